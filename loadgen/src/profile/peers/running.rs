//! One process's share of the profile on a peer, set up and running: [`start`] sets the
//! share up ([`set_up`]: namespace, config values, sessions, long-held locks), waits for
//! the gate, then starts each kind of load as its own tasks (short locks, readers, the
//! config writer, churn) and the samplers; [`Running`] stops them and measures.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use super::{sessions_at, Measured, Share};
use crate::profile::Reads;
use crate::profile::{
    each, join_tasks, lat, open_loop_reads, record, spawn_config_writer, spawn_jeopardy_sampler,
    spawn_keepalive_sampler, spawn_lateness_probe, Failures, JeopardyStats, ReadCounts,
    CONFIG_KEYS,
};
use crate::report::Lat;
use crate::systems::etcd_conn::EtcdConn;
use crate::systems::{open_many, Conn, Held, Sess, WatchedValue, ETCD_RENEWALS};

/// A share of the load, set up and running.
pub(super) struct Running {
    pub(super) start: Instant,
    pub(super) deadline: Instant,
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
/// churn and the samplers.
pub(super) async fn start(
    conn: &Conn,
    lease: Duration,
    share: &Share,
    dur: Duration,
    gate: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<Running> {
    let set = set_up(conn, lease, share, dur).await?;
    gate.await?;

    // The run.
    let start = Instant::now();
    let run = RunCtx {
        slots: set.slots.clone(),
        start,
        deadline: start + dur,
        stop: Arc::new(AtomicBool::new(false)),
        errors: Arc::new(AtomicU64::new(0)),
        failures: Arc::new(Failures::default()),
    };
    let (acq, ka, rd, wr) = (lat(start), lat(start), lat(start), lat(start));
    let writes_ok: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let reads = Arc::new(AtomicU64::new(0));
    let cache_hits = Arc::new(AtomicU64::new(0));
    let churned = Arc::new(AtomicU64::new(0));
    let renewals0 = ETCD_RENEWALS.load(Ordering::Relaxed);
    let mut tasks = Vec::new();
    spawn_short_locks(&mut tasks, &run, &set, &acq);
    spawn_readers(
        &mut tasks,
        &run,
        conn,
        &set,
        share.reads_per_s,
        (&rd, &reads, &cache_hits),
    );
    tasks.push(spawn_writer(
        &run,
        conn,
        &set,
        share.writes_per_s,
        &wr,
        &writes_ok,
    ));
    tasks.push(spawn_churn(&run, conn, &set, lease, &churned));

    // KeepAlive round trips (etcd; ZooKeeper's client pings on its own and does not say).
    tasks.push(spawn_keepalive_sampler(
        set.slots.len(),
        {
            let slots = set.slots.clone();
            move |i| slots[i].lock().expect("slot").last_keepalive()
        },
        start,
        run.deadline,
        run.stop.clone(),
        ka.clone(),
    ));

    // How late this process runs a due task (as ours).
    let late = lat(start);
    tasks.push(spawn_lateness_probe(
        run.deadline,
        run.stop.clone(),
        late.clone(),
    ));

    // Sessions in jeopardy, defined as ours (no renewal answered for longer than the
    // lease; ZooKeeper: its client not connected).
    let jeopardy = Arc::new(Mutex::new(JeopardyStats::default()));
    tasks.push(spawn_jeopardy_sampler(
        set.slots.len(),
        {
            let slots = set.slots.clone();
            move |i| slots[i].lock().expect("slot").lease_valid(lease)
        },
        run.deadline,
        run.stop.clone(),
        jeopardy.clone(),
    ));

    Ok(Running {
        start,
        deadline: run.deadline,
        tasks,
        stop: run.stop,
        acq,
        ka,
        rd,
        wr,
        late,
        writes_ok,
        failures: run.failures,
        jeopardy,
        errors: run.errors,
        reads,
        cache_hits,
        churned,
        setup_errors: set.setup_errors,
        renewals0,
        renewed: 0,
        elapsed: 0.0,
        slots: set.slots,
        admin: set.admin,
        held: set.held,
        n: set.n,
        long_locks: set.long_locks,
        short_locks: set.short_locks,
        short_period: set.short_period,
        churn_per_s: set.churn_per_s,
        writes_per_s: share.writes_per_s,
        open_secs: set.open_secs,
    })
}

/// A share as set up, before the run: its sizes, the admin session, every session in its
/// slot and the long-held locks taken.
struct Setup {
    n: usize,
    long_locks: usize,
    short_locks: usize,
    short_period: Duration,
    churn_per_s: f64,
    lock_dir: String,
    config_dir: String,
    admin: Arc<Sess>,
    slots: Slots,
    held: Arc<Mutex<Vec<(usize, Held)>>>,
    setup_errors: Arc<AtomicU64>,
    open_secs: f64,
}

/// Every session of a share, each in its slot (churn replaces a slot's session).
type Slots = Arc<Vec<Mutex<Arc<Sess>>>>;

/// What every task of a run shares: the sessions, the run's clock and stop switch, and
/// its error counts.
struct RunCtx {
    slots: Slots,
    start: Instant,
    deadline: Instant,
    stop: Arc<AtomicBool>,
    errors: Arc<AtomicU64>,
    failures: Arc<Failures>,
}

/// Setup: the namespace (ZooKeeper needs parents), the config values, the sessions, then
/// the long-held locks.
async fn set_up(
    conn: &Conn,
    lease: Duration,
    share: &Share,
    dur: Duration,
) -> anyhow::Result<Setup> {
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
    let slots: Slots = Arc::new(sessions.into_iter().map(Mutex::new).collect());
    Ok(Setup {
        n,
        long_locks,
        short_locks,
        short_period,
        churn_per_s,
        lock_dir,
        config_dir,
        admin,
        slots,
        held,
        setup_errors,
        open_secs,
    })
}

/// Short locks, as ours: each taken once a period (at a random offset), held 1 s.
fn spawn_short_locks(
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
    run: &RunCtx,
    set: &Setup,
    acq: &Arc<Mutex<Lat>>,
) {
    let (start, deadline, short_period) = (run.start, run.deadline, set.short_period);
    for j in 0..set.short_locks {
        let i = set.long_locks + j;
        let (slots, acq, stop, errors) = (
            run.slots.clone(),
            acq.clone(),
            run.stop.clone(),
            run.errors.clone(),
        );
        let failures = run.failures.clone();
        let offset = short_period.mul_f64(rand::random::<f64>());
        let dir = format!("{}/l{i}", set.lock_dir);
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
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        failures.why("acquire", &e);
                        failures.acquire();
                    }
                }
                due += short_period;
            }
        }));
    }
}

