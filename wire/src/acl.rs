//! Access control lists: who may read a node, write it, create children under it, and
//! change its ACL (`docs/security.md`, "ACLs").
//!
//! The model is Chubby's (a node names who may do what; a new node inherits its parent's
//! ACL), with ZooKeeper's separate create right and etcd's groups as named sets of
//! identities. An entry ([`Principal`]) is one identity (`lock://client/payments-api`), a
//! prefix of identities ending in `*` (`lock://client/payments-*`), a group
//! (`group:payments`) or everyone (`*`).
//!
//! This module is the vocabulary and the rule ([`Acl::allows`]); where the ACLs live (the
//! replicated state, interned) and who is an admin are the replica's.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::identity::{Identity, NAME_BYTES_MAX, SCHEME};

/// Most entries one right of an ACL may list.
pub const ACL_ENTRIES_MAX: usize = 64;

/// Most members one group may have.
pub const GROUP_MEMBERS_MAX: usize = 1024;

/// The prefix that marks a group in an ACL entry (`group:payments`).
pub const GROUP_PREFIX: &str = "group:";

/// What an ACL grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Right {
    /// Get, exists, list children, watch, cached reads.
    Read,
    /// Set the node's data, delete it.
    Write,
    /// Create children under it (ephemeral and sequential ones too: taking a lock,
    /// joining a group).
    Create,
    /// Change the node's ACL.
    Admin,
}

impl Right {
    /// Every right, in the order an ACL lists them.
    pub const ALL: [Right; 4] = [Right::Read, Right::Write, Right::Create, Right::Admin];

    /// The right's name: `read`, `write`, `create` or `admin`.
    pub fn name(self) -> &'static str {
        match self {
            Right::Read => "read",
            Right::Write => "write",
            Right::Create => "create",
            Right::Admin => "admin",
        }
    }
}

impl fmt::Display for Right {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One entry of an ACL: whom it names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Principal {
    /// `*`: every identity the cell admits.
    Everyone,
    /// One identity, as its certificate's URI (`lock://client/payments-api`).
    Identity(String),
    /// Every identity that starts with this text (written with a trailing `*`:
    /// `lock://client/payments-*` is the prefix `lock://client/payments-`).
    IdentityPrefix(String),
    /// Every member of the named group (written `group:<name>`).
    Group(String),
}

/// A group's name: 1 to [`NAME_BYTES_MAX`] bytes of lowercase ASCII letters, digits, `.`,
/// `_` and `-` (the characters of an identity's parts).
pub fn check_group_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(format!(
            "group name {name:?}: it must be 1 to {NAME_BYTES_MAX} characters"
        ));
    }
    if let Some(c) = crate::identity::first_bad_name_char(name) {
        return Err(format!(
            "group name {name:?} may hold only lowercase letters, digits, '.', '_' and '-', \
             not {c:?}"
        ));
    }
    Ok(())
}

impl Principal {
    /// Parses `*`, `group:<name>`, an identity URI, or an identity prefix ending in `*`;
    /// the error says what is wrong.
    pub fn parse(s: &str) -> Result<Principal, String> {
        if s == "*" {
            return Ok(Principal::Everyone);
        }
        if let Some(name) = s.strip_prefix(GROUP_PREFIX) {
            check_group_name(name)?;
            return Ok(Principal::Group(name.to_string()));
        }
        if let Some(prefix) = s.strip_suffix('*') {
            if !prefix.starts_with(SCHEME) {
                return Err(format!(
                    "{s:?}: an identity prefix must start with {SCHEME:?} (or use \"*\" for \
                     everyone)"
                ));
            }
            if prefix.contains('*') {
                return Err(format!("{s:?}: '*' may only end an identity prefix"));
            }
            // The longest identity: `lock://<cell>/replica/<name>`.
            let longest = SCHEME.len() + 2 * NAME_BYTES_MAX + "/replica/".len();
            if prefix.len() > longest {
                return Err(format!(
                    "{s:?}: an identity prefix longer than any identity ({longest} bytes)"
                ));
            }
            if let Some(c) = prefix[SCHEME.len()..]
                .split('/')
                .find_map(crate::identity::first_bad_name_char)
            {
                return Err(format!(
                    "{s:?}: an identity prefix may hold only lowercase letters, digits, '.', \
                     '_', '-' and '/', not {c:?}"
                ));
            }
            return Ok(Principal::IdentityPrefix(prefix.to_string()));
        }
        let id = Identity::parse(s)?;
        Ok(Principal::Identity(id.to_string()))
    }

    /// Checks an entry that arrived decoded (not parsed): the same rules as
    /// [`Principal::parse`].
    pub fn check(&self) -> Result<(), String> {
        let reparsed = Principal::parse(&self.to_string())?;
        if &reparsed != self {
            return Err(format!("ACL entry {self} is not in its canonical form"));
        }
        Ok(())
    }

