//! The Raft-node actor: the one place commands enter the log.

use std::collections::BTreeSet;
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient, ResponseFuture};
use openraft::{ChangeMembers, ServerState};
use wire::command::Command;
use wire::metrics::prometheus_client::metrics::histogram::Histogram;
use wire::raft::NodeId;
use wire::types::{MemberInfo, Reply};
use wire::Error;

use crate::actors::messages::LeadershipChanged;
use crate::raft::Raft;

/// Propose a command and wait for its result (applied on this leader).
#[derive(Message)]
#[rtype(result = "Result<Reply, Error>")]
pub struct Propose(pub Command);

/// A membership change.
#[derive(Message, Clone)]
#[rtype(result = "Result<Reply, Error>")]
pub enum ChangeMembership {
    /// Add a learner and wait until it has caught up.
    AddLearner {
        /// Its id.
        id: NodeId,
        /// Its address.
        addr: String,
    },
    /// Promote a learner to voter.
    Promote {
        /// Its id.
        id: NodeId,
    },
    /// Remove a voter or learner.
    Remove {
        /// Its id.
        id: NodeId,
    },
}

/// The actor.
pub struct RaftNode {
    raft: Raft,
    timeout: Duration,
    subscribers: Vec<Recipient<LeadershipChanged>>,
    proposals: tokio::sync::mpsc::UnboundedSender<Proposal>,
    /// The batcher's end of `proposals`, until the actor starts it.
    batcher_rx: Option<tokio::sync::mpsc::UnboundedReceiver<Proposal>>,
    /// Where the batcher records each entry's commit latency.
    commit_seconds: Histogram,
}

impl RaftNode {
    /// Wraps `raft`; requests wait at most `timeout` for a commit.
    pub fn new(
        raft: Raft,
        timeout: Duration,
        subscribers: Vec<Recipient<LeadershipChanged>>,
    ) -> Self {
        let (proposals, rx) = tokio::sync::mpsc::unbounded_channel();
        RaftNode {
            raft,
            timeout,
            subscribers,
            proposals,
            batcher_rx: Some(rx),
            commit_seconds: wire::metrics::seconds_histogram(0.000_5, 16),
        }
    }

    /// A handle that proposes to this node's batcher directly ([`Proposer`]).
    pub fn proposer(&self) -> Proposer {
        Proposer {
            proposals: self.proposals.clone(),
            timeout: self.timeout,
        }
    }

    /// Records each entry's time from proposal to apply at this leader in `h` (the
    /// replica's `lockservice_raft_commit_seconds`).
    pub fn with_commit_histogram(mut self, h: Histogram) -> Self {
        self.commit_seconds = h;
        self
    }
}

/// A command waiting to be proposed, and where its answer goes.
struct Proposal {
    cmd: Command,
    answer: tokio::sync::oneshot::Sender<Result<Reply, Error>>,
}

/// Entries the batcher keeps in flight at once. openraft 0.9 appends and syncs each entry
/// alone, in its core loop (`RaftCore::append_to_log` awaits the flush), so one entry per
/// command caps the leader at one command per fsync (measured: 1.00 entries per fsync,
/// the cores 44 % idle at 256 writers). Proposals that arrive while this many entries
/// are in flight wait and go together in the next. openraft 0.10 no longer waits for the
/// flush in its core loop (appends complete through `IOFlushed`), so more entries could be
/// in flight and the log's flusher would group them; the port keeps 2 (behaviour as on
/// 0.9) until that is measured.
const ENTRIES_IN_FLIGHT: usize = 2;
/// At most this many commands, and about this many bytes of them, in one entry.
const BATCH_COMMANDS_MAX: usize = 512;
const BATCH_BYTES_MAX: usize = 1 << 20;

/// Takes the longest run from the front of `queue` that may share one entry: at most
/// [`BATCH_COMMANDS_MAX`] commands of about [`BATCH_BYTES_MAX`] bytes, and what the
/// [`BatchRule`](wire::command::BatchRule) admits (1024 creates, 1024 new sessions). In
/// order: the first command that does not fit waits for the next entry, and so do the
/// ones after it, so no client's commands are reordered. The first command always goes
/// (one the rule refuses even alone, a transaction of more creates than an entry holds,
/// goes alone and is refused at apply by `validate_write`, as the gateway refuses it
/// before it gets here).
fn take_batch(queue: &mut std::collections::VecDeque<Proposal>) -> Vec<Proposal> {
    let mut rule = wire::command::BatchRule::default();
    let (mut batch, mut bytes) = (Vec::new(), 0);
    while let Some(p) = queue.front() {
        let size = p.cmd.approx_bytes();
        let fits = batch.is_empty()
            || (batch.len() < BATCH_COMMANDS_MAX && bytes + size <= BATCH_BYTES_MAX);
        if !fits {
            return batch;
        }
        let admitted = rule.admit(&p.cmd);
        if !admitted && !batch.is_empty() {
            return batch;
        }
        bytes += size;
        batch.push(queue.pop_front().expect("front"));
        if !admitted {
            // Alone, in an entry of its own.
            return batch;
        }
    }
    batch
}

