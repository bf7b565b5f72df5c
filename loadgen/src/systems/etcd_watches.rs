//! Many watches over one `Watch` stream per client, as Go's clientv3 does: its watcher
//! multiplexes every `Watch` call of one client (with the same context metadata) onto a
//! single bidirectional gRPC stream, and matches each `created` answer to its request by
//! order (etcd answers the creates of one stream in the order they were sent). The Rust
//! `etcd-client` crate opens a new stream for every `Client::watch` call, so 2 000 lock
//! waiters of one client cost etcd 2 000 streams where clientv3's cost it one; loadgen's
//! lock waits (`waitDeletes` in `EtcdSess::acquire`) go through a [`WatchMux`] instead,
//! one per gRPC client (`EtcdConn`, which opens the streams: this module only uses them).
//!
//! A wait is one watch: created at the revision after the read that found the key, ended
//! by the key's delete (then cancelled at the server, as clientv3 cancels a watch whose
//! context ends), or failed by a cancel or compaction of the watch, or by the stream's
//! failure. A stream the server ends sends its waits back to look again; a failed one
//! fails every wait on it; the next wait opens a new one (through `EtcdConn::call`, so at
//! the next member if this one timed out). clientv3 would
//! re-create its watchers on a new stream itself; here the lock's acquire fails and its
//! caller counts the failure and tries again, as for any other failed request.
//!
//! A stream stays at the member it was opened at until it ends, as a clientv3 watch stream
//! stays on its connection: when the client moves its requests to another member, waits
//! still go to the old member's stream until that fails (its connection's keep-alive
//! gives a silent member up within 8 s).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};

use anyhow::anyhow;
use etcd_client::{EventType, WatchOptions, WatchRequestSender, WatchResponseStream, WatchStream};
use tokio::sync::oneshot;

/// Where a wait hears its outcome: `Ok` when the key was deleted, `Err` with the reason
/// when its watch or the stream failed.
type Waiter = oneshot::Sender<Result<(), String>>;

/// The waits of one stream.
#[derive(Default)]
struct Table {
    /// Waits whose watch was asked for but not yet created, oldest first.
    pending: VecDeque<Waiter>,
    /// Waits by watch id.
    watching: HashMap<i64, Waiter>,
    /// Why the stream ended, once it did: no new watch goes on it.
    ended: Option<String>,
}

impl Table {
    /// The stream is over: every wait hears `outcome` (`Ok` to look again, as after a
    /// delete; `Err` to fail).
    fn end(&mut self, why: &str, outcome: Result<(), String>) {
        self.ended = Some(why.to_string());
        for w in self.pending.drain(..) {
            let _ = w.send(outcome.clone());
        }
        for (_, w) in self.watching.drain() {
            let _ = w.send(outcome.clone());
        }
    }
}

/// Ends its stream's waits when dropped armed: a wait queued whose watch request never
/// went out (its future dropped meanwhile).
struct Unsent<'a>(Option<&'a Mutex<Table>>);

impl Unsent<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.0 {
            let why = "a wait was dropped before its watch was asked for";
            t.lock().expect("watches").end(why, Err(why.into()));
        }
    }
}

/// A stream in use: its request side, its waits and the task reading its answers.
struct Live {
    watcher: Arc<tokio::sync::Mutex<WatchRequestSender>>,
    table: Arc<Mutex<Table>>,
    reader: tokio::task::JoinHandle<()>,
}

/// One client's watch stream, shared by all its waits (see the module).
#[derive(Default)]
pub struct WatchMux {
    /// The stream in use. Held while a watch is asked for, so the requests go out in the
    /// order their waits were queued.
    live: tokio::sync::Mutex<Option<Live>>,
}

impl Drop for WatchMux {
    fn drop(&mut self) {
        if let Some(l) = self.live.get_mut().take() {
            l.reader.abort();
        }
    }
}

