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

#[test]
fn dev_cell_demo_commands_and_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cell");
    let base = free_base(3);
    let mut dev = Command::new(LOCKCTL)
        .args([
            "dev",
            "--replicas",
            "3",
            "--base-port",
            &base.to_string(),
            "--data",
        ])
        .arg(&data)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // Read the demo output until the cell says it is running.
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
    unsafe { libc::kill(dev.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = dev.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "lockctl dev did not stop");
        std::thread::sleep(Duration::from_millis(100));
    };
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
