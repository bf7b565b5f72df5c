//! `lockctl dir`: the directory's map of prefixes to cells, kept in the root cell
//! (`docs/directory.md`). `--endpoints` names the root cell; the cells are reached at the
//! endpoints their entries list, with the same TLS files (the identity must be an admin
//! of the root cell and of every cell it places or moves a prefix in).

use anyhow::Context;
use clap::Subcommand;
use client_sdk::{Client, ClientConfig, CreateMode, Session};
use wire::directory::{
    cell_node, check_cell_name, check_prefix, decode, encode, prefix_node, CellInfo, PrefixEntry,
    PrefixRecord, PrefixState, ROOT_CELLS, ROOT_DIR, ROOT_PREFIXES,
};
use wire::Error;

/// `lockctl dir ...`
#[derive(Subcommand, Debug)]
pub enum DirCommand {
    /// Print the map: every cell with its endpoints, every prefix with its cell and
    /// epoch (and a move under way).
    #[command(after_help = "Examples:\n  lockctl --endpoints 127.0.0.1:7201 dir ls")]
    Ls,
    /// Describe a cell (create or replace its entry): its name and where clients reach
    /// it (its proxies, or its replicas).
    ///
    /// Example: lockctl --endpoints ROOT dir cell cell-a 127.0.0.1:7101,127.0.0.1:7102
    #[command(
        after_help = "Examples:\n  lockctl --endpoints 127.0.0.1:7201 dir cell cell-a 127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103"
    )]
    Cell {
        /// The cell's name.
        name: String,
        /// Its endpoints, comma-separated.
        #[arg(value_name = "ENDPOINTS", value_delimiter = ',', required = true)]
        addrs: Vec<String>,
    },
    /// Place a prefix in a cell: the cell records it owned (epoch 0), then the directory
    /// names the cell. Placing it where it already is does nothing; a prefix placed
    /// elsewhere moves with `dir move`.
    ///
    /// Note: a cell that records its first prefix serves only its prefixes from then on.
    ///
    /// Example: lockctl --endpoints ROOT dir set /payments cell-a
    #[command(
        after_help = "Examples:\n  lockctl --endpoints 127.0.0.1:7201 dir set /payments cell-a"
    )]
    Set {
        /// The prefix (`/payments`).
        prefix: String,
        /// The cell.
        cell: String,
    },
    /// Remove a prefix's entry from the map (its cell keeps its nodes and its record).
    #[command(after_help = "Examples:\n  lockctl --endpoints 127.0.0.1:7201 dir rm /payments")]
    Rm {
        /// The prefix.
        prefix: String,
    },
    /// Move a prefix to another cell: freeze it in its cell (writes wait), copy its
    /// persistent nodes (data, versions, ACLs), let the old cell go (its locks and other
    /// ephemeral nodes there end), the new cell serves it at the next epoch, the old copy
    /// is dropped, and the directory names the new cell. Safe to run again after a crash
    /// at any step: it goes on from where the cells and the map stand.
    #[command(
        after_help = "Examples:\n  lockctl --endpoints 127.0.0.1:7201 dir move /payments --to cell-b"
    )]
    Move {
        /// The prefix.
        prefix: String,
        /// The cell it moves to.
        #[arg(long)]
        to: String,
    },
}

/// Runs `cmd` against the root cell `root`; `template` is how cells are reached.
pub async fn run(root: &Client, template: &ClientConfig, cmd: DirCommand) -> anyhow::Result<()> {
    let session = root.open_session().await?;
    let r = run_in(&session, root, template, cmd).await;
    let _ = session.close().await;
    r
}

