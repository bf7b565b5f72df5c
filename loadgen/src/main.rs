//! `loadgen`: load and failure scenarios for the lock service, and the same scenarios
//! against etcd and ZooKeeper (started on loopback by `ops/bench/peers.sh`) with each
//! one's standard lock recipe, so one tool measures all three.

/// jemalloc instead of glibc's malloc: under `loadgen profile` glibc's malloc and free took
/// 10-20 % of the leader's, the proxy's and loadgen's CPU (docs/benchmarks.md, issue 27).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod cluster;
mod pinning;
mod profile;

mod report;
mod scenarios;
mod server_sessions;
mod state;

mod systems;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::cluster::{Cluster, System};
use crate::report::Report;
use crate::scenarios::Ctx;
use crate::systems::Conn;

/// Load and failure scenarios, for this lock service and, side by side, etcd and ZooKeeper.
///
/// Each run starts the system under test on loopback (ours: `lockctl dev`, which must be
/// built next to loadgen; etcd and ZooKeeper: `ops/bench/peers.sh`, which needs Debian's
/// `etcd-server` and `zookeeper` packages), prints a summary table, and writes
/// `<out>/<scenario>-<system>.json` and a latency-over-time chart `.svg`.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The system to run against.
    #[arg(long, value_enum, default_value = "ours", global = true)]
    system: System,
    /// Scale of the scenario (1.0 = the documented full size; 0.05 runs in seconds).
    #[arg(long, default_value_t = 1.0, global = true)]
    scale: f64,
    /// Where results go.
    #[arg(long, default_value = "bench-results", global = true)]
    out: PathBuf,
    /// Members of the cluster (the same for every system).
    #[arg(long, default_value_t = 3, global = true)]
    members: u16,
    /// Proxies in front of our cell (clients connect to them).
    #[arg(long, default_value_t = 0, global = true)]
    proxies: u16,
    /// Session lease / etcd lease TTL / ZooKeeper session timeout, in seconds.
    #[arg(long, default_value_t = 12, global = true)]
    lease_secs: u64,
    /// etcd in profile, state and herd: renew all 2 000 leases of a gRPC client on one
    /// keep-alive stream (as one clientv3 process would) instead of one stream per lease
    /// (as independent clients would).
    #[arg(long, global = true)]
    etcd_shared_keepalive: bool,
    /// etcd in profile and state: one lease per gRPC client (2 000 sessions), shared by
    /// all its sessions and their locks, as a clientv3 process holds one
    /// `concurrency.Session` for all its mutexes, instead of one lease per session. A
    /// lost lease is then all of its client's sessions lost.
    #[arg(long, global = true)]
    etcd_lease_per_client: bool,
    /// etcd in profile and state: connect the lease clients to the leader only, so no
    /// renewal is forwarded by a follower (spread over all members otherwise).
    #[arg(long, global = true)]
    etcd_leader_only: bool,
    /// loadgen processes for etcd's and ZooKeeper's profile, and for ZooKeeper's state,
    /// each holding its share of the sessions (a ZooKeeper session is a connection, and
    /// one process may hold fewer than 20 000 here). 0: one per 15 000 ZooKeeper
    /// sessions, else one.
    #[arg(long, default_value_t = 0, global = true)]
    processes: usize,
    /// Once the system under test is up, lower loadgen's own scheduling priority to this
    /// niceness (1-19; every thread of this process): the servers, started before, keep
    /// theirs, so on a machine shared with the client simulation they get the CPU first,
    /// as on machines of their own. The servers' own latency figures (ours: "... at the
    /// leader", "... at the proxies") then show what the system does when not starved;
    /// loadgen's figures include its own wait for the CPU. Not with `compare` (the
    /// systems started after the first would inherit it).
    #[arg(long, default_value_t = 0, global = true, value_parser = clap::value_parser!(u8).range(0..=19))]
    client_nice: u8,
    /// Run each scenario this many times per system (a fresh cluster each time): each
    /// run's report goes to `<out>/run-<k>/`, and `<out>` gets one whose figures and
    /// latency percentiles are the runs' medians, with their ranges and every failure.
    #[arg(long, default_value_t = 1, global = true, value_parser = clap::value_parser!(u16).range(1..=100))]
    runs: u16,
    /// Bind every thread of the servers under test (ours: replicas and proxies; etcd's
    /// members; ZooKeeper's JVMs) to these CPUs, e.g. `0` or `0-1` (re-applied every
    /// second, so a restarted member is bound too). Use with `--loadgen-cpus` for a split
    /// that is the same for all three systems.
    #[arg(long, global = true)]
    server_cpus: Option<pinning::Cpus>,
    /// Bind every thread of loadgen (and the processes it starts: takeover holders,
    /// profile parts) to these CPUs.
    #[arg(long, global = true)]
    loadgen_cpus: Option<pinning::Cpus>,
    /// profile: config reads through each system's own client cache (`cached`: ours, the
    /// consistent cache; ZooKeeper, getData with a watch as Curator's NodeCache; etcd has
    /// no Rust client for its leasing KV, so stays uncached) or every read to the servers
    /// (`uncached`: the like-for-like row).
    #[arg(long, value_enum, default_value = "cached", global = true)]
    reads: profile::Reads,
    /// How long one request may take, retries included, before it fails: our SDK's
    /// request timeout (it retries within it, across a leader change) and the deadline
    /// of each of etcd's unary requests; the same for both, so that fault runs compare
    /// like with like. ZooKeeper's client has no request deadline (a request fails when
    /// its connection is given up).
    #[arg(long, default_value_t = systems::DEFAULT_REQUEST_TIMEOUT_SECS, global = true, value_parser = clap::value_parser!(u64).range(1..=600))]
    request_timeout_secs: u64,
    /// Test hook: at the end of `profile`, end this many sessions that hold no lock
    /// behind loadgen's back (ours, etcd: their renewals stop; ZooKeeper: another client
    /// closes them), so the server-side session check must confirm them lost.
    #[arg(long, default_value_t = 0, global = true, hide = true)]
    end_sessions_behind_back: usize,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug, Clone)]
