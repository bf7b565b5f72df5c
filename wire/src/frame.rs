//! Length-prefixed postcard frames.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of postcard. The
//! reader checks the length against a maximum *before* allocating, so a garbage length
//! cannot make a process allocate gigabytes.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::Error;

/// Encodes `msg` as one frame (length prefix included).
pub fn encode<T: Serialize>(msg: &T, max_bytes: usize) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; 4];
    let body = postcard::to_extend(msg, Vec::new()).map_err(|e| Error::Internal {
        reason: format!("encode: {e}"),
    })?;
    if body.len() > max_bytes {
        return Err(Error::FrameTooLarge {
            len: body.len(),
            max: max_bytes,
        });
    }
    buf[..4].copy_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    Ok(buf)
}

/// Decodes a frame body (without the length prefix).
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, Error> {
    postcard::from_bytes(body).map_err(|e| Error::Malformed {
        reason: e.to_string(),
    })
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

/// Reads one frame's body, refusing lengths above `max_bytes`. `Ok(None)` at a clean end
/// of stream before any byte of a new frame.
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    max_bytes: usize,
) -> Result<Option<Vec<u8>>, Error> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await.map_err(io_error)?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
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
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| Error::Malformed {
            reason: format!("stream ended inside a frame: {e}"),
        })?;
    Ok(Some(body))
}

/// Reads and decodes one frame; a clean end of stream is an error here.
pub async fn read<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    max_bytes: usize,
) -> Result<T, Error> {
    match read_body(r, max_bytes).await? {
        Some(body) => decode(&body),
        None => Err(Error::Connection {
            reason: "stream closed before a frame".into(),
        }),
    }
}

fn io_error(e: std::io::Error) -> Error {
    Error::Connection {
        reason: e.to_string(),
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
            let _ = decode::<Request>(&bytes);
        }
    }
}
