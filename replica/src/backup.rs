//! Backups to object storage (issue 28; the seed's flow 5.5, "an hourly copy of the
//! snapshot in object storage in another region").
//!
//! A backup is one object: a snapshot file's bytes (`raft::snapshot_file`: magic,
//! CRC-32, length, then the state), so a copy that was cut short or changed on the way is
//! refused when read back, with the reason. Objects are named
//! `<prefix>/<cell>/snapshot-<index:020>-<unix ms:013>.lksnap`: sorted by name they are
//! sorted by the log index they cover. The leader writes them ([`crate::actors::backuper`]),
//! on a schedule and on demand (`lockctl snapshot save`), and keeps the newest
//! `keep`; `lockctl snapshot ls` lists them and `lockctl snapshot restore` seeds a new
//! replica's data directory from one ([`seed`]).
//!
//! The store is [`object_store`] (Apache Arrow's): `s3://bucket/prefix` (AWS S3 or any
//! S3-compatible server, Google Cloud Storage's included through its XML API and HMAC
//! keys; credentials from the usual `AWS_*` environment or the options),
//! `azure://container/prefix` (Azure Blob Storage; credentials from the `AZURE_*`
//! environment or the options) and `file:///path` (a local or mounted directory).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreScheme, PutPayload};
use openraft::Membership;
use serde::{Deserialize, Serialize};
use wire::raft::{LogId, SnapshotMeta, StoredMembership};

use crate::raft::sm_store::{decode_state, SmState};
use crate::raft::snapshot_file;

pub use crate::raft::snapshot_file::SEEDED_ID_PREFIX;

/// What a backup object's name ends with.
pub const OBJECT_SUFFIX: &str = ".lksnap";

/// The largest backup [`Store::get`] reads for a restore: the largest snapshot a replica
/// takes from a peer (a cell whose state is larger cannot install it on a follower).
pub const BACKUP_BYTES_MAX: u64 = crate::raft::network::SNAPSHOT_BYTES_MAX;

/// The replica's `[backup]` section: off unless `url` is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackupConfig {
    /// Where backups go: `s3://bucket/prefix`, `azure://container/prefix` or
    /// `file:///path`. Unset: no backups.
    pub url: Option<String>,
    /// Options of the store, by object_store's names (for S3: `endpoint`, `region`,
    /// `allow_http`, `access_key_id`, `secret_access_key`, `virtual_hosted_style_request`,
    /// ...; for Azure: `account_name`, `access_key`, `sas_key`, `client_id`,
    /// `client_secret`, `tenant_id`, `use_azure_cli`, `endpoint`, `allow_http`, ...).
    /// Credentials are better left to the `AWS_*` or `AZURE_*` environment variables or
    /// the instance's role or managed identity than written here. A name the store does
    /// not know is refused.
    pub options: BTreeMap<String, String>,
    /// How often the leader writes one (seconds): when the newest backup of this cell in
    /// the store is this old, the leader writes another. Checked every minute (or every
    /// interval, if shorter), so a leader change or a restart neither skips nor doubles
    /// one.
    pub interval_secs: u64,
    /// How many of this cell's backups to keep in the store (the newest; older ones are
    /// deleted after each backup).
    pub keep: usize,
}

impl Default for BackupConfig {
    fn default() -> Self {
        BackupConfig {
            url: None,
            options: BTreeMap::new(),
            interval_secs: 3_600,
            keep: 48,
        }
    }
}

impl BackupConfig {
    /// Checks the values, and that the store's URL and options are ones it can use (no
    /// request is made).
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.interval_secs >= 1, "backup.interval_secs must be >= 1");
        anyhow::ensure!(self.keep >= 1, "backup.keep must be >= 1");
        match &self.url {
            Some(url) => {
                Store::open(url, &self.options).map_err(anyhow::Error::msg)?;
            }
            None => anyhow::ensure!(
                self.options.is_empty(),
                "backup.options is set but backup.url is not"
            ),
        }
        Ok(())
    }
}

/// One backup in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupObject {
    /// Its name under the store's prefix: `<cell>/snapshot-<index>-<unix ms>.lksnap`.
    pub name: String,
    /// The cell it is of.
    pub cell: String,
    /// The log index it covers.
    pub index: u64,
    /// When it was taken (Unix milliseconds, from its name).
    pub unix_ms: u64,
    /// Its size.
    pub bytes: u64,
}

