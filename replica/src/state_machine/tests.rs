//! Table tests of the state machine's rules, and property tests against a simple model.

use std::collections::BTreeMap;

use proptest::prelude::*;
use wire::command::{BatchRule, Command, Effect, LeaseCheckpoint};
use wire::types::{CreateMode, Reply, SessionId, TxnOp, TxnResult};
use wire::Error;

use super::StateMachine;

/// The admin of the states the tests build.
const ADMIN: &str = "lock://client/admin";

/// A state whose root every identity may use (a development cell's), bootstrapped
/// without an entry so indexes start at 1.
fn open_state() -> StateMachine {
    StateMachine::bootstrapped(&[ADMIN.to_string()], &wire::acl::Acl::everyone())
}

struct Harness {
    sm: StateMachine,
    index: u64,
    next_request: u64,
}

impl Harness {
    fn new() -> Harness {
        Harness {
            sm: open_state(),
            index: 0,
            next_request: 1,
        }
    }

    fn apply(&mut self, cmd: Command) -> (Result<Reply, Error>, Vec<Effect>) {
        self.index += 1;
        self.sm.apply(self.index, &cmd)
    }

    fn session(&mut self) -> u64 {
        match self
            .apply(Command::CreateSession {
                owner: "lock://client/test".into(),
            })
            .0
        {
            Ok(Reply::SessionCreated { session, .. }) => session,
            other => panic!("{other:?}"),
        }
    }

    fn write(&mut self, session: u64, op: TxnOp) -> Result<Reply, Error> {
        let request_id = self.next_request;
        self.next_request += 1;
        self.write_id(session, request_id, op)
    }

    fn write_id(&mut self, session: u64, request_id: u64, op: TxnOp) -> Result<Reply, Error> {
        self.apply(Command::Write {
            session,
            request_id,
            ack_below: 0,
            ops: vec![op],
            single: true,
        })
        .0
    }
}

fn create(path: &str, data: &[u8], ephemeral: bool, sequential: bool) -> TxnOp {
    TxnOp::Create {
        path: path.into(),
        data: data.to_vec(),
        mode: CreateMode {
            ephemeral,
            sequential,
        },
    }
}

fn set(path: &str, data: &[u8], version: Option<u64>) -> TxnOp {
    TxnOp::SetData {
        path: path.into(),
        data: data.to_vec(),
        version,
    }
}

fn del(path: &str, version: Option<u64>) -> TxnOp {
    TxnOp::Delete {
        path: path.into(),
        version,
    }
}

#[test]
fn create_get_set_delete_round_trip() {
    let mut h = Harness::new();
    let s = h.session();
    assert!(matches!(
        h.write(s, create("/a", b"1", false, false)),
        Ok(Reply::Created { .. })
    ));
    let Ok(Reply::Data { data, stat, .. }) = h.sm.get("/a") else {
        panic!()
    };
    assert_eq!(
        (data.as_slice(), stat.version, stat.create_index),
        (&b"1"[..], 0, 2)
    );
    assert!(
        matches!(h.write(s, set("/a", b"2", Some(0))), Ok(Reply::Set { stat }) if stat.version == 1)
    );
    // Stale CAS: refused, nothing changes.
    let before = h.sm.clone();
    let err = h.write(s, set("/a", b"3", Some(0))).unwrap_err();
    assert_eq!(
        err,
        Error::BadVersion {
            path: "/a".into(),
            expected: 0,
            actual: 1
        }
    );
    assert_eq!(before.nodes, h.sm.nodes);
    assert!(matches!(
        h.write(s, del("/a", Some(5))),
        Err(Error::BadVersion { .. })
    ));
    assert!(matches!(h.write(s, del("/a", Some(1))), Ok(Reply::Deleted)));
    assert!(matches!(h.sm.get("/a"), Err(Error::NoNode { .. })));
}

#[test]
fn structural_rules() {
    let mut h = Harness::new();
    let s = h.session();
    assert!(
        matches!(h.write(s, create("/x/y", b"", false, false)), Err(Error::NoNode { path }) if path == "/x")
    );
    h.write(s, create("/x", b"", false, false)).unwrap();
    assert!(matches!(
        h.write(s, create("/x", b"", false, false)),
        Err(Error::NodeExists { .. })
    ));
    h.write(s, create("/x/y", b"", false, false)).unwrap();
    assert!(matches!(
        h.write(s, del("/x", None)),
        Err(Error::NotEmpty { .. })
    ));
    h.write(s, create("/e", b"", true, false)).unwrap();
    assert!(matches!(
        h.write(s, create("/e/c", b"", false, false)),
        Err(Error::EphemeralParent { .. })
    ));
    assert!(matches!(
        h.write(s, del("/", None)),
        Err(Error::RootNode { .. })
    ));
    assert!(matches!(
        h.write(s, set("/", b"", None)),
        Err(Error::RootNode { .. })
    ));
    assert!(matches!(
        h.write(s, create("/", b"", false, false)),
        Err(Error::RootNode { .. })
    ));
    let big = vec![0u8; wire::VALUE_BYTES_MAX + 1];
    assert!(matches!(
        h.write(s, create("/big", &big, false, false)),
        Err(Error::ValueTooLarge { .. })
    ));
    let ok = vec![0u8; wire::VALUE_BYTES_MAX];
    assert!(h.write(s, create("/big", &ok, false, false)).is_ok());
    for bad in ["", "rel", "/a/", "/a//b", "/a/../b", "/./a"] {
        assert!(
            matches!(
                h.write(s, create(bad, b"", false, false)),
                Err(Error::InvalidPath { .. })
            ),
            "{bad}"
        );
    }
}

#[test]
fn sessions_must_be_open() {
    let mut h = Harness::new();
    assert_eq!(
        h.write(99, create("/a", b"", false, false)),
        Err(Error::UnknownSession { session: 99 })
    );
    assert_eq!(
        h.write(0, create("/a", b"", false, false)),
        Err(Error::SessionRequired)
    );
    let s = h.session();
    h.write(s, create("/e", b"", true, false)).unwrap();
    let (r, effects) = h.apply(Command::ExpireSessions { sessions: vec![s] });
    assert!(r.is_ok());
    assert!(effects.contains(&Effect::Deleted { path: "/e".into() }));
    assert!(h.sm.node("/e").is_none());
    assert_eq!(
        h.write(s, create("/a", b"", false, false)),
        Err(Error::SessionExpired { session: s })
    );
    assert!(h.sm.node("/a").is_none());
    assert_eq!(
        h.apply(Command::CloseSession { session: s }).0,
        Err(Error::SessionExpired { session: s })
    );
}

#[test]
fn sequential_names_and_predecessor() {
    let mut h = Harness::new();
    let s = h.session();
    h.write(s, create("/lock", b"", false, false)).unwrap();
    let mut names = Vec::new();
    for i in 0..3 {
        let Ok(Reply::Created {
            path, predecessor, ..
        }) = h.write(s, create("/lock/n-", b"", true, true))
        else {
            panic!()
        };
        assert_eq!(path, format!("/lock/n-{i:010}"));
        assert_eq!(predecessor.map(|p| p.name), names.last().cloned());
        names.push(path.rsplit('/').next().unwrap().to_string());
    }
    // Different prefixes share the parent's counter and order by sequence.
    let Ok(Reply::Created {
        path, predecessor, ..
    }) = h.write(s, create("/lock/a-", b"", true, true))
    else {
        panic!()
    };
    assert_eq!(path, "/lock/a-0000000003");
    assert_eq!(predecessor.unwrap().name, "n-0000000002");
}

#[test]
fn multibyte_names_next_to_sequential_nodes() {
    // A sibling whose name is not ASCII must not crash predecessor computation.
    let mut h = Harness::new();
    let s = h.session();
    h.write(s, create("/locks", b"", false, false)).unwrap();
    for name in [
        "/locks/€€€€",
        "/locks/ünïcödé-ñame",
        "/locks/日本語のなまえです",
        "/locks/a€",
    ] {
        h.write(s, create(name, b"", false, false)).unwrap();
    }
    let Ok(Reply::Created { predecessor, .. }) = h.write(s, create("/locks/n-", b"", true, true))
    else {
        panic!()
    };
    assert!(predecessor.is_none());
    let Ok(Reply::Created {
        path, predecessor, ..
    }) = h.write(s, create("/locks/€-", b"", true, true))
    else {
        panic!()
    };
    assert_eq!(path, "/locks/€-0000000001");
    assert_eq!(predecessor.unwrap().name, "n-0000000000");
}

proptest! {
    #[test]
    fn sequence_of_never_panics(name in "\\PC{0,16}") {
        let _ = super::sequence_of(&name);
    }
}

#[test]
fn mark_cacher_is_recorded_for_open_sessions_only() {
    let mut h = Harness::new();
    let s = h.session();
    assert!(!h.sm.session(s).unwrap().caches);
    assert!(h.apply(Command::MarkCacher { session: s }).0.is_ok());
    assert!(h.sm.session(s).unwrap().caches);
    assert_eq!(
        h.apply(Command::MarkCacher { session: 999 }).0,
        Err(Error::UnknownSession { session: 999 })
    );
}

#[test]
fn changed_since_sees_a_create_then_delete() {
    use wire::types::{EventType, WatchKind};
    let mut h = Harness::new();
    let s = h.session();
    h.write(s, create("/dir", b"", false, false)).unwrap();
    let since = h.sm.last_index();
    assert_eq!(h.sm.changed_since("/dir/x", WatchKind::Exists, since), None);
    h.write(s, create("/dir/x", b"", false, false)).unwrap();
    h.write(s, del("/dir/x", None)).unwrap();
    assert_eq!(
        h.sm.changed_since("/dir/x", WatchKind::Exists, since),
        Some(EventType::Deleted)
    );
    let now = h.sm.last_index();
    assert_eq!(h.sm.changed_since("/dir/x", WatchKind::Exists, now), None);
    h.write(s, set("/dir", b"v", None)).unwrap();
    assert_eq!(
        h.sm.changed_since("/dir", WatchKind::Data, now),
        Some(EventType::DataChanged)
    );
    assert_eq!(h.sm.changed_since("/dir", WatchKind::Children, now), None);
}

#[test]
fn dedup_returns_first_answer() {
    let mut h = Harness::new();
    let s = h.session();
    let first = h.write_id(s, 7, create("/q-", b"", false, true)).unwrap();
    let again = h.write_id(s, 7, create("/q-", b"", false, true)).unwrap();
    assert_eq!(first, again);
    assert_eq!(h.sm.node("/").unwrap().children.len(), 1);
    // ack_below forgets; an older id is then stale.
    let (r, _) = h.apply(Command::Write {
        session: s,
        request_id: 9,
        ack_below: 9,
        ops: vec![create("/z", b"", false, false)],
        single: true,
    });
    assert!(r.is_ok());
    assert_eq!(
        h.write_id(s, 7, create("/q-", b"", false, true)),
        Err(Error::StaleRequest {
            session: s,
            request_id: 7
        })
    );
}

#[test]
fn unacknowledged_results_are_never_evicted() {
    let mut h = Harness::new();
    let s = h.session();
    let write = |h: &mut Harness, id: u64, ack_below: u64, path: String| {
        h.apply(Command::Write {
            session: s,
            request_id: id,
            ack_below,
            ops: vec![create(&path, b"", false, false)],
            single: true,
        })
        .0
    };
    // Request 1 stays unacknowledged (its answer was lost) while many more complete.
    let first = write(&mut h, 1, 0, "/first".into());
    assert!(first.is_ok());
    for id in 2..=wire::DEDUP_RESULTS_MAX as u64 {
        assert!(write(&mut h, id, 1, format!("/n{id}")).is_ok());
    }
    // The window is full: the next request is refused, unapplied.
    let next = wire::DEDUP_RESULTS_MAX as u64 + 1;
    assert_eq!(
        write(&mut h, next, 1, "/over".into()),
        Err(Error::TooManyRequests {
            session: s,
            max: wire::DEDUP_RESULTS_MAX
        })
    );
    assert!(h.sm.node("/over").is_none());
    // The retry of request 1 still gets its first answer.
    assert_eq!(write(&mut h, 1, 0, "/first".into()), first);
    // Once the client acknowledges request 1, the refused request goes through.
    assert!(write(&mut h, next, 2, "/over".into()).is_ok());
    assert!(h.sm.node("/over").is_some());
}

