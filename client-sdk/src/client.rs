//! Connections, leader discovery and retries.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use wire::hash::HashMap;

use tokio::sync::Mutex;
use wire::hello::{Hello, HelloReply, ALPN_CLIENT};
use wire::types::{Op, ProxyStatus, Reply, Request, Response, SessionId, Status};
use wire::{frame, tls, Error, CLIENT_FRAME_BYTES_MAX};

/// The default grace period: how long a session in jeopardy keeps trying before it gives
/// up (see [`ClientConfig::grace_period`]).
pub const GRACE_PERIOD: Duration = Duration::from_secs(45);

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
    /// Most sessions this client holds open at once (default and upper bound
    /// [`SESSIONS_PER_CLIENT_MAX`]); opening one more fails with
    /// [`Error::TooManySessions`].
    pub sessions_max: usize,
    /// The UDP sockets the client's QUIC endpoint runs on (default: the operating
    /// system's; the fault suite's simulation passes simulated ones).
    pub sockets: wire::quic::Sockets,
}

/// Most sessions one client holds open: each keeps an event stream open on the client's
/// connection, which has [`wire::quic::STREAMS_MAX`] (4 096) streams in all, and the rest
/// (1 024) stay free for requests. With every stream taken by event streams no request
/// could be sent, not even the sessions' KeepAlives, and they would all expire.
pub const SESSIONS_PER_CLIENT_MAX: usize = wire::quic::STREAMS_MAX as usize - 1_024;

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
            grace_period: GRACE_PERIOD,
            cache_entries_max: 10_000,
            cache_bytes_max: 64 * 1024 * 1024,
            agent: format!("client-sdk {}", env!("CARGO_PKG_VERSION")),
            sessions_max: SESSIONS_PER_CLIENT_MAX,
            sockets: wire::quic::Sockets::Os,
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
    leader: LeaderHint,
    /// Endpoints that said in their handshake that they are proxies.
    proxies: std::sync::Mutex<wire::hash::HashSet<SocketAddr>>,
    /// KeepAlives waiting to be sent (see [`Client::keepalive`]).
    keepalives: tokio::sync::mpsc::UnboundedSender<KeepAliveWaiter>,
    /// Invalidation acknowledgements waiting to be sent (see [`Client::ack_invalidation`]).
    acks: tokio::sync::mpsc::UnboundedSender<PendingAck>,
    /// Where silent connections are announced (see [`Client::silences`]).
    silences: tokio::sync::broadcast::Sender<SocketAddr>,
    /// Endpoints whose connection a probe just gave up, until when they are skipped.
    silenced: std::sync::Mutex<HashMap<SocketAddr, (Instant, Error)>>,
    /// Sessions open (or opening) on this client, each holding a [`SessionSlot`].
    sessions: Arc<std::sync::atomic::AtomicUsize>,
}

/// One of a client's [`ClientConfig::sessions_max`] places for a session; given back when
/// dropped (the session's event loop holds it until the session ends).
pub(crate) struct SessionSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Acknowledgements of this client's sessions that arrive within this window of the first
/// one go out together, one `AckInvalidationsBatch` RPC per server.
const ACK_COALESCE: Duration = Duration::from_millis(5);

/// One invalidation to acknowledge to the server that sent it.
struct PendingAck {
    addr: SocketAddr,
    session: SessionId,
    id: u64,
    /// Retried until then (a lease): the server has stopped waiting for us by then.
    give_up: Instant,
}

/// Collects acknowledgements and sends them grouped by server; ends with the client.
async fn ack_batcher(
    client: std::sync::Weak<Inner>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<PendingAck>,
) {
    while let Some(first) = rx.recv().await {
        tokio::time::sleep(ACK_COALESCE).await;
        let mut by_addr: HashMap<SocketAddr, Vec<PendingAck>> = HashMap::default();
        by_addr.entry(first.addr).or_default().push(first);
        // Bounded by what is queued now (each batch at most KEEPALIVE_BATCH_MAX sessions
        // is split below).
        while let Ok(a) = rx.try_recv() {
            by_addr.entry(a.addr).or_default().push(a);
        }
        let Some(inner) = client.upgrade() else {
            return;
        };
        for (addr, acks) in by_addr {
            let client = Client {
                inner: inner.clone(),
            };
            wire::rt::spawn(async move { client.send_acks(addr, acks).await });
        }
    }
}

/// KeepAlives of this client's sessions that fall due within this window of the first one
/// go out together, as one `KeepAliveBatch` RPC.
const KEEPALIVE_COALESCE: Duration = Duration::from_millis(20);

