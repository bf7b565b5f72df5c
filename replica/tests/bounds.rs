//! Bad input from a remote party costs that party its stream or connection, never the
//! replica (DESIGN.md, safety rule 8; issue 22, item 4). Real replica processes on
//! loopback, attacked by raw QUIC connections that speak the wire protocol badly:
//!
//! - stalled frames: several client connections each open every stream the replica
//!   allows, send a header claiming the largest frame and then nothing (or only a little
//!   of the body), and hold on; the replica's RSS stays under [`RSS_BOUND_BYTES`] and
//!   another client's requests are answered meanwhile;
//! - a deeply nested command inside an AppendEntries on the peer ALPN: answered with a
//!   typed error, and the replica lives on.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use client_sdk::CreateMode;
use common::{rt, serial, Opts, TestCell};
use wire::hello::{Hello, HelloReply, ALPN_CLIENT, ALPN_PEER};
use wire::raft::{PeerRequest, PeerResponse};
use wire::{frame, CLIENT_FRAME_BYTES_MAX};

/// The replica's RSS during the stalled-frames attack stays below this. What it may hold:
/// its own baseline (a one-replica cell idles at about 20 MiB), and per attacking
/// connection at most the bytes its requests may hold (`wire::CLIENT_CONNECTION_BYTES_MAX`,
/// 32 MiB) plus what QUIC buffers unread (`wire::quic::CONNECTION_RECEIVE_WINDOW_BYTES`,
/// 8 MiB), plus a few hundred bytes per open stream: 3 connections, ~120 MiB over the
/// baseline.
const RSS_BOUND_BYTES: u64 = 256 * 1024 * 1024;

/// The attack stops early once the replica's RSS passes this, far past the bound, so a
/// regression does not run the machine short of memory.
const RSS_ABORT_BYTES: u64 = 1536 * 1024 * 1024;

/// Attacking connections per phase.
const ATTACK_CONNECTIONS: usize = 3;

/// Body bytes each stream sends after its header in the second phase.
const BODY_PREFIX_BYTES: usize = 32 * 1024;

fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A cell of one replica, and a client once it leads.
async fn one_replica_cell() -> (TestCell, client_sdk::Client) {
    let cell = TestCell::start(Opts {
        replicas: 1,
        ..Opts::default()
    });
    let client = cell.client().await;
    cell.wait_leader(&client, Duration::from_secs(20), None)
        .await;
    (cell, client)
}

