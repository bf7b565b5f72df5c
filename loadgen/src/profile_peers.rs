//! The `profile` scenario against etcd and ZooKeeper: the seed's steady state with each
//! peer's own sessions, lock recipe and reads, so it can be set beside ours.
//!
//! The same load as ours (see [`crate::profile`]): 50 000 sessions at full scale, 15 000
//! locks held all run and 5 000 taken once a period (held 1 s), every session reading one
//! of 100 config values once a second, 10 config writes a second, 10 sessions a second
//! closed and replaced; `--fault kill|freeze` kills or freezes the leader 40 % in.
//!
//! What differs is what the peers are:
//! - **etcd**: a session is a lease renewed every 4 s; 2 000 leases share a gRPC client,
//!   each renewed on its own keep-alive stream (as independent clients would), or with
//!   `--etcd-shared-keepalive` all on one ([`crate::etcd_leases`], as one clientv3
//!   process holding them would). Every renewal goes to the leader (followers forward
//!   them). Reads are
//!   linearizable ranges, served by the cluster: etcd has no client cache.
//! - **ZooKeeper**: a session is a TCP connection (50 000 of them); its client pings the
//!   member it is connected to. Reads are `getData` at that member (sequentially
//!   consistent, not linearizable), with no client cache.
//!
//! Neither has a proxy tier, so every read and every renewal reaches the cluster; the
//! report says how many were achieved, since a reader waits for its previous read.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use crate::profile::{
    each, join_tasks, lat, record, run_with_fault, spawn_config_writer, spawn_keepalive_sampler,
    Fault, Injected, CONFIG_KEYS,
};
use crate::report::{Lat, Report};
use crate::scenarios::Ctx;
use crate::systems::{open_many, Held, Sess, ETCD_RENEWALS};

/// Locks under this directory; config values under `/profile/config`.
const LOCKS: &str = "/profile/locks";

