//! The session's consistent cache of node values (and of absences).
//!
//! Valid only while the session is healthy: a hit is served only while the local lease is
//! valid, the cache is flushed when the session enters jeopardy, expires, or sees a
//! fail-over (the leader's list of cachers died with it, so an invalidation may have been
//! lost). The leader invalidates every cacher before a write to a cached node commits; an
//! entry is dropped before the invalidation is acknowledged.
//!
//! A read that races an invalidation is not cached: every flush or invalidation bumps a
//! generation, and a read's answer is stored only if the generation did not move while it
//! was in flight.
//!
//! The same list of cachers tells a lock holder that its node may be going: a [`Pin`] is
//! a holder's cached read of its own node. While the leader knows the session caches the
//! node, no delete or change of it (by someone else, an admin, a prefix's move to another
//! cell) commits before the holder dropped it: the invalidation leaves the pin
//! unconfirmed before it is acknowledged, and so does a flush (the event stream broke, the
//! lease is in doubt). An unconfirmed pin is read again at the leader: found with its
//! token, it is confirmed again (an invalidation can come without a change: a proxy
//! drops every copy when its upstream reconnects); found gone, another's, or in no longer
//! this cell, it is lost for good.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use wire::hash::HashMap;

use wire::types::NodeStat;

/// A cached node: its data and metadata, or `None` for a cached absence.
pub type CachedValue = Option<(Vec<u8>, NodeStat)>;

/// Counters the application can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Reads served from the cache.
    pub hits: u64,
    /// Reads that went to the cell.
    pub misses: u64,
    /// Entries dropped by invalidations from the leader.
    pub invalidated: u64,
    /// Whole-cache flushes (jeopardy, expiry, fail-over).
    pub flushes: u64,
    /// Entries evicted to stay within the bounds.
    pub evicted: u64,
    /// Entries now.
    pub entries: usize,
    /// Bytes of data now.
    pub bytes: usize,
}

struct Entry {
    value: CachedValue,
    used: u64,
    bytes: usize,
}

/// A lock holder's claim on its own node (module docs): `pinned` while the leader is known
/// to hold the session as a cacher of the node; `lost` for good once a read found the
/// node gone, another's (another token), or no longer in this cell.
#[derive(Debug)]
pub(crate) struct Pin {
    pub(crate) path: String,
    /// The node's token when it was granted: a node found with another is not ours.
    pub(crate) token: u64,
    pinned: AtomicBool,
    lost: AtomicBool,
    released: AtomicBool,
}

impl Pin {
    pub(crate) fn new(path: &str, token: u64) -> Pin {
        Pin {
            path: path.to_string(),
            token,
            pinned: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            released: AtomicBool::new(false),
        }
    }

    /// The leader is known to invalidate this session before the node changes.
    pub(crate) fn pinned(&self) -> bool {
        self.pinned.load(Ordering::Acquire)
    }

    /// The node was deleted or changed, or is no longer this cell's: for good.
    pub(crate) fn lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    pub(crate) fn set_lost(&self) {
        self.pinned.store(false, Ordering::Release);
        self.lost.store(true, Ordering::Release);
    }

    /// Its holder let it go (released or dropped the guard).
    pub(crate) fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }
}

/// A bounded LRU cache.
pub(crate) struct Cache {
    entries: HashMap<String, Entry>,
    entries_max: usize,
    bytes_max: usize,
    clock: u64,
    generation: u64,
    stats: CacheStats,
    /// Lock holders' pins, by node path.
    pins: HashMap<String, Vec<Arc<Pin>>>,
    /// Woken when pins become unconfirmed (a flush) or one is let go.
    pins_changed: Arc<tokio::sync::Notify>,
}

