//! Raft RPCs between replicas over QUIC.
//!
//! Each client openraft makes for a peer has a QUIC connection of its own (opened lazily,
//! reopened after a failure), and gives it back to a small pool when dropped, for the next
//! client of that peer. openraft 0.9 makes a new client for each leadership check
//! (`ensure_linearizable`) and each election's votes; without the pool each check dialed
//! every follower again, a TLS handshake per follower per check (about 200 a second at the
//! leader under `loadgen profile`). A pooled connection keeps the record of its peer's
//! certificate check: before, each check's new client verified the certificate chain of
//! its pooled connection again (an ECDSA verification per follower per check, a fifth of
//! the leader's CPU under `loadgen profile --reads uncached`). Connections are not shared by clients alive at the same
//! time: a replication stream keeps its own, as before the pool, so its large AppendEntries
//! never share a congestion window with the heartbeats of a check. Each RPC is one
//! bidirectional stream: a [`PeerRequest`] frame out, a [`PeerResponse`] frame back.
//! A snapshot travels whole on one stream of the connection of the client openraft sends
//! it with ([`PeerRequest::Snapshot`]: a frame with its metadata and length, then its
//! bytes, raw; openraft 0.10 dropped 0.9's chunked `InstallSnapshot` RPC and leaves the
//! transfer to the application). The first stream of a connection carries the hello.
//!
//! A peer killed and restarted at the same address resets the connections made to its
//! previous process at their next packet (its endpoint signs stateless resets with keys
//! derived from its TLS key, `wire::quic::StableReset`), so a pooled or kept connection
//! to it closes at once instead of timing requests out until QUIC's idle timeout (3 s),
//! and openraft's next request dials the new process.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{
    NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use tokio::sync::Mutex;
use wire::hello::{Hello, HelloReply};
use wire::raft::{
    Binding, Member, NodeId, PeerRequest, PeerResponse, PeerState, SnapshotOffer, StoreId,
    TypeConfig, Vote,
};
use wire::{frame, tls, PEER_FRAME_BYTES_MAX};

use crate::raft::sm_store::{Snapshot, SnapshotData};
use crate::raft::Raft;

/// Idle connections, by peer id and address (a member re-added at another address is
/// dialed anew), each with when its peer's certificate was last checked: a connection
/// taken from the pool is checked again only when a fresh one would be ([`Checked`]).
type Pool = Arc<std::sync::Mutex<HashMap<(NodeId, String), Vec<Held>>>>;

/// A connection to a peer, when its certificate was last checked there, and the store its
/// hello named (the same for every answer on it: a store changes only with the process).
type Held = (quinn::Connection, Option<Checked>, Option<StoreId>);

/// The store each member last answered from while the membership did not bind it
/// (unbound or pending), with the log id of the effective membership it was heard under:
/// what the leader binds it to ([`crate::raft::binding::bind_stores`]), only under that
/// same membership (an answer heard before a member was removed and added back says
/// nothing about the store it has now, so an old entry needs no removing).
pub type SeenStores = Arc<std::sync::Mutex<BTreeMap<NodeId, (StoreId, Option<wire::raft::LogId>)>>>;

/// Members whose answers were not counted, each with the store it answered from: logged
/// once each.
type Warned = Arc<std::sync::Mutex<BTreeSet<(NodeId, Option<StoreId>)>>>;

/// Idle connections kept per peer; a client dropped when that many wait closes its own.
const IDLE_PER_PEER_MAX: usize = 4;

/// Creates per-peer clients sharing one QUIC endpoint and a pool of idle connections.
#[derive(Clone)]
pub struct PeerNetworkFactory {
    endpoint: quinn::Endpoint,
    peer_tls: quinn::ClientConfig,
    self_id: NodeId,
    cell: Arc<str>,
    pool: Pool,
    dials: Arc<AtomicU64>,
    cert_checks: Arc<AtomicU64>,
    tls_files: Option<Arc<wire::tls::Reloading>>,
    raft: Arc<std::sync::OnceLock<Raft>>,
    /// The highest term this replica stood again from ([`stand_again`]): once per term,
    /// however many voters refuse it alike.
    stood_again: Arc<AtomicU64>,
    /// This replica's own store.
    store: StoreId,
    /// Stores that answered for members not bound to them.
    seen: SeenStores,
    /// Members whose answers were not counted, and the store they came from, each logged
    /// once.
    warned: Warned,
}

impl PeerNetworkFactory {
    /// Peers are dialed from `endpoint` with `peer_tls` (ALPN `lockservice-peer`); a peer
    /// must prove with its certificate that it is a replica of `cell`.
    pub fn new(
        endpoint: quinn::Endpoint,
        peer_tls: quinn::ClientConfig,
        self_id: NodeId,
        cell: &str,
        store: StoreId,
    ) -> Self {
        PeerNetworkFactory {
            store,
            seen: Arc::default(),
            warned: Arc::default(),
            endpoint,
            peer_tls,
            self_id,
            cell: cell.into(),
            pool: Arc::default(),
            dials: Arc::default(),
            cert_checks: Arc::default(),
            tls_files: None,
            raft: Arc::default(),
            stood_again: Arc::default(),
        }
    }

    /// Where the replica puts its Raft handle once it is made (the factory is made
    /// first): the clients use it to stand again at once after a split vote they cannot
    /// lose ([`stand_again`]).
    pub fn raft_slot(&self) -> Arc<std::sync::OnceLock<Raft>> {
        self.raft.clone()
    }

    /// Checks a peer's certificate again, before each RPC, once `files` took new files
    /// or the certificate's `notAfter` passed: a peer whose certificate expired or was
    /// revoked gets no more RPCs (no more of the log) on a connection dialed before.
    pub fn with_tls_files(mut self, files: Arc<wire::tls::Reloading>) -> Self {
        self.tls_files = Some(files);
        self
    }

    /// The stores members answered from while not bound to them, for the leader to bind
    /// them ([`crate::raft::binding::bind_stores`]).
    pub fn seen_stores(&self) -> SeenStores {
        self.seen.clone()
    }

    /// Connections dialed to peers so far (one per peer, plus one after each failure): a
    /// counter shared with every client, for `Status::peer_dials`.
    pub fn dials(&self) -> Arc<AtomicU64> {
        self.dials.clone()
    }

