//! Prometheus metrics, `/health` and `/ready` over HTTP (feature `server`): what a
//! replica, a proxy and the directory serve on their `metrics.listen` address
//! (`docs/operations.md`, "Metrics and alerts").
//!
//! A server implements [`Probe`]. Each scrape of `/metrics` builds a fresh [`Scrape`]: the
//! values a server reads at that moment (sessions, term, lag, ...) go in as constant
//! gauges and counters, and its live instruments (histograms and counters it updates as
//! it works, such as the fsync histogram) are registered by handle. `prometheus-client`
//! encodes them; every name starts with [`PREFIX`], counters end in `_total` and
//! durations are in seconds.
//!
//! - `GET /metrics`: 200 with the metrics: OpenMetrics text for a scraper whose `Accept`
//!   names it (Prometheus does), else Prometheus' text format 0.0.4.
//! - `GET /health`: 200 `ok` while the process serves at all.
//! - `GET /ready`: 200 with the reason when the server should take traffic (a replica: a
//!   member of its cell that knows a leader and has applied its log; a proxy: holds its
//!   own session at the cell; the directory: holds a map), else 503 with the reason.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry, Unit};

pub use prometheus_client;

/// Every metric's name starts with this and `_`.
pub const PREFIX: &str = "lockservice";

/// The content type of `/metrics` for a scraper that accepts OpenMetrics (Prometheus
/// does).
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of `/metrics` otherwise: Prometheus' text format 0.0.4 (`curl`,
/// `promtool check metrics`).
pub const PROMETHEUS_TEXT: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// A server's `[metrics]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// TCP address of the HTTP server for `/metrics` (Prometheus), `/health` and
    /// `/ready`, e.g. `0.0.0.0:9464`. None (the default): not served.
    pub listen: Option<SocketAddr>,
}

/// A boxed future, as [`Probe`]'s methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a server answers on its metrics port.
pub trait Probe: Send + Sync + 'static {
    /// The metrics of this moment.
    fn metrics(&self) -> BoxFuture<'_, Scrape>;
    /// `Ok(why)` when the server should take traffic, `Err(why not)` otherwise.
    fn ready(&self) -> BoxFuture<'_, Result<String, String>>;
}

/// `prometheus-client` ends every help text with a period: one written with its own
/// would end in two.
fn help_text(h: &str) -> &str {
    h.trim_end_matches('.')
}

/// One scrape's metrics under [`PREFIX`].
pub struct Scrape {
    registry: Registry,
}

impl Default for Scrape {
    fn default() -> Self {
        Scrape::new()
    }
}

/// When this process first served metrics (or built a scrape), Unix seconds.
static STARTED: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

fn started() -> f64 {
    *STARTED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    })
}

impl Scrape {
    /// A scrape with no labels of its own (the directory's), holding the process's
    /// `start_time_seconds` and `build_info`.
    pub fn new() -> Scrape {
        Scrape::with_registry(Registry::with_prefix(PREFIX))
    }

    /// A scrape whose every metric carries the label `cell` (replicas and proxies), so
    /// that rules and dashboards can tell cells apart however they are scraped.
    pub fn for_cell(cell: &str) -> Scrape {
        let labels = [(
            std::borrow::Cow::Borrowed("cell"),
            std::borrow::Cow::Owned(cell.to_string()),
        )];
        Scrape::with_registry(Registry::with_prefix_and_labels(PREFIX, labels.into_iter()))
    }

    fn with_registry(registry: Registry) -> Scrape {
        let mut s = Scrape { registry };
        s.gauge_in(
            "start_time",
            "When this process started serving metrics, Unix time (a change is a restart).",
            Unit::Seconds,
            started(),
        );
        s.labelled_gauge(
            "build_info",
            "1, labelled with this build's version.",
            "version",
            &[(env!("CARGO_PKG_VERSION").to_string(), 1.0)],
        );
        s
    }

