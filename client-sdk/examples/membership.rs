//! Join a group as an ephemeral member and list the members with a watch.
//!
//! `cargo run -p client-sdk --example membership -- worker-1` (with a cell running).

use std::time::Duration;

use client_sdk::recipes::membership::Group;
use client_sdk::{Client, ClientConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = std::env::args().nth(1).unwrap_or_else(|| "worker-1".into());
    let client = Client::connect(ClientConfig::from_env()).await?;
    let session = client.open_session().await?;
    let group = Group::new(&session, "/example-group");
    group.join(&name, b"ready".to_vec()).await?;
    let (members, changed) = group.members_watch().await?;
    println!(
        "members: {:?}",
        members.iter().map(|m| &m.name).collect::<Vec<_>>()
    );
    match tokio::time::timeout(Duration::from_secs(5), changed).await {
        Ok(ev) => println!("membership changed: {:?}", ev?.event),
        Err(_) => println!("no change in 5 s"),
    }
    session.close().await?; // our member node goes with the session
    Ok(())
}
