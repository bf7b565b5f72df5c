//! Issue 5: the proxy tier, with real processes on loopback. `lockctl dev --proxies N`
//! starts 3 replica processes and N proxy processes (`lockctl proxy`, the same code as the
//! `proxy` binary); clients use the SDK in this process unless noted.
//!
//! Scale knobs: `PROXY_SESSIONS` (default 2000) and `PROXY_SOAK_SECS` (default 60) for the
//! KeepAlive batching run, `PROXY_WATCHERS` (default 1000) for the watch fan-out.
//!
//! One test binary, its tests in modules by concern: [`scenarios`] (issue 5's five),
//! [`limits`] (bad input and limits at a proxy), [`invalidations`] (a cache behind a
//! proxy that is frozen, deaf or fails over), and [`links`] (a proxy or client whose link
//! to the leader stalls, through a pausable UDP relay, and a proxy restarted).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use client_sdk::{Client, ClientConfig, CreateMode, Error, Lock, Session, SessionState};
use wire::types::{Op, ProxyStatus, Reply, Request, Status};

#[path = "../common/mod.rs"]
mod common;
use common::*;

mod acls;
mod invalidations;
mod limits;
mod links;
mod ownership;
mod scenarios;

/// A client of `endpoints` with a certificate for `lock://client/<name>` from the cell's
/// own CA.
async fn client_as(cell: &Cell, name: &str, endpoints: &[String]) -> Client {
    let ca = wire::tls::Ca::from_pem(
        &std::fs::read_to_string(cell.ca()).unwrap(),
        &std::fs::read_to_string(cell.data.join("tls").join(wire::tls::CA_KEY_FILE)).unwrap(),
    )
    .unwrap();
    let uri = format!("lock://client/{name}");
    let c = ca
        .issue(&wire::identity::Identity::parse(&uri).unwrap(), 1)
        .unwrap();
    let dir = cell.data.join(format!("client-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = ClientConfig::new(endpoints.to_vec(), cell.ca());
    (cfg.cert, cfg.key) = (dir.join("c.pem"), dir.join("c.key"));
    std::fs::write(&cfg.cert, c.cert_pem).unwrap();
    std::fs::write(&cfg.key, c.key_pem).unwrap();
    Client::connect(cfg).await.unwrap()
}

struct Cell {
    _dir: tempfile::TempDir,
    data: PathBuf,
    replicas: Vec<String>,
    proxies: Vec<String>,
    dev: DevGuard,
}

impl Cell {
    fn start(proxies: u16) -> Cell {
        Cell::start_with(proxies, &[])
    }

    /// [`Cell::start`] with more `lockctl dev` arguments.
    fn start_with(proxies: u16, extra: &[&str]) -> Cell {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("cell");
        let base = free_base(3);
        let pbase = free_base_from(base + 3, proxies.max(1));
        let (proxies_arg, pbase_arg) = (proxies.to_string(), pbase.to_string());
        let mut args = vec![
            "--no-demo",
            "--proxies",
            &proxies_arg,
            "--proxy-base-port",
            &pbase_arg,
        ];
        args.extend_from_slice(extra);
        let (dev, _) = start_dev(&data, base, &args);
        Cell {
            _dir: dir,
            data,
            replicas: (0..3).map(|i| format!("127.0.0.1:{}", base + i)).collect(),
            proxies: (0..proxies)
                .map(|i| format!("127.0.0.1:{}", pbase + i))
                .collect(),
            dev: DevGuard(Some(dev)),
        }
    }

    fn ca(&self) -> PathBuf {
        self.data.join("tls/ca.pem")
    }

    async fn client(&self, endpoints: &[String]) -> Client {
        Client::connect(ClientConfig::new(endpoints.to_vec(), self.ca()))
            .await
            .unwrap()
    }

    /// The first proxy's log and the three replicas' (for a failure's message).
    fn logs(&self) -> String {
        let log = |name: &str| std::fs::read_to_string(self.data.join(name)).unwrap_or_default();
        format!(
            "proxy log:\n{}\nreplica logs:\n{}\n{}\n{}",
            log("proxy-1.log"),
            log("replica-1.log"),
            log("replica-2.log"),
            log("replica-3.log")
        )
    }

    fn stop(mut self) {
        let _ = stop_dev(self.dev.0.take().unwrap());
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The leader's status, asked of every replica in turn.
async fn leader_status(c: &Client) -> Status {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for a in c.endpoints() {
            if let Ok(s) = c.status_of(a).await {
                if s.role == "Leader" {
                    return s;
                }
            }
        }
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn proxy_status(c: &Client, addr: &str) -> ProxyStatus {
    let req = Request {
        session: 0,
        request_id: 0,
        ack_below: 0,
        op: Op::ProxyStatus,
    };
    match c.call_at(addr.parse().unwrap(), &req).await.unwrap() {
        Reply::ProxyStatus(s) => s,
        other => panic!("unexpected {other:?}"),
    }
}

/// Opens `n` sessions through `clients` (round robin), `wave` at a time.
async fn open_sessions(clients: &[Client], n: usize, wave: usize) -> Vec<Session> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let k = wave.min(n - out.len());
        let base = out.len();
        let opened = futures::future::join_all(
            (0..k).map(|i| clients[(base + i) % clients.len()].open_session()),
        )
        .await;
        for s in opened {
            out.push(s.expect("open session through the proxy"));
        }
    }
    out
}

/// A raw request as `session` (no SDK), for the tests that speak the wire themselves.
fn raw(session: u64, op: Op) -> Request {
    Request {
        session,
        request_id: 0,
        ack_below: 0,
        op,
    }
}

/// Reads `path` twice through the proxy at `paddr` as the raw `session` (a `CachedGet`,
/// no SDK): both answers must be cachable, so the proxy caches the node and holds the
/// session as its cacher.
async fn cache_through_proxy(
    via: &Client,
    paddr: std::net::SocketAddr,
    session: u64,
    path: &str,
) -> Result<(), String> {
    for _ in 0..2 {
        let r = via
            .call_at(paddr, &raw(session, Op::CachedGet { path: path.into() }))
            .await
            .unwrap();
        if !matches!(r, Reply::CachedData { cachable: true, .. }) {
            return Err(format!("not cached through the proxy: {r:?}"));
        }
    }
    Ok(())
}

/// Waits (up to 30 s) until the proxy at `paddr` opens sessions; returns the first.
async fn first_proxied_session(via: &Client, paddr: std::net::SocketAddr) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match via.call_at(paddr, &raw(0, Op::CreateSession)).await {
            Ok(Reply::SessionCreated { session, .. }) => return session,
            other => {
                assert!(Instant::now() < deadline, "proxy not serving: {other:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// A child process killed when the test ends, even by a panic.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
