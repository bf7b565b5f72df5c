//! The `profile` scenario against etcd and ZooKeeper: the seed's steady state with each
//! peer's own sessions, lock recipe and reads, so it can be set beside ours.
//!
//! The same load as ours (see [`crate::profile`]): 50 000 sessions at full scale, 15 000
//! locks held all run and 5 000 taken once a period (held 1 s), every session reading one
//! of 100 config values once a second, 10 config writes a second, 10 sessions a second
//! closed and replaced; `--fault kill|freeze` kills or freezes the leader 40 % in.
//!
//! What differs is what the peers are:
//! - **etcd**: a session is a lease renewed every 4 s; 2 000 leases share a gRPC client,
//!   each renewed on its own keep-alive stream (as independent clients would), or with
//!   `--etcd-shared-keepalive` all on one ([`crate::systems::etcd_leases`], as one clientv3
//!   process holding them would). Every renewal goes to the leader (followers forward
//!   them). Reads are
//!   linearizable ranges, served by the cluster (etcd's client cache, clientv3's
//!   `leasing` KV, has no Rust client).
//! - **ZooKeeper**: a session is a TCP connection (50 000 of them); its client pings the
//!   member it is connected to. Reads are `getData` at that member (sequentially
//!   consistent, not linearizable); with `--reads cached` (the default) each session
//!   keeps its value under a watch, as Curator's `NodeCache`.
//!
//! Neither has a proxy tier, so every read and every renewal reaches the cluster; the
//! report says how many were achieved, since a reader waits for its previous read.
//!
//! ZooKeeper's sessions are connections, and one process here may hold fewer than 20 000
//! of them (its open-file hard limit), so above 15 000 sessions the load is split over
//! several loadgen processes ([`profile_parts`]): each runs a share (its own sessions,
//! locks, readers, churn and a share of the config writes, under its own root), they
//! start the run together, and this process injects the fault and merges their
//! histograms and counts into one report.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::cluster::System;
use crate::profile::{run_with_fault, Fault, Injected};
use crate::profile::{Reads, CONFIG_KEYS};
use crate::report::{proc_cost, Lat, LatPart, ProcCost, Report};
use crate::scenarios::Ctx;
use crate::systems::Conn;

mod running;

use running::start;

/// ZooKeeper sessions one loadgen process takes when the profile is split
/// ([`parts_for`]).
pub const ZK_SESSIONS_PER_PROCESS: usize = 15_000;

/// Sessions of the profile at `scale` (as [`Ctx::n`] counts them).
fn sessions_at(scale: f64) -> usize {
    ((50_000.0 * scale).round() as usize).max(50)
}

/// How many loadgen processes the profile on `system` at `scale` uses: `asked` if not 0,
/// else for ZooKeeper one per [`ZK_SESSIONS_PER_PROCESS`] sessions, else one.
pub fn parts_for(system: System, scale: f64, asked: usize) -> usize {
    if asked > 0 {
        asked
    } else if system == System::Zk {
        sessions_at(scale).div_ceil(ZK_SESSIONS_PER_PROCESS).max(1)
    } else {
        1
    }
}

/// One process's share of the load: all of it, or one part of several.
struct Share {
    scale: f64,
    reads_per_s: f64,
    /// Where its locks and config values live.
    root: String,
    /// Config writes a second this process makes.
    writes_per_s: f64,
}