/// Completes once this replica does not lead (at once if it does not now). Watches the
/// server metrics, which change with the role but not with every entry.
async fn not_leading(raft: &Raft) {
    let mut metrics = raft.server_metrics();
    loop {
        if metrics.borrow_and_update().state != ServerState::Leader {
            return;
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// Proposes what arrives on `rx`: each command in an entry of its own while fewer than
/// [`ENTRIES_IN_FLIGHT`] entries are in flight, else together with the others that
/// waited, as one [`Command::Batch`]. Entries go to openraft in the order their commands
/// arrived. Ends when the actor and every [`Proposer`] are gone.
async fn batcher(
    raft: Raft,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Proposal>,
    commit_seconds: Histogram,
) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(ENTRIES_IN_FLIGHT));
    let mut queue = std::collections::VecDeque::new();
    loop {
        if queue.is_empty() {
            match rx.recv().await {
                Some(p) => queue.push_back(p),
                None => return,
            }
        }
        // A replica that does not lead proposes at once (openraft refuses with the
        // leader's address): entries it proposed while leading keep their slots until they
        // are applied or truncated, which may be long after it stepped down, and waiting
        // for them would turn every `NotLeader` into a commit timeout.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => Some(s.expect("never closed")),
            _ = not_leading(&raft) => None,
        };
        while let Ok(p) = rx.try_recv() {
            queue.push_back(p);
        }
        let batch = take_batch(&mut queue);
        let cmd = if batch.len() == 1 {
            batch[0].cmd.clone()
        } else {
            Command::Batch(batch.iter().map(|p| p.cmd.clone()).collect())
        };
        tracing::trace!(commands = batch.len(), "propose");
        let proposed = std::time::Instant::now();
        // openraft 0.10 takes the responder from the caller (0.9 made one and handed
        // back its receiver): one that answers on completion only.
        let (responder, reply) = openraft::impls::ProgressResponder::complete_only();
        match raft.client_write_ff(cmd, Some(responder)).await {
            Ok(()) => {
                let commit_seconds = commit_seconds.clone();
                wire::rt::spawn(async move {
                    let r = reply.await;
                    drop(slot);
                    if matches!(r, Ok(Ok(_))) {
                        commit_seconds.observe(proposed.elapsed().as_secs_f64());
                    }
                    let answers: Vec<Result<Reply, Error>> = match r {
                        Ok(Ok(resp)) if batch.len() == 1 => vec![resp.data.result],
                        Ok(Ok(resp)) => resp.data.batch,
                        Ok(Err(e)) => {
                            vec![Err(crate::errors::from_client_write_error(e)); batch.len()]
                        }
                        Err(_) => vec![
                            Err(Error::Unavailable {
                                reason: "raft stopped before answering".into(),
                            });
                            batch.len()
                        ],
                    };
                    let mut answers = answers.into_iter();
                    for p in batch {
                        let a = answers.next().unwrap_or_else(|| {
                            Err(Error::Internal {
                                reason: "a batch answered fewer commands than it held".into(),
                            })
                        });
                        let _ = p.answer.send(a);
                    }
                });
            }
            Err(fatal) => {
                drop(slot);
                for p in batch {
                    let _ = p.answer.send(Err(Error::Unavailable {
                        reason: format!("raft: {fatal}"),
                    }));
                }
            }
        }
    }
}

