//! The operations crate's library part: what the fault-injection suite shares between its
//! tiers (histories and checkers), the network-namespace test hosts and the suite that runs
//! real processes on them. The `lockctl` binary lives in `main.rs`, `faultsuite` in
//! `bin/faultsuite.rs`.

pub mod checkers;
pub mod netns;
pub mod sim;
pub mod suite;
