//! The cacher-list actor (leader-only): records cached reads, holds writes to cached nodes
//! until every cacher dropped the value (or its session ended), and sends the
//! invalidations on the sessions' event streams. The logic is [`Cachers`].

use tokio::time::Instant;
use wire::hash::{HashMap, HashSet};

use actix::{Actor, Addr, Context, Handler, Message, ResponseFuture};
use tokio::sync::oneshot;
use wire::command::Effect;
use wire::types::{Reply, SessionId};
use wire::Error;

use crate::actors::messages::{AppliedMsg, LeadershipChanged};
use crate::actors::watch_table::{Push, WatchTableActor};
use crate::leader::cachers::Cachers;
use crate::raft::sm_store::{Applied, SharedState};

/// Phase one of a cached read: this leader's term and the node's hold epoch; `None` while
/// the node is uncachable, or while this actor has not yet learnt that its replica leads.
#[derive(Message)]
#[rtype(result = "Option<(u64, u64)>")]
pub struct BeginRead(pub String);

/// Phase two: record the cacher if the replica still leads in `term`, no hold started
/// since `epoch`, the reading session is still open (and its lease has not run out
/// here), and the node read is not an ephemeral of a session whose end is in flight.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Record {
    /// The reading session.
    pub session: SessionId,
    /// The node.
    pub path: String,
    /// From [`BeginRead`].
    pub term: u64,
    /// From [`BeginRead`].
    pub epoch: u64,
    /// The owner of the node as read, if it is an ephemeral.
    pub owner: Option<SessionId>,
    /// The node as read: its `(create_index, mod_index)`, or `None` if it was absent.
    /// Recorded only if the node is still so: a change between the read and the record
    /// that no hold covered (an end deleting an ephemeral created after the end's hold
    /// began, applied and unmarked before this record arrived) would otherwise be cached.
    pub seen: Option<(u64, u64)>,
}

/// Hold a write to `paths`: resolves with the hold's id and this leader's term once every
/// cacher dropped them; `NotLeader` while this actor has not learnt that its replica
/// leads (a hold then would wait for no one: the replica's cachers of an earlier term
/// are gone and the sessions of earlier leaders are not yet known to be unconfirmed).
/// The write must be proposed as [`wire::command::Command::Held`] in that term.
#[derive(Message)]
#[rtype(result = "Result<(u64, u64), Error>")]
pub struct Hold(pub Vec<String>);

/// Hold the end of `sessions` (their close, or their expiry when `lease_ran_out`): from
/// this message on, no ephemeral they own is recorded as cached, and the hold covers
/// every ephemeral they own now. An ephemeral one of them creates later (a write already
/// on its way) is then never cached before the end applies and deletes it, so no cache
/// keeps a node the end removed. Resolves like [`Hold`]; the hold id is `None` when they
/// own nothing (nothing to wait for), and the end must still be proposed as
/// [`wire::command::Command::Held`] in the term returned: in a later term the marks are
/// gone.
#[derive(Message)]
#[rtype(result = "Result<(Option<u64>, u64), Error>")]
pub struct HoldEnd {
    /// The sessions that end.
    pub sessions: Vec<SessionId>,
    /// Their leases ran out at this leader (see [`LeaseExpired`]).
    pub lease_ran_out: bool,
}

/// The held write was applied or failed: the nodes become cachable again.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Release(pub u64);

/// A session acknowledged invalidations.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Ack {
    /// The session.
    pub session: SessionId,
    /// Invalidation ids.
    pub ids: Vec<u64>,
}

/// These sessions' leases ran out at the leader: their clients' own leases (which run from
/// when they sent their KeepAlives) ended earlier still, so they serve nothing from their
/// caches any more. Holds stop waiting for them.
#[derive(Message)]
#[rtype(result = "()")]
pub struct LeaseExpired(pub Vec<SessionId>);

/// A session's event stream attached to this leader. The SDK flushes its cache before it
/// (re)opens its stream, so after a fail-over this confirms the session no longer holds
/// values cached from the old leader.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StreamConnected {
    /// The session.
    pub session: SessionId,
    /// The replica's Raft term when the stream asked to attach (read before leadership was
    /// confirmed for it): a confirmation counts only in that term, and is kept until this
    /// actor learns of that term if it arrives first.
    pub term: u64,
}

