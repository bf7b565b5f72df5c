//! Connections, leader discovery and retries.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use wire::hello::{Hello, HelloReply, ALPN_CLIENT};
use wire::types::{Op, Reply, Request, Response, SessionId, Status};
use wire::{frame, tls, Error, CLIENT_FRAME_BYTES_MAX};

/// How to reach a cell.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Replica and/or proxy addresses, `host:port` (a proxy speaks the same protocol; the
    /// client moves to the next endpoint when one fails).
    pub endpoints: Vec<String>,
    /// The cell's CA certificate (PEM).
    pub ca: PathBuf,
    /// How long one operation may take, retries included, before it fails with
    /// [`Error::Timeout`] (default 15 s).
    pub request_timeout: Duration,
    /// How long one attempt waits for an answer (default 6 s, above the replicas' own
    /// 5 s commit timeout).
    pub attempt_timeout: Duration,
    /// How long a connection attempt (QUIC handshake and hello) may take (default 1 s): a
    /// dead replica is skipped quickly instead of holding up the request.
    pub connect_timeout: Duration,
    /// How long a session in jeopardy keeps trying to reach the cell before it gives up
    /// and reports itself expired (Chubby's grace period; default 45 s).
    pub grace_period: Duration,
    /// Most values one session caches (default 10 000).
    pub cache_entries_max: usize,
    /// Most bytes of data one session caches (default 64 MiB).
    pub cache_bytes_max: usize,
    /// Agent string sent in the hello.
    pub agent: String,
}

/// The endpoints of a local `lockctl dev` cell.
pub const DEV_ENDPOINTS: &str =
    "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103,127.0.0.1:7104,127.0.0.1:7105";

impl ClientConfig {
    /// From the environment shared with `lockctl`: `LOCKCTL_ENDPOINTS` (comma-separated,
    /// default: the local dev cell) and `LOCKCTL_CA` (default `cell-data/tls/ca.pem`).
    pub fn from_env() -> ClientConfig {
        let endpoints = std::env::var("LOCKCTL_ENDPOINTS").unwrap_or_else(|_| DEV_ENDPOINTS.into());
        let ca = std::env::var("LOCKCTL_CA").unwrap_or_else(|_| "cell-data/tls/ca.pem".into());
        ClientConfig::new(
            endpoints
                .split(',')
                .map(|e| e.trim().to_string())
                .filter(|e| !e.is_empty())
                .collect(),
            ca.into(),
        )
    }

    /// Defaults for the given endpoints and CA file.
    pub fn new(endpoints: Vec<String>, ca: PathBuf) -> ClientConfig {
        ClientConfig {
            endpoints,
            ca,
            request_timeout: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(6),
            connect_timeout: Duration::from_secs(1),
            grace_period: crate::session::GRACE_PERIOD,
            cache_entries_max: 10_000,
            cache_bytes_max: 64 * 1024 * 1024,
            agent: format!("client-sdk {}", env!("CARGO_PKG_VERSION")),
        }
    }
}

struct Inner {
    cfg: ClientConfig,
    endpoint: quinn::Endpoint,
    addrs: Vec<SocketAddr>,
    /// One slot per endpoint: handshakes to different endpoints proceed in parallel, and
    /// callers of one endpoint share its connection (or its recent failure).
    conns: std::sync::Mutex<HashMap<SocketAddr, Arc<Mutex<Slot>>>>,
    leader: std::sync::Mutex<Option<SocketAddr>>,
}

/// An endpoint's connection, or its last failed attempt.
#[derive(Default)]
struct Slot {
    conn: Option<quinn::Connection>,
    failed: Option<(Instant, Error)>,
}

/// A handle to a cell; cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

fn conn_err(e: impl std::fmt::Display) -> Error {
    Error::Connection {
        reason: e.to_string(),
    }
}