/// What one process measured; the parts' are merged by [`profile_parts`].
#[derive(Serialize, Deserialize)]
pub struct Measured {
    n: usize,
    long_locks: usize,
    short_locks: usize,
    short_period_s: f64,
    churn_per_s: f64,
    writes_per_s: f64,
    open_secs: f64,
    setup_errors: u64,
    errors: u64,
    reads: u64,
    /// Reads served from the client's watched copy (ZooKeeper, `--reads cached`).
    cache_hits: u64,
    churned: u64,
    elapsed: f64,
    renewed: u64,
    lost: usize,
    /// The server's ids of the sessions loadgen should still hold: the run's (churned ones
    /// replaced) and the admin session ([`Sess::server_id`]).
    ids: Vec<u64>,
    /// Sessions seen in jeopardy at least once, and the most at once
    /// ([`Sess::lease_valid`]).
    jeopardy_ever: usize,
    jeopardy_most: usize,
    held_long: usize,
    acq: LatPart,
    ka: LatPart,
    rd: LatPart,
    wr: LatPart,
    /// loadgen's own lateness ([`crate::profile::spawn_lateness_probe`]).
    late: LatPart,
    /// When config writes succeeded, seconds from the run's start.
    writes_ok: Vec<f64>,
    /// When short-lock acquires failed, seconds from the run's start.
    acq_failed: Vec<f64>,
    /// Config reads that failed, and config write attempts that failed.
    reads_failed: u64,
    writes_failed: u64,
    /// Why operations failed, as (operation, reason, count) ([`crate::profile::Failures`]).
    #[serde(default)]
    reasons: Vec<(String, String, u64)>,
    /// A part's own CPU and memory.
    cost: Option<ProcCost>,
    /// Session opens retried in setup, and the fewest opens in flight at once after
    /// backing off ([`crate::systems::open_many`]).
    open_retries: u64,
    open_window_least: u64,
}

/// The profile scenario for etcd and ZooKeeper, in this process. `reads_per_s` is each
/// session's config reads a second.
pub async fn profile(
    ctx: &Ctx,
    secs: Option<f64>,
    fault: Option<Fault>,
    reads_per_s: f64,
) -> anyhow::Result<Report> {
    let dur = secs.map_or_else(|| ctx.secs(120.0, 20.0), Duration::from_secs_f64);
    let share = Share {
        scale: ctx.scale,
        reads_per_s,
        root: "/profile".into(),
        writes_per_s: 10.0,
    };
    let mut run = start(&ctx.conn, ctx.lease, &share, dur, async { Ok(()) }).await?;
    let (begun, deadline) = (run.start, run.deadline);
    let injected = run_with_fault(ctx, begun, deadline, fault).await?;
    run.stop().await;
    // What the clients saw at the end of the run, before the hook and the wait (as each
    // part of a split run measures it).
    let m = run.measure().await;
    run.end_behind_back(&ctx.conn, crate::server_sessions::behind_back_share(0, 1))
        .await?;
    // The server's check while every session is open, a lease after the run (or the
    // fault), before a frozen leader resumes.
    let waited = crate::server_sessions::settle(
        ctx.lease,
        Instant::now(),
        injected.as_ref().map(Injected::at),
    )
    .await;
    let at_server = crate::server_sessions::check(&ctx.cluster, &run.ids()).await;
    if let Some(i) = &injected {
        i.resume(ctx);
    }
    let r = report(
        ctx,
        fault,
        reads_per_s,
        &[m],
        injected,
        (begun, deadline),
        (at_server, waited),
    );
    // Sessions end with the cluster (revoking 50 000 leases would be 50 000 writes).
    drop(run);
    r
}

