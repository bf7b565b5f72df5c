//! Links that stall: a proxy or client that reaches the leader through a pausable UDP
//! relay (silence, dropped large datagrams), and a proxy killed and restarted at its
//! address.

use super::*;

/// A UDP relay on loopback between its clients (the proxy, and a test's own client) and
/// `target` that drops every datagram both ways while `paused` is set, and while
/// `drop_big` is set the target's datagrams over 1 000 bytes (its larger answers;
/// acknowledgements and small answers still arrive): a slow link between a proxy and its
/// leader, without touching the cell. Each client address gets an upstream socket of its
/// own, so the target's datagrams go back to the client they are for (one shared socket
/// sent each to whichever client had sent last, so a test client could get some of the
/// proxy's datagrams and lose some of its own).
/// Runs until the task is aborted (which aborts the return paths too).
async fn pausable_relay(
    listen: tokio::net::UdpSocket,
    target: std::net::SocketAddr,
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    drop_big: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    let listen = Arc::new(listen);
    let mut upstream: std::collections::HashMap<std::net::SocketAddr, Arc<tokio::net::UdpSocket>> =
        std::collections::HashMap::new();
    let mut back_paths = tokio::task::JoinSet::new();
    let mut a = vec![0u8; 65_536];
    loop {
        let Ok((n, from)) = listen.recv_from(&mut a).await else {
            return;
        };
        let up = match upstream.get(&from) {
            Some(up) => up.clone(),
            None => {
                let up = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
                up.connect(target).await.unwrap();
                let (up2, listen, paused, drop_big) =
                    (up.clone(), listen.clone(), paused.clone(), drop_big.clone());
                back_paths.spawn(async move {
                    let mut b = vec![0u8; 65_536];
                    while let Ok(n) = up2.recv(&mut b).await {
                        let dropped = paused.load(Ordering::SeqCst)
                            || n > 1_000 && drop_big.load(Ordering::SeqCst);
                        if !dropped {
                            let _ = listen.send_to(&b[..n], from).await;
                        }
                    }
                });
                upstream.insert(from, up.clone());
                up
            }
        };
        if !paused.load(Ordering::SeqCst) {
            let _ = up.send(&a[..n]).await;
        }
    }
}

/// One replica (a `lockctl dev` cell of one) and a `lockctl proxy` process that reaches it
/// only through a [`pausable_relay`]; the proxy logs to `proxy.log` in `dir`.
struct Relayed {
    dir: tempfile::TempDir,
    _dev: DevGuard,
    replica: std::net::SocketAddr,
    proxy_addr: std::net::SocketAddr,
    relay_addr: std::net::SocketAddr,
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    drop_big: std::sync::Arc<std::sync::atomic::AtomicBool>,
    relay: tokio::task::JoinHandle<()>,
    proxy: std::process::Child,
}

impl Relayed {
    fn start(rt: &tokio::runtime::Runtime, keepalive_interval_ms: u64, rust_log: &str) -> Relayed {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("cell");
        let base = free_base(1);
        let (dev, _) = start_dev_of(&data, base, 1, &["--no-demo"]);
        let dev = DevGuard(Some(dev));
        let replica: std::net::SocketAddr = format!("127.0.0.1:{base}").parse().unwrap();
        let pport = free_base_from(base + 16, 1);
        let proxy_addr: std::net::SocketAddr = format!("127.0.0.1:{pport}").parse().unwrap();
        let paused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drop_big = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relay_sock = rt
            .block_on(tokio::net::UdpSocket::bind("127.0.0.1:0"))
            .unwrap();
        let relay_addr = relay_sock.local_addr().unwrap();
        let relay = rt.spawn(pausable_relay(
            relay_sock,
            replica,
            paused.clone(),
            drop_big.clone(),
        ));
        let tls = data.join("tls");
        let cfg = dir.path().join("proxy.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"{proxy_addr}\"\nreplicas = [\"{relay_addr}\"]\n\
                 keepalive_interval_ms = {keepalive_interval_ms}\nforward_timeout_ms = 5000\n\n\
                 [tls]\nca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n",
                tls.join("ca.pem").display(),
                tls.join("proxy.pem").display(),
                tls.join("proxy.key").display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("proxy.log")).unwrap();
        let proxy = std::process::Command::new(LOCKCTL)
            .args(["proxy", "--config"])
            .arg(&cfg)
            .env("RUST_LOG", rust_log)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Relayed {
            dir,
            _dev: dev,
            replica,
            proxy_addr,
            relay_addr,
            paused,
            drop_big,
            relay,
            proxy,
        }
    }

