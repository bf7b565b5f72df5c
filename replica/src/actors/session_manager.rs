//! The session manager: leader-only lease deadlines.
//!
//! KeepAlives extend a lease in memory after a coalesced leadership check and are never
//! logged (except the one batched checkpoint a session needs after a fail-over, see
//! [`crate::leader::leases`]). A lease that runs out becomes one committed
//! `ExpireSessions` entry. On becoming leader the table is rebuilt from the state machine
//! once everything committed before has been applied.
//!
//! Every leadership change starts a new *generation*; results of proposals and checks
//! started in an earlier generation are ignored, so they never touch the new table.

use std::time::Duration;
use tokio::time::Instant;
use wire::hash::HashMap;
use wire::metrics::prometheus_client::metrics::counter::Counter;

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture,
    WrapFuture,
};
use tokio::sync::oneshot;
use wire::command::{Command, Effect, LeaseCheckpoint};
use wire::types::{Reply, SessionId};
use wire::Error;

use crate::actors::cacher_list::{CacherListActor, HoldEnd, Release};
use crate::actors::messages::{AppliedMsg, LeadershipChanged};
use crate::actors::raft_node::{Propose, RaftNode};
use crate::leader::confirm_watch::ConfirmWatch;
use crate::leader::leases::{KeepAliveStep, Leases, Renewal};
use crate::raft::read_gate::ReadGate;
use crate::raft::sm_store::{Applied, SharedState};

/// How long to wait before retrying to load the lease table after a failed check.
const LOAD_RETRY: Duration = Duration::from_millis(100);

/// KeepAlives of one or many sessions received together at `received` (a `KeepAlive` or a
/// `KeepAliveBatch` RPC): one mailbox message and one leadership confirmation for all of
/// them, where a message each would cost a confirmation ticket and a pending actor future
/// per session (thousands per batch at a proxy's scale). Answers come in the order of
/// `sessions`.
#[derive(Message)]
#[rtype(result = "Vec<Result<Reply, Error>>")]
pub struct KeepAliveMany {
    /// The sessions.
    pub sessions: Vec<SessionId>,
    /// Who renews them: a session it may not use is answered
    /// [`Error::NotSessionOwner`] and not renewed.
    pub acting: crate::state_machine::Acting,
    /// When the replica received them (the leases run from here).
    pub received: Instant,
}

/// Number of sessions with a lease here (0 when not leading).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct LeaseCount;

/// The lease deadline of each session here (`None` for one without a lease here).
#[derive(Message)]
#[rtype(result = "Vec<Option<Instant>>")]
pub struct LeaseDeadlines(pub Vec<SessionId>);

type Waiter = (Instant, oneshot::Sender<Result<Reply, Error>>);

fn not_leader() -> Error {
    Error::NotLeader {
        leader_id: None,
        leader_addr: None,
    }
}

/// The actor.
pub struct SessionManager {
    leases: Leases,
    raft_node: Addr<RaftNode>,
    gate: ReadGate,
    state: SharedState,
    lease_ms: u64,
    scan_interval: Duration,
    leading_term: Option<u64>,
    generation: u64,
    waiting: HashMap<SessionId, Vec<Waiter>>,
    cachers: Option<Addr<CacherListActor>>,
    /// Raft's metrics (when the quorum last acknowledged this leader) and how long a
    /// silence stops the lease clock; see [`SessionManager::quorum_silent`].
    quorum: Option<(QuorumWatch, Duration)>,
    last_tick: Instant,
    /// Whether the lease clock is stopped now (for logging the change once).
    clock_stopped: bool,
    /// Leadership confirmations for KeepAlives: failing ones stop the lease clock too.
    confirms: ConfirmWatch,
    /// Sessions expired by this manager's committed expiries.
    expiries: Counter,
}

type QuorumWatch = crate::raft::Metrics;

impl SessionManager {
    /// A session manager proposing through `raft_node`.
    pub fn new(
        raft_node: Addr<RaftNode>,
        gate: ReadGate,
        state: SharedState,
        lease: Duration,
        checkpoint_interval: Duration,
        scan_interval: Duration,
    ) -> SessionManager {
        SessionManager {
            leases: Leases::new(lease, checkpoint_interval),
            raft_node,
            gate,
            state,
            lease_ms: lease.as_millis() as u64,
            scan_interval,
            leading_term: None,
            generation: 0,
            waiting: HashMap::default(),
            cachers: None,
            quorum: None,
            last_tick: Instant::now(),
            clock_stopped: false,
            confirms: ConfirmWatch::default(),
            expiries: Counter::default(),
        }
    }