    /// Peer certificates checked so far on dialed connections (once a connection, again
    /// when the TLS files change or the certificate's `notAfter` passes): a counter shared
    /// with every client, for `Status::peer_certificate_checks`.
    pub fn cert_checks(&self) -> Arc<AtomicU64> {
        self.cert_checks.clone()
    }
}

impl RaftNetworkFactory<TypeConfig> for PeerNetworkFactory {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Member) -> PeerClient {
        let idle = {
            let mut pool = self.pool.lock().expect("peer pool");
            let idle = pool.entry((target, node.addr.clone())).or_default();
            // The most recently returned first; closed ones are dropped on the way.
            std::iter::from_fn(|| idle.pop()).find(|(c, _, _)| c.close_reason().is_none())
        };
        PeerClient {
            endpoint: self.endpoint.clone(),
            tls: self.peer_tls.clone(),
            target,
            addr: node.addr.clone(),
            self_id: self.self_id,
            cell: self.cell.clone(),
            conn: Mutex::new(idle),
            pool: self.pool.clone(),
            dials: self.dials.clone(),
            cert_checks: self.cert_checks.clone(),
            tls_files: self.tls_files.clone(),
            raft: self.raft.clone(),
            stood_again: self.stood_again.clone(),
            seen: self.seen.clone(),
            warned: self.warned.clone(),
            store: self.store,
        }
    }
}

/// One peer's client.
pub struct PeerClient {
    endpoint: quinn::Endpoint,
    tls: quinn::ClientConfig,
    target: NodeId,
    addr: String,
    self_id: NodeId,
    cell: Arc<str>,
    /// The connection, when its peer's certificate was last checked (the files'
    /// generation and the certificate's `notAfter`), and the store its hello named (kept
    /// with the connection in the pool).
    conn: Mutex<Option<Held>>,
    pool: Pool,
    dials: Arc<AtomicU64>,
    cert_checks: Arc<AtomicU64>,
    tls_files: Option<Arc<wire::tls::Reloading>>,
    raft: Arc<std::sync::OnceLock<Raft>>,
    stood_again: Arc<AtomicU64>,
    seen: SeenStores,
    warned: Warned,
    /// This replica's own store.
    store: StoreId,
}

/// When a peer's certificate was last checked on a connection: the TLS files'
/// generation then, and the certificate's `notAfter` (Unix seconds).
type Checked = (u64, i64);