async fn run_in(
    s: &Session,
    root: &Client,
    template: &ClientConfig,
    cmd: DirCommand,
) -> anyhow::Result<()> {
    match cmd {
        DirCommand::Ls => {
            let map = read(s).await?;
            for c in &map.cells {
                println!("cell   {}\t{}", c.name, c.endpoints.join(","));
            }
            for p in &map.prefixes {
                let moving = p
                    .moving_to
                    .as_ref()
                    .map(|to| format!("\tmoving to {to}"))
                    .unwrap_or_default();
                println!("prefix {}\t{}\tepoch {}{moving}", p.prefix, p.cell, p.epoch);
            }
            Ok(())
        }
        DirCommand::Cell {
            name,
            addrs: endpoints,
        } => {
            check_cell_name(&name)?;
            for e in &endpoints {
                if e.parse::<std::net::SocketAddr>().is_err() {
                    anyhow::bail!("bad endpoint {e:?}: expected host:port, e.g. 127.0.0.1:7101");
                }
            }
            let info = CellInfo {
                name: name.clone(),
                endpoints,
            };
            // The endpoints must be that cell's (their certificates name it), and answer.
            let cell = connect(template, &info).await?;
            cell.prefixes().await.with_context(|| {
                format!(
                    "{} is not reachable as cell {name} (do its certificates say \
                     lock://{name}/...?)",
                    info.endpoints.join(",")
                )
            })?;
            folders(s, root).await?;
            put(s, &cell_node(&name), encode(&info), None).await?;
            println!("cell {name} described");
            Ok(())
        }
        DirCommand::Set { prefix, cell } => {
            check_prefix(&prefix)?;
            let info = cell_info(s, &cell).await?;
            // One command per prefix at a time (a move, a placement, a removal).
            folders(s, root).await?;
            take_prefix_lease(s, &prefix).await?;
            if let Some((e, _)) = entry(s, &prefix).await? {
                if e.cell == cell && e.moving_to.is_none() {
                    // Told again (an earlier run may have stopped before telling it).
                    connect(template, &info)
                        .await?
                        .set_prefix(&prefix, e.epoch, PrefixState::Owned)
                        .await?;
                    println!("{prefix} is in {cell} already (epoch {})", e.epoch);
                    return Ok(());
                }
                anyhow::bail!(
                    "{prefix} is placed in {} (epoch {}); move it with `lockctl dir move {prefix} --to {cell}`",
                    e.cell,
                    e.epoch
                );
            }
            // The entry first, created only if there is none (two placements at once: one
            // wins, the other is refused before it touches its cell); then the cell.
            // Until the cell records the prefix, clients sent there get `WrongCell` and
            // retry. (The folders were made before the lease.)
            let e = PrefixEntry {
                prefix: prefix.clone(),
                cell: cell.clone(),
                epoch: 0,
                moving_to: None,
            };
            match s
                .create(&prefix_node(&prefix), encode(&e), CreateMode::default())
                .await
            {
                Ok(_) => {}
                Err(Error::NodeExists { .. }) => {
                    let (now, _) = entry(s, &prefix).await?.ok_or_else(|| {
                        anyhow::anyhow!("{prefix}'s entry came and went; run this again")
                    })?;
                    if now.cell != cell {
                        anyhow::bail!("{prefix} was just placed in {} by someone else", now.cell);
                    }
                }
                Err(e) => return Err(e.into()),
            }
            connect(template, &info)
                .await?
                .set_prefix(&prefix, 0, PrefixState::Owned)
                .await?;
            println!("{prefix} placed in {cell} (epoch 0)");
            Ok(())
        }
        DirCommand::Rm { prefix } => {
            check_prefix(&prefix)?;
            // Nothing to remove (and then maybe no `/directory` to hold the lease under).
            if entry(s, &prefix).await?.is_none() {
                println!("{prefix} is not in the map");
                return Ok(());
            }
            // One command per prefix at a time (a move, a placement, a removal): a `dir
            // set` cannot tell the cell to own the prefix between this check and the
            // removal.
            take_prefix_lease(s, &prefix).await?;
            let Some((e, version)) = entry(s, &prefix).await? else {
                println!("{prefix} is not in the map");
                return Ok(());
            };
            if let Some(to) = &e.moving_to {
                anyhow::bail!(
                    "a move of {prefix} to {to} is under way: finish it first with \
                     `lockctl dir move {prefix} --to {to}`; the entry stays"
                );
            }
            // A cell that still serves the prefix keeps it: removing the entry then would
            // let `dir set` place it in a second cell. A cell that cannot be asked might.
            let recorded = async {
                let info = cell_info(s, &e.cell).await?;
                anyhow::Ok(connect(template, &info).await?.prefixes().await?)
            }
            .await
            .with_context(|| {
                format!(
                    "could not ask {} whether it still serves {prefix}; the entry stays",
                    e.cell
                )
            })?;
            if let Some(why) = still_served(&e.cell, &prefix, &recorded) {
                anyhow::bail!("{why}: move it away first; the entry stays");
            }
            // Only the entry checked (the lease serializes our own commands; the version
            // also catches a hand edit of the map).
            match s.delete(&prefix_node(&prefix), Some(version)).await {
                Ok(()) => println!("{prefix} removed from the map"),
                Err(Error::NoNode { .. }) => println!("{prefix} is not in the map"),
                Err(Error::BadVersion { .. }) => anyhow::bail!(
                    "{prefix}'s entry changed while it was checked (edited outside `lockctl \
                     dir`, or by a command whose hold lapsed): run this again; the entry stays"
                ),
                Err(e) => return Err(e.into()),
            }
            Ok(())
        }
        DirCommand::Move { prefix, to } => {
            let stop = |step| {
                stop_after(step);
                false
            };
            move_prefix(s, template, &prefix, &to, &stop)
                .await
                .map(|_| ())
        }
    }
}

