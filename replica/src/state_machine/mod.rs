//! # The replicated state machine
//!
//! A namespace of nodes, a table of sessions and the per-session dedup record, changed only
//! by applying log entries ([`wire::command::Command`]) in order. It is plain,
//! deterministic Rust: no I/O, no clock, no randomness, no actors. Time enters only as data
//! (an expiry is a command the leader proposes; a lease checkpoint carries milliseconds
//! measured by the leader). Every replica that applies the same log holds the same state,
//! byte for byte, which is what the property tests in [`tests`] check against a model.
//!
//! ## Rules enforced here
//!
//! - Paths are validated ([`wire::path::validate`]); values are at most
//!   [`wire::VALUE_BYTES_MAX`] bytes; a transaction has at most [`wire::TXN_OPS_MAX`] ops.
//! - A node's parent must exist and must not be ephemeral; a node with children cannot be
//!   deleted; the root can be neither created, deleted nor written.
//! - Every create gets its own fencing token, `epoch << 54 | (index × 1024 + position)`
//!   ([`wire::directory::token`]), the position being its place among the entry's
//!   creates; so tokens are unique and only go up, in apply order, across leader changes
//!   too. A [`Command::Batch`] applies several commands at one index, creates under one
//!   parent (lock contenders) included; it holds at most 1024 creates and 1024
//!   `CreateSession`s ([`BatchRule`], checked here again). The sessions one entry opens
//!   get consecutive ids from its range ([`wire::types::session_id`]).
//! - A write from a session that is not open fails here, at apply, whatever the leader
//!   believed when it proposed it (etcd-io/etcd#11456 was a grant to a lapsed lease).
//! - (session, request id) → result is remembered, so a retried write returns its first
//!   answer and is not applied twice.
//! - A transaction applies all of its ops or none.
//!
//! Applying returns the client's answer and the list of [`Effect`]s for the watch table and
//! the cacher list (leader-local, in `crate::leader`).

mod prefixes;
mod reads;
mod security;
mod session;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use wire::command::{BatchRule, Command, Effect, LeaseCheckpoint};
use wire::types::{CreateMode, LogIndex, NodeStat, Reply, RequestId, SessionId, TxnOp, TxnResult};
use wire::{path, Error};

pub use security::{AclId, Security};
pub use session::{Acting, Session};
use wire::acl::Right;
use wire::directory::{ExportedNode, PrefixRecord, PrefixState};
use wire::path::check_value;
pub use wire::path::validate_write;

pub use wire::path::SEQUENCE_DIGITS;

/// Where a command stands among the commands of its log entry: how many sessions and
/// create ops the commands before it took (its own take the next ids and tokens of the
/// entry's ranges, [`wire::types::session_id`], [`wire::directory::token`]).
#[derive(Debug, Clone, Copy, Default)]
struct Place {
    sessions: u64,
    creates: u64,
}

/// One node of the namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Its data (at most [`wire::VALUE_BYTES_MAX`] bytes).
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Data changes since creation.
    pub version: u64,
    /// Changes to the set of children.
    pub children_version: u64,
    /// Index of the creating entry (its fencing token is `token`).
    pub create_index: LogIndex,
    /// Index of the last data change.
    pub mod_index: LogIndex,
    /// Index of the last change to the set of children (ZooKeeper's pzxid).
    pub children_index: LogIndex,
    /// Owner of an ephemeral node.
    pub ephemeral_owner: Option<SessionId>,
    /// Next sequence number for sequential children.
    pub sequence_next: u64,
    /// Names of the children.
    pub children: BTreeSet<String>,
    /// Its ACL (an index into [`Security`]'s table; a new node gets its parent's).
    pub acl: AclId,
    /// Its fencing token: `epoch << 54 | (create_index × 1024 + position)`, the epoch of
    /// its prefix when it was created ([`wire::directory::token`]); kept when a move
    /// copies it.
    pub token: u64,
}

impl Node {
    fn new(
        data: Vec<u8>,
        index: LogIndex,
        owner: Option<SessionId>,
        acl: AclId,
        token: u64,
    ) -> Node {
        Node {
            data,
            version: 0,
            children_version: 0,
            create_index: index,
            mod_index: index,
            children_index: index,
            ephemeral_owner: owner,
            sequence_next: 0,
            children: BTreeSet::new(),
            acl,
            token,
        }
    }

    /// The node's metadata as clients see it.
    pub fn stat(&self) -> NodeStat {
        NodeStat {
            version: self.version,
            children_version: self.children_version,
            create_index: self.create_index,
            mod_index: self.mod_index,
            ephemeral_owner: self.ephemeral_owner,
            data_len: self.data.len() as u32,
            children_count: self.children.len() as u32,
            token: self.token,
        }
    }
}

