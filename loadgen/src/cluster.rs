//! Starting the system under test on loopback: our cell (with `lockctl dev`, replica and
//! proxy processes), or etcd / ZooKeeper members (with `ops/bench/peers.sh`); finding its
//! processes and its leader; stopping it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{bail, Context};

/// Which system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum System {
    /// This lock service.
    Ours,
    /// etcd 3.4 (Debian's `etcd-server`).
    Etcd,
    /// ZooKeeper 3.8 (Debian's `zookeeper`).
    Zk,
}

impl System {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            System::Ours => "ours",
            System::Etcd => "etcd",
            System::Zk => "zookeeper",
        }
    }
}

/// A running cluster.
pub struct Cluster {
    pub system: System,
    /// Client endpoints (for ours: the proxies if any, else the replicas).
    pub endpoints: Vec<String>,
    /// Replica endpoints (ours) or member endpoints.
    pub members: Vec<String>,
    /// CA file (ours).
    pub ca: PathBuf,
    dir: PathBuf,
    dev: Option<Child>,
    /// Replica processes loadgen started itself (restarts, learners).
    spawned: std::sync::Mutex<Vec<Child>>,
    /// The CPUs every server process starts on (`--server-cpus`), restarts included.
    cpus: Option<crate::pinning::Cpus>,
    _tmp: Option<tempfile::TempDir>,
}

pub(crate) fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var(format!("LOADGEN_{}", name.to_uppercase())) {
        return Ok(p.into());
    }
    let me = std::env::current_exe()?;
    let p = me.parent().context("exe dir")?.join(name);
    if !p.exists() {
        bail!(
            "{} not found next to loadgen: build it first (cargo build --release --bins)",
            p.display()
        );
    }
    Ok(p)
}

/// Where each kind of server searches for free ports: disjoint regions, so that two
/// loadgen processes at once (the test command runs an etcd, a ZooKeeper and one of our
/// cells side by side) never pick the same ports. A port is only known free when it is
/// checked; a server binds it later (ZooKeeper's JVMs bind their quorum ports seconds
/// after they start, its leader's only once elected), so another process searching the
/// same region in between could take it. Within its region a process starts at an
/// offset from its pid, so two runs of one kind are unlikely to collide either (the
/// tests run one of each kind at a time). All below Linux's ephemeral range (32 768).
#[derive(Clone, Copy)]
enum Ports {
    /// Our cell's replicas and proxies (`lockctl dev`).
    Ours,
    /// An etcd cluster: a client and a peer port per member.
    Etcd,
    /// A ZooKeeper ensemble: client ports at the base, quorum and election ports 100 up.
    Zk,
    /// A replica started later (a learner).
    NewReplica,
    /// An etcd member added later.
    NewEtcdMember,
}

impl Ports {
    /// Where this kind's search starts.
    fn from(self) -> u16 {
        let (start, width) = match self {
            Ports::Ours => (20_000, 4_000),
            Ports::Etcd => (24_100, 1_900),
            Ports::Zk => (26_100, 1_800),
            Ports::NewReplica => (28_100, 1_900),
            Ports::NewEtcdMember => (30_100, 1_900),
        };
        start + (std::process::id() % width) as u16
    }
}

/// The first of `n` consecutive free loopback ports (TCP and UDP), searching from `from`
/// up to 60 000, then from 10 000. Servers' ports are best kept below Linux's ephemeral
/// range (32 768 and up): after a run with many short connections, tens of thousands of
/// ephemeral ports sit in TIME_WAIT, where nothing may listen.
///
/// A range once returned is never returned again in this process: two clusters started
/// at once (tests run in parallel) both found the same ports free before either bound
/// them, and the second's members, unable to bind, left it talking to the first's, which
/// went away with the first test (`a_quiet_connection_is_not_sent_away_for_its_pings`
/// failed with a broken pipe when run beside another etcd test). A process starts tens of
/// clusters at most, so the ports are not handed back.
pub(crate) fn free_base(n: u16, from: u16) -> u16 {
    static TAKEN: std::sync::Mutex<Vec<(u16, u16)>> = std::sync::Mutex::new(Vec::new());
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    let candidates = (from..60_000).step_by(16).chain((10_000..from).step_by(16));
    'outer: for base in candidates {
        let end = base.saturating_add(n);
        if taken.iter().any(|&(b, e)| base < e && b < end) {
            continue;
        }
        for p in base..base + n {
            if std::net::UdpSocket::bind(("127.0.0.1", p)).is_err()
                || std::net::TcpListener::bind(("127.0.0.1", p)).is_err()
            {
                continue 'outer;
            }
        }
        taken.push((base, end));
        return base;
    }
    panic!("no {n} consecutive free ports on 127.0.0.1");
}

