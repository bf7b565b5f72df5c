//! Each voter bound to its store: the guard against a replica whose data was lost.
//!
//! A replica that comes back under its id with an empty store may have acknowledged
//! entries, and voted, in the name of the store it lost. The membership records which
//! store each member's answers must come from ([`wire::raft::Binding`]); the replica that
//! sent a request counts an answer only from that store (`network::PeerClient::admit`).
//! This module holds the two tasks that keep the record and obey it:
//!
//! - [`bind_stores`] (the leader): binds every member not bound yet to the store it
//!   answers from, with openraft's `ChangeMembers::SetNodes`; in a cell nobody bound yet
//!   (new, or seeded from a backup) it binds every member at once, those it has not heard
//!   from becoming pending.
//! - [`guard_candidacy`] (every replica): a replica whose id the membership binds to
//!   another store never stands for election (its own vote would count for a log its
//!   store never promised), until an admin replaces it.
//!
//! docs/architecture.md, "A replica whose data was lost", says why the record must live
//! in the membership and what this leaves open.

use std::collections::BTreeMap;
use std::time::Duration;

use openraft::{ChangeMembers, Membership, Precondition, ServerState};
use wire::raft::{Binding, LogId, Member, NodeId, StoreId, StoredMembership};

use crate::raft::network::SeenStores;
use crate::raft::Raft;

/// Whether replica `id`, whose store is `own`, may stand for election under membership
/// `m`: unless `m` binds `id` to another store.
pub fn may_stand_in(m: &Membership<NodeId, Member>, id: NodeId, own: StoreId) -> bool {
    match m.get_node(&id).map(|n| n.store) {
        Some(Binding::Bound(s)) => s == own,
        _ => true,
    }
}

/// [`may_stand_in`] under `raft`'s effective membership.
pub fn may_stand(raft: &Raft, id: NodeId, own: StoreId) -> bool {
    may_stand_in(
        raft.metrics().borrow().membership_config.membership(),
        id,
        own,
    )
}

/// The members a leader (replica `id`, store `own`) binds now under membership `m`,
/// having heard the stores in `seen`: a member unbound or pending is bound to the store
/// it answered from under `m` itself (an answer heard under an earlier membership may
/// come from a store the member no longer has: removed and added back, it is heard
/// again); an unbound member not heard from becomes pending (so once anyone is bound, no
/// unbound member's answers count). Bound members are left as they are: a member bound
/// to a store that is gone is replaced by an admin, never rebound here. Nothing while
/// `m` is a joint configuration: openraft's second step of an admin's change must not
/// find another change in its way.
pub fn bindings_to_make(
    id: NodeId,
    own: StoreId,
    m: &StoredMembership,
    seen: &BTreeMap<NodeId, (StoreId, Option<LogId>)>,
) -> BTreeMap<NodeId, Member> {
    let mut out = BTreeMap::new();
    if m.membership().get_joint_config().len() > 1 {
        return out;
    }
    for (nid, n) in m.membership().nodes() {
        let heard = if *nid == id {
            Some(own)
        } else {
            seen.get(nid)
                .filter(|(_, under)| under == m.log_id())
                .map(|(s, _)| *s)
        };
        let store = match (n.store, heard) {
            (Binding::Unbound | Binding::Pending, Some(s)) => Binding::Bound(s),
            (Binding::Unbound, None) => Binding::Pending,
            _ => continue,
        };
        out.insert(
            *nid,
            Member {
                addr: n.addr.clone(),
                store,
            },
        );
    }
    out
}