enum Cmd {
    /// Uncontended acquire and release: each client loops on its own lock.
    Acquire,
    /// 2 000 contenders on one lock: hand-off latency (and, for ours, events per hand-off).
    Herd,
    /// A lock holder process is killed (`kill -9`): time until a waiter is granted.
    Takeover,
    /// Writers while the leader is killed (`kill -9`), frozen with `--freeze`, or stopped
    /// as an operator would with `--stop`: how long writes fail, and sessions lost.
    Failover {
        /// SIGSTOP the leader instead of killing it.
        #[arg(long, conflicts_with = "stop")]
        freeze: bool,
        /// SIGTERM the leader instead of killing it (a planned restart, each system's own
        /// graceful stop: ours hands the leadership over first).
        #[arg(long)]
        stop: bool,
        /// How long the writers go on after the kill or freeze, in seconds (default 12
        /// after a kill, 20 after a freeze: the figures in docs/benchmarks.md).
        #[arg(long)]
        after_secs: Option<u64>,
    },
    /// The write ceiling with fsync on, at rising concurrency; reports the knee.
    MaxWrites,
    /// A mass restart: 2 000 new sessions a second each taking a lock, for 30 s.
    Burst,
    /// The seed's steady state: 50 000 sessions, 20 000 locks (5 000 taken once a period of
    /// a third of the run, at most a minute: every 40 s at the default 120 s, every 20 s
    /// with --secs 60), 50 000 config reads and 10 config writes a second, session churn. Ours runs through
    /// proxies (--proxies, else one per 12 500 sessions) with cached reads; etcd and
    /// ZooKeeper with their own sessions and uncached reads. With --fault, the leader is
    /// killed or frozen 40 % into the run.
    Profile {
        /// Run time in seconds (default 120 at full scale).
        #[arg(long)]
        secs: Option<f64>,
        /// Kill (`kill -9`) or freeze (SIGSTOP) the leader 40 % into the run.
        #[arg(long, value_enum)]
        fault: Option<profile::Fault>,
        /// Config reads per session per second (0: sessions, locks and writes only).
        #[arg(long, default_value_t = 1.0)]
        reads_per_session: f64,
    },
    /// A large state: 100 000 nodes of 1 KB and 50 000 sessions. Reports replica RSS,
    /// snapshot size and time (and the write stall meanwhile), a follower's restart time
    /// and a new learner's catch-up time (ZooKeeper: a follower's with its data emptied).
    State,
    /// Ours only: one runaway client identity, held to small limits per identity, beside
    /// well-behaved clients looping acquire and release: their latency alone, beside it,
    /// and beside the same abuse from an identity without limits.
    Abuse,
    /// Ours only: a prefix of `nodes` nodes moved between two cells (`lockctl dev --cells
    /// 2`, --members replicas each) while writers write through a router: how long it
    /// was frozen, what the writers met, when every writer worked in the new cell.
    Move {
        /// Nodes under the prefix.
        #[arg(long, default_value_t = 10_000)]
        nodes: usize,
        /// Writers (each creates a node every 10 ms under its own).
        #[arg(long, default_value_t = 8)]
        writers: usize,
    },
    /// Runs a scenario against ours, etcd and ZooKeeper and prints one table with ratios.
    Compare {
        /// The scenario: acquire, herd, takeover, failover, failover-freeze, failover-stop,
        /// max-writes, burst, profile and state.
        scenario: String,
    },
    /// One share of a profile split over several processes (started by `profile`).
    #[command(hide = true)]
    ProfilePart {
        #[arg(long)]
        endpoints: String,
        #[arg(long)]
        ca: Option<PathBuf>,
        #[arg(long)]
        part: usize,
        #[arg(long)]
        parts: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long)]
        reads_per_session: f64,
        #[arg(long)]
        result: PathBuf,
    },
    /// Holds sessions for ZooKeeper's state split over processes (started by `state`):
    /// opens `count`, prints READY, and on a line from stdin prints how many were lost.
    #[command(hide = true)]
    HoldSessions {
        #[arg(long)]
        endpoints: String,
        #[arg(long)]
        count: usize,
    },
    /// Holds a lock until killed (the takeover scenario's holder process).
    #[command(hide = true)]
    Hold {
        #[arg(long)]
        endpoints: String,
        #[arg(long)]
        ca: Option<PathBuf>,
        #[arg(long)]
        lock: String,
    },
}

