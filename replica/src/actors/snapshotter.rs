//! The snapshotter: writes snapshot files (atomically, checksummed, with backups) on its own
//! thread, so a large snapshot never blocks an arbiter or the Raft runtime.
//!
//! openraft decides *when* (every `snapshot_interval_entries` applied entries) and purges
//! the log behind each snapshot; this actor owns the files.

use std::path::PathBuf;

use actix::{Actor, Handler, SyncContext};

use crate::raft::sm_store::WriteSnapshot;
use crate::raft::snapshot_file;

/// The snapshotter actor (a sync actor on its own arbiter thread).
pub struct Snapshotter {
    dir: PathBuf,
    /// Snapshots written since start.
    pub written: u64,
}

impl Snapshotter {
    /// Writes snapshots into `dir`.
    pub fn new(dir: PathBuf) -> Snapshotter {
        Snapshotter { dir, written: 0 }
    }
}

impl Actor for Snapshotter {
    type Context = SyncContext<Self>;
}

impl Handler<WriteSnapshot> for Snapshotter {
    type Result = Result<(), String>;

    fn handle(&mut self, msg: WriteSnapshot, _: &mut SyncContext<Self>) -> Self::Result {
        snapshot_file::write(&self.dir, &msg.meta, &msg.data).map_err(|e| e.to_string())?;
        self.written += 1;
        Ok(())
    }
}
