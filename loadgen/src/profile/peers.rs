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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::cluster::System;
use crate::profile::Reads;
use crate::profile::{
    each, join_tasks, lat, record, run_with_fault, spawn_config_writer, spawn_jeopardy_sampler,
    spawn_keepalive_sampler, spawn_lateness_probe, Failures, Fault, Injected, JeopardyStats,
    CONFIG_KEYS,
};
use crate::report::{proc_cost, Lat, LatPart, ProcCost, Report};
use crate::scenarios::Ctx;
use crate::systems::etcd_conn::EtcdConn;
use crate::systems::{open_many, Conn, Held, Sess, WatchedValue, ETCD_RENEWALS};

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
    /// A part's own CPU and memory.
    cost: Option<ProcCost>,
    /// Session opens retried in setup, and the fewest opens in flight at once after
    /// backing off ([`crate::systems::open_many`]).
    open_retries: u64,
    open_window_least: u64,
}

/// A share of the load, set up and running.
struct Running {
    start: Instant,
    deadline: Instant,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    acq: Arc<Mutex<Lat>>,
    ka: Arc<Mutex<Lat>>,
    rd: Arc<Mutex<Lat>>,
    wr: Arc<Mutex<Lat>>,
    late: Arc<Mutex<Lat>>,
    writes_ok: Arc<Mutex<Vec<Instant>>>,
    failures: Arc<Failures>,
    jeopardy: Arc<Mutex<JeopardyStats>>,
    errors: Arc<AtomicU64>,
    reads: Arc<AtomicU64>,
    cache_hits: Arc<AtomicU64>,
    churned: Arc<AtomicU64>,
    setup_errors: Arc<AtomicU64>,
    renewals0: u64,
    renewed: u64,
    elapsed: f64,
    slots: Arc<Vec<Mutex<Arc<Sess>>>>,
    admin: Arc<Sess>,
    held: Arc<Mutex<Vec<(usize, Held)>>>,
    n: usize,
    long_locks: usize,
    short_locks: usize,
    short_period: Duration,
    churn_per_s: f64,
    writes_per_s: f64,
    open_secs: f64,
}

