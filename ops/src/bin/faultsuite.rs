//! `faultsuite`: the fault-injection suite on real replica processes in network
//! namespaces. See `ops::faults` and docs/testing.md.
//!
//! ```text
//! faultsuite --time 10m            # ten minutes of faults, a random seed
//! faultsuite --time 60s --seed 7   # the nemesis schedule of seed 7 again
//! ```
//!
//! Exit status: 0 when every checker passed, 1 when one found a violation (or the run
//! broke), 77 when the suite cannot run here (not root, tools missing), 130 when
//! interrupted (Ctrl-C, SIGTERM: the namespaces and replicas are cleaned up first).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use ops::faults::netns::{self, Hosts};
use ops::faults::plan::{faketime_library, Fault, Plan, Verdict};
use ops::faults::{checkers, real, sim, workloads};

/// Run the lock service's fault suite: five replica processes in network namespaces, a
/// seeded nemesis, fenced-lock / register / session / watch workloads and their checkers.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// How long to inject faults (e.g. 90s, 10m, 1h).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    time: Duration,
    /// Seed of the nemesis' schedule and the workloads' choices (default: from the clock;
    /// printed, so a run can be repeated).
    #[arg(long)]
    seed: Option<u64>,
    /// Where histories, logs and verdict.json go (default: target/faultsuite/seed-<seed>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The cell's session lease in milliseconds.
    #[arg(long, default_value_t = 6_000, value_parser = clap::value_parser!(u64).range(2_000..=60_000))]
    lease_ms: u64,
    /// Clock rate skew of hosts 4 and 5 under libfaketime (0.02: 2 % fast and 2 % slow);
    /// 0 turns it off. Turned off with a warning when libfaketime is not installed.
    #[arg(long, default_value_t = 0.02, value_parser = parse_skew)]
    skew: f64,
    /// The faults to draw from (comma-separated; default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<Fault>,
    #[command(subcommand)]
    command: Option<Hidden>,
}

