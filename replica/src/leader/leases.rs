//! Session lease deadlines on the leader, and the checkpoint rule that lets a dead client's
//! session expire even when leaders change faster than the lease.
//!
//! ## The problem
//!
//! KeepAlives are never logged, so a new leader does not know when each session last
//! renewed. Giving every session a full lease on takeover is safe (no live client is
//! expired by a fail-over) but, if leaders change faster than the lease, a dead client's
//! session is extended forever (etcd-io/etcd#9888, #17132).
//!
//! ## The rule
//!
//! A session may be *marked silent* in the log with a proven silence `S` ms. While it is
//! marked, no leader acknowledges a KeepAlive for it until a checkpoint entry naming it as
//! `renewed` has committed. So after the mark commits, no leader extended that session's
//! lease without the log saying so, and the last acknowledged renewal happened at least `S`
//! before the mark. Every leader's deadline for it was therefore at most
//! `mark_time − S + lease`, and a new leader (taking over after the mark) may safely give
//! it `lease − S` from its takeover instead of a full lease.
//!
//! - A new leader first commits `mark_all` (every session marked, keeping any recorded
//!   silence), so silence keeps accumulating across leaders. Live clients clear the mark
//!   with their next KeepAlive, batched into one checkpoint entry.
//! - Every `checkpoint_interval` the leader commits how much longer the sessions still
//!   marked have been silent: one number, the time since its previous silence checkpoint
//!   (the first interval starts when its `mark_all` committed), which every replica adds
//!   to each marked session's recorded silence after clearing the renewed ones. The sum
//!   is a lower bound of the truth; an interval whose entry fails is dropped, never
//!   counted twice. (A list of every marked session's silence, as before, was ~400 KB per
//!   entry after a fail-over with 50 000 sessions, re-sent to every follower.)
//! - Only one checkpoint is in flight at a time, so `renewed` and silence entries commit
//!   in the order the leader decided them.
//!
//! The cost: one small entry per checkpoint interval while some session is silent, and one
//! batched entry after each fail-over as live clients renew. Steady-state KeepAlives of
//! healthy sessions never touch the log.
//!
//! This struct is plain logic with time passed in; the session-manager actor drives it.

use std::time::Duration;
use tokio::time::Instant;
use wire::hash::HashMap;

use wire::command::LeaseCheckpoint;
use wire::types::SessionId;

#[derive(Debug, Clone)]
struct Lease {
    deadline: Instant,
    /// Marked silent in the log (or a mark is in flight): renewals need a checkpoint.
    marked: bool,
    /// An expiry entry is in flight.
    expiring: bool,
    /// A renewal is waiting for the next checkpoint.
    renewal_pending: bool,
    /// When its last KeepAlive arrived (the client is there, asking).
    asked_at: Option<Instant>,
}

/// The outcome of [`Leases::renew`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The lease now runs to `received + lease`.
    Renewed,
    /// The lease had run out (or its expiry is in flight): the session is over.
    Expired,
    /// Not renewable here right now (not tracked, or marked again by a new term): the
    /// client should simply retry.
    NotHere,
}

/// What to do with a KeepAlive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepAliveStep {
    /// Renew after confirming leadership.
    Renew,
    /// The session is marked silent: renew once a checkpoint naming it commits.
    NeedsCheckpoint,
    /// Not a session this leader tracks.
    Unknown,
    /// Its lease already ran out here.
    Expired,
}

/// The leader's lease table.
#[derive(Debug)]
pub struct Leases {
    lease: Duration,
    checkpoint_interval: Duration,
    sessions: HashMap<SessionId, Lease>,
    /// `mark_all` has not committed yet (sessions opened meanwhile start marked).
    mark_all_unapplied: bool,
    mark_all_proposed: bool,
    checkpoint_in_flight: bool,
    last_silence_checkpoint: Option<Instant>,
    /// Where the next silence checkpoint's interval starts: when this leader's `mark_all`
    /// committed (as it learned), then each silence checkpoint's creation. `None` before
    /// the mark committed: no silence is counted for sessions the log has not marked.
    silence_from: Option<Instant>,
    active: bool,
}

