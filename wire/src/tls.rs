//! Certificates and rustls configuration.
//!
//! Every hop is mutual TLS. A cell runs with a CA of its own: every replica and proxy
//! presents a certificate signed by it for the DNS name [`SERVER_NAME`], and every
//! connection's other end presents one too, checked against the same CA. Each
//! certificate carries one identity ([`crate::identity`]) that says its role: only a
//! replica of the cell may speak the peer protocol, only a proxy of the cell may forward
//! for its clients. There is no plain-text listener, and no listener that takes a
//! connection without a certificate.
//!
//! `DevCa` (feature `dev-ca`) makes such a CA, and a certificate for each role, with
//! rcgen for local cells and tests; `lockctl certs` makes them for real cells.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, UnixTime};

use crate::identity::Identity;

/// A process's TLS files: the CA it trusts for the other end of every connection, and
/// its own certificate and key, whose identity says its role (a replica's, a proxy's or
/// a client's; [`crate::identity`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsConfig {
    /// The cell's CA certificate (PEM): every certificate the other end of a connection
    /// presents must chain to it.
    pub ca: PathBuf,
    /// This process's certificate chain (PEM), the leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// Certificate revocation lists (PEM) the CA published: a certificate they list is
    /// refused at the handshake, and a connection open with one is closed when a list
    /// naming it is loaded. Re-read, with the other files, when they change.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub crls: Vec<PathBuf>,
}

impl TlsConfig {
    /// A replica's files in a TLS directory as `DevCa::write_to` and `lockctl certs`
    /// write it ([`CA_FILE`], [`REPLICA_CERT_FILE`], [`REPLICA_KEY_FILE`]).
    pub fn replica_in_dir(dir: &Path) -> TlsConfig {
        TlsConfig {
            ca: dir.join(CA_FILE),
            cert: dir.join(REPLICA_CERT_FILE),
            key: dir.join(REPLICA_KEY_FILE),
            crls: Vec::new(),
        }
    }

    /// A proxy's files in a TLS directory ([`PROXY_CERT_FILE`], [`PROXY_KEY_FILE`]).
    pub fn proxy_in_dir(dir: &Path) -> TlsConfig {
        TlsConfig {
            ca: dir.join(CA_FILE),
            cert: dir.join(PROXY_CERT_FILE),
            key: dir.join(PROXY_KEY_FILE),
            crls: Vec::new(),
        }
    }

    /// A client's files in a TLS directory ([`CLIENT_CERT_FILE`], [`CLIENT_KEY_FILE`]).
    pub fn client_in_dir(dir: &Path) -> TlsConfig {
        TlsConfig {
            ca: dir.join(CA_FILE),
            cert: dir.join(CLIENT_CERT_FILE),
            key: dir.join(CLIENT_KEY_FILE),
            crls: Vec::new(),
        }
    }
}

/// The DNS name every server certificate carries and every client checks.
pub const SERVER_NAME: &str = "lockservice";

/// The CA certificate's file name in a TLS directory.
pub const CA_FILE: &str = "ca.pem";
/// The CA's private key file name (`lockctl certs`; `DevCa` writes one too).
pub const CA_KEY_FILE: &str = "ca.key";
/// The replicas' certificate file name in a TLS directory.
pub const REPLICA_CERT_FILE: &str = "replica.pem";
/// The replicas' key file name.
pub const REPLICA_KEY_FILE: &str = "replica.key";
/// The proxies' certificate file name in a TLS directory.
pub const PROXY_CERT_FILE: &str = "proxy.pem";
/// The proxies' key file name.
pub const PROXY_KEY_FILE: &str = "proxy.key";
/// A client's certificate file name in a TLS directory (the SDK's default next to the CA
/// it is given).
pub const CLIENT_CERT_FILE: &str = "client.pem";
/// A client's key file name.
pub const CLIENT_KEY_FILE: &str = "client.key";

/// The cell name `DevCa` issues its certificates for.
pub const DEV_CELL: &str = "dev";

/// The identity of `DevCa`'s client certificate: a development cell's admin.
pub const DEV_CLIENT: &str = "lock://client/dev";

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct CertAndKey {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM.
    pub key_pem: String,
}

impl std::fmt::Debug for CertAndKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CertAndKey(..)")
    }
}

/// A development certificate authority with a certificate for each role, all of cell
/// [`DEV_CELL`]: `lock://dev/replica/dev` (shared by the replicas of a dev cell),
/// `lock://dev/proxy/dev` and `lock://client/dev`.
#[cfg(feature = "dev-ca")]
pub struct DevCa {
    /// CA certificate, PEM.
    pub ca_pem: String,
    /// The CA's private key, PEM (written as `ca.key`, so `lockctl certs issue --ca-dir`
    /// can issue more for a dev cell).
    pub ca_key_pem: String,
    /// The replicas' certificate (also for [`SERVER_NAME`], `localhost` and `127.0.0.1`).
    pub replica: CertAndKey,
    /// The proxies' certificate (the same names).
    pub proxy: CertAndKey,
    /// A client's certificate.
    pub client: CertAndKey,
}

#[cfg(feature = "dev-ca")]
impl DevCa {
    /// Makes a fresh CA and a certificate for each role signed by it (ECDSA P-256 keys).
    pub fn generate() -> Result<DevCa, String> {
        let e = |e: rcgen::Error| e.to_string();
        let key = |_: u64| rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(e);
        DevCa::build(key, false)
    }