/// Sets up `share` (its namespace, config values, sessions and long-held locks), waits
/// for `gate`, then starts the run of `dur`: short locks, readers, the config writer,
/// churn and the KeepAlive sampler.
async fn start(
    conn: &Conn,
    lease: Duration,
    share: &Share,
    dur: Duration,
    gate: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<Running> {
    let n = sessions_at(share.scale);
    let long_locks = ((15_000.0 * share.scale).round() as usize).max(10).min(n);
    let short_locks = ((5_000.0 * share.scale).round() as usize)
        .max(5)
        .min(n - long_locks);
    let short_period = Duration::from_secs(60).min(dur / 3);
    let churn_per_s = (n as f64 / 5_000.0).max(1.0);
    let locks = long_locks + short_locks;
    let lock_dir = format!("{}/locks", share.root);
    let config_dir = format!("{}/config", share.root);

    // Setup: the namespace (ZooKeeper needs parents), the config values, the sessions,
    // then the long-held locks.
    let admin = conn.session(lease).await?;
    admin.ensure_dir(&lock_dir).await?;
    admin.ensure_dir(&config_dir).await?;
    for k in 0..CONFIG_KEYS {
        let key = format!("{config_dir}/k{k}");
        admin.prepare_key(&key).await?;
        admin.write(&key, vec![b'v'; 100]).await?;
    }
    let admin = Arc::new(admin);
    each(locks, 128, "lock dirs", |i| {
        let (admin, dir) = (admin.clone(), format!("{lock_dir}/l{i}"));
        async move { admin.ensure_dir(&dir).await }
    })
    .await?;
    let opened = Instant::now();
    let sessions = open_many(conn, n, lease).await?;
    let open_secs = opened.elapsed().as_secs_f64();
    let sessions: Vec<Arc<Sess>> = sessions.into_iter().map(Arc::new).collect();
    let held: Arc<Mutex<Vec<(usize, Held)>>> = Arc::default();
    let setup_errors = Arc::new(AtomicU64::new(0));
    each(long_locks, 128, "long locks", |i| {
        let (s, held, setup_errors) = (sessions[i].clone(), held.clone(), setup_errors.clone());
        let dir = format!("{lock_dir}/l{i}");
        async move {
            match s.acquire(&dir).await {
                Ok((h, _)) => held.lock().expect("held").push((i, h)),
                Err(e) => {
                    if setup_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        eprintln!("loadgen: a long-held lock was not taken: {e:#}");
                    }
                }
            }
            Ok(())
        }
    })
    .await?;
    let slots: Arc<Vec<Mutex<Arc<Sess>>>> =
        Arc::new(sessions.into_iter().map(Mutex::new).collect());
    gate.await?;

    // The run.
    let start = Instant::now();
    let deadline = start + dur;
    let stop = Arc::new(AtomicBool::new(false));
    let (acq, ka, rd, wr) = (lat(start), lat(start), lat(start), lat(start));
    let writes_ok: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let errors = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Failures::default());
    let reads = Arc::new(AtomicU64::new(0));
    let churned = Arc::new(AtomicU64::new(0));
    let renewals0 = ETCD_RENEWALS.load(Ordering::Relaxed);
    let mut tasks = Vec::new();

    // Short locks: as ours.
    for j in 0..short_locks {
        let i = long_locks + j;
        let (slots, acq, stop, errors) = (slots.clone(), acq.clone(), stop.clone(), errors.clone());
        let failures = failures.clone();
        let offset = short_period.mul_f64(rand::random::<f64>());
        let dir = format!("{lock_dir}/l{i}");
        tasks.push(tokio::spawn(async move {
            let mut due = start + offset;
            while due < deadline && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(due).await;
                let s = slots[i].lock().expect("slot").clone();
                let t0 = Instant::now();
                match failures.acquiring(s.acquire(&dir)).await {
                    Ok((h, _)) => {
                        let t1 = Instant::now();
                        record(&acq, t1 - t0, t1);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        if s.release(h).await.is_err() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        failures.acquire();
                    }
                }
                due += short_period;
            }
        }));
    }

    // Readers: one task per 50 sessions, each reading its value once a period; a reader
    // waits for its previous read, so a saturated cluster lowers the rate achieved.
    // ZooKeeper with `--reads cached` keeps each session's copy under a watch.
    let zk_cache = matches!(conn, Conn::Zk(_)) && crate::profile::reads_mode() == Reads::Cached;
    let cache_hits = Arc::new(AtomicU64::new(0));
    if share.reads_per_s > 0.0 {
        let period = Duration::from_secs_f64(1.0 / share.reads_per_s);
        for first in (0..n).step_by(50) {
            let (slots, rd, stop, reads, errors) = (
                slots.clone(),
                rd.clone(),
                stop.clone(),
                reads.clone(),
                errors.clone(),
            );
            let (failures, cache_hits) = (failures.clone(), cache_hits.clone());
            let offset = period.mul_f64(rand::random::<f64>());
            let config_dir = config_dir.clone();
            tasks.push(tokio::spawn(async move {
                let mut due = start + offset;
                let mut local = Lat::new(start);
                // ZooKeeper with `--reads cached`: each session's watched copy.
                let mut copies: std::collections::HashMap<usize, WatchedValue> =
                    std::collections::HashMap::new();
                while due < deadline && !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep_until(due).await;
                    for i in first..(first + 50).min(slots.len()) {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let s = slots[i].lock().expect("slot").clone();
                        let key = format!("{config_dir}/k{}", i % CONFIG_KEYS);
                        let t0 = Instant::now();
                        let read = if zk_cache {
                            let hit = copies
                                .get_mut(&i)
                                .and_then(|c| c.valid_for(&s).then_some(c.len));
                            match hit {
                                Some(len) => {
                                    cache_hits.fetch_add(1, Ordering::Relaxed);
                                    Ok(len)
                                }
                                None => {
                                    copies.remove(&i);
                                    s.read_watched(&key).await.map(|c| {
                                        let len = c.len;
                                        copies.insert(i, c);
                                        len
                                    })
                                }
                            }
                        } else {
                            s.read(&key).await
                        };
                        match read {
                            Ok(_) => {
                                let t1 = Instant::now();
                                local.record(t1 - t0, t1);
                                reads.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                failures.reads.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    due += period;
                    // Behind by more than a period: skip the missed rounds.
                    let now = Instant::now();
                    if due + period < now {
                        due = now;
                    }
                }
                rd.lock().expect("lat").merge(&local);
            }));
        }
    }

    // The config writer: retries a failed write (its failures are the unavailability).
    // etcd: one member at a time, moving on after a failure, as every etcd client here
    // ([`crate::systems::etcd_conn`]).
    let pinned = match conn {
        Conn::Etcd(eps) => Some(Arc::new(EtcdConn::new(eps.clone()))),
        _ => None,
    };
    tasks.push(spawn_config_writer(
        {
            let (admin, config_dir) = (admin.clone(), config_dir.clone());
            move |key: String, value: Vec<u8>| {
                let (admin, pinned) = (admin.clone(), pinned.clone());
                // The writer names keys under /profile/config; this share's are its own.
                let key = key.replacen("/profile/config", &config_dir, 1);
                async move {
                    match pinned {
                        Some(p) => p
                            .call("Put", |mut c| async move { c.put(key, value, None).await })
                            .await
                            .is_ok(),
                        None => admin.write(&key, value).await.is_ok(),
                    }
                }
            }
        },
        share.writes_per_s,
        deadline,
        stop.clone(),
        wr.clone(),
        writes_ok.clone(),
        failures.clone(),
    ));

    // Churn: sessions that hold no lock are closed and replaced by new ones.
    {
        let (slots, conn, stop, churned, errors) = (
            slots.clone(),
            conn.clone(),
            stop.clone(),
            churned.clone(),
            errors.clone(),
        );
        let plain = locks..n;
        tasks.push(tokio::spawn(async move {
            if plain.is_empty() {
                return;
            }
            let every = Duration::from_secs_f64(1.0 / churn_per_s);
            let mut due = start;
            while due < deadline && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(due).await;
                let i = plain.start + rand::random::<usize>() % plain.len();
                let old = slots[i].lock().expect("slot").clone();
                // As ours: only a healthy session is churned out; one lost or in jeopardy
                // stays in its slot to be counted at the end (replacing it would hide
                // its loss from the clients' count and the server's).
                if old.lost() || !old.lease_valid(lease) {
                    due += every;
                    continue;
                }
                match old.reopen(&conn, lease).await {
                    Ok(fresh) => {
                        *slots[i].lock().expect("slot") = Arc::new(fresh);
                        // Readers may still hold the old one for a moment; it is closed
                        // when the last of them lets go.
                        match Arc::try_unwrap(old) {
                            Ok(s) => s.close().await,
                            Err(shared) => {
                                tokio::spawn(async move {
                                    for _ in 0..100 {
                                        if Arc::strong_count(&shared) == 1 {
                                            break;
                                        }
                                        tokio::time::sleep(Duration::from_millis(50)).await;
                                    }
                                    if let Ok(s) = Arc::try_unwrap(shared) {
                                        s.close().await;
                                    }
                                });
                            }
                        }
                        churned.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                due += every;
            }
        }));
    }

    // KeepAlive round trips (etcd; ZooKeeper's client pings on its own and does not say).
    tasks.push(spawn_keepalive_sampler(
        slots.len(),
        {
            let slots = slots.clone();
            move |i| slots[i].lock().expect("slot").last_keepalive()
        },
        start,
        deadline,
        stop.clone(),
        ka.clone(),
    ));

    // How late this process runs a due task (as ours).
    let late = lat(start);
    tasks.push(spawn_lateness_probe(deadline, stop.clone(), late.clone()));

    // Sessions in jeopardy, defined as ours (no renewal answered for longer than the
    // lease; ZooKeeper: its client not connected).
    let jeopardy = Arc::new(Mutex::new(JeopardyStats::default()));
    tasks.push(spawn_jeopardy_sampler(
        slots.len(),
        {
            let slots = slots.clone();
            move |i| slots[i].lock().expect("slot").lease_valid(lease)
        },
        deadline,
        stop.clone(),
        jeopardy.clone(),
    ));

    Ok(Running {
        start,
        deadline,
        tasks,
        stop,
        acq,
        ka,
        rd,
        wr,
        late,
        writes_ok,
        failures,
        jeopardy,
        errors,
        reads,
        cache_hits,
        churned,
        setup_errors,
        renewals0,
        renewed: 0,
        elapsed: 0.0,
        slots,
        admin,
        held,
        n,
        long_locks,
        short_locks,
        short_period,
        churn_per_s,
        writes_per_s: share.writes_per_s,
        open_secs,
    })
}

impl Running {
    /// The server's ids of the sessions loadgen should still hold: the run's (churned ones
    /// replaced) and the admin session.
    fn ids(&self) -> Vec<u64> {
        self.slots
            .iter()
            .map(|s| s.lock().expect("slot").server_id())
            .chain([self.admin.server_id()])
            .collect()
    }

    /// Ends `k` sessions that hold no lock behind loadgen's back (the test hook
    /// [`crate::server_sessions::END_BEHIND_BACK`]).
    async fn end_behind_back(&self, conn: &Conn, k: usize) -> anyhow::Result<()> {
        let plain = self.long_locks + self.short_locks..self.n;
        anyhow::ensure!(
            k <= plain.len(),
            "cannot end {k} sessions: {} hold no lock",
            plain.len()
        );
        for i in plain.take(k) {
            let s = self.slots[i].lock().expect("slot").clone();
            s.end_behind_back(conn).await?;
        }
        Ok(())
    }

    /// Ends the run: stops and joins every task.
    async fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.elapsed = self.start.elapsed().as_secs_f64();
        self.renewed = ETCD_RENEWALS
            .load(Ordering::Relaxed)
            .saturating_sub(self.renewals0);
        join_tasks(std::mem::take(&mut self.tasks), &self.errors).await;
        self.failures.count_unfinished();
    }

    /// What was measured, once stopped: also counts sessions lost and long-held locks
    /// still held. The sessions stay open (the server's count comes after).
    async fn measure(&self) -> Measured {
        let lost = self
            .slots
            .iter()
            .filter(|s| s.lock().expect("slot").lost())
            .count()
            + usize::from(self.admin.lost());
        let held = std::mem::take(&mut *self.held.lock().expect("held"));
        let mut held_long = 0;
        for (i, h) in &held {
            let s = self.slots[*i].lock().expect("slot").clone();
            if !s.lost() && s.holds(h).await.unwrap_or(false) {
                held_long += 1;
            }
        }
        let part = |l: &Arc<Mutex<Lat>>| l.lock().expect("lat").to_part();
        let start = self.start;
        let (jeopardy_ever, jeopardy_most) = {
            let j = self.jeopardy.lock().expect("jeopardy");
            (j.ever, j.most)
        };
        Measured {
            n: self.n,
            long_locks: self.long_locks,
            short_locks: self.short_locks,
            short_period_s: self.short_period.as_secs_f64(),
            churn_per_s: self.churn_per_s,
            writes_per_s: self.writes_per_s,
            open_secs: self.open_secs,
            setup_errors: self.setup_errors.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            churned: self.churned.load(Ordering::Relaxed),
            elapsed: self.elapsed,
            renewed: self.renewed,
            lost,
            ids: self.ids(),
            jeopardy_ever,
            jeopardy_most,
            held_long,
            acq: part(&self.acq),
            ka: part(&self.ka),
            rd: part(&self.rd),
            wr: part(&self.wr),
            late: part(&self.late),
            writes_ok: self
                .writes_ok
                .lock()
                .expect("ok")
                .iter()
                .map(|t| t.duration_since(start).as_secs_f64())
                .collect(),
            acq_failed: self
                .failures
                .acquires
                .lock()
                .expect("failures")
                .iter()
                .map(|t| t.saturating_duration_since(start).as_secs_f64())
                .collect(),
            reads_failed: self.failures.reads.load(Ordering::Relaxed),
            writes_failed: self.failures.writes.load(Ordering::Relaxed),
            cost: None,
            open_retries: crate::systems::OPEN_RETRIES.load(Ordering::Relaxed),
            open_window_least: crate::systems::OPEN_WINDOW_LEAST.load(Ordering::Relaxed),
        }
    }
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
    let pb = crate::scenarios::bar(parts as u64, "parts ready");
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
                "{} ({})",
                n.div_ceil(crate::systems::ETCD_LEASES_PER_CLIENT),
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
