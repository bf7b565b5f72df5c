//! # wire: the vocabulary of the lock service
//!
//! Every byte that crosses a process boundary is defined here, so that replicas, proxies,
//! the directory, the client SDK and the tools agree on one protocol.
//!
//! # Layout
//!
//! - [`types`]: identifiers, node metadata ([`types::NodeStat`]), the client operations
//!   ([`types::Op`]) and their replies ([`types::Reply`]).
//! - [`error`]: [`Error`], the typed errors a client can receive. Each variant names the
//!   problem; none is ever returned for a request that changed state, except where the
//!   variant says so.
//! - `command` (feature `raft`): `command::Command`, the entries of the replicated log.
//! - `raft` (feature `raft`): the openraft type configuration and the replica↔replica
//!   RPC messages. Only replicas enable the feature, so clients and proxies do not
//!   compile openraft.
//! - [`frame`]: length-prefixed postcard frames, read within bounds (size, time, bytes per
//!   connection); [`decode`]: postcard decoding bounded in depth and in what it builds.
//! - [`hello`]: the first exchange on every connection, carrying [`PROTOCOL_VERSION`].
//! - [`store`]: store ids and the membership's binding of each member to its store.
//! - [`rt`]: where background tasks are spawned (so the simulation can pause a host).
//! - [`serve`]: the one request loop of every client-protocol server (replicas and
//!   proxies), handing each request to a [`serve::Handler`] with its [`serve::Caller`].
//! - `metrics` and `logs` (feature `server`): the servers' Prometheus metrics, `/health`
//!   and `/ready` over HTTP, and their logging (text or JSON lines).
//! - [`latency`]: per-request-kind latency histograms a server reports in its status.
//! - [`tls`] and [`quic`]: certificates (with feature `dev-ca`, a development CA built
//!   with rcgen) and QUIC endpoint construction shared by every process; [`identity`]:
//!   the identity a certificate proves, and which roles may use which connection;
//!   [`acl`]: access control lists (who may read, write, create under and administer a
//!   node) and the rule that applies them.
//!
//! # Encoding rules
//!
//! postcard is positional: enum variants and struct fields may only be appended, never
//! reordered or removed, and a change that breaks that rule bumps [`PROTOCOL_VERSION`].

#![warn(missing_docs)]

pub mod acl;
#[cfg(feature = "raft")]
pub mod command;
pub mod decode;
pub mod directory;
pub mod error;
pub mod frame;
pub mod hash;
pub mod hello;
pub mod identity;
pub mod latency;
pub mod limits;
#[cfg(feature = "server")]
pub mod logs;
#[cfg(feature = "server")]
pub mod metrics;
pub mod path;
pub mod quic;
pub mod quota;
#[cfg(feature = "raft")]
pub mod raft;
pub mod rt;
pub mod serve;
pub mod store;
pub mod tls;
pub mod types;

pub use error::{Bound, Error};
pub use hello::PROTOCOL_VERSION;
pub use limits::*;

/// Whether `addr` is `host:port` or `ip:port` (IPv6 in brackets): what a replica's member
/// address may be. A name is resolved whenever a peer dials it, so a replica may come
/// back at another IP under the same name (a Kubernetes StatefulSet's pods do).
pub fn is_host_port(addr: &str) -> bool {
    if addr.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return false;
    };
    // A fully qualified name may end in a dot (no search domains are tried for it).
    let host = host.strip_suffix('.').unwrap_or(host);
    port.parse::<u16>().is_ok_and(|p| p > 0)
        && !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn member_addresses_are_host_port() {
        for ok in [
            "127.0.0.1:7001",
            "[::1]:7001",
            "localhost:7001",
            "lockservice-replica-0.lockservice-replica-peers.lockservice.svc.cluster.local:7001",
            "replica-0.peers.lockservice.svc.cluster.local.:7001",
        ] {
            assert!(super::is_host_port(ok), "{ok}");
        }
        for bad in [
            "",
            "localhost",
            "localhost:",
            "localhost:0",
            "localhost:70000",
            ":7001",
            "a..b:7001",
            "-a:7001",
            "a b:7001",
            "::1:7001",
            ".:7001",
        ] {
            assert!(!super::is_host_port(bad), "{bad}");
        }
    }
}
