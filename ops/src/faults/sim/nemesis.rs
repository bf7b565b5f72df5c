//! The simulation's nemesis: between simulation steps it injects one fault at a time
//! ([`SIM_FAULTS`]) and heals it.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use replica::raft::mem_log::MemLog;

use super::moves::{self, MoveAsk};
use super::{
    host, Active, Admin, MemberStep, Pauses, Shared, SimPlan, Slot, CLIENTS, MAX_LATENCY, PROXY,
    REPLICAS,
};
use crate::faults::plan::{Fault, Injected};

/// The faults the simulation injects: the namespace tier's, the proxy's crash and a
/// follower's lost data.
pub const SIM_FAULTS: [Fault; 12] = [
    Fault::KillProxy,
    Fault::KillLeader,
    Fault::KillFollower,
    Fault::PauseLeader,
    Fault::IsolateLeader,
    Fault::Split,
    Fault::OneWay,
    Fault::Loss,
    Fault::Slow,
    Fault::ClientCut,
    Fault::Member,
    Fault::Wipe,
];

/// Every host of the simulation (with `moves`, the second cell's and the directory's).
fn all_hosts(with_moves: bool) -> Vec<String> {
    let mut v: Vec<String> = (1..=REPLICAS).map(host).collect();
    v.push(PROXY.into());
    v.push(CLIENTS.into());
    if with_moves {
        v.extend(moves::hosts());
    }
    v
}

/// Undoes every network fault: repairs and releases every link, no loss, normal latency.
fn heal_network(sim: &mut turmoil::Sim<'_>, with_moves: bool) {
    let hosts = all_hosts(with_moves);
    for a in &hosts {
        for b in &hosts {
            if a < b {
                sim.repair(a.as_str(), b.as_str());
                sim.release(a.as_str(), b.as_str());
                sim.set_link_fail_rate(a.as_str(), b.as_str(), 0.0);
                sim.set_link_max_message_latency(a.as_str(), b.as_str(), MAX_LATENCY);
            }
        }
    }
}

/// A host other than `leader`'s, drawn from `rng`.
fn follower_of(leader: usize, rng: &mut StdRng) -> usize {
    let others: Vec<usize> = (1..=REPLICAS).filter(|h| *h != leader).collect();
    *others.choose(rng).expect("four followers")
}

/// Injects `fault`; returns what it hit and the host it crashed, if any.
fn inject(
    sim: &mut turmoil::Sim<'_>,
    pauses: &mut Pauses,
    fault: Fault,
    leader: Option<usize>,
    rng: &mut StdRng,
    with_moves: bool,
) -> (String, Option<String>, Option<Arc<AtomicBool>>) {
    let all_hosts = || all_hosts(with_moves);
    let leader = leader.unwrap_or_else(|| rng.gen_range(1..=REPLICAS));
    let follower = follower_of(leader, rng);
    let replicas: Vec<String> = (1..=REPLICAS).map(host).collect();
    let (target, crashed) = match fault {
        Fault::KillLeader | Fault::KillFollower => {
            let h = host(if fault == Fault::KillLeader {
                leader
            } else {
                follower
            });
            sim.crash(h.as_str());
            (h.clone(), Some(h))
        }
        Fault::PauseLeader => {
            // The leader's whole process stops (its traffic is not touched: the others'
            // datagrams wait in its sockets, as in a stopped process's socket buffers).
            let h = host(leader);
            let switch = pauses.switch(&h);
            switch.store(true, Ordering::SeqCst);
            return (h, None, Some(switch));
        }
        Fault::IsolateLeader => {
            let h = host(leader);
            for other in all_hosts().iter().filter(|o| **o != h) {
                sim.partition(h.as_str(), other.as_str());
            }
            (h, None)
        }
        Fault::Split => {
            let mut order = replicas.clone();
            order.shuffle(rng);
            let (minority, majority) = order.split_at(2);
            for a in minority {
                for b in majority {
                    sim.partition(a.as_str(), b.as_str());
                }
            }
            (format!("{minority:?} | {majority:?}"), None)
        }
        Fault::OneWay => {
            let (a, b) = (host(leader), host(follower));
            sim.partition_oneway(a.as_str(), b.as_str());
            (format!("{a} -> {b}"), None)
        }
        Fault::Loss => {
            let rate = rng.gen_range(0.05..0.3);
            for a in &replicas {
                for b in all_hosts().iter().filter(|b| *b != a) {
                    sim.set_link_fail_rate(a.as_str(), b.as_str(), rate);
                }
            }
            (format!("{:.0} % of datagrams", rate * 100.0), None)
        }
        Fault::Slow => {
            // The leader's links: each datagram takes up to 100–400 ms, above openraft's
            // 150 ms RPC timeout, for a lease and a half (see `nemesis`).
            let h = host(leader);
            let ms = rng.gen_range(100..400);
            for other in all_hosts().iter().filter(|o| **o != h) {
                sim.set_link_max_message_latency(
                    h.as_str(),
                    other.as_str(),
                    Duration::from_millis(ms),
                );
            }
            (format!("{h} up to {ms} ms per datagram"), None)
        }
        Fault::ClientCut => {
            // The proxied clients (both cache readers among them) lose their proxy, which
            // stays connected to the cell: writes to what they cache must wait for their
            // leases, while their caches keep answering.
            sim.partition(CLIENTS, PROXY);
            (format!("{CLIENTS} | {PROXY}"), None)
        }
        Fault::KillProxy => {
            sim.crash(PROXY);
            (PROXY.into(), Some(PROXY.into()))
        }
        Fault::Member | Fault::Wipe | Fault::Move => {
            unreachable!("{fault:?} is driven by `nemesis`")
        }
    };
    (target, crashed, None)
}

