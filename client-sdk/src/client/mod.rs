//! A client's connections to a cell: one QUIC connection per endpoint, leader discovery,
//! and retries of requests whose outcome is unknown.
//!
//! A [`Client`] is a handle (cheap to clone) on one QUIC endpoint and the connections it
//! dials lazily, one per replica or proxy address it was given. Everything a session does
//! goes through [`Client::call`]: try the leader it last reached, follow `NotLeader`
//! redirects, move to the next endpoint when one fails at the connection level, and retry
//! with the same request id until the operation's deadline, so the cell's dedup makes a
//! retry safe. The pieces around it live in submodules:
//!
//! - [`config`]: [`ClientConfig`], its defaults and limits.
//! - `batchers`: KeepAlives and invalidation acknowledgements of a client's sessions that
//!   fall due together travel as one RPC (`KeepAliveBatch`, `AckInvalidationsBatch`).
//! - `liveness`: when each connection last heard anything, and the probe that gives a
//!   silent peer up after two seconds instead of QUIC's idle timeout, or as soon as
//!   another replica leads in the newest term reported ([`Client::newer_leader`]).
//!
//! Sessions are built on a client (see `crate::session`, which opens them); this module
//! knows nothing of sessions beyond counting their places (`SessionSlot`). A client
//! talks to one cell: routing a path to one of several cells belongs above it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use wire::hash::HashMap;

use tokio::sync::Mutex;
use wire::hello::{Hello, HelloReply, ALPN_CLIENT};
use wire::identity::Identity;
use wire::types::{Op, ProxyStatus, Reply, Request, Response, SessionId, Status};
use wire::{frame, tls, Error, CLIENT_FRAME_BYTES_MAX};

mod batchers;
pub mod config;
mod liveness;

use batchers::{ack_batcher, keepalive_batcher, KeepAliveWaiter, PendingAck};
pub use config::{ClientConfig, SESSIONS_PER_CLIENT_MAX};
use liveness::{presumed_dead, watch_heard, Heard, Verdict, SILENCES_QUEUED};

