//! The metrics endpoints of a running cell with proxies (issue 28): every process
//! answers `/metrics`, `/health` and `/ready`; after traffic, the seed's four figures
//! (commit latency, fsync latency, session expiries, the oldest unacknowledged
//! invalidation) and the histograms are there and non-zero; every metric the dashboard
//! and the alerting rules in `ops/monitoring/` use exists in the live scrape; and
//! `/ready` turns 503 on a replica that has lost its leader.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use client_sdk::{Client, ClientConfig};
use common::*;
use wire::types::CreateMode;

/// An HTTP/1.1 GET: (status, content type, body).
fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String, String)> {
    http_get_accepting(addr, path, "*/*")
}

/// [`http_get`] with an `Accept` header.
fn http_get_accepting(
    addr: &str,
    path: &str,
    accept: &str,
) -> std::io::Result<(u16, String, String)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type:")
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default();
    Ok((status, content_type, body.to_string()))
}

/// `/metrics` in Prometheus' text format, after checking the OpenMetrics one Prometheus
/// asks for is served too.
fn scrape(addr: &str) -> String {
    let (status, ct, body) = http_get_accepting(
        addr,
        "/metrics",
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    )
    .expect("GET /metrics");
    assert_eq!(status, 200, "{addr}/metrics: {body}");
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    assert!(body.ends_with("# EOF\n"), "{addr}: not a whole exposition");
    let (status, ct, body) = http_get(addr, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200, "{addr}/metrics: {body}");
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    body
}

/// The value of the first sample named `name` whose labels include every one of
/// `labels` (`key="value"`).
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let n = series.split('{').next()?;
        (n == name && labels.iter().all(|x| series.contains(x)))
            .then(|| value.parse().ok())
            .flatten()
    })
}

fn must(text: &str, name: &str, labels: &[&str], who: &str) -> f64 {
    sample(text, name, labels).unwrap_or_else(|| panic!("{who}: no {name}{labels:?} in\n{text}"))
}

/// Every sample name in a scrape.
fn names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_string))
        .collect()
}

/// Every `lockservice_*` metric name a file uses.
fn used_in(file: &str) -> BTreeSet<String> {
    words_starting(&std::fs::read_to_string(file).unwrap(), "lockservice_")
}

