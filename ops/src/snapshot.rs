//! `lockctl snapshot save | ls | restore`: backups in object storage (the replicas'
//! `[backup]`, `replica::backup`). `save` asks the cell's leader to write one now; `ls`
//! and `restore` read the store directly, without the cell (a restore is what you do when
//! the cell is gone).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use replica::backup::{self, BackupObject, Store};

/// What `lockctl snapshot` does besides asking every replica for a local snapshot.
#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Make the leader write a backup to the cell's store now (the replicas'
    /// `[backup] url`); prints the object, the index it covers and the state's digest.
    #[command(after_help = "Examples:\n  lockctl snapshot save\n  lockctl snapshot save --json")]
    Save,
    /// List the backups in a store, oldest first (by the time taken): object, cell,
    /// index, time, size.
    #[command(after_help = "Examples:\n  \
        lockctl snapshot ls --store s3://backups/lockservice --cell prod-1\n  \
        lockctl snapshot ls --store s3://b/p --store-option endpoint=http://127.0.0.1:9000 \
        --store-option allow_http=true --json\n  \
        lockctl snapshot ls --store azure://backups/lockservice --store-option account_name=acct")]
    Ls {
        #[command(flatten)]
        store: StoreArgs,
        /// Only this cell's backups.
        #[arg(long)]
        cell: Option<String>,
    },
    /// Seed the empty data directory of a new cell's replica from a backup (a disaster
    /// recovery): the object is read, verified (format, length, checksum, the state
    /// itself) and written as the replica's snapshot, with --members as the new cell's
    /// voters. Run it for every member's data directory, with the same backup, members
    /// and --bump-index (each gets the same state), then start them all with `bootstrap =
    /// false`. With --check, only read and verify.
    #[command(after_help = "Examples:\n  \
        lockctl snapshot restore --store s3://backups/lockservice --cell prod-1 --check\n  \
        lockctl snapshot restore --store s3://backups/lockservice --cell prod-1 \\\n    \
        --data-dir /var/lib/lockservice --id 1 \\\n    \
        --members 1=r1.prod:7001,2=r2.prod:7001,3=r3.prod:7001,4=r4.prod:7001,5=r5.prod:7001 \\\n    \
        --bump-index 360000000")]
    Restore {
        #[command(flatten)]
        store: StoreArgs,
        /// The backup to restore (a name `snapshot ls` prints). Default: the newest of
        /// --cell.
        #[arg(long)]
        object: Option<String>,
        /// The cell whose newest backup to restore (needed without --object when the
        /// store holds several cells').
        #[arg(long)]
        cell: Option<String>,
        /// The replica's data directory (its `data_dir`): must hold no log and no
        /// snapshot yet.
        #[arg(long, required_unless_present = "check")]
        data_dir: Option<PathBuf>,
        /// The id of the replica whose data directory this is (one of --members).
        #[arg(long, required_unless_present = "check")]
        id: Option<u64>,
        /// The new cell's voters, ID=HOST:PORT, comma-separated (as the replicas'
        /// `members`).
        #[arg(long, value_delimiter = ',', value_parser = member, required_unless_present = "check")]
        members: Vec<(u64, String)>,
        /// Start the new cell's log this many entries past the backup's index, so that
        /// every fencing token it grants (index × 1024 + position) is above every token
        /// the old cell granted, including after the backup was taken: at least the
        /// entries the old cell could have committed since (its entries per second ×
        /// seconds between the backup and the old cell's end). Required when seeding
        /// (left out, the restore refuses and suggests a value from the backup's age);
        /// the same on every member. 0 lets the new cell repeat tokens the old one granted
        /// after the backup: use it only if the old cell wrote nothing since.
        #[arg(long)]
        bump_index: Option<u64>,
        /// Only read and verify the backup, and print what it holds.
        #[arg(long)]
        check: bool,
    },
}

/// Where backups are.
#[derive(clap::Args, Debug)]
pub struct StoreArgs {
    /// The store: s3://bucket/prefix (credentials from the AWS_* environment or
    /// --store-option), azure://container/prefix (AZURE_* environment or --store-option)
    /// or file:///path.
    #[arg(long, env = "LOCKCTL_BACKUP_STORE")]
    store: String,
    /// An option of the store, KEY=VALUE, as the replicas' `[backup] options` (e.g.
    /// endpoint=http://127.0.0.1:9000, allow_http=true, region=eu-west-1). Repeatable.
    #[arg(long = "store-option", value_name = "KEY=VALUE", value_parser = crate::dev::key_value)]
    options: Vec<(String, String)>,
}

