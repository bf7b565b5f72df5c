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

/// Concurrent bidirectional streams a client may open on a `lockservice-client`
/// connection: one per request in flight, plus one event stream per session. Measured:
/// raising it to 65 536 made quinn ~8x slower per request (lock hand-off p50 15 ms →
/// 120 ms), so it stays at 4 096; a process that multiplexes more sessions opens more
/// connections (the proxy tier will multiplex them). Opening a stream beyond the limit
/// waits for one to finish rather than failing. A server grants it once the connection's
/// ALPN is known ([`grant_streams`]); until then, and on peer connections, the limit is
/// [`PEER_STREAMS_MAX`].
pub const STREAMS_MAX: u32 = 4_096;

/// Concurrent bidirectional streams a server grants a connection before its ALPN is
/// known, and a `lockservice-peer` connection for good: a peer's client makes one RPC at
/// a time on its own connection (openraft's replication, votes and leadership checks each
/// have a client), so 64 leaves room for the streams still closing.
pub const PEER_STREAMS_MAX: u32 = 64;

/// Bytes a sender may have in flight on one stream beyond what the receiver has read:
/// QUIC's per-stream flow-control window (quinn's default is 1.25 MB). 1 MiB keeps a
/// stream at over 1 GB/s on a 1 ms round trip.
pub const STREAM_RECEIVE_WINDOW_BYTES: u32 = 1024 * 1024;

/// Bytes a sender may have in flight on one connection, all streams together, beyond what
/// the receiver has read: QUIC's connection flow-control window. quinn's default is
/// unlimited, so 4 096 streams could each park their 1.25 MB window unread in quinn's
/// buffers, 5 GB per connection. Frames are read as they arrive (within the connection's
/// frame budget, `wire::frame::Budget`), so this only bounds what waits in quinn.
pub const CONNECTION_RECEIVE_WINDOW_BYTES: u32 = 8 * 1024 * 1024;

/// Which end of connections an endpoint's transport parameters are for.
#[derive(Clone, Copy)]
enum Role {
    /// Accepts connections (a replica, a proxy).
    Server,
    /// Dials them (a client, a proxy upstream, a replica dialing a peer).
    Client,
}

fn transport(role: Role) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    // Streams the other side may open. Nothing in the service opens a stream toward the
    // side that dialed, or a unidirectional stream, or sends a datagram: granting none
    // means a remote party cannot make this end buffer any.
    t.max_concurrent_bidi_streams(match role {
        Role::Server => PEER_STREAMS_MAX.into(),
        Role::Client => 0u32.into(),
    });
    t.max_concurrent_uni_streams(0u32.into());
    t.datagram_receive_buffer_size(None);
    t.stream_receive_window(STREAM_RECEIVE_WINDOW_BYTES.into());
    t.receive_window(CONNECTION_RECEIVE_WINDOW_BYTES.into());
    t.keep_alive_interval(Some(Duration::from_millis(KEEP_ALIVE_MS)));
    t.max_idle_timeout(Some(
        Duration::from_millis(IDLE_TIMEOUT_MS)
            .try_into()
            .expect("idle"),
    ));
    Arc::new(t)
}

/// Grants an accepted connection the streams its ALPN needs: [`STREAMS_MAX`] on a
/// `lockservice-client` connection; a peer connection keeps [`PEER_STREAMS_MAX`]. Call it
/// once the handshake is done, before accepting the hello stream.
pub fn grant_streams(conn: &quinn::Connection) {
    if alpn(conn).as_deref() == Some(crate::hello::ALPN_CLIENT) {
        conn.set_max_concurrent_bi_streams(STREAMS_MAX.into());
    }
}

/// The ALPN protocol a connection negotiated.
pub fn alpn(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()
        .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|h| h.protocol)
}

/// Limits on the connections a server accepts (see [`ConnectionGate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once, handshakes included.
    pub connections_max: usize,
    /// Of those, from one source IP address.
    pub connections_per_source_max: usize,
}

/// Counts a server's connections, in total and per source address, and refuses an
/// incoming one beyond [`ConnectionLimits`] before its handshake (no TLS work is done for
/// it; the client sees the connection refused). What one connection may make the server
/// hold is bounded (streams, flow-control windows, the frame budget), so these make the
/// whole bounded: the process holds at most `connections_max` times that.
#[derive(Clone)]
pub struct ConnectionGate {
    limits: ConnectionLimits,
    inner: Arc<std::sync::Mutex<GateState>>,
}

#[derive(Default)]
struct GateState {
    total: usize,
    per_source: std::collections::HashMap<std::net::IpAddr, usize>,
    refused: u64,
}

/// A connection admitted by a [`ConnectionGate`]; it stops counting when dropped.
pub struct Admitted {
    gate: ConnectionGate,
    source: std::net::IpAddr,
}

impl ConnectionGate {
    /// A gate with these limits.
    pub fn new(limits: ConnectionLimits) -> ConnectionGate {
        ConnectionGate {
            limits,
            inner: Arc::default(),
        }
    }

