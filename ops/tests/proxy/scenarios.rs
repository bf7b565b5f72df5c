//! Issue 5's scenarios: KeepAlives batched, a holder surviving its proxy, the cache
//! through two proxies, one upstream watch fanned out, a leader kill answered exactly once.

use super::*;

/// Scenario 1: 2 000 sessions through one proxy for 60 s. The leader answers about one
/// batched KeepAlive RPC a second (at most 2) and no session expires.
#[test]
fn keepalives_are_batched_and_no_session_expires() {
    let _g = serial();
    let n = env_or("PROXY_SESSIONS", 2_000) as usize;
    let soak = Duration::from_secs(env_or("PROXY_SOAK_SECS", 60));
    let cell = Cell::start(1);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        // Two connections to the proxy (each QUIC connection carries at most 4 096
        // streams, and every session keeps one open for its events).
        let via = vec![
            cell.client(&cell.proxies).await,
            cell.client(&cell.proxies).await,
        ];
        let opened = Instant::now();
        let sessions = open_sessions(&via, n, 200).await;
        println!(
            "FIGURE proxy: {n} sessions opened through one proxy in {} ms",
            opened.elapsed().as_millis()
        );
        let s0 = leader_status(&direct).await;
        let t0 = Instant::now();
        tokio::time::sleep(soak).await;
        let s1 = leader_status(&direct).await;
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(s0.id, s1.id, "the leader changed during the run");
        let rpcs = s1.keepalive_rpcs - s0.keepalive_rpcs;
        let renewed = s1.keepalives_renewed - s0.keepalives_renewed;
        let rate = rpcs as f64 / secs;
        let p = proxy_status(&direct, &cell.proxies[0]).await;
        println!(
            "FIGURE proxy: {n} sessions for {secs:.0} s: leader answered {rpcs} KeepAlive RPCs \
             ({rate:.2}/s) renewing {renewed} leases; proxy sent {} batches carrying {} \
             KeepAlives",
            p.keepalive_batches, p.keepalives_batched
        );
        assert!(rate <= 2.0, "{rate:.2} KeepAlive RPCs/s at the leader");
        // Both servers time what they answer: the leader each batch, the proxy each
        // client's (which waits for the next batch upstream).
        let at_leader = wire::latency::find(&s1.request_latency, "KeepAliveBatch")
            .expect("the leader timed its KeepAlive batches")
            .since(wire::latency::find(&s0.request_latency, "KeepAliveBatch"))
            .unwrap();
        let at_leader = wire::latency::summarize(&at_leader);
        assert!(
            at_leader.count.abs_diff(rpcs) <= 2,
            "{at_leader:?} timed, {rpcs} answered"
        );
        let at_proxy: u64 = ["KeepAlive", "KeepAliveBatch"]
            .iter()
            .filter_map(|op| wire::latency::find(&p.request_latency, op))
            .map(|l| l.histogram().unwrap().len())
            .sum();
        assert!(
            at_proxy >= rpcs,
            "the proxy timed {at_proxy} client KeepAlives"
        );
        println!(
            "FIGURE proxy: KeepAlive batch at the leader p50 {:.2} ms, p99 {:.2} ms",
            at_leader.p50_ms, at_leader.p99_ms
        );
        // Every session renews every lease/3 = 4 s.
        let expected = (n as f64 * secs / 4.0) as u64;
        assert!(
            renewed >= expected * 8 / 10,
            "only {renewed} renewals, expected about {expected}"
        );
        let unhealthy = sessions
            .iter()
            .filter(|s| s.state() != SessionState::Healthy)
            .count();
        assert_eq!(unhealthy, 0, "sessions not healthy after the run");
        assert!(s1.session_count as usize > n, "sessions lost at the leader");
        assert_eq!(p.sessions as usize, n, "proxy renews every client session");
    });
    cell.stop();
}

