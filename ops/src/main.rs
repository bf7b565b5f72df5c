//! `lockctl`: the operator CLI and the local dev-cell launcher.
//!
//! - `lockctl dev` starts a local cell of replica processes on loopback, shows it working,
//!   and stops them cleanly on Ctrl-C.
//! - `lockctl status | create | get | set | ls | rm | watch | member ...` talk to a running
//!   cell.

/// jemalloc instead of glibc's malloc: under `loadgen profile` glibc's malloc and free took
/// 10-20 % of the leader's, the proxy's and loadgen's CPU (docs/benchmarks.md, issue 27).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod acl;
mod certs;
mod dev;
mod elect;
use ops::dir;
mod fenced;
mod lock;
mod snapshot;
mod tree;
mod watch;

pub(crate) use ops::say;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use client_sdk::{Client, ClientConfig, CreateMode, Reply};
use wire::types::Op;

/// Operate a lock-service cell.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None, after_help = EXIT_CODES)]
struct Cli {
    /// Replica (or proxy) addresses, comma-separated. Default: the settings file's, else
    /// the default `lockctl dev` cell's (127.0.0.1:7101-7105).
    #[arg(long, env = "LOCKCTL_ENDPOINTS", global = true)]
    endpoints: Option<String>,
    /// The cell's CA certificate. Default: the settings file's, else
    /// cell-data/tls/ca.pem.
    #[arg(long, env = "LOCKCTL_CA", global = true)]
    ca: Option<PathBuf>,
    /// A settings file (TOML: endpoints, ca, cert, key, timeout_secs; relative paths
    /// from the file's directory). Flags and environment variables override it. Default:
    /// $XDG_CONFIG_HOME/lockctl.toml or ~/.config/lockctl.toml, if there is one.
    #[arg(long, env = "LOCKCTL_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// This client's certificate (every connection is mutual TLS). Default: client.pem
    /// next to the CA.
    #[arg(long = "cert", env = "LOCKCTL_CERT", global = true)]
    tls_cert: Option<PathBuf>,
    /// The certificate's key. Default: client.key next to the CA.
    #[arg(long = "key", env = "LOCKCTL_KEY", global = true)]
    tls_key: Option<PathBuf>,
    /// Give up on a request after this many seconds. Default: the settings file's, else 15.
    #[arg(long, global = true)]
    timeout_secs: Option<u64>,
    /// Print what read commands (status, get, ls, watch) return as JSON (one object per
    /// line for watch) instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

/// `lockctl`'s settings file (`--config`, or `~/.config/lockctl.toml`): the connection
/// settings an `etcdctl` or `zkCli` user would otherwise repeat on every command.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    /// Endpoints: a comma-separated string or a list.
    endpoints: Option<Endpoints>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    timeout_secs: Option<u64>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum Endpoints {
    One(String),
    List(Vec<String>),
}

/// The settings file to read: the one named (it must exist), else the user's, if any.
fn settings_path(named: Option<&PathBuf>) -> Option<PathBuf> {
    if let Some(p) = named {
        return Some(p.clone());
    }
    let dir = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    Some(dir.join("lockctl.toml")).filter(|p| p.exists())
}

/// Reads a settings file; relative paths in it are taken from its directory.
fn read_settings(path: &std::path::Path) -> anyhow::Result<Settings> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("settings file {}", path.display()))?;
    let mut s: Settings =
        toml::from_str(&text).with_context(|| format!("settings file {}", path.display()))?;
    let base = path.parent().unwrap_or(std::path::Path::new("."));
    for p in [&mut s.ca, &mut s.cert, &mut s.key].into_iter().flatten() {
        if p.is_relative() {
            *p = base.join(&*p);
        }
    }
    Ok(s)
}

/// How to reach the cell: flags and environment first, then the settings file, then
/// the defaults.
#[derive(Debug)]
struct Reach {
    endpoints: String,
    tls: ClientTls,
    timeout_secs: u64,
}

fn reach(cli: &Cli) -> anyhow::Result<Reach> {
    let file = match settings_path(cli.config.as_ref()) {
        Some(p) => read_settings(&p)?,
        None => Settings::default(),
    };
    let endpoints = cli
        .endpoints
        .clone()
        .or(file.endpoints.map(|e| match e {
            Endpoints::One(s) => s,
            Endpoints::List(l) => l.join(","),
        }))
        .unwrap_or_else(|| dev::DEFAULT_ENDPOINTS.to_string());
    // A CA named by flag or environment comes with its own certificate and key (given, or
    // next to it), never the settings file's, which belong to the file's CA.
    let (file_cert, file_key) = if cli.ca.is_some() {
        (None, None)
    } else {
        (file.cert, file.key)
    };
    Ok(Reach {
        endpoints,
        tls: ClientTls {
            ca: cli
                .ca
                .clone()
                .or(file.ca)
                .unwrap_or_else(|| PathBuf::from("cell-data/tls/ca.pem")),
            cert: cli.tls_cert.clone().or(file_cert),
            key: cli.tls_key.clone().or(file_key),
        },
        timeout_secs: cli.timeout_secs.or(file.timeout_secs).unwrap_or(15),
    })
}

/// The exit statuses, for scripts (also in `--help`).
const EXIT_CODES: &str = "Exit status: 0 done; 1 any other error; 2 bad arguments; \
3 lock not acquired in time; 4 lock lost; 5 fenced write refused; 6 no such node; \
7 conflict (version mismatch, node exists, not empty, transaction failed); 8 the cell \
did not answer (unreachable, no leader, timed out); 9 refused (not allowed, a limit, a \
certificate or configuration to fix).

Examples:
  lockctl status
  lockctl create /app/config v1
  lockctl set /app/config v2 --version 0
  lockctl get /app/config --json
  lockctl watch /app/config
  lockctl lock /app/leader -- ./run-job.sh
  lockctl completions bash > /etc/bash_completion.d/lockctl";