/// While this replica (`id`, store `own`) leads, binds the members that are not bound
/// yet ([`bindings_to_make`]), as soon as it has heard from them. Ends when Raft stops.
pub async fn bind_stores(raft: Raft, id: NodeId, own: StoreId, seen: SeenStores) {
    let mut metrics = raft.metrics();
    loop {
        // Woken by every change of the metrics, and at least every 100 ms for answers
        // heard meanwhile (they change no metric).
        if let Ok(Err(_)) =
            tokio::time::timeout(Duration::from_millis(100), metrics.changed()).await
        {
            return;
        }
        let (leading, membership) = {
            let m = metrics.borrow_and_update();
            // One membership change at a time: openraft refuses another while one is
            // not committed (a new leader's first, the cell's initial one at index 0).
            let settled = m.membership_config.log_id() == m.committed_membership_config.log_id();
            (
                m.state == ServerState::Leader && m.current_leader == Some(id) && settled,
                m.membership_config.clone(),
            )
        };
        if !leading {
            continue;
        }
        let changes = {
            let seen = seen.lock().expect("seen stores");
            bindings_to_make(id, own, &membership, &seen)
        };
        if changes.is_empty() {
            continue;
        }
        let shown: Vec<String> = changes
            .iter()
            .map(|(n, m)| format!("{n}: {}", m.store))
            .collect();
        let change = ChangeMembers::SetNodes(changes);
        // Only onto the membership it was decided under: an admin's change in between
        // (a member removed, say) must not be undone by this one.
        let unchanged = Precondition::LastMembershipLogId {
            last_membership_log_id: *membership.log_id(),
        };
        match tokio::time::timeout(
            Duration::from_secs(5),
            raft.change_membership_if(change, false, [unchanged]),
        )
        .await
        {
            Ok(Ok(_)) => tracing::info!(bound = ?shown, "members bound to their stores"),
            Ok(Err(openraft::error::RaftError::APIError(
                openraft::error::ClientWriteError::PreconditionFailed(_)
                | openraft::error::ClientWriteError::ChangeMembershipError(
                    openraft::error::ChangeMembershipError::InProgress(_),
                ),
            ))) => {}
            Ok(Err(e)) => {
                tracing::warn!(bound = ?shown, "binding members to their stores: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(_) => {
                tracing::warn!(bound = ?shown, "binding members to their stores timed out");
            }
        }
    }
}

/// Keeps openraft's own elections off while the effective membership binds this replica
/// (`id`) to another store than its own (`own`), or is empty (openraft's first metrics
/// are a placeholder without one; a replica in no membership cannot stand anyway), and
/// on otherwise; says so once each time it turns. Elections start off
/// (`server::raft_config`) until it has looked. Ends when Raft stops.
/// Our own election triggers (`network::stand_now` and the others) and a leader
/// hand-over ask [`may_stand`] themselves: openraft's `trigger().elect()` and its
/// leadership transfer do not look at this switch.
pub async fn guard_candidacy(raft: Raft, id: NodeId, own: StoreId) {
    raft.runtime_config().elect(false);
    let mut metrics = raft.metrics();
    let mut allowed = None;
    // Whether elections are off because the membership binds this id elsewhere.
    let mut refused = false;
    loop {
        let (may, bound, known) = {
            let m = metrics.borrow_and_update();
            let membership = m.membership_config.membership();
            let known = membership.nodes().next().is_some();
            (
                known && may_stand_in(membership, id, own),
                membership.get_node(&id).map(|n| n.store),
                known,
            )
        };
        if allowed != Some(may) {
            raft.runtime_config().elect(may);
            if !may && known {
                tracing::error!(
                    store = %own,
                    bound = ?bound,
                    "the cell binds replica {id} to another store than this one: its data \
                     was lost or replaced. It will not stand for election, and the leader \
                     does not count its answers, until it is replaced (lockctl member \
                     remove {id}, then add-learner and promote; docs/operations.md)"
                );
            } else if may && refused {
                tracing::info!(store = %own, "replica {id} may stand for election again");
            }
            refused = !may && known;
            allowed = Some(may);
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn store(b: u8) -> StoreId {
        StoreId([b; 16])
    }

    fn stored(bindings: &[Binding], at: u64) -> StoredMembership {
        let log_id = openraft::LogId::new(
            wire::raft::LeaderId {
                term: 1,
                node_id: 1,
            },
            at,
        );
        openraft::StoredMembership::new(Some(log_id), membership(bindings))
    }

    fn heard(
        stores: &[(NodeId, StoreId)],
        m: &StoredMembership,
    ) -> BTreeMap<NodeId, (StoreId, Option<LogId>)> {
        stores
            .iter()
            .map(|(n, s)| (*n, (*s, *m.log_id())))
            .collect()
    }

    fn membership(bindings: &[Binding]) -> Membership<NodeId, Member> {
        let nodes: BTreeMap<NodeId, Member> = bindings
            .iter()
            .enumerate()
            .map(|(i, b)| {
                (
                    i as u64 + 1,
                    Member {
                        addr: format!("127.0.0.1:71{i:02}"),
                        store: *b,
                    },
                )
            })
            .collect();
        let voters: BTreeSet<NodeId> = nodes.keys().copied().collect();
        Membership::new(vec![voters], nodes).unwrap()
    }

    /// Only the store a member is bound to counts; an unbound member's every answer
    /// counts; a pending member's none.
    #[test]
    fn an_answer_counts_only_from_the_bound_store() {
        assert!(Binding::Unbound.counts(Some(store(1))));
        assert!(Binding::Unbound.counts(None));
        assert!(!Binding::Pending.counts(Some(store(1))));
        assert!(Binding::Bound(store(1)).counts(Some(store(1))));
        assert!(!Binding::Bound(store(1)).counts(Some(store(2))));
        assert!(!Binding::Bound(store(1)).counts(None));
    }

    /// A never-bound cell's leader binds every member it heard from and makes the rest
    /// pending; later, a pending member is bound once heard; bound ones are never
    /// touched, even when heard from another store.
    #[test]
    fn the_leader_binds_what_it_heard_and_leaves_bound_members_alone() {
        let m = stored(&[Binding::Unbound; 5], 3);
        let seen = heard(&[(2, store(2)), (3, store(3))], &m);
        let out = bindings_to_make(1, store(1), &m, &seen);
        let got: Vec<(NodeId, Binding)> = out.iter().map(|(n, m)| (*n, m.store)).collect();
        assert_eq!(
            got,
            vec![
                (1, Binding::Bound(store(1))),
                (2, Binding::Bound(store(2))),
                (3, Binding::Bound(store(3))),
                (4, Binding::Pending),
                (5, Binding::Pending),
            ]
        );
        assert_eq!(out[&4].addr, "127.0.0.1:7103");

        let bindings = [
            Binding::Bound(store(1)),
            Binding::Bound(store(2)),
            Binding::Bound(store(3)),
            Binding::Pending,
            Binding::Pending,
        ];
        let m = stored(&bindings, 9);
        // 3 answers from another store (wiped): left alone; 4 heard: bound; 5 not yet.
        let mut seen = heard(&[(3, store(33)), (4, store(4))], &m);
        let out = bindings_to_make(1, store(1), &m, &seen);
        let got: Vec<(NodeId, Binding)> = out.iter().map(|(n, m)| (*n, m.store)).collect();
        assert_eq!(got, vec![(4, Binding::Bound(store(4)))]);
        // 5 heard under an earlier membership (before it was removed and added back, say):
        // that store is not bound; heard again under this one, it is.
        let earlier = stored(&bindings, 7);
        seen.insert(5, (store(55), *earlier.log_id()));
        let out = bindings_to_make(1, store(1), &m, &seen);
        assert!(!out.contains_key(&5), "{out:?}");
        seen.insert(5, (store(5), *m.log_id()));
        let out = bindings_to_make(1, store(1), &m, &seen);
        assert_eq!(out[&5].store, Binding::Bound(store(5)));

        let m = stored(&[Binding::Bound(store(1)); 1], 2);
        assert!(bindings_to_make(1, store(1), &m, &BTreeMap::new()).is_empty());

        // A joint configuration (an admin's change half done): nothing.
        let nodes: BTreeMap<NodeId, Member> = (1..=3)
            .map(|i| (i, Member::unbound(format!("127.0.0.1:{i}"))))
            .collect();
        let joint = Membership::new(
            vec![
                std::collections::BTreeSet::from([1, 2]),
                std::collections::BTreeSet::from([1, 2, 3]),
            ],
            nodes,
        )
        .unwrap();
        let joint = openraft::StoredMembership::new(*m.log_id(), joint);
        let seen = heard(&[(2, store(2)), (3, store(3))], &joint);
        assert!(bindings_to_make(1, store(1), &joint, &seen).is_empty());
    }

    /// A replica bound to another store may not stand; bound to its own, pending,
    /// unbound, or not a member, it may.
    #[test]
    fn a_replica_bound_to_another_store_never_stands() {
        let m = membership(&[Binding::Bound(store(1)), Binding::Pending, Binding::Unbound]);
        assert!(may_stand_in(&m, 1, store(1)));
        assert!(!may_stand_in(&m, 1, store(9)));
        assert!(may_stand_in(&m, 2, store(9)));
        assert!(may_stand_in(&m, 3, store(9)));
        assert!(may_stand_in(&m, 4, store(9)));
    }
}
