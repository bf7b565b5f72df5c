//! Is the peer still there? Each connection's watcher notes when it last received a
//! datagram; a request that has waited a second on a silent peer probes it, and a probe
//! unanswered for another second gives the connection up (QUIC alone would notice only at
//! its idle timeout). While the probe waits, the client asks the cell's other replicas
//! who leads: one that leads in the newest term any of them reports gives the silent
//! connection up at once, the moment the cell has elected it.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use wire::types::Op;

/// When a connection last received anything, as its watcher ([`watch_heard`]) noticed
/// (at most [`HEARD_POLL`] late, or later if the runtime stalled), and its count of
/// received datagrams then.
pub(super) type Heard = Arc<std::sync::Mutex<(Instant, u64)>>;

/// How often a connection's watcher looks at its received-datagram count.
const HEARD_POLL: Duration = Duration::from_millis(100);

/// Records in `heard` when `conn` last received a datagram, until the connection closes or
/// its slot lets go of `heard` (the connection was replaced, or the client dropped).
pub(super) async fn watch_heard(
    conn: quinn::Connection,
    heard: std::sync::Weak<std::sync::Mutex<(Instant, u64)>>,
) {
    let mut seen = conn.stats().udp_rx.datagrams;
    loop {
        tokio::time::sleep(HEARD_POLL).await;
        let Some(heard) = heard.upgrade() else {
            return;
        };
        if conn.close_reason().is_some() {
            return;
        }
        let n = conn.stats().udp_rx.datagrams;
        if n != seen {
            seen = n;
            *heard.lock().expect("heard lock") = (Instant::now(), n);
        }
    }
}

/// A request waiting this long makes the client probe its connection.
const PROBE_AFTER: Duration = Duration::from_secs(1);
/// A request waits at least this long before its connection may be probed (its peer
/// silent for [`PROBE_AFTER`] by then, counted from the last datagram).
const PROBE_MIN_WAIT: Duration = Duration::from_millis(300);
/// Silence announcements kept for a slow receiver of [`Client::silences`].
pub(super) const SILENCES_QUEUED: usize = 64;

/// Why [`presumed_dead`] gave a connection up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Silent, and its probe went unanswered too.
    Dead,
    /// Silent, and the replica at this address leads in the newest term any replica
    /// reported (see [`super::Client::newer_leader`]).
    Superseded(std::net::SocketAddr),
}

/// Completes only if `conn`'s peer looks dead: while a request waits (a held write may
/// legitimately take seconds), the connection is watched. A peer that sent anything at
/// all in the last second (answers, acknowledgements) is alive, however slow it is under
/// load. Once the peer has been silent for a second (`heard`: when the connection last
/// received anything) and the request has waited at least [`PROBE_MIN_WAIT`], it is
/// probed with a cheap
/// request (`ProxyStatus`: a proxy answers it itself, a replica refuses it at once; either
/// answer proves the peer alive); no answer and still nothing received within
/// `probe_timeout` means the peer is gone (killed or frozen), which QUIC alone would
/// notice only at its idle timeout. The silence is measured from the last datagram, not
/// in whole seconds from the request's start: a request sent just before its peer died
/// used to see the last answers in its first second and probe only after its second (a
/// fail-over's first second lost). `silent` is called each time a probe is about to be
/// sent.
///
/// Beside each probe runs `newer(silence)`, the search for another leader (`silence`:
/// when the connection last received anything, which names this silence for every
/// request waiting on it): if it finds one before the probe is answered, the connection
/// is given up at once ([`Verdict::Superseded`]); if it finds none (or is not run: `None`
/// at once, for a proxy), the probe decides alone.
pub(super) async fn presumed_dead<N, F>(
    conn: &quinn::Connection,
    heard: &Heard,
    probe_timeout: Duration,
    silent: impl Fn(),
    newer: N,
) -> Verdict
where
    N: Fn(Instant) -> F,
    F: std::future::Future<Output = Option<std::net::SocketAddr>>,
{
    let received = || conn.stats().udp_rx.datagrams;
    let mut since = Instant::now();
    loop {
        let (last, count) = *heard.lock().expect("heard lock");
        // A request sent after its peer fell silent probes once the silence is a second
        // old (after a short wait of its own), not a second after it was sent: a proxy
        // whose next batch left after the leader's kill gave it up a second later than
        // the others, and the new leader's writes waited for it.
        let due = (since + PROBE_MIN_WAIT).max(last + PROBE_AFTER);
        if Instant::now() < due {
            tokio::time::sleep_until(due).await;
            continue;
        }
        let seen = received();
        if seen != count {
            // Something arrived that the watcher has not noted yet (it runs every 100 ms,
            // later if the runtime stalled): not silent; count the second from now.
            *heard.lock().expect("heard lock") = (Instant::now(), seen);
            continue;
        }
        tracing::debug!(peer = %conn.remote_address(), silent_ms = last.elapsed().as_millis() as u64, "peer silent: probing");
        silent();
        let req = super::sessionless(Op::ProxyStatus);
        let probe = super::exchange(conn, &req);
        // The search ends with the probe: an answered probe means the peer is alive, and
        // an unanswered one gives the connection up anyway.
        let answered = tokio::select! {
            r = tokio::time::timeout(probe_timeout, probe) => matches!(r, Ok(Ok(_))),
            Some(leader) = newer(last) => {
                tracing::debug!(peer = %conn.remote_address(), %leader, "peer silent and another replica leads in the newest term the replicas report");
                return Verdict::Superseded(leader);
            }
        };
        let now_seen = received();
        if !answered && now_seen == seen {
            tracing::debug!(peer = %conn.remote_address(), "probe unanswered: peer presumed dead");
            return Verdict::Dead;
        }
        tracing::debug!(peer = %conn.remote_address(), answered, datagrams = now_seen - seen, "probe: peer alive");
        // Alive: a fresh second before the next look.
        since = Instant::now();
    }
}
