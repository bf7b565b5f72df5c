//! Lost sessions, one definition for all three systems, checked at the server at the end
//! of a run (issue 26).
//!
//! Each system's clients declare sessions lost in their own way (ours: the cell answered
//! expired/unknown, or the grace period ran out; etcd: the server answered a renewal with
//! TTL 0, its "lease not found"; ZooKeeper: the Rust client's own state), so next to that
//! figure every run that reports lost sessions also asks the server, **session by
//! session**, which of the sessions loadgen should still hold it still holds:
//!
//! - **ours**: a `KeepAliveBatch` of their ids at the leader (renewed: held; expired or
//!   unknown: lost; a lease that ran out at the leader is "expired" even before its
//!   expiry is applied);
//! - **etcd**: `LeaseTimeToLive` of each lease at the leader (TTL -1, "not found": lost;
//!   TTL 0 or less, a lease past its expiry that etcd 3.4 has not yet revoked, at most
//!   1 000 a second: lost);
//! - **ZooKeeper**: the session ids the leader's `dump` lists (its session tracker's
//!   expiry sets; an expired session leaves them on the tick it expires).
//!
//! Ids are compared, not counts, so a session that is not loadgen's (our proxies' own, a
//! churned one still closing) cannot hide a lost one. And the check waits before it asks
//! ([`settle`]): a lease that missed its renewals shortly before the end, or whose leader
//! was killed or frozen, is still within its TTL at the server for a while (a new leader
//! gives every session a fresh lease), so asking at once would count it as held. The
//! sessions keep being renewed meanwhile, as in the run.

use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

use crate::cluster::{four_letter_within, Cluster, System};
use crate::report::Report;

/// The name of the server's count in a report: loadgen's sessions the server still holds.
pub const AT_SERVER: &str = "sessions at the server at the end";
/// The name of the sessions the server confirms lost in a report.
pub const CONFIRMED_LOST: &str = "sessions the server confirms lost";
/// The name of the wait before the check in a report.
pub const WAITED: &str = "server check: waited after the run (s)";

/// How long [`check`] keeps looking for a leader that answers.
const LOOK: Duration = Duration::from_secs(30);
/// How long one member may take to say whether it leads.
const ASK: Duration = Duration::from_secs(3);
/// How long a fault's election may take, at most, for the wait: ours stand 1.5–2 s after
/// the last heartbeat, etcd's election timeout is 1 s, ZooKeeper's followers give up on a
/// frozen leader after `syncLimit` ticks (10 s here; a killed one at once).
const ELECTION: Duration = Duration::from_secs(12);
/// Beyond the lease: ZooKeeper expires sessions on a 2 s tick, etcd checks for expired
/// leases every 500 ms, ours proposes an expiry within a second.
const MARGIN: Duration = Duration::from_secs(5);

/// Sessions a run ends behind its clients' backs at its end (`--end-sessions-behind-back`,
/// a test hook): the server-side check must confirm exactly these lost.
pub static END_BEHIND_BACK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// This process's share of [`END_BEHIND_BACK`] when a run is split into `parts`.
pub fn behind_back_share(part: usize, parts: usize) -> usize {
    let k = END_BEHIND_BACK.load(std::sync::atomic::Ordering::Relaxed);
    k / parts + usize::from(part < k % parts)
}

/// Notes the hook's use in `r`.
pub fn note_behind_back(r: &mut Report) {
    let k = END_BEHIND_BACK.load(std::sync::atomic::Ordering::Relaxed);
    if k > 0 {
        r.param(
            "sessions ended behind loadgen's back at the end (test hook)",
            k,
        );
    }
}

/// What the server said about loadgen's sessions.
pub struct Check {
    /// Those it still holds.
    pub held: u64,
    /// Those it no longer holds.
    pub lost: u64,
    /// How the server was asked.
    pub how: &'static str,
}

/// Waits until every session that could still run out has: `lease` + a margin after the
/// later of the run's `end` and the `fault`'s election. Returns how long it waited.
pub async fn settle(lease: Duration, end: Instant, fault: Option<Instant>) -> Duration {
    let from = fault.map_or(end, |f| end.max(f + ELECTION));
    let until = from + lease + MARGIN;
    let now = Instant::now();
    let pb = crate::report::bar(
        until.saturating_duration_since(now).as_secs(),
        "waiting a lease before asking the server",
    );
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1).min(until - Instant::now())).await;
        pb.set_position(Instant::now().saturating_duration_since(now).as_secs());
    }
    pb.finish_and_clear();
    Instant::now().saturating_duration_since(end)
}