/// Readers: one task per 50 sessions, each reading its value once a period; the group's
/// reads are spread over the period, each sent when due (whether or not the earlier ones
/// were answered) and timed from then ([`open_loop_reads`]). ZooKeeper with `--reads
/// cached` keeps each session's copy under a watch. `counts` are the read latencies, the
/// reads made and those served from a watched copy.
fn spawn_readers(
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
    run: &RunCtx,
    conn: &Conn,
    set: &Setup,
    reads_per_s: f64,
    counts: (&Arc<Mutex<Lat>>, &Arc<AtomicU64>, &Arc<AtomicU64>),
) {
    let (rd, reads, cache_hits) = counts;
    let zk_cache = matches!(conn, Conn::Zk(_)) && crate::profile::reads_mode() == Reads::Cached;
    if reads_per_s <= 0.0 {
        return;
    }
    let (start, deadline) = (run.start, run.deadline);
    let period = Duration::from_secs_f64(1.0 / reads_per_s);
    for first in (0..set.n).step_by(50) {
        let (slots, rd, stop, reads, errors) = (
            run.slots.clone(),
            (*rd).clone(),
            run.stop.clone(),
            (*reads).clone(),
            run.errors.clone(),
        );
        let (failures, cache_hits) = (run.failures.clone(), (*cache_hits).clone());
        let offset = period.mul_f64(rand::random::<f64>());
        let config_dir = set.config_dir.clone();
        let n = (first + 50).min(slots.len()) - first;
        tasks.push(tokio::spawn(async move {
            // ZooKeeper with `--reads cached`: each session's watched copy, taken out while
            // it is read and put back after (a read that finds it out, another of the same
            // session still waiting, reads again and brings its own).
            let copies: Arc<Vec<Mutex<Option<WatchedValue>>>> =
                Arc::new((0..n).map(|_| Mutex::new(None)).collect());
            let read = |j: usize| {
                let i = first + j;
                let s = slots[i].lock().expect("slot").clone();
                let key = format!("{config_dir}/k{}", i % CONFIG_KEYS);
                let (copies, cache_hits) = (copies.clone(), cache_hits.clone());
                let failures = failures.clone();
                async move {
                    let read = if zk_cache {
                        let mut copy = copies[j].lock().expect("copy").take();
                        let hit = copy.as_mut().and_then(|c| c.valid_for(&s).then_some(c.len));
                        match hit {
                            Some(len) => {
                                cache_hits.fetch_add(1, Ordering::Relaxed);
                                *copies[j].lock().expect("copy") = copy;
                                Ok(len)
                            }
                            None => s.read_watched(&key).await.map(|c| {
                                let len = c.len;
                                *copies[j].lock().expect("copy") = Some(c);
                                len
                            }),
                        }
                    } else {
                        s.read(&key).await
                    };
                    if let Err(e) = &read {
                        failures.why("read", e);
                    }
                    read.is_ok()
                }
            };
            let counts = ReadCounts {
                lat: &rd,
                reads: &reads,
                errors: &errors,
                failures: &failures,
            };
            open_loop_reads((start + offset, period, deadline), &stop, n, read, counts).await;
        }));
    }
}