    /// Like [`DevCa::generate`], with Ed25519 keys (every signature the same length; an
    /// ECDSA one varies by a byte or two) derived from `seed` and fixed serial numbers, so
    /// the certificates, and with them the size of every handshake packet, are the same in
    /// every run. For the fault
    /// suite's simulation only: whoever knows the seed holds the keys.
    pub fn generate_ed25519_from_seed(seed: u64) -> Result<DevCa, String> {
        DevCa::build(|n| ed25519_from_seed(seed, n), true)
    }

    /// A certificate for `identity` from a CA made by [`DevCa::generate_ed25519_from_seed`]
    /// with `seed`: its key derived from `seed` and `n` (above 3: 0 to 3 are the CA's and
    /// the three roles'), serial `n + 1`. The same in every run, as the CA's are (the
    /// simulation's second cell and its directory instance). For the fault suite's
    /// simulation only.
    pub fn issue_ed25519_from_seed(
        &self,
        seed: u64,
        n: u64,
        identity: &Identity,
    ) -> Result<CertAndKey, String> {
        if n <= 3 {
            return Err(format!("key {n} is one of the dev CA's own (0 to 3)"));
        }
        let e = |e: rcgen::Error| e.to_string();
        let ca = self.ca()?;
        let key = ed25519_from_seed(seed, n)?;
        let params = leaf_params(identity, serial(true, n + 1))?;
        let cert = params.signed_by(&key, &ca.issuer).map_err(e)?;
        Ok(CertAndKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// `key(n)` gives the n-th key: 0 the CA's, then the replicas', proxies' and client's.
    fn build(
        key: impl Fn(u64) -> Result<rcgen::KeyPair, String>,
        fixed_serials: bool,
    ) -> Result<DevCa, String> {
        let e = |e: rcgen::Error| e.to_string();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "lockservice dev CA");
        ca_params.serial_number = Some(serial(fixed_serials, 1));
        let ca_key = key(0)?;
        let ca_key_pem = ca_key.serialize_pem();
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).map_err(e)?;
        let issue = |n: u64, identity: &Identity| -> Result<CertAndKey, String> {
            let k = key(n)?;
            let params = leaf_params(identity, serial(fixed_serials, n + 1))?;
            let cert = params.signed_by(&k, &ca).map_err(e)?;
            Ok(CertAndKey {
                cert_pem: cert.pem(),
                key_pem: k.serialize_pem(),
            })
        };
        let (cell, name) = (DEV_CELL.to_string(), "dev".to_string());
        Ok(DevCa {
            replica: issue(
                1,
                &Identity::Replica {
                    cell: cell.clone(),
                    name: name.clone(),
                },
            )?,
            proxy: issue(
                2,
                &Identity::Proxy {
                    cell,
                    name: name.clone(),
                },
            )?,
            client: issue(3, &Identity::Client { name })?,
            ca_pem: ca.pem(),
            ca_key_pem,
        })
    }

    /// The CA, to issue more certificates with.
    pub fn ca(&self) -> Result<Ca, String> {
        Ca::from_pem(&self.ca_pem, &self.ca_key_pem)
    }

    /// Writes the CA and every role's certificate and key into `dir` (created if
    /// missing): [`CA_FILE`], [`REPLICA_CERT_FILE`] and the others; keys readable by the
    /// owner only.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(CA_FILE), &self.ca_pem)?;
        write_private(&dir.join(CA_KEY_FILE), &self.ca_key_pem)?;
        for (pair, cert, key) in [
            (&self.replica, REPLICA_CERT_FILE, REPLICA_KEY_FILE),
            (&self.proxy, PROXY_CERT_FILE, PROXY_KEY_FILE),
            (&self.client, CLIENT_CERT_FILE, CLIENT_KEY_FILE),
        ] {
            std::fs::write(dir.join(cert), &pair.cert_pem)?;
            write_private(&dir.join(key), &pair.key_pem)?;
        }
        Ok(())
    }

    /// True if `dir` holds every file [`DevCa::write_to`] writes.
    pub fn complete_in(dir: &Path) -> bool {
        [
            CA_FILE,
            REPLICA_CERT_FILE,
            REPLICA_KEY_FILE,
            PROXY_CERT_FILE,
            PROXY_KEY_FILE,
            CLIENT_CERT_FILE,
            CLIENT_KEY_FILE,
        ]
        .iter()
        .all(|f| dir.join(f).exists())
    }
}

/// The `n`-th Ed25519 key derived from `seed` (see [`DevCa::generate_ed25519_from_seed`]).
#[cfg(feature = "dev-ca")]
fn ed25519_from_seed(seed: u64, n: u64) -> Result<rcgen::KeyPair, String> {
    // PKCS#8 v1 of an Ed25519 key: a fixed prefix, then the 32-byte secret.
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    for i in 0..4u64 {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hasher::write_u64(&mut h, seed);
        std::hash::Hasher::write_u64(&mut h, n * 4 + i);
        der.extend_from_slice(&std::hash::Hasher::finish(&h).to_le_bytes());
    }
    rcgen::KeyPair::try_from(der.as_slice()).map_err(|e| e.to_string())
}

