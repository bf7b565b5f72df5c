//! The cell itself: status, membership changes, snapshots on demand and state digests.

use super::*;

impl Gateway {
    /// Adds a learner at `addr` (leader only).
    pub(super) async fn add_learner(&self, id: u64, addr: String) -> Response {
        if !wire::is_host_port(&addr) {
            return Err(Error::BadRequest {
                reason: format!("bad address {addr:?}: expected host:port or ip:port"),
            });
        }
        self.change(ChangeMembership::AddLearner { id, addr }).await
    }

    /// A page of the cell's sessions with their leases here (this replica leads: the
    /// caller confirmed it).
    pub(super) async fn list_sessions(&self, after: SessionId, limit: u32) -> Response {
        let limit = limit.clamp(1, wire::types::SESSIONS_PAGE_MAX) as usize;
        // A page also stops at half a client frame (owners and paths are up to 1 KiB
        // each), with at least one session in it.
        let mut budget = wire::CLIENT_FRAME_BYTES_MAX / 2;
        let (mut page, more) = {
            let s = self.state.read().expect("state lock");
            let mut listed = s.sm.sessions_after(after).peekable();
            let mut page: Vec<wire::types::SessionInfo> = Vec::new();
            while page.len() < limit {
                let Some((_, next)) = listed.peek() else {
                    break;
                };
                let bytes = 64
                    + next.owner.len()
                    + next
                        .ephemerals
                        .iter()
                        .take(wire::types::SESSION_EPHEMERALS_LISTED)
                        .map(|p| p.len() + 8)
                        .sum::<usize>();
                if !page.is_empty() && bytes > budget {
                    break;
                }
                budget = budget.saturating_sub(bytes);
                let (id, session) = listed.next().expect("peeked");
                page.push(wire::types::SessionInfo {
                    id,
                    owner: session.owner.clone(),
                    lease_left_ms: None,
                    ephemerals: session.ephemerals.len() as u64,
                    ephemeral_paths: session
                        .ephemerals
                        .iter()
                        .take(wire::types::SESSION_EPHEMERALS_LISTED)
                        .cloned()
                        .collect(),
                    caches: session.caches,
                });
            }
            (page, listed.next().is_some())
        };
        let ids = page.iter().map(|i| i.id).collect();
        let deadlines = self
            .sessions
            .send(crate::actors::session_manager::LeaseDeadlines(ids))
            .await
            .map_err(|e| Error::Unavailable {
                reason: format!("session manager: {e}"),
            })?;
        let now = Instant::now();
        for (info, deadline) in page.iter_mut().zip(deadlines) {
            info.lease_left_ms =
                deadline.map(|d| d.saturating_duration_since(now).as_millis() as u64);
        }
        Ok(Reply::Sessions {
            sessions: page,
            more,
        })
    }

    /// A digest of the replicated state and the index it reflects, at most one at a time
    /// and one per [`DIGEST_INTERVAL`].
    pub(super) fn state_digest(&self) -> Response {
        // Held while computing: a second request meanwhile is refused too.
        let Ok(mut last) = self.last_digest.try_lock() else {
            return Err(Error::Unavailable {
                reason: "a state digest is being computed; retry".into(),
            });
        };
        if last.is_some_and(|t| t.elapsed() < DIGEST_INTERVAL) {
            return Err(Error::Unavailable {
                reason: format!(
                    "a state digest was computed less than {} ms ago; retry",
                    DIGEST_INTERVAL.as_millis()
                ),
            });
        }
        let r = {
            let s = self.state.read().expect("state lock");
            Reply::StateDigest {
                index: s.sm.last_index(),
                digest: s.sm.digest(),
            }
        };
        *last = Some(Instant::now());
        Ok(r)
    }

    /// Writes a backup to the store now (this replica leads: the caller confirmed it);
    /// answers once the object is written.
    pub(super) async fn backup(&self) -> Response {
        let Some(b) = &self.backup else {
            return Err(Error::BadRequest {
                reason: "this cell has no backup store: set [backup] url in the replicas' \
                         configuration (docs/operations.md, \"Backups\")"
                    .into(),
            });
        };
        let t = b
            .addr
            .send(crate::actors::backuper::BackupNow)
            .await
            .map_err(|e| Error::Internal {
                reason: format!("backuper: {e}"),
            })??;
        Ok(Reply::BackupTaken {
            store: b.url.clone(),
            object: t.object,
            index: t.index,
            bytes: t.bytes,
            digest: t.digest,
            total_ms: t.total_ms,
            pruned: t.pruned,
        })
    }