#[test]
fn transactions_are_all_or_nothing() {
    let mut h = Harness::new();
    let s = h.session();
    h.write(s, create("/cfg", b"v0", false, false)).unwrap();
    let before = h.sm.nodes.clone();
    let ops = vec![
        create("/a", b"", false, false),
        create("/a/b", b"", true, false),
        set("/cfg", b"v1", None),
        del("/cfg", Some(0)), // version is 1 after the set: fails
    ];
    let r = h.apply(Command::Write {
        session: s,
        request_id: 100,
        ack_below: 0,
        ops,
        single: false,
    });
    assert!(
        matches!(r.0, Err(Error::TxnFailed { index: 3, .. })),
        "{r:?}"
    );
    assert!(r.1.is_empty());
    assert_eq!(before, h.sm.nodes);
    assert!(h.sm.session(s).unwrap().ephemerals.is_empty());

    let ops = vec![
        TxnOp::Check {
            path: "/cfg".into(),
            version: Some(0),
        },
        create("/a", b"", false, false),
        set("/cfg", b"v1", Some(0)),
    ];
    let r = h.apply(Command::Write {
        session: s,
        request_id: 101,
        ack_below: 0,
        ops,
        single: false,
    });
    let Ok(Reply::Txn { results }) = r.0 else {
        panic!("{r:?}")
    };
    assert!(matches!(
        results[..],
        [
            TxnResult::Checked,
            TxnResult::Created { .. },
            TxnResult::Set { .. }
        ]
    ));
}

#[test]
fn lease_checkpoints() {
    let mut h = Harness::new();
    let a = h.session();
    let b = h.session();
    let _ = h.apply(Command::LeaseCheckpoint(LeaseCheckpoint {
        mark_all: true,
        ..Default::default()
    }));
    assert_eq!(h.sm.session(a).unwrap().silent_ms, Some(0));
    // Renewals clear first; the silence added applies to those still marked.
    let _ = h.apply(Command::LeaseCheckpoint(LeaseCheckpoint {
        mark_all: false,
        renewed: vec![b],
        silent_add_ms: 5_000,
    }));
    assert_eq!(h.sm.session(a).unwrap().silent_ms, Some(5_000));
    assert_eq!(h.sm.session(b).unwrap().silent_ms, None);
    let c = h.session();
    let _ = h.apply(Command::LeaseCheckpoint(LeaseCheckpoint {
        silent_add_ms: 1_500,
        ..Default::default()
    }));
    assert_eq!(h.sm.session(a).unwrap().silent_ms, Some(6_500));
    assert_eq!(
        h.sm.session(b).unwrap().silent_ms,
        None,
        "renewed: unmarked"
    );
    assert_eq!(
        h.sm.session(c).unwrap().silent_ms,
        None,
        "opened after the mark"
    );
    // mark_all keeps accumulated silence.
    let _ = h.apply(Command::LeaseCheckpoint(LeaseCheckpoint {
        mark_all: true,
        ..Default::default()
    }));
    assert_eq!(h.sm.session(a).unwrap().silent_ms, Some(6_500));
}

// ---- Property tests against a model ----

#[derive(Debug, Clone)]
enum Action {
    NewSession,
    EndSession(usize, bool),
    Create {
        parent: usize,
        name: usize,
        ephemeral: bool,
        sequential: bool,
        session: usize,
    },
    Set {
        path: usize,
        cas: bool,
        session: usize,
    },
    Delete {
        path: usize,
        cas: bool,
        session: usize,
    },
    Retry(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        1 => Just(Action::NewSession),
        1 => (0..4usize, any::<bool>()).prop_map(|(s, e)| Action::EndSession(s, e)),
        5 => (0..3usize, 0..3usize, any::<bool>(), any::<bool>(), 0..4usize).prop_map(
            |(parent, name, ephemeral, sequential, session)| Action::Create {
                parent, name, ephemeral, sequential, session
            }
        ),
        3 => (0..12usize, any::<bool>(), 0..4usize).prop_map(|(path, cas, session)| Action::Set { path, cas, session }),
        3 => (0..12usize, any::<bool>(), 0..4usize).prop_map(|(path, cas, session)| Action::Delete { path, cas, session }),
        2 => (0..64usize).prop_map(Action::Retry),
    ]
}

#[derive(Debug, Clone, PartialEq)]
struct ModelNode {
    data: Vec<u8>,
    version: u64,
    owner: Option<u64>,
    create_index: u64,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn matches_model(actions in proptest::collection::vec(action(), 1..60)) {
        let mut h = Harness::new();
        let mut model: BTreeMap<String, ModelNode> = BTreeMap::new();
        let mut sessions: Vec<u64> = Vec::new();
        let mut open: Vec<u64> = Vec::new();
        let mut history: Vec<(u64, u64, TxnOp, Result<Reply, Error>)> = Vec::new();
        let mut last_token = 0u64;
        let mut last_seq: BTreeMap<String, u64> = BTreeMap::new();
        let parents = ["/", "/p", "/p/q"];
        let names = ["a", "b", "p"];
        // A persistent skeleton so deeper paths are reachable.
        let boot = h.session();
        h.write(boot, create("/p", b"", false, false)).unwrap();
        h.write(boot, create("/p/q", b"", false, false)).unwrap();
        for p in ["/p", "/p/q"] {
            let n = h.sm.node(p).unwrap();
            model.insert(p.into(), ModelNode { data: vec![], version: 0, owner: None, create_index: n.create_index });
        }
        sessions.push(boot);
        open.push(boot);

        for act in actions {
            let pick = |i: usize| sessions[i % sessions.len()];
            match act {
                Action::NewSession => {
                    let s = h.session();
                    sessions.push(s);
                    open.push(s);
                }
                Action::EndSession(i, expire) => {
                    let s = pick(i);
                    let cmd = if expire { Command::ExpireSessions { sessions: vec![s] } } else { Command::CloseSession { session: s } };
                    let was_open = open.contains(&s);
                    let (r, _) = h.apply(cmd);
                    if was_open {
                        prop_assert!(r.is_ok());
                        model.retain(|_, n| n.owner != Some(s));
                        open.retain(|x| *x != s);
                    }
                }
                Action::Create { parent, name, ephemeral, sequential, session } => {
                    let s = pick(session);
                    let p = parents[parent];
                    let path = if p == "/" { format!("/{}", names[name]) } else { format!("{p}/{}", names[name]) };
                    let op = create(&path, b"d", ephemeral, sequential);
                    let request_id = h.next_request;
                    let r = h.write(s, op.clone());
                    let parent_ok = p == "/" || model.get(p).is_some_and(|n| n.owner.is_none());
                    if let Ok(Reply::Created { path: full, stat, .. }) = &r {
                        prop_assert!(open.contains(&s) && parent_ok);
                        prop_assert!(!model.contains_key(full));
                        prop_assert!(stat.create_index > last_token, "tokens increase");
                        last_token = stat.create_index;
                        if sequential {
                            let seq = super::sequence_of(full).unwrap();
                            if let Some(prev) = last_seq.get(p) { prop_assert!(seq > *prev, "sequence increases"); }
                            last_seq.insert(p.to_string(), seq);
                        }
                        model.insert(full.clone(), ModelNode { data: b"d".to_vec(), version: 0, owner: ephemeral.then_some(s), create_index: stat.create_index });
                    } else {
                        prop_assert!(!open.contains(&s) || !parent_ok || (!sequential && model.contains_key(&path)), "{r:?}");
                    }
                    history.push((s, request_id, op, r));
                }
                Action::Set { path, cas, session } => {
                    let s = pick(session);
                    let keys: Vec<String> = model.keys().cloned().collect();
                    if keys.is_empty() { continue; }
                    let p = keys[path % keys.len()].clone();
                    let version = cas.then(|| model[&p].version);
                    let op = set(&p, b"v", version);
                    let request_id = h.next_request;
                    let r = h.write(s, op.clone());
                    if open.contains(&s) {
                        prop_assert!(r.is_ok(), "{r:?}");
                        let n = model.get_mut(&p).unwrap();
                        n.version += 1;
                        n.data = b"v".to_vec();
                    } else {
                        prop_assert!(r.is_err());
                    }
                    history.push((s, request_id, op, r));
                }
                Action::Delete { path, cas, session } => {
                    let s = pick(session);
                    let keys: Vec<String> = model.keys().cloned().collect();
                    if keys.is_empty() { continue; }
                    let p = keys[path % keys.len()].clone();
                    let version = cas.then(|| model[&p].version + 1); // always wrong when cas
                    let op = del(&p, version);
                    let request_id = h.next_request;
                    let r = h.write(s, op.clone());
                    let has_children = model.keys().any(|k| k.starts_with(&format!("{p}/")));
                    if open.contains(&s) && !cas && !has_children {
                        prop_assert!(r.is_ok(), "{r:?}");
                        model.remove(&p);
                        // A parent created again counts its sequence from 0, as ZooKeeper's
                        // cversion does; fencing rests on create indexes, checked above.
                        last_seq.remove(&p);
                    } else {
                        prop_assert!(r.is_err());
                    }
                    history.push((s, request_id, op, r));
                }
                Action::Retry(i) => {
                    if history.is_empty() { continue; }
                    let (s, request_id, op, first) = history[i % history.len()].clone();
                    let before = h.sm.nodes.clone();
                    let again = h.write_id(s, request_id, op);
                    if open.contains(&s) {
                        prop_assert_eq!(&again, &first, "a retry returns the first answer");
                        prop_assert_eq!(&before, &h.sm.nodes, "a retry changes nothing");
                    }
                }
            }
            // The namespace equals the model.
            let sm_paths: Vec<&String> = h.sm.nodes.keys().filter(|k| *k != "/").collect();
            let model_paths: Vec<&String> = model.keys().collect();
            prop_assert_eq!(sm_paths, model_paths);
            for (p, m) in &model {
                let n = h.sm.node(p).unwrap();
                prop_assert_eq!((&n.data, n.version, n.ephemeral_owner, n.create_index), (&m.data, m.version, m.owner, m.create_index));
            }
            // Ephemerals belong to open sessions only.
            for n in h.sm.nodes.values() {
                if let Some(owner) = n.ephemeral_owner { prop_assert!(open.contains(&owner)); }
            }
        }
    }
}

// ---- Lease checkpoints: recorded silence is a lower bound of the truth ----

#[derive(Debug, Clone)]
enum LeaseAction {
    /// Time passes (ms).
    Advance(u64),
    /// Session `i` sends a KeepAlive.
    KeepAlive(usize),
    /// The leader proposes its next checkpoint: it commits and the leader hears so
    /// (`Commit`), it fails (`Lost`), or it commits although the leader heard a failure
    /// (`CommittedButFailed`, a timeout on a slow commit).
    Checkpoint(CheckpointFate),
    /// A new leader takes over from the log.
    Takeover,
    /// A client opens a session.
    Open,
    /// A client opens a session whose `SessionOpened` effect reaches the lease table
    /// only at a later `Deliver` (effects and checkpoint answers travel by different
    /// tasks: a checkpoint applied after the session may be answered first).
    OpenLate,
    /// The effects of every `OpenLate` so far reach the lease table.
    Deliver,
}

#[derive(Debug, Clone, Copy)]
enum CheckpointFate {
    Commit,
    Lost,
    CommittedButFailed,
}

