//! The fenced-lock workload: workers take one lock and write to a protected resource with
//! their token; worker 0 now and then stops renewing while it holds the lock, sleeps past
//! its lease and writes anyway.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, Lock};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{open_session, renew_if_expired, Run};
use crate::faults::checkers::{Kind, Op};

/// A fenced-lock worker; worker 0 sometimes stops renewing while it holds the lock.
pub(super) async fn fenced_worker(client: Client, run: Arc<Run>, w: usize, seed: u64) {
    let who = format!("lock-{w}");
    let mut rng = StdRng::seed_from_u64(seed);
    let lock_path = "/suite/lock";
    let acq = |token| Op::Acquire {
        lock: lock_path.into(),
        token,
    };
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    let mut grants = 0u64;
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        run.rec.log(&who, Kind::Invoke, acq(None));
        let guard = match Lock::exclusive(&session, lock_path)
            .acquire_timeout(Duration::from_secs(5))
            .await
        {
            Ok(Some(g)) => g,
            Ok(None) => {
                run.rec.log(&who, Kind::Fail, acq(None));
                continue;
            }
            Err(_) => {
                run.rec.log(&who, Kind::Info, acq(None));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = guard.token();
        run.rec.log(&who, Kind::Ok, acq(Some(token)));
        grants += 1;
        if w == 0 && grants.is_multiple_of(4) && Instant::now() + run.lease * 3 < run.deadline {
            // Paused while holding: no KeepAlives; the lease runs out, another worker
            // takes the lock, and this one writes with its old token anyway.
            session.stop_keepalives();
            *run.abandoned.lock().expect("lock") += 1;
            tokio::time::sleep(run.lease * 2 + Duration::from_secs(1)).await;
            run.resource.write(&run.rec, &who, token);
            drop(guard);
            session = match open_session(&client, &run).await {
                Some(s) => s,
                None => return,
            };
            continue;
        }
        let act = Op::Act {
            lock: lock_path.into(),
            token,
        };
        if w == 1 && grants.is_multiple_of(3) && Instant::now() + run.lease * 3 < run.deadline {
            // Deaf while holding: no KeepAlives, and it keeps acting (without the fenced
            // resource) for as long as its lease says it may. The cell expires the session
            // and grants the lock to another worker; the checker's rule 3 sees whether
            // this one still acted after that grant completed (it must not: its local
            // lease ends first, by the clock-drift allowance, unless the cell's clock
            // runs faster than that allows).
            session.stop_keepalives();
            *run.abandoned.lock().expect("lock") += 1;
            let bound = Instant::now() + run.lease * 2;
            while Instant::now() < bound {
                let at = run.rec.stamp();
                if !guard.may_act() {
                    break;
                }
                run.rec.log_at(at, &who, Kind::Ok, act.clone());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(guard);
            session = match open_session(&client, &run).await {
                Some(s) => s,
                None => return,
            };
            continue;
        }
        for _ in 0..rng.gen_range(1..=3) {
            let at = run.rec.stamp();
            if !guard.may_act() {
                break;
            }
            run.rec.log_at(at, &who, Kind::Ok, act.clone());
            if !run.resource.write(&run.rec, &who, token) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.gen_range(1..20))).await;
        }
        let _ = guard.release().await;
        run.rec.log(
            &who,
            Kind::Ok,
            Op::Release {
                lock: lock_path.into(),
                token,
            },
        );
    }
    let _ = session.close().await;
}
