//! The peer side of `loadgen compare` for the two large scenarios (`profile`, `state`):
//! each runs briefly against etcd and ZooKeeper (`--scale 0.02`), so the peers' code paths
//! do not rot. Needs Debian's `etcd-server` and `zookeeper` (`.ci/run` installs them);
//! without them each test says so and checks nothing. Speed is not checked here.

use std::path::Path;
use std::process::Command;

mod common;
use common::{failed, figure, server_confirms_lost, server_confirms_none_lost};

const LOADGEN: &str = env!("CARGO_BIN_EXE_loadgen");

/// One run per system at a time: an etcd run and a ZooKeeper run may overlap (libtest runs
/// two tests at once on two cores), two of one system may not. Each run starts its own
/// cluster on ports it finds free, so the two never share a server; what they share is
/// the CPU, and these tests check behaviour with wide margins, not speed.
static ETCD_LANE: std::sync::Mutex<()> = std::sync::Mutex::new(());
static ZK_LANE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn installed(system: &str) -> bool {
    let ok = match system {
        "etcd" => Command::new("etcd").arg("--version").output().is_ok(),
        _ => Path::new("/usr/share/java/zookeeper.jar").exists(),
    };
    if !ok {
        eprintln!("SKIPPED: {system} is not installed (apt-get install -y etcd-server zookeeper)");
    }
    ok
}

fn run(system: &str, args: &[&str], name: &str, out: &Path) -> serde_json::Value {
    run_at(system, "0.02", args, name, out)
}

