//! The client host of the simulation: the workloads, the membership changes the nemesis
//! asks for, and the watch on who leads.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use client_sdk::{Client, ClientConfig};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wire::types::{Op as WireOp, Reply};

use super::moves::{MoveRun, Places};
use super::{moves, Admin, Shared};
use crate::faults::plan::{Plan, Verdict};
use crate::faults::workloads::{finish_workloads, start_workloads};

/// The client host: waits for a leader, runs the workloads until the plan's time is up,
/// then checks what they recorded. Meanwhile it tells the nemesis who leads.
pub(super) async fn clients(
    config: ClientConfig,
    proxied: ClientConfig,
    plan: Plan,
    replicas: Vec<(u64, SocketAddr)>,
    places: Option<Places>,
    out: &Path,
    shared: Arc<Mutex<Shared>>,
) -> anyhow::Result<Verdict> {
    let client = Client::connect(config.clone()).await?;
    // With moves: the prefixes placed, both cells in the map, the moving prefix's nodes.
    let a: Vec<SocketAddr> = replicas.iter().map(|(_, a)| *a).collect();
    let mut moves = match &places {
        Some(p) => Some(moves::setup(&client, &config, &a, p).await?),
        None => None,
    };
    let admin = wire::rt::spawn(admin_loop(client.clone(), replicas.clone(), shared.clone()));
    let watch = wire::rt::spawn(watch_leader(
        client.clone(),
        replicas.clone(),
        shared.clone(),
    ));
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let workloads = start_workloads(&client, &config, Some(&proxied), &plan, &mut rng).await?;
    let mover = moves.as_mut().map(|m| {
        m.start(workloads.run.clone(), plan.seed);
        wire::rt::spawn(move_loop(m.mover(), shared.clone()))
    });
    {
        // The client host's clock is the simulation's (never skewed).
        let mut s = shared.lock().expect("shared");
        s.history_zero = turmoil::elapsed().saturating_sub(workloads.started().elapsed());
        s.ends_at = Some(turmoil::elapsed() + plan.time);
    }
    tokio::time::sleep_until(workloads.deadline()).await;
    // The nemesis heals everything when the time is up; give it a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut verdict = Verdict {
        seed: plan.seed,
        secs: plan.time.as_secs(),
        ..Verdict::default()
    };
    // The proxy keeps a session of its own for as long as it runs, and so does the
    // directory instance in its root cell (this one).
    let mut sessions_left = 1;
    if let (Some(m), Some(p)) = (moves, &places) {
        let finished = m.finished.clone();
        verdict.violations = m.finish(&p.b).await;
        verdict.moves = *finished.lock().expect("finished");
        sessions_left += 1;
    }
    if let Some(t) = mover {
        t.abort();
    }
    let r = finish_workloads(
        workloads,
        &client,
        &replicas,
        sessions_left,
        &plan,
        verdict,
        out,
    )
    .await;
    watch.abort();
    admin.abort();
    r
}

/// Makes the prefix moves the nemesis asks for ([`Shared::move_ask`]), one at a time,
/// and reports each outcome in [`Shared::move_result`].
async fn move_loop(mut mover: impl FnMut(moves::MoveAsk) -> MoveRun, shared: Arc<Mutex<Shared>>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(ask) = shared.lock().expect("shared").move_ask.take() else {
            continue;
        };
        let r = mover(ask).await;
        shared.lock().expect("shared").move_result = Some(r);
    }
}

/// Makes the membership changes the nemesis asks for ([`Admin`]), one at a time, and
/// reports each outcome in [`Shared::admin_result`].
async fn admin_loop(client: Client, replicas: Vec<(u64, SocketAddr)>, shared: Arc<Mutex<Shared>>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(op) = shared.lock().expect("shared").admin.take() else {
            continue;
        };
        let r = match op {
            Admin::Remove(id) => membership(&client, WireOp::RemoveMember { id }).await,
            Admin::Add { id, addr } => add_and_promote(&client, &replicas, id, addr).await,
        };
        shared.lock().expect("shared").admin_result = Some(r);
    }
}

/// One membership request, retried for up to 10 s.
async fn membership(client: &Client, op: WireOp) -> Result<(), String> {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match client.request(op.clone()).await {
            Ok(Reply::MembershipChanged { .. }) => return Ok(()),
            Ok(other) => return Err(format!("{op:?}: unexpected reply {other:?}")),
            Err(e) if tokio::time::Instant::now() >= until => return Err(format!("{op:?}: {e}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// Adds replica `id` as a learner, waits (up to 10 s) until it applied what the others
/// had, and promotes it.
async fn add_and_promote(
    client: &Client,
    replicas: &[(u64, SocketAddr)],
    id: u64,
    addr: SocketAddr,
) -> Result<(), String> {
    membership(
        client,
        WireOp::AddLearner {
            id,
            addr: addr.to_string(),
        },
    )
    .await?;
    let mut target = 0;
    for (_, a) in replicas.iter().filter(|(_, a)| *a != addr) {
        if let Ok(Ok(st)) =
            tokio::time::timeout(Duration::from_millis(500), client.status_of(*a)).await
        {
            target = target.max(st.last_applied);
        }
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Ok(st)) =
            tokio::time::timeout(Duration::from_millis(500), client.status_of(addr)).await
        {
            if st.last_applied >= target {
                break;
            }
        }
        if tokio::time::Instant::now() >= until {
            return Err(format!(
                "replica {id} did not catch up to {target} within 10 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    membership(client, WireOp::Promote { id }).await
}

/// Keeps [`Shared::leader`] current: the replica that says it leads with the highest term.
async fn watch_leader(
    client: Client,
    replicas: Vec<(u64, SocketAddr)>,
    shared: Arc<Mutex<Shared>>,
) {
    loop {
        let mut best: Option<(u64, usize)> = None;
        for (i, (_, addr)) in replicas.iter().enumerate() {
            if let Ok(Ok(st)) =
                tokio::time::timeout(Duration::from_millis(500), client.status_of(*addr)).await
            {
                if st.role == "Leader" && best.is_none_or(|(t, _)| st.term > t) {
                    best = Some((st.term, i + 1));
                }
            }
        }
        if let Some((_, l)) = best {
            shared.lock().expect("shared").leader = Some(l);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
