//! The client side: a QUIC listener speaking exactly the replicas' client protocol.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, ClientConfig};
use tokio::sync::Semaphore;
use wire::hello::{HelloOk, HelloReply, ALPN_CLIENT};
use wire::quic::Sockets;
use wire::types::{IdRanges, Op, ProxyStatus, Reply, Request, Response, SessionId};
use wire::{frame, path, Error, CLIENT_FRAME_BYTES_MAX};

use crate::config::ProxyConfig;
use crate::hub::Hub;
use crate::upstream::Upstream;

/// A running proxy.
pub struct Proxy {
    /// The cell this proxy serves (from its certificate's identity).
    pub(crate) cell: String,
    pub(crate) cfg: ProxyConfig,
    pub(crate) up: Arc<Upstream>,
    pub(crate) hub: Arc<Hub>,
    /// How long client requests took here, by kind, for [`ProxyStatus`].
    latency: wire::latency::Recorder,
    /// The TLS files, re-read when they change; closes client connections whose
    /// certificate expires or is revoked.
    tls_files: Arc<wire::tls::Reloading>,
    /// Connections and requests in flight per client identity.
    quotas: Arc<wire::quota::Quotas>,
}

/// Runs a proxy until `shutdown` completes.
pub async fn run(cfg: ProxyConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    run_on(cfg, Sockets::Os, shutdown).await
}

/// [`run`] with both its endpoints (the listener and the upstream client) on `sockets`:
/// the fault suite's simulation runs proxies on simulated ones.
pub async fn run_on(
    cfg: ProxyConfig,
    sockets: Sockets,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    cfg.validate()?;
    // Mutual TLS: the certificate must be a proxy's; its cell is the one this proxy
    // serves, and it is also what the proxy presents to the cell's replicas.
    let (tls, me, tls_files) = wire::tls::server_config_reloading(&cfg.tls, &[ALPN_CLIENT])
        .map_err(|e| anyhow::anyhow!("the proxy's TLS files: {e}"))?;
    let cell = match &me {
        wire::identity::Identity::Proxy { cell, .. } => cell.clone(),
        other => anyhow::bail!(
            "the certificate in {} is {other}, a {}'s; a proxy needs one for \
             lock://<cell>/proxy/<name> (lockctl certs issue --role proxy)",
            cfg.tls.cert.display(),
            other.role()
        ),
    };
    // Stateless resets that survive a restart (see `wire::quic::StableReset`): a
    // restarted proxy's clients learn at once that their old connection is gone.
    let reset =
        wire::quic::StableReset::from_key_file(&cfg.tls.key, &format!("proxy at {}", cfg.listen))
            .map_err(anyhow::Error::msg)?;
    let endpoint = wire::quic::server_endpoint_on(&sockets, cfg.listen, tls, None, Some(reset))
        .map_err(anyhow::Error::msg)?;
    let mut ccfg = ClientConfig::new(cfg.replicas.clone(), cfg.tls.ca.clone());
    ccfg.cert = cfg.tls.cert.clone();
    ccfg.key = cfg.tls.key.clone();
    // The replicas' certificates are checked against the proxy's revocation lists too,
    // and must be of the proxy's own cell (cells may share a CA).
    ccfg.crls = cfg.tls.crls.clone();
    ccfg.cell = Some(cell.clone());
    // A replica's refusal of a client's request by its identity's limit goes back to
    // that client (who retries), rather than being retried here for the forward
    // timeout while the client's places are held.
    ccfg.retry_limit_refusals = false;
    ccfg.sockets = sockets;
    ccfg.agent = format!("proxy {} at {}", env!("CARGO_PKG_VERSION"), cfg.listen);
    ccfg.attempt_timeout = Duration::from_millis(cfg.forward_timeout_ms);
    let client = Client::connect(ccfg)
        .await
        .map_err(|e| anyhow::anyhow!("upstream client: {e}"))?;
    let hub = Arc::new(Hub::new());
    let up = Arc::new(Upstream::new(
        client,
        hub.clone(),
        Duration::from_millis(cfg.keepalive_interval_ms),
        Duration::from_millis(cfg.forward_timeout_ms),
    ));
    tracing::info!(identity = %me, "proxy's certificate checked");
    let proxy = Arc::new(Proxy {
        cell,
        cfg: cfg.clone(),
        up: up.clone(),
        hub,
        latency: Default::default(),
        tls_files,
        quotas: wire::quota::Quotas::new(cfg.per_identity.clone()),
    });
    let mut tasks = vec![
        wire::rt::spawn(up.clone().batch_loop()),
        wire::rt::spawn(up.clone().tick_loop()),
        wire::rt::spawn(up.clone().stream_loop()),
        wire::rt::spawn(up.clone().silence_loop()),
        wire::rt::spawn(serve(endpoint.clone(), proxy.clone())),
        wire::rt::spawn(stats_loop(proxy.clone())),
    ];
    if let Some(addr) = cfg.metrics.listen {
        let listener = wire::metrics::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("the proxy: {e}"))?;
        tracing::info!(%addr, "metrics, /health and /ready served");
        tasks.push(wire::rt::spawn(wire::metrics::serve(
            listener,
            Arc::new(crate::metrics::ProxyProbe(proxy.clone())),
        )));
    }
    tracing::info!(listen = %cfg.listen, replicas = ?cfg.replicas, "proxy serving");
    shutdown.await;
    tracing::info!("proxy shutting down");
    endpoint.close(0u32.into(), b"proxy shutting down");
    for t in tasks {
        t.abort();
    }
    endpoint.wait_idle().await;
    Ok(())
}

