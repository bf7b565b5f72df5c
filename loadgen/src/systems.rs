//! One client session per system, with each system's standard lock recipe:
//!
//! - **ours**: the SDK's `Lock` (ephemeral sequential node; the grant names its
//!   predecessor, a waiter watches only that one; the token is the create index).
//! - **etcd**: clientv3 3.4's `concurrency.Mutex`, step for step: a lease kept alive every
//!   third of its TTL; `tryAcquire` is one txn, `If(CreateRevision(<prefix>/<lease>) == 0)
//!   Then(Put(key, lease), Get(prefix, WithFirstCreate)) Else(Get(key), Get(prefix,
//!   WithFirstCreate))`, so an uncontended acquire is one RPC (the lock is held when the
//!   prefix's oldest key is ours or there is none); contended, `waitDeletes`: get the
//!   latest key of the prefix created before ours, watch it for its delete, repeat. The
//!   token is the key's create revision. (3.5 adds a `Get` of the own key after the wait,
//!   on the contended path only; Debian's etcd here is 3.4.)
//! - **ZooKeeper**: the lock recipe: an ephemeral sequential child, list the children,
//!   watch the one just below; the token is the node's creation zxid.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{anyhow, Context};
use client_sdk::{Client, ClientConfig, CreateMode, Lock, LockGuard, Session};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use zookeeper_client as zk;

use crate::cluster::{Cluster, System};
use crate::etcd_conn::EtcdConn;
use crate::zk_sess::ZkSess;

/// A connection factory for one cluster.
#[derive(Clone)]
pub enum Conn {
    /// Our SDK client (sessions are multiplexed over its connection).
    Ours(Client),
    /// etcd endpoints (each session has its own gRPC client).
    Etcd(Vec<String>),
    /// ZooKeeper connect string (each session is a connection).
    Zk(String),
}

/// A session with a lease (12 s unless configured otherwise).
pub enum Sess {
    /// Ours.
    Ours(Session),
    /// etcd: its connection (shared by the sessions of one client), lease id, what keeps
    /// the lease alive.
    Etcd(Arc<EtcdConn>, i64, EtcdKeeper),
    /// ZooKeeper: the session, resumed if its client gives up on it
    /// ([`crate::zk_sess`]).
    Zk(ZkSess),
}

/// What keeps an etcd lease alive.
pub enum EtcdKeeper {
    /// A task of its own on its own keep-alive stream (a session with its own client, as
    /// clientv3's `concurrency.Session` on its own client), and what it has seen.
    Own(tokio::task::JoinHandle<()>, Arc<Mutex<KeeperState>>),
    /// A client's shared stream ([`crate::etcd_leases::LeaseMux`]), as clientv3 renews
    /// every lease of one client.
    Shared(Arc<crate::etcd_leases::LeaseMux>, i64),
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
            Some(crate::etcd_conn::options().with_timeout(Duration::from_secs(2))),
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
    /// A session dropped without [`Sess::close`] stops renewing (its lease then runs out at
    /// the server), so no keeper outlives its session.
    fn drop(&mut self) {
        self.stop();
    }
}

/// A value read with a watch ([`Sess::read_watched`]): valid until the watch fires.
pub struct WatchedValue {
    /// The session that read it (a churned slot's new session has no watch).
    session: u64,
    /// Its length.
    pub len: usize,
    changed: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    fired: bool,
}

impl WatchedValue {
    /// True while the copy may be served to `s`: read by `s` and its watch not fired.
    pub fn valid_for(&mut self, s: &Sess) -> bool {
        use futures::FutureExt;
        if !self.fired && self.changed.as_mut().now_or_never().is_some() {
            self.fired = true;
        }
        !self.fired && self.session == s.server_id()
    }
}

/// A held lock.
pub enum Held {
    /// Ours.
    Ours(LockGuard),
    /// etcd: the key.
    Etcd(String),
    /// ZooKeeper: the node.
    Zk(String),
}

