//! Coalesced leadership checks.
//!
//! openraft 0.9 runs one quorum round per `ensure_linearizable` call. Reads and KeepAlives
//! arriving together share one round here: callers that arrive while a round is running
//! wait for the *next* round (one that starts after they arrived), so every caller's answer
//! is confirmed by a quorum heartbeat that happened after its request was received.
//!
//! **Barrier.** openraft 0.9 lets a leader that restarts keep leading in the same term,
//! reusing the no-op of its original election; its saved committed index may then be
//! behind entries that were acknowledged before the restart (it is not fsynced). So before
//! the first check a process answers, it commits a `Noop` of its own and waits for it to
//! apply: from then on the state machine holds every entry acknowledged before. With
//! openraft 0.10 that restore is turned off (`server::raft_config`: a restarted leader
//! stands in a new term), and a new leader's own blank entry already serves as the
//! barrier; the barrier stays anyway: it costs one entry per leadership and keeps reads
//! correct if the restore were ever turned back on.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use wire::Error;

use crate::raft::Raft;
use wire::command::Command;

type Waiter = oneshot::Sender<Result<(), Error>>;

/// One quorum round, retried while `timeout` lasts: a round fails when a follower answers
/// its heartbeat later than openraft waits for (a loaded follower, a big entry in flight),
/// and failing every caller then (each KeepAlive waiting on it, after a fail-over all of
/// them) would let live sessions expire for want of a second try. Every try starts after
/// the callers arrived, so a success confirms leadership as late as the first would have.
/// Losing leadership is final at once.
async fn confirm_within(raft: &Raft, timeout: Duration) -> Result<(), Error> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        // ReadIndex, as 0.9's `ensure_linearizable()` did: a quorum must acknowledge a
        // heartbeat sent after the call (openraft 0.10's LeaseRead would answer from an
        // earlier acknowledgement within the leader lease; not used). In 0.10 a round waits
        // at most one leader lease for its quorum, then fails (`QuorumNotEnough`) and is
        // retried here.
        let read = raft.ensure_linearizable(openraft::ReadPolicy::ReadIndex);
        match tokio::time::timeout_at(deadline, read).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => {
                let e = crate::errors::from_check_leader(e);
                if matches!(e, Error::NotLeader { .. })
                    || tokio::time::Instant::now() + RETRY_AFTER >= deadline
                {
                    return Err(e);
                }
                tracing::debug!("leadership not confirmed this round, retrying: {e}");
                tokio::time::sleep(RETRY_AFTER).await;
            }
            Err(_) => {
                return Err(Error::Unavailable {
                    reason: format!(
                        "leadership not confirmed by a quorum within {} ms",
                        timeout.as_millis()
                    ),
                })
            }
        }
    }
}

/// Pause between quorum rounds that failed.
const RETRY_AFTER: Duration = Duration::from_millis(20);

/// A cheap handle to the gate's task.
#[derive(Clone)]
pub struct ReadGate {
    tx: mpsc::UnboundedSender<Waiter>,
}

impl ReadGate {
    /// Starts the gate's task on the current tokio runtime.
    pub fn start(raft: Raft, timeout: Duration) -> ReadGate {
        let (tx, mut rx) = mpsc::unbounded_channel::<Waiter>();
        wire::rt::spawn(async move {
            let mut barrier_done = false;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while let Ok(more) = rx.try_recv() {
                    batch.push(more);
                }
                let started = tokio::time::Instant::now();
                let mut result = Ok(());
                if !barrier_done {
                    result = match tokio::time::timeout(timeout, raft.client_write(Command::Noop))
                        .await
                    {
                        Ok(Ok(_)) => {
                            barrier_done = true;
                            Ok(())
                        }
                        Ok(Err(e)) => Err(crate::errors::from_client_write(e)),
                        Err(_) => Err(Error::Unavailable {
                            reason: format!(
                                "barrier not committed within {} ms",
                                timeout.as_millis()
                            ),
                        }),
                    };
                }
                if result.is_ok() {
                    result = confirm_within(&raft, timeout).await;
                }
                tracing::debug!(
                    waiters = batch.len(),
                    ok = result.is_ok(),
                    ms = started.elapsed().as_millis() as u64,
                    "leadership round"
                );
                for w in batch {
                    let _ = w.send(result.clone());
                }
            }
        });
        ReadGate { tx }
    }

    /// Resolves once a quorum confirmed this replica's leadership after the call, and the
    /// state machine has applied everything committed before it.
    pub async fn confirm(&self) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(tx).map_err(|_| Error::Unavailable {
            reason: "replica shutting down".into(),
        })?;
        rx.await.map_err(|_| Error::Unavailable {
            reason: "replica shutting down".into(),
        })?
    }
}
