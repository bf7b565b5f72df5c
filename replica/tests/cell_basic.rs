//! Five real replicas on loopback: elections, the node API, sessions and ephemerals,
//! dedup of retried writes, and bad input.

mod common;

use std::time::{Duration, Instant};

use client_sdk::{CreateMode, Error, TxnOp};
use common::{percentile, rt, serial, Opts, TestCell};
use wire::types::{Op, Request};

/// Scenario 1: five replicas elect a leader; create/get/set/ls/rm round-trip; a stale CAS
/// is refused with a typed error and changes nothing. Prints election time and commit
/// latency of a few hundred sequential creates.
#[test]
fn elect_and_round_trip() {
    let _g = serial();
    rt().block_on(async {
        let started = Instant::now();
        let cell = TestCell::start(Opts::default());
        let client = cell.client().await;
        let leader = cell.wait_leader(&client, Duration::from_secs(20), None).await;
        println!("FIGURE election: replica {leader} leads {} ms after start", started.elapsed().as_millis());

        let s = client.open_session().await.unwrap();
        s.create("/cfg", b"v0".to_vec(), CreateMode::default()).await.unwrap();
        let (data, stat) = client.get("/cfg").await.unwrap();
        assert_eq!((data.as_slice(), stat.version), (&b"v0"[..], 0));
        let stat = s.set_data("/cfg", b"v1".to_vec(), Some(0)).await.unwrap();
        assert_eq!(stat.version, 1);
        let err = s.set_data("/cfg", b"stale".to_vec(), Some(0)).await.unwrap_err();
        assert_eq!(err, Error::BadVersion { path: "/cfg".into(), expected: 0, actual: 1 });
        assert_eq!(client.get("/cfg").await.unwrap().0, b"v1");
        s.create("/cfg/child", b"".to_vec(), CreateMode::default()).await.unwrap();
        let kids = client.children("/cfg").await.unwrap();
        assert_eq!(kids.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["child"]);
        assert!(matches!(s.delete("/cfg", None).await, Err(Error::NotEmpty { .. })));
        s.delete("/cfg/child", None).await.unwrap();
        assert!(matches!(s.delete("/cfg", Some(0)).await, Err(Error::BadVersion { .. })));
        s.delete("/cfg", Some(1)).await.unwrap();
        assert_eq!(client.exists("/cfg").await.unwrap(), None);

        // Commit latency of sequential creates.
        let mut ms = Vec::new();
        for i in 0..300 {
            let t = Instant::now();
            s.create(&format!("/n{i}"), vec![0u8; 64], CreateMode::default()).await.unwrap();
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "FIGURE commit latency, 300 sequential creates through 5 replicas (debug build): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            percentile(&ms, 0.5),
            percentile(&ms, 0.99),
            ms.last().unwrap()
        );
        // Group commit: concurrent writers share fsyncs.
        let before = cell.statuses(&client).await[&leader].clone();
        let mut tasks = Vec::new();
        for w in 0..32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..20 {
                    s.create(&format!("/g{w}-{i}"), vec![0u8; 64], CreateMode::default()).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let after = cell.statuses(&client).await[&leader].clone();
        println!(
            "FIGURE group commit on the leader, 32 concurrent writers x 20 creates: {} appends made durable by {} fsyncs",
            after.log_appends - before.log_appends,
            after.log_syncs - before.log_syncs
        );
        s.close().await.unwrap();
    });
}

/// Scenario 2: ephemeral sequential nodes get increasing names; closing the session removes
/// them; with a short lease, a client that stops its KeepAlives is expired and its
/// ephemerals vanish, and every replica agrees.
#[test]
fn ephemerals_follow_their_session() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts { lease_ms: 3_000, ..Opts::default() });
        let client = cell.client().await;
        cell.wait_leader(&client, Duration::from_secs(20), None).await;
        let admin = client.open_session().await.unwrap();
        admin.create("/lock", vec![], CreateMode::default()).await.unwrap();

        let a = client.open_session().await.unwrap();
        let mode = CreateMode { ephemeral: true, sequential: true };
        let mut last: Option<String> = None;
        for _ in 0..5 {
            let c = a.create("/lock/n-", vec![], mode).await.unwrap();
            if let Some(prev) = &last {
                assert!(c.path > *prev, "{} after {prev}", c.path);
                assert_eq!(c.predecessor.as_ref().map(|p| format!("/lock/{}", p.name)).as_ref(), Some(prev));
            } else {
                assert!(c.predecessor.is_none());
            }
            last = Some(c.path);
        }
        assert_eq!(client.children("/lock").await.unwrap().len(), 5);
        a.close().await.unwrap();
        assert_eq!(client.children("/lock").await.unwrap().len(), 0);

        // One batched KeepAlive RPC answers each of its sessions: renewed, ended, never seen.
        let sessions = vec![admin.id(), a.id(), 999_999];
        match client.request(Op::KeepAliveBatch { sessions }).await {
            Ok(wire::types::Reply::KeepAliveBatch { renewed, expired, unknown, .. }) => {
                assert_eq!(renewed, vec![admin.id()]);
                let ended: Vec<u64> = expired.iter().chain(&unknown).copied().collect();
                assert!(ended.contains(&a.id()) && ended.contains(&999_999), "{expired:?} {unknown:?}");
                assert!(!unknown.contains(&admin.id()) && !expired.contains(&admin.id()));
            }
            other => panic!("expected a KeepAliveBatch reply, got {other:?}"),
        }

        // A client that goes silent: its session expires after the lease.
        let b = client.open_session().await.unwrap();
        let live = client.open_session().await.unwrap();
        b.create("/lock/n-", vec![], mode).await.unwrap();
        b.create("/lock/n-", vec![], mode).await.unwrap();
        live.create("/lock/n-", vec![], mode).await.unwrap();
        let silent_from = Instant::now();
        b.stop_keepalives();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let kids = client.children("/lock").await.unwrap();
            if kids.len() == 1 {
                assert_eq!(kids[0].1.ephemeral_owner, Some(live.id()));
                break;
            }
            assert!(Instant::now() < deadline, "session did not expire: {kids:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let took = silent_from.elapsed();
        println!("FIGURE expiry: silent session expired {} ms after its KeepAlives stopped (lease 3000 ms)", took.as_millis());
        assert!(took >= Duration::from_millis(2_000), "expired too early: {took:?}");
        assert!(matches!(
            b.create("/lock/n-", vec![], mode).await,
            Err(Error::SessionExpired { .. })
        ));
        // Every replica reaches the same applied index with the same namespace.
        let leader_status = cell.statuses(&client).await;
        let target = leader_status.values().map(|s| s.last_applied).max().unwrap();
        cell.wait_applied(&client, target, Duration::from_secs(10)).await;
        let st = cell.statuses(&client).await;
        let nodes: Vec<u64> = st.values().map(|s| s.node_count).collect();
        let sessions: Vec<u64> = st.values().map(|s| s.session_count).collect();
        assert!(nodes.windows(2).all(|w| w[0] == w[1]), "node counts differ: {nodes:?}");
        assert!(sessions.windows(2).all(|w| w[0] == w[1]), "session counts differ: {sessions:?}");
        // And the same content: one digest at one index.
        cell.assert_same_state(&client, Duration::from_secs(10)).await;
        assert_eq!(live.state(), client_sdk::SessionState::Healthy);
    });
}

