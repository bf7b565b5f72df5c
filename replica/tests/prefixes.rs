//! Cells know what they own (issue 25; docs/directory.md): the prefixes a cell records,
//! `WrongCell` for the rest, a frozen prefix that reads but does not write, and a prefix
//! moved between two real cells by the operations `lockctl dir move` is made of (freeze,
//! export, import, let go, hand over, drop), with its data, versions, ACLs and sequence
//! counters; the old cell's locks end before the new cell serves, and fencing tokens only
//! grow across the move. Every replica of both cells ends
//! with the same state.

mod common;

use std::time::Duration;

use client_sdk::{Client, CreateMode, Lock};
use common::{rt, serial, Opts, TestCell};
use wire::directory::{ExportedNode, PrefixState};
use wire::Error;

fn three() -> Opts {
    Opts {
        replicas: 3,
        // No lease checkpoints (log entries) while digests are compared.
        checkpoint_interval_ms: 3_600_000,
        ..Opts::default()
    }
}

async fn export_all(c: &Client, prefix: &str) -> Vec<ExportedNode> {
    let mut out = Vec::new();
    let mut after = None;
    for _ in 0..10_000 {
        let (nodes, more) = c.export_prefix(prefix, after).await.unwrap();
        after = nodes.last().map(|n| n.path.clone());
        out.extend(nodes);
        if !more {
            return out;
        }
    }
    panic!("export never ended");
}