/// The answer to one session's KeepAlive, and the server that gave it.
type KeepAliveResult = Result<(Reply, SocketAddr), Error>;

/// One session's KeepAlive waiting for its batch.
struct KeepAliveWaiter {
    session: SessionId,
    deadline: Instant,
    tx: tokio::sync::oneshot::Sender<KeepAliveResult>,
}

/// Collects KeepAlives and sends each group as one RPC; ends with the client.
async fn keepalive_batcher(
    client: std::sync::Weak<Inner>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<KeepAliveWaiter>,
) {
    while let Some(first) = rx.recv().await {
        tokio::time::sleep(KEEPALIVE_COALESCE).await;
        let mut batch = vec![first];
        while batch.len() < wire::KEEPALIVE_BATCH_MAX {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let Some(inner) = client.upgrade() else {
            return;
        };
        let client = Client { inner };
        wire::rt::spawn(async move { client.send_keepalives(batch).await });
    }
}

/// An endpoint's connection, or its last failed attempt.
#[derive(Default)]
struct Slot {
    conn: Option<(quinn::Connection, Heard)>,
    failed: Option<(Instant, Error)>,
}

/// When a connection last received anything, as its watcher ([`watch_heard`]) noticed
/// (at most [`HEARD_POLL`] late, or later if the runtime stalled), and its count of
/// received datagrams then.
type Heard = Arc<std::sync::Mutex<(Instant, u64)>>;

/// How often a connection's watcher looks at its received-datagram count.
const HEARD_POLL: Duration = Duration::from_millis(100);

/// Records in `heard` when `conn` last received a datagram, until the connection closes or
/// its slot lets go of `heard` (the connection was replaced, or the client dropped).
async fn watch_heard(
    conn: quinn::Connection,
    heard: std::sync::Weak<std::sync::Mutex<(Instant, u64)>>,
) {
    let mut seen = conn.stats().udp_rx.datagrams;
    loop {
        tokio::time::sleep(HEARD_POLL).await;
        let Some(heard) = heard.upgrade() else {
            return;
        };
        if conn.close_reason().is_some() {
            return;
        }
        let n = conn.stats().udp_rx.datagrams;
        if n != seen {
            seen = n;
            *heard.lock().expect("heard lock") = (Instant::now(), n);
        }
    }
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

/// The leader a client last reached. Its watchers (the sessions' event streams) wake only
/// when it changes, not on every request that confirms it.
struct LeaderHint(tokio::sync::watch::Sender<Option<SocketAddr>>);

impl LeaderHint {
    fn get(&self) -> Option<SocketAddr> {
        *self.0.borrow()
    }

    /// Makes `addr` the leader; true if it was not already.
    fn set(&self, addr: SocketAddr) -> bool {
        self.0.send_if_modified(|l| {
            let changed = *l != Some(addr);
            *l = Some(addr);
            changed
        })
    }

    /// Forgets `addr` if it is the leader.
    fn forget(&self, addr: SocketAddr) {
        self.0.send_if_modified(|l| {
            let was = *l == Some(addr);
            if was {
                *l = None;
            }
            was
        });
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
        let endpoint = wire::quic::client_endpoint_on(&cfg.sockets, tls, bind).map_err(conn_err)?;
        let (keepalives, rx) = tokio::sync::mpsc::unbounded_channel();
        let (acks, acks_rx) = tokio::sync::mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            cfg,
            endpoint,
            addrs,
            conns: std::sync::Mutex::new(HashMap::default()),
            leader: LeaderHint(tokio::sync::watch::channel(None).0),
            proxies: Default::default(),
            keepalives,
            acks,
            silences: tokio::sync::broadcast::channel(SILENCES_QUEUED).0,
            silenced: std::sync::Mutex::new(HashMap::default()),
            sessions: Arc::default(),
        });
        wire::rt::spawn(keepalive_batcher(Arc::downgrade(&inner), rx));
        wire::rt::spawn(ack_batcher(Arc::downgrade(&inner), acks_rx));
        Ok(Client { inner })
    }

    /// Renews `session`'s lease, trying until `deadline`: the answer (a
    /// [`Reply::KeepAlive`]) and the server that gave it. KeepAlives of this client's
    /// sessions that fall due together travel as one `KeepAliveBatch` RPC, so a process
    /// holding many sessions (a loadgen, a multi-tenant server) sends one RPC per round
    /// rather than one per session.
    pub(crate) async fn keepalive(&self, session: SessionId, deadline: Instant) -> KeepAliveResult {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let w = KeepAliveWaiter {
            session,
            deadline,
            tx,
        };
        if self.inner.keepalives.send(w).is_err() {
            return Err(conn_err("the client is shutting down"));
        }
        rx.await
            .unwrap_or_else(|_| Err(conn_err("the KeepAlive batcher stopped")))
    }

    /// Acknowledges invalidation `id` of `session` to the server `addr` whose event stream
    /// delivered it, and nowhere else: that server (the leader, or a proxy) is the one
    /// holding a write until it hears from us; another one would ignore the id.
    /// Acknowledgements queued together travel as one `AckInvalidationsBatch` per server;
    /// each is retried until `give_up`.
    pub(crate) fn ack_invalidation(
        &self,
        addr: SocketAddr,
        session: SessionId,
        id: u64,
        give_up: Instant,
    ) {
        let _ = self.inner.acks.send(PendingAck {
            addr,
            session,
            id,
            give_up,
        });
    }

    async fn send_acks(&self, addr: SocketAddr, mut acks: Vec<PendingAck>) {
        let mut backoff = Duration::from_millis(20);
        loop {
            acks.retain(|a| Instant::now() < a.give_up);
            if acks.is_empty() {
                return;
            }
            let mut by_session: std::collections::BTreeMap<SessionId, Vec<u64>> =
                Default::default();
            for a in &acks {
                by_session.entry(a.session).or_default().push(a.id);
            }
            let all: Vec<(SessionId, Vec<u64>)> = by_session.into_iter().collect();
            let mut failed = false;
            for chunk in all.chunks(wire::KEEPALIVE_BATCH_MAX) {
                let req = if let [(session, ids)] = chunk {
                    // One session: the plain form, which every server version knows.
                    Request {
                        session: *session,
                        request_id: 0,
                        ack_below: 0,
                        op: Op::AckInvalidations { ids: ids.clone() },
                    }
                } else {
                    Request {
                        session: 0,
                        request_id: 0,
                        ack_below: 0,
                        op: Op::AckInvalidationsBatch {
                            acks: chunk.to_vec(),
                        },
                    }
                };
                match self.call_at(addr, &req).await {
                    Ok(_) => {
                        let done: wire::hash::HashSet<SessionId> =
                            chunk.iter().map(|(s, _)| *s).collect();
                        acks.retain(|a| !done.contains(&a.session));
                    }
                    Err(e) if !e.is_retryable() => {
                        tracing::debug!(%addr, "invalidation acks refused: {e}");
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(%addr, "invalidation acks failed, retrying: {e}");
                        failed = true;
                    }
                }
            }
            if !failed {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    async fn send_keepalives(&self, mut batch: Vec<KeepAliveWaiter>) {
        // A session whose loop gave up (it retries) is not renewed on its behalf.
        batch.retain(|w| !w.tx.is_closed());
        let Some(deadline) = batch.iter().map(|w| w.deadline).min() else {
            return;
        };
        if batch.len() == 1 {
            let w = batch.pop().expect("one");
            let req = Request {
                session: w.session,
                request_id: 0,
                ack_below: 0,
                op: Op::KeepAlive,
            };
            let _ = w.tx.send(self.call_until_from(req, deadline).await);
            return;
        }
        let req = Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::KeepAliveBatch {
                sessions: batch.iter().map(|w| w.session).collect(),
            },
        };
        match self.call_until_from(req, deadline).await {
            Ok((
                Reply::KeepAliveBatch {
                    session_lease_ms,
                    renewed,
                    expired,
                    unknown,
                    unacknowledged,
                },
                addr,
            )) => {
                let renewed: wire::hash::HashSet<SessionId> = renewed.into_iter().collect();
                let expired: wire::hash::HashSet<SessionId> = expired.into_iter().collect();
                let unknown: wire::hash::HashSet<SessionId> = unknown.into_iter().collect();
                let mut unacked: HashMap<SessionId, Vec<(u64, Vec<String>)>> = HashMap::default();
                for (s, id, paths) in unacknowledged {
                    unacked.entry(s).or_default().push((id, paths));
                }
                for w in batch {
                    let s = w.session;
                    let r = if renewed.contains(&s) {
                        Ok((
                            Reply::KeepAlive {
                                session_lease_ms,
                                unacknowledged: unacked.remove(&s).unwrap_or_default(),
                            },
                            addr,
                        ))
                    } else if expired.contains(&s) {
                        Err(Error::SessionExpired { session: s })
                    } else if unknown.contains(&s) {
                        Err(Error::UnknownSession { session: s })
                    } else {
                        Err(Error::Unavailable {
                            reason: "not renewed in this round".into(),
                        })
                    };
                    let _ = w.tx.send(r);
                }
            }
            Ok((other, _)) => {
                for w in batch {
                    let _ = w.tx.send(Err(unexpected(&other)));
                }
            }
            Err(e) => {
                let ids: Vec<SessionId> = batch.iter().map(|w| w.session).collect();
                tracing::debug!(sessions = %wire::types::IdRanges(&ids), "KeepAliveBatch failed: {e}");
                for w in batch {
                    let _ = w.tx.send(Err(e.clone()));
                }
            }
        }
    }

    /// The configured endpoints.
    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.inner.addrs
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    /// The local UDP address this client's QUIC endpoint is bound to (every connection of
    /// the client uses it): for matching its traffic in captures and firewall rules.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.endpoint.local_addr()
    }

    async fn connection(&self, addr: SocketAddr) -> Result<quinn::Connection, Error> {
        self.connection_heard(addr).await.map(|(c, _)| c)
    }

    /// The connection to `addr` (dialed if there is none) and when it last heard anything.
    async fn connection_heard(
        &self,
        addr: SocketAddr,
    ) -> Result<(quinn::Connection, Heard), Error> {
        let slot = self
            .inner
            .conns
            .lock()
            .expect("connections lock")
            .entry(addr)
            .or_default()
            .clone();
        self.not_silenced(addr)?;
        let mut slot = slot.lock().await;
        if let Some((c, heard)) = &slot.conn {
            if c.close_reason().is_none() {
                return Ok((c.clone(), heard.clone()));
            }
        }
        // Given up while this caller waited for the slot.
        self.not_silenced(addr)?;
        // A dead endpoint is tried once per connect timeout, not once per caller: the
        // others move on to the next endpoint at once.
        if let Some((at, e)) = &slot.failed {
            if at.elapsed() < self.inner.cfg.connect_timeout {
                return Err(e.clone());
            }
        }
        tracing::debug!(%addr, "dialing");
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
            if reply?.proxy {
                self.inner
                    .proxies
                    .lock()
                    .expect("proxies lock")
                    .insert(addr);
            }
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
                let heard: Heard = Arc::new(std::sync::Mutex::new((
                    Instant::now(),
                    conn.stats().udp_rx.datagrams,
                )));
                wire::rt::spawn(watch_heard(conn.clone(), Arc::downgrade(&heard)));
                slot.conn = Some((conn.clone(), heard.clone()));
                slot.failed = None;
                Ok((conn, heard))
            }
            Err(e) => {
                slot.conn = None;
                slot.failed = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Records `addr`, whose connection is about to be closed after an unanswered probe,
    /// as silenced for a connect timeout: callers move on to the next endpoint at once
    /// instead of each spending that timeout on a handshake with a peer that was silent a
    /// moment ago (after a leader's death that was a second lost by every caller that
    /// tried the endpoints in their configured order). Recorded before the close, outside
    /// the endpoint's slot, so no caller can start dialing it in between.
    fn silenced(&self, addr: SocketAddr, e: &Error) {
        let until = Instant::now() + self.inner.cfg.connect_timeout;
        self.inner
            .silenced
            .lock()
            .expect("silenced lock")
            .insert(addr, (until, e.clone()));
        self.connection_failed(addr);
    }

    /// `Err` while `addr` is silenced (see [`Client::silenced`]).
    fn not_silenced(&self, addr: SocketAddr) -> Result<(), Error> {
        let mut silenced = self.inner.silenced.lock().expect("silenced lock");
        match silenced.get(&addr) {
            Some((until, e)) if Instant::now() < *until => Err(e.clone()),
            Some(_) => {
                silenced.remove(&addr);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Forgets `addr` as the leader after it failed at the connection level, so the next
    /// attempts start with the other endpoints rather than a dead one.
    fn connection_failed(&self, addr: SocketAddr) {
        self.inner.leader.forget(addr);
    }

    /// One attempt at one replica: no retry, no redirect.
    pub async fn call_at(&self, addr: SocketAddr, req: &Request) -> Response {
        self.attempt(addr, req).await.and_then(|r| r)
    }

    /// One attempt: `Err` if it failed here (connection, no answer in time), `Ok` with the
    /// server's answer otherwise (which may be the server's error).
    async fn attempt(&self, addr: SocketAddr, req: &Request) -> Result<Response, Error> {
        let attempt = async {
            let (conn, heard) = self.connection_heard(addr).await?;
            let work = async {
                let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
                frame::write(&mut send, req, CLIENT_FRAME_BYTES_MAX).await?;
                let _ = send.finish();
                frame::read::<_, Response>(&mut recv, CLIENT_FRAME_BYTES_MAX).await
            };
            // Every request probes, KeepAlives too: one that waits at a proxy for its
            // next batch makes the probe ask the proxy, which answers at once.
            let probe = presumed_dead(&conn, &heard, || {
                // Nobody listening is fine: the announcement is advisory.
                let _ = self.inner.silences.send(addr);
            });
            tokio::select! {
                r = work => r,
                _ = probe => {
                    let e = conn_err(format!("{addr}: no answer to a probe; presumed dead"));
                    self.silenced(addr, &e);
                    // Every request waiting on it fails now and is retried elsewhere (with
                    // its request id), instead of waiting for QUIC's idle timeout.
                    conn.close(0u32.into(), b"peer silent");
                    Err(e)
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
        if let Some(l) = self.inner.leader.get() {
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
        self.call_until_from(req, deadline).await.map(|(r, _)| r)
    }

    /// Like [`Client::call_until`]; also says which server answered.
    pub(crate) async fn call_until_from(
        &self,
        req: Request,
        deadline: Instant,
    ) -> Result<(Reply, SocketAddr), Error> {
        let mut last_err = None;
        let mut attempt = 0u32;
        let started = Instant::now();
        while Instant::now() < deadline {
            let mut redirected = false;
            for addr in self.candidates() {
                if Instant::now() >= deadline {
                    break;
                }
                let proxy = self
                    .inner
                    .proxies
                    .lock()
                    .expect("proxies lock")
                    .contains(&addr);
                let r = match self.attempt(addr, &req).await {
                    // A proxy that answers "timed out" is alive and retries the cell with
                    // the same request id itself: stay with it. Moving on would move every
                    // session of this client (and their event streams) to another proxy,
                    // leaving the cached values they hold here to be waited out.
                    Ok(Err(e @ Error::Timeout { .. })) if proxy => {
                        self.inner.leader.set(addr);
                        last_err = Some(e);
                        break;
                    }
                    Ok(r) => r,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(r) => {
                        self.inner.leader.set(addr);
                        return Ok((r, addr));
                    }
                    Err(Error::NotLeader {
                        leader_addr: Some(hint),
                        leader_id,
                    }) => {
                        if let Ok(h) = hint.parse::<SocketAddr>() {
                            if self.inner.leader.set(h) {
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
                        self.inner.leader.set(addr);
                        return Ok((reply, recv, addr));
                    }
                    Err(Error::NotLeader {
                        leader_addr: Some(hint),
                        leader_id,
                    }) => {
                        if let Ok(h) = hint.parse::<SocketAddr>() {
                            if self.inner.leader.set(h) {
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

    /// Announcements of silent servers: the address of a connection is sent each time a
    /// request to it has waited a second without anything at all arriving from it. A probe
    /// follows, and if that goes unanswered for another second too the connection is
    /// dropped and its requests move on. A silence is a suspicion, not a verdict (a server
    /// starved of CPU can be silent for a second); a proxy uses it to start flushing its
    /// clients' caches while the cell may be electing a new leader. A receiver that falls
    /// more than a few announcements behind skips the oldest.
    pub fn silences(&self) -> tokio::sync::broadcast::Receiver<SocketAddr> {
        self.inner.silences.subscribe()
    }

    /// The leader this client last reached, if any.
    pub fn leader_hint(&self) -> Option<SocketAddr> {
        self.inner.leader.get()
    }

    /// Wakes when [`Client::leader_hint`] changes (a session's event stream moves then).
    pub(crate) fn leader_changes(&self) -> tokio::sync::watch::Receiver<Option<SocketAddr>> {
        self.inner.leader.0.subscribe()
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
        let slot = self.session_slot()?;
        crate::Session::open(self.clone(), slot).await
    }

    /// Takes a place for one more session, if the client has one.
    fn session_slot(&self) -> Result<SessionSlot, Error> {
        use std::sync::atomic::Ordering::SeqCst;
        let max = self.inner.cfg.sessions_max.min(SESSIONS_PER_CLIENT_MAX);
        let n = &self.inner.sessions;
        n.fetch_update(SeqCst, SeqCst, |now| (now < max).then_some(now + 1))
            .map(|_| SessionSlot(n.clone()))
            .map_err(|_| Error::TooManySessions { max })
    }

    /// How many sessions this client holds open (or is opening) now.
    pub fn sessions_open(&self) -> usize {
        self.inner
            .sessions
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The status of one replica.
    pub async fn status_of(&self, addr: SocketAddr) -> Result<Status, Error> {
        match self.call_at(addr, &sessionless(Op::Status)).await? {
            Reply::Status(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// The digest of one replica's replicated state and the log index it reflects
    /// ([`Op::StateDigest`]; a proxy answers `BadRequest`). Replicas at the same index
    /// agree on it; it costs the replica a walk of its whole state.
    pub async fn state_digest_of(&self, addr: SocketAddr) -> Result<(u64, u64), Error> {
        match self.call_at(addr, &sessionless(Op::StateDigest)).await? {
            Reply::StateDigest { index, digest } => Ok((index, digest)),
            other => Err(unexpected(&other)),
        }
    }

    /// The counters of one proxy (a replica answers `BadRequest`).
    pub async fn proxy_status_of(&self, addr: SocketAddr) -> Result<ProxyStatus, Error> {
        match self.call_at(addr, &sessionless(Op::ProxyStatus)).await? {
            Reply::ProxyStatus(s) => Ok(s),
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
/// A request waits at least this long before its connection may be probed (its peer
/// silent for [`PROBE_AFTER`] by then, counted from the last datagram).
const PROBE_MIN_WAIT: Duration = Duration::from_millis(300);
/// Silence announcements kept for a slow receiver of [`Client::silences`].
const SILENCES_QUEUED: usize = 64;

/// Completes only if `conn`'s peer looks dead: while a request waits (a held write may
/// legitimately take seconds), the connection is watched. A peer that sent anything at
/// all in the last second (answers, acknowledgements) is alive, however slow it is under
/// load. Once the peer has been silent for a second (`heard`: when the connection last
/// received anything) and the request has waited at least [`PROBE_MIN_WAIT`], it is
/// probed with a cheap
/// request (`ProxyStatus`: a proxy answers it itself, a replica refuses it at once; either
/// answer proves the peer alive); no answer and still nothing received within a second
/// means the peer is gone (killed or frozen), which QUIC alone would notice only at its
/// idle timeout. The silence is measured from the last datagram, not in whole seconds
/// from the request's start: a request sent just before its peer died used to see the
/// last answers in its first second and probe only after its second (a fail-over's
/// first second lost). `silent` is called each time a probe is about to be sent.
async fn presumed_dead(conn: &quinn::Connection, heard: &Heard, silent: impl Fn()) {
    let received = || conn.stats().udp_rx.datagrams;
    let mut since = Instant::now();
    loop {
        let (last, count) = *heard.lock().expect("heard lock");
        // A request sent after its peer fell silent probes once the silence is a second
        // old (after a short wait of its own), not a second after it was sent: a proxy
        // whose next batch left after the leader's kill gave it up a second later than
        // the others, and the new leader's writes waited for it.
        let due = (since + PROBE_MIN_WAIT).max(last + PROBE_AFTER);
        if Instant::now() < due {
            tokio::time::sleep_until(due).await;
            continue;
        }
        let seen = received();
        if seen != count {
            // Something arrived that the watcher has not noted yet (it runs every 100 ms,
            // later if the runtime stalled): not silent; count the second from now.
            *heard.lock().expect("heard lock") = (Instant::now(), seen);
            continue;
        }
        tracing::debug!(peer = %conn.remote_address(), silent_ms = last.elapsed().as_millis() as u64, "peer silent: probing");
        silent();
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
        let answered = matches!(tokio::time::timeout(PROBE_TIMEOUT, probe).await, Ok(Ok(_)));
        let now_seen = received();
        if !answered && now_seen == seen {
            tracing::debug!(peer = %conn.remote_address(), "probe unanswered: peer presumed dead");
            return;
        }
        tracing::debug!(peer = %conn.remote_address(), answered, datagrams = now_seen - seen, "probe: peer alive");
        // Alive: a fresh second before the next look.
        since = Instant::now();
    }
}

/// A request outside any session (status, membership).
fn sessionless(op: Op) -> Request {
    Request {
        session: 0,
        request_id: 0,
        ack_below: 0,
        op,
    }
}

pub(crate) fn unexpected(r: &Reply) -> Error {
    Error::Internal {
        reason: format!("unexpected reply {r:?}"),
    }
}
