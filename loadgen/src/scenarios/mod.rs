//! The scenarios. Each starts from a running cluster, drives it through one [`Conn`], and
//! returns a [`Report`]: [`acquire`], [`herd`], [`takeover`] and [`failover`],
//! [`max_writes`], [`burst`] here (a file each); `profile` and `state` in their own
//! folders. What they share (the context, progress bars, paced opens, the unavailability
//! measure) is in this file.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use indicatif::ProgressBar;

use crate::cluster::{Cluster, System};
use crate::report::{bar, proc_cost, Report};
use crate::systems::{Conn, Sess};

/// What every scenario gets.
pub struct Ctx {
    pub cluster: Cluster,
    pub conn: Conn,
    pub scale: f64,
    pub lease: Duration,
    /// Session opens [`Ctx::sessions`] retried (its paced opener tries a failed open
    /// again), reported by [`Ctx::costs`].
    pub open_retries: std::sync::atomic::AtomicU64,
    /// Loadgen's own cost when this run started ([`crate::report::own_cost_from_here`]).
    pub own_before: Option<crate::report::ProcCost>,
}

impl Ctx {
    pub(crate) fn n(&self, full: f64, min: usize) -> usize {
        ((full * self.scale).round() as usize).max(min)
    }

    pub(crate) fn secs(&self, full: f64, min: f64) -> Duration {
        Duration::from_secs_f64((full * self.scale).max(min))
    }

    pub(crate) fn report(&self, scenario: &str) -> Report {
        let mut r = Report::new(scenario, self.cluster.system.name(), self.scale);
        r.param("members", self.cluster.members.len());
        r.param("client endpoints", self.cluster.endpoints.join(","));
        r.param("lease / session timeout (s)", self.lease.as_secs());
        // `state` loads its nodes through clients of its own, with other deadlines.
        if scenario != "state" {
            r.param(
                "request timeout (s)",
                match self.conn {
                    Conn::Zk(_) => "none (a request fails when its connection is given up)".into(),
                    _ => format!("{}", crate::systems::request_timeout().as_secs_f64()),
                },
            );
        }
        r
    }

    pub(crate) fn costs(&self, r: &mut Report) {
        let retried = self.open_retries.load(std::sync::atomic::Ordering::Relaxed);
        if retried > 0 {
            r.figure("session opens retried (setup)", retried as f64);
        }
        for (name, pid) in self.cluster.processes() {
            if let Some(c) = proc_cost(&name, pid) {
                r.processes.push(c);
            }
        }
        if let Some(mut c) = proc_cost("loadgen", std::process::id()) {
            // This run's share of loadgen's CPU (its peak RSS was reset at the start).
            if let Some(b) = &self.own_before {
                c.cpu_secs = (c.cpu_secs - b.cpu_secs).max(0.0);
                c.cpu_wait_secs = (c.cpu_wait_secs - b.cpu_wait_secs).max(0.0);
            }
            r.processes.push(c);
        }
    }

    /// How many TCP connections this process has established to the cluster's client
    /// ports (read from `/proc`): etcd's and ZooKeeper's sessions' connections, to show
    /// how they are held ([`sessions_model`]). `None` for ours (QUIC over one UDP
    /// socket per SDK client) or when `/proc` cannot be read.
    ///
    /// The least of ten readings over one second, asked while nothing is sent: a client
    /// dropped during the setup (a leader lookup, say) closes its connection from a task
    /// of its own, which on a CPU-starved machine ran after a single reading (a 4th
    /// connection counted beside etcd's 3 on 2026-12-06).
    pub(crate) async fn client_connections(&self) -> Option<usize> {
        if self.cluster.system == System::Ours {
            return None;
        }
        let ports: std::collections::HashSet<u16> = self
            .cluster
            .endpoints
            .iter()
            .filter_map(|e| e.rsplit(':').next()?.parse().ok())
            .collect();
        let mut least = None;
        for _ in 0..10 {
            if let Some(n) = own_tcp_connections(&ports) {
                least = Some(least.map_or(n, |l: usize| l.min(n)));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        least
    }

    /// `n` sessions, held as one client process of each system holds many (see
    /// [`sessions_model`]).
    async fn sessions(&self, n: usize) -> anyhow::Result<Vec<Arc<Sess>>> {
        use std::sync::atomic::Ordering::Relaxed;
        let before = crate::systems::OPEN_RETRIES.load(Relaxed);
        let opened = crate::systems::open_many(&self.conn, n, self.lease).await;
        self.open_retries.fetch_add(
            crate::systems::OPEN_RETRIES
                .load(Relaxed)
                .saturating_sub(before),
            Relaxed,
        );
        Ok(opened?.into_iter().map(Arc::new).collect())
    }
}

/// This process's established TCP connections whose remote port is one of `ports`
/// (`/proc/net/tcp` and `tcp6`, matched to this process's sockets by inode).
fn own_tcp_connections(ports: &std::collections::HashSet<u16>) -> Option<usize> {
    let mut inodes = std::collections::HashSet::new();
    for fd in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Ok(link) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if let Some(n) = link
            .to_str()
            .and_then(|l| l.strip_prefix("socket:["))
            .and_then(|l| l.strip_suffix(']'))
        {
            inodes.insert(n.to_string());
        }
    }
    let mut n = 0;
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            let (Some(rem), Some(st), Some(inode)) = (f.get(2), f.get(3), f.get(9)) else {
                continue;
            };
            let port = rem
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            // 01: ESTABLISHED.
            if *st == "01" && port.is_some_and(|p| ports.contains(&p)) && inodes.contains(*inode) {
                n += 1;
            }
        }
    }
    Some(n)
}

