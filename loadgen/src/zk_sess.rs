//! A ZooKeeper session kept the way ZooKeeper's Java client keeps one.
//!
//! `zookeeper-client` (Rust) declares a session expired itself 7/5 of its timeout after it
//! last heard a server, and stops reconnecting. The Java client never does that: it keeps
//! reconnecting with the session's id and password until a server answers, and only a
//! server says that a session expired. A new leader gives every session a fresh timeout,
//! so an election that outlasts the Rust client's patience (a frozen leader:
//! `failover-freeze`) would end, in loadgen, sessions the cell still holds.
//!
//! [`ZkSess`] watches its client. When the client gives up, it connects again with the
//! session's id and password, as the Java client would (once a member serves), until a
//! server answers: with the
//! session (resumed: the same session, with its ephemeral nodes; watches left on the old
//! client fire with its end, and a recipe re-reads) or with "session expired" (lost).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client as zk;

/// One ZooKeeper session, resumed through a new client if its client gives up on it.
pub struct ZkSess {
    current: Arc<RwLock<zk::Client>>,
    /// Set once a server said the session is over (or nobody answered for long).
    over: Arc<AtomicBool>,
    resumed: Arc<AtomicU64>,
    resumer: tokio::task::JoinHandle<()>,
}

/// How long the resumer keeps trying without any server answering, in session timeouts
/// (about: a connect under way is not cut short).
const PATIENCE_TIMEOUTS: u32 = 5;

impl ZkSess {
    /// Keeps the session of `client`, a client of the ensemble `cluster`
    /// (`host:port,...`).
    pub fn new(client: zk::Client, cluster: String) -> Self {
        let current = Arc::new(RwLock::new(client));
        let over = Arc::new(AtomicBool::new(false));
        let resumed = Arc::new(AtomicU64::new(0));
        let resumer = tokio::spawn(resume(
            Arc::downgrade(&current),
            cluster,
            over.clone(),
            resumed.clone(),
        ));
        ZkSess {
            current,
            over,
            resumed,
            resumer,
        }
    }

    /// The session's client now (a new one after a resume).
    pub fn client(&self) -> zk::Client {
        self.current.read().expect("zk client").clone()
    }

    /// How many times the session was resumed after its client gave up on it.
    pub fn resumed(&self) -> u64 {
        self.resumed.load(Ordering::SeqCst)
    }

    /// True once the session is known to be over: a server said it expired (or nobody
    /// answered for [`PATIENCE_TIMEOUTS`] timeouts), or it was closed. A client that gave
    /// up while the resume is still trying is not over (the Java client's Disconnected).
    pub fn lost(&self) -> bool {
        self.over.load(Ordering::SeqCst)
            || matches!(
                self.client().state(),
                zk::SessionState::Closed | zk::SessionState::AuthFailed
            )
    }
}

impl ZkSess {
    /// Deletes `node` (a lock node of this session) once the session can: through the
    /// session's client now, tried again while a resume may be under way, for at most two
    /// session timeouts; nothing to do once the session is over (its ephemeral nodes went
    /// with it) or the node is gone.
    pub async fn delete_when_connected(&self, node: &str) {
        let give_up = Instant::now() + self.client().session_timeout() * 2;
        while Instant::now() < give_up && !self.lost() {
            match self.client().delete(node, None).await {
                Ok(()) | Err(zk::Error::NoNode) => return,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

impl Drop for ZkSess {
    fn drop(&mut self) {
        // Dropping the last client closes the session; the resumer holds none.
        self.resumer.abort();
    }
}

async fn resume(
    current: Weak<RwLock<zk::Client>>,
    cluster: String,
    over: Arc<AtomicBool>,
    resumed: Arc<AtomicU64>,
) {
    loop {
        // Hold no client while waiting: a client kept here would keep the session open
        // after its owner closed it.
        let (mut states, info, timeout) = {
            let Some(cur) = current.upgrade() else { return };
            let c = cur.read().expect("zk client").clone();
            (c.state_watcher(), c.session().clone(), c.session_timeout())
        };
        loop {
            match states.state() {
                zk::SessionState::Expired => break,
                zk::SessionState::Closed | zk::SessionState::AuthFailed => return,
                _ => {}
            }
            states.changed().await;
        }
        let give_up = Instant::now() + timeout * PATIENCE_TIMEOUTS;
        // As the Java client, until a server answers: wait for a member to serve (each
        // given the session timeout over the number of members to answer `srvr`, the Java
        // client's connect timeout; a frozen member is passed over), then connect with the
        // whole ensemble, so the resumed client can move between members later as the
        // first could. The crate's one connection timeout (3/5 T, see
        // [`crate::systems::zk_connector`]) also bounds a try at a member that froze in
        // between, where the Java client's is T/n.
        let members: Vec<&str> = cluster.split(',').collect();
        let answer = timeout / members.len().max(1) as u32;
        loop {
            if Instant::now() >= give_up {
                tracing::warn!(session = %info.id(), "gave up resuming: no member answered");
                over.store(true, Ordering::SeqCst);
                return;
            }
            let mut serving = false;
            for m in &members {
                if crate::cluster::four_letter_within(m, "srvr", answer)
                    .await
                    .is_some_and(|s| s.contains("Mode: "))
                {
                    serving = true;
                    break;
                }
            }
            if serving {
                match crate::systems::zk_connector(timeout)
                    .session(info.clone())
                    .connect(&cluster)
                    .await
                {
                    Ok(c) => {
                        let Some(cur) = current.upgrade() else { return };
                        *cur.write().expect("zk client") = c;
                        resumed.fetch_add(1, Ordering::SeqCst);
                        tracing::info!(session = %info.id(), "resumed a ZooKeeper session its client gave up");
                        break;
                    }
                    Err(zk::Error::SessionExpired) => {
                        over.store(true, Ordering::SeqCst);
                        return;
                    }
                    Err(e) => tracing::debug!(session = %info.id(), "resume: {e}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(500 + rand::random::<u64>() % 500)).await;
        }
    }
}
