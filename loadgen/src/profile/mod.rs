//! The `profile` scenario: the seed's steady state of one cell, through proxies.
//!
//! At full scale: 50 000 sessions (KeepAlive every lease/3 = 4 s, so 12 500 a second), held
//! on 25 QUIC connections (2 000 sessions each) spread over the proxies; 20 000 locks, of
//! which 15 000 are held for the whole run and 5 000 are taken once a period each (held
//! 1 s; the period is a third of the run, at most a minute, so the offered rate depends on
//! `--secs`: 125 acquires a second at the default 120 s, 250 at 60 s; the report states
//! the period); every session reads one config value a second through its consistent cache
//! (50 000 reads a second); a writer changes a config value 10 times a second; 10 sessions
//! a second are closed and replaced by new ones (churn).
//!
//! With `--fault kill` or `--fault freeze`, the leader is killed (`kill -9`) or frozen
//! (SIGSTOP) 40 % into the run: the report then gives how long config writes failed, and
//! the latency charts show acquires and KeepAlives around the event. Sessions lost must be
//! 0 either way.
//!
//! Ours in `ours.rs`, etcd's and ZooKeeper's in `peers.rs` (split over loadgen processes
//! when ZooKeeper needs more connections than one may hold); what they share here.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{bail, Context};
use client_sdk::{Client, Session};
use wire::types::Status;

mod ours;
pub mod peers;

pub use ours::profile;

use crate::report::bar;
use crate::report::{Lat, Report};
use crate::scenarios::Ctx;

/// A fault injected into the leader during the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// `kill -9` the leader.
    Kill,
    /// SIGSTOP the leader (resumed after the run).
    Freeze,
}

/// How `profile`'s config reads are made (`--reads`; issue 26: reads in both modes for
/// all three systems).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Reads {
    /// Each system's own client cache: ours, the consistent cache (the leader invalidates
    /// a copy before a write to it commits); ZooKeeper, `getData` with a watch, the copy
    /// served until the watch fires, as Curator's `NodeCache` (eventually consistent);
    /// etcd, none (its linearizable cache, clientv3's `leasing` KV, has no Rust client,
    /// so etcd's reads stay uncached).
    Cached,
    /// Every read reaches the servers: ours and etcd linearizable reads; ZooKeeper
    /// `getData` at the connected member (sequentially consistent; a linearizable read
    /// would need a `sync` first).
    Uncached,
}

/// The `--reads` of this process (false: uncached).
pub static READS_CACHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// This process's `--reads`.
pub fn reads_mode() -> Reads {
    if READS_CACHED.load(Ordering::Relaxed) {
        Reads::Cached
    } else {
        Reads::Uncached
    }
}

/// The report's name for the config reads' latency.
pub fn read_row(cached: bool) -> &'static str {
    if cached {
        "config read (cached)"
    } else {
        "config read (uncached)"
    }
}

/// Sessions per QUIC connection (each session keeps one stream open for its events; a
/// connection carries at most `wire::quic::STREAMS_MAX`).
pub(crate) const SESSIONS_PER_CONNECTION: usize = 2_000;
/// Config values every session reads from.
pub(crate) const CONFIG_KEYS: usize = 100;

pub(crate) fn lat(start: Instant) -> Arc<Mutex<Lat>> {
    Arc::new(Mutex::new(Lat::new(start)))
}

/// The start of a `profile` run left out of its steady-state acquire figure.
const WARM_UP: Duration = Duration::from_secs(10);

pub(crate) fn record(l: &Mutex<Lat>, d: Duration, at: Instant) {
    l.lock().expect("lat").record(d, at);
}

/// Where a group's config reads are counted ([`open_loop_reads`]).
pub(crate) struct ReadCounts<'a> {
    /// The latencies of the successes (the group's are merged in at its end).
    pub lat: &'a Mutex<Lat>,
    /// Reads that succeeded.
    pub reads: &'a AtomicU64,
    /// The run's operation errors (a failed read is one).
    pub errors: &'a AtomicU64,
    /// The run's failures by operation (a failed or unsent read is one of `reads`).
    pub failures: &'a Failures,
}

