//! Mutual TLS and identities at real replica processes (issue 24, first step;
//! docs/security.md): who may connect, on which protocol, and what a replica refuses to
//! start with.
//!
//! - A client certificate from another CA, a connection without a certificate, a client
//!   certificate on the peer protocol, a replica certificate on the client protocol and a
//!   proxy certificate of another cell: each refused at the handshake or before its first
//!   frame is read, and the cell's state digest is the same before and after.
//! - The SDK names the problem: a client configured with a replica's certificate, or with
//!   a certificate its CA did not sign, fails at once with `BadRequest`.
//! - A replica started with a key that is not its certificate's, a certificate another CA
//!   signed, or a client's certificate, exits with an error that says what to fix.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use client_sdk::{Client, CreateMode};
use common::{rt, serial, Opts, TestCell};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use wire::hello::{Hello, HelloReply, ALPN_CLIENT, ALPN_PEER};
use wire::raft::PeerRequest;
use wire::tls::{DevCa, TlsConfig};
use wire::Error;

/// A rustls client configuration trusting the cell's CA (so the server's certificate
/// passes) and presenting `cert` (`None`: no certificate), built without the SDK's own
/// checks, as an attacker would.
fn raw_client(cell_ca: &Path, cert: Option<(&Path, &Path)>, alpn: &[u8]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(cell_ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let b = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots);
    let mut cfg = match cert {
        Some((cert, key)) => {
            let chain: Vec<_> = CertificateDer::pem_file_iter(cert)
                .unwrap()
                .map(|c| c.unwrap())
                .collect();
            b.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap())
                .unwrap()
        }
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![alpn.to_vec()];
    cfg
}

/// A refused connection: what it is, its certificate and key (`None`: no certificate),
/// its ALPN, and a piece of the reason it must be refused with.
type Case<'a> = (&'a str, Option<&'a (PathBuf, PathBuf)>, &'a [u8], &'a str);

/// A vote request for term 1 000 from node 99: had a refused peer connection been
/// served, the replica's term would jump.
fn vote_frame() -> PeerRequest {
    PeerRequest::Vote(openraft::raft::VoteRequest::new(
        wire::raft::Vote::new(1_000, 99),
        None,
    ))
}

/// Dials `addr` with `tls` and says a hello on the first stream (on the peer protocol it
/// then also asks for a vote in term 1 000); `Ok` if the server answered the hello, else
/// what failed (the handshake, or the connection closed with a reason).
async fn try_connect(addr: &str, tls: rustls::ClientConfig) -> Result<(), String> {
    let peer = tls.alpn_protocols.first().map(|a| a.as_slice()) == Some(ALPN_PEER);
    let ep = wire::quic::client_endpoint(tls, "127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = ep
        .connect(addr.parse().unwrap(), wire::tls::SERVER_NAME)
        .unwrap()
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let said = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        wire::frame::write(&mut send, &Hello::new("mtls test"), 4096)
            .await
            .map_err(|e| e.to_string())?;
        let _ = send.finish();
        let reply: HelloReply = wire::frame::read(&mut recv, 4096)
            .await
            .map_err(|e| e.to_string())?;
        reply.map(|_| ()).map_err(|e| e.to_string())
    };
    let said = async {
        let r = said.await;
        if peer {
            // Whatever the hello's fate, try the vote too.
            if let Ok((mut send, _recv)) = conn.open_bi().await {
                let _ = wire::frame::write(&mut send, &vote_frame(), 4096).await;
                let _ = send.finish();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        r
    };
    let r = tokio::time::timeout(Duration::from_secs(5), said)
        .await
        .unwrap_or_else(|_| Err("no answer in 5 s".into()));
    match (r, conn.close_reason()) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(reason)) => Err(format!("closed: {reason}")),
        (Err(e), None) => Err(e),
    }
}