/// The profile split over `parts` loadgen processes (`loadgen profile-part`, started
/// from this executable): each sets up its share, they start the run together, this
/// process injects the fault and merges what they measured.
pub async fn profile_parts(
    ctx: &Ctx,
    secs: Option<f64>,
    fault: Option<Fault>,
    reads_per_s: f64,
    parts: usize,
) -> anyhow::Result<Report> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let dur = secs.map_or_else(|| ctx.secs(120.0, 20.0), Duration::from_secs_f64);
    let dir = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for k in 0..parts {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args([
            "--system",
            match ctx.cluster.system {
                System::Ours => "ours",
                System::Etcd => "etcd",
                System::Zk => "zk",
            },
        ]);
        cmd.args(["--scale", &(ctx.scale / parts as f64).to_string()]);
        cmd.args(["--lease-secs", &ctx.lease.as_secs().to_string()]);
        cmd.args([
            "--request-timeout-secs",
            &crate::systems::request_timeout().as_secs().to_string(),
        ]);
        if crate::systems::ETCD_SHARED_KEEPALIVE.load(Ordering::Relaxed) {
            cmd.arg("--etcd-shared-keepalive");
        }
        if crate::systems::ETCD_LEADER_ONLY.load(Ordering::Relaxed) {
            cmd.arg("--etcd-leader-only");
        }
        if crate::systems::ETCD_LEASE_PER_CLIENT.load(Ordering::Relaxed) {
            cmd.arg("--etcd-lease-per-client");
        }
        cmd.args([
            "--reads",
            match crate::profile::reads_mode() {
                Reads::Cached => "cached",
                Reads::Uncached => "uncached",
            },
        ]);
        cmd.args([
            "--end-sessions-behind-back",
            &crate::server_sessions::behind_back_share(k, parts).to_string(),
        ]);
        cmd.arg("profile-part");
        cmd.args(["--endpoints", &ctx.cluster.endpoints.join(",")]);
        if !ctx.cluster.ca.as_os_str().is_empty() {
            cmd.arg("--ca").arg(&ctx.cluster.ca);
        }
        cmd.args(["--part", &k.to_string(), "--parts", &parts.to_string()]);
        cmd.args(["--secs", &dur.as_secs_f64().to_string()]);
        cmd.args(["--reads-per-session", &reads_per_s.to_string()]);
        cmd.arg("--result")
            .arg(dir.path().join(format!("part-{k}.json")));
        cmd.env("LOADGEN_NO_PROGRESS", "1");
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        children.push(cmd.spawn().context("start a loadgen part")?);
    }
    // Every part set up (sessions open, long locks held), then all start at once.
    let pb = crate::report::bar(parts as u64, "parts ready");
    let mut lines = Vec::new();
    for (k, c) in children.iter_mut().enumerate() {
        let out = c.stdout.take().expect("piped");
        let mut out = tokio::io::BufReader::new(out).lines();
        let ready = tokio::time::timeout(Duration::from_secs(1_800), async {
            while let Some(l) = out.next_line().await? {
                if l == "READY" {
                    return Ok(true);
                }
            }
            Ok::<bool, std::io::Error>(false)
        })
        .await;
        match ready {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) | Ok(Err(_)) => anyhow::bail!("loadgen part {k} ended during setup"),
            Err(_) => anyhow::bail!("loadgen part {k} not set up within 30 minutes"),
        }
        lines.push(out);
        pb.inc(1);
    }
    pb.finish_and_clear();
    // Kept open until the server's sessions are counted: a part ends when its stdin
    // closes, closing its sessions.
    let mut stdins = Vec::with_capacity(parts);
    for c in children.iter_mut() {
        let mut stdin = c.stdin.take().expect("piped");
        stdin.write_all(b"GO\n").await?;
        stdin.flush().await?;
        stdins.push(stdin);
    }
    let begun = Instant::now();
    let deadline = begun + dur;
    let injected = run_with_fault(ctx, begun, deadline, fault).await?;
    // Every part has measured and still holds its sessions: the server's count.
    for (k, out) in lines.iter_mut().enumerate() {
        let measured = tokio::time::timeout(Duration::from_secs(300), async {
            while let Some(l) = out.next_line().await? {
                if l == "MEASURED" {
                    return Ok(true);
                }
            }
            Ok::<bool, std::io::Error>(false)
        })
        .await;
        match measured {
            Ok(Ok(true)) => {}
            Ok(_) => anyhow::bail!("loadgen part {k} ended before it had measured"),
            Err(_) => anyhow::bail!("loadgen part {k} did not measure within 5 minutes"),
        }
    }
    let mut measured = Vec::new();
    for k in 0..parts {
        let path = dir.path().join(format!("part-{k}.json"));
        let m: Measured = serde_json::from_slice(
            &std::fs::read(&path).with_context(|| format!("read {}", path.display()))?,
        )?;
        measured.push(m);
    }
    let waited = crate::server_sessions::settle(
        ctx.lease,
        Instant::now(),
        injected.as_ref().map(Injected::at),
    )
    .await;
    let ids: Vec<u64> = measured
        .iter()
        .flat_map(|m| m.ids.iter().copied())
        .collect();
    let at_server = crate::server_sessions::check(&ctx.cluster, &ids).await;
    drop(stdins);
    for (k, c) in children.iter_mut().enumerate() {
        let status = tokio::time::timeout(Duration::from_secs(300), c.wait())
            .await
            .with_context(|| format!("loadgen part {k} did not end within 5 minutes"))??;
        if !status.success() {
            anyhow::bail!("loadgen part {k} failed: {status}");
        }
    }
    if let Some(i) = &injected {
        i.resume(ctx);
    }
    drop(lines);
    report(
        ctx,
        fault,
        reads_per_s,
        &measured,
        injected,
        (begun, deadline),
        (at_server, waited),
    )
}

