//! The fault suite (`faultsuite`): the same workloads and checkers run against a cell under
//! injected faults, in two tiers.
//!
//! - [`real`]: five replica processes on real fjall and QUIC, each in a network namespace
//!   of its own ([`netns`]), with a nemesis that kills, pauses, partitions, slows and
//!   replaces them (root, `nftables`, `iproute2`; `faketime` for clock skew).
//! - [`sim`]: the whole cell, and a proxy, in one process on turmoil's simulated network
//!   and clock, so a seed replays the same run datagram for datagram.
//!
//! Both take a [`plan::Plan`] and end in a [`plan::Verdict`]; both run the
//! [`workloads`], which record histories that the [`checkers`] judge (fenced locks,
//! linearizable registers) or check as they go (sessions, ephemerals, watches).

pub mod checkers;
pub mod netns;
pub mod plan;
pub mod real;
pub mod sim;
pub mod workloads;
