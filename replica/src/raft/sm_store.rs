//! openraft's state-machine side: the in-memory [`StateMachine`] plus snapshots.
//!
//! Applying publishes each batch's [`Effect`]s on a channel (never awaiting an actor and
//! never calling back into Raft). Snapshots are serialized here and written to disk by the
//! snapshotter actor (or directly, when no actor system runs, as in storage tests).

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use futures::TryStreamExt;
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use wire::command::{Command, CommandOutput, Effect};
use wire::raft::{LeaderId, LogId, NodeId, SnapshotMeta, StoredMembership, TypeConfig};
use wire::types::Reply;

use crate::raft::snapshot_file;
use crate::state_machine::StateMachine;

/// Everything a snapshot holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SmState {
    /// Last log id applied.
    pub last_applied: Option<LogId>,
    /// Last membership applied.
    pub membership: StoredMembership,
    /// The namespace and sessions.
    pub sm: StateMachine,
}

/// The state shared with readers (gateway, session manager).
pub type SharedState = Arc<RwLock<SmState>>;

/// A snapshot's data as openraft hands it between the state machine and the network
/// (`RaftStateMachine::SnapshotData`, openraft 0.10): the serialized state, and our id of
/// the snapshot, which 0.9 kept in openraft's metadata and 0.10 does not (the id names a
/// restored backup's snapshot, `snapshot_file::SEEDED_ID_PREFIX`, and travels to the
/// followers a leader sends it to, as it did).
#[derive(Debug)]
pub struct SnapshotData {
    /// Our id of the snapshot.
    pub id: String,
    /// The serialized state ([`SmState`], postcard).
    pub data: Cursor<Vec<u8>>,
}

/// A snapshot: openraft's metadata and [`SnapshotData`].
pub type Snapshot = openraft::Snapshot<LeaderId, NodeId, wire::raft::Member, SnapshotData>;

/// What one applied batch changed.
#[derive(Debug, Clone)]
pub enum Applied {
    /// Effects of the entry at `index`.
    Effects {
        /// The entry's log index.
        index: u64,
        /// What it changed.
        effects: Vec<Effect>,
    },
    /// The whole state was replaced by an installed snapshot.
    SnapshotInstalled {
        /// The snapshot's last index.
        index: u64,
    },
}

/// Where built or received snapshots are persisted.
#[derive(Clone)]
pub enum SnapshotSink {
    /// Serialize and write the file from the calling task (tests, the simulation).
    Direct(PathBuf),
    /// Ask the actors that handle [`EncodeSnapshot`] (the snapshot encoder, on its own
    /// thread at low CPU priority) and [`WriteSnapshot`] (the snapshotter, on another, at
    /// the replica's priority, so a received snapshot is never written behind a build).
    Actor {
        /// Writes snapshot files, built and received.
        write: actix::Recipient<WriteSnapshot>,
        /// Serializes built snapshots.
        encode: actix::Recipient<EncodeSnapshot>,
    },
}

/// Serialize a copy of the state for a snapshot (what a snapshot build asks
/// [`SnapshotSink::Actor`]): answers the bytes and the milliseconds spent serializing.
#[derive(actix::Message)]
#[rtype(result = "Result<(Vec<u8>, u64), String>")]
pub struct EncodeSnapshot {
    /// The copy.
    pub state: SmState,
    /// `faults.snapshot_build_delay_ms` (tests).
    pub delay: std::time::Duration,
}

impl EncodeSnapshot {
    /// Does what it asks, on the calling thread.
    pub fn run(self) -> Result<(Vec<u8>, u64), String> {
        let started = std::time::Instant::now();
        let data = encode(&self.state, self.delay).map_err(|e| e.to_string())?;
        Ok((data, started.elapsed().as_millis() as u64))
    }
}

/// Write one snapshot (what [`SnapshotSink::Actor`] asks); answers its data back.
#[derive(actix::Message)]
#[rtype(result = "Result<Vec<u8>, String>")]
pub struct WriteSnapshot {
    /// Its metadata.
    pub meta: SnapshotMeta,
    /// Our id of it.
    pub id: String,
    /// The serialized state.
    pub data: Vec<u8>,
}

