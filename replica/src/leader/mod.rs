//! Leader-local, volatile state: rebuilt on every leadership change, never replicated.
//!
//! - [`leases`]: session lease deadlines (the session manager's logic).
//! - [`read_gate`]: coalesced leadership checks for linearizable reads and KeepAlives.
//! - [`confirm_watch`]: whether those checks are failing for KeepAlives (which stops the
//!   lease clock).
//!
//! The watch table and the cacher list will live here too: both are lost on fail-over by
//! design (clients re-register watches and flush caches on the fail-over event).

pub mod cachers;
pub mod confirm_watch;
pub mod leases;
pub mod read_gate;
pub mod watch_table;