impl Leases {
    /// An inactive table (this replica does not lead).
    pub fn new(lease: Duration, checkpoint_interval: Duration) -> Leases {
        Leases {
            lease,
            checkpoint_interval,
            sessions: HashMap::default(),
            mark_all_unapplied: false,
            mark_all_proposed: false,
            checkpoint_in_flight: false,
            last_silence_checkpoint: None,
            silence_from: None,
            active: false,
        }
    }

    /// True while this replica leads and the table is loaded.
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Number of tracked sessions.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// True when no session is tracked.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Takes over: every session known to the state machine gets `lease − silence` from
    /// `now` (a full lease unless the log proves silence).
    pub fn become_leader(
        &mut self,
        now: Instant,
        sessions: impl IntoIterator<Item = (SessionId, Option<u64>)>,
    ) {
        self.sessions.clear();
        for (id, silent_ms) in sessions {
            let silent = silent_ms.unwrap_or(0);
            let remaining = self.lease.saturating_sub(Duration::from_millis(silent));
            self.sessions.insert(
                id,
                Lease {
                    deadline: now + remaining,
                    marked: true,
                    expiring: false,
                    renewal_pending: false,
                    asked_at: None,
                },
            );
        }
        self.mark_all_unapplied = true;
        self.mark_all_proposed = false;
        self.checkpoint_in_flight = false;
        self.last_silence_checkpoint = Some(now);
        self.silence_from = None;
        self.active = true;
    }

    /// Stops leading: forget everything.
    pub fn step_down(&mut self) {
        self.sessions.clear();
        self.active = false;
        self.checkpoint_in_flight = false;
    }

    /// A session was created (applied) while leading: a full lease. `marked_in_log` is
    /// whether the applied state has it marked (`silent_ms` set): a checkpoint that
    /// marked every session may have applied after the session was created and been
    /// answered (clearing `mark_all_unapplied`) before the creation's effect arrived, as
    /// the two travel by different tasks. A session marked in the log stays marked here
    /// until a checkpoint names it as renewed; renewed without one, its silence would
    /// keep growing in the log while its client renews, and the next leader would give
    /// it less lease than its client counts on.
    pub fn opened(&mut self, id: SessionId, now: Instant, marked_in_log: bool) {
        if !self.active {
            return;
        }
        self.sessions.entry(id).or_insert(Lease {
            deadline: now + self.lease,
            marked: self.mark_all_unapplied || marked_in_log,
            expiring: false,
            renewal_pending: false,
            asked_at: None,
        });
    }

    /// A session ended (applied).
    pub fn ended(&mut self, id: SessionId) {
        self.sessions.remove(&id);
    }

    /// Classifies a KeepAlive received at `now`.
    pub fn keepalive(&mut self, id: SessionId, now: Instant) -> KeepAliveStep {
        let Some(l) = self.sessions.get_mut(&id) else {
            return KeepAliveStep::Unknown;
        };
        if l.expiring || now >= l.deadline {
            return KeepAliveStep::Expired;
        }
        l.asked_at = Some(now);
        if l.marked {
            l.renewal_pending = true;
            return KeepAliveStep::NeedsCheckpoint;
        }
        KeepAliveStep::Renew
    }

    /// Extends a lease to `received + lease` after leadership was confirmed (and, for a
    /// marked session, after its renewal committed). Only a lease that really ran out
    /// yields [`Renewal::Expired`].
    pub fn renew(&mut self, id: SessionId, received: Instant, now: Instant) -> Renewal {
        let Some(l) = self.sessions.get_mut(&id) else {
            return Renewal::NotHere;
        };
        if l.expiring || now >= l.deadline {
            return Renewal::Expired;
        }
        if l.marked {
            return Renewal::NotHere;
        }
        l.deadline = l.deadline.max(received + self.lease);
        Renewal::Renewed
    }

