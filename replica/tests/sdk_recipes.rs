//! Issue 3, scenario 5: election hand-off with fencing, membership seen by a watcher,
//! config compare-and-set conflicts and watches, on five real replicas.

mod common;

use std::time::Duration;

use client_sdk::fencing::admit;
use client_sdk::recipes::config::Config;
use client_sdk::recipes::election::Election;
use client_sdk::recipes::membership::Group;
use client_sdk::{CreateMode, Error, EventType};
use common::{rt, serial, Opts, TestCell};

const T: Duration = Duration::from_secs(10);

#[test]
fn election_membership_and_config() {
    let _g = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts::default());
        let client = cell.client().await;
        cell.wait_leader(&client, Duration::from_secs(20), None)
            .await;
        let a = client.open_session().await.unwrap();
        let b = client.open_session().await.unwrap();
        let observer = client.open_session().await.unwrap();
        a.create("/svc", vec![], CreateMode::default())
            .await
            .unwrap();

        // Election: a leads; b waits; the observer sees a, then b after a resigns.
        let ea = Election::new(&a, "/svc/leader");
        let la = ea.campaign(b"10.0.0.1:80".to_vec()).await.unwrap();
        let eb = Election::new(&b, "/svc/leader");
        let b_campaign = tokio::spawn(async move { eb.campaign(b"10.0.0.2:80".to_vec()).await });
        let eo = Election::new(&observer, "/svc/leader");
        let (leader, changed) = eo.observe().await.unwrap();
        let leader = leader.expect("a leader");
        assert_eq!(leader.address, b"10.0.0.1:80");
        assert_eq!(leader.token, la.token());
        // The protected resource has seen a's token.
        let mut highest = admit(None, la.token()).unwrap();
        let old_token = la.token();
        la.resign().await.unwrap();
        tokio::time::timeout(T, changed)
            .await
            .expect("observer told")
            .unwrap();
        let lb = tokio::time::timeout(T, b_campaign)
            .await
            .expect("b takes over")
            .unwrap()
            .unwrap();
        let (leader, _) = eo.observe().await.unwrap();
        assert_eq!(leader.unwrap().address, b"10.0.0.2:80");
        // b's first act fences the resource; a's late write is refused.
        highest = admit(Some(highest), lb.token()).unwrap();
        assert!(
            admit(Some(highest), old_token).is_err(),
            "the old leader is fenced out"
        );
        assert!(
            observer.check_sequencer(lb.sequencer()).await.unwrap(),
            "b's grant is current"
        );

        // Membership: joins and leaves are seen by a watcher.
        let ga = Group::new(&a, "/svc/members");
        ga.join("a", b"x".to_vec()).await.unwrap();
        let go = Group::new(&observer, "/svc/members");
        let (members, changed) = go.members_watch().await.unwrap();
        assert_eq!(
            members.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
            vec!["a"]
        );
        Group::new(&b, "/svc/members")
            .join("b", b"y".to_vec())
            .await
            .unwrap();
        assert_eq!(
            tokio::time::timeout(T, changed)
                .await
                .expect("join seen")
                .unwrap()
                .event,
            EventType::ChildrenChanged
        );
        let (members, changed) = go.members_watch().await.unwrap();
        assert_eq!(members.len(), 2);
        assert_eq!(go.member_data("b").await.unwrap(), b"y");
        ga.leave("a").await.unwrap();
        tokio::time::timeout(T, changed)
            .await
            .expect("leave seen")
            .unwrap();
        assert_eq!(go.members().await.unwrap().len(), 1);
        // A member whose session ends leaves too.
        let (_, changed) = go.members_watch().await.unwrap();
        b.close().await.unwrap();
        tokio::time::timeout(T, changed)
            .await
            .expect("session end seen")
            .unwrap();
        assert!(go.members().await.unwrap().is_empty());

        // Config: compare-and-set conflicts change nothing; watches fire on change.
        let ca = Config::new(&a);
        let co = Config::new(&observer);
        assert_eq!(ca.set("/svc/flags", b"v1".to_vec(), None).await.unwrap(), 0);
        let (value, version, w) = co.watch("/svc/flags").await.unwrap();
        assert_eq!((value.as_slice(), version), (&b"v1"[..], 0));
        assert_eq!(
            ca.set("/svc/flags", b"v2".to_vec(), Some(0)).await.unwrap(),
            1
        );
        let err = co
            .set("/svc/flags", b"v2-conflict".to_vec(), Some(0))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::BadVersion {
                    expected: 0,
                    actual: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(co.get("/svc/flags").await.unwrap(), (b"v2".to_vec(), 1));
        assert_eq!(
            tokio::time::timeout(T, w)
                .await
                .expect("config watch")
                .unwrap()
                .event,
            EventType::DataChanged
        );
        // Client-side checks: same typed errors, no RPC needed.
        let big = vec![0u8; wire::VALUE_BYTES_MAX + 1];
        assert!(matches!(
            ca.set("/svc/flags", big, Some(1)).await,
            Err(Error::ValueTooLarge { .. })
        ));
        assert!(matches!(
            ca.get("svc/flags").await,
            Err(Error::InvalidPath { .. })
        ));
        // b's session closed above: its leadership ended with it.
        assert!(!observer.check_sequencer(lb.sequencer()).await.unwrap());
        assert!(eo.leader().await.unwrap().is_none());
    });
}
