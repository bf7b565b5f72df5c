//! Sessions belong to identities through a proxy (issue 24, second step): the proxy
//! forwards its clients' requests for their identities, so a session opened through it
//! belongs to the client and not to the proxy; what the proxy answers itself (batched
//! KeepAlives, acknowledgements, cached reads, watches, event streams) it checks against
//! the owner it learned when it opened the session, or asks the cell for one it did not.

use super::*;
use wire::types::SessionId;

fn req(session: SessionId, request_id: u64, op: Op) -> Request {
    Request {
        session,
        request_id,
        ack_below: 0,
        op,
    }
}

/// What `mallory` tries on `victim`'s session, each refused as not its own. Where
/// `acks_dropped`, a proxy that does not know the session's owner drops Mallory's
/// acknowledgements instead (answered `Acked`, nothing done: invalidations are relayed
/// only to sessions that cached through the proxy, whose owner it checked then, and an
/// acknowledgement never waits for the cell).
async fn refused(mallory: &Client, victim: SessionId, first_id: u64, acks_dropped: bool) {
    let tries = [
        Op::KeepAlive,
        Op::KeepAliveBatch {
            sessions: vec![victim],
        },
        Op::AckInvalidations { ids: vec![1] },
        Op::AckInvalidationsBatch {
            acks: vec![(victim, vec![1])],
        },
        Op::CachedGet { path: "/p".into() },
        Op::Get {
            path: "/p".into(),
            watch: true,
        },
        Op::Rewatch {
            watches: Vec::new(),
        },
        Op::Create {
            path: "/p/mallory".into(),
            data: Vec::new(),
            mode: CreateMode {
                ephemeral: true,
                sequential: false,
            },
        },
        Op::Delete {
            path: "/p/alice".into(),
            version: None,
        },
        Op::CloseSession,
    ];
    for (i, op) in tries.into_iter().enumerate() {
        let what = op.name();
        let ack = matches!(
            op,
            Op::AckInvalidations { .. } | Op::AckInvalidationsBatch { .. }
        );
        let r = mallory.call(req(victim, first_id + i as u64, op)).await;
        if ack && acks_dropped {
            assert!(matches!(r, Ok(Reply::Acked)), "{what}: {r:?}");
            continue;
        }
        match r {
            Err(Error::NotSessionOwner { session, identity }) => {
                assert_eq!(
                    (session, identity.as_str()),
                    (victim, "lock://client/mallory"),
                    "{what}"
                );
            }
            other => panic!("{what} under another identity's session: {other:?}"),
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    match mallory
        .open_stream(req(victim, 0, Op::Events), deadline)
        .await
    {
        Err(Error::NotSessionOwner { .. }) => {}
        other => panic!(
            "another identity's event stream: {:?}",
            other.map(|(r, ..)| r)
        ),
    }
}

#[test]
fn through_a_proxy_a_session_belongs_to_the_client_that_opened_it() {
    let _s = serial();
    let cell = Cell::start(2);
    rt().block_on(async {
        let first = &cell.proxies[..1];
        let second = &cell.proxies[1..];
        let alice = cell.client(first).await;
        let direct_alice = cell.client(&cell.replicas).await;
        let mallory = client_as(&cell, "mallory", first).await;
        let direct_mallory = client_as(&cell, "mallory", &cell.replicas).await;

        // A session opened through the proxy, with an ephemeral node and a cached value.
        let s = alice.open_session().await.unwrap();
        s.create("/p", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let ephemeral = CreateMode {
            ephemeral: true,
            sequential: false,
        };
        s.create("/p/alice", Vec::new(), ephemeral).await.unwrap();
        s.get_cached("/p").await.unwrap();
        // Through the proxy (which opened it, and knows its owner), and directly at the
        // replicas (the cell recorded the client, not the proxy, as its owner).
        refused(&mallory, s.id(), 1_000, false).await;
        refused(&direct_mallory, s.id(), 2_000, false).await;
        // The cell recorded Alice, not the proxy, as the owner: she renews it directly.
        assert!(matches!(
            direct_alice.call(req(s.id(), 0, Op::KeepAlive)).await,
            Ok(Reply::KeepAlive { .. })
        ));
        // At a second proxy (a client failing over between proxies), which had never
        // seen the session: Alice goes on (the proxy learns her as the owner from the
        // cell), and Mallory is refused, acknowledgements included.
        let alice_2 = cell.client(second).await;
        let mallory_2 = client_as(&cell, "mallory", second).await;
        assert!(matches!(
            alice_2.call(req(s.id(), 0, Op::KeepAlive)).await,
            Ok(Reply::KeepAlive { .. })
        ));
        refused(&mallory_2, s.id(), 4_000, false).await;

        // The proxy's own session is the proxy's: no client renews or closes it, through
        // the proxy or directly; and a client may not forward for anyone.
        let own = proxy_status(&alice, &first[0]).await.session;
        assert_ne!(own, 0);
        // (Nor reads under it: a proxy reads for its clients under its own session, but
        // only the proxy may ask for that.)
        for c in [&mallory, &direct_alice] {
            for op in [
                Op::KeepAlive,
                Op::CloseSession,
                Op::CachedGet { path: "/p".into() },
                Op::Rewatch {
                    watches: Vec::new(),
                },
            ] {
                match c.call(req(own, 5_000, op)).await {
                    Err(Error::NotSessionOwner { session, .. }) => assert_eq!(session, own),
                    other => panic!("a client used the proxy's own session: {other:?}"),
                }
            }
        }
        match mallory
            .call(req(
                s.id(),
                5_001,
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
            other => panic!("a client forwarded through a proxy: {other:?}"),
        }

        // A session opened directly at the replicas: the proxy has never seen it, asks
        // the cell, and refuses Mallory; Alice, its owner, may use it through the proxy.
        let d = direct_alice.open_session().await.unwrap();
        refused(&mallory, d.id(), 3_000, true).await;
        assert!(matches!(
            alice.call(req(d.id(), 0, Op::KeepAlive)).await,
            Ok(Reply::KeepAlive { .. })
        ));
        d.close().await.unwrap();

        // Mallory's own session through the proxy works (the control), and Alice's went
        // on throughout: its lease, its ephemeral node, its writes.
        let m = mallory.open_session().await.unwrap();
        m.create("/m", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        assert!(s.lease_valid(), "{}", cell.logs());
        s.set_data("/p", b"v2".to_vec(), None).await.unwrap();
        assert!(s.exists("/p/alice").await.unwrap().is_some());
        s.close().await.unwrap();
        assert!(direct_alice.exists("/p/alice").await.unwrap().is_none());
    });
    cell.stop();
}