impl SnapshotSink {
    /// Writes the snapshot file; gives `data` back.
    async fn write(
        &self,
        meta: &SnapshotMeta,
        id: &str,
        data: Vec<u8>,
    ) -> Result<Vec<u8>, std::io::Error> {
        let r = match self {
            SnapshotSink::Direct(dir) => snapshot_file::write(dir, meta, id, &data)
                .map(|_| data)
                .map_err(|e| e.to_string()),
            SnapshotSink::Actor { write, .. } => write
                .send(WriteSnapshot {
                    meta: meta.clone(),
                    id: id.to_string(),
                    data,
                })
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r),
        };
        r.map_err(|e| std::io::Error::other(format!("writing snapshot {id}: {e}")))
    }
}

/// What the last snapshot this replica built cost (for `Status` and `Op::Snapshot`).
#[derive(Debug, Default)]
pub struct SnapshotStats {
    /// Snapshots built since start.
    pub built: AtomicU64,
    /// Log index the last one covers.
    pub last_index: AtomicU64,
    /// Its size in bytes.
    pub last_bytes: AtomicU64,
    /// Milliseconds to serialize the state's copy (without the state's lock; taking the
    /// copy is a few pointer copies).
    pub last_serialize_ms: AtomicU64,
    /// Milliseconds to serialize and write it durably.
    pub last_total_ms: AtomicU64,
}

/// The openraft state machine.
pub struct SmStore {
    state: SharedState,
    dir: PathBuf,
    sink: SnapshotSink,
    applied_tx: Option<mpsc::UnboundedSender<Applied>>,
    snapshot_counter: u64,
    stats: Arc<SnapshotStats>,
    build_delay: std::time::Duration,
}

fn sm_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("reading the state machine's snapshot: {e}"))
}

impl SmStore {
    /// Opens the store, restoring the newest valid snapshot in `dir`.
    pub fn open(
        dir: &Path,
        sink: SnapshotSink,
        applied_tx: Option<mpsc::UnboundedSender<Applied>>,
    ) -> anyhow::Result<SmStore> {
        let mut state = SmState::default();
        if let Some(file) = snapshot_file::latest(dir)? {
            state = postcard::from_bytes(&file.data)?;
            let index = file.meta.last_log_id.map(|l| l.index).unwrap_or(0);
            let (nodes, sessions) = (state.sm.node_count(), state.sm.session_count());
            if file.id.starts_with(snapshot_file::SEEDED_ID_PREFIX) {
                // Seeded from a backup (`lockctl snapshot restore`): the digest, once, so
                // a disaster-recovery drill can compare it with the backup's.
                let digest = format!("{:016x}", state.sm.digest());
                tracing::info!(index, nodes, sessions, %digest, "seeded from a backup");
            } else {
                tracing::info!(index, nodes, sessions, "restored snapshot");
            }
        }
        Ok(SmStore {
            state: Arc::new(RwLock::new(state)),
            dir: dir.to_path_buf(),
            sink,
            applied_tx,
            snapshot_counter: 0,
            stats: Arc::default(),
            build_delay: std::time::Duration::ZERO,
        })
    }

    /// Makes every snapshot build take `delay` longer where it serializes
    /// (`faults.snapshot_build_delay_ms`, for tests).
    pub fn set_build_delay(&mut self, delay: std::time::Duration) {
        self.build_delay = delay;
    }

    /// A store that writes snapshots itself and publishes nothing (storage tests).
    pub fn open_standalone(dir: &Path) -> anyhow::Result<SmStore> {
        SmStore::open(dir, SnapshotSink::Direct(dir.to_path_buf()), None)
    }

    /// The shared state, for readers.
    pub fn shared(&self) -> SharedState {
        self.state.clone()
    }

    /// The snapshot counters, shared with the gateway.
    pub fn snapshot_stats(&self) -> Arc<SnapshotStats> {
        self.stats.clone()
    }
}

/// Builds snapshots from a consistent copy of the state.
pub struct SmSnapshotBuilder {
    state: SharedState,
    sink: SnapshotSink,
    counter: u64,
    stats: Arc<SnapshotStats>,
    build_delay: std::time::Duration,
}

