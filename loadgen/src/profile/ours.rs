//! The `profile` scenario on our cell, through proxies (the scenario: [`super`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::bail;
use client_sdk::{Client, ClientConfig, CreateMode, Lock, Session, SessionState};
use wire::types::{ProxyStatus, Status};

use super::*;
use crate::report::{Lat, Report};
use crate::scenarios::Ctx;

/// Every proxy's status (`None` for one that did not answer).
async fn proxies_each(c: &Client, proxies: &[String]) -> Vec<Option<ProxyStatus>> {
    let mut each = Vec::with_capacity(proxies.len());
    for p in proxies {
        let status = match p.parse() {
            Ok(addr) => c.proxy_status_of(addr).await.ok(),
            Err(_) => None,
        };
        each.push(status);
    }
    each
}

/// The proxies' counters added up.
fn proxies_total(each: &[Option<ProxyStatus>]) -> ProxyStatus {
    let mut t = ProxyStatus::default();
    for s in each.iter().flatten() {
        t.clients += s.clients;
        t.sessions += s.sessions;
        t.keepalive_batches += s.keepalive_batches;
        t.keepalives_batched += s.keepalives_batched;
        t.cache_hits += s.cache_hits;
        t.upstream_reads += s.upstream_reads;
        t.upstream_writes += s.upstream_writes;
        t.invalidations_relayed += s.invalidations_relayed;
    }
    t
}
/// The requests that make up an acquire, a config write and a KeepAlive, as the servers
/// timed them during the run: at the leader (when it did not change) and at the proxies
/// (all of them together), so the client's latency can be told apart from the cell's.
fn server_latencies(
    r: &mut Report,
    leader: (&Status, &Status),
    proxies: (&[Option<ProxyStatus>], &[Option<ProxyStatus>]),
) {
    use wire::latency::{find, OpLatency};
    fn between(before: &[OpLatency], after: &[OpLatency], op: &str) -> Option<Histogram> {
        find(after, op)?.since(find(before, op)).ok()
    }
    type Histogram = hdrhistogram::Histogram<u64>;
    for (op, what) in [
        ("Create", "acquire's create"),
        ("SetData", "config write"),
        ("KeepAliveBatch", "KeepAlive batch"),
    ] {
        if leader.0.id == leader.1.id {
            if let Some(h) = between(&leader.0.request_latency, &leader.1.request_latency, op) {
                r.server_latency(&format!("{what} at the leader"), &h);
            }
        }
        let mut all: Option<Histogram> = None;
        for (p0, p1) in proxies.0.iter().zip(proxies.1) {
            let (Some(p0), Some(p1)) = (p0, p1) else {
                continue;
            };
            if let Some(h) = between(&p0.request_latency, &p1.request_latency, op) {
                match &mut all {
                    Some(a) => {
                        let _ = a.add(&h);
                    }
                    None => all = Some(h),
                }
            }
        }
        if let Some(h) = all {
            r.server_latency(&format!("{what} at the proxies"), &h);
        }
    }
}

