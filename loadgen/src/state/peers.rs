//! The `state` scenario against etcd and ZooKeeper: the large state of [`crate::state`],
//! and what each peer's own mechanisms cost with it.
//!
//! At full scale: 100 000 nodes (etcd: keys) of 1 000 bytes, written by 8 sessions with
//! 256 in flight, and 50 000 sessions ([`open_many`]). Reported under the same keys as
//! ours wherever the figure means the same: every member's resident memory empty, loaded
//! and (etcd) after the snapshot; a snapshot: etcd's maintenance `Snapshot` at the leader
//! (a copy of its bbolt backend, streamed to loadgen and saved with fsync, as
//! `etcdctl snapshot save` does) while a writer measures the stall; ZooKeeper 3.8 takes no
//! snapshot on demand, so its own newest snapshot files are reported; a follower killed
//! (`kill -9`) and restarted (time until it answers, time until it has applied what the
//! leader had); a member catching up from nothing: etcd, a learner (`MemberAdd` as
//! learner, then the new member started); ZooKeeper, a follower restarted with an emptied
//! data dir, which the leader sends its whole state (a SNAP): 3.8 cannot add an observer
//! without dynamic reconfig. Sessions lost must be 0.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{anyhow, bail, Context};
use etcd_client::{ConnectOptions, GetOptions, MemberAddOptions, StatusResponse};
use zookeeper_client as zk;

use super::{catch_up, rss_of, NODE_BYTES, PER_DIR};
use crate::cluster::{four_letter, System};
use crate::profile::each;
use crate::report::{proc_cost, rss_mb, Report};
use crate::scenarios::Ctx;
use crate::systems::zk::zk_err;
use crate::systems::{open_many, Sess};

/// How long any one wait (a catch-up, a snapshot, a restart) may take.
const WAIT: Duration = Duration::from_secs(300);
/// How often a member is polled while catching up (as for ours).
/// Writer sessions (or clients) loading the nodes, and how many writes are in flight.
const WRITERS: usize = 8;
const IN_FLIGHT: usize = 256;

/// The state scenario against etcd or ZooKeeper; ZooKeeper's sessions are held by
/// `processes` loadgen processes (0: one per
/// [`ZK_SESSIONS_PER_PROCESS`](crate::profile::peers::ZK_SESSIONS_PER_PROCESS)).
pub async fn state(ctx: &Ctx, processes: usize) -> anyhow::Result<Report> {
    match ctx.cluster.system {
        System::Etcd => etcd(ctx).await,
        System::Zk => zookeeper(ctx, processes).await,
        System::Ours => bail!("state::peers runs against etcd and ZooKeeper (ours: state::ours)"),
    }
}

/// Member `i`'s (1-based) name in `peers.sh`: `m1`.. (etcd) or `z1`.. (ZooKeeper).
fn member_name(ctx: &Ctx, i: usize) -> String {
    match ctx.cluster.system {
        System::Zk => format!("z{i}"),
        _ => format!("m{i}"),
    }
}

/// The 1-based number of the member at endpoint `addr`.
fn member_no(ctx: &Ctx, addr: &str) -> anyhow::Result<usize> {
    ctx.cluster
        .members
        .iter()
        .position(|m| m == addr)
        .map(|i| i + 1)
        .with_context(|| format!("{addr} is not a member"))
}

/// The followers' endpoints (every member but `leader`), with their numbers.
fn followers(ctx: &Ctx, leader: &str) -> Vec<(usize, String)> {
    ctx.cluster
        .members
        .iter()
        .enumerate()
        .filter(|(_, m)| *m != leader)
        .map(|(i, m)| (i + 1, m.clone()))
        .collect()
}

