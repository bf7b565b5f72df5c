//! A cache behind a proxy stays consistent when the proxy is frozen, a client is deaf to
//! invalidations or never acknowledges them, the leader fails over, or an ephemeral's
//! session expires.

use super::*;

/// A proxy frozen (SIGSTOP) for longer than a lease, with a lock holder and a cacher
/// behind it: both move to the other proxy and keep their sessions; a write to the cached
/// node completes (the frozen proxy's session runs out at the leader) and no reader sees
/// the old value after it. Thawed, the proxy finds its session gone, opens a new one, and
/// serves correct values again.
#[test]
fn frozen_proxy_loses_nothing() {
    let _g = serial();
    let cell = Cell::start(2);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        writer
            .create("/locks", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let behind = cell.client(&cell.proxies).await; // proxy 1 first, then proxy 2
        let reader = behind.open_session().await.unwrap();
        let holder = behind.open_session().await.unwrap();
        let guard = Lock::exclusive(&holder, "/locks/f")
            .acquire()
            .await
            .unwrap();
        assert_eq!(reader.get_cached("/cfg").await.unwrap().unwrap().0, b"v1");
        let p1 = pid_listening(&cell.data, "proxy", &cell.proxies[0]).expect("proxy 1");
        let p1_before = proxy_status(&direct, &cell.proxies[0]).await.session;
        unsafe { libc::kill(p1, libc::SIGSTOP) };
        let frozen = Instant::now();
        // A reader that keeps reading through the freeze: never older than a completed write.
        let r = reader.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
        let (stop2, done2) = (stop.clone(), done_at.clone());
        let reads = tokio::spawn(async move {
            let mut n = 0u64;
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                let started = Instant::now();
                if let Ok(Some((v, _))) = r.get_cached("/cfg").await {
                    let done = *done2.lock().unwrap();
                    if done.is_some_and(|d| d < started) {
                        assert_eq!(v, b"v2", "stale read after the write completed");
                    }
                    n += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        });
        let wrote = Instant::now();
        writer.set_data("/cfg", b"v2".to_vec(), None).await.unwrap();
        *done_at.lock().unwrap() = Some(Instant::now());
        let write_ms = wrote.elapsed().as_millis();
        // Past a lease since the freeze.
        let left = Duration::from_secs(16).saturating_sub(frozen.elapsed());
        tokio::time::sleep(left).await;
        assert_eq!(
            holder.state(),
            SessionState::Healthy,
            "holder lost its session"
        );
        assert_eq!(
            reader.state(),
            SessionState::Healthy,
            "reader lost its session"
        );
        assert!(holder.check_sequencer(guard.sequencer()).await.unwrap());
        unsafe { libc::kill(p1, libc::SIGCONT) };
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let n = reads.await.unwrap();
        // Thawed: a new session, and correct service through it.
        let fresh = cell.client(&cell.proxies[..1]).await;
        let s = fresh.open_session().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = proxy_status(&direct, &cell.proxies[0]).await;
            if st.session != 0 && st.session != p1_before {
                break;
            }
            assert!(Instant::now() < deadline, "thawed proxy has no new session");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match s.get_cached("/cfg").await {
                Ok(Some((v, _))) => {
                    assert_eq!(v, b"v2");
                    break;
                }
                other => {
                    assert!(Instant::now() < deadline, "thawed proxy: {other:?}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        let (_, _, w) = s.get_watch("/cfg").await.unwrap();
        writer.set_data("/cfg", b"v3".to_vec(), None).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .expect("watch through the thawed proxy")
            .unwrap();
        println!(
            "FIGURE proxy frozen 16 s: write to a node cached behind it took {write_ms} ms; \
             {n} reads, none stale; holder and reader kept their sessions"
        );
    });
    cell.stop();
}

/// A client that renews through a proxy but never opens its event stream (a stream stuck
/// somewhere) would make the proxy, and so the leader, hold a write to a node it cached
/// for ever. The proxy repeats the unacknowledged invalidation in the client's KeepAlive
/// replies (Chubby's piggyback); its acknowledgement releases the write.
#[test]
fn a_deaf_client_hears_of_the_invalidation_in_its_keepalive_reply() {
    let _g = serial();
    let cell = Cell::start(1);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let via = cell.client(&cell.proxies).await;
        let proxy: std::net::SocketAddr = cell.proxies[0].parse().unwrap();
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let deaf = match via
            .call_at(
                proxy,
                &Request {
                    session: 0,
                    request_id: 0,
                    ack_below: 0,
                    op: Op::CreateSession,
                },
            )
            .await
            .unwrap()
        {
            Reply::SessionCreated { session, .. } => session,
            other => panic!("{other:?}"),
        };
        let raw = |op: Op| Request {
            session: deaf,
            request_id: 0,
            ack_below: 0,
            op,
        };
        // Cached through the proxy (a second read is served from the proxy's cache).
        cache_through_proxy(&via, proxy, deaf, "/cfg")
            .await
            .unwrap();
        match via.call_at(proxy, &raw(Op::KeepAlive)).await.unwrap() {
            Reply::KeepAlive { unacknowledged, .. } => assert!(unacknowledged.is_empty()),
            other => panic!("{other:?}"),
        }
        let t = Instant::now();
        let write =
            tokio::spawn(async move { writer.set_data("/cfg", b"v2".to_vec(), None).await });
        let mut heard = None;
        for _ in 0..40 {
            if write.is_finished() {
                break;
            }
            // Each KeepAlive waits for the proxy's next batch (about a second).
            match via.call_at(proxy, &raw(Op::KeepAlive)).await.unwrap() {
                Reply::KeepAlive { unacknowledged, .. } if !unacknowledged.is_empty() => {
                    let (id, paths) = &unacknowledged[0];
                    assert_eq!(paths, &vec!["/cfg".to_string()]);
                    heard.get_or_insert(t.elapsed());
                    let r = via
                        .call_at(proxy, &raw(Op::AckInvalidations { ids: vec![*id] }))
                        .await
                        .unwrap();
                    assert!(matches!(r, Reply::Acked), "{r:?}");
                }
                Reply::KeepAlive { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        let heard = heard.expect("a KeepAlive reply repeated the invalidation");
        tokio::time::timeout(Duration::from_secs(5), write)
            .await
            .expect("the write completed")
            .unwrap()
            .unwrap();
        let took = t.elapsed();
        println!(
            "FIGURE proxy: a renewing client without an event stream heard of the \
             invalidation in a KeepAlive reply after {} ms; the write completed after {} ms",
            heard.as_millis(),
            took.as_millis()
        );
        assert!(
            took < Duration::from_secs(8),
            "the write waited {took:?} (lease 12 s)"
        );
        let p = proxy_status(&direct, &cell.proxies[0]).await;
        assert_eq!(p.pending_invalidations, 0, "{p:?}");
    });
    cell.stop();
}

/// A proxy reopens its event stream at a new leader only once no client owes it an
/// acknowledgement, not only the clients of its latest flush. A client that cached `/cfg`
/// through the proxy goes deaf: it never acknowledges the write's invalidation and stops
/// renewing. The write waits for the proxy, the proxy for the deaf client; then the
/// leader is killed. The new leader knows nothing of the old one's cachers and takes the
/// proxy's reopened stream as its word that nothing cached through it is left, so the
/// retried write completes as soon as the stream opens. The deaf client holds no paths
/// any more (they went with the invalidation), so the proxy's reset names no one: only
/// the rule that no client owes anything keeps the stream closed until that client's
/// lease has run out (12 s after its last renewal). Opened sooner, the write completes
/// while the deaf client may still serve the old value from its cache.
#[test]
fn a_stream_reopened_at_a_new_leader_waits_for_a_client_still_owing_an_invalidation() {
    let _g = serial();
    let cell = Cell::start(1);
    let outcome: Result<(), String> = rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let via = cell.client(&cell.proxies).await;
        let paddr: std::net::SocketAddr = cell.proxies[0].parse().unwrap();
        let deaf = first_proxied_session(&via, paddr).await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        cache_through_proxy(&via, paddr, deaf, "/cfg").await?;
        // The deaf client's last renewal: its lease (as the client counts it) ends 12 s
        // from when it sent this KeepAlive.
        let renewed = Instant::now();
        match via.call_at(paddr, &raw(deaf, Op::KeepAlive)).await.unwrap() {
            Reply::KeepAlive { .. } => {}
            other => return Err(format!("KeepAlive: {other:?}")),
        }
        let write = tokio::spawn(async move {
            writer.set_data("/cfg", b"v2".to_vec(), None).await?;
            Ok::<Instant, Error>(Instant::now())
        });
        // The write is held (the leader waits for an invalidation) and not done.
        let deadline = Instant::now() + Duration::from_secs(10);
        while leader_status(&direct).await.oldest_invalidation_ms == 0 {
            if write.is_finished() || Instant::now() > deadline {
                return Err("the write did not wait for the deaf client".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if write.is_finished() {
            return Err("the write did not wait for the deaf client".into());
        }
        let replicas = cell.replicas.join(",");
        let data = cell.data.clone();
        tokio::task::spawn_blocking(move || kill_leader(&data, &replicas))
            .await
            .unwrap()
            .ok_or("no leader to kill")?;
        let done = tokio::time::timeout(Duration::from_secs(40), write)
            .await
            .map_err(|_| "the write did not complete within 40 s".to_string())?
            .unwrap()
            .map_err(|e| format!("the write failed: {e}"))?;
        let after = done.duration_since(renewed);
        println!(
            "the write completed {} ms after the deaf client's last renewal (its lease: 12 s)",
            after.as_millis()
        );
        // 10 s leaves room for the proxy's tick and the test's own steps, and is far from
        // the ~3 s (an election) the write takes when the stream reopens without waiting.
        if after < Duration::from_secs(10) {
            return Err(format!(
                "the write completed {} ms after the deaf client's last renewal, inside \
                 its 12 s lease: the proxy reopened its stream while the client still owed \
                 the invalidation",
                after.as_millis()
            ));
        }
        Ok(())
    });
    let logs = cell.logs();
    cell.stop();
    if let Err(e) = outcome {
        panic!("{e}; {logs}");
    }
}

/// Issue 22, item 1 through a proxy: S's lease runs out and its expiry holds S's
/// ephemerals as they are then ({/svc/e1}), waiting for H (a direct raw cacher that does
/// not acknowledge yet); meanwhile S creates the ephemeral /svc/x and R, a client of the
/// proxy, caches it; then H acknowledges and the expiry deletes /svc/x. Before the fix
/// the proxy (one cacher upstream) was never invalidated and R kept reading /svc/x.
#[test]
fn an_ephemeral_created_while_its_session_expires_is_not_served_by_a_proxy_after() {
    let _g = serial();
    let lease_ms = 3_000u64;
    let cell = Cell::start_with(1, &["--lease-ms", "3000"]);
    let outcome: Result<(), String> = rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let via = cell.client(&cell.proxies).await;
        let paddr: std::net::SocketAddr = cell.proxies[0].parse().unwrap();
        first_proxied_session(&via, paddr).await;
        let owner = direct.open_session().await.unwrap();
        owner
            .create("/svc", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let new_session = || async {
            match direct.request(Op::CreateSession).await.unwrap() {
                Reply::SessionCreated { session, .. } => session,
                other => panic!("{other:?}"),
            }
        };
        let create = |path: &str| Op::Create {
            path: path.into(),
            data: b"s".to_vec(),
            mode: CreateMode {
                ephemeral: true,
                sequential: false,
            },
        };
        let s = new_session().await;
        let with_id = |session, request_id, op| Request {
            request_id,
            ..raw(session, op)
        };
        let r = direct.call(with_id(s, 1, create("/svc/e1"))).await;
        if !matches!(r, Ok(Reply::Created { .. })) {
            return Err(format!("create /svc/e1: {r:?}"));
        }
        let h = new_session().await;
        let r = direct
            .call(raw(h, Op::CachedGet { path: "/svc/e1".into() }))
            .await;
        if !matches!(r, Ok(Reply::CachedData { cachable: true, .. })) {
            return Err(format!("H's cached read: {r:?}"));
        }
        let deadline = Instant::now() + Duration::from_millis(lease_ms * 4);
        let invalidation = loop {
            if Instant::now() > deadline {
                return Err("S's expiry never held /svc/e1".into());
            }
            if let Ok(Reply::KeepAlive { unacknowledged, .. }) =
                direct.call(raw(h, Op::KeepAlive)).await
            {
                if let Some((id, _)) = unacknowledged.first() {
                    break *id;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let r = direct.call(with_id(s, 2, create("/svc/x"))).await;
        let created = matches!(r, Ok(Reply::Created { .. }));
        let reader = via.open_session().await.unwrap();
        let seen = reader.get_cached("/svc/x").await.unwrap();
        if seen.is_some() != created {
            return Err(format!("R read {seen:?} after the create answered {r:?}"));
        }
        let r = direct
            .call(raw(h, Op::AckInvalidations { ids: vec![invalidation] }))
            .await;
        if !matches!(r, Ok(Reply::Acked)) {
            return Err(format!("H's acknowledgement: {r:?}"));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while direct.exists("/svc/x").await.unwrap().is_some()
            || direct.exists("/svc/e1").await.unwrap().is_some()
        {
            if Instant::now() > deadline {
                return Err("S's expiry never applied".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if reader.state() != SessionState::Healthy {
            return Err(format!("R is {:?}", reader.state()));
        }
        // Through the SDK's own cache and through the proxy's (a second session of the
        // proxy's client reads it too).
        let other = via.open_session().await.unwrap();
        for (who, session) in [("R", &reader), ("another client", &other)] {
            let cached = session.get_cached("/svc/x").await.unwrap();
            if cached.is_some() {
                return Err(format!(
                    "{who} read /svc/x through the proxy after S's expiry removed it: {cached:?}"
                ));
            }
        }
        println!("FIGURE proxy: an ephemeral created during its session's expiry (created={created}) is not served after its removal");
        Ok(())
    });
    let log = |name: &str| std::fs::read_to_string(cell.data.join(name)).unwrap_or_default();
    let logs = format!(
        "proxy log:\n{}\nleader logs:\n{}",
        log("proxy-1.log"),
        log("replica-1.log")
    );
    cell.stop();
    if let Err(e) = outcome {
        panic!("{e}; {logs}");
    }
}

/// Issue 22, item 5: a client of a proxy that renews but never acknowledges an
/// invalidation (it ignores the ones its KeepAlive replies repeat) used to keep its cache
/// rights for as long as it renewed: the proxy waited for it, and so did the write. Now the
/// proxy stops relaying its KeepAlives after a lease (it is told `SessionExpired`), its
/// lease runs out, and the write goes on; the proxy's own session and its other clients
/// are unharmed.
#[test]
fn a_proxy_client_that_renews_but_never_acknowledges_loses_its_session() {
    let _g = serial();
    let lease_ms = 3_000u64;
    let cell = Cell::start_with(1, &["--lease-ms", "3000"]);
    let outcome: Result<(), String> = rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let via = cell.client(&cell.proxies).await;
        let paddr: std::net::SocketAddr = cell.proxies[0].parse().unwrap();
        let bad = first_proxied_session(&via, paddr).await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let good = via.open_session().await.unwrap();
        good.get_cached("/cfg").await.unwrap();
        cache_through_proxy(&via, paddr, bad, "/cfg").await?;
        let held_at = Instant::now();
        let write = tokio::spawn(async move {
            writer.set_data("/cfg", b"v2".to_vec(), None).await?;
            Ok::<Instant, Error>(Instant::now())
        });
        let bound = Duration::from_millis(lease_ms * 4);
        let refused_at = loop {
            if held_at.elapsed() > bound {
                return Err(format!("the client was renewed for {:?} without acknowledging", held_at.elapsed()));
            }
            match via.call_at(paddr, &raw(bad, Op::KeepAlive)).await {
                Ok(Reply::KeepAlive { .. }) => {}
                Err(Error::SessionExpired { .. }) => break Instant::now(),
                other => return Err(format!("KeepAlive: {other:?}")),
            }
            if write.is_finished() {
                return Err("the write went on while the client still cached /cfg".into());
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        let refused_after = refused_at.duration_since(held_at);
        if refused_after < Duration::from_millis(lease_ms) {
            return Err(format!("refused after {refused_after:?}, inside a lease"));
        }
        let done = tokio::time::timeout(bound, write)
            .await
            .map_err(|_| "the write never completed".to_string())?
            .unwrap()
            .map_err(|e| format!("the write failed: {e}"))?;
        let took = done.duration_since(held_at);
        if took > Duration::from_millis(lease_ms * 2 + 2_000) {
            return Err(format!("the write took {took:?}"));
        }
        // The proxy's other client keeps its session and reads the new value.
        if good.state() != SessionState::Healthy {
            return Err(format!("the good client is {:?}", good.state()));
        }
        let v = good.get_cached("/cfg").await.unwrap().map(|(d, _)| d);
        if v.as_deref() != Some(&b"v2"[..]) {
            return Err(format!("the good client read {v:?}"));
        }
        println!(
            "FIGURE proxy: a client renewing without acknowledging was refused after {} ms; the write held for it completed after {} ms (lease {lease_ms} ms)",
            refused_after.as_millis(),
            took.as_millis()
        );
        Ok(())
    });
    let logs = cell.logs();
    cell.stop();
    if let Err(e) = outcome {
        panic!("{e}; {logs}");
    }
}
