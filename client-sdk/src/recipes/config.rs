//! Configuration values: read, compare-and-set on the version, watch for change.
//!
//! ```no_run
//! # async fn demo(session: client_sdk::Session) -> Result<(), client_sdk::Error> {
//! use client_sdk::recipes::config::Config;
//! let config = Config::new(&session);
//! let (value, version) = config.get("/config/flags").await?;
//! match config.set("/config/flags", b"dark-mode=on".to_vec(), Some(version)).await {
//!     Ok(new_version) => println!("now at version {new_version}"),
//!     Err(client_sdk::Error::BadVersion { .. }) => println!("someone else changed it first"),
//!     Err(e) => return Err(e),
//! }
//! # let _ = value;
//! # Ok(()) }
//! ```

use wire::types::CreateMode;
use wire::Error;

use crate::session::Session;
use crate::watch::Watch;

/// Config values read and written through one session.
#[derive(Clone)]
pub struct Config {
    session: Session,
}

impl Config {
    /// Config access through `session`.
    pub fn new(session: &Session) -> Config {
        Config {
            session: session.clone(),
        }
    }

    /// The value and its version (linearizable).
    pub async fn get(&self, path: &str) -> Result<(Vec<u8>, u64), Error> {
        let (data, stat) = self.session.get(path).await?;
        Ok((data, stat.version))
    }

    /// Sets the value. With `expected_version`, only if the value still has that version
    /// (`BadVersion` otherwise, and nothing changes); without, creates the node if missing
    /// or overwrites it. Returns the new version.
    pub async fn set(
        &self,
        path: &str,
        value: Vec<u8>,
        expected_version: Option<u64>,
    ) -> Result<u64, Error> {
        if expected_version.is_none() {
            match self
                .session
                .create(path, value.clone(), CreateMode::default())
                .await
            {
                Ok(c) => return Ok(c.stat.version),
                Err(Error::NodeExists { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(self
            .session
            .set_data(path, value, expected_version)
            .await?
            .version)
    }

    /// The value, its version, and a watch that fires when it changes or is deleted.
    pub async fn watch(&self, path: &str) -> Result<(Vec<u8>, u64, Watch), Error> {
        let (data, stat, w) = self.session.get_watch(path).await?;
        Ok((data, stat.version, w))
    }
}
