//! The proxy's configuration: one documented struct with defaults, loaded with the
//! `config` crate from a TOML file plus `LOCKSVC_PROXY__*` environment overrides (e.g.
//! `LOCKSVC_PROXY__MAX_CLIENTS=5000`), validated at start.

use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// TLS files: the proxy presents a certificate for the DNS name `lockservice` signed by
/// the cell's CA (clients cannot tell it from a replica), and trusts that CA when dialing
/// the replicas.
pub use wire::tls::TlsConfig;

/// Everything a proxy needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyConfig {
    /// Where clients connect (UDP, QUIC).
    pub listen: SocketAddr,
    /// The cell's replica addresses (`host:port`); the proxy finds the leader itself.
    pub replicas: Vec<String>,
    /// TLS files.
    pub tls: TlsConfig,
    /// How often the collected KeepAlives go to the leader as one batch.
    #[serde(default = "default_keepalive_interval_ms")]
    pub keepalive_interval_ms: u64,
    /// Most client connections at once; more are refused with `Unavailable`, so their SDK
    /// moves to another proxy.
    #[serde(default = "default_max_clients")]
    pub max_clients: usize,
    /// Most requests in flight on one client connection; more get `Busy` (the SDK retries).
    #[serde(default = "default_max_inflight")]
    pub max_inflight_per_client: usize,
    /// How long a forwarded request may take at the cell, retries included, before the
    /// client gets `Unavailable` (and retries with the same request id). Below the SDK's
    /// 6 s attempt timeout.
    #[serde(default = "default_forward_timeout_ms")]
    pub forward_timeout_ms: u64,
    /// How often the proxy logs its counters (0: never).
    #[serde(default = "default_stats_interval_ms")]
    pub stats_interval_ms: u64,
    /// Connections at once, handshakes included; more are refused before their
    /// handshake. At least `max_clients`, so that clients past `max_clients` are told
    /// `Unavailable` rather than refused.
    #[serde(default = "default_connections_max")]
    pub connections_max: usize,
    /// Of those, from one source IP address.
    #[serde(default = "default_connections_per_source_max")]
    pub connections_per_source_max: usize,
    /// Bytes the requests of one client connection may hold at once while they are read,
    /// decoded and answered; a connection that reaches it waits.
    #[serde(default = "default_client_connection_bytes_max")]
    pub client_connection_bytes_max: usize,
    /// Connections, requests in flight and sessions per client identity here (the
    /// replicas count the same for the requests this proxy forwards; `[per_identity]`,
    /// `[per_identity.identities."lock://client/NAME"]`).
    #[serde(default)]
    pub per_identity: wire::quota::QuotaConfig,
    /// The metrics endpoint (`[metrics] listen = "host:port"`; off by default).
    #[serde(default)]
    pub metrics: wire::metrics::MetricsConfig,
}

fn default_keepalive_interval_ms() -> u64 {
    1_000
}
fn default_max_clients() -> usize {
    2_500
}
fn default_max_inflight() -> usize {
    2_048
}
fn default_forward_timeout_ms() -> u64 {
    5_000
}
fn default_stats_interval_ms() -> u64 {
    30_000
}
fn default_connections_max() -> usize {
    3_000
}
fn default_connections_per_source_max() -> usize {
    wire::CONNECTIONS_PER_SOURCE_MAX
}
fn default_client_connection_bytes_max() -> usize {
    wire::CLIENT_CONNECTION_BYTES_MAX
}

impl ProxyConfig {
    /// A configuration with defaults for everything but the addresses and TLS files.
    pub fn new(listen: SocketAddr, replicas: Vec<String>, tls: TlsConfig) -> ProxyConfig {
        ProxyConfig {
            listen,
            replicas,
            tls,
            keepalive_interval_ms: default_keepalive_interval_ms(),
            max_clients: default_max_clients(),
            max_inflight_per_client: default_max_inflight(),
            forward_timeout_ms: default_forward_timeout_ms(),
            stats_interval_ms: default_stats_interval_ms(),
            connections_max: default_connections_max(),
            connections_per_source_max: default_connections_per_source_max(),
            client_connection_bytes_max: default_client_connection_bytes_max(),
            per_identity: Default::default(),
            metrics: Default::default(),
        }
    }

