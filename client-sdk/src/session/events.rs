//! The session's event stream: kept open at the leader, watch events dispatched,
//! invalidations applied to the cache and acknowledged, watches re-armed after a
//! reconnection, and fail-overs announced.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use wire::types::{Op, Reply, Request};
use wire::Error;

use super::{Inner, SessionEvent, SessionState};

/// Keeps the session's event stream open at the leader, dispatches watch events, and after
/// every reconnection re-arms the watches (those whose node changed in the gap fire) and,
/// when the serving replica changed, announces a fail-over.
pub(super) async fn event_loop(inner: Arc<Inner>, _slot: crate::client::SessionSlot) {
    let mut state = inner.state_tx.subscribe();
    let mut serving: Option<std::net::SocketAddr> = None;
    let mut connected_before = false;
    loop {
        if inner.state() == SessionState::Expired {
            inner.watches.clear();
            return;
        }
        if inner.keepalives_stopped.load(Ordering::SeqCst) {
            // As if the process had died (`stop_keepalives`): it does not reconnect, so it
            // does not hear from the cell that its session ended either.
            return;
        }
        // Reads begun from now on are not trusted for the cache until the stream is back.
        inner.stream_up.store(false, Ordering::SeqCst);
        if connected_before {
            // The stream broke: invalidations may have been lost with it (and a new leader
            // knows nothing of what we cached). Drop everything before reconnecting; the
            // leader treats the reconnection as our confirmation that we did.
            inner.cache.lock().expect("cache lock").flush();
        }
        let req = Request {
            session: inner.id,
            request_id: 0,
            ack_below: 0,
            op: Op::Events,
        };
        let deadline = Instant::now() + inner.lease / 3;
        let (mut recv, addr) = match inner.client.open_stream(req, deadline).await {
            Ok((_opened, recv, addr)) => (recv, addr),
            Err(Error::SessionExpired { .. }) | Err(Error::UnknownSession { .. }) => {
                inner.set_state(SessionState::Expired);
                continue;
            }
            Err(e) => {
                tracing::debug!(session = inner.id, "event stream not open: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let failed_over = connected_before && serving != Some(addr);
        inner.stream_generation.fetch_add(1, Ordering::SeqCst);
        // Re-arm on every (re)connection: watches armed at another leader, or events
        // dropped while the stream was down, fire now if their node changed meanwhile.
        if !rearm(&inner, inner.watches.specs()).await {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if failed_over {
            let _ = inner.events.send(SessionEvent::FailOver);
        }
        // Cached reads are trusted again, on this connection; pins left unconfirmed by the
        // break are read again now, at this server.
        inner.stream_up.store(true, Ordering::SeqCst);
        inner.reconnected.notify_waiters();
        serving = Some(addr);
        connected_before = true;
        // Frames are read by their own task (a frame read is not cancel-safe), so the
        // leader check below can interrupt the wait without losing bytes.
        let (frames_tx, mut frames) = tokio::sync::mpsc::channel(256);
        let reader = wire::rt::spawn(async move {
            loop {
                let frame: Result<wire::types::Response, Error> =
                    wire::frame::read(&mut recv, wire::CLIENT_FRAME_BYTES_MAX).await;
                let end = !matches!(frame, Ok(Ok(_)));
                if frames_tx.send(frame).await.is_err() || end {
                    return;
                }
            }
        });
        // Requests that find another leader (this one may be deposed without knowing it
        // yet) move the stream there: woken when the client's leader changes, not by a
        // timer (a process with 50 000 sessions would wake 50 000 loops twice a second).
        let mut leader = inner.client.leader_changes();
        let moved = |l: &Option<std::net::SocketAddr>| l.is_some_and(|l| l != addr);
        if moved(&leader.borrow_and_update()) {
            reader.abort();
            continue;
        }
        loop {
            let frame = tokio::select! {
                f = frames.recv() => match f {
                    Some(f) => f,
                    None => break,
                },
                // Closed (or expired): stop at once rather than when the cell ends the
                // stream, so the client is let go with the session.
                _ = state.wait_for(|s| *s == SessionState::Expired) => break,
                changed = leader.changed() => {
                    if changed.is_err() || moved(&leader.borrow_and_update()) {
                        break;
                    }
                    continue;
                }
            };
            match frame {
                Ok(Ok(Reply::Event(ev))) => {
                    inner.watch_events.fetch_add(1, Ordering::Relaxed);
                    let later = inner.watches.dispatch(&ev);
                    if !later.is_empty() && !rearm(&inner, later).await {
                        break;
                    }
                }
                Ok(Ok(Reply::Invalidate { id, paths })) => {
                    tracing::debug!(session = inner.id, id, ?paths, "invalidation");
                    // Drop first, then acknowledge: the write waits for the acknowledgement.
                    inner.cache.lock().expect("cache lock").invalidate(&paths);
                    ack_invalidation(&inner, addr, id);
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(session = inner.id, "event stream error: {e}");
                    break;
                }
                Err(_) => break,
            }
        }
        reader.abort();
    }
}

/// Acknowledges invalidation `id` to the server whose event stream delivered it (through
/// the client's batcher). Retried for up to a lease: after that, the server has stopped
/// waiting for us anyway unless we kept renewing through it, and then our event stream is
/// there too and it sends what is unacknowledged again when the stream reconnects.
pub(super) fn ack_invalidation(inner: &Inner, addr: std::net::SocketAddr, id: u64) {
    inner
        .client
        .ack_invalidation(addr, inner.id, id, Instant::now() + inner.lease);
}

/// Re-arms watches at the leader, in chunks the cell accepts; those that fired in the gap
/// are dispatched at once. False if the cell could not be asked (the caller reconnects and
/// tries again).
pub(super) async fn rearm(inner: &Arc<Inner>, specs: Vec<wire::types::WatchSpec>) -> bool {
    for chunk in wire::types::rewatch_chunks(&specs) {
        let req = Request {
            session: inner.id,
            request_id: 0,
            ack_below: 0,
            op: Op::Rewatch {
                watches: chunk.to_vec(),
            },
        };
        match inner.client.call(req).await {
            Ok(Reply::Rewatched { fired }) => {
                for ev in fired {
                    inner.watch_events.fetch_add(1, Ordering::Relaxed);
                    let later = inner.watches.dispatch(&ev);
                    if !later.is_empty() && !Box::pin(rearm(inner, later)).await {
                        return false;
                    }
                }
            }
            Ok(other) => {
                tracing::warn!("unexpected answer to Rewatch: {other:?}");
                return false;
            }
            Err(Error::SessionExpired { .. }) => {
                inner.set_state(SessionState::Expired);
                return false;
            }
            Err(e) => {
                tracing::warn!(session = inner.id, "re-arming watches failed: {e}");
                return false;
            }
        }
    }
    true
}
