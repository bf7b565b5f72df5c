//! The `state` scenario on our cell (the scenario: [`super`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{bail, Context};
use client_sdk::{Client, ClientConfig, CreateMode, Session, SessionState};
use wire::types::{Op, Reply, Request};

use super::{catch_up, rss_of, NODE_BYTES, PER_DIR};
use crate::profile::{connections, create_ok, each, leader_status, open_all};
use crate::report::{rss_mb, Lat, Report};
use crate::scenarios::Ctx;

fn admin_req(op: Op) -> Request {
    Request {
        session: 0,
        request_id: 0,
        ack_below: 0,
        op,
    }
}

async fn applied_at(direct: &Client, addr: &str) -> Option<u64> {
    direct
        .status_of(addr.parse().ok()?)
        .await
        .ok()
        .map(|s| s.last_applied)
}

/// Waits until the replica at `addr` has applied `index` ([`catch_up`]).
async fn catch_up_at(
    direct: &Client,
    addr: &str,
    index: u64,
    from: Instant,
    within: Duration,
) -> anyhow::Result<(Duration, Duration)> {
    catch_up(addr, index, from, within, || async {
        applied_at(direct, addr).await.map(Some)
    })
    .await
}

/// A client for one replica that retries its address every 100 ms.
fn fresh_cfg(ctx: &Ctx, addr: &str) -> ClientConfig {
    let mut cfg = ClientConfig::new(vec![addr.to_string()], ctx.cluster.ca.clone());
    cfg.connect_timeout = Duration::from_millis(100);
    cfg
}

