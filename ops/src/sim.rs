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
//! suite ([`crate::suite`]) through the client SDK on simulated sockets too: both cache
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
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use client_sdk::{Client, ClientConfig};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use replica::config::{Member, RaftConfig, ReplicaConfig, SessionConfig, TlsConfig};
use replica::raft::mem_log::MemLog;
use replica::server::Plumbing;
use wire::quic::{SocketFactory, Sockets};
use wire::types::{Op as WireOp, Reply};

use crate::suite::{self, Fault, Injected, Plan, Verdict};

/// Replicas of the simulated cell.
pub const REPLICAS: usize = 5;
const PORT: u16 = 7100;
const CLIENTS: &str = "clients";
const PROXY: &str = "p1";
const PROXY_PORT: u16 = 7200;

/// Binds turmoil's simulated UDP sockets for QUIC endpoints; must be called from a task
/// of a turmoil host.
#[derive(Debug, Default)]
pub struct SimSockets {
    host: String,
    seed: u64,
    endpoints: std::sync::atomic::AtomicU64,
}

impl SimSockets {
    /// A factory whose endpoints' QUIC randomness comes from `seed` (and the order in
    /// which they are made).
    pub fn new(host: &str, seed: u64) -> SimSockets {
        SimSockets {
            host: host.into(),
            seed,
            endpoints: Default::default(),
        }
    }
}

/// Connection ids from a seeded generator (quinn's default draws them from the operating
/// system).
struct SeededCids(StdRng);

impl quinn::ConnectionIdGenerator for SeededCids {
    fn generate_cid(&mut self) -> quinn::ConnectionId {
        let mut b = [0u8; 8];
        self.0.fill(&mut b);
        quinn::ConnectionId::new(&b)
    }

    fn cid_len(&self) -> usize {
        8
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

impl SocketFactory for SimSockets {
    fn configure(&self, config: &mut quinn::EndpointConfig) {
        let n = self
            .endpoints
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut seed = [0u8; 32];
        StdRng::seed_from_u64(base).fill(&mut seed);
        config.rng_seed(Some(seed));
        let cids = std::sync::atomic::AtomicU64::new(0);
        config.cid_generator(move || {
            let k = cids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::new(SeededCids(StdRng::seed_from_u64(base ^ k ^ 0x6369_6473)))
        });
    }

    fn bind(&self, addr: SocketAddr) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        // turmoil's bind is `async` but completes at once (it only touches the simulated
        // world), so one poll finishes it.
        let mut bind = std::pin::pin!(turmoil::net::UdpSocket::bind(addr));
        let sock = match bind
            .as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
        {
            Poll::Ready(r) => r?,
            Poll::Pending => return Err(io::Error::other("simulated bind did not complete")),
        };
        let local = sock.local_addr()?;
        let sock = Arc::new(sock);
        // turmoil offers `recv_from` as a future only; a task turns it into a channel that
        // quinn's `poll_recv` can poll.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let reader = sock.clone();
        let host = self.host.clone();
        let task = wire::rt::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            while let Ok((n, from)) = reader.recv_from(&mut buf).await {
                if trace_datagrams() {
                    eprintln!(
                        "TRACE {:?} {host}:{} <- {from} {n}",
                        turmoil::elapsed(),
                        local.port()
                    );
                }
                if tx.send((buf[..n].to_vec(), from)).is_err() {
                    break;
                }
            }
        });
        Ok(Arc::new(SimUdp {
            host: self.host.clone(),
            sock,
            local,
            rx: Mutex::new(rx),
            reader: task.abort_handle(),
        }))
    }
}

type Datagram = (Vec<u8>, SocketAddr);

/// `SIM_TRACE=1`: print every datagram a simulated socket receives (simulated time,
/// receiver, sender, length), to find where two runs of one seed part ways.
fn trace_datagrams() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SIM_TRACE").is_some())
}

/// A turmoil UDP socket as quinn sees it.
#[derive(Debug)]
struct SimUdp {
    host: String,
    sock: Arc<turmoil::net::UdpSocket>,
    local: SocketAddr,
    rx: Mutex<tokio::sync::mpsc::UnboundedReceiver<Datagram>>,
    reader: tokio::task::AbortHandle,
}

