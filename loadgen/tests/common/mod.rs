//! Reading the JSON reports loadgen writes, shared by the scenario and peer tests.

#![allow(dead_code)]

/// The figure `k` of a report.
pub fn figure(v: &serde_json::Value, k: &str) -> f64 {
    v["figures"][k]
        .as_f64()
        .unwrap_or_else(|| panic!("no figure {k:?} in {v}"))
}

/// The server was asked for its sessions (etcd: leases) at the end, and lost none of
/// loadgen's.
pub fn server_confirms_none_lost(v: &serde_json::Value) {
    assert!(figure(v, "sessions at the server at the end") > 0.0, "{v}");
    assert_eq!(figure(v, "sessions the server confirms lost"), 0.0, "{v}");
}

/// The latency `k` has its failures counted next to it.
pub fn failed(v: &serde_json::Value, k: &str) -> u64 {
    v["latencies"][k]["failed"]
        .as_u64()
        .unwrap_or_else(|| panic!("no failure count next to latency {k:?} in {v}"))
}
