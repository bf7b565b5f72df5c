//! Identifiers, node metadata, client operations and their replies.
//!
//! One file of about 800 lines with its tests, on purpose: the client protocol's whole
//! vocabulary, read side by side (a request's `Op` next to its `Reply`).

use serde::{Deserialize, Serialize};

/// A session's id: `index × SESSIONS_PER_ENTRY + n` for the `n`th `CreateSession` applied
/// in the log entry at `index` ([`session_id`]), so ids only go up and are unique for the
/// life of the cell, and [`session_index`] gives the entry that opened a session. `0` means
/// "no session".
pub type SessionId = u64;
/// At most this many sessions are opened by one log entry (a leader coalesces the
/// `CreateSession`s that arrive together into one entry).
pub const SESSIONS_PER_ENTRY: u64 = 1024;

/// The id of the `n`th session (from 0) opened by the log entry at `index`.
pub const fn session_id(index: LogIndex, n: u64) -> SessionId {
    index * SESSIONS_PER_ENTRY + n
}

/// The log index of the entry that opened session `id`.
pub const fn session_index(id: SessionId) -> LogIndex {
    id / SESSIONS_PER_ENTRY
}
/// A client-chosen request id, unique and increasing within one session.
pub type RequestId = u64;
/// A Raft log index.
pub type LogIndex = u64;
/// A replica's id within its cell.
pub type ReplicaId = u64;

/// Metadata of one node, as returned by reads and writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStat {
    /// Number of data changes since creation (0 when created).
    pub version: u64,
    /// Number of changes to the set of children (creates and deletes beneath it).
    pub children_version: u64,
    /// Log index of the entry that created the node in this cell (see `token` for the
    /// fencing token).
    pub create_index: LogIndex,
    /// Log index of the entry that last changed the node's data.
    pub mod_index: LogIndex,
    /// The owning session of an ephemeral node; `None` for persistent nodes.
    pub ephemeral_owner: Option<SessionId>,
    /// Length of the data in bytes.
    pub data_len: u32,
    /// Number of children.
    pub children_count: u32,
    /// The node's fencing token: `epoch << 54 | (create_index × 1024 + position)`, the
    /// position being the create's place among the entry's creates
    /// ([`crate::directory::token`]); unique in the cell, and growing in the order
    /// creates apply. A lock's grant carries it; a protected resource accepts only tokens at
    /// least as high as the highest it has seen.
    pub token: u64,
}

/// How a node is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateMode {
    /// Deleted when the owning session ends. Ephemeral nodes cannot have children.
    pub ephemeral: bool,
    /// The cell appends the parent's sequence counter, zero-padded to 10 digits.
    pub sequential: bool,
}

/// One operation inside a transaction ([`Op::Txn`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TxnOp {
    /// Require that `path` exists and, if given, has this version. Changes nothing.
    Check {
        /// Node path.
        path: String,
        /// Expected version, or any version when `None`.
        version: Option<u64>,
    },
    /// Create a node (see [`Op::Create`]).
    Create {
        /// Node path (the prefix when sequential).
        path: String,
        /// Initial data.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// Ephemeral and/or sequential.
        mode: CreateMode,
    },
    /// Delete a node (see [`Op::Delete`]).
    Delete {
        /// Node path.
        path: String,
        /// Expected version, or any version when `None`.
        version: Option<u64>,
    },
    /// Replace a node's data (see [`Op::SetData`]).
    SetData {
        /// Node path.
        path: String,
        /// New data.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// Expected version, or any version when `None`.
        version: Option<u64>,
    },
}

/// The result of one operation of a successful transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TxnResult {
    /// A `Check` passed.
    Checked,
    /// A `Create` made this node.
    Created {
        /// Actual path (with the sequence suffix when sequential).
        path: String,
        /// The new node's metadata.
        stat: NodeStat,
    },
    /// A `Delete` removed its node.
    Deleted,
    /// A `SetData` wrote; the node's new metadata.
    Set {
        /// The node's new metadata.
        stat: NodeStat,
    },
}

/// The node just below a new sequential node among its siblings, computed when the create
/// was applied. `None` in [`Reply::Created`] means no lower sibling existed at that log
/// position, so a lock recipe knows it holds the lock without another read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Predecessor {
    /// Name (last path component) of the sibling.
    pub name: String,
    /// Its create index.
    pub create_index: LogIndex,
}

/// A Raft member as seen by clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Replica id.
    pub id: ReplicaId,
    /// Address clients and peers use (`host:port`).
    pub addr: String,
    /// Voter (true) or learner (false).
    pub voter: bool,
    /// The store its answers must come from to count ([`crate::store::Binding`]).
    pub store: crate::store::Binding,
}