    /// Sessions whose lease ran out by `now`; they are flagged so each is proposed once.
    pub fn take_expired(&mut self, now: Instant) -> Vec<SessionId> {
        let mut out: Vec<SessionId> = self
            .sessions
            .iter_mut()
            .filter(|(_, l)| !l.expiring && now >= l.deadline)
            .map(|(id, l)| {
                l.expiring = true;
                *id
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Stops the lease clock for `d`: every lease not already expiring runs `d` longer.
    /// The leader calls it for the time its own quorum was silent, when KeepAlives could
    /// not be confirmed (a slow or lossy link at the leader): clients that kept sending
    /// them must not lose their sessions for it. Extending a lease is always safe (no
    /// holder loses a lock earlier than its client expects); a dead client's session
    /// merely expires that much later. Recorded silence is not reduced, so checkpoints
    /// stay lower bounds.
    pub fn postpone(&mut self, d: Duration) {
        for l in self.sessions.values_mut().filter(|l| !l.expiring) {
            l.deadline += d;
        }
    }

    /// Stops the lease clock for `d` for the sessions whose clients are asking: those
    /// whose last KeepAlive arrived less than half a lease before `now` (a live client
    /// sends one every third of a lease, and retries within a quarter second when one
    /// fails). The leader calls it while its quorum is heard but KeepAlives' leadership
    /// confirmations stall or fail (a slow round trip, or apply lag holding the read gate
    /// back): a client that keeps asking must not lose its session for it however long
    /// that lasts, but a dead one (it asks nothing) expires on time, and one that died
    /// just after asking at most half a lease late. [`Leases::postpone`], for a silent
    /// quorum, stops every clock.
    pub fn postpone_asking(&mut self, d: Duration, now: Instant) {
        let recent = self.lease / 2;
        for l in self.sessions.values_mut().filter(|l| {
            !l.expiring
                && l.asked_at
                    .is_some_and(|at| now.saturating_duration_since(at) < recent)
        }) {
            l.deadline += d;
        }
    }

    /// An expiry proposal failed: these may be proposed again.
    pub fn expiry_failed(&mut self, ids: &[SessionId]) {
        for id in ids {
            if let Some(l) = self.sessions.get_mut(id) {
                l.expiring = false;
            }
        }
    }

    /// The next checkpoint to propose, if any is due and none is in flight.
    pub fn next_checkpoint(&mut self, now: Instant) -> Option<LeaseCheckpoint> {
        if !self.active || self.checkpoint_in_flight {
            return None;
        }
        let mut cp = LeaseCheckpoint::default();
        if self.mark_all_unapplied && !self.mark_all_proposed {
            cp.mark_all = true;
        }
        let mut renewed: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, l)| l.marked && l.renewal_pending && !l.expiring)
            .map(|(id, _)| *id)
            .collect();
        renewed.sort_unstable();
        cp.renewed = renewed;
        let silence_due = self
            .last_silence_checkpoint
            .is_none_or(|t| now.duration_since(t) >= self.checkpoint_interval);
        if silence_due {
            // One interval for every session still marked: the log only ever learns
            // silence that this leader measured since its mark committed. An interval
            // whose entry fails is lost, never counted twice: a lower bound stays one.
            let any_silent = self
                .sessions
                .values()
                .any(|l| l.marked && !l.renewal_pending && !l.expiring);
            if let (true, Some(from)) = (any_silent, self.silence_from) {
                cp.silent_add_ms = now.saturating_duration_since(from).as_millis() as u64;
                self.silence_from = Some(now);
            }
            self.last_silence_checkpoint = Some(now);
        }
        if !cp.mark_all && cp.renewed.is_empty() && cp.silent_add_ms == 0 {
            return None;
        }
        if cp.mark_all {
            self.mark_all_proposed = true;
        }
        self.checkpoint_in_flight = true;
        Some(cp)
    }

    /// The checkpoint `cp` committed (`ok`) or failed. Returns the sessions whose mark was
    /// cleared: their waiting KeepAlives may now be renewed.
    pub fn checkpoint_done(
        &mut self,
        cp: &LeaseCheckpoint,
        ok: bool,
        now: Instant,
    ) -> Vec<SessionId> {
        self.checkpoint_in_flight = false;
        if !ok {
            if cp.mark_all {
                self.mark_all_proposed = false;
            }
            return Vec::new();
        }
        if cp.mark_all {
            self.mark_all_unapplied = false;
            self.silence_from.get_or_insert(now);
        }
        let mut cleared = Vec::new();
        for id in &cp.renewed {
            if let Some(l) = self.sessions.get_mut(id) {
                l.marked = false;
                l.renewal_pending = false;
                cleared.push(*id);
            }
        }
        cleared
    }

    /// The deadline of one session (for tests and status).
    pub fn deadline(&self, id: SessionId) -> Option<Instant> {
        self.sessions.get(&id).map(|l| l.deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(12);
    const CP: Duration = Duration::from_secs(1);

    /// Issue 22, item 5: failing KeepAlive confirmations stop the clock only for the
    /// sessions whose clients keep asking; a dead session expires on time, and one that
    /// stopped asking expires at most half a lease late. (Before, every lease was
    /// postponed for as long as confirmations failed, so under sustained apply lag a dead
    /// session never expired.) A client that keeps asking survives any length of it.
    #[test]
    fn failing_confirmations_postpone_only_sessions_that_keep_asking() {
        let t0 = Instant::now();
        let lease = Duration::from_secs(12);
        let mut l = Leases::new(lease, Duration::from_secs(1));
        l.become_leader(t0, [(1, None), (2, None), (3, None)]);
        l.sessions.values_mut().for_each(|x| x.marked = false);
        // For 60 s no confirmation succeeds: session 1 asks every 4 s throughout,
        // session 3 asks once at 1 s and dies, session 2 is dead from the start.
        let second = Duration::from_secs(1);
        for s in 1..=60u64 {
            let now = t0 + second * s as u32;
            if s % 4 == 0 {
                assert_eq!(l.keepalive(1, now), KeepAliveStep::Renew, "at {s} s");
            }
            if s == 1 {
                assert_eq!(l.keepalive(3, now), KeepAliveStep::Renew);
            }
            l.postpone_asking(second, now);
            for id in l.take_expired(now) {
                match id {
                    2 => assert_eq!(s, 12, "the dead session expires on time"),
                    3 => assert!((12..=12 + 6).contains(&s), "expired at {s} s"),
                    other => panic!("session {other}, which kept asking, expired at {s} s"),
                }
            }
        }
        assert!(l.deadline(1).is_some_and(|d| d > t0 + second * 60));
    }

    #[test]
    fn takeover_gives_full_lease_unless_silence_is_recorded() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE, CP);
        l.become_leader(t0, [(1, None), (2, Some(5_000)), (3, Some(20_000))]);
        assert_eq!(l.deadline(1), Some(t0 + LEASE));
        assert_eq!(l.deadline(2), Some(t0 + Duration::from_secs(7)));
        assert_eq!(l.deadline(3), Some(t0));
        assert_eq!(l.take_expired(t0), vec![3]);
    }

    #[test]
    fn postponing_extends_live_leases_but_not_expiries_in_flight() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE, CP);
        l.become_leader(t0, [(1, None), (2, Some(12_000))]);
        assert_eq!(l.take_expired(t0), vec![2]);
        l.postpone(Duration::from_secs(3));
        assert_eq!(l.deadline(1), Some(t0 + LEASE + Duration::from_secs(3)));
        assert_eq!(l.deadline(2), Some(t0), "an expiry in flight stays decided");
        assert!(l.take_expired(t0 + LEASE).is_empty());
        assert_eq!(l.take_expired(t0 + LEASE + Duration::from_secs(3)), vec![1]);
    }

    #[test]
    fn marked_sessions_renew_only_through_a_checkpoint() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE, CP);
        l.become_leader(t0, [(1, None), (2, None)]);
        // First checkpoint marks everyone.
        let cp = l.next_checkpoint(t0).unwrap();
        assert!(cp.mark_all);
        assert!(
            l.next_checkpoint(t0).is_none(),
            "one checkpoint in flight at a time"
        );
        // Session 1 renews while the mark is in flight: it must wait.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(l.keepalive(1, t1), KeepAliveStep::NeedsCheckpoint);
        assert_eq!(l.renew(1, t1, t1), Renewal::NotHere);
        // The mark committed at t1: silence is counted from there.
        assert!(l.checkpoint_done(&cp, true, t1).is_empty());
        let cp2 = l.next_checkpoint(t1).unwrap();
        assert_eq!(cp2.renewed, vec![1]);
        assert_eq!(cp2.silent_add_ms, 0, "silence is not due yet");
        assert_eq!(l.checkpoint_done(&cp2, true, t1), vec![1]);
        assert_eq!(l.renew(1, t1, t1), Renewal::Renewed);
        assert_eq!(l.deadline(1), Some(t1 + LEASE));
        assert_eq!(l.keepalive(1, t1), KeepAliveStep::Renew);
        // Session 2 stays silent: its silence is checkpointed.
        let t2 = t0 + Duration::from_secs(3);
        let cp3 = l.next_checkpoint(t2).unwrap();
        assert_eq!(
            cp3.silent_add_ms, 2_500,
            "since the mark committed, not the takeover"
        );
        l.checkpoint_done(&cp3, true, t2);
        // A failed interval is lost, never counted twice.
        let t3 = t2 + Duration::from_secs(1);
        let cp4 = l.next_checkpoint(t3).unwrap();
        assert_eq!(cp4.silent_add_ms, 1_000);
        l.checkpoint_done(&cp4, false, t3);
        let t4 = t3 + Duration::from_secs(1);
        let cp5 = l.next_checkpoint(t4).unwrap();
        assert_eq!(cp5.silent_add_ms, 1_000);
        // Once session 2 renews, nobody is silent: no more silence entries.
        assert_eq!(l.checkpoint_done(&cp5, true, t4), Vec::<SessionId>::new());
        assert_eq!(l.keepalive(2, t4), KeepAliveStep::NeedsCheckpoint);
        let cp6 = l.next_checkpoint(t4 + Duration::from_secs(1)).unwrap();
        assert_eq!((cp6.renewed.clone(), cp6.silent_add_ms), (vec![2], 0));
    }

    #[test]
    fn silence_accumulates_across_fast_leader_changes() {
        // Each leader lives 4 s (< 12 s lease) and checkpoints before it dies; the
        // dead session's recorded silence grows until a leader expires it.
        let mut now = Instant::now();
        let mut recorded: Option<u64> = None;
        let mut expired_at_leader = None;
        for leader in 0..10 {
            let mut l = Leases::new(LEASE, CP);
            l.become_leader(now, [(7, recorded)]);
            let cp = l.next_checkpoint(now).unwrap();
            l.checkpoint_done(&cp, true, now);
            let mut expired = false;
            for _ in 0..40 {
                now += Duration::from_millis(100);
                if !l.take_expired(now).is_empty() {
                    expired = true;
                    break;
                }
                if let Some(cp) = l.next_checkpoint(now) {
                    if cp.silent_add_ms > 0 {
                        recorded = Some(recorded.unwrap_or(0) + cp.silent_add_ms);
                    }
                    l.checkpoint_done(&cp, true, now);
                }
            }
            if expired {
                expired_at_leader = Some(leader);
                break;
            }
        }
        assert!(
            expired_at_leader.is_some(),
            "a dead session must expire under leader churn"
        );
    }

    #[test]
    fn expired_leases_are_not_renewed() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE, CP);
        l.become_leader(t0, [(1, None)]);
        let cp = l.next_checkpoint(t0).unwrap();
        l.checkpoint_done(&cp, true, t0);
        let late = t0 + LEASE + Duration::from_millis(1);
        assert_eq!(l.keepalive(1, late), KeepAliveStep::Expired);
        assert_eq!(l.take_expired(late), vec![1]);
        assert!(l.take_expired(late).is_empty(), "proposed once");
        l.expiry_failed(&[1]);
        assert_eq!(l.take_expired(late), vec![1]);
    }
}