impl Drop for PeerClient {
    /// Gives a live connection back to the pool for the next client of this peer.
    fn drop(&mut self) {
        let Some((conn, checked, store)) = self.conn.get_mut().take() else {
            return;
        };
        if conn.close_reason().is_some() {
            return;
        }
        let mut pool = self.pool.lock().expect("peer pool");
        let idle = pool.entry((self.target, self.addr.clone())).or_default();
        if idle.len() < IDLE_PER_PEER_MAX {
            idle.push((conn, checked, store));
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Failure(String);

enum CallError {
    Unreachable(String),
    Network(String),
}

impl PeerClient {
    /// The connection to the peer (dialed if there is none), and the store its hello
    /// named.
    async fn connection(&self) -> Result<(quinn::Connection, Option<StoreId>), CallError> {
        let mut guard = self.conn.lock().await;
        if let Some((c, checked, store)) = guard.as_mut() {
            if c.close_reason().is_none() {
                match self.recheck(c, checked) {
                    Ok(()) => return Ok((c.clone(), *store)),
                    Err(e) => {
                        tracing::warn!(peer = self.target, "closing the connection to a peer: {e}");
                        c.close(wire::tls::CLOSE_CERTIFICATE.into(), e.as_bytes());
                    }
                }
            }
        }
        let addr = resolve_peer(&self.addr, &self.endpoint).await?;
        self.dials.fetch_add(1, Ordering::Relaxed);
        let connecting = self
            .endpoint
            .connect_with(self.tls.clone(), addr, tls::SERVER_NAME)
            .map_err(|e| CallError::Unreachable(format!("connect {addr}: {e}")))?;
        let conn = tokio::time::timeout(Duration::from_secs(2), connecting)
            .await
            .map_err(|_| CallError::Unreachable(format!("connect {addr}: timed out")))?
            .map_err(|e| CallError::Unreachable(format!("connect {addr}: {e}")))?;
        // The CA signed it; it must also be a replica of this cell, not a proxy or a client
        // (or another cell's replica) found at a peer's address.
        let expect = wire::identity::Dialed::PeerOf { cell: &self.cell };
        if let Err(e) = wire::identity::check_dialed(&conn, expect) {
            return Err(CallError::Unreachable(format!(
                "peer {} at {addr}: {e}",
                self.target
            )));
        }

        // Hello on the first stream.
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| CallError::Unreachable(e.to_string()))?;
        frame::write(
            &mut send,
            &Hello::new(format!("replica {}", self.self_id)),
            1024,
        )
        .await
        .map_err(|e| CallError::Unreachable(e.to_string()))?;
        let _ = send.finish();
        let reply: HelloReply = frame::read(&mut recv, 1024)
            .await
            .map_err(|e| CallError::Unreachable(e.to_string()))?;
        let hello = reply.map_err(|e| {
            CallError::Unreachable(format!("peer {} refused hello: {e}", self.target))
        })?;
        // The replica this address reached must be the one dialed: replicas of a cell may
        // share a certificate, and an address may now lead to another (a name re-resolved
        // to a reused IP, a replica restarted elsewhere). Its votes and acknowledgements
        // would otherwise count twice.
        if hello.replica_id != self.target {
            conn.close(0u32.into(), b"not the replica dialed");
            return Err(CallError::Unreachable(format!(
                "dialed replica {} at {addr}, and replica {} answered",
                self.target, hello.replica_id
            )));
        }
        let checked =
            match &self.tls_files {
                Some(files) => {
                    self.cert_checks.fetch_add(1, Ordering::Relaxed);
                    Some(files.verify_dialed(&conn).map_err(|e| {
                        CallError::Unreachable(format!("peer {}: {e}", self.target))
                    })?)
                }
                None => None,
            };
        *guard = Some((conn.clone(), checked, hello.store));
        Ok((conn, hello.store))
    }

    /// Checks the peer's certificate on `conn` again if the TLS files changed or its
    /// `notAfter` passed since `checked` (or it was never checked here).
    fn recheck(
        &self,
        conn: &quinn::Connection,
        checked: &mut Option<Checked>,
    ) -> Result<(), String> {
        let Some(files) = &self.tls_files else {
            return Ok(());
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        match checked {
            Some((generation, not_after))
                if *generation == files.generation_now() && now <= *not_after =>
            {
                Ok(())
            }
            _ => {
                self.cert_checks.fetch_add(1, Ordering::Relaxed);
                *checked = Some(files.verify_dialed(conn)?);
                Ok(())
            }
        }
    }

    async fn call(&self, req: PeerRequest, ttl: Duration) -> Result<PeerResponse, CallError> {
        self.call_from(req, ttl).await.map(|(r, _)| r)
    }

    /// [`PeerClient::call`], and the store that answered.
    async fn call_from(
        &self,
        req: PeerRequest,
        ttl: Duration,
    ) -> Result<(PeerResponse, Option<StoreId>), CallError> {
        let fut = async {
            let (conn, store) = self.connection().await?;
            let (mut send, mut recv) = conn
                .open_bi()
                .await
                .map_err(|e| CallError::Unreachable(format!("stream to {}: {e}", self.target)))?;
            frame::write(&mut send, &req, PEER_FRAME_BYTES_MAX)
                .await
                .map_err(|e| CallError::Network(e.to_string()))?;
            let _ = send.finish();
            frame::read::<_, PeerResponse>(&mut recv, PEER_FRAME_BYTES_MAX)
                .await
                .map(|r| (r, store))
                .map_err(|e| CallError::Network(e.to_string()))
        };
        match tokio::time::timeout(ttl, fut).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Network(format!(
                "rpc to {} timed out",
                self.target
            ))),
        }
    }

    /// Whether an answer from `store` counts for the target, by its binding in this
    /// replica's effective membership ([`Binding::counts`]): if not, the reason, and the
    /// answer must be taken as none (openraft then counts neither the acknowledgement nor
    /// the vote). The store of a member not bound to it is recorded for the leader to
    /// bind ([`PeerNetworkFactory::seen_stores`]). Returns the binding it was counted by
    /// (`None`: not a member here).
    fn admit(&self, store: Option<StoreId>) -> Result<Option<Binding>, String> {
        let Some(raft) = self.raft.get() else {
            return Err("the replica's Raft handle is not set yet".into());
        };
        let (binding, membership_id) = {
            let m = raft.metrics();
            let m = m.borrow();
            let membership = &m.membership_config;
            (
                membership
                    .membership()
                    .get_node(&self.target)
                    .map(|m| m.store),
                *membership.log_id(),
            )
        };
        // Not a member in this replica's membership: openraft counts its answers nowhere.
        let Some(binding) = binding else {
            return Ok(None);
        };
        // Only for a member not bound yet: a bound one's answers (nearly all, on the
        // commit path) take no lock here.
        if let (Some(s), Binding::Unbound | Binding::Pending) = (store, binding) {
            self.seen
                .lock()
                .expect("seen stores")
                .insert(self.target, (s, membership_id));
        }
        if binding.counts(store) {
            return Ok(Some(binding));
        }
        let why = match (binding, store) {
            (Binding::Pending, _) => format!(
                "replica {} is not bound to a store yet (it answered from {}): its answers \
                 count once the leader binds it",
                self.target,
                store.map_or("no store".into(), |s| format!("store {s}"))
            ),
            (Binding::Bound(b), _) => format!(
                "replica {} answered from {}, and the cell binds it to store {b}: its data \
                 was lost; nothing it says counts until it is replaced (lockctl member \
                 remove, add-learner, promote)",
                self.target,
                store.map_or("no store".into(), |s| format!("store {s}"))
            ),
            (Binding::Unbound, _) => unreachable!("an unbound member's answers count"),
        };
        if self
            .warned
            .lock()
            .expect("warned")
            .insert((self.target, store))
        {
            if matches!(binding, Binding::Bound(_)) {
                tracing::error!(peer = self.target, "{why}");
            } else {
                tracing::info!(peer = self.target, "{why}");
            }
        }
        Err(why)
    }

    /// Asks the peer what it holds ([`PeerRequest::Probe`]) within `ttl`; with the store
    /// it answered from.
    pub async fn probe(&self, ttl: Duration) -> Result<(PeerState, Option<StoreId>), ProbeFailure> {
        match self.call_from(PeerRequest::Probe, ttl).await {
            Ok((PeerResponse::Probe(s), store)) => Ok((s, store)),
            Ok((PeerResponse::Refused(e), _)) => Err(ProbeFailure::Refused(e.to_string())),
            Ok(_) => Err(ProbeFailure::Refused(
                "answered the probe with something else".into(),
            )),
            Err(CallError::Unreachable(m) | CallError::Network(m)) => {
                Err(ProbeFailure::NoAnswer(m))
            }
        }
    }
}

/// Why a [`PeerClient::probe`] got no state back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeFailure {
    /// Not reached, or no answer in time (down, not started yet, partitioned).
    NoAnswer(String),
    /// Reached, and it refused (a build without the probe, a stopped Raft core): it is up
    /// and may hold a cell.
    Refused(String),
}

impl std::fmt::Display for ProbeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeFailure::NoAnswer(m) => write!(f, "no answer: {m}"),
            ProbeFailure::Refused(m) => write!(f, "refused: {m}"),
        }
    }
}

/// What this replica holds, for a peer's [`PeerRequest::Probe`].
async fn peer_state(raft: &Raft) -> Result<PeerState, wire::Error> {
    let initialized = raft
        .is_initialized()
        .await
        .map_err(|e| wire::Error::Unavailable {
            reason: format!("the Raft core stopped: {e}"),
        })?;
    let m = raft.metrics();
    let m = m.borrow();
    Ok(PeerState {
        initialized,
        term: m.current_term,
        last_log_index: m.last_log_index,
    })
}

fn rpc_err(e: CallError) -> RPCError<TypeConfig> {
    match e {
        CallError::Unreachable(m) => RPCError::Unreachable(Unreachable::new(&Failure(m))),
        CallError::Network(m) => RPCError::Network(NetworkError::new(&Failure(m))),
    }
}

fn unexpected(what: &str) -> RPCError<TypeConfig> {
    RPCError::Network(NetworkError::new(&Failure(format!(
        "unexpected peer response to {what}"
    ))))
}

/// A peer's Raft error (its core stopped: the only error its RPC handlers return). openraft
/// 0.10's `RaftNetworkV2` has no remote-error form for these RPCs (0.9 took a
/// `RemoteError` carrying it): the peer cannot take part now, so it is unreachable, and
/// openraft backs off as for a peer that is down.
fn remote_err(target: NodeId, e: RaftError<TypeConfig>) -> RPCError<TypeConfig> {
    RPCError::Unreachable(Unreachable::new(&Failure(format!("peer {target}: {e}"))))
}