    /// Stops the lease clock while this leader has heard no quorum acknowledgement for
    /// `silence` (Raft's `millis_since_quorum_ack`): KeepAlives cannot be confirmed then,
    /// through no fault of the clients (a slow or lossy link at the leader), so no lease
    /// runs out meanwhile. Also while KeepAlives' leadership confirmations fail or stall
    /// for longer than `silence` (see [`ConfirmWatch`]): with round trips just above
    /// openraft's RPC timeout, the quorum clock can look alive while no KeepAlive is
    /// confirmed. Cells of one voter have no quorum to hear from and are left out.
    pub fn with_quorum_watch(mut self, metrics: QuorumWatch, silence: Duration) -> SessionManager {
        self.quorum = Some((metrics, silence));
        self
    }

    /// True while a leader of several voters has not heard a quorum for the set silence.
    fn quorum_silent(&self) -> bool {
        let Some((m, silence)) = &self.quorum else {
            return false;
        };
        let m = m.borrow();
        if m.membership_config.membership().voter_ids().count() < 2 {
            return false;
        }
        // Deprecated in openraft 0.10 for `last_quorum_acked`, still filled in.
        #[allow(deprecated)]
        let ack = m.millis_since_quorum_ack;
        ack.is_none_or(|ms| Duration::from_millis(ms) > *silence)
    }

    /// Counts the sessions this manager expires in `c` (the replica's
    /// `lockservice_session_expiries_total`).
    pub fn with_expiry_counter(mut self, c: Counter) -> SessionManager {
        self.expiries = c;
        self
    }

    /// Expiries delete ephemeral nodes: hold them through `cachers` first, so no client
    /// keeps a cached copy of a node that is gone.
    pub fn with_cachers(mut self, cachers: Addr<CacherListActor>) -> SessionManager {
        self.cachers = Some(cachers);
        self
    }

    fn take_waiters(&mut self, ids: &[SessionId]) -> Vec<(SessionId, Waiter)> {
        let mut out = Vec::new();
        for id in ids {
            for w in self.waiting.remove(id).unwrap_or_default() {
                out.push((*id, w));
            }
        }
        out
    }