impl Drop for SimUdp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Simulated sends never block.
#[derive(Debug)]
struct AlwaysWritable;

impl UdpPoller for AlwaysWritable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncUdpSocket for SimUdp {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(AlwaysWritable)
    }

    fn try_send(&self, t: &Transmit) -> io::Result<()> {
        if trace_datagrams() {
            eprintln!(
                "TRACE {:?} {}:{} -> {} {}",
                turmoil::elapsed(),
                self.host,
                self.local.port(),
                t.destination,
                t.contents.len()
            );
        }
        match t.segment_size {
            Some(seg) if seg > 0 => {
                for chunk in t.contents.chunks(seg) {
                    self.sock.try_send_to(chunk, t.destination)?;
                }
            }
            _ => {
                self.sock.try_send_to(t.contents, t.destination)?;
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let room = bufs.len().min(meta.len());
        let mut n = 0;
        while n < room {
            let (data, from) = if n == 0 {
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(d)) => d,
                    Poll::Ready(None) => {
                        return Poll::Ready(Err(io::Error::other("simulated socket closed")))
                    }
                    Poll::Pending => return Poll::Pending,
                }
            } else {
                match rx.try_recv() {
                    Ok(d) => d,
                    Err(_) => break,
                }
            };
            let len = data.len().min(bufs[n].len());
            bufs[n][..len].copy_from_slice(&data[..len]);
            meta[n] = RecvMeta {
                addr: from,
                len,
                stride: len,
                ..RecvMeta::default()
            };
            n += 1;
        }
        Poll::Ready(Ok(n))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    fn may_fragment(&self) -> bool {
        false
    }
}

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