/// The answer to [`Op::Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The replica that answered.
    pub id: ReplicaId,
    /// `Leader`, `Follower`, `Candidate`, `Learner` or `Shutdown`.
    pub role: String,
    /// Current Raft term.
    pub term: u64,
    /// The leader this replica knows of.
    pub leader: Option<MemberInfo>,
    /// Last log index applied to this replica's state machine.
    pub last_applied: LogIndex,
    /// Last log index in this replica's log.
    pub last_log_index: LogIndex,
    /// Index of the last snapshot, if any.
    pub snapshot_index: Option<LogIndex>,
    /// Index below which the log was purged, if any.
    pub purged_index: Option<LogIndex>,
    /// Members of the cell (voters and learners).
    pub members: Vec<MemberInfo>,
    /// Open sessions in this replica's state machine.
    pub session_count: u64,
    /// Nodes in this replica's state machine (including `/`).
    pub node_count: u64,
    /// Log appends made durable since this replica started.
    pub log_appends: u64,
    /// fsyncs that made them durable (fewer than appends when group commit batches them).
    pub log_syncs: u64,
    /// (session, node) cacher records on this leader.
    pub cachers: u64,
    /// Age of the oldest invalidation still waiting for acknowledgements, in ms (0 if none).
    pub oldest_invalidation_ms: u64,
    /// KeepAlive RPCs this replica answered: one per [`Op::KeepAlive`] and one per
    /// [`Op::KeepAliveBatch`], however many sessions it carried.
    pub keepalive_rpcs: u64,
    /// Session leases renewed by those RPCs.
    pub keepalives_renewed: u64,
    /// Watches armed at this leader (one per session, node and kind).
    pub watches: u64,
    /// Invalidations sent to cachers by this leader (one per cacher and held write).
    pub invalidations_sent: u64,
    /// Size in bytes of the last snapshot this replica built (0 if none since start).
    pub snapshot_bytes: u64,
    /// Milliseconds it took to serialize and write it.
    pub snapshot_build_ms: u64,
    /// How long this replica took to answer each kind of request since it started, from
    /// accepting the request's stream to the answer (see [`crate::latency`]).
    pub request_latency: Vec<crate::latency::OpLatency>,
    /// QUIC connections this replica dialed to its peers since it started: one per peer,
    /// plus one after each failure of a connection. Growing steadily on a healthy cell
    /// means connections are not being reused.
    pub peer_dials: u64,
    /// Refusals by the limits per identity since start: connections, requests in
    /// flight, sessions ([`crate::quota`]).
    pub refused_by_limit: [u64; 3],
    /// Peer certificates this replica checked on connections it dialed, since it started:
    /// once per connection, and again on it when the TLS files change or the
    /// certificate's `notAfter` passes. Growing with the requests (each leadership check
    /// takes a pooled connection) means each check verifies a certificate chain again.
    pub peer_certificate_checks: u64,
    /// The log's fsyncs in the last one to two minutes (the current minute and the one
    /// before) and their p99 in µs (`None` without one): the disk as it is now.
    pub recent_fsyncs: u64,
    /// See `recent_fsyncs`.
    pub recent_fsync_p99_us: Option<u64>,
    /// The answering replica's store ([`crate::store::StoreId`]): when it differs from
    /// the store `members` binds this replica to, its data was lost and nothing it says
    /// counts until it is replaced.
    pub store: Option<crate::store::StoreId>,
}

/// The answer to [`Op::ProxyStatus`]: a proxy's counters since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyStatus {
    /// Client connections open now.
    pub clients: u64,
    /// Client sessions the proxy renews (those that sent a KeepAlive through it).
    pub sessions: u64,
    /// Batched KeepAlive RPCs sent to the leader.
    pub keepalive_batches: u64,
    /// Client KeepAlives carried by those batches.
    pub keepalives_batched: u64,
    /// Cached reads answered from the proxy's cache.
    pub cache_hits: u64,
    /// Reads forwarded to the cell (plain, watched and cached reads).
    pub upstream_reads: u64,
    /// Requests other than reads and KeepAlives forwarded to the cell.
    pub upstream_writes: u64,
    /// Invalidations relayed to clients.
    pub invalidations_relayed: u64,
    /// Watch events delivered to clients.
    pub watch_events_relayed: u64,
    /// (node, kind) watches the proxy holds at the leader.
    pub upstream_watches: u64,
    /// The proxy's own session at the cell (0 before it has one).
    pub session: SessionId,
    /// Invalidations relayed to clients and not yet acknowledged by all of them (or ended
    /// by their leases): each holds a write at the leader.
    pub pending_invalidations: u64,
    /// Age of the oldest of them, in ms (0 if none).
    pub oldest_pending_ms: u64,
    /// How long this proxy took to answer each kind of client request since it started,
    /// from accepting the request's stream to the answer, the wait for the cell included
    /// (see [`crate::latency`]).
    pub request_latency: Vec<crate::latency::OpLatency>,
    /// Refusals by the limits per identity since start: connections, requests in
    /// flight, sessions ([`crate::quota`]).
    pub refused_by_limit: [u64; 3],
}

/// A request from a client (or proxy) to a replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The session the request belongs to (0 for session-less operations such as
    /// `CreateSession`, `Status` and membership changes).
    pub session: SessionId,
    /// Unique, increasing id within the session. A retry reuses the id, so a write whose
    /// outcome was unknown is never applied twice.
    pub request_id: RequestId,
    /// The client has received answers to every request id below this one; the cell may
    /// forget their stored results.
    pub ack_below: RequestId,
    /// What to do.
    pub op: Op,
}

