//! Lock holders' pins on their own nodes (see [`crate::cache`]): taken at a grant, read
//! again at the leader after every flush or invalidation, let go with the guard.

use std::sync::{Arc, Weak};
use std::time::Duration;

use wire::types::{Op, Reply};
use wire::Error;

use super::{Inner, Session, SessionState};
use crate::cache::Pin;

impl Session {
    /// Pins `path`, a node this session holds with `token`: reads it at the leader
    /// through the cache, then keeps the pin confirmed (read again after every flush or
    /// invalidation) until it is let go ([`Session::unpin`]), lost, or the session ends.
    pub(crate) async fn pin(
        &self,
        path: &str,
        token: u64,
        until: Option<tokio::time::Instant>,
    ) -> Arc<Pin> {
        /// Lets the pin go if the future is dropped before it is handed over.
        struct Unpin<'a>(&'a Session, Option<Arc<Pin>>);
        impl Drop for Unpin<'_> {
            fn drop(&mut self) {
                if let Some(p) = self.1.take() {
                    self.0.unpin(&p);
                }
            }
        }
        let pin = Arc::new(Pin::new(path, token));
        let changed = {
            let mut cache = self.inner.cache.lock().expect("cache lock");
            cache.add_pin(pin.clone());
            cache.pins_changed()
        };
        let mut held = Unpin(self, Some(pin.clone()));
        // A read counts only with the event stream up (see `Inner::stream_up`): a fresh
        // session's stream may still be connecting. Waited for up to a request timeout
        // (and not past the acquire's own deadline, `until`); past it the pin's keeper
        // reads it once the stream is up.
        let mut until_up = tokio::time::Instant::now() + self.request_timeout();
        if let Some(u) = until {
            until_up = until_up.min(u);
        }
        self.inner.wait_stream_up(until_up).await;
        self.confirm(&pin).await;
        held.1 = None;
        wire::rt::spawn(keep_pinned(
            Arc::downgrade(&self.inner),
            pin.clone(),
            changed,
        ));
        pin
    }

    /// Woken whenever a pin of this session is lost, unconfirmed, confirmed or let go.
    pub(crate) fn pins_changed(&self) -> Arc<tokio::sync::Notify> {
        self.inner.cache.lock().expect("cache lock").pins_changed()
    }

    /// Lets `pin` go.
    pub(crate) fn unpin(&self, pin: &Arc<Pin>) {
        self.inner.cache.lock().expect("cache lock").remove_pin(pin);
    }

    /// One cachable read of the pin's node at the leader, trusted only if the event
    /// stream was up, on one connection, from its start to its answer: confirms the pin
    /// if the node is still ours and the leader recorded us as its cacher; marks it lost
    /// if the node is gone, another's, or no longer this cell's.
    async fn confirm(&self, pin: &Pin) {
        if !self.lease_valid() {
            return;
        }
        let mark = self.inner.stream_mark();
        if mark.is_none() {
            // Read again once the stream is back (`keep_pinned`).
            return;
        }
        let generation = self.inner.cache.lock().expect("cache lock").generation();
        let lose = |pin: &Pin| self.inner.cache.lock().expect("cache lock").lose_pin(pin);
        let read = self
            .read(Op::CachedGet {
                path: pin.path.clone(),
            })
            .await;
        match read {
            Ok(Reply::CachedData {
                value, cachable, ..
            }) => match value {
                Some((_, stat)) if stat.token == pin.token => {
                    if cachable && self.lease_valid() && self.inner.stream_unchanged(mark) {
                        self.inner
                            .cache
                            .lock()
                            .expect("cache lock")
                            .confirm_pin(pin, generation);
                    }
                }
                // Gone, or another's node now: a linearizable answer.
                _ => lose(pin),
            },
            Err(Error::WrongCell { .. }) => lose(pin),
            Ok(_) | Err(_) => {}
        }
    }
}

/// Keeps `pin` confirmed: waits while it is, reads it again while it is not, at once and
/// then with a growing pause (100 ms to 1 s) cut short when the event stream is back or
/// the session is safe again. Ends when the pin is let go or lost, or the session ends
/// or is dropped.
async fn keep_pinned(inner: Weak<Inner>, pin: Arc<Pin>, changed: Arc<tokio::sync::Notify>) {
    let mut pause = Duration::from_millis(100);
    loop {
        let notified = changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if pin.released() || pin.lost() {
            return;
        }
        let Some(inner) = inner.upgrade() else { return };
        if inner.state() == SessionState::Expired {
            return;
        }
        if pin.pinned() {
            drop(inner);
            notified.await;
            pause = Duration::from_millis(100);
            continue;
        }
        let mut back = Box::pin(inner.reconnected.clone().notified_owned());
        back.as_mut().enable();
        let session = Session { inner };
        session.confirm(&pin).await;
        drop(session);
        if !pin.pinned() && !pin.lost() {
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = back => {}
            }
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}