/// The config writer: retries a failed write (its failures are the unavailability).
/// etcd: one member at a time, moving on after a failure, as every etcd client here
/// ([`crate::systems::etcd_conn`]).
fn spawn_writer(
    run: &RunCtx,
    conn: &Conn,
    set: &Setup,
    writes_per_s: f64,
    wr: &Arc<Mutex<Lat>>,
    writes_ok: &Arc<Mutex<Vec<Instant>>>,
) -> tokio::task::JoinHandle<()> {
    let pinned = match conn {
        Conn::Etcd(eps) => Some(Arc::new(EtcdConn::new(eps.clone()))),
        _ => None,
    };
    spawn_config_writer(
        {
            let (admin, config_dir) = (set.admin.clone(), set.config_dir.clone());
            let failures = run.failures.clone();
            move |key: String, value: Vec<u8>| {
                let (admin, pinned) = (admin.clone(), pinned.clone());
                let failures = failures.clone();
                // The writer names keys under /profile/config; this share's are its own.
                let key = key.replacen("/profile/config", &config_dir, 1);
                async move {
                    let r = match pinned {
                        Some(p) => p
                            .call("Put", |mut c| async move { c.put(key, value, None).await })
                            .await
                            .map(|_| ()),
                        None => admin.write(&key, value).await.map(|_| ()),
                    };
                    if let Err(e) = &r {
                        failures.why("write", e);
                    }
                    r.is_ok()
                }
            }
        },
        writes_per_s,
        run.deadline,
        run.stop.clone(),
        wr.clone(),
        writes_ok.clone(),
        run.failures.clone(),
    )
}

/// Churn: sessions that hold no lock are closed and replaced by new ones.
fn spawn_churn(
    run: &RunCtx,
    conn: &Conn,
    set: &Setup,
    lease: Duration,
    churned: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let (slots, conn, stop, churned, errors) = (
        run.slots.clone(),
        conn.clone(),
        run.stop.clone(),
        churned.clone(),
        run.errors.clone(),
    );
    let (start, deadline, churn_per_s) = (run.start, run.deadline, set.churn_per_s);
    let plain = set.long_locks + set.short_locks..set.n;
    tokio::spawn(async move {
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
    })
}

impl Running {
    /// The server's ids of the sessions loadgen should still hold: the run's (churned ones
    /// replaced) and the admin session.
    pub(super) fn ids(&self) -> Vec<u64> {
        self.slots
            .iter()
            .map(|s| s.lock().expect("slot").server_id())
            .chain([self.admin.server_id()])
            .collect()
    }

    /// Ends `k` sessions that hold no lock behind loadgen's back (the test hook
    /// [`crate::server_sessions::END_BEHIND_BACK`]).
    pub(super) async fn end_behind_back(&self, conn: &Conn, k: usize) -> anyhow::Result<()> {
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
    pub(super) async fn stop(&mut self) {
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
    pub(super) async fn measure(&self) -> Measured {
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
            reasons: self.failures.reasons(),
            writes_failed: self.failures.writes.load(Ordering::Relaxed),
            cost: None,
            open_retries: crate::systems::OPEN_RETRIES.load(Ordering::Relaxed),
            open_window_least: crate::systems::OPEN_WINDOW_LEAST.load(Ordering::Relaxed),
        }
    }
}
