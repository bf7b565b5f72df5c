//! Prefix moves in the simulation (`SimPlan::moves`, issue 25): a second cell and a
//! directory instance join the simulated cell, a prefix moves between the two cells as
//! one of the nemesis' faults, and workloads on that prefix are checked.
//!
//! - **Hosts.** Cell `b` (three replicas, `b1`..`b3`, their certificates naming cell `b`)
//!   and a directory instance `d1` reading the map from the first cell (`dev`), which is
//!   also the root cell: it records `/suite` (the namespace workloads) and `/directory`
//!   as its own, and [`PREFIX`] starts there at epoch 0.
//! - **The fault.** `move` runs `lockctl dir move`'s code ([`crate::dir::move_or_stop`])
//!   from the client host, to the cell that does not serve [`PREFIX`] now. Half of the
//!   moves stop after a seeded step, as a mover killed there would (its session is left
//!   to expire, holding the move's lease until then); the next `move` fault runs the move
//!   again and must finish it. The other faults hit the first cell meanwhile, so a move
//!   left half done meets crashes, partitions and pauses. A move still unfinished when the
//!   workloads end is finished before the checks.
//! - **Workloads** through a [`Router`] (the SDK's routing, by the directory's map):
//!   writers create nodes `n1`, `n2`, ... under a folder each and remember which creates
//!   were acknowledged; lock
//!   workers take a lock under the prefix, act on it while `may_act` says so (for up to
//!   two seconds, so that moves fall inside their holds) and write to a fenced resource
//!   with their token. Their grants, acts and fenced writes go into the suite's history,
//!   so the fenced-lock checker's three rules cover them across moves: tokens grow, no
//!   write with an older token after a newer one, and no holder acting after another's
//!   grant of a higher token completed.
//! - **Checks** (`Moves::finish`): every create a writer had acknowledged is there, with
//!   its data, and nothing it never wrote; exactly one cell serves the prefix, at the
//!   map's epoch, and the other records it gone at that epoch (or, for cell `b` before its
//!   first move, nothing); the map names the owner with no move under way; cell `b`'s
//!   replicas hold the same state.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use client_sdk::{Client, ClientConfig, CreateMode, Lock, Router, RouterConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use replica::config::TlsConfig;
use replica::raft::mem_log::MemLog;
use replica::server::Plumbing;
use tokio::time::Instant;
use wire::directory::PrefixState;
use wire::identity::Identity;
use wire::quic::Sockets;

use super::{SimPlan, SimSockets, PORT};
use crate::faults::checkers::{FencedResource, Kind, Op};
use crate::faults::workloads::Run;

/// The second cell's name (its certificates say `lock://b/replica/b`).
pub const CELL_B: &str = "b";
/// The first cell's name (the dev certificates' cell).
pub const CELL_A: &str = wire::tls::DEV_CELL;
/// Replicas of the second cell.
pub const B_REPLICAS: usize = 3;
/// The directory instance's host.
pub const DIRECTORY: &str = "d1";
const DIRECTORY_PORT: u16 = 7300;
/// The prefix that moves.
pub const PREFIX: &str = "/mv";
const LOCK: &str = "/mv/lock";
const WRITERS: usize = 2;
const LOCKERS: usize = 2;

/// The second cell's host `i` (1-based).
pub fn b_host(i: usize) -> String {
    format!("b{i}")
}

/// The hosts this module adds.
pub fn hosts() -> Vec<String> {
    let mut v: Vec<String> = (1..=B_REPLICAS).map(b_host).collect();
    v.push(DIRECTORY.into());
    v
}

/// Where the second cell and the directory are.
#[derive(Debug, Clone)]
pub struct Places {
    /// The second cell's replicas.
    pub b: Vec<SocketAddr>,
    /// The directory instance.
    pub directory: SocketAddr,
}