/// The whole replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateMachine {
    nodes: imbl::OrdMap<String, Node>,
    sessions: imbl::OrdMap<SessionId, Session>,
    /// Recently ended sessions (bounded by [`wire::ENDED_SESSIONS_MAX`]), so a late
    /// request gets `SessionExpired` rather than `UnknownSession`.
    ended: imbl::OrdSet<SessionId>,
    /// Highest index applied.
    last_index: LogIndex,
    /// Admins, groups and the ACL table.
    security: Security,
    /// Open sessions per owner (for the limits per identity).
    owners: BTreeMap<String, u64>,
    /// The prefixes this cell has recorded (`wire::directory`): none while the cell is
    /// not part of a directory, and it then serves every path.
    prefixes: BTreeMap<String, (u64, PrefixState)>,
}

impl Default for StateMachine {
    fn default() -> Self {
        Self::new()
    }
}

/// How to undo one change of a multi-op transaction.
enum Undo {
    Node(String, Option<Node>),
    Ephemeral {
        session: SessionId,
        path: String,
        added: bool,
    },
}

impl StateMachine {
    /// An empty namespace holding only `/`.
    pub fn new() -> StateMachine {
        let mut nodes = imbl::OrdMap::new();
        nodes.insert(
            "/".to_string(),
            Node::new(Vec::new(), 0, None, security::ROOT_ACL_AT_START, 0),
        );
        StateMachine {
            nodes,
            sessions: imbl::OrdMap::new(),
            ended: imbl::OrdSet::new(),
            last_index: 0,
            security: Security::new(),
            owners: BTreeMap::new(),
            prefixes: BTreeMap::new(),
        }
    }

    /// A state bootstrapped without a log entry: `admins`, and the root's ACL. For tests
    /// of the state machine, whose indexes would shift with a bootstrap entry.
    #[cfg(test)]
    pub(crate) fn bootstrapped(admins: &[String], root_acl: &wire::acl::Acl) -> StateMachine {
        let mut sm = StateMachine::new();
        let root = sm.nodes.get_mut("/").expect("root");
        root.acl = sm
            .security
            .bootstrap(root.acl, admins, root_acl)
            .expect("a valid bootstrap");
        sm.security.sweep();
        sm
    }

    /// Panics unless the ACL table counts exactly the nodes that use each ACL.
    #[cfg(test)]
    pub(crate) fn assert_acl_counts(&self) {
        let mut actual = BTreeMap::new();
        for n in self.nodes.values() {
            *actual.entry(n.acl).or_insert(0u64) += 1;
        }
        assert_eq!(self.security.counts(), actual, "the ACL table's counts");
        let mut owners = BTreeMap::new();
        for s in self.sessions.values() {
            *owners.entry(s.owner.clone()).or_insert(0u64) += 1;
        }
        assert_eq!(self.owners, owners, "the sessions counted per owner");
    }

    /// The admins, groups and ACLs.
    pub fn security(&self) -> &Security {
        &self.security
    }

    /// A node's ACL.
    pub fn acl_of(&self, p: &str) -> Result<&wire::acl::Acl, Error> {
        path::validate(p)?;
        let n = self.nodes.get(p).ok_or_else(|| Error::NoNode {
            path: p.to_string(),
        })?;
        Ok(self.security.acl(n.acl))
    }

    /// Whether `identity` may read `p` (what a read served at this state checks): this
    /// cell serves the path ([`StateMachine::check_owned`]), and the read right on the node; a node that does not exist is readable (its absence is
    /// what any identity learns, as with ZooKeeper's `exists`). `Unavailable` before the
    /// bootstrap.
    pub fn check_read(&self, identity: &str, p: &str) -> Result<(), Error> {
        self.security.check_bootstrapped()?;
        self.check_owned(p, false)?;
        match self.nodes.get(p) {
            Some(n) => self.security.require(n.acl, Right::Read, identity, p),
            None => Ok(()),
        }
    }

    /// Whether applying a write of `session` with `request_id` would answer from the
    /// session's record rather than decide afresh (its first answer, or `StaleRequest`).
    pub fn has_answer(&self, session: SessionId, request_id: RequestId) -> bool {
        self.sessions
            .get(&session)
            .is_some_and(|s| s.results.contains_key(&request_id) || request_id < s.forgotten_below)
    }

