use super::*;

fn ev(at_us: u64, p: &str, kind: Kind, op: Op) -> Event {
    Event {
        at_us,
        process: p.into(),
        kind,
        op,
    }
}

fn acq(lock: &str, token: Option<u64>) -> Op {
    Op::Acquire {
        lock: lock.into(),
        token,
    }
}

fn fw(token: u64, seq: u64) -> Op {
    Op::FencedWrite {
        resource: "r".into(),
        token,
        seq,
    }
}

fn good_lock_history() -> Vec<Event> {
    vec![
        ev(0, "a", Kind::Invoke, acq("/l", None)),
        ev(5, "a", Kind::Ok, acq("/l", Some(10))),
        ev(6, "a", Kind::Ok, fw(10, 1)),
        ev(7, "a", Kind::Ok, fw(10, 2)),
        ev(3, "b", Kind::Invoke, acq("/l", None)),
        ev(20, "b", Kind::Ok, acq("/l", Some(12))),
        ev(21, "b", Kind::Ok, fw(12, 3)),
        // a paused holder wakes up and is refused
        ev(22, "a", Kind::Fail, fw(10, 0)),
    ]
}

#[test]
fn a_good_fenced_history_passes_and_survives_json() {
    let h = good_lock_history();
    let mut buf = Vec::new();
    write_history(&mut buf, &h).unwrap();
    let back = read_history(&buf[..]).unwrap();
    assert_eq!(back, h);
    let s = check_fenced_lock(&back).unwrap();
    assert_eq!(
        s,
        FencedStats {
            grants: 2,
            accepted: 3,
            refused: 1,
            acts: 0,
        }
    );
}

#[test]
fn acting_after_a_higher_grant_completed_is_caught() {
    let act = |token| Op::Act {
        lock: "/l".into(),
        token,
    };
    // a acts under 10 before b's grant of 12 completed (at 20): fine.
    let mut h = good_lock_history();
    h.push(ev(19, "a", Kind::Ok, act(10)));
    h.push(ev(25, "b", Kind::Ok, act(12)));
    assert_eq!(check_fenced_lock(&h).unwrap().acts, 2);
    // a still acts under 10 after b was granted 12: two holders at once.
    h.push(ev(21, "a", Kind::Ok, act(10)));
    let e = check_fenced_lock(&h).unwrap_err();
    assert!(e.contains("acted under token 10 at 21"), "{e}");
}

#[test]
fn fenced_lock_violations_are_caught() {
    // A stale token accepted after a newer one.
    let mut h = good_lock_history();
    h.push(ev(23, "a", Kind::Ok, fw(10, 4)));
    assert!(check_fenced_lock(&h)
        .unwrap_err()
        .contains("after token 12"));
    // Two holders with one token.
    let mut h = good_lock_history();
    h.push(ev(24, "b", Kind::Ok, fw(10, 0)));
    let e = check_fenced_lock(&h).unwrap_err();
    assert!(e.contains("used by"), "{e}");
    // A grant that returned after another completed, with a lower token.
    let mut h = good_lock_history();
    h.push(ev(30, "c", Kind::Invoke, acq("/l", None)));
    h.push(ev(31, "c", Kind::Ok, acq("/l", Some(11))));
    let e = check_fenced_lock(&h).unwrap_err();
    assert!(e.contains("higher token 12"), "{e}");
    // The same token granted twice.
    let mut h = good_lock_history();
    h.push(ev(30, "c", Kind::Invoke, acq("/l", None)));
    h.push(ev(31, "c", Kind::Ok, acq("/l", Some(12))));
    assert!(check_fenced_lock(&h).unwrap_err().contains("granted to"));
}

#[test]
fn bad_lines_are_named() {
    let e = read_history(&b"{\"at_us\":1}\n"[..]).unwrap_err();
    assert!(e.starts_with("line 1:"), "{e}");
}

fn read(key: &str, v: Option<&str>) -> Op {
    Op::Read {
        key: key.into(),
        value: v.map(String::from),
    }
}

fn write(key: &str, v: &str) -> Op {
    Op::Write {
        key: key.into(),
        value: v.into(),
    }
}

fn cas(key: &str, from: Option<&str>, to: &str) -> Op {
    Op::Cas {
        key: key.into(),
        from: from.map(String::from),
        to: to.into(),
    }
}

/// (invoke, complete, process, kind, op) into events.
fn hist(ops: &[(u64, u64, &str, Kind, Op)]) -> Vec<Event> {
    let mut out = Vec::new();
    for (a, b, p, k, op) in ops {
        let inv = match op {
            Op::Read { key, .. } => read(key, None),
            o => o.clone(),
        };
        out.push(ev(*a, p, Kind::Invoke, inv));
        out.push(ev(*b, p, *k, op.clone()));
    }
    out.sort_by_key(|e| e.at_us);
    out
}

