//! The cache: reads answered here, the clients holding each node, invalidations relayed
//! to them and acknowledged upstream once all have answered (or their leases ran out),
//! and the resets that flush everything when the upstream session or stream is lost.

use super::*;

impl Hub {
    /// A cached read served here, if the proxy holds the node and may serve it: the
    /// client is recorded as a holder first.
    pub fn cache_lookup(
        &self,
        session: SessionId,
        identity: &str,
        path: &str,
    ) -> Result<Reply, Snapshot> {
        let mut t = lock(&self.t);
        let ready = self.ready();
        let snap = Snapshot {
            generation: t.generation,
            seq: t.inval_seq,
            ready,
        };
        if !ready || !t.live(session, Instant::now()) {
            return Err(snap);
        }
        let Some(e) = t.cache.get(path).cloned() else {
            return Err(snap);
        };
        // Served only to an identity the leader answered for this copy.
        if !e.readers.contains(identity) {
            return Err(snap);
        }
        t.record_holder(session, path);
        self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
        Ok(Reply::CachedData {
            value: e.value,
            index: e.index,
            cachable: true,
        })
    }

    /// An upstream cached read came back: cache it and record the client, unless the
    /// node was invalidated or the upstream reset since `snap` (then the answer is passed
    /// on as not cachable).
    #[allow(clippy::too_many_arguments)]
    pub fn cache_fill(
        &self,
        session: SessionId,
        identity: &str,
        path: &str,
        snap: Snapshot,
        value: Option<(Vec<u8>, NodeStat)>,
        index: LogIndex,
        cachable: bool,
    ) -> Reply {
        let mut t = lock(&self.t);
        t.last_index = t.last_index.max(index);
        let raced = !snap.ready
            || t.generation != snap.generation
            || seq_touched(&t.recent_inval, snap.seq, t.inval_seq, |p| p == path);
        let cachable = cachable && self.ready() && !raced;
        if cachable {
            // No invalidation of the node since the read began: a copy cached meanwhile
            // holds the same value, and its readers stay readers.
            let mut readers = t.cache.remove(path).map(|e| e.readers).unwrap_or_default();
            readers.insert(identity.to_string());
            t.cache.insert(
                path.to_string(),
                Entry {
                    value: value.clone(),
                    index,
                    readers,
                },
            );
        }
        // Only a client this proxy renews may be told to cache: the proxy must know its
        // lease to stop waiting for it when it goes silent.
        let cachable = cachable && t.live(session, Instant::now());
        if cachable {
            t.record_holder(session, path);
        }
        Reply::CachedData {
            value,
            index,
            cachable,
        }
    }

