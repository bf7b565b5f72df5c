//! The session manager: leader-only lease deadlines.
//!
//! KeepAlives extend a lease in memory after a coalesced leadership check and are never
//! logged (except the one batched checkpoint a session needs after a fail-over, see
//! [`crate::leader::leases`]). A lease that runs out becomes one committed
//! `ExpireSessions` entry. On becoming leader the table is rebuilt from the state machine
//! once everything committed before the new term has been applied.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture,
    ResponseFuture, WrapFuture,
};
use tokio::sync::oneshot;
use wire::command::{Command, Effect, LeaseCheckpoint};
use wire::types::{Reply, SessionId};
use wire::Error;

use crate::actors::raft_node::{LeadershipChanged, Propose, RaftNode};
use crate::leader::leases::{KeepAliveStep, Leases};
use crate::leader::read_gate::ReadGate;
use crate::raft::sm_store::{Applied, SharedState};

/// A KeepAlive received by the gateway at `received`.
#[derive(Message)]
#[rtype(result = "Result<Reply, Error>")]
pub struct KeepAlive {
    /// The session.
    pub session: SessionId,
    /// When the replica received it (the lease runs from here).
    pub received: Instant,
}

/// Effects of applied entries (from the state-machine store's channel).
#[derive(Message)]
#[rtype(result = "()")]
pub struct AppliedMsg(pub Applied);

/// Number of sessions with a lease here (0 when not leading).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct LeaseCount;

#[derive(Message)]
#[rtype(result = "()")]
struct Loaded {
    term: u64,
}

type Waiter = (Instant, oneshot::Sender<Result<Reply, Error>>);

