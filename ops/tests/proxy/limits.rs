//! Bad input and limits at a proxy.

use super::*;

/// Bad input and limits at a proxy: typed errors that name the problem, and the proxy
/// keeps serving. Also: a session ended at the cell is reported to its client through
/// the proxy.
#[test]
fn proxy_limits_bad_input_and_expiry_reporting() {
    let _g = serial();
    let cell = Cell::start(1);
    // A second proxy with tight limits, started by hand from its own config file. Its
    // "cell" is a port nobody answers on, so every forwarded request takes the whole
    // forward timeout: a request that stays in flight for sure.
    let port = free_base_from(
        cell.proxies[0]
            .rsplit(':')
            .next()
            .unwrap()
            .parse::<u16>()
            .unwrap()
            + 16,
        1,
    );
    let listen = format!("127.0.0.1:{port}");
    let dead = format!("127.0.0.1:{}", free_base_from(port + 16, 1));
    let cfg_path = cell.data.join("tight-proxy.toml");
    let abs = std::fs::canonicalize(&cell.data).unwrap();
    let tls = |f: &str| abs.join("tls").join(f).display().to_string();
    let config = format!(
        "listen = \"{listen}\"\nreplicas = [{dead:?}]\nmax_clients = 1\n\
         max_inflight_per_client = 1\nforward_timeout_ms = 3000\n\
         [tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        tls("ca.pem"),
        tls("proxy.pem"),
        tls("proxy.key"),
    );
    std::fs::write(&cfg_path, config).unwrap();
    let tight = KillOnDrop(
        std::process::Command::new(LOCKCTL)
            .args(["proxy", "--config"])
            .arg(&cfg_path)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let status = Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::Status,
        };
        let proxy_status_req = Request {
            op: Op::ProxyStatus,
            ..status.clone()
        };
        // The first client is served (poll until the proxy is up).
        let first = cell.client(std::slice::from_ref(&listen)).await;
        let addr = listen.parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while first.call_at(addr, &proxy_status_req).await.is_err() {
            assert!(Instant::now() < deadline, "tight proxy did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A second client connection is refused, naming the limit.
        let second = cell.client(std::slice::from_ref(&listen)).await;
        match second.call_at(addr, &proxy_status_req).await {
            Err(Error::Unavailable { reason }) if reason.contains("limit of 1 clients") => {}
            other => panic!("expected a refusal naming the client limit, got {other:?}"),
        }
        // One request in flight at a time: a Status waiting for the unreachable cell
        // holds the slot; a request sent meanwhile is refused as `Busy`, naming the limit,
        // and a retry is safe.
        let f = first.clone();
        let st = status.clone();
        let pending = tokio::spawn(async move { f.call_at(addr, &st).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        match first.call_at(addr, &proxy_status_req).await {
            Err(e @ Error::Busy { limit: 1 }) => {
                assert!(e.is_retryable());
                assert!(!e.is_deterministic());
            }
            other => panic!("expected Busy with limit 1, got {other:?}"),
        }
        // The SDK's own path retries it: answered once the held slot is free (the Status
        // holds it for the whole forward timeout, 3 s), not refused.
        assert!(!pending.is_finished(), "the slot is still held");
        let retried = first
            .call_until(
                proxy_status_req.clone(),
                tokio::time::Instant::now() + Duration::from_secs(15),
            )
            .await;
        assert!(
            matches!(retried, Ok(Reply::ProxyStatus(_))),
            "a Busy request is retried until it is served, got {retried:?}"
        );
        assert!(
            pending.is_finished(),
            "served only after the slot was freed"
        );
        match pending.await.unwrap() {
            Err(e @ (Error::Unavailable { .. } | Error::Timeout { .. })) => {
                assert!(e.is_retryable())
            }
            other => panic!("expected a retryable error from the unreachable cell, got {other:?}"),
        }
        assert!(
            first.call_at(addr, &proxy_status_req).await.is_ok(),
            "served again"
        );

        // The dev proxy: a session the cell never had, requests that make no sense there,
        // and a garbage frame.
        let p = &cell.proxies[0];
        let paddr = p.parse().unwrap();
        let via = cell.client(std::slice::from_ref(p)).await;
        let ka = Request {
            session: 999_999,
            request_id: 0,
            ack_below: 0,
            op: Op::KeepAlive,
        };
        match via.call_at(paddr, &ka).await {
            Err(Error::UnknownSession { session: 999_999 }) => {}
            other => panic!("expected UnknownSession, got {other:?}"),
        }
        // A client's batched KeepAlives: bad ones are refused whole, unknown sessions named.
        let batch = |sessions: Vec<u64>| Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::KeepAliveBatch { sessions },
        };
        assert!(matches!(
            via.call_at(paddr, &batch(vec![0, 1])).await,
            Err(Error::SessionRequired)
        ));
        assert!(matches!(
            via.call_at(paddr, &batch(vec![7; wire::KEEPALIVE_BATCH_MAX + 1]))
                .await,
            Err(Error::BadRequest { .. })
        ));
        match via.call_at(paddr, &batch(vec![999_999, 999_998])).await {
            Ok(Reply::KeepAliveBatch {
                renewed, unknown, ..
            }) => {
                assert!(renewed.is_empty());
                assert_eq!(unknown.len(), 2, "{unknown:?}");
            }
            other => panic!("expected unknown sessions, got {other:?}"),
        }
        // Batched invalidation acknowledgements: checked whole, at the proxy and the cell.
        let acks = |acks: Vec<(u64, Vec<u64>)>| Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::AckInvalidationsBatch { acks },
        };
        let raddr = cell.replicas[0].parse().unwrap();
        for addr in [paddr, raddr] {
            assert!(matches!(
                via.call_at(addr, &acks(vec![(5, vec![1]), (0, vec![2])]))
                    .await,
                Err(Error::SessionRequired)
            ));
            assert!(matches!(
                via.call_at(addr, &acks(vec![(5, vec![])])).await,
                Err(Error::BadRequest { .. })
            ));
            let too_many = (1..=wire::KEEPALIVE_BATCH_MAX as u64 + 1)
                .map(|s| (s, vec![1]))
                .collect();
            assert!(matches!(
                via.call_at(addr, &acks(too_many)).await,
                Err(Error::BadRequest { .. })
            ));
            // Ids nobody is waiting for (a late or repeated acknowledgement) change nothing.
            assert!(matches!(
                via.call_at(addr, &acks(vec![(999_999, vec![12_345])]))
                    .await,
                Ok(Reply::Acked)
            ));
        }
        let ps = Request {
            op: Op::ProxyStatus,
            ..status.clone()
        };
        assert!(matches!(
            direct.call_at(raddr, &ps).await,
            Err(Error::BadRequest { .. })
        ));
        let files = wire::tls::TlsConfig::client_in_dir(cell.ca().parent().unwrap());
        let (tls, _) = wire::tls::client_config(&files, wire::hello::ALPN_CLIENT).unwrap();
        let ep = wire::quic::client_endpoint(tls, "127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = ep
            .connect(paddr, wire::tls::SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        wire::frame::write(&mut s, &wire::hello::Hello::new("garbage test"), 4096)
            .await
            .unwrap();
        let _ = s.finish();
        let hello: wire::hello::HelloReply = wire::frame::read(&mut r, 4096).await.unwrap();
        hello.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&[0, 0, 0, 3, 0xff, 0xff, 0xff]).await.unwrap();
        let _ = s.finish();
        let resp: wire::types::Response = wire::frame::read(&mut r, wire::CLIENT_FRAME_BYTES_MAX)
            .await
            .unwrap();
        assert!(matches!(resp, Err(Error::Malformed { .. })), "{resp:?}");
        // A proxy takes clients only: a replica's certificate (of its own cell, from its
        // CA) passes the handshake and is closed before its first frame is read.
        let files = wire::tls::TlsConfig::replica_in_dir(cell.ca().parent().unwrap());
        let (tls, _) = wire::tls::client_config(&files, wire::hello::ALPN_CLIENT).unwrap();
        let ep = wire::quic::client_endpoint(tls, "127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = ep
            .connect(paddr, wire::tls::SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        let said = async {
            let (mut s, mut r) = conn.open_bi().await.map_err(|e| e.to_string())?;
            wire::frame::write(&mut s, &wire::hello::Hello::new("a replica"), 4096)
                .await
                .map_err(|e| e.to_string())?;
            let _ = s.finish();
            let r: Result<wire::hello::HelloReply, _> = wire::frame::read(&mut r, 4096).await;
            Ok::<_, String>(r.is_ok())
        };
        let answered = tokio::time::timeout(Duration::from_secs(5), said).await;
        assert!(
            !matches!(answered, Ok(Ok(true))),
            "the proxy answered a replica's hello"
        );
        let reason = conn
            .close_reason()
            .map(|r| r.to_string())
            .unwrap_or_default();
        assert!(reason.contains("may not connect to a proxy"), "{reason}");

        // `lockctl proxy-status` shows the counters.
        let o = lockctl(p, &cell.ca(), &["proxy-status"]);
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        assert!(out.contains("batches") && out.contains(p.as_str()), "{out}");

        // A session ended at the cell (closed here by another client) is reported to its
        // client through the proxy within a KeepAlive interval or two.
        let victim = via.open_session().await.unwrap();
        let close = Request {
            session: victim.id(),
            request_id: 1,
            ack_below: 0,
            op: Op::CloseSession,
        };
        direct.call(close).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), victim.expired())
            .await
            .expect("expiry not reported through the proxy");
    });
    drop(tight);
    cell.stop();
}
