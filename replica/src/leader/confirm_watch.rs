//! Whether the leader is failing to confirm its leadership for KeepAlives.
//!
//! A KeepAlive renews a lease only once the leader has confirmed, through a quorum, that
//! it still leads. When those confirmations stall or fail (a slow or lossy link at the
//! leader), clients that keep renewing get no renewal, through no fault of theirs; the
//! session manager then stops its lease clock, as it does when Raft reports no quorum
//! acknowledgement at all. Raft's own quorum clock is not enough: with round trips just
//! above openraft's RPC timeout, the odd heartbeat still gets through (so the quorum clock
//! looks alive and expiries commit) while confirmations keep timing out. Stopping the
//! clock only extends leases, which never lets two holders act.
//!
//! Each confirmation holds a [`Ticket`] while it runs; a ticket dropped unfinished (the
//! KeepAlive's caller went away) is forgotten, so it cannot stop the clock for ever.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Default)]
struct State {
    next: u64,
    in_flight: BTreeMap<u64, Instant>,
    last_failure: Option<Instant>,
    last_success: Option<Instant>,
}

/// Confirmations in flight and the last outcomes; cheap to clone (clones share).
#[derive(Debug, Clone, Default)]
pub struct ConfirmWatch(Arc<Mutex<State>>);

/// One confirmation in flight; see [`Ticket::finish`].
#[derive(Debug)]
pub struct Ticket {
    watch: ConfirmWatch,
    id: u64,
}

impl ConfirmWatch {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A confirmation starts now.
    pub fn start(&self, now: Instant) -> Ticket {
        let id = self.with(|s| {
            s.next += 1;
            s.in_flight.insert(s.next, now);
            s.next
        });
        Ticket {
            watch: self.clone(),
            id,
        }
    }

    /// True while confirmations are failing: one has been waiting longer than `patience`,
    /// or the last one to end failed less than `memory` ago (and none succeeded since).
    pub fn failing(&self, now: Instant, patience: Duration, memory: Duration) -> bool {
        self.with(|s| {
            let stalled = s
                .in_flight
                .first_key_value()
                .is_some_and(|(_, started)| now.saturating_duration_since(*started) > patience);
            let failed = match (s.last_failure, s.last_success) {
                (Some(f), ok) => {
                    ok.is_none_or(|ok| ok < f) && now.saturating_duration_since(f) < memory
                }
                (None, _) => false,
            };
            stalled || failed
        })
    }

    /// Forgets everything (a new term: the old confirmations say nothing about it).
    pub fn reset(&self) {
        self.with(|s| {
            s.in_flight.clear();
            s.last_failure = None;
            s.last_success = None;
        });
    }
}

impl Ticket {
    /// The confirmation ended: `ok` if leadership was confirmed.
    pub fn finish(self, ok: bool, now: Instant) {
        self.watch.with(|s| {
            if s.in_flight.remove(&self.id).is_some() {
                if ok {
                    s.last_success = Some(now);
                } else {
                    s.last_failure = Some(now);
                }
            }
        });
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.watch.with(|s| {
            s.in_flight.remove(&self.id);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Duration = Duration::from_millis(500);
    const M: Duration = Duration::from_secs(6);

    #[test]
    fn a_stalled_confirmation_stops_the_clock_until_it_ends() {
        let w = ConfirmWatch::default();
        let t0 = Instant::now();
        let t = w.start(t0);
        assert!(!w.failing(t0 + Duration::from_millis(400), P, M));
        assert!(w.failing(t0 + Duration::from_millis(600), P, M));
        t.finish(true, t0 + Duration::from_millis(700));
        assert!(!w.failing(t0 + Duration::from_millis(700), P, M));
    }

    #[test]
    fn a_failure_counts_until_a_success_or_for_the_memory() {
        let w = ConfirmWatch::default();
        let t0 = Instant::now();
        w.start(t0).finish(false, t0);
        assert!(w.failing(t0 + Duration::from_secs(1), P, M));
        assert!(
            !w.failing(t0 + M + Duration::from_millis(1), P, M),
            "no attempt for a whole lease (dead clients): the clock runs again"
        );
        w.start(t0 + Duration::from_secs(2))
            .finish(true, t0 + Duration::from_secs(2));
        assert!(!w.failing(t0 + Duration::from_secs(3), P, M));
        w.start(t0 + Duration::from_secs(4))
            .finish(false, t0 + Duration::from_secs(4));
        assert!(w.failing(t0 + Duration::from_secs(5), P, M));
    }

    #[test]
    fn a_dropped_ticket_is_forgotten_and_a_reset_forgets_all() {
        let w = ConfirmWatch::default();
        let t0 = Instant::now();
        drop(w.start(t0));
        assert!(!w.failing(t0 + Duration::from_secs(2), P, M));
        let _pending = w.start(t0);
        w.start(t0).finish(false, t0);
        assert!(w.failing(t0 + Duration::from_secs(1), P, M));
        w.reset();
        assert!(!w.failing(t0 + Duration::from_secs(1), P, M));
    }
}