/// The invalidations a session has left unacknowledged for a while, to repeat in its
/// KeepAlive reply (see [`wire::types::Reply::KeepAlive`]).
#[derive(Message)]
#[rtype(result = "Vec<(u64, Vec<String>)>")]
pub struct Unacknowledged(pub SessionId);

/// [`Unacknowledged`] for many sessions (a batched KeepAlive): (session, id, nodes).
#[derive(Message)]
#[rtype(result = "Vec<(SessionId, u64, Vec<String>)>")]
pub struct UnacknowledgedMany(pub Vec<SessionId>);

/// Of these sessions, those that have left an invalidation unacknowledged for the given
/// age or longer: a client that renews but never acknowledges would hold writes to its
/// cached nodes for as long as it lives, so the gateway stops renewing them (their leases
/// then run out, and the holds go on).
#[derive(Message)]
#[rtype(result = "Vec<SessionId>")]
pub struct Overdue {
    /// The sessions renewing now.
    pub sessions: Vec<SessionId>,
    /// How long an invalidation may stay unacknowledged.
    pub age: std::time::Duration,
}

/// Number of cacher records and age of the oldest waiting invalidation (ms).
#[derive(Message)]
#[rtype(result = "CacherStats")]
pub struct Stats;

/// The answer to [`Stats`].
#[derive(Debug, Clone, Copy, actix::MessageResponse)]
pub struct CacherStats {
    /// (session, node) records.
    pub cachers: u64,
    /// Age of the oldest waiting invalidation, ms.
    pub oldest_invalidation_ms: u64,
    /// Invalidations sent since this replica started (one per cacher and hold).
    pub invalidations_sent: u64,
    /// Writes held now, waiting for acknowledgements.
    pub holds_waiting: u64,
}

/// After a fail-over: the old leader's list of cachers is gone, so every session created
/// before this leader took over may cache anything until it confirms a flush.
#[derive(Debug)]
struct Failover {
    /// Sessions opened by entries at or below this index were created by earlier leaders.
    boundary: u64,
    /// Sessions that confirmed a flush, or whose lease ran out at this leader (their
    /// clients stopped serving from their caches before that, and this leader will never
    /// renew them): neither is waited for. Without the second, the expiry of an old
    /// cacher that never reconnected (a crashed proxy's session) waited, through the
    /// hold on its ephemerals or on any write, for that very session to confirm: every
    /// write stalled until something else ended it (simulation seed 5).
    confirmed: HashSet<SessionId>,
    /// When this replica took over (for the log line when the last one confirms).
    since: tokio::time::Instant,
}

pub use crate::raft::Metrics;

/// The actor.
pub struct CacherListActor {
    cachers: Cachers,
    streams: Addr<WatchTableActor>,
    waiters: HashMap<u64, oneshot::Sender<()>>,
    state: SharedState,
    failover: Option<Failover>,
    /// The term this replica leads in, as last announced by [`LeadershipChanged`].
    term: Option<u64>,
    /// Streams attached in a term this actor has not been told of yet: (term, session).
    early: Vec<(u64, SessionId)>,
    /// openraft's own view, checked at each hold and cached read: the announcement may
    /// lag (a watch on the metrics), and the term above is only the last one announced.
    metrics: Option<Metrics>,
    invalidations_sent: u64,
    /// Sessions whose end is in flight at this leader (a [`HoldEnd`]) or whose lease ran
    /// out here ([`LeaseExpired`]): their ephemerals are not cachable and they are not
    /// recorded as cachers. Until their end applies, or leadership changes.
    ending: HashSet<SessionId>,
}

impl CacherListActor {
    /// Sends invalidations through the event streams `streams` manages.
    pub fn new(streams: Addr<WatchTableActor>, state: SharedState) -> CacherListActor {
        CacherListActor {
            metrics: None,
            cachers: Cachers::new(),
            streams,
            waiters: HashMap::default(),
            state,
            failover: None,
            term: None,
            early: Vec::new(),
            invalidations_sent: 0,
            ending: HashSet::default(),
        }
    }

    /// Also checks openraft's metrics before each hold and cached read: this replica must
    /// lead now, in the term last announced.
    pub fn with_metrics(mut self, metrics: Metrics) -> CacherListActor {
        self.metrics = Some(metrics);
        self
    }

    /// The term this replica leads in, if it leads now in the one last announced.
    fn leading_term(&self) -> Option<u64> {
        let term = self.term?;
        match &self.metrics {
            Some(m) => crate::raft::leading_term(m).filter(|t| *t == term),
            None => Some(term),
        }
    }

