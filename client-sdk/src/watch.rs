//! One-shot watches on the client side.
//!
//! A watch is registered here *before* its read is sent (so an event racing the read's
//! answer is never lost), then bound to the index the read reflected. Events arrive on the
//! session's event stream and complete every waiter of the same node and kind armed before
//! the event's index. Waiters of that node and kind armed later are re-armed at the cell,
//! since the cell keeps one watch per (session, node, kind).

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use wire::hash::HashMap;

use tokio::sync::oneshot;
use wire::types::{LogIndex, WatchEvent, WatchKind, WatchSpec};
use wire::Error;

/// A one-shot watch: resolves with the event once the watched node changes, or with
/// `SessionExpired` if the session ends first. Dropping it cancels nothing at the cell.
pub struct Watch {
    rx: oneshot::Receiver<WatchEvent>,
    session: u64,
}

impl Future for Watch {
    type Output = Result<WatchEvent, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let session = self.session;
        Pin::new(&mut self.rx)
            .poll(cx)
            .map(|r| r.map_err(|_| Error::SessionExpired { session }))
    }
}

struct Waiter {
    id: u64,
    /// `None` until the read answered (an event meanwhile completes it: a spurious wake-up
    /// is harmless, a lost one is not).
    since: Option<LogIndex>,
    /// Registered by an `exists` read (which may turn out to arm a creation watch).
    exists_read: bool,
    tx: oneshot::Sender<WatchEvent>,
}

/// All waiters of one session.
#[derive(Default)]
pub(crate) struct Registry {
    inner: Mutex<RegistryInner>,
}

#[derive(Default)]
struct RegistryInner {
    next_id: u64,
    waiters: HashMap<(String, WatchKind), Vec<Waiter>>,
    /// The session ended: new watches resolve at once with `SessionExpired`.
    closed: bool,
}

impl Registry {
    /// Registers a waiter before its read is sent.
    pub(crate) fn register(&self, session: u64, path: &str, kind: WatchKind) -> (u64, Watch) {
        self.register_read(session, path, kind, false)
    }

    /// Registers the waiter of an `exists` read: under `Data` until its answer says which
    /// kind the cell armed, and completed by a racing creation event too.
    pub(crate) fn register_exists(&self, session: u64, path: &str) -> (u64, Watch) {
        self.register_read(session, path, WatchKind::Data, true)
    }

    fn register_read(
        &self,
        session: u64,
        path: &str,
        kind: WatchKind,
        exists_read: bool,
    ) -> (u64, Watch) {
        let mut r = self.inner.lock().expect("registry lock");
        r.next_id += 1;
        let id = r.next_id;
        let (tx, rx) = oneshot::channel();
        if r.closed {
            drop(tx); // resolves the watch with SessionExpired
            return (id, Watch { rx, session });
        }
        let list = r.waiters.entry((path.to_string(), kind)).or_default();
        // Waiters whose `Watch` was dropped wait for nobody: a process that reads and
        // watches a node again and again (the directory's map) would pile them up.
        list.retain(|w| !w.tx.is_closed());
        list.push(Waiter {
            id,
            since: None,
            exists_read,
            tx,
        });
        (id, Watch { rx, session })
    }

    /// Binds a waiter to its read's index, or moves it to another kind (an `exists` read
    /// arms a data watch when the node exists and a creation watch when it does not).
    pub(crate) fn bind(
        &self,
        id: u64,
        path: &str,
        from: WatchKind,
        to: WatchKind,
        since: LogIndex,
    ) {
        let mut r = self.inner.lock().expect("registry lock");
        let Some(list) = r.waiters.get_mut(&(path.to_string(), from)) else {
            return;
        };
        let Some(pos) = list.iter().position(|w| w.id == id) else {
            return;
        };
        let mut w = list.remove(pos);
        w.since = Some(since);
        r.waiters.entry((path.to_string(), to)).or_default().push(w);
    }

    /// Forgets a waiter whose read failed.
    pub(crate) fn cancel(&self, id: u64, path: &str, kind: WatchKind) {
        let mut r = self.inner.lock().expect("registry lock");
        if let Some(list) = r.waiters.get_mut(&(path.to_string(), kind)) {
            list.retain(|w| w.id != id);
        }
    }

    /// Completes the waiters an event fires; returns specs of the waiters of the same node
    /// and kind that are armed later than the event and must be re-armed at the cell.
    pub(crate) fn dispatch(&self, ev: &WatchEvent) -> Vec<WatchSpec> {
        let mut r = self.inner.lock().expect("registry lock");
        // An `exists` read registers under `Data` until its answer says which kind the cell
        // armed; a creation event racing that answer completes it too.
        if ev.kind == WatchKind::Exists {
            if let Some(list) = r.waiters.get_mut(&(ev.path.clone(), WatchKind::Data)) {
                let (unbound, bound): (Vec<Waiter>, Vec<Waiter>) = list
                    .drain(..)
                    .partition(|w| w.since.is_none() && w.exists_read);
                *list = bound;
                for w in unbound {
                    let _ = w.tx.send(ev.clone());
                }
            }
        }
        let key = (ev.path.clone(), ev.kind);
        let Some(list) = r.waiters.remove(&key) else {
            return Vec::new();
        };
        // Waiters whose `Watch` was dropped need nothing.
        let list: Vec<Waiter> = list.into_iter().filter(|w| !w.tx.is_closed()).collect();
        let mut later = Vec::new();
        for w in list {
            match w.since {
                Some(since) if ev.index != 0 && since >= ev.index => later.push(w),
                _ => {
                    let _ = w.tx.send(ev.clone());
                }
            }
        }
        let specs = later
            .iter()
            .map(|w| WatchSpec {
                path: ev.path.clone(),
                kind: ev.kind,
                since_index: w.since.unwrap_or(0),
            })
            .collect();
        if !later.is_empty() {
            r.waiters.insert(key, later);
        }
        specs
    }

