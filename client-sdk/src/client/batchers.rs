//! KeepAlives and invalidation acknowledgements of a client's sessions that fall due
//! together go out as one RPC: a process holding many sessions (a loadgen, a multi-tenant
//! server) sends one `KeepAliveBatch` per round rather than one KeepAlive per session,
//! and a fail-over's flush of every session's cache is acknowledged in a few RPCs.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;
use wire::hash::HashMap;

use wire::types::{Op, Reply, Request, SessionId};
use wire::Error;

use super::{conn_err, unexpected, Client, Inner};

/// Acknowledgements of this client's sessions that arrive within this window of the first
/// one go out together, one `AckInvalidationsBatch` RPC per server.
const ACK_COALESCE: Duration = Duration::from_millis(5);

/// One invalidation to acknowledge to the server that sent it.
pub(super) struct PendingAck {
    addr: SocketAddr,
    session: SessionId,
    id: u64,
    /// Retried until then (a lease): the server has stopped waiting for us by then.
    give_up: Instant,
}

/// Collects acknowledgements and sends them grouped by server; ends with the client.
pub(super) async fn ack_batcher(
    client: std::sync::Weak<Inner>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<PendingAck>,
) {
    while let Some(first) = rx.recv().await {
        tokio::time::sleep(ACK_COALESCE).await;
        let mut by_addr: HashMap<SocketAddr, Vec<PendingAck>> = HashMap::default();
        by_addr.entry(first.addr).or_default().push(first);
        // Bounded by what is queued now (each batch at most KEEPALIVE_BATCH_MAX sessions
        // is split below).
        while let Ok(a) = rx.try_recv() {
            by_addr.entry(a.addr).or_default().push(a);
        }
        let Some(inner) = client.upgrade() else {
            return;
        };
        for (addr, acks) in by_addr {
            let client = Client {
                inner: inner.clone(),
            };
            wire::rt::spawn(async move { client.send_acks(addr, acks).await });
        }
    }
}

/// KeepAlives of this client's sessions that fall due within this window of the first one
/// go out together, as one `KeepAliveBatch` RPC.
const KEEPALIVE_COALESCE: Duration = Duration::from_millis(20);

/// The answer to one session's KeepAlive, and the server that gave it.
pub(crate) type KeepAliveResult = Result<(Reply, SocketAddr), Error>;

/// One session's KeepAlive waiting for its batch.
pub(super) struct KeepAliveWaiter {
    session: SessionId,
    deadline: Instant,
    tx: tokio::sync::oneshot::Sender<KeepAliveResult>,
}

