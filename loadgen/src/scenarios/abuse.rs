//! `abuse` (ours only): one runaway client identity beside well-behaved ones, to show the
//! limits per identity keep the others' acquire latency (docs/security.md, "Limits per
//! identity"; issue 24, item 5).
//!
//! Well-behaved clients (the cell's dev identity) loop acquire and release, each on its
//! own lock, through three phases of equal length: alone; beside an abuser whose identity
//! (`lock://client/abuser`, a certificate issued here from the dev CA) is held to the
//! cell's default limits per identity, which loadgen sets small for this run
//! ([`ABUSER_LIMITS`]); and beside the same abuse from an identity without limits (the
//! dev identity itself), for contrast. The abuser floods writes from many connections
//! and tasks and churns sessions; a refusal by its limits is retried by its SDK, as any
//! client's would be. Reported: the well-behaved clients' acquire p50/p99 per phase, the
//! ratios to the first, and the abuser's completed writes and refusals (counted at the
//! replicas, `Status::refused_by_limit`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, CreateMode};

use super::{ticker, Ctx};
use crate::report::{Lat, Report};

/// The abuser's limits at every replica in this run (the defaults per identity, which
/// the dev identity is exempt from): `(connections, requests in flight, sessions)`.
pub const ABUSER_LIMITS: (u64, u64, u64) = (64, 16, 64);

/// The environment that gives the replicas [`ABUSER_LIMITS`] as their default limits
/// per identity (read by `ReplicaConfig::load`).
pub fn replica_env() -> Vec<(String, String)> {
    let (c, r, s) = ABUSER_LIMITS;
    [("CONNECTIONS", c), ("REQUESTS", r), ("SESSIONS", s)]
        .into_iter()
        .map(|(k, v)| {
            (
                format!("LOCKSVC_REPLICA__LIMITS__PER_IDENTITY__DEFAULT__{k}"),
                v.to_string(),
            )
        })
        .collect()
}

const ABUSER: &str = "lock://client/abuser";

/// What one phase's abuser did.
#[derive(Default)]
struct Abuse {
    writes: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    sessions: AtomicU64,
}

pub async fn abuse(ctx: &Ctx) -> anyhow::Result<Report> {
    anyhow::ensure!(
        ctx.cluster.system == crate::cluster::System::Ours,
        "abuse runs against ours only (limits per identity are ours)"
    );
    let n = ctx.n(20.0, 2);
    let phase = ctx.secs(15.0, 3.0);
    let conns = ctx.n(32.0, 4);
    let tasks = ctx.n(32.0, 8);
    let sessions = ctx.sessions(n).await?;
    for (i, s) in sessions.iter().enumerate() {
        s.ensure_dir(&format!("/bench/abuse/c{i}")).await?;
    }
    // The abuser's certificate, from the dev cell's CA.
    let tls = ctx.cluster.dir().join("cell/tls");
    let ca = wire::tls::Ca::from_pem(
        &std::fs::read_to_string(tls.join(wire::tls::CA_FILE))?,
        &std::fs::read_to_string(tls.join(wire::tls::CA_KEY_FILE))?,
    )
    .map_err(anyhow::Error::msg)?;
    let abuser_dir = ctx.cluster.dir().join("abuser");
    std::fs::create_dir_all(&abuser_dir)?;
    let c = ca
        .issue(
            &wire::identity::Identity::parse(ABUSER).map_err(anyhow::Error::msg)?,
            1,
        )
        .map_err(anyhow::Error::msg)?;
    std::fs::write(abuser_dir.join("client.pem"), c.cert_pem)?;
    std::fs::write(abuser_dir.join("client.key"), c.key_pem)?;
    let limited = || {
        let mut cfg =
            crate::systems::ours_config(ctx.cluster.endpoints.clone(), ctx.cluster.ca.clone());
        cfg.cert = abuser_dir.join("client.pem");
        cfg.key = abuser_dir.join("client.key");
        cfg
    };
    let unlimited =
        || crate::systems::ours_config(ctx.cluster.endpoints.clone(), ctx.cluster.ca.clone());

    let mut r = ctx.report("abuse");
    r.param("well-behaved clients (sessions, one lock each)", n);
    r.param("phase (s)", phase.as_secs_f64());
    r.param("abuser connections", conns);
    r.param("abuser write tasks per connection", tasks);
    let (lc, lr, ls) = ABUSER_LIMITS;
    r.param(
        "abuser's limits (connections, requests in flight, sessions)",
        format!("{lc}, {lr}, {ls}"),
    );
    let refused0 = refusals(ctx).await;
    let mut p99s = Vec::new();
    for (name, abuser) in [
        ("alone", None),
        ("beside a limited abuser", Some(true)),
        ("beside an unlimited abuser", Some(false)),
    ] {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stats = Arc::new(Abuse::default());
        let mut abusers = Vec::new();
        if let Some(limited_id) = abuser {
            for k in 0..conns {
                let cfg = if limited_id { limited() } else { unlimited() };
                let (done, stats) = (done.clone(), stats.clone());
                abusers.push(tokio::spawn(flood(cfg, k, tasks, done, stats)));
            }
            // Let the flood build up before measuring.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let acq = measure(&sessions, phase, name).await?;
        done.store(true, Ordering::SeqCst);
        for a in abusers {
            let _ = a.await;
        }
        r.latency_failed(&format!("acquire {name}"), &acq, 0);
        p99s.push(acq.summary().p99);
        if abuser.is_some() {
            r.figure(
                &format!("abuser writes per s {name}"),
                stats.writes.load(Ordering::Relaxed) as f64 / phase.as_secs_f64(),
            );
            r.figure(
                &format!("abuser requests refused by its limits {name} (at the client)"),
                stats.refused.load(Ordering::Relaxed) as f64,
            );
            r.figure(
                &format!("abuser requests failed otherwise {name}"),
                stats.failed.load(Ordering::Relaxed) as f64,
            );
            r.figure(
                &format!("abuser sessions opened {name}"),
                stats.sessions.load(Ordering::Relaxed) as f64,
            );
        }
    }
    let refused1 = refusals(ctx).await;
    for (i, what) in ["connections", "requests", "sessions"].iter().enumerate() {
        r.figure(
            &format!("refusals by limit at the replicas: {what}"),
            (refused1[i] - refused0[i]) as f64,
        );
    }
    if p99s[0] > 0.0 {
        r.figure(
            "acquire p99 ratio, limited abuser / alone",
            p99s[1] / p99s[0],
        );
        r.figure(
            "acquire p99 ratio, unlimited abuser / alone",
            p99s[2] / p99s[0],
        );
    }
    r.notes.push(
        "The well-behaved clients' every acquire and release must succeed (a failure ends \
         the run); the abuser's failures are counted, not fatal."
            .into(),
    );
    ctx.costs(&mut r);
    Ok(r)
}

/// Refusals by limit summed over the replicas: connections, requests, sessions.
async fn refusals(ctx: &Ctx) -> [u64; 3] {
    let mut sum = [0u64; 3];
    let Ok(c) = Client::connect(crate::systems::ours_config(
        ctx.cluster.endpoints.clone(),
        ctx.cluster.ca.clone(),
    ))
    .await
    else {
        return sum;
    };
    for addr in c.endpoints() {
        if let Ok(s) = c.status_of(addr).await {
            for (i, n) in s.refused_by_limit.iter().enumerate() {
                sum[i] += n;
            }
        }
    }
    sum
}

/// The well-behaved clients' acquire latencies over `phase`.
async fn measure(
    sessions: &[Arc<crate::systems::Sess>],
    phase: Duration,
    name: &str,
) -> anyhow::Result<Lat> {
    let start = Instant::now();
    let deadline = start + phase;
    let (pb, t) = ticker(phase, &format!("abuse: {name}"));
    let runs: Vec<_> = sessions
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let s = s.clone();
            tokio::spawn(async move {
                let mut acq = Lat::new(start);
                let dir = format!("/bench/abuse/c{i}");
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let (h, _) = s.acquire(&dir).await?;
                    let t1 = Instant::now();
                    acq.record(t1 - t0, t1);
                    s.release(h).await?;
                }
                anyhow::Ok(acq)
            })
        })
        .collect();
    let mut acq = Lat::new(start);
    for run in runs {
        acq.merge(&run.await??);
    }
    t.abort();
    pb.finish_and_clear();
    Ok(acq)
}

