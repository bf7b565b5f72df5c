//! `proxy`: the lock service's proxy tier.

/// jemalloc instead of glibc's malloc: under `loadgen profile` glibc's malloc and free took
/// 10-20 % of the leader's, the proxy's and loadgen's CPU (docs/benchmarks.md, issue 27).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::path::PathBuf;

use clap::Parser;

/// A lock-service proxy: terminates clients, batches their KeepAlives, serves cached reads
/// and fans out watches for one cell.
///
/// Configuration comes from a TOML file (see `ops/proxy.example.toml`) with environment
/// overrides: `LOCKSVC_PROXY__<KEY>`, e.g. `LOCKSVC_PROXY__MAX_CLIENTS=5000` or
/// `LOCKSVC_PROXY__REPLICAS=127.0.0.1:7101,127.0.0.1:7102`.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Configuration file (TOML).
    #[arg(short, long)]
    config: PathBuf,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = wire::logs::init("info,quinn=warn") {
        eprintln!("proxy: {e}");
        std::process::exit(2);
    }
    let cfg = match proxy::ProxyConfig::load(Some(&args.config)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("proxy: {}: {e:#}", args.config.display());
            std::process::exit(2);
        }
    };
    if let Err(e) = proxy::run_until_signal(cfg) {
        eprintln!("proxy: {e:#}");
        std::process::exit(1);
    }
}