impl Actor for RaftNode {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(rx) = self.batcher_rx.take() {
            wire::rt::spawn(batcher(self.raft.clone(), rx, self.commit_seconds.clone()));
        }
        // Tell subscribers when leadership changes. The trigger is openraft's server
        // metrics, which change only with the role, the vote, the leader or the
        // membership: its full metrics change with every entry, and each change woke
        // this actor's thread (docs/benchmarks.md, "CPU per write"). At each change the
        // role, term and last log index are read from Raft's own state, one consistent
        // view as fresh as the change or fresher (the full metrics, sent after the
        // server metrics, may not show the change yet when this wakes).
        let raft = self.raft.clone();
        let mut server = self.raft.server_metrics();
        let subscribers = self.subscribers.clone();
        let fut = async move {
            let mut leading = false;
            let mut term = 0;
            loop {
                server.borrow_and_update();
                let Ok((now_leading, now_term, last_log_index)) =
                    raft.with_raft_state(leadership_view).await
                else {
                    break;
                };
                if now_leading != leading || (now_leading && now_term != term) {
                    leading = now_leading;
                    term = now_term;
                    tracing::info!(leading, term, "leadership changed");
                    for s in &subscribers {
                        s.do_send(LeadershipChanged {
                            leading,
                            term,
                            last_log_index,
                        });
                    }
                }
                if server.changed().await.is_err() {
                    break;
                }
            }
            // Raft's core stopped (shutdown, or a fatal error with the process still
            // up). Its last word, the `Shutdown` role, reaches the full metrics only: a
            // leader says here that it no longer leads.
            if leading {
                stopped_leading(&subscribers, term, &raft);
            }
        };
        ctx.spawn(actix::fut::wrap_future(fut));
    }
}

/// Tells `subscribers` that this replica, which led in `term`, leads no more: Raft's core
/// stopped.
fn stopped_leading(subscribers: &[Recipient<LeadershipChanged>], term: u64, raft: &Raft) {
    let last_log_index = raft.metrics().borrow().last_log_index.unwrap_or(0);
    tracing::info!(leading = false, term, "leadership changed: raft stopped");
    for s in subscribers {
        s.do_send(LeadershipChanged {
            leading: false,
            term,
            last_log_index,
        });
    }
}

/// Whether this replica leads, its term and its last log index, from one view of Raft's
/// state (what [`LeadershipChanged`] carries).
fn leadership_view(st: &openraft::RaftState<wire::raft::TypeConfig>) -> (bool, u64, u64) {
    (
        st.server_state == ServerState::Leader,
        st.vote_ref().leader_id.term,
        st.log_ids.last().map_or(0, |l| l.index),
    )
}

fn timeout_error(what: &str, d: Duration) -> Error {
    Error::Unavailable {
        reason: format!("{what} {TIMED_OUT} {} ms", d.as_millis()),
    }
}

const TIMED_OUT: &str = "not committed within";

/// True for the answer of a [`Propose`] that timed out: its entry may still be appended
/// and commit later (unlike a proposal refused because this replica does not lead).
pub fn is_commit_timeout(e: &Error) -> bool {
    matches!(e, Error::Unavailable { reason } if reason.contains(TIMED_OUT))
}

/// Whether a hold taken for a proposal is released once the proposal answered `r`: not
/// after a commit timeout, whose entry may still be appended and applied later (until
/// then its nodes must stay uncachable, or a cached read could be recorded with the old
/// value just before the write applies).
pub fn releases_hold<T>(r: &Result<T, Error>) -> bool {
    !matches!(r, Err(e) if is_commit_timeout(e))
}

impl Handler<Propose> for RaftNode {
    type Result = ResponseFuture<Result<Reply, Error>>;

    fn handle(&mut self, msg: Propose, _: &mut Context<Self>) -> Self::Result {
        Box::pin(self.proposer().propose(msg.0))
    }
}

/// Proposes commands to the Raft node's batcher without a message to the actor: what the
/// gateway's writes use. The actor runs on the replica's actix thread and the gateway on
/// the runtime's workers, so a [`Propose`] crossed threads twice more on its way in and
/// out (measured: docs/benchmarks.md, "CPU per write"); a proposal here goes straight into
/// the batcher's queue, in the same order and with the same timeout.
#[derive(Clone)]
pub struct Proposer {
    proposals: tokio::sync::mpsc::UnboundedSender<Proposal>,
    timeout: Duration,
}

