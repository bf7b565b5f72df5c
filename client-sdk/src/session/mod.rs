//! A session: KeepAlives, the local lease clock, and the node operations.
//!
//! The local lease clock starts when a KeepAlive is *sent*, so the client's idea of its
//! expiry is always earlier than the leader's (which runs from when it received it). When
//! the local lease runs out without a renewal the session is in [`SessionState::Jeopardy`]:
//! the application must stop acting on its locks. The library keeps trying every replica
//! for a grace period; it ends in `Healthy` again (the session survived) or `Expired`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use tokio::sync::{broadcast, watch};
use wire::types::{
    CreateMode, NodeStat, Op, Predecessor, Reply, Request, RequestId, SessionId, TxnOp, TxnResult,
};
use wire::Error;

use crate::cache::{Cache, CacheStats, CachedValue};
use crate::client::{unexpected, Client};
use crate::watch::Registry;

mod events;
mod keepalive;
mod pins;
mod watches;

use events::event_loop;
use keepalive::keepalive_loop;

/// Something the application should know about its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEvent {
    /// The local lease ran out without a renewal: stop acting on locks now.
    Jeopardy,
    /// The session was confirmed after jeopardy: its locks are still held.
    Safe,
    /// The session is over: its locks and ephemeral nodes are gone.
    Expired,
    /// The cell's leader changed. Watches were re-armed (any that should have fired in the
    /// gap fired); cached values must be dropped.
    FailOver,
}

/// Where a session stands, from the client's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// The local lease is valid: locks may be acted on.
    Healthy,
    /// The local lease ran out without a renewal: stop acting on locks; the library keeps
    /// trying to reach the cell until the grace period ends.
    Jeopardy,
    /// The cell ended the session (or the grace period ran out): everything it held is gone.
    Expired,
}

/// The result of a create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    /// The node's actual path (with the sequence suffix when sequential).
    pub path: String,
    /// Its metadata; `token` is the fencing token.
    pub stat: NodeStat,
    /// For sequential nodes: the sibling just below it when it was created.
    pub predecessor: Option<Predecessor>,
}

/// Widest spread of request ids in flight: a new request waits until its id is less than
/// this far above the oldest unanswered one. Half the cell's dedup window
/// ([`wire::DEDUP_RESULTS_MAX`]), so the cell always has room for every unacknowledged
/// result and never refuses a request of this session for lack of it.
pub const IN_FLIGHT_MAX: u64 = wire::DEDUP_RESULTS_MAX as u64 / 2;

struct Inner {
    client: Client,
    id: SessionId,
    lease: Duration,
    requests: Mutex<Requests>,
    request_done: tokio::sync::Notify,
    state_tx: watch::Sender<SessionState>,
    /// The state again, as a number, for [`Session::lease_valid`] and
    /// [`Session::state`] to read without a lock: holders call them before every action,
    /// and a process may have thousands of sessions. Written with the watch, under its
    /// lock, before subscribers are woken.
    state_now: AtomicU8,
    /// When the local lease runs out, in nanoseconds since `opened` (every deadline is
    /// counted from a KeepAlive sent after the session was opened, so never earlier).
    local_deadline_ns: AtomicU64,
    /// When the request that opened the session was sent: the origin of `local_deadline_ns`.
    opened: Instant,
    keepalives_stopped: AtomicBool,
    events: broadcast::Sender<SessionEvent>,
    watches: Registry,
    watch_events: std::sync::atomic::AtomicU64,
    cache: Mutex<Cache>,
    /// Bumped each time the event stream (re)connects.
    stream_generation: std::sync::atomic::AtomicU64,
    /// True while the event stream is connected and its watches re-armed: a cached read
    /// (or a pin's read) is trusted only if it began and ended while this held, on one
    /// connection of the stream (the leader that answered it may otherwise be one whose
    /// successor took the stream's reconnection as proof that this session dropped
    /// everything it cached).
    stream_up: AtomicBool,
    /// Woken when the event stream is back, and when the session is safe again: pins
    /// left unconfirmed are read again then.
    reconnected: Arc<tokio::sync::Notify>,
    /// The last successful KeepAlive: when it was answered, and its round trip.
    last_keepalive: Mutex<Option<(Instant, Duration)>>,
}

