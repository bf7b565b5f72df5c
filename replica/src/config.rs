//! The replica's configuration: one documented struct with defaults, loaded with the
//! `config` crate from a TOML file plus `LOCKSVC_REPLICA__*` environment overrides (e.g.
//! `LOCKSVC_REPLICA__SESSION__LEASE_MS=5000`), validated at start.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One initial voter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Replica id (unique within the cell, > 0).
    pub id: u64,
    /// Its address (`host:port`), used by clients and peers alike.
    pub addr: String,
}

/// TLS files (shared with proxies).
pub use wire::tls::TlsConfig;

/// The metrics endpoint (shared with proxies and the directory).
pub use crate::backup::BackupConfig;
pub use wire::metrics::MetricsConfig;

/// Raft timing and log compaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RaftConfig {
    /// Leader heartbeat period. openraft 0.9 also uses it as the AppendEntries and
    /// leadership-check timeout, so below ~100 ms debug builds time out, and it must exceed
    /// the worst round trip between replicas (see docs/testing.md, "Found by the
    /// simulation").
    pub heartbeat_interval_ms: u64,
    /// Lower bound of the randomized election timeout: long enough that a slow fsync or a
    /// short blip does not start an election, short enough for fail-over well inside a lease.
    /// openraft 0.9 adds its leader lease (= `election_timeout_max_ms`) before a follower
    /// that saw a committed leader stands, so with 500–1000 ms a follower stands 1.5–2 s
    /// after the last heartbeat: the seed's "1 to 2 s".
    pub election_timeout_min_ms: u64,
    /// Upper bound of the randomized election timeout.
    pub election_timeout_max_ms: u64,
    /// Take a snapshot (and purge the log behind it) every this many applied entries.
    pub snapshot_interval_entries: u64,
    /// Entries kept in the log behind a snapshot, so a follower that lags slightly catches
    /// up from the log rather than from a whole snapshot.
    pub log_entries_kept_after_snapshot: u64,
}

impl Default for RaftConfig {
    fn default() -> Self {
        RaftConfig {
            heartbeat_interval_ms: 150,
            election_timeout_min_ms: 500,
            election_timeout_max_ms: 1_000,
            snapshot_interval_entries: 100_000,
            log_entries_kept_after_snapshot: 1_000,
        }
    }
}

/// Session leases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionConfig {
    /// Session lease. Clients renew every third of it. 12 s outlasts GC pauses and the
    /// cell's own fail-over (1–3 s) while keeping takeover after a holder's death < 15 s.
    pub lease_ms: u64,
    /// How often the leader commits lease checkpoints for silent sessions, so a dead
    /// client's session expires even when leaders change faster than the lease.
    pub checkpoint_interval_ms: u64,
    /// How often the leader looks for expired leases.
    pub expiry_scan_interval_ms: u64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            lease_ms: 12_000,
            checkpoint_interval_ms: 1_000,
            expiry_scan_interval_ms: 100,
        }
    }
}

/// Bounds on what remote parties may make the replica hold (DESIGN.md, safety rule 8).
/// Frame sizes, deadlines, stream counts and nesting are fixed by the protocol
/// (`wire::frame`, `wire::quic`, `wire::decode`); these are what an operator may size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitsConfig {
    /// Connections at once (clients, proxies and peers together, handshakes included);
    /// more are refused before their handshake.
    pub connections_max: usize,
    /// Of those, from one source IP address.
    pub connections_per_source_max: usize,
    /// Bytes the requests of one client or proxy connection may hold at once while they
    /// are read, decoded and answered; a connection that reaches it waits.
    pub client_connection_bytes_max: usize,
    /// Bytes the RPCs of one peer connection may hold at once.
    pub peer_connection_bytes_max: usize,
    /// Connections, requests in flight and sessions per client identity (a proxy's
    /// forwarded requests count under its client's identity; a proxy's own connections
    /// and requests are not limited here, its clients are, at the proxy and here).
    pub per_identity: wire::quota::QuotaConfig,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            connections_max: wire::CONNECTIONS_MAX,
            connections_per_source_max: wire::CONNECTIONS_PER_SOURCE_MAX,
            client_connection_bytes_max: wire::CLIENT_CONNECTION_BYTES_MAX,
            peer_connection_bytes_max: wire::PEER_CONNECTION_BYTES_MAX,
            per_identity: Default::default(),
        }
    }
}