fn lease_action() -> impl Strategy<Value = LeaseAction> {
    prop_oneof![
        4 => (0u64..2_500).prop_map(LeaseAction::Advance),
        4 => (0usize..8).prop_map(LeaseAction::KeepAlive),
        3 => prop_oneof![
            Just(CheckpointFate::Commit),
            Just(CheckpointFate::Lost),
            Just(CheckpointFate::CommittedButFailed),
        ]
        .prop_map(LeaseAction::Checkpoint),
        1 => Just(LeaseAction::Takeover),
        1 => Just(LeaseAction::Open),
        1 => Just(LeaseAction::OpenLate),
        1 => Just(LeaseAction::Deliver),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The real leader lease table driving the real state machine: whatever commits,
    /// fails or commits unbeknownst, and however leaders change, no session's recorded
    /// silence exceeds the time since the receipt of its last acknowledged renewal, so no
    /// new leader gives a live session less lease than its client counts on.
    #[test]
    fn recorded_silence_never_exceeds_the_truth(
        actions in proptest::collection::vec(lease_action(), 1..120)
    ) {
        use crate::leader::leases::{KeepAliveStep, Leases, Renewal};
        use std::time::Duration;
        use tokio::time::Instant;
        let lease = Duration::from_secs(12);
        let t0 = Instant::now();
        let mut now = t0;
        let mut h = Harness::new();
        let mut ids: Vec<u64> = (0..4).map(|_| h.session()).collect();
        // When each session's last acknowledged renewal was received.
        let mut acked: BTreeMap<u64, Instant> = ids.iter().map(|id| (*id, t0)).collect();
        // KeepAlives waiting for a checkpoint: (session, received).
        let mut waiting: Vec<(u64, Instant)> = Vec::new();
        // Sessions opened whose effect has not reached the lease table yet.
        let mut late: Vec<u64> = Vec::new();
        let mut leader = Leases::new(lease, Duration::from_secs(1));
        // Whether the log has session `id` marked, as the session manager reads it when
        // the effect arrives.
        let marked = |h: &Harness, id: u64| h.sm.session(id).is_some_and(|s| s.silent_ms.is_some());
        let load = |h: &Harness| -> Vec<(u64, Option<u64>)> {
            h.sm.sessions().map(|(id, s)| (id, s.silent_ms)).collect()
        };
        leader.become_leader(now, load(&h));
        for a in actions {
            match a {
                LeaseAction::Advance(ms) => now += Duration::from_millis(ms),
                LeaseAction::KeepAlive(i) => {
                    let id = ids[i % ids.len()];
                    let mut step = leader.keepalive(id, now);
                    if step == KeepAliveStep::Unknown && h.sm.session(id).is_some() {
                        // The session manager adopts a session whose effect has not
                        // reached it yet (`keepalive_step`).
                        leader.opened(id, now, marked(&h, id));
                        step = leader.keepalive(id, now);
                    }
                    match step {
                        KeepAliveStep::Renew => {
                            if leader.renew(id, now, now) == Renewal::Renewed {
                                acked.insert(id, now);
                            }
                        }
                        KeepAliveStep::NeedsCheckpoint => waiting.push((id, now)),
                        KeepAliveStep::Unknown | KeepAliveStep::Expired => {}
                    }
                }
                LeaseAction::Checkpoint(fate) => {
                    let Some(cp) = leader.next_checkpoint(now) else { continue };
                    if !matches!(fate, CheckpointFate::Lost) {
                        let _ = h.apply(Command::LeaseCheckpoint(cp.clone()));
                    }
                    let ok = matches!(fate, CheckpointFate::Commit);
                    for id in leader.checkpoint_done(&cp, ok, now) {
                        for (w, received) in waiting.iter().filter(|(w, _)| *w == id) {
                            if leader.renew(*w, *received, now) == Renewal::Renewed {
                                let a = acked.get_mut(w).unwrap();
                                *a = (*a).max(*received);
                            }
                        }
                        waiting.retain(|(w, _)| *w != id);
                    }
                }
                LeaseAction::Takeover => {
                    leader = Leases::new(lease, Duration::from_secs(1));
                    leader.become_leader(now, load(&h));
                    waiting.clear();
                }
                LeaseAction::Open => {
                    let id = h.session();
                    leader.opened(id, now, marked(&h, id));
                    acked.insert(id, now);
                    ids.push(id);
                }
                LeaseAction::OpenLate => {
                    let id = h.session();
                    acked.insert(id, now);
                    ids.push(id);
                    late.push(id);
                }
                LeaseAction::Deliver => {
                    for id in late.drain(..) {
                        leader.opened(id, now, marked(&h, id));
                    }
                }
            }
            for (id, s) in h.sm.sessions() {
                if let Some(ms) = s.silent_ms {
                    let truth = now.duration_since(acked[&id]).as_millis() as u64;
                    prop_assert!(
                        ms <= truth,
                        "session {id}: recorded silence {ms} ms > {truth} ms since its last \
                         acknowledged renewal"
                    );
                }
            }
        }
    }
}

/// A held write applies only in the term whose cacher list held it: in another it is a
/// `NotLeader` answer that changes nothing and does not use up the request id, so the
/// client's retry (same id) applies.
#[test]
fn a_held_write_applies_only_in_the_term_it_was_held_in() {
    let mut h = Harness::new();
    let s = h.session();
    h.write(s, create("/cfg", b"v1", false, false)).unwrap();
    let held = |term| Command::Held {
        term,
        command: Box::new(Command::Write {
            session: s,
            request_id: 40,
            ack_below: 0,
            ops: vec![set("/cfg", b"v2", None)],
            single: true,
        }),
    };
    h.index += 1;
    let (r, effects) = h.sm.apply_in_term(h.index, 4, &held(3));
    assert!(matches!(r, Err(Error::NotLeader { .. })), "{r:?}");
    assert!(effects.is_empty());
    assert_eq!(h.sm.node("/cfg").unwrap().data, b"v1".to_vec());
    h.index += 1;
    let (r, effects) = h.sm.apply_in_term(h.index, 4, &held(4));
    assert!(r.is_ok(), "{r:?}");
    assert!(!effects.is_empty());
    assert_eq!(h.sm.node("/cfg").unwrap().data, b"v2".to_vec());
    // A held expiry in a stale term leaves the session and its ephemerals.
    let owner = h.session();
    h.write(owner, create("/e", b"", true, false)).unwrap();
    let expire = Command::Held {
        term: 1,
        command: Box::new(Command::ExpireSessions {
            sessions: vec![owner],
        }),
    };
    h.index += 1;
    let (r, _) = h.sm.apply_in_term(h.index, 2, &expire);
    assert!(matches!(r, Err(Error::NotLeader { .. })), "{r:?}");
    assert!(h.sm.session(owner).is_some() && h.sm.node("/e").is_some());
}

fn write_cmd(session: u64, request_id: u64, op: TxnOp) -> Command {
    Command::Write {
        session,
        request_id,
        ack_below: 0,
        ops: vec![op],
        single: true,
    }
}

/// A batch applies its commands in order at one index, each with its own answer, exactly
/// as one entry each would (but for the index): a later command sees an earlier one's
/// change, a failing one changes nothing and does not stop the rest, and a retried write
/// in a later batch returns its first answer.
#[test]
fn a_batch_applies_its_commands_in_order_at_one_index() {
    let mut h = Harness::new();
    let (a, b) = (h.session(), h.session());
    h.write(a, create("/cfg", b"v0", false, false)).unwrap();
    let batch = vec![
        write_cmd(a, 10, set("/cfg", b"v1", Some(0))),
        write_cmd(b, 20, set("/cfg", b"stale", Some(0))),
        write_cmd(b, 21, create("/b", b"", true, false)),
        write_cmd(
            a,
            11,
            TxnOp::Delete {
                path: "/cfg".into(),
                version: Some(1),
            },
        ),
    ];
    h.index += 1;
    let at = h.index;
    let (answers, effects) = h.sm.apply_batch_in_term(at, 0, &batch);
    assert_eq!(answers.len(), 4);
    assert!(matches!(answers[0], Ok(Reply::Set { .. })), "{answers:?}");
    assert_eq!(
        answers[1],
        Err(Error::BadVersion {
            path: "/cfg".into(),
            expected: 0,
            actual: 1
        })
    );
    assert!(
        matches!(answers[2], Ok(Reply::Created { .. })),
        "{answers:?}"
    );
    assert!(answers[3].is_ok(), "{answers:?}");
    assert!(h.sm.node("/cfg").is_none());
    let n = h.sm.node("/b").expect("/b");
    assert_eq!((n.create_index, n.ephemeral_owner), (at, Some(b)));
    assert!(
        effects.contains(&Effect::Deleted {
            path: "/cfg".into()
        }),
        "{effects:?}"
    );
    // The same write retried later (same session and request id) is not applied again.
    h.index += 1;
    let (again, _) = h.sm.apply_batch_in_term(h.index, 0, &batch[2..3]);
    assert_eq!(again[0], answers[2]);
}

/// Lock contenders created by one batch each get a token of their own, growing in apply
/// order (the predecessor's lower), and the sessions one entry opens get distinct,
/// consecutive ids from its range, below the next entry's; a batch inside a batch
/// answers `Unavailable` and changes nothing.
#[test]
fn a_batch_gives_each_create_its_own_token_and_its_sessions_distinct_ids() {
    let mut h = Harness::new();
    let (a, b) = (h.session(), h.session());
    h.write(a, create("/lock", b"", false, false)).unwrap();
    h.write(a, create("/other", b"", false, false)).unwrap();
    let sessions_before = h.sm.session_count();
    let batch = vec![
        Command::CreateSession {
            owner: "lock://client/test".into(),
        },
        write_cmd(a, 30, create("/lock/n-", b"", true, true)),
        Command::CreateSession {
            owner: "lock://client/test".into(),
        },
        write_cmd(b, 40, create("/lock/n-", b"", true, true)),
        write_cmd(b, 41, create("/other/x", b"", false, false)),
        Command::Held {
            term: 0,
            command: Box::new(write_cmd(b, 42, create("/lock/m-", b"", true, true))),
        },
        Command::Batch(vec![Command::Noop]),
    ];
    h.index += 1;
    let at = h.index;
    let (answers, _) = h.sm.apply_batch_in_term(at, 0, &batch);
    let opened: Vec<SessionId> = [0, 2]
        .iter()
        .map(|&i| match answers[i] {
            Ok(Reply::SessionCreated { session, .. }) => session,
            ref other => panic!("{i}: {other:?}"),
        })
        .collect();
    assert_eq!(
        opened,
        vec![
            wire::types::session_id(at, 0),
            wire::types::session_id(at, 1)
        ]
    );
    assert!(opened.iter().all(|&s| wire::types::session_index(s) == at));
    assert!(opened[0] > b, "ids go up: {opened:?} after {b}");
    let created: Vec<(String, u64, Option<String>)> = [1, 3, 4, 5]
        .iter()
        .map(|&i| match &answers[i] {
            Ok(Reply::Created {
                path,
                stat,
                predecessor,
            }) => (
                path.clone(),
                stat.token,
                predecessor
                    .as_ref()
                    .map(|p| wire::path::join("/lock", &p.name)),
            ),
            other => panic!("{i}: {other:?}"),
        })
        .collect();
    let tokens: Vec<u64> = created.iter().map(|c| c.1).collect();
    let expected: Vec<u64> = (0..4)
        .map(|k| wire::directory::token(0, at, k).unwrap())
        .collect();
    assert_eq!(tokens, expected, "{created:?}");
    // The second contender's predecessor is the first, with the lower token.
    assert_eq!(created[1].2.as_deref(), Some(created[0].0.as_str()));
    for (path, token, _) in &created {
        let n = h.sm.node(path).unwrap();
        assert_eq!((n.token, n.create_index), (*token, at), "{path}");
    }
    assert!(
        matches!(answers[6], Err(Error::Unavailable { .. })),
        "{answers:?}"
    );
    assert_eq!(h.sm.session_count(), sessions_before + 2);
    for s in &opened {
        h.sm.check_session(*s).expect("opened");
    }
    let Ok(Reply::Children { children, .. }) = h.sm.children("/lock") else {
        panic!("children of /lock")
    };
    assert_eq!(children.len(), 3, "{children:?}");
    // The next entry's create and session are above every token and id of this one's.
    let Ok(Reply::Created { stat, .. }) = h.write_id(b, 43, create("/lock/n-", b"", true, true))
    else {
        panic!("create in the next entry")
    };
    assert!(stat.token > wire::directory::token(0, at, 1023).unwrap());
    let next = h.session();
    assert!(next > wire::types::session_id(at, wire::types::SESSIONS_PER_ENTRY - 1));
}

/// One entry opens at most `SESSIONS_PER_ENTRY` sessions (its id range): the next
/// `CreateSession` is refused, at batching and at apply, and opens nothing.
#[test]
fn an_entry_opens_at_most_its_range_of_sessions() {
    let per = wire::types::SESSIONS_PER_ENTRY as usize;
    let mut rule = wire::command::BatchRule::default();
    for _ in 0..per {
        assert!(rule.admit(&Command::CreateSession {
            owner: "lock://client/test".into()
        }));
    }
    assert!(!rule.admit(&Command::CreateSession {
        owner: "lock://client/test".into()
    }));
    let mut h = Harness::new();
    h.index += 1;
    let (answers, _) = h.sm.apply_batch_in_term(
        h.index,
        0,
        &vec![
            Command::CreateSession {
                owner: "lock://client/test".into()
            };
            per + 1
        ],
    );
    assert!(answers[..per]
        .iter()
        .all(|a| matches!(a, Ok(Reply::SessionCreated { .. }))));
    assert!(matches!(answers[per], Err(Error::Unavailable { .. })));
    assert_eq!(h.sm.session_count(), per);
}

proptest! {
    /// The rule the leader batches by: it admits commands until the entry would hold more
    /// than 1024 create ops or open more than 1024 sessions, whatever they create under,
    /// and counts each command's creates as the position of the next one's first.
    #[test]
    fn the_batch_rule_refuses_exactly_what_overflows_an_entrys_ranges(
        cmds in prop::collection::vec((0u8..5, 0u8..3, 1usize..=wire::TXN_OPS_MAX), 1..60)
    ) {
        let cmds: Vec<Command> = cmds
            .into_iter()
            .enumerate()
            .map(|(i, (kind, parent, n))| match kind {
                0 => Command::CreateSession { owner: "lock://client/test".into() },
                1 => write_cmd(1, i as u64, create(&format!("/p{parent}/n-"), b"", true, true)),
                2 => Command::Write {
                    session: 1,
                    request_id: i as u64,
                    ack_below: 0,
                    ops: (0..n)
                        .map(|k| if k % 3 == 2 {
                            set(&format!("/p{parent}"), b"", None)
                        } else {
                            create(&format!("/p{parent}/m{i}-{k}"), b"", false, false)
                        })
                        .collect(),
                    single: false,
                },
                3 => write_cmd(1, i as u64, set(&format!("/p{parent}"), b"", None)),
                _ => Command::CloseSession { session: 9 },
            })
            .collect();
        let mut rule = wire::command::BatchRule::default();
        let (mut sessions, mut creates) = (0u64, 0u64);
        for c in &cmds {
            let (s, n) = match c {
                Command::CreateSession { .. } => (1, 0),
                Command::Write { ops, .. } => (
                    0,
                    ops.iter().filter(|o| matches!(o, TxnOp::Create { .. })).count() as u64,
                ),
                _ => (0, 0),
            };
            let expected = sessions + s <= wire::types::SESSIONS_PER_ENTRY
                && creates + n <= wire::directory::CREATES_PER_ENTRY;
            prop_assert_eq!(rule.creates(), creates);
            prop_assert_eq!(rule.admit(c), expected, "{:?}", c);
            if expected {
                sessions += s;
                creates += n;
            }
        }
    }
}

// ---- Batch entries and snapshots: a replica restored from a snapshot goes on alike ----

/// One log entry of a generated history.
#[derive(Debug, Clone)]
enum Entry {
    One(Command),
    Batch(Vec<Command>),
}

/// Applies `e` at `index` the way the state-machine store does; returns each command's
/// answer.
fn apply_entry(sm: &mut StateMachine, index: u64, e: &Entry) -> Vec<Result<Reply, Error>> {
    match e {
        Entry::One(cmd) => vec![sm.apply(index, cmd).0],
        Entry::Batch(cmds) => sm.apply_batch_in_term(index, 0, cmds).0,
    }
}

/// Turns `actions` into a log (commands grouped into batch entries of up to `batch`
/// commands wherever the batch rule admits them), built against a replica that applies
/// each entry as it is made so the commands name sessions and nodes that exist.
fn history(actions: &[(Action, usize)]) -> (Vec<Entry>, Vec<Vec<Result<Reply, Error>>>) {
    let mut sm = open_state();
    let mut next_request = 1u64;
    let parents = ["/", "/p", "/p/q"];
    let names = ["a", "b", "p"];
    let mut pending: Vec<Command> = Vec::new();
    let mut rule = BatchRule::default();
    type Log = (Vec<Entry>, Vec<Vec<Result<Reply, Error>>>);
    fn flush(
        sm: &mut StateMachine,
        log: &mut Log,
        pending: &mut Vec<Command>,
        rule: &mut BatchRule,
    ) {
        if pending.is_empty() {
            return;
        }
        let e = if pending.len() == 1 {
            Entry::One(pending.pop().expect("one"))
        } else {
            Entry::Batch(std::mem::take(pending))
        };
        log.1.push(apply_entry(sm, log.0.len() as u64 + 1, &e));
        log.0.push(e);
        *rule = BatchRule::default();
    }
    let mut log: Log = (Vec::new(), Vec::new());
    // A persistent skeleton so deeper paths are reachable.
    let boot_index = 1;
    let boot = wire::types::session_id(boot_index, 0);
    for cmd in [
        Command::CreateSession {
            owner: "lock://client/test".into(),
        },
        write_cmd(boot, 1, create("/p", b"", false, false)),
        write_cmd(boot, 2, create("/p/q", b"", false, false)),
    ] {
        pending.push(cmd);
        flush(&mut sm, &mut log, &mut pending, &mut rule);
    }
    next_request += 2;
    for (act, batch) in actions {
        let open: Vec<SessionId> = sm.sessions().map(|(id, _)| id).collect();
        let pick = |i: usize| open.get(i % open.len().max(1)).copied().unwrap_or(boot);
        let keys: Vec<String> = sm.nodes.keys().filter(|k| *k != "/").cloned().collect();
        let mut write = |session, op| {
            next_request += 1;
            write_cmd(session, next_request, op)
        };
        let cmd = match act {
            Action::NewSession => Command::CreateSession {
                owner: "lock://client/test".into(),
            },
            Action::EndSession(i, true) => Command::ExpireSessions {
                sessions: vec![pick(*i)],
            },
            Action::EndSession(i, false) => Command::CloseSession { session: pick(*i) },
            Action::Create {
                parent,
                name,
                ephemeral,
                sequential,
                session,
            } => {
                let p = parents[*parent];
                let path = if p == "/" {
                    format!("/{}", names[*name])
                } else {
                    format!("{p}/{}", names[*name])
                };
                write(pick(*session), create(&path, b"d", *ephemeral, *sequential))
            }
            Action::Set { path, cas, session } if !keys.is_empty() => {
                let p = &keys[path % keys.len()];
                let version = cas.then(|| sm.node(p).expect("listed").version);
                write(pick(*session), set(p, b"v", version))
            }
            Action::Delete { path, cas, session } if !keys.is_empty() => {
                let p = &keys[path % keys.len()];
                write(pick(*session), del(p, cas.then_some(0)))
            }
            // A retry: a write sent again with its request id.
            Action::Retry(i) => match log.0.get(i % log.0.len().max(1)) {
                Some(Entry::One(cmd @ Command::Write { .. })) => cmd.clone(),
                _ => Command::Noop,
            },
            _ => Command::Noop,
        };
        // Held by the leader of term 0 (the term these entries are applied in) now and
        // then, as a write to a cached node is.
        let cmd = if next_request.is_multiple_of(3) {
            Command::Held {
                term: 0,
                command: Box::new(cmd),
            }
        } else {
            cmd
        };
        if pending.len() >= *batch || !rule.admit(&cmd) {
            flush(&mut sm, &mut log, &mut pending, &mut rule);
            assert!(rule.admit(&cmd), "an empty batch admits {cmd:?}");
        }
        pending.push(cmd);
    }
    flush(&mut sm, &mut log, &mut pending, &mut rule);
    log
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Issue 22, item 6: a random history with batch entries, applied by one replica from
    /// the start, and by another up to a random entry, then snapshotted (encoded and
    /// decoded as a snapshot is), restored into a fresh replica and continued: every
    /// answer after the snapshot is the same, and so are the states and their digests
    /// (the digest also tells apart the states the history went through).
    #[test]
    fn a_replica_restored_from_a_snapshot_goes_on_alike(
        actions in proptest::collection::vec((action(), 1..5usize), 1..60),
        cut in any::<proptest::sample::Index>(),
    ) {
        let (entries, answers) = history(&actions);
        // A long history without one batch entry (every action drawn with a batch of 1)
        // is what the other tests cover: draw again rather than fail (a fresh seed found
        // one on 2026-12-06; the test command's fixed seed never drew it).
        prop_assume!(entries.iter().any(|e| matches!(e, Entry::Batch(_))) || entries.len() < 8);
        let cut = cut.index(entries.len() + 1);
        let mut whole = open_state();
        let mut digests = std::collections::BTreeSet::new();
        for (i, e) in entries.iter().enumerate() {
            prop_assert_eq!(&apply_entry(&mut whole, i as u64 + 1, e), &answers[i]);
            digests.insert((whole.digest(), postcard::to_allocvec(&whole).unwrap()));
        }
        let mut before = open_state();
        for (i, e) in entries[..cut].iter().enumerate() {
            apply_entry(&mut before, i as u64 + 1, e);
        }
        let bytes = postcard::to_allocvec(&before).unwrap();
        let mut restored: StateMachine = postcard::from_bytes(&bytes).unwrap();
        prop_assert_eq!(&restored, &before);
        prop_assert_eq!(restored.digest(), before.digest());
        for (i, e) in entries.iter().enumerate().skip(cut) {
            prop_assert_eq!(&apply_entry(&mut restored, i as u64 + 1, e), &answers[i], "entry {} after a snapshot at {}", i + 1, cut);
        }
        prop_assert_eq!(&restored, &whole);
        prop_assert_eq!(restored.digest(), whole.digest());
        // Different states, different digests (no collision among the states seen).
        let by_digest: std::collections::BTreeMap<u64, &Vec<u8>> = digests.iter().map(|(d, b)| (*d, b)).collect();
        prop_assert_eq!(by_digest.len(), digests.iter().map(|(_, b)| b).collect::<std::collections::BTreeSet<_>>().len());
    }
}

/// The digest changes with any part of the state: a node's data, a stored result, a
/// session's cache mark.
#[test]
fn the_digest_sees_every_part_of_the_state() {
    let mut h = Harness::new();
    let s = h.session();
    h.write(s, create("/a", b"x", false, false)).unwrap();
    let base = h.sm.digest();
    let mut other = h.sm.clone();
    other.nodes.get_mut("/a").unwrap().data = b"y".to_vec();
    assert_ne!(other.digest(), base);
    let mut other = h.sm.clone();
    other.sessions.get_mut(&s).unwrap().caches = true;
    assert_ne!(other.digest(), base);
    let mut other = h.sm.clone();
    other.sessions.get_mut(&s).unwrap().results.clear();
    assert_ne!(other.digest(), base);
    assert_eq!(h.sm.clone().digest(), base);
}

// ---- Sessions belong to identities (issue 24, step 2) ----

/// A session records the identity that opened it; only that identity may use it, except
/// that a proxy's batch may renew or acknowledge for a client's session (never for a
/// proxy's or a replica's, or under no identity). The owner survives a snapshot, and a
/// digest tells owners apart.
#[test]
fn a_session_is_usable_by_its_owner_and_a_proxy_batch_for_clients_only() {
    use super::Acting;
    let mut h = Harness::new();
    let owned_by = |h: &mut Harness, owner: &str| match h
        .apply(Command::CreateSession {
            owner: owner.into(),
        })
        .0
    {
        Ok(Reply::SessionCreated { session, .. }) => session,
        other => panic!("{other:?}"),
    };
    let alice = owned_by(&mut h, "lock://client/alice");
    let proxy = owned_by(&mut h, "lock://cell-a/proxy/p1");
    let as_ = |who: &str| Acting {
        identity: who.into(),
        proxy_batch: false,
        forwarded_by: None,
    };
    let batch = |who: &str| Acting {
        identity: who.into(),
        proxy_batch: true,
        forwarded_by: None,
    };
    assert!(h
        .sm
        .check_session_for(alice, &as_("lock://client/alice"))
        .is_ok());
    assert_eq!(
        h.sm.check_session_for(alice, &as_("lock://client/bob"))
            .unwrap_err(),
        Error::NotSessionOwner {
            session: alice,
            identity: "lock://client/bob".into()
        }
    );
    // No identity is nobody's owner, even where the owner string were empty.
    assert!(h.sm.check_session_for(alice, &as_("")).is_err());
    // A proxy's batch renews a client's session, not another proxy's own.
    assert!(h
        .sm
        .check_session_for(alice, &batch("lock://cell-a/proxy/p2"))
        .is_ok());
    assert!(h
        .sm
        .check_session_for(proxy, &batch("lock://cell-a/proxy/p2"))
        .is_err());
    assert!(h
        .sm
        .check_session_for(proxy, &as_("lock://cell-a/proxy/p1"))
        .is_ok());
    // An unknown or ended session gets the usual answer, not an owner's refusal.
    assert_eq!(
        h.sm.check_session_for(999, &as_("lock://client/alice"))
            .unwrap_err(),
        Error::UnknownSession { session: 999 }
    );
    // Through a snapshot (encoded and decoded as one is), the owner stays.
    let bytes = postcard::to_allocvec(&h.sm).unwrap();
    let restored: StateMachine = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(restored.digest(), h.sm.digest());
    assert!(restored
        .check_session_for(alice, &as_("lock://client/bob"))
        .is_err());
    assert!(restored
        .check_session_for(alice, &as_("lock://client/alice"))
        .is_ok());
    // Two cells alike but for one session's owner have different digests.
    let mut other = Harness::new();
    owned_by(&mut other, "lock://client/bob");
    owned_by(&mut other, "lock://cell-a/proxy/p1");
    assert_ne!(other.sm.digest(), h.sm.digest());
    h.apply(Command::CloseSession { session: alice }).0.unwrap();
    assert_eq!(
        h.sm.check_session_for(alice, &as_("lock://client/alice"))
            .unwrap_err(),
        Error::SessionExpired { session: alice }
    );
}

// ---- ACLs, groups and admins (issue 24, step 3) ----

mod acls {
    use super::*;
    use wire::acl::{Acl, Principal, Right};

    const API: &str = "lock://client/payments-api";
    const WORKER: &str = "lock://client/payments-worker";
    const OTHER: &str = "lock://client/search";

    fn p(s: &str) -> Principal {
        Principal::parse(s).unwrap()
    }

    /// A harness whose root only the admin may use.
    fn closed() -> Harness {
        Harness {
            sm: StateMachine::bootstrapped(&[ADMIN.to_string()], &Acl::admins_only()),
            index: 0,
            next_request: 1,
        }
    }

    fn session_of(h: &mut Harness, owner: &str) -> u64 {
        match h
            .apply(Command::CreateSession {
                owner: owner.into(),
            })
            .0
        {
            Ok(Reply::SessionCreated { session, .. }) => session,
            other => panic!("{other:?}"),
        }
    }

    fn set_acl(h: &mut Harness, by: &str, path: &str, acl: Acl) -> Result<Reply, Error> {
        h.apply(Command::SetAcl {
            by: by.into(),
            path: path.into(),
            acl,
        })
        .0
    }

    fn denied(path: &str, right: Right, identity: &str) -> Error {
        Error::Denied {
            path: path.into(),
            right,
            identity: identity.into(),
        }
    }

    /// "The payments team may lock under /payments and nobody else may": the admin
    /// makes /payments and gives the team's group read, create and write; the team
    /// takes locks (ephemeral sequential children) and releases them; anyone else is
    /// refused each step with a typed error that changes nothing.
    #[test]
    fn the_payments_team_locks_under_payments_and_nobody_else_may() {
        let mut h = closed();
        let admin = session_of(&mut h, ADMIN);
        let api = session_of(&mut h, API);
        let other = session_of(&mut h, OTHER);
        // Nobody but the admin may create under the closed root.
        assert_eq!(
            h.write(api, create("/payments", b"", false, false)),
            Err(denied("/", Right::Create, API))
        );
        assert!(h
            .write(admin, create("/payments", b"", false, false))
            .is_ok());
        assert_eq!(
            h.apply(Command::SetGroup {
                by: ADMIN.into(),
                name: "payments".into(),
                members: Some(vec![API.into(), WORKER.into()]),
            })
            .0,
            Ok(Reply::SecurityChanged { index: h.index })
        );
        let team = Acl {
            read: vec![p("group:payments")],
            write: vec![p("group:payments")],
            create: vec![p("group:payments")],
            admin: vec![],
        };
        assert!(set_acl(&mut h, ADMIN, "/payments", team.clone()).is_ok());
        // The team creates the lock's directory; it inherits /payments' ACL.
        assert!(h
            .write(api, create("/payments/lock", b"", false, false))
            .is_ok());
        assert_eq!(
            h.sm.acl_of("/payments/lock").unwrap(),
            &team.clone().canonical()
        );
        let before = h.sm.digest();
        let nodes_before = h.sm.nodes.clone();
        // Another identity cannot queue for the lock, write, delete or read.
        let lock = create("/payments/lock/l-", b"", true, true);
        assert_eq!(
            h.write(other, lock.clone()),
            Err(denied("/payments/lock", Right::Create, OTHER))
        );
        assert_eq!(
            h.write(other, set("/payments/lock", b"x", None)),
            Err(denied("/payments/lock", Right::Write, OTHER))
        );
        assert_eq!(
            h.write(other, del("/payments/lock", None)),
            Err(denied("/payments/lock", Right::Write, OTHER))
        );
        assert_eq!(
            h.sm.check_read(OTHER, "/payments/lock"),
            Err(denied("/payments/lock", Right::Read, OTHER))
        );
        // A denial is remembered like any answer (a retry gets it again), and the
        // namespace is as it was.
        assert_eq!(h.sm.nodes, nodes_before);
        assert_ne!(h.sm.digest(), before, "the denials are remembered");
        // A team member queues and holds; its node inherits the ACL (no write right
        // for the worker is needed to release: its own ephemeral).
        let worker = session_of(&mut h, WORKER);
        let held = match h.write(worker, lock.clone()) {
            Ok(Reply::Created { path, .. }) => path,
            other => panic!("{other:?}"),
        };
        assert!(h.sm.check_read(API, &held).is_ok());
        // Take the write right away from the team on the lock node: the holder still
        // releases its own ephemeral node, a team member may no longer delete it.
        let no_write = Acl {
            write: vec![],
            ..team.clone()
        };
        assert!(set_acl(&mut h, ADMIN, &held, no_write).is_ok());
        assert_eq!(
            h.write(api, del(&held, None)),
            Err(denied(&held, Right::Write, API))
        );
        assert_eq!(h.write(worker, del(&held, None)), Ok(Reply::Deleted));
        h.sm.assert_acl_counts();
    }

    /// A create inherits its parent's ACL as it is at the create; a later change of the
    /// parent's ACL does not reach existing children; a group's change reaches every
    /// node naming the group.
    #[test]
    fn rights_are_inherited_at_create_and_groups_apply_everywhere() {
        let mut h = open_harness();
        let s = session_of(&mut h, API);
        assert!(h.write(s, create("/a", b"", false, false)).is_ok());
        assert!(h.write(s, create("/a/old", b"", false, false)).is_ok());
        let only_api = Acl {
            read: vec![p("group:readers")],
            write: vec![p(API)],
            create: vec![p(API)],
            admin: vec![p(API)],
        };
        assert!(set_acl(&mut h, API, "/a", only_api.clone()).is_ok());
        assert!(h.write(s, create("/a/new", b"", false, false)).is_ok());
        assert_eq!(h.sm.acl_of("/a/old").unwrap(), &Acl::everyone());
        assert_eq!(
            h.sm.acl_of("/a/new").unwrap(),
            &only_api.clone().canonical()
        );
        // The group does not exist yet: WORKER may not read /a/new.
        assert!(h.sm.check_read(WORKER, "/a/new").is_err());
        assert!(h.sm.check_read(WORKER, "/a/old").is_ok());
        assert!(h
            .apply(Command::SetGroup {
                by: ADMIN.into(),
                name: "readers".into(),
                members: Some(vec![WORKER.into()]),
            })
            .0
            .is_ok());
        assert!(h.sm.check_read(WORKER, "/a/new").is_ok());
        assert!(h.sm.check_read(WORKER, "/a").is_ok());
        // Only an admin changes groups or admins.
        assert_eq!(
            h.apply(Command::SetGroup {
                by: API.into(),
                name: "readers".into(),
                members: None,
            })
            .0,
            Err(Error::NotAdmin {
                action: "change groups".into(),
                identity: API.into(),
            })
        );
        assert!(h
            .apply(Command::SetGroup {
                by: ADMIN.into(),
                name: "readers".into(),
                members: None,
            })
            .0
            .is_ok());
        assert!(h.sm.check_read(WORKER, "/a/new").is_err());
        h.sm.assert_acl_counts();
    }

    fn open_harness() -> Harness {
        Harness::new()
    }

    /// Only the admin right on a node changes its ACL (an admin may always); the last
    /// admin cannot be removed; a bad ACL or identity is refused and changes nothing.
    #[test]
    fn who_may_change_acls_groups_and_admins() {
        let mut h = closed();
        let admin = session_of(&mut h, ADMIN);
        assert!(h.write(admin, create("/x", b"", false, false)).is_ok());
        assert_eq!(
            set_acl(&mut h, API, "/x", Acl::everyone()),
            Err(denied("/x", Right::Admin, API))
        );
        assert_eq!(
            set_acl(&mut h, ADMIN, "/nope", Acl::everyone()),
            Err(Error::NoNode {
                path: "/nope".into()
            })
        );
        let bad = Acl {
            read: vec![Principal::Identity("nobody".into())],
            ..Acl::default()
        };
        assert!(matches!(
            set_acl(&mut h, ADMIN, "/x", bad),
            Err(Error::BadRequest { .. })
        ));
        let give_api_admin = Acl {
            admin: vec![p(API)],
            ..Acl::default()
        };
        assert!(set_acl(&mut h, ADMIN, "/x", give_api_admin).is_ok());
        assert!(set_acl(&mut h, API, "/x", Acl::everyone()).is_ok());
        // Admins.
        let last = h
            .apply(Command::SetAdmin {
                by: ADMIN.into(),
                identity: ADMIN.into(),
                admin: false,
            })
            .0;
        assert!(
            matches!(&last, Err(Error::BadRequest { reason }) if reason.contains("last admin")),
            "{last:?}"
        );
        assert!(matches!(
            h.apply(Command::SetAdmin {
                by: API.into(),
                identity: API.into(),
                admin: true,
            })
            .0,
            Err(Error::NotAdmin { .. })
        ));
        for (identity, admin) in [(API, true), (ADMIN, false)] {
            assert!(h
                .apply(Command::SetAdmin {
                    by: ADMIN.into(),
                    identity: identity.into(),
                    admin,
                })
                .0
                .is_ok());
        }
        assert!(h.sm.security().is_admin(API) && !h.sm.security().is_admin(ADMIN));
        let api = session_of(&mut h, API);
        assert!(h.write(api, create("/by-api", b"", false, false)).is_ok());
        h.sm.assert_acl_counts();
    }

    /// Before the bootstrap entry nothing that needs an ACL is decided: a write answers
    /// `Unavailable` and is not remembered (its retry after the bootstrap applies); a
    /// second bootstrap changes nothing.
    #[test]
    fn nothing_is_decided_before_the_bootstrap_and_it_applies_once() {
        let mut sm = StateMachine::new();
        let (r, _) = sm.apply(1, &Command::CreateSession { owner: API.into() });
        let Ok(Reply::SessionCreated { session, .. }) = r else {
            panic!("{r:?}")
        };
        let w = Command::Write {
            session,
            request_id: 1,
            ack_below: 0,
            ops: vec![create("/a", b"", false, false)],
            single: true,
        };
        assert!(matches!(sm.apply(2, &w).0, Err(Error::Unavailable { .. })));
        assert!(matches!(
            sm.check_read(API, "/"),
            Err(Error::Unavailable { .. })
        ));
        let boot = Command::Bootstrap {
            admins: vec![ADMIN.into()],
            root_acl: Acl::everyone(),
        };
        assert!(sm.apply(3, &boot).0.is_ok());
        assert!(matches!(sm.apply(4, &w).0, Ok(Reply::Created { .. })));
        let digest = sm.digest();
        let other = Command::Bootstrap {
            admins: vec![API.into()],
            root_acl: Acl::admins_only(),
        };
        assert!(sm.apply(5, &other).0.is_ok());
        let mut expected = sm.clone();
        expected.last_index = 4;
        assert_eq!(
            expected.digest(),
            digest,
            "a second bootstrap changed the state"
        );
        assert!(sm.security().is_admin(ADMIN) && !sm.security().is_admin(API));
        // A bootstrap with a bad admin changes nothing and leaves the cell waiting.
        let mut fresh = StateMachine::new();
        let bad = Command::Bootstrap {
            admins: vec!["admin".into()],
            root_acl: Acl::everyone(),
        };
        assert!(matches!(
            fresh.apply(1, &bad).0,
            Err(Error::BadRequest { .. })
        ));
        assert!(!fresh.security().bootstrapped());
    }

    /// A transaction denied part-way rolls back whole, ACL counts included; ACLs,
    /// groups and admins survive a snapshot (the state's encoding) byte for byte.
    #[test]
    fn a_denied_transaction_rolls_back_and_acls_survive_a_snapshot() {
        let mut h = open_harness();
        let s = session_of(&mut h, API);
        assert!(h.write(s, create("/open", b"", false, false)).is_ok());
        assert!(h.write(s, create("/shut", b"", false, false)).is_ok());
        assert!(set_acl(
            &mut h,
            API,
            "/shut",
            Acl {
                read: vec![p(API)],
                ..Acl::default()
            }
        )
        .is_ok());
        let nodes = h.sm.nodes.clone();
        let counts = h.sm.security().counts();
        h.index += 1;
        let (r, effects) = h.sm.apply(
            h.index,
            &Command::Write {
                session: s,
                request_id: 99,
                ack_below: 0,
                ops: vec![
                    create("/open/a", b"", false, false),
                    create("/open/b", b"", true, false),
                    del("/open/a", None),
                    create("/shut/c", b"", false, false),
                ],
                single: false,
            },
        );
        assert_eq!(
            r,
            Err(Error::TxnFailed {
                index: 3,
                error: Box::new(denied("/shut", Right::Create, API)),
            })
        );
        assert!(effects.is_empty());
        assert_eq!(h.sm.nodes, nodes);
        assert_eq!(h.sm.security().counts(), counts);
        assert!(h.sm.session(s).unwrap().ephemerals.is_empty());
        h.sm.assert_acl_counts();
        // Through a snapshot.
        assert!(h
            .apply(Command::SetGroup {
                by: ADMIN.into(),
                name: "g".into(),
                members: Some(vec![WORKER.into()]),
            })
            .0
            .is_ok());
        let bytes = postcard::to_allocvec(&h.sm).unwrap();
        let back: StateMachine = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, h.sm);
        assert_eq!(back.digest(), h.sm.digest());
        assert_eq!(back.acl_of("/shut").unwrap(), h.sm.acl_of("/shut").unwrap());
        assert!(back.check_read(WORKER, "/shut").is_err());
        assert!(back.check_read(API, "/shut").is_ok());
        // The digest tells ACLs apart.
        let mut other = h.sm.clone();
        assert!(other
            .apply(
                h.index + 1,
                &Command::SetAcl {
                    by: ADMIN.into(),
                    path: "/open".into(),
                    acl: Acl::admins_only(),
                },
            )
            .0
            .is_ok());
        other.last_index = h.sm.last_index;
        assert_ne!(other.digest(), h.sm.digest());
    }

    /// Sessions are counted per owner (the limits per identity read the count) through
    /// opens, closes and expiries.
    #[test]
    fn sessions_are_counted_per_owner() {
        let mut h = open_harness();
        let a: Vec<u64> = (0..3).map(|_| session_of(&mut h, API)).collect();
        let b = session_of(&mut h, WORKER);
        assert_eq!((h.sm.sessions_of(API), h.sm.sessions_of(WORKER)), (3, 1));
        assert!(h.apply(Command::CloseSession { session: a[0] }).0.is_ok());
        assert!(h
            .apply(Command::ExpireSessions {
                sessions: vec![a[1], b],
            })
            .0
            .is_ok());
        assert_eq!((h.sm.sessions_of(API), h.sm.sessions_of(WORKER)), (1, 0));
        h.sm.assert_acl_counts();
    }

    #[derive(Debug, Clone)]
    enum AclAction {
        Create(u8, bool),
        Delete(u8),
        SetAcl(u8, u8),
        Txn(Vec<(u8, bool)>),
    }

    fn acl_action() -> impl Strategy<Value = AclAction> {
        prop_oneof![
            (0u8..12, any::<bool>()).prop_map(|(n, e)| AclAction::Create(n, e)),
            (0u8..12).prop_map(AclAction::Delete),
            (0u8..12, 0u8..4).prop_map(|(n, a)| AclAction::SetAcl(n, a)),
            proptest::collection::vec((0u8..12, any::<bool>()), 1..5).prop_map(AclAction::Txn),
        ]
    }

    /// Nodes `/n0`..`/n3` at the top, the rest under them: `/n{k%4}/n{k}`.
    fn node_path(k: u8) -> String {
        if k < 4 {
            format!("/n{k}")
        } else {
            format!("/n{}/n{k}", k % 4)
        }
    }

    fn acl_choice(a: u8) -> Acl {
        match a {
            0 => Acl::everyone(),
            1 => Acl::admins_only(),
            2 => Acl {
                read: vec![p(API)],
                create: vec![p(API)],
                ..Acl::default()
            },
            _ => Acl {
                write: vec![p("group:g")],
                create: vec![p("lock://client/payments-*")],
                ..Acl::default()
            },
        }
    }

    proptest! {
        /// Over random creates, deletes, ACL changes and transactions (some denied,
        /// some failing part-way), the ACL table counts exactly the nodes using each
        /// ACL, an ACL no node uses is gone, and a write is allowed exactly when the
        /// ACL of its node (or parent) in the state it applies to grants it.
        #[test]
        fn the_acl_table_counts_its_nodes_and_every_write_obeys_the_acl_it_met(
            actions in proptest::collection::vec(acl_action(), 1..60)
        ) {
            let mut h = open_harness();
            let s = session_of(&mut h, API);
            for a in actions {
                match a {
                    AclAction::Create(k, eph) => {
                        let path = node_path(k);
                        let parent = wire::path::parent(&path).to_string();
                        let allowed = h.sm.node(&parent).map(|n| {
                            h.sm.security().allows(n.acl, Right::Create, API)
                        });
                        let op = create(&path, b"", eph, false);
                        let pre = h.sm.precheck_write(API, s, std::slice::from_ref(&op), true);
                        let r = h.write(s, op);
                        if pre.is_err() {
                            prop_assert_eq!(&r, &pre.map(|_| Reply::Closed), "the gateway refused what apply would not");
                        }
                        if allowed == Some(false) {
                            prop_assert_eq!(r, Err(denied(&parent, Right::Create, API)));
                        } else if r.is_ok() {
                            prop_assert_eq!(allowed, Some(true));
                            prop_assert_eq!(
                                h.sm.node(&path).unwrap().acl,
                                h.sm.node(&parent).unwrap().acl
                            );
                        }
                    }
                    AclAction::Delete(k) => {
                        let path = node_path(k);
                        let own = h.sm.node(&path).is_some_and(|n| n.ephemeral_owner == Some(s));
                        let allowed = h.sm.node(&path).map(|n| {
                            own || h.sm.security().allows(n.acl, Right::Write, API)
                        });
                        let op = del(&path, None);
                        let pre = h.sm.precheck_write(API, s, std::slice::from_ref(&op), true);
                        let r = h.write(s, op);
                        if pre.is_err() {
                            prop_assert_eq!(&r, &pre.map(|_| Reply::Closed), "the gateway refused what apply would not");
                        }
                        if allowed == Some(false) {
                            prop_assert_eq!(r, Err(denied(&path, Right::Write, API)));
                        } else if r.is_ok() {
                            prop_assert_eq!(allowed, Some(true));
                        }
                    }
                    AclAction::SetAcl(k, a) => {
                        let _ = set_acl(&mut h, ADMIN, &node_path(k), acl_choice(a));
                    }
                    AclAction::Txn(ops) => {
                        let before = (h.sm.nodes.clone(), h.sm.security().counts());
                        let ops: Vec<TxnOp> = ops
                            .into_iter()
                            .map(|(k, c)| {
                                if c {
                                    create(&node_path(k), b"", false, false)
                                } else {
                                    del(&node_path(k), None)
                                }
                            })
                            .collect();
                        let pre = h.sm.precheck_write(API, s, &ops, false);
                        h.index += 1;
                        let request_id = h.next_request;
                        h.next_request += 1;
                        let (r, _) = h.sm.apply(
                            h.index,
                            &Command::Write {
                                session: s,
                                request_id,
                                ack_below: 0,
                                ops,
                                single: false,
                            },
                        );
                        if pre.is_err() {
                            // Refused early, it is refused at apply too (perhaps for an
                            // earlier op's other fault), and changes nothing.
                            prop_assert!(r.is_err(), "the gateway refused what apply took: {:?}", pre);
                        }
                        if r.is_err() {
                            prop_assert_eq!(&h.sm.nodes, &before.0);
                            prop_assert_eq!(h.sm.security().counts(), before.1);
                        }
                    }
                }
                h.sm.assert_acl_counts();
                prop_assert!(h.sm.security().counts().values().all(|n| *n > 0));
            }
        }
    }
}

