//! etcd: clientv3 3.4's `concurrency.Mutex` step for step on a lease kept alive like
//! `concurrency.Session` (see the recipe in [`super`]), over [`EtcdConn`] (etcdctl's
//! client settings); the leases of many sessions on one gRPC client ([`Clients`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{anyhow, Context};
use etcd_client::{
    Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};

use super::etcd_conn::EtcdConn;
use super::etcd_leases::LeaseMux;

/// An etcd session: a lease, the connection it was granted on (shared by the sessions of
/// one client), and what keeps it alive.
pub struct EtcdSess {
    conn: Arc<EtcdConn>,
    lease: i64,
    keeper: EtcdKeeper,
}

/// What keeps an etcd lease alive.
pub enum EtcdKeeper {
    /// A task of its own on its own keep-alive stream (a session with its own client, as
    /// clientv3's `concurrency.Session` on its own client), and what it has seen.
    Own(tokio::task::JoinHandle<()>, Arc<Mutex<KeeperState>>),
    /// A client's shared stream ([`crate::systems::etcd_leases::LeaseMux`]), as clientv3 renews
    /// every lease of one client.
    Shared(Arc<crate::systems::etcd_leases::LeaseMux>, i64),
    /// The one lease of the whole gRPC client, shared by all its sessions
    /// (`--etcd-lease-per-client`), as a clientv3 process holds one
    /// `concurrency.Session` for all its mutexes: renewed by its own keeper while any of
    /// them is open. Closing one of the sessions leaves the lease alone.
    Client(Arc<EtcdKeeper>),
}

/// What an etcd lease's own keeper has seen.
pub struct KeeperState {
    /// The last renewal answered, and its round trip.
    last: Option<(Instant, Duration)>,
    /// When the lease was last renewed (or granted).
    renewed: Instant,
    /// The server said the lease is gone (a renewal answered with TTL 0, or "lease not
    /// found").
    gone: bool,
}