/// Scenario 7: a retried create with the same (session, request id) leaves one node; and
/// scenario 8: bad input gets typed errors and changes nothing.
#[test]
fn dedup_and_bad_input() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts::default());
        let client = cell.client().await;
        cell.wait_leader(&client, Duration::from_secs(20), None)
            .await;
        let s = client.open_session().await.unwrap();
        s.create("/q", vec![], CreateMode::default()).await.unwrap();

        let req = Request {
            session: s.id(),
            request_id: 1_000,
            ack_below: 0,
            op: Op::Create {
                path: "/q/item-".into(),
                data: vec![],
                mode: CreateMode {
                    ephemeral: false,
                    sequential: true,
                },
            },
        };
        let first = client.call(req.clone()).await.unwrap();
        let second = client.call(req.clone()).await.unwrap();
        assert_eq!(first, second, "a retry returns the original answer");
        assert_eq!(
            client.children("/q").await.unwrap().len(),
            1,
            "applied once"
        );

        // Bad input. The SDK refuses it before any RPC; the same requests sent raw get
        // the same typed errors from the replica.
        let before = cell.statuses(&client).await;
        let nodes_before = before.values().next().unwrap().node_count;
        let raw = |request_id: u64, op: Op| Request {
            session: s.id(),
            request_id,
            ack_below: 0,
            op,
        };
        let big = vec![7u8; wire::VALUE_BYTES_MAX + 1];
        assert_eq!(
            client
                .call(raw(
                    2_000,
                    Op::Create {
                        path: "/big".into(),
                        data: big.clone(),
                        mode: CreateMode::default()
                    }
                ))
                .await,
            Err(Error::ValueTooLarge {
                len: wire::VALUE_BYTES_MAX + 1,
                max: wire::VALUE_BYTES_MAX
            })
        );
        assert!(matches!(
            client
                .call(raw(
                    2_001,
                    Op::SetData {
                        path: "/q".into(),
                        data: big.clone(),
                        version: None
                    }
                ))
                .await,
            Err(Error::ValueTooLarge { .. })
        ));
        for (i, bad) in ["", "nope", "/a/", "/a//b", "/a/../b", "/."]
            .iter()
            .enumerate()
        {
            let op = Op::Create {
                path: bad.to_string(),
                data: vec![],
                mode: CreateMode::default(),
            };
            assert!(
                matches!(
                    client.call(raw(2_100 + i as u64, op)).await,
                    Err(Error::InvalidPath { .. })
                ),
                "{bad:?}"
            );
            let op = Op::Get {
                path: bad.to_string(),
                watch: false,
            };
            assert!(
                matches!(
                    client.call(raw(0, op)).await,
                    Err(Error::InvalidPath { .. })
                ),
                "{bad:?}"
            );
        }
        let txn = Op::Txn {
            ops: vec![
                TxnOp::Create {
                    path: "/ok".into(),
                    data: vec![],
                    mode: CreateMode::default(),
                },
                TxnOp::Delete {
                    path: "bad".into(),
                    version: None,
                },
            ],
        };
        assert!(matches!(
            client.call(raw(2_200, txn)).await,
            Err(Error::TxnFailed { index: 1, .. })
        ));
        assert!(
            client.exists("/ok").await.unwrap().is_none(),
            "a failed transaction applies nothing"
        );
        let big = vec![7u8; wire::VALUE_BYTES_MAX + 1];
        assert_eq!(
            s.create("/big", big.clone(), CreateMode::default()).await,
            Err(Error::ValueTooLarge {
                len: wire::VALUE_BYTES_MAX + 1,
                max: wire::VALUE_BYTES_MAX
            })
        );
        assert!(matches!(
            s.set_data("/q", big, None).await,
            Err(Error::ValueTooLarge { .. })
        ));
        for bad in ["", "nope", "/a/", "/a//b", "/a/../b", "/."] {
            assert!(
                matches!(
                    s.create(bad, vec![], CreateMode::default()).await,
                    Err(Error::InvalidPath { .. })
                ),
                "{bad:?}"
            );
            assert!(
                matches!(client.get(bad).await, Err(Error::InvalidPath { .. })),
                "{bad:?}"
            );
        }
        let long = format!("/{}", "x".repeat(wire::PATH_BYTES_MAX));
        assert!(matches!(
            s.create(&long, vec![], CreateMode::default()).await,
            Err(Error::InvalidPath { .. })
        ));
        let unknown = Request {
            session: 987_654_321,
            request_id: 1,
            ack_below: 0,
            op: Op::Create {
                path: "/u".into(),
                data: vec![],
                mode: CreateMode::default(),
            },
        };
        assert_eq!(
            client.call(unknown).await,
            Err(Error::UnknownSession {
                session: 987_654_321
            })
        );
        let ka = Request {
            session: 987_654_321,
            request_id: 0,
            ack_below: 0,
            op: Op::KeepAlive,
        };
        assert!(matches!(
            client.call(ka).await,
            Err(Error::UnknownSession { .. })
        ));
        let no_session = Request {
            session: 0,
            request_id: 1,
            ack_below: 0,
            op: Op::SetData {
                path: "/q".into(),
                data: vec![],
                version: None,
            },
        };
        assert_eq!(client.call(no_session).await, Err(Error::SessionRequired));

        // Wrong protocol version and garbage frames, on raw QUIC connections.
        let leader = cell
            .wait_leader(&client, Duration::from_secs(5), None)
            .await;
        let addr: std::net::SocketAddr = cell.addr(leader).parse().unwrap();
        let files = wire::tls::TlsConfig::client_in_dir(cell.ca.parent().unwrap());
        let (tls, _) = wire::tls::client_config(&files, wire::hello::ALPN_CLIENT).unwrap();
        let ep = wire::quic::client_endpoint(tls, "127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = ep
            .connect(addr, wire::tls::SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let hello = wire::hello::Hello {
            protocol_version: 999,
            agent: "old client".into(),
        };
        wire::frame::write(&mut send, &hello, 4096).await.unwrap();
        let _ = send.finish();
        let reply: wire::hello::HelloReply =
            tokio::time::timeout(Duration::from_secs(5), wire::frame::read(&mut recv, 4096))
                .await
                .expect("answered, not hung")
                .unwrap();
        assert_eq!(
            reply,
            Err(Error::ProtocolVersion {
                client: 999,
                server: wire::PROTOCOL_VERSION
            })
        );

        let conn = ep
            .connect(addr, wire::tls::SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        wire::frame::write(&mut send, &wire::hello::Hello::new("fuzzer"), 4096)
            .await
            .unwrap();
        let _ = send.finish();
        let ok: wire::hello::HelloReply = wire::frame::read(&mut recv, 4096).await.unwrap();
        assert!(ok.is_ok());
        let mut seed = 0x9e3779b97f4a7c15u64;
        for i in 0..50 {
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            let mut garbage = Vec::new();
            let len = 8 + (i * 7) % 200;
            for _ in 0..len {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                garbage.push(seed as u8);
            }
            if i % 10 == 0 {
                // An absurd length prefix.
                garbage[..4].copy_from_slice(&u32::MAX.to_be_bytes());
            }
            send.write_all(&garbage).await.unwrap();
            let _ = send.finish();
            let resp: Result<wire::types::Response, Error> = tokio::time::timeout(
                Duration::from_secs(5),
                wire::frame::read(&mut recv, wire::CLIENT_FRAME_BYTES_MAX),
            )
            .await
            .expect("answered");
            match resp {
                Ok(Err(Error::Malformed { .. })) | Ok(Err(Error::FrameTooLarge { .. })) => {}
                // Rarely, random bytes decode as a valid read-only or session-less request.
                Ok(other) => eprintln!("garbage frame {i} decoded into a request: {other:?}"),
                Err(e) => panic!("no typed answer to garbage frame {i}: {e}"),
            }
        }
        // Still serving, state unchanged.
        let after = cell.statuses(&client).await;
        assert_eq!(after.values().next().unwrap().node_count, nodes_before);
        assert_eq!(client.get("/q").await.unwrap().1.version, 0);
        s.create("/still-serving", vec![], CreateMode::default())
            .await
            .unwrap();
    });
}

