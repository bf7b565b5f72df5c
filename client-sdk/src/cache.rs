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

/// A bounded LRU cache.
pub(crate) struct Cache {
    entries: HashMap<String, Entry>,
    entries_max: usize,
    bytes_max: usize,
    clock: u64,
    generation: u64,
    stats: CacheStats,
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
        }
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
        for p in paths {
            if let Some(e) = self.entries.remove(p) {
                self.stats.bytes -= e.bytes;
                self.stats.invalidated += 1;
            }
        }
        self.stats.entries = self.entries.len();
    }

    /// Drops everything.
    pub(crate) fn flush(&mut self) {
        self.generation += 1;
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
