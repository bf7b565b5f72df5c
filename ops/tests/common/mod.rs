//! Helpers shared by the `lockctl` end-to-end tests: a dev cell of real processes on
//! loopback, `lockctl` invocations, and the multi-process cache checker.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const LOCKCTL: &str = env!("CARGO_BIN_EXE_lockctl");

/// A base port with `n` free consecutive UDP ports on 127.0.0.1.
pub fn free_base(n: u16) -> u16 {
    free_base_from(20_000 + (std::process::id() % 20_000) as u16, n)
}

/// A base port at or above `start` with `n` free consecutive UDP ports on 127.0.0.1.
pub fn free_base_from(start: u16, n: u16) -> u16 {
    'outer: for base in (start..60_000).step_by(16) {
        for p in base..base + n {
            if std::net::UdpSocket::bind(("127.0.0.1", p)).is_err() {
                continue 'outer;
            }
        }
        return base;
    }
    panic!("no free ports");
}

/// A base port `b` with TCP ports `b + o` free on 127.0.0.1 for every offset `o` (in a
/// region of its own, above the UDP ports [`free_base`] finds).
pub fn free_tcp_base(offsets: &[u16]) -> u16 {
    let start = 41_000 + (std::process::id() % 10_000) as u16;
    'outer: for base in (start..60_000).step_by(7) {
        for o in offsets {
            if std::net::TcpListener::bind(("127.0.0.1", base + o)).is_err() {
                continue 'outer;
            }
        }
        return base;
    }
    panic!("no free TCP ports");
}