/// Everything a client can ask of a cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Open a session. Reply: [`Reply::SessionCreated`].
    CreateSession,
    /// Extend the session's lease. Never logged. Reply: [`Reply::KeepAlive`].
    KeepAlive,
    /// Extend the leases of many sessions in one RPC: what a proxy sends each interval for
    /// its clients, and what the SDK sends for the sessions of one client that are due
    /// together (the request's own `session` is ignored). At most
    /// [`crate::KEEPALIVE_BATCH_MAX`] sessions. Reply: [`Reply::KeepAliveBatch`].
    KeepAliveBatch {
        /// The sessions to renew.
        sessions: Vec<SessionId>,
    },
    /// A proxy's counters. Replicas answer `BadRequest`. Reply: [`Reply::ProxyStatus`].
    ProxyStatus,
    /// End the session now; its ephemeral nodes are deleted. Reply: [`Reply::Closed`].
    CloseSession,
    /// Create a node. The parent must exist and must not be ephemeral.
    Create {
        /// Path (the prefix when sequential).
        path: String,
        /// Initial data, at most [`crate::VALUE_BYTES_MAX`] bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// Ephemeral and/or sequential.
        mode: CreateMode,
    },
    /// Delete a node that has no children.
    Delete {
        /// Path.
        path: String,
        /// Expected version (compare-and-delete), any when `None`.
        version: Option<u64>,
    },
    /// Replace a node's data.
    SetData {
        /// Path.
        path: String,
        /// New data, at most [`crate::VALUE_BYTES_MAX`] bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// Expected version (compare-and-set), any when `None`.
        version: Option<u64>,
    },
    /// Read a node's data and metadata (linearizable). Reply: [`Reply::Data`]. With
    /// `watch`, a [`WatchKind::Data`] watch is armed atomically with the read.
    Get {
        /// Path.
        path: String,
        /// Arm a one-shot watch (needs a session).
        watch: bool,
    },
    /// Read a node's metadata if it exists (linearizable). Reply: [`Reply::Exists`]. With
    /// `watch`, a [`WatchKind::Data`] watch is armed if the node exists, a
    /// [`WatchKind::Exists`] watch (fires on creation) if it does not.
    Exists {
        /// Path.
        path: String,
        /// Arm a one-shot watch (needs a session).
        watch: bool,
    },
    /// List a node's children with their metadata, in name order (linearizable). With
    /// `watch`, a [`WatchKind::Children`] watch is armed.
    Children {
        /// Path.
        path: String,
        /// Arm a one-shot watch (needs a session).
        watch: bool,
    },
    /// All or nothing: every op applies, or none does and the first failure is returned.
    Txn {
        /// At most [`crate::TXN_OPS_MAX`] operations.
        ops: Vec<TxnOp>,
    },
    /// Who leads, what is applied, who is a member. Served by any replica.
    Status,
    /// Add a non-voting learner (leader only).
    AddLearner {
        /// New replica's id.
        id: ReplicaId,
        /// Its address.
        addr: String,
    },
    /// Promote a learner to voter (leader only).
    Promote {
        /// The learner's id.
        id: ReplicaId,
    },
    /// Remove a voter or learner from the cell (leader only).
    RemoveMember {
        /// The member's id.
        id: ReplicaId,
    },
    /// Build a snapshot of the replica that receives it now (any replica; no session) and
    /// purge its log behind it; answered with [`Reply::SnapshotTaken`] once it is written.
    /// Replicas also snapshot by themselves every `snapshot_interval_entries` entries.
    Snapshot,
    /// Open the session's event stream (leader only). The first answer frame is
    /// [`Reply::EventsOpened`]; every later frame on the same stream is a [`Reply::Event`],
    /// until the leader changes or the session ends.
    Events,
    /// Re-arm watches after a fail-over. Each watch whose node changed after its
    /// `since_index` fires at once (returned in [`Reply::Rewatched`]); the others are armed.
    Rewatch {
        /// The watches to re-arm.
        watches: Vec<WatchSpec>,
    },
    /// Is this sequencer still the current holder (node present, same fencing token, same
    /// owner)? Linearizable. Reply: [`Reply::Sequencer`].
    CheckSequencer {
        /// The lock node's full path.
        path: String,
        /// Its fencing token ([`NodeStat::token`]).
        token: u64,
        /// The holder's session.
        session: SessionId,
    },
    /// Read a node (or its absence) to cache it: like `Get`, and the leader records this
    /// session as a cacher of the node unless a write to it is in progress. Before any
    /// later write to the node commits, the leader sends the session an
    /// [`Reply::Invalidate`] on its event stream and waits for the acknowledgement (or for
    /// the session's lease to run out). The stat's `children_count` and
    /// `children_version` are always 0 here: a child's create or delete does not
    /// invalidate its parent, so a cache would serve them stale (read them with
    /// [`Op::Children`]). Reply: [`Reply::CachedData`].
    CachedGet {
        /// Path.
        path: String,
    },
    /// Acknowledge invalidations received on the event stream: the values are dropped.
    AckInvalidations {
        /// The invalidations' ids.
        ids: Vec<u64>,
    },
    /// The sequential sibling just below a node (by sequence number), linearizable: what a
    /// woken lock waiter needs instead of listing every waiter. `NoNode` if the node itself
    /// is gone. Reply: [`Reply::Predecessor`].
    Predecessor {
        /// The node's full path.
        path: String,
    },
    /// [`Op::AckInvalidations`] for several sessions at once, each with its own ids: what
    /// the SDK sends for the sessions of one client whose acknowledgements fall due
    /// together (a fail-over flushes every session's cache at once; one RPC per session
    /// made the flush take seconds). The request's own `session` is ignored; at most
    /// [`crate::KEEPALIVE_BATCH_MAX`] sessions. Reply: [`Reply::Acked`].
    AckInvalidationsBatch {
        /// Each session with the invalidation ids it acknowledges.
        acks: Vec<(SessionId, Vec<u64>)>,
    },
    /// A digest of the replica's whole replicated state, and the log index it reflects
    /// (any replica, no session; replicas only). Two replicas at the same index must give
    /// the same digest: what tests and the fault suite compare after a run. It serializes
    /// the whole state under the state's read lock (applies wait meanwhile), so a
    /// replica computes one at a time and at most four a second (`Unavailable`
    /// otherwise). Reply: [`Reply::StateDigest`].
    StateDigest,
    /// `op`, sent by a proxy for its client `identity` (a `lock://client/...` URI): the
    /// replica answers it as if the client had sent it directly, so a session opened this
    /// way belongs to the client, and only the client (through a proxy or directly) may
    /// use it. Only a proxy of the replica's own cell may send it, to replicas only; it
    /// does not nest. What the proxy itself answers (KeepAlives it batches, cached reads,
    /// acknowledgements) it checks against the owner it learned (see
    /// `docs/security.md`, "Sessions belong to identities").
    Forwarded {
        /// The client's identity, as its certificate proves it to the proxy.
        identity: String,
        /// What the client asked.
        op: Box<Op>,
    },
    /// A node's ACL (linearizable; needs the read or the admin right on the node).
    /// Reply: [`Reply::Acl`].
    GetAcl {
        /// Path.
        path: String,
    },
    /// Replace a node's ACL (needs the admin right on the node, or to be a cell admin).
    /// Existing children keep theirs; children created later inherit the new one. Cached
    /// copies of the node are dropped first, as for a write. Reply: [`Reply::SecurityChanged`].
    SetAcl {
        /// Path.
        path: String,
        /// The new ACL (at most [`crate::acl::ACL_ENTRIES_MAX`] entries per right).
        acl: crate::acl::Acl,
    },
    /// The cell's admins and groups (linearizable; any identity). Reply:
    /// [`Reply::Security`].
    Security,
    /// Create or replace a group (cell admins only). Reply: [`Reply::SecurityChanged`].
    SetGroup {
        /// The group's name.
        name: String,
        /// Its members: identity URIs, at most [`crate::acl::GROUP_MEMBERS_MAX`].
        members: Vec<String>,
    },
    /// Remove a group (cell admins only); ACL entries naming it then match nobody.
    /// Reply: [`Reply::SecurityChanged`].
    RemoveGroup {
        /// The group's name.
        name: String,
    },
    /// Make an identity a cell admin, or no longer one (cell admins only; the last admin
    /// cannot be removed). Reply: [`Reply::SecurityChanged`].
    SetAdmin {
        /// The identity URI.
        identity: String,
        /// True to add it, false to remove it.
        admin: bool,
    },
    /// The prefixes this cell has recorded, with their epochs and states
    /// (linearizable; any identity). Reply: [`Reply::Prefixes`].
    Prefixes,
    /// Record where a prefix stands in this cell (cell admins only; the changes a move
    /// makes, `crate::directory`). Freezing drops every cached copy of the prefix's nodes
    /// first, as a write does. Reply: [`Reply::PrefixChanged`].
    SetPrefix {
        /// The prefix (`/payments`).
        prefix: String,
        /// Its epoch.
        epoch: u64,
        /// Its new state.
        state: crate::directory::PrefixState,
    },
    /// A page of a prefix's persistent nodes in path order, after `after` (cell admins
    /// only; linearizable; only while the prefix is frozen), for a move's copy. Reply: [`Reply::Exported`].
    ExportPrefix {
        /// The prefix.
        prefix: String,
        /// The last path of the previous page.
        after: Option<String>,
    },
    /// Copy nodes into a prefix this cell is importing (cell admins only). Reply:
    /// [`Reply::PrefixChanged`].
    ImportPrefix {
        /// The prefix.
        prefix: String,
        /// Its epoch here.
        epoch: u64,
        /// The first page of a copy: what an interrupted copy left is dropped first.
        first: bool,
        /// The nodes, in path order (at most about [`crate::directory::IMPORT_BYTES_MAX`]).
        nodes: Vec<crate::directory::ExportedNode>,
    },
    /// Delete every node of a prefix that moved out or is being imported (cell admins
    /// only). Reply: [`Reply::PrefixChanged`].
    DropPrefix {
        /// The prefix.
        prefix: String,
        /// Its epoch here.
        epoch: u64,
    },
    /// The directory's map of prefixes to cells: answered by directory servers, not by
    /// cells. Reply: [`Reply::Directory`].
    Directory,
    /// The cell's sessions in id order, from just after `after`, at most `limit` (up to
    /// [`SESSIONS_PAGE_MAX`]); cell admins only, answered by the leader (which keeps the
    /// leases). Reply: [`Reply::Sessions`].
    Sessions {
        /// List ids above this one (0: from the first).
        after: SessionId,
        /// At most this many.
        limit: u32,
    },
    /// Copy the state to the cell's backup store now (cell admins only, answered by the
    /// leader once the object is written; the replicas' `[backup]` configuration names
    /// the store). Reply: [`Reply::BackupTaken`].
    Backup,
    /// Who leads, as the answering replica sees it: its term, its role and the leader it
    /// knows. Answered by every replica at once from its Raft state (no quorum, no
    /// lock), so a client whose leader fell silent can ask the others whether one of them
    /// leads now; a proxy answers `BadRequest`. Reply: [`Reply::Leadership`].
    Leadership,
    /// [`Op::Leadership`], answered as soon as the answering replica knows a leader (itself
    /// or another) in a term above `newer_than` (at once if it does), or after `wait_ms`
    /// (at most [`LEADERSHIP_WAIT_MAX_MS`]) with its view then: a client searching for a
    /// new leader hears of it when it is elected (from the new leader) or when its first
    /// heartbeat arrives (from the others), not when it next asks, and a replica still
    /// leading in a term the client knows to be old does not answer first.
    /// Reply: [`Reply::Leadership`].
    LeadershipAfter {
        /// How long the replica may hold the answer, in milliseconds.
        wait_ms: u32,
        /// The newest term the asker has heard of: an answer is held until a leader of a
        /// later term is known.
        newer_than: u64,
    },
    /// Hand the leadership over (admin, leader only): to `to`, a voter, or when `None` to
    /// the follower whose log reaches furthest (either must have answered the leader in
    /// the last second, and be close to its log). Answered once another replica leads;
    /// refused with [`crate::Error::Membership`] (not retried) when no voter fits, while
    /// a membership change is half done, or when the target did not take over within
    /// 1 s (the old leader then refuses writes until the cell elects a leader by its
    /// timers, as after a crash). Naming the replica that leads answers at once, as
    /// done. Writes reaching the old leader meanwhile are answered
    /// [`crate::Error::NotLeader`] naming the target. A replica told to stop (SIGTERM)
    /// while leading does the same first. Reply: [`Reply::LeaderTransferred`].
    TransferLeader {
        /// The voter to hand over to; `None`: the best follower.
        to: Option<ReplicaId>,
    },
}

