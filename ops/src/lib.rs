//! The operations crate's library part: the fault-injection suite ([`faults`]), with its
//! two tiers (network namespaces, simulation), the workloads and checkers they share and
//! the network-namespace test hosts, and `lockctl dir` ([`dir`], which the simulation's
//! prefix moves run too). The `lockctl` binary lives in `main.rs` beside its
//! files (`dev.rs`, `lock.rs`, `fenced.rs`), `faultsuite` in `bin/faultsuite.rs`.

/// Writes one line to stderr with a single write, so lines from several processes sharing
/// the stream (a `lockctl lock` and its command) never interleave mid-line.
#[doc(hidden)]
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

pub mod dir;
pub mod faults;