impl LimitsConfig {
    /// The defaults, with `identity` unlimited (a development cell's client, which
    /// loadgen and the tests drive at a whole cell's scale).
    pub fn unlimited_for(identity: &str) -> LimitsConfig {
        let mut l = LimitsConfig::default();
        l.per_identity
            .identities
            .insert(identity.to_string(), wire::quota::Limits::unlimited());
        l
    }
}

/// Who may do what in a new cell (`docs/security.md`, "ACLs"). Read once: the first
/// leader of a new cell proposes these as the cell's first security settings
/// (`Command::Bootstrap`), and from then on they live in the replicated state and change
/// only through `lockctl acl` (a replica's configuration never overrides them, since
/// replicas that disagreed would apply the same write differently). Give every replica
/// of a cell the same values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SecurityConfig {
    /// The cell's first admins (identity URIs such as `lock://client/ops`): they pass
    /// every ACL and may change ACLs, groups and admins.
    pub initial_admins: Vec<String>,
    /// The root node's ACL, which every node created later inherits until an admin
    /// changes it: `admins` (only the admins may do anything; production) or `everyone`
    /// (every identity the cell admits may read, write, create and change ACLs; a
    /// development cell).
    pub root_acl: RootAcl,
}

/// See [`SecurityConfig::root_acl`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RootAcl {
    /// Only the cell's admins.
    #[default]
    Admins,
    /// Every identity.
    Everyone,
}

impl Default for SecurityConfig {
    fn default() -> Self {
        SecurityConfig {
            initial_admins: Vec::new(),
            root_acl: RootAcl::Admins,
        }
    }
}

impl SecurityConfig {
    /// A development cell's: the root open to every identity, `admin` the one admin.
    pub fn open(admin: &str) -> SecurityConfig {
        SecurityConfig {
            initial_admins: vec![admin.to_string()],
            root_acl: RootAcl::Everyone,
        }
    }

    /// The root's ACL.
    pub fn root_acl(&self) -> wire::acl::Acl {
        match self.root_acl {
            RootAcl::Admins => wire::acl::Acl::admins_only(),
            RootAcl::Everyone => wire::acl::Acl::everyone(),
        }
    }

    /// Checks the admins are identities and a cell whose root only admins may use has
    /// one.
    pub fn validate(&self) -> anyhow::Result<()> {
        for a in &self.initial_admins {
            let id = wire::identity::Identity::parse(a)
                .map_err(|e| anyhow::anyhow!("security.initial_admins: {e}"))?;
            anyhow::ensure!(
                &id.to_string() == a,
                "security.initial_admins: {a:?} is not in canonical form (write {id})"
            );
        }
        anyhow::ensure!(
            !self.initial_admins.is_empty(),
            "security.initial_admins is empty: a cell needs an admin (only admins change \
             ACLs, groups, admins and the membership, so a cell without one could never \
             replace a replica). Name at least one admin identity, for example \
             initial_admins = [\"lock://client/ops\"], with a certificate from `lockctl certs \
             issue --role client --name ops`"
        );
        Ok(())
    }
}

/// Faults injected on purpose, for tests that show the replica keeps its promises while
/// something is slow. Leave every field at its default (0: no fault) in production.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FaultsConfig {
    /// Extra time each snapshot build spends where it serializes the state (after taking
    /// its copy, before writing the file): stands for the serialization of a state far
    /// larger than a test can write. Sessions must still expire, and reads, writes and
    /// KeepAlives go on, while it lasts.
    pub snapshot_build_delay_ms: u64,
}

/// The least a connection's budget may be: its largest frame and what that may decode to.
fn connection_bytes_min(frame_bytes_max: usize) -> usize {
    frame_bytes_max + wire::decode::Limits::for_frame(frame_bytes_max).element_bytes_max
}

