//! The snapshotter writes snapshot files (atomically, checksummed, with backups) on its own
//! thread, so a large snapshot never blocks an arbiter or the Raft runtime; the snapshot
//! encoder serializes built snapshots on another, at the lowest CPU and I/O priority, so
//! it yields the core to the replica's commits (and a received snapshot is never written
//! behind a build's serializing).
//!
//! openraft decides *when* (every `snapshot_interval_entries` applied entries) and purges
//! the log behind each snapshot; this actor owns the files.

use std::path::PathBuf;

use actix::{Actor, Handler, SyncContext};

use crate::raft::sm_store::{EncodeSnapshot, WriteSnapshot};
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

/// The snapshot encoder (a sync actor on its own arbiter thread, at low priority).
pub struct SnapshotEncoder;

impl Actor for SnapshotEncoder {
    type Context = SyncContext<Self>;

    fn started(&mut self, _: &mut SyncContext<Self>) {
        lower_priority();
    }
}

/// Makes this thread yield to the rest of the replica: nice 19 for the CPU (serializing a
/// large state takes a core for a while; at the replica's priority, on a core shared
/// with its other threads, it held back commits and KeepAlives; at nice 19 it is slow
/// under load, never stuck), and the lowest best-effort I/O priority (honoured by the
/// BFQ scheduler only; best-effort, not idle, which may never get the disk under a steady
/// write load). A failure is logged and the thread runs as it is.
pub(crate) fn lower_priority() {
    const IOPRIO_WHO_PROCESS: libc::c_int = 1;
    const IOPRIO_CLASS_BE: libc::c_int = 2;
    const IOPRIO_CLASS_SHIFT: libc::c_int = 13;
    const LOWEST: libc::c_int = 7;
    // SAFETY: system calls on this thread's own id, with plain integer arguments.
    let (nice, io) = unsafe {
        let tid = libc::gettid();
        (
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19),
            libc::syscall(
                libc::SYS_ioprio_set,
                IOPRIO_WHO_PROCESS,
                tid,
                (IOPRIO_CLASS_BE << IOPRIO_CLASS_SHIFT) | LOWEST,
            ),
        )
    };
    if nice != 0 || io != 0 {
        tracing::warn!(
            nice,
            io,
            error = %std::io::Error::last_os_error(),
            "a snapshot or backup thread runs at the replica's priority"
        );
    }
}

impl Handler<EncodeSnapshot> for SnapshotEncoder {
    type Result = Result<(Vec<u8>, u64), String>;

    fn handle(&mut self, msg: EncodeSnapshot, _: &mut SyncContext<Self>) -> Self::Result {
        msg.run()
    }
}

impl Handler<WriteSnapshot> for Snapshotter {
    type Result = Result<Vec<u8>, String>;

    fn handle(&mut self, msg: WriteSnapshot, _: &mut SyncContext<Self>) -> Self::Result {
        snapshot_file::write(&self.dir, &msg.meta, &msg.id, &msg.data)
            .map_err(|e| e.to_string())?;
        self.written += 1;
        Ok(msg.data)
    }
}

#[cfg(test)]
mod tests {
    /// The thread that calls `lower_priority` runs at nice 19 and the lowest best-effort
    /// I/O priority; other threads keep theirs.
    #[test]
    fn the_snapshotter_thread_yields_the_cpu_and_the_disk() {
        // SAFETY: reads of a thread's own priorities.
        let read = || unsafe {
            let tid = libc::gettid();
            *libc::__errno_location() = 0;
            let nice = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
            let io = libc::syscall(libc::SYS_ioprio_get, 1, tid);
            (nice, io)
        };
        let before = read();
        let (nice, io) = std::thread::spawn(move || {
            super::lower_priority();
            read()
        })
        .join()
        .unwrap();
        assert_eq!(nice, 19);
        assert_eq!(io, (2 << 13) | 7, "best-effort class, level 7");
        assert_eq!(read(), before, "the calling thread keeps its priorities");
    }
}
