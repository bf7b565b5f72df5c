//! Certificates and rustls configuration.
//!
//! A cell runs with a CA of its own: every replica (and later every proxy) presents a
//! certificate signed by it for the DNS name [`SERVER_NAME`], and clients trust only that
//! CA. [`DevCa`] makes such a CA and certificates with rcgen for local cells and tests;
//! production operators bring their own PEM files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A server's TLS files, as replicas and proxies configure them. Every server of a cell
/// presents a certificate signed by the cell's CA for the DNS name [`SERVER_NAME`];
/// `lockctl dev` generates such a set ([`DevCa`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsConfig {
    /// The cell's CA certificate (PEM), trusted when dialing replicas.
    pub ca: PathBuf,
    /// This server's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

/// The DNS name every server certificate carries and every client checks.
pub const SERVER_NAME: &str = "lockservice";

/// File names used inside a TLS directory (see [`DevCa::write_to`]).
pub const CA_FILE: &str = "ca.pem";
/// Server certificate file name.
pub const CERT_FILE: &str = "server.pem";
/// Server key file name.
pub const KEY_FILE: &str = "server.key";

/// A development certificate authority with one server certificate.
pub struct DevCa {
    /// CA certificate, PEM.
    pub ca_pem: String,
    /// Server certificate for [`SERVER_NAME`], `localhost` and `127.0.0.1`, PEM.
    pub cert_pem: String,
    /// The server certificate's private key, PEM.
    pub key_pem: String,
}

impl DevCa {
    /// Makes a fresh CA and a server certificate signed by it.
    pub fn generate() -> Result<DevCa, String> {
        let e = |e: rcgen::Error| e.to_string();
        let ca_key = rcgen::KeyPair::generate().map_err(e)?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "lockservice dev CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).map_err(e)?;

        let key = rcgen::KeyPair::generate().map_err(e)?;
        let params = rcgen::CertificateParams::new(vec![
            SERVER_NAME.to_string(),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
        ])
        .map_err(e)?;
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
    Arc::new(rustls::crypto::ring::default_provider())
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
