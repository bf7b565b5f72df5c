//! The openraft type configuration and the replica↔replica messages.
//!
//! All openraft glue types live here and in `replica/src/raft/`, so a later port to
//! another openraft line stays contained.

use openraft::error::RaftError;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use openraft::RaftTypeConfig;
use serde::{Deserialize, Serialize};

use crate::command::{Command, CommandOutput};
pub use crate::store::{Binding, StoreId};

openraft::declare_raft_types!(
    /// The cell's Raft types: log entries are [`Command`]s, apply returns [`CommandOutput`].
    /// The leader id is openraft's default, `leader_id_adv` (term and node id, several
    /// candidates per term, ordered by node id): the flavour 0.9 had without its
    /// `single-term-leader` feature. The snapshot data type is the state machine's
    /// (`RaftStateMachine::SnapshotData`) since openraft 0.10.
    pub TypeConfig:
        D = Command,
        R = CommandOutput,
        NodeId = u64,
        Node = Member,
        AsyncRuntime = crate::rt::RaftRuntime,
);

/// A Raft node id.
pub type NodeId = u64;
/// A leader id (term and node id; also the committed leader id of a log id).
pub type LeaderId = <TypeConfig as RaftTypeConfig>::LeaderId;
/// A vote.
pub type Vote = <TypeConfig as RaftTypeConfig>::Vote;
/// A log entry.
pub type Entry = <TypeConfig as RaftTypeConfig>::Entry;
/// A log id.
pub type LogId = openraft::LogId<LeaderId>;
/// Snapshot metadata (openraft 0.10's has no snapshot id: ours travels beside it, in
/// [`SnapshotOffer::id`] and the replica's snapshot files).
pub type SnapshotMeta = openraft::SnapshotMeta<LeaderId, NodeId, Member>;
/// A stored membership.
pub type StoredMembership = openraft::StoredMembership<LeaderId, NodeId, Member>;

/// A member of the cell as the membership records it (openraft's `Node`): where it is
/// reached, and which store its answers must come from to count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// `host:port` of its peer and client endpoint.
    pub addr: String,
    /// The store it is bound to.
    pub store: Binding,
}

impl Member {
    /// A member at `addr`, bound to nothing yet ([`Binding::Unbound`]).
    pub fn unbound(addr: impl Into<String>) -> Member {
        Member {
            addr: addr.into(),
            store: Binding::Unbound,
        }
    }
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.addr, self.store)
    }
}

/// One RPC from a replica to a peer.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Replicate entries or heartbeat.
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    /// Ask for a vote.
    Vote(VoteRequest<TypeConfig>),
    /// Was one chunk of a snapshot: openraft 0.9's chunked snapshot RPC, which openraft
    /// 0.10's network (`RaftNetworkV2`) no longer has (its types are deprecated stubs
    /// without serde). Never sent since protocol 10 and refused if received; kept, empty,
    /// so that the variants after it keep their places.
    InstallSnapshot,
    /// What do you hold? Asked by a replica about to initialize a new cell, which does so
    /// only if no other member already holds one. Answered with [`PeerResponse::Probe`];
    /// a replica built before this request answers `Refused` (it does not decode).
    Probe,
    /// A whole snapshot, from the leader: this frame, then [`SnapshotOffer::bytes`] bytes of
    /// the snapshot's data on the same stream, raw, after it (a snapshot may be larger
    /// than a frame may be). Answered with [`PeerResponse::Snapshot`].
    Snapshot(SnapshotOffer),
    /// The leader hands its leadership to the request's target (openraft's
    /// `Trigger::transfer_leader`): every voter is told. Answered with
    /// [`PeerResponse::TransferLeader`].
    TransferLeader(TransferLeaderRequest<TypeConfig>),
}

/// The head of a [`PeerRequest::Snapshot`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotOffer {
    /// The sending leader's vote.
    pub vote: Vote,
    /// openraft's metadata of the snapshot.
    pub meta: SnapshotMeta,
    /// Our id of the snapshot (what its file records; a restored backup's starts with
    /// the replica's `SEEDED_ID_PREFIX`).
    pub id: String,
    /// Bytes of data that follow the frame.
    pub bytes: u64,
}

/// The answer to a [`PeerRequest`].
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerResponse {
    /// Answer to `AppendEntries`.
    AppendEntries(Result<AppendEntriesResponse<TypeConfig>, RaftError<TypeConfig>>),
    /// Answer to `Vote`.
    Vote(Result<VoteResponse<TypeConfig>, RaftError<TypeConfig>>),
    /// Was the answer to `InstallSnapshot`; never sent since protocol 10 (kept, empty,
    /// for its place).
    InstallSnapshot,
    /// The request could not be handled at all (malformed, wrong cell).
    Refused(crate::Error),
    /// Answer to `Probe`.
    Probe(PeerState),
    /// Answer to `Snapshot`: the receiver's vote once it installed it (or refused it for a
    /// lower vote).
    Snapshot(Result<SnapshotResponse<TypeConfig>, RaftError<TypeConfig>>),
    /// Answer to `TransferLeader`.
    TransferLeader(Result<TransferLeaderResponse<TypeConfig>, RaftError<TypeConfig>>),
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