/// A certificate authority that issues certificates with identities: what
/// `lockctl certs` keeps in `ca.pem` and `ca.key`.
#[cfg(feature = "dev-ca")]
pub struct Ca {
    cert_pem: String,
    key_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

#[cfg(feature = "dev-ca")]
impl Ca {
    /// A new CA named `name` (its subject's common name), valid for `days` from an hour
    /// ago (an hour's room for clocks behind), with an ECDSA P-256 key.
    pub fn generate(name: &str, days: u32) -> Result<Ca, String> {
        let e = |e: rcgen::Error| e.to_string();
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(e)?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(serial(false, 0));
        (params.not_before, params.not_after) = validity(days)?;
        let cert = params.self_signed(&key).map_err(e)?;
        Ca::from_pem(&cert.pem(), &key.serialize_pem())
    }

    /// The CA in `cert_pem` with its key `key_pem`.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, String> {
        let key = rcgen::KeyPair::from_pem(key_pem)
            .map_err(|e| format!("the CA's key does not parse: {e}"))?;
        let issuer = rcgen::Issuer::from_ca_cert_pem(cert_pem, key)
            .map_err(|e| format!("the CA's certificate does not parse: {e}"))?;
        Ok(Ca {
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            issuer,
        })
    }

    /// The CA's certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key, PEM.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A certificate for `identity` with a new key, valid for `days` from an hour ago, a
    /// random serial, and the server names for replicas and proxies ([`leaf_params`]).
    /// Checked against the CA before it is returned (a CA key that is not the CA
    /// certificate's is found here, not at the first handshake).
    pub fn issue(&self, identity: &Identity, days: u32) -> Result<CertAndKey, String> {
        let (from, until) = validity(days)?;
        self.issue_between(identity, from, until)
    }

    /// [`Ca::issue`] for `secs` seconds from now (valid from an hour ago): a short-lived
    /// certificate, for rotation drills and tests of expiry.
    pub fn issue_for_secs(&self, identity: &Identity, secs: u32) -> Result<CertAndKey, String> {
        let now = time::OffsetDateTime::now_utc();
        self.issue_between(
            identity,
            now - time::Duration::hours(1),
            now + time::Duration::seconds(secs.into()),
        )
    }

    fn issue_between(
        &self,
        identity: &Identity,
        from: time::OffsetDateTime,
        until: time::OffsetDateTime,
    ) -> Result<CertAndKey, String> {
        let e = |e: rcgen::Error| e.to_string();
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(e)?;
        let mut params = leaf_params(identity, serial(false, 0))?;
        (params.not_before, params.not_after) = (from, until);
        let cert = params.signed_by(&key, &self.issuer).map_err(e)?;
        let ca = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .map_err(|e| format!("the CA's certificate: {e}"))?;
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(ca)
            .map_err(|e| format!("the CA's certificate: {e}"))?;
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| e.to_string())?
            .verify_client_cert(cert.der(), &[], UnixTime::now())
            .map_err(|e| {
                format!("the issued certificate does not check against the CA (is ca.key the key of ca.pem?): {e}")
            })?;
        Ok(CertAndKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

#[cfg(feature = "dev-ca")]
impl Ca {
    /// A certificate revocation list (PEM) signed by this CA, listing the serial numbers
    /// `serials` (big-endian bytes, as [`serial_of`] gives them), numbered `number` (each
    /// new list a higher number), valid for `days` (webpki does not refuse an outdated
    /// list; the date tells operators when the next is due).
    pub fn crl(&self, serials: &[Vec<u8>], number: u64, days: u32) -> Result<String, String> {
        let e = |e: rcgen::Error| e.to_string();
        let now = time::OffsetDateTime::now_utc();
        let params = rcgen::CertificateRevocationListParams {
            this_update: now - time::Duration::minutes(5),
            next_update: now + time::Duration::days(days.max(1).into()),
            crl_number: rcgen::SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|s| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from_slice(s),
                    revocation_time: now - time::Duration::minutes(5),
                    reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        params.signed_by(&self.issuer).map_err(e)?.pem().map_err(e)
    }
}

/// The serial number of the first certificate in `pem` (big-endian bytes).
pub fn serial_of(pem: &str) -> Result<Vec<u8>, String> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| format!("not a PEM certificate: {e}"))?;
    serial_of_der(&der)
}

/// The serial number of the DER certificate `der` (big-endian bytes).
pub fn serial_of_der(der: &[u8]) -> Result<Vec<u8>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    Ok(cert.raw_serial().to_vec())
}

/// The serial numbers a PEM revocation list holds, and its number.
pub fn crl_contents(pem: &str) -> Result<(Vec<Vec<u8>>, u64), String> {
    let der = CertificateRevocationListDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| format!("not a PEM revocation list: {e}"))?;
    let (_, crl) = x509_parser::parse_x509_crl(&der)
        .map_err(|e| format!("the revocation list does not parse: {e}"))?;
    let serials = crl
        .iter_revoked_certificates()
        .map(|r| r.raw_serial().to_vec())
        .collect();
    let number = crl
        .crl_number()
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(0);
    Ok((serials, number))
}

/// The longest validity `Ca` gives (100 years).
#[cfg(feature = "dev-ca")]
pub const DAYS_MAX: u32 = 36_500;

