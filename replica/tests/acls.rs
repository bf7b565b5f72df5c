//! ACLs, groups and admins (issue 24, step 3; docs/security.md, "ACLs") at real replica
//! processes of a production-like cell: the root only its admin may use.
//!
//! The admin gives the payments team (a group) /payments; a team member takes a lock
//! under it; another identity from the cell's own CA is refused each write, read, cached
//! read and place in the lock's queue with a typed `Denied`, and nothing it tried changed
//! a node (on every replica: the same state digest everywhere). Rights are inherited at
//! create; the admin changes an ACL and the change takes effect; only admins change groups
//! and admins. The ACLs survive snapshots, a restart and a learner's catch-up from a
//! snapshot (the digests, which cover ACLs, groups and admins, agree).

mod common;

use std::time::Duration;

use client_sdk::{Client, CreateMode, Lock};
use common::{rt, serial, Opts, TestCell};
use wire::acl::{Acl, Principal, Right};
use wire::types::{Op, Reply};
use wire::Error;

const ADMIN: &str = wire::tls::DEV_CLIENT;
const API: &str = "lock://client/payments-api";
const SEARCH: &str = "lock://client/search";

async fn client_as(cell: &TestCell, uri: &str) -> Client {
    let mut cfg = cell.client_config();
    let name = uri.rsplit('/').next().unwrap();
    (cfg.cert, cfg.key) = cell.issue_client(&cell.dir.path().join(name), uri);
    Client::connect(cfg).await.unwrap()
}

fn denied(path: &str, right: Right, identity: &str) -> Error {
    Error::Denied {
        path: path.into(),
        right,
        identity: identity.into(),
    }
}

fn team_acl() -> Acl {
    let team = Principal::parse("group:payments").unwrap();
    Acl {
        read: vec![team.clone()],
        write: vec![team.clone()],
        create: vec![team],
        admin: vec![],
    }
}

