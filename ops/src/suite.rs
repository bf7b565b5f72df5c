//! The fault suite on real processes in network namespaces (`faultsuite`).
//!
//! Five replica processes run on real fjall and QUIC, each in its own network namespace
//! (hosts 1–5 of [`crate::netns::Hosts`]); the clients and the nemesis run in host 6. For
//! the time given, a seeded nemesis injects one fault at a time, in rounds that each hold
//! every kind of the plan in a seeded order (kill -9 and restart,
//! SIGSTOP, leader isolation, majority/minority splits, one-way cuts, packet loss, a slow
//! link, replacing a member) while, with the option, two replicas run under libfaketime
//! with their clocks running fast and slow. Meanwhile the workloads record histories:
//!
//! - *fenced lock*: workers take one lock and write to a protected resource with their
//!   token; one of them now and then stops renewing while it holds the lock, sleeps past
//!   its lease and writes anyway. Checked by [`crate::checkers::check_fenced_lock`].
//! - *register*: linearizable reads, cached reads, writes and compare-and-sets on a few
//!   keys (fresh keys every epoch, so each key's history stays short enough to search),
//!   two cache readers that only read through their session caches, and two readers that
//!   only make linearizable reads (and so start at a follower). Checked by
//!   [`crate::checkers::check_register`].
//! - *sessions*: sessions that keep renewing hold an ephemeral each and must never expire;
//!   sessions that stop renewing must take their ephemerals with them, on every replica.
//! - *session ends*: sessions create an ephemeral key each and end, by close or by
//!   ceasing to renew, while readers read those keys through their caches and
//!   linearizably; the removals go into the register history, so a cached read that
//!   finds a key after its removal completed is a stale read.
//! - *watches*: one watcher per register key re-reads after every event; once the key's
//!   writers moved on, its last read must be the key's final value (no missed change).
//!
//! After the time is up every fault is healed, and the cell must converge: every replica
//! answers, no session is left, all replicas hold the same number of nodes, and no
//! ephemeral of the run survives. Histories, the nemesis' log, replica logs and a
//! `verdict.json` are written to the output directory.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, ClientConfig, CreateMode, Lock, Session, SessionState};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use replica::config::{Member, ReplicaConfig, SessionConfig, TlsConfig};
use serde::{Deserialize, Serialize};
use wire::types::{Op as WireOp, Reply};

use crate::checkers::{
    check_fenced_lock, check_register, write_history, FencedResource, Kind, Op, Recorder,
};
use crate::netns::Hosts;

/// Replica hosts are 1..=REPLICAS; the clients and the nemesis run in host CLIENT_HOST.
pub const REPLICAS: usize = 5;
/// The host of the clients and the nemesis.
pub const CLIENT_HOST: usize = 6;
const PORT: u16 = 7100;
/// Register keys get fresh names every epoch.
const EPOCH: Duration = Duration::from_secs(10);
const KEYS_PER_EPOCH: usize = 2;
/// The register checker's bound on one key's operations.
pub const MAX_OPS_PER_KEY: usize = 1_500;

/// One kind of fault the nemesis injects.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// `kill -9` the leader, restart it after the hold.
    KillLeader,
    /// `kill -9` a follower, restart it after the hold.
    KillFollower,
    /// SIGSTOP the leader, SIGCONT after the hold.
    PauseLeader,
    /// Cut the leader off from every other host (clients included).
    IsolateLeader,
    /// Split the replicas 2 / 3 with the leader in the minority; clients reach both sides.
    Split,
    /// Cut one direction only between the leader and the other replicas.
    OneWay,
    /// Drop 30 % of the packets arriving at a random replica.
    Loss,
    /// Drop every packet arriving for the two cache readers (their invalidations and
    /// KeepAlive replies stop while the register workers write on): what they serve from
    /// their caches must still never be stale.
    ClientCut,
    /// Shape the leader's outgoing traffic to 256 kbit/s (tbf) for a lease and a half.
    Slow,
    /// Replace a follower: remove it, wipe it, add it back under a new id as a learner,
    /// promote it.
    Member,
    /// Crash the proxy, restart it after a short hold (a quarter of a lease at most): its
    /// clients' sessions, locks and cache coherence must survive it. Simulation tier only
    /// (the namespace tier runs no proxy).
    KillProxy,
}

impl Fault {
    /// Every fault of the namespace tier.
    pub const ALL: [Fault; 10] = [
        Fault::KillLeader,
        Fault::KillFollower,
        Fault::PauseLeader,
        Fault::IsolateLeader,
        Fault::Split,
        Fault::OneWay,
        Fault::Loss,
        Fault::ClientCut,
        Fault::Slow,
        Fault::Member,
    ];
}

/// What a run does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// How long the workloads run under faults.
    pub time: Duration,
    /// Seeds the nemesis' schedule and the workloads' choices.
    pub seed: u64,
    /// Session lease of the cell, ms.
    pub lease_ms: u64,
    /// Clock rate skew for hosts 4 and 5 (e.g. 0.02: one runs 2 % fast, one 2 % slow);
    /// 0 for none. Needs libfaketime (Debian package `faketime`).
    pub skew: f64,
    /// The faults to draw from.
    pub faults: Vec<Fault>,
}

/// One fault as injected.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Injected {
    /// Milliseconds since the workloads started.
    pub at_ms: u64,
    /// Which fault.
    pub fault: Fault,
    /// What it hit (hosts, replica ids).
    pub target: String,
    /// How long it was held, ms.
    pub held_ms: u64,
    /// An error while injecting or healing it (the run goes on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The outcome of a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Verdict {
    /// The seed.
    pub seed: u64,
    /// Seconds the workloads ran.
    pub secs: u64,
    /// Every fault injected.
    pub faults: Vec<Injected>,
    /// Lock grants checked.
    pub grants: usize,
    /// Fenced writes the resource accepted.
    pub fenced_accepted: usize,
    /// Fenced writes refused as stale.
    pub fenced_refused: usize,
    /// Register operations checked for linearizability.
    pub register_ops: usize,
    /// Sessions that kept renewing for the whole run.
    pub sessions_kept: usize,
    /// Sessions left to expire.
    pub sessions_abandoned: usize,
    /// Watchers whose last read was checked against the final value.
    pub watches_checked: usize,
    /// Violations found; empty when the run passed.
    pub violations: Vec<String>,
}