/// `kill -9` the member at `addr`; returns once the process is gone (or a zombie: killed
/// members are reparented to a pid 1 that need not reap them).
async fn kill9(ctx: &Ctx, addr: &str) -> anyhow::Result<()> {
    let pid = ctx
        .cluster
        .pid_of(addr)
        .with_context(|| format!("pid of {addr}"))?;
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let gone = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_or(true, |s| s.lines().any(|l| l.starts_with("State:\tZ")));
        if gone {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("{addr} (pid {pid}) still running 10 s after kill -9")
}

/// A follower killed (`kill -9`) and restarted: times until it answers and until it has
/// applied what the leader had when it was restarted; returns its number.
async fn restart_a_follower(ctx: &Ctx, r: &mut Report) -> anyhow::Result<usize> {
    let leader_index = || async {
        match ctx.cluster.system {
            System::Etcd => etcd_leader_index(ctx).await,
            _ => zk_leader_zxid(ctx).await,
        }
    };
    let (leader, _) = leader_index().await?;
    let (victim, victim_addr) = followers(ctx, &leader)
        .into_iter()
        .next()
        .context("a follower")?;
    kill9(ctx, &victim_addr).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, target) = leader_index().await?;
    let t = Instant::now();
    ctx.cluster.restart_member(&member_name(ctx, victim))?;
    let what = format!("replica-{victim}");
    let (answered, caught) = match ctx.cluster.system {
        System::Etcd => etcd_catch_up(&what, &victim_addr, target, t).await?,
        _ => zk_catch_up(&what, &victim_addr, target, t).await?,
    };
    r.param(
        "restarted",
        format!("replica-{victim} (a follower), kill -9"),
    );
    r.figure("restart: answering after (s)", answered.as_secs_f64());
    r.figure("restart: caught up after (s)", caught.as_secs_f64());
    if let Some(mb) = ctx.cluster.pid_of(&victim_addr).and_then(rss_mb) {
        r.figure(&format!("replica-{victim} RSS after restart (MB)"), mb);
    }
    Ok(victim)
}

