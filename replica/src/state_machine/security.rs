//! Who may do what: the cell's admins, its groups and the nodes' ACLs, as replicated
//! state (`docs/security.md`, "ACLs").
//!
//! ACLs are interned: a node holds an [`AclId`], and [`Security`] a table of the distinct
//! ACLs with how many nodes use each, so 100 000 nodes under one prefix share one copy
//! (in memory and in snapshots). A new node takes its parent's id; an ACL no node uses
//! any more leaves the table. Ids are never reused, so the table is the same on every
//! replica that applied the same log.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use wire::acl::{Acl, Right};
use wire::Error;

/// A node's ACL, as an index into [`Security`]'s table.
pub type AclId = u64;

/// The id of the ACL a fresh state's root has: admins only.
pub const ROOT_ACL_AT_START: AclId = 0;

/// One distinct ACL and how many nodes use it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Interned {
    acl: Acl,
    nodes: u64,
}

/// The cell's admins, groups and ACL table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Security {
    /// True once [`wire::command::Command::Bootstrap`] has applied. Until then nothing
    /// that needs an ACL is decided (it answers `Unavailable`, unremembered).
    bootstrapped: bool,
    /// Identities that pass every ACL and may change groups and admins.
    admins: BTreeSet<String>,
    /// Groups by name, each a set of identity URIs.
    groups: BTreeMap<String, BTreeSet<String>>,
    /// The distinct ACLs nodes use.
    acls: BTreeMap<AclId, Interned>,
    /// The id the next new ACL gets.
    next_id: AclId,
    /// ACLs whose count fell to 0 during the command being applied: they leave the table
    /// when it is done ([`Security::sweep`]), not at once, since a transaction that rolls
    /// back gives their nodes back. Always empty between commands (so not encoded).
    #[serde(skip)]
    unused: Vec<AclId>,
}

impl Security {
    /// A fresh state's: not bootstrapped, no admins, the root's ACL (id
    /// [`ROOT_ACL_AT_START`], used by one node) grants nothing.
    pub fn new() -> Security {
        let mut acls = BTreeMap::new();
        acls.insert(
            ROOT_ACL_AT_START,
            Interned {
                acl: Acl::admins_only(),
                nodes: 1,
            },
        );
        Security {
            bootstrapped: false,
            admins: BTreeSet::new(),
            groups: BTreeMap::new(),
            acls,
            next_id: ROOT_ACL_AT_START + 1,
            unused: Vec::new(),
        }
    }

    /// Whether the bootstrap entry has applied.
    pub fn bootstrapped(&self) -> bool {
        self.bootstrapped
    }

    /// Fails with `Unavailable` until the bootstrap entry has applied (a new cell's first
    /// leader proposes it at once; clients retry).
    pub fn check_bootstrapped(&self) -> Result<(), Error> {
        if self.bootstrapped {
            Ok(())
        } else {
            Err(Error::Unavailable {
                reason: "the cell has not applied its security bootstrap yet; retry".into(),
            })
        }
    }

    /// The admins, in order.
    pub fn admins(&self) -> impl Iterator<Item = &String> {
        self.admins.iter()
    }

    /// Whether `identity` is a cell admin.
    pub fn is_admin(&self, identity: &str) -> bool {
        self.admins.contains(identity)
    }

    /// The groups with their members, in name order.
    pub fn groups(&self) -> impl Iterator<Item = (&String, &BTreeSet<String>)> {
        self.groups.iter()
    }

    /// How many distinct ACLs nodes use.
    pub fn acl_count(&self) -> usize {
        self.acls.len()
    }

    /// The ACL behind `id`.
    pub fn acl(&self, id: AclId) -> &Acl {
        &self
            .acls
            .get(&id)
            .expect("a node's ACL is in the table")
            .acl
    }

    /// Whether `identity` holds `right` on a node whose ACL is `id`: an admin always
    /// does; otherwise the ACL decides, groups looked up here. Nothing is granted before
    /// the bootstrap (callers check [`Security::check_bootstrapped`] first, to answer
    /// `Unavailable` rather than a denial).
    pub fn allows(&self, id: AclId, right: Right, identity: &str) -> bool {
        if !self.bootstrapped || identity.is_empty() {
            return false;
        }
        if self.admins.contains(identity) {
            return true;
        }
        let in_group = |g: &str, who: &str| self.groups.get(g).is_some_and(|m| m.contains(who));
        self.acl(id).allows(right, identity, &in_group)
    }

    /// [`Security::allows`], as the error a client sees: `Unavailable` before the
    /// bootstrap, `Denied { path, right, identity }` when not allowed.
    pub fn require(
        &self,
        id: AclId,
        right: Right,
        identity: &str,
        path: &str,
    ) -> Result<(), Error> {
        self.check_bootstrapped()?;
        if self.allows(id, right, identity) {
            Ok(())
        } else {
            Err(Error::Denied {
                path: path.to_string(),
                right,
                identity: identity.to_string(),
            })
        }
    }

