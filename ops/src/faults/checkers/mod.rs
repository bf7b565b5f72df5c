//! Histories and the checkers that read them (the fault-injection suite's verdicts).
//!
//! A history is a list of [`Event`]s, stored as JSON lines: every operation a client
//! starts is an `invoke`, and ends as `ok` (it happened), `fail` (it surely did not) or
//! `info` (unknown: a timeout, a crash). Times are microseconds on one clock per history.
//!
//! - [`check_fenced_lock`]: clients take a lock and write to a protected resource with the
//!   grant's fencing token; the resource records what it accepted. Accepted tokens never
//!   go down, writes of two critical sections never interleave, and a grant that completed
//!   before another was asked for has the lower token.
//! - [`check_register`]: get / set / compare-and-set on keys must be linearizable per key
//!   (a Wing–Gong search with memoization, for the short histories a fault run records).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;

use serde::{Deserialize, Serialize};

/// How an operation ended, or that it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// It started.
    Invoke,
    /// It happened.
    Ok,
    /// It surely did not happen.
    Fail,
    /// Unknown whether it happened.
    Info,
}

/// What an operation is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "f", rename_all = "snake_case")]
pub enum Op {
    /// Take a lock; `token` is set on `ok`.
    Acquire {
        /// The lock.
        lock: String,
        /// The fencing token granted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<u64>,
    },
    /// Release a lock.
    Release {
        /// The lock.
        lock: String,
        /// The token held.
        token: u64,
    },
    /// A write to a protected resource under `token`, as the resource saw it: `ok` when
    /// accepted (it then carries the resource's acceptance sequence), `fail` when refused
    /// as stale.
    FencedWrite {
        /// The resource.
        resource: String,
        /// The token presented.
        token: u64,
        /// Order of acceptance at the resource.
        #[serde(default)]
        seq: u64,
    },
    /// Read a key; `value` on `ok` (`None`: absent).
    Read {
        /// The key.
        key: String,
        /// What was read.
        #[serde(default)]
        value: Option<String>,
    },
    /// Write a key.
    Write {
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// The holder of `token` acted on the strength of its lock alone (its lease said it may,
    /// `Lock::may_act`), without a fenced resource: recorded `ok` when it did. No grant of
    /// a higher token to another client may have completed before.
    Act {
        /// The lock.
        lock: String,
        /// The token held.
        token: u64,
    },
    /// Set `key` to `to` if it holds `from` (`None`: absent). `fail`: it did not hold it.
    Cas {
        /// The key.
        key: String,
        /// The expected value.
        from: Option<String>,
        /// The new value.
        to: String,
    },
    /// The key stops existing: deleted, or removed with the session that owned it (its
    /// close, or its expiry, whose moment is unknown: recorded `info`).
    Remove {
        /// The key.
        key: String,
    },
}

/// One line of a history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Microseconds since the run started.
    pub at_us: u64,
    /// The client that did it.
    pub process: String,
    /// Start or end.
    pub kind: Kind,
    /// The operation.
    pub op: Op,
}

/// Reads a JSON-lines history; names the line of a bad record.
pub fn read_history(r: impl std::io::Read) -> Result<Vec<Event>, String> {
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(r).lines().enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(serde_json::from_str(&line).map_err(|e| format!("line {}: {e}", i + 1))?);
    }
    Ok(out)
}

/// Writes a history as JSON lines.
pub fn write_history(w: &mut impl std::io::Write, events: &[Event]) -> std::io::Result<()> {
    for e in events {
        serde_json::to_writer(&mut *w, e)?;
        w.write_all(b"\n")?;
    }
    Ok(())
}

