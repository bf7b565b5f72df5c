//! Entries of the replicated log and what applying them returns.
//!
//! Only these are logged: session create/close/expire, lease checkpoints, node writes
//! (create, delete, set data, transactions) and no-ops. KeepAlives, reads and watch
//! registrations never touch the log.

use std::cell::Cell;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::Error;
use crate::types::{Reply, RequestId, SessionId, TxnOp};

/// One application entry of the Raft log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Does nothing (a leader's first entry, or a barrier).
    Noop,
    /// Opens a session; its id is [`crate::types::session_id`] of this entry's log index
    /// and the number of sessions the entry opened before it.
    CreateSession {
        /// The identity that opened it (a `lock://` URI: the client's, also when a proxy
        /// forwarded the request, or the proxy's own): the only one that may use it.
        owner: String,
    },
    /// Ends a session at the client's request; its ephemeral nodes are deleted.
    CloseSession {
        /// The session.
        session: SessionId,
    },
    /// Ends sessions whose lease ran out at the leader; their ephemerals are deleted here,
    /// at this one log position on every replica.
    ExpireSessions {
        /// The sessions.
        sessions: Vec<SessionId>,
    },
    /// A node write from a session, deduplicated by (session, request id).
    Write {
        /// The writing session.
        session: SessionId,
        /// Its request id.
        request_id: RequestId,
        /// Results for ids below this may be forgotten.
        ack_below: RequestId,
        /// The write itself: a transaction of one or more ops.
        ops: Vec<TxnOp>,
        /// True when the client sent a single op (the reply is then that op's own reply
        /// rather than a transaction result).
        single: bool,
    },
    /// Lease bookkeeping that lets a dead client's session expire even when leaders change
    /// faster than the lease (see `replica/src/leader/leases.rs`).
    LeaseCheckpoint(LeaseCheckpoint),
    /// The session has started caching values. Logged once per session, before its first
    /// cached read is answered, so that after a fail-over the new leader knows which
    /// sessions may hold cached values (only those must confirm a flush before writes to
    /// cachable nodes proceed).
    MarkCacher {
        /// The session.
        session: SessionId,
    },
    /// `command`, proposed after the leader of term `term` held it until every cacher of
    /// the nodes it changes dropped them (Chubby's rule). Applied only if this entry was
    /// appended in that same term: the cacher list the hold consulted is the leader's own
    /// and volatile, so in any other term (the replica lost leadership and won it again
    /// while the proposal was on its way) the hold proves nothing, and the entry applies
    /// as a `NotLeader` error that changes nothing (the client retries).
    Held {
        /// The term of the leader whose cacher list held the write.
        term: u64,
        /// What is applied.
        #[serde(deserialize_with = "held_command")]
        command: Box<Command>,
    },
    /// Commands proposed together, applied in order at this one log index, each with its
    /// own answer ([`CommandOutput::batch`]). The leader coalesces the proposals that
    /// arrive while earlier entries are in flight (openraft 0.9 appends and syncs each
    /// entry alone). Each create gets its own fencing token from the entry's index and its
    /// position among the entry's creates, so a batch holds at most
    /// [`crate::directory::CREATES_PER_ENTRY`] create ops and
    /// [`crate::types::SESSIONS_PER_ENTRY`] `CreateSession`s ([`BatchRule`]); a batch holds
    /// no batch.
    Batch(#[serde(deserialize_with = "batch_commands")] Vec<Command>),
    /// The cell's first security settings: its admins and the root's ACL, from the first
    /// leader's configuration (`[security]`). Applies once; a later one (a second leader
    /// that proposed it before seeing the first applied) changes nothing. Until it has
    /// applied, writes and reads that need an ACL answer `Unavailable`.
    Bootstrap {
        /// The cell admins (identity URIs).
        admins: Vec<String>,
        /// The root node's ACL, which every node created later inherits unless changed.
        root_acl: crate::acl::Acl,
    },
    /// Replaces a node's ACL, if `by` holds the admin right on it (or is a cell admin).
    SetAcl {
        /// The acting identity (from its certificate, never from the request).
        by: String,
        /// The node.
        path: String,
        /// Its new ACL.
        acl: crate::acl::Acl,
    },
    /// Creates or replaces a group (`members: Some`) or removes it (`None`), if `by` is a
    /// cell admin.
    SetGroup {
        /// The acting identity.
        by: String,
        /// The group's name.
        name: String,
        /// Its members, or `None` to remove it.
        members: Option<Vec<String>>,
    },
    /// Adds or removes a cell admin, if `by` is one (the last admin stays).
    SetAdmin {
        /// The acting identity.
        by: String,
        /// The identity added or removed.
        identity: String,
        /// True to add, false to remove.
        admin: bool,
    },
    /// Records where a prefix stands in this cell (`wire::directory`), if `by` is a cell
    /// admin and the change is one a move makes (see `PrefixState`); setting what is
    /// already recorded changes nothing and succeeds, so a re-run move goes on.
    SetPrefix {
        /// The acting identity.
        by: String,
        /// The prefix (`/payments`).
        prefix: String,
        /// Its epoch.
        epoch: u64,
        /// Its new state.
        state: crate::directory::PrefixState,
    },
    /// Copies nodes of a prefix being imported (state `Importing` at `epoch`) into this
    /// cell, parents before children, if `by` is a cell admin. `first` drops what an
    /// earlier, interrupted copy left first.
    ImportPrefix {
        /// The acting identity.
        by: String,
        /// The prefix.
        prefix: String,
        /// Its epoch here (must be the recorded one).
        epoch: u64,
        /// The first chunk of a copy.
        first: bool,
        /// The nodes, in path order.
        nodes: Vec<crate::directory::ExportedNode>,
    },
    /// Deletes every node of a prefix that is `Gone` (moved out) or `Importing` at
    /// `epoch`, ephemeral ones included, if `by` is a cell admin.
    DropPrefix {
        /// The acting identity.
        by: String,
        /// The prefix.
        prefix: String,
        /// Its recorded epoch.
        epoch: u64,
    },
}

