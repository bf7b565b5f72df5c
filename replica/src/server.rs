//! Starting and stopping a replica: the library call `main.rs` makes.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, AsyncContext, SyncArbiter};
use openraft::SnapshotPolicy;
use tokio::sync::mpsc;
use wire::hello::{ALPN_CLIENT, ALPN_PEER};
use wire::quic::Sockets;
use wire::raft::Member;

use crate::actors::cacher_list::CacherListActor;
use crate::actors::messages::AppliedMsg;
use crate::actors::raft_node::RaftNode;
use crate::actors::session_manager::SessionManager;
use crate::actors::snapshotter::{SnapshotEncoder, Snapshotter};
use crate::actors::watch_table::WatchTableActor;
use crate::config::ReplicaConfig;
use crate::gateway::Gateway;
use crate::raft::log_store::LogStore;
use crate::raft::mem_log::MemLog;
use crate::raft::network::PeerNetworkFactory;
use crate::raft::read_gate::ReadGate;
use crate::raft::sm_store::{SmStore, SnapshotSink};
use crate::raft::Raft;

/// The Raft log a replica runs on: fjall on disk, or the simulation's in memory.
enum Log {
    Disk(LogStore),
    Memory(MemLog),
}

/// Refuses to start where the log store would be made anew (no fjall database in its
/// directory: missing, empty, or a fresh volume's) while snapshots remain: the log was lost (a disk of its own, a directory
/// deleted) and the snapshots were not. A new store there would start from an old
/// snapshot whose membership may still show this replica unbound or pending, and vote and
/// stand as a member it no longer is (docs/architecture.md, "A replica whose data was
/// lost"). A restore makes the log store before it writes its snapshot
/// (`backup::seed`), so a seeded replica's first start is not refused.
fn refuse_snapshots_without_their_log(
    log_dir: &std::path::Path,
    snap_dir: &std::path::Path,
) -> anyhow::Result<()> {
    let log_is_new =
        !LogStore::exists(log_dir).map_err(|e| anyhow::anyhow!("{}: {e}", log_dir.display()))?;
    let snapshots = crate::raft::snapshot_file::list(snap_dir)?;
    if log_is_new && !snapshots.is_empty() {
        anyhow::bail!(
            "{} holds no Raft log but {} holds {} snapshot(s): this replica's log was lost, \
             and its snapshots alone must not make it a member again. Empty the data \
             directory (keep a copy for a post-mortem), start the replica empty (bootstrap \
             = false), and replace it in the cell: lockctl member remove <id>, then \
             add-learner and promote (docs/operations.md, \"A replica whose data was \
             lost\"). If the directory was seeded by hand or by an older build's restore, \
             run this build's lockctl snapshot restore into an empty directory instead",
            log_dir.display(),
            snap_dir.display(),
            snapshots.len()
        );
    }
    Ok(())
}

/// openraft's configuration from ours.
pub fn raft_config(cfg: &ReplicaConfig) -> anyhow::Result<openraft::Config> {
    let r = &cfg.raft;
    let c = openraft::Config {
        cluster_name: "lockservice".into(),
        heartbeat_interval: r.heartbeat_interval_ms,
        election_timeout_min: r.election_timeout_min_ms,
        election_timeout_max: r.election_timeout_max_ms,
        install_snapshot_timeout: 5_000,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(r.snapshot_interval_entries),
        max_in_snapshot_log_to_keep: r.log_entries_kept_after_snapshot,
        // Pieces a snapshot is written to a follower's stream in (`network::full_snapshot`),
        // each due within `install_snapshot_timeout`, as 0.9's chunks were.
        snapshot_max_chunk_size: 4 * 1024 * 1024,
        // What the feature `loosen-follower-log-revert` did in openraft 0.9 (see the
        // workspace's Cargo.toml).
        allow_log_reversion: Some(true),
        // openraft 0.9 had no pre-vote: keep elections as they were (0.10's default is off
        // too, but may change; `network.rs` does not implement the pre-vote RPC).
        enable_pre_vote: Some(false),
        // A leader's own entries may not be on its disk when its followers commit them
        // (0.10 replicates an entry once `append` returns, before its fsync: the log
        // store's `append` returns at once, so the leader's fsync overlaps replication and
        // many appends share one fsync). A leader killed then and restarted must not lead
        // again in its old term: it would give the entries it lost, which the cell
        // committed, new contents under the same log ids. With restore off it comes back
        // as a follower and a new term is elected, whose log check keeps those entries.
        // Test: `cell_failover::a_leader_killed_before_its_fsync_loses_no_committed_write`.
        enable_leader_restore: Some(false),
        // Off until `raft::binding::guard_candidacy` has looked at the membership: a
        // replica whose store is not the one the cell binds it to must not stand, not
        // even at the first tick (a single voter elects there without a timeout).
        enable_elect: false,
        ..Default::default()
    };
    Ok(c.validate()?)
}

