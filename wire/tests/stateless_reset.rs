//! A server killed (`kill -9`) and restarted at the same address tells a client still
//! holding a connection to the old process at once, with a stateless reset, if both
//! processes sign resets with [`wire::quic::StableReset`]; with quinn's default (a
//! random key per process) the client only learns of it from its idle timeout.
//!
//! The server must be a separate process that really dies, so this test runs without
//! libtest's harness (`harness = false`): started with `STATELESS_RESET_SERVE` set, the
//! binary is the server; otherwise it is the test, and starts itself as the server.

use std::io::{BufRead, BufReader};
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
    let tls = TlsConfig::in_dir(&dir);
    let server = wire::tls::server_config(&tls.cert, &tls.key, &[ALPN]).expect("tls");
    let reset = (key == "stable").then(|| {
        let secret = std::fs::read(&tls.key).expect("key file");
        StableReset::derive(&secret, addr)
    });
    let ep = server_endpoint_on(&Sockets::Os, addr, server, None, reset).expect("endpoint");
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

/// Starts the server and waits until it listens.
fn start(addr: SocketAddr, dir: &Path, key: &str) -> Child {
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .env(SERVE, format!("{addr},{},{key}", dir.display()))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the server's ready line");
    assert_eq!(line.trim(), "ready", "the server did not start");
    child
}

async fn echo(conn: &quinn::Connection, msg: &[u8]) -> Result<Vec<u8>, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(msg).await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    recv.read_to_end(1024).await.map_err(|e| e.to_string())
}

/// Connects to a server started with `key`, kills it, starts it again at the same address
/// and sends on the old connection. Returns how the old connection ended and how long
/// after that send.
async fn old_connection_after_restart(dir: &Path, key: &str) -> (quinn::ConnectionError, Duration) {
    // A free loopback port, for both of the server's lives.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port");
    let mut first = start(addr, dir, key);
    let client_tls = wire::tls::client_config(&dir.join(wire::tls::CA_FILE), ALPN).expect("tls");
    let ep = client_endpoint(client_tls, "127.0.0.1:0".parse().unwrap()).expect("client");
    let conn = ep
        .connect(addr, wire::tls::SERVER_NAME)
        .expect("connect")
        .await
        .expect("handshake");
    assert_eq!(echo(&conn, b"hello").await.expect("echo"), b"hello");

    // kill -9: the process sends nothing on its way out.
    first.kill().expect("kill");
    first.wait().expect("wait");
    let mut second = start(addr, dir, key);

    let sent = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), echo(&conn, b"again")).await;
    let took = sent.elapsed();
    let _ = second.kill();
    let _ = second.wait();
    assert!(
        matches!(r, Ok(Err(_))),
        "a send on a connection to a dead process must fail, got {r:?}"
    );
    let reason = conn.close_reason().expect("the connection is closed");
    (reason, took)
}

async fn test() {
    let dir = tempfile::tempdir().expect("tempdir");
    DevCa::generate()
        .expect("ca")
        .write_to(dir.path())
        .expect("write the certificates");

    // With the stable key: reset at once.
    let (reason, took) = old_connection_after_restart(dir.path(), "stable").await;
    assert!(
        matches!(reason, quinn::ConnectionError::Reset),
        "with a stable reset key the old connection must end with a stateless reset, \
         ended with {reason:?}"
    );
    assert!(
        took < Duration::from_millis(1_500),
        "the reset took {took:?}; the idle timeout is {} ms",
        wire::quic::IDLE_TIMEOUT_MS
    );
    println!("stable key: {reason:?} after {took:?}");

    // The control: quinn's random key. The restarted server's reset carries a token the
    // client does not know, so the client waits for its idle timeout.
    let (reason, took) = old_connection_after_restart(dir.path(), "random").await;
    assert!(
        matches!(reason, quinn::ConnectionError::TimedOut),
        "with a random key per process the old connection ends by idle timeout, \
         ended with {reason:?}"
    );
    println!("random key: {reason:?} after {took:?}");
    println!("stateless_reset: ok");
}
