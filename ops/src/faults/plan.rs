//! What a fault-suite run is asked to do and what it found, shared by both tiers: the
//! kinds of [`Fault`], a run's [`Plan`], each fault as [`Injected`], and the [`Verdict`].

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
    /// Move a prefix to the other cell (`lockctl dir move`), half of the time stopped
    /// after a seeded step as a killed mover would be, to be finished by the next move.
    /// Simulation tier only, with `faultsuite sim --moves` (a second cell and a directory).
    Move,
    /// A follower's data lost: it restarts under its own id with an empty store, which
    /// the cell does not count (its membership binds the id to the store that was lost),
    /// and after a while it is replaced under the same id (removed, added back as a
    /// learner, caught up, promoted). Simulation tier only.
    Wipe,
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
    /// Prefix moves that finished (`faultsuite sim --moves`).
    #[serde(default)]
    pub moves: usize,
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
