//! Typed errors. Each variant says what went wrong and carries what the client needs to
//! act on it. An error answer means nothing changed, except where a variant says so.

use serde::{Deserialize, Serialize};

use crate::types::{ReplicaId, SessionId};

/// Every error a client or peer can receive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Error {
    /// This replica does not lead; send writes and linearizable reads to `leader_addr`.
    #[error("not the leader (leader: {})", leader_addr.as_deref().unwrap_or("unknown"))]
    NotLeader {
        /// The leader this replica knows of.
        leader_id: Option<ReplicaId>,
        /// Its address.
        leader_addr: Option<String>,
    },
    /// The cell cannot answer now (no quorum, election in progress). The request may or
    /// may not have been applied; retry it with the same request id.
    #[error("cell unavailable: {reason}")]
    Unavailable {
        /// What the replica saw.
        reason: String,
    },
    /// No node at this path.
    #[error("no node at {path}")]
    NoNode {
        /// The path.
        path: String,
    },
    /// A node already exists at this path.
    #[error("node {path} already exists")]
    NodeExists {
        /// The path.
        path: String,
    },
    /// A compare-and-set or compare-and-delete saw another version.
    #[error("version mismatch at {path}: expected {expected}, found {actual}")]
    BadVersion {
        /// The path.
        path: String,
        /// The version the request expected.
        expected: u64,
        /// The node's current version.
        actual: u64,
    },
    /// A node with children cannot be deleted.
    #[error("node {path} has children")]
    NotEmpty {
        /// The path.
        path: String,
    },
    /// Ephemeral nodes cannot have children.
    #[error("parent {path} is ephemeral and cannot have children")]
    EphemeralParent {
        /// The parent path.
        path: String,
    },
    /// The root node cannot be created, deleted or written.
    #[error("the root node cannot be {action}")]
    RootNode {
        /// What was attempted.
        action: String,
    },
    /// A value larger than [`crate::VALUE_BYTES_MAX`].
    #[error("value of {len} bytes exceeds the maximum of {max} bytes")]
    ValueTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A malformed path.
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath {
        /// The path (truncated if very long).
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The session id was never issued by this cell.
    #[error("unknown session {session}")]
    UnknownSession {
        /// The session id.
        session: SessionId,
    },
    /// The session has ended (expired or closed): its ephemeral nodes are gone and a new
    /// session is needed.
    #[error("session {session} has expired or was closed")]
    SessionExpired {
        /// The session id.
        session: SessionId,
    },
    /// This request id is older than the results the cell still remembers for the session.
    /// It was answered before; its result can no longer be returned.
    #[error("request {request_id} of session {session} is older than the dedup window")]
    StaleRequest {
        /// The session.
        session: SessionId,
        /// The request id.
        request_id: u64,
    },
    /// The operation needs a session and none was given.
    #[error("operation requires a session")]
    SessionRequired,
    /// Client and server speak different protocol versions.
    #[error("protocol version mismatch: client speaks {client}, server speaks {server}")]
    ProtocolVersion {
        /// The client's version.
        client: u32,
        /// The server's version.
        server: u32,
    },
    /// A frame longer than the protocol's maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Bytes that do not decode as the expected message.
    #[error("malformed message: {reason}")]
    Malformed {
        /// The decoder's complaint.
        reason: String,
    },
    /// A request arrived before the connection's hello.
    #[error("the connection's first stream must carry a hello")]
    HelloRequired,
    /// A transaction failed at op `index`; nothing was applied.
    #[error("transaction op {index} failed: {error}")]
    TxnFailed {
        /// Position of the failing op.
        index: usize,
        /// Why it failed.
        error: Box<Error>,
    },
    /// A request that is well-formed but not acceptable (e.g. too many transaction ops).
    #[error("bad request: {reason}")]
    BadRequest {
        /// Why.
        reason: String,
    },
    /// A membership change was refused.
    #[error("membership change refused: {reason}")]
    Membership {
        /// Why.
        reason: String,
    },
    /// The client gave up waiting. The request may or may not have been applied.
    #[error("timed out after {after_ms} ms: {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long.
        after_ms: u64,
    },
    /// A connection or stream failed.
    #[error("connection error: {reason}")]
    Connection {
        /// The transport's complaint.
        reason: String,
    },
    /// A replica-side failure that is not the client's fault.
    #[error("internal error: {reason}")]
    Internal {
        /// What happened.
        reason: String,
    },
    /// The session already has [`crate::DEDUP_RESULTS_MAX`] unacknowledged results; the
    /// request was not applied. The SDK never gets here: it keeps its request ids within
    /// the window.
    #[error("session {session} has {max} unacknowledged requests; nothing was applied")]
    TooManyRequests {
        /// The session.
        session: SessionId,
        /// The window.
        max: usize,
    },
    /// The client already holds `max` open sessions, the most one QUIC connection carries
    /// (each session keeps an event stream open on it, and a connection has
    /// [`crate::quic::STREAMS_MAX`] streams); no session was opened. Open another client
    /// for more. Raised by the SDK, never by a server.
    #[error(
        "this client already holds {max} sessions, the most one connection carries (each \
         keeps an event stream open); no session was opened: use another client for more"
    )]
    TooManySessions {
        /// The limit (`ClientConfig::sessions_max`).
        max: usize,
    },
    /// The sender exceeded one of the bounds on what a remote party may make a server
    /// hold (DESIGN.md, safety rule 8): the stream (or connection) that exceeded it is
    /// closed after this answer, and nothing was applied. Every other stream and client
    /// goes on.
    #[error("{bound} exceeded: the limit is {limit}")]
    LimitExceeded {
        /// Which bound.
        bound: Bound,
        /// Its value, in the bound's unit (bytes, milliseconds, levels, connections).
        limit: u64,
    },
    /// The session was opened by another identity: only its owner (directly, or through a
    /// proxy of the cell) may renew, close, acknowledge for, watch under, write under or
    /// read the event stream of a session. Nothing was done.
    #[error("session {session} belongs to another identity: {identity} may not use it")]
    NotSessionOwner {
        /// The session.
        session: SessionId,
        /// The identity that asked (the owner is not named).
        identity: String,
    },
    /// The server already has `limit` requests of this connection in flight (a proxy's
    /// `max_inflight_per_client`); this one was refused before anything was done. Unlike
    /// [`Error::LimitExceeded`] nothing is closed: retry once an answer arrives (the SDK
    /// does, with backoff, until the request's deadline). KeepAlives and acknowledgements
    /// are never refused this way.
    #[error(
        "{limit} requests of this connection are in flight, the server's limit; nothing was \
         done: retry"
    )]
    Busy {
        /// The limit, in requests.
        limit: u64,
    },
    /// The node's ACL does not grant `identity` this right (and it is not a cell admin).
    /// Nothing was done.
    #[error("{identity} may not {right} {path}: its ACL does not grant it")]
    Denied {
        /// The node whose ACL decided (for a create: the parent).
        path: String,
        /// The right that was needed.
        right: crate::acl::Right,
        /// The identity that asked.
        identity: String,
    },
    /// The identity holds as many connections, requests in flight or sessions as the
    /// server's limit per identity allows (`docs/security.md`, "Limits per identity").
    /// Nothing was done. Requests in flight: retry once an answer arrives (the SDK does,
    /// with backoff); connections and sessions: close some first.
    #[error("{identity} holds {limit} {what}, its limit at this server; nothing was done")]
    TooManyFor {
        /// The identity.
        identity: String,
        /// What it holds too many of.
        what: crate::quota::Limited,
        /// Its limit.
        limit: u64,
    },
    /// Only a cell admin may do this. Nothing was done.
    #[error("{identity} may not {action}: only a cell admin may")]
    NotAdmin {
        /// What was asked (`change groups`, `change admins`).
        action: String,
        /// The identity that asked.
        identity: String,
    },
    /// This cell does not serve `prefix` (it never owned it, or it moved out at
    /// `epoch`): ask the directory where it lives now, with a map at least this new. The
    /// SDK's router does, and retries there. Nothing was done.
    #[error("this cell does not serve {prefix} (epoch {epoch}): it lives in another cell")]
    WrongCell {
        /// The path's prefix (`/payments`).
        prefix: String,
        /// The prefix's epoch as this cell knows it (0: never here).
        epoch: u64,
    },
    /// `prefix` is being moved to another cell: writes are refused until the move is
    /// done (reads are still served). Nothing was done: retry, the SDK does (with the
    /// same request id) and reaches the new cell once the directory names it.
    #[error(
        "{prefix} is frozen for a move to another cell (epoch {epoch}); nothing was done: retry"
    )]
    Frozen {
        /// The prefix.
        prefix: String,
        /// Its epoch in this cell.
        epoch: u64,
    },
    /// The TLS handshake with a server was refused, by the server or by this client: a
    /// certificate not signed by the CA the other side trusts, expired or revoked, or a
    /// protocol it does not speak. Raised by the SDK, never sent by a server. The SDK
    /// tries the cell's other endpoints (one server's certificate may be the problem) and
    /// gives up at once when every endpoint refused: no retry fixes a certificate, fix
    /// the certificate or the CA file named.
    #[error("TLS handshake refused: {reason}")]
    Handshake {
        /// The endpoint, and what was refused.
        reason: String,
    },
}

