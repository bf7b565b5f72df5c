//! openraft glue: the log store on fjall, the state-machine store with snapshot files, the
//! QUIC network, the read gate (coalesced leadership checks), and the one alias and
//! helper for openraft's metrics ([`Metrics`], [`leading_term`]).
//!
//! openraft's API is used here, in `wire::raft` (its type configuration and RPC
//! messages), and in three places above: the Raft node actor (`actors/raft_node.rs`:
//! membership changes, leadership announcements), the server's start (`server.rs`:
//! openraft's `Config`) and `errors.rs` (openraft's errors as the wire's). A port to
//! another openraft line touches those and nothing else (the actors' tests build
//! openraft values too).

pub mod binding;
pub mod bootstrap;
pub mod handover;
pub mod log_store;
pub mod mem_log;
pub mod network;
pub mod read_gate;
pub mod sm_store;
pub mod snapshot_file;

/// The Raft handle (`Clone + Send`). openraft 0.10's handle names the state machine too.
pub type Raft = openraft::Raft<wire::raft::TypeConfig, sm_store::SmStore>;

/// openraft's metrics, as [`openraft::Raft::metrics`] hands them out (a tokio watch:
/// `wire::rt::RaftWatch`).
pub type Metrics = tokio::sync::watch::Receiver<openraft::RaftMetrics<wire::raft::TypeConfig>>;

/// The term this replica leads in now by openraft's own view, if it leads.
pub fn leading_term(metrics: &Metrics) -> Option<u64> {
    let m = metrics.borrow();
    (m.state == openraft::ServerState::Leader).then_some(m.current_term)
}
