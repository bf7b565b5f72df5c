//! `takeover` (a lock holder killed while a waiter is queued) and `failover` (the
//! leader killed or frozen under writers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::Context;

use super::{longest_gap, ticker, Ctx};
use crate::cluster::System;
use crate::report::{Lat, Report};
use crate::systems::Conn;

/// A holder process dies (`kill -9`); how long until a waiter is granted the lock.
pub async fn takeover(ctx: &Ctx, exe: &std::path::Path) -> anyhow::Result<Report> {
    let dir = "/bench/takeover";
    let waiter = ctx.conn.session(ctx.lease).await?;
    waiter.ensure_dir(dir).await?;
    let mut holder = std::process::Command::new(exe);
    holder.arg("hold");
    if !ctx.cluster.ca.as_os_str().is_empty() {
        holder.arg("--ca").arg(&ctx.cluster.ca);
    }
    let mut holder = holder
        .args([
            "--system",
            match ctx.cluster.system {
                System::Ours => "ours",
                System::Etcd => "etcd",
                System::Zk => "zk",
            },
        ])
        .args(["--endpoints", &ctx.cluster.endpoints.join(",")])
        .args([
            "--lock",
            dir,
            "--lease-secs",
            &ctx.lease.as_secs().to_string(),
            "--request-timeout-secs",
            &crate::systems::request_timeout().as_secs().to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()?;
    let mut line = String::new();
    {
        use std::io::BufRead;
        let mut r = std::io::BufReader::new(holder.stdout.take().context("stdout")?);
        r.read_line(&mut line)?;
    }
    anyhow::ensure!(
        line.starts_with("HELD"),
        "holder did not take the lock: {line:?}"
    );
    let w = tokio::spawn(async move {
        let r = waiter.acquire(dir).await;
        (Instant::now(), r.map(|(_, t)| t))
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    anyhow::ensure!(
        !w.is_finished(),
        "the waiter got the lock while it was held"
    );
    let killed = Instant::now();
    unsafe { libc::kill(holder.id() as i32, libc::SIGKILL) };
    let _ = holder.wait();
    let (pb, t) = ticker(ctx.lease + Duration::from_secs(5), "takeover");
    let (granted, token) = tokio::time::timeout(ctx.lease * 3, w)
        .await
        .context("no takeover within three leases")??;
    t.abort();
    pb.finish_and_clear();
    token?;
    let mut r = ctx.report("takeover");
    r.param("holder", "a separate loadgen process, kill -9");
    let secs = granted.duration_since(killed).as_secs_f64();
    r.figure("takeover after kill -9 (s)", secs);
    r.notes.push(format!(
        "measured from the kill; the holder's last KeepAlive was up to a third of the lease \
         earlier, so from its last KeepAlive the takeover took up to {:.1} s",
        secs + ctx.lease.as_secs_f64() / 3.0
    ));
    ctx.costs(&mut r);
    Ok(r)
}

/// What happens to the leader in [`failover`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaderEvent {
    /// `kill -9`: a crash.
    Kill,
    /// SIGSTOP (resumed with SIGCONT after the run): a stall.
    Freeze,
    /// SIGTERM: a planned restart, as an operator stops a server (each system's own
    /// graceful stop: ours hands the leadership over first, etcd documents doing so).
    Stop,
}

/// Writers (and their sessions) while the leader is killed (`kill -9`), frozen
/// (SIGSTOP) or stopped (SIGTERM): how long writes fail, and whether any session is
/// lost, as the clients declared it and as the server confirms it
/// ([`crate::server_sessions`]).
pub async fn failover(
    ctx: &Ctx,
    event_kind: LeaderEvent,
    after: Option<Duration>,
) -> anyhow::Result<Report> {
    let freeze = event_kind == LeaderEvent::Freeze;
    let n = ctx.n(16.0, 4);
    let sessions = ctx.sessions(n).await?;
    for (i, s) in sessions.iter().enumerate() {
        s.prepare_key(&format!("/bench-w{i}")).await?;
    }
    let start = Instant::now();
    let before = Duration::from_secs(3);
    let after = after.unwrap_or(Duration::from_secs(if freeze { 20 } else { 12 }));
    let stop = Arc::new(AtomicBool::new(false));
    let done: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = sessions
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (s, stop, done) = (s.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut lat = Lat::new(start);
                let mut failed = 0u64;
                let key = format!("/bench-w{i}");
                let mut v = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let t0 = Instant::now();
                    // Failures (and their time) count as unavailability: retry.
                    let ok = tokio::time::timeout(
                        Duration::from_secs(20),
                        s.write(&key, v.to_string().into_bytes()),
                    )
                    .await
                    .is_ok_and(|r| r.is_ok());
                    let t1 = Instant::now();
                    if ok {
                        lat.record(t1 - t0, t1);
                        done.lock().expect("done").push(t1);
                        v += 1;
                    } else {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                (lat, failed)
            })
        })
        .collect();
    let what = match event_kind {
        LeaderEvent::Kill => "kill -9",
        LeaderEvent::Freeze => "freeze",
        LeaderEvent::Stop => "SIGTERM",
    };
    let (pb, t) = ticker(before + after, what);
    tokio::time::sleep(before).await;
    let leader = ctx.cluster.leader().await?;
    let pid = ctx.cluster.pid_of(&leader).context("leader pid")?;
    let event = Instant::now();
    // The event on the wall clock too, to be read beside the servers' logs (when the new
    // leader was elected, docs/benchmarks.md).
    let event_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let signal = match event_kind {
        LeaderEvent::Kill => libc::SIGKILL,
        LeaderEvent::Freeze => libc::SIGSTOP,
        LeaderEvent::Stop => libc::SIGTERM,
    };
    unsafe { libc::kill(pid as i32, signal) };
    tokio::time::sleep(after).await;
    stop.store(true, Ordering::SeqCst);
    let mut lat = Lat::new(start);
    let mut failed = 0;
    for t in tasks {
        let (l, f) = t.await?;
        lat.merge(&l);
        failed += f;
    }
    t.abort();
    pb.finish_and_clear();
    let lost = sessions.iter().filter(|s| s.lost()).count();
    // The server's check while every session is still open, a lease after the fault's
    // election, before a frozen leader resumes (it would answer as leader for a moment).
    let waited = crate::server_sessions::settle(ctx.lease, Instant::now(), Some(event)).await;
    let ids: Vec<u64> = sessions.iter().map(|s| s.server_id()).collect();
    let at_server = crate::server_sessions::check(&ctx.cluster, &ids).await;
    if freeze {
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    }
    // The longest stretch without a write after the event, and when the writes were
    // back (read beside the servers' logs: how soon after the election).
    let longest = longest_gap(&done.lock().expect("done"), event);
    let gap = longest.map_or(after, |(gap, _)| gap);
    let name = match event_kind {
        LeaderEvent::Kill => "failover",
        LeaderEvent::Freeze => "failover-freeze",
        LeaderEvent::Stop => "failover-stop",
    };
    let mut r = ctx.report(name);
    r.param("writers (sessions, one key each)", n);
    r.param("sessions held", super::sessions_model(&ctx.conn));
    r.param(
        "event",
        match event_kind {
            LeaderEvent::Kill => "leader kill -9",
            LeaderEvent::Freeze => "leader SIGSTOP",
            LeaderEvent::Stop => "leader SIGTERM",
        },
    );
    r.param("leader", &leader);
    r.param("run after the event (s)", after.as_secs());
    r.param("event at (Unix time, s)", format!("{event_unix:.3}"));
    r.latency_failed("write", &lat, failed);
    r.notes.push(
        "write failed: attempts that failed or took over 20 s, each retried after 20 ms \
         (the percentiles are over the successes)"
            .into(),
    );
    r.figure("writes unavailable (s)", gap.as_secs_f64());
    if let Some((_, back)) = longest {
        r.figure("writes back after the event (s)", back.as_secs_f64());
    }
    r.figure("sessions lost", lost as f64);
    if let Conn::Zk(_) = ctx.conn {
        r.figure(
            "sessions resumed after their client gave up",
            sessions.iter().map(|s| s.resumed()).sum::<u64>() as f64,
        );
    }
    crate::server_sessions::report(&mut r, at_server, waited, "the writers' sessions");
    ctx.costs(&mut r);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_back_at_the_end_of_the_longest_gap() {
        let event = Instant::now();
        let at = |ms: u64| event + Duration::from_millis(ms);
        // A write answered just after a freeze, then the fail-over's gap, then writes.
        let done = [
            at(0) - Duration::from_millis(5),
            at(3),
            at(1_800),
            at(1_803),
            at(1_900),
        ];
        assert_eq!(
            longest_gap(&done, event),
            Some((Duration::from_millis(1_797), Duration::from_millis(1_800)))
        );
        assert_eq!(
            longest_gap(&[at(0) - Duration::from_millis(1)], event),
            None
        );
        assert_eq!(
            longest_gap(&[at(40)], event),
            Some((Duration::from_millis(40), Duration::from_millis(40)))
        );
    }
}
