//! The actor's fail-over bookkeeping, with the real watch-table actor and state.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::Actor;
use wire::command::Command;

use super::*;
use crate::raft::sm_store::SmState;

/// A state holding one session from an earlier leader that has cached reads; returns
/// it, the session and the last applied index.
fn state_with_old_cacher() -> (SharedState, SessionId, u64) {
    let mut s = SmState {
        sm: crate::state_machine::StateMachine::bootstrapped(
            &["lock://client/test".into()],
            &wire::acl::Acl::everyone(),
        ),
        ..SmState::default()
    };
    let session = match s
        .sm
        .apply(
            1,
            &Command::CreateSession {
                owner: "lock://client/test".into(),
            },
        )
        .0
    {
        Ok(Reply::SessionCreated { session, .. }) => session,
        other => panic!("{other:?}"),
    };
    assert!(s.sm.apply(2, &Command::MarkCacher { session }).0.is_ok());
    s.last_applied = Some(openraft::LogId::new(
        wire::raft::LeaderId {
            term: 1,
            node_id: 1,
        },
        2,
    ));
    (Arc::new(RwLock::new(s)), session, 2)
}

/// The actor over `state` (and openraft's `metrics`, if given), told nothing yet.
fn unannounced(state: &SharedState, metrics: Option<Metrics>) -> Addr<CacherListActor> {
    let streams = WatchTableActor::new(state.clone()).start();
    let list = CacherListActor::new(streams, state.clone());
    match metrics {
        Some(m) => list.with_metrics(m),
        None => list,
    }
    .start()
}

/// Tells `list` that its replica leads in `term`, elected with `last` in its log.
async fn announce(list: &Addr<CacherListActor>, term: u64, last: u64) {
    list.send(LeadershipChanged {
        leading: true,
        term,
        last_log_index: last,
    })
    .await
    .expect("actor");
}

async fn new_leader(state: &SharedState, last: u64) -> Addr<CacherListActor> {
    let list = unannounced(state, None);
    announce(&list, 2, last).await;
    list
}

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(5);

/// Simulation seed 5: an old cacher that never reconnects (its proxy crashed) has its
/// lease run out at the new leader. The write held for it goes on, and so must every
/// later one — the ExpireSessions that removes it from the state first — instead of
/// waiting again for that session to confirm a flush it never will.
#[actix_rt::test]
async fn an_old_cacher_whose_lease_ran_out_is_not_waited_for_again() {
    let (state, session, last) = state_with_old_cacher();
    let list = new_leader(&state, last).await;
    let mut first = Box::pin(list.send(Hold(vec!["/a".into()])));
    assert!(
        tokio::time::timeout(SHORT, &mut first).await.is_err(),
        "a write after a fail-over must wait for an old cacher"
    );
    list.send(LeaseExpired(vec![session])).await.expect("actor");
    let id = tokio::time::timeout(LONG, first)
        .await
        .expect("the write goes on once the cacher's lease ran out")
        .expect("actor")
        .expect("held")
        .0;
    list.send(Release(id)).await.expect("actor");
    // The session is still in the state (its ExpireSessions is not applied yet).
    let second = tokio::time::timeout(LONG, list.send(Hold(vec!["/b".into()]))).await;
    assert!(
        matches!(second, Ok(Ok(Ok(_)))),
        "a later write waited for the expired cacher again: {second:?}"
    );
}

/// An old cacher that reattached its event stream (it flushed its cache first) is not
/// waited for; before it does, writes wait for it.
#[actix_rt::test]
async fn an_old_cacher_is_waited_for_until_its_stream_reattaches() {
    let (state, session, last) = state_with_old_cacher();
    let list = new_leader(&state, last).await;
    let mut first = Box::pin(list.send(Hold(vec!["/a".into()])));
    assert!(tokio::time::timeout(SHORT, &mut first).await.is_err());
    list.send(StreamConnected { session, term: 2 })
        .await
        .expect("actor");
    let id = tokio::time::timeout(LONG, first)
        .await
        .expect("the write goes on once the cacher confirmed")
        .expect("actor")
        .expect("held")
        .0;
    list.send(Release(id)).await.expect("actor");
    let second = tokio::time::timeout(LONG, list.send(Hold(vec!["/a".into()]))).await;
    assert!(matches!(second, Ok(Ok(Ok(_)))), "{second:?}");
}

