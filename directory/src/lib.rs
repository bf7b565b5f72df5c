//! # directory: the map from prefixes to cells
//!
//! The authoritative map lives in a small **root cell** of our own service, as nodes
//! (`wire::directory::ROOT_CELLS`, `ROOT_PREFIXES`; `lockctl dir set|rm|move` write
//! them). A directory instance is a stateless server of a copy of it: it reads the map as
//! a client of the root cell (its certificate, `lock://directory/<name>`, is a client
//! there), keeps it current with watches on the two folders and on every entry, and
//! answers `Op::Directory` over QUIC with the same mutual TLS as every hop. Instances
//! share nothing: run, restart and scale them independently; each serves the same map
//! once it has read it. With the root cell unreachable an instance goes on serving the
//! last map it read; one that never read a map answers `Unavailable`. See
//! `docs/directory.md`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, ClientConfig, Session};
use wire::directory::{decode, CellInfo, DirectoryMap, PrefixEntry, ROOT_CELLS, ROOT_PREFIXES};
use wire::hello::{HelloOk, HelloReply, ALPN_CLIENT};
use wire::types::{Op, Request, Response, SessionId};
use wire::{Error, CLIENT_FRAME_BYTES_MAX};

/// A directory instance's settings.
#[derive(Debug, Clone)]
pub struct DirectoryConfig {
    /// Where it listens (UDP, QUIC).
    pub listen: SocketAddr,
    /// The root cell's endpoints (replicas or proxies).
    pub root: Vec<String>,
    /// Its TLS files: a `lock://directory/<name>` certificate, presented to its clients
    /// and to the root cell, and the CA both trust.
    pub tls: wire::tls::TlsConfig,
    /// How often the map is read again even without a watch firing (a safety net).
    pub refresh: Duration,
    /// Where `/metrics`, `/health` and `/ready` are served over HTTP (None: not served).
    pub metrics_listen: Option<SocketAddr>,
}

/// What the instance serves: the last map read, if any.
#[derive(Default)]
pub struct Served {
    map: RwLock<Option<DirectoryMap>>,
    /// When the map was last read whole from the root cell.
    read_at: RwLock<Option<Instant>>,
    /// Whole reads of the map that succeeded, and that failed.
    reads: AtomicU64,
    read_failures: AtomicU64,
    /// Directory requests answered with a map.
    answered: AtomicU64,
}

impl Served {
    /// The map served now.
    pub fn map(&self) -> Option<DirectoryMap> {
        self.map.read().expect("map lock").clone()
    }
}

/// Reads the whole map from the root cell under `session`, arming watches on both
/// folders and every entry; returns it with a future that completes when any of them
/// fires. A missing folder reads as empty (and is watched for its creation).
pub async fn read_map(
    session: &Session,
) -> Result<(DirectoryMap, futures::future::BoxFuture<'static, ()>), Error> {
    let mut watches: Vec<futures::future::BoxFuture<'static, ()>> = Vec::new();
    let mut map = DirectoryMap::default();
    for folder in [ROOT_CELLS, ROOT_PREFIXES] {
        let children = match session.children_watch(folder).await {
            Ok((children, w)) => {
                watches.push(Box::pin(async move {
                    let _ = w.await;
                }));
                children
            }
            Err(Error::NoNode { .. }) => {
                let (_, w) = session.exists_watch(folder).await?;
                watches.push(Box::pin(async move {
                    let _ = w.await;
                }));
                continue;
            }
            Err(e) => return Err(e),
        };
        for (name, _) in children {
            let path = format!("{folder}/{name}");
            let (data, stat, w) = match session.get_watch(&path).await {
                Ok(r) => r,
                // Removed since the listing: the folder's watch has fired already.
                Err(Error::NoNode { .. }) => continue,
                Err(e) => return Err(e),
            };
            watches.push(Box::pin(async move {
                let _ = w.await;
            }));
            add(&mut map, folder, &path, &data, stat.mod_index);
        }
    }
    map.cells.sort_by(|a, b| a.name.cmp(&b.name));
    map.prefixes.sort_by(|a, b| a.prefix.cmp(&b.prefix));
    let any = Box::pin(async move {
        let _ = futures::future::select_all(watches).await;
    });
    Ok((map, any))
}

