//! Snapshot files: written atomically, checksummed, a few kept as backups.
//!
//! Format: the magic `LKSNAP6\n` (2 since sessions record their owner, 3 since the state
//! holds ACLs, groups and admins, 4 since it records the prefixes the cell owns and each
//! node's fencing token, 5 since openraft 0.10: its `SnapshotMeta` has no snapshot id, so
//! [`SnapshotFile`] carries ours, and the metadata is openraft 0.10's; 6 since the
//! membership binds each member to its store (`wire::raft::Member`); `LKSNAP4` and
//! `LKSNAP5` are still read, their members unbound, so older builds' backups restore; a
//! file of another version is refused with an error naming both), a big-endian CRC-32 of the body, the body's length as a
//! big-endian u64, then the body: postcard of [`SnapshotFile`]. A file is written under a
//! temporary name, fsynced, renamed into place, and the directory is fsynced, so a crash
//! leaves either the old set of snapshots or the new one, never a torn file. A file whose
//! checksum does not match is skipped (and renamed `*.corrupt`) and the next older one used.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use wire::raft::SnapshotMeta;

const MAGIC: &[u8; 8] = b"LKSNAP6\n";

/// The format before: [`SnapshotFile`] with openraft's `BasicNode` (an address only) as
/// the membership's node type. Still read (not written), its members unbound.
const MAGIC_V5: &[u8; 8] = b"LKSNAP5\n";

/// A membership of the formats before [`MAGIC`] (members by address only).
type LegacyMembership =
    openraft::StoredMembership<wire::raft::LeaderId, wire::raft::NodeId, openraft::BasicNode>;

/// An `LKSNAP5` body ([`MAGIC_V5`]).
#[derive(Deserialize)]
struct FileV5 {
    meta: openraft::SnapshotMeta<wire::raft::LeaderId, wire::raft::NodeId, openraft::BasicNode>,
    data: Vec<u8>,
    id: String,
}

/// A membership of an older format with the same members and voters, each unbound.
fn unbound(m: LegacyMembership) -> Result<wire::raft::StoredMembership, String> {
    let nodes: std::collections::BTreeMap<_, _> = m
        .membership()
        .nodes()
        .map(|(id, n)| (*id, wire::raft::Member::unbound(n.addr.clone())))
        .collect();
    let configs = m.membership().get_joint_config().clone();
    let membership = openraft::Membership::new(configs, nodes).map_err(|e| e.to_string())?;
    Ok(openraft::StoredMembership::new(*m.log_id(), membership))
}

/// The format before: openraft 0.9's `SnapshotMeta` (last log id, membership, snapshot id)
/// and the data. Still read (not written), so that a backup taken by a 0.9 build seeds a
/// cell of this one: 0.10's log ids and memberships encode as 0.9's did with the leader id
/// we use (`leader_id_adv`: term and node id), and postcard lays a nested struct out as its
/// fields in a row, so [`FileV4`] reads such a body whole, its snapshot id included.
const MAGIC_V4: &[u8; 8] = b"LKSNAP4\n";

/// An `LKSNAP4` body ([`MAGIC_V4`]).
#[derive(Deserialize)]
struct FileV4 {
    last_log_id: Option<wire::raft::LogId>,
    last_membership: LegacyMembership,
    snapshot_id: String,
    data: Vec<u8>,
}

/// The snapshot id prefix of a snapshot a restore seeded from a backup
/// (`crate::backup::seed`): a replica that starts from one logs the state's digest
/// ("seeded from a backup").
pub const SEEDED_ID_PREFIX: &str = "restored-";

/// How many snapshot files to keep (the newest plus backups).
pub const SNAPSHOTS_KEPT: usize = 3;

/// What a snapshot file holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotFile {
    /// openraft's metadata (last log id, membership).
    pub meta: SnapshotMeta,
    /// The serialized state machine (the same bytes peers receive).
    pub data: Vec<u8>,
    /// Our id of the snapshot (`<term>-<index>-<n>` for one this replica built, the
    /// builder's for one received from a leader, [`SEEDED_ID_PREFIX`]`<index>` for one a
    /// restore seeded): openraft 0.9 kept it in its metadata, 0.10 does not.
    pub id: String,
}

fn file_name(meta: &SnapshotMeta) -> String {
    let index = meta.last_log_id.map(|l| l.index).unwrap_or(0);
    format!("snapshot-{index:020}.snap")
}