/// The longest an [`Op::LeadershipAfter`] is held, in milliseconds.
pub const LEADERSHIP_WAIT_MAX_MS: u32 = 1_000;

/// The most sessions one [`Op::Sessions`] answer lists.
pub const SESSIONS_PAGE_MAX: u32 = 1_000;

/// The ephemeral nodes [`SessionInfo`] names, at most (it counts them all).
pub const SESSION_EPHEMERALS_LISTED: usize = 8;

/// One session, as [`Op::Sessions`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// The session's id.
    pub id: SessionId,
    /// The identity that opened it (the only one that may use it).
    pub owner: String,
    /// Its lease left at the leader, in ms (0: ran out, its expiry is being committed);
    /// `None` when the leader has no lease for it yet (opened a moment ago, or the leader
    /// took over a moment ago).
    pub lease_left_ms: Option<u64>,
    /// How many ephemeral nodes it owns.
    pub ephemerals: u64,
    /// The first [`SESSION_EPHEMERALS_LISTED`] of them, in path order.
    pub ephemeral_paths: Vec<String>,
    /// Whether it caches values (the leader holds writes to them for its acknowledgement).
    pub caches: bool,
}

impl Op {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Sessions { .. } => "Sessions",
            Op::Backup => "Backup",
            Op::Leadership => "Leadership",
            Op::LeadershipAfter { .. } => "LeadershipAfter",
            Op::TransferLeader { .. } => "TransferLeader",
            Op::CreateSession => "CreateSession",
            Op::KeepAlive => "KeepAlive",
            Op::KeepAliveBatch { .. } => "KeepAliveBatch",
            Op::ProxyStatus => "ProxyStatus",
            Op::CloseSession => "CloseSession",
            Op::Create { .. } => "Create",
            Op::Delete { .. } => "Delete",
            Op::SetData { .. } => "SetData",
            Op::Get { .. } => "Get",
            Op::Exists { .. } => "Exists",
            Op::Children { .. } => "Children",
            Op::Txn { .. } => "Txn",
            Op::Status => "Status",
            Op::AddLearner { .. } => "AddLearner",
            Op::Promote { .. } => "Promote",
            Op::RemoveMember { .. } => "RemoveMember",
            Op::Snapshot => "Snapshot",
            Op::Events => "Events",
            Op::Rewatch { .. } => "Rewatch",
            Op::CheckSequencer { .. } => "CheckSequencer",
            Op::Predecessor { .. } => "Predecessor",
            Op::CachedGet { .. } => "CachedGet",
            Op::AckInvalidations { .. } => "AckInvalidations",
            Op::AckInvalidationsBatch { .. } => "AckInvalidationsBatch",
            Op::StateDigest => "StateDigest",
            Op::Forwarded { op, .. } => op.name(),
            Op::GetAcl { .. } => "GetAcl",
            Op::SetAcl { .. } => "SetAcl",
            Op::Security => "Security",
            Op::SetGroup { .. } => "SetGroup",
            Op::RemoveGroup { .. } => "RemoveGroup",
            Op::SetAdmin { .. } => "SetAdmin",
            Op::Prefixes => "Prefixes",
            Op::SetPrefix { .. } => "SetPrefix",
            Op::ExportPrefix { .. } => "ExportPrefix",
            Op::ImportPrefix { .. } => "ImportPrefix",
            Op::DropPrefix { .. } => "DropPrefix",
            Op::Directory => "Directory",
        }
    }

    /// True for operations that go through the log.
    pub fn is_write(&self) -> bool {
        if let Op::Forwarded { op, .. } = self {
            return op.is_write();
        }
        matches!(
            self,
            Op::CreateSession
                | Op::CloseSession
                | Op::Create { .. }
                | Op::Delete { .. }
                | Op::SetData { .. }
                | Op::Txn { .. }
                | Op::SetAcl { .. }
                | Op::SetGroup { .. }
                | Op::RemoveGroup { .. }
                | Op::SetAdmin { .. }
                | Op::SetPrefix { .. }
                | Op::ImportPrefix { .. }
                | Op::DropPrefix { .. }
        )
    }
}