impl Proposer {
    /// Queues `cmd` for the batcher at once (so proposals keep the order of these calls)
    /// and returns the wait for its result: applied on this leader, refused, or a commit
    /// timeout after the node's timeout.
    pub fn propose(
        &self,
        cmd: Command,
    ) -> impl std::future::Future<Output = Result<Reply, Error>> + Send + 'static {
        let timeout = self.timeout;
        let (answer, rx) = tokio::sync::oneshot::channel();
        let sent = self.proposals.send(Proposal { cmd, answer });
        async move {
            if sent.is_err() {
                return Err(Error::Unavailable {
                    reason: "the proposal batcher stopped".into(),
                });
            }
            // Timed out, the command may still be proposed and commit (it stays queued):
            // the caller treats it as a commit timeout.
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(Error::Unavailable {
                    reason: "the proposal batcher dropped the command".into(),
                }),
                Err(_) => Err(timeout_error("write", timeout)),
            }
        }
    }
}

/// The cell's members as clients see them.
pub fn members(raft: &Raft) -> Vec<MemberInfo> {
    let m = raft.metrics().borrow().membership_config.clone();
    let voters: BTreeSet<NodeId> = m.membership().voter_ids().collect();
    m.membership()
        .nodes()
        .map(|(id, n)| MemberInfo {
            id: *id,
            addr: n.addr.clone(),
            voter: voters.contains(id),
            store: n.store,
        })
        .collect()
}

impl Handler<ChangeMembership> for RaftNode {
    type Result = ResponseFuture<Result<Reply, Error>>;

    fn handle(&mut self, msg: ChangeMembership, _: &mut Context<Self>) -> Self::Result {
        let raft = self.raft.clone();
        // Catching up a learner from a snapshot may take a while: allow more time.
        let timeout = self.timeout * 6;
        Box::pin(async move {
            let fut = async {
                // The leader binds members to their stores with membership changes of its
                // own (`raft::binding::bind_stores`), and openraft takes one at a time: a
                // change refused as in progress is tried again (within the timeout).
                loop {
                    let r = change_membership_once(&raft, &msg).await;
                    match &r {
                        Err(openraft::error::RaftError::APIError(
                            openraft::error::ClientWriteError::ChangeMembershipError(
                                openraft::error::ChangeMembershipError::InProgress(_),
                            ),
                        )) => tokio::time::sleep(Duration::from_millis(50)).await,
                        _ => return r,
                    }
                }
            };
            match tokio::time::timeout(timeout, fut).await {
                Ok(Ok(_)) => Ok(Reply::MembershipChanged {
                    members: members(&raft),
                }),
                Ok(Err(e)) => Err(crate::errors::from_client_write(e)),
                Err(_) => Err(timeout_error("membership change", timeout)),
            }
        })
    }
}

/// One try of a membership change (`ChangeMembership`'s handler tries again while
/// another change is in progress). A promotion first waits until the leader has bound
/// the learner to its store: a voter whose answers do not count yet would weigh on the
/// cell like one that is down.
async fn change_membership_once(
    raft: &Raft,
    msg: &ChangeMembership,
) -> Result<
    openraft::raft::ClientWriteResponse<wire::raft::TypeConfig>,
    openraft::error::RaftError<
        wire::raft::TypeConfig,
        openraft::error::ClientWriteError<wire::raft::TypeConfig>,
    >,
> {
    match msg.clone() {
        ChangeMembership::AddLearner { id, addr } => {
            // Pending: its answers count once the leader binds it to the
            // store it answers from (`raft::binding::bind_stores`).
            let member = wire::raft::Member {
                addr,
                store: wire::raft::Binding::Pending,
            };
            raft.add_learner(id, member, true).await
        }
        ChangeMembership::Promote { id } => {
            let mut metrics = raft.metrics();
            for _ in 0..600 {
                let pending = metrics
                    .borrow_and_update()
                    .membership_config
                    .membership()
                    .get_node(&id)
                    .is_some_and(|m| m.store == wire::raft::Binding::Pending);
                if !pending {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(100), metrics.changed()).await;
            }
            raft.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
                .await
        }
        ChangeMembership::Remove { id } => {
            let voter = raft
                .metrics()
                .borrow()
                .membership_config
                .membership()
                .voter_ids()
                .any(|v| v == id);
            let change = if voter {
                ChangeMembers::RemoveVoters(BTreeSet::from([id]))
            } else {
                ChangeMembers::RemoveNodes(BTreeSet::from([id]))
            };
            raft.change_membership(change, false).await
        }
    }
}