/// Scenario 2: two proxies; `kill -9` the one a lock holder uses. The holder moves to the
/// other, keeps its session and its lock (same token); a waiter on the other proxy does
/// not get the lock until the holder releases it.
#[test]
fn holder_survives_its_proxy_dying() {
    let _g = serial();
    let cell = Cell::start(2);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let holder_client = cell.client(&cell.proxies).await; // proxy 1 first
        let waiter_client = cell.client(&cell.proxies[1..]).await;
        let holder = holder_client.open_session().await.unwrap();
        let waiter = waiter_client.open_session().await.unwrap();
        holder
            .create("/locks", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let guard = Lock::exclusive(&holder, "/locks/a")
            .acquire()
            .await
            .unwrap();
        let token = guard.token();
        let w = waiter.clone();
        let waiting = tokio::spawn(async move {
            let g = Lock::exclusive(&w, "/locks/a").acquire().await;
            (Instant::now(), g)
        });
        // The waiter has queued (its node is there) before the proxy dies.
        let deadline = Instant::now() + Duration::from_secs(10);
        while direct.children("/locks/a").await.unwrap().len() < 2 {
            assert!(Instant::now() < deadline, "the waiter never queued");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let p1 = pid_listening(&cell.data, "proxy", &cell.proxies[0]).expect("proxy 1 pid");
        unsafe { libc::kill(p1, libc::SIGKILL) };
        let killed = Instant::now();
        // Longer than a lease: a session that was not moved would have expired.
        tokio::time::sleep(Duration::from_secs(15)).await;
        assert_eq!(holder.state(), SessionState::Healthy, "holder's session");
        assert!(guard.may_act(), "the holder may still act on its lock");
        assert!(
            holder.check_sequencer(guard.sequencer()).await.unwrap(),
            "the cell still has the holder's node with the same token"
        );
        assert!(
            !waiting.is_finished(),
            "the waiter got the lock while it was held"
        );
        let (data, stat) = direct.get(&guard.sequencer().node).await.unwrap();
        assert!(data.is_empty());
        assert_eq!(stat.token, token);
        assert_eq!(stat.ephemeral_owner, Some(holder.id()));
        println!(
            "FIGURE proxy: holder kept session {} and token {token} for {} s after its proxy \
             was killed",
            holder.id(),
            killed.elapsed().as_secs()
        );
        let released = Instant::now();
        guard.release().await.unwrap();
        let (got_at, g) = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("waiter not granted after release")
            .unwrap();
        let g = g.unwrap();
        assert!(g.token() > token);
        println!(
            "FIGURE proxy: waiter behind the surviving proxy granted {} ms after the release",
            got_at.duration_since(released).as_millis()
        );
    });
    cell.stop();
}

/// Scenario 3: a node cached by clients behind two proxies. A write sends one
/// invalidation per proxy upstream and completes only after every client behind them
/// dropped the value; then the multi-process cache checker runs through the proxies.
#[test]
fn cache_through_two_proxies() {
    let _g = serial();
    let cell = Cell::start(2);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let mut readers = Vec::new();
        for p in &cell.proxies {
            let c = cell.client(std::slice::from_ref(p)).await;
            for _ in 0..3 {
                readers.push(c.open_session().await.unwrap());
            }
        }
        for r in &readers {
            let v = r.get_cached("/cfg").await.unwrap().unwrap();
            assert_eq!(v.0, b"v1");
            // The second read is a hit in the client's own cache.
            r.get_cached("/cfg").await.unwrap();
            assert_eq!(r.cache_stats().hits, 1);
        }
        let s0 = leader_status(&direct).await;
        assert_eq!(s0.cachers, 2, "the leader records one cacher per proxy");
        writer.set_data("/cfg", b"v2".to_vec(), None).await.unwrap();
        // The write completed: every reader dropped v1 before it did.
        for r in &readers {
            assert_eq!(r.cache_stats().invalidated, 1, "reader not invalidated");
        }
        let s1 = leader_status(&direct).await;
        assert_eq!(
            s1.invalidations_sent - s0.invalidations_sent,
            2,
            "one invalidation per proxy"
        );
        for r in &readers {
            assert_eq!(r.get_cached("/cfg").await.unwrap().unwrap().0, b"v2");
        }
        let mut relayed = 0;
        let mut hits = 0;
        for p in &cell.proxies {
            let s = proxy_status(&direct, p).await;
            relayed += s.invalidations_relayed;
            hits += s.cache_hits;
        }
        assert_eq!(relayed, 6, "one invalidation per client that held the node");
        assert!(
            hits >= 4,
            "later readers behind a proxy are served from its cache"
        );
        writer
            .create("/reg", b"0".to_vec(), CreateMode::default())
            .await
            .unwrap();
    });
    // The checker: two reader processes behind each proxy, writes straight to the cell.
    let readers: Vec<String> = cell
        .proxies
        .iter()
        .flat_map(|p| [p.clone(), p.clone()])
        .collect();
    let replicas = cell.replicas.join(",");
    let (reads, writes) = cache_checker(&cell.data, &readers, &replicas, false);
    println!("FIGURE proxy cache checker, 4 readers behind 2 proxies: {reads} reads, {writes} writes, no stale read");
    let (reads, writes) = cache_checker(&cell.data, &readers, &replicas, true);
    println!(
        "FIGURE proxy cache checker across a leader kill -9: {reads} reads, {writes} writes, \
         no stale read"
    );
    cell.stop();
}