/// The profile scenario on our cell. `secs` overrides the run time (full scale: 120 s);
/// `reads_per_s` is each session's config reads a second (1 in the seed). etcd and
/// ZooKeeper run it with their own sessions, recipe and uncached reads
/// ([`super::peers`], which `main` calls for them).
pub async fn profile(
    ctx: &Ctx,
    secs: Option<f64>,
    fault: Option<Fault>,
    reads_per_s: f64,
) -> anyhow::Result<Report> {
    let dur = secs.map_or_else(|| ctx.secs(120.0, 20.0), Duration::from_secs_f64);
    let config_writes_per_s = 10.0;
    let proxies = ctx.cluster.endpoints.clone();
    if proxies == ctx.cluster.members {
        bail!("profile runs through proxies: start the cell with --proxies N (N >= 1)");
    }
    let set = set_up(ctx, &proxies, dur).await?;
    let Setup {
        n,
        long_locks,
        short_locks,
        short_period,
        churn_per_s,
        locks,
        conns,
        open_secs,
        ..
    } = set;
    let (admin, guards, setup_errors) = (
        set.admin.clone(),
        set.guards.clone(),
        set.setup_errors.clone(),
    );
    let direct = Client::connect(ClientConfig::new(
        ctx.cluster.members.clone(),
        ctx.cluster.ca.clone(),
    ))
    .await?;

    // The run.
    let start = Instant::now();
    let deadline = start + dur;
    let run = RunCtx {
        slots: set.slots.clone(),
        start,
        deadline,
        stop: Arc::new(AtomicBool::new(false)),
        errors: Arc::new(AtomicU64::new(0)),
        failures: Arc::new(Failures::default()),
    };
    let (slots, stop, errors, failures) = (
        run.slots.clone(),
        run.stop.clone(),
        run.errors.clone(),
        run.failures.clone(),
    );
    let (acq, ka, rd, wr) = (lat(start), lat(start), lat(start), lat(start));
    let writes_ok: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(Vec::new()));
    let reads = Arc::new(AtomicU64::new(0));
    let churned = Arc::new(AtomicU64::new(0));
    let l0 = leader_status(&direct).await?;
    let p0s = proxies_each(&direct, &proxies).await;
    let p0 = proxies_total(&p0s);
    let mut tasks = Vec::new();
    spawn_short_locks(&mut tasks, &run, &set, &acq);
    let cached = reads_mode() == Reads::Cached;
    spawn_readers(&mut tasks, &run, cached, reads_per_s, (&rd, &reads));
    tasks.push(spawn_writer(
        &run,
        &admin,
        config_writes_per_s,
        &wr,
        &writes_ok,
    ));
    tasks.push(spawn_churn(&run, &set, &churned));

    // KeepAlive round trips: every renewal, sampled from each session's last one.
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

    // The disk under the cell.
    let disk = lat(start);
    tasks.push(spawn_fsync_probe(
        ctx.cluster.dir().to_path_buf(),
        deadline,
        stop.clone(),
        disk.clone(),
    ));

    // How late loadgen's own runtime runs a task that is due: a share of every
    // client-side latency here that a client on its own machine would not have.
    let late = lat(start);
    tasks.push(spawn_lateness_probe(deadline, stop.clone(), late.clone()));

    // Sessions whose local lease ran out (jeopardy: their holders must stop acting).
    let jeopardy = Arc::new(Mutex::new(JeopardyStats::default()));
    tasks.push(spawn_jeopardy_sampler(
        slots.len(),
        {
            let slots = slots.clone();
            move |i| slots[i].lock().expect("slot").lease_valid()
        },
        deadline,
        stop.clone(),
        jeopardy.clone(),
    ));

    // The fault, 40 % into the run.
    let injected = run_with_fault(ctx, start, deadline, fault).await?;
    stop.store(true, Ordering::SeqCst);
    let elapsed = start.elapsed().as_secs_f64();
    let l1 = leader_status(&direct).await?;
    let p1s = proxies_each(&direct, &proxies).await;
    let p1 = proxies_total(&p1s);
    join_tasks(tasks, &errors).await;
    failures.count_unfinished();
    // What the clients saw at the end of the run, before the test hook and the wait (as
    // the peers' profile counts it).
    let sessions: Vec<Session> = slots
        .iter()
        .map(|s| s.lock().expect("slot").clone())
        .collect();
    let lost = sessions
        .iter()
        .filter(|s| s.state() == SessionState::Expired)
        .count()
        + usize::from(admin.state() == SessionState::Expired);
    let held_long = guards
        .lock()
        .expect("guards")
        .iter()
        .filter(|g| g.may_act())
        .count();
    // The test hook: sessions that hold no lock stop renewing behind loadgen's back.
    let behind = crate::server_sessions::behind_back_share(0, 1);
    anyhow::ensure!(
        behind <= n - locks,
        "cannot end {behind} sessions: {} hold no lock",
        n - locks
    );
    for slot in slots.iter().skip(locks).take(behind) {
        slot.lock().expect("slot").stop_keepalives();
    }
    // The server's check, before a frozen leader resumes (it would answer as leader for a
    // moment) and before any session ends, a lease after now (the tasks are joined and
    // the hook applied) or after the fault.
    let waited = crate::server_sessions::settle(
        ctx.lease,
        Instant::now(),
        injected.as_ref().map(Injected::at),
    )
    .await;
    let ids: Vec<u64> = slots
        .iter()
        .map(|s| s.lock().expect("slot").id())
        .chain([admin.id()])
        .collect();
    let at_server = crate::server_sessions::check(&ctx.cluster, &ids).await;
    if let Some(i) = &injected {
        i.resume(ctx);
    }

    // Results.
    let (mut hits, mut misses) = (0u64, 0u64);
    for s in &sessions {
        let c = s.cache_stats();
        hits += c.hits;
        misses += c.misses;
    }
    let mut r = ctx.report(Injected::scenario(fault));
    r.param("sessions", n);
    r.param(
        "QUIC connections (sessions per connection)",
        format!("{conns} ({SESSIONS_PER_CONNECTION})"),
    );
    r.param("proxies", proxies.len());
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
    r.param(
        "config reads",
        if cached {
            "cached: the SDK's consistent cache (the leader invalidates a copy before a \
             write to it commits)"
        } else {
            "uncached: linearizable reads at the leader (--reads uncached)"
        },
    );
    r.param("config writes per s", config_writes_per_s);
    r.param("sessions churned per s", churn_per_s);
    r.param("run (s)", format!("{elapsed:.0}"));
    let acq_failed = failures.acquires.lock().expect("failures").clone();
    let far = start + dur * 10;
    r.latency_failed(
        "acquire (short locks)",
        &acq.lock().expect("lat"),
        acq_failed.len() as u64,
    );
    // Without the warm-up: every session's first cached read registers it as a cacher
    // (one write each, 50 000 at once at full scale) in the run's first seconds.
    r.latency_failed(
        &format!("acquire after the first {} s", WARM_UP.as_secs()),
        &acq.lock().expect("lat").since(WARM_UP),
        failed_between(&acq_failed, start + WARM_UP, far),
    );
    r.latency("KeepAlive round trip", &ka.lock().expect("lat"));
    r.latency_failed(
        read_row(cached),
        &rd.lock().expect("lat"),
        failures.reads.load(Ordering::Relaxed),
    );
    r.latency_failed(
        "config write",
        &wr.lock().expect("lat"),
        failures.writes.load(Ordering::Relaxed),
    );
    r.notes.push(
        "failed: next to each client operation's latency (whose percentiles are over the \
         successes); a config write's are failed attempts, each retried after 20 ms; an \
         acquire still unfinished when its task was given up, 30 s after the run, failed; a \
         KeepAlive the SDK retries itself is not counted (see jeopardy and the server-side \
         session check)"
            .into(),
    );
    crate::profile::note_reasons(&mut r, failures.reasons());
    server_latencies(&mut r, (&l0, &l1), (&p0s, &p1s));
    r.latency(
        "disk: 4 KiB write + fdatasync (probe next to the cell's data)",
        &disk.lock().expect("lat"),
    );
    r.latency(LATENESS, &late.lock().expect("lat"));
    r.figure("sessions opened per s (setup)", n as f64 / open_secs);
    r.figure("sessions lost", lost as f64);
    crate::server_sessions::note_behind_back(&mut r);
    crate::server_sessions::report(
        &mut r,
        at_server,
        waited,
        "the run's sessions, churned ones replaced, and the admin session",
    );
    r.figure("long-held locks still held", held_long as f64);
    r.figure(
        "config reads per s (at clients)",
        reads.load(Ordering::Relaxed) as f64 / elapsed,
    );
    r.figure(
        "client cache hit rate (%)",
        100.0 * hits as f64 / (hits + misses).max(1) as f64,
    );
    r.figure(
        "reads reaching the cell per s",
        p1.upstream_reads.saturating_sub(p0.upstream_reads) as f64 / elapsed,
    );
    r.figure(
        "reads answered by proxies' caches per s",
        p1.cache_hits.saturating_sub(p0.cache_hits) as f64 / elapsed,
    );
    {
        let j = jeopardy.lock().expect("jeopardy");
        r.figure("sessions in jeopardy at some point", j.ever as f64);
        r.figure("sessions in jeopardy at once (most)", j.most as f64);
    }
    r.figure("sessions churned", churned.load(Ordering::Relaxed) as f64);
    r.figure("operation errors", errors.load(Ordering::Relaxed) as f64);
    r.figure(
        "setup errors (long-held locks not taken)",
        setup_errors.load(Ordering::Relaxed) as f64,
    );
    if l0.id == l1.id {
        let rpcs = l1.keepalive_rpcs.saturating_sub(l0.keepalive_rpcs);
        let renewed = l1.keepalives_renewed.saturating_sub(l0.keepalives_renewed);
        r.figure("KeepAlive RPCs at the leader per s", rpcs as f64 / elapsed);
        r.figure("leases renewed per s", renewed as f64 / elapsed);
    } else {
        r.notes.push(format!(
            "the leader changed (replica {} to {}): leader counters are not compared",
            l0.id, l1.id
        ));
    }
    r.figure(
        "KeepAlives batched by proxies per s",
        p1.keepalives_batched.saturating_sub(p0.keepalives_batched) as f64 / elapsed,
    );
    r.figure("sessions at the leader (end)", l1.session_count as f64);
    if let Some(i) = &injected {
        i.report(
            &mut r,
            &writes_ok.lock().expect("ok"),
            (&acq.lock().expect("lat"), &acq_failed),
            start,
            deadline,
        );
    }
    ctx.costs(&mut r);
    // The sessions end with the cell (closing 50 000 of them would be 50 000 writes), but
    // their KeepAlive loops and event streams must not outlive the run: each would try
    // the stopped cell until its grace period ran out, up to a minute, 50 000 of them at
    // full scale, into the next run of `--runs N` (whose loadgen then took 1.5 times the
    // CPU at a fifth of the scale, and at full scale fell behind and lost every session).
    for s in &sessions {
        s.stop_keepalives();
    }
    admin.stop_keepalives();
    Ok(r)
}

