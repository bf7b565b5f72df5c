//! Issue 22, item 3: a recipe's create whose answer is lost, or whose future is dropped
//! while it is in flight, must leave nothing in the queue. Its node is an ephemeral of a
//! live session: left behind, it blocks every later contender (the same session's retry
//! included) until that session ends.
//!
//! One real replica; the recipe's session reaches it only through a UDP relay on loopback
//! that the test can make deaf (it drops the replica's datagrams and still forwards the
//! client's). So a create reaches the cell and commits while its answer is lost, every
//! time: the test watches the node appear through a second, direct client before it lets
//! the relay hear again or drops the attempt's future. (Killing the leader between the
//! commit and the reply would lose the same answer, but that window cannot be hit at
//! will.) The relay can also cut the link both ways, so a release's delete never arrives.
//! A lease of 20 s, far longer than any bound below, shows that nothing here waited for
//! a session to end.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::recipes::election::Election;
use client_sdk::recipes::membership::Group;
use client_sdk::{Client, CreateMode, Lock, NodeStat, Session, SessionState};
use common::{rt, serial, Opts, TestCell};

/// The session lease: nothing below may wait this long.
const LEASE_MS: u64 = 20_000;
/// How long the relayed client's calls retry before they give up (its `request_timeout`).
const RELAYED_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a contender may take to get a lock freed by a cleanup (far below the lease).
const BOUND: Duration = Duration::from_secs(6);
/// A generous limit for the test's own waits.
const T: Duration = Duration::from_secs(15);

/// A UDP relay in front of one replica. While deaf, it drops every datagram from the
/// replica (answers, acknowledgements, handshakes) and still forwards the client's; while
/// cut, it drops both ways. Each client address gets an upstream socket of its own. Ends
/// when dropped.
struct Relay {
    addr: SocketAddr,
    deaf: Arc<AtomicBool>,
    cut: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listen = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = listen.local_addr().unwrap();
        let deaf = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(relay(listen, target, deaf.clone(), cut.clone()));
        Relay {
            addr,
            deaf,
            cut,
            task,
        }
    }

    fn deafen(&self) {
        self.deaf.store(true, Ordering::SeqCst);
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    /// Passes everything again.
    fn hear(&self) {
        self.deaf.store(false, Ordering::SeqCst);
        self.cut.store(false, Ordering::SeqCst);
    }

    /// A client that reaches the cell only through this relay.
    async fn client(&self, cell: &TestCell) -> Client {
        let mut cfg = cell.client_config();
        cfg.endpoints = vec![self.addr.to_string()];
        cfg.request_timeout = RELAYED_REQUEST_TIMEOUT;
        cfg.attempt_timeout = Duration::from_secs(2);
        Client::connect(cfg).await.expect("client")
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    listen: Arc<tokio::net::UdpSocket>,
    target: SocketAddr,
    deaf: Arc<AtomicBool>,
    cut: Arc<AtomicBool>,
) {
    let mut upstream: std::collections::HashMap<SocketAddr, Arc<tokio::net::UdpSocket>> =
        std::collections::HashMap::new();
    // Aborted with this task (dropping the set aborts the return paths).
    let mut back_paths = tokio::task::JoinSet::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        let Ok((n, from)) = listen.recv_from(&mut buf).await else {
            return;
        };
        let up = match upstream.get(&from) {
            Some(up) => up.clone(),
            None => {
                let up = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
                up.connect(target).await.unwrap();
                let (up2, listen, deaf, cut) =
                    (up.clone(), listen.clone(), deaf.clone(), cut.clone());
                back_paths.spawn(async move {
                    let mut b = vec![0u8; 65_536];
                    while let Ok(n) = up2.recv(&mut b).await {
                        if !deaf.load(Ordering::SeqCst) && !cut.load(Ordering::SeqCst) {
                            let _ = listen.send_to(&b[..n], from).await;
                        }
                    }
                });
                upstream.insert(from, up.clone());
                up
            }
        };
        if !cut.load(Ordering::SeqCst) {
            let _ = up.send(&buf[..n]).await;
        }
    }
}

/// One replica, a direct client with a session `b`, and a relayed client with a session
/// `a`; `dirs` are created (persistent) first.
struct Setup {
    cell: TestCell,
    relay: Relay,
    _direct: Client,
    _relayed: Client,
    a: Session,
    b: Session,
}