    /// Sessions from earlier leaders that have not confirmed a flush yet; leaves fail-over
    /// mode once there are none. `None` while this replica has not applied its log up to
    /// the takeover: a session created or marked as a cacher before it may not be in the
    /// state yet, and would not be waited for.
    fn unconfirmed(&mut self) -> Option<HashSet<SessionId>> {
        let Some(f) = &self.failover else {
            return Some(HashSet::default());
        };
        let set: HashSet<SessionId> = {
            let s = self.state.read().expect("state lock");
            if s.last_applied.map_or(0, |l| l.index) < f.boundary {
                return None;
            }
            s.sm.sessions()
                .filter(|(id, sess)| {
                    sess.caches
                        && wire::types::session_index(*id) <= f.boundary
                        && !f.confirmed.contains(id)
                })
                .map(|(id, _)| id)
                .collect()
        };
        if set.is_empty() {
            tracing::info!(
                confirmed = f.confirmed.len(),
                after_ms = f.since.elapsed().as_millis() as u64,
                "fail-over over: a write found every earlier cacher confirmed its flush"
            );
            self.failover = None;
        }
        Some(set)
    }

    fn complete(&mut self, id: u64) {
        if let Some(tx) = self.waiters.remove(&id) {
            let _ = tx.send(());
        }
    }
}

impl Actor for CacherListActor {
    type Context = Context<Self>;
}

impl Handler<BeginRead> for CacherListActor {
    type Result = Option<(u64, u64)>;

    fn handle(&mut self, msg: BeginRead, _: &mut Context<Self>) -> Option<(u64, u64)> {
        let term = self.leading_term()?;
        self.cachers.begin_read(&msg.0).map(|epoch| (term, epoch))
    }
}

impl Handler<Record> for CacherListActor {
    type Result = bool;

    fn handle(&mut self, msg: Record, _: &mut Context<Self>) -> bool {
        // In another term the table was cleared since `BeginRead`: its epoch means nothing.
        if self.leading_term() != Some(msg.term) {
            return false;
        }
        // An ephemeral whose owner is ending may be deleted by an end that does not hold
        // it (it was created after the end's hold began).
        if msg.owner.is_some_and(|o| self.ending.contains(&o)) || self.ending.contains(&msg.session)
        {
            return false;
        }
        // A session that ended after the gateway read the state: recorded, it would be a
        // cacher nobody removes (its `SessionEnded` was handled already), and every later
        // hold on the node would wait for it for ever. The state is applied before the
        // effect is sent here, so either this sees the end or the effect comes after.
        {
            let s = self.state.read().expect("state lock");
            if s.sm.check_session(msg.session).is_err() {
                return false;
            }
            let now = s.sm.node(&msg.path).map(|n| (n.create_index, n.mod_index));
            if now != msg.seen {
                return false;
            }
        }
        self.cachers.record(msg.session, &msg.path, msg.epoch)
    }
}

impl CacherListActor {
    /// Starts a hold on `paths` (see [`Hold`]); with `quiet_if_empty`, a hold on no path
    /// waits for nobody (not even the sessions of earlier leaders: it changes no node
    /// they may cache) and makes no entry in the table (`None`).
    fn start_hold(
        &mut self,
        paths: Vec<String>,
        quiet_if_empty: bool,
    ) -> ResponseFuture<Result<(Option<u64>, u64), Error>> {
        let Some(term) = self.leading_term() else {
            return Box::pin(async {
                Err(Error::NotLeader {
                    leader_id: None,
                    leader_addr: None,
                })
            });
        };
        if quiet_if_empty && paths.is_empty() {
            return Box::pin(async move { Ok((None, term)) });
        }
        let Some(unconfirmed) = self.unconfirmed() else {
            return Box::pin(async {
                Err(Error::Unavailable {
                    reason: "a new leader is still applying its log; retry".into(),
                })
            });
        };
        let unconfirmed_ids: Vec<SessionId> = if tracing::enabled!(tracing::Level::DEBUG) {
            let mut v: Vec<SessionId> = unconfirmed.iter().copied().collect();
            v.sort_unstable();
            v
        } else {
            Vec::new()
        };
        let (id, sends) = self.cachers.hold(&paths, Instant::now(), unconfirmed);
        tracing::debug!(
            id,
            paths = ?paths,
            waits_for = ?sends.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            unconfirmed = ?unconfirmed_ids,
            "write held for cachers"
        );
        for (session, paths) in sends {
            self.invalidations_sent += 1;
            self.streams.do_send(Push {
                session,
                item: Reply::Invalidate { id, paths },
            });
        }
        if self.cachers.hold_complete(id) {
            return Box::pin(async move { Ok((Some(id), term)) });
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.insert(id, tx);
        Box::pin(async move {
            rx.await
                .map(|_| (Some(id), term))
                .map_err(|_| Error::NotLeader {
                    leader_id: None,
                    leader_addr: None,
                })
        })
    }

    /// `sessions`' leases ran out here: holds stop waiting for them (their clients' own
    /// leases, which run from when they sent their KeepAlives, ended earlier still).
    fn lease_expired(&mut self, sessions: &[SessionId]) {
        if let Some(f) = &mut self.failover {
            f.confirmed.extend(sessions.iter().copied());
        }
        for &session in sessions {
            for id in self.cachers.session_ended(session) {
                self.complete(id);
            }
        }
    }
}

impl Handler<Hold> for CacherListActor {
    type Result = ResponseFuture<Result<(u64, u64), Error>>;

    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) -> Self::Result {
        let held = self.start_hold(msg.0, false);
        Box::pin(async move {
            let (id, term) = held.await?;
            Ok((id.expect("a hold that is not quiet has an id"), term))
        })
    }
}