/// Successful answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// A new session and the lease granted to it.
    SessionCreated {
        /// The session's id.
        session: SessionId,
        /// Lease length in milliseconds; the client renews every third of it.
        session_lease_ms: u64,
    },
    /// The lease was extended by `session_lease_ms` from when the replica received the
    /// KeepAlive.
    KeepAlive {
        /// Lease length in milliseconds.
        session_lease_ms: u64,
        /// Invalidations the answering server sent this session more than
        /// [`crate::INVALIDATION_RESEND_MS`] ago that it has not acknowledged: (id, nodes).
        /// Like Chubby's invalidations piggybacked on KeepAlive replies, this ties the
        /// lease to invalidation: a session that keeps renewing cannot hold a write up for
        /// long by missing its event stream. The client drops the nodes and acknowledges
        /// the ids to the server that answered.
        unacknowledged: Vec<(u64, Vec<String>)>,
    },
    /// The answer to [`Op::KeepAliveBatch`]: sessions in neither list were not renewed
    /// this time (the leader changed or is loading its lease table) and may be retried.
    KeepAliveBatch {
        /// Lease length in milliseconds, counted from when the replica received the batch.
        session_lease_ms: u64,
        /// Sessions whose lease was extended.
        renewed: Vec<SessionId>,
        /// Sessions that are over (expired or closed).
        expired: Vec<SessionId>,
        /// Sessions this cell never had.
        unknown: Vec<SessionId>,
        /// For renewed sessions: invalidations sent to them that are overdue, as in
        /// [`Reply::KeepAlive`]: (session, id, nodes).
        unacknowledged: Vec<(SessionId, u64, Vec<String>)>,
    },
    /// A proxy's counters.
    ProxyStatus(ProxyStatus),
    /// The session is closed.
    Closed,
    /// A node was created.
    Created {
        /// Its actual path (with the sequence suffix when sequential).
        path: String,
        /// Its metadata (`token` is the fencing token).
        stat: NodeStat,
        /// For sequential nodes: the sibling just below at the create's log position.
        predecessor: Option<Predecessor>,
    },
    /// The node was deleted.
    Deleted,
    /// The node's data was replaced.
    Set {
        /// Its new metadata.
        stat: NodeStat,
    },
    /// A node's data and metadata.
    Data {
        /// Data.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// Metadata.
        stat: NodeStat,
        /// Log index the read reflects (a watch set with it fires for later changes).
        index: LogIndex,
    },
    /// A node's metadata, or `None` if it does not exist.
    Exists {
        /// Metadata if the node exists.
        stat: Option<NodeStat>,
        /// Log index the read reflects.
        index: LogIndex,
    },
    /// A node's children, in name order.
    Children {
        /// The parent's metadata.
        stat: NodeStat,
        /// (name, metadata) of each child.
        children: Vec<(String, NodeStat)>,
        /// Log index the read reflects.
        index: LogIndex,
    },
    /// A transaction applied; one result per op.
    Txn {
        /// Results in op order.
        results: Vec<TxnResult>,
    },
    /// Replica status.
    Status(Box<Status>),
    /// A membership change committed.
    MembershipChanged {
        /// The cell's members after the change.
        members: Vec<MemberInfo>,
    },
    /// The answer to [`Op::Snapshot`]: the snapshot now on disk.
    SnapshotTaken {
        /// The last log index it covers.
        index: LogIndex,
        /// Its size in bytes.
        bytes: u64,
        /// Milliseconds to serialize it (applies wait meanwhile).
        serialize_ms: u64,
        /// Milliseconds to serialize and write it durably.
        total_ms: u64,
    },
    /// The event stream is open; events after `index` will be delivered.
    EventsOpened {
        /// The leader's applied index when the stream opened.
        index: LogIndex,
    },
    /// One event on the event stream.
    Event(WatchEvent),
    /// Watches re-armed; those in `fired` had changed already and are not armed.
    Rewatched {
        /// Events of the watches that fired at once.
        fired: Vec<WatchEvent>,
    },
    /// The answer to [`Op::CheckSequencer`].
    Sequencer {
        /// True while the sequencer's node still exists with that token and owner.
        current: bool,
    },
    /// The answer to [`Op::Predecessor`].
    Predecessor {
        /// The sibling just below, if any.
        predecessor: Option<Predecessor>,
    },
    /// The answer to [`Op::CachedGet`].
    CachedData {
        /// The node's data and metadata, or `None` if it does not exist (absence may be
        /// cached too).
        value: Option<(Vec<u8>, NodeStat)>,
        /// Log index the read reflects.
        index: LogIndex,
        /// True when the session was recorded as a cacher and may cache the answer; false
        /// while a write to the node is in progress (use it, do not cache it).
        cachable: bool,
    },
    /// On the event stream: drop these cached values, then acknowledge with
    /// [`Op::AckInvalidations`]. A write to them is waiting for it.
    Invalidate {
        /// Identifies the invalidation in the acknowledgement.
        id: u64,
        /// The nodes whose cached values must be dropped.
        paths: Vec<String>,
    },
    /// Acknowledgements received.
    Acked,
    /// The answer to [`Op::StateDigest`].
    StateDigest {
        /// The last log index applied to the state digested.
        index: LogIndex,
        /// A 64-bit xxh3 hash of the state's canonical encoding (every node, session and
        /// stored result, in key order).
        digest: u64,
    },
    /// The answer to [`Op::GetAcl`].
    Acl {
        /// The node's ACL.
        acl: crate::acl::Acl,
        /// Log index the read reflects.
        index: LogIndex,
    },
    /// The answer to [`Op::Security`].
    Security {
        /// The cell's admins, in order.
        admins: Vec<String>,
        /// Every group with its members, in name order.
        groups: Vec<(String, Vec<String>)>,
        /// Log index the read reflects.
        index: LogIndex,
    },
    /// An ACL, group or admin change committed.
    SecurityChanged {
        /// The log index it applied at.
        index: LogIndex,
    },
    /// The prefixes a cell has recorded.
    Prefixes {
        /// In prefix order.
        prefixes: Vec<crate::directory::PrefixRecord>,
        /// The applied index the answer reflects.
        index: LogIndex,
    },
    /// A prefix's state changed, or nodes were imported or dropped.
    PrefixChanged {
        /// The log index it applied at.
        index: LogIndex,
    },
    /// A page of a prefix's persistent nodes.
    Exported {
        /// The nodes, in path order.
        nodes: Vec<crate::directory::ExportedNode>,
        /// Whether more follow (ask again with `after` = the last path).
        more: bool,
        /// The applied index the page reflects.
        index: LogIndex,
    },
    /// The directory's map.
    Directory(crate::directory::DirectoryMap),
    /// Answer to [`Op::Sessions`].
    Sessions {
        /// The sessions, in id order.
        sessions: Vec<SessionInfo>,
        /// More sessions follow the last one listed (ask again with its id as `after`).
        more: bool,
    },
    /// Answer to [`Op::Backup`]: the backup now in the store.
    BackupTaken {
        /// The store it was written to (the leader's `backup.url`).
        store: String,
        /// Its name under the store's prefix (`<cell>/snapshot-<index>-<unix ms>.lksnap`).
        object: String,
        /// The log index it covers.
        index: LogIndex,
        /// Its size in bytes.
        bytes: u64,
        /// The digest of the state it holds (what [`Op::StateDigest`] answers for that
        /// state): a cell restored from it answers the same at the same index.
        digest: u64,
        /// Milliseconds to copy, serialize and write it.
        total_ms: u64,
        /// Older backups deleted by retention.
        pruned: u32,
    },
    /// Answer to [`Op::Leadership`]: the answering replica's view, which may be stale (a
    /// replica cut off from the others keeps the last leader it knew, at its term).
    Leadership {
        /// The replica that answered.
        id: ReplicaId,
        /// Its current Raft term.
        term: u64,
        /// Whether it is the leader of that term now.
        leading: bool,
        /// The leader it knows of in that term, if any (itself when `leading`).
        leader: Option<ReplicaId>,
    },
    /// Answer to [`Op::TransferLeader`]: the leadership moved.
    LeaderTransferred {
        /// The replica that led.
        from: ReplicaId,
        /// The replica that leads now.
        to: ReplicaId,
        /// Milliseconds from the request to the new leader's election, as the old leader
        /// saw it.
        took_ms: u64,
    },
}