impl StoreArgs {
    fn open(&self) -> anyhow::Result<Store> {
        let options: BTreeMap<String, String> = self.options.iter().cloned().collect();
        Store::open(&self.store, &options).map_err(anyhow::Error::msg)
    }
}

fn member(s: &str) -> Result<(u64, String), String> {
    let (id, addr) = crate::dev::key_value(s)?;
    let id: u64 = id
        .parse()
        .map_err(|_| format!("{s:?}: expected ID=HOST:PORT with a numeric id"))?;
    Ok((id, addr))
}

/// `lockctl snapshot ls` and `restore` (the ones that need no cell).
pub async fn run_offline(cmd: SnapshotCommand, json: bool) -> anyhow::Result<()> {
    match cmd {
        SnapshotCommand::Save => unreachable!("save asks the cell"),
        SnapshotCommand::Ls { store, cell } => {
            let s = store.open()?;
            let listed = s.list(cell.as_deref()).await.map_err(anyhow::Error::msg)?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "store": s.url(), "backups": listed })
                );
                return Ok(());
            }
            if listed.is_empty() {
                println!("no backups in {}", s.url());
            }
            for b in &listed {
                println!(
                    "{}\tcell {}\tindex {}\ttaken {}\t{} bytes",
                    b.name,
                    b.cell,
                    b.index,
                    humantime::format_rfc3339_millis(
                        std::time::UNIX_EPOCH + std::time::Duration::from_millis(b.unix_ms)
                    ),
                    b.bytes
                );
            }
            Ok(())
        }
        SnapshotCommand::Restore {
            store,
            object,
            cell,
            data_dir,
            id,
            members,
            bump_index,
            check,
        } => {
            let s = store.open()?;
            let chosen = choose(&s, object, cell).await?;
            let bytes = s
                .get(&chosen.name, backup::BACKUP_BYTES_MAX)
                .await
                .map_err(anyhow::Error::msg)?;
            let what = format!("{} in {}", chosen.name, s.url());
            let verified = backup::verify(&bytes, &what)
                .map_err(|e| anyhow::anyhow!("refused: {e}; nothing was written"))?;
            anyhow::ensure!(
                verified.index() == chosen.index,
                "refused: {what} is named for index {} but holds index {}; nothing was written",
                chosen.index,
                verified.index()
            );
            let digest = verified.state.sm.digest();
            let (nodes, sessions) = (
                verified.state.sm.node_count(),
                verified.state.sm.session_count(),
            );
            let written = match (check, data_dir, id) {
                (true, _, _) => None,
                (false, Some(dir), Some(id)) => {
                    let bump = bump_index.ok_or_else(|| {
                        anyhow::anyhow!(
                            "refused: --bump-index is needed to seed a new cell; nothing was \
                             written. {}",
                            bump_advice(chosen.unix_ms, backup::unix_ms_now())
                        )
                    })?;
                    if bump == 0 {
                        eprintln!(
                            "lockctl: warning: --bump-index 0: the new cell's fencing tokens \
                             go on from the backup's index, so it may grant tokens equal to or \
                             lower than ones the old cell granted after the backup, which a \
                             protected resource would then accept from the old holders"
                        );
                    }
                    let mut by_id = BTreeMap::new();
                    for (id, addr) in members {
                        anyhow::ensure!(
                            by_id.insert(id, addr).is_none(),
                            "--members names {id} twice"
                        );
                    }
                    Some(
                        backup::seed(&dir, id, verified, &by_id, bump)
                            .map_err(anyhow::Error::msg)
                            .with_context(|| format!("seeding {}", dir.display()))?,
                    )
                }
                _ => anyhow::bail!("--data-dir and --id are needed (or --check)"),
            };
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "object": chosen.name,
                        "index": chosen.index,
                        "log_index": written.as_ref().map(|_| chosen.index + bump_index.unwrap_or(0)),
                        "digest": format!("{digest:016x}"),
                        "nodes": nodes,
                        "sessions": sessions,
                        "written": written,
                    })
                );
                return Ok(());
            }
            println!(
                "{}: index {}, digest {digest:016x}, {nodes} nodes, {sessions} sessions \
                 (verified)",
                chosen.name, chosen.index
            );
            if let Some(path) = written {
                println!(
                    "wrote {} (the new cell's log starts at index {}): seed every member \
                     alike, then start them all with bootstrap = false; sessions in the \
                     backup expire a lease after the new leader takes over unless their \
                     clients renew them",
                    path.display(),
                    chosen.index + bump_index.unwrap_or(0)
                );
            }
            Ok(())
        }
    }
}