impl Verdict {
    /// Whether no checker found anything.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Where Debian's libfaketime (package `faketime`) keeps its thread-safe library.
pub fn faketime_library() -> Option<&'static str> {
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
}

fn replica_addr(host: usize) -> String {
    format!("{}.{host}:{PORT}", crate::netns::SUBNET)
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// A replica process slot: the host it lives on and the replica id it runs now.
struct Slot {
    host: usize,
    id: u64,
    child: Option<Child>,
    paused: bool,
}

/// The cell under test, as the nemesis sees it.
struct Cell {
    hosts: Hosts,
    out: PathBuf,
    exe: PathBuf,
    plan: Plan,
    slots: Vec<Slot>,
    next_id: u64,
}

impl Cell {
    fn config_path(&self, id: u64) -> PathBuf {
        self.out.join(format!("replica-{id}.toml"))
    }

    fn write_config(&self, host: usize, id: u64, bootstrap: bool) -> anyhow::Result<()> {
        let tls = self.out.join("tls");
        let members = (1..=REPLICAS as u64)
            .map(|i| Member {
                id: i,
                addr: replica_addr(i as usize),
            })
            .collect();
        let cfg = ReplicaConfig {
            id,
            listen: replica_addr(host).parse()?,
            advertise: None,
            data_dir: self.out.join(format!("data-{id}")),
            bootstrap,
            members,
            tls: TlsConfig::in_dir(&tls),
            raft: Default::default(),
            session: SessionConfig {
                lease_ms: self.plan.lease_ms,
                ..SessionConfig::default()
            },
            request_timeout_ms: 5_000,
            limits: Default::default(),
            faults: Default::default(),
        };
        cfg.validate()?;
        std::fs::write(self.config_path(id), toml::to_string(&cfg)?)?;
        Ok(())
    }

    /// Starts slot `i`'s replica (under faketime on hosts 4 and 5 when skewed).
    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let (host, id) = (self.slots[i].host, self.slots[i].id);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.out.join(format!("replica-{id}.log")))?;
        let rate = match host {
            4 if self.plan.skew > 0.0 => Some(1.0 + self.plan.skew),
            5 if self.plan.skew > 0.0 => Some(1.0 - self.plan.skew),
            _ => None,
        };
        let mut cmd = self.hosts.command(host, &self.exe);
        if let (Some(r), Some(lib)) = (rate, faketime_library()) {
            // libfaketime preloaded into the replica itself (not the `faketime` wrapper,
            // which forks: signals to the wrapper would miss the replica).
            cmd.env("LD_PRELOAD", lib)
                .env("FAKETIME", format!("+0 x{r:.3}"))
                .env("FAKETIME_DONT_RESET", "1");
        }
        cmd.arg("replica")
            .arg("--config")
            .arg(self.config_path(id))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or("warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.slots[i].child = Some(cmd.spawn()?);
        self.slots[i].paused = false;
        Ok(())
    }

    fn signal(&self, i: usize, sig: i32) {
        if let Some(c) = &self.slots[i].child {
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.slots[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.slots[i].paused = false;
    }

    fn pause(&mut self, i: usize) {
        self.signal(i, libc::SIGSTOP);
        self.slots[i].paused = true;
    }

    fn resume(&mut self, i: usize) {
        self.signal(i, libc::SIGCONT);
        self.slots[i].paused = false;
    }

    fn addr(&self, i: usize) -> SocketAddr {
        replica_addr(self.slots[i].host).parse().expect("valid")
    }

    /// The slot of the replica that says it leads (highest term), if any answers so.
    async fn leader(&self, client: &Client) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for i in 0..self.slots.len() {
            if self.slots[i].child.is_none() || self.slots[i].paused {
                continue;
            }
            let st =
                tokio::time::timeout(Duration::from_millis(700), client.status_of(self.addr(i)))
                    .await;
            if let Ok(Ok(st)) = st {
                if st.role == "Leader" && best.is_none_or(|(t, _)| st.term > t) {
                    best = Some((st.term, i));
                }
            }
        }
        best.map(|(_, i)| i)
    }

    /// Waits up to `within` for a leader.
    async fn wait_leader(&self, client: &Client, within: Duration) -> Option<usize> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Some(l) = self.leader(client).await {
                return Some(l);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    }

    /// Undoes everything: heals the network, resumes paused and restarts dead replicas.
    fn heal_all(&mut self) -> Vec<String> {
        let mut errors = Vec::new();
        if let Err(e) = self.hosts.heal() {
            errors.push(e);
        }
        for i in 0..self.slots.len() {
            if self.slots[i].paused {
                self.resume(i);
            }
            if self.slots[i].child.is_none() {
                if let Err(e) = self.spawn(i) {
                    errors.push(format!("restart of replica {}: {e}", self.slots[i].id));
                }
            }
        }
        errors
    }

    fn stop_all(&mut self) {
        for i in 0..self.slots.len() {
            if self.slots[i].paused {
                self.resume(i);
            }
            self.signal(i, libc::SIGTERM);
        }
        let end = Instant::now() + Duration::from_secs(10);
        for s in &mut self.slots {
            if let Some(mut c) = s.child.take() {
                loop {
                    match c.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < end => {
                            std::thread::sleep(Duration::from_millis(50))
                        }
                        _ => {
                            let _ = c.kill();
                            let _ = c.wait();
                            break;
                        }
                    }
                }
            }
        }
    }
}

