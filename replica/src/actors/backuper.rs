//! The backuper copies the state to object storage (`crate::backup`): on the leader, when
//! the newest backup of this cell in the store is `backup.interval_secs` old (checked
//! every minute, or every interval if shorter), and whenever an admin asks
//! (`Op::Backup`, `lockctl snapshot save`). One backup at a time; after each, only the
//! newest `backup.keep` of the cell stay in the store.
//!
//! A backup is a copy of the applied state (the state's maps are persistent, so the copy
//! costs the state lock a few pointer copies), serialized on a thread of its own at the
//! lowest CPU and I/O priority, then written with one PUT. It does not touch the log or
//! the replica's own snapshots.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix::{Actor, AsyncContext, Context, Handler, ResponseFuture, WrapFuture};
use wire::error::Error;

use crate::backup::{BackupConfig, Store};
use crate::raft::sm_store::SharedState;
use crate::raft::Raft;

/// What the backuper has done (for metrics and `Status`).
#[derive(Debug, Default)]
pub struct BackupStats {
    /// Backups written since start.
    pub written: AtomicU64,
    /// Backups (and checks of the store) that failed since start.
    pub failed: AtomicU64,
    /// When the newest backup of this cell in the store was taken (Unix seconds; 0 if
    /// none seen yet): what this replica last wrote or, leading, last listed.
    pub newest_unix_secs: AtomicU64,
    /// Size of the last backup this replica wrote.
    pub last_bytes: AtomicU64,
    /// Milliseconds the last backup took (copy, serialize, upload, retention).
    pub last_ms: AtomicU64,
    /// The configured interval, seconds.
    pub interval_secs: AtomicU64,
}

/// A backup written: what `Op::Backup` answers.
#[derive(Debug, Clone)]
pub struct Taken {
    /// The object's name under the store's prefix.
    pub object: String,
    /// The log index it covers.
    pub index: u64,
    /// Its size.
    pub bytes: u64,
    /// The state's digest.
    pub digest: u64,
    /// Milliseconds it took.
    pub total_ms: u64,
    /// Older backups deleted by retention.
    pub pruned: u32,
}

struct Inner {
    id: u64,
    cell: String,
    cfg: BackupConfig,
    store: Store,
    state: SharedState,
    raft: Raft,
    stats: Arc<BackupStats>,
    /// One backup at a time.
    running: tokio::sync::Mutex<()>,
}

/// The backuper actor.
pub struct Backuper {
    inner: Arc<Inner>,
}

impl Backuper {
    /// A backuper for replica `id` of `cell`, writing to `store` as `cfg` says.
    pub fn new(
        id: u64,
        cell: String,
        cfg: BackupConfig,
        store: Store,
        state: SharedState,
        raft: Raft,
        stats: Arc<BackupStats>,
    ) -> Backuper {
        stats
            .interval_secs
            .store(cfg.interval_secs, Ordering::Relaxed);
        Backuper {
            inner: Arc::new(Inner {
                id,
                cell,
                cfg,
                store,
                state,
                raft,
                stats,
                running: tokio::sync::Mutex::new(()),
            }),
        }
    }
}

/// How often the leader looks at the store's newest backup.
fn check_every(interval: Duration) -> Duration {
    interval.clamp(Duration::from_secs(1), Duration::from_secs(60))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Inner {
    fn leading(&self) -> bool {
        self.raft.metrics().borrow().current_leader == Some(self.id)
    }

    /// A scheduled check: on the leader, a backup when the newest is due.
    async fn check(&self) {
        if !self.leading() {
            return;
        }
        let Ok(_one) = self.running.try_lock() else {
            return;
        };
        let newest = match self.store.latest(&self.cell).await {
            Ok(n) => n,
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "backup: the store could not be listed");
                return;
            }
        };
        let newest_ms = newest.map_or(0, |b| b.unix_ms);
        self.stats
            .newest_unix_secs
            .fetch_max(newest_ms / 1000, Ordering::Relaxed);
        let due = newest_ms.saturating_add(self.cfg.interval_secs.saturating_mul(1000));
        if unix_ms() < due || !self.leading() {
            return;
        }
        if let Err(e) = self.write().await {
            tracing::warn!(error = %e, "backup failed; tried again at the next check");
        }
    }

    /// A backup asked for: waits for one under way, then writes one.
    async fn now(&self) -> Result<Taken, Error> {
        let _one = self.running.lock().await;
        // Not `Unavailable`: a client would retry it, writing another object each time.
        self.write()
            .await
            .map_err(|reason| Error::Internal { reason })
    }

    /// Copies, serializes, uploads, prunes. The caller holds `running`.
    async fn write(&self) -> Result<Taken, String> {
        let started = Instant::now();
        let r = self.write_inner(started).await;
        match &r {
            Ok(t) => {
                let st = &self.stats;
                st.written.fetch_add(1, Ordering::Relaxed);
                st.last_bytes.store(t.bytes, Ordering::Relaxed);
                st.last_ms.store(t.total_ms, Ordering::Relaxed);
                tracing::info!(
                    object = %t.object,
                    index = t.index,
                    bytes = t.bytes,
                    ms = t.total_ms,
                    pruned = t.pruned,
                    "backup written"
                );
            }
            Err(_) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        r
    }

    async fn write_inner(&self, started: Instant) -> Result<Taken, String> {
        let copy = self.state.read().expect("state lock").clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("backup-encode".into())
            .spawn(move || {
                crate::actors::snapshotter::lower_priority();
                let _ = tx.send(crate::backup::encode(&copy));
            })
            .map_err(|e| format!("backup: no thread to serialize on: {e}"))?;
        let enc = rx
            .await
            .map_err(|_| "backup: the serializing thread stopped".to_string())??;
        let taken_ms = unix_ms();
        let bytes = enc.bytes.len() as u64;
        let object = self
            .store
            .put(&self.cell, enc.index, taken_ms, enc.bytes)
            .await?;
        self.stats
            .newest_unix_secs
            .fetch_max(taken_ms / 1000, Ordering::Relaxed);
        let pruned = match self.store.prune(&self.cell, self.cfg.keep).await {
            Ok(p) => p.len() as u32,
            Err(e) => {
                // The backup is written; the old ones go at the next.
                tracing::warn!(error = %e, "backup: retention could not delete old backups");
                0
            }
        };
        Ok(Taken {
            object: object.name,
            index: enc.index,
            bytes,
            digest: enc.digest,
            total_ms: started.elapsed().as_millis() as u64,
            pruned,
        })
    }
}

impl Actor for Backuper {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let every = check_every(Duration::from_secs(self.inner.cfg.interval_secs));
        ctx.run_interval(every, |act, ctx| {
            let inner = act.inner.clone();
            ctx.spawn(async move { inner.check().await }.into_actor(act));
        });
    }
}

/// Write a backup now (`Op::Backup`; the gateway checked that this replica leads).
#[derive(actix::Message)]
#[rtype(result = "Result<Taken, Error>")]
pub struct BackupNow;

impl Handler<BackupNow> for Backuper {
    type Result = ResponseFuture<Result<Taken, Error>>;

    fn handle(&mut self, _: BackupNow, _: &mut Context<Self>) -> Self::Result {
        let inner = self.inner.clone();
        Box::pin(async move { inner.now().await })
    }
}
