//! Watches: one upstream watch per (node, kind), each client's watch kept here with the
//! index its read reflects, events fanned out to the clients armed below them.

use super::*;

impl Hub {
    /// A snapshot to take before sending a watched read upstream.
    pub fn watch_snapshot(&self) -> Snapshot {
        let ready = self.ready();
        let t = lock(&self.t);
        Snapshot {
            generation: t.generation,
            seq: t.event_seq,
            ready,
        }
    }

    /// Registers a client's watch armed at `since`. Returns the upstream watch to re-arm
    /// if an event on it (or a reset) may have consumed the upstream watch since `snap`.
    pub fn add_watch(
        &self,
        session: SessionId,
        key: WatchKey,
        since: LogIndex,
        snap: Snapshot,
    ) -> Option<wire::types::WatchSpec> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        t.last_index = t.last_index.max(since);
        t.client(session, lease);
        let raced = !snap.ready
            || t.generation != snap.generation
            || seq_touched(&t.recent_events, snap.seq, t.event_seq, |k| *k == key);
        let list = t.watches.entry(key.clone()).or_default();
        if let Some(w) = list.iter_mut().find(|(s, _)| *s == session) {
            w.1 = w.1.min(since);
        } else {
            list.push((session, since));
        }
        let min = list.iter().map(|(_, i)| *i).min().unwrap_or(since);
        raced.then_some(wire::types::WatchSpec {
            path: key.0,
            kind: key.1,
            since_index: min,
        })
    }

    /// An upstream watch fired: fires every client watch armed below the event's index
    /// (all of them when the index is 0: the change is older than the leader's memory).
    /// Returns the upstream watch to re-arm for the clients left.
    pub fn fire(&self, ev: &WatchEvent) -> Option<wire::types::WatchSpec> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        let key = (ev.path.clone(), ev.kind);
        t.event_seq += 1;
        let seq = t.event_seq;
        t.recent_events.push_back((seq, key.clone()));
        while t.recent_events.len() > RECENT_MAX {
            t.recent_events.pop_front();
        }
        t.last_index = t.last_index.max(ev.index);
        let list = t.watches.remove(&key).unwrap_or_default();
        let (fired, left): (Vec<_>, Vec<_>) = list
            .into_iter()
            .partition(|(_, since)| ev.index == 0 || *since < ev.index);
        for (s, _) in fired {
            self.counters
                .watch_events_relayed
                .fetch_add(1, Ordering::Relaxed);
            t.deliver(s, Ok(Reply::Event(ev.clone())), lease);
        }
        if left.is_empty() {
            return None;
        }
        let min = left.iter().map(|(_, i)| *i).min().expect("not empty");
        t.watches.insert(key.clone(), left);
        Some(wire::types::WatchSpec {
            path: key.0,
            kind: key.1,
            since_index: min,
        })
    }

    /// The upstream watch for `key` as it should be armed now (`None`: no client left).
    pub fn watch_spec(&self, key: &WatchKey) -> Option<wire::types::WatchSpec> {
        let t = lock(&self.t);
        let list = t.watches.get(key)?;
        Some(wire::types::WatchSpec {
            path: key.0.clone(),
            kind: key.1,
            since_index: list.iter().map(|(_, i)| *i).min()?,
        })
    }

    /// Removes one client's watch (it fired in a `Rewatch` answer to that client).
    pub fn remove_watch(&self, session: SessionId, key: &WatchKey) {
        let mut t = lock(&self.t);
        if let Some(list) = t.watches.get_mut(key) {
            list.retain(|(s, _)| *s != session);
            if list.is_empty() {
                t.watches.remove(key);
            }
        }
    }

    /// Every upstream watch with the lowest index a client armed it at: what to re-arm
    /// after the upstream stream (re)connects.
    pub fn all_watches(&self) -> Vec<wire::types::WatchSpec> {
        let t = lock(&self.t);
        t.watches
            .iter()
            .map(|(k, list)| wire::types::WatchSpec {
                path: k.0.clone(),
                kind: k.1,
                since_index: list.iter().map(|(_, i)| *i).min().unwrap_or(0),
            })
            .collect()
    }
}
