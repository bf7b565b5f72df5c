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

fn endpoint(
    sockets: &Sockets,
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, String> {
    let runtime = crate::rt::quic_runtime().ok_or("no async runtime")?;
    match sockets {
        Sockets::Os => {
            let sock = socket(addr).map_err(|e| format!("bind {addr}: {e}"))?;
            quinn::Endpoint::new(quinn::EndpointConfig::default(), server, sock, runtime)
        }
        Sockets::Factory(f) => {
            let sock = f.bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
            let mut config = quinn::EndpointConfig::default();
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
    server_endpoint_on(&Sockets::Os, addr, tls, client_tls)
}

/// [`server_endpoint`] on `sockets`.
pub fn server_endpoint_on(
    sockets: &Sockets,
    addr: SocketAddr,
    tls: rustls::ServerConfig,
    client_tls: Option<rustls::ClientConfig>,
) -> Result<quinn::Endpoint, String> {
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(transport());
    let mut ep = endpoint(sockets, addr, Some(server))?;
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
    let mut ep = endpoint(sockets, bind, None).map_err(|e| format!("client {e}"))?;
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
