//! Many etcd leases kept alive over one `LeaseKeepAlive` stream, as Go's clientv3 does
//! for all the leases of one client (its `lessor` sends every lease's renewal on a single
//! bidirectional stream). The Rust `etcd-client` crate opens one stream per lease, which
//! at 50 000 leases costs etcd 50 000 server-side streams; the large scenarios use this
//! instead, so etcd is measured as its own client would drive it.
//!
//! The two messages are declared here with `prost` (etcd's `rpc.proto`: a request is the
//! lease id, field 1; a response carries the id, field 2, and the new TTL, field 3, which
//! is 0 once the lease is gone) and sent with tonic's generic client.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::time::Instant;

use anyhow::anyhow;

use crate::systems::ETCD_RENEWALS;

#[derive(Clone, PartialEq, prost::Message)]
struct KeepAliveRequest {
    #[prost(int64, tag = "1")]
    id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct KeepAliveResponse {
    #[prost(int64, tag = "2")]
    id: i64,
    #[prost(int64, tag = "3")]
    ttl: i64,
}

/// One lease's renewals.
struct Lease {
    /// When its next renewal is due.
    due: Instant,
    /// When its last renewal was sent.
    sent: Option<Instant>,
    /// When it was last renewed (or granted).
    renewed: Instant,
    /// The last renewal answered and its round trip.
    last: Option<(Instant, Duration)>,
    /// Known to be over: the server answered a renewal with TTL 0 (its answer for a lease
    /// it does not have). Only the server decides: a lease not renewed for a while is
    /// still renewed, as clientv3's keep-alive loop does.
    gone: bool,
}

/// The leases one client keeps alive, and the task doing it.
pub struct LeaseMux {
    leases: Mutex<HashMap<i64, Lease>>,
    ttl: Duration,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl LeaseMux {
    /// Starts keeping leases of `ttl` alive through `endpoints` (one stream at a time, to
    /// the next endpoint when it fails); renewals every third of the TTL, as clientv3.
    pub fn start(endpoints: Vec<String>, ttl: Duration) -> Arc<LeaseMux> {
        let mux = Arc::new(LeaseMux {
            leases: Mutex::default(),
            ttl,
            task: Mutex::default(),
        });
        let task = tokio::spawn(run(Arc::downgrade(&mux), endpoints));
        *mux.task.lock().expect("task") = Some(task);
        mux
    }

    /// Adds lease `id`, just granted; its first renewal comes within a third of its TTL.
    pub fn add(&self, id: i64) {
        let now = Instant::now();
        let first = (self.ttl / 3).mul_f64(0.5 + 0.5 * rand::random::<f64>());
        self.leases.lock().expect("leases").insert(
            id,
            Lease {
                due: now + first,
                sent: None,
                renewed: now,
                last: None,
                gone: false,
            },
        );
    }

    /// Stops renewing lease `id`.
    pub fn remove(&self, id: i64) {
        self.leases.lock().expect("leases").remove(&id);
    }

    /// The last renewal of `id` answered, and its round trip.
    pub fn last_keepalive(&self, id: i64) -> Option<(Instant, Duration)> {
        self.leases.lock().expect("leases").get(&id)?.last
    }

    /// True if lease `id` is known to be over.
    pub fn lost(&self, id: i64) -> bool {
        self.leases
            .lock()
            .expect("leases")
            .get(&id)
            .is_none_or(|l| l.gone)
    }

    /// True while lease `id` was renewed (or granted) less than a TTL ago, as the client
    /// sees it (longer is jeopardy, as for ours).
    pub fn valid(&self, id: i64) -> bool {
        self.leases
            .lock()
            .expect("leases")
            .get(&id)
            .is_some_and(|l| !l.gone && l.renewed.elapsed() <= self.ttl)
    }

    /// The leases due now, marked sent.
    fn due(&self) -> Vec<i64> {
        let now = Instant::now();
        let every = self.ttl / 3;
        let mut out = Vec::new();
        for (id, l) in self.leases.lock().expect("leases").iter_mut() {
            if l.gone {
                continue;
            }
            if l.due <= now {
                l.sent = Some(now);
                l.due = now + every.mul_f64(0.9 + 0.1 * rand::random::<f64>());
                out.push(*id);
            }
        }
        out
    }

    fn answered(&self, r: &KeepAliveResponse) {
        let now = Instant::now();
        if let Some(l) = self.leases.lock().expect("leases").get_mut(&r.id) {
            if r.ttl > 0 {
                l.renewed = now;
                l.last = l.sent.map(|s| (now, now - s));
                ETCD_RENEWALS.fetch_add(1, Ordering::Relaxed);
            } else {
                l.gone = true;
            }
        }
    }

    /// After a new stream opened: every live lease is renewed at once.
    fn all_due(&self) {
        let now = Instant::now();
        for l in self.leases.lock().expect("leases").values_mut() {
            l.due = now;
        }
    }
}

impl Drop for LeaseMux {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().expect("task").take() {
            t.abort();
        }
    }
}

/// Opens a keep-alive stream to `endpoint`: requests go into the returned sender; the
/// replies come out of the returned receiver, which ends when the stream does. (etcd
/// answers the call's headers only with its first reply, so the call is awaited in a
/// task of its own while requests flow.)
async fn open_stream(
    endpoint: &str,
) -> anyhow::Result<(
    tokio::sync::mpsc::Sender<KeepAliveRequest>,
    tokio::sync::mpsc::Receiver<KeepAliveResponse>,
    tokio::task::JoinHandle<()>,
)> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))?
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| anyhow!("{e}"))?;
    let (tx, rx) = tokio::sync::mpsc::channel(4_096);
    let (reply_tx, reply_rx) = tokio::sync::mpsc::channel(4_096);
    let requests =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let reader = tokio::spawn(async move {
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/etcdserverpb.Lease/LeaseKeepAlive",
        );
        let codec = tonic_prost::ProstCodec::<KeepAliveRequest, KeepAliveResponse>::default();
        let Ok(r) = grpc
            .streaming(tonic::Request::new(requests), path, codec)
            .await
        else {
            return;
        };
        let mut replies = r.into_inner();
        while let Ok(Some(m)) = replies.message().await {
            if reply_tx.send(m).await.is_err() {
                return;
            }
        }
    });
    Ok((tx, reply_rx, reader))
}

