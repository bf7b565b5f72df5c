//! Hash maps whose iteration order a simulation can replay.
//!
//! std's `RandomState` keys every map from the operating system's randomness, so two runs
//! of the same program iterate a map in different orders; where a replica or client sends
//! one message per entry, the order of messages differs too, and a seeded simulation stops
//! replaying exactly. [`SeededState`] keys its maps like std does (a random base per
//! process, a counter per map) unless [`fix_seed`] fixed the base, which the fault suite's
//! simulation does before each seed. The hash is SipHash-1-3 (std's `DefaultHasher`)
//! keyed by prefixing the two keys, so maps keyed by client-chosen strings still resist
//! collision flooding when the base is random.

use std::hash::{BuildHasher, DefaultHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static READY: AtomicBool = AtomicBool::new(false);
static K0: AtomicU64 = AtomicU64::new(0);
static K1: AtomicU64 = AtomicU64::new(0);
static NEXT: AtomicU64 = AtomicU64::new(0);

/// A `HashMap` keyed by [`SeededState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, SeededState>;

/// A `HashSet` keyed by [`SeededState`].
pub type HashSet<T> = std::collections::HashSet<T, SeededState>;

/// The keys of one map's hasher; see the module documentation.
#[derive(Clone, Debug)]
pub struct SeededState {
    k0: u64,
    k1: u64,
}

fn random_u64(salt: u64) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(salt);
    h.finish()
}

impl Default for SeededState {
    fn default() -> SeededState {
        if !READY.load(Ordering::Acquire) {
            // Racing first users may each store a random base; any of them will do.
            K0.store(random_u64(0), Ordering::Relaxed);
            K1.store(random_u64(1), Ordering::Relaxed);
            READY.store(true, Ordering::Release);
        }
        SeededState {
            k0: K0
                .load(Ordering::Relaxed)
                .wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)),
            k1: K1.load(Ordering::Relaxed),
        }
    }
}

impl BuildHasher for SeededState {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut h = DefaultHasher::new();
        h.write_u64(self.k0);
        h.write_u64(self.k1);
        h
    }
}

/// Fixes the keys of every map made from now on: derived from `seed` and the order in
/// which maps are made. For simulations only (a known key lets an attacker who controls
/// map keys make them collide).
pub fn fix_seed(seed: u64) {
    K0.store(seed ^ 0x736f_6d65_7073_6575, Ordering::Relaxed);
    K1.store(
        seed.rotate_left(32) ^ 0x646f_7261_6e64_6f6d,
        Ordering::Relaxed,
    );
    NEXT.store(0, Ordering::Relaxed);
    READY.store(true, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(seed: u64) -> Vec<u32> {
        fix_seed(seed);
        let m: HashMap<u32, ()> = (0..64).map(|i| (i, ())).collect();
        m.keys().copied().collect()
    }

    #[test]
    fn a_fixed_seed_repeats_the_iteration_order() {
        assert_eq!(order(7), order(7));
        assert_ne!(order(7), order(8), "another seed, another order");
        let mut s: HashSet<&str> = HashSet::default();
        assert!(s.insert("/a") && !s.insert("/a"));
    }
}