fn bench_script() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("LOADGEN_PEERS_SH") {
        return Ok(p.into());
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/bench/peers.sh");
    if !p.exists() {
        bail!("{} not found (set LOADGEN_PEERS_SH)", p.display());
    }
    Ok(p)
}

/// Connections each of our replicas accepts from loadgen, in total and from one address
/// (see `Cluster::start_ours`).
pub const CONNECTIONS_MAX: usize = 16_384;

impl Cluster {
    /// Starts `members` members of `system` (and, for ours, `proxies` proxies) with a
    /// session lease of `lease_ms`, every server process started on `cpus` if given (and
    /// so sized for them: [`crate::pinning::start_on`]).
    pub fn start(
        system: System,
        members: u16,
        proxies: u16,
        lease_ms: u64,
        cpus: Option<crate::pinning::Cpus>,
    ) -> anyhow::Result<Cluster> {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("loadgen-{}-", system.name()))
            .tempdir()?;
        match system {
            System::Ours => Cluster::start_ours(tmp, members, proxies, lease_ms, cpus),
            System::Etcd | System::Zk => Cluster::start_peers(system, tmp, members, cpus),
        }
    }

    /// `cmd`, started on the servers' CPUs if the cluster has them.
    fn on_cpus(cpus: &Option<crate::pinning::Cpus>, mut cmd: Command) -> Command {
        if let Some(c) = cpus {
            crate::pinning::start_on(&mut cmd, c);
        }
        cmd
    }

    /// Our cell: `lockctl dev` with `members` replicas and `proxies` proxies, on free
    /// ports, its data in `tmp`; returns once it says it runs.
    fn start_ours(
        tmp: tempfile::TempDir,
        members: u16,
        proxies: u16,
        lease_ms: u64,
        cpus: Option<crate::pinning::Cpus>,
    ) -> anyhow::Result<Cluster> {
        let system = System::Ours;
        let dir = tmp.path().to_path_buf();
        let base = free_base(members + 1, Ports::Ours.from());
        let pbase = free_base(proxies.max(1), base + 16);
        let mut dev = Cluster::on_cpus(&cpus, Command::new(sibling("lockctl")?))
            .args(["dev", "--no-demo", "--replicas", &members.to_string()])
            .args(["--base-port", &base.to_string()])
            .args(["--proxies", &proxies.to_string()])
            .args(["--proxy-base-port", &pbase.to_string()])
            .args(["--lease-ms", &lease_ms.to_string()])
            .arg("--data")
            .arg(dir.join("cell"))
            // Every client here comes from one address, 127.0.0.1, where a real cell's
            // come from many hosts: the replicas' per-source connection limit (256) and
            // total (4 096) are lifted, as `peers.sh` lifts ZooKeeper's per-address one
            // (`maxClientCnxns=0`; etcd has none). `burst` opens a connection per arrival.
            .env(
                "LOCKSVC_REPLICA__LIMITS__CONNECTIONS_MAX",
                CONNECTIONS_MAX.to_string(),
            )
            .env(
                "LOCKSVC_REPLICA__LIMITS__CONNECTIONS_PER_SOURCE_MAX",
                CONNECTIONS_MAX.to_string(),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("start lockctl dev")?;
        let mut lines = BufReader::new(dev.stdout.take().expect("stdout")).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut up = false;
        while Instant::now() < deadline {
            match lines.next() {
                Some(Ok(l)) if l.starts_with("cell running") => {
                    up = true;
                    break;
                }
                Some(Ok(_)) => {}
                _ => break,
            }
        }
        std::thread::spawn(move || for _ in lines {});
        if !up {
            let _ = dev.kill();
            bail!("our cell did not start");
        }
        let members_v: Vec<String> = (0..members)
            .map(|i| format!("127.0.0.1:{}", base + i))
            .collect();
        let proxies_v: Vec<String> = (0..proxies)
            .map(|i| format!("127.0.0.1:{}", pbase + i))
            .collect();
        Ok(Cluster {
            system,
            endpoints: if proxies_v.is_empty() {
                members_v.clone()
            } else {
                proxies_v
            },
            members: members_v,
            ca: dir.join("cell/tls/ca.pem"),
            dir,
            dev: Some(dev),
            spawned: Default::default(),
            cpus,
            _tmp: Some(tmp),
        })
    }

    /// etcd or ZooKeeper: `members` members started by `ops/bench/peers.sh` on free ports,
    /// their data in `tmp`.
    fn start_peers(
        system: System,
        tmp: tempfile::TempDir,
        members: u16,
        cpus: Option<crate::pinning::Cpus>,
    ) -> anyhow::Result<Cluster> {
        let dir = tmp.path().to_path_buf();
        let (kind, ports, region) = match system {
            System::Etcd => ("etcd", members * 2, Ports::Etcd),
            _ => ("zk", 100 + members * 2, Ports::Zk),
        };
        let base = free_base(ports, region.from());
        let out = Cluster::on_cpus(&cpus, Command::new(bench_script()?))
            .args([
                kind,
                dir.to_str().context("dir")?,
                &members.to_string(),
                &base.to_string(),
            ])
            .output()
            .context("run ops/bench/peers.sh")?;
        if !out.status.success() {
            bail!(
                "peers.sh {kind} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let endpoints: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(',')
            .map(String::from)
            .collect();
        let c = Cluster {
            system,
            endpoints: endpoints.clone(),
            members: endpoints,
            ca: PathBuf::new(),
            dir,
            dev: None,
            spawned: Default::default(),
            cpus,
            _tmp: Some(tmp),
        };
        Ok(c)
    }

    /// Every server process: (name, pid).
    pub fn processes(&self) -> Vec<(String, u32)> {
        processes_of(self.system, &self.dir)
    }

    /// The pid of the process serving member endpoint `addr`.
    pub fn pid_of(&self, addr: &str) -> Option<u32> {
        match self.system {
            System::Ours => self.replica_pid(self.members.iter().position(|m| m == addr)? + 1),
            _ => std::fs::read_to_string(self.dir.join("pids"))
                .ok()?
                .lines()
                .find(|l| l.ends_with(addr))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok()),
        }
    }

    /// The member endpoint of the current leader.
    pub async fn leader(&self) -> anyhow::Result<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(l) = self.leader_once().await {
                return Ok(l);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!(
            "no leader found in 30 s{}",
            self.member_logs()
                .map(|l| format!("; the members' last log lines:\n{l}"))
                .unwrap_or_default()
        )
    }

    /// Copies each etcd or ZooKeeper member's log (`<name>.log`, the last 4 MiB of each)
    /// into `dir`, which it creates; `None` for our cell, whose replicas log elsewhere
    /// (`lockctl dev` keeps their logs with the cell's data).
    pub fn keep_member_logs(&self, dir: &Path) -> anyhow::Result<Option<PathBuf>> {
        const KEEP: u64 = 4 << 20;
        if self.system == System::Ours {
            return Ok(None);
        }
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        for name in self.member_names()? {
            let from = self.dir.join(format!("{name}.log"));
            let mut f =
                std::fs::File::open(&from).with_context(|| format!("open {}", from.display()))?;
            let len = f.metadata()?.len();
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(len.saturating_sub(KEEP)))?;
            let mut to = std::fs::File::create(dir.join(format!("{name}.log")))?;
            std::io::copy(&mut f, &mut to)?;
        }
        Ok(Some(dir.to_path_buf()))
    }

    /// ZooKeeper's garbage collection over the run, from each member's `gc.log`
    /// (`peers.sh` starts every JVM with `-Xlog:gc`; a restarted member's earlier logs
    /// too): the collector in use, how many pauses, their longest and their sum over all
    /// members, setup included. `None` for the other systems.
    pub fn zk_gc(&self) -> Option<GcSummary> {
        if self.system != System::Zk {
            return None;
        }
        let mut g = GcSummary::default();
        for name in self.member_names().ok()? {
            // A restarted JVM keeps its predecessor's log as gc.log.0 (and so on).
            let Ok(files) = std::fs::read_dir(self.dir.join(&name)) else {
                continue;
            };
            let mut read = false;
            for f in files.flatten() {
                if f.file_name().to_string_lossy().starts_with("gc.log") {
                    if let Ok(text) = std::fs::read_to_string(f.path()) {
                        g.add_log(&text);
                        read = true;
                    }
                }
            }
            g.members += u64::from(read);
        }
        Some(g)
    }

    /// The names of the etcd or ZooKeeper members `peers.sh` started, from its pid list:
    /// a member that has exited (or was stopped) is still named.
    fn member_names(&self) -> anyhow::Result<Vec<String>> {
        let pids = std::fs::read_to_string(self.dir.join("pids")).context("the pid list")?;
        Ok(pids
            .lines()
            .filter_map(|l| Some(l.split_whitespace().next()?.to_string()))
            .collect())
    }

    /// The last lines of each etcd or ZooKeeper member's log (`peers.sh` writes
    /// `<name>.log` in the cluster's directory), to say why a cluster did not come up.
    fn member_logs(&self) -> Option<String> {
        if self.system == System::Ours {
            return None;
        }
        let mut out = String::new();
        for name in self.member_names().ok()? {
            let text = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).ok()?;
            let lines: Vec<&str> = text.lines().collect();
            for l in &lines[lines.len().saturating_sub(15)..] {
                out.push_str(&format!("  {name}: {l}\n"));
            }
        }
        Some(out)
    }

    async fn leader_once(&self) -> Option<String> {
        match self.system {
            System::Ours => {
                let c = client_sdk::Client::connect(client_sdk::ClientConfig::new(
                    self.members.clone(),
                    self.ca.clone(),
                ))
                .await
                .ok()?;
                for a in c.endpoints() {
                    if let Ok(s) = c.status_of(a).await {
                        if s.role == "Leader" {
                            return Some(a.to_string());
                        }
                    }
                }
                None
            }
            System::Etcd => {
                for m in &self.members {
                    let Ok(mut c) = etcd_client::Client::connect(
                        [m.as_str()],
                        Some(
                            crate::systems::etcd_conn::options()
                                .with_timeout(Duration::from_secs(2)),
                        ),
                    )
                    .await
                    else {
                        continue;
                    };
                    if let Ok(s) = c.status().await {
                        if s.header().is_some_and(|h| h.member_id() == s.leader()) {
                            return Some(m.clone());
                        }
                    }
                }
                None
            }
            System::Zk => {
                for m in &self.members {
                    if four_letter(m, "srvr")
                        .await
                        .is_some_and(|s| s.contains("Mode: leader"))
                    {
                        return Some(m.clone());
                    }
                }
                None
            }
        }
    }

    fn spawn_replica(&self, config: &Path) -> anyhow::Result<()> {
        let child = Cluster::on_cpus(&self.cpus, Command::new(sibling("lockctl")?))
            .arg("replica")
            .arg("--config")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start a replica")?;
        self.spawned.lock().expect("spawned").push(child);
        Ok(())
    }

    /// Starts replica `i` (1-based) of our cell again from its configuration and data
    /// (after it was killed).
    pub fn restart_replica(&self, i: usize) -> anyhow::Result<()> {
        anyhow::ensure!(self.system == System::Ours, "ours only");
        self.spawn_replica(&self.dir.join(format!("cell/replica-{i}.toml")))
    }

    /// Starts a new, empty replica with id `id` (not a member yet) on a free port; returns
    /// its address, for `AddLearner`.
    pub fn start_new_replica(&self, id: u64) -> anyhow::Result<String> {
        anyhow::ensure!(self.system == System::Ours, "ours only");
        let cell = self.dir.join("cell");
        let text = std::fs::read_to_string(cell.join("replica-1.toml"))?;
        let mut cfg: toml::Table = text.parse().context("replica-1.toml")?;
        let port = free_base(1, Ports::NewReplica.from());
        let addr = format!("127.0.0.1:{port}");
        cfg.insert("id".into(), toml::Value::Integer(id as i64));
        cfg.insert("listen".into(), toml::Value::String(addr.clone()));
        cfg.insert("bootstrap".into(), toml::Value::Boolean(false));
        cfg.insert(
            "data_dir".into(),
            toml::Value::String(cell.join(format!("replica-{id}")).display().to_string()),
        );
        let path = cell.join(format!("replica-{id}.toml"));
        std::fs::write(&path, toml::to_string(&cfg)?)?;
        self.spawn_replica(&path)?;
        Ok(addr)
    }

    /// The pid of replica `i` (1-based) of our cell.
    pub fn replica_pid(&self, i: usize) -> Option<u32> {
        self.processes()
            .into_iter()
            .find(|(n, _)| *n == format!("replica-{i}"))
            .map(|(_, p)| p)
    }

    /// The directory holding the cluster's data, configurations and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `peers.sh CMD DIR ARGS...` for this cluster; returns what it printed.
    fn peers_sh(&self, cmd: &str, args: &[&str]) -> anyhow::Result<String> {
        let out = Cluster::on_cpus(&self.cpus, Command::new(bench_script()?))
            .arg(cmd)
            .arg(&self.dir)
            .args(args)
            .output()
            .with_context(|| format!("run ops/bench/peers.sh {cmd}"))?;
        if !out.status.success() {
            bail!(
                "peers.sh {cmd} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Starts etcd or ZooKeeper member `name` (`m1`.., `z1`..) again with the command line
    /// it was first started with and its data dir as it is (`peers.sh restart`), after it
    /// was killed; [`Cluster::processes`] and [`Cluster::pid_of`] then find the new process.
    pub fn restart_member(&self, name: &str) -> anyhow::Result<()> {
        anyhow::ensure!(self.system != System::Ours, "etcd and ZooKeeper only");
        self.peers_sh("restart", &[name]).map(|_| ())
    }

    /// Two loopback ports, free now, for a new etcd member: (client, peer).
    pub fn new_member_ports(&self) -> (u16, u16) {
        let base = free_base(2, Ports::NewEtcdMember.from());
        (base, base + 1)
    }

    /// Starts a new etcd member `name` on `client_port` and `peer_port` that joins this
    /// cluster (`--initial-cluster-state existing`, `peers.sh etcd-learner`); it must have
    /// been added first (MemberAdd), and `initial_cluster` lists every member with it
    /// (`m1=http://127.0.0.1:PORT,...`). Returns its client endpoint.
    pub fn start_etcd_member(
        &self,
        name: &str,
        client_port: u16,
        peer_port: u16,
        initial_cluster: &str,
    ) -> anyhow::Result<String> {
        anyhow::ensure!(self.system == System::Etcd, "etcd only");
        self.peers_sh(
            "etcd-learner",
            &[
                name,
                &client_port.to_string(),
                &peer_port.to_string(),
                initial_cluster,
            ],
        )
    }

    /// Waits until the cluster serves (a leader is known).
    pub async fn ready(&self) -> anyhow::Result<()> {
        self.leader().await.map(|_| ())
    }

    /// Stops everything.
    pub fn stop(&mut self) {
        if let Some(mut dev) = self.dev.take() {
            unsafe { libc::kill(dev.id() as i32, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = dev.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = dev.kill();
            let _ = dev.wait();
        }
        if self.system != System::Ours {
            if let Ok(s) = bench_script() {
                let _ = Command::new(s)
                    .args(["stop", self.dir.to_str().unwrap_or("")])
                    .status();
            }
        }
        // Stopped members (SIGSTOP) cannot handle SIGTERM: make sure nothing is left.
        for (_, pid) in self.processes() {
            unsafe {
                libc::kill(pid as i32, libc::SIGCONT);
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
        for mut c in self.spawned.lock().expect("spawned").drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
        // LOADGEN_KEEP_DATA=1 keeps the cluster's directory (data, configs, logs).
        if std::env::var_os("LOADGEN_KEEP_DATA").is_some() {
            if let Some(t) = self._tmp.take() {
                eprintln!("loadgen: kept {}", t.keep().display());
            }
        }
    }
}

/// A ZooKeeper four-letter command's answer.
pub async fn four_letter(addr: &str, cmd: &str) -> Option<String> {
    four_letter_within(addr, cmd, Duration::from_secs(2)).await
}

/// [`four_letter`] with its own time limit (a leader's `dump` of 50 000 sessions is large).
pub async fn four_letter_within(addr: &str, cmd: &str, within: Duration) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(cmd.as_bytes()).await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        Some(out)
    };
    tokio::time::timeout(within, fut).await.ok().flatten()
}

/// The server processes of a cluster of `system` in `dir` (see [`Cluster::processes`]).
pub fn processes_of(system: System, dir: &Path) -> Vec<(String, u32)> {
    match system {
        System::Ours => {
            let mut out = Vec::new();
            let cell = dir.join("cell");
            for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                    continue;
                };
                let Ok(cmd) = std::fs::read_to_string(format!("/proc/{pid}/cmdline")) else {
                    continue;
                };
                let args: Vec<&str> = cmd.split('\0').collect();
                if args.len() >= 4
                    && (args[1] == "replica" || args[1] == "proxy")
                    && args[3].starts_with(cell.to_str().unwrap_or("-"))
                {
                    let name = Path::new(args[3])
                        .file_stem()
                        .map_or("?".into(), |s| s.to_string_lossy().into_owned());
                    out.push((name, pid));
                }
            }
            out.sort();
            out
        }
        System::Etcd | System::Zk => std::fs::read_to_string(dir.join("pids"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.first()?.to_string(), f.get(1)?.parse().ok()?))
            })
            .collect(),
    }
}

