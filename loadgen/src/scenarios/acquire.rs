//! `acquire`: uncontended acquire and release, each client on its own lock.

use tokio::time::Instant;

use super::{etcd_grpc_counts, ticker, Ctx, ALL_OR_NOTHING};
use crate::report::{Lat, Report};

/// Uncontended acquire/release: each client loops on its own lock.
pub async fn acquire(ctx: &Ctx) -> anyhow::Result<Report> {
    let n = ctx.n(20.0, 2);
    let dur = ctx.secs(20.0, 3.0);
    let sessions = ctx.sessions(n).await?;
    for (i, s) in sessions.iter().enumerate() {
        s.ensure_dir(&format!("/bench/acq/c{i}")).await?;
    }
    let conns = ctx.client_connections().await;
    // Connections that moved to another member during the setup (a request timed out
    // there) each opened one more.
    let moves = crate::systems::etcd_conn::MOVES.load(std::sync::atomic::Ordering::Relaxed);
    let rpcs0 =
        etcd_grpc_counts(&ctx.cluster, "grpc_server_handled_total", "etcdserverpb.KV").await;
    let start = Instant::now();
    let deadline = start + dur;
    let (pb, t) = ticker(dur, "acquire");
    let tasks: Vec<_> = sessions
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let s = s.clone();
            tokio::spawn(async move {
                let (mut acq, mut rel) = (Lat::new(start), Lat::new(start));
                let dir = format!("/bench/acq/c{i}");
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let (h, _) = s.acquire(&dir).await?;
                    let t1 = Instant::now();
                    acq.record(t1 - t0, t1);
                    s.release(h).await?;
                    let t2 = Instant::now();
                    rel.record(t2 - t1, t2);
                }
                anyhow::Ok((acq, rel))
            })
        })
        .collect();
    let (mut acq, mut rel) = (Lat::new(start), Lat::new(start));
    for t in tasks {
        let (a, r) = t.await??;
        acq.merge(&a);
        rel.merge(&r);
    }
    t.abort();
    pb.finish_and_clear();
    let rpcs1 =
        etcd_grpc_counts(&ctx.cluster, "grpc_server_handled_total", "etcdserverpb.KV").await;
    let mut r = ctx.report("acquire");
    r.param("clients (sessions, one lock each)", n);
    r.param("sessions held", super::sessions_model(&ctx.conn));
    r.param("duration (s)", dur.as_secs_f64());
    // Any failed operation ends the run with an error: a report has none.
    r.latency_failed("acquire", &acq, 0);
    r.latency_failed("release", &rel, 0);
    r.notes.push(ALL_OR_NOTHING.into());
    // etcd: what the lock recipe cost, counted by the servers (every member's
    // grpc_server_handled_total; a follower answers a KV request itself or forwards it
    // over raft, not over gRPC, so the sum counts each client request once).
    if let (Some(a), Some(b)) = (rpcs0, rpcs1) {
        for m in ["Txn", "Range", "DeleteRange", "Put"] {
            let n = b.get(m).unwrap_or(&0.0) - a.get(m).unwrap_or(&0.0);
            r.figure(
                &format!("etcd {m} RPCs per acquire and release (at the servers)"),
                n / acq.count().max(1) as f64,
            );
        }
    }
    r.figure("acquires per s", acq.count() as f64 / dur.as_secs_f64());
    if let Some(c) = conns {
        r.figure(
            "client TCP connections to the servers (loadgen's, at the start)",
            c as f64,
        );
        r.figure(
            "etcd clients moved to another member (until the start)",
            moves as f64,
        );
    }
    ctx.costs(&mut r);
    Ok(r)
}