#[test]
fn only_certified_identities_in_their_roles_get_in_and_nothing_changes() {
    let _s = serial();
    rt().block_on(async {
        // No lease checkpoints during the test (they are log entries, and would change
        // the state the test compares before and after).
        let cell = TestCell::start(Opts {
            replicas: 3,
            checkpoint_interval_ms: 3_600_000,
            ..Opts::default()
        });
        let client = cell.client().await;
        let leader = cell
            .wait_leader(&client, Duration::from_secs(20), None)
            .await;
        let s = client.open_session().await.unwrap();
        s.create("/cfg", b"v1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        // No session stays open: what sessions log (lease checkpoints, renewals) would
        // change the state between the two digests.
        s.close().await.unwrap();
        cell.assert_same_state(&client, Duration::from_secs(10))
            .await;
        let terms = |st: std::collections::BTreeMap<u64, wire::types::Status>| {
            st.into_iter()
                .map(|(id, s)| (id, s.term))
                .collect::<Vec<_>>()
        };
        let terms_before = terms(cell.statuses(&client).await);
        // One digest per replica per `DIGEST_INTERVAL`: the one above was just made.
        tokio::time::sleep(replica::gateway::DIGEST_INTERVAL * 2).await;
        let digest_before = client
            .state_digest_of(cell.addr(leader).parse().unwrap())
            .await
            .unwrap();

        let tls = cell.ca.parent().unwrap().to_path_buf();
        let other = cell.dir.path().join("other-ca");
        DevCa::generate().unwrap().write_to(&other).unwrap();
        let pair = |dir: &Path, stem: &str| {
            (
                dir.join(format!("{stem}.pem")),
                dir.join(format!("{stem}.key")),
            )
        };
        let (own_client, other_client) = (pair(&tls, "client"), pair(&other, "client"));
        let (own_replica, own_proxy) = (pair(&tls, "replica"), pair(&tls, "proxy"));
        // Certificates from the cell's own CA for another cell's replica and proxy.
        let ca = wire::tls::Ca::from_pem(
            &std::fs::read_to_string(&cell.ca).unwrap(),
            &std::fs::read_to_string(tls.join(wire::tls::CA_KEY_FILE)).unwrap(),
        )
        .unwrap();
        let foreign = cell.dir.path().join("foreign");
        std::fs::create_dir_all(&foreign).unwrap();
        for (stem, uri) in [
            ("replica", "lock://other/replica/9"),
            ("proxy", "lock://other/proxy/p1"),
        ] {
            let c = ca
                .issue(&wire::identity::Identity::parse(uri).unwrap(), 1)
                .unwrap();
            std::fs::write(foreign.join(format!("{stem}.pem")), c.cert_pem).unwrap();
            std::fs::write(foreign.join(format!("{stem}.key")), c.key_pem).unwrap();
        }
        let (foreign_replica, foreign_proxy) = (pair(&foreign, "replica"), pair(&foreign, "proxy"));

        for id in 1..=3u64 {
            let addr = cell.addr(id);
            // The control: the cell's own client certificate on the client protocol.
            let ok = raw_client(&cell.ca, Some((&own_client.0, &own_client.1)), ALPN_CLIENT);
            assert_eq!(try_connect(&addr, ok).await, Ok(()), "replica {id}");
            let refused: [Case; 7] = [
                (
                    "another cell's replica certificate on the peer protocol",
                    Some(&foreign_replica),
                    ALPN_PEER,
                    "may not speak the peer protocol",
                ),
                (
                    "another cell's proxy certificate",
                    Some(&foreign_proxy),
                    ALPN_CLIENT,
                    "proxy of another cell",
                ),
                (
                    "a client certificate from another CA",
                    Some(&other_client),
                    ALPN_CLIENT,
                    "handshake",
                ),
                ("no certificate", None, ALPN_CLIENT, "handshake"),
                (
                    "a client certificate on the peer protocol",
                    Some(&own_client),
                    ALPN_PEER,
                    "may not speak the peer protocol",
                ),
                (
                    "a replica certificate on the client protocol",
                    Some(&own_replica),
                    ALPN_CLIENT,
                    "replica's certificate",
                ),
                (
                    "another CA's replica certificate on the peer protocol",
                    Some(&pair(&other, "replica")),
                    ALPN_PEER,
                    "handshake",
                ),
            ];
            for (what, cert, alpn, why) in refused {
                let cfg = raw_client(
                    &cell.ca,
                    cert.map(|(c, k)| (c.as_path(), k.as_path())),
                    alpn,
                );
                let r = try_connect(&addr, cfg).await;
                let e = r.expect_err(&format!("replica {id} let in {what}"));
                assert!(e.contains(why), "replica {id}, {what}: {e}");
            }
            // A proxy certificate of this cell may use the client protocol.
            let proxy = raw_client(&cell.ca, Some((&own_proxy.0, &own_proxy.1)), ALPN_CLIENT);
            assert_eq!(
                try_connect(&addr, proxy).await,
                Ok(()),
                "replica {id}, proxy"
            );
        }

        // The SDK: a replica's certificate as a client's, and a certificate another CA
        // signed, are refused before any connection, with the reason.
        let mut cfg = cell.client_config();
        (cfg.cert, cfg.key) = own_replica.clone();
        match Client::connect(cfg).await {
            Err(Error::BadRequest { reason }) => {
                assert!(reason.contains("a replica's"), "{reason}")
            }
            other => panic!("a replica's certificate as a client's: {:?}", other.err()),
        }
        let mut cfg = cell.client_config();
        (cfg.cert, cfg.key) = other_client.clone();
        match Client::connect(cfg).await {
            Err(Error::BadRequest { reason }) => {
                assert!(reason.contains("does not check against the CA"), "{reason}")
            }
            other => panic!("another CA's certificate: {:?}", other.err()),
        }
        // A proxy certificate of another cell, from the cell's CA, passes the SDK's own
        // checks; the replicas close its connections with the reason, and the SDK says it
        // at once rather than retrying.
        let mut cfg = cell.client_config();
        (cfg.cert, cfg.key) = foreign_proxy.clone();
        let outsider = Client::connect(cfg).await.unwrap();
        let t = std::time::Instant::now();
        match outsider.open_session().await {
            Err(Error::BadRequest { reason }) => {
                assert!(
                    reason.contains("refused this client's certificate"),
                    "{reason}"
                );
                assert!(reason.contains("proxy of another cell"), "{reason}");
            }
            other => panic!("another cell's proxy opened a session: {:?}", other.err()),
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        // A client that trusts another CA cannot reach the cell; a TLS failure may be one
        // server's, so it tries every endpoint, and once every one refused it fails at
        // once (no retry fixes a certificate) with an error that names the handshake.
        let mut cfg = cell.client_config();
        cfg.ca = other.join(wire::tls::CA_FILE);
        (cfg.cert, cfg.key) = other_client.clone();
        cfg.request_timeout = Duration::from_secs(10);
        let stranger = Client::connect(cfg).await.unwrap();
        let t = std::time::Instant::now();
        match stranger.open_session().await {
            Err(e @ Error::Handshake { .. }) => {
                assert!(e.to_string().contains("handshake"), "{e}")
            }
            other => panic!("a client of another CA opened a session: {:?}", other.err()),
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "refused everywhere, yet tried for {:?}",
            t.elapsed()
        );

        // Nothing changed in the cell.
        let after = cell
            .assert_same_state(&client, Duration::from_secs(10))
            .await;
        tokio::time::sleep(replica::gateway::DIGEST_INTERVAL * 2).await;
        let digest_after = client
            .state_digest_of(cell.addr(leader).parse().unwrap())
            .await
            .unwrap();
        // The leader's state (its applied index and digest) is what it was, and every
        // replica holds that same state.
        assert_eq!(digest_before, digest_after);
        assert_eq!(after, digest_after.0, "the replicas hold another state");
        assert_eq!(
            terms_before,
            terms(cell.statuses(&client).await),
            "a refused vote counted"
        );
    });
}

/// Starts a replica with `tls` and returns its exit status and output (it must exit).
fn start_replica(cell: &TestCell, tls: TlsConfig) -> (bool, String) {
    start_replica_with(cell, tls, |_| {})
}

/// [`start_replica`] with a change to the rest of the configuration.
fn start_replica_with(
    cell: &TestCell,
    tls: TlsConfig,
    change: impl FnOnce(&mut replica::config::ReplicaConfig),
) -> (bool, String) {
    let (_, cfg) = &cell.configs[&1];
    let mut cfg = cfg.clone();
    cfg.tls = tls;
    change(&mut cfg);
    cfg.data_dir = cell.dir.path().join("misconfigured");
    let path = cell.dir.path().join("misconfigured.toml");
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    let log = cell.dir.path().join("misconfigured.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_replica"))
        .arg("--config")
        .arg(&path)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(cell.dir.path().join("misconfigured.err")).unwrap())
        .spawn()
        .unwrap();
    // It must exit by itself; one still running after 20 s started, which is a failure.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(cell.dir.path().join("misconfigured.err")).unwrap()
        + &std::fs::read_to_string(&log).unwrap();
    (status.is_some_and(|s| s.success()) || status.is_none(), out)
}

