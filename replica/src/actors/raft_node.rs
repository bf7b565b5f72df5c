//! The Raft-node actor: the one place commands enter the log.

use std::collections::BTreeSet;
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient, ResponseFuture};
use openraft::{BasicNode, ChangeMembers, ServerState};
use wire::command::Command;
use wire::raft::NodeId;
use wire::types::{MemberInfo, Reply};
use wire::Error;

use crate::raft::Raft;

/// Propose a command and wait for its result (applied on this leader).
#[derive(Message)]
#[rtype(result = "Result<Reply, Error>")]
pub struct Propose(pub Command);

/// A membership change.
#[derive(Message)]
#[rtype(result = "Result<Reply, Error>")]
pub enum ChangeMembership {
    /// Add a learner and wait until it has caught up.
    AddLearner {
        /// Its id.
        id: NodeId,
        /// Its address.
        addr: String,
    },
    /// Promote a learner to voter.
    Promote {
        /// Its id.
        id: NodeId,
    },
    /// Remove a voter or learner.
    Remove {
        /// Its id.
        id: NodeId,
    },
}

/// Sent to subscribers when this replica starts or stops leading.
#[derive(Message, Clone, Debug)]
#[rtype(result = "()")]
pub struct LeadershipChanged {
    /// True when this replica now leads.
    pub leading: bool,
    /// The term.
    pub term: u64,
    /// This replica's last log index when the change was seen: every session created by an
    /// earlier leader has an id at or below it.
    pub last_log_index: u64,
}

/// The actor.
pub struct RaftNode {
    raft: Raft,
    timeout: Duration,
    subscribers: Vec<Recipient<LeadershipChanged>>,
}

impl RaftNode {
    /// Wraps `raft`; requests wait at most `timeout` for a commit.
    pub fn new(
        raft: Raft,
        timeout: Duration,
        subscribers: Vec<Recipient<LeadershipChanged>>,
    ) -> Self {
        RaftNode {
            raft,
            timeout,
            subscribers,
        }
    }
}

impl Actor for RaftNode {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Watch openraft's metrics and tell subscribers when leadership changes.
        let mut metrics = self.raft.metrics();
        let subscribers = self.subscribers.clone();
        let fut = async move {
            let mut leading = false;
            let mut term = 0;
            loop {
                let (now_leading, now_term, last_log_index) = {
                    let m = metrics.borrow_and_update();
                    (
                        m.state == ServerState::Leader,
                        m.current_term,
                        m.last_log_index.unwrap_or(0),
                    )
                };
                if now_leading != leading || (now_leading && now_term != term) {
                    leading = now_leading;
                    term = now_term;
                    tracing::info!(leading, term, "leadership changed");
                    for s in &subscribers {
                        s.do_send(LeadershipChanged {
                            leading,
                            term,
                            last_log_index,
                        });
                    }
                }
                if metrics.changed().await.is_err() {
                    return;
                }
            }
        };
        ctx.spawn(actix::fut::wrap_future(fut));
    }
}

fn timeout_error(what: &str, d: Duration) -> Error {
    Error::Unavailable {
        reason: format!("{what} {TIMED_OUT} {} ms", d.as_millis()),
    }
}

const TIMED_OUT: &str = "not committed within";

/// True for the answer of a [`Propose`] that timed out: its entry may still be appended
/// and commit later (unlike a proposal refused because this replica does not lead).
pub fn is_commit_timeout(e: &Error) -> bool {
    matches!(e, Error::Unavailable { reason } if reason.contains(TIMED_OUT))
}

/// Whether a hold taken for a proposal is released once the proposal answered `r`: not
/// after a commit timeout, whose entry may still be appended and applied later (until
/// then its nodes must stay uncachable, or a cached read could be recorded with the old
/// value just before the write applies).
pub fn releases_hold<T>(r: &Result<T, Error>) -> bool {
    !matches!(r, Err(e) if is_commit_timeout(e))
}

impl Handler<Propose> for RaftNode {
    type Result = ResponseFuture<Result<Reply, Error>>;

    fn handle(&mut self, msg: Propose, _: &mut Context<Self>) -> Self::Result {
        let raft = self.raft.clone();
        let timeout = self.timeout;
        tracing::trace!("propose");
        Box::pin(async move {
            let r = tokio::time::timeout(timeout, raft.client_write(msg.0)).await;
            tracing::trace!(ok = matches!(r, Ok(Ok(_))), "proposed");
            match r {
                Ok(Ok(resp)) => resp.data.result,
                Ok(Err(e)) => Err(crate::errors::from_client_write(e)),
                Err(_) => Err(timeout_error("write", timeout)),
            }
        })
    }
}

/// The cell's members as clients see them.
pub fn members(raft: &Raft) -> Vec<MemberInfo> {
    let m = raft.metrics().borrow().membership_config.clone();
    let voters: BTreeSet<NodeId> = m.membership().voter_ids().collect();
    m.membership()
        .nodes()
        .map(|(id, n)| MemberInfo {
            id: *id,
            addr: n.addr.clone(),
            voter: voters.contains(id),
        })
        .collect()
}

impl Handler<ChangeMembership> for RaftNode {
    type Result = ResponseFuture<Result<Reply, Error>>;

    fn handle(&mut self, msg: ChangeMembership, _: &mut Context<Self>) -> Self::Result {
        let raft = self.raft.clone();
        // Catching up a learner from a snapshot may take a while: allow more time.
        let timeout = self.timeout * 6;
        Box::pin(async move {
            let fut = async {
                match msg {
                    ChangeMembership::AddLearner { id, addr } => {
                        raft.add_learner(id, BasicNode { addr }, true).await
                    }
                    ChangeMembership::Promote { id } => {
                        raft.change_membership(
                            ChangeMembers::AddVoterIds(BTreeSet::from([id])),
                            false,
                        )
                        .await
                    }
                    ChangeMembership::Remove { id } => {
                        let voter = raft
                            .metrics()
                            .borrow()
                            .membership_config
                            .membership()
                            .voter_ids()
                            .any(|v| v == id);
                        let change = if voter {
                            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
                        } else {
                            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
                        };
                        raft.change_membership(change, false).await
                    }
                }
            };
            match tokio::time::timeout(timeout, fut).await {
                Ok(Ok(_)) => Ok(Reply::MembershipChanged {
                    members: members(&raft),
                }),
                Ok(Err(e)) => Err(crate::errors::from_client_write(e)),
                Err(_) => Err(timeout_error("membership change", timeout)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proposal_that_timed_out_keeps_its_hold_and_every_other_answer_releases_it() {
        let timed_out: Result<(), Error> = Err(timeout_error("write", Duration::from_secs(5)));
        assert!(!releases_hold(&timed_out), "{timed_out:?}");
        for r in [
            Ok(()),
            Err(Error::NotLeader {
                leader_id: None,
                leader_addr: None,
            }),
            Err(Error::Unavailable {
                reason: "leadership not confirmed by a quorum within 5000 ms".into(),
            }),
            Err(Error::SessionExpired { session: 7 }),
        ] {
            assert!(releases_hold(&r), "{r:?}");
        }
    }
}
