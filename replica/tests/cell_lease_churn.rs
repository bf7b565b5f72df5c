//! Scenario 9: leaders change faster than the session lease for longer than a lease; a dead
//! client's session still expires (the lease checkpoints carry its silence across leaders),
//! and a live client's session does not.

mod common;

use std::time::{Duration, Instant};

use client_sdk::{CreateMode, SessionState};
use common::{rt, serial, Opts, TestCell};

#[test]
fn dead_session_expires_under_leader_churn() {
    let _g = serial();
    rt().block_on(async {
        let lease_ms = 4_000;
        let mut cell = TestCell::start(Opts { lease_ms, checkpoint_interval_ms: 250, ..Opts::default() });
        let client = cell.client().await;
        let mut leader = cell.wait_leader(&client, Duration::from_secs(20), None).await;
        let admin = client.open_session().await.unwrap();
        admin.create("/members", vec![], CreateMode::default()).await.unwrap();
        let dead = client.open_session().await.unwrap();
        let live = client.open_session().await.unwrap();
        let eph = CreateMode { ephemeral: true, sequential: false };
        dead.create("/members/dead", vec![], eph).await.unwrap();
        live.create("/members/live", vec![], eph).await.unwrap();
        dead.stop_keepalives();
        let silent_from = Instant::now();

        // Churn: kill -9 the leader after ~1.5 s in office, wait for another to be elected,
        // and bring the old one back as a follower. No leader lives as long as the 4 s
        // lease, so a full lease on every takeover would keep the dead session forever.
        let mut changes = 0;
        let mut expired_after = None;
        let churn_until = Instant::now() + Duration::from_millis(lease_ms * 6);
        while Instant::now() < churn_until {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            if client.exists("/members/dead").await.unwrap().is_none() {
                expired_after = Some(silent_from.elapsed());
                println!(
                    "FIGURE churn: dead session expired {} ms after it went silent, after {changes} leader changes (lease {lease_ms} ms)",
                    silent_from.elapsed().as_millis()
                );
                break;
            }
            let old = leader;
            cell.kill(old);
            leader = cell.wait_leader(&client, Duration::from_secs(10), Some(old)).await;
            cell.spawn(old);
            changes += 1;
        }
        let expired_after = expired_after.expect("the dead client's session expired despite leader churn");
        assert!(changes >= 2, "leaders changed during the lease: {changes}");
        assert!(expired_after >= Duration::from_millis(lease_ms / 2), "expired too early: {expired_after:?}");
        // The live session rode through every fail-over.
        assert!(client.exists("/members/live").await.unwrap().is_some(), "live session's ephemeral survives");
        assert_ne!(live.state(), SessionState::Expired);
        live.create("/members/live-2", vec![], eph).await.unwrap();
    });
}