/// `dir move` as the fault suite's simulation runs it: stopped after step `stop_after`
/// (as a crash there would: the mover's session is left to expire, so its lease on the
/// move holds until then), or to the end. True if the move finished.
pub async fn move_or_stop(
    root: &Client,
    template: &ClientConfig,
    prefix: &str,
    to: &str,
    stop_after: Option<u32>,
) -> anyhow::Result<bool> {
    let session = root.open_session().await?;
    let stop = |step| stop_after == Some(step);
    let r = move_prefix(&session, template, prefix, to, &stop).await;
    if matches!(r, Ok(false)) {
        session.stop_keepalives();
    } else {
        let _ = session.close().await;
    }
    r
}

/// The map as the root cell holds it.
pub async fn read(s: &Session) -> anyhow::Result<wire::directory::DirectoryMap> {
    let mut map = wire::directory::DirectoryMap::default();
    for folder in [ROOT_CELLS, ROOT_PREFIXES] {
        let children = match s.children(folder).await {
            Ok(c) => c,
            Err(Error::NoNode { .. }) => continue,
            Err(e) => return Err(e.into()),
        };
        for (name, _) in children {
            let path = format!("{folder}/{name}");
            let (data, stat) = s.get(&path).await?;
            map.index = map.index.max(stat.mod_index);
            if folder == ROOT_CELLS {
                map.cells.push(decode(&data, &path)?);
            } else {
                map.prefixes.push(decode(&data, &path)?);
            }
        }
    }
    Ok(map)
}

