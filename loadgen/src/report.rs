//! Results: HDR latency summaries, figures, process costs; printed as a table, written as
//! JSON, and drawn as a latency-over-time SVG chart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::time::Instant;

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// Latencies of one kind of operation, and when each happened.
pub struct Lat {
    hist: Histogram<u64>,
    series: Vec<(f64, f64)>,
    start: Instant,
}

/// A [`Lat`] sent between loadgen processes (see [`Lat::to_part`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatPart {
    hist: Vec<u8>,
    series: Vec<(f64, f64)>,
}

/// Percentiles of a [`Lat`], in milliseconds, and how many of the operation failed.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Operations that succeeded (the percentiles are over these).
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    /// Operations that failed, not in the percentiles (absent where loadgen does not
    /// count them: a server's own timings, a probe, a renewal the client retries itself).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<u64>,
}

impl Lat {
    /// Empty; times in the series count from `start`.
    pub fn new(start: Instant) -> Lat {
        Lat {
            hist: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds"),
            series: Vec::new(),
            start,
        }
    }

    /// Records one latency that ended at `at`.
    pub fn record(&mut self, d: Duration, at: Instant) {
        let us = (d.as_micros() as u64).clamp(1, 3_600_000_000);
        let _ = self.hist.record(us);
        if self.series.len() < 200_000 {
            self.series.push((
                at.duration_since(self.start).as_secs_f64(),
                d.as_secs_f64() * 1e3,
            ));
        }
    }

    /// Adds everything recorded in `other`.
    pub fn merge(&mut self, other: &Lat) {
        let _ = self.hist.add(&other.hist);
        self.series.extend_from_slice(&other.series);
    }

    /// What another process needs to merge this one: the histogram in HdrHistogram's V2
    /// encoding and the series (seconds since this one's start).
    pub fn to_part(&self) -> LatPart {
        let mut hist = Vec::new();
        use hdrhistogram::serialization::Serializer as _;
        hdrhistogram::serialization::V2Serializer::new()
            .serialize(&self.hist, &mut hist)
            .expect("a histogram serializes to memory");
        LatPart {
            hist,
            series: self.series.clone(),
        }
    }

    /// A [`Lat`] from another process's [`Lat::to_part`], its series counted from `start`.
    pub fn from_part(p: &LatPart, start: Instant) -> anyhow::Result<Lat> {
        let hist = hdrhistogram::serialization::Deserializer::new()
            .deserialize(&mut p.hist.as_slice())
            .map_err(|e| anyhow::anyhow!("a latency histogram from a loadgen part: {e:?}"))?;
        Ok(Lat {
            hist,
            series: p.series.clone(),
            start,
        })
    }

    /// The latencies that ended `from` or later after the start (from the series, which
    /// holds the first 200 000 recorded): a run's steady state without its warm-up.
    pub fn since(&self, from: Duration) -> Lat {
        self.between(from, Duration::MAX)
    }

    /// The latencies that ended in `[from, to)` after the start (from the series, as
    /// [`Lat::since`]): the moments around a fault.
    pub fn between(&self, from: Duration, to: Duration) -> Lat {
        let mut some = Lat::new(self.start);
        let (from, to) = (from.as_secs_f64(), to.as_secs_f64());
        for &(at, ms) in self.series.iter().filter(|(at, _)| *at >= from && *at < to) {
            let _ = some
                .hist
                .record(((ms * 1e3) as u64).clamp(1, 3_600_000_000));
            some.series.push((at, ms));
        }
        some
    }

    /// The instant the series' times count from.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Number recorded.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The percentiles.
    pub fn summary(&self) -> Summary {
        summary_of(&self.hist)
    }
}

/// Percentiles of a histogram of microseconds, in milliseconds.
pub fn summary_of(hist: &Histogram<u64>) -> Summary {
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1e3;
    Summary {
        count: hist.len(),
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        p999: q(0.999),
        max: hist.max() as f64 / 1e3,
        failed: None,
    }
}