/// Writes that reach the leader together share log entries (openraft 0.9 appends and
/// syncs each entry alone, so the leader coalesces what waits), but never a fencing token
/// or a session id: 48 sessions opened at once get 48 ids; 48 contenders creating
/// ephemeral sequential nodes under one lock parent at once share entries and get 48
/// distinct tokens, in the order of their names (the lock recipe grants in name order); and 48 writers of
/// 10 writes each need fewer log entries than writes, and 48 sessions opened at once fewer
/// entries than sessions. Every replica agrees afterwards.
#[test]
fn concurrent_writes_share_entries_but_never_a_token_or_a_session_id() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts { replicas: 3, ..Opts::default() });
        let client = cell.client().await;
        let leader = cell.wait_leader(&client, Duration::from_secs(20), None).await;
        let admin = client.open_session().await.unwrap();
        admin.create("/lock", vec![], CreateMode::default()).await.unwrap();

        let opens = (0..48).map(|_| {
            let c = client.clone();
            tokio::spawn(async move { c.open_session().await.unwrap() })
        });
        let mut sessions = Vec::new();
        for t in opens.collect::<Vec<_>>() {
            sessions.push(t.await.unwrap());
        }
        let ids: std::collections::BTreeSet<u64> = sessions.iter().map(|s| s.id()).collect();
        assert_eq!(ids.len(), 48, "session ids shared: {ids:?}");
        let opening: std::collections::BTreeSet<u64> =
            ids.iter().map(|id| wire::types::session_index(*id)).collect();
        println!("FIGURE 48 sessions opened at once took {} log entries", opening.len());
        assert!(opening.len() < 48, "no two sessions opened in one entry: {ids:?}");

        let mode = CreateMode { ephemeral: true, sequential: true };
        let creates = sessions.iter().map(|s| {
            let s = s.clone();
            tokio::spawn(async move { s.create("/lock/n-", vec![], mode).await.unwrap() })
        });
        let mut created = Vec::new();
        for t in creates.collect::<Vec<_>>() {
            created.push(t.await.unwrap());
        }
        created.sort_by(|a, b| a.path.cmp(&b.path));
        for w in created.windows(2) {
            assert!(
                w[0].stat.token < w[1].stat.token,
                "{} has token {} but {} has token {}",
                w[0].path,
                w[0].stat.token,
                w[1].path,
                w[1].stat.token
            );
        }
        // The contenders shared entries (each create has a token of its own).
        let entries: std::collections::BTreeSet<u64> =
            created.iter().map(|c| c.stat.create_index).collect();
        println!("FIGURE 48 contenders under one parent took {} log entries", entries.len());
        assert!(entries.len() < 48, "no two contenders created in one entry");

        for (i, s) in sessions.iter().enumerate() {
            s.create(&format!("/w{i}"), vec![], CreateMode::default()).await.unwrap();
        }
        let before = cell.statuses(&client).await[&leader].clone();
        let writes = sessions.iter().enumerate().map(|(i, s)| {
            let s = s.clone();
            tokio::spawn(async move {
                for v in 0..10u8 {
                    s.set_data(&format!("/w{i}"), vec![v], None).await.unwrap();
                }
            })
        });
        for t in writes.collect::<Vec<_>>() {
            t.await.unwrap();
        }
        let after = cell.statuses(&client).await[&leader].clone();
        let entries = after.last_log_index - before.last_log_index;
        println!(
            "FIGURE coalesced writes: 480 writes from 48 concurrent writers took {entries} log entries and {} leader fsyncs",
            after.log_syncs - before.log_syncs
        );
        assert!(entries < 480, "{entries} entries for 480 writes: nothing was coalesced");
        for (i, _) in sessions.iter().enumerate() {
            assert_eq!(client.get(&format!("/w{i}")).await.unwrap().0, vec![9u8]);
        }
        // Every replica applied the same: same node count once caught up.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = cell.statuses(&client).await;
            let counts: std::collections::BTreeSet<(u64, u64)> =
                st.values().map(|s| (s.last_applied, s.node_count)).collect();
            if st.len() == 3 && counts.len() == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "replicas differ: {counts:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The batch entries left the same content on every replica.
        cell.assert_same_state(&client, Duration::from_secs(10)).await;
    });
}

