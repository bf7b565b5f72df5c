//! The state scenario on ZooKeeper, its sessions held by other loadgen processes when
//! there are many ([`hold_sessions`]).

use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{bail, Context};
use zookeeper_client as zk;

use super::{
    followers, kill9, member_name, open_figures, restart_a_follower, IN_FLIGHT, WAIT, WRITERS,
};
use crate::cluster::{four_letter, System};
use crate::profile::each;
use crate::report::{proc_cost, rss_mb, Report};
use crate::scenarios::Ctx;
use crate::state::{catch_up, rss_of, NODE_BYTES, PER_DIR};
use crate::systems::zk::zk_err;
use crate::systems::{open_many, Sess};

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
pub(super) async fn zk_leader_zxid(ctx: &Ctx) -> anyhow::Result<(String, u64)> {
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

pub(super) async fn zk_catch_up(
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

pub(super) async fn zookeeper(ctx: &Ctx, processes: usize) -> anyhow::Result<Report> {
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