/// Every word of `text` that starts with `prefix` (letters, digits and `_` after it):
/// the metric names or environment variables a file uses.
pub fn words_starting(text: &str, prefix: &str) -> std::collections::BTreeSet<String> {
    text.match_indices(prefix)
        .map(|(i, _)| {
            text[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

pub fn lockctl(endpoints: &str, ca: &std::path::Path, args: &[&str]) -> Output {
    Command::new(LOCKCTL)
        // The client's certificate next to the CA, whatever the caller's environment says.
        .env_remove("LOCKCTL_CERT")
        .env_remove("LOCKCTL_KEY")
        // No settings file of the user's (an empty one).
        .env("LOCKCTL_CONFIG", "/dev/null")
        .args(["--endpoints", endpoints, "--ca"])
        .arg(ca)
        .args(["--timeout-secs", "10"])
        .args(args)
        .output()
        .expect("run lockctl")
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Starts `lockctl dev` and returns it with its output up to "cell running" and the
/// hints after it (to the line "Ctrl-C stops ...").
pub fn start_dev(
    data: &std::path::Path,
    base: u16,
    extra: &[&str],
) -> (std::process::Child, String) {
    start_dev_of(data, base, 3, extra)
}

/// [`start_dev`] with `replicas` replicas.
pub fn start_dev_of(
    data: &std::path::Path,
    base: u16,
    replicas: u16,
    extra: &[&str],
) -> (std::process::Child, String) {
    start_dev_with(data, base, replicas, extra, &[])
}

/// [`start_dev_of`] with `env` set for `lockctl dev` and the processes it starts.
pub fn start_dev_with(
    data: &std::path::Path,
    base: u16,
    replicas: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, String) {
    let mut dev = Command::new(LOCKCTL);
    dev.envs(env.iter().copied());
    let mut dev = dev
        .args([
            "dev",
            "--replicas",
            &replicas.to_string(),
            "--base-port",
            &base.to_string(),
            "--data",
        ])
        .arg(data)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = String::new();
    let mut lines = BufReader::new(dev.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        out.push_str(&line);
        out.push('\n');
        if line.starts_with("Ctrl-C stops") {
            break;
        }
    }
    assert!(
        out.contains("cell running") || out.contains("cells running"),
        "dev did not come up:\n{out}"
    );
    // Keep draining its output, or its next line would hit a closed pipe.
    std::thread::spawn(move || for _ in lines {});
    (dev, out)
}

/// A `lockctl dev` cell (three replicas unless told) in its own temporary directory,
/// stopped on drop: the preamble of most tests here.
pub struct DevCell {
    /// The temporary directory; the cell's data is in `cell/`, tests may add files.
    pub dir: tempfile::TempDir,
    /// The cell's data directory.
    pub data: std::path::PathBuf,
    /// The first replica's port (the others follow it).
    pub base: u16,
    /// The replicas' addresses.
    pub endpoints: Vec<String>,
    /// The development CA the cell's certificates are signed with.
    pub ca: std::path::PathBuf,
    /// What `lockctl dev` printed up to "cell running".
    pub out: String,
    dev: DevGuard,
}

impl DevCell {
    /// Starts `lockctl dev --replicas 3` with `extra` arguments on free ports.
    pub fn start(extra: &[&str]) -> DevCell {
        DevCell::start_of(3, extra)
    }

    /// Starts `lockctl dev --replicas N` with `extra` arguments on free ports.
    pub fn start_of(replicas: u16, extra: &[&str]) -> DevCell {
        DevCell::start_in(tempfile::tempdir().unwrap(), replicas, extra)
    }

    /// Like [`DevCell::start_of`], for the cell `cell` of the CA in `tls` (a dev cell's
    /// `tls/`): its files are copied in (not the CA's key), with a replica certificate
    /// naming `cell` (`lock://<cell>/replica/dev`), as cells behind one directory are.
    pub fn start_sharing(
        replicas: u16,
        extra: &[&str],
        tls: &std::path::Path,
        cell: &str,
    ) -> DevCell {
        let dir = tempfile::tempdir().unwrap();
        let into = dir.path().join("cell/tls");
        std::fs::create_dir_all(&into).unwrap();
        for f in std::fs::read_dir(tls).unwrap() {
            let f = f.unwrap();
            if f.file_name() != wire::tls::CA_KEY_FILE {
                std::fs::copy(f.path(), into.join(f.file_name())).unwrap();
            }
        }
        let read = |f: &str| std::fs::read_to_string(tls.join(f)).unwrap();
        let ca = wire::tls::Ca::from_pem(&read(wire::tls::CA_FILE), &read(wire::tls::CA_KEY_FILE))
            .unwrap();
        let id = wire::identity::Identity::Replica {
            cell: cell.into(),
            name: "dev".into(),
        };
        let issued = ca.issue(&id, 30).unwrap();
        std::fs::write(into.join(wire::tls::REPLICA_CERT_FILE), issued.cert_pem).unwrap();
        wire::tls::write_private(&into.join(wire::tls::REPLICA_KEY_FILE), &issued.key_pem).unwrap();
        DevCell::start_in(dir, replicas, extra)
    }

    /// `lockctl dev` with its data in `dir`'s `cell/`.
    fn start_in(dir: tempfile::TempDir, replicas: u16, extra: &[&str]) -> DevCell {
        let data = dir.path().join("cell");
        let base = free_base(replicas);
        let (dev, out) = start_dev_of(&data, base, replicas, extra);
        DevCell {
            endpoints: (0..replicas)
                .map(|i| format!("127.0.0.1:{}", base + i))
                .collect(),
            ca: data.join("tls/ca.pem"),
            data,
            dir,
            base,
            out,
            dev: DevGuard(Some(dev)),
        }
    }

    /// The endpoints as `lockctl --endpoints` takes them.
    pub fn eps(&self) -> String {
        self.endpoints.join(",")
    }

    /// Ctrl-C to `lockctl dev`; waits for it and returns its exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        stop_dev(self.dev.0.take().expect("the cell is running"))
    }
}

/// One dev cell at a time in this binary (two cores; fixed port blocks).
pub static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stops a `lockctl dev` left running by a failing test (its replicas stop with it).
pub struct DevGuard(pub Option<std::process::Child>);

impl Drop for DevGuard {
    fn drop(&mut self) {
        if let Some(dev) = self.0.take() {
            let _ = stop_dev(dev);
        }
    }
}

/// Ctrl-C to `lockctl dev`; waits for it to stop.
pub fn stop_dev(dev: std::process::Child) -> std::process::ExitStatus {
    let mut dev = dev;
    unsafe { libc::kill(dev.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = dev.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "lockctl dev did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pid of the `lockctl replica|proxy --config` process of the cell in `data` whose
/// configuration listens on `addr`.
pub fn pid_listening(data: &Path, kind: &str, addr: &str) -> Option<i32> {
    let pids = Command::new("pgrep")
        .args(["-f", &format!("{kind} --config")])
        .output()
        .unwrap();
    for p in String::from_utf8_lossy(&pids.stdout).lines() {
        let cmdline = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default();
        let cfg_path = cmdline.split('\0').nth(3).unwrap_or("").to_string();
        let cfg = std::fs::read_to_string(&cfg_path).unwrap_or_default();
        if cfg_path.starts_with(data.to_str().unwrap())
            && cfg.contains(&format!("listen = \"{addr}\""))
        {
            return p.parse().ok();
        }
    }
    None
}

/// `kill -9` of whichever replica of the cell in `data` leads now (asked through
/// `endpoints`). Returns its address.
pub fn kill_leader(data: &Path, endpoints: &str) -> Option<String> {
    signal_leader(data, endpoints, libc::SIGKILL).map(|(addr, _)| addr)
}

/// Sends `sig` to the leader's replica process; returns its address and pid.
pub fn signal_leader(data: &Path, endpoints: &str, sig: i32) -> Option<(String, i32)> {
    let o = lockctl(endpoints, &data.join("tls/ca.pem"), &["status"]);
    let st = text(&o);
    let line = st.lines().find(|l| l.contains(" Leader "))?;
    let addr = line.split_whitespace().nth(1)?.to_string();
    let pid = pid_listening(data, "replica", &addr)?;
    unsafe { libc::kill(pid, sig) };
    Some((addr, pid))
}

fn wall_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// The cache checker: one `lockctl watch-cached /reg` reader process per entry of
/// `readers` (each with those endpoints) reads the node in a loop while this process
/// writes increasing values through `writer`; asserts that no read returns a value older
/// than a write that completed before the read began. With `kill`, the leader is killed
/// (`kill -9`) a second into the writes. Returns (reads, writes).
pub fn cache_checker(data: &Path, readers: &[String], writer: &str, kill: bool) -> (usize, usize) {
    let ca = data.join("tls/ca.pem");
    let procs: Vec<_> = readers
        .iter()
        .map(|endpoints| {
            Command::new(LOCKCTL)
                .args(["--endpoints", endpoints, "--ca"])
                .arg(&ca)
                .args(["watch-cached", "/reg", "--every-ms", "5", "--for-secs", "7"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    // The writer: this process, through lockctl set (one process per write).
    let mut writes: Vec<(u64, u128, u128)> = Vec::new();
    // Values only grow across runs on one cell: start above anything written before.
    let floor = std::fs::read_to_string(data.join("checker-floor"))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let mut value = floor + 1;
    let started = Instant::now();
    let mut killed = !kill;
    while started.elapsed() < Duration::from_secs(5) {
        if !killed && started.elapsed() > Duration::from_secs(1) {
            killed = kill_leader(data, writer).is_some();
        }
        let start = wall_us();
        let o = lockctl(writer, &ca, &["set", "/reg", &value.to_string()]);
        let end = wall_us();
        if o.status.success() {
            writes.push((value, start, end));
        }
        value += 1;
    }
    std::fs::write(data.join("checker-floor"), value.to_string()).unwrap();
    let mut reads = 0;
    for r in procs {
        let out = r.wait_with_output().unwrap();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            if parts.len() < 5 || parts[2] == "error:" {
                continue;
            }
            let (start, got): (u128, u64) =
                (parts[0].parse().unwrap(), parts[4].parse().unwrap_or(0));
            let newest_done = writes
                .iter()
                .filter(|w| w.2 < start)
                .map(|w| w.0)
                .max()
                .unwrap_or(0);
            assert!(
                got >= newest_done || got == 0 && newest_done == 0,
                "stale read by a reader process: {line} after write {newest_done} completed"
            );
            reads += 1;
        }
    }
    assert!(
        reads > 100 && writes.len() > 5,
        "{reads} reads, {} writes",
        writes.len()
    );
    (reads, writes.len())
}

/// What a [`Relay`] lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Link {
    /// Everything, both ways.
    Open = 0,
    /// Nothing, either way: the client is cut off from the cell.
    Cut = 1,
    /// The client's datagrams reach the cell; none of the cell's reach the client (its
    /// KeepAlives renew the session at the leader, but it never hears so).
    RepliesLost = 2,
}

/// A UDP relay on loopback between clients and one server, which the test can cut (both
/// ways, or only the server's replies) and heal. Each client address gets an upstream
/// socket of its own. Threads, not tasks: the tests here are synchronous. Stopped on drop.
pub struct Relay {
    /// Where clients send.
    pub addr: std::net::SocketAddr,
    link: std::sync::Arc<std::sync::atomic::AtomicU8>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    /// A relay to `target`, open.
    pub fn start(target: std::net::SocketAddr) -> Relay {
        use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
        use std::sync::Arc;
        let listen = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        listen
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let addr = listen.local_addr().unwrap();
        let link = Arc::new(AtomicU8::new(Link::Open as u8));
        let stop = Arc::new(AtomicBool::new(false));
        let (link2, stop2) = (link.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut upstream = std::collections::HashMap::new();
            let mut back = Vec::new();
            let mut buf = vec![0u8; 65_536];
            while !stop2.load(Ordering::SeqCst) {
                let Ok((n, from)) = listen.recv_from(&mut buf) else {
                    continue;
                };
                let up: &mut std::net::UdpSocket = upstream.entry(from).or_insert_with(|| {
                    let up = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                    up.connect(target).unwrap();
                    up.set_read_timeout(Some(Duration::from_millis(50)))
                        .unwrap();
                    let (up2, listen2) = (up.try_clone().unwrap(), listen.try_clone().unwrap());
                    let (link3, stop3) = (link2.clone(), stop2.clone());
                    back.push(std::thread::spawn(move || {
                        let mut b = vec![0u8; 65_536];
                        while !stop3.load(Ordering::SeqCst) {
                            let Ok(n) = up2.recv(&mut b) else { continue };
                            if link3.load(Ordering::SeqCst) == Link::Open as u8 {
                                let _ = listen2.send_to(&b[..n], from);
                            }
                        }
                    }));
                    up
                });
                if link2.load(Ordering::SeqCst) != Link::Cut as u8 {
                    let _ = up.send(&buf[..n]);
                }
            }
            for t in back {
                let _ = t.join();
            }
        });
        Relay {
            addr,
            link,
            stop,
            thread: Some(thread),
        }
    }

    /// Lets through what `link` says, from now on.
    pub fn set(&self, link: Link) {
        self.link
            .store(link as u8, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Microseconds since the epoch, now.
pub fn now_us() -> u128 {
    wall_us()
}

/// The lines a child writes to one of its pipes, each with when this process read it
/// (µs since the epoch), collected by a thread.
#[derive(Clone, Default)]
pub struct Lines(pub std::sync::Arc<std::sync::Mutex<Vec<(u128, String)>>>);

impl Lines {
    /// Starts collecting the lines of `from`.
    pub fn collect(from: impl std::io::Read + Send + 'static) -> Lines {
        let lines = Lines::default();
        let l = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(from).lines() {
                let Ok(line) = line else { break };
                l.0.lock().unwrap().push((wall_us(), line));
            }
        });
        lines
    }

    /// The first line containing `what`, with when it was read.
    pub fn find(&self, what: &str) -> Option<(u128, String)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .find(|(_, l)| l.contains(what))
            .cloned()
    }

    /// Waits until a line contains `what`, for at most `within`.
    pub fn wait_for(&self, what: &str, within: Duration) -> Option<(u128, String)> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = self.find(what) {
                return Some(l);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Everything so far, one line each.
    pub fn text(&self) -> String {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(at, l)| format!("[{at}] {l}\n"))
            .collect()
    }
}

/// Waits until `cond` holds, for at most `within`; whether it did.
pub fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A two-worker runtime for a test's async part.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
