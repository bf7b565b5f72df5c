//! `lockctl ls -R` and `lockctl rm -r`: a subtree walked from the client, one level at a
//! time (the cell has no recursive read or delete; each listing is linearizable on its
//! own, the walk as a whole is not a snapshot).

use std::collections::VecDeque;
use std::io::{BufRead, IsTerminal, Write};

use client_sdk::{Client, Session};
use wire::types::NodeStat;
use wire::Error;

/// The most nodes one `ls -R` or `rm -r` walks; a larger subtree is refused with a
/// message (walk a part of it, or raise `--max-nodes`).
pub const MAX_NODES_DEFAULT: usize = 100_000;

/// Every node under `path` (not `path` itself), in path order (so each parent before its
/// children). Fails if there are more than `max` of them.
pub async fn walk(
    client: &Client,
    path: &str,
    max: usize,
) -> anyhow::Result<Vec<(String, NodeStat)>> {
    wire::path::validate(path)?;
    let mut out = Vec::new();
    let mut queue = VecDeque::from([path.to_string()]);
    while let Some(p) = queue.pop_front() {
        let children = match client.children(&p).await {
            Ok(c) => c,
            // Deleted since its parent was listed.
            Err(Error::NoNode { .. }) if p != path => continue,
            Err(e) => return Err(e.into()),
        };
        for (name, stat) in children {
            let child = wire::path::join(&p, &name);
            if stat.children_count > 0 {
                queue.push_back(child.clone());
            }
            out.push((child, stat));
            anyhow::ensure!(
                out.len() <= max,
                "more than {max} nodes under {path}: walk a part of it, or raise --max-nodes"
            );
        }
    }
    // Tree order: by path components, so each node comes right before its subtree.
    out.sort_by(|a, b| a.0.split('/').cmp(b.0.split('/')));
    Ok(out)
}

/// One line of `ls -R`.
pub fn line(path: &str, stat: &NodeStat) -> String {
    let mut s = format!(
        "{path}\tversion={} token={} data={}B children={}",
        stat.version, stat.token, stat.data_len, stat.children_count
    );
    if let Some(owner) = stat.ephemeral_owner {
        s.push_str(&format!(" ephemeral(session {owner})"));
    }
    s
}

/// `rm -r`: deletes `path` and everything under it, deepest first, after asking (or with
/// `yes`). Returns the number of nodes deleted.
pub async fn remove(client: &Client, path: &str, yes: bool, max: usize) -> anyhow::Result<usize> {
    anyhow::ensure!(
        path != "/",
        "rm -r / would delete the whole namespace: refused"
    );
    // The node itself must exist (a missing one is exit status 6, as for `rm`).
    client.get(path).await?;
    let nodes = walk(client, path, max).await?;
    if !yes {
        let question = format!(
            "delete {path} and the {} node(s) under it? [y/N] ",
            nodes.len()
        );
        anyhow::ensure!(
            std::io::stdin().is_terminal(),
            "rm -r {path} would delete {} node(s): pass --yes to do it without a terminal",
            nodes.len() + 1
        );
        eprint!("{question}");
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            anyhow::bail!("nothing deleted");
        }
    }
    let session = client.open_session().await?;
    let r = remove_in(&session, path, nodes, max).await;
    let _ = session.close().await;
    r
}

async fn remove_in(
    session: &Session,
    path: &str,
    nodes: Vec<(String, NodeStat)>,
    max: usize,
) -> anyhow::Result<usize> {
    let mut deleted = 0;
    // Deepest first: a parent's children are gone before it.
    let mut order: Vec<String> = nodes.into_iter().map(|(p, _)| p).collect();
    order.push(path.to_string());
    order.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
    for p in order {
        if delete_subtree_node(session, &p, max).await? {
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// Deletes `p`; when a child was created under it since the walk (`NotEmpty`), deletes
/// what is there now first, a bounded number of times. False if it was already gone.
async fn delete_subtree_node(session: &Session, p: &str, max: usize) -> anyhow::Result<bool> {
    for _ in 0..5 {
        match session.delete(p, None).await {
            Ok(()) => return Ok(true),
            Err(Error::NoNode { .. }) => return Ok(false),
            Err(Error::NotEmpty { .. }) => {
                let children = session.children(p).await?;
                anyhow::ensure!(
                    children.len() <= max,
                    "{p} gained more than {max} children while it was being deleted"
                );
                for (name, _) in children {
                    let child = wire::path::join(p, &name);
                    Box::pin(delete_subtree_node(session, &child, max)).await?;
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("{p} kept gaining children while it was being deleted: gave up")
}