/// The file's body (postcard of [`SnapshotFile`]) and its 20-byte head.
fn encode(meta: &SnapshotMeta, id: &str, data: &[u8]) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let body = postcard::to_allocvec(&SnapshotFile {
        meta: meta.clone(),
        data: data.to_vec(),
        id: id.to_string(),
    })
    .map_err(std::io::Error::other)?;
    let mut head = Vec::with_capacity(20);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&crc32fast::hash(&body).to_be_bytes());
    head.extend_from_slice(&(body.len() as u64).to_be_bytes());
    Ok((head, body))
}

/// A snapshot file's bytes, in memory (what a backup uploads: the same format as on
/// disk, so its checksum and length travel with it).
pub fn to_bytes(meta: &SnapshotMeta, id: &str, data: &[u8]) -> std::io::Result<Vec<u8>> {
    let (mut head, body) = encode(meta, id, data)?;
    head.extend_from_slice(&body);
    Ok(head)
}

/// Writes `meta` + `id` + `data` atomically into `dir`, then prunes old files beyond
/// [`SNAPSHOTS_KEPT`]. Returns the final path.
pub fn write(dir: &Path, meta: &SnapshotMeta, id: &str, data: &[u8]) -> std::io::Result<PathBuf> {
    fs::create_dir_all(dir)?;
    let (head, body) = encode(meta, id, data)?;
    let path = dir.join(file_name(meta));
    let tmp = path.with_extension("snap.tmp");
    {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&head)?;
        write_trickled(&mut f, head.len() as u64, &body)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, &path)?;
    fs::File::open(dir)?.sync_all()?;
    prune(dir)?;
    Ok(path)
}

/// Bytes of a snapshot file written between two writebacks ([`write_trickled`]).
const WRITEBACK_CHUNK: usize = 1 << 20;

/// Writes `bytes` at file offset `at` a chunk at a time, starting each chunk's writeback
/// as soon as it is written and waiting for the chunk before it, so that at most two
/// chunks are dirty at once and the closing fsync has little left to do. A whole
/// snapshot left dirty and flushed by one fsync held the log's fsyncs behind it (one
/// filesystem: ext4 orders a journal commit after the data it covers), and writes
/// stalled while a snapshot was written (RocksDB's `bytes_per_sync` is the same idea).
/// Where `sync_file_range` is refused, the chunks are written alike and the fsync does
/// the rest.
fn write_trickled(f: &mut fs::File, at: u64, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let mut previous: Option<(u64, usize)> = None;
    let mut off = at;
    for chunk in bytes.chunks(WRITEBACK_CHUNK) {
        f.write_all(chunk)?;
        let mut ranges = vec![(off, chunk.len(), libc::SYNC_FILE_RANGE_WRITE)];
        if let Some((p, len)) = previous {
            ranges.push((
                p,
                len,
                libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER,
            ));
        }
        for (at, len, flags) in ranges {
            // SAFETY: sync_file_range(2) on our own open file, with plain integer arguments.
            let r = unsafe {
                libc::sync_file_range(fd, at as libc::off64_t, len as libc::off64_t, flags)
            };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                // Not supported here: the closing fsync does it all. Anything else (an I/O
                // error) is the file's: a call that waits reports it, and marks it
                // reported, so the fsync after it would not see it again.
                match e.raw_os_error() {
                    Some(libc::ENOSYS | libc::EINVAL | libc::ESPIPE | libc::EOPNOTSUPP) => {}
                    _ => return Err(e),
                }
            }
        }
        previous = Some((off, chunk.len()));
        off += chunk.len() as u64;
    }
    Ok(())
}

/// Snapshot files in `dir`, newest first.
pub fn list(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "snap"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    files.sort();
    files.reverse();
    Ok(files)
}

fn prune(dir: &Path) -> std::io::Result<()> {
    for old in list(dir)?.into_iter().skip(SNAPSHOTS_KEPT) {
        fs::remove_file(old)?;
    }
    Ok(())
}

/// Reads and verifies one snapshot file.
pub fn read(path: &Path) -> Result<SnapshotFile, String> {
    let bytes = fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    from_bytes(&bytes, &path.display().to_string())
}