/// From an hour ago to `days` from now.
#[cfg(feature = "dev-ca")]
fn validity(days: u32) -> Result<(time::OffsetDateTime, time::OffsetDateTime), String> {
    if !(1..=DAYS_MAX).contains(&days) {
        return Err(format!(
            "a certificate's validity must be 1 to {DAYS_MAX} days, not {days}"
        ));
    }
    let now = time::OffsetDateTime::now_utc();
    Ok((
        now - time::Duration::hours(1),
        now + time::Duration::days(days.into()),
    ))
}

/// A serial number: `n` when fixed (the simulation's certificates), else 16 random bytes
/// (rcgen's default is a hash of the public key, so a certificate reissued for the same
/// key would repeat its serial, and revoking one would revoke both).
#[cfg(feature = "dev-ca")]
fn serial(fixed: bool, n: u64) -> rcgen::SerialNumber {
    if fixed {
        return rcgen::SerialNumber::from(n);
    }
    use rand::RngCore;
    let mut b = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut b);
    // Positive: the first bit clear.
    b[0] &= 0x7f;
    rcgen::SerialNumber::from_slice(&b)
}

/// The parameters of a certificate for `identity`: its one SAN URI, and for replicas and
/// proxies the server names clients check ([`SERVER_NAME`], `localhost`, `127.0.0.1`);
/// usable for both ends of a connection (a replica dials its peers with it, a proxy the
/// replicas).
#[cfg(feature = "dev-ca")]
pub fn leaf_params(
    identity: &Identity,
    serial: rcgen::SerialNumber,
) -> Result<rcgen::CertificateParams, String> {
    let e = |e: rcgen::Error| e.to_string();
    let names = match identity {
        Identity::Client { .. } => Vec::new(),
        _ => vec![
            SERVER_NAME.to_string(),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
        ],
    };
    let mut params = rcgen::CertificateParams::new(names).map_err(e)?;
    params.subject_alt_names.push(rcgen::SanType::URI(
        rcgen::string::Ia5String::try_from(identity.to_string()).map_err(e)?,
    ));
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, identity.to_string());
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.serial_number = Some(serial);
    Ok(params)
}

/// Writes a private key readable by its owner only.
#[cfg(feature = "dev-ca")]
pub fn write_private(path: &Path, pem: &str) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    o.mode(0o600);
    let mut f = o.open(path)?;
    // `mode` applies only to a file created here: a replaced one keeps its old mode.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    f.write_all(pem.as_bytes())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    if random_fixed() {
        p.secure_random = &SEEDED;
    }
    Arc::new(p)
}

/// The randomness rustls draws for its own use (hello randoms, the extension order,
/// session and ticket ids): the operating system's unless [`fix_random`] seeded it.
#[derive(Debug)]
struct SeededRandom(std::sync::Mutex<Option<rand::rngs::StdRng>>);

static SEEDED: SeededRandom = SeededRandom(std::sync::Mutex::new(None));

impl rustls::crypto::SecureRandom for SeededRandom {
    fn fill(&self, buf: &mut [u8]) -> Result<(), rustls::crypto::GetRandomFailed> {
        use rand::RngCore;
        match self.0.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(rng) => {
                rng.fill_bytes(buf);
                Ok(())
            }
            None => rustls::crypto::ring::default_provider()
                .secure_random
                .fill(buf),
        }
    }
}

/// Draws rustls' own randomness (every configuration made from now on) and QUIC's
/// initial destination connection ids ([`crate::quic::client_config`]) from `seed`, in
/// the order they are drawn. For simulations only: a simulated server that no longer
/// knows a connection takes a late Initial packet for a new connection attempt and
/// removes its header protection with keys derived from the wrong connection id, so
/// whether the garbage reserved bits pass (and an `Incoming` is handed to the gateway)
/// is decided by those random bytes; a replay must draw the same ones.
pub fn fix_random(seed: u64) {
    use rand::SeedableRng;
    *SEEDED.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(rand::rngs::StdRng::seed_from_u64(
        seed ^ 0x746c_735f_7261_6e64,
    ));
}

/// True after [`fix_random`].
pub(crate) fn random_fixed() -> bool {
    SEEDED.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
}

/// `len` random bytes from [`fix_random`]'s generator, if it was seeded.
pub(crate) fn seeded_bytes(len: usize) -> Option<Vec<u8>> {
    use rand::RngCore;
    let mut g = SEEDED.0.lock().unwrap_or_else(|e| e.into_inner());
    let rng = g.as_mut()?;
    let mut b = vec![0u8; len];
    rng.fill_bytes(&mut b);
    Some(b)
}

/// The earliest `notAfter` (Unix seconds) of the certificates in the PEM file at `path`
/// (a chain's intermediate may expire before its leaf): what the servers report as
/// `lockservice_tls_certificate_expiry_timestamp_seconds`, for the alert on certificates
/// about to expire.
pub fn earliest_not_after(path: &Path) -> Result<i64, String> {
    chain_not_after(&read_certs(path)?).map_err(|e| format!("{}: {e}", path.display()))
}

/// The earliest `notAfter` (Unix seconds) of a chain's certificates.
fn chain_not_after(chain: &[CertificateDer<'_>]) -> Result<i64, String> {
    let mut earliest = i64::MAX;
    for cert in chain {
        let (_, c) = x509_parser::parse_x509_certificate(cert)
            .map_err(|e| format!("a certificate does not parse: {e}"))?;
        earliest = earliest.min(c.validity().not_after.timestamp());
    }
    Ok(earliest)
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: holds no certificate", path.display()));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn read_roots(ca_path: &Path) -> Result<Arc<rustls::RootCertStore>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in read_certs(ca_path)? {
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", ca_path.display()))?;
    }
    Ok(Arc::new(roots))
}

