//! `lockctl watch PATH`: a node's value and every change to it, until Ctrl-C.
//!
//! The cell's watches are one-shot (as ZooKeeper's): each fires once, on the next change
//! after the read that armed it, and names what happened, not the new value. So the loop
//! is read-and-arm, wait, print, and again: the re-read shows the node as it is then, and
//! several changes between an event and the re-read show as that one new value.

use std::time::Duration;

use client_sdk::{Client, Session};
use wire::types::{EventType, NodeStat, WatchEvent};

/// Arguments of `lockctl watch`.
#[derive(clap::Args, Debug)]
pub struct WatchArgs {
    /// The node (it need not exist yet: its creation is an event).
    pub path: String,
    /// Watch the node's set of children instead of its data.
    #[arg(long)]
    pub children: bool,
    /// Stop after this many events (default: until Ctrl-C).
    #[arg(long)]
    pub count: Option<u64>,
}

/// One node, as JSON (`get --json`, and each state `watch --json` prints).
pub fn node_json(path: &str, data: &[u8], stat: &NodeStat) -> serde_json::Value {
    serde_json::json!({
        "path": path,
        "data": String::from_utf8_lossy(data),
        "stat": stat,
    })
}

fn event_name(e: EventType) -> &'static str {
    match e {
        EventType::Created => "created",
        EventType::DataChanged => "changed",
        EventType::Deleted => "deleted",
        EventType::ChildrenChanged => "children-changed",
    }
}

/// Reads the node (or its children), arms the next watch, and prints what it read.
async fn read_and_arm(
    session: &Session,
    args: &WatchArgs,
    json: bool,
) -> anyhow::Result<client_sdk::Watch> {
    let path = args.path.as_str();
    if args.children {
        let (children, w) = session.children_watch(path).await?;
        let names: Vec<&str> = children.iter().map(|(n, _)| n.as_str()).collect();
        if json {
            println!("{}", serde_json::json!({ "path": path, "children": names }));
        } else {
            println!("{path} children: {}", names.join(" "));
        }
        return Ok(w);
    }
    let (stat, w) = session.exists_watch(path).await?;
    match stat {
        None if json => println!("{}", serde_json::json!({ "path": path, "exists": false })),
        None => println!("{path} does not exist"),
        Some(_) => {
            // The data as of now; the watch armed above fires on any later change, and a
            // change between the two reads shows here already.
            match session.get(path).await {
                Ok((data, stat)) if json => println!("{}", node_json(path, &data, &stat)),
                Ok((data, stat)) => println!(
                    "{path} version={} {}",
                    stat.version,
                    String::from_utf8_lossy(&data)
                ),
                Err(wire::Error::NoNode { .. }) if json => {
                    println!("{}", serde_json::json!({ "path": path, "exists": false }))
                }
                Err(wire::Error::NoNode { .. }) => println!("{path} does not exist"),
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(w)
}

fn print_event(ev: &WatchEvent, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::json!({
                "event": event_name(ev.event),
                "path": ev.path,
                "index": ev.index,
            })
        );
    } else {
        println!("{} {} index={}", event_name(ev.event), ev.path, ev.index);
    }
}

/// Runs `lockctl watch` until Ctrl-C (or `--count` events); the session is closed on the
/// way out.
pub async fn run(client: &Client, args: WatchArgs, json: bool) -> anyhow::Result<()> {
    wire::path::validate(&args.path)?;
    in_session_until_ctrl_c(client, |session| async move {
        watch_loop(&session, &args, json).await
    })
    .await
}

/// Opens a session, runs `body` in it until it ends or Ctrl-C (Ok then), and closes the
/// session on the way out: what `watch` and `elect --observe` do. One Ctrl-C listener
/// for the whole command, made first: a Ctrl-C while a read is in flight (a new listener
/// would not see a signal delivered before it existed) ends it too.
pub async fn in_session_until_ctrl_c<F, Fut>(client: &Client, body: F) -> anyhow::Result<()>
where
    F: FnOnce(Session) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let session = tokio::select! {
        s = client.open_session() => s?,
        _ = &mut ctrl_c => return Ok(()),
    };
    let r = tokio::select! {
        r = body(session.clone()) => r,
        _ = &mut ctrl_c => Ok(()),
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), session.close()).await;
    r
}

async fn watch_loop(session: &Session, args: &WatchArgs, json: bool) -> anyhow::Result<()> {
    let mut seen = 0u64;
    let mut expired = session.subscribe();
    loop {
        let w = read_and_arm(session, args, json).await?;
        if args.count.is_some_and(|n| seen >= n) {
            return Ok(());
        }
        tokio::select! {
            ev = w => {
                print_event(&ev?, json);
                seen += 1;
            }
            _ = expired.wait_for(|s| *s == client_sdk::SessionState::Expired) => {
                anyhow::bail!("the session expired: events may have been missed");
            }
        }
    }
}