impl BackupObject {
    /// The name of the backup of `cell` at `index` taken at `unix_ms`.
    pub fn name_of(cell: &str, index: u64, unix_ms: u64) -> String {
        format!("{cell}/snapshot-{index:020}-{unix_ms:013}{OBJECT_SUFFIX}")
    }

    /// Reads a name back (`None`: not a backup's name).
    pub fn parse(name: &str, bytes: u64) -> Option<BackupObject> {
        let (cell, file) = name.split_once('/')?;
        let stem = file
            .strip_prefix("snapshot-")?
            .strip_suffix(OBJECT_SUFFIX)?;
        let (index, unix_ms) = stem.split_once('-')?;
        if cell.is_empty() || index.len() != 20 || unix_ms.len() != 13 {
            return None;
        }
        Some(BackupObject {
            name: name.to_string(),
            cell: cell.to_string(),
            index: index.parse().ok()?,
            unix_ms: unix_ms.parse().ok()?,
            bytes,
        })
    }
}

/// The newest of `listed` (as [`Store::list`] orders them) taken at or before `not_after`
/// (Unix ms): names further ahead are a clock that ran ahead, not the newest backup.
pub fn newest_taken(listed: &[BackupObject], not_after: u64) -> Option<&BackupObject> {
    listed.iter().rev().find(|b| b.unix_ms <= not_after)
}

/// Now, in Unix milliseconds (0 before 1970).
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A store of backups: an object store and the prefix they live under.
#[derive(Clone)]
pub struct Store {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    url: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.url)
    }
}

/// How long one request to the store may take, and how long its retries may go on: a
/// store that does not answer fails a backup (counted, logged, tried again at the next
/// check) instead of holding it for object_store's default of three minutes; long enough
/// for the largest single PUT ([`MULTIPART_ABOVE`], 32 MiB) at 3 Mbit/s, to another
/// region.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);

/// Backups larger than this are uploaded in parts (S3 takes at most 5 GB in one PUT, and
/// a part that fails is retried alone).
pub const MULTIPART_ABOVE: usize = 2 * PART_BYTES;

/// The size of one part of a multipart upload.
pub const PART_BYTES: usize = 16 << 20;

/// The store URLs [`Store::open`] takes, for its errors.
const URL_FORMS: &str = "s3://bucket/prefix, azure://container/prefix or file:///path";

/// Each request's own limit, [`REQUEST_TIMEOUT`].
fn client_options() -> object_store::ClientOptions {
    object_store::ClientOptions::new().with_timeout(REQUEST_TIMEOUT)
}

/// Retries of one request: a few, within [`REQUEST_TIMEOUT`].
fn retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        max_retries: 3,
        retry_timeout: REQUEST_TIMEOUT,
        ..Default::default()
    }
}