#[test]
fn a_cell_serves_its_prefixes_and_a_prefix_moves_to_another_cell() {
    let _s = serial();
    rt().block_on(async {
        let a = TestCell::start(three());
        let b = TestCell::start(three());
        a.keep_on_panic();
        let ca = a.client().await;
        let cb = b.client().await;
        a.wait_leader(&ca, Duration::from_secs(20), None).await;
        b.wait_leader(&cb, Duration::from_secs(20), None).await;
        let sa = ca.open_session().await.unwrap();
        let sb = cb.open_session().await.unwrap();

        // Before any prefix is recorded, cell A serves every path.
        sa.create("/pay", b"root".to_vec(), CreateMode::default())
            .await
            .unwrap();
        sa.create("/pay/cfg", b"v0".to_vec(), CreateMode::default())
            .await
            .unwrap();
        sa.set_data("/pay/cfg", b"v1".to_vec(), Some(0))
            .await
            .unwrap();
        sa.create("/other", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        for i in 0..300 {
            sa.create(
                &format!("/pay/n{i:04}"),
                vec![7; 2000],
                CreateMode::default(),
            )
            .await
            .unwrap();
        }
        assert!(ca.prefixes().await.unwrap().is_empty());

        // A owns /pay at epoch 0: /other is another cell's from now on.
        ca.set_prefix("/pay", 0, PrefixState::Owned).await.unwrap();
        let wrong = Error::WrongCell {
            prefix: "/other".into(),
            epoch: 0,
        };
        assert_eq!(
            sa.set_data("/other", b"x".to_vec(), None)
                .await
                .unwrap_err(),
            wrong
        );
        assert_eq!(sa.get("/other").await.unwrap_err(), wrong);
        assert!(sa.get("/").await.is_ok());

        // A lock granted in A: its token is of epoch 0 (its create index × 1024 + position).
        let held = Lock::exclusive(&sa, "/pay/lock").acquire().await.unwrap();
        let old_token = held.sequencer().token;
        assert_eq!(wire::directory::token_epoch(old_token), 0);

        // Frozen: reads are served, a write waits (the SDK retries `Frozen`) and is
        // applied once the freeze is lifted, under its first request id.
        ca.set_prefix("/pay", 0, PrefixState::Frozen).await.unwrap();
        let writer = {
            let sa = sa.clone();
            tokio::spawn(async move { sa.set_data("/pay/cfg", b"v2".to_vec(), Some(1)).await })
        };
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !writer.is_finished(),
            "a write went through a frozen prefix"
        );
        assert_eq!(sa.get("/pay/cfg").await.unwrap().0, b"v1");
        ca.set_prefix("/pay", 0, PrefixState::Owned).await.unwrap();
        let st = writer.await.unwrap().unwrap();
        assert_eq!(st.version, 2);

        // A write applied whose answer was lost, retried (same request id) after the
        // prefix froze: it gets its first answer, not `Frozen` (which would make a router
        // send it again elsewhere, applying it twice).
        let raw = wire::types::Request {
            session: sa.id(),
            request_id: 1 << 40,
            ack_below: 0,
            op: wire::types::Op::Create {
                path: "/pay/once".into(),
                data: b"1".to_vec(),
                mode: CreateMode::default(),
            },
        };
        let first = ca.call(raw.clone()).await.unwrap();
        ca.set_prefix("/pay", 0, PrefixState::Frozen).await.unwrap();
        assert_eq!(ca.call(raw.clone()).await.unwrap(), first);
        ca.set_prefix("/pay", 0, PrefixState::Owned).await.unwrap();

        // Not exported while writes go on.
        assert!(matches!(
            ca.export_prefix("/pay", None).await.unwrap_err(),
            Error::BadRequest { .. }
        ));
        // The move, step by step: freeze A; B imports at epoch 1 (a first attempt
        // interrupted after one page, then the whole copy); B owns; A lets go and drops.
        ca.set_prefix("/pay", 0, PrefixState::Frozen).await.unwrap();
        let nodes = export_all(&ca, "/pay").await;
        assert_eq!(nodes.len(), 304, "the lock's ephemeral node is not copied");
        let (first_page, more) = ca.export_prefix("/pay", None).await.unwrap();
        assert!(more && first_page.len() < nodes.len(), "several pages");
        cb.set_prefix("/pay", 1, PrefixState::Importing)
            .await
            .unwrap();
        cb.import_prefix("/pay", 1, true, first_page).await.unwrap();
        assert_eq!(
            sb.get("/pay/cfg").await.unwrap_err(),
            Error::WrongCell {
                prefix: "/pay".into(),
                epoch: 1
            },
            "nothing is served while importing"
        );
        let mut first = true;
        let mut chunk = Vec::new();
        let mut bytes = 0;
        for n in nodes.iter().cloned() {
            bytes += n.data.len() + n.path.len() + 64;
            chunk.push(n);
            if bytes > 256 * 1024 {
                cb.import_prefix("/pay", 1, first, std::mem::take(&mut chunk))
                    .await
                    .unwrap();
                (first, bytes) = (false, 0);
            }
        }
        cb.import_prefix("/pay", 1, first, chunk).await.unwrap();
        // The old cell lets go before the new one serves: its locks end at the
        // hand-over (no lock is held in both cells at once), and its sequencers are no
        // longer current.
        assert!(sa.check_sequencer(held.sequencer()).await.unwrap());
        ca.set_prefix("/pay", 1, PrefixState::Gone).await.unwrap();
        assert!(!sa.check_sequencer(held.sequencer()).await.unwrap());
        assert_eq!(
            sa.exists(&held.sequencer().node).await.unwrap_err(),
            Error::WrongCell {
                prefix: "/pay".into(),
                epoch: 1
            }
        );
        cb.set_prefix("/pay", 1, PrefixState::Owned).await.unwrap();
        // A faithful copy (exported from B under a freeze given up at once).
        cb.set_prefix("/pay", 1, PrefixState::Frozen).await.unwrap();
        assert_eq!(export_all(&cb, "/pay").await, nodes, "a faithful copy");
        cb.set_prefix("/pay", 1, PrefixState::Owned).await.unwrap();

        // B serves /pay: the copied version goes on, and its first grant is above every
        // token A ever gave for /pay.
        assert_eq!(sb.get("/pay/cfg").await.unwrap().0, b"v2");
        sb.set_data("/pay/cfg", b"v3".to_vec(), Some(2))
            .await
            .unwrap();
        let new = Lock::exclusive(&sb, "/pay/lock").acquire().await.unwrap();
        assert!(new.sequencer().token > old_token);
        assert_eq!(wire::directory::token_epoch(new.sequencer().token), 1);

        // A refuses /pay with the epoch of the move, then drops it; its holder's
        // ephemeral node goes with it, and the session goes on.
        let moved = Error::WrongCell {
            prefix: "/pay".into(),
            epoch: 1,
        };
        assert_eq!(
            sa.set_data("/pay/cfg", b"late".to_vec(), None)
                .await
                .unwrap_err(),
            moved
        );
        ca.drop_prefix("/pay", 1).await.unwrap();
        ca.drop_prefix("/pay", 1).await.unwrap();
        assert!(sb.children("/pay").await.unwrap().len() > 300);
        assert!(matches!(
            cb.drop_prefix("/pay", 1).await.unwrap_err(),
            Error::BadRequest { .. }
        ));
        let recorded = ca.prefixes().await.unwrap();
        assert_eq!(recorded.len(), 1);
        assert_eq!(
            (recorded[0].epoch, recorded[0].state),
            (1, PrefixState::Gone)
        );
        drop(held);
        new.release().await.unwrap();
        sa.close().await.unwrap();
        sb.close().await.unwrap();

        // Every replica of each cell holds the same state.
        a.assert_same_state(&ca, Duration::from_secs(20)).await;
        b.assert_same_state(&cb, Duration::from_secs(20)).await;
    });
}