impl Client {
    /// Prepares connections to the cell. Fails if no endpoint parses or the CA cannot be
    /// read; replicas are dialed lazily.
    pub async fn connect(cfg: ClientConfig) -> Result<Client, Error> {
        let mut addrs = Vec::new();
        for e in &cfg.endpoints {
            let a: SocketAddr = tokio::net::lookup_host(e)
                .await
                .map_err(|err| Error::BadRequest {
                    reason: format!("endpoint {e:?}: {err}"),
                })?
                .next()
                .ok_or_else(|| Error::BadRequest {
                    reason: format!("endpoint {e:?} resolves to nothing"),
                })?;
            addrs.push(a);
        }
        if addrs.is_empty() {
            return Err(Error::BadRequest {
                reason: "no endpoints".into(),
            });
        }
        let tls = tls::client_config(&cfg.ca, ALPN_CLIENT)
            .map_err(|reason| Error::BadRequest { reason })?;
        let bind: SocketAddr = if addrs[0].is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .expect("addr");
        let endpoint = wire::quic::client_endpoint(tls, bind).map_err(conn_err)?;
        Ok(Client {
            inner: Arc::new(Inner {
                cfg,
                endpoint,
                addrs,
                conns: std::sync::Mutex::new(HashMap::new()),
                leader: std::sync::Mutex::new(None),
            }),
        })
    }

