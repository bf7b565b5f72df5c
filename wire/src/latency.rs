//! Server-side request latencies: how long a replica or a proxy took to answer each kind
//! of request, from the moment its request stream was accepted to the moment the answer
//! was ready.
//!
//! A server keeps one [`Recorder`]; [`crate::types::Status`] and
//! [`crate::types::ProxyStatus`] carry its [`Recorder::snapshot`]: one [`OpLatency`] per
//! [`crate::types::Op::name`], each a cumulative HdrHistogram of microseconds since the
//! server started. Two snapshots taken a while apart give the latencies of that while
//! ([`OpLatency::since`]), so a load generator (or an operator) can tell the time a
//! request spent at the leader from the time it spent at a proxy and in the client.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The largest latency recorded as itself, in microseconds (one hour); longer ones are
/// recorded as this.
pub const LATENCY_US_MAX: u64 = 3_600_000_000;

/// Significant decimal digits the histograms keep (values are within 1 % of the truth).
const SIGNIFICANT_DIGITS: u8 = 2;

/// Latencies of one kind of request at one server.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpLatency {
    /// The request kind ([`crate::types::Op::name`], e.g. `Create`).
    pub op: String,
    /// Every latency recorded since the server started, in microseconds: an HdrHistogram
    /// in its V2 serialization (read it with [`OpLatency::histogram`]).
    pub histogram: Vec<u8>,
}

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Requests recorded.
    pub count: u64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl OpLatency {
    /// The histogram (microseconds). Fails on bytes that are not a V2 histogram.
    pub fn histogram(&self) -> Result<Histogram<u64>, String> {
        Deserializer::new()
            .deserialize(&mut self.histogram.as_slice())
            .map_err(|e| format!("latency histogram of {}: {e:?}", self.op))
    }

    /// What was recorded after `earlier` (a snapshot of the same server taken before this
    /// one); everything recorded, when `earlier` is `None` (e.g. the op was not seen yet).
    pub fn since(&self, earlier: Option<&OpLatency>) -> Result<Histogram<u64>, String> {
        let mut h = self.histogram()?;
        if let Some(e) = earlier {
            let e = e.histogram()?;
            // A server that restarted between the two snapshots starts from zero.
            if h.subtract(&e).is_err() {
                return self.histogram();
            }
        }
        Ok(h)
    }
}

/// Shows the summary, not the histogram's bytes.
impl std::fmt::Debug for OpLatency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("OpLatency");
        d.field("op", &self.op);
        match self.histogram() {
            Ok(h) => d.field("since_start", &summarize(&h)),
            Err(e) => d.field("histogram", &e),
        };
        d.finish()
    }
}

/// Summarizes a histogram of microseconds.
pub fn summarize(h: &Histogram<u64>) -> LatencySummary {
    let ms = |us: u64| us as f64 / 1e3;
    LatencySummary {
        count: h.len(),
        p50_ms: ms(h.value_at_quantile(0.5)),
        p99_ms: ms(h.value_at_quantile(0.99)),
        max_ms: ms(h.max()),
    }
}

/// Finds `op` in a snapshot.
pub fn find<'a>(snapshot: &'a [OpLatency], op: &str) -> Option<&'a OpLatency> {
    snapshot.iter().find(|l| l.op == op)
}

/// One histogram per request kind, shared by a server's request tasks.
#[derive(Debug, Default)]
pub struct Recorder {
    by_op: Mutex<BTreeMap<&'static str, Histogram<u64>>>,
}

impl Recorder {
    /// Records that a request of kind `op` took `took`.
    pub fn record(&self, op: &'static str, took: Duration) {
        let us = (took.as_micros() as u64).clamp(1, LATENCY_US_MAX);
        let mut by_op = self.by_op.lock().expect("latency recorder lock");
        let h = by_op.entry(op).or_insert_with(|| {
            Histogram::new_with_bounds(1, LATENCY_US_MAX, SIGNIFICANT_DIGITS)
                .expect("valid histogram bounds")
        });
        // Within bounds (clamped above), so this cannot fail.
        let _ = h.record(us);
    }

    /// Every kind recorded so far, in name order.
    pub fn snapshot(&self) -> Vec<OpLatency> {
        let by_op = self.by_op.lock().expect("latency recorder lock").clone();
        by_op
            .into_iter()
            .map(|(op, h)| {
                let mut histogram = Vec::new();
                V2Serializer::new()
                    .serialize(&h, &mut histogram)
                    .expect("a histogram serializes to memory");
                OpLatency {
                    op: op.to_string(),
                    histogram,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_round_trips_and_two_give_the_latencies_between_them() {
        let r = Recorder::default();
        for ms in [1, 2, 3] {
            r.record("Create", Duration::from_millis(ms));
        }
        r.record("Delete", Duration::from_micros(0));
        let first = r.snapshot();
        assert_eq!(
            first.iter().map(|l| l.op.as_str()).collect::<Vec<_>>(),
            ["Create", "Delete"]
        );
        for _ in 0..99 {
            r.record("Create", Duration::from_millis(100));
        }
        r.record("Create", Duration::from_secs(7200));
        let second = r.snapshot();

        let all = summarize(&find(&second, "Create").unwrap().since(None).unwrap());
        assert_eq!(all.count, 103);
        let between = find(&second, "Create")
            .unwrap()
            .since(find(&first, "Create"))
            .unwrap();
        let s = summarize(&between);
        assert_eq!(s.count, 100);
        assert!((s.p50_ms - 100.0).abs() < 1.0, "{s:?}");
        // Longer than the bound: recorded as the bound.
        assert!((s.max_ms - LATENCY_US_MAX as f64 / 1e3).abs() / s.max_ms < 0.01);
        // A zero latency counts as 1 µs, not lost.
        assert_eq!(
            summarize(&find(&second, "Delete").unwrap().since(None).unwrap()).count,
            1
        );
    }

    #[test]
    fn an_earlier_snapshot_of_a_restarted_server_is_ignored() {
        let before = Recorder::default();
        for _ in 0..10 {
            before.record("Create", Duration::from_millis(5));
        }
        let after = Recorder::default();
        after.record("Create", Duration::from_millis(5));
        let h = find(&after.snapshot(), "Create")
            .unwrap()
            .since(find(&before.snapshot(), "Create"))
            .unwrap();
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn garbage_bytes_are_an_error_not_a_panic() {
        let l = OpLatency {
            op: "Create".into(),
            histogram: vec![0xde, 0xad, 0xbe, 0xef],
        };
        let e = l.histogram().unwrap_err();
        assert!(e.contains("Create"), "{e}");
    }
}