fn run_at(system: &str, scale: &str, args: &[&str], name: &str, out: &Path) -> serde_json::Value {
    let lane = if system == "zk" { &ZK_LANE } else { &ETCD_LANE };
    let _g = lane.lock().unwrap_or_else(|e| e.into_inner());
    let o = Command::new(LOADGEN)
        .args(["--scale", scale, "--system", system, "--out"])
        .arg(out)
        .args(args)
        .output()
        .expect("run loadgen");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{text}");
    assert!(
        o.status.success(),
        "loadgen {system} {args:?} failed:\n{text}"
    );
    let file = if system == "zk" { "zookeeper" } else { system };
    let json = out.join(format!("{name}-{file}.json"));
    assert!(out.join(format!("{name}-{file}.svg")).exists());
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

/// The run used three loadgen processes (this one and two others named `<other> 0` and
/// `<other> 1`), and reported the others' costs.
fn assert_split_over_two(v: &serde_json::Value, other: &str) {
    let procs = v["params"]["loadgen processes"].as_str().unwrap();
    assert!(procs.starts_with("3 "), "{v}");
    let names: Vec<&str> = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for k in 0..2 {
        assert!(
            names.contains(&format!("{other} {k}").as_str()),
            "{names:?}"
        );
    }
}

fn count(v: &serde_json::Value, k: &str) -> u64 {
    v["latencies"][k]["count"]
        .as_u64()
        .unwrap_or_else(|| panic!("no latency {k:?} in {v}"))
}

/// The profile at 1/50 scale on a peer, 12 s with an 8 s lease (every lease is renewed
/// about four times; 20 s until 2026-12-06, cut for the test command's time): its sessions stay alive, its locks are taken with its own recipe and
/// kept, and every read reaches the cluster. With `behind` > 0, that many sessions are
/// ended behind loadgen's back at the end (etcd: their keepers stop, so their leases run
/// out at the server; ZooKeeper: another client closes them), and the server-side check,
/// by id and a lease after the run, must find exactly those lost.
fn profile_on(system: &str, extra: &[&str], behind: u64) -> Option<serde_json::Value> {
    if !installed(system) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut args = extra.to_vec();
    let behind_s = behind.to_string();
    args.extend(["--lease-secs", "8", "--end-sessions-behind-back", &behind_s]);
    args.extend(["profile", "--secs", "12"]);
    let v = run(system, &args, "profile", dir.path());
    // Asked at the server before any session closed (with --processes, while the parts
    // still hold theirs).
    // The members' logs are kept next to the report when, and only when, the server
    // confirmed sessions lost (the cluster's own directory goes with it).
    let kept = dir
        .path()
        .join(format!("{}-member-logs", v["system"].as_str().unwrap()));
    if behind == 0 {
        assert_eq!(figure(&v, "sessions lost"), 0.0, "{v}");
        server_confirms_none_lost(&v);
        assert!(!kept.exists(), "{} kept without a loss", kept.display());
    } else {
        assert!(figure(&v, "sessions lost") <= behind as f64, "{v}");
        server_confirms_lost(&v, behind);
        let logs: Vec<_> = std::fs::read_dir(&kept)
            .unwrap_or_else(|e| panic!("{}: {e}", kept.display()))
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(logs.len(), 3, "one log per member: {logs:?}");
        assert!(
            logs.iter().all(|l| std::fs::metadata(l).unwrap().len() > 0),
            "{logs:?}"
        );
    }
    // 1 000 sessions and each loadgen process's admin session were asked for by id.
    let processes = extra
        .iter()
        .position(|a| *a == "--processes")
        .map_or(1.0, |i| extra[i + 1].parse::<f64>().unwrap());
    assert_eq!(
        figure(&v, "sessions at the server at the end"),
        1_000.0 + processes - behind as f64,
        "{v}"
    );
    // Jeopardy, defined as ours, is reported for the peers too.
    figure(&v, "sessions in jeopardy at some point");
    assert_eq!(figure(&v, "operation errors"), 0.0, "{v}");
    // ZooKeeper reads through its watched copies by default (--reads cached); etcd has
    // no Rust client for its cache, so its reads stay uncached.
    let read = if system == "zk" && !extra.contains(&"uncached") {
        "config read (cached)"
    } else {
        "config read (uncached)"
    };
    for k in ["acquire (short locks)", "config write", read] {
        assert_eq!(failed(&v, k), 0, "{k}: {v}");
    }
    assert_eq!(figure(&v, "setup errors (long-held locks not taken)"), 0.0);
    assert_eq!(
        figure(&v, "long-held locks still held"),
        v["params"]["locks held all run"]
            .as_str()
            .unwrap()
            .parse::<f64>()
            .unwrap(),
        "{v}"
    );
    assert!(count(&v, "acquire (short locks)") > 0, "{v}");
    assert!(count(&v, "config write") > 0, "{v}");
    // loadgen's own lateness, merged from every part.
    assert!(
        count(
            &v,
            "loadgen's own lateness (a 10 ms timer, how late it ran)"
        ) > 0,
        "{v}"
    );
    let reads = count(&v, read);
    assert!(reads > 0, "{v}");
    assert!(figure(&v, "reads reaching the cell per s") > 0.0, "{v}");
    let hit_rate = figure(&v, "client cache hit rate (%)");
    if read == "config read (cached)" {
        // 100 values written 10 times a second in all, each read by 10 sessions a second:
        // most reads find their copy.
        assert!(hit_rate > 50.0, "{v}");
    } else {
        assert_eq!(hit_rate, 0.0, "{v}");
    }
    if system == "etcd" {
        assert!(figure(&v, "leases renewed per s") > 0.0, "{v}");
        assert!(count(&v, "KeepAlive round trip") > 0, "{v}");
    }
    Some(v)
}

#[test]
fn profile_on_etcd() {
    profile_on("etcd", &[], 3);
}

/// The same with every lease of a gRPC client renewed on one stream (loadgen's own
/// keep-alive multiplexer), the lease clients connected to the leader only: the leases
/// must stay alive and their renewals be seen.
#[test]
fn profile_on_etcd_with_shared_keepalive_streams_at_the_leader() {
    let v = profile_on(
        "etcd",
        &[
            "--etcd-shared-keepalive",
            "--etcd-leader-only",
            "--reads",
            "uncached",
        ],
        0,
    );
    if let Some(v) = v {
        assert_eq!(
            v["params"]["etcd lease clients connected to"], "the leader only (--etcd-leader-only)",
            "{v}"
        );
    }
}

/// As a clientv3 process does: one lease for all the sessions (and locks) of a gRPC
/// client, 1 000 sessions on three leases here (at least a client per member, so that
/// requests spread over the members; and the admin session's own lease), which stay
/// alive through the run, the server confirming every session held.
#[test]
fn profile_on_etcd_with_one_lease_per_client() {
    let Some(v) = profile_on("etcd", &["--etcd-lease-per-client"], 0) else {
        return;
    };
    assert_eq!(
        v["params"]["etcd leases"],
        "one per gRPC connection, shared by its sessions (--etcd-lease-per-client)",
        "{v}"
    );
    assert_eq!(figure(&v, "etcd leases of loadgen's sessions"), 4.0, "{v}");
}

/// Split over two loadgen processes, as the full profile is (a ZooKeeper session is a
/// connection, and one process may hold fewer than 20 000 here): the parts start
/// together and their counts and histograms are merged into one report; three sessions
/// closed behind loadgen's back (two in one part, one in the other) are found lost.
#[test]
fn profile_on_zookeeper_split_over_two_processes() {
    let Some(v) = profile_on("zk", &["--processes", "2"], 3) else {
        return;
    };
    assert_split_over_two(&v, "loadgen part");
    // 1 000 sessions at this scale: both parts' sessions are counted.
    assert_eq!(v["params"]["sessions"], "1000", "{v}");
}

/// The large state at 1/50 scale on a peer: loaded, a follower killed and restarted, a
/// member without data caught up (etcd: a learner; ZooKeeper: a follower whose data
/// directory was emptied), every session kept.
fn state_on(system: &str, extra: &[&str]) -> Option<serde_json::Value> {
    if !installed(system) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut args = extra.to_vec();
    args.push("state");
    let v = run(system, &args, "state", dir.path());
    assert_eq!(figure(&v, "sessions lost"), 0.0, "{v}");
    server_confirms_none_lost(&v);
    assert!(figure(&v, "nodes in the cell") >= 2_000.0, "{v}");
    assert!(figure(&v, "restart: caught up after (s)") < 60.0, "{v}");
    assert!(figure(&v, "learner: caught up after (s)") < 60.0, "{v}");
    assert!(figure(&v, "replica-1 RSS loaded (MB)") > 0.0, "{v}");
    Some(v)
}

#[test]
fn state_on_etcd() {
    state_on("etcd", &[]);
}

/// ZooKeeper's sessions held by two other loadgen processes, as the full state's 50 000
/// are (one process may hold fewer than 20 000 connections here): every one is opened,
/// kept through the restarts and counted, and the holders' costs are reported.
#[test]
fn state_on_zookeeper_with_sessions_in_two_processes() {
    let Some(v) = state_on("zk", &["--processes", "2"]) else {
        return;
    };
    assert_split_over_two(&v, "loadgen session holder");
    assert_eq!(v["params"]["sessions (one connection each)"], "1000", "{v}");
    assert_eq!(figure(&v, "sessions in the cell"), 1_000.0 + 8.0, "{v}");
}

/// etcd's lock is clientv3's `concurrency.Mutex` step for step: uncontended, an acquire is
/// one `Txn` (the put and the owner read together) and a release one `DeleteRange`, with
/// no separate `Range`, as counted by etcd's own servers. Its four sessions are held as
/// one clientv3 process holds them: on a connection per member (three), where each
/// session would have had a client of its own (four).
#[test]
fn an_uncontended_etcd_acquire_is_one_txn_at_the_servers() {
    if !installed("etcd") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let v = run_at("etcd", "0.2", &["acquire"], "acquire", dir.path());
    assert_eq!(v["params"]["clients (sessions, one lock each)"], "4", "{v}");
    // One connection per member; one more for each client that moved on to another
    // member during the setup (a request timed out on a starved machine).
    let moves = figure(&v, "etcd clients moved to another member (until the start)");
    let conns = figure(
        &v,
        "client TCP connections to the servers (loadgen's, at the start)",
    );
    assert!(
        (3.0..=3.0 + moves).contains(&conns),
        "{conns} connections, {moves} moves: {v}"
    );
    let per = |m: &str| {
        figure(
            &v,
            &format!("etcd {m} RPCs per acquire and release (at the servers)"),
        )
    };
    assert!(count(&v, "acquire") > 0, "{v}");
    assert_eq!(per("Txn"), 1.0, "{v}");
    assert_eq!(per("DeleteRange"), 1.0, "{v}");
    assert_eq!(per("Range"), 0.0, "{v}");
    assert_eq!(per("Put"), 0.0, "{v}");
}

/// A frozen leader (SIGSTOP) with four writers, as `failover --freeze`: the writes come
/// back within the run (etcd: the client's 5 s request deadline and keep-alive move it off
/// the frozen member; ZooKeeper: a session its Rust client gave up on is resumed with its
/// id and password, as the Java client keeps trying), and the new leader holds every
/// writer's session at the end, asked by id.
///
/// ZooKeeper's run goes on 40 s after the freeze, not the benchmark's 20: its followers
/// notice a frozen leader only after `syncLimit` ticks (10 s), then elect, and its
/// clients give a connection up before resuming their sessions elsewhere; on the starved
/// 2-core test run (ours and the scenarios beside it) no write came back within 20 s
/// once (2026-12-06), sessions intact.
fn freeze_on(system: &str, after_secs: u64) -> Option<serde_json::Value> {
    if !installed(system) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let after = after_secs.to_string();
    let v = run_at(
        system,
        "0.2",
        &["failover", "--freeze", "--after-secs", &after],
        "failover-freeze",
        dir.path(),
    );
    assert_eq!(v["params"]["event"], "leader SIGSTOP", "{v}");
    assert_eq!(v["params"]["writers (sessions, one key each)"], "4", "{v}");
    assert_eq!(
        v["params"]["run after the event (s)"],
        after.as_str(),
        "{v}"
    );
    // Writes resumed before the run ended.
    assert!(
        figure(&v, "writes unavailable (s)") < after_secs as f64,
        "{v}"
    );
    assert_eq!(figure(&v, "sessions lost"), 0.0, "{v}");
    server_confirms_none_lost(&v);
    Some(v)
}

#[test]
fn a_frozen_etcd_leader_loses_no_lease() {
    freeze_on("etcd", 20);
}

#[test]
fn a_frozen_zookeeper_leader_loses_no_session_its_client_gave_up_on() {
    if let Some(v) = freeze_on("zk", 40) {
        // Reported, whether or not a client gave up in this run.
        figure(&v, "sessions resumed after their client gave up");
    }
}

/// etcd's herd as one clientv3 process holds its sessions: the contenders' leases share one
/// gRPC client, their renewals one keep-alive stream (`--etcd-shared-keepalive`) and their
/// lock waits one watch stream, as counted by etcd's own servers (a stream per waiter
/// would be one per contender: 39 here). Every contender is granted the lock once, in
/// token order.
#[test]
fn an_etcd_herd_waits_on_one_watch_stream_per_client() {
    if !installed("etcd") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let v = run(
        "etcd",
        &["--etcd-shared-keepalive", "herd"],
        "herd",
        dir.path(),
    );
    let n: u64 = v["params"]["contenders (sessions)"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n >= 20, "{v}");
    assert_eq!(count(&v, "hand-off"), n - 1, "{v}");
    assert_eq!(failed(&v, "hand-off"), 0, "{v}");
    let watch = figure(&v, "etcd Watch streams opened (at the servers)");
    let keepalive = figure(&v, "etcd LeaseKeepAlive streams opened (at the servers)");
    assert!((1.0..=3.0).contains(&watch), "{watch} Watch streams: {v}");
    assert!(
        (1.0..=3.0).contains(&keepalive),
        "{keepalive} keep-alive streams: {v}"
    );
    assert!(
        !v["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap_or("").contains("did not increase")),
        "{v}"
    );
}
