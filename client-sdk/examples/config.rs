//! Read a config value, compare-and-set it, and watch it.
//!
//! `cargo run -p client-sdk --example config` (with a cell running).

use client_sdk::recipes::config::Config;
use client_sdk::{Client, ClientConfig, Error};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = Client::connect(ClientConfig::from_env()).await?;
    let session = client.open_session().await?;
    let config = Config::new(&session);
    config.set("/example-config", b"v1".to_vec(), None).await?;
    let (value, version, changed) = config.watch("/example-config").await?;
    println!(
        "value {:?} at version {version}",
        String::from_utf8_lossy(&value)
    );
    let new_version = config
        .set("/example-config", b"v2".to_vec(), Some(version))
        .await?;
    println!("compare-and-set to v2: version {new_version}");
    match config
        .set("/example-config", b"stale".to_vec(), Some(version))
        .await
    {
        Err(Error::BadVersion {
            expected, actual, ..
        }) => {
            println!("stale compare-and-set refused (expected {expected}, found {actual})")
        }
        other => println!("unexpected: {other:?}"),
    }
    println!("watch fired: {:?}", changed.await?.event);
    session.close().await?;
    Ok(())
}
