//! ACLs through a proxy (issue 24, step 3): the proxy forwards reads it cannot answer for
//! the client's identity, and serves its cached copy of a node only to identities the
//! leader answered a read of that copy for; an ACL change drops the copy like a write.

use super::*;
use wire::acl::{Acl, Principal, Right};

fn is_read_denied<T: std::fmt::Debug>(r: &Result<T, Error>) -> bool {
    matches!(r, Err(Error::Denied { right: Right::Read, identity, .. })
        if identity == "lock://client/mallory")
}

#[test]
fn a_proxy_serves_a_cached_node_only_to_identities_the_leader_answered() {
    let _s = serial();
    let cell = Cell::start(1);
    rt().block_on(async {
        let proxy = &cell.proxies[..];
        // The dev cell's client is its admin; Mallory is another identity of the CA.
        let alice = cell.client(proxy).await;
        let mallory = client_as(&cell, "mallory", proxy).await;
        let a = alice.open_session().await.unwrap();
        a.create("/secret", b"s1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let alice_only = Acl {
            read: vec![Principal::parse(wire::tls::DEV_CLIENT).unwrap()],
            create: vec![Principal::parse(wire::tls::DEV_CLIENT).unwrap()],
            ..Acl::default()
        };
        alice.set_acl("/secret", alice_only.clone()).await.unwrap();
        // The lock's directory inherits the ACL.
        a.create("/secret/lock", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        // Alice caches /secret through the proxy: the proxy holds a copy now.
        let hits = proxy_status(&alice, &proxy[0]).await.cache_hits;
        a.get_cached("/secret").await.unwrap();
        let b = alice.open_session().await.unwrap();
        b.get_cached("/secret").await.unwrap();
        assert!(
            proxy_status(&alice, &proxy[0]).await.cache_hits > hits,
            "the proxy served its copy to the identity the leader answered"
        );

        // Mallory, through the same proxy, gets none of it.
        let m = mallory.open_session().await.unwrap();
        assert!(is_read_denied(&m.get_cached("/secret").await));
        assert!(is_read_denied(&m.get("/secret").await));
        assert!(is_read_denied(&mallory.get("/secret").await));
        let watched = mallory
            .call(Request {
                session: m.id(),
                request_id: 0,
                ack_below: 0,
                op: Op::Get {
                    path: "/secret".into(),
                    watch: true,
                },
            })
            .await;
        assert!(is_read_denied(&watched), "{watched:?}");
        let rewatch = mallory
            .call(Request {
                session: m.id(),
                request_id: 0,
                ack_below: 0,
                op: Op::Rewatch {
                    watches: vec![wire::types::WatchSpec {
                        path: "/secret".into(),
                        kind: wire::types::WatchKind::Data,
                        since_index: 1,
                    }],
                },
            })
            .await;
        assert!(is_read_denied(&rewatch), "{rewatch:?}");
        // Nor a place in the lock's queue, nor a write.
        let queued = Lock::exclusive(&m, "/secret/lock")
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
            "{queued:?}"
        );
        assert!(matches!(
            m.set_data("/secret", b"x".to_vec(), None).await,
            Err(Error::Denied {
                right: Right::Write,
                ..
            })
        ));
        assert_eq!(alice.get("/secret").await.unwrap().0, b"s1".to_vec());

        // Granted the read right, Mallory reads (upstream, then from the proxy's copy).
        let mut both = alice_only.clone();
        both.read
            .push(Principal::parse("lock://client/mallory").unwrap());
        alice.set_acl("/secret", both).await.unwrap();
        assert_eq!(
            m.get_cached("/secret").await.unwrap().unwrap().0,
            b"s1".to_vec()
        );
        // Revoked again: the ACL change dropped the proxy's copy (held like a write), so
        // the proxy does not serve Mallory its old answer.
        alice.set_acl("/secret", alice_only).await.unwrap();
        let m2 = mallory.open_session().await.unwrap();
        assert!(is_read_denied(&m2.get_cached("/secret").await));
        // Alice still reads, through the proxy.
        assert_eq!(
            b.get_cached("/secret").await.unwrap().unwrap().0,
            b"s1".to_vec()
        );
    });
}

/// Limits per identity at a proxy (issue 24, step 5): an identity at its limits of
/// connections and requests in flight is refused with `TooManyFor` (and counted in
/// `ProxyStatus`), while another identity through the same proxy goes on.
#[test]
fn a_proxy_holds_an_identity_to_its_limits() {
    let _s = serial();
    // The proxies read their configuration with these overrides at start (the dev
    // client stays unlimited: its own entry in `lockctl dev`'s configuration).
    let env = [
        ("LOCKSVC_PROXY__PER_IDENTITY__DEFAULT__CONNECTIONS", "1"),
        ("LOCKSVC_PROXY__PER_IDENTITY__DEFAULT__REQUESTS", "2"),
    ];
    for (k, v) in env {
        std::env::set_var(k, v);
    }
    let cell = Cell::start(1);
    for (k, _) in env {
        std::env::remove_var(k);
    }
    rt().block_on(async {
        let proxy = &cell.proxies[..];
        let alice = cell.client(proxy).await;
        let mallory = client_as(&cell, "mallory", proxy).await;
        mallory.get("/").await.unwrap();
        // A second connection of the same identity: refused at its hello.
        let mut cfg = ClientConfig::new(proxy.to_vec(), cell.ca());
        let dir = cell.data.join("client-mallory");
        (cfg.cert, cfg.key) = (dir.join("c.pem"), dir.join("c.key"));
        let second = match Client::connect(cfg).await {
            Ok(c) => c.get("/").await.map(|_| ()),
            Err(e) => Err(e),
        };
        assert!(
            matches!(
                &second,
                Err(Error::TooManyFor {
                    what: wire::quota::Limited::Connections,
                    limit: 1,
                    ..
                })
            ),
            "{second:?}"
        );
        // Requests in flight: 30 reads at once, one attempt each.
        let addr: std::net::SocketAddr = proxy[0].parse().unwrap();
        let tries = (0..30).map(|_| {
            let m = &mallory;
            async move {
                m.call_at(
                    addr,
                    &Request {
                        session: 0,
                        request_id: 0,
                        ack_below: 0,
                        op: Op::Children {
                            path: "/".into(),
                            watch: false,
                        },
                    },
                )
                .await
            }
        });
        let results = futures::future::join_all(tries).await;
        let refused = results
            .iter()
            .filter(|r| {
                matches!(
                    r,
                    Err(Error::TooManyFor {
                        what: wire::quota::Limited::Requests,
                        limit: 2,
                        ..
                    })
                )
            })
            .count();
        assert!(refused > 0, "30 reads at once never met the limit of 2");
        assert!(
            results
                .iter()
                .all(|r| r.is_ok() || matches!(r, Err(Error::TooManyFor { .. }))),
            "{results:?}"
        );
        // Alice (another identity) goes on, with as many connections as she likes.
        let alice_2 = cell.client(proxy).await;
        alice.get("/").await.unwrap();
        alice_2.get("/").await.unwrap();
        let st = proxy_status(&alice, &proxy[0]).await;
        assert!(
            st.refused_by_limit[0] >= 1 && st.refused_by_limit[1] >= 1,
            "{:?}",
            st.refused_by_limit
        );
    });
}
