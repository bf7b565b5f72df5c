//! Mapping openraft's errors to the client's typed [`wire::Error`].

use openraft::error::{ClientWriteError, LinearizableReadError, RaftError};
use wire::raft::TypeConfig;
use wire::Error;

fn not_leader(f: openraft::error::ForwardToLeader<TypeConfig>) -> Error {
    Error::NotLeader {
        leader_id: f.leader_id,
        leader_addr: f.leader_node.map(|n| n.addr),
    }
}

/// From a failed `ensure_linearizable`.
pub fn from_check_leader(e: RaftError<TypeConfig, LinearizableReadError<TypeConfig>>) -> Error {
    match e {
        RaftError::APIError(LinearizableReadError::ForwardToLeader(f)) => not_leader(f),
        RaftError::APIError(LinearizableReadError::QuorumNotEnough(q)) => Error::Unavailable {
            reason: format!("no quorum: {q}"),
        },
        RaftError::Fatal(f) => Error::Unavailable {
            reason: format!("raft stopped: {f}"),
        },
    }
}

/// From a `client_write_ff` answer that failed.
pub fn from_client_write_error(e: ClientWriteError<TypeConfig>) -> Error {
    from_client_write(RaftError::APIError(e))
}

/// From a failed `client_write` / membership change.
pub fn from_client_write(e: RaftError<TypeConfig, ClientWriteError<TypeConfig>>) -> Error {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => not_leader(f),
        // openraft 0.10 tells an entry discarded by a new leader's log apart from one never
        // appended; 0.9 answered both `ForwardToLeader`, and so do we (the proposer's
        // answer is the same as before: not the leader, outcome unknown to it).
        RaftError::APIError(ClientWriteError::LogEntryDiscarded(f)) => not_leader(f),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => Error::Membership {
            reason: c.to_string(),
        },
        // We attach no preconditions to writes.
        RaftError::APIError(ClientWriteError::PreconditionFailed(p)) => Error::Unavailable {
            reason: format!("write refused: {p}"),
        },
        RaftError::Fatal(f) => Error::Unavailable {
            reason: format!("raft stopped: {f}"),
        },
    }
}
