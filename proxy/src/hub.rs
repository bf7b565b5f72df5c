//! The proxy's tables: its clients, its cache, who holds what, the invalidations being
//! relayed, and the watches it fans out. Everything here can be rebuilt: a proxy that dies
//! loses nothing the cell or its clients need (clients move to another proxy, flush their
//! caches and re-arm their watches there).
//!
//! **Caching.** The proxy is one cacher at the leader (its own session). A client's cached
//! read is answered from the proxy's cache when it holds the node, and the client is
//! recorded as a *holder*. An invalidation from the leader drops the node here, is relayed
//! to the holders only, and is acknowledged upstream once every one of them acknowledged,
//! or its lease as seen by this proxy ran out (the client's own lease clock, started at its
//! send, ran out earlier still), or it was reported expired. Recording is atomic with the
//! upstream read the same way it is at the leader: a read whose node was invalidated (or
//! whose upstream stream was reset) while it was in flight is answered but not cached.
//!
//! **Watches.** One upstream watch per (node, kind): clients' watched reads are sent
//! upstream under the proxy's session (the leader keeps one watch per session, node and
//! kind) and each client's watch is kept here with the index its read reflects. An event
//! fires every client watch armed below the event's index; the rest are re-armed upstream.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;
use wire::hash::{HashMap, HashSet};

use tokio::sync::mpsc::UnboundedSender;
use wire::types::{LogIndex, NodeStat, Reply, Response, SessionId, WatchEvent, WatchKind};
use wire::Error;

/// Items queued for a client whose event stream is not connected, at most.
const QUEUED_MAX: usize = 10_000;
/// Recent events and invalidations remembered to detect races with reads in flight.
const RECENT_MAX: usize = 4_096;
/// A client not heard from for this long past its lease is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// A watch to (re-)arm upstream: node, kind and the lowest index any client armed it at.
pub type WatchKey = (String, WatchKind);

/// Counters reported by `ProxyStatus`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Client connections open now.
    pub clients: AtomicU64,
    /// Batched KeepAlive RPCs sent.
    pub keepalive_batches: AtomicU64,
    /// Client KeepAlives carried by them.
    pub keepalives_batched: AtomicU64,
    /// Cached reads answered here.
    pub cache_hits: AtomicU64,
    /// Reads forwarded to the cell.
    pub upstream_reads: AtomicU64,
    /// Other requests forwarded to the cell.
    pub upstream_writes: AtomicU64,
    /// Invalidations relayed to clients.
    pub invalidations_relayed: AtomicU64,
    /// Watch events delivered to clients.
    pub watch_events_relayed: AtomicU64,
}

struct ClientState {
    /// The client's event stream here: (stream id, sender).
    sink: Option<(u64, UnboundedSender<Response>)>,
    /// Items for the stream while it is not connected.
    queued: VecDeque<Response>,
    /// The latest moment the client's own lease can last, as far as this proxy knows:
    /// `received + lease` of the last KeepAlive it relayed (the client started its clock
    /// before sending), or `now + lease` when it first cached something here.
    lease_until: Instant,
    /// Nodes it may hold a value of that came from this proxy.
    paths: HashSet<String>,
    /// Whether `lease_until` comes from a renewal (or an open) the leader confirmed, rather
    /// than from the client merely showing up.
    renewed: bool,
}

struct Pending {
    /// When it was relayed.
    since: Instant,
    /// The upstream invalidation to acknowledge when done: (proxy session, id).
    upstream: Option<(SessionId, u64)>,
    /// Clients that have not acknowledged yet, with the nodes each was told to drop (sent
    /// again when the client's stream reconnects: a frame written to a stream that then
    /// broke may never have arrived).
    waiting: HashMap<SessionId, Vec<String>>,
}

#[derive(Clone)]
struct Entry {
    value: Option<(Vec<u8>, NodeStat)>,
    index: LogIndex,
}

#[derive(Default)]
struct Tables {
    clients: HashMap<SessionId, ClientState>,
    cache: HashMap<String, Entry>,
    holders: HashMap<String, HashSet<SessionId>>,
    pending: HashMap<u64, Pending>,
    /// The index of `pending[..].waiting` by client: after a reset there is a pending
    /// invalidation per client, and what one client is owed must not be found by walking
    /// them all (that held the tables for seconds once per client).
    waiting_on: HashMap<SessionId, HashSet<u64>>,
    /// Pending invalidations by the upstream invalidation they relay.
    by_upstream: HashMap<UpstreamAck, u64>,
    next_id: u64,
    next_stream: u64,
    /// Bumped on every reset of the upstream session or stream.
    generation: u64,
    /// The local invalidations of the latest reset, kept until the proxy is ready again:
    /// while it has not been, nothing was cached here or told to be cached since, so a
    /// reconnection waits for these instead of flushing every client a second time.
    flushed: Option<Vec<u64>>,
    /// Sequence of invalidations received, and the recent ones' nodes.
    inval_seq: u64,
    recent_inval: VecDeque<(u64, String)>,
    /// Client watches per upstream watch: (client session, index armed at).
    watches: HashMap<WatchKey, Vec<(SessionId, LogIndex)>>,
    /// Sequence of events received, and the recent ones' keys.
    event_seq: u64,
    recent_events: VecDeque<(u64, WatchKey)>,
    last_index: LogIndex,
}

/// What a read in flight must compare against when it comes back.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    generation: u64,
    seq: u64,
    /// Whether the upstream stream was usable when the read was sent: a read sent while
    /// it was down may have reached a leader that no longer leads when the stream reopens.
    ready: bool,
}

/// An acknowledgement owed upstream: (proxy session, invalidation id).
pub type UpstreamAck = (SessionId, u64);

/// The shared state of one proxy.
pub struct Hub {
    t: Mutex<Tables>,
    /// Counters.
    pub counters: Counters,
    lease_ms: AtomicU64,
    ready: AtomicBool,
    /// The proxy's own session can be trusted to be alive until this moment (the send time
    /// of the last batch that renewed it, plus the lease); past it the leader may have
    /// expired it and dropped it as a cacher, so nothing may be served from this cache.
    own_deadline: Mutex<Option<Instant>>,
}

impl Default for Hub {
    fn default() -> Self {
        Hub::new()
    }
}

fn lock(m: &Mutex<Tables>) -> std::sync::MutexGuard<'_, Tables> {
    m.lock().expect("proxy tables lock")
}

impl Tables {
    fn client(&mut self, session: SessionId, lease: Duration) -> &mut ClientState {
        self.clients.entry(session).or_insert_with(|| ClientState {
            sink: None,
            queued: VecDeque::new(),
            lease_until: Instant::now() + lease,
            paths: HashSet::default(),
            renewed: false,
        })
    }

