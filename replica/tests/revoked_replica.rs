//! A replica whose certificate is revoked gets no more of the log (issue 24, step 4):
//! the leader checks a peer's certificate again before each RPC once its files changed,
//! so its connection to the revoked replica, dialed before the revocation, is closed and
//! cannot be made again; the others go on.

mod common;

use std::time::{Duration, Instant};

use client_sdk::CreateMode;
use common::{rt, serial, Opts, TestCell};
use wire::identity::Identity;

fn replace(path: &std::path::Path, pem: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, pem).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn a_revoked_replica_gets_no_more_of_the_log() {
    let _s = serial();
    rt().block_on(async {
        let mut cell = TestCell::start(Opts {
            replicas: 3,
            crl: true,
            ..Opts::default()
        });
        cell.keep_on_panic();
        let client = cell.client().await;
        let leader = cell
            .wait_leader(&client, Duration::from_secs(20), None)
            .await;
        // A follower gets a certificate of its own, and a revocation list of its own (it
        // is not told of its own revocation), and is restarted on them.
        let victim = *cell.procs.keys().find(|id| **id != leader).unwrap();
        let dir = cell.dir.path().join("victim-tls");
        std::fs::create_dir_all(&dir).unwrap();
        let ca = cell.ca_issuer();
        let own = ca
            .issue(&Identity::parse("lock://dev/replica/victim").unwrap(), 1)
            .unwrap();
        std::fs::write(dir.join("replica.pem"), &own.cert_pem).unwrap();
        std::fs::write(dir.join("replica.key"), &own.key_pem).unwrap();
        std::fs::write(dir.join("empty.crl"), ca.crl(&[], 1, 30).unwrap()).unwrap();
        {
            let (path, cfg) = cell.configs.get_mut(&victim).unwrap();
            cfg.tls.cert = dir.join("replica.pem");
            cfg.tls.key = dir.join("replica.key");
            cfg.tls.crls = vec![dir.join("empty.crl")];
            std::fs::write(&*path, toml::to_string_pretty(&*cfg).unwrap()).unwrap();
        }
        cell.kill(victim);
        cell.spawn(victim);
        let s = client.open_session().await.unwrap();
        s.create("/before", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let victim_addr = cell.addr(victim).parse().unwrap();
        let leader_now = cell
            .wait_leader(&client, Duration::from_secs(20), None)
            .await;
        assert_ne!(
            leader_now, victim,
            "the victim leads; the test needs it to follow"
        );
        let caught_up = {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let st = client.status_of(victim_addr).await;
                let leader_st = cell.statuses(&client).await[&leader_now].last_applied;
                if st.as_ref().is_ok_and(|st| st.last_applied >= leader_st) {
                    break true;
                }
                if Instant::now() > deadline {
                    break false;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        assert!(caught_up, "the victim did not follow before its revocation");

        // Revoked in the list the others read.
        let serial_no = wire::tls::serial_of(&own.cert_pem).unwrap();
        replace(
            &cell.crl(),
            &ca.crl(std::slice::from_ref(&serial_no), 2, 30).unwrap(),
        );
        // Within a few seconds (files re-read at most once a second, the watcher every
        // 2 s) the leader stops sending it the log: writes go on, its applied index stays.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let at = client.status_of(victim_addr).await.unwrap().last_applied;
        for i in 0..20 {
            s.create(&format!("/after-{i}"), Vec::new(), CreateMode::default())
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let st = client.status_of(victim_addr).await.unwrap();
        let leader_applied = cell.statuses(&client).await[&leader_now].last_applied;
        assert!(
            st.last_applied <= at && leader_applied >= at + 20,
            "the revoked replica still gets the log: it applied {} (from {at}), the leader {}",
            st.last_applied,
            leader_applied
        );
    });
}