/// Records a history as it happens: one clock (microseconds since [`Recorder::new`]),
/// shared by every client of a run.
#[derive(Debug)]
pub struct Recorder {
    start: tokio::time::Instant,
    events: std::sync::Mutex<Vec<Event>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Recorder {
        Recorder {
            start: tokio::time::Instant::now(),
            events: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// When the clock started.
    pub fn start(&self) -> tokio::time::Instant {
        self.start
    }

    /// Records one event now.
    pub fn log(&self, process: &str, kind: Kind, op: Op) {
        let at_us = self.start.elapsed().as_micros() as u64;
        self.events.lock().expect("history lock").push(Event {
            at_us,
            process: process.into(),
            kind,
            op,
        });
    }

    /// The recorder's clock now (microseconds since it started), for [`Recorder::log_at`].
    pub fn stamp(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Records an event that happened at `at_us` (from [`Recorder::stamp`]): an action
    /// is stamped before the check that allowed it, so a delay between the two cannot
    /// make a timely action look late.
    pub fn log_at(&self, at_us: u64, process: &str, kind: Kind, op: Op) {
        self.events.lock().expect("history lock").push(Event {
            at_us,
            process: process.into(),
            kind,
            op,
        });
    }

    /// Everything recorded so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().expect("history lock").clone()
    }
}

/// A protected resource that checks fencing tokens: it accepts a write whose token is at
/// least the highest it accepted, and records every write (accepted with its order of
/// acceptance, or refused as stale) in a [`Recorder`].
#[derive(Debug)]
pub struct FencedResource {
    name: String,
    /// (highest token accepted, writes accepted).
    state: std::sync::Mutex<(u64, u64)>,
}

impl FencedResource {
    /// A resource that has accepted nothing yet.
    pub fn new(name: &str) -> FencedResource {
        FencedResource {
            name: name.into(),
            state: std::sync::Mutex::new((0, 0)),
        }
    }

    /// `who` writes under `token`; true when accepted.
    pub fn write(&self, rec: &Recorder, who: &str, token: u64) -> bool {
        let mut st = self.state.lock().expect("resource lock");
        let accepted = token >= st.0;
        let seq = if accepted {
            st.0 = token;
            st.1 += 1;
            st.1
        } else {
            0
        };
        rec.log(
            who,
            if accepted { Kind::Ok } else { Kind::Fail },
            Op::FencedWrite {
                resource: self.name.clone(),
                token,
                seq,
            },
        );
        accepted
    }
}

/// What a passing fenced-lock check covered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedStats {
    /// Grants seen.
    pub grants: usize,
    /// Writes the resources accepted.
    pub accepted: usize,
    /// Writes refused as stale.
    pub refused: usize,
    /// Actions taken on the strength of a lease alone (rule 3).
    pub acts: usize,
}

/// Checks a fenced-lock history; the error names the first violation found.
pub fn check_fenced_lock(events: &[Event]) -> Result<FencedStats, String> {
    // 1. At each resource, in acceptance order: tokens never go down, and one token's
    //    writes come from one client (two critical sections never interleave).
    let mut accepted: BTreeMap<&str, Vec<(u64, u64, &str)>> = BTreeMap::new();
    let mut refused = 0;
    for e in events {
        if let Op::FencedWrite {
            resource,
            token,
            seq,
        } = &e.op
        {
            match e.kind {
                Kind::Ok => accepted.entry(resource.as_str()).or_default().push((
                    *seq,
                    *token,
                    e.process.as_str(),
                )),
                Kind::Fail => refused += 1,
                _ => {}
            }
        }
    }
    let mut n_accepted = 0;
    for (resource, writes) in &mut accepted {
        writes.sort();
        n_accepted += writes.len();
        let mut owner: HashMap<u64, &str> = HashMap::new();
        for w in writes.windows(2) {
            let ((s1, t1, _), (s2, t2, _)) = (w[0], w[1]);
            if s1 == s2 {
                return Err(format!("{resource}: two writes accepted as #{s1}"));
            }
            if t2 < t1 {
                return Err(format!(
                    "{resource}: token {t2} accepted (#{s2}) after token {t1} (#{s1})"
                ));
            }
        }
        for (seq, token, p) in writes.iter() {
            if let Some(o) = owner.insert(*token, p) {
                if o != *p {
                    return Err(format!(
                        "{resource}: token {token} used by {o} and {p} (write #{seq})"
                    ));
                }
            }
        }
    }
    // 2. Grants: unique per lock, and one that completed before another was invoked has
    //    the lower token (the grant had the highest token when it returned).
    let mut invoked: HashMap<&str, Vec<u64>> = HashMap::new();
    struct Grant<'a> {
        invoked: u64,
        done: u64,
        token: u64,
        process: &'a str,
    }
    let mut grants: BTreeMap<&str, Vec<Grant>> = BTreeMap::new();
    for e in events {
        if let Op::Acquire { lock, token } = &e.op {
            match (e.kind, token) {
                (Kind::Invoke, _) => invoked.entry(e.process.as_str()).or_default().push(e.at_us),
                (Kind::Ok, Some(t)) => {
                    let start = invoked
                        .get_mut(e.process.as_str())
                        .and_then(|v| v.pop())
                        .ok_or_else(|| {
                            format!("{}: acquire ok without an invoke at {}", e.process, e.at_us)
                        })?;
                    grants.entry(lock.as_str()).or_default().push(Grant {
                        invoked: start,
                        done: e.at_us,
                        token: *t,
                        process: &e.process,
                    });
                }
                (Kind::Ok, None) => {
                    return Err(format!("{}: acquire ok without a token", e.process));
                }
                _ => {
                    invoked.get_mut(e.process.as_str()).and_then(|v| v.pop());
                }
            }
        }
    }
    let mut n_grants = 0;
    for (lock, gs) in &grants {
        n_grants += gs.len();
        let mut seen: HashMap<u64, &str> = HashMap::new();
        for g in gs {
            if let Some(p) = seen.insert(g.token, g.process) {
                return Err(format!(
                    "{lock}: token {} granted to {p} and {}",
                    g.token, g.process
                ));
            }
        }
        // Sorted by completion, the largest token among grants completed before each
        // invoke must be below that grant's token.
        let mut by_done: Vec<&Grant> = gs.iter().collect();
        by_done.sort_by_key(|g| g.done);
        for g in gs {
            let earlier = by_done
                .iter()
                .take_while(|h| h.done < g.invoked)
                .max_by_key(|h| h.token);
            if let Some(h) = earlier {
                if h.token > g.token {
                    return Err(format!(
                        "{lock}: {} was granted token {} (asked at {} µs) although {} had \
                         been granted the higher token {} at {} µs",
                        g.process, g.token, g.invoked, h.process, h.token, h.done
                    ));
                }
            }
        }
    }
    // 3. A holder that acted because its lease said it still held the lock did so before
    //    any grant of a higher token to another client completed (the lease, not the
    //    fencing token, is what kept two holders from acting at once).
    let mut acts = 0;
    for e in events {
        let Op::Act { lock, token } = &e.op else {
            continue;
        };
        if e.kind != Kind::Ok {
            continue;
        }
        acts += 1;
        let later = grants.get(lock.as_str()).and_then(|gs| {
            gs.iter()
                .filter(|g| g.token > *token && g.process != e.process && g.done < e.at_us)
                .min_by_key(|g| g.done)
        });
        if let Some(g) = later {
            return Err(format!(
                "{lock}: {} acted under token {token} at {} µs, after {} was granted token {} \
                 at {} µs (two holders acting at once)",
                e.process, e.at_us, g.process, g.token, g.done
            ));
        }
    }
    Ok(FencedStats {
        grants: n_grants,
        accepted: n_accepted,
        refused,
        acts,
    })
}

