//! `max-writes`: the write ceiling with fsync on, at rising concurrency.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{Ctx, ALL_OR_NOTHING};
use crate::report::bar;
use crate::report::{Lat, Report};
use crate::systems::Conn;

/// How long the disk is probed before the first level.
const FSYNC_PROBE: Duration = Duration::from_secs(3);

/// The name of the disk probe's latency in a report.
const DISK: &str =
    "disk: 4 KiB write + fdatasync (probe next to the servers' data, before the writers)";

/// The write ceiling with fsync on: each level runs that many writers (one key each) for
/// a while; the knee is the last level that still added 10 % throughput.
pub async fn max_writes(ctx: &Ctx) -> anyhow::Result<Report> {
    let levels: Vec<usize> = [1usize, 4, 16, 64, 256]
        .into_iter()
        .filter(|l| *l <= ctx.n(256.0, 4))
        .collect();
    let per = ctx.secs(10.0, 2.0);
    let top = *levels.last().expect("levels");
    let sessions = ctx.sessions(top).await?;
    for (i, s) in sessions.iter().enumerate() {
        s.prepare_key(&format!("/bench-mw{i}")).await?;
    }
    let start = Instant::now();
    let mut r = ctx.report("max-writes");
    // The machine's fsync, in this run, on the filesystem under the servers' data, before
    // any writer starts: what a commit at one writer is compared with.
    let disk = Arc::new(Mutex::new(Lat::new(start)));
    crate::profile::spawn_fsync_probe(
        ctx.cluster.dir().to_path_buf(),
        Instant::now() + FSYNC_PROBE,
        Arc::new(AtomicBool::new(false)),
        disk.clone(),
    )
    .await?;
    let disk = std::mem::replace(&mut *disk.lock().expect("disk"), Lat::new(start));
    let fsync_p50 = disk.summary().p50;
    r.latency(DISK, &disk);
    let mut all = Lat::new(start);
    let mut prev = 0.0;
    let mut knee = levels[0];
    let pb = bar(levels.len() as u64, "levels");
    for &level in &levels {
        // Ours: how many entries the leader's log flusher made durable per fsync (its
        // group commit), from the leader's counters before and after the level.
        let leader_before = match &ctx.conn {
            Conn::Ours(c) => crate::profile::leader_status(c).await.ok(),
            _ => None,
        };
        let deadline = Instant::now() + per;
        let tasks: Vec<_> = sessions[..level]
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let s = s.clone();
                tokio::spawn(async move {
                    let mut lat = Lat::new(start);
                    let key = format!("/bench-mw{i}");
                    let mut v = 0u64;
                    while Instant::now() < deadline {
                        let t0 = Instant::now();
                        s.write(&key, v.to_string().into_bytes()).await?;
                        let t1 = Instant::now();
                        lat.record(t1 - t0, t1);
                        v += 1;
                    }
                    anyhow::Ok(lat)
                })
            })
            .collect();
        let mut lat = Lat::new(start);
        for t in tasks {
            lat.merge(&t.await??);
        }
        let tput = lat.count() as f64 / per.as_secs_f64();
        r.figure(&format!("writes per s at {level:>3} writers"), tput);
        let summary = lat.summary();
        r.figure(&format!("p50 ms at {level:>3} writers"), summary.p50);
        r.figure(&format!("p99 ms at {level:>3} writers"), summary.p99);
        if level == 1 && disk.count() > 0 && fsync_p50 > 0.0 {
            // A write at one writer is one commit, from the client's request to its answer.
            r.figure(
                "commit p50 at 1 writer / fsync p50",
                summary.p50 / fsync_p50,
            );
        }
        if let (Some(b), Conn::Ours(c)) = (&leader_before, &ctx.conn) {
            if let Ok(a) = crate::profile::leader_status(c).await {
                let syncs = a.log_syncs.saturating_sub(b.log_syncs);
                let entries = a.last_log_index.saturating_sub(b.last_log_index);
                if a.id == b.id && syncs > 0 && entries > 0 {
                    r.figure(
                        &format!("leader log entries per fsync at {level:>3} writers"),
                        entries as f64 / syncs as f64,
                    );
                    // Writes coalesced into one entry share its append and fsync.
                    r.figure(
                        &format!("writes per log entry at {level:>3} writers"),
                        lat.count() as f64 / entries as f64,
                    );
                }
            }
        }
        if tput > prev * 1.1 {
            knee = level;
        }
        prev = prev.max(tput);
        all.merge(&lat);
        pb.inc(1);
    }
    pb.finish_and_clear();
    r.param(
        "levels (writers, one session and key each)",
        format!("{levels:?}"),
    );
    r.param("seconds per level", per.as_secs_f64());
    r.param("sessions held", super::sessions_model(&ctx.conn));
    r.latency_failed("write (all levels)", &all, 0);
    r.notes.push(ALL_OR_NOTHING.into());
    r.notes.push(format!(
        "disk: before the first level, for {} s with no writer, 4 KiB written next to the \
         servers' data and fdatasync'ed every 10 ms; 'commit p50 at 1 writer / fsync p50' \
         divides the one writer's write p50 (request to answer, at the client) by it",
        FSYNC_PROBE.as_secs()
    ));
    r.figure("knee (writers)", knee as f64);
    r.figure("peak writes per s", prev);
    ctx.costs(&mut r);
    Ok(r)
}
