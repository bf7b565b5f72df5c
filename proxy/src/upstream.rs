//! The proxy's side toward the cell: its own session, the KeepAlive batcher, and its event
//! stream (invalidations and watch events for everything its clients cache and watch).
//!
//! One file of about 800 lines with its tests, on purpose: the three share the state of
//! the one upstream session (its id, lease and stream generation) and are read together.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use wire::hash::{HashMap, HashSet};

use client_sdk::Client;
use tokio::sync::oneshot;
use wire::types::{IdRanges, Op, Reply, Request, Response, SessionId, WatchSpec};
use wire::Error;

use crate::hub::{Hub, UpstreamAck, WatchKey};

/// Pause before retrying a batch the leader did not take.
const BATCH_RETRY: Duration = Duration::from_millis(200);
/// How often the event stream checks that it is still at the leader requests reach.
const STREAM_LEADER_CHECK: Duration = Duration::from_millis(500);

struct Waiter {
    received: Instant,
    tx: oneshot::Sender<Response>,
}

/// The proxy's connection to its cell.
pub struct Upstream {
    /// The SDK client dialing the replicas (follows the leader, retries with the same id).
    pub client: Client,
    /// Shared tables.
    pub hub: Arc<Hub>,
    session: AtomicU64,
    queue: Mutex<HashMap<SessionId, Vec<Waiter>>>,
    owed: Mutex<Vec<UpstreamAck>>,
    /// Upstream watches whose re-arming failed: retried until it works or the stream
    /// resets (which re-arms everything).
    to_rearm: Mutex<HashSet<WatchKey>>,
    interval: Duration,
    forward_timeout: Duration,
    /// The leader the event stream is open at (none while it is down).
    attached: Mutex<Option<std::net::SocketAddr>>,
    /// When the clients' caches were flushed ahead because that leader went silent (the
    /// stream still open); cleared when it answers again or the stream is reopened.
    flushed_ahead: Mutex<Option<Instant>>,
    /// When the last batch the leader renewed in full was sent.
    batch_ok_sent: Mutex<Option<Instant>>,
    /// Cached reads waiting for the next upstream read of their node, by node and client
    /// identity (an entry exists while a task is reading that node for its waiters).
    read_rounds: Mutex<HashMap<RoundKey, Vec<oneshot::Sender<Response>>>>,
}

/// A node and the client identity its upstream read is forwarded for.
type RoundKey = (String, String);

fn unavailable(reason: &str) -> Error {
    Error::Unavailable {
        reason: reason.into(),
    }
}

impl Upstream {
    /// A connection to the cell through `client`.
    pub fn new(
        client: Client,
        hub: Arc<Hub>,
        interval: Duration,
        forward_timeout: Duration,
    ) -> Upstream {
        Upstream {
            client,
            hub,
            session: AtomicU64::new(0),
            queue: Mutex::new(HashMap::default()),
            owed: Mutex::new(Vec::new()),
            to_rearm: Mutex::new(HashSet::default()),
            interval,
            forward_timeout,
            attached: Mutex::new(None),
            flushed_ahead: Mutex::new(None),
            batch_ok_sent: Mutex::new(None),
            read_rounds: Mutex::new(HashMap::default()),
        }
    }

    /// The proxy's own session (0 while it has none).
    pub fn session(&self) -> SessionId {
        self.session.load(Ordering::SeqCst)
    }