/// The actor.
pub struct SessionManager {
    leases: Leases,
    raft_node: Addr<RaftNode>,
    gate: ReadGate,
    state: SharedState,
    lease_ms: u64,
    scan_interval: Duration,
    leading_term: Option<u64>,
    waiting: HashMap<SessionId, Vec<Waiter>>,
}

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
            waiting: HashMap::new(),
        }
    }

    fn fail_waiters(&mut self, ids: Option<&[SessionId]>, err: Error) {
        let keys: Vec<SessionId> = match ids {
            Some(ids) => ids.to_vec(),
            None => self.waiting.keys().copied().collect(),
        };
        for id in keys {
            for (_, tx) in self.waiting.remove(&id).unwrap_or_default() {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if !self.leases.is_active() {
            return;
        }
        let now = Instant::now();
        let expired = self.leases.take_expired(now);
        if !expired.is_empty() {
            tracing::info!(sessions = ?expired, "expiring sessions");
            self.fail_waiters(
                Some(&expired),
                Error::SessionExpired {
                    session: expired[0],
                },
            );
            let ids = expired.clone();
            let fut = self
                .raft_node
                .send(Propose(Command::ExpireSessions { sessions: expired }));
            ctx.spawn(fut.into_actor(self).map(move |r, act, _| {
                if !matches!(r, Ok(Ok(_))) {
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
        let fut = self
            .raft_node
            .send(Propose(Command::LeaseCheckpoint(cp.clone())));
        ctx.spawn(fut.into_actor(self).map(move |r, act, ctx| {
            let ok = matches!(r, Ok(Ok(_)));
            act.checkpoint_done(&cp, ok);
            if ok {
                act.try_checkpoint(ctx);
            }
        }));
    }

    fn checkpoint_done(&mut self, cp: &LeaseCheckpoint, ok: bool) {
        let cleared = self.leases.checkpoint_done(cp, ok);
        if !ok {
            self.fail_waiters(
                Some(&cp.renewed),
                Error::Unavailable {
                    reason: "lease checkpoint not committed".into(),
                },
            );
            return;
        }
        let now = Instant::now();
        for id in cleared {
            for (received, tx) in self.waiting.remove(&id).unwrap_or_default() {
                let r = if self.leases.renew(id, received, now) {
                    Ok(Reply::KeepAlive {
                        session_lease_ms: self.lease_ms,
                    })
                } else {
                    Err(Error::SessionExpired { session: id })
                };
                let _ = tx.send(r);
            }
        }
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
        self.leases.step_down();
        self.fail_waiters(
            None,
            Error::NotLeader {
                leader_id: None,
                leader_addr: None,
            },
        );
        if !msg.leading {
            self.leading_term = None;
            return;
        }
        self.leading_term = Some(msg.term);
        // Wait until this leader has applied everything committed before its term.
        let gate = self.gate.clone();
        let addr = ctx.address();
        let term = msg.term;
        tokio::spawn(async move {
            for _ in 0..100 {
                if gate.confirm().await.is_ok() {
                    addr.do_send(Loaded { term });
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
}

impl Handler<Loaded> for SessionManager {
    type Result = ();

    fn handle(&mut self, msg: Loaded, ctx: &mut Context<Self>) {
        if self.leading_term != Some(msg.term) {
            return;
        }
        // Read the state here, on the actor, so that every SessionOpened effect handled
        // before this point is for a session already present in what we read.
        let sessions: Vec<(SessionId, Option<u64>)> = {
            let s = self.state.read().expect("state lock");
            s.sm.sessions()
                .map(|(id, sess)| (id, sess.silent_ms))
                .collect()
        };
        tracing::info!(
            sessions = sessions.len(),
            term = msg.term,
            "session leases loaded"
        );
        self.leases.become_leader(Instant::now(), sessions);
        self.try_checkpoint(ctx);
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
                Effect::SessionOpened { session } => self.leases.opened(session, now),
                Effect::SessionEnded { session } => {
                    self.leases.ended(session);
                    self.fail_waiters(Some(&[session]), Error::SessionExpired { session });
                }
                _ => {}
            }
        }
    }
}

impl Handler<LeaseCount> for SessionManager {
    type Result = usize;

    fn handle(&mut self, _: LeaseCount, _: &mut Context<Self>) -> usize {
        self.leases.len()
    }
}

impl Handler<KeepAlive> for SessionManager {
    type Result = ResponseActFuture<Self, Result<Reply, Error>>;

    fn handle(&mut self, msg: KeepAlive, ctx: &mut Context<Self>) -> Self::Result {
        let fail = |e: Error| -> Self::Result { Box::pin(actix::fut::ready(Err(e))) };
        if self.leading_term.is_none() {
            return fail(Error::NotLeader {
                leader_id: None,
                leader_addr: None,
            });
        }
        if !self.leases.is_active() {
            return fail(Error::Unavailable {
                reason: "new leader is loading sessions".into(),
            });
        }
        let id = msg.session;
        let mut step = self.leases.keepalive(id, msg.received);
        if step == KeepAliveStep::Unknown {
            // Opened so recently that its effect has not reached us yet?
            let open = {
                let s = self.state.read().expect("state lock");
                s.sm.check_session(id).map(|_| ())
            };
            if let Err(e) = open {
                return fail(e);
            }
            self.leases.opened(id, Instant::now());
            step = self.leases.keepalive(id, msg.received);
        }
        match step {
            KeepAliveStep::Unknown | KeepAliveStep::Expired => {
                fail(Error::SessionExpired { session: id })
            }
            KeepAliveStep::Renew => {
                let gate = self.gate.clone();
                let lease_ms = self.lease_ms;
                Box::pin(async move { gate.confirm().await }.into_actor(self).map(
                    move |r, act, _| {
                        r?;
                        if act.leases.renew(id, msg.received, Instant::now()) {
                            Ok(Reply::KeepAlive {
                                session_lease_ms: lease_ms,
                            })
                        } else {
                            Err(Error::SessionExpired { session: id })
                        }
                    },
                ))
            }
            KeepAliveStep::NeedsCheckpoint => {
                let (tx, rx) = oneshot::channel();
                self.waiting.entry(id).or_default().push((msg.received, tx));
                self.try_checkpoint(ctx);
                let fut: ResponseFuture<Result<Reply, Error>> = Box::pin(async move {
                    rx.await.unwrap_or(Err(Error::Unavailable {
                        reason: "leader changed".into(),
                    }))
                });
                Box::pin(fut.into_actor(self))
            }
        }
    }
}