/// The cell as set up for a run: its sizes, the clients (one QUIC connection per 2 000
/// sessions, spread over the proxies), the admin session, every session in its slot and
/// the long-held locks taken.
struct Setup {
    n: usize,
    long_locks: usize,
    short_locks: usize,
    short_period: Duration,
    churn_per_s: f64,
    locks: usize,
    conns: usize,
    open_secs: f64,
    clients: Vec<Client>,
    admin: Session,
    slots: Slots,
    guards: Arc<Mutex<Vec<client_sdk::LockGuard>>>,
    setup_errors: Arc<AtomicU64>,
}

/// Every session of the run, each in its slot (churn replaces a slot's session).
type Slots = Arc<Vec<Mutex<Session>>>;

/// What every task of a run shares: the sessions, the run's clock and stop switch, and
/// its error counts.
struct RunCtx {
    slots: Slots,
    start: Instant,
    deadline: Instant,
    stop: Arc<AtomicBool>,
    errors: Arc<AtomicU64>,
    failures: Arc<Failures>,
}

/// Setup: the clients, the namespace, then the sessions, then the long-held locks.
async fn set_up(ctx: &Ctx, proxies: &[String], dur: Duration) -> anyhow::Result<Setup> {
    let n = ctx.n(50_000.0, 50);
    let long_locks = ctx.n(15_000.0, 10).min(n);
    let short_locks = ctx.n(5_000.0, 5).min(n - long_locks);
    // Once a period each, the period a third of the run and at most a minute (a short run
    // takes each short lock three times): the offered rate depends on the run's length,
    // alike for every system (`peers/running.rs` does the same).
    let short_period = Duration::from_secs(60).min(dur / 3);
    let churn_per_s = (n as f64 / 5_000.0).max(1.0);
    let clients = connections(ctx, proxies, n).await?;
    let conns = clients.len();

    let admin = clients[0].open_session().await?;
    for p in ["/profile", "/profile/locks", "/profile/config"] {
        create_ok(admin.create(p, Vec::new(), CreateMode::default()).await)?;
    }
    for k in 0..CONFIG_KEYS {
        create_ok(
            admin
                .create(
                    &format!("/profile/config/k{k}"),
                    vec![b'v'; 100],
                    CreateMode::default(),
                )
                .await,
        )?;
    }
    let locks = long_locks + short_locks;
    each(locks, 128, "lock dirs", |i| {
        let admin = admin.clone();
        async move {
            create_ok(
                admin
                    .create(
                        &format!("/profile/locks/l{i}"),
                        Vec::new(),
                        CreateMode::default(),
                    )
                    .await,
            )
        }
    })
    .await?;
    let opened = Instant::now();
    let sessions = open_all(&clients, n).await?;
    let open_secs = opened.elapsed().as_secs_f64();
    let guards: Arc<Mutex<Vec<client_sdk::LockGuard>>> = Arc::new(Mutex::new(Vec::new()));
    let setup_errors = Arc::new(AtomicU64::new(0));
    each(long_locks, 128, "long locks", |i| {
        let (s, guards, setup_errors) = (sessions[i].clone(), guards.clone(), setup_errors.clone());
        async move {
            // A failure is counted (and reported), not fatal: the run shows what follows.
            match Lock::exclusive(&s, &format!("/profile/locks/l{i}"))
                .acquire()
                .await
            {
                Ok(g) => guards.lock().expect("guards").push(g),
                Err(e) => {
                    if setup_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        eprintln!("loadgen: a long-held lock was not taken: {e}");
                    }
                }
            }
            Ok(())
        }
    })
    .await?;
    let slots: Slots = Arc::new(sessions.into_iter().map(Mutex::new).collect());
    Ok(Setup {
        n,
        long_locks,
        short_locks,
        short_period,
        churn_per_s,
        locks,
        conns,
        open_secs,
        clients,
        admin,
        slots,
        guards,
        setup_errors,
    })
}