/// Simulation-free race found by a proxy test: openraft makes the replica leader before
/// this actor hears of it. A write held then waited for no one (the earlier leaders'
/// cachers were not yet unconfirmed) and committed while a proxy's client still served
/// the old value. Now the hold is refused until the actor knows the term.
#[actix_rt::test]
async fn a_hold_before_the_actor_knows_it_leads_is_refused() {
    let (state, session, last) = state_with_old_cacher();
    let list = unannounced(&state, None);
    let r = list.send(Hold(vec!["/a".into()])).await.expect("actor");
    assert!(matches!(r, Err(Error::NotLeader { .. })), "{r:?}");
    assert_eq!(
        list.send(BeginRead("/a".into())).await.expect("actor"),
        None
    );
    announce(&list, 2, last).await;
    // Now the hold waits for the earlier leader's cacher.
    let mut held = Box::pin(list.send(Hold(vec!["/a".into()])));
    assert!(tokio::time::timeout(SHORT, &mut held).await.is_err());
    list.send(StreamConnected { session, term: 2 })
        .await
        .expect("actor");
    let (_, term) = tokio::time::timeout(LONG, held)
        .await
        .expect("held")
        .expect("actor")
        .expect("held");
    assert_eq!(term, 2, "the hold names the term it was made in");
}

/// A stream that attached in the new term before the actor heard of the term confirms
/// the flush once it does; one from an earlier term confirms nothing.
#[actix_rt::test]
async fn a_stream_attached_before_the_term_was_announced_confirms_in_that_term_only() {
    let (state, session, last) = state_with_old_cacher();
    let list = unannounced(&state, None);
    list.send(StreamConnected { session, term: 1 })
        .await
        .expect("actor");
    announce(&list, 2, last).await;
    let mut held = Box::pin(list.send(Hold(vec!["/a".into()])));
    assert!(
        tokio::time::timeout(SHORT, &mut held).await.is_err(),
        "a stream of term 1 confirmed a flush to the leader of term 2"
    );
    drop(held);

    let (state, session, last) = state_with_old_cacher();
    let list = unannounced(&state, None);
    list.send(StreamConnected { session, term: 2 })
        .await
        .expect("actor");
    announce(&list, 2, last).await;
    let r = tokio::time::timeout(LONG, list.send(Hold(vec!["/a".into()]))).await;
    assert!(
        matches!(r, Ok(Ok(Ok((_, 2))))),
        "the early confirmation was lost: {r:?}"
    );
}

/// A cached read that began in one term is not recorded in another (the table was
/// cleared between, so its epoch means nothing).
#[actix_rt::test]
async fn a_read_begun_in_another_term_is_not_recorded() {
    let (state, session, last) = state_with_old_cacher();
    let list = new_leader(&state, last).await;
    let (term, epoch) = list
        .send(BeginRead("/a".into()))
        .await
        .expect("actor")
        .expect("cachable");
    announce(&list, term + 1, last).await;
    let recorded = list
        .send(Record {
            session,
            path: "/a".into(),
            term,
            epoch,
            owner: None,
            seen: None,
        })
        .await
        .expect("actor");
    assert!(!recorded, "recorded with an epoch from an earlier term");
}

