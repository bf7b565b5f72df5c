use super::*;

/// The client identity the tests read as.
const ID: &str = "lock://client/t";

impl Hub {
    /// Panics unless the indexes of the pending invalidations match them.
    fn assert_indexed(&self) {
        let t = lock(&self.t);
        let mut waiting_on: HashMap<SessionId, HashSet<u64>> = HashMap::default();
        let mut by_upstream = HashMap::default();
        for (id, p) in &t.pending {
            assert!(!p.waiting.is_empty(), "pending {id} waits for nobody");
            for s in p.waiting.keys() {
                waiting_on.entry(*s).or_default().insert(*id);
            }
            if let Some(u) = p.upstream {
                assert!(by_upstream.insert(u, *id).is_none(), "{u:?} relayed twice");
            }
        }
        assert_eq!(t.waiting_on, waiting_on);
        assert_eq!(t.by_upstream, by_upstream);
    }
}

#[derive(Debug, Clone)]
enum Step {
    Read(SessionId, u8),
    Invalidate(u64, u8),
    Ack(SessionId, u64),
    AckOwed(SessionId),
    Reset,
    End(SessionId),
    Renew(SessionId),
    Attach(SessionId),
    TickAll,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let c = 1..6u64;
    prop_oneof![
        4 => (c.clone(), 0..3u8).prop_map(|(s, p)| Step::Read(s, p)),
        3 => (1..6u64, 0..3u8).prop_map(|(i, p)| Step::Invalidate(i, p)),
        1 => (c.clone(), 1..12u64).prop_map(|(s, i)| Step::Ack(s, i)),
        3 => c.clone().prop_map(Step::AckOwed),
        1 => Just(Step::Reset),
        1 => c.clone().prop_map(Step::End),
        1 => c.clone().prop_map(Step::Renew),
        1 => c.prop_map(Step::Attach),
        1 => Just(Step::TickAll),
    ]
}

proptest::proptest! {
    /// Whatever clients read, acknowledge, end or let lapse, and whatever the leader
    /// invalidates (repeats included) and however often the proxy resets, the
    /// per-client index of pending invalidations stays exact, and what it answers for
    /// KeepAlive replies and reattached streams is what a walk of them all finds.
    #[test]
    fn pending_index_matches_a_full_walk(steps in proptest::collection::vec(step(), 1..60)) {
        let hub = ready_hub(&[1, 2, 3, 4, 5]);
        for st in steps {
            match st {
                Step::Read(c, p) => {
                    let path = format!("/k{p}");
                    if let Err(snap) = hub.cache_lookup(c, ID, &path) {
                        hub.cache_fill(c, ID, &path, snap, Some((b"v".to_vec(), stat())), 7, true);
                    }
                }
                Step::Invalidate(i, p) => {
                    hub.invalidate(99, i, vec![format!("/k{p}")]);
                }
                Step::Ack(c, i) => {
                    hub.ack(c, &[i]);
                }
                Step::AckOwed(c) => {
                    let ids: Vec<u64> = hub
                        .unacknowledged(c, Duration::ZERO, 64)
                        .into_iter()
                        .map(|(id, _)| id)
                        .collect();
                    hub.ack(c, &ids);
                }
                Step::Reset => {
                    hub.reset();
                    hub.set_ready(true);
                }
                Step::End(c) => {
                    hub.session_ended(c);
                }
                Step::Renew(c) => hub.renewed(c, Instant::now(), hub.lease()),
                Step::Attach(c) => {
                    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
                    hub.attach_stream(c, tx);
                }
                Step::TickAll => {
                    hub.tick(Instant::now() + Duration::from_secs(3_600));
                }
            }
            hub.assert_indexed();
            let all: Vec<SessionId> = (1..=6).collect();
            let many = hub.unacknowledged_many(&all, Duration::ZERO, 64);
            let t = lock(&hub.t);
            for s in &all {
                let mut walk: Vec<(Instant, u64, Vec<String>)> = t
                    .pending
                    .iter()
                    .filter_map(|(id, p)| p.waiting.get(s).map(|x| (p.since, *id, x.clone())))
                    .collect();
                walk.sort();
                let walk: Vec<(u64, Vec<String>)> =
                    walk.into_iter().map(|(_, id, x)| (id, x)).collect();
                proptest::prop_assert_eq!(many.get(s).cloned().unwrap_or_default(), walk);
            }
        }
    }
}

