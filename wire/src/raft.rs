//! The openraft type configuration and the replica↔replica messages.
//!
//! All openraft glue types live here and in `replica/src/raft/`, so a later port to
//! another openraft line stays contained.

use std::io::Cursor;

use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};

use crate::command::{Command, CommandOutput};

openraft::declare_raft_types!(
    /// The cell's Raft types: log entries are [`Command`]s, apply returns [`CommandOutput`].
    pub TypeConfig:
        D = Command,
        R = CommandOutput,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = crate::rt::RaftRuntime,
);

/// A Raft node id.
pub type NodeId = u64;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// A log id.
pub type LogId = openraft::LogId<NodeId>;
/// Snapshot metadata.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, openraft::BasicNode>;
/// A stored membership.
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;

/// One RPC from a replica to a peer.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Replicate entries or heartbeat.
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    /// Ask for a vote.
    Vote(VoteRequest<NodeId>),
    /// One chunk of a snapshot.
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// What do you hold? Asked by a replica about to initialize a new cell, which does so
    /// only if no other member already holds one. Answered with [`PeerResponse::Probe`];
    /// a replica built before this request answers `Refused` (it does not decode).
    Probe,
}

/// The answer to a [`PeerRequest`].
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerResponse {
    /// Answer to `AppendEntries`.
    AppendEntries(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    /// Answer to `Vote`.
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    /// Answer to `InstallSnapshot`.
    InstallSnapshot(
        Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>,
    ),
    /// The request could not be handled at all (malformed, wrong cell).
    Refused(crate::Error),
    /// Answer to `Probe`.
    Probe(PeerState),
}

/// What a replica holds of a cell, as it answers [`PeerRequest::Probe`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerState {
    /// Whether it holds any Raft state: a vote, a log entry, or a snapshot it was seeded
    /// with (openraft's `is_initialized`). A replica that holds none is empty: it joins
    /// whichever cell contacts it first.
    pub initialized: bool,
    /// Its current term (0 before any election it took part in).
    pub term: u64,
    /// The index of its last log entry or snapshot, if it has one.
    pub last_log_index: Option<u64>,
}