/// CPU and memory of one process of the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcCost {
    pub name: String,
    pub cpu_secs: f64,
    pub peak_rss_mb: f64,
    /// Seconds its threads were ready to run but waited for a CPU (Linux schedstat; live
    /// threads only): how much the machine's other load delayed it.
    #[serde(default)]
    pub cpu_wait_secs: f64,
}

/// An error as a failure's reason: its first line, numbers left out (so that like errors
/// count together), at most 160 characters.
pub fn reason_of(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .filter(|c| !c.is_ascii_digit())
        .take(160)
        .collect()
}

/// This process's cost so far, with its peak RSS reset to what it holds now
/// (`/proc/self/clear_refs`): a run's own cost is the cost at its end less this. One
/// loadgen process makes every run of `--runs` and `compare`, and `/proc` counts from the
/// process's start.
pub fn own_cost_from_here() -> Option<ProcCost> {
    // Best effort: without it the peak is the process's, which the report then says.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    proc_cost("loadgen", std::process::id())
}

/// Reads a live process's CPU seconds (user + system) and peak RSS from `/proc`.
pub fn proc_cost(name: &str, pid: u32) -> Option<ProcCost> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ProcCost {
        name: name.to_string(),
        cpu_secs: ticks / hz,
        peak_rss_mb: status_mb(pid, "VmHWM:")?,
        cpu_wait_secs: cpu_wait_secs(pid).unwrap_or(0.0),
    })
}

/// The time a live process's threads spent runnable on a run queue, waiting for a CPU: the
/// second field of each `/proc/<pid>/task/<tid>/schedstat`, in nanoseconds.
fn cpu_wait_secs(pid: u32) -> Option<f64> {
    let mut ns = 0u64;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(t) = t else { continue };
        let Ok(stat) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        ns += stat
            .split_whitespace()
            .nth(1)
            .and_then(|w| w.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(ns as f64 / 1e9)
}

/// A live process's resident memory now (VmRSS), in MB.
pub fn rss_mb(pid: u32) -> Option<f64> {
    status_mb(pid, "VmRSS:")
}

/// A kB field of `/proc/<pid>/status` (e.g. `VmRSS:`), in MB.
fn status_mb(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// One scenario's result for one system.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub system: String,
    pub scale: f64,
    /// What was run (sessions, connections, processes, durations).
    pub params: BTreeMap<String, String>,
    /// Single figures (throughput, times, counts).
    pub figures: BTreeMap<String, f64>,
    /// Latency summaries by operation.
    pub latencies: BTreeMap<String, Summary>,
    pub processes: Vec<ProcCost>,
    pub notes: Vec<String>,
    /// Latency over time per operation: (seconds, worst latency in ms) per time bucket.
    pub series: BTreeMap<String, Vec<(f64, f64)>>,
    /// How many runs this report summarizes (`--runs`): with more than one, every figure
    /// and latency percentile is the median of the runs, `failed` the sum, and `ranges`
    /// holds each one's lowest and highest.
    #[serde(skip_serializing_if = "is_one")]
    pub runs: usize,
    /// Per figure (by name) and per latency statistic (`<latency> p50`, `p99`, `max`,
    /// `failed`): the lowest and highest of the runs.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub ranges: BTreeMap<String, (f64, f64)>,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// The median of `v` (the mean of the middle two for an even count); `v` is not empty.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// True for a figure that counts something that went wrong (sessions lost, errors,
/// failures): repeated runs report its sum, never a median that could hide one bad run.
fn counts_harm(name: &str) -> bool {
    ["lost", "error", "failed", "not taken", "jeopardy"]
        .iter()
        .any(|w| name.contains(w))
}

/// The lowest and highest of `v`.
fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(*x), hi.max(*x))
        })
}

