//! The watch-table actor: arms one-shot watches, fires them from applied effects, and
//! delivers events on each session's event stream (buffering while the stream is
//! reconnecting). Leader-only; emptied when leadership changes, which also ends every
//! event stream so clients reconnect to the new leader and re-arm.

use std::collections::VecDeque;
use wire::hash::HashMap;

use actix::{Actor, Context, Handler, Message};
use tokio::sync::mpsc;
use wire::command::Effect;
use wire::types::{LogIndex, Reply, SessionId, WatchEvent, WatchKind};

use crate::actors::messages::{AppliedMsg, LeadershipChanged};
use crate::leader::watch_table::WatchTable;
use crate::raft::sm_store::{Applied, SharedState};

/// Events kept per session while its stream is not connected; beyond this the oldest are
/// dropped (the client re-arms and re-reads after reconnecting anyway).
pub const PENDING_EVENTS_MAX: usize = 10_000;

/// Arm a watch at `since`. If the node already changed after `since`, the watch fires at
/// once: the event is returned, and also delivered on the stream when `deliver` is set.
#[derive(Message)]
#[rtype(result = "Option<WatchEvent>")]
pub struct Arm {
    /// The watching session.
    pub session: SessionId,
    /// The node.
    pub path: String,
    /// The kind.
    pub kind: WatchKind,
    /// The index the watch's read reflected.
    pub since: LogIndex,
    /// Deliver an immediate firing on the event stream (reads) rather than only returning
    /// it (re-arming, whose reply carries it).
    pub deliver: bool,
}

/// Attach a session's event stream.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Connect {
    /// The session.
    pub session: SessionId,
    /// Where its stream items go.
    pub tx: mpsc::UnboundedSender<Reply>,
    /// The Raft term the stream's leadership was confirmed in: a stream of an earlier
    /// term than a leadership change already seen here is refused (it ends, and the
    /// client reopens it), since the cacher list drops its flush confirmation.
    pub term: u64,
}

/// Send an item (an invalidation) on a session's event stream.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Push {
    /// The session.
    pub session: SessionId,
    /// The item.
    pub item: Reply,
}

/// Number of armed watches, and of those on one path.
#[derive(Message)]
#[rtype(result = "WatchCounts")]
pub struct WatchCount(pub String);

/// The answer to [`WatchCount`].
#[derive(Debug, Clone, Copy, actix::MessageResponse)]
pub struct WatchCounts {
    /// All armed watches.
    pub total: usize,
    /// Those on the asked path.
    pub on_path: usize,
}

#[derive(Default)]
struct Sink {
    tx: Option<mpsc::UnboundedSender<Reply>>,
    pending: VecDeque<Reply>,
}

/// The actor.
pub struct WatchTableActor {
    table: WatchTable,
    state: SharedState,
    sinks: HashMap<SessionId, Sink>,
    /// The highest term of a leadership change seen.
    term_seen: u64,
}

impl WatchTableActor {
    /// A watch table reading the applied state through `state`.
    pub fn new(state: SharedState) -> WatchTableActor {
        WatchTableActor {
            table: WatchTable::new(),
            state,
            sinks: HashMap::default(),
            term_seen: 0,
        }
    }

    fn deliver(&mut self, session: SessionId, ev: Reply) {
        if !self.sinks.contains_key(&session)
            && self
                .state
                .read()
                .expect("state lock")
                .sm
                .session(session)
                .is_none()
        {
            return;
        }
        let sink = self.sinks.entry(session).or_default();
        if let Some(tx) = &sink.tx {
            match tx.send(ev) {
                Ok(()) => return,
                Err(mpsc::error::SendError(ev)) => {
                    sink.tx = None;
                    sink.pending.push_back(ev);
                }
            }
        } else {
            sink.pending.push_back(ev);
        }
        while sink.pending.len() > PENDING_EVENTS_MAX {
            sink.pending.pop_front();
        }
    }
}

impl Actor for WatchTableActor {
    type Context = Context<Self>;
}

impl Handler<Arm> for WatchTableActor {
    type Result = Option<WatchEvent>;