    /// What applying `ops` for `session` (owned by `who`) would refuse for want of a
    /// right, judged at this state: the gateway refuses such a write early, before it
    /// holds cached copies or takes a log entry. Only ops whose node no earlier op of the
    /// transaction touches are judged (the others are decided at apply); apply decides
    /// in any case.
    pub fn precheck_write(
        &self,
        who: &str,
        session: SessionId,
        ops: &[TxnOp],
        single: bool,
    ) -> Result<(), Error> {
        self.security.check_bootstrapped()?;
        self.check_ops_owned(ops)?;
        let mut touched: BTreeSet<&str> = BTreeSet::new();
        for (i, op) in ops.iter().enumerate() {
            let (node, right) = match op {
                TxnOp::Create { path: p, .. } => (path::parent(p), Right::Create),
                TxnOp::SetData { path: p, .. } => (p.as_str(), Right::Write),
                TxnOp::Delete { path: p, .. } => (p.as_str(), Right::Write),
                TxnOp::Check { path: p, .. } => (p.as_str(), Right::Read),
            };
            let own_ephemeral = matches!(op, TxnOp::Delete { .. })
                && self
                    .nodes
                    .get(node)
                    .is_some_and(|n| n.ephemeral_owner == Some(session));
            if !touched.contains(node) && !own_ephemeral {
                if let Err(e) = self.check_right(who, node, right) {
                    return Err(if single {
                        e
                    } else {
                        Error::TxnFailed {
                            index: i,
                            error: Box::new(e),
                        }
                    });
                }
            }
            match op {
                TxnOp::Create { path: p, .. } | TxnOp::Delete { path: p, .. } => {
                    touched.insert(p.as_str());
                    touched.insert(path::parent(p));
                }
                TxnOp::SetData { .. } | TxnOp::Check { .. } => {}
            }
        }
        Ok(())
    }

    /// Whether `identity` holds `right` on the existing node `p` (`Ok` when it does not
    /// exist: what comes of that is decided where the node is needed).
    pub fn check_right(&self, identity: &str, p: &str, right: Right) -> Result<(), Error> {
        self.security.check_bootstrapped()?;
        match self.nodes.get(p) {
            Some(n) => self.security.require(n.acl, right, identity, p),
            None => Ok(()),
        }
    }