/// A client holds at most `sessions_max` sessions (each keeps an event stream on its one
/// connection; with every stream taken no request could be sent and all its sessions
/// would expire): one more fails with `TooManySessions` and opens nothing at the cell, and
/// a closed session gives its place back.
#[test]
fn a_client_refuses_sessions_beyond_its_limit_and_frees_a_place_on_close() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts {
            replicas: 3,
            ..Opts::default()
        });
        let mut cfg = cell.client_config();
        cfg.sessions_max = 3;
        let client = client_sdk::Client::connect(cfg).await.unwrap();
        cell.wait_leader(&client, Duration::from_secs(20), None)
            .await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(client.open_session().await.unwrap());
        }
        let before = cell.statuses(&client).await;
        match client.open_session().await {
            Err(Error::TooManySessions { max: 3 }) => {}
            Err(other) => panic!("expected TooManySessions, got {other}"),
            Ok(s) => panic!("a fourth session opened: {}", s.id()),
        }
        let after = cell.statuses(&client).await;
        let sessions = |m: &std::collections::BTreeMap<u64, wire::types::Status>| {
            m.values().map(|s| s.session_count).max().unwrap_or(0)
        };
        assert_eq!(
            sessions(&after),
            sessions(&before),
            "the refused open reached the cell"
        );
        assert_eq!(client.sessions_open(), 3);

        held.pop().unwrap().close().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.sessions_open() > 2 {
            assert!(
                Instant::now() < deadline,
                "the closed session kept its place"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let again = client.open_session().await.unwrap();
        again
            .create("/again", vec![], CreateMode::default())
            .await
            .unwrap();
    });
}

