//! Messages more than one actor handles: what the Raft node announces and what the
//! state machine's apply publishes. They live apart from every actor so that no actor
//! imports another for them (the session manager, the watch table and the cacher list
//! all take both).

use actix::Message;

use crate::raft::sm_store::Applied;

/// Sent to subscribers when this replica starts or stops leading.
#[derive(Message, Clone, Debug)]
#[rtype(result = "()")]
pub struct LeadershipChanged {
    /// True when this replica now leads.
    pub leading: bool,
    /// The term.
    pub term: u64,
    /// This replica's last log index when the change was seen: every session created by an
    /// earlier leader was opened by an entry at or below it ([`wire::types::session_index`]).
    pub last_log_index: u64,
}

/// Effects of applied entries (from the state-machine store's channel).
#[derive(Message)]
#[rtype(result = "()")]
pub struct AppliedMsg(pub Applied);