    fn ca(&self) -> PathBuf {
        self.dir.path().join("cell/tls/ca.pem")
    }

    /// A client through the proxy and one straight to the replica, once the proxy serves;
    /// also the session the proxy opened first for the test (raw, not renewed).
    async fn clients(&self) -> (Client, Client, u64) {
        let endpoint = |a: std::net::SocketAddr| ClientConfig::new(vec![a.to_string()], self.ca());
        let via = Client::connect(endpoint(self.proxy_addr)).await.unwrap();
        let direct = Client::connect(endpoint(self.replica)).await.unwrap();
        let session = first_proxied_session(&via, self.proxy_addr).await;
        (via, direct, session)
    }

    fn pause(&self, paused: bool) {
        self.paused
            .store(paused, std::sync::atomic::Ordering::SeqCst);
    }

    fn drop_big(&self, drop: bool) {
        self.drop_big
            .store(drop, std::sync::atomic::Ordering::SeqCst);
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("proxy.log")).unwrap_or_default()
    }
}

impl Drop for Relayed {
    fn drop(&mut self) {
        self.relay.abort();
        let _ = self.proxy.kill();
        let _ = self.proxy.wait();
    }
}

/// A KeepAlive that reaches the proxy while its batch to the leader is slow is still
/// forwarded in the next batch, although the proxy's wait for it ran out first (the
/// `profile --fault kill` run that lost 103 sessions: their clients' retries each timed
/// out at the proxy just before the next batch started). One replica, reached by the
/// proxy only through a relay that goes silent for 2.5 s; the proxy batches every 100 ms,
/// so it waits 1.2 s for each KeepAlive. The session sends exactly one KeepAlive, during
/// the silence, and must outlive its first lease.
#[test]
fn a_keepalive_is_forwarded_after_its_wait_ran_out() {
    let _g = serial();
    let rt = rt();
    let cell = Relayed::start(&rt, 100, "info,proxy::upstream=debug");
    let (replica, paddr) = (cell.replica, cell.proxy_addr);
    let outcome = rt.block_on(async {
        let (via, direct, session) = cell.clients().await;
        let opened = Instant::now();
        tokio::time::sleep(Duration::from_millis(500)).await;
        cell.pause(true);
        // A batch is in flight by now (one starts every 100 ms) and stuck; ours waits
        // behind it, and the proxy stops waiting for it after 1.2 s.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let ka = {
            let via = via.clone();
            let req = raw(session, Op::KeepAlive);
            tokio::spawn(async move { via.call_at(paddr, &req).await })
        };
        tokio::time::sleep(Duration::from_millis(2_100)).await;
        cell.pause(false);
        println!("KeepAlive answer while the link was silent: {:?}", ka.await);
        // Past the session's first lease (12 s from its opening) with margin, and before
        // the one the forwarded KeepAlive gave it (12 s from the batch after the silence).
        tokio::time::sleep_until((opened + Duration::from_millis(13_500)).into()).await;
        direct
            .call_at(replica, &raw(session, Op::CloseSession))
            .await
    });
    if let Err(e) = outcome {
        panic!(
            "the session did not outlive its first lease ({e}): its one KeepAlive was not \
             forwarded; proxy log:\n{}",
            cell.log()
        );
    }
}