/// The exit status for an error ([`EXIT_CODES`]).
fn exit_code(e: &anyhow::Error) -> i32 {
    use wire::Error as E;
    let Some(w) = e.chain().find_map(|c| c.downcast_ref::<wire::Error>()) else {
        return if e.chain().any(|c| c.downcast_ref::<Unreachable>().is_some()) {
            8
        } else {
            1
        };
    };
    match w {
        E::NoNode { .. } => 6,
        E::BadVersion { .. } | E::NodeExists { .. } | E::NotEmpty { .. } | E::TxnFailed { .. } => 7,
        E::NotLeader { .. }
        | E::Unavailable { .. }
        | E::Timeout { .. }
        | E::Connection { .. }
        | E::Busy { .. }
        | E::Frozen { .. } => 8,
        E::Denied { .. }
        | E::NotAdmin { .. }
        | E::NotSessionOwner { .. }
        | E::TooManyFor { .. }
        | E::TooManySessions { .. }
        | E::TooManyRequests { .. }
        | E::LimitExceeded { .. }
        | E::WrongCell { .. }
        | E::BadRequest { .. }
        | E::Handshake { .. }
        | E::ProtocolVersion { .. } => 9,
        _ => 1,
    }
}

/// No endpoint of the cell answered (`lockctl status`): exit status 8.
#[derive(Debug, thiserror::Error)]
#[error("no replica answered ({0} tried)")]
struct Unreachable(usize);

