//! The reads that arm a one-shot watch atomically with the read (data, existence,
//! children), and the binding of a watch to the session's event stream.

use std::sync::atomic::Ordering;

use wire::types::{NodeStat, Op, Reply, WatchKind};
use wire::Error;

use super::events::rearm;
use super::{into_error, Session};
use crate::watch::Watch;

impl Session {
    /// Reads a node and arms a one-shot watch on its data, atomically with the read: the
    /// watch fires on the next change or delete after what the read returned.
    pub async fn get_watch(&self, path: &str) -> Result<(Vec<u8>, NodeStat, Watch), Error> {
        wire::path::validate(path)?;
        let generation = self.inner.stream_generation.load(Ordering::SeqCst);
        let (id, w) = self
            .inner
            .watches
            .register(self.inner.id, path, WatchKind::Data);
        match self
            .read(Op::Get {
                path: path.into(),
                watch: true,
            })
            .await
        {
            Ok(Reply::Data { data, stat, index }) => {
                self.bind_watch(
                    id,
                    path,
                    WatchKind::Data,
                    WatchKind::Data,
                    index,
                    generation,
                );
                Ok((data, stat, w))
            }
            other => {
                self.inner.watches.cancel(id, path, WatchKind::Data);
                Err(into_error(other))
            }
        }
    }

    /// Binds a waiter to its read's index. If the event stream reconnected while the read
    /// was in flight, the watch may be armed at a replica that no longer leads (the
    /// re-arming at reconnection skipped it, since it was not bound yet): re-arm it here.
    fn bind_watch(
        &self,
        id: u64,
        path: &str,
        from: WatchKind,
        to: WatchKind,
        index: u64,
        generation: u64,
    ) {
        self.inner.watches.bind(id, path, from, to, index);
        if self.inner.stream_generation.load(Ordering::SeqCst) != generation {
            let inner = self.inner.clone();
            let spec = wire::types::WatchSpec {
                path: path.to_string(),
                kind: to,
                since_index: index,
            };
            wire::rt::spawn(async move {
                rearm(&inner, vec![spec]).await;
            });
        }
    }

    /// A node's metadata, with a one-shot watch: on its data or deletion if it exists, on
    /// its creation if it does not.
    pub async fn exists_watch(&self, path: &str) -> Result<(Option<NodeStat>, Watch), Error> {
        wire::path::validate(path)?;
        let generation = self.inner.stream_generation.load(Ordering::SeqCst);
        let (id, w) = self.inner.watches.register_exists(self.inner.id, path);
        match self
            .read(Op::Exists {
                path: path.into(),
                watch: true,
            })
            .await
        {
            Ok(Reply::Exists { stat, index }) => {
                let kind = if stat.is_some() {
                    WatchKind::Data
                } else {
                    WatchKind::Exists
                };
                self.bind_watch(id, path, WatchKind::Data, kind, index, generation);
                Ok((stat, w))
            }
            other => {
                self.inner.watches.cancel(id, path, WatchKind::Data);
                Err(into_error(other))
            }
        }
    }

    /// A node's children, with a one-shot watch on the set of children (and the node's
    /// deletion).
    pub async fn children_watch(
        &self,
        path: &str,
    ) -> Result<(Vec<(String, NodeStat)>, Watch), Error> {
        wire::path::validate(path)?;
        let generation = self.inner.stream_generation.load(Ordering::SeqCst);
        let (id, w) = self
            .inner
            .watches
            .register(self.inner.id, path, WatchKind::Children);
        match self
            .read(Op::Children {
                path: path.into(),
                watch: true,
            })
            .await
        {
            Ok(Reply::Children {
                children, index, ..
            }) => {
                self.bind_watch(
                    id,
                    path,
                    WatchKind::Children,
                    WatchKind::Children,
                    index,
                    generation,
                );
                Ok((children, w))
            }
            other => {
                self.inner.watches.cancel(id, path, WatchKind::Children);
                Err(into_error(other))
            }
        }
    }
}