    /// Sends `item` on the client's stream, or queues it until the stream connects.
    fn deliver(&mut self, session: SessionId, item: Response, lease: Duration) {
        let c = self.client(session, lease);
        if let Some((_, tx)) = &c.sink {
            match tx.send(item) {
                Ok(()) => return,
                Err(e) => {
                    c.sink = None;
                    c.queued.push_back(e.0);
                }
            }
        } else {
            c.queued.push_back(item);
        }
        while c.queued.len() > QUEUED_MAX {
            c.queued.pop_front();
        }
    }

    /// Records a pending invalidation (and indexes it).
    fn add_pending(&mut self, id: u64, p: Pending) {
        for s in p.waiting.keys() {
            self.waiting_on.entry(*s).or_default().insert(id);
        }
        if let Some(u) = p.upstream {
            self.by_upstream.insert(u, id);
        }
        self.pending.insert(id, p);
    }

    fn unindex(&mut self, session: SessionId, id: u64) {
        if let Some(ids) = self.waiting_on.get_mut(&session) {
            ids.remove(&id);
            if ids.is_empty() {
                self.waiting_on.remove(&session);
            }
        }
    }

    /// Invalidation `id` stops waiting for `session`; true if it waits for nobody now.
    fn stop_waiting(&mut self, id: u64, session: SessionId) -> bool {
        let Some(p) = self.pending.get_mut(&id) else {
            return false;
        };
        if p.waiting.remove(&session).is_none() {
            return false;
        }
        let done = p.waiting.is_empty();
        self.unindex(session, id);
        done
    }

    /// Removes `session` from every pending invalidation; returns the upstream acks owed.
    fn stop_waiting_for(&mut self, session: SessionId) -> Vec<UpstreamAck> {
        let ids: Vec<u64> = self
            .waiting_on
            .get(&session)
            .map(|ids| ids.iter().copied().collect())
            .unwrap_or_default();
        let done = ids
            .into_iter()
            .filter(|id| self.stop_waiting(*id, session))
            .collect();
        self.finish(done)
    }

    /// Drops the pending invalidations `ids` (done); returns their upstream acks.
    fn finish(&mut self, ids: Vec<u64>) -> Vec<UpstreamAck> {
        let mut acks = Vec::new();
        for id in ids {
            let Some(p) = self.pending.remove(&id) else {
                continue;
            };
            for s in p.waiting.keys() {
                self.unindex(*s, id);
            }
            if let Some(u) = p.upstream {
                if self.by_upstream.get(&u) == Some(&id) {
                    self.by_upstream.remove(&u);
                }
                acks.push(u);
            }
        }
        acks
    }

    fn forget_holder(&mut self, session: SessionId) {
        if let Some(c) = self.clients.get_mut(&session) {
            for p in c.paths.drain() {
                if let Some(h) = self.holders.get_mut(&p) {
                    h.remove(&session);
                    if h.is_empty() {
                        self.holders.remove(&p);
                    }
                }
            }
        }
    }

    fn drop_watches_of(&mut self, session: SessionId) {
        self.watches.retain(|_, list| {
            list.retain(|(s, _)| *s != session);
            !list.is_empty()
        });
    }
}

impl Hub {
    /// Empty tables; the lease defaults to 12 s until the cell says otherwise.
    pub fn new() -> Hub {
        // Invalidation ids start at a random point, so an acknowledgement meant for an
        // earlier run of this proxy (or for another proxy) cannot complete one of ours.
        let t = Tables {
            next_id: u64::from(rand_u32()) << 32,
            ..Tables::default()
        };
        Hub {
            t: Mutex::new(t),
            counters: Counters::default(),
            lease_ms: AtomicU64::new(12_000),
            ready: AtomicBool::new(false),
            own_deadline: Mutex::new(None),
        }
    }