    /// Builds a snapshot covering at least what is applied now; answers once it is written.
    pub(super) async fn snapshot(&self) -> Response {
        let st = &self.snapshot_stats;
        let applied = self
            .raft
            .metrics()
            .borrow()
            .last_applied
            .map_or(0, |l| l.index);
        let started = Instant::now();
        let deadline = started + Duration::from_secs(120);
        let mut seen = st.built.load(Ordering::Acquire);
        let internal = |e: String| Error::Internal {
            reason: format!("snapshot: {e}"),
        };
        self.raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| internal(e.to_string()))?;
        loop {
            let built = st.built.load(Ordering::Acquire);
            if built != seen {
                if st.last_index.load(Ordering::Relaxed) >= applied {
                    return Ok(Reply::SnapshotTaken {
                        index: st.last_index.load(Ordering::Relaxed),
                        bytes: st.last_bytes.load(Ordering::Relaxed),
                        serialize_ms: st.last_serialize_ms.load(Ordering::Relaxed),
                        total_ms: st.last_total_ms.load(Ordering::Relaxed),
                    });
                }
                // One already under way when asked covered less: ask again.
                seen = built;
                self.raft
                    .trigger()
                    .snapshot()
                    .await
                    .map_err(|e| internal(e.to_string()))?;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("a snapshot covering index {applied}"),
                    after_ms: started.elapsed().as_millis() as u64,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub(super) async fn change(&self, c: ChangeMembership) -> Response {
        self.raft_node.send(c).await.unwrap_or_else(|e| {
            Err(Error::Internal {
                reason: format!("raft node: {e}"),
            })
        })
    }

    /// Who leads, as this replica sees it ([`Op::Leadership`]): read from the Raft
    /// metrics alone, so it costs no actor round trip, lock or quorum.
    pub fn leadership(&self) -> Reply {
        let metrics = self.raft.metrics();
        let m = metrics.borrow();
        Reply::Leadership {
            id: self.id,
            term: m.current_term,
            leading: m.state == openraft::ServerState::Leader,
            leader: m.current_leader,
        }
    }

    /// [`Gateway::leadership`] once this replica knows a leader in a term above
    /// `newer_than`, or after `wait_ms` (at most [`wire::types::LEADERSHIP_WAIT_MAX_MS`])
    /// ([`Op::LeadershipAfter`]): the new leader's answer leaves the moment openraft
    /// reports it elected, a follower's when the new leader's first heartbeat arrives.
    pub async fn leadership_after(&self, wait_ms: u32, newer_than: u64) -> Reply {
        let wait = u64::from(wait_ms.min(wire::types::LEADERSHIP_WAIT_MAX_MS));
        let mut metrics = self.raft.metrics();
        let _ = tokio::time::timeout(
            std::time::Duration::from_millis(wait),
            metrics.wait_for(|m| m.current_term > newer_than && m.current_leader.is_some()),
        )
        .await;
        self.leadership()
    }

    /// This replica's view of the cell.
    pub async fn status(&self) -> Status {
        self.status_with(true).await.0
    }

    /// [`Gateway::status`] and the cacher list's counts; without the request latencies
    /// unless `latencies` (what a metrics scrape asks: copying every histogram out holds
    /// the lock each request records under).
    pub async fn status_with(
        &self,
        latencies: bool,
    ) -> (Status, Option<crate::actors::cacher_list::CacherStats>) {
        let stats = self.cachers.send(Stats).await.ok();
        let watches = self
            .watches
            .send(WatchCount(String::new()))
            .await
            .map_or(0, |c| c.total as u64);
        let m = self.raft.metrics().borrow().clone();
        let members = members(&self.raft);
        let leader = m.current_leader.and_then(|l| {
            members
                .iter()
                .find(|x| x.id == l)
                .cloned()
                .or(Some(MemberInfo {
                    id: l,
                    addr: String::new(),
                    voter: true,
                    store: Default::default(),
                }))
        });
        let (sessions, nodes) = {
            let s = self.state.read().expect("state lock");
            (s.sm.session_count() as u64, s.sm.node_count() as u64)
        };
        let (recent_fsyncs, recent_fsync_p99_us) = self.log_stats.recent.p99_us();
        let status = Status {
            id: self.id,
            role: format!("{:?}", m.state),
            term: m.current_term,
            leader,
            last_applied: m.last_applied.map(|l| l.index).unwrap_or(0),
            last_log_index: m.last_log_index.unwrap_or(0),
            snapshot_index: m.snapshot.map(|l| l.index),
            purged_index: m.purged.map(|l| l.index),
            members,
            session_count: sessions,
            node_count: nodes,
            log_appends: self.log_stats.appends.load(Ordering::Relaxed),
            log_syncs: self.log_stats.syncs.load(Ordering::Relaxed),
            cachers: stats.map_or(0, |s| s.cachers),
            oldest_invalidation_ms: stats.map_or(0, |s| s.oldest_invalidation_ms),
            keepalive_rpcs: self.keepalive_stats.rpcs.load(Ordering::Relaxed),
            keepalives_renewed: self.keepalive_stats.renewed.load(Ordering::Relaxed),
            watches,
            invalidations_sent: stats.map_or(0, |s| s.invalidations_sent),
            snapshot_bytes: self.snapshot_stats.last_bytes.load(Ordering::Relaxed),
            snapshot_build_ms: self.snapshot_stats.last_total_ms.load(Ordering::Relaxed),
            request_latency: if latencies {
                self.latency.snapshot()
            } else {
                Vec::new()
            },
            peer_dials: self.peer_dials.load(Ordering::Relaxed),
            peer_certificate_checks: self.peer_certificate_checks.load(Ordering::Relaxed),
            refused_by_limit: self.quotas.refusals(),
            recent_fsyncs,
            recent_fsync_p99_us,
            store: Some(self.store),
        };
        (status, stats)
    }
}