    fn fail_all_waiters(&mut self, err: Error) {
        for (_, waiters) in self.waiting.drain() {
            for (_, tx) in waiters {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }

    /// True while KeepAlives' leadership confirmations stall or fail (multi-voter cells
    /// with a quorum watch only): one waiting longer than the silence, or the last one
    /// failed within a lease with none confirmed since.
    fn confirms_failing(&self, now: Instant) -> bool {
        let Some((m, silence)) = &self.quorum else {
            return false;
        };
        if m.borrow()
            .membership_config
            .membership()
            .voter_ids()
            .count()
            < 2
        {
            return false;
        }
        self.confirms
            .failing(now, *silence, Duration::from_millis(self.lease_ms))
    }

    /// Confirms leadership for KeepAlives through the read gate, tracked by `confirms`.
    fn confirm_for_keepalives(&self) -> impl std::future::Future<Output = Result<(), Error>> {
        let gate = self.gate.clone();
        let ticket = self.confirms.start(Instant::now());
        async move {
            let r = gate.confirm().await;
            ticket.finish(r.is_ok(), Instant::now());
            r
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        let since_last = now.saturating_duration_since(self.last_tick);
        self.last_tick = now;
        if !self.leases.is_active() {
            return;
        }
        let quorum_silent = self.quorum_silent();
        if quorum_silent || self.confirms_failing(now) {
            if !self.clock_stopped {
                let why = if quorum_silent {
                    "no quorum acknowledgement"
                } else {
                    "KeepAlive confirmations failing (for the sessions that keep asking)"
                };
                tracing::warn!("{why}: lease clock stopped");
                self.clock_stopped = true;
            }
            if quorum_silent {
                self.leases.postpone(since_last);
                return;
            }
            // Confirmations failing with the quorum heard: only the clients that keep
            // asking have their clocks stopped; dead sessions expire.
            self.leases.postpone_asking(since_last, now);
        } else if self.clock_stopped {
            tracing::warn!("quorum heard and KeepAlives confirmed again: lease clock running");
            self.clock_stopped = false;
        }
        let expired = self.leases.take_expired(now);
        if !expired.is_empty() {
            tracing::info!(sessions = ?expired, "expiring sessions");
            for (id, (_, tx)) in self.take_waiters(&expired) {
                let _ = tx.send(Err(Error::SessionExpired { session: id }));
            }
            let ids = expired.clone();
            let generation = self.generation;
            let cachers = self.cachers.clone();
            let raft_node = self.raft_node.clone();
            let fut = async move {
                let (hold, cmd) = match &cachers {
                    // The cacher list reads the sessions' ephemerals and marks them ending
                    // in one step (see `HoldEnd`), so an ephemeral created meanwhile is
                    // never cached before this expiry deletes it.
                    Some(c) => match c
                        .send(HoldEnd {
                            sessions: expired.clone(),
                            lease_ran_out: true,
                        })
                        .await
                    {
                        Ok(Ok((id, term))) => (
                            id,
                            Command::Held {
                                term,
                                command: Box::new(Command::ExpireSessions { sessions: expired }),
                            },
                        ),
                        // Not held (no longer leading, or not yet told): cachers of the
                        // ephemerals may still serve them, so nothing is proposed; the
                        // expiry is retried.
                        Ok(Err(e)) => return Ok(Err(e)),
                        Err(e) => return Err(e),
                    },
                    None => (None, Command::ExpireSessions { sessions: expired }),
                };
                let r = raft_node.send(Propose(cmd)).await;
                // As for writes: a timed-out expiry may still commit, so its hold stays.
                let release = match &r {
                    Ok(answer) => crate::actors::raft_node::releases_hold(answer),
                    Err(_) => true,
                };
                if let (Some(c), Some(id), true) = (&cachers, hold, release) {
                    c.do_send(Release(id));
                }
                r
            };
            ctx.spawn(fut.into_actor(self).map(move |r, act, _| {
                if act.generation != generation {
                    return;
                }
                if matches!(r, Ok(Ok(_))) {
                    act.expiries.inc_by(ids.len() as u64);
                } else {
                    tracing::warn!(?r, "expiry not committed; will retry");
                    act.leases.expiry_failed(&ids);
                }
            }));
        }
        self.try_checkpoint(ctx);
    }

    fn try_checkpoint(&mut self, ctx: &mut Context<Self>) {
        let Some(cp) = self.leases.next_checkpoint(Instant::now()) else {
            return;
        };
        let generation = self.generation;
        let started = Instant::now();
        let fut = self
            .raft_node
            .send(Propose(Command::LeaseCheckpoint(cp.clone())));
        ctx.spawn(fut.into_actor(self).map(move |r, act, ctx| {
            if act.generation != generation {
                return;
            }
            let ok = matches!(r, Ok(Ok(_)));
            tracing::debug!(
                renewed = cp.renewed.len(),
                mark_all = cp.mark_all,
                ok,
                ms = started.elapsed().as_millis() as u64,
                "lease checkpoint"
            );
            act.checkpoint_done(&cp, ok, ctx);
            if ok {
                act.try_checkpoint(ctx);
            }
        }));
    }

    fn checkpoint_done(&mut self, cp: &LeaseCheckpoint, ok: bool, ctx: &mut Context<Self>) {
        let cleared = self.leases.checkpoint_done(cp, ok, Instant::now());
        if !ok {
            for (_, (_, tx)) in self.take_waiters(&cp.renewed) {
                let _ = tx.send(Err(Error::Unavailable {
                    reason: "lease checkpoint not committed".into(),
                }));
            }
            return;
        }
        // The commit proves leadership only up to some moment before it; KeepAlives that
        // arrived after that moment are acknowledged only after a fresh quorum round.
        let waiters = self.take_waiters(&cleared);
        if waiters.is_empty() {
            return;
        }
        let generation = self.generation;
        ctx.spawn(
            self.confirm_for_keepalives()
                .into_actor(self)
                .map(move |r, act, _| {
                    for (id, (received, tx)) in waiters {
                        let reply = match &r {
                            Err(e) => Err(e.clone()),
                            Ok(()) if act.generation != generation => Err(not_leader()),
                            Ok(()) => act.renewal_reply(id, received),
                        };
                        let _ = tx.send(reply);
                    }
                }),
        );
    }

    fn renewal_reply(&mut self, id: SessionId, received: Instant) -> Result<Reply, Error> {
        match self.leases.renew(id, received, Instant::now()) {
            Renewal::Renewed => Ok(Reply::KeepAlive {
                session_lease_ms: self.lease_ms,
                unacknowledged: Vec::new(),
            }),
            Renewal::Expired => Err(Error::SessionExpired { session: id }),
            Renewal::NotHere => Err(not_leader()),
        }
    }

    /// Loads the lease table once this leader has applied everything committed before
    /// (the read gate's barrier), retrying for as long as this generation lasts.
    fn try_load(&mut self, ctx: &mut Context<Self>, term: u64) {
        let generation = self.generation;
        let gate = self.gate.clone();
        ctx.spawn(
            async move { gate.confirm().await }
                .into_actor(self)
                .map(move |r, act, ctx| {
                    if act.generation != generation {
                        return;
                    }
                    match r {
                        Ok(()) => act.load(term),
                        Err(e) => {
                            tracing::debug!("lease table not loaded yet: {e}");
                            ctx.run_later(LOAD_RETRY, move |act, ctx| {
                                if act.generation == generation {
                                    act.try_load(ctx, term);
                                }
                            });
                        }
                    }
                }),
        );
    }

    fn load(&mut self, term: u64) {
        // Read the state here, on the actor, so that every SessionOpened effect handled
        // before this point is for a session already present in what we read.
        let sessions: Vec<(SessionId, Option<u64>)> = {
            let s = self.state.read().expect("state lock");
            s.sm.sessions()
                .map(|(id, sess)| (id, sess.silent_ms))
                .collect()
        };
        tracing::info!(sessions = sessions.len(), term, "session leases loaded");
        self.leases.become_leader(Instant::now(), sessions);
    }
}

impl Actor for SessionManager {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.scan_interval, |act, ctx| act.tick(ctx));
    }
}

impl Handler<LeadershipChanged> for SessionManager {
    type Result = ();

