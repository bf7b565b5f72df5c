//! The scenarios. Each starts from a running cluster, drives it through one [`Conn`], and
//! returns a [`Report`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cluster::{Cluster, System};
use crate::report::{proc_cost, Lat, Report};
use crate::systems::{Conn, Sess};

/// What every scenario gets.
pub struct Ctx {
    pub cluster: Cluster,
    pub conn: Conn,
    pub scale: f64,
    pub lease: Duration,
}

impl Ctx {
    pub(crate) fn n(&self, full: f64, min: usize) -> usize {
        ((full * self.scale).round() as usize).max(min)
    }

    pub(crate) fn secs(&self, full: f64, min: f64) -> Duration {
        Duration::from_secs_f64((full * self.scale).max(min))
    }

    pub(crate) fn report(&self, scenario: &str) -> Report {
        let mut r = Report::new(scenario, self.cluster.system.name(), self.scale);
        r.param("members", self.cluster.members.len());
        r.param("client endpoints", self.cluster.endpoints.join(","));
        r.param("lease / session timeout (s)", self.lease.as_secs());
        r
    }

    pub(crate) fn costs(&self, r: &mut Report) {
        for (name, pid) in self.cluster.processes() {
            if let Some(c) = proc_cost(&name, pid) {
                r.processes.push(c);
            }
        }
        if let Some(c) = proc_cost("loadgen", std::process::id()) {
            r.processes.push(c);
        }
    }

    async fn sessions(&self, n: usize) -> anyhow::Result<Vec<Arc<Sess>>> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let k = (n - out.len()).min(100);
            let got =
                futures::future::join_all((0..k).map(|_| self.conn.session(self.lease))).await;
            for s in got {
                out.push(Arc::new(s?));
            }
        }
        Ok(out)
    }
}

pub(crate) fn bar(len: u64, what: &str) -> ProgressBar {
    // A profile's parts (other loadgen processes) would draw over their parent's bars.
    if std::env::var_os("LOADGEN_NO_PROGRESS").is_some() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {elapsed}")
            .expect("template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// Opens `n` sessions, `batch` at a time, with a progress bar; `open(i)` opens the i-th.
pub(crate) async fn open_batched<T, F, Fut>(
    n: usize,
    batch: usize,
    open: F,
) -> anyhow::Result<Vec<T>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    // `batch` at a time, the first failure fatal: the paced opener with one try.
    let pace = crate::systems::Pace::new(batch, 1, Duration::ZERO);
    Ok(crate::systems::open_paced(n, pace, open).await?.0)
}

fn ticker(d: Duration, what: &str) -> (ProgressBar, tokio::task::JoinHandle<()>) {
    let pb = bar(d.as_secs().max(1), what);
    let p = pb.clone();
    let h = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            p.inc(1);
        }
    });
    (pb, h)
}

/// Uncontended acquire/release: each client loops on its own lock.
pub async fn acquire(ctx: &Ctx) -> anyhow::Result<Report> {
    let n = ctx.n(20.0, 2);
    let dur = ctx.secs(20.0, 3.0);
    let sessions = ctx.sessions(n).await?;
    for (i, s) in sessions.iter().enumerate() {
        s.ensure_dir(&format!("/bench/acq/c{i}")).await?;
    }
    let rpcs0 = etcd_kv_rpcs(&ctx.cluster).await;
    let start = Instant::now();
    let deadline = start + dur;
    let (pb, t) = ticker(dur, "acquire");
    let tasks: Vec<_> = sessions
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let s = s.clone();
            tokio::spawn(async move {
                let (mut acq, mut rel) = (Lat::new(start), Lat::new(start));
                let dir = format!("/bench/acq/c{i}");
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let (h, _) = s.acquire(&dir).await?;
                    let t1 = Instant::now();
                    acq.record(t1 - t0, t1);
                    s.release(h).await?;
                    let t2 = Instant::now();
                    rel.record(t2 - t1, t2);
                }
                anyhow::Ok((acq, rel))
            })
        })
        .collect();
    let (mut acq, mut rel) = (Lat::new(start), Lat::new(start));
    for t in tasks {
        let (a, r) = t.await??;
        acq.merge(&a);
        rel.merge(&r);
    }
    t.abort();
    pb.finish_and_clear();
    let rpcs1 = etcd_kv_rpcs(&ctx.cluster).await;
    let mut r = ctx.report("acquire");
    r.param("clients (sessions, one lock each)", n);
    r.param("duration (s)", dur.as_secs_f64());
    // Any failed operation ends the run with an error: a report has none.
    r.latency_failed("acquire", &acq, 0);
    r.latency_failed("release", &rel, 0);
    r.notes.push(ALL_OR_NOTHING.into());
    // etcd: what the lock recipe cost, counted by the servers (every member's
    // grpc_server_handled_total; a follower answers a KV request itself or forwards it
    // over raft, not over gRPC, so the sum counts each client request once).
    if let (Some(a), Some(b)) = (rpcs0, rpcs1) {
        for m in ["Txn", "Range", "DeleteRange", "Put"] {
            let n = b.get(m).unwrap_or(&0.0) - a.get(m).unwrap_or(&0.0);
            r.figure(
                &format!("etcd {m} RPCs per acquire and release (at the servers)"),
                n / acq.count().max(1) as f64,
            );
        }
    }
    r.figure("acquires per s", acq.count() as f64 / dur.as_secs_f64());
    ctx.costs(&mut r);
    Ok(r)
}

