//! One client session per system, with each system's standard lock recipe:
//!
//! - **ours**: the SDK's `Lock` (ephemeral sequential node; the grant names its
//!   predecessor, a waiter watches only that one; the token is the node's fencing token,
//!   its create index × 1024 + its place among the entry's creates).
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
//!
//! Each system's code is in its own file (`ours.rs`, `etcd.rs` with its connection, its
//! shared keep-alive stream and its shared watch stream in `etcd_conn.rs`,
//! `etcd_leases.rs` and `etcd_watches.rs`, `zk.rs`); this file
//! holds what the scenarios use ([`Conn`], [`Sess`], [`Held`]) and hands each operation to
//! the session's system.

pub mod etcd;
pub mod etcd_conn;
pub mod etcd_leases;
pub mod etcd_watches;
mod ours;
pub mod zk;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::anyhow;
use client_sdk::{Client, ClientConfig, LockGuard, Session};

use crate::cluster::{Cluster, System};
pub use etcd::{
    etcd_clients_for, EtcdSess, ETCD_LEADER_ONLY, ETCD_LEASES_PER_CLIENT, ETCD_LEASE_PER_CLIENT,
    ETCD_RENEWALS, ETCD_SHARED_KEEPALIVE,
};
pub use zk::{zk_session_cap, ZkSess};

/// Each request's deadline in milliseconds, the same for ours and etcd
/// (`--request-timeout-secs`; see [`request_timeout`]).
pub static REQUEST_TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_REQUEST_TIMEOUT_SECS * 1000);

/// The default of `--request-timeout-secs`: etcdctl's `--command-timeout`.
pub const DEFAULT_REQUEST_TIMEOUT_SECS: u64 = 5;

/// How long one request of a scenario's client may take, retries included, before it
/// fails: our SDK's `ClientConfig::request_timeout` (which retries within it, across a
/// leader change) and the deadline of each of etcd's unary requests (etcdctl's
/// `--command-timeout`, 5 s, the default for both). ZooKeeper's client has no request
/// deadline: a request fails when its connection is given up (7.2 s of silence here,
/// [`zk`]).
pub fn request_timeout() -> Duration {
    Duration::from_millis(REQUEST_TIMEOUT_MS.load(Ordering::Relaxed))
}

/// Our SDK's configuration for a scenario's client of `endpoints`: loadgen's agent name
/// and the scenarios' [`request_timeout`].
pub fn ours_config(endpoints: Vec<String>, ca: std::path::PathBuf) -> ClientConfig {
    let mut cfg = ClientConfig::new(endpoints, ca);
    cfg.agent = "loadgen".into();
    cfg.request_timeout = request_timeout();
    cfg
}

/// A connection factory for one cluster.
#[derive(Clone)]
pub enum Conn {
    /// Our SDK client (sessions are multiplexed over its connection).
    Ours(Client),
    /// etcd endpoints (a session opened alone has a gRPC client of its own; those
    /// opened together by [`open_many`] share clients, [`etcd_clients_for`]).
    Etcd(Vec<String>),
    /// ZooKeeper connect string (each session is a connection).
    Zk(String),
}

/// A session with a lease (12 s unless configured otherwise).
pub enum Sess {
    /// Ours.
    Ours(Session),
    /// etcd: a lease, its connection and what keeps it alive.
    Etcd(EtcdSess),
    /// ZooKeeper: the session, resumed if its client gives up on it ([`zk`]).
    Zk(ZkSess),
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
            System::Ours => Conn::Ours(
                Client::connect(ours_config(endpoints.to_vec(), ca.to_path_buf())).await?,
            ),
            System::Etcd => Conn::Etcd(endpoints.to_vec()),
            System::Zk => Conn::Zk(endpoints.join(",")),
        })
    }

    /// Opens a session with a lease of `lease`.
    pub async fn session(&self, lease: Duration) -> anyhow::Result<Sess> {
        match self {
            Conn::Ours(c) => Ok(Sess::Ours(c.open_session().await?)),
            Conn::Etcd(eps) => Ok(Sess::Etcd(etcd::session_on_new_client(eps, lease).await?)),
            Conn::Zk(cluster) => Ok(Sess::Zk(ZkSess::open(cluster, lease).await?)),
        }
    }
}

/// Session opens retried by [`open_many`] in this process.
pub static OPEN_RETRIES: AtomicU64 = AtomicU64::new(0);

/// The fewest session opens [`open_many`] had in flight at once in this process (its
/// pace after backing off; [`OPEN_WINDOW`] when it never had to).
pub static OPEN_WINDOW_LEAST: AtomicU64 = AtomicU64::new(OPEN_WINDOW as u64);