    /// A 64-bit xxh3 hash of the whole state's postcard encoding: every map here is
    /// ordered, so replicas holding the same state give the same digest, and any
    /// difference (a node's data, a version, a stored result, a session's mark) changes
    /// it. Streams the encoding into the hasher (no copy of the state).
    pub fn digest(&self) -> u64 {
        struct Hasher(xxhash_rust::xxh3::Xxh3);
        impl std::io::Write for Hasher {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.update(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut h = Hasher(xxhash_rust::xxh3::Xxh3::new());
        postcard::to_io(self, &mut h).expect("hashing cannot fail");
        h.0.digest()
    }

    /// Highest log index applied.
    pub fn last_index(&self) -> LogIndex {
        self.last_index
    }

    /// Number of nodes, `/` included.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Number of open sessions.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Open sessions with their recorded silence (see [`LeaseCheckpoint`]).
    pub fn sessions(&self) -> impl Iterator<Item = (SessionId, &Session)> {
        self.sessions.iter().map(|(id, s)| (*id, s))
    }

    /// Open sessions with ids above `after`, in id order (a page of `Op::Sessions`).
    pub fn sessions_after(&self, after: SessionId) -> impl Iterator<Item = (SessionId, &Session)> {
        use std::ops::Bound;
        self.sessions
            .range((Bound::Excluded(after), Bound::Unbounded))
            .map(|(id, s)| (*id, s))
    }

    /// How many sessions `owner` has open.
    pub fn sessions_of(&self, owner: &str) -> u64 {
        self.owners.get(owner).copied().unwrap_or(0)
    }

    /// One open session.
    pub fn session(&self, id: SessionId) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// Checks that `id` is an open session, with the error a client should see if not.
    pub fn check_session(&self, id: SessionId) -> Result<&Session, Error> {
        if let Some(s) = self.sessions.get(&id) {
            return Ok(s);
        }
        if id == 0 {
            return Err(Error::SessionRequired);
        }
        if self.ended.contains(&id)
            || (wire::types::session_index(id) <= self.last_index && self.is_forgotten_end(id))
        {
            return Err(Error::SessionExpired { session: id });
        }
        Err(Error::UnknownSession { session: id })
    }

    /// [`StateMachine::check_session`], and that `acting` may use the session (it is
    /// the owner, or a proxy's batch for a client's session): else
    /// [`Error::NotSessionOwner`].
    pub fn check_session_for(&self, id: SessionId, acting: &Acting) -> Result<&Session, Error> {
        let s = self.check_session(id)?;
        if acting.may_use(&s.owner) {
            Ok(s)
        } else {
            Err(Error::NotSessionOwner {
                session: id,
                identity: acting.identity.clone(),
            })
        }
    }

    /// [`StateMachine::check_session`], and that `acting` may read under the session
    /// ([`Acting::may_read_under`]: also a proxy forwarding a client's read under its
    /// own session): else [`Error::NotSessionOwner`].
    pub fn check_session_to_read(&self, id: SessionId, acting: &Acting) -> Result<&Session, Error> {
        let s = self.check_session(id)?;
        if acting.may_read_under(&s.owner) {
            Ok(s)
        } else {
            Err(Error::NotSessionOwner {
                session: id,
                identity: acting.identity.clone(),
            })
        }
    }

    /// True when `id` is below every remembered ended session while the ended set is full:
    /// it may have been a session whose end was forgotten.
    fn is_forgotten_end(&self, id: SessionId) -> bool {
        self.ended.len() >= wire::ENDED_SESSIONS_MAX
            && self.ended.get_min().is_some_and(|first| id < *first)
    }

    /// A node by path.
    pub fn node(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path)
    }

    /// Applies the entry at `index` as if appended in term 0 (no leader's term: a
    /// [`Command::Held`] in it applies as `NotLeader`). Returns the client's answer and
    /// what changed.
    pub fn apply(&mut self, index: LogIndex, cmd: &Command) -> (Result<Reply, Error>, Vec<Effect>) {
        self.apply_in_term(index, 0, cmd)
    }

    /// Applies the entry at `index`, appended by the leader of `term`. Returns the
    /// client's answer and what changed.
    pub fn apply_in_term(
        &mut self,
        index: LogIndex,
        term: u64,
        cmd: &Command,
    ) -> (Result<Reply, Error>, Vec<Effect>) {
        self.advance_to(index);
        let mut effects = Vec::new();
        let result = self.apply_command(index, term, cmd, Place::default(), &mut effects);
        self.security.sweep();
        (result, effects)
    }

    /// Entries apply in log order, each once.
    fn advance_to(&mut self, index: LogIndex) {
        assert!(
            index > self.last_index,
            "apply out of order: {index} after {}",
            self.last_index
        );
        self.last_index = index;
    }

    /// Applies a [`Command::Batch`] entry at `index`, appended by the leader of `term`:
    /// each command in order, all at this one index. Returns each command's answer and
    /// what changed. A command the [`BatchRule`] does not admit beside the earlier ones
    /// (a leader never proposes one) changes nothing and answers `Unavailable`, so its
    /// client retries it in an entry of its own.
    pub fn apply_batch_in_term(
        &mut self,
        index: LogIndex,
        term: u64,
        cmds: &[Command],
    ) -> (Vec<Result<Reply, Error>>, Vec<Effect>) {
        self.advance_to(index);
        let mut effects = Vec::new();
        let results = self.apply_batch(index, term, cmds, &mut effects);
        self.security.sweep();
        (results, effects)
    }

    fn apply_batch(
        &mut self,
        index: LogIndex,
        term: u64,
        cmds: &[Command],
        effects: &mut Vec<Effect>,
    ) -> Vec<Result<Reply, Error>> {
        let mut rule = BatchRule::default();
        cmds.iter()
            .map(|c| {
                let place = Place {
                    sessions: rule.sessions(),
                    creates: rule.creates(),
                };
                if rule.admit(c) {
                    self.apply_command(index, term, c, place, effects)
                } else {
                    Err(Error::Unavailable {
                        reason: "proposed in one entry with a command it may not share an \
                                 index with; retry"
                            .into(),
                    })
                }
            })
            .collect()
    }

    /// Applies one command at `index`, at `place` among the entry's commands.
    fn apply_command(
        &mut self,
        index: LogIndex,
        term: u64,
        cmd: &Command,
        place: Place,
        effects: &mut Vec<Effect>,
    ) -> Result<Reply, Error> {
        match cmd {
            Command::Batch(cmds) => {
                // Reached only through `apply_in_term` (whose caller wants one answer) or
                // a batch inside a held command, which no leader proposes: apply what the
                // rule admits, answer for the entry as a whole.
                self.apply_batch(index, term, cmds, effects);
                Ok(Reply::Closed)
            }
            Command::Held {
                term: held,
                command,
            } => {
                if *held != term {
                    // Held by a cacher list of another term: nothing it knew holds now.
                    return Err(Error::NotLeader {
                        leader_id: None,
                        leader_addr: None,
                    });
                }
                self.apply_command(index, term, command, place, effects)
            }
            Command::Noop => Ok(Reply::Closed),
            Command::CreateSession { owner } => {
                let id = wire::types::session_id(index, place.sessions);
                *self.owners.entry(owner.clone()).or_default() += 1;
                self.sessions.insert(
                    id,
                    Session {
                        owner: owner.clone(),
                        ..Session::default()
                    },
                );
                effects.push(Effect::SessionOpened { session: id });
                Ok(Reply::SessionCreated {
                    session: id,
                    session_lease_ms: 0,
                })
            }
            Command::CloseSession { session } => match self.check_session(*session) {
                Ok(_) => {
                    self.end_session(*session, index, effects);
                    Ok(Reply::Closed)
                }
                Err(e) => Err(e),
            },
            Command::ExpireSessions { sessions } => {
                for s in sessions {
                    if self.sessions.contains_key(s) {
                        self.end_session(*s, index, effects);
                    }
                }
                Ok(Reply::Closed)
            }
            Command::LeaseCheckpoint(cp) => {
                self.apply_checkpoint(cp);
                Ok(Reply::Closed)
            }
            Command::MarkCacher { session } => match self.sessions.get_mut(session) {
                Some(s) => {
                    s.caches = true;
                    Ok(Reply::Closed)
                }
                None => Err(self.check_session(*session).expect_err("not open")),
            },
            Command::Write {
                session,
                request_id,
                ack_below,
                ops,
                single,
            } => self.apply_write(
                (index, place.creates),
                *session,
                *request_id,
                *ack_below,
                ops,
                *single,
                effects,
            ),
            Command::Bootstrap { admins, root_acl } => {
                let root = self.nodes.get_mut("/").expect("the root exists");
                root.acl = self.security.bootstrap(root.acl, admins, root_acl)?;
                Ok(Reply::SecurityChanged { index })
            }
            Command::SetAcl { by, path: p, acl } => {
                self.security.check_bootstrapped()?;
                path::validate(p)?;
                // An ACL is part of the prefix's data: not changed where the prefix is
                // frozen (the copy would lose it) or not served.
                self.check_owned(p, true)?;
                acl.check().map_err(|reason| Error::BadRequest { reason })?;
                let n = self
                    .nodes
                    .get(p)
                    .ok_or_else(|| Error::NoNode { path: p.clone() })?;
                self.security.require(n.acl, Right::Admin, by, p)?;
                let old = n.acl;
                let id = self.security.replace(old, acl.clone());
                self.nodes.get_mut(p).expect("checked above").acl = id;
                Ok(Reply::SecurityChanged { index })
            }
            Command::SetGroup { by, name, members } => {
                self.security.set_group(by, name, members.as_deref())?;
                Ok(Reply::SecurityChanged { index })
            }
            Command::SetAdmin {
                by,
                identity,
                admin,
            } => {
                self.security.set_admin(by, identity, *admin)?;
                Ok(Reply::SecurityChanged { index })
            }
            Command::SetPrefix {
                by,
                prefix,
                epoch,
                state,
            } => {
                self.require_admin(by, "change the prefixes a cell owns")?;
                self.set_prefix(prefix, *epoch, *state)?;
                if *state == PrefixState::Gone {
                    // Locks and other ephemeral nodes are not copied: they end here, at
                    // the hand-over, so their holders hear of it (a `Deleted` event) and
                    // no sequencer of this cell stays current for the prefix.
                    self.drop_ephemerals(prefix, index, effects);
                }
                Ok(Reply::PrefixChanged { index })
            }
            Command::ImportPrefix {
                by,
                prefix,
                epoch,
                first,
                nodes,
            } => {
                self.require_admin(by, "import a prefix")?;
                self.import_prefix(index, prefix, *epoch, *first, nodes, effects)?;
                Ok(Reply::PrefixChanged { index })
            }
            Command::DropPrefix { by, prefix, epoch } => {
                self.require_admin(by, "drop a prefix")?;
                match self.prefixes.get(prefix) {
                    Some(&(e, PrefixState::Gone | PrefixState::Importing)) if e == *epoch => {}
                    other => {
                        return Err(Error::BadRequest {
                            reason: format!(
                                "{prefix} may be dropped only when gone or importing at epoch \
                                 {epoch}; it is {}",
                                prefixes::describe(other)
                            ),
                        })
                    }
                }
                self.drop_subtree(prefix, index, effects);
                Ok(Reply::PrefixChanged { index })
            }
        }
    }

    fn require_admin(&self, by: &str, action: &str) -> Result<(), Error> {
        self.security.check_bootstrapped()?;
        if self.security.is_admin(by) {
            Ok(())
        } else {
            Err(Error::NotAdmin {
                action: action.to_string(),
                identity: by.to_string(),
            })
        }
    }

    fn apply_checkpoint(&mut self, cp: &LeaseCheckpoint) {
        if cp.mark_all {
            self.change_sessions(|s| s.silent_ms.is_none(), |s| s.silent_ms = Some(0));
        }
        for id in &cp.renewed {
            if let Some(s) = self.sessions.get_mut(id) {
                s.silent_ms = None;
            }
        }
        if cp.silent_add_ms > 0 {
            self.change_sessions(
                |s| s.silent_ms.is_some(),
                |s| {
                    if let Some(ms) = s.silent_ms.as_mut() {
                        *ms = ms.saturating_add(cp.silent_add_ms);
                    }
                },
            );
        }
    }

    /// Applies `change` to every session `which` picks. A persistent map has no
    /// `values_mut`, and each `get_mut` copies its part of the map while a snapshot's
    /// copy shares it: only the sessions that change are looked up.
    fn change_sessions(&mut self, which: impl Fn(&Session) -> bool, change: impl Fn(&mut Session)) {
        let ids: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| which(s))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(s) = self.sessions.get_mut(&id) {
                change(s);
            }
        }
    }

    fn end_session(&mut self, id: SessionId, index: LogIndex, effects: &mut Vec<Effect>) {
        let session = self
            .sessions
            .remove(&id)
            .expect("end_session of an open session");
        if let Some(n) = self.owners.get_mut(&session.owner) {
            *n -= 1;
            if *n == 0 {
                self.owners.remove(&session.owner);
            }
        }
        // Children before parents cannot happen (ephemerals have no children), so any
        // order works; name order keeps effects deterministic.
        for p in &session.ephemerals {
            self.remove_node(p, index, effects);
        }
        self.ended.insert(id);
        while self.ended.len() > wire::ENDED_SESSIONS_MAX {
            self.ended.remove_min();
        }
        effects.push(Effect::SessionEnded { session: id });
    }

    fn remove_node(&mut self, p: &str, index: LogIndex, effects: &mut Vec<Effect>) {
        let node = self
            .nodes
            .remove(p)
            .expect("remove_node of an existing node");
        debug_assert!(node.children.is_empty(), "removing {p} with children");
        self.security.release(node.acl);
        let parent_path = path::parent(p);
        let parent = self
            .nodes
            .get_mut(parent_path)
            .expect("parent of an existing node");
        parent.children.remove(path::name(p));
        parent.children_version += 1;
        parent.children_index = index;
        effects.push(Effect::Deleted {
            path: p.to_string(),
        });
        effects.push(Effect::ChildrenChanged {
            path: parent_path.to_string(),
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn apply_write(
        &mut self,
        at: (LogIndex, u64),
        session_id: SessionId,
        request_id: RequestId,
        ack_below: RequestId,
        ops: &[TxnOp],
        single: bool,
        effects: &mut Vec<Effect>,
    ) -> Result<Reply, Error> {
        // Nothing is decided before the cell's ACLs exist: not applied and not
        // remembered, so the client's retry is evaluated afresh once they do.
        self.security.check_bootstrapped()?;
        let session = match self.sessions.get_mut(&session_id) {
            Some(s) => s,
            None => return Err(self.check_session(session_id).expect_err("not open")),
        };
        if let Some(stored) = session.results.get(&request_id) {
            return stored.clone();
        }
        if request_id < session.forgotten_below {
            return Err(Error::StaleRequest {
                session: session_id,
                request_id,
            });
        }
        // A prefix this cell does not serve, or one frozen for a move: not applied and not
        // remembered (like the window check below), so a retry is evaluated afresh here,
        // and the same write may go to the prefix's new cell.
        self.check_ops_owned(ops)?;
        let session = self.sessions.get_mut(&session_id).expect("checked above");
        session.forget_below(ack_below.min(request_id));
        if session.window_full() {
            // Not applied and not remembered: a retry is evaluated afresh.
            return Err(Error::TooManyRequests {
                session: session_id,
                max: wire::DEDUP_RESULTS_MAX,
            });
        }

        // The session's owner writes: only it may use the session (checked at the
        // gateway, for good: an owner never changes), and its rights are checked here,
        // against the ACLs as they are at this entry.
        let who = session.owner.clone();
        let result = self.execute(at, session_id, &who, ops, single, effects);
        let session = self
            .sessions
            .get_mut(&session_id)
            .expect("session still open");
        session.remember(request_id, result.clone());
        result
    }

    /// Executes `ops` at `(index, position)`: the entry's index and the position its
    /// first create takes among the entry's creates; each create op takes the next.
    fn execute(
        &mut self,
        (index, position): (LogIndex, u64),
        session: SessionId,
        who: &str,
        ops: &[TxnOp],
        single: bool,
        effects: &mut Vec<Effect>,
    ) -> Result<Reply, Error> {
        validate_write(ops, single)?;
        if single {
            let mut undo = None;
            let at = (index, position);
            return match self.execute_op(at, session, who, &ops[0], &mut undo, effects) {
                Ok(TxnResult::Created { path, stat }) => {
                    let predecessor = if ops_is_sequential(&ops[0]) {
                        self.predecessor(&path)
                    } else {
                        None
                    };
                    Ok(Reply::Created {
                        path,
                        stat,
                        predecessor,
                    })
                }
                Ok(TxnResult::Deleted) => Ok(Reply::Deleted),
                Ok(TxnResult::Set { stat }) => Ok(Reply::Set { stat }),
                Ok(TxnResult::Checked) => Ok(Reply::Txn {
                    results: vec![TxnResult::Checked],
                }),
                Err(e) => Err(e),
            };
        }
        let mut undo = Some(Vec::new());
        let mut txn_effects = Vec::new();
        let mut results = Vec::with_capacity(ops.len());
        let mut next = position;
        for (i, op) in ops.iter().enumerate() {
            let at = (index, next);
            if matches!(op, TxnOp::Create { .. }) {
                next += 1;
            }
            match self.execute_op(at, session, who, op, &mut undo, &mut txn_effects) {
                Ok(r) => results.push(r),
                Err(e) => {
                    self.rollback(undo.take().unwrap_or_default());
                    return Err(Error::TxnFailed {
                        index: i,
                        error: Box::new(e),
                    });
                }
            }
        }
        effects.extend(txn_effects);
        Ok(Reply::Txn { results })
    }

    fn rollback(&mut self, undo: Vec<Undo>) {
        for u in undo.into_iter().rev() {
            match u {
                // Each node holds one use of its ACL: retained before released, so an
                // ACL both nodes use is not dropped in between.
                Undo::Node(p, Some(n)) => {
                    self.security.retain(n.acl);
                    if let Some(old) = self.nodes.insert(p, n) {
                        self.security.release(old.acl);
                    }
                }
                Undo::Node(p, None) => {
                    if let Some(old) = self.nodes.remove(&p) {
                        self.security.release(old.acl);
                    }
                }
                Undo::Ephemeral {
                    session,
                    path,
                    added,
                } => {
                    if let Some(s) = self.sessions.get_mut(&session) {
                        if added {
                            s.ephemerals.remove(&path);
                        } else {
                            s.ephemerals.insert(path);
                        }
                    }
                }
            }
        }
    }

    fn save(&self, undo: &mut Option<Vec<Undo>>, p: &str) {
        if let Some(u) = undo {
            u.push(Undo::Node(p.to_string(), self.nodes.get(p).cloned()));
        }
    }

    /// Executes one op at `(index, position)` (the position is a create's).
    fn execute_op(
        &mut self,
        (index, position): (LogIndex, u64),
        session: SessionId,
        who: &str,
        op: &TxnOp,
        undo: &mut Option<Vec<Undo>>,
        effects: &mut Vec<Effect>,
    ) -> Result<TxnResult, Error> {
        match op {
            TxnOp::Check { path: p, version } => {
                path::validate(p)?;
                let n = self
                    .nodes
                    .get(p)
                    .ok_or_else(|| Error::NoNode { path: p.clone() })?;
                self.security.require(n.acl, Right::Read, who, p)?;
                check_version(p, n, *version)?;
                Ok(TxnResult::Checked)
            }
            TxnOp::Create {
                path: p,
                data,
                mode,
            } => self.create(
                (index, position),
                session,
                who,
                p,
                data,
                *mode,
                undo,
                effects,
            ),
            TxnOp::Delete { path: p, version } => {
                path::validate(p)?;
                if p == "/" {
                    return Err(Error::RootNode {
                        action: "deleted".into(),
                    });
                }
                let n = self
                    .nodes
                    .get(p)
                    .ok_or_else(|| Error::NoNode { path: p.clone() })?;
                // A session may always delete its own ephemeral nodes: a lock holder
                // releases where it may only create.
                if n.ephemeral_owner != Some(session) {
                    self.security.require(n.acl, Right::Write, who, p)?;
                }
                check_version(p, n, *version)?;
                if !n.children.is_empty() {
                    return Err(Error::NotEmpty { path: p.clone() });
                }
                let owner = n.ephemeral_owner;
                self.save(undo, p);
                self.save(undo, path::parent(p));
                if let Some(owner) = owner {
                    if let Some(s) = self.sessions.get_mut(&owner) {
                        s.ephemerals.remove(p);
                    }
                    if let Some(u) = undo {
                        u.push(Undo::Ephemeral {
                            session: owner,
                            path: p.clone(),
                            added: false,
                        });
                    }
                }
                self.remove_node(p, index, effects);
                Ok(TxnResult::Deleted)
            }
            TxnOp::SetData {
                path: p,
                data,
                version,
            } => {
                path::validate(p)?;
                check_value(data)?;
                if p == "/" {
                    return Err(Error::RootNode {
                        action: "written".into(),
                    });
                }
                let n = self
                    .nodes
                    .get(p)
                    .ok_or_else(|| Error::NoNode { path: p.clone() })?;
                self.security.require(n.acl, Right::Write, who, p)?;
                check_version(p, n, *version)?;
                self.save(undo, p);
                let n = self.nodes.get_mut(p).expect("checked above");
                n.data = data.clone();
                n.version += 1;
                n.mod_index = index;
                let stat = n.stat();
                effects.push(Effect::DataChanged { path: p.clone() });
                Ok(TxnResult::Set { stat })
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        &mut self,
        (index, position): (LogIndex, u64),
        session: SessionId,
        who: &str,
        p: &str,
        data: &[u8],
        mode: CreateMode,
        undo: &mut Option<Vec<Undo>>,
        effects: &mut Vec<Effect>,
    ) -> Result<TxnResult, Error> {
        if p == "/" {
            return Err(Error::RootNode {
                action: "created".into(),
            });
        }
        path::validate_create(p, data, mode)?;
        let parent_path = path::parent(p).to_string();
        let parent = self.nodes.get(&parent_path).ok_or_else(|| Error::NoNode {
            path: parent_path.clone(),
        })?;
        self.security
            .require(parent.acl, Right::Create, who, &parent_path)?;
        if parent.ephemeral_owner.is_some() {
            return Err(Error::EphemeralParent { path: parent_path });
        }
        let full = if mode.sequential {
            format!(
                "{p}{:0width$}",
                parent.sequence_next,
                width = SEQUENCE_DIGITS
            )
        } else {
            p.to_string()
        };
        if mode.sequential && parent_path == "/" {
            // The node's name, not the request's, is its prefix.
            self.check_owned(&full, true)?;
        }
        if self.nodes.contains_key(&full) {
            return Err(Error::NodeExists { path: full });
        }
        self.save(undo, &parent_path);
        self.save(undo, &full);
        let owner = mode.ephemeral.then_some(session);
        // Inherited at create: the parent's ACL.
        let acl = parent.acl;
        let token =
            wire::directory::token(self.epoch_of(&full), index, position).ok_or_else(|| {
                Error::BadRequest {
                    reason: format!(
                        "no fencing token for {full}: its prefix's epoch, this index or its \
                     position in the entry ({position}) is out of range"
                    ),
                }
            })?;
        let parent = self.nodes.get_mut(&parent_path).expect("checked above");
        if mode.sequential {
            parent.sequence_next += 1;
        }
        parent.children.insert(path::name(&full).to_string());
        parent.children_version += 1;
        parent.children_index = index;
        self.security.retain(acl);
        let node = Node::new(data.to_vec(), index, owner, acl, token);
        let stat = node.stat();
        self.nodes.insert(full.clone(), node);
        if let Some(owner) = owner {
            self.sessions
                .get_mut(&owner)
                .expect("writer is open")
                .ephemerals
                .insert(full.clone());
            if let Some(u) = undo {
                u.push(Undo::Ephemeral {
                    session: owner,
                    path: full.clone(),
                    added: true,
                });
            }
        }
        effects.push(Effect::Created { path: full.clone() });
        effects.push(Effect::ChildrenChanged { path: parent_path });
        Ok(TxnResult::Created { path: full, stat })
    }
}

/// The sequence number at the end of a sequential node's name.
///
/// Works on bytes: a name may end in multi-byte characters, and slicing a `str` inside
/// one would panic during apply, on every replica, at every replay.
pub fn sequence_of(name: &str) -> Option<u64> {
    let bytes = name.as_bytes();
    if bytes.len() < SEQUENCE_DIGITS {
        return None;
    }
    let tail = &bytes[bytes.len() - SEQUENCE_DIGITS..];
    if !tail.iter().all(|b| b.is_ascii_digit()) {
        return None;
    }
    tail.iter().try_fold(0u64, |acc, b| {
        acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

fn ops_is_sequential(op: &TxnOp) -> bool {
    matches!(op, TxnOp::Create { mode, .. } if mode.sequential)
}

fn check_version(p: &str, n: &Node, expected: Option<u64>) -> Result<(), Error> {
    match expected {
        Some(v) if v != n.version => Err(Error::BadVersion {
            path: p.to_string(),
            expected: v,
            actual: n.version,
        }),
        _ => Ok(()),
    }
}
