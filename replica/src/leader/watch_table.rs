//! One-shot watches on the leader: who waits for what, and which applied effects fire them.
//!
//! A watch is armed at the log index its read reflected; only changes at later indexes fire
//! it, so a change the read already saw never fires it and a change after the read always
//! does (the actor also checks the state machine when arming, for changes that were
//! applied between the read and the registration). Each watch fires once and is removed.
//!
//! Firing rules (ZooKeeper's): a `Data` watch fires on a data change or a delete; a
//! `Children` watch on a change to the children or a delete of the node itself; an
//! `Exists` watch (armed on a missing node) on a create. A delete therefore fires both the
//! data and the children watches of the node.
//!
//! Leader-local and volatile: emptied on every leadership change; clients re-arm their
//! watches with the index they last saw (`Op::Rewatch`).

use wire::hash::{HashMap, HashSet};

use wire::command::Effect;
use wire::types::{EventType, LogIndex, SessionId, WatchEvent, WatchKind};

#[derive(Debug, Clone, PartialEq, Eq)]
struct Armed {
    session: SessionId,
    kind: WatchKind,
    since: LogIndex,
}

/// The table.
#[derive(Debug, Default)]
pub struct WatchTable {
    by_path: HashMap<String, Vec<Armed>>,
    by_session: HashMap<SessionId, HashSet<String>>,
    armed: usize,
}

impl WatchTable {
    /// An empty table.
    pub fn new() -> WatchTable {
        WatchTable::default()
    }

    /// Number of armed watches.
    pub fn len(&self) -> usize {
        self.armed
    }

    /// True when no watch is armed.
    pub fn is_empty(&self) -> bool {
        self.armed == 0
    }

    /// Number of armed watches on `path` (any session, any kind).
    pub fn watches_on(&self, path: &str) -> usize {
        self.by_path.get(path).map_or(0, Vec::len)
    }

    /// Arms a watch. Arming the same (session, path, kind) twice keeps one watch, armed at
    /// the earlier index.
    pub fn arm(&mut self, session: SessionId, path: &str, kind: WatchKind, since: LogIndex) {
        let list = self.by_path.entry(path.to_string()).or_default();
        if let Some(w) = list
            .iter_mut()
            .find(|w| w.session == session && w.kind == kind)
        {
            w.since = w.since.min(since);
            return;
        }
        list.push(Armed {
            session,
            kind,
            since,
        });
        self.by_session
            .entry(session)
            .or_default()
            .insert(path.to_string());
        self.armed += 1;
    }

    /// Fires and removes the watches matched by the effects of the entry at `index`.
    pub fn apply(&mut self, index: LogIndex, effects: &[Effect]) -> Vec<(SessionId, WatchEvent)> {
        let mut fired = Vec::new();
        for e in effects {
            let (path, event, kinds): (&str, EventType, &[WatchKind]) = match e {
                Effect::Created { path } => (path, EventType::Created, &[WatchKind::Exists]),
                Effect::DataChanged { path } => (path, EventType::DataChanged, &[WatchKind::Data]),
                Effect::Deleted { path } => (
                    path,
                    EventType::Deleted,
                    &[WatchKind::Data, WatchKind::Children],
                ),
                Effect::ChildrenChanged { path } => {
                    (path, EventType::ChildrenChanged, &[WatchKind::Children])
                }
                Effect::SessionEnded { session } => {
                    self.session_ended(*session);
                    continue;
                }
                Effect::SessionOpened { .. } => continue,
            };
            let Some(list) = self.by_path.get_mut(path) else {
                continue;
            };
            let mut kept = Vec::with_capacity(list.len());
            for w in list.drain(..) {
                if kinds.contains(&w.kind) && index > w.since {
                    fired.push((
                        w.session,
                        WatchEvent {
                            path: path.to_string(),
                            kind: w.kind,
                            event,
                            index,
                        },
                    ));
                } else {
                    kept.push(w);
                }
            }
            *list = kept;
            self.tidy(path);
        }
        for (session, ev) in &fired {
            self.armed -= 1;
            let still = self
                .by_path
                .get(&ev.path)
                .is_some_and(|l| l.iter().any(|w| w.session == *session));
            if !still {
                if let Some(paths) = self.by_session.get_mut(session) {
                    paths.remove(&ev.path);
                }
            }
        }
        fired
    }