async fn connect(cell: &TestCell, addr: SocketAddr, alpn: &[u8]) -> quinn::Connection {
    // The peer protocol takes replicas' certificates only: the attacker holds one.
    let dir = cell.ca.parent().unwrap();
    let files = if alpn == wire::hello::ALPN_PEER {
        wire::tls::TlsConfig::replica_in_dir(dir)
    } else {
        wire::tls::TlsConfig::client_in_dir(dir)
    };
    let (tls, _) = wire::tls::client_config(&files, alpn).expect("tls");
    let ep = wire::quic::client_endpoint(tls, "127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let conn = ep
        .connect(addr, wire::tls::SERVER_NAME)
        .expect("connect")
        .await
        .expect("handshake");
    let (mut send, mut recv) = conn.open_bi().await.expect("hello stream");
    frame::write(&mut send, &Hello::new("bounds test attacker"), 1024)
        .await
        .expect("hello");
    let _ = send.finish();
    let reply: HelloReply = frame::read(&mut recv, 1024).await.expect("hello reply");
    reply.expect("hello accepted");
    conn
}

/// Opens as many streams as `conn` allows (up to `streams`), each sending a header that
/// claims the largest client frame followed by `prefix` body bytes, then holding the
/// stream open until `stop` is set. Returns how many streams got their bytes out.
async fn stall_streams(
    conn: quinn::Connection,
    streams: usize,
    prefix: usize,
    stop: Arc<tokio::sync::Notify>,
    opened: Arc<AtomicUsize>,
) {
    let mut head = (CLIENT_FRAME_BYTES_MAX as u32).to_be_bytes().to_vec();
    head.resize(4 + prefix, 0xab);
    let head = Arc::new(head);
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let Ok(Ok((mut send, recv))) =
            tokio::time::timeout(Duration::from_secs(2), conn.open_bi()).await
        else {
            break;
        };
        let (head, stop, opened) = (head.clone(), stop.clone(), opened.clone());
        tasks.push(tokio::spawn(async move {
            if tokio::time::timeout(Duration::from_secs(20), send.write_all(&head))
                .await
                .is_ok_and(|r| r.is_ok())
            {
                opened.fetch_add(1, Ordering::Relaxed);
            }
            stop.notified().await;
            drop((send, recv));
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// One attack phase: returns (peak RSS, streams that sent their bytes, the longest a
/// request of the honest client took, its requests answered).
async fn attack(
    cell: &TestCell,
    pid: u32,
    honest: &client_sdk::Session,
    prefix: usize,
    phase: &str,
) -> (u64, usize, Duration, usize) {
    let addr: SocketAddr = cell.addr(1).parse().unwrap();
    let stop = Arc::new(tokio::sync::Notify::new());
    let opened = Arc::new(AtomicUsize::new(0));
    let mut conns = Vec::new();
    let mut attackers = Vec::new();
    for _ in 0..ATTACK_CONNECTIONS {
        let conn = connect(cell, addr, ALPN_CLIENT).await;
        conns.push(conn.clone());
        attackers.push(tokio::spawn(stall_streams(
            conn,
            wire::quic::STREAMS_MAX as usize,
            prefix,
            stop.clone(),
            opened.clone(),
        )));
    }
    let started = Instant::now();
    let mut peak = 0;
    let mut slowest = Duration::ZERO;
    let mut answered = 0;
    // The honest client works all along; RSS is sampled between its requests.
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(10) {
        let t = Instant::now();
        let path = format!("/honest-{phase}-{i}");
        honest
            .create(&path, b"x".to_vec(), CreateMode::default())
            .await
            .unwrap_or_else(|e| panic!("{phase}: an honest create failed during the attack: {e}"));
        let (data, _) = honest.get(&path).await.expect("honest get");
        assert_eq!(data, b"x");
        slowest = slowest.max(t.elapsed());
        answered += 1;
        i += 1;
        assert!(alive(pid), "{phase}: the replica died during the attack");
        let rss = rss_bytes(pid).expect("rss");
        peak = peak.max(rss);
        if rss > RSS_ABORT_BYTES {
            // Far past the bound: stop before the machine runs short of memory.
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.notify_waiters();
    for c in &conns {
        c.close(0u32.into(), b"done");
    }
    for a in attackers {
        let _ = tokio::time::timeout(Duration::from_secs(5), a).await;
    }
    (peak, opened.load(Ordering::Relaxed), slowest, answered)
}

/// Several connections open every stream they may, send a header claiming the largest
/// client frame, then nothing (first phase) or 32 KiB of the body (second phase), and
/// hold on. Before the fix the replica allocated the claimed 4 MiB per stream up front and
/// waited for the rest for ever; the second phase took its RSS past 1 GB.
#[test]
fn stalled_frames_on_every_stream_do_not_exhaust_the_replica() {
    let _g = serial();
    rt().block_on(async {
        let (cell, client) = one_replica_cell().await;
        let honest = client.open_session().await.expect("session");
        let pid = cell.procs[&1].id();
        let baseline = rss_bytes(pid).expect("rss");
        println!(
            "FIGURE bounds: replica RSS before the attack {} MiB",
            baseline >> 20
        );
        for (phase, prefix) in [("header-only", 0), ("header+32KiB", BODY_PREFIX_BYTES)] {
            let (peak, opened, slowest, answered) =
                attack(&cell, pid, &honest, prefix, phase).await;
            println!(
                "FIGURE bounds: {phase}: {ATTACK_CONNECTIONS} connections, {opened} stalled \
                 streams, replica RSS peak {} MiB (bound {} MiB); honest client: {answered} \
                 create+get answered, slowest {} ms",
                peak >> 20,
                RSS_BOUND_BYTES >> 20,
                slowest.as_millis()
            );
            assert!(
                peak < RSS_BOUND_BYTES,
                "{phase}: replica RSS reached {} MiB (bound {} MiB)",
                peak >> 20,
                RSS_BOUND_BYTES >> 20
            );
            assert!(
                answered >= 5,
                "{phase}: only {answered} honest requests answered"
            );
        }
        assert!(alive(pid), "the replica died during the attack");
    });
}

/// True while process `pid` runs (neither gone nor a zombie waiting to be reaped).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// The bytes of an `AppendEntries` whose one entry is `depth` commands nested in one
/// another (`Held` in `Held` ..., or `Batch` in `Batch` ...) around a `Noop`. Built by
/// splicing, since building the value itself would recurse as deep when encoded.
fn nested_append_entries(depth: usize, batch: bool) -> Vec<u8> {
    const MAGIC: u64 = 0x5eed_5eed_5eed;
    let entry = wire::raft::Entry {
        log_id: openraft::LogId::new(
            wire::raft::LeaderId {
                term: 1,
                node_id: 1,
            },
            1,
        ),
        payload: openraft::EntryPayload::Normal(wire::command::Command::MarkCacher {
            session: MAGIC,
        }),
    };
    let req = PeerRequest::AppendEntries(openraft::raft::AppendEntriesRequest {
        vote: wire::raft::Vote::new_committed(1, 1),
        prev_log_id: None,
        entries: vec![entry],
        leader_commit: None,
    });
    let body = postcard::to_allocvec(&req).expect("encode");
    let marker = postcard::to_allocvec(&wire::command::Command::MarkCacher { session: MAGIC })
        .expect("encode marker");
    let at = body
        .windows(marker.len())
        .position(|w| w == marker.as_slice())
        .expect("marker in the encoding");
    // Variant indexes: Noop 0, Held 7 ({ term, command }), Batch 8 (a sequence).
    let level: &[u8] = if batch { &[8, 1] } else { &[7, 0] };
    let mut out = body[..at].to_vec();
    for _ in 0..depth {
        out.extend_from_slice(level);
    }
    out.push(0);
    out.extend_from_slice(&body[at + marker.len()..]);
    let mut framed = (out.len() as u32).to_be_bytes().to_vec();
    framed.extend_from_slice(&out);
    framed
}

/// An AppendEntries carrying a command nested 200 000 deep (`Held` in `Held`, then
/// `Batch` in `Batch`) reaches the replica on the peer ALPN. Before the fix postcard
/// recursed once per level and the replica died of a stack overflow; now the frame is
/// refused with a typed error and the replica goes on serving.
#[test]
fn a_deeply_nested_command_is_refused_and_the_replica_lives() {
    let _g = serial();
    rt().block_on(async {
        let (cell, client) = one_replica_cell().await;
        let addr: SocketAddr = cell.addr(1).parse().unwrap();
        let conn = connect(&cell, addr, ALPN_PEER).await;
        for batch in [false, true] {
            let bytes = nested_append_entries(200_000, batch);
            let (mut send, mut recv) = conn.open_bi().await.expect("stream");
            send.write_all(&bytes).await.expect("send");
            let _ = send.finish();
            let resp: Result<PeerResponse, _> =
                tokio::time::timeout(Duration::from_secs(10), frame::read(&mut recv, 1 << 20))
                    .await
                    .expect("an answer within 10 s");
            assert!(
                alive(cell.procs[&1].id()),
                "the replica died decoding a nested command (batch: {batch})"
            );
            match resp {
                Ok(PeerResponse::Refused(e)) => {
                    println!("FIGURE bounds: nested command (batch: {batch}) refused: {e}")
                }
                other => panic!("expected a typed refusal, got {other:?}"),
            }
        }
        // The replica still serves.
        let s = client
            .open_session()
            .await
            .expect("session after the attack");
        s.create("/after", b"ok".to_vec(), CreateMode::default())
            .await
            .expect("create after the attack");
    });
}

/// A snapshot offer above the replica's committed log id by term but not by index (no
/// correct leader sends one: it contradicts an entry committed here) is refused with a
/// typed error before openraft sees it; openraft asserts against it, and its Raft core
/// stopped. The replica goes on serving.
#[test]
fn a_snapshot_contradicting_committed_entries_is_refused_and_the_replica_lives() {
    let _g = serial();
    rt().block_on(async {
        let (cell, client) = one_replica_cell().await;
        let s = client.open_session().await.expect("session");
        for i in 0..3 {
            s.create(&format!("/before-{i}"), vec![], CreateMode::default())
                .await
                .expect("create");
        }
        let addr: SocketAddr = cell.addr(1).parse().unwrap();
        let conn = connect(&cell, addr, ALPN_PEER).await;
        // A later term than any the cell reached, at index 1, below what it committed.
        let term = 1_000;
        let offer = wire::raft::SnapshotOffer {
            vote: wire::raft::Vote::new_committed(term, 1),
            meta: wire::raft::SnapshotMeta {
                last_log_id: Some(openraft::LogId::new(
                    wire::raft::LeaderId { term, node_id: 1 },
                    1,
                )),
                last_membership: Default::default(),
            },
            id: "crafted".into(),
            bytes: 0,
        };
        let (mut send, mut recv) = conn.open_bi().await.expect("stream");
        frame::write(&mut send, &PeerRequest::Snapshot(offer), 1 << 20)
            .await
            .expect("send");
        let _ = send.finish();
        let resp: Result<PeerResponse, _> =
            tokio::time::timeout(Duration::from_secs(10), frame::read(&mut recv, 1 << 20))
                .await
                .expect("an answer within 10 s");
        match resp {
            Ok(PeerResponse::Refused(e)) => {
                assert!(e.to_string().contains("contradicts"), "{e}")
            }
            other => panic!("expected a typed refusal, got {other:?}"),
        }
        assert!(alive(cell.procs[&1].id()), "the replica died");
        s.create("/after", b"ok".to_vec(), CreateMode::default())
            .await
            .expect("create after the crafted snapshot");
    });
}