/// Serializes `state` for a snapshot. `delay` (`faults.snapshot_build_delay_ms`, tests
/// only) is spent inside the serialization itself, so a test that makes it long also
/// shows whatever the serialization holds while it runs (the state lock, a runtime
/// worker) wherever the code calls it from.
fn encode(state: &SmState, delay: std::time::Duration) -> postcard::Result<Vec<u8>> {
    struct Slow<'a>(&'a SmState, std::time::Duration);
    impl Serialize for Slow<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            if !self.1.is_zero() {
                std::thread::sleep(self.1);
            }
            self.0.serialize(s)
        }
    }
    postcard::to_allocvec(&Slow(state, delay))
}

/// Decodes a serialized state that came from outside this process (a peer's snapshot, a
/// backup) within bounds, so a crafted one cannot overflow the stack (a `TxnFailed` error
/// stored for dedup nests) or build gigabytes out of a few bytes. 64 element bytes per
/// byte is more than any state builds (a node is a path, its data and ~60 bytes of
/// metadata).
pub fn decode_state(data: &[u8]) -> Result<SmState, String> {
    let limits = wire::decode::Limits {
        depth_max: wire::decode::DEPTH_MAX,
        element_bytes_max: data.len().saturating_mul(64).saturating_add(1 << 20),
    };
    let (state, _): (SmState, _) =
        wire::decode::from_bytes(data, limits).map_err(|e| e.to_string())?;
    Ok(state)
}

impl RaftSnapshotBuilder<TypeConfig> for SmSnapshotBuilder {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<Snapshot, std::io::Error> {
        let started = tokio::time::Instant::now();
        // A copy taken under the read lock and serialized without it. Serializing under
        // the lock held every apply back for as long as it took (std's `RwLock` then held
        // every reader behind the waiting apply too): no session could expire, no write
        // commit, no KeepAlive be checked while a large state was serialized. The nodes,
        // sessions and ended sessions are persistent maps (`imbl`), so the copy shares
        // them: taking it costs the lock a few pointer copies whatever the state's size
        // (a deep copy of 20 000 nodes of 1 KB held it about 40 ms), and memory grows only
        // by the parts applies change while the copy lives (copy-on-write).
        let copy: SmState = self.state.read().expect("state lock").clone();
        let lock_ms = started.elapsed().as_millis() as u64;
        let last = copy.last_applied;
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: copy.membership.clone(),
        };
        let id = format!(
            "{}-{}-{}",
            last.map(|l| l.leader_id.term).unwrap_or(0),
            last.map(|l| l.index).unwrap_or(0),
            self.counter
        );
        // Serialized on the snapshot encoder's thread, at low CPU priority (a large state
        // takes a core for a while, which at the replica's own priority held back its
        // commits, and on a runtime worker the tasks queued behind it, heartbeats among
        // them), then written by the snapshotter. Inline when the sink is direct (storage
        // tests and the simulation, whose replay covers only what runs on its own runtime).
        let ask = EncodeSnapshot {
            state: copy,
            delay: self.build_delay,
        };
        let encoded = match &self.sink {
            SnapshotSink::Direct(_) => ask.run(),
            SnapshotSink::Actor { encode, .. } => encode
                .send(ask)
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r),
        };
        let (data, serialize_ms) = encoded
            .map_err(|e| std::io::Error::other(format!("serializing snapshot {id}: {e}")))?;
        let data = self.sink.write(&meta, &id, data).await?;
        let index = meta.last_log_id.map(|l| l.index).unwrap_or(0);
        let total_ms = started.elapsed().as_millis() as u64;
        tracing::info!(
            index,
            bytes = data.len(),
            lock_ms,
            serialize_ms,
            ms = total_ms,
            "snapshot written"
        );
        let st = &self.stats;
        st.last_index.store(index, Ordering::Relaxed);
        st.last_bytes.store(data.len() as u64, Ordering::Relaxed);
        st.last_serialize_ms.store(serialize_ms, Ordering::Relaxed);
        st.last_total_ms.store(total_ms, Ordering::Relaxed);
        st.built.fetch_add(1, Ordering::Release);
        Ok(Snapshot {
            meta,
            snapshot: SnapshotData {
                id,
                data: Cursor::new(data),
            },
        })
    }
}

