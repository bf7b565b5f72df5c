//! The gateway: the replica's QUIC listener.
//!
//! One endpoint serves both kinds of connection, told apart by ALPN: `lockservice-peer`
//! connections carry Raft RPCs ([`crate::raft::network::serve_peer`]); `lockservice-client`
//! connections carry the client protocol. A client connection starts with a hello stream
//! (protocol version check); then every request is one bidirectional stream: a
//! [`Request`] frame in, a [`Response`] frame out. A malformed frame gets a typed error on
//! its own stream and the connection keeps working.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use actix::Addr;
use wire::command::Command;
use wire::hello::{HelloOk, HelloReply, ALPN_PEER};
use wire::types::{IdRanges, MemberInfo, Op, Reply, Request, Response, SessionId, Status, TxnOp};
use wire::{frame, path, Error, CLIENT_FRAME_BYTES_MAX};

use crate::actors::cacher_list::{
    Ack, BeginRead, CacherListActor, Hold, HoldEnd, Overdue, Record, Release, Stats,
    StreamConnected, Unacknowledged, UnacknowledgedMany,
};
use crate::actors::raft_node::{members, ChangeMembership, Propose, RaftNode};
use crate::actors::session_manager::{KeepAliveMany, SessionManager};
use crate::actors::watch_table::{Arm, Connect, WatchCount, WatchTableActor};
use crate::raft::read_gate::ReadGate;
use crate::raft::sm_store::{SharedState, SnapshotStats};
use crate::raft::Raft;

/// A session that renews while it leaves an invalidation unacknowledged for this many
/// leases is no longer renewed (see [`Gateway::overdue`]).
/// Three: a proxy stops relaying the KeepAlives of a client of its own that owes it an
/// acknowledgement for a lease, whose lease then runs out within one more; the proxy
/// acknowledges upstream by then, inside the leader's limit, so one bad client costs only
/// its own session, not the proxy's.
pub const OVERDUE_LEASES: u32 = 3;

/// Everything a request handler needs.
pub struct Gateway {
    /// This replica's id.
    pub id: u64,
    /// Raft handle (metrics, peers).
    pub raft: Raft,
    /// Where commands are proposed.
    pub raft_node: Addr<RaftNode>,
    /// Where KeepAlives go.
    pub sessions: Addr<SessionManager>,
    /// Where watches are armed and event streams attached.
    pub watches: Addr<WatchTableActor>,
    /// Who caches what; holds writes to cached nodes.
    pub cachers: Addr<CacherListActor>,
    /// Leadership checks for linearizable reads.
    pub gate: ReadGate,
    /// The applied state, for reads.
    pub state: SharedState,
    /// Session lease granted to clients.
    pub lease_ms: u64,
    /// Group-commit counters of the log store.
    pub log_stats: std::sync::Arc<crate::raft::log_store::FlushStats>,
    /// KeepAlive counters for [`Status`].
    pub keepalive_stats: KeepAliveStats,
    /// What the last snapshot cost, for [`Status`] and [`Op::Snapshot`].
    pub snapshot_stats: Arc<SnapshotStats>,
    /// Writes being held or proposed here, by (session, request id): a retry of one still
    /// in flight waits for its answer instead of proposing a second entry.
    pub in_flight: InFlight,
    /// How long requests took here, by kind, for [`Status`].
    pub latency: wire::latency::Recorder,
    /// Connections dialed to peers (`PeerNetworkFactory::dials`), for [`Status`].
    pub peer_dials: Arc<std::sync::atomic::AtomicU64>,
    /// When the last [`Op::StateDigest`] was computed: one at a time, at most one per
    /// [`DIGEST_INTERVAL`] (each walks the whole state under its read lock, which holds
    /// applies back).
    pub last_digest: std::sync::Mutex<Option<Instant>>,
}

/// The least time between two [`Op::StateDigest`] computations at one replica.
pub const DIGEST_INTERVAL: Duration = Duration::from_millis(250);

/// Writes in flight at this replica (see [`Gateway::in_flight`]).
#[derive(Default)]
pub struct InFlight(
    std::sync::Mutex<
        wire::hash::HashMap<
            (SessionId, wire::types::RequestId),
            tokio::sync::broadcast::Sender<Response>,
        >,
    >,
);