/// Session opens in flight at once when nothing has failed.
pub const OPEN_WINDOW: usize = 200;

/// How many times one session's open is tried before the setup gives up.
const OPEN_TRIES: u32 = 30;

/// Opens `n` sessions for a large scenario (profile, state), showing a progress bar.
/// Ours: over `ours` (clients of many sessions each). etcd: one lease per session,
/// [`ETCD_LEASES_PER_CLIENT`] per gRPC client, each lease renewed on its own keep-alive
/// stream, or all of a client's on one ([`ETCD_SHARED_KEEPALIVE`]) ([`etcd::Clients`]).
/// ZooKeeper: one connection per session (a ZooKeeper session is a connection).
///
/// Paced as a server takes them ([`open_paced`]): up to [`OPEN_WINDOW`] opens at once;
/// a round with a failed open (a `LeaseGrant` or a connect past its deadline on a busy
/// server) halves that, waits a second and tries the failed ones again, and each clean
/// round grows it back by a quarter (at least one). Rounds run in lockstep: a round
/// waits for its slowest open. Retries are counted in
/// [`OPEN_RETRIES`] and the slowest pace in [`OPEN_WINDOW_LEAST`]; one session's open is
/// given up after [`OPEN_TRIES`] tries.
pub async fn open_many(conn: &Conn, n: usize, lease: Duration) -> anyhow::Result<Vec<Sess>> {
    if matches!(conn, Conn::Zk(_)) && n > zk_session_cap() {
        anyhow::bail!(
            "{n} ZooKeeper sessions need {n} connections, but this process may hold only \
             {} (its open-file limit, less 2 000); run with a smaller --scale or raise the \
             hard limit (needs CAP_SYS_RESOURCE)",
            zk_session_cap()
        );
    }
    let etcd_clients = match conn {
        Conn::Etcd(eps) => Some(etcd::Clients::start(eps, n, lease).await?),
        _ => None,
    };
    let pace = Pace::new(OPEN_WINDOW, OPEN_TRIES, Duration::from_secs(1));
    let (sessions, pace) = open_paced(n, pace, |i| {
        let etcd_clients = etcd_clients.as_ref();
        async move {
            match etcd_clients {
                Some(clients) => clients.session(i, lease).await.map(Sess::Etcd),
                None => conn.session(lease).await,
            }
        }
    })
    .await?;
    OPEN_RETRIES.fetch_add(pace.retries, Ordering::Relaxed);
    OPEN_WINDOW_LEAST.fetch_min(pace.least as u64, Ordering::Relaxed);
    Ok(sessions)
}

/// The pace of [`open_paced`]: opens in flight at once (the window), its bounds, and
/// what happened.
#[derive(Clone, Debug)]
pub struct Pace {
    /// The window's ceiling (and its start).
    pub most: usize,
    /// Tries per item before giving up.
    pub tries: u32,
    /// The wait after a round with a failure.
    pub backoff: Duration,
    /// Retries made.
    pub retries: u64,
    /// The smallest window used.
    pub least: usize,
    /// Rounds run.
    pub rounds: u64,
}

impl Pace {
    /// A pace starting at (and never above) `most` opens at once.
    pub fn new(most: usize, tries: u32, backoff: Duration) -> Self {
        Pace {
            most: most.max(1),
            tries: tries.max(1),
            backoff,
            retries: 0,
            least: most.max(1),
            rounds: 0,
        }
    }
}

/// Runs `open(i)` for every `i` in `0..n`, a window of them at a time: a round with any
/// failure halves the window (down to 1), waits `pace.backoff` and retries the failed
/// items in the next round; a clean round grows the window by a quarter (at least one, at
/// most to `pace.most`). Fails when one item failed `pace.tries` times (the sessions
/// opened so far are dropped). Returns the results in order of `i`.
pub async fn open_paced<T, F, Fut>(
    n: usize,
    mut pace: Pace,
    open: F,
) -> anyhow::Result<(Vec<T>, Pace)>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let pb = crate::report::bar(n as u64, "sessions");
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut tries = vec![0u32; n];
    // Items still to open, failed ones first so a retried item does not wait for the rest.
    let mut todo: std::collections::VecDeque<usize> = (0..n).collect();
    let mut window = pace.most;
    let mut done = 0usize;
    while !todo.is_empty() {
        let round: Vec<usize> = (0..window.min(todo.len()))
            .filter_map(|_| todo.pop_front())
            .collect();
        let results = futures::future::join_all(round.iter().map(|&i| open(i))).await;
        pace.rounds += 1;
        let mut failed = Vec::new();
        let mut given_up = None;
        for (i, r) in round.into_iter().zip(results) {
            tries[i] += 1;
            match r {
                Ok(v) => {
                    out[i] = Some(v);
                    done += 1;
                }
                Err(e) if tries[i] >= pace.tries => given_up = given_up.or(Some((e, tries[i]))),
                Err(_) => failed.push(i),
            }
        }
        pb.set_position(done as u64);
        if let Some((e, tried)) = given_up {
            pb.finish_and_clear();
            return Err(e.context(format!(
                "open a session ({tried} tries, {window} opens at once at the end, {done} of \
                 {n} open)"
            )));
        }
        if failed.is_empty() {
            window = (window + (window / 4).max(1)).min(pace.most);
        } else {
            pace.retries += failed.len() as u64;
            window = (window / 2).max(1);
            pace.least = pace.least.min(window);
            for i in failed.into_iter().rev() {
                todo.push_front(i);
            }
            tokio::time::sleep(pace.backoff).await;
        }
    }
    pb.finish_and_clear();
    Ok((
        out.into_iter()
            .map(|v| v.expect("every item opened"))
            .collect(),
        pace,
    ))
}