    fn handle(&mut self, msg: Arm, _: &mut Context<Self>) -> Option<WatchEvent> {
        // Changes applied between the read and now are visible in the state, and their
        // effects may already have passed through this actor: check the state first.
        let changed = {
            let s = self.state.read().expect("state lock");
            // Ended between the read and now: its watches would never be freed.
            s.sm.session(msg.session)?;
            s.sm.changed_since(&msg.path, msg.kind, msg.since)
                .map(|event| WatchEvent {
                    path: msg.path.clone(),
                    kind: msg.kind,
                    event,
                    // Above `since` even for a spurious firing, so the client never takes it
                    // for an event its read already reflected (and re-arms it forever).
                    index: s.sm.change_index(&msg.path, event).max(msg.since + 1),
                })
        };
        match changed {
            Some(ev) => {
                if msg.deliver {
                    self.deliver(msg.session, Reply::Event(ev.clone()));
                }
                Some(ev)
            }
            None => {
                self.table.arm(msg.session, &msg.path, msg.kind, msg.since);
                None
            }
        }
    }
}

impl Handler<AppliedMsg> for WatchTableActor {
    type Result = ();

    fn handle(&mut self, msg: AppliedMsg, _: &mut Context<Self>) {
        let Applied::Effects { index, effects } = msg.0 else {
            return;
        };
        for (session, ev) in self.table.apply(index, &effects) {
            self.deliver(session, Reply::Event(ev));
        }
        for e in &effects {
            if let Effect::SessionEnded { session } = e {
                // Dropping the sender ends the session's stream.
                self.sinks.remove(session);
            }
        }
    }
}

impl Handler<Push> for WatchTableActor {
    type Result = ();

    fn handle(&mut self, msg: Push, _: &mut Context<Self>) {
        self.deliver(msg.session, msg.item);
    }
}

impl Handler<Connect> for WatchTableActor {
    type Result = ();

    fn handle(&mut self, msg: Connect, _: &mut Context<Self>) {
        if msg.term < self.term_seen {
            // Confirmed in a term this replica has left since: dropping `tx` ends it.
            return;
        }
        if self
            .state
            .read()
            .expect("state lock")
            .sm
            .session(msg.session)
            .is_none()
        {
            // Ended meanwhile: dropping `tx` ends the stream.
            self.sinks.remove(&msg.session);
            return;
        }
        let sink = self.sinks.entry(msg.session).or_default();
        while let Some(ev) = sink.pending.pop_front() {
            if let Err(mpsc::error::SendError(ev)) = msg.tx.send(ev) {
                sink.pending.push_front(ev);
                return;
            }
        }
        sink.tx = Some(msg.tx);
    }
}

impl Handler<LeadershipChanged> for WatchTableActor {
    type Result = ();

    fn handle(&mut self, msg: LeadershipChanged, _: &mut Context<Self>) {
        // Volatile: a new leader (or a deposed one) starts empty; streams end.
        self.term_seen = self.term_seen.max(msg.term);
        self.table.clear();
        self.sinks.clear();
    }
}

impl Handler<WatchCount> for WatchTableActor {
    type Result = WatchCounts;

    fn handle(&mut self, msg: WatchCount, _: &mut Context<Self>) -> WatchCounts {
        WatchCounts {
            total: self.table.len(),
            on_path: self.table.watches_on(&msg.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, RwLock};

    use actix::Actor;
    use wire::command::Command;

    use super::*;
    use crate::raft::sm_store::SmState;

    /// A stream whose leadership was confirmed in a term this replica has left since is
    /// ended at once (the cacher list drops its flush confirmation, so kept, it would
    /// leave writes waiting for that session); one of the current term is kept.
    #[actix_rt::test]
    async fn a_stream_confirmed_in_an_earlier_term_is_ended() {
        let mut s = SmState::default();
        let session = match s
            .sm
            .apply(
                1,
                &Command::CreateSession {
                    owner: "lock://client/test".into(),
                },
            )
            .0
        {
            Ok(Reply::SessionCreated { session, .. }) => session,
            other => panic!("{other:?}"),
        };
        let table = WatchTableActor::new(Arc::new(RwLock::new(s))).start();
        table
            .send(LeadershipChanged {
                leading: true,
                term: 3,
                last_log_index: 1,
            })
            .await
            .expect("actor");
        let (tx, mut stale) = mpsc::unbounded_channel();
        table
            .send(Connect {
                session,
                tx,
                term: 2,
            })
            .await
            .expect("actor");
        assert!(
            matches!(
                stale.try_recv(),
                Err(mpsc::error::TryRecvError::Disconnected)
            ),
            "a stream of term 2 stayed attached in term 3"
        );
        let (tx, mut current) = mpsc::unbounded_channel();
        table
            .send(Connect {
                session,
                tx,
                term: 3,
            })
            .await
            .expect("actor");
        assert!(matches!(
            current.try_recv(),
            Err(mpsc::error::TryRecvError::Empty)
        ));
    }
}
