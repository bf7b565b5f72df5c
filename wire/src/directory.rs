//! Cells, prefixes and the directory that maps one to the other (`docs/directory.md`).
//!
//! A **prefix** is a top-level path (`/payments`): it and everything below it live in
//! exactly one cell, so no operation spans two consensus groups. The **directory** maps
//! each prefix to its cell, with an **epoch** that grows by one at every move of the
//! prefix. Each cell records, in its replicated state, the prefixes it owns and their
//! epochs ([`PrefixState`]); a request for a path the cell does not own is answered with
//! [`crate::Error::WrongCell`], one under a prefix being moved out with
//! [`crate::Error::Frozen`] (writes only).
//!
//! **Fencing tokens across moves**: a node's token is `epoch << 54 | sequence`, the
//! sequence being `create index × 1024 + position` ([`token`]). A prefix's epoch in its
//! new cell is above its epoch in the old one, so every grant in the new cell carries a
//! larger token than any grant the old cell ever made for that prefix, whatever the two
//! cells' log indexes. A protected resource compares tokens as before: a `u64` that only
//! grows.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Bits of a fencing token below the epoch: its *sequence*, `create index ×`
/// [`CREATES_PER_ENTRY`] ` + position`, which stays under `2^54` while the create index is
/// under `2^44` (1.8 × 10^13 entries: 5.5 years at 100 000 entries a second, 55 at a
/// more than busy cell's 10 000).
pub const TOKEN_SEQUENCE_BITS: u32 = 54;

/// The largest epoch a token can carry (10 bits: 1 023 moves of one prefix).
pub const EPOCH_MAX: u64 = (1 << (64 - TOKEN_SEQUENCE_BITS)) - 1;

/// At most this many nodes are created by one log entry, each with a token of its own:
/// the `position`th create (from 0, in apply order) of the entry at `index` has the
/// sequence `index × CREATES_PER_ENTRY + position`, so creates that share an entry (lock
/// contenders under one parent included) get distinct tokens that grow in the order they
/// apply, and every token of an entry is above every token of the entries before it.
pub const CREATES_PER_ENTRY: u64 = 1024;

// One transaction's creates always fit in one entry.
const _: () = assert!(crate::TXN_OPS_MAX as u64 <= CREATES_PER_ENTRY);

/// The fencing token of the `position`th create in the log entry at `index`, under a
/// prefix at `epoch`: `epoch << 54 | (index × 1024 + position)`. `None` if a part is out
/// of range (the create is then refused rather than given a token that could repeat).
pub fn token(epoch: u64, index: u64, position: u64) -> Option<u64> {
    if epoch > EPOCH_MAX || position >= CREATES_PER_ENTRY {
        return None;
    }
    let sequence = index.checked_mul(CREATES_PER_ENTRY)? + position;
    (sequence < 1 << TOKEN_SEQUENCE_BITS).then_some(epoch << TOKEN_SEQUENCE_BITS | sequence)
}

/// The epoch a token carries (the prefix's epoch in the cell that created the node).
pub fn token_epoch(token: u64) -> u64 {
    token >> TOKEN_SEQUENCE_BITS
}

/// The log index of the entry that created the node a token was given to.
pub fn token_index(token: u64) -> u64 {
    (token & ((1 << TOKEN_SEQUENCE_BITS) - 1)) / CREATES_PER_ENTRY
}

/// The prefix a path belongs to: its first component with the leading slash
/// (`/payments/locks/a` → `/payments`); `None` for the root `/`. The path must be valid
/// ([`crate::path::validate`]).
pub fn prefix_of(path: &str) -> Option<&str> {
    if path == "/" || !path.starts_with('/') {
        return None;
    }
    let end = path[1..].find('/').map_or(path.len(), |i| i + 1);
    Some(&path[..end])
}