struct Inner {
    cfg: ClientConfig,
    endpoint: quinn::Endpoint,
    /// Each configured endpoint's address (`None`: a name that has not resolved yet), in
    /// the configured order: resolved at connect, and again after a pass over the
    /// endpoints reached none of them (see [`Client::resolve_again`]).
    addrs: std::sync::Mutex<Vec<Option<SocketAddr>>>,
    /// The names' second lookups (see [`Client::resolve_again`]).
    resolving: std::sync::Mutex<Resolving>,
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
    /// Searches for a newer leader by (connection, start of its silence): when each
    /// started and its outcome once done (see [`Client::search`]).
    searches: std::sync::Mutex<HashMap<(usize, Instant), (Instant, Search)>>,
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

/// When the endpoint names may be looked up again, and whether a lookup is running.
#[derive(Default)]
struct Resolving {
    running: bool,
    next: Option<Instant>,
    /// The pause before the next lookup: [`RESOLVE_AGAIN_EVERY`], doubled (up to
    /// [`RESOLVE_AGAIN_MAX`]) each time the names resolve as before.
    pause: Duration,
}

/// An endpoint's connection, or its last failed attempt.
#[derive(Default)]
struct Slot {
    conn: Option<(quinn::Connection, Heard)>,
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

/// A connection to `addr` that failed with `e`. The server's close for an identity it
/// does not take on this connection (sent once the handshake is done, so authenticated)
/// is `BadRequest` with the reason: no retry and no other endpoint of the cell will take
/// it either. Anything else, TLS alerts included, is a `Connection` error with the
/// reason, and the client goes on to the next endpoint: a certificate problem may be one
/// server's (an expired certificate on one replica), and a close during the handshake
/// can be forged by anyone who sees the client's first packet.
///
/// A TLS alert that refuses a certificate or the handshake's terms is
/// [`Error::Handshake`]: [`Client::call_until`] still tries the other endpoints, and
/// gives up at once when all of them refused.
fn refused_or(addr: SocketAddr, e: &quinn::ConnectionError) -> Error {
    match e {
        quinn::ConnectionError::TransportError(t) if tls_refusal(t.code) => Error::Handshake {
            reason: format!("{addr}: this client refused the server: {e}"),
        },
        quinn::ConnectionError::ConnectionClosed(c) if tls_refusal(c.error_code) => {
            Error::Handshake {
                reason: format!("{addr} refused this client: {e}"),
            }
        }
        quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == wire::identity::CLOSE_REFUSED_IDENTITY.into() =>
        {
            Error::BadRequest {
                reason: format!(
                    "{addr} refused this client's certificate: {}",
                    String::from_utf8_lossy(&c.reason)
                ),
            }
        }
        _ => conn_err(format!("{addr}: {e}")),
    }
}

/// Whether a QUIC error code carries a TLS alert (`0x100 + alert`, RFC 9001 §4.8) that
/// refuses a certificate or the handshake's terms (RFC 8446 §6.2): handshake_failure,
/// bad/unsupported/revoked/expired/unknown certificate, unknown CA, access denied,
/// decrypt error (a certificate signed by a CA of the same name with another key: rustls
/// reports a bad signature), certificate required, no application protocol.
fn tls_refusal(code: quinn::TransportErrorCode) -> bool {
    match u64::from(code).checked_sub(0x100) {
        Some(alert) if alert < 0x100 => {
            matches!(alert, 40 | 42..=46 | 48 | 49 | 51 | 116 | 120)
        }
        _ => false,
    }
}

/// How long a first dial may go unanswered before the next endpoint is dialed beside it
/// ([`Client::reachable_first`]).
const DIAL_STAGGER: Duration = Duration::from_millis(150);

/// How often at most a client resolves its endpoint names again while it reaches none of
/// its endpoints (replicas rescheduled at other addresses under the same names, as a
/// Kubernetes StatefulSet's pods are); doubled each time they resolve as before, up to
/// [`RESOLVE_AGAIN_MAX`], so a cell that is down does not have every client asking DNS
/// every second.
const RESOLVE_AGAIN_EVERY: Duration = Duration::from_secs(1);

/// The longest pause between two lookups of the endpoint names.
const RESOLVE_AGAIN_MAX: Duration = Duration::from_secs(30);

/// How long one name's lookup may take.
const RESOLVE_WITHIN: Duration = Duration::from_secs(2);

/// How many passes of one call in a row may end by following a leader hint at once
/// (replicas with stale views naming each other would otherwise be gone round without a
/// pause); then the call waits its backoff.
const HINTS_FOLLOWED_MAX: u32 = 4;

/// How often [`Client::newer_leader`] asks the other replicas who leads while a request
/// waits on a silent one: a new leader is found at most this long after it was elected.
const SEARCH_EVERY: Duration = Duration::from_millis(100);

/// How long after a call's first `NotLeader` answer the replicas' `NotLeader` answers
/// are taken for an election under way (followers wait 1.5-2 s of silence before they
/// stand, and a split vote costs another timeout), and looked at again every
/// [`ELECTION_POLL`].
const ELECTION_WINDOW: Duration = Duration::from_secs(4);

/// The pause between passes over the endpoints in which a replica answered that it
/// does not lead ([`Client::call`]).
const ELECTION_POLL: Duration = Duration::from_millis(100);

/// How long a search's outcome is kept after its probe timeout (for the requests that
/// ask for it late).
const SEARCHES_KEPT: Duration = Duration::from_secs(5);

/// How long one replica's answer to [`Op::Leadership`] may take once connected; to
/// [`Op::LeadershipAfter`], held by the replica for up to [`SEARCH_EVERY`], that much
/// longer.
const SEARCH_ANSWER_WITHIN: Duration = Duration::from_millis(250);

/// A search's outcome: `None` while it runs, then the new leader it found, if any.
type Search = tokio::sync::watch::Receiver<Option<Option<SocketAddr>>>;

/// One replica's answer to [`Op::Leadership`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LeadershipAnswer {
    addr: SocketAddr,
    term: u64,
    leading: bool,
}

/// The replica among `answers` that leads in `newest`, the newest term any answer of the
/// search reported, if one does. Raft elects at most one leader at a time, so a replica
/// leading in that term is the cell's leader now, unless a replica this client did not
/// hear from has already moved to a later one; a replica still leading in an older term
/// (cut off from the others, not yet told) is passed over as long as one answer names a
/// later term.
fn newest_leader(newest: u64, answers: &[LeadershipAnswer]) -> Option<SocketAddr> {
    answers
        .iter()
        .find(|a| a.term == newest && a.leading)
        .map(|a| a.addr)
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
    /// Prepares connections to the cell. Fails if an endpoint is not `host:port`, if none
    /// resolves, or if the CA cannot be read; replicas are dialed lazily. Names are
    /// resolved here, side by side, each within 2 s, taking a name's first address: one
    /// that does not resolve now (a replica's pod not scheduled yet) is left out with a
    /// warning while another does. When a pass over the endpoints then reaches none of
    /// them, the names are resolved again in the background (at most once a second,
    /// less often while they resolve as before), so a client whose replicas all came back
    /// at other addresses under their names finds them without a restart.
    pub async fn connect(cfg: ClientConfig) -> Result<Client, Error> {
        let mut resolved = Vec::new();
        let mut unresolved = Vec::new();
        for e in &cfg.endpoints {
            if !wire::is_host_port(e) {
                return Err(Error::BadRequest {
                    reason: format!("endpoint {e:?}: expected host:port or ip:port"),
                });
            }
        }
        // Side by side: one slow name costs RESOLVE_WITHIN, not one each.
        for found in futures::future::join_all(cfg.endpoints.iter().map(|e| resolve(e, None))).await
        {
            match found {
                Ok(a) => resolved.push(Some(a)),
                Err(why) => {
                    resolved.push(None);
                    unresolved.push(why);
                }
            }
        }
        let addrs: Vec<SocketAddr> = resolved.iter().flatten().copied().collect();
        if addrs.is_empty() {
            return Err(Error::BadRequest {
                reason: if unresolved.is_empty() {
                    "no endpoints".into()
                } else {
                    format!("no endpoint resolves ({})", unresolved.join("; "))
                },
            });
        }
        if !unresolved.is_empty() {
            tracing::warn!(
                left_out = ?unresolved,
                "endpoints that do not resolve now are left out"
            );
        }
        let files = tls::TlsConfig {
            ca: cfg.ca.clone(),
            cert: cfg.cert.clone(),
            key: cfg.key.clone(),
            crls: cfg.crls.clone(),
        };
        let (tls, me) = tls::client_config(&files, ALPN_CLIENT)
            .map_err(|reason| Error::BadRequest { reason })?;
        if let Identity::Replica { .. } = me {
            return Err(Error::BadRequest {
                reason: format!(
                    "the certificate in {} is {me}, a replica's; a client needs a client's \
                     (lock://client/<name>: lockctl certs issue --role client)",
                    cfg.cert.display()
                ),
            });
        }
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
            addrs: std::sync::Mutex::new(resolved),
            resolving: Default::default(),
            conns: std::sync::Mutex::new(HashMap::default()),
            leader: LeaderHint(tokio::sync::watch::channel(None).0),
            proxies: Default::default(),
            keepalives,
            acks,
            silences: tokio::sync::broadcast::channel(SILENCES_QUEUED).0,
            silenced: std::sync::Mutex::new(HashMap::default()),
            searches: std::sync::Mutex::new(HashMap::default()),
            sessions: Arc::default(),
        });
        wire::rt::spawn(keepalive_batcher(Arc::downgrade(&inner), rx));
        wire::rt::spawn(ack_batcher(Arc::downgrade(&inner), acks_rx));
        Ok(Client { inner })
    }
    /// The configured endpoints' addresses now, in the configured order (a name that has
    /// never resolved is left out; one that does not resolve now keeps its last address).
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        let addrs = self.inner.addrs.lock().expect("addrs lock");
        addrs.iter().flatten().copied().collect()
    }

    /// Resolves the endpoint names again in the background, after a pass that reached
    /// none of the endpoints (the caller goes on with the addresses it has; its next pass
    /// uses the new ones): one lookup at a time, at most once per [`RESOLVE_AGAIN_EVERY`]
    /// (doubling while the names resolve as before), and only if an endpoint is a name.
    /// Each name takes the first address of the client's socket's family; a name that
    /// does not resolve now keeps the address it had. Connections to addresses no
    /// endpoint has any more are closed.
    fn resolve_again(&self) {
        let names = &self.inner.cfg.endpoints;
        if names.iter().all(|e| e.parse::<SocketAddr>().is_ok()) {
            return;
        }
        // A new outage (none for a while after the last lookup was due) starts again from
        // the shortest pause.
        let new_outage = {
            let mut r = self.inner.resolving.lock().expect("resolving lock");
            if r.running || r.next.is_some_and(|t| Instant::now() < t) {
                return;
            }
            r.running = true;
            r.next.is_none_or(|t| t.elapsed() > RESOLVE_AGAIN_MAX)
        };
        let client = self.clone();
        wire::rt::spawn(async move {
            let v6 = client
                .inner
                .endpoint
                .local_addr()
                .is_ok_and(|a| a.is_ipv6());
            let names = &client.inner.cfg.endpoints;
            let now = futures::future::join_all(names.iter().map(|e| resolve(e, Some(v6)))).await;
            let (before, after) = {
                let mut addrs = client.inner.addrs.lock().expect("addrs lock");
                let before = addrs.clone();
                for (slot, found) in addrs.iter_mut().zip(now) {
                    if let Ok(a) = found {
                        *slot = Some(a);
                    }
                }
                (before, addrs.clone())
            };
            let moved = after != before;
            {
                let mut r = client.inner.resolving.lock().expect("resolving lock");
                r.pause = if moved || new_outage {
                    RESOLVE_AGAIN_EVERY
                } else {
                    (r.pause * 2).min(RESOLVE_AGAIN_MAX)
                };
                r.next = Some(Instant::now() + r.pause);
                r.running = false;
            }
            if moved {
                tracing::info!(
                    ?before,
                    now = ?after,
                    "no endpoint reachable: their names resolve to other addresses now"
                );
                let gone: Vec<SocketAddr> = before
                    .iter()
                    .flatten()
                    .filter(|a| !after.contains(&Some(**a)))
                    .copied()
                    .collect();
                for a in gone {
                    client.inner.leader.forget(a);
                    let slot = client.inner.conns.lock().expect("conns lock").remove(&a);
                    if let Some(slot) = slot {
                        if let Some((c, _)) = &slot.lock().await.conn {
                            c.close(0u32.into(), b"endpoint moved");
                        }
                    }
                }
            }
        });
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
        let slot = self.slot(addr);
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
                .map_err(|e| refused_or(addr, &e))?;
            // The CA signed it; it must also be a replica or a proxy (a directory
            // instance, for a directory client), not a client that happens to listen at
            // a configured address.
            let expect = match (&self.inner.cfg.cell, self.inner.cfg.directory) {
                (_, true) => wire::identity::Dialed::Directory,
                (Some(cell), false) => wire::identity::Dialed::Cell { cell },
                (None, false) => wire::identity::Dialed::Server,
            };
            wire::identity::check_dialed(&conn, expect)
                .map_err(|e| conn_err(format!("{addr}: {e}")))?;

            let hello = async {
                let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
                frame::write(&mut send, &Hello::new(self.inner.cfg.agent.clone()), 4096).await?;
                let _ = send.finish();
                frame::read::<_, HelloReply>(&mut recv, 4096).await
            };
            // A server that refused this client's identity closed the connection with the
            // reason: say it, rather than the stream's failure.
            let reply = match hello.await {
                Ok(r) => r,
                Err(e) => match conn.close_reason() {
                    Some(closed) => return Err(refused_or(addr, &closed)),
                    None => return Err(e),
                },
            };
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
        self.attempt(addr, req, None).await.and_then(|r| r)
    }

    /// One attempt: `Err` if it failed here (connection, no answer in time), `Ok` with the
    /// server's answer otherwise (which may be the server's error). It waits
    /// [`ClientConfig::attempt_timeout`], or until `deadline` if that comes first, so a
    /// call never outlives its request timeout by an attempt.
    async fn attempt(
        &self,
        addr: SocketAddr,
        req: &Request,
        deadline: Option<Instant>,
    ) -> Result<Response, Error> {
        self.attempt_finding(addr, req, deadline).await.0
    }

    /// [`Client::attempt`], and the leader its search found if it gave `addr` up for
    /// one ([`Verdict::Superseded`]): the one hint a call follows at once after a
    /// connection-level failure.
    async fn attempt_finding(
        &self,
        addr: SocketAddr,
        req: &Request,
        deadline: Option<Instant>,
    ) -> (Result<Response, Error>, Option<SocketAddr>) {
        let attempt = async {
            let (conn, heard) = match self.connection_heard(addr).await {
                Ok(c) => c,
                Err(e) => return (Err(e), None),
            };
            let work = exchange(&conn, req);
            // Every request probes, KeepAlives too: one that waits at a proxy for its
            // next batch makes the probe ask the proxy, which answers at once.
            let probe = presumed_dead(
                &conn,
                &heard,
                self.inner.cfg.probe_timeout,
                || {
                    // Nobody listening is fine: the announcement is advisory.
                    let _ = self.inner.silences.send(addr);
                },
                |silence| self.search(addr, &conn, silence),
            );
            tokio::select! {
                r = work => (r, None),
                verdict = probe => {
                    let found = match verdict {
                        Verdict::Superseded(leader) => Some(leader),
                        Verdict::Dead => None,
                    };
                    let e = match found {
                        None => conn_err(format!("{addr}: no answer to a probe; presumed dead")),
                        Some(leader) => conn_err(format!(
                            "{addr}: silent, and {leader} leads in the newest term the replicas report"
                        )),
                    };
                    self.silenced(addr, &e);
                    if let Some(leader) = found {
                        // After `silenced`, which forgot `addr` as the leader: the retry
                        // (and the sessions' event streams) go to the new one first.
                        self.inner.leader.set(leader);
                    }
                    // Every request waiting on it fails now and is retried elsewhere (with
                    // its request id), instead of waiting for QUIC's idle timeout.
                    conn.close(0u32.into(), b"peer silent");
                    (Err(e), found)
                }
            }
        };
        let t = match deadline {
            Some(d) => self
                .inner
                .cfg
                .attempt_timeout
                .min(d.saturating_duration_since(Instant::now())),
            None => self.inner.cfg.attempt_timeout,
        };
        match tokio::time::timeout(t, attempt).await {
            Ok(r) => r,
            Err(_) => (
                Err(Error::Timeout {
                    what: format!("answer from {addr}"),
                    after_ms: t.as_millis() as u64,
                }),
                None,
            ),
        }
    }

    /// The outcome of the search for a newer leader ([`Client::newer_leader`]) while
    /// `conn` (to `addr`) is silent since `silence`: one search per silence of a
    /// connection, run as a task of its own and shared by every request waiting on it
    /// (a proxy has hundreds waiting on its leader), which each await its outcome.
    async fn search(
        &self,
        addr: SocketAddr,
        conn: &quinn::Connection,
        silence: Instant,
    ) -> Option<SocketAddr> {
        let key = (conn.stable_id(), silence);
        let mut outcome = {
            let mut searches = self.inner.searches.lock().expect("searches lock");
            // Older silences' outcomes are of no use any more (a search lasts about a
            // probe timeout).
            let kept = self.inner.cfg.probe_timeout + SEARCHES_KEPT;
            searches.retain(|_, (started, _)| started.elapsed() < kept);
            searches
                .entry(key)
                .or_insert_with(|| {
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    let (client, conn) = (self.clone(), conn.clone());
                    wire::rt::spawn(async move {
                        let found = client.newer_leader(addr, &conn).await;
                        let _ = tx.send(Some(found));
                    });
                    (Instant::now(), rx)
                })
                .1
                .clone()
        };
        let found = outcome.wait_for(Option::is_some).await;
        found.ok().and_then(|f| f.flatten())
    }

    /// Looks for a replica other than `silent` (whose connection `conn` has gone quiet
    /// while requests wait on it) that leads now: asks every other replica endpoint who
    /// leads every [`SEARCH_EVERY`], each answering at once if it leads and otherwise
    /// holding the answer for the round's length unless it is elected meanwhile
    /// ([`Op::LeadershipAfter`]), and returns the endpoint of the first that says it
    /// leads in a term no answer of the search so far exceeds, or at the round's end of
    /// one that leads in a term no answer of the round exceeds ([`newest_leader`]). So
    /// the new leader is heard from about one round trip after its election, not up to a
    /// round later (60-137 ms after the election with the answers not held,
    /// docs/benchmarks.md). A cell elects only after its followers heard nothing from the
    /// old leader for their election timeout, so the new leader's answer is the earliest
    /// sign of a fail-over the client can have; the probe alone would give the old
    /// connection up only [`ClientConfig::probe_timeout`] after the silence began,
    /// however soon the cell elected. `None` if `silent` is a proxy (a proxy's own
    /// fail-over is the probe's to decide), if there is no other endpoint, as soon as
    /// `conn` receives anything again or closes, or once the rounds a probe can last are
    /// done.
    async fn newer_leader(
        &self,
        silent: SocketAddr,
        conn: &quinn::Connection,
    ) -> Option<SocketAddr> {
        let received = conn.stats().udp_rx.datagrams;
        let proxies = self.inner.proxies.lock().expect("proxies lock").clone();
        // Directory instances and proxies have no leader to find.
        if self.inner.cfg.directory || proxies.contains(&silent) {
            return None;
        }
        let others: Vec<SocketAddr> = self
            .endpoints()
            .into_iter()
            .filter(|a| *a != silent && !proxies.contains(a))
            .collect();
        if others.is_empty() {
            return None;
        }
        let rounds = self.inner.cfg.probe_timeout.as_millis() / SEARCH_EVERY.as_millis() + 1;
        // The newest term any answer of this search named.
        let mut newest = 0;
        for round in 0..rounds {
            if conn.close_reason().is_some() || conn.stats().udp_rx.datagrams != received {
                return None;
            }
            let next = Instant::now() + SEARCH_EVERY;
            // The first round's questions are answered at once, so every replica's term is
            // known before a held round: a replica still leading in an older term (cut
            // off, not yet told) answers a held question at once, and the followers'
            // newer terms come only at the round's end.
            let held = (round > 0).then_some(newest);
            let mut asks: futures::stream::FuturesUnordered<_> = others
                .iter()
                .map(|a| self.ask_leadership(*a, held))
                .collect();
            let mut answers = Vec::new();
            while let Some(answer) = futures::StreamExt::next(&mut asks).await {
                let Some(a) = answer else { continue };
                newest = newest.max(a.term);
                if held.is_some() && a.leading && a.term == newest {
                    return Some(a.addr);
                }
                answers.push(a);
            }
            if let Some(leader) = newest_leader(newest, &answers) {
                return Some(leader);
            }
            tokio::time::sleep_until(next).await;
        }
        None
    }

    /// `addr`'s answer to [`Op::Leadership`]: its term and whether it leads, or `None`
    /// (not connected yet, unreachable, no answer within [`SEARCH_ANSWER_WITHIN`], a
    /// proxy's refusal, a replica of an older build). An endpoint without an open
    /// connection is dialed in the background, with its connect timeout (cut shorter, a
    /// slow handshake would be started over in every round and never finish).
    async fn ask_leadership(
        &self,
        addr: SocketAddr,
        held: Option<u64>,
    ) -> Option<LeadershipAnswer> {
        if !self.has_connection(addr) {
            // Dialed in the background and asked in a later round once connected: a
            // replica that is down or cut off would hold every round up for its connect
            // timeout, as long as the probe itself waits.
            if !self.failed_lately(addr) {
                let client = self.clone();
                wire::rt::spawn(async move {
                    let _ = client.connection(addr).await;
                });
            }
            return None;
        }
        let ask = async {
            // Connected a moment ago; under the timeout in case it closed since.
            let conn = self.connection(addr).await?;
            if let Some(newer_than) = held {
                let op = Op::LeadershipAfter {
                    wait_ms: SEARCH_EVERY.as_millis() as u32,
                    newer_than,
                };
                if let r @ Ok(Ok(Reply::Leadership { .. })) =
                    exchange(&conn, &sessionless(op)).await
                {
                    return r;
                }
                // A replica of an older build cannot decode the held question
                // (`Malformed`): ask it the plain one.
            }
            exchange(&conn, &sessionless(Op::Leadership)).await
        };
        // A held question's answer may come a round later, plus the same allowance.
        let within = SEARCH_ANSWER_WITHIN
            + if held.is_some() {
                SEARCH_EVERY
            } else {
                Duration::ZERO
            };
        match tokio::time::timeout(within, ask).await {
            Ok(Ok(Ok(Reply::Leadership { term, leading, .. }))) => Some(LeadershipAnswer {
                addr,
                term,
                leading,
            }),
            _ => None,
        }
    }

    /// The slot of `addr`'s connection.
    fn slot(&self, addr: SocketAddr) -> Arc<Mutex<Slot>> {
        self.inner
            .conns
            .lock()
            .expect("connections lock")
            .entry(addr)
            .or_default()
            .clone()
    }

    /// True if this client has an open connection to `addr` now (false while one is being
    /// dialed).
    fn has_connection(&self, addr: SocketAddr) -> bool {
        let slot = self.slot(addr);
        let open = slot.try_lock().is_ok_and(|s| {
            s.conn
                .as_ref()
                .is_some_and(|(c, _)| c.close_reason().is_none())
        });
        open
    }

    /// True if dialing `addr` failed within the connect timeout, or a probe just gave it up.
    fn failed_lately(&self, addr: SocketAddr) -> bool {
        if self.not_silenced(addr).is_err() {
            return true;
        }
        let slot = self.slot(addr);
        let failed = slot.try_lock().is_ok_and(|s| {
            s.failed
                .as_ref()
                .is_some_and(|(at, _)| at.elapsed() < self.inner.cfg.connect_timeout)
        });
        failed
    }

    /// `cands` in the order to try them. As they are if the first has an open
    /// connection; otherwise they are dialed one after another, each [`DIAL_STAGGER`]
    /// after the one before or at once when it failed (RFC 8305's "happy eyeballs"),
    /// until one completes its handshake, which then goes first. A dead endpoint at the
    /// head of the list (a leader just killed, named first in the configuration or by
    /// the others' hints) then costs a new client [`DIAL_STAGGER`] instead of a whole
    /// connect timeout, and a healthy first endpoint is the only one dialed. The dials
    /// that lose go on in the background and keep their connections for later.
    async fn reachable_first(
        &self,
        mut cands: Vec<SocketAddr>,
        deadline: Instant,
    ) -> Vec<SocketAddr> {
        match cands.first() {
            Some(first) if !self.has_connection(*first) => {}
            _ => return cands,
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let until = deadline.min(Instant::now() + self.inner.cfg.connect_timeout);
        let (mut started, mut running) = (0, 0);
        loop {
            if started < cands.len() {
                let (client, addr, tx) = (self.clone(), cands[started], tx.clone());
                wire::rt::spawn(async move {
                    let ok = client.connection(addr).await.is_ok();
                    let _ = tx.send((addr, ok));
                });
                started += 1;
                running += 1;
            } else if running == 0 {
                return cands;
            }
            let wait = if started < cands.len() {
                until.min(Instant::now() + DIAL_STAGGER)
            } else {
                until
            };
            match tokio::time::timeout_at(wait, rx.recv()).await {
                Ok(Some((addr, true))) => {
                    if let Some(i) = cands.iter().position(|a| *a == addr) {
                        let a = cands.remove(i);
                        cands.insert(0, a);
                    }
                    return cands;
                }
                Ok(Some((_, false))) => running -= 1,
                Ok(None) => return cands,
                Err(_) if Instant::now() >= until => return cands,
                Err(_) => {}
            }
        }
    }

    fn candidates(&self) -> Vec<SocketAddr> {
        let addrs = self.inner.addrs.lock().expect("addrs lock");
        let mut v = Vec::with_capacity(addrs.len() + 1);
        v.extend(self.inner.leader.get());
        for a in addrs.iter().flatten() {
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
        // When a replica first answered this call that it does not lead.
        let mut first_not_leader: Option<Instant> = None;
        // Passes ended by following a hint without a pause, in a row.
        let mut followed = 0u32;
        while Instant::now() < deadline {
            let mut redirected = false;
            // Endpoints tried in this pass, how many of them refused the handshake, and how
            // many could not be reached.
            let (mut tried, mut refused, mut unreachable) = (0usize, 0usize, 0usize);
            let mut tried_here: Vec<SocketAddr> = Vec::new();
            // Whether a replica answered in this pass that it does not lead.
            let mut not_leader = false;
            for addr in self.reachable_first(self.candidates(), deadline).await {
                if Instant::now() >= deadline {
                    break;
                }
                tried += 1;
                tried_here.push(addr);
                let proxy = self
                    .inner
                    .proxies
                    .lock()
                    .expect("proxies lock")
                    .contains(&addr);
                let (r, found) = self.attempt_finding(addr, &req, Some(deadline)).await;
                // No answer from the endpoint itself (not an error it answered with).
                let no_answer = r.is_err();
                let r = match r {
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
                        not_leader = true;
                        if let Some(h) = hint_addr(&hint).await {
                            // A hint at an endpoint that just failed (the dead leader, named
                            // by followers until they elect another) is kept but not
                            // followed at once: that went round without a pause. One this
                            // pass has not tried is followed even when another call set it
                            // already (its search found the new leader, and this call's
                            // attempt at the silent one ended without): it used to wait
                            // out the election poll (100 ms) first. At most
                            // `HINTS_FOLLOWED_MAX` passes in a row end so.
                            let changed = self.inner.leader.set(h);
                            if (changed || !tried_here.contains(&h))
                                && !self.failed_lately(h)
                                && followed < HINTS_FOLLOWED_MAX
                            {
                                redirected = true;
                            }
                        }
                        last_err = Some(Error::NotLeader {
                            leader_addr: Some(hint),
                            leader_id,
                        });
                        if redirected {
                            followed += 1;
                            break;
                        }
                    }
                    Err(e @ Error::TooManyFor { .. }) if !self.inner.cfg.retry_limit_refusals => {
                        return Err(e)
                    }
                    Err(e @ Error::Handshake { .. }) => {
                        self.connection_failed(addr);
                        refused += 1;
                        last_err = Some(e);
                    }
                    Err(e) if e.is_retryable() => {
                        if matches!(e, Error::Connection { .. } | Error::Timeout { .. }) {
                            self.connection_failed(addr);
                            unreachable += usize::from(no_answer);
                        }
                        // A replica electing (or that knows no leader) answers NotLeader
                        // without a hint.
                        not_leader |= matches!(e, Error::NotLeader { .. });
                        last_err = Some(e);
                        // This attempt's own search found the leader elsewhere (a silent
                        // leader superseded by a newer one): go there next, not down the
                        // list. Only that: a hint kept from before (the dead leader the
                        // followers name) or set by concurrent calls would be followed
                        // round and round without a pause.
                        if found.is_some_and(|l| l != addr && !self.failed_lately(l)) {
                            redirected = true;
                            followed += 1;
                            break;
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            // No endpoint answered: their names may point elsewhere now (an old address
            // of a moved replica silent, or reused by a server of another cell).
            if !redirected && tried > 0 && unreachable + refused == tried {
                self.resolve_again();
            }
            // Every endpoint refused the TLS handshake: a certificate or CA to fix, which
            // no retry will.
            if !redirected && tried > 0 && refused == tried {
                if let Some(e) = last_err {
                    return Err(e);
                }
            }
            if !redirected {
                followed = 0;
                attempt += 1;
                // A replica answered that it does not lead: the cell is electing, or its
                // leader is one this client cannot reach (just killed). The replicas name
                // the new leader as soon as it is elected; a growing backoff would find it
                // up to half a second later. Past an election's length (a cell without a
                // quorum), the backoff grows as for any error, so clients do not keep a
                // leaderless cell busy.
                if not_leader {
                    first_not_leader.get_or_insert_with(Instant::now);
                }
                let electing =
                    not_leader && first_not_leader.is_some_and(|t| t.elapsed() < ELECTION_WINDOW);
                let backoff = if electing {
                    ELECTION_POLL
                } else {
                    Duration::from_millis((50 * u64::from(attempt)).min(500))
                };
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
            // Endpoints tried in this pass, how many of them refused the handshake, and how
            // many could not be reached.
            let (mut tried, mut refused, mut unreachable) = (0usize, 0usize, 0usize);
            for addr in self.reachable_first(self.candidates(), deadline).await {
                tried += 1;
                let attempt = async {
                    let conn = self.connection(addr).await?;
                    let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
                    frame::write(&mut send, &req, CLIENT_FRAME_BYTES_MAX).await?;
                    let _ = send.finish();
                    let first: Response = frame::read(&mut recv, CLIENT_FRAME_BYTES_MAX).await?;
                    Ok::<_, Error>((first, recv))
                };
                let t = self.inner.cfg.attempt_timeout;
                let r = match tokio::time::timeout(t, attempt).await {
                    Ok(r) => r,
                    Err(_) => Err(Error::Timeout {
                        what: format!("stream at {addr}"),
                        after_ms: t.as_millis() as u64,
                    }),
                };
                // No answer from the endpoint itself (not an error it answered with).
                let no_answer = r.is_err();
                let r = r.and_then(|(first, recv)| Ok((first?, recv)));
                if let Err(e) = &r {
                    tracing::debug!(%addr, "stream not opened here: {e}");
                }
                match r {
                    Ok((reply, recv)) => {
                        self.inner.leader.set(addr);
                        return Ok((reply, recv, addr));
                    }
                    Err(Error::NotLeader {
                        leader_addr: Some(hint),
                        leader_id,
                    }) => {
                        if let Some(h) = hint_addr(&hint).await {
                            // A hint at an endpoint that just failed (the dead leader, named
                            // by followers until they elect another) is kept but not
                            // followed at once: that went round without a pause.
                            if self.inner.leader.set(h) && !self.failed_lately(h) {
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
                    Err(e @ Error::TooManyFor { .. }) if !self.inner.cfg.retry_limit_refusals => {
                        return Err(e)
                    }
                    Err(e @ Error::Handshake { .. }) => {
                        self.connection_failed(addr);
                        refused += 1;
                        last_err = e
                    }
                    Err(e) if e.is_retryable() => {
                        if matches!(e, Error::Connection { .. } | Error::Timeout { .. }) {
                            self.connection_failed(addr);
                            unreachable += usize::from(no_answer);
                        }
                        last_err = e
                    }
                    Err(e) => return Err(e),
                }
            }
            if !redirected && tried > 0 && unreachable + refused == tried {
                self.resolve_again();
            }
            if !redirected && tried > 0 && refused == tried {
                return Err(last_err);
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

    /// Takes a place for one more session, if the client has one.
    pub(crate) fn session_slot(&self) -> Result<SessionSlot, Error> {
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
            Reply::Status(s) => Ok(*s),
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

    /// A node's ACL (linearizable; needs the read or the admin right on the node).
    pub async fn get_acl(&self, path: &str) -> Result<wire::acl::Acl, Error> {
        wire::path::validate(path)?;
        match self.request(Op::GetAcl { path: path.into() }).await? {
            Reply::Acl { acl, .. } => Ok(acl),
            other => Err(unexpected(&other)),
        }
    }

    /// Replaces a node's ACL (needs the admin right on it, or to be a cell admin);
    /// returns the log index it applied at. Children created later inherit it; existing
    /// ones keep theirs.
    pub async fn set_acl(&self, path: &str, acl: wire::acl::Acl) -> Result<u64, Error> {
        wire::path::validate(path)?;
        acl.check().map_err(|reason| Error::BadRequest { reason })?;
        changed(
            self.request(Op::SetAcl {
                path: path.into(),
                acl,
            })
            .await?,
        )
    }

    /// The cell's admins and its groups with their members, in name order.
    pub async fn security(&self) -> Result<Security, Error> {
        match self.request(Op::Security).await? {
            Reply::Security { admins, groups, .. } => Ok(Security { admins, groups }),
            other => Err(unexpected(&other)),
        }
    }

    /// Creates or replaces a group (cell admins only); returns the log index.
    pub async fn set_group(&self, name: &str, members: Vec<String>) -> Result<u64, Error> {
        wire::acl::check_members(name, &members).map_err(|reason| Error::BadRequest { reason })?;
        changed(
            self.request(Op::SetGroup {
                name: name.into(),
                members,
            })
            .await?,
        )
    }

    /// Removes a group (cell admins only); returns the log index.
    pub async fn remove_group(&self, name: &str) -> Result<u64, Error> {
        wire::acl::check_group_name(name).map_err(|reason| Error::BadRequest { reason })?;
        changed(self.request(Op::RemoveGroup { name: name.into() }).await?)
    }

    /// Adds (`admin`) or removes a cell admin (cell admins only; the last one stays);
    /// returns the log index.
    pub async fn set_admin(&self, identity: &str, admin: bool) -> Result<u64, Error> {
        wire::identity::Identity::parse(identity).map_err(|reason| Error::BadRequest { reason })?;
        changed(
            self.request(Op::SetAdmin {
                identity: identity.into(),
                admin,
            })
            .await?,
        )
    }
}

/// Prefixes and moves (`wire::directory`): what `lockctl dir` uses. Each is for cell
/// admins, except [`Client::prefixes`].
impl Client {
    /// The prefixes this cell has recorded, with their epochs and states (none: the cell
    /// serves every path).
    pub async fn prefixes(&self) -> Result<Vec<wire::directory::PrefixRecord>, Error> {
        match self.request(Op::Prefixes).await? {
            Reply::Prefixes { prefixes, .. } => Ok(prefixes),
            other => Err(unexpected(&other)),
        }
    }

    /// Records where `prefix` stands in this cell; returns the log index. Setting what is
    /// already recorded succeeds (a re-run move goes on).
    pub async fn set_prefix(
        &self,
        prefix: &str,
        epoch: u64,
        state: wire::directory::PrefixState,
    ) -> Result<u64, Error> {
        wire::directory::check_prefix(prefix)?;
        prefix_changed(
            self.request(Op::SetPrefix {
                prefix: prefix.into(),
                epoch,
                state,
            })
            .await?,
        )
    }

    /// A page of `prefix`'s persistent nodes after `after`, and whether more follow.
    pub async fn export_prefix(
        &self,
        prefix: &str,
        after: Option<String>,
    ) -> Result<(Vec<wire::directory::ExportedNode>, bool), Error> {
        wire::directory::check_prefix(prefix)?;
        match self
            .request(Op::ExportPrefix {
                prefix: prefix.into(),
                after,
            })
            .await?
        {
            Reply::Exported { nodes, more, .. } => Ok((nodes, more)),
            other => Err(unexpected(&other)),
        }
    }

    /// Copies `nodes` into `prefix`, which this cell is importing at `epoch` (`first`:
    /// what an earlier copy left is dropped first); returns the log index.
    pub async fn import_prefix(
        &self,
        prefix: &str,
        epoch: u64,
        first: bool,
        nodes: Vec<wire::directory::ExportedNode>,
    ) -> Result<u64, Error> {
        wire::directory::check_prefix(prefix)?;
        prefix_changed(
            self.request(Op::ImportPrefix {
                prefix: prefix.into(),
                epoch,
                first,
                nodes,
            })
            .await?,
        )
    }

    /// Deletes every node of `prefix`, which moved out (or is being imported) at
    /// `epoch`; returns the log index.
    pub async fn drop_prefix(&self, prefix: &str, epoch: u64) -> Result<u64, Error> {
        wire::directory::check_prefix(prefix)?;
        prefix_changed(
            self.request(Op::DropPrefix {
                prefix: prefix.into(),
                epoch,
            })
            .await?,
        )
    }
}

impl Client {
    /// The map of prefixes to cells, from a directory instance (a client made with
    /// [`ClientConfig::directory`] set).
    pub async fn directory(&self) -> Result<wire::directory::DirectoryMap, Error> {
        match self.request(Op::Directory).await? {
            Reply::Directory(map) => Ok(map),
            other => Err(unexpected(&other)),
        }
    }
}

fn prefix_changed(r: Reply) -> Result<u64, Error> {
    match r {
        Reply::PrefixChanged { index } => Ok(index),
        other => Err(unexpected(&other)),
    }
}

/// The cell's admins and groups ([`Client::security`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Security {
    /// Identities that pass every ACL and may change ACLs, groups and admins.
    pub admins: Vec<String>,
    /// Each group's name and members, in name order.
    pub groups: Vec<(String, Vec<String>)>,
}

fn changed(r: Reply) -> Result<u64, Error> {
    match r {
        Reply::SecurityChanged { index } => Ok(index),
        other => Err(unexpected(&other)),
    }
}

/// One request and its answer on a stream of its own on `conn`.
async fn exchange(conn: &quinn::Connection, req: &Request) -> Result<Response, Error> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
    frame::write(&mut send, req, CLIENT_FRAME_BYTES_MAX).await?;
    let _ = send.finish();
    frame::read::<_, Response>(&mut recv, CLIENT_FRAME_BYTES_MAX).await
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

/// An endpoint (`host:port` or `ip:port`) as a socket address: its first address (of
/// IPv6 if `v6` is `Some(true)`, of IPv4 if `Some(false)`: the family of the client's
/// socket), looked up within [`RESOLVE_WITHIN`]; the reason if there is none.
async fn resolve(endpoint: &str, v6: Option<bool>) -> Result<SocketAddr, String> {
    if let Ok(a) = endpoint.parse() {
        return Ok(a);
    }
    match tokio::time::timeout(RESOLVE_WITHIN, tokio::net::lookup_host(endpoint)).await {
        Ok(Ok(mut found)) => found
            .find(|a| v6.is_none_or(|v6| a.is_ipv6() == v6))
            .ok_or_else(|| match v6 {
                None => format!("{endpoint}: resolves to nothing"),
                Some(_) => {
                    format!("{endpoint}: resolves to nothing of this client's address family")
                }
            }),
        Ok(Err(e)) => Err(format!("{endpoint}: {e}")),
        Err(_) => Err(format!(
            "{endpoint}: no answer within {} s",
            RESOLVE_WITHIN.as_secs()
        )),
    }
}

/// A leader hint as a socket address: parsed, or resolved when the cell's members are
/// addressed by name (a Kubernetes StatefulSet's are); `None` if it does not resolve
/// within 250 ms (the client then asks its other endpoints, as before).
async fn hint_addr(hint: &str) -> Option<SocketAddr> {
    if let Ok(a) = hint.parse() {
        return Some(a);
    }
    tokio::time::timeout(Duration::from_millis(250), tokio::net::lookup_host(hint))
        .await
        .ok()?
        .ok()?
        .find(SocketAddr::is_ipv4)
}

#[cfg(test)]
mod tests {
    use super::{hint_addr, newest_leader, tls_refusal, LeadershipAnswer};

    /// A replica leading in the newest term reported is the new leader; one leading in an
    /// older term (cut off, not yet told) is not, nor is anyone while the newest term has
    /// no leader yet (an election under way).
    #[test]
    fn the_new_leader_leads_in_the_newest_term_reported() {
        let a = |port: u16, term: u64, leading: bool| LeadershipAnswer {
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            term,
            leading,
        };
        // The newest term of the answers themselves, as a search's first round has it.
        let newest =
            |v: &[LeadershipAnswer]| newest_leader(v.iter().map(|a| a.term).max().unwrap_or(0), v);
        assert_eq!(newest(&[]), None);
        // Followers of the silent leader, still in its term: nothing newer.
        assert_eq!(newest(&[a(1, 4, false), a(2, 4, false)]), None);
        // A candidate in term 5, no leader yet.
        assert_eq!(newest(&[a(1, 4, false), a(2, 5, false)]), None);
        // Elected in term 5.
        assert_eq!(
            newest(&[a(1, 4, false), a(2, 5, true), a(3, 5, false)]),
            Some(a(2, 5, true).addr)
        );
        // A stale leader of term 3 beside a follower of term 4.
        assert_eq!(newest(&[a(1, 3, true), a(2, 4, false)]), None);
        assert_eq!(
            newest(&[a(1, 3, true), a(2, 4, false), a(3, 4, true)]),
            Some(a(3, 4, true).addr)
        );
        // A later round: the stale leader answers alone (the followers' answers held), but
        // an earlier round named term 4.
        assert_eq!(newest_leader(4, &[a(1, 3, true)]), None);
    }

    /// A leader hint is an address, or a name resolved to an IPv4 address (members named
    /// as a StatefulSet's are); what is neither gives no hint, without waiting. Only
    /// `localhost` is looked up (the machine's own hosts file, no DNS server).
    #[tokio::test]
    async fn a_leader_hint_is_an_address_or_a_name_that_resolves() {
        assert_eq!(
            hint_addr("127.0.0.1:7001").await,
            Some("127.0.0.1:7001".parse().unwrap())
        );
        assert_eq!(
            hint_addr("localhost:7001").await,
            Some("127.0.0.1:7001".parse().unwrap())
        );
        let started = std::time::Instant::now();
        assert_eq!(hint_addr("no port here").await, None);
        assert_eq!(hint_addr("").await, None);
        // No lookup: well under the 250 ms a lookup may take (a wide margin for a loaded
        // machine, where the blocking pool may be slow to start).
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }

    /// QUIC carries TLS alert A as 0x100 + A: the certificate alerts are refusals, other
    /// alerts and transport errors are not.
    #[test]
    fn tls_alerts_that_refuse_a_certificate_are_told_apart() {
        use quinn::TransportErrorCode as Code;
        for alert in [40u8, 42, 43, 44, 45, 46, 48, 49, 51, 116, 120] {
            assert!(tls_refusal(Code::crypto(alert)), "alert {alert}");
        }
        for alert in [0u8, 10, 47, 50, 52, 80, 255] {
            assert!(!tls_refusal(Code::crypto(alert)), "alert {alert}");
        }
        for other in [
            Code::NO_ERROR,
            Code::INTERNAL_ERROR,
            Code::PROTOCOL_VIOLATION,
        ] {
            assert!(!tls_refusal(other), "{other}");
        }
    }
}
