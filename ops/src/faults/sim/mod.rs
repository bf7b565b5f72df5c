//! The fault suite's simulation tier (`faultsuite sim`): a whole cell in one process on a
//! simulated network and clock (turmoil).
//!
//! Five replicas run the real replica code (`replica::server::run_on`: the actors, the
//! state machine, openraft, QUIC with TLS) on turmoil hosts. Their QUIC endpoints send
//! datagrams through turmoil's simulated UDP ([`SimSockets`]), their Raft logs live in
//! memory ([`replica::raft::mem_log::MemLog`], kept across a simulated crash as a synced
//! disk would be) and every timer, lease and deadline runs on turmoil's clock, which
//! advances only as the simulation steps. A sixth host runs a proxy
//! (`proxy::server::run_on`), and one more runs the workloads and checkers of the namespace
//! suite ([`crate::faults::workloads`]) through the client SDK on simulated sockets too: both cache
//! readers, a fenced worker, two register workers and a keeper go through the proxy.
//!
//! Between steps a seeded nemesis injects one fault at a time: crash and restart of the
//! leader or a follower, leader isolation, a majority/minority split, a one-way cut, lost
//! datagrams, a slow leader, the leader's process paused (as by SIGSTOP, see below),
//! proxied clients cut off from their proxy, the
//! proxy crashed and restarted, and a follower replaced (removed, restarted empty under a
//! new id, added as a learner, caught up, promoted). When
//! the workloads' time is up every fault is healed and the cell must converge, exactly as
//! in the namespace suite.
//!
//! A seed replays: the same faults at the same simulated times, the same datagrams in the
//! same order and so the same history. What that takes, besides
//! turmoil's seeded network and host order: openraft's election timeouts fixed per replica
//! (drawn from the seed: a range one millisecond wide), the QUIC endpoints' randomness
//! and connection ids seeded ([`SimSockets`]), rustls' own randomness and QUIC's initial
//! destination ids seeded ([`wire::tls::fix_random`]), maps keyed from the seed
//! ([`wire::hash::fix_seed`]), tokio's runtime seed (turmoil sets it when built with
//! `--cfg tokio_unstable`, which `.cargo/config.toml` sets), certificates derived from the
//! seed (Ed25519: an ECDSA signature's length varies; fixed serials: a random one's
//! encoding does too), no wall clock in anything a reply carries, and no blocking-pool
//! thread on the path of a simulated replica. (An earlier `pause-leader`, which held the
//! leader's traffic and released it at once, sometimes parted ways from its replay in the
//! tick of the release: late Initial packets for connections a server had dropped were
//! unprotected with the wrong keys, and whether their garbage reserved bits passed was
//! decided by unseeded TLS randomness; `fix_random` seeds it.) `SIM_TRACE=1` prints every
//! datagram sent and received (simulated time, host, peer, length), which is how the
//! sources were found.
//!
//! Clocks run at different rates: turmoil gives every host the same clock, so each
//! replica and the proxy run a task that now and then moves their own (paused) tokio clock
//! on by an extra millisecond ([`skewed_clock`]); by default each runs fast against the client
//! host's by a seeded share up to 2 %, inside the 2.5 % the SDK allows for
//! ([`wire::CLOCK_DRIFT_PERMILLE_MAX`]).
//!
//! Process pauses: turmoil steps every running host's runtime each tick and has no way to
//! stop one, so each replica's and the proxy's software runs on a `LocalSet` of its own
//! ([`pausable`]) and every task they start goes there (`wire::rt`: our spawns, openraft's
//! runtime and quinn's). The nemesis pauses a host by no longer driving its set: nothing
//! of it runs, datagrams wait in its sockets, its timers are due but unserved, while its
//! clock goes on; on resume every missed deadline fires at once, in the order the set
//! polls them, as after SIGCONT.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use client_sdk::ClientConfig;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use replica::config::{Member, RaftConfig, ReplicaConfig, SessionConfig, TlsConfig};
use replica::raft::mem_log::MemLog;
use replica::server::Plumbing;
use wire::quic::Sockets;

use crate::faults::plan::{Fault, Plan, Verdict};

mod clients;
pub mod moves;
mod nemesis;
mod net;

