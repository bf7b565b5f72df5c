//! Length-prefixed postcard frames, read within bounds.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of postcard. What a
//! remote party can make a reader hold with it is bounded (DESIGN.md, safety rule 8):
//!
//! - **Bytes per stream.** The length is checked against the cap of the protocol
//!   (`CLIENT_FRAME_BYTES_MAX`, `PEER_FRAME_BYTES_MAX`, a hello's few KiB) before anything
//!   is allocated, and the body's buffer grows as bytes arrive ([`READ_CHUNK_BYTES`] at a
//!   time, doubling at most), never to the claimed length up front: a header claiming
//!   4 MiB followed by nothing costs a few bytes, not 4 MiB. (Before, `vec![0; len]` on
//!   every stream of three connections took a replica past 1.6 GB: `replica/tests/bounds.rs`.)
//! - **Time.** Once a frame's first byte has arrived, the rest must arrive within
//!   [`FRAME_DEADLINE_MS`]; a server wants a request's whole frame within that time of
//!   accepting its stream ([`read_request`]).
//! - **Bytes per connection.** A server reads requests against the connection's
//!   [`Budget`]: the bytes of a frame being read, and then of its decoded form, are
//!   reserved from it until the answer is sent. A reader that finds the budget spent
//!   waits (QUIC's flow control then holds the sender back) within the frame's deadline.
//! - **Decoding** is bounded in depth and in the bytes of sequences it builds
//!   ([`crate::decode`]).
//!
//! A bound exceeded is [`Error::LimitExceeded`] (or [`Error::FrameTooLarge`] for a
//! length); the server answers it on that stream and closes the stream.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::decode::Limits;
use crate::error::{Bound, Error};

/// Once the first byte of a frame has arrived, the rest must arrive within this many
/// milliseconds (for a request, from the moment its stream was accepted). The SDK gives an
/// attempt 6 s and openraft an InstallSnapshot chunk 5 s, so a frame slower than this is
/// one its sender has given up on; a 4 MiB client frame in 5 s is 0.8 MB/s.
pub const FRAME_DEADLINE_MS: u64 = 5_000;

/// A connection must open its first stream and send its hello within this many
/// milliseconds of its handshake, or it is closed: QUIC keep-alives would keep a
/// connection that never says hello open, holding its place under the connection limits,
/// for ever. A client sends its hello at once; 5 s allows a loaded host.
pub const HELLO_DEADLINE_MS: u64 = 5_000;

/// Largest hello (or hello answer) frame: an agent string and a version, or an error.
pub const HELLO_BYTES_MAX: usize = 4_096;

/// A frame's buffer grows by at most this many bytes (or doubles, if more) per read, as
/// its bytes arrive.
pub const READ_CHUNK_BYTES: usize = 64 * 1024;

/// Encodes `msg` as one frame (length prefix included).
pub fn encode<T: Serialize>(msg: &T, max_bytes: usize) -> Result<Vec<u8>, Error> {
    // The body is encoded after four bytes kept for its length, into one buffer (most
    // frames are small: a few dozen bytes).
    let mut buf = Vec::with_capacity(64);
    buf.extend_from_slice(&[0u8; 4]);
    let mut buf = postcard::to_extend(msg, buf).map_err(|e| Error::Internal {
        reason: format!("encode: {e}"),
    })?;
    let len = buf.len() - 4;
    if len > max_bytes {
        return Err(Error::FrameTooLarge {
            len,
            max: max_bytes,
        });
    }
    buf[..4].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(buf)
}

/// Decodes a frame body (without the length prefix) within the limits of a frame of up to
/// `max_bytes` ([`Limits::for_frame`]).
pub fn decode<T: DeserializeOwned>(body: &[u8], max_bytes: usize) -> Result<T, Error> {
    crate::decode::from_bytes(body, Limits::for_frame(max_bytes)).map(|(v, _)| v)
}

