//! A session: KeepAlives, the local lease clock, and the node operations.
//!
//! The local lease clock starts when a KeepAlive is *sent*, so the client's idea of its
//! expiry is always earlier than the leader's (which runs from when it received it). When
//! the local lease runs out without a renewal the session is in [`SessionState::Jeopardy`]:
//! the application must stop acting on its locks. The library keeps trying every replica
//! for a grace period; it ends in `Healthy` again (the session survived) or `Expired`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use wire::types::{
    CreateMode, NodeStat, Op, Predecessor, Reply, Request, RequestId, SessionId, TxnOp, TxnResult,
};
use wire::Error;

use crate::client::{unexpected, Client};

/// Where a session stands, from the client's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// The local lease is valid: locks may be acted on.
    Healthy,
    /// The local lease ran out without a renewal: stop acting on locks; the library keeps
    /// trying to reach the cell until the grace period ends.
    Jeopardy,
    /// The cell ended the session (or the grace period ran out): everything it held is gone.
    Expired,
}

/// The result of a create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    /// The node's actual path (with the sequence suffix when sequential).
    pub path: String,
    /// Its metadata; `create_index` is the fencing token.
    pub stat: NodeStat,
    /// For sequential nodes: the sibling just below it when it was created.
    pub predecessor: Option<Predecessor>,
}

/// How long a session in jeopardy keeps trying before it gives up (Chubby's grace period).
pub const GRACE_PERIOD: Duration = Duration::from_secs(45);

/// Widest spread of request ids in flight: a new request waits until its id is less than
/// this far above the oldest unanswered one. Half the cell's dedup window
/// ([`wire::DEDUP_RESULTS_MAX`]), so the cell always has room for every unacknowledged
/// result and never refuses a request of this session for lack of it.
pub const IN_FLIGHT_MAX: u64 = wire::DEDUP_RESULTS_MAX as u64 / 2;

struct Inner {
    client: Client,
    id: SessionId,
    lease: Duration,
    requests: Mutex<Requests>,
    request_done: tokio::sync::Notify,
    state_tx: watch::Sender<SessionState>,
    local_deadline: Mutex<Instant>,
    keepalives_stopped: AtomicBool,
}

/// Request ids: the next one, and those sent but not yet answered.
struct Requests {
    next: RequestId,
    outstanding: BTreeSet<RequestId>,
}

