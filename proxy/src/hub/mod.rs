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
//!
//! The tables are one structure under one lock ([`Hub`]); its methods are grouped by
//! concern: `clients` (sessions, leases, overdue acknowledgements and event streams),
//! `cache` (cached reads, invalidations and their acknowledgements, resets) and
//! `watches` (the fan-out of upstream watches).

mod cache;
mod clients;
#[cfg(test)]
mod tests;
mod watches;

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
    /// The identity that owns the session, once known: this proxy opened it for that
    /// client, or the cell confirmed it (`Upstream::check_owner`).
    owner: Option<String>,
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
    /// The client identities the leader answered a read of this node for (forwarded for
    /// each): only they are served the cached copy; anyone else's read goes upstream, so
    /// the node's ACL decides it. An ACL change drops the entry like a write does.
    readers: HashSet<String>,
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
            owner: None,
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

    /// How long ago the proxy's own session stopped being surely alive (`None` while it
    /// is, or before it was first renewed).
    pub fn own_session_lapsed(&self, now: Instant) -> Option<std::time::Duration> {
        self.own_deadline
            .lock()
            .expect("own deadline")
            .and_then(|d| now.checked_duration_since(d))
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
