//! A session's replicated record.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use wire::types::{Reply, RequestId};
use wire::Error;

/// What every replica knows about one open session. Lease deadlines are *not* here: they
/// live only in the leader's memory (`crate::leader::leases`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    /// The identity that opened the session (`lock://` URI): the only one that may use it
    /// ([`Acting::may_use`]).
    pub owner: String,
    /// Paths of the session's ephemeral nodes.
    pub ephemerals: BTreeSet<String>,
    /// Stored results by request id, not yet acknowledged by the client (at most
    /// [`wire::DEDUP_RESULTS_MAX`]).
    pub results: BTreeMap<RequestId, Result<Reply, Error>>,
    /// Results of request ids below this were forgotten.
    pub forgotten_below: RequestId,
    /// `Some(ms)`: the session is marked silent in the log, with at least `ms` of proven
    /// silence. No leader acknowledges its KeepAlives until a checkpoint clears the mark.
    pub silent_ms: Option<u64>,
    /// The session has cached values (see `Command::MarkCacher`).
    pub caches: bool,
}

/// Who asks to use a session: what [`crate::state_machine::StateMachine::check_session_for`]
/// checks against the session's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acting {
    /// The identity the request acts as (`wire::serve::Caller::acting_as`: the client a
    /// proxy forwards for, else the connection's own); empty for none.
    pub identity: String,
    /// The request is a proxy's own batch of KeepAlives or acknowledgements for its
    /// clients' sessions: it may renew or acknowledge for any session a client owns (the
    /// proxy checked each client against the owner before batching).
    pub proxy_batch: bool,
    /// For a request a proxy forwarded, the proxy's own identity. A proxy reads for its
    /// clients under its own session (cached reads it serves, watches it relays), with
    /// the client's rights checked: [`Acting::may_read_under`].
    pub forwarded_by: Option<String>,
}

impl Acting {
    /// Whether this caller may read (and arm watches, and cache) under a session owned by
    /// `owner`: as [`Acting::may_use`], or the session is the forwarding proxy's own.
    /// Never for writes, closes or renewals: those stay the owner's.
    pub fn may_read_under(&self, owner: &str) -> bool {
        self.may_use(owner) || self.forwarded_by.as_deref() == Some(owner)
    }

    /// Whether this caller may use a session owned by `owner`.
    pub fn may_use(&self, owner: &str) -> bool {
        (!self.identity.is_empty() && self.identity == owner)
            || (self.proxy_batch
                && matches!(
                    wire::identity::Identity::parse(owner),
                    Ok(wire::identity::Identity::Client { .. })
                ))
    }
}

impl Session {
    /// Forgets results of requests below `below` (the client has their answers).
    pub fn forget_below(&mut self, below: RequestId) {
        if below <= self.forgotten_below {
            return;
        }
        self.forgotten_below = below;
        self.results = self.results.split_off(&below);
    }

    /// True when no further result can be remembered until the client acknowledges some.
    pub fn window_full(&self) -> bool {
        self.results.len() >= wire::DEDUP_RESULTS_MAX
    }

    /// Remembers one result until the client acknowledges it.
    pub fn remember(&mut self, request_id: RequestId, result: Result<Reply, Error>) {
        debug_assert!(!self.window_full(), "caller checks window_full");
        self.results.insert(request_id, result);
    }
}