/// Adds the entry at `path` (in `folder`) to `map`. An entry that does not decode
/// (written by hand, or by a newer build) is left out and logged; the rest of the map is
/// served.
fn add(map: &mut DirectoryMap, folder: &str, path: &str, data: &[u8], mod_index: u64) {
    map.index = map.index.max(mod_index);
    let decoded = if folder == ROOT_CELLS {
        decode::<CellInfo>(data, path).map(|c| map.cells.push(c))
    } else {
        decode::<PrefixEntry>(data, path).map(|p| map.prefixes.push(p))
    };
    if let Err(e) = decoded {
        tracing::warn!("left out of the map: {e}");
    }
}

/// [`read_map`] without watches.
async fn read_plain(session: &Session) -> Result<DirectoryMap, Error> {
    let mut map = DirectoryMap::default();
    for folder in [ROOT_CELLS, ROOT_PREFIXES] {
        let children = match session.children(folder).await {
            Ok(c) => c,
            Err(Error::NoNode { .. }) => continue,
            Err(e) => return Err(e),
        };
        for (name, _) in children {
            let path = format!("{folder}/{name}");
            let (data, stat) = match session.get(&path).await {
                Ok(r) => r,
                Err(Error::NoNode { .. }) => continue,
                Err(e) => return Err(e),
            };
            add(&mut map, folder, &path, &data, stat.mod_index);
        }
    }
    map.cells.sort_by(|a, b| a.name.cmp(&b.name));
    map.prefixes.sort_by(|a, b| a.prefix.cmp(&b.prefix));
    Ok(map)
}

fn publish(served: &Served, map: DirectoryMap) {
    served.reads.fetch_add(1, Ordering::Relaxed);
    *served.read_at.write().expect("read_at lock") = Some(Instant::now());
    if served.map().as_ref() != Some(&map) {
        tracing::info!(
            cells = map.cells.len(),
            prefixes = map.prefixes.len(),
            index = map.index,
            "serving a new map"
        );
        *served.map.write().expect("map lock") = Some(map);
    }
}

