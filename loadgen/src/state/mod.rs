//! The `state` scenario: a cell holding the seed's large state, and what it costs.
//!
//! At full scale: 100 000 nodes of 1 000 bytes (about 100 MB of data) and 50 000 sessions
//! (kept alive through proxies). Reported: every replica's resident memory before and
//! after; the snapshot each replica builds on demand (`Op::Snapshot`: size, time, and how
//! long writes stall while the leader serializes); a follower killed (`kill -9`) and
//! restarted (time until it answers, time until it has caught up); a new replica added as
//! a learner (time until `AddLearner` returns, which openraft does once the learner has
//! caught up, from a snapshot since the log is purged behind it). Sessions lost must be 0.
//!
//! Ours in `ours.rs`, etcd's and ZooKeeper's in `peers.rs`; what they share here.

mod ours;
pub mod peers;

use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::bail;

use crate::cluster::System;
use crate::report::{rss_mb, Report};
use crate::scenarios::Ctx;

/// Bytes of data per node.
pub(crate) const NODE_BYTES: usize = 1_000;
/// Nodes per directory.
pub(crate) const PER_DIR: usize = 1_000;
/// How often a member is asked how far it has applied.
const POLL: Duration = Duration::from_millis(20);

/// The state scenario (etcd and ZooKeeper: [`peers::state`], where ZooKeeper's sessions
/// may be split over `processes` loadgen processes).
pub async fn state(ctx: &Ctx, processes: usize) -> anyhow::Result<Report> {
    if ctx.cluster.system == System::Ours {
        ours::state(ctx).await
    } else {
        peers::state(ctx, processes).await
    }
}

/// Every member's resident memory, as figures "replica-<i> RSS <when> (MB)".
fn rss_of(ctx: &Ctx, r: &mut Report, when: &str) {
    for (i, m) in ctx.cluster.members.iter().enumerate() {
        if let Some(mb) = ctx.cluster.pid_of(m).and_then(rss_mb) {
            r.figure(&format!("replica-{} RSS {when} (MB)", i + 1), mb);
        }
    }
}

/// Polls `probe` every [`POLL`] until it reports `index` applied; returns when the member
/// first answered and when it had caught up, both from `from`. `probe` gives `None` when
/// the member does not answer, `Some(None)` when it answers but does not serve yet, and
/// `Some(Some(applied))` when it serves.
async fn catch_up<F, Fut>(
    what: &str,
    index: u64,
    from: Instant,
    within: Duration,
    mut probe: F,
) -> anyhow::Result<(Duration, Duration)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<Option<u64>>>,
{
    let mut answered = None;
    let mut last = None;
    while from.elapsed() < within {
        if let Some(applied) = probe().await {
            answered.get_or_insert(from.elapsed());
            last = applied.or(last);
            if applied.is_some_and(|a| a >= index) {
                return Ok((answered.unwrap_or_default(), from.elapsed()));
            }
        }
        tokio::time::sleep(POLL).await;
    }
    match (answered, last) {
        (None, _) => bail!("{what} did not answer within {within:?}"),
        (Some(_), None) => bail!("{what} answered but did not serve within {within:?}"),
        (Some(_), Some(a)) => {
            bail!("{what} did not reach index {index} within {within:?} (it was at {a})")
        }
    }
}
