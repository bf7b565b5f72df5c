//! Locks: exclusive and shared (read/write), blocking, try, or try with a timeout.
//!
//! The lock at `/locks/db` is a directory node; each contender creates an ephemeral
//! sequential child (`lock-`, or `read-`/`write-` for shared locks). Sequence numbers
//! follow creation order, so the queue is the children sorted by sequence:
//!
//! - an exclusive contender (and a writer) holds the lock when no earlier node exists;
//! - a reader holds it when no earlier node other than a reader's (a writer's, or an
//!   exclusive contender's at the same path) exists.
//!
//! A waiter watches only the node that blocks it (the nearest earlier node, or for a reader
//! the nearest earlier non-reader), so a release wakes one waiter, not the herd. When woken it
//! re-lists rather than assuming it now holds the lock, since the node it watched may have
//! been a waiter that gave up. A waiter that gives up deletes its node. Release deletes the
//! node; so does the session's expiry, at one log position.
//!
//! No attempt leaves a node behind that nobody holds, whatever happens to it. Its create
//! carries a request id the cell deduplicates, and is sent again under that id while its
//! outcome is unknown (an answer lost to a dead leader or a cut link), so it creates at
//! most one node. An attempt that ends without a grant (an error, a deadline, or its
//! future dropped, even while the create is in flight) removes its node: at once when it
//! can, otherwise in the background, which first learns the create's outcome with the
//! same request id and then deletes the node it made, trying until the cell answers or
//! the session is over. A contender behind it (the same session's next attempt included)
//! waits for that delete, not for the session to end.
//!
//! Every grant carries a [`Sequencer`] whose token is the node's fencing token
//! ([`NodeStat::token`](wire::types::NodeStat::token)): unique, and higher than every
//! earlier holder's. Protected resources must check it on every write
//! (see [`crate::fencing`]).
//!
//! ```no_run
//! # async fn demo(session: client_sdk::Session) -> Result<(), client_sdk::Error> {
//! use client_sdk::Lock;
//! let lock = Lock::exclusive(&session, "/locks/db");
//! let guard = lock.acquire().await?;
//! println!("holding with token {}", guard.token());
//! // ... act only while guard.may_act() (its docs show the loop), writing to the
//! // protected resource with guard.token() ...
//! guard.release().await?;
//! # Ok(()) }
//! ```

use std::time::Duration;
use tokio::time::Instant;

use wire::types::{CreateMode, LogIndex, NodeStat, Op, SessionId};
use wire::{path, Error};

use crate::recipes::Pending;
use crate::session::{outcome_unknown, Session};

/// Digits of the sequence suffix the cell appends.
const SEQUENCE_DIGITS: usize = 10;

/// How a lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// Alone.
    Exclusive,
    /// With other readers, never with a writer.
    Read,
    /// Alone (the writer side of a shared lock).
    Write,
}

impl LockMode {
    fn prefix(self) -> &'static str {
        match self {
            LockMode::Exclusive => "lock-",
            LockMode::Read => "read-",
            LockMode::Write => "write-",
        }
    }
}

/// Proof of a grant, to hand to protected resources: which lock, which node, how, the
/// fencing token (the node's [`NodeStat::token`](wire::types::NodeStat::token)) and the
/// holder's session.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sequencer {
    /// The lock's path.
    pub lock: String,
    /// The holder's node (full path).
    pub node: String,
    /// How it is held.
    pub mode: LockMode,
    /// The fencing token: higher than every earlier holder's.
    pub token: u64,
    /// The holder's session.
    pub session: SessionId,
}

/// A lock at a path, used through one session.
#[derive(Clone)]
pub struct Lock {
    session: Session,
    path: String,
    mode: LockMode,
    data: Vec<u8>,
}