/// The note of a scenario that fails as a whole on any failed operation.
const ALL_OR_NOTHING: &str = "failed: this scenario stops with an error at the first failed \
     operation (no retry), so a report it writes had none";

/// etcd's KV requests answered so far, by method, summed over the members (each
/// member's `grpc_server_handled_total` on its client port's `/metrics`); `None` for the
/// other systems, or if a member did not answer.
async fn etcd_kv_rpcs(cluster: &Cluster) -> Option<std::collections::BTreeMap<String, f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if cluster.system != System::Etcd {
        return None;
    }
    let mut out = std::collections::BTreeMap::new();
    for m in &cluster.members {
        let addr = m.trim_start_matches("http://");
        let body = tokio::time::timeout(Duration::from_secs(5), async {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
                .await
                .ok()?;
            let mut body = String::new();
            s.read_to_string(&mut body).await.ok()?;
            Some(body)
        })
        .await
        .ok()??;
        for line in body.lines() {
            let Some(rest) = line.strip_prefix("grpc_server_handled_total{") else {
                continue;
            };
            if !rest.contains("grpc_service=\"etcdserverpb.KV\"") {
                continue;
            }
            let method = rest.split("grpc_method=\"").nth(1)?.split('"').next()?;
            let n: f64 = line.rsplit(' ').next()?.parse().ok()?;
            *out.entry(method.to_string()).or_insert(0.0) += n;
        }
    }
    Some(out)
}

/// How long a herd's contenders keep trying before the rest count as never granted.
const HERD_PATIENCE: Duration = Duration::from_secs(600);

/// What one herd contender did.
struct Contender {
    /// When it was granted the lock, the hand-off time (from the previous holder's first
    /// release call), and its fencing token; `None` if it never was.
    granted: Option<(Instant, Option<Duration>, u64)>,
    acquire_failed: u64,
    release_failed: u64,
    first_error: Option<String>,
}

