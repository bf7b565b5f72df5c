//! ZooKeeper: the lock recipe of its documentation on a session kept the way ZooKeeper's
//! Java client keeps one, and the client's settings ([`zk_connector`]).
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

use anyhow::{anyhow, Context};
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

impl ZkSess {
    /// Opens a session on the ensemble `cluster` (`host:port,...`) with a timeout of
    /// `lease`.
    pub(super) async fn open(cluster: &str, lease: Duration) -> anyhow::Result<ZkSess> {
        let c = zk_connector(lease)
            .connect(cluster)
            .await
            .map_err(|e| anyhow!("zookeeper connect: {e}"))?;
        Ok(ZkSess::new(c, cluster.to_string()))
    }

    /// Creates every node of `dir` that is missing.
    pub(super) async fn ensure_dir(&self, dir: &str) -> anyhow::Result<()> {
        let c = self.client();
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

    /// Takes the lock `dir` (`again`: after a failed attempt of this session, see
    /// [`super::Sess::acquire_again`]): its node and fencing token (the node's creation
    /// zxid).
    pub(super) async fn acquire(&self, dir: &str, again: bool) -> anyhow::Result<(String, u64)> {
        let z = self;
        // The children are `<session id>-lock-<sequence>` (the session id is what
        // Curator's protected mode puts a GUID for), ordered by their sequence.
        let mine = format!("{:016x}-lock-", z.server_id());
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
                let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
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
            Ok(token) => Ok((node, token)),
            Err(e) => {
                z.delete_when_connected(&node).await;
                Err(e)
            }
        }
    }

    /// Deletes the lock's node; one already gone is released (as Curator's release
    /// ignores NoNode): a delete retried after its answer was lost, or a session that
    /// ended.
    pub(super) async fn release(&self, node: &str) -> anyhow::Result<()> {
        match self.client().delete(node, None).await {
            Ok(()) | Err(zk::Error::NoNode) => Ok(()),
            Err(e) => Err(zk_err(e)),
        }
    }

    /// Sets `key`'s data.
    pub(super) async fn write(&self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        self.client()
            .set_data(key, value, None)
            .await
            .map_err(zk_err)?;
        Ok(())
    }

    /// Creates the persistent node `key` unless it exists.
    pub(super) async fn prepare_key(&self, key: &str) -> anyhow::Result<()> {
        let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match self.client().create(key, b"", &opts).await {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(e) => Err(zk_err(e)),
        }
    }

    /// `getData` of `key` at the connected member: the value's length.
    pub(super) async fn read(&self, key: &str) -> anyhow::Result<usize> {
        Ok(self.client().get_data(key).await.map_err(zk_err)?.0.len())
    }

    /// `getData` of `key` with a watch: the value's length, and a future that ends when
    /// the watch fires (or the session breaks).
    pub(super) async fn read_watched(
        &self,
        key: &str,
    ) -> anyhow::Result<(
        usize,
        std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    )> {
        let (data, _, w) = self
            .client()
            .get_and_watch_data(key)
            .await
            .map_err(zk_err)?;
        Ok((
            data.len(),
            Box::pin(async move {
                w.changed().await;
            }),
        ))
    }

    /// True while the lock's node is there.
    pub(super) async fn holds(&self, node: &str) -> anyhow::Result<bool> {
        Ok(self
            .client()
            .check_stat(node)
            .await
            .map_err(zk_err)?
            .is_some())
    }

    /// The session id.
    pub(super) fn server_id(&self) -> u64 {
        self.client().session_id().0 as u64
    }

    /// True while the client is connected (not the Java client's Disconnected, Curator's
    /// SUSPENDED).
    pub(super) fn connected(&self) -> bool {
        matches!(
            self.client().state(),
            zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly
        )
    }