fn scenario_cmd(name: &str) -> anyhow::Result<Cmd> {
    Ok(match name {
        "acquire" => Cmd::Acquire,
        "herd" => Cmd::Herd,
        "takeover" => Cmd::Takeover,
        "failover" => Cmd::Failover {
            freeze: false,
            stop: false,
            after_secs: None,
        },
        "failover-freeze" => Cmd::Failover {
            freeze: true,
            stop: false,
            after_secs: None,
        },
        "failover-stop" => Cmd::Failover {
            freeze: false,
            stop: true,
            after_secs: None,
        },
        "max-writes" => Cmd::MaxWrites,
        "burst" => Cmd::Burst,
        "state" => Cmd::State,
        "abuse" => Cmd::Abuse,
        "move" => Cmd::Move {
            nodes: 10_000,
            writers: 8,
        },
        "profile" => Cmd::Profile {
            secs: None,
            fault: None,
            reads_per_session: 1.0,
        },
        other => anyhow::bail!(
            "unknown scenario {other:?} (acquire, herd, takeover, failover, failover-freeze, \
             failover-stop, max-writes, burst, profile, state, abuse, move)"
        ),
    })
}

/// Makes glibc's allocator take every block of 1 MiB or more straight from the kernel
/// (`mmap`), untouched until written, and give it back when freed. Loadgen plays thousands
/// of client processes in one: each arrival of `burst` is an SDK client with a QUIC
/// endpoint of its own, whose receive buffer is 3 MB (quinn: 1 472-byte datagrams × 64 GRO
/// segments × a batch of 32) of which a few pages are ever written. By default glibc
/// raises its mmap threshold past that size after the first such block is freed, so the
/// later ones come from its heap and are zeroed there, 3 MB resident each: 4 000 arrivals
/// in flight took 12 GB, and the full-scale run was stopped at 21 GB. With the threshold
/// fixed they cost what they touch (measured: 1 000 clients, 100 at a time, 798 MB → 33
/// MB). Real client processes hold one endpoint each and pay the 3 MB once; the servers
/// are separate processes and not affected. Since loadgen's allocator is jemalloc
/// (issue 27) this setting reaches nothing (`mallopt` is glibc's); it stays for a build
/// with the system allocator. `burst`'s memory under jemalloc is not measured yet.
fn mmap_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter; called before any thread of
        // ours allocates large blocks.
        let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
        if ok != 1 {
            tracing::warn!("mallopt(M_MMAP_THRESHOLD) refused: large buffers stay on the heap");
        }
    }
}