/// Creates the map's folders if missing. `/directory` is made readable by everyone and
/// changeable by the root cell's admins only (its children inherit that).
async fn folders(s: &Session, root: &Client) -> anyhow::Result<()> {
    for f in [ROOT_DIR, ROOT_CELLS, ROOT_PREFIXES] {
        match s.create(f, Vec::new(), CreateMode::default()).await {
            Ok(_) if f == ROOT_DIR => {
                let acl = wire::acl::Acl {
                    read: vec![wire::acl::Principal::Everyone],
                    write: Vec::new(),
                    create: Vec::new(),
                    admin: Vec::new(),
                };
                root.set_acl(ROOT_DIR, acl).await?;
            }
            Ok(_) | Err(Error::NodeExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Creates `path` with `data`, or replaces its data (if at `version`, when given).
async fn put(s: &Session, path: &str, data: Vec<u8>, version: Option<u64>) -> anyhow::Result<()> {
    if version.is_none() {
        match s.create(path, data.clone(), CreateMode::default()).await {
            Ok(_) => return Ok(()),
            Err(Error::NodeExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    s.set_data(path, data, version).await?;
    Ok(())
}

async fn cell_info(s: &Session, cell: &str) -> anyhow::Result<CellInfo> {
    check_cell_name(cell)?;
    match s.get(&cell_node(cell)).await {
        Ok((data, _)) => Ok(decode(&data, &cell_node(cell))?),
        Err(Error::NoNode { .. }) => anyhow::bail!(
            "the map does not describe cell {cell}: add it with `lockctl dir cell {cell} ENDPOINTS`"
        ),
        Err(e) => Err(e.into()),
    }
}

/// A prefix's entry and its node's version, if the map has one.
async fn entry(s: &Session, prefix: &str) -> anyhow::Result<Option<(PrefixEntry, u64)>> {
    match s.get(&prefix_node(prefix)).await {
        Ok((data, stat)) => Ok(Some((decode(&data, &prefix_node(prefix))?, stat.version))),
        Err(Error::NoNode { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Refuses a move that would take `e`'s prefix past the last epoch a fencing token can
/// carry, before anything changes: the new cell would refuse the import only after the
/// old one froze the prefix, leaving it frozen.
fn may_move_again(e: &PrefixEntry) -> anyhow::Result<()> {
    if e.epoch >= wire::directory::EPOCH_MAX {
        anyhow::bail!(
            "{} is at epoch {}, the last a fencing token can carry: it cannot move again \
             (docs/directory.md, \"Fencing tokens across a move\")",
            e.prefix,
            e.epoch
        );
    }
    Ok(())
}

/// A client of `cell`, whose servers must be that cell's (their certificates name it).
async fn connect(template: &ClientConfig, cell: &CellInfo) -> anyhow::Result<Client> {
    let mut cfg = template.clone();
    cfg.endpoints = cell.endpoints.clone();
    cfg.directory = false;
    cfg.cell = Some(cell.name.clone());
    Ok(Client::connect(cfg).await?)
}

/// A prefix's state in a cell, if recorded there.
async fn state_in(c: &Client, prefix: &str) -> anyhow::Result<Option<(u64, PrefixState)>> {
    Ok(c.prefixes()
        .await?
        .into_iter()
        .find(|r| r.prefix == prefix)
        .map(|r| (r.epoch, r.state)))
}

/// Why `cell`, recording `recorded`, still serves `prefix` (`None`: it does not). A cell
/// that records no prefix at all serves every path (a cell before any placement).
fn still_served(cell: &str, prefix: &str, recorded: &[PrefixRecord]) -> Option<String> {
    match recorded.iter().find(|r| r.prefix == prefix) {
        Some(r) if r.state != PrefixState::Gone => Some(format!(
            "{cell} still records {prefix} as {} (epoch {})",
            r.state, r.epoch
        )),
        Some(_) => None,
        None if recorded.is_empty() => Some(format!(
            "{cell} records no prefix, so it serves every path, {prefix} included"
        )),
        None => None,
    }
}

/// Where a running move holds its lease: an ephemeral node of the mover's session.
const ROOT_MOVES: &str = "/directory/moves";

/// One `dir set`, `dir rm` or `dir move` per prefix at a time: an ephemeral node under
/// [`ROOT_MOVES`], gone with the command's session (at once when it ends, within the root
/// cell's lease when it crashed). A command that finds one waits for it to go (a crashed
/// mover's session expiring) for up to a minute.
async fn take_prefix_lease(s: &Session, prefix: &str) -> anyhow::Result<()> {
    match s
        .create(ROOT_MOVES, Vec::new(), CreateMode::default())
        .await
    {
        Ok(_) | Err(Error::NodeExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let node = format!("{ROOT_MOVES}/{}", prefix.trim_start_matches('/'));
    let ephemeral = CreateMode {
        ephemeral: true,
        sequential: false,
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut said = false;
    loop {
        match s.create(&node, Vec::new(), ephemeral).await {
            Ok(_) => return Ok(()),
            Err(Error::NodeExists { .. }) if tokio::time::Instant::now() < deadline => {
                if !said {
                    crate::say!(
                        "lockctl: another `lockctl dir` command on {prefix} (a move, a \
                         placement or a removal) holds {node}; waiting for it to end (a \
                         crashed one's session expires within the root cell's lease)"
                    );
                    said = true;
                }
                let (stat, w) = s.exists_watch(&node).await?;
                if stat.is_some() {
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), w).await;
                }
            }
            Err(Error::NodeExists { .. }) => {
                anyhow::bail!(
                    "another `lockctl dir` command on {prefix} still holds {node} after a minute"
                )
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The test hook that stops a move after a step, as a crash there would
/// (`LOCKCTL_MOVE_STOP_AFTER=<step>`; the steps are numbered in [`move_prefix`]): the
/// process exits with status 9 at once.
fn stop_after(step: u32) {
    if std::env::var("LOCKCTL_MOVE_STOP_AFTER")
        .ok()
        .and_then(|v| v.parse().ok())
        == Some(step)
    {
        crate::say!("lockctl: stopping the move after step {step} (LOCKCTL_MOVE_STOP_AFTER)");
        std::process::exit(9);
    }
}

/// `dir move`: each step is skipped when the cells show it done, so a re-run after a
/// crash goes on from there (`docs/directory.md`, "A move"). Steps: 0 the intent in the
/// map, 1 frozen, 2 importing, 3 the first page copied, 4 the copy done, 5 the old cell
/// gone, 6 the new cell owns, 7 the old copy dropped, then the map names the new cell.
async fn move_prefix(
    s: &Session,
    template: &ClientConfig,
    prefix: &str,
    to: &str,
    stop: &(dyn Fn(u32) -> bool + Sync),
) -> anyhow::Result<bool> {
    check_prefix(prefix)?;
    let to_info = cell_info(s, to).await?;
    take_prefix_lease(s, prefix).await?;
    let Some((mut e, version)) = entry(s, prefix).await? else {
        anyhow::bail!("{prefix} is not in the map: place it with `lockctl dir set {prefix} CELL`");
    };
    if e.cell == to && e.moving_to.is_none() {
        println!("{prefix} is in {to} already (epoch {})", e.epoch);
        return Ok(true);
    }
    may_move_again(&e)?;
    match &e.moving_to {
        Some(t) if t != to => anyhow::bail!(
            "a move of {prefix} to {t} is under way: finish it with `lockctl dir move {prefix} --to {t}`"
        ),
        Some(_) => println!("{prefix}: going on with the move to {to}"),
        None => {
            // The intent first, so that a crash leaves a map that says what to finish.
            e.moving_to = Some(to.to_string());
            put(s, &prefix_node(prefix), encode(&e), Some(version)).await?;
        }
    }
    if stop(0) {
        return Ok(false);
    }
    let from = connect(template, &cell_info(s, &e.cell).await?).await?;
    let into = connect(template, &to_info).await?;
    let (old, new) = (e.epoch, e.epoch + 1);
    let started = tokio::time::Instant::now();
    let mut frozen_at = None;

    // 1. Freeze in the old cell (unless it has let go already).
    let handed_over =
        matches!(state_in(&from, prefix).await?, Some((ep, PrefixState::Gone)) if ep == new);
    if !handed_over {
        from.set_prefix(prefix, old, PrefixState::Frozen).await?;
        frozen_at = Some(tokio::time::Instant::now());
        if stop(1) {
            return Ok(false);
        }
        // 2. Copy into the new cell (unless it serves the prefix already).
        let owned =
            matches!(state_in(&into, prefix).await?, Some((ep, PrefixState::Owned)) if ep == new);
        if !owned {
            into.set_prefix(prefix, new, PrefixState::Importing).await?;
            if stop(2) {
                return Ok(false);
            }
            let (mut after, mut first, mut nodes) = (None, true, 0usize);
            loop {
                let (page, more) = from.export_prefix(prefix, after.clone()).await?;
                after = page.last().map(|n| n.path.clone());
                nodes += page.len();
                into.import_prefix(prefix, new, first, page).await?;
                if first && stop(3) {
                    return Ok(false);
                }
                first = false;
                if !more {
                    break;
                }
            }
            println!("{prefix}: {nodes} nodes copied");
            if stop(4) {
                return Ok(false);
            }
        }
        // 3. The old cell lets go: its locks there end before the new cell serves.
        from.set_prefix(prefix, new, PrefixState::Gone).await?;
        if stop(5) {
            return Ok(false);
        }
    }
    // 4. The new cell serves.
    into.set_prefix(prefix, new, PrefixState::Owned).await?;
    if stop(6) {
        return Ok(false);
    }
    // 5. The old copy goes.
    from.drop_prefix(prefix, new).await?;
    if stop(7) {
        return Ok(false);
    }
    // 6. The map names the new cell.
    let (now, version) = entry(s, prefix)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{prefix}'s entry vanished from the map during the move"))?;
    if now.moving_to.as_deref() != Some(to) {
        anyhow::bail!(
            "{prefix}'s entry changed during the move (now {now:?}); the map was not flipped"
        );
    }
    let done = PrefixEntry {
        prefix: prefix.to_string(),
        cell: to.to_string(),
        epoch: new,
        moving_to: None,
    };
    put(s, &prefix_node(prefix), encode(&done), Some(version)).await?;
    match frozen_at {
        Some(f) => println!(
            "{prefix} moved to {to} (epoch {new}): frozen {} ms, move {} ms",
            f.elapsed().as_millis(),
            started.elapsed().as_millis()
        ),
        None => println!("{prefix} moved to {to} (epoch {new})"),
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dir rm` keeps an entry whose cell still serves the prefix: recorded and not gone, or
    /// nothing recorded at all (a cell before any placement serves every path; it was
    /// taken for one that does not serve the prefix, so `dir set` could place it in a
    /// second cell).
    #[test]
    fn an_entry_stays_while_its_cell_serves_the_prefix() {
        let rec = |prefix: &str, state| PrefixRecord {
            prefix: prefix.into(),
            epoch: 1,
            state,
        };
        let why = still_served("cell-a", "/pay", &[]).unwrap();
        assert!(why.contains("serves every path"), "{why}");
        let why = still_served("cell-a", "/pay", &[rec("/pay", PrefixState::Owned)]).unwrap();
        assert!(why.contains("still records /pay as"), "{why}");
        assert!(still_served("cell-a", "/pay", &[rec("/pay", PrefixState::Frozen)]).is_some());
        assert!(still_served("cell-a", "/pay", &[rec("/pay", PrefixState::Importing)]).is_some());
        assert_eq!(
            still_served("cell-a", "/pay", &[rec("/pay", PrefixState::Gone)]),
            None
        );
        assert_eq!(
            still_served("cell-a", "/pay", &[rec("/idx", PrefixState::Owned)]),
            None
        );
    }

    /// A prefix at the last epoch a token can carry is refused before the move starts;
    /// one below it may move.
    #[test]
    fn a_move_past_the_last_epoch_is_refused_before_anything_changes() {
        let at = |epoch| PrefixEntry {
            prefix: "/pay".into(),
            cell: "cell-a".into(),
            epoch,
            moving_to: None,
        };
        assert!(may_move_again(&at(0)).is_ok());
        assert!(may_move_again(&at(wire::directory::EPOCH_MAX - 1)).is_ok());
        let e = may_move_again(&at(wire::directory::EPOCH_MAX)).unwrap_err();
        assert!(e.to_string().contains("cannot move again"), "{e}");
    }
}