impl Inner {
    /// Where the event stream stands now, for a read to compare with at its end.
    fn stream_mark(&self) -> Option<u64> {
        self.stream_up
            .load(Ordering::SeqCst)
            .then(|| self.stream_generation.load(Ordering::SeqCst))
    }

    /// True if the event stream was up at `mark` and still is, on the same connection.
    fn stream_unchanged(&self, mark: Option<u64>) -> bool {
        mark.is_some() && self.stream_mark() == mark
    }

    /// Waits until the event stream is up or `until` passes; true if it is up.
    async fn wait_stream_up(&self, until: Instant) -> bool {
        loop {
            let mut back = Box::pin(self.reconnected.clone().notified_owned());
            back.as_mut().enable();
            if self.stream_mark().is_some() {
                return true;
            }
            if tokio::time::timeout_at(until, back).await.is_err() {
                return false;
            }
        }
    }

    /// The state, without taking the watch's lock.
    fn state(&self) -> SessionState {
        match self.state_now.load(Ordering::Acquire) {
            0 => SessionState::Healthy,
            1 => SessionState::Jeopardy,
            _ => SessionState::Expired,
        }
    }

    /// When the local lease runs out.
    fn local_deadline(&self) -> Instant {
        self.opened + Duration::from_nanos(self.local_deadline_ns.load(Ordering::Acquire))
    }

    /// Moves the local lease's end to `at` (not before the session was opened).
    fn set_local_deadline(&self, at: Instant) {
        let ns = at.saturating_duration_since(self.opened).as_nanos();
        self.local_deadline_ns
            .store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Release);
    }

    /// Moves to `to`, telling subscribers what changed. `Expired` is final.
    fn set_state(&self, to: SessionState) {
        let mut from = SessionState::Healthy;
        let changed = self.state_tx.send_if_modified(|s| {
            from = *s;
            if *s == to || *s == SessionState::Expired {
                return false;
            }
            *s = to;
            let n = match to {
                SessionState::Healthy => 0,
                SessionState::Jeopardy => 1,
                SessionState::Expired => 2,
            };
            self.state_now.store(n, Ordering::Release);
            true
        });
        if !changed {
            return;
        }
        if to != SessionState::Healthy {
            // The lease is in doubt (or over): cached values may no longer be trusted.
            self.cache.lock().expect("cache lock").flush();
        } else {
            // Safe again: pins left unconfirmed are read again now.
            self.reconnected.notify_waiters();
        }
        let ev = match (from, to) {
            (_, SessionState::Jeopardy) => {
                tracing::warn!(
                    session = self.id,
                    "session in jeopardy: local lease ran out"
                );
                SessionEvent::Jeopardy
            }
            (SessionState::Jeopardy, SessionState::Healthy) => SessionEvent::Safe,
            (_, SessionState::Expired) => {
                self.watches.clear();
                SessionEvent::Expired
            }
            _ => return,
        };
        let _ = self.events.send(ev);
    }
}

/// Request ids: the next one, and those sent but not yet answered.
struct Requests {
    next: RequestId,
    outstanding: BTreeSet<RequestId>,
}