/// Writes one frame.
pub async fn write<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
    max_bytes: usize,
) -> Result<(), Error> {
    let buf = encode(msg, max_bytes)?;
    w.write_all(&buf).await.map_err(io_error)?;
    Ok(())
}

/// Reads one frame's body, refusing lengths above `max_bytes`, with the rest of the
/// frame due [`FRAME_DEADLINE_MS`] after its first byte. `Ok(None)` at a clean end of
/// stream before any byte of a new frame.
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    max_bytes: usize,
) -> Result<Option<Vec<u8>>, Error> {
    Ok(read_frame(r, max_bytes, None).await?.map(|(body, _)| body))
}

/// Reads and decodes one frame; a clean end of stream is an error here.
pub async fn read<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    max_bytes: usize,
) -> Result<T, Error> {
    match read_body(r, max_bytes).await? {
        Some(body) => decode(&body, max_bytes),
        None => Err(Error::Connection {
            reason: "stream closed before a frame".into(),
        }),
    }
}

/// Reads and decodes the one request frame of a stream a server accepted: the whole
/// frame within [`FRAME_DEADLINE_MS`] from now, its bytes and then its decoded form
/// reserved from the connection's `budget`. The returned [`Reserved`] holds them until
/// it is dropped: drop it once the answer is sent (or, for a stream that lives on, once
/// the request is taken apart).
pub async fn read_request<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    max_bytes: usize,
    budget: &Budget,
) -> Result<(T, Reserved), Error> {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(FRAME_DEADLINE_MS);
    let read = async {
        let Some((body, reserved)) = read_frame(r, max_bytes, Some(budget)).await? else {
            return Err(Error::Connection {
                reason: "stream closed before a frame".into(),
            });
        };
        let mut reserved = reserved.expect("a budget was given");
        let (msg, built) = crate::decode::from_bytes(&body, Limits::for_frame(max_bytes))?;
        // What the request holds from now on: its decoded sequences, and its strings and
        // byte strings (copies of at most the frame's bytes).
        let len = body.len();
        drop(body);
        reserved.reserve_to(len.saturating_add(built)).await?;
        Ok((msg, reserved))
    };
    match tokio::time::timeout_at(deadline, read).await {
        Ok(r) => r,
        Err(_) => Err(deadline_error()),
    }
}

fn deadline_error() -> Error {
    Error::LimitExceeded {
        bound: Bound::FrameDeadline,
        limit: FRAME_DEADLINE_MS,
    }
}

/// The header, then the body within the deadline of the first byte.
async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_bytes: usize,
    budget: Option<&Budget>,
) -> Result<Option<(Vec<u8>, Option<Reserved>)>, Error> {
    let mut len = [0u8; 4];
    let got = r.read(&mut len).await.map_err(io_error)?;
    if got == 0 {
        return Ok(None);
    }
    let rest = read_rest(r, len, got, max_bytes, budget);
    match tokio::time::timeout(Duration::from_millis(FRAME_DEADLINE_MS), rest).await {
        Ok(r) => r.map(Some),
        Err(_) => Err(deadline_error()),
    }
}

