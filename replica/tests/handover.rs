//! Leadership handed over on purpose (issue 27, item 5): SIGTERM on the leader, the
//! `TransferLeader` request, and a rolling restart of a cell of five. Each asserts what
//! clients must not see (a failed request, a session event, a lost write, replicas that
//! disagree) and that the leadership moved by a hand-over, not by an election after a
//! silence (the longest gap between two writes stays well under the cell's shortest
//! election timeout).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use client_sdk::{CreateMode, Error, SessionState};
use common::*;
use wire::types::{Op, Reply};

/// Writes `/w` in a loop until told to stop; returns the successes' times and every
/// error. Each write is one request; the SDK retries an attempt a replica refused as
/// it would for any application, and only what the application sees counts.
/// The writer's outcome: when each write succeeded, and every error.
type Written = tokio::task::JoinHandle<(Vec<Instant>, Vec<Error>)>;

fn writer(s: client_sdk::Session) -> (Arc<std::sync::atomic::AtomicBool>, Written) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = stop.clone();
    let task = tokio::spawn(async move {
        let (mut done, mut failed) = (Vec::new(), Vec::new());
        // Bounded: about 1 ms a write, and every test stops it within a minute or two.
        for i in 0..1_000_000u64 {
            if stopping.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            match s.set_data("/w", i.to_be_bytes().to_vec(), None).await {
                Ok(_) => done.push(Instant::now()),
                Err(e) => failed.push(e),
            }
        }
        (done, failed)
    });
    (stop, task)
}

/// The longest time between two successful writes.
fn longest_gap(done: &[Instant]) -> Duration {
    done.windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default()
}

/// The session had no event but `FailOver` (the leader changed): no jeopardy, no
/// expiry, and it is healthy.
fn assert_calm(
    name: &str,
    events: &mut tokio::sync::broadcast::Receiver<client_sdk::SessionEvent>,
    s: &client_sdk::Session,
) {
    // Bounded by the channel's capacity.
    loop {
        match events.try_recv() {
            Ok(client_sdk::SessionEvent::FailOver) => {}
            Ok(e) => panic!("the {name} session had an event: {e:?}"),
            Err(tokio::sync::broadcast::error::TryRecvError::Empty) => break,
            Err(e) => panic!("the {name} session's events: {e:?}"),
        }
    }
    assert_eq!(s.state(), SessionState::Healthy, "{name}");
}

/// The old leader's log says it handed the leadership over (not that it was lost).
fn assert_handed_over(cell: &TestCell, id: u64) {
    let log = cell.log_of(id);
    assert!(
        log.contains("leadership handed over"),
        "replica {id} did not hand its leadership over; logs in {}",
        cell.dir.path().display()
    );
}

/// SIGTERM on the leader of a cell of three under a stream of writes: the leader hands
/// over to a follower and exits; no write fails, no session has an event, and the
/// writes pause far less than an election would take.
#[test]
fn sigterm_on_the_leader_hands_the_leadership_over() {
    let _g = serial();
    rt().block_on(async {
        let (mut cell, client, leader) = TestCell::settled(3).await;
        let s = client.open_session().await.unwrap();
        let idle = client.open_session().await.unwrap();
        let (mut events, mut idle_events) = (s.events(), idle.events());
        s.create("/w", vec![], CreateMode::default()).await.unwrap();
        let (stop, task) = writer(s.clone());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let term = cell.statuses(&client).await[&leader].term;
        let took = cell.stop(leader, Duration::from_secs(10)).await;
        let now = cell
            .wait_leader(&client, Duration::from_secs(20), Some(leader))
            .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (done, failed) = task.await.unwrap();
        let gap = longest_gap(&done);
        println!(
            "FIGURE hand-over on SIGTERM: leader {leader} exited {} ms after the signal, {now} leads; {} writes, longest gap {} ms",
            took.as_millis(),
            done.len(),
            gap.as_millis()
        );
        assert!(failed.is_empty(), "writes failed: {failed:?}");
        assert_handed_over(&cell, leader);
        assert_eq!(
            cell.statuses(&client).await[&now].term,
            term + 1,
            "more than one election"
        );
        // An election after a silence takes 1.5 s or more with these timers.
        assert!(gap < Duration::from_millis(1_400), "writes paused {gap:?}");
        assert_calm("writing", &mut events, &s);
        assert_calm("idle", &mut idle_events, &idle);
        cell.spawn(leader);
        s.create("/after", vec![], CreateMode::default()).await.unwrap();
        cell.assert_same_state(&client, Duration::from_secs(30)).await;
    });
}