/// A held lock. Release it with [`LockGuard::release`]; dropping it keeps the lock held
/// until the session ends (a lock service cannot know the work is done).
#[derive(Debug)]
pub struct LockGuard {
    session: Session,
    sequencer: Sequencer,
    /// The holder's cached read of its own node: no delete of the node (by anyone, or by
    /// its prefix moving to another cell) commits before this session learned of it.
    pin: std::sync::Arc<crate::cache::Pin>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.session.unpin(&self.pin);
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id())
            .field("state", &self.state())
            .finish()
    }
}

impl LockGuard {
    /// The grant's sequencer.
    pub fn sequencer(&self) -> &Sequencer {
        &self.sequencer
    }

    /// The fencing token.
    pub fn token(&self) -> LogIndex {
        self.sequencer.token
    }

    /// True while the session is healthy and its local lease has not run out
    /// ([`Session::lease_valid`]), and the leader is known to tell this session before
    /// the lock's node is deleted or changed: act on the lock only then. In jeopardy (or
    /// once expired) the lock may already belong to someone else.
    ///
    /// The second condition is how a holder learns that its node went other than with its
    /// session: deleted by someone else, or ended because its prefix moved to another
    /// cell (`lockctl dir move`). The holder reads its node through the session's cache
    /// at the grant, so the leader invalidates it before such a delete commits; the
    /// invalidation makes this false before it is acknowledged, and a read of the node
    /// right after tells whether it is gone for good ([`LockGuard::lost`]) or still held
    /// (an invalidation without a change: a proxy reconnecting upstream drops every
    /// copy). After the session's event stream broke (a fail-over, a lost connection) this
    /// is false until the node has been read again at the leader, which the library does
    /// at once.
    ///
    /// Ask before every action, and keep each action short: one that began while this
    /// said yes may still be running when the lease falls into doubt (the local lease ends
    /// only a little before the cell's), so every write must also carry the fencing token
    /// ([`LockGuard::token`]). The loop:
    ///
    /// ```no_run
    /// # async fn demo(session: client_sdk::Session) -> Result<(), client_sdk::Error> {
    /// use client_sdk::Lock;
    /// use std::time::Duration;
    /// let guard = Lock::exclusive(&session, "/locks/db").acquire().await?;
    /// let mut state = session.subscribe();
    /// for step in 0..1_000 {
    ///     while !guard.may_act() {
    ///         if guard.lost() {
    ///             // The lock is gone (someone else may hold it): start again with a new
    ///             // grant (a new session if this one expired) and a new token.
    ///             return Ok(());
    ///         }
    ///         // In jeopardy, or reconnecting: act on nothing until it is settled.
    ///         let _ = tokio::time::timeout(Duration::from_millis(100), state.changed()).await;
    ///     }
    ///     // One short step of the work, its writes checked against guard.token().
    ///     println!("step {step} under token {}", guard.token());
    /// }
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn may_act(&self) -> bool {
        self.session.lease_valid() && self.confirmed()
    }

    /// The second half of [`LockGuard::may_act`]: the leader is known to tell this session
    /// before the lock's node is deleted or changed. False for a moment after every
    /// break of the session's event stream and every invalidation of the node, until the
    /// library has read the node at the leader again.
    pub fn confirmed(&self) -> bool {
        self.pin.pinned() && !self.pin.lost()
    }

