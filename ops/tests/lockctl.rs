//! `lockctl` end to end: `lockctl dev` starts a real cell of replica processes, the node
//! commands work against it (and fail clearly on bad input), and Ctrl-C stops everything.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::*;

#[test]
fn dev_cell_demo_commands_and_clean_stop() {
    let _g = serial();
    let mut cell = DevCell::start(&[]);
    let (out, base, data) = (cell.out.clone(), cell.base, cell.data.clone());
    assert!(out.contains("a stale compare-and-set is refused"), "{out}");
    assert!(
        out.contains("took /demo/lock as /demo/lock/n-0000000000 with fencing token"),
        "{out}"
    );
    assert!(
        out.contains("its ephemeral lock node is gone: true"),
        "{out}"
    );

    let (endpoints, ca) = (cell.eps(), cell.ca.clone());

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
    // Every replica times what it answers: the creates above reached the leader.
    let o = lockctl(&endpoints, &ca, &["latency"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(text(&o).matches("(replica)").count(), 3, "{}", text(&o));
    let creates: u64 = text(&o)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Create "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(creates >= 2, "{}", text(&o));
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

    // A snapshot on demand on every replica; `status --full` shows its size.
    let o = lockctl(&endpoints, &ca, &["snapshot"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        text(&o).matches("snapshot at index").count(),
        3,
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["status", "--full"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        text(&o).matches("snapshot_bytes: 0,").count(),
        0,
        "{}",
        text(&o)
    );
    assert_eq!(
        text(&o).matches("snapshot_bytes:").count(),
        3,
        "{}",
        text(&o)
    );

    // Ctrl-C stops the cell cleanly.
    let status = cell.stop();
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
    let mut cell = DevCell::start(&["--no-demo", "--lease-ms", "3000"]);
    let store = cell.dir.path().join("resource");
    let (ca, endpoints) = (cell.ca.clone(), cell.eps());
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
    assert!(cell.stop().success());
}

/// Issue 4, scenario 2 with a real client process: a cacher stopped with SIGSTOP delays a
/// write to its node until its lease runs out, not longer; resumed, it never serves the old
/// value (its local lease had already run out, so its cache was off).
#[test]
fn stopped_cacher_delays_write_and_never_serves_the_old_value() {
    use std::os::unix::process::CommandExt;

    let _g = serial();
    let mut cell = DevCell::start(&["--no-demo", "--lease-ms", "3000"]);
    let (ca, endpoints) = (cell.ca.clone(), cell.eps());
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
    assert!(cell.stop().success());
}

/// Issue 4, scenario 3 with separate processes: three `lockctl watch-cached` reader
/// processes read a cached node in a loop while this process writes increasing values;
/// no read returns a value older than a write that completed before the read began. Once
/// plainly and once across a leader `kill -9`.
#[test]
fn checker_with_reader_processes() {
    let _g = serial();
    let mut cell = DevCell::start(&["--no-demo"]);
    let (data, ca, endpoints) = (cell.data.clone(), cell.ca.clone(), cell.eps());
    assert!(lockctl(&endpoints, &ca, &["create", "/reg", "0"])
        .status
        .success());
    let readers = vec![endpoints.clone(); 3];
    for kill_leader in [false, true] {
        let (reads, writes) = cache_checker(&data, &readers, &endpoints, kill_leader);
        println!(
            "FIGURE cache checker, 3 reader processes{}: {reads} reads, {writes} writes, no stale read",
            if kill_leader {
                " across a leader kill -9"
            } else {
                ""
            },
        );
    }
    // The dev launcher reports the killed replica's exit; stop what is left.
    let _ = cell.stop();
}