/// The whole configuration of one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaConfig {
    /// This replica's id (> 0, unique in the cell).
    pub id: u64,
    /// UDP address the QUIC listener binds (clients, proxies and peers).
    pub listen: SocketAddr,
    /// Address advertised to peers and clients; defaults to `listen`.
    #[serde(default)]
    pub advertise: Option<String>,
    /// Directory for the log (fjall) and snapshots.
    pub data_dir: PathBuf,
    /// Initialize a new cell with `members` as voters if this replica's log is empty. Set it
    /// on one replica of a new cell; replicas that join later leave it false.
    #[serde(default)]
    pub bootstrap: bool,
    /// Initial voters (used only with `bootstrap`).
    #[serde(default)]
    pub members: Vec<Member>,
    /// TLS files.
    pub tls: TlsConfig,
    /// Raft timing.
    #[serde(default)]
    pub raft: RaftConfig,
    /// Session leases.
    #[serde(default)]
    pub session: SessionConfig,
    /// Longest a client request waits for a commit or a leadership check before the client
    /// gets `Unavailable` (the write may still commit later; retry with the same id).
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Bounds on connections and on the bytes their requests hold.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Faults injected for tests (none by default).
    #[serde(default)]
    pub faults: FaultsConfig,
    /// A new cell's admins and root ACL.
    #[serde(default)]
    pub security: SecurityConfig,
    /// The metrics endpoint (off by default).
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Backups to object storage (off by default).
    #[serde(default)]
    pub backup: BackupConfig,
}

fn default_request_timeout_ms() -> u64 {
    5_000
}

