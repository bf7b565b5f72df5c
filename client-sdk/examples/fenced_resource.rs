//! A protected resource that checks fencing tokens, on fjall: the highest token accepted
//! per lock is stored next to the data and checked in the same write transaction as every
//! write. A holder that paused past its lease and writes late is refused.
//!
//! Runs without a cell: it plays two holders with the tokens a cell would grant.
//! `cargo run -p client-sdk --example fenced_resource`

use client_sdk::fencing::{admit, StaleToken};
use fjall::{
    KeyspaceCreateOptions, PersistMode, Readable, SingleWriterTxDatabase, SingleWriterTxKeyspace,
};

struct Resource {
    db: SingleWriterTxDatabase,
    data: SingleWriterTxKeyspace,
    fences: SingleWriterTxKeyspace,
}

impl Resource {
    fn open(dir: &std::path::Path) -> fjall::Result<Resource> {
        let db = SingleWriterTxDatabase::builder(dir).open()?;
        let data = db.keyspace("data", KeyspaceCreateOptions::default)?;
        let fences = db.keyspace("fences", KeyspaceCreateOptions::default)?;
        Ok(Resource { db, data, fences })
    }

    /// The check and the write in one transaction: never check, then write separately.
    fn write(
        &self,
        lock: &str,
        token: u64,
        key: &str,
        value: &[u8],
    ) -> fjall::Result<Result<(), StaleToken>> {
        let mut tx = self.db.write_tx().durability(Some(PersistMode::SyncAll));
        let highest = tx
            .get(&self.fences, lock)?
            .map(|v| u64::from_be_bytes(v.as_ref().try_into().expect("8 bytes")));
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
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let resource = Resource::open(dir.path())?;
    // Holder A was granted /locks/db with token 918204 and writes.
    println!(
        "A (918204): {:?}",
        resource.write("/locks/db", 918_204, "balance", b"100")?
    );
    // A pauses past its lease; B is granted the lock with a higher token and fences first.
    println!(
        "B (918260): {:?}",
        resource.write("/locks/db", 918_260, "balance", b"90")?
    );
    // A wakes up and sends the write it prepared before the pause: refused.
    println!(
        "A (918204) late: {:?}",
        resource.write("/locks/db", 918_204, "balance", b"110")?
    );
    Ok(())
}
