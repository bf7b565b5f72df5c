//! `lockctl lock`: hold a lock while a command runs (like `etcdctl lock`).

use std::process::Stdio;

use client_sdk::recipes::lock::LockMode;
use client_sdk::{Client, Lock, SessionEvent};

/// Options of `lockctl lock`.
#[derive(clap::Args, Debug)]
pub struct LockArgs {
    /// The lock's path (created if missing; its parent must exist).
    pub path: String,
    /// exclusive, read or write.
    #[arg(long, default_value = "exclusive", value_parser = ["exclusive", "read", "write"])]
    pub mode: String,
    /// Give up after this many seconds of waiting (exit status 3); wait forever if absent.
    #[arg(long)]
    pub wait_secs: Option<u64>,
    /// What to do with the command if the session expires while it runs: `term` (send it
    /// SIGTERM) or `keep` (let it run; its writes must then be refused by fencing).
    #[arg(long, default_value = "term", value_parser = ["term", "keep"])]
    pub on_expiry: String,
    /// The command to run while holding the lock; it gets LOCK_PATH, LOCK_NODE, LOCK_TOKEN
    /// and LOCK_SESSION in its environment. Without one, hold until Ctrl-C.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// Runs `lockctl lock`. Returns the exit status.
pub async fn run(client: &Client, args: LockArgs) -> anyhow::Result<i32> {
    let session = client.open_session().await?;
    let lock = match args.mode.as_str() {
        "read" => Lock::read(&session, &args.path),
        "write" => Lock::write(&session, &args.path),
        _ => Lock::exclusive(&session, &args.path),
    };
    let guard = match args.wait_secs {
        Some(s) => match lock
            .acquire_timeout(std::time::Duration::from_secs(s))
            .await?
        {
            Some(g) => g,
            None => {
                crate::say!("lockctl: {} not acquired within {s} s", args.path);
                session.close().await?;
                return Ok(3);
            }
        },
        None => lock.acquire().await?,
    };
    let seq = guard.sequencer().clone();
    let mode = match seq.mode {
        LockMode::Exclusive => "exclusive",
        LockMode::Read => "read",
        LockMode::Write => "write",
    };
    println!(
        "acquired {} ({mode}) token={} node={} session={}",
        seq.lock, seq.token, seq.node, seq.session
    );
    let mut events = session.events();
    if args.command.is_empty() {
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                e = events.recv() => {
                    if report(&seq.lock, e) {
                        return Ok(4);
                    }
                }
            }
        }
        guard.release().await?;
        session.close().await?;
        return Ok(0);
    }
    let mut child = tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("LOCK_PATH", &seq.lock)
        .env("LOCK_NODE", &seq.node)
        .env("LOCK_TOKEN", seq.token.to_string())
        .env("LOCK_SESSION", seq.session.to_string())
        .stdin(Stdio::inherit())
        .spawn()?;
    let mut expired = false;
    let status = loop {
        tokio::select! {
            st = child.wait() => break st?,
            e = events.recv(), if !expired => {
                if report(&seq.lock, e) {
                    expired = true;
                    if args.on_expiry == "term" {
                        if let Some(pid) = child.id() {
                            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                        }
                    }
                }
            }
        }
    };
    if !expired {
        // The session may have expired without our hearing it yet (the command finished
        // first): releasing then tells us.
        match guard.release().await {
            Ok(()) => session.close().await?,
            Err(client_sdk::Error::SessionExpired { .. }) => {
                report(&seq.lock, Ok(SessionEvent::Expired));
                expired = true;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(if expired {
        4
    } else {
        status.code().unwrap_or(1)
    })
}

/// Reports a session event on stderr; true when the session is over.
fn report(lock: &str, e: Result<SessionEvent, tokio::sync::broadcast::error::RecvError>) -> bool {
    match e {
        Ok(SessionEvent::Jeopardy) => {
            crate::say!("lockctl: session in jeopardy: stop acting on {lock}");
            false
        }
        Ok(SessionEvent::Safe) => {
            crate::say!("lockctl: session safe again: still holding {lock}");
            false
        }
        Ok(SessionEvent::FailOver) => false,
        Ok(SessionEvent::Expired) | Err(_) => {
            crate::say!("lockctl: session expired: lock {lock} lost");
            true
        }
    }
}