use clients::clients;
use nemesis::nemesis;
pub use nemesis::SIM_FAULTS;
pub use net::SimSockets;

/// Replicas of the simulated cell.
pub const REPLICAS: usize = 5;
const PORT: u16 = 7100;
const CLIENTS: &str = "clients";
const PROXY: &str = "p1";
const PROXY_PORT: u16 = 7200;

/// One simulation run: a seed and how long the workloads run (simulated time).
#[derive(Debug, Clone)]
pub struct SimPlan {
    /// Seed of everything seeded (see the module documentation).
    pub seed: u64,
    /// How long the workloads run and faults are injected, in simulated time.
    pub time: Duration,
    /// The cell's session lease.
    pub lease_ms: u64,
    /// Clock rate skew: each replica's and the proxy's clock runs fast against the client
    /// host's by a share drawn from the seed between 0 and this (0.02: up to 2 % fast).
    /// The clients' SDK trusts its lease only while the cell's clock is at most
    /// [`wire::CLOCK_DRIFT_PERMILLE_MAX`] fast, so values above 0.025 leave that bound.
    pub skew: f64,
    /// A second cell and a directory instance, and the `move` fault ([`moves`]).
    pub moves: bool,
}

impl SimPlan {
    /// How fast each skewed host's clock runs against the client host's (0.013: 1.3 %
    /// fast), replicas `r1`..`r5` then the proxy: drawn from the seed.
    pub fn clock_rates(&self) -> Vec<(String, f64)> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x636c_6f63_6b73);
        let mut hosts: Vec<String> = (1..=REPLICAS).map(host).collect();
        hosts.push(PROXY.into());
        hosts
            .into_iter()
            .map(|h| (h, rng.gen_range(0.0..=self.skew)))
            .collect()
    }
}

/// Runs the current host's clock fast by `extra` (0.02: 2 % fast): it gains the host's
/// tokio clock (paused: turmoil moves it one tick per step) an extra millisecond about
/// every `1 ms / extra` of the host's own time, so every timer, lease and deadline on the
/// host comes that much sooner than the simulation's (and the client host's) time says.
/// Whole milliseconds: tokio's timers have millisecond resolution, and a clock off the
/// millisecond grid rounds every deadline up (a 0.2 ms step every 10 ms made a host run
/// 1.67 times fast instead of 1.02).
async fn skewed_clock(extra: f64) {
    if extra <= 0.0 {
        return;
    }
    // The jump happens at the start of one of turmoil's 1 ms steps, whose end the host
    // would have reached anyway: 2 ms gains 1 ms.
    let step = TICK + Duration::from_millis(1);
    // A cycle is `period` on both clocks, then the jump: `period + 2` ms on the host's
    // against `period + 1` on the simulation's, a rate of 1 + 1 / (period + 1).
    let period = Duration::from_millis(((1.0 / extra).round() as u64).saturating_sub(1).max(1));
    loop {
        tokio::time::sleep(period).await;
        tokio::time::advance(step).await;
    }
}

/// Runs a host's software on a `LocalSet` of its own (every task it spawns goes there, see
/// `wire::rt`), driven while `paused` is false. While it is true the software stands still
/// as under SIGSTOP: no task of it runs, its timers fire only when it runs again, datagrams
/// wait in its sockets' buffers, and its clock goes on (turmoil's, and the
/// [`skewed_clock`] task, which runs outside the set), so when it resumes every deadline
/// it missed is due at once. Crashing the host drops the set and its tasks.
pub async fn pausable(
    paused: Arc<AtomicBool>,
    software: impl Future<Output = turmoil::Result> + 'static,
) -> turmoil::Result {
    // A panic in any task of the host fails the run, as it does on turmoil's own set
    // (without this a LocalSet ignores it, and the host would run on half dead).
    #[allow(unused_mut)]
    let mut set = tokio::task::LocalSet::new();
    #[cfg(tokio_unstable)]
    set.unhandled_panic(tokio::runtime::UnhandledPanic::ShutdownRuntime);
    let main = set.spawn_local(software);
    loop {
        if paused.load(Ordering::SeqCst) {
            tokio::time::sleep(TICK).await;
            continue;
        }
        // One step's worth, then look at the switch again.
        set.run_until(tokio::time::sleep(TICK)).await;
        if main.is_finished() {
            return main.await.map_err(|e| format!("host software: {e}"))?;
        }
    }
}

