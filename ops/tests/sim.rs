//! The simulation tier of the fault suite, bounded for CI: `faultsuite sim` runs the whole
//! cell (five replicas and the workload clients) in one process on turmoil's simulated
//! network and clock, one run per seed, each under a seeded nemesis (crashes and
//! restarts, leader isolation, splits, one-way cuts, loss, a slow leader, held traffic,
//! proxied clients cut off from their proxy, the proxy crashed and restarted, a member
//! replaced) with every replica's and the proxy's clock running up to 2 % fast, and
//! checks the fenced-lock, register, session and watch workloads.
//!
//! One seed (the first that paused a host, else the last) is run a second time in a fresh
//! process and must inject the same faults at the same simulated times and write the same
//! history, line for line.
//!
//! Seed 5 is in the default set because it once stalled every write after a fail-over
//! (an expiring old cacher waited for itself to confirm a flush; docs/testing.md).
//!
//! A second test runs seed 2 with the replicas' clocks up to 5 % fast and must fail:
//! the checkers bite on a clock outside the SDK's 2.5 % allowance.
//!
//! `FAULTSUITE_SIM_SEEDS` (default 5), `FAULTSUITE_SIM_FIRST` (default 1) and
//! `FAULTSUITE_SIM_TIME` (simulated time per seed, default 30s) change the run. Needs no
//! root: nothing leaves the process.

use std::collections::BTreeSet;
use std::process::Command;

use ops::faults::plan::{Fault, Verdict};

/// Runs `faultsuite sim` with `args`, its output under `out`; prints and returns stdout.
fn sim(args: &[&str], out: &std::path::Path) -> (std::process::Output, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_faultsuite"))
        .arg("sim")
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("faultsuite runs");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    println!("{stdout}");
    (o, stdout)
}

