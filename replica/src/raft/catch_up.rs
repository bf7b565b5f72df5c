//! A replica that starts on an empty store votes only once it holds what the cell has
//! committed.
//!
//! Raft counts a voter's acknowledgement of an entry as a promise that the voter keeps
//! the entry, and a voter's vote as a promise that it holds nothing newer than the
//! candidate. A replica whose data directory was lost (a disk replaced, a volume
//! deleted) and that comes back under its old id breaks both: it may have counted towards
//! the commit of an entry it no longer holds, and with its empty log it would vote for any
//! candidate. Five replicas, an entry committed on three of them, one of the three wiped,
//! the other two down: the wiped one and the two that never had the entry elect one of
//! those two, and the committed entry (a lock grant, a fencing token) is gone.
//!
//! So a replica that starts with no vote, no log and no snapshot is *catching up*: it
//! answers `Vote` requests by refusing every candidate whose log goes past the cell's
//! first entry (the membership entry a new cell's bootstrap writes at index 0; only the
//! bootstrapping replica can stand with that log, which is how a new cell elects its
//! first leader from replicas that are all new), until either
//!
//! - it has acknowledged an `AppendEntries` that brought its log up to the commit index
//!   of a leader that had committed an entry of its own term (such a leader's log, and
//!   so its commit index once past its term's first entry, covers every entry committed
//!   before it was elected), or
//! - it leads and has applied an entry of its own term (it was elected by voters of
//!   which at least one holds every committed entry, so its log holds them too).
//!
//! It acknowledges appends meanwhile (it really keeps what it acknowledges) and can be a
//! candidate. The state survives a restart in the middle: a marker file in the data
//! directory, written (and synced) before the replica answers any peer, is removed when
//! it has caught up.
//!
//! What this cannot see: a candidate whose log stops at the cell's first entry is granted
//! (a new cell needs it), so the loss above stays possible if the two replicas that never
//! had the entry also never got past the first entry (a leader's first append to a new
//! follower carries its term's first entry with the bootstrap's), or if the wiped
//! replica's acknowledgement of an entry reaches the leader only after the replica was
//! wiped and restarted. docs/operations.md, "A replica whose data was lost".

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, VoteRequest, VoteResponse};
use openraft::RaftLogId;
use wire::raft::{NodeId, TypeConfig};

/// The marker file, in the data directory, of a replica still catching up.
pub const MARKER_FILE: &str = "catching-up";

/// Whether this replica is still catching up (see the module's documentation).
#[derive(Debug)]
pub struct CatchUp {
    pending: AtomicBool,
    marker: Option<PathBuf>,
    id: NodeId,
}

/// What an `AppendEntries` request says about catching up, taken before the request is
/// handed to openraft.
#[derive(Debug, Clone, Copy)]
pub struct AppendSeen {
    /// The index the follower's log reaches if it accepts every entry of the request.
    reaches: Option<u64>,
    /// The leader's commit index, if the leader has committed an entry of its own term.
    own_term_commit: Option<u64>,
}

impl CatchUp {
    /// Whether a replica starting on a store with this state is catching up: no vote, no
    /// log, no snapshot, or the marker file of an earlier start still in `data_dir`.
    /// Writes the marker (and syncs it and the directory) when it is, if `data_dir` is
    /// given (a replica on an in-memory log, as in the simulation, keeps it in memory).
    pub fn open(id: NodeId, data_dir: Option<&Path>, empty_store: bool) -> std::io::Result<Self> {
        let marker = data_dir.map(|d| d.join(MARKER_FILE));
        let pending = empty_store || marker.as_deref().is_some_and(Path::exists);
        if pending {
            if let (Some(path), Some(dir)) = (&marker, data_dir) {
                std::fs::create_dir_all(dir)?;
                let f = std::fs::File::create(path)?;
                f.sync_all()?;
                std::fs::File::open(dir)?.sync_all()?;
            }
            tracing::warn!(
                "replica {id} starts on an empty store (or did not finish catching up before \
                 it stopped): it votes only for a new cell's first candidate until it has \
                 caught up with a leader"
            );
        }
        Ok(CatchUp {
            pending: AtomicBool::new(pending),
            marker,
            id,
        })
    }

    /// A replica that is not catching up (tests of other parts).
    pub fn caught_up(id: NodeId) -> Self {
        CatchUp {
            pending: AtomicBool::new(false),
            marker: None,
            id,
        }
    }

    /// Whether it is still catching up.
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// The answer to `req` if this replica must refuse it without asking openraft: while
    /// catching up, every candidate whose last log entry is past index 0. `vote` is this
    /// replica's own vote now (the refusal carries it, as openraft's own refusals do).
    pub fn refuse_vote(
        &self,
        req: &VoteRequest<NodeId>,
        vote: openraft::Vote<NodeId>,
    ) -> Option<VoteResponse<NodeId>> {
        if !self.pending() || req.last_log_id.is_some_and(|l| l.index == 0) {
            return None;
        }
        tracing::info!(
            candidate = %req.vote,
            candidate_last_log = ?req.last_log_id,
            "vote refused: replica {} is still catching up after starting on an empty store",
            self.id
        );
        Some(VoteResponse {
            vote,
            vote_granted: false,
            last_log_id: None,
        })
    }