/// A refusal (`PeerResponse::Refused`) as an RPC error.
fn refused(target: NodeId, e: wire::Error) -> RPCError<TypeConfig> {
    RPCError::Network(NetworkError::new(&Failure(format!(
        "peer {target} refused: {e}"
    ))))
}

/// About this many bytes of entries, at most, go in one AppendEntries RPC. openraft 0.9
/// sends up to `max_payload_entries` (300) entries at once and gives the RPC one
/// heartbeat interval (150 ms); a batch entry may hold about 1 MiB, so a follower that
/// fell behind could be sent 300 MiB, more than a peer frame may carry, and anything near
/// that never arrives within the interval: the same payload is retried for ever and the
/// follower never catches up (measured: a burst of 2 000 sessions a second stalled all
/// commits for 9 s). Sending a prefix and answering `PartialSuccess` keeps each RPC small.
const APPEND_BYTES_MAX: usize = 1 << 20;

/// How many of `entries` one AppendEntries carries: the longest prefix of at most
/// [`APPEND_BYTES_MAX`] bytes (estimated), and at least one entry.
fn append_prefix(entries: &[wire::raft::Entry]) -> usize {
    let mut bytes = 0;
    for (i, e) in entries.iter().enumerate() {
        bytes += 32
            + match &e.payload {
                openraft::EntryPayload::Normal(cmd) => cmd.approx_bytes(),
                openraft::EntryPayload::Membership(_) => 256,
                openraft::EntryPayload::Blank => 0,
            };
        if bytes > APPEND_BYTES_MAX && i > 0 {
            return i;
        }
    }
    entries.len()
}

impl RaftNetworkV2<TypeConfig> for PeerClient {
    type SnapshotData = SnapshotData;

    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        // A prefix only, if the whole is large: the follower's success then covers up to
        // the last entry sent, which openraft takes as `PartialSuccess` and goes on from
        // (0.10 still has it: its default `stream_append` ends the pipeline at a partial
        // success and the replication loop sends the rest in the next request).
        let n = append_prefix(&rpc.entries);
        let partial = if n < rpc.entries.len() {
            rpc.entries.truncate(n);
            rpc.entries.last().map(|e| e.log_id)
        } else {
            None
        };
        let (resp, store) = self
            .call_from(PeerRequest::AppendEntries(rpc), option.hard_ttl())
            .await
            .map_err(rpc_err)?;
        self.admit(store)
            .map_err(|m| rpc_err(CallError::Unreachable(m)))?;
        match resp {
            PeerResponse::AppendEntries(Ok(AppendEntriesResponse::Success))
                if partial.is_some() =>
            {
                Ok(AppendEntriesResponse::PartialSuccess(partial))
            }
            PeerResponse::AppendEntries(Ok(r)) => Ok(r),
            PeerResponse::AppendEntries(Err(e)) => Err(remote_err(self.target, e)),
            PeerResponse::Refused(e) => Err(refused(self.target, e)),
            _ => Err(unexpected("append_entries")),
        }
    }

    /// Sends a whole snapshot on one stream ([`PeerRequest::Snapshot`]): its head, then
    /// its bytes in pieces of openraft's `snapshot_max_chunk_size`, each due within the
    /// RPC's time to live (`install_snapshot_timeout`, as each chunk RPC of 0.9 was), then
    /// the answer within it again (the receiver decodes and installs the snapshot before
    /// it answers, as 0.9's last chunk did). So a snapshot of any size goes through as
    /// long as it keeps moving; a peer frame would have bounded it.
    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl std::future::Future<Output = ReplicationClosed> + openraft::OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let ttl = option.hard_ttl();
        let chunk = option
            .snapshot_chunk_size()
            .unwrap_or(4 << 20)
            .max(64 << 10);
        let send = self.send_snapshot(vote, snapshot, ttl, chunk);
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            r = send => r,
        }
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        match self
            .call(PeerRequest::TransferLeader(req), option.hard_ttl())
            .await
            .map_err(rpc_err)?
        {
            PeerResponse::TransferLeader(Ok(r)) => Ok(r),
            PeerResponse::TransferLeader(Err(e)) => Err(remote_err(self.target, e)),
            PeerResponse::Refused(e) => Err(refused(self.target, e)),
            _ => Err(unexpected("transfer_leader")),
        }
    }

    /// 500 ms between tries to a peer that cannot be reached: openraft 0.9's default
    /// (0.10's doubles from 200 ms to 1 s). 0.10 also backs off after about ten failed
    /// RPCs in a row of other kinds (timeouts), which 0.9 retried at each heartbeat.
    fn backoff(&self) -> Option<openraft::network::Backoff> {
        Some(openraft::network::Backoff::new(std::iter::repeat(
            Duration::from_millis(500),
        )))
    }

    // `pre_vote` is left to openraft's default (granted without asking): 0.9 had no
    // pre-vote, and `raft_config` keeps it off (`enable_pre_vote: Some(false)`).

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let (vote, last_log_id) = (rpc.vote, rpc.last_log_id);
        let (resp, store) = self
            .call_from(PeerRequest::Vote(rpc), option.hard_ttl())
            .await
            .map_err(rpc_err)?;
        let binding = self
            .admit(store)
            .map_err(|m| rpc_err(CallError::Unreachable(m)))?;
        match resp {
            // Only a cell seeded from a backup has unbound members (a new cell's are bound
            // or pending from its first entry), and each of them holds the seeded snapshot
            // at least: an empty one may be a replica whose data was lost, and to a
            // candidate whose log is older than the cell's first binding, it looks unbound
            // still. Its vote does not count (docs/architecture.md, "A replica whose data
            // was lost").
            PeerResponse::Vote(Ok(r))
                if binding == Some(Binding::Unbound) && r.last_log_id.is_none() =>
            {
                Err(rpc_err(CallError::Unreachable(format!(
                    "replica {} is unbound here and holds nothing: its vote does not count",
                    self.target
                ))))
            }
            PeerResponse::Vote(Ok(r)) => {
                // Once per term: two voters refusing alike would otherwise have it stand
                // in the next term and at once in the one after.
                let term = vote.leader_id.term;
                if stand_again(&vote, last_log_id.as_ref(), self.target, &r)
                    && self.stood_again.fetch_max(term, Ordering::Relaxed) < term
                {
                    if let Some(raft) = self.raft.get() {
                        if crate::raft::binding::may_stand(raft, self.self_id, self.store) {
                            stand_now(raft, vote, self.target, &r).await;
                        }
                    }
                }
                Ok(r)
            }
            PeerResponse::Vote(Err(e)) => Err(remote_err(self.target, e)),
            PeerResponse::Refused(e) => Err(refused(self.target, e)),
            _ => Err(unexpected("vote")),
        }
    }
}