/// The verifier of the certificates connections present to a server: chained to the CA
/// in `ca_path`, valid now, for client authentication, and not on `crls` (the
/// certificate itself; a certificate whose issuer published no list passes). Every
/// connection must present one.
fn client_verifier(
    roots: &Arc<rustls::RootCertStore>,
    ca_path: &Path,
    crls: &[CertificateRevocationListDer<'static>],
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, String> {
    rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .with_crls(crls.iter().cloned())
        .only_check_end_entity_revocation()
        .allow_unknown_revocation_status()
        .build()
        .map_err(|e| format!("{}: {e}", ca_path.display()))
}

/// The verifier of the certificates servers present to this process: chained to the CA,
/// valid now, for [`SERVER_NAME`] and server authentication, and not on `crls`.
fn server_verifier(
    roots: &Arc<rustls::RootCertStore>,
    ca_path: &Path,
    crls: &[CertificateRevocationListDer<'static>],
) -> Result<Arc<rustls::client::WebPkiServerVerifier>, String> {
    rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
        .with_crls(crls.iter().cloned())
        .only_check_end_entity_revocation()
        .allow_unknown_revocation_status()
        .build()
        .map_err(|e| format!("{}: {e}", ca_path.display()))
}

/// The revocation lists in `paths` (PEM, any number per file).
fn read_crls(paths: &[PathBuf]) -> Result<Vec<CertificateRevocationListDer<'static>>, String> {
    let mut out = Vec::new();
    for path in paths {
        let crls: Vec<CertificateRevocationListDer<'static>> =
            CertificateRevocationListDer::pem_file_iter(path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .collect::<Result<_, _>>()
                .map_err(|e| format!("{}: {e}", path.display()))?;
        if crls.is_empty() {
            return Err(format!(
                "{}: holds no certificate revocation list (PEM \"X509 CRL\")",
                path.display()
            ));
        }
        out.extend(crls);
    }
    Ok(out)
}

/// What [`load_own`] found: this process's chain, key and identity, checked, and the CA
/// (read once, so the checks and the live verifier use the same one).
struct Own {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    identity: Identity,
    roots: Arc<rustls::RootCertStore>,
    crls: Vec<CertificateRevocationListDer<'static>>,
}

/// Loads `tls`'s certificate and key and checks that they fit together: the key is the
/// certificate's, the certificate chains to the CA and is valid now (the checks the
/// other end will make), and it carries one identity. Each error says which file to fix.
fn load_own(tls: &TlsConfig) -> Result<Own, String> {
    // The CA first: a missing CA file is the likeliest mistake, and the error names it.
    let roots = read_roots(&tls.ca)?;
    let certs = read_certs(&tls.cert)?;
    let key = read_key(&tls.key)?;
    let crls = read_crls(&tls.crls)?;
    rustls::sign::CertifiedKey::from_der(certs.clone(), key.clone_key(), &provider()).map_err(
        |e| {
            format!(
                "{} is not the key of the certificate in {}: {e}",
                tls.key.display(),
                tls.cert.display()
            )
        },
    )?;
    client_verifier(&roots, &tls.ca, &crls)?
        .verify_client_cert(&certs[0], &certs[1..], UnixTime::now())
        .map_err(|e| {
            format!(
                "the certificate in {} does not check against the CA in {} (is it signed \
                 by that CA, valid now, for client authentication, and not revoked?): {e}",
                tls.cert.display(),
                tls.ca.display()
            )
        })?;
    let identity =
        Identity::of_cert(&certs[0]).map_err(|e| format!("{}: {e}", tls.cert.display()))?;
    // A replica's or proxy's certificate also serves: for the name clients check, and
    // for server authentication.
    if !matches!(identity, Identity::Client { .. }) {
        let name =
            rustls::pki_types::ServerName::try_from(SERVER_NAME).map_err(|e| e.to_string())?;
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| format!("{}: {e}", tls.ca.display()))?
            .verify_server_cert(&certs[0], &certs[1..], &name, &[], UnixTime::now())
            .map_err(|e| {
                format!(
                    "the certificate in {} cannot serve: it must be for the DNS name {SERVER_NAME:?} \
                     and for server authentication: {e}",
                    tls.cert.display()
                )
            })?;
    }
    Ok(Own {
        certs,
        key,
        identity,
        roots,
        crls,
    })
}

/// The identity in `tls`'s certificate, after the checks a server makes at start: the
/// key fits the certificate, the CA signed it, it is valid now and carries one identity.
pub fn own_identity(tls: &TlsConfig) -> Result<Identity, String> {
    load_own(tls).map(|o| o.identity)
}

/// A rustls server configuration from `tls`'s files, with the given ALPN protocols, and
/// the identity it serves as. Every connection must present a certificate chained to
/// `tls.ca` (mutual TLS); TLS session resumption is off, so every connection's
/// certificate is verified afresh. Refuses files that do not fit together (see
/// [`own_identity`]).
pub fn server_config(
    tls: &TlsConfig,
    alpns: &[&[u8]],
) -> Result<(rustls::ServerConfig, Identity), String> {
    server_config_reloading(tls, alpns).map(|(cfg, id, _)| (cfg, id))
}

/// [`server_config`], whose files are re-read when they change ([`Reloading`]): every
/// later handshake uses the new certificate, key, CA and revocation lists. With the
/// [`Reloading`], to close connections whose certificate expires or is revoked
/// ([`Reloading::guard`]).
pub fn server_config_reloading(
    tls: &TlsConfig,
    alpns: &[&[u8]],
) -> Result<(rustls::ServerConfig, Identity, Arc<Reloading>), String> {
    let files = Reloading::open(tls)?;
    let identity = files.identity.clone();
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(Arc::new(ReloadingClientVerifier(files.clone())))
        .with_cert_resolver(Arc::new(ReloadingCert(files.clone())));
    // A resumed handshake takes the client's chain from the ticket without verifying it
    // again: no tickets, no resumption.
    cfg.send_tls13_tickets = 0;
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
    Ok((cfg, identity, files))
}

/// A rustls client configuration that trusts the CA in `tls.ca` and presents `tls`'s
/// certificate, speaking `alpn`; with the identity it presents. Refuses files that do not
/// fit together (see [`own_identity`]).
pub fn client_config(
    tls: &TlsConfig,
    alpn: &[u8],
) -> Result<(rustls::ClientConfig, Identity), String> {
    client_config_reloading(tls, alpn).map(|(cfg, id, _)| (cfg, id))
}

/// [`client_config`], with its [`Reloading`] files, to check a dialed connection's
/// server certificate again before using it ([`Reloading::verify_dialed`]).
pub fn client_config_reloading(
    tls: &TlsConfig,
    alpn: &[u8],
) -> Result<(rustls::ClientConfig, Identity, Arc<Reloading>), String> {
    let files = Reloading::open(tls)?;
    let identity = files.identity.clone();
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ReloadingServerVerifier(files.clone())))
        .with_client_cert_resolver(Arc::new(ReloadingCert(files.clone())));
    cfg.alpn_protocols = vec![alpn.to_vec()];
    Ok((cfg, identity, files))
}

