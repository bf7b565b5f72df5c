//! Limits per identity (issue 24, step 5; docs/security.md, "Limits per identity"), at
//! real replica processes: an identity at its limits of connections, sessions and
//! requests in flight is refused each with `TooManyFor` (and counted in `Status`),
//! nothing it was refused changes the cell, and another identity goes on as before.

mod common;

use std::path::Path;
use std::time::Duration;

use client_sdk::{Client, CreateMode};
use common::{rt, serial, Opts, TestCell};
use wire::quota::{Limited, Limits};
use wire::types::{Op, Reply, Request};
use wire::Error;

const ABUSER: &str = "lock://client/abuser";

async fn client_as(cell: &TestCell, dir: &Path, endpoint: &str) -> Result<Client, Error> {
    let mut cfg = cell.client_config();
    cfg.endpoints = vec![endpoint.to_string()];
    cfg.cert = dir.join("client.pem");
    cfg.key = dir.join("client.key");
    Client::connect(cfg).await
}

fn refused(what: Limited, limit: u64) -> Error {
    Error::TooManyFor {
        identity: ABUSER.into(),
        what,
        limit,
    }
}

#[test]
fn an_identity_at_its_limits_is_refused_and_the_others_go_on() {
    let _s = serial();
    rt().block_on(async {
        let mut opts = Opts {
            replicas: 3,
            ..Opts::default()
        };
        opts.limits.per_identity.identities.insert(
            ABUSER.into(),
            Limits {
                connections: 2,
                requests: 4,
                sessions: 3,
            },
        );
        let cell = TestCell::start(opts);
        cell.keep_on_panic();
        let good = cell.client().await;
        let leader = cell.wait_leader(&good, Duration::from_secs(20), None).await;
        let at = cell.addr(leader);
        let dir = cell.dir.path().join("abuser");
        cell.issue_client(&dir, ABUSER);

        // Connections: two to the leader, the third refused at its hello.
        let a1 = client_as(&cell, &dir, &at).await.unwrap();
        let a2 = client_as(&cell, &dir, &at).await.unwrap();
        for c in [&a1, &a2] {
            c.get("/").await.unwrap();
        }
        let third = match client_as(&cell, &dir, &at).await {
            Ok(c) => c.get("/").await.map(|_| ()),
            Err(e) => Err(e),
        };
        assert_eq!(third, Err(refused(Limited::Connections, 2)), "{third:?}");

        // Sessions: three, the fourth refused; closing one makes room.
        let mut sessions = Vec::new();
        for _ in 0..3 {
            sessions.push(a1.open_session().await.unwrap());
        }
        assert_eq!(
            a1.open_session().await.err(),
            Some(refused(Limited::Sessions, 3))
        );
        sessions.pop().unwrap().close().await.unwrap();
        sessions.push(a1.open_session().await.unwrap());

        // Requests in flight: 40 writes sent at once on one connection, each one
        // attempt: some are refused, the others apply, and each refused one left nothing.
        let s = sessions[0].id();
        let tries = (0..40u64).map(|i| {
            let a1 = &a1;
            let at = at.parse().unwrap();
            async move {
                let r = a1
                    .call_at(
                        at,
                        &Request {
                            session: s,
                            request_id: 1_000 + i,
                            ack_below: 0,
                            op: Op::Create {
                                path: format!("/flood-{i}"),
                                data: Vec::new(),
                                mode: CreateMode::default(),
                            },
                        },
                    )
                    .await;
                (i, r)
            }
        });
        let results = futures::future::join_all(tries).await;
        let mut refused_n = 0;
        for (i, r) in &results {
            match r {
                Ok(Reply::Created { .. }) => {}
                Err(e) if *e == refused(Limited::Requests, 4) => {
                    refused_n += 1;
                    assert!(
                        good.exists(&format!("/flood-{i}")).await.unwrap().is_none(),
                        "a refused write applied"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(refused_n > 0, "40 writes at once never met the limit of 4");
        assert!(refused_n < 40, "every write was refused");

        // The other identity went on throughout, and goes on.
        let g = good.open_session().await.unwrap();
        for i in 0..5 {
            g.create(&format!("/good-{i}"), Vec::new(), CreateMode::default())
                .await
                .unwrap();
        }
        let st = good.status_of(at.parse().unwrap()).await.unwrap();
        assert!(
            st.refused_by_limit.iter().all(|n| *n > 0),
            "refusals counted by kind: {:?}",
            st.refused_by_limit
        );
    });
}