impl Handler<HoldEnd> for CacherListActor {
    type Result = ResponseFuture<Result<(Option<u64>, u64), Error>>;

    fn handle(&mut self, msg: HoldEnd, _: &mut Context<Self>) -> Self::Result {
        if self.leading_term().is_none() {
            return self.start_hold(Vec::new(), true);
        }
        // A new leader that has not applied its log up to the takeover may not know the
        // sessions' ephemerals yet (a create committed under the old leader): an end held
        // on too few nodes would delete one an earlier cacher still serves.
        if self.unconfirmed().is_none() {
            return Box::pin(async {
                Err(Error::Unavailable {
                    reason: "a new leader is still applying its log; retry".into(),
                })
            });
        }
        // Read and marked in this one handler: a cached read of an ephemeral of theirs
        // recorded before it is of a node that exists now (only its owner's delete or end
        // removes it), so the hold below invalidates it; one recorded after is refused.
        // Only sessions still open are marked (an end applies `SessionEnded`, which
        // unmarks them; a session already gone would stay marked).
        let (open, ephemerals): (Vec<SessionId>, Vec<String>) = {
            let s = self.state.read().expect("state lock");
            let open: Vec<SessionId> = msg
                .sessions
                .iter()
                .copied()
                .filter(|id| s.sm.session(*id).is_some())
                .collect();
            let mut paths: Vec<String> = open
                .iter()
                .filter_map(|id| s.sm.session(*id))
                .flat_map(|sess| sess.ephemerals.iter().cloned())
                .collect();
            paths.sort();
            paths.dedup();
            (open, paths)
        };
        if msg.lease_ran_out {
            self.lease_expired(&msg.sessions);
        }
        self.ending.extend(open);
        self.start_hold(ephemerals, true)
    }
}

impl Handler<Release> for CacherListActor {
    type Result = ();

    fn handle(&mut self, msg: Release, _: &mut Context<Self>) {
        self.cachers.release(msg.0);
    }
}

impl Handler<Ack> for CacherListActor {
    type Result = ();

    fn handle(&mut self, msg: Ack, _: &mut Context<Self>) {
        tracing::debug!(session = msg.session, ids = ?msg.ids, "invalidations acknowledged");
        for id in msg.ids {
            if self.cachers.ack(msg.session, id) {
                self.complete(id);
            }
        }
    }
}

impl Handler<LeaseExpired> for CacherListActor {
    type Result = ();

    fn handle(&mut self, msg: LeaseExpired, _: &mut Context<Self>) {
        self.lease_expired(&msg.0);
        let open: Vec<SessionId> = {
            let s = self.state.read().expect("state lock");
            msg.0
                .into_iter()
                .filter(|id| s.sm.session(*id).is_some())
                .collect()
        };
        self.ending.extend(open);
    }
}

impl Handler<AppliedMsg> for CacherListActor {
    type Result = ();

    fn handle(&mut self, msg: AppliedMsg, _: &mut Context<Self>) {
        let Applied::Effects { effects, .. } = msg.0 else {
            return;
        };
        for e in effects {
            if let Effect::SessionEnded { session } = e {
                self.ending.remove(&session);
                for id in self.cachers.session_ended(session) {
                    self.complete(id);
                }
            }
        }
    }
}

