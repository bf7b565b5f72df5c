//! Ours: the SDK's `Lock` recipe and plain node operations on a [`Session`].

use client_sdk::{CreateMode, Lock, LockGuard, Session};

/// Creates every node of `dir` that is missing.
pub(super) async fn ensure_dir(s: &Session, dir: &str) -> anyhow::Result<()> {
    let mut path = String::new();
    for part in dir.trim_start_matches('/').split('/') {
        path = format!("{path}/{part}");
        match s.create(&path, Vec::new(), CreateMode::default()).await {
            Ok(_) | Err(client_sdk::Error::NodeExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Takes the exclusive lock `dir`; its guard and fencing token (`NodeStat::token`).
pub(super) async fn acquire(s: &Session, dir: &str) -> anyhow::Result<(LockGuard, u64)> {
    let g = Lock::exclusive(s, dir).acquire().await?;
    let t = g.token();
    Ok((g, t))
}

/// Writes `value` to the node `key`.
pub(super) async fn write(s: &Session, key: &str, value: Vec<u8>) -> anyhow::Result<()> {
    s.set_data(key, value, None).await?;
    Ok(())
}

/// Creates the node `key` unless it exists.
pub(super) async fn prepare_key(s: &Session, key: &str) -> anyhow::Result<()> {
    match s.create(key, Vec::new(), CreateMode::default()).await {
        Ok(_) | Err(client_sdk::Error::NodeExists { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