/// One abuser connection: `tasks` tasks writing as fast as they are answered, and one
/// opening and closing sessions, until `done`.
async fn flood(
    cfg: client_sdk::ClientConfig,
    k: usize,
    tasks: usize,
    done: Arc<std::sync::atomic::AtomicBool>,
    stats: Arc<Abuse>,
) {
    let count = |r: &Result<(), wire::Error>, stats: &Abuse| match r {
        Ok(()) => {}
        Err(wire::Error::TooManyFor { .. }) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => {
            stats.failed.fetch_add(1, Ordering::Relaxed);
        }
    };
    let client = match Client::connect(cfg).await {
        Ok(c) => c,
        Err(e) => {
            count(&Err(e), &stats);
            return;
        }
    };
    let session = match client.open_session().await {
        Ok(s) => Arc::new(s),
        Err(e) => {
            count(&Err(e), &stats);
            return;
        }
    };
    stats.sessions.fetch_add(1, Ordering::Relaxed);
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (session, done, stats) = (session.clone(), done.clone(), stats.clone());
        handles.push(tokio::spawn(async move {
            let path = format!("/bench/abuse-flood-{k}-{t}");
            let r = session
                .create(&path, Vec::new(), CreateMode::default())
                .await
                .map(|_| ());
            if !matches!(r, Err(wire::Error::NodeExists { .. })) {
                count(&r, &stats);
            }
            let mut i = 0u64;
            while !done.load(Ordering::Relaxed) {
                i += 1;
                let r = session
                    .set_data(&path, i.to_be_bytes().to_vec(), None)
                    .await
                    .map(|_| ());
                if r.is_ok() {
                    stats.writes.fetch_add(1, Ordering::Relaxed);
                }
                count(&r, &stats);
            }
        }));
    }
    // Session churn beside the writes.
    let churn = {
        let (client, done, stats) = (client.clone(), done.clone(), stats.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                match client.open_session().await {
                    Ok(s) => {
                        stats.sessions.fetch_add(1, Ordering::Relaxed);
                        let _ = s.close().await;
                    }
                    Err(e) => {
                        count(&Err(e), &stats);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        })
    };
    for h in handles {
        let _ = h.await;
    }
    let _ = churn.await;
    let _ = session.close().await;
}
