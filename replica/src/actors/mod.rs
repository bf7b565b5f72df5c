//! The replica's actors. Each file holds the messages, and a thin actor whose handlers
//! forward to plain logic that is tested without actix.
//!
//! - [`raft_node::RaftNode`]: wraps the openraft handle: proposes commands with a timeout,
//!   changes membership, and reports leadership changes to the session manager.
//! - [`session_manager::SessionManager`]: leader-only lease deadlines
//!   ([`crate::leader::leases`]), KeepAlives, expiries and lease checkpoints.
//! - [`snapshotter::Snapshotter`]: writes snapshot files off the async runtime.
//! - [`backuper::Backuper`]: copies the state to object storage on the leader, on a
//!   schedule and on demand (`crate::backup`).
//!
//! - [`watch_table::WatchTableActor`]: one-shot watches and each session's event stream.
//!
//! - [`cacher_list::CacherListActor`]: who caches which node; holds writes to cached nodes
//!   until every cacher dropped the value. Fed by the same
//!   [`crate::raft::sm_store::Applied`] stream.
//!
//! [`messages`] holds what more than one of them handles (leadership changes, applied
//! effects), so that none imports another for it.

pub mod backuper;
pub mod cacher_list;
pub mod messages;
pub mod raft_node;
pub mod session_manager;
pub mod snapshotter;
pub mod watch_table;