/// Verifies and decodes a snapshot file's bytes (`what` names them in errors: a path, an
/// object). Refused, with the reason: another format, not a snapshot file at all, fewer
/// or more bytes than its head says (a partial copy), a checksum that does not match.
pub fn from_bytes(bytes: &[u8], what: &str) -> Result<SnapshotFile, String> {
    let v4 = bytes.len() >= 8 && bytes[..8] == MAGIC_V4[..];
    let v5 = bytes.len() >= 8 && bytes[..8] == MAGIC_V5[..];
    if bytes.len() >= 8 && bytes[..6] == MAGIC[..6] && bytes[..8] != MAGIC[..] && !v4 && !v5 {
        return Err(format!(
            "{what}: snapshot format {:?}, this build reads {:?} (written by another build; \
             move the data directory aside and let the replica catch up from its peers)",
            String::from_utf8_lossy(&bytes[..7]),
            String::from_utf8_lossy(&MAGIC[..7]),
        ));
    }
    if bytes.len() < 20 || (&bytes[..8] != MAGIC && !v4 && !v5) {
        return Err(format!("{what}: not a snapshot file"));
    }
    let crc = u32::from_be_bytes(bytes[8..12].try_into().expect("4 bytes"));
    let len = u64::from_be_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let body = &bytes[20..];
    if body.len() as u64 != len {
        return Err(format!(
            "{what}: truncated or padded ({} bytes where its head says {len})",
            body.len()
        ));
    }
    if crc32fast::hash(body) != crc {
        return Err(format!(
            "{what}: checksum mismatch (the bytes changed after it was written)"
        ));
    }
    if v4 {
        let f: FileV4 = postcard::from_bytes(body).map_err(|e| format!("{what}: {e}"))?;
        return Ok(SnapshotFile {
            meta: SnapshotMeta {
                last_log_id: f.last_log_id,
                last_membership: unbound(f.last_membership).map_err(|e| format!("{what}: {e}"))?,
            },
            data: f.data,
            id: f.snapshot_id,
        });
    }
    if v5 {
        let f: FileV5 = postcard::from_bytes(body).map_err(|e| format!("{what}: {e}"))?;
        return Ok(SnapshotFile {
            meta: SnapshotMeta {
                last_log_id: f.meta.last_log_id,
                last_membership: unbound(f.meta.last_membership)
                    .map_err(|e| format!("{what}: {e}"))?,
            },
            data: f.data,
            id: f.id,
        });
    }
    postcard::from_bytes(body).map_err(|e| format!("{what}: {e}"))
}