/// Prefixes, moves and tokens across them (issue 25).
mod prefixes {
    use super::*;
    use wire::directory::{ExportedNode, PrefixState};

    fn set_prefix(
        h: &mut Harness,
        by: &str,
        prefix: &str,
        epoch: u64,
        state: PrefixState,
    ) -> Result<Reply, Error> {
        h.apply(Command::SetPrefix {
            by: by.into(),
            prefix: prefix.into(),
            epoch,
            state,
        })
        .0
    }

    /// A write that acknowledges every earlier answer (many writes from one session).
    fn w(h: &mut Harness, session: u64, op: TxnOp) -> Result<Reply, Error> {
        let request_id = h.next_request;
        h.next_request += 1;
        h.apply(Command::Write {
            session,
            request_id,
            ack_below: request_id,
            ops: vec![op],
            single: true,
        })
        .0
    }

    fn token_of(r: Result<Reply, Error>) -> u64 {
        match r {
            Ok(Reply::Created { stat, .. }) => stat.token,
            other => panic!("{other:?}"),
        }
    }

    /// A cell with no prefix recorded serves every path; once it owns one it refuses
    /// the others with `WrongCell`, not remembered, so the same request id applies once
    /// the cell owns the prefix after all. Only admins change prefixes, and only along
    /// the moves' transitions.
    #[test]
    fn a_cell_serves_what_it_owns_and_refuses_the_rest() {
        let mut h = Harness::new();
        let s = h.session();
        assert!(h.write(s, create("/other", b"", false, false)).is_ok());
        assert!(matches!(
            set_prefix(&mut h, "lock://client/test", "/pay", 0, PrefixState::Owned),
            Err(Error::NotAdmin { .. })
        ));
        set_prefix(&mut h, ADMIN, "/pay", 0, PrefixState::Owned).unwrap();
        assert!(h.write(s, create("/pay", b"", false, false)).is_ok());
        let before = h.sm.nodes.clone();
        assert_eq!(
            h.write_id(s, 100, set("/other", b"x", None)),
            Err(Error::WrongCell {
                prefix: "/other".into(),
                epoch: 0
            })
        );
        assert_eq!(
            h.sm.check_read("lock://client/test", "/other/a"),
            Err(Error::WrongCell {
                prefix: "/other".into(),
                epoch: 0
            })
        );
        assert!(h.sm.check_read("lock://client/test", "/").is_ok());
        assert_eq!(h.sm.nodes, before, "nothing changed");
        set_prefix(&mut h, ADMIN, "/other", 0, PrefixState::Owned).unwrap();
        assert!(matches!(
            h.write_id(s, 100, set("/other", b"x", None)),
            Ok(Reply::Set { .. })
        ));
        // Transitions a move never makes.
        for (epoch, to) in [
            (1, PrefixState::Owned),
            (0, PrefixState::Gone),
            (0, PrefixState::Importing),
        ] {
            assert!(
                matches!(
                    set_prefix(&mut h, ADMIN, "/pay", epoch, to),
                    Err(Error::BadRequest { .. })
                ),
                "{epoch} {to}"
            );
        }
        // Setting what is recorded again is fine (a re-run).
        set_prefix(&mut h, ADMIN, "/pay", 0, PrefixState::Owned).unwrap();
        assert!(matches!(
            set_prefix(&mut h, ADMIN, "/a/b", 0, PrefixState::Owned),
            Err(Error::BadRequest { .. })
        ));
    }

