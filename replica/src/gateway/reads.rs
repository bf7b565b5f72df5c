//! Reads: linearizable reads behind the read gate (with a watch armed atomically when
//! asked), cached reads that record the session as a cacher, re-armed watches after a
//! fail-over, and the lock recipes' reads (predecessor, sequencer).

use super::*;

impl Gateway {
    /// A read for caching: the value (or absence), and whether this session was recorded
    /// as a cacher (atomically with the read, see `leader::cachers`).
    pub(super) async fn cached_get(&self, req: &Request, me: &Acting, p: &str) -> Response {
        path::validate(p)?;
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        self.gate.confirm().await?;
        let marked = {
            let s = self.state.read().expect("state lock");
            // Refused early (nothing proposed, nothing recorded); checked again below at
            // the state the value is taken from.
            s.sm.check_read(&me.identity, p)?;
            s.sm.check_session_to_read(req.session, me)?.caches
        };
        if !marked {
            // Once per session: log that it caches, so a future leader knows to wait for
            // its flush after a fail-over.
            self.propose(Command::MarkCacher {
                session: req.session,
            })
            .await?;
        }
        let internal = |e: actix::MailboxError| Error::Internal {
            reason: format!("cacher list: {e}"),
        };
        let epoch = self
            .cachers
            .send(BeginRead(p.to_string()))
            .await
            .map_err(internal)?;
        let (value, index, may_cache) = {
            let s = self.state.read().expect("state lock");
            s.sm.check_session(req.session)?;
            // Checked at the state the value is taken from.
            s.sm.check_read(&me.identity, p)?;
            // A node's children are not part of what is cached: a child's create or
            // delete does not hold its parent, so the children fields would go stale in
            // a cache. They are 0 in every cached read (`children` reads them).
            let value = s.sm.node(p).map(|n| {
                let mut stat = n.stat();
                stat.children_count = 0;
                stat.children_version = 0;
                (n.data.clone(), stat)
            });
            (value, s.sm.last_index(), s.sm.cachable(p))
        };
        if !may_cache {
            // Under a prefix being moved: served, never cached (the freeze's hold dropped
            // every copy; none may be made until the prefix is owned again).
            return Ok(Reply::CachedData {
                value,
                index,
                cachable: false,
            });
        }
        let owner = value.as_ref().and_then(|(_, stat)| stat.ephemeral_owner);
        let seen = value
            .as_ref()
            .map(|(_, stat)| (stat.create_index, stat.mod_index));
        // Sequential creates are not held (see `cached_paths`), so the absence of a name
        // one could make (ending in a sequence number) is not cachable: names are
        // predictable, and a cached absence of `.../lock-0000000007` would go stale.
        if value.is_none() && crate::state_machine::sequence_of(path::name(p)).is_some() {
            return Ok(Reply::CachedData {
                value,
                index,
                cachable: false,
            });
        }
        let cachable = match epoch {
            Some((term, epoch)) => self
                .cachers
                .send(Record {
                    session: req.session,
                    path: p.to_string(),
                    term,
                    epoch,
                    owner,
                    seen,
                })
                .await
                .map_err(internal)?,
            None => false,
        };
        Ok(Reply::CachedData {
            value,
            index,
            cachable,
        })
    }

    /// A linearizable read; with `watch`, a one-shot watch armed at the index the read
    /// reflects.
    pub(super) async fn read(
        &self,
        req: &Request,
        me: &Acting,
        p: &str,
        watch: bool,
        f: impl FnOnce(&crate::state_machine::StateMachine) -> Response,
    ) -> Response {
        path::validate(p)?;
        if watch && req.session == 0 {
            return Err(Error::SessionRequired);
        }
        self.gate.confirm().await?;
        let reply = {
            let s = self.state.read().expect("state lock");
            if watch {
                s.sm.check_session_to_read(req.session, me)?;
            }
            s.sm.check_read(&me.identity, p)?;
            f(&s.sm)?
        };
        if watch {
            let Some((kind, since)) = reply.armed_watch() else {
                return Err(Error::Internal {
                    reason: format!("unexpected {reply:?}"),
                });
            };
            let arm = Arm {
                session: req.session,
                path: p.to_string(),
                kind,
                since,
                deliver: true,
            };
            self.watches.send(arm).await.map_err(|e| Error::Internal {
                reason: format!("watch table: {e}"),
            })?;
        }
        Ok(reply)
    }

    pub(super) async fn rewatch(
        &self,
        req: &Request,
        me: &Acting,
        watches: Vec<wire::types::WatchSpec>,
    ) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        path::validate_rewatch(&watches)?;
        self.gate.confirm().await?;
        {
            let s = self.state.read().expect("state lock");
            // An empty `Rewatch` is how a proxy asks whether its client owns a session:
            // the owner's check, strictly (not a proxy's read under its own session).
            if watches.is_empty() {
                s.sm.check_session_for(req.session, me)?;
            } else {
                s.sm.check_session_to_read(req.session, me)?;
            }
            // A watch tells when a node changes: only for identities that may read it.
            // A proxy re-arming its own watches after a fail-over is not checked: each
            // was armed by a read it forwarded for a client, which was.
            let own_proxy = me.forwarded_by.is_none() && self.is_own_proxy(&me.identity);
            if !own_proxy {
                for w in &watches {
                    s.sm.check_read(&me.identity, &w.path)?;
                }
            }
        }
        let mut fired = Vec::new();
        for w in watches {
            let arm = Arm {
                session: req.session,
                path: w.path,
                kind: w.kind,
                since: w.since_index,
                deliver: false,
            };
            if let Some(ev) = self.watches.send(arm).await.map_err(|e| Error::Internal {
                reason: format!("watch table: {e}"),
            })? {
                fired.push(ev);
            }
        }
        Ok(Reply::Rewatched { fired })
    }

    /// The sequential sibling just below `path` (linearizable).
    pub(super) async fn predecessor(&self, me: &Acting, path: String) -> Response {
        path::validate(&path)?;
        self.gate.confirm().await?;
        let s = self.state.read().expect("state lock");
        // It names a sibling: the read right on the parent, as listing the children.
        s.sm.check_read(&me.identity, path::parent(&path))?;
        if s.sm.node(&path).is_none() {
            return Err(Error::NoNode { path });
        }
        Ok(Reply::Predecessor {
            predecessor: s.sm.predecessor(&path),
        })
    }

    /// Whether a sequencer is still the current holder of its lock (linearizable).
    pub(super) async fn check_sequencer(
        &self,
        path: String,
        token: u64,
        session: SessionId,
    ) -> Response {
        path::validate(&path)?;
        self.gate.confirm().await?;
        let s = self.state.read().expect("state lock");
        Ok(Reply::Sequencer {
            current: s.sm.sequencer_current(&path, token, session),
        })
    }
}