/// The state scenario on our cell.
pub(super) async fn state(ctx: &Ctx) -> anyhow::Result<Report> {
    let nodes = ctx.n(100_000.0, 1_000);
    let n = ctx.n(50_000.0, 100);
    let members = ctx.cluster.members.clone();
    let mut r = ctx.report("state");
    r.param("nodes (persistent, 1 000 per parent)", nodes);
    r.param("bytes per node", NODE_BYTES);
    r.param("sessions", n);
    r.param("proxies", ctx.cluster.endpoints.len());
    let mut cfg = ClientConfig::new(members.clone(), ctx.cluster.ca.clone());
    // A snapshot or a learner's catch-up is one long answer.
    cfg.attempt_timeout = Duration::from_secs(300);
    cfg.request_timeout = Duration::from_secs(300);
    // The restarted replica is polled: retry its address every 100 ms, not every second.
    cfg.connect_timeout = Duration::from_millis(100);
    let direct = Client::connect(cfg).await?;
    rss_of(ctx, &mut r, "empty");

    // Load: the nodes, written by 8 sessions straight to the cell, then the sessions.
    let writers = futures::future::try_join_all((0..8).map(|_| direct.open_session())).await?;
    create_ok(
        writers[0]
            .create("/state", Vec::new(), CreateMode::default())
            .await,
    )?;
    let dirs = nodes.div_ceil(PER_DIR);
    for d in 0..dirs {
        create_ok(
            writers[0]
                .create(&format!("/state/d{d}"), Vec::new(), CreateMode::default())
                .await,
        )?;
    }
    let t = Instant::now();
    each(nodes, 256, "nodes", |i| {
        let s = writers[i % writers.len()].clone();
        async move {
            let mut data = format!("node {i} ").into_bytes();
            data.resize(NODE_BYTES, b'x');
            create_ok(
                s.create(
                    &format!("/state/d{}/n{i}", i / PER_DIR),
                    data,
                    CreateMode::default(),
                )
                .await,
            )
        }
    })
    .await?;
    r.figure(
        "nodes written per s (load)",
        nodes as f64 / t.elapsed().as_secs_f64(),
    );
    let clients = connections(ctx, &ctx.cluster.endpoints, n).await?;
    let t = Instant::now();
    let sessions: Vec<Session> = open_all(&clients, n).await?;
    r.figure(
        "sessions opened per s (load)",
        n as f64 / t.elapsed().as_secs_f64(),
    );

    // Every replica has applied everything.
    let leader = leader_status(&direct).await?;
    let target = leader.last_applied;
    for m in &members {
        catch_up_at(&direct, m, target, Instant::now(), Duration::from_secs(120)).await?;
    }
    r.figure("nodes in the cell", leader.node_count as f64);
    r.figure("sessions in the cell", leader.session_count as f64);
    r.figure("log index after load", target as f64);
    rss_of(ctx, &mut r, "loaded");

    // The same writer for 3 s without a snapshot, for comparison (issue 27: the writes
    // while snapshotting should keep within 1.5 times this one's p99).
    let leader_addr = ctx.cluster.leader().await?;
    let write_state = |s: client_sdk::Session| {
        move |v: u64| {
            let s = s.clone();
            async move {
                s.set_data("/state", v.to_string().into_bytes(), None)
                    .await
                    .is_ok()
            }
        }
    };
    let quiet_stop = Arc::new(AtomicBool::new(false));
    let quiet = spawn_stall_writer(
        Instant::now(),
        quiet_stop.clone(),
        write_state(writers[0].clone()),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    quiet_stop.store(true, Ordering::SeqCst);
    let (quiet_lat, quiet_failed) = quiet.await?;
    r.latency_failed("write, no snapshot", &quiet_lat, quiet_failed);

    // Snapshots on demand, one replica at a time; a writer measures the stall at the
    // leader.
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let writer = spawn_stall_writer(start, stop.clone(), write_state(writers[0].clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut snapped = None;
    for (i, m) in members.iter().enumerate() {
        let t = Instant::now();
        let reply = direct.call_at(m.parse()?, &admin_req(Op::Snapshot)).await;
        match reply? {
            Reply::SnapshotTaken {
                index,
                bytes,
                serialize_ms,
                total_ms,
            } => {
                let who = if *m == leader_addr {
                    "leader".to_string()
                } else {
                    format!("replica-{}", i + 1)
                };
                r.figure(&format!("{who} snapshot size (MB)"), bytes as f64 / 1e6);
                r.figure(
                    &format!("{who} snapshot serialize (ms)"),
                    serialize_ms as f64,
                );
                r.figure(
                    &format!("{who} snapshot serialize + write (ms)"),
                    total_ms as f64,
                );
                r.figure(
                    &format!("{who} snapshot call (ms)"),
                    t.elapsed().as_secs_f64() * 1e3,
                );
                snapped.get_or_insert(index);
            }
            other => bail!("unexpected answer to Snapshot: {other:?}"),
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let (lat, failed) = writer.await?;
    r.latency_failed("write while snapshotting", &lat, failed);
    rss_of(ctx, &mut r, "after snapshots");

    // A follower killed and restarted: it loads its snapshot and replays its log.
    let (victim, victim_addr) = members
        .iter()
        .enumerate()
        .find(|(_, m)| **m != leader_addr)
        .map(|(i, m)| (i + 1, m.clone()))
        .context("a follower")?;
    let pid = ctx.cluster.replica_pid(victim).context("follower pid")?;
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let target = leader_status(&direct).await?.last_applied;
    // A fresh client: the old one's connection to the killed process would first have to
    // be found dead (about 2 s), which is not the replica's restart time.
    let fresh = Client::connect(fresh_cfg(ctx, &victim_addr)).await?;
    let t = Instant::now();
    ctx.cluster.restart_replica(victim)?;
    let (answered, caught) =
        catch_up_at(&fresh, &victim_addr, target, t, Duration::from_secs(300)).await?;
    r.param(
        "restarted",
        format!("replica-{victim} (a follower), kill -9"),
    );
    r.figure("restart: answering after (s)", answered.as_secs_f64());
    r.figure("restart: caught up after (s)", caught.as_secs_f64());
    if let Some(mb) = ctx.cluster.replica_pid(victim).and_then(rss_mb) {
        r.figure(&format!("replica-{victim} RSS after restart (MB)"), mb);
    }

    // A new replica joins as a learner.
    let id = members.len() as u64 + 1;
    let addr = ctx.cluster.start_new_replica(id)?;
    let t = Instant::now();
    match direct
        .call_until(
            admin_req(Op::AddLearner {
                id,
                addr: addr.clone(),
            }),
            Instant::now() + Duration::from_secs(300),
        )
        .await?
    {
        Reply::MembershipChanged { .. } => {}
        other => bail!("unexpected answer to AddLearner: {other:?}"),
    }
    let added = t.elapsed();
    let target = leader_status(&direct).await?.last_applied;
    let (_, caught) = catch_up_at(&direct, &addr, target, t, Duration::from_secs(300)).await?;
    r.param("learner", format!("replica-{id} at {addr}"));
    r.figure(
        "learner: AddLearner returned after (s)",
        added.as_secs_f64(),
    );
    r.figure("learner: caught up after (s)", caught.as_secs_f64());
    if let Some(mb) = ctx.cluster.replica_pid(id as usize).and_then(rss_mb) {
        r.figure(&format!("replica-{id} (learner) RSS (MB)"), mb);
    }
    if let Ok(s) = direct.status_of(addr.parse()?).await {
        r.figure("learner: nodes", s.node_count as f64);
        r.figure("learner: sessions", s.session_count as f64);
    }

    let lost = sessions
        .iter()
        .filter(|s| s.state() == SessionState::Expired)
        .count();
    r.figure("sessions lost", lost as f64);
    let waited = crate::server_sessions::settle(ctx.lease, Instant::now(), None).await;
    let ids: Vec<u64> = sessions
        .iter()
        .map(|s| s.id())
        .chain(writers.iter().map(|w| w.id()))
        .collect();
    let at_server = crate::server_sessions::check(&ctx.cluster, &ids).await;
    crate::server_sessions::report(
        &mut r,
        at_server,
        waited,
        "the sessions and the 8 writers' sessions",
    );
    if let Some(i) = snapped {
        r.param("snapshot index (first)", i);
    }
    ctx.costs(&mut r);
    Ok(r)
}

/// The writer that measures a snapshot's stall: writes value `v` (0, 1, ...) every 5 ms
/// until `stop`, timing each write that succeeded and counting those that failed.
pub(crate) fn spawn_stall_writer<F, Fut>(
    start: Instant,
    stop: Arc<AtomicBool>,
    write: F,
) -> tokio::task::JoinHandle<(Lat, u64)>
where
    F: Fn(u64) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    tokio::spawn(async move {
        let mut lat = Lat::new(start);
        let mut failed = 0u64;
        let mut v = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let t0 = Instant::now();
            if write(v).await {
                let t1 = Instant::now();
                lat.record(t1 - t0, t1);
            } else {
                failed += 1;
            }
            v += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (lat, failed)
    })
}