/// One session; cheap to clone. Dropping every clone does not close the session (the
/// KeepAlive task keeps it alive until [`Session::close`] or [`Session::stop_keepalives`]).
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl Session {
    pub(crate) async fn open(
        client: Client,
        slot: crate::client::SessionSlot,
    ) -> Result<Session, Error> {
        let sent = Instant::now();
        let (id, lease_ms) = match client.request(Op::CreateSession).await? {
            Reply::SessionCreated {
                session,
                session_lease_ms,
            } => (session, session_lease_ms),
            other => return Err(unexpected(&other)),
        };
        let lease = Duration::from_millis(lease_ms);
        tracing::debug!(session = id, endpoints = ?client.config().endpoints, "session opened");
        let (state_tx, _) = watch::channel(SessionState::Healthy);
        let cache = Mutex::new(Cache::new(
            client.config().cache_entries_max,
            client.config().cache_bytes_max,
        ));
        let inner = Arc::new(Inner {
            client,
            id,
            lease,
            requests: Mutex::new(Requests {
                next: 1,
                outstanding: BTreeSet::new(),
            }),
            request_done: tokio::sync::Notify::new(),
            state_tx,
            state_now: AtomicU8::new(0),
            local_deadline_ns: AtomicU64::new(0),
            opened: sent,
            keepalives_stopped: AtomicBool::new(false),
            events: broadcast::channel(64).0,
            watches: Registry::default(),
            watch_events: std::sync::atomic::AtomicU64::new(0),
            cache,
            stream_generation: std::sync::atomic::AtomicU64::new(0),
            stream_up: AtomicBool::new(false),
            reconnected: Arc::new(tokio::sync::Notify::new()),
            last_keepalive: Mutex::new(None),
        });
        inner.set_local_deadline(sent + wire::local_lease(lease));
        wire::rt::spawn(keepalive_loop(inner.clone()));
        wire::rt::spawn(event_loop(inner.clone(), slot));
        Ok(Session { inner })
    }

    /// The session id (`wire::types::session_id`: the log index of its creation times
    /// `wire::types::SESSIONS_PER_ENTRY`, plus its place among the sessions that entry opened).
    pub fn id(&self) -> SessionId {
        self.inner.id
    }

    /// The lease the cell granted.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The current state.
    pub fn state(&self) -> SessionState {
        self.inner.state()
    }

    /// True while the session is [`SessionState::Healthy`] and its local lease (from
    /// when the last answered KeepAlive was sent, shortened for clock drift) has not run
    /// out, checked against the clock now: the state is set by the KeepAlive loop, which
    /// may run late (a starved runtime) or not at all ([`Session::stop_keepalives`]).
    pub fn lease_valid(&self) -> bool {
        self.inner.state() == SessionState::Healthy && Instant::now() < self.inner.local_deadline()
    }

    /// A receiver of state changes.
    pub fn subscribe(&self) -> watch::Receiver<SessionState> {
        self.inner.state_tx.subscribe()
    }

    /// A receiver of session events (jeopardy, safe, expired, fail-over).
    pub fn events(&self) -> broadcast::Receiver<SessionEvent> {
        self.inner.events.subscribe()
    }

    /// Waits until the session is expired (returns at once if it already is).
    pub async fn expired(&self) {
        let mut rx = self.subscribe();
        let _ = rx.wait_for(|s| *s == SessionState::Expired).await;
    }

    /// Number of watch events this session has received (from its event stream or from
    /// re-arming after a fail-over).
    pub fn watch_events_received(&self) -> u64 {
        self.inner.watch_events.load(Ordering::Relaxed)
    }

    /// Number of this session's watches that have not fired yet.
    pub fn pending_watches(&self) -> usize {
        self.inner.watches.len()
    }

    /// When the local lease runs out unless renewed: the cell's lease counted from when
    /// the last acknowledged KeepAlive was sent, shortened by
    /// [`wire::CLOCK_DRIFT_PERMILLE_MAX`] so it ends before the leader's even if the
    /// leader's clock runs fast.
    pub fn local_deadline(&self) -> Instant {
        self.inner.local_deadline()
    }

    /// The last KeepAlive that renewed the lease: when its answer arrived, and its round
    /// trip (retries included; through a proxy, this includes the wait for the proxy's
    /// next batch). `None` until the first renewal. For monitoring and load tests.
    pub fn last_keepalive(&self) -> Option<(Instant, Duration)> {
        *self.inner.last_keepalive.lock().expect("keepalive lock")
    }

    /// Stops sending KeepAlives without closing the session, as if the process had died:
    /// the cell expires the session one lease after its last renewal. Its event stream is
    /// not reopened once it breaks either, so the session does not learn of its expiry
    /// from the cell ([`Session::lease_valid`] still ends with the local lease). For
    /// tests and fault drills.
    pub fn stop_keepalives(&self) {
        self.inner.keepalives_stopped.store(true, Ordering::SeqCst);
    }

    /// Allocates the next request id once it is within [`IN_FLIGHT_MAX`] of the oldest
    /// unanswered one. It stays unanswered (so the cell keeps its result) until the
    /// returned slot is dropped.
    pub(crate) async fn request_slot(&self) -> RequestSlot {
        loop {
            let notified = self.inner.request_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut r = self.inner.requests.lock().expect("requests lock");
                let oldest = r.outstanding.first().copied().unwrap_or(r.next);
                if r.next - oldest < IN_FLIGHT_MAX {
                    let id = r.next;
                    r.next += 1;
                    r.outstanding.insert(id);
                    // No await before the slot exists: a dropped future frees the id.
                    return RequestSlot {
                        inner: self.inner.clone(),
                        id,
                    };
                }
            }
            notified.await;
        }
    }

    /// Sends one request of this session, retried with the same id until answered.
    pub async fn call(&self, op: Op) -> Result<Reply, Error> {
        // Bad input fails here, before any RPC, with the error the cell would give.
        check_locally(&op)?;
        // Even if this future is dropped mid-flight, the id leaves the window.
        let slot = self.request_slot().await;
        let deadline = Instant::now() + self.request_timeout();
        self.call_in(&slot, op, deadline).await
    }

    /// Sends `op` under `slot`'s request id, retried (with that id) until `deadline`.
    /// Sent again under the same slot, it is answered with the outcome of the first send
    /// that applied: the cell keeps the result until the id is acknowledged, which only
    /// happens once the slot is dropped.
    pub(crate) async fn call_in(
        &self,
        slot: &RequestSlot,
        op: Op,
        deadline: Instant,
    ) -> Result<Reply, Error> {
        check_locally(&op)?;
        // Every id below the oldest unanswered one has been answered: the cell may forget
        // their results. Never above our own id, which is unanswered.
        let ack_below = {
            let r = self.inner.requests.lock().expect("requests lock");
            r.outstanding
                .first()
                .copied()
                .unwrap_or(r.next)
                .min(slot.id)
        };
        let r = self
            .inner
            .client
            .call_until(
                Request {
                    session: self.inner.id,
                    request_id: slot.id,
                    ack_below,
                    op,
                },
                deadline,
            )
            .await;
        if let Err(Error::SessionExpired { .. }) = &r {
            self.inner.set_state(SessionState::Expired);
        }
        r
    }

    /// Sends `op` under `slot` until its outcome is known: an answer, or an error the
    /// cell decided (see [`outcome_unknown`]). Each round retries for the client's
    /// request timeout; rounds go on until `give_up` (then the last error, the outcome
    /// still unknown, is returned) or, without one, until the session is over (then
    /// `SessionExpired`: whatever the request created is gone with it).
    pub(crate) async fn call_until_known(
        &self,
        slot: &RequestSlot,
        op: Op,
        give_up: Option<Instant>,
    ) -> Result<Reply, Error> {
        let round = self.request_timeout();
        let mut pause = Duration::from_millis(50);
        loop {
            if self.is_over() {
                return Err(Error::SessionExpired {
                    session: self.inner.id,
                });
            }
            let now = Instant::now();
            let deadline = give_up.map_or(now + round, |g| g.min(now + round));
            match self.call_in(slot, op.clone(), deadline).await {
                Err(e) if outcome_unknown(&e) => {
                    let now = Instant::now();
                    if give_up.is_some_and(|g| now >= g) {
                        return Err(e);
                    }
                    let until = give_up.map_or(now + pause, |g| g.min(now + pause));
                    tokio::time::sleep_until(until).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                r => return r,
            }
        }
    }

    /// How long one call retries before it gives up ([`crate::ClientConfig::request_timeout`]).
    pub(crate) fn request_timeout(&self) -> Duration {
        self.inner.client.config().request_timeout
    }

    /// True once the session is over, or so surely over that nothing it created can
    /// outlast it: expired (or closed), or its local lease ran out a grace period ago,
    /// when the KeepAlive loop gives up too (a session whose KeepAlives were stopped
    /// never hears of its end otherwise).
    pub(crate) fn is_over(&self) -> bool {
        self.inner.state() == SessionState::Expired
            || Instant::now()
                >= self.inner.local_deadline() + self.inner.client.config().grace_period
    }

    async fn read(&self, op: Op) -> Result<Reply, Error> {
        let r = self
            .inner
            .client
            .call(Request {
                session: self.inner.id,
                request_id: 0,
                ack_below: 0,
                op,
            })
            .await;
        if let Err(Error::SessionExpired { .. }) = &r {
            self.inner.set_state(SessionState::Expired);
        }
        r
    }
    /// The sequential sibling just below `path` (by sequence number), if any; `NoNode` if
    /// `path` itself is gone. Linearizable.
    pub async fn predecessor(&self, path: &str) -> Result<Option<Predecessor>, Error> {
        wire::path::validate(path)?;
        match self.read(Op::Predecessor { path: path.into() }).await? {
            Reply::Predecessor { predecessor } => Ok(predecessor),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a node through the session's consistent cache: served locally (no RPC) while
    /// the session is healthy and its local lease valid; otherwise read at the leader, which
    /// records this session as a cacher and invalidates it before any later write to the
    /// node commits. `None` means the node does not exist (absence is cached too). The
    /// stat's `children_count` and `children_version` are always 0 (children are not
    /// cached: use [`Session::children`]).
    pub async fn get_cached(&self, path: &str) -> Result<CachedValue, Error> {
        wire::path::validate(path)?;
        let usable =
            || self.state() == SessionState::Healthy && Instant::now() < self.local_deadline();
        // A fresh session's event stream may still be connecting: its first cached reads
        // wait for it (up to a second), or they could not be kept.
        if usable()
            && self.inner.stream_mark().is_none()
            && self.inner.stream_generation.load(Ordering::SeqCst) <= 1
        {
            self.inner
                .wait_stream_up(Instant::now() + Duration::from_secs(1))
                .await;
        }
        let mark = self.inner.stream_mark();
        let generation = {
            let mut cache = self.inner.cache.lock().expect("cache lock");
            if usable() {
                if let Some(v) = cache.get(path) {
                    return Ok(v);
                }
            } else {
                cache.count_miss();
            }
            cache.generation()
        };
        match self.read(Op::CachedGet { path: path.into() }).await? {
            Reply::CachedData {
                value, cachable, ..
            } => {
                if cachable && usable() && self.inner.stream_unchanged(mark) {
                    self.inner.cache.lock().expect("cache lock").insert(
                        path,
                        value.clone(),
                        generation,
                    );
                }
                Ok(value)
            }
            other => Err(unexpected(&other)),
        }
    }

    /// The cache's counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.inner.cache.lock().expect("cache lock").stats()
    }

    /// Asks the cell whether `sequencer` is still the current holder of its lock.
    pub async fn check_sequencer(&self, sequencer: &crate::Sequencer) -> Result<bool, Error> {
        check_sequencer(&self.inner.client, sequencer).await
    }

    /// Creates a node.
    pub async fn create(
        &self,
        path: &str,
        data: Vec<u8>,
        mode: CreateMode,
    ) -> Result<Created, Error> {
        match self
            .call(Op::Create {
                path: path.into(),
                data,
                mode,
            })
            .await?
        {
            Reply::Created {
                path,
                stat,
                predecessor,
            } => Ok(Created {
                path,
                stat,
                predecessor,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes a node (compare-and-delete when `version` is given).
    pub async fn delete(&self, path: &str, version: Option<u64>) -> Result<(), Error> {
        match self
            .call(Op::Delete {
                path: path.into(),
                version,
            })
            .await?
        {
            Reply::Deleted => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Replaces a node's data (compare-and-set when `version` is given).
    pub async fn set_data(
        &self,
        path: &str,
        data: Vec<u8>,
        version: Option<u64>,
    ) -> Result<NodeStat, Error> {
        match self
            .call(Op::SetData {
                path: path.into(),
                data,
                version,
            })
            .await?
        {
            Reply::Set { stat } => Ok(stat),
            other => Err(unexpected(&other)),
        }
    }

    /// Runs a transaction: all ops apply or none.
    pub async fn txn(&self, ops: Vec<TxnOp>) -> Result<Vec<TxnResult>, Error> {
        match self.call(Op::Txn { ops }).await? {
            Reply::Txn { results } => Ok(results),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a node (linearizable).
    pub async fn get(&self, path: &str) -> Result<(Vec<u8>, NodeStat), Error> {
        self.inner.client.get(path).await
    }

    /// A node's metadata, if it exists (linearizable).
    pub async fn exists(&self, path: &str) -> Result<Option<NodeStat>, Error> {
        self.inner.client.exists(path).await
    }

    /// A node's children (linearizable).
    pub async fn children(&self, path: &str) -> Result<Vec<(String, NodeStat)>, Error> {
        self.inner.client.children(path).await
    }

    /// Ends the session: its ephemeral nodes are deleted at once.
    pub async fn close(&self) -> Result<(), Error> {
        self.inner.keepalives_stopped.store(true, Ordering::SeqCst);
        self.inner.cache.lock().expect("cache lock").flush();
        let r = self.call(Op::CloseSession).await;
        tracing::debug!(session = self.inner.id, result = ?r, "session closed");
        self.inner.set_state(SessionState::Expired);
        match r {
            Ok(_) | Err(Error::SessionExpired { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The checks the cell would make of `op` without its namespace.
fn check_locally(op: &Op) -> Result<(), Error> {
    match op {
        // No copy of the value just to check it.
        Op::Create { path, data, mode } => wire::path::validate_create(path, data, *mode),
        Op::Delete { path, .. } => wire::path::validate(path),
        Op::SetData { path, data, .. } => {
            wire::path::validate(path)?;
            wire::path::check_value(data)
        }
        Op::Txn { ops } => wire::path::validate_write(ops, false),
        Op::Get { path, .. } | Op::Exists { path, .. } | Op::Children { path, .. } => {
            wire::path::validate(path)
        }
        _ => Ok(()),
    }
}

/// The error in an unexpected read answer.
fn into_error(r: Result<Reply, Error>) -> Error {
    match r {
        Ok(other) => unexpected(&other),
        Err(e) => e,
    }
}

/// Asks the cell whether `sequencer` is still the current holder of its lock.
pub(crate) async fn check_sequencer(
    client: &Client,
    seq: &crate::Sequencer,
) -> Result<bool, Error> {
    let op = Op::CheckSequencer {
        path: seq.node.clone(),
        token: seq.token,
        session: seq.session,
    };
    match client.request(op).await? {
        Reply::Sequencer { current } => Ok(current),
        other => Err(unexpected(&other)),
    }
}

/// A request id of this session, unanswered until the slot is dropped (however the call
/// using it ended): while it lives the cell keeps the id's result, so a write sent under
/// it may be sent again and is answered with the outcome of the first send that applied.
pub(crate) struct RequestSlot {
    inner: Arc<Inner>,
    id: RequestId,
}

impl Drop for RequestSlot {
    fn drop(&mut self) {
        self.inner
            .requests
            .lock()
            .expect("requests lock")
            .outstanding
            .remove(&self.id);
        self.inner.request_done.notify_waiters();
    }
}

/// True when `e` leaves a write's outcome unknown: it may have been applied, or may still
/// be (the request was lost, timed out, or met a leader change, a stopped proposal or an
/// internal failure). Every other error was decided by the cell (or refused before being
/// sent): the write did not apply, and never will under that request id. A refused TLS
/// handshake ([`Error::Handshake`]) is unknown too: an earlier attempt of the same request
/// may have reached the leader before the certificates stopped fitting (one expired, or
/// a revocation list was reloaded, mid-request).
pub(crate) fn outcome_unknown(e: &Error) -> bool {
    matches!(
        e,
        Error::NotLeader { .. }
            | Error::Unavailable { .. }
            | Error::Timeout { .. }
            | Error::Connection { .. }
            | Error::Internal { .. }
            | Error::Handshake { .. }
    )
}

impl Client {
    /// Opens a session and starts its KeepAlives.
    pub async fn open_session(&self) -> Result<Session, Error> {
        let slot = self.session_slot()?;
        Session::open(self.clone(), slot).await
    }
}

#[cfg(test)]
mod tests {
    use super::outcome_unknown;
    use wire::Error;

    /// A write whose attempt met a refused TLS handshake may still have been applied by
    /// an earlier attempt of the same request (the certificates stopped fitting
    /// mid-request): the recipes must treat it as unknown, not as "not applied".
    #[test]
    fn a_refused_handshake_leaves_a_write_unknown() {
        assert!(outcome_unknown(&Error::Handshake {
            reason: "127.0.0.1:1 refused this client".into()
        }));
        assert!(outcome_unknown(&Error::Connection {
            reason: "lost".into()
        }));
        assert!(!outcome_unknown(&Error::NoNode { path: "/x".into() }));
    }
}