/// Open files: ZooKeeper's sessions are connections, so `profile` and `state` at full scale
/// hold 50 000 sockets. Raises the soft limit to the hard one, and (as root) both to 200 000.
fn raise_open_files() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            let want = lim.rlim_max.max(200_000);
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: want,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                lim.rlim_cur = lim.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
    }
}

/// Runs `cmd` on `system` `--runs` times; prints and writes each run's report, and with
/// more than one run the median report as well.
/// The report's parameter naming the CPU binding.
const BINDING: &str = "CPU binding (sched_setaffinity, every thread)";

/// How the servers and loadgen were bound to CPUs, for the report.
fn cpu_binding(cli: &Cli) -> String {
    match (&cli.server_cpus, &cli.loadgen_cpus) {
        (None, None) => "none: servers and loadgen share every CPU".to_string(),
        (s, l) => format!(
            "servers on CPUs {}, loadgen on CPUs {}",
            s.as_ref().map_or("any".into(), |c| c.to_string()),
            l.as_ref().map_or("any".into(), |c| c.to_string())
        ),
    }
}

async fn run_repeated(cli: &Cli, system: System, cmd: &Cmd) -> anyhow::Result<Report> {
    if cli.runs == 1 {
        return run_one(cli, system, cmd, &cli.out).await;
    }
    let mut runs = Vec::new();
    let mut failures = Vec::new();
    for k in 1..=cli.runs {
        eprintln!("loadgen: run {k} of {} on {}", cli.runs, system.name());
        match run_one(cli, system, cmd, &cli.out.join(format!("run-{k}"))).await {
            Ok(r) => runs.push(r),
            // A run that fails is recorded, not dropped: the others still run.
            Err(e) => {
                eprintln!("loadgen: run {k} on {} failed: {e:#}", system.name());
                failures.push(format!("run {k} failed: {e:#}"));
            }
        }
    }
    if runs.is_empty() {
        anyhow::bail!("every run failed: {}", failures.join("; "));
    }
    let mut r = Report::median_of(&runs);
    r.param("runs that failed (not in the medians)", failures.len());
    r.notes.extend(failures);
    r.print();
    let (json, svg) = r.write(&cli.out)?;
    println!("  wrote {} and {}", json.display(), svg.display());
    Ok(r)
}

