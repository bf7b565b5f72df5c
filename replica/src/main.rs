//! `replica`: one Raft member of a lock-service cell.

/// jemalloc instead of glibc's malloc: under `loadgen profile` glibc's malloc and free took
/// 10-20 % of the leader's, the proxy's and loadgen's CPU (docs/benchmarks.md, issue 27).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::path::PathBuf;

use clap::Parser;

/// One replica of a lock-service cell.
///
/// Configuration comes from a TOML file (see `ops/replica.example.toml`) with environment
/// overrides: `LOCKSVC_REPLICA__<SECTION>__<KEY>`, e.g. `LOCKSVC_REPLICA__SESSION__LEASE_MS`.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Configuration file (TOML).
    #[arg(short, long)]
    config: PathBuf,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = wire::logs::init("info,openraft=warn,fjall=warn,lsm_tree=warn,quinn=warn") {
        eprintln!("replica: {e}");
        std::process::exit(2);
    }
    let cfg = match replica::config::ReplicaConfig::load(Some(&args.config)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("replica: {}: {e:#}", args.config.display());
            std::process::exit(2);
        }
    };
    let result = replica::server::run_until_signal(cfg);
    if let Err(e) = result {
        eprintln!("replica: {e:#}");
        std::process::exit(1);
    }
}
