//! turmoil's simulated UDP under quinn: [`SimSockets`] binds the sockets of every QUIC
//! endpoint of the simulation, with seeded connection ids.

use std::future::Future;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wire::quic::SocketFactory;

/// Binds turmoil's simulated UDP sockets for QUIC endpoints; must be called from a task
/// of a turmoil host.
#[derive(Debug, Default)]
pub struct SimSockets {
    host: String,
    seed: u64,
    endpoints: std::sync::atomic::AtomicU64,
}

impl SimSockets {
    /// A factory whose endpoints' QUIC randomness comes from `seed` (and the order in
    /// which they are made).
    pub fn new(host: &str, seed: u64) -> SimSockets {
        SimSockets {
            host: host.into(),
            seed,
            endpoints: Default::default(),
        }
    }
}

/// Connection ids from a seeded generator (quinn's default draws them from the operating
/// system).
struct SeededCids(StdRng);

impl quinn::ConnectionIdGenerator for SeededCids {
    fn generate_cid(&mut self) -> quinn::ConnectionId {
        let mut b = [0u8; 8];
        self.0.fill(&mut b);
        quinn::ConnectionId::new(&b)
    }

    fn cid_len(&self) -> usize {
        8
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

impl SocketFactory for SimSockets {
    fn configure(&self, config: &mut quinn::EndpointConfig) {
        let n = self
            .endpoints
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut seed = [0u8; 32];
        StdRng::seed_from_u64(base).fill(&mut seed);
        config.rng_seed(Some(seed));
        let cids = std::sync::atomic::AtomicU64::new(0);
        config.cid_generator(move || {
            let k = cids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::new(SeededCids(StdRng::seed_from_u64(base ^ k ^ 0x6369_6473)))
        });
    }

    fn bind(&self, addr: SocketAddr) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        // turmoil's bind is `async` but completes at once (it only touches the simulated
        // world), so one poll finishes it.
        let mut bind = std::pin::pin!(turmoil::net::UdpSocket::bind(addr));
        let sock = match bind
            .as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
        {
            Poll::Ready(r) => r?,
            Poll::Pending => return Err(io::Error::other("simulated bind did not complete")),
        };
        let local = sock.local_addr()?;
        let sock = Arc::new(sock);
        // turmoil offers `recv_from` as a future only; a task turns it into a channel that
        // quinn's `poll_recv` can poll.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let reader = sock.clone();
        let host = self.host.clone();
        let task = wire::rt::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            while let Ok((n, from)) = reader.recv_from(&mut buf).await {
                if trace_datagrams() {
                    eprintln!(
                        "TRACE {:?} {host}:{} <- {from} {n}",
                        turmoil::elapsed(),
                        local.port()
                    );
                }
                if tx.send((buf[..n].to_vec(), from)).is_err() {
                    break;
                }
            }
        });
        Ok(Arc::new(SimUdp {
            host: self.host.clone(),
            sock,
            local,
            rx: Mutex::new(rx),
            reader: task.abort_handle(),
        }))
    }
}

type Datagram = (Vec<u8>, SocketAddr);

/// `SIM_TRACE=1`: print every datagram a simulated socket receives (simulated time,
/// receiver, sender, length), to find where two runs of one seed part ways.
fn trace_datagrams() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SIM_TRACE").is_some())
}

/// A turmoil UDP socket as quinn sees it.
#[derive(Debug)]
struct SimUdp {
    host: String,
    sock: Arc<turmoil::net::UdpSocket>,
    local: SocketAddr,
    rx: Mutex<tokio::sync::mpsc::UnboundedReceiver<Datagram>>,
    reader: tokio::task::AbortHandle,
}

impl Drop for SimUdp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Simulated sends never block.
#[derive(Debug)]
struct AlwaysWritable;

impl UdpPoller for AlwaysWritable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncUdpSocket for SimUdp {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(AlwaysWritable)
    }

    fn try_send(&self, t: &Transmit) -> io::Result<()> {
        if trace_datagrams() {
            eprintln!(
                "TRACE {:?} {}:{} -> {} {}",
                turmoil::elapsed(),
                self.host,
                self.local.port(),
                t.destination,
                t.contents.len()
            );
        }
        match t.segment_size {
            Some(seg) if seg > 0 => {
                for chunk in t.contents.chunks(seg) {
                    self.sock.try_send_to(chunk, t.destination)?;
                }
            }
            _ => {
                self.sock.try_send_to(t.contents, t.destination)?;
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let room = bufs.len().min(meta.len());
        let mut n = 0;
        while n < room {
            let (data, from) = if n == 0 {
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(d)) => d,
                    Poll::Ready(None) => {
                        return Poll::Ready(Err(io::Error::other("simulated socket closed")))
                    }
                    Poll::Pending => return Poll::Pending,
                }
            } else {
                match rx.try_recv() {
                    Ok(d) => d,
                    Err(_) => break,
                }
            };
            let len = data.len().min(bufs[n].len());
            bufs[n][..len].copy_from_slice(&data[..len]);
            meta[n] = RecvMeta {
                addr: from,
                len,
                stride: len,
                ..RecvMeta::default()
            };
            n += 1;
        }
        Poll::Ready(Ok(n))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    fn may_fragment(&self) -> bool {
        false
    }
}