/// The config reads of one group of `n` sessions, each session once every `period` from
/// `first`, until `deadline` or until `stop` is set (`read(j)` reads for the group's
/// `j`-th session and says whether it succeeded). Open loop, without coordinated
/// omission: the `j`-th session's reads are due at `first + j × period / n` and every
/// `period` after, so the group's reads are spread evenly over the period as independent
/// clients' would be; each is sent when it is due, whether or not earlier ones have been
/// answered, and timed from when it was due, not from when it was sent. A read that goes
/// out late because loadgen's runtime was busy carries that wait too (reads due before
/// the deadline are sent even when loadgen gets to them after it); reads due before a
/// `stop` that came ahead of the deadline and never sent count as failed reads (as far as
/// a client could tell), and a failed read also as an operation error.
pub(crate) async fn open_loop_reads<F, Fut>(
    (first, period, deadline): (Instant, Duration, Instant),
    stop: &AtomicBool,
    n: usize,
    mut read: F,
    counts: ReadCounts<'_>,
) where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    use futures::stream::{FuturesUnordered, StreamExt};
    if n == 0 {
        return;
    }
    let step = period.div_f64(n as f64);
    let due_of = |k: u64| first + step.mul_f64(k as f64);
    // Its series counts from the run's start, as the shared one's does.
    let mut lat = Lat::new(counts.lat.lock().expect("lat").start());
    let mut record = |(ok, due, at): (bool, Instant, Instant)| {
        if ok {
            lat.record(at - due, at);
            counts.reads.fetch_add(1, Ordering::Relaxed);
        } else {
            counts.errors.fetch_add(1, Ordering::Relaxed);
            counts.failures.reads.fetch_add(1, Ordering::Relaxed);
        }
    };
    let mut in_flight = FuturesUnordered::new();
    let mut k: u64 = 0;
    loop {
        let due = due_of(k);
        if due >= deadline {
            break;
        }
        // Stopped before the end (a fault, an error): the reads due by now were never
        // sent. Stopped at the end, as every run is, the reads due before it still go
        // out (timed from when they were due): a reader polled a few ms after the run's
        // stop, on a busy host, would otherwise count a read nobody tried as failed.
        let now = Instant::now();
        if stop.load(Ordering::Relaxed) && now < deadline {
            if due <= now {
                let late = ((now - due).as_secs_f64() / step.as_secs_f64()).floor() as u64 + 1;
                counts.failures.reads.fetch_add(late, Ordering::Relaxed);
                counts.errors.fetch_add(late, Ordering::Relaxed);
                counts
                    .failures
                    .why("read", &"due before the run was stopped, never sent");
            }
            break;
        }
        tokio::select! {
            biased;
            Some(done) = in_flight.next(), if !in_flight.is_empty() => record(done),
            _ = tokio::time::sleep_until(due) => {
                let r = read((k % n as u64) as usize);
                in_flight.push(async move {
                    let ok = r.await;
                    (ok, due, Instant::now())
                });
                k += 1;
            }
        }
    }
    while let Some(done) = in_flight.next().await {
        record(done);
    }
    counts.lat.lock().expect("lat").merge(&lat);
}

/// A profile run's failed operations, by operation, reported next to their latencies.
#[derive(Default)]
pub(crate) struct Failures {
    /// When each short-lock acquire failed (so the windows around a fault get theirs).
    pub acquires: Mutex<Vec<Instant>>,
    /// Config reads that failed.
    pub reads: AtomicU64,
    /// Config write attempts that failed (each retried after 20 ms).
    pub writes: AtomicU64,
    /// Short-lock acquires started, and those that ended (granted or failed).
    pub acquires_started: AtomicU64,
    pub acquires_ended: AtomicU64,
    /// Why operations failed: (operation, [`crate::report::reason_of`] the error) and how
    /// many times.
    reasons: Mutex<BTreeMap<(String, String), u64>>,
}

impl Failures {
    /// An `op` ("read", "acquire", "write") failed with `e`.
    pub fn why(&self, op: &str, e: &dyn std::fmt::Display) {
        let key = (op.to_string(), crate::report::reason_of(e));
        *self
            .reasons
            .lock()
            .expect("reasons")
            .entry(key)
            .or_default() += 1;
    }

    /// The reasons, as (operation, reason, count).
    pub fn reasons(&self) -> Vec<(String, String, u64)> {
        let r = self.reasons.lock().expect("reasons");
        r.iter()
            .map(|((op, why), n)| (op.clone(), why.clone(), *n))
            .collect()
    }

    /// An acquire failed now.
    pub fn acquire(&self) {
        self.acquires.lock().expect("failures").push(Instant::now());
    }

    /// Runs `acquire`, noting that it started and, unless it is abandoned (its task given
    /// up at the end of the run), that it ended.
    pub async fn acquiring<T>(&self, acquire: impl std::future::Future<Output = T>) -> T {
        self.acquires_started.fetch_add(1, Ordering::Relaxed);
        let r = acquire.await;
        self.acquires_ended.fetch_add(1, Ordering::Relaxed);
        r
    }