/// Adds the second cell's replicas and the directory instance to `sim` (certificates from
/// the seeded dev CA in `tls`, written under `out`).
pub(super) fn add_hosts(
    sim: &mut turmoil::Sim<'_>,
    plan: &SimPlan,
    out: &Path,
    tls: &Path,
    ca: &wire::tls::DevCa,
    a: &[SocketAddr],
) -> anyhow::Result<Places> {
    let b: Vec<SocketAddr> = (1..=B_REPLICAS)
        .map(|i| SocketAddr::new(sim.lookup(b_host(i)), PORT))
        .collect();
    // Cell b's files: the same CA, its own replica certificate.
    let tls_b = out.join("tls-b");
    std::fs::create_dir_all(&tls_b)?;
    std::fs::copy(tls.join(wire::tls::CA_FILE), tls_b.join(wire::tls::CA_FILE))?;
    let rb = ca
        .issue_ed25519_from_seed(
            plan.seed,
            4,
            &Identity::Replica {
                cell: CELL_B.into(),
                name: CELL_B.into(),
            },
        )
        .map_err(anyhow::Error::msg)?;
    std::fs::write(tls_b.join(wire::tls::REPLICA_CERT_FILE), &rb.cert_pem)?;
    wire::tls::write_private(&tls_b.join(wire::tls::REPLICA_KEY_FILE), &rb.key_pem)?;
    let members = super::members(&b);
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x0063_656c_6c62);
    for i in 1..=B_REPLICAS {
        // Fixed election timeouts, distinct, as the first cell's (see `run_seed`).
        let election = 520 + 100 * i as u64 + rng.gen_range(0..40);
        let cfg = super::replica_config(
            i as u64,
            b[i - 1],
            &members,
            out.join(format!("data-b{i}")),
            &tls_b,
            election,
            plan.lease_ms,
        )?;
        let log = MemLog::with_store_id(super::store_id(100 + i, 0));
        let seed = plan.seed;
        sim.host(b_host(i), move || {
            let cfg = cfg.clone();
            let plumbing = Plumbing {
                sockets: Sockets::Factory(Arc::new(SimSockets::new(
                    &b_host(i),
                    seed ^ 0x62 ^ ((i as u64) << 40),
                ))),
                memory_log: Some(log.clone()),
            };
            async move {
                replica::server::run_on(cfg, plumbing, std::future::pending())
                    .await
                    .map_err(|e| format!("replica of cell b: {e:#}").into())
            }
        });
    }

    // The directory instance: a client of the first (root) cell.
    let d = ca
        .issue_ed25519_from_seed(
            plan.seed,
            5,
            &Identity::Directory {
                name: DIRECTORY.into(),
            },
        )
        .map_err(anyhow::Error::msg)?;
    let dir_tls = TlsConfig {
        ca: tls.join(wire::tls::CA_FILE),
        cert: out.join("tls-b").join("directory.pem"),
        key: out.join("tls-b").join("directory.key"),
        crls: Vec::new(),
    };
    std::fs::write(&dir_tls.cert, &d.cert_pem)?;
    wire::tls::write_private(&dir_tls.key, &d.key_pem)?;
    let cfg = directory::DirectoryConfig {
        listen: SocketAddr::from(([0, 0, 0, 0], DIRECTORY_PORT)),
        root: a.iter().map(|a| a.to_string()).collect(),
        tls: dir_tls,
        refresh: Duration::from_secs(5),
        metrics_listen: None,
    };
    let seed = plan.seed;
    sim.host(DIRECTORY, move || {
        let cfg = cfg.clone();
        let sockets = Sockets::Factory(Arc::new(SimSockets::new(DIRECTORY, seed ^ 0x0064_6972)));
        async move {
            directory::run_on(cfg, sockets, std::future::pending())
                .await
                .map_err(|e| format!("directory: {e:#}").into())
        }
    });
    Ok(Places {
        b,
        directory: SocketAddr::new(sim.lookup(DIRECTORY), DIRECTORY_PORT),
    })
}

/// A move the nemesis asks the client host to make: to `to`, stopped after step
/// `stop_after` if given.
#[derive(Debug, Clone)]
pub struct MoveAsk {
    /// The cell the prefix moves to.
    pub to: String,
    /// The step after which the mover stops, as if killed there.
    pub stop_after: Option<u32>,
}

/// What the client host's move side holds.
pub(super) struct Moves {
    template: ClientConfig,
    root: Client,
    b: Client,
    router: Router,
    /// Taken for each move, so the final completion never runs beside one.
    mover: Arc<tokio::sync::Mutex<()>>,
    tasks: Vec<tokio::task::JoinHandle<Writer>>,
    lockers: Vec<tokio::task::JoinHandle<()>>,
    /// Moves that finished.
    pub finished: Arc<Mutex<usize>>,
}

/// What a writer did: under its folder it created `n1`, `n2`, ... (a node per write, so
/// that a write lost by a move shows as a missing node, not hidden by a later value).
#[derive(Debug, Default)]
struct Writer {
    path: String,
    acked: Vec<u64>,
    attempted: u64,
}