    /// The cell's session lease.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.load(Ordering::Relaxed))
    }

    /// Records the lease the cell grants.
    pub fn set_lease_ms(&self, ms: u64) {
        self.lease_ms.store(ms, Ordering::Relaxed);
    }

    /// True while the upstream event stream is open and its watches re-armed: only then
    /// may values be cached here (invalidations can reach us).
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst) && self.own_session_valid(Instant::now())
    }

    /// True while the proxy's own session is surely alive at the leader.
    pub fn own_session_valid(&self, now: Instant) -> bool {
        self.own_deadline
            .lock()
            .expect("own deadline")
            .is_some_and(|d| now < d)
    }

    /// The proxy's own session was renewed by a batch sent at `sent`.
    pub fn set_own_renewed(&self, sent: Instant) {
        let mut d = self.own_deadline.lock().expect("own deadline");
        let new = sent + wire::local_lease(self.lease());
        *d = Some(d.map_or(new, |old| old.max(new)));
    }

    /// The proxy opened a new session with a request sent at `sent` (`None`: it has no
    /// session now).
    pub fn set_own_session(&self, sent: Option<Instant>) {
        *self.own_deadline.lock().expect("own deadline") =
            sent.map(|t| t + wire::local_lease(self.lease()));
    }

    /// Marks the upstream stream usable (after a reset and re-arm) or not.
    pub fn set_ready(&self, ready: bool) {
        if ready {
            // Under the table lock, so `reset_unless_flushed` sees both or neither.
            let mut t = lock(&self.t);
            t.flushed = None;
            self.ready.store(true, Ordering::SeqCst);
        } else {
            self.ready.store(false, Ordering::SeqCst);
        }
    }

    /// The highest log index seen in any answer from the cell.
    pub fn last_index(&self) -> LogIndex {
        lock(&self.t).last_index
    }

    /// Notes an index seen in an answer.
    pub fn saw_index(&self, index: LogIndex) {
        let mut t = lock(&self.t);
        t.last_index = t.last_index.max(index);
    }

    /// A KeepAlive of `session` received at `received` was renewed by the leader for
    /// `lease` (the lease the client is told: the same value, so that the proxy never
    /// takes a shorter one than the client's own clock runs on).
    pub fn renewed(&self, session: SessionId, received: Instant, lease: Duration) {
        let mut t = lock(&self.t);
        let c = t.client(session, lease);
        c.lease_until = if c.renewed {
            c.lease_until.max(received + lease)
        } else {
            received + lease
        };
        c.renewed = true;
    }

    /// A session was opened through this proxy by a request received at `received`: the
    /// leader started its lease of `lease_ms` (its answer, which the client is told) after
    /// that. A client's session can be opened before the proxy's own, whose answer tells
    /// the proxy the cell's lease; the proxy's default taken in its place made it wait
    /// for the client too long (a shorter cell lease) or, with a longer one, stop waiting
    /// for it while its cache was still valid. The hub-wide lease (the proxy's own
    /// session's) is left alone: only answers to the proxy's own requests set it.
    pub fn opened(&self, session: SessionId, received: Instant, lease_ms: u64) {
        self.renewed(session, received, Duration::from_millis(lease_ms));
    }

    /// Sessions this proxy currently knows of.
    pub fn session_count(&self) -> usize {
        lock(&self.t).clients.len()
    }

    /// The invalidations `session` has not acknowledged although they were relayed at
    /// least `age` ago, the oldest first, at most `max` (for its KeepAlive reply).
    pub fn unacknowledged(
        &self,
        session: SessionId,
        age: Duration,
        max: usize,
    ) -> Vec<(u64, Vec<String>)> {
        self.unacknowledged_many(&[session], age, max)
            .remove(&session)
            .unwrap_or_default()
    }

    /// True when `session` has left an invalidation relayed here unacknowledged for `age`
    /// or longer at `now`.
    pub fn overdue(&self, session: SessionId, now: Instant, age: Duration) -> bool {
        let t = lock(&self.t);
        t.waiting_on.get(&session).is_some_and(|ids| {
            ids.iter().any(|id| {
                t.pending
                    .get(id)
                    .is_some_and(|p| now.saturating_duration_since(p.since) >= age)
            })
        })
    }

    /// [`Hub::unacknowledged`] for many sessions in one pass over the pending
    /// invalidations (sessions with none are left out). One pass, not one per session:
    /// after a reset there is a pending invalidation per client, and a batch renews
    /// thousands of them, so a pass per session held the table for seconds (every client
    /// request waited, and the next KeepAlive batch went out seconds late).
    pub fn unacknowledged_many(
        &self,
        sessions: &[SessionId],
        age: Duration,
        max: usize,
    ) -> HashMap<SessionId, Vec<(u64, Vec<String>)>> {
        let mut found: HashMap<SessionId, Vec<(Instant, u64, Vec<String>)>> = HashMap::default();
        let now = Instant::now();
        {
            let t = lock(&self.t);
            for s in sessions {
                for id in t.waiting_on.get(s).into_iter().flatten() {
                    let Some(p) = t.pending.get(id) else {
                        continue;
                    };
                    if now.saturating_duration_since(p.since) < age {
                        continue;
                    }
                    if let Some(paths) = p.waiting.get(s) {
                        found
                            .entry(*s)
                            .or_default()
                            .push((p.since, *id, paths.clone()));
                    }
                }
            }
        }
        found
            .into_iter()
            .map(|(s, mut v)| {
                v.sort();
                v.truncate(max);
                (s, v.into_iter().map(|(_, id, paths)| (id, paths)).collect())
            })
            .collect()
    }

    /// Invalidations waiting for client acknowledgements, and the age of the oldest.
    pub fn pending_invalidations(&self) -> (usize, Duration) {
        let t = lock(&self.t);
        let oldest = t
            .pending
            .values()
            .map(|p| p.since.elapsed())
            .max()
            .unwrap_or_default();
        (t.pending.len(), oldest)
    }

    /// (node, kind) watches held upstream.
    pub fn upstream_watch_count(&self) -> usize {
        lock(&self.t).watches.len()
    }

    /// The session is over (expired, closed): its stream ends with `SessionExpired`, its
    /// watches and holdings are dropped. Returns the upstream acks this completes.
    pub fn session_ended(&self, session: SessionId) -> Vec<UpstreamAck> {
        let mut t = lock(&self.t);
        t.forget_holder(session);
        t.drop_watches_of(session);
        if let Some(c) = t.clients.remove(&session) {
            if let Some((_, tx)) = c.sink {
                let _ = tx.send(Err(Error::SessionExpired { session }));
            }
        }
        t.stop_waiting_for(session)
    }

    // ----- event streams -----

    /// Attaches a client's event stream; queued items are sent first. Returns its id.
    pub fn attach_stream(&self, session: SessionId, tx: UnboundedSender<Response>) -> u64 {
        let lease = self.lease();
        let mut t = lock(&self.t);
        t.next_stream += 1;
        let id = t.next_stream;
        let mut resend: Vec<(u64, Vec<String>)> = t
            .waiting_on
            .get(&session)
            .into_iter()
            .flatten()
            .filter_map(|pid| {
                let paths = t.pending.get(pid)?.waiting.get(&session)?;
                Some((*pid, paths.clone()))
            })
            .collect();
        resend.sort();
        let c = t.client(session, lease);
        for (pid, paths) in resend {
            c.queued.push_back(Ok(Reply::Invalidate { id: pid, paths }));
        }
        while let Some(item) = c.queued.pop_front() {
            if let Err(e) = tx.send(item) {
                c.queued.push_front(e.0);
                return id;
            }
        }
        c.sink = Some((id, tx));
        id
    }

    /// Items taken for a stream that broke before they were written: kept for the next
    /// stream of the session.
    pub fn requeue(&self, session: SessionId, items: Vec<Response>) {
        let mut t = lock(&self.t);
        if let Some(c) = t.clients.get_mut(&session) {
            for item in items.into_iter().rev() {
                c.queued.push_front(item);
            }
            while c.queued.len() > QUEUED_MAX {
                c.queued.pop_back();
            }
        }
    }

    /// Detaches a client's stream if `id` is still the attached one.
    pub fn detach_stream(&self, session: SessionId, id: u64) {
        let mut t = lock(&self.t);
        if let Some(c) = t.clients.get_mut(&session) {
            if c.sink.as_ref().is_some_and(|(s, _)| *s == id) {
                c.sink = None;
            }
        }
    }

    // ----- caching -----

    /// A cached read served here, if the proxy holds the node and may serve it: the
    /// client is recorded as a holder first.
    pub fn cache_lookup(&self, session: SessionId, path: &str) -> Result<Reply, Snapshot> {
        let mut t = lock(&self.t);
        let ready = self.ready();
        let snap = Snapshot {
            generation: t.generation,
            seq: t.inval_seq,
            ready,
        };
        if !ready || !t.live(session, Instant::now()) {
            return Err(snap);
        }
        let Some(e) = t.cache.get(path).cloned() else {
            return Err(snap);
        };
        t.record_holder(session, path);
        self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
        Ok(Reply::CachedData {
            value: e.value,
            index: e.index,
            cachable: true,
        })
    }

    /// An upstream cached read came back: cache it and record the client, unless the
    /// node was invalidated or the upstream reset since `snap` (then the answer is passed
    /// on as not cachable).
    pub fn cache_fill(
        &self,
        session: SessionId,
        path: &str,
        snap: Snapshot,
        value: Option<(Vec<u8>, NodeStat)>,
        index: LogIndex,
        cachable: bool,
    ) -> Reply {
        let mut t = lock(&self.t);
        t.last_index = t.last_index.max(index);
        let raced = !snap.ready
            || t.generation != snap.generation
            || seq_touched(&t.recent_inval, snap.seq, t.inval_seq, |p| p == path);
        let cachable = cachable && self.ready() && !raced;
        if cachable {
            t.cache.insert(
                path.to_string(),
                Entry {
                    value: value.clone(),
                    index,
                },
            );
        }
        // Only a client this proxy renews may be told to cache: the proxy must know its
        // lease to stop waiting for it when it goes silent.
        let cachable = cachable && t.live(session, Instant::now());
        if cachable {
            t.record_holder(session, path);
        }
        Reply::CachedData {
            value,
            index,
            cachable,
        }
    }

    /// The leader invalidated `paths` (invalidation `id` of the proxy's `session`): drop
    /// them and relay to their holders. Returns the upstream ack if no holder is waited for.
    pub fn invalidate(
        &self,
        session: SessionId,
        id: u64,
        paths: Vec<String>,
    ) -> Option<UpstreamAck> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        // Sent again (a KeepAlive reply repeats what is overdue): still being relayed, so
        // acknowledged upstream only when the clients are done. Treating it as new would
        // find no holders (they were taken the first time) and acknowledge at once.
        if t.by_upstream.contains_key(&(session, id)) {
            return None;
        }
        let mut per_client: HashMap<SessionId, Vec<String>> = HashMap::default();
        // A client that has not acknowledged an earlier invalidation of one of these nodes
        // may still serve it from its cache (the message may be stuck, or the client cut
        // off): its holding was taken by the earlier relay, so without this the leader's
        // next write to the node would be acknowledged at once and complete while that
        // client still serves the value of two writes ago. It is told again and waited
        // for, as the leader waits for a cacher until it acknowledges.
        {
            let wanted: HashSet<&String> = paths.iter().collect();
            for q in t.pending.values() {
                for (c, held) in &q.waiting {
                    for p in held.iter().filter(|p| wanted.contains(p)) {
                        per_client.entry(*c).or_default().push(p.clone());
                    }
                }
            }
        }
        for p in paths {
            t.inval_seq += 1;
            let seq = t.inval_seq;
            t.recent_inval.push_back((seq, p.clone()));
            while t.recent_inval.len() > RECENT_MAX {
                t.recent_inval.pop_front();
            }
            t.cache.remove(&p);
            for c in t.holders.remove(&p).unwrap_or_default() {
                if let Some(cs) = t.clients.get_mut(&c) {
                    cs.paths.remove(&p);
                }
                per_client.entry(c).or_default().push(p.clone());
            }
        }
        tracing::debug!(
            upstream = id,
            holders = ?per_client.keys().collect::<Vec<_>>(),
            "invalidation from the leader"
        );
        if per_client.is_empty() {
            return Some((session, id));
        }
        for held in per_client.values_mut() {
            held.sort();
            held.dedup();
        }
        t.next_id += 1;
        let local = t.next_id;
        t.add_pending(
            local,
            Pending {
                since: Instant::now(),
                upstream: Some((session, id)),
                waiting: per_client.clone(),
            },
        );
        for (c, paths) in per_client {
            self.counters
                .invalidations_relayed
                .fetch_add(1, Ordering::Relaxed);
            t.deliver(c, Ok(Reply::Invalidate { id: local, paths }), lease);
        }
        None
    }

    /// A client acknowledged invalidations; returns the upstream acks now owed.
    pub fn ack(&self, session: SessionId, ids: &[u64]) -> Vec<UpstreamAck> {
        tracing::debug!(session, ?ids, "a client acknowledged invalidations");
        let mut t = lock(&self.t);
        let mut done = Vec::new();
        for id in ids {
            if t.stop_waiting(*id, session) {
                done.push(*id);
            }
        }
        t.finish(done)
    }

    /// The upstream session or stream is being reset: nothing cached here can be trusted
    /// to be invalidated any more. Drops the cache, invalidates every holder of anything,
    /// and returns the local invalidations to wait for before reconnecting upstream (the
    /// leader takes the reconnection as this proxy's confirmation that it flushed).
    pub fn reset(&self) -> Vec<u64> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        // Under the table lock, as `set_ready(true)` clears `flushed` under it: a resume
        // landing between the two could otherwise leave the proxy ready with `flushed` set,
        // and a later reconnection would reuse this reset although values were cached since.
        self.ready.store(false, Ordering::SeqCst);
        t.generation += 1;
        t.cache.clear();
        t.holders.clear();
        let holding: Vec<(SessionId, Vec<String>)> = t
            .clients
            .iter_mut()
            .filter(|(_, c)| !c.paths.is_empty())
            .map(|(s, c)| (*s, c.paths.drain().collect()))
            .collect();
        let mut ids = Vec::new();
        for (s, paths) in holding {
            t.next_id += 1;
            let id = t.next_id;
            t.add_pending(
                id,
                Pending {
                    since: Instant::now(),
                    upstream: None,
                    waiting: [(s, paths.clone())].into_iter().collect(),
                },
            );
            self.counters
                .invalidations_relayed
                .fetch_add(1, Ordering::Relaxed);
            t.deliver(s, Ok(Reply::Invalidate { id, paths }), lease);
            ids.push(id);
        }
        t.flushed = Some(ids.clone());
        ids
    }

    /// A reset before reconnecting upstream, unless the latest reset already flushed
    /// everything and the proxy has not been ready since (it flushed ahead, when the
    /// leader went silent): then that reset's invalidations, still to be waited for.
    /// Returns the local invalidations to wait for and whether they are the earlier ones.
    pub fn reset_unless_flushed(&self) -> (Vec<u64>, bool) {
        {
            let t = lock(&self.t);
            if !self.ready.load(Ordering::SeqCst) {
                if let Some(ids) = &t.flushed {
                    return (ids.clone(), true);
                }
            }
        }
        (self.reset(), false)
    }

    /// True once no client owes the acknowledgement of anything relayed or flushed here
    /// (or its lease ran out): what the proxy must know before reopening its stream tells a
    /// new leader that nothing cached through it is left. Not only the latest reset's
    /// invalidations: a client that still owes an earlier one (a flush ahead the leader
    /// answered after all, or a write's invalidation the old leader was waiting for) holds
    /// no paths any more, so a new reset does not include it, yet it may still serve the
    /// value from its cache.
    pub fn nothing_owed(&self) -> bool {
        lock(&self.t).pending.is_empty()
    }

    /// True once none of `ids` is pending.
    pub fn all_done(&self, ids: &[u64]) -> bool {
        let t = lock(&self.t);
        ids.iter().all(|id| !t.pending.contains_key(id))
    }

    /// Periodic upkeep: clients whose lease (as seen here) ran out stop being waited for;
    /// long-silent clients are forgotten. Returns the upstream acks now owed.
    pub fn tick(&self, now: Instant) -> Vec<UpstreamAck> {
        let mut t = lock(&self.t);
        let mut done = Vec::new();
        let t = &mut *t;
        let clients = &t.clients;
        let mut gone = Vec::new();
        for (id, p) in t.pending.iter_mut() {
            p.waiting.retain(|c, _| {
                let live = clients.get(c).is_some_and(|cs| cs.lease_until > now);
                if !live {
                    gone.push((*c, *id));
                }
                live
            });
            if p.waiting.is_empty() {
                done.push(*id);
            }
        }
        for (c, id) in gone {
            tracing::debug!(
                session = c,
                id,
                "invalidation no longer waits: lease ran out here"
            );
            t.unindex(c, id);
        }
        let forget: Vec<SessionId> = t
            .clients
            .iter()
            .filter(|(_, c)| c.sink.is_none() && c.lease_until + FORGET_AFTER < now)
            .map(|(s, _)| *s)
            .collect();
        for s in forget {
            t.forget_holder(s);
            t.drop_watches_of(s);
            t.clients.remove(&s);
        }
        t.finish(done)
    }

    // ----- watches -----

    /// A snapshot to take before sending a watched read upstream.
    pub fn watch_snapshot(&self) -> Snapshot {
        let ready = self.ready();
        let t = lock(&self.t);
        Snapshot {
            generation: t.generation,
            seq: t.event_seq,
            ready,
        }
    }

    /// Registers a client's watch armed at `since`. Returns the upstream watch to re-arm
    /// if an event on it (or a reset) may have consumed the upstream watch since `snap`.
    pub fn add_watch(
        &self,
        session: SessionId,
        key: WatchKey,
        since: LogIndex,
        snap: Snapshot,
    ) -> Option<wire::types::WatchSpec> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        t.last_index = t.last_index.max(since);
        t.client(session, lease);
        let raced = !snap.ready
            || t.generation != snap.generation
            || seq_touched(&t.recent_events, snap.seq, t.event_seq, |k| *k == key);
        let list = t.watches.entry(key.clone()).or_default();
        if let Some(w) = list.iter_mut().find(|(s, _)| *s == session) {
            w.1 = w.1.min(since);
        } else {
            list.push((session, since));
        }
        let min = list.iter().map(|(_, i)| *i).min().unwrap_or(since);
        raced.then_some(wire::types::WatchSpec {
            path: key.0,
            kind: key.1,
            since_index: min,
        })
    }

    /// An upstream watch fired: fires every client watch armed below the event's index
    /// (all of them when the index is 0: the change is older than the leader's memory).
    /// Returns the upstream watch to re-arm for the clients left.
    pub fn fire(&self, ev: &WatchEvent) -> Option<wire::types::WatchSpec> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        let key = (ev.path.clone(), ev.kind);
        t.event_seq += 1;
        let seq = t.event_seq;
        t.recent_events.push_back((seq, key.clone()));
        while t.recent_events.len() > RECENT_MAX {
            t.recent_events.pop_front();
        }
        t.last_index = t.last_index.max(ev.index);
        let list = t.watches.remove(&key).unwrap_or_default();
        let (fired, left): (Vec<_>, Vec<_>) = list
            .into_iter()
            .partition(|(_, since)| ev.index == 0 || *since < ev.index);
        for (s, _) in fired {
            self.counters
                .watch_events_relayed
                .fetch_add(1, Ordering::Relaxed);
            t.deliver(s, Ok(Reply::Event(ev.clone())), lease);
        }
        if left.is_empty() {
            return None;
        }
        let min = left.iter().map(|(_, i)| *i).min().expect("not empty");
        t.watches.insert(key.clone(), left);
        Some(wire::types::WatchSpec {
            path: key.0,
            kind: key.1,
            since_index: min,
        })
    }

    /// The upstream watch for `key` as it should be armed now (`None`: no client left).
    pub fn watch_spec(&self, key: &WatchKey) -> Option<wire::types::WatchSpec> {
        let t = lock(&self.t);
        let list = t.watches.get(key)?;
        Some(wire::types::WatchSpec {
            path: key.0.clone(),
            kind: key.1,
            since_index: list.iter().map(|(_, i)| *i).min()?,
        })
    }

    /// Removes one client's watch (it fired in a `Rewatch` answer to that client).
    pub fn remove_watch(&self, session: SessionId, key: &WatchKey) {
        let mut t = lock(&self.t);
        if let Some(list) = t.watches.get_mut(key) {
            list.retain(|(s, _)| *s != session);
            if list.is_empty() {
                t.watches.remove(key);
            }
        }
    }

    /// Every upstream watch with the lowest index a client armed it at: what to re-arm
    /// after the upstream stream (re)connects.
    pub fn all_watches(&self) -> Vec<wire::types::WatchSpec> {
        let t = lock(&self.t);
        t.watches
            .iter()
            .map(|(k, list)| wire::types::WatchSpec {
                path: k.0.clone(),
                kind: k.1,
                since_index: list.iter().map(|(_, i)| *i).min().unwrap_or(0),
            })
            .collect()
    }
}