impl RaftStateMachine<TypeConfig> for SmStore {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = SmSnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), std::io::Error> {
        let s = self.state.read().expect("state lock");
        Ok((s.last_applied, s.membership.clone()))
    }

    /// Applies a batch: openraft 0.10 streams the entries, each with the responder of its
    /// proposer (on the leader), where 0.9 passed a list and took the outputs back. The
    /// batch is collected first and applied under one write lock, as before (the lock is
    /// never held across an await); the effects are published, then the proposers
    /// answered, in the order 0.9's core answered them after `apply` returned.
    async fn apply<Strm>(&mut self, entries: Strm) -> Result<(), std::io::Error>
    where
        Strm: futures::Stream<Item = Result<EntryResponder<TypeConfig>, std::io::Error>>
            + Unpin
            + OptionalSend,
    {
        let batch: Vec<EntryResponder<TypeConfig>> = entries.try_collect().await?;
        let mut outputs = Vec::with_capacity(batch.len());
        let mut published = Vec::new();
        {
            let mut s = self.state.write().expect("state lock");
            for (entry, responder) in batch {
                s.last_applied = Some(entry.log_id);
                let mut batch = Vec::new();
                let result = match entry.payload {
                    EntryPayload::Blank => Ok(Reply::Closed),
                    EntryPayload::Normal(cmd) => {
                        let (index, term) = (entry.log_id.index, entry.log_id.leader_id.term);
                        let (result, effects) = match &cmd {
                            Command::Batch(cmds) => {
                                let (results, effects) =
                                    s.sm.apply_batch_in_term(index, term, cmds);
                                batch = results;
                                (Ok(Reply::Closed), effects)
                            }
                            cmd => s.sm.apply_in_term(index, term, cmd),
                        };
                        if !effects.is_empty() {
                            published.push(Applied::Effects { index, effects });
                        }
                        result
                    }
                    EntryPayload::Membership(m) => {
                        s.membership = StoredMembership::new(Some(entry.log_id), m);
                        Ok(Reply::Closed)
                    }
                };
                outputs.push((responder, CommandOutput { result, batch }));
            }
        }
        if let Some(tx) = &self.applied_tx {
            for a in published {
                let _ = tx.send(a);
            }
        }
        for (responder, output) in outputs {
            if let Some(r) = responder {
                r.send(output);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.snapshot_counter += 1;
        SmSnapshotBuilder {
            state: self.state.clone(),
            sink: self.sink.clone(),
            counter: self.snapshot_counter,
            stats: self.stats.clone(),
            build_delay: self.build_delay,
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: SnapshotData,
    ) -> Result<(), std::io::Error> {
        let SnapshotData { id, data } = snapshot;
        let data = data.into_inner();
        let mut new_state = decode_state(&data)
            .map_err(|e| std::io::Error::other(format!("decoding snapshot {id}: {e}")))?;
        new_state.last_applied = meta.last_log_id;
        new_state.membership = meta.last_membership.clone();
        self.sink.write(meta, &id, data).await?;
        *self.state.write().expect("state lock") = new_state;
        if let Some(tx) = &self.applied_tx {
            let _ = tx.send(Applied::SnapshotInstalled {
                index: meta.last_log_id.map(|l| l.index).unwrap_or(0),
            });
        }
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, std::io::Error> {
        let dir = self.dir.clone();
        let file = match self.sink {
            // Snapshots written from the calling task (tests, the simulation) are read
            // the same way: a blocking-pool thread would finish on the wall clock, and a
            // simulation replays only what runs on its own.
            SnapshotSink::Direct(_) => snapshot_file::latest(&dir).map_err(sm_err)?,
            SnapshotSink::Actor { .. } => {
                tokio::task::spawn_blocking(move || snapshot_file::latest(&dir))
                    .await
                    .map_err(sm_err)?
                    .map_err(sm_err)?
            }
        };
        Ok(file.map(|f| Snapshot {
            meta: f.meta,
            snapshot: SnapshotData {
                id: f.id,
                data: Cursor::new(f.data),
            },
        }))
    }
}