/// Runs a proxy on its own runtime until SIGINT or SIGTERM.
pub fn run_until_signal(cfg: ProxyConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move { run(cfg, wire::rt::shutdown_signal()).await })
}

async fn stats_loop(p: Arc<Proxy>) {
    if p.cfg.stats_interval_ms == 0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(p.cfg.stats_interval_ms));
    tick.tick().await;
    loop {
        tick.tick().await;
        let s = p.status();
        tracing::info!(
            clients = s.clients,
            sessions = s.sessions,
            keepalive_batches = s.keepalive_batches,
            keepalives_batched = s.keepalives_batched,
            cache_hits = s.cache_hits,
            upstream_reads = s.upstream_reads,
            invalidations_relayed = s.invalidations_relayed,
            upstream_watches = s.upstream_watches,
            "proxy counters"
        );
    }
}

/// Accepts connections until the endpoint is closed; one beyond `connections_max` in
/// all or `connections_per_source_max` from its address is refused before its handshake.
async fn serve(endpoint: quinn::Endpoint, p: Arc<Proxy>) {
    let gate = wire::quic::ConnectionGate::new(wire::quic::ConnectionLimits {
        connections_max: p.cfg.connections_max,
        connections_per_source_max: p.cfg.connections_per_source_max,
    });
    while let Some(incoming) = endpoint.accept().await {
        let Some(admitted) = gate.admit(incoming.remote_address()) else {
            incoming.refuse();
            continue;
        };
        let p = p.clone();
        wire::rt::spawn(async move {
            let _admitted = admitted;
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!("handshake failed: {e}");
                    return;
                }
            };
            // Clients only, checked before the first frame.
            let listener = wire::identity::Listener::Proxy { cell: &p.cell };
            let Ok(who) = wire::identity::check_accepted(&conn, listener, false) else {
                return;
            };
            p.tls_files.guard(conn.clone());
            wire::quic::grant_streams(&conn);
            let bytes_max = p.cfg.client_connection_bytes_max;
            wire::serve::serve(conn, who, p, bytes_max).await;
        });
    }
}