/// The step loop with the nemesis between steps; returns the faults injected.
pub(super) fn nemesis(
    sim: &mut turmoil::Sim<'_>,
    pauses: &mut Pauses,
    plan: &SimPlan,
    shared: &Mutex<Shared>,
    slots: &[Arc<Mutex<Slot>>],
    addrs: &[SocketAddr],
    out: &Path,
) -> anyhow::Result<Vec<Injected>> {
    let mut next_id = REPLICAS as u64 + 1;
    // Stores made so far by `member` and `wipe` (each host's first is generation 0).
    let mut generation = 0u64;
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x6e656d65_73697300);
    let mut log = Vec::new();
    let mut active: Option<Active> = None;
    let mut next_at: Option<Duration> = None;
    let mut bag: Vec<Fault> = Vec::new();
    let mut healed = false;
    let with_moves = plan.moves;
    let mut kinds = SIM_FAULTS.to_vec();
    if with_moves {
        // Twice a round: a move costs no turn of the others.
        kinds.extend([Fault::Move, Fault::Move]);
    }
    // Where the next move takes the prefix: the other cell, until a move finishes.
    let mut move_to = moves::CELL_B.to_string();
    // A move asked for and not answered yet.
    let mut moving = false;
    loop {
        let finished = sim.step().map_err(|e| anyhow::anyhow!("simulation: {e}"))?;
        if finished {
            break;
        }
        let now = sim.elapsed();
        let (ends_at, leader, zero) = {
            let s = shared.lock().expect("shared");
            (s.ends_at, s.leader, s.history_zero)
        };
        let Some(ends_at) = ends_at else { continue };
        if healed {
            continue;
        }
        if moving {
            let result = shared.lock().expect("shared").move_result.take();
            if let Some(r) = result {
                moving = false;
                if r == Ok(true) {
                    move_to = if move_to == moves::CELL_B {
                        moves::CELL_A.to_string()
                    } else {
                        moves::CELL_B.to_string()
                    };
                }
            }
        }
        if now >= ends_at {
            if let Some(a) = active.take() {
                let error = a.member.map(|m| format!("unfinished at the end: {m:?}"));
                log.push(heal(sim, a, now, zero, error, with_moves));
            }
            heal_network(sim, with_moves);
            healed = true;
            continue;
        }
        if let Some(a) = &mut active {
            let mut done: Option<Option<String>> = None;
            if let Some(step) = a.member {
                let result = shared.lock().expect("shared").admin_result.take();
                match (step, result) {
                    (
                        MemberStep::Wiped {
                            host: h,
                            old,
                            remove_at,
                        },
                        None,
                    ) if now >= remove_at => {
                        shared.lock().expect("shared").admin = Some(Admin::Remove(old));
                        a.member = Some(MemberStep::Removing {
                            host: h,
                            old,
                            same_id: true,
                        });
                    }
                    (
                        MemberStep::Removing {
                            host: h,
                            old,
                            same_id: true,
                        },
                        Some(Ok(())),
                    ) => {
                        // Removed: its wiped store comes back under its own id.
                        a.member = Some(MemberStep::Adding);
                        shared.lock().expect("shared").admin = Some(Admin::Add {
                            id: old,
                            addr: addrs[h - 1],
                        });
                    }
                    (
                        MemberStep::Removing {
                            host: h,
                            old,
                            same_id: false,
                        },
                        Some(Ok(())),
                    ) => {
                        // Removed: the host starts again as a new, empty replica.
                        let new = next_id;
                        next_id += 1;
                        sim.crash(host(h).as_str());
                        {
                            let mut slot = slots[h - 1].lock().expect("slot");
                            slot.cfg.id = new;
                            slot.cfg.bootstrap = false;
                            slot.cfg.data_dir = out.join(format!("data-{new}"));
                            generation += 1;
                            slot.log = MemLog::with_store_id(super::store_id(h, generation));
                        }
                        sim.bounce(host(h).as_str());
                        a.target = format!("{}: replica {old} replaced by {new}", host(h));
                        a.member = Some(MemberStep::Adding);
                        shared.lock().expect("shared").admin = Some(Admin::Add {
                            id: new,
                            addr: addrs[h - 1],
                        });
                    }
                    (MemberStep::Adding, Some(Ok(()))) => done = Some(None),
                    (MemberStep::Wiped { .. }, Some(Ok(()))) => {
                        done = Some(Some("an answer to a change not asked for yet".into()))
                    }
                    (_, Some(Err(e))) => done = Some(Some(e)),
                    (_, None) if now >= a.until => {
                        done = Some(Some(format!("timed out: {step:?}")));
                    }
                    (_, None) => {}
                }
            } else if now >= a.until {
                done = Some(None);
            }
            if let Some(error) = done {
                let a = active.take().expect("active");
                log.push(heal(sim, a, now, zero, error, with_moves));
                next_at = Some(now + Duration::from_millis(rng.gen_range(1_000..3_000)));
            }
            continue;
        }
        let due = *next_at.get_or_insert(now + Duration::from_secs(2));
        let hold = Duration::from_millis(rng.gen_range(1_000..6_000));
        if now < due || now + hold + Duration::from_secs(1) >= ends_at {
            continue;
        }
        if bag.is_empty() {
            // Rounds of every kind in a seeded order. The first round of seed `s` opens
            // with kinds 3s, 3s+1 and 3s+2 (mod 12, in a seeded order), so any four
            // consecutive seeds open with every kind between them.
            bag = kinds.clone();
            bag.shuffle(&mut rng);
            if log.is_empty() {
                let n = kinds.len() as u64;
                let front: Vec<Fault> = (0..3)
                    .map(|j| kinds[((3 * plan.seed + j) % n) as usize])
                    .collect();
                // `pop` takes from the end: the front kinds go last.
                bag.sort_by_key(|f| front.contains(f));
            }
        }
        let fault = bag.pop().expect("refilled");
        let hold = match fault {
            Fault::Slow => hold.max(Duration::from_millis(plan.lease_ms * 3 / 2)),
            // The longest a membership change may take.
            Fault::Member => Duration::from_secs(15),
            // A moment uncounted, then a membership change's longest, as above.
            Fault::Wipe => Duration::from_secs(15),
            // Short enough that the proxied clients' sessions outlive it: they renew
            // every third of a lease, through the proxy's once-a-second batch, so a cut
            // longer than about half a lease costs a proxied keeper its session (the
            // namespace tier's `client-cut` silences the cache readers only).
            Fault::KillProxy | Fault::ClientCut => {
                Duration::from_millis(rng.gen_range(300..=plan.lease_ms / 4))
            }
            // Runs beside the others (below); one still running at the end is finished by
            // the client host before the checks.
            Fault::Move => Duration::ZERO,
            _ => hold,
        };
        if now + hold + Duration::from_secs(1) >= ends_at {
            // Too long for the time left: try another kind first.
            bag.insert(0, fault);
            continue;
        }
        if fault == Fault::Move {
            // A move runs beside the faults that follow it (it is not the one fault held
            // at a time): the nemesis goes on at once. Half of the moves stop after a
            // seeded step, as a killed mover would; the next one goes on from there (after
            // the stopped mover's session expired), and so does the client host at the end.
            if moving {
                // The last one is still running: this turn goes to another fault.
                continue;
            }
            let stop_after = rng.gen_bool(0.5).then(|| rng.gen_range(0..=7u32));
            shared.lock().expect("shared").move_ask = Some(MoveAsk {
                to: move_to.clone(),
                stop_after,
            });
            moving = true;
            let stop = stop_after.map_or(String::new(), |s| format!(", stopped after step {s}"));
            log.push(Injected {
                at_ms: now.saturating_sub(zero).as_millis() as u64,
                fault,
                target: format!("{} to cell {move_to}{stop}", moves::PREFIX),
                held_ms: 0,
                error: None,
            });
            continue;
        }
        if fault == Fault::Member {
            // A follower's replica is removed; `Removing` then restarts its host as a
            // new replica, which is added as a learner, caught up and promoted.
            let Some(l) = leader else {
                bag.insert(0, fault);
                continue;
            };
            let h = follower_of(l, &mut rng);
            let old = slots[h - 1].lock().expect("slot").cfg.id;
            shared.lock().expect("shared").admin = Some(Admin::Remove(old));
            active = Some(Active {
                fault,
                target: format!("{}: replica {old}", host(h)),
                from: now,
                until: now + hold,
                crashed: None,
                paused: None,
                member: Some(MemberStep::Removing {
                    host: h,
                    old,
                    same_id: false,
                }),
            });
            continue;
        }
        if fault == Fault::Wipe {
            // A follower's store is lost: its host restarts it under its id with an
            // empty store (and snapshot directory); `Wiped` asks for its removal a little
            // later, and it is added back under its id.
            let Some(l) = leader else {
                bag.insert(0, fault);
                continue;
            };
            let h = follower_of(l, &mut rng);
            sim.crash(host(h).as_str());
            let old = {
                let mut slot = slots[h - 1].lock().expect("slot");
                generation += 1;
                slot.log = MemLog::with_store_id(super::store_id(h, generation));
                slot.cfg.data_dir = out.join(format!("data-{}-wiped-{generation}", slot.cfg.id));
                slot.cfg.bootstrap = false;
                slot.cfg.id
            };
            sim.bounce(host(h).as_str());
            let uncounted = Duration::from_millis(rng.gen_range(500..1_500));
            active = Some(Active {
                fault,
                target: format!("{}: replica {old} wiped", host(h)),
                from: now,
                until: now + hold,
                crashed: None,
                paused: None,
                member: Some(MemberStep::Wiped {
                    host: h,
                    old,
                    remove_at: now + uncounted,
                }),
            });
            continue;
        }

        let (target, crashed, paused) = inject(sim, pauses, fault, leader, &mut rng, with_moves);
        active = Some(Active {
            fault,
            target,
            from: now,
            until: now + hold,
            crashed,
            paused,
            member: None,
        });
    }
    Ok(log)
}

/// Heals one fault: restarts the host it crashed, undoes what it did to the network.
fn heal(
    sim: &mut turmoil::Sim<'_>,
    a: Active,
    now: Duration,
    zero: Duration,
    error: Option<String>,
    with_moves: bool,
) -> Injected {
    if let Some(h) = &a.crashed {
        sim.bounce(h.as_str());
    }
    if let Some(p) = &a.paused {
        p.store(false, Ordering::SeqCst);
    }
    heal_network(sim, with_moves);
    Injected {
        at_ms: a.from.saturating_sub(zero).as_millis() as u64,
        fault: a.fault,
        target: a.target,
        held_ms: (now - a.from).as_millis() as u64,
        error,
    }
}