/// Collects KeepAlives and sends each group as one RPC; ends with the client.
pub(super) async fn keepalive_batcher(
    client: std::sync::Weak<Inner>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<KeepAliveWaiter>,
) {
    while let Some(first) = rx.recv().await {
        tokio::time::sleep(KEEPALIVE_COALESCE).await;
        let mut batch = vec![first];
        while batch.len() < wire::KEEPALIVE_BATCH_MAX {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let Some(inner) = client.upgrade() else {
            return;
        };
        let client = Client { inner };
        wire::rt::spawn(async move { client.send_keepalives(batch).await });
    }
}

impl Client {
    /// Renews `session`'s lease, trying until `deadline`: the answer (a
    /// [`Reply::KeepAlive`]) and the server that gave it. KeepAlives of this client's
    /// sessions that fall due together travel as one `KeepAliveBatch` RPC, so a process
    /// holding many sessions (a loadgen, a multi-tenant server) sends one RPC per round
    /// rather than one per session.
    pub(crate) async fn keepalive(&self, session: SessionId, deadline: Instant) -> KeepAliveResult {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let w = KeepAliveWaiter {
            session,
            deadline,
            tx,
        };
        if self.inner.keepalives.send(w).is_err() {
            return Err(conn_err("the client is shutting down"));
        }
        rx.await
            .unwrap_or_else(|_| Err(conn_err("the KeepAlive batcher stopped")))
    }

    /// Acknowledges invalidation `id` of `session` to the server `addr` whose event stream
    /// delivered it, and nowhere else: that server (the leader, or a proxy) is the one
    /// holding a write until it hears from us; another one would ignore the id.
    /// Acknowledgements queued together travel as one `AckInvalidationsBatch` per server;
    /// each is retried until `give_up`.
    pub(crate) fn ack_invalidation(
        &self,
        addr: SocketAddr,
        session: SessionId,
        id: u64,
        give_up: Instant,
    ) {
        let _ = self.inner.acks.send(PendingAck {
            addr,
            session,
            id,
            give_up,
        });
    }

    async fn send_acks(&self, addr: SocketAddr, mut acks: Vec<PendingAck>) {
        let mut backoff = Duration::from_millis(20);
        loop {
            acks.retain(|a| Instant::now() < a.give_up);
            if acks.is_empty() {
                return;
            }
            let mut by_session: std::collections::BTreeMap<SessionId, Vec<u64>> =
                Default::default();
            for a in &acks {
                by_session.entry(a.session).or_default().push(a.id);
            }
            let all: Vec<(SessionId, Vec<u64>)> = by_session.into_iter().collect();
            let mut failed = false;
            for chunk in all.chunks(wire::KEEPALIVE_BATCH_MAX) {
                let req = if let [(session, ids)] = chunk {
                    // One session: the plain form, which every server version knows.
                    Request {
                        session: *session,
                        request_id: 0,
                        ack_below: 0,
                        op: Op::AckInvalidations { ids: ids.clone() },
                    }
                } else {
                    Request {
                        session: 0,
                        request_id: 0,
                        ack_below: 0,
                        op: Op::AckInvalidationsBatch {
                            acks: chunk.to_vec(),
                        },
                    }
                };
                match self.call_at(addr, &req).await {
                    Ok(_) => {
                        let done: wire::hash::HashSet<SessionId> =
                            chunk.iter().map(|(s, _)| *s).collect();
                        acks.retain(|a| !done.contains(&a.session));
                    }
                    // A handshake refused here is one endpoint's (as a connection failure).
                    Err(e) if !e.is_retryable() && !matches!(e, Error::Handshake { .. }) => {
                        tracing::debug!(%addr, "invalidation acks refused: {e}");
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(%addr, "invalidation acks failed, retrying: {e}");
                        failed = true;
                    }
                }
            }
            if !failed {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    async fn send_keepalives(&self, mut batch: Vec<KeepAliveWaiter>) {
        // A session whose loop gave up (it retries) is not renewed on its behalf.
        batch.retain(|w| !w.tx.is_closed());
        let Some(deadline) = batch.iter().map(|w| w.deadline).min() else {
            return;
        };
        if batch.len() == 1 {
            let w = batch.pop().expect("one");
            let req = Request {
                session: w.session,
                request_id: 0,
                ack_below: 0,
                op: Op::KeepAlive,
            };
            let _ = w.tx.send(self.call_until_from(req, deadline).await);
            return;
        }
        let req = Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::KeepAliveBatch {
                sessions: batch.iter().map(|w| w.session).collect(),
            },
        };
        match self.call_until_from(req, deadline).await {
            Ok((
                Reply::KeepAliveBatch {
                    session_lease_ms,
                    renewed,
                    expired,
                    unknown,
                    unacknowledged,
                },
                addr,
            )) => {
                let renewed: wire::hash::HashSet<SessionId> = renewed.into_iter().collect();
                let expired: wire::hash::HashSet<SessionId> = expired.into_iter().collect();
                let unknown: wire::hash::HashSet<SessionId> = unknown.into_iter().collect();
                let mut unacked: HashMap<SessionId, Vec<(u64, Vec<String>)>> = HashMap::default();
                for (s, id, paths) in unacknowledged {
                    unacked.entry(s).or_default().push((id, paths));
                }
                for w in batch {
                    let s = w.session;
                    let r = if renewed.contains(&s) {
                        Ok((
                            Reply::KeepAlive {
                                session_lease_ms,
                                unacknowledged: unacked.remove(&s).unwrap_or_default(),
                            },
                            addr,
                        ))
                    } else if expired.contains(&s) {
                        Err(Error::SessionExpired { session: s })
                    } else if unknown.contains(&s) {
                        Err(Error::UnknownSession { session: s })
                    } else {
                        Err(Error::Unavailable {
                            reason: "not renewed in this round".into(),
                        })
                    };
                    let _ = w.tx.send(r);
                }
            }
            Ok((other, _)) => {
                for w in batch {
                    let _ = w.tx.send(Err(unexpected(&other)));
                }
            }
            Err(e) => {
                let ids: Vec<SessionId> = batch.iter().map(|w| w.session).collect();
                tracing::debug!(sessions = %wire::types::IdRanges(&ids), "KeepAliveBatch failed: {e}");
                for w in batch {
                    let _ = w.tx.send(Err(e.clone()));
                }
            }
        }
    }
}