/// Counts a connection until it closes (held by its loop, not by its requests), with its
/// place in its identity's quota (given back when this is dropped).
pub struct Connected(Arc<Hub>, #[allow(dead_code)] Option<wire::quota::Place>);

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.counters.clients.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the proxy keeps for one client connection, shared with its requests.
pub struct ClientConnection {
    /// Its requests in flight here, at most `max_inflight_per_client` (KeepAlives,
    /// acknowledgements and event streams are not counted).
    inflight: Arc<Semaphore>,
}

/// The proxy's client protocol: `wire::serve`'s loop (shared with the replicas) around
/// [`Proxy::handle`], with the proxy's own limits: clients at once (at the hello) and
/// requests in flight per client.
impl wire::serve::Handler for Proxy {
    type Connection = ClientConnection;
    type Held = Connected;

    fn hello(
        &self,
        caller: &wire::serve::Caller,
        hello: Result<wire::hello::Hello, Error>,
    ) -> (ClientConnection, Connected, HelloReply) {
        let count = self.hub.counters.clients.fetch_add(1, Ordering::Relaxed) + 1;
        let identity = caller.identity.as_deref().unwrap_or_default();
        let (place, hello) = match self.quotas.connect(identity) {
            Ok(p) => (Some(p), hello),
            Err(e) => (None, Err(e)),
        };
        let connected = Connected(self.hub.clone(), place);
        let state = ClientConnection {
            inflight: Arc::new(Semaphore::new(self.cfg.max_inflight_per_client)),
        };
        let reply: HelloReply = match hello {
            Ok(_) if count as usize > self.cfg.max_clients => Err(Error::Unavailable {
                reason: format!(
                    "proxy {} is at its limit of {} clients",
                    self.cfg.listen, self.cfg.max_clients
                ),
            }),
            Ok(h) => h.check().map(|_| HelloOk {
                protocol_version: wire::PROTOCOL_VERSION,
                replica_id: 0,
                proxy: true,
                store: None,
            }),
            Err(e) => Err(e),
        };
        (state, connected, reply)
    }

    async fn request(
        &self,
        connection: &ClientConnection,
        caller: &wire::serve::Caller,
        req: Request,
        received: Instant,
    ) -> Response {
        // The client's identity, as its certificate proved it (`check_accepted` admitted
        // clients only).
        let Some(me) = caller.identity.as_deref() else {
            return Err(Error::BadRequest {
                reason: "this connection has no identity".into(),
            });
        };
        match req.op {
            // KeepAlives and acknowledgements are never refused: a refused one would cost
            // a session its lease or hold a write up.
            Op::KeepAlive
            | Op::KeepAliveBatch { .. }
            | Op::AckInvalidations { .. }
            | Op::AckInvalidationsBatch { .. } => self.handle(me, req, received).await,
            _ => match connection.inflight.clone().try_acquire_owned() {
                Ok(_permit) => match self.quotas.begin(me) {
                    Ok(_place) => self.handle(me, req, received).await,
                    Err(e) => Err(e),
                },
                Err(_) => Err(Error::Busy {
                    limit: self.cfg.max_inflight_per_client as u64,
                }),
            },
        }
    }

    async fn events(
        &self,
        _: &ClientConnection,
        caller: &wire::serve::Caller,
        session: SessionId,
        send: quinn::SendStream,
        quic: quinn::Connection,
    ) {
        // Event streams last as long as their session: bounded by QUIC's stream limit,
        // not by the in-flight limit.
        let me = caller.identity.clone().unwrap_or_default();
        self.serve_events(&me, session, send, quic).await
    }
}

impl Proxy {
    /// The proxy's counters.
    pub fn status(&self) -> ProxyStatus {
        let c = &self.hub.counters;
        let (pending, oldest) = self.hub.pending_invalidations();
        ProxyStatus {
            pending_invalidations: pending as u64,
            oldest_pending_ms: oldest.as_millis() as u64,
            request_latency: self.latency.snapshot(),
            refused_by_limit: self.quotas.refusals(),
            clients: c.clients.load(Ordering::Relaxed),
            sessions: self.hub.session_count() as u64,
            keepalive_batches: c.keepalive_batches.load(Ordering::Relaxed),
            keepalives_batched: c.keepalives_batched.load(Ordering::Relaxed),
            cache_hits: c.cache_hits.load(Ordering::Relaxed),
            upstream_reads: c.upstream_reads.load(Ordering::Relaxed),
            upstream_writes: c.upstream_writes.load(Ordering::Relaxed),
            invalidations_relayed: c.invalidations_relayed.load(Ordering::Relaxed),
            watch_events_relayed: c.watch_events_relayed.load(Ordering::Relaxed),
            upstream_watches: self.hub.upstream_watch_count() as u64,
            session: self.up.session(),
        }
    }

    async fn handle(&self, me: &str, req: Request, received: Instant) -> Response {
        let op = req.op.name();
        let r = self.dispatch(me, req, received).await;
        self.latency.record(op, received.elapsed());
        r
    }

    /// Answers the client `me`'s request. What the proxy answers for a session itself
    /// (KeepAlives it batches, cached reads, acknowledgements, watches, the event stream)
    /// it checks against the session's owner first (`Upstream::check_owner`); what it
    /// forwards, it forwards for `me` ([`Op::Forwarded`]), and the cell checks.
    async fn dispatch(&self, me: &str, req: Request, received: Instant) -> Response {
        let needs_session = matches!(
            req.op,
            Op::KeepAlive | Op::CachedGet { .. } | Op::AckInvalidations { .. } | Op::Rewatch { .. }
        ) || matches!(
            req.op,
            Op::Get { watch: true, .. }
                | Op::Exists { watch: true, .. }
                | Op::Children { watch: true, .. }
        );
        if needs_session && req.session == 0 {
            return Err(Error::SessionRequired);
        }
        // Acknowledgements are checked against what this proxy knows, below.
        if needs_session && !matches!(req.op, Op::AckInvalidations { .. }) {
            self.up.check_owner(me, req.session).await?;
        }
        let counters = &self.hub.counters;
        match req.op {
            Op::KeepAlive => self.up.keepalive(req.session, received).await,
            Op::KeepAliveBatch { sessions } => self.keepalive_batch(me, sessions, received).await,
            Op::Forwarded { .. } => Err(Error::BadRequest {
                reason: "only a proxy forwards requests for others, and only to replicas".into(),
            }),
            Op::ProxyStatus => Ok(Reply::ProxyStatus(self.status())),
            Op::StateDigest => Err(Error::BadRequest {
                reason: "StateDigest is answered by replicas; this is a proxy".into(),
            }),
            Op::Leadership | Op::LeadershipAfter { .. } => Err(Error::BadRequest {
                reason: "Leadership is answered by replicas; this is a proxy".into(),
            }),
            Op::Events => Err(Error::BadRequest {
                reason: "Events needs its own stream".into(),
            }),
            Op::CachedGet { path } => self.cached_get(me, req.session, path).await,
            Op::AckInvalidations { ids } => {
                for (session, ids) in self.own_acks(me, vec![(req.session, ids)])? {
                    let acks = self.hub.ack(session, &ids);
                    self.up.send_acks(acks);
                }
                Ok(Reply::Acked)
            }
            Op::AckInvalidationsBatch { acks } => {
                path::validate_ack_batch(&acks)?;
                let mut owed = Vec::new();
                for (session, ids) in self.own_acks(me, acks)? {
                    owed.extend(self.hub.ack(session, &ids));
                }
                self.up.send_acks(owed);
                Ok(Reply::Acked)
            }
            Op::Get { watch: true, .. }
            | Op::Exists { watch: true, .. }
            | Op::Children { watch: true, .. } => self.watched_read(me, req.session, req.op).await,
            Op::Rewatch { watches } => self.rewatch(me, req.session, watches).await,
            Op::CloseSession => {
                counters.upstream_writes.fetch_add(1, Ordering::Relaxed);
                let session = req.session;
                let r = self.up.forward_for(me, req).await;
                if matches!(r, Ok(_) | Err(Error::SessionExpired { .. })) {
                    let acks = self.hub.session_ended(session);
                    self.up.send_acks(acks);
                }
                r
            }
            Op::CreateSession => {
                counters.upstream_writes.fetch_add(1, Ordering::Relaxed);
                let r = self.up.forward_for(me, req).await;
                if let Ok(Reply::SessionCreated {
                    session,
                    session_lease_ms,
                }) = &r
                {
                    self.hub.opened(*session, received, *session_lease_ms);
                    self.hub.set_owner(*session, me);
                }
                r
            }
            op => {
                if op.is_write()
                    || matches!(
                        op,
                        Op::AddLearner { .. }
                            | Op::Promote { .. }
                            | Op::RemoveMember { .. }
                            | Op::TransferLeader { .. }
                            | Op::Snapshot
                    )
                {
                    counters.upstream_writes.fetch_add(1, Ordering::Relaxed);
                } else {
                    counters.upstream_reads.fetch_add(1, Ordering::Relaxed);
                }
                self.up.forward_for(me, Request { op, ..req }).await
            }
        }
    }

    /// A client's KeepAlives for many of its sessions at once (the SDK coalesces those
    /// due together): each joins this proxy's next batch like a single KeepAlive.
    ///
    /// Each session is checked against its owner first: one another identity owns refuses
    /// the whole batch before anything is renewed, and one the cell does not hold (or
    /// no longer) is reported as such without joining a batch (an id not issued yet
    /// must not be renewed for `me` once it is).
    async fn keepalive_batch(
        &self,
        me: &str,
        sessions: Vec<SessionId>,
        received: Instant,
    ) -> Response {
        path::validate_keepalive_batch(&sessions)?;
        let (mut renewed, mut expired, mut unknown, mut unacknowledged) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // Owners this proxy knows are checked here at once; the others (a client that
        // moved here from another proxy) are asked of the cell all together.
        let checks =
            futures::future::join_all(sessions.iter().map(|&s| self.up.check_owner(me, s))).await;
        let mut owned = Vec::with_capacity(sessions.len());
        let mut first_err = None;
        for (&s, checked) in sessions.iter().zip(checks) {
            match checked {
                Ok(()) => owned.push(s),
                Err(Error::UnknownSession { .. }) => unknown.push(s),
                Err(Error::SessionExpired { .. }) => expired.push(s),
                Err(e @ Error::NotSessionOwner { .. }) => return Err(e),
                // The cell could not say (an election): not renewed now, retried by the
                // client; the others go on.
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let sessions = owned;
        let results =
            futures::future::join_all(sessions.iter().map(|&s| self.up.keepalive(s, received)))
                .await;
        let mut lease_ms = self.hub.lease().as_millis() as u64;
        for (&s, r) in sessions.iter().zip(results) {
            match r {
                Ok(Reply::KeepAlive {
                    session_lease_ms,
                    unacknowledged: u,
                }) => {
                    lease_ms = session_lease_ms;
                    renewed.push(s);
                    unacknowledged.extend(u.into_iter().map(|(id, paths)| (s, id, paths)));
                }
                Err(Error::SessionExpired { .. }) => expired.push(s),
                Err(Error::UnknownSession { .. }) => unknown.push(s),
                Ok(other) => {
                    first_err.get_or_insert(Error::Internal {
                        reason: format!("unexpected KeepAlive answer {other:?}"),
                    });
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        tracing::debug!(
            sessions = %IdRanges(&sessions),
            renewed = renewed.len(),
            expired = expired.len(),
            unknown = unknown.len(),
            first_err = ?first_err,
            ms = received.elapsed().as_millis() as u64,
            "client KeepAliveBatch"
        );
        if renewed.is_empty() && expired.is_empty() && unknown.is_empty() {
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        Ok(Reply::KeepAliveBatch {
            session_lease_ms: lease_ms,
            renewed,
            expired,
            unknown,
            unacknowledged,
        })
    }

    /// Of the acknowledgements the client `me` sends, those for sessions this proxy knows
    /// `me` owns. One for a session another identity owns refuses the request; one for a
    /// session whose owner this proxy does not know is dropped: invalidations are relayed
    /// here only to sessions that cached here, whose owner was checked when they did.
    /// (The cell is never asked: an acknowledgement must not wait on it.)
    fn own_acks(
        &self,
        me: &str,
        acks: Vec<(SessionId, Vec<u64>)>,
    ) -> Result<Vec<(SessionId, Vec<u64>)>, Error> {
        let mut mine = Vec::with_capacity(acks.len());
        for (session, ids) in acks {
            match self.hub.owned_by(session, me) {
                Some(true) => mine.push((session, ids)),
                Some(false) => {
                    return Err(Error::NotSessionOwner {
                        session,
                        identity: me.to_string(),
                    })
                }
                None => {}
            }
        }
        Ok(mine)
    }

    /// A cached read for the client `me`: from the proxy's cache if the leader answered
    /// `me` a read of this copy of the node, else upstream, forwarded for `me` (the
    /// node's ACL decides) under the proxy's own session.
    async fn cached_get(&self, me: &str, session: u64, p: String) -> Response {
        path::validate(&p)?;
        let snap = match self.hub.cache_lookup(session, me, &p) {
            Ok(hit) => return Ok(hit),
            Err(snap) => snap,
        };
        match self.up.cached_read(me, &p).await? {
            Reply::CachedData {
                value,
                index,
                cachable,
            } => Ok(self
                .hub
                .cache_fill(session, me, &p, snap, value, index, cachable)),
            other => Err(Error::Internal {
                reason: format!("unexpected answer to CachedGet: {other:?}"),
            }),
        }
    }

    /// A watched read: sent upstream under the proxy's session, forwarded for the client
    /// `me` (its read right is checked there; one upstream watch per node and kind), the
    /// client's watch kept here at the index its read reflects.
    async fn watched_read(&self, me: &str, session: u64, op: Op) -> Response {
        let p = match &op {
            Op::Get { path, .. } | Op::Exists { path, .. } | Op::Children { path, .. } => {
                path.clone()
            }
            _ => unreachable!("only watched reads come here"),
        };
        path::validate(&p)?;
        let snap = self.hub.watch_snapshot();
        self.hub
            .counters
            .upstream_reads
            .fetch_add(1, Ordering::Relaxed);
        let reply = self.up.own_for(me, op).await?;
        let Some((kind, index)) = reply.armed_watch() else {
            return Err(Error::Internal {
                reason: format!("unexpected answer to a watched read: {reply:?}"),
            });
        };
        if let Some(spec) = self.hub.add_watch(session, (p, kind), index, snap) {
            self.up.rearm_later(spec);
        }
        Ok(reply)
    }

    /// A client re-arms its watches (after its stream reconnected): re-armed upstream
    /// under the proxy's session, forwarded for the client (its read right on each node
    /// is checked there); those that fire are answered to this client only.
    async fn rewatch(
        &self,
        me: &str,
        session: u64,
        watches: Vec<wire::types::WatchSpec>,
    ) -> Response {
        path::validate_rewatch(&watches)?;
        if watches.is_empty() {
            // Nothing to arm: a session check at the cell, as a replica would make.
            self.up.confirm_owner(me, session).await?;
            return Ok(Reply::Rewatched { fired: Vec::new() });
        }
        let snap = self.hub.watch_snapshot();
        let fired = match self
            .up
            .own_for(
                me,
                Op::Rewatch {
                    watches: watches.clone(),
                },
            )
            .await?
        {
            Reply::Rewatched { fired } => fired,
            other => {
                return Err(Error::Internal {
                    reason: format!("unexpected answer to Rewatch: {other:?}"),
                })
            }
        };
        for w in watches {
            let key = (w.path.clone(), w.kind);
            if fired.iter().any(|e| e.path == w.path && e.kind == w.kind) {
                self.hub.remove_watch(session, &key);
                continue;
            }
            if let Some(spec) = self.hub.add_watch(session, key, w.since_index, snap) {
                self.up.rearm_later(spec);
            }
        }
        self.hub
            .counters
            .watch_events_relayed
            .fetch_add(fired.len() as u64, Ordering::Relaxed);
        Ok(Reply::Rewatched { fired })
    }

    /// A client's event stream: opened after the cell confirms the session, then fed with
    /// the invalidations and watch events the proxy relays, until the session ends or the
    /// client goes away.
    async fn serve_events(
        &self,
        me: &str,
        session: u64,
        mut send: quinn::SendStream,
        conn: quinn::Connection,
    ) {
        let opened: Response = async {
            if session == 0 {
                return Err(Error::SessionRequired);
            }
            // A session check at the cell, for the client: a stream is never attached
            // for a session that ended or that another identity owns.
            self.up.confirm_owner(me, session).await?;
            Ok(Reply::EventsOpened {
                index: self.hub.last_index(),
            })
        }
        .await;
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
        let id = self.hub.attach_stream(session, tx);
        loop {
            let item = tokio::select! {
                item = rx.recv() => item,
                _ = conn.closed() => None,
            };
            let Some(item) = item else { break };
            let end = item.is_err();
            if frame::write(&mut send, &item, CLIENT_FRAME_BYTES_MAX)
                .await
                .is_err()
            {
                // Keep what was not written for the session's next stream.
                let mut left = vec![item];
                rx.close();
                while let Ok(x) = rx.try_recv() {
                    left.push(x);
                }
                self.hub.requeue(session, left);
                break;
            }
            if end {
                break;
            }
        }
        self.hub.detach_stream(session, id);
        let _ = send.finish();
    }
}
