//! The first exchange on every connection.
//!
//! The client opens a bidirectional stream, sends a [`Hello`] frame and reads a
//! [`HelloReply`]. A version mismatch is answered with [`crate::Error::ProtocolVersion`]
//! and the connection is closed, so a mismatched client fails at once instead of hanging.

use serde::{Deserialize, Serialize};

use crate::store::StoreId;
use crate::types::ReplicaId;

/// The protocol version spoken by this build. Bumped on any incompatible change: 6 since
/// each create has its own fencing token (`index × 1024 + position`, issue 27): replicas
/// of two builds would apply one entry into two different states, so they refuse each
/// other; 7 since [`crate::types::Status`] has `peer_certificate_checks`; 8 since
/// [`crate::types::Op::Sessions`]; 9 since [`crate::types::Op::Backup`].
/// [`crate::types::Op::Leadership`] came after 9 without a bump: only clients send it,
/// only to find a new leader faster, and a replica of an older build cannot decode it
/// (it answers `Malformed`), which a client takes as no answer;
/// [`crate::types::Op::LeadershipAfter`] likewise (a client asks such a replica
/// [`crate::types::Op::Leadership`] instead). 10 since openraft 0.10:
/// the peer RPCs carry its types (`VoteRequest` has a `leadership_transfer` field, the
/// responses and errors are generic over the type configuration, `RaftError`'s fatal
/// errors changed), snapshots travel whole (`PeerRequest::Snapshot`) instead of in
/// chunks, and a cell must not mix replicas of the two openraft lines (their elections
/// and leases differ), so replicas of 9 and 10 refuse each other at the hello. 11 since
/// each voter is bound to its store in the membership (`wire::raft::Member`, a new
/// openraft `Node` type in every membership entry and snapshot) and a replica's hello
/// answer names its store ([`HelloOk::store`]).
pub const PROTOCOL_VERSION: u32 = 11;

/// ALPN for client (and proxy) connections to a replica.
pub const ALPN_CLIENT: &[u8] = b"lockservice-client";
/// ALPN for replica↔replica Raft traffic.
pub const ALPN_PEER: &[u8] = b"lockservice-peer";

/// The first frame on a connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Free-form description of the sender, for logs ("lockctl 0.1.0", "replica 3").
    pub agent: String,
}

/// The answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloOk {
    /// The server's [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The answering replica (0 for a proxy).
    pub replica_id: ReplicaId,
    /// True when the server is a proxy. A proxy retries the cell itself, so a client stays
    /// with it when a request times out there (the cell is slow, not the proxy), and moves
    /// on only when the proxy is unreachable or says it lost the cell (`Unavailable`).
    pub proxy: bool,
    /// The answering replica's store ([`StoreId`]); `None` from a proxy. A leader or a
    /// candidate counts a peer's answers only if the membership binds the peer to this
    /// store (`wire::raft::Binding`).
    pub store: Option<StoreId>,
}

/// The hello answer frame.
pub type HelloReply = Result<HelloOk, crate::Error>;

impl Hello {
    /// A hello for this build.
    pub fn new(agent: impl Into<String>) -> Self {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            agent: agent.into(),
        }
    }

    /// Checks the version against this build's.
    pub fn check(&self) -> Result<(), crate::Error> {
        if self.protocol_version != PROTOCOL_VERSION {
            return Err(crate::Error::ProtocolVersion {
                client: self.protocol_version,
                server: PROTOCOL_VERSION,
            });
        }
        Ok(())
    }
}