impl PeerClient {
    /// [`RaftNetworkV2::full_snapshot`] without its cancellation.
    async fn send_snapshot(
        &self,
        vote: Vote,
        snapshot: Snapshot,
        ttl: Duration,
        chunk: usize,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let stream_err = |e: CallError| -> StreamingError<TypeConfig> {
            match e {
                CallError::Unreachable(m) => {
                    StreamingError::Unreachable(Unreachable::new(&Failure(m)))
                }
                CallError::Network(m) => StreamingError::Network(NetworkError::new(&Failure(m))),
            }
        };
        let net = |m: String| stream_err(CallError::Network(m));
        let timed_out = |what: &str| net(format!("snapshot to {}: {what} timed out", self.target));
        let (conn, store) = tokio::time::timeout(ttl, self.connection())
            .await
            .map_err(|_| timed_out("connecting"))?
            .map_err(stream_err)?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| {
            stream_err(CallError::Unreachable(format!(
                "stream to {}: {e}",
                self.target
            )))
        })?;
        let data = snapshot.snapshot.data.into_inner();
        let offer = SnapshotOffer {
            vote,
            meta: snapshot.meta,
            id: snapshot.snapshot.id,
            bytes: data.len() as u64,
        };
        tokio::time::timeout(
            ttl,
            frame::write(
                &mut send,
                &PeerRequest::Snapshot(offer),
                PEER_FRAME_BYTES_MAX,
            ),
        )
        .await
        .map_err(|_| timed_out("head"))?
        .map_err(|e| net(e.to_string()))?;
        for piece in data.chunks(chunk) {
            tokio::time::timeout(ttl, send.write_all(piece))
                .await
                .map_err(|_| timed_out("data"))?
                .map_err(|e| net(e.to_string()))?;
        }
        let _ = send.finish();
        drop(data);
        let resp = tokio::time::timeout(
            ttl,
            frame::read::<_, PeerResponse>(&mut recv, PEER_FRAME_BYTES_MAX),
        )
        .await
        .map_err(|_| timed_out("answer"))?
        .map_err(|e| net(e.to_string()))?;
        self.admit(store)
            .map_err(|m| stream_err(CallError::Unreachable(m)))?;
        match resp {
            PeerResponse::Snapshot(Ok(r)) => Ok(r),
            PeerResponse::Snapshot(Err(e)) => Err(stream_err(CallError::Unreachable(format!(
                "peer {}: {e}",
                self.target
            )))),
            PeerResponse::Refused(e) => Err(net(format!("peer {} refused: {e}", self.target))),
            _ => Err(net("unexpected peer response to a snapshot".into())),
        }
    }
}

/// Whether a candidate whose vote request (`vote`, its log ending at `last_log_id`) got
/// `resp` from `voter` should stand again at once, in the next term, rather than after
/// an election timeout: the voter refused because it stood itself in the same term (its
/// vote is its own, uncommitted: two followers stood together), and its log is shorter
/// than the candidate's, so it can never have this candidate's vote (a longer log
/// refuses it). openraft 0.9 orders the candidacies of one term by node
/// id, so when the follower with the higher id and the shorter log stands first or in
/// the same tick, the one with the longer log lost the term and waited a whole election
/// timeout (0.5-1 s) for the next (docs/benchmarks.md, "failover at 14f868b, traced at
/// the server"). In the next term the voter, holding an uncommitted vote, has no leader
/// lease to keep and grants the longer log. The same when the voter stood in a later
/// term than this candidacy's (a follower with a shorter log and a shorter timer stood
/// term after term while the longer log's lease kept it out, and the longer log stood
/// only when it refused it, [`stand_first`]): openraft takes the voter's uncommitted
/// vote from the refusal, and this replica stands in the term after it. Never when the
/// voter's vote is committed (a leader was elected in that term) or of an earlier term,
/// as the response shows it. Only liveness is at stake: an election started anew is one
/// more round trip at worst; in a cell of five or more, a voter that won the term with
/// the others' votes after it answered can be deposed by the longer log's next term (one
/// more leader change).
pub fn stand_again(
    vote: &Vote,
    last_log_id: Option<&wire::raft::LogId>,
    voter: NodeId,
    resp: &VoteResponse<TypeConfig>,
) -> bool {
    !resp.vote_granted
        && !vote.is_committed()
        && !resp.vote.is_committed()
        && resp.vote.leader_id.term >= vote.leader_id.term
        && resp.vote.leader_id.node_id == voter
        && resp.last_log_id.as_ref() < last_log_id
}

/// Stands again in the next term, if this replica still holds `vote` (still the
/// candidate the refusal answered). If the voter stood in a later term, once openraft
/// has taken the voter's vote from this refusal (the refusal is handed back to it only
/// after this returns, so that is waited for beside it, for at most 200 ms): a term
/// above the voter's.
async fn stand_now(raft: &Raft, vote: Vote, voter: NodeId, resp: &VoteResponse<TypeConfig>) {
    if resp.vote.leader_id.term > vote.leader_id.term {
        let (raft, theirs) = (raft.clone(), resp.vote);
        wire::rt::spawn(async move {
            for _ in 0..40 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                match raft.with_raft_state(move |st| *st.vote_ref()).await {
                    Ok(now) if now == theirs => {
                        tracing::info!(
                            term = vote.leader_id.term,
                            voter,
                            voter_vote = %theirs,
                            "refused by a shorter log's later candidacy: standing again at \
                             once above it"
                        );
                        // No pre-vote round (0.9 had none): the point is to stand at once.
                        if let Err(e) = raft.trigger().elect(false).await {
                            tracing::warn!("standing again: {e}");
                        }
                        return;
                    }
                    Ok(now) if now == vote => continue,
                    _ => return,
                }
            }
        });
        return;
    }
    let still = raft
        .with_raft_state(move |st| *st.vote_ref() == vote)
        .await
        .unwrap_or(false);
    if !still {
        return;
    }
    tracing::info!(
        term = vote.leader_id.term,
        voter,
        voter_vote = %resp.vote,
        "split vote with a shorter log: standing again at once in the next term"
    );
    // No pre-vote round (0.9 had none): the point is to stand at once.
    if let Err(e) = raft.trigger().elect(false).await {
        tracing::warn!("standing again: {e}");
    }
}

