//! A reference fenced resource on fjall, for scripts and drills (`lockctl fenced-write`,
//! `lockctl fenced-get`): every write carries a lock's fencing token, and in the same
//! write transaction the store refuses a token lower than the highest it accepted for
//! that lock (see `client_sdk::fencing`).

use std::path::Path;

use anyhow::Context;
use client_sdk::fencing::{admit, StaleToken};
use fjall::{
    KeyspaceCreateOptions, PersistMode, Readable, SingleWriterTxDatabase, SingleWriterTxKeyspace,
};

/// The store.
pub struct FencedStore {
    db: SingleWriterTxDatabase,
    data: SingleWriterTxKeyspace,
    fences: SingleWriterTxKeyspace,
}

impl FencedStore {
    /// Opens (or creates) the store in `dir`. One process at a time.
    pub fn open(dir: &Path) -> anyhow::Result<FencedStore> {
        let db = SingleWriterTxDatabase::builder(dir)
            .open()
            .with_context(|| format!("open fenced store {}", dir.display()))?;
        let data = db.keyspace("data", KeyspaceCreateOptions::default)?;
        let fences = db.keyspace("fences", KeyspaceCreateOptions::default)?;
        Ok(FencedStore { db, data, fences })
    }

    /// Writes `key = value` under `lock`'s token, or refuses a stale token. The check and
    /// the write are one transaction, synced before returning.
    pub fn write(
        &self,
        lock: &str,
        token: u64,
        key: &str,
        value: &[u8],
    ) -> anyhow::Result<Result<(), StaleToken>> {
        let mut tx = self.db.write_tx().durability(Some(PersistMode::SyncAll));
        let highest = match tx.get(&self.fences, lock)? {
            Some(v) => Some(u64::from_be_bytes(
                v.as_ref().try_into().context("corrupt fence")?,
            )),
            None => None,
        };
        match admit(highest, token) {
            Err(stale) => {
                tx.rollback();
                Ok(Err(stale))
            }
            Ok(new_highest) => {
                tx.insert(&self.fences, lock, new_highest.to_be_bytes());
                tx.insert(&self.data, key, value);
                tx.commit()?;
                Ok(Ok(()))
            }
        }
    }

    /// A value, if present.
    pub fn get(&self, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
        Ok(self.data.get(key)?.map(|v| v.to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_tokens_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = FencedStore::open(dir.path()).unwrap();
        assert!(store.write("/locks/a", 10, "k", b"first").unwrap().is_ok());
        assert!(store.write("/locks/a", 12, "k", b"second").unwrap().is_ok());
        let refused = store.write("/locks/a", 10, "k", b"late").unwrap();
        assert_eq!(
            refused,
            Err(StaleToken {
                token: 10,
                highest: 12
            })
        );
        assert_eq!(store.get("k").unwrap().unwrap(), b"second");
        // Another lock has its own high-water mark.
        assert!(store.write("/locks/b", 1, "j", b"x").unwrap().is_ok());
        drop(store);
        let store = FencedStore::open(dir.path()).unwrap();
        assert!(
            store
                .write("/locks/a", 11, "k", b"after restart")
                .unwrap()
                .is_err(),
            "durable"
        );
    }
}
