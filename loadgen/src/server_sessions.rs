//! Lost sessions, one definition for all three systems, checked at the server at the end
//! of a run (issue 26).
//!
//! Each system's clients declare sessions lost in their own way (ours: the cell answered
//! expired/unknown, or the grace period ran out; etcd: the server answered a renewal with
//! TTL 0, its "lease not found"; ZooKeeper: the Rust client's own state), so next to that
//! figure every run that reports lost sessions also asks the server, before loadgen closes
//! any session, how many it holds:
//!
//! - **ours**: the leader's `Status.session_count`;
//! - **etcd**: the leases the leader lists (`LeaseLeases`);
//! - **ZooKeeper**: `zk_global_sessions` of the leader's `mntr`.
//!
//! "sessions the server confirms lost" is the sessions loadgen should still hold less
//! those the server holds (less the server's own sessions that are not loadgen's, such as
//! our proxies'), at least 0.

use std::time::Duration;
use tokio::time::Instant;

use crate::cluster::{four_letter, Cluster, System};
use crate::report::Report;

/// The name of the server's count in a report.
pub const AT_SERVER: &str = "sessions at the server at the end";
/// The name of the sessions the server confirms lost in a report.
pub const CONFIRMED_LOST: &str = "sessions the server confirms lost";

/// How long [`count`] keeps looking for a leader that answers.
const LOOK: Duration = Duration::from_secs(30);
/// How long one member may take to answer.
const ASK: Duration = Duration::from_secs(3);

/// The sessions (etcd: leases) the leader of `cluster` holds now; a member that does not
/// answer within 3 s (a frozen one) is skipped. Looks for up to 30 s.
pub async fn count(cluster: &Cluster) -> anyhow::Result<u64> {
    let deadline = Instant::now() + LOOK;
    while Instant::now() < deadline {
        for m in &cluster.members {
            let got = tokio::time::timeout(ASK, count_at(cluster, m)).await;
            if let Ok(Some(n)) = got {
                return Ok(n);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("no leader told its session count within {LOOK:?}")
}

/// The count at member `m` if it is the leader.
async fn count_at(cluster: &Cluster, m: &str) -> Option<u64> {
    match cluster.system {
        System::Ours => {
            let mut cfg = client_sdk::ClientConfig::new(vec![m.to_string()], cluster.ca.clone());
            cfg.connect_timeout = Duration::from_secs(1);
            cfg.attempt_timeout = Duration::from_secs(2);
            cfg.request_timeout = ASK;
            let c = client_sdk::Client::connect(cfg).await.ok()?;
            let s = c.status_of(m.parse().ok()?).await.ok()?;
            (s.role == "Leader").then_some(s.session_count)
        }
        System::Etcd => {
            let opts = etcd_client::ConnectOptions::new()
                .with_connect_timeout(Duration::from_secs(1))
                .with_timeout(Duration::from_secs(2));
            let mut c = etcd_client::Client::connect([m], Some(opts)).await.ok()?;
            let st = c.status().await.ok()?;
            if st.header().is_none_or(|h| h.member_id() != st.leader()) {
                return None;
            }
            Some(c.leases().await.ok()?.leases().len() as u64)
        }
        System::Zk => {
            if !four_letter(m, "srvr").await?.contains("Mode: leader") {
                return None;
            }
            Some(crate::state_peers::zk_mntr(m, "zk_global_sessions").await? as u64)
        }
    }
}

/// Adds the server's count (`at_server`, if it could be asked) and the sessions it
/// confirms lost to `r`: `should_hold` sessions loadgen opened and had not closed
/// (`what` says which), `others` sessions the server holds that are not loadgen's
/// (`others_what` says which).
pub fn report(
    r: &mut Report,
    at_server: anyhow::Result<u64>,
    should_hold: u64,
    what: &str,
    others: u64,
    others_what: &str,
) {
    let system = r.system.clone();
    let how = match system.as_str() {
        "ours" => "the leader's session count (Status.session_count)",
        "etcd" => "the leases the leader lists (LeaseLeases)",
        _ => "zk_global_sessions of the leader's mntr",
    };
    match at_server {
        Ok(n) => {
            r.figure(AT_SERVER, n as f64);
            r.figure(
                CONFIRMED_LOST,
                should_hold.saturating_sub(n.saturating_sub(others)) as f64,
            );
            r.notes.push(format!(
                "server-side session check: '{AT_SERVER}' is {how}, asked before loadgen \
                 closed any session: {n}; loadgen should still hold {should_hold} ({what}); \
                 the server's sessions that are not loadgen's: {others} ({others_what}); \
                 '{CONFIRMED_LOST}' = {should_hold} - ({n} - {others}), at least 0. A \
                 session whose lease had not yet run out at the server counts as held; \
                 'sessions lost' is what loadgen's clients declared"
            ));
        }
        Err(e) => r.notes.push(format!(
            "server-side session check failed ({how}): {e:#}; '{AT_SERVER}' and \
             '{CONFIRMED_LOST}' are missing"
        )),
    }
}

/// Our proxies' own sessions at the cell (each proxy holds one once it needs it); 0 for
/// the peers and for a cell without proxies.
pub async fn proxy_sessions(cluster: &Cluster) -> u64 {
    if cluster.system != System::Ours || cluster.endpoints == cluster.members {
        return 0;
    }
    let mut cfg = client_sdk::ClientConfig::new(cluster.endpoints.clone(), cluster.ca.clone());
    cfg.request_timeout = ASK;
    let Ok(c) = client_sdk::Client::connect(cfg).await else {
        return 0;
    };
    let mut n = 0;
    for p in &cluster.endpoints {
        let Ok(addr) = p.parse() else { continue };
        if let Ok(Ok(s)) = tokio::time::timeout(ASK, c.proxy_status_of(addr)).await {
            n += u64::from(s.session != 0);
        }
    }
    n
}