/// Whether a voter that answered a vote request (`vote`, the candidate's log ending at
/// `last_log_id`) with `resp` should stand itself at once, if its leader has been silent
/// past its lease ([`stand_if_leader_silent`] checks that): it refused the candidate for
/// its shorter log (its own log, in `resp`, is longer), it follows a leader of an older
/// term than the candidate's (its vote is committed, and not its own), and that leader,
/// by the candidate's standing, is silent to the candidate too. The traced slow
/// fail-overs after the fix of [`stand_again`]: the follower with the shorter log stood
/// first, the one with the longer log refused it and stood only on its own timer, 0.2
/// to 0.45 s later (docs/benchmarks.md, "failover at 14f868b, traced at the server").
/// Standing at once is what that timer would do a little later: the longer log stands
/// in the next term of its own, the shorter log (which stood in that term too) refuses
/// it by its own vote, and [`stand_again`] has the longer log stand once more, which the
/// shorter log grants. Liveness only: when a replica stands is not what keeps two
/// leaders out of one term, and a leader that still reaches this voter within its lease
/// is never disrupted (openraft refused the candidate by that lease, and
/// [`stand_if_leader_silent`] then does nothing).
pub fn stand_first(
    vote: &Vote,
    last_log_id: Option<&wire::raft::LogId>,
    self_id: NodeId,
    resp: &VoteResponse<TypeConfig>,
) -> bool {
    !resp.vote_granted
        && resp.vote.is_committed()
        && resp.vote.leader_id.node_id != self_id
        && resp.vote.leader_id.term < vote.leader_id.term
        && last_log_id < resp.last_log_id.as_ref()
}

/// Stands in the next term if this replica still holds `followed` (the committed vote
/// for the leader it followed when it refused `candidate`) and that leader has not been
/// heard for longer than its lease (openraft's `election_timeout_max`).
async fn stand_if_leader_silent(raft: &Raft, followed: Vote, candidate: Vote) {
    let lease = Duration::from_millis(raft.config().election_timeout_max);
    let silent = raft
        .with_raft_state(move |st| {
            use openraft::Instant as _;
            *st.vote_ref() == followed
                && st
                    .vote_last_modified()
                    .is_none_or(|heard| heard.elapsed() > lease)
        })
        .await
        .unwrap_or(false);
    if !silent {
        return;
    }
    tracing::info!(
        term = followed.leader_id.term,
        candidate = %candidate,
        "refused a shorter log while the leader is silent past its lease: standing at once"
    );
    // No pre-vote round (0.9 had none): the point is to stand at once.
    if let Err(e) = raft.trigger().elect(false).await {
        tracing::warn!("standing at once: {e}");
    }
}

/// The largest snapshot a follower accepts, in bytes (a [`PeerRequest::Snapshot`] whose
/// head announces more is refused before anything is allocated for it, and its bytes are
/// read into a buffer grown as they arrive, never past what the head announced): a
/// crafted head announcing a terabyte would otherwise have the follower allocate it. Four
/// times the design's 1 GB of state would be generous; two is what a snapshot of 1 GB
/// (the state's upper bound) needs with room.
pub const SNAPSHOT_BYTES_MAX: u64 = 2 * 1024 * 1024 * 1024;

/// Bytes of a received snapshot read at a time, each piece due within
/// [`frame::FRAME_DEADLINE_MS`] (a sender that stops sending is dropped).
const SNAPSHOT_READ_BYTES: usize = 1 << 20;

/// Reads the `bytes` bytes of a snapshot that follow its head on `recv`, and no more.
async fn read_snapshot_bytes<R: tokio::io::AsyncRead + Unpin>(
    recv: &mut R,
    bytes: u64,
) -> Result<Vec<u8>, String> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let deadline = Duration::from_millis(frame::FRAME_DEADLINE_MS);
    while (buf.len() as u64) < bytes {
        let at = buf.len();
        let n = ((bytes - at as u64) as usize).min(SNAPSHOT_READ_BYTES);
        buf.resize(at + n, 0);
        match tokio::time::timeout(deadline, recv.read_exact(&mut buf[at..])).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("reading a snapshot: {e}")),
            Err(_) => return Err("reading a snapshot: no data in time".into()),
        }
    }
    Ok(buf)
}

/// Receives and installs one snapshot ([`PeerRequest::Snapshot`]), whose head was read.
async fn install_snapshot(
    raft: &Raft,
    recv: &mut quinn::RecvStream,
    offer: SnapshotOffer,
) -> Result<PeerResponse, wire::Error> {
    if offer.bytes > SNAPSHOT_BYTES_MAX {
        return Err(wire::Error::LimitExceeded {
            bound: wire::Bound::SnapshotBytes,
            limit: SNAPSHOT_BYTES_MAX,
        });
    }
    // Only a leader sends a snapshot, with its committed vote (openraft asserts it).
    if !offer.vote.is_committed() {
        return Err(wire::Error::Malformed {
            reason: "a snapshot sent without a leader's committed vote".into(),
        });
    }
    // openraft 0.10 panics (its core stops) on a snapshot whose last log id is of a later
    // leadership than the vote it comes with: no correct leader sends one, so it is
    // refused here instead.
    if offer
        .meta
        .last_log_id
        .is_some_and(|l| l.leader_id > offer.vote.leader_id)
    {
        return Err(wire::Error::Malformed {
            reason: "a snapshot beyond its sender's leadership".into(),
        });
    }
    let data = read_snapshot_bytes(recv, offer.bytes)
        .await
        .map_err(|reason| wire::Error::Connection { reason })?;
    // Likewise for a snapshot above the committed log id but not at a higher index (it
    // contradicts entries committed here; openraft asserts it never happens). Checked once
    // the bytes are in, as close to the install as it can be: the committed id grows
    // while they arrive.
    let committed = raft
        .with_raft_state(|s| s.local_committed().cloned())
        .await
        .map_err(|e| wire::Error::Unavailable {
            reason: e.to_string(),
        })?;
    if let (Some(last), Some(c)) = (&offer.meta.last_log_id, &committed) {
        if last > c && last.index <= c.index {
            return Err(wire::Error::Malformed {
                reason: format!("a snapshot at {last} contradicts the entry committed here at {c}"),
            });
        }
    }
    let snapshot = Snapshot {
        meta: offer.meta,
        snapshot: SnapshotData {
            id: offer.id,
            data: std::io::Cursor::new(data),
        },
    };
    Ok(PeerResponse::Snapshot(
        raft.install_full_snapshot(offer.vote, snapshot)
            .await
            .map_err(RaftError::Fatal),
    ))
}