/// Scenario 4: 1 000 clients behind one proxy watch the same node; the leader holds one
/// watch for the proxy, and a change reaches all 1 000.
#[test]
fn one_upstream_watch_fans_out() {
    let _g = serial();
    let n = env_or("PROXY_WATCHERS", 1_000) as usize;
    let cell = Cell::start(1);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/flag", b"off".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let via = vec![
            cell.client(&cell.proxies).await,
            cell.client(&cell.proxies).await,
        ];
        let sessions = open_sessions(&via, n, 200).await;
        let mut watches = Vec::new();
        for chunk in sessions.chunks(200) {
            let got = futures::future::join_all(chunk.iter().map(|s| s.get_watch("/flag"))).await;
            for g in got {
                let (data, _, w) = g.unwrap();
                assert_eq!(data, b"off");
                watches.push(w);
            }
        }
        let s = leader_status(&direct).await;
        assert_eq!(s.watches, 1, "the leader holds one watch for the proxy");
        let p = proxy_status(&direct, &cell.proxies[0]).await;
        assert_eq!(p.upstream_watches, 1);
        let changed = Instant::now();
        writer
            .set_data("/flag", b"on".to_vec(), None)
            .await
            .unwrap();
        let fired =
            tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(watches))
                .await
                .expect("not every watcher was told");
        let ok = fired.iter().filter(|r| r.is_ok()).count();
        assert_eq!(
            ok,
            n,
            "watch errors: {:?}",
            fired.iter().find(|r| r.is_err())
        );
        println!(
            "FIGURE proxy: one upstream watch, {n} watchers behind one proxy all told in {} ms",
            changed.elapsed().as_millis()
        );
        let total: u64 = sessions.iter().map(|s| s.watch_events_received()).sum();
        assert_eq!(total, n as u64, "each watcher got exactly one event");
    });
    cell.stop();
}

