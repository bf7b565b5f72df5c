//! How loadgen talks to etcd, in every scenario: one member at a time, with the settings
//! of etcd's own command-line client, and on to the next member when a request fails.
//!
//! clientv3 3.4 keeps a gRPC connection per member with HTTP/2 keep-alive, and grpc-go
//! marks a member ready only once it has answered the HTTP/2 handshake, so a frozen or
//! killed member is left for the others; applications bound each request with a context
//! deadline. The Rust `etcd-client` balances each request over every endpoint with
//! power-of-two-choices and considers a member whose kernel accepts the TCP connection
//! ready (a SIGSTOPped member's does), so through it alone requests kept going to a
//! frozen member and hung (issue 26: `failover-freeze` had no request timeout, no
//! keep-alive and kept choosing the frozen member). [`EtcdConn`] instead:
//!
//! - talks to one member at a time (starting at the one it is given first);
//! - bounds every unary request by [`crate::systems::request_timeout`] (etcdctl's
//!   `--command-timeout`, 5 s, unless `--request-timeout-secs` says otherwise),
//!   connects within [`DIAL_TIMEOUT`] (`--dial-timeout`) and, while a request or stream
//!   is open on the connection and nothing has arrived for [`KEEPALIVE_TIME`], pings it,
//!   giving it up after [`KEEPALIVE_TIMEOUT`] without an answer (`--keepalive-timeout`;
//!   the interval is above etcd's servers' minimum, not etcdctl's 2 s: see
//!   [`KEEPALIVE_TIME`]);
//! - moves to the next member when a request times out or the member is unreachable,
//!   and tries a read that found its member unreachable again at the next one within
//!   the same deadline (clientv3 repeats an immutable request on `Unavailable`);
//! - takes a member only once it accepts a TCP connection, so a killed member is
//!   skipped as grpc-go skips a member whose connection is down ([`EtcdConn::client`]).
//!
//! This is loadgen's own policy, close to clientv3's but not the same: clientv3 3.4
//! spreads requests round-robin over every member that is ready, and a member that was
//! connected when it froze stays ready until its keep-alive ping fails (etcdctl's 2 s +
//! 6 s; with clientv3's default, no keep-alive, until it resumes), so some requests still
//! go to it for that long; loadgen uses one member per connection
//! (connections start at different members, so the load is spread) and leaves a member
//! at the first timeout.
//!
//! Streams (watches, lease keep-alives) carry no request timeout, as in clientv3; the
//! keep-alive pings find a silent member under them. A client's lock waits share one
//! watch stream ([`EtcdConn::wait_deleted`]), as clientv3's watches do.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::anyhow;

/// etcdctl's `--dial-timeout` default.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings go out after this long without anything arriving, and only while a
/// request or stream is open. etcd's servers send a client that pings more often than
/// `--grpc-keepalive-min-time` (5 s by default), or at all without an open stream, away
/// with GOAWAY `ENHANCE_YOUR_CALM` ("too_many_pings"), which ends every request and
/// stream on the connection. etcdctl's `--keepalive-time` is 2 s, but grpc-go doubles its
/// interval each time a server says so, and hyper does not: with 2 s a quiet watch was
/// cut within 20 s (`a_quiet_connection_is_not_sent_away_for_its_pings`). Against etcd's
/// default grpc-go's doubling settles at 8 s (2, 4, 8); 10 s keeps well above the
/// minimum from the start. (It is not enough to keep etcd's killed-leader `profile` runs
/// from falling behind: they do with this setting too.)
pub const KEEPALIVE_TIME: Duration = Duration::from_secs(10);
/// etcdctl's `--keepalive-timeout` default: a connection whose ping is not answered
/// within this is closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(6);

