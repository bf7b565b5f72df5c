//! Recipes built from sessions, ephemeral sequential nodes and one-shot watches. Each is a
//! short module over a [`crate::Session`].
//!
//! - [`lock`]: exclusive and shared (read/write) locks with fencing tokens.

pub mod lock;