/// The run's shared state for the workloads.
struct Run {
    rec: Recorder,
    deadline: Instant,
    lease: Duration,
    violations: Mutex<Vec<String>>,
    resource: FencedResource,
    /// The local ports of the cache readers, which `client-cut` hits.
    lossy_ports: Vec<u16>,
    abandoned: Mutex<usize>,
    watches_checked: Mutex<usize>,
    /// The ephemeral keys of [`ending_owner`]s, newest last (read by [`ending_reader`]s).
    ending_keys: Mutex<Vec<String>>,
}

impl Run {
    fn violation(&self, v: String) {
        eprintln!("faultsuite: VIOLATION {v}");
        self.violations.lock().expect("lock").push(v);
    }

    fn epoch_of(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.rec.start()).as_millis() / EPOCH.as_millis()) as u64
    }
}

fn key(epoch: u64, k: usize) -> String {
    format!("/suite/reg/e{epoch}k{k}")
}

fn text(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

async fn open_session(client: &Client, run: &Run) -> Option<Session> {
    while Instant::now() < run.deadline {
        match client.open_session().await {
            Ok(s) => return Some(s),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    None
}

/// Replaces `session` with a new one if it expired; false if none could be opened before
/// the deadline (the worker stops).
async fn renew_if_expired(client: &Client, run: &Run, session: &mut Session) -> bool {
    if session.state() != SessionState::Expired {
        return true;
    }
    match open_session(client, run).await {
        Some(s) => {
            *session = s;
            true
        }
        None => false,
    }
}

/// A fenced-lock worker; worker 0 sometimes stops renewing while it holds the lock.
async fn fenced_worker(client: Client, run: Arc<Run>, w: usize, seed: u64) {
    let who = format!("lock-{w}");
    let mut rng = StdRng::seed_from_u64(seed);
    let lock_path = "/suite/lock";
    let acq = |token| Op::Acquire {
        lock: lock_path.into(),
        token,
    };
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    let mut grants = 0u64;
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        run.rec.log(&who, Kind::Invoke, acq(None));
        let guard = match Lock::exclusive(&session, lock_path)
            .acquire_timeout(Duration::from_secs(5))
            .await
        {
            Ok(Some(g)) => g,
            Ok(None) => {
                run.rec.log(&who, Kind::Fail, acq(None));
                continue;
            }
            Err(_) => {
                run.rec.log(&who, Kind::Info, acq(None));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = guard.token();
        run.rec.log(&who, Kind::Ok, acq(Some(token)));
        grants += 1;
        if w == 0 && grants.is_multiple_of(4) && Instant::now() + run.lease * 3 < run.deadline {
            // Paused while holding: no KeepAlives; the lease runs out, another worker
            // takes the lock, and this one writes with its old token anyway.
            session.stop_keepalives();
            *run.abandoned.lock().expect("lock") += 1;
            tokio::time::sleep(run.lease * 2 + Duration::from_secs(1)).await;
            run.resource.write(&run.rec, &who, token);
            drop(guard);
            session = match open_session(&client, &run).await {
                Some(s) => s,
                None => return,
            };
            continue;
        }
        let act = Op::Act {
            lock: lock_path.into(),
            token,
        };
        if w == 1 && grants.is_multiple_of(3) && Instant::now() + run.lease * 3 < run.deadline {
            // Deaf while holding: no KeepAlives, and it keeps acting (without the fenced
            // resource) for as long as its lease says it may. The cell expires the session
            // and grants the lock to another worker; the checker's rule 3 sees whether
            // this one still acted after that grant completed (it must not: its local
            // lease ends first, by the clock-drift allowance, unless the cell's clock
            // runs faster than that allows).
            session.stop_keepalives();
            *run.abandoned.lock().expect("lock") += 1;
            let bound = Instant::now() + run.lease * 2;
            while Instant::now() < bound {
                let at = run.rec.stamp();
                if !guard.may_act() {
                    break;
                }
                run.rec.log_at(at, &who, Kind::Ok, act.clone());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(guard);
            session = match open_session(&client, &run).await {
                Some(s) => s,
                None => return,
            };
            continue;
        }
        for _ in 0..rng.gen_range(1..=3) {
            let at = run.rec.stamp();
            if !guard.may_act() {
                break;
            }
            run.rec.log_at(at, &who, Kind::Ok, act.clone());
            if !run.resource.write(&run.rec, &who, token) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.gen_range(1..20))).await;
        }
        let _ = guard.release().await;
        run.rec.log(
            &who,
            Kind::Ok,
            Op::Release {
                lock: lock_path.into(),
                token,
            },
        );
    }
    let _ = session.close().await;
}

/// A register worker: reads (linearizable and cached), writes and compare-and-sets.
async fn register_worker(client: Client, run: Arc<Run>, w: usize, seed: u64) {
    let who = format!("reg-{w}");
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    let mut n = 0u64;
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        let k = current_key(&run, &mut rng);
        n += 1;
        let value = format!("{w}-{n}");
        match rng.gen_range(0..100) {
            0..30 => linearizable_read(&client, &run, &who, &k).await,
            30..50 => cached_read(&session, &run, &who, &k).await,
            50..75 => {
                let op = Op::Write {
                    key: k.clone(),
                    value: value.clone(),
                };
                run.rec.log(&who, Kind::Invoke, op.clone());
                let r = session.set_data(&k, value.into_bytes(), None).await;
                run.rec
                    .log(&who, if r.is_ok() { Kind::Ok } else { Kind::Info }, op);
            }
            _ => {
                // Compare-and-set by version: every value is unique, so a version names
                // one value and the CAS is one on values.
                run.rec.log(&who, Kind::Invoke, read(&k, None));
                let (from, version) = match client.get(&k).await {
                    Ok((v, stat)) => {
                        run.rec.log(&who, Kind::Ok, read(&k, Some(text(&v))));
                        (text(&v), stat.version)
                    }
                    Err(_) => {
                        run.rec.log(&who, Kind::Info, read(&k, None));
                        continue;
                    }
                };
                let op = Op::Cas {
                    key: k.clone(),
                    from: Some(from),
                    to: value.clone(),
                };
                run.rec.log(&who, Kind::Invoke, op.clone());
                let kind = match session
                    .set_data(&k, value.into_bytes(), Some(version))
                    .await
                {
                    Ok(_) => Kind::Ok,
                    Err(wire::Error::BadVersion { .. }) => Kind::Fail,
                    Err(_) => Kind::Info,
                };
                run.rec.log(&who, kind, op);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(20..80))).await;
    }
    let _ = session.close().await;
}

/// A cache reader: cached reads only, of the current epoch's keys, one every few
/// milliseconds. Its hits never wait on the network, so while `client-cut` stops what
/// arrives for it, it goes on serving what it cached, and the register checker sees
/// whether a write completed meanwhile without waiting for this session.
async fn cache_reader(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("cache-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        let k = current_key(&run, &mut rng);
        cached_read(&session, &run, &who, &k).await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(15..45))).await;
    }
    let _ = session.close().await;
}