    /// Frozen: reads served, not cachable; writes refused with `Frozen` and not
    /// remembered (the same request id applies after the freeze is lifted); a write
    /// applied before the freeze, retried, still gets its first answer.
    #[test]
    fn a_frozen_prefix_reads_but_does_not_write() {
        let mut h = Harness::new();
        let s = h.session();
        set_prefix(&mut h, ADMIN, "/pay", 0, PrefixState::Owned).unwrap();
        h.write(s, create("/pay", b"", false, false)).unwrap();
        let first = h.write_id(s, 50, create("/pay/a", b"1", false, false));
        assert!(first.is_ok());
        assert!(h.sm.cachable("/pay/a"));
        set_prefix(&mut h, ADMIN, "/pay", 0, PrefixState::Frozen).unwrap();
        assert!(!h.sm.cachable("/pay/a") && !h.sm.cachable("/pay"));
        assert!(h.sm.check_read("lock://client/test", "/pay/a").is_ok());
        assert_eq!(
            h.write_id(s, 50, create("/pay/a", b"1", false, false)),
            first
        );
        let frozen = Err(Error::Frozen {
            prefix: "/pay".into(),
            epoch: 0,
        });
        let d = h.sm.clone();
        assert_eq!(h.write_id(s, 51, set("/pay/a", b"2", None)), frozen);
        assert_eq!(h.sm.nodes, d.nodes, "nothing changed");
        assert!(frozen.clone().unwrap_err().is_retryable());
        set_prefix(&mut h, ADMIN, "/pay", 0, PrefixState::Owned).unwrap();
        assert!(matches!(
            h.write_id(s, 51, set("/pay/a", b"2", None)),
            Ok(Reply::Set { .. })
        ));
    }