    /// The configured endpoints.
    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.inner.addrs
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    async fn connection(&self, addr: SocketAddr) -> Result<quinn::Connection, Error> {
        let slot = self
            .inner
            .conns
            .lock()
            .expect("connections lock")
            .entry(addr)
            .or_default()
            .clone();
        let mut slot = slot.lock().await;
        if let Some(c) = &slot.conn {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        // A dead endpoint is tried once per connect timeout, not once per caller: the
        // others move on to the next endpoint at once.
        if let Some((at, e)) = &slot.failed {
            if at.elapsed() < self.inner.cfg.connect_timeout {
                return Err(e.clone());
            }
        }
        let handshake = async {
            let conn = self
                .inner
                .endpoint
                .connect(addr, tls::SERVER_NAME)
                .map_err(conn_err)?
                .await
                .map_err(|e| conn_err(format!("{addr}: {e}")))?;
            let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
            frame::write(&mut send, &Hello::new(self.inner.cfg.agent.clone()), 4096).await?;
            let _ = send.finish();
            let reply: HelloReply = frame::read(&mut recv, 4096).await?;
            reply?;
            Ok::<_, Error>(conn)
        };
        let r = tokio::time::timeout(self.inner.cfg.connect_timeout, handshake)
            .await
            .unwrap_or_else(|_| {
                Err(conn_err(format!(
                    "{addr}: no handshake within {:?}",
                    self.inner.cfg.connect_timeout
                )))
            });
        match r {
            Ok(conn) => {
                slot.conn = Some(conn.clone());
                slot.failed = None;
                Ok(conn)
            }
            Err(e) => {
                slot.conn = None;
                slot.failed = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Forgets `addr` as the leader after it failed at the connection level, so the next
    /// attempts start with the other endpoints rather than a dead one.
    fn connection_failed(&self, addr: SocketAddr) {
        let mut l = self.inner.leader.lock().expect("leader lock");
        if *l == Some(addr) {
            *l = None;
        }
    }

    /// One attempt at one replica: no retry, no redirect.
    pub async fn call_at(&self, addr: SocketAddr, req: &Request) -> Response {
        let attempt = async {
            let conn = self.connection(addr).await?;
            let work = async {
                let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
                frame::write(&mut send, req, CLIENT_FRAME_BYTES_MAX).await?;
                let _ = send.finish();
                frame::read::<_, Response>(&mut recv, CLIENT_FRAME_BYTES_MAX).await?
            };
            // A KeepAlive may wait at a proxy for its next batch: it does not probe (any
            // other request on the same connection does, for all of them).
            let probe = async {
                if matches!(req.op, Op::KeepAlive) {
                    std::future::pending::<()>().await;
                }
                presumed_dead(&conn).await
            };
            tokio::select! {
                r = work => r,
                _ = probe => {
                    // Every request waiting on it fails now and is retried elsewhere (with
                    // its request id), instead of waiting for QUIC's idle timeout.
                    conn.close(0u32.into(), b"peer silent");
                    Err(conn_err(format!("{addr}: no answer to a probe; presumed dead")))
                }
            }
        };
        let t = self.inner.cfg.attempt_timeout;
        match tokio::time::timeout(t, attempt).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: format!("answer from {addr}"),
                after_ms: t.as_millis() as u64,
            }),
        }
    }

    fn candidates(&self) -> Vec<SocketAddr> {
        let mut v = Vec::with_capacity(self.inner.addrs.len() + 1);
        if let Some(l) = *self.inner.leader.lock().expect("leader lock") {
            v.push(l);
        }
        for a in &self.inner.addrs {
            if !v.contains(a) {
                v.push(*a);
            }
        }
        v
    }

    /// Sends `req` to the leader, following `NotLeader` hints and retrying errors that
    /// leave the outcome unknown (with the same request id) until
    /// [`ClientConfig::request_timeout`] runs out.
    pub async fn call(&self, req: Request) -> Result<Reply, Error> {
        self.call_until(req, Instant::now() + self.inner.cfg.request_timeout)
            .await
    }

    /// Like [`Client::call`] with an explicit deadline.
    pub async fn call_until(&self, req: Request, deadline: Instant) -> Result<Reply, Error> {
        let mut last_err = None;
        let mut attempt = 0u32;
        let started = Instant::now();
        while Instant::now() < deadline {
            let mut redirected = false;
            for addr in self.candidates() {
                if Instant::now() >= deadline {
                    break;
                }
                match self.call_at(addr, &req).await {
                    Ok(r) => {
                        *self.inner.leader.lock().expect("leader lock") = Some(addr);
                        return Ok(r);
                    }
                    Err(Error::NotLeader {
                        leader_addr: Some(hint),
                        leader_id,
                    }) => {
                        if let Ok(h) = hint.parse::<SocketAddr>() {
                            let mut l = self.inner.leader.lock().expect("leader lock");
                            if *l != Some(h) {
                                *l = Some(h);
                                redirected = true;
                            }
                        }
                        last_err = Some(Error::NotLeader {
                            leader_addr: Some(hint),
                            leader_id,
                        });
                        if redirected {
                            break;
                        }
                    }
                    Err(e) if e.is_retryable() => {
                        if matches!(e, Error::Connection { .. } | Error::Timeout { .. }) {
                            self.connection_failed(addr);
                        }
                        last_err = Some(e)
                    }
                    Err(e) => return Err(e),
                }
            }
            if !redirected {
                attempt += 1;
                let backoff = Duration::from_millis((50 * u64::from(attempt)).min(500));
                let left = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(backoff.min(left)).await;
            }
        }
        Err(match last_err {
            Some(e @ Error::Unavailable { .. }) => e,
            Some(e) => Error::Timeout {
                what: format!("request {:?} (last error: {e})", req.op.name()),
                after_ms: started.elapsed().as_millis() as u64,
            },
            None => Error::Timeout {
                what: "request".into(),
                after_ms: started.elapsed().as_millis() as u64,
            },
        })
    }

    /// Opens a streaming request (the session's event stream) at the leader: returns the
    /// first answer, the stream carrying the later frames, and the replica that serves it.
    pub async fn open_stream(
        &self,
        req: Request,
        deadline: Instant,
    ) -> Result<(Reply, quinn::RecvStream, SocketAddr), Error> {
        let mut last_err = Error::Timeout {
            what: "event stream".into(),
            after_ms: 0,
        };
        while Instant::now() < deadline {
            let mut redirected = false;
            for addr in self.candidates() {
                let attempt = async {
                    let conn = self.connection(addr).await?;
                    let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
                    frame::write(&mut send, &req, CLIENT_FRAME_BYTES_MAX).await?;
                    let _ = send.finish();
                    let first: Response = frame::read(&mut recv, CLIENT_FRAME_BYTES_MAX).await?;
                    Ok::<_, Error>((first?, recv))
                };
                let t = self.inner.cfg.attempt_timeout;
                let r = match tokio::time::timeout(t, attempt).await {
                    Ok(r) => r,
                    Err(_) => Err(Error::Timeout {
                        what: format!("stream at {addr}"),
                        after_ms: t.as_millis() as u64,
                    }),
                };
                match r {
                    Ok((reply, recv)) => {
                        *self.inner.leader.lock().expect("leader lock") = Some(addr);
                        return Ok((reply, recv, addr));
                    }
                    Err(Error::NotLeader {
                        leader_addr: Some(hint),
                        leader_id,
                    }) => {
                        if let Ok(h) = hint.parse::<SocketAddr>() {
                            let mut l = self.inner.leader.lock().expect("leader lock");
                            if *l != Some(h) {
                                *l = Some(h);
                                redirected = true;
                            }
                        }
                        last_err = Error::NotLeader {
                            leader_addr: Some(hint),
                            leader_id,
                        };
                        if redirected {
                            break;
                        }
                    }
                    Err(e) if e.is_retryable() => {
                        if matches!(e, Error::Connection { .. } | Error::Timeout { .. }) {
                            self.connection_failed(addr);
                        }
                        last_err = e
                    }
                    Err(e) => return Err(e),
                }
            }
            if !redirected {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Err(last_err)
    }

    /// The leader this client last reached, if any.
    pub fn leader_hint(&self) -> Option<SocketAddr> {
        *self.inner.leader.lock().expect("leader lock")
    }

    /// A session-less request to the leader.
    pub async fn request(&self, op: Op) -> Result<Reply, Error> {
        self.call(Request {
            session: 0 as SessionId,
            request_id: 0,
            ack_below: 0,
            op,
        })
        .await
    }

    /// Opens a session and starts its KeepAlives.
    pub async fn open_session(&self) -> Result<crate::Session, Error> {
        crate::Session::open(self.clone()).await
    }

    /// The status of one replica.
    pub async fn status_of(&self, addr: SocketAddr) -> Result<Status, Error> {
        match self
            .call_at(
                addr,
                &Request {
                    session: 0,
                    request_id: 0,
                    ack_below: 0,
                    op: Op::Status,
                },
            )
            .await?
        {
            Reply::Status(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a node (linearizable, at the leader).
    pub async fn get(&self, path: &str) -> Result<(Vec<u8>, wire::types::NodeStat), Error> {
        wire::path::validate(path)?;
        match self
            .request(Op::Get {
                path: path.into(),
                watch: false,
            })
            .await?
        {
            Reply::Data { data, stat, .. } => Ok((data, stat)),
            other => Err(unexpected(&other)),
        }
    }

    /// A node's metadata, if it exists (linearizable).
    pub async fn exists(&self, path: &str) -> Result<Option<wire::types::NodeStat>, Error> {
        wire::path::validate(path)?;
        match self
            .request(Op::Exists {
                path: path.into(),
                watch: false,
            })
            .await?
        {
            Reply::Exists { stat, .. } => Ok(stat),
            other => Err(unexpected(&other)),
        }
    }

    /// A node's children with their metadata, in name order (linearizable).
    pub async fn children(
        &self,
        path: &str,
    ) -> Result<Vec<(String, wire::types::NodeStat)>, Error> {
        wire::path::validate(path)?;
        match self
            .request(Op::Children {
                path: path.into(),
                watch: false,
            })
            .await?
        {
            Reply::Children { children, .. } => Ok(children),
            other => Err(unexpected(&other)),
        }
    }
}

/// A request waiting this long makes the client probe its connection.
const PROBE_AFTER: Duration = Duration::from_secs(1);
/// A probe unanswered for this long marks the connection dead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Completes only if `conn`'s peer looks dead: while a request waits (a held write may
/// legitimately take seconds), a cheap probe is sent every second on the same connection;
/// one that gets no answer within a second means the peer is gone (killed or frozen), which
/// QUIC alone would notice only at its idle timeout. The probe is `ProxyStatus`: a proxy
/// answers it itself, a replica refuses it at once; either answer proves the peer alive.
async fn presumed_dead(conn: &quinn::Connection) {
    tokio::time::sleep(PROBE_AFTER).await;
    loop {
        let probe = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
            let req = Request {
                session: 0,
                request_id: 0,
                ack_below: 0,
                op: Op::ProxyStatus,
            };
            frame::write(&mut send, &req, CLIENT_FRAME_BYTES_MAX).await?;
            let _ = send.finish();
            frame::read::<_, Response>(&mut recv, CLIENT_FRAME_BYTES_MAX).await
        };
        match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
            Ok(Ok(_)) => tokio::time::sleep(PROBE_AFTER).await,
            _ => return,
        }
    }
}

pub(crate) fn unexpected(r: &Reply) -> Error {
    Error::Internal {
        reason: format!("unexpected reply {r:?}"),
    }
}
