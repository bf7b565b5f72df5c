//! `lockctl dev`: a local cell of real replica processes on loopback.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use client_sdk::{Client, ClientConfig, CreateMode, Error};
use replica::config::{Member, RaftConfig, ReplicaConfig, SessionConfig, TlsConfig};

/// The endpoints of the default dev cell.
pub const DEFAULT_ENDPOINTS: &str =
    "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103,127.0.0.1:7104,127.0.0.1:7105";

/// Options of `lockctl dev`.
#[derive(clap::Args, Debug)]
pub struct DevArgs {
    /// Number of replicas (1, 3 or 5).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=7))]
    replicas: u64,
    /// Directory for TLS files, configs, logs and replica data.
    #[arg(long, default_value = "cell-data")]
    data: PathBuf,
    /// First UDP port; replica N listens on base-port + N - 1.
    #[arg(long, default_value_t = 7101)]
    base_port: u16,
    /// Also start this many proxies (0..=8), on proxy-base-port, +1, ...
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=8))]
    proxies: u16,
    /// First UDP port of the proxies (default: base-port + 100).
    #[arg(long)]
    proxy_base_port: Option<u16>,
    /// Serve /metrics (Prometheus), /health and /ready over HTTP (TCP) from every
    /// replica, proxy and directory: each on this port plus its UDP port's offset from
    /// base-port (replica N on metrics-base-port + N - 1, the proxies from
    /// metrics-base-port + 100; with --cells, the root at + 100 and the directory at + 200).
    #[arg(long)]
    metrics_base_port: Option<u16>,
    /// Session lease in milliseconds.
    #[arg(long, default_value_t = 12_000)]
    lease_ms: u64,
    /// Back the cell up to this object store (`s3://bucket/prefix`,
    /// `azure://container/prefix` or `file:///path`;
    /// the replicas' `[backup] url`): the leader writes a backup every
    /// --backup-interval-secs, and `lockctl snapshot save` writes one now.
    #[arg(long, value_name = "URL")]
    backup: Option<String>,
    /// An option of the backup store, KEY=VALUE (`[backup] options`; e.g.
    /// endpoint=http://127.0.0.1:9000, allow_http=true, region=us-east-1). Repeatable.
    #[arg(long, value_name = "KEY=VALUE", requires = "backup", value_parser = key_value)]
    backup_option: Vec<(String, String)>,
    /// How often the leader writes a backup (seconds).
    #[arg(long, default_value_t = 3_600, requires = "backup")]
    backup_interval_secs: u64,
    /// How many backups of the cell the store keeps.
    #[arg(long, default_value_t = 48, requires = "backup")]
    backup_keep: usize,
    /// Skip the demonstration after start-up.
    #[arg(long)]
    no_demo: bool,
    /// Stop after the demonstration instead of running until Ctrl-C.
    #[arg(long)]
    exit_after_demo: bool,
    /// After the demonstration, restart every replica in turn as an operator would
    /// (SIGTERM, then start it again once it exited) while a writer writes, and print
    /// what the writer saw: a leader stopped so hands the leadership over first.
    #[arg(long, conflicts_with = "cells")]
    rolling_restart: bool,
    /// Start several cells behind a directory instead of one cell: a root cell (one
    /// replica) holding the map, this many cells (--replicas each, ports base-port,
    /// base-port + 10, ...), one directory instance, and prefixes /cell-1-demo, ... placed
    /// one in each (`docs/directory.md`).
    #[arg(long, value_parser = clap::value_parser!(u16).range(2..=8))]
    cells: Option<u16>,
}

/// Reads `KEY=VALUE`.
pub fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

/// Where the process listening on UDP `port` serves its metrics (see
/// `--metrics-base-port`), if asked to.
pub fn metrics_addr(args: &DevArgs, port: u16) -> anyhow::Result<Option<std::net::SocketAddr>> {
    let Some(m) = args.metrics_base_port else {
        return Ok(None);
    };
    let offset = i64::from(port) - i64::from(args.base_port);
    let p = i64::from(m) + offset;
    anyhow::ensure!(
        (1..=i64::from(u16::MAX)).contains(&p),
        "--metrics-base-port {m}: the process on UDP port {port} would serve its metrics on \
         TCP port {p}, out of range"
    );
    Ok(Some(std::net::SocketAddr::from(([127, 0, 0, 1], p as u16))))
}