    /// A future that completes at the next change, after this call, of what
    /// [`LockGuard::confirmed`] or [`LockGuard::lost`] may say (or of the session's
    /// state). It listens from the call on, not from its first poll: take it, then look at
    /// the guard, then await it, and no change falls in between. For a supervisor that
    /// acts on the change, as `lockctl lock` stops its command while the lock is
    /// unconfirmed.
    pub fn changed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut notified = Box::pin(self.session.pins_changed().notified_owned());
        notified.as_mut().enable();
        let mut state = self.session.subscribe();
        async move {
            tokio::select! {
                _ = notified => {}
                _ = state.changed() => {}
            }
        }
    }

    /// True once the lock's node is known to be gone other than by this guard's release:
    /// deleted by someone else, or ended by a move of its prefix to another cell (or by
    /// the session's end, which [`Session::state`] also says). For good: start again
    /// with a new grant (in the cell that now serves the path). Known from a read of the
    /// node after its invalidation, so [`LockGuard::may_act`] turns false first.
    pub fn lost(&self) -> bool {
        self.pin.lost() || self.session.state() == crate::SessionState::Expired
    }

    /// Completes once [`LockGuard::lost`] is true (at once if it is): the node was
    /// deleted by someone else, its prefix moved away, or the session ended.
    pub async fn wait_lost(&self) {
        loop {
            let changed = self.changed();
            if self.lost() {
                return;
            }
            changed.await;
        }
    }

    /// Releases the lock (deletes the node). If the delete's outcome is unknown (the
    /// cell could not be reached within the request timeout), the error is returned and
    /// the node is deleted in the background as soon as the cell answers (or goes with
    /// the session); so it is if this future is dropped before the delete is answered.
    pub async fn release(self) -> Result<(), Error> {
        let mut node = Pending::created(&self.session, &self.sequencer.node, self.token());
        node.remove().await
    }
}

