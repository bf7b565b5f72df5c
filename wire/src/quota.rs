//! Limits per identity: how many connections, requests in flight and sessions one client
//! identity may hold at a server, so one runaway client (the seed's "blast radius")
//! cannot take what the others need (`docs/security.md`, "Limits per identity").
//!
//! [`Quotas`] counts connections and requests in flight per identity, with a guard per
//! connection or request that gives its place back when dropped; sessions are counted by
//! whoever knows them (a replica's state, a proxy's table) and checked with
//! [`Quotas::check_sessions`]. A refusal is [`Error::TooManyFor`] and a counter
//! ([`Quotas::refusals`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::Error;

/// What is limited per identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Limited {
    /// Connections open at once.
    Connections,
    /// Requests in flight at once (KeepAlives and acknowledgements are never counted).
    Requests,
    /// Sessions open at once.
    Sessions,
}

impl std::fmt::Display for Limited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limited::Connections => "connections",
            Limited::Requests => "requests in flight",
            Limited::Sessions => "sessions",
        })
    }
}

/// A limit that is never met: the largest a TOML configuration can hold (its integers
/// are signed 64-bit).
pub const UNLIMITED: u64 = i64::MAX as u64;

/// One identity's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    /// Connections open at once.
    pub connections: u64,
    /// Requests in flight at once.
    pub requests: u64,
    /// Sessions open at once.
    pub sessions: u64,
}

impl Default for Limits {
    /// Room for a busy service (a few hundred processes of one application, each with a
    /// connection or two and a handful of sessions) and not for a cell's whole capacity:
    /// a cell holds 50 000 sessions, so five identities at their session limit leave
    /// room for everyone else.
    fn default() -> Self {
        Limits {
            connections: 1_024,
            requests: 1_024,
            sessions: 10_000,
        }
    }
}

impl Limits {
    /// No limit (an identity trusted with the whole cell: a development cell's client,
    /// a load generator): [`UNLIMITED`] of each.
    pub fn unlimited() -> Limits {
        Limits {
            connections: UNLIMITED,
            requests: UNLIMITED,
            sessions: UNLIMITED,
        }
    }

    /// The limit on `what`.
    pub fn of(&self, what: Limited) -> u64 {
        match what {
            Limited::Connections => self.connections,
            Limited::Requests => self.requests,
            Limited::Sessions => self.sessions,
        }
    }
}

/// The limits of a server: a default for every identity, and some identities' own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QuotaConfig {
    /// Every identity's, unless listed in `identities`.
    pub default: Limits,
    /// Identities with limits of their own (an identity URI → its limits).
    pub identities: std::collections::BTreeMap<String, Limits>,
}

impl QuotaConfig {
    /// The limits of `identity`.
    pub fn limits(&self, identity: &str) -> Limits {
        self.identities
            .get(identity)
            .copied()
            .unwrap_or(self.default)
    }