impl Cache {
    pub(crate) fn new(entries_max: usize, bytes_max: usize) -> Cache {
        Cache {
            entries: HashMap::default(),
            entries_max,
            bytes_max,
            clock: 0,
            generation: 0,
            stats: CacheStats::default(),
            pins: HashMap::default(),
            pins_changed: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Adds a pin (not yet confirmed: see [`Cache::confirm_pin`]).
    pub(crate) fn add_pin(&mut self, pin: Arc<Pin>) {
        self.pins.entry(pin.path.clone()).or_default().push(pin);
    }

    /// Its holder let `pin` go.
    pub(crate) fn remove_pin(&mut self, pin: &Arc<Pin>) {
        pin.released.store(true, Ordering::Release);
        if let Some(v) = self.pins.get_mut(&pin.path) {
            v.retain(|p| !Arc::ptr_eq(p, pin));
            if v.is_empty() {
                self.pins.remove(&pin.path);
            }
        }
        self.pins_changed.notify_waiters();
    }

    /// The leader answered a cachable read of the pin's node, which was still ours,
    /// begun at `generation`: the pin holds, unless an invalidation or a flush came
    /// since (then the answer may predate it, and the pin is read again).
    pub(crate) fn confirm_pin(&mut self, pin: &Pin, generation: u64) -> bool {
        if generation != self.generation || pin.lost() || pin.released() {
            return false;
        }
        pin.pinned.store(true, Ordering::Release);
        self.pins_changed.notify_waiters();
        true
    }

    /// A read found `pin`'s node gone, another's, or elsewhere: lost for good, and every
    /// listener told.
    pub(crate) fn lose_pin(&mut self, pin: &Pin) {
        pin.set_lost();
        self.pins_changed.notify_waiters();
    }

    /// What pin keepers wait on.
    pub(crate) fn pins_changed(&self) -> Arc<tokio::sync::Notify> {
        self.pins_changed.clone()
    }

    /// A hit, or `None` (counted as a miss).
    pub(crate) fn get(&mut self, path: &str) -> Option<CachedValue> {
        self.clock += 1;
        match self.entries.get_mut(path) {
            Some(e) => {
                e.used = self.clock;
                self.stats.hits += 1;
                Some(e.value.clone())
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Counts a read that bypassed the cache (session not healthy).
    pub(crate) fn count_miss(&mut self) {
        self.stats.misses += 1;
    }

    /// The generation a read starts at.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Stores a read's answer unless an invalidation or flush happened since `generation`.
    pub(crate) fn insert(&mut self, path: &str, value: CachedValue, generation: u64) {
        if generation != self.generation {
            return;
        }
        let bytes = path.len() + value.as_ref().map_or(0, |(d, _)| d.len());
        if bytes > self.bytes_max || self.entries_max == 0 {
            return;
        }
        self.clock += 1;
        if let Some(old) = self.entries.insert(
            path.to_string(),
            Entry {
                value,
                used: self.clock,
                bytes,
            },
        ) {
            self.stats.bytes -= old.bytes;
        }
        self.stats.bytes += bytes;
        while self.entries.len() > self.entries_max || self.stats.bytes > self.bytes_max {
            let Some(lru) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            let e = self.entries.remove(&lru).expect("present");
            self.stats.bytes -= e.bytes;
            self.stats.evicted += 1;
        }
        self.stats.entries = self.entries.len();
    }

    /// Drops these entries (an invalidation from the leader).
    pub(crate) fn invalidate(&mut self, paths: &[String]) {
        self.generation += 1;
        let mut unconfirmed = false;
        for p in paths {
            for pin in self.pins.get(p).into_iter().flatten() {
                // Its node may be going: not to be acted on until it is read again.
                pin.pinned.store(false, Ordering::Release);
                unconfirmed = true;
            }
            if let Some(e) = self.entries.remove(p) {
                self.stats.bytes -= e.bytes;
                self.stats.invalidated += 1;
            }
        }
        self.stats.entries = self.entries.len();
        if unconfirmed {
            self.pins_changed.notify_waiters();
        }
    }

    /// Drops everything.
    pub(crate) fn flush(&mut self) {
        self.generation += 1;
        if !self.pins.is_empty() {
            for pin in self.pins.values().flatten() {
                pin.pinned.store(false, Ordering::Release);
            }
            self.pins_changed.notify_waiters();
        }
        self.entries.clear();
        self.stats.bytes = 0;
        self.stats.entries = 0;
        self.stats.flushes += 1;
    }

    pub(crate) fn stats(&self) -> CacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat() -> NodeStat {
        NodeStat {
            version: 0,
            children_version: 0,
            create_index: 1,
            mod_index: 1,
            ephemeral_owner: None,
            data_len: 1,
            children_count: 0,
            token: 1,
        }
    }

    #[test]
    fn hits_misses_invalidation_and_races() {
        let mut c = Cache::new(10, 1 << 20);
        assert!(c.get("/a").is_none());
        let g = c.generation();
        c.insert("/a", Some((b"1".to_vec(), stat())), g);
        c.insert("/missing", None, g);
        assert_eq!(c.get("/a").unwrap().unwrap().0, b"1");
        assert_eq!(c.get("/missing"), Some(None), "absence is cached");
        // A read in flight while an invalidation arrives is not stored.
        let g = c.generation();
        c.invalidate(&["/a".to_string()]);
        c.insert("/a", Some((b"old".to_vec(), stat())), g);
        assert!(c.get("/a").is_none());
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.invalidated, s.entries), (2, 2, 1, 1));
        c.flush();
        assert_eq!(c.stats().entries, 0);
    }

    #[test]
    fn pins_are_unconfirmed_by_invalidations_and_flushes_and_lost_only_for_good() {
        let mut c = Cache::new(0, 0);
        let pin = Arc::new(Pin::new("/l/lock-1", 7));
        c.add_pin(pin.clone());
        assert!(!pin.pinned() && !pin.lost());
        // A read begun before an invalidation of anything does not confirm.
        let g = c.generation();
        c.invalidate(&["/other".to_string()]);
        assert!(!c.confirm_pin(&pin, g));
        let g = c.generation();
        assert!(
            c.confirm_pin(&pin, g),
            "a cache that stores nothing still pins"
        );
        assert!(pin.pinned());
        // A flush leaves it unconfirmed, not lost.
        c.flush();
        assert!(!pin.pinned() && !pin.lost());
        let g = c.generation();
        assert!(c.confirm_pin(&pin, g));
        // An invalidation of its node: unconfirmed (a read decides whether it is lost).
        c.invalidate(&["/l/lock-1".to_string()]);
        assert!(!pin.pinned() && !pin.lost());
        let g = c.generation();
        assert!(
            c.confirm_pin(&pin, g),
            "read again and found: confirmed again"
        );
        pin.set_lost();
        assert!(!pin.pinned() && pin.lost());
        let g = c.generation();
        assert!(!c.confirm_pin(&pin, g), "lost for good");
        // Let go: no longer marked by anything.
        let other = Arc::new(Pin::new("/l/lock-2", 8));
        c.add_pin(other.clone());
        c.remove_pin(&other);
        assert!(other.released());
        c.invalidate(&["/l/lock-2".to_string()]);
        assert!(!other.lost() && !other.pinned());
    }

    #[test]
    fn bounded_by_count_and_bytes_lru() {
        let mut c = Cache::new(2, 1 << 20);
        let g = c.generation();
        c.insert("/a", None, g);
        c.insert("/b", None, g);
        assert!(c.get("/a").is_some()); // /b is now least recently used
        c.insert("/c", None, g);
        assert!(c.get("/b").is_none());
        assert!(c.get("/a").is_some() && c.get("/c").is_some());
        let mut c = Cache::new(100, 10);
        c.insert("/x", Some((vec![0; 6], stat())), 0);
        c.insert("/y", Some((vec![0; 6], stat())), 0);
        assert_eq!(c.stats().entries, 1, "bytes bound");
        assert_eq!(c.stats().evicted, 1);
    }
}
