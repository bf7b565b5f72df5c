//! Leadership handed over on purpose (issue 27, item 5): when a leader is told to stop
//! (SIGTERM, `server::run`) and on `lockctl member transfer-leader`
//! ([`wire::types::Op::TransferLeader`]).
//!
//! openraft 0.10's transfer: the leader stops taking new entries and sending heartbeats
//! and tells every voter; the voters drop their leader lease for that transfer, and the
//! target, once its log holds the leader's last entry, stands at once and is elected
//! without waiting for any timer. Clients whose writes reach the old leader meanwhile are
//! answered `NotLeader` naming the target and try again there.

use std::time::{Duration, Instant};

use openraft::ServerState;
use wire::raft::NodeId;
use wire::Error;

use crate::raft::Raft;

/// How long a hand-over is given: a target that is caught up is elected within a few
/// round trips (10-50 ms in the tests); this bounds one that is not, or that stopped at
/// the same moment (a whole cell stopped at once): the replica then stops anyway on
/// SIGTERM, and the cell elects a leader by its timers as after a crash.
pub const HAND_OVER_WITHIN: Duration = Duration::from_secs(1);

/// A follower whose last answer to the leader is older than this is not handed the
/// leadership (it may be down); a few heartbeat intervals.
const HEARD_WITHIN: Duration = Duration::from_secs(1);

/// How often the transfer is asked for again until another replica leads. openraft's
/// target ignores a transfer while its log lacks the leader's last entry, which may
/// still be on its way when the first request arrives; the leader takes no new entry once
/// asked, so a later request finds the target caught up. Without asking again, the
/// leader would refuse writes and send no heartbeat until the voters' timers ran out.
const ASK_AGAIN: Duration = Duration::from_millis(50);

/// The voter the leadership goes to: `to` if given (a voter other than `me`), else the
/// voter other than `me` whose log the leader has replicated furthest (the lowest id
/// among equals), so the transfer waits least for the target to catch up. Either must
/// have answered the leader within [`HEARD_WITHIN`]; none while a membership change is
/// half done (the second step needs this leader). `Ok(None)`: `to` is `me`, which leads
/// already. Refusals are [`Error::Membership`] (not retried: a retry would not help
/// soon, and a retried hand-over could move the leadership again).
pub fn choose(
    m: &openraft::RaftMetrics<wire::raft::TypeConfig>,
    me: NodeId,
    to: Option<NodeId>,
) -> Result<Option<NodeId>, Error> {
    use openraft::Instant as _;
    let refuse = |reason: String| Err(Error::Membership { reason });
    if to == Some(me) {
        return Ok(None);
    }
    let membership = m.membership_config.membership();
    if membership.get_joint_config().len() > 1 {
        return refuse(
            "a membership change is half done; hand the leadership over once it completes".into(),
        );
    }
    let voters: Vec<NodeId> = membership.voter_ids().filter(|id| *id != me).collect();
    let heard = |id: &NodeId| {
        m.heartbeat
            .as_ref()
            .and_then(|h| h.get(id).cloned().flatten())
            .is_some_and(|at| at.elapsed() < HEARD_WITHIN)
    };
    if let Some(to) = to {
        if !voters.contains(&to) {
            return refuse(format!(
                "replica {to} is not a voter of this cell (voters: {voters:?})"
            ));
        }
        if !heard(&to) {
            return refuse(format!(
                "replica {to} has not answered the leader for {HEARD_WITHIN:?} or more"
            ));
        }
        return Ok(Some(to));
    }
    if voters.is_empty() {
        return refuse("this cell has no other voter to hand the leadership to".into());
    }
    voters
        .iter()
        .copied()
        .filter(heard)
        .max_by(|a, b| matched(m, *a).cmp(&matched(m, *b)).then(b.cmp(a)))
        .map(Some)
        .ok_or_else(|| Error::Membership {
            reason: format!(
                "no other voter has answered the leader within {HEARD_WITHIN:?} (voters: {voters:?})"
            ),
        })
}

