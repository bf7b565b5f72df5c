//! `replica`: one Raft member of a lock-service cell.

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
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                "info,openraft=warn,fjall=warn,lsm_tree=warn,quinn=warn".into()
            }),
        )
        .init();
    let cfg = match replica::config::ReplicaConfig::load(Some(&args.config)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("replica: {}: {e:#}", args.config.display());
            std::process::exit(2);
        }
    };
    let system = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    });
    let result = system.block_on(async move {
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("signal handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        };
        replica::server::run(cfg, shutdown).await
    });
    if let Err(e) = result {
        eprintln!("replica: {e:#}");
        std::process::exit(1);
    }
}
