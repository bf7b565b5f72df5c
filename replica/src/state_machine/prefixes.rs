//! The prefixes a cell owns (`wire::directory`): which paths it serves, which are frozen
//! for a move, and the three commands a move applies (set a prefix's state, import a
//! copied subtree, drop a subtree).
//!
//! A cell that has recorded no prefix serves every path (a cell outside any directory).
//! Once it has recorded one, it serves the root and the prefixes it owns (reads and
//! writes) or that are frozen (reads); every other path is answered
//! [`Error::WrongCell`].
//!
//! The changes a move makes, each allowed again once made (a re-run goes on):
//!
//! | from | to |
//! |---|---|
//! | not recorded | owned or importing, any epoch (placing a prefix; importing one) |
//! | owned at e | frozen at e (a move starts) |
//! | frozen at e | owned at e (a move given up), gone at e' > e (a move done) |
//! | importing at e | owned at e (copied), importing at e' > e (another attempt) |
//! | gone at e | importing at e' > e (moving back) |

use wire::command::Effect;
use wire::types::LogIndex;

use super::*;

/// How a recorded prefix (or none) reads in an error.
pub(super) fn describe(r: Option<&(u64, PrefixState)>) -> String {
    match r {
        None => "not recorded here".into(),
        Some((e, s)) => format!("{s} at epoch {e}"),
    }
}

impl StateMachine {
    /// Whether this cell serves `p` (`write`: for a write). The root is always served.
    pub fn check_owned(&self, p: &str, write: bool) -> Result<(), Error> {
        if self.prefixes.is_empty() {
            return Ok(());
        }
        let Some(prefix) = wire::directory::prefix_of(p) else {
            return Ok(());
        };
        match self.prefixes.get(prefix) {
            Some((_, PrefixState::Owned)) => Ok(()),
            Some((_, PrefixState::Frozen)) if !write => Ok(()),
            Some(&(epoch, PrefixState::Frozen)) => Err(Error::Frozen {
                prefix: prefix.to_string(),
                epoch,
            }),
            Some(&(epoch, _)) => Err(Error::WrongCell {
                prefix: prefix.to_string(),
                epoch,
            }),
            None => Err(Error::WrongCell {
                prefix: prefix.to_string(),
                epoch: 0,
            }),
        }
    }

    /// [`StateMachine::check_owned`] for each op of a write (a check op reads).
    pub fn check_ops_owned(&self, ops: &[TxnOp]) -> Result<(), Error> {
        for op in ops {
            let p = match op {
                TxnOp::Check { path, .. }
                | TxnOp::Create { path, .. }
                | TxnOp::Delete { path, .. }
                | TxnOp::SetData { path, .. } => path,
            };
            self.check_owned(p, !matches!(op, TxnOp::Check { .. }))?;
        }
        Ok(())
    }

    /// Whether reads of `p` may be cached: not under a prefix being moved (a copy cached
    /// from the old cell must not outlive the move).
    pub fn cachable(&self, p: &str) -> bool {
        wire::directory::prefix_of(p)
            .and_then(|prefix| self.prefixes.get(prefix))
            .is_none_or(|(_, s)| *s == PrefixState::Owned)
    }

    /// The epoch of the prefix `p` belongs to (0 if not recorded).
    pub fn epoch_of(&self, p: &str) -> u64 {
        wire::directory::prefix_of(p)
            .and_then(|prefix| self.prefixes.get(prefix))
            .map_or(0, |(e, _)| *e)
    }

    /// The prefixes recorded here.
    pub fn prefixes(&self) -> Vec<PrefixRecord> {
        self.prefixes
            .iter()
            .map(|(p, (e, s))| PrefixRecord {
                prefix: p.clone(),
                epoch: *e,
                state: *s,
            })
            .collect()
    }