/// The HTTP/2 channel of every etcd client of loadgen that carries load: the settings of
/// [`options`], and no limit on the streams the library itself resets.
///
/// h2 (under tonic and hyper) forgets a stream it cancelled (a request given up at its
/// deadline, a lock wait dropped) after 1 s, and remembers at most 50 such; a reply that
/// arrives later for a forgotten stream is answered with a reset of its own making, and
/// those are counted per connection, never decremented. At 1 024 (h2's
/// `max_local_error_reset_streams` default, a guard against a misbehaving server) h2 sends
/// the server GOAWAY `ENHANCE_YOUR_CALM` ("too_many_internal_resets") and every request on
/// the connection fails with `ResourceExhausted`: under load and after a leader change
/// loadgen's clients tore their own connections down this way (issue 26,
/// `docs/bench/i26/b71ef466/h2-diag-profile-kill-etcd/`). grpc-go, under clientv3, has no
/// such limit: so none here. Built here because etcd-client's own `Client::connect` does
/// not expose the setting.
pub fn endpoint(ep: &str) -> anyhow::Result<tonic::transport::Endpoint> {
    let url = if ep.starts_with("http://") || ep.starts_with("https://") {
        ep.to_string()
    } else {
        format!("http://{ep}")
    };
    Ok(tonic::transport::Endpoint::from_shared(url)?
        .connect_timeout(DIAL_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_TIME)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(false)
        .http2_max_local_error_reset_streams(None))
}

/// A client of the one member `ep` over [`endpoint`]'s channel, set up as etcd-client's
/// own `Client::connect` sets up its channel (a balanced channel of the one endpoint,
/// which connects on the first request): an unreachable member fails that request, so
/// the caller moves on ([`EtcdConn::attempts`]).
pub async fn connect(ep: &str) -> anyhow::Result<etcd_client::Client> {
    let endpoint = endpoint(ep)?;
    let (channel, tx) = tonic::transport::Channel::balance_channel(64);
    tx.send(tonic::transport::channel::Change::Insert(
        endpoint.uri().clone(),
        endpoint,
    ))
    .await
    .map_err(|_| anyhow::anyhow!("the channel to {ep} is gone"))?;
    Ok(etcd_client::Client::from_channel(etcd_client::Channel::Tonic(channel), None).await?)
}

/// The connection options of loadgen's other etcd clients (setting up, looking up the
/// leader, checking leases at the end): the same as [`endpoint`]'s but for the reset
/// limit, which their few requests never reach.
pub fn options() -> etcd_client::ConnectOptions {
    etcd_client::ConnectOptions::new()
        .with_connect_timeout(DIAL_TIMEOUT)
        .with_keep_alive(KEEPALIVE_TIME, KEEPALIVE_TIMEOUT)
        // No pings without an open request or stream: clientv3's `PermitWithoutStream`
        // is false by default, and etcd's servers refuse such pings.
        .with_keep_alive_while_idle(false)
}

/// Times an etcd client of this process moved on to another member ([`EtcdConn::failed`]):
/// each opens one connection more (`acquire` reports it beside the connections counted).
pub static MOVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A client of one etcd member at a time, moving on after a failure (see the module).
pub struct EtcdConn {
    eps: Vec<String>,
    /// The member in use (an index into `eps`, growing: taken modulo) and its client.
    cur: Mutex<(usize, Option<etcd_client::Client>)>,
    /// This client's one watch stream, shared by all its lock waits.
    watches: super::etcd_watches::WatchMux,
}

impl EtcdConn {
    /// A connection to `eps`, starting at the first.
    pub fn new(eps: Vec<String>) -> EtcdConn {
        assert!(!eps.is_empty(), "etcd needs an endpoint");
        EtcdConn {
            eps,
            cur: Mutex::new((0, None)),
            watches: Default::default(),
        }
    }

    /// Waits until `key` is deleted at a revision from `from_rev` on, over this client's
    /// one watch stream ([`super::etcd_watches`]).
    pub async fn wait_deleted(&self, key: Vec<u8>, from_rev: i64) -> anyhow::Result<()> {
        self.watches
            .wait_deleted(key, from_rev, |key, opts| {
                self.call(
                    "Watch",
                    |mut c| async move { c.watch(key, Some(opts)).await },
                )
            })
            .await
    }