fn ev(path: &str, kind: WatchKind, index: u64) -> WatchEvent {
    WatchEvent {
        path: path.into(),
        kind,
        event: wire::types::EventType::DataChanged,
        index,
    }
}

#[test]
fn events_fire_only_watches_armed_below_them() {
    let hub = ready_hub(&[]);
    let snap = hub.watch_snapshot();
    let key = ("/a".to_string(), WatchKind::Data);
    assert!(hub.add_watch(1, key.clone(), 10, snap).is_none());
    assert!(hub.add_watch(2, key.clone(), 20, snap).is_none());
    let (tx1, mut rx1) = tokio::sync::mpsc::unbounded_channel();
    let (tx2, mut rx2) = tokio::sync::mpsc::unbounded_channel();
    hub.attach_stream(1, tx1);
    hub.attach_stream(2, tx2);
    // An event at 15 fires client 1's watch only; client 2's must be re-armed at 20.
    let rearm = hub.fire(&ev("/a", WatchKind::Data, 15)).unwrap();
    assert_eq!(rearm.since_index, 20);
    assert!(matches!(rx1.try_recv(), Ok(Ok(Reply::Event(_)))));
    assert!(rx2.try_recv().is_err());
    assert!(hub.fire(&ev("/a", WatchKind::Data, 21)).is_none());
    assert!(matches!(rx2.try_recv(), Ok(Ok(Reply::Event(_)))));
    assert_eq!(hub.upstream_watch_count(), 0);
}

#[test]
fn a_watch_registered_after_an_event_on_its_key_is_rearmed() {
    let hub = ready_hub(&[]);
    let key = ("/a".to_string(), WatchKind::Data);
    let snap = hub.watch_snapshot();
    hub.fire(&ev("/b", WatchKind::Data, 3));
    assert!(
        hub.add_watch(1, key.clone(), 2, snap).is_none(),
        "other key"
    );
    let snap = hub.watch_snapshot();
    hub.fire(&ev("/a", WatchKind::Data, 5));
    let spec = hub.add_watch(2, key, 4, snap).expect("re-arm");
    assert_eq!(spec.since_index, 4);
}

fn ready_hub(clients: &[SessionId]) -> Hub {
    let hub = Hub::new();
    hub.set_ready(true);
    hub.set_own_session(Some(Instant::now()));
    for c in clients {
        hub.renewed(*c, Instant::now(), hub.lease());
    }
    hub
}

#[test]
fn a_reconnection_after_a_flush_ahead_waits_for_it_instead_of_flushing_again() {
    let hub = ready_hub(&[1, 2]);
    for s in [1, 2] {
        let snap = hub.cache_lookup(s, ID, &format!("/n{s}")).unwrap_err();
        hub.cache_fill(
            s,
            ID,
            &format!("/n{s}"),
            snap,
            Some((b"v".to_vec(), stat())),
            7,
            true,
        );
    }
    // The leader went silent: flushed ahead, the stream still open.
    let ahead = hub.reset();
    assert_eq!(ahead.len(), 2);
    // A read that comes back meanwhile is not cached (nothing is until ready).
    let snap = hub.cache_lookup(1, ID, "/n1").unwrap_err();
    let r = hub.cache_fill(1, ID, "/n1", snap, Some((b"v".to_vec(), stat())), 8, true);
    assert!(matches!(
        r,
        Reply::CachedData {
            cachable: false,
            ..
        }
    ));
    // The stream broke: the reconnection waits for the same invalidations.
    hub.set_ready(false);
    assert_eq!(hub.reset_unless_flushed(), (ahead.clone(), true));
    assert!(!hub.all_done(&ahead));
    hub.ack(1, &ahead);
    assert!(!hub.all_done(&ahead), "client 2 has not flushed yet");
    hub.ack(2, &ahead);
    assert!(hub.all_done(&ahead));
    // Once ready again, the next reconnection flushes what was cached since.
    hub.set_ready(true);
    let snap = hub.cache_lookup(2, ID, "/n2").unwrap_err();
    hub.cache_fill(2, ID, "/n2", snap, Some((b"v".to_vec(), stat())), 9, true);
    hub.set_ready(false);
    let (again, reused) = hub.reset_unless_flushed();
    assert!(!reused);
    assert_eq!(again.len(), 1, "client 2 holds /n2 again");
    assert!(!again.iter().any(|id| ahead.contains(id)));
}

