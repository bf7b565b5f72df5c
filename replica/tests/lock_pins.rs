//! A lock holder learns that its node is gone before the delete commits, whoever deletes
//! it: the holder reads its node through its session's cache at the grant (a pin), so
//! the leader invalidates it first, and `LockGuard::may_act` turns false (and `lost`
//! true) before the invalidation is acknowledged. Without this a holder whose node was
//! deleted by someone else (an admin, or a prefix moving to another cell) would go on
//! acting on its lease alone while the next contender is granted the lock.
//!
//! At five real replicas: a delete by another session; the same after the leader was
//! killed (the pin is read again at the new leader, and holds again); and a holder whose
//! lock is simply released by itself and taken by another is unaffected.

mod common;

use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Lock, LockGuard};
use common::{rt, serial, Opts, TestCell};

/// Waits (bounded) until the guard may act again, after a flush of its session's cache.
async fn until_may_act(guard: &LockGuard, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if guard.may_act() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Waits (bounded) until the guard knows its lock is gone for good.
async fn until_lost(guard: &LockGuard, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if guard.lost() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[test]
fn a_holder_learns_before_its_node_is_deleted_by_someone_else() {
    let _g = serial();
    rt().block_on(async {
        let mut cell = TestCell::start(Opts::default());
        cell.keep_on_panic();
        let admin = cell.client().await;
        cell.wait_settled_leader(&admin, Duration::from_secs(30))
            .await;
        let holder_client = cell.client().await;
        let holder = holder_client.open_session().await.unwrap();
        let other = admin.open_session().await.unwrap();

        // Granted: it may act at once (the pin was read at the grant).
        let guard = Lock::exclusive(&holder, "/l").acquire().await.unwrap();
        assert!(guard.may_act(), "a fresh grant may act");
        assert!(!guard.lost());

        // Someone else deletes the holder's node. Once that delete is answered, the
        // holder already knows: the leader held the delete for its acknowledgement.
        other.delete(&guard.sequencer().node, None).await.unwrap();
        assert!(
            !guard.may_act(),
            "the holder may still act although its node's delete committed"
        );
        // A read of the node right after finds it gone: lost for good.
        assert!(
            until_lost(&guard, Duration::from_secs(10)).await,
            "never lost"
        );
        assert!(!guard.may_act());
        assert!(holder.lease_valid(), "the session itself goes on");
        drop(guard);

        // The next grant, then the leader killed: the holder's event stream moves to the
        // new leader, which knows nothing of its cachers, so the pin is read there again
        // and holds again.
        let guard = Lock::exclusive(&holder, "/l").acquire().await.unwrap();
        assert!(guard.may_act());
        let leader = cell
            .wait_leader(&admin, Duration::from_secs(10), None)
            .await;
        cell.kill(leader);
        let new = cell
            .wait_leader(&admin, Duration::from_secs(30), Some(leader))
            .await;
        assert_ne!(new, leader);
        assert!(
            until_may_act(&guard, Duration::from_secs(30)).await,
            "the pin was not read again at the new leader"
        );
        assert!(!guard.lost());
        // A delete at the new leader waits for the holder too.
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match other.delete(&guard.sequencer().node, None).await {
                Ok(()) => break,
                Err(e) if Instant::now() < until => {
                    eprintln!("delete at the new leader: {e}; again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("delete at the new leader: {e}"),
            }
        }
        assert!(
            !guard.may_act(),
            "a holder acts after a delete at the new leader"
        );
        assert!(
            until_lost(&guard, Duration::from_secs(10)).await,
            "never lost"
        );
        drop(guard);

        // A holder's own release and the next holder's grant: nothing is lost.
        let a = Lock::exclusive(&holder, "/l").acquire().await.unwrap();
        assert!(a.may_act());
        let contender = {
            let other = other.clone();
            tokio::spawn(async move { Lock::exclusive(&other, "/l").acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            a.may_act(),
            "a waiting contender does not unsettle the holder"
        );
        a.release().await.unwrap();
        let b = tokio::time::timeout(Duration::from_secs(10), contender)
            .await
            .expect("granted")
            .unwrap()
            .unwrap();
        assert!(b.may_act() && !b.lost());
        b.release().await.unwrap();
    });
}