    fn handle(&mut self, msg: LeadershipChanged, ctx: &mut Context<Self>) {
        self.generation += 1;
        self.confirms.reset();
        self.leases.step_down();
        self.fail_all_waiters(not_leader());
        if !msg.leading {
            self.leading_term = None;
            return;
        }
        self.leading_term = Some(msg.term);
        self.try_load(ctx, msg.term);
    }
}

impl Handler<AppliedMsg> for SessionManager {
    type Result = ();

    fn handle(&mut self, msg: AppliedMsg, _: &mut Context<Self>) {
        let Applied::Effects { effects, .. } = msg.0 else {
            return;
        };
        let now = Instant::now();
        for e in effects {
            match e {
                // Whether the log marks it: a checkpoint that marked every session may
                // have applied after this one was created and been answered before this
                // effect arrived (they travel by different tasks). Read only while leading.
                Effect::SessionOpened { session } if self.leases.is_active() => {
                    let marked = self.marked_in_log(session);
                    self.leases.opened(session, now, marked)
                }
                Effect::SessionEnded { session } => {
                    self.leases.ended(session);
                    for (_, (_, tx)) in self.take_waiters(&[session]) {
                        let _ = tx.send(Err(Error::SessionExpired { session }));
                    }
                }
                _ => {}
            }
        }
    }
}

impl Handler<LeaseDeadlines> for SessionManager {
    type Result = Vec<Option<Instant>>;

    fn handle(&mut self, m: LeaseDeadlines, _: &mut Context<Self>) -> Vec<Option<Instant>> {
        m.0.iter().map(|id| self.leases.deadline(*id)).collect()
    }
}

impl Handler<LeaseCount> for SessionManager {
    type Result = usize;

    fn handle(&mut self, _: LeaseCount, _: &mut Context<Self>) -> usize {
        self.leases.len()
    }
}

/// One session's part of a [`KeepAliveMany`] while it is being answered.
enum Part {
    Done(Box<Result<Reply, Error>>),
    /// Renewed once leadership is confirmed.
    Renew(SessionId),
    /// Answered when its lease checkpoint commits.
    Checkpoint(oneshot::Receiver<Result<Reply, Error>>),
}

impl SessionManager {
    /// Whether the applied state has session `id` marked (its silence counted by lease
    /// checkpoints, `silent_ms` set); false for a session it does not hold.
    fn marked_in_log(&self, id: SessionId) -> bool {
        let s = self.state.read().expect("state lock");
        s.sm.session(id)
            .is_some_and(|sess| sess.silent_ms.is_some())
    }