/// Serves one accepted peer connection: the hello, then one RPC per stream, each read
/// within the bounds of `wire::frame::read_request` against the connection's `budget`.
///
/// `stood_first` is the highest candidate's term this replica stood at once for
/// ([`stand_first`]), shared by every peer connection of the replica: once per term;
/// `snapshots` is held while a snapshot is received and installed (one at a time in the
/// replica).
pub async fn serve_peer(
    conn: quinn::Connection,
    raft: Raft,
    self_id: NodeId,
    store: StoreId,
    stood_first: Arc<AtomicU64>,
    snapshots: Arc<Mutex<()>>,
    budget: frame::Budget,
) {
    // Hello first.
    let Some((mut send, hello)) = wire::quic::accept_hello(&conn).await else {
        return;
    };
    let reply: HelloReply = match hello {
        Ok(h) => h.check().map(|_| wire::hello::HelloOk {
            protocol_version: wire::PROTOCOL_VERSION,
            replica_id: self_id,
            proxy: false,
            store: Some(store),
        }),
        Err(e) => Err(e),
    };
    let ok = reply.is_ok();
    let _ = frame::write(&mut send, &reply, frame::HELLO_BYTES_MAX).await;
    let _ = send.finish();
    if !ok {
        conn.close(1u32.into(), b"bad hello");
        return;
    }
    let exceeded = Arc::new(wire::quic::ExceededLog::default());
    loop {
        let (mut send, mut recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(_) => return,
        };
        let (raft, budget, exceeded, snapshots) = (
            raft.clone(),
            budget.clone(),
            exceeded.clone(),
            snapshots.clone(),
        );
        let stood_first = stood_first.clone();
        let remote = conn.remote_address();
        wire::rt::spawn(async move {
            let read =
                frame::read_request::<_, PeerRequest>(&mut recv, PEER_FRAME_BYTES_MAX, &budget);
            let (resp, _reserved) = match read.await {
                Ok((PeerRequest::AppendEntries(r), held)) => (
                    PeerResponse::AppendEntries(raft.append_entries(r).await),
                    Some(held),
                ),
                Ok((PeerRequest::Vote(r), held)) => {
                    let (vote, last_log_id) = (r.vote, r.last_log_id);
                    let resp = raft.vote(r).await;
                    if let Ok(resp) = &resp {
                        let term = vote.leader_id.term;
                        if stand_first(&vote, last_log_id.as_ref(), self_id, resp)
                            && crate::raft::binding::may_stand(&raft, self_id, store)
                            && stood_first.fetch_max(term, Ordering::Relaxed) < term
                        {
                            // Answered first; the check and the candidacy go on beside it.
                            let (raft, their_vote) = (raft.clone(), resp.vote);
                            wire::rt::spawn(async move {
                                stand_if_leader_silent(&raft, their_vote, vote).await;
                            });
                        }
                    }
                    (PeerResponse::Vote(resp), Some(held))
                }
                Ok((PeerRequest::Probe, held)) => (
                    match peer_state(&raft).await {
                        Ok(s) => PeerResponse::Probe(s),
                        Err(e) => PeerResponse::Refused(e),
                    },
                    Some(held),
                ),
                // A replica the cell binds to another store never stands
                // (`binding::guard_candidacy`): handed the leadership, it says no.
                Ok((PeerRequest::TransferLeader(r), held))
                    if *r.to_node_id() == self_id
                        && !crate::raft::binding::may_stand(&raft, self_id, store) =>
                {
                    (
                        PeerResponse::Refused(wire::Error::Unavailable {
                            reason: format!(
                                "replica {self_id}: the cell binds it to another store \
                                 than its own (its data was lost); it does not stand"
                            ),
                        }),
                        Some(held),
                    )
                }
                Ok((PeerRequest::TransferLeader(r), held)) => (
                    PeerResponse::TransferLeader(
                        raft.handle_transfer_leader(r)
                            .await
                            .map_err(RaftError::Fatal),
                    ),
                    Some(held),
                ),
                Ok((PeerRequest::Snapshot(offer), held)) => {
                    // One snapshot at a time in the replica (a sender that timed out and
                    // sent again on a new connection waits here): its bytes are held
                    // outside the connection's budget (bounded by SNAPSHOT_BYTES_MAX).
                    let _one = snapshots.lock().await;
                    match install_snapshot(&raft, &mut recv, offer).await {
                        Ok(resp) => (resp, Some(held)),
                        Err(e) => {
                            if matches!(e, wire::Error::LimitExceeded { .. }) {
                                exceeded.record(remote, &e);
                            }
                            let _ = recv.stop(5u32.into());
                            (PeerResponse::Refused(e), None)
                        }
                    }
                }
                Ok((PeerRequest::InstallSnapshot, held)) => (
                    PeerResponse::Refused(wire::Error::Malformed {
                        reason: "InstallSnapshot chunks are no longer taken (protocol 10)".into(),
                    }),
                    Some(held),
                ),
                Err(e) => {
                    exceeded.record(remote, &e);
                    (PeerResponse::Refused(e), None)
                }
            };
            let deadline = Duration::from_millis(frame::FRAME_DEADLINE_MS);
            match tokio::time::timeout(
                deadline,
                frame::write(&mut send, &resp, PEER_FRAME_BYTES_MAX),
            )
            .await
            {
                Ok(_) => {
                    let _ = send.finish();
                }
                Err(_) => {
                    let _ = send.reset(4u32.into());
                }
            }
        });
    }
}