impl Report {
    /// One report for repeated runs of the same scenario on the same system: each figure
    /// and each latency percentile the median of the runs that have it (with its range
    /// in [`Report::ranges`]), `failed` summed over the runs (its range per run too),
    /// the first run's parameters and processes, every run's notes once.
    pub fn median_of(runs: &[Report]) -> Report {
        let first = &runs[0];
        if runs.len() == 1 {
            return first.clone();
        }
        let mut r = Report::new(&first.scenario, &first.system, first.scale);
        r.params = first.params.clone();
        r.param("runs", runs.len());
        r.processes = first.processes.clone();
        r.series = first.series.clone();
        r.runs = runs.len();
        let fig_keys: std::collections::BTreeSet<&String> =
            runs.iter().flat_map(|x| x.figures.keys()).collect();
        for k in fig_keys {
            let mut v: Vec<f64> = runs
                .iter()
                .filter_map(|x| x.figures.get(k))
                .copied()
                .collect();
            r.ranges.insert(k.clone(), range(&v));
            let total = if counts_harm(k) {
                v.iter().sum()
            } else {
                median(&mut v)
            };
            r.figures.insert(k.clone(), total);
        }
        let lat_keys: std::collections::BTreeSet<&String> =
            runs.iter().flat_map(|x| x.latencies.keys()).collect();
        for k in lat_keys {
            let all: Vec<&Summary> = runs.iter().filter_map(|x| x.latencies.get(k)).collect();
            let stat = |f: fn(&Summary) -> f64| -> Vec<f64> { all.iter().map(|s| f(s)).collect() };
            let mut pick = |name: &str, f: fn(&Summary) -> f64| {
                let mut v = stat(f);
                r.ranges.insert(format!("{k} {name}"), range(&v));
                median(&mut v)
            };
            let summary = Summary {
                count: pick("count", |s| s.count as f64) as u64,
                p50: pick("p50", |s| s.p50),
                p90: pick("p90", |s| s.p90),
                p99: pick("p99", |s| s.p99),
                p999: pick("p99.9", |s| s.p999),
                max: pick("max", |s| s.max),
                failed: if all.iter().any(|s| s.failed.is_some()) {
                    let v: Vec<f64> = all.iter().map(|s| s.failed.unwrap_or(0) as f64).collect();
                    r.ranges.insert(format!("{k} failed"), range(&v));
                    Some(v.iter().sum::<f64>() as u64)
                } else {
                    None
                },
            };
            r.latencies.insert(k.clone(), summary);
        }
        for x in runs {
            for n in &x.notes {
                if !r.notes.contains(n) {
                    r.notes.push(n.clone());
                }
            }
        }
        r.notes.insert(
            0,
            format!(
                "median of {} runs (each run's report in run-1 ... run-{}); a latency's \
                 count and percentiles are the runs' medians, its failed the sum over the \
                 runs; a figure that counts losses, errors or failures (its name has \
                 'lost', 'error', 'failed', 'not taken' or 'jeopardy') is the sum over the \
                 runs, every other the median; ranges are the lowest and highest run; the \
                 chart is the first run's",
                runs.len(),
                runs.len()
            ),
        );
        r
    }
}

/// Buckets of a chart: enough to show a stall, few enough for a small SVG.
const CHART_BUCKETS: f64 = 400.0;

/// The worst latency per time bucket.
fn bucketed(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let t_max = points.iter().map(|p| p.0).fold(0.0f64, f64::max);
    let width = (t_max / CHART_BUCKETS).max(0.01);
    let mut worst: BTreeMap<u64, f64> = BTreeMap::new();
    for (t, ms) in points {
        let b = (t / width) as u64;
        let w = worst.entry(b).or_insert(0.0);
        *w = w.max(*ms);
    }
    worst
        .into_iter()
        .map(|(b, ms)| ((b as f64 + 0.5) * width, ms))
        .collect()
}

