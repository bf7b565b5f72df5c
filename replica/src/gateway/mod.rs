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
use crate::actors::raft_node::{members, ChangeMembership, RaftNode};
use crate::actors::session_manager::{KeepAliveMany, SessionManager};
use crate::actors::watch_table::{Arm, Connect, WatchCount, WatchTableActor};
use crate::raft::read_gate::ReadGate;
use crate::raft::sm_store::{SharedState, SnapshotStats};
use crate::raft::Raft;
use crate::state_machine::Acting;

mod acls;
mod admin;
mod prefixes;
mod reads;
mod sessions;
mod writes;

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
    /// The cell this replica belongs to, from its certificate's identity
    /// (`lock://<cell>/replica/<name>`): only this cell's replicas may speak the peer
    /// protocol to it, and the client protocol only from clients and its own proxies.
    /// A proxy of this cell may also forward requests for its clients
    /// ([`Op::Forwarded`]) and renew or acknowledge for their sessions in batches.
    pub cell: String,
    /// Raft handle (metrics, peers).
    pub raft: Raft,
    /// The Raft node: membership changes go through it.
    pub raft_node: Addr<RaftNode>,
    /// Where the gateway's commands are proposed (the Raft node's batcher, directly).
    pub proposer: crate::actors::raft_node::Proposer,
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
    /// Peer certificates checked on dialed connections
    /// (`PeerNetworkFactory::cert_checks`), for [`Status`].
    pub peer_certificate_checks: Arc<std::sync::atomic::AtomicU64>,
    /// Connections, requests in flight and sessions per client identity.
    pub quotas: Arc<wire::quota::Quotas>,
    /// When the last [`Op::StateDigest`] was computed: one at a time, at most one per
    /// [`DIGEST_INTERVAL`] (each walks the whole state under its read lock, which holds
    /// applies back).
    pub last_digest: std::sync::Mutex<Option<Instant>>,
    /// What the metrics record as it happens (refusals are counted here).
    pub instruments: Arc<crate::metrics::Instruments>,
    /// Backups to object storage, when `[backup]` names a store.
    pub backup: Option<Backups>,
    /// The highest candidate's term this replica stood at once for
    /// (`raft::network::stand_first`).
    pub stood_first: Arc<std::sync::atomic::AtomicU64>,
    /// This replica's store (`raft::binding`): named in its hello to peers.
    pub store: wire::raft::StoreId,
    /// Held while a snapshot sent by a peer is received and installed: one at a time in
    /// the replica, whichever connection it comes on (its bytes are held outside every
    /// connection's budget, bounded by `raft::network::SNAPSHOT_BYTES_MAX`).
    pub snapshot_receiving: Arc<tokio::sync::Mutex<()>>,
}

/// The replica's backups to object storage ([`crate::actors::backuper`]).
pub struct Backups {
    /// The backuper.
    pub addr: Addr<crate::actors::backuper::Backuper>,
    /// The store's URL (`backup.url`).
    pub url: String,
    /// What it has done.
    pub stats: Arc<crate::actors::backuper::BackupStats>,
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
    /// The TLS files, re-read when they change: each connection is closed when its
    /// certificate expires or is revoked ([`wire::tls::Reloading::guard`]).
    pub tls_files: Option<Arc<wire::tls::Reloading>>,
}

/// Accepts connections until the endpoint is closed. An incoming connection beyond the
/// gate's limits is refused before its handshake; one without a certificate from the
/// cell's CA fails the handshake; one whose identity may not use the protocol it chose is
/// closed before its first frame ([`wire::identity::admit`]).
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
            let peer = wire::quic::alpn(&conn).as_deref() == Some(ALPN_PEER);
            // Who it is, before any frame is read: a connection whose certificate has no
            // identity, or whose role may not use this protocol here, is closed with the
            // reason.
            let listener = wire::identity::Listener::Replica { cell: &gw.cell };
            let Ok(who) = wire::identity::check_accepted(&conn, listener, peer) else {
                return;
            };
            if let Some(files) = &bounds.tls_files {
                files.guard(conn.clone());
            }
            wire::quic::grant_streams(&conn);
            if peer {
                let budget = frame::Budget::new(bounds.peer_connection_bytes_max);
                crate::raft::network::serve_peer(
                    conn,
                    gw.raft.clone(),
                    gw.id,
                    gw.store,
                    gw.stood_first.clone(),
                    gw.snapshot_receiving.clone(),
                    budget,
                )
                .await;
            } else {
                wire::serve::serve(conn, who, gw, bounds.client_connection_bytes_max).await;
            }
        });
    }
}

