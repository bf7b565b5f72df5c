//! One client session per system, with each system's standard lock recipe:
//!
//! - **ours**: the SDK's `Lock` (ephemeral sequential node; the grant names its
//!   predecessor, a waiter watches only that one; the token is the create index).
//! - **etcd**: `concurrency.Mutex`'s algorithm: a lease kept alive every third of its TTL,
//!   a key `<prefix>/<lease>` created with it, then wait for every key of the prefix with a
//!   lower create revision to be deleted, watching the latest one; the token is the create
//!   revision.
//! - **ZooKeeper**: the lock recipe: an ephemeral sequential child, list the children,
//!   watch the one just below; the token is the node's creation zxid.

use std::time::Duration;

use anyhow::{anyhow, Context};
use client_sdk::{Client, ClientConfig, CreateMode, Lock, LockGuard, Session};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use zookeeper_client as zk;

use crate::cluster::{Cluster, System};

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
    /// etcd: client, lease id, the keep-alive task.
    Etcd(Box<etcd_client::Client>, i64, tokio::task::JoinHandle<()>),
    /// ZooKeeper.
    Zk(zk::Client),
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
            Conn::Etcd(eps) => {
                let mut c = etcd_client::Client::connect(eps.clone(), None).await?;
                let id = c.lease_grant(lease.as_secs() as i64, None).await?.id();
                // Like clientv3's concurrency.Session: keep the lease alive through member
                // failures (re-open the keep-alive stream, possibly at another member) until
                // the lease is over.
                let every = lease / 3;
                let mut kc = c.clone();
                let task = tokio::spawn(async move {
                    let mut last_ok = tokio::time::Instant::now();
                    let mut stream = None;
                    loop {
                        if stream.is_none() {
                            if let Ok(s) = kc.lease_keep_alive(id).await {
                                stream = Some(s);
                            }
                        }
                        let mut renewed = false;
                        if let Some((keeper, replies)) = stream.as_mut() {
                            if keeper.keep_alive().await.is_ok() {
                                match replies.message().await {
                                    Ok(Some(r)) if r.ttl() > 0 => renewed = true,
                                    Ok(Some(_)) => return, // the lease is gone
                                    _ => {}
                                }
                            }
                        }
                        if renewed {
                            last_ok = tokio::time::Instant::now();
                            tokio::time::sleep(every).await;
                        } else {
                            stream = None;
                            if last_ok.elapsed() > lease {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                });
                Ok(Sess::Etcd(Box::new(c), id, task))
            }
            Conn::Zk(cluster) => {
                let c = zk::Client::connector()
                    .session_timeout(lease)
                    .connect(cluster)
                    .await
                    .map_err(|e| anyhow!("zookeeper connect: {e}"))?;
                Ok(Sess::Zk(c))
            }
        }
    }
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
            Sess::Zk(c) => {
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
        match self {
            Sess::Ours(s) => {
                let g = Lock::exclusive(s, dir).acquire().await?;
                let t = g.token();
                Ok((Held::Ours(g), t))
            }
            Sess::Etcd(c, lease, _) => {
                let mut c = (**c).clone();
                let key = format!("{dir}/{lease:x}");
                let txn = Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(
                        key.clone(),
                        "",
                        Some(PutOptions::new().with_lease(*lease)),
                    )])
                    .or_else([TxnOp::get(key.clone(), None)]);
                let r = c.txn(txn).await?;
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
                loop {
                    let opts = GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Descend)
                        .with_max_create_revision(my_rev - 1)
                        .with_limit(1);
                    let g = c.get(format!("{dir}/"), Some(opts)).await?;
                    let Some(kv) = g.kvs().first() else {
                        return Ok((Held::Etcd(key), my_rev as u64));
                    };
                    let waited = kv.key().to_vec();
                    let rev = g.header().context("header")?.revision();
                    let (_w, mut stream) = c
                        .watch(
                            waited,
                            Some(WatchOptions::new().with_start_revision(rev + 1)),
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
            Sess::Zk(c) => {
                let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let prefix = format!("{dir}/lock-");
                let (stat, seq) = c.create(&prefix, b"", &opts).await.map_err(zk_err)?;
                let me = format!("lock-{seq}");
                let node = format!("{dir}/{me}");
                loop {
                    let mut kids = c.list_children(dir).await.map_err(zk_err)?;
                    kids.sort();
                    let i = kids
                        .iter()
                        .position(|k| *k == me)
                        .context("own lock node vanished (session expired?)")?;
                    if i == 0 {
                        return Ok((Held::Zk(node), stat.czxid as u64));
                    }
                    let pred = format!("{dir}/{}", kids[i - 1]);
                    let (st, w) = c.check_and_watch_stat(&pred).await.map_err(zk_err)?;
                    if st.is_some() {
                        w.changed().await;
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
                c.clone().delete(key, None).await?;
                Ok(())
            }
            (Sess::Zk(c), Held::Zk(node)) => c.delete(&node, None).await.map_err(zk_err),
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
                c.clone().put(key, value, None).await?;
                Ok(())
            }
            Sess::Zk(c) => {
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
            Sess::Zk(c) => {
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
            Sess::Etcd(mut c, lease, task) => {
                task.abort();
                let _ = c.lease_revoke(lease).await;
            }
            Sess::Zk(c) => drop(c),
        }
    }

    /// True if the session is known to be over.
    pub fn lost(&self) -> bool {
        match self {
            Sess::Ours(s) => s.state() == client_sdk::SessionState::Expired,
            Sess::Etcd(_, _, task) => task.is_finished(),
            Sess::Zk(c) => matches!(
                c.state(),
                zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
            ),
        }
    }
}