    /// A value that goes up and down, read now (`name` without a unit suffix).
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.registry
            .register(name, help_text(help), ConstGauge::<f64>::new(value));
    }

    /// A gauge in `unit` (the name gets the unit's suffix, e.g. `_seconds`).
    pub fn gauge_in(&mut self, name: &str, help: &str, unit: Unit, value: f64) {
        self.registry.register_with_unit(
            name,
            help_text(help),
            unit,
            ConstGauge::<f64>::new(value),
        );
    }

    /// A count since the server started, read now (`name` without `_total`, which the
    /// encoding adds).
    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.registry
            .register(name, help_text(help), ConstCounter::<u64>::new(value));
    }

    /// One gauge per value of `label`.
    pub fn labelled_gauge(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: &[(String, f64)],
    ) {
        let family =
            Family::<Vec<(String, String)>, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        for (v, x) in values {
            family
                .get_or_create(&vec![(label.to_string(), v.clone())])
                .set(*x);
        }
        self.registry.register(name, help_text(help), family);
    }

    /// One counter per value of `label`.
    pub fn labelled_counter(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: &[(String, u64)],
    ) {
        let family =
            Family::<Vec<(String, String)>, prometheus_client::metrics::counter::Counter>::default(
            );
        for (v, x) in values {
            family
                .get_or_create(&vec![(label.to_string(), v.clone())])
                .inc_by(*x);
        }
        self.registry.register(name, help_text(help), family);
    }

    /// `tls_certificate_expiry_timestamp_seconds`: the earliest notAfter of the PEM chain
    /// at `cert` (every server reports its own, for the alert on certificates about to
    /// expire). A file that cannot be read leaves the metric out, with a warning.
    pub fn certificate_expiry(&mut self, cert: &std::path::Path) {
        match crate::tls::earliest_not_after(cert) {
            Ok(t) => self.gauge_in(
                "tls_certificate_expiry_timestamp",
                "Earliest notAfter of this process's certificate chain, Unix time.",
                Unit::Seconds,
                t as f64,
            ),
            Err(e) => tracing::warn!(error = %e, "the certificate's expiry for the metrics"),
        }
    }

    /// `limit_refusals_total{limit}` from [`crate::quota::Quotas::refusals`]
    /// (connections, requests, sessions).
    pub fn limit_refusals(&mut self, refused: [u64; 3]) {
        let [connections, requests, sessions] = refused;
        self.labelled_counter(
            "limit_refusals",
            "Refusals by the limits per identity, by limit.",
            "limit",
            &[
                ("connections".into(), connections),
                ("requests".into(), requests),
                ("sessions".into(), sessions),
            ],
        );
    }

    /// A live instrument (a clone of the server's handle: histograms and counters share
    /// their state between clones).
    pub fn live(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.registry.register(name, help_text(help), metric);
    }

    /// A live instrument in `unit`.
    pub fn live_in(&mut self, name: &str, help: &str, unit: Unit, metric: impl Metric) {
        self.registry
            .register_with_unit(name, help_text(help), unit, metric);
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; an encoding error would be a metric that
        // breaks the format, which the tests' scrape would catch.
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding the metrics failed");
        }
        out
    }

    /// The Prometheus text format (0.0.4).
    pub fn encode_prometheus(&self) -> String {
        let mut out = String::new();
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::warn!(error = %e, "encoding the metrics failed");
        }
        out
    }
}

/// A histogram of durations in seconds: `count` buckets from `first` seconds, each twice
/// the one before (e.g. 0.0001 s and 16 buckets reach 3.3 s).
pub fn seconds_histogram(first: f64, count: u16) -> Histogram {
    Histogram::new(exponential_buckets(first, 2.0, count))
}

/// A histogram of counts: buckets 1, 2, 4, ... up to `2^(count-1)`.
pub fn count_histogram(count: u16) -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, count))
}

/// Binds the metrics port, with an error that names the address.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("the metrics address {addr}: {e}"))
}

/// Serves `/metrics`, `/health` and `/ready` on `listener` until the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, probe: Arc<dyn Probe>) {
    started();
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::get;

    let metrics = {
        let probe = probe.clone();
        move |headers: axum::http::HeaderMap| {
            let probe = probe.clone();
            async move {
                let scrape = probe.metrics().await;
                let openmetrics = headers
                    .get_all(header::ACCEPT)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .any(|v| v.contains("application/openmetrics-text"));
                if openmetrics {
                    ([(header::CONTENT_TYPE, OPENMETRICS)], scrape.encode()).into_response()
                } else {
                    (
                        [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
                        scrape.encode_prometheus(),
                    )
                        .into_response()
                }
            }
        }
    };
    let ready = {
        let probe = probe.clone();
        move || {
            let probe = probe.clone();
            async move {
                match probe.ready().await {
                    Ok(why) => (StatusCode::OK, format!("ready: {why}\n")),
                    Err(why) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}\n"),
                    ),
                }
            }
        }
    };
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(error = %e, "the metrics server stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_names_units_and_totals_as_prometheus_expects() {
        let mut s = Scrape::for_cell("c1");
        s.gauge("sessions", "Open sessions.", 3.0);
        s.gauge_in("oldest_invalidation", "Age.", Unit::Seconds, 0.5);
        s.counter("keepalives", "KeepAlives.", 7);
        s.labelled_gauge(
            "follower_lag_entries",
            "Lag.",
            "follower",
            &[("2".into(), 4.0)],
        );
        let h = seconds_histogram(0.001, 4);
        h.observe(0.003);
        s.live_in("fsync", "fsyncs.", Unit::Seconds, h);
        let text = s.encode();
        for line in [
            "lockservice_sessions{cell=\"c1\"} 3.0",
            "lockservice_oldest_invalidation_seconds{cell=\"c1\"} 0.5",
            "lockservice_keepalives_total{cell=\"c1\"} 7",
            "lockservice_follower_lag_entries{cell=\"c1\",follower=\"2\"} 4.0",
            "lockservice_fsync_seconds_count{cell=\"c1\"} 1",
            "lockservice_fsync_seconds_bucket{cell=\"c1\",le=\"0.004\"} 1",
            "# HELP lockservice_sessions Open sessions.\n",
            "lockservice_build_info{cell=\"c1\",version=",
            "# EOF",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
    }
}
