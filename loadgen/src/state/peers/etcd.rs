//! The state scenario on etcd.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{anyhow, bail, Context};
use etcd_client::{ConnectOptions, GetOptions, MemberAddOptions, StatusResponse};

use super::{member_name, member_no, open_figures, restart_a_follower, IN_FLIGHT, WAIT, WRITERS};
use crate::profile::each;
use crate::report::{rss_mb, Report};
use crate::scenarios::Ctx;
use crate::state::{catch_up, rss_of, NODE_BYTES, PER_DIR};
use crate::systems::{open_many, Sess};

/// A client of the etcd member(s) `eps`, failing fast (for polling).
async fn etcd_quick(eps: &[String]) -> Option<etcd_client::Client> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(500))
        .with_timeout(Duration::from_secs(2));
    etcd_client::Client::connect(eps, Some(opts)).await.ok()
}

/// The status of the etcd member at `addr` (a fresh client, so a restarted member is
/// asked at once rather than after a reconnect backoff), or `None` within 3 s.
async fn etcd_status(addr: &str) -> Option<StatusResponse> {
    let fut = async {
        let mut c = etcd_quick(&[addr.to_string()]).await?;
        c.status().await.ok()
    };
    tokio::time::timeout(Duration::from_secs(3), fut)
        .await
        .ok()
        .flatten()
}

/// What a member has applied (etcd 3.4 reports `raftAppliedIndex`; older ones only the
/// index they know committed).
fn etcd_applied(s: &StatusResponse) -> u64 {
    if s.raft_applied_index() > 0 {
        s.raft_applied_index()
    } else {
        s.raft_index()
    }
}

/// The leader's endpoint and its raft index (everything committed so far).
pub(super) async fn etcd_leader_index(ctx: &Ctx) -> anyhow::Result<(String, u64)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let leader = ctx.cluster.leader().await?;
        if let Some(s) = etcd_status(&leader).await {
            return Ok((leader, s.raft_index()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the etcd leader's status did not answer within 30 s")
}

pub(super) async fn etcd_catch_up(
    what: &str,
    addr: &str,
    index: u64,
    from: Instant,
) -> anyhow::Result<(Duration, Duration)> {
    catch_up(what, index, from, WAIT, || async {
        etcd_status(addr).await.map(|s| Some(etcd_applied(&s)))
    })
    .await
}

/// The raft index of the newest `.snap` file of etcd member `name` (its log is compacted
/// behind it), if it wrote one.
fn etcd_raft_snapshot(dir: &Path, name: &str) -> Option<u64> {
    std::fs::read_dir(dir.join(name).join("member/snap"))
        .ok()?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let (_term, index) = n.strip_suffix(".snap")?.split_once('-')?;
            u64::from_str_radix(index, 16).ok()
        })
        .max()
}