    /// Admits a connection from `source`, or refuses it (`None`) when the server holds
    /// `connections_max` connections, or `connections_per_source_max` from that address.
    /// A refusal is logged, the first one and then at every power of two, so a flood of
    /// them cannot flood the log.
    pub fn admit(&self, source: SocketAddr) -> Option<Admitted> {
        let ip = source.ip().to_canonical();
        let mut st = self.inner.lock().expect("connection gate");
        let from_source = st.per_source.get(&ip).copied().unwrap_or(0);
        let refusal = if st.total >= self.limits.connections_max {
            Some(("connections_max", self.limits.connections_max))
        } else if from_source >= self.limits.connections_per_source_max {
            Some((
                "connections_per_source_max",
                self.limits.connections_per_source_max,
            ))
        } else {
            None
        };
        if let Some((what, limit)) = refusal {
            st.refused += 1;
            if st.refused.is_power_of_two() {
                tracing::warn!(
                    %source, limit, refused = st.refused, open = st.total, from_source,
                    "refused a connection: {what} reached"
                );
            }
            return None;
        }
        st.total += 1;
        *st.per_source.entry(ip).or_default() += 1;
        Some(Admitted {
            gate: self.clone(),
            source: ip,
        })
    }

    /// Connections admitted and still open.
    pub fn open(&self) -> usize {
        self.inner.lock().expect("connection gate").total
    }

    /// Connections refused since the gate was made.
    pub fn refused(&self) -> u64 {
        self.inner.lock().expect("connection gate").refused
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut st = self.gate.inner.lock().expect("connection gate");
        st.total -= 1;
        if let Some(n) = st.per_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                st.per_source.remove(&self.source);
            }
        }
    }
}

/// Accepts a connection's hello stream and reads its hello, within
/// [`crate::frame::HELLO_DEADLINE_MS`] of the call (made right after the handshake);
/// `None`, the connection closed and a line logged, if it does not come in time.
pub async fn accept_hello(
    conn: &quinn::Connection,
) -> Option<(quinn::SendStream, Result<crate::hello::Hello, crate::Error>)> {
    use crate::frame;
    let hello = async {
        let (send, mut recv) = conn.accept_bi().await.ok()?;
        let hello = frame::read(&mut recv, frame::HELLO_BYTES_MAX).await;
        Some((send, hello))
    };
    let deadline = Duration::from_millis(frame::HELLO_DEADLINE_MS);
    match tokio::time::timeout(deadline, hello).await {
        Ok(h) => h,
        Err(_) => {
            let err = crate::Error::LimitExceeded {
                bound: crate::Bound::HelloDeadline,
                limit: frame::HELLO_DEADLINE_MS,
            };
            tracing::info!(remote = %conn.remote_address(), "closed a connection: {err}");
            conn.close(3u32.into(), b"no hello in time");
            None
        }
    }
}

/// Writes `msg` as the one answer frame of a stream and finishes it, within
/// [`crate::frame::FRAME_DEADLINE_MS`]: a remote party that stops reading gets the stream
/// reset instead of holding the answer (and what its request reserved) for ever. An answer
/// too large for `max_bytes` is replaced by its error.
pub async fn answer<T: serde::Serialize>(
    mut send: quinn::SendStream,
    msg: &Result<T, crate::Error>,
    max_bytes: usize,
) {
    use crate::frame;
    let buf = match frame::encode(msg, max_bytes) {
        Ok(buf) => buf,
        Err(e) => frame::encode(&Result::<T, _>::Err(e), max_bytes).expect("an error fits"),
    };
    let deadline = Duration::from_millis(frame::FRAME_DEADLINE_MS);
    match tokio::time::timeout(deadline, send.write_all(&buf)).await {
        Ok(_) => {
            let _ = send.finish();
        }
        Err(_) => {
            let _ = send.reset(4u32.into());
        }
    }
}

/// Logs the first bound a remote party exceeds on one connection, and counts the rest:
/// a connection that opens 4 096 stalled streams logs one line, not 4 096.
#[derive(Default)]
pub struct ExceededLog {
    count: std::sync::atomic::AtomicU64,
}

impl ExceededLog {
    /// Records `err` from `remote` (only [`crate::Error::LimitExceeded`] and
    /// [`crate::Error::FrameTooLarge`] are bounds; other errors are not counted).
    pub fn record(&self, remote: SocketAddr, err: &crate::Error) {
        if !matches!(
            err,
            crate::Error::LimitExceeded { .. } | crate::Error::FrameTooLarge { .. }
        ) {
            return;
        }
        let n = self
            .count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if n == 1 {
            tracing::warn!(%remote, "closed a stream: {err}");
        } else {
            tracing::debug!(%remote, n, "closed a stream: {err}");
        }
    }

    /// Bounds exceeded so far on the connection.
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
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
    server.transport_config(transport(Role::Server));
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
    cfg.transport_config(transport(Role::Client));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_counts_per_source_and_in_total() {
        let gate = ConnectionGate::new(ConnectionLimits {
            connections_max: 3,
            connections_per_source_max: 2,
        });
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let a2: SocketAddr = "10.0.0.1:5001".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:5000".parse().unwrap();
        let c: SocketAddr = "[::ffff:10.0.0.3]:5000".parse().unwrap();
        let first = gate.admit(a).expect("first");
        let _second = gate.admit(a2).expect("second from the same address");
        assert!(
            gate.admit(a).is_none(),
            "a third from one address is refused"
        );
        let _third = gate.admit(b).expect("another address");
        assert!(gate.admit(c).is_none(), "the total is reached");
        assert_eq!((gate.open(), gate.refused()), (3, 2));
        drop(first);
        let _fourth = gate.admit(c).expect("a place was given back");
        assert!(gate.admit("10.0.0.3:1".parse().unwrap()).is_none());
    }
}