/// Removes a write from [`InFlight`] when its first caller is done (or gone), telling the
/// retries that joined it: the answer, or `Unavailable` so they retry themselves.
struct InFlightGuard<'a> {
    table: &'a InFlight,
    key: (SessionId, wire::types::RequestId),
    answer: Option<Response>,
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        let tx = self
            .table
            .0
            .lock()
            .expect("in-flight lock")
            .remove(&self.key);
        if let Some(tx) = tx {
            let _ = tx.send(self.answer.take().unwrap_or_else(|| {
                Err(Error::Unavailable {
                    reason: "the first attempt of this request was abandoned; retry".into(),
                })
            }));
        }
    }
}

/// KeepAlive RPCs answered and leases renewed, since the replica started.
#[derive(Debug, Default)]
pub struct KeepAliveStats {
    rpcs: AtomicU64,
    renewed: AtomicU64,
}

/// The nodes a write may change whose cached values must be dropped first: created
/// (non-sequential: a cached absence), deleted and rewritten nodes. Sequential creates make
/// names no one can have cached: the absence of a name ending in a sequence number is
/// never cachable (`Gateway::cached_get`).
pub fn cached_paths(ops: &[TxnOp]) -> Vec<String> {
    let mut paths: Vec<String> = ops
        .iter()
        .filter_map(|op| match op {
            TxnOp::Create { path, mode, .. } if !mode.sequential => Some(path.clone()),
            TxnOp::Delete { path, .. } | TxnOp::SetData { path, .. } => Some(path.clone()),
            _ => None,
        })
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// What [`serve`] bounds for every connection (DESIGN.md, safety rule 8): how many it
/// accepts ([`wire::quic::ConnectionGate`]), and the bytes each one's requests may hold
/// at once, by ALPN ([`frame::Budget`]).
#[derive(Clone)]
pub struct ServeBounds {
    /// Connections in total and per source address.
    pub gate: wire::quic::ConnectionGate,
    /// Bytes of requests in progress on one client (or proxy) connection.
    pub client_connection_bytes_max: usize,
    /// Bytes of RPCs in progress on one peer connection.
    pub peer_connection_bytes_max: usize,
}

/// Accepts connections until the endpoint is closed. An incoming connection beyond the
/// gate's limits is refused before its handshake.
pub async fn serve(endpoint: quinn::Endpoint, gw: Arc<Gateway>, bounds: ServeBounds) {
    while let Some(incoming) = endpoint.accept().await {
        let Some(admitted) = bounds.gate.admit(incoming.remote_address()) else {
            incoming.refuse();
            continue;
        };
        let gw = gw.clone();
        let bounds = bounds.clone();
        wire::rt::spawn(async move {
            let _admitted = admitted;
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!("handshake failed: {e}");
                    return;
                }
            };
            wire::quic::grant_streams(&conn);
            if wire::quic::alpn(&conn).as_deref() == Some(ALPN_PEER) {
                let budget = frame::Budget::new(bounds.peer_connection_bytes_max);
                crate::raft::network::serve_peer(conn, gw.raft.clone(), gw.id, budget).await;
            } else {
                let budget = frame::Budget::new(bounds.client_connection_bytes_max);
                serve_client(conn, gw, budget).await;
            }
        });
    }
}

async fn serve_client(conn: quinn::Connection, gw: Arc<Gateway>, budget: frame::Budget) {
    let Some((mut send, hello)) = wire::quic::accept_hello(&conn).await else {
        return;
    };
    let reply: HelloReply = match hello {
        Ok(h) => h.check().map(|_| {
            tracing::debug!(remote = %conn.remote_address(), agent = %h.agent, "client connected");
            HelloOk {
                protocol_version: wire::PROTOCOL_VERSION,
                replica_id: gw.id,
                proxy: false,
            }
        }),
        Err(e) => Err(e),
    };
    let ok = reply.is_ok();
    if let Err(e) = &reply {
        tracing::info!(remote = %conn.remote_address(), "refused client hello: {e}");
    }
    let _ = frame::write(&mut send, &reply, frame::HELLO_BYTES_MAX).await;
    let _ = send.finish();
    if !ok {
        // Give the error frame time to reach the client before closing.
        let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
        conn.close(2u32.into(), b"hello refused");
        return;
    }
    let exceeded = Arc::new(wire::quic::ExceededLog::default());
    loop {
        let (send, mut recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(_) => return,
        };
        let (gw, budget, exceeded) = (gw.clone(), budget.clone(), exceeded.clone());
        let remote = conn.remote_address();
        wire::rt::spawn(async move {
            let received = Instant::now();
            let read =
                frame::read_request::<_, Request>(&mut recv, CLIENT_FRAME_BYTES_MAX, &budget);
            // The request's bytes stay reserved from the connection's budget until its
            // answer is written.
            let (resp, _reserved): (Response, _) = match read.await {
                Ok((req, reserved)) if req.op == Op::Events => {
                    drop(reserved);
                    gw.serve_events(req.session, send).await;
                    return;
                }
                Ok((req, reserved)) => (gw.handle(req, received).await, Some(reserved)),
                Err(e) => {
                    exceeded.record(remote, &e);
                    (Err(e), None)
                }
            };
            wire::quic::answer(send, &resp, CLIENT_FRAME_BYTES_MAX).await;
        });
    }
}