    /// Forgets every watch of an ended session.
    pub fn session_ended(&mut self, session: SessionId) {
        for path in self.by_session.remove(&session).unwrap_or_default() {
            if let Some(list) = self.by_path.get_mut(&path) {
                let before = list.len();
                list.retain(|w| w.session != session);
                self.armed -= before - list.len();
            }
            self.tidy(&path);
        }
    }

    /// Forgets everything (leadership lost).
    pub fn clear(&mut self) {
        *self = WatchTable::default();
    }

    fn tidy(&mut self, path: &str) {
        if self.by_path.get(path).is_some_and(Vec::is_empty) {
            self.by_path.remove(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deleted(p: &str) -> Vec<Effect> {
        vec![
            Effect::Deleted { path: p.into() },
            Effect::ChildrenChanged { path: "/".into() },
        ]
    }

    #[test]
    fn one_shot_and_only_after_the_armed_index() {
        let mut t = WatchTable::new();
        t.arm(1, "/a", WatchKind::Data, 10);
        // A change the read already reflected does not fire.
        assert!(t
            .apply(10, &[Effect::DataChanged { path: "/a".into() }])
            .is_empty());
        let fired = t.apply(11, &[Effect::DataChanged { path: "/a".into() }]);
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].1.event, EventType::DataChanged);
        assert_eq!(fired[0].1.index, 11);
        // One-shot.
        assert!(t
            .apply(12, &[Effect::DataChanged { path: "/a".into() }])
            .is_empty());
        assert!(t.is_empty());
    }

    #[test]
    fn delete_fires_data_and_children_watches_exists_fires_on_create() {
        let mut t = WatchTable::new();
        t.arm(1, "/a", WatchKind::Data, 1);
        t.arm(2, "/a", WatchKind::Children, 1);
        t.arm(3, "/b", WatchKind::Exists, 1);
        let fired = t.apply(5, &deleted("/a"));
        let mut kinds: Vec<_> = fired.iter().map(|(s, e)| (*s, e.kind, e.event)).collect();
        kinds.sort_by_key(|(s, k, _)| (*s, *k));
        assert_eq!(
            kinds,
            vec![
                (1, WatchKind::Data, EventType::Deleted),
                (2, WatchKind::Children, EventType::Deleted)
            ]
        );
        // Children of /b changing does not fire an exists watch; creating /b does.
        assert!(t
            .apply(6, &[Effect::ChildrenChanged { path: "/b".into() }])
            .is_empty());
        let fired = t.apply(7, &[Effect::Created { path: "/b".into() }]);
        assert_eq!(
            fired,
            vec![(
                3,
                WatchEvent {
                    path: "/b".into(),
                    kind: WatchKind::Exists,
                    event: EventType::Created,
                    index: 7
                }
            )]
        );
        assert!(t.is_empty());
    }

    #[test]
    fn children_watch_fires_on_child_changes() {
        let mut t = WatchTable::new();
        t.arm(1, "/lock", WatchKind::Children, 3);
        assert!(t
            .apply(
                4,
                &[Effect::DataChanged {
                    path: "/lock".into()
                }]
            )
            .is_empty());
        let fired = t.apply(
            5,
            &[
                Effect::Created {
                    path: "/lock/n-1".into(),
                },
                Effect::ChildrenChanged {
                    path: "/lock".into(),
                },
            ],
        );
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].1.event, EventType::ChildrenChanged);
    }

    #[test]
    fn arming_twice_keeps_one_and_sessions_clean_up() {
        let mut t = WatchTable::new();
        t.arm(1, "/a", WatchKind::Data, 5);
        t.arm(1, "/a", WatchKind::Data, 3);
        t.arm(2, "/a", WatchKind::Data, 5);
        assert_eq!(t.len(), 2);
        assert_eq!(t.watches_on("/a"), 2);
        t.apply(6, &[Effect::SessionEnded { session: 2 }]);
        assert_eq!(t.len(), 1);
        let fired = t.apply(4, &[Effect::DataChanged { path: "/a".into() }]);
        assert_eq!(fired.len(), 1, "armed at the earlier index 3");
        assert!(t.is_empty());
        assert!(t.by_session.values().all(HashSet::is_empty));
    }
}