/// Where a `member` fault stands.
#[derive(Debug, Clone, Copy)]
enum MemberStep {
    /// Waiting for the removal of `old`, which runs on host `host`.
    Removing { host: usize, old: u64 },
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

/// The faults the simulation injects: the namespace tier's and the proxy's crash.
pub const SIM_FAULTS: [Fault; 11] = [
    Fault::KillProxy,
    Fault::KillLeader,
    Fault::KillFollower,
    Fault::PauseLeader,
    Fault::IsolateLeader,
    Fault::Split,
    Fault::OneWay,
    Fault::Loss,
    Fault::Slow,
    Fault::ClientCut,
    Fault::Member,
];

/// Every host of the simulation.
fn all_hosts() -> Vec<String> {
    let mut v: Vec<String> = (1..=REPLICAS).map(host).collect();
    v.push(PROXY.into());
    v.push(CLIENTS.into());
    v
}

/// Undoes every network fault: repairs and releases every link, no loss, normal latency.
fn heal_network(sim: &mut turmoil::Sim<'_>) {
    let hosts = all_hosts();
    for a in &hosts {
        for b in &hosts {
            if a < b {
                sim.repair(a.as_str(), b.as_str());
                sim.release(a.as_str(), b.as_str());
                sim.set_link_fail_rate(a.as_str(), b.as_str(), 0.0);
                sim.set_link_max_message_latency(a.as_str(), b.as_str(), MAX_LATENCY);
            }
        }
    }
}

const MAX_LATENCY: Duration = Duration::from_millis(5);

/// turmoil's step: every host's clock moves on by this much per step.
const TICK: Duration = Duration::from_millis(1);

/// Injects `fault`; returns what it hit and the host it crashed, if any.
fn inject(
    sim: &mut turmoil::Sim<'_>,
    pauses: &mut Pauses,
    fault: Fault,
    leader: Option<usize>,
    rng: &mut StdRng,
) -> (String, Option<String>, Option<Arc<AtomicBool>>) {
    let leader = leader.unwrap_or_else(|| rng.gen_range(1..=REPLICAS));
    let follower = {
        let others: Vec<usize> = (1..=REPLICAS).filter(|i| *i != leader).collect();
        *others.choose(rng).expect("four followers")
    };
    let replicas: Vec<String> = (1..=REPLICAS).map(host).collect();
    let (target, crashed) = match fault {
        Fault::KillLeader | Fault::KillFollower => {
            let h = host(if fault == Fault::KillLeader {
                leader
            } else {
                follower
            });
            sim.crash(h.as_str());
            (h.clone(), Some(h))
        }
        Fault::PauseLeader => {
            // The leader's whole process stops (its traffic is not touched: the others'
            // datagrams wait in its sockets, as in a stopped process's socket buffers).
            let h = host(leader);
            let switch = pauses.switch(&h);
            switch.store(true, Ordering::SeqCst);
            return (h, None, Some(switch));
        }
        Fault::IsolateLeader => {
            let h = host(leader);
            for other in all_hosts().iter().filter(|o| **o != h) {
                sim.partition(h.as_str(), other.as_str());
            }
            (h, None)
        }
        Fault::Split => {
            let mut order = replicas.clone();
            order.shuffle(rng);
            let (minority, majority) = order.split_at(2);
            for a in minority {
                for b in majority {
                    sim.partition(a.as_str(), b.as_str());
                }
            }
            (format!("{minority:?} | {majority:?}"), None)
        }
        Fault::OneWay => {
            let (a, b) = (host(leader), host(follower));
            sim.partition_oneway(a.as_str(), b.as_str());
            (format!("{a} -> {b}"), None)
        }
        Fault::Loss => {
            let rate = rng.gen_range(0.05..0.3);
            for a in &replicas {
                for b in all_hosts().iter().filter(|b| *b != a) {
                    sim.set_link_fail_rate(a.as_str(), b.as_str(), rate);
                }
            }
            (format!("{:.0} % of datagrams", rate * 100.0), None)
        }
        Fault::Slow => {
            // The leader's links: each datagram takes up to 100–400 ms, above openraft's
            // 150 ms RPC timeout, for a lease and a half (see `nemesis`).
            let h = host(leader);
            let ms = rng.gen_range(100..400);
            for other in all_hosts().iter().filter(|o| **o != h) {
                sim.set_link_max_message_latency(
                    h.as_str(),
                    other.as_str(),
                    Duration::from_millis(ms),
                );
            }
            (format!("{h} up to {ms} ms per datagram"), None)
        }
        Fault::ClientCut => {
            // The proxied clients (both cache readers among them) lose their proxy, which
            // stays connected to the cell: writes to what they cache must wait for their
            // leases, while their caches keep answering.
            sim.partition(CLIENTS, PROXY);
            (format!("{CLIENTS} | {PROXY}"), None)
        }
        Fault::KillProxy => {
            sim.crash(PROXY);
            (PROXY.into(), Some(PROXY.into()))
        }
        Fault::Member => unreachable!("a membership change is driven by `nemesis`"),
    };
    (target, crashed, None)
}

/// Runs one seed: builds the simulated cell, runs the workloads under the nemesis, heals,
/// checks. Histories and `verdict.json` go to `out`.
pub fn run_seed(plan: &SimPlan, out: &Path) -> anyhow::Result<Verdict> {
    std::fs::create_dir_all(out)?;
    wire::hash::fix_seed(plan.seed);
    wire::tls::fix_random(plan.seed);
    let tls = out.join("tls");
    wire::tls::DevCa::generate_ed25519_from_seed(plan.seed)
        .map_err(anyhow::Error::msg)?
        .write_to(&tls)?;
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
    let members: Vec<Member> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| Member {
            id: i as u64 + 1,
            addr: a.to_string(),
        })
        .collect();
    // openraft draws each election timeout from the operating system's randomness; a
    // range one millisecond wide makes it a constant, drawn here per replica from the seed
    // (distinct, so elections do not tie).
    let rates = plan.clock_rates();
    let mut slots = Vec::new();
    let mut timeouts: Vec<u64> = (0..10u64).map(|k| 500 + 50 * k).collect();
    timeouts.shuffle(&mut StdRng::seed_from_u64(plan.seed ^ 0x656c_6563));
    for i in 1..=REPLICAS {
        let election = timeouts[i - 1];
        let cfg = ReplicaConfig {
            id: i as u64,
            // turmoil binds only the unspecified address; peers know the host's.
            listen: SocketAddr::from(([0, 0, 0, 0], PORT)),
            advertise: Some(addrs[i - 1].to_string()),
            data_dir: out.join(format!("data-{i}")),
            bootstrap: i == 1,
            members: members.clone(),
            tls: TlsConfig::in_dir(&tls),
            raft: RaftConfig {
                election_timeout_min_ms: election,
                election_timeout_max_ms: election + 1,
                ..RaftConfig::default()
            },
            session: SessionConfig {
                lease_ms: plan.lease_ms,
                ..SessionConfig::default()
            },
            request_timeout_ms: 5_000,
            limits: Default::default(),
            faults: Default::default(),
        };
        cfg.validate()?;
        let slot = Arc::new(Mutex::new(Slot {
            cfg,
            log: MemLog::new(),
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
            TlsConfig::in_dir(&tls),
        );
        cfg.stats_interval_ms = 0;
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
        sim.client(CLIENTS, async move {
            let r = clients(config, proxied, suite_plan, replicas, &out, shared.clone()).await;
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

/// The step loop with the nemesis between steps; returns the faults injected.
fn nemesis(
    sim: &mut turmoil::Sim<'_>,
    pauses: &mut Pauses,
    plan: &SimPlan,
    shared: &Mutex<Shared>,
    slots: &[Arc<Mutex<Slot>>],
    addrs: &[SocketAddr],
    out: &Path,
) -> anyhow::Result<Vec<Injected>> {
    let mut next_id = REPLICAS as u64 + 1;
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x6e656d65_73697300);
    let mut log = Vec::new();
    let mut active: Option<Active> = None;
    let mut next_at: Option<Duration> = None;
    let mut bag: Vec<Fault> = Vec::new();
    let mut healed = false;
    loop {
        let finished = sim.step().map_err(|e| anyhow::anyhow!("simulation: {e}"))?;
        if finished {
            break;
        }
        let now = sim.elapsed();
        let (ends_at, leader, zero) = {
            let s = shared.lock().expect("shared");
            (s.ends_at, s.leader, s.history_zero)
        };
        let Some(ends_at) = ends_at else { continue };
        if healed {
            continue;
        }
        if now >= ends_at {
            if let Some(a) = active.take() {
                let error = a.member.map(|m| format!("unfinished at the end: {m:?}"));
                log.push(heal(sim, a, now, zero, error));
            }
            heal_network(sim);
            healed = true;
            continue;
        }
        if let Some(a) = &mut active {
            let mut done: Option<Option<String>> = None;
            if let Some(step) = a.member {
                let result = shared.lock().expect("shared").admin_result.take();
                match (step, result) {
                    (MemberStep::Removing { host: h, old }, Some(Ok(()))) => {
                        // Removed: the host starts again as a new, empty replica.
                        let new = next_id;
                        next_id += 1;
                        sim.crash(host(h).as_str());
                        {
                            let mut slot = slots[h - 1].lock().expect("slot");
                            slot.cfg.id = new;
                            slot.cfg.bootstrap = false;
                            slot.cfg.data_dir = out.join(format!("data-{new}"));
                            slot.log = MemLog::new();
                        }
                        sim.bounce(host(h).as_str());
                        a.target = format!("{}: replica {old} replaced by {new}", host(h));
                        a.member = Some(MemberStep::Adding);
                        shared.lock().expect("shared").admin = Some(Admin::Add {
                            id: new,
                            addr: addrs[h - 1],
                        });
                    }
                    (MemberStep::Adding, Some(Ok(()))) => done = Some(None),
                    (_, Some(Err(e))) => done = Some(Some(e)),
                    (_, None) if now >= a.until => {
                        done = Some(Some(format!("timed out: {step:?}")));
                    }
                    (_, None) => {}
                }
            } else if now >= a.until {
                done = Some(None);
            }
            if let Some(error) = done {
                let a = active.take().expect("active");
                log.push(heal(sim, a, now, zero, error));
                next_at = Some(now + Duration::from_millis(rng.gen_range(1_000..3_000)));
            }
            continue;
        }
        let due = *next_at.get_or_insert(now + Duration::from_secs(2));
        let hold = Duration::from_millis(rng.gen_range(1_000..6_000));
        if now < due || now + hold + Duration::from_secs(1) >= ends_at {
            continue;
        }
        if bag.is_empty() {
            // Rounds of every kind in a seeded order. The first round of seed `s` opens
            // with kinds 3s, 3s+1 and 3s+2 (mod 11, in a seeded order), so any four
            // consecutive seeds open with every kind between them.
            bag = SIM_FAULTS.to_vec();
            bag.shuffle(&mut rng);
            if log.is_empty() {
                let n = SIM_FAULTS.len() as u64;
                let front: Vec<Fault> = (0..3)
                    .map(|j| SIM_FAULTS[((3 * plan.seed + j) % n) as usize])
                    .collect();
                // `pop` takes from the end: the front kinds go last.
                bag.sort_by_key(|f| front.contains(f));
            }
        }
        let fault = bag.pop().expect("refilled");
        let hold = match fault {
            Fault::Slow => hold.max(Duration::from_millis(plan.lease_ms * 3 / 2)),
            // The longest a membership change may take.
            Fault::Member => Duration::from_secs(15),
            // Short enough that the proxied clients' sessions outlive it: they renew
            // every third of a lease, through the proxy's once-a-second batch, so a cut
            // longer than about half a lease costs a proxied keeper its session (the
            // namespace tier's `client-cut` silences the cache readers only).
            Fault::KillProxy | Fault::ClientCut => {
                Duration::from_millis(rng.gen_range(300..=plan.lease_ms / 4))
            }
            _ => hold,
        };
        if now + hold + Duration::from_secs(1) >= ends_at {
            // Too long for the time left: try another kind first.
            bag.insert(0, fault);
            continue;
        }
        if fault == Fault::Member {
            // A follower's replica is removed; `Removing` then restarts its host as a
            // new replica, which is added as a learner, caught up and promoted.
            let Some(l) = leader else {
                bag.insert(0, fault);
                continue;
            };
            let followers: Vec<usize> = (1..=REPLICAS).filter(|h| *h != l).collect();
            let h = *followers.choose(&mut rng).expect("four followers");
            let old = slots[h - 1].lock().expect("slot").cfg.id;
            shared.lock().expect("shared").admin = Some(Admin::Remove(old));
            active = Some(Active {
                fault,
                target: format!("{}: replica {old}", host(h)),
                from: now,
                until: now + hold,
                crashed: None,
                paused: None,
                member: Some(MemberStep::Removing { host: h, old }),
            });
            continue;
        }

        let (target, crashed, paused) = inject(sim, pauses, fault, leader, &mut rng);
        active = Some(Active {
            fault,
            target,
            from: now,
            until: now + hold,
            crashed,
            paused,
            member: None,
        });
    }
    Ok(log)
}

/// Heals one fault: restarts the host it crashed, undoes what it did to the network.
fn heal(
    sim: &mut turmoil::Sim<'_>,
    a: Active,
    now: Duration,
    zero: Duration,
    error: Option<String>,
) -> Injected {
    if let Some(h) = &a.crashed {
        sim.bounce(h.as_str());
    }
    if let Some(p) = &a.paused {
        p.store(false, Ordering::SeqCst);
    }
    heal_network(sim);
    Injected {
        at_ms: a.from.saturating_sub(zero).as_millis() as u64,
        fault: a.fault,
        target: a.target,
        held_ms: (now - a.from).as_millis() as u64,
        error,
    }
}

/// The client host: waits for a leader, runs the workloads until the plan's time is up,
/// then checks what they recorded. Meanwhile it tells the nemesis who leads.
async fn clients(
    config: ClientConfig,
    proxied: ClientConfig,
    plan: Plan,
    replicas: Vec<(u64, SocketAddr)>,
    out: &Path,
    shared: Arc<Mutex<Shared>>,
) -> anyhow::Result<Verdict> {
    let client = Client::connect(config.clone()).await?;
    let admin = wire::rt::spawn(admin_loop(client.clone(), replicas.clone(), shared.clone()));
    let watch = wire::rt::spawn(watch_leader(
        client.clone(),
        replicas.clone(),
        shared.clone(),
    ));
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let workloads =
        suite::start_workloads(&client, &config, Some(&proxied), &plan, &mut rng).await?;
    {
        // The client host's clock is the simulation's (never skewed).
        let mut s = shared.lock().expect("shared");
        s.history_zero = turmoil::elapsed().saturating_sub(workloads.started().elapsed());
        s.ends_at = Some(turmoil::elapsed() + plan.time);
    }
    tokio::time::sleep_until(workloads.deadline()).await;
    // The nemesis heals everything when the time is up; give it a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let verdict = Verdict {
        seed: plan.seed,
        secs: plan.time.as_secs(),
        ..Verdict::default()
    };
    // The proxy keeps a session of its own for as long as it runs.
    let r = suite::finish_workloads(workloads, &client, &replicas, 1, &plan, verdict, out).await;
    watch.abort();
    admin.abort();
    r
}

/// Makes the membership changes the nemesis asks for ([`Admin`]), one at a time, and
/// reports each outcome in [`Shared::admin_result`].
async fn admin_loop(client: Client, replicas: Vec<(u64, SocketAddr)>, shared: Arc<Mutex<Shared>>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(op) = shared.lock().expect("shared").admin.take() else {
            continue;
        };
        let r = match op {
            Admin::Remove(id) => membership(&client, WireOp::RemoveMember { id }).await,
            Admin::Add { id, addr } => add_and_promote(&client, &replicas, id, addr).await,
        };
        shared.lock().expect("shared").admin_result = Some(r);
    }
}

/// One membership request, retried for up to 10 s.
async fn membership(client: &Client, op: WireOp) -> Result<(), String> {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match client.request(op.clone()).await {
            Ok(Reply::MembershipChanged { .. }) => return Ok(()),
            Ok(other) => return Err(format!("{op:?}: unexpected reply {other:?}")),
            Err(e) if tokio::time::Instant::now() >= until => return Err(format!("{op:?}: {e}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// Adds replica `id` as a learner, waits (up to 10 s) until it applied what the others
/// had, and promotes it.
async fn add_and_promote(
    client: &Client,
    replicas: &[(u64, SocketAddr)],
    id: u64,
    addr: SocketAddr,
) -> Result<(), String> {
    membership(
        client,
        WireOp::AddLearner {
            id,
            addr: addr.to_string(),
        },
    )
    .await?;
    let mut target = 0;
    for (_, a) in replicas.iter().filter(|(_, a)| *a != addr) {
        if let Ok(Ok(st)) =
            tokio::time::timeout(Duration::from_millis(500), client.status_of(*a)).await
        {
            target = target.max(st.last_applied);
        }
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Ok(st)) =
            tokio::time::timeout(Duration::from_millis(500), client.status_of(addr)).await
        {
            if st.last_applied >= target {
                break;
            }
        }
        if tokio::time::Instant::now() >= until {
            return Err(format!(
                "replica {id} did not catch up to {target} within 10 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    membership(client, WireOp::Promote { id }).await
}

/// Keeps [`Shared::leader`] current: the replica that says it leads with the highest term.
async fn watch_leader(
    client: Client,
    replicas: Vec<(u64, SocketAddr)>,
    shared: Arc<Mutex<Shared>>,
) {
    loop {
        let mut best: Option<(u64, usize)> = None;
        for (i, (_, addr)) in replicas.iter().enumerate() {
            if let Ok(Ok(st)) =
                tokio::time::timeout(Duration::from_millis(500), client.status_of(*addr)).await
            {
                if st.role == "Leader" && best.is_none_or(|(t, _)| st.term > t) {
                    best = Some((st.term, i + 1));
                }
            }
        }
        if let Some((_, l)) = best {
            shared.lock().expect("shared").leader = Some(l);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
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