/// `status`'s error when no endpoint answered, from each endpoint's error: the refusal
/// (exit status 9) when every one refused the TLS handshake, else [`Unreachable`] (8).
fn none_answered(errors: Vec<wire::Error>) -> anyhow::Error {
    let tried = errors.len();
    let all_refused = errors
        .iter()
        .all(|e| matches!(e, wire::Error::Handshake { .. }));
    match errors.into_iter().next() {
        Some(e) if all_refused => e.into(),
        _ => Unreachable(tried).into(),
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a local cell on loopback (data under --data), show it working, run until Ctrl-C.
    #[command(after_help = "Examples:\n  \
        lockctl dev\n  \
        lockctl dev --replicas 3 --proxies 2 --data /tmp/cell\n  \
        lockctl dev --cells 2 --no-demo")]
    Dev(dev::DevArgs),
    /// Show every replica's role, term, applied index and the cell's members.
    #[command(after_help = "Examples:\n  \
        lockctl status\n  \
        lockctl status --full --json\n  \
        lockctl --endpoints 10.0.0.1:7101,10.0.0.2:7101 status")]
    Status {
        /// Print every counter of every replica (cachers, held invalidations, KeepAlive
        /// RPCs, watches, snapshot size and time, ...).
        #[arg(long)]
        full: bool,
    },
    /// List the cell's sessions (cell admins): id, owner identity, lease left at the
    /// leader, ephemeral nodes, whether it caches.
    ///
    /// Examples: lockctl sessions; lockctl sessions --owner lock://client/indexer --json
    #[command(after_help = "Examples:\n  \
        lockctl sessions\n  \
        lockctl sessions --owner lock://client/indexer --json")]
    Sessions {
        /// Only the sessions of this identity.
        #[arg(long)]
        owner: Option<String>,
    },
    /// Create a node.
    #[command(after_help = "Examples:\n  \
        lockctl create /app\n  \
        lockctl create /app/config v1\n  \
        lockctl create /jobs/job- '{\"id\": 7}' --sequential")]
    Create {
        /// Path (the prefix when --sequential).
        path: String,
        /// Data (UTF-8).
        #[arg(default_value = "")]
        data: String,
        /// Ephemeral: deleted when this command's session closes (at once).
        #[arg(long)]
        ephemeral: bool,
        /// Append a sequence number.
        #[arg(long)]
        sequential: bool,
    },
    /// Print a node's data and metadata.
    #[command(after_help = "Examples:\n  \
        lockctl get /app/config\n  \
        lockctl get /app/config --json")]
    Get {
        /// Path.
        path: String,
    },
    /// Print a node's value and every change to it (or to its children, with --children)
    /// until Ctrl-C: a one-shot watch, re-armed after each event with a read that shows
    /// the value at that moment (changes between an event and the re-read are folded into
    /// it, as with ZooKeeper's watches).
    #[command(after_help = "Examples:\n  \
        lockctl watch /app/config\n  \
        lockctl watch /services/indexer --children --count 1")]
    Watch(watch::WatchArgs),
    /// Is a lock holder still the holder: its node present with the same fencing token and
    /// session? Linearizable. Exit status 0 if so, 4 if not. Under `lockctl lock`, the
    /// command's environment gives all three (LOCK_NODE, LOCK_TOKEN, LOCK_SESSION).
    #[command(
        after_help = "Examples:\n  lockctl check-sequencer --node /app/leader/lock-0000000012 --token 12289 --session 42"
    )]
    CheckSequencer {
        /// The holder's lock node (full path).
        #[arg(long, env = "LOCK_NODE")]
        node: String,
        /// Its fencing token.
        #[arg(long, env = "LOCK_TOKEN")]
        token: u64,
        /// The holder's session.
        #[arg(long, env = "LOCK_SESSION")]
        session: u64,
    },
    /// Print a completion script for a shell (bash, zsh, fish, elvish, powershell).
    #[command(after_help = "Examples:\n  \
        lockctl completions bash > /etc/bash_completion.d/lockctl\n  \
        lockctl completions zsh > ~/.zfunc/_lockctl")]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Read a node through a session's consistent cache repeatedly, printing for each read
    /// its start and end wall-clock times (µs since the epoch), whether it came from the
    /// cache or the cell, and the value.
    /// For watching a config value, and for cache drills.
    #[command(after_help = "Examples:\n  \
        lockctl watch-cached /app/config\n  \
        lockctl watch-cached /app/config --every-ms 500 --for-secs 300")]
    WatchCached {
        /// Path.
        path: String,
        /// Milliseconds between reads.
        #[arg(long, default_value_t = 100)]
        every_ms: u64,
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 60)]
        for_secs: u64,
    },
    /// Replace a node's data; with --version, only if the node has that version.
    #[command(after_help = "Examples:\n  \
        lockctl set /app/config v2\n  \
        lockctl set /app/config v3 --version 1")]
    Set {
        /// Path.
        path: String,
        /// New data (UTF-8).
        data: String,
        /// Expected version (compare-and-set).
        #[arg(long)]
        version: Option<u64>,
    },
    /// List a node's children.
    #[command(after_help = "Examples:\n  \
        lockctl ls\n  \
        lockctl ls /app\n  \
        lockctl ls -R /app --max-nodes 10000")]
    Ls {
        /// Path.
        #[arg(default_value = "/")]
        path: String,
        /// Every node under the path, with its stats (version, token, data size,
        /// children, ephemeral owner), parents first.
        #[arg(short = 'R', long)]
        recursive: bool,
        /// With -R: refuse a subtree of more nodes than this.
        #[arg(long, default_value_t = tree::MAX_NODES_DEFAULT)]
        max_nodes: usize,
    },
    /// Delete a node; with --version, only if it has that version; with -r, the node and
    /// everything under it (asks first, unless --yes).
    ///
    /// Examples: lockctl rm /app/flag --version 3; lockctl rm -r /app/old --yes
    #[command(after_help = "Examples:\n  \
        lockctl rm /app/flag\n  \
        lockctl rm /app/flag --version 3\n  \
        lockctl rm -r /app/old --yes")]
    Rm {
        /// Path.
        path: String,
        /// Expected version.
        #[arg(long, conflicts_with = "recursive")]
        version: Option<u64>,
        /// The node and everything under it, deepest first.
        #[arg(short = 'r', long)]
        recursive: bool,
        /// With -r: do not ask (needed without a terminal).
        #[arg(short = 'y', long, requires = "recursive")]
        yes: bool,
        /// With -r: refuse a subtree of more nodes than this.
        #[arg(long, default_value_t = tree::MAX_NODES_DEFAULT)]
        max_nodes: usize,
    },
    /// Hold a lock while a command runs (the command gets LOCK_TOKEN etc.); exit status is
    /// the command's, 3 if not acquired in time, 4 if the lock was lost (or the lease in
    /// doubt, with --on-jeopardy term).
    ///
    /// The command runs in a process group of its own, and stops acting the moment the
    /// lease is in doubt. When the session falls into jeopardy (its local lease, counted
    /// from the last answered KeepAlive's send and shortened for clock drift, ran out
    /// without a renewal: cut off from the cell, the lock may be granted to someone else
    /// as soon as the cell's lease ends, which is a little later), lockctl sends the group
    /// SIGSTOP (--on-jeopardy stop, the default). If the session is confirmed after all
    /// (safe), it sends SIGCONT and the command goes on holding the lock. If the session
    /// expires, the lock is lost: lockctl sends SIGTERM, then SIGCONT (a stopped command
    /// could not act on SIGTERM; note that a SIGTERM handler of the command then runs
    /// after the lock was lost), SIGKILL --kill-after-secs later if the group has not
    /// ended, and exits with status 4. Each transition is a line on stderr, with the
    /// time, and for jeopardy when the last renewal was sent and when the cell's lease
    /// ends at the earliest.
    ///
    /// --on-jeopardy term ends the command at jeopardy instead (as on expiry; lockctl then
    /// releases the lock if the session survives, and exits 4). --on-jeopardy ignore is
    /// the old behaviour and UNSAFE: the command goes on for up to the grace period (45 s)
    /// while the lock may already belong to another holder, and only fencing (the
    /// resource checking LOCK_TOKEN on every write) keeps them apart.
    ///
    /// SIGINT, SIGTERM and SIGHUP sent to lockctl are passed on to the command's group; in
    /// a terminal the command's group is the foreground group while it runs, so it reads
    /// the terminal and gets Ctrl-C itself.
    #[command(after_help = "Examples:\n  \
        lockctl lock /app/leader -- ./run-job.sh\n  \
        lockctl lock /locks/backup --wait-secs 30 --on-jeopardy term -- ./backup.sh\n  \
        lockctl lock /locks/config --mode read -- cat /etc/app.conf")]
    Lock(lock::LockArgs),
    /// Stand in an election at PATH and run a command while leading (exit status as for
    /// `lock`); or, with --observe, print who leads and each change until Ctrl-C.
    ///
    /// The election is the lock queue with each candidate's --data (default: host:pid)
    /// in its node; the leader holds the lowest. The command gets LOCK_TOKEN (its term's
    /// fencing token) and is stopped or ended if leadership is in doubt or lost, as under
    /// `lockctl lock`.
    ///
    /// Examples: lockctl elect /services/indexer/leader --data 10.0.0.7:8080 -- ./indexer;
    /// lockctl elect /services/indexer/leader --observe --json
    #[command(after_help = "Examples:\n  \
        lockctl elect /services/indexer/leader --data 10.0.0.7:8080 -- ./indexer\n  \
        lockctl elect /services/indexer/leader --observe --json")]
    Elect(elect::ElectArgs),
    /// Write KEY=VALUE to a fjall-backed fenced resource under a lock's token; refused (exit
    /// status 5) if a higher token was already accepted for that lock.
    #[command(
        after_help = "Examples:\n  lockctl fenced-write --store /tmp/fenced --lock /app/leader --token 12289 balance 100"
    )]
    FencedWrite {
        /// The store's directory.
        #[arg(long)]
        store: PathBuf,
        /// The lock whose token guards the write.
        #[arg(long)]
        lock: String,
        /// The fencing token.
        #[arg(long)]
        token: u64,
        /// Key.
        key: String,
        /// Value (UTF-8).
        value: String,
    },
    /// Print a value from a fenced resource.
    #[command(after_help = "Examples:\n  lockctl fenced-get --store /tmp/fenced balance")]
    FencedGet {
        /// The store's directory.
        #[arg(long)]
        store: PathBuf,
        /// Key.
        key: String,
    },
    /// Change the cell's membership (one member at a time).
    #[command(subcommand)]
    #[command(after_help = "Examples:\n  \
        lockctl member add-learner 6 10.0.0.6:7101\n  \
        lockctl member promote 6\n  \
        lockctl member remove 3")]
    Member(MemberCommand),
    /// Show each endpoint's proxy counters (the endpoints must be proxies).
    #[command(after_help = "Examples:\n  \
        lockctl --endpoints 127.0.0.1:7201,127.0.0.1:7202 proxy-status\n  \
        lockctl proxy-status --json")]
    ProxyStatus,
    /// Show how long each endpoint (replica or proxy) took to answer each kind of request
    /// since it started: count, p50, p99 and max, timed at the server.
    #[command(after_help = "Examples:\n  \
        lockctl latency\n  \
        lockctl latency --json")]
    Latency,
    /// Without a subcommand: make each replica build a snapshot now and purge its log
    /// behind it (before maintenance, or to measure); prints each one's index, size and
    /// time. `save`, `ls` and `restore`: backups in object storage.
    #[command(after_help = "Examples:\n  \
        lockctl snapshot\n  \
        lockctl snapshot save\n  \
        lockctl snapshot ls --store file:///var/backups/lockservice")]
    Snapshot {
        #[command(subcommand)]
        action: Option<snapshot::SnapshotCommand>,
    },
    /// Make a CA and certificates with identities for replicas, proxies and clients.
    #[command(subcommand)]
    #[command(after_help = "Examples:\n  \
        lockctl certs init ca\n  \
        lockctl certs issue --ca-dir ca --role client --name payments-api --out app\n  \
        lockctl certs show app/client.pem")]
    Certs(certs::CertsCommand),
    /// Show and change who may do what: nodes' ACLs, groups, the cell's admins.
    #[command(subcommand)]
    #[command(after_help = "Examples:\n  \
        lockctl acl ls\n  \
        lockctl acl get /payments\n  \
        lockctl acl set /payments --read group:payments --write group:payments")]
    Acl(acl::AclCommand),
    /// The directory's map of prefixes to cells, kept in the root cell that --endpoints
    /// names: list it, describe cells, place, remove and move prefixes.
    #[command(subcommand)]
    #[command(after_help = "Examples:\n  \
        lockctl --endpoints 127.0.0.1:7201 dir ls\n  \
        lockctl --endpoints 127.0.0.1:7201 dir move /cell-1-demo --to cell-2")]
    Dir(dir::DirCommand),
    /// Run one directory instance in this process (used by `lockctl dev` and the tests;
    /// same as the `directory` binary).
    #[command(hide = true)]
    Directory {
        /// Address to listen on (UDP).
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// The root cell's endpoints, comma-separated.
        #[arg(long, value_delimiter = ',')]
        root: Vec<String>,
        /// A TLS directory holding ca.pem, directory.pem and directory.key.
        #[arg(long)]
        tls_dir: PathBuf,
        /// Serve /metrics, /health and /ready over HTTP on this TCP address.
        #[arg(long)]
        metrics_listen: Option<std::net::SocketAddr>,
    },
    /// Run one proxy in this process (used by `lockctl dev`; same as the `proxy` binary).
    #[command(hide = true)]
    Proxy {
        /// Configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run one replica in this process (used by `lockctl dev`; same as the `replica` binary).
    #[command(hide = true)]
    Replica {
        /// Configuration file.
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum MemberCommand {
    /// Add a non-voting learner; returns once it has caught up.
    #[command(after_help = "Examples:\n  lockctl member add-learner 6 10.0.0.6:7101")]
    AddLearner {
        /// Its replica id.
        id: u64,
        /// Its address (host:port).
        addr: String,
    },
    /// Promote a learner to voter.
    #[command(after_help = "Examples:\n  lockctl member promote 6")]
    Promote {
        /// Its replica id.
        id: u64,
    },
    /// Remove a voter or learner.
    #[command(after_help = "Examples:\n  lockctl member remove 3")]
    Remove {
        /// Its replica id.
        id: u64,
    },
    /// Hand the leadership to another voter (before maintenance on the leader; a replica
    /// stopped with SIGTERM while leading does it by itself). Returns once it leads.
    #[command(
        after_help = "Examples:\n  lockctl member transfer-leader\n  lockctl member transfer-leader 3"
    )]
    TransferLeader {
        /// The voter to hand over to (default: the follower whose log reaches furthest).
        id: Option<u64>,
    },
}