/// How [`open_many`] keeps etcd leases alive: false (the default), each lease on its own
/// keep-alive stream, as 50 000 independent clients would (one stream each); true, all
/// of a gRPC client's leases on one stream, as one clientv3 process holding 2 000 leases
/// would (`--etcd-shared-keepalive`).
pub static ETCD_SHARED_KEEPALIVE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether [`open_many`] gives all the sessions of an etcd gRPC client one lease
/// (`--etcd-lease-per-client`, [`EtcdKeeper::Client`]) rather than one each.
pub static ETCD_LEASE_PER_CLIENT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether [`open_many`] connects etcd lease clients to the leader only (found when the
/// sessions are opened; `--etcd-leader-only`) rather than spreading them over members.
pub static ETCD_LEADER_ONLY: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The endpoint of etcd's leader among `eps`, asked of each member in turn.
pub async fn etcd_leader(eps: &[String]) -> anyhow::Result<String> {
    for ep in eps {
        let Ok(mut c) = etcd_client::Client::connect(
            [ep.clone()],
            Some(crate::systems::etcd_conn::options().with_timeout(Duration::from_secs(2))),
        )
        .await
        else {
            continue;
        };
        if let Ok(st) = c.status().await {
            if st.header().is_some_and(|h| h.member_id() == st.leader()) {
                return Ok(ep.clone());
            }
        }
    }
    Err(anyhow!("no etcd member among {eps:?} says it leads"))
}

/// etcd lease renewals answered in this process (every one went to the leader).
pub static ETCD_RENEWALS: AtomicU64 = AtomicU64::new(0);

impl EtcdKeeper {
    /// When the last renewal was answered, and its round trip.
    pub fn last_keepalive(&self) -> Option<(Instant, Duration)> {
        match self {
            EtcdKeeper::Own(_, st) => st.lock().expect("keeper").last,
            EtcdKeeper::Shared(mux, id) => mux.last_keepalive(*id),
            EtcdKeeper::Client(k) => k.last_keepalive(),
        }
    }

    /// True once the server said the lease is gone (only then: a keeper that hears
    /// nothing keeps trying). This is loadgen's definition, the same for all three
    /// systems, not clientv3's: clientv3 3.4 closes a lease's keep-alive when nothing
    /// answers within its TTL and `concurrency.Session` then ends; what such an
    /// application would see is the jeopardy figure (no renewal for longer than the lease).
    fn lost(&self) -> bool {
        match self {
            EtcdKeeper::Own(_, st) => st.lock().expect("keeper").gone,
            EtcdKeeper::Shared(mux, id) => mux.lost(*id),
            EtcdKeeper::Client(k) => k.lost(),
        }
    }

    /// True while the lease was renewed (or granted) less than `ttl` ago: the client's
    /// view, as ours' local lease (no renewal for longer than the lease is jeopardy).
    fn valid(&self, ttl: Duration) -> bool {
        match self {
            EtcdKeeper::Own(_, st) => {
                let st = st.lock().expect("keeper");
                !st.gone && st.renewed.elapsed() <= ttl
            }
            EtcdKeeper::Shared(mux, id) => mux.valid(*id),
            EtcdKeeper::Client(k) => k.valid(ttl),
        }
    }

    /// Stops renewing this session's lease (a client's lease: only once its last session
    /// is dropped, when its keeper is).
    fn stop(&self) {
        match self {
            EtcdKeeper::Own(task, _) => task.abort(),
            EtcdKeeper::Shared(mux, id) => mux.remove(*id),
            EtcdKeeper::Client(_) => {}
        }
    }
}

impl Drop for EtcdKeeper {
    /// A session dropped without [`super::Sess::close`] stops renewing (its lease then runs out at
    /// the server), so no keeper outlives its session.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sessions per etcd gRPC client when many are opened at once ([`open_many`]), as many
/// as ours put on one QUIC connection.
pub const ETCD_LEASES_PER_CLIENT: usize = 2_000;

/// How many gRPC clients [`Clients`] opens for `n` sessions on `members` members: one
/// per [`ETCD_LEASES_PER_CLIENT`] sessions, and at least one per member, so that a few
/// sessions' requests are spread over the members as clientv3's round-robin balancer
/// spreads one process's requests (one connection per member).
pub fn etcd_clients_for(n: usize, members: usize) -> usize {
    n.div_ceil(ETCD_LEASES_PER_CLIENT).max(members).max(1)
}

/// `eps` rotated so that successive calls start at successive members: clients spread
/// over the members, as etcd's own do.
fn spread(eps: &[String]) -> Vec<String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut eps = eps.to_vec();
    if !eps.is_empty() {
        let at = NEXT.fetch_add(1, Ordering::Relaxed) as usize % eps.len();
        eps.rotate_left(at);
    }
    eps
}

/// A session on a gRPC client of its own (its connection starts at the next member).
pub(super) async fn session_on_new_client(
    eps: &[String],
    lease: Duration,
) -> anyhow::Result<EtcdSess> {
    etcd_session(Arc::new(EtcdConn::new(spread(eps))), lease).await
}

/// A new lease of `lease` on `c`.
async fn grant(c: &EtcdConn, lease: Duration) -> anyhow::Result<i64> {
    let ttl = lease.as_secs() as i64;
    let r = c
        .call("LeaseGrant", |mut c| async move {
            c.lease_grant(ttl, None).await
        })
        .await?;
    Ok(r.id())
}

/// A lease on `c` kept alive like clientv3's `concurrency.Session`.
async fn etcd_session(c: Arc<EtcdConn>, lease: Duration) -> anyhow::Result<EtcdSess> {
    let id = grant(&c, lease).await?;
    // Like clientv3's concurrency.Session: keep the lease alive through member failures
    // (re-open the keep-alive stream, possibly at another member) every third of its TTL.
    // Unlike it, keep trying however long nothing answers (clientv3 3.4 gives up after a
    // TTL without an answer): the lease is over only when the server says so (a renewal
    // answered with TTL 0, or "lease not found"), so a stall in loadgen is not turned
    // into a loss by loadgen; the jeopardy figure is what clientv3 would have seen.
    let every = lease / 3;
    let kc = c.clone();
    let st = Arc::new(Mutex::new(KeeperState {
        last: None,
        renewed: Instant::now(),
        gone: false,
    }));
    let st2 = st.clone();
    let task = tokio::spawn(async move {
        let mut stream = None;
        loop {
            let t0 = Instant::now();
            let mut renewed = false;
            if stream.is_none() {
                // Opening the stream sends a renewal and waits for its answer (a member
                // that does not answer within a third of the TTL is given up for another).
                if let Ok((mut c, turn)) = kc.client().await {
                    match tokio::time::timeout(every, c.lease_keep_alive(id)).await {
                        Ok(Ok((keeper, replies))) => {
                            stream = Some((keeper, replies, turn));
                            renewed = true;
                        }
                        Ok(Err(e)) if lease_not_found(&e) => {
                            st2.lock().expect("keeper").gone = true;
                            return;
                        }
                        // An unreachable member, or one that did not answer within a
                        // third of the TTL, is left for the next (see below).
                        Ok(Err(e)) if crate::systems::etcd_conn::unreachable(&e) => kc.failed(turn),
                        Ok(Err(_)) => {}
                        Err(_) => kc.failed(turn),
                    }
                }
            } else if let Some((keeper, replies, turn)) = stream.as_mut() {
                let turn = *turn;
                if keeper.keep_alive().await.is_ok() {
                    match tokio::time::timeout(every, replies.message()).await {
                        Ok(Ok(Some(r))) if r.ttl() > 0 => renewed = true,
                        Ok(Ok(Some(_))) => {
                            // TTL 0: the server no longer has the lease.
                            st2.lock().expect("keeper").gone = true;
                            return;
                        }
                        Ok(Err(e)) if lease_not_found(&e) => {
                            st2.lock().expect("keeper").gone = true;
                            return;
                        }
                        // No answer within a third of the TTL: the member is left for
                        // the next, as a unary request's timeout leaves it
                        // ([`EtcdConn::call`]). Waiting for the connection to fail never
                        // ended for a frozen member: the gRPC channel dials it again and
                        // its kernel accepts, so the keeper of a session whose client
                        // used no other request (loadgen's admin session in `profile`)
                        // stayed on the frozen leader until its lease ran out (one lease
                        // lost in one of five `profile --fault freeze` runs, 2026-12-04).
                        // clientv3 leaves it once its HTTP/2 keep-alive ping fails (2 s +
                        // 6 s).
                        Err(_) => kc.failed(turn),
                        // A broken stream is opened again, at the same member unless it
                        // is unreachable.
                        Ok(Err(e)) if crate::systems::etcd_conn::unreachable(&e) => kc.failed(turn),
                        _ => {}
                    }
                }
            }
            if renewed {
                let t1 = Instant::now();
                {
                    let mut st = st2.lock().expect("keeper");
                    st.last = Some((t1, t1 - t0));
                    st.renewed = t1;
                }
                ETCD_RENEWALS.fetch_add(1, Ordering::Relaxed);
                // Spread the renewals of leases granted together.
                tokio::time::sleep(every.mul_f64(0.9 + 0.1 * rand::random::<f64>())).await;
            } else {
                stream = None;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    Ok(EtcdSess {
        conn: c,
        lease: id,
        keeper: EtcdKeeper::Own(task, st),
    })
}

/// True if `e` is etcd's "lease not found" (the `etcd-client` crate's answer to a
/// keep-alive stream opened for a lease the server no longer has, or the server's own).
fn lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// A lease on `c` renewed on the client's shared keep-alive stream `mux`.
async fn shared_etcd_session(
    c: Arc<EtcdConn>,
    mux: Arc<crate::systems::etcd_leases::LeaseMux>,
    lease: Duration,
) -> anyhow::Result<EtcdSess> {
    let id = grant(&c, lease).await?;
    mux.add(id);
    Ok(EtcdSess {
        conn: c,
        lease: id,
        keeper: EtcdKeeper::Shared(mux, id),
    })
}

/// The gRPC clients of many sessions ([`super::open_many`]): one per
/// [`ETCD_LEASES_PER_CLIENT`] sessions, each with its shared keep-alive stream
/// (`--etcd-shared-keepalive`) or its one lease (`--etcd-lease-per-client`) if asked for.
pub(super) struct Clients(Vec<Client>);

/// One gRPC client of [`Clients`]: its connection, its shared keep-alive stream, and
/// the lease all its sessions share.
type Client = (
    Arc<EtcdConn>,
    Option<Arc<LeaseMux>>,
    Option<(i64, Arc<EtcdKeeper>)>,
);

impl Clients {
    /// The clients for `n` sessions on the members `eps`.
    pub(super) async fn start(
        eps: &[String],
        n: usize,
        lease: Duration,
    ) -> anyhow::Result<Clients> {
        let mut etcd_clients = Vec::new();
        let leader_only = ETCD_LEADER_ONLY.load(Ordering::Relaxed);
        let eps = if leader_only {
            // The leader first, the others after it: requests and keep-alive streams go
            // to the leader and move on to another member only when it fails (with the
            // leader alone, a fault on it would lose leases for want of another member
            // to renew at: loadgen's doing, not etcd's).
            let leader = etcd_leader(eps).await?;
            let mut v = vec![leader.clone()];
            v.extend(eps.iter().filter(|e| **e != leader).cloned());
            v
        } else {
            eps.to_vec()
        };
        for i in 0..etcd_clients_for(n, eps.len()) {
            // Each client starts at another member, so clients spread over members
            // (all at the leader with `--etcd-leader-only`).
            let mut eps = eps.clone();
            if !leader_only {
                let at = i % eps.len().max(1);
                eps.rotate_left(at);
            }
            // Requests start at the client's first member (the leader with
            // `--etcd-leader-only`) and move on only when it fails.
            let client = Arc::new(EtcdConn::new(eps.clone()));
            let mux = ETCD_SHARED_KEEPALIVE
                .load(Ordering::Relaxed)
                .then(|| LeaseMux::start(eps, lease));
            let client_lease = if ETCD_LEASE_PER_CLIENT.load(Ordering::Relaxed) {
                let EtcdSess {
                    lease: id, keeper, ..
                } = etcd_session(client.clone(), lease).await?;
                Some((id, Arc::new(keeper)))
            } else {
                None
            };
            etcd_clients.push((client, mux, client_lease));
        }
        Ok(Clients(etcd_clients))
    }

    /// The `i`-th session: on client `i` modulo the clients, so sessions (and their
    /// requests) spread over the clients and their members.
    pub(super) async fn session(&self, i: usize, lease: Duration) -> anyhow::Result<EtcdSess> {
        match self.0.get(i % self.0.len().max(1)) {
            Some((c, _, Some((id, k)))) => Ok(EtcdSess {
                conn: c.clone(),
                lease: *id,
                keeper: EtcdKeeper::Client(k.clone()),
            }),
            Some((c, Some(mux), None)) => shared_etcd_session(c.clone(), mux.clone(), lease).await,
            Some((c, None, None)) => etcd_session(c.clone(), lease).await,
            None => Err(anyhow!("no etcd client for session {i}")),
        }
    }
}

impl EtcdSess {
    /// Takes the lock `dir`: its key and fencing token (the key's create revision).
    pub(super) async fn acquire(&self, dir: &str) -> anyhow::Result<(String, u64)> {
        let (c, lease) = (&self.conn, &self.lease);
        let key = format!("{dir}/{lease:x}");
        let prefix = format!("{dir}/");
        // clientv3's `WithFirstCreate`: the prefix's oldest key (the owner).
        let owner = || {
            TxnOp::get(
                prefix.clone(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            )
        };
        // One RPC, as `Mutex.tryAcquire`: create the key unless it exists (then
        // read it), and read the owner in the same txn.
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key.clone(), "", Some(PutOptions::new().with_lease(*lease))),
                owner(),
            ])
            .or_else([TxnOp::get(key.clone(), None), owner()]);
        let r = c
            .call("Txn", |mut c| async move { c.txn(txn).await })
            .await?;
        let my_rev = if r.succeeded() {
            r.header().context("header")?.revision()
        } else {
            match r.op_responses().first() {
                Some(TxnOpResponse::Get(g)) => {
                    g.kvs().first().context("own key")?.create_revision()
                }
                _ => return Err(anyhow!("unexpected txn answer")),
            }
        };
        let owner_rev = match r.op_responses().get(1) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().map(|kv| kv.create_revision()),
            _ => return Err(anyhow!("unexpected txn answer (no owner read)")),
        };
        if owner_rev.is_none_or(|rev| rev == my_rev) {
            return Ok((key, my_rev as u64));
        }
        // Contended: `waitDeletes`, as clientv3 3.4; if the wait fails, the key is
        // deleted (best effort) before the error is returned, as `Mutex.Lock` does.
        let waited: anyhow::Result<()> = async {
            loop {
                let opts = GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Descend)
                    .with_max_create_revision(my_rev - 1)
                    .with_limit(1);
                let g = c
                    .read(|mut c| {
                        let (p, opts) = (prefix.clone(), opts.clone());
                        async move { c.get(p, Some(opts)).await }
                    })
                    .await?;
                let Some(kv) = g.kvs().first() else {
                    return Ok(());
                };
                let waited = kv.key().to_vec();
                let rev = g.header().context("header")?.revision();
                // A watch on the client's one stream: no request timeout, as in clientv3
                // (the connection's keep-alive pings end it if the member goes silent).
                c.wait_deleted(waited, rev + 1).await?;
            }
        }
        .await;
        if let Err(e) = waited {
            let k = key.clone();
            let _ = c
                .call(
                    "DeleteRange",
                    |mut c| async move { c.delete(k, None).await },
                )
                .await;
            return Err(e);
        }
        Ok((key, my_rev as u64))
    }

    /// Deletes the lock's key.
    pub(super) async fn release(&self, key: String) -> anyhow::Result<()> {
        self.conn
            .call(
                "DeleteRange",
                |mut c| async move { c.delete(key, None).await },
            )
            .await?;
        Ok(())
    }

    /// Puts `value` at `key`.
    pub(super) async fn write(&self, key: &str, value: Vec<u8>) -> anyhow::Result<()> {
        let key = key.to_string();
        self.conn
            .call("Put", |mut c| async move { c.put(key, value, None).await })
            .await?;
        Ok(())
    }

    /// Ends the session: stops renewing and revokes its lease (one of a client's sessions:
    /// its keys go with its releases; the lease stays).
    pub(super) async fn close(self) {
        let EtcdSess {
            conn,
            lease,
            keeper,
        } = self;
        if let EtcdKeeper::Client(_) = keeper {
            return;
        }
        keeper.stop();
        let _ = conn
            .call(
                "LeaseRevoke",
                |mut c| async move { c.lease_revoke(lease).await },
            )
            .await;
    }

    /// A linearizable range of `key` ([`EtcdConn::read`]: tried at the next member if
    /// its member is unreachable).
    async fn get(&self, key: &str) -> anyhow::Result<etcd_client::GetResponse> {
        let key = key.to_string();
        self.conn
            .read(|mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await
    }

    /// A linearizable range of `key`: the value's length (0 if none).
    pub(super) async fn read(&self, key: &str) -> anyhow::Result<usize> {
        let r = self.get(key).await?;
        Ok(r.kvs().first().map_or(0, |kv| kv.value().len()))
    }

    /// A new session opened the way this one was: a lease on the same gRPC client (the
    /// client's own lease again with `--etcd-lease-per-client`).
    pub(super) async fn reopen(&self, lease: Duration) -> anyhow::Result<EtcdSess> {
        match &self.keeper {
            EtcdKeeper::Shared(mux, _) => {
                shared_etcd_session(self.conn.clone(), mux.clone(), lease).await
            }
            EtcdKeeper::Client(k) => Ok(EtcdSess {
                conn: self.conn.clone(),
                lease: self.lease,
                keeper: EtcdKeeper::Client(k.clone()),
            }),
            EtcdKeeper::Own(..) => etcd_session(self.conn.clone(), lease).await,
        }
    }

    /// True while the lock's key is there.
    pub(super) async fn holds(&self, key: &str) -> anyhow::Result<bool> {
        Ok(self.get(key).await?.count() > 0)
    }

    /// The lease id.
    pub(super) fn server_id(&self) -> u64 {
        self.lease as u64
    }

    /// Test hook: stops renewing the lease without a word to anyone.
    pub(super) fn end_behind_back(&self) -> anyhow::Result<()> {
        if let EtcdKeeper::Client(_) = self.keeper {
            anyhow::bail!("with --etcd-lease-per-client a session has no lease of its own to end");
        }
        self.keeper.stop();
        Ok(())
    }

    /// The last renewal answered and its round trip.
    pub(super) fn last_keepalive(&self) -> Option<(Instant, Duration)> {
        self.keeper.last_keepalive()
    }

    /// False while the lease is in jeopardy (no renewal answered for longer than `ttl`).
    pub(super) fn valid(&self, ttl: Duration) -> bool {
        self.keeper.valid(ttl)
    }

    /// True once the server said the lease is gone.
    pub(super) fn lost(&self) -> bool {
        self.keeper.lost()
    }
}