/// One register operation with its interval (`done = None`: unknown outcome).
#[derive(Debug, Clone)]
struct RegOp {
    invoked: u64,
    done: Option<u64>,
    op: Op,
    ok: bool,
}

/// Checks that every key's reads, writes and compare-and-sets are linearizable. Keys are
/// checked one by one; at most `max_ops_per_key` completed operations each (the search is
/// exponential in the worst case). The error names the key and its operations.
pub fn check_register(events: &[Event], max_ops_per_key: usize) -> Result<usize, String> {
    let mut open: HashMap<(&str, &str), (u64, &Op)> = HashMap::new();
    let mut per_key: BTreeMap<String, Vec<RegOp>> = BTreeMap::new();
    for e in events {
        let key = match &e.op {
            Op::Read { key, .. }
            | Op::Write { key, .. }
            | Op::Cas { key, .. }
            | Op::Remove { key } => key.as_str(),
            _ => continue,
        };
        match e.kind {
            Kind::Invoke => {
                open.insert((e.process.as_str(), key), (e.at_us, &e.op));
            }
            kind => {
                let (invoked, inv_op) =
                    open.remove(&(e.process.as_str(), key)).ok_or_else(|| {
                        format!(
                            "{}: {key}: completion without an invoke at {}",
                            e.process, e.at_us
                        )
                    })?;
                let r = match kind {
                    Kind::Ok => RegOp {
                        invoked,
                        done: Some(e.at_us),
                        op: e.op.clone(),
                        ok: true,
                    },
                    Kind::Fail => RegOp {
                        invoked,
                        done: Some(e.at_us),
                        op: e.op.clone(),
                        ok: false,
                    },
                    // An unknown read constrains nothing.
                    _ if matches!(inv_op, Op::Read { .. }) => continue,
                    _ => RegOp {
                        invoked,
                        done: None,
                        op: inv_op.clone(),
                        ok: true,
                    },
                };
                // A failed read or write did nothing: leave it out.
                if !r.ok && !matches!(r.op, Op::Cas { .. }) {
                    continue;
                }
                per_key.entry(key.to_string()).or_default().push(r);
            }
        }
    }
    // Operations still open at the end are unknown too.
    for ((_, key), (invoked, op)) in open {
        if !matches!(op, Op::Read { .. }) {
            per_key.entry(key.to_string()).or_default().push(RegOp {
                invoked,
                done: None,
                op: op.clone(),
                ok: true,
            });
        }
    }
    let mut checked = 0;
    for (key, ops) in &per_key {
        if ops.len() > max_ops_per_key {
            return Err(format!(
                "{key}: {} operations, more than the {max_ops_per_key} the search handles",
                ops.len()
            ));
        }
        if !linearizable(ops) {
            return Err(explain_non_linearizable(key, ops));
        }
        checked += ops.len();
    }
    Ok(checked)
}