    /// Test hook: a second client takes the session over (its id and password) and
    /// closes it. Not detached: dropping the other client closes the session. Until the
    /// close is applied, this session's client (or its resumer) may reconnect and take the
    /// session back (the close then fails as "session moved"), so this waits for a server
    /// to say the session is over, and tries again if none does.
    pub(super) async fn end_behind_back(&self, cluster: &str) -> anyhow::Result<()> {
        for _ in 0..3 {
            let c = self.client();
            let other = zk_connector(c.session_timeout())
                .session(c.session().clone())
                .connect(cluster)
                .await
                .map_err(|e| anyhow!("zookeeper connect as session {}: {e}", c.session_id()))?;
            drop(other);
            drop(c);
            for _ in 0..200 {
                if self.lost() {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        anyhow::bail!(
            "ZooKeeper session {} did not end",
            self.client().session_id()
        );
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

/// Ephemeral ports this host gives outgoing TCP connections: `ip_local_port_range` less
/// the `ip_local_reserved_ports` within it (`None` if `/proc` cannot be read).
pub fn ephemeral_ports() -> Option<usize> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let reserved =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_reserved_ports").unwrap_or_default();
    ephemeral_ports_of(&range, &reserved)
}

/// [`ephemeral_ports`] from the two files' text: "32768\t60999" and "20000-27999,30000".
fn ephemeral_ports_of(range: &str, reserved: &str) -> Option<usize> {
    let mut it = range.split_whitespace().map(|p| p.parse::<u32>());
    let (lo, hi) = (it.next()?.ok()?, it.next()?.ok()?);
    let mut free = (hi.checked_sub(lo)? + 1) as usize;
    for part in reserved.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?),
            None => {
                let p = part.trim().parse::<u32>().ok()?;
                (p, p)
            }
        };
        let (a, b) = (a.max(lo), b.min(hi));
        if a <= b {
            free = free.saturating_sub((b - a + 1) as usize);
        }
    }
    Some(free)
}

/// A warning for a ZooKeeper run of `sessions` sessions (a TCP connection each, all from
/// this host) that would use more than 80 % of the host's ephemeral ports: near
/// exhaustion each `connect` searches the port range for a free one, and the setup
/// slowed with it (2026-12-03: with 28 232 ports, session opens fell from ~800 to ~150 a
/// second past 28 000 sessions, though the servers were falling behind too), so the run
/// may measure the client host as much as ZooKeeper. 50 000 real clients would come from
/// many hosts. Printed and kept in the report's notes; the run goes on.
pub fn ephemeral_port_warning(sessions: usize) -> Option<String> {
    let ports = ephemeral_ports()?;
    (sessions * 5 > ports * 4).then(|| {
        format!(
            "{sessions} ZooKeeper sessions are {sessions} TCP connections from this host, \
             which has {ports} ephemeral ports (net.ipv4.ip_local_port_range less \
             ip_local_reserved_ports); near exhaustion every connect searches the range for \
             a free port. To widen them, keeping loadgen's server ports (20000-32099) \
             reserved: sysctl -w net.ipv4.ip_local_port_range='1024 65535' \
             net.ipv4.ip_local_reserved_ports=20000-32099"
        )
    })
}

pub(crate) fn zk_err(e: zk::Error) -> anyhow::Error {
    anyhow!("zookeeper: {e}")
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
        // As the Java client, until a server answers: the session is reached through a
        // member that answers `srvr` within the session timeout over the number of
        // members (the Java client's connect timeout; a frozen member is passed over,
        // where this crate's one connection timeout, 3/5 T, would be spent on it). A
        // detached client touches the session there (its timeout at the server starts
        // again) and lets go without closing it; then the session's client connects
        // through the whole ensemble, so it can move between members later as the first
        // could, with the touch's fresh timeout to find a member in.
        let members: Vec<&str> = cluster.split(',').collect();
        let answer = timeout / members.len().max(1) as u32;
        loop {
            if Instant::now() >= give_up {
                tracing::warn!(session = %info.id(), "gave up resuming: no member answered");
                over.store(true, Ordering::SeqCst);
                return;
            }
            if let Some(m) = serving_member(&members, answer).await {
                let touched = zk_connector(timeout)
                    .detached()
                    .session(info.clone())
                    .connect(&m)
                    .await;
                let resumed_client = match touched {
                    Ok(touch) => {
                        drop(touch);
                        zk_connector(timeout)
                            .session(info.clone())
                            .connect(&cluster)
                            .await
                    }
                    Err(e) => Err(e),
                };
                match resumed_client {
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

/// A member of `members` that serves (answers `srvr` with its mode within `answer`),
/// asked at most once a second for the whole process: many sessions resuming at once
/// share one round of probes instead of each making its own.
async fn serving_member(members: &[&str], answer: Duration) -> Option<String> {
    static LAST: tokio::sync::Mutex<Option<(Instant, Option<String>)>> =
        tokio::sync::Mutex::const_new(None);
    let mut last = LAST.lock().await;
    if let Some((at, m)) = last.as_ref() {
        if at.elapsed() < Duration::from_secs(1)
            && m.as_deref().is_none_or(|m| members.contains(&m))
        {
            return m.clone();
        }
    }
    // From a random member on, as the Java client shuffles its list.
    let at = rand::random::<u64>() as usize % members.len().max(1);
    let mut serving = None;
    for m in members[at..].iter().chain(&members[..at]) {
        if crate::cluster::four_letter_within(m, "srvr", answer)
            .await
            .is_some_and(|s| s.contains("Mode: "))
        {
            serving = Some(m.to_string());
            break;
        }
    }
    *last = Some((Instant::now(), serving.clone()));
    serving
}

#[cfg(test)]
mod port_tests {
    use super::ephemeral_ports_of;

    #[test]
    fn ephemeral_ports_are_the_range_less_what_is_reserved_in_it() {
        assert_eq!(ephemeral_ports_of("32768\t60999\n", "\n"), Some(28_232));
        assert_eq!(
            ephemeral_ports_of("1024\t65535\n", "20000-27999\n"),
            Some(64_512 - 8_000)
        );
        // Reserved ports outside the range do not count; single ports do.
        assert_eq!(
            ephemeral_ports_of("32768 60999", "1000-2000,40000"),
            Some(28_231)
        );
        assert_eq!(ephemeral_ports_of("garbage", ""), None);
    }
}
