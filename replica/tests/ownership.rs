//! Sessions belong to identities (issue 24, second step; docs/security.md, "Sessions
//! belong to identities"), at real replica processes: a client certificate of another
//! identity, from the cell's own CA, cannot renew, close, acknowledge for, write under,
//! watch under, cache under or read the event stream of a session it did not open; each
//! attempt is `NotSessionOwner` and changes nothing (same state digest). After the leader
//! is killed, the new leader refuses the same (the owner is replicated state), and the
//! owner's session, its ephemeral node and its own requests go on. A session id used
//! before it is issued (ids are predictable) is unknown then, and refused once its owner
//! opened it.

mod common;

use std::time::Duration;

use client_sdk::{Client, CreateMode};
use common::{rt, serial, Opts, TestCell};
use wire::types::{Op, Reply, Request, SessionId, TxnOp};
use wire::Error;

fn req(session: SessionId, request_id: u64, op: Op) -> Request {
    Request {
        session,
        request_id,
        ack_below: 0,
        op,
    }
}

/// Everything a session is used for, tried by `mallory` on `victim`'s session: each must
/// be refused as not its own.
async fn try_everything(mallory: &Client, victim: SessionId, first_id: u64) {
    let tries: Vec<(&str, Op)> = vec![
        ("KeepAlive", Op::KeepAlive),
        (
            "KeepAliveBatch",
            Op::KeepAliveBatch {
                sessions: vec![victim],
            },
        ),
        ("AckInvalidations", Op::AckInvalidations { ids: vec![1, 2] }),
        (
            "AckInvalidationsBatch",
            Op::AckInvalidationsBatch {
                acks: vec![(victim, vec![1, 2])],
            },
        ),
        (
            "an ephemeral create",
            Op::Create {
                path: "/owned/mallory".into(),
                data: b"x".to_vec(),
                mode: CreateMode {
                    ephemeral: true,
                    sequential: false,
                },
            },
        ),
        (
            "SetData",
            Op::SetData {
                path: "/owned".into(),
                data: b"mallory".to_vec(),
                version: None,
            },
        ),
        (
            "deleting the victim's ephemeral node",
            Op::Delete {
                path: "/owned/alice".into(),
                version: None,
            },
        ),
        (
            "a transaction",
            Op::Txn {
                ops: vec![TxnOp::Delete {
                    path: "/owned/alice".into(),
                    version: None,
                }],
            },
        ),
        (
            "a watched read",
            Op::Get {
                path: "/owned".into(),
                watch: true,
            },
        ),
        (
            "Rewatch",
            Op::Rewatch {
                watches: Vec::new(),
            },
        ),
        (
            "CachedGet",
            Op::CachedGet {
                path: "/owned".into(),
            },
        ),
        ("CloseSession", Op::CloseSession),
    ];
    for (i, (what, op)) in tries.into_iter().enumerate() {
        match mallory.call(req(victim, first_id + i as u64, op)).await {
            Err(Error::NotSessionOwner { session, identity }) => {
                assert_eq!(session, victim, "{what}");
                assert_eq!(identity, "lock://client/mallory", "{what}");
            }
            other => panic!("{what} under another identity's session: {other:?}"),
        }
    }
    // The event stream.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    match mallory
        .open_stream(req(victim, 0, Op::Events), deadline)
        .await
    {
        Err(Error::NotSessionOwner { .. }) => {}
        other => panic!(
            "another identity's event stream: {:?}",
            other.map(|(r, _, a)| (r, a))
        ),
    }
    // A client may not forward for anyone, not even for the owner.
    match mallory
        .call(req(
            victim,
            first_id + 100,
            Op::Forwarded {
                identity: "lock://client/dev".into(),
                op: Box::new(Op::CloseSession),
            },
        ))
        .await
    {
        Err(Error::BadRequest { reason }) => {
            assert!(reason.contains("only a proxy forwards"), "{reason}")
        }
        other => panic!("a client forwarded for another: {other:?}"),
    }
}

#[test]
fn a_session_is_used_by_its_owner_only_and_a_new_leader_knows_the_owner() {
    let _s = serial();
    rt().block_on(async {
        // No lease checkpoints (log entries) while the digests are compared.
        let cell = TestCell::start(Opts {
            replicas: 3,
            checkpoint_interval_ms: 3_600_000,
            ..Opts::default()
        });
        cell.keep_on_panic();
        let alice = cell.client().await;
        let leader = cell
            .wait_leader(&alice, Duration::from_secs(20), None)
            .await;
        let mut cfg = cell.client_config();
        (cfg.cert, cfg.key) =
            cell.issue_client(&cell.dir.path().join("mallory"), "lock://client/mallory");
        let mallory = Client::connect(cfg).await.unwrap();

        // Session ids are predictable (index × 1024 + position): Mallory renews and writes
        // under the id Alice's session will get before it exists. Refused as unknown, and
        // nothing about it is remembered for Mallory once Alice opens it.
        let last = cell.statuses(&alice).await[&leader].last_log_index;
        let predicted = wire::types::session_id(last + 1, 0);
        for (i, op) in [
            Op::KeepAlive,
            Op::SetData {
                path: "/".into(),
                data: Vec::new(),
                version: None,
            },
        ]
        .into_iter()
        .enumerate()
        {
            match mallory.call(req(predicted, 1 + i as u64, op)).await {
                Err(Error::UnknownSession { session }) => assert_eq!(session, predicted),
                other => panic!("a session not yet open: {other:?}"),
            }
        }
        let s = alice.open_session().await.unwrap();
        assert_eq!(
            s.id(),
            predicted,
            "another entry came first; the prediction missed"
        );
        s.create("/owned", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        s.create(
            "/owned/alice",
            b"held".to_vec(),
            CreateMode {
                ephemeral: true,
                sequential: false,
            },
        )
        .await
        .unwrap();
        // Alice caches the node: a forged acknowledgement would matter.
        s.get_cached("/owned").await.unwrap();
        // Mallory's own session works (the control).
        let m = mallory.open_session().await.unwrap();
        m.create("/mallory", b"m".to_vec(), CreateMode::default())
            .await
            .unwrap();

        cell.assert_same_state(&alice, Duration::from_secs(10))
            .await;
        tokio::time::sleep(replica::gateway::DIGEST_INTERVAL * 2).await;
        let addr = cell.addr(leader).parse().unwrap();
        let before = alice.state_digest_of(addr).await.unwrap();

        try_everything(&mallory, s.id(), 1_000).await;

        tokio::time::sleep(replica::gateway::DIGEST_INTERVAL * 2).await;
        assert_eq!(
            alice.state_digest_of(addr).await.unwrap(),
            before,
            "a refused request changed the cell's state"
        );
        // Alice's own requests on the session still work.
        assert!(matches!(
            alice.call(req(s.id(), 0, Op::KeepAlive)).await,
            Ok(Reply::KeepAlive { .. })
        ));
        s.set_data("/owned", b"v2".to_vec(), None).await.unwrap();

        // The owner is replicated state: a new leader refuses the same.
        let mut cell = cell;
        cell.kill(leader);
        let new = cell
            .wait_leader(&alice, Duration::from_secs(20), Some(leader))
            .await;
        assert_ne!(new, leader);
        try_everything(&mallory, s.id(), 2_000).await;
        // And Alice's session, its ephemeral node and its requests go on.
        s.set_data("/owned", b"v3".to_vec(), None).await.unwrap();
        assert!(s.exists("/owned/alice").await.unwrap().is_some());
        assert!(s.lease_valid());
        s.close().await.unwrap();
        assert!(alice.exists("/owned/alice").await.unwrap().is_none());
    });
}
