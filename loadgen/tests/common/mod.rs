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
    server_confirms_lost(v, 0);
}

/// The server was asked for loadgen's sessions (etcd: leases) by id, a lease and more
/// after the run, and no longer holds exactly `k` of them.
pub fn server_confirms_lost(v: &serde_json::Value, k: u64) {
    assert!(figure(v, "sessions at the server at the end") > 0.0, "{v}");
    assert_eq!(
        figure(v, "sessions the server confirms lost"),
        k as f64,
        "{v}"
    );
    let lease: f64 = v["params"]["lease / session timeout (s)"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no lease in {v}"));
    assert!(
        figure(v, "server check: waited after the run (s)") >= lease,
        "the server was asked before a lease had passed: {v}"
    );
}

/// The latency `k` has its failures counted next to it.
pub fn failed(v: &serde_json::Value, k: &str) -> u64 {
    v["latencies"][k]["failed"]
        .as_u64()
        .unwrap_or_else(|| panic!("no failure count next to latency {k:?} in {v}"))
}