/// Retries `f` every 200 ms for up to `within` (simulated time).
async fn retry<T, F, Fut>(what: &str, within: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let until = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= until => {
                return Err(e.context(format!("{what}: gave up after {within:?}")))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Places the prefixes (the first cell keeps `/suite` and `/directory`, and [`PREFIX`]
/// starts there), describes both cells in the map, creates the prefix's nodes and a
/// router. `root` is a client of the first cell; `template` how cells are reached.
pub(super) async fn setup(
    root: &Client,
    template: &ClientConfig,
    a: &[SocketAddr],
    places: &Places,
) -> anyhow::Result<Moves> {
    let within = Duration::from_secs(60);
    for p in ["/suite", "/directory"] {
        retry("record a prefix", within, || async {
            Ok(root.set_prefix(p, 0, PrefixState::Owned).await?)
        })
        .await?;
    }
    let b = {
        let mut cfg = template.clone();
        cfg.endpoints = places.b.iter().map(|a| a.to_string()).collect();
        cfg.cell = Some(CELL_B.into());
        Client::connect(cfg).await?
    };
    retry("cell b answers", within, || async {
        Ok(b.prefixes().await?)
    })
    .await?;
    for (name, eps) in [(CELL_A, a), (CELL_B, &places.b[..])] {
        let cmd = crate::dir::DirCommand::Cell {
            name: name.into(),
            addrs: eps.iter().map(|a| a.to_string()).collect(),
        };
        crate::dir::run(root, template, cmd).await?;
    }
    let cmd = crate::dir::DirCommand::Set {
        prefix: PREFIX.into(),
        cell: CELL_A.into(),
    };
    crate::dir::run(root, template, cmd).await?;
    let s = root.open_session().await?;
    // The writers' folders.
    let mut paths: Vec<String> = vec![PREFIX.into(), LOCK.into()];
    paths.extend((0..WRITERS).map(|i| format!("{PREFIX}/w{i}")));
    for p in &paths {
        match s.create(p, b"0".to_vec(), CreateMode::default()).await {
            Ok(_) | Err(wire::Error::NodeExists { .. }) => {}
            Err(e) => anyhow::bail!("create {p}: {e}"),
        }
    }
    let _ = s.close().await;
    let mut rt = template.clone();
    rt.request_timeout = Duration::from_secs(2);
    let router = retry("the directory serves the map", within, || {
        let cfg = RouterConfig::new(vec![places.directory.to_string()], rt.clone());
        async move { Ok(Router::connect(cfg).await?) }
    })
    .await?;
    Ok(Moves {
        template: template.clone(),
        root: root.clone(),
        b,
        router,
        mover: Arc::new(tokio::sync::Mutex::new(())),
        tasks: Vec::new(),
        lockers: Vec::new(),
        finished: Arc::new(Mutex::new(0)),
    })
}

impl Moves {
    /// Starts the writers and lock workers until the run's deadline; the lock workers'
    /// history goes into the run's.
    pub(super) fn start(&mut self, run: Arc<Run>, seed: u64) {
        let deadline = run.deadline;
        for i in 0..WRITERS {
            let router = self.router.clone();
            self.tasks.push(wire::rt::spawn(writer(
                router,
                format!("{PREFIX}/w{i}"),
                deadline,
            )));
        }
        let resource = Arc::new(FencedResource::new("r-mv"));
        for w in 0..LOCKERS {
            self.lockers.push(wire::rt::spawn(locker(
                self.router.clone(),
                run.clone(),
                resource.clone(),
                w,
                seed ^ (w as u64 + 1) << 20,
                deadline,
            )));
        }
    }

    /// Makes the moves the nemesis asks for, one at a time, reporting each outcome: true
    /// if it finished, false if it stopped as asked.
    pub(super) fn mover(&self) -> impl FnMut(MoveAsk) -> MoveRun {
        let (root, template, lock, finished) = (
            self.root.clone(),
            self.template.clone(),
            self.mover.clone(),
            self.finished.clone(),
        );
        move |ask: MoveAsk| {
            let (root, template, lock, finished) = (
                root.clone(),
                template.clone(),
                lock.clone(),
                finished.clone(),
            );
            Box::pin(async move {
                let _held = lock.lock().await;
                let r = crate::dir::move_or_stop(&root, &template, PREFIX, &ask.to, ask.stop_after)
                    .await
                    .map_err(|e| format!("{e:#}"));
                if let Ok(true) = r {
                    *finished.lock().expect("finished") += 1;
                }
                r
            })
        }
    }

    /// After the workloads: finishes a move left half done (as the nemesis heals its other
    /// faults: a frozen prefix holds its writers up), waits for the workloads, and checks
    /// (see the module documentation). Returns the violations found.
    pub(super) async fn finish(self, b_replicas: &[SocketAddr]) -> Vec<String> {
        let mut violations = Vec::new();
        let Moves {
            template,
            root,
            b,
            router,
            mover,
            tasks,
            lockers,
            finished,
        } = self;
        // A move left half done is finished (a new mover waits for a stopped one's
        // session to expire, then goes on from where the cells stand).
        {
            let _held = mover.lock().await;
            let pending = retry("read the map", Duration::from_secs(60), || async {
                let s = root.open_session().await?;
                let map = crate::dir::read(&s).await;
                let _ = s.close().await;
                map
            })
            .await
            .map(|m| {
                m.prefixes
                    .into_iter()
                    .find(|p| p.prefix == PREFIX)
                    .and_then(|p| p.moving_to)
            });
            match pending {
                Ok(Some(to)) => {
                    let r = retry("finish the move", Duration::from_secs(120), || async {
                        crate::dir::move_or_stop(&root, &template, PREFIX, &to, None).await
                    })
                    .await;
                    match r {
                        Ok(_) => *finished.lock().expect("finished") += 1,
                        Err(e) => violations.push(format!("move: could not finish: {e:#}")),
                    }
                }
                Ok(None) => {}
                Err(e) => violations.push(format!("move: {e:#}")),
            }
        }
        for l in lockers {
            if tokio::time::timeout(Duration::from_secs(60), l)
                .await
                .is_err()
            {
                violations.push("move: a lock worker did not finish within 60 s".into());
            }
        }
        let mut writers = Vec::new();
        for t in tasks {
            match tokio::time::timeout(Duration::from_secs(60), t).await {
                Ok(Ok(w)) => writers.push(w),
                _ => violations.push("move: a writer did not finish within 60 s".into()),
            }
        }
        // One owner, at the map's epoch; the map names it.
        let owner = || async {
            let s = root.open_session().await?;
            let map = crate::dir::read(&s).await;
            let _ = s.close().await;
            let entry = map?
                .prefixes
                .into_iter()
                .find(|p| p.prefix == PREFIX)
                .ok_or_else(|| anyhow::anyhow!("{PREFIX} is not in the map"))?;
            anyhow::ensure!(
                entry.moving_to.is_none(),
                "a move is still under way: {entry:?}"
            );
            let mut owners = Vec::new();
            for (name, c) in [(CELL_A, &root), (CELL_B, &b)] {
                let rec = c.prefixes().await?.into_iter().find(|r| r.prefix == PREFIX);
                match rec {
                    Some(r) if r.state == PrefixState::Owned => {
                        anyhow::ensure!(
                            r.epoch == entry.epoch,
                            "{name} owns {PREFIX} at epoch {}, the map says {}",
                            r.epoch,
                            entry.epoch
                        );
                        owners.push(name);
                    }
                    // The cell that let go last did so at the map's epoch.
                    Some(r) if r.state == PrefixState::Gone && r.epoch == entry.epoch => {}
                    // Cell b before any move finished (a record stays once set).
                    None if entry.epoch == 0 => {}
                    None => {
                        anyhow::bail!("{name} has no record of {PREFIX} at epoch {}", entry.epoch)
                    }
                    Some(r) => anyhow::bail!("{name} records {PREFIX} as {r:?} after the moves"),
                }
            }
            anyhow::ensure!(
                owners == [entry.cell.as_str()],
                "cells serving {PREFIX}: {owners:?}; the map names {}",
                entry.cell
            );
            Ok::<_, anyhow::Error>(entry.cell)
        };
        match retry("one owner", Duration::from_secs(30), owner).await {
            Ok(_) => {}
            Err(e) => violations.push(format!("move: {e:#}")),
        }
        // No acknowledged write lost, none that was never made, each with its data.
        for w in writers {
            let read = retry("list a writer's nodes", Duration::from_secs(30), || async {
                Ok(router.children(&w.path).await?)
            })
            .await;
            match read {
                Ok(children) => {
                    let found: std::collections::BTreeSet<u64> = children
                        .iter()
                        .filter_map(|(name, _)| name.strip_prefix('n')?.parse().ok())
                        .collect();
                    let lost: Vec<u64> = w
                        .acked
                        .iter()
                        .filter(|n| !found.contains(n))
                        .copied()
                        .collect();
                    if !lost.is_empty() {
                        violations.push(format!(
                            "move: {}: acknowledged creates missing: {lost:?} (of {})",
                            w.path,
                            w.acked.len()
                        ));
                    }
                    if let Some(n) = found.iter().find(|n| **n > w.attempted || **n == 0) {
                        violations.push(format!(
                            "move: {}: n{n} exists, never written (attempted up to {})",
                            w.path, w.attempted
                        ));
                    }
                    if children.len() != found.len() {
                        violations.push(format!("move: {}: unexpected children", w.path));
                    }
                    // The data came along (spot check: the last acknowledged node's).
                    if let Some(last) = w.acked.last() {
                        match router.get(&format!("{}/n{last}", w.path)).await {
                            Ok((d, _)) if d == last.to_string().into_bytes() => {}
                            other => {
                                violations.push(format!("move: {}/n{last} reads {other:?}", w.path))
                            }
                        }
                    }
                }
                Err(e) => violations.push(format!("move: {e:#}")),
            }
        }
        router.close().await;
        // The second cell's replicas hold the same state.
        let mut same = false;
        let until = Instant::now() + Duration::from_secs(30);
        let mut last = Vec::new();
        while Instant::now() < until && !same {
            last.clear();
            for a in b_replicas {
                if let Ok(Ok(d)) =
                    tokio::time::timeout(Duration::from_secs(1), b.state_digest_of(*a)).await
                {
                    last.push(d);
                }
            }
            same = last.len() == b_replicas.len() && last.windows(2).all(|w| w[0] == w[1]);
            if !same {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        if !same {
            violations.push(format!("move: cell b's replicas do not converge: {last:?}"));
        }
        violations
    }
}

/// A move in progress, as the client host runs it.
pub(super) type MoveRun =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<bool, String>> + Send + 'static>>;

/// Sets `path` to 1, 2, 3, ... through the router until `deadline`.
async fn writer(router: Router, path: String, deadline: Instant) -> Writer {
    let mut w = Writer {
        path,
        ..Writer::default()
    };
    while Instant::now() < deadline {
        w.attempted += 1;
        let n = w.attempted;
        let node = format!("{}/n{n}", w.path);
        if router
            .create(&node, n.to_string().into_bytes(), CreateMode::default())
            .await
            .is_ok()
        {
            w.acked.push(n);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w
}

/// Takes the lock under the prefix through the router's session for it, acts while it
/// may (up to two seconds), writes to the fenced resource with its token, releases.
async fn locker(
    router: Router,
    run: Arc<Run>,
    resource: Arc<FencedResource>,
    w: usize,
    seed: u64,
    deadline: Instant,
) {
    let who = format!("mv-lock-{w}");
    let rec = &run.rec;
    let mut rng = StdRng::seed_from_u64(seed);
    let acq = |token| Op::Acquire {
        lock: LOCK.into(),
        token,
    };
    while Instant::now() < deadline {
        let session = match router.session_for(LOCK).await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        rec.log(&who, Kind::Invoke, acq(None));
        let guard = match Lock::exclusive(&session, LOCK)
            .acquire_timeout(Duration::from_secs(3))
            .await
        {
            Ok(Some(g)) => g,
            Ok(None) => {
                rec.log(&who, Kind::Fail, acq(None));
                continue;
            }
            Err(e) => {
                rec.log(&who, Kind::Info, acq(None));
                if matches!(e, wire::Error::WrongCell { .. }) {
                    let _ = router.refresh().await;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let token = guard.token();
        rec.log(&who, Kind::Ok, acq(Some(token)));
        let act = Op::Act {
            lock: LOCK.into(),
            token,
        };
        let until = Instant::now() + Duration::from_millis(rng.gen_range(200..2_000));
        while Instant::now() < until {
            let at = rec.stamp();
            if !guard.may_act() {
                break;
            }
            rec.log_at(at, &who, Kind::Ok, act.clone());
            if !resource.write(rec, &who, token) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.gen_range(10..60))).await;
        }
        let lost = guard.lost();
        if !lost {
            let _ = guard.release().await;
        } else {
            drop(guard);
        }
        rec.log(
            &who,
            Kind::Ok,
            Op::Release {
                lock: LOCK.into(),
                token,
            },
        );
    }
}