/// A closed session lets go of its client at once: once the application has closed the
/// session and dropped both handles, the client's connections close and its UDP socket is
/// released within a second or so. Before, the KeepAlive loop slept out its third of a
/// lease (4 s here) holding the client, so a process opening a client per short job held
/// thousands (loadgen's `burst`: 12 GB).
#[test]
fn a_closed_session_lets_go_of_its_client_at_once() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts {
            replicas: 3,
            ..Opts::default()
        });
        let client = cell.client().await;
        cell.wait_leader(&client, Duration::from_secs(20), None)
            .await;
        drop(client);
        for round in 0..3 {
            let client = client_sdk::Client::connect(cell.client_config())
                .await
                .unwrap();
            let port = client.local_addr().unwrap().port();
            let s = client.open_session().await.unwrap();
            s.create(
                &format!("/e{round}"),
                vec![],
                CreateMode {
                    ephemeral: true,
                    sequential: false,
                },
            )
            .await
            .unwrap();
            s.close().await.unwrap();
            drop(s);
            drop(client);
            let closed = Instant::now();
            // The port is free once the client's endpoint (and its socket) is gone.
            loop {
                if std::net::UdpSocket::bind(("0.0.0.0", port)).is_ok() {
                    break;
                }
                assert!(
                    closed.elapsed() < Duration::from_secs(2),
                    "round {round}: the client of a closed session still holds UDP port {port} \
                     after {:?}",
                    closed.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!(
                "FIGURE round {round}: client's UDP port free {} ms after close and drop",
                closed.elapsed().as_millis()
            );
        }
    });
}