impl Store {
    /// The store at `url` with `options` (see [`BackupConfig`]). Makes no request.
    pub fn open(url: &str, options: &BTreeMap<String, String>) -> Result<Store, String> {
        let parsed = url::Url::parse(url)
            .map_err(|e| format!("backup store {url:?}: {e} (expected {URL_FORMS})"))?;
        let (scheme, prefix) = ObjectStoreScheme::parse(&parsed)
            .map_err(|e| format!("backup store {url:?}: {e} (expected {URL_FORMS})"))?;
        let store: Arc<dyn ObjectStore> = match scheme {
            ObjectStoreScheme::Local => {
                if let Some(k) = options.keys().next() {
                    return Err(format!(
                        "backup store {url:?}: option {k:?} given, but a file:// store takes none"
                    ));
                }
                Arc::new(object_store::local::LocalFileSystem::new())
            }
            ObjectStoreScheme::AmazonS3 => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(url)
                    .with_retry(retry())
                    .with_client_options(client_options());
                for (k, v) in options {
                    let key: object_store::aws::AmazonS3ConfigKey = k.parse().map_err(|_| {
                        format!(
                            "backup store {url:?}: option {k:?} is not one object_store's S3 \
                             client takes (endpoint, region, allow_http, access_key_id, \
                             secret_access_key, token, virtual_hosted_style_request, ...)"
                        )
                    })?;
                    b = b.with_config(key, v.clone());
                }
                Arc::new(
                    b.build()
                        .map_err(|e| format!("backup store {url:?}: {e}"))?,
                )
            }
            ObjectStoreScheme::MicrosoftAzure => {
                // object_store 0.12 takes `az://container/a/b`'s container from the host
                // but drops the first path segment from its prefix (a/b becomes b).
                if parsed.scheme() == "az" {
                    return Err(format!(
                        "backup store {url:?}: write azure://container/prefix (an az:// URL \
                         loses its prefix's first segment in object_store 0.12)"
                    ));
                }
                // `from_env`: credentials from the `AZURE_*` environment (a Secret's),
                // as the S3 store takes `AWS_*`.
                let mut b = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(url)
                    .with_retry(retry())
                    .with_client_options(client_options());
                for (k, v) in options {
                    let key: object_store::azure::AzureConfigKey = k.parse().map_err(|_| {
                        format!(
                            "backup store {url:?}: option {k:?} is not one object_store's \
                             Azure client takes (account_name, access_key, sas_key, \
                             client_id, client_secret, tenant_id, endpoint, allow_http, ...)"
                        )
                    })?;
                    b = b.with_config(key, v.clone());
                }
                Arc::new(
                    b.build()
                        .map_err(|e| format!("backup store {url:?}: {e}"))?,
                )
            }
            other => {
                return Err(format!(
                    "backup store {url:?}: {other:?} is not built into this binary (s3://, \
                     azure:// and file:// are; Google Cloud Storage through s3:// with its \
                     XML API's endpoint and HMAC keys)"
                ))
            }
        };
        Ok(Store {
            store,
            prefix,
            url: url.to_string(),
        })
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, name: &str) -> Result<ObjectPath, String> {
        let p = ObjectPath::parse(name).map_err(|e| format!("object name {name:?}: {e}"))?;
        Ok(self.prefix.parts().chain(p.parts()).collect())
    }

    /// The backups in the store, of `cell` or of every cell, oldest first: by cell, then
    /// the time they were taken, then index. By time, not index: a cell restored from an
    /// older backup under the same name writes lower indices than the old cell's last
    /// ones, and its backups are still the newest. Objects whose names are not a backup's
    /// are left out.
    pub async fn list(&self, cell: Option<&str>) -> Result<Vec<BackupObject>, String> {
        let under = match cell {
            Some(c) => self.path(c)?,
            None => self.prefix.clone(),
        };
        let metas: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&under))
            .try_collect()
            .await
            .map_err(|e| format!("listing {}: {e}", self.url))?;
        let skip = self.prefix.parts().count();
        let mut found: Vec<BackupObject> = metas
            .iter()
            .filter_map(|m| {
                let rel: Vec<String> = m
                    .location
                    .parts()
                    .skip(skip)
                    .map(|p| p.as_ref().to_string())
                    .collect();
                BackupObject::parse(&rel.join("/"), m.size)
            })
            .filter(|b| cell.is_none_or(|c| b.cell == c))
            .collect();
        found.sort_by(|a, b| (&a.cell, a.unix_ms, a.index).cmp(&(&b.cell, b.unix_ms, b.index)));
        Ok(found)
    }

    /// Writes a backup: one PUT, or above [`MULTIPART_ABOVE`] a multipart upload in
    /// [`PART_BYTES`] parts (Azure: blocks, then the block list); either way the object
    /// appears whole, when complete, or not at all (a multipart upload that fails is
    /// aborted, its parts deleted on S3; Azure keeps uncommitted blocks, invisible, until
    /// it discards them after a week).
    pub async fn put(
        &self,
        cell: &str,
        index: u64,
        unix_ms: u64,
        bytes: Vec<u8>,
    ) -> Result<BackupObject, String> {
        self.put_in_parts(cell, index, unix_ms, bytes, MULTIPART_ABOVE, PART_BYTES)
            .await
    }

    /// [`Store::put`] with other thresholds: uploads in parts of `part_bytes` when
    /// `bytes` is larger than `multipart_above` (S3 wants parts of at least 5 MiB but
    /// the last).
    pub async fn put_in_parts(
        &self,
        cell: &str,
        index: u64,
        unix_ms: u64,
        bytes: Vec<u8>,
        multipart_above: usize,
        part_bytes: usize,
    ) -> Result<BackupObject, String> {
        let name = BackupObject::name_of(cell, index, unix_ms);
        let len = bytes.len() as u64;
        let path = self.path(&name)?;
        let failed = |e: object_store::Error| format!("writing {name} to {}: {e}", self.url);
        if bytes.len() <= multipart_above {
            self.store
                .put(&path, PutPayload::from(bytes))
                .await
                .map_err(failed)?;
        } else {
            let upload = self.store.put_multipart(&path).await.map_err(failed)?;
            let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, part_bytes);
            let mut sent = Ok(());
            for chunk in bytes.chunks(part_bytes) {
                // At most a few parts in flight at once.
                sent = w.wait_for_capacity(4).await;
                if sent.is_err() {
                    break;
                }
                w.write(chunk);
            }
            if let Err(e) = sent {
                // The parts sent so far would stay stored (and billed) in the bucket.
                let _ = w.abort().await;
                return Err(failed(e));
            }
            // `finish` aborts the upload itself when completing it fails.
            w.finish().await.map_err(failed)?;
        }
        Ok(BackupObject {
            name,
            cell: cell.to_string(),
            index,
            unix_ms,
            bytes: len,
        })
    }

    /// Reads a backup's bytes (not verified: see [`verify`]), refusing an object over
    /// `max` bytes by the size the store gives before any of it is read (restore passes
    /// [`BACKUP_BYTES_MAX`]: a misnamed huge object is refused, not loaded into memory).
    pub async fn get(&self, name: &str, max: u64) -> Result<Vec<u8>, String> {
        let r = self
            .store
            .get(&self.path(name)?)
            .await
            .map_err(|e| format!("reading {name} from {}: {e}", self.url))?;
        if r.meta.size > max {
            return Err(format!(
                "{name} in {} is {} bytes, more than a backup can be ({max} bytes): not a \
                 backup of this service",
                self.url, r.meta.size
            ));
        }
        let bytes = r
            .bytes()
            .await
            .map_err(|e| format!("reading {name} from {}: {e}", self.url))?;
        Ok(bytes.to_vec())
    }

    /// Deletes all but the newest `keep` backups of `cell` (by the time they were taken),
    /// never `spare` (the one just written, whatever its time says); returns the names
    /// deleted. Backups named after `future_after` (Unix ms; a clock that ran ahead) are
    /// neither counted among the newest nor deleted: left for an operator to look at.
    pub async fn prune(
        &self,
        cell: &str,
        keep: usize,
        spare: Option<&str>,
        future_after: u64,
    ) -> Result<Vec<String>, String> {
        let all: Vec<BackupObject> = self
            .list(Some(cell))
            .await?
            .into_iter()
            .filter(|b| b.unix_ms <= future_after)
            .collect();
        let mut deleted = Vec::new();
        for old in all
            .iter()
            .take(all.len().saturating_sub(keep.max(1)))
            .filter(|o| Some(o.name.as_str()) != spare)
        {
            match self.store.delete(&self.path(&old.name)?).await {
                // S3 answers a delete of a missing object with success, Azure with
                // NotFound: gone either way (another leader pruned it first).
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(format!("deleting {} from {}: {e}", old.name, self.url)),
            }
            deleted.push(old.name.clone());
        }
        Ok(deleted)
    }
}