/// Writes the configuration files of a dev cell and returns their paths.
pub fn write_configs(args: &DevArgs) -> anyhow::Result<Vec<PathBuf>> {
    let tls_dir = args.data.join("tls");
    if !wire::tls::DevCa::complete_in(&tls_dir) {
        wire::tls::DevCa::generate()
            .map_err(anyhow::Error::msg)?
            .write_to(&tls_dir)?;
    }
    let abs = std::fs::canonicalize(&args.data)?;
    let members: Vec<Member> = (1..=args.replicas)
        .map(|id| Member {
            id,
            addr: format!("127.0.0.1:{}", args.base_port as u64 + id - 1),
        })
        .collect();
    let mut paths = Vec::new();
    for m in &members {
        let cfg = ReplicaConfig {
            id: m.id,
            listen: m.addr.parse()?,
            advertise: None,
            data_dir: abs.join(format!("replica-{}", m.id)),
            bootstrap: m.id == 1,
            members: members.clone(),
            tls: TlsConfig::replica_in_dir(&abs.join("tls")),
            raft: RaftConfig::default(),
            session: SessionConfig {
                lease_ms: args.lease_ms,
                ..SessionConfig::default()
            },
            request_timeout_ms: 5_000,
            // The dev client drives a whole cell's load (loadgen, the tests).
            limits: replica::config::LimitsConfig::unlimited_for(wire::tls::DEV_CLIENT),
            faults: Default::default(),
            // The quick start's cell: every identity may do anything, and the dev
            // client is its admin (`lockctl acl` works out of the box).
            security: replica::config::SecurityConfig::open(wire::tls::DEV_CLIENT),
            metrics: replica::config::MetricsConfig {
                listen: metrics_addr(args, args.base_port + m.id as u16 - 1)?,
            },
            backup: replica::config::BackupConfig {
                url: args.backup.clone(),
                options: args.backup_option.iter().cloned().collect(),
                interval_secs: args.backup_interval_secs,
                keep: args.backup_keep,
            },
        };
        cfg.validate()?;
        let path = args.data.join(format!("replica-{}.toml", m.id));
        std::fs::write(&path, toml::to_string_pretty(&cfg)?)?;
        paths.push(path);
    }
    Ok(paths)
}

/// The proxies' addresses of a dev cell.
pub fn proxy_endpoints(args: &DevArgs) -> Vec<String> {
    let base = args.proxy_base_port.unwrap_or(args.base_port + 100);
    (0..args.proxies)
        .map(|i| format!("127.0.0.1:{}", base + i))
        .collect()
}

/// Writes the proxies' configuration files of a dev cell and returns their paths.
pub fn write_proxy_configs(args: &DevArgs) -> anyhow::Result<Vec<PathBuf>> {
    let abs = std::fs::canonicalize(&args.data)?;
    let replicas: Vec<String> = (1..=args.replicas)
        .map(|id| format!("127.0.0.1:{}", args.base_port as u64 + id - 1))
        .collect();
    let mut paths = Vec::new();
    for (i, listen) in proxy_endpoints(args).iter().enumerate() {
        let mut cfg = proxy::ProxyConfig::new(
            listen.parse()?,
            replicas.clone(),
            proxy::config::TlsConfig::proxy_in_dir(&abs.join("tls")),
        );
        cfg.per_identity.identities.insert(
            wire::tls::DEV_CLIENT.into(),
            wire::quota::Limits::unlimited(),
        );
        cfg.metrics.listen = metrics_addr(args, cfg.listen.port())?;
        cfg.validate()?;
        let path = args.data.join(format!("proxy-{}.toml", i + 1));
        std::fs::write(&path, toml::to_string_pretty(&cfg)?)?;
        paths.push(path);
    }
    Ok(paths)
}