/// Every linearizable read at the leader confirms its leadership with a quorum round, and
/// openraft 0.9 makes a new network client for each round: a client must take an idle
/// connection to its peer from the pool rather than dial (before, each round dialed every
/// follower again, a TLS handshake per follower per read: 200 dials for these reads). Once
/// warm (a round may end while one follower's answer is still out, so up to two
/// connections per follower serve the rounds), 100 reads one after another, each its own
/// round, dial at most the pool's size more. A pooled connection keeps the record of its
/// peer's certificate check, so those reads verify no more certificate chains than they
/// dial connections (before, each round verified each follower's chain again: 200 checks
/// for these reads, a fifth of the leader's CPU under `loadgen profile`).
#[test]
fn leadership_checks_reuse_the_peer_connections() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts { replicas: 3, ..Opts::default() });
        let client = cell.client().await;
        let leader = cell.wait_leader(&client, Duration::from_secs(20), None).await;
        let s = client.open_session().await.unwrap();
        s.create("/probe", b"x".to_vec(), CreateMode::default()).await.unwrap();
        for _ in 0..20 {
            client.get("/probe").await.unwrap();
        }
        // Let the leader's replication to both followers settle (their connections dialed).
        let mut before = cell.statuses(&client).await[&leader].peer_dials;
        let mut checks_before = 0;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let st = &cell.statuses(&client).await[&leader];
            let now = st.peer_dials;
            checks_before = st.peer_certificate_checks;
            if now == before && now >= 2 {
                break;
            }
            before = now;
        }
        for _ in 0..100 {
            assert_eq!(client.get("/probe").await.unwrap().0, b"x");
        }
        let statuses = cell.statuses(&client).await;
        let after = statuses[&leader].peer_dials;
        let checks_after = statuses[&leader].peer_certificate_checks;
        println!("FIGURE peer dials at the leader: {before} before 100 linearizable reads, {after} after");
        println!("FIGURE peer certificate checks at the leader: {checks_before} before, {checks_after} after");
        assert!(checks_before >= 2, "the peers' certificates were never checked ({checks_before})");
        assert!(
            checks_after - checks_before <= after - before,
            "100 leadership checks verified {} peer certificates on {} new connections",
            checks_after - checks_before,
            after - before
        );
        // Up to the pool's four idle connections per follower may still be dialed.
        assert!(after <= before + 8, "100 leadership checks dialed {} new peer connections", after - before);
        for (id, st) in &statuses {
            assert!(st.peer_dials <= 16, "replica {id} dialed {} peer connections", st.peer_dials);
        }
        s.close().await.unwrap();
    });
}

