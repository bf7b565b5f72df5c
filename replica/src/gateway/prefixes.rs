//! The prefixes this cell owns, and the operations a move (`lockctl dir move`) asks of
//! a cell: freeze, export, import, hand over, drop (`wire::directory`,
//! `state_machine/prefixes.rs`).

use wire::directory::{check_prefix, PrefixState, IMPORT_BYTES_MAX};

use super::*;

impl Gateway {
    /// The prefixes recorded here (linearizable; any identity).
    pub(super) async fn prefixes(&self) -> Response {
        self.gate.confirm().await?;
        let s = self.state.read().expect("state lock");
        Ok(Reply::Prefixes {
            prefixes: s.sm.prefixes(),
            index: s.sm.last_index(),
        })
    }

    /// Records a prefix's state (admins; decided at apply). Any state but owned is held
    /// like a write to every node of the prefix, cached or not: once it applies, no copy
    /// cached from this cell is left, and none is granted until the prefix is owned
    /// again. The first prefix a cell records is held like a write to every node (the
    /// cell stops serving all other paths).
    pub(super) async fn set_prefix(
        &self,
        me: &Acting,
        prefix: String,
        epoch: u64,
        state: PrefixState,
    ) -> Response {
        check_prefix(&prefix)?;
        self.require_admin(me, "change the prefixes a cell owns")?;
        let first = self
            .state
            .read()
            .expect("state lock")
            .sm
            .prefixes()
            .is_empty();
        let hold = if first {
            vec![crate::leader::cachers::ALL.to_string()]
        } else if state != PrefixState::Owned {
            vec![crate::leader::cachers::prefix_hold(&prefix)]
        } else {
            Vec::new()
        };
        self.propose_held(
            hold,
            Command::SetPrefix {
                by: me.identity.clone(),
                prefix,
                epoch,
                state,
            },
        )
        .await
    }

    /// A page of the prefix's persistent nodes (admins; linearizable; only while the
    /// prefix is frozen here).
    pub(super) async fn export_prefix(
        &self,
        me: &Acting,
        prefix: String,
        after: Option<String>,
    ) -> Response {
        check_prefix(&prefix)?;
        self.require_admin_confirmed(me, "export a prefix").await?;
        let s = self.state.read().expect("state lock");
        // A copy taken while writes go on would miss them: frozen first.
        let frozen =
            s.sm.prefixes()
                .into_iter()
                .any(|r| r.prefix == prefix && r.state == PrefixState::Frozen);
        if !frozen {
            return Err(Error::BadRequest {
                reason: format!("{prefix} is exported only while frozen for a move"),
            });
        }
        let (nodes, more) = s.sm.export(&prefix, after.as_deref(), IMPORT_BYTES_MAX);
        Ok(Reply::Exported {
            nodes,
            more,
            index: s.sm.last_index(),
        })
    }

    /// Imports or drops nodes of a prefix (admins; decided at apply).
    pub(super) async fn change_prefix_nodes(&self, me: &Acting, cmd: Command) -> Response {
        let hold = match &cmd {
            Command::ImportPrefix { prefix, .. } | Command::DropPrefix { prefix, .. } => {
                check_prefix(prefix)?;
                vec![crate::leader::cachers::prefix_hold(prefix)]
            }
            _ => Vec::new(),
        };
        self.require_admin(me, "import or drop a prefix")?;
        // Nothing of a prefix being imported or dropped is cachable here (it is not
        // owned); held anyway, so that is not this command's premise.
        self.propose_held(hold, cmd).await
    }
}