#[test]
fn simulated_cell_survives_seeded_faults() {
    let seeds: u64 = std::env::var("FAULTSUITE_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let first: u64 = std::env::var("FAULTSUITE_SIM_FIRST")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let time = std::env::var("FAULTSUITE_SIM_TIME").unwrap_or_else(|_| "30s".into());
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let (o, stdout) = sim(
        &[
            "--seeds",
            &seeds.to_string(),
            "--seed",
            &first.to_string(),
            "--time",
            &time,
        ],
        dir.path(),
    );
    assert!(
        o.status.success(),
        "the simulation found a violation or broke:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut kinds = BTreeSet::new();
    let (mut grants, mut ops, mut faults) = (0, 0, 0);
    let mut paused_seed = None;
    for s in first..first + seeds {
        let v: Verdict = serde_json::from_slice(
            &std::fs::read(dir.path().join(format!("seed-{s}")).join("verdict.json"))
                .unwrap_or_else(|e| panic!("seed {s}: no verdict: {e}")),
        )
        .unwrap();
        assert!(v.passed(), "seed {s}: {:#?}", v.violations);
        // Each seed did its job: faults were injected and every workload made progress.
        assert!(!v.faults.is_empty(), "seed {s}: no fault injected");
        assert!(v.grants >= 10, "seed {s}: {v:?}");
        assert!(v.register_ops >= 200, "seed {s}: {v:?}");
        assert_eq!(v.sessions_kept, 3, "seed {s}: {v:?}");
        assert!(v.sessions_abandoned >= 1, "seed {s}: {v:?}");
        kinds.extend(v.faults.iter().map(|f| f.fault));
        if v.faults.iter().any(|f| f.fault == Fault::PauseLeader) {
            paused_seed.get_or_insert(s);
        }
        grants += v.grants;
        ops += v.register_ops;
        faults += v.faults.len();
    }
    // A seed replays: a seed run again on its own in a fresh process (after others had run
    // before it in the first one) injects the same faults at the same simulated times and
    // writes the same history, line for line. The seed is the first that paused a host
    // (every pause's timers fire at once on resume), else the last.
    let last = paused_seed.unwrap_or(first + seeds - 1);
    let again = dir.path().join("again");
    let (o, stdout) = sim(&["--seed", &last.to_string(), "--time", &time], &again);
    assert!(o.status.success(), "{stdout}");
    let run = |d: &std::path::Path| {
        let d = d.join(format!("seed-{last}"));
        let v: Verdict =
            serde_json::from_slice(&std::fs::read(d.join("verdict.json")).unwrap()).unwrap();
        let schedule: Vec<_> = v.faults.iter().map(|f| (f.at_ms, f.fault)).collect();
        (
            schedule,
            std::fs::read_to_string(d.join("history.jsonl")).unwrap(),
        )
    };
    let ((s1, h1), (s2, h2)) = (run(dir.path()), run(&again));
    assert_eq!(s1, s2, "seed {last}: the replay injected other faults");
    let first_difference = h1.lines().zip(h2.lines()).position(|(a, b)| a != b).or((h1
        .lines()
        .count()
        != h2.lines().count())
    .then(|| h1.lines().count()));
    assert_eq!(
        first_difference, None,
        "seed {last}: the replay's history parted ways at this line"
    );
    println!("FIGURE faultsuite sim replay: seed {last} again: same faults, history identical");

    // Seed s opens with fault kinds 3s..3s+2 (mod 12), so four consecutive seeds cover
    // all twelve (the schedule is a function of the seed: this holds or fails every time).
    assert!(
        kinds.len() as u64 >= (3 * seeds).min(ops::faults::sim::SIM_FAULTS.len() as u64),
        "kinds injected: {kinds:?}"
    );
    println!(
        "FIGURE faultsuite sim: seeds {first}..{} x {time} simulated in {:.0} s: {faults} \
         faults of {} kinds, {grants} grants, {ops} register ops linearizable, 0 violations",
        first + seeds,
        started.elapsed().as_secs_f64(),
        kinds.len()
    );
}

/// The checkers bite on a clock outside the SDK's allowance: with the replicas' clocks
/// up to 10 % fast (four times the 2.5 % the SDK's local lease allows for), seed 2's deaf
/// holder still acts on its lease after the cell, whose leader r1 runs 9.9 % fast,
/// expired its session and granted the lock to another worker (checker rule 3). The
/// overlap comes 5.6 s into the run. (With 5 %, the overlap window is a few acts wide:
/// seed 2 showed it until the SDK's staggered dials moved its schedule, and no seed of
/// 1–24 does since.)
#[test]
fn a_cell_clock_beyond_the_allowance_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let (o, stdout) = sim(
        &["--seed", "2", "--skew", "0.10", "--time", "30s"],
        dir.path(),
    );
    assert!(
        !o.status.success() && stdout.contains("two holders acting at once"),
        "a 10 % fast leader went unnoticed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Issue 25, item 6: prefix moves in the simulation's nemesis (`--moves`: a second cell
/// `b`, a directory instance, and the `move` fault, which runs `lockctl dir move`'s code
/// beside the other faults, half of the time stopped after a seeded step as a killed
/// mover would be). Workloads on the moving prefix go through the SDK's router: writers
/// whose every acknowledged create must survive the moves, and lock workers whose grants,
/// acts and fenced writes join the suite's history, so the fenced-lock checker's rules
/// hold across cells (tokens grow, a holder never acts after another's grant of a higher
/// token). At the end exactly one cell serves the prefix, at the map's epoch.
///
/// Seeds 1 and 3 each grant the moving lock in two epochs (a move finished while the
/// lock workers ran), and they are the ones that catch a holder acting on its lease after
/// its lock moved away: with `LockGuard::may_act` reduced to the lease (as before lock
/// holders pinned their nodes) both fail rule 3, "two holders acting at once", at 36.1 s
/// and 2.6 s. Seed 3 is run again and must replay line for line.
#[test]
fn prefix_moves_under_the_nemesis_keep_every_checker_green() {
    let dir = tempfile::tempdir().unwrap();
    let (o, stdout) = sim(
        &["--seed", "1", "--seeds", "3", "--time", "60s", "--moves"],
        dir.path(),
    );
    assert!(
        o.status.success(),
        "a violation with prefix moves:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (mut moves, mut stopped) = (0, 0);
    for s in [1u64, 2, 3] {
        let d = dir.path().join(format!("seed-{s}"));
        let v: Verdict =
            serde_json::from_slice(&std::fs::read(d.join("verdict.json")).unwrap()).unwrap();
        assert!(v.passed(), "seed {s}: {:#?}", v.violations);
        assert!(v.moves >= 1, "seed {s}: no move finished: {v:?}");
        moves += v.moves;
        stopped += v
            .faults
            .iter()
            .filter(|f| f.fault == Fault::Move && f.target.contains("stopped after"))
            .count();
        // Grants of the moving prefix's lock, by the epoch in their tokens' high bits.
        let history = std::fs::read_to_string(d.join("history.jsonl")).unwrap();
        let mut epochs = BTreeSet::new();
        for line in history.lines().filter(|l| l.contains("\"mv-lock-")) {
            let e: serde_json::Value = serde_json::from_str(line).unwrap();
            if e["kind"] == "ok" && e["op"]["f"] == "acquire" {
                epochs.insert(wire::directory::token_epoch(
                    e["op"]["token"].as_u64().unwrap(),
                ));
            }
        }
        if s != 2 {
            assert!(
                epochs.len() >= 2,
                "seed {s}: the moving lock was granted in one epoch only: {epochs:?}"
            );
        }
    }
    assert!(stopped >= 1, "no move was stopped midway");
    // Seed 3 replays with its moves.
    let again = dir.path().join("again");
    let (o, out2) = sim(&["--seed", "3", "--time", "60s", "--moves"], &again);
    assert!(o.status.success(), "{out2}");
    let h = |d: &std::path::Path| std::fs::read_to_string(d.join("seed-3/history.jsonl")).unwrap();
    assert!(
        h(dir.path()) == h(&again),
        "seed 3 with moves did not replay"
    );
    println!(
        "FIGURE faultsuite sim --moves: seeds 1..3 x 60s: {moves} moves finished ({stopped} \
         stopped midway and finished later), the moving lock granted in two epochs in seeds \
         1 and 3, 0 violations; seed 3 replayed"
    );
}