#[derive(Subcommand, Debug)]
enum Hidden {
    /// Check a recorded history again (history.jsonl of a run): fenced lock and register.
    Check {
        /// The history (JSON lines).
        history: PathBuf,
    },
    /// Run the simulation tier: the whole cell in this process on turmoil's simulated
    /// network and clock, one run per seed (no root needed).
    Sim {
        /// How many seeds to run, from `--seed` up.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        seeds: u64,
        /// The first seed (default: from the clock; printed, so a run can be repeated).
        #[arg(long)]
        seed: Option<u64>,
        /// Simulated time per seed of workloads under faults (e.g. 30s, 2m).
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        time: Duration,
        /// The cell's session lease in milliseconds.
        #[arg(long, default_value_t = 6_000, value_parser = clap::value_parser!(u64).range(2_000..=60_000))]
        lease_ms: u64,
        /// Clock rate skew: each replica's and the proxy's clock runs fast against the
        /// clients' by a share drawn from the seed up to this (0.02: up to 2 % fast; the
        /// SDK's lease allows for 2.5 %). 0 turns it off.
        #[arg(long, default_value_t = 0.02, value_parser = parse_skew)]
        skew: f64,
        /// Where each seed's histories and verdict.json go (default: target/faultsuite/sim).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Add a second cell and a directory instance, and let the nemesis move a prefix
        /// between the cells (the `move` fault), with its workloads and checks.
        #[arg(long)]
        moves: bool,
    },
    /// (internal) The clients and the nemesis, run inside the client host.
    #[command(hide = true)]
    Inside {
        #[arg(long)]
        prefix: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// (internal) One replica.
    #[command(hide = true)]
    Replica {
        #[arg(long)]
        config: PathBuf,
    },
}

/// Log lines' time: inside the simulation, the simulated time (and the logging host's own
/// clock, which runs fast when skewed; add `turmoil=info` to `RUST_LOG` for the host's
/// name); elsewhere the wall clock.
struct LogTime;

impl tracing_subscriber::fmt::time::FormatTime for LogTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match turmoil::sim_elapsed() {
            Some(sim) => write!(
                w,
                "sim {:>10.6}s host {:>10.6}s",
                sim.as_secs_f64(),
                turmoil::elapsed().as_secs_f64()
            ),
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The simulation runs every replica in this process, and its faults make openraft and
    // the replicas log a warning per lost RPC: quiet unless RUST_LOG asks.
    let default_filter = match cli.command {
        Some(Hidden::Sim { .. }) => "off",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_timer(LogTime)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    let r = match &cli.command {
        Some(Hidden::Replica { config }) => replica::config::ReplicaConfig::load(Some(config))
            .and_then(replica::server::run_until_signal)
            .map(|_| ExitCode::SUCCESS),
        Some(Hidden::Inside { prefix, out }) => inside(prefix, out),
        Some(Hidden::Check { history }) => check(history),
        Some(Hidden::Sim {
            seeds,
            seed,
            time,
            lease_ms,
            skew,
            out,
            moves,
        }) => sim(*seeds, *seed, *time, *lease_ms, *skew, out.clone(), *moves),
        None => outer(cli),
    };
    r.unwrap_or_else(|e| {
        eprintln!("faultsuite: error: {e:#}");
        ExitCode::FAILURE
    })
}

fn check(history: &Path) -> anyhow::Result<ExitCode> {
    let events = checkers::read_history(std::fs::File::open(history)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", history.display()))?;
    let mut ok = true;
    match checkers::check_fenced_lock(&events) {
        Ok(s) => println!(
            "fenced lock: ok ({} grants, {} writes accepted, {} refused, {} lease-only acts)",
            s.grants, s.accepted, s.refused, s.acts
        ),
        Err(e) => {
            ok = false;
            println!("fenced lock: VIOLATION {e}");
        }
    }
    match checkers::check_register(&events, workloads::MAX_OPS_PER_KEY) {
        Ok(n) => println!("register: ok ({n} operations linearizable)"),
        Err(e) => {
            ok = false;
            println!("register: VIOLATION {e}");
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One line of what a run did and checked.
fn summary(v: &Verdict) -> String {
    format!(
        "{} faults{}; {} grants, {} fenced writes accepted, {} refused as stale; {} register ops \
         linearizable; {} sessions kept, {} abandoned; {} watches checked",
        v.faults.len(),
        if v.moves > 0 {
            format!(" ({} prefix moves finished)", v.moves)
        } else {
            String::new()
        },
        v.grants,
        v.fenced_accepted,
        v.fenced_refused,
        v.register_ops,
        v.sessions_kept,
        v.sessions_abandoned,
        v.watches_checked
    )
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64 % 1_000_000)
        .unwrap_or(1)
}

/// A seed's clock rates, for a report: "r1 +1.3 %, r2 +0.2 %, ...".
fn rates(plan: &sim::SimPlan) -> String {
    plan.clock_rates()
        .iter()
        .map(|(h, x)| format!("{h} +{:.1} %", x * 100.0))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A clock rate skew in [0, 0.5) (a share: 0.02 is 2 %).
fn parse_skew(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if (0.0..0.5).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is outside [0, 0.5) (0.02 means 2 %)"))
    }
}

fn sim(
    seeds: u64,
    seed: Option<u64>,
    time: Duration,
    lease_ms: u64,
    skew: f64,
    out: Option<PathBuf>,
    moves: bool,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        time >= Duration::from_secs(5) && time <= Duration::from_secs(3_600),
        "--time must be between 5s and 1h of simulated time"
    );
    let first = seed.unwrap_or_else(clock_seed);
    let out = out.unwrap_or_else(|| PathBuf::from("target/faultsuite/sim"));
    let mut failed = Vec::new();
    let started = Instant::now();
    for s in first..first.saturating_add(seeds) {
        let dir = out.join(format!("seed-{s}"));
        let _ = std::fs::remove_dir_all(&dir);
        let plan = sim::SimPlan {
            seed: s,
            time,
            lease_ms,
            skew,
            moves,
        };
        let t = Instant::now();
        let replay = format!(
            "faultsuite sim --seed {s} --time {} --lease-ms {lease_ms} --skew {skew}{}",
            humantime::format_duration(time),
            if moves { " --moves" } else { "" }
        );
        match sim::run_seed(&plan, &dir) {
            Ok(v) if v.passed() => {
                println!(
                    "faultsuite sim: seed {s}: PASS in {:.1} s: {}",
                    t.elapsed().as_secs_f64(),
                    summary(&v)
                );
                let _ = std::fs::remove_dir_all(dir.join("tls"));
            }
            Ok(v) => {
                for x in &v.violations {
                    println!("faultsuite sim: seed {s}: VIOLATION {x}");
                }
                println!(
                    "faultsuite sim: seed {s}: FAIL; output in {}; clocks: {}; replay: \
                     {replay}",
                    dir.display(),
                    rates(&plan)
                );
                failed.push(s);
            }
            Err(e) => {
                println!(
                    "faultsuite sim: seed {s}: the run broke: {e:#}; output in {}; clocks: \
                     {}; replay: {replay}",
                    dir.display(),
                    rates(&plan)
                );
                failed.push(s);
            }
        }
    }
    println!(
        "faultsuite sim: {} of {seeds} seeds passed ({first}..{}) in {:.0} s",
        seeds - failed.len() as u64,
        first.saturating_add(seeds),
        started.elapsed().as_secs_f64()
    );
    Ok(if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        println!("faultsuite sim: failed seeds: {failed:?}");
        ExitCode::FAILURE
    })
}

fn inside(prefix: &str, out: &Path) -> anyhow::Result<ExitCode> {
    let plan: Plan = serde_json::from_slice(&std::fs::read(out.join("plan.json"))?)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let v = rt.block_on(real::run_inside(plan, prefix, out))?;
    Ok(if v.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn outer(cli: Cli) -> anyhow::Result<ExitCode> {
    if let Some(reason) = netns::unavailable() {
        eprintln!("faultsuite: skipped: {reason}");
        return Ok(ExitCode::from(77));
    }
    let seed = cli.seed.unwrap_or_else(clock_seed);
    let mut skew = cli.skew;
    anyhow::ensure!(
        !cli.faults.contains(&Fault::KillProxy),
        "kill-proxy runs only in the simulation tier (faultsuite sim): this tier runs no proxy"
    );
    anyhow::ensure!(
        !cli.faults.contains(&Fault::Wipe),
        "wipe runs only in the simulation tier (faultsuite sim)"
    );
    anyhow::ensure!(
        !cli.faults.contains(&Fault::Move),
        "move runs only in the simulation tier (faultsuite sim --moves): this tier runs one cell"
    );
    if skew > 0.0 && faketime_library().is_none() {
        eprintln!("faultsuite: libfaketime not found (apt-get install -y faketime): no clock skew");
        skew = 0.0;
    }
    let plan = Plan {
        time: cli.time,
        seed,
        lease_ms: cli.lease_ms,
        skew,
        faults: if cli.faults.is_empty() {
            Fault::ALL.to_vec()
        } else {
            cli.faults.clone()
        },
    };
    let out = cli
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("target/faultsuite/seed-{seed}")));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let out = std::fs::canonicalize(&out)?;
    wire::tls::DevCa::generate()
        .map_err(anyhow::Error::msg)?
        .write_to(&out.join("tls"))?;
    std::fs::write(out.join("plan.json"), serde_json::to_vec_pretty(&plan)?)?;
    eprintln!(
        "faultsuite: seed {seed}, {} of faults ({:?}), lease {} ms, clock skew ±{:.0} %; \
         output in {}",
        humantime::format_duration(plan.time),
        plan.faults,
        plan.lease_ms,
        skew * 100.0,
        out.display()
    );
    let prefix = format!("fs{}", std::process::id());
    let hosts = Hosts::up(&prefix, real::CLIENT_HOST).map_err(anyhow::Error::msg)?;
    let mut child = hosts
        .command(real::CLIENT_HOST, std::env::current_exe()?)
        .args(["inside", "--prefix", &prefix, "--out"])
        .arg(&out)
        .spawn()?;
    // Ctrl-C or SIGTERM: stop the run, but still delete the namespaces and any replica
    // left running, instead of leaving them behind.
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let interrupted = interrupted.clone();
        ctrlc::set_handler(move || interrupted.store(true, Ordering::SeqCst))?;
    }
    let limit = Instant::now() + plan.time + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if Instant::now() > limit || interrupted.load(Ordering::SeqCst) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    drop(hosts);
    if interrupted.load(Ordering::SeqCst) {
        let stray = kill_strays(&out);
        eprintln!(
            "faultsuite: interrupted; namespaces deleted, {stray} replica processes stopped; \
             partial output in {}",
            out.display()
        );
        return Ok(ExitCode::from(130));
    }
    let stray = kill_strays(&out);
    if stray > 0 {
        eprintln!("faultsuite: killed {stray} replica processes left running");
    }
    let verdict: Option<Verdict> = std::fs::read(out.join("verdict.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let Some(v) = verdict else {
        eprintln!(
            "faultsuite: the run broke ({}); no verdict. Replay: faultsuite --seed {seed} --time {}",
            status.map_or("timed out".to_string(), |s| s.to_string()),
            humantime::format_duration(plan.time)
        );
        return Ok(ExitCode::FAILURE);
    };
    println!("faultsuite: seed {seed}: {}", summary(&v));
    if v.passed() {
        println!("faultsuite: PASS (seed {seed})");
        Ok(ExitCode::SUCCESS)
    } else {
        for x in &v.violations {
            println!("faultsuite: VIOLATION {x}");
        }
        println!(
            "faultsuite: FAIL (seed {seed}); histories in {}; replay the schedule with \
             `faultsuite --seed {seed} --time {}`",
            out.display(),
            humantime::format_duration(plan.time)
        );
        Ok(ExitCode::FAILURE)
    }
}

/// Kills any process still running a replica of this run (its command line names a config
/// under `out`); returns how many. The client host stops its replicas itself; this is the
/// safety net for a client host that crashed or was killed.
fn kill_strays(out: &Path) -> usize {
    let needle = out.to_string_lossy().into_owned();
    let mut n = 0;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(" replica --config ") && cmdline.contains(&needle) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            n += 1;
        }
    }
    n
}
