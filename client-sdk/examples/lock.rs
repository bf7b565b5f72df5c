//! Take an exclusive lock, write to a protected resource with the fencing token, release.
//!
//! Start a cell (`cargo run --bin lockctl -- dev`), then:
//! `cargo run -p client-sdk --example lock`

use std::time::Duration;

use client_sdk::{Client, ClientConfig, Lock};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = Client::connect(ClientConfig::from_env()).await?;
    let session = client.open_session().await?;
    let lock = Lock::exclusive(&session, "/example-lock");
    match lock.acquire_timeout(Duration::from_secs(10)).await? {
        Some(guard) => {
            println!("holding /example-lock with fencing token {}", guard.token());
            // Every write to the protected resource carries guard.token(); the resource
            // refuses tokens lower than the highest it has seen (see fenced_resource.rs).
            if guard.may_act() {
                println!("session healthy: acting on the lock");
            }
            guard.release().await?;
            println!("released");
        }
        None => println!("someone else held /example-lock for 10 s; gave up (no node left behind)"),
    }
    session.close().await?;
    Ok(())
}