pub(super) async fn etcd(ctx: &Ctx) -> anyhow::Result<Report> {
    let nodes = ctx.n(100_000.0, 1_000);
    let n = ctx.n(50_000.0, 100);
    let members = ctx.cluster.members.clone();
    let mut r = ctx.report("state");
    r.param("nodes (keys, 1 000 per prefix)", nodes);
    r.param("bytes per node", NODE_BYTES);
    r.param("sessions (leases, 2 000 a client)", n);
    rss_of(ctx, &mut r, "empty");

    // Load: the keys, written by 8 clients (each over every member, starting at another),
    // then the sessions.
    let mut writers = Vec::with_capacity(WRITERS);
    for i in 0..WRITERS {
        let mut eps = members.clone();
        eps.rotate_left(i % members.len());
        writers.push(
            etcd_client::Client::connect(eps, Some(crate::systems::etcd_conn::options())).await?,
        );
    }
    writers[0].put("/state", "", None).await?;
    let t = Instant::now();
    each(nodes, IN_FLIGHT, "nodes", |i| {
        let mut c = writers[i % writers.len()].clone();
        async move {
            let mut data = format!("node {i} ").into_bytes();
            data.resize(NODE_BYTES, b'x');
            c.put(format!("/state/d{}/n{i}", i / PER_DIR), data, None)
                .await?;
            Ok(())
        }
    })
    .await?;
    r.figure(
        "nodes written per s (load)",
        nodes as f64 / t.elapsed().as_secs_f64(),
    );
    let t = Instant::now();
    let sessions: Vec<Sess> = open_many(&ctx.conn, n, ctx.lease).await?;
    r.figure(
        "sessions opened per s (load)",
        n as f64 / t.elapsed().as_secs_f64(),
    );
    open_figures(&mut r);

    // Every member has applied everything.
    let (leader, target) = etcd_leader_index(ctx).await?;
    for (i, m) in members.iter().enumerate() {
        etcd_catch_up(&format!("replica-{}", i + 1), m, target, Instant::now()).await?;
    }
    let mut lc = etcd_client::Client::connect(
        [leader.as_str()],
        Some(crate::systems::etcd_conn::options()),
    )
    .await?;
    let keys = lc
        .get(
            "/state",
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await?
        .count();
    r.figure("nodes in the cell", keys as f64);
    r.figure(
        "sessions in the cell",
        lc.leases().await?.leases().len() as f64,
    );
    r.figure("log index after load", target as f64);
    rss_of(ctx, &mut r, "loaded");

    // The leader's snapshot (the maintenance API), saved like `etcdctl snapshot save`
    // (streamed to a file, then fsync), while a writer at the leader measures the stall.
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let writer = {
        let c = etcd_client::Client::connect(
            [leader.as_str()],
            Some(crate::systems::etcd_conn::options()),
        )
        .await?;
        crate::state::ours::spawn_stall_writer(start, stop.clone(), move |v| {
            let mut c = c.clone();
            async move { c.put("/state", v.to_string(), None).await.is_ok() }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let path = ctx.cluster.dir().join("leader-snapshot.db");
    let mut sc = etcd_client::Client::connect(
        [leader.as_str()],
        Some(crate::systems::etcd_conn::options()),
    )
    .await?;
    let t = Instant::now();
    let saved = tokio::time::timeout(WAIT, async {
        use tokio::io::AsyncWriteExt;
        let mut stream = sc.snapshot().await?;
        let mut f = tokio::fs::File::create(&path).await?;
        let mut bytes = 0usize;
        while let Some(m) = stream.message().await? {
            bytes += m.blob().len();
            f.write_all(m.blob()).await?;
        }
        let streamed = t.elapsed();
        f.sync_all().await?;
        anyhow::Ok((bytes, streamed, t.elapsed()))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let (lat, failed) = writer.await?;
    let _ = std::fs::remove_file(&path);
    let (bytes, streamed, total) = saved
        .map_err(|_| anyhow!("the leader's snapshot did not finish within {WAIT:?}"))?
        .context("the leader's snapshot")?;
    r.figure("leader snapshot size (MB)", bytes as f64 / 1e6);
    r.figure(
        "leader snapshot streamed (ms)",
        streamed.as_secs_f64() * 1e3,
    );
    r.figure(
        "leader snapshot streamed + saved (ms)",
        total.as_secs_f64() * 1e3,
    );
    r.latency_failed("write while snapshotting", &lat, failed);
    r.notes.push(
        "snapshot: etcd's maintenance Snapshot at the leader, as `etcdctl snapshot save`: a \
         copy of its bbolt backend (the whole keyspace, with its MVCC revisions) streamed \
         over gRPC to loadgen and written to a file with fsync; etcd never serializes its \
         state as ours does (the backend is the state), so its time is reported as \
         'streamed (+ saved)', not as 'serialize + write'"
            .into(),
    );
    for (i, m) in members.iter().enumerate() {
        if let Some(s) = etcd_status(m).await {
            r.figure(
                &format!("replica-{} backend db size (MB)", i + 1),
                s.db_size() as f64 / 1e6,
            );
        }
    }
    rss_of(ctx, &mut r, "after snapshots");

    // A follower killed and restarted: it replays its WAL (from its last raft snapshot)
    // and the leader sends what it missed.
    restart_a_follower(ctx, &mut r).await?;

    // A new member joins as a learner.
    let (leader, _) = etcd_leader_index(ctx).await?;
    let id = members.len() + 1;
    let name = member_name(ctx, id);
    let (client_port, peer_port) = ctx.cluster.new_member_ports();
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut lc = etcd_client::Client::connect(
        [leader.as_str()],
        Some(crate::systems::etcd_conn::options()),
    )
    .await?;
    // etcd refuses MemberAdd until every voting member has been connected for 5 s (its
    // strict reconfig check), which the follower just restarted may not have been yet.
    let asked = Instant::now();
    let (t, added) = loop {
        let t = Instant::now();
        match lc
            .member_add(
                [peer_url.as_str()],
                Some(MemberAddOptions::new().with_is_learner()),
            )
            .await
        {
            Ok(a) => break (t, a),
            Err(e) if asked.elapsed() < Duration::from_secs(60) => {
                tracing::debug!("member_add: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e).context("member_add (learner) for 60 s"),
        }
    };
    let initial: Vec<String> = added
        .member_list()
        .iter()
        .filter_map(|m| {
            let n = if m.name().is_empty() {
                name.as_str()
            } else {
                m.name()
            };
            Some(format!("{n}={}", m.peer_urls().first()?))
        })
        .collect();
    let (_, target) = etcd_leader_index(ctx).await?;
    let addr = ctx
        .cluster
        .start_etcd_member(&name, client_port, peer_port, &initial.join(","))?;
    let (_, caught) = etcd_catch_up(&format!("learner {name}"), &addr, target, t).await?;
    r.param("learner", format!("replica-{id} ({name}) at {addr}"));
    r.figure("learner: caught up after (s)", caught.as_secs_f64());
    let refused = t.duration_since(asked).as_secs_f64();
    if refused > 0.0 {
        r.param(
            "learner: MemberAdd refused for (s)",
            format!("{refused:.1}"),
        );
    }
    if let Some(mb) = ctx.cluster.pid_of(&addr).and_then(rss_mb) {
        r.figure(&format!("replica-{id} (learner) RSS (MB)"), mb);
    }
    if let Some(mut c) = etcd_quick(std::slice::from_ref(&addr)).await {
        let opts = GetOptions::new()
            .with_prefix()
            .with_count_only()
            .with_serializable();
        if let Ok(g) = c.get("/state", Some(opts)).await {
            r.figure("learner: nodes", g.count() as f64);
        }
    }
    let leader_name = member_name(ctx, member_no(ctx, &leader)?);
    let compacted = etcd_raft_snapshot(ctx.cluster.dir(), &leader_name);
    r.notes.push(format!(
        "learner: MemberAdd (as learner) at the leader, then the new member started with \
         --initial-cluster-state existing; timed from MemberAdd to its applied index \
         reaching the leader's raft index at the add ({target}), so it includes the \
         process's start (ours starts the replica before AddLearner); {}",
        match compacted {
            Some(i) => format!(
                "the leader had compacted its log at its raft snapshot (index {i}), so it \
                 sent the learner its whole backend, then the entries after it"
            ),
            None => "the leader had not compacted its log (no raft snapshot before \
                     --snapshot-count, 100 000 entries), so the learner replayed the log \
                     from the start rather than receiving a snapshot"
                .into(),
        }
    ));

    let lost = sessions.iter().filter(|s| s.lost()).count();
    r.figure("sessions lost", lost as f64);
    let waited = crate::server_sessions::settle(ctx.lease, Instant::now(), None).await;
    let ids: Vec<u64> = sessions.iter().map(|s| s.server_id()).collect();
    let at_server = crate::server_sessions::check(&ctx.cluster, &ids).await;
    crate::server_sessions::report(
        &mut r,
        at_server,
        waited,
        "the sessions' leases (the writers hold none)",
    );
    ctx.costs(&mut r);
    Ok(r)
}
