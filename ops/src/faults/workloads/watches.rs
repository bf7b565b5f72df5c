//! The watch workload: a watcher per register key re-reads after every event; its last
//! read must be the key's final value.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use client_sdk::{Client, Session, SessionState};

use super::{text, Run};

/// Watches one key of one epoch; once its writers moved on (and a write's retries could
/// have landed), the last value read must be the key's final value.
pub(super) async fn watcher(
    client: Client,
    session: Session,
    run: Arc<Run>,
    k: String,
    until: Instant,
) {
    let shared = session.id();
    let session = watch_key(&client, session, &run, &k, until).await;
    if session.id() != shared {
        let _ = session.close().await;
    }
}

/// [`watcher`]'s loop; returns the session it ended with (a new one if the first expired).
async fn watch_key(
    client: &Client,
    mut session: Session,
    run: &Run,
    k: &str,
    until: Instant,
) -> Session {
    let mut last: Option<String> = None;
    while Instant::now() < until {
        match tokio::time::timeout(
            until.saturating_duration_since(Instant::now()),
            session.get_watch(k),
        )
        .await
        {
            Ok(Ok((v, _, w))) => {
                last = Some(text(&v));
                tokio::select! {
                    _ = w => {}
                    _ = tokio::time::sleep_until(until) => break,
                }
            }
            Ok(Err(_)) => {
                last = None;
                if session.state() == SessionState::Expired {
                    if let Ok(s) = client.open_session().await {
                        session = s;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => break,
        }
    }
    let Some(last) = last else {
        return session;
    };
    for _ in 0..20 {
        if let Ok((v, _)) = client.get(k).await {
            let fin = text(&v);
            if fin != last {
                run.violation(format!(
                    "watcher of {k} missed a change: its last read was {last:?}, the final \
                     value is {fin:?}"
                ));
            }
            *run.watches_checked.lock().expect("lock") += 1;
            return session;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    session
}