/// The cell's first security settings ([`Command::Bootstrap`]): proposed by whichever
/// replica leads while the applied state has none, once that leader has applied every
/// committed entry (so it does not propose again what a previous leader committed; one
/// proposed twice applies once). Ends once the state holds them, or when Raft stops.
pub async fn bootstrap_security(
    raft: Raft,
    gate: crate::raft::read_gate::ReadGate,
    state: crate::raft::sm_store::SharedState,
    raft_node: actix::Addr<RaftNode>,
    admins: Vec<String>,
    root_acl: wire::acl::Acl,
) {
    const RETRY: Duration = Duration::from_millis(200);
    let bootstrapped = || {
        state
            .read()
            .expect("state lock")
            .sm
            .security()
            .bootstrapped()
    };
    let mut metrics = raft.metrics();
    loop {
        if bootstrapped() {
            return;
        }
        let leading = metrics.borrow_and_update().state == ServerState::Leader;
        if leading {
            let r = match gate.confirm().await {
                Ok(()) if bootstrapped() => return,
                Ok(()) => raft_node
                    .send(Propose(Command::Bootstrap {
                        admins: admins.clone(),
                        root_acl: root_acl.clone(),
                    }))
                    .await
                    .unwrap_or_else(|e| {
                        Err(Error::Internal {
                            reason: format!("raft node: {e}"),
                        })
                    }),
                Err(e) => Err(e),
            };
            match r {
                Ok(_) => {
                    tracing::info!(?admins, %root_acl, "security bootstrap committed");
                    return;
                }
                Err(e) => {
                    tracing::debug!("security bootstrap not committed yet: {e}");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            }
        }
        tokio::select! {
            changed = metrics.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::types::{CreateMode, TxnOp};

    fn proposal(cmd: Command) -> Proposal {
        Proposal {
            cmd,
            answer: tokio::sync::oneshot::channel().0,
        }
    }

    fn create(parent: &str, data: usize) -> Command {
        Command::Write {
            session: 1,
            request_id: 1,
            ack_below: 0,
            ops: vec![TxnOp::Create {
                path: format!("{parent}/n-"),
                data: vec![0; data],
                mode: CreateMode::default(),
            }],
            single: true,
        }
    }

    fn sizes(queue: &mut std::collections::VecDeque<Proposal>) -> Vec<usize> {
        let mut out = Vec::new();
        while !queue.is_empty() {
            out.push(take_batch(queue).len());
        }
        out
    }

    /// Batches are runs from the front of the queue, in order: lock contenders under one
    /// parent and new sessions share an entry; the rule's 1024 creates, and the count and
    /// size limits, end a run (and start the next).
    #[test]
    fn batches_are_ordered_runs_cut_by_the_rule_and_the_limits() {
        let mut q: std::collections::VecDeque<Proposal> = [
            create("/a", 0),
            create("/b", 0),
            Command::CreateSession {
                owner: "lock://client/test".into(),
            },
            create("/a", 0),
            Command::CreateSession {
                owner: "lock://client/test".into(),
            },
            Command::Noop,
        ]
        .into_iter()
        .map(proposal)
        .collect();
        assert_eq!(sizes(&mut q), vec![6], "creates under /a share the entry");

        // A transaction of 128 creates (the most one may hold) fills an entry's 1024
        // creates eight times over.
        let txn = |i: u64| Command::Write {
            session: 1,
            request_id: i,
            ack_below: 0,
            ops: (0..wire::TXN_OPS_MAX)
                .map(|k| TxnOp::Create {
                    path: format!("/a/n{i}-{k}"),
                    data: Vec::new(),
                    mode: CreateMode::default(),
                })
                .collect(),
            single: false,
        };
        let mut q: std::collections::VecDeque<Proposal> =
            (0..20).map(|i| proposal(txn(i))).collect();
        assert_eq!(sizes(&mut q), vec![8, 8, 4]);
        // One that the rule refuses even alone still goes, alone, to be refused at apply.
        let mut huge = txn(99);
        if let Command::Write { ops, .. } = &mut huge {
            let more = ops.clone();
            for _ in 0..8 {
                ops.extend(more.iter().cloned());
            }
        }
        let mut q: std::collections::VecDeque<Proposal> = [proposal(huge), proposal(Command::Noop)]
            .into_iter()
            .collect();
        assert_eq!(sizes(&mut q), vec![1, 1]);

        let mut q: std::collections::VecDeque<Proposal> = (0..BATCH_COMMANDS_MAX + 5)
            .map(|_| proposal(Command::Noop))
            .collect();
        let first = take_batch(&mut q);
        assert_eq!(first.len(), BATCH_COMMANDS_MAX, "the count ends it");
        assert_eq!(sizes(&mut q), vec![5]);

        // 64 KiB values: about 16 to a MiB; one larger than the limit still goes alone.
        let mut q: std::collections::VecDeque<Proposal> = (0..40)
            .map(|i| proposal(create(&format!("/p{i}"), 64 * 1024)))
            .chain([proposal(create("/big", 2 * BATCH_BYTES_MAX))])
            .collect();
        let s = sizes(&mut q);
        assert_eq!(s.iter().sum::<usize>(), 41, "{s:?}");
        assert!(s.iter().all(|n| *n <= 16), "{s:?}");
        assert_eq!(*s.last().unwrap(), 1, "{s:?}");
    }

    #[test]
    fn a_proposal_that_timed_out_keeps_its_hold_and_every_other_answer_releases_it() {
        let timed_out: Result<(), Error> = Err(timeout_error("write", Duration::from_secs(5)));
        assert!(!releases_hold(&timed_out), "{timed_out:?}");
        for r in [
            Ok(()),
            Err(Error::NotLeader {
                leader_id: None,
                leader_addr: None,
            }),
            Err(Error::Unavailable {
                reason: "leadership not confirmed by a quorum within 5000 ms".into(),
            }),
            Err(Error::SessionExpired { session: 7 }),
        ] {
            assert!(releases_hold(&r), "{r:?}");
        }
    }

    /// Records what [`LeadershipChanged`] messages it is sent.
    struct Seen(std::sync::Arc<std::sync::Mutex<Vec<(bool, u64)>>>);

    impl Actor for Seen {
        type Context = Context<Self>;
    }

    impl Handler<LeadershipChanged> for Seen {
        type Result = ();

        fn handle(&mut self, m: LeadershipChanged, _: &mut Context<Self>) {
            self.0.lock().unwrap().push((m.leading, m.term));
        }
    }

    /// The Raft node tells its subscribers when it starts leading, and when a leader's
    /// Raft core stops (shut down here; a fatal storage error stops it the same way with
    /// the process still up) that it leads no more: openraft's last word, the `Shutdown`
    /// role, reaches only its full metrics, which the leadership watcher does not wait on.
    #[actix_rt::test]
    async fn a_leader_whose_raft_stops_tells_its_subscribers_it_leads_no_more() {
        use crate::raft::{
            mem_log::MemLog,
            network::PeerNetworkFactory,
            sm_store::{SmStore, SnapshotSink},
        };
        let dir = tempfile::tempdir().unwrap();
        let tls_dir = dir.path().join("tls");
        wire::tls::DevCa::generate()
            .unwrap()
            .write_to(&tls_dir)
            .unwrap();
        let tls = wire::tls::TlsConfig::replica_in_dir(&tls_dir);
        let rustls = || {
            wire::tls::client_config(&tls, wire::hello::ALPN_PEER)
                .unwrap()
                .0
        };
        let endpoint =
            wire::quic::client_endpoint(rustls(), "127.0.0.1:0".parse().unwrap()).unwrap();
        let peer_tls = wire::quic::client_config(rustls()).unwrap();
        let network =
            PeerNetworkFactory::new(endpoint, peer_tls, 1, "test", wire::raft::StoreId([1; 16]));
        let snaps = dir.path().join("snapshots");
        std::fs::create_dir_all(&snaps).unwrap();
        let sm = SmStore::open(&snaps, SnapshotSink::Direct(snaps.clone()), None).unwrap();
        let config = openraft::Config {
            heartbeat_interval: 50,
            election_timeout_min: 150,
            election_timeout_max: 300,
            ..Default::default()
        };
        let raft = Raft::new(
            1,
            std::sync::Arc::new(config.validate().unwrap()),
            network,
            MemLog::new(),
            sm,
        )
        .await
        .unwrap();
        raft.initialize(std::collections::BTreeMap::from([(
            1,
            wire::raft::Member::unbound("127.0.0.1:1"),
        )]))
        .await
        .unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let subscriber = Seen(seen.clone()).start();
        let _node = RaftNode::new(
            raft.clone(),
            Duration::from_secs(5),
            vec![subscriber.recipient()],
        )
        .start();
        let until = |want: (bool, u64)| {
            let seen = seen.clone();
            async move {
                for _ in 0..100 {
                    if seen.lock().unwrap().contains(&want) {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            }
        };
        assert!(until((true, 1)).await, "told it leads in term 1: {seen:?}");
        raft.shutdown().await.unwrap();
        assert!(
            until((false, 1)).await,
            "told it leads no more once raft stopped: {seen:?}"
        );
    }
}