fn main() {
    let cli = Cli::parse();
    let filter = if matches!(
        cli.command,
        Command::Replica { .. } | Command::Proxy { .. } | Command::Directory { .. }
    ) {
        "info,openraft=warn,fjall=warn,lsm_tree=warn,quinn=warn"
    } else {
        "warn"
    };
    if let Err(e) = wire::logs::init(filter) {
        say!("lockctl: {e}");
        std::process::exit(2);
    }
    if let Err(e) = run(cli) {
        say!("lockctl: {e:#}");
        std::process::exit(exit_code(&e));
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Replica { config } => return dev::run_replica(config),
        Command::Proxy { config } => return dev::run_proxy(config),
        Command::Directory {
            listen,
            root,
            tls_dir,
            metrics_listen,
        } => {
            return directory::run_until_signal(directory::DirectoryConfig {
                listen: *listen,
                root: root.clone(),
                tls: wire::tls::TlsConfig {
                    ca: tls_dir.join(wire::tls::CA_FILE),
                    cert: tls_dir.join("directory.pem"),
                    key: tls_dir.join("directory.key"),
                    crls: Vec::new(),
                },
                refresh: Duration::from_secs(30),
                metrics_listen: *metrics_listen,
            })
        }
        Command::Certs(cmd) => return certs::run(cmd),
        Command::Snapshot {
            action:
                Some(
                    snapshot::SnapshotCommand::Ls { .. }
                    | snapshot::SnapshotCommand::Restore { .. },
                ),
        } => {
            let Command::Snapshot {
                action: Some(action),
            } = cli.command
            else {
                unreachable!("matched above")
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            return rt.block_on(snapshot::run_offline(action, cli.json));
        }
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut cmd, "lockctl", &mut std::io::stdout());
            return Ok(());
        }
        Command::FencedWrite {
            store,
            lock,
            token,
            key,
            value,
        } => {
            let store = fenced::FencedStore::open(store)?;
            match store.write(lock, *token, key, value.as_bytes())? {
                Ok(()) => {
                    println!("wrote {key} under {lock} token {token}");
                    return Ok(());
                }
                Err(stale) => {
                    say!("lockctl: refused: {stale}");
                    std::process::exit(5);
                }
            }
        }
        Command::FencedGet { store, key } => {
            let store = fenced::FencedStore::open(store)?;
            match store.get(key)? {
                Some(v) => println!("{}", String::from_utf8_lossy(&v)),
                None => anyhow::bail!("no value for {key}"),
            }
            return Ok(());
        }
        _ => {}
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // Settings (flags, environment, the settings file) before the command is taken apart;
    // `dev` needs none of them.
    let r = match &cli.command {
        Command::Dev(_) => None,
        _ => Some(reach(&cli)?),
    };
    rt.block_on(async move {
        match (cli.command, r) {
            (Command::Dev(args), _) => dev::run(args).await,
            (other, Some(r)) => {
                command(&r.endpoints, &r.tls, r.timeout_secs, cli.json, other).await
            }
            (_, None) => unreachable!("settings are read for every command but dev"),
        }
    })
}