    /// Once the run's tasks are joined: every acquire that started and never ended (its
    /// task was given up) counts as failed, now.
    pub fn count_unfinished(&self) {
        let started = self.acquires_started.load(Ordering::Relaxed);
        let ended = self.acquires_ended.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut a = self.acquires.lock().expect("failures");
        for _ in ended..started {
            a.push(now);
        }
    }
}

/// Notes saying why operations failed: for each operation, its five most frequent reasons
/// (`reasons` as (operation, reason, count); like ones are summed).
pub(crate) fn note_reasons(
    r: &mut Report,
    reasons: impl IntoIterator<Item = (String, String, u64)>,
) {
    let mut by: BTreeMap<(String, String), u64> = BTreeMap::new();
    for (op, why, n) in reasons {
        *by.entry((op, why)).or_default() += n;
    }
    let mut ops: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
    for ((op, why), n) in by {
        ops.entry(op).or_default().push((n, why));
    }
    for (op, mut whys) in ops {
        whys.sort_by(|a, b| b.cmp(a));
        let total = whys.len();
        for (n, why) in whys.into_iter().take(5) {
            r.notes
                .push(format!("{n} failed {op}s: {why} (numbers left out)"));
        }
        if total > 5 {
            r.notes
                .push(format!("failed {op}s: {} other reasons", total - 5));
        }
    }
}

/// How many of `failures` happened at or after `from` and before `to`.
pub(crate) fn failed_between(failures: &[Instant], from: Instant, to: Instant) -> u64 {
    failures.iter().filter(|t| **t >= from && **t < to).count() as u64
}