/// The index of the last entry the leader knows `id` holds.
fn matched(m: &openraft::RaftMetrics<wire::raft::TypeConfig>, id: NodeId) -> Option<u64> {
    m.replication
        .as_ref()
        .and_then(|r| r.get(&id).cloned().flatten())
        .map(|l| l.index)
}

/// How far behind the leader's last entry the target may be when the transfer starts:
/// the leader takes no new entry from then on, and the target must receive the rest
/// before it may stand (a target further behind, one that needs a snapshot say, would
/// leave the cell without writes for the whole hand-over).
const CAUGHT_UP_WITHIN: u64 = 64;

/// Hands this replica's leadership to `to` (or to [`choose`]'s pick) and waits until
/// another replica leads, at most `within`. Returns the new leader and how long it took.
/// The transfer starts only once the target is within [`CAUGHT_UP_WITHIN`] entries of
/// the leader's log (waited for within `within`), so a lagging target is refused
/// without stopping the cell's writes.
pub async fn hand_over(
    raft: &Raft,
    me: NodeId,
    to: Option<NodeId>,
    within: Duration,
) -> Result<(NodeId, Duration), Error> {
    let started = Instant::now();
    let deadline = started + within;
    let mut metrics = raft.metrics();
    let target = {
        let m = metrics.borrow_and_update();
        if m.state != ServerState::Leader {
            // The gateway names the leader it knows (`Gateway::with_leader_hint`).
            return Err(Error::NotLeader {
                leader_id: None,
                leader_addr: None,
            });
        }
        match choose(&m, me, to)? {
            Some(t) => t,
            None => return Ok((me, Duration::ZERO)),
        }
    };
    let caught_up = tokio::time::timeout_at(
        deadline.into(),
        metrics.wait_for(|m| {
            m.state != ServerState::Leader
                || matched(m, target).unwrap_or(0) + CAUGHT_UP_WITHIN
                    >= m.last_log_index.unwrap_or(0)
        }),
    )
    .await
    .map(|r| r.map(|m| m.state == ServerState::Leader));
    match caught_up {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            return Err(Error::Membership {
                reason: "this replica stopped leading before the hand-over began".into(),
            })
        }
        Ok(Err(_)) => {
            return Err(Error::Unavailable {
                reason: "raft stopped".into(),
            })
        }
        Err(_) => {
            return Err(Error::Membership {
                reason: format!(
                    "replica {target} did not catch up with the leader's log within {within:?}; \
                     the leadership stays here"
                ),
            })
        }
    }
    tracing::info!(to = target, "handing the leadership over");
    loop {
        raft.trigger()
            .transfer_leader(target)
            .await
            .map_err(|e| Error::Unavailable {
                reason: format!("raft stopped: {e}"),
            })?;
        let ask_again = (Instant::now() + ASK_AGAIN).min(deadline);
        let moved = tokio::time::timeout_at(
            ask_again.into(),
            metrics.wait_for(|m| m.current_leader.is_some_and(|l| l != me)),
        )
        .await;
        match moved {
            Ok(Ok(m)) => {
                let leader = m.current_leader.unwrap_or(target);
                let took = started.elapsed();
                tracing::info!(
                    to = leader,
                    ms = took.as_millis() as u64,
                    "leadership handed over"
                );
                return Ok((leader, took));
            }
            Ok(Err(_)) => {
                return Err(Error::Unavailable {
                    reason: "raft stopped during the hand-over".into(),
                })
            }
            Err(_) if Instant::now() >= deadline => {
                return Err(Error::Membership {
                    reason: format!(
                        "replica {target} did not take the leadership over within {within:?}; \
                         this replica refuses writes until the cell elects a leader by its \
                         timers (an election timeout)"
                    ),
                })
            }
            Err(_) => {}
        }
    }
}