    /// Checks every limit is at least 1 and every listed identity is one.
    pub fn validate(&self) -> Result<(), String> {
        let check = |who: &str, l: &Limits| {
            if l.connections == 0 || l.requests == 0 || l.sessions == 0 {
                Err(format!(
                    "{who}: every limit per identity must be at least 1 ({l:?})"
                ))
            } else {
                Ok(())
            }
        };
        check("limits.per_identity.default", &self.default)?;
        for (id, l) in &self.identities {
            crate::identity::Identity::parse(id)
                .map_err(|e| format!("limits.per_identity.identities: {e}"))?;
            check(id, l)?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Counts {
    connections: u64,
    requests: u64,
}

/// At most one log line of refusals per this while.
const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Connections and requests in flight per identity, and refusals by kind.
pub struct Quotas {
    cfg: QuotaConfig,
    counts: Mutex<HashMap<String, Counts>>,
    refused: [AtomicU64; 3],
    /// When a refusal was last logged, and refusals since then left out of the log: at
    /// most one line a second, so an abusive client cannot flood the server's log.
    logged: Mutex<(Option<std::time::Instant>, u64)>,
}

impl Quotas {
    /// Counters under `cfg`'s limits.
    pub fn new(cfg: QuotaConfig) -> Arc<Quotas> {
        Arc::new(Quotas {
            cfg,
            counts: Mutex::new(HashMap::new()),
            refused: Default::default(),
            logged: Mutex::new((None, 0)),
        })
    }

    /// The limits of `identity`.
    pub fn limits(&self, identity: &str) -> Limits {
        self.cfg.limits(identity)
    }

    fn refuse(&self, identity: &str, what: Limited) -> Error {
        let i = match what {
            Limited::Connections => 0,
            Limited::Requests => 1,
            Limited::Sessions => 2,
        };
        self.refused[i].fetch_add(1, Ordering::Relaxed);
        let now = std::time::Instant::now();
        // Decided under the lock, written after it (a slow stderr must not hold others).
        let log_now = {
            let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
            match logged.0 {
                Some(at) if now.duration_since(at) < LOG_EVERY => {
                    logged.1 += 1;
                    None
                }
                _ => {
                    logged.0 = Some(now);
                    Some(std::mem::take(&mut logged.1))
                }
            }
        };
        if let Some(left_out) = log_now {
            tracing::info!(
                identity,
                %what,
                limit = self.limits(identity).of(what),
                left_out,
                "refused by the limit per identity (left_out: refusals since the last line)"
            );
        }
        Error::TooManyFor {
            identity: identity.to_string(),
            what,
            limit: self.limits(identity).of(what),
        }
    }

    /// Refusals so far: connections, requests, sessions.
    pub fn refusals(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.refused[i].load(Ordering::Relaxed))
    }

    fn take(self: &Arc<Self>, identity: &str, what: Limited) -> Result<Place, Error> {
        let limit = self.limits(identity).of(what);
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let c = counts.entry(identity.to_string()).or_default();
        let n = match what {
            Limited::Connections => &mut c.connections,
            _ => &mut c.requests,
        };
        if *n >= limit {
            if c.connections == 0 && c.requests == 0 {
                counts.remove(identity);
            }
            drop(counts);
            return Err(self.refuse(identity, what));
        }
        *n += 1;
        Ok(Place {
            quotas: self.clone(),
            identity: identity.to_string(),
            what,
        })
    }

    /// A place for one more connection of `identity`, held until the guard drops.
    pub fn connect(self: &Arc<Self>, identity: &str) -> Result<Place, Error> {
        self.take(identity, Limited::Connections)
    }

    /// A place for one more request in flight of `identity`, held until the guard drops.
    pub fn begin(self: &Arc<Self>, identity: &str) -> Result<Place, Error> {
        self.take(identity, Limited::Requests)
    }

    /// Refuses one more session for `identity`, which holds `open` already.
    pub fn check_sessions(&self, identity: &str, open: u64) -> Result<(), Error> {
        if open >= self.limits(identity).sessions {
            return Err(self.refuse(identity, Limited::Sessions));
        }
        Ok(())
    }

    /// Connections and requests in flight `identity` holds now.
    pub fn held(&self, identity: &str) -> (u64, u64) {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .get(identity)
            .map_or((0, 0), |c| (c.connections, c.requests))
    }
}

/// A connection's or request's place in its identity's quota, given back when dropped.
pub struct Place {
    quotas: Arc<Quotas>,
    identity: String,
    what: Limited,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut counts = self.quotas.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = counts.get_mut(&self.identity) {
            match self.what {
                Limited::Connections => c.connections = c.connections.saturating_sub(1),
                _ => c.requests = c.requests.saturating_sub(1),
            }
            if c.connections == 0 && c.requests == 0 {
                counts.remove(&self.identity);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_identity_has_its_own_places_given_back_on_drop() {
        let mut cfg = QuotaConfig {
            default: Limits {
                connections: 2,
                requests: 3,
                sessions: 5,
            },
            ..QuotaConfig::default()
        };
        cfg.identities
            .insert("lock://client/big".into(), Limits::unlimited());
        cfg.validate().unwrap();
        let q = Quotas::new(cfg);
        let a = "lock://client/a";
        let c1 = q.connect(a).unwrap();
        let _c2 = q.connect(a).unwrap();
        assert_eq!(
            q.connect(a).err(),
            Some(Error::TooManyFor {
                identity: a.into(),
                what: Limited::Connections,
                limit: 2,
            })
        );
        // Another identity is not affected; a listed one has its own limits.
        let _b = q.connect("lock://client/b").unwrap();
        let big: Vec<Place> = (0..100)
            .map(|_| q.connect("lock://client/big").unwrap())
            .collect();
        drop(c1);
        let _c3 = q.connect(a).unwrap();
        let r: Vec<Place> = (0..3).map(|_| q.begin(a).unwrap()).collect();
        assert!(q.begin(a).is_err());
        assert_eq!(q.held(a), (2, 3));
        drop(r);
        assert_eq!(q.held(a), (2, 0));
        assert!(q.check_sessions(a, 4).is_ok());
        assert!(matches!(
            q.check_sessions(a, 5),
            Err(Error::TooManyFor {
                what: Limited::Sessions,
                limit: 5,
                ..
            })
        ));
        assert_eq!(q.refusals(), [1, 1, 1]);
        drop(big);
        assert_eq!(q.held("lock://client/big"), (0, 0));
        // Nothing is kept for an identity that holds nothing.
        assert!(q.counts.lock().unwrap().get("lock://client/big").is_none());
    }

    #[test]
    fn a_limit_of_zero_or_an_unknown_identity_is_refused() {
        let mut cfg = QuotaConfig::default();
        cfg.default.requests = 0;
        assert!(cfg.validate().unwrap_err().contains("at least 1"));
        let mut cfg = QuotaConfig::default();
        cfg.identities.insert("bob".into(), Limits::default());
        assert!(cfg.validate().is_err());
    }
}