/// Names the first operation whose completion made `ops` non-linearizable: the shortest
/// prefix in time (operations completed later counted as still open) that has no
/// linearization, found by bisection (a prefix that fails stays failing as it grows).
fn explain_non_linearizable(key: &str, ops: &[RegOp]) -> String {
    let cut = |t: u64| -> Vec<RegOp> {
        ops.iter()
            .filter(|o| o.invoked <= t)
            .filter_map(|o| match o.done {
                Some(d) if d <= t => Some(o.clone()),
                // Still open at `t`: a read constrains nothing yet, a write may or may not
                // have happened.
                _ if matches!(o.op, Op::Read { .. }) => None,
                _ if !o.ok => None,
                _ => Some(RegOp {
                    done: None,
                    ..o.clone()
                }),
            })
            .collect()
    };
    let mut times: Vec<u64> = ops.iter().filter_map(|o| o.done).collect();
    times.sort_unstable();
    times.dedup();
    let (mut lo, mut hi) = (0usize, times.len().saturating_sub(1));
    while lo < hi {
        let mid = (lo + hi) / 2;
        if linearizable(&cut(times[mid])) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let at = times.get(lo).copied().unwrap_or(0);
    let culprit: Vec<&RegOp> = ops.iter().filter(|o| o.done == Some(at)).collect();
    let since = culprit.iter().map(|o| o.invoked).min().unwrap_or(at);
    let context: Vec<String> = ops
        .iter()
        .filter(|o| o.invoked <= at && o.done.is_none_or(|d| d + 1_000_000 >= since))
        .map(|o| {
            format!(
                "  [{} .. {}] {}{:?}",
                o.invoked,
                o.done.map_or("?".into(), |d| d.to_string()),
                if o.ok { "" } else { "failed " },
                o.op
            )
        })
        .collect();
    let context = &context[context.len().saturating_sub(16)..];
    format!(
        "{key}: not linearizable from {at} µs on, when this completed: {culprit:?}; the \
         operations around it (µs since the start):\n{}",
        context.join("\n")
    )
}

/// Applies `o` to `state`, or says it cannot happen there.
fn step(state: &Option<String>, o: &RegOp) -> Option<Option<String>> {
    match (&o.op, o.ok) {
        (Op::Read { value, .. }, _) => (value == state).then(|| state.clone()),
        (Op::Write { value, .. }, _) => Some(Some(value.clone())),
        (Op::Cas { from, to, .. }, true) => (from == state).then(|| Some(to.clone())),
        (Op::Cas { from, .. }, false) => (from != state).then(|| state.clone()),
        (Op::Remove { .. }, _) => Some(None),
        _ => None,
    }
}

/// Wing and Gong's search: repeatedly pick an operation that may come next (none of the
/// others pending finished before it began), apply it if the register allows, backtrack
/// otherwise; states already explored (same set done, same value) are skipped.
fn linearizable(ops: &[RegOp]) -> bool {
    let n = ops.len();
    let words = n.div_ceil(64);
    let must: Vec<usize> = (0..n).filter(|i| ops[*i].done.is_some()).collect();
    let mut seen: HashSet<(Vec<u64>, Option<String>)> = HashSet::new();
    let mut stack = vec![(vec![0u64; words], None::<String>)];
    while let Some((done, state)) = stack.pop() {
        let is_done = |i: usize| done[i / 64] & (1 << (i % 64)) != 0;
        if must.iter().all(|i| is_done(*i)) {
            return true;
        }
        if !seen.insert((done.clone(), state.clone())) {
            continue;
        }
        // The earliest completion among pending operations bounds what may go next.
        let horizon = (0..n)
            .filter(|i| !is_done(*i))
            .filter_map(|i| ops[i].done)
            .min()
            .unwrap_or(u64::MAX);
        for i in (0..n).filter(|i| !is_done(*i)) {
            if ops[i].invoked > horizon {
                continue;
            }
            if let Some(next) = step(&state, &ops[i]) {
                let mut d = done.clone();
                d[i / 64] |= 1 << (i % 64);
                stack.push((d, next));
            }
        }
    }
    false
}

#[cfg(test)]
mod tests;