/// What the JVMs' `-Xlog:gc` logs say ([`Cluster::zk_gc`]).
#[derive(Debug, Default, PartialEq)]
pub struct GcSummary {
    /// Members whose logs were read.
    pub members: u64,
    /// The collectors named ("Using G1"), each once.
    pub collectors: Vec<String>,
    /// Pauses over all members.
    pub pauses: u64,
    /// The longest pause, and the sum of all, in milliseconds.
    pub max_ms: f64,
    pub total_ms: f64,
}

impl GcSummary {
    /// Adds one member's log: lines such as `[0.031s][info][gc] Using Serial` and
    /// `[52.575s][info][gc] GC(0) Pause Young (Allocation Failure) 546M->9M(1979M)
    /// 682.406ms`.
    pub fn add_log(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(c) = line.split("] Using ").nth(1) {
                let c = c.trim().to_string();
                if !self.collectors.contains(&c) {
                    self.collectors.push(c);
                }
            } else if line.contains(" Pause ") {
                let ms = line
                    .rsplit(' ')
                    .next()
                    .and_then(|t| t.strip_suffix("ms"))
                    .and_then(|t| t.parse::<f64>().ok());
                if let Some(ms) = ms {
                    self.pauses += 1;
                    self.total_ms += ms;
                    self.max_ms = self.max_ms.max(ms);
                }
            }
        }
    }
}