    /// What `req` can tell about catching up (call before handing it to openraft).
    pub fn see_append(&self, req: &AppendEntriesRequest<TypeConfig>) -> Option<AppendSeen> {
        if !self.pending() {
            return None;
        }
        let reaches = req
            .entries
            .last()
            .map(|e| e.get_log_id().index)
            .or(req.prev_log_id.map(|l| l.index));
        let own_term_commit = req
            .leader_commit
            .filter(|c| c.leader_id.term == req.vote.leader_id.term)
            .map(|c| c.index);
        Some(AppendSeen {
            reaches,
            own_term_commit,
        })
    }

    /// openraft's answer to an append seen with [`CatchUp::see_append`]: caught up when
    /// the accepted entries reach the leader's commit index in the leader's own term.
    pub fn appended(&self, seen: Option<AppendSeen>, resp: &AppendEntriesResponse<NodeId>) {
        let Some(seen) = seen else { return };
        let reached = match resp {
            AppendEntriesResponse::Success => seen.reaches,
            AppendEntriesResponse::PartialSuccess(m) => m.map(|l| l.index),
            _ => None,
        };
        if let (Some(reached), Some(commit)) = (reached, seen.own_term_commit) {
            if reached >= commit {
                self.done(&format!(
                    "its log reaches the leader's commit index {commit}"
                ));
            }
        }
    }

    /// openraft's metrics now: caught up when this replica leads and has applied an entry
    /// of its own term.
    pub fn observe(&self, m: &openraft::RaftMetrics<NodeId, openraft::BasicNode>) {
        if self.pending()
            && m.state == openraft::ServerState::Leader
            && m.last_applied
                .is_some_and(|l| l.leader_id.term == m.current_term)
        {
            self.done(&format!(
                "it leads and has applied an entry of its term {}",
                m.current_term
            ));
        }
    }

    fn done(&self, why: &str) {
        if !self.pending.swap(false, Ordering::AcqRel) {
            return;
        }
        if let Some(path) = &self.marker {
            let removed = std::fs::remove_file(path).and_then(|()| {
                let dir = path.parent().unwrap_or(Path::new("."));
                std::fs::File::open(dir)?.sync_all()
            });
            if let Err(e) = removed {
                // Still catching up at the next start: safe, only slower to vote.
                tracing::warn!("remove {}: {e}", path.display());
            }
        }
        tracing::info!("replica {} has caught up ({why}): it votes again", self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, LogId, Vote};

    fn log_id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    fn vote_req(last: Option<LogId<NodeId>>) -> VoteRequest<NodeId> {
        VoteRequest {
            vote: Vote::new(5, 2),
            last_log_id: last,
        }
    }

    fn append(
        term: u64,
        prev: Option<LogId<NodeId>>,
        commit: Option<LogId<NodeId>>,
    ) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(term, 1),
            prev_log_id: prev,
            entries: vec![],
            leader_commit: commit,
        }
    }

    #[test]
    fn a_replica_on_an_empty_store_grants_only_a_new_cells_first_candidate_until_caught_up() {
        let dir = tempfile::tempdir().unwrap();
        let c = CatchUp::open(3, Some(dir.path()), true).unwrap();
        assert!(dir.path().join(MARKER_FILE).exists());
        let mine = Vote::new(4, 3);
        assert!(c.refuse_vote(&vote_req(Some(log_id(4, 7))), mine).is_some());
        assert!(c.refuse_vote(&vote_req(None), mine).is_some());
        assert!(c.refuse_vote(&vote_req(Some(log_id(0, 0))), mine).is_none());

        // A leader whose commit index is of an earlier term: not enough.
        let r = append(6, Some(log_id(6, 20)), Some(log_id(5, 18)));
        c.appended(c.see_append(&r), &AppendEntriesResponse::Success);
        assert!(c.pending());
        // Of its own term but past what this append reaches: not yet.
        let r = append(6, Some(log_id(6, 20)), Some(log_id(6, 21)));
        c.appended(c.see_append(&r), &AppendEntriesResponse::Success);
        assert!(c.pending());
        // Refused appends say nothing.
        let r = append(6, Some(log_id(6, 21)), Some(log_id(6, 21)));
        c.appended(c.see_append(&r), &AppendEntriesResponse::Conflict);
        assert!(c.pending());
        // Reaching it: caught up, the marker gone, votes as openraft decides.
        c.appended(c.see_append(&r), &AppendEntriesResponse::Success);
        assert!(!c.pending());
        assert!(!dir.path().join(MARKER_FILE).exists());
        assert!(c.refuse_vote(&vote_req(Some(log_id(4, 7))), mine).is_none());
    }

    #[test]
    fn the_marker_keeps_a_replica_catching_up_across_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        drop(CatchUp::open(3, Some(dir.path()), true).unwrap());
        // Restarted with some log now, but not caught up.
        let c = CatchUp::open(3, Some(dir.path()), false).unwrap();
        assert!(c.pending());
        // A store that is not empty and no marker: not catching up.
        let other = tempfile::tempdir().unwrap();
        let c = CatchUp::open(3, Some(other.path()), false).unwrap();
        assert!(!c.pending());
        assert!(!other.path().join(MARKER_FILE).exists());
    }
}
