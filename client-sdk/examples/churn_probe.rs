// temporary probe, not committed
use client_sdk::{Client, ClientConfig};
use std::time::Duration;

fn rss_fds() -> (u64, usize) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let rss = s
        .lines()
        .find(|l| l.starts_with("VmRSS"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    (rss, fds)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let par: usize = std::env::var("PAR")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let t0 = std::time::Instant::now();
    for round in 0..(n / par) {
        let mut hs = vec![];
        for _ in 0..par {
            hs.push(tokio::spawn(async {
                let client = Client::connect(ClientConfig::from_env()).await.unwrap();
                let session = client.open_session().await.unwrap();
                session.close().await.unwrap();
            }));
        }
        for h in hs {
            h.await?;
        }
        let (rss, fds) = rss_fds();
        println!(
            "{:6.1}s round {round} done {} rss {} MB fds {fds}",
            t0.elapsed().as_secs_f64(),
            (round + 1) * par,
            rss / 1024
        );
    }
    for i in 0..12 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (rss, fds) = rss_fds();
        println!("after +{}s rss {} MB fds {fds}", i + 1, rss / 1024);
    }
    Ok(())
}