/// A follower killed (`kill -9`) and restarted at the same address is replicated to, and
/// answers clients, as soon as it is up: its new process answers connections to the old
/// one (the leader's, the client's) with a stateless reset, since both processes sign
/// them with keys derived from the TLS key and address, and they dial it again at once.
/// With quinn's random key per process both would send into the dead connections until
/// QUIC's 3 s idle timeout (measured: the client's status request answered 3.0 s after
/// the kill), and the follower would wait that long for the cell's writes.
#[test]
fn a_restarted_follower_is_replicated_to_at_once() {
    let _g = serial();
    rt().block_on(async {
        let mut cell = TestCell::start(Opts {
            replicas: 3,
            ..Opts::default()
        });
        let client = cell.client().await;
        let leader = cell
            .wait_leader(&client, Duration::from_secs(20), None)
            .await;
        let s = client.open_session().await.unwrap();
        s.create("/before", b"x".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let applied = cell.statuses(&client).await[&leader].last_applied;
        cell.wait_applied(&client, applied, Duration::from_secs(20))
            .await;
        let follower = (1..=3).find(|id| *id != leader).unwrap();
        let addr = cell.addr(follower).parse().unwrap();

        cell.kill(follower);
        let killed = Instant::now();
        cell.spawn(follower);
        // A write the restarted follower must receive (the leader and the other follower
        // commit it meanwhile).
        s.create("/after", b"y".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let index = cell.statuses(&client).await[&leader].last_applied;
        let mut caught = None;
        for _ in 0..1_000 {
            if let Ok(st) = client.status_of(addr).await {
                if st.last_applied >= index {
                    caught = Some(killed.elapsed());
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let caught = caught.unwrap_or_else(|| {
            panic!(
                "the restarted follower did not catch up within 1 000 polls ({:?}); logs in {}",
                killed.elapsed(),
                cell.dir.path().display()
            )
        });
        println!(
            "FIGURE restarted follower: had the write and answered {} ms after the kill",
            caught.as_millis()
        );
        assert!(
            caught < Duration::from_millis(2_500),
            "the restarted follower had the leader's write and answered {caught:?} after \
             the kill (QUIC's idle timeout is {} ms); logs in {}",
            wire::quic::IDLE_TIMEOUT_MS,
            cell.dir.path().display()
        );
        s.close().await.unwrap();
    });
}

/// A page of `Op::Sessions` stops at its byte budget (half a client frame), not only at
/// its count: 300 sessions each owning 8 ephemeral nodes with 1 000-byte paths (about
/// 8 KiB listed per session, 2.4 MB in all) come in pages of fewer than 300 though 1 000
/// were asked for, each page saying more follow, and paging on from each page's last id
/// lists every session exactly once.
#[test]
fn a_sessions_page_stops_at_its_byte_budget() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts {
            replicas: 1,
            ..Opts::default()
        });
        let client = cell.client().await;
        cell.wait_leader(&client, Duration::from_secs(20), None)
            .await;
        let root = client.open_session().await.unwrap();
        root.create("/e", vec![], CreateMode::default())
            .await
            .unwrap();
        let mut opened = std::collections::BTreeSet::new();
        let mut held = Vec::new();
        for _ in 0..300 {
            let s = client.open_session().await.unwrap();
            let ops = (0..8)
                .map(|k| {
                    let name = format!("s{}-{k}-", s.id());
                    wire::types::TxnOp::Create {
                        path: format!("/e/{name}{}", "x".repeat(997 - name.len())),
                        data: Vec::new(),
                        mode: CreateMode {
                            ephemeral: true,
                            sequential: false,
                        },
                    }
                })
                .collect();
            s.txn(ops).await.unwrap();
            opened.insert(s.id());
            held.push(s);
        }
        let (mut listed, mut pages, mut after) = (Vec::new(), 0, 0);
        loop {
            let (sessions, more) = match client
                .request(wire::types::Op::Sessions {
                    after,
                    limit: 1_000,
                })
                .await
                .unwrap()
            {
                wire::types::Reply::Sessions { sessions, more } => (sessions, more),
                other => panic!("{other:?}"),
            };
            pages += 1;
            let ours = sessions.iter().filter(|s| opened.contains(&s.id)).count();
            if pages == 1 {
                assert!(
                    more && ours < 300,
                    "the first page listed {ours} of the 300 sessions, more: {more}"
                );
            }
            for s in &sessions {
                if opened.contains(&s.id) {
                    assert_eq!(
                        (s.ephemerals, s.ephemeral_paths.len()),
                        (8, 8),
                        "session {}",
                        s.id
                    );
                }
            }
            after = sessions.last().map(|s| s.id).unwrap_or(after);
            listed.extend(sessions.into_iter().map(|s| s.id));
            if !more {
                break;
            }
            assert!(pages < 10, "more than 10 pages");
        }
        let listed_ours: Vec<u64> = listed
            .iter()
            .copied()
            .filter(|id| opened.contains(id))
            .collect();
        let unique: std::collections::BTreeSet<u64> = listed_ours.iter().copied().collect();
        assert_eq!(unique.len(), listed_ours.len(), "a session listed twice");
        assert_eq!(unique, opened, "every session listed");
        println!(
            "FIGURE sessions listing: 300 sessions with 8 paths of 1 000 bytes each came \
             in {pages} pages"
        );
    });
}