    /// The paths of the nodes of `prefix` (itself and below), in path order.
    pub fn subtree_paths(&self, prefix: &str) -> Vec<String> {
        let below = format!("{prefix}/");
        let mut out: Vec<String> = self
            .nodes
            .get(prefix)
            .map(|_| prefix.to_string())
            .into_iter()
            .collect();
        out.extend(
            self.nodes
                .range::<_, str>((
                    std::ops::Bound::Excluded(below.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(p, _)| p.starts_with(&below))
                .map(|(p, _)| p.clone()),
        );
        out
    }

    /// Up to `max_bytes` (at least one node) of the persistent nodes of `prefix` after
    /// `after` in path order, for a move's copy; and whether more follow.
    pub fn export(
        &self,
        prefix: &str,
        after: Option<&str>,
        max_bytes: usize,
    ) -> (Vec<ExportedNode>, bool) {
        let below = format!("{prefix}/");
        let start = match after {
            Some(a) => std::ops::Bound::Excluded(a),
            None => std::ops::Bound::Included(prefix),
        };
        let mut out = Vec::new();
        let mut bytes = 0;
        for (p, n) in self
            .nodes
            .range::<_, str>((start, std::ops::Bound::Unbounded))
            .take_while(|(p, _)| p.as_str() == prefix || p.starts_with(&below))
        {
            if n.ephemeral_owner.is_some() {
                continue;
            }
            let acl = self.security.acl(n.acl).clone();
            let size =
                64 + p.len() + n.data.len() + postcard::to_allocvec(&acl).map_or(0, |v| v.len());
            if !out.is_empty() && bytes + size > max_bytes {
                return (out, true);
            }
            bytes += size;
            out.push(ExportedNode {
                path: p.clone(),
                data: n.data.clone(),
                version: n.version,
                children_version: n.children_version,
                sequence_next: n.sequence_next,
                token: n.token,
                acl,
            });
        }
        (out, false)
    }

    pub(super) fn set_prefix(
        &mut self,
        prefix: &str,
        epoch: u64,
        to: PrefixState,
    ) -> Result<(), Error> {
        use PrefixState::*;
        wire::directory::check_prefix(prefix)?;
        if epoch > wire::directory::EPOCH_MAX {
            return Err(Error::BadRequest {
                reason: format!("epoch {epoch} is above {}", wire::directory::EPOCH_MAX),
            });
        }
        let now = self.prefixes.get(prefix);
        let allowed = match (now, to) {
            (None, Owned | Importing) => true,
            (Some(&(e, s)), t) if s == t && e == epoch => true,
            (Some(&(e, Owned)), Frozen) => e == epoch,
            (Some(&(e, Frozen)), Owned) => e == epoch,
            (Some(&(e, Frozen)), Gone) => epoch > e,
            (Some(&(e, Importing)), Owned) => e == epoch,
            (Some(&(e, Importing)), Importing) => epoch > e,
            (Some(&(e, Gone)), Importing) => epoch > e,
            _ => false,
        };
        if !allowed {
            return Err(Error::BadRequest {
                reason: format!(
                    "{prefix} cannot become {to} at epoch {epoch}: it is {}",
                    describe(now)
                ),
            });
        }
        self.prefixes.insert(prefix.to_string(), (epoch, to));
        Ok(())
    }

    pub(super) fn import_prefix(
        &mut self,
        index: LogIndex,
        prefix: &str,
        epoch: u64,
        first: bool,
        nodes: &[ExportedNode],
        effects: &mut Vec<Effect>,
    ) -> Result<(), Error> {
        match self.prefixes.get(prefix) {
            Some(&(e, PrefixState::Importing)) if e == epoch => {}
            other => {
                return Err(Error::BadRequest {
                    reason: format!(
                    "{prefix} takes imported nodes only while importing at epoch {epoch}; it is {}",
                    describe(other)
                ),
                })
            }
        }
        // Checked whole before anything changes: the command applies all or nothing.
        let below = format!("{prefix}/");
        let copied = |p: &str| p == prefix || p.starts_with(&below);
        let mut last: Option<&str> = None;
        let mut in_page: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
        for n in nodes {
            path::validate(&n.path)?;
            check_value(&n.data)?;
            n.acl
                .check()
                .map_err(|reason| Error::BadRequest { reason })?;
            if n.path != prefix && !n.path.starts_with(&below) {
                return Err(Error::BadRequest {
                    reason: format!("{} is not under {prefix}", n.path),
                });
            }
            if last.is_some_and(|l| l >= n.path.as_str()) {
                return Err(Error::BadRequest {
                    reason: format!("imported nodes out of path order at {}", n.path),
                });
            }
            // Tokens only grow across a move: every copied token is of an earlier epoch.
            if wire::directory::token_epoch(n.token) >= epoch {
                return Err(Error::BadRequest {
                    reason: format!(
                        "{} carries token {} of epoch {} or later; importing at epoch {epoch}",
                        n.path, n.token, epoch
                    ),
                });
            }
            // Every node lands under a persistent parent: one earlier in the page, or
            // one here that stays (a first page drops the prefix's nodes first).
            let parent = path::parent(&n.path);
            let parent_ok = in_page.contains(parent)
                || self
                    .nodes
                    .get(parent)
                    .is_some_and(|pn| pn.ephemeral_owner.is_none() && !(first && copied(parent)));
            if !parent_ok {
                return Err(Error::BadRequest {
                    reason: format!("{} comes without its parent {parent}", n.path),
                });
            }
            // A node copied over an ephemeral one would leave its session pointing at a
            // persistent node.
            if !first
                && self
                    .nodes
                    .get(&n.path)
                    .is_some_and(|o| o.ephemeral_owner.is_some())
            {
                return Err(Error::BadRequest {
                    reason: format!("{} is an ephemeral node here", n.path),
                });
            }
            in_page.insert(&n.path);
            last = Some(&n.path);
        }
        if first {
            self.drop_subtree(prefix, index, effects);
        }
        for n in nodes {
            let parent_path = path::parent(&n.path).to_string();
            let acl = self.security.adopt(n.acl.clone());
            let mut node = Node::new(n.data.clone(), index, None, acl, n.token);
            node.version = n.version;
            node.children_version = n.children_version;
            node.sequence_next = n.sequence_next;
            if let Some(old) = self.nodes.get(&n.path) {
                // Imported again (a chunk re-sent): keep the children already here.
                node.children = old.children.clone();
                let old_acl = old.acl;
                self.security.release(old_acl);
                effects.push(Effect::DataChanged {
                    path: n.path.clone(),
                });
            } else {
                let copied_parent = copied(&parent_path);
                let parent = self.nodes.get_mut(&parent_path).expect("checked above");
                parent.children.insert(path::name(&n.path).to_string());
                // A copied parent keeps its copied children version; the root's counts
                // the prefix's node arriving.
                if !copied_parent {
                    parent.children_version += 1;
                }
                parent.children_index = index;
                effects.push(Effect::Created {
                    path: n.path.clone(),
                });
                effects.push(Effect::ChildrenChanged { path: parent_path });
            }
            self.nodes.insert(n.path.clone(), node);
        }
        Ok(())
    }

    /// Deletes the ephemeral nodes of `prefix` (they have no children), and their
    /// sessions' records of them.
    pub(super) fn drop_ephemerals(
        &mut self,
        prefix: &str,
        index: LogIndex,
        effects: &mut Vec<Effect>,
    ) {
        for p in self.subtree_paths(prefix) {
            if let Some(owner) = self.nodes[&p].ephemeral_owner {
                if let Some(s) = self.sessions.get_mut(&owner) {
                    s.ephemerals.remove(&p);
                }
                self.remove_node(&p, index, effects);
            }
        }
    }

    /// Deletes the nodes of `prefix` (itself and below), children before parents, and
    /// their sessions' records of the ephemeral ones.
    pub(super) fn drop_subtree(
        &mut self,
        prefix: &str,
        index: LogIndex,
        effects: &mut Vec<Effect>,
    ) {
        let paths = self.subtree_paths(prefix);
        // Descendants sort after their ancestors: in reverse, children go first.
        for p in paths.iter().rev() {
            if let Some(owner) = self.nodes[p].ephemeral_owner {
                if let Some(s) = self.sessions.get_mut(&owner) {
                    s.ephemerals.remove(p);
                }
            }
            self.remove_node(p, index, effects);
        }
    }
}
