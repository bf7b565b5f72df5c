//! The simulation's process pause (`ops::faults::sim::pausable`) on its own: a paused host runs
//! nothing, neither the tasks it spawned (through `wire::rt`, openraft's runtime or
//! quinn's) nor their timers, while its clock goes on; on resume the missed deadlines are
//! due at once. Its own process: `wire::rt::spawn_on_local_sets` is process-wide.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::AsyncRuntime;

/// A simulation of 1 ms steps whose hosts' tasks go to their LocalSets.
fn simulation() -> turmoil::Sim<'static> {
    wire::rt::spawn_on_local_sets();
    turmoil::Builder::new()
        .tick_duration(Duration::from_millis(1))
        .simulation_duration(Duration::from_secs(60))
        .build()
}

#[test]
fn a_paused_host_runs_nothing_and_finds_its_clock_moved_on() {
    let mut sim = simulation();
    let paused = Arc::new(AtomicBool::new(false));
    // Ticks of two tasks of the host (one spawned by our code, one by openraft's
    // runtime), each every 10 ms by its own sleep; and the longest gap either saw.
    let ticks = Arc::new(AtomicU64::new(0));
    let longest_gap = Arc::new(Mutex::new(Duration::ZERO));
    {
        let (paused, ticks, longest_gap) = (paused.clone(), ticks.clone(), longest_gap.clone());
        sim.host("h", move || {
            let (paused, ticks, longest_gap) = (paused.clone(), ticks.clone(), longest_gap.clone());
            ops::faults::sim::pausable(paused, async move {
                let ticker = |ticks: Arc<AtomicU64>, gap: Arc<Mutex<Duration>>| async move {
                    let mut last = tokio::time::Instant::now();
                    loop {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        let now = tokio::time::Instant::now();
                        let mut g = gap.lock().unwrap();
                        *g = (*g).max(now - last);
                        last = now;
                        ticks.fetch_add(1, Ordering::SeqCst);
                    }
                };
                wire::rt::spawn(ticker(ticks.clone(), longest_gap.clone()));
                <wire::rt::RaftRuntime as AsyncRuntime>::spawn(ticker(ticks, longest_gap));
                std::future::pending::<()>().await;
                Ok(())
            })
        });
    }
    let step_for = |sim: &mut turmoil::Sim<'_>, ms: u64| {
        for _ in 0..ms {
            sim.step().unwrap();
        }
    };
    step_for(&mut sim, 1_000);
    let before = ticks.load(Ordering::SeqCst);
    assert!(before >= 150, "{before} ticks in a second before the pause");
    assert!(*longest_gap.lock().unwrap() < Duration::from_millis(20));

    paused.store(true, Ordering::SeqCst);
    step_for(&mut sim, 3_000);
    let during = ticks.load(Ordering::SeqCst) - before;
    assert!(during <= 2, "{during} ticks while paused");

    paused.store(false, Ordering::SeqCst);
    step_for(&mut sim, 1_000);
    assert!(
        ticks.load(Ordering::SeqCst) - before >= 150,
        "did not resume"
    );
    // The tasks woke from a 10 ms sleep to find about three seconds gone.
    let gap = *longest_gap.lock().unwrap();
    assert!(
        gap >= Duration::from_millis(2_900) && gap < Duration::from_millis(3_200),
        "longest gap {gap:?}"
    );
}

#[test]
fn a_panic_in_any_task_of_a_pausable_host_fails_the_run() {
    let mut sim = simulation();
    sim.host("h", || {
        ops::faults::sim::pausable(Arc::new(AtomicBool::new(false)), async {
            // Not the host's main task: one it spawned, as a replica's actors and
            // request handlers are.
            wire::rt::spawn(async { panic!("a task of the host panicked") });
            std::future::pending::<()>().await;
            Ok(())
        })
    });
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (0..1_000).any(|_| sim.step().is_err())
    }));
    assert!(
        !matches!(failed, Ok(false)),
        "the simulation ran on past a panicked task"
    );
}