impl Sess {
    /// Makes sure the lock directory (ours, ZooKeeper) exists.
    pub async fn ensure_dir(&self, dir: &str) -> anyhow::Result<()> {
        match self {
            Sess::Ours(s) => ours::ensure_dir(s, dir).await,
            Sess::Etcd(_) => Ok(()),
            Sess::Zk(z) => z.ensure_dir(dir).await,
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
                let (g, t) = ours::acquire(s, dir).await?;
                Ok((Held::Ours(g), t))
            }
            Sess::Etcd(e) => {
                let (key, t) = e.acquire(dir).await?;
                Ok((Held::Etcd(key), t))
            }
            Sess::Zk(z) => {
                let (node, t) = z.acquire(dir, again).await?;
                Ok((Held::Zk(node), t))
            }
        }
    }

    /// Releases a lock.
    pub async fn release(&self, h: Held) -> anyhow::Result<()> {
        match (self, h) {
            (_, Held::Ours(g)) => Ok(g.release().await?),
            (Sess::Etcd(e), Held::Etcd(key)) => e.release(key).await,
            (Sess::Zk(z), Held::Zk(node)) => z.release(&node).await,
            _ => Err(anyhow!("lock held through another system")),
        }
    }

    /// Writes `value` to `key` (created by [`Sess::prepare_key`] for ours and ZooKeeper).
    pub async fn write(&self, key: &str, value: Vec<u8>) -> anyhow::Result<()> {
        match self {
            Sess::Ours(s) => ours::write(s, key, value).await,
            Sess::Etcd(e) => e.write(key, value).await,
            Sess::Zk(z) => z.write(key, &value).await,
        }
    }

    /// Creates `key` (a persistent node) if the system needs it before `write`.
    pub async fn prepare_key(&self, key: &str) -> anyhow::Result<()> {
        match self {
            Sess::Ours(s) => ours::prepare_key(s, key).await,
            Sess::Etcd(_) => Ok(()),
            Sess::Zk(z) => z.prepare_key(key).await,
        }
    }

    /// Ends the session (its locks and ephemerals go at once).
    pub async fn close(self) {
        match self {
            Sess::Ours(s) => {
                let _ = s.close().await;
            }
            Sess::Etcd(e) => e.close().await,
            Sess::Zk(z) => drop(z),
        }
    }

    /// Reads `key` at the servers (ours: a linearizable read, no cache; etcd: a
    /// linearizable range; ZooKeeper: `getData` at the connected member).
    pub async fn read(&self, key: &str) -> anyhow::Result<usize> {
        match self {
            Sess::Ours(s) => Ok(s.get(key).await?.0.len()),
            Sess::Etcd(e) => e.read(key).await,
            Sess::Zk(z) => z.read(key).await,
        }
    }

    /// Reads `key` and leaves a watch on it (ZooKeeper only): what Curator's `NodeCache`
    /// does, a copy kept until the watch fires (or the session breaks), then read again.
    /// Eventually consistent: between a write and its watch event the copy is stale.
    pub async fn read_watched(&self, key: &str) -> anyhow::Result<WatchedValue> {
        match self {
            Sess::Zk(z) => {
                let (len, changed) = z.read_watched(key).await?;
                Ok(WatchedValue {
                    session: self.server_id(),
                    len,
                    changed,
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
            Sess::Etcd(e) => Ok(Sess::Etcd(e.reopen(lease).await?)),
            _ => conn.session(lease).await,
        }
    }

    /// True if the lock `h` is still held: its node or key is still there.
    pub async fn holds(&self, h: &Held) -> anyhow::Result<bool> {
        match (self, h) {
            (Sess::Ours(_), Held::Ours(g)) => Ok(g.may_act()),
            (Sess::Etcd(e), Held::Etcd(key)) => e.holds(key).await,
            (Sess::Zk(z), Held::Zk(node)) => z.holds(node).await,
            _ => Err(anyhow!("lock held through another system")),
        }
    }

    /// The session's id at its server, for the server-side check
    /// ([`crate::server_sessions`]): ours, the session id; etcd, the lease id; ZooKeeper,
    /// the session id.
    pub fn server_id(&self) -> u64 {
        match self {
            Sess::Ours(s) => s.id(),
            Sess::Etcd(e) => e.server_id(),
            Sess::Zk(z) => z.server_id(),
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
            (Sess::Ours(s), _) => {
                s.stop_keepalives();
                Ok(())
            }
            (Sess::Etcd(e), _) => e.end_behind_back(),
            (Sess::Zk(z), Conn::Zk(cluster)) => z.end_behind_back(cluster).await,
            (Sess::Zk(_), _) => anyhow::bail!("a ZooKeeper session needs a ZooKeeper connection"),
        }
    }

    /// How many times this session was resumed after its client gave up on it
    /// (ZooKeeper, [`zk`]; 0 for the others, whose clients do not give up).
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
            Sess::Etcd(e) => e.last_keepalive(),
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
            Sess::Etcd(e) => e.valid(lease),
            Sess::Zk(z) => z.connected(),
        }
    }

    /// True if the session is known to be over: ours, the cell said so (or its grace
    /// period ran out); etcd, the server answered a renewal with TTL 0 or "lease not
    /// found"; ZooKeeper, a server said it expired ([`ZkSess::lost`]).
    pub fn lost(&self) -> bool {
        match self {
            Sess::Ours(s) => s.state() == client_sdk::SessionState::Expired,
            Sess::Etcd(e) => e.lost(),
            Sess::Zk(z) => z.lost(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{open_paced, Pace};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A server that refuses an open while more than `cap` are in flight: the pace backs
    /// off until every item opens, and the results keep their order.
    #[tokio::test]
    async fn paced_opens_back_off_to_what_the_server_takes() {
        let (in_flight, cap) = (AtomicUsize::new(0), 12);
        let pace = Pace::new(100, 30, Duration::from_millis(1));
        let (out, pace) = open_paced(500, pace, |i| {
            let in_flight = &in_flight;
            async move {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::task::yield_now().await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                anyhow::ensure!(now <= cap, "busy: {now} in flight");
                Ok(i)
            }
        })
        .await
        .unwrap();
        assert_eq!(out, (0..500).collect::<Vec<_>>());
        assert!(pace.retries > 0, "{pace:?}");
        assert!(pace.least <= cap, "{pace:?}");
    }

    /// One failure halves the window; clean rounds grow it back, so 2 000 items take
    /// far fewer rounds than at the halved window (40).
    #[tokio::test]
    async fn the_window_grows_back_after_a_failure() {
        let failed_once = std::sync::atomic::AtomicBool::new(false);
        let pace = Pace::new(100, 30, Duration::from_millis(1));
        let (out, pace) = open_paced(2_000, pace, |i| {
            let failed_once = &failed_once;
            async move {
                if i == 0 && !failed_once.swap(true, Ordering::SeqCst) {
                    anyhow::bail!("busy");
                }
                Ok(i)
            }
        })
        .await
        .unwrap();
        assert_eq!(out.len(), 2_000);
        assert_eq!((pace.retries, pace.least), (1, 50), "{pace:?}");
        assert!(pace.rounds < 30, "{pace:?}");
    }

    /// An item that never opens ends the setup after its tries, with its error.
    #[tokio::test]
    async fn an_open_that_always_fails_is_given_up_after_its_tries() {
        let tries = AtomicUsize::new(0);
        let pace = Pace::new(10, 4, Duration::from_millis(1));
        let r = open_paced(20, pace, |i| {
            let tries = &tries;
            async move {
                if i == 7 {
                    tries.fetch_add(1, Ordering::SeqCst);
                    anyhow::bail!("LeaseGrant: no answer within 5s");
                }
                Ok(i)
            }
        })
        .await;
        let e = format!("{:#}", r.expect_err("gave up"));
        assert!(
            e.contains("4 tries")
                && e.contains("14 of 20 open")
                && e.contains("no answer within 5s"),
            "{e}"
        );
        assert_eq!(tries.load(Ordering::SeqCst), 4);
    }
}
