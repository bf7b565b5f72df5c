//! The proxy tier of the lock service.
//!
//! A proxy terminates up to a few thousand client connections and speaks exactly the
//! replicas' client protocol, so the SDK cannot tell it from a replica. Toward the cell it
//! is one well-behaved client:
//!
//! - **KeepAlives** from all its clients go to the leader as one `KeepAliveBatch` per
//!   interval (1 s); each client is answered only after the leader renewed it. The client's
//!   lease clock started at its own send, so it stays conservative.
//! - **Writes and reads** are forwarded with the client's session and request ids; the
//!   proxy follows leader changes and resends unanswered requests (the cell deduplicates).
//! - **Cached reads** are served from the proxy's cache; the proxy is one cacher at the
//!   leader and relays each invalidation only to the clients that hold the node.
//! - **Watches**: one upstream watch per (node, kind), fanned out to every client.
//!
//! It keeps nothing that cannot be rebuilt: kill it, and its clients carry on through
//! another proxy with the same sessions, locks and watches. See [`hub`] for the rules.

#![warn(missing_docs)]

pub mod config;
pub mod hub;
pub mod metrics;
pub mod server;
pub mod upstream;

pub use config::ProxyConfig;
pub use server::{run, run_until_signal};