async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    mut len: [u8; 4],
    mut got: usize,
    max_bytes: usize,
    budget: Option<&Budget>,
) -> Result<(Vec<u8>, Option<Reserved>), Error> {
    while got < 4 {
        let n = r.read(&mut len[got..]).await.map_err(io_error)?;
        if n == 0 {
            return Err(Error::Malformed {
                reason: "stream ended inside a frame header".into(),
            });
        }
        got += n;
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max_bytes {
        return Err(Error::FrameTooLarge {
            len,
            max: max_bytes,
        });
    }
    let mut reserved = match budget {
        Some(b) => Some(b.reserve_none(len)?),
        None => None,
    };
    let mut body = Vec::new();
    while body.len() < len {
        if body.len() == body.capacity() {
            // Grow by a chunk, or double, but never past the frame's length.
            let target = (body.capacity() * 2)
                .max(body.len() + READ_CHUNK_BYTES)
                .min(len);
            if let Some(res) = &mut reserved {
                res.reserve_to(target).await?;
            }
            body.reserve_exact(target - body.len());
        }
        let spare = (body.capacity() - body.len()).min(len - body.len());
        let n = (&mut *r)
            .take(spare as u64)
            .read_buf(&mut body)
            .await
            .map_err(io_error)?;
        if n == 0 {
            return Err(Error::Malformed {
                reason: format!(
                    "stream ended inside a frame ({} of {len} bytes)",
                    body.len()
                ),
            });
        }
    }
    Ok((body, reserved))
}

fn io_error(e: std::io::Error) -> Error {
    Error::Connection {
        reason: e.to_string(),
    }
}

/// The bytes one connection's requests may hold at once while they are read, decoded and
/// answered ([`read_request`]); shared by every stream of the connection.
#[derive(Clone, Debug)]
pub struct Budget {
    sem: Arc<Semaphore>,
    bytes_max: usize,
}

impl Budget {
    /// A budget of `bytes_max` bytes (at most `u32::MAX`).
    pub fn new(bytes_max: usize) -> Budget {
        let bytes_max = bytes_max.min(u32::MAX as usize);
        Budget {
            sem: Arc::new(Semaphore::new(bytes_max)),
            bytes_max,
        }
    }

    /// The budget's size.
    pub fn bytes_max(&self) -> usize {
        self.bytes_max
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> usize {
        self.bytes_max - self.sem.available_permits()
    }

    /// An empty reservation for a request that will hold `len` bytes or more: refused
    /// at once if that can never fit.
    fn reserve_none(&self, len: usize) -> Result<Reserved, Error> {
        if len > self.bytes_max {
            return Err(self.exceeded());
        }
        Ok(Reserved {
            budget: self.clone(),
            permit: None,
        })
    }

    fn exceeded(&self) -> Error {
        Error::LimitExceeded {
            bound: Bound::ConnectionBytes,
            limit: self.bytes_max as u64,
        }
    }
}

/// Bytes reserved from a [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Reserved {
    budget: Budget,
    permit: Option<OwnedSemaphorePermit>,
}

impl Reserved {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.permit.as_ref().map_or(0, |p| p.num_permits())
    }

    /// Holds `total` bytes, waiting for the budget to have them; refused at once if the
    /// budget could never hold that many.
    async fn reserve_to(&mut self, total: usize) -> Result<(), Error> {
        if total > self.budget.bytes_max {
            return Err(self.budget.exceeded());
        }
        let more = total.saturating_sub(self.bytes());
        if more == 0 {
            return Ok(());
        }
        let p = self
            .budget
            .sem
            .clone()
            .acquire_many_owned(more as u32)
            .await
            .map_err(|_| self.budget.exceeded())?;
        match &mut self.permit {
            Some(held) => held.merge(p),
            None => self.permit = Some(p),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Op, Request};

    #[tokio::test]
    async fn round_trip_and_limits() {
        let req = Request {
            session: 7,
            request_id: 1,
            ack_below: 0,
            op: Op::Status,
        };
        let buf = encode(&req, 1024).unwrap();
        let mut r = &buf[..];
        let back: Request = read(&mut r, 1024).await.unwrap();
        assert_eq!(back, req);

        let big = [0xffu8, 0xff, 0xff, 0xff];
        let mut r = &big[..];
        assert!(matches!(
            read::<_, Request>(&mut r, 1024).await,
            Err(Error::FrameTooLarge { .. })
        ));

        let garbage = [0u8, 0, 0, 3, 0xff, 0xff, 0xff];
        let mut r = &garbage[..];
        assert!(matches!(
            read::<_, Request>(&mut r, 1024).await,
            Err(Error::Malformed { .. })
        ));

        let short = [0u8, 0, 0, 9, 1];
        let mut r = &short[..];
        assert!(matches!(
            read::<_, Request>(&mut r, 1024).await,
            Err(Error::Malformed { .. })
        ));
    }

    #[test]
    fn rewatch_chunks_fit_a_frame() {
        use crate::types::{rewatch_chunks, WatchKind, WatchSpec};
        let long = "/".to_string() + &"x".repeat(crate::PATH_BYTES_MAX - 1);
        let specs: Vec<WatchSpec> = (0..12_000)
            .map(|i| WatchSpec {
                path: if i % 2 == 0 {
                    long.clone()
                } else {
                    format!("/n{i}")
                },
                kind: WatchKind::Data,
                since_index: i,
            })
            .collect();
        let chunks = rewatch_chunks(&specs);
        assert_eq!(chunks.iter().map(|c| c.len()).sum::<usize>(), specs.len());
        for c in &chunks {
            assert!(c.len() <= crate::REWATCH_MAX);
            let req = Request {
                session: 1,
                request_id: 0,
                ack_below: 0,
                op: Op::Rewatch {
                    watches: c.to_vec(),
                },
            };
            encode(&req, crate::CLIENT_FRAME_BYTES_MAX).expect("fits a frame");
        }
        assert!(rewatch_chunks(&[]).is_empty());
    }

    proptest::proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = decode::<Request>(&bytes, crate::CLIENT_FRAME_BYTES_MAX);
        }
    }

    /// A frame whose first byte arrived but whose rest does not is given up after
    /// [`FRAME_DEADLINE_MS`] with the typed error (before, the reader waited for ever).
    #[tokio::test(start_paused = true)]
    async fn a_stalled_frame_times_out() {
        let (mut w, mut r) = tokio::io::duplex(1024);
        w.write_all(&[0, 0, 1, 0, 7]).await.unwrap();
        let t = tokio::time::Instant::now();
        let got = read_body(&mut r, 1024).await;
        assert_eq!(got.unwrap_err(), deadline_error());
        assert_eq!(t.elapsed(), Duration::from_millis(FRAME_DEADLINE_MS));
        // A request stream that never sends a byte is given up just the same.
        let (_w2, mut r2) = tokio::io::duplex(1024);
        let got = read_request::<_, Request>(&mut r2, 1024, &Budget::new(1 << 20)).await;
        assert_eq!(got.unwrap_err(), deadline_error());
        drop(w);
    }

    /// Requests on one connection share its budget: a second request waits while the
    /// first holds it, and goes on once the first is answered (its reservation dropped);
    /// a request that could never fit is refused at once.
    #[tokio::test(start_paused = true)]
    async fn requests_share_the_connection_budget() {
        let hello = crate::hello::Hello::new("x".repeat(140));
        let frame = encode(&hello, 1024).unwrap();
        let budget = Budget::new(200);
        let mut a = &frame[..];
        let (_, held) = read_request::<_, crate::hello::Hello>(&mut a, 1024, &budget)
            .await
            .unwrap();
        assert_eq!(held.bytes(), frame.len() - 4);
        assert_eq!(budget.in_use(), frame.len() - 4);
        let b = {
            let (budget, frame) = (budget.clone(), frame.clone());
            tokio::spawn(async move {
                let mut b = &frame[..];
                read_request::<_, crate::hello::Hello>(&mut b, 1024, &budget)
                    .await
                    .map(|(h, _)| h)
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!b.is_finished(), "the second request waits for the budget");
        drop(held);
        assert_eq!(b.await.unwrap().unwrap(), hello);
        assert_eq!(budget.in_use(), 0);

        let small = Budget::new(100);
        let mut c = &frame[..];
        let got = read_request::<_, crate::hello::Hello>(&mut c, 1024, &small).await;
        assert_eq!(
            got.unwrap_err(),
            Error::LimitExceeded {
                bound: Bound::ConnectionBytes,
                limit: 100
            }
        );
    }
}