/// A reader: linearizable reads only, of the current epoch's keys. It never writes, so it
/// never learns who leads from a write's redirect: its reads go to the first replica of
/// its list (a follower, mostly), which must send it on to the leader rather than answer
/// from its own, possibly stale, state.
async fn reader(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("read-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    while Instant::now() < run.deadline {
        let k = current_key(&run, &mut rng);
        linearizable_read(&client, &run, &who, &k).await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(20..60))).await;
    }
}

/// One of the current epoch's register keys, drawn from `rng`.
fn current_key(run: &Run, rng: &mut StdRng) -> String {
    key(
        run.epoch_of(Instant::now()),
        rng.gen_range(0..KEYS_PER_EPOCH),
    )
}

/// A linearizable read of `k`, recorded (a failed one as indeterminate).
async fn linearizable_read(client: &Client, run: &Run, who: &str, k: &str) {
    run.rec.log(who, Kind::Invoke, read(k, None));
    match client.get(k).await {
        Ok((v, _)) => run.rec.log(who, Kind::Ok, read(k, Some(text(&v)))),
        Err(_) => run.rec.log(who, Kind::Info, read(k, None)),
    }
}

/// A read of `k` through `session`'s cache, recorded (a failed one as indeterminate).
async fn cached_read(session: &Session, run: &Run, who: &str, k: &str) {
    run.rec.log(who, Kind::Invoke, read(k, None));
    match session.get_cached(k).await {
        Ok(v) => run
            .rec
            .log(who, Kind::Ok, read(k, v.map(|(data, _)| text(&data)))),
        Err(_) => run.rec.log(who, Kind::Info, read(k, None)),
    }
}

fn read(k: &str, value: Option<String>) -> Op {
    Op::Read {
        key: k.into(),
        value,
    }
}

/// Watches one key of one epoch; once its writers moved on (and a write's retries could
/// have landed), the last value read must be the key's final value.
async fn watcher(client: Client, session: Session, run: Arc<Run>, k: String, until: Instant) {
    let shared = session.id();
    let session = watch_key(&client, session, &run, &k, until).await;
    if session.id() != shared {
        let _ = session.close().await;
    }
}