/// Runs one proxy in this process (the hidden `lockctl proxy` command).
pub fn run_proxy(config: &Path) -> anyhow::Result<()> {
    let cfg = proxy::ProxyConfig::load(Some(config))?;
    proxy::run_until_signal(cfg)
}

/// Runs one replica in this process (the hidden `lockctl replica` command).
pub fn run_replica(config: &Path) -> anyhow::Result<()> {
    let cfg = ReplicaConfig::load(Some(config))?;
    replica::server::run_until_signal(cfg)
}

struct Children(Vec<(String, Child)>);

impl Children {
    fn stop(&mut self) {
        for (_, c) in &self.0 {
            // SIGTERM: each replica shuts down cleanly.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        // Proxies first (they are clients of the replicas), then replicas.
        self.0.sort_by_key(|(name, _)| !name.starts_with("proxy"));
        for (name, c) in &mut self.0 {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => {
                        eprintln!("{name} did not stop in time; killing it");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
        self.0.clear();
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts the replicas of the cell `args` describes (as `name-N` children); returns
/// their endpoints.
fn spawn_replicas(
    args: &DevArgs,
    name: &str,
    children: &mut Children,
) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(&args.data)
        .with_context(|| format!("create {}", args.data.display()))?;
    let configs = write_configs(args)?;
    for (i, cfg) in configs.iter().enumerate() {
        let id = i as u64 + 1;
        let log = std::fs::File::create(args.data.join(format!("replica-{id}.log")))?;
        let child =
            start_replica(cfg, log).with_context(|| format!("start {name} replica {id}"))?;
        children.0.push((format!("{name}-{id}"), child));
    }
    Ok((1..=args.replicas)
        .map(|id| format!("127.0.0.1:{}", args.base_port as u64 + id - 1))
        .collect())
}

/// `lockctl dev`.
pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    if let Some(n) = args.cells {
        return run_cells(args, n).await;
    }
    let mut children = Children(Vec::new());
    let endpoints = spawn_replicas(&args, "replica", &mut children)?;
    let exe = std::env::current_exe()?;
    println!(
        "started {} replicas on {} (data, configs and logs in {})",
        args.replicas,
        endpoints.join(", "),
        args.data.display()
    );
    let ca = args.data.join("tls").join(wire::tls::CA_FILE);
    let client = Client::connect(ClientConfig::new(endpoints.clone(), ca.clone())).await?;
    let started = Instant::now();
    let leader = wait_for_leader(&client, Duration::from_secs(30)).await?;
    println!(
        "replica {leader} leads after {} ms",
        started.elapsed().as_millis()
    );

    let proxies = proxy_endpoints(&args);
    for (i, cfg) in write_proxy_configs(&args)?.iter().enumerate() {
        let name = format!("proxy-{}", i + 1);
        let log = std::fs::File::create(args.data.join(format!("{name}.log")))?;
        let child = std::process::Command::new(&exe)
            .arg("proxy")
            .arg("--config")
            .arg(cfg)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("start {name}"))?;
        children.0.push((name, child));
    }
    if !proxies.is_empty() {
        // Every proxy reachable (it answers its status) before this is printed: a test's
        // first handshake to a proxy still starting timed out on a busy machine.
        wait_for_proxies(
            &client,
            &proxies,
            &mut children,
            &args.data,
            Duration::from_secs(30),
        )
        .await?;
        println!(
            "started {} proxies on {}",
            proxies.len(),
            proxies.join(", ")
        );
    }
    if args.metrics_base_port.is_some() {
        let mut urls = Vec::new();
        for addr in endpoints.iter().chain(&proxies) {
            let port: u16 = addr.rsplit(':').next().unwrap_or("0").parse()?;
            if let Some(m) = metrics_addr(&args, port)? {
                urls.push(format!("http://{m}/metrics"));
            }
        }
        println!("metrics (also /health and /ready): {}", urls.join(" "));
    }

    if !args.no_demo {
        demo(&client).await?;
        if !proxies.is_empty() {
            let via = Client::connect(ClientConfig::new(proxies.clone(), ca.clone())).await?;
            let s = via.open_session().await?;
            println!(
                "through the proxies: session {} reads /demo/config = {:?}",
                s.id(),
                s.get_cached("/demo/config")
                    .await?
                    .map(|(d, _)| String::from_utf8_lossy(&d).into_owned())
            );
            s.close().await?;
        }
    }
    if args.rolling_restart {
        rolling_restart(&args, &client, &mut children).await?;
    }
    print_status(&client).await?;
    // The hint's compare-and-set names the version the node has now (the demo changed it).
    let set_hint = match client.get("/demo/config").await {
        Ok((_, stat)) => format!("set /demo/config v2 --version {}", stat.version),
        Err(_) => "create /demo/config v1".to_string(),
    };
    if args.exit_after_demo {
        children.stop();
        return Ok(());
    }
    println!(
        "\ncell running. Try, in another terminal:\n  \
         export LOCKCTL_ENDPOINTS={} LOCKCTL_CA={}\n  \
         cargo run -q --bin lockctl -- status\n  \
         cargo run -q --bin lockctl -- {set_hint}\n  \
         cargo run -q --bin lockctl -- watch /demo/config\n\
         Ctrl-C stops the cell.",
        endpoints.join(","),
        ca.display()
    );
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = tick.tick() => {
                // Report each replica that exited once, and stop watching it.
                children.0.retain_mut(|(name, c)| match c.try_wait() {
                    Ok(Some(status)) => {
                        eprintln!("{name} exited: {status} (see {}/{name}.log)", args.data.display());
                        false
                    }
                    _ => true,
                });
            }
        }
    }
    println!("stopping the cell");
    children.stop();
    Ok(())
}