    /// The first step of a KeepAlive for `id`: its lease's state, after adopting a session
    /// opened so recently that its effect has not reached the lease table yet.
    fn keepalive_step(&mut self, id: SessionId, received: Instant) -> Result<KeepAliveStep, Error> {
        let step = self.leases.keepalive(id, received);
        if step != KeepAliveStep::Unknown {
            return Ok(step);
        }
        // Opened so recently that its effect has not reached us yet?
        let marked = {
            let s = self.state.read().expect("state lock");
            s.sm.check_session(id)?.silent_ms.is_some()
        };
        self.leases.opened(id, Instant::now(), marked);
        Ok(self.leases.keepalive(id, received))
    }
}

impl Handler<KeepAliveMany> for SessionManager {
    type Result = ResponseActFuture<Self, Vec<Result<Reply, Error>>>;

    fn handle(&mut self, msg: KeepAliveMany, ctx: &mut Context<Self>) -> Self::Result {
        let refuse =
            |e: Error, n: usize| -> Self::Result { Box::pin(actix::fut::ready(vec![Err(e); n])) };
        let n = msg.sessions.len();
        if self.leading_term.is_none() {
            return refuse(not_leader(), n);
        }
        if !self.leases.is_active() {
            return refuse(
                Error::Unavailable {
                    reason: "new leader is loading sessions".into(),
                },
                n,
            );
        }
        let received = msg.received;
        // Each session is checked against the state first, under one read of it: open,
        // and `acting` may use it (its owner never changes, so the check holds for the
        // renewal below). A session the state does not hold gets the state's answer.
        let checked: Vec<Result<(), Error>> = {
            let s = self.state.read().expect("state lock");
            msg.sessions
                .iter()
                .map(|&id| s.sm.check_session_for(id, &msg.acting).map(|_| ()))
                .collect()
        };
        let mut parts = Vec::with_capacity(n);
        let (mut renewing, mut checkpointing) = (false, false);
        for (id, checked) in msg.sessions.into_iter().zip(checked) {
            let step = checked.and_then(|()| self.keepalive_step(id, received));
            parts.push(match step {
                Err(e) => Part::Done(Box::new(Err(e))),
                Ok(KeepAliveStep::Unknown) => Part::Done(Box::new(Err(not_leader()))),
                Ok(KeepAliveStep::Expired) => {
                    Part::Done(Box::new(Err(Error::SessionExpired { session: id })))
                }
                Ok(KeepAliveStep::Renew) => {
                    renewing = true;
                    Part::Renew(id)
                }
                Ok(KeepAliveStep::NeedsCheckpoint) => {
                    let (tx, rx) = oneshot::channel();
                    self.waiting.entry(id).or_default().push((received, tx));
                    checkpointing = true;
                    Part::Checkpoint(rx)
                }
            });
        }
        if checkpointing {
            self.try_checkpoint(ctx);
        }
        let confirm = renewing.then(|| self.confirm_for_keepalives());
        let generation = self.generation;
        // Renewals right after the confirmation (a renewal delayed behind other sessions'
        // checkpoint commits could find its old lease run out meanwhile), then the
        // checkpointed ones as their commits come.
        let confirmed = async move {
            match confirm {
                Some(c) => c.await,
                None => Ok(()),
            }
        };
        Box::pin(
            confirmed
                .into_actor(self)
                .map(move |r, act, _| {
                    parts
                        .into_iter()
                        .map(|p| match p {
                            Part::Renew(id) => Part::Done(Box::new(match &r {
                                Err(e) => Err(e.clone()),
                                Ok(()) if act.generation != generation => Err(not_leader()),
                                Ok(()) => act.renewal_reply(id, received),
                            })),
                            other => other,
                        })
                        .collect::<Vec<_>>()
                })
                .then(|parts, act, _| {
                    async move {
                        let mut out = Vec::with_capacity(parts.len());
                        for p in parts {
                            out.push(match p {
                                Part::Done(r) => *r,
                                Part::Checkpoint(rx) => {
                                    rx.await.unwrap_or(Err(Error::Unavailable {
                                        reason: "leader changed".into(),
                                    }))
                                }
                                Part::Renew(_) => unreachable!("renewed above"),
                            });
                        }
                        out
                    }
                    .into_actor(act)
                }),
        )
    }
}
