//! A test cell: real `replica` processes on loopback, each with its own fjall directory.
//!
//! Tests in one file share a mutex so that only one cell runs at a time (two cores; five
//! replicas each), keeping election timing far from its limits.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use client_sdk::{Client, ClientConfig, Status};
use replica::config::{Member, RaftConfig, ReplicaConfig, SessionConfig, TlsConfig};

/// One cell at a time per test binary.
pub static SERIAL: Mutex<()> = Mutex::new(());

/// Takes the per-binary lock, surviving a panic in another test.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Knobs of a test cell.
#[derive(Clone, Debug)]
pub struct Opts {
    pub replicas: u64,
    pub lease_ms: u64,
    pub checkpoint_interval_ms: u64,
    pub raft: RaftConfig,
    pub request_timeout_ms: u64,
    /// `faults.snapshot_build_delay_ms` of every replica.
    pub snapshot_build_delay_ms: u64,
    /// Admins and the root's ACL (default: the dev client is the admin, the root open).
    pub security: replica::config::SecurityConfig,
    /// `[limits]` of every replica (default: the dev client unlimited).
    pub limits: replica::config::LimitsConfig,
    /// Give the replicas a revocation list, `tls/revoked.crl` (empty at the start):
    /// [`TestCell::crl`].
    pub crl: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            replicas: 5,
            lease_ms: 12_000,
            checkpoint_interval_ms: 1_000,
            raft: RaftConfig::default(),
            request_timeout_ms: 5_000,
            snapshot_build_delay_ms: 0,
            security: replica::config::SecurityConfig::open(wire::tls::DEV_CLIENT),
            crl: false,
            limits: replica::config::LimitsConfig::unlimited_for(wire::tls::DEV_CLIENT),
        }
    }
}

pub struct TestCell {
    pub dir: tempfile::TempDir,
    pub configs: BTreeMap<u64, (PathBuf, ReplicaConfig)>,
    pub procs: BTreeMap<u64, Child>,
    pub ca: PathBuf,
    opts: Opts,
    members: Vec<Member>,
}

fn free_udp_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.local_addr().expect("addr").port()
}

impl TestCell {
    /// Writes configs and starts `opts.replicas` replicas; replica 1 bootstraps the cell.
    pub fn start(opts: Opts) -> TestCell {
        let mut cell = TestCell::prepare(opts);
        for id in 1..=cell.opts.replicas {
            cell.spawn(id);
        }
        cell
    }

    /// Writes the configs of `opts.replicas` replicas (replica 1 bootstraps the cell) and
    /// starts none of them: [`TestCell::spawn`] each.
    pub fn prepare(opts: Opts) -> TestCell {
        let dir = tempfile::tempdir().expect("tempdir");
        let tls = dir.path().join("tls");
        let ca = wire::tls::DevCa::generate().expect("ca");
        ca.write_to(&tls).expect("write tls");
        if opts.crl {
            let crl = ca.ca().expect("ca").crl(&[], 1, 30).expect("crl");
            std::fs::write(tls.join("revoked.crl"), crl).expect("write crl");
        }
        let members: Vec<Member> = (1..=opts.replicas)
            .map(|id| Member {
                id,
                addr: format!("127.0.0.1:{}", free_udp_port()),
            })
            .collect();
        let mut cell = TestCell {
            ca: tls.join(wire::tls::CA_FILE),
            dir,
            configs: BTreeMap::new(),
            procs: BTreeMap::new(),
            opts,
            members: members.clone(),
        };
        for m in &members {
            cell.write_config(m.id, &m.addr, m.id == 1);
        }
        cell
    }

    /// The members' ids and addresses, as a restore takes them.
    pub fn member_addrs(&self) -> BTreeMap<u64, String> {
        self.members
            .iter()
            .map(|m| (m.id, m.addr.clone()))
            .collect()
    }