/// The client protocol of a replica: every request is answered by [`Gateway::handle`];
/// the loop around it is `wire::serve`'s, shared with the proxies.
impl wire::serve::Handler for Gateway {
    type Connection = ();
    /// The connection's place in its identity's quota (none for a proxy of this cell,
    /// whose clients are counted one by one).
    type Held = Option<wire::quota::Place>;

    fn hello(
        &self,
        caller: &wire::serve::Caller,
        hello: Result<wire::hello::Hello, Error>,
    ) -> ((), Self::Held, HelloReply) {
        let identity = caller.identity.as_deref().unwrap_or_default();
        let place = if self.is_own_proxy(identity) {
            Ok(None)
        } else {
            self.quotas.connect(identity).map(Some)
        };
        let (place, hello) = match place {
            Ok(p) => (p, hello),
            Err(e) => (None, Err(e)),
        };
        let reply: HelloReply = match hello {
            Ok(h) => h.check().map(|_| {
                tracing::debug!(remote = %caller.peer, agent = %h.agent, "client connected");
                HelloOk {
                    protocol_version: wire::PROTOCOL_VERSION,
                    replica_id: self.id,
                    proxy: false,
                    store: None,
                }
            }),
            Err(e) => Err(e),
        };
        if let Err(e) = &reply {
            tracing::info!(remote = %caller.peer, "refused client hello: {e}");
        }
        ((), place, reply)
    }

    async fn request(
        &self,
        _: &(),
        caller: &wire::serve::Caller,
        req: Request,
        received: Instant,
    ) -> Response {
        self.handle(caller, req, received).await
    }

    async fn events(
        &self,
        _: &(),
        caller: &wire::serve::Caller,
        session: SessionId,
        send: quinn::SendStream,
        _: quinn::Connection,
    ) {
        let acting = self.acting(caller, false);
        self.serve_events(session, &acting, send).await
    }
}

/// How long a request answered `NotLeader` by a replica that cannot name another leader
/// is held for the election under way ([`Gateway::leader_coming`]), in ms: a leader
/// transfer or a contested election takes a few round trips; an election that takes
/// longer (no quorum) gets the `NotLeader` answer as before, a little later.
const LEADER_HOLD_MS: u64 = 300;

impl Gateway {
    /// Answers one request from `caller`; a proxy's [`Op::Forwarded`] is answered as if
    /// its client had sent the inner op.
    pub async fn handle(
        &self,
        caller: &wire::serve::Caller,
        req: Request,
        received: Instant,
    ) -> Response {
        let op = req.op.name();
        let r = self.placed(caller, req, received).await;
        self.latency.record(op, received.elapsed());
        if let Err(e) = &r {
            self.instruments.refused(e);
        }
        self.with_leader_hint(r)
    }