/// The sequence number at the end of a node name.
pub fn sequence_of(name: &str) -> Option<u64> {
    let b = name.as_bytes();
    if b.len() < SEQUENCE_DIGITS {
        return None;
    }
    let tail = &b[b.len() - SEQUENCE_DIGITS..];
    if !tail.iter().all(u8::is_ascii_digit) {
        return None;
    }
    tail.iter().try_fold(0u64, |acc, d| {
        acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// The node that blocks `mine` in a queue of children: the nearest earlier node, or for a
/// reader the nearest earlier node that is not a reader's (a writer, or an exclusive
/// contender queued at the same path). `None`: `mine` holds the lock.
pub fn blocker<'a>(
    children: &'a [(String, NodeStat)],
    mine: &str,
    mode: LockMode,
) -> Option<&'a str> {
    let my_seq = sequence_of(mine)?;
    children
        .iter()
        .filter_map(|(name, _)| sequence_of(name).map(|seq| (seq, name.as_str())))
        .filter(|(seq, name)| {
            *seq < my_seq && (mode != LockMode::Read || !name.starts_with(LockMode::Read.prefix()))
        })
        .max_by_key(|(seq, _)| *seq)
        .map(|(_, name)| name)
}

#[derive(Clone, Copy)]
enum Wait {
    No,
    Until(Option<Instant>),
}

impl Lock {
    /// An exclusive lock at `path` (a directory node, created if missing; its parent must
    /// exist).
    pub fn exclusive(session: &Session, path: &str) -> Lock {
        Lock {
            session: session.clone(),
            path: path.to_string(),
            mode: LockMode::Exclusive,
            data: Vec::new(),
        }
    }

    /// The reader side of a shared lock at `path`.
    pub fn read(session: &Session, path: &str) -> Lock {
        Lock {
            session: session.clone(),
            path: path.to_string(),
            mode: LockMode::Read,
            data: Vec::new(),
        }
    }

    /// The writer side of a shared lock at `path`.
    pub fn write(session: &Session, path: &str) -> Lock {
        Lock {
            session: session.clone(),
            path: path.to_string(),
            mode: LockMode::Write,
            data: Vec::new(),
        }
    }

    /// Stores `data` in this contender's node (an election candidate's address, say).
    pub fn with_data(mut self, data: Vec<u8>) -> Lock {
        self.data = data;
        self
    }

    /// Waits until the lock is held (or the session ends). A create whose answer is lost
    /// (the cell unreachable, a leader change) is sent again under the same request id
    /// until the cell answers, so it never leaves a second node nor an error with a node
    /// behind. Dropping the future at any point leaves no node in the queue (see the
    /// module's docs).
    pub async fn acquire(&self) -> Result<LockGuard, Error> {
        Ok(self
            .run(Wait::Until(None))
            .await?
            .expect("waits until held"))
    }

    /// Takes the lock only if it is free now; leaves no node behind otherwise. If the
    /// create goes unanswered for the request timeout, its error is returned and the node,
    /// if the create applied, is deleted in the background once the cell answers.
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>, Error> {
        self.run(Wait::No).await
    }

    /// Waits at most `timeout`; on timeout deletes its node and returns `None`. The
    /// create counts against `timeout` too: one still unanswered at the deadline gives
    /// `None`, and its node, if the create applied, is deleted in the background once the
    /// cell answers.
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<Option<LockGuard>, Error> {
        self.run(Wait::Until(Some(Instant::now() + timeout))).await
    }

    async fn ensure_dir(&self) -> Result<(), Error> {
        match self
            .session
            .create(&self.path, Vec::new(), CreateMode::default())
            .await
        {
            Ok(_) | Err(Error::NodeExists { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn run(&self, wait: Wait) -> Result<Option<LockGuard>, Error> {
        path::validate(&self.path)?;
        let create = Op::Create {
            path: path::join(&self.path, self.mode.prefix()),
            data: self.data.clone(),
            mode: CreateMode {
                ephemeral: true,
                sequential: true,
            },
        };
        // How long the create is asked again (under its request id) while its outcome is
        // unknown: a try as long as one request; a timeout until its deadline; a blocking
        // acquire until the session is over.
        let give_up = match wait {
            Wait::No => Some(Instant::now() + self.session.request_timeout()),
            Wait::Until(deadline) => deadline,
        };
        // Our node from before the create is sent: if this attempt ends without a grant,
        // however it ends (its future dropped included), the node is removed, so it never
        // blocks the queue; a create whose outcome is unknown is resolved first.
        let mut node = Pending::new(&self.session);
        // One write when the lock node exists (the usual case); it is created on first use.
        let created = match node.create(create.clone(), give_up).await {
            Err(Error::NoNode { path }) if path == self.path => {
                self.ensure_dir().await?;
                node.create(create, give_up).await
            }
            r => r,
        };
        let created = match created {
            Ok(c) => c,
            // The deadline passed before the create's outcome was known: not acquired.
            Err(e) if outcome_unknown(&e) && matches!(wait, Wait::Until(Some(_))) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        match self.wait_for_turn(&created, wait).await {
            Ok(true) => {
                // Pinned before the node is settled: an attempt dropped during the pin's
                // read still removes its node.
                let pin = self
                    .session
                    .pin(&created.path, created.stat.token, give_up)
                    .await;
                node.settle();
                Ok(Some(LockGuard {
                    session: self.session.clone(),
                    sequencer: Sequencer {
                        lock: self.path.clone(),
                        node: created.path,
                        mode: self.mode,
                        token: created.stat.token,
                        session: self.session.id(),
                    },
                    pin,
                }))
            }
            // Gave up (try, timeout): delete the node so we leave nothing in the queue.
            Ok(false) => node.remove().await.map(|()| None),
            Err(e @ Error::SessionExpired { .. }) => {
                // The node went with the session.
                node.settle();
                Err(e)
            }
            Err(e) => {
                let _ = node.remove().await;
                Err(e)
            }
        }
    }

    /// Waits until `created` holds the lock (`true`) or the wait is over (`false`).
    async fn wait_for_turn(&self, created: &crate::Created, wait: Wait) -> Result<bool, Error> {
        let node = &created.path;
        let mine = path::name(node).to_string();
        // Fast path: nothing below us when the create applied.
        if created.predecessor.is_none() {
            return Ok(true);
        }
        // For exclusive and write modes the node just below ours when the create applied
        // is the one to wait for: no listing needed (2 000 contenders would otherwise each
        // list 2 000 children at once). Readers wait for the nearest earlier non-reader,
        // which only a listing shows.
        let mut known_blocker = match (self.mode, &created.predecessor) {
            (LockMode::Read, _) | (_, None) => None,
            (_, Some(p)) => Some(p.name.clone()),
        };
        loop {
            let block = match known_blocker.take() {
                Some(b) => b,
                // Exclusive and write modes ask for the sibling just below (one small read)
                // rather than listing every waiter after each wake-up.
                None if self.mode != LockMode::Read => match self.session.predecessor(node).await {
                    Ok(Some(p)) => p.name,
                    Ok(None) => return Ok(true),
                    Err(Error::NoNode { .. }) => {
                        return Err(Error::SessionExpired {
                            session: self.session.id(),
                        })
                    }
                    Err(e) => return Err(e),
                },
                None => {
                    let children = self.session.children(&self.path).await?;
                    if !children.iter().any(|(n, _)| *n == mine) {
                        // Our node is gone: only the session's end removes it behind our back.
                        return Err(Error::SessionExpired {
                            session: self.session.id(),
                        });
                    }
                    match blocker(&children, &mine, self.mode) {
                        Some(b) => b.to_string(),
                        None => return Ok(true),
                    }
                }
            };
            let deadline = match wait {
                Wait::No => return Ok(false),
                Wait::Until(d) => d,
            };
            // A data watch on the blocker fires when it is deleted. A blocker already gone
            // arms nothing (a watch for the creation of a sequential name would never fire
            // and never be freed).
            let watch = match self
                .session
                .get_watch(&path::join(&self.path, &block))
                .await
            {
                Ok((_, _, w)) => w,
                Err(Error::NoNode { .. }) => continue,
                Err(e) => return Err(e),
            };
            let expired = self.session.expired();
            let timer = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = watch => { r?; }
                _ = timer => return Ok(false),
                _ = expired => return Err(Error::SessionExpired { session: self.session.id() }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat() -> NodeStat {
        NodeStat {
            version: 0,
            children_version: 0,
            create_index: 0,
            mod_index: 0,
            ephemeral_owner: None,
            data_len: 0,
            children_count: 0,
            token: 0,
        }
    }

    fn kids(names: &[&str]) -> Vec<(String, NodeStat)> {
        names.iter().map(|n| (n.to_string(), stat())).collect()
    }

    #[test]
    fn blockers() {
        let q = kids(&[
            "read-0000000001",
            "write-0000000002",
            "read-0000000003",
            "read-0000000004",
            "write-0000000005",
        ]);
        assert_eq!(blocker(&q, "read-0000000001", LockMode::Read), None);
        assert_eq!(
            blocker(&q, "write-0000000002", LockMode::Write),
            Some("read-0000000001")
        );
        assert_eq!(
            blocker(&q, "read-0000000003", LockMode::Read),
            Some("write-0000000002")
        );
        assert_eq!(
            blocker(&q, "read-0000000004", LockMode::Read),
            Some("write-0000000002")
        );
        assert_eq!(
            blocker(&q, "write-0000000005", LockMode::Write),
            Some("read-0000000004")
        );
        // Modes mixed at one path: a reader waits for an earlier exclusive contender as for
        // a writer (it once looked only for `write-` nodes and shared the lock with one).
        let q = kids(&["lock-0000000001", "read-0000000002", "read-0000000003"]);
        assert_eq!(
            blocker(&q, "read-0000000002", LockMode::Read),
            Some("lock-0000000001")
        );
        assert_eq!(
            blocker(&q, "read-0000000003", LockMode::Read),
            Some("lock-0000000001")
        );
        let q = kids(&["lock-0000000007", "lock-0000000009", "lock-0000000012"]);
        assert_eq!(blocker(&q, "lock-0000000007", LockMode::Exclusive), None);
        assert_eq!(
            blocker(&q, "lock-0000000012", LockMode::Exclusive),
            Some("lock-0000000009")
        );
        assert_eq!(sequence_of("€€€€"), None);
    }
}
