//! The replica's Prometheus metrics, `/health` and `/ready` (served by
//! [`wire::metrics::serve`] on `metrics.listen`; names and meanings in
//! `docs/operations.md`, "Metrics and alerts").
//!
//! Most values are read at each scrape from what [`Gateway::status`] gathers (the actors'
//! counts, the log store's counters, openraft's metrics). What has to be recorded as it
//! happens lives in [`Instruments`]: the commit and fsync histograms, session expiries,
//! leader changes and refusals.

use std::sync::Arc;

use openraft::ServerState;
use wire::error::Error;
use wire::metrics::prometheus_client::metrics::counter::Counter;
use wire::metrics::prometheus_client::metrics::family::Family;
use wire::metrics::prometheus_client::metrics::histogram::Histogram;
use wire::metrics::prometheus_client::registry::Unit;
use wire::metrics::{BoxFuture, Probe, Scrape};

use crate::gateway::Gateway;
use crate::raft::Raft;

/// Labels of a refusal counter: `reason`.
type Reason = Vec<(String, String)>;

/// What a replica records as it happens.
#[derive(Debug)]
pub struct Instruments {
    /// From proposing an entry to its being applied at this leader, in seconds.
    pub commit_seconds: Histogram,
    /// Sessions whose lease ran out, expired by this replica while it led.
    pub session_expiries: Counter,
    /// Times the leader this replica knows of changed (including to none).
    pub leader_changes: Counter,
    /// Requests refused, by reason: `limit` (a bound on requests, sessions or load),
    /// `acl` (an ACL or admin check), `wrong_cell` (the path's prefix is served by
    /// another cell, or is frozen for a move).
    pub refusals: Family<Reason, Counter>,
}

/// The reasons [`Instruments::refusals`] counts under.
pub const REFUSAL_REASONS: [&str; 3] = ["limit", "acl", "wrong_cell"];

impl Default for Instruments {
    fn default() -> Self {
        let refusals = Family::<Reason, Counter>::default();
        // Each reason from zero, so rules and dashboards see it before the first refusal.
        for reason in REFUSAL_REASONS {
            refusals.get_or_create(&reason_label(reason)).inc_by(0);
        }
        Instruments {
            // 0.5 ms to 16 s.
            commit_seconds: wire::metrics::seconds_histogram(0.000_5, 16),
            session_expiries: Counter::default(),
            leader_changes: Counter::default(),
            refusals,
        }
    }
}

fn reason_label(reason: &str) -> Reason {
    vec![("reason".to_string(), reason.to_string())]
}

/// The refusal reason an error counts under, if it is a refusal.
pub fn refusal_reason(e: &Error) -> Option<&'static str> {
    match e {
        Error::TooManyRequests { .. }
        | Error::TooManySessions { .. }
        | Error::LimitExceeded { .. }
        | Error::TooManyFor { .. }
        | Error::Busy { .. } => Some("limit"),
        Error::Denied { .. } | Error::NotAdmin { .. } => Some("acl"),
        Error::WrongCell { .. } | Error::Frozen { .. } => Some("wrong_cell"),
        _ => None,
    }
}

impl Instruments {
    /// Counts `e` under its reason, if it is a refusal.
    pub fn refused(&self, e: &Error) {
        if let Some(reason) = refusal_reason(e) {
            self.refusals.get_or_create(&reason_label(reason)).inc();
        }
    }
}

/// Counts every change of the leader this replica knows of, until raft stops.
pub async fn count_leader_changes(raft: Raft, changes: Counter) {
    // The server metrics change with the leader, not with every entry.
    let mut metrics = raft.server_metrics();
    let mut leader = metrics.borrow_and_update().current_leader;
    while metrics.changed().await.is_ok() {
        let now = metrics.borrow_and_update().current_leader;
        if now != leader {
            leader = now;
            changes.inc();
            tracing::info!(leader = ?now, "the leader changed");
        }
    }
}

/// The replica's [`Probe`].
pub struct ReplicaProbe {
    /// Where status comes from.
    pub gateway: Arc<Gateway>,
    /// The live instruments (also held by the gateway and the actors).
    pub instruments: Arc<Instruments>,
    /// The replica's certificate file, for its expiry.
    pub cert: std::path::PathBuf,
}

/// Entries a replica's applied index may trail its own log and still be ready.
pub const READY_APPLY_LAG_MAX: u64 = 1_000;