    /// Sends a request to the leader, retrying (same request id) until the forward
    /// timeout. The leader's address never reaches the client: a `NotLeader` becomes
    /// `Unavailable`, so the client retries here instead of bypassing the proxy.
    pub async fn forward(&self, req: Request) -> Response {
        let deadline = Instant::now() + self.forward_timeout;
        let started = Instant::now();
        match self.client.call_until(req, deadline).await {
            // The cell is slow, electing or loading: the client waits here and resends
            // (same request id). Every other proxy sees the same cell, and clients that
            // moved during a fail-over left their cached values behind, which this
            // proxy's reset then had to wait out for a lease. Never `NotLeader`: that
            // would send the client past the proxy.
            Err(e) if e.is_retryable() && self.hub.own_session_valid(Instant::now()) => {
                Err(Error::Timeout {
                    what: format!("the cell, through this proxy (last error: {e})"),
                    after_ms: started.elapsed().as_millis() as u64,
                })
            }
            // A proxy whose own lease ran out has lost the cell: clients go elsewhere.
            Err(e) if e.is_retryable() => Err(unavailable(&format!(
                "the proxy has lost its connection to the cell ({e})"
            ))),
            // The replicas refused the proxy's own handshake: the proxy's certificate to
            // fix, not the client's; the client may find another proxy.
            Err(e @ Error::Handshake { .. }) => Err(unavailable(&format!(
                "the proxy cannot reach the cell ({e})"
            ))),
            r => r,
        }
    }

    /// [`Upstream::forward`] of a client's request, for the client `identity`
    /// ([`Op::Forwarded`]): the cell answers it as the client's own.
    pub async fn forward_for(&self, identity: &str, req: Request) -> Response {
        let op = Op::Forwarded {
            identity: identity.to_string(),
            op: Box::new(req.op),
        };
        self.forward(Request { op, ..req }).await
    }

    /// Whether the client `identity` owns `session`: known here once this proxy opened
    /// the session for it or the cell confirmed it; else asked of the cell
    /// ([`Upstream::confirm_owner`]). Anything else is [`Error::NotSessionOwner`], or the
    /// cell's answer.
    pub async fn check_owner(&self, identity: &str, session: SessionId) -> Result<(), Error> {
        if session == 0 {
            return Err(Error::SessionRequired);
        }
        if self.hub.owned_by(session, identity) == Some(true) {
            return Ok(());
        }
        self.confirm_owner(identity, session).await
    }

    /// Asks the cell whether `session` is open and the client `identity` owns it (an
    /// empty `Rewatch` forwarded for the client checks both and arms nothing), unless this
    /// proxy already knows another identity owns it; remembers the owner if so.
    pub async fn confirm_owner(&self, identity: &str, session: SessionId) -> Result<(), Error> {
        // The proxy's own upstream session is nobody else's (a client may learn its id
        // from `ProxyStatus`).
        if self.hub.owned_by(session, identity) == Some(false) || session == self.session() {
            return Err(Error::NotSessionOwner {
                session,
                identity: identity.to_string(),
            });
        }
        let check = Request {
            session,
            request_id: 0,
            ack_below: 0,
            op: Op::Rewatch {
                watches: Vec::new(),
            },
        };
        self.forward_for(identity, check).await?;
        self.hub.set_owner(session, identity);
        Ok(())
    }

    /// Reads `path` at the leader as a cached read under the proxy's session, sharing the
    /// read with every client that asks for the same node meanwhile. A read in flight
    /// may reflect the node as it was before a later client asked, so newcomers are not
    /// given its answer: they join the next round, one read sent as soon as the current
    /// one returns, after all of them arrived (so each answer is as fresh as a read of its
    /// own would have been). After an invalidation or a fail-over flush, thousands of
    /// clients re-read the same few nodes at once; this sends one or two reads per node
    /// instead of one per client (each of which the leader had to confirm as leader).
    ///
    /// Each read is forwarded for one client identity (the node's ACL decides at the
    /// leader), so rounds are shared only by clients of the same identity.
    pub async fn cached_read(self: &Arc<Self>, identity: &str, path: &str) -> Response {
        let (tx, rx) = oneshot::channel();
        let key = (path.to_string(), identity.to_string());
        let start = {
            let mut rounds = self.read_rounds.lock().expect("read rounds");
            match rounds.get_mut(&key) {
                Some(next) => {
                    next.push(tx);
                    false
                }
                None => {
                    rounds.insert(key.clone(), vec![tx]);
                    true
                }
            }
        };
        if start {
            // In its own task: a client that stops waiting must not strand the others.
            wire::rt::spawn(self.clone().read_rounds_of(key));
        }
        rx.await
            .unwrap_or_else(|_| Err(unavailable("the proxy stopped reading upstream")))
    }