    /// True when the entry names `identity`; `in_group(group, identity)` says whether an
    /// identity is a member of a group.
    pub fn names(&self, identity: &str, in_group: &dyn Fn(&str, &str) -> bool) -> bool {
        match self {
            Principal::Everyone => true,
            Principal::Identity(id) => id == identity,
            Principal::IdentityPrefix(prefix) => identity.starts_with(prefix.as_str()),
            Principal::Group(group) => in_group(group, identity),
        }
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Principal::Everyone => f.write_str("*"),
            Principal::Identity(id) => f.write_str(id),
            Principal::IdentityPrefix(prefix) => write!(f, "{prefix}*"),
            Principal::Group(name) => write!(f, "{GROUP_PREFIX}{name}"),
        }
    }
}

impl std::str::FromStr for Principal {
    type Err = String;
    fn from_str(s: &str) -> Result<Principal, String> {
        Principal::parse(s)
    }
}

/// A node's ACL: for each right, the entries it is granted to. An empty list grants the
/// right to nobody but the cell's admins.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Acl {
    /// Who may read.
    pub read: Vec<Principal>,
    /// Who may write and delete.
    pub write: Vec<Principal>,
    /// Who may create children.
    pub create: Vec<Principal>,
    /// Who may change the ACL.
    pub admin: Vec<Principal>,
}

impl Acl {
    /// Every right to everyone (the root of a development cell).
    pub fn everyone() -> Acl {
        let all = vec![Principal::Everyone];
        Acl {
            read: all.clone(),
            write: all.clone(),
            create: all.clone(),
            admin: all,
        }
    }

    /// No right to anyone but the cell's admins (the root of a production cell).
    pub fn admins_only() -> Acl {
        Acl::default()
    }

    /// The entries granted `right`.
    pub fn entries(&self, right: Right) -> &[Principal] {
        match right {
            Right::Read => &self.read,
            Right::Write => &self.write,
            Right::Create => &self.create,
            Right::Admin => &self.admin,
        }
    }

    fn entries_mut(&mut self, right: Right) -> &mut Vec<Principal> {
        match right {
            Right::Read => &mut self.read,
            Right::Write => &mut self.write,
            Right::Create => &mut self.create,
            Right::Admin => &mut self.admin,
        }
    }

    /// True when the ACL grants `right` to `identity` (admins are the caller's to check:
    /// they pass every ACL).
    pub fn allows(
        &self,
        right: Right,
        identity: &str,
        in_group: &dyn Fn(&str, &str) -> bool,
    ) -> bool {
        self.entries(right)
            .iter()
            .any(|p| p.names(identity, in_group))
    }

    /// The same ACL with each right's entries sorted and without repeats, so that two
    /// ACLs that grant the same are equal (and share one copy in the replicated state).
    pub fn canonical(mut self) -> Acl {
        for right in Right::ALL {
            let list = self.entries_mut(right);
            list.sort();
            list.dedup();
            if list.contains(&Principal::Everyone) {
                *list = vec![Principal::Everyone];
            }
        }
        self
    }