impl WatchMux {
    /// Waits until `key` is deleted at a revision from `from_rev` on, over this client's
    /// stream; if there is none or it ended, `open` opens one with this wait's watch as
    /// its first (etcd-client's `Client::watch`, which returns once the stream is open;
    /// the watch's `created` answer comes on the stream like any later one's).
    pub async fn wait_deleted<Open, Fut>(
        &self,
        key: Vec<u8>,
        from_rev: i64,
        open: Open,
    ) -> anyhow::Result<()>
    where
        Open: FnOnce(Vec<u8>, WatchOptions) -> Fut,
        Fut: Future<Output = anyhow::Result<WatchStream>>,
    {
        let (tx, rx) = oneshot::channel();
        let opts = WatchOptions::new().with_start_revision(from_rev);
        {
            let mut live = self.live.lock().await;
            // Queued under the table's lock only while the stream is not over: a wait
            // queued after the reader ended the table would never hear anything.
            let mut tx = Some(tx);
            if let Some(l) = live.as_ref() {
                let mut t = l.table.lock().expect("watches");
                if t.ended.is_none() {
                    t.pending.push_back(tx.take().expect("not queued yet"));
                }
            }
            if tx.is_none() {
                let l = live.as_ref().expect("an open stream");
                // Queued, not yet asked for: were this future dropped before the request
                // went out, every later `created` answer would go to the wait queued
                // before its own. The guard then ends the stream for all its waits.
                let unsent = Unsent(Some(l.table.as_ref()));
                let sent = l.watcher.lock().await.watch(key, Some(opts)).await;
                unsent.disarm();
                if let Err(e) = sent {
                    // The request side is gone: the stream is over for every wait.
                    let why = format!("the watch stream failed: {e}");
                    l.table.lock().expect("watches").end(&why, Err(why.clone()));
                }
            } else {
                if let Some(old) = live.take() {
                    old.reader.abort();
                    let why = "the watch stream was replaced";
                    old.table.lock().expect("watches").end(why, Err(why.into()));
                }
                // A new stream, opened with this wait's watch as its first request (within
                // the request timeout): the wait is the first pending one, and the reader
                // gives it the id of the first `created` answer (or fails it if the
                // server refused the watch).
                let (watcher, stream) = open(key, opts).await?.split();
                let table = Arc::new(Mutex::new(Table::default()));
                table
                    .lock()
                    .expect("watches")
                    .pending
                    .push_back(tx.take().expect("not queued"));
                let watcher = Arc::new(tokio::sync::Mutex::new(watcher));
                let reader = tokio::spawn(read_answers(stream, table.clone(), watcher.clone()));
                *live = Some(Live {
                    watcher,
                    table,
                    reader,
                });
            }
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(anyhow!("watch: {why}")),
            Err(_) => Err(anyhow!("watch: the stream was dropped")),
        }
    }
}

/// Reads a stream's answers until it ends: a `created` answer gives the oldest pending
/// wait its watch id; a delete ends the wait of its watch (and the watch is cancelled);
/// a cancelled or compacted watch fails its wait.
async fn read_answers(
    mut stream: WatchResponseStream,
    table: Arc<Mutex<Table>>,
    watcher: Arc<tokio::sync::Mutex<WatchRequestSender>>,
) {
    let (why, outcome) = loop {
        let m = match stream.message().await {
            // Ended by the server: the waits look again (as loadgen's waits did on a
            // stream of their own), and watch again on a new stream if the key is there.
            Ok(None) => break ("the watch stream ended".to_string(), Ok(())),
            Ok(Some(m)) => m,
            Err(e) => {
                let why = format!("the watch stream failed: {e}");
                break (why.clone(), Err(why));
            }
        };
        let id = m.watch_id();
        let deleted = {
            let mut t = table.lock().expect("watches");
            if m.created() {
                if let Some(w) = t.pending.pop_front() {
                    if m.canceled() {
                        let _ = w.send(Err(format!("not created: {}", m.cancel_reason())));
                    } else {
                        t.watching.insert(id, w);
                    }
                }
                continue;
            }
            if m.canceled() || m.compact_revision() > 0 {
                if let Some(w) = t.watching.remove(&id) {
                    let _ = w.send(Err(format!(
                        "cancelled by the server (compacted at {}): {}",
                        m.compact_revision(),
                        m.cancel_reason()
                    )));
                }
                continue;
            }
            if m.events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                t.watching.remove(&id)
            } else {
                None
            }
        };
        if let Some(w) = deleted {
            let _ = w.send(Ok(()));
            // Sent from a task of its own: this task is the stream's only reader, and
            // must not wait on the request side while answers pile up.
            let watcher = watcher.clone();
            tokio::spawn(async move {
                let _ = watcher.lock().await.cancel(id).await;
            });
        }
    };
    table.lock().expect("watches").end(&why, outcome);
}