/// One part of [`profile_parts`] (the hidden `profile-part` command): sets up its share
/// under `/profile/p<part>`, prints `READY`, starts when a line arrives on stdin, runs for
/// `secs`, writes what it measured to `result` as JSON and prints `MEASURED`, then holds
/// its sessions until stdin closes (so the server's sessions can be counted).
pub async fn part(
    conn: &Conn,
    lease: Duration,
    scale: f64,
    (part, parts): (usize, usize),
    secs: f64,
    reads_per_s: f64,
    result: &Path,
) -> anyhow::Result<()> {
    let share = Share {
        scale,
        reads_per_s,
        root: format!("/profile/p{part}"),
        writes_per_s: 10.0 / parts as f64,
    };
    let gate = async {
        use std::io::Write;
        println!("READY");
        std::io::stdout().flush()?;
        let mut line = String::new();
        tokio::task::spawn_blocking(move || std::io::stdin().read_line(&mut line)).await??;
        Ok(())
    };
    let mut run = start(conn, lease, &share, Duration::from_secs_f64(secs), gate).await?;
    tokio::time::sleep_until(run.deadline).await;
    run.stop().await;
    run.end_behind_back(conn, crate::server_sessions::behind_back_share(0, 1))
        .await?;
    let mut m = run.measure().await;
    m.cost = proc_cost(&format!("loadgen part {part}"), std::process::id());
    std::fs::write(result, serde_json::to_vec(&m)?)
        .with_context(|| format!("write {}", result.display()))?;
    {
        use std::io::Write;
        println!("MEASURED");
        std::io::stdout().flush()?;
    }
    // Until the parent has counted the server's sessions (it closes stdin), or 10 minutes.
    let wait = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)
    });
    let _ = tokio::time::timeout(Duration::from_secs(600), wait).await;
    drop(run);
    Ok(())
}