/// The profile scenario for etcd and ZooKeeper. `reads_per_s` is each session's config
/// reads a second.
pub async fn profile(
    ctx: &Ctx,
    secs: Option<f64>,
    fault: Option<Fault>,
    reads_per_s: f64,
) -> anyhow::Result<Report> {
    let n = ctx.n(50_000.0, 50);
    let long_locks = ctx.n(15_000.0, 10).min(n);
    let short_locks = ctx.n(5_000.0, 5).min(n - long_locks);
    let dur = secs.map_or_else(|| ctx.secs(120.0, 20.0), Duration::from_secs_f64);
    let short_period = Duration::from_secs(60).min(dur / 3);
    let config_writes_per_s = 10.0;
    let churn_per_s = (n as f64 / 5_000.0).max(1.0);
    let locks = long_locks + short_locks;

    // Setup: the namespace (ZooKeeper needs parents), the config values, the sessions,
    // then the long-held locks.
    let admin = ctx.conn.session(ctx.lease).await?;
    admin.ensure_dir(LOCKS).await?;
    admin.ensure_dir("/profile/config").await?;
    for k in 0..CONFIG_KEYS {
        let key = format!("/profile/config/k{k}");
        admin.prepare_key(&key).await?;
        admin.write(&key, vec![b'v'; 100]).await?;
    }
    let admin = Arc::new(admin);
    each(locks, 128, "lock dirs", |i| {
        let admin = admin.clone();
        async move { admin.ensure_dir(&format!("{LOCKS}/l{i}")).await }
    })
    .await?;
    let opened = Instant::now();
    let sessions = open_many(&ctx.conn, n, ctx.lease).await?;
    let open_secs = opened.elapsed().as_secs_f64();
    let sessions: Vec<Arc<Sess>> = sessions.into_iter().map(Arc::new).collect();
    let held: Arc<Mutex<Vec<(usize, Held)>>> = Arc::default();
    let setup_errors = Arc::new(AtomicU64::new(0));
    each(long_locks, 128, "long locks", |i| {
        let (s, held, setup_errors) = (sessions[i].clone(), held.clone(), setup_errors.clone());
        async move {
            match s.acquire(&format!("{LOCKS}/l{i}")).await {
                Ok((h, _)) => held.lock().expect("held").push((i, h)),
                Err(e) => {
                    if setup_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        eprintln!("loadgen: a long-held lock was not taken: {e:#}");
                    }
                }
            }
            Ok(())
        }
    })
    .await?;
    let slots: Arc<Vec<Mutex<Arc<Sess>>>> =
        Arc::new(sessions.into_iter().map(Mutex::new).collect());

    // The run.
    let start = Instant::now();
    let deadline = start + dur;
    let stop = Arc::new(AtomicBool::new(false));
    let (acq, ka, rd, wr) = (lat(start), lat(start), lat(start), lat(start));
    let writes_ok: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let errors = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicU64::new(0));
    let churned = Arc::new(AtomicU64::new(0));
    let renewals0 = ETCD_RENEWALS.load(Ordering::Relaxed);
    let mut tasks = Vec::new();

    // Short locks: as ours.
    for j in 0..short_locks {
        let i = long_locks + j;
        let (slots, acq, stop, errors) = (slots.clone(), acq.clone(), stop.clone(), errors.clone());
        let offset = short_period.mul_f64(rand::random::<f64>());
        tasks.push(tokio::spawn(async move {
            let mut due = start + offset;
            let dir = format!("{LOCKS}/l{i}");
            while due < deadline && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(due).await;
                let s = slots[i].lock().expect("slot").clone();
                let t0 = Instant::now();
                match s.acquire(&dir).await {
                    Ok((h, _)) => {
                        let t1 = Instant::now();
                        record(&acq, t1 - t0, t1);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        if s.release(h).await.is_err() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                due += short_period;
            }
        }));
    }

    // Readers: one task per 50 sessions, each reading its value once a period; a reader
    // waits for its previous read, so a saturated cluster lowers the rate achieved.
    if reads_per_s > 0.0 {
        let period = Duration::from_secs_f64(1.0 / reads_per_s);
        for first in (0..n).step_by(50) {
            let (slots, rd, stop, reads, errors) = (
                slots.clone(),
                rd.clone(),
                stop.clone(),
                reads.clone(),
                errors.clone(),
            );
            let offset = period.mul_f64(rand::random::<f64>());
            tasks.push(tokio::spawn(async move {
                let mut due = start + offset;
                let mut local = Lat::new(start);
                while due < deadline && !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep_until(due).await;
                    for i in first..(first + 50).min(slots.len()) {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let s = slots[i].lock().expect("slot").clone();
                        let t0 = Instant::now();
                        match s
                            .read(&format!("/profile/config/k{}", i % CONFIG_KEYS))
                            .await
                        {
                            Ok(_) => {
                                let t1 = Instant::now();
                                local.record(t1 - t0, t1);
                                reads.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    due += period;
                    // Behind by more than a period: skip the missed rounds.
                    let now = Instant::now();
                    if due + period < now {
                        due = now;
                    }
                }
                rd.lock().expect("lat").merge(&local);
            }));
        }
    }

    // The config writer: retries a failed write (its failures are the unavailability).
    tasks.push(spawn_config_writer(
        {
            let admin = admin.clone();
            move |key: String, value: Vec<u8>| {
                let admin = admin.clone();
                async move { admin.write(&key, value).await.is_ok() }
            }
        },
        config_writes_per_s,
        deadline,
        stop.clone(),
        wr.clone(),
        writes_ok.clone(),
    ));

    // Churn: sessions that hold no lock are closed and replaced by new ones.
    {
        let (slots, conn, lease, stop, churned, errors) = (
            slots.clone(),
            ctx.conn.clone(),
            ctx.lease,
            stop.clone(),
            churned.clone(),
            errors.clone(),
        );
        let plain = locks..n;
        tasks.push(tokio::spawn(async move {
            if plain.is_empty() {
                return;
            }
            let every = Duration::from_secs_f64(1.0 / churn_per_s);
            let mut due = start;
            while due < deadline && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(due).await;
                let i = plain.start + rand::random::<usize>() % plain.len();
                let old = slots[i].lock().expect("slot").clone();
                match old.reopen(&conn, lease).await {
                    Ok(fresh) => {
                        *slots[i].lock().expect("slot") = Arc::new(fresh);
                        // Readers may still hold the old one for a moment; it is closed
                        // when the last of them lets go.
                        match Arc::try_unwrap(old) {
                            Ok(s) => s.close().await,
                            Err(shared) => {
                                tokio::spawn(async move {
                                    for _ in 0..100 {
                                        if Arc::strong_count(&shared) == 1 {
                                            break;
                                        }
                                        tokio::time::sleep(Duration::from_millis(50)).await;
                                    }
                                    if let Ok(s) = Arc::try_unwrap(shared) {
                                        s.close().await;
                                    }
                                });
                            }
                        }
                        churned.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                due += every;
            }
        }));
    }

    // KeepAlive round trips (etcd; ZooKeeper's client pings on its own and does not say).
    tasks.push(spawn_keepalive_sampler(
        slots.len(),
        {
            let slots = slots.clone();
            move |i| slots[i].lock().expect("slot").last_keepalive()
        },
        start,
        deadline,
        stop.clone(),
        ka.clone(),
    ));

    // The fault, 40 % into the run.
    let injected = run_with_fault(ctx, start, deadline, fault).await?;
    stop.store(true, Ordering::SeqCst);
    let elapsed = start.elapsed().as_secs_f64();
    let renewed = ETCD_RENEWALS
        .load(Ordering::Relaxed)
        .saturating_sub(renewals0);
    join_tasks(tasks, &errors).await;
    if let Some(i) = &injected {
        i.resume(ctx);
    }

    // Results.
    let lost = slots
        .iter()
        .filter(|s| s.lock().expect("slot").lost())
        .count()
        + usize::from(admin.lost());
    let held = std::mem::take(&mut *held.lock().expect("held"));
    let mut held_long = 0;
    for (i, h) in &held {
        let s = slots[*i].lock().expect("slot").clone();
        if !s.lost() && s.holds(h).await.unwrap_or(false) {
            held_long += 1;
        }
    }
    let mut r = ctx.report(Injected::scenario(fault));
    r.param("sessions", n);
    match &*admin {
        Sess::Etcd(..) => r.param(
            "gRPC connections (leases per connection)",
            format!(
                "{} ({})",
                n.div_ceil(crate::systems::ETCD_LEASES_PER_CLIENT),
                crate::systems::ETCD_LEASES_PER_CLIENT
            ),
        ),
        _ => r.param("TCP connections (one per session)", n),
    }
    if matches!(&*admin, Sess::Etcd(..)) {
        r.param(
            "etcd keep-alive streams",
            if crate::systems::ETCD_SHARED_KEEPALIVE.load(Ordering::Relaxed) {
                "one per gRPC connection (--etcd-shared-keepalive)"
            } else {
                "one per lease"
            },
        );
        r.param(
            "etcd lease clients connected to",
            if crate::systems::ETCD_LEADER_ONLY.load(Ordering::Relaxed) {
                "the leader only (--etcd-leader-only)"
            } else {
                "all members, spread"
            },
        );
    }
    r.param("proxies", 0);
    r.param("loadgen processes", 1);
    r.param("locks held all run", long_locks);
    r.param(
        "short locks (each taken once a period, held 1 s)",
        format!("{short_locks} (period {:.0} s)", short_period.as_secs_f64()),
    );
    r.param(
        "config values (each session reads one a second)",
        CONFIG_KEYS,
    );
    r.param("config reads per session per s", reads_per_s);
    r.param("config writes per s", config_writes_per_s);
    r.param("sessions churned per s", churn_per_s);
    r.param("run (s)", format!("{elapsed:.0}"));
    r.latency("acquire (short locks)", &acq.lock().expect("lat"));
    if ka.lock().expect("lat").count() > 0 {
        r.latency("KeepAlive round trip", &ka.lock().expect("lat"));
    }
    if reads_per_s > 0.0 {
        r.latency("config read (uncached)", &rd.lock().expect("lat"));
    }
    r.latency("config write", &wr.lock().expect("lat"));
    r.figure("sessions opened per s (setup)", n as f64 / open_secs);
    r.figure(
        "session opens retried (setup)",
        crate::systems::OPEN_RETRIES.load(Ordering::Relaxed) as f64,
    );
    r.figure("sessions lost", lost as f64);
    r.figure("long-held locks still held", held_long as f64);
    let read_rate = reads.load(Ordering::Relaxed) as f64 / elapsed;
    r.figure("config reads per s (at clients)", read_rate);
    r.figure("client cache hit rate (%)", 0.0);
    r.figure("reads reaching the cell per s", read_rate);
    r.figure("sessions churned", churned.load(Ordering::Relaxed) as f64);
    r.figure("operation errors", errors.load(Ordering::Relaxed) as f64);
    r.figure(
        "setup errors (long-held locks not taken)",
        setup_errors.load(Ordering::Relaxed) as f64,
    );
    if matches!(&*admin, Sess::Etcd(..)) {
        // Followers forward every LeaseKeepAlive to the leader.
        r.figure(
            "KeepAlive RPCs at the leader per s",
            renewed as f64 / elapsed,
        );
        r.figure("leases renewed per s", renewed as f64 / elapsed);
    } else {
        r.notes.push(format!(
            "ZooKeeper sessions are kept alive by the member each is connected to (the \
             client pings after 1.8 s without a request, 3/20 of the session timeout{}); \
             the client does not expose the round trip, so there is no KeepAlive latency row",
            if reads_per_s >= 1.0 {
                "; the readers' requests keep most sessions busy instead"
            } else {
                ""
            }
        ));
    }
    r.notes.push(format!(
        "no client cache: every config read reaches the cluster; the readers achieved \
         {read_rate:.0} of the {:.0} reads a second asked for",
        n as f64 * reads_per_s
    ));
    if let Some(i) = &injected {
        i.report(&mut r, &writes_ok.lock().expect("ok"), start, deadline);
    }
    ctx.costs(&mut r);
    // Sessions end with the cluster (revoking 50 000 leases would be 50 000 writes).
    Ok(r)
}
