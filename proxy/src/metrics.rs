//! The proxy's Prometheus metrics, `/health` and `/ready` (on `[metrics] listen`; names
//! and meanings in `docs/operations.md`, "Metrics and alerts"): its counters
//! ([`Proxy::status`]), read at each scrape.

use std::sync::Arc;

use wire::metrics::prometheus_client::registry::Unit;
use wire::metrics::{BoxFuture, Probe, Scrape};

use crate::server::Proxy;

/// The proxy's [`Probe`]. Ready while it holds its own session at the cell, renewed within
/// its lease (it reached
/// the leader and can renew its clients' sessions).
pub struct ProxyProbe(pub Arc<Proxy>);

impl Probe for ProxyProbe {
    fn metrics(&self) -> BoxFuture<'_, Scrape> {
        Box::pin(async move { self.scrape() })
    }

    fn ready(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            match self.0.up.session() {
                0 => Err("no session at the cell yet (its leader not reached)".into()),
                // Its own lease at the leader ran out unrenewed, and a lease more went by:
                // the cell is lost to it, and its clients are better served by another
                // proxy (`forward` answers them `Unavailable` meanwhile). The lease more
                // keeps a short lease, a fail-over or a slow renewal from flapping it.
                s if self
                    .0
                    .hub
                    .own_session_lapsed(tokio::time::Instant::now())
                    .is_some_and(|l| l >= self.0.hub.lease()) =>
                {
                    Err(format!(
                        "lost the cell: session {s} not renewed for over a lease"
                    ))
                }
                s => Ok(format!("session {s} at the cell")),
            }
        })
    }
}

impl ProxyProbe {
    fn scrape(&self) -> Scrape {
        let st = self.0.status();
        let mut s = Scrape::for_cell(&self.0.cell);
        s.gauge(
            "proxy_clients",
            "Client connections open now.",
            st.clients as f64,
        );
        s.gauge(
            "proxy_sessions",
            "Client sessions this proxy renews.",
            st.sessions as f64,
        );
        s.counter(
            "proxy_keepalive_batches",
            "Batched KeepAlive RPCs sent to the leader.",
            st.keepalive_batches,
        );
        s.counter(
            "proxy_keepalives_batched",
            "Client KeepAlives carried by those batches.",
            st.keepalives_batched,
        );
        s.counter(
            "proxy_cache_hits",
            "Cached reads answered from the proxy's cache.",
            st.cache_hits,
        );
        s.counter(
            "proxy_upstream_reads",
            "Reads forwarded to the cell (plain, watched and cached reads).",
            st.upstream_reads,
        );
        s.counter(
            "proxy_upstream_writes",
            "Requests other than reads and KeepAlives forwarded to the cell.",
            st.upstream_writes,
        );
        s.counter(
            "proxy_invalidations_relayed",
            "Invalidations relayed to clients.",
            st.invalidations_relayed,
        );
        s.counter(
            "proxy_watch_events_relayed",
            "Watch events delivered to clients.",
            st.watch_events_relayed,
        );
        s.gauge(
            "proxy_upstream_watches",
            "(node, kind) watches this proxy holds at the leader.",
            st.upstream_watches as f64,
        );
        s.gauge(
            "proxy_pending_invalidations",
            "Invalidations relayed to clients and not yet acknowledged by all of them.",
            st.pending_invalidations as f64,
        );
        s.gauge_in(
            "proxy_oldest_pending_invalidation",
            "Age of the oldest of them (0 if none).",
            Unit::Seconds,
            st.oldest_pending_ms as f64 / 1000.0,
        );
        s.limit_refusals(st.refused_by_limit);
        s.certificate_expiry(&self.0.cfg.tls.cert);
        s
    }
}