/// Short locks: session long_locks + j takes lock long_locks + j once a period, holding
/// it 1 s; the first time at a random offset.
fn spawn_short_locks(
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
    run: &RunCtx,
    set: &Setup,
    acq: &Arc<Mutex<Lat>>,
) {
    let (start, deadline, short_period) = (run.start, run.deadline, set.short_period);
    for j in 0..set.short_locks {
        let i = set.long_locks + j;
        let (slots, acq, stop, errors) = (
            run.slots.clone(),
            acq.clone(),
            run.stop.clone(),
            run.errors.clone(),
        );
        let failures = run.failures.clone();
        let offset = short_period.mul_f64(rand::random::<f64>());
        tasks.push(tokio::spawn(async move {
            let mut due = start + offset;
            let path = format!("/profile/locks/l{i}");
            while due < deadline && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(due).await;
                let s = slots[i].lock().expect("slot").clone();
                let t0 = Instant::now();
                match failures
                    .acquiring(Lock::exclusive(&s, &path).acquire())
                    .await
                {
                    Ok(g) => {
                        let t1 = Instant::now();
                        record(&acq, t1 - t0, t1);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        if g.release().await.is_err() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        failures.why("acquire", &e);
                        failures.acquire();
                    }
                }
                due += short_period;
            }
        }));
    }
}

