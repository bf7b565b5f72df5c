//! The clients' sessions as this proxy sees them: leases (renewed through its KeepAlive
//! batches), invalidations a client owes an acknowledgement for, and its event stream.

use super::*;

impl Hub {
    /// A KeepAlive of `session` received at `received` was renewed by the leader for
    /// `lease` (the lease the client is told: the same value, so that the proxy never
    /// takes a shorter one than the client's own clock runs on).
    pub fn renewed(&self, session: SessionId, received: Instant, lease: Duration) {
        let mut t = lock(&self.t);
        let c = t.client(session, lease);
        c.lease_until = if c.renewed {
            c.lease_until.max(received + lease)
        } else {
            received + lease
        };
        c.renewed = true;
    }

    /// A session was opened through this proxy by a request received at `received`: the
    /// leader started its lease of `lease_ms` (its answer, which the client is told) after
    /// that. A client's session can be opened before the proxy's own, whose answer tells
    /// the proxy the cell's lease; the proxy's default taken in its place made it wait
    /// for the client too long (a shorter cell lease) or, with a longer one, stop waiting
    /// for it while its cache was still valid. The hub-wide lease (the proxy's own
    /// session's) is left alone: only answers to the proxy's own requests set it.
    pub fn opened(&self, session: SessionId, received: Instant, lease_ms: u64) {
        self.renewed(session, received, Duration::from_millis(lease_ms));
    }

    /// Whether `identity` owns `session`, if this proxy knows the owner (`None`: it does
    /// not). Compared under the lock: every KeepAlive through the proxy asks.
    pub fn owned_by(&self, session: SessionId, identity: &str) -> Option<bool> {
        lock(&self.t)
            .clients
            .get(&session)
            .and_then(|c| c.owner.as_deref().map(|o| o == identity))
    }

    /// Records that `owner` owns `session` (forgotten with the session's other state).
    pub fn set_owner(&self, session: SessionId, owner: &str) {
        let lease = self.lease();
        lock(&self.t).client(session, lease).owner = Some(owner.to_string());
    }

    /// Sessions this proxy currently knows of.
    pub fn session_count(&self) -> usize {
        lock(&self.t).clients.len()
    }

    /// The invalidations `session` has not acknowledged although they were relayed at
    /// least `age` ago, the oldest first, at most `max` (for its KeepAlive reply).
    pub fn unacknowledged(
        &self,
        session: SessionId,
        age: Duration,
        max: usize,
    ) -> Vec<(u64, Vec<String>)> {
        self.unacknowledged_many(&[session], age, max)
            .remove(&session)
            .unwrap_or_default()
    }

    /// True when `session` has left an invalidation relayed here unacknowledged for `age`
    /// or longer at `now`.
    pub fn overdue(&self, session: SessionId, now: Instant, age: Duration) -> bool {
        let t = lock(&self.t);
        t.waiting_on.get(&session).is_some_and(|ids| {
            ids.iter().any(|id| {
                t.pending
                    .get(id)
                    .is_some_and(|p| now.saturating_duration_since(p.since) >= age)
            })
        })
    }

    /// [`Hub::unacknowledged`] for many sessions in one pass over the pending
    /// invalidations (sessions with none are left out). One pass, not one per session:
    /// after a reset there is a pending invalidation per client, and a batch renews
    /// thousands of them, so a pass per session held the table for seconds (every client
    /// request waited, and the next KeepAlive batch went out seconds late).
    pub fn unacknowledged_many(
        &self,
        sessions: &[SessionId],
        age: Duration,
        max: usize,
    ) -> HashMap<SessionId, Vec<(u64, Vec<String>)>> {
        let mut found: HashMap<SessionId, Vec<(Instant, u64, Vec<String>)>> = HashMap::default();
        let now = Instant::now();
        {
            let t = lock(&self.t);
            for s in sessions {
                for id in t.waiting_on.get(s).into_iter().flatten() {
                    let Some(p) = t.pending.get(id) else {
                        continue;
                    };
                    if now.saturating_duration_since(p.since) < age {
                        continue;
                    }
                    if let Some(paths) = p.waiting.get(s) {
                        found
                            .entry(*s)
                            .or_default()
                            .push((p.since, *id, paths.clone()));
                    }
                }
            }
        }
        found
            .into_iter()
            .map(|(s, mut v)| {
                v.sort();
                v.truncate(max);
                (s, v.into_iter().map(|(_, id, paths)| (id, paths)).collect())
            })
            .collect()
    }

    /// Invalidations waiting for client acknowledgements, and the age of the oldest.
    pub fn pending_invalidations(&self) -> (usize, Duration) {
        let t = lock(&self.t);
        let oldest = t
            .pending
            .values()
            .map(|p| p.since.elapsed())
            .max()
            .unwrap_or_default();
        (t.pending.len(), oldest)
    }

    /// (node, kind) watches held upstream.
    pub fn upstream_watch_count(&self) -> usize {
        lock(&self.t).watches.len()
    }

    /// The session is over (expired, closed): its stream ends with `SessionExpired`, its
    /// watches and holdings are dropped. Returns the upstream acks this completes.
    pub fn session_ended(&self, session: SessionId) -> Vec<UpstreamAck> {
        let mut t = lock(&self.t);
        t.forget_holder(session);
        t.drop_watches_of(session);
        if let Some(c) = t.clients.remove(&session) {
            if let Some((_, tx)) = c.sink {
                let _ = tx.send(Err(Error::SessionExpired { session }));
            }
        }
        t.stop_waiting_for(session)
    }

    /// Attaches a client's event stream; queued items are sent first. Returns its id.
    pub fn attach_stream(&self, session: SessionId, tx: UnboundedSender<Response>) -> u64 {
        let lease = self.lease();
        let mut t = lock(&self.t);
        t.next_stream += 1;
        let id = t.next_stream;
        let mut resend: Vec<(u64, Vec<String>)> = t
            .waiting_on
            .get(&session)
            .into_iter()
            .flatten()
            .filter_map(|pid| {
                let paths = t.pending.get(pid)?.waiting.get(&session)?;
                Some((*pid, paths.clone()))
            })
            .collect();
        resend.sort();
        let c = t.client(session, lease);
        for (pid, paths) in resend {
            c.queued.push_back(Ok(Reply::Invalidate { id: pid, paths }));
        }
        while let Some(item) = c.queued.pop_front() {
            if let Err(e) = tx.send(item) {
                c.queued.push_front(e.0);
                return id;
            }
        }
        c.sink = Some((id, tx));
        id
    }

    /// Items taken for a stream that broke before they were written: kept for the next
    /// stream of the session.
    pub fn requeue(&self, session: SessionId, items: Vec<Response>) {
        let mut t = lock(&self.t);
        if let Some(c) = t.clients.get_mut(&session) {
            for item in items.into_iter().rev() {
                c.queued.push_front(item);
            }
            while c.queued.len() > QUEUED_MAX {
                c.queued.pop_back();
            }
        }
    }

    /// Detaches a client's stream if `id` is still the attached one.
    pub fn detach_stream(&self, session: SessionId, id: u64) {
        let mut t = lock(&self.t);
        if let Some(c) = t.clients.get_mut(&session) {
            if c.sink.as_ref().is_some_and(|(s, _)| *s == id) {
                c.sink = None;
            }
        }
    }
}
