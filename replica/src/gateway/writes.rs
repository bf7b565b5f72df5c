//! Writes: validated, joined with a retry of the same request still in flight, held
//! until the cachers of the nodes they touch have dropped their copies, then proposed.

use super::*;

impl Gateway {
    pub(super) async fn write(
        &self,
        req: &Request,
        me: &Acting,
        ops: Vec<TxnOp>,
        single: bool,
    ) -> Response {
        if req.session == 0 {
            return Err(Error::SessionRequired);
        }
        crate::state_machine::validate_write(&ops, single)?;
        // Only the session's owner writes under it (and so creates ephemerals it owns, or
        // joins a retry in flight below): decided here, before anything is held or
        // proposed, and for good, since an owner never changes.
        self.check_owner(req.session, me).await?;
        // A write the ACLs or the cell's prefixes refuse now is refused here, before it
        // holds anyone's cached copies or takes a log entry (apply decides in any case, at
        // the state it meets). Not a retry of a write already answered: apply returns its
        // first answer, which a refusal judged at today's state must not hide (the write
        // applied, its answer was lost, and the prefix froze or moved since: the client
        // would send it again elsewhere).
        {
            let s = self.state.read().expect("state lock");
            if !s.sm.has_answer(req.session, req.request_id) {
                s.sm.precheck_write(&me.identity, req.session, &ops, single)?;
            }
        }
        // A retry (same session and request id) of a write still in flight here joins it:
        // under load clients and proxies resend while a write is held or queued, and each
        // resend would otherwise be one more log entry (applied as a duplicate, but paid
        // for in the log, replication and apply).
        let key = (req.session, req.request_id);
        let joined = {
            let mut m = self.in_flight.0.lock().expect("in-flight lock");
            match m.get(&key) {
                Some(tx) => Some(tx.subscribe()),
                None => {
                    m.insert(key, tokio::sync::broadcast::channel(1).0);
                    None
                }
            }
        };
        if let Some(mut rx) = joined {
            return rx.recv().await.unwrap_or_else(|_| {
                Err(Error::Unavailable {
                    reason: "the first attempt of this request ended; retry".into(),
                })
            });
        }
        let mut guard = InFlightGuard {
            table: &self.in_flight,
            key,
            answer: None,
        };
        let paths = cached_paths(&ops);
        let cmd = Command::Write {
            session: req.session,
            request_id: req.request_id,
            ack_below: req.ack_below,
            ops,
            single,
        };
        let r = self.propose_held(paths, cmd).await;
        guard.answer = Some(r.clone());
        r
    }

    /// Proposes `cmd` after every cacher of `paths` dropped them (Chubby's rule), keeping
    /// the nodes uncachable until the command is applied.
    pub async fn propose_held(&self, paths: Vec<String>, cmd: Command) -> Response {
        if paths.is_empty() {
            return self.propose(cmd).await;
        }
        let (mut waited, mut tries) = (0, 0u32);
        let (hold, term) = loop {
            let held =
                self.cachers
                    .send(Hold(paths.clone()))
                    .await
                    .map_err(|e| Error::Internal {
                        reason: format!("cacher list: {e}"),
                    })?;
            match held {
                Ok(h) => break h,
                // Elected a moment ago: openraft says this replica leads, and the cacher
                // list has not been told yet or has not applied the log up to the
                // takeover. A client that found this leader as soon as it was elected
                // (`Op::LeadershipAfter`) would otherwise be refused and come back after
                // its backoff (100 ms, measured: docs/benchmarks.md); wait here instead,
                // asking again after 2 ms, then twice as long each time (at most 50 ms), for
                // at most TAKEOVER_WAIT_MS of sleeps: about ten asks of the cacher list per
                // write, however long the takeover takes.
                Err(Error::NotLeader { .. } | Error::Unavailable { .. })
                    if waited < TAKEOVER_WAIT_MS && self.raft_leads() =>
                {
                    let pause = (TAKEOVER_POLL_MS << tries.min(5)).min(50);
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                    waited += pause;
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        };
        self.propose_in_hold(Some(hold), term, cmd).await
    }

    /// Whether openraft says this replica leads now.
    pub(super) fn raft_leads(&self) -> bool {
        self.raft.metrics().borrow().state == openraft::ServerState::Leader
    }

    /// Proposes `cmd` as held by the cacher list in `term` (under `hold`, released once
    /// the command's fate is known).
    pub(super) async fn propose_in_hold(
        &self,
        hold: Option<u64>,
        term: u64,
        cmd: Command,
    ) -> Response {
        // Applied only if appended in the term whose cacher list held it.
        let r = self
            .propose(Command::Held {
                term,
                command: Box::new(cmd),
            })
            .await;
        // A proposal that timed out may still commit: its nodes stay uncachable (the
        // hold kept) until this leadership ends, or a cached read could be recorded with
        // the old value just before the write applies.
        if let (Some(hold), true) = (hold, crate::actors::raft_node::releases_hold(&r)) {
            self.cachers.do_send(Release(hold));
        }
        r
    }
}

/// How long a write held for cachers waits, at most, for the cacher list of a replica
/// that openraft has just elected to take over ([`Gateway::propose_held`]), in ms.
const TAKEOVER_WAIT_MS: u64 = 300;

/// Its first pause before asking again, in ms (doubled after each).
const TAKEOVER_POLL_MS: u64 = 2;
