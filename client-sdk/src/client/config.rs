//! How to reach a cell: endpoints, CA and certificate, timeouts, cache and session limits.

use std::path::PathBuf;
use std::time::Duration;

/// The default grace period: how long a session in jeopardy keeps trying before it gives
/// up (see [`ClientConfig::grace_period`]).
pub const GRACE_PERIOD: Duration = Duration::from_secs(45);

/// How to reach a cell.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Replica and/or proxy addresses, `host:port` (a proxy speaks the same protocol; the
    /// client moves to the next endpoint when one fails).
    pub endpoints: Vec<String>,
    /// The cell's CA certificate (PEM): the servers' certificates must chain to it.
    pub ca: PathBuf,
    /// This client's certificate (PEM), which proves its identity to the cell (every
    /// connection is mutual TLS): `lock://client/<name>` (`lockctl certs issue --role
    /// client`). Default: [`wire::tls::CLIENT_CERT_FILE`] next to the CA file.
    pub cert: PathBuf,
    /// The certificate's private key (PEM). Default: [`wire::tls::CLIENT_KEY_FILE`] next
    /// to the CA file.
    pub key: PathBuf,
    /// How long one operation may take, retries included, before it fails with
    /// [`wire::Error::Timeout`] (default 15 s).
    pub request_timeout: Duration,
    /// How long one attempt waits for an answer (default 6 s, above the replicas' own
    /// 5 s commit timeout); never past the call's [`ClientConfig::request_timeout`].
    pub attempt_timeout: Duration,
    /// How long a connection attempt (QUIC handshake and hello) may take (default 1 s): a
    /// dead replica is skipped quickly instead of holding up the request.
    pub connect_timeout: Duration,
    /// How long a probe of a silent server may go unanswered before its connection is
    /// given up and its requests move on (default 1 s). A request's server is probed once
    /// nothing at all has arrived from it for a second; meanwhile the client asks the
    /// cell's other replicas who leads, and moves to one that leads in the newest term
    /// they report without waiting for the probe (see `docs/client.md`, "Fail-over").
    pub probe_timeout: Duration,
    /// How long a session in jeopardy keeps trying to reach the cell before it gives up
    /// and reports itself expired (Chubby's grace period; default 45 s).
    pub grace_period: Duration,
    /// Most values one session caches (default 10 000).
    pub cache_entries_max: usize,
    /// Most bytes of data one session caches (default 64 MiB).
    pub cache_bytes_max: usize,
    /// Agent string sent in the hello.
    pub agent: String,
    /// Most sessions this client holds open at once (default and upper bound
    /// [`SESSIONS_PER_CLIENT_MAX`]); opening one more fails with
    /// [`wire::Error::TooManySessions`].
    pub sessions_max: usize,
    /// The UDP sockets the client's QUIC endpoint runs on (default: the operating
    /// system's; the fault suite's simulation passes simulated ones).
    pub sockets: wire::quic::Sockets,
    /// Certificate revocation lists (PEM) the servers' certificates are checked against
    /// (default none); re-read with the other files when they change.
    pub crls: Vec<PathBuf>,
    /// Retry a request refused by the server's limit on the identity's requests in
    /// flight (`Error::TooManyFor`), with backoff, until the request's deadline (the
    /// default); a proxy sets it false and passes the refusal to its client, who retries.
    pub retry_limit_refusals: bool,
    /// The endpoints are directory instances (`lock://directory/<name>` certificates),
    /// not a cell's replicas or proxies (default false): what [`crate::Router`] uses to
    /// fetch the map of prefixes to cells.
    pub directory: bool,
    /// The cell the endpoints belong to, if known (default none): each server's
    /// certificate must then be a replica's or a proxy's of this cell. The
    /// [`crate::Router`] sets it to the cell the directory names.
    pub cell: Option<String>,
}

/// Most sessions one client holds open: each keeps an event stream open on the client's
/// connection, which has [`wire::quic::STREAMS_MAX`] (4 096) streams in all, and the rest
/// (1 024) stay free for requests. With every stream taken by event streams no request
/// could be sent, not even the sessions' KeepAlives, and they would all expire.
pub const SESSIONS_PER_CLIENT_MAX: usize = wire::quic::STREAMS_MAX as usize - 1_024;

/// The endpoints of a local `lockctl dev` cell.
pub const DEV_ENDPOINTS: &str =
    "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103,127.0.0.1:7104,127.0.0.1:7105";

impl ClientConfig {
    /// From the environment shared with `lockctl`: `LOCKCTL_ENDPOINTS` (comma-separated,
    /// default: the local dev cell), `LOCKCTL_CA` (default `cell-data/tls/ca.pem`), and
    /// `LOCKCTL_CERT` and `LOCKCTL_KEY` (default: `client.pem` and `client.key` next to
    /// the CA).
    pub fn from_env() -> ClientConfig {
        let endpoints = std::env::var("LOCKCTL_ENDPOINTS").unwrap_or_else(|_| DEV_ENDPOINTS.into());
        let ca = std::env::var("LOCKCTL_CA").unwrap_or_else(|_| "cell-data/tls/ca.pem".into());
        let mut cfg = ClientConfig::new(
            endpoints
                .split(',')
                .map(|e| e.trim().to_string())
                .filter(|e| !e.is_empty())
                .collect(),
            ca.into(),
        );
        if let Ok(cert) = std::env::var("LOCKCTL_CERT") {
            cfg.cert = cert.into();
        }
        if let Ok(key) = std::env::var("LOCKCTL_KEY") {
            cfg.key = key.into();
        }
        cfg
    }

    /// Defaults for the given endpoints and CA file; the client's certificate and key are
    /// taken from the CA's directory ([`wire::tls::CLIENT_CERT_FILE`],
    /// [`wire::tls::CLIENT_KEY_FILE`]), as `lockctl dev` and `lockctl certs` write them.
    pub fn new(endpoints: Vec<String>, ca: PathBuf) -> ClientConfig {
        let dir = ca.parent().map(|d| d.to_path_buf()).unwrap_or_default();
        ClientConfig {
            endpoints,
            cert: dir.join(wire::tls::CLIENT_CERT_FILE),
            key: dir.join(wire::tls::CLIENT_KEY_FILE),
            ca,
            request_timeout: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(6),
            connect_timeout: Duration::from_secs(1),
            probe_timeout: Duration::from_secs(1),
            grace_period: GRACE_PERIOD,
            cache_entries_max: 10_000,
            cache_bytes_max: 64 * 1024 * 1024,
            agent: format!("client-sdk {}", env!("CARGO_PKG_VERSION")),
            sessions_max: SESSIONS_PER_CLIENT_MAX,
            sockets: wire::quic::Sockets::Os,
            crls: Vec::new(),
            retry_limit_refusals: true,
            directory: false,
            cell: None,
        }
    }
}
