//! Certificates and rustls configuration.
//!
//! A cell runs with a CA of its own: every replica (and later every proxy) presents a
//! certificate signed by it for the DNS name [`SERVER_NAME`], and clients trust only that
//! CA. `DevCa` (feature `dev-ca`) makes such a CA and certificates with rcgen for local
//! cells and tests; production operators bring their own PEM files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A server's TLS files, as replicas and proxies configure them. Every server of a cell
/// presents a certificate signed by the cell's CA for the DNS name [`SERVER_NAME`];
/// `lockctl dev` generates such a set (`DevCa`, feature `dev-ca`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsConfig {
    /// The cell's CA certificate (PEM), trusted when dialing replicas.
    pub ca: PathBuf,
    /// This server's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl TlsConfig {
    /// The files `DevCa::write_to` writes into `dir` ([`CA_FILE`], [`CERT_FILE`],
    /// [`KEY_FILE`]).
    pub fn in_dir(dir: &Path) -> TlsConfig {
        TlsConfig {
            ca: dir.join(CA_FILE),
            cert: dir.join(CERT_FILE),
            key: dir.join(KEY_FILE),
        }
    }
}

/// The DNS name every server certificate carries and every client checks.
pub const SERVER_NAME: &str = "lockservice";

/// File names used inside a TLS directory (see `DevCa::write_to`).
pub const CA_FILE: &str = "ca.pem";
/// Server certificate file name.
pub const CERT_FILE: &str = "server.pem";
/// Server key file name.
pub const KEY_FILE: &str = "server.key";

/// A development certificate authority with one server certificate.
#[cfg(feature = "dev-ca")]
pub struct DevCa {
    /// CA certificate, PEM.
    pub ca_pem: String,
    /// Server certificate for [`SERVER_NAME`], `localhost` and `127.0.0.1`, PEM.
    pub cert_pem: String,
    /// The server certificate's private key, PEM.
    pub key_pem: String,
}

#[cfg(feature = "dev-ca")]
impl DevCa {
    /// Makes a fresh CA and a server certificate signed by it (ECDSA P-256 keys).
    pub fn generate() -> Result<DevCa, String> {
        DevCa::generate_with(&rcgen::PKCS_ECDSA_P256_SHA256)
    }

    /// Like [`DevCa::generate`], with Ed25519 keys (every signature the same length; an
    /// ECDSA one varies by a byte or two) derived from `seed` and fixed serial numbers, so
    /// the certificates, and with them the size of every handshake packet, are the same in
    /// every run. For the fault
    /// suite's simulation only: whoever knows the seed holds the keys.
    pub fn generate_ed25519_from_seed(seed: u64) -> Result<DevCa, String> {
        let e = |e: rcgen::Error| e.to_string();
        let key = |n: u64| -> Result<rcgen::KeyPair, String> {
            // PKCS#8 v1 of an Ed25519 key: a fixed prefix, then the 32-byte secret.
            let mut der = vec![
                0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
                0x04, 0x20,
            ];
            for i in 0..4u64 {
                let mut h = std::hash::DefaultHasher::new();
                std::hash::Hasher::write_u64(&mut h, seed);
                std::hash::Hasher::write_u64(&mut h, n * 4 + i);
                der.extend_from_slice(&std::hash::Hasher::finish(&h).to_le_bytes());
            }
            rcgen::KeyPair::try_from(der.as_slice()).map_err(e)
        };
        DevCa::build(key(0)?, key(1)?, true)
    }

    fn generate_with(alg: &'static rcgen::SignatureAlgorithm) -> Result<DevCa, String> {
        let e = |e: rcgen::Error| e.to_string();
        DevCa::build(
            rcgen::KeyPair::generate_for(alg).map_err(e)?,
            rcgen::KeyPair::generate_for(alg).map_err(e)?,
            false,
        )
    }

    fn build(
        ca_key: rcgen::KeyPair,
        key: rcgen::KeyPair,
        fixed_serials: bool,
    ) -> Result<DevCa, String> {
        let e = |e: rcgen::Error| e.to_string();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "lockservice dev CA");
        if fixed_serials {
            ca_params.serial_number = Some(rcgen::SerialNumber::from(1u64));
        }
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).map_err(e)?;

        let mut params = rcgen::CertificateParams::new(vec![
            SERVER_NAME.to_string(),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
        ])
        .map_err(e)?;
        if fixed_serials {
            params.serial_number = Some(rcgen::SerialNumber::from(2u64));
        }
        let cert = params.signed_by(&key, &ca).map_err(e)?;
        Ok(DevCa {
            ca_pem: ca.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `ca.pem`, `server.pem` and `server.key` into `dir` (created if missing).
    pub fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(CA_FILE), &self.ca_pem)?;
        std::fs::write(dir.join(CERT_FILE), &self.cert_pem)?;
        std::fs::write(dir.join(KEY_FILE), &self.key_pem)?;
        Ok(())
    }
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

/// A rustls server configuration from PEM files, with the given ALPN protocols.
pub fn server_config(
    cert_path: &Path,
    key_path: &Path,
    alpns: &[&[u8]],
) -> Result<rustls::ServerConfig, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_path)
        .map_err(|e| format!("{}: {e}", cert_path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", cert_path.display()))?;
    let key = PrivateKeyDer::from_pem_file(key_path)
        .map_err(|e| format!("{}: {e}", key_path.display()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| e.to_string())?;
    cfg.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
    Ok(cfg)
}

/// A rustls client configuration that trusts the CA in `ca_path`, speaking `alpn`.
pub fn client_config(ca_path: &Path, alpn: &[u8]) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in
        CertificateDer::pem_file_iter(ca_path).map_err(|e| format!("{}: {e}", ca_path.display()))?
    {
        let cert = cert.map_err(|e| format!("{}: {e}", ca_path.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", ca_path.display()))?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![alpn.to_vec()];
    Ok(cfg)
}
