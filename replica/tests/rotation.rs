//! Rotation, expiry and revocation of certificates while the cell runs (issue 24, step 4;
//! docs/security.md, "Certificates and roles"), at real replica processes:
//!
//! - the replicas' certificate and key are reissued in place: within seconds every
//!   replica presents the new one to new connections (checked by serial), and the cell
//!   goes on (peers dial each other with it);
//! - a client's short-lived certificate is reissued before it expires: the client, its
//!   session and its requests go on past the old certificate's expiry, without a
//!   restart;
//! - a client whose certificate is not reissued stops working once it expires: its open
//!   connections are closed at the expiry and new handshakes refused;
//! - a certificate added to the replicas' revocation list stops working within seconds,
//!   open connections included; the others go on;
//! - a client whose own revocation list names the replicas' certificate refuses them at
//!   the handshake;
//! - the CA itself is rotated (a bundle of the old and the new CA, then the replicas'
//!   certificate from the new one, then the new CA alone): a client of the new CA gets in
//!   once the bundle is taken, the cell goes on throughout, and once the old CA is gone
//!   its clients are cut off, open connections included, with no replica restarted.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use client_sdk::{Client, CreateMode};
use common::{rt, serial, Opts, TestCell};
use wire::identity::Identity;

/// Writes `pem` to `path` whole (a rename), as an operator's tooling would.
fn replace(path: &Path, pem: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, pem).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Writes a certificate and key for `uri` valid `secs` seconds into `dir` (the SDK's
/// `client.pem`/`client.key` next to a copy of the CA).
fn client_files(cell: &TestCell, dir: &Path, uri: &str, secs: u32) -> String {
    let c = cell
        .ca_issuer()
        .issue_for_secs(&Identity::parse(uri).unwrap(), secs)
        .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(&cell.ca, dir.join(wire::tls::CA_FILE)).unwrap();
    replace(&dir.join(wire::tls::CLIENT_KEY_FILE), &c.key_pem);
    replace(&dir.join(wire::tls::CLIENT_CERT_FILE), &c.cert_pem);
    c.cert_pem
}

/// A client configuration on the files in `dir` (its CA, certificate and key).
fn config_in(cell: &TestCell, dir: &Path) -> client_sdk::ClientConfig {
    let mut cfg = cell.client_config();
    cfg.ca = dir.join(wire::tls::CA_FILE);
    cfg.cert = dir.join(wire::tls::CLIENT_CERT_FILE);
    cfg.key = dir.join(wire::tls::CLIENT_KEY_FILE);
    cfg.request_timeout = Duration::from_secs(5);
    cfg
}

async fn client_in(cell: &TestCell, dir: &Path) -> Client {
    Client::connect(config_in(cell, dir)).await.unwrap()
}

/// Reissues the replicas' certificate and key in place from `ca` and waits (up to 10 s
/// each) until every replica presents the new one to a new connection; returns its
/// serial.
async fn reissue_replicas(cell: &TestCell, ca: &wire::tls::Ca) -> Vec<u8> {
    let tls = cell.ca.parent().unwrap();
    let r = ca
        .issue(&Identity::parse("lock://dev/replica/dev").unwrap(), 30)
        .unwrap();
    let serial = wire::tls::serial_of(&r.cert_pem).unwrap();
    replace(&tls.join("replica.key"), &r.key_pem);
    replace(&tls.join("replica.pem"), &r.cert_pem);
    for id in cell.procs.keys() {
        let addr = cell.addr(*id);
        let seen = eventually(Duration::from_secs(10), || async {
            presented_serial(cell, &addr).await == serial
        })
        .await;
        assert!(seen, "replica {id} still presents its earlier certificate");
    }
    serial
}

/// The serial of the certificate the replica at `addr` presents to a new connection.
async fn presented_serial(cell: &TestCell, addr: &str) -> Vec<u8> {
    let tls = cell.ca.parent().unwrap();
    let (cfg, _) = wire::tls::client_config(
        &wire::tls::TlsConfig::client_in_dir(tls),
        wire::hello::ALPN_CLIENT,
    )
    .unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(wire::quic::client_config(cfg).unwrap());
    let conn = ep
        .connect(addr.parse().unwrap(), wire::tls::SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let chain = conn
        .peer_identity()
        .unwrap()
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .unwrap();
    conn.close(0u32.into(), b"done");
    wire::tls::serial_of_der(&chain[0]).unwrap()
}

/// Polls `f` every 200 ms until it is true or `within` passes.
async fn eventually<F, Fut>(within: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

#[test]
fn certificates_rotate_expire_and_are_revoked_while_the_cell_runs() {
    let _s = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts {
            replicas: 3,
            crl: true,
            ..Opts::default()
        });
        cell.keep_on_panic();
        let admin = cell.client().await;
        cell.wait_leader(&admin, Duration::from_secs(20), None)
            .await;
        let dir = cell.dir.path();

        // Two clients with certificates valid 20 s: A's will be reissued, B's not.
        let started = Instant::now();
        client_files(&cell, &dir.join("a"), "lock://client/a", 20);
        client_files(&cell, &dir.join("b"), "lock://client/b", 20);
        let a = client_in(&cell, &dir.join("a")).await;
        let b = client_in(&cell, &dir.join("b")).await;
        let sa = a.open_session().await.unwrap();
        sa.create("/a", b"1".to_vec(), CreateMode::default())
            .await
            .unwrap();
        assert!(b.get("/a").await.is_ok());

        // The replicas' certificate reissued in place (same identity, new key).
        let tls = cell.ca.parent().unwrap();
        let old = wire::tls::serial_of(&std::fs::read_to_string(tls.join("replica.pem")).unwrap())
            .unwrap();
        let new = reissue_replicas(&cell, &cell.ca_issuer()).await;
        assert_ne!(old, new);
        sa.set_data("/a", b"2".to_vec(), None).await.unwrap();

        // A's certificate reissued (valid a day) before the old one expires.
        client_files(&cell, &dir.join("a"), "lock://client/a", 86_400);
        // Past the old certificates' expiry (20 s after issue, plus margins).
        let past = Duration::from_secs(26).saturating_sub(started.elapsed());
        tokio::time::sleep(past).await;
        // A goes on, with its session (no restart): the replicas closed its connections
        // at the old expiry, and it reconnected with the new certificate.
        sa.set_data("/a", b"3".to_vec(), None).await.unwrap();
        assert_eq!(a.get("/a").await.unwrap().0, b"3".to_vec());
        assert!(sa.lease_valid(), "A's session lost its lease");
        // B's expired: refused.
        let refused = b.get("/a").await;
        assert!(
            refused.is_err(),
            "an expired certificate still works: {refused:?}"
        );

        // Revocation: C works, then its certificate is listed; its open connections
        // are closed and new ones refused; A goes on.
        let c_pem = client_files(&cell, &dir.join("c"), "lock://client/c", 86_400);
        let c = client_in(&cell, &dir.join("c")).await;
        let sc = c.open_session().await.unwrap();
        sc.create("/c", Vec::new(), CreateMode::default())
            .await
            .unwrap();
        let serial_c = wire::tls::serial_of(&c_pem).unwrap();
        let crl = cell.ca_issuer().crl(&[serial_c], 2, 30).unwrap();
        replace(&cell.crl(), &crl);
        let cut = eventually(Duration::from_secs(15), || async {
            c.get("/c").await.is_err()
        })
        .await;
        assert!(cut, "a revoked certificate still works");
        assert!(
            a.get("/c").await.is_ok(),
            "A was cut off by another's revocation"
        );
        assert!(sa.lease_valid());

        // The dialing side: a client whose own revocation list (`ClientConfig::crls`)
        // names the replicas' certificate refuses them at the handshake.
        client_files(&cell, &dir.join("d"), "lock://client/d", 86_400);
        let d_crl = dir.join("d").join("servers.crl");
        let d_cfg = || {
            let mut cfg = config_in(&cell, &dir.join("d"));
            cfg.crls = vec![d_crl.clone()];
            cfg
        };
        replace(&d_crl, &cell.ca_issuer().crl(&[], 1, 30).unwrap());
        let d = Client::connect(d_cfg()).await.unwrap();
        assert!(d.get("/a").await.is_ok());
        replace(
            &d_crl,
            &cell
                .ca_issuer()
                .crl(std::slice::from_ref(&new), 2, 30)
                .unwrap(),
        );
        let refused = match Client::connect(d_cfg()).await {
            Ok(c) => c.get("/a").await.map(|_| ()),
            Err(e) => Err(e),
        };
        assert!(
            refused.is_err(),
            "a client connected to servers whose certificate its list revokes"
        );
        assert!(a.get("/a").await.is_ok());
    });
}

