//! One request loop for every server of the client protocol: a replica's gateway and a
//! proxy answer their clients the same way, and differ only in what they do with each
//! request.
//!
//! [`serve`] owns everything around a request: the hello (answered as the server's
//! [`Handler::hello`] decides; a refused client is told why before the connection
//! closes), one request per bidirectional stream, the connection's budget of request
//! bytes in progress (a request's bytes stay reserved until its answer is written), the
//! `Events` request whose stream lasts as long as its session (handed to
//! [`Handler::events`] with the stream), and the answer or error encoded back. Every
//! request reaches the handler with the connection's [`Caller`]: its peer and the
//! identity its certificate proves (the server checked before calling [`serve`] that the
//! identity may use the connection: [`crate::identity::check_accepted`]). The caller is
//! the connection's, the same for all its requests; a handler that accepts requests a proxy forwards for its clients
//! derives each one's caller with [`Caller::forwarded_for`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use crate::frame;
use crate::hello::{Hello, HelloReply};
use crate::types::{Op, Request, Response, SessionId};
use crate::{Error, CLIENT_FRAME_BYTES_MAX};

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The connection's remote address when its hello arrived (a connection that
    /// migrates later keeps it).
    pub peer: SocketAddr,
    /// The identity the connection's certificate proves (its `lock://` URI); `None` only
    /// for a caller made with [`Caller::from_peer`], which no server connection is.
    pub identity: Option<String>,
    /// For a request a proxy forwards, the identity of the client it acts for (`None`
    /// for a connection's own requests). Set only by [`Caller::forwarded_for`], which
    /// refuses it unless the connection is a proxy's.
    on_behalf_of: Option<String>,
}

impl Caller {
    /// The caller on a connection from `peer`, with no identity.
    pub fn from_peer(peer: SocketAddr) -> Caller {
        Caller {
            peer,
            identity: None,
            on_behalf_of: None,
        }
    }

    /// The identity the request acts as: the client a proxy forwards it for, else the
    /// connection's own.
    pub fn acting_as(&self) -> Option<&str> {
        self.on_behalf_of.as_deref().or(self.identity.as_deref())
    }

    /// The client a proxy forwards for.
    pub fn on_behalf_of(&self) -> Option<&str> {
        self.on_behalf_of.as_deref()
    }

    /// The caller of a request this connection forwards for `client`: allowed only when
    /// `is_proxy` says the connection's own identity is a proxy's (the handler knows which
    /// identities are); anyone else is refused, so no client can act as another.
    pub fn forwarded_for(
        &self,
        client: String,
        is_proxy: impl Fn(&str) -> bool,
    ) -> Result<Caller, Error> {
        match self.identity.as_deref() {
            Some(me) if is_proxy(me) => Ok(Caller {
                on_behalf_of: Some(client),
                ..self.clone()
            }),
            me => Err(Error::BadRequest {
                reason: format!(
                    "{} may not act for {client:?}: only a proxy forwards for others",
                    me.unwrap_or("a connection without an identity")
                ),
            }),
        }
    }
}

/// What a server does with its clients' connections and requests.
pub trait Handler: Send + Sync + 'static {
    /// What the server keeps for one connection and shares with its requests (a limit on
    /// its requests in flight): it lives until the last of them ends.
    type Connection: Send + Sync + 'static;
    /// What the connection's loop holds until the connection closes, and no longer (a
    /// counter's guard): requests still running do not keep it.
    type Held: Send + 'static;

    /// Decides on a connection's hello (`hello` is the error if it could not be read):
    /// the connection's state, what its loop holds, and the answer. With an error the
    /// client is told it and the connection closes; both are kept until then.
    fn hello(
        &self,
        caller: &Caller,
        hello: Result<Hello, Error>,
    ) -> (Self::Connection, Self::Held, HelloReply);

    /// Answers one request (any but `Events`), received at `received`.
    fn request(
        &self,
        connection: &Self::Connection,
        caller: &Caller,
        req: Request,
        received: Instant,
    ) -> impl Future<Output = Response> + Send;

    /// Serves `session`'s event stream on `send` until it ends; `quic` is the QUIC
    /// connection it came on.
    fn events(
        &self,
        connection: &Self::Connection,
        caller: &Caller,
        session: SessionId,
        send: quinn::SendStream,
        quic: quinn::Connection,
    ) -> impl Future<Output = ()> + Send;
}

