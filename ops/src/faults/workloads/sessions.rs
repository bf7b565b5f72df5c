//! The session workloads: sessions that keep renewing (their ephemerals must stay),
//! sessions that stop (their ephemerals must go), and sessions that end while readers
//! read their ephemerals (a cached read after a removal completed is stale).

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, CreateMode, SessionState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::register::{cached_read, linearizable_read};
use super::{open_session, renew_if_expired, Run};
use crate::faults::checkers::{Kind, Op};

/// A session that keeps renewing and owns an ephemeral: it must never expire.
pub(super) async fn keeper(client: Client, run: Arc<Run>, i: usize) -> bool {
    let Some(session) = open_session(&client, &run).await else {
        run.violation(format!("keeper {i}: no session could be opened"));
        return false;
    };
    let path = format!("/suite/members/keep-{i}");
    let mut created = false;
    while !created && Instant::now() < run.deadline {
        created = session
            .create(
                &path,
                vec![],
                CreateMode {
                    ephemeral: true,
                    sequential: false,
                },
            )
            .await
            .is_ok()
            || session.exists(&path).await.ok().flatten().is_some();
    }
    let mut states = session.subscribe();
    loop {
        if *states.borrow() == SessionState::Expired {
            run.violation(format!(
                "session {} (keeper {i}) kept renewing but expired at {} ms",
                session.id(),
                run.rec.start().elapsed().as_millis()
            ));
            return false;
        }
        tokio::select! {
            r = states.changed() => if r.is_err() { break },
            _ = tokio::time::sleep_until(run.deadline) => break,
        }
    }
    let _ = session.close().await;
    true
}

/// Now and then a session that creates an ephemeral and stops renewing.
pub(super) async fn abandoner(client: Client, run: Arc<Run>) {
    let mut n = 0;
    while Instant::now() + run.lease < run.deadline {
        if let Some(s) = open_session(&client, &run).await {
            let _ = s
                .create(
                    &format!("/suite/members/gone-{n}"),
                    vec![],
                    CreateMode {
                        ephemeral: true,
                        sequential: false,
                    },
                )
                .await;
            s.stop_keepalives();
            *run.abandoned.lock().expect("lock") += 1;
            n += 1;
        }
        tokio::time::sleep(Duration::from_secs(7)).await;
    }
}

/// Nodes removed by session ends, for the register checker: a session creates an
/// ephemeral key (a write of a fresh value), then ends, by close (a removal that completes
/// when the close returns) or by ceasing to renew (a removal at an unknown moment, pinned
/// by the linearizable reads of [`ending_reader`]), and the next session takes a fresh key.
/// A cached read that finds a key after its removal completed is a stale read.
pub(super) async fn ending_owner(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("ending-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    // The last session must be gone by the deadline (convergence wants none left).
    while Instant::now() + run.lease < run.deadline {
        let Some(session) = open_session(&client, &run).await else {
            return;
        };
        n += 1;
        let k = format!("/suite/ending/o{i}-{n}");
        let value = format!("{i}-{n}");
        let op = Op::Write {
            key: k.clone(),
            value: value.clone(),
        };
        run.rec.log(&who, Kind::Invoke, op.clone());
        let mode = CreateMode {
            ephemeral: true,
            sequential: false,
        };
        let kind = match session.create(&k, value.into_bytes(), mode).await {
            Ok(_) => Kind::Ok,
            Err(wire::Error::NodeExists { .. }) => Kind::Fail,
            Err(_) => Kind::Info,
        };
        run.rec.log(&who, kind, op);
        run.ending_keys.lock().expect("lock").push(k.clone());
        tokio::time::sleep(Duration::from_millis(rng.gen_range(500..2_000))).await;
        let op = Op::Remove { key: k };
        run.rec.log(&who, Kind::Invoke, op.clone());
        if rng.gen_bool(0.5) {
            let kind = match session.close().await {
                Ok(()) => Kind::Ok,
                Err(_) => Kind::Info,
            };
            run.rec.log(&who, kind, op);
        } else {
            session.stop_keepalives();
            run.rec.log(&who, Kind::Info, op);
            *run.abandoned.lock().expect("lock") += 1;
        }
    }
}

/// Reads the [`ending_owner`]s' newest keys, through its session's cache and
/// linearizably (the latter pin when an expiry's removal had completed).
pub(super) async fn ending_reader(client: Client, run: Arc<Run>, i: usize, seed: u64) {
    let who = format!("ending-read-{i}");
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut session) = open_session(&client, &run).await else {
        return;
    };
    while Instant::now() < run.deadline {
        if !renew_if_expired(&client, &run, &mut session).await {
            return;
        }
        let k = {
            let keys = run.ending_keys.lock().expect("lock");
            let recent = &keys[keys.len().saturating_sub(4)..];
            recent.get(rng.gen_range(0..recent.len().max(1))).cloned()
        };
        if let Some(k) = k {
            if rng.gen_bool(0.7) {
                cached_read(&session, &run, &who, &k).await;
            } else {
                linearizable_read(&client, &run, &who, &k).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(10..40))).await;
    }
    let _ = session.close().await;
}
