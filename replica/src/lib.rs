//! # replica: one Raft member of a lock-service cell
//!
//! # Layout
//!
//! - [`state_machine`]: the replicated namespace, sessions and dedup record. Plain,
//!   deterministic, no I/O.
//! - [`raft`]: openraft glue: the fjall log store with group commit, the state-machine
//!   store with checksummed snapshot files, and Raft RPCs over QUIC.
//! - [`actors`]: the Raft node, the session manager and the snapshotter (actix).
//! - [`leader`]: leader-local volatile state: lease deadlines and coalesced leadership
//!   checks (later: the watch table and the cacher list).
//! - [`gateway`]: the QUIC listener for clients and peers.
//! - [`server`]: [`server::run`] starts everything and stops on a shutdown future.
//! - [`config`]: the documented configuration.
//!
//! # What is logged
//!
//! Session create/close/expire, lease checkpoints, node writes (create, delete, set data,
//! transactions) and no-ops. Never: KeepAlives, reads, watch registrations.

pub mod actors;
pub mod config;
pub mod errors;
pub mod gateway;
pub mod leader;
pub mod raft;
pub mod server;
pub mod state_machine;