// ---------------------------------------------------------------------------------------
// etcd

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
async fn etcd_leader_index(ctx: &Ctx) -> anyhow::Result<(String, u64)> {
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

async fn etcd_catch_up(
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

async fn etcd(ctx: &Ctx) -> anyhow::Result<Report> {
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
        super::ours::spawn_stall_writer(start, stop.clone(), move |v| {
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

// ---------------------------------------------------------------------------------------
// ZooKeeper

/// The last zxid a ZooKeeper server has applied (`srvr`'s `Zxid:`): `None` if it does not
/// answer, `Some(None)` if it answers but does not serve (not synced with a leader).
async fn zk_zxid(addr: &str) -> Option<Option<u64>> {
    let s = four_letter(addr, "srvr").await?;
    Some(
        s.lines()
            .find_map(|l| l.strip_prefix("Zxid:"))
            .and_then(|z| u64::from_str_radix(z.trim().trim_start_matches("0x"), 16).ok()),
    )
}

/// One `mntr` value of a ZooKeeper server.
pub(crate) async fn zk_mntr(addr: &str, key: &str) -> Option<f64> {
    four_letter(addr, "mntr")
        .await?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('\t')?.trim().parse().ok())
}

/// The leader's endpoint and its last applied zxid.
async fn zk_leader_zxid(ctx: &Ctx) -> anyhow::Result<(String, u64)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let leader = ctx.cluster.leader().await?;
        if let Some(Some(z)) = zk_zxid(&leader).await {
            return Ok((leader, z));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the ZooKeeper leader's srvr did not answer within 30 s")
}

async fn zk_catch_up(
    what: &str,
    addr: &str,
    zxid: u64,
    from: Instant,
) -> anyhow::Result<(Duration, Duration)> {
    catch_up(what, zxid, from, WAIT, || zk_zxid(addr)).await
}

/// Member `i`'s data dir (`myid`, and `version-2/` with its snapshots and logs).
fn zk_data(ctx: &Ctx, i: usize) -> std::path::PathBuf {
    ctx.cluster.dir().join(format!("z{i}/data"))
}

/// The newest `snapshot.<zxid>` file in `data/version-2`: (zxid, bytes).
fn zk_newest_snapshot(data: &Path) -> Option<(u64, u64)> {
    std::fs::read_dir(data.join("version-2"))
        .ok()?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let z = u64::from_str_radix(n.strip_prefix("snapshot.")?, 16).ok()?;
            Some((z, e.metadata().ok()?.len()))
        })
        .max()
}

async fn zookeeper(ctx: &Ctx, processes: usize) -> anyhow::Result<Report> {
    let nodes = ctx.n(100_000.0, 1_000);
    let n = ctx.n(50_000.0, 100);
    let parts = crate::profile::peers::parts_for(System::Zk, ctx.scale, processes);
    let members = ctx.cluster.members.clone();
    let mut r = ctx.report("state");
    r.param("nodes (persistent, 1 000 per parent)", nodes);
    r.param("bytes per node", NODE_BYTES);
    r.param("sessions (one connection each)", n);
    if parts > 1 {
        r.param(
            "loadgen processes",
            format!(
                "{} (this one writes the nodes; {parts} others hold the sessions: a \
                 ZooKeeper session is a TCP connection, and one process may hold only {} \
                 here, its open-file limit less 2 000)",
                parts + 1,
                crate::systems::zk_session_cap()
            ),
        );
    }
    rss_of(ctx, &mut r, "empty");

    // Load: the nodes, written by 8 sessions (parents first), then the sessions.
    let mut writers: Vec<zk::Client> = Vec::with_capacity(WRITERS);
    // Their sessions, kept (and resumed if a client gives up) while the writers work.
    let mut writer_sessions = Vec::with_capacity(WRITERS);
    for _ in 0..WRITERS {
        match ctx.conn.session(ctx.lease).await? {
            Sess::Zk(z) => {
                writers.push(z.client());
                writer_sessions.push(z);
            }
            _ => bail!("not a ZooKeeper session"),
        }
    }
    let create = |c: zk::Client, path: String, data: Vec<u8>| async move {
        let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match c.create(&path, &data, &opts).await {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(e) => Err(zk_err(e)).with_context(|| format!("create {path}")),
        }
    };
    create(writers[0].clone(), "/state".into(), Vec::new()).await?;
    for d in 0..nodes.div_ceil(PER_DIR) {
        create(writers[0].clone(), format!("/state/d{d}"), Vec::new()).await?;
    }
    let t = Instant::now();
    each(nodes, IN_FLIGHT, "nodes", |i| {
        let c = writers[i % writers.len()].clone();
        let mut data = format!("node {i} ").into_bytes();
        data.resize(NODE_BYTES, b'x');
        create(c, format!("/state/d{}/n{i}", i / PER_DIR), data)
    })
    .await?;
    r.figure(
        "nodes written per s (load)",
        nodes as f64 / t.elapsed().as_secs_f64(),
    );
    let (_, nodes_zxid) = zk_leader_zxid(ctx).await?;
    let t = Instant::now();
    let mut sessions = if parts > 1 {
        ZkSessions::Held(Holders::start(ctx, n, parts).await?)
    } else {
        ZkSessions::Here(open_many(&ctx.conn, n, ctx.lease).await?)
    };
    r.figure(
        "sessions opened per s (load)",
        n as f64 / t.elapsed().as_secs_f64(),
    );
    if parts <= 1 {
        open_figures(&mut r);
    }

    // Every member has applied everything.
    let (leader, target) = zk_leader_zxid(ctx).await?;
    for (i, m) in members.iter().enumerate() {
        zk_catch_up(&format!("replica-{}", i + 1), m, target, Instant::now()).await?;
    }
    if let Some(c) = zk_mntr(&leader, "zk_znode_count").await {
        r.figure("nodes in the cell", c);
    }
    if let Some(s) = zk_mntr(&leader, "zk_global_sessions").await {
        r.figure("sessions in the cell", s);
    }
    r.figure("log index after load", (target & 0xffff_ffff) as f64);
    r.notes.push(
        "log index after load: the zxid's counter (transactions of the leader's epoch)".into(),
    );
    rss_of(ctx, &mut r, "loaded");

    // Snapshots: none on demand in 3.8; ZooKeeper writes one itself (in the background,
    // fuzzy, without stopping writes) after snapCount/2 to snapCount (100 000)
    // transactions, and one at startup.
    let mut partial = Vec::new();
    for (i, m) in members.iter().enumerate() {
        let who = if *m == leader {
            "leader".to_string()
        } else {
            format!("replica-{}", i + 1)
        };
        match zk_newest_snapshot(&zk_data(ctx, i + 1)) {
            Some((z, bytes)) if z >= nodes_zxid => {
                r.figure(&format!("{who} snapshot size (MB)"), bytes as f64 / 1e6);
                if let Some(ms) = zk_mntr(m, "zk_max_snapshottime").await {
                    r.figure(
                        &format!("{who} own snapshot, longest serialize + write (ms)"),
                        ms,
                    );
                }
            }
            Some((z, bytes)) => partial.push(format!(
                "{who}: snapshot.{z:x}, {:.2} MB",
                bytes as f64 / 1e6
            )),
            None => partial.push(format!("{who}: none")),
        }
    }
    r.notes.push(
        "snapshot: ZooKeeper 3.8 takes no snapshot on demand; reported is the newest \
         snapshot file ZooKeeper wrote itself (in a background thread, fuzzy, after \
         snapCount/2 to snapCount = 100 000 transactions), only where it holds every node; \
         no write stall is measured, and RSS 'after snapshots' is not reported (nothing was \
         asked of it)"
            .into(),
    );
    if !partial.is_empty() {
        r.notes.push(format!(
            "no snapshot holding every node yet (the nodes were in by zxid {nodes_zxid:x}) \
             on {}",
            partial.join("; ")
        ));
    }

    // A follower killed and restarted: it loads its snapshot, replays its log and gets
    // the rest from the leader (a DIFF).
    r.figure("sessions lost after load", sessions.lost().await? as f64);
    let victim = restart_a_follower(ctx, &mut r).await?;
    r.notes.push(
        "restart: answering = it answers srvr (serving or not); caught up = it serves and \
         its last applied zxid reached the leader's at the restart"
            .into(),
    );
    // A session ends a session timeout after its last ping: counted at once and again a
    // timeout later, what each step cost shows apart.
    r.figure(
        "sessions lost after the restart",
        sessions.lost().await? as f64,
    );
    tokio::time::sleep(ctx.lease + Duration::from_secs(1)).await;
    r.figure(
        "sessions lost a session timeout after the restart",
        sessions.lost().await? as f64,
    );

    // A member without data catching up: the other follower, killed, its data dir emptied
    // (but for myid) and restarted; the leader sends it its whole state (a SNAP).
    let (leader, _) = zk_leader_zxid(ctx).await?;
    let (empty, empty_addr) = followers(ctx, &leader)
        .into_iter()
        .find(|(i, _)| *i != victim)
        .or_else(|| followers(ctx, &leader).into_iter().next())
        .context("a follower")?;
    kill9(ctx, &empty_addr).await?;
    let data = zk_data(ctx, empty);
    for e in std::fs::read_dir(&data)
        .with_context(|| format!("read {}", data.display()))?
        .flatten()
    {
        if e.file_name() == "myid" {
            continue;
        }
        let p = e.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        }
        .with_context(|| format!("remove {}", p.display()))?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, target) = zk_leader_zxid(ctx).await?;
    let t = Instant::now();
    ctx.cluster.restart_member(&member_name(ctx, empty))?;
    let (answered, caught) =
        zk_catch_up(&format!("replica-{empty}"), &empty_addr, target, t).await?;
    r.param(
        "emptied",
        format!("replica-{empty} (a follower), kill -9, data dir emptied but for myid"),
    );
    r.figure("empty member: answering after (s)", answered.as_secs_f64());
    r.figure("empty member: caught up after (s)", caught.as_secs_f64());
    r.figure("learner: caught up after (s)", caught.as_secs_f64());
    if let Some(mb) = ctx.cluster.pid_of(&empty_addr).and_then(rss_mb) {
        r.figure("empty member: RSS (MB)", mb);
    }
    r.figure(
        "sessions lost after the empty member caught up",
        sessions.lost().await? as f64,
    );
    tokio::time::sleep(ctx.lease + Duration::from_secs(1)).await;
    let how = match zk_newest_snapshot(&data) {
        Some((z, bytes)) => {
            r.figure("empty member: snapshot written (MB)", bytes as f64 / 1e6);
            format!(
                "it fetched the whole state from the leader (a SNAP), as a new member would, \
                 and wrote it as its snapshot.{z:x} ({:.2} MB)",
                bytes as f64 / 1e6
            )
        }
        None => "it wrote no snapshot, so the leader may have sent it its log (a DIFF) \
                 rather than its state (a SNAP)"
            .to_string(),
    };
    r.notes.push(format!(
        "learner: ZooKeeper 3.8 adds a member (an observer) only by dynamic reconfig, so \
         instead replica-{empty}, a follower, was killed (kill -9), its data dir emptied but \
         for myid, and restarted; {how}; timed from the restart (so with the JVM's start, \
         which ours' learner time does not include) to its applied zxid reaching the \
         leader's (also reported as 'empty member')"
    ));

    let lost = sessions.lost().await?;
    r.figure("sessions lost", lost as f64);
    // Before the holders close theirs.
    let waited = crate::server_sessions::settle(ctx.lease, Instant::now(), None).await;
    let ids: Vec<u64> = sessions
        .ids()
        .into_iter()
        .chain(writers.iter().map(|w| w.session_id().0 as u64))
        .collect();
    let at_server = crate::server_sessions::check(&ctx.cluster, &ids).await;
    crate::server_sessions::report(
        &mut r,
        at_server,
        waited,
        "the sessions and the 8 writers' sessions",
    );
    if let ZkSessions::Held(h) = sessions {
        h.finish(&mut r).await?;
    }
    ctx.costs(&mut r);
    Ok(r)
}

/// ZooKeeper's sessions of the state: in this process, or held by others.
enum ZkSessions {
    Here(Vec<Sess>),
    Held(Holders),
}

impl ZkSessions {
    /// The sessions' ids at the server.
    fn ids(&self) -> Vec<u64> {
        match self {
            ZkSessions::Here(s) => s.iter().map(|s| s.server_id()).collect(),
            ZkSessions::Held(h) => h.ids.clone(),
        }
    }

    /// How many have ended so far.
    async fn lost(&mut self) -> anyhow::Result<usize> {
        match self {
            ZkSessions::Here(s) => Ok(s.iter().filter(|s| s.lost()).count()),
            ZkSessions::Held(h) => h.lost().await,
        }
    }
}

/// Other loadgen processes holding sessions (`loadgen hold-sessions`, [`hold_sessions`]).
struct Holders {
    /// The held sessions' ids at the server.
    ids: Vec<u64>,
    children: Vec<(
        tokio::process::Child,
        tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    )>,
}

impl Holders {
    /// Starts `parts` processes holding `n` sessions between them; returns once every one
    /// has opened its share.
    async fn start(ctx: &Ctx, n: usize, parts: usize) -> anyhow::Result<Holders> {
        use tokio::io::AsyncBufReadExt;
        let exe = std::env::current_exe()?;
        let mut children = Vec::with_capacity(parts);
        for k in 0..parts {
            let count = n / parts + usize::from(k < n % parts);
            let mut c = tokio::process::Command::new(&exe)
                .args(["--system", "zk", "--lease-secs"])
                .arg(ctx.lease.as_secs().to_string())
                .arg("hold-sessions")
                .args(["--endpoints", &ctx.cluster.endpoints.join(",")])
                .args(["--count", &count.to_string()])
                .env("LOADGEN_NO_PROGRESS", "1")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .context("start a loadgen session holder")?;
            let out = tokio::io::BufReader::new(c.stdout.take().expect("piped")).lines();
            children.push((c, out));
        }
        // They open their sessions at the same time, as one process's would be.
        let mut ids = Vec::with_capacity(n);
        for (k, (_, out)) in children.iter_mut().enumerate() {
            match tokio::time::timeout(WAIT, out.next_line()).await {
                Ok(Ok(Some(l))) if l.starts_with("READY") => {
                    for id in l.trim_start_matches("READY").split_whitespace() {
                        ids.push(u64::from_str_radix(id, 16).with_context(|| {
                            format!("session holder {k} named a session {id:?}")
                        })?);
                    }
                }
                Ok(Ok(Some(l))) => bail!("session holder {k} said {l:.80?}, not READY"),
                Ok(_) => bail!("session holder {k} ended before its sessions were open"),
                Err(_) => bail!("session holder {k} did not open its sessions within {WAIT:?}"),
            }
        }
        Ok(Holders { ids, children })
    }

    /// How many of the held sessions have ended so far.
    async fn lost(&mut self) -> anyhow::Result<usize> {
        use tokio::io::AsyncWriteExt;
        let mut lost = 0;
        for (k, (c, out)) in self.children.iter_mut().enumerate() {
            let stdin = c.stdin.as_mut().expect("piped");
            stdin.write_all(b"CHECK\n").await?;
            stdin.flush().await?;
            let line = tokio::time::timeout(WAIT, out.next_line())
                .await
                .with_context(|| format!("session holder {k} did not answer"))??
                .with_context(|| format!("session holder {k} ended before it answered"))?;
            lost += line
                .strip_prefix("LOST ")
                .and_then(|l| l.parse::<usize>().ok())
                .with_context(|| format!("session holder {k} said {line:?}, not LOST <n>"))?;
        }
        Ok(lost)
    }

    /// Ends the holders (closing their sessions); each one's CPU and memory go into `r`.
    async fn finish(mut self, r: &mut Report) -> anyhow::Result<()> {
        for (k, (mut c, _)) in self.children.drain(..).enumerate() {
            if let Some(cost) = c
                .id()
                .and_then(|pid| proc_cost(&format!("loadgen session holder {k}"), pid))
            {
                r.processes.push(cost);
            }
            drop(c.stdin.take());
            let status = tokio::time::timeout(WAIT, c.wait())
                .await
                .with_context(|| format!("session holder {k} did not end"))??;
            if !status.success() {
                bail!("session holder {k} failed: {status}");
            }
        }
        Ok(())
    }
}

/// A session holder of [`Holders`] (the hidden `hold-sessions` command): opens `count`
/// sessions, prints `READY` and their ids at the server (hex, space-separated); on each line from stdin prints `LOST <n>` (how many have
/// ended); closes them and returns when stdin closes.
pub async fn hold_sessions(
    conn: &crate::systems::Conn,
    count: usize,
    lease: Duration,
) -> anyhow::Result<()> {
    use std::io::Write;
    let sessions = open_many(conn, count, lease).await?;
    let ids: Vec<String> = sessions
        .iter()
        .map(|s| format!("{:x}", s.server_id()))
        .collect();
    println!("READY {}", ids.join(" "));
    std::io::stdout().flush()?;
    let read_line = || {
        tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|n| n > 0)
        })
    };
    while read_line().await?? {
        println!("LOST {}", sessions.iter().filter(|s| s.lost()).count());
        std::io::stdout().flush()?;
    }
    Ok(())
}

/// How [`open_many`]'s pacing went in this process (its retries and slowest pace).
fn open_figures(r: &mut Report) {
    use std::sync::atomic::Ordering::Relaxed;
    r.figure(
        "session opens retried (load)",
        crate::systems::OPEN_RETRIES.load(Relaxed) as f64,
    );
    r.figure(
        "session opens in flight at once, fewest after backing off (load)",
        crate::systems::OPEN_WINDOW_LEAST.load(Relaxed) as f64,
    );
}
