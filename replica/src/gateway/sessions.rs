//! Sessions at the gateway: opening and closing them, renewing their leases (one or a
//! batch, with the overdue-acknowledgement rule), their acknowledgements of
//! invalidations, and their event streams.

use super::*;

impl Gateway {
    /// Opens a session owned by the identity `me` acts as (a logged command); the answer
    /// names the cell's lease.
    pub(super) async fn create_session(&self, me: &Acting) -> Response {
        if me.identity.is_empty() {
            return Err(Error::BadRequest {
                reason: "a session needs an identity to belong to, and this connection has none"
                    .into(),
            });
        }
        let owner = me.identity.clone();
        // At most its limit of sessions (counted in the applied state; requests in flight
        // bound how far concurrent opens can pass it).
        let open = self
            .state
            .read()
            .expect("state lock")
            .sm
            .sessions_of(&owner);
        self.quotas.check_sessions(&owner, open)?;
        match self.propose(Command::CreateSession { owner }).await? {
            Reply::SessionCreated { session, .. } => Ok(Reply::SessionCreated {
                session,
                session_lease_ms: self.lease_ms,
            }),
            other => Err(Error::Internal {
                reason: format!("unexpected {other:?}"),
            }),
        }
    }

    /// Renews one session's lease (never logged), unless it leaves an invalidation
    /// unacknowledged for too long; a cacher also hears of the invalidations its event
    /// stream may have lost.
    pub(super) async fn keepalive(
        &self,
        req: &Request,
        me: &Acting,
        received: Instant,
    ) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        // Refused before anything else: no overdue check, no renewal.
        self.refuse_foreign(&[req.session], me)?;
        self.keepalive_stats.rpcs.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(session = req.session, "KeepAlive");
        if !self.overdue(&[req.session]).await.is_empty() {
            return Err(Error::SessionExpired {
                session: req.session,
            });
        }
        let mut r = match self
            .sessions
            .send(KeepAliveMany {
                sessions: vec![req.session],
                acting: me.clone(),
                received,
            })
            .await
        {
            Ok(mut one) => one.pop().unwrap_or_else(|| {
                Err(Error::Internal {
                    reason: "session manager answered no session".into(),
                })
            }),
            Err(e) => Err(Error::Internal {
                reason: format!("session manager: {e}"),
            }),
        };
        if let Ok(Reply::KeepAlive { unacknowledged, .. }) = &mut r {
            self.keepalive_stats.renewed.fetch_add(1, Ordering::Relaxed);
            // A cacher whose event stream lost an invalidation hears of it here.
            if !self.cachers_among(&[req.session]).is_empty() {
                *unacknowledged = self
                    .cachers
                    .send(Unacknowledged(req.session))
                    .await
                    .unwrap_or_default();
            }
        }
        r
    }

    /// Ends a session now: its cached copies are dropped first, then its ephemeral nodes
    /// go with the logged close.
    pub(super) async fn close_session(&self, req: &Request, me: &Acting) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        // Before the cacher list hears of it: a refused close changes nothing.
        self.check_owner(req.session, me).await?;
        // Its ephemeral nodes vanish: drop cached copies first (the cacher list
        // reads them and marks the session ending in one step, see `HoldEnd`).
        let held = self
            .cachers
            .send(HoldEnd {
                sessions: vec![req.session],
                lease_ran_out: false,
            })
            .await
            .map_err(|e| Error::Internal {
                reason: format!("cacher list: {e}"),
            })?;
        let (hold, term) = held?;
        self.propose_in_hold(
            hold,
            term,
            Command::CloseSession {
                session: req.session,
            },
        )
        .await
    }

    /// A session's acknowledgements of invalidations.
    pub(super) fn ack(&self, req: &Request, me: &Acting, ids: Vec<u64>) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        // Dropped unless the session is open here: the cacher list waits only for sessions
        // the state holds.
        if self.refuse_foreign(&[req.session], me)?.is_empty() {
            return Ok(Reply::Acked);
        }
        self.cachers.do_send(Ack {
            session: req.session,
            ids,
        });
        Ok(Reply::Acked)
    }

    /// Acknowledgements of many sessions (a proxy's, or a client's batch): a client's is
    /// refused as a whole if it may not use one of them; in a proxy's, those for such a
    /// session are dropped.
    pub(super) fn ack_batch(&self, acks: Vec<(SessionId, Vec<u64>)>, me: &Acting) -> Response {
        path::validate_ack_batch(&acks)?;
        let sessions: Vec<SessionId> = acks.iter().map(|(s, _)| *s).collect();
        let open = self.refuse_foreign(&sessions, me)?;
        for (session, ids) in acks {
            if open.contains(&session) {
                self.cachers.do_send(Ack { session, ids });
            }
        }
        Ok(Reply::Acked)
    }

    /// Renews many sessions with one leadership check (the session manager coalesces the
    /// checks of KeepAlives in flight together). Fails as a whole only when this replica
    /// does not lead; otherwise says which sessions were renewed and which are over.
    /// A client's batch is refused as a whole, renewing nothing, if it may not use one of
    /// the sessions; in a proxy's, such a session alone is answered `NotSessionOwner`.
    pub(super) async fn keepalive_batch(
        &self,
        sessions: Vec<u64>,
        me: &Acting,
        received: Instant,
    ) -> Response {
        path::validate_keepalive_batch(&sessions)?;
        self.refuse_foreign(&sessions, me)?;
        self.keepalive_stats.rpcs.fetch_add(1, Ordering::Relaxed);
        let overdue = self.overdue(&sessions).await;
        let sessions: Vec<SessionId> = if overdue.is_empty() {
            sessions
        } else {
            sessions
                .into_iter()
                .filter(|s| !overdue.contains(s))
                .collect()
        };
        let results = match self
            .sessions
            .send(KeepAliveMany {
                sessions: sessions.clone(),
                acting: me.clone(),
                received,
            })
            .await
        {
            Ok(results) => results,
            Err(e) => {
                return Err(Error::Internal {
                    reason: format!("session manager: {e}"),
                })
            }
        };
        // Overdue sessions are in none of the lists: not renewed, and not reported as
        // expired either (a proxy would then stop waiting for them at once, while the
        // client's own lease may still let it serve from its cache). Their waiters at the
        // proxy time out, their clients fall into jeopardy, and once their leases run
        // out here they are reported expired like any other.
        let (mut renewed, mut expired, mut unknown) = (Vec::new(), Vec::new(), Vec::new());
        let mut first_err = None;
        let mut failed = Vec::new();
        for (&session, r) in sessions.iter().zip(results) {
            match r {
                Ok(_) => renewed.push(session),
                Err(Error::SessionExpired { .. }) => expired.push(session),
                Err(Error::UnknownSession { .. }) => unknown.push(session),
                Err(e) => {
                    failed.push(session);
                    first_err.get_or_insert(e);
                }
            }
        }
        tracing::debug!(
            sessions = %IdRanges(&sessions),
            renewed = renewed.len(),
            expired = %IdRanges(&expired),
            unknown = %IdRanges(&unknown),
            failed = %IdRanges(&failed),
            first_err = ?first_err,
            ms = received.elapsed().as_millis() as u64,
            "KeepAliveBatch"
        );
        if renewed.is_empty() && expired.is_empty() && unknown.is_empty() {
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        self.keepalive_stats
            .renewed
            .fetch_add(renewed.len() as u64, Ordering::Relaxed);
        // Cachers among them hear of overdue invalidations here too.
        let cachers = self.cachers_among(&renewed);
        let unacknowledged = if cachers.is_empty() {
            Vec::new()
        } else {
            self.cachers
                .send(UnacknowledgedMany(cachers))
                .await
                .unwrap_or_default()
        };
        Ok(Reply::KeepAliveBatch {
            session_lease_ms: self.lease_ms,
            renewed,
            expired,
            unknown,
            unacknowledged,
        })
    }

    /// Refuses with [`Error::NotSessionOwner`] if one of `sessions`, open in the state,
    /// belongs to someone `me` may not act for; else the open ones. Sessions the state
    /// does not hold (ended, or not applied here yet) are left out, not refused: the
    /// session manager's renewal reads the state again and answers them, and an
    /// acknowledgement for them is dropped. In a proxy's own batch a session it may not
    /// act for is left out too (and logged), so that one bad id in it costs the proxy's
    /// other clients nothing: the session manager answers it `NotSessionOwner`.
    pub(super) fn refuse_foreign(
        &self,
        sessions: &[SessionId],
        me: &Acting,
    ) -> Result<wire::hash::HashSet<SessionId>, Error> {
        let s = self.state.read().expect("state lock");
        let mut open = wire::hash::HashSet::default();
        for &id in sessions {
            match s.sm.check_session_for(id, me) {
                Ok(_) => {
                    open.insert(id);
                }
                Err(e @ Error::NotSessionOwner { .. }) if !me.proxy_batch => return Err(e),
                Err(Error::NotSessionOwner { .. }) => {
                    tracing::warn!(
                        session = id,
                        proxy = %me.identity,
                        "a proxy's batch names a session no client owns; left out"
                    );
                }
                Err(_) => {}
            }
        }
        Ok(open)
    }

    /// Of `sessions`, those open in the state that have cached something (one read of the
    /// state for them all).
    pub(super) fn cachers_among(&self, sessions: &[SessionId]) -> Vec<SessionId> {
        let s = self.state.read().expect("state lock");
        sessions
            .iter()
            .copied()
            .filter(|id| s.sm.check_session(*id).is_ok_and(|x| x.caches))
            .collect()
    }

    /// Of `sessions` (renewing now), the cachers that a hold has waited for (an
    /// unacknowledged invalidation, or after a fail-over an unconfirmed flush) for
    /// [`OVERDUE_LEASES`] leases: they are not renewed (a single KeepAlive is answered
    /// `SessionExpired`; in a batch they are left out of every list), so their leases run
    /// out here within one more lease and the writes held for them go on. A client that renews but never acknowledges (a bug,
    /// or a stuck event stream while it ignores the invalidations repeated in its
    /// KeepAlive replies) loses its session, and with it its cache, instead of holding
    /// writes to its nodes (and the ends of other sessions whose ephemerals it cached)
    /// for as long as it lives. So a hold waits at most for every cacher's
    /// acknowledgement or the end of its lease, and that end comes at most
    /// `OVERDUE_LEASES + 1` leases after the hold began.
    pub(super) async fn overdue(&self, sessions: &[SessionId]) -> Vec<SessionId> {
        let cachers = self.cachers_among(sessions);
        if cachers.is_empty() {
            return Vec::new();
        }
        let age = Duration::from_millis(self.lease_ms) * OVERDUE_LEASES;
        let overdue = self
            .cachers
            .send(Overdue {
                sessions: cachers,
                age,
            })
            .await
            .unwrap_or_default();
        if !overdue.is_empty() {
            tracing::warn!(
                sessions = %IdRanges(&overdue),
                after_ms = age.as_millis() as u64,
                "sessions renew but leave invalidations unacknowledged: no longer renewed, \
                 they lose their cache with their session"
            );
        }
        overdue
    }

    /// Serves a session's event stream: confirms leadership, attaches the stream to the
    /// watch table, then forwards events until the session ends, leadership changes, or
    /// the client goes away.
    pub async fn serve_events(
        &self,
        session: wire::types::SessionId,
        me: &Acting,
        mut send: quinn::SendStream,
    ) {
        let mut term = 0;
        let opened: Response = async {
            if session == 0 {
                return Err(Error::SessionRequired);
            }
            // Before the confirmation: a stream confirms a flush only in the term it was
            // confirmed for (see `StreamConnected`). If the term moved on meanwhile, the
            // cacher list would drop the confirmation while the stream stayed attached,
            // and writes would wait for this session: refuse, and the client reopens.
            term = self.raft.metrics().borrow().current_term;
            self.gate.confirm().await?;
            if self.raft.metrics().borrow().current_term != term {
                return Err(Error::NotLeader {
                    leader_id: None,
                    leader_addr: None,
                });
            }
            let s = self.state.read().expect("state lock");
            s.sm.check_session_for(session, me)?;
            Ok(Reply::EventsOpened {
                index: s.sm.last_index(),
            })
        }
        .await;
        let opened = self.with_leader_hint(opened);
        let ok = opened.is_ok();
        if frame::write(&mut send, &opened, CLIENT_FRAME_BYTES_MAX)
            .await
            .is_err()
            || !ok
        {
            let _ = send.finish();
            return;
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        self.watches.do_send(Connect { session, tx, term });
        self.cachers.do_send(StreamConnected { session, term });
        while let Some(ev) = rx.recv().await {
            let item: Response = Ok(ev);
            if frame::write(&mut send, &item, CLIENT_FRAME_BYTES_MAX)
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = send.finish();
    }
}