#[cfg(test)]
mod gc_tests {
    use super::GcSummary;

    #[test]
    fn a_gc_log_is_summed_over_members() {
        let mut g = GcSummary::default();
        g.add_log(
            "[0.031s][info][gc] Using Serial\n\
             [52.575s][info][gc] GC(0) Pause Young (Allocation Failure) 546M->9M(1979M) 682.406ms\n\
             [93.517s][info][gc] GC(1) Pause Young (Allocation Failure) 555M->33M(1979M) 1265.200ms\n",
        );
        g.add_log(
            "[0.012s][info][gc] Using G1\n\
             [10.1s][info][gc] GC(0) Pause Young (Normal) (G1 Evacuation Pause) 100M->20M(2048M) 12.500ms\n\
             [11.0s][info][gc] GC(1) Concurrent Mark Cycle\n\
             [11.2s][info][gc] GC(1) Pause Remark 60M->60M(2048M) 3.250ms\n\
             [11.3s][info][gc] GC(1) Pause Cleanup 60M->60M(2048M) 0.125ms\n\
             [11.4s][info][gc] GC(1) Concurrent Mark Cycle 301.500ms\n",
        );
        assert_eq!(g.collectors, vec!["Serial".to_string(), "G1".to_string()]);
        // Remark and Cleanup are pauses; a concurrent cycle's time is not.
        assert_eq!(g.pauses, 5);
        assert!((g.max_ms - 1265.2).abs() < 1e-9);
        assert!((g.total_ms - (682.406 + 1265.2 + 12.5 + 3.25 + 0.125)).abs() < 1e-9);
    }
}
