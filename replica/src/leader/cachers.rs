//! The cacher list: who caches which node, and the invalidations a write waits for.
//!
//! Chubby's rule: a write to a cached node is held until every session that may cache it
//! has dropped the value. A hold marks its nodes *uncachable* (reads meanwhile get the
//! committed, old value and are not recorded as cachers), invalidates every cacher of
//! them, and completes once each has acknowledged or its session ended (its lease ran out
//! at the leader: the client's own lease, which runs from when it sent its KeepAlive,
//! ended earlier still). Then the write is proposed; once it is applied the hold is
//! released and the nodes become cachable again.
//!
//! Recording is two-phase to be atomic with the read: [`Cachers::begin_read`] returns the
//! node's hold epoch (or `None` while it is uncachable), the read happens, and
//! [`Cachers::record`] accepts the cacher only if no hold started since. A hold that
//! starts after `begin_read` therefore either sees the cacher (and invalidates it) or
//! makes the read uncachable.
//!
//! A hold may name a whole prefix, as `/payments/` (a node path never ends in `/`): it
//! covers the prefix's node and every node below it, cached or not yet, present or absent
//! (a prefix frozen for a move: no copy cached from this cell may outlive the move).
//! The key [`ALL`] covers every node (a cell recording its first prefix stops serving
//! every other one).
//!
//! Leader-local and volatile: lost on fail-over; clients flush their caches then.

use std::time::Duration;
use tokio::time::Instant;
use wire::hash::{HashMap, HashSet};

use wire::types::SessionId;

/// One hold in progress.
#[derive(Debug)]
struct Hold {
    paths: Vec<String>,
    /// Cachers of the paths that have not acknowledged.
    waiting: HashSet<SessionId>,
    /// After a fail-over: sessions that may still cache anything from the old leader and
    /// have not confirmed their cache was flushed.
    unconfirmed: HashSet<SessionId>,
    started: Instant,
}

impl Hold {
    fn done(&self) -> bool {
        self.waiting.is_empty() && self.unconfirmed.is_empty()
    }
}

/// What a new hold must send: `(session, invalidation id, paths)` per cacher.
pub type Invalidations = Vec<(SessionId, Vec<String>)>;

/// The table.
#[derive(Debug, Default)]
pub struct Cachers {
    by_path: HashMap<String, HashSet<SessionId>>,
    by_session: HashMap<SessionId, HashSet<String>>,
    /// Holds in progress per path (several writes may wait on one node).
    holding: HashMap<String, u32>,
    /// Bumped whenever a hold starts on the path.
    epoch: HashMap<String, u64>,
    holds: HashMap<u64, Hold>,
    next_hold: u64,
}

impl Cachers {
    /// An empty table.
    pub fn new() -> Cachers {
        Cachers::default()
    }

