//! `lockctl` end to end: `lockctl dev` starts a real cell of replica processes, the node
//! commands work against it (and fail clearly on bad input), and Ctrl-C stops everything.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const LOCKCTL: &str = env!("CARGO_BIN_EXE_lockctl");

/// A base port with `n` free consecutive UDP ports on 127.0.0.1.
fn free_base(n: u16) -> u16 {
    let start = 20_000 + (std::process::id() % 20_000) as u16;
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

fn lockctl(endpoints: &str, ca: &std::path::Path, args: &[&str]) -> Output {
    Command::new(LOCKCTL)
        .args(["--endpoints", endpoints, "--ca"])
        .arg(ca)
        .args(["--timeout-secs", "10"])
        .args(args)
        .output()
        .expect("run lockctl")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Starts `lockctl dev` and returns it with its output up to "cell running".
fn start_dev(data: &std::path::Path, base: u16, extra: &[&str]) -> (std::process::Child, String) {
    let mut dev = Command::new(LOCKCTL)
        .args([
            "dev",
            "--replicas",
            "3",
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
        if line.starts_with("cell running") {
            break;
        }
    }
    assert!(out.contains("cell running"), "dev did not come up:\n{out}");
    // Keep draining its output, or its next line would hit a closed pipe.
    std::thread::spawn(move || for _ in lines {});
    (dev, out)
}

/// One dev cell at a time in this binary (two cores; fixed port blocks).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stops a `lockctl dev` left running by a failing test (its replicas stop with it).
struct DevGuard(Option<std::process::Child>);

impl Drop for DevGuard {
    fn drop(&mut self) {
        if let Some(dev) = self.0.take() {
            let _ = stop_dev(dev);
        }
    }
}

/// Ctrl-C to `lockctl dev`; waits for it to stop.
fn stop_dev(dev: std::process::Child) -> std::process::ExitStatus {
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

#[test]
fn dev_cell_demo_commands_and_clean_stop() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cell");
    let base = free_base(3);
    let (dev, out) = start_dev(&data, base, &[]);
    let mut dev = DevGuard(Some(dev));
    assert!(out.contains("a stale compare-and-set is refused"), "{out}");
    assert!(
        out.contains("took /demo/lock as /demo/lock/n-0000000000 with fencing token"),
        "{out}"
    );
    assert!(
        out.contains("its ephemeral lock node is gone: true"),
        "{out}"
    );

    let endpoints = (0..3)
        .map(|i| format!("127.0.0.1:{}", base + i))
        .collect::<Vec<_>>()
        .join(",");
    let ca = data.join("tls/ca.pem");

    let o = lockctl(&endpoints, &ca, &["status"]);
    assert!(o.status.success(), "{}", text(&o));
    let s = text(&o);
    assert_eq!(s.matches("Leader").count(), 1, "{s}");
    assert_eq!(s.matches("Follower").count(), 2, "{s}");

    let o = lockctl(&endpoints, &ca, &["create", "/app", "hello"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["get", "/app"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "hello\n");
    assert!(text(&o).contains("version=0"), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["set", "/app", "v2", "--version", "0"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["set", "/app", "v3", "--version", "0"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("version mismatch at /app: expected 0, found 1"),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["create", "/app/job-", "--sequential"]);
    assert!(
        text(&o).contains("created /app/job-0000000000"),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["ls", "/app"]);
    assert!(text(&o).contains("job-0000000000"), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["rm", "/app"]);
    assert!(
        !o.status.success() && text(&o).contains("has children"),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["rm", "/app/job-0000000000"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["get", "/nope"]);
    assert!(
        !o.status.success() && text(&o).contains("no node at /nope"),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["create", "relative/path"]);
    assert!(
        !o.status.success() && text(&o).contains("invalid path"),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["member", "promote", "42"]);
    assert!(
        !o.status.success() && text(&o).contains("membership change refused"),
        "{}",
        text(&o)
    );

    // Ctrl-C stops the cell cleanly.
    let status = stop_dev(dev.0.take().unwrap());
    assert!(status.success(), "{status}");
    // Its replicas are gone: the ports are free again.
    for p in base..base + 3 {
        assert!(
            std::net::UdpSocket::bind(("127.0.0.1", p)).is_ok(),
            "port {p} still bound"
        );
    }
    // The data survives a restart of the dev cell.
    let o = Command::new(LOCKCTL)
        .args([
            "dev",
            "--replicas",
            "3",
            "--exit-after-demo",
            "--base-port",
            &base.to_string(),
            "--data",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn unreachable_cell_and_bad_ca_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let o = lockctl("127.0.0.1:9", &dir.path().join("missing.pem"), &["status"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("missing.pem"), "{}", text(&o));
    let o = Command::new(LOCKCTL).arg("--help").output().unwrap();
    assert!(
        o.status.success() && text(&o).contains("member"),
        "{}",
        text(&o)
    );
}

/// Issue 3, scenario 2: a holder process is stopped (SIGSTOP) past its lease; its session
/// expires; the next waiter gets the lock with a higher token and writes to the fenced
/// resource; the old holder, resumed, has its delayed write refused, and its library
/// reports the session expired.
#[test]
fn paused_holder_is_fenced_out() {
    use std::io::Write;
    use std::os::unix::process::CommandExt;

    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cell");
    let store = dir.path().join("resource");
    let base = free_base(3);
    let (dev, _) = start_dev(&data, base, &["--no-demo", "--lease-ms", "3000"]);
    let mut dev = DevGuard(Some(dev));
    let endpoints = (0..3)
        .map(|i| format!("127.0.0.1:{}", base + i))
        .collect::<Vec<_>>()
        .join(",");
    let ca = data.join("tls/ca.pem");
    let o = lockctl(&endpoints, &ca, &["create", "/locks"]);
    assert!(o.status.success(), "{}", text(&o));

    let lock_cmd = |script: &str| {
        let mut c = Command::new(LOCKCTL);
        c.args(["--endpoints", &endpoints, "--ca"])
            .arg(&ca)
            .args([
                "lock",
                "/locks/res",
                "--on-expiry",
                "keep",
                "--",
                "sh",
                "-c",
                script,
            ])
            .env("LOCKCTL", LOCKCTL)
            .env("STORE", &store)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        c
    };
    // The holder writes once it reads a line: its "delayed write".
    let mut holder = lock_cmd(
        "read line; exec \"$LOCKCTL\" fenced-write --store \"$STORE\" --lock \"$LOCK_PATH\" --token \"$LOCK_TOKEN\" k from-old-holder",
    )
    .spawn()
    .unwrap();
    let mut holder_out = BufReader::new(holder.stdout.take().unwrap()).lines();
    let first = holder_out.next().unwrap().unwrap();
    assert!(first.starts_with("acquired /locks/res"), "{first}");
    let old_token: u64 = first
        .split("token=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();

    let waiter = lock_cmd(
        "exec \"$LOCKCTL\" fenced-write --store \"$STORE\" --lock \"$LOCK_PATH\" --token \"$LOCK_TOKEN\" k from-new-holder",
    )
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // Pause the holder (lockctl and its command) past its 3 s lease.
    let paused_at = Instant::now();
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGSTOP) };
    let waited = waiter.wait_with_output().unwrap();
    let took = paused_at.elapsed();
    let wout = text(&waited);
    assert!(waited.status.success(), "{wout}");
    let new_token: u64 = wout
        .split("token=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(new_token > old_token, "{new_token} > {old_token}");
    assert!(wout.contains("wrote k under /locks/res"), "{wout}");
    println!(
        "FIGURE takeover: waiter granted {} ms after the holder was paused (lease 3000 ms, counted from its last KeepAlive up to 1 s before the pause)",
        took.as_millis()
    );

    // Resume the holder and let it make its delayed write.
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGCONT) };
    holder.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let held = holder.wait_with_output().unwrap();
    let hout = format!(
        "{}{}",
        String::from_utf8_lossy(&held.stdout),
        String::from_utf8_lossy(&held.stderr)
    );
    assert!(hout.contains("refused: stale fencing token"), "{hout}");
    assert!(
        hout.contains("session expired"),
        "the holder's library reports expiry: {hout}"
    );
    assert_eq!(held.status.code(), Some(4), "{hout}");
    let o = Command::new(LOCKCTL)
        .args(["fenced-get", "--store"])
        .arg(&store)
        .arg("k")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "from-new-holder\n",
        "{}",
        text(&o)
    );
    assert!(stop_dev(dev.0.take().unwrap()).success());
}

/// Issue 4, scenario 2 with a real client process: a cacher stopped with SIGSTOP delays a
/// write to its node until its lease runs out, not longer; resumed, it never serves the old
/// value (its local lease had already run out, so its cache was off).
#[test]
fn stopped_cacher_delays_write_and_never_serves_the_old_value() {
    use std::os::unix::process::CommandExt;

    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cell");
    let base = free_base(3);
    let (dev, _) = start_dev(&data, base, &["--no-demo", "--lease-ms", "3000"]);
    let mut dev = DevGuard(Some(dev));
    let endpoints = (0..3)
        .map(|i| format!("127.0.0.1:{}", base + i))
        .collect::<Vec<_>>()
        .join(",");
    let ca = data.join("tls/ca.pem");
    assert!(lockctl(&endpoints, &ca, &["create", "/flag", "old"])
        .status
        .success());
    let mut cacher = Command::new(LOCKCTL)
        .args(["--endpoints", &endpoints, "--ca"])
        .arg(&ca)
        .args([
            "watch-cached",
            "/flag",
            "--every-ms",
            "50",
            "--for-secs",
            "20",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(cacher.stdout.take().unwrap()).lines();
    // Wait until it serves from its cache.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let line = lines.next().unwrap().unwrap();
        if line.contains(" cache ") && line.ends_with(" old") {
            break;
        }
        assert!(Instant::now() < deadline, "never cached: {line}");
    }
    unsafe { libc::kill(-(cacher.id() as i32), libc::SIGSTOP) };
    let stopped = Instant::now();
    let o = lockctl(&endpoints, &ca, &["set", "/flag", "new"]);
    let held = stopped.elapsed();
    assert!(o.status.success(), "{}", text(&o));
    println!(
        "FIGURE cache: write held {} ms by a SIGSTOPped cacher (lease 3000 ms)",
        held.as_millis()
    );
    assert!(
        held >= Duration::from_millis(1_500),
        "the write waited for the stopped cacher: {held:?}"
    );
    assert!(
        held < Duration::from_millis(3_000 + 3_000),
        "not much longer than its lease: {held:?}"
    );
    let resumed_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros();
    unsafe { libc::kill(-(cacher.id() as i32), libc::SIGCONT) };
    // Nothing it reads after resuming is the old value (its session has expired, so its
    // reads fail; a cached old value would be the bug).
    let mut after = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while after < 20 && Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        let start: u128 = line.split(' ').next().unwrap().parse().unwrap();
        if start > resumed_us {
            assert!(
                !line.ends_with(" old"),
                "served the old value after resuming: {line}"
            );
            after += 1;
        }
    }
    assert!(after > 0, "no reads after resuming");
    unsafe { libc::kill(-(cacher.id() as i32), libc::SIGKILL) };
    let _ = cacher.wait();
    assert!(stop_dev(dev.0.take().unwrap()).success());
}

/// Issue 4, scenario 3 with separate processes: three `lockctl watch-cached` reader
/// processes read a cached node in a loop while this process writes increasing values;
/// no read returns a value older than a write that completed before the read began. Once
/// plainly and once across a leader `kill -9`.
#[test]
fn checker_with_reader_processes() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cell");
    let base = free_base(3);
    let (dev, _) = start_dev(&data, base, &["--no-demo"]);
    let mut dev = DevGuard(Some(dev));
    let endpoints = (0..3)
        .map(|i| format!("127.0.0.1:{}", base + i))
        .collect::<Vec<_>>()
        .join(",");
    let ca = data.join("tls/ca.pem");
    assert!(lockctl(&endpoints, &ca, &["create", "/reg", "0"])
        .status
        .success());
    let wall_us = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros()
    };
    for kill_leader in [false, true] {
        let readers: Vec<_> = (0..3)
            .map(|_| {
                Command::new(LOCKCTL)
                    .args(["--endpoints", &endpoints, "--ca"])
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
        let mut value = 1000 * u64::from(kill_leader) + 1;
        let started = Instant::now();
        let mut killed = false;
        while started.elapsed() < Duration::from_secs(5) {
            if kill_leader && !killed && started.elapsed() > Duration::from_secs(1) {
                // kill -9 whichever replica leads now.
                let o = lockctl(&endpoints, &ca, &["status"]);
                let st = text(&o);
                if let Some(line) = st.lines().find(|l| l.contains(" Leader ")) {
                    let addr = line.split_whitespace().nth(1).unwrap().to_string();
                    let pid = Command::new("pgrep")
                        .args(["-f", "replica --config"])
                        .output()
                        .unwrap();
                    for p in String::from_utf8_lossy(&pid.stdout).lines() {
                        let cmdline = std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                            .unwrap_or_default();
                        let cfg_path = cmdline.split('\0').nth(3).unwrap_or("").to_string();
                        let cfg = std::fs::read_to_string(&cfg_path).unwrap_or_default();
                        if cfg_path.starts_with(data.to_str().unwrap())
                            && cfg.contains(&format!("listen = \"{addr}\""))
                        {
                            unsafe { libc::kill(p.parse::<i32>().unwrap(), libc::SIGKILL) };
                        }
                    }
                    killed = true;
                }
            }
            let start = wall_us();
            let o = lockctl(&endpoints, &ca, &["set", "/reg", &value.to_string()]);
            let end = wall_us();
            if o.status.success() {
                writes.push((value, start, end));
            }
            value += 1;
        }
        let mut reads = 0;
        for r in readers {
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
        println!(
            "FIGURE cache checker, 3 reader processes{}: {reads} reads, {} writes, no stale read",
            if kill_leader {
                " across a leader kill -9"
            } else {
                ""
            },
            writes.len()
        );
        assert!(
            reads > 100 && writes.len() > 5,
            "{reads} reads, {} writes",
            writes.len()
        );
    }
    // The dev launcher reports the killed replica's exit; stop what is left.
    let _ = stop_dev(dev.0.take().unwrap());
}