/// One session; cheap to clone. Dropping every clone does not close the session (the
/// KeepAlive task keeps it alive until [`Session::close`] or [`Session::stop_keepalives`]).
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl Session {
    pub(crate) async fn open(client: Client) -> Result<Session, Error> {
        let sent = Instant::now();
        let (id, lease_ms) = match client.request(Op::CreateSession).await? {
            Reply::SessionCreated {
                session,
                session_lease_ms,
            } => (session, session_lease_ms),
            other => return Err(unexpected(&other)),
        };
        let lease = Duration::from_millis(lease_ms);
        let (state_tx, _) = watch::channel(SessionState::Healthy);
        let inner = Arc::new(Inner {
            client,
            id,
            lease,
            requests: Mutex::new(Requests {
                next: 1,
                outstanding: BTreeSet::new(),
            }),
            request_done: tokio::sync::Notify::new(),
            state_tx,
            local_deadline: Mutex::new(sent + lease),
            keepalives_stopped: AtomicBool::new(false),
        });
        tokio::spawn(keepalive_loop(inner.clone()));
        Ok(Session { inner })
    }

    /// The session id (the log index of its creation).
    pub fn id(&self) -> SessionId {
        self.inner.id
    }

    /// The lease the cell granted.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The current state.
    pub fn state(&self) -> SessionState {
        *self.inner.state_tx.borrow()
    }

    /// A receiver of state changes.
    pub fn subscribe(&self) -> watch::Receiver<SessionState> {
        self.inner.state_tx.subscribe()
    }

    /// When the local lease runs out unless renewed.
    pub fn local_deadline(&self) -> Instant {
        *self.inner.local_deadline.lock().expect("deadline lock")
    }

    /// Stops sending KeepAlives without closing the session, as if the process had died:
    /// the cell expires the session one lease after its last renewal. For tests and
    /// fault drills.
    pub fn stop_keepalives(&self) {
        self.inner.keepalives_stopped.store(true, Ordering::SeqCst);
    }

    /// Allocates the next request id once it is within [`IN_FLIGHT_MAX`] of the oldest
    /// unanswered one; returns it with `ack_below` (every id below has been answered).
    async fn next_ids(&self) -> (RequestId, RequestId) {
        loop {
            let notified = self.inner.request_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut r = self.inner.requests.lock().expect("requests lock");
                let oldest = r.outstanding.first().copied().unwrap_or(r.next);
                if r.next - oldest < IN_FLIGHT_MAX {
                    let id = r.next;
                    r.next += 1;
                    r.outstanding.insert(id);
                    return (id, oldest.min(id));
                }
            }
            notified.await;
        }
    }

    /// Sends one request of this session, retried with the same id until answered.
    pub async fn call(&self, op: Op) -> Result<Reply, Error> {
        let (request_id, ack_below) = self.next_ids().await;
        let r = self
            .inner
            .client
            .call(Request {
                session: self.inner.id,
                request_id,
                ack_below,
                op,
            })
            .await;
        self.inner
            .requests
            .lock()
            .expect("requests lock")
            .outstanding
            .remove(&request_id);
        self.inner.request_done.notify_waiters();
        if let Err(Error::SessionExpired { .. }) = &r {
            self.inner.state_tx.send_replace(SessionState::Expired);
        }
        r
    }

    /// Creates a node.
    pub async fn create(
        &self,
        path: &str,
        data: Vec<u8>,
        mode: CreateMode,
    ) -> Result<Created, Error> {
        match self
            .call(Op::Create {
                path: path.into(),
                data,
                mode,
            })
            .await?
        {
            Reply::Created {
                path,
                stat,
                predecessor,
            } => Ok(Created {
                path,
                stat,
                predecessor,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes a node (compare-and-delete when `version` is given).
    pub async fn delete(&self, path: &str, version: Option<u64>) -> Result<(), Error> {
        match self
            .call(Op::Delete {
                path: path.into(),
                version,
            })
            .await?
        {
            Reply::Deleted => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Replaces a node's data (compare-and-set when `version` is given).
    pub async fn set_data(
        &self,
        path: &str,
        data: Vec<u8>,
        version: Option<u64>,
    ) -> Result<NodeStat, Error> {
        match self
            .call(Op::SetData {
                path: path.into(),
                data,
                version,
            })
            .await?
        {
            Reply::Set { stat } => Ok(stat),
            other => Err(unexpected(&other)),
        }
    }

    /// Runs a transaction: all ops apply or none.
    pub async fn txn(&self, ops: Vec<TxnOp>) -> Result<Vec<TxnResult>, Error> {
        match self.call(Op::Txn { ops }).await? {
            Reply::Txn { results } => Ok(results),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a node (linearizable).
    pub async fn get(&self, path: &str) -> Result<(Vec<u8>, NodeStat), Error> {
        self.inner.client.get(path).await
    }

    /// A node's metadata, if it exists (linearizable).
    pub async fn exists(&self, path: &str) -> Result<Option<NodeStat>, Error> {
        self.inner.client.exists(path).await
    }

    /// A node's children (linearizable).
    pub async fn children(&self, path: &str) -> Result<Vec<(String, NodeStat)>, Error> {
        self.inner.client.children(path).await
    }

    /// Ends the session: its ephemeral nodes are deleted at once.
    pub async fn close(&self) -> Result<(), Error> {
        self.inner.keepalives_stopped.store(true, Ordering::SeqCst);
        let r = self.call(Op::CloseSession).await;
        self.inner.state_tx.send_replace(SessionState::Expired);
        match r {
            Ok(_) | Err(Error::SessionExpired { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

async fn keepalive_loop(inner: Arc<Inner>) {
    let interval = inner.lease / 3;
    let retry = Duration::from_millis(250).min(interval);
    let mut next = Instant::now() + interval;
    loop {
        tokio::time::sleep_until(next.into()).await;
        if inner.keepalives_stopped.load(Ordering::SeqCst)
            || *inner.state_tx.borrow() == SessionState::Expired
        {
            return;
        }
        let sent = Instant::now();
        let deadline_for_try = sent + interval.max(Duration::from_secs(1));
        let call = inner.client.call_until(
            Request {
                session: inner.id,
                request_id: 0,
                ack_below: 0,
                op: Op::KeepAlive,
            },
            deadline_for_try,
        );
        tokio::pin!(call);
        let local_deadline = *inner.local_deadline.lock().expect("deadline lock");
        // The lease may run out while this KeepAlive is in flight: enter jeopardy on time.
        let r = tokio::select! {
            r = &mut call => r,
            _ = tokio::time::sleep_until(local_deadline.into()) => {
                enter_jeopardy(&inner);
                call.await
            }
        };
        match r {
            Ok(Reply::KeepAlive { session_lease_ms }) => {
                *inner.local_deadline.lock().expect("deadline lock") =
                    sent + Duration::from_millis(session_lease_ms);
                inner.state_tx.send_if_modified(|s| {
                    let changed = *s != SessionState::Healthy;
                    *s = SessionState::Healthy;
                    changed
                });
                next = sent + interval;
            }
            Err(Error::SessionExpired { .. }) | Err(Error::UnknownSession { .. }) => {
                inner.state_tx.send_replace(SessionState::Expired);
                return;
            }
            _ => {
                let local_deadline = *inner.local_deadline.lock().expect("deadline lock");
                let now = Instant::now();
                if now >= local_deadline + GRACE_PERIOD {
                    inner.state_tx.send_replace(SessionState::Expired);
                    return;
                }
                if now >= local_deadline {
                    enter_jeopardy(&inner);
                }
                next = now + retry;
            }
        }
    }
}

fn enter_jeopardy(inner: &Inner) {
    inner.state_tx.send_if_modified(|s| {
        let changed = *s == SessionState::Healthy;
        if changed {
            tracing::warn!(
                session = inner.id,
                "session in jeopardy: local lease ran out"
            );
            *s = SessionState::Jeopardy;
        }
        changed
    });
}