#[test]
fn linearizable_register_histories_pass() {
    // Concurrent write and read: the read may see either value.
    let h = hist(&[
        (0, 10, "a", Kind::Ok, write("k", "1")),
        (5, 15, "b", Kind::Ok, read("k", None)),
        (20, 30, "a", Kind::Ok, cas("k", Some("1"), "2")),
        (21, 31, "b", Kind::Fail, cas("k", Some("1"), "3")),
        (40, 50, "b", Kind::Ok, read("k", Some("2"))),
    ]);
    assert_eq!(check_register(&h, 100).unwrap(), 5);
    // A write with an unknown outcome may have happened, late.
    let mut h = hist(&[(0, 10, "a", Kind::Ok, write("k", "1"))]);
    h.push(ev(11, "b", Kind::Invoke, write("k", "2")));
    h.push(ev(12, "b", Kind::Info, write("k", "2")));
    h.extend(hist(&[(100, 110, "c", Kind::Ok, read("k", Some("2")))]));
    check_register(&h, 100).unwrap();
}

#[test]
fn random_sequential_runs_pass_and_one_wrong_read_fails() {
    // A deterministic generator (no dependency): ops one after another on a model.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let mut model: Option<String> = None;
    let mut ops = Vec::new();
    for i in 0..200u64 {
        let (kind, op) = match next(3) {
            0 => {
                let v = next(4).to_string();
                model = Some(v.clone());
                (Kind::Ok, write("k", &v))
            }
            1 => (Kind::Ok, read("k", model.as_deref())),
            _ => {
                let from = next(4).to_string();
                let to = next(4).to_string();
                if model.as_deref() == Some(from.as_str()) {
                    model = Some(to.clone());
                    (Kind::Ok, cas("k", Some(&from), &to))
                } else {
                    (Kind::Fail, cas("k", Some(&from), &to))
                }
            }
        };
        ops.push((i * 10, i * 10 + 5, "a", kind, op));
    }
    check_register(&hist(&ops), 1_000).unwrap();
    let last_read = ops
        .iter()
        .rposition(|o| matches!(o.4, Op::Read { .. }))
        .unwrap();
    ops[last_read].4 = read("k", Some("never written"));
    assert!(check_register(&hist(&ops), 1_000).is_err());
}

#[test]
fn a_removed_key_read_as_present_after_the_removal_is_caught() {
    let rm = || Op::Remove { key: "k".into() };
    // A removal with an unknown end (an expiry): a read that found the key gone pins
    // it; a later read that finds it again is stale.
    let ok = hist(&[
        (0, 10, "o", Kind::Ok, write("k", "1")),
        (20, 25, "r", Kind::Ok, read("k", Some("1"))),
        (30, 40, "r", Kind::Ok, read("k", None)),
    ]);
    let mut with_unknown = ok.clone();
    with_unknown.push(ev(15, "o", Kind::Invoke, rm()));
    with_unknown.push(ev(16, "o", Kind::Info, rm()));
    with_unknown.sort_by_key(|e| e.at_us);
    check_register(&with_unknown, 100).unwrap();
    let mut stale = with_unknown.clone();
    stale.push(ev(50, "c", Kind::Invoke, read("k", None)));
    stale.push(ev(51, "c", Kind::Ok, read("k", Some("1"))));
    assert!(check_register(&stale, 100).is_err());
    // A completed removal (a close) orders itself before later reads.
    let h = hist(&[
        (0, 10, "o", Kind::Ok, write("k", "1")),
        (20, 30, "o", Kind::Ok, rm()),
        (40, 50, "c", Kind::Ok, read("k", Some("1"))),
    ]);
    assert!(check_register(&h, 100).is_err());
}

#[test]
fn stale_and_impossible_reads_are_caught() {
    // A read that began after a write completed sees the old value: stale.
    let h = hist(&[
        (0, 10, "a", Kind::Ok, write("k", "1")),
        (20, 30, "a", Kind::Ok, write("k", "2")),
        (40, 50, "b", Kind::Ok, read("k", Some("1"))),
        (60, 70, "b", Kind::Ok, read("k", Some("2"))),
    ]);
    let e = check_register(&h, 100).unwrap_err();
    // The explanation names the stale read's completion as the first bad moment.
    assert!(e.starts_with("k: not linearizable from 50 µs on"), "{e}");
    assert!(e.contains("Some(\"1\")"), "{e}");
    // Two successful compare-and-sets from the same value.
    let h = hist(&[
        (0, 10, "a", Kind::Ok, write("k", "1")),
        (20, 30, "a", Kind::Ok, cas("k", Some("1"), "2")),
        (21, 31, "b", Kind::Ok, cas("k", Some("1"), "3")),
    ]);
    assert!(check_register(&h, 100).is_err());
    // A value nobody wrote.
    let h = hist(&[(0, 10, "a", Kind::Ok, read("k", Some("9")))]);
    assert!(check_register(&h, 100).is_err());
    // Too long a history is refused, not searched for ever.
    let many: Vec<_> = (0..10)
        .map(|i| (i * 10, i * 10 + 5, "a", Kind::Ok, write("k", "1")))
        .collect();
    assert!(check_register(&hist(&many), 5)
        .unwrap_err()
        .contains("more than"));
}