/// Scenario 5: leader `kill -9` with clients behind proxies. Sessions survive, and each
/// request in flight is answered, and applied, exactly once.
#[test]
fn leader_kill_behind_proxies_answers_exactly_once() {
    let _g = serial();
    let cell = Cell::start(2);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let setup = direct.open_session().await.unwrap();
        setup
            .create("/seq", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let mut sessions = Vec::new();
        for p in &cell.proxies {
            let c = cell.client(std::slice::from_ref(p)).await;
            for _ in 0..4 {
                sessions.push(c.open_session().await.unwrap());
            }
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for (k, s) in sessions.iter().enumerate() {
            let s = s.clone();
            let stop = stop.clone();
            writers.push(tokio::spawn(async move {
                let dir = format!("/seq/c{k}");
                s.create(&dir, Vec::new(), CreateMode::default())
                    .await
                    .unwrap();
                let mut acked = Vec::new();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let mode = CreateMode {
                        ephemeral: false,
                        sequential: true,
                    };
                    match s
                        .create(&format!("{dir}/n-"), i.to_string().into_bytes(), mode)
                        .await
                    {
                        Ok(_) => acked.push(i),
                        Err(e) => panic!("client {k}: request {i} failed: {e}"),
                    }
                    i += 1;
                }
                (dir, acked)
            }));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let replicas = cell.replicas.join(",");
        let data = cell.data.clone();
        let killed = tokio::task::spawn_blocking(move || kill_leader(&data, &replicas))
            .await
            .unwrap()
            .expect("leader killed");
        tokio::time::sleep(Duration::from_secs(6)).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut total = 0;
        for w in writers {
            let (dir, acked) = w.await.unwrap();
            let children = direct.children(&dir).await.unwrap();
            // Each node's value, 64 reads in flight (about 6 600 nodes in all: one read
            // at a time took most of this test's minute).
            use futures::StreamExt;
            let applied: Vec<u64> = futures::stream::iter(&children)
                .map(|(name, _)| {
                    let (direct, path) = (&direct, format!("{dir}/{name}"));
                    async move { direct.get(&path).await }
                })
                .buffered(64)
                .map(|r| {
                    let (d, _) = r.unwrap();
                    String::from_utf8(d).unwrap().parse::<u64>().unwrap()
                })
                .collect()
                .await;
            let mut sorted = applied.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(
                sorted.len(),
                applied.len(),
                "{dir}: a request applied twice"
            );
            assert_eq!(
                sorted, acked,
                "{dir}: applied set differs from answered set"
            );
            total += acked.len();
        }
        for s in &sessions {
            assert_eq!(s.state(), SessionState::Healthy, "session {} lost", s.id());
        }
        println!(
            "FIGURE proxy: leader {killed} killed under 8 writers behind 2 proxies: {total} \
             creates answered and applied exactly once, 0 sessions lost"
        );
        // Bad input through a proxy gets the cell's typed error.
        let s = &sessions[0];
        match s
            .create("no-slash", Vec::new(), CreateMode::default())
            .await
        {
            Err(Error::InvalidPath { .. }) => {}
            other => panic!("expected InvalidPath, got {other:?}"),
        }
    });
    cell.stop();
}

/// A lock held through a proxy across a leader kill: the proxy drops every cached copy
/// when its upstream reconnects (invalidating its clients), which leaves the holder's
/// pin unconfirmed, never lost; the holder may act again once it has read its node at
/// the new leader. Then someone else deletes the node: the holder may not act from the
/// moment the delete is answered, and soon knows the lock is gone.
#[test]
fn a_proxied_holder_keeps_its_lock_across_a_leader_kill_and_learns_of_a_delete() {
    let _g = serial();
    let cell = Cell::start(1);
    rt().block_on(async {
        let direct = cell.client(&cell.replicas).await;
        let admin = direct.open_session().await.unwrap();
        admin
            .create("/locks", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let holder_client = cell.client(&cell.proxies).await;
        let holder = holder_client.open_session().await.unwrap();
        let guard = Lock::exclusive(&holder, "/locks/p")
            .acquire()
            .await
            .unwrap();
        assert!(guard.may_act(), "a fresh grant through a proxy may act");
        let replicas = cell.replicas.join(",");
        let data = cell.data.clone();
        tokio::task::spawn_blocking(move || kill_leader(&data, &replicas))
            .await
            .unwrap()
            .expect("leader killed");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut unconfirmed_seen = false;
        loop {
            unconfirmed_seen |= !guard.confirmed();
            if guard.may_act() && Instant::now() > deadline - Duration::from_secs(25) {
                break;
            }
            assert!(!guard.lost(), "a leader kill lost a proxied holder's lock");
            assert!(
                Instant::now() < deadline,
                "the proxied holder never may act again after the leader kill"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "proxied holder after the leader kill: unconfirmed for a while: {unconfirmed_seen}"
        );
        assert!(
            holder.check_sequencer(guard.sequencer()).await.unwrap(),
            "the holder's node is still current"
        );
        // A delete by someone else, at the new leader.
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            match admin.delete(&guard.sequencer().node, None).await {
                Ok(()) => break,
                Err(e) if Instant::now() < until => {
                    eprintln!("delete: {e}; again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("delete: {e}"),
            }
        }
        assert!(
            !guard.may_act(),
            "a proxied holder may act after its node's delete committed"
        );
        let until = Instant::now() + Duration::from_secs(10);
        while !guard.lost() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            guard.lost(),
            "the proxied holder never learned of the delete"
        );
        assert_eq!(holder.state(), SessionState::Healthy);
    });
    cell.stop();
}