/// What a replica runs on besides its configuration. [`run`] uses the default: real UDP
/// sockets, the Raft log on fjall under the data directory, and snapshot files written by
/// the snapshotter actor on its own thread.
#[derive(Debug, Clone, Default)]
pub struct Plumbing {
    /// The UDP sockets of the replica's QUIC endpoint.
    pub sockets: Sockets,
    /// Keep the Raft log in this in-memory store instead of fjall, and write snapshot
    /// files from the state machine's task instead of the snapshotter thread. For the
    /// fault suite's simulation, where every task runs on one simulated clock and no
    /// actix system (which the snapshotter's thread needs) exists.
    pub memory_log: Option<MemLog>,
}

/// Runs a replica until `shutdown` resolves. Must be called inside an actix system whose
/// tokio runtime is multi-threaded (see `main.rs`).
pub async fn run(cfg: ReplicaConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    run_on(cfg, Plumbing::default(), shutdown).await
}

/// [`run`] on the given [`Plumbing`]. With an in-memory log it needs no actix system, only
/// a tokio `LocalSet` (actors are spawned as local tasks).
pub async fn run_on(
    cfg: ReplicaConfig,
    plumbing: Plumbing,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    cfg.validate()?;
    let started = tokio::time::Instant::now();
    let log_dir = crate::backup::log_dir(&cfg.data_dir);
    let snap_dir = crate::backup::snapshot_dir(&cfg.data_dir);
    if plumbing.memory_log.is_none() {
        refuse_snapshots_without_their_log(&log_dir, &snap_dir)?;
    }
    std::fs::create_dir_all(&log_dir)?;
    std::fs::create_dir_all(&snap_dir)?;

    // Mutual TLS on both protocols; the certificate must be a replica's, and its cell is
    // this replica's cell.
    let (server_tls, me, tls_files) =
        wire::tls::server_config_reloading(&cfg.tls, &[ALPN_CLIENT, ALPN_PEER])
            .map_err(|e| anyhow::anyhow!("replica {}'s TLS files: {e}", cfg.id))?;
    let cell = match &me {
        wire::identity::Identity::Replica { cell, .. } => cell.clone(),
        other => anyhow::bail!(
            "replica {}: the certificate in {} is {other}, a {}'s; a replica needs one for \
             lock://<cell>/replica/<name> (lockctl certs issue --role replica)",
            cfg.id,
            cfg.tls.cert.display(),
            other.role()
        ),
    };
    let (peer_tls, _, peer_files) =
        wire::tls::client_config_reloading(&cfg.tls, ALPN_PEER).map_err(anyhow::Error::msg)?;
    let peer_tls = wire::quic::client_config(peer_tls).map_err(anyhow::Error::msg)?;
    // Stateless resets signed with a key derived from our TLS key and identity: after a
    // kill and restart, peers and clients still sending on a connection to the old process
    // are told at once rather than after their idle timeout.
    let reset = wire::quic::StableReset::from_key_file(
        &cfg.tls.key,
        &format!("replica {} at {}", cfg.id, cfg.advertised()),
    )
    .map_err(anyhow::Error::msg)?;
    let endpoint = wire::quic::server_endpoint_on(
        &plumbing.sockets,
        cfg.listen,
        server_tls,
        None,
        Some(reset),
    )
    .map_err(anyhow::Error::msg)?;

    let sink = if plumbing.memory_log.is_some() {
        SnapshotSink::Direct(snap_dir.clone())
    } else {
        let dir = snap_dir.clone();
        SnapshotSink::Actor {
            write: SyncArbiter::start(1, move || Snapshotter::new(dir.clone())).recipient(),
            encode: SyncArbiter::start(1, || SnapshotEncoder).recipient(),
        }
    };
    let (applied_tx, mut applied_rx) = mpsc::unbounded_channel();
    let mut sm_store = SmStore::open(&snap_dir, sink, Some(applied_tx))?;
    sm_store.set_build_delay(Duration::from_millis(cfg.faults.snapshot_build_delay_ms));
    let state = sm_store.shared();
    let snapshot_stats = sm_store.snapshot_stats();
    // The log store first: its id goes in every answer to a peer.
    let log = match plumbing.memory_log {
        Some(log) => Log::Memory(log),
        None => {
            // A slow disk and a power loss on demand, for tests only
            // (`LogStore::open_with_hook`).
            let hook = (std::env::var(crate::raft::log_store::TEST_HOOKS_ENV).as_deref()
                == Ok("1"))
            .then(|| cfg.data_dir.clone());
            if hook.is_some() {
                tracing::warn!("test hooks on: the log's fsyncs stall as the data directory's test-sync-stall-ms asks, and a power loss is emulated at start if test-lose-unsynced exists");
            }
            Log::Disk(LogStore::open_with_hook(&log_dir, hook)?)
        }
    };
    let store_id = match &log {
        Log::Memory(log) => log.store_id(),
        Log::Disk(log) => log.store_id(),
    };
    tracing::info!(store = %store_id, "this replica's store");
    let network = PeerNetworkFactory::new(endpoint.clone(), peer_tls, cfg.id, &cell, store_id)
        .with_tls_files(peer_files);
    let seen_stores = network.seen_stores();
    let peer_dials = network.dials();
    let probe_network = network.clone();
    let raft_slot = network.raft_slot();
    let peer_certificate_checks = network.cert_checks();
    let config = Arc::new(raft_config(&cfg)?);
    let (raft, log_stats) = match log {
        Log::Memory(log) => {
            let raft = Raft::new(cfg.id, config, network, log, sm_store).await?;
            (raft, Arc::default())
        }
        Log::Disk(log_store) => {
            let log_stats = log_store.stats();
            let raft = Raft::new(cfg.id, config, network, log_store, sm_store).await?;
            (raft, log_stats)
        }
    };

    let _ = raft_slot.set(raft.clone());
    // Only the store the cell binds this replica to may stand, and the leader binds the
    // members not bound yet (`raft::binding`).
    wire::rt::spawn(crate::raft::binding::guard_candidacy(
        raft.clone(),
        cfg.id,
        store_id,
    ));
    wire::rt::spawn(crate::raft::binding::bind_stores(
        raft.clone(),
        cfg.id,
        store_id,
        seen_stores,
    ));
    // A new cell is initialized once the other members are asked (below, beside serving:
    // this replica answers their probes and RPCs meanwhile).
    let bootstrap = cfg.bootstrap && !raft.is_initialized().await?;

    let timeout = Duration::from_millis(cfg.request_timeout_ms);
    let gate = ReadGate::start(raft.clone(), timeout);
    let watch_table = WatchTableActor::new(state.clone()).start();
    let cacher_list = CacherListActor::new(watch_table.clone(), state.clone())
        .with_metrics(raft.metrics())
        .start();
    let instruments = Arc::new(crate::metrics::Instruments::default());
    wire::rt::spawn(crate::metrics::count_leader_changes(
        raft.clone(),
        instruments.leader_changes.clone(),
    ));
    let mut raft_node_addr = None;
    let mut proposer = None;
    let session_manager = SessionManager::create(|ctx| {
        let subscribers = vec![
            ctx.address().recipient(),
            watch_table.clone().recipient(),
            cacher_list.clone().recipient(),
        ];
        let rn = RaftNode::new(raft.clone(), timeout, subscribers)
            .with_commit_histogram(instruments.commit_seconds.clone());
        proposer = Some(rn.proposer());
        let rn = rn.start();
        raft_node_addr = Some(rn.clone());
        SessionManager::new(
            rn,
            gate.clone(),
            state.clone(),
            Duration::from_millis(cfg.session.lease_ms),
            Duration::from_millis(cfg.session.checkpoint_interval_ms),
            Duration::from_millis(cfg.session.expiry_scan_interval_ms),
        )
        .with_cachers(cacher_list.clone())
        .with_expiry_counter(instruments.session_expiries.clone())
        .with_quorum_watch(
            raft.metrics(),
            Duration::from_millis(cfg.raft.election_timeout_min_ms),
        )
    });
    let raft_node = raft_node_addr.expect("raft node started");
    let proposer = proposer.expect("raft node started");

    let sm_for_applied = session_manager.clone();
    let wt_for_applied = watch_table.clone();
    let cl_for_applied = cacher_list.clone();
    wire::rt::spawn(async move {
        while let Some(a) = applied_rx.recv().await {
            wt_for_applied.do_send(AppliedMsg(a.clone()));
            cl_for_applied.do_send(AppliedMsg(a.clone()));
            sm_for_applied.do_send(AppliedMsg(a));
        }
    });

    wire::rt::spawn(crate::actors::raft_node::bootstrap_security(
        raft.clone(),
        gate.clone(),
        state.clone(),
        raft_node.clone(),
        cfg.security.initial_admins.clone(),
        cfg.security.root_acl(),
    ));

    let backup = match &cfg.backup.url {
        Some(url) => {
            let store =
                crate::backup::Store::open(url, &cfg.backup.options).map_err(anyhow::Error::msg)?;
            let stats = Arc::new(crate::actors::backuper::BackupStats::default());
            let addr = crate::actors::backuper::Backuper::new(
                cfg.id,
                cell.clone(),
                cfg.backup.clone(),
                store,
                state.clone(),
                raft.clone(),
                stats.clone(),
            )
            .start();
            tracing::info!(store = %url, every_secs = cfg.backup.interval_secs, keep = cfg.backup.keep, "backups on (written by the leader)");
            Some(crate::gateway::Backups {
                addr,
                url: url.clone(),
                stats,
            })
        }
        None => None,
    };

    tracing::info!(identity = %me, "replica's certificate checked");
    let gw = Arc::new(Gateway {
        backup,
        id: cfg.id,
        cell,
        raft: raft.clone(),
        raft_node,
        proposer,
        sessions: session_manager,
        watches: watch_table,
        cachers: cacher_list.clone(),
        gate,
        state,
        lease_ms: cfg.session.lease_ms,
        log_stats,
        keepalive_stats: Default::default(),
        snapshot_stats,
        in_flight: Default::default(),
        latency: Default::default(),
        peer_dials,
        peer_certificate_checks,
        last_digest: Default::default(),
        quotas: wire::quota::Quotas::new(cfg.limits.per_identity.clone()),
        instruments: instruments.clone(),
        stood_first: Default::default(),
        store: store_id,
        snapshot_receiving: Default::default(),
    });
    let l = &cfg.limits;
    let bounds = crate::gateway::ServeBounds {
        gate: wire::quic::ConnectionGate::new(wire::quic::ConnectionLimits {
            connections_max: l.connections_max,
            connections_per_source_max: l.connections_per_source_max,
        }),
        client_connection_bytes_max: l.client_connection_bytes_max,
        peer_connection_bytes_max: l.peer_connection_bytes_max,
        tls_files: Some(tls_files),
    };
    let metrics = match cfg.metrics.listen {
        Some(addr) => {
            let listener = wire::metrics::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("replica {}: {e}", cfg.id))?;
            tracing::info!(%addr, "metrics, /health and /ready served");
            let probe = crate::metrics::ReplicaProbe {
                gateway: gw.clone(),
                instruments,
                cert: cfg.tls.cert.clone(),
            };
            Some(wire::rt::spawn(wire::metrics::serve(
                listener,
                Arc::new(probe),
            )))
        }
        None => None,
    };
    let serve = wire::rt::spawn(crate::gateway::serve(endpoint.clone(), gw, bounds));
    tracing::info!(id = cfg.id, listen = %cfg.listen, "replica serving");
    if bootstrap {
        // Unbound: the first leader binds them (`raft::binding::bind_stores`).
        let members: BTreeMap<u64, Member> = cfg
            .members
            .iter()
            .map(|m| (m.id, Member::unbound(m.addr.clone())))
            .collect();
        tracing::info!(
            ?members,
            "asking the other members before initializing a new cell"
        );
        wire::rt::spawn(crate::raft::bootstrap::initialize_new_cell(
            raft.clone(),
            probe_network,
            cfg.id,
            store_id,
            members,
            started,
        ));
    }

    shutdown.await;
    tracing::info!("shutting down");
    // A leader hands over first, so clients lose no more than a few round trips
    // (issue 27, item 5); a follower, or a leader whose hand-over fails, just stops.
    if raft.metrics().borrow().state == openraft::ServerState::Leader {
        if let Err(e) = crate::raft::handover::hand_over(
            &raft,
            cfg.id,
            None,
            crate::raft::handover::HAND_OVER_WITHIN,
        )
        .await
        {
            tracing::warn!(error = %e, "stopping without handing the leadership over");
        }
    }
    endpoint.close(0u32.into(), b"shutdown");
    let _ = raft.shutdown().await;
    serve.abort();
    if let Some(m) = metrics {
        m.abort();
    }
    Ok(())
}

/// Runs a replica in this thread until SIGINT or SIGTERM: builds the runtime (a
/// multi-thread tokio runtime under an actix system) and calls [`run`]. What the `replica`
/// binary and `lockctl replica` do.
pub fn run_until_signal(cfg: ReplicaConfig) -> anyhow::Result<()> {
    let system = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    });
    system.block_on(async move { run(cfg, wire::rt::shutdown_signal()).await })
}