/// A leader that goes silent for 1.6 s and then answers (a stalled link, not a
/// fail-over). A request forwarded during the silence makes the proxy's SDK client
/// announce it after a second, and the proxy flushes its clients' caches ahead of a
/// possible fail-over, keeping its event stream. The link is back before the probe gives
/// the connection up, so a renewed batch resumes caching on the same stream: no second
/// flush, no reopened stream. The client's cached value is gone, a write made afterwards
/// is what it reads next (not the value it had cached), and the proxy caches again.
#[test]
fn a_silent_leader_is_flushed_ahead_and_caching_resumes() {
    let _g = serial();
    let rt = rt();
    let cell = Relayed::start(&rt, 200, "info");
    let paddr = cell.proxy_addr;
    let outcome: Result<(), String> = rt.block_on(async {
        let (via, direct, _) = cell.clients().await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let reader = via.open_session().await.unwrap();
        let value = |v: Option<(Vec<u8>, client_sdk::NodeStat)>| v.map(|(d, _)| d);
        assert_eq!(
            value(reader.get_cached("/cfg").await.unwrap()),
            Some(b"v1".to_vec())
        );
        assert_eq!(reader.cache_stats().entries, 1);
        cell.pause(true);
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Forwarded upstream, stuck behind the silent link: its wait is what is announced.
        let stuck = {
            let reader = reader.clone();
            tokio::spawn(async move { reader.get("/cfg").await })
        };
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        cell.pause(false);
        // Fresh traffic at once, so the link's return is seen before the probe's second
        // runs out (retransmissions after a silence may wait longer).
        let _ = via.call_at(paddr, &raw(0, Op::Status)).await;
        let _ = reader.get("/cfg").await;
        let _ = stuck.await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cell.log().contains("caching resumes") {
            if Instant::now() > deadline {
                return Err("caching did not resume within 10 s".into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let log = cell.log();
        if !log.contains("clients' caches flushed ahead") {
            return Err("no flush ahead".into());
        }
        let opens = log.matches("upstream event stream open").count();
        if opens != 1 {
            return Err(format!(
                "the event stream was opened {opens} times, not once"
            ));
        }
        if reader.cache_stats().entries != 0 {
            return Err("the client kept its cached value through the flush".into());
        }
        writer.set_data("/cfg", b"v2".to_vec(), None).await.unwrap();
        let got = value(reader.get_cached("/cfg").await.unwrap());
        if got != Some(b"v2".to_vec()) {
            return Err(format!("stale read after the write: {got:?}"));
        }
        // Cached again, at the proxy too: a second client's read is a proxy cache hit.
        let hits = proxy_status(&via, &paddr.to_string()).await.cache_hits;
        let other = via.open_session().await.unwrap();
        other.get_cached("/cfg").await.unwrap();
        let after = proxy_status(&via, &paddr.to_string()).await.cache_hits;
        if after != hits + 1 {
            return Err(format!("proxy cache hits {hits} -> {after}: not caching"));
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}; proxy log:\n{}", cell.log());
    }
}

/// Creates `path` with `data` (straight at the replica), then returns a client knowing the
/// replica by two endpoints, the relay first, that has read `path` through the relay (so
/// takes it for the leader). Bounded retries: a first read may go to the second endpoint
/// if the relay's handshake is slow while the cell warms up.
async fn client_via_relay_first(cell: &Relayed, path: &str, data: Vec<u8>) -> Client {
    let direct = Client::connect(ClientConfig::new(vec![cell.replica.to_string()], cell.ca()))
        .await
        .unwrap();
    let owner = direct.open_session().await.unwrap();
    owner
        .create(path, data, CreateMode::default())
        .await
        .unwrap();
    let eps = vec![cell.relay_addr.to_string(), cell.replica.to_string()];
    for _ in 0..10 {
        let c = Client::connect(ClientConfig::new(eps.clone(), cell.ca()))
            .await
            .unwrap();
        if c.get(path).await.is_ok() && c.leader_hint() == Some(cell.relay_addr) {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("no read through the relay in 10 tries");
}

/// A connection the SDK gives up while its peer is silent counts as a recent failure of
/// its endpoint: a request made just after does not spend the connect timeout (1 s) on a
/// handshake with the peer that was silent a moment ago (after a leader's kill, three of
/// four proxies lost that second reopening their event streams). The client knows the
/// one replica by two endpoints, the stalled relay first. A read of a missing node
/// waits at the silent relay until the client, asking its other endpoint who leads,
/// hears that the replica there leads (it is the same replica): the relay is given up,
/// the read is refused by the replica, and the client's leader is the direct endpoint.
/// A request to the relay then fails at once, and the next read is answered within half
/// a second (it took 1 s when the relay was dialed again first).
#[test]
fn a_connection_given_up_after_a_probe_is_not_dialed_again_at_once() {
    let _g = serial();
    let rt = rt();
    let cell = Relayed::start(&rt, 1_000, "info");
    let (refused_in, took) = rt.block_on(async {
        // No session on this client: nothing but the test's reads goes through it.
        let c = client_via_relay_first(&cell, "/x", Vec::new()).await;
        cell.pause(true);
        match c.get("/missing").await {
            Err(Error::NoNode { .. }) => {}
            other => panic!("expected NoNode from the replica, got {other:?}"),
        }
        assert_eq!(
            c.leader_hint(),
            Some(cell.replica),
            "the replica leads, asked at its own address"
        );
        let started = Instant::now();
        let at_relay = c
            .call_at(
                cell.relay_addr,
                &wire::types::Request {
                    session: 0,
                    request_id: 0,
                    ack_below: 0,
                    op: wire::types::Op::Exists {
                        path: "/x".into(),
                        watch: false,
                    },
                },
            )
            .await;
        assert!(
            matches!(at_relay, Err(Error::Connection { .. })),
            "{at_relay:?}"
        );
        let refused_in = started.elapsed();
        let started = Instant::now();
        c.get("/x")
            .await
            .expect("answered through the second endpoint");
        (refused_in, started.elapsed())
    });
    println!(
        "FIGURE sdk: a request to the endpoint given up a moment ago refused in \
         {refused_in:?}; a read answered in {took:?}"
    );
    assert!(
        refused_in < Duration::from_millis(500),
        "a request to the endpoint given up a moment ago took {refused_in:?}: it was dialed"
    );
    assert!(
        took < Duration::from_millis(500),
        "the read took {took:?}: the endpoint given up a moment ago was dialed again first"
    );
}

/// Cached reads of one node that reach the proxy while an upstream read of it is in flight
/// share the next upstream read, sent when that one returns (after they all arrived, so
/// none is answered with a value older than its own start). 60 sessions ask for a node
/// the proxy does not hold while its link to the leader is stalled: the proxy sends two
/// upstream reads, not 60, and every session gets the node's value.
#[test]
fn cached_reads_of_one_node_share_upstream_reads() {
    let _g = serial();
    let rt = rt();
    let cell = Relayed::start(&rt, 1_000, "info");
    let paddr = cell.proxy_addr;
    let outcome: Result<(), String> = rt.block_on(async {
        let (via, direct, _) = cell.clients().await;
        let writer = direct.open_session().await.unwrap();
        writer
            .create("/hot", b"h1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let readers = open_sessions(std::slice::from_ref(&via), 60, 20).await;
        let before = proxy_status(&via, &paddr.to_string()).await.upstream_reads;
        cell.pause(true);
        let mut reads = Vec::new();
        for s in &readers {
            let s = s.clone();
            reads.push(tokio::spawn(async move { s.get_cached("/hot").await }));
        }
        // Well under the second after which a silent leader is suspected.
        tokio::time::sleep(Duration::from_millis(600)).await;
        cell.pause(false);
        for r in reads {
            match r.await.unwrap() {
                Ok(Some((v, _))) if v == b"h1" => {}
                other => return Err(format!("a reader got {other:?}")),
            }
        }
        let after = proxy_status(&via, &paddr.to_string()).await.upstream_reads;
        println!(
            "FIGURE proxy: 60 concurrent cached reads of one node sent {} upstream",
            after - before
        );
        if after - before > 2 {
            return Err(format!("{} upstream reads for 60 readers", after - before));
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}; proxy log:\n{}", cell.log());
    }
}

/// A request sent just before its peer went silent is given up a second after the last
/// datagram, not after whole seconds counted from its start. The client knows the one
/// replica by two endpoints, the relay first. A read of a 4 KiB value goes out while the
/// relay drops the replica's large datagrams (its answer; acknowledgements still arrive),
/// another read goes out 100 ms later, and 300 ms after the start the relay drops
/// everything. The read must be answered through the second endpoint within 2.75 s of
/// its start (silence from about 0.3 s, a second of it, a second of probe: about 2.3 s);
/// looking once a second from the request's start saw datagrams in the first second and
/// probed only after the second: 3 s. The second read's answer is not waited for: the
/// replica may send it in one packet with a retransmission of the large answer, which the
/// relay drops (the test waited for it, and then sometimes paused the relay only after the
/// large read's 6 s attempt timeout).
#[test]
fn a_request_gives_up_a_second_after_the_last_datagram() {
    let _g = serial();
    let rt = rt();
    let cell = Relayed::start(&rt, 1_000, "info");
    let took = rt.block_on(async {
        // No session on this client: nothing but the test's reads goes through it.
        let c = client_via_relay_first(&cell, "/big", vec![7u8; 4096]).await;
        cell.drop_big(true);
        let started = Instant::now();
        let big = {
            let c = c.clone();
            tokio::spawn(async move { c.get("/big").await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let small = {
            let c = c.clone();
            tokio::spawn(async move { c.get("/missing").await })
        };
        tokio::time::sleep_until((started + Duration::from_millis(300)).into()).await;
        cell.pause(true);
        let (data, _) = big
            .await
            .unwrap()
            .expect("answered through the second endpoint");
        assert_eq!(data.len(), 4096);
        let took = started.elapsed();
        match small.await.unwrap() {
            Err(Error::NoNode { .. }) => {}
            other => panic!("expected NoNode for the second read, got {other:?}"),
        }
        took
    });
    println!(
        "FIGURE sdk: a read whose peer went silent 0.3 s in was answered elsewhere after {took:?}"
    );
    assert!(
        took < Duration::from_millis(2_750),
        "the read took {took:?}: its silent peer was not given up a second after it went quiet"
    );
}

/// A request sent after its peer had already gone silent probes once the silence is a
/// second old, not a second after the request was sent. The client has read through the
/// relay, which then drops everything; 700 ms later a read goes out. It must be answered
/// through the second endpoint within 1.75 s of being sent (silence a second old at
/// 1.0 s, probe given up at 2.0 s: 1.3 s); counting from its own start made it 2.0 s.
#[test]
fn a_request_to_an_already_silent_peer_probes_when_the_silence_is_a_second_old() {
    let _g = serial();
    let rt = rt();
    let cell = Relayed::start(&rt, 1_000, "info");
    let took = rt.block_on(async {
        // No session on this client: nothing but the test's reads goes through it.
        let c = client_via_relay_first(&cell, "/late", Vec::new()).await;
        cell.pause(true);
        tokio::time::sleep(Duration::from_millis(700)).await;
        let started = Instant::now();
        c.get("/late")
            .await
            .expect("answered through the second endpoint");
        started.elapsed()
    });
    println!("FIGURE sdk: a read sent 0.7 s into its peer's silence was answered elsewhere after {took:?}");
    assert!(
        took < Duration::from_millis(1_750),
        "the read took {took:?}: the silence was counted from the request's start"
    );
}

/// A proxy killed (`kill -9`) and started again at the same address serves its clients
/// at once: the new process answers the clients' connections to the old one with a
/// stateless reset (both derive QUIC's reset keys from the TLS key and address), so the
/// SDK dials it again on its next request. With quinn's random keys per process the
/// client would send into the dead connection until it presumed the proxy dead (a second
/// of silence, then an unanswered probe: two seconds at least).
#[test]
fn a_restarted_proxy_is_used_again_at_once() {
    let _g = serial();
    let cell = Cell::start(1);
    rt().block_on(async {
        let client = cell.client(&cell.proxies).await;
        let s = client.open_session().await.unwrap();
        s.create("/restart", b"x".to_vec(), CreateMode::default())
            .await
            .unwrap();
        let pid = pid_listening(&cell.data, "proxy", &cell.proxies[0]).expect("proxy pid");
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
        let args: Vec<&str> = cmdline.split('\0').filter(|a| !a.is_empty()).collect();
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let killed = Instant::now();
        // Dead (gone, or a zombie until `lockctl dev` reaps it), so its socket is free.
        let dead = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|st| st.rsplit(") ").next().is_some_and(|r| r.starts_with('Z')))
                .unwrap_or(true)
        };
        for _ in 0..500 {
            if dead() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(dead(), "the killed proxy {pid} is still running");
        // The same command again: same configuration, same address, same TLS key.
        let log = cell.data.join("proxy-restarted.log");
        let out = std::fs::File::create(&log).unwrap();
        let _again = KillOnDrop(
            std::process::Command::new(args[0])
                .args(&args[1..])
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .expect("restart the proxy"),
        );
        let (data, _) = tokio::time::timeout(Duration::from_secs(20), s.get("/restart"))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "no read through the restarted proxy within 20 s; its log: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .unwrap();
        assert_eq!(data, b"x");
        let took = killed.elapsed();
        println!(
            "FIGURE proxy restarted: a read through it answered {} ms after the kill",
            took.as_millis()
        );
        assert_eq!(s.state(), SessionState::Healthy);
        assert!(
            took < Duration::from_millis(1_800),
            "the first read through the restarted proxy took {took:?} after the kill"
        );
    });
    cell.stop();
}
