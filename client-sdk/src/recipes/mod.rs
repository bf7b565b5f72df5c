//! Recipes built from sessions, ephemeral sequential nodes and one-shot watches. Each is a
//! short module over a [`crate::Session`].
//!
//! - [`lock`]: exclusive and shared (read/write) locks with fencing tokens.
//! - [`election`]: leader election with the leader's address in its node.
//! - [`membership`]: a group of ephemeral members, listed with a watch.
//! - [`config`]: values with compare-and-set on the version, and watches.

pub mod config;
pub mod election;
pub mod lock;
pub mod membership;