/// How the sessions of [`Ctx::sessions`] are held, for the report of a scenario that
/// opens them so: as one client process of each system holds many. Ours, all on one SDK
/// client (one QUIC connection, to the leader); etcd, up to 2 000 leases per gRPC client
/// and at least a client per member, each starting at another member, so that their
/// requests spread over the members as one clientv3 process's do (its balancer keeps a
/// connection per member and sends requests round-robin), renewed on a stream per lease
/// or on one per client (`--etcd-shared-keepalive`); ZooKeeper, a connection each (a
/// ZooKeeper session is its connection).
pub(crate) fn sessions_model(conn: &Conn) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    match conn {
        Conn::Ours(_) => "all on one SDK client (one QUIC connection)".into(),
        Conn::Etcd(_) => format!(
            "up to {} leases per gRPC client, at least a client per member (requests \
             spread over the members){}, renewed on {}",
            crate::systems::ETCD_LEASES_PER_CLIENT,
            if crate::systems::ETCD_LEASE_PER_CLIENT.load(Relaxed) {
                " sharing one lease (--etcd-lease-per-client)"
            } else {
                ""
            },
            if crate::systems::ETCD_SHARED_KEEPALIVE.load(Relaxed) {
                "one keep-alive stream (--etcd-shared-keepalive)"
            } else {
                "a keep-alive stream per lease"
            }
        ),
        Conn::Zk(_) => "a connection each (a ZooKeeper session is its connection)".into(),
    }
}

/// Opens `n` sessions, `batch` at a time, with a progress bar; `open(i)` opens the i-th.
pub(crate) async fn open_batched<T, F, Fut>(
    n: usize,
    batch: usize,
    open: F,
) -> anyhow::Result<Vec<T>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    // `batch` at a time, the first failure fatal: the paced opener with one try.
    let pace = crate::systems::Pace::new(batch, 1, Duration::ZERO);
    Ok(crate::systems::open_paced(n, pace, open).await?.0)
}

pub(crate) fn ticker(d: Duration, what: &str) -> (ProgressBar, tokio::task::JoinHandle<()>) {
    let pb = bar(d.as_secs().max(1), what);
    let p = pb.clone();
    let h = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            p.inc(1);
        }
    });
    (pb, h)
}
pub mod abuse;
mod acquire;
mod burst;
mod failover;
mod herd;
mod max_writes;
pub mod move_prefix;

pub use abuse::abuse;
pub use acquire::acquire;
pub use burst::burst;
pub use failover::{failover, takeover, LeaderEvent};
pub use herd::herd;
pub use max_writes::max_writes;

/// Unavailability after `event`: from it to the first success after it, or the longest
/// gap between successes after it if that is longer; `none` if nothing succeeded.
pub(crate) fn unavailable(successes: &[Instant], event: Instant, none: Duration) -> Duration {
    longest_gap(successes, event).map_or(none, |(gap, _)| gap)
}

/// The longest stretch without a success after `event` (counted from `event` up to the
/// first success after it, then between successes) and when it ended, from `event` (the
/// first such stretch if several are as long); `None` if nothing succeeded after it.
pub(crate) fn longest_gap(successes: &[Instant], event: Instant) -> Option<(Duration, Duration)> {
    let mut times: Vec<Instant> = successes.iter().copied().filter(|t| *t > event).collect();
    times.sort();
    let mut prev = event;
    let mut longest: Option<(Duration, Duration)> = None;
    for t in times {
        if longest.is_none_or(|(gap, _)| t - prev > gap) {
            longest = Some((t - prev, t - event));
        }
        prev = t;
    }
    longest
}

/// The note of a scenario that fails as a whole on any failed operation.
pub(crate) const ALL_OR_NOTHING: &str =
    "failed: this scenario stops with an error at the first failed \
     operation (no retry), so a report it writes had none";

/// etcd's gRPC counter `metric` (e.g. `grpc_server_handled_total`, requests answered, or
/// `grpc_server_started_total`, streams and requests begun) for the service `service`
/// (e.g. `etcdserverpb.KV`), by method, summed over the members (each member's
/// `/metrics` on its client port); `None` for the other systems, or if a member did not
/// answer.
pub(crate) async fn etcd_grpc_counts(
    cluster: &Cluster,
    metric: &str,
    service: &str,
) -> Option<std::collections::BTreeMap<String, f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if cluster.system != System::Etcd {
        return None;
    }
    let mut out = std::collections::BTreeMap::new();
    for m in &cluster.members {
        let addr = m.trim_start_matches("http://");
        let body = tokio::time::timeout(Duration::from_secs(5), async {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
                .await
                .ok()?;
            let mut body = String::new();
            s.read_to_string(&mut body).await.ok()?;
            Some(body)
        })
        .await
        .ok()??;
        for line in body.lines() {
            let Some(rest) = line.strip_prefix(metric).and_then(|l| l.strip_prefix('{')) else {
                continue;
            };
            if !rest.contains(&format!("grpc_service=\"{service}\"")) {
                continue;
            }
            let method = rest.split("grpc_method=\"").nth(1)?.split('"').next()?;
            let n: f64 = line.rsplit(' ').next()?.parse().ok()?;
            *out.entry(method.to_string()).or_insert(0.0) += n;
        }
    }
    Some(out)
}