    /// Every armed waiter, for re-arming after a fail-over (the earliest index per node and
    /// kind).
    pub(crate) fn specs(&self) -> Vec<WatchSpec> {
        let mut r = self.inner.lock().expect("registry lock");
        // Forget waiters whose `Watch` was dropped: nobody waits for them.
        for list in r.waiters.values_mut() {
            list.retain(|w| !w.tx.is_closed());
        }
        r.waiters.retain(|_, list| !list.is_empty());
        // Waiters whose read has not answered yet are not armed anywhere yet: their read
        // arms them (and the session re-arms them if the stream moved meanwhile).
        r.waiters
            .iter()
            .filter_map(|((path, kind), list)| {
                let since = list.iter().filter_map(|w| w.since).min()?;
                Some(WatchSpec {
                    path: path.clone(),
                    kind: *kind,
                    since_index: since,
                })
            })
            .collect()
    }

    /// Drops every waiter (the session ended): their watches resolve with an error.
    pub(crate) fn clear(&self) {
        let mut r = self.inner.lock().expect("registry lock");
        r.waiters.clear();
        r.closed = true;
    }

    /// Number of waiting watches.
    pub(crate) fn len(&self) -> usize {
        self.inner
            .lock()
            .expect("registry lock")
            .waiters
            .values()
            .map(Vec::len)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::types::EventType;

    fn ev(path: &str, kind: WatchKind, index: LogIndex) -> WatchEvent {
        WatchEvent {
            path: path.into(),
            kind,
            event: EventType::DataChanged,
            index,
        }
    }

    #[tokio::test]
    async fn fires_waiters_armed_before_the_event_and_keeps_later_ones() {
        let reg = Registry::default();
        let (a, wa) = reg.register(1, "/x", WatchKind::Data);
        reg.bind(a, "/x", WatchKind::Data, WatchKind::Data, 5);
        let (b, _wb) = reg.register(1, "/x", WatchKind::Data);
        reg.bind(b, "/x", WatchKind::Data, WatchKind::Data, 9);
        let rearm = reg.dispatch(&ev("/x", WatchKind::Data, 7));
        assert_eq!(wa.await.unwrap().index, 7);
        assert_eq!(
            rearm,
            vec![WatchSpec {
                path: "/x".into(),
                kind: WatchKind::Data,
                since_index: 9
            }]
        );
        assert_eq!(reg.len(), 1);
    }

    #[tokio::test]
    async fn unbound_waiters_fire_and_exists_moves_kind() {
        let reg = Registry::default();
        let (_, w) = reg.register(1, "/y", WatchKind::Data);
        reg.dispatch(&ev("/y", WatchKind::Data, 3));
        assert!(
            w.await.is_ok(),
            "an event racing the read completes the waiter"
        );
        let (id, w) = reg.register(1, "/z", WatchKind::Data);
        reg.bind(id, "/z", WatchKind::Data, WatchKind::Exists, 4);
        assert!(reg.dispatch(&ev("/z", WatchKind::Data, 5)).is_empty());
        reg.dispatch(&ev("/z", WatchKind::Exists, 5));
        assert_eq!(w.await.unwrap().kind, WatchKind::Exists);
        let (_, w) = reg.register(1, "/q", WatchKind::Children);
        reg.clear();
        assert_eq!(w.await, Err(Error::SessionExpired { session: 1 }));
        let (_, w) = reg.register(1, "/q", WatchKind::Children);
        assert_eq!(
            w.await,
            Err(Error::SessionExpired { session: 1 }),
            "closed after expiry"
        );
    }

    #[tokio::test]
    async fn creation_racing_an_exists_answer_is_not_lost() {
        let reg = Registry::default();
        let (_, other) = reg.register(1, "/n", WatchKind::Data);
        let (id, w) = reg.register_exists(1, "/n");
        let ev = WatchEvent {
            path: "/n".into(),
            kind: WatchKind::Exists,
            event: EventType::Created,
            index: 9,
        };
        reg.dispatch(&ev);
        reg.bind(id, "/n", WatchKind::Data, WatchKind::Exists, 8);
        assert_eq!(w.await.unwrap().event, EventType::Created);
        assert_eq!(
            reg.len(),
            1,
            "a get's data waiter is not woken by a creation event"
        );
        drop(other);
    }

    #[tokio::test]
    async fn unanswered_reads_are_not_rearmed() {
        let reg = Registry::default();
        let (_id, _w) = reg.register(1, "/pending", WatchKind::Data);
        assert!(reg.specs().is_empty());
    }

    #[tokio::test]
    async fn dropped_watches_are_not_rearmed() {
        let reg = Registry::default();
        let (id, w) = reg.register(1, "/gone", WatchKind::Exists);
        reg.bind(id, "/gone", WatchKind::Exists, WatchKind::Exists, 3);
        drop(w);
        assert!(reg.specs().is_empty());
    }
}
