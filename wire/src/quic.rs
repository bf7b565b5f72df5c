//! QUIC endpoints shared by every process.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// UDP socket buffer size. With the kernel default (~208 KiB) a burst of handshakes from
/// thousands of clients drops datagrams; 4 MiB is `net.core.rmem_max` on our hosts.
pub const UDP_BUFFER_BYTES: usize = 4 * 1024 * 1024;

/// Idle timeout of a connection: a peer silent this long is considered gone. Short, so a
/// client notices a dead replica well inside its 4 s KeepAlive interval.
pub const IDLE_TIMEOUT_MS: u64 = 3_000;

/// QUIC keep-alive interval; must be below [`IDLE_TIMEOUT_MS`].
pub const KEEP_ALIVE_MS: u64 = 500;

/// Concurrent bidirectional streams a peer may open: one per request in flight, plus one
/// event stream per session. Measured: raising it to 65 536 made quinn ~8x slower per
/// request (lock hand-off p50 15 ms → 120 ms), so it stays at 4 096; a process that
/// multiplexes more sessions opens more connections (the proxy tier will multiplex them).
/// Opening a stream beyond the limit waits for one to finish rather than failing.
pub const STREAMS_MAX: u32 = 4_096;

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(STREAMS_MAX.into());
    t.max_concurrent_uni_streams(256u32.into());
    t.keep_alive_interval(Some(Duration::from_millis(KEEP_ALIVE_MS)));
    t.max_idle_timeout(Some(
        Duration::from_millis(IDLE_TIMEOUT_MS)
            .try_into()
            .expect("idle"),
    ));
    Arc::new(t)
}

fn socket(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let domain = if addr.is_ipv4() {
        socket2::Domain::IPV4
    } else {
        socket2::Domain::IPV6
    };
    let sock = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    // Best effort: the kernel caps these at rmem_max/wmem_max.
    let _ = sock.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(UDP_BUFFER_BYTES);
    sock.bind(&addr.into())?;
    Ok(sock.into())
}

/// Binds the UDP sockets QUIC endpoints run on, in place of the operating system's: a
/// simulated network (the fault suite's deterministic simulation) or any other datagram
/// transport. A process built without one uses real sockets.
pub trait SocketFactory: Send + Sync + 'static {
    /// A socket bound to `addr` (port 0: any free port).
    fn bind(&self, addr: SocketAddr) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>>;

    /// Adjusts the configuration of the next endpoint made on this factory's sockets; a
    /// simulation that must replay exactly seeds the endpoint's randomness here (its
    /// random number generator, its connection ids). The default changes nothing.
    fn configure(&self, config: &mut quinn::EndpointConfig) {
        let _ = config;
    }
}

/// Which sockets an endpoint uses: the operating system's, or a [`SocketFactory`]'s.
#[derive(Clone, Default)]
pub enum Sockets {
    /// Real UDP sockets.
    #[default]
    Os,
    /// Sockets from a factory.
    Factory(Arc<dyn SocketFactory>),
}

impl std::fmt::Debug for Sockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sockets::Os => f.write_str("Os"),
            Sockets::Factory(_) => f.write_str("Factory"),
        }
    }
}

/// The shortest time between two stateless resets from an endpoint with [`StableReset`]
/// keys: none (quinn's default is 20 ms; see [`StableReset`]).
pub const RESET_INTERVAL_MIN: Duration = Duration::ZERO;

/// What a server endpoint needs to send a stateless reset that a client of its previous
/// process accepts: derived from a secret (the server's TLS private key file) and the
/// server's identity (a replica's id and advertised address, a proxy's listen address),
/// so it is the same each time the same server starts again.
///
/// QUIC lets an endpoint that lost a connection's state (its process was killed and
/// restarted) tell the other side at once, with a stateless reset carrying the token it
/// gave out for that connection id: the other side closes the connection instead of
/// sending into it until its idle timeout. The token is an HMAC of the connection id, so
/// a restarted process can only send a valid one if it signs with its predecessor's key;
/// and quinn only answers packets for connection ids its id generator could have issued,
/// which it checks with a keyed hash. quinn draws both keys at random per process; here
/// both come from `HMAC-SHA256(secret, label + identity)`, so nobody without the private
/// key can forge a reset, and servers sharing a certificate but not an identity have
/// different keys. Rotating the TLS key (or rewriting its file) changes them: connections
/// made before such a restart end by idle timeout, as they would with random keys.
///
/// quinn sends at most one reset per `min_reset_interval`, 20 ms by default: after a
/// restart the old connections' packets arrive in bursts (their retransmissions and
/// keep-alives are timed alike), so most of a proxy's thousands of clients, or even 200
/// (`wire/tests/stateless_reset.rs`), would be left to their idle timeout. Endpoints with
/// these keys answer every such packet. A reset is always shorter than the packet that
/// provoked it, and a packet whose connection id this endpoint could not have issued (its
/// id generator's keyed hash says so) gets none, so this amplifies nothing and two
/// endpoints cannot reset each other in a loop.
#[derive(Clone)]
pub struct StableReset {
    reset_key: Arc<dyn quinn::crypto::HmacKey>,
    cid_key: u64,
}