impl Reply {
    /// The watch a watched read of this answer arms, and the index it is armed at: a data
    /// watch for `Data` and for `Exists` of an existing node, a creation watch for `Exists`
    /// of a missing one, a children watch for `Children`. `None` for other answers.
    pub fn armed_watch(&self) -> Option<(WatchKind, LogIndex)> {
        match self {
            Reply::Data { index, .. } => Some((WatchKind::Data, *index)),
            Reply::Exists {
                stat: Some(_),
                index,
            } => Some((WatchKind::Data, *index)),
            Reply::Exists { stat: None, index } => Some((WatchKind::Exists, *index)),
            Reply::Children { index, .. } => Some((WatchKind::Children, *index)),
            _ => None,
        }
    }
}

/// What a watch waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WatchKind {
    /// The node's data changes or the node is deleted (set by `get`, or by `exists` on an
    /// existing node).
    Data,
    /// The node's set of children changes or the node is deleted (set by `children`).
    Children,
    /// The node is created (set by `exists` on a missing node).
    Exists,
}

/// What happened to a watched node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    /// The node was created.
    Created,
    /// The node's data changed.
    DataChanged,
    /// The node was deleted.
    Deleted,
    /// The node's children changed.
    ChildrenChanged,
}

/// A one-shot watch fired. It names the node, the watch kind, what happened and the log
/// index at which it happened, not the new value: re-read (and re-arm) to see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// The watched node.
    pub path: String,
    /// The kind of watch that fired.
    pub kind: WatchKind,
    /// What happened.
    pub event: EventType,
    /// The log index of the change (0 when a re-armed watch fired because its change is
    /// older than the leader's memory of changes).
    pub index: LogIndex,
}