async fn setup(dirs: &[&str]) -> Setup {
    let cell = TestCell::start(Opts {
        replicas: 1,
        lease_ms: LEASE_MS,
        ..Opts::default()
    });
    let direct = cell.client().await;
    cell.wait_leader(&direct, Duration::from_secs(20), None)
        .await;
    let b = direct.open_session().await.unwrap();
    for d in dirs {
        b.create(d, vec![], CreateMode::default()).await.unwrap();
    }
    let relay = Relay::start(cell.addr(1).parse().unwrap()).await;
    let relayed = relay.client(&cell).await;
    let a = relayed.open_session().await.unwrap();
    Setup {
        cell,
        relay,
        _direct: direct,
        _relayed: relayed,
        a,
        b,
    }
}

/// The children of `dir` owned by `session`, read by `observer`.
async fn owned_by(observer: &Session, dir: &str, session: &Session) -> Vec<(String, NodeStat)> {
    observer
        .children(dir)
        .await
        .unwrap()
        .into_iter()
        .filter(|(_, st)| st.ephemeral_owner == Some(session.id()))
        .collect()
}

/// Waits until `observer` sees a child of `dir` owned by `session` and named `name`
/// (any name when `None`): the create committed. Returns its name.
async fn wait_created(
    observer: &Session,
    dir: &str,
    session: &Session,
    name: Option<&str>,
) -> String {
    let deadline = Instant::now() + T;
    loop {
        let kids = owned_by(observer, dir, session).await;
        if let Some((n, _)) = kids.iter().find(|(n, _)| name.is_none_or(|w| w == n)) {
            return n.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the create under {dir} never committed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `task` has finished or an ordinary call of the relayed client would have
/// given up on its answer (its request timeout and a second more since `started`).
async fn past_the_request_timeout<T>(task: &tokio::task::JoinHandle<T>, started: Instant) {
    let until = started + RELAYED_REQUEST_TIMEOUT + Duration::from_secs(1);
    while !task.is_finished() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `try_acquire` whose create committed but whose answer never came back gives up; then
/// the same session's retry gets the lock (its first node is not in the way) and so does
/// another session after it, each within a few seconds of a 20 s lease.
#[test]
fn a_lock_create_whose_answer_is_lost_leaves_nothing_in_the_queue() {
    let _g = serial();
    rt().block_on(async {
        let Setup {
            cell: _cell,
            relay,
            a,
            b,
            ..
        } = setup(&["/locks", "/locks/x"]).await;
        relay.deafen();
        let started = Instant::now();
        let attempt = tokio::spawn({
            let a = a.clone();
            async move {
                Lock::exclusive(&a, "/locks/x")
                    .try_acquire()
                    .await
                    .map(|g| g.map(|g| g.token()))
            }
        });
        let first = wait_created(&b, "/locks/x", &a, None).await;
        let r = tokio::time::timeout(T, attempt)
            .await
            .expect("the attempt gives up")
            .unwrap();
        println!(
            "the attempt whose answer was lost returned {r:?} after {} ms (its node {first})",
            started.elapsed().as_millis()
        );
        assert!(!matches!(r, Ok(Some(_))), "granted without an answer");
        relay.hear();

        // The same session tries again: its first node must not block it.
        let t = Instant::now();
        let ga = Lock::exclusive(&a, "/locks/x")
            .acquire_timeout(BOUND)
            .await
            .unwrap();
        let Some(ga) = ga else {
            panic!(
                "the retry of session {} queued behind its own first node for {BOUND:?}: {:?}",
                a.id(),
                b.children("/locks/x").await.unwrap()
            );
        };
        println!(
            "the same session's retry got the lock in {} ms",
            t.elapsed().as_millis()
        );
        ga.release().await.unwrap();

        // Another session gets it, without waiting for the first session to end.
        let t = Instant::now();
        let gb = Lock::exclusive(&b, "/locks/x")
            .acquire_timeout(BOUND)
            .await
            .unwrap();
        let Some(gb) = gb else {
            panic!(
                "another session waited {BOUND:?} behind session {}'s node: {:?}",
                a.id(),
                b.children("/locks/x").await.unwrap()
            );
        };
        println!(
            "another session got the lock in {} ms",
            t.elapsed().as_millis()
        );
        assert_eq!(
            a.state(),
            SessionState::Healthy,
            "the first session lives on"
        );
        assert!(owned_by(&b, "/locks/x", &a).await.is_empty());
        gb.release().await.unwrap();
    });
}

/// A blocking `acquire` whose create's answer is lost for longer than a call's request
/// timeout keeps asking with the same request id: once the cell answers it holds the lock
/// on the one node it created (no error, no second node).
#[test]
fn a_blocking_acquire_whose_answer_is_lost_holds_its_one_node() {
    let _g = serial();
    rt().block_on(async {
        let Setup {
            cell: _cell,
            relay,
            a,
            b,
            ..
        } = setup(&["/locks", "/locks/y"]).await;
        relay.deafen();
        let started = Instant::now();
        let attempt = tokio::spawn({
            let a = a.clone();
            async move { Lock::exclusive(&a, "/locks/y").acquire().await }
        });
        let node = wait_created(&b, "/locks/y", &a, None).await;
        past_the_request_timeout(&attempt, started).await;
        relay.hear();
        let r = tokio::time::timeout(T, attempt)
            .await
            .expect("the acquire ends once the cell answers")
            .unwrap();
        println!(
            "the acquire whose answer was lost returned after {} ms: {r:?}",
            started.elapsed().as_millis()
        );
        let g = r.expect("granted once the cell answered");
        assert_eq!(g.sequencer().node, format!("/locks/y/{node}"));
        let mine = owned_by(&b, "/locks/y", &a).await;
        assert_eq!(mine.len(), 1, "one node: {mine:?}");
        assert!(b.check_sequencer(g.sequencer()).await.unwrap());
        g.release().await.unwrap();
    });
}

/// An acquire whose future is dropped while its create is in flight (committed, answer
/// not back yet) leaves no node: another session gets the lock at once.
#[test]
fn a_lock_attempt_cancelled_during_its_create_leaves_nothing_in_the_queue() {
    let _g = serial();
    rt().block_on(a_cancelled_attempt_does_not_block(
        "/locks/x",
        Lock::exclusive,
        Lock::exclusive,
        "exclusive: another session",
    ));
}

/// The writer of a shared lock dropped while its create is in flight leaves no node: a
/// reader after it (which waits only for earlier writers) gets the lock at once.
#[test]
fn a_writer_cancelled_during_its_create_does_not_block_readers() {
    let _g = serial();
    rt().block_on(a_cancelled_attempt_does_not_block(
        "/locks/rw",
        Lock::write,
        Lock::read,
        "shared: a reader",
    ));
}

/// Session a's `first` attempt on the lock at `dir` is dropped once its create has
/// committed (its answer held back); `who`, session b's `second`, must then get the lock
/// within [`BOUND`], while a lives on.
async fn a_cancelled_attempt_does_not_block(
    dir: &'static str,
    first: fn(&Session, &str) -> Lock,
    second: fn(&Session, &str) -> Lock,
    who: &str,
) {
    let Setup {
        cell: _cell,
        relay,
        a,
        b,
        ..
    } = setup(&["/locks", dir]).await;
    relay.deafen();
    let attempt = tokio::spawn({
        let a = a.clone();
        async move { first(&a, dir).acquire().await }
    });
    let node = wait_created(&b, dir, &a, None).await;
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());
    relay.hear();
    let t = Instant::now();
    let Some(g) = second(&b, dir).acquire_timeout(BOUND).await.unwrap() else {
        panic!(
            "{who} waited {BOUND:?} behind the cancelled attempt's node {node}: {:?}",
            b.children(dir).await.unwrap()
        );
    };
    println!(
        "{who} got the lock {} ms after the cancelled attempt",
        t.elapsed().as_millis()
    );
    assert_eq!(
        a.state(),
        SessionState::Healthy,
        "the first session lives on"
    );
    g.release().await.unwrap();
}

/// A campaign dropped while its create is in flight leaves no candidate in the queue:
/// another candidate leads at once instead of waiting for the first session to end.
#[test]
fn a_campaign_cancelled_during_its_create_leaves_no_candidate() {
    let _g = serial();
    rt().block_on(async {
        let Setup {
            cell: _cell,
            relay,
            a,
            b,
            ..
        } = setup(&["/svc", "/svc/leader"]).await;
        relay.deafen();
        let attempt = tokio::spawn({
            let a = a.clone();
            async move {
                Election::new(&a, "/svc/leader")
                    .campaign(b"a:1".to_vec())
                    .await
            }
        });
        let node = wait_created(&b, "/svc/leader", &a, None).await;
        attempt.abort();
        assert!(attempt.await.unwrap_err().is_cancelled());
        relay.hear();
        let t = Instant::now();
        let eb = Election::new(&b, "/svc/leader");
        let lb = tokio::time::timeout(BOUND, eb.campaign(b"b:1".to_vec()))
            .await
            .unwrap_or_else(|_| {
                panic!("b did not lead within {BOUND:?}: the cancelled candidate {node} was in the way")
            })
            .unwrap();
        println!(
            "another candidate led {} ms after the cancelled campaign",
            t.elapsed().as_millis()
        );
        let leader = eb.leader().await.unwrap().expect("a leader");
        assert_eq!(leader.address, b"b:1");
        assert_eq!(leader.token, lb.token());
        assert_eq!(a.state(), SessionState::Healthy, "the first session lives on");
        lb.resign().await.unwrap();
    });
}

/// A join whose answer is lost for longer than a call's request timeout keeps asking with
/// the same request id and succeeds once the cell answers, with one member (it used to
/// fail with the timeout, its member listed all the same, and a retried join failed with
/// `NodeExists` on its own node).
#[test]
fn a_join_whose_answer_is_lost_joins_once() {
    let _g = serial();
    rt().block_on(async {
        let Setup {
            cell: _cell,
            relay,
            a,
            b,
            ..
        } = setup(&["/svc", "/svc/members"]).await;
        relay.deafen();
        let started = Instant::now();
        let join = tokio::spawn({
            let a = a.clone();
            async move {
                Group::new(&a, "/svc/members")
                    .join("w1", b"a:1".to_vec())
                    .await
            }
        });
        wait_created(&b, "/svc/members", &a, Some("w1")).await;
        past_the_request_timeout(&join, started).await;
        relay.hear();
        let r = tokio::time::timeout(T, join)
            .await
            .expect("the join ends once the cell answers")
            .unwrap();
        println!(
            "the join whose answer was lost returned after {} ms: {r:?}",
            started.elapsed().as_millis()
        );
        r.expect("joined once the cell answered");
        let members = Group::new(&b, "/svc/members").members().await.unwrap();
        assert_eq!(members.len(), 1, "{members:?}");
        assert_eq!(members[0].name, "w1");
        assert_eq!(members[0].stat.ephemeral_owner, Some(a.id()));
        assert_eq!(
            Group::new(&b, "/svc/members")
                .member_data("w1")
                .await
                .unwrap(),
            b"a:1"
        );
    });
}

/// A join whose future is dropped while its create is in flight (committed, answer not
/// back) leaves no member behind, and only that member goes: the session's other member
/// stays, and the same name can be joined again.
#[test]
fn a_join_cancelled_during_its_create_leaves_no_member() {
    let _g = serial();
    rt().block_on(async {
        let Setup {
            cell: _cell,
            relay,
            a,
            b,
            ..
        } = setup(&["/svc", "/svc/members"]).await;
        let group = Group::new(&a, "/svc/members");
        group.join("w1", b"a:1".to_vec()).await.unwrap();
        let names = || async {
            Group::new(&b, "/svc/members")
                .members()
                .await
                .unwrap()
                .into_iter()
                .map(|m| m.name)
                .collect::<Vec<String>>()
        };

        relay.deafen();
        let join = tokio::spawn({
            let group = group.clone();
            async move { group.join("w2", b"a:2".to_vec()).await }
        });
        wait_created(&b, "/svc/members", &a, Some("w2")).await;
        join.abort();
        assert!(join.await.unwrap_err().is_cancelled());
        relay.hear();
        let t = Instant::now();
        let deadline = t + BOUND;
        loop {
            let now = names().await;
            if now == ["w1"] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cancelled join's member was still listed after {BOUND:?}: {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "the cancelled join's member was gone {} ms after the cell answered again",
            t.elapsed().as_millis()
        );
        group.join("w2", b"a:3".to_vec()).await.unwrap();
        assert_eq!(names().await, ["w1", "w2"]);
        assert_eq!(a.state(), SessionState::Healthy, "the session lives on");
    });
}

/// A release whose delete goes unanswered for the request timeout (the link cut both
/// ways, so the delete never reaches the cell) reports the error and keeps deleting in the
/// background: once the link is back, another session gets the lock at once instead of
/// waiting for the holder's session to end.
#[test]
fn a_release_that_times_out_still_frees_the_lock() {
    let _g = serial();
    rt().block_on(async {
        let Setup {
            cell: _cell,
            relay,
            a,
            b,
            ..
        } = setup(&["/locks", "/locks/z"]).await;
        let g = Lock::exclusive(&a, "/locks/z").acquire().await.unwrap();
        let node = g.sequencer().node.clone();
        relay.cut();
        let started = Instant::now();
        let r = tokio::time::timeout(T, g.release())
            .await
            .expect("the release gives up");
        println!(
            "the release over a cut link returned after {} ms: {r:?}",
            started.elapsed().as_millis()
        );
        assert!(r.is_err(), "nothing reached the cell");
        assert!(b.exists(&node).await.unwrap().is_some(), "still held");
        relay.hear();
        let t = Instant::now();
        let Some(gb) = Lock::exclusive(&b, "/locks/z")
            .acquire_timeout(BOUND)
            .await
            .unwrap()
        else {
            panic!(
                "another session waited {BOUND:?} behind the released node {node}: {:?}",
                b.children("/locks/z").await.unwrap()
            );
        };
        println!(
            "another session got the lock {} ms after the link came back",
            t.elapsed().as_millis()
        );
        assert_eq!(
            a.state(),
            SessionState::Healthy,
            "the holder's session lives on"
        );
        gb.release().await.unwrap();
    });
}
