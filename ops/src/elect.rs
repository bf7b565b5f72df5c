//! `lockctl elect PATH`: stand in an election and run a command while leading (the
//! election is the lock queue with each candidate's data in its node, as
//! `client_sdk::recipes::election` keeps it); or, with `--observe`, print who leads and
//! every change until Ctrl-C.

use client_sdk::recipes::election::{Election, LeaderInfo};
use client_sdk::{Client, Session};

use crate::lock::LockArgs;

/// Options of `lockctl elect`.
#[derive(clap::Args, Debug)]
pub struct ElectArgs {
    /// Print who leads now and each change, until Ctrl-C (or --count changes); do not
    /// stand.
    #[arg(long, conflicts_with_all = ["data", "command", "wait_secs"])]
    pub observe: bool,
    /// With --observe: stop after this many changes.
    #[arg(long, requires = "observe")]
    pub count: Option<u64>,
    /// Standing: the election's path, data, timeout, and what to do with the command if
    /// leadership is in doubt or lost (as for `lockctl lock`, always exclusive).
    #[command(flatten)]
    pub stand: LockArgs,
}

/// Runs `lockctl elect`. Returns the exit status.
pub async fn run(client: &Client, mut args: ElectArgs, json: bool) -> anyhow::Result<i32> {
    wire::path::validate(&args.stand.path)?;
    if args.observe {
        observe(client, &args, json).await?;
        return Ok(0);
    }
    anyhow::ensure!(
        args.stand.mode == "exclusive",
        "an election has one leader: --mode {} is for `lockctl lock`",
        args.stand.mode
    );
    if args.stand.data.is_none() {
        // Who stands, for observers: this host and process.
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown-host".into());
        args.stand.data = Some(format!("{host}:{}", std::process::id()));
    }
    args.stand.granted = "elected";
    crate::lock::run(client, args.stand).await
}

fn describe(leader: &Option<LeaderInfo>, json: bool) -> String {
    match (leader, json) {
        (Some(l), true) => serde_json::json!({
            "leader": String::from_utf8_lossy(&l.address),
            "node": l.node,
            "token": l.token,
            "session": l.session,
        })
        .to_string(),
        (None, true) => serde_json::json!({ "leader": null }).to_string(),
        (Some(l), false) => format!(
            "leader {} token={} node={}",
            String::from_utf8_lossy(&l.address),
            l.token,
            l.node
        ),
        (None, false) => "no leader".to_string(),
    }
}

async fn observe(client: &Client, args: &ElectArgs, json: bool) -> anyhow::Result<()> {
    crate::watch::in_session_until_ctrl_c(client, |session| async move {
        observe_loop(&session, args, json).await
    })
    .await
}

async fn observe_loop(session: &Session, args: &ElectArgs, json: bool) -> anyhow::Result<()> {
    let election = Election::new(session, &args.stand.path);
    let mut expired = session.subscribe();
    let mut last: Option<String> = None;
    let mut changes = 0u64;
    loop {
        let (leader, watch) = election.observe().await?;
        let now = describe(&leader, json);
        // A watch also fires for a change that leaves the same leader (a candidate
        // joining or leaving behind it): print only changes of who leads.
        if last.as_ref() != Some(&now) {
            if last.is_some() {
                changes += 1;
            }
            println!("{now}");
            last = Some(now);
        }
        if args.count.is_some_and(|n| changes >= n) {
            return Ok(());
        }
        tokio::select! {
            ev = watch => { ev?; }
            _ = expired.wait_for(|s| *s == client_sdk::SessionState::Expired) => {
                anyhow::bail!("the session expired: changes may have been missed");
            }
        }
    }
}