    /// Loads `file` (TOML) with `LOCKSVC_PROXY__*` overrides and validates the result.
    pub fn load(file: Option<&Path>) -> anyhow::Result<ProxyConfig> {
        let mut b = config::Config::builder();
        if let Some(f) = file {
            b = b.add_source(config::File::from(f).format(config::FileFormat::Toml));
        }
        b = b.add_source(
            config::Environment::with_prefix("LOCKSVC_PROXY")
                .prefix_separator("__")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("replicas")
                .try_parsing(true),
        );
        let cfg: ProxyConfig = b.build()?.try_deserialize()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values make sense together.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.replicas.is_empty(), "replicas must name at least one");
        for r in &self.replicas {
            anyhow::ensure!(
                r.rsplit_once(':')
                    .is_some_and(|(_, p)| p.parse::<u16>().is_ok()),
                "replica address {r:?} is not host:port"
            );
        }
        anyhow::ensure!(
            (100..=2_000).contains(&self.keepalive_interval_ms),
            "keepalive_interval_ms must be within 100..=2000 (clients renew every 4 s and \
             wait at most two batch periods)"
        );
        anyhow::ensure!(self.max_clients > 0, "max_clients must be > 0");
        anyhow::ensure!(
            self.max_inflight_per_client > 0,
            "max_inflight_per_client must be > 0"
        );
        self.per_identity.validate().map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            self.connections_max >= self.max_clients,
            "connections_max must be >= max_clients"
        );
        anyhow::ensure!(
            (1..=self.connections_max).contains(&self.connections_per_source_max),
            "connections_per_source_max must be within 1..=connections_max"
        );
        let min = wire::CLIENT_FRAME_BYTES_MAX
            + wire::decode::Limits::for_frame(wire::CLIENT_FRAME_BYTES_MAX).element_bytes_max;
        anyhow::ensure!(
            (min..=u32::MAX as usize).contains(&self.client_connection_bytes_max),
            "client_connection_bytes_max must be within {min}..4 GiB (the largest client \
             frame and what it may decode to)"
        );
        anyhow::ensure!(
            (500..=5_500).contains(&self.forward_timeout_ms),
            "forward_timeout_ms must be within 500..=5500 (below the SDK's 6 s attempt timeout)"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_file_with_defaults_and_rejects_nonsense() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.toml");
        std::fs::write(
            &f,
            r#"
listen = "127.0.0.1:7201"
replicas = ["127.0.0.1:7101", "127.0.0.1:7102"]
[tls]
ca = "ca.pem"
cert = "server.pem"
key = "server.key"
"#,
        )
        .unwrap();
        let cfg = ProxyConfig::load(Some(&f)).unwrap();
        assert_eq!(cfg.keepalive_interval_ms, 1_000);
        assert_eq!(cfg.replicas.len(), 2);
        assert_eq!(cfg.max_clients, 2_500);

        let mut bad = cfg.clone();
        bad.replicas = vec!["nohost".into()];
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("host:port"));
        let mut bad = cfg.clone();
        bad.connections_max = bad.max_clients - 1;
        assert!(bad.validate().is_err());
        let mut bad = cfg.clone();
        bad.client_connection_bytes_max = 1 << 20;
        assert!(bad.validate().is_err());
        let mut bad = cfg.clone();
        bad.keepalive_interval_ms = 10_000;
        assert!(bad.validate().is_err());
        let mut bad = cfg;
        bad.replicas.clear();
        assert!(bad.validate().is_err());
    }

    #[test]
    fn the_example_file_is_valid() {
        let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/proxy.example.toml");
        let cfg = ProxyConfig::load(Some(&f)).unwrap();
        assert_eq!(cfg.replicas.len(), 5);
        assert_eq!(cfg, {
            let mut d = ProxyConfig::new(cfg.listen, cfg.replicas.clone(), cfg.tls.clone());
            d.stats_interval_ms = 30_000;
            d
        });
    }
}
