//! The KeepAlive loop: renews the session every third of its lease, keeps the local lease
//! clock (started when a KeepAlive is sent, so it ends before the leader's), and moves the
//! session into jeopardy on time and to expired after the grace period.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

use wire::types::Reply;
use wire::Error;

use super::events::ack_invalidation;
use super::{Inner, SessionState};

pub(super) async fn keepalive_loop(inner: Arc<Inner>) {
    let interval = inner.lease / 3;
    let retry = Duration::from_millis(250).min(interval);
    let mut next = Instant::now() + interval;
    let mut state = inner.state_tx.subscribe();
    loop {
        // A retry's wait (or a late first KeepAlive) may outlast the local lease: enter
        // jeopardy when it runs out, not at the next try (up to `retry` later, while the
        // cell's lease may be ending: the holder must know at once).
        let local_deadline = inner.local_deadline();
        if local_deadline < next && inner.state() == SessionState::Healthy {
            if !sleep_unless_ended(&mut state, local_deadline).await {
                return;
            }
            if !inner.keepalives_stopped.load(Ordering::SeqCst)
                && Instant::now() >= inner.local_deadline()
            {
                enter_jeopardy(&inner);
            }
        }
        if !sleep_unless_ended(&mut state, next).await {
            return;
        }
        if inner.keepalives_stopped.load(Ordering::SeqCst) || inner.state() == SessionState::Expired
        {
            return;
        }
        let sent = Instant::now();
        let deadline_for_try = sent + interval.max(Duration::from_secs(1));
        let call = inner.client.keepalive(inner.id, deadline_for_try);
        tokio::pin!(call);
        let local_deadline = inner.local_deadline();
        // The lease may run out while this KeepAlive is in flight: enter jeopardy on time.
        let r = tokio::select! {
            r = &mut call => r,
            _ = tokio::time::sleep_until(local_deadline) => {
                enter_jeopardy(&inner);
                call.await
            }
        };
        match r {
            Ok((
                Reply::KeepAlive {
                    session_lease_ms,
                    unacknowledged,
                },
                addr,
            )) => {
                // Invalidations our event stream missed (Chubby's piggyback): drop the
                // nodes, then acknowledge to the server that holds the write.
                for (id, paths) in unacknowledged {
                    inner.cache.lock().expect("cache lock").invalidate(&paths);
                    ack_invalidation(&inner, addr, id);
                }
                let now = Instant::now();
                *inner.last_keepalive.lock().expect("keepalive lock") = Some((now, now - sent));
                // Shortened for clock drift: it ends before the leader's lease does.
                inner.set_local_deadline(
                    sent + wire::local_lease(Duration::from_millis(session_lease_ms)),
                );
                inner.set_state(SessionState::Healthy);
                next = sent + interval;
            }
            Err(Error::SessionExpired { .. }) | Err(Error::UnknownSession { .. }) => {
                inner.set_state(SessionState::Expired);
                return;
            }
            _ => {
                let local_deadline = inner.local_deadline();
                let now = Instant::now();
                if now >= local_deadline + inner.client.config().grace_period {
                    inner.set_state(SessionState::Expired);
                    return;
                }
                if now >= local_deadline {
                    enter_jeopardy(&inner);
                }
                next = now + retry;
            }
        }
    }
}

/// Sleeps until `at`; false, at once, if the session ends first (closed, or expired). A
/// closed session's loop must not keep its client, and so the client's connections and
/// UDP socket, for up to a third of a lease after the application let go of both: a
/// process that opens a client per short job (a cron job, a test, loadgen's arrivals)
/// would hold thousands of them.
async fn sleep_unless_ended(state: &mut watch::Receiver<SessionState>, at: Instant) -> bool {
    tokio::select! {
        _ = tokio::time::sleep_until(at) => true,
        _ = state.wait_for(|s| *s == SessionState::Expired) => false,
    }
}

fn enter_jeopardy(inner: &Inner) {
    inner.set_state(SessionState::Jeopardy);
}