#[test]
fn a_ca_is_rotated_while_the_cell_runs() {
    let _s = serial();
    rt().block_on(async {
        let cell = TestCell::start(Opts {
            replicas: 3,
            ..Opts::default()
        });
        cell.keep_on_panic();
        let admin = cell.client().await;
        cell.wait_leader(&admin, Duration::from_secs(20), None)
            .await;
        let dir = cell.dir.path();
        let old_ca = std::fs::read_to_string(&cell.ca).unwrap();

        // A client of the old CA, with its own copy of the old CA, and a session.
        client_files(&cell, &dir.join("old"), "lock://client/old", 86_400);
        let old = client_in(&cell, &dir.join("old")).await;
        let s_old = old.open_session().await.unwrap();
        s_old
            .create("/rot", b"0".to_vec(), CreateMode::default())
            .await
            .unwrap();

        // A new CA (a subject name of its own, as every CA generation needs) and a client
        // certificate from it, trusting both CAs (the replicas still present the old
        // CA's certificate).
        let new_ca = wire::tls::Ca::generate("lockservice rotated CA", 30).unwrap();
        let bundle = format!("{old_ca}{}", new_ca.cert_pem());
        let n_dir = dir.join("new");
        std::fs::create_dir_all(&n_dir).unwrap();
        let n = new_ca
            .issue(&Identity::parse("lock://client/new").unwrap(), 1)
            .unwrap();
        replace(&n_dir.join(wire::tls::CA_FILE), &bundle);
        replace(&n_dir.join(wire::tls::CLIENT_KEY_FILE), &n.key_pem);
        replace(&n_dir.join(wire::tls::CLIENT_CERT_FILE), &n.cert_pem);
        let n_cfg = || config_in(&cell, &n_dir);
        // Before the replicas trust the new CA, its client is refused.
        let early = match Client::connect(n_cfg()).await {
            Ok(c) => c.get("/rot").await.map(|_| ()),
            Err(e) => Err(e),
        };
        assert!(
            early.is_err(),
            "a client of a CA the cell does not trust got in"
        );

        // Step 1: the replicas trust both CAs. The new CA's client gets in without a
        // restart; the old one goes on.
        replace(&cell.ca, &bundle);
        let deadline = Instant::now() + Duration::from_secs(15);
        let newc = loop {
            if let Ok(c) = Client::connect(n_cfg()).await {
                if c.get("/rot").await.is_ok() {
                    break c;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the replicas never took the CA bundle"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let s_new = newc.open_session().await.unwrap();
        s_new.set_data("/rot", b"1".to_vec(), None).await.unwrap();
        s_old.set_data("/rot", b"2".to_vec(), None).await.unwrap();

        // Step 2: the replicas' certificate reissued by the new CA; every replica
        // presents it, and the cell (peers dialing each other) goes on.
        reissue_replicas(&cell, &new_ca).await;
        s_new.set_data("/rot", b"3".to_vec(), None).await.unwrap();

        // Step 3: the old CA withdrawn, from the replicas and from the new client. The
        // old CA's client is cut off, its open connections included; the new one goes
        // on with its session, and writes still commit (the replicas replicate to each
        // other under the new CA alone).
        replace(&cell.ca, new_ca.cert_pem());
        replace(&n_dir.join(wire::tls::CA_FILE), new_ca.cert_pem());
        let cut = eventually(Duration::from_secs(15), || async {
            old.get("/rot").await.is_err()
        })
        .await;
        assert!(cut, "a client of a withdrawn CA still works");
        for v in 4..8u8 {
            s_new.set_data("/rot", vec![b'0' + v], None).await.unwrap();
        }
        assert_eq!(newc.get("/rot").await.unwrap().0, b"7".to_vec());
        assert!(
            s_new.lease_valid(),
            "the new client's session lost its lease"
        );
        let late = match Client::connect(n_cfg()).await {
            Ok(c) => c.get("/rot").await.map(|(v, _)| v),
            Err(e) => Err(e),
        };
        assert_eq!(
            late.unwrap(),
            b"7".to_vec(),
            "a new connection of the new CA"
        );
    });
}