/// Commands nested in commands, at most: what the leader proposes nests no deeper than a
/// batch of held writes (`Batch` of `Held { Write }`). Decoding refuses a deeper command,
/// and a `Batch` anywhere but at the top (a batch holds no batch), before recursing into
/// it: postcard decodes a nested command by recursing once per level, and a crafted peer
/// frame nested 100 000 deep overflowed a replica's stack (`replica/tests/bounds.rs`).
/// [`crate::decode::from_bytes`] reports the refusal as
/// [`Error::LimitExceeded`] with [`crate::error::Bound::CommandNesting`].
pub const COMMAND_NESTING_MAX: u8 = 2;

thread_local! {
    /// How many `Held`/`Batch` levels the command being decoded on this thread is in.
    static NESTING: Cell<u8> = const { Cell::new(0) };
    /// Set when a decode on this thread refused a command for its nesting.
    static NESTING_EXCEEDED: Cell<bool> = const { Cell::new(false) };
}

/// Clears the refusal flag before a decode.
pub(crate) fn nesting_reset() {
    NESTING_EXCEEDED.with(|c| c.set(false));
}

/// Whether the last decode on this thread refused a command for its nesting (and the
/// limit it passed); clears the flag.
pub(crate) fn nesting_exceeded() -> Option<u64> {
    NESTING_EXCEEDED
        .with(|c| c.replace(false))
        .then_some(COMMAND_NESTING_MAX as u64)
}

/// Restores the nesting level when a nested decode returns (or unwinds).
struct NestingGuard(u8);

impl Drop for NestingGuard {
    fn drop(&mut self) {
        NESTING.with(|c| c.set(self.0));
    }
}

fn nested<T, E: serde::de::Error>(batch: bool, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let level = NESTING.with(Cell::get);
    if level >= COMMAND_NESTING_MAX || (batch && level > 0) {
        NESTING_EXCEEDED.with(|c| c.set(true));
        return Err(E::custom("commands nested too deep"));
    }
    NESTING.with(|c| c.set(level + 1));
    let _restore = NestingGuard(level);
    f()
}

fn held_command<'de, D: Deserializer<'de>>(d: D) -> Result<Box<Command>, D::Error> {
    nested(false, || Box::<Command>::deserialize(d))
}

fn batch_commands<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Command>, D::Error> {
    nested(true, || Vec::<Command>::deserialize(d))
}

/// What openraft's logs show of an entry (openraft 0.10 requires `Display` of its
/// application data): the command's kind and approximate size, never its contents (a
/// batch may hold a megabyte, and node data may be anything).
impl std::fmt::Display for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Command::Noop => "Noop",
            Command::CreateSession { .. } => "CreateSession",
            Command::CloseSession { .. } => "CloseSession",
            Command::ExpireSessions { .. } => "ExpireSessions",
            Command::Write { .. } => "Write",
            Command::LeaseCheckpoint { .. } => "LeaseCheckpoint",
            Command::MarkCacher { .. } => "MarkCacher",
            Command::Held { .. } => "Held",
            Command::Batch { .. } => "Batch",
            Command::Bootstrap { .. } => "Bootstrap",
            Command::SetAcl { .. } => "SetAcl",
            Command::SetGroup { .. } => "SetGroup",
            Command::SetAdmin { .. } => "SetAdmin",
            Command::SetPrefix { .. } => "SetPrefix",
            Command::ImportPrefix { .. } => "ImportPrefix",
            Command::DropPrefix { .. } => "DropPrefix",
        };
        write!(f, "{kind}(~{} B)", self.approx_bytes())
    }
}

