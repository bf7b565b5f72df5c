//! # replica: one Raft member of a lock-service cell
//!
//! # Layout
//!
//! - [`state_machine`]: the replicated namespace, sessions and dedup record. Plain,
//!   deterministic, no I/O.
//! - [`raft`]: openraft glue: the fjall log store with group commit, the state-machine
//!   store with checksummed snapshot files, Raft RPCs over QUIC, and the coalesced
//!   leadership checks (the read gate).
//! - [`leader`]: leader-local volatile state, plain logic over `wire` and std: lease
//!   deadlines, the watch table, the cacher list's holds.
//! - [`actors`]: the Raft node, the session manager, the watch table, the cacher list and
//!   the snapshotter (actix), each driving its logic from [`leader`].
//! - [`gateway`]: the QUIC listener for clients and peers.
//! - [`metrics`]: Prometheus metrics, `/health` and `/ready` on `metrics.listen`.
//! - [`server`]: [`server::run`] starts everything and stops on a shutdown future.
//! - [`config`]: the documented configuration.
//!
//! # What is logged
//!
//! Session create/close/expire, lease checkpoints, node writes (create, delete, set data,
//! transactions) and no-ops. Never: KeepAlives, reads, watch registrations.

pub mod actors;
pub mod backup;
pub mod config;
pub mod errors;
pub mod gateway;
pub mod leader;
pub mod metrics;
pub mod raft;
pub mod server;
pub mod state_machine;