    /// The client of the member in use, and its turn (for [`EtcdConn::failed`]).
    ///
    /// After a move (a failure at the member before), a member is taken only once it
    /// accepts a TCP connection, as grpc-go uses only a member whose connection is up: a
    /// killed member refuses at once and is skipped. The Rust client's channel connects
    /// lazily, so a connection that moved on from a busy member (a timeout) could land on
    /// the dead one and fail the next request there ("tcp connect error") before moving on
    /// again. A frozen member's kernel still accepts: it is left when a request times out
    /// there. The first member is taken as given (a failed request moves on from it), so
    /// a client opens one connection, not a probe and a connection.
    pub async fn client(&self) -> anyhow::Result<(etcd_client::Client, usize)> {
        let current = || {
            let cur = self.cur.lock().expect("etcd conn");
            (cur.1.clone(), cur.0)
        };
        let (mut turn, n) = match current() {
            (Some(c), turn) => return Ok((c, turn)),
            (None, turn) => (turn, self.eps.len()),
        };
        // At most one round: if no member accepts, the last one is used and its
        // requests fail at their deadline.
        for _ in 1..n {
            if turn == 0 || accepts(&self.eps[turn % n]).await {
                break;
            }
            self.failed(turn);
            turn = match current() {
                (Some(c), turn) => return Ok((c, turn)),
                (None, turn) => turn,
            };
        }
        let ep = self.eps[turn % n].clone();
        let c = connect(&ep).await?;
        let mut cur = self.cur.lock().expect("etcd conn");
        if cur.0 == turn && cur.1.is_none() {
            cur.1 = Some(c.clone());
        }
        Ok((c, turn))
    }

    /// The member of `turn` failed: the next request goes to the next member (unless
    /// another request already moved on).
    pub fn failed(&self, turn: usize) {
        let mut cur = self.cur.lock().expect("etcd conn");
        if cur.0 == turn {
            cur.0 += 1;
            cur.1 = None;
            MOVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// One unary request, bounded by [`crate::systems::request_timeout`]; a timeout or an unreachable
    /// member moves the connection on. Not retried (a write: the caller decides).
    pub async fn call<T, F, Fut>(&self, what: &str, f: F) -> anyhow::Result<T>
    where
        F: FnOnce(etcd_client::Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut f = Some(f);
        self.attempts(what, 1, move |c| (f.take().expect("one attempt"))(c))
            .await
    }

    /// A read (`Range`): as [`EtcdConn::call`], but one that found its member
    /// unreachable is tried again at the next member within the same deadline, as
    /// clientv3's retry interceptor repeats an immutable request on `Unavailable`.
    pub async fn read<T, F, Fut>(&self, f: F) -> anyhow::Result<T>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.attempts("Range", self.eps.len().max(1), f).await
    }

    async fn attempts<T, F, Fut>(&self, what: &str, tries: usize, mut f: F) -> anyhow::Result<T>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let timeout = crate::systems::request_timeout();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = None;
        for _ in 0..tries {
            let (c, turn) = self.client().await?;
            match tokio::time::timeout_at(deadline, f(c)).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => {
                    if !unreachable(&e) {
                        return Err(anyhow!("etcd {what}: {e}"));
                    }
                    self.failed(turn);
                    last = Some(e);
                }
                Err(_) => {
                    self.failed(turn);
                    return Err(anyhow!("etcd {what}: no answer within {timeout:?}"));
                }
            }
        }
        Err(anyhow!(
            "etcd {what}: {}",
            last.map_or("no member".to_string(), |e| e.to_string())
        ))
    }
}

