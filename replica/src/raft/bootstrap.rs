//! Initializing a new cell, and only a new one.
//!
//! The replica started with `bootstrap = true` writes the cell's first membership, but
//! only once it knows no other member already holds a cell: before, one whose data
//! directory was lost (or that was left empty beside members seeded from a backup)
//! initialized a cell of its own at index 0, which other empty members could elect, and
//! the seeded members would take that leader's entries at indices they already hold as
//! committed for theirs (openraft skips them): two states under one name. It asks every
//! other member what it holds
//! ([`PeerRequest::Probe`](wire::raft::PeerRequest::Probe)), every round afresh, and
//! decides with [`decide`]:
//!
//! - a member that holds any Raft state (a vote, a log, a seeded snapshot): do not
//!   initialize; this replica waits to be caught up by that cell's leader, as any member
//!   started with `bootstrap = false` does;
//! - a member that was reached and refused the probe (a build without it, a stopped Raft
//!   core): it may hold a cell, so ask again (and say so in the log);
//! - every other member answered, each empty: initialize now;
//! - a majority of the members (this one among them) answered empty in this round and
//!   [`STRAGGLERS_WAIT`] has passed since the replica started: initialize, naming the
//!   members that did not answer (a new cell can be started with a minority down);
//! - otherwise ask again (a cell needs a majority to elect its first leader anyway).
//!
//! A member that is down, or does not answer, cannot be asked: the guard protects against
//! members that are up (start seeded members first).

use std::collections::BTreeMap;
use std::time::Duration;

use openraft::RaftNetworkFactory;
use tokio::time::Instant;
use wire::raft::{Binding, Member, StoreId};
use wire::raft::{NodeId, PeerState};

use crate::raft::network::{PeerNetworkFactory, ProbeFailure};
use crate::raft::Raft;

/// How long the bootstrap replica waits, from its start, for members that do not answer
/// once a majority has answered empty.
pub const STRAGGLERS_WAIT: Duration = Duration::from_secs(2);

/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(1_000);

/// The pause between rounds of probes.
const PROBE_EVERY: Duration = Duration::from_millis(200);

/// What the bootstrap replica does after a round of probes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Initialize the cell; `silent` are the members that did not answer.
    Initialize {
        /// Members (other than this one) that did not answer.
        silent: Vec<NodeId>,
    },
    /// Do not initialize: member `id` holds a cell already.
    Held {
        /// The member that answered so (the lowest such id).
        id: NodeId,
        /// What it answered.
        state: PeerState,
    },
    /// Ask again.
    Wait,
}

/// Decides from one round's `answers` (member id → what it holds, or why not) whether
/// replica `self_id`, itself empty, initializes a cell of `members`; `waited` is whether
/// [`STRAGGLERS_WAIT`] has passed. A member with no entry in `answers` was not asked.
pub fn decide(
    self_id: NodeId,
    members: &[NodeId],
    answers: &BTreeMap<NodeId, Result<PeerState, ProbeFailure>>,
    waited: bool,
) -> Decision {
    let others = || members.iter().filter(move |id| **id != self_id);
    if let Some((id, state)) = others().find_map(|id| match answers.get(id) {
        Some(Ok(s)) if s.initialized => Some((*id, s.clone())),
        _ => None,
    }) {
        return Decision::Held { id, state };
    }
    if others().any(|id| matches!(answers.get(id), Some(Err(ProbeFailure::Refused(_))))) {
        return Decision::Wait;
    }
    let silent: Vec<NodeId> = others()
        .filter(|id| !matches!(answers.get(id), Some(Ok(_))))
        .copied()
        .collect();
    let empty = 1 + others().count() - silent.len();
    let majority = members.len() / 2 + 1;
    if silent.is_empty() || (waited && empty >= majority) {
        Decision::Initialize { silent }
    } else {
        Decision::Wait
    }
}

/// How often the bootstrap replica says in its log what it still waits for.
const WAITING_LOGGED_EVERY: Duration = Duration::from_secs(10);

