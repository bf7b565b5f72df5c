//! Scenario 9: leaders change faster than the session lease for longer than a lease; a dead
//! client's session still expires (the lease checkpoints carry its silence across leaders),
//! and a live client's session does not. Also: a dead client's session expires while a long
//! snapshot is being built.

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

/// Issue 22, item 5: a dead client's session expires while the leader builds a long
/// snapshot, and writes, reads and KeepAlives go on meanwhile. The build serialized the
/// state under its read lock; the expiry's apply then waited for the whole serialization
/// and every reader waited behind that apply, so nothing expired (and no linearizable read
/// was answered) until the snapshot was done. `faults.snapshot_build_delay_ms` makes the
/// serialization 10 s longer, standing for a state larger than a test writes.
#[test]
fn dead_session_expires_during_a_long_snapshot() {
    let _g = serial();
    rt().block_on(async {
        let (lease_ms, delay_ms) = (4_000u64, 10_000u64);
        // Elections slower than the default, so that a loaded machine does not change the
        // leader during the 10 s this test needs it in office.
        let raft = replica::config::RaftConfig {
            election_timeout_min_ms: 1_500,
            election_timeout_max_ms: 3_000,
            ..Default::default()
        };
        let cell = TestCell::start(Opts {
            replicas: 3,
            lease_ms,
            raft,
            snapshot_build_delay_ms: delay_ms,
            ..Opts::default()
        });
        let client = cell.client().await;
        let leader = cell.wait_leader(&client, Duration::from_secs(20), None).await;
        let leader_addr: std::net::SocketAddr = cell.addr(leader).parse().unwrap();
        let live = client.open_session().await.unwrap();
        live.create("/members", vec![], CreateMode::default()).await.unwrap();
        // Something for the copy to walk: 64 nodes of 16 KiB.
        for i in 0..64 {
            live.create(&format!("/members/data-{i}"), vec![7; 16 * 1024], CreateMode::default())
                .await
                .unwrap();
        }
        let eph = CreateMode { ephemeral: true, sequential: false };
        let dead = client.open_session().await.unwrap();
        dead.create("/members/dead", vec![], eph).await.unwrap();
        dead.stop_keepalives();
        let silent_from = Instant::now();
        // The leader's status: it must answer throughout (no fail-over hides a stall); a
        // few tries, so that one lost handshake on a loaded machine is not taken for one.
        let leader_status = |c: &client_sdk::Client| {
            let c = c.clone();
            async move {
                let mut last = None;
                for _ in 0..4 {
                    match c.status_of(leader_addr).await {
                        Ok(s) => return s,
                        Err(e) => last = Some(e),
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                panic!("the leader does not answer its status: {last:?}")
            }
        };
        let snapshot_index = |c: &client_sdk::Client| {
            let s = leader_status(c);
            async move { s.await.snapshot_index }
        };
        let term = leader_status(&client).await.term;
        assert_eq!(snapshot_index(&client).await, None, "no snapshot before the test's");
        let snap = {
            let c = client.clone();
            let req = wire::types::Request { session: 0, request_id: 0, ack_below: 0, op: wire::types::Op::Snapshot };
            tokio::spawn(async move { c.call_at(leader_addr, &req).await })
        };
        // While the snapshot is being built: the dead session expires within its lease
        // (plus the scan and a commit), and the live one writes and stays healthy.
        let bound = Duration::from_millis(lease_ms + 3_000);
        let mut slowest_write = Duration::ZERO;
        // The index of a write applied before a read that still saw the dead session's
        // node: the expiry's entry comes after it.
        let mut before_expiry = None;
        let gone_after = loop {
            let t = Instant::now();
            let written = live.set_data("/members", b"tick".to_vec(), None).await.unwrap();
            slowest_write = slowest_write.max(t.elapsed());
            if client.exists("/members/dead").await.unwrap().is_none() {
                break silent_from.elapsed();
            }
            before_expiry = Some(written.mod_index);
            assert!(
                silent_from.elapsed() < bound,
                "the dead session's ephemeral still exists {:?} after it went silent (lease {lease_ms} ms)",
                silent_from.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            snapshot_index(&client).await,
            None,
            "the snapshot (10 s longer) was already done when the session expired"
        );
        assert!(gone_after >= Duration::from_millis(lease_ms / 2), "expired too early: {gone_after:?}");
        let st = leader_status(&client).await;
        assert_eq!((st.role.as_str(), st.term), ("Leader", term), "the leader stayed in office");
        assert_eq!(live.state(), SessionState::Healthy);
        println!(
            "FIGURE snapshot: a dead session expired {} ms after it went silent (lease {lease_ms} ms) while a snapshot was being built; slowest write meanwhile {} ms",
            gone_after.as_millis(),
            slowest_write.as_millis()
        );
        // The snapshot completes afterwards and covers the expiry.
        let deadline = Instant::now() + Duration::from_millis(delay_ms + 30_000);
        while snapshot_index(&client).await.is_none() {
            assert!(Instant::now() < deadline, "the snapshot never completed");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = snap.await;
        // The snapshot's copy was taken before the expiry applied, and the snapshot was not
        // done when it had: the build spanned the expiry.
        let (built, before) = (snapshot_index(&client).await.unwrap(), before_expiry.unwrap());
        assert!(built <= before, "the snapshot (index {built}) was taken after the expiry (after index {before})");
        let st = leader_status(&client).await;
        assert_eq!((st.role.as_str(), st.term), ("Leader", term), "the leader stayed in office");
        assert_eq!(live.state(), SessionState::Healthy);
        live.create("/members/after", vec![], eph).await.unwrap();
    });
}