    /// Writes replica `id`'s config file again from `configs[id]` (changed by the test).
    pub fn rewrite_config(&self, id: u64) {
        let (path, cfg) = &self.configs[&id];
        std::fs::write(path, toml::to_string_pretty(cfg).expect("toml")).expect("write config");
    }

    fn write_config(&mut self, id: u64, addr: &str, bootstrap: bool) {
        let tls = self.dir.path().join("tls");
        let mut tls_files = TlsConfig::replica_in_dir(&tls);
        if self.opts.crl {
            tls_files.crls = vec![self.crl()];
        }
        let cfg = ReplicaConfig {
            id,
            listen: addr.parse().expect("addr"),
            advertise: None,
            data_dir: self.dir.path().join(format!("replica-{id}")),
            bootstrap,
            members: self.members.clone(),
            tls: tls_files,
            raft: self.opts.raft.clone(),
            session: SessionConfig {
                lease_ms: self.opts.lease_ms,
                checkpoint_interval_ms: self.opts.checkpoint_interval_ms,
                ..SessionConfig::default()
            },
            request_timeout_ms: self.opts.request_timeout_ms,
            limits: self.opts.limits.clone(),
            faults: replica::config::FaultsConfig {
                snapshot_build_delay_ms: self.opts.snapshot_build_delay_ms,
            },
            security: self.opts.security.clone(),
            metrics: Default::default(),
            backup: Default::default(),
        };
        let path = self.dir.path().join(format!("replica-{id}.toml"));
        std::fs::write(&path, toml::to_string_pretty(&cfg).expect("toml")).expect("write config");
        self.configs.insert(id, (path, cfg));
    }

    /// Writes the config of a new, non-bootstrapping replica and returns its address.
    pub fn prepare_new_replica(&mut self, id: u64) -> String {
        let addr = format!("127.0.0.1:{}", free_udp_port());
        self.write_config(id, &addr, false);
        addr
    }

