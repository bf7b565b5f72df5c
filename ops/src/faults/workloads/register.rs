//! The register workload: writes, compare-and-sets, linearizable reads and reads
//! through session caches on a few keys per epoch, recorded for the register checker.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, Session};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{key, open_session, renew_if_expired, text, Run, KEYS_PER_EPOCH};
use crate::faults::checkers::{Kind, Op};

/// A register worker: reads (linearizable and cached), writes and compare-and-sets.
pub(super) async fn register_worker(client: Client, run: Arc<Run>, w: usize, seed: u64) {
    let who = format!("reg-{w}");
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    let mut n = 0u64;
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        let k = current_key(&run, &mut rng);
        n += 1;
        let value = format!("{w}-{n}");
        match rng.gen_range(0..100) {
            0..30 => linearizable_read(&client, &run, &who, &k).await,
            30..50 => cached_read(&session, &run, &who, &k).await,
            50..75 => {
                let op = Op::Write {
                    key: k.clone(),
                    value: value.clone(),
                };
                run.rec.log(&who, Kind::Invoke, op.clone());
                let r = session.set_data(&k, value.into_bytes(), None).await;
                run.rec
                    .log(&who, if r.is_ok() { Kind::Ok } else { Kind::Info }, op);
            }
            _ => {
                // Compare-and-set by version: every value is unique, so a version names
                // one value and the CAS is one on values.
                run.rec.log(&who, Kind::Invoke, read(&k, None));
                let (from, version) = match client.get(&k).await {
                    Ok((v, stat)) => {
                        run.rec.log(&who, Kind::Ok, read(&k, Some(text(&v))));
                        (text(&v), stat.version)
                    }
                    Err(_) => {
                        run.rec.log(&who, Kind::Info, read(&k, None));
                        continue;
                    }
                };
                let op = Op::Cas {
                    key: k.clone(),
                    from: Some(from),
                    to: value.clone(),
                };
                run.rec.log(&who, Kind::Invoke, op.clone());
                let kind = match session
                    .set_data(&k, value.into_bytes(), Some(version))
                    .await
                {
                    Ok(_) => Kind::Ok,
                    Err(wire::Error::BadVersion { .. }) => Kind::Fail,
                    Err(_) => Kind::Info,
                };
                run.rec.log(&who, kind, op);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(20..80))).await;
    }
    let _ = session.close().await;
}

/// A cache reader: cached reads only, of the current epoch's keys, one every few
/// milliseconds. Its hits never wait on the network, so while `client-cut` stops what
/// arrives for it, it goes on serving what it cached, and the register checker sees
/// whether a write completed meanwhile without waiting for this session.
pub(super) async fn cache_reader(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("cache-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        let k = current_key(&run, &mut rng);
        cached_read(&session, &run, &who, &k).await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(15..45))).await;
    }
    let _ = session.close().await;
}

/// A reader: linearizable reads only, of the current epoch's keys. It never writes, so it
/// never learns who leads from a write's redirect: its reads go to the first replica of
/// its list (a follower, mostly), which must send it on to the leader rather than answer
/// from its own, possibly stale, state.
pub(super) async fn reader(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("read-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    while Instant::now() < run.deadline {
        let k = current_key(&run, &mut rng);
        linearizable_read(&client, &run, &who, &k).await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(20..60))).await;
    }
}

/// One of the current epoch's register keys, drawn from `rng`.
fn current_key(run: &Run, rng: &mut StdRng) -> String {
    key(
        run.epoch_of(Instant::now()),
        rng.gen_range(0..KEYS_PER_EPOCH),
    )
}

/// A linearizable read of `k`, recorded (a failed one as indeterminate).
pub(super) async fn linearizable_read(client: &Client, run: &Run, who: &str, k: &str) {
    run.rec.log(who, Kind::Invoke, read(k, None));
    match client.get(k).await {
        Ok((v, _)) => run.rec.log(who, Kind::Ok, read(k, Some(text(&v)))),
        Err(_) => run.rec.log(who, Kind::Info, read(k, None)),
    }
}

/// A read of `k` through `session`'s cache, recorded (a failed one as indeterminate).
pub(super) async fn cached_read(session: &Session, run: &Run, who: &str, k: &str) {
    run.rec.log(who, Kind::Invoke, read(k, None));
    match session.get_cached(k).await {
        Ok(v) => run
            .rec
            .log(who, Kind::Ok, read(k, v.map(|(data, _)| text(&data)))),
        Err(_) => run.rec.log(who, Kind::Info, read(k, None)),
    }
}

fn read(k: &str, value: Option<String>) -> Op {
    Op::Read {
        key: k.into(),
        value,
    }
}