pub(crate) async fn leader_status(direct: &Client) -> anyhow::Result<Status> {
    for _ in 0..50 {
        for a in direct.endpoints() {
            if let Ok(s) = direct.status_of(a).await {
                if s.role == "Leader" {
                    return Ok(s);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("no leader answered")
}

pub(crate) async fn open_all(clients: &[Client], n: usize) -> anyhow::Result<Vec<Session>> {
    crate::scenarios::open_batched(n, 500, |i| async move {
        Ok(clients[i / SESSIONS_PER_CONNECTION].open_session().await?)
    })
    .await
}

/// Enough QUIC connections to `endpoints` for `sessions` sessions; each lists the
/// endpoints starting at a different one, so they spread over proxies.
pub(crate) async fn connections(
    ctx: &Ctx,
    endpoints: &[String],
    sessions: usize,
) -> anyhow::Result<Vec<Client>> {
    let conns = sessions.div_ceil(SESSIONS_PER_CONNECTION).max(1);
    let mut clients = Vec::with_capacity(conns);
    for i in 0..conns {
        let mut eps = endpoints.to_vec();
        eps.rotate_left(i % endpoints.len());
        let cfg = crate::systems::ours_config(eps, ctx.cluster.ca.clone());
        clients.push(Client::connect(cfg).await?);
    }
    Ok(clients)
}

/// Runs `f` over `0..n` with at most `par` in flight.
pub(crate) async fn each<F, Fut>(n: usize, par: usize, what: &str, f: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    use futures::StreamExt;
    let pb = bar(n as u64, what);
    let mut s = futures::stream::iter((0..n).map(f)).buffer_unordered(par);
    while let Some(r) = s.next().await {
        r?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(())
}

pub(crate) fn create_ok(r: Result<client_sdk::Created, client_sdk::Error>) -> anyhow::Result<()> {
    match r {
        Ok(_) | Err(client_sdk::Error::NodeExists { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The config writer of both profiles: writes a value every `1/per_s` s until `deadline`
/// (or `stop`), retrying a failed write every 20 ms (its failures are the
/// unavailability); every success goes into `wr` and `ok`, every failed attempt is
/// counted in `failures.writes`. `write(key, value)` says whether the write succeeded.
pub(crate) fn spawn_config_writer<F, Fut>(
    write: F,
    per_s: f64,
    deadline: Instant,
    stop: Arc<AtomicBool>,
    wr: Arc<Mutex<Lat>>,
    ok: Arc<Mutex<Vec<Instant>>>,
    failures: Arc<Failures>,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(String, Vec<u8>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    tokio::spawn(async move {
        let every = Duration::from_secs_f64(1.0 / per_s);
        let mut v = 0u64;
        while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let key = format!("/profile/config/k{}", v as usize % CONFIG_KEYS);
            let done = tokio::time::timeout(
                Duration::from_secs(20),
                write(key, format!("{v:0100}").into_bytes()),
            )
            .await
            .unwrap_or(false);
            let t1 = Instant::now();
            if done {
                record(&wr, t1 - t0, t1);
                ok.lock().expect("ok").push(t1);
                v += 1;
                tokio::time::sleep_until(t0 + every).await;
            } else {
                failures.writes.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
}

/// Measures the disk the cell writes to while a run lasts: every 10 ms, 4 KiB written to a
/// file in `dir` and `fdatasync`ed, the time of both recorded into `lat`. The replicas'
/// logs fsync on the same filesystem, so a slow disk shows here as it slows commits.
pub(crate) fn spawn_fsync_probe(
    dir: std::path::PathBuf,
    deadline: Instant,
    stop: Arc<AtomicBool>,
    lat: Arc<Mutex<Lat>>,
) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        use std::io::{Seek, SeekFrom, Write};
        let path = dir.join("fsync-probe");
        let Ok(mut f) = std::fs::File::create(&path) else {
            eprintln!("loadgen: no fsync probe: cannot create {}", path.display());
            return;
        };
        let block = [0x5au8; 4096];
        let mut n = 0u64;
        while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let ok = f.seek(SeekFrom::Start((n % 256) * 4096)).is_ok()
                && f.write_all(&block).is_ok()
                && f.sync_data().is_ok();
            if !ok {
                eprintln!("loadgen: fsync probe failed; stopping it");
                return;
            }
            let t1 = Instant::now();
            record(&lat, t1 - t0, t1);
            n += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_file(&path);
    })
}

/// The name of [`spawn_lateness_probe`]'s latency in a report.
pub(crate) const LATENESS: &str = "loadgen's own lateness (a 10 ms timer, how late it ran)";

/// Measures how long loadgen's own runtime takes to run a task that is due: a task sleeps
/// until a deadline every 10 ms and records how late it woke. Its threads share the
/// machine's cores with the servers and with every simulated client's tasks, so this is
/// the wait a client-side latency (an acquire, a write) carries before loadgen even sees
/// its answer; a client on a machine of its own would not have it.
pub(crate) fn spawn_lateness_probe(
    deadline: Instant,
    stop: Arc<AtomicBool>,
    lat: Arc<Mutex<Lat>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let tick = Duration::from_millis(10);
        let mut due = Instant::now() + tick;
        while due < deadline && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep_until(due).await;
            let now = Instant::now();
            record(&lat, now.saturating_duration_since(due), now);
            // The next tick from now: a late wake-up is one sample, not a run of them.
            due = now + tick;
        }
    })
}

/// Samples every session's last KeepAlive once a second into `ka` (a session renews every
/// 4 s, so each renewal is seen once). `last(i)` is session `i`'s last renewal and round
/// trip.
pub(crate) fn spawn_keepalive_sampler<F>(
    sessions: usize,
    last: F,
    start: Instant,
    deadline: Instant,
    stop: Arc<AtomicBool>,
    ka: Arc<Mutex<Lat>>,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(usize) -> Option<(Instant, Duration)> + Send + 'static,
{
    tokio::spawn(async move {
        let mut seen: Vec<Option<Instant>> = vec![None; sessions];
        while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            for (i, seen) in seen.iter_mut().enumerate() {
                if let Some((at, rtt)) = last(i) {
                    if at > start && *seen != Some(at) {
                        *seen = Some(at);
                        record(&ka, rtt, at);
                    }
                }
                yield_now_and_then(i).await;
            }
        }
    })
}

/// Lets the runtime's other tasks run after every 1 024th of a sampler's sessions: a pass
/// over 50 000 sessions takes several milliseconds, which would otherwise hold a worker
/// thread (and the replies and requests queued behind it) that long, many times a second.
async fn yield_now_and_then(n: usize) {
    if n % 1024 == 1023 {
        tokio::task::yield_now().await;
    }
}

/// What [`spawn_jeopardy_sampler`] saw.
#[derive(Default)]
pub(crate) struct JeopardyStats {
    /// Sessions seen at least once with their local lease run out.
    pub ever: usize,
    /// The most seen so at one sample.
    pub most: usize,
}

/// Every 200 ms, asks each session whether its local lease is valid (`valid(i)`); a
/// session without one is in jeopardy (or over): a lock holder must not act then. A fail-over
/// that delays KeepAlives past the local lease shows here before it loses a session.
pub(crate) fn spawn_jeopardy_sampler<F>(
    sessions: usize,
    valid: F,
    deadline: Instant,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<JeopardyStats>>,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(usize) -> bool + Send + 'static,
{
    tokio::spawn(async move {
        let mut seen = vec![false; sessions];
        while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (mut now, mut new) = (0, 0);
            for (i, seen) in seen.iter_mut().enumerate() {
                if !valid(i) {
                    now += 1;
                    new += usize::from(!*seen);
                    *seen = true;
                }
                yield_now_and_then(i).await;
            }
            let mut s = stats.lock().expect("jeopardy");
            s.most = s.most.max(now);
            s.ever += new;
        }
    })
}

/// How long before and after a fault its acquire latencies are reported on their own.
pub(crate) const AROUND_FAULT: Duration = Duration::from_secs(10);

/// The fault a profile run injected into the leader.
pub(crate) struct Injected {
    fault: Fault,
    leader: String,
    at: Instant,
}

/// Waits out a profile run (with a progress bar) until `deadline`, killing or freezing the
/// leader 40 % in if `fault` says so.
pub(crate) async fn run_with_fault(
    ctx: &Ctx,
    start: Instant,
    deadline: Instant,
    fault: Option<Fault>,
) -> anyhow::Result<Option<Injected>> {
    let dur = deadline - start;
    let pb = bar(dur.as_secs().max(1), "profile");
    let fault_at = start + dur.mul_f64(0.4);
    let mut injected = None;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1).min(deadline - Instant::now())).await;
        pb.set_position(start.elapsed().as_secs());
        if let Some(f) = fault {
            if injected.is_none() && Instant::now() >= fault_at {
                let leader = ctx.cluster.leader().await?;
                let pid = ctx.cluster.pid_of(&leader).context("leader pid")?;
                let at = Instant::now();
                let sig = match f {
                    Fault::Kill => libc::SIGKILL,
                    Fault::Freeze => libc::SIGSTOP,
                };
                unsafe { libc::kill(pid as i32, sig) };
                injected = Some(Injected {
                    fault: f,
                    leader,
                    at,
                });
            }
        }
    }
    pb.finish_and_clear();
    Ok(injected)
}

impl Injected {
    /// When the fault was injected.
    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    /// Lets a frozen leader go on (SIGCONT) after the run.
    pub(crate) fn resume(&self, ctx: &Ctx) {
        if self.fault == Fault::Freeze {
            if let Some(pid) = ctx.cluster.pid_of(&self.leader) {
                unsafe { libc::kill(pid as i32, libc::SIGCONT) };
            }
        }
    }

    /// The report's name for a run with `fault`.
    pub(crate) fn scenario(fault: Option<Fault>) -> &'static str {
        match fault {
            None => "profile",
            Some(Fault::Kill) => "profile-kill",
            Some(Fault::Freeze) => "profile-freeze",
        }
    }

    /// Adds the fault, how long config writes were unavailable after it, and the short
    /// locks' acquire latency in the [`AROUND_FAULT`] before it and after it (by when each
    /// acquire ended) from `acq`, with the acquires that failed in each (`acq.1`, when
    /// each failed).
    pub(crate) fn report(
        &self,
        r: &mut Report,
        writes_ok: &[Instant],
        acq: (&Lat, &[Instant]),
        start: Instant,
        deadline: Instant,
    ) {
        let (acq, acq_failed) = acq;
        let at = self.at.saturating_duration_since(acq.start());
        r.latency_failed(
            &format!(
                "acquire in the {} s before the fault",
                AROUND_FAULT.as_secs()
            ),
            &acq.between(at.saturating_sub(AROUND_FAULT), at),
            failed_between(
                acq_failed,
                self.at.checked_sub(AROUND_FAULT).unwrap_or(start),
                self.at,
            ),
        );
        r.latency_failed(
            &format!(
                "acquire in the {} s after the fault",
                AROUND_FAULT.as_secs()
            ),
            &acq.between(at, at + AROUND_FAULT),
            failed_between(acq_failed, self.at, self.at + AROUND_FAULT),
        );
        let gap = crate::scenarios::unavailable(
            writes_ok,
            self.at,
            deadline.saturating_duration_since(self.at),
        );
        r.param(
            "fault",
            format!(
                "leader {} {} at {:.0} s",
                self.leader,
                match self.fault {
                    Fault::Kill => "kill -9",
                    Fault::Freeze => "SIGSTOP",
                },
                self.at.duration_since(start).as_secs_f64()
            ),
        );
        r.figure("config writes unavailable (s)", gap.as_secs_f64());
    }
}

/// Waits up to 30 s for a run's tasks after it stopped them; one still blocked (an
/// acquire that never returned) is aborted and counted in `errors`.
pub(crate) async fn join_tasks(tasks: Vec<tokio::task::JoinHandle<()>>, errors: &AtomicU64) {
    let give_up = Instant::now() + Duration::from_secs(30);
    for t in tasks {
        let abort = t.abort_handle();
        if tokio::time::timeout_at(give_up, t).await.is_err() {
            abort.abort();
            errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}