/// Keeps `served` current: a session at the root cell, the map read again whenever a
/// watch fires (or every `refresh`), a new session when one ends. Errors are logged and
/// retried after a second; the last map stays served meanwhile.
async fn follow(client: Client, served: Arc<Served>, refresh: Duration) {
    let mut session: Option<Session> = None;
    loop {
        let s = match &session {
            Some(s) if s.state() != client_sdk::SessionState::Expired => s.clone(),
            _ => match client.open_session().await {
                Ok(s) => {
                    session = Some(s.clone());
                    s
                }
                Err(e) => {
                    tracing::warn!("root cell: cannot open a session: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
        };
        match read_map(&s).await {
            Ok((map, mut changed)) => {
                publish(&served, map);
                // Until a watch fires: the watches armed stay armed (arming them again on
                // a timer would pile up waiters in the session for nodes that never
                // change); the timer only reads the map again, unwatched.
                loop {
                    tokio::select! {
                        _ = &mut changed => break,
                        _ = s.expired() => break,
                        _ = tokio::time::sleep(refresh) => {
                            match read_plain(&s).await {
                                Ok(m) => publish(&served, m),
                                Err(_) => {
                                    served.read_failures.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                }
            }
            Err(e) => {
                served.read_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("root cell: cannot read the map: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// One directory instance.
struct Instance {
    served: Arc<Served>,
    tls_files: Arc<wire::tls::Reloading>,
}

impl wire::serve::Handler for Instance {
    type Connection = ();
    type Held = ();

    fn hello(
        &self,
        _: &wire::serve::Caller,
        hello: Result<wire::hello::Hello, Error>,
    ) -> ((), (), HelloReply) {
        let reply = hello.and_then(|h| {
            h.check().map(|_| HelloOk {
                protocol_version: wire::PROTOCOL_VERSION,
                replica_id: 0,
                proxy: false,
                store: None,
            })
        });
        ((), (), reply)
    }

    async fn request(&self, _: &(), _: &wire::serve::Caller, req: Request, _: Instant) -> Response {
        match req.op {
            Op::Directory => match self.served.map() {
                Some(map) => {
                    self.served.answered.fetch_add(1, Ordering::Relaxed);
                    Ok(wire::types::Reply::Directory(map))
                }
                None => Err(Error::Unavailable {
                    reason: "this directory instance has not read the map from the root cell yet"
                        .into(),
                }),
            },
            other => Err(Error::BadRequest {
                reason: format!(
                    "a directory instance answers Directory only, not {}",
                    other.name()
                ),
            }),
        }
    }

    async fn events(
        &self,
        _: &(),
        _: &wire::serve::Caller,
        _: SessionId,
        _: quinn::SendStream,
        _: quinn::Connection,
    ) {
        // No sessions here: the stream is closed at once.
    }
}

/// Runs a directory instance until `shutdown` completes.
pub async fn run(cfg: DirectoryConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    run_on(cfg, wire::quic::Sockets::Os, shutdown).await
}

/// [`run`] on `sockets` (the fault suite's simulation gives simulated ones), which serve
/// both its listener and its client of the root cell.
pub async fn run_on(
    cfg: DirectoryConfig,
    sockets: wire::quic::Sockets,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    if cfg.root.is_empty() {
        anyhow::bail!("no root cell endpoints (--root)");
    }
    let (tls, me, tls_files) = wire::tls::server_config_reloading(&cfg.tls, &[ALPN_CLIENT])
        .map_err(|e| anyhow::anyhow!("the directory's TLS files: {e}"))?;
    if !matches!(me, wire::identity::Identity::Directory { .. }) {
        anyhow::bail!(
            "the certificate in {} is {me}, a {}'s; a directory instance needs one for \
             lock://directory/<name> (lockctl certs issue --role directory)",
            cfg.tls.cert.display(),
            me.role()
        );
    }
    let endpoint = wire::quic::server_endpoint_on(&sockets, cfg.listen, tls, None, None)
        .map_err(anyhow::Error::msg)?;
    let mut ccfg = ClientConfig::new(cfg.root.clone(), cfg.tls.ca.clone());
    ccfg.cert = cfg.tls.cert.clone();
    ccfg.key = cfg.tls.key.clone();
    ccfg.crls = cfg.tls.crls.clone();
    ccfg.agent = format!("directory {} at {}", env!("CARGO_PKG_VERSION"), cfg.listen);
    ccfg.sockets = sockets;
    let client = Client::connect(ccfg)
        .await
        .map_err(|e| anyhow::anyhow!("root cell client: {e}"))?;
    let served = Arc::new(Served::default());
    let instance = Arc::new(Instance {
        served: served.clone(),
        tls_files,
    });
    let mut tasks = vec![
        wire::rt::spawn(follow(client, served.clone(), cfg.refresh)),
        wire::rt::spawn(serve(endpoint.clone(), instance)),
    ];
    if let Some(addr) = cfg.metrics_listen {
        let listener = wire::metrics::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("the directory: {e}"))?;
        tracing::info!(%addr, "metrics, /health and /ready served");
        let probe = DirectoryProbe {
            served,
            cert: cfg.tls.cert.clone(),
        };
        tasks.push(wire::rt::spawn(wire::metrics::serve(
            listener,
            Arc::new(probe),
        )));
    }
    tracing::info!(identity = %me, listen = %cfg.listen, root = ?cfg.root, "directory serving");
    shutdown.await;
    endpoint.close(0u32.into(), b"directory shutting down");
    for t in tasks {
        t.abort();
    }
    endpoint.wait_idle().await;
    Ok(())
}

async fn serve(endpoint: quinn::Endpoint, instance: Arc<Instance>) {
    let gate = wire::quic::ConnectionGate::new(wire::quic::ConnectionLimits {
        connections_max: 20_000,
        connections_per_source_max: 1_000,
    });
    while let Some(incoming) = endpoint.accept().await {
        let Some(admitted) = gate.admit(incoming.remote_address()) else {
            incoming.refuse();
            continue;
        };
        let instance = instance.clone();
        wire::rt::spawn(async move {
            let _admitted = admitted;
            let Ok(conn) = incoming.await else { return };
            let listener = wire::identity::Listener::Directory;
            let Ok(who) = wire::identity::check_accepted(&conn, listener, false) else {
                return;
            };
            instance.tls_files.guard(conn.clone());
            wire::quic::grant_streams(&conn);
            wire::serve::serve(conn, who, instance, CLIENT_FRAME_BYTES_MAX * 4).await;
        });
    }
}

/// Runs a directory instance on its own runtime until SIGINT or SIGTERM.
pub fn run_until_signal(cfg: DirectoryConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move { run(cfg, wire::rt::shutdown_signal()).await })
}

/// The directory's Prometheus metrics, `/health` and `/ready` (ready once it holds a
/// map; names in `docs/operations.md`, "Metrics and alerts").
struct DirectoryProbe {
    served: Arc<Served>,
    cert: std::path::PathBuf,
}

impl wire::metrics::Probe for DirectoryProbe {
    fn metrics(&self) -> wire::metrics::BoxFuture<'_, wire::metrics::Scrape> {
        use wire::metrics::prometheus_client::registry::Unit;
        Box::pin(async move {
            let mut s = wire::metrics::Scrape::new();
            let map = self.served.map();
            s.gauge(
                "directory_map_held",
                "1 once this instance holds a map to serve.",
                f64::from(u8::from(map.is_some())),
            );
            let (cells, prefixes, index) =
                map.map_or((0, 0, 0), |m| (m.cells.len(), m.prefixes.len(), m.index));
            s.gauge(
                "directory_map_cells",
                "Cells in the map served.",
                cells as f64,
            );
            s.gauge(
                "directory_map_prefixes",
                "Prefixes in the map served.",
                prefixes as f64,
            );
            s.gauge(
                "directory_map_index",
                "The root cell's log index of the newest entry in the map served.",
                index as f64,
            );
            let age = self
                .served
                .read_at
                .read()
                .expect("read_at lock")
                .map_or(0.0, |t| t.elapsed().as_secs_f64());
            s.gauge_in(
                "directory_map_age",
                "Time since the map was last read whole from the root cell (0 before).",
                Unit::Seconds,
                age,
            );
            s.counter(
                "directory_map_reads",
                "Whole reads of the map from the root cell.",
                self.served.reads.load(Ordering::Relaxed),
            );
            s.counter(
                "directory_map_read_failures",
                "Reads of the map from the root cell that failed (retried after a second).",
                self.served.read_failures.load(Ordering::Relaxed),
            );
            s.counter(
                "directory_requests_answered",
                "Directory requests answered with a map.",
                self.served.answered.load(Ordering::Relaxed),
            );
            s.certificate_expiry(&self.cert);
            s
        })
    }

    fn ready(&self) -> wire::metrics::BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            match self.served.map() {
                Some(m) => Ok(format!(
                    "serving a map of {} cells and {} prefixes",
                    m.cells.len(),
                    m.prefixes.len()
                )),
                None => Err("no map read from the root cell yet".into()),
            }
        })
    }
}