impl ReplicaConfig {
    /// Loads a configuration file (TOML) with environment overrides.
    pub fn load(file: Option<&Path>) -> anyhow::Result<ReplicaConfig> {
        let mut b = config::Config::builder();
        if let Some(f) = file {
            b = b.add_source(config::File::from(f).format(config::FileFormat::Toml));
        }
        b = b.add_source(
            config::Environment::with_prefix("LOCKSVC_REPLICA")
                .prefix_separator("__")
                .separator("__"),
        );
        let cfg: ReplicaConfig = b.build()?.try_deserialize()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values make sense together.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.id > 0, "id must be > 0");
        let r = &self.raft;
        anyhow::ensure!(
            r.heartbeat_interval_ms >= 20,
            "raft.heartbeat_interval_ms must be >= 20"
        );
        anyhow::ensure!(
            r.election_timeout_min_ms > r.heartbeat_interval_ms * 2,
            "raft.election_timeout_min_ms must exceed twice the heartbeat interval"
        );
        anyhow::ensure!(
            r.election_timeout_max_ms > r.election_timeout_min_ms,
            "raft.election_timeout_max_ms must exceed election_timeout_min_ms"
        );
        anyhow::ensure!(
            r.snapshot_interval_entries >= 1,
            "raft.snapshot_interval_entries must be >= 1"
        );
        let s = &self.session;
        anyhow::ensure!(s.lease_ms >= 1_000, "session.lease_ms must be >= 1000");
        anyhow::ensure!(
            s.lease_ms > r.election_timeout_max_ms,
            "session.lease_ms must exceed raft.election_timeout_max_ms, or fail-overs expire sessions"
        );
        anyhow::ensure!(
            s.checkpoint_interval_ms >= 50,
            "session.checkpoint_interval_ms must be >= 50"
        );
        anyhow::ensure!(
            s.expiry_scan_interval_ms >= 10,
            "session.expiry_scan_interval_ms must be >= 10"
        );
        let l = &self.limits;
        anyhow::ensure!(
            l.connections_max >= 1 && l.connections_per_source_max >= 1,
            "limits.connections_max and limits.connections_per_source_max must be >= 1"
        );
        anyhow::ensure!(
            l.connections_per_source_max <= l.connections_max,
            "limits.connections_per_source_max must not exceed limits.connections_max"
        );
        let client_min = connection_bytes_min(wire::CLIENT_FRAME_BYTES_MAX);
        anyhow::ensure!(
            l.client_connection_bytes_max >= client_min,
            "limits.client_connection_bytes_max must be >= {client_min} (the largest client \
             frame and what it may decode to)"
        );
        let peer_min = connection_bytes_min(wire::PEER_FRAME_BYTES_MAX);
        anyhow::ensure!(
            l.peer_connection_bytes_max >= peer_min,
            "limits.peer_connection_bytes_max must be >= {peer_min} (the largest peer frame \
             and what it may decode to)"
        );
        anyhow::ensure!(
            l.client_connection_bytes_max <= u32::MAX as usize
                && l.peer_connection_bytes_max <= u32::MAX as usize,
            "limits.*_connection_bytes_max must be below 4 GiB"
        );
        self.security.validate()?;
        self.backup.validate()?;
        l.per_identity.validate().map_err(anyhow::Error::msg)?;
        if self.bootstrap {
            anyhow::ensure!(!self.members.is_empty(), "bootstrap needs members");
            anyhow::ensure!(
                self.members.iter().any(|m| m.id == self.id),
                "bootstrap members must include this replica ({})",
                self.id
            );
        }
        Ok(())
    }

    /// The address peers and clients use for this replica.
    pub fn advertised(&self) -> String {
        self.advertise
            .clone()
            .unwrap_or_else(|| self.listen.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_file_with_defaults_and_validates() {
        let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.toml");
        std::fs::write(
            &f,
            r#"
id = 2
listen = "127.0.0.1:7002"
data_dir = "/tmp/x"
[tls]
ca = "ca.pem"
cert = "server.pem"
key = "server.key"
[session]
lease_ms = 6000
[security]
initial_admins = ["lock://client/ops"]
"#,
        )
        .unwrap();
        let c = ReplicaConfig::load(Some(&f)).unwrap();
        assert_eq!(c.id, 2);
        assert_eq!(c.session.lease_ms, 6000);
        assert_eq!(c.raft, RaftConfig::default());
        assert_eq!(c.advertised(), "127.0.0.1:7002");
        assert_eq!(
            c.security.initial_admins,
            vec!["lock://client/ops".to_string()]
        );
        assert_eq!(
            c.security.root_acl,
            RootAcl::Admins,
            "the secure root by default"
        );
        let mut bad = c.clone();
        bad.session.lease_ms = 900;
        assert!(bad.validate().is_err());
        // No admin, whatever the root's ACL: refused, saying what to set.
        for root_acl in [RootAcl::Admins, RootAcl::Everyone] {
            let mut bad = c.clone();
            bad.security.initial_admins.clear();
            bad.security.root_acl = root_acl;
            let e = bad.validate().unwrap_err().to_string();
            assert!(
                e.contains("initial_admins") && e.contains("lockctl certs"),
                "{e}"
            );
        }
        // An admin that is not an identity, or not in canonical form.
        for admin in ["ops", "lock://client/Ops", "lock://client/a/b"] {
            let mut bad = c.clone();
            bad.security.initial_admins = vec![admin.into()];
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains("security.initial_admins"), "{admin}: {e}");
        }
    }

    /// A development cell's limits (its client unlimited) survive TOML, whose integers
    /// are signed.
    #[test]
    fn unlimited_limits_survive_toml() {
        let l = LimitsConfig::unlimited_for(wire::tls::DEV_CLIENT);
        let text = toml::to_string(&l).unwrap();
        let back: LimitsConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, l);
        assert_eq!(
            back.per_identity.limits(wire::tls::DEV_CLIENT),
            wire::quota::Limits::unlimited()
        );
    }

    /// Environment variables are process-wide: the tests that load configs take turns.
    static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn environment_overrides_the_file() {
        let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
        let f =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/replica.example.toml");
        // SAFETY (edition 2024 marks set_var unsafe): the ENV lock keeps the other
        // config tests from reading the environment meanwhile.
        std::env::set_var("LOCKSVC_REPLICA__SESSION__LEASE_MS", "7000");
        std::env::set_var("LOCKSVC_REPLICA__ID", "4");
        let c = ReplicaConfig::load(Some(&f));
        std::env::remove_var("LOCKSVC_REPLICA__SESSION__LEASE_MS");
        std::env::remove_var("LOCKSVC_REPLICA__ID");
        let c = c.unwrap();
        assert_eq!(c.session.lease_ms, 7000);
        assert_eq!(c.id, 4);
        assert!(ReplicaConfig::load(Some(std::path::Path::new("/nonexistent.toml"))).is_err());
    }

    #[test]
    fn example_config_is_valid() {
        let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
        let f =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/replica.example.toml");
        let c = ReplicaConfig::load(Some(&f)).unwrap();
        assert_eq!(c.members.len(), 5);
        assert_eq!(c.raft, RaftConfig::default());
        assert_eq!(c.session, SessionConfig::default());
        assert_eq!(c.limits, LimitsConfig::default());
        let mut bad = c.clone();
        bad.limits.client_connection_bytes_max = wire::CLIENT_FRAME_BYTES_MAX;
        assert!(
            bad.validate().is_err(),
            "a budget below one frame and its decoding"
        );
        let mut bad = c;
        bad.limits.connections_per_source_max = bad.limits.connections_max + 1;
        assert!(bad.validate().is_err());
    }
}
