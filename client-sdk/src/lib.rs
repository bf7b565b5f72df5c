//! # client-sdk: talk to a lock-service cell
//!
//! # Layout
//!
//! - [`Client`]: QUIC connections to the cell's replicas, leader discovery and retries of
//!   requests whose outcome is unknown (with the same request id, so the cell's dedup
//!   makes a retry safe).
//! - [`Session`]: one session with its KeepAlive loop, local lease clock and state
//!   ([`SessionState`]: healthy, jeopardy, expired), and the node operations.
//!
//! A [`Client`] and its sessions talk to one cell. A [`Router`] spans many: it resolves
//! each path's cell through the directory (`docs/directory.md`), keeps one client and
//! one session per cell it uses, and hands each operation to that cell's session;
//! nothing below it changes.
//!
//! ```no_run
//! # async fn demo() -> Result<(), client_sdk::Error> {
//! use client_sdk::{Client, ClientConfig, CreateMode};
//! let client = Client::connect(ClientConfig::new(
//!     vec!["127.0.0.1:7101".into()],
//!     "cell-data/tls/ca.pem".into(),
//! ))
//! .await?;
//! let session = client.open_session().await?;
//! let created = session.create("/config", b"v1".to_vec(), CreateMode::default()).await?;
//! println!("created {} with token {}", created.path, created.stat.token);
//! session.close().await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod cache;
mod client;
pub mod fencing;
pub mod recipes;
mod router;
mod session;
mod watch;

pub use cache::CacheStats;
pub use client::{Client, ClientConfig, Security, SESSIONS_PER_CLIENT_MAX};
pub use recipes::lock::{Lock, LockGuard, Sequencer};
pub use router::{
    Router, RouterConfig, RouterEvent, RouterStats, DIRECTORY_TIMEOUT, ROUTE_ATTEMPTS,
    UNKNOWN_PREFIX_REFETCH,
};
pub use session::{Created, Session, SessionEvent, SessionState};
pub use watch::Watch;
pub use wire::types::{
    CreateMode, EventType, NodeStat, Predecessor, Reply, Status, TxnOp, TxnResult, WatchEvent,
    WatchKind,
};
pub use wire::Error;