/// A peer's address as a socket address: `ip:port` as it is, or `host:port` resolved now
/// (on every dial, so a replica that came back at another IP under the same name, as a
/// Kubernetes StatefulSet's pods do, is found), taking the first address of the
/// endpoint's own family.
async fn resolve_peer(addr: &str, endpoint: &quinn::Endpoint) -> Result<SocketAddr, CallError> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    let v6 = endpoint.local_addr().is_ok_and(|l| l.is_ipv6());
    let found = tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(addr))
        .await
        .map_err(|_| CallError::Unreachable(format!("resolve peer address {addr}: timed out")))?
        .map_err(|e| CallError::Unreachable(format!("resolve peer address {addr}: {e}")))?
        .find(|a| a.is_ipv6() == v6);
    found.ok_or_else(|| {
        CallError::Unreachable(format!(
            "peer address {addr} resolves to no IPv{} address",
            if v6 { 6 } else { 4 }
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::raft::{LeaderId, LogId};

    fn log(index: u64) -> Option<LogId> {
        Some(LogId::new(
            LeaderId {
                term: 1,
                node_id: 1,
            },
            index,
        ))
    }

    fn resp(vote: Vote, granted: bool, last: Option<LogId>) -> VoteResponse<TypeConfig> {
        VoteResponse::new(vote, last, granted)
    }

    /// A snapshot's bytes are read to the length its head announced, across pieces and
    /// past a peer frame's size, and nothing after them.
    #[tokio::test]
    async fn a_snapshot_is_read_to_its_announced_length_past_a_frames_size() {
        let len = PEER_FRAME_BYTES_MAX + 3 * SNAPSHOT_READ_BYTES + 123;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let (mut tx, mut rx) = tokio::io::duplex(1 << 16);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            tx.write_all(&sent).await.unwrap();
            tx.write_all(b"after").await.unwrap();
            tx
        });
        let got = read_snapshot_bytes(&mut rx, len as u64).await.unwrap();
        assert!(got == data, "the snapshot came back changed");
        let _tx = writer.await.unwrap();
        let mut after = [0u8; 5];
        tokio::io::AsyncReadExt::read_exact(&mut rx, &mut after)
            .await
            .unwrap();
        assert_eq!(&after, b"after");
        // A sender that stops short is an error, not a short snapshot.
        let (mut tx, mut rx) = tokio::io::duplex(1 << 16);
        tokio::io::AsyncWriteExt::write_all(&mut tx, &[1; 10])
            .await
            .unwrap();
        drop(tx);
        assert!(read_snapshot_bytes(&mut rx, 11).await.is_err());
    }

    /// The traced case: replica 2 (log to 2 632) stood in term 2 together with replica 3
    /// (log to 2 631), which refused it by its own vote `T2-N3`.
    #[test]
    fn a_split_vote_against_a_shorter_log_stands_again_at_once() {
        let mine = Vote::new(2, 2);
        let r = resp(Vote::new(2, 3), false, log(2631));
        assert!(stand_again(&mine, log(2632).as_ref(), 3, &r));
        // Equal logs: the voter's candidacy can win with this one's vote; leave it.
        assert!(!stand_again(&mine, log(2631).as_ref(), 3, &r));
        // The voter stood in a later term (its shorter timer, while this one's lease kept
        // it out): stand above it.
        let later = resp(Vote::new(6, 3), false, log(2631));
        assert!(stand_again(&mine, log(2632).as_ref(), 3, &later));
        assert!(!stand_again(&mine, log(2631).as_ref(), 3, &later));
        // A longer log at the voter: it is the one to win.
        let r = resp(Vote::new(2, 3), false, log(2700));
        assert!(!stand_again(&mine, log(2632).as_ref(), 3, &r));
    }

    /// The remaining traced case: replica 3 (log to 2 631) stood in term 3 while replica 2
    /// (log to 2 632) still followed the dead leader 1 of term 2 and refused it by its log.
    #[test]
    fn a_follower_refusing_a_shorter_log_stands_first() {
        let candidate = Vote::new(3, 3);
        let followed = Vote::new_committed(2, 1);
        let r = resp(followed, false, log(2632));
        assert!(stand_first(&candidate, log(2631).as_ref(), 2, &r));
        // An empty candidate log is shorter than any.
        assert!(stand_first(&candidate, None, 2, &r));
    }

    #[test]
    fn nothing_else_makes_a_follower_stand_first() {
        let candidate = Vote::new(3, 3);
        let shorter = log(2631);
        for (why, r) in [
            // Granted: the candidate is as long or longer.
            ("granted", resp(Vote::new(3, 3), true, log(2631))),
            // Equal logs: a refusal can only be the lease's, or the term's.
            ("equal", resp(Vote::new_committed(2, 1), false, log(2631))),
            // A candidacy of its own, or a vote for another candidate: no leader to wait for.
            ("own", resp(Vote::new(3, 2), false, log(2632))),
            ("another's", resp(Vote::new(2, 4), false, log(2632))),
            // It leads itself.
            ("leader", resp(Vote::new_committed(2, 2), false, log(2632))),
            // It follows a leader of the candidate's term or a later one.
            (
                "same term",
                resp(Vote::new_committed(3, 4), false, log(2632)),
            ),
            (
                "later term",
                resp(Vote::new_committed(4, 4), false, log(2632)),
            ),
        ] {
            assert!(!stand_first(&candidate, shorter.as_ref(), 2, &r), "{why}");
        }
    }

    #[test]
    fn nothing_else_makes_it_stand_again() {
        let mine = Vote::new(2, 2);
        let last = log(2632);
        for (why, from, r) in [
            ("granted", 3, resp(Vote::new(2, 2), true, log(2631))),
            // A leader was elected in this term: never disrupt it.
            (
                "leader",
                3,
                resp(Vote::new_committed(2, 3), false, log(2631)),
            ),
            // The voter follows a leader of the term before (refused by its lease).
            (
                "lease",
                3,
                resp(Vote::new_committed(1, 1), false, log(2631)),
            ),
            // A leader of a later term: the cell has moved on.
            (
                "later leader",
                3,
                resp(Vote::new_committed(3, 3), false, log(2631)),
            ),
            // An earlier term's candidacy of the voter's (a delayed answer).
            ("earlier term", 3, resp(Vote::new(1, 3), false, log(2631))),
            // It voted for a third replica, whose log this one does not know.
            ("another's vote", 3, resp(Vote::new(2, 4), false, log(2631))),
        ] {
            assert!(!stand_again(&mine, last.as_ref(), from, &r), "{why}");
        }
        // An empty voter that voted for itself: None is below any log, so it stands
        // again only against a log that has entries.
        let empty = resp(Vote::new(2, 3), false, None);
        assert!(stand_again(&mine, last.as_ref(), 3, &empty));
        assert!(!stand_again(&mine, None, 3, &empty));
    }
}
