//! Leader-local, volatile state: rebuilt on every leadership change, never replicated.
//! Plain logic over `wire` and std, tested without actors or Raft (the actors in
//! [`crate::actors`] drive it).
//!
//! - [`leases`]: session lease deadlines (the session manager's logic).
//! - [`confirm_watch`]: whether leadership checks are failing for KeepAlives (which stops
//!   the lease clock).
//! - [`watch_table`]: one-shot watches per node and kind (the watch table actor's logic).
//! - [`cachers`]: who caches which node and the holds waiting for them (the cacher list
//!   actor's logic).
//!
//! All of it is lost on fail-over by design: clients re-register watches and flush their
//! caches on the fail-over event. The coalesced leadership checks that feed it live in
//! [`crate::raft::read_gate`], beside the Raft handle they call.

pub mod cachers;
pub mod confirm_watch;
pub mod leases;
pub mod watch_table;