/// [`watcher`]'s loop; returns the session it ended with (a new one if the first expired).
async fn watch_key(
    client: &Client,
    mut session: Session,
    run: &Run,
    k: &str,
    until: Instant,
) -> Session {
    let mut last: Option<String> = None;
    while Instant::now() < until {
        match tokio::time::timeout(
            until.saturating_duration_since(Instant::now()),
            session.get_watch(k),
        )
        .await
        {
            Ok(Ok((v, _, w))) => {
                last = Some(text(&v));
                tokio::select! {
                    _ = w => {}
                    _ = tokio::time::sleep_until(until) => break,
                }
            }
            Ok(Err(_)) => {
                last = None;
                if session.state() == SessionState::Expired {
                    if let Ok(s) = client.open_session().await {
                        session = s;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => break,
        }
    }
    let Some(last) = last else {
        return session;
    };
    for _ in 0..20 {
        if let Ok((v, _)) = client.get(k).await {
            let fin = text(&v);
            if fin != last {
                run.violation(format!(
                    "watcher of {k} missed a change: its last read was {last:?}, the final \
                     value is {fin:?}"
                ));
            }
            *run.watches_checked.lock().expect("lock") += 1;
            return session;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    session
}

/// A session that keeps renewing and owns an ephemeral: it must never expire.
async fn keeper(client: Client, run: Arc<Run>, i: usize) -> bool {
    let Some(session) = open_session(&client, &run).await else {
        run.violation(format!("keeper {i}: no session could be opened"));
        return false;
    };
    let path = format!("/suite/members/keep-{i}");
    let mut created = false;
    while !created && Instant::now() < run.deadline {
        created = session
            .create(
                &path,
                vec![],
                CreateMode {
                    ephemeral: true,
                    sequential: false,
                },
            )
            .await
            .is_ok()
            || session.exists(&path).await.ok().flatten().is_some();
    }
    let mut states = session.subscribe();
    loop {
        if *states.borrow() == SessionState::Expired {
            run.violation(format!(
                "session {} (keeper {i}) kept renewing but expired at {} ms",
                session.id(),
                run.rec.start().elapsed().as_millis()
            ));
            return false;
        }
        tokio::select! {
            r = states.changed() => if r.is_err() { break },
            _ = tokio::time::sleep_until(run.deadline) => break,
        }
    }
    let _ = session.close().await;
    true
}

/// Now and then a session that creates an ephemeral and stops renewing.
async fn abandoner(client: Client, run: Arc<Run>) {
    let mut n = 0;
    while Instant::now() + run.lease < run.deadline {
        if let Some(s) = open_session(&client, &run).await {
            let _ = s
                .create(
                    &format!("/suite/members/gone-{n}"),
                    vec![],
                    CreateMode {
                        ephemeral: true,
                        sequential: false,
                    },
                )
                .await;
            s.stop_keepalives();
            *run.abandoned.lock().expect("lock") += 1;
            n += 1;
        }
        tokio::time::sleep(Duration::from_secs(7)).await;
    }
}

/// Nodes removed by session ends, for the register checker: a session creates an
/// ephemeral key (a write of a fresh value), then ends, by close (a removal that completes
/// when the close returns) or by ceasing to renew (a removal at an unknown moment, pinned
/// by the linearizable reads of [`ending_reader`]), and the next session takes a fresh key.
/// A cached read that finds a key after its removal completed is a stale read.
async fn ending_owner(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("ending-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    // The last session must be gone by the deadline (convergence wants none left).
    while Instant::now() + run.lease < run.deadline {
        let Some(session) = open_session(&client, &run).await else {
            return;
        };
        n += 1;
        let k = format!("/suite/ending/o{i}-{n}");
        let value = format!("{i}-{n}");
        let op = Op::Write {
            key: k.clone(),
            value: value.clone(),
        };
        run.rec.log(&who, Kind::Invoke, op.clone());
        let mode = CreateMode {
            ephemeral: true,
            sequential: false,
        };
        let kind = match session.create(&k, value.into_bytes(), mode).await {
            Ok(_) => Kind::Ok,
            Err(wire::Error::NodeExists { .. }) => Kind::Fail,
            Err(_) => Kind::Info,
        };
        run.rec.log(&who, kind, op);
        run.ending_keys.lock().expect("lock").push(k.clone());
        tokio::time::sleep(Duration::from_millis(rng.gen_range(500..2_000))).await;
        let op = Op::Remove { key: k };
        run.rec.log(&who, Kind::Invoke, op.clone());
        if rng.gen_bool(0.5) {
            let kind = match session.close().await {
                Ok(()) => Kind::Ok,
                Err(_) => Kind::Info,
            };
            run.rec.log(&who, kind, op);
        } else {
            session.stop_keepalives();
            run.rec.log(&who, Kind::Info, op);
            *run.abandoned.lock().expect("lock") += 1;
        }
    }
}

/// Reads the [`ending_owner`]s' newest keys, through its session's cache and
/// linearizably (the latter pin when an expiry's removal had completed).
async fn ending_reader(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("ending-read-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        let k = {
            let keys = run.ending_keys.lock().expect("lock");
            let recent = &keys[keys.len().saturating_sub(4)..];
            recent.get(rng.gen_range(0..recent.len().max(1))).cloned()
        };
        if let Some(k) = k {
            if rng.gen_bool(0.7) {
                cached_read(&session, &run, &who, &k).await;
            } else {
                linearizable_read(&client, &run, &who, &k).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(10..40))).await;
    }
    let _ = session.close().await;
}

/// The nemesis: one fault at a time, drawn from the plan, until the deadline.
async fn nemesis(cell: &mut Cell, client: &Client, run: &Run, rng: &mut StdRng) -> Vec<Injected> {
    let mut log = Vec::new();
    // Faults come in rounds: each round is the plan's faults in a seeded order, so a run
    // long enough for one round injects every kind.
    let mut bag: Vec<Fault> = Vec::new();
    tokio::time::sleep(Duration::from_secs(2)).await;
    while Instant::now() + Duration::from_secs(8) < run.deadline {
        if bag.is_empty() {
            bag = cell.plan.faults.clone();
            bag.shuffle(rng);
        }
        let fault = bag.pop().expect("faults given");
        let hold = Duration::from_millis(rng.gen_range(2_000..5_000));
        let at = run.rec.start().elapsed();
        let leader = cell.leader(client).await;
        let followers: Vec<usize> = (0..cell.slots.len())
            .filter(|i| Some(*i) != leader)
            .collect();
        let mut error = None;
        let target;
        match (fault, leader) {
            (Fault::KillLeader | Fault::KillFollower, _) => {
                let i = if fault == Fault::KillLeader {
                    leader.unwrap_or(0)
                } else {
                    *followers.choose(rng).expect("followers")
                };
                target = format!("replica {}", cell.slots[i].id);
                cell.kill(i);
                tokio::time::sleep(hold).await;
                if let Err(e) = cell.spawn(i) {
                    error = Some(format!("restart: {e}"));
                }
            }
            (Fault::PauseLeader, Some(l)) => {
                target = format!("replica {}", cell.slots[l].id);
                cell.pause(l);
                tokio::time::sleep(hold).await;
                cell.resume(l);
            }
            (Fault::IsolateLeader, Some(l)) => {
                target = format!("host {}", cell.slots[l].host);
                error = cell.hosts.isolate(cell.slots[l].host).err();
                tokio::time::sleep(hold).await;
            }
            (Fault::Split, Some(l)) => {
                let mut others: Vec<usize> =
                    followers.iter().map(|i| cell.slots[*i].host).collect();
                others.shuffle(rng);
                let minority = vec![cell.slots[l].host, others[0]];
                let majority = others[1..].to_vec();
                target = format!("{minority:?} | {majority:?}");
                error = cell.hosts.split(&minority, &majority).err();
                tokio::time::sleep(hold).await;
            }
            (Fault::OneWay, Some(l)) => {
                let lh = cell.slots[l].host;
                let hs: Vec<usize> = followers.iter().map(|i| cell.slots[*i].host).collect();
                if rng.gen_bool(0.5) {
                    target = format!("followers deaf to host {lh}");
                    for h in hs {
                        error = error.or(cell.hosts.drop_from(h, lh).err());
                    }
                } else {
                    target = format!("host {lh} deaf to followers");
                    for h in hs {
                        error = error.or(cell.hosts.drop_from(lh, h).err());
                    }
                }
                tokio::time::sleep(hold).await;
            }
            (Fault::Loss, _) => {
                let i = rng.gen_range(0..cell.slots.len());
                target = format!("host {} (30 %)", cell.slots[i].host);
                error = cell.hosts.loss(cell.slots[i].host, 30).err();
                tokio::time::sleep(hold).await;
            }
            (Fault::ClientCut, _) => {
                let ports = run.lossy_ports.clone();
                target = format!("host {CLIENT_HOST} ports {ports:?}");
                error = cell.hosts.loss_to_ports(CLIENT_HOST, &ports, 100).err();
                tokio::time::sleep(hold).await;
            }
            (Fault::Slow, Some(l)) => {
                // Held longer than a lease: a degraded link at the leader must not cost
                // the clients that keep renewing their sessions.
                let hold = run.lease * 3 / 2;
                target = format!("host {} (256 kbit/s)", cell.slots[l].host);
                error = cell.hosts.slow(cell.slots[l].host, 256).err();
                tokio::time::sleep(hold).await;
            }
            (Fault::Member, Some(_)) => {
                let i = *followers.choose(rng).expect("followers");
                target = format!(
                    "replica {} on host {}",
                    cell.slots[i].id, cell.slots[i].host
                );
                error = replace_member(cell, client, i)
                    .await
                    .err()
                    .map(|e| e.to_string());
            }
            (Fault::KillProxy, _) => {
                target = "no proxy in this tier: skipped".into();
            }
            (_, None) => {
                target = "no leader: skipped".into();
            }
        }
        for e in cell.heal_all() {
            error = Some(error.map_or(e.clone(), |p| format!("{p}; {e}")));
        }
        let held = run.rec.start().elapsed() - at;
        eprintln!(
            "faultsuite: {:>6} ms {fault:?} {target} ({} ms){}",
            ms(at),
            ms(held),
            error
                .as_deref()
                .map(|e| format!(" error: {e}"))
                .unwrap_or_default()
        );
        log.push(Injected {
            at_ms: ms(at),
            fault,
            target,
            held_ms: ms(held),
            error,
        });
        tokio::time::sleep(Duration::from_millis(rng.gen_range(2_000..4_000))).await;
    }
    log
}

/// Removes slot `i`'s replica, wipes it and brings it back under a new id: learner,
/// caught up, promoted.
async fn replace_member(cell: &mut Cell, client: &Client, i: usize) -> anyhow::Result<()> {
    let old = cell.slots[i].id;
    expect_membership(client.request(WireOp::RemoveMember { id: old }).await)?;
    cell.kill(i);
    let _ = std::fs::remove_dir_all(cell.out.join(format!("data-{old}")));
    let id = cell.next_id;
    cell.next_id += 1;
    cell.write_config(cell.slots[i].host, id, false)?;
    cell.slots[i].id = id;
    cell.spawn(i)?;
    let addr = cell.addr(i);
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        match client
            .request(WireOp::AddLearner {
                id,
                addr: addr.to_string(),
            })
            .await
        {
            Ok(r) => {
                expect_membership(Ok(r))?;
                break;
            }
            Err(e) if Instant::now() < end => {
                tracing::debug!("add learner {id}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => anyhow::bail!("add learner {id}: {e}"),
        }
    }
    // Caught up: within a few entries of the leader.
    loop {
        let leader = cell.leader(client).await;
        let target = match leader {
            Some(l) => client
                .status_of(cell.addr(l))
                .await
                .ok()
                .map(|s| s.last_applied),
            None => None,
        };
        let mine = client.status_of(addr).await.ok().map(|s| s.last_applied);
        if let (Some(t), Some(m)) = (target, mine) {
            if m + 20 >= t {
                break;
            }
        }
        anyhow::ensure!(
            Instant::now() < end,
            "learner {id} did not catch up in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    expect_membership(client.request(WireOp::Promote { id }).await)
}

fn expect_membership(r: Result<Reply, wire::Error>) -> anyhow::Result<()> {
    match r? {
        Reply::MembershipChanged { .. } => Ok(()),
        other => anyhow::bail!("unexpected reply {other:?}"),
    }
}

/// After healing: every replica answers, no session is left, all hold the same state (the
/// same digest at the same applied index), and no ephemeral of the run survives.
pub(crate) async fn check_converged(
    replicas: &[(u64, SocketAddr)],
    client: &Client,
    sessions_left: u64,
    within: Duration,
) -> Result<(), String> {
    let end = Instant::now() + within;
    let mut last = String::new();
    while Instant::now() < end {
        let mut seen = BTreeMap::new();
        for (id, addr) in replicas {
            if let Ok(Ok(st)) =
                tokio::time::timeout(Duration::from_secs(1), client.status_of(*addr)).await
            {
                seen.insert(*id, (st.session_count, st.node_count, st.last_applied));
            }
        }
        let counts: std::collections::BTreeSet<_> =
            seen.values().map(|(s, n, _)| (*s, *n)).collect();
        let applied: std::collections::BTreeSet<_> = seen.values().map(|(_, _, a)| *a).collect();
        if seen.len() == replicas.len() && counts.len() == 1 && applied.len() == 1 {
            let (sessions, _) = counts.into_iter().next().expect("one");
            // The same content, not only the same counts: one digest at one index.
            let mut digests = BTreeMap::new();
            for (id, addr) in replicas {
                if let Ok(Ok(d)) =
                    tokio::time::timeout(Duration::from_secs(1), client.state_digest_of(*addr))
                        .await
                {
                    digests.insert(*id, d);
                }
            }
            let at: std::collections::BTreeSet<u64> = digests.values().map(|d| d.0).collect();
            let same_index = digests.len() == replicas.len() && at.len() == 1;
            if same_index
                && digests
                    .values()
                    .map(|d| d.1)
                    .collect::<std::collections::BTreeSet<_>>()
                    .len()
                    > 1
            {
                return Err(format!(
                    "replicas hold different states at one index (id: (index, digest)): {digests:?}"
                ));
            }
            if same_index && sessions == sessions_left {
                let members = client
                    .children("/suite/members")
                    .await
                    .map_err(|e| e.to_string())?;
                let holders = client.children("/suite/lock").await.unwrap_or_default();
                let ending = client.children("/suite/ending").await.unwrap_or_default();
                if members.is_empty() && holders.is_empty() && ending.is_empty() {
                    return Ok(());
                }
                return Err(format!(
                    "ephemerals outlived their sessions: members {:?}, lock {:?}, ending {:?}",
                    members.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                    holders.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                    ending.iter().map(|(n, _)| n).collect::<Vec<_>>()
                ));
            }
        }
        last = format!("{seen:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!(
        "replicas (id: sessions, nodes, applied) did not converge within {} s: {last}",
        within.as_secs()
    ))
}

/// Runs the workloads and the nemesis inside the client host; writes the histories and
/// `verdict.json` to `out`.
pub async fn run_inside(plan: Plan, prefix: &str, out: &Path) -> anyhow::Result<Verdict> {
    let exe = std::env::current_exe()?;
    let mut cell = Cell {
        hosts: Hosts::attach(prefix, CLIENT_HOST),
        out: out.to_path_buf(),
        exe,
        plan: plan.clone(),
        slots: (1..=REPLICAS)
            .map(|h| Slot {
                host: h,
                id: h as u64,
                child: None,
                paused: false,
            })
            .collect(),
        next_id: REPLICAS as u64 + 1,
    };
    for i in 0..REPLICAS {
        cell.write_config(i + 1, i as u64 + 1, i == 0)?;
        cell.spawn(i)?;
    }
    let result = drive(&mut cell, plan, out).await;
    cell.stop_all();
    result
}

async fn drive(cell: &mut Cell, plan: Plan, out: &Path) -> anyhow::Result<Verdict> {
    let endpoints: Vec<String> = (1..=REPLICAS).map(replica_addr).collect();
    let config = ClientConfig::new(endpoints, out.join("tls").join(wire::tls::CA_FILE));
    let client = Client::connect(config.clone()).await?;
    cell.wait_leader(&client, Duration::from_secs(30))
        .await
        .ok_or_else(|| anyhow::anyhow!("no leader within 30 s"))?;
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let workloads = start_workloads(&client, &config, None, &plan, &mut rng).await?;
    let faults = nemesis(cell, &client, &workloads.run, &mut rng).await;
    tokio::time::sleep_until(workloads.deadline()).await;
    let mut violations = Vec::new();
    for e in cell.heal_all() {
        violations.push(format!("healing: {e}"));
    }
    eprintln!("faultsuite: time is up; faults healed; waiting for the workloads");
    let replicas: Vec<(u64, SocketAddr)> = (0..cell.slots.len())
        .map(|i| (cell.slots[i].id, cell.addr(i)))
        .collect();
    let verdict = Verdict {
        seed: plan.seed,
        secs: plan.time.as_secs(),
        faults,
        violations,
        ..Verdict::default()
    };
    finish_workloads(workloads, &client, &replicas, 0, &plan, verdict, out).await
}

/// The workloads of one run, as [`start_workloads`] left them running.
pub(crate) struct Workloads {
    run: Arc<Run>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    keepers: Vec<tokio::task::JoinHandle<bool>>,
    watchers: tokio::task::JoinHandle<usize>,
}

impl Workloads {
    /// Time zero of the history: operations' and faults' times count from it.
    pub(crate) fn started(&self) -> Instant {
        self.run.rec.start()
    }

    /// When the workloads stop starting operations.
    pub(crate) fn deadline(&self) -> Instant {
        self.run.deadline
    }
}

/// Creates the namespace the workloads use (every register key starts at "0") and starts
/// every workload, each on its own client built from `config`, until `plan.time` from now.
/// With `proxied`, both cache readers, one fenced worker, two register workers and one
/// keeper use it instead (a proxy's endpoints): their sessions, KeepAlives, reads and
/// invalidations then go through the proxy. Worker seeds are drawn from `rng`.
pub(crate) async fn start_workloads(
    client: &Client,
    config: &ClientConfig,
    proxied: Option<&ClientConfig>,
    plan: &Plan,
    rng: &mut StdRng,
) -> anyhow::Result<Workloads> {
    let setup = open_session_until(client, Instant::now() + Duration::from_secs(30)).await?;
    for p in [
        "/suite",
        "/suite/reg",
        "/suite/members",
        "/suite/lock",
        "/suite/ending",
    ] {
        match setup.create(p, vec![], CreateMode::default()).await {
            Ok(_) | Err(wire::Error::NodeExists { .. }) => {}
            Err(e) => anyhow::bail!("create {p}: {e}"),
        }
    }
    let epochs = plan.time.as_millis() / EPOCH.as_millis() + 2;
    let rec = Recorder::new();
    for e in 0..epochs as u64 {
        for k in 0..KEYS_PER_EPOCH {
            let op = Op::Write {
                key: key(e, k),
                value: "0".into(),
            };
            rec.log("setup", Kind::Invoke, op.clone());
            setup
                .create(&key(e, k), b"0".to_vec(), CreateMode::default())
                .await?;
            rec.log("setup", Kind::Ok, op);
        }
    }
    let _ = setup.close().await;
    // Each workload gets its own client (its own QUIC connections), as separate
    // processes would. Each client lists the replicas starting from a different one, as
    // independently configured clients would: reads then reach followers first, and only
    // a follower that refuses them (it does not lead) sends the client on to the leader.
    let mut n_clients = 0usize;
    let mut new_client = |via_proxy: bool| {
        let mut cfg = match proxied {
            Some(p) if via_proxy => p.clone(),
            _ => config.clone(),
        };
        let n = cfg.endpoints.len().max(1);
        cfg.endpoints.rotate_left(n_clients % n);
        n_clients += 1;
        Client::connect(cfg)
    };
    let mut cache_clients = Vec::new();
    for _ in 0..2 {
        cache_clients.push(new_client(true).await?);
    }
    let lossy_ports = cache_clients
        .iter()
        .map(|c| c.local_addr().map(|a| a.port()))
        .collect::<std::io::Result<Vec<u16>>>()?;
    let run = Arc::new(Run {
        rec,
        deadline: Instant::now() + plan.time,
        lease: Duration::from_millis(plan.lease_ms),
        violations: Mutex::new(Vec::new()),
        resource: FencedResource::new("r"),
        lossy_ports,
        abandoned: Mutex::new(0),
        watches_checked: Mutex::new(0),
        ending_keys: Mutex::new(Vec::new()),
    });
    let mut tasks = Vec::new();
    for w in 0..3 {
        let c = new_client(w == 2).await?;
        tasks.push(wire::rt::spawn(fenced_worker(c, run.clone(), w, rng.gen())));
    }
    for w in 0..4 {
        let c = new_client(w >= 2).await?;
        tasks.push(wire::rt::spawn(register_worker(
            c,
            run.clone(),
            w,
            rng.gen(),
        )));
    }
    for (i, c) in cache_clients.into_iter().enumerate() {
        tasks.push(wire::rt::spawn(cache_reader(c, run.clone(), i, rng.gen())));
    }
    for i in 0..2 {
        let c = new_client(false).await?;
        tasks.push(wire::rt::spawn(reader(c, run.clone(), i, rng.gen())));
    }
    {
        let c = new_client(false).await?;
        tasks.push(wire::rt::spawn(abandoner(c, run.clone())));
    }
    for i in 0..2 {
        let c = new_client(i == 1).await?;
        tasks.push(wire::rt::spawn(ending_owner(c, run.clone(), i, rng.gen())));
        let c = new_client(i == 1).await?;
        tasks.push(wire::rt::spawn(ending_reader(c, run.clone(), i, rng.gen())));
    }
    let mut keepers = Vec::new();
    for i in 0..3 {
        let c = new_client(i == 2).await?;
        keepers.push(wire::rt::spawn(keeper(c, run.clone(), i)));
    }
    // Watchers: one session, a task per key of each epoch, started as the epoch begins.
    let watch_client = new_client(false).await?;
    let watchers = {
        let run = run.clone();
        let epochs_run = plan.time.as_millis().div_ceil(EPOCH.as_millis()) as u64;
        wire::rt::spawn(async move {
            let Some(session) = open_session(&watch_client, &run).await else {
                return 0;
            };
            let mut hs = Vec::new();
            for e in 0..epochs_run {
                let starts = run.rec.start() + EPOCH * e as u32;
                tokio::time::sleep_until(starts).await;
                let until = starts + EPOCH + Duration::from_secs(12);
                for k in 0..KEYS_PER_EPOCH {
                    hs.push(wire::rt::spawn(watcher(
                        watch_client.clone(),
                        session.clone(),
                        run.clone(),
                        key(e, k),
                        until,
                    )));
                }
            }
            let mut unfinished = 0;
            for h in hs {
                if tokio::time::timeout(Duration::from_secs(60), h)
                    .await
                    .is_err()
                {
                    unfinished += 1;
                }
            }
            let _ = session.close().await;
            unfinished
        })
    };
    Ok(Workloads {
        run,
        tasks,
        keepers,
        watchers,
    })
}

/// Once the faults are healed: waits for the workloads, checks the cell converged (with
/// `sessions_left` sessions that are not the workloads', such as a proxy's own), writes the
/// history and runs the checkers; completes `verdict` (which holds the faults and any
/// violations found so far) and writes it to `out/verdict.json`.
pub(crate) async fn finish_workloads(
    workloads: Workloads,
    client: &Client,
    replicas: &[(u64, SocketAddr)],
    sessions_left: u64,
    plan: &Plan,
    mut verdict: Verdict,
    out: &Path,
) -> anyhow::Result<Verdict> {
    let Workloads {
        run,
        tasks,
        keepers,
        watchers,
    } = workloads;
    let mut violations = std::mem::take(&mut verdict.violations);
    for t in tasks {
        if tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .is_err()
        {
            violations.push("a workload did not finish within 60 s of the end".into());
        }
    }
    let mut kept = 0;
    for k in keepers {
        if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(30), k).await {
            kept += 1;
        }
    }
    match tokio::time::timeout(Duration::from_secs(90), watchers).await {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => violations.push(format!("{n} watchers did not finish")),
        _ => violations.push("the watchers did not finish".into()),
    }
    // Convergence: sessions left to expire need a lease, plus fail-over slack.
    let within = Duration::from_millis(plan.lease_ms * 3) + Duration::from_secs(30);
    if let Err(e) = check_converged(replicas, client, sessions_left, within).await {
        violations.push(e);
    }

    let events = run.rec.events();
    write_history(
        &mut std::fs::File::create(out.join("history.jsonl"))?,
        &events,
    )?;
    verdict.sessions_kept = kept;
    verdict.sessions_abandoned = *run.abandoned.lock().expect("lock");
    verdict.watches_checked = *run.watches_checked.lock().expect("lock");
    match check_fenced_lock(&events) {
        Ok(s) => {
            verdict.grants = s.grants;
            verdict.fenced_accepted = s.accepted;
            verdict.fenced_refused = s.refused;
        }
        Err(e) => violations.push(format!("fenced lock: {e}")),
    }
    match check_register(&events, MAX_OPS_PER_KEY) {
        Ok(n) => verdict.register_ops = n,
        Err(e) => violations.push(format!("register: {e}")),
    }
    violations.extend(run.violations.lock().expect("lock").drain(..));
    verdict.violations = violations;
    std::fs::write(
        out.join("verdict.json"),
        serde_json::to_string_pretty(&verdict)?,
    )?;
    Ok(verdict)
}

async fn open_session_until(client: &Client, until: Instant) -> anyhow::Result<Session> {
    loop {
        match client.open_session().await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= until => anyhow::bail!("open session: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
