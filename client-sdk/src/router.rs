//! Many cells behind one namespace: a [`Router`] resolves each path's cell through the
//! directory (`docs/directory.md`) and hands the operation to that cell's session.
//!
//! The map of prefixes to cells is fetched from any directory instance and cached for
//! [`RouterConfig::map_ttl`] (minutes): it is never fetched on the path of an operation
//! whose prefix it already knows. The router keeps one [`Client`] and one [`Session`]
//! per cell it uses, opened on first use. An operation answered `WrongCell` (a stale
//! map: the prefix moved) or `Frozen` past the request's deadline makes the router fetch
//! the map again and send the operation where it now points, at most
//! [`ROUTE_ATTEMPTS`] times. A path whose prefix the cached map does not name makes it
//! fetch the map again, at most once a second ([`UNKNOWN_PREFIX_REFETCH`]). Only those definite refusals are re-sent elsewhere: any
//! other error (a timeout, whose write the old cell may have applied) is returned, since
//! sessions, and so the cell's deduplication of retries, do not move between cells.
//!
//! A client configured with a cell's own endpoints ([`Client`]) keeps working as before;
//! the router is for namespaces split over cells.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use wire::directory::DirectoryMap;
use wire::types::{CreateMode, NodeStat};
use wire::Error;

use crate::{Client, ClientConfig, Created, Session};

/// How many times one operation is sent, to the cell the map names each time.
pub const ROUTE_ATTEMPTS: u32 = 6;

/// How long one fetch of the map may take, retries over the instances included.
pub const DIRECTORY_TIMEOUT: Duration = Duration::from_secs(2);

/// A cached map that names no cell for a path is fetched again for it if it is at least
/// this old (a prefix placed since it was fetched), so unknown paths cost at most one
/// fetch a second.
pub const UNKNOWN_PREFIX_REFETCH: Duration = Duration::from_secs(1);

/// A [`Router`]'s settings.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// The directory instances' endpoints (`host:port`, tried in order).
    pub directory: Vec<String>,
    /// What every cell's client is made from (CA, certificate, key, timeouts); its
    /// endpoints are the cell's, from the map.
    pub client: ClientConfig,
    /// How long a fetched map is used without asking again (default 5 minutes); a
    /// `WrongCell` answer asks at once.
    pub map_ttl: Duration,
}

impl RouterConfig {
    /// Directory endpoints and a client template (see [`ClientConfig::new`]).
    pub fn new(directory: Vec<String>, client: ClientConfig) -> RouterConfig {
        RouterConfig {
            directory,
            client,
            map_ttl: Duration::from_secs(300),
        }
    }
}

/// Routes operations to the cell that owns each path (module docs).
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

/// What a [`Router`] reports as it goes ([`Router::events`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterEvent {
    /// An event of the router's session in `cell` (jeopardy, safe, expired, fail-over).
    Session {
        /// The cell.
        cell: String,
        /// The session's event.
        event: crate::SessionEvent,
    },
    /// A prefix moved (a map fetched names another cell or a new epoch for it): its
    /// ephemeral nodes, locks and watches in the old cell are gone; start them again in
    /// the new one (a fail-over, for that prefix).
    Moved {
        /// The prefix.
        prefix: String,
        /// The cell it was in, as the previous map said.
        from: String,
        /// The cell it is in now.
        to: String,
        /// Its epoch now.
        epoch: u64,
    },
}

/// What a [`Router`] has met so far ([`Router::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Answers `WrongCell`: the map was stale (each one made the router fetch it again).
    pub wrong_cell: u64,
    /// Answers `Frozen` past a request's deadline (a prefix being moved).
    pub frozen: u64,
    /// Fetches of the map.
    pub map_fetches: u64,
}

struct Inner {
    cfg: RouterConfig,
    wrong_cell: std::sync::atomic::AtomicU64,
    frozen: std::sync::atomic::AtomicU64,
    map_fetches: std::sync::atomic::AtomicU64,
    events: tokio::sync::broadcast::Sender<RouterEvent>,
    directory: Client,
    /// The map, when it was fetched, and the fetch's number (a fetch answered late
    /// never replaces a newer one's map).
    map: RwLock<Option<(DirectoryMap, Instant, u64)>>,
    fetches_started: std::sync::atomic::AtomicU64,
    cells: tokio::sync::Mutex<HashMap<String, (Client, Session)>>,
}