impl Command {
    /// About how many bytes this command adds to a log entry (its paths and data, plus a
    /// little for the rest): cheap, for the limits on a batch and on one AppendEntries.
    pub fn approx_bytes(&self) -> usize {
        match self {
            Command::Held { command, .. } => command.approx_bytes(),
            Command::Batch(cmds) => 16 + cmds.iter().map(Command::approx_bytes).sum::<usize>(),
            Command::Write { ops, .. } => {
                ops.iter()
                    .map(|op| {
                        64 + match op {
                            TxnOp::Create { path, data, .. }
                            | TxnOp::SetData { path, data, .. } => path.len() + data.len(),
                            TxnOp::Check { path, .. } | TxnOp::Delete { path, .. } => path.len(),
                        }
                    })
                    .sum()
            }
            Command::ExpireSessions { sessions } => 16 + 8 * sessions.len(),
            Command::CreateSession { owner } => 32 + owner.len(),
            Command::Bootstrap { admins, root_acl } => {
                32 + admins.iter().map(String::len).sum::<usize>() + acl_bytes(root_acl)
            }
            Command::SetAcl { by, path, acl } => 32 + by.len() + path.len() + acl_bytes(acl),
            Command::SetGroup { by, name, members } => {
                32 + by.len()
                    + name.len()
                    + members.iter().flatten().map(|m| 1 + m.len()).sum::<usize>()
            }
            Command::SetAdmin { by, identity, .. } => 32 + by.len() + identity.len(),
            Command::SetPrefix { by, prefix, .. } | Command::DropPrefix { by, prefix, .. } => {
                32 + by.len() + prefix.len()
            }
            Command::ImportPrefix {
                by, prefix, nodes, ..
            } => {
                32 + by.len()
                    + prefix.len()
                    + nodes
                        .iter()
                        .map(|n| 48 + n.path.len() + n.data.len() + acl_bytes(&n.acl))
                        .sum::<usize>()
            }
            Command::LeaseCheckpoint(cp) => 64 + 8 * cp.renewed.len(),
            _ => 32,
        }
    }
}

fn acl_bytes(acl: &crate::acl::Acl) -> usize {
    crate::acl::Right::ALL
        .iter()
        .flat_map(|r| acl.entries(*r))
        .map(|p| 2 + p.to_string().len())
        .sum()
}

/// Which commands may share one [`Command::Batch`]: at most
/// [`crate::types::SESSIONS_PER_ENTRY`] `CreateSession`s (each gets the next id of the
/// entry's range) and at most [`crate::directory::CREATES_PER_ENTRY`] create ops (each
/// gets the next token of the entry's range, [`crate::directory::token`]). Creates under
/// one parent share an entry freely: their tokens differ by position. The leader forms
/// batches with it, and applying a batch checks it again, so a batch that breaks it
/// applies only the commands it admits.
#[derive(Debug, Default)]
pub struct BatchRule {
    sessions: u64,
    creates: u64,
}

impl BatchRule {
    /// Whether `cmd` may join the commands admitted so far; if so, it is admitted.
    pub fn admit(&mut self, cmd: &Command) -> bool {
        match Self::inner(cmd) {
            Command::Batch(_) => false,
            Command::CreateSession { .. } if self.sessions >= crate::types::SESSIONS_PER_ENTRY => {
                false
            }
            Command::CreateSession { .. } => {
                self.sessions += 1;
                true
            }
            Command::Write { ops, .. } => {
                let creates = Self::creates_in(ops);
                if self.creates + creates > crate::directory::CREATES_PER_ENTRY {
                    return false;
                }
                self.creates += creates;
                true
            }
            _ => true,
        }
    }

    /// How many create ops `ops` holds (each takes one position of its entry, whether it
    /// succeeds or not).
    pub fn creates_in(ops: &[TxnOp]) -> u64 {
        ops.iter()
            .filter(|op| matches!(op, TxnOp::Create { .. }))
            .count() as u64
    }

    /// How many create ops were admitted so far: the position of the next command's
    /// first create.
    pub fn creates(&self) -> u64 {
        self.creates
    }

