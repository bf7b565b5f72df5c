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
//! - [`rt`]: where background tasks are spawned (so the simulation can pause a host).
//! - [`serve`]: the one request loop of every client-protocol server (replicas and
//!   proxies), handing each request to a [`serve::Handler`] with its [`serve::Caller`].
//! - `metrics` (feature `metrics`): the servers' Prometheus metrics, `/health` and
//!   `/ready` over HTTP.
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
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod path;
pub mod quic;
pub mod quota;
#[cfg(feature = "raft")]
pub mod raft;
pub mod rt;
pub mod serve;
pub mod tls;
pub mod types;

pub use error::{Bound, Error};
pub use hello::PROTOCOL_VERSION;
pub use limits::*;
