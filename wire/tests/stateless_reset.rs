//! A server killed (`kill -9`) and restarted at the same address tells clients still
//! holding connections to the old process at once, with a stateless reset, if both
//! processes use [`wire::quic::StableReset`] keys: all of 200 connections, so the reset
//! rate limit is no bottleneck. With quinn's defaults (random keys per process) a client
//! only learns of it from its idle timeout.
//!
//! The server must be a separate process that really dies, so this test runs without
//! libtest's harness (`harness = false`): started with `STATELESS_RESET_SERVE` set, the
//! binary is the server; otherwise it is the test, and starts itself as the server.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use wire::quic::{client_endpoint, server_endpoint_on, Sockets, StableReset};
use wire::tls::{DevCa, TlsConfig};

const ALPN: &[u8] = b"reset-test";
/// `STATELESS_RESET_SERVE=<addr>,<dir>,<stable|random>` makes this binary the server.
const SERVE: &str = "STATELESS_RESET_SERVE";

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match std::env::var(SERVE) {
        Ok(spec) => rt.block_on(serve(&spec)),
        Err(_) => rt.block_on(test()),
    }
}

/// The server: accepts connections and answers each stream's bytes with the same bytes.
async fn serve(spec: &str) {
    let mut it = spec.split(',');
    let (addr, dir, key) = (
        it.next()
            .expect("addr")
            .parse::<SocketAddr>()
            .expect("addr"),
        PathBuf::from(it.next().expect("dir")),
        it.next().expect("key"),
    );
    let tls = TlsConfig::replica_in_dir(&dir);
    let (server, _) = wire::tls::server_config(&tls, &[ALPN]).expect("tls");
    let reset = (key == "stable").then(|| {
        StableReset::from_key_file(&tls.key, &format!("test server at {addr}")).expect("key file")
    });
    let ep = server_endpoint_on(&Sockets::Os, addr, server, None, reset).expect("endpoint");
    // The test holds our stdin: if it dies (a panic, a kill), we end too.
    std::thread::spawn(|| {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        std::process::exit(0);
    });
    println!("ready");
    while let Some(incoming) = ep.accept().await {
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    if let Ok(b) = recv.read_to_end(1024).await {
                        let _ = send.write_all(&b).await;
                        let _ = send.finish();
                    }
                });
            }
        });
    }
}

/// A server process, killed when dropped (also when the test panics).
struct Server(Child);

impl Server {
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts the server and waits until it listens.
fn start(addr: SocketAddr, dir: &Path, key: &str) -> Server {
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .env(SERVE, format!("{addr},{},{key}", dir.display()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the server");
    let stdout = child.stdout.take().expect("stdout");
    let server = Server(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the server's ready line");
    assert_eq!(line.trim(), "ready", "the server did not start");
    server
}

async fn echo(conn: &quinn::Connection, msg: &[u8]) -> Result<Vec<u8>, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(msg).await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    recv.read_to_end(1024).await.map_err(|e| e.to_string())
}

/// Opens `n` connections to a server started with `key`, kills it, starts it again at
/// the same address and sends on every old connection at once. Returns how each old
/// connection ended and how long after the sends.
async fn old_connections_after_restart(
    dir: &Path,
    key: &str,
    n: usize,
) -> Vec<(quinn::ConnectionError, Duration)> {
    // A free loopback port, for both of the server's lives.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port");
    let mut first = start(addr, dir, key);
    let (client_tls, _) =
        wire::tls::client_config(&TlsConfig::client_in_dir(dir), ALPN).expect("tls");
    let ep = client_endpoint(client_tls, "127.0.0.1:0".parse().unwrap()).expect("client");
    let mut conns = Vec::new();
    for _ in 0..n {
        let conn = ep
            .connect(addr, wire::tls::SERVER_NAME)
            .expect("connect")
            .await
            .expect("handshake");
        assert_eq!(echo(&conn, b"hello").await.expect("echo"), b"hello");
        conns.push(conn);
    }

    // kill -9: the process sends nothing on its way out.
    first.kill();
    let _second = start(addr, dir, key);

    let sent = Instant::now();
    let ends = conns.into_iter().map(|conn| {
        tokio::spawn(async move {
            let r = tokio::time::timeout(Duration::from_secs(10), echo(&conn, b"again")).await;
            let took = sent.elapsed();
            assert!(
                matches!(r, Ok(Err(_))),
                "a send on a connection to a dead process must fail, got {r:?}"
            );
            (conn.close_reason().expect("the connection is closed"), took)
        })
    });
    let mut out = Vec::new();
    for e in ends.collect::<Vec<_>>() {
        out.push(e.await.expect("a connection's task"));
    }
    out
}

async fn test() {
    let dir = tempfile::tempdir().expect("tempdir");
    DevCa::generate()
        .expect("ca")
        .write_to(dir.path())
        .expect("write the certificates");

    // With stable keys: every old connection reset at once, 200 of them (quinn's default
    // of one reset per 20 ms would take 4 s for these, beyond the idle timeout).
    let ends = old_connections_after_restart(dir.path(), "stable", 200).await;
    let slowest = ends.iter().map(|(_, t)| *t).max().expect("connections");
    for (reason, took) in &ends {
        assert!(
            matches!(reason, quinn::ConnectionError::Reset),
            "with stable keys every old connection must end with a stateless reset, one \
             ended with {reason:?} after {took:?}"
        );
    }
    assert!(
        slowest < Duration::from_millis(1_500),
        "the slowest of {} resets took {slowest:?}; the idle timeout is {} ms",
        ends.len(),
        wire::quic::IDLE_TIMEOUT_MS
    );
    println!(
        "stable keys: {} connections reset, the slowest after {slowest:?}",
        ends.len()
    );

    // The control: quinn's random keys. The restarted server does not recognise the old
    // connection ids as its own (its id generator's key differs) and drops their packets
    // without a reset, so the client waits for its idle timeout.
    let ends = old_connections_after_restart(dir.path(), "random", 1).await;
    let (reason, took) = &ends[0];
    assert!(
        matches!(reason, quinn::ConnectionError::TimedOut),
        "with random keys per process the old connection ends by idle timeout, \
         ended with {reason:?}"
    );
    println!("random keys: {reason:?} after {took:?}");
    println!("stateless_reset: ok");
}