impl Handler<LeadershipChanged> for CacherListActor {
    type Result = ();

    fn handle(&mut self, msg: LeadershipChanged, _: &mut Context<Self>) {
        // Volatile: waiting writes fail (their senders are dropped) and are retried at the
        // new leader. A new leader knows no cachers, so until each older session confirms
        // it flushed (or ends), writes to cachable nodes wait for it.
        self.cachers.clear();
        self.waiters.clear();
        self.ending.clear();
        self.term = msg.leading.then_some(msg.term);
        if msg.leading {
            self.cachers.ids_above(msg.term << 32);
        }
        // Streams that attached in this term before this message arrived confirmed their
        // flush to this leader; those of earlier terms confirm nothing now.
        let term = msg.term;
        let confirmed: HashSet<SessionId> = self
            .early
            .iter()
            .filter(|(t, _)| msg.leading && *t == term)
            .map(|(_, s)| *s)
            .collect();
        self.early.retain(|(t, _)| *t > term);
        self.failover = msg.leading.then(|| Failover {
            boundary: msg.last_log_index,
            confirmed,
            since: tokio::time::Instant::now(),
        });
    }
}

impl Handler<StreamConnected> for CacherListActor {
    type Result = ();

    fn handle(&mut self, msg: StreamConnected, _: &mut Context<Self>) {
        let session = msg.session;
        match self.term {
            Some(t) if t == msg.term => {}
            // Attached while leading in an earlier term: that stream is gone or going.
            Some(t) if t > msg.term => return,
            // The replica leads in `msg.term` and this actor is not told yet.
            _ => {
                self.early.push((msg.term, session));
                return;
            }
        }
        if let Some(f) = &mut self.failover {
            f.confirmed.insert(session);
        }
        // Invalidations written to the broken stream may be lost: send them again on the
        // new one (the watch table attached it before this message was sent).
        for (id, paths) in self.cachers.unacknowledged(session) {
            self.streams.do_send(Push {
                session,
                item: Reply::Invalidate { id, paths },
            });
        }
        for id in self.cachers.confirm(session) {
            self.complete(id);
        }
    }
}

impl Handler<Unacknowledged> for CacherListActor {
    type Result = Vec<(u64, Vec<String>)>;

    fn handle(&mut self, msg: Unacknowledged, _: &mut Context<Self>) -> Self::Result {
        self.cachers.unacknowledged_older(
            msg.0,
            Instant::now(),
            std::time::Duration::from_millis(wire::INVALIDATION_RESEND_MS),
            wire::KEEPALIVE_UNACKED_MAX,
            &mut { wire::KEEPALIVE_UNACKED_BYTES_MAX },
        )
    }
}

impl Handler<UnacknowledgedMany> for CacherListActor {
    type Result = Vec<(SessionId, u64, Vec<String>)>;

    fn handle(&mut self, msg: UnacknowledgedMany, _: &mut Context<Self>) -> Self::Result {
        let now = Instant::now();
        let age = std::time::Duration::from_millis(wire::INVALIDATION_RESEND_MS);
        // One budget for the whole reply, whatever the number of sessions.
        let mut bytes = wire::KEEPALIVE_UNACKED_BYTES_MAX;
        let mut out = Vec::new();
        for s in msg.0 {
            let some = self.cachers.unacknowledged_older(
                s,
                now,
                age,
                wire::KEEPALIVE_UNACKED_MAX,
                &mut bytes,
            );
            out.extend(some.into_iter().map(|(id, paths)| (s, id, paths)));
        }
        out
    }
}

impl Handler<Overdue> for CacherListActor {
    type Result = Vec<SessionId>;

    fn handle(&mut self, msg: Overdue, _: &mut Context<Self>) -> Vec<SessionId> {
        self.cachers.overdue(&msg.sessions, Instant::now(), msg.age)
    }
}

impl Handler<Stats> for CacherListActor {
    type Result = CacherStats;

    fn handle(&mut self, _: Stats, _: &mut Context<Self>) -> CacherStats {
        CacherStats {
            cachers: self.cachers.len() as u64,
            oldest_invalidation_ms: self.cachers.oldest_waiting(Instant::now()).as_millis() as u64,
            invalidations_sent: self.invalidations_sent,
            holds_waiting: self.cachers.holds_waiting() as u64,
        }
    }
}

#[cfg(test)]
mod tests;