/// How often at most a [`Reloading`] looks at its files again (a handshake asks
/// it; a server's watcher asks every [`RELOAD_POLL`]).
pub const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a server's watcher re-reads its files, so a new revocation list closes
/// open connections without waiting for a handshake.
pub const RELOAD_POLL: std::time::Duration = std::time::Duration::from_secs(2);

/// What [`Reloading`] holds from one reading of the files.
struct Loaded {
    /// The files' bytes when read (compared to see whether they changed).
    bytes: Vec<Vec<u8>>,
    key: Arc<rustls::sign::CertifiedKey>,
    client_verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    server_verifier: Arc<rustls::client::WebPkiServerVerifier>,
}

/// A process's TLS files, re-read when they change (rotation): at most once per
/// [`RELOAD_CHECK`], at the next handshake, or by a server's watcher. New files are used
/// only if they fit together as at start ([`own_identity`]'s checks) and name the same
/// identity; otherwise the old ones stay and the reason is logged. Open connections keep
/// the keys they agreed; [`Reloading::guard`] closes a server's connection whose peer
/// certificate expires, or no longer checks against the current CA and revocation lists.
pub struct Reloading {
    tls: TlsConfig,
    identity: Identity,
    state: std::sync::Mutex<(std::time::Instant, Arc<Loaded>)>,
    /// Bumped at every reload (connections' guards check their certificate again).
    generation: tokio::sync::watch::Sender<u64>,
    watching: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Reloading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reloading({})", self.tls.cert.display())
    }
}

fn read_all(tls: &TlsConfig) -> Vec<Vec<u8>> {
    std::iter::once(&tls.ca)
        .chain([&tls.cert, &tls.key])
        .chain(tls.crls.iter())
        .map(|p| std::fs::read(p).unwrap_or_default())
        .collect()
}

fn load(tls: &TlsConfig, bytes: Vec<Vec<u8>>) -> Result<(Identity, Loaded), String> {
    let own = load_own(tls)?;
    let key = rustls::sign::CertifiedKey::from_der(own.certs, own.key, &provider())
        .map_err(|e| format!("{}: {e}", tls.key.display()))?;
    Ok((
        own.identity,
        Loaded {
            bytes,
            key: Arc::new(key),
            client_verifier: client_verifier(&own.roots, &tls.ca, &own.crls)?,
            server_verifier: server_verifier(&own.roots, &tls.ca, &own.crls)?,
        },
    ))
}