    /// Starts (or restarts) replica `id` from its config and data directory.
    pub fn spawn(&mut self, id: u64) {
        let (path, _) = &self.configs[&id];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("replica-{id}.log")))
            .expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_replica"))
            .arg("--config")
            .arg(path)
            .env(
                "RUST_LOG",
                "info,openraft=warn,fjall=warn,lsm_tree=warn,quinn=warn",
            )
            // The slow-disk hook (`TestCell::stall_fsyncs`); inert while its file is absent.
            .env(replica::raft::log_store::TEST_HOOKS_ENV, "1")
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn replica");
        self.procs.insert(id, child);
    }

    /// Stalls every log fsync of replica `id` by `ms` milliseconds from now on (0: no
    /// more), through the log store's test hook (`replica::raft::log_store::SYNC_STALL_FILE`).
    pub fn stall_fsyncs(&self, id: u64, ms: u64) {
        let file = self.configs[&id]
            .1
            .data_dir
            .join(replica::raft::log_store::SYNC_STALL_FILE);
        if ms == 0 {
            let _ = std::fs::remove_file(file);
        } else {
            std::fs::write(file, ms.to_string()).expect("write the stall file");
        }
    }

    /// Makes replica `id`, when next started, lose the log entries its last fsync did not
    /// cover, as after a power loss (the log store's test hook,
    /// `replica::raft::log_store::LOSE_UNSYNCED_FILE`). Call it after [`TestCell::kill`].
    pub fn lose_unsynced_at_restart(&self, id: u64) {
        let dir = &self.configs[&id].1.data_dir;
        assert!(
            dir.join(replica::raft::log_store::SYNCED_INDEX_FILE)
                .exists(),
            "replica {id} recorded no fsync"
        );
        std::fs::write(dir.join(replica::raft::log_store::LOSE_UNSYNCED_FILE), "")
            .expect("write the power-loss marker");
    }

    /// Stops replica `id` as an operator would (SIGTERM) and waits for it to exit, at
    /// most `within` (then it is killed and the test fails). Returns how long it took.
    pub async fn stop(&mut self, id: u64, within: Duration) -> Duration {
        let started = Instant::now();
        let mut child = self.procs.remove(&id).expect("a running replica");
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        // Bounded by `within`.
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    assert!(status.success(), "replica {id} exited with {status}");
                    return started.elapsed();
                }
                Ok(None) if started.elapsed() < within => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "replica {id} did not exit within {within:?} of SIGTERM; logs in {}",
                        self.dir.path().display()
                    );
                }
            }
        }
    }

    /// Replica `id`'s own log (its stdout and stderr; empty if it never started).
    pub fn log_of(&self, id: u64) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("replica-{id}.log")))
            .unwrap_or_default()
    }

    /// `kill -9` replica `id` and reap it.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut c) = self.procs.remove(&id) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal (SIGSTOP, SIGCONT, ...) to replica `id`.
    pub fn signal(&self, id: u64, sig: i32) {
        if let Some(c) = self.procs.get(&id) {
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    pub fn addr(&self, id: u64) -> String {
        self.configs[&id].1.listen.to_string()
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.configs
            .values()
            .map(|(_, c)| c.listen.to_string())
            .collect()
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new(self.endpoints(), self.ca.clone());
        c.attempt_timeout = Duration::from_secs(2);
        c.request_timeout = Duration::from_secs(20);
        c
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.client_config()).await.expect("client")
    }

    /// Status of every running replica.
    pub async fn statuses(&self, client: &Client) -> BTreeMap<u64, Status> {
        let mut out = BTreeMap::new();
        for id in self.procs.keys() {
            if let Ok(s) = client
                .status_of(self.addr(*id).parse().expect("addr"))
                .await
            {
                out.insert(*id, s);
            }
        }
        out
    }

    /// The replicas' revocation list (with `Opts::crl`).
    pub fn crl(&self) -> PathBuf {
        self.dir.path().join("tls").join("revoked.crl")
    }

    /// The cell's CA, to issue more certificates with.
    pub fn ca_issuer(&self) -> wire::tls::Ca {
        let tls = self.ca.parent().expect("tls dir");
        wire::tls::Ca::from_pem(
            &std::fs::read_to_string(&self.ca).expect("ca.pem"),
            &std::fs::read_to_string(tls.join(wire::tls::CA_KEY_FILE)).expect("ca.key"),
        )
        .expect("ca")
    }

    /// A client certificate and key for `uri` (valid a day), issued by the cell's CA
    /// into `dir` as `client.pem` and `client.key`; returns their paths.
    pub fn issue_client(&self, dir: &std::path::Path, uri: &str) -> (PathBuf, PathBuf) {
        let c = self
            .ca_issuer()
            .issue(&wire::identity::Identity::parse(uri).expect("identity"), 1)
            .expect("issue");
        std::fs::create_dir_all(dir).expect("dir");
        let (cert, key) = (dir.join("client.pem"), dir.join("client.key"));
        std::fs::write(&cert, c.cert_pem).expect("write cert");
        std::fs::write(&key, c.key_pem).expect("write key");
        (cert, key)
    }

    /// Waits until a running replica reports itself leader (optionally not `not`).
    pub async fn wait_leader(&self, client: &Client, within: Duration, not: Option<u64>) -> u64 {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            for (id, s) in self.statuses(client).await {
                if s.role == "Leader" && Some(id) != not {
                    // A new cell's first leader commits the security bootstrap at once;
                    // tests that predict log indexes start after it. (Ignored if it
                    // fails: the caller finds out with its own requests.)
                    let _ = client.security().await;
                    return id;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "no leader within {within:?}; logs in {}",
            self.dir.path().display()
        );
    }

    /// A cell of `replicas` replicas (the other options default), a client, and the
    /// leader every replica agrees on ([`Self::wait_settled_leader`], within 30 s).
    pub async fn settled(replicas: u64) -> (TestCell, Client, u64) {
        let cell = TestCell::start(Opts {
            replicas,
            ..Opts::default()
        });
        let client = cell.client().await;
        let leader = cell
            .wait_settled_leader(&client, Duration::from_secs(30))
            .await;
        (cell, client, leader)
    }

    /// Waits until every running replica reports the same leader in the same term, twice
    /// 300 ms apart, and returns it. Right after a cell starts, a follower that has not
    /// heard from the bootstrapping replica yet may still call an election (more likely
    /// on a loaded machine); once every follower follows the leader, their election timers
    /// are reset by its heartbeats. Tests that assert what a leader change disturbs
    /// (cached reads right after the start) wait for this rather than [`Self::wait_leader`].
    pub async fn wait_settled_leader(&self, client: &Client, within: Duration) -> u64 {
        let deadline = Instant::now() + within;
        let mut last: Option<(u64, u64)> = None;
        while Instant::now() < deadline {
            let st = self.statuses(client).await;
            let views: BTreeSet<(u64, Option<u64>)> = st
                .values()
                .map(|s| (s.term, s.leader.as_ref().map(|l| l.id)))
                .collect();
            let agreed = match views.into_iter().collect::<Vec<_>>()[..] {
                [(term, Some(leader))] if st.len() == self.procs.len() => Some((term, leader)),
                _ => None,
            };
            match agreed {
                Some((_, leader)) if agreed == last => return leader,
                _ => last = agreed,
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        panic!(
            "the replicas did not agree on a leader within {within:?}; logs in {}",
            self.dir.path().display()
        );
    }

    /// Waits until every running replica has applied at least `index`.
    pub async fn wait_applied(&self, client: &Client, index: u64, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let st = self.statuses(client).await;
            if st.len() == self.procs.len() && st.values().all(|s| s.last_applied >= index) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replicas did not reach index {index}: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every running replica reports its state digest at one applied index,
    /// and asserts the digests are equal there (the replicas hold the same content, not
    /// only the same counts). Returns that index.
    pub async fn assert_same_state(&self, client: &Client, within: Duration) -> u64 {
        let deadline = Instant::now() + within;
        loop {
            let mut seen = BTreeMap::new();
            for id in self.procs.keys() {
                if let Ok(d) = client
                    .state_digest_of(self.addr(*id).parse().expect("addr"))
                    .await
                {
                    seen.insert(*id, d);
                }
            }
            let indexes: std::collections::BTreeSet<u64> = seen.values().map(|d| d.0).collect();
            if seen.len() == self.procs.len() && indexes.len() == 1 {
                let digests: std::collections::BTreeSet<u64> = seen.values().map(|d| d.1).collect();
                assert_eq!(
                    digests.len(),
                    1,
                    "replicas at index {indexes:?} hold different states: {seen:?}"
                );
                return *indexes.first().expect("one");
            }
            assert!(
                Instant::now() < deadline,
                "replicas never reported one applied index: {seen:?}"
            );
            // A replica computes at most one digest per `DIGEST_INTERVAL`.
            tokio::time::sleep(replica::gateway::DIGEST_INTERVAL + Duration::from_millis(50)).await;
        }
    }

    /// Keeps the data directory (for post-mortems) when a test fails.
    pub fn keep_on_panic(&self) {
        if std::thread::panicking() {
            let kept = self.dir.path().to_path_buf();
            eprintln!("cell data kept in {}", kept.display());
        }
    }
}

impl Drop for TestCell {
    fn drop(&mut self) {
        for (_, c) in self.procs.iter_mut() {
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            // Keep logs for the failure report.
            let p = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            let kept = p.keep();
            eprintln!("test failed: cell logs kept in {}", kept.display());
        }
    }
}

/// A two-worker tokio runtime for a test body.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Sorted percentiles of durations in milliseconds.
pub fn percentile(sorted_ms: &[f64], p: f64) -> f64 {
    if sorted_ms.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ms.len() as f64 - 1.0) * p).round() as usize;
    sorted_ms[i]
}
