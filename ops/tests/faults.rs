//! The fault-injection suite's first real-process workload (issue 6, in progress): a fenced
//! lock on three replica processes, with the leader killed (`kill -9`) and, later, the new
//! leader frozen (SIGSTOP) under it, and one holder that stops renewing while it holds the
//! lock (as if its process were paused) and writes with its old token after its lease ran
//! out. The history is written as JSON lines and checked by `ops::faults::checkers`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use client_sdk::{Client, ClientConfig, Lock};
use common::*;
use ops::faults::checkers::{
    check_fenced_lock, read_history, write_history, FencedResource, Kind, Op, Recorder,
};

#[test]
fn fenced_lock_history_holds_across_kill_freeze_and_a_paused_holder() {
    let _g = serial();
    let mut cell = DevCell::start(&["--no-demo", "--lease-ms", "3000"]);
    let (data, endpoints) = (cell.data.clone(), cell.endpoints.clone());
    let (eps, ca) = (cell.eps(), cell.ca.clone());
    let rec = Arc::new(Recorder::new());
    let res = Arc::new(FencedResource::new("r"));
    let run = Duration::from_secs(22);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let deadline = Instant::now() + run;
        let mut workers = Vec::new();
        for w in 0..4 {
            let (rec, res, endpoints, ca) =
                (rec.clone(), res.clone(), endpoints.clone(), ca.clone());
            workers.push(tokio::spawn(async move {
                let who = format!("w{w}");
                let client = Client::connect(ClientConfig::new(endpoints, ca))
                    .await
                    .unwrap();
                let mut session = client.open_session().await.unwrap();
                let mut paused_once = false;
                while Instant::now() < deadline {
                    if session.state() == client_sdk::SessionState::Expired {
                        session = match client.open_session().await {
                            Ok(s) => s,
                            Err(_) => continue,
                        };
                    }
                    let lock = Lock::exclusive(&session, "/fence");
                    rec.log(
                        &who,
                        Kind::Invoke,
                        Op::Acquire {
                            lock: "/fence".into(),
                            token: None,
                        },
                    );
                    let g = match lock.acquire_timeout(Duration::from_secs(5)).await {
                        Ok(Some(g)) => g,
                        Ok(None) => {
                            rec.log(
                                &who,
                                Kind::Fail,
                                Op::Acquire {
                                    lock: "/fence".into(),
                                    token: None,
                                },
                            );
                            continue;
                        }
                        Err(_) => {
                            rec.log(
                                &who,
                                Kind::Info,
                                Op::Acquire {
                                    lock: "/fence".into(),
                                    token: None,
                                },
                            );
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let token = g.token();
                    rec.log(
                        &who,
                        Kind::Ok,
                        Op::Acquire {
                            lock: "/fence".into(),
                            token: Some(token),
                        },
                    );
                    if w == 0 && !paused_once {
                        // Paused while holding: no KeepAlives; the lease (3 s) runs out and
                        // another worker takes the lock; then this one writes anyway.
                        paused_once = true;
                        session.stop_keepalives();
                        tokio::time::sleep(Duration::from_secs(9)).await;
                        res.write(&rec, &who, token);
                        continue;
                    }
                    for _ in 0..3 {
                        if !g.may_act() || !res.write(&rec, &who, token) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    let _ = g.release().await;
                    rec.log(
                        &who,
                        Kind::Ok,
                        Op::Release {
                            lock: "/fence".into(),
                            token,
                        },
                    );
                }
            }));
        }
        // Faults (after the paused holder's lease ran out and its stale write was made):
        // the leader killed at 11 s; the next one frozen for 3 s at 15 s.
        tokio::time::sleep(Duration::from_secs(11)).await;
        let killed = tokio::task::block_in_place(|| signal_leader(&data, &eps, libc::SIGKILL));
        assert!(killed.is_some(), "no leader to kill");
        tokio::time::sleep(Duration::from_secs(4)).await;
        let frozen = tokio::task::block_in_place(|| signal_leader(&data, &eps, libc::SIGSTOP));
        tokio::time::sleep(Duration::from_secs(3)).await;
        if let Some((_, pid)) = frozen {
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
        for w in workers {
            tokio::time::timeout(Duration::from_secs(60), w)
                .await
                .expect("a worker hung")
                .unwrap();
        }
    });
    let events = rec.events();
    let path = cell.dir.path().join("fenced-lock.jsonl");
    write_history(&mut std::fs::File::create(&path).unwrap(), &events).unwrap();
    let history = read_history(std::fs::File::open(&path).unwrap()).unwrap();
    let stats = check_fenced_lock(&history)
        .unwrap_or_else(|e| panic!("fenced-lock violation: {e}\nhistory: {}", path.display()));
    println!(
        "FIGURE faults: fenced lock over 22 s with a leader kill -9, a leader SIGSTOP (3 s) and a \
         paused holder: {} grants, {} writes accepted, {} refused as stale; checker passed",
        stats.grants, stats.accepted, stats.refused
    );
    assert!(stats.grants >= 20, "too little progress: {stats:?}");
    assert!(
        stats.refused >= 1,
        "the paused holder's stale write was not refused: {stats:?}"
    );
    let _ = cell.stop();
}

/// A follower frozen (SIGSTOP) for 6 s under steady writes: the leader keeps committing
/// with the other follower (a silent peer is backed off, not flooded, and not mistaken for
/// the live one), and once thawed the follower catches up with everything.
#[test]
fn a_frozen_follower_neither_stalls_the_cell_nor_stays_behind() {
    let _g = serial();
    let mut cell = DevCell::start(&["--no-demo"]);
    let (data, endpoints) = (cell.data.clone(), cell.endpoints.clone());
    let ca = cell.ca.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = Client::connect(ClientConfig::new(endpoints.clone(), ca.clone()))
            .await
            .unwrap();
        let s = client.open_session().await.unwrap();
        s.create("/f", Vec::new(), client_sdk::CreateMode::default())
            .await
            .unwrap();
        let leader = loop {
            let mut found = None;
            for a in client.endpoints() {
                if let Ok(st) = client.status_of(a).await {
                    if st.role == "Leader" {
                        found = Some(a.to_string());
                    }
                }
            }
            if let Some(l) = found {
                break l;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let follower = endpoints.iter().find(|e| **e != leader).unwrap().clone();
        let pid = pid_listening(&data, "replica", &follower).expect("follower pid");
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let frozen_at = Instant::now();
        let mut slowest = Duration::ZERO;
        let mut n = 0u64;
        while frozen_at.elapsed() < Duration::from_secs(6) {
            let t = Instant::now();
            s.set_data("/f", n.to_string().into_bytes(), None)
                .await
                .expect("the cell keeps committing with one follower frozen");
            slowest = slowest.max(t.elapsed());
            n += 1;
        }
        unsafe { libc::kill(pid, libc::SIGCONT) };
        let target = client
            .status_of(leader.parse().unwrap())
            .await
            .unwrap()
            .last_applied;
        let thawed = Instant::now();
        let caught_up = loop {
            if let Ok(st) = client.status_of(follower.parse().unwrap()).await {
                if st.last_applied >= target {
                    break thawed.elapsed();
                }
            }
            assert!(
                thawed.elapsed() < Duration::from_secs(20),
                "the thawed follower did not catch up"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        println!(
            "FIGURE faults: follower frozen 6 s: {n} writes committed meanwhile (slowest {} ms); \
             caught up {} ms after SIGCONT",
            slowest.as_millis(),
            caught_up.as_millis()
        );
        assert!(n >= 50, "only {n} writes in 6 s with one follower frozen");
        assert!(slowest < Duration::from_secs(3), "a write took {slowest:?}");
    });
    let _ = cell.stop();
}