impl Router {
    /// Connects to the directory and fetches the map (an error if no instance answers).
    pub async fn connect(cfg: RouterConfig) -> Result<Router, Error> {
        let mut dcfg = cfg.client.clone();
        dcfg.endpoints = cfg.directory.clone();
        dcfg.directory = true;
        dcfg.cell = None;
        // A map fetch that fails leaves the cached map in use: it must not hold an
        // operation up for a whole request timeout per attempt.
        dcfg.request_timeout = dcfg.request_timeout.min(DIRECTORY_TIMEOUT);
        dcfg.attempt_timeout = dcfg.attempt_timeout.min(DIRECTORY_TIMEOUT);
        let directory = Client::connect(dcfg).await?;
        let router = Router {
            inner: Arc::new(Inner {
                cfg,
                wrong_cell: Default::default(),
                frozen: Default::default(),
                map_fetches: Default::default(),
                events: tokio::sync::broadcast::channel(256).0,
                directory,
                map: RwLock::new(None),
                fetches_started: Default::default(),
                cells: tokio::sync::Mutex::new(HashMap::new()),
            }),
        };
        router.refresh().await?;
        Ok(router)
    }

    /// The map as last fetched, fetched again if older than the TTL (the cached one is
    /// kept, and returned, while no directory instance answers).
    pub async fn map(&self) -> Result<DirectoryMap, Error> {
        let cached = self.inner.map.read().expect("map lock").clone();
        match cached {
            Some((m, at, _)) if at.elapsed() < self.inner.cfg.map_ttl => Ok(m),
            Some((m, _, _)) => match self.refresh().await {
                Ok(fresh) => Ok(fresh),
                Err(e) => {
                    tracing::warn!("directory unreachable, the cached map stays: {e}");
                    Ok(m)
                }
            },
            None => self.refresh().await,
        }
    }

    /// The router's events: each cell's session events, and prefixes that moved. Subscribe
    /// before the operations whose events matter.
    pub fn events(&self) -> tokio::sync::broadcast::Receiver<RouterEvent> {
        self.inner.events.subscribe()
    }

    /// What this router has met so far.
    pub fn stats(&self) -> RouterStats {
        use std::sync::atomic::Ordering::Relaxed;
        RouterStats {
            wrong_cell: self.inner.wrong_cell.load(Relaxed),
            frozen: self.inner.frozen.load(Relaxed),
            map_fetches: self.inner.map_fetches.load(Relaxed),
        }
    }

    /// Fetches the map now.
    pub async fn refresh(&self) -> Result<DirectoryMap, Error> {
        self.inner
            .map_fetches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let number = self
            .inner
            .fetches_started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let m = self.inner.directory.directory().await?;
        let before = {
            let mut held = self.inner.map.write().expect("map lock");
            match held.as_ref() {
                // A later fetch answered first: its map stays.
                Some((newer, _, n)) if *n > number => return Ok(newer.clone()),
                _ => held.replace((m.clone(), Instant::now(), number)),
            }
        };
        if let Some((old, _, _)) = before {
            for e in &m.prefixes {
                if let Some(o) = old.prefixes.iter().find(|o| o.prefix == e.prefix) {
                    if (o.cell != e.cell || o.epoch != e.epoch) && e.epoch > o.epoch {
                        let _ = self.inner.events.send(RouterEvent::Moved {
                            prefix: e.prefix.clone(),
                            from: o.cell.clone(),
                            to: e.cell.clone(),
                            epoch: e.epoch,
                        });
                    }
                }
            }
        }
        Ok(m)
    }

    /// [`Router::map`], fetched again if it names no cell for `path` and is at least
    /// [`UNKNOWN_PREFIX_REFETCH`] old (the prefix may have been placed since).
    async fn map_for(&self, path: &str) -> Result<DirectoryMap, Error> {
        let map = self.map().await?;
        if map.entry_for(path).is_some() {
            return Ok(map);
        }
        let age = self
            .inner
            .map
            .read()
            .expect("map lock")
            .as_ref()
            .map(|(_, at, _)| at.elapsed());
        if age.is_some_and(|a| a >= UNKNOWN_PREFIX_REFETCH) {
            return self.refresh().await;
        }
        Ok(map)
    }

    /// The cell the map names for `path`.
    pub async fn cell_of(&self, path: &str) -> Result<String, Error> {
        wire::path::validate(path)?;
        let map = self.map_for(path).await?;
        map.entry_for(path)
            .map(|e| e.cell.clone())
            .ok_or_else(|| Error::NoNode {
                path: format!(
                    "{} (the directory maps no cell for this prefix)",
                    wire::directory::prefix_of(path).unwrap_or(path)
                ),
            })
    }

