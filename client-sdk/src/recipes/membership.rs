//! Group membership: each member is an ephemeral child of the group node, so a member that
//! dies leaves the group one lease later; the member list is read with a watch.
//!
//! ```no_run
//! # async fn demo(session: client_sdk::Session) -> Result<(), client_sdk::Error> {
//! use client_sdk::recipes::membership::Group;
//! let group = Group::new(&session, "/services/indexer/members");
//! group.join("worker-7", b"10.0.0.7:8080".to_vec()).await?;
//! let (members, changed) = group.members_watch().await?;
//! println!("{} members", members.len());
//! changed.await?; // someone joined or left
//! # Ok(()) }
//! ```

use wire::types::{CreateMode, NodeStat, Op};
use wire::{path, Error};

use crate::recipes::Pending;
use crate::session::Session;
use crate::watch::Watch;

/// A group at a path.
#[derive(Clone)]
pub struct Group {
    session: Session,
    path: String,
}

/// One member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name (the child node's name).
    pub name: String,
    /// Its node's metadata (`ephemeral_owner` is its session).
    pub stat: NodeStat,
}

impl Group {
    /// The group at `path` (created on first join if missing; its parent must exist).
    pub fn new(session: &Session, path: &str) -> Group {
        Group {
            session: session.clone(),
            path: path.to_string(),
        }
    }

    /// Joins as `name` with `data`; the membership lasts as long as this session. One
    /// write when the group exists (the usual case); the group is created on first use.
    ///
    /// A join whose answer is lost (the cell unreachable, a leader change) is asked again
    /// under the same request id until the cell answers, so it joins once and never fails
    /// with `NodeExists` on its own member; it ends only with an answer or the session's
    /// end. Bound it with a timeout if needed: a join whose future is dropped before it
    /// returns leaves no member behind (its node, if the create applied, is deleted in
    /// the background once the cell answers). A new join under the same name right after
    /// a dropped one may still find that node and fail with `NodeExists`.
    pub async fn join(&self, name: &str, data: Vec<u8>) -> Result<(), Error> {
        let create = Op::Create {
            path: path::join(&self.path, name),
            data,
            mode: CreateMode {
                ephemeral: true,
                sequential: false,
            },
        };
        let mut member = Pending::new(&self.session);
        match member.create(create.clone(), None).await {
            Err(Error::NoNode { path }) if path == self.path => {
                match self
                    .session
                    .create(&self.path, Vec::new(), CreateMode::default())
                    .await
                {
                    Ok(_) | Err(Error::NodeExists { .. }) => {}
                    Err(e) => return Err(e),
                }
                member.create(create, None).await?;
            }
            r => {
                r?;
            }
        }
        member.settle();
        Ok(())
    }

    /// Leaves the group.
    pub async fn leave(&self, name: &str) -> Result<(), Error> {
        match self
            .session
            .delete(&path::join(&self.path, name), None)
            .await
        {
            Ok(()) | Err(Error::NoNode { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The members now (linearizable), in name order.
    pub async fn members(&self) -> Result<Vec<Member>, Error> {
        match self.session.children(&self.path).await {
            Ok(kids) => Ok(kids
                .into_iter()
                .map(|(name, stat)| Member { name, stat })
                .collect()),
            Err(Error::NoNode { .. }) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// The members now and a watch that fires when anyone joins or leaves.
    pub async fn members_watch(&self) -> Result<(Vec<Member>, Watch), Error> {
        let (kids, w) = self.session.children_watch(&self.path).await?;
        Ok((
            kids.into_iter()
                .map(|(name, stat)| Member { name, stat })
                .collect(),
            w,
        ))
    }

    /// One member's data.
    pub async fn member_data(&self, name: &str) -> Result<Vec<u8>, Error> {
        Ok(self.session.get(&path::join(&self.path, name)).await?.0)
    }
}