impl Reloading {
    /// Reads and checks the files (an error says which to fix).
    pub fn open(tls: &TlsConfig) -> Result<Arc<Reloading>, String> {
        let bytes = read_all(tls);
        let (identity, loaded) = load(tls, bytes)?;
        Ok(Arc::new(Reloading {
            tls: tls.clone(),
            identity,
            state: std::sync::Mutex::new((std::time::Instant::now(), Arc::new(loaded))),
            generation: tokio::sync::watch::channel(0).0,
            watching: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The identity the files were opened with (a reload never changes it).
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// How many times new files were taken.
    pub fn generation(&self) -> u64 {
        *self.generation.borrow()
    }

    fn current(&self) -> Arc<Loaded> {
        self.check(false)
    }

    /// The loaded files, re-read first if [`RELOAD_CHECK`] has passed (or `now`) and they
    /// changed.
    fn check(&self, now: bool) -> Arc<Loaded> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !now && st.0.elapsed() < RELOAD_CHECK {
            return st.1.clone();
        }
        st.0 = std::time::Instant::now();
        let bytes = read_all(&self.tls);
        if bytes == st.1.bytes {
            return st.1.clone();
        }
        match load(&self.tls, bytes.clone()) {
            Ok((identity, loaded)) if identity == self.identity => {
                tracing::info!(cert = %self.tls.cert.display(), "TLS files changed: reloaded");
                st.1 = Arc::new(loaded);
                self.generation.send_modify(|g| *g += 1);
            }
            Ok((identity, _)) => {
                tracing::warn!(
                    cert = %self.tls.cert.display(),
                    "TLS files changed to another identity ({identity}, not {}): keeping the \
                     old ones",
                    self.identity
                );
                st.1 = seen(&st.1, bytes);
            }
            Err(e) => {
                tracing::warn!(
                    cert = %self.tls.cert.display(),
                    "TLS files changed but do not fit together (keeping the old ones): {e}"
                );
                st.1 = seen(&st.1, bytes);
            }
        }
        st.1.clone()
    }

    /// Re-reads the files every [`RELOAD_POLL`] while the process runs (once per
    /// `Reloading`; started by the first [`Reloading::guard`]).
    fn watch(self: &Arc<Self>) {
        if self
            .watching
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let me = Arc::downgrade(self);
        crate::rt::spawn(async move {
            loop {
                tokio::time::sleep(RELOAD_POLL).await;
                let Some(me) = me.upgrade() else { return };
                me.check(true);
            }
        });
    }

    /// Closes `conn` (a server's) when its peer's certificate expires, or, after new
    /// files were taken, when it no longer checks against the CA and revocation lists
    /// (revoked, or its CA no longer trusted). Ends with the connection.
    pub fn guard(self: &Arc<Self>, conn: quinn::Connection) {
        self.guard_with(conn, |loaded, chain| {
            loaded
                .client_verifier
                .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
                .map(|_| ())
        })
    }

    /// The generation of the files, re-read first if due ([`RELOAD_CHECK`]).
    pub fn generation_now(&self) -> u64 {
        self.current();
        self.generation()
    }

    /// Checks the certificate the server at the other end of `conn` (dialed by this
    /// process) presented, against the files as last loaded: valid now (not expired),
    /// chained to the CA, for [`SERVER_NAME`], and not on a revocation list. Returns the
    /// files' generation it was checked at and the earliest `notAfter` of the chain it
    /// presented (Unix seconds; an intermediate may expire before the leaf), so a caller
    /// can check again only when either has moved.
    pub fn verify_dialed(&self, conn: &quinn::Connection) -> Result<(u64, i64), String> {
        let generation = self.generation_now();
        let chain = conn
            .peer_identity()
            .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
            .ok_or("the server presented no certificate")?;
        let leaf = chain.first().ok_or("the server presented no certificate")?;
        let name =
            rustls::pki_types::ServerName::try_from(SERVER_NAME).map_err(|e| e.to_string())?;
        self.current()
            .server_verifier
            .verify_server_cert(leaf, &chain[1..], &name, &[], UnixTime::now())
            .map_err(|e| format!("the server's certificate no longer checks: {e}"))?;
        let not_after = chain_not_after(&chain).map_err(|e| format!("the server's chain: {e}"))?;
        Ok((generation, not_after))
    }

    fn guard_with(
        self: &Arc<Self>,
        conn: quinn::Connection,
        check: fn(&Loaded, &[CertificateDer<'static>]) -> Result<(), rustls::Error>,
    ) {
        self.watch();
        let Some(chain) = conn
            .peer_identity()
            .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
        else {
            return;
        };
        let Some(leaf) = chain.first().cloned() else {
            return;
        };
        let expires = x509_parser::parse_x509_certificate(&leaf)
            .ok()
            .map(|(_, c)| c.validity().not_after.timestamp())
            .unwrap_or(i64::MAX);
        let me = self.clone();
        let mut generation = self.generation.subscribe();
        // Files taken between the handshake and here: checked at once.
        generation.mark_changed();
        crate::rt::spawn(async move {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            // notAfter is inclusive to the second: expired one second after it.
            let left = std::time::Duration::from_secs(
                (expires - now + 1).clamp(0, 10 * 365 * 86_400) as u64,
            );
            let expiry = tokio::time::sleep(left);
            tokio::pin!(expiry);
            loop {
                tokio::select! {
                    _ = conn.closed() => return,
                    _ = &mut expiry => {
                        tracing::info!(remote = %conn.remote_address(), "closing a connection: its certificate expired");
                        conn.close(CLOSE_CERTIFICATE.into(), b"the certificate expired");
                        return;
                    }
                    changed = generation.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let current = me.current();
                        if let Err(e) = check(&current, &chain) {
                            tracing::info!(remote = %conn.remote_address(), "closing a connection: its certificate no longer checks: {e}");
                            let reason = format!("the certificate no longer checks: {e}");
                            conn.close(CLOSE_CERTIFICATE.into(), reason.as_bytes());
                            return;
                        }
                    }
                }
            }
        });
    }
}

/// The QUIC close code of a connection closed for its certificate (expired, revoked).
pub const CLOSE_CERTIFICATE: u32 = 5;

/// `old`, with `bytes` recorded as seen (files that were not taken are not looked at
/// again until they change once more).
fn seen(old: &Loaded, bytes: Vec<Vec<u8>>) -> Arc<Loaded> {
    Arc::new(Loaded {
        bytes,
        key: old.key.clone(),
        client_verifier: old.client_verifier.clone(),
        server_verifier: old.server_verifier.clone(),
    })
}

/// This process's certificate and key, as last loaded.
#[derive(Debug)]
struct ReloadingCert(Arc<Reloading>);

impl rustls::server::ResolvesServerCert for ReloadingCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.current().key.clone())
    }
}

impl rustls::client::ResolvesClientCert for ReloadingCert {
    fn resolve(
        &self,
        _: &[&[u8]],
        _: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.current().key.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The certificates connections present to a server, checked against the CA and
/// revocation lists as last loaded.
#[derive(Debug)]
struct ReloadingClientVerifier(Arc<Reloading>);

impl rustls::server::danger::ClientCertVerifier for ReloadingClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        // Optional hints; the CA may change under us, so none are given.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.0
            .current()
            .client_verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .client_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .client_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.current().client_verifier.supported_verify_schemes()
    }
}

/// The certificates servers present to this process, checked against the CA and
/// revocation lists as last loaded.
#[derive(Debug)]
struct ReloadingServerVerifier(Arc<Reloading>);

impl rustls::client::danger::ServerCertVerifier for ReloadingServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.0.current().server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.current().server_verifier.supported_verify_schemes()
    }
}

