//! The workloads both tiers run against a cell, and what they record. Each records a
//! history ([`crate::faults::checkers`]) or checks as it goes:
//!
//! - *fenced lock*: workers take one lock and write to a protected resource with their
//!   token; one of them now and then stops renewing while it holds the lock, sleeps past
//!   its lease and writes anyway. Checked by [`crate::faults::checkers::check_fenced_lock`].
//! - *register*: linearizable reads, cached reads, writes and compare-and-sets on a few
//!   keys (fresh keys every epoch, so each key's history stays short enough to search),
//!   two cache readers that only read through their session caches, and two readers that
//!   only make linearizable reads (and so start at a follower). Checked by
//!   [`crate::faults::checkers::check_register`].
//! - *sessions*: sessions that keep renewing hold an ephemeral each and must never expire;
//!   sessions that stop renewing must take their ephemerals with them, on every replica.
//! - *session ends*: sessions create an ephemeral key each and end, by close or by
//!   ceasing to renew, while readers read those keys through their caches and
//!   linearizably; the removals go into the register history, so a cached read that
//!   finds a key after its removal completed is a stale read.
//! - *watches*: one watcher per register key re-reads after every event; once the key's
//!   writers moved on, its last read must be the key's final value (no missed change).
//!
//! [`start_workloads`] sets them going, each on its own client; [`finish_workloads`]
//! waits for them and runs the checkers; [`check_converged`] is the last check, once every
//! fault is healed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, ClientConfig, CreateMode, Session, SessionState};
use rand::rngs::StdRng;
use rand::Rng;

use crate::faults::checkers::{
    check_fenced_lock, check_register, write_history, FencedResource, Kind, Op, Recorder,
};
use crate::faults::plan::{Plan, Verdict};

mod fenced;
mod register;
mod sessions;
mod watches;

use fenced::fenced_worker;
use register::{cache_reader, reader, register_worker};
use sessions::{abandoner, ending_owner, ending_reader, keeper};
use watches::watcher;

/// Register keys get fresh names every epoch.
const EPOCH: Duration = Duration::from_secs(10);
const KEYS_PER_EPOCH: usize = 2;
/// The register checker's bound on one key's operations.
pub const MAX_OPS_PER_KEY: usize = 1_500;

/// The run's shared state for the workloads.
pub(crate) struct Run {
    pub(crate) rec: Recorder,
    pub(crate) deadline: Instant,
    pub(crate) lease: Duration,
    violations: Mutex<Vec<String>>,
    resource: FencedResource,
    /// The local ports of the cache readers, which `client-cut` hits.
    pub(crate) lossy_ports: Vec<u16>,
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

/// The workloads of one run, as [`start_workloads`] left them running.
pub(crate) struct Workloads {
    pub(crate) run: Arc<Run>,
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