/// Starts replica `id` of the cell again from its config (`lockctl dev
/// --rolling-restart`), its log appended to.
fn spawn_replica(args: &DevArgs, id: u64) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(args.data.join(format!("replica-{id}.log")))?;
    start_replica(&args.data.join(format!("replica-{id}.toml")), log)
        .with_context(|| format!("start replica {id} again"))
}

/// Runs `lockctl replica --config cfg` as a child process logging to `log`.
fn start_replica(cfg: &Path, log: std::fs::File) -> anyhow::Result<Child> {
    Ok(std::process::Command::new(std::env::current_exe()?)
        .arg("replica")
        .arg("--config")
        .arg(cfg)
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()?)
}

/// Waits until every replica of `client`'s endpoints names one leader in one term and
/// has applied within 64 entries of its commit.
async fn wait_settled(client: &Client, within: Duration) -> anyhow::Result<u64> {
    let deadline = Instant::now() + within;
    // Bounded by `within`.
    while Instant::now() < deadline {
        let mut st = Vec::new();
        for addr in client.endpoints() {
            if let Ok(s) = client.status_of(addr).await {
                st.push(s);
            }
        }
        let leaders: std::collections::BTreeSet<_> = st
            .iter()
            .map(|s| (s.term, s.leader.as_ref().map(|l| l.id)))
            .collect();
        let top = st.iter().map(|s| s.last_applied).max().unwrap_or(0);
        if st.len() == client.endpoints().len()
            && leaders.len() == 1
            && st.iter().all(|s| s.last_applied + 64 >= top)
        {
            if let Some((_, Some(leader))) = leaders.first() {
                return Ok(*leader);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!(
        "the replicas did not settle on one leader within {} s",
        within.as_secs()
    )
}

/// `lockctl dev --rolling-restart`: restarts every replica in turn as an operator
/// would (SIGTERM, wait for the exit, start again, wait until it follows and has caught
/// up) while a writer writes `/demo/rolling` in a loop, and prints what the writer saw:
/// a leader stopped so hands the leadership over first (docs/operations.md, "Rolling
/// restarts").
async fn rolling_restart(
    args: &DevArgs,
    client: &Client,
    children: &mut Children,
) -> anyhow::Result<()> {
    println!("\n-- rolling restart --");
    let session = client.open_session().await?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (session, stop) = (session.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed, mut longest) = (0u64, 0u64, Duration::ZERO);
            let mut last = Instant::now();
            // Bounded: stopped once every replica was restarted.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match session
                    .set_data("/demo/config", ok.to_string().into_bytes(), None)
                    .await
                {
                    Ok(_) => {
                        ok += 1;
                        longest = longest.max(last.elapsed());
                        last = Instant::now();
                    }
                    Err(_) => failed += 1,
                }
            }
            (ok, failed, longest)
        })
    };
    for id in 1..=args.replicas {
        let leader = wait_settled(client, Duration::from_secs(30)).await?;
        let name = format!("replica-{id}");
        let Some(pos) = children.0.iter().position(|(n, _)| *n == name) else {
            anyhow::bail!("{name} is not running");
        };
        let (_, mut child) = children.0.remove(pos);
        let started = Instant::now();
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = tokio::task::spawn_blocking(move || child.wait()).await??;
        let stopped = started.elapsed();
        children.0.push((name.clone(), spawn_replica(args, id)?));
        let now = wait_settled(client, Duration::from_secs(30)).await?;
        println!(
            "{name}: stopped in {} ms ({status}){}, started again; replica {now} leads",
            stopped.as_millis(),
            if id == leader {
                format!(", it led: handed over to replica {now}")
            } else {
                String::new()
            }
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed, longest) = writer.await?;
    session.close().await?;
    println!(
        "rolling restart done: {ok} writes, {failed} failed, the longest pause between two \
         writes {} ms",
        longest.as_millis()
    );
    Ok(())
}

