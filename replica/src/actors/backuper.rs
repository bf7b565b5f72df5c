//! The backuper copies the state to object storage (`crate::backup`): on the leader, when
//! the newest backup of this cell in the store is `backup.interval_secs` old (checked
//! every minute, or every interval if shorter), and whenever an admin asks
//! (`Op::Backup`, `lockctl snapshot save`). One backup at a time; after each, only the
//! newest `backup.keep` of the cell stay in the store.
//!
//! A backup is a copy of the applied state (the state's maps are persistent, so the copy
//! costs the state lock a few pointer copies), then serialized and written (one PUT, or a
//! multipart upload when large) on a thread of its own at the lowest CPU and I/O
//! priority, with a client and runtime of its own. It does not touch the log or the
//! replica's own snapshots.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        let listed = match self.store.list(Some(&self.cell)).await {
            Ok(l) => l,
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "backup: the store could not be listed");
                return;
            }
        };
        let interval_ms = self.cfg.interval_secs.saturating_mul(1000);
        let now = crate::backup::unix_ms_now();
        // The newest taken, leaving out any named more than an interval in the future (a
        // clock that ran ahead, here or on the replica that wrote it): such a name does
        // not hold backups back.
        let newest_ms = crate::backup::newest_taken(&listed, now.saturating_add(interval_ms))
            .map_or(0, |b| b.unix_ms);
        self.stats
            .newest_unix_secs
            .fetch_max(newest_ms / 1000, Ordering::Relaxed);
        let due = now >= newest_ms.saturating_add(interval_ms);
        if !due || !self.leading() {
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
        let (cfg, cell) = (self.cfg.clone(), self.cell.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Serializing, uploading (the S3 client hashes the whole payload to sign it) and
        // pruning all run on a thread of their own at the lowest priority, with a runtime
        // of their own: none of it on the arbiter that runs the replica's actors.
        std::thread::Builder::new()
            .name("backup".into())
            .spawn(move || {
                crate::actors::snapshotter::lower_priority();
                let _ = tx.send(upload(copy, &cfg, cell, started));
            })
            .map_err(|e| format!("backup: no thread to run on: {e}"))?;
        let taken = rx
            .await
            .map_err(|_| "backup: its thread stopped".to_string())??;
        self.stats
            .newest_unix_secs
            .fetch_max(taken.unix_ms / 1000, Ordering::Relaxed);
        Ok(taken.taken)
    }
}

/// A backup written, and when.
struct Uploaded {
    taken: Taken,
    unix_ms: u64,
}

/// Serializes `copy`, writes it to the store as `cell`'s newest backup, and prunes the
/// cell's backups to `cfg.keep` (blocking: runs on the backup's own thread). The store's
/// client is opened here, so its connections (and the TLS and hashing of the upload) live
/// on this thread's runtime, not in a pool shared with the actors' arbiter.
fn upload(
    copy: crate::raft::sm_store::SmState,
    cfg: &BackupConfig,
    cell: String,
    started: Instant,
) -> Result<Uploaded, String> {
    let url = cfg.url.as_deref().ok_or("backup: no store configured")?;
    let store = Store::open(url, &cfg.options)?;
    let keep = cfg.keep;
    let interval_ms = cfg.interval_secs.saturating_mul(1000);
    let enc = crate::backup::encode(&copy)?;
    drop(copy);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("backup: no runtime: {e}"))?;
    rt.block_on(async move {
        let unix_ms = crate::backup::unix_ms_now();
        let bytes = enc.bytes.len() as u64;
        let object = store.put(&cell, enc.index, unix_ms, enc.bytes).await?;
        let future_after = unix_ms.saturating_add(interval_ms);
        let pruned = match store
            .prune(&cell, keep, Some(&object.name), future_after)
            .await
        {
            Ok(p) => p.len() as u32,
            Err(e) => {
                // The backup is written; the old ones go at the next.
                tracing::warn!(error = %e, "backup: retention could not delete old backups");
                0
            }
        };
        Ok(Uploaded {
            taken: Taken {
                object: object.name,
                index: enc.index,
                bytes,
                digest: enc.digest,
                total_ms: started.elapsed().as_millis() as u64,
                pruned,
            },
            unix_ms,
        })
    })
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