    /// Number of (session, node) records.
    pub fn len(&self) -> usize {
        self.by_session.values().map(HashSet::len).sum()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Phase one of a cached read: the node's epoch, or `None` while a write holds it
    /// (or its prefix).
    pub fn begin_read(&self, path: &str) -> Option<u64> {
        let key = prefix_key(path);
        let held = |k: &str| self.holding.get(k).copied().unwrap_or(0) > 0;
        if held(path) || held(ALL) || key.as_deref().is_some_and(held) {
            return None;
        }
        let epoch = |k: &str| self.epoch.get(k).copied().unwrap_or(0);
        // All only grow: their sum changes whenever one does.
        Some(epoch(path) + epoch(ALL) + key.as_deref().map_or(0, epoch))
    }

    /// Phase two: records `session` as a cacher of `path` if no hold started since
    /// `begin_read` returned `epoch`. Returns whether the reader may cache.
    pub fn record(&mut self, session: SessionId, path: &str, epoch: u64) -> bool {
        if self.begin_read(path) != Some(epoch) {
            return false;
        }
        self.by_path
            .entry(path.to_string())
            .or_default()
            .insert(session);
        self.by_session
            .entry(session)
            .or_default()
            .insert(path.to_string());
        true
    }

    /// Starts a hold on `paths`: marks them uncachable and returns the hold's id with the
    /// invalidations to send. `unconfirmed` are sessions that may cache anything since an
    /// earlier leader (see [`Cachers::confirm`]); the hold waits for them too.
    pub fn hold(
        &mut self,
        paths: &[String],
        now: Instant,
        unconfirmed: HashSet<SessionId>,
    ) -> (u64, Invalidations) {
        self.next_hold += 1;
        let id = self.next_hold;
        let mut per_session: HashMap<SessionId, Vec<String>> = HashMap::default();
        for p in paths {
            *self.holding.entry(p.clone()).or_default() += 1;
            *self.epoch.entry(p.clone()).or_default() += 1;
            if is_prefix_key(p) {
                for (cached, sessions) in &self.by_path {
                    if under_key(cached, p) {
                        for s in sessions {
                            per_session.entry(*s).or_default().push(cached.clone());
                        }
                    }
                }
                continue;
            }
            for s in self.by_path.get(p).into_iter().flatten() {
                per_session.entry(*s).or_default().push(p.clone());
            }
        }
        for v in per_session.values_mut() {
            v.sort();
            v.dedup();
        }
        let waiting: HashSet<SessionId> = per_session.keys().copied().collect();
        self.holds.insert(
            id,
            Hold {
                paths: paths.to_vec(),
                waiting,
                unconfirmed,
                started: now,
            },
        );
        let mut sends: Invalidations = per_session.into_iter().collect();
        sends.sort();
        (id, sends)
    }

    /// The invalidations `session` has not acknowledged yet, with the nodes of each it
    /// caches: resent when its event stream reconnects (a frame written to a stream that
    /// then broke may never have arrived).
    pub fn unacknowledged(&self, session: SessionId) -> Vec<(u64, Vec<String>)> {
        let cached = self.by_session.get(&session);
        let mut out: Vec<(u64, Vec<String>)> = self
            .holds
            .iter()
            .filter(|(_, h)| h.waiting.contains(&session))
            .map(|(id, h)| {
                let mut paths: Vec<String> = Vec::new();
                for p in &h.paths {
                    let Some(c) = cached else { break };
                    if is_prefix_key(p) {
                        // A prefix hold names no node: what it invalidates here is every
                        // node of the session's cache under it (sent again with the
                        // nodes, as at first; an empty list would be acknowledged without
                        // dropping anything).
                        paths.extend(c.iter().filter(|n| under_key(n, p)).cloned());
                    } else if c.contains(p) {
                        paths.push(p.clone());
                    }
                }
                paths.sort();
                paths.dedup();
                (*id, paths)
            })
            .collect();
        out.sort();
        out
    }

    /// Like [`Cachers::unacknowledged`], only the invalidations sent at least `age` before
    /// `now`, the oldest first, at most `max` of them and of at most `bytes_max` bytes of
    /// paths, which is lowered by what they take (for KeepAlive replies).
    pub fn unacknowledged_older(
        &self,
        session: SessionId,
        now: Instant,
        age: std::time::Duration,
        max: usize,
        bytes_max: &mut usize,
    ) -> Vec<(u64, Vec<String>)> {
        if !self.by_session.contains_key(&session)
            && !self.holds.values().any(|h| h.waiting.contains(&session))
        {
            return Vec::new();
        }
        let old: wire::hash::HashSet<u64> = self
            .holds
            .iter()
            .filter(|(_, h)| h.started + age <= now && h.waiting.contains(&session))
            .map(|(id, _)| *id)
            .collect();
        if old.is_empty() {
            return Vec::new();
        }
        let mut out = self.unacknowledged(session);
        out.retain(|(id, _)| old.contains(id));
        out.truncate(max);
        // Within `bytes_max` (a prefix hold names every node cached under it): one that
        // does not fit is left to the event stream's resend, or the session's lease.
        let mut left = *bytes_max;
        out.retain(|(_, paths)| {
            let bytes = 16 + paths.iter().map(|p| p.len() + 8).sum::<usize>();
            if bytes > left {
                return false;
            }
            left -= bytes;
            true
        });
        *bytes_max = left;
        out
    }

    /// Of `sessions`, those that a hold begun `age` or longer before `now` still waits
    /// for: an invalidation they have not acknowledged, or (after a fail-over) a flush
    /// they have not confirmed (a client that moved behind a proxy never reopens its own
    /// stream to the leader).
    pub fn overdue(&self, sessions: &[SessionId], now: Instant, age: Duration) -> Vec<SessionId> {
        let late: Vec<&Hold> = self
            .holds
            .values()
            .filter(|h| h.started + age <= now && !h.done())
            .collect();
        if late.is_empty() {
            return Vec::new();
        }
        sessions
            .iter()
            .copied()
            .filter(|s| {
                late.iter()
                    .any(|h| h.waiting.contains(s) || h.unconfirmed.contains(s))
            })
            .collect()
    }

    /// True once every cacher of the hold acknowledged or ended.
    pub fn hold_complete(&self, id: u64) -> bool {
        self.holds.get(&id).is_none_or(Hold::done)
    }

    /// `session` acknowledged invalidation `id`: it no longer caches those nodes. Returns
    /// whether the hold just completed.
    pub fn ack(&mut self, session: SessionId, id: u64) -> bool {
        let Some(h) = self.holds.get_mut(&id) else {
            return false;
        };
        if !h.waiting.remove(&session) {
            return false;
        }
        let paths = h.paths.clone();
        let done = h.done();
        for p in &paths {
            if is_prefix_key(p) {
                let under: Vec<String> = self
                    .by_session
                    .get(&session)
                    .into_iter()
                    .flatten()
                    .filter(|c| under_key(c, p))
                    .cloned()
                    .collect();
                for c in under {
                    self.forget(session, &c);
                }
            } else {
                self.forget(session, p);
            }
        }
        done
    }

    /// A session ended: it caches nothing. Returns the holds that completed.
    pub fn session_ended(&mut self, session: SessionId) -> Vec<u64> {
        for p in self.by_session.remove(&session).unwrap_or_default() {
            if let Some(set) = self.by_path.get_mut(&p) {
                set.remove(&session);
                if set.is_empty() {
                    self.by_path.remove(&p);
                }
            }
        }
        let mut done = Vec::new();
        for (id, h) in self.holds.iter_mut() {
            let removed = h.waiting.remove(&session) | h.unconfirmed.remove(&session);
            if removed && h.done() {
                done.push(*id);
            }
        }
        done.sort_unstable();
        done
    }

    /// After a fail-over, `session` confirmed it flushed its cache (its event stream
    /// reconnected to this leader, which the SDK does only after flushing). Returns the
    /// holds that completed.
    pub fn confirm(&mut self, session: SessionId) -> Vec<u64> {
        let mut done = Vec::new();
        for (id, h) in self.holds.iter_mut() {
            if h.unconfirmed.remove(&session) && h.done() {
                done.push(*id);
            }
        }
        done.sort_unstable();
        done
    }

    /// The write under hold `id` was applied (or failed): its nodes become cachable again.
    pub fn release(&mut self, id: u64) {
        let Some(h) = self.holds.remove(&id) else {
            return;
        };
        for p in h.paths {
            if let Some(n) = self.holding.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.holding.remove(&p);
                }
            }
        }
    }

    /// Holds still waiting for acknowledgements.
    pub fn holds_waiting(&self) -> usize {
        self.holds.values().filter(|h| !h.done()).count()
    }

    /// Age of the oldest hold still waiting for acknowledgements.
    pub fn oldest_waiting(&self, now: Instant) -> Duration {
        self.holds
            .values()
            .filter(|h| !h.done())
            .map(|h| now.duration_since(h.started))
            .max()
            .unwrap_or_default()
    }

    /// Forgets everything (leadership lost).
    pub fn clear(&mut self) {
        // Hold ids are never reused: a `Release` or an acknowledgement arriving late from
        // an earlier term must not match a hold of this one.
        let next_hold = self.next_hold;
        *self = Cachers::default();
        self.next_hold = next_hold;
    }

    /// Hold ids from here on are above `floor` (a new leader passes its term shifted
    /// left by 32 bits, so ids stay unique across terms and across restarts).
    pub fn ids_above(&mut self, floor: u64) {
        self.next_hold = self.next_hold.max(floor);
    }

    fn forget(&mut self, session: SessionId, path: &str) {
        if let Some(set) = self.by_path.get_mut(path) {
            set.remove(&session);
            if set.is_empty() {
                self.by_path.remove(path);
            }
        }
        if let Some(set) = self.by_session.get_mut(&session) {
            set.remove(path);
            if set.is_empty() {
                self.by_session.remove(&session);
            }
        }
    }
}