impl Held {
    /// The same lock again, to retry a release that failed: etcd's key, ZooKeeper's node
    /// (a delete may be sent again). `None` for ours, whose release retries itself.
    pub fn again(&self) -> Option<Held> {
        match self {
            Held::Ours(_) => None,
            Held::Etcd(k) => Some(Held::Etcd(k.clone())),
            Held::Zk(n) => Some(Held::Zk(n.clone())),
        }
    }
}

impl Conn {
    /// A factory for `c`'s sessions.
    pub async fn new(c: &Cluster) -> anyhow::Result<Conn> {
        Conn::for_endpoints(c.system, &c.endpoints, &c.ca).await
    }

    /// A factory from endpoints.
    pub async fn for_endpoints(
        system: System,
        endpoints: &[String],
        ca: &std::path::Path,
    ) -> anyhow::Result<Conn> {
        Ok(match system {
            System::Ours => {
                let mut cfg = ClientConfig::new(endpoints.to_vec(), ca.to_path_buf());
                cfg.agent = "loadgen".into();
                Conn::Ours(Client::connect(cfg).await?)
            }
            System::Etcd => Conn::Etcd(endpoints.to_vec()),
            System::Zk => Conn::Zk(endpoints.join(",")),
        })
    }

    /// Opens a session with a lease of `lease`.
    pub async fn session(&self, lease: Duration) -> anyhow::Result<Sess> {
        match self {
            Conn::Ours(c) => Ok(Sess::Ours(c.open_session().await?)),
            Conn::Etcd(eps) => etcd_session(Arc::new(EtcdConn::new(spread(eps))), lease).await,
            Conn::Zk(cluster) => {
                let c = zk_connector(lease)
                    .connect(cluster)
                    .await
                    .map_err(|e| anyhow!("zookeeper connect: {e}"))?;
                Ok(Sess::Zk(ZkSess::new(c, cluster.clone())))
            }
        }
    }
}

/// A ZooKeeper client set up as close to the Java client's timings as the Rust client
/// allows. The Java client, with a session timeout T, pings after about T/4 without a
/// request (its read timeout, 2/3 T, halved, less a second) and drops a connection that
/// has heard nothing for 2/3 T, then reconnects until the server answers (it never
/// declares the session expired itself). `zookeeper-client`'s defaults are harsher: a
/// ping after 3/20 T, a drop after 2/5 T. Its connection timeout may be set up to 3/5 T
/// (more is ignored), which gives a ping after 9/40 T and a drop after 3/5 T (with 12 s:
/// 2.7 s and 7.2 s, against the Java client's about 3 s and 8 s). What cannot be set: it
/// declares the session expired itself 7/5 T after it last heard from a server, where
/// the Java client would keep trying; loadgen's server-side check counts a session as
/// lost only if the server no longer holds it.
pub fn zk_connector(lease: Duration) -> zk::Connector {
    let mut c = zk::Client::connector();
    c.session_timeout(lease).connection_timeout(lease * 3 / 5);
    c
}

/// Sessions per etcd gRPC client when many are opened at once ([`open_many`]), as many
/// as ours put on one QUIC connection.
pub const ETCD_LEASES_PER_CLIENT: usize = 2_000;

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
async fn etcd_session(c: Arc<EtcdConn>, lease: Duration) -> anyhow::Result<Sess> {
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
                        Ok(Ok(s)) => {
                            stream = Some(s);
                            renewed = true;
                        }
                        Ok(Err(e)) if lease_not_found(&e) => {
                            st2.lock().expect("keeper").gone = true;
                            return;
                        }
                        // Only a member that cannot be reached moves the connection on
                        // (clientv3 does not leave a member for being slow; a frozen
                        // one's connection fails its keep-alive pings within 8 s).
                        Ok(Err(e)) if crate::etcd_conn::unreachable(&e) => kc.failed(turn),
                        _ => {}
                    }
                }
            } else if let Some((keeper, replies)) = stream.as_mut() {
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
                        // A slow or broken stream is opened again, at the same member:
                        // only a member that cannot be reached moves the connection on
                        // (as clientv3 does not leave a member for being slow).
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
    let keeper = EtcdKeeper::Own(task, st);
    Ok(Sess::Etcd(c, id, keeper))
}