impl StableReset {
    /// The keys of the server named `identity` whose secret is `secret`.
    pub fn derive(secret: &[u8], identity: &str) -> StableReset {
        let master = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let derive = |what: &str| {
            let label = format!("lockservice {what} v1 {identity}");
            ring::hmac::sign(&master, label.as_bytes())
        };
        let reset = derive("stateless reset");
        let cid = derive("connection ids");
        let mut cid_key = [0u8; 8];
        cid_key.copy_from_slice(&cid.as_ref()[..8]);
        StableReset {
            reset_key: Arc::new(ring::hmac::Key::new(
                ring::hmac::HMAC_SHA256,
                reset.as_ref(),
            )),
            cid_key: u64::from_le_bytes(cid_key),
        }
    }

    /// [`StableReset::derive`] with the bytes of the server's TLS private key file at
    /// `key_path` as the secret.
    pub fn from_key_file(
        key_path: &std::path::Path,
        identity: &str,
    ) -> Result<StableReset, String> {
        let secret =
            std::fs::read(key_path).map_err(|e| format!("read {}: {e}", key_path.display()))?;
        Ok(StableReset::derive(&secret, identity))
    }

    fn apply(&self, config: &mut quinn::EndpointConfig) {
        config.reset_key(self.reset_key.clone());
        config.min_reset_interval(RESET_INTERVAL_MIN);
        let key = self.cid_key;
        config.cid_generator(move || {
            Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(key))
        });
    }
}

impl std::fmt::Debug for StableReset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StableReset(..)")
    }
}

fn endpoint(
    sockets: &Sockets,
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
    reset: Option<StableReset>,
) -> Result<quinn::Endpoint, String> {
    let runtime = crate::rt::quic_runtime().ok_or("no async runtime")?;
    let mut config = quinn::EndpointConfig::default();
    if let Some(r) = reset {
        r.apply(&mut config);
    }
    match sockets {
        Sockets::Os => {
            let sock = socket(addr).map_err(|e| format!("bind {addr}: {e}"))?;
            quinn::Endpoint::new(config, server, sock, runtime)
        }
        Sockets::Factory(f) => {
            let sock = f.bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
            f.configure(&mut config);
            quinn::Endpoint::new_with_abstract_socket(config, server, sock, runtime)
        }
    }
    .map_err(|e| format!("endpoint on {addr}: {e}"))
}

/// A QUIC endpoint that accepts connections on `addr` with `tls`, and can also dial out
/// with `client_tls` if given.
pub fn server_endpoint(
    addr: SocketAddr,
    tls: rustls::ServerConfig,
    client_tls: Option<rustls::ClientConfig>,
) -> Result<quinn::Endpoint, String> {
    server_endpoint_on(&Sockets::Os, addr, tls, client_tls, None)
}

/// [`server_endpoint`] on `sockets`, with `reset`'s keys if given, so that clients of a
/// previous process at `addr` are reset at once (see [`StableReset`]; quinn's default keys
/// are random per process).
pub fn server_endpoint_on(
    sockets: &Sockets,
    addr: SocketAddr,
    tls: rustls::ServerConfig,
    client_tls: Option<rustls::ClientConfig>,
    reset: Option<StableReset>,
) -> Result<quinn::Endpoint, String> {
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(transport());
    let mut ep = endpoint(sockets, addr, Some(server), reset)?;
    if let Some(c) = client_tls {
        ep.set_default_client_config(client_config(c)?);
    }
    Ok(ep)
}

/// A client-only QUIC endpoint on an ephemeral loopback-or-any port.
pub fn client_endpoint(
    tls: rustls::ClientConfig,
    bind: SocketAddr,
) -> Result<quinn::Endpoint, String> {
    client_endpoint_on(&Sockets::Os, tls, bind)
}

/// [`client_endpoint`] on `sockets`.
pub fn client_endpoint_on(
    sockets: &Sockets,
    tls: rustls::ClientConfig,
    bind: SocketAddr,
) -> Result<quinn::Endpoint, String> {
    let mut ep = endpoint(sockets, bind, None, None).map_err(|e| format!("client {e}"))?;
    ep.set_default_client_config(client_config(tls)?);
    Ok(ep)
}

/// A quinn client configuration from a rustls one.
pub fn client_config(tls: rustls::ClientConfig) -> Result<quinn::ClientConfig, String> {
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(transport());
    if crate::tls::random_fixed() {
        // quinn draws each connection's initial destination id (20 bytes, as it does)
        // from the operating system; a simulation seeds it (see `tls::fix_random`).
        cfg.initial_dst_cid_provider(Arc::new(|| {
            let b = crate::tls::seeded_bytes(20).unwrap_or_else(|| vec![0; 20]);
            quinn::ConnectionId::new(&b)
        }));
    }
    Ok(cfg)
}
