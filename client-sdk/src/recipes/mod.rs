//! Recipes built from sessions, ephemeral sequential nodes and one-shot watches. Each is a
//! short module over a [`crate::Session`].
//!
//! - [`lock`]: exclusive and shared (read/write) locks with fencing tokens.
//! - [`election`]: leader election with the leader's address in its node.
//! - [`membership`]: a group of ephemeral members, listed with a watch.
//! - [`config`]: values with compare-and-set on the version, and watches.

pub mod config;
pub mod election;
pub mod lock;
pub mod membership;

use std::time::Duration;
use tokio::time::Instant;

use wire::types::{Op, Reply};
use wire::Error;

use crate::client::unexpected;
use crate::session::{outcome_unknown, RequestSlot, Session};

/// A node a recipe is creating, or has created and not yet handed to its caller: a lock
/// contender's node until it is granted, a member's node until the join returns. If the
/// recipe ends without settling it (an error, a deadline, its future dropped), the node is
/// removed in the background, so it never blocks a queue or lists a member nobody
/// believes joined.
///
/// It is armed before the create is sent. If the create's outcome is still unknown then
/// (its answer lost, or its future dropped in flight), the background task sends the same
/// create again under the same request id: the cell's dedup answers with the outcome of
/// the first send that applied, or applies it now, and either way the task learns the
/// node's path and deletes it. It never creates a second node. It keeps trying while the
/// outcome is unknown, until the session is over (its ephemerals are gone with it then).
pub(crate) struct Pending {
    session: Session,
    state: State,
}

enum State {
    /// Nothing to remove: never created, handed over, or already removed.
    Settled,
    /// The create was (or is about to be) sent under `slot`; its outcome is unknown.
    Creating { slot: RequestSlot, op: Op },
    /// Created: `path` with the fencing token `token` (`NodeStat::token`); `unique` when the path
    /// cannot be created again (sequential), so deleting by path alone is exact.
    Created {
        path: String,
        token: u64,
        unique: bool,
    },
}

impl Pending {
    /// Nothing yet.
    pub(crate) fn new(session: &Session) -> Pending {
        Pending {
            session: session.clone(),
            state: State::Settled,
        }
    }

    /// A node that exists (a granted lock being released).
    pub(crate) fn created(session: &Session, path: &str, token: u64) -> Pending {
        Pending {
            session: session.clone(),
            state: State::Created {
                path: path.to_string(),
                token,
                unique: true,
            },
        }
    }

    /// Sends the create `op` under a request id of its own, again under the same id while
    /// its outcome is unknown, until it is known or `give_up` passes (without one: until
    /// the session is over). The node is ours from before the first send: whatever
    /// happens to this future, it is removed unless [`Pending::settle`] is called.
    /// An error with the outcome still unknown ([`outcome_unknown`]) leaves it to the
    /// background to find out and remove.
    pub(crate) async fn create(
        &mut self,
        op: Op,
        give_up: Option<Instant>,
    ) -> Result<crate::Created, Error> {
        debug_assert!(matches!(self.state, State::Settled), "one node at a time");
        if give_up.is_some_and(|g| Instant::now() >= g) {
            // Not sent: nothing to find out or remove.
            return Err(Error::Timeout {
                what: "create (the deadline passed before it was sent)".into(),
                after_ms: 0,
            });
        }
        let unique = matches!(&op, Op::Create { mode, .. } if mode.sequential);
        let slot = self.session.request_slot().await;
        self.state = State::Creating {
            slot,
            op: op.clone(),
        };
        let State::Creating { slot, .. } = &self.state else {
            unreachable!("set above");
        };
        match self.session.call_until_known(slot, op, give_up).await {
            Ok(Reply::Created {
                path,
                stat,
                predecessor,
            }) => {
                self.state = State::Created {
                    path: path.clone(),
                    token: stat.token,
                    unique,
                };
                Ok(crate::Created {
                    path,
                    stat,
                    predecessor,
                })
            }
            Ok(other) => {
                self.state = State::Settled;
                Err(unexpected(&other))
            }
            Err(e) if outcome_unknown(&e) => Err(e),
            Err(e) => {
                // Decided by the cell: nothing was created.
                self.state = State::Settled;
                Err(e)
            }
        }
    }

    /// The node is handed over (or gone): nothing to remove.
    pub(crate) fn settle(&mut self) {
        self.state = State::Settled;
    }

    /// Removes a node with a unique (sequential) path now. If the delete's outcome is
    /// unknown, the error is returned and the node is left to the background (which
    /// goes on trying until it is deleted or the session is over), as is a node whose
    /// create's outcome is still unknown.
    pub(crate) async fn remove(&mut self) -> Result<(), Error> {
        let State::Created {
            path, unique: true, ..
        } = &self.state
        else {
            return Ok(());
        };
        match self.session.delete(path, None).await {
            Ok(()) | Err(Error::NoNode { .. }) => {
                self.settle();
                Ok(())
            }
            Err(e) if outcome_unknown(&e) => Err(e),
            Err(e) => {
                self.settle();
                Err(e)
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let state = std::mem::replace(&mut self.state, State::Settled);
        if matches!(state, State::Settled) {
            return;
        }
        // Inside a runtime only (a drop at shutdown has none); `wire::rt` picks where, as
        // for every other task of the SDK (a local task in the simulation).
        if tokio::runtime::Handle::try_current().is_ok() {
            let session = self.session.clone();
            wire::rt::spawn(remove_in_background(session, state));
        }
    }
}

/// Finds out what a create left (with its own request id) and deletes it.
async fn remove_in_background(session: Session, state: State) {
    let (path, token, unique) = match state {
        State::Settled => return,
        State::Created {
            path,
            token,
            unique,
        } => (path, token, unique),
        State::Creating { slot, op } => {
            let unique = matches!(&op, Op::Create { mode, .. } if mode.sequential);
            match session.call_until_known(&slot, op, None).await {
                Ok(Reply::Created { path, stat, .. }) => (path, stat.token, unique),
                // Not created (decided by the cell), or the session is over.
                r => {
                    tracing::debug!(session = session.id(), "abandoned create: {r:?}");
                    return;
                }
            }
        }
    };
    tracing::debug!(session = session.id(), %path, "removing an abandoned node");
    delete_own(&session, &path, token, unique).await;
}

/// Deletes `path` if it is still the node with fencing token `token`, retrying while the
/// outcome is unknown, until it is gone or the session is over. A path that may have been
/// created again (a member's name) is checked first and deleted at the version seen.
async fn delete_own(session: &Session, path: &str, token: u64, unique: bool) {
    let mut pause = Duration::from_millis(50);
    while !session.is_over() {
        let version = if unique {
            Ok(None)
        } else {
            match session.exists(path).await {
                Ok(Some(st)) if st.token == token => Ok(Some(st.version)),
                // Gone, or someone else's node now.
                Ok(_) => return,
                Err(e) => Err(e),
            }
        };
        let r = match version {
            Ok(version) => session.delete(path, version).await,
            Err(e) => Err(e),
        };
        match r {
            Ok(()) | Err(Error::NoNode { .. }) => return,
            // Its data changed since the check: check again.
            Err(Error::BadVersion { .. }) => {}
            Err(e) if outcome_unknown(&e) => {}
            Err(e) => {
                tracing::debug!(session = session.id(), %path, "abandoned node not removed: {e}");
                return;
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}
