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
//! **Fencing tokens across moves**: a node's token is `epoch << 48 | create index`
//! ([`token`]). A prefix's epoch in its new cell is above its epoch in the old one, so
//! every grant in the new cell carries a larger token than any grant the old cell ever
//! made for that prefix, whatever the two cells' log indexes. A protected resource
//! compares tokens as before: a `u64` that only grows.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Bits of a fencing token below the epoch: the create index must stay under `2^48`
/// (2.8 × 10^14 entries: 89 years at 100 000 entries a second).
pub const TOKEN_INDEX_BITS: u32 = 48;

/// The largest epoch a token can carry (16 bits: 65 535 moves of one prefix).
pub const EPOCH_MAX: u64 = (1 << (64 - TOKEN_INDEX_BITS)) - 1;

/// The fencing token of a node created at log index `index` under a prefix at `epoch`:
/// `epoch << 48 | index`. With epoch 0 (a cell outside any directory, or a prefix never
/// moved) the token is the create index, as it always was. `None` if either part is out
/// of range (the create is then refused rather than given a token that could repeat).
pub fn token(epoch: u64, index: u64) -> Option<u64> {
    (epoch <= EPOCH_MAX && index < (1 << TOKEN_INDEX_BITS))
        .then_some(epoch << TOKEN_INDEX_BITS | index)
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

    /// Tokens: the create index alone at epoch 0; any token of a later epoch is above
    /// every token of an earlier one; out-of-range parts give none.
    #[test]
    fn tokens_grow_with_the_epoch() {
        assert_eq!(token(0, 17), Some(17));
        let last_old = token(3, (1 << TOKEN_INDEX_BITS) - 1).unwrap();
        let first_new = token(4, 1).unwrap();
        assert!(first_new > last_old);
        assert_eq!(token(EPOCH_MAX + 1, 1), None);
        assert_eq!(token(1, 1 << TOKEN_INDEX_BITS), None);
        assert_eq!(token(EPOCH_MAX, 5), Some(EPOCH_MAX << TOKEN_INDEX_BITS | 5));
    }
}