async fn wait_for_leader(client: &Client, within: Duration) -> anyhow::Result<u64> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        for addr in client.endpoints() {
            if let Ok(s) = client.status_of(addr).await {
                if s.role == "Leader" {
                    return Ok(s.id);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("no leader within {} s", within.as_secs())
}

/// Waits until every proxy of `proxies` answers its status; fails at once, naming its
/// log, if a proxy process (`proxy-N` among `children`, logging to `data`) exits.
async fn wait_for_proxies(
    client: &Client,
    proxies: &[String],
    children: &mut Children,
    data: &std::path::Path,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    for (i, p) in proxies.iter().enumerate() {
        let addr: std::net::SocketAddr = p.parse()?;
        let name = format!("proxy-{}", i + 1);
        loop {
            if let Some((_, c)) = children.0.iter_mut().find(|(n, _)| *n == name) {
                if let Some(status) = c.try_wait()? {
                    anyhow::bail!(
                        "{name} exited at start ({status}); its log: {}",
                        data.join(format!("{name}.log")).display()
                    );
                }
            }
            match client.proxy_status_of(addr).await {
                Ok(_) => break,
                Err(e) if Instant::now() >= deadline => {
                    anyhow::bail!(
                        "proxy {p} did not answer within {} s: {e}",
                        within.as_secs()
                    )
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    Ok(())
}

async fn demo(client: &Client) -> anyhow::Result<()> {
    println!("\n-- demo --");
    let session = client.open_session().await?;
    println!(
        "opened session {} (lease {} ms)",
        session.id(),
        session.lease().as_millis()
    );
    match session
        .create("/demo", Vec::new(), CreateMode::default())
        .await
    {
        Ok(_) | Err(Error::NodeExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let version = match session
        .create("/demo/config", b"v1".to_vec(), CreateMode::default())
        .await
    {
        Ok(c) => c.stat.version,
        Err(Error::NodeExists { .. }) => client.get("/demo/config").await?.1.version,
        Err(e) => return Err(e.into()),
    };
    let stat = session
        .set_data(
            "/demo/config",
            b"hello from lockctl dev".to_vec(),
            Some(version),
        )
        .await?;
    println!(
        "set /demo/config (compare-and-set on version {version}) -> version {}",
        stat.version
    );
    match session
        .set_data("/demo/config", b"stale".to_vec(), Some(version))
        .await
    {
        Err(e @ Error::BadVersion { .. }) => println!("a stale compare-and-set is refused: {e}"),
        other => anyhow::bail!("stale CAS was not refused: {other:?}"),
    }
    match session
        .create("/demo/lock", Vec::new(), CreateMode::default())
        .await
    {
        Ok(_) | Err(Error::NodeExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let node = session
        .create(
            "/demo/lock/n-",
            Vec::new(),
            CreateMode {
                ephemeral: true,
                sequential: true,
            },
        )
        .await?;
    match &node.predecessor {
        None => println!(
            "took /demo/lock as {} with fencing token {}",
            node.path, node.stat.token
        ),
        Some(p) => println!("queued on /demo/lock as {} behind {}", node.path, p.name),
    }
    session.close().await?;
    println!(
        "closed the session: its ephemeral lock node is gone: {}",
        client.exists(&node.path).await?.is_none()
    );
    println!("-- end of demo --\n");
    Ok(())
}

/// Prints every endpoint's status as a table; returns how many answered, and the errors
/// of those that did not. `lag` is how many entries of the leader's log a replica has not
/// applied; `fsync p99` is its log's fsyncs in the last minute or two.
pub async fn print_status(client: &Client) -> anyhow::Result<(usize, Vec<Error>)> {
    let row = |cols: [&str; 13]| {
        println!(
            "{:<4} {:<18} {:<10} {:>5} {:>7} {:>9} {:>9} {:>7} {:>9} {:>8} {:>6} {:>8} {:>10}",
            cols[0],
            cols[1],
            cols[2],
            cols[3],
            cols[4],
            cols[5],
            cols[6],
            cols[7],
            cols[8],
            cols[9],
            cols[10],
            cols[11],
            cols[12]
        )
    };
    row([
        "id",
        "addr",
        "role",
        "term",
        "leader",
        "applied",
        "log",
        "lag",
        "snapshot",
        "sessions",
        "nodes",
        "fsyncs",
        "fsync p99",
    ]);
    let mut members = None;
    let mut stores = Vec::new();
    let (mut answered, mut errors) = (0, Vec::new());
    let mut got = Vec::new();
    for addr in client.endpoints() {
        got.push((addr, client.status_of(addr).await));
    }
    // The leader of the highest term (a deposed one may not know yet).
    let leader_log = got
        .iter()
        .filter_map(|(_, s)| s.as_ref().ok().filter(|s| s.role == "Leader"))
        .max_by_key(|s| s.term)
        .map(|s| s.last_log_index);
    for (addr, status) in got {
        match status {
            Ok(s) => {
                answered += 1;
                row([
                    &s.id.to_string(),
                    &addr.to_string(),
                    &s.role,
                    &s.term.to_string(),
                    &s.leader
                        .as_ref()
                        .map(|l| l.id.to_string())
                        .unwrap_or_else(|| "-".into()),
                    &s.last_applied.to_string(),
                    &s.last_log_index.to_string(),
                    &leader_log
                        .map(|l| l.saturating_sub(s.last_applied).to_string())
                        .unwrap_or_else(|| "-".into()),
                    &s.snapshot_index
                        .map(|i| i.to_string())
                        .unwrap_or_else(|| "-".into()),
                    &s.session_count.to_string(),
                    &s.node_count.to_string(),
                    &s.log_syncs.to_string(),
                    &s.recent_fsync_p99_us
                        .map(|us| format!("{:.2} ms", us as f64 / 1000.0))
                        .unwrap_or_else(|| "-".into()),
                ]);
                stores.push((s.id, s.store));
                if s.role == "Leader" {
                    members = Some(s.members);
                } else {
                    members.get_or_insert(s.members);
                }
            }
            Err(e) => {
                println!("{:<4} {:<18} unreachable: {e}", "?", addr.to_string());
                errors.push(e);
            }
        }
    }
    if let Some(ms) = members {
        let list: Vec<String> = ms
            .iter()
            .map(|m| {
                let store = match m.store {
                    wire::store::Binding::Bound(_) => String::new(),
                    other => format!(" ({other})"),
                };
                format!(
                    "{}@{}{}{store}",
                    m.id,
                    m.addr,
                    if m.voter { "" } else { " (learner)" }
                )
            })
            .collect();
        println!("members: {}", list.join(", "));
        for (id, store) in stores {
            let Some(m) = ms.iter().find(|m| m.id == id) else {
                continue;
            };
            if let wire::store::Binding::Bound(b) = m.store {
                if store != Some(b) {
                    println!(
                        "replica {id}: its store ({}) is not the one the cell binds it to \
                         ({b}): its data was lost or replaced, and nothing it says counts. \
                         Replace it: lockctl member remove {id}; lockctl member add-learner \
                         {id} {}; lockctl member promote {id}",
                        store.map_or("unknown".into(), |s| s.to_string()),
                        m.addr
                    );
                }
            }
        }
    }
    Ok((answered, errors))
}

/// `lockctl dev --cells N`: a root cell, N cells trusting one CA, a directory instance,
/// and a prefix placed in each cell.
async fn run_cells(args: DevArgs, n: u16) -> anyhow::Result<()> {
    let tls = args.data.join("tls");
    if !wire::tls::DevCa::complete_in(&tls) {
        wire::tls::DevCa::generate()
            .map_err(anyhow::Error::msg)?
            .write_to(&tls)?;
    }
    // The directory instance's certificate, from the same CA.
    let ca_pem = std::fs::read_to_string(tls.join(wire::tls::CA_FILE))?;
    let ca_key = std::fs::read_to_string(tls.join(wire::tls::CA_KEY_FILE))?;
    let ca = wire::tls::Ca::from_pem(&ca_pem, &ca_key).map_err(anyhow::Error::msg)?;
    let dir_id = wire::identity::Identity::Directory { name: "dev".into() };
    let issued = ca.issue(&dir_id, 365).map_err(anyhow::Error::msg)?;
    std::fs::write(tls.join("directory.pem"), &issued.cert_pem)?;
    std::fs::write(tls.join("directory.key"), &issued.key_pem)?;
    // Each cell's TLS directory: the CA (not its key), the client's and the directory's
    // files, and replica and proxy certificates naming that cell, so a client that
    // expects a cell (the router, `lockctl dir`) can tell them apart.
    let copy_tls = |to: &Path, cell: &str| -> anyhow::Result<()> {
        let dir = to.join("tls");
        std::fs::create_dir_all(&dir)?;
        for f in std::fs::read_dir(&tls)? {
            let f = f?;
            if f.file_name() != wire::tls::CA_KEY_FILE {
                std::fs::copy(f.path(), dir.join(f.file_name()))?;
            }
        }
        let name = "dev".to_string();
        for (id, cert, key) in [
            (
                wire::identity::Identity::Replica {
                    cell: cell.into(),
                    name: name.clone(),
                },
                wire::tls::REPLICA_CERT_FILE,
                wire::tls::REPLICA_KEY_FILE,
            ),
            (
                wire::identity::Identity::Proxy {
                    cell: cell.into(),
                    name: name.clone(),
                },
                wire::tls::PROXY_CERT_FILE,
                wire::tls::PROXY_KEY_FILE,
            ),
        ] {
            let issued = ca.issue(&id, 365).map_err(anyhow::Error::msg)?;
            std::fs::write(dir.join(cert), &issued.cert_pem)?;
            wire::tls::write_private(&dir.join(key), &issued.key_pem)?;
        }
        Ok(())
    };
    let mut children = Children(Vec::new());
    let sub = |name: &str, base_port: u16, replicas: u64| DevArgs {
        replicas,
        data: args.data.join(name),
        base_port,
        proxies: 0,
        proxy_base_port: None,
        // Each process keeps its UDP port's offset from the outer base port.
        metrics_base_port: args
            .metrics_base_port
            .map(|m| m + (base_port - args.base_port)),
        lease_ms: args.lease_ms,
        // Each cell's backups under its own name in the one store.
        backup: args.backup.clone(),
        backup_option: args.backup_option.clone(),
        backup_interval_secs: args.backup_interval_secs,
        backup_keep: args.backup_keep,
        no_demo: true,
        exit_after_demo: false,
        rolling_restart: false,
        cells: None,
    };
    let root_args = sub("root", args.base_port + 100, 1);
    copy_tls(&root_args.data, "root")?;
    let root = spawn_replicas(&root_args, "root", &mut children)?;
    let mut cells = Vec::new();
    for i in 1..=n {
        let name = format!("cell-{i}");
        let a = sub(&name, args.base_port + 10 * (i - 1), args.replicas);
        copy_tls(&a.data, &name)?;
        let eps = spawn_replicas(&a, &name, &mut children)?;
        cells.push((name, eps));
    }
    let ca_file = tls.join(wire::tls::CA_FILE);
    let root_client = Client::connect(ClientConfig::new(root.clone(), ca_file.clone())).await?;
    wait_for_leader(&root_client, Duration::from_secs(30)).await?;
    for (_, eps) in &cells {
        let c = Client::connect(ClientConfig::new(eps.clone(), ca_file.clone())).await?;
        wait_for_leader(&c, Duration::from_secs(30)).await?;
    }
    println!("started a root cell on {} and {n} cells", root.join(","));
    let template = root_client.config().clone();
    for (i, (name, eps)) in cells.iter().enumerate() {
        let cmd = crate::dir::DirCommand::Cell {
            name: name.clone(),
            addrs: eps.clone(),
        };
        crate::dir::run(&root_client, &template, cmd).await?;
        let cmd = crate::dir::DirCommand::Set {
            prefix: format!("/cell-{}-demo", i + 1),
            cell: name.clone(),
        };
        crate::dir::run(&root_client, &template, cmd).await?;
    }
    let listen = format!("127.0.0.1:{}", args.base_port + 200);
    let log = std::fs::File::create(args.data.join("directory.log"))?;
    let mut directory = std::process::Command::new(std::env::current_exe()?);
    directory
        .args([
            "directory",
            "--listen",
            &listen,
            "--root",
            &root.join(","),
            "--tls-dir",
        ])
        .arg(&tls);
    if let Some(m) = metrics_addr(&args, args.base_port + 200)? {
        directory.arg("--metrics-listen").arg(m.to_string());
        println!("the directory's metrics (also /health and /ready): http://{m}/metrics");
    }
    let child = directory
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .context("start the directory")?;
    children.0.push(("directory".into(), child));
    // A routed client: one namespace over the cells.
    let router = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match client_sdk::Router::connect(client_sdk::RouterConfig::new(
                vec![listen.clone()],
                ClientConfig::new(Vec::new(), ca_file.clone()),
            ))
            .await
            {
                Ok(r) if r.map().await.is_ok_and(|m| m.prefixes.len() == n as usize) => return r,
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await
    .context("the directory did not serve the map within 30 s")?;
    for i in 1..=n {
        let p = format!("/cell-{i}-demo");
        match router
            .create(&p, b"hello".to_vec(), CreateMode::default())
            .await
        {
            Ok(_) | Err(Error::NodeExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        println!("{p} lives in {}", router.cell_of(&p).await?);
    }
    router.close().await;
    println!(
        "\ncells running. The map is in the root cell; try, in another terminal:\n  \
         export LOCKCTL_ENDPOINTS={} LOCKCTL_CA={}\n  \
         cargo run -q --bin lockctl -- dir ls\n  \
         cargo run -q --bin lockctl -- dir move /cell-1-demo --to cell-2\n\
         The directory serves the map at {listen} (SDK: client_sdk::Router).\n\
         Ctrl-C stops everything.",
        root.join(","),
        ca_file.display()
    );
    if args.exit_after_demo {
        children.stop();
        return Ok(());
    }
    tokio::signal::ctrl_c().await?;
    println!("stopping the cells");
    children.stop();
    Ok(())
}
