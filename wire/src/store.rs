//! Store ids and bindings: how a cell tells a replica's store from the one it lost.
//!
//! Every replica's store has an id ([`StoreId`]), and the membership binds each member to
//! one ([`Binding`]): a replica whose data was lost comes back with another store, and
//! what it answers no longer counts for the member it was (docs/architecture.md, "A
//! replica whose data was lost"). Here rather than in `raft` so that clients see the
//! bindings in [`crate::types::MemberInfo`].

use serde::{Deserialize, Serialize};

/// The id of one replica's store: 128 random bits given to a data directory when it is
/// first used (or seeded from a backup), kept in it. A replica whose data was lost comes
/// back with a new one, so the cell can tell it from the store that made its promises.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct StoreId(pub [u8; 16]);

impl StoreId {
    /// A fresh id from `rng`.
    pub fn random(rng: &mut impl rand::RngCore) -> StoreId {
        let mut b = [0u8; 16];
        rng.fill_bytes(&mut b);
        StoreId(b)
    }

    /// The id in 32 lowercase hex digits (what [`std::fmt::Display`] prints).
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Reads 32 hex digits back.
    pub fn from_hex(s: &str) -> Option<StoreId> {
        if s.len() != 32 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let mut b = [0u8; 16];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(StoreId(b))
    }
}

impl std::fmt::Display for StoreId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

impl std::fmt::Debug for StoreId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreId({})", self.hex())
    }
}

/// Which store's answers count for a member: the record that keeps a replica whose data
/// was lost from voting away entries its old store acknowledged (docs/architecture.md, "A
/// replica whose data was lost"). Checked by the replica that sent the request (a leader
/// counting acknowledgements, a candidate counting votes), against its own effective
/// membership: an answer that does not count is taken as no answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Binding {
    /// Nobody bound it yet: every answer counts. Only in a cell that was never bound (a
    /// new cell, or one seeded from a backup) until its first leader binds its members.
    #[default]
    Unbound,
    /// To be bound to the store it next answers from; until then its answers do not
    /// count (a member added as a learner, or one that did not answer when the cell's
    /// members were first bound).
    Pending,
    /// Its answers count only when they come from this store.
    Bound(StoreId),
}

impl Binding {
    /// Whether an answer from a replica whose hello named `answered` counts.
    pub fn counts(&self, answered: Option<StoreId>) -> bool {
        match self {
            Binding::Unbound => true,
            Binding::Pending => false,
            Binding::Bound(s) => answered == Some(*s),
        }
    }
}

impl std::fmt::Display for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Binding::Unbound => f.write_str("unbound"),
            Binding::Pending => f.write_str("binding pending"),
            Binding::Bound(s) => write!(f, "store {s}"),
        }
    }
}