/// Which of `ids` (ours: session ids; etcd: lease ids; ZooKeeper: session ids) the leader
/// of `cluster` still holds. A member that does not answer within 3 s (a frozen one) is
/// skipped; looks for a leader for up to 30 s.
pub async fn check(cluster: &Cluster, ids: &[u64]) -> anyhow::Result<Check> {
    let deadline = Instant::now() + LOOK;
    let mut last = None;
    while Instant::now() < deadline {
        for m in &cluster.members {
            match check_at(cluster, m, ids).await {
                Ok(Some(held)) => {
                    return Ok(Check {
                        held,
                        lost: ids.len() as u64 - held,
                        how: how(cluster.system),
                    })
                }
                Ok(None) => {}
                Err(e) => last = Some(e),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match last {
        Some(e) => Err(e.context(format!("no leader answered within {LOOK:?}"))),
        None => anyhow::bail!("no leader answered within {LOOK:?}"),
    }
}

fn how(system: System) -> &'static str {
    match system {
        System::Ours => "a KeepAliveBatch of loadgen's session ids at the leader",
        System::Etcd => "LeaseTimeToLive of each of loadgen's leases at the leader",
        System::Zk => "the session ids in the leader's `dump`",
    }
}

/// How many of `ids` member `m` holds, if it is the leader (`None` if it is not, or does
/// not answer whether it is).
async fn check_at(cluster: &Cluster, m: &str, ids: &[u64]) -> anyhow::Result<Option<u64>> {
    match cluster.system {
        System::Ours => ours(cluster, m, ids).await,
        System::Etcd => etcd(m, ids).await,
        System::Zk => {
            let Some(srvr) = four_letter_within(m, "srvr", ASK).await else {
                return Ok(None);
            };
            if !srvr.contains("Mode: leader") {
                return Ok(None);
            }
            let dump = four_letter_within(m, "dump", Duration::from_secs(30))
                .await
                .ok_or_else(|| anyhow::anyhow!("the ZooKeeper leader {m} did not dump"))?;
            let listed = zk_dumped_sessions(&dump)?;
            Ok(Some(
                ids.iter().filter(|i| listed.contains(i)).count() as u64
            ))
        }
    }
}

async fn ours(cluster: &Cluster, m: &str, ids: &[u64]) -> anyhow::Result<Option<u64>> {
    use wire::types::{Op, Reply};
    let mut cfg = client_sdk::ClientConfig::new(vec![m.to_string()], cluster.ca.clone());
    cfg.connect_timeout = Duration::from_secs(1);
    cfg.attempt_timeout = Duration::from_secs(2);
    cfg.request_timeout = ASK;
    let Ok(c) = client_sdk::Client::connect(cfg).await else {
        return Ok(None);
    };
    let Ok(s) = c.status_of(m.parse()?).await else {
        return Ok(None);
    };
    if s.role != "Leader" {
        return Ok(None);
    }
    let mut held = 0;
    for chunk in ids.chunks(wire::KEEPALIVE_BATCH_MAX) {
        let op = Op::KeepAliveBatch {
            sessions: chunk.to_vec(),
        };
        match c.call_at(m.parse()?, &request(op)).await {
            Ok(Reply::KeepAliveBatch {
                renewed,
                expired,
                unknown,
                ..
            }) => {
                anyhow::ensure!(
                    renewed.len() + expired.len() + unknown.len() == chunk.len(),
                    "the leader answered for {} of {} sessions",
                    renewed.len() + expired.len() + unknown.len(),
                    chunk.len()
                );
                held += renewed.len() as u64;
            }
            Ok(other) => anyhow::bail!("unexpected answer to KeepAliveBatch: {other:?}"),
            // It stopped leading meanwhile: ask again.
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(held))
}

fn request(op: wire::types::Op) -> wire::types::Request {
    wire::types::Request {
        session: 0,
        request_id: 0,
        ack_below: 0,
        op,
    }
}

async fn etcd(m: &str, ids: &[u64]) -> anyhow::Result<Option<u64>> {
    use futures::StreamExt;
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(5));
    let Ok(mut c) = etcd_client::Client::connect([m], Some(opts)).await else {
        return Ok(None);
    };
    let Ok(st) = c.status().await else {
        return Ok(None);
    };
    if st.header().is_none_or(|h| h.member_id() != st.leader()) {
        return Ok(None);
    }
    // Each lease once (with --etcd-lease-per-client many sessions share one).
    let distinct: HashSet<u64> = ids.iter().copied().collect();
    let answers: Vec<(u64, anyhow::Result<bool>)> = futures::stream::iter(distinct)
        .map(|id| {
            let c = c.clone();
            async move { (id, lease_alive(c, id, m).await) }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let mut alive = HashSet::new();
    for (id, a) in answers {
        if a? {
            alive.insert(id);
        }
    }
    Ok(Some(ids.iter().filter(|i| alive.contains(i)).count() as u64))
}

/// Whether etcd still holds lease `id`: asked up to three times (a failed request again
/// after a second), and a TTL of 0 or less asked again a second later, since etcd 3.4
/// answers whole seconds and a live lease with under a second left reads 0.
async fn lease_alive(c: etcd_client::Client, id: u64, m: &str) -> anyhow::Result<bool> {
    let mut last = None;
    let mut low = 0;
    for _ in 0..3 {
        match c.clone().lease_time_to_live(id as i64, None).await {
            Ok(r) if r.ttl() > 0 => return Ok(true),
            // -1: not found; 0 or less twice: expired (not yet revoked) or about to.
            Ok(r) if r.ttl() < 0 => return Ok(false),
            Ok(_) => {
                low += 1;
                if low == 2 {
                    return Ok(false);
                }
            }
            Err(e) if e.to_string().contains("lease not found") => return Ok(false),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    match last {
        Some(e) => Err(anyhow::anyhow!("LeaseTimeToLive({id:x}) at {m}: {e}")),
        None => Ok(false),
    }
}

/// The session ids a ZooKeeper leader's `dump` lists (its "SessionTracker dump" section,
/// before "ephemeral nodes dump").
pub fn zk_dumped_sessions(dump: &str) -> anyhow::Result<HashSet<u64>> {
    let tracker = dump
        .split("ephemeral nodes dump")
        .next()
        .filter(|s| s.contains("SessionTracker dump"))
        .ok_or_else(|| anyhow::anyhow!("not a ZooKeeper dump: {:.200}", dump))?;
    let mut out = HashSet::new();
    for tok in tracker.split_whitespace() {
        if let Some(hex) = tok.strip_prefix("0x") {
            out.insert(u64::from_str_radix(hex, 16)?);
        }
    }
    Ok(out)
}

/// Adds what the server said (`check`, if it could be asked, after waiting `waited`) to
/// `r`: `should_hold` sessions loadgen opened and had not closed (`what` says which).
pub fn report(r: &mut Report, check: anyhow::Result<Check>, waited: Duration, what: &str) {
    r.figure(WAITED, waited.as_secs_f64());
    match check {
        Ok(c) => {
            r.figure(AT_SERVER, c.held as f64);
            r.figure(CONFIRMED_LOST, c.lost as f64);
            r.notes.push(format!(
                "server-side session check, {waited:.0?} after the run ended (a lease and \
                 a margin after it, or after the fault's election if later), the sessions \
                 renewed meanwhile as in the run, before loadgen closed any: {} of \
                 loadgen's {} sessions ({what}) asked by id, with {}; '{AT_SERVER}' is \
                 those it holds, '{CONFIRMED_LOST}' those it does not. 'sessions lost' is \
                 what loadgen's clients declared",
                c.held + c.lost,
                c.held + c.lost,
                c.how
            ));
        }
        Err(e) => r.notes.push(format!(
            "server-side session check failed: {e:#}; '{AT_SERVER}' and '{CONFIRMED_LOST}' \
             are missing"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaders_dump_lists_its_sessions_and_not_its_connections() {
        let dump = "SessionTracker dump:\nSession Sets (2)/(2):\n0 expire at Wed Dec 02 \
                    07:31:57 UTC 2026:\n\t0x10000aa896d0000\n1 expire at x:\n\t0x2a\n\
                    ephemeral nodes dump:\nSessions with Ephemerals (1):\n0x99:\n\t/a\n\
                    Connections dump:\n\tip: /127.0.0.1:56594 sessionId: 0x77\n";
        let got = zk_dumped_sessions(dump).unwrap();
        assert_eq!(got, HashSet::from([0x10000aa896d0000, 0x2a]));
        assert!(zk_dumped_sessions("Mode: follower").is_err());
    }
}