/// What a certificate says, for `lockctl certs show`.
#[derive(Debug, Clone)]
pub struct CertInfo {
    /// Its identity, or why it has none.
    pub identity: Result<Identity, String>,
    /// The subject's distinguished name.
    pub subject: String,
    /// The issuer's distinguished name.
    pub issuer: String,
    /// The serial number, hex.
    pub serial: String,
    /// Valid from (RFC 2822).
    pub not_before: String,
    /// Valid until (RFC 2822).
    pub not_after: String,
    /// Seconds until it expires (negative: expired that long ago).
    pub expires_in_secs: i64,
    /// Its DNS names.
    pub dns_names: Vec<String>,
    /// True for a CA certificate.
    pub is_ca: bool,
}

/// Describes the first certificate in the PEM file `path`.
pub fn describe(path: &Path) -> Result<CertInfo, String> {
    let certs = read_certs(path)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&certs[0])
        .map_err(|e| format!("{}: the certificate does not parse: {e}", path.display()))?;
    let dns_names = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|s| {
            s.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let validity = cert.validity();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(CertInfo {
        identity: Identity::of_cert(&certs[0]),
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        serial: cert.raw_serial_as_string(),
        not_before: validity.not_before.to_string(),
        not_after: validity.not_after.to_string(),
        expires_in_secs: validity.not_after.timestamp() - now,
        dns_names,
        is_ca: cert.is_ca(),
    })
}

#[cfg(all(test, feature = "dev-ca"))]
mod tests {
    use super::*;

    #[test]
    fn servers_require_client_certificates_and_never_resume() {
        let dir = tempfile::tempdir().unwrap();
        DevCa::generate().unwrap().write_to(dir.path()).unwrap();
        let (cfg, me) = server_config(&TlsConfig::replica_in_dir(dir.path()), &[b"x"]).unwrap();
        assert_eq!(me.to_string(), "lock://dev/replica/dev");
        assert_eq!(cfg.send_tls13_tickets, 0, "tickets would allow resumption");
        assert!(
            !cfg.session_storage.can_cache(),
            "a session cache allows resumption"
        );
        assert_eq!(cfg.max_early_data_size, 0);
    }

    #[test]
    fn a_server_certificate_must_carry_the_server_name_and_issued_ones_their_identity() {
        let dir = tempfile::tempdir().unwrap();
        let dev = DevCa::generate().unwrap();
        dev.write_to(dir.path()).unwrap();
        let ca = dev.ca().unwrap();
        // A proxy's certificate for another DNS name cannot serve: clients check the name.
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["elsewhere".to_string()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            rcgen::string::Ia5String::try_from("lock://dev/proxy/x").unwrap(),
        ));
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &ca.issuer).unwrap();
        std::fs::write(dir.path().join("elsewhere.pem"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("elsewhere.key"), key.serialize_pem()).unwrap();
        let files = TlsConfig {
            cert: dir.path().join("elsewhere.pem"),
            key: dir.path().join("elsewhere.key"),
            ..TlsConfig::proxy_in_dir(dir.path())
        };
        let e = server_config(&files, &[b"x"]).unwrap_err();
        assert!(e.contains("cannot serve"), "{e}");
        let id = Identity::parse("lock://cell-b/proxy/p2").unwrap();
        let issued = ca.issue(&id, 1).unwrap();
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        assert_eq!(Identity::of_cert(&der).unwrap(), id);
        assert!(ca.issue(&id, 0).is_err());
        assert!(ca.issue(&id, DAYS_MAX + 1).is_err());
        // A CA key that is not the CA's is found at issue time.
        let other = DevCa::generate().unwrap();
        let wrong = Ca::from_pem(&dev.ca_pem, &other.ca_key_pem).unwrap();
        let e = wrong.issue(&id, 1).unwrap_err();
        assert!(e.contains("does not check against the CA"), "{e}");
    }
}