/// Checks a prefix: a valid path of exactly one component, at most 64 bytes of letters,
/// digits, `-`, `_` and `.`.
pub fn check_prefix(prefix: &str) -> Result<(), Error> {
    let bad = |reason: &str| {
        Err(Error::BadRequest {
            reason: format!("bad prefix {prefix:?}: {reason}"),
        })
    };
    let Some(name) = prefix.strip_prefix('/') else {
        return bad("a prefix is a top-level path such as /payments");
    };
    if name.is_empty() || name.len() > 64 {
        return bad("1 to 64 bytes after the '/'");
    }
    if name == "." || name == ".." {
        return bad("'.' and '..' are not names");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return bad("only letters, digits, '-', '_' and '.' (one path component)");
    }
    Ok(())
}

/// Checks a cell's name: 1 to 64 bytes of lower-case letters, digits and `-` (it appears
/// in certificates' identities, `lock://<cell>/replica/<n>`).
pub fn check_cell_name(name: &str) -> Result<(), Error> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(Error::BadRequest {
            reason: format!(
                "bad cell name {name:?}: 1 to 64 bytes of lower-case letters, digits and '-'"
            ),
        });
    }
    Ok(())
}

/// Where a prefix stands in one cell (each cell's replicated state records it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PrefixState {
    /// The cell serves the prefix: reads and writes.
    Owned,
    /// Being moved out: reads are served, writes refused with [`Error::Frozen`] (retry:
    /// the SDK finds the new cell once the move is done). Cached reads are not granted.
    Frozen,
    /// Being copied in: nothing is served ([`Error::WrongCell`]) until it is owned.
    Importing,
    /// Moved out: nothing is served ([`Error::WrongCell`] with this epoch, the epoch of
    /// the move, so a client knows how new its map must be).
    Gone,
}

impl std::fmt::Display for PrefixState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PrefixState::Owned => "owned",
            PrefixState::Frozen => "frozen",
            PrefixState::Importing => "importing",
            PrefixState::Gone => "gone",
        })
    }
}

/// A prefix as one cell records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixRecord {
    /// The prefix (`/payments`).
    pub prefix: String,
    /// Its epoch in this cell.
    pub epoch: u64,
    /// Where it stands.
    pub state: PrefixState,
}

/// About how many bytes of nodes one export page or import command carries (an import
/// is one log entry; a replica sends about 1 MiB of entries per AppendEntries).
pub const IMPORT_BYTES_MAX: usize = 512 * 1024;

/// A persistent node copied from one cell to another by a move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedNode {
    /// Its path.
    pub path: String,
    /// Its data.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Its data version (kept, so compare-and-set goes on across the move).
    pub version: u64,
    /// Its children version.
    pub children_version: u64,
    /// The next sequence number of its sequential children (kept: names keep growing).
    pub sequence_next: u64,
    /// Its fencing token (kept).
    pub token: u64,
    /// Its ACL.
    pub acl: crate::acl::Acl,
}

/// A cell as the directory describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellInfo {
    /// Its name (the `<cell>` of its replicas' identities).
    pub name: String,
    /// Where clients reach it: its proxies, or its replicas when it has none
    /// (`host:port`, tried in order).
    pub endpoints: Vec<String>,
}

/// A prefix as the directory maps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixEntry {
    /// The prefix (`/payments`).
    pub prefix: String,
    /// The cell that owns it.
    pub cell: String,
    /// Its epoch: 0 when first placed, one more at every move.
    pub epoch: u64,
    /// A move under way to this cell (`lockctl dir move`), for a re-run to finish.
    pub moving_to: Option<String>,
}

/// The whole map a directory serves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectoryMap {
    /// The root cell's applied index the map was read at: a map with a higher one is
    /// newer.
    pub index: u64,
    /// The cells, by name.
    pub cells: Vec<CellInfo>,
    /// The prefixes, by prefix.
    pub prefixes: Vec<PrefixEntry>,
}

impl DirectoryMap {
    /// The entry of the prefix `path` belongs to, if the map has one.
    pub fn entry_for(&self, path: &str) -> Option<&PrefixEntry> {
        let p = prefix_of(path)?;
        self.prefixes.iter().find(|e| e.prefix == p)
    }

    /// A cell by name.
    pub fn cell(&self, name: &str) -> Option<&CellInfo> {
        self.cells.iter().find(|c| c.name == name)
    }
}