/// The report of a profile run from what each process measured.
fn report(
    ctx: &Ctx,
    fault: Option<Fault>,
    reads_per_s: f64,
    parts: &[Measured],
    injected: Option<Injected>,
    (begun, deadline): (Instant, Instant),
    (at_server, waited): (anyhow::Result<crate::server_sessions::Check>, Duration),
) -> anyhow::Result<Report> {
    let sum = |f: fn(&Measured) -> f64| parts.iter().map(f).sum::<f64>();
    let n = sum(|m| m.n as f64) as usize;
    let long_locks = sum(|m| m.long_locks as f64) as usize;
    let short_locks = sum(|m| m.short_locks as f64) as usize;
    let elapsed = parts.iter().map(|m| m.elapsed).fold(0.0, f64::max);
    let open_secs = parts.iter().map(|m| m.open_secs).fold(0.0, f64::max);
    let short_period = parts.first().map_or(0.0, |m| m.short_period_s);
    let (mut acq, mut ka, mut rd, mut wr, mut late) = (
        Lat::new(begun),
        Lat::new(begun),
        Lat::new(begun),
        Lat::new(begun),
        Lat::new(begun),
    );
    let mut writes_ok = Vec::new();
    let mut acq_failed = Vec::new();
    for m in parts {
        acq_failed.extend(
            m.acq_failed
                .iter()
                .map(|s| begun + Duration::from_secs_f64(*s)),
        );
        acq.merge(&Lat::from_part(&m.acq, begun)?);
        ka.merge(&Lat::from_part(&m.ka, begun)?);
        rd.merge(&Lat::from_part(&m.rd, begun)?);
        wr.merge(&Lat::from_part(&m.wr, begun)?);
        late.merge(&Lat::from_part(&m.late, begun)?);
        writes_ok.extend(
            m.writes_ok
                .iter()
                .map(|s| begun + Duration::from_secs_f64(*s)),
        );
    }
    writes_ok.sort();
    let etcd = ctx.cluster.system == System::Etcd;
    let mut r = ctx.report(Injected::scenario(fault));
    r.param("sessions", n);
    if etcd {
        r.param(
            "gRPC connections (leases per connection)",
            format!(
                "{} (up to {})",
                crate::systems::etcd_clients_for(n, ctx.cluster.members.len()),
                crate::systems::ETCD_LEASES_PER_CLIENT
            ),
        );
        r.param(
            "etcd leases",
            if crate::systems::ETCD_LEASE_PER_CLIENT.load(Ordering::Relaxed) {
                "one per gRPC connection, shared by its sessions (--etcd-lease-per-client)"
            } else {
                "one per session"
            },
        );
        r.param(
            "etcd keep-alive streams",
            if crate::systems::ETCD_SHARED_KEEPALIVE.load(Ordering::Relaxed) {
                "one per gRPC connection (--etcd-shared-keepalive)"
            } else {
                "one per lease"
            },
        );
        r.param(
            "etcd lease clients connected to",
            if crate::systems::ETCD_LEADER_ONLY.load(Ordering::Relaxed) {
                "the leader only (--etcd-leader-only)"
            } else {
                "all members, spread"
            },
        );
    } else {
        r.param("TCP connections (one per session)", n);
    }
    r.param("proxies", 0);
    r.param(
        "loadgen processes",
        if parts.len() > 1 {
            format!(
                "{} ({} running sessions, each with its own root; 1 injecting the fault \
                 and merging)",
                parts.len() + 1,
                parts.len()
            )
        } else {
            "1".into()
        },
    );
    r.param("locks held all run", long_locks);
    r.param(
        "short locks (each taken once a period, held 1 s)",
        format!("{short_locks} (period {short_period:.0} s)"),
    );
    r.param(
        "config values (each session reads one a second)",
        CONFIG_KEYS * parts.len(),
    );
    r.param("config reads per session per s", reads_per_s);
    r.param("config writes per s", sum(|m| m.writes_per_s));
    r.param("sessions churned per s", sum(|m| m.churn_per_s));
    if etcd && crate::systems::ETCD_LEASE_PER_CLIENT.load(Ordering::Relaxed) {
        r.notes.push(
            "--etcd-lease-per-client: a churned session is a new user of its client's \
             lease, so churn costs etcd no LeaseGrant or LeaseRevoke in this row (ours and \
             ZooKeeper open and close a session at the server); a lost lease is all of \
             its client's sessions lost"
                .into(),
        );
    }
    r.param("run (s)", format!("{elapsed:.0}"));
    r.latency_failed("acquire (short locks)", &acq, acq_failed.len() as u64);
    if ka.count() > 0 {
        r.latency("KeepAlive round trip", &ka);
    }
    let zk_cache = !etcd && crate::profile::reads_mode() == Reads::Cached;
    r.param(
        "config reads",
        match (etcd, zk_cache) {
            (true, _) if crate::profile::reads_mode() == Reads::Cached => {
                "uncached: linearizable ranges (etcd's linearizable client cache, clientv3's \
                 leasing KV, has no Rust client; --reads cached leaves etcd uncached)"
            }
            (true, _) => "uncached: linearizable ranges",
            (false, true) => {
                "cached: getData with a watch, the copy served until the watch fires, as \
                 Curator's NodeCache (eventually consistent)"
            }
            (false, false) => "uncached: getData at the connected member (sequentially consistent)",
        },
    );
    if reads_per_s > 0.0 {
        r.latency_failed(
            crate::profile::read_row(zk_cache),
            &rd,
            sum(|m| m.reads_failed as f64) as u64,
        );
    }
    r.latency_failed("config write", &wr, sum(|m| m.writes_failed as f64) as u64);
    r.notes.push(
        "failed: next to each client operation's latency (whose percentiles are over the \
         successes); a config write's are failed attempts, each retried after 20 ms; an \
         acquire still unfinished when its task was given up, 30 s after the run, failed; a \
         renewal the keeper retries itself is not counted (see jeopardy and the \
         server-side session check)"
            .into(),
    );
    crate::profile::note_reasons(&mut r, parts.iter().flat_map(|m| m.reasons.iter().cloned()));
    r.latency(crate::profile::LATENESS, &late);
    r.figure("sessions opened per s (setup)", n as f64 / open_secs);
    r.figure(
        "session opens retried (setup)",
        sum(|m| m.open_retries as f64),
    );
    r.figure(
        "session opens in flight at once, fewest after backing off (setup)",
        parts
            .iter()
            .map(|m| m.open_window_least)
            .min()
            .unwrap_or(crate::systems::OPEN_WINDOW as u64) as f64,
    );
    r.notes.push(format!(
        "setup: sessions are opened up to {} at once; a round with a failed open (a \
         deadline passed on a busy server) halves that, waits 1 s and tries the failed \
         ones again, a clean round grows it back (loadgen/src/systems/mod.rs open_many)",
        crate::systems::OPEN_WINDOW
    ));
    r.figure("sessions lost", sum(|m| m.lost as f64));
    if etcd {
        let leases: std::collections::HashSet<u64> =
            parts.iter().flat_map(|m| m.ids.iter().copied()).collect();
        r.figure("etcd leases of loadgen's sessions", leases.len() as f64);
    }
    crate::server_sessions::note_behind_back(&mut r);
    crate::server_sessions::report(
        &mut r,
        at_server,
        waited,
        "the run's sessions, churned ones replaced, and each loadgen process's admin \
         session",
    );
    r.figure(
        "sessions in jeopardy at some point",
        sum(|m| m.jeopardy_ever as f64),
    );
    r.figure(
        "sessions in jeopardy at once (most)",
        sum(|m| m.jeopardy_most as f64),
    );
    r.notes.push(if etcd {
        "jeopardy: a lease whose last renewal (or grant) was answered longer than the \
         lease ago, sampled every 200 ms, as ours (its local lease run out)"
            .into()
    } else {
        "jeopardy: a session whose client is not connected (the Java client's \
         Disconnected, Curator's SUSPENDED), sampled every 200 ms: ZooKeeper's client does \
         not expose its pings, so this stands for ours' 'local lease run out'"
            .into()
    });
    r.figure("long-held locks still held", sum(|m| m.held_long as f64));
    let read_rate = sum(|m| m.reads as f64) / elapsed;
    r.figure("config reads per s (at clients)", read_rate);
    let hits = sum(|m| m.cache_hits as f64);
    r.figure(
        "client cache hit rate (%)",
        100.0 * hits / sum(|m| m.reads as f64).max(1.0),
    );
    r.figure("reads reaching the cell per s", read_rate - hits / elapsed);
    r.figure("sessions churned", sum(|m| m.churned as f64));
    r.figure("operation errors", sum(|m| m.errors as f64));
    r.figure(
        "setup errors (long-held locks not taken)",
        sum(|m| m.setup_errors as f64),
    );
    if etcd {
        // Followers forward every LeaseKeepAlive to the leader.
        let renewed = sum(|m| m.renewed as f64);
        r.figure("KeepAlive RPCs at the leader per s", renewed / elapsed);
        r.figure("leases renewed per s", renewed / elapsed);
    } else {
        r.notes.push(format!(
            "ZooKeeper sessions are kept alive by the member each is connected to (the \
             client pings after 9/40 of the session timeout without a request and drops a \
             connection silent for 3/5 of it, as near the Java client's 1/4 and 2/3 as \
             zookeeper-client allows{}); the client does not expose the round trip, so \
             there is no KeepAlive latency row",
            if reads_per_s >= 1.0 {
                "; the readers' requests keep most sessions busy instead"
            } else {
                ""
            }
        ));
    }
    if parts.len() > 1 {
        r.notes.push(format!(
            "sessions split over {} loadgen processes (one process may hold fewer than \
             20 000 connections here); setup figures are for all of them together",
            parts.len()
        ));
    }
    r.notes.push(format!(
        "{}; the readers achieved {read_rate:.0} of the {:.0} reads a second asked for",
        if zk_cache {
            "a read served from a watched copy counts as a hit; the others reach the \
             member the session is connected to"
        } else {
            "no client cache: every config read reaches the cluster"
        },
        n as f64 * reads_per_s
    ));
    if let Some(i) = &injected {
        i.report(&mut r, &writes_ok, (&acq, &acq_failed), begun, deadline);
    }
    ctx.costs(&mut r);
    r.processes
        .extend(parts.iter().filter_map(|m| m.cost.clone()));
    Ok(r)
}