    /// `req` given a place in its identity's request quota and dispatched (as the
    /// client a proxy forwards it for, if it does); its place is kept while it is held
    /// for an election ([`Gateway::dispatch_or_hold`]).
    async fn placed(
        &self,
        caller: &wire::serve::Caller,
        req: Request,
        received: Instant,
    ) -> Response {
        match req.op {
            Op::Forwarded { identity, op } => match self.forwarded_caller(caller, identity, &op) {
                Ok(client) => match self.request_place(&client, &op) {
                    Ok(_place) => {
                        self.dispatch_or_hold(&client, Request { op: *op, ..req }, received)
                            .await
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            },
            _ => match self.request_place(caller, &req.op) {
                Ok(_place) => self.dispatch_or_hold(caller, req, received).await,
                Err(e) => Err(e),
            },
        }
    }

    /// Dispatches `req`; if it is answered `NotLeader` while an election is under way,
    /// holds the answer for it ([`Gateway::leader_coming`]), and dispatches the request
    /// again if this replica was elected meanwhile: as the client's own retry with the
    /// same request id would, only sooner. Never a `TransferLeader` (it would give away
    /// the leadership just won).
    async fn dispatch_or_hold(
        &self,
        caller: &wire::serve::Caller,
        req: Request,
        received: Instant,
    ) -> Response {
        // A copy only where it may be served again: here, a replica that knows no leader
        // now may be elected while the request waits.
        let again = (self.raft.metrics().borrow().current_leader.is_none()
            && !matches!(req.op, Op::TransferLeader { .. }))
        .then(|| req.clone());
        let r = self.dispatch(caller, req, received).await;
        let Err(Error::NotLeader { leader_id, .. }) = &r else {
            return r;
        };
        match (self.leader_coming(*leader_id).await, again) {
            (true, Some(req)) => self.dispatch(caller, req, received).await,
            _ => r,
        }
    }

    /// Called when a request was answered `NotLeader`: if this replica cannot name
    /// another leader yet (an election is under way, or it leads but is handing the
    /// leadership over), waits until it can, at most [`LEADER_HOLD_MS`], so the answer
    /// names the new leader (filled in by `with_leader_hint`) instead of sending the
    /// client round the replicas and into its election poll (100 ms). Returns true if
    /// this replica itself was elected meanwhile (the request is then served here).
    ///
    /// `named` is the leader the `NotLeader` answer named: a leader handing over names
    /// its target (one that refuses for another reason, just elected or its lease run
    /// out, names none and is not held).
    async fn leader_coming(&self, named: Option<wire::types::ReplicaId>) -> bool {
        let mut metrics = self.raft.metrics();
        let handing_over = {
            let m = metrics.borrow_and_update();
            match m.current_leader {
                None => false,
                Some(l)
                    if l == self.id
                        && m.state == openraft::ServerState::Leader
                        && named.is_some_and(|n| n != self.id) =>
                {
                    true
                }
                Some(_) => return false,
            }
        };
        let me = self.id;
        let known = tokio::time::timeout(
            std::time::Duration::from_millis(LEADER_HOLD_MS),
            metrics.wait_for(|m| match m.current_leader {
                None => false,
                Some(l) if l == me => !handing_over && m.state == openraft::ServerState::Leader,
                Some(_) => true,
            }),
        )
        .await;
        matches!(known, Ok(Ok(m)) if m.current_leader == Some(me))
    }

    /// The caller of a request a proxy forwards for `identity`: only a proxy of this
    /// cell forwards, only for clients, and only one level deep.
    fn forwarded_caller(
        &self,
        caller: &wire::serve::Caller,
        identity: String,
        op: &Op,
    ) -> Result<wire::serve::Caller, Error> {
        if matches!(op, Op::Forwarded { .. } | Op::Events) {
            let what = if matches!(op, Op::Events) {
                "an event stream"
            } else {
                "a forwarded request"
            };
            return Err(Error::BadRequest {
                reason: format!("{what} may not be forwarded"),
            });
        }
        if !matches!(
            wire::identity::Identity::parse(&identity),
            Ok(wire::identity::Identity::Client { .. })
        ) {
            return Err(Error::BadRequest {
                reason: format!("a proxy forwards only for clients, not for {identity:?}"),
            });
        }
        caller.forwarded_for(identity, |me| self.is_own_proxy(me))
    }

    /// A place for `op` in its acting identity's requests in flight, held while it is
    /// answered: none needed for KeepAlives and acknowledgements (never refused, so a
    /// client at its limit keeps its sessions), nor for a proxy's own requests (its
    /// clients' are counted under their identities).
    fn request_place(
        &self,
        caller: &wire::serve::Caller,
        op: &Op,
    ) -> Result<Option<wire::quota::Place>, Error> {
        if matches!(
            op,
            Op::KeepAlive
                | Op::KeepAliveBatch { .. }
                | Op::AckInvalidations { .. }
                | Op::AckInvalidationsBatch { .. }
                | Op::Leadership
        ) {
            return Ok(None);
        }
        let identity = caller.acting_as().unwrap_or_default();
        if caller.on_behalf_of().is_none() && self.is_own_proxy(identity) {
            return Ok(None);
        }
        self.quotas.begin(identity).map(Some)
    }

    /// Whether `identity` is a proxy of this replica's cell.
    fn is_own_proxy(&self, identity: &str) -> bool {
        matches!(
            wire::identity::Identity::parse(identity),
            Ok(wire::identity::Identity::Proxy { cell, .. }) if cell == self.cell
        )
    }

    /// Who `caller` acts as on sessions; `batch`: the request is a batch of KeepAlives or
    /// acknowledgements, which a proxy of this cell sends for its clients' sessions.
    pub(crate) fn acting(&self, caller: &wire::serve::Caller, batch: bool) -> Acting {
        Acting {
            identity: caller.acting_as().unwrap_or_default().to_string(),
            proxy_batch: batch
                && caller.on_behalf_of().is_none()
                && caller
                    .identity
                    .as_deref()
                    .is_some_and(|me| self.is_own_proxy(me)),
            forwarded_by: caller
                .on_behalf_of()
                .and(caller.identity.as_deref())
                .map(str::to_string),
        }
    }

    /// Checks that `acting` may use `session`, decisively: a session this replica has
    /// not applied yet (a leader just elected) is looked up again once leadership is
    /// confirmed, which waits for every committed entry to apply. Its owner never
    /// changes, so what this finds holds until the session ends.
    pub(crate) async fn check_owner(
        &self,
        session: SessionId,
        acting: &Acting,
    ) -> Result<(), Error> {
        let first = self
            .state
            .read()
            .expect("state lock")
            .sm
            .check_session_for(session, acting)
            .map(|_| ());
        match first {
            Err(Error::UnknownSession { .. }) => {
                self.gate.confirm().await?;
                self.state
                    .read()
                    .expect("state lock")
                    .sm
                    .check_session_for(session, acting)
                    .map(|_| ())
            }
            other => other,
        }
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
        self.proposer.propose(cmd).await
    }

    async fn dispatch(
        &self,
        caller: &wire::serve::Caller,
        req: Request,
        received: Instant,
    ) -> Response {
        let me = self.acting(caller, false);
        match req.op.clone() {
            // Sessions (sessions.rs).
            Op::CreateSession => self.create_session(&me).await,
            Op::KeepAlive => self.keepalive(&req, &me, received).await,
            Op::KeepAliveBatch { sessions } => {
                let me = self.acting(caller, true);
                self.keepalive_batch(sessions, &me, received).await
            }
            Op::CloseSession => self.close_session(&req, &me).await,
            Op::AckInvalidations { ids } => self.ack(&req, &me, ids),
            Op::AckInvalidationsBatch { acks } => self.ack_batch(acks, &self.acting(caller, true)),
            Op::Forwarded { .. } => Err(Error::BadRequest {
                reason: "a forwarded request may not be forwarded again".into(),
            }),
            Op::Events => Err(Error::BadRequest {
                reason: "Events needs its own stream".into(),
            }),
            // Writes (writes.rs).
            Op::Create { path, data, mode } => {
                self.write(&req, &me, vec![TxnOp::Create { path, data, mode }], true)
                    .await
            }
            Op::Delete { path, version } => {
                self.write(&req, &me, vec![TxnOp::Delete { path, version }], true)
                    .await
            }
            Op::SetData {
                path,
                data,
                version,
            } => {
                self.write(
                    &req,
                    &me,
                    vec![TxnOp::SetData {
                        path,
                        data,
                        version,
                    }],
                    true,
                )
                .await
            }
            Op::Txn { ops } => self.write(&req, &me, ops, false).await,
            // Reads (reads.rs).
            Op::Get { path, watch } => self.read(&req, &me, &path, watch, |sm| sm.get(&path)).await,
            Op::Exists { path, watch } => {
                self.read(&req, &me, &path, watch, |sm| sm.exists(&path))
                    .await
            }
            Op::Children { path, watch } => {
                self.read(&req, &me, &path, watch, |sm| sm.children(&path))
                    .await
            }
            Op::Rewatch { watches } => self.rewatch(&req, &me, watches).await,
            Op::Predecessor { path } => self.predecessor(&me, path).await,
            Op::CheckSequencer {
                path,
                token,
                session,
            } => self.check_sequencer(path, token, session).await,
            Op::CachedGet { path } => self.cached_get(&req, &me, &path).await,
            // The cell itself (admin.rs).
            Op::Status => Ok(Reply::Status(Box::new(self.status().await))),
            Op::Leadership => Ok(self.leadership()),
            Op::LeadershipAfter {
                wait_ms,
                newer_than,
            } => Ok(self.leadership_after(wait_ms, newer_than).await),
            Op::ProxyStatus => Err(Error::BadRequest {
                reason: "ProxyStatus is answered by proxies; this is a replica".into(),
            }),
            Op::AddLearner { id, addr } => {
                self.require_admin_confirmed(&me, "change the cell's membership")
                    .await?;
                self.add_learner(id, addr).await
            }
            Op::Promote { id } => {
                self.require_admin_confirmed(&me, "change the cell's membership")
                    .await?;
                self.change(ChangeMembership::Promote { id }).await
            }
            Op::RemoveMember { id } => {
                self.require_admin_confirmed(&me, "change the cell's membership")
                    .await?;
                self.change(ChangeMembership::Remove { id }).await
            }
            Op::TransferLeader { to } => {
                self.require_admin_confirmed(&me, "hand the leadership over")
                    .await?;
                let (leader, took) = crate::raft::handover::hand_over(
                    &self.raft,
                    self.id,
                    to,
                    crate::raft::handover::HAND_OVER_WITHIN,
                )
                .await?;
                Ok(Reply::LeaderTransferred {
                    from: self.id,
                    to: leader,
                    took_ms: took.as_millis() as u64,
                })
            }
            Op::Snapshot => {
                self.require_admin(&me, "make a replica take a snapshot")?;
                self.snapshot().await
            }
            Op::StateDigest => self.state_digest(),
            Op::Backup => {
                self.require_admin_confirmed(&me, "back the cell up")
                    .await?;
                self.backup().await
            }
            Op::Sessions { after, limit } => {
                self.require_admin_confirmed(&me, "list the cell's sessions")
                    .await?;
                self.list_sessions(after, limit).await
            }
            // ACLs, groups and admins (acls.rs).
            Op::GetAcl { path } => self.get_acl(&me, &path).await,
            Op::SetAcl { path, acl } => self.set_acl(&me, path, acl).await,
            Op::Security => self.security().await,
            Op::SetGroup { name, members } => {
                self.change_security(Command::SetGroup {
                    by: me.identity.clone(),
                    name,
                    members: Some(members),
                })
                .await
            }
            Op::RemoveGroup { name } => {
                self.change_security(Command::SetGroup {
                    by: me.identity.clone(),
                    name,
                    members: None,
                })
                .await
            }
            Op::SetAdmin { identity, admin } => {
                self.change_security(Command::SetAdmin {
                    by: me.identity.clone(),
                    identity,
                    admin,
                })
                .await
            }
            // Prefixes and moves (prefixes.rs).
            Op::Prefixes => self.prefixes().await,
            Op::SetPrefix {
                prefix,
                epoch,
                state,
            } => self.set_prefix(&me, prefix, epoch, state).await,
            Op::ExportPrefix { prefix, after } => self.export_prefix(&me, prefix, after).await,
            Op::ImportPrefix {
                prefix,
                epoch,
                first,
                nodes,
            } => {
                self.change_prefix_nodes(
                    &me,
                    Command::ImportPrefix {
                        by: me.identity.clone(),
                        prefix,
                        epoch,
                        first,
                        nodes,
                    },
                )
                .await
            }
            Op::DropPrefix { prefix, epoch } => {
                self.change_prefix_nodes(
                    &me,
                    Command::DropPrefix {
                        by: me.identity.clone(),
                        prefix,
                        epoch,
                    },
                )
                .await
            }
            Op::Directory => Err(Error::BadRequest {
                reason: "Directory is answered by directory servers; this is a replica".into(),
            }),
        }
    }
}