    /// The leader invalidated `paths` (invalidation `id` of the proxy's `session`): drop
    /// them and relay to their holders. Returns the upstream ack if no holder is waited for.
    pub fn invalidate(
        &self,
        session: SessionId,
        id: u64,
        paths: Vec<String>,
    ) -> Option<UpstreamAck> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        // Sent again (a KeepAlive reply repeats what is overdue): still being relayed, so
        // acknowledged upstream only when the clients are done. Treating it as new would
        // find no holders (they were taken the first time) and acknowledge at once.
        if t.by_upstream.contains_key(&(session, id)) {
            return None;
        }
        let mut per_client: HashMap<SessionId, Vec<String>> = HashMap::default();
        // A client that has not acknowledged an earlier invalidation of one of these nodes
        // may still serve it from its cache (the message may be stuck, or the client cut
        // off): its holding was taken by the earlier relay, so without this the leader's
        // next write to the node would be acknowledged at once and complete while that
        // client still serves the value of two writes ago. It is told again and waited
        // for, as the leader waits for a cacher until it acknowledges.
        {
            let wanted: HashSet<&String> = paths.iter().collect();
            for q in t.pending.values() {
                for (c, held) in &q.waiting {
                    for p in held.iter().filter(|p| wanted.contains(p)) {
                        per_client.entry(*c).or_default().push(p.clone());
                    }
                }
            }
        }
        for p in paths {
            t.inval_seq += 1;
            let seq = t.inval_seq;
            t.recent_inval.push_back((seq, p.clone()));
            while t.recent_inval.len() > RECENT_MAX {
                t.recent_inval.pop_front();
            }
            t.cache.remove(&p);
            for c in t.holders.remove(&p).unwrap_or_default() {
                if let Some(cs) = t.clients.get_mut(&c) {
                    cs.paths.remove(&p);
                }
                per_client.entry(c).or_default().push(p.clone());
            }
        }
        tracing::debug!(
            upstream = id,
            holders = ?per_client.keys().collect::<Vec<_>>(),
            "invalidation from the leader"
        );
        if per_client.is_empty() {
            return Some((session, id));
        }
        for held in per_client.values_mut() {
            held.sort();
            held.dedup();
        }
        t.next_id += 1;
        let local = t.next_id;
        t.add_pending(
            local,
            Pending {
                since: Instant::now(),
                upstream: Some((session, id)),
                waiting: per_client.clone(),
            },
        );
        for (c, paths) in per_client {
            self.counters
                .invalidations_relayed
                .fetch_add(1, Ordering::Relaxed);
            t.deliver(c, Ok(Reply::Invalidate { id: local, paths }), lease);
        }
        None
    }

    /// A client acknowledged invalidations; returns the upstream acks now owed.
    pub fn ack(&self, session: SessionId, ids: &[u64]) -> Vec<UpstreamAck> {
        tracing::debug!(session, ?ids, "a client acknowledged invalidations");
        let mut t = lock(&self.t);
        let mut done = Vec::new();
        for id in ids {
            if t.stop_waiting(*id, session) {
                done.push(*id);
            }
        }
        t.finish(done)
    }

    /// The upstream session or stream is being reset: nothing cached here can be trusted
    /// to be invalidated any more. Drops the cache, invalidates every holder of anything,
    /// and returns the local invalidations to wait for before reconnecting upstream (the
    /// leader takes the reconnection as this proxy's confirmation that it flushed).
    pub fn reset(&self) -> Vec<u64> {
        let lease = self.lease();
        let mut t = lock(&self.t);
        // Under the table lock, as `set_ready(true)` clears `flushed` under it: a resume
        // landing between the two could otherwise leave the proxy ready with `flushed` set,
        // and a later reconnection would reuse this reset although values were cached since.
        self.ready.store(false, Ordering::SeqCst);
        t.generation += 1;
        t.cache.clear();
        t.holders.clear();
        let holding: Vec<(SessionId, Vec<String>)> = t
            .clients
            .iter_mut()
            .filter(|(_, c)| !c.paths.is_empty())
            .map(|(s, c)| (*s, c.paths.drain().collect()))
            .collect();
        let mut ids = Vec::new();
        for (s, paths) in holding {
            t.next_id += 1;
            let id = t.next_id;
            t.add_pending(
                id,
                Pending {
                    since: Instant::now(),
                    upstream: None,
                    waiting: [(s, paths.clone())].into_iter().collect(),
                },
            );
            self.counters
                .invalidations_relayed
                .fetch_add(1, Ordering::Relaxed);
            t.deliver(s, Ok(Reply::Invalidate { id, paths }), lease);
            ids.push(id);
        }
        t.flushed = Some(ids.clone());
        ids
    }

    /// A reset before reconnecting upstream, unless the latest reset already flushed
    /// everything and the proxy has not been ready since (it flushed ahead, when the
    /// leader went silent): then that reset's invalidations, still to be waited for.
    /// Returns the local invalidations to wait for and whether they are the earlier ones.
    pub fn reset_unless_flushed(&self) -> (Vec<u64>, bool) {
        {
            let t = lock(&self.t);
            if !self.ready.load(Ordering::SeqCst) {
                if let Some(ids) = &t.flushed {
                    return (ids.clone(), true);
                }
            }
        }
        (self.reset(), false)
    }

    /// True once no client owes the acknowledgement of anything relayed or flushed here
    /// (or its lease ran out): what the proxy must know before reopening its stream tells a
    /// new leader that nothing cached through it is left. Not only the latest reset's
    /// invalidations: a client that still owes an earlier one (a flush ahead the leader
    /// answered after all, or a write's invalidation the old leader was waiting for) holds
    /// no paths any more, so a new reset does not include it, yet it may still serve the
    /// value from its cache.
    pub fn nothing_owed(&self) -> bool {
        lock(&self.t).pending.is_empty()
    }

    /// True once none of `ids` is pending.
    pub fn all_done(&self, ids: &[u64]) -> bool {
        let t = lock(&self.t);
        ids.iter().all(|id| !t.pending.contains_key(id))
    }

    /// Periodic upkeep: clients whose lease (as seen here) ran out stop being waited for;
    /// long-silent clients are forgotten. Returns the upstream acks now owed.
    pub fn tick(&self, now: Instant) -> Vec<UpstreamAck> {
        let mut t = lock(&self.t);
        let mut done = Vec::new();
        let t = &mut *t;
        let clients = &t.clients;
        let mut gone = Vec::new();
        for (id, p) in t.pending.iter_mut() {
            p.waiting.retain(|c, _| {
                let live = clients.get(c).is_some_and(|cs| cs.lease_until > now);
                if !live {
                    gone.push((*c, *id));
                }
                live
            });
            if p.waiting.is_empty() {
                done.push(*id);
            }
        }
        for (c, id) in gone {
            tracing::debug!(
                session = c,
                id,
                "invalidation no longer waits: lease ran out here"
            );
            t.unindex(c, id);
        }
        let forget: Vec<SessionId> = t
            .clients
            .iter()
            .filter(|(_, c)| c.sink.is_none() && c.lease_until + FORGET_AFTER < now)
            .map(|(s, _)| *s)
            .collect();
        for s in forget {
            t.forget_holder(s);
            t.drop_watches_of(s);
            t.clients.remove(&s);
        }
        t.finish(done)
    }
}