    /// A whole move between two states: freeze, export in pages, import, hand over,
    /// drop. The copy keeps data, versions, ACLs, sequence counters and tokens; the new
    /// cell's first grant has a higher token than any the old cell made; the old cell
    /// answers `WrongCell` at the new epoch and holds no node of the prefix, its sessions
    /// none of their ephemerals there; a copy interrupted and started again ends alike.
    #[test]
    fn a_prefix_moves_with_its_data_and_tokens_only_grow() {
        let mut a = Harness::new();
        let mut b = Harness::new();
        // B's log is far behind A's: tokens must still grow across the move.
        let sa = a.session();
        set_prefix(&mut a, ADMIN, "/pay", 0, PrefixState::Owned).unwrap();
        w(&mut a, sa, create("/pay", b"root", false, false)).unwrap();
        w(&mut a, sa, create("/pay/locks", b"", false, false)).unwrap();
        let mut last_old = 0;
        for i in 0..30 {
            last_old = token_of(w(&mut a, sa, create("/pay/locks/lock-", b"", false, true)));
            w(
                &mut a,
                sa,
                create(&format!("/pay/cfg{i:02}"), &[i as u8; 100], false, false),
            )
            .unwrap();
            w(&mut a, sa, set(&format!("/pay/cfg{i:02}"), b"v2", None)).unwrap();
        }
        for i in 0..30 {
            w(&mut a, sa, del(&format!("/pay/locks/lock-{i:010}"), None)).unwrap();
        }
        let eph = w(&mut a, sa, create("/pay/locks/lock-", b"", true, true));
        last_old = last_old.max(token_of(eph));
        let acl = wire::acl::Acl::everyone();
        a.apply(Command::SetAcl {
            by: ADMIN.into(),
            path: "/pay/cfg03".into(),
            acl: acl.clone(),
        })
        .0
        .unwrap();
        set_prefix(&mut a, ADMIN, "/pay", 0, PrefixState::Frozen).unwrap();

        let mut pages = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let (nodes, more) = a.sm.export("/pay", after.as_deref(), 1000);
            assert!(!nodes.is_empty());
            after = nodes.last().map(|n| n.path.clone());
            pages.push(nodes);
            if !more {
                break;
            }
        }
        assert!(pages.len() > 2, "{} pages", pages.len());
        let exported: Vec<ExportedNode> = pages.iter().flatten().cloned().collect();
        assert!(
            exported.iter().all(|n| !n.path.contains("lock-")),
            "ephemerals are not copied"
        );
        assert_eq!(exported.len(), 32);