/// True if `e` is etcd's "lease not found" (the `etcd-client` crate's answer to a
/// keep-alive stream opened for a lease the server no longer has, or the server's own).
fn lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// How many ZooKeeper sessions this process can hold: each is a TCP connection, so the
/// open-file limit (less 2 000 for everything else) caps them. A container without
/// CAP_SYS_RESOURCE cannot raise its hard limit (20 000 on the benchmark machine).
pub fn zk_session_cap() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1_000;
    }
    (lim.rlim_cur as usize).saturating_sub(2_000).max(100)
}

/// A lease on `c` renewed on the client's shared keep-alive stream `mux`.
async fn shared_etcd_session(
    c: Arc<EtcdConn>,
    mux: Arc<crate::etcd_leases::LeaseMux>,
    lease: Duration,
) -> anyhow::Result<Sess> {
    let id = grant(&c, lease).await?;
    mux.add(id);
    Ok(Sess::Etcd(c, id, EtcdKeeper::Shared(mux, id)))
}

/// Session opens retried by [`open_many`] in this process.
pub static OPEN_RETRIES: AtomicU64 = AtomicU64::new(0);

/// Opens `n` sessions for a large scenario (profile, state), `par` at a time, showing a
/// progress bar. Ours: over `ours` (clients of many sessions each). etcd: one lease per
/// session, [`ETCD_LEASES_PER_CLIENT`] per gRPC client, each lease renewed on its own
/// keep-alive stream, or all of a client's on one ([`ETCD_SHARED_KEEPALIVE`]). ZooKeeper: one connection per session (a ZooKeeper
/// session is a connection). A failed open is retried up to 4 times ([`OPEN_RETRIES`]).
pub async fn open_many(conn: &Conn, n: usize, lease: Duration) -> anyhow::Result<Vec<Sess>> {
    if matches!(conn, Conn::Zk(_)) && n > zk_session_cap() {
        anyhow::bail!(
            "{n} ZooKeeper sessions need {n} connections, but this process may hold only \
             {} (its open-file limit, less 2 000); run with a smaller --scale or raise the \
             hard limit (needs CAP_SYS_RESOURCE)",
            zk_session_cap()
        );
    }
    let mut etcd_clients = Vec::new();
    if let Conn::Etcd(eps) = conn {
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
            eps.clone()
        };
        for i in 0..n.div_ceil(ETCD_LEASES_PER_CLIENT) {
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
                .then(|| crate::etcd_leases::LeaseMux::start(eps, lease));
            let client_lease = if ETCD_LEASE_PER_CLIENT.load(Ordering::Relaxed) {
                match etcd_session(client.clone(), lease).await? {
                    Sess::Etcd(_, id, keeper) => Some((id, Arc::new(keeper))),
                    _ => unreachable!("an etcd session"),
                }
            } else {
                None
            };
            etcd_clients.push((client, mux, client_lease));
        }
    }
    crate::scenarios::open_batched(n, 200, |i| {
        let etcd = etcd_clients.get(i / ETCD_LEASES_PER_CLIENT).cloned();
        async move {
            // A client retries a failed connect (a busy server's handshake can time
            // out); the retries are counted and reported.
            let mut tries = 0;
            loop {
                let r = match &etcd {
                    Some((c, _, Some((id, k)))) => {
                        Ok(Sess::Etcd(c.clone(), *id, EtcdKeeper::Client(k.clone())))
                    }
                    Some((c, Some(mux), None)) => {
                        shared_etcd_session(c.clone(), mux.clone(), lease).await
                    }
                    Some((c, None, None)) => etcd_session(c.clone(), lease).await,
                    None => conn.session(lease).await,
                };
                tries += 1;
                if r.is_ok() || tries == 5 {
                    return r;
                }
                OPEN_RETRIES.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    })
    .await
}

fn zk_err(e: zk::Error) -> anyhow::Error {
    anyhow!("zookeeper: {e}")
}

impl Sess {
    /// Makes sure the lock directory (ours, ZooKeeper) exists.
    pub async fn ensure_dir(&self, dir: &str) -> anyhow::Result<()> {
        match self {
            Sess::Ours(s) => {
                let mut path = String::new();
                for part in dir.trim_start_matches('/').split('/') {
                    path = format!("{path}/{part}");
                    match s.create(&path, Vec::new(), CreateMode::default()).await {
                        Ok(_) | Err(client_sdk::Error::NodeExists { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(())
            }
            Sess::Etcd(..) => Ok(()),
            Sess::Zk(z) => {
                let c = z.client();
                let mut path = String::new();
                for part in dir.trim_start_matches('/').split('/') {
                    path = format!("{path}/{part}");
                    let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                    match c.create(&path, b"", &opts).await {
                        Ok(_) | Err(zk::Error::NodeExists) => {}
                        Err(e) => return Err(zk_err(e)),
                    }
                }
                Ok(())
            }
        }
    }

    /// Takes the exclusive lock `dir` (blocking); returns it with its fencing token.
    pub async fn acquire(&self, dir: &str) -> anyhow::Result<(Held, u64)> {
        self.acquire_as(dir, false).await
    }

    /// [`Sess::acquire`] again after it failed on this session: ZooKeeper first looks for
    /// a node of this session left by the failed attempt (a create whose answer was lost)
    /// and waits with it, as Curator's protected mode finds its node by its GUID (here the
    /// session id in the name); etcd's key is the lease's anyway, and ours resolves an
    /// unanswered create itself.
    pub async fn acquire_again(&self, dir: &str) -> anyhow::Result<(Held, u64)> {
        self.acquire_as(dir, true).await
    }

    async fn acquire_as(&self, dir: &str, again: bool) -> anyhow::Result<(Held, u64)> {
        match self {
            Sess::Ours(s) => {
                let g = Lock::exclusive(s, dir).acquire().await?;
                let t = g.token();
                Ok((Held::Ours(g), t))
            }
            Sess::Etcd(c, lease, _) => {
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
                    return Ok((Held::Etcd(key), my_rev as u64));
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
                        // A stream: no request timeout, as in clientv3 (the connection's
                        // keep-alive pings end it if the member goes silent).
                        let opts = WatchOptions::new().with_start_revision(rev + 1);
                        let (_w, mut stream) = c
                            .call(
                                "Watch",
                                |mut c| async move { c.watch(waited, Some(opts)).await },
                            )
                            .await?;
                        'watch: loop {
                            match stream.message().await? {
                                Some(m) => {
                                    if m.events()
                                        .iter()
                                        .any(|e| e.event_type() == EventType::Delete)
                                    {
                                        break 'watch;
                                    }
                                }
                                None => break 'watch,
                            }
                        }
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
                Ok((Held::Etcd(key), my_rev as u64))
            }
            Sess::Zk(z) => {
                // The children are `<session id>-lock-<sequence>` (the session id is what
                // Curator's protected mode puts a GUID for), ordered by their sequence.
                let mine = format!("{:016x}-lock-", self.server_id());
                let seq_of = |k: &str| k.rsplit('-').next().unwrap_or("").to_string();
                let left = if again {
                    z.client()
                        .list_children(dir)
                        .await
                        .map_err(zk_err)?
                        .into_iter()
                        .find(|k| k.starts_with(&mine))
                } else {
                    None
                };
                // The token is the node's creation zxid, from the create's answer (or read
                // once, for a node found again).
                let (me, czxid) = match left {
                    Some(k) => (k, None),
                    None => {
                        let opts =
                            zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                        let (stat, seq) = z
                            .client()
                            .create(&format!("{dir}/{mine}"), b"", &opts)
                            .await
                            .map_err(zk_err)?;
                        (format!("{mine}{seq}"), Some(stat.czxid as u64))
                    }
                };
                let node = format!("{dir}/{me}");
                // If the wait fails, the node is deleted before the error is returned, as
                // Curator's lock deletes its path on an error.
                let waited: anyhow::Result<u64> = async {
                    loop {
                        // The session's client now: a watch left on a client that gave up
                        // fires with its end, and the recipe reads again through the resumed
                        // one (as the Java client reads again after a reconnect).
                        let c = z.client();
                        let mut kids = c.list_children(dir).await.map_err(zk_err)?;
                        kids.sort_by_key(|k| seq_of(k));
                        let i = kids
                            .iter()
                            .position(|k| *k == me)
                            .context("own lock node vanished (session expired?)")?;
                        if i == 0 {
                            if let Some(t) = czxid {
                                return Ok(t);
                            }
                            let st = c.check_stat(&node).await.map_err(zk_err)?;
                            return Ok(st.context("own lock node vanished")?.czxid as u64);
                        }
                        let pred = format!("{dir}/{}", kids[i - 1]);
                        let (st, w) = c.check_and_watch_stat(&pred).await.map_err(zk_err)?;
                        if st.is_some() {
                            w.changed().await;
                        }
                    }
                }
                .await;
                match waited {
                    Ok(token) => Ok((Held::Zk(node), token)),
                    Err(e) => {
                        z.delete_when_connected(&node).await;
                        Err(e)
                    }
                }
            }
        }
    }

    /// Releases a lock.
    pub async fn release(&self, h: Held) -> anyhow::Result<()> {
        match (self, h) {
            (_, Held::Ours(g)) => Ok(g.release().await?),
            (Sess::Etcd(c, ..), Held::Etcd(key)) => {
                c.call(
                    "DeleteRange",
                    |mut c| async move { c.delete(key, None).await },
                )
                .await?;
                Ok(())
            }
            // A node already gone is released (as Curator's release ignores NoNode): a
            // delete retried after its answer was lost, or a session that ended.
            (Sess::Zk(z), Held::Zk(node)) => match z.client().delete(&node, None).await {
                Ok(()) | Err(zk::Error::NoNode) => Ok(()),
                Err(e) => Err(zk_err(e)),
            },
            _ => Err(anyhow!("lock held through another system")),
        }
    }

    /// Writes `value` to `key` (created by [`Sess::prepare_key`] for ours and ZooKeeper).
    pub async fn write(&self, key: &str, value: Vec<u8>) -> anyhow::Result<()> {
        match self {
            Sess::Ours(s) => {
                s.set_data(key, value, None).await?;
                Ok(())
            }
            Sess::Etcd(c, ..) => {
                let key = key.to_string();
                c.call("Put", |mut c| async move { c.put(key, value, None).await })
                    .await?;
                Ok(())
            }
            Sess::Zk(z) => {
                let c = z.client();
                c.set_data(key, &value, None).await.map_err(zk_err)?;
                Ok(())
            }
        }
    }

    /// Creates `key` (a persistent node) if the system needs it before `write`.
    pub async fn prepare_key(&self, key: &str) -> anyhow::Result<()> {
        match self {
            Sess::Ours(s) => match s.create(key, Vec::new(), CreateMode::default()).await {
                Ok(_) | Err(client_sdk::Error::NodeExists { .. }) => Ok(()),
                Err(e) => Err(e.into()),
            },
            Sess::Etcd(..) => Ok(()),
            Sess::Zk(z) => {
                let c = z.client();
                let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                match c.create(key, b"", &opts).await {
                    Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
                    Err(e) => Err(zk_err(e)),
                }
            }
        }
    }

    /// Ends the session (its locks and ephemerals go at once).
    pub async fn close(self) {
        match self {
            Sess::Ours(s) => {
                let _ = s.close().await;
            }
            // One of a client's sessions: its keys go with its releases; the lease stays.
            Sess::Etcd(_, _, EtcdKeeper::Client(_)) => {}
            Sess::Etcd(c, lease, keeper) => {
                keeper.stop();
                let _ = c
                    .call(
                        "LeaseRevoke",
                        |mut c| async move { c.lease_revoke(lease).await },
                    )
                    .await;
            }
            Sess::Zk(z) => drop(z),
        }
    }

    /// Reads `key` at the servers (ours: a linearizable read, no cache; etcd: a
    /// linearizable range; ZooKeeper: `getData` at the connected member).
    pub async fn read(&self, key: &str) -> anyhow::Result<usize> {
        match self {
            Sess::Ours(s) => Ok(s.get(key).await?.0.len()),
            Sess::Etcd(c, ..) => {
                let key = key.to_string();
                let r = c
                    .read(|mut c| {
                        let key = key.clone();
                        async move { c.get(key, None).await }
                    })
                    .await?;
                Ok(r.kvs().first().map_or(0, |kv| kv.value().len()))
            }
            Sess::Zk(z) => Ok(z.client().get_data(key).await.map_err(zk_err)?.0.len()),
        }
    }

    /// Reads `key` and leaves a watch on it (ZooKeeper only): what Curator's `NodeCache`
    /// does, a copy kept until the watch fires (or the session breaks), then read again.
    /// Eventually consistent: between a write and its watch event the copy is stale.
    pub async fn read_watched(&self, key: &str) -> anyhow::Result<WatchedValue> {
        match self {
            Sess::Zk(z) => {
                let c = z.client();
                let (data, _, w) = c.get_and_watch_data(key).await.map_err(zk_err)?;
                Ok(WatchedValue {
                    session: self.server_id(),
                    len: data.len(),
                    changed: Box::pin(async move {
                        w.changed().await;
                    }),
                    fired: false,
                })
            }
            _ => anyhow::bail!("a watched read is ZooKeeper's cache; ours has its own"),
        }
    }

    /// A new session opened the way this one was (etcd: a lease on the same gRPC client;
    /// otherwise through `conn`).
    pub async fn reopen(&self, conn: &Conn, lease: Duration) -> anyhow::Result<Sess> {
        match self {
            Sess::Etcd(c, _, EtcdKeeper::Shared(mux, _)) => {
                shared_etcd_session(c.clone(), mux.clone(), lease).await
            }
            Sess::Etcd(c, id, EtcdKeeper::Client(k)) => {
                Ok(Sess::Etcd(c.clone(), *id, EtcdKeeper::Client(k.clone())))
            }
            Sess::Etcd(c, ..) => etcd_session(c.clone(), lease).await,
            _ => conn.session(lease).await,
        }
    }

    /// True if the lock `h` is still held: its node or key is still there.
    pub async fn holds(&self, h: &Held) -> anyhow::Result<bool> {
        match (self, h) {
            (Sess::Ours(_), Held::Ours(g)) => Ok(g.may_act()),
            (Sess::Etcd(c, ..), Held::Etcd(key)) => {
                let key = key.clone();
                let r = c
                    .read(|mut c| {
                        let key = key.clone();
                        async move { c.get(key, None).await }
                    })
                    .await?;
                Ok(r.count() > 0)
            }
            (Sess::Zk(z), Held::Zk(node)) => {
                Ok(z.client().check_stat(node).await.map_err(zk_err)?.is_some())
            }
            _ => Err(anyhow!("lock held through another system")),
        }
    }

    /// The session's id at its server, for the server-side check
    /// ([`crate::server_sessions`]): ours, the session id; etcd, the lease id; ZooKeeper,
    /// the session id.
    pub fn server_id(&self) -> u64 {
        match self {
            Sess::Ours(s) => s.id(),
            Sess::Etcd(_, lease, _) => *lease as u64,
            Sess::Zk(z) => z.client().session_id().0 as u64,
        }
    }

    /// Test hook (`--end-sessions-behind-back`): ends this session without telling
    /// loadgen's clients, so the server-side check must find it lost. Ours and etcd stop
    /// renewing it (the SDK's KeepAlives stop; the lease's keeper stops), so its lease
    /// runs out at the server a lease later, which a check made too early would miss.
    /// ZooKeeper's client pings on its own and cannot be silenced, so a second client
    /// takes the session over (its id and password) and closes it.
    pub async fn end_behind_back(&self, conn: &Conn) -> anyhow::Result<()> {
        match (self, conn) {
            (Sess::Ours(s), _) => s.stop_keepalives(),
            (Sess::Etcd(_, _, EtcdKeeper::Client(_)), _) => anyhow::bail!(
                "with --etcd-lease-per-client a session has no lease of its own to end"
            ),
            (Sess::Etcd(_, _, keeper), _) => keeper.stop(),
            (Sess::Zk(z), Conn::Zk(cluster)) => {
                // Not detached: dropping the other client closes the session. Until the
                // close is applied, this session's client (or its resumer) may reconnect
                // and take the session back (the close then fails as "session moved"), so
                // this waits for a server to say the session is over, and tries again if
                // none does.
                for _ in 0..3 {
                    let c = z.client();
                    let other = zk_connector(c.session_timeout())
                        .session(c.session().clone())
                        .connect(cluster)
                        .await
                        .map_err(|e| {
                            anyhow!("zookeeper connect as session {}: {e}", c.session_id())
                        })?;
                    drop(other);
                    drop(c);
                    for _ in 0..200 {
                        if z.lost() {
                            return Ok(());
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                anyhow::bail!("ZooKeeper session {} did not end", z.client().session_id());
            }
            (Sess::Zk(_), _) => anyhow::bail!("a ZooKeeper session needs a ZooKeeper connection"),
        }
        Ok(())
    }

    /// How many times this session was resumed after its client gave up on it
    /// (ZooKeeper, [`crate::zk_sess`]; 0 for the others, whose clients do not give up).
    pub fn resumed(&self) -> u64 {
        match self {
            Sess::Zk(z) => z.resumed(),
            _ => 0,
        }
    }

    /// The last KeepAlive answered and its round trip (ours, etcd; ZooKeeper's client
    /// pings on its own and does not say).
    pub fn last_keepalive(&self) -> Option<(Instant, Duration)> {
        match self {
            Sess::Ours(s) => s.last_keepalive(),
            Sess::Etcd(_, _, k) => k.last_keepalive(),
            Sess::Zk(_) => None,
        }
    }

    /// False while the session is in jeopardy (or over), as the client sees it. Ours: its
    /// local lease ran out. etcd: no renewal answered for longer than the lease (as ours).
    /// ZooKeeper: its client is not connected (the Java client's Disconnected, Curator's
    /// SUSPENDED), since its pings are not visible.
    pub fn lease_valid(&self, lease: Duration) -> bool {
        match self {
            Sess::Ours(s) => s.lease_valid(),
            Sess::Etcd(_, _, k) => k.valid(lease),
            Sess::Zk(z) => matches!(
                z.client().state(),
                zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly
            ),
        }
    }

    /// True if the session is known to be over: ours, the cell said so (or its grace
    /// period ran out); etcd, the server answered a renewal with TTL 0 or "lease not
    /// found"; ZooKeeper, the client's state.
    pub fn lost(&self) -> bool {
        match self {
            Sess::Ours(s) => s.state() == client_sdk::SessionState::Expired,
            Sess::Etcd(_, _, keeper) => keeper.lost(),
            Sess::Zk(z) => z.lost(),
        }
    }
}
