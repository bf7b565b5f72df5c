//! Campaign for leadership with an address; observe who leads; resign.
//!
//! `cargo run -p client-sdk --example election -- 10.0.0.7:8080` (with a cell running).

use client_sdk::recipes::election::Election;
use client_sdk::{Client, ClientConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    let client = Client::connect(ClientConfig::from_env()).await?;
    let session = client.open_session().await?;
    let election = Election::new(&session, "/example-election");
    let leadership = election.campaign(address.clone().into_bytes()).await?;
    println!("{address} leads with token {}", leadership.token());
    let (leader, _changed) = election.observe().await?;
    if let Some(l) = leader {
        println!(
            "observers see {} (token {})",
            String::from_utf8_lossy(&l.address),
            l.token
        );
    }
    leadership.resign().await?;
    println!("resigned");
    session.close().await?;
    Ok(())
}