/// `Op::TransferLeader` (what `lockctl member transfer-leader` sends): to a named voter,
/// to the best follower when none is named, and refused with a typed error for this
/// replica itself or a replica that is not a voter, changing nothing.
#[test]
fn transfer_leader_on_demand() {
    let _g = serial();
    rt().block_on(async {
        let (cell, client, leader) = TestCell::settled(3).await;
        let target = (1..=3).find(|id| *id != leader).expect("a follower");
        let term = cell.statuses(&client).await[&leader].term;
        match client
            .request(Op::TransferLeader { to: Some(target) })
            .await
        {
            Ok(Reply::LeaderTransferred { from, to, took_ms }) => {
                println!("FIGURE transfer-leader: {from} -> {to} in {took_ms} ms");
                assert_eq!((from, to), (leader, target));
            }
            other => panic!("transfer to {target}: {other:?}"),
        }
        assert_eq!(
            cell.wait_settled_leader(&client, Duration::from_secs(30))
                .await,
            target
        );
        let st = cell.statuses(&client).await;
        assert_eq!(st[&target].term, term + 1, "more than one election: {st:?}");

        // Naming the leader is done at once (a retried request changes nothing); a
        // replica that is not a voter is refused, naming the problem.
        match client
            .request(Op::TransferLeader { to: Some(target) })
            .await
        {
            Ok(Reply::LeaderTransferred { from, to, took_ms }) => {
                assert_eq!((from, to, took_ms), (target, target, 0))
            }
            other => panic!("transfer to the leader: {other:?}"),
        }
        match client.request(Op::TransferLeader { to: Some(99) }).await {
            Err(Error::Membership { reason }) => {
                assert!(reason.contains("not a voter"), "{reason}")
            }
            other => panic!("transfer to 99: {other:?}"),
        }
        assert_eq!(cell.statuses(&client).await[&target].term, term + 1);

        match client.request(Op::TransferLeader { to: None }).await {
            Ok(Reply::LeaderTransferred { from, to, .. }) => {
                assert_eq!(from, target);
                assert_ne!(to, target);
            }
            other => panic!("transfer to the best follower: {other:?}"),
        }
    });
}

