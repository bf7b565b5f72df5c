//! ACLs, groups and admins: reads of them, and the commands that change them (checked at
//! apply, against the state they apply to; see `state_machine::security`).

use super::*;

impl Gateway {
    /// A node's ACL, for an identity that may read the node or administer it.
    pub(super) async fn get_acl(&self, me: &Acting, p: &str) -> Response {
        path::validate(p)?;
        self.gate.confirm().await?;
        let s = self.state.read().expect("state lock");
        let acl = s.sm.acl_of(p)?.clone();
        if let Err(read) = s.sm.check_read(&me.identity, p) {
            // The admin right shows it too; refused, the read right is what is named.
            s.sm.check_right(&me.identity, p, wire::acl::Right::Admin)
                .map_err(|_| read)?;
        }
        Ok(Reply::Acl {
            acl,
            index: s.sm.last_index(),
        })
    }

    /// The admins and groups (any identity may read them).
    pub(super) async fn security(&self) -> Response {
        self.gate.confirm().await?;
        let s = self.state.read().expect("state lock");
        let sec = s.sm.security();
        sec.check_bootstrapped()?;
        Ok(Reply::Security {
            admins: sec.admins().cloned().collect(),
            groups: sec
                .groups()
                .map(|(g, m)| (g.clone(), m.iter().cloned().collect()))
                .collect(),
            index: s.sm.last_index(),
        })
    }

    /// Replaces a node's ACL: held like a write to the node, so cached copies are dropped
    /// before it commits (a cache must not go on serving a node to an identity the new
    /// ACL no longer lets read it).
    pub(super) async fn set_acl(&self, me: &Acting, p: String, acl: wire::acl::Acl) -> Response {
        path::validate(&p)?;
        acl.check().map_err(|reason| Error::BadRequest { reason })?;
        // Refused early when the state already says no; decided at apply.
        {
            let s = self.state.read().expect("state lock");
            s.sm.check_owned(&p, true)?;
            s.sm.check_right(&me.identity, &p, wire::acl::Right::Admin)?;
        }
        let cmd = Command::SetAcl {
            by: me.identity.clone(),
            path: p.clone(),
            acl,
        };
        self.propose_held(vec![p], cmd).await
    }

    /// Refuses `me` unless it is a cell admin in this replica's applied state (membership
    /// changes and snapshots, which are not log commands checked at apply).
    pub(super) async fn require_admin_confirmed(
        &self,
        me: &Acting,
        action: &str,
    ) -> Result<(), Error> {
        // As a leader that has applied every committed entry (an admin's removal
        // committed before is applied by then).
        self.gate.confirm().await?;
        self.require_admin(me, action)
    }

    /// [`Gateway::require_admin_confirmed`] at this replica's applied state, whatever
    /// its role (a snapshot is asked of every replica).
    pub(super) fn require_admin(&self, me: &Acting, action: &str) -> Result<(), Error> {
        let s = self.state.read().expect("state lock");
        s.sm.security().check_bootstrapped()?;
        if s.sm.security().is_admin(&me.identity) {
            Ok(())
        } else {
            Err(Error::NotAdmin {
                action: action.to_string(),
                identity: me.identity.clone(),
            })
        }
    }

    /// A group or admin change: admins only, decided at apply.
    pub(super) async fn change_security(&self, cmd: Command) -> Response {
        match &cmd {
            Command::SetGroup {
                name,
                members: Some(m),
                ..
            } => wire::acl::check_members(name, m),
            Command::SetGroup { name, .. } => wire::acl::check_group_name(name),
            Command::SetAdmin { identity, .. } => {
                wire::identity::Identity::parse(identity).map(|_| ())
            }
            _ => Ok(()),
        }
        .map_err(|reason| Error::BadRequest { reason })?;
        self.propose(cmd).await
    }
}