/// The pause switch of every replica's host and the proxy's (see [`pausable`]).
#[derive(Debug, Default)]
struct Pauses(BTreeMap<String, Arc<AtomicBool>>);

impl Pauses {
    fn switch(&mut self, host: &str) -> Arc<AtomicBool> {
        self.0.entry(host.to_string()).or_default().clone()
    }
}

fn host(i: usize) -> String {
    format!("r{i}")
}

/// What the client host tells the nemesis: when the workloads end (simulated time since
/// the start) and which replica leads (from the replicas' status).
#[derive(Debug, Default)]
struct Shared {
    /// The history's time zero, in simulated time: faults are reported on its clock.
    history_zero: Duration,
    ends_at: Option<Duration>,
    leader: Option<usize>,
    verdict: Option<anyhow::Result<Verdict>>,
    /// A membership change for the client host to make (the `member` fault), and its
    /// outcome.
    admin: Option<Admin>,
    admin_result: Option<Result<(), String>>,
    /// A prefix move for the client host to make (the `move` fault), and its outcome
    /// (true: finished; false: stopped as asked).
    move_ask: Option<moves::MoveAsk>,
    move_result: Option<Result<bool, String>>,
}

/// A membership change the nemesis asks the client host to make.
#[derive(Debug, Clone)]
enum Admin {
    /// Remove replica `id` from the cell.
    Remove(u64),
    /// Add replica `id` at `addr` as a learner, wait until it caught up, promote it.
    Add { id: u64, addr: SocketAddr },
}

/// What a replica host runs when it (re)starts: the `member` fault gives it a new id,
/// an empty log and a fresh data directory.
#[derive(Debug, Clone)]
struct Slot {
    cfg: ReplicaConfig,
    log: MemLog,
}

/// Where a `member` (or `wipe`) fault stands.
#[derive(Debug, Clone, Copy)]
enum MemberStep {
    /// `wipe`: host `host` restarted as replica `old` with an empty store; its removal is
    /// asked for at `remove_at`.
    Wiped {
        host: usize,
        old: u64,
        remove_at: Duration,
    },
    /// Waiting for the removal of `old`, which runs on host `host`; `same_id`: it comes
    /// back under `old` (`wipe`), not under a new id (`member`).
    Removing {
        host: usize,
        old: u64,
        same_id: bool,
    },
    /// The host restarted as a new replica; waiting for it to be added and promoted.
    Adding,
}

/// A fault the nemesis injected and has not healed yet.
struct Active {
    fault: Fault,
    target: String,
    from: Duration,
    until: Duration,
    crashed: Option<String>,
    /// The switch of the host it paused, if any.
    paused: Option<Arc<AtomicBool>>,
    member: Option<MemberStep>,
}

const MAX_LATENCY: Duration = Duration::from_millis(5);

/// The store id of host `host`'s `generation`th store (0 at the start; a `member` or
/// `wipe` fault gives the host a new one): drawn from neither the clock nor the thread's
/// generator, so that a seed replays alike.
fn store_id(host: usize, generation: u64) -> wire::store::StoreId {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&(host as u64).to_be_bytes());
    b[8..].copy_from_slice(&generation.to_be_bytes());
    wire::store::StoreId(b)
}

/// turmoil's step: every host's clock moves on by this much per step.
const TICK: Duration = Duration::from_millis(1);

/// The members of a cell whose replicas, ids 1, 2, ..., are at `addrs`.
fn members(addrs: &[SocketAddr]) -> Vec<Member> {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| Member {
            id: i as u64 + 1,
            addr: a.to_string(),
        })
        .collect()
}