/// Initializes a new cell of `members` once [`decide`] says so, asking every other member
/// each round until then; returns without initializing when one holds a cell already or
/// this replica joined one meanwhile. Runs beside the replica's serving (it answers
/// probes and RPCs while it waits). `started` is when the replica started, on tokio's
/// clock (the simulation's, under `faultsuite sim`).
pub async fn initialize_new_cell(
    raft: Raft,
    mut network: PeerNetworkFactory,
    self_id: NodeId,
    own: StoreId,
    members: BTreeMap<NodeId, Member>,
    started: Instant,
) {
    let ids: Vec<NodeId> = members.keys().copied().collect();
    let mut logged = started;
    loop {
        match raft.is_initialized().await {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!("not initializing a new cell: this replica joined one meanwhile");
                return;
            }
            Err(e) => {
                tracing::error!("not initializing a new cell: the Raft core stopped: {e}");
                return;
            }
        }
        // Every member afresh each round: one that answered empty before may have voted
        // for a seeded member since.
        let mut probes = Vec::new();
        for (id, node) in members.iter().filter(|(id, _)| **id != self_id) {
            let client = network.new_client(*id, node).await;
            let id = *id;
            probes.push(async move { (id, client.probe(PROBE_TIMEOUT).await) });
        }
        let answered: BTreeMap<NodeId, Result<(PeerState, Option<StoreId>), ProbeFailure>> =
            futures::future::join_all(probes)
                .await
                .into_iter()
                .collect();
        let answers: BTreeMap<NodeId, Result<PeerState, ProbeFailure>> = answered
            .iter()
            .map(|(id, a)| (*id, a.clone().map(|(s, _)| s)))
            .collect();
        let not_empty = || {
            answers
                .iter()
                .filter_map(|(id, a)| a.as_ref().err().map(|e| format!("{id}: {e}")))
                .collect::<Vec<_>>()
        };
        match decide(
            self_id,
            &ids,
            &answers,
            started.elapsed() >= STRAGGLERS_WAIT,
        ) {
            Decision::Initialize { silent } => {
                if !silent.is_empty() {
                    tracing::warn!(
                        ?silent,
                        why = ?not_empty(),
                        "members did not answer; a majority did, each empty"
                    );
                }
                // Each member bound to the store it answered from, those that did not
                // answer pending (`raft::binding`): a new cell has no unbound member.
                let members: BTreeMap<NodeId, Member> = members
                    .iter()
                    .map(|(id, m)| {
                        let store = if *id == self_id {
                            Binding::Bound(own)
                        } else {
                            match &answered.get(id) {
                                Some(Ok((_, Some(s)))) => Binding::Bound(*s),
                                _ => Binding::Pending,
                            }
                        };
                        (
                            *id,
                            Member {
                                addr: m.addr.clone(),
                                store,
                            },
                        )
                    })
                    .collect();
                tracing::info!(?members, "initializing a new cell");
                if let Err(e) = raft.initialize(members.clone()).await {
                    // `NotAllowed`: a leader reached this replica first.
                    tracing::info!("not initializing a new cell: {e}");
                }
                return;
            }
            Decision::Held { id, state } if state.last_log_index.is_none() => {
                tracing::warn!(
                    member = id,
                    term = state.term,
                    "not initializing a new cell: member {id} has voted (term {}) but holds \
                     no entry yet; this replica waits to be caught up by the cell's leader. \
                     If no member ever holds an entry (`lockctl status`: none has applied \
                     anything), this replica's data was lost before the cell's first entry \
                     reached the others and the cell cannot elect: stop every member, empty \
                     their data directories and start the cell again.",
                    state.term
                );
                return;
            }
            Decision::Held { id, state } => {
                tracing::warn!(
                    member = id,
                    term = state.term,
                    last_log_index = ?state.last_log_index,
                    "not initializing a new cell: member {id} already holds one; this \
                     replica waits to be caught up by its leader, as a member started with \
                     bootstrap = false does (set bootstrap = false on this replica)"
                );
                return;
            }
            Decision::Wait => {
                if logged.elapsed() >= WAITING_LOGGED_EVERY {
                    logged = Instant::now();
                    tracing::warn!(
                        why = ?not_empty(),
                        "not initializing a new cell yet: waiting for a majority of the \
                         members to answer empty (and for every member that refused the \
                         probe to answer it)"
                    );
                }
                tokio::time::sleep(PROBE_EVERY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answers = BTreeMap<NodeId, Result<PeerState, ProbeFailure>>;

    fn empty() -> Result<PeerState, ProbeFailure> {
        Ok(PeerState {
            initialized: false,
            term: 0,
            last_log_index: None,
        })
    }

    fn held(index: u64) -> PeerState {
        PeerState {
            initialized: true,
            term: 0,
            last_log_index: Some(index),
        }
    }

    fn silent() -> Result<PeerState, ProbeFailure> {
        Err(ProbeFailure::NoAnswer("connect: timed out".into()))
    }

    fn refused() -> Result<PeerState, ProbeFailure> {
        Err(ProbeFailure::Refused("malformed".into()))
    }

    #[test]
    fn every_other_member_empty_initializes_at_once() {
        let answers: Answers = (2..=5).map(|id| (id, empty())).collect();
        assert_eq!(
            decide(1, &[1, 2, 3, 4, 5], &answers, false),
            Decision::Initialize { silent: vec![] }
        );
        // A cell of one has no one to ask.
        assert_eq!(
            decide(1, &[1], &Answers::new(), false),
            Decision::Initialize { silent: vec![] }
        );
    }

    #[test]
    fn one_member_holding_a_cell_stops_it_whatever_the_others_say() {
        let mut answers: Answers = (2..=3).map(|id| (id, empty())).collect();
        answers.insert(4, silent());
        answers.insert(5, Ok(held(40)));
        for waited in [false, true] {
            assert_eq!(
                decide(1, &[1, 2, 3, 4, 5], &answers, waited),
                Decision::Held {
                    id: 5,
                    state: held(40)
                }
            );
        }
        // A replica that only voted counts as holding one too.
        let voted = PeerState {
            initialized: true,
            term: 3,
            last_log_index: None,
        };
        let answers = Answers::from([(3, Ok(voted.clone()))]);
        assert_eq!(
            decide(1, &[1, 2, 3], &answers, true),
            Decision::Held {
                id: 3,
                state: voted
            }
        );
    }

    #[test]
    fn silent_members_are_waited_for_then_a_majority_of_empty_ones_is_enough() {
        let members = [1, 2, 3, 4, 5];
        let mut two: Answers = (2..=3).map(|id| (id, empty())).collect();
        two.insert(4, silent());
        assert_eq!(decide(1, &members, &two, false), Decision::Wait);
        assert_eq!(
            decide(1, &members, &two, true),
            Decision::Initialize { silent: vec![4, 5] }
        );
        // Itself and one other are not a majority of five, however long it waited.
        let one = Answers::from([(2, empty())]);
        assert_eq!(decide(1, &members, &one, true), Decision::Wait);
        assert_eq!(decide(1, &members, &Answers::new(), true), Decision::Wait);
        // Of two, itself alone is not a majority.
        assert_eq!(decide(1, &[1, 2], &Answers::new(), true), Decision::Wait);
    }

    #[test]
    fn a_member_that_refuses_the_probe_is_waited_for_as_it_may_hold_a_cell() {
        let mut answers: Answers = (2..=4).map(|id| (id, empty())).collect();
        answers.insert(5, refused());
        for waited in [false, true] {
            assert_eq!(
                decide(1, &[1, 2, 3, 4, 5], &answers, waited),
                Decision::Wait
            );
        }
        // One that holds a cell still decides.
        answers.insert(4, Ok(held(9)));
        assert!(matches!(
            decide(1, &[1, 2, 3, 4, 5], &answers, true),
            Decision::Held { id: 4, .. }
        ));
    }

    #[test]
    fn answers_from_outside_the_members_count_for_nothing() {
        let answers = Answers::from([(9, Ok(held(7))), (8, refused()), (2, empty())]);
        assert_eq!(decide(1, &[1, 2, 3], &answers, false), Decision::Wait);
        assert_eq!(
            decide(1, &[1, 2, 3], &answers, true),
            Decision::Initialize { silent: vec![3] }
        );
    }
}
