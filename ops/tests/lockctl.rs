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
    // Each replica's lag behind the leader's log, and its log's fsync p99 of the last
    // minute or two (the demo wrote a moment ago).
    assert!(s.contains(" lag ") && s.contains("fsync p99"), "{s}");
    for line in s
        .lines()
        .filter(|l| l.contains(" Leader ") || l.contains(" Follower "))
    {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert!(cols[7].parse::<u64>().is_ok(), "lag: {line}");
        assert!(line.trim_end().ends_with(" ms"), "fsync p99: {line}");
    }

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
    // The leadership handed over on demand (a replica stopped with SIGTERM while
    // leading does the same: replica/tests/handover.rs).
    let o = lockctl(&endpoints, &ca, &["member", "transfer-leader", "9"]);
    assert!(
        !o.status.success() && text(&o).contains("not a voter"),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["member", "transfer-leader"]);
    assert!(
        o.status.success() && text(&o).contains(" leads (was "),
        "{}",
        text(&o)
    );
    let o = lockctl(&endpoints, &ca, &["status"]);
    assert_eq!(text(&o).matches("Leader").count(), 1, "{}", text(&o));

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
    let o = Command::new(LOCKCTL)
        .args(["lock", "--help"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && text(&o).contains("--on-jeopardy") && text(&o).contains("SIGSTOP"),
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

/// The command `lockctl lock` runs in the jeopardy tests: it writes its shell's pid to
/// `$PIDFILE`, then a line with the time (µs since the epoch) to `$HB` every 50 ms, until
/// `$DONE` exists (at most 60 s).
const HEARTBEAT: &str = r#"echo $$ > "$PIDFILE"
i=0
while [ $i -lt 1200 ] && [ ! -e "$DONE" ]; do
  date +%s%6N >> "$HB"
  sleep 0.05
  i=$((i+1))
done"#;

/// A `lockctl lock` process running [`HEARTBEAT`], its output collected; on drop its
/// process group and its command's are killed (a test that fails leaves nothing running).
struct Heartbeating {
    lockctl: std::process::Child,
    out: Lines,
    err: Lines,
    dir: std::path::PathBuf,
}

impl Heartbeating {
    /// `lockctl lock /locks/job` with `lock_args` around `sh -c script` (usually
    /// [`HEARTBEAT`]).
    fn start(
        dir: &std::path::Path,
        endpoints: &str,
        ca: &std::path::Path,
        lock_args: &[&str],
        script: &str,
    ) -> Heartbeating {
        use std::os::unix::process::CommandExt;
        let mut lockctl = Command::new(LOCKCTL)
            .args(["--endpoints", endpoints, "--ca"])
            .arg(ca)
            .args(["lock", "/locks/job"])
            .args(lock_args)
            .args(["--", "sh", "-c", script])
            .env("HB", dir.join("heartbeats"))
            .env("PIDFILE", dir.join("command.pid"))
            .env("DONE", dir.join("done"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let out = Lines::collect(lockctl.stdout.take().unwrap());
        let err = Lines::collect(lockctl.stderr.take().unwrap());
        Heartbeating {
            lockctl,
            out,
            err,
            dir: dir.to_path_buf(),
        }
    }

    /// The heartbeats written so far (complete lines only).
    fn beats(&self) -> Vec<u128> {
        let s = std::fs::read_to_string(self.dir.join("heartbeats")).unwrap_or_default();
        let complete = &s[..s.rfind('\n').map_or(0, |i| i + 1)];
        complete.lines().map(|l| l.parse().unwrap()).collect()
    }

    /// Waits for lockctl to exit, for at most `within`.
    fn wait(&mut self, within: Duration) -> std::process::ExitStatus {
        let mut status = None;
        let exited = wait_until(within, || {
            status = self.lockctl.try_wait().unwrap();
            status.is_some()
        });
        assert!(
            exited,
            "lockctl lock did not exit:\n{}{}",
            self.out.text(),
            self.err.text()
        );
        status.unwrap()
    }

    fn output(&self) -> String {
        format!("{}{}", self.out.text(), self.err.text())
    }
}

impl Drop for Heartbeating {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.dir.join("command.pid")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<i32>() {
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        unsafe { libc::kill(-(self.lockctl.id() as i32), libc::SIGKILL) };
        let _ = self.lockctl.wait();
    }
}

/// The time (µs since the epoch) written in RFC 3339 right after `after` in `line`.
fn stamp_after(line: &str, after: &str) -> u128 {
    let rest = &line[line
        .find(after)
        .unwrap_or_else(|| panic!("no {after:?} in {line}"))
        + after.len()..];
    let t = &rest[..=rest
        .find('Z')
        .unwrap_or_else(|| panic!("no time in {rest}"))];
    humantime::parse_rfc3339(t)
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// Milliseconds from `from` to `to` (µs since the epoch), signed.
fn ms(from: u128, to: u128) -> f64 {
    (to as f64 - from as f64) / 1_000.0
}

/// Issue 22, item 7: a holder cut off from the cell stops acting when its lease falls into
/// doubt, not when it hears its session expired. One replica (3 s lease); `lockctl lock`
/// reaches it only through a relay, and runs a command that writes a heartbeat every
/// 50 ms. The test cuts the relay both ways: the command must stop (no heartbeat after
/// lockctl's jeopardy) before the cell's lease for the session can have ended (the last
/// answered KeepAlive's send plus the lease), and a second contender, straight to the
/// replica, is granted the lock only after the last heartbeat. Healed, lockctl hears that
/// the session expired, ends the command (still without a heartbeat) and exits with 4.
/// Before the fix the command went on writing heartbeats after the waiter's grant.
#[test]
fn a_cut_off_holder_stops_its_command_before_its_lease_ends() {
    use std::os::unix::process::CommandExt;
    const LEASE_MS: u128 = 3_000;

    let _g = serial();
    let (mut cell, relay, mut holder) = relayed_holder("3000", &[], HEARTBEAT);
    let (ca, direct) = (cell.ca.clone(), cell.eps());

    let cut = now_us();
    relay.set(Link::Cut);
    let granted_file = cell.dir.path().join("granted");
    let mut waiter = Command::new(LOCKCTL)
        .args(["--endpoints", &direct, "--ca"])
        .arg(&ca)
        .args([
            "lock",
            "/locks/job",
            "--",
            "sh",
            "-c",
            "date +%s%6N > \"$GRANTED\"",
        ])
        .env("GRANTED", &granted_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let waiter_out = Lines::collect(waiter.stdout.take().unwrap());
    let waiter_err = Lines::collect(waiter.stderr.take().unwrap());
    let Some((grant, _)) = waiter_out.wait_for("acquired /locks/job", Duration::from_secs(20))
    else {
        let _ = waiter.kill();
        panic!(
            "the waiter was never granted the lock:\n{}{}\nholder:\n{}",
            waiter_out.text(),
            waiter_err.text(),
            holder.output()
        );
    };
    // A heartbeat after the grant is two holders acting at once: look for one for a
    // second (twenty heartbeat periods).
    let overlap = wait_until(Duration::from_secs(1), || {
        holder.beats().last().is_some_and(|&b| b > grant)
    });
    if overlap {
        // Only to say how bad it is: how many in the second after the grant.
        wait_until(Duration::from_secs(1), || {
            holder
                .beats()
                .last()
                .is_some_and(|&b| b > grant + 1_000_000)
        });
    }
    let beats = holder.beats();
    let last = *beats.last().unwrap();
    let after_grant = beats.iter().filter(|&&b| b > grant).count();
    assert!(
        !overlap && last < grant,
        "the cut-off holder's command went on acting after the waiter was granted the lock: \
         the waiter's grant {:.0} ms after the cut, jeopardy reported {} ms after it, the \
         last heartbeat so far {:.0} ms after it ({after_grant} heartbeats after the \
         grant)\nholder:\n{}",
        ms(cut, grant),
        holder
            .err
            .find("lockctl: session in jeopardy")
            .map_or("never".to_string(), |(at, _)| format!("{:.0}", ms(cut, at))),
        ms(cut, last),
        holder.output()
    );
    assert!(
        last > cut,
        "the command acted on after the cut while its lease was valid: last heartbeat {:.0} ms after the cut",
        ms(cut, last)
    );

    // lockctl stopped it on jeopardy, before the cell's lease could have run out, or
    // earlier still: when the session's event stream broke, which leaves the lock
    // unconfirmed until its node is read again.
    let (_, jeopardy) = holder
        .err
        .find("lockctl: session in jeopardy")
        .unwrap_or_else(|| panic!("no jeopardy reported:\n{}", holder.output()));
    let unconfirmed = holder.err.find("unconfirmed at ");
    let stopped = match &unconfirmed {
        Some((_, line)) if line.contains("stopped the command (SIGSTOP") => {
            assert!(jeopardy.contains("stopped already"), "{jeopardy}");
            stamp_after(line, "unconfirmed at ")
        }
        _ => {
            assert!(
                jeopardy.contains("stopped the command (SIGSTOP"),
                "{jeopardy}"
            );
            stamp_after(&jeopardy, "session in jeopardy at ")
        }
    };
    let renewal_sent = stamp_after(&jeopardy, "no renewal since the KeepAlive sent at ");
    let lease_end = stamp_after(&jeopardy, "the cell's lease lasts until ");
    assert_eq!(lease_end - renewal_sent, LEASE_MS * 1_000, "{jeopardy}");
    // The reported renewal is plausible: answered before the cut, and at most one
    // KeepAlive interval (a third of the lease) and a retry before it.
    assert!(
        renewal_sent < cut && renewal_sent + (LEASE_MS / 3 + 500) * 1_000 > cut,
        "last renewal sent {:.0} ms after the cut: {jeopardy}",
        ms(cut, renewal_sent)
    );
    assert!(
        stopped < lease_end && last < lease_end && stopped < grant,
        "stopped {:.0} ms and last heartbeat {:.0} ms after the cut; the cell's lease ends \
         {:.0} ms after it at the earliest, the waiter's grant {:.0} ms",
        ms(cut, stopped),
        ms(cut, last),
        ms(cut, lease_end),
        ms(cut, grant)
    );
    let leader_expired = std::fs::read_to_string(cell.data.join("replica-1.log"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.contains("expiring sessions"))
        .and_then(|l| humantime::parse_rfc3339(l.split_whitespace().next()?).ok())
        .map(|t| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_micros());

    // Healed, lockctl hears that the session is over and ends the command, which acts no
    // more on its way out (SIGTERM goes before the SIGCONT).
    relay.set(Link::Open);
    let status = holder.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(4), "{}", holder.output());
    assert!(
        holder.output().contains("session expired"),
        "{}",
        holder.output()
    );
    let beats = holder.beats();
    assert!(
        beats.iter().all(|&b| b < grant),
        "a heartbeat after the grant once the holder heard of its expiry:\n{}",
        holder.output()
    );
    assert!(wait_until(Duration::from_secs(10), || waiter
        .try_wait()
        .unwrap()
        .is_some()));
    assert!(waiter.wait().unwrap().success(), "{}", waiter_err.text());
    println!(
        "FIGURE lockctl lock cut off (lease {LEASE_MS} ms), ms from the cut: last renewal \
         sent {:.0}, command stopped {:.0} (last heartbeat {:.0}), cell's lease ends at the \
         earliest {:.0}, the leader expires the session {}, waiter granted {:.0}",
        ms(cut, renewal_sent),
        ms(cut, stopped),
        ms(cut, last),
        ms(cut, lease_end),
        leader_expired.map_or("(not logged)".to_string(), |t| format!("{:.0}", ms(cut, t))),
        ms(cut, grant)
    );
    drop(holder);
    assert!(cell.stop().success());
}

/// Issue 22, item 7, the other way out of jeopardy: the holder's KeepAlives still reach the
/// cell but no answer reaches it (the relay drops only the replica's datagrams), so its
/// lease is renewed at the leader while lockctl cannot know it. One replica, 9 s lease
/// (the first KeepAlive after the cut, a third of a lease after the last answered one,
/// renews the session at the leader; the next ones do not get through, as the client
/// drops the silent connection and cannot dial again: so after jeopardy there are about
/// 3.2 s for the client to be renewed). lockctl stops the command on jeopardy; the test
/// keeps the answers lost for another 300 ms (no heartbeat in it), then heals the link: the session is confirmed (Safe),
/// lockctl continues the command, its heartbeats resume, and it ends normally with the
/// lock still held (lockctl exits 0). Before the fix the heartbeats went on throughout.
/// A one-replica cell with a lease of `lease_ms` and a `lockctl lock /locks/job` holder
/// running `script` with `lock_args`, reaching the cell through a relay the test controls;
/// returned once it holds the lock and its command has written five heartbeats.
fn relayed_holder(
    lease_ms: &str,
    lock_args: &[&str],
    script: &str,
) -> (DevCell, Relay, Heartbeating) {
    let cell = DevCell::start_of(1, &["--no-demo", "--lease-ms", lease_ms]);
    let (ca, direct) = (cell.ca.clone(), cell.eps());
    let o = lockctl(&direct, &ca, &["create", "/locks"]);
    assert!(o.status.success(), "{}", text(&o));
    let relay = Relay::start(cell.endpoints[0].parse().unwrap());
    let holder = Heartbeating::start(
        cell.dir.path(),
        &relay.addr.to_string(),
        &ca,
        lock_args,
        script,
    );
    holder
        .out
        .wait_for("acquired /locks/job", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("the holder did not acquire:\n{}", holder.output()));
    assert!(
        wait_until(Duration::from_secs(10), || holder.beats().len() >= 5),
        "the command wrote no heartbeats:\n{}",
        holder.output()
    );
    (cell, relay, holder)
}

#[test]
fn a_holder_that_hears_no_answers_is_stopped_then_continued_when_safe() {
    let _g = serial();
    let (mut cell, relay, mut holder) = relayed_holder("9000", &[], HEARTBEAT);

    let cut = now_us();
    relay.set(Link::RepliesLost);
    let (jeopardy, _) = holder
        .err
        .wait_for("lockctl: session in jeopardy", Duration::from_secs(9 + 5))
        .unwrap_or_else(|| panic!("no jeopardy:\n{}", holder.output()));
    // The answers stay lost for 300 ms more (six heartbeat periods): the command must
    // not act in them.
    assert!(!wait_until(Duration::from_millis(300), || holder
        .err
        .find("lockctl: session safe again")
        .is_some()
        || holder.lockctl.try_wait().unwrap().is_some()));
    let healed = now_us();
    relay.set(Link::Open);
    let stopped_beats: Vec<u128> = holder
        .beats()
        .into_iter()
        .filter(|&b| b > jeopardy && b < healed)
        .collect();
    assert!(
        stopped_beats.is_empty(),
        "the command acted while its lease was in doubt: {} heartbeats between the jeopardy \
         ({:.0} ms after the cut) and the heal ({:.0} ms)\n{}",
        stopped_beats.len(),
        ms(cut, jeopardy),
        ms(cut, healed),
        holder.output()
    );
    let (safe, _) = holder
        .err
        .wait_for("lockctl: session safe again", Duration::from_secs(10))
        .unwrap_or_else(|| {
            panic!(
                "the session was not confirmed after the heal:\n{}",
                holder.output()
            )
        });
    // Continued once the session is safe and its lock confirmed again (read again at the
    // leader once the event stream is back), a moment after Safe.
    assert!(
        wait_until(Duration::from_secs(5), || holder
            .output()
            .contains("continued the command (SIGCONT")),
        "{}",
        holder.output()
    );
    assert!(
        wait_until(Duration::from_secs(5), || holder
            .beats()
            .last()
            .is_some_and(|&b| b > safe)),
        "the command did not resume after Safe:\n{}",
        holder.output()
    );
    let resumed = holder.beats().into_iter().find(|&b| b > jeopardy).unwrap();
    std::fs::write(cell.dir.path().join("done"), "").unwrap();
    let status = holder.wait(Duration::from_secs(20));
    assert!(status.success(), "{status}: {}", holder.output());
    println!(
        "FIGURE lockctl lock, answers lost (lease 9000 ms), ms from the cut: jeopardy and \
         stop {:.0}, healed {:.0}, safe {:.0}, first heartbeat after the stop {:.0}",
        ms(cut, jeopardy),
        ms(cut, healed),
        ms(cut, safe),
        ms(cut, resumed)
    );
    drop(holder);
    assert!(cell.stop().success());
}

/// Issue 22, item 7, `--on-jeopardy term`: a holder whose answers are lost has its
/// command sent SIGTERM on jeopardy; a command that ignores SIGTERM is killed
/// `--kill-after-secs` later, and `lockctl` exits with status 4 (the command was ended).
#[test]
fn on_jeopardy_term_ends_the_command_and_kills_one_that_ignores_it() {
    let _g = serial();
    let deaf = format!("trap '' TERM\n{HEARTBEAT}");
    let kill_after_s = 2u64;
    let kill_after = kill_after_s.to_string();
    let (mut cell, relay, mut holder) = relayed_holder(
        "9000",
        &["--on-jeopardy", "term", "--kill-after-secs", &kill_after],
        &deaf,
    );
    let cut = now_us();
    relay.set(Link::RepliesLost);
    let (jeopardy, _) = holder
        .err
        .wait_for("lockctl: session in jeopardy", Duration::from_secs(9 + 5))
        .unwrap_or_else(|| panic!("no jeopardy:\n{}", holder.output()));
    let status = holder.wait(Duration::from_secs(kill_after_s + 20));
    assert_eq!(status.code(), Some(4), "{}", holder.output());
    let out = holder.output();
    assert!(out.contains("ending the command (SIGTERM"), "{out}");
    assert!(
        out.contains("the command was ended because the session fell into jeopardy"),
        "{out}"
    );
    let after: Vec<u128> = holder
        .beats()
        .into_iter()
        .filter(|&b| b > jeopardy)
        .collect();
    let last = after.last().copied().unwrap_or(jeopardy);
    // It ignored SIGTERM and went on until the SIGKILL, and not after it.
    assert!(
        after.iter().any(|&b| b > jeopardy + 500_000),
        "the command stopped before the SIGKILL although it ignores SIGTERM:\n{out}"
    );
    assert!(
        last < jeopardy + (kill_after_s as u128 * 1_000_000) + 700_000,
        "the command acted {:.0} ms after the jeopardy (SIGKILL due after {kill_after_s} s):\n{out}",
        ms(jeopardy, last)
    );
    println!(
        "FIGURE lockctl lock --on-jeopardy term, answers lost (lease 9000 ms), ms from the cut: \
         jeopardy and SIGTERM {:.0}, last heartbeat of a command ignoring SIGTERM {:.0} \
         (SIGKILL after {kill_after_s} s)",
        ms(cut, jeopardy),
        ms(cut, last)
    );
    drop(holder);
    assert!(cell.stop().success());
}

/// `lockctl certs`: a CA and certificates made with it run a real replica, and a client
/// with the client certificate reaches it; the wrong role, a second CA in one place and
/// malformed names are refused with the reason.
#[test]
fn certs_made_by_lockctl_run_a_replica_and_reach_it() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s);
    let certs = |args: &[&str]| {
        Command::new(LOCKCTL)
            .arg("certs")
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap()
    };
    let o = certs(&["init", "ca", "--name", "test CA"]);
    assert!(o.status.success(), "{}", text(&o));
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(p("ca/ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o077,
            0,
            "the CA key is readable by others: {mode:o}"
        );
    }
    let o = certs(&["init", "ca"]);
    assert!(
        !o.status.success() && text(&o).contains("already holds a CA"),
        "{}",
        text(&o)
    );
    let issue = |extra: &[&str]| {
        let mut a = vec!["issue", "--ca-dir", "ca"];
        a.extend_from_slice(extra);
        certs(&a)
    };
    for (args, why) in [
        (
            &["--role", "replica", "--name", "r1", "--out", "x"][..],
            "add --cell",
        ),
        (
            &[
                "--role", "client", "--cell", "c1", "--name", "x", "--out", "x",
            ][..],
            "drop --cell",
        ),
        (
            &["--role", "client", "--name", "a b", "--out", "x"][..],
            "may hold only",
        ),
        (
            &["--role", "client", "--name", "Upper", "--out", "x"][..],
            "lowercase",
        ),
        (
            &["--role", "auditor", "--name", "x", "--out", "x"][..],
            "invalid value",
        ),
        (&["--role", "client", "--name", "x"][..], "--out"),
        (
            &["--role", "client", "--name", "x", "--out", "ca"][..],
            "holds a CA key",
        ),
        (
            &[
                "--role", "client", "--name", "x", "--out", "x", "--days", "0",
            ][..],
            "1 to 36500",
        ),
    ] {
        let o = issue(args);
        assert!(
            !o.status.success() && text(&o).contains(why),
            "{args:?}: {}",
            text(&o)
        );
    }
    let o = issue(&[
        "--role", "replica", "--cell", "c1", "--name", "r1", "--out", "node",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = issue(&["--role", "client", "--name", "payments-api", "--out", "app"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = issue(&["--role", "client", "--name", "again", "--out", "app"]);
    assert!(
        !o.status.success() && text(&o).contains("--force"),
        "{}",
        text(&o)
    );
    let o = certs(&["show", "node/replica.pem"]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    for line in [
        "lock://c1/replica/r1",
        "role:       replica",
        "cell:       c1",
        "expires in",
    ] {
        assert!(s.contains(line), "{line}: {s}");
    }
    let o = certs(&["show", "ca/ca.pem"]);
    assert!(text(&o).contains("a CA certificate"), "{}", text(&o));

    // A one-replica cell on the replica's files, reached with the client's.
    let port = free_base(1);
    let addr = format!("127.0.0.1:{port}");
    let cfg = replica::config::ReplicaConfig {
        id: 1,
        listen: addr.parse().unwrap(),
        advertise: None,
        data_dir: p("data"),
        bootstrap: true,
        members: vec![replica::config::Member {
            id: 1,
            addr: addr.clone(),
        }],
        tls: replica::config::TlsConfig::replica_in_dir(&p("node")),
        raft: Default::default(),
        session: Default::default(),
        request_timeout_ms: 5_000,
        limits: Default::default(),
        faults: Default::default(),
        // A production cell: only its admin, the client, may do anything.
        security: replica::config::SecurityConfig {
            initial_admins: vec!["lock://client/payments-api".into()],
            root_acl: replica::config::RootAcl::Admins,
        },
        metrics: Default::default(),
        backup: Default::default(),
    };
    std::fs::write(p("replica.toml"), toml::to_string(&cfg).unwrap()).unwrap();
    let mut replica = DevGuard(Some(
        Command::new(LOCKCTL)
            .args(["replica", "--config"])
            .arg(p("replica.toml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(p("replica.log")).unwrap())
            .spawn()
            .unwrap(),
    ));
    let ok = wait_until(Duration::from_secs(30), || {
        let o = lockctl(&addr, &p("app/ca.pem"), &["status"]);
        o.status.success() && text(&o).contains("Leader")
    });
    assert!(
        ok,
        "no answer from the replica: {}",
        std::fs::read_to_string(p("replica.log")).unwrap_or_default()
    );
    // The replica's own certificate is not a client's.
    let o = Command::new(LOCKCTL)
        .args(["--endpoints", &addr, "--ca"])
        .arg(p("node/ca.pem"))
        .arg("--cert")
        .arg(p("node/replica.pem"))
        .arg("--key")
        .arg(p("node/replica.key"))
        .args(["--timeout-secs", "5", "status"])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("a replica's"),
        "{}",
        text(&o)
    );

    // ACLs with lockctl on this production cell: only its admin (the payments-api
    // client) may use the root; it gives /payments to the payments group and lets
    // another identity queue (create) there, not read or write.
    let o = issue(&["--role", "client", "--name", "search", "--out", "other"]);
    assert!(o.status.success(), "{}", text(&o));
    // `certs revoke` writes a list the CA signed that names the certificate; a second run
    // adds to it under a higher number (the servers' use of it: replica/tests/rotation.rs).
    let serial_of =
        |f: &str| wire::tls::serial_of(&std::fs::read_to_string(p(f)).unwrap()).unwrap();
    let revoke = |cert: &str| certs(&["revoke", "--ca-dir", "ca", "--crl", "ca/revoked.crl", cert]);
    let listed =
        || wire::tls::crl_contents(&std::fs::read_to_string(p("ca/revoked.crl")).unwrap()).unwrap();
    let o = revoke("other/client.pem");
    assert!(o.status.success(), "{}", text(&o));
    let (first, n1) = listed();
    assert_eq!(first, vec![serial_of("other/client.pem")]);
    let o = revoke("app/client.pem");
    assert!(o.status.success(), "{}", text(&o));
    let (both, n2) = listed();
    assert!(n2 > n1, "the list's number did not grow: {n1} then {n2}");
    assert!(
        both.contains(&serial_of("other/client.pem"))
            && both.contains(&serial_of("app/client.pem")),
        "{both:?}"
    );
    let o = revoke("no-such.pem");
    assert!(
        !o.status.success() && text(&o).contains("no-such.pem"),
        "{}",
        text(&o)
    );
    let admin = |args: &[&str]| lockctl(&addr, &p("app/ca.pem"), args);
    let other = |args: &[&str]| lockctl(&addr, &p("other/ca.pem"), args);
    let o = other(&["create", "/payments"]);
    assert!(
        !o.status.success() && text(&o).contains("may not create /"),
        "{}",
        text(&o)
    );
    for args in [
        &["create", "/payments"][..],
        &[
            "acl",
            "group",
            "set",
            "payments",
            "lock://client/payments-api",
        ],
        &[
            "acl",
            "set",
            "/payments",
            "--read",
            "group:payments",
            "--create",
            "group:payments,lock://client/search",
        ],
    ] {
        let o = admin(args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    }
    let o = admin(&["acl", "get", "/payments"]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    for line in [
        "read:   group:payments",
        "write:  (admins only)",
        "create: lock://client/search, group:payments",
    ] {
        assert!(s.contains(line), "{line:?} in {s}");
    }
    let o = admin(&["acl", "ls"]);
    let s = text(&o);
    assert!(
        s.contains("admins: lock://client/payments-api")
            && s.contains("group:payments: lock://client/payments-api"),
        "{s}"
    );
    let o = other(&["create", "/payments/q"]);
    assert!(o.status.success(), "{}", text(&o));
    for (args, says) in [
        (&["get", "/payments"][..], "may not read /payments"),
        (&["set", "/payments", "v"][..], "may not write /payments"),
        (
            &["acl", "admins", "add", "lock://client/search"][..],
            "only a cell admin",
        ),
        (&["snapshot"][..], "only a cell admin"),
    ] {
        let o = other(args);
        assert!(
            !o.status.success() && text(&o).contains(says),
            "{args:?}: {}",
            text(&o)
        );
    }
    let o = admin(&["acl", "set", "/payments", "--read", "nobody"]);
    assert!(
        !o.status.success() && text(&o).contains("--read"),
        "{}",
        text(&o)
    );
    if let Some(mut c) = replica.0.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A holder whose lock's node is deleted by someone else (here the admin; a prefix moved
/// to another cell ends it the same way) while its session lives on: `lockctl lock`
/// learns before the delete is answered, ends the command as on expiry and exits 4.
#[test]
fn a_holder_whose_node_is_deleted_ends_its_command() {
    let _g = serial();
    let mut cell = DevCell::start_of(1, &["--no-demo"]);
    let (ca, eps) = (cell.ca.clone(), cell.eps());
    let o = lockctl(&eps, &ca, &["create", "/locks"]);
    assert!(o.status.success(), "{}", text(&o));
    let mut holder = Heartbeating::start(cell.dir.path(), &eps, &ca, &[], HEARTBEAT);
    let (_, line) = holder
        .out
        .wait_for("acquired /locks/job", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("the holder did not acquire:\n{}", holder.output()));
    let node = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("node="))
        .expect("node=")
        .to_string();
    assert!(
        wait_until(Duration::from_secs(10), || holder.beats().len() >= 3),
        "the command wrote no heartbeats:\n{}",
        holder.output()
    );
    let o = lockctl(&eps, &ca, &["rm", &node]);
    assert!(o.status.success(), "{}", text(&o));
    let deleted = now_us();
    let status = holder.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(4), "{}", holder.output());
    let out = holder.output();
    assert!(out.contains("lock /locks/job lost at"), "{out}");
    assert!(out.contains("ending the command (SIGTERM"), "{out}");
    // It was told before the delete was answered; the command's last heartbeat comes
    // within moments of it (SIGTERM is immediate; a margin for a loaded machine).
    let last = holder.beats().last().copied().unwrap_or(0);
    assert!(
        last < deleted + 1_500_000,
        "the command went on {:.0} ms after its node was deleted:\n{out}",
        ms(deleted, last)
    );
    drop(holder);
    assert!(cell.stop().success());
}

/// What a script needs from lockctl (issue 28): the hint `lockctl dev` prints works as
/// printed, read commands print JSON with `--json`, `watch` prints a node's value and each
/// change (re-armed) and stops after `--count` events, exit statuses tell what happened,
/// `status` fails when no replica answers, and completions generate.
#[test]
fn json_watch_exit_codes_hint_and_completions() {
    let _g = serial();
    let cell = DevCell::start(&[]);
    let (endpoints, ca) = (cell.eps(), cell.ca.clone());

    // The hint's compare-and-set names the version the demo left (it changed the node).
    let hint = cell
        .out
        .lines()
        .find_map(|l| {
            l.split("lockctl -- ")
                .nth(1)
                .filter(|h| h.starts_with("set "))
        })
        .unwrap_or_else(|| panic!("no set hint in:\n{}", cell.out))
        .to_string();
    let args: Vec<&str> = hint.split_whitespace().collect();
    let o = lockctl(&endpoints, &ca, &args);
    assert!(o.status.success(), "`{hint}`: {}", text(&o));

    // --json on get, ls and status.
    let o = lockctl(&endpoints, &ca, &["create", "/j", "one"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["--json", "get", "/j"]);
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert_eq!(v["data"], "one", "{v}");
    assert_eq!(v["stat"]["version"], 0, "{v}");
    let o = lockctl(&endpoints, &ca, &["create", "/j/k", "x"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["ls", "/j", "--json"]);
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert_eq!(v["children"][0]["name"], "k", "{v}");
    let o = lockctl(&endpoints, &ca, &["status", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let roles: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["status"]["role"].to_string()
        })
        .collect();
    assert_eq!(roles.len(), 3, "{}", text(&o));
    assert_eq!(
        roles.iter().filter(|r| r.contains("Leader")).count(),
        1,
        "{roles:?}"
    );

    // Exit statuses: no such node 6, version mismatch 7, node exists 7, bad path 1.
    let code = |args: &[&str]| lockctl(&endpoints, &ca, args).status.code();
    assert_eq!(code(&["get", "/nope"]), Some(6));
    assert_eq!(code(&["set", "/j", "two", "--version", "5"]), Some(7));
    assert_eq!(code(&["create", "/j"]), Some(7));
    assert_eq!(code(&["rm", "/j"]), Some(7));

    // watch: the value now, then each change with the value re-read, until --count.
    let (mut w, mut lines) = spawn_watch(&endpoints, &ca, &["/j", "--count", "2"]);
    let first = lines.next().unwrap().unwrap();
    assert_eq!(first, "/j version=0 one");
    let o = lockctl(&endpoints, &ca, &["set", "/j", "two"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(lines
        .next()
        .unwrap()
        .unwrap()
        .starts_with("changed /j index="));
    assert_eq!(lines.next().unwrap().unwrap(), "/j version=1 two");
    let o = lockctl(&endpoints, &ca, &["rm", "/j/k"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = lockctl(&endpoints, &ca, &["rm", "/j"]);
    assert!(o.status.success(), "{}", text(&o));
    // Deleting a child is no event on the node's data; its own deletion is.
    assert!(lines
        .next()
        .unwrap()
        .unwrap()
        .starts_with("deleted /j index="));
    assert_eq!(lines.next().unwrap().unwrap(), "/j does not exist");
    assert_exits_ok(&mut w, Duration::from_secs(20), "after --count 2");

    // check-sequencer: a command under `lockctl lock` checks its own hold from its
    // environment (exit 0); once the lock is released the same sequencer is stale (4).
    let o = Command::new(LOCKCTL)
        .env_remove("LOCKCTL_CERT")
        .env_remove("LOCKCTL_KEY")
        .env("LOCKCTL_ENDPOINTS", &endpoints)
        .env("LOCKCTL_CA", &ca)
        .env("LOCKCTL_CONFIG", "/dev/null")
        .args(["lock", "/seq", "--", "sh", "-c"])
        .arg(format!(
            "echo $LOCK_NODE $LOCK_TOKEN $LOCK_SESSION; {LOCKCTL} check-sequencer"
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(out.contains(": current holder"), "{out}");
    let held: Vec<&str> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() == 3 && w[0].starts_with("/seq/"))
        .unwrap_or_else(|| panic!("no LOCK_NODE line in {out}"));
    let o = lockctl(
        &endpoints,
        &ca,
        &[
            "check-sequencer",
            "--node",
            held[0],
            "--token",
            held[1],
            "--session",
            held[2],
        ],
    );
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("NOT the holder"), "{}", text(&o));

    // A CA that did not sign the cell (with a client certificate of its own): every
    // replica's certificate is refused, so the command fails at once with 9 and says so,
    // rather than retrying for its whole timeout; `status` too (it used to exit 0).
    let other = tempfile::tempdir().unwrap();
    let certs = |args: &[&str]| {
        let o = Command::new(LOCKCTL)
            .arg("certs")
            .args(args)
            .current_dir(other.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
    };
    certs(&["init", "ca"]);
    certs(&[
        "issue", "--ca-dir", "ca", "--role", "client", "--name", "stranger", "--out", "app",
    ]);
    // And a CA with the dev CA's very name but another key (a stale dev cell's CA): the
    // chain then fails on its signature (TLS alert 51), not on an unknown issuer (48).
    certs(&["init", "twin", "--name", "lockservice dev CA"]);
    certs(&[
        "issue", "--ca-dir", "twin", "--role", "client", "--name", "twin", "--out", "twin-app",
    ]);
    for wrong_ca in [
        other.path().join("app/ca.pem"),
        other.path().join("twin-app/ca.pem"),
    ] {
        for args in [
            &["get", "/j"][..],
            &["status"][..],
            &["status", "--json"][..],
        ] {
            let t0 = Instant::now();
            let o = lockctl(&endpoints, &wrong_ca, args);
            assert_eq!(o.status.code(), Some(9), "{args:?}: {}", text(&o));
            assert!(
                text(&o).contains("TLS handshake refused"),
                "{args:?}: {}",
                text(&o)
            );
            assert!(
                t0.elapsed() < Duration::from_secs(8),
                "{args:?} took {:?}",
                t0.elapsed()
            );
        }
    }

    // Ctrl-C (SIGINT) ends a watch at once, with status 0.
    let (mut w, mut lines) = spawn_watch(&endpoints, &ca, &["/seq"]);
    assert!(lines.next().unwrap().unwrap().starts_with("/seq"));
    let kill = Command::new("kill")
        .args(["-INT", &w.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_exits_ok(&mut w, Duration::from_secs(10), "on SIGINT");

    // No replica answers: status fails with 8 (it used to exit 0). The TLS files outlive
    // the cell's directory.
    let keep = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(ca.parent().unwrap()).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), keep.path().join(f.file_name())).unwrap();
    }
    let ca = keep.path().join("ca.pem");
    drop(cell);
    let o = lockctl(&endpoints, &ca, &["status"]);
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));

    for shell in ["bash", "zsh"] {
        let o = Command::new(LOCKCTL)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            text(&o).contains("watch") && text(&o).contains("--json"),
            "{shell}"
        );
    }
    let o = Command::new(LOCKCTL).arg("--help").output().unwrap();
    assert!(text(&o).contains("Exit status: 0 done"), "{}", text(&o));
}

/// `lockctl watch ARGS` against the cell, with its stdout's lines.
fn spawn_watch(
    endpoints: &str,
    ca: &std::path::Path,
    args: &[&str],
) -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    spawn_lockctl(endpoints, ca, &[&["watch"], args].concat())
}

/// `lockctl ARGS` in the background, its stdout read line by line.
fn spawn_lockctl(
    endpoints: &str,
    ca: &std::path::Path,
    args: &[&str],
) -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let mut w = Command::new(LOCKCTL)
        .env_remove("LOCKCTL_CERT")
        .env_remove("LOCKCTL_KEY")
        .env("LOCKCTL_CONFIG", "/dev/null")
        .args(["--endpoints", endpoints, "--ca"])
        .arg(ca)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(w.stdout.take().unwrap()).lines();
    (w, lines)
}

/// `w` exits with status 0 within `within` (`what`: when it should have).
fn assert_exits_ok(w: &mut std::process::Child, within: Duration, what: &str) {
    let mut status = None;
    let exited = wait_until(within, || {
        status = w.try_wait().unwrap();
        status.is_some()
    });
    assert!(exited, "lockctl did not stop {what}");
    let status = status.unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn ls_r_rm_r_elect_and_sessions() {
    let _g = serial();
    let cell = DevCell::start(&["--no-demo"]);
    let (eps, ca) = (cell.eps(), cell.ca.clone());
    for p in ["/t", "/t/b", "/t/b/c", "/t/d"] {
        let o = lockctl(&eps, &ca, &["create", p, "x"]);
        assert!(o.status.success(), "{}", text(&o));
    }
    // ls -R: every node under the path with its stats, in path order.
    let o = lockctl(&eps, &ca, &["ls", "-R", "/t"]);
    assert!(o.status.success(), "{}", text(&o));
    let paths: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| l.split('\t').next().unwrap().to_string())
        .collect();
    assert_eq!(paths, ["/t/b", "/t/b/c", "/t/d"], "{}", text(&o));
    assert!(text(&o).contains("version=0 token="), "{}", text(&o));
    let o = lockctl(
        &eps,
        &ca,
        &["--json", "ls", "-R", "/t", "--max-nodes", "10"],
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["nodes"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(v["nodes"][0]["stat"]["children_count"], 1, "{v}");
    let o = lockctl(&eps, &ca, &["ls", "-R", "/t", "--max-nodes", "2"]);
    assert!(
        !o.status.success() && text(&o).contains("more than 2 nodes"),
        "{}",
        text(&o)
    );

    // An endpoint that is not host:port is refused before anything is dialed.
    let o = lockctl(&format!("{eps},replica-1"), &ca, &["get", "/t"]);
    assert_eq!(o.status.code(), Some(9), "{}", text(&o));
    assert!(text(&o).contains("expected host:port"), "{}", text(&o));

    // rm -r asks first; without a terminal it needs --yes, and deletes nothing.
    let o = lockctl(&eps, &ca, &["rm", "-r", "/t"]);
    assert!(
        !o.status.success() && text(&o).contains("--yes"),
        "{}",
        text(&o)
    );
    assert!(lockctl(&eps, &ca, &["get", "/t/b/c"]).status.success());
    let o = lockctl(&eps, &ca, &["rm", "-r", "/t", "--yes"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("(4 nodes)"), "{}", text(&o));
    assert_eq!(lockctl(&eps, &ca, &["get", "/t"]).status.code(), Some(6));
    assert_eq!(
        lockctl(&eps, &ca, &["rm", "-r", "/t", "--yes"])
            .status
            .code(),
        Some(6)
    );
    let o = lockctl(&eps, &ca, &["rm", "-r", "/", "--yes"]);
    assert!(
        !o.status.success() && text(&o).contains("refused"),
        "{}",
        text(&o)
    );

    // elect: an observer sees no leader, the first candidate, the second after it.
    let (mut obs, mut lines) =
        spawn_lockctl(&eps, &ca, &["elect", "/e", "--observe", "--count", "2"]);
    assert_eq!(lines.next().unwrap().unwrap(), "no leader");
    // The first leader leads until the test says (a marker file; 60 s at most).
    let marker = cell.dir.path().join("first-may-resign");
    let script = format!(
        "echo token=$LOCK_TOKEN; i=0; while [ ! -e {m} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
        m = marker.display()
    );
    let first = spawn_lockctl(
        &eps,
        &ca,
        &["elect", "/e", "--data", "first", "--", "sh", "-c", &script],
    );
    let (mut first, mut first_out) = first;
    let elected = first_out.next().unwrap().unwrap();
    assert!(
        elected.starts_with("elected /e (exclusive) token="),
        "{elected}"
    );
    let token = elected
        .split("token=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(first_out.next().unwrap().unwrap(), format!("token={token}"));
    // `sessions` lists the leader's session with its ephemeral node and its lease.
    let o = lockctl(&eps, &ca, &["sessions"]);
    assert!(o.status.success(), "{}", text(&o));
    let node = elected
        .split("node=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    let row = String::from_utf8_lossy(&o.stdout)
        .lines()
        .find(|l| l.contains(&node))
        .unwrap_or_else(|| panic!("no session with {node}: {}", text(&o)))
        .to_string();
    assert!(
        row.contains("lock://client/dev") && row.contains(" s "),
        "{row}"
    );
    let o = lockctl(
        &eps,
        &ca,
        &["--json", "sessions", "--owner", "lock://client/dev"],
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mine = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["ephemeral_paths"][0] == node.as_str())
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(mine["ephemerals"], 1, "{v}");
    assert!(mine["lease_left_ms"].as_u64().unwrap() > 0, "{v}");
    let o = lockctl(
        &eps,
        &ca,
        &["--json", "sessions", "--owner", "lock://client/nobody"],
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["sessions"].as_array().unwrap().len(), 0, "{v}");
    // A second candidate waits behind it; given up after 1 s, it exits 3.
    let o = lockctl(
        &eps,
        &ca,
        &[
            "elect",
            "/e",
            "--data",
            "second",
            "--wait-secs",
            "1",
            "--",
            "true",
        ],
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    std::fs::write(&marker, b"").unwrap();
    let o = lockctl(
        &eps,
        &ca,
        &["elect", "/e", "--data", "second", "--", "true"],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("elected /e"), "{}", text(&o));
    assert_exits_ok(&mut first, Duration::from_secs(20), "after its command");
    let l = lines.next().unwrap().unwrap();
    assert!(
        l.starts_with(&format!("leader first token={token} node=/e/")),
        "{l}"
    );
    let l = lines.next().unwrap().unwrap();
    assert!(l == "no leader" || l.starts_with("leader second "), "{l}");
    assert_exits_ok(&mut obs, Duration::from_secs(20), "after --count 2 changes");
    let o = lockctl(&eps, &ca, &["elect", "/e", "--observe", "--data", "x"]);
    assert!(
        !o.status.success(),
        "--observe does not stand: {}",
        text(&o)
    );
}

/// A client whose endpoint names point where no replica is (replicas rescheduled at other
/// addresses under the same names) finds the cell once the names resolve to it, without
/// a restart: after a pass over its endpoints reaches none of them, the SDK resolves the
/// names again. `lockctl get` runs with names in a mount namespace of its own whose
/// `/etc/hosts` is a file of the test's, first naming 127.0.0.9 (nothing there), three
/// seconds later 127.0.0.1 (the cell). Needs root (`unshare -m`, `mount --bind`); skipped
/// without it, or where such a namespace does not change what `getent hosts` answers.
#[test]
fn a_client_resolves_its_endpoint_names_again_when_it_reaches_none() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root for a mount namespace with its own /etc/hosts");
        return;
    }
    let _g = serial();
    let cell = DevCell::start(&[]);
    let o = lockctl(&cell.eps(), &cell.ca, &["create", "/moved", "found"]);
    assert!(o.status.success(), "{}", text(&o));
    let hosts = cell.dir.path().join("hosts");
    let names = ["r1.cell.test", "r2.cell.test", "r3.cell.test"];
    let hosts_at = |ip: &str| format!("127.0.0.1 localhost\n{ip} {}\n", names.join(" "));
    std::fs::write(&hosts, hosts_at("127.0.0.9")).unwrap();
    let endpoints: Vec<String> = names
        .iter()
        .zip(cell.base..)
        .map(|(n, port)| format!("{n}:{port}"))
        .collect();
    // The namespace works here (root may lack CAP_SYS_ADMIN in a container, and a
    // caching resolver could answer from the host's own file): else skip.
    let probe = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$0" /etc/hosts && getent hosts "$1""#)
        .arg(&hosts)
        .arg(names[0])
        .output();
    match probe {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("127.0.0.9") => {}
        other => {
            eprintln!("skipped: no mount namespace with its own /etc/hosts here: {other:?}");
            return;
        }
    }
    let get = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$0" /etc/hosts && exec "$@""#)
        .arg(&hosts)
        .arg(LOCKCTL)
        // The SDK says when the names moved: the test checks they were looked up again,
        // not found at the first lookup by a lockctl slow to start.
        .env("RUST_LOG", "client_sdk=info")
        .env("LOCKCTL_CONFIG", "/dev/null")
        .env_remove("LOCKCTL_CERT")
        .env_remove("LOCKCTL_KEY")
        .args(["--endpoints", &endpoints.join(","), "--ca"])
        .arg(&cell.ca)
        .args(["--timeout-secs", "30", "get", "/moved"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare runs");
    // Killed if the test fails before it ends.
    struct KillOnDrop(Option<std::process::Child>);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if let Some(c) = &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let mut guard = KillOnDrop(Some(get));
    let get = guard.0.as_mut().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    if let Some(status) = get.try_wait().unwrap() {
        let o = guard.0.take().unwrap().wait_with_output().unwrap();
        panic!(
            "lockctl ended before the names moved ({status}): {}",
            text(&o)
        );
    }
    // In place (the bind mount holds this file's inode, not its name).
    std::fs::write(&hosts, hosts_at("127.0.0.1")).unwrap();
    let moved = Instant::now();
    let deadline = moved + Duration::from_secs(30);
    while get.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = get.kill();
    let o = guard.0.take().unwrap().wait_with_output().unwrap();
    assert!(
        o.status.success() && text(&o).contains("found"),
        "lockctl did not reach the cell after its names moved: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("resolve to other addresses now"),
        "the SDK did not say it looked the names up again: {}",
        text(&o)
    );
    println!(
        "FIGURE re-resolved endpoint names: the read answered {} ms after the names moved",
        moved.elapsed().as_millis()
    );
}

/// A proxy that cannot start (its port taken) stops `lockctl dev` at once with the
/// proxy's log named, rather than after a 30 s wait for it to answer; the replicas it
/// started stop with it.
#[test]
fn a_proxy_that_cannot_start_stops_dev_naming_its_log() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let base = free_base(3);
    let pbase = free_base_from(base + 3, 1);
    let _taken = std::net::UdpSocket::bind(("127.0.0.1", pbase)).unwrap();
    let started = Instant::now();
    let mut dev = Command::new(LOCKCTL)
        .args(["dev", "--no-demo", "--replicas", "3", "--base-port"])
        .arg(base.to_string())
        .args(["--proxies", "1", "--proxy-base-port"])
        .arg(pbase.to_string())
        .arg("--data")
        .arg(dir.path().join("cell"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = started + Duration::from_secs(60);
    while dev.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = dev.kill();
    let o = dev.wait_with_output().unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("proxy-1 exited at start") && t.contains("proxy-1.log"),
        "{t}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?} (the wait for a proxy that answers is 30 s): {t}",
        started.elapsed()
    );
    // Nothing of the cell left running.
    let cell = dir.path().join("cell");
    let ps = Command::new("pgrep")
        .args(["-f", &cell.display().to_string()])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&ps.stdout).trim().is_empty(),
        "processes of the cell still run: {}",
        String::from_utf8_lossy(&ps.stdout)
    );
}

/// `lockctl dev --rolling-restart` restarts every replica in turn under a writer (a
/// leader stopped with SIGTERM hands the leadership over first) and reports what the
/// writer saw: no failed write.
#[test]
fn dev_demonstrates_a_rolling_restart() {
    let _g = serial();
    let cell = DevCell::start(&["--rolling-restart"]);
    let out = cell.out.clone();
    assert_eq!(out.matches(", started again; replica ").count(), 3, "{out}");
    assert!(out.contains("it led: handed over to replica"), "{out}");
    let done = out
        .lines()
        .find(|l| l.starts_with("rolling restart done: "))
        .unwrap_or_else(|| panic!("no summary: {out}"));
    assert!(done.contains(" writes, 0 failed"), "{done}");
    let log = (1..=3)
        .map(|id| std::fs::read_to_string(cell.data.join(format!("replica-{id}.log"))).unwrap())
        .collect::<String>();
    assert!(
        log.contains("leadership handed over"),
        "no hand-over logged"
    );
}
