//! `burst`: a mass restart, 2 000 new sessions a second each taking a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use super::Ctx;
use crate::cluster::System;
use crate::report::bar;
use crate::report::{Lat, Report};
use crate::systems::Conn;

/// A mass restart: clients arrive at a fixed rate (2 000 a second at full scale), each
/// opening a new session and taking one of a pool of existing locks (its own: the pool
/// outlasts the hold), holding it briefly, then closing. Latency is from arrival (session
/// open included) to grant.
///
/// Each arrival is a new client process, the same for all three systems: it opens a
/// connection of its own (ours: a new SDK client, so a new QUIC connection; etcd: a new
/// gRPC client; ZooKeeper: a new connection, as a session is one) and drops it when it
/// is done. Its arrival time is its scheduled moment, not when loadgen got round to it:
/// an arrival that waits for one of the 4 000 in-flight places (or for loadgen's own
/// runtime) carries that wait in its latency, as a queue in front of the servers would.
pub async fn burst(ctx: &Ctx) -> anyhow::Result<Report> {
    let rate = (2000.0 * ctx.scale).max(20.0);
    let dur = ctx.secs(30.0, 3.0);
    let hold = Duration::from_secs(2);
    let total = (rate * dur.as_secs_f64()) as u64;
    // Locks are reused after pool / rate seconds, well after their 2 s hold.
    let pool = ((rate * 5.0) as u64).min(total).max(1);
    let setup = ctx.sessions(64).await?;
    setup[0].ensure_dir("/bench/burst").await?;
    let made = Arc::new(AtomicU64::new(0));
    let creators: Vec<_> = setup
        .iter()
        .map(|s| {
            let (s, made) = (s.clone(), made.clone());
            tokio::spawn(async move {
                loop {
                    let i = made.fetch_add(1, Ordering::SeqCst);
                    if i >= pool {
                        return anyhow::Ok(());
                    }
                    s.ensure_dir(&format!("/bench/burst/l{i}")).await?;
                }
            })
        })
        .collect();
    for c in creators {
        c.await??;
    }
    // Up to 4 000 arrivals at once, each a client of its own (a connection and a session).
    const IN_FLIGHT: usize = 4_000;
    let (system, endpoints, ca) = (
        ctx.cluster.system,
        Arc::new(ctx.cluster.endpoints.clone()),
        Arc::new(ctx.cluster.ca.clone()),
    );
    let start = Instant::now();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let failed = Arc::new(AtomicU64::new(0));
    let acquires_failed = Arc::new(AtomicU64::new(0));
    // How many arrivals failed with each error (its first line), for the report's notes.
    let reasons: Arc<Mutex<std::collections::BTreeMap<String, u64>>> = Arc::default();
    // Ours: the local address of each arrival's connection, to show they are its own.
    let local_addrs: Arc<Mutex<std::collections::HashSet<std::net::SocketAddr>>> = Arc::default();
    let pb = bar(total, "arrivals");
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due).await;
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            break;
        };
        let (endpoints, ca) = (endpoints.clone(), ca.clone());
        let (lease, failed, pb) = (ctx.lease, failed.clone(), pb.clone());
        let (reasons, acquires_failed) = (reasons.clone(), acquires_failed.clone());
        let local_addrs = local_addrs.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            // Its scheduled moment: any wait for a place or for loadgen counts.
            let arrived = due;
            let r = async {
                // A new client process: its own connection (dropped at the end).
                let conn = Conn::for_endpoints(system, &endpoints, &ca).await?;
                if let Conn::Ours(c) = &conn {
                    local_addrs.lock().expect("addrs").insert(c.local_addr()?);
                }
                let s = conn.session(lease).await?;
                let dir = format!("/bench/burst/l{}", i % pool);
                let t0 = Instant::now();
                let acquired = s.acquire(&dir).await;
                if acquired.is_err() {
                    acquires_failed.fetch_add(1, Ordering::Relaxed);
                }
                let (h, _) = acquired?;
                let granted = Instant::now();
                tokio::time::sleep(hold).await;
                s.release(h).await?;
                s.close().await;
                anyhow::Ok((arrived, t0, granted))
            }
            .await;
            pb.inc(1);
            if let Err(e) = &r {
                failed.fetch_add(1, Ordering::Relaxed);
                let reason = crate::report::reason_of(e);
                *reasons.lock().expect("reasons").entry(reason).or_default() += 1;
            }
            r.ok()
        }));
    }
    let offered = start.elapsed();
    let (mut restart, mut acq) = (Lat::new(start), Lat::new(start));
    for t in tasks {
        if let Some((arrived, t0, granted)) = t.await? {
            restart.record(granted - arrived, granted);
            acq.record(granted - t0, granted);
        }
    }
    pb.finish_and_clear();
    let mut r = ctx.report("burst");
    r.param("arrivals (new session + own lock each)", total);
    r.param(
        "connection per arrival",
        "a new client each, dropped at its end (ours: an SDK client, its own QUIC \
         connection; etcd: a gRPC client; ZooKeeper: a connection)",
    );
    r.param(
        "arrival time",
        "its scheduled moment (a wait for an in-flight place counts)",
    );
    r.param(
        "connection limits at the servers",
        match system {
            System::Ours => format!(
                "{} per replica, from one address too (all of loadgen's come from 127.0.0.1)",
                crate::cluster::CONNECTIONS_MAX
            ),
            System::Zk => "maxClientCnxns=0 (no per-address limit)".to_string(),
            System::Etcd => "none".to_string(),
        },
    );
    r.param(
        "transport",
        match system {
            System::Ours => "QUIC with mutual TLS (a client certificate checked per connection)",
            System::Etcd | System::Zk => "plain TCP (peers.sh starts them without TLS)",
        },
    );
    r.param("offered rate (per s)", rate);
    r.param("hold (s)", hold.as_secs());
    r.param("locks (reused round robin)", pool);
    let failed = failed.load(Ordering::Relaxed);
    r.latency_failed("arrival to grant", &restart, failed);
    r.latency_failed("acquire", &acq, acquires_failed.load(Ordering::Relaxed));
    r.figure(
        "achieved arrivals per s",
        total as f64 / offered.as_secs_f64(),
    );
    r.figure("failed", failed as f64);
    if system == System::Ours {
        r.figure(
            "distinct client connections (local UDP ports)",
            local_addrs.lock().expect("addrs").len() as f64,
        );
    }
    for (reason, n) in reasons.lock().expect("reasons").iter() {
        r.notes
            .push(format!("{n} arrivals failed: {reason} (numbers left out)"));
    }
    ctx.costs(&mut r);
    Ok(r)
}
