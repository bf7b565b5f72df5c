//! Leader election: the lock queue with each candidate's address in its node.
//!
//! Candidates queue as ephemeral sequential children of the election path; the lowest
//! leads. Each waits only for the candidate just before it, so a leader's death wakes one
//! candidate. Observers read the lowest node to learn who leads, and watch that node to be
//! told when it goes. A new leader's first act should be a write that carries its token to
//! the resources it controls, fencing out the old leader.
//!
//! ```no_run
//! # async fn demo(session: client_sdk::Session) -> Result<(), client_sdk::Error> {
//! use client_sdk::recipes::election::Election;
//! let election = Election::new(&session, "/services/indexer/leader");
//! let leadership = election.campaign(b"10.0.0.7:8080".to_vec()).await?;
//! println!("leading with token {}", leadership.token());
//! // ... lead only while leadership.may_act() (its docs show the loop) ...
//! leadership.resign().await?;
//! # Ok(()) }
//! ```

use wire::types::{LogIndex, SessionId};
use wire::{path, Error};

use crate::recipes::lock::{sequence_of, Lock, LockGuard, Sequencer};
use crate::session::Session;
use crate::watch::Watch;

/// An election at a path.
#[derive(Clone)]
pub struct Election {
    session: Session,
    path: String,
}

/// Who leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The leader's node.
    pub node: String,
    /// What it published (its address).
    pub address: Vec<u8>,
    /// Its fencing token.
    pub token: LogIndex,
    /// Its session.
    pub session: Option<SessionId>,
}

/// This process leads until it resigns or its session ends.
#[derive(Debug)]
pub struct Leadership {
    guard: LockGuard,
}

impl Leadership {
    /// The fencing token of this term of leadership.
    pub fn token(&self) -> LogIndex {
        self.guard.token()
    }

    /// The grant, for resources and `check_sequencer`.
    pub fn sequencer(&self) -> &Sequencer {
        self.guard.sequencer()
    }

    /// True while the session is healthy and its local lease has not run out
    /// ([`crate::Session::lease_valid`]): lead only then. In jeopardy (or once expired)
    /// another candidate may already lead.
    ///
    /// Ask before every act of leadership and keep each one short; the resources it
    /// controls must still check [`Leadership::token`] (an act begun while this said yes
    /// may end after the lease fell into doubt). The loop:
    ///
    /// ```no_run
    /// # async fn demo(session: client_sdk::Session) -> Result<(), client_sdk::Error> {
    /// use client_sdk::recipes::election::Election;
    /// use client_sdk::SessionState;
    /// use std::time::Duration;
    /// let election = Election::new(&session, "/services/indexer/leader");
    /// let leadership = election.campaign(b"10.0.0.7:8080".to_vec()).await?;
    /// let mut state = session.subscribe();
    /// loop {
    ///     while !leadership.may_act() {
    ///         if session.state() == SessionState::Expired {
    ///             // No longer the leader: campaign again with a new session.
    ///             return Ok(());
    ///         }
    ///         // In jeopardy: lead nothing until the session is safe again or expired.
    ///         let _ = tokio::time::timeout(Duration::from_millis(100), state.changed()).await;
    ///     }
    ///     // One short act of leadership, carrying leadership.token().
    ///     # break;
    /// }
    /// leadership.resign().await?;
    /// # Ok(()) }
    /// ```
    pub fn may_act(&self) -> bool {
        self.guard.may_act()
    }

    /// True once the leadership is gone for good: its node was deleted by someone else,
    /// its prefix moved to another cell, or the session ended ([`LockGuard::lost`]).
    ///
    /// [`LockGuard::lost`]: crate::LockGuard::lost
    pub fn lost(&self) -> bool {
        self.guard.lost()
    }

    /// Steps down: the next candidate takes over.
    pub async fn resign(self) -> Result<(), Error> {
        self.guard.release().await
    }
}

impl Election {
    /// An election at `path` (created if missing; its parent must exist).
    pub fn new(session: &Session, path: &str) -> Election {
        Election {
            session: session.clone(),
            path: path.to_string(),
        }
    }

    /// Stands with `address` and returns once this candidate leads. As with
    /// [`Lock::acquire`], a campaign whose future is dropped (or that fails) leaves no
    /// candidate in the queue, even if its create's answer never came back.
    pub async fn campaign(&self, address: Vec<u8>) -> Result<Leadership, Error> {
        let guard = Lock::exclusive(&self.session, &self.path)
            .with_data(address)
            .acquire()
            .await?;
        Ok(Leadership { guard })
    }

    /// Who leads now (linearizable), if anyone.
    pub async fn leader(&self) -> Result<Option<LeaderInfo>, Error> {
        Ok(self.observe_inner(false).await?.0)
    }

    /// Who leads now, and a watch that fires when that changes (the leader's node goes or
    /// changes; or, with no leader, when a candidate appears). Call again after it fires.
    pub async fn observe(&self) -> Result<(Option<LeaderInfo>, Watch), Error> {
        let (leader, watch) = self.observe_inner(true).await?;
        Ok((leader, watch.expect("watch requested")))
    }

    async fn observe_inner(
        &self,
        watch: bool,
    ) -> Result<(Option<LeaderInfo>, Option<Watch>), Error> {
        loop {
            let children = match self.session.children(&self.path).await {
                Ok(c) => c,
                Err(Error::NoNode { .. }) if watch => {
                    let (_, w) = self.session.exists_watch(&self.path).await?;
                    return Ok((None, Some(w)));
                }
                Err(Error::NoNode { .. }) => return Ok((None, None)),
                Err(e) => return Err(e),
            };
            let lowest = children
                .iter()
                .filter_map(|(n, st)| sequence_of(n).map(|seq| (seq, n, st)))
                .min_by_key(|(seq, _, _)| *seq);
            let Some((_, name, _)) = lowest else {
                if !watch {
                    return Ok((None, None));
                }
                let (kids, w) = self.session.children_watch(&self.path).await?;
                if kids.iter().any(|(n, _)| sequence_of(n).is_some()) {
                    continue; // a candidate appeared meanwhile: look again
                }
                return Ok((None, Some(w)));
            };
            let node = path::join(&self.path, name);
            let got = if watch {
                self.session
                    .get_watch(&node)
                    .await
                    .map(|(d, st, w)| (d, st, Some(w)))
            } else {
                self.session.get(&node).await.map(|(d, st)| (d, st, None))
            };
            match got {
                Ok((address, stat, w)) => {
                    let info = LeaderInfo {
                        node,
                        address,
                        token: stat.token,
                        session: stat.ephemeral_owner,
                    };
                    return Ok((Some(info), w));
                }
                // The leader left between the listing and the read: look again.
                Err(Error::NoNode { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }
}