/// Hold ids are not reused across terms: a `Release` arriving late from an earlier
/// term (a held write that applied as `NotLeader` after a re-election) must not
/// release a hold of this one and make its nodes cachable while its write is on the
/// way.
#[actix_rt::test]
async fn a_late_release_from_an_earlier_term_does_not_release_a_new_hold() {
    let (state, session, last) = state_with_old_cacher();
    let list = new_leader(&state, last).await;
    list.send(StreamConnected { session, term: 2 })
        .await
        .expect("actor");
    let (old, _) = list
        .send(Hold(vec!["/a".into()]))
        .await
        .expect("actor")
        .expect("held");
    announce(&list, 3, last).await;
    list.send(StreamConnected { session, term: 3 })
        .await
        .expect("actor");
    let (new, term) = list
        .send(Hold(vec!["/b".into()]))
        .await
        .expect("actor")
        .expect("held");
    assert_eq!(term, 3);
    assert_ne!(old, new, "a hold id was reused in a new term");
    list.send(Release(old)).await.expect("actor");
    assert_eq!(
        list.send(BeginRead("/b".into())).await.expect("actor"),
        None,
        "the late release of hold {old} made /b cachable under hold {new}"
    );
}

/// A new leader that has not applied its log up to the takeover does not know every
/// earlier cacher yet (a `MarkCacher` may be committed but not applied): holds are
/// refused as retryable until it has, instead of waiting for too few sessions.
#[actix_rt::test]
async fn a_hold_waits_until_the_log_is_applied_up_to_the_takeover() {
    let (state, _session, last) = state_with_old_cacher();
    // Elected with one more entry in its log than it has applied.
    let list = new_leader(&state, last + 1).await;
    let r = tokio::time::timeout(LONG, list.send(Hold(vec!["/a".into()]))).await;
    assert!(
        matches!(r, Ok(Ok(Err(Error::Unavailable { .. })))),
        "a hold before the log was applied up to the takeover: {r:?}"
    );
    state.write().expect("state").last_applied = Some(openraft::LogId::new(
        wire::raft::LeaderId {
            term: 1,
            node_id: 1,
        },
        last + 1,
    ));
    let mut held = Box::pin(list.send(Hold(vec!["/a".into()])));
    assert!(
        tokio::time::timeout(SHORT, &mut held).await.is_err(),
        "once applied, the hold waits for the earlier cacher"
    );
}

/// The actor knows only the last term announced to it; openraft may have moved on
/// (to another term, or to following) before the announcement arrives. A hold or a
/// cached read then is refused: recorded in the old term's table, the read would be
/// wiped by the coming announcement while its session confirms a flush in the new
/// term, and writes would not wait for it.
#[actix_rt::test]
async fn holds_and_reads_follow_openrafts_term_not_only_the_announced_one() {
    let (state, session, last) = state_with_old_cacher();
    let mut m = openraft::RaftMetrics::new_initial(1);
    m.state = openraft::ServerState::Leader;
    m.current_term = 2;
    let (tx, rx) = tokio::sync::watch::channel(m);
    let list = unannounced(&state, Some(rx));
    announce(&list, 2, last).await;
    list.send(StreamConnected { session, term: 2 })
        .await
        .expect("actor");
    assert!(list
        .send(BeginRead("/a".into()))
        .await
        .expect("actor")
        .is_some());
    // Re-elected in term 3; the announcement has not arrived.
    tx.send_modify(|m| m.current_term = 3);
    assert_eq!(
        list.send(BeginRead("/a".into())).await.expect("actor"),
        None
    );
    let r = tokio::time::timeout(LONG, list.send(Hold(vec!["/a".into()]))).await;
    assert!(matches!(r, Ok(Ok(Err(Error::NotLeader { .. })))), "{r:?}");
}

/// Applies `cmd` at the next index of `state`, as the state-machine store would, and
/// returns the effects it had.
fn apply(state: &SharedState, cmd: Command) -> (Result<Reply, Error>, Vec<Effect>) {
    let mut s = state.write().expect("state");
    let index = s.last_applied.map_or(0, |l| l.index) + 1;
    let r = s.sm.apply(index, &cmd);
    s.last_applied = Some(openraft::LogId::new(
        wire::raft::LeaderId {
            term: 2,
            node_id: 1,
        },
        index,
    ));
    r
}

