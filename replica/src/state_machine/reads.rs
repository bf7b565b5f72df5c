//! The reads the state machine answers from its namespace (`Get`, `Exists`, `Children`,
//! `Predecessor`, `CheckSequencer`) and what a re-armed watch asks of it: all `&self`,
//! the same answer on every replica at one applied index.

use wire::types::{EventType, LogIndex, Predecessor, Reply, SessionId, WatchKind};
use wire::{path, Error};

use super::{sequence_of, Node, StateMachine};

impl StateMachine {
    /// `Get`: data and metadata.
    pub fn get(&self, p: &str) -> Result<Reply, Error> {
        path::validate(p)?;
        let n = self.nodes.get(p).ok_or_else(|| Error::NoNode {
            path: p.to_string(),
        })?;
        Ok(Reply::Data {
            data: n.data.clone(),
            stat: n.stat(),
            index: self.last_index,
        })
    }

    /// `Exists`: metadata or nothing.
    pub fn exists(&self, p: &str) -> Result<Reply, Error> {
        path::validate(p)?;
        Ok(Reply::Exists {
            stat: self.nodes.get(p).map(Node::stat),
            index: self.last_index,
        })
    }

    /// `Children`: names and metadata in name order.
    pub fn children(&self, p: &str) -> Result<Reply, Error> {
        path::validate(p)?;
        let n = self.nodes.get(p).ok_or_else(|| Error::NoNode {
            path: p.to_string(),
        })?;
        let children = n
            .children
            .iter()
            .map(|c| {
                let child = &self.nodes[&path::join(p, c)];
                (c.clone(), child.stat())
            })
            .collect();
        Ok(Reply::Children {
            stat: n.stat(),
            children,
            index: self.last_index,
        })
    }

    /// Whether a watch of `kind` on `p`, armed at `since`, would have fired by now, and
    /// with what event. Used to re-arm watches after a fail-over.
    pub fn changed_since(&self, p: &str, kind: WatchKind, since: LogIndex) -> Option<EventType> {
        let node = self.nodes.get(p);
        match (kind, node) {
            (WatchKind::Exists, Some(_)) => Some(EventType::Created),
            // Missing now, but it may have been created and deleted since: if the parent's
            // children changed after `since` (or the parent is gone or new), fire; at worst
            // a spurious wake-up, never a missed one.
            (WatchKind::Exists, None) => {
                let parent = self.nodes.get(path::parent(p));
                let maybe =
                    parent.is_none_or(|pn| pn.children_index > since || pn.create_index > since);
                maybe.then_some(EventType::Deleted)
            }
            (WatchKind::Data | WatchKind::Children, None) => Some(EventType::Deleted),
            (WatchKind::Data | WatchKind::Children, Some(n)) if n.create_index > since => {
                Some(EventType::Deleted)
            }
            (WatchKind::Data, Some(n)) if n.mod_index > since => Some(EventType::DataChanged),
            (WatchKind::Children, Some(n)) if n.children_index > since => {
                Some(EventType::ChildrenChanged)
            }
            _ => None,
        }
    }

    /// The log index of the change [`StateMachine::changed_since`] reported: the node's
    /// create, data or children index; for a delete (whose index is not kept) the last
    /// applied index, an upper bound.
    pub fn change_index(&self, p: &str, event: EventType) -> LogIndex {
        match (event, self.nodes.get(p)) {
            (EventType::Created, Some(n)) => n.create_index,
            (EventType::DataChanged, Some(n)) => n.mod_index,
            (EventType::ChildrenChanged, Some(n)) => n.children_index,
            _ => self.last_index,
        }
    }

    /// Is the lock node `p` still held by `session` with fencing token `token`?
    pub fn sequencer_current(&self, p: &str, token: LogIndex, session: SessionId) -> bool {
        // Not where the prefix is no longer served (moved out, or never here).
        self.check_owned(p, false).is_ok()
            && self
                .nodes
                .get(p)
                .is_some_and(|n| n.token == token && n.ephemeral_owner == Some(session))
    }

    /// The sibling of the sequential node `p` with the highest sequence number below its
    /// own (sequence numbers of one parent follow creation order, whatever the prefix).
    pub fn predecessor(&self, p: &str) -> Option<Predecessor> {
        let own = sequence_of(path::name(p))?;
        let parent_path = path::parent(p);
        let parent = self.nodes.get(parent_path)?;
        let mut best: Option<(u64, &String)> = None;
        for c in &parent.children {
            if let Some(seq) = sequence_of(c) {
                if seq < own && best.is_none_or(|(b, _)| seq > b) {
                    best = Some((seq, c));
                }
            }
        }
        best.map(|(_, name)| Predecessor {
            name: name.clone(),
            create_index: self.nodes[&path::join(parent_path, name)].create_index,
        })
    }
}
