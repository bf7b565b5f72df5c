//! Readers share a lock; a writer waits for every earlier holder.
//!
//! `cargo run -p client-sdk --example shared_lock` (with a cell running).

use client_sdk::{Client, ClientConfig, Lock};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = Client::connect(ClientConfig::from_env()).await?;
    let (r1, r2, w) = (
        client.open_session().await?,
        client.open_session().await?,
        client.open_session().await?,
    );
    let g1 = Lock::read(&r1, "/example-rw").acquire().await?;
    let g2 = Lock::read(&r2, "/example-rw").acquire().await?;
    println!(
        "two readers hold /example-rw (tokens {} and {})",
        g1.token(),
        g2.token()
    );
    let writer = Lock::write(&w, "/example-rw");
    println!(
        "writer can take it now? {}",
        writer.try_acquire().await?.is_some()
    );
    g1.release().await?;
    g2.release().await?;
    let gw = writer.acquire().await?;
    println!("writer holds it with token {}", gw.token());
    gw.release().await?;
    for s in [r1, r2, w] {
        s.close().await?;
    }
    Ok(())
}