    /// Checks an ACL from a request: at most [`ACL_ENTRIES_MAX`] entries per right, each
    /// valid. The error names the right and the entry.
    pub fn check(&self) -> Result<(), String> {
        for right in Right::ALL {
            let list = self.entries(right);
            if list.len() > ACL_ENTRIES_MAX {
                return Err(format!(
                    "the {right} right lists {} entries; at most {ACL_ENTRIES_MAX}",
                    list.len()
                ));
            }
            for p in list {
                p.check().map_err(|e| format!("the {right} right: {e}"))?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for Acl {
    /// `read=a,b write=c create= admin=d`: each right with its entries, comma-separated.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, right) in Right::ALL.into_iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{right}=")?;
            for (j, p) in self.entries(right).iter().enumerate() {
                if j > 0 {
                    f.write_str(",")?;
                }
                write!(f, "{p}")?;
            }
        }
        Ok(())
    }
}

/// Checks a group's members from a request: at most [`GROUP_MEMBERS_MAX`], each an
/// identity URI (a group lists identities, not prefixes or other groups, so membership is
/// one lookup and cannot loop).
pub fn check_members(group: &str, members: &[String]) -> Result<(), String> {
    check_group_name(group)?;
    if members.len() > GROUP_MEMBERS_MAX {
        return Err(format!(
            "group {group:?} lists {} members; at most {GROUP_MEMBERS_MAX}",
            members.len()
        ));
    }
    for m in members {
        let id = Identity::parse(m).map_err(|e| format!("group {group:?}: {e}"))?;
        if &id.to_string() != m {
            return Err(format!(
                "group {group:?}: member {m:?} is not in canonical form"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_groups(_: &str, _: &str) -> bool {
        false
    }

    #[test]
    fn entries_parse_and_print_back() {
        for s in [
            "*",
            "group:payments",
            "lock://client/payments-api",
            "lock://client/payments-*",
            "lock://cell-a/proxy/*",
            "lock://*",
        ] {
            let p = Principal::parse(s).unwrap();
            assert_eq!(p.to_string(), s);
            p.check().unwrap();
        }
        assert_eq!(
            Principal::parse("lock://client/payments-*").unwrap(),
            Principal::IdentityPrefix("lock://client/payments-".into())
        );
    }

    #[test]
    fn bad_entries_are_refused_with_a_reason() {
        for (s, says) in [
            ("", "not an identity"),
            ("payments", "not an identity"),
            ("group:", "1 to"),
            ("group:Payments", "lowercase"),
            ("lock://client/pay*ments*", "may only end"),
            ("client/*", "must start with"),
            ("lock://client/PAY*", "lowercase"),
            ("lock://client/a/b", "not an identity"),
        ] {
            let e = Principal::parse(s).unwrap_err();
            assert!(e.contains(says), "{s:?}: {e}");
        }
        // A decoded entry gets the same rules.
        assert!(Principal::Identity("lock://client/A".into())
            .check()
            .is_err());
        assert!(Principal::Group("".into()).check().is_err());
        assert!(Principal::IdentityPrefix("http://".into()).check().is_err());
    }

    #[test]
    fn an_acl_grants_what_it_lists_and_nothing_else() {
        let acl = Acl {
            read: vec![Principal::Group("payments".into())],
            write: vec![Principal::parse("lock://client/payments-api").unwrap()],
            create: vec![Principal::parse("lock://client/payments-*").unwrap()],
            admin: vec![],
        };
        let in_group = |g: &str, id: &str| g == "payments" && id == "lock://client/auditor";
        let api = "lock://client/payments-api";
        let worker = "lock://client/payments-worker";
        let auditor = "lock://client/auditor";
        let other = "lock://client/search";
        assert!(acl.allows(Right::Read, auditor, &in_group));
        assert!(!acl.allows(Right::Read, api, &in_group));
        assert!(acl.allows(Right::Write, api, &in_group));
        assert!(!acl.allows(Right::Write, worker, &in_group));
        assert!(acl.allows(Right::Create, worker, &in_group));
        assert!(acl.allows(Right::Create, api, &in_group));
        assert!(!acl.allows(Right::Create, auditor, &in_group));
        for right in Right::ALL {
            assert!(!acl.allows(right, other, &in_group), "{right}");
        }
        // Nobody is listed for admin: only the cell's admins may change this ACL.
        for id in [api, worker, auditor, other] {
            assert!(!acl.allows(Right::Admin, id, &in_group), "{id}");
        }
        // A prefix is a prefix of the whole URI: it does not reach another role or cell.
        let p = Principal::parse("lock://client/pay*").unwrap();
        assert!(p.names("lock://client/payments", &no_groups));
        assert!(!p.names("lock://client/search", &no_groups));
        assert!(!p.names("lock://pay/proxy/x", &no_groups));
        assert!(Acl::everyone().allows(Right::Admin, other, &no_groups));
        assert!(!Acl::admins_only().allows(Right::Read, other, &no_groups));
    }

    #[test]
    fn canonical_acls_that_grant_the_same_are_equal() {
        let a = Acl {
            read: vec![
                Principal::Group("b".into()),
                Principal::Group("a".into()),
                Principal::Group("b".into()),
            ],
            write: vec![Principal::Group("a".into()), Principal::Everyone],
            ..Acl::default()
        };
        let b = Acl {
            read: vec![Principal::Group("a".into()), Principal::Group("b".into())],
            write: vec![Principal::Everyone],
            ..Acl::default()
        };
        assert_eq!(a.clone().canonical(), b.clone().canonical());
        assert_ne!(a, b);
        assert_eq!(b.to_string(), "read=group:a,group:b write=* create= admin=");
    }

    #[test]
    fn acl_and_group_bounds() {
        let many = vec![Principal::Everyone; ACL_ENTRIES_MAX + 1];
        let acl = Acl {
            create: many,
            ..Acl::default()
        };
        let e = acl.check().unwrap_err();
        assert!(
            e.contains("create right") && e.contains("at most 64"),
            "{e}"
        );
        let bad = Acl {
            admin: vec![Principal::Identity("lock://nobody".into())],
            ..Acl::default()
        };
        assert!(bad.check().unwrap_err().contains("admin right"));
        Acl::everyone().check().unwrap();

        check_members(
            "ops",
            &["lock://client/a".into(), "lock://c/proxy/p".into()],
        )
        .unwrap();
        assert!(check_members("ops", &["lock://client/*".into()]).is_err());
        assert!(check_members("Ops", &[]).is_err());
        let members: Vec<String> = (0..=GROUP_MEMBERS_MAX)
            .map(|i| format!("lock://client/m{i}"))
            .collect();
        assert!(check_members("ops", &members)
            .unwrap_err()
            .contains("at most"));
    }
}