/// Renews the mux's leases until it is dropped: one stream at a time; when it fails (or
/// leaves renewals unanswered for a third of the TTL), the next endpoint after 200 ms. A
/// lease is given up only when the server answers its renewal with TTL 0.
async fn run(mux: Weak<LeaseMux>, endpoints: Vec<String>) {
    let mut at = 0usize;
    loop {
        let endpoint = &endpoints[at % endpoints.len().max(1)];
        at += 1;
        let opened = open_stream(endpoint).await;
        let Some(m) = mux.upgrade() else { return };
        let Ok((tx, mut replies, reader)) = opened else {
            drop(m);
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        m.all_due();
        let silent_max = m.ttl / 3;
        drop(m);
        // Since when renewals sent on this stream have gone unanswered: a stream silent
        // for a third of the TTL (a frozen member) is given up for the next endpoint.
        let mut unanswered_since: Option<Instant> = None;
        // One timer per stream, polled in the select: a sleep made inside the select
        // would start over after every reply, and no renewal would go out while
        // replies kept coming.
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                r = replies.recv() => match r {
                    Some(r) => match mux.upgrade() {
                        Some(m) => {
                            unanswered_since = None;
                            m.answered(&r);
                        }
                        None => {
                            reader.abort();
                            return;
                        }
                    },
                    None => break,
                },
                _ = tick.tick() => {
                    let Some(m) = mux.upgrade() else {
                        reader.abort();
                        return;
                    };
                    let mut failed = false;
                    for id in m.due() {
                        unanswered_since.get_or_insert_with(Instant::now);
                        if tx.try_send(KeepAliveRequest { id }).is_err() {
                            failed = true;
                            break;
                        }
                    }
                    if failed || unanswered_since.is_some_and(|t| t.elapsed() > silent_max) {
                        break;
                    }
                }
            }
        }
        reader.abort();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