/// The bounds behind [`Error::LimitExceeded`]: each names what a remote party tried to
/// make a server hold, and its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Bound {
    /// Bytes of frames read, decoded and not yet answered on one connection
    /// ([`crate::frame::Budget`]).
    ConnectionBytes,
    /// Milliseconds a frame may take to arrive ([`crate::frame::FRAME_DEADLINE_MS`]).
    FrameDeadline,
    /// Levels of nesting in a decoded message ([`crate::decode::Limits::depth_max`]).
    NestingDepth,
    /// Bytes of sequence elements a decoded message may build
    /// ([`crate::decode::Limits::element_bytes_max`]).
    DecodedBytes,
    /// Commands nested in commands (`command::COMMAND_NESTING_MAX`).
    CommandNesting,
    /// Milliseconds from a connection's handshake to its hello
    /// ([`crate::frame::HELLO_DEADLINE_MS`]).
    HelloDeadline,
    /// Bytes of a snapshot a follower accepts (`replica::raft::network::SNAPSHOT_BYTES_MAX`).
    SnapshotBytes,
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bound::ConnectionBytes => "bytes in flight on a connection (bytes)",
            Bound::FrameDeadline => "time for a frame to arrive (ms)",
            Bound::NestingDepth => "nesting depth of a message (levels)",
            Bound::DecodedBytes => "bytes a decoded message may build (bytes)",
            Bound::CommandNesting => "commands nested in commands (levels)",
            Bound::HelloDeadline => "time from handshake to hello (ms)",
            Bound::SnapshotBytes => "bytes of a snapshot (bytes)",
        })
    }
}