/// A backup written to bytes, with what it holds.
#[derive(Debug)]
pub struct Encoded {
    /// The object's bytes (a snapshot file's).
    pub bytes: Vec<u8>,
    /// The log index the state reflects.
    pub index: u64,
    /// The state's digest (`StateMachine::digest`, what `Op::StateDigest` answers).
    pub digest: u64,
}

/// Writes `state` (a copy: the state's maps are persistent, so copying is cheap) as a
/// backup's bytes. Takes a core for a while on a large state: run it off the replica's
/// runtime.
pub fn encode(state: &SmState) -> Result<Encoded, String> {
    let index = state.last_applied.map_or(0, |l| l.index);
    let data = postcard::to_allocvec(state).map_err(|e| e.to_string())?;
    let meta = SnapshotMeta {
        last_log_id: state.last_applied,
        last_membership: state.membership.clone(),
    };
    let bytes = snapshot_file::to_bytes(&meta, &format!("backup-{index}"), &data)
        .map_err(|e| e.to_string())?;
    Ok(Encoded {
        bytes,
        index,
        digest: state.sm.digest(),
    })
}

/// A backup read back and verified.
#[derive(Debug)]
pub struct Verified {
    /// Its metadata (the source cell's last log id and membership).
    pub meta: SnapshotMeta,
    /// The state.
    pub state: SmState,
}

impl Verified {
    /// The log index it covers.
    pub fn index(&self) -> u64 {
        self.meta.last_log_id.map_or(0, |l| l.index)
    }
}