/// Readers: every session reads its config value once a period (through its cache if
/// `cached`, else linearizably); one task per 50 sessions, whose reads are spread over the
/// period, sent when due and timed from then ([`open_loop_reads`]). `counts` are the read
/// latencies and the reads made.
fn spawn_readers(
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
    run: &RunCtx,
    cached: bool,
    reads_per_s: f64,
    counts: (&Arc<Mutex<Lat>>, &Arc<AtomicU64>),
) {
    let (rd, reads) = counts;
    if reads_per_s <= 0.0 {
        return;
    }
    let (start, deadline) = (run.start, run.deadline);
    let read_period = Duration::from_secs_f64(1.0 / reads_per_s);
    for first in (0..run.slots.len()).step_by(50) {
        let (slots, rd, stop, reads, errors) = (
            run.slots.clone(),
            (*rd).clone(),
            run.stop.clone(),
            (*reads).clone(),
            run.errors.clone(),
        );
        let failures = run.failures.clone();
        let offset = read_period.mul_f64(rand::random::<f64>());
        let n = (first + 50).min(slots.len()) - first;
        tasks.push(tokio::spawn(async move {
            let read = |j: usize| {
                let i = first + j;
                let s = slots[i].lock().expect("slot").clone();
                let key = format!("/profile/config/k{}", i % CONFIG_KEYS);
                let failures = failures.clone();
                async move {
                    let read = if cached {
                        s.get_cached(&key).await.map(|_| ())
                    } else {
                        s.get(&key).await.map(|_| ())
                    };
                    if let Err(e) = &read {
                        failures.why("read", e);
                    }
                    read.is_ok()
                }
            };
            let counts = ReadCounts {
                lat: &rd,
                reads: &reads,
                errors: &errors,
                failures: &failures,
            };
            open_loop_reads(
                (start + offset, read_period, deadline),
                &stop,
                n,
                read,
                counts,
            )
            .await;
        }));
    }
}