impl Probe for ReplicaProbe {
    fn metrics(&self) -> BoxFuture<'_, Scrape> {
        Box::pin(self.scrape())
    }

    fn ready(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let m = self.gateway.raft.metrics().borrow().clone();
            let id = self.gateway.id;
            let member = m
                .membership_config
                .membership()
                .nodes()
                .any(|(n, _)| *n == id);
            if !member {
                return Err(format!("replica {id} is not a member of the cell"));
            }
            let Some(leader) = m.current_leader else {
                return Err("no leader known".into());
            };
            let applied = m.last_applied.map_or(0, |l| l.index);
            let last = m.last_log_index.unwrap_or(0);
            if last.saturating_sub(applied) > READY_APPLY_LAG_MAX {
                return Err(format!(
                    "applied {applied} of {last} entries in its log (more than \
                     {READY_APPLY_LAG_MAX} behind)"
                ));
            }
            Ok(format!(
                "replica {id}, {:?}, leader {leader}, applied {applied}",
                m.state
            ))
        })
    }
}

impl ReplicaProbe {
    async fn scrape(&self) -> Scrape {
        let (st, cacher_stats) = self.gateway.status_with(false).await;
        let m = self.gateway.raft.metrics().borrow().clone();
        let i = &self.instruments;
        let log = &self.gateway.log_stats;
        let mut s = Scrape::for_cell(&self.gateway.cell);
        let leading = m.state == ServerState::Leader;

        // Raft.
        s.gauge(
            "raft_leader",
            "1 on the cell's leader, 0 elsewhere.",
            f64::from(u8::from(leading)),
        );
        s.gauge(
            "raft_leader_known",
            "1 when this replica knows a leader.",
            f64::from(u8::from(m.current_leader.is_some())),
        );
        s.gauge("raft_term", "The current Raft term.", st.term as f64);
        // openraft 0.9's leader does not step down when it loses its quorum: a leader
        // whose quorum last acknowledged it long ago leads nothing (the no-leader alert
        // counts only leaders heard from recently).
        let alone = st.members.iter().filter(|x| x.voter).count() == 1;
        // Deprecated in openraft 0.10 for `last_quorum_acked` (an instant), still filled
        // in; kept so that the gauge means what it meant.
        #[allow(deprecated)]
        let ack = m.millis_since_quorum_ack.or(alone.then_some(0));
        if let (true, Some(ms)) = (leading, ack) {
            s.gauge_in(
                "raft_quorum_ack_age",
                "On the leader: time since a quorum last acknowledged it.",
                Unit::Seconds,
                ms as f64 / 1000.0,
            );
        }
        s.gauge(
            "raft_applied_index",
            "Last log index applied to the state machine.",
            st.last_applied as f64,
        );
        s.gauge(
            "raft_last_log_index",
            "Last index in this replica's log.",
            st.last_log_index as f64,
        );
        let lags: Vec<(String, f64)> = match (&m.replication, leading) {
            (Some(r), true) => r
                .iter()
                .filter(|(id, _)| **id != st.id)
                .map(|(id, matched)| {
                    let matched = matched.map_or(0, |l| l.index);
                    (
                        id.to_string(),
                        st.last_log_index.saturating_sub(matched) as f64,
                    )
                })
                .collect(),
            _ => Vec::new(),
        };
        s.labelled_gauge(
            "raft_follower_lag_entries",
            "On the leader: entries of its log each follower has not yet matched.",
            "follower",
            &lags,
        );
        s.live(
            "raft_leader_changes",
            "Changes of the leader this replica knows of.",
            i.leader_changes.clone(),
        );
        s.live_in(
            "raft_commit",
            "From proposing an entry to its being applied at this leader.",
            Unit::Seconds,
            i.commit_seconds.clone(),
        );

        // The log on disk.
        s.live_in(
            "log_fsync",
            "fsyncs of the Raft log.",
            Unit::Seconds,
            log.fsync_seconds.clone(),
        );
        s.live(
            "log_appends_per_fsync",
            "Log appends each fsync made durable (group commit).",
            log.appends_per_fsync.clone(),
        );
        s.counter("log_appends", "Log appends made durable.", st.log_appends);
        s.counter("log_fsyncs", "fsyncs of the Raft log.", st.log_syncs);

        // Sessions, watches and caching.
        s.gauge_in(
            "session_lease",
            "The session lease this replica grants.",
            Unit::Seconds,
            self.gateway.lease_ms as f64 / 1000.0,
        );
        s.gauge(
            "sessions",
            "Open sessions in the state machine.",
            st.session_count as f64,
        );
        s.gauge(
            "nodes",
            "Nodes in the state machine, the root included.",
            st.node_count as f64,
        );
        s.live(
            "session_expiries",
            "Sessions this replica expired while it led (their lease ran out).",
            i.session_expiries.clone(),
        );
        s.counter(
            "keepalive_rpcs",
            "KeepAlive RPCs answered (a proxy's batch counts once).",
            st.keepalive_rpcs,
        );
        s.counter(
            "keepalives_renewed",
            "Session leases renewed by KeepAlives.",
            st.keepalives_renewed,
        );
        s.gauge(
            "watches",
            "Watches armed at this leader.",
            st.watches as f64,
        );
        s.gauge(
            "cachers",
            "(session, node) cacher records at this leader.",
            st.cachers as f64,
        );
        s.gauge_in(
            "oldest_unacked_invalidation",
            "Age of the oldest write held for cachers' acknowledgements (0 if none).",
            Unit::Seconds,
            st.oldest_invalidation_ms as f64 / 1000.0,
        );
        let holds = cacher_stats.map_or(0, |c| c.holds_waiting);
        s.gauge(
            "holds_waiting",
            "Writes held at this leader waiting for cachers' acknowledgements.",
            holds as f64,
        );
        s.counter(
            "invalidations_sent",
            "Invalidations sent to cachers (one per cacher and held write).",
            st.invalidations_sent,
        );

        // Snapshots.
        s.gauge_in(
            "snapshot_size",
            "Size of the last snapshot this replica built (0 if none since start).",
            Unit::Bytes,
            st.snapshot_bytes as f64,
        );
        s.gauge_in(
            "snapshot_build",
            "How long the last snapshot build took to serialize and write.",
            Unit::Seconds,
            st.snapshot_build_ms as f64 / 1000.0,
        );
        s.gauge(
            "snapshot_index",
            "Last log index of this replica's snapshot (0 if none).",
            st.snapshot_index.unwrap_or(0) as f64,
        );

        // Backups to object storage (only where `[backup]` names a store).
        if let Some(b) = &self.gateway.backup {
            use std::sync::atomic::Ordering::Relaxed;
            let st = &b.stats;
            s.counter(
                "backups_written",
                "Backups this replica wrote to the object store (as leader).",
                st.written.load(Relaxed),
            );
            s.counter(
                "backup_failures",
                "Backups, and checks of the store, that failed at this replica.",
                st.failed.load(Relaxed),
            );
            s.gauge_in(
                "backup_newest_timestamp",
                "When the newest backup of this cell in the store was taken, as this replica \
                 last wrote or (leading) listed it; 0 until then.",
                Unit::Seconds,
                st.newest_unix_secs.load(Relaxed) as f64,
            );
            s.gauge_in(
                "backup_interval",
                "How often the leader writes a backup (backup.interval_secs).",
                Unit::Seconds,
                st.interval_secs.load(Relaxed) as f64,
            );
            s.gauge_in(
                "backup_last_size",
                "Size of the last backup this replica wrote (0 if none since start).",
                Unit::Bytes,
                st.last_bytes.load(Relaxed) as f64,
            );
            s.gauge_in(
                "backup_last_duration",
                "How long the last backup this replica wrote took (copy, serialize, upload).",
                Unit::Seconds,
                st.last_ms.load(Relaxed) as f64 / 1000.0,
            );
        }

        // Refusals.
        s.live(
            "refusals",
            "Requests refused, by reason (limit, acl, wrong_cell).",
            i.refusals.clone(),
        );
        s.limit_refusals(st.refused_by_limit);

        // Peers and certificates.
        s.counter(
            "peer_dials",
            "QUIC connections dialed to peers.",
            st.peer_dials,
        );
        s.counter(
            "peer_certificate_checks",
            "Peer certificate chains checked on dialed connections.",
            st.peer_certificate_checks,
        );
        s.certificate_expiry(&self.cert);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_apart_by_reason() {
        let i = Instruments::default();
        i.refused(&Error::NotAdmin {
            action: "change admins".into(),
            identity: "lock://client/x".into(),
        });
        i.refused(&Error::NoNode { path: "/a".into() });
        let mut s = Scrape::new();
        s.live("refusals", "r", i.refusals.clone());
        let text = s.encode();
        assert!(
            text.contains("lockservice_refusals_total{reason=\"acl\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("lockservice_refusals_total{reason=\"limit\"} 0"),
            "{text}"
        );
    }
}
