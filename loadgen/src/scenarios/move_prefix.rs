//! `move` (ours only; issue 25): a prefix of N nodes moved between two cells while writers
//! write through a router. Reports how long the prefix was frozen, what the writers met
//! meanwhile, and how long after the move every writer worked in the new cell.
//!
//! Its own cluster: `lockctl dev --cells 2` (a root cell, two cells, a directory).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use client_sdk::{ClientConfig, CreateMode, Router, RouterConfig, TxnOp};

use crate::pinning::Cpus;
use crate::report::{Lat, Report};

/// The prefix `lockctl dev --cells 2` places in cell-1, moved to cell-2.
const PREFIX: &str = "/cell-1-demo";

/// What `lockctl dev --cells 2` printed that the run needs.
struct Cells {
    dev: std::process::Child,
    root: String,
    ca: std::path::PathBuf,
    directory: String,
    _tmp: tempfile::TempDir,
}

impl Drop for Cells {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our child's pid; SIGINT stops `lockctl dev` and its cells.
        unsafe { libc::kill(self.dev.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.dev.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.dev.kill();
        let _ = self.dev.wait();
    }
}

fn start_cells(
    replicas: u16,
    lockctl: &std::path::Path,
    server_cpus: Option<&Cpus>,
) -> anyhow::Result<Cells> {
    let tmp = tempfile::Builder::new().prefix("loadgen-move-").tempdir()?;
    let base = crate::cluster::free_base(40, 23_000);
    let mut cmd = Command::new(lockctl);
    cmd.args(["dev", "--cells", "2", "--replicas", &replicas.to_string()])
        .args(["--base-port", &base.to_string(), "--data"])
        .arg(tmp.path().join("cells"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // Bound from its start, and with it every replica, proxy and directory it starts.
    if let Some(cpus) = server_cpus {
        crate::pinning::start_on(&mut cmd, cpus);
    }
    let mut dev = cmd.spawn().context("start lockctl dev --cells 2")?;
    let mut lines = BufReader::new(dev.stdout.take().context("stdout")?).lines();
    let (mut root, mut ca, mut directory) = (None, None, None);
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        let Some(Ok(l)) = lines.next() else { break };
        if let Some(rest) = l.trim().strip_prefix("export ") {
            for kv in rest.split(' ') {
                match kv.split_once('=') {
                    Some(("LOCKCTL_ENDPOINTS", v)) => root = Some(v.to_string()),
                    Some(("LOCKCTL_CA", v)) => ca = Some(std::path::PathBuf::from(v)),
                    _ => {}
                }
            }
        }
        if let Some(rest) = l.strip_prefix("The directory serves the map at ") {
            directory = rest.split(' ').next().map(str::to_string);
        }
        if l.starts_with("Ctrl-C") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    match (root, ca, directory) {
        (Some(root), Some(ca), Some(directory)) => Ok(Cells {
            dev,
            root,
            ca,
            directory,
            _tmp: tmp,
        }),
        _ => {
            let _ = dev.kill();
            let _ = dev.wait();
            bail!("lockctl dev --cells 2 did not come up")
        }
    }
}

/// One run: `nodes` nodes under the prefix, `writers` writers, the move; the cells on
/// `server_cpus` if given.
pub async fn run(
    replicas: u16,
    nodes: usize,
    writers: usize,
    scale: f64,
    server_cpus: Option<&Cpus>,
) -> anyhow::Result<Report> {
    let lockctl = crate::cluster::sibling("lockctl")?;
    let cells = tokio::task::block_in_place(|| start_cells(replicas, &lockctl, server_cpus))?;
    let router = Router::connect(RouterConfig::new(
        vec![cells.directory.clone()],
        ClientConfig::new(Vec::new(), cells.ca.clone()),
    ))
    .await?;
    let s = router.session_for(PREFIX).await?;
    s.create(&format!("{PREFIX}/data"), Vec::new(), CreateMode::default())
        .await?;
    let per_txn = wire::TXN_OPS_MAX.min(100);
    for t in 0..nodes.div_ceil(per_txn) {
        let ops = (t * per_txn..((t + 1) * per_txn).min(nodes))
            .map(|i| TxnOp::Create {
                path: format!("{PREFIX}/data/n{i:06}"),
                data: vec![b'x'; 100],
                mode: CreateMode::default(),
            })
            .collect();
        s.txn(ops).await?;
    }
    // Writers through a router whose requests give up after a second, as an
    // application's would: they meet the move.
    let mut tmpl = ClientConfig::new(Vec::new(), cells.ca.clone());
    tmpl.request_timeout = Duration::from_secs(1);
    let wrouter = Router::connect(RouterConfig::new(vec![cells.directory.clone()], tmpl)).await?;
    let stop = Arc::new(AtomicBool::new(false));
    // Stops the writers on every way out of this function, errors included.
    let _stop = StopOnDrop(stop.clone());
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    // Each write creates a node of its own (a sequential child of the writer's node), so
    // that every acknowledged write can be looked for in the new cell afterwards.
    let sequential = CreateMode {
        ephemeral: false,
        sequential: true,
    };
    for w in 0..writers {
        let path = format!("{PREFIX}/w{w}");
        router
            .create(&path, b"0".to_vec(), CreateMode::default())
            .await?;
        let (r, stop) = (wrouter.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Lat::new(start);
            let mut failed = 0u64;
            let mut acked: Vec<String> = Vec::new();
            let mut in_new: Option<Instant> = None;
            while !stop.load(Ordering::SeqCst) {
                let t0 = tokio::time::Instant::now();
                match r
                    .create(&format!("{path}/e-"), Vec::new(), sequential)
                    .await
                {
                    Ok(c) => {
                        let t1 = tokio::time::Instant::now();
                        lat.record(t1 - t0, t1);
                        acked.push(c.path);
                        if in_new.is_none()
                            && r.cell_of(&path).await.ok().as_deref() == Some("cell-2")
                        {
                            in_new = Some(Instant::now());
                        }
                    }
                    Err(_) => failed += 1,
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (path, lat, acked, failed, in_new)
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let moved_at = Instant::now();
    let out = tokio::task::block_in_place(|| {
        Command::new(&lockctl)
            .args(["--endpoints", &cells.root, "--ca"])
            .arg(&cells.ca)
            .args(["dir", "move", PREFIX, "--to", "cell-2"])
            .output()
    })?;
    let returned = Instant::now();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "lockctl dir move failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // "frozen N ms, move M ms"
    let ms_after = |key: &str| -> Option<f64> {
        let i = text.find(key)? + key.len();
        text[i..].split(' ').next()?.parse().ok()
    };
    let frozen = ms_after("frozen ").context("no freeze time in lockctl's output")?;
    let whole = ms_after("move ").context("no move time in lockctl's output")?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let mut lat = Lat::new(start);
    let (mut failed, mut slowest) = (0u64, Duration::ZERO);
    let (mut lost, mut acked_all) = (0u64, 0u64);
    for t in tasks {
        let (path, l, acked, f, in_new) = t.await?;
        lat.merge(&l);
        failed += f;
        let at = in_new.with_context(|| format!("{path} never wrote in the new cell"))?;
        slowest = slowest.max(at.saturating_duration_since(returned));
        // Every acknowledged write, in the cell the prefix lives in now.
        let present: std::collections::HashSet<String> = router
            .children(&path)
            .await?
            .into_iter()
            .map(|(name, _)| format!("{path}/{name}"))
            .collect();
        acked_all += acked.len() as u64;
        lost += acked.iter().filter(|p| !present.contains(*p)).count() as u64;
    }
    let stats = wrouter.stats();
    let checked = server_cpus.map(|c| crate::pinning::check_tree(cells.dev.id(), c));
    router.close().await;
    wrouter.close().await;
    let mut r = Report::new("move", "ours", scale);
    r.param("replicas per cell", replicas);
    r.param("nodes under the prefix", nodes);
    r.param("writers (1 s request deadline)", writers);
    r.figure("prefix frozen (ms, lockctl's own clock)", frozen);
    r.figure("whole move (ms)", whole);
    r.figure(
        "dir move command (ms, with its process start)",
        (returned - moved_at).as_secs_f64() * 1e3,
    );
    r.figure(
        "every writer working in the new cell, after the command returned (ms)",
        slowest.as_secs_f64() * 1e3,
    );
    r.figure(
        "writes failed (deadline passed during the move)",
        failed as f64,
    );
    r.figure(
        "WrongCell answers met by the writers' router",
        stats.wrong_cell as f64,
    );
    r.figure(
        "acknowledged writes (each a node of its own)",
        acked_all as f64,
    );
    r.figure(
        "acknowledged writes lost (not found in the new cell)",
        lost as f64,
    );
    r.latency_failed("write", &lat, failed);
    if let Some((bound, total)) = checked {
        r.param(
            "server threads on the server CPUs at the end",
            format!("{bound} of {total}"),
        );
    }
    if lost > 0 {
        bail!("{lost} acknowledged writes were not found in the new cell");
    }
    Ok(r)
}

/// Sets the flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}