/// A watch to re-arm after a fail-over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchSpec {
    /// The node.
    pub path: String,
    /// The kind.
    pub kind: WatchKind,
    /// The log index the watch was armed at (its read's index).
    pub since_index: LogIndex,
}

/// Splits watches to re-arm into `Rewatch` requests that fit: at most
/// [`crate::REWATCH_MAX`] watches and about [`crate::REWATCH_PATH_BYTES_MAX`] bytes of paths
/// each (10 000 watches of 1 KiB paths would not fit in one frame).
pub fn rewatch_chunks(specs: &[WatchSpec]) -> Vec<&[WatchSpec]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, w) in specs.iter().enumerate() {
        let full = i - start >= crate::REWATCH_MAX
            || (i > start && bytes + w.path.len() > crate::REWATCH_PATH_BYTES_MAX);
        if full {
            out.push(&specs[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += w.path.len();
    }
    if start < specs.len() {
        out.push(&specs[start..]);
    }
    out
}

/// One frame sent in answer to a [`Request`].
pub type Response = Result<Reply, crate::Error>;

/// Session ids written compactly for logs: sorted, runs of consecutive ids as `a-b`
/// (`"3-5,9"`). A proxy's batch of thousands of sessions is mostly a few runs, because
/// the SDK opens a process's sessions together and renews those due together.
pub struct IdRanges<'a>(pub &'a [SessionId]);

impl std::fmt::Display for IdRanges<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids = self.0.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let mut i = 0;
        while i < ids.len() {
            let mut j = i;
            while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
                j += 1;
            }
            if i > 0 {
                f.write_str(",")?;
            }
            if j == i {
                write!(f, "{}", ids[i])?;
            } else {
                write!(f, "{}-{}", ids[i], ids[j])?;
            }
            i = j + 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod id_ranges_tests {
    use super::IdRanges;

    #[test]
    fn runs_are_folded_and_order_is_ignored() {
        assert_eq!(IdRanges(&[]).to_string(), "");
        assert_eq!(IdRanges(&[7]).to_string(), "7");
        assert_eq!(
            IdRanges(&[9, 3, 4, 5, 5, 11, 12]).to_string(),
            "3-5,9,11-12"
        );
    }
}

#[cfg(test)]
mod bytes_encoding_tests {
    use super::{CreateMode, TxnOp};

    /// Node data is encoded as bytes (`serde_bytes`: one copy, not one call per byte),
    /// and postcard writes bytes exactly as it writes a sequence of `u8`, so frames and
    /// log entries from before the change decode the same.
    #[test]
    fn data_as_bytes_encodes_like_a_sequence_of_u8() {
        #[derive(serde::Serialize)]
        struct Plain {
            path: String,
            data: Vec<u8>,
        }
        #[derive(serde::Serialize)]
        struct Bytes {
            path: String,
            #[serde(with = "serde_bytes")]
            data: Vec<u8>,
        }
        let data: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let plain = postcard::to_allocvec(&Plain {
            path: "/a".into(),
            data: data.clone(),
        });
        let bytes = postcard::to_allocvec(&Bytes {
            path: "/a".into(),
            data: data.clone(),
        });
        assert!(
            plain.unwrap() == bytes.unwrap(),
            "bytes and a u8 sequence differ"
        );
        let mode = CreateMode {
            ephemeral: true,
            sequential: false,
        };
        let op = TxnOp::Create {
            path: "/a".into(),
            data,
            mode,
        };
        let encoded = postcard::to_allocvec(&op).unwrap();
        assert!(
            postcard::from_bytes::<TxnOp>(&encoded).unwrap() == op,
            "round trip"
        );
    }
}