#[test]
fn a_reconnection_waits_for_a_client_still_owing_an_earlier_flush() {
    let hub = ready_hub(&[1, 2]);
    let snap = hub.cache_lookup(1, ID, "/x").unwrap_err();
    hub.cache_fill(1, ID, "/x", snap, Some((b"v".to_vec(), stat())), 7, true);
    // Flushed ahead; the leader answered again before client 1 acknowledged.
    let ahead = hub.reset();
    hub.set_ready(true);
    // Client 2 caches something meanwhile; then the leader really dies.
    let snap = hub.cache_lookup(2, ID, "/y").unwrap_err();
    hub.cache_fill(2, ID, "/y", snap, Some((b"v".to_vec(), stat())), 8, true);
    hub.set_ready(false);
    let (ids, reused) = hub.reset_unless_flushed();
    assert!(!reused);
    hub.ack(2, &ids);
    // The new reset is done, but client 1 may still serve /x: not yet.
    assert!(hub.all_done(&ids));
    assert!(!hub.nothing_owed());
    hub.ack(1, &ahead);
    assert!(hub.nothing_owed());
}

#[test]
fn caching_resumed_after_a_flush_ahead_still_waits_for_clients_that_did_not_flush() {
    let hub = ready_hub(&[1]);
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    hub.cache_fill(1, ID, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
    let ahead = hub.reset();
    // The leader answered again before client 1 dropped /c: caching resumes.
    hub.set_ready(true);
    // A write to /c must not be acknowledged while client 1 may still serve it.
    assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
    assert!(
        hub.ack(1, &ahead).is_empty(),
        "the write's invalidation is separate"
    );
    let owed = hub.unacknowledged(1, Duration::ZERO, 64);
    assert_eq!(owed.len(), 1);
    assert_eq!(owed[0].1, vec!["/c".to_string()]);
    assert_eq!(hub.ack(1, &[owed[0].0]), vec![(99, 5)]);
}

#[test]
fn an_invalidation_sent_again_is_not_acknowledged_before_its_holders() {
    let hub = ready_hub(&[1]);
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    hub.cache_fill(1, ID, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
    assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
    // The leader repeats it (KeepAlive reply, stream resend): its holder was taken the
    // first time, so treating it as new would acknowledge it at once.
    assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
    // Overdue for client 1 only once it is old enough, and only for client 1.
    assert!(hub
        .unacknowledged(1, Duration::from_secs(60), 64)
        .is_empty());
    let u = hub.unacknowledged(1, Duration::ZERO, 64);
    assert_eq!(u.len(), 1);
    assert_eq!(u[0].1, vec!["/c".to_string()]);
    assert!(hub.unacknowledged(2, Duration::ZERO, 64).is_empty());
    assert_eq!(hub.ack(1, &[u[0].0]), vec![(99, 5)]);
    // Done with it: a later repeat (our acknowledgement was lost) is acknowledged again.
    assert_eq!(hub.invalidate(99, 5, vec!["/c".into()]), Some((99, 5)));
    assert_eq!(hub.pending_invalidations().0, 0);
}

#[test]
fn overdue_invalidations_of_many_sessions_match_one_at_a_time() {
    // Clients 1..=5 cache /pop; 1 and 2 also cache /a; 6 caches nothing.
    let hub = ready_hub(&[1, 2, 3, 4, 5, 6]);
    let read = |s: SessionId, p: &str| {
        // The first reader fills the proxy's cache; later ones hit it (and hold it too).
        if let Err(snap) = hub.cache_lookup(s, ID, p) {
            hub.cache_fill(s, ID, p, snap, Some((b"v".to_vec(), stat())), 7, true);
        }
    };
    for s in 1..=5 {
        read(s, "/pop");
    }
    for s in [1, 2] {
        read(s, "/a");
    }
    assert!(hub.invalidate(99, 5, vec!["/pop".into()]).is_none());
    assert!(hub.invalidate(99, 6, vec!["/a".into()]).is_none());
    // Fewer sessions asked than waiting (walks the batch) and more (walks the waiters).
    for asked in [vec![2, 6], vec![1, 2, 3, 4, 5, 6, 7, 8]] {
        let many = hub.unacknowledged_many(&asked, Duration::ZERO, 64);
        for s in &asked {
            let one = hub.unacknowledged(*s, Duration::ZERO, 64);
            assert_eq!(many.get(s).cloned().unwrap_or_default(), one, "session {s}");
        }
        assert!(!many.contains_key(&6) && !many.contains_key(&7));
    }
    let two = hub.unacknowledged(2, Duration::ZERO, 64);
    assert_eq!(two.len(), 2, "oldest first: /pop then /a");
    assert_eq!(two[0].1, vec!["/pop".to_string()]);
    assert_eq!(two[1].1, vec!["/a".to_string()]);
    assert_eq!(hub.unacknowledged(2, Duration::ZERO, 1), two[..1].to_vec());
    let three = hub.unacknowledged(3, Duration::ZERO, 64);
    assert_eq!(three, vec![(two[0].0, vec!["/pop".to_string()])]);
    assert!(hub
        .unacknowledged_many(&[1, 2], Duration::from_secs(60), 64)
        .is_empty());
}

#[test]
fn a_second_invalidation_waits_for_clients_owing_the_first() {
    // Client 1 caches /c and is cut off: it never acknowledges invalidation 5.
    let hub = ready_hub(&[1, 2]);
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    hub.cache_fill(1, ID, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
    let (tx1, mut rx1) = tokio::sync::mpsc::unbounded_channel();
    hub.attach_stream(1, tx1);
    assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
    let Ok(Ok(Reply::Invalidate { id: first, .. })) = rx1.try_recv() else {
        panic!("client 1 not invalidated")
    };
    // The next write to /c (and to /d, which nobody holds): client 1 still owes the
    // first acknowledgement, so it may still serve /c: this one waits for it too.
    assert!(
        hub.invalidate(99, 6, vec!["/c".into(), "/d".into()])
            .is_none(),
        "acknowledged upstream while client 1 may still serve /c"
    );
    let Ok(Ok(Reply::Invalidate { id: second, paths })) = rx1.try_recv() else {
        panic!("client 1 not told again")
    };
    assert_eq!(paths, vec!["/c".to_string()]);
    // A write to another node does not wait for it.
    assert_eq!(hub.invalidate(99, 7, vec!["/e".into()]), Some((99, 7)));
    assert_eq!(hub.ack(1, &[first]), vec![(99, 5)]);
    assert_eq!(hub.ack(1, &[second]), vec![(99, 6)]);
    assert_eq!(hub.pending_invalidations().0, 0);
    // Cut off for good instead: both wait until its lease as seen here runs out.
    let snap = hub.cache_lookup(2, ID, "/c").unwrap_err();
    hub.cache_fill(2, ID, "/c", snap, Some((b"v".to_vec(), stat())), 8, true);
    assert!(hub.invalidate(99, 8, vec!["/c".into()]).is_none());
    assert!(hub.invalidate(99, 9, vec!["/c".into()]).is_none());
    let mut acks = hub.tick(Instant::now() + Duration::from_secs(13));
    acks.sort();
    assert_eq!(acks, vec![(99, 8), (99, 9)]);
}

/// A cached copy is served only to identities the leader answered a read of the node
/// for: another identity's read is a miss (it goes upstream, where the node's ACL
/// decides), and once answered it joins the readers; an invalidation (a write, or an
/// ACL change, which the leader holds like a write) drops every reader with the copy.
#[test]
fn a_cached_copy_is_served_only_to_identities_the_leader_answered() {
    let hub = ready_hub(&[1, 2]);
    let other = "lock://client/other";
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    hub.cache_fill(1, ID, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
    assert!(hub.cache_lookup(1, ID, "/c").is_ok());
    assert!(
        hub.cache_lookup(2, ID, "/c").is_ok(),
        "same identity, other session"
    );
    let snap = hub
        .cache_lookup(2, other, "/c")
        .expect_err("an identity the leader never answered is not served the copy");
    // The leader answered it: it joins the readers, and the first reader stays one.
    hub.cache_fill(2, other, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
    assert!(hub.cache_lookup(2, other, "/c").is_ok());
    assert!(hub.cache_lookup(1, ID, "/c").is_ok());
    // Both sessions hold the copy: the upstream acknowledgement waits for them.
    let _ = hub.invalidate(99, 5, vec!["/c".into()]);
    assert!(
        hub.cache_lookup(1, ID, "/c").is_err(),
        "dropped with its readers"
    );
    assert!(
        hub.cache_lookup(2, other, "/c").is_err(),
        "dropped with its readers"
    );
}

#[test]
fn invalidation_waits_for_every_holder_then_acks_upstream() {
    let hub = ready_hub(&[1, 2]);
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    let r = hub.cache_fill(1, ID, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
    assert!(matches!(r, Reply::CachedData { cachable: true, .. }));
    assert!(
        hub.cache_lookup(2, ID, "/c").is_ok(),
        "served from the proxy's cache"
    );
    let (tx1, mut rx1) = tokio::sync::mpsc::unbounded_channel();
    hub.attach_stream(1, tx1);
    assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
    let Ok(Ok(Reply::Invalidate { id, .. })) = rx1.try_recv() else {
        panic!("client 1 not invalidated")
    };
    assert!(hub.cache_lookup(3, ID, "/c").is_err(), "dropped at once");
    assert!(
        hub.ack(1, &[id]).is_empty(),
        "client 2 has not acknowledged"
    );
    // Client 2 never answers: its lease as seen here runs out.
    let acks = hub.tick(Instant::now() + Duration::from_secs(13));
    assert_eq!(acks, vec![(99, 5)]);
}

/// A client's session opened before the proxy's own (so before any answer told the
/// proxy the cell's lease): the proxy waits for it as long as the lease its open's
/// answer named, not the 12 s default. Shorter: the write held for a silent client
/// went on 12 s later instead of 3 s (the flaky
/// `a_proxy_client_that_renews_but_never_acknowledges_loses_its_session`). Longer:
/// the proxy stopped waiting while the client's cache was still valid.
#[test]
fn a_client_is_waited_for_as_long_as_the_lease_its_open_named() {
    for (lease_ms, waits_at, done_at) in [(3_000u64, 2_500u64, 3_500u64), (30_000, 13_000, 30_500)]
    {
        let hub = Hub::new();
        hub.set_ready(true);
        let opened = Instant::now();
        hub.opened(1, opened, lease_ms);
        hub.set_own_session(Some(opened));
        let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
        let r = hub.cache_fill(1, ID, "/c", snap, Some((b"v".to_vec(), stat())), 7, true);
        assert!(matches!(r, Reply::CachedData { cachable: true, .. }));
        assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
        let at = |ms| opened + Duration::from_millis(ms);
        assert!(
            hub.tick(at(waits_at)).is_empty(),
            "lease {lease_ms} ms: stopped waiting after {waits_at} ms"
        );
        assert_eq!(
            hub.tick(at(done_at)),
            vec![(99, 5)],
            "lease {lease_ms} ms: still waiting after {done_at} ms"
        );
    }
}

#[test]
fn a_read_that_raced_an_invalidation_is_not_cached() {
    let hub = ready_hub(&[1]);
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    assert_eq!(hub.invalidate(99, 1, vec!["/c".into()]), Some((99, 1)));
    let r = hub.cache_fill(1, ID, "/c", snap, None, 7, true);
    assert!(matches!(
        r,
        Reply::CachedData {
            cachable: false,
            ..
        }
    ));
    assert!(hub.cache_lookup(1, ID, "/c").is_err());
    // A reset also makes reads in flight uncachable and invalidates every holder.
    let snap = hub.cache_lookup(1, ID, "/d").unwrap_err();
    hub.cache_fill(1, ID, "/d", snap, None, 8, true);
    let ids = hub.reset();
    assert_eq!(ids.len(), 1);
    assert!(!hub.all_done(&ids));
    assert!(
        hub.ack(1, &ids).is_empty(),
        "local invalidations owe nothing upstream"
    );
    assert!(hub.all_done(&ids));
}

#[test]
fn nothing_is_cached_for_unknown_clients_or_past_the_proxys_own_lease() {
    let hub = ready_hub(&[1]);
    // A session never renewed here (or ended) is answered but not told to cache.
    let snap = hub.cache_lookup(7, ID, "/c").unwrap_err();
    let r = hub.cache_fill(7, ID, "/c", snap, None, 3, true);
    assert!(matches!(
        r,
        Reply::CachedData {
            cachable: false,
            ..
        }
    ));
    assert!(
        hub.cache_lookup(7, ID, "/c").is_err(),
        "no hit for an unknown session"
    );
    assert!(
        hub.cache_lookup(1, ID, "/c").is_ok(),
        "the value itself was cached"
    );
    // The proxy's own session may have run out at the leader: serve nothing cached.
    hub.set_own_session(Some(Instant::now() - Duration::from_secs(13)));
    assert!(!hub.ready());
    assert!(hub.cache_lookup(1, ID, "/c").is_err());
    // A read sent while the stream was down is never cached.
    hub.set_own_session(Some(Instant::now()));
    hub.set_ready(false);
    let snap = hub.cache_lookup(1, ID, "/d").unwrap_err();
    hub.set_ready(true);
    let r = hub.cache_fill(1, ID, "/d", snap, None, 4, true);
    assert!(matches!(
        r,
        Reply::CachedData {
            cachable: false,
            ..
        }
    ));
}

#[test]
fn a_reconnecting_client_is_sent_its_unacknowledged_invalidations_again() {
    let hub = ready_hub(&[1]);
    let snap = hub.cache_lookup(1, ID, "/c").unwrap_err();
    hub.cache_fill(1, ID, "/c", snap, None, 3, true);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let first = hub.attach_stream(1, tx);
    assert!(hub.invalidate(99, 5, vec!["/c".into()]).is_none());
    drop(rx); // the stream broke with the invalidation in it
    hub.detach_stream(1, first);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    hub.attach_stream(1, tx);
    let Ok(Ok(Reply::Invalidate { id, paths })) = rx.try_recv() else {
        panic!("not sent again")
    };
    assert_eq!(paths, vec!["/c".to_string()]);
    assert_eq!(hub.ack(1, &[id]), vec![(99, 5)]);
}

fn stat() -> NodeStat {
    NodeStat {
        version: 0,
        children_version: 0,
        create_index: 1,
        mod_index: 1,
        ephemeral_owner: None,
        data_len: 1,
        children_count: 0,
        token: 1,
    }
}