/// Aborts its tasks when dropped.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// N contenders on one lock: each takes it, then releases it at once. Hand-off latency is
/// from the previous holder's release call to the next grant. A failed acquire or release
/// is counted and tried again on the same session (as an application would), so one
/// slow request costs its time in the hand-offs instead of ending the run.
pub async fn herd(ctx: &Ctx) -> anyhow::Result<Report> {
    let n = ctx.n(2000.0, 10);
    let sessions = ctx.sessions(n).await?;
    let dir = "/bench/herd";
    sessions[0].ensure_dir(dir).await?;
    let (first, _) = sessions[0].acquire(dir).await?;
    let start = Instant::now();
    let give_up = start + HERD_PATIENCE;
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let pb = bar(n as u64 - 1, "hand-offs");
    let tasks: Vec<_> = sessions[1..]
        .iter()
        .map(|s| {
            let (s, last, pb) = (s.clone(), last_release.clone(), pb.clone());
            tokio::spawn(async move {
                let mut me = Contender {
                    granted: None,
                    acquire_failed: 0,
                    release_failed: 0,
                    first_error: None,
                };
                let mut retry = false;
                let (h, token) = loop {
                    let tried = if retry {
                        s.acquire_again(dir).await
                    } else {
                        s.acquire(dir).await
                    };
                    match tried {
                        Ok(got) => break got,
                        Err(e) => {
                            me.acquire_failed += 1;
                            me.first_error.get_or_insert(format!("acquire: {e:#}"));
                            // A session that is over cannot take the lock any more.
                            if Instant::now() >= give_up || s.lost() {
                                return me;
                            }
                            retry = true;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                };
                let now = Instant::now();
                let waited = last.lock().expect("last").map(|t| now - t);
                *last.lock().expect("last") = Some(Instant::now());
                me.granted = Some((now, waited, token));
                // Until it succeeds: a lock not released stays held until its session
                // ends, and the next hand-off's time runs from the first release call.
                let mut h = Some(h);
                while let Some(held) = h.take() {
                    let again = held.again();
                    if let Err(e) = s.release(held).await {
                        me.release_failed += 1;
                        me.first_error.get_or_insert(format!("release: {e:#}"));
                        // A session that is over released its locks with it.
                        if Instant::now() < give_up && !s.lost() {
                            h = again;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
                pb.inc(1);
                me
            })
        })
        .collect();
    // Stops every contender if this returns early.
    let _stop = AbortOnDrop(tasks.iter().map(|t| t.abort_handle()).collect());
    // Let every contender queue behind the first holder.
    let settle = Duration::from_millis(1000 + n as u64);
    tokio::time::sleep(settle).await;
    let released = Instant::now();
    *last_release.lock().expect("last") = Some(released);
    // Retried as the contenders' releases are.
    let mut h = Some(first);
    let mut first_release_failed = 0u64;
    while let Some(held) = h.take() {
        let again = held.again();
        if let Err(e) = sessions[0].release(held).await {
            first_release_failed += 1;
            if Instant::now() >= give_up || sessions[0].lost() {
                return Err(e.context("the first holder could not release the lock"));
            }
            h = again;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut lat = Lat::new(start);
    let mut tokens = Vec::new();
    let (mut never, mut acquire_failed, mut release_failed) = (0u64, 0u64, first_release_failed);
    let mut first_error = None;
    for t in tasks {
        // A contender still running after the patience (and a minute for its last
        // request) is stopped and counts as never granted.
        let abort = t.abort_handle();
        let me = match tokio::time::timeout_at(give_up + Duration::from_secs(60), t).await {
            Ok(me) => me?,
            Err(_) => {
                abort.abort();
                never += 1;
                continue;
            }
        };
        acquire_failed += me.acquire_failed;
        release_failed += me.release_failed;
        if first_error.is_none() {
            first_error = me.first_error;
        }
        match me.granted {
            Some((at, waited, token)) => {
                if let Some(w) = waited {
                    lat.record(w, at);
                }
                tokens.push((at, token));
            }
            None => never += 1,
        }
    }
    pb.finish_and_clear();
    let total = released.elapsed();
    tokens.sort();
    let increasing = tokens.windows(2).all(|w| w[0].1 < w[1].1);
    let mut r = ctx.report("herd");
    r.param("contenders (sessions)", n);
    r.latency_failed("hand-off", &lat, never);
    r.notes.push(format!(
        "hand-off failed: contenders never granted the lock within {} s (or whose session \
         ended); a failed acquire or release is tried again on the same session after \
         100 ms and counted below (etcd's key stays the session's, as clientv3's Mutex, \
         and a failed wait deletes it first, as Mutex.Lock does; ZooKeeper's node is \
         named with the session id and found again, as Curator's protected mode finds its \
         GUID, and a failed wait deletes it, as Curator's lock does)",
        HERD_PATIENCE.as_secs()
    ));
    r.figure(
        "acquire attempts failed (each tried again)",
        acquire_failed as f64,
    );
    r.figure(
        "release attempts failed (each tried again)",
        release_failed as f64,
    );
    if let Some(e) = first_error {
        r.notes.push(format!("first failure: {e}"));
    }
    r.figure("total after first release (s)", total.as_secs_f64());
    r.figure("hand-offs per s", tokens.len() as f64 / total.as_secs_f64());
    if let Conn::Ours(_) = ctx.conn {
        let events: u64 = sessions
            .iter()
            .map(|s| match s.as_ref() {
                Sess::Ours(s) => s.watch_events_received(),
                _ => 0,
            })
            .sum();
        r.figure("watch events per hand-off", events as f64 / (n - 1) as f64);
    }
    if !increasing {
        r.notes
            .push("fencing tokens did not increase with grant order".into());
    }
    ctx.costs(&mut r);
    Ok(r)
}

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

/// Writers (and their sessions) while the leader is killed (`kill -9`) or frozen
/// (SIGSTOP): how long writes fail, and whether any session is lost, as the clients
/// declared it and as the server confirms it ([`crate::server_sessions`]).
pub async fn failover(ctx: &Ctx, freeze: bool) -> anyhow::Result<Report> {
    let n = ctx.n(16.0, 4);
    let sessions = ctx.sessions(n).await?;
    for (i, s) in sessions.iter().enumerate() {
        s.prepare_key(&format!("/bench-w{i}")).await?;
    }
    let start = Instant::now();
    let before = Duration::from_secs(3);
    let after = Duration::from_secs(if freeze { 20 } else { 12 });
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
    let (pb, t) = ticker(before + after, if freeze { "freeze" } else { "kill -9" });
    tokio::time::sleep(before).await;
    let leader = ctx.cluster.leader().await?;
    let pid = ctx.cluster.pid_of(&leader).context("leader pid")?;
    let event = Instant::now();
    unsafe {
        libc::kill(
            pid as i32,
            if freeze { libc::SIGSTOP } else { libc::SIGKILL },
        )
    };
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
    let gap = unavailable(&done.lock().expect("done"), event, after);
    let name = if freeze {
        "failover-freeze"
    } else {
        "failover"
    };
    let mut r = ctx.report(name);
    r.param("writers (sessions, one key each)", n);
    r.param(
        "event",
        if freeze {
            "leader SIGSTOP"
        } else {
            "leader kill -9"
        },
    );
    r.param("leader", &leader);
    r.latency_failed("write", &lat, failed);
    r.notes.push(
        "write failed: attempts that failed or took over 20 s, each retried after 20 ms \
         (the percentiles are over the successes)"
            .into(),
    );
    r.figure("writes unavailable (s)", gap.as_secs_f64());
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

/// Unavailability after `event`: from it to the first success after it, or the longest
/// gap between successes after it if that is longer; `none` if nothing succeeded.
pub(crate) fn unavailable(successes: &[Instant], event: Instant, none: Duration) -> Duration {
    let mut times: Vec<Instant> = successes.iter().copied().filter(|t| *t > event).collect();
    times.sort();
    let mut gap = Duration::ZERO;
    let mut prev = event;
    for t in times {
        gap = gap.max(t - prev);
        prev = t;
    }
    if prev == event {
        none
    } else {
        gap
    }
}

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
        r.figure(&format!("p99 ms at {level:>3} writers"), lat.summary().p99);
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
    r.latency_failed("write (all levels)", &all, 0);
    r.notes.push(ALL_OR_NOTHING.into());
    r.figure("knee (writers)", knee as f64);
    r.figure("peak writes per s", prev);
    ctx.costs(&mut r);
    Ok(r)
}

/// A mass restart: clients arrive at a fixed rate (2 000 a second at full scale), each
/// opening a new session and taking one of a pool of existing locks (its own: the pool
/// outlasts the hold), holding it briefly, then closing. Latency is from arrival (session
/// open included) to grant.
///
/// Each arrival is a new client process, the same for all three systems: it opens a
/// connection of its own (ours: a new SDK client, so a new QUIC connection; etcd: a new
/// gRPC client; ZooKeeper: a new connection, as a session is one) and drops it when it
/// is done. Its arrival time is its scheduled moment, not when loadgen got round to it:
/// an arrival that waits for one of the 4 000 in-flight places (or for loadgen's own
/// runtime) carries that wait in its latency, as a queue in front of the servers would.
pub async fn burst(ctx: &Ctx) -> anyhow::Result<Report> {
    let rate = (2000.0 * ctx.scale).max(20.0);
    let dur = ctx.secs(30.0, 3.0);
    let hold = Duration::from_secs(2);
    let total = (rate * dur.as_secs_f64()) as u64;
    // Locks are reused after pool / rate seconds, well after their 2 s hold.
    let pool = ((rate * 5.0) as u64).min(total).max(1);
    let setup = ctx.sessions(64).await?;
    setup[0].ensure_dir("/bench/burst").await?;
    let made = Arc::new(AtomicU64::new(0));
    let creators: Vec<_> = setup
        .iter()
        .map(|s| {
            let (s, made) = (s.clone(), made.clone());
            tokio::spawn(async move {
                loop {
                    let i = made.fetch_add(1, Ordering::SeqCst);
                    if i >= pool {
                        return anyhow::Ok(());
                    }
                    s.ensure_dir(&format!("/bench/burst/l{i}")).await?;
                }
            })
        })
        .collect();
    for c in creators {
        c.await??;
    }
    // Up to 4 000 arrivals at once, each a client of its own (a connection and a session).
    const IN_FLIGHT: usize = 4_000;
    let (system, endpoints, ca) = (
        ctx.cluster.system,
        Arc::new(ctx.cluster.endpoints.clone()),
        Arc::new(ctx.cluster.ca.clone()),
    );
    let start = Instant::now();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let failed = Arc::new(AtomicU64::new(0));
    let acquires_failed = Arc::new(AtomicU64::new(0));
    // How many arrivals failed with each error (its first line), for the report's notes.
    let reasons: Arc<Mutex<std::collections::BTreeMap<String, u64>>> = Arc::default();
    // Ours: the local address of each arrival's connection, to show they are its own.
    let local_addrs: Arc<Mutex<std::collections::HashSet<std::net::SocketAddr>>> = Arc::default();
    let pb = bar(total, "arrivals");
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due).await;
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            break;
        };
        let (endpoints, ca) = (endpoints.clone(), ca.clone());
        let (lease, failed, pb) = (ctx.lease, failed.clone(), pb.clone());
        let (reasons, acquires_failed) = (reasons.clone(), acquires_failed.clone());
        let local_addrs = local_addrs.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            // Its scheduled moment: any wait for a place or for loadgen counts.
            let arrived = due;
            let r = async {
                // A new client process: its own connection (dropped at the end).
                let conn = Conn::for_endpoints(system, &endpoints, &ca).await?;
                if let Conn::Ours(c) = &conn {
                    local_addrs.lock().expect("addrs").insert(c.local_addr()?);
                }
                let s = conn.session(lease).await?;
                let dir = format!("/bench/burst/l{}", i % pool);
                let t0 = Instant::now();
                let acquired = s.acquire(&dir).await;
                if acquired.is_err() {
                    acquires_failed.fetch_add(1, Ordering::Relaxed);
                }
                let (h, _) = acquired?;
                let granted = Instant::now();
                tokio::time::sleep(hold).await;
                s.release(h).await?;
                s.close().await;
                anyhow::Ok((arrived, t0, granted))
            }
            .await;
            pb.inc(1);
            if let Err(e) = &r {
                failed.fetch_add(1, Ordering::Relaxed);
                // The first line, numbers left out, so that like errors count together.
                let reason: String = e
                    .to_string()
                    .lines()
                    .next()
                    .unwrap_or("")
                    .chars()
                    .filter(|c| !c.is_ascii_digit())
                    .take(160)
                    .collect();
                *reasons.lock().expect("reasons").entry(reason).or_default() += 1;
            }
            r.ok()
        }));
    }
    let offered = start.elapsed();
    let (mut restart, mut acq) = (Lat::new(start), Lat::new(start));
    for t in tasks {
        if let Some((arrived, t0, granted)) = t.await? {
            restart.record(granted - arrived, granted);
            acq.record(granted - t0, granted);
        }
    }
    pb.finish_and_clear();
    let mut r = ctx.report("burst");
    r.param("arrivals (new session + own lock each)", total);
    r.param(
        "connection per arrival",
        "a new client each, dropped at its end (ours: an SDK client, its own QUIC \
         connection; etcd: a gRPC client; ZooKeeper: a connection)",
    );
    r.param(
        "arrival time",
        "its scheduled moment (a wait for an in-flight place counts)",
    );
    r.param("offered rate (per s)", rate);
    r.param("hold (s)", hold.as_secs());
    r.param("locks (reused round robin)", pool);
    let failed = failed.load(Ordering::Relaxed);
    r.latency_failed("arrival to grant", &restart, failed);
    r.latency_failed("acquire", &acq, acquires_failed.load(Ordering::Relaxed));
    r.figure(
        "achieved arrivals per s",
        total as f64 / offered.as_secs_f64(),
    );
    r.figure("failed", failed as f64);
    if system == System::Ours {
        r.figure(
            "distinct client connections (local UDP ports)",
            local_addrs.lock().expect("addrs").len() as f64,
        );
    }
    for (reason, n) in reasons.lock().expect("reasons").iter() {
        r.notes
            .push(format!("{n} arrivals failed: {reason} (numbers left out)"));
    }
    ctx.costs(&mut r);
    Ok(r)
}