/// A simulated replica's configuration: replica `id` of `members`, advertised at `addr`,
/// its files in `tls`, its election timeout fixed at `election` ms (a range one
/// millisecond wide), the first one bootstrapping.
fn replica_config(
    id: u64,
    addr: SocketAddr,
    members: &[Member],
    data_dir: std::path::PathBuf,
    tls: &Path,
    election: u64,
    lease_ms: u64,
) -> anyhow::Result<ReplicaConfig> {
    let cfg = ReplicaConfig {
        id,
        // turmoil binds only the unspecified address; peers know the host's.
        listen: SocketAddr::from(([0, 0, 0, 0], PORT)),
        advertise: Some(addr.to_string()),
        data_dir,
        bootstrap: id == 1,
        members: members.to_vec(),
        tls: TlsConfig::replica_in_dir(tls),
        raft: RaftConfig {
            election_timeout_min_ms: election,
            election_timeout_max_ms: election + 1,
            ..RaftConfig::default()
        },
        session: SessionConfig {
            lease_ms,
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
    Ok(cfg)
}

/// Runs one seed: builds the simulated cell, runs the workloads under the nemesis, heals,
/// checks. Histories and `verdict.json` go to `out`.
pub fn run_seed(plan: &SimPlan, out: &Path) -> anyhow::Result<Verdict> {
    std::fs::create_dir_all(out)?;
    wire::hash::fix_seed(plan.seed);
    wire::tls::fix_random(plan.seed);
    let tls = out.join("tls");
    let dev_ca =
        wire::tls::DevCa::generate_ed25519_from_seed(plan.seed).map_err(anyhow::Error::msg)?;
    dev_ca.write_to(&tls)?;
    // Every task of replicas, proxy and clients goes to its host's LocalSet, so a host can
    // be paused (`pausable`).
    wire::rt::spawn_on_local_sets();
    let mut pauses = Pauses::default();
    let margin = Duration::from_secs(600);
    let mut sim = turmoil::Builder::new()
        .rng_seed(plan.seed)
        .simulation_duration(plan.time + margin)
        .tick_duration(TICK)
        .min_message_latency(Duration::from_micros(100))
        .max_message_latency(MAX_LATENCY)
        .udp_capacity(1 << 16)
        .enable_random_order()
        .build();

    let addrs: Vec<SocketAddr> = (1..=REPLICAS)
        .map(|i| SocketAddr::new(sim.lookup(host(i)), PORT))
        .collect();
    let members = members(&addrs);
    // openraft draws each election timeout from the operating system's randomness; a
    // range one millisecond wide makes it a constant, drawn here per replica from the seed
    // (distinct, so elections do not tie).
    let rates = plan.clock_rates();
    let mut slots = Vec::new();
    let mut timeouts: Vec<u64> = (0..10u64).map(|k| 500 + 50 * k).collect();
    timeouts.shuffle(&mut StdRng::seed_from_u64(plan.seed ^ 0x656c_6563));
    for i in 1..=REPLICAS {
        let cfg = replica_config(
            i as u64,
            addrs[i - 1],
            &members,
            out.join(format!("data-{i}")),
            &tls,
            timeouts[i - 1],
            plan.lease_ms,
        )?;
        let slot = Arc::new(Mutex::new(Slot {
            cfg,
            log: MemLog::with_store_id(store_id(i, 0)),
        }));
        slots.push(slot.clone());
        let seed = plan.seed;
        let starts = std::sync::atomic::AtomicU64::new(0);
        let extra = rates[i - 1].1;
        let paused = pauses.switch(&host(i));
        sim.host(host(i), move || {
            let Slot { cfg, log } = slot.lock().expect("slot").clone();
            // Each start of the host seeds its endpoint anew: a restarted replica must
            // not reuse its previous life's connection ids.
            let start = starts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let sockets = SimSockets::new(&host(i), seed ^ i as u64 ^ (start << 32));
            let plumbing = Plumbing {
                sockets: Sockets::Factory(Arc::new(sockets)),
                memory_log: Some(log),
            };
            let paused = paused.clone();
            async move {
                tokio::spawn(skewed_clock(extra));
                pausable(paused, async move {
                    replica::server::run_on(cfg, plumbing, std::future::pending())
                        .await
                        .map_err(|e| format!("replica: {e:#}").into())
                })
                .await
            }
        });
    }

    // One proxy in front of the cell; some of the workloads' clients go through it.
    let proxy_addr = SocketAddr::new(sim.lookup(PROXY), PROXY_PORT);
    {
        let mut cfg = proxy::config::ProxyConfig::new(
            SocketAddr::from(([0, 0, 0, 0], PROXY_PORT)),
            addrs.iter().map(|a| a.to_string()).collect(),
            TlsConfig::proxy_in_dir(&tls),
        );
        cfg.stats_interval_ms = 0;
        cfg.per_identity.identities.insert(
            wire::tls::DEV_CLIENT.into(),
            wire::quota::Limits::unlimited(),
        );
        let seed = plan.seed;
        let extra = rates[REPLICAS].1;
        let paused = pauses.switch(PROXY);
        let starts = std::sync::atomic::AtomicU64::new(0);
        sim.host(PROXY, move || {
            let cfg = cfg.clone();
            // Seeded anew at each start, as the replicas are: a restarted proxy must not
            // issue its previous life's connection ids (its stateless-reset key is the
            // same in every life, so an old id's reset could close a new connection).
            let start = starts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let sockets = Sockets::Factory(Arc::new(SimSockets::new(
                PROXY,
                seed ^ 0x7072_6f78 ^ (start << 32),
            )));
            let paused = paused.clone();
            async move {
                tokio::spawn(skewed_clock(extra));
                pausable(paused, async move {
                    proxy::server::run_on(cfg, sockets, std::future::pending())
                        .await
                        .map_err(|e| format!("proxy: {e:#}").into())
                })
                .await
            }
        });
    }

    let places = if plan.moves {
        Some(moves::add_hosts(
            &mut sim, plan, out, &tls, &dev_ca, &addrs,
        )?)
    } else {
        None
    };
    let shared = Arc::new(Mutex::new(Shared::default()));
    {
        let shared = shared.clone();
        let mut config = ClientConfig::new(
            addrs.iter().map(|a| a.to_string()).collect(),
            tls.join(wire::tls::CA_FILE),
        );
        config.sockets = Sockets::Factory(Arc::new(SimSockets::new(CLIENTS, plan.seed)));
        let mut proxied = config.clone();
        proxied.endpoints = vec![proxy_addr.to_string()];
        let suite_plan = Plan {
            time: plan.time,
            seed: plan.seed,
            lease_ms: plan.lease_ms,
            skew: 0.0,
            faults: SIM_FAULTS.to_vec(),
        };
        let out = out.to_path_buf();
        let replicas: Vec<(u64, SocketAddr)> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| (i as u64 + 1, *a))
            .collect();
        let places = places.clone();
        sim.client(CLIENTS, async move {
            let r = clients(
                config,
                proxied,
                suite_plan,
                replicas,
                places,
                &out,
                shared.clone(),
            )
            .await;
            shared.lock().expect("shared").verdict = Some(r);
            Ok(())
        });
    }

    let faults = nemesis(&mut sim, &mut pauses, plan, &shared, &slots, &addrs, out)?;
    let verdict = shared
        .lock()
        .expect("shared")
        .verdict
        .take()
        .ok_or_else(|| anyhow::anyhow!("the client host ended without a verdict"))?;
    let mut verdict = verdict?;
    verdict.faults = faults;
    std::fs::write(
        out.join("verdict.json"),
        serde_json::to_string_pretty(&verdict)?,
    )?;
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skewed_clock_runs_fast_by_the_share_asked() {
        let mut sim = turmoil::Builder::new()
            .tick_duration(TICK)
            .simulation_duration(Duration::from_secs(100))
            .build();
        let out = Arc::new(Mutex::new(Vec::new()));
        for (name, extra) in [("a", 0.0), ("b", 0.02), ("c", 0.004), ("d", 0.25)] {
            let out = out.clone();
            sim.client(name, async move {
                tokio::spawn(skewed_clock(extra));
                let sim_start = turmoil::sim_elapsed().expect("in a host");
                // Ten seconds by this host's clock...
                tokio::time::sleep(Duration::from_secs(10)).await;
                // ... took this long in the simulation.
                let sim = turmoil::sim_elapsed().expect("in a host") - sim_start;
                out.lock().expect("out").push((name, extra, sim));
                Ok(())
            });
        }
        sim.run().unwrap();
        let out = out.lock().unwrap();
        assert_eq!(out.len(), 4);
        for (name, extra, sim) in out.iter() {
            let rate = 10.0 / sim.as_secs_f64();
            assert!(
                (rate - (1.0 + extra)).abs() < 0.01 * (1.0 + extra),
                "host {name}: asked {extra}, ran {rate:.4} times as fast"
            );
        }
    }
}