/// The config writer: retries a failed write (its failures are the unavailability).
fn spawn_writer(
    run: &RunCtx,
    admin: &Session,
    writes_per_s: f64,
    wr: &Arc<Mutex<Lat>>,
    writes_ok: &Arc<Mutex<Vec<Instant>>>,
) -> tokio::task::JoinHandle<()> {
    spawn_config_writer(
        {
            let (admin, failures) = (admin.clone(), run.failures.clone());
            move |key: String, value: Vec<u8>| {
                let (admin, failures) = (admin.clone(), failures.clone());
                async move {
                    let r = admin.set_data(&key, value, None).await;
                    if let Err(e) = &r {
                        failures.why("write", e);
                    }
                    r.is_ok()
                }
            }
        },
        writes_per_s,
        run.deadline,
        run.stop.clone(),
        wr.clone(),
        writes_ok.clone(),
        run.failures.clone(),
    )
}

/// Churn: sessions that hold no lock are closed and replaced by new ones.
fn spawn_churn(run: &RunCtx, set: &Setup, churned: &Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    let (slots, clients, stop, churned, errors) = (
        run.slots.clone(),
        set.clients.clone(),
        run.stop.clone(),
        churned.clone(),
        run.errors.clone(),
    );
    let (start, deadline, churn_per_s) = (run.start, run.deadline, set.churn_per_s);
    let plain = set.locks..set.n;
    tokio::spawn(async move {
        if plain.is_empty() {
            return;
        }
        let every = Duration::from_secs_f64(1.0 / churn_per_s);
        let mut due = start;
        while due < deadline && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep_until(due).await;
            let i = plain.start + rand::random::<usize>() % plain.len();
            // Only a healthy session is churned out: one in jeopardy or expired stays
            // in its slot to be counted at the end (closing it would hide its loss:
            // the SDK's close answers Ok for a session the cell has expired).
            if slots[i].lock().expect("slot").state() != SessionState::Healthy {
                due += every;
                continue;
            }
            let client = &clients[i / SESSIONS_PER_CONNECTION];
            match client.open_session().await {
                Ok(fresh) => {
                    let old = std::mem::replace(&mut *slots[i].lock().expect("slot"), fresh);
                    if old.close().await.is_err() {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    churned.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            due += every;
        }
    })
}
