//! Mapping openraft's errors to the client's typed [`wire::Error`].

use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use wire::raft::NodeId;
use wire::Error;

type Node = openraft::BasicNode;

fn not_leader(f: openraft::error::ForwardToLeader<NodeId, Node>) -> Error {
    Error::NotLeader {
        leader_id: f.leader_id,
        leader_addr: f.leader_node.map(|n| n.addr),
    }
}

/// From a failed `ensure_linearizable`.
pub fn from_check_leader(e: RaftError<NodeId, CheckIsLeaderError<NodeId, Node>>) -> Error {
    match e {
        RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)) => not_leader(f),
        RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(q)) => Error::Unavailable {
            reason: format!("no quorum: {q}"),
        },
        RaftError::Fatal(f) => Error::Unavailable {
            reason: format!("raft stopped: {f}"),
        },
    }
}

/// From a `client_write_ff` answer that failed.
pub fn from_client_write_error(e: ClientWriteError<NodeId, Node>) -> Error {
    from_client_write(RaftError::APIError(e))
}

/// From a failed `client_write` / membership change.
pub fn from_client_write(e: RaftError<NodeId, ClientWriteError<NodeId, Node>>) -> Error {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => not_leader(f),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => Error::Membership {
            reason: c.to_string(),
        },
        RaftError::Fatal(f) => Error::Unavailable {
            reason: format!("raft stopped: {f}"),
        },
    }
}