async fn run_one(
    cli: &Cli,
    system: System,
    cmd: &Cmd,
    out: &std::path::Path,
) -> anyhow::Result<Report> {
    let lease = Duration::from_secs(cli.lease_secs);
    let own_before = report::own_cost_from_here();
    // ZooKeeper's profile and state hold 50 000 sessions at full scale, a TCP
    // connection each from this host: refused before anything starts if the host's
    // ephemeral ports would run short.
    let port_warning = if system == System::Zk && matches!(cmd, Cmd::Profile { .. } | Cmd::State) {
        systems::zk::ephemeral_port_warning((50_000.0 * cli.scale).round() as usize)
    } else {
        None
    };
    if let Some(w) = &port_warning {
        eprintln!("loadgen: warning: {w}");
    }
    let proxies = if system == System::Ours {
        match cmd {
            Cmd::Profile { .. } | Cmd::State if cli.proxies == 0 => {
                ((50_000.0 * cli.scale / 12_500.0).ceil() as u16).clamp(1, 8)
            }
            _ => cli.proxies,
        }
    } else {
        0
    };
    if let Cmd::Move { nodes, writers } = cmd {
        anyhow::ensure!(system == System::Ours, "move is ours only");
        let nodes = ((*nodes as f64) * cli.scale).round().max(10.0) as usize;
        let mut r = scenarios::move_prefix::run(
            cli.members,
            nodes,
            *writers,
            cli.scale,
            cli.server_cpus.as_ref(),
        )
        .await?;
        r.param(BINDING, cpu_binding(cli));
        r.print();
        let (json, svg) = r.write(out)?;
        println!("  wrote {} and {}", json.display(), svg.display());
        return Ok(r);
    }
    if matches!(cmd, Cmd::Abuse) {
        // The replicas' default limits per identity, which the abuser meets (the dev
        // identity of the well-behaved clients is exempt in `lockctl dev`'s cell).
        for (k, v) in scenarios::abuse::replica_env() {
            std::env::set_var(k, v);
        }
    }
    let cluster = tokio::task::block_in_place(|| {
        Cluster::start(
            system,
            cli.members,
            proxies,
            lease.as_millis() as u64,
            cli.server_cpus.clone(),
        )
    })?;
    cluster.ready().await?;
    if cli.client_nice > 0 {
        lower_own_priority(cli.client_nice)?;
    }
    let binding = match &cli.server_cpus {
        Some(cpus) => Some(pinning::bind_servers(
            system,
            cluster.dir().to_path_buf(),
            cpus.clone(),
        )?),
        None => None,
    };
    let conn = Conn::new(&cluster).await?;
    let ctx = Ctx {
        cluster,
        conn,
        scale: cli.scale,
        lease,
        open_retries: Default::default(),
        own_before,
    };
    let r = match cmd {
        Cmd::Acquire => scenarios::acquire(&ctx).await,
        Cmd::Herd => scenarios::herd(&ctx).await,
        Cmd::Takeover => scenarios::takeover(&ctx, &std::env::current_exe()?).await,
        Cmd::Failover {
            freeze,
            stop,
            after_secs,
        } => {
            let event = match (freeze, stop) {
                (true, _) => scenarios::LeaderEvent::Freeze,
                (_, true) => scenarios::LeaderEvent::Stop,
                _ => scenarios::LeaderEvent::Kill,
            };
            scenarios::failover(&ctx, event, after_secs.map(std::time::Duration::from_secs)).await
        }
        Cmd::MaxWrites => scenarios::max_writes(&ctx).await,
        Cmd::Burst => scenarios::burst(&ctx).await,
        Cmd::Abuse => scenarios::abuse(&ctx).await,
        Cmd::Move { .. } => unreachable!("run above, on its own cells"),
        Cmd::Profile {
            secs,
            fault,
            reads_per_session,
        } if system == System::Ours => {
            profile::profile(&ctx, *secs, *fault, *reads_per_session).await
        }
        Cmd::Profile {
            secs,
            fault,
            reads_per_session,
        } => match profile::peers::parts_for(system, cli.scale, cli.processes) {
            1 => profile::peers::profile(&ctx, *secs, *fault, *reads_per_session).await,
            parts => {
                profile::peers::profile_parts(&ctx, *secs, *fault, *reads_per_session, parts).await
            }
        },
        Cmd::State => state::state(&ctx, cli.processes).await,
        Cmd::Compare { .. }
        | Cmd::Hold { .. }
        | Cmd::HoldSessions { .. }
        | Cmd::ProfilePart { .. } => {
            unreachable!("not a scenario")
        }
    };
    if let Some(b) = binding {
        b.abort();
    }
    let checked = cli
        .server_cpus
        .as_ref()
        .map(|cpus| pinning::check_servers(system, ctx.cluster.dir(), cpus));
    let gc = ctx.cluster.zk_gc();
    // The cluster's directory goes with it: when the server confirmed sessions lost,
    // keep what its members logged (before they are stopped), to find out why.
    let kept = r
        .as_ref()
        .ok()
        .filter(|r| {
            r.figures
                .get(server_sessions::CONFIRMED_LOST)
                .is_some_and(|n| *n > 0.0)
        })
        .map(|r| {
            ctx.cluster
                .keep_member_logs(&out.join(format!("{}-member-logs", r.system)))
        });
    let mut cluster = ctx.cluster;
    tokio::task::block_in_place(|| cluster.stop());
    let mut r = r?;
    match kept {
        Some(Ok(Some(dir))) => r.notes.push(format!(
            "the server confirmed sessions lost: its members' logs are kept in {}",
            dir.display()
        )),
        Some(Err(e)) => r
            .notes
            .push(format!("could not keep the members' logs: {e:#}")),
        Some(Ok(None)) | None => {}
    }
    if cli.client_nice > 0 {
        r.param("loadgen niceness (servers 0)", cli.client_nice);
    }
    r.param(BINDING, cpu_binding(cli));
    if let Some((bound, total)) = checked {
        r.param(
            "server threads on the server CPUs at the end",
            format!("{bound} of {total}"),
        );
    }
    if system == System::Zk {
        r.param(
            "ZooKeeper JVM heap (-Xmx, PEERS_ZK_HEAP)",
            std::env::var("PEERS_ZK_HEAP").unwrap_or_else(|_| "2g".into()),
        );
    }
    r.notes.extend(port_warning);
    if system == System::Zk {
        if let Some(p) = systems::zk::ephemeral_ports() {
            r.param(
                "this host's ephemeral ports (for ZooKeeper's connections)",
                p,
            );
        }
    }
    if let Some(gc) = gc {
        r.param("ZooKeeper JVM garbage collector", gc.collectors.join(", "));
        r.param("ZooKeeper members whose GC logs were read", gc.members);
        r.figure("ZooKeeper GC pauses (all members)", gc.pauses as f64);
        r.figure("ZooKeeper GC pause max (ms)", gc.max_ms);
        r.figure("ZooKeeper GC pauses summed (s)", gc.total_ms / 1000.0);
    }
    r.print();
    let (json, svg) = r.write(out)?;
    println!("  wrote {} and {}", json.display(), svg.display());
    Ok(r)
}

