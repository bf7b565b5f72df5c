//! `wire::rt`: where tasks go before and after `spawn_on_local_sets` (a process of its
//! own: the switch is process-wide).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::AsyncRuntime;
use wire::rt::{quic_runtime, spawn, spawn_on_local_sets, RaftRuntime};

#[test]
fn tasks_go_to_the_runtime_then_to_the_local_set_being_driven() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Before the switch, outside any LocalSet: an ordinary task.
    assert_eq!(rt.block_on(async { spawn(async { 1 }).await.unwrap() }), 1);

    spawn_on_local_sets();
    let set = tokio::task::LocalSet::new();
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    // Spawned while the set is driven, by our code, by openraft's runtime and by quinn's.
    set.block_on(&rt, async move {
        spawn(async {});
        quic_runtime().unwrap().spawn(Box::pin(async {}));
        <RaftRuntime as AsyncRuntime>::spawn(async move { r.store(true, Ordering::SeqCst) })
            .await
            .unwrap();
    });
    assert!(ran.load(Ordering::SeqCst));

    // A task spawned on the set runs only while the set is driven: the runtime alone,
    // however long it runs, leaves it queued (a paused host).
    let held = Arc::new(AtomicBool::new(false));
    let h = held.clone();
    set.block_on(&rt, async move {
        spawn(async move { h.store(true, Ordering::SeqCst) });
    });
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
    assert!(!held.load(Ordering::SeqCst), "ran without its LocalSet");
    set.block_on(&rt, tokio::task::yield_now());
    assert!(
        held.load(Ordering::SeqCst),
        "did not run when its LocalSet was driven"
    );
}