    /// Serves rounds of reads of `path` until nobody waits for the next one.
    async fn read_rounds_of(self: Arc<Self>, key: (String, String)) {
        // Should this task end any other way (a panic), its node's waiters are answered
        // with an error and the next reader starts a new task, instead of joining a round
        // nobody serves.
        struct Rounds<'a> {
            up: &'a Upstream,
            key: &'a (String, String),
            ended: bool,
        }
        impl Drop for Rounds<'_> {
            fn drop(&mut self) {
                if !self.ended {
                    let rounds = &self.up.read_rounds;
                    let mut rounds = rounds.lock().unwrap_or_else(|e| e.into_inner());
                    rounds.remove(self.key);
                }
            }
        }
        let mut guard = Rounds {
            up: &self,
            key: &key,
            ended: false,
        };
        loop {
            let round = {
                let mut rounds = self.read_rounds.lock().expect("read rounds");
                let round = rounds.get_mut(&key).map(std::mem::take).unwrap_or_default();
                if round.is_empty() {
                    // Removed under the lock: a reader arriving after it starts a new task
                    // (whose entry this task must not touch on its way out).
                    rounds.remove(&key);
                    guard.ended = true;
                    return;
                }
                round
            };
            self.hub
                .counters
                .upstream_reads
                .fetch_add(1, Ordering::Relaxed);
            let (path, identity) = &key;
            let r = self
                .own_for(identity, Op::CachedGet { path: path.clone() })
                .await;
            for tx in round {
                let _ = tx.send(r.clone());
            }
        }
    }

    /// The proxy's session `session` is over: forget it (unless already replaced).
    fn lost_session(&self, session: SessionId) {
        if self
            .session
            .compare_exchange(session, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            tracing::warn!(session, "the proxy's session is over; opening a new one");
            self.hub.set_own_session(None);
        }
    }

    /// A read under the proxy's own session forwarded for the client `identity`: the
    /// replica checks the client's read right, and lets a proxy read under its own
    /// session for it (cached reads the proxy serves, watches it relays).
    pub async fn own_for(&self, identity: &str, op: Op) -> Response {
        self.own(Op::Forwarded {
            identity: identity.to_string(),
            op: Box::new(op),
        })
        .await
    }

    /// A request under the proxy's own session.
    pub async fn own(&self, op: Op) -> Response {
        let session = self.session();
        if session == 0 {
            return Err(unavailable("the proxy is establishing its session"));
        }
        let r = self
            .forward(Request {
                session,
                request_id: 0,
                ack_below: 0,
                op,
            })
            .await;
        match r {
            // The proxy's session, not the client's, is gone: the client must not take it
            // for its own (it would stop renewing a live session).
            Err(Error::SessionExpired { session: s } | Error::UnknownSession { session: s })
                if s == session =>
            {
                self.lost_session(session);
                Err(unavailable("the proxy is re-establishing its session"))
            }
            r => r,
        }
    }

    /// Queues a client's KeepAlive for the next batch and waits for its renewal.
    pub async fn keepalive(&self, session: SessionId, received: Instant) -> Response {
        // A client that renews but leaves an invalidation unacknowledged for a lease loses
        // its session rather than keeping its cache rights: its KeepAlives are no longer
        // relayed, so its lease runs out (here and at the leader) and the invalidation
        // stops waiting for it. Without this the proxy waited for it as long as it
        // renewed, and the leader, waiting for the proxy, would in the end stop renewing
        // the proxy's own session (every client's cache with it).
        let now = Instant::now();
        if self.hub.overdue(session, now, self.hub.lease()) {
            tracing::warn!(
                session,
                "client renews but leaves an invalidation unacknowledged for a lease: no \
                 longer renewed, it loses its session and its cache"
            );
            return Err(Error::SessionExpired { session });
        }
        let (tx, rx) = oneshot::channel();
        self.queue
            .lock()
            .expect("keepalive queue")
            .entry(session)
            .or_default()
            .push(Waiter { received, tx });
        // Two batch periods (and a forwarding round) at most: the client's own attempt
        // waits longer.
        let wait = self.interval * 2 + Duration::from_secs(1);
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(r)) => r,
            // The cell is slow or electing: the client should wait here, not move.
            _ if self.hub.own_session_valid(Instant::now()) => Err(Error::Timeout {
                what: "the leader renewing this KeepAlive".into(),
                after_ms: wait.as_millis() as u64,
            }),
            _ => Err(unavailable("KeepAlive not renewed by the leader in time")),
        }
    }

    /// Sends the acknowledgements owed upstream (each under the session that received
    /// the invalidation; one from a session since replaced is moot and skipped).
    pub fn send_acks(self: &Arc<Self>, acks: Vec<UpstreamAck>) {
        let current = self.session();
        let ids: Vec<u64> = acks
            .into_iter()
            .filter(|(s, _)| *s == current)
            .map(|(_, id)| id)
            .collect();
        if ids.is_empty() {
            return;
        }
        let me = self.clone();
        wire::rt::spawn(async move {
            if let Err(e) = me.own(Op::AckInvalidations { ids: ids.clone() }).await {
                tracing::debug!("upstream invalidation ack failed, will retry: {e}");
                // The leader's write waits for it: try again on the next tick (moot once
                // the session is replaced).
                if me.session() == current {
                    let mut owed = me.owed.lock().expect("owed acks");
                    owed.extend(ids.into_iter().map(|id| (current, id)));
                }
            }
        });
    }

    /// Re-arms upstream watches; fired ones are dispatched to clients (and re-armed for
    /// those left). False if the cell could not be asked.
    pub async fn rearm(self: &Arc<Self>, specs: Vec<WatchSpec>) -> bool {
        let mut todo = specs;
        // Bounded: each round either re-arms or fires; a re-armed watch does not return.
        for _ in 0..16 {
            if todo.is_empty() {
                return true;
            }
            let mut next = Vec::new();
            for chunk in wire::types::rewatch_chunks(&todo) {
                match self
                    .own(Op::Rewatch {
                        watches: chunk.to_vec(),
                    })
                    .await
                {
                    Ok(Reply::Rewatched { fired }) => {
                        for ev in fired {
                            if let Some(spec) = self.hub.fire(&ev) {
                                next.push(spec);
                            }
                        }
                    }
                    Ok(other) => {
                        tracing::warn!("unexpected answer to Rewatch: {other:?}");
                        return false;
                    }
                    Err(e) => {
                        tracing::debug!("re-arming upstream watches failed: {e}");
                        return false;
                    }
                }
            }
            todo = next;
        }
        todo.is_empty()
    }

    /// Re-arms in the background (a watch whose upstream copy an event consumed); on
    /// failure the stream loop retries it every half second.
    pub fn rearm_later(self: &Arc<Self>, spec: WatchSpec) {
        let me = self.clone();
        wire::rt::spawn(async move {
            if !me.rearm(vec![spec.clone()]).await {
                me.to_rearm
                    .lock()
                    .expect("re-arm set")
                    .insert((spec.path, spec.kind));
            }
        });
    }

    /// Retries the re-arms that failed (with the current lowest index of each).
    fn retry_rearms(self: &Arc<Self>) {
        let keys: Vec<WatchKey> = self.to_rearm.lock().expect("re-arm set").drain().collect();
        let specs: Vec<WatchSpec> = keys.iter().filter_map(|k| self.hub.watch_spec(k)).collect();
        if specs.is_empty() {
            return;
        }
        let me = self.clone();
        wire::rt::spawn(async move {
            if !me.rearm(specs.clone()).await {
                let mut set = me.to_rearm.lock().expect("re-arm set");
                set.extend(specs.into_iter().map(|s| (s.path, s.kind)));
            }
        });
    }

    /// Sends the collected KeepAlives (and the proxy's own) as one batch each interval.
    pub async fn batch_loop(self: Arc<Self>) {
        let mut next = Instant::now() + self.interval;
        loop {
            tokio::time::sleep_until(next).await;
            let started = Instant::now();
            let ok = self.send_batch().await;
            next = next_batch_at(started, Instant::now(), ok, self.interval);
        }
    }

    async fn send_batch(self: &Arc<Self>) -> bool {
        // Every KeepAlive received since the previous batch started goes in this one, also
        // when its client has stopped waiting for the answer: the wait (two intervals and
        // a second) can run out while a slow batch is in flight, and a client whose
        // retries each arrived during one slow batch and timed out before the next
        // started was never forwarded at all (103 sessions lost in a `profile --fault
        // kill` run). Renewing it is what the client asked for; the leader's lease runs
        // from the batch, as for every renewal through a proxy. A failed batch is retried
        // only for those still waiting (below), so a dead client is renewed at most once
        // after its last KeepAlive.
        let mut waiting: HashMap<SessionId, Vec<Waiter>> =
            std::mem::take(&mut *self.queue.lock().expect("keepalive queue"));
        let own = self.session();
        let mut sessions: Vec<SessionId> = waiting.keys().copied().collect();
        if own != 0 && !waiting.contains_key(&own) {
            sessions.push(own);
        }
        if sessions.is_empty() {
            return true;
        }
        let sent = Instant::now();
        let mut renewed_all = Vec::new();
        let mut expired_all = Vec::new();
        let mut unknown_all = Vec::new();
        let mut own_unacked = Vec::new();
        let mut lease_ms = None;
        let mut ok = true;
        // The chunks of a big batch go together: one after the other, a slow leader's
        // delay would count once per chunk.
        let answers =
            futures::future::join_all(sessions.chunks(wire::KEEPALIVE_BATCH_MAX).map(|chunk| {
                self.hub
                    .counters
                    .keepalive_batches
                    .fetch_add(1, Ordering::Relaxed);
                self.forward(Request {
                    session: 0,
                    request_id: 0,
                    ack_below: 0,
                    op: Op::KeepAliveBatch {
                        sessions: chunk.to_vec(),
                    },
                })
            }))
            .await;
        for answer in answers {
            match answer {
                Ok(Reply::KeepAliveBatch {
                    session_lease_ms,
                    renewed,
                    expired,
                    unknown,
                    unacknowledged,
                }) => {
                    own_unacked.extend(
                        unacknowledged
                            .into_iter()
                            .filter(|(s, _, _)| *s == own)
                            .map(|(_, id, paths)| (id, paths)),
                    );
                    lease_ms = Some(session_lease_ms);
                    renewed_all.extend(renewed);
                    expired_all.extend(expired);
                    unknown_all.extend(unknown);
                }
                Ok(other) => {
                    tracing::warn!("unexpected answer to KeepAliveBatch: {other:?}");
                    ok = false;
                }
                Err(e) => {
                    tracing::debug!("KeepAlive batch failed: {e}");
                    ok = false;
                }
            }
        }
        tracing::debug!(
            sessions = %IdRanges(&sessions),
            renewed = renewed_all.len(),
            expired = expired_all.len(),
            unknown = unknown_all.len(),
            ok,
            ms = sent.elapsed().as_millis() as u64,
            "upstream KeepAliveBatch"
        );
        if let Some(ms) = lease_ms {
            self.hub.set_lease_ms(ms);
        }
        if ok {
            *self.batch_ok_sent.lock().expect("batch time") = Some(sent);
        }
        // Invalidations our upstream stream missed (the leader repeats what is overdue):
        // relayed like any other, or acknowledged again if we were done with them.
        let acks: Vec<UpstreamAck> = own_unacked
            .into_iter()
            .filter_map(|(id, paths)| self.hub.invalidate(own, id, paths))
            .collect();
        self.send_acks(acks);
        let lease_ms = lease_ms.unwrap_or_else(|| self.hub.lease().as_millis() as u64);
        self.hub
            .counters
            .keepalives_batched
            .fetch_add(renewed_all.len() as u64, Ordering::Relaxed);
        // A client whose event stream missed an invalidation hears of it here.
        let mut overdue = self.hub.unacknowledged_many(
            &renewed_all,
            Duration::from_millis(wire::INVALIDATION_RESEND_MS),
            wire::KEEPALIVE_UNACKED_MAX,
        );
        for s in renewed_all {
            if s == own {
                self.hub.set_own_renewed(sent);
            }
            let mut replies = waiting.remove(&s).unwrap_or_default();
            if replies.is_empty() {
                continue;
            }
            let unacknowledged = overdue.remove(&s).unwrap_or_default();
            for w in replies.drain(..) {
                self.hub
                    .renewed(s, w.received, Duration::from_millis(lease_ms));
                let _ = w.tx.send(Ok(Reply::KeepAlive {
                    session_lease_ms: lease_ms,
                    unacknowledged: unacknowledged.clone(),
                }));
            }
        }
        let ended = expired_all
            .into_iter()
            .map(|s| (s, Error::SessionExpired { session: s }))
            .chain(
                unknown_all
                    .into_iter()
                    .map(|s| (s, Error::UnknownSession { session: s })),
            );
        for (s, err) in ended {
            if s == own {
                self.lost_session(s);
            }
            for w in waiting.remove(&s).unwrap_or_default() {
                let _ = w.tx.send(Err(err.clone()));
            }
            let acks = self.hub.session_ended(s);
            // Acks of an ended session's waits: sent by whoever holds an Arc (the tick).
            self.pending_acks(acks);
        }
        // Neither renewed nor expired: try again in the next batch while they still wait.
        let mut q = self.queue.lock().expect("keepalive queue");
        for (s, ws) in waiting {
            let ws: Vec<Waiter> = ws.into_iter().filter(|w| !w.tx.is_closed()).collect();
            if !ws.is_empty() {
                q.entry(s).or_default().extend(ws);
            }
        }
        ok
    }

    fn pending_acks(&self, acks: Vec<UpstreamAck>) {
        if !acks.is_empty() {
            self.owed.lock().expect("owed acks").extend(acks);
        }
    }
}