/// The client's TLS files from the command line (certificate and key default to the
/// SDK's: next to the CA).
#[derive(Debug, Clone)]
struct ClientTls {
    ca: PathBuf,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

async fn connect(endpoints: &str, tls: &ClientTls, timeout_secs: u64) -> anyhow::Result<Client> {
    let mut cfg = ClientConfig::new(
        endpoints
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect(),
        tls.ca.clone(),
    );
    if let Some(cert) = &tls.cert {
        cfg.cert = cert.clone();
    }
    if let Some(key) = &tls.key {
        cfg.key = key.clone();
    }
    let ca = &tls.ca;
    cfg.request_timeout = Duration::from_secs(timeout_secs);
    // Admin operations (a snapshot, a learner catching up) may take one long answer; a
    // dead replica is still detected by the connection probe within seconds.
    cfg.attempt_timeout = cfg.attempt_timeout.max(cfg.request_timeout);
    cfg.agent = format!("lockctl {}", env!("CARGO_PKG_VERSION"));
    Client::connect(cfg)
        .await
        .with_context(|| format!("cannot reach the cell (CA {})", ca.display()))
}

async fn command(
    endpoints: &str,
    tls: &ClientTls,
    timeout_secs: u64,
    json: bool,
    cmd: Command,
) -> anyhow::Result<()> {
    let client = connect(endpoints, tls, timeout_secs).await?;
    match cmd {
        Command::Status { full } if json || full => {
            let (mut answered, mut errors) = (0, Vec::new());
            for addr in client.endpoints() {
                let r = client.status_of(addr).await;
                answered += usize::from(r.is_ok());
                if let Err(e) = &r {
                    errors.push(e.clone());
                }
                match (r, json) {
                    // The latency histograms are `lockctl latency --json`'s.
                    (Ok(mut s), true) => {
                        s.request_latency.clear();
                        println!(
                            "{}",
                            serde_json::json!({ "endpoint": addr.to_string(), "status": s })
                        )
                    }
                    (Err(e), true) => println!(
                        "{}",
                        serde_json::json!({ "endpoint": addr.to_string(), "error": e.to_string() })
                    ),
                    (Ok(s), false) => println!("{addr}: {s:#?}"),
                    (Err(e), false) => println!("{addr}: {e}"),
                }
            }
            if answered == 0 {
                return Err(none_answered(errors));
            }
            Ok(())
        }
        Command::Status { .. } => match dev::print_status(&client).await? {
            (0, errors) => Err(none_answered(errors)),
            _ => Ok(()),
        },
        Command::Watch(args) => watch::run(&client, args, json).await,
        Command::CheckSequencer {
            node,
            token,
            session,
        } => {
            wire::path::validate(&node)?;
            let op = Op::CheckSequencer {
                path: node.clone(),
                token,
                session,
            };
            match client.request(op).await? {
                Reply::Sequencer { current } => {
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({ "node": node, "token": token, "session": session, "current": current })
                        );
                    } else if current {
                        println!("{node} token {token}: current holder");
                    } else {
                        println!("{node} token {token}: NOT the holder any more");
                    }
                    if !current {
                        std::process::exit(4);
                    }
                    Ok(())
                }
                other => anyhow::bail!("unexpected reply {other:?}"),
            }
        }
        Command::Create {
            path,
            data,
            ephemeral,
            sequential,
        } => {
            let session = client.open_session().await?;
            let r = session
                .create(
                    &path,
                    data.into_bytes(),
                    CreateMode {
                        ephemeral,
                        sequential,
                    },
                )
                .await;
            session.close().await?;
            let c = r?;
            println!("created {} (token {})", c.path, c.stat.token);
            Ok(())
        }
        Command::WatchCached {
            path,
            every_ms,
            for_secs,
        } => {
            let session = client.open_session().await?;
            let until = std::time::Instant::now() + Duration::from_secs(for_secs);
            let wall_us = || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_micros())
                    .unwrap_or(0)
            };
            while std::time::Instant::now() < until {
                let hits = session.cache_stats().hits;
                let start_us = wall_us();
                let r = session.get_cached(&path).await;
                let end_us = wall_us();
                let from = if session.cache_stats().hits > hits {
                    "cache"
                } else {
                    "cell"
                };
                match r {
                    Ok(Some((data, stat))) => println!(
                        "{start_us} {end_us} {from} version={} {}",
                        stat.version,
                        String::from_utf8_lossy(&data)
                    ),
                    Ok(None) => println!("{start_us} {end_us} {from} absent"),
                    Err(e) => println!("{start_us} {end_us} error: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(every_ms)).await;
            }
            session.close().await?;
            Ok(())
        }
        Command::Get { path } => {
            let (data, stat) = client.get(&path).await?;
            if json {
                println!("{}", watch::node_json(&path, &data, &stat));
                return Ok(());
            }
            println!("{}", String::from_utf8_lossy(&data));
            eprintln!(
                "version={} create_index={} token={} mod_index={} children={} ephemeral_owner={}",
                stat.version,
                stat.create_index,
                stat.token,
                stat.mod_index,
                stat.children_count,
                stat.ephemeral_owner
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| "-".into())
            );
            Ok(())
        }
        Command::Set {
            path,
            data,
            version,
        } => {
            let session = client.open_session().await?;
            let r = session.set_data(&path, data.into_bytes(), version).await;
            session.close().await?;
            let stat = r?;
            println!("{path} now at version {}", stat.version);
            Ok(())
        }
        Command::Ls {
            path,
            recursive: true,
            max_nodes,
        } => {
            let nodes = tree::walk(&client, &path, max_nodes).await?;
            if json {
                let nodes: Vec<_> = nodes
                    .iter()
                    .map(|(p, stat)| serde_json::json!({ "path": p, "stat": stat }))
                    .collect();
                println!("{}", serde_json::json!({ "path": path, "nodes": nodes }));
            } else {
                for (p, stat) in &nodes {
                    println!("{}", tree::line(p, stat));
                }
            }
            Ok(())
        }
        Command::Ls { path, .. } if json => {
            let children: Vec<_> = client
                .children(&path)
                .await?
                .into_iter()
                .map(|(name, stat)| serde_json::json!({ "name": name, "stat": stat }))
                .collect();
            println!(
                "{}",
                serde_json::json!({ "path": path, "children": children })
            );
            Ok(())
        }
        Command::Ls { path, .. } => {
            for (name, stat) in client.children(&path).await? {
                let flag = if stat.ephemeral_owner.is_some() {
                    " (ephemeral)"
                } else {
                    ""
                };
                println!(
                    "{name}\tversion={} token={}{flag}",
                    stat.version, stat.token
                );
            }
            Ok(())
        }
        Command::Rm {
            path,
            recursive: true,
            yes,
            max_nodes,
            ..
        } => {
            let n = tree::remove(&client, &path, yes, max_nodes).await?;
            println!("deleted {path} and everything under it ({n} nodes)");
            Ok(())
        }
        Command::Rm { path, version, .. } => {
            let session = client.open_session().await?;
            let r = session.delete(&path, version).await;
            session.close().await?;
            r?;
            println!("deleted {path}");
            Ok(())
        }
        Command::Member(m) => {
            let op = match m {
                MemberCommand::AddLearner { id, addr } => Op::AddLearner { id, addr },
                MemberCommand::Promote { id } => Op::Promote { id },
                MemberCommand::Remove { id } => Op::RemoveMember { id },
                MemberCommand::TransferLeader { id } => {
                    return match client.request(Op::TransferLeader { to: id }).await? {
                        Reply::LeaderTransferred { from, to, took_ms } => {
                            println!("replica {to} leads (was {from}; {took_ms} ms)");
                            Ok(())
                        }
                        other => anyhow::bail!("unexpected reply {other:?}"),
                    };
                }
            };
            match client.request(op).await? {
                Reply::MembershipChanged { members } => {
                    for m in members {
                        println!(
                            "{}\t{}\t{}\t{}",
                            m.id,
                            m.addr,
                            if m.voter { "voter" } else { "learner" },
                            m.store
                        );
                    }
                    Ok(())
                }
                other => anyhow::bail!("unexpected reply {other:?}"),
            }
        }
        Command::Sessions { owner } => {
            let mut listed = Vec::new();
            let mut after = 0;
            // Bounded: each page moves `after` forward, and the cell holds finitely many.
            loop {
                let op = Op::Sessions {
                    after,
                    limit: wire::types::SESSIONS_PAGE_MAX,
                };
                let (page, more) = match client.request(op).await? {
                    Reply::Sessions { sessions, more } => (sessions, more),
                    other => anyhow::bail!("unexpected reply {other:?}"),
                };
                let Some(last) = page.last().map(|s| s.id) else {
                    break;
                };
                anyhow::ensure!(last > after, "the cell listed sessions out of order");
                after = last;
                listed.extend(
                    page.into_iter()
                        .filter(|s| owner.as_ref().is_none_or(|o| &s.owner == o)),
                );
                if !more {
                    break;
                }
            }
            if json {
                println!("{}", serde_json::json!({ "sessions": listed }));
                return Ok(());
            }
            println!(
                "{:<12} {:<32} {:>10} {:>6} {:>10}  ephemeral nodes",
                "session", "owner", "lease left", "caches", "ephemerals"
            );
            for s in &listed {
                let lease = s
                    .lease_left_ms
                    .map_or("-".to_string(), |ms| format!("{:.1} s", ms as f64 / 1000.0));
                let mut paths = s.ephemeral_paths.join(" ");
                if s.ephemerals as usize > s.ephemeral_paths.len() {
                    paths.push_str(" ...");
                }
                println!(
                    "{:<12} {:<32} {:>10} {:>6} {:>10}  {paths}",
                    s.id,
                    s.owner,
                    lease,
                    if s.caches { "yes" } else { "no" },
                    s.ephemerals,
                );
            }
            println!("{} session(s)", listed.len());
            Ok(())
        }
        Command::Elect(args) => {
            let code = elect::run(&client, args, json).await?;
            if code != 0 {
                std::process::exit(code);
            }
            Ok(())
        }
        Command::Lock(args) => {
            let code = lock::run(&client, args).await?;
            if code != 0 {
                std::process::exit(code);
            }
            Ok(())
        }
        Command::Latency => {
            for addr in client.endpoints() {
                let (what, lat) = match client.status_of(addr).await {
                    Ok(s) => ("replica", s.request_latency),
                    Err(_) => match client.proxy_status_of(addr).await {
                        Ok(s) => ("proxy", s.request_latency),
                        Err(e) if json => {
                            println!(
                                "{}",
                                serde_json::json!({ "endpoint": addr.to_string(), "error": e.to_string() })
                            );
                            continue;
                        }
                        Err(e) => {
                            println!("{addr}: {e}");
                            continue;
                        }
                    },
                };
                if json {
                    let ops: Vec<_> = lat
                        .iter()
                        .filter_map(|l| {
                            let s = wire::latency::summarize(&l.histogram().ok()?);
                            Some(serde_json::json!({
                                "request": l.op, "count": s.count, "p50_ms": s.p50_ms,
                                "p99_ms": s.p99_ms, "max_ms": s.max_ms,
                            }))
                        })
                        .collect();
                    println!(
                        "{}",
                        serde_json::json!({ "endpoint": addr.to_string(), "kind": what, "requests": ops })
                    );
                    continue;
                }
                println!("{addr} ({what})");
                println!(
                    "  {:<22} {:>10} {:>10} {:>10} {:>10}",
                    "request", "count", "p50 ms", "p99 ms", "max ms"
                );
                for l in &lat {
                    match l.histogram() {
                        Ok(h) => {
                            let s = wire::latency::summarize(&h);
                            println!(
                                "  {:<22} {:>10} {:>10.2} {:>10.2} {:>10.2}",
                                l.op, s.count, s.p50_ms, s.p99_ms, s.max_ms
                            );
                        }
                        Err(e) => println!("  {:<22} {e}", l.op),
                    }
                }
            }
            Ok(())
        }
        Command::ProxyStatus if json => {
            for addr in client.endpoints() {
                let v = match client.proxy_status_of(addr).await {
                    Ok(s) => serde_json::json!({ "endpoint": addr.to_string(), "status": s }),
                    Err(e) => {
                        serde_json::json!({ "endpoint": addr.to_string(), "error": e.to_string() })
                    }
                };
                println!("{v}");
            }
            Ok(())
        }
        Command::ProxyStatus => {
            println!(
                "{:<18} {:>7} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}",
                "proxy",
                "clients",
                "sessions",
                "batches",
                "renewals",
                "hits",
                "reads",
                "writes",
                "invals",
                "watches",
                "pending",
                "oldest-ms"
            );
            for addr in client.endpoints() {
                match client.proxy_status_of(addr).await {
                    Ok(s) => println!(
                        "{:<18} {:>7} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}",
                        addr.to_string(),
                        s.clients,
                        s.sessions,
                        s.keepalive_batches,
                        s.keepalives_batched,
                        s.cache_hits,
                        s.upstream_reads,
                        s.upstream_writes,
                        s.invalidations_relayed,
                        s.upstream_watches,
                        s.pending_invalidations,
                        s.oldest_pending_ms
                    ),
                    Err(e) => println!("{:<18} {e}", addr.to_string()),
                }
            }
            Ok(())
        }
        Command::Snapshot {
            action: Some(snapshot::SnapshotCommand::Save),
        } => match client.request(Op::Backup).await? {
            Reply::BackupTaken {
                store,
                object,
                index,
                bytes,
                digest,
                total_ms,
                pruned,
            } => {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "store": store,
                            "object": object,
                            "index": index,
                            "bytes": bytes,
                            "digest": format!("{digest:016x}"),
                            "ms": total_ms,
                            "pruned": pruned,
                        })
                    );
                } else {
                    println!(
                        "{object}: index {index}, digest {digest:016x}, {bytes} bytes, \
                         written to {store} in {total_ms} ms ({pruned} older deleted)"
                    );
                }
                Ok(())
            }
            other => anyhow::bail!("unexpected reply {other:?}"),
        },
        Command::Snapshot {
            action:
                Some(
                    snapshot::SnapshotCommand::Ls { .. }
                    | snapshot::SnapshotCommand::Restore { .. },
                ),
        } => unreachable!("run without the cell"),
        Command::Snapshot { action: None } => {
            let mut failed = false;
            for addr in client.endpoints() {
                let req = wire::types::Request {
                    session: 0,
                    request_id: 0,
                    ack_below: 0,
                    op: Op::Snapshot,
                };
                match client.call_at(addr, &req).await {
                    Ok(Reply::SnapshotTaken {
                        index,
                        bytes,
                        serialize_ms,
                        total_ms,
                    }) => println!(
                        "{addr}	snapshot at index {index}: {bytes} bytes, serialized in \
                         {serialize_ms} ms, written in {total_ms} ms"
                    ),
                    Ok(other) => {
                        failed = true;
                        println!("{addr}	unexpected reply {other:?}")
                    }
                    Err(e) => {
                        failed = true;
                        println!("{addr}	{e}")
                    }
                }
            }
            if failed {
                anyhow::bail!("not every replica took a snapshot");
            }
            Ok(())
        }
        Command::Acl(cmd) => acl::run(&client, cmd).await,
        Command::Dir(cmd) => dir::run(&client, client.config(), cmd).await,
        Command::Dev(_)
        | Command::Directory { .. }
        | Command::Certs(_)
        | Command::Completions { .. }
        | Command::Proxy { .. }
        | Command::Replica { .. }
        | Command::FencedWrite { .. }
        | Command::FencedGet { .. } => {
            unreachable!("handled above")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own consistency checks over every command and argument (a global option
    /// must not share its id with a subcommand's argument, for one).
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        // `--key` is global and `fenced-write` has a KEY argument: both parse.
        let cli = Cli::try_parse_from([
            "lockctl",
            "--key",
            "c.key",
            "fenced-write",
            "--store",
            "s",
            "--lock",
            "/l",
            "--token",
            "1",
            "k",
            "v",
        ])
        .unwrap();
        assert_eq!(cli.tls_key, Some(PathBuf::from("c.key")));
    }

    /// Splits an example line as a shell would, enough for `--help` examples: words at
    /// whitespace, '...' and "..." quoting (no escapes), and the command ends at an
    /// unquoted `|`, `>`, `&&`, ... (what follows is the shell's, not lockctl's).
    fn shell_words(line: &str) -> Vec<String> {
        let mut words = Vec::new();
        let mut word = String::new();
        let mut in_word = false;
        let mut quoted = false;
        let mut quote = None;
        let mut chars = line.chars();
        loop {
            let c = chars.next();
            match (quote, c) {
                (Some(q), Some(c)) if c == q => quote = None,
                (Some(_), Some(c)) => word.push(c),
                (Some(q), None) => panic!("{line:?}: unclosed {q}"),
                (None, Some(c @ ('\'' | '"'))) => {
                    quote = Some(c);
                    in_word = true;
                    quoted = true;
                }
                (None, Some(c)) if !c.is_whitespace() => {
                    word.push(c);
                    in_word = true;
                }
                (None, c) => {
                    if in_word {
                        let operator = matches!(
                            word.as_str(),
                            "|" | "||" | "&&" | ";" | "&" | ">" | ">>" | "<" | "2>"
                        );
                        if operator && !quoted {
                            return words;
                        }
                        words.push(std::mem::take(&mut word));
                        in_word = false;
                        quoted = false;
                    }
                    if c.is_none() {
                        return words;
                    }
                }
            }
        }
    }

    #[test]
    fn shell_words_splits_like_a_shell() {
        assert_eq!(
            shell_words(r#"lockctl a 'b c' "d'e" f'g h'i"#),
            ["lockctl", "a", "b c", "d'e", "fg hi"]
        );
        assert_eq!(
            shell_words("lockctl completions bash > /x"),
            ["lockctl", "completions", "bash"]
        );
        assert_eq!(shell_words("lockctl get '>' | jq"), ["lockctl", "get", ">"]);
        assert_eq!(
            shell_words("lockctl acl set /p --read '*'"),
            ["lockctl", "acl", "set", "/p", "--read", "*"]
        );
    }

    /// The example lines of an `after_help` (after its "Examples:" line; a line ending
    /// with a backslash goes on on the next).
    fn examples(after_help: &str) -> Vec<String> {
        let mut lines = Vec::new();
        let mut pending = String::new();
        let start = after_help.find("Examples:").unwrap_or(after_help.len());
        for line in after_help[start..].lines().skip(1) {
            let line = line.trim();
            match line.strip_suffix('\\') {
                Some(head) => {
                    pending.push_str(head);
                    pending.push(' ');
                }
                None => {
                    pending.push_str(line);
                    lines.push(std::mem::take(&mut pending));
                }
            }
        }
        lines.push(pending);
        lines.retain(|l| l.starts_with("lockctl "));
        lines
    }

    /// Issue 28: every visible command's `--help` ends with examples, and every example
    /// parses, as the command it is listed under (or one of its subcommands).
    #[test]
    fn every_command_has_examples_that_parse() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &[String], checked: &mut usize) {
            let name = path.join(" ");
            let after_help = cmd
                .get_after_help()
                .map(|h| h.to_string())
                .unwrap_or_default();
            assert!(
                after_help.contains("Examples:"),
                "`{name} --help` has no Examples: block"
            );
            let lines = examples(&after_help);
            assert!(!lines.is_empty(), "`{name} --help`: no example lines");
            for line in &lines {
                let words = shell_words(line);
                if let Err(e) = Cli::try_parse_from(&words) {
                    panic!("`{name} --help`: example {line:?} does not parse: {e}");
                }
                let mut m = Cli::command()
                    .try_get_matches_from(&words)
                    .unwrap_or_else(|e| panic!("`{name} --help`: example {line:?}: {e}"));
                let mut ran = vec!["lockctl".to_string()];
                while let Some((sub, sub_m)) = m.remove_subcommand() {
                    ran.push(sub);
                    m = sub_m;
                }
                assert!(
                    ran.starts_with(path),
                    "`{name} --help`: example {line:?} runs `{}`",
                    ran.join(" ")
                );
                *checked += 1;
            }
            for sub in cmd.get_subcommands() {
                if sub.is_hide_set() || sub.get_name() == "help" {
                    continue;
                }
                let mut sub_path = path.to_vec();
                sub_path.push(sub.get_name().to_string());
                walk(sub, &sub_path, checked);
            }
        }
        let mut cmd = Cli::command();
        cmd.build();
        let mut checked = 0;
        walk(&cmd, &["lockctl".to_string()], &mut checked);
        assert!(checked > 60, "only {checked} examples checked");
    }

    /// Flags win over the settings file, the file over the defaults; the file's relative
    /// paths are its directory's; a CA given by flag comes without the file's certificate
    /// and key; a key the file should not have is an error naming it.
    #[test]
    fn settings_file_between_flags_and_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("lockctl.toml");
        std::fs::write(
            &file,
            "endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\nca = \"tls/ca.pem\"\ntimeout_secs = 3\n\
             cert = \"tls/me.pem\"\nkey = \"tls/me.key\"\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let cli = Cli::try_parse_from(["lockctl", "--config", f, "status"]).unwrap();
        let r = reach(&cli).unwrap();
        assert_eq!(r.endpoints, "127.0.0.1:1,127.0.0.1:2");
        assert_eq!(r.tls.ca, dir.path().join("tls/ca.pem"));
        assert_eq!(r.timeout_secs, 3);
        assert_eq!(r.tls.cert, Some(dir.path().join("tls/me.pem")));
        assert_eq!(r.tls.key, Some(dir.path().join("tls/me.key")));
        let cli =
            Cli::try_parse_from(["lockctl", "--config", f, "--ca", "/other/ca.pem", "status"])
                .unwrap();
        let r = reach(&cli).unwrap();
        assert_eq!(r.tls.ca, PathBuf::from("/other/ca.pem"));
        assert_eq!((r.tls.cert, r.tls.key), (None, None));
        let cli = Cli::try_parse_from([
            "lockctl",
            "--config",
            f,
            "--endpoints",
            "127.0.0.1:9",
            "--timeout-secs",
            "7",
            "status",
        ])
        .unwrap();
        let r = reach(&cli).unwrap();
        assert_eq!((r.endpoints.as_str(), r.timeout_secs), ("127.0.0.1:9", 7));
        assert_eq!(r.tls.ca, dir.path().join("tls/ca.pem"));

        std::fs::write(&file, "endpoint = \"127.0.0.1:1\"\n").unwrap();
        let cli = Cli::try_parse_from(["lockctl", "--config", f, "status"]).unwrap();
        let e = format!("{:#}", reach(&cli).unwrap_err());
        assert!(e.contains("endpoint") && e.contains("lockctl.toml"), "{e}");
        let missing = dir.path().join("none.toml");
        let cli = Cli::try_parse_from(["lockctl", "--config", missing.to_str().unwrap(), "status"])
            .unwrap();
        assert!(format!("{:#}", reach(&cli).unwrap_err()).contains("none.toml"));
    }
}