/// Opens a session in `state` (as an applied `CreateSession`).
fn open_session(state: &SharedState) -> SessionId {
    match apply(
        state,
        Command::CreateSession {
            owner: "lock://client/test".into(),
        },
    )
    .0
    {
        Ok(Reply::SessionCreated { session, .. }) => session,
        other => panic!("{other:?}"),
    }
}

/// A leader whose earlier cacher confirmed its flush (so holds wait only for cachers
/// recorded here).
async fn settled_leader() -> (SharedState, SessionId, Addr<CacherListActor>) {
    let (state, session, last) = state_with_old_cacher();
    let list = new_leader(&state, last).await;
    list.send(StreamConnected { session, term: 2 })
        .await
        .expect("actor");
    (state, session, list)
}

/// Issue 22, item 2: the gateway reads the state (the session is open), then the
/// session ends and its `SessionEnded` reaches the cacher list, and only then does
/// the gateway's `Record` arrive. Before the fix the ended session was recorded as a
/// cacher that nothing would ever remove, and every later hold on the node waited for
/// it for ever.
#[actix_rt::test]
async fn a_cacher_recorded_after_its_session_ended_is_refused() {
    let (state, session, list) = settled_leader().await;
    let (term, epoch) = list
        .send(BeginRead("/a".into()))
        .await
        .expect("actor")
        .expect("cachable");
    let (r, effects) = apply(&state, Command::CloseSession { session });
    assert!(r.is_ok(), "{r:?}");
    list.send(AppliedMsg(Applied::Effects { index: 3, effects }))
        .await
        .expect("actor");
    let recorded = list
        .send(Record {
            session,
            path: "/a".into(),
            term,
            epoch,
            owner: None,
            seen: None,
        })
        .await
        .expect("actor");
    assert!(
        !recorded,
        "a session that had ended was recorded as a cacher"
    );
    let held = tokio::time::timeout(LONG, list.send(Hold(vec!["/a".into()]))).await;
    assert!(
        matches!(held, Ok(Ok(Ok(_)))),
        "a hold waited for a session that had ended: {held:?}"
    );
}

/// Issue 22, item 1 at the actor: once a session's end is held, an ephemeral it
/// creates afterwards (a write already on its way) is not cachable until the end
/// applies; one it owned before is in the hold, which waits for its cachers.
#[actix_rt::test]
async fn an_ending_sessions_ephemerals_are_held_or_uncachable() {
    let (state, _old, list) = settled_leader().await;
    let (owner, reader) = (open_session(&state), open_session(&state));
    let create = |path: &str, request_id| Command::Write {
        session: owner,
        request_id,
        ack_below: 0,
        ops: vec![wire::types::TxnOp::Create {
            path: path.into(),
            data: Vec::new(),
            mode: wire::types::CreateMode {
                ephemeral: true,
                sequential: false,
            },
        }],
        single: true,
    };
    assert!(apply(&state, create("/e1", 1)).0.is_ok());
    let read = |path: &'static str| {
        let (list, state) = (list.clone(), state.clone());
        async move {
            let (term, epoch) = list
                .send(BeginRead(path.into()))
                .await
                .expect("actor")
                .expect("cachable");
            let seen = state
                .read()
                .expect("state")
                .sm
                .node(path)
                .map(|n| (n.create_index, n.mod_index));
            list.send(Record {
                session: reader,
                path: path.into(),
                term,
                epoch,
                owner: Some(owner),
                seen,
            })
            .await
            .expect("actor")
        }
    };
    assert!(read("/e1").await, "cached before the end began");
    let mut end = Box::pin(list.send(HoldEnd {
        sessions: vec![owner],
        lease_ran_out: true,
    }));
    assert!(
        tokio::time::timeout(SHORT, &mut end).await.is_err(),
        "the end must wait for the cacher of /e1"
    );
    // The owner's create that was on its way applies now.
    assert!(apply(&state, create("/x", 2)).0.is_ok());
    assert!(
        !read("/x").await,
        "an ephemeral of an ending session was recorded as cached"
    );
    let unacked = list.send(Unacknowledged(reader)).await.expect("actor");
    assert!(unacked.is_empty(), "not overdue yet: {unacked:?}");
    // The reader acknowledges the invalidation of /e1: the end goes on.
    let id = {
        let hold = list.send(Hold(vec!["/other".into()])).await.expect("actor");
        // Hold ids are handed out in order: the end's is the one before.
        hold.expect("held").0 - 1
    };
    list.send(Ack {
        session: reader,
        ids: vec![id],
    })
    .await
    .expect("actor");
    let (hold, _) = tokio::time::timeout(LONG, end)
        .await
        .expect("the end went on once the cacher acknowledged")
        .expect("actor")
        .expect("held");
    assert_eq!(hold, Some(id));
    // An end with nothing to hold is answered at once, without a hold.
    let (r, effects) = apply(&state, Command::CloseSession { session: owner });
    assert!(r.is_ok());
    list.send(AppliedMsg(Applied::Effects { index: 0, effects }))
        .await
        .expect("actor");
    let quiet = list
        .send(HoldEnd {
            sessions: vec![reader],
            lease_ran_out: false,
        })
        .await
        .expect("actor")
        .expect("held");
    assert_eq!(quiet, (None, 2));
}