/// The newest snapshot in `dir` that verifies. Corrupt files are renamed `*.corrupt` and
/// skipped; a file of another format is an error (it is not corrupt, and starting without
/// it would start from an empty state while the log before it is gone).
pub fn latest(dir: &Path) -> std::io::Result<Option<SnapshotFile>> {
    for path in list(dir)? {
        let mut magic = [0u8; 8];
        if fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok()
            && magic[..6] == MAGIC[..6]
            && magic != *MAGIC
            && magic != *MAGIC_V4
            && magic != *MAGIC_V5
        {
            return Err(std::io::Error::other(read(&path).err().unwrap_or_default()));
        }
        match read(&path) {
            Ok(s) => return Ok(Some(s)),
            Err(e) => {
                tracing::error!("skipping snapshot: {e}");
                let _ = fs::rename(&path, path.with_extension("corrupt"));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(index: u64) -> SnapshotMeta {
        SnapshotMeta {
            last_log_id: Some(openraft::LogId::new(
                wire::raft::LeaderId {
                    term: 1,
                    node_id: 1,
                },
                index,
            )),
            last_membership: Default::default(),
        }
    }

    fn id(index: u64) -> String {
        format!("s{index}")
    }

    /// A snapshot of several writeback chunks, not a multiple of one, reads back whole.
    #[test]
    fn a_snapshot_written_a_chunk_at_a_time_reads_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..WRITEBACK_CHUNK * 3 + 12_345)
            .map(|i| (i % 251) as u8)
            .collect();
        write(dir.path(), &meta(7), &id(7), &data).unwrap();
        let back = latest(dir.path()).unwrap().unwrap();
        assert_eq!(back.id, "s7");
        assert!(back.data == data, "the data came back changed");
    }

    #[test]
    fn write_read_prune_and_skip_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        for i in 1..=5 {
            write(dir.path(), &meta(i * 10), &id(i * 10), &[i as u8; 100]).unwrap();
        }
        assert_eq!(list(dir.path()).unwrap().len(), SNAPSHOTS_KEPT);
        let newest = latest(dir.path()).unwrap().unwrap();
        assert_eq!(newest.id, "s50");
        // Corrupt the newest: the next older one is used.
        let p = list(dir.path()).unwrap()[0].clone();
        let mut bytes = fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        fs::write(&p, bytes).unwrap();
        let s = latest(dir.path()).unwrap().unwrap();
        assert_eq!(s.id, "s40");
        assert!(p.with_extension("corrupt").exists());
    }

    /// A membership of two voters and a learner, by address only (the formats before
    /// `LKSNAP6`), and what it reads back as: the same members, unbound.
    fn legacy_membership() -> (LegacyMembership, wire::raft::StoredMembership) {
        let log_id = Some(openraft::LogId::new(
            wire::raft::LeaderId {
                term: 1,
                node_id: 1,
            },
            3,
        ));
        let addr = |i: u64| format!("127.0.0.1:71{i:02}");
        let voters = vec![std::collections::BTreeSet::from([1u64, 2])];
        let old = openraft::Membership::new(
            voters.clone(),
            (1..=3u64)
                .map(|i| (i, openraft::BasicNode::new(addr(i))))
                .collect::<std::collections::BTreeMap<_, _>>(),
        )
        .unwrap();
        let new = openraft::Membership::new(
            voters,
            (1..=3u64)
                .map(|i| (i, wire::raft::Member::unbound(addr(i))))
                .collect::<std::collections::BTreeMap<_, _>>(),
        )
        .unwrap();
        (
            openraft::StoredMembership::new(log_id, old),
            openraft::StoredMembership::new(log_id, new),
        )
    }

    fn framed(magic: &[u8; 8], body: &[u8]) -> Vec<u8> {
        let mut bytes = magic.to_vec();
        bytes.extend_from_slice(&crc32fast::hash(body).to_be_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_be_bytes());
        bytes.extend_from_slice(body);
        bytes
    }

    /// An `LKSNAP4` file (openraft 0.9's metadata with its snapshot id, then the data),
    /// as a 0.9 build wrote it (postcard of the same fields in the same order), reads back
    /// with its id, its members unbound.
    #[test]
    fn a_snapshot_of_the_format_before_reads_back_with_its_id() {
        #[derive(Serialize)]
        struct Meta09 {
            last_log_id: Option<wire::raft::LogId>,
            last_membership: LegacyMembership,
            snapshot_id: String,
        }
        #[derive(Serialize)]
        struct File09 {
            meta: Meta09,
            data: Vec<u8>,
        }
        let (old, new) = legacy_membership();
        let m = meta(42);
        let body = postcard::to_allocvec(&File09 {
            meta: Meta09 {
                last_log_id: m.last_log_id,
                last_membership: old,
                snapshot_id: "restored-42".into(),
            },
            data: vec![7; 1000],
        })
        .unwrap();
        let f = from_bytes(&framed(MAGIC_V4, &body), "old").unwrap();
        assert_eq!(f.id, "restored-42");
        assert_eq!(f.meta.last_log_id, m.last_log_id);
        assert_eq!(f.meta.last_membership, new);
        assert_eq!(f.data, vec![7; 1000]);
    }

    /// An `LKSNAP5` file (members by address only) reads back with the same members and
    /// voters, unbound: a backup of a build before stores were bound restores.
    #[test]
    fn a_snapshot_of_the_format_before_bindings_reads_back_unbound() {
        #[derive(Serialize)]
        struct File5 {
            meta: openraft::SnapshotMeta<
                wire::raft::LeaderId,
                wire::raft::NodeId,
                openraft::BasicNode,
            >,
            data: Vec<u8>,
            id: String,
        }
        let (old, new) = legacy_membership();
        let body = postcard::to_allocvec(&File5 {
            meta: openraft::SnapshotMeta {
                last_log_id: meta(9).last_log_id,
                last_membership: old,
            },
            data: vec![5; 10],
            id: "1-9-1".into(),
        })
        .unwrap();
        let f = from_bytes(&framed(MAGIC_V5, &body), "v5").unwrap();
        assert_eq!(f.id, "1-9-1");
        assert_eq!(f.meta.last_membership, new);
        assert_eq!(f.meta.last_log_id, meta(9).last_log_id);
        assert_eq!(f.data, vec![5; 10]);
    }

    /// A snapshot of another format (an older build's `LKSNAP2`) is refused with an error
    /// naming both formats, and left where it is: not skipped as corrupt.
    #[test]
    fn a_snapshot_of_another_format_is_an_error_not_skipped() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &meta(10), &id(10), &[1; 100]).unwrap();
        let p = list(dir.path()).unwrap()[0].clone();
        let mut bytes = fs::read(&p).unwrap();
        bytes[..8].copy_from_slice(b"LKSNAP2\n");
        fs::write(&p, bytes).unwrap();
        let e = latest(dir.path()).unwrap_err().to_string();
        assert!(e.contains("LKSNAP2") && e.contains("LKSNAP6"), "{e}");
        assert!(p.exists(), "the file was moved");
    }
}