    /// The session this router holds in the cell of `path`, opened on first use.
    pub async fn session_for(&self, path: &str) -> Result<Session, Error> {
        wire::path::validate(path)?;
        let map = self.map_for(path).await?;
        let entry = map.entry_for(path).ok_or_else(|| Error::NoNode {
            path: format!(
                "{} (the directory maps no cell for this prefix)",
                wire::directory::prefix_of(path).unwrap_or(path)
            ),
        })?;
        let cell = entry.cell.clone();
        {
            let cells = self.inner.cells.lock().await;
            if let Some((_, s)) = cells.get(&cell) {
                if s.state() != crate::SessionState::Expired {
                    return Ok(s.clone());
                }
            }
        }
        let info = map.cell(&cell).ok_or_else(|| Error::Unavailable {
            reason: format!("the directory names cell {cell:?} but does not describe it"),
        })?;
        // Connected outside the lock: a cell that does not answer holds up only the
        // operations bound for it.
        let mut ccfg = self.inner.cfg.client.clone();
        ccfg.endpoints = info.endpoints.clone();
        ccfg.directory = false;
        // The servers there must be that cell's.
        ccfg.cell = Some(cell.clone());
        let client = Client::connect(ccfg).await?;
        let session = client.open_session().await?;
        let mut cells = self.inner.cells.lock().await;
        match cells.get(&cell) {
            // Another operation opened one meanwhile: use it, close this one.
            Some((_, s)) if s.state() != crate::SessionState::Expired => {
                let s = s.clone();
                drop(cells);
                let _ = session.close().await;
                Ok(s)
            }
            _ => {
                // The session's events, as the router's, until the session ends.
                let mut rx = session.events();
                let (tx, name) = (self.inner.events.clone(), cell.clone());
                wire::rt::spawn(async move {
                    loop {
                        let event = match rx.recv().await {
                            Ok(e) => e,
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                        };
                        let expired = event == crate::SessionEvent::Expired;
                        let _ = tx.send(RouterEvent::Session {
                            cell: name.clone(),
                            event,
                        });
                        if expired {
                            return;
                        }
                    }
                });
                cells.insert(cell, (client, session.clone()));
                Ok(session)
            }
        }
    }

    /// The cells this router holds sessions in, with their sessions (subscribe to each
    /// one's [`Session::events`] for its events).
    pub async fn sessions(&self) -> Vec<(String, Session)> {
        let cells = self.inner.cells.lock().await;
        let mut v: Vec<_> = cells
            .iter()
            .map(|(c, (_, s))| (c.clone(), s.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Runs `op` under the session of `path`'s cell; on `WrongCell` or `Frozen`, fetches
    /// the map again and runs it where the map then points.
    pub async fn routed<T, F, Fut>(&self, path: &str, op: F) -> Result<T, Error>
    where
        F: Fn(Session) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let mut last = None;
        for attempt in 0..ROUTE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(50 << attempt.min(5))).await;
                if let Err(e) = self.refresh().await {
                    tracing::warn!("directory unreachable while rerouting {path}: {e}");
                }
            }
            let session = self.session_for(path).await?;
            match op(session).await {
                Err(e @ (Error::WrongCell { .. } | Error::Frozen { .. })) => {
                    let counter = match e {
                        Error::WrongCell { .. } => &self.inner.wrong_cell,
                        _ => &self.inner.frozen,
                    };
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    last = Some(e);
                }
                r => return r,
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// [`Session::get`] in the path's cell.
    pub async fn get(&self, path: &str) -> Result<(Vec<u8>, NodeStat), Error> {
        self.routed(path, |s| async move { s.get(path).await })
            .await
    }

    /// [`Session::children`] in the path's cell.
    pub async fn children(&self, path: &str) -> Result<Vec<(String, NodeStat)>, Error> {
        self.routed(path, |s| async move { s.children(path).await })
            .await
    }

    /// [`Session::create`] in the path's cell.
    pub async fn create(
        &self,
        path: &str,
        data: Vec<u8>,
        mode: CreateMode,
    ) -> Result<Created, Error> {
        self.routed(path, |s| {
            let data = data.clone();
            async move { s.create(path, data, mode).await }
        })
        .await
    }

    /// [`Session::set_data`] in the path's cell.
    pub async fn set_data(
        &self,
        path: &str,
        data: Vec<u8>,
        version: Option<u64>,
    ) -> Result<NodeStat, Error> {
        self.routed(path, |s| {
            let data = data.clone();
            async move { s.set_data(path, data, version).await }
        })
        .await
    }

    /// [`Session::delete`] in the path's cell.
    pub async fn delete(&self, path: &str, version: Option<u64>) -> Result<(), Error> {
        self.routed(path, |s| async move { s.delete(path, version).await })
            .await
    }

    /// Closes every session this router holds.
    pub async fn close(&self) {
        let cells = std::mem::take(&mut *self.inner.cells.lock().await);
        for (_, (_, s)) in cells {
            let _ = s.close().await;
        }
    }
}