/// From the review of the fix (F1): a new leader that has not applied its log up to
/// the takeover may not know an ending session's ephemerals yet; its `HoldEnd` is
/// refused as retryable rather than holding too few nodes.
#[actix_rt::test]
async fn an_end_at_a_new_leader_waits_until_the_log_is_applied() {
    let (state, session, last) = state_with_old_cacher();
    let list = new_leader(&state, last + 1).await;
    let r = tokio::time::timeout(
        LONG,
        list.send(HoldEnd {
            sessions: vec![session],
            lease_ran_out: false,
        }),
    )
    .await;
    assert!(
        matches!(r, Ok(Ok(Err(Error::Unavailable { .. })))),
        "an end held before the log was applied up to the takeover: {r:?}"
    );
}

/// From the review of the fix (F2): an ephemeral created after its owner's end was
/// held is read; before the reader's `Record` arrives the end applies (deleting it)
/// and its `SessionEnded` unmarks the owner. The record must still be refused: the
/// node is not what was read.
#[actix_rt::test]
async fn a_record_of_a_node_deleted_since_the_read_is_refused() {
    let (state, _old, list) = settled_leader().await;
    let (owner, reader) = (open_session(&state), open_session(&state));
    let held = list
        .send(HoldEnd {
            sessions: vec![owner],
            lease_ran_out: true,
        })
        .await
        .expect("actor")
        .expect("held");
    assert_eq!(held.0, None, "the owner owned nothing yet");
    let create = Command::Write {
        session: owner,
        request_id: 1,
        ack_below: 0,
        ops: vec![wire::types::TxnOp::Create {
            path: "/x".into(),
            data: Vec::new(),
            mode: wire::types::CreateMode {
                ephemeral: true,
                sequential: false,
            },
        }],
        single: true,
    };
    assert!(apply(&state, create).0.is_ok());
    let (term, epoch) = list
        .send(BeginRead("/x".into()))
        .await
        .expect("actor")
        .expect("cachable");
    let seen = state
        .read()
        .expect("state")
        .sm
        .node("/x")
        .map(|n| (n.create_index, n.mod_index));
    assert!(seen.is_some());
    let (r, effects) = apply(
        &state,
        Command::ExpireSessions {
            sessions: vec![owner],
        },
    );
    assert!(r.is_ok(), "{r:?}");
    list.send(AppliedMsg(Applied::Effects { index: 0, effects }))
        .await
        .expect("actor");
    let recorded = list
        .send(Record {
            session: reader,
            path: "/x".into(),
            term,
            epoch,
            owner: Some(owner),
            seen,
        })
        .await
        .expect("actor");
    assert!(
        !recorded,
        "a node deleted since the read was recorded as cached"
    );
}