    /// How many `CreateSession`s were admitted so far.
    pub fn sessions(&self) -> u64 {
        self.sessions
    }

    fn inner(cmd: &Command) -> &Command {
        match cmd {
            Command::Held { command, .. } => Self::inner(command),
            other => other,
        }
    }
}

/// Lease facts a leader commits so that the next leader may grant less than a full lease.
///
/// The rule: once a session is marked *silent* in the log, no leader acknowledges a
/// KeepAlive for it until a `renewed` entry naming it has committed. A new leader may
/// therefore give a silent session only `lease − silent_ms` instead of a full lease.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseCheckpoint {
    /// Mark every open session silent with 0 ms of silence (a new leader does this when it
    /// takes over; live sessions clear the mark with their next KeepAlive).
    pub mark_all: bool,
    /// Sessions that renewed: their silent mark is cleared (applied before
    /// `silent_add_ms`).
    pub renewed: Vec<SessionId>,
    /// Every session still marked silent (after `renewed` is applied) has been silent this
    /// many milliseconds longer than recorded: the leader's time since its previous
    /// silence checkpoint (or since its `mark_all` committed), a lower bound. One number
    /// for every marked session keeps the entry a few bytes long however many sessions a
    /// fail-over marked (a list of 50 000 was ~400 KB per entry).
    pub silent_add_ms: u64,
}

/// What applying one log entry returned to its proposer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandOutput {
    /// The answer to send back to the client.
    pub result: Result<Reply, Error>,
    /// For a [`Command::Batch`], each command's answer, in order (empty otherwise).
    #[serde(default)]
    pub batch: Vec<Result<Reply, Error>>,
}

impl Default for CommandOutput {
    fn default() -> Self {
        CommandOutput {
            result: Ok(Reply::Closed),
            batch: Vec::new(),
        }
    }
}

/// Something a committed entry changed, for the watch table and cacher list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Effect {
    /// A node was created.
    Created {
        /// Its path.
        path: String,
    },
    /// A node's data changed.
    DataChanged {
        /// Its path.
        path: String,
    },
    /// A node was deleted.
    Deleted {
        /// Its path.
        path: String,
    },
    /// A node's set of children changed.
    ChildrenChanged {
        /// The parent's path.
        path: String,
    },
    /// A session opened.
    SessionOpened {
        /// The session.
        session: SessionId,
    },
    /// A session ended (closed or expired).
    SessionEnded {
        /// The session.
        session: SessionId,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{from_bytes, Limits};
    use crate::error::Bound;

    fn decode(bytes: &[u8]) -> Result<Command, Error> {
        from_bytes::<Command>(bytes, Limits::for_frame(1 << 20)).map(|(c, _)| c)
    }

    fn held(c: Command) -> Command {
        Command::Held {
            term: 3,
            command: Box::new(c),
        }
    }

    /// What the leader proposes decodes: a held write, a batch of plain and held
    /// commands.
    #[test]
    fn what_the_leader_proposes_decodes() {
        for c in [
            held(Command::CloseSession { session: 5 }),
            Command::Batch(vec![
                Command::CreateSession {
                    owner: "lock://client/test".into(),
                },
                held(Command::MarkCacher { session: 9 }),
            ]),
        ] {
            let bytes = postcard::to_allocvec(&c).unwrap();
            assert_eq!(decode(&bytes).unwrap(), c);
            // And through plain postcard (the log store's reads), too.
            assert_eq!(postcard::from_bytes::<Command>(&bytes).unwrap(), c);
        }
    }

    /// A batch inside a batch or a held batch, and three levels of `Held`, are refused
    /// with the typed error; nothing deeper is even looked at.
    #[test]
    fn deeper_nesting_is_refused() {
        let refused = Error::LimitExceeded {
            bound: Bound::CommandNesting,
            limit: COMMAND_NESTING_MAX as u64,
        };
        for c in [
            Command::Batch(vec![Command::Batch(vec![Command::Noop])]),
            held(Command::Batch(vec![Command::Noop])),
            held(held(held(Command::Noop))),
        ] {
            let bytes = postcard::to_allocvec(&c).unwrap();
            assert_eq!(decode(&bytes).unwrap_err(), refused, "{c:?}");
        }
        // 100 000 levels of `Held` ([7, term 0] each): refused at the third.
        let mut deep = [7u8, 0].repeat(100_000);
        deep.push(0);
        assert_eq!(decode(&deep).unwrap_err(), refused);
        // The level is restored after a refusal: the next decode on this thread is fine.
        let ok = postcard::to_allocvec(&held(Command::Noop)).unwrap();
        assert!(decode(&ok).is_ok());
    }
}
