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
//! request reaches the handler with its [`Caller`]: the connection's peer now and, once
//! certificates carry identities, who it is and whom a proxy acts for.

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
    /// The connection's remote address.
    pub peer: SocketAddr,
    /// The identity the connection's certificate proves: `None` while certificates carry
    /// no identities.
    pub identity: Option<String>,
    /// For a request a proxy forwards, the identity of the client it acts for: `None` for
    /// a client's own request. Only a proxy may act for another identity.
    pub on_behalf_of: Option<String>,
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
}

/// What a server does with its clients' connections and requests.
pub trait Handler: Send + Sync + 'static {
    /// What the server keeps for one connection, from its hello until it closes (a
    /// counter's guard, a limit on its requests in flight).
    type Connection: Send + Sync + 'static;

    /// Decides on a connection's hello (`hello` is the error if it could not be read):
    /// the connection's state, and the answer. With an error the client is told it and
    /// the connection closes; the state is kept until then.
    fn hello(&self, caller: &Caller, hello: Result<Hello, Error>)
        -> (Self::Connection, HelloReply);

    /// Answers one request (any but `Events`), received at `received`.
    fn request(
        &self,
        connection: &Self::Connection,
        caller: &Caller,
        req: Request,
        received: Instant,
    ) -> impl Future<Output = Response> + Send;

    /// Serves `session`'s event stream on `send` until it ends; `connection` is the QUIC
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

/// Serves the client-protocol connection `conn` with `handler` until it closes; the
/// requests in progress on it may hold up to `bytes_max` bytes at once.
pub async fn serve<H: Handler>(conn: quinn::Connection, handler: Arc<H>, bytes_max: usize) {
    let Some((mut send, hello)) = crate::quic::accept_hello(&conn).await else {
        return;
    };
    let caller = Arc::new(Caller::from_peer(conn.remote_address()));
    let (state, reply) = handler.hello(&caller, hello);
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
    fn a_forwarded_request_acts_as_the_client_it_is_forwarded_for() {
        let mut c = Caller::from_peer("127.0.0.1:9".parse().unwrap());
        assert_eq!(c.acting_as(), None);
        c.identity = Some("lock://cell-a/proxy/1".into());
        assert_eq!(c.acting_as(), Some("lock://cell-a/proxy/1"));
        c.on_behalf_of = Some("lock://client/payments".into());
        assert_eq!(c.acting_as(), Some("lock://client/payments"));
    }
}