fn wait_ready(addr: &str, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let (status, _, body) = http_get(addr, "/ready").expect("GET /ready");
        if status == 200 {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{addr} not ready within {within:?}: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn metrics_of_a_cell_with_proxies() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cell");
    let base = free_base(3);
    let mbase = free_tcp_base(&[0, 1, 2, 100, 101]);
    // The servers log JSON lines (into cell/replica-N.log), and back the cell up to a
    // directory every 2 s.
    let store = format!("file://{}/backups", dir.path().display());
    let (dev, out) = start_dev_with(
        &data,
        base,
        3,
        &[
            "--proxies",
            "2",
            "--metrics-base-port",
            &mbase.to_string(),
            "--lease-ms",
            "3000",
            "--backup",
            &store,
            "--backup-interval-secs",
            "2",
            "--backup-keep",
            "2",
            "--no-demo",
        ],
        &[("LOCKSERVICE_LOG_FORMAT", "json")],
    );
    let _guard = DevGuard(Some(dev));
    let replicas: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", base + i)).collect();
    let proxies: Vec<String> = (0..2)
        .map(|i| format!("127.0.0.1:{}", base + 100 + i))
        .collect();
    let rm: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", mbase + i)).collect();
    let pm: Vec<String> = (0..2)
        .map(|i| format!("127.0.0.1:{}", mbase + 100 + i))
        .collect();
    assert!(
        out.contains(&format!("http://{}/metrics", pm[1])),
        "dev names the metrics addresses:\n{out}"
    );
    for a in rm.iter().chain(&pm) {
        // A proxy serves its metrics once it has reached the cell.
        let deadline = Instant::now() + Duration::from_secs(20);
        let (status, _, body) = loop {
            match http_get(a, "/health") {
                Ok(r) => break r,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("{a}/health: {e}"),
            }
        };
        assert_eq!((status, body.as_str()), (200, "ok\n"), "{a}/health");
        let why = wait_ready(a, Duration::from_secs(20));
        assert!(why.starts_with("ready: "), "{why}");
    }

    // Traffic: writes, cached reads through a proxy and directly, a write that
    // invalidates them, and a session left to expire.
    let ca = data.join("tls/ca.pem");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let direct = Client::connect(ClientConfig::new(replicas.clone(), ca.clone()))
            .await
            .unwrap();
        // Both readers through the first proxy: the second reads from its cache.
        let via = Client::connect(ClientConfig::new(vec![proxies[0].clone()], ca.clone()))
            .await
            .unwrap();
        let writer = direct.open_session().await.unwrap();
        let reader = via.open_session().await.unwrap();
        let second = via.open_session().await.unwrap();
        writer
            .create("/m", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        writer.get_cached("/m").await.unwrap();
        reader.get_cached("/m").await.unwrap();
        second.get_cached("/m").await.unwrap();
        writer.set_data("/m", b"v2".to_vec(), None).await.unwrap();
        let doomed = direct.open_session().await.unwrap();
        doomed
            .create(
                "/m-eph",
                Vec::new(),
                CreateMode {
                    ephemeral: true,
                    sequential: false,
                },
            )
            .await
            .unwrap();
        doomed.stop_keepalives();
        // The 3 s lease runs out; the leader expires it.
        let deadline = Instant::now() + Duration::from_secs(20);
        while writer.exists("/m-eph").await.unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "the doomed session never expired"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // A proxy renews its clients in batches, once a second.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    });

    let rs: Vec<String> = rm.iter().map(|a| scrape(a)).collect();
    let ps: Vec<String> = pm.iter().map(|a| scrape(a)).collect();
    let leaders: Vec<usize> = (0..3)
        .filter(|i| must(&rs[*i], "lockservice_raft_leader", &[], &rm[*i]) == 1.0)
        .collect();
    assert_eq!(leaders.len(), 1, "one leader among the replicas");
    let l = &rs[leaders[0]];
    let who = &rm[leaders[0]];
    // The seed's four figures, and the histograms, at the leader.
    assert!(must(l, "lockservice_raft_commit_seconds_count", &[], who) > 0.0);
    assert!(must(l, "lockservice_raft_commit_seconds_sum", &[], who) > 0.0);
    assert!(must(l, "lockservice_log_fsync_seconds_count", &[], who) > 0.0);
    assert!(must(l, "lockservice_log_appends_per_fsync_count", &[], who) > 0.0);
    assert!(must(l, "lockservice_session_expiries_total", &[], who) >= 1.0);
    must(
        l,
        "lockservice_oldest_unacked_invalidation_seconds",
        &[],
        who,
    );
    assert!(must(l, "lockservice_invalidations_sent_total", &[], who) >= 1.0);
    assert!(must(l, "lockservice_keepalive_rpcs_total", &[], who) > 0.0);
    assert!(must(l, "lockservice_sessions", &[], who) >= 1.0);
    assert!(must(l, "lockservice_raft_leader_changes_total", &[], who) >= 1.0);
    assert_eq!(must(l, "lockservice_session_lease_seconds", &[], who), 3.0);
    // Backups: the leader wrote some (every 2 s), the newest a moment ago.
    assert!(must(l, "lockservice_backups_written_total", &[], who) >= 1.0);
    assert!(must(l, "lockservice_backup_last_size_bytes", &[], who) > 0.0);
    assert_eq!(
        must(l, "lockservice_backup_interval_seconds", &[], who),
        2.0
    );
    let newest = must(l, "lockservice_backup_newest_timestamp_seconds", &[], who);
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        unix - newest < 60.0,
        "the newest backup is {} s old",
        unix - newest
    );
    let cell = format!("cell=\"{}\"", "dev");
    must(l, "lockservice_raft_term", &[&cell], who);
    let lags = l
        .lines()
        .filter(|x| x.starts_with("lockservice_raft_follower_lag_entries{"))
        .count();
    assert_eq!(lags, 2, "the leader reports both followers' lag:\n{l}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        must(
            l,
            "lockservice_tls_certificate_expiry_timestamp_seconds",
            &[],
            who
        ) > now
    );
    assert_eq!(
        must(l, "lockservice_refusals_total", &["reason=\"acl\""], who),
        0.0
    );
    for (i, r) in rs.iter().enumerate() {
        assert!(must(r, "lockservice_log_fsync_seconds_count", &[], &rm[i]) > 0.0);
        assert_eq!(must(r, "lockservice_raft_leader_known", &[], &rm[i]), 1.0);
        assert!(must(r, "lockservice_raft_applied_index", &[], &rm[i]) > 0.0);
    }
    // The proxies: batches, the cache, invalidations relayed to the reader.
    let total =
        |name: &str| -> f64 { ps.iter().map(|p| sample(p, name, &[]).unwrap_or(0.0)).sum() };
    assert!(total("lockservice_proxy_keepalive_batches_total") >= 1.0);
    assert!(total("lockservice_proxy_cache_hits_total") >= 1.0, "{ps:?}");
    assert!(
        total("lockservice_proxy_invalidations_relayed_total") >= 1.0,
        "{ps:?}"
    );

    // Every metric the dashboard and the alerts use is in the scrape.
    let mut live = BTreeSet::new();
    for t in rs.iter().chain(&ps) {
        live.extend(names(t));
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/monitoring/");
    for file in ["alerts.yml", "dashboard.json"] {
        let used = used_in(&format!("{root}{file}"));
        assert!(used.len() > 5, "{file} names its metrics");
        let missing: Vec<_> = used.difference(&live).collect();
        assert!(
            missing.is_empty(),
            "{file} uses metrics no process serves: {missing:?}"
        );
    }

    // promtool's lint of the exposition, where it is installed (ops/test.sh needs it).
    if std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok()
    {
        for t in rs.iter().chain(&ps) {
            let mut c = std::process::Command::new("promtool")
                .args(["check", "metrics"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            c.stdin.take().unwrap().write_all(t.as_bytes()).unwrap();
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "promtool check metrics: {}", text(&o));
        }
    }

    // JSON lines, one per leadership change and per expiry, in every replica's log.
    let mut messages = Vec::new();
    for id in 1..=3 {
        let log = std::fs::read_to_string(data.join(format!("replica-{id}.log"))).unwrap();
        for line in log.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("replica-{id}.log: not a JSON line ({e}): {line}"));
            assert!(
                v["level"].is_string() && v["timestamp"].is_string(),
                "{line}"
            );
            messages.push(v["fields"]["message"].as_str().unwrap_or("").to_string());
        }
    }
    for want in [
        "leadership changed",
        "the leader changed",
        "expiring sessions",
    ] {
        assert!(
            messages.iter().any(|m| m == want),
            "no {want:?} line in the replicas' logs: {messages:?}"
        );
    }

    // A replica left alone (the leader and the other follower killed) stops being ready.
    let alone = (0..3).find(|i| *i != leaders[0]).unwrap();
    for i in (0..3).filter(|i| *i != alone) {
        let pid = pid_listening(&data, "replica", &replicas[i]).expect("replica pid");
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _, body) = http_get(&rm[alone], "/ready").unwrap();
        if status == 503 {
            assert!(body.contains("no leader known"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "still ready alone: {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, _, _) = http_get(&rm[alone], "/health").unwrap();
    assert_eq!(status, 200, "alive, if not ready");
    // The proxies, their own sessions no longer renewed, stop being ready once their
    // lease (3 s) runs out: a load balancer sends clients elsewhere.
    for p in &pm {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (status, _, body) = http_get(p, "/ready").unwrap();
            if status == 503 {
                assert!(body.contains("lost the cell"), "{p}: {body}");
                break;
            }
            assert!(Instant::now() < deadline, "{p} still ready: {body}");
            std::thread::sleep(Duration::from_millis(200));
        }
        let (status, _, _) = http_get(p, "/health").unwrap();
        assert_eq!(status, 200, "{p}: alive, if not ready");
    }
}

#[test]
fn metrics_of_a_directory_and_its_cells() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cells");
    // Two cells of one replica at base, base + 10; the root at base + 100; the
    // directory at base + 200.
    let base = free_base(11);
    let mbase = free_tcp_base(&[0, 10, 100, 200]);
    let (dev, out) = start_dev_of(
        &data,
        base,
        1,
        &[
            "--cells",
            "2",
            "--no-demo",
            "--metrics-base-port",
            &mbase.to_string(),
        ],
    );
    let _guard = DevGuard(Some(dev));
    let dm = format!("127.0.0.1:{}", mbase + 200);
    assert!(out.contains(&format!("http://{dm}/metrics")), "{out}");
    let why = wait_ready(&dm, Duration::from_secs(20));
    assert!(why.contains("2 cells and 2 prefixes"), "{why}");
    let d = scrape(&dm);
    assert_eq!(must(&d, "lockservice_directory_map_held", &[], &dm), 1.0);
    assert_eq!(must(&d, "lockservice_directory_map_cells", &[], &dm), 2.0);
    assert_eq!(
        must(&d, "lockservice_directory_map_prefixes", &[], &dm),
        2.0
    );
    assert!(must(&d, "lockservice_directory_map_reads_total", &[], &dm) >= 1.0);
    assert!(
        must(
            &d,
            "lockservice_directory_requests_answered_total",
            &[],
            &dm
        ) >= 1.0
    );
    must(
        &d,
        "lockservice_tls_certificate_expiry_timestamp_seconds",
        &[],
        &dm,
    );
    assert!(
        !d.contains("cell=\""),
        "the directory's metrics name no cell:\n{d}"
    );
    // Each cell's replica (and the root's) labels its metrics with its own cell.
    let labels: BTreeSet<String> = [0, 10, 100]
        .iter()
        .map(|o| {
            let a = format!("127.0.0.1:{}", mbase + o);
            let t = scrape(&a);
            let line = t
                .lines()
                .find(|l| l.starts_with("lockservice_raft_term{"))
                .unwrap_or_else(|| panic!("{a}: no term:\n{t}"))
                .to_string();
            line.split("cell=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(labels.len(), 3, "three cells, three labels: {labels:?}");
}