impl Gateway {
    /// Answers one request.
    pub async fn handle(&self, req: Request, received: Instant) -> Response {
        let op = req.op.name();
        let r = self.dispatch(req, received).await;
        self.latency.record(op, received.elapsed());
        self.with_leader_hint(r)
    }

    fn with_leader_hint(&self, r: Response) -> Response {
        match r {
            Err(Error::NotLeader {
                leader_id: None, ..
            }) => {
                let m = self.raft.metrics().borrow().clone();
                let leader_id = m.current_leader.filter(|l| *l != self.id);
                let leader_addr = leader_id.and_then(|l| {
                    m.membership_config
                        .membership()
                        .get_node(&l)
                        .map(|n| n.addr.clone())
                });
                Err(Error::NotLeader {
                    leader_id,
                    leader_addr,
                })
            }
            other => other,
        }
    }

    async fn propose(&self, cmd: Command) -> Response {
        self.raft_node.send(Propose(cmd)).await.unwrap_or_else(|e| {
            Err(Error::Internal {
                reason: format!("raft node: {e}"),
            })
        })
    }

    async fn write(&self, req: &Request, ops: Vec<TxnOp>, single: bool) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        crate::state_machine::validate_write(&ops, single)?;
        if let Err(e @ Error::SessionExpired { .. }) = self
            .state
            .read()
            .expect("state lock")
            .sm
            .check_session(req.session)
            .map(|_| ())
        {
            return Err(e);
        }
        // A retry (same session and request id) of a write still in flight here joins it:
        // under load clients and proxies resend while a write is held or queued, and each
        // resend would otherwise be one more log entry (applied as a duplicate, but paid
        // for in the log, replication and apply).
        let key = (req.session, req.request_id);
        let joined = {
            let mut m = self.in_flight.0.lock().expect("in-flight lock");
            match m.get(&key) {
                Some(tx) => Some(tx.subscribe()),
                None => {
                    m.insert(key, tokio::sync::broadcast::channel(1).0);
                    None
                }
            }
        };
        if let Some(mut rx) = joined {
            return rx.recv().await.unwrap_or_else(|_| {
                Err(Error::Unavailable {
                    reason: "the first attempt of this request ended; retry".into(),
                })
            });
        }
        let mut guard = InFlightGuard {
            table: &self.in_flight,
            key,
            answer: None,
        };
        let paths = cached_paths(&ops);
        let cmd = Command::Write {
            session: req.session,
            request_id: req.request_id,
            ack_below: req.ack_below,
            ops,
            single,
        };
        let r = self.propose_held(paths, cmd).await;
        guard.answer = Some(r.clone());
        r
    }

    /// Proposes `cmd` after every cacher of `paths` dropped them (Chubby's rule), keeping
    /// the nodes uncachable until the command is applied.
    pub async fn propose_held(&self, paths: Vec<String>, cmd: Command) -> Response {
        if paths.is_empty() {
            return self.propose(cmd).await;
        }
        let (hold, term) =
            self.cachers
                .send(Hold(paths))
                .await
                .map_err(|e| Error::Internal {
                    reason: format!("cacher list: {e}"),
                })??;
        self.propose_in_hold(Some(hold), term, cmd).await
    }

    /// Proposes `cmd` as held by the cacher list in `term` (under `hold`, released once
    /// the command's fate is known).
    async fn propose_in_hold(&self, hold: Option<u64>, term: u64, cmd: Command) -> Response {
        // Applied only if appended in the term whose cacher list held it.
        let r = self
            .propose(Command::Held {
                term,
                command: Box::new(cmd),
            })
            .await;
        // A proposal that timed out may still commit: its nodes stay uncachable (the
        // hold kept) until this leadership ends, or a cached read could be recorded with
        // the old value just before the write applies.
        if let (Some(hold), true) = (hold, crate::actors::raft_node::releases_hold(&r)) {
            self.cachers.do_send(Release(hold));
        }
        r
    }

    /// A read for caching: the value (or absence), and whether this session was recorded
    /// as a cacher (atomically with the read, see `leader::cachers`).
    async fn cached_get(&self, req: &Request, p: &str) -> Response {
        path::validate(p)?;
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        self.gate.confirm().await?;
        let marked = self
            .state
            .read()
            .expect("state lock")
            .sm
            .check_session(req.session)?
            .caches;
        if !marked {
            // Once per session: log that it caches, so a future leader knows to wait for
            // its flush after a fail-over.
            self.propose(Command::MarkCacher {
                session: req.session,
            })
            .await?;
        }
        let internal = |e: actix::MailboxError| Error::Internal {
            reason: format!("cacher list: {e}"),
        };
        let epoch = self
            .cachers
            .send(BeginRead(p.to_string()))
            .await
            .map_err(internal)?;
        let (value, index) = {
            let s = self.state.read().expect("state lock");
            s.sm.check_session(req.session)?;
            // A node's children are not part of what is cached: a child's create or
            // delete does not hold its parent, so the children fields would go stale in
            // a cache. They are 0 in every cached read (`children` reads them).
            let value = s.sm.node(p).map(|n| {
                let mut stat = n.stat();
                stat.children_count = 0;
                stat.children_version = 0;
                (n.data.clone(), stat)
            });
            (value, s.sm.last_index())
        };
        let owner = value.as_ref().and_then(|(_, stat)| stat.ephemeral_owner);
        let seen = value
            .as_ref()
            .map(|(_, stat)| (stat.create_index, stat.mod_index));
        // Sequential creates are not held (see `cached_paths`), so the absence of a name
        // one could make (ending in a sequence number) is not cachable: names are
        // predictable, and a cached absence of `.../lock-0000000007` would go stale.
        if value.is_none() && crate::state_machine::sequence_of(path::name(p)).is_some() {
            return Ok(Reply::CachedData {
                value,
                index,
                cachable: false,
            });
        }
        let cachable = match epoch {
            Some((term, epoch)) => self
                .cachers
                .send(Record {
                    session: req.session,
                    path: p.to_string(),
                    term,
                    epoch,
                    owner,
                    seen,
                })
                .await
                .map_err(internal)?,
            None => false,
        };
        Ok(Reply::CachedData {
            value,
            index,
            cachable,
        })
    }

    /// A linearizable read; with `watch`, a one-shot watch armed at the index the read
    /// reflects.
    async fn read(
        &self,
        req: &Request,
        p: &str,
        watch: bool,
        f: impl FnOnce(&crate::state_machine::StateMachine) -> Response,
    ) -> Response {
        path::validate(p)?;
        if watch && req.session == 0 {
            return Err(Error::SessionRequired);
        }
        self.gate.confirm().await?;
        let reply = {
            let s = self.state.read().expect("state lock");
            if watch {
                s.sm.check_session(req.session)?;
            }
            f(&s.sm)?
        };
        if watch {
            let Some((kind, since)) = reply.armed_watch() else {
                return Err(Error::Internal {
                    reason: format!("unexpected {reply:?}"),
                });
            };
            let arm = Arm {
                session: req.session,
                path: p.to_string(),
                kind,
                since,
                deliver: true,
            };
            self.watches.send(arm).await.map_err(|e| Error::Internal {
                reason: format!("watch table: {e}"),
            })?;
        }
        Ok(reply)
    }

    async fn rewatch(&self, req: &Request, watches: Vec<wire::types::WatchSpec>) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        path::validate_rewatch(&watches)?;
        self.gate.confirm().await?;
        self.state
            .read()
            .expect("state lock")
            .sm
            .check_session(req.session)?;
        let mut fired = Vec::new();
        for w in watches {
            let arm = Arm {
                session: req.session,
                path: w.path,
                kind: w.kind,
                since: w.since_index,
                deliver: false,
            };
            if let Some(ev) = self.watches.send(arm).await.map_err(|e| Error::Internal {
                reason: format!("watch table: {e}"),
            })? {
                fired.push(ev);
            }
        }
        Ok(Reply::Rewatched { fired })
    }

    /// Serves a session's event stream: confirms leadership, attaches the stream to the
    /// watch table, then forwards events until the session ends, leadership changes, or
    /// the client goes away.
    pub async fn serve_events(&self, session: wire::types::SessionId, mut send: quinn::SendStream) {
        let mut term = 0;
        let opened: Response = async {
            if session == 0 {
                return Err(Error::SessionRequired);
            }
            // Before the confirmation: a stream confirms a flush only in the term it was
            // confirmed for (see `StreamConnected`). If the term moved on meanwhile, the
            // cacher list would drop the confirmation while the stream stayed attached,
            // and writes would wait for this session: refuse, and the client reopens.
            term = self.raft.metrics().borrow().current_term;
            self.gate.confirm().await?;
            if self.raft.metrics().borrow().current_term != term {
                return Err(Error::NotLeader {
                    leader_id: None,
                    leader_addr: None,
                });
            }
            let s = self.state.read().expect("state lock");
            s.sm.check_session(session)?;
            Ok(Reply::EventsOpened {
                index: s.sm.last_index(),
            })
        }
        .await;
        let opened = self.with_leader_hint(opened);
        let ok = opened.is_ok();
        if frame::write(&mut send, &opened, CLIENT_FRAME_BYTES_MAX)
            .await
            .is_err()
            || !ok
        {
            let _ = send.finish();
            return;
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        self.watches.do_send(Connect { session, tx, term });
        self.cachers.do_send(StreamConnected { session, term });
        while let Some(ev) = rx.recv().await {
            let item: Response = Ok(ev);
            if frame::write(&mut send, &item, CLIENT_FRAME_BYTES_MAX)
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = send.finish();
    }

    async fn dispatch(&self, req: Request, received: Instant) -> Response {
        match req.op.clone() {
            Op::CreateSession => match self.propose(Command::CreateSession).await? {
                Reply::SessionCreated { session, .. } => Ok(Reply::SessionCreated {
                    session,
                    session_lease_ms: self.lease_ms,
                }),
                other => Err(Error::Internal {
                    reason: format!("unexpected {other:?}"),
                }),
            },
            Op::KeepAliveBatch { sessions } => self.keepalive_batch(sessions, received).await,
            Op::ProxyStatus => Err(Error::BadRequest {
                reason: "ProxyStatus is answered by proxies; this is a replica".into(),
            }),
            Op::KeepAlive => {
                if req.session == 0 {
                    return Err(Error::SessionRequired);
                }
                self.keepalive_stats.rpcs.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(session = req.session, "KeepAlive");
                if !self.overdue(&[req.session]).await.is_empty() {
                    return Err(Error::SessionExpired {
                        session: req.session,
                    });
                }
                let mut r = match self
                    .sessions
                    .send(KeepAliveMany {
                        sessions: vec![req.session],
                        received,
                    })
                    .await
                {
                    Ok(mut one) => one.pop().unwrap_or_else(|| {
                        Err(Error::Internal {
                            reason: "session manager answered no session".into(),
                        })
                    }),
                    Err(e) => Err(Error::Internal {
                        reason: format!("session manager: {e}"),
                    }),
                };
                if let Ok(Reply::KeepAlive { unacknowledged, .. }) = &mut r {
                    self.keepalive_stats.renewed.fetch_add(1, Ordering::Relaxed);
                    // A cacher whose event stream lost an invalidation hears of it here.
                    if !self.cachers_among(&[req.session]).is_empty() {
                        *unacknowledged = self
                            .cachers
                            .send(Unacknowledged(req.session))
                            .await
                            .unwrap_or_default();
                    }
                }
                r
            }
            Op::CloseSession => {
                if req.session == 0 {
                    return Err(Error::SessionRequired);
                }
                // Its ephemeral nodes vanish: drop cached copies first (the cacher list
                // reads them and marks the session ending in one step, see `HoldEnd`).
                let held = self
                    .cachers
                    .send(HoldEnd {
                        sessions: vec![req.session],
                        lease_ran_out: false,
                    })
                    .await
                    .map_err(|e| Error::Internal {
                        reason: format!("cacher list: {e}"),
                    })?;
                let (hold, term) = held?;
                self.propose_in_hold(
                    hold,
                    term,
                    Command::CloseSession {
                        session: req.session,
                    },
                )
                .await
            }
            Op::Create { path, data, mode } => {
                self.write(&req, vec![TxnOp::Create { path, data, mode }], true)
                    .await
            }
            Op::Delete { path, version } => {
                self.write(&req, vec![TxnOp::Delete { path, version }], true)
                    .await
            }
            Op::SetData {
                path,
                data,
                version,
            } => {
                self.write(
                    &req,
                    vec![TxnOp::SetData {
                        path,
                        data,
                        version,
                    }],
                    true,
                )
                .await
            }
            Op::Txn { ops } => self.write(&req, ops, false).await,
            Op::Get { path, watch } => self.read(&req, &path, watch, |sm| sm.get(&path)).await,
            Op::Exists { path, watch } => {
                self.read(&req, &path, watch, |sm| sm.exists(&path)).await
            }
            Op::Children { path, watch } => {
                self.read(&req, &path, watch, |sm| sm.children(&path)).await
            }
            Op::Events => Err(Error::BadRequest {
                reason: "Events needs its own stream".into(),
            }),
            Op::Rewatch { watches } => self.rewatch(&req, watches).await,
            Op::Predecessor { path } => {
                path::validate(&path)?;
                self.gate.confirm().await?;
                let s = self.state.read().expect("state lock");
                if s.sm.node(&path).is_none() {
                    return Err(Error::NoNode { path });
                }
                Ok(Reply::Predecessor {
                    predecessor: s.sm.predecessor(&path),
                })
            }
            Op::CheckSequencer {
                path,
                token,
                session,
            } => {
                path::validate(&path)?;
                self.gate.confirm().await?;
                let s = self.state.read().expect("state lock");
                Ok(Reply::Sequencer {
                    current: s.sm.sequencer_current(&path, token, session),
                })
            }
            Op::Status => Ok(Reply::Status(self.status().await)),
            Op::CachedGet { path } => self.cached_get(&req, &path).await,
            Op::AckInvalidations { ids } => {
                if req.session == 0 {
                    return Err(Error::SessionRequired);
                }
                self.cachers.do_send(Ack {
                    session: req.session,
                    ids,
                });
                Ok(Reply::Acked)
            }
            Op::AckInvalidationsBatch { acks } => {
                path::validate_ack_batch(&acks)?;
                for (session, ids) in acks {
                    self.cachers.do_send(Ack { session, ids });
                }
                Ok(Reply::Acked)
            }
            Op::AddLearner { id, addr } => {
                if addr.parse::<std::net::SocketAddr>().is_err() {
                    return Err(Error::BadRequest {
                        reason: format!("bad address {addr:?}"),
                    });
                }
                self.change(ChangeMembership::AddLearner { id, addr }).await
            }
            Op::Promote { id } => self.change(ChangeMembership::Promote { id }).await,
            Op::RemoveMember { id } => self.change(ChangeMembership::Remove { id }).await,
            Op::Snapshot => self.snapshot().await,
            Op::StateDigest => {
                // Held while computing: a second request meanwhile is refused too.
                let Ok(mut last) = self.last_digest.try_lock() else {
                    return Err(Error::Unavailable {
                        reason: "a state digest is being computed; retry".into(),
                    });
                };
                if last.is_some_and(|t| t.elapsed() < DIGEST_INTERVAL) {
                    return Err(Error::Unavailable {
                        reason: format!(
                            "a state digest was computed less than {} ms ago; retry",
                            DIGEST_INTERVAL.as_millis()
                        ),
                    });
                }
                let r = {
                    let s = self.state.read().expect("state lock");
                    Reply::StateDigest {
                        index: s.sm.last_index(),
                        digest: s.sm.digest(),
                    }
                };
                *last = Some(Instant::now());
                Ok(r)
            }
        }
    }

    /// Builds a snapshot covering at least what is applied now; answers once it is written.
    async fn snapshot(&self) -> Response {
        let st = &self.snapshot_stats;
        let applied = self
            .raft
            .metrics()
            .borrow()
            .last_applied
            .map_or(0, |l| l.index);
        let started = Instant::now();
        let deadline = started + Duration::from_secs(120);
        let mut seen = st.built.load(Ordering::Acquire);
        let internal = |e: String| Error::Internal {
            reason: format!("snapshot: {e}"),
        };
        self.raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| internal(e.to_string()))?;
        loop {
            let built = st.built.load(Ordering::Acquire);
            if built != seen {
                if st.last_index.load(Ordering::Relaxed) >= applied {
                    return Ok(Reply::SnapshotTaken {
                        index: st.last_index.load(Ordering::Relaxed),
                        bytes: st.last_bytes.load(Ordering::Relaxed),
                        serialize_ms: st.last_serialize_ms.load(Ordering::Relaxed),
                        total_ms: st.last_total_ms.load(Ordering::Relaxed),
                    });
                }
                // One already under way when asked covered less: ask again.
                seen = built;
                self.raft
                    .trigger()
                    .snapshot()
                    .await
                    .map_err(|e| internal(e.to_string()))?;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("a snapshot covering index {applied}"),
                    after_ms: started.elapsed().as_millis() as u64,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Renews many sessions with one leadership check (the session manager coalesces the
    /// checks of KeepAlives in flight together). Fails as a whole only when this replica
    /// does not lead; otherwise says which sessions were renewed and which are over.
    async fn keepalive_batch(&self, sessions: Vec<u64>, received: Instant) -> Response {
        path::validate_keepalive_batch(&sessions)?;
        self.keepalive_stats.rpcs.fetch_add(1, Ordering::Relaxed);
        let overdue = self.overdue(&sessions).await;
        let sessions: Vec<SessionId> = if overdue.is_empty() {
            sessions
        } else {
            sessions
                .into_iter()
                .filter(|s| !overdue.contains(s))
                .collect()
        };
        let results = match self
            .sessions
            .send(KeepAliveMany {
                sessions: sessions.clone(),
                received,
            })
            .await
        {
            Ok(results) => results,
            Err(e) => {
                return Err(Error::Internal {
                    reason: format!("session manager: {e}"),
                })
            }
        };
        // Overdue sessions are in none of the lists: not renewed, and not reported as
        // expired either (a proxy would then stop waiting for them at once, while the
        // client's own lease may still let it serve from its cache). Their waiters at the
        // proxy time out, their clients fall into jeopardy, and once their leases run
        // out here they are reported expired like any other.
        let (mut renewed, mut expired, mut unknown) = (Vec::new(), Vec::new(), Vec::new());
        let mut first_err = None;
        let mut failed = Vec::new();
        for (&session, r) in sessions.iter().zip(results) {
            match r {
                Ok(_) => renewed.push(session),
                Err(Error::SessionExpired { .. }) => expired.push(session),
                Err(Error::UnknownSession { .. }) => unknown.push(session),
                Err(e) => {
                    failed.push(session);
                    first_err.get_or_insert(e);
                }
            }
        }
        tracing::debug!(
            sessions = %IdRanges(&sessions),
            renewed = renewed.len(),
            expired = %IdRanges(&expired),
            unknown = %IdRanges(&unknown),
            failed = %IdRanges(&failed),
            first_err = ?first_err,
            ms = received.elapsed().as_millis() as u64,
            "KeepAliveBatch"
        );
        if renewed.is_empty() && expired.is_empty() && unknown.is_empty() {
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        self.keepalive_stats
            .renewed
            .fetch_add(renewed.len() as u64, Ordering::Relaxed);
        // Cachers among them hear of overdue invalidations here too.
        let cachers = self.cachers_among(&renewed);
        let unacknowledged = if cachers.is_empty() {
            Vec::new()
        } else {
            self.cachers
                .send(UnacknowledgedMany(cachers))
                .await
                .unwrap_or_default()
        };
        Ok(Reply::KeepAliveBatch {
            session_lease_ms: self.lease_ms,
            renewed,
            expired,
            unknown,
            unacknowledged,
        })
    }

    /// Of `sessions`, those open in the state that have cached something (one read of the
    /// state for them all).
    fn cachers_among(&self, sessions: &[SessionId]) -> Vec<SessionId> {
        let s = self.state.read().expect("state lock");
        sessions
            .iter()
            .copied()
            .filter(|id| s.sm.check_session(*id).is_ok_and(|x| x.caches))
            .collect()
    }

    /// Of `sessions` (renewing now), the cachers that a hold has waited for (an
    /// unacknowledged invalidation, or after a fail-over an unconfirmed flush) for
    /// [`OVERDUE_LEASES`] leases: they are not renewed (a single KeepAlive is answered
    /// `SessionExpired`; in a batch they are left out of every list), so their leases run
    /// out here within one more lease and the writes held for them go on. A client that renews but never acknowledges (a bug,
    /// or a stuck event stream while it ignores the invalidations repeated in its
    /// KeepAlive replies) loses its session, and with it its cache, instead of holding
    /// writes to its nodes (and the ends of other sessions whose ephemerals it cached)
    /// for as long as it lives. So a hold waits at most for every cacher's
    /// acknowledgement or the end of its lease, and that end comes at most
    /// `OVERDUE_LEASES + 1` leases after the hold began.
    async fn overdue(&self, sessions: &[SessionId]) -> Vec<SessionId> {
        let cachers = self.cachers_among(sessions);
        if cachers.is_empty() {
            return Vec::new();
        }
        let age = Duration::from_millis(self.lease_ms) * OVERDUE_LEASES;
        let overdue = self
            .cachers
            .send(Overdue {
                sessions: cachers,
                age,
            })
            .await
            .unwrap_or_default();
        if !overdue.is_empty() {
            tracing::warn!(
                sessions = %IdRanges(&overdue),
                after_ms = age.as_millis() as u64,
                "sessions renew but leave invalidations unacknowledged: no longer renewed, \
                 they lose their cache with their session"
            );
        }
        overdue
    }

    async fn change(&self, c: ChangeMembership) -> Response {
        self.raft_node.send(c).await.unwrap_or_else(|e| {
            Err(Error::Internal {
                reason: format!("raft node: {e}"),
            })
        })
    }

    /// This replica's view of the cell.
    pub async fn status(&self) -> Status {
        let stats = self.cachers.send(Stats).await.ok();
        let watches = self
            .watches
            .send(WatchCount(String::new()))
            .await
            .map_or(0, |c| c.total as u64);
        let m = self.raft.metrics().borrow().clone();
        let members = members(&self.raft);
        let leader = m.current_leader.and_then(|l| {
            members
                .iter()
                .find(|x| x.id == l)
                .cloned()
                .or(Some(MemberInfo {
                    id: l,
                    addr: String::new(),
                    voter: true,
                }))
        });
        let (sessions, nodes) = {
            let s = self.state.read().expect("state lock");
            (s.sm.session_count() as u64, s.sm.node_count() as u64)
        };
        Status {
            id: self.id,
            role: format!("{:?}", m.state),
            term: m.current_term,
            leader,
            last_applied: m.last_applied.map(|l| l.index).unwrap_or(0),
            last_log_index: m.last_log_index.unwrap_or(0),
            snapshot_index: m.snapshot.map(|l| l.index),
            purged_index: m.purged.map(|l| l.index),
            members,
            session_count: sessions,
            node_count: nodes,
            log_appends: self.log_stats.appends.load(Ordering::Relaxed),
            log_syncs: self.log_stats.syncs.load(Ordering::Relaxed),
            cachers: stats.map_or(0, |s| s.cachers),
            oldest_invalidation_ms: stats.map_or(0, |s| s.oldest_invalidation_ms),
            keepalive_rpcs: self.keepalive_stats.rpcs.load(Ordering::Relaxed),
            keepalives_renewed: self.keepalive_stats.renewed.load(Ordering::Relaxed),
            watches,
            invalidations_sent: stats.map_or(0, |s| s.invalidations_sent),
            snapshot_bytes: self.snapshot_stats.last_bytes.load(Ordering::Relaxed),
            snapshot_build_ms: self.snapshot_stats.last_total_ms.load(Ordering::Relaxed),
            request_latency: self.latency.snapshot(),
            peer_dials: self.peer_dials.load(Ordering::Relaxed),
        }
    }
}