/// Issue 27, item 5: a rolling restart of a cell of five (each replica in turn stopped
/// with SIGTERM, started again, and caught up before the next) under a stream of writes
/// and beside an idle session: no failed request, no session event, no lost write, the
/// same state everywhere, and no pause as long as an election.
#[test]
fn a_rolling_restart_of_five_costs_clients_nothing() {
    let _g = serial();
    rt().block_on(async {
        let mut cell = TestCell::start(Opts::default());
        let client = cell.client().await;
        cell.wait_settled_leader(&client, Duration::from_secs(30))
            .await;
        let s = client.open_session().await.unwrap();
        let idle = client.open_session().await.unwrap();
        let (mut events, mut idle_events) = (s.events(), idle.events());
        s.create("/w", vec![], CreateMode::default()).await.unwrap();
        let (stop, task) = writer(s.clone());
        let mut handed = Vec::new();
        for id in 1..=5 {
            let leader = cell
                .wait_settled_leader(&client, Duration::from_secs(30))
                .await;
            cell.stop(id, Duration::from_secs(10)).await;
            if id == leader {
                handed.push(id);
            }
            cell.spawn(id);
            // Caught up and following before the next one goes.
            cell.wait_settled_leader(&client, Duration::from_secs(30))
                .await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (done, failed) = task.await.unwrap();
        let gap = longest_gap(&done);
        println!(
            "FIGURE rolling restart of five: {} writes, longest gap {} ms, leaders handed over: {handed:?}",
            done.len(),
            gap.as_millis()
        );
        assert!(failed.is_empty(), "writes failed: {failed:?}");
        assert!(!handed.is_empty(), "no leader was restarted");
        for id in &handed {
            assert_handed_over(&cell, *id);
        }
        assert!(gap < Duration::from_millis(1_400), "writes paused {gap:?}");
        assert_calm("writing", &mut events, &s);
        assert_calm("idle", &mut idle_events, &idle);
        let (data, _) = client.get("/w").await.unwrap();
        assert_eq!(data, ((done.len() - 1) as u64).to_be_bytes().to_vec());
        cell.assert_same_state(&client, Duration::from_secs(30)).await;
    });
}

/// A request a replica cannot serve while it knows no leader (an election is under way)
/// is held until it knows one, at most 300 ms (`Gateway::leader_coming`), instead of
/// being answered `NotLeader` without a hint at once and sending the client into its
/// election poll. Here the election never ends (the other two replicas are down): the
/// answer comes after the hold, still `NotLeader` without a leader.
#[test]
fn a_request_to_a_replica_that_knows_no_leader_waits_for_one() {
    let _g = serial();
    rt().block_on(async {
        let (mut cell, client, leader) = TestCell::settled(3).await;
        let survivor = (1..=3).find(|id| *id != leader).expect("a follower");
        let addr: std::net::SocketAddr = cell.addr(survivor).parse().unwrap();
        client.status_of(addr).await.unwrap();
        for id in (1..=3).filter(|id| *id != survivor) {
            cell.kill(id);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = client.status_of(addr).await.unwrap();
            if st.leader.is_none() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replica {survivor} still follows: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let req = wire::types::Request {
            session: 0,
            request_id: 0,
            ack_below: 0,
            op: Op::CreateSession,
        };
        let sent = Instant::now();
        let r = client.call_at(addr, &req).await;
        let took = sent.elapsed();
        println!(
            "FIGURE leaderless replica: answered after {} ms: {r:?}",
            took.as_millis()
        );
        assert!(
            matches!(
                r,
                Err(Error::NotLeader {
                    leader_id: None,
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(
            took >= Duration::from_millis(250),
            "answered after {took:?}: not held for the election"
        );
        assert!(took < Duration::from_secs(3), "held {took:?}");
    });
}

/// A follower that is down (it has not answered the leader for over a second) is not
/// handed the leadership: named, the request is refused and changes nothing; a leader
/// stopped meanwhile hands over to a follower that is up.
#[test]
fn the_leadership_is_not_handed_to_a_follower_that_is_down() {
    let _g = serial();
    rt().block_on(async {
        let (mut cell, client, leader) = TestCell::settled(5).await;
        let down = (1..=5).find(|id| *id != leader).expect("a follower");
        cell.kill(down);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let term = cell.statuses(&client).await[&leader].term;
        // Named, it is refused (and the leadership stays where it is).
        match client.request(Op::TransferLeader { to: Some(down) }).await {
            Err(Error::Membership { reason }) => {
                assert!(reason.contains("has not answered"), "{reason}")
            }
            other => panic!("transfer to {down}, which is down: {other:?}"),
        }
        let st = cell.statuses(&client).await;
        assert_eq!(
            (st[&leader].role.as_str(), st[&leader].term),
            ("Leader", term)
        );
        cell.stop(leader, Duration::from_secs(10)).await;
        let now = cell
            .wait_leader(&client, Duration::from_secs(20), Some(leader))
            .await;
        assert_ne!(now, down);
        assert_handed_over(&cell, leader);
    });
}