    /// One more node uses `id`.
    pub fn retain(&mut self, id: AclId) {
        self.acls
            .get_mut(&id)
            .expect("a retained ACL is in the table")
            .nodes += 1;
    }

    /// One node fewer uses `id`; an ACL no node uses leaves the table at the next
    /// [`Security::sweep`].
    pub fn release(&mut self, id: AclId) {
        let e = self
            .acls
            .get_mut(&id)
            .expect("a released ACL is in the table");
        e.nodes -= 1;
        if e.nodes == 0 {
            self.unused.push(id);
        }
    }

    /// Drops the ACLs no node uses any more: called once a command has applied (or
    /// rolled back).
    pub fn sweep(&mut self) {
        for id in std::mem::take(&mut self.unused) {
            if self.acls.get(&id).is_some_and(|e| e.nodes == 0) {
                self.acls.remove(&id);
            }
        }
    }

    /// The id of `acl` (canonical form), adding it to the table unused if it is new.
    /// Callers retain it for the node they give it to right away (an unused entry would
    /// otherwise stay).
    fn intern(&mut self, acl: Acl) -> AclId {
        let acl = acl.canonical();
        if let Some((id, _)) = self.acls.iter().find(|(_, e)| e.acl == acl) {
            return *id;
        }
        let id = self.next_id;
        self.next_id = self
            .next_id
            .checked_add(1)
            .expect("fewer than 2^64 ACLs over a cell's life");
        self.acls.insert(id, Interned { acl, nodes: 0 });
        id
    }

    /// The id of `acl` for one more node (a node copied in by a move).
    pub fn adopt(&mut self, acl: Acl) -> AclId {
        let id = self.intern(acl);
        self.retain(id);
        id
    }

    /// Moves one node from the ACL `old` to `acl`; returns the new id.
    pub fn replace(&mut self, old: AclId, acl: Acl) -> AclId {
        let id = self.intern(acl);
        self.retain(id);
        self.release(old);
        id
    }

    /// Applies the bootstrap: `admins` and the root's ACL (the root node's id is
    /// `root`); returns the root's new id. A second bootstrap changes nothing and returns
    /// `root`.
    pub fn bootstrap(
        &mut self,
        root: AclId,
        admins: &[String],
        root_acl: &Acl,
    ) -> Result<AclId, Error> {
        if self.bootstrapped {
            return Ok(root);
        }
        for a in admins {
            check_identity(a)?;
        }
        root_acl
            .check()
            .map_err(|reason| Error::BadRequest { reason })?;
        self.admins = admins.iter().cloned().collect();
        self.bootstrapped = true;
        Ok(self.replace(root, root_acl.clone()))
    }

    /// Replaces (`Some`) or removes (`None`) a group, if `by` is an admin.
    pub fn set_group(
        &mut self,
        by: &str,
        name: &str,
        members: Option<&[String]>,
    ) -> Result<(), Error> {
        self.require_admin(by, "change groups")?;
        match members {
            Some(m) => {
                wire::acl::check_members(name, m).map_err(|reason| Error::BadRequest { reason })?;
                self.groups
                    .insert(name.to_string(), m.iter().cloned().collect());
            }
            None => {
                wire::acl::check_group_name(name).map_err(|reason| Error::BadRequest { reason })?;
                self.groups.remove(name);
            }
        }
        Ok(())
    }

    /// Adds or removes an admin, if `by` is one; the last admin stays (a cell without
    /// admins could never change an admin-only ACL again).
    pub fn set_admin(&mut self, by: &str, identity: &str, admin: bool) -> Result<(), Error> {
        self.require_admin(by, "change the cell's admins")?;
        check_identity(identity)?;
        if admin {
            self.admins.insert(identity.to_string());
        } else {
            if self.admins.len() == 1 && self.admins.contains(identity) {
                return Err(Error::BadRequest {
                    reason: format!(
                        "{identity} is the cell's last admin: add another admin before \
                         removing it"
                    ),
                });
            }
            self.admins.remove(identity);
        }
        Ok(())
    }

    fn require_admin(&self, by: &str, action: &str) -> Result<(), Error> {
        self.check_bootstrapped()?;
        if self.admins.contains(by) {
            Ok(())
        } else {
            Err(Error::NotAdmin {
                action: action.to_string(),
                identity: by.to_string(),
            })
        }
    }
}

#[cfg(test)]
impl Security {
    /// How many nodes use each ACL, by the table's own count.
    pub(crate) fn counts(&self) -> BTreeMap<AclId, u64> {
        self.acls.iter().map(|(id, e)| (*id, e.nodes)).collect()
    }
}

impl Default for Security {
    fn default() -> Self {
        Security::new()
    }
}

/// An identity URI in canonical form, or `BadRequest` saying what is wrong.
fn check_identity(s: &str) -> Result<(), Error> {
    let id = wire::identity::Identity::parse(s).map_err(|reason| Error::BadRequest { reason })?;
    if id.to_string() != s {
        return Err(Error::BadRequest {
            reason: format!("identity {s:?} is not in canonical form ({id})"),
        });
    }
    Ok(())
}