/// Serves the client-protocol connection `conn` of `identity` (what
/// [`crate::identity::check_accepted`] admitted) with `handler` until it closes; the
/// requests in progress on it may hold up to `bytes_max` bytes at once.
pub async fn serve<H: Handler>(
    conn: quinn::Connection,
    identity: crate::identity::Identity,
    handler: Arc<H>,
    bytes_max: usize,
) {
    let Some((mut send, hello)) = crate::quic::accept_hello(&conn).await else {
        return;
    };
    let mut caller = Caller::from_peer(conn.remote_address());
    caller.identity = Some(identity.to_string());
    let caller = Arc::new(caller);
    // `_held` is dropped when this loop returns: the connection is closed, whatever its
    // requests still running hold.
    let (state, _held, reply) = handler.hello(&caller, hello);
    let ok = reply.is_ok();
    let _ = frame::write(&mut send, &reply, frame::HELLO_BYTES_MAX).await;
    let _ = send.finish();
    if !ok {
        // Give the error frame time to reach the client before closing.
        let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
        conn.close(2u32.into(), b"hello refused");
        drop(state);
        return;
    }
    let state = Arc::new(state);
    let budget = frame::Budget::new(bytes_max);
    let exceeded = Arc::new(crate::quic::ExceededLog::default());
    loop {
        let (send, mut recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(_) => return,
        };
        let (handler, state, caller) = (handler.clone(), state.clone(), caller.clone());
        let (budget, exceeded, quic) = (budget.clone(), exceeded.clone(), conn.clone());
        crate::rt::spawn(async move {
            let received = Instant::now();
            let read =
                frame::read_request::<_, Request>(&mut recv, CLIENT_FRAME_BYTES_MAX, &budget);
            // The request's bytes stay reserved from the connection's budget until its
            // answer is written.
            let (resp, _reserved): (Response, _) = match read.await {
                // Event streams last as long as their session.
                Ok((req, reserved)) if req.op == Op::Events => {
                    drop(reserved);
                    handler
                        .events(&state, &caller, req.session, send, quic)
                        .await;
                    return;
                }
                Ok((req, reserved)) => (
                    handler.request(&state, &caller, req, received).await,
                    Some(reserved),
                ),
                Err(e) => {
                    exceeded.record(caller.peer, &e);
                    (Err(e), None)
                }
            };
            crate::quic::answer(send, &resp, CLIENT_FRAME_BYTES_MAX).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_proxy_acts_for_another_identity() {
        let is_proxy = |id: &str| id.contains("/proxy/");
        let mut c = Caller::from_peer("127.0.0.1:9".parse().unwrap());
        assert_eq!(c.acting_as(), None);
        // Without an identity, or with a client's, nobody may be acted for.
        assert!(c
            .forwarded_for("lock://client/payments".into(), is_proxy)
            .is_err());
        c.identity = Some("lock://client/indexer".into());
        assert_eq!(c.acting_as(), Some("lock://client/indexer"));
        assert!(c
            .forwarded_for("lock://client/payments".into(), is_proxy)
            .is_err());
        // A proxy's request for its client acts as the client.
        c.identity = Some("lock://cell-a/proxy/1".into());
        let f = c
            .forwarded_for("lock://client/payments".into(), is_proxy)
            .unwrap();
        assert_eq!(f.acting_as(), Some("lock://client/payments"));
        assert_eq!(f.on_behalf_of(), Some("lock://client/payments"));
        assert_eq!(c.acting_as(), Some("lock://cell-a/proxy/1"));
    }
}