/// Reads a backup's bytes back: refused, naming `what` and the reason, when it is not a
/// snapshot file, is cut short, fails its checksum, or holds a state that does not decode
/// or does not match its metadata.
pub fn verify(bytes: &[u8], what: &str) -> Result<Verified, String> {
    let file = snapshot_file::from_bytes(bytes, what)?;
    let state =
        decode_state(&file.data).map_err(|e| format!("{what}: the state does not decode: {e}"))?;
    if state.last_applied != file.meta.last_log_id {
        return Err(format!(
            "{what}: its metadata covers {:?} but its state {:?}",
            file.meta.last_log_id, state.last_applied
        ));
    }
    Ok(Verified {
        meta: file.meta,
        state,
    })
}

/// A replica's log directory under its data directory.
pub fn log_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("log")
}

/// A replica's snapshot directory under its data directory.
pub fn snapshot_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("snapshots")
}

/// Seeds the empty data directory of replica `id` of a new cell with `backup`'s state, the
/// cell's voters being `members` (id → address). Started, the replica holds the backup's
/// state at its log index, with `members` as the cell's membership. Seed every member's
/// directory alike (same backup, members and bump: the snapshot is the same bytes, but
/// each directory also gets a log store of its own, with its own store id, so a snapshot
/// file copied into another directory does not seed it: that replica refuses to start): a
/// member left empty and started with `bootstrap` would initialize a cell of its own,
/// which the other empty members could elect, and the seeded ones would take its entries
/// at indices they hold as committed for their own (openraft skips them): two states.
/// Returns the snapshot file written.
///
/// The log id is re-based to term 0 at the backup's index plus `bump`: the new cell's
/// first leader is elected in term 1, so its entries follow the restored state's in log
/// order, and the index (from which fencing tokens are made: index × 1024 + position)
/// goes on from there. With `bump` 0 the new cell's tokens go on from the backup's index,
/// so they may equal or fall below tokens the old cell granted after the backup: a
/// resource would accept the old holders' writes beside (or after) the new ones. A `bump`
/// at least the entries the old cell could have committed since the backup puts every
/// new token above every old one (etcdutl's `snapshot restore --bump-revision` is the
/// same idea); `lockctl snapshot restore` requires one.
pub fn seed(
    data_dir: &Path,
    id: u64,
    backup: Verified,
    members: &BTreeMap<u64, String>,
    bump: u64,
) -> Result<PathBuf, String> {
    if members.is_empty() {
        return Err("a restored cell needs its members (id=host:port, ...)".into());
    }
    if !members.contains_key(&id) {
        return Err(format!(
            "replica {id} is not one of the members ({}): seed each member's own data \
             directory with its id",
            members
                .keys()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    for (id, addr) in members {
        if *id == 0 || !wire::is_host_port(addr) {
            return Err(format!(
                "member {id}={addr}: expected an id above 0 and a host:port"
            ));
        }
    }
    for dir in [log_dir(data_dir), snapshot_dir(data_dir)] {
        let used = match std::fs::read_dir(&dir) {
            Ok(mut entries) => entries.next().is_some(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        };
        if used {
            return Err(format!(
                "{} already holds a replica's data: a restore seeds an empty data \
                 directory (move this one aside)",
                dir.display()
            ));
        }
    }
    if backup.meta.last_log_id.is_none() {
        return Err("the backup holds no applied entry: nothing to restore".into());
    }
    // Tokens and session ids are index × 1024 + position in a u64.
    let index = backup
        .index()
        .checked_add(bump)
        .filter(|i| i.checked_mul(1 << 20).is_some())
        .ok_or_else(|| format!("index {} + bump {bump} is too large", backup.index()))?;
    let log_id = LogId::new(
        wire::raft::LeaderId {
            term: 0,
            node_id: 0,
        },
        index,
    );
    let voters: BTreeSet<u64> = members.keys().copied().collect();
    // Unbound: a restore cannot know the other members' new stores; the restored cell's
    // first leader binds them (`raft::binding::bind_stores`).
    let nodes: BTreeMap<u64, wire::raft::Member> = members
        .iter()
        .map(|(id, addr)| (*id, wire::raft::Member::unbound(addr.clone())))
        .collect();
    let mut state = backup.state;
    state.last_applied = Some(log_id);
    let membership = Membership::new(vec![voters], nodes).map_err(|e| e.to_string())?;
    state.membership = StoredMembership::new(Some(log_id), membership);
    let data = postcard::to_allocvec(&state).map_err(|e| e.to_string())?;
    let meta = SnapshotMeta {
        last_log_id: Some(log_id),
        last_membership: state.membership.clone(),
    };
    // The store first (its id made now): a replica refuses to start on snapshots beside
    // a log store it has to make anew, as that is what a lost log looks like
    // (`server::refuse_snapshots_without_their_log`).
    let logs = log_dir(data_dir);
    let logs_existed = logs.exists();
    let remove_logs = || {
        if logs_existed {
            if let Ok(entries) = std::fs::read_dir(&logs) {
                for entry in entries.flatten() {
                    let _ = std::fs::remove_dir_all(entry.path());
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        } else {
            let _ = std::fs::remove_dir_all(&logs);
        }
    };
    drop(crate::raft::log_store::LogStore::open(&logs).map_err(|e| {
        remove_logs();
        format!("{}: {e}", logs.display())
    })?);
    let dir = snapshot_dir(data_dir);
    let existed = dir.exists();
    let id = format!("{SEEDED_ID_PREFIX}{index}");
    snapshot_file::write(&dir, &meta, &id, &data).map_err(|e| {
        remove_logs();
        // Nothing half-written left behind (the directory was empty): the restore can be
        // run again once the cause is fixed.
        if existed {
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for entry in entries.flatten() {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
        format!("{}: {e}", dir.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sort_by_index_and_read_back() {
        let a = BackupObject::name_of("dev", 9, 1_700_000_000_000);
        let b = BackupObject::name_of("dev", 10, 1_600_000_000_000);
        assert!(a < b, "{a} sorts before {b}");
        let back = BackupObject::parse(&b, 7).unwrap();
        assert_eq!(
            (back.cell.as_str(), back.index, back.unix_ms),
            ("dev", 10, 1_600_000_000_000)
        );
        for not in [
            "dev/other.lksnap",
            "snapshot-1-2.lksnap",
            "dev/snapshot-x-y.lksnap",
            "",
        ] {
            assert!(BackupObject::parse(not, 0).is_none(), "{not}");
        }
    }

    #[test]
    fn a_store_it_cannot_use_is_refused_with_the_reason() {
        let none = BTreeMap::new();
        for (url, says) in [
            ("not a url", "expected s3://"),
            ("gs://bucket/x", "not built into this binary"),
            ("ftp://host/x", "expected s3://"),
        ] {
            let e = Store::open(url, &none).unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
        }
        let bad: BTreeMap<String, String> = [("endpoit".to_string(), "x".to_string())].into();
        let e = Store::open("s3://bucket/p", &bad).unwrap_err();
        assert!(e.contains("endpoit"), "{e}");
        let e = Store::open("file:///tmp/x", &bad).unwrap_err();
        assert!(e.contains("takes none"), "{e}");
        let ok: BTreeMap<String, String> = [
            ("endpoint".to_string(), "http://127.0.0.1:9".to_string()),
            ("allow_http".to_string(), "true".to_string()),
        ]
        .into();
        Store::open("s3://bucket/p", &ok).unwrap();
        // Azure: az:// would lose the prefix's first segment; an option it does not know.
        let account: BTreeMap<String, String> =
            [("account_name".to_string(), "acct".to_string())].into();
        let e = Store::open("az://container/a/b", &account).unwrap_err();
        assert!(e.contains("azure://container/prefix"), "{e}");
        let e = Store::open("azure://container/p", &bad).unwrap_err();
        assert!(e.contains("endpoit") && e.contains("Azure"), "{e}");
        let s = Store::open("azure://container/a/b", &account).unwrap();
        assert_eq!(s.prefix.as_ref(), "a/b");
    }

    fn sample_state() -> SmState {
        let mut sm = crate::state_machine::StateMachine::bootstrapped(
            &["lock://client/t".to_string()],
            &wire::acl::Acl::everyone(),
        );
        let cmd = wire::command::Command::CreateSession {
            owner: "lock://client/t".into(),
        };
        assert!(sm.apply(5, &cmd).0.is_ok());
        SmState {
            last_applied: Some(LogId::new(
                wire::raft::LeaderId {
                    term: 3,
                    node_id: 1,
                },
                5,
            )),
            membership: StoredMembership::default(),
            sm,
        }
    }

    /// A backup written to a file:// store reads back with the same digest; cut short,
    /// changed, or not a backup at all, it is refused with the reason; retention keeps
    /// the newest.
    #[test]
    fn a_backup_round_trips_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/backups", dir.path().display());
        let store = Store::open(&url, &BTreeMap::new()).unwrap();
        let state = sample_state();
        let enc = encode(&state).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for t in 0..3 {
                store
                    .put("dev", enc.index, 1_000 + t, enc.bytes.clone())
                    .await
                    .unwrap();
            }
            let listed = store.list(Some("dev")).await.unwrap();
            assert_eq!(listed.len(), 3);
            assert_eq!(
                store.prune("dev", 2, None, u64::MAX).await.unwrap().len(),
                1
            );
            let listed = store.list(Some("dev")).await.unwrap();
            let newest = newest_taken(&listed, u64::MAX).unwrap();
            assert_eq!(newest.unix_ms, 1_002);
            let bytes = store.get(&newest.name, BACKUP_BYTES_MAX).await.unwrap();
            let back = verify(&bytes, &newest.name).unwrap();
            assert_eq!(back.index(), 5);
            assert_eq!(back.state.sm.digest(), enc.digest);
        });
        let cut = &enc.bytes[..enc.bytes.len() - 10];
        assert!(verify(cut, "o").unwrap_err().contains("truncated"));
        let mut changed = enc.bytes.clone();
        let last = changed.len() - 1;
        changed[last] ^= 1;
        assert!(verify(&changed, "o").unwrap_err().contains("checksum"));
        assert!(verify(b"hello", "o")
            .unwrap_err()
            .contains("not a snapshot"));
    }

    /// A cell restored under the same name writes lower indices than the old cell's last
    /// backups: the newest is the last taken, retention keeps the newest by time and
    /// never deletes the one just written; large backups go up in parts and read back.
    #[test]
    fn the_newest_is_the_last_taken_and_parts_read_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            &format!("file://{}/b", dir.path().display()),
            &BTreeMap::new(),
        )
        .unwrap();
        let enc = encode(&sample_state()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // The old cell's, at high indices, taken earlier.
            for t in 0..3 {
                store
                    .put("dev", 900 + t, 1_000 + t, enc.bytes.clone())
                    .await
                    .unwrap();
            }
            // The restored cell's, at a lower index, taken later.
            let mine = store
                .put("dev", 50, 2_000, enc.bytes.clone())
                .await
                .unwrap();
            let listed = store.list(Some("dev")).await.unwrap();
            assert_eq!(newest_taken(&listed, u64::MAX).unwrap().name, mine.name);
            assert_eq!(newest_taken(&listed, 1_999).unwrap().index, 902);
            let gone = store
                .prune("dev", 2, Some(&mine.name), u64::MAX)
                .await
                .unwrap();
            assert_eq!(gone.len(), 2, "{gone:?}");
            let left: Vec<u64> = store
                .list(Some("dev"))
                .await
                .unwrap()
                .iter()
                .map(|b| b.index)
                .collect();
            assert_eq!(left, vec![902, 50]);
            // A clock that ran ahead named one far in the future: the one just written
            // is never deleted, whatever the times say.
            let ahead = store
                .put("dev", 60, 9_999_999, enc.bytes.clone())
                .await
                .unwrap();
            let now = store
                .put("dev", 61, 3_000, enc.bytes.clone())
                .await
                .unwrap();
            store
                .prune("dev", 1, Some(&now.name), u64::MAX)
                .await
                .unwrap();
            let names = || {
                let store = store.clone();
                async move {
                    store
                        .list(Some("dev"))
                        .await
                        .unwrap()
                        .into_iter()
                        .map(|b| b.name)
                        .collect::<Vec<String>>()
                }
            };
            let left = names().await;
            assert!(left.contains(&now.name), "{left:?}");
            // Named in the future (past `future_after`): neither counted among the newest
            // nor deleted, so the real history stays.
            let later = store
                .put("dev", 62, 3_500, enc.bytes.clone())
                .await
                .unwrap();
            store
                .prune("dev", 2, Some(&later.name), 5_000)
                .await
                .unwrap();
            let left = names().await;
            assert!(
                left.contains(&ahead.name)
                    && left.contains(&now.name)
                    && left.contains(&later.name),
                "{left:?}"
            );
            // In parts: 7 parts of 64 bytes and a short one.
            let big: Vec<u8> = (0..64 * 7 + 5).map(|i| (i % 251) as u8).collect();
            let o = store
                .put_in_parts("dev", 70, 4_000, big.clone(), 100, 64)
                .await
                .unwrap();
            assert_eq!(store.get(&o.name, big.len() as u64).await.unwrap(), big);
            // Over the limit: refused by its size, naming both.
            let e = store.get(&o.name, big.len() as u64 - 1).await.unwrap_err();
            assert!(
                e.contains(&format!("is {} bytes", big.len()))
                    && e.contains(&format!("({} bytes)", big.len() - 1))
                    && e.contains("not a backup"),
                "{e}"
            );
        });
    }

    /// What decodes as a snapshot file but not as a backup is refused too.
    #[test]
    fn a_state_that_does_not_decode_or_match_its_metadata_is_refused() {
        let state = sample_state();
        let meta = |index| SnapshotMeta {
            last_log_id: Some(LogId::new(
                wire::raft::LeaderId {
                    term: 3,
                    node_id: 1,
                },
                index,
            )),
            last_membership: StoredMembership::default(),
        };
        let garbage = snapshot_file::to_bytes(&meta(5), "x", &[0xff; 64]).unwrap();
        assert!(verify(&garbage, "o")
            .unwrap_err()
            .contains("does not decode"));
        let data = postcard::to_allocvec(&state).unwrap();
        let other = snapshot_file::to_bytes(&meta(6), "x", &data).unwrap();
        assert!(verify(&other, "o").unwrap_err().contains("metadata covers"));
        assert!(verify(&snapshot_file::to_bytes(&meta(5), "x", &data).unwrap(), "o").is_ok());
    }

    /// A seeded data directory holds the backup's state at its index in term 0 with the
    /// new members; a directory already in use is refused.
    #[test]
    fn a_seed_rebases_the_log_id_and_keeps_the_index() {
        let dir = tempfile::tempdir().unwrap();
        let enc = encode(&sample_state()).unwrap();
        let members: BTreeMap<u64, String> = [
            (1, "127.0.0.1:1".to_string()),
            (2, "localhost:2".to_string()),
        ]
        .into();
        seed(dir.path(), 1, verify(&enc.bytes, "b").unwrap(), &members, 0).unwrap();
        let file = snapshot_file::latest(&snapshot_dir(dir.path()))
            .unwrap()
            .unwrap();
        let state: SmState = postcard::from_bytes(&file.data).unwrap();
        let id = state.last_applied.unwrap();
        assert_eq!((id.leader_id.term, id.index), (0, 5));
        // Bumped: the log index moves on, the state is the same.
        let bumped = tempfile::tempdir().unwrap();
        seed(
            bumped.path(),
            1,
            verify(&enc.bytes, "b").unwrap(),
            &members,
            1_000,
        )
        .unwrap();
        let file_b = snapshot_file::latest(&snapshot_dir(bumped.path()))
            .unwrap()
            .unwrap();
        let b: SmState = postcard::from_bytes(&file_b.data).unwrap();
        assert_eq!(b.last_applied.unwrap().index, 1_005);
        assert_eq!(b.sm.digest(), enc.digest);
        let e = seed(
            tempfile::tempdir().unwrap().path(),
            1,
            verify(&enc.bytes, "b").unwrap(),
            &members,
            u64::MAX,
        )
        .unwrap_err();
        assert!(e.contains("too large"), "{e}");
        assert_eq!(file.meta.last_log_id, state.last_applied);
        let voters: Vec<u64> = state.membership.membership().voter_ids().collect();
        assert_eq!(voters, vec![1, 2]);
        assert_eq!(
            state.sm.digest(),
            enc.digest,
            "the state itself is the backup's"
        );
        let e = seed(dir.path(), 1, verify(&enc.bytes, "b").unwrap(), &members, 0).unwrap_err();
        assert!(e.contains("already holds"), "{e}");
        let e = seed(
            tempfile::tempdir().unwrap().path(),
            3,
            verify(&enc.bytes, "b").unwrap(),
            &members,
            0,
        )
        .unwrap_err();
        assert!(e.contains("not one of the members"), "{e}");
        let e = seed(
            tempfile::tempdir().unwrap().path(),
            1,
            verify(&enc.bytes, "b").unwrap(),
            &[(1, "nothing".to_string())].into(),
            0,
        )
        .unwrap_err();
        assert!(e.contains("host:port"), "{e}");
    }
}