#[test]
fn acls_decide_at_every_replica_and_survive_snapshots_restarts_and_learners() {
    let _s = serial();
    rt().block_on(async {
        let mut cell = TestCell::start(Opts {
            replicas: 3,
            // No lease checkpoints (log entries) while digests are compared.
            checkpoint_interval_ms: 3_600_000,
            // Nothing kept behind a snapshot: a new learner must install one.
            raft: replica::config::RaftConfig {
                log_entries_kept_after_snapshot: 0,
                ..Default::default()
            },
            security: replica::config::SecurityConfig {
                initial_admins: vec![ADMIN.into()],
                root_acl: replica::config::RootAcl::Admins,
            },
            ..Opts::default()
        });
        cell.keep_on_panic();
        let admin = cell.client().await;
        cell.wait_leader(&admin, Duration::from_secs(20), None)
            .await;
        let api = client_as(&cell, API).await;
        let search = client_as(&cell, SEARCH).await;

        // The root is the admins' only: even reading it is refused to others.
        assert_eq!(
            api.get("/").await.unwrap_err(),
            denied("/", Right::Read, API)
        );
        let a = api.open_session().await.unwrap();
        assert_eq!(
            a.create("/payments", Vec::new(), CreateMode::default())
                .await
                .unwrap_err(),
            denied("/", Right::Create, API)
        );
        // Only an admin changes groups.
        assert_eq!(
            api.set_group("payments", vec![API.into()])
                .await
                .unwrap_err(),
            Error::NotAdmin {
                action: "change groups".into(),
                identity: API.into(),
            }
        );

        // The admin makes /payments the team's.
        let s = admin.open_session().await.unwrap();
        s.create("/payments", b"p".to_vec(), CreateMode::default())
            .await
            .unwrap();
        admin.set_group("payments", vec![API.into()]).await.unwrap();
        admin.set_acl("/payments", team_acl()).await.unwrap();
        let sec = admin.security().await.unwrap();
        assert_eq!(sec.admins, vec![ADMIN.to_string()]);
        assert_eq!(sec.groups, vec![("payments".into(), vec![API.into()])]);

        // The team creates a lock directory (inheriting the ACL) and takes the lock.
        a.create("/payments/lock", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        assert_eq!(
            api.get_acl("/payments/lock").await.unwrap(),
            team_acl().canonical()
        );
        let held = Lock::exclusive(&a, "/payments/lock")
            .acquire()
            .await
            .unwrap();
        a.set_data("/payments", b"by-api".to_vec(), None)
            .await
            .unwrap();

        // Everything the other identity tries is refused, and changes no node.
        let digest_index = cell
            .assert_same_state(&admin, Duration::from_secs(10))
            .await;
        let (payments_before, lock_before) = (
            admin.get("/payments").await.unwrap(),
            admin.children("/payments/lock").await.unwrap(),
        );
        let o = search.open_session().await.unwrap();
        assert_eq!(
            o.create(
                "/payments/lock/lock-",
                Vec::new(),
                CreateMode {
                    ephemeral: true,
                    sequential: true,
                }
            )
            .await
            .unwrap_err(),
            denied("/payments/lock", Right::Create, SEARCH)
        );
        let queued = Lock::exclusive(&o, "/payments/lock")
            .acquire_timeout(Duration::from_secs(5))
            .await;
        assert!(
            matches!(
                &queued,
                Err(Error::Denied {
                    right: Right::Create,
                    ..
                })
            ),
            "a lock queue without the create right: {queued:?}"
        );
        assert_eq!(
            o.set_data("/payments", b"x".to_vec(), None)
                .await
                .unwrap_err(),
            denied("/payments", Right::Write, SEARCH)
        );
        assert_eq!(
            o.delete("/payments/lock", None).await.unwrap_err(),
            denied("/payments/lock", Right::Write, SEARCH)
        );
        for r in [
            search.get("/payments").await.map(|_| ()),
            search.children("/payments/lock").await.map(|_| ()),
            o.get_cached("/payments").await.map(|_| ()),
            o.get("/payments").await.map(|_| ()),
            search.get_acl("/payments").await.map(|_| ()),
        ] {
            assert!(
                matches!(
                    &r,
                    Err(Error::Denied {
                        right: Right::Read,
                        ..
                    })
                ),
                "{r:?}"
            );
        }
        match search
            .request(Op::SetAcl {
                path: "/payments".into(),
                acl: Acl::everyone(),
            })
            .await
        {
            Err(e) => assert_eq!(e, denied("/payments", Right::Admin, SEARCH)),
            other => panic!("{other:?}"),
        }
        assert_eq!(admin.get("/payments").await.unwrap(), payments_before);
        assert_eq!(admin.children("/payments/lock").await.unwrap(), lock_before);
        assert_eq!(
            admin.get_acl("/payments").await.unwrap(),
            team_acl().canonical()
        );
        o.close().await.unwrap();
        let after = cell
            .assert_same_state(&admin, Duration::from_secs(10))
            .await;
        assert!(after > digest_index);

        // The admin lets the other identity read: it reads now (no restart, no cache).
        let mut acl = team_acl();
        acl.read.push(Principal::parse(SEARCH).unwrap());
        admin.set_acl("/payments", acl.clone()).await.unwrap();
        assert_eq!(search.get("/payments").await.unwrap().0, b"by-api".to_vec());
        // Children made before keep their ACL.
        assert!(search.children("/payments/lock").await.is_err());
        held.release().await.unwrap();

        // Membership and snapshots are the admins'.
        for (op, action) in [
            (
                Op::AddLearner {
                    id: 9,
                    addr: "127.0.0.1:9".into(),
                },
                "change the cell's membership",
            ),
            (Op::RemoveMember { id: 1 }, "change the cell's membership"),
            (Op::Snapshot, "make a replica take a snapshot"),
            (
                Op::Sessions {
                    after: 0,
                    limit: 10,
                },
                "list the cell's sessions",
            ),
            (Op::Backup, "back the cell up"),
        ] {
            assert_eq!(
                search.request(op).await.unwrap_err(),
                Error::NotAdmin {
                    action: action.into(),
                    identity: SEARCH.into(),
                }
            );
        }

        // Snapshots on every replica (logs purged behind them), a restart, a learner
        // that catches up from a snapshot: the ACLs are the same everywhere.
        for id in cell.procs.keys().copied().collect::<Vec<_>>() {
            match admin
                .call_at(
                    cell.addr(id).parse().unwrap(),
                    &wire::types::Request {
                        session: 0,
                        request_id: 0,
                        ack_below: 0,
                        op: Op::Snapshot,
                    },
                )
                .await
            {
                Ok(Reply::SnapshotTaken { .. }) => {}
                other => panic!("snapshot at {id}: {other:?}"),
            }
        }
        let leader = cell
            .wait_leader(&admin, Duration::from_secs(20), None)
            .await;
        let follower = *cell.procs.keys().find(|id| **id != leader).unwrap();
        cell.kill(follower);
        cell.spawn(follower);
        let addr4 = cell.prepare_new_replica(4);
        cell.spawn(4);
        match admin
            .request(Op::AddLearner {
                id: 4,
                addr: addr4.clone(),
            })
            .await
            .unwrap()
        {
            Reply::MembershipChanged { members } => {
                assert!(members.iter().any(|m| m.id == 4 && !m.voter))
            }
            other => panic!("{other:?}"),
        }
        let at = cell
            .assert_same_state(&admin, Duration::from_secs(30))
            .await;
        assert!(at > after);
        let learner = admin.status_of(addr4.parse().unwrap()).await.unwrap();
        assert!(
            learner.snapshot_index.is_some(),
            "the learner caught up without a snapshot: {learner:?}"
        );
        // And the restarted replica decides alike when it leads: kill the others'
        // leader until it does not matter who leads (every replica holds the same).
        cell.kill(leader);
        let new = cell
            .wait_leader(&admin, Duration::from_secs(20), Some(leader))
            .await;
        assert_ne!(new, leader);
        assert_eq!(search.get("/payments").await.unwrap().0, b"by-api".to_vec());
        let o = search.open_session().await.unwrap();
        assert_eq!(
            o.set_data("/payments", b"x".to_vec(), None)
                .await
                .unwrap_err(),
            denied("/payments", Right::Write, SEARCH)
        );
        assert_eq!(admin.get_acl("/payments").await.unwrap(), acl.canonical());
    });
}
