//! The operations crate's library part: the fault-injection suite ([`faults`]), with its
//! two tiers (network namespaces, simulation), the workloads and checkers they share and
//! the network-namespace test hosts. The `lockctl` binary lives in `main.rs` beside its
//! files (`dev.rs`, `lock.rs`, `fenced.rs`), `faultsuite` in `bin/faultsuite.rs`.

pub mod faults;