#[test]
fn a_misconfigured_replica_refuses_to_start_and_says_what_to_fix() {
    let _s = serial();
    let cell = TestCell::start(Opts {
        replicas: 1,
        ..Opts::default()
    });
    let tls = cell.ca.parent().unwrap().to_path_buf();
    let other = cell.dir.path().join("other-ca");
    DevCa::generate().unwrap().write_to(&other).unwrap();
    let good = TlsConfig::replica_in_dir(&tls);
    let cases = [
        (
            "a key that is not the certificate's",
            TlsConfig {
                key: tls.join("client.key"),
                ..good.clone()
            },
            "is not the key of the certificate",
        ),
        (
            "a certificate another CA signed",
            TlsConfig {
                cert: other.join("replica.pem"),
                key: other.join("replica.key"),
                ..good.clone()
            },
            "does not check against the CA",
        ),
        (
            "a client's certificate",
            TlsConfig::client_in_dir(&tls),
            "a replica needs one for lock://<cell>/replica/<name>",
        ),
        (
            "a missing key file",
            TlsConfig {
                key: tls.join("nope.key"),
                ..good.clone()
            },
            "nope.key",
        ),
    ];
    for (what, files, says) in cases {
        let (ok, out) = start_replica(&cell, files);
        assert!(!ok, "a replica started with {what}");
        assert!(out.contains(says), "{what}: {out}");
    }
    // A cell always has an admin: none configured is refused, and the error says what to
    // set.
    let (ok, out) = start_replica_with(&cell, good, |c| c.security.initial_admins.clear());
    assert!(!ok, "a replica started without an admin");
    assert!(
        out.contains("security.initial_admins is empty"),
        "no admin: {out}"
    );
}