impl Error {
    /// True when a retry with the same request id is safe and may succeed: the request
    /// may have been applied (the cell's dedup makes the retry return the original
    /// answer), or it was refused unapplied for a reason that passes ([`Error::Busy`]).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::NotLeader { .. }
                | Error::Unavailable { .. }
                | Error::Timeout { .. }
                | Error::Connection { .. }
                | Error::Busy { .. }
                | Error::Frozen { .. }
                | Error::TooManyFor {
                    what: crate::quota::Limited::Requests,
                    ..
                }
        )
    }

    /// A deterministic error is decided by the state machine from the log alone: every
    /// replica reaches the same one at the same log position.
    pub fn is_deterministic(&self) -> bool {
        !matches!(
            self,
            Error::NotLeader { .. }
                | Error::Unavailable { .. }
                | Error::Timeout { .. }
                | Error::Connection { .. }
                | Error::Internal { .. }
                | Error::ProtocolVersion { .. }
                | Error::FrameTooLarge { .. }
                | Error::Malformed { .. }
                | Error::HelloRequired
                | Error::TooManySessions { .. }
                | Error::LimitExceeded { .. }
                | Error::NotSessionOwner { .. }
                | Error::Busy { .. }
                | Error::TooManyFor { .. }
                | Error::Handshake { .. }
        )
    }
}