impl Report {
    /// An empty report.
    pub fn new(scenario: &str, system: &str, scale: f64) -> Report {
        Report {
            scenario: scenario.into(),
            system: system.into(),
            scale,
            params: BTreeMap::new(),
            figures: BTreeMap::new(),
            latencies: BTreeMap::new(),
            processes: Vec::new(),
            notes: Vec::new(),
            series: BTreeMap::new(),
            runs: 1,
            ranges: BTreeMap::new(),
        }
    }

    /// Notes a parameter.
    pub fn param(&mut self, k: &str, v: impl ToString) {
        self.params.insert(k.into(), v.to_string());
    }

    /// Notes a figure.
    pub fn figure(&mut self, k: &str, v: f64) {
        self.figures.insert(k.into(), v);
    }

    /// Adds a latency distribution (and its series for the chart).
    pub fn latency(&mut self, k: &str, lat: &Lat) {
        self.latencies.insert(k.into(), lat.summary());
        self.series.insert(k.into(), bucketed(&lat.series));
    }

    /// Adds a latency distribution of an operation and how many of it failed (next to
    /// the count of those that succeeded, which the percentiles are over).
    pub fn latency_failed(&mut self, k: &str, lat: &Lat, failed: u64) {
        self.latency(k, lat);
        if let Some(s) = self.latencies.get_mut(k) {
            s.failed = Some(failed);
        }
    }

    /// Adds a latency distribution measured by a server (a histogram of microseconds from
    /// its status): in the table and the JSON, not in the chart.
    pub fn server_latency(&mut self, k: &str, hist: &Histogram<u64>) {
        self.latencies.insert(k.into(), summary_of(hist));
    }

    /// Prints the summary table.
    pub fn print(&self) {
        println!(
            "\n== {} on {} (scale {}) ==",
            self.scenario, self.system, self.scale
        );
        for (k, v) in &self.params {
            println!("  {k:<28} {v}");
        }
        if !self.latencies.is_empty() {
            println!(
                "  {:<22} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}  (ms)",
                "latency", "count", "failed", "p50", "p90", "p99", "p99.9", "max"
            );
            for (k, s) in &self.latencies {
                let failed = s.failed.map_or("-".to_string(), |n| n.to_string());
                println!(
                    "  {:<22} {:>8} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                    k, s.count, failed, s.p50, s.p90, s.p99, s.p999, s.max
                );
                if self.runs > 1 {
                    let rg = |stat: &str| {
                        self.ranges
                            .get(&format!("{k} {stat}"))
                            .map_or("-".to_string(), |(lo, hi)| format!("{lo:.2}-{hi:.2}"))
                    };
                    println!(
                        "  {:<22} range over {} runs: p50 {}, p99 {}, max {}, failed per run {}",
                        "",
                        self.runs,
                        rg("p50"),
                        rg("p99"),
                        rg("max"),
                        rg("failed")
                    );
                }
            }
        }
        for (k, v) in &self.figures {
            match self.ranges.get(k) {
                Some((lo, hi)) if self.runs > 1 => {
                    println!("  {k:<28} {v:.2}   (runs {lo:.2}-{hi:.2})")
                }
                _ => println!("  {k:<28} {v:.2}"),
            }
        }
        for p in &self.processes {
            println!(
                "  process {:<20} cpu {:>8.2} s   waited for a cpu {:>8.2} s   peak rss {:>8.1} MB",
                p.name, p.cpu_secs, p.cpu_wait_secs, p.peak_rss_mb
            );
        }
        for n in &self.notes {
            println!("  note: {n}");
        }
    }

    /// Writes `<out>/<scenario>-<system>.json` and `.svg`; returns their paths.
    pub fn write(&self, out: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
        std::fs::create_dir_all(out)?;
        let base = out.join(format!("{}-{}", self.scenario, self.system));
        let json = base.with_extension("json");
        std::fs::write(&json, serde_json::to_string_pretty(self)?)?;
        let svg = base.with_extension("svg");
        self.chart(&svg)?;
        Ok((json, svg))
    }