/// Where the root cell keeps the map: one node per cell under [`ROOT_CELLS`] (named by
/// the cell, data: a postcard [`CellInfo`]) and one per prefix under [`ROOT_PREFIXES`]
/// (named by the prefix without its slash, data: a postcard [`PrefixEntry`]).
pub const ROOT_DIR: &str = "/directory";
/// The cells' nodes in the root cell.
pub const ROOT_CELLS: &str = "/directory/cells";
/// The prefixes' nodes in the root cell.
pub const ROOT_PREFIXES: &str = "/directory/prefixes";

/// A [`CellInfo`] or [`PrefixEntry`] as the root cell stores it (postcard).
pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_allocvec(v).expect("directory entries serialize")
}

/// A root-cell node's data read back; `what` names the node in the error.
pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> Result<T, Error> {
    postcard::from_bytes(bytes).map_err(|e| Error::Malformed {
        reason: format!("{what}: not a directory entry: {e}"),
    })
}

/// The root-cell node of a prefix (`/payments` → `/directory/prefixes/payments`).
pub fn prefix_node(prefix: &str) -> String {
    format!("{ROOT_PREFIXES}/{}", prefix.trim_start_matches('/'))
}

/// The root-cell node of a cell.
pub fn cell_node(cell: &str) -> String {
    format!("{ROOT_CELLS}/{cell}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_of_paths() {
        assert_eq!(prefix_of("/"), None);
        assert_eq!(prefix_of("/payments"), Some("/payments"));
        assert_eq!(prefix_of("/payments/locks/a"), Some("/payments"));
        assert!(check_prefix("/payments").is_ok());
        for bad in [
            "payments",
            "/",
            "/a/b",
            "/..",
            "/a b",
            &format!("/{}", "x".repeat(65)),
        ] {
            assert!(check_prefix(bad).is_err(), "{bad}");
        }
        assert!(check_cell_name("cell-a").is_ok());
        assert!(check_cell_name("Cell").is_err() && check_cell_name("").is_err());
    }

    /// Tokens: at epoch 0, the create index × 1024 + position; every token of an entry
    /// above every token of the entries before it; any token of a later epoch above every
    /// token of an earlier one; out-of-range parts give none.
    #[test]
    fn tokens_grow_with_the_position_the_index_and_the_epoch() {
        assert_eq!(token(0, 17, 0), Some(17 * 1024));
        assert_eq!(token(0, 17, 5), Some(17 * 1024 + 5));
        assert!(token(0, 18, 0) > token(0, 17, CREATES_PER_ENTRY - 1));
        let index_max = (1 << (TOKEN_SEQUENCE_BITS - 10)) - 1;
        let last_old = token(3, index_max, CREATES_PER_ENTRY - 1).unwrap();
        let first_new = token(4, 1, 0).unwrap();
        assert!(first_new > last_old);
        assert_eq!(token_epoch(last_old), 3);
        assert_eq!(token_index(last_old), index_max);
        assert_eq!(token_index(token(2, 17, 9).unwrap()), 17);
        assert_eq!(token(EPOCH_MAX + 1, 1, 0), None);
        assert_eq!(token(1, index_max + 1, 0), None);
        assert_eq!(token(1, 1, CREATES_PER_ENTRY), None);
        assert_eq!(token(0, u64::MAX, 0), None);
        assert_eq!(
            token(EPOCH_MAX, 5, 1),
            Some(EPOCH_MAX << TOKEN_SEQUENCE_BITS | (5 * 1024 + 1))
        );
        // A token of the layout before (epoch << 48 | index) stays below every token of
        // the same epoch made now, and of epoch 0 too: an upgraded cell's tokens go on
        // growing.
        for epoch in [0u64, 1, 7, 1023] {
            let before = epoch << 48 | ((1 << 48) - 1);
            let before = if epoch == 0 { (1 << 40) - 1 } else { before };
            let now = token(epoch, 1 << 40, 0).unwrap();
            assert!(now > before, "epoch {epoch}");
        }
    }
}
