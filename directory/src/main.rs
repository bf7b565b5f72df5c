//! `directory`: serves the map from prefixes to cells (`docs/directory.md`).

/// jemalloc instead of glibc's malloc: under `loadgen profile` glibc's malloc and free took
/// 10-20 % of the leader's, the proxy's and loadgen's CPU (docs/benchmarks.md, issue 27).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// A directory instance: serves, over QUIC with mutual TLS, the map from prefixes to
/// cells that it reads (and watches) in the root cell. Instances share nothing: run as
/// many as you like.
///
/// Example:
///   directory --listen 127.0.0.1:7301 --root 127.0.0.1:7001,127.0.0.1:7002 \
///     --ca tls/ca.pem --cert tls/directory.pem --key tls/directory.key
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Address to listen on (UDP).
    #[arg(long, env = "DIRECTORY_LISTEN")]
    listen: SocketAddr,
    /// The root cell's endpoints (replicas or proxies), comma-separated.
    #[arg(long, env = "DIRECTORY_ROOT", value_delimiter = ',', required = true)]
    root: Vec<String>,
    /// The CA certificate (PEM) that signed the root cell's and the clients'
    /// certificates.
    #[arg(long, env = "DIRECTORY_CA")]
    ca: PathBuf,
    /// This instance's certificate (PEM): lock://directory/<name> (`lockctl certs issue
    /// --role directory`).
    #[arg(long, env = "DIRECTORY_CERT")]
    cert: PathBuf,
    /// Its private key (PEM).
    #[arg(long, env = "DIRECTORY_KEY")]
    key: PathBuf,
    /// Certificate revocation lists (PEM), comma-separated.
    #[arg(long, env = "DIRECTORY_CRLS", value_delimiter = ',')]
    crls: Vec<PathBuf>,
    /// Read the whole map again at least this often (seconds), watches or not.
    #[arg(long, default_value_t = 30)]
    refresh_secs: u64,
    /// Serve /metrics (Prometheus), /health and /ready over HTTP on this TCP address.
    #[arg(long, env = "DIRECTORY_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

fn main() {
    let a = Args::parse();
    if let Err(e) = wire::logs::init("info,quinn=warn") {
        eprintln!("directory: {e}");
        std::process::exit(2);
    }
    let cfg = directory::DirectoryConfig {
        listen: a.listen,
        root: a.root,
        tls: wire::tls::TlsConfig {
            ca: a.ca,
            cert: a.cert,
            key: a.key,
            crls: a.crls,
        },
        refresh: Duration::from_secs(a.refresh_secs.max(1)),
        metrics_listen: a.metrics_listen,
    };
    if let Err(e) = directory::run_until_signal(cfg) {
        eprintln!("directory: {e:#}");
        std::process::exit(1);
    }
}