    fn chart(&self, path: &Path) -> anyhow::Result<()> {
        use plotters::prelude::*;
        let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let t_max = self
            .series
            .values()
            .flat_map(|s| s.iter().map(|p| p.0))
            .fold(1.0f64, f64::max);
        let y_max = self
            .series
            .values()
            .flat_map(|s| s.iter().map(|p| p.1))
            .fold(1.0f64, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "{} on {}: latency over time (ms)",
                    self.scenario, self.system
                ),
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(48)
            .build_cartesian_2d(0.0..t_max * 1.02, 0.0..y_max * 1.05)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc("ms")
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
        for (i, (name, s)) in self.series.iter().enumerate() {
            let c = colors[i % colors.len()];
            chart
                .draw_series(
                    s.iter()
                        .map(|(t, ms)| Circle::new((*t, *ms), 1, c.filled())),
                )
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .label(name.clone())
                .legend(move |(x, y)| Circle::new((x, y), 3, c.filled()));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }
}

/// Prints one table comparing the same scenario on several systems, with ratios to the
/// first (ours): for latencies and times, above 1 means the peer is slower. Rows are the
/// first report's keys, then any key only a later report has (a peer's own figure).
pub fn compare(reports: &[Report]) {
    let Some(first) = reports.first() else { return };
    println!("\n== compare: {} ==", first.scenario);
    let mut rows: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    let mut lat_keys: Vec<&String> = first.latencies.keys().collect();
    let mut fig_keys: Vec<&String> = first.figures.keys().collect();
    for r in &reports[1..] {
        for k in r.latencies.keys() {
            if !lat_keys.contains(&k) {
                lat_keys.push(k);
            }
        }
        for k in r.figures.keys() {
            if !fig_keys.contains(&k) {
                fig_keys.push(k);
            }
        }
    }
    for k in lat_keys {
        for (label, pick) in [("p50", 0), ("p99", 1), ("max", 2)] {
            let vals = reports
                .iter()
                .map(|r| {
                    r.latencies.get(k).map(|s| match pick {
                        0 => s.p50,
                        1 => s.p99,
                        _ => s.max,
                    })
                })
                .collect();
            rows.push((format!("{k} {label} (ms)"), vals));
        }
        if reports
            .iter()
            .any(|r| r.latencies.get(k).is_some_and(|s| s.failed.is_some()))
        {
            let vals = reports
                .iter()
                .map(|r| r.latencies.get(k)?.failed.map(|n| n as f64))
                .collect();
            rows.push((format!("{k} failed"), vals));
        }
    }
    for k in fig_keys {
        rows.push((
            k.clone(),
            reports.iter().map(|r| r.figures.get(k).copied()).collect(),
        ));
    }
    let w = rows.iter().map(|(name, _)| name.len()).fold(34, usize::max);
    let mut header = format!("  {:<w$}", "metric");
    for r in reports {
        header += &format!(" {:>12}", r.system);
    }
    for r in &reports[1..] {
        header += &format!(" {:>12}", format!("{}/{}", r.system, first.system));
    }
    println!("{header}");
    for (name, vals) in rows {
        let mut line = format!("  {name:<w$}");
        for v in &vals {
            line += &match v {
                Some(v) => format!(" {v:>12.2}"),
                None => format!(" {:>12}", "-"),
            };
        }
        for v in &vals[1..] {
            line += &match (v, vals[0]) {
                (Some(v), Some(base)) if base > 0.0 => format!(" {:>12.2}", v / base),
                _ => format!(" {:>12}", "-"),
            };
        }
        println!("{line}");
    }
}

/// A progress bar on stderr (hidden in a profile's parts: other loadgen processes would
/// draw over their parent's bars).
pub(crate) fn bar(len: u64, what: &str) -> ProgressBar {
    if std::env::var_os("LOADGEN_NO_PROGRESS").is_some() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {elapsed}")
            .expect("template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_keeps_only_the_latencies_that_ended_after_the_warm_up() {
        let start = Instant::now();
        let mut lat = Lat::new(start);
        // A slow warm-up, then a fast steady state.
        for i in 0..100u64 {
            lat.record(Duration::from_millis(500), start + Duration::from_millis(i));
        }
        for i in 0..900u64 {
            lat.record(
                Duration::from_millis(2),
                start + Duration::from_secs(10) + Duration::from_millis(i),
            );
        }
        let steady = lat.since(Duration::from_secs(10));
        assert_eq!(steady.count(), 900);
        let s = steady.summary();
        assert!(s.max < 2.1 && s.p50 > 1.9, "{s:?}");
        assert!(
            lat.summary().p99 >= 499.0,
            "the whole run keeps the warm-up"
        );
    }

    #[test]
    fn between_keeps_only_the_latencies_that_ended_in_the_window() {
        let start = Instant::now();
        let mut lat = Lat::new(start);
        for s in 0..30u64 {
            // One a second; slow ones from 10 s to 12 s (a fault).
            let ms = if (10..13).contains(&s) { 900 } else { 3 };
            lat.record(Duration::from_millis(ms), start + Duration::from_secs(s));
        }
        let before = lat.between(Duration::from_secs(0), Duration::from_secs(10));
        assert_eq!(before.count(), 10);
        assert!(before.summary().max < 3.1, "{:?}", before.summary());
        let after = lat.between(Duration::from_secs(10), Duration::from_secs(20));
        assert_eq!(after.count(), 10);
        assert!(after.summary().max >= 899.0, "{:?}", after.summary());
        assert_eq!(lat.since(Duration::from_secs(10)).count(), 20);
    }

    #[test]
    fn repeated_runs_report_medians_ranges_and_every_failure() {
        let run = |fig: f64, p99: f64, failed: u64| {
            let mut r = Report::new("acquire", "etcd", 1.0);
            r.figure("acquires per s", fig);
            r.figure("sessions lost", failed as f64 * 100.0);
            r.latencies.insert(
                "acquire".into(),
                Summary {
                    count: 100,
                    p50: 1.0,
                    p90: 2.0,
                    p99,
                    p999: p99,
                    max: p99,
                    failed: Some(failed),
                },
            );
            r.notes.push("same note".into());
            r
        };
        let runs = [
            run(10.0, 5.0, 0),
            run(30.0, 50.0, 2),
            run(20.0, 7.0, 1),
            run(40.0, 6.0, 0),
            run(25.0, 9.0, 0),
        ];
        let m = Report::median_of(&runs);
        assert_eq!(m.runs, 5);
        assert_eq!(m.figures["acquires per s"], 25.0);
        assert_eq!(m.ranges["acquires per s"], (10.0, 40.0));
        let a = &m.latencies["acquire"];
        assert_eq!(a.p99, 7.0);
        assert_eq!(m.ranges["acquire p99"], (5.0, 50.0));
        // Failures are never hidden by a median: all of them, and the range per run.
        assert_eq!(a.failed, Some(3));
        assert_eq!(m.ranges["acquire failed"], (0.0, 2.0));
        assert_eq!(m.params["runs"], "5");
        // One run's lost sessions are not a median's to hide.
        assert_eq!(m.figures["sessions lost"], 300.0);
        assert_eq!(m.ranges["sessions lost"], (0.0, 200.0));
        assert_eq!(m.notes.iter().filter(|n| *n == "same note").count(), 1);
        // An even count takes the middle two's mean; one run is itself.
        let m = Report::median_of(&runs[..4]);
        assert_eq!(m.figures["acquires per s"], 25.0);
        assert_eq!(Report::median_of(&runs[..1]).runs, 1);
    }
}