        let import = |h: &mut Harness, first: bool, nodes: Vec<ExportedNode>| {
            h.apply(Command::ImportPrefix {
                by: ADMIN.into(),
                prefix: "/pay".into(),
                epoch: 1,
                first,
                nodes,
            })
            .0
        };
        // Not before it is importing.
        assert!(matches!(
            import(&mut b, true, pages[0].clone()),
            Err(Error::BadRequest { .. })
        ));
        set_prefix(&mut b, ADMIN, "/pay", 1, PrefixState::Importing).unwrap();
        // A first attempt, interrupted after two pages, then a whole copy.
        import(&mut b, true, pages[0].clone()).unwrap();
        import(&mut b, false, pages[1].clone()).unwrap();
        let sb = b.session();
        assert_eq!(
            w(&mut b, sb, set("/pay/cfg00", b"x", None)),
            Err(Error::WrongCell {
                prefix: "/pay".into(),
                epoch: 1
            })
        );
        for (i, p) in pages.iter().enumerate() {
            import(&mut b, i == 0, p.clone()).unwrap();
        }
        set_prefix(&mut b, ADMIN, "/pay", 1, PrefixState::Owned).unwrap();
        let (copied, more) = b.sm.export("/pay", None, usize::MAX);
        assert!(!more);
        assert_eq!(
            copied, exported,
            "data, versions, ACLs, counters and tokens kept"
        );
        b.sm.assert_acl_counts();

        // The new cell's first grant is above every token of the old one; the names of
        // sequential children go on.
        let created = w(&mut b, sb, create("/pay/locks/lock-", b"", true, true));
        let Ok(Reply::Created { path, stat, .. }) = created else {
            panic!("{created:?}")
        };
        assert_eq!(path, "/pay/locks/lock-0000000031");
        assert!(stat.token > last_old, "{} <= {last_old}", stat.token);
        assert_eq!(wire::directory::token_epoch(stat.token), 1);
        // And a CAS on a copied node sees the copied version.
        assert!(matches!(
            w(&mut b, sb, set("/pay/cfg05", b"v3", Some(1))),
            Ok(Reply::Set { .. })
        ));

        // The old cell lets go: its locks end at the hand-over.
        let lock = "/pay/locks/lock-0000000030";
        assert!(a.sm.sequencer_current(lock, last_old, sa));
        let (r, effects) = a.apply(Command::SetPrefix {
            by: ADMIN.into(),
            prefix: "/pay".into(),
            epoch: 1,
            state: PrefixState::Gone,
        });
        r.unwrap();
        assert!(effects.contains(&Effect::Deleted { path: lock.into() }));
        assert!(a.sm.session(sa).unwrap().ephemerals.is_empty());
        assert!(!a.sm.sequencer_current(lock, last_old, sa));
        assert_eq!(
            w(&mut a, sa, set("/pay/cfg00", b"late", None)),
            Err(Error::WrongCell {
                prefix: "/pay".into(),
                epoch: 1
            })
        );
        assert!(a.sm.check_read("lock://client/test", "/pay/cfg00").is_err());
        let (_, effects) = a.apply(Command::DropPrefix {
            by: ADMIN.into(),
            prefix: "/pay".into(),
            epoch: 1,
        });
        assert!(effects.contains(&Effect::Deleted {
            path: "/pay/cfg00".into()
        }));
        assert!(a.sm.subtree_paths("/pay").is_empty());
        a.sm.assert_acl_counts();
        // The session goes on and ends cleanly.
        a.apply(Command::CloseSession { session: sa }).0.unwrap();
        // Dropping again changes nothing and succeeds; dropping an owned prefix is refused.
        a.apply(Command::DropPrefix {
            by: ADMIN.into(),
            prefix: "/pay".into(),
            epoch: 1,
        })
        .0
        .unwrap();
        assert!(matches!(
            b.apply(Command::DropPrefix {
                by: ADMIN.into(),
                prefix: "/pay".into(),
                epoch: 1
            })
            .0,
            Err(Error::BadRequest { .. })
        ));
        // The state survives a snapshot round trip.
        let bytes = postcard::to_allocvec(&b.sm).unwrap();
        let back: StateMachine = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, b.sm);
    }
}

mod prefix_refusals {
    use super::*;
    use wire::directory::{ExportedNode, PrefixState};

    fn node(path: &str, token: u64) -> ExportedNode {
        ExportedNode {
            path: path.into(),
            data: b"d".to_vec(),
            version: 0,
            children_version: 0,
            sequence_next: 0,
            token,
            acl: wire::acl::Acl::everyone(),
        }
    }

    fn cmd(prefix: &str, epoch: u64, state: PrefixState) -> Command {
        Command::SetPrefix {
            by: ADMIN.into(),
            prefix: prefix.into(),
            epoch,
            state,
        }
    }

