//! The Raft log in memory, for the fault suite's deterministic simulation.
//!
//! A simulated replica must not touch a real disk: fjall's flusher thread would complete
//! appends on the wall clock while the rest of the cell runs on the simulated one. This
//! store keeps the log, vote, committed id and purge point behind one mutex and completes
//! every append at once, which is what a durable write looks like to openraft. The state
//! lives in a [`MemLog`] that the simulation holds across a simulated crash and hands to
//! the restarted replica, so a crash loses exactly what a real one loses after fsync:
//! nothing acknowledged.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};

use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader};
use wire::raft::{Entry, LogId, TypeConfig, Vote};

#[derive(Debug, Default)]
struct State {
    log: BTreeMap<u64, Entry>,
    vote: Option<Vote>,
    committed: Option<LogId>,
    purged: Option<LogId>,
}

/// One replica's durable Raft state, kept in memory; cheap to clone (clones share it).
#[derive(Debug, Clone)]
pub struct MemLog {
    state: Arc<Mutex<State>>,
    store_id: wire::raft::StoreId,
}

impl Default for MemLog {
    fn default() -> MemLog {
        MemLog::new()
    }
}

impl MemLog {
    /// An empty log, with a store id of its own.
    pub fn new() -> MemLog {
        MemLog::with_store_id(wire::raft::StoreId::random(&mut rand::thread_rng()))
    }

    /// An empty log whose store has `id` (the simulation's, drawn from its seed).
    pub fn with_store_id(id: wire::raft::StoreId) -> MemLog {
        MemLog {
            state: Arc::default(),
            store_id: id,
        }
    }

    /// This store's id (`LogStore::store_id`'s counterpart; a clone shares it).
    pub fn store_id(&self) -> wire::raft::StoreId {
        self.store_id
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        // A panic while holding the lock poisons it; the state itself is still whole
        // (every change below is one map operation), so keep going.
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Entries held (after purges).
    pub fn len(&self) -> usize {
        self.with(|s| s.log.len())
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RaftLogReader<TypeConfig> for MemLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, std::io::Error> {
        Ok(self.with(|s| s.log.range(range).map(|(_, e)| e.clone()).collect()))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, std::io::Error> {
        Ok(self.with(|s| s.vote))
    }
}

impl RaftLogStorage<TypeConfig> for MemLog {
    type LogReader = MemLog;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, std::io::Error> {
        Ok(self.with(|s| {
            let last = s.log.values().next_back().map(|e| e.log_id);
            LogState {
                last_purged_log_id: s.purged,
                last_log_id: last.or(s.purged),
            }
        }))
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), std::io::Error> {
        self.with(|s| s.vote = Some(*vote));
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), std::io::Error> {
        self.with(|s| s.committed = committed);
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, std::io::Error> {
        Ok(self.with(|s| s.committed))
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), std::io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        self.with(|s| {
            for e in entries {
                s.log.insert(e.log_id.index, e);
            }
        });
        callback.io_completed(Ok(()));
        Ok(())
    }

    /// Removes every entry after `last_log_id` (all of them if `None`).
    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), std::io::Error> {
        let from = last_log_id.map_or(0, |l| l.index + 1);
        self.with(|s| {
            s.log.split_off(&from);
        });
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), std::io::Error> {
        self.with(|s| {
            s.purged = Some(log_id);
            s.log = s.log.split_off(&(log_id.index + 1));
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::testing::log::{StoreBuilder, Suite};

    // openraft's storage conformance suite, run against the in-memory log (with the real
    // state-machine store in a temporary directory).
    struct Builder;

    impl StoreBuilder<TypeConfig, MemLog, crate::raft::sm_store::SmStore, tempfile::TempDir>
        for Builder
    {
        async fn build(
            &self,
        ) -> Result<
            (tempfile::TempDir, MemLog, crate::raft::sm_store::SmStore),
            openraft::StorageError<TypeConfig>,
        > {
            let dir = tempfile::tempdir().expect("tempdir");
            let sm = crate::raft::sm_store::SmStore::open_standalone(&dir.path().join("snapshots"))
                .expect("open sm");
            Ok((dir, MemLog::new(), sm))
        }
    }

    // openraft 0.10's suite is async (0.9's ran its own runtime).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn openraft_storage_suite() {
        Suite::test_all(Builder).await.expect("suite");
    }

    #[test]
    fn a_clone_shares_the_state_a_restart_reads() {
        let log = MemLog::new();
        let mut again = log.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        rt.block_on(async {
            let mut l = log.clone();
            l.save_vote(&Vote::new(3, 2)).await.unwrap();
            assert_eq!(again.read_vote().await.unwrap(), Some(Vote::new(3, 2)));
        });
    }
}