impl Upstream {
    /// Upkeep every 100 ms: stops waiting for clients whose lease ran out and sends the
    /// acknowledgements that completes.
    pub async fn tick_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            let mut acks = self.hub.tick(Instant::now());
            acks.append(&mut self.owed.lock().expect("owed acks"));
            self.send_acks(acks);
        }
    }

    async fn ensure_session(&self) -> Result<SessionId, Error> {
        let s = self.session();
        if s != 0 {
            return Ok(s);
        }
        let req = Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::CreateSession,
        };
        let sent = Instant::now();
        match self.forward(req).await? {
            Reply::SessionCreated {
                session,
                session_lease_ms,
            } => {
                self.hub.set_lease_ms(session_lease_ms);
                self.hub.set_own_session(Some(sent));
                self.session.store(session, Ordering::SeqCst);
                tracing::info!(session, "proxy session opened");
                Ok(session)
            }
            other => Err(Error::Internal {
                reason: format!("unexpected answer to CreateSession: {other:?}"),
            }),
        }
    }

    /// Keeps the proxy's event stream open at the leader. Before every (re)connection the
    /// proxy's clients drop what they cached through it (the leader takes the reconnection
    /// as the proxy's confirmation); after it, every upstream watch is re-armed.
    pub async fn stream_loop(self: Arc<Self>) {
        loop {
            let down_at = Instant::now();
            self.hub.set_ready(false);
            let session = match self.ensure_session().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!("no proxy session yet: {e}");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
            };
            let reset_at = Instant::now();
            // Flushed already if the leader went silent before the stream broke.
            *self.flushed_ahead.lock().expect("flushed ahead") = None;
            let (ids, ahead) = self.hub.reset_unless_flushed();
            // Every client, not only this reset's: one still owing an earlier flush or
            // invalidation holds no paths, so this reset did not include it. Opening the
            // stream tells the leader nothing cached here is left, so no time limit
            // here: the wait is bounded by the clients' leases (the tick stops waiting
            // for one whose lease ran out) and a client that keeps renewing without
            // acknowledging is no longer renewed after a lease (`keepalive`), so it ends
            // within two leases.
            let mut logged = false;
            while !self.hub.nothing_owed() {
                if !logged && reset_at.elapsed() > self.hub.lease() {
                    tracing::warn!(
                        "upstream stream waits for clients still owing acknowledgements"
                    );
                    logged = true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let flushed_at = Instant::now();
            let req = Request {
                session,
                request_id: 0,
                ack_below: 0,
                op: Op::Events,
            };
            let deadline = Instant::now() + self.hub.lease() / 3;
            let (mut recv, addr) = match self.client.open_stream(req, deadline).await {
                Ok((reply, recv, addr)) => {
                    if let Reply::EventsOpened { index } = reply {
                        self.hub.saw_index(index);
                    }
                    (recv, addr)
                }
                Err(Error::SessionExpired { .. }) | Err(Error::UnknownSession { .. }) => {
                    self.lost_session(session);
                    continue;
                }
                Err(e) => {
                    tracing::debug!("upstream event stream not open: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Everything is re-armed below; earlier failures are moot.
            self.to_rearm.lock().expect("re-arm set").clear();
            let all = self.hub.all_watches();
            if !self.rearm(all.clone()).await {
                // Not a reason to drop the stream (and flush every client again): retry.
                let mut set = self.to_rearm.lock().expect("re-arm set");
                set.extend(all.into_iter().map(|s| (s.path, s.kind)));
            }
            *self.attached.lock().expect("attached") = Some(addr);
            self.hub.set_ready(true);
            let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_millis() as u64;
            let now = Instant::now();
            // Where a fail-over's time goes at the proxy: writes to what its clients cached
            // wait for this stream (the leader's sign that they flushed).
            tracing::info!(
                session,
                leader = %addr,
                clients_flushed = ids.len(),
                flushed_ahead = ahead,
                session_ms = ms(down_at, reset_at),
                flush_ms = ms(reset_at, flushed_at),
                open_ms = ms(flushed_at, now),
                "upstream event stream open"
            );
            let (frames_tx, mut frames) = tokio::sync::mpsc::channel(1024);
            let reader = wire::rt::spawn(async move {
                loop {
                    let frame: Result<Response, Error> =
                        wire::frame::read(&mut recv, wire::CLIENT_FRAME_BYTES_MAX).await;
                    let end = !matches!(frame, Ok(Ok(_)));
                    if frames_tx.send(frame).await.is_err() || end {
                        return;
                    }
                }
            });
            let mut check = tokio::time::interval(STREAM_LEADER_CHECK);
            check.tick().await;
            loop {
                let frame = tokio::select! {
                    f = frames.recv() => match f {
                        Some(f) => f,
                        None => break,
                    },
                    _ = check.tick() => {
                        // Another leader, a replaced session, or a session the leader may
                        // have expired (nothing renewed it for a lease): start over.
                        if self.session() != session
                            || self.client.leader_hint().is_some_and(|l| l != addr)
                            || !self.hub.own_session_valid(Instant::now())
                        {
                            break;
                        }
                        self.resume_if_answered(addr);
                        self.retry_rearms();
                        continue;
                    }
                };
                match frame {
                    Ok(Ok(Reply::Event(ev))) => {
                        if let Some(spec) = self.hub.fire(&ev) {
                            self.rearm_later(spec);
                        }
                    }
                    Ok(Ok(Reply::Invalidate { id, paths })) => {
                        if let Some(ack) = self.hub.invalidate(session, id, paths) {
                            self.send_acks(vec![ack]);
                        }
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        tracing::info!("upstream event stream ended: {e}");
                        break;
                    }
                    Err(e) => {
                        tracing::info!("upstream event stream broke: {e}");
                        break;
                    }
                }
            }
            reader.abort();
            *self.attached.lock().expect("attached") = None;
            self.hub.set_ready(false);
        }
    }

    /// Flushes the clients' caches as soon as the leader the event stream is open at goes
    /// silent (a request to it waited a second with nothing received), without waiting
    /// for the SDK's probe to give it up a second later: after a kill or a freeze the
    /// flush (0.6–1.2 s for 12 500 clients on two cores) then runs while the cell elects,
    /// instead of after, and the stream reopens at the new leader without a second one.
    /// Nothing is cached here until the stream is ready again. If the leader answers
    /// after all, caching resumes on the same stream: invalidations that arrive meanwhile
    /// wait for every client that has not yet dropped the node (see `Hub::invalidate`).
    pub async fn silence_loop(self: Arc<Self>) {
        let mut silences = self.client.silences();
        loop {
            let addr = match silences.recv().await {
                Ok(a) => a,
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            if *self.attached.lock().expect("attached") != Some(addr) || !self.hub.ready() {
                continue;
            }
            *self.flushed_ahead.lock().expect("flushed ahead") = Some(Instant::now());
            let ids = self.hub.reset();
            tracing::info!(
                leader = %addr,
                clients_flushed = ids.len(),
                "the leader went silent: clients' caches flushed ahead of a fail-over"
            );
        }
    }

    /// After a flush ahead, a batch sent later and renewed in full by the leader at
    /// `addr` (the stream's) shows it alive: caching resumes on the open stream.
    fn resume_if_answered(&self, addr: std::net::SocketAddr) {
        let mut ahead = self.flushed_ahead.lock().expect("flushed ahead");
        let Some(at) = *ahead else {
            return;
        };
        let answered = self
            .batch_ok_sent
            .lock()
            .expect("batch time")
            .is_some_and(|sent| sent > at);
        if answered && self.client.leader_hint() == Some(addr) {
            *ahead = None;
            self.hub.set_ready(true);
            tracing::info!(leader = %addr, "the leader answered again: caching resumes");
        }
    }
}

/// When the batch after one that started at `started` and ended at `now` goes: an
/// interval after the start of a good batch, so after a slow one (a fail-over, a loaded
/// leader) the KeepAlives that queued meanwhile go at once instead of waiting out another
/// interval on top (in full-scale freeze runs this took the sessions whose local lease ran
/// out from thousands to none); [`BATCH_RETRY`] after a failed one.
fn next_batch_at(started: Instant, now: Instant, ok: bool, interval: Duration) -> Instant {
    if ok {
        started + interval
    } else {
        now + BATCH_RETRY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_batch_is_followed_at_once_and_a_quick_one_after_its_interval() {
        let t0 = Instant::now();
        let interval = Duration::from_secs(1);
        // Quick: the next one an interval after this one started.
        let quick = next_batch_at(t0, t0 + Duration::from_millis(100), true, interval);
        assert_eq!(quick, t0 + interval);
        // Slow (2.4 s, as when the leader froze): due already, so it goes at once.
        let end = t0 + Duration::from_millis(2_400);
        assert!(next_batch_at(t0, end, true, interval) <= end);
        // Failed: retried shortly after it ended, not at once.
        assert_eq!(next_batch_at(t0, end, false, interval), end + BATCH_RETRY);
    }
}
