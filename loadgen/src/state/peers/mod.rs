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

use std::time::Duration;
use tokio::time::Instant;

use anyhow::{bail, Context};

use crate::cluster::System;
use crate::report::{rss_mb, Report};
use crate::scenarios::Ctx;

mod etcd;
mod zk;

use etcd::{etcd, etcd_catch_up, etcd_leader_index};
pub use zk::hold_sessions;
use zk::{zk_catch_up, zk_leader_zxid, zookeeper};

/// How long any one wait (a catch-up, a snapshot, a restart) may take.
const WAIT: Duration = Duration::from_secs(300);
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
