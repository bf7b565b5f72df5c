//! openraft glue: the log store on fjall, the state-machine store with snapshot files, the
//! QUIC network, and the read gate (coalesced leadership checks). Everything that depends on openraft's API lives here (and in
//! `wire::raft`), so a port to another openraft line stays contained.

pub mod log_store;
pub mod mem_log;
pub mod network;
pub mod read_gate;
pub mod sm_store;
pub mod snapshot_file;

/// The Raft handle (`Clone + Send`).
pub type Raft = openraft::Raft<wire::raft::TypeConfig>;