/// The hold key of every node.
pub const ALL: &str = "//";

/// The hold key of a whole prefix: `/payments/` for `/payments`.
pub fn prefix_hold(prefix: &str) -> String {
    format!("{prefix}/")
}

fn is_prefix_key(k: &str) -> bool {
    k.len() > 1 && k.ends_with('/')
}

/// The prefix hold key a node path falls under (`/payments/a` → `/payments/`).
fn prefix_key(path: &str) -> Option<String> {
    wire::directory::prefix_of(path).map(prefix_hold)
}

/// Whether the node `path` is covered by the prefix hold key `key`.
fn under_key(path: &str, key: &str) -> bool {
    key == ALL || path.starts_with(key) || path == &key[..key.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefix hold invalidates every cacher below the prefix (and of the prefix node),
    /// makes every path below it uncachable, even one not cached when it started, and a
    /// read that began before it cannot be recorded after it.
    #[test]
    fn a_prefix_hold_covers_every_node_below_it() {
        let now = Instant::now();
        let mut c = Cachers::new();
        let e = c.begin_read("/pay/a").unwrap();
        assert!(c.record(1, "/pay/a", e));
        let e = c.begin_read("/pay").unwrap();
        assert!(c.record(2, "/pay", e));
        let e = c.begin_read("/payroll/x").unwrap();
        assert!(c.record(3, "/payroll/x", e));
        let racing = c.begin_read("/pay/new").unwrap();
        let (id, sends) = c.hold(&[prefix_hold("/pay")], now, HashSet::default());
        assert_eq!(sends, vec![(1, p("/pay/a")), (2, p("/pay"))]);
        assert_eq!(c.begin_read("/pay/b"), None);
        assert!(
            !c.record(4, "/pay/new", racing),
            "a read begun before the hold"
        );
        assert!(c.begin_read("/payroll/y").is_some(), "another prefix");
        // Sent again (a reconnected stream, a KeepAlive reply) with the nodes it
        // invalidates, never with none: an empty list would be acknowledged as done.
        assert_eq!(c.unacknowledged(1), vec![(id, p("/pay/a"))]);
        assert_eq!(c.unacknowledged(2), vec![(id, p("/pay"))]);
        assert_eq!(
            c.unacknowledged_older(
                1,
                now + Duration::from_secs(2),
                Duration::from_secs(1),
                8,
                &mut 1_000
            ),
            vec![(id, p("/pay/a"))]
        );
        assert!(!c.ack(1, id));
        assert!(c.ack(2, id));
        assert!(c.hold_complete(id));
        assert_eq!(c.len(), 1, "only /payroll/x is still cached");
        c.release(id);
        assert!(c.begin_read("/pay/b").is_some());
        // The key of every node.
        let racing = c.begin_read("/x").unwrap();
        let (all, sends) = c.hold(&[ALL.to_string()], now, HashSet::default());
        assert_eq!(sends, vec![(3, p("/payroll/x"))]);
        assert_eq!(c.unacknowledged(3), vec![(all, p("/payroll/x"))]);
        assert_eq!(c.begin_read("/pay/b"), None);
        assert!(!c.record(5, "/x", racing));
        assert!(c.ack(3, all));
        assert!(c.is_empty());
        c.release(all);
        assert!(c.begin_read("/x").is_some());
    }

    fn p(s: &str) -> Vec<String> {
        vec![s.to_string()]
    }

    /// KeepAlive replies carry unacknowledged invalidations within a byte budget: a
    /// prefix hold over many cached nodes that does not fit is left out (to the event
    /// stream's resend), and what fits is sent whole, never cut.
    #[test]
    fn keepalive_resends_stay_within_their_byte_budget() {
        let now = Instant::now();
        let mut c = Cachers::new();
        for i in 0..100 {
            let path = format!("/big/n{i:03}");
            let e = c.begin_read(&path).unwrap();
            assert!(c.record(1, &path, e));
        }
        let e = c.begin_read("/small").unwrap();
        assert!(c.record(1, "/small", e));
        let (big, _) = c.hold(&[prefix_hold("/big")], now, HashSet::default());
        let (small, _) = c.hold(&p("/small"), now, HashSet::default());
        let later = now + Duration::from_secs(2);
        let age = Duration::from_secs(1);
        let mut budget = 200;
        let sent = c.unacknowledged_older(1, later, age, 64, &mut budget);
        assert_eq!(sent, vec![(small, p("/small"))], "the big one does not fit");
        assert!(budget < 200);
        let mut budget = 100_000;
        let sent = c.unacknowledged_older(1, later, age, 64, &mut budget);
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0].0, big);
        assert_eq!(sent[0].1.len(), 100, "sent whole");
    }

    #[test]
    fn hold_waits_for_every_cacher_then_releases() {
        let now = Instant::now();
        let mut c = Cachers::new();
        let e = c.begin_read("/cfg").unwrap();
        assert!(c.record(1, "/cfg", e));
        assert!(c.record(2, "/cfg", e));
        let (id, sends) = c.hold(&p("/cfg"), now, HashSet::default());
        assert_eq!(sends, vec![(1, p("/cfg")), (2, p("/cfg"))]);
        assert!(!c.hold_complete(id));
        // Uncachable meanwhile.
        assert_eq!(c.begin_read("/cfg"), None);
        assert!(!c.ack(1, id));
        assert!(c.ack(2, id), "complete when the last cacher acknowledges");
        assert!(c.hold_complete(id));
        assert!(c.is_empty(), "acknowledging cachers cache nothing any more");
        c.release(id);
        assert!(c.begin_read("/cfg").is_some());
    }

    #[test]
    fn unacknowledged_invalidations_are_listed_for_resending() {
        let now = Instant::now();
        let mut c = Cachers::new();
        for path in ["/a", "/b"] {
            let e = c.begin_read(path).unwrap();
            assert!(c.record(1, path, e));
        }
        let e = c.begin_read("/a").unwrap();
        assert!(c.record(2, "/a", e));
        let (h1, _) = c.hold(&p("/a"), now, HashSet::default());
        let (h2, _) = c.hold(&p("/b"), now, HashSet::default());
        assert_eq!(c.unacknowledged(1), vec![(h1, p("/a")), (h2, p("/b"))]);
        assert!(!c.ack(1, h1));
        assert_eq!(c.unacknowledged(1), vec![(h2, p("/b"))]);
        assert_eq!(c.unacknowledged(2), vec![(h1, p("/a"))]);
        assert!(c.unacknowledged(3).is_empty());
    }

    #[test]
    fn only_overdue_invalidations_are_repeated_in_keepalive_replies() {
        let t0 = Instant::now();
        let mut c = Cachers::new();
        for path in ["/a", "/b", "/c"] {
            let e = c.begin_read(path).unwrap();
            assert!(c.record(1, path, e));
        }
        let (h1, _) = c.hold(&p("/a"), t0, HashSet::default());
        let (h2, _) = c.hold(&p("/b"), t0 + Duration::from_secs(1), HashSet::default());
        let (_h3, _) = c.hold(&p("/c"), t0 + Duration::from_secs(2), HashSet::default());
        let age = Duration::from_secs(1);
        let at = t0 + Duration::from_millis(2_500);
        assert_eq!(
            c.unacknowledged_older(1, at, age, 64, &mut 1_000),
            vec![(h1, p("/a")), (h2, p("/b"))]
        );
        assert_eq!(
            c.unacknowledged_older(1, at, age, 1, &mut 1_000),
            vec![(h1, p("/a"))]
        );
        assert!(c
            .unacknowledged_older(2, at, age, 64, &mut 1_000)
            .is_empty());
        assert!(c.ack(1, h1), "its only cacher acknowledged");
        assert_eq!(
            c.unacknowledged_older(1, at, age, 64, &mut 1_000),
            vec![(h2, p("/b"))]
        );
    }

    #[test]
    fn sessions_that_leave_an_invalidation_unacknowledged_too_long_are_overdue() {
        let t0 = Instant::now();
        let mut c = Cachers::new();
        for s in [1, 2] {
            let e = c.begin_read("/a").unwrap();
            assert!(c.record(s, "/a", e));
        }
        let (id, _) = c.hold(&p("/a"), t0, HashSet::default());
        let age = Duration::from_secs(24);
        assert!(c
            .overdue(&[1, 2, 3], t0 + Duration::from_secs(23), age)
            .is_empty());
        assert!(!c.ack(2, id));
        assert_eq!(c.overdue(&[1, 2, 3], t0 + age, age), vec![1]);
        assert!(c.ack(1, id));
        assert!(c.overdue(&[1, 2, 3], t0 + age, age).is_empty());
        // After a fail-over: a session that never confirms its flush is overdue too.
        let (id, _) = c.hold(&p("/b"), t0, HashSet::from_iter([4]));
        assert!(c.overdue(&[4], t0 + Duration::from_secs(1), age).is_empty());
        assert_eq!(c.overdue(&[3, 4], t0 + age, age), vec![4]);
        assert_eq!(c.confirm(4), vec![id]);
        assert!(c.overdue(&[4], t0 + age, age).is_empty());
    }

    #[test]
    fn a_read_racing_a_hold_is_not_recorded() {
        let now = Instant::now();
        let mut c = Cachers::new();
        let e = c.begin_read("/cfg").unwrap();
        // A write holds and completes (nobody cached) and is released before the read's
        // record arrives: the read saw the old value and must not be cached.
        let (id, sends) = c.hold(&p("/cfg"), now, HashSet::default());
        assert!(sends.is_empty() && c.hold_complete(id));
        c.release(id);
        assert!(!c.record(7, "/cfg", e));
        assert!(c.is_empty());
    }

    #[test]
    fn ended_sessions_complete_holds_and_age_is_reported() {
        let t0 = Instant::now();
        let mut c = Cachers::new();
        for s in [1, 2] {
            let e = c.begin_read("/a").unwrap();
            c.record(s, "/a", e);
        }
        let (id, _) = c.hold(&p("/a"), t0, HashSet::default());
        assert_eq!(
            c.oldest_waiting(t0 + Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert!(c.session_ended(1).is_empty());
        assert_eq!(c.session_ended(2), vec![id]);
        assert_eq!(
            c.oldest_waiting(t0 + Duration::from_secs(4)),
            Duration::ZERO
        );
        // Two writes on one node: cachable only after both released.
        let (a, _) = c.hold(&p("/b"), t0, HashSet::default());
        let (b, _) = c.hold(&p("/b"), t0, HashSet::default());
        c.release(a);
        assert_eq!(c.begin_read("/b"), None);
        c.release(b);
        assert!(c.begin_read("/b").is_some());
    }

    #[test]
    fn after_a_failover_holds_wait_for_unconfirmed_sessions() {
        let t0 = Instant::now();
        let mut c = Cachers::new();
        // Nobody cached at this leader, but sessions 1 and 2 may hold values cached from
        // the old one.
        let (id, sends) = c.hold(&p("/x"), t0, HashSet::from_iter([1, 2]));
        assert!(sends.is_empty());
        assert!(!c.hold_complete(id));
        assert!(c.confirm(1).is_empty());
        assert_eq!(c.confirm(2), vec![id]);
        let (id2, _) = c.hold(&p("/y"), t0, HashSet::from_iter([3]));
        assert_eq!(c.session_ended(3), vec![id2], "or its lease ran out");
    }
}