    fn import(first: bool, nodes: Vec<ExportedNode>) -> Command {
        Command::ImportPrefix {
            by: ADMIN.into(),
            prefix: "/pay".into(),
            epoch: 1,
            first,
            nodes,
        }
    }

    /// An import never lands a node without its persistent parent, never over an
    /// ephemeral node, and never with a token of its own epoch or later; refused whole,
    /// nothing changed.
    #[test]
    fn an_import_refuses_what_would_orphan_overwrite_an_ephemeral_or_repeat_a_token() {
        let mut h = Harness::new();
        let s = h.session();
        h.write(s, create("/pay", b"", false, false)).unwrap();
        h.write(s, create("/pay/e", b"", true, false)).unwrap();
        h.apply(cmd("/pay", 1, PrefixState::Importing)).0.unwrap();
        let before = h.sm.clone();
        for (first, nodes) in [
            (false, vec![node("/pay/e", 5)]),
            (false, vec![node("/pay/e/x", 5)]),
            (true, vec![node("/pay/a/b", 5)]),
            (true, vec![node("/pay", 5), node("/pay/a/b", 6)]),
            (
                true,
                vec![node("/pay", 1 << wire::directory::TOKEN_SEQUENCE_BITS)],
            ),
            (true, vec![node("/pay", 3), node("/other", 4)]),
        ] {
            let r = h.apply(import(first, nodes.clone())).0;
            assert!(
                matches!(r, Err(Error::BadRequest { .. })),
                "{nodes:?}: {r:?}"
            );
            assert_eq!(h.sm.nodes, before.nodes);
            assert_eq!(h.sm.sessions, before.sessions);
        }
        // A first page drops what was there, the ephemeral node with its session's
        // record of it.
        h.apply(import(true, vec![node("/pay", 3), node("/pay/a", 4)]))
            .0
            .unwrap();
        assert!(h.sm.node("/pay/e").is_none());
        assert!(h.sm.session(s).unwrap().ephemerals.is_empty());
        h.sm.assert_acl_counts();
    }

    /// A sequential create under the root is judged by the node's name; an ACL is not
    /// changed under a frozen prefix (the move's copy would lose it).
    #[test]
    fn sequential_names_at_the_root_and_acls_follow_ownership() {
        let mut h = Harness::new();
        let s = h.session();
        h.write(s, create("/pay", b"", false, false)).unwrap();
        h.apply(cmd("/pay", 0, PrefixState::Owned)).0.unwrap();
        h.apply(cmd("/lock-", 0, PrefixState::Owned)).0.unwrap();
        assert_eq!(
            h.write(s, create("/lock-", b"", false, true)),
            Err(Error::WrongCell {
                prefix: "/lock-0000000000".into(),
                epoch: 0
            })
        );
        h.apply(cmd("/pay", 0, PrefixState::Frozen)).0.unwrap();
        let r = h
            .apply(Command::SetAcl {
                by: ADMIN.into(),
                path: "/pay".into(),
                acl: wire::acl::Acl::everyone(),
            })
            .0;
        assert_eq!(
            r,
            Err(Error::Frozen {
                prefix: "/pay".into(),
                epoch: 0
            })
        );
    }
}

// ---- Fencing tokens: one per create, growing in apply order ----

/// One command of a token history.
#[derive(Debug, Clone)]
enum TokenOp {
    /// A lock contender: a sequential ephemeral child of `/lock{0}` by session `{1}`.
    Contend(usize, usize),
    /// A transaction of `{1}` sequential creates, alternately under `/lock{0}` and
    /// `/data`, failing at its end (a check of a node that is not there) if `{2}`.
    Txn(usize, usize, bool),
    /// Session `{1}` releases its oldest node under `/lock{0}`.
    Release(usize, usize),
    /// An earlier write sent again with its request id.
    Retry(usize),
    /// A new session.
    Session,
}

fn token_op() -> impl Strategy<Value = TokenOp> {
    prop_oneof![
        6 => (0..2usize, 0..4usize).prop_map(|(l, s)| TokenOp::Contend(l, s)),
        2 => (0..2usize, 1..6usize, any::<bool>()).prop_map(|(l, n, f)| TokenOp::Txn(l, n, f)),
        3 => (0..2usize, 0..4usize).prop_map(|(l, s)| TokenOp::Release(l, s)),
        1 => (0..64usize).prop_map(TokenOp::Retry),
        1 => Just(TokenOp::Session),
    ]
}

/// A replica applying a token history, and what the checks remember.
struct TokenRun {
    sm: StateMachine,
    index: u64,
    sessions: Vec<SessionId>,
    /// The highest token any create got so far.
    last: u64,
    /// Every node ever created, with its token.
    token_of: BTreeMap<String, u64>,
}

impl TokenRun {
    /// Applies `cmds` as one entry and checks every create in it.
    fn entry(&mut self, cmds: &[Command]) -> Result<(), TestCaseError> {
        self.index += 1;
        let at = self.index;
        let (answers, _) = self.sm.apply_batch_in_term(at, 0, cmds);
        let mut created: Vec<(String, u64, Option<String>)> = Vec::new();
        for a in &answers {
            match a {
                Ok(Reply::SessionCreated { session, .. }) => self.sessions.push(*session),
                Ok(Reply::Created {
                    path,
                    stat,
                    predecessor,
                }) => {
                    let parent = wire::path::parent(path);
                    let pred = predecessor
                        .as_ref()
                        .map(|p| wire::path::join(parent, &p.name));
                    created.push((path.clone(), stat.token, pred));
                }
                Ok(Reply::Txn { results }) => {
                    for r in results {
                        if let TxnResult::Created { path, stat } = r {
                            created.push((path.clone(), stat.token, None));
                        }
                    }
                }
                _ => {}
            }
        }
        for (path, token, pred) in created {
            if let Some(first) = self.token_of.get(&path) {
                // A retried create: its first answer again.
                prop_assert_eq!(*first, token, "{} answered another token", path);
                continue;
            }
            prop_assert!(
                token > self.last,
                "{} got token {} after {}",
                path,
                token,
                self.last
            );
            prop_assert_eq!(wire::directory::token_index(token), at);
            self.last = token;
            self.token_of.insert(path.clone(), token);
            if let Some(pred) = pred {
                let below = self.token_of.get(&pred).copied();
                prop_assert!(
                    below.is_some_and(|b| b < token),
                    "{}'s predecessor {} has token {:?}, not below {}",
                    path,
                    pred,
                    below,
                    token
                );
            }
        }
        // Every lock's children, in queue order, have increasing tokens.
        for lock in ["/lock0", "/lock1"] {
            if self.sm.node(lock).is_none() {
                // Not created yet (the entries that set the history up).
                continue;
            }
            let Ok(Reply::Children { children, .. }) = self.sm.children(lock) else {
                panic!("children of {lock}")
            };
            // Queue order: by sequence number, whatever the name before it.
            let mut names: Vec<&String> = children.iter().map(|(n, _)| n).collect();
            names.sort_by_key(|n| super::sequence_of(n));
            let tokens: Vec<u64> = names
                .iter()
                .map(|n| self.sm.node(&wire::path::join(lock, n)).unwrap().token)
                .collect();
            prop_assert!(
                tokens.windows(2).all(|w| w[0] < w[1]),
                "{} in queue order: {:?} {:?}",
                lock,
                names,
                tokens
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Issue 27, item 1: over random batches (lock contenders under one parent sharing
    /// entries, transactions of several creates, failed ones, releases, retries, new
    /// sessions), every create gets a token of its own: the tokens of the creates as they
    /// apply strictly increase (so none repeats), each carries its entry's index, a
    /// waiter's predecessor always has the lower token, and a lock's children in queue
    /// (sequence) order have increasing tokens after every entry. A retried create answers its first
    /// token again.
    #[test]
    fn every_create_gets_its_own_token_growing_in_apply_order(
        ops in proptest::collection::vec((token_op(), 1..8usize), 1..80),
    ) {
        let mut run = TokenRun {
            sm: open_state(),
            index: 0,
            sessions: Vec::new(),
            last: 0,
            token_of: BTreeMap::new(),
        };
        run.entry(&vec![Command::CreateSession { owner: "lock://client/test".into() }; 4])?;
        let boot = run.sessions[0];
        let parents = ["/lock0", "/lock1", "/data"];
        let skeleton: Vec<Command> = parents
            .iter()
            .enumerate()
            .map(|(i, p)| write_cmd(boot, i as u64 + 1, create(p, b"", false, false)))
            .collect();
        run.entry(&skeleton)?;
        let mut sent: Vec<Command> = Vec::new();
        let mut pending: Vec<Command> = Vec::new();
        let mut rule = BatchRule::default();
        // Request ids after the skeleton's.
        for (req, (op, batch)) in (parents.len() as u64 + 1..).zip(ops) {
            let session = |s: usize| run.sessions[s % run.sessions.len()];
            let cmd = match op {
                TokenOp::Contend(l, s) => write_cmd(session(s), req, create(&format!("/lock{l}/c-"), b"", true, true)),
                TokenOp::Txn(l, n, fail) => {
                    let mut ops: Vec<TxnOp> = (0..n)
                        .map(|j| if j % 2 == 0 {
                            create(&format!("/lock{l}/t-"), b"", false, true)
                        } else {
                            create("/data/d-", b"", false, true)
                        })
                        .collect();
                    if fail {
                        ops.push(TxnOp::Check { path: "/absent".into(), version: None });
                    }
                    Command::Write { session: boot, request_id: req, ack_below: 0, ops, single: false }
                }
                TokenOp::Release(l, s) => {
                    let owner = session(s);
                    let parent = format!("/lock{l}");
                    let Ok(Reply::Children { children, .. }) = run.sm.children(&parent) else { panic!() };
                    let mut names: Vec<String> = children.into_iter().map(|(n, _)| n).collect();
                    names.sort();
                    match names
                        .into_iter()
                        .map(|n| format!("{parent}/{n}"))
                        .find(|p| run.sm.node(p).is_some_and(|n| n.ephemeral_owner == Some(owner)))
                    {
                        Some(p) => write_cmd(owner, req, del(&p, None)),
                        None => continue,
                    }
                }
                TokenOp::Retry(i) => match sent.get(i % sent.len().max(1)) {
                    Some(c) => c.clone(),
                    None => continue,
                },
                TokenOp::Session => Command::CreateSession { owner: "lock://client/test".into() },
            };
            if pending.len() >= batch || !rule.admit(&cmd) {
                run.entry(&std::mem::take(&mut pending))?;
                rule = BatchRule::default();
                prop_assert!(rule.admit(&cmd), "an empty entry admits {:?}", cmd);
            }
            if matches!(cmd, Command::Write { .. }) {
                sent.push(cmd.clone());
            }
            pending.push(cmd);
        }
        if !pending.is_empty() {
            run.entry(&pending)?;
        }
    }
}

/// The persistent maps encode exactly as the `BTreeMap`s and `BTreeSet` they replaced
/// (postcard: a length, then the entries in order), so snapshot files (`LKSNAP4`) written
/// before still load.
#[test]
fn the_persistent_maps_encode_as_the_standard_ones() {
    let std_map: BTreeMap<String, u64> = [("/a".to_string(), 1), ("/b/c".to_string(), 2)].into();
    let p_map: imbl::OrdMap<String, u64> = std_map.clone().into_iter().collect();
    assert_eq!(
        postcard::to_allocvec(&std_map).unwrap(),
        postcard::to_allocvec(&p_map).unwrap()
    );
    let std_set: std::collections::BTreeSet<u64> = [3, 1, 2].into();
    let p_set: imbl::OrdSet<u64> = std_set.iter().copied().collect();
    assert_eq!(
        postcard::to_allocvec(&std_set).unwrap(),
        postcard::to_allocvec(&p_set).unwrap()
    );
    let back: imbl::OrdMap<String, u64> =
        postcard::from_bytes(&postcard::to_allocvec(&std_map).unwrap()).unwrap();
    assert_eq!(back, p_map);
}
