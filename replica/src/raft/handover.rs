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
/// have answered the leader within [`HEARD_WITHIN`].
pub fn choose(
    m: &openraft::RaftMetrics<wire::raft::TypeConfig>,
    me: NodeId,
    to: Option<NodeId>,
) -> Result<NodeId, Error> {
    use openraft::Instant as _;
    let voters: Vec<NodeId> = m
        .membership_config
        .membership()
        .voter_ids()
        .filter(|id| *id != me)
        .collect();
    let heard = |id: &NodeId| {
        m.heartbeat
            .as_ref()
            .and_then(|h| h.get(id).cloned().flatten())
            .is_some_and(|at| at.elapsed() < HEARD_WITHIN)
    };
    if let Some(to) = to {
        if to == me {
            return Err(Error::BadRequest {
                reason: format!("replica {me} already leads; name another voter"),
            });
        }
        if !voters.contains(&to) {
            return Err(Error::BadRequest {
                reason: format!("replica {to} is not a voter of this cell (voters: {voters:?})"),
            });
        }
        if !heard(&to) {
            return Err(Error::Unavailable {
                reason: format!(
                    "replica {to} has not answered the leader for {HEARD_WITHIN:?} or more"
                ),
            });
        }
        return Ok(to);
    }
    let matched = |id: &NodeId| {
        m.replication
            .as_ref()
            .and_then(|r| r.get(id).cloned().flatten())
            .map(|l| l.index)
    };
    if voters.is_empty() {
        return Err(Error::BadRequest {
            reason: "this cell has no other voter to hand the leadership to".into(),
        });
    }
    voters
        .iter()
        .copied()
        .filter(heard)
        .max_by(|a, b| matched(a).cmp(&matched(b)).then(b.cmp(a)))
        .ok_or_else(|| Error::Unavailable {
            reason: format!(
                "no other voter has answered the leader within {HEARD_WITHIN:?} (voters: {voters:?})"
            ),
        })
}

/// Hands this replica's leadership to `to` (or to [`choose`]'s pick) and waits until
/// another replica leads, at most `within`. Returns the new leader and how long it took.
pub async fn hand_over(
    raft: &Raft,
    me: NodeId,
    to: Option<NodeId>,
    within: Duration,
) -> Result<(NodeId, Duration), Error> {
    let started = Instant::now();
    let mut metrics = raft.metrics();
    let target = {
        let m = metrics.borrow_and_update();
        if m.state != ServerState::Leader {
            let leader_addr = m.current_leader.and_then(|l| {
                m.membership_config
                    .membership()
                    .get_node(&l)
                    .map(|n| n.addr.clone())
            });
            return Err(Error::NotLeader {
                leader_id: m.current_leader,
                leader_addr,
            });
        }
        choose(&m, me, to)?
    };
    tracing::info!(to = target, "handing the leadership over");
    let deadline = started + within;
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
                return Err(Error::Timeout {
                    what: format!("replica {target} to take the leadership over"),
                    after_ms: within.as_millis() as u64,
                })
            }
            Err(_) => {}
        }
    }
}
