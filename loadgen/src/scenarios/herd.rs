//! `herd`: 2 000 contenders on one lock, each taking it and releasing it at once.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use super::{etcd_grpc_counts, Ctx};
use crate::cluster::Cluster;
use crate::report::bar;
use crate::report::{Lat, Report};
use crate::systems::{open_many, Conn, Sess, ETCD_LEASE_PER_CLIENT};

/// How long a herd's contenders keep trying before the rest count as never granted.
const HERD_PATIENCE: Duration = Duration::from_secs(600);

/// What one herd contender did.
struct Contender {
    /// When it was granted the lock, the hand-off time (from the previous holder's first
    /// release call), and its fencing token; `None` if it never was.
    granted: Option<(Instant, Option<Duration>, u64)>,
    acquire_failed: u64,
    release_failed: u64,
    first_error: Option<String>,
}

/// Aborts its tasks when dropped.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// N contenders on one lock: each takes it, then releases it at once. Hand-off latency is
/// from the previous holder's release call to the next grant. A failed acquire or release
/// is counted and tried again on the same session (as an application would), so one
/// slow request costs its time in the hand-offs instead of ending the run.
pub async fn herd(ctx: &Ctx) -> anyhow::Result<Report> {
    let n = ctx.n(2000.0, 10);
    // Streams counted from before the sessions open (their keep-alive streams open with
    // them).
    let streams0 = etcd_streams(&ctx.cluster).await;
    let sessions = herd_sessions(ctx, n).await?;
    let dir = "/bench/herd";
    sessions[0].ensure_dir(dir).await?;
    let (first, _) = sessions[0].acquire(dir).await?;
    let start = Instant::now();
    let give_up = start + HERD_PATIENCE;
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let pb = bar(n as u64 - 1, "hand-offs");
    let tasks: Vec<_> = sessions[1..]
        .iter()
        .map(|s| {
            let (s, last, pb) = (s.clone(), last_release.clone(), pb.clone());
            tokio::spawn(async move {
                let mut me = Contender {
                    granted: None,
                    acquire_failed: 0,
                    release_failed: 0,
                    first_error: None,
                };
                let mut retry = false;
                let (h, token) = loop {
                    let tried = if retry {
                        s.acquire_again(dir).await
                    } else {
                        s.acquire(dir).await
                    };
                    match tried {
                        Ok(got) => break got,
                        Err(e) => {
                            me.acquire_failed += 1;
                            me.first_error.get_or_insert(format!("acquire: {e:#}"));
                            // A session that is over cannot take the lock any more.
                            if Instant::now() >= give_up || s.lost() {
                                return me;
                            }
                            retry = true;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                };
                let now = Instant::now();
                let waited = last.lock().expect("last").map(|t| now - t);
                *last.lock().expect("last") = Some(Instant::now());
                me.granted = Some((now, waited, token));
                // Until it succeeds: a lock not released stays held until its session
                // ends, and the next hand-off's time runs from the first release call.
                let mut h = Some(h);
                while let Some(held) = h.take() {
                    let again = held.again();
                    if let Err(e) = s.release(held).await {
                        me.release_failed += 1;
                        me.first_error.get_or_insert(format!("release: {e:#}"));
                        // A session that is over released its locks with it.
                        if Instant::now() < give_up && !s.lost() {
                            h = again;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
                pb.inc(1);
                me
            })
        })
        .collect();
    // Stops every contender if this returns early.
    let _stop = AbortOnDrop(tasks.iter().map(|t| t.abort_handle()).collect());
    // Let every contender queue behind the first holder.
    let settle = Duration::from_millis(1000 + n as u64);
    tokio::time::sleep(settle).await;
    let released = Instant::now();
    *last_release.lock().expect("last") = Some(released);
    // Retried as the contenders' releases are.
    let mut h = Some(first);
    let mut first_release_failed = 0u64;
    while let Some(held) = h.take() {
        let again = held.again();
        if let Err(e) = sessions[0].release(held).await {
            first_release_failed += 1;
            if Instant::now() >= give_up || sessions[0].lost() {
                return Err(e.context("the first holder could not release the lock"));
            }
            h = again;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut lat = Lat::new(start);
    let mut tokens = Vec::new();
    let (mut never, mut acquire_failed, mut release_failed) = (0u64, 0u64, first_release_failed);
    let mut first_error = None;
    for t in tasks {
        // A contender still running after the patience (and a minute for its last
        // request) is stopped and counts as never granted.
        let abort = t.abort_handle();
        let me = match tokio::time::timeout_at(give_up + Duration::from_secs(60), t).await {
            Ok(me) => me?,
            Err(_) => {
                abort.abort();
                never += 1;
                continue;
            }
        };
        acquire_failed += me.acquire_failed;
        release_failed += me.release_failed;
        if first_error.is_none() {
            first_error = me.first_error;
        }
        match me.granted {
            Some((at, waited, token)) => {
                if let Some(w) = waited {
                    lat.record(w, at);
                }
                tokens.push((at, token));
            }
            None => never += 1,
        }
    }
    pb.finish_and_clear();
    let total = released.elapsed();
    let streams1 = etcd_streams(&ctx.cluster).await;
    tokens.sort();
    let increasing = tokens.windows(2).all(|w| w[0].1 < w[1].1);
    let mut r = ctx.report("herd");
    r.param("contenders (sessions)", n);
    r.param("sessions held", super::sessions_model(&ctx.conn));
    if matches!(ctx.conn, Conn::Etcd(_)) {
        r.param("etcd lock waits", "a gRPC client's on its one watch stream");
    }
    r.latency_failed("hand-off", &lat, never);
    r.notes.push(format!(
        "hand-off failed: contenders never granted the lock within {} s (or whose session \
         ended); a failed acquire or release is tried again on the same session after \
         100 ms and counted below (etcd's key stays the session's, as clientv3's Mutex, \
         and a failed wait deletes it first, as Mutex.Lock does; ZooKeeper's node is \
         named with the session id and found again, as Curator's protected mode finds its \
         GUID, and a failed wait deletes it, as Curator's lock does)",
        HERD_PATIENCE.as_secs()
    ));
    r.figure(
        "acquire attempts failed (each tried again)",
        acquire_failed as f64,
    );
    r.figure(
        "release attempts failed (each tried again)",
        release_failed as f64,
    );
    if let Some(e) = first_error {
        r.notes.push(format!("first failure: {e}"));
    }
    r.figure("total after first release (s)", total.as_secs_f64());
    r.figure("hand-offs per s", tokens.len() as f64 / total.as_secs_f64());
    if let (Some(a), Some(b)) = (streams0, streams1) {
        // Counted at etcd's servers: how the contenders' clients used their streams.
        for (m, what) in [
            ("Watch", "etcd Watch streams opened (at the servers)"),
            (
                "LeaseKeepAlive",
                "etcd LeaseKeepAlive streams opened (at the servers)",
            ),
        ] {
            r.figure(what, b.get(m).unwrap_or(&0.0) - a.get(m).unwrap_or(&0.0));
        }
    }
    if let Conn::Ours(_) = ctx.conn {
        let events: u64 = sessions
            .iter()
            .map(|s| match s.as_ref() {
                Sess::Ours(s) => s.watch_events_received(),
                _ => 0,
            })
            .sum();
        r.figure("watch events per hand-off", events as f64 / (n - 1) as f64);
    }
    if !increasing {
        r.notes
            .push("fencing tokens did not increase with grant order".into());
    }
    ctx.costs(&mut r);
    Ok(r)
}

/// The contenders' sessions, held as each system's own client holds many: ours, all on
/// one SDK client (one QUIC connection); etcd, 2 000 leases on one gRPC client, their lock waits on its
/// one watch stream (and with `--etcd-shared-keepalive` their renewals on its one
/// keep-alive stream), as one clientv3 process with 2 000 `concurrency.Session`s holds
/// them; ZooKeeper, a connection each (a ZooKeeper session is its connection).
async fn herd_sessions(ctx: &Ctx, n: usize) -> anyhow::Result<Vec<Arc<Sess>>> {
    match &ctx.conn {
        Conn::Etcd(_) => {
            anyhow::ensure!(
                !ETCD_LEASE_PER_CLIENT.load(Ordering::Relaxed),
                "herd needs a lease per contender: clientv3's Mutex names its key after the \
                 session's lease, so contenders sharing one lease would share one key; run \
                 herd without --etcd-lease-per-client"
            );
            Ok(open_many(&ctx.conn, n, ctx.lease)
                .await?
                .into_iter()
                .map(Arc::new)
                .collect())
        }
        _ => ctx.sessions(n).await,
    }
}

/// etcd's `Watch` and `LeaseKeepAlive` streams begun so far, summed over the members
/// (`None` for the other systems).
async fn etcd_streams(cluster: &Cluster) -> Option<std::collections::BTreeMap<String, f64>> {
    let mut all =
        etcd_grpc_counts(cluster, "grpc_server_started_total", "etcdserverpb.Watch").await?;
    all.extend(etcd_grpc_counts(cluster, "grpc_server_started_total", "etcdserverpb.Lease").await?);
    Some(all)
}