impl Tables {
    /// True for a client whose lease this proxy saw renewed (or opened) and not run out.
    fn live(&self, session: SessionId, now: Instant) -> bool {
        self.clients
            .get(&session)
            .is_some_and(|c| c.renewed && c.lease_until > now)
    }

    fn record_holder(&mut self, session: SessionId, path: &str) {
        let Some(c) = self.clients.get_mut(&session) else {
            return;
        };
        c.paths.insert(path.to_string());
        self.holders
            .entry(path.to_string())
            .or_default()
            .insert(session);
    }
}

/// A number that differs between processes and between calls: from the keys of a fresh
/// `wire::hash` hasher (random per process, fixed per seed in the fault suite's
/// simulation, which must replay).
fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = wire::hash::SeededState::default().build_hasher();
    h.write_u8(0);
    h.finish() as u32
}

/// True if an item matching `hit` was recorded after sequence number `since` (or if the
/// record no longer reaches back that far).
fn seq_touched<T>(
    recent: &VecDeque<(u64, T)>,
    since: u64,
    now: u64,
    hit: impl Fn(&T) -> bool,
) -> bool {
    if now == since {
        return false;
    }
    if recent.front().is_none_or(|(s, _)| *s > since + 1) {
        return true;
    }
    recent.iter().any(|(s, x)| *s > since && hit(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Hub {
        /// Panics unless the indexes of the pending invalidations match them.
        fn assert_indexed(&self) {
            let t = lock(&self.t);
            let mut waiting_on: HashMap<SessionId, HashSet<u64>> = HashMap::default();
            let mut by_upstream = HashMap::default();
            for (id, p) in &t.pending {
                assert!(!p.waiting.is_empty(), "pending {id} waits for nobody");
                for s in p.waiting.keys() {
                    waiting_on.entry(*s).or_default().insert(*id);
                }
                if let Some(u) = p.upstream {
                    assert!(by_upstream.insert(u, *id).is_none(), "{u:?} relayed twice");
                }
            }
            assert_eq!(t.waiting_on, waiting_on);
            assert_eq!(t.by_upstream, by_upstream);
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Read(SessionId, u8),
        Invalidate(u64, u8),
        Ack(SessionId, u64),
        AckOwed(SessionId),
        Reset,
        End(SessionId),
        Renew(SessionId),
        Attach(SessionId),
        TickAll,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        let c = 1..6u64;
        prop_oneof![
            4 => (c.clone(), 0..3u8).prop_map(|(s, p)| Step::Read(s, p)),
            3 => (1..6u64, 0..3u8).prop_map(|(i, p)| Step::Invalidate(i, p)),
            1 => (c.clone(), 1..12u64).prop_map(|(s, i)| Step::Ack(s, i)),
            3 => c.clone().prop_map(Step::AckOwed),
            1 => Just(Step::Reset),
            1 => c.clone().prop_map(Step::End),
            1 => c.clone().prop_map(Step::Renew),
            1 => c.prop_map(Step::Attach),
            1 => Just(Step::TickAll),
        ]
    }

    proptest::proptest! {
        /// Whatever clients read, acknowledge, end or let lapse, and whatever the leader
        /// invalidates (repeats included) and however often the proxy resets, the
        /// per-client index of pending invalidations stays exact, and what it answers for
        /// KeepAlive replies and reattached streams is what a walk of them all finds.
        #[test]
        fn pending_index_matches_a_full_walk(steps in proptest::collection::vec(step(), 1..60)) {
            let hub = ready_hub(&[1, 2, 3, 4, 5]);
            for st in steps {
                match st {
                    Step::Read(c, p) => {
                        let path = format!("/k{p}");
                        if let Err(snap) = hub.cache_lookup(c, &path) {
                            hub.cache_fill(c, &path, snap, Some((b"v".to_vec(), stat())), 7, true);
                        }
                    }
                    Step::Invalidate(i, p) => {
                        hub.invalidate(99, i, vec![format!("/k{p}")]);
                    }
                    Step::Ack(c, i) => {
                        hub.ack(c, &[i]);
                    }
                    Step::AckOwed(c) => {
                        let ids: Vec<u64> = hub
                            .unacknowledged(c, Duration::ZERO, 64)
                            .into_iter()
                            .map(|(id, _)| id)
                            .collect();
                        hub.ack(c, &ids);
                    }
                    Step::Reset => {
                        hub.reset();
                        hub.set_ready(true);
                    }
                    Step::End(c) => {
                        hub.session_ended(c);
                    }
                    Step::Renew(c) => hub.renewed(c, Instant::now(), hub.lease()),
                    Step::Attach(c) => {
                        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
                        hub.attach_stream(c, tx);
                    }
                    Step::TickAll => {
                        hub.tick(Instant::now() + Duration::from_secs(3_600));
                    }
                }
                hub.assert_indexed();
                let all: Vec<SessionId> = (1..=6).collect();
                let many = hub.unacknowledged_many(&all, Duration::ZERO, 64);
                let t = lock(&hub.t);
                for s in &all {
                    let mut walk: Vec<(Instant, u64, Vec<String>)> = t
                        .pending
                        .iter()
                        .filter_map(|(id, p)| p.waiting.get(s).map(|x| (p.since, *id, x.clone())))
                        .collect();
                    walk.sort();
                    let walk: Vec<(u64, Vec<String>)> =
                        walk.into_iter().map(|(_, id, x)| (id, x)).collect();
                    proptest::prop_assert_eq!(many.get(s).cloned().unwrap_or_default(), walk);
                }
            }
        }
    }

    fn ev(path: &str, kind: WatchKind, index: u64) -> WatchEvent {
        WatchEvent {
            path: path.into(),
            kind,
            event: wire::types::EventType::DataChanged,
            index,
        }
    }

    #[test]
    fn events_fire_only_watches_armed_below_them() {
        let hub = ready_hub(&[]);
        let snap = hub.watch_snapshot();
        let key = ("/a".to_string(), WatchKind::Data);
        assert!(hub.add_watch(1, key.clone(), 10, snap).is_none());
        assert!(hub.add_watch(2, key.clone(), 20, snap).is_none());
        let (tx1, mut rx1) = tokio::sync::mpsc::unbounded_channel();
        let (tx2, mut rx2) = tokio::sync::mpsc::unbounded_channel();
        hub.attach_stream(1, tx1);
        hub.attach_stream(2, tx2);
        // An event at 15 fires client 1's watch only; client 2's must be re-armed at 20.
        let rearm = hub.fire(&ev("/a", WatchKind::Data, 15)).unwrap();
        assert_eq!(rearm.since_index, 20);
        assert!(matches!(rx1.try_recv(), Ok(Ok(Reply::Event(_)))));
        assert!(rx2.try_recv().is_err());
        assert!(hub.fire(&ev("/a", WatchKind::Data, 21)).is_none());
        assert!(matches!(rx2.try_recv(), Ok(Ok(Reply::Event(_)))));
        assert_eq!(hub.upstream_watch_count(), 0);
    }

    #[test]
    fn a_watch_registered_after_an_event_on_its_key_is_rearmed() {
        let hub = ready_hub(&[]);
        let key = ("/a".to_string(), WatchKind::Data);
        let snap = hub.watch_snapshot();
        hub.fire(&ev("/b", WatchKind::Data, 3));
        assert!(
            hub.add_watch(1, key.clone(), 2, snap).is_none(),
            "other key"
        );
        let snap = hub.watch_snapshot();
        hub.fire(&ev("/a", WatchKind::Data, 5));
        let spec = hub.add_watch(2, key, 4, snap).expect("re-arm");
        assert_eq!(spec.since_index, 4);
    }

    fn ready_hub(clients: &[SessionId]) -> Hub {
        let hub = Hub::new();
        hub.set_ready(true);
        hub.set_own_session(Some(Instant::now()));
        for c in clients {
            hub.renewed(*c, Instant::now(), hub.lease());
        }
        hub
    }

    #[test]
    fn a_reconnection_after_a_flush_ahead_waits_for_it_instead_of_flushing_again() {
        let hub = ready_hub(&[1, 2]);
        for s in [1, 2] {
            let snap = hub.cache_lookup(s, &format!("/n{s}")).unwrap_err();
            hub.cache_fill(
                s,
                &format!("/n{s}"),
                snap,
                Some((b"v".to_vec(), stat())),
                7,
                true,
            );
        }
        // The leader went silent: flushed ahead, the stream still open.
        let ahead = hub.reset();
        assert_eq!(ahead.len(), 2);
        // A read that comes back meanwhile is not cached (nothing is until ready).
        let snap = hub.cache_lookup(1, "/n1").unwrap_err();
        let r = hub.cache_fill(1, "/n1", snap, Some((b"v".to_vec(), stat())), 8, true);
        assert!(matches!(
            r,
            Reply::CachedData {
                cachable: false,
                ..
            }
        ));
        // The stream broke: the reconnection waits for the same invalidations.
        hub.set_ready(false);
        assert_eq!(hub.reset_unless_flushed(), (ahead.clone(), true));
        assert!(!hub.all_done(&ahead));
        hub.ack(1, &ahead);
        assert!(!hub.all_done(&ahead), "client 2 has not flushed yet");
        hub.ack(2, &ahead);
        assert!(hub.all_done(&ahead));
        // Once ready again, the next reconnection flushes what was cached since.
        hub.set_ready(true);
        let snap = hub.cache_lookup(2, "/n2").unwrap_err();
        hub.cache_fill(2, "/n2", snap, Some((b"v".to_vec(), stat())), 9, true);
        hub.set_ready(false);
        let (again, reused) = hub.reset_unless_flushed();
        assert!(!reused);
        assert_eq!(again.len(), 1, "client 2 holds /n2 again");
        assert!(!again.iter().any(|id| ahead.contains(id)));
    }

    #[test]
    fn a_reconnection_waits_for_a_client_still_owing_an_earlier_flush() {
        let hub = ready_hub(&[1, 2]);
        let snap = hub.cache_lookup(1, "/x").unwrap_err();
        hub.cache_fill(1, "/x", snap, Some((b"v".to_vec(), stat())), 7, true);
        // Flushed ahead; the leader answered again before client 1 acknowledged.
        let ahead = hub.reset();
        hub.set_ready(true);
        // Client 2 caches something meanwhile; then the leader really dies.
        let snap = hub.cache_lookup(2, "/y").unwrap_err();
        hub.cache_fill(2, "/y", snap, Some((b"v".to_vec(), stat())), 8, true);
        hub.set_ready(false);
        let (ids, reused) = hub.reset_unless_flushed();
        assert!(!reused);
        hub.ack(2, &ids);
        // The new reset is done, but client 1 may still serve /x: not yet.
        assert!(hub.all_done(&ids));
        assert!(!hub.nothing_owed());
        hub.ack(1, &ahead);
        assert!(hub.nothing_owed());
    }

    #[test]
    fn caching_resumed_after_a_flush_ahead_still_waits_for_clients_that_did_not_flush() {
        let hub = ready_hub(&[1]);
        let snap = hub.cache_lookup(1, "/c").unwrap_err();
        hub.cache_fill(1, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
        let ahead = hub.reset();
        // The leader answered again before client 1 dropped /c: caching resumes.
        hub.set_ready(true);
        // A write to /c must not be acknowledged while client 1 may still serve it.
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        assert!(
            hub.ack(1, &ahead).is_empty(),
            "the write's invalidation is separate"
        );
        let owed = hub.unacknowledged(1, Duration::ZERO, 64);
        assert_eq!(owed.len(), 1);
        assert_eq!(owed[0].1, vec!["/c".to_string()]);
        assert_eq!(hub.ack(1, &[owed[0].0]), vec![(99, 5)]);
    }

    #[test]
    fn an_invalidation_sent_again_is_not_acknowledged_before_its_holders() {
        let hub = ready_hub(&[1]);
        let snap = hub.cache_lookup(1, "/c").unwrap_err();
        hub.cache_fill(1, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        // The leader repeats it (KeepAlive reply, stream resend): its holder was taken the
        // first time, so treating it as new would acknowledge it at once.
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        // Overdue for client 1 only once it is old enough, and only for client 1.
        assert!(hub
            .unacknowledged(1, Duration::from_secs(60), 64)
            .is_empty());
        let u = hub.unacknowledged(1, Duration::ZERO, 64);
        assert_eq!(u.len(), 1);
        assert_eq!(u[0].1, vec!["/c".to_string()]);
        assert!(hub.unacknowledged(2, Duration::ZERO, 64).is_empty());
        assert_eq!(hub.ack(1, &[u[0].0]), vec![(99, 5)]);
        // Done with it: a later repeat (our acknowledgement was lost) is acknowledged again.
        assert_eq!(hub.invalidate(99, 5, vec!["/c".into()]), Some((99, 5)));
        assert_eq!(hub.pending_invalidations().0, 0);
    }

    #[test]
    fn overdue_invalidations_of_many_sessions_match_one_at_a_time() {
        // Clients 1..=5 cache /pop; 1 and 2 also cache /a; 6 caches nothing.
        let hub = ready_hub(&[1, 2, 3, 4, 5, 6]);
        let read = |s: SessionId, p: &str| {
            // The first reader fills the proxy's cache; later ones hit it (and hold it too).
            if let Err(snap) = hub.cache_lookup(s, p) {
                hub.cache_fill(s, p, snap, Some((b"v".to_vec(), stat())), 7, true);
            }
        };
        for s in 1..=5 {
            read(s, "/pop");
        }
        for s in [1, 2] {
            read(s, "/a");
        }
        assert!(hub.invalidate(99, 5, vec!["/pop".into()]).is_none());
        assert!(hub.invalidate(99, 6, vec!["/a".into()]).is_none());
        // Fewer sessions asked than waiting (walks the batch) and more (walks the waiters).
        for asked in [vec![2, 6], vec![1, 2, 3, 4, 5, 6, 7, 8]] {
            let many = hub.unacknowledged_many(&asked, Duration::ZERO, 64);
            for s in &asked {
                let one = hub.unacknowledged(*s, Duration::ZERO, 64);
                assert_eq!(many.get(s).cloned().unwrap_or_default(), one, "session {s}");
            }
            assert!(!many.contains_key(&6) && !many.contains_key(&7));
        }
        let two = hub.unacknowledged(2, Duration::ZERO, 64);
        assert_eq!(two.len(), 2, "oldest first: /pop then /a");
        assert_eq!(two[0].1, vec!["/pop".to_string()]);
        assert_eq!(two[1].1, vec!["/a".to_string()]);
        assert_eq!(hub.unacknowledged(2, Duration::ZERO, 1), two[..1].to_vec());
        let three = hub.unacknowledged(3, Duration::ZERO, 64);
        assert_eq!(three, vec![(two[0].0, vec!["/pop".to_string()])]);
        assert!(hub
            .unacknowledged_many(&[1, 2], Duration::from_secs(60), 64)
            .is_empty());
    }

    #[test]
    fn a_second_invalidation_waits_for_clients_owing_the_first() {
        // Client 1 caches /c and is cut off: it never acknowledges invalidation 5.
        let hub = ready_hub(&[1, 2]);
        let snap = hub.cache_lookup(1, "/c").unwrap_err();
        hub.cache_fill(1, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
        let (tx1, mut rx1) = tokio::sync::mpsc::unbounded_channel();
        hub.attach_stream(1, tx1);
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        let Ok(Ok(Reply::Invalidate { id: first, .. })) = rx1.try_recv() else {
            panic!("client 1 not invalidated")
        };
        // The next write to /c (and to /d, which nobody holds): client 1 still owes the
        // first acknowledgement, so it may still serve /c: this one waits for it too.
        assert!(
            hub.invalidate(99, 6, vec!["/c".into(), "/d".into()])
                .is_none(),
            "acknowledged upstream while client 1 may still serve /c"
        );
        let Ok(Ok(Reply::Invalidate { id: second, paths })) = rx1.try_recv() else {
            panic!("client 1 not told again")
        };
        assert_eq!(paths, vec!["/c".to_string()]);
        // A write to another node does not wait for it.
        assert_eq!(hub.invalidate(99, 7, vec!["/e".into()]), Some((99, 7)));
        assert_eq!(hub.ack(1, &[first]), vec![(99, 5)]);
        assert_eq!(hub.ack(1, &[second]), vec![(99, 6)]);
        assert_eq!(hub.pending_invalidations().0, 0);
        // Cut off for good instead: both wait until its lease as seen here runs out.
        let snap = hub.cache_lookup(2, "/c").unwrap_err();
        hub.cache_fill(2, "/c", snap, Some((b"v".to_vec(), stat())), 8, true);
        assert!(hub.invalidate(99, 8, vec!["/c".into()]).is_none());
        assert!(hub.invalidate(99, 9, vec!["/c".into()]).is_none());
        let mut acks = hub.tick(Instant::now() + Duration::from_secs(13));
        acks.sort();
        assert_eq!(acks, vec![(99, 8), (99, 9)]);
    }

    #[test]
    fn invalidation_waits_for_every_holder_then_acks_upstream() {
        let hub = ready_hub(&[1, 2]);
        let snap = hub.cache_lookup(1, "/c").unwrap_err();
        let r = hub.cache_fill(1, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
        assert!(matches!(r, Reply::CachedData { cachable: true, .. }));
        assert!(
            hub.cache_lookup(2, "/c").is_ok(),
            "served from the proxy's cache"
        );
        let (tx1, mut rx1) = tokio::sync::mpsc::unbounded_channel();
        hub.attach_stream(1, tx1);
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        let Ok(Ok(Reply::Invalidate { id, .. })) = rx1.try_recv() else {
            panic!("client 1 not invalidated")
        };
        assert!(hub.cache_lookup(3, "/c").is_err(), "dropped at once");
        assert!(
            hub.ack(1, &[id]).is_empty(),
            "client 2 has not acknowledged"
        );
        // Client 2 never answers: its lease as seen here runs out.
        let acks = hub.tick(Instant::now() + Duration::from_secs(13));
        assert_eq!(acks, vec![(99, 5)]);
    }

    /// A client's session opened before the proxy's own (so before any answer told the
    /// proxy the cell's lease): the proxy waits for it as long as the lease its open's
    /// answer named, not the 12 s default. Shorter: the write held for a silent client
    /// went on 12 s later instead of 3 s (the flaky
    /// `a_proxy_client_that_renews_but_never_acknowledges_loses_its_session`). Longer:
    /// the proxy stopped waiting while the client's cache was still valid.
    #[test]
    fn a_client_is_waited_for_as_long_as_the_lease_its_open_named() {
        for (lease_ms, waits_at, done_at) in
            [(3_000u64, 2_500u64, 3_500u64), (30_000, 13_000, 30_500)]
        {
            let hub = Hub::new();
            hub.set_ready(true);
            let opened = Instant::now();
            hub.opened(1, opened, lease_ms);
            hub.set_own_session(Some(opened));
            let snap = hub.cache_lookup(1, "/c").unwrap_err();
            let r = hub.cache_fill(1, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
            assert!(matches!(r, Reply::CachedData { cachable: true, .. }));
            assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
            let at = |ms| opened + Duration::from_millis(ms);
            assert!(
                hub.tick(at(waits_at)).is_empty(),
                "lease {lease_ms} ms: stopped waiting after {waits_at} ms"
            );
            assert_eq!(
                hub.tick(at(done_at)),
                vec![(99, 5)],
                "lease {lease_ms} ms: still waiting after {done_at} ms"
            );
        }
    }

    #[test]
    fn a_read_that_raced_an_invalidation_is_not_cached() {
        let hub = ready_hub(&[1]);
        let snap = hub.cache_lookup(1, "/c").unwrap_err();
        assert_eq!(hub.invalidate(99, 1, vec!["/c".into()]), Some((99, 1)));
        let r = hub.cache_fill(1, "/c", snap, None, 7, true);
        assert!(matches!(
            r,
            Reply::CachedData {
                cachable: false,
                ..
            }
        ));
        assert!(hub.cache_lookup(1, "/c").is_err());
        // A reset also makes reads in flight uncachable and invalidates every holder.
        let snap = hub.cache_lookup(1, "/d").unwrap_err();
        hub.cache_fill(1, "/d", snap, None, 8, true);
        let ids = hub.reset();
        assert_eq!(ids.len(), 1);
        assert!(!hub.all_done(&ids));
        assert!(
            hub.ack(1, &ids).is_empty(),
            "local invalidations owe nothing upstream"
        );
        assert!(hub.all_done(&ids));
    }

    #[test]
    fn nothing_is_cached_for_unknown_clients_or_past_the_proxys_own_lease() {
        let hub = ready_hub(&[1]);
        // A session never renewed here (or ended) is answered but not told to cache.
        let snap = hub.cache_lookup(7, "/c").unwrap_err();
        let r = hub.cache_fill(7, "/c", snap, None, 3, true);
        assert!(matches!(
            r,
            Reply::CachedData {
                cachable: false,
                ..
            }
        ));
        assert!(
            hub.cache_lookup(7, "/c").is_err(),
            "no hit for an unknown session"
        );
        assert!(
            hub.cache_lookup(1, "/c").is_ok(),
            "the value itself was cached"
        );
        // The proxy's own session may have run out at the leader: serve nothing cached.
        hub.set_own_session(Some(Instant::now() - Duration::from_secs(13)));
        assert!(!hub.ready());
        assert!(hub.cache_lookup(1, "/c").is_err());
        // A read sent while the stream was down is never cached.
        hub.set_own_session(Some(Instant::now()));
        hub.set_ready(false);
        let snap = hub.cache_lookup(1, "/d").unwrap_err();
        hub.set_ready(true);
        let r = hub.cache_fill(1, "/d", snap, None, 4, true);
        assert!(matches!(
            r,
            Reply::CachedData {
                cachable: false,
                ..
            }
        ));
    }

    #[test]
    fn a_reconnecting_client_is_sent_its_unacknowledged_invalidations_again() {
        let hub = ready_hub(&[1]);
        let snap = hub.cache_lookup(1, "/c").unwrap_err();
        hub.cache_fill(1, "/c", snap, None, 3, true);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let first = hub.attach_stream(1, tx);
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        drop(rx); // the stream broke with the invalidation in it
        hub.detach_stream(1, first);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        hub.attach_stream(1, tx);
        let Ok(Ok(Reply::Invalidate { id, paths })) = rx.try_recv() else {
            panic!("not sent again")
        };
        assert_eq!(paths, vec!["/c".to_string()]);
        assert_eq!(hub.ack(1, &[id]), vec![(99, 5)]);
    }

    fn stat() -> NodeStat {
        NodeStat {
            version: 0,
            children_version: 0,
            create_index: 1,
            mod_index: 1,
            ephemeral_owner: None,
            data_len: 1,
            children_count: 0,
        }
    }
}
