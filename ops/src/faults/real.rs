//! The fault suite on real processes in network namespaces (`faultsuite`).
//!
//! Five replica processes run on real fjall and QUIC, each in its own network namespace
//! (hosts 1–5 of [`crate::faults::netns::Hosts`]); the clients and the nemesis run in host 6. For
//! the time given, a seeded nemesis injects one fault at a time, in rounds that each hold
//! every kind of the plan in a seeded order (kill -9 and restart,
//! SIGSTOP, leader isolation, majority/minority splits, one-way cuts, packet loss, a slow
//! link, replacing a member) while, with the option, two replicas run under libfaketime
//! with their clocks running fast and slow. Meanwhile the workloads
//! ([`crate::faults::workloads`]) run in host 6 and record their histories.
//!
//! After the time is up every fault is healed, and the cell must converge: every replica
//! answers, no session is left, all replicas hold the same number of nodes, and no
//! ephemeral of the run survives. Histories, the nemesis' log, replica logs and a
//! `verdict.json` are written to the output directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, ClientConfig};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use replica::config::{Member, ReplicaConfig, SessionConfig, TlsConfig};
use wire::types::{Op as WireOp, Reply};

use crate::faults::netns::Hosts;
use crate::faults::plan::{faketime_library, Fault, Injected, Plan, Verdict};
use crate::faults::workloads::{finish_workloads, start_workloads, Run};

/// Replica hosts are 1..=REPLICAS; the clients and the nemesis run in host CLIENT_HOST.
pub const REPLICAS: usize = 5;
/// The host of the clients and the nemesis.
pub const CLIENT_HOST: usize = 6;
const PORT: u16 = 7100;

fn replica_addr(host: usize) -> String {
    format!("{}.{host}:{PORT}", crate::faults::netns::SUBNET)
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
            tls: TlsConfig::replica_in_dir(&tls),
            raft: Default::default(),
            session: SessionConfig {
                lease_ms: self.plan.lease_ms,
                ..SessionConfig::default()
            },
            request_timeout_ms: 5_000,
            // The dev client drives a whole cell's load (loadgen, the tests).
            limits: replica::config::LimitsConfig::unlimited_for(wire::tls::DEV_CLIENT),
            faults: Default::default(),
            security: replica::config::SecurityConfig::open(wire::tls::DEV_CLIENT),
            metrics: Default::default(),
            backup: Default::default(),
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
            (Fault::Move, _) => {
                target = "one cell in this tier: skipped".into();
            }
            (Fault::Wipe, _) => {
                target = "simulation tier only: skipped".into();
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