/// Entries a second assumed by [`bump_advice`]: about ten times what a cell commits on
/// a fast disk (log entries, not writes: one entry carries many writes under load).
const ADVICE_ENTRIES_PER_SEC: u64 = 100_000;

/// What `--bump-index` to choose for a backup taken at `taken_ms` when it is `now_ms`:
/// the entries an old cell could have committed since, at [`ADVICE_ENTRIES_PER_SEC`],
/// with an hour's margin for clocks, rounded up to whole hours so that hosts asking
/// within the same hour are told the same value. Valid only if the old cell stopped by
/// now.
fn bump_advice(taken_ms: u64, now_ms: u64) -> String {
    let age_secs = now_ms.saturating_sub(taken_ms) / 1_000;
    let hours = (age_secs + 3_600).div_ceil(3_600);
    let suggested = hours * 3_600 * ADVICE_ENTRIES_PER_SEC;
    format!(
        "Choose it above the log entries the old cell could have committed since the backup \
         (taken {age_secs} s ago), so that every fencing token the new cell grants is above \
         every token the old one granted; the same value on every member. If the old cell is \
         stopped, at up to {ADVICE_ENTRIES_PER_SEC} entries a second plus an hour's margin: \
         --bump-index {suggested}"
    )
}

/// The object named, or the newest of the cell named, or the newest of the only cell.
async fn choose(
    s: &Store,
    object: Option<String>,
    cell: Option<String>,
) -> anyhow::Result<BackupObject> {
    if let Some(name) = object {
        let listed = s.list(None).await.map_err(anyhow::Error::msg)?;
        return listed
            .into_iter()
            .find(|b| b.name == name)
            .ok_or_else(|| anyhow::anyhow!("no backup {name:?} in {} (see snapshot ls)", s.url()));
    }
    let listed = s.list(cell.as_deref()).await.map_err(anyhow::Error::msg)?;
    let cells: std::collections::BTreeSet<&str> = listed.iter().map(|b| b.cell.as_str()).collect();
    anyhow::ensure!(
        cells.len() <= 1,
        "{} holds backups of several cells ({}): name one with --cell or --object",
        s.url(),
        cells.into_iter().collect::<Vec<_>>().join(", ")
    );
    // The newest taken, leaving out names more than an hour in the future (a clock that
    // ran ahead) while there is another.
    let sane = backup::newest_taken(&listed, backup::unix_ms_now() + 3_600_000);
    sane.or(listed.last()).cloned().ok_or_else(|| {
        anyhow::anyhow!(
            "no backups{} in {}",
            cell.map(|c| format!(" of cell {c}")).unwrap_or_default(),
            s.url()
        )
    })
}

#[cfg(test)]
mod tests {
    /// The suggested bump covers the backup's age and an hour at the assumed rate.
    #[test]
    fn the_suggested_bump_covers_the_backups_age_and_an_hour() {
        let advice = super::bump_advice(1_000_000, 1_000_000 + 7_200_500);
        assert!(advice.contains("taken 7200 s ago"), "{advice}");
        assert!(advice.ends_with("--bump-index 1080000000"), "{advice}");
        // Rounded up to whole hours: the same value for hosts asking within an hour.
        let advice = super::bump_advice(0, 100_000);
        assert!(advice.ends_with("--bump-index 720000000"), "{advice}");
        let advice = super::bump_advice(0, 3_500_000);
        assert!(advice.ends_with("--bump-index 720000000"), "{advice}");
        // A backup named in the future (a clock ahead) counts as just taken.
        let advice = super::bump_advice(5_000, 1_000);
        assert!(advice.ends_with("--bump-index 360000000"), "{advice}");
    }
}