/// Whether the member at `ep` (`host:port`, or a URL) accepts a TCP connection within
/// [`DIAL_TIMEOUT`].
async fn accepts(ep: &str) -> bool {
    let addr = ep
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    matches!(
        tokio::time::timeout(DIAL_TIMEOUT, tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// True if `e` says the member could not be reached or could not serve (rather than
/// answering the request with an error of its own, such as "lease not found").
pub fn unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Cluster, System};

    /// One etcd member started for a test, or `None` (with a note) when etcd is not
    /// installed.
    async fn one_etcd() -> Option<Cluster> {
        if std::process::Command::new("etcd")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("SKIPPED: etcd is not installed (apt-get install -y etcd-server)");
            return None;
        }
        let cluster =
            tokio::task::block_in_place(|| Cluster::start(System::Etcd, 1, 0, 12_000, None))
                .expect("start etcd");
        cluster.ready().await.expect("etcd ready");
        Some(cluster)
    }

    /// A member that is down (its port refuses connections) is skipped before a request is
    /// sent to it: a connection that moves on (as after a timeout) past the member it was
    /// on to a dead one goes on to the next, where a write (one attempt, not retried, as
    /// every unary request but a read) succeeds. Without the check the write went to the
    /// dead member and failed (and only the next request moved on), so after a leader
    /// kill every connection that moved onto the dead member failed a request more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_that_refuses_connections_is_skipped() {
        let Some(cluster) = one_etcd().await else {
            return;
        };
        // A port nothing listens on any more: connections to it are refused.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .to_string();
        let up = cluster.endpoints[0].clone();
        let conn = EtcdConn::new(vec![up.clone(), dead, up]);
        // Its first member is taken as given; a timeout there moves it on.
        let (_, first) = conn.client().await.expect("client");
        assert_eq!(first, 0);
        conn.failed(first);
        let t = std::time::Instant::now();
        conn.call("Put", |mut c| async move { c.put("k", "v", None).await })
            .await
            .expect("the write goes to the member that is up");
        let took = t.elapsed();
        assert!(took < Duration::from_secs(2), "the write took {took:?}");
        // And the connection stays with the member that answered.
        let (_, turn) = conn.client().await.expect("client");
        assert_eq!(turn % 3, 2);
    }

    /// etcd's servers enforce a keep-alive policy (`--grpc-keepalive-min-time`, 5 s by
    /// default, and no pings on a connection without a stream): a client that pings more
    /// often is sent away with GOAWAY `ENHANCE_YOUR_CALM` ("too_many_pings"), which ends
    /// every stream and request on the connection (tonic reports `ResourceExhausted`).
    /// A quiet connection with an open watch (a client's lock waits share one) pings
    /// every keep-alive interval, so held 20 s its watch must still be open and deliver
    /// the event of a later write. With etcdctl's 2 s interval (grpc-go backs off when
    /// told; hyper does not) the stream was cut before the write ("error reading a body
    /// from connection").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quiet_connection_is_not_sent_away_for_its_pings() {
        let Some(cluster) = one_etcd().await else {
            return;
        };
        let ep = cluster.endpoints[0].clone();
        let mut c = connect(&ep).await.expect("connect");
        let mut events = c.watch("quiet", None).await.expect("watch");
        tokio::time::sleep(Duration::from_secs(20)).await;
        let mut writer = c.clone();
        tokio::spawn(async move { writer.put("quiet", "v", None).await });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match tokio::time::timeout_at(deadline, events.message()).await {
                Ok(Ok(Some(r))) if !r.events().is_empty() => break,
                Ok(Ok(Some(_))) => continue,
                other => panic!("the quiet watch did not deliver the write: {other:?}"),
            }
        }
    }

    /// Requests given up before their answers arrive (at a deadline, or a lock wait
    /// dropped) must not make the client close its own connection. Each round sends 1 000
    /// reads of a 64 KiB value at once on one connection and drops them after 50 ms, so
    /// their answers arrive for streams already reset, most of them no longer remembered
    /// (h2 keeps 50); with h2's default limit the connection was torn down after 1 024 such
    /// answers (within the first four rounds here) and the read after it failed with
    /// `ResourceExhausted` ("too_many_internal_resets") or "connection closed". Every read
    /// after a round must succeed on the same client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_to_abandoned_requests_do_not_close_the_connection() {
        let Some(cluster) = one_etcd().await else {
            return;
        };
        let c = connect(&cluster.endpoints[0]).await.expect("connect");
        c.clone()
            .put("big", vec![b'x'; 64 << 10], None)
            .await
            .expect("put");
        for round in 0..10 {
            let reads = (0..1_000).map(|_| {
                let mut c = c.clone();
                async move { c.get("big", None).await }
            });
            let _ =
                tokio::time::timeout(Duration::from_millis(50), futures::future::join_all(reads))
                    .await;
            // The late answers arrive while this read is on its way.
            let r = tokio::time::timeout(Duration::from_secs(5), c.clone().get("big", None))
                .await
                .unwrap_or_else(|_| panic!("round {round}: no answer within 5 s"));
            if let Err(e) = r {
                panic!("round {round}: a read after abandoned ones failed: {e}");
            }
        }
    }
}