async fn hold(
    system: System,
    endpoints: &str,
    ca: &std::path::Path,
    lock: &str,
    lease: Duration,
) -> anyhow::Result<()> {
    let eps: Vec<String> = endpoints.split(',').map(String::from).collect();
    let conn = Conn::for_endpoints(system, &eps, ca).await?;
    let s = conn.session(lease).await?;
    s.ensure_dir(lock).await?;
    let (_held, token) = s.acquire(lock).await?;
    println!("HELD {token}");
    use std::io::Write;
    std::io::stdout().flush()?;
    loop {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
}

/// Sets niceness `nice` on every thread of this process (threads started later inherit it
/// from the thread that starts them).
fn lower_own_priority(nice: u8) -> anyhow::Result<()> {
    for t in std::fs::read_dir("/proc/self/task")? {
        let tid: libc::id_t = t?.file_name().to_string_lossy().parse()?;
        // SAFETY: setpriority reads its arguments only.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice.into()) } != 0 {
            anyhow::bail!(
                "setpriority({tid}, {nice}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    raise_open_files();
    mmap_large_buffers();
    systems::ETCD_SHARED_KEEPALIVE.store(
        cli.etcd_shared_keepalive,
        std::sync::atomic::Ordering::Relaxed,
    );
    profile::READS_CACHED.store(
        cli.reads == profile::Reads::Cached,
        std::sync::atomic::Ordering::Relaxed,
    );
    server_sessions::END_BEHIND_BACK.store(
        cli.end_sessions_behind_back,
        std::sync::atomic::Ordering::Relaxed,
    );
    systems::REQUEST_TIMEOUT_MS.store(
        cli.request_timeout_secs * 1000,
        std::sync::atomic::Ordering::Relaxed,
    );
    systems::ETCD_LEADER_ONLY.store(cli.etcd_leader_only, std::sync::atomic::Ordering::Relaxed);
    systems::ETCD_LEASE_PER_CLIENT.store(
        cli.etcd_lease_per_client,
        std::sync::atomic::Ordering::Relaxed,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    // Before any thread of the runtime runs loadgen's work (its threads exist now, and
    // threads started later inherit the binding).
    if let Some(cpus) = &cli.loadgen_cpus {
        if let Err(e) = pinning::bind_self(cpus) {
            eprintln!("loadgen: {e:#}");
            std::process::exit(2);
        }
    }
    let r: anyhow::Result<()> = rt.block_on(async {
        match &cli.command {
            Cmd::Hold {
                endpoints,
                ca,
                lock,
            } => {
                hold(
                    cli.system,
                    endpoints,
                    ca.as_deref().unwrap_or(std::path::Path::new("")),
                    lock,
                    Duration::from_secs(cli.lease_secs),
                )
                .await
            }
            Cmd::HoldSessions { endpoints, count } => {
                let eps: Vec<String> = endpoints.split(',').map(String::from).collect();
                let conn = Conn::for_endpoints(cli.system, &eps, std::path::Path::new("")).await?;
                state::peers::hold_sessions(&conn, *count, Duration::from_secs(cli.lease_secs))
                    .await
            }
            Cmd::ProfilePart {
                endpoints,
                ca,
                part,
                parts,
                secs,
                reads_per_session,
                result,
            } => {
                let eps: Vec<String> = endpoints.split(',').map(String::from).collect();
                let ca = ca.as_deref().unwrap_or(std::path::Path::new(""));
                let conn = Conn::for_endpoints(cli.system, &eps, ca).await?;
                profile::peers::part(
                    &conn,
                    Duration::from_secs(cli.lease_secs),
                    cli.scale,
                    (*part, *parts),
                    *secs,
                    *reads_per_session,
                    result,
                )
                .await
            }
            Cmd::Compare { .. } if cli.client_nice > 0 => {
                anyhow::bail!("--client-nice is for one system at a time (not with compare)")
            }
            Cmd::Compare { scenario } => {
                let cmd = scenario_cmd(scenario)?;
                let mut reports = Vec::new();
                for system in [System::Ours, System::Etcd, System::Zk] {
                    match run_repeated(&cli, system, &cmd).await {
                        Ok(r) => reports.push(r),
                        Err(e) => eprintln!("loadgen: {scenario} on {}: {e:#}", system.name()),
                    }
                }
                report::compare(&reports);
                Ok(())
            }
            cmd => run_repeated(&cli, cli.system, cmd).await.map(|_| ()),
        }
    });
    if let Err(e) = r {
        eprintln!("loadgen: {e:#}");
        std::process::exit(1);
    }
}
