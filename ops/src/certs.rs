//! `lockctl certs`: a CA for a cell, and certificates with identities for its replicas,
//! proxies and clients (docs/security.md).
//!
//! A TLS directory holds `ca.pem` and, per role, `<stem>.pem` and `<stem>.key`; the stems
//! default to the role (`replica`, `proxy`, `client`), which is where replicas and proxies
//! configured with `TlsConfig::*_in_dir` and the SDK (`client.pem` next to the CA) look.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use wire::identity::Identity;
use wire::tls::{Ca, CA_FILE, CA_KEY_FILE};

/// `lockctl certs ...`.
#[derive(Subcommand, Debug)]
pub enum CertsCommand {
    /// Make a new CA in DIR: `ca.pem` (give it to every replica, proxy and client) and
    /// `ca.key` (keep it safe: whoever holds it can mint any identity).
    ///
    /// Example: lockctl certs init /etc/lockservice/ca --name "payments cell CA"
    #[command(after_help = "Examples:\n  \
        lockctl certs init ca\n  \
        lockctl certs init /etc/lockservice/ca --name \"payments cell CA\" --days 1825")]
    Init {
        /// Where to write `ca.pem` and `ca.key` (created if missing; an existing CA there
        /// is not overwritten).
        dir: PathBuf,
        /// The CA's name (its subject's common name). Default: `lockservice CA` and the
        /// time it is made, so that each CA generation has a name of its own (servers
        /// match a revocation list to its CA by name).
        #[arg(long)]
        name: Option<String>,
        /// Days the CA is valid (at most 36 500).
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
    /// Issue a certificate and key with an identity, signed by the CA in --ca-dir.
    ///
    /// Examples:
    ///   lockctl certs issue --ca-dir ca --role replica --cell cell-a --name 3 --out r3
    ///   lockctl certs issue --ca-dir ca --role client --name payments-api --out app
    #[command(after_help = "Examples:\n  \
        lockctl certs issue --ca-dir ca --role replica --cell cell-a --name 3 --out r3\n  \
        lockctl certs issue --ca-dir ca --role client --name payments-api --out app --days 90")]
    Issue(IssueArgs),
    /// Revoke certificates: add them to the CA's revocation list in --crl (made if
    /// missing). Give the list to every replica and proxy (`tls.crls` in their
    /// configuration): they re-read it within seconds, refuse those certificates at the
    /// handshake and close the connections open with them.
    ///
    /// Example: lockctl certs revoke --ca-dir ca --crl ca/revoked.crl app/client.pem
    #[command(
        after_help = "Examples:\n  lockctl certs revoke --ca-dir ca --crl ca/revoked.crl app/client.pem"
    )]
    Revoke {
        /// The directory holding the CA's `ca.pem` and `ca.key`.
        #[arg(long)]
        ca_dir: PathBuf,
        /// The revocation list (PEM) to add them to.
        #[arg(long)]
        crl: PathBuf,
        /// The certificates (PEM files) to revoke.
        #[arg(required = true)]
        certs: Vec<PathBuf>,
    },
    /// Print a certificate's identity, role, issuer and validity.
    ///
    /// Example: lockctl certs show cell-data/tls/client.pem
    #[command(after_help = "Examples:\n  lockctl certs show cell-data/tls/client.pem")]
    Show {
        /// A PEM certificate file.
        file: PathBuf,
    },
}

/// The role a certificate is for.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `lock://<cell>/replica/<name>`: a replica of the cell.
    Replica,
    /// `lock://<cell>/proxy/<name>`: a proxy of the cell.
    Proxy,
    /// `lock://client/<name>`: an application or tool.
    Client,
    /// `lock://directory/<name>`: a directory instance (serves the map of prefixes to
    /// cells; reads it from the root cell).
    Directory,
}

/// `lockctl certs issue`.
#[derive(Args, Debug)]
pub struct IssueArgs {
    /// The directory holding the CA's `ca.pem` and `ca.key` (`lockctl certs init`).
    #[arg(long)]
    ca_dir: PathBuf,
    /// The certificate's role.
    #[arg(long, value_enum)]
    role: Role,
    /// The cell, for a replica or a proxy.
    #[arg(long)]
    cell: Option<String>,
    /// The name within the cell (a replica's, a proxy's) or the client's name.
    #[arg(long)]
    name: String,
    /// Where to write `<stem>.pem` and `<stem>.key` (and a copy of `ca.pem`, if none is
    /// there): a TLS directory for one process. Not the CA's directory, which holds
    /// `ca.key`: a directory copied to a server must not carry it.
    #[arg(long)]
    out: PathBuf,
    /// The files' stem. Default: the role (`replica.pem`, `replica.key`, ...), where the
    /// servers' example configurations and the SDK look.
    #[arg(long)]
    stem: Option<String>,
    /// Days the certificate is valid (at most 36 500).
    #[arg(long, default_value_t = 365)]
    days: u32,
    /// Replace existing files of that stem.
    #[arg(long)]
    force: bool,
}

/// Runs a `lockctl certs` command.
pub fn run(cmd: &CertsCommand) -> anyhow::Result<()> {
    match cmd {
        CertsCommand::Init { dir, name, days } => {
            let name = name.clone().unwrap_or_else(|| {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                format!("lockservice CA {secs}")
            });
            init(dir, &name, *days)
        }
        CertsCommand::Issue(a) => issue(a),
        CertsCommand::Show { file } => show(file),
        CertsCommand::Revoke { ca_dir, crl, certs } => revoke(ca_dir, crl, certs),
    }
}

fn revoke(ca_dir: &Path, crl: &Path, certs: &[PathBuf]) -> anyhow::Result<()> {
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()));
    let ca = Ca::from_pem(
        &read(&ca_dir.join(CA_FILE))?,
        &read(&ca_dir.join(CA_KEY_FILE))?,
    )
    .map_err(anyhow::Error::msg)?;
    let (mut serials, number) = if crl.exists() {
        wire::tls::crl_contents(&read(crl)?)
            .map_err(|e| anyhow::anyhow!("{}: {e}", crl.display()))?
    } else {
        (Vec::new(), 0)
    };
    for c in certs {
        let serial =
            wire::tls::serial_of(&read(c)?).map_err(|e| anyhow::anyhow!("{}: {e}", c.display()))?;
        if !serials.contains(&serial) {
            serials.push(serial);
        }
    }
    let pem = ca
        .crl(&serials, number + 1, 30)
        .map_err(anyhow::Error::msg)?;
    // Written whole, then renamed: a server never reads half a list.
    let tmp = crl.with_extension("crl.tmp");
    std::fs::write(&tmp, pem).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, crl).with_context(|| format!("write {}", crl.display()))?;
    println!(
        "{} now lists {} revoked certificate(s) (number {}); servers configured with it \
         reload it within seconds",
        crl.display(),
        serials.len(),
        number + 1
    );
    Ok(())
}

fn init(dir: &Path, name: &str, days: u32) -> anyhow::Result<()> {
    let (cert, key) = (dir.join(CA_FILE), dir.join(CA_KEY_FILE));
    if cert.exists() || key.exists() {
        anyhow::bail!(
            "{} already holds a CA ({} or {} exists); remove them first to make a new one",
            dir.display(),
            CA_FILE,
            CA_KEY_FILE
        );
    }
    let ca = Ca::generate(name, days).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::write(&cert, ca.cert_pem()).with_context(|| format!("write {}", cert.display()))?;
    wire::tls::write_private(&key, ca.key_pem())
        .with_context(|| format!("write {}", key.display()))?;
    println!(
        "made CA {name:?}, valid {days} days: {} (give it to every replica, proxy and \
         client) and {} (keep it secret)",
        cert.display(),
        key.display()
    );
    Ok(())
}

fn identity(a: &IssueArgs) -> anyhow::Result<Identity> {
    let uri = match (a.role, &a.cell) {
        (Role::Client, None) => format!("lock://client/{}", a.name),
        (Role::Client, Some(_)) => {
            anyhow::bail!("a client's identity names no cell (lock://client/<name>): drop --cell")
        }
        (Role::Directory, None) => format!("lock://directory/{}", a.name),
        (Role::Directory, Some(_)) => anyhow::bail!(
            "a directory instance's identity names no cell (lock://directory/<name>): drop --cell"
        ),
        (Role::Replica | Role::Proxy, None) => {
            anyhow::bail!("a replica's or proxy's identity names its cell: add --cell")
        }
        (Role::Replica, Some(cell)) => format!("lock://{cell}/replica/{}", a.name),
        (Role::Proxy, Some(cell)) => format!("lock://{cell}/proxy/{}", a.name),
    };
    Identity::parse(&uri).map_err(anyhow::Error::msg)
}

fn issue(a: &IssueArgs) -> anyhow::Result<()> {
    let id = identity(a)?;
    let read = |f: &str| {
        let p = a.ca_dir.join(f);
        std::fs::read_to_string(&p).with_context(|| {
            format!(
                "read {} (make a CA with `lockctl certs init {}`)",
                p.display(),
                a.ca_dir.display()
            )
        })
    };
    let ca = Ca::from_pem(&read(CA_FILE)?, &read(CA_KEY_FILE)?).map_err(anyhow::Error::msg)?;
    let out = a.out.clone();
    if out.join(CA_KEY_FILE).exists() {
        anyhow::bail!(
            "{} holds a CA key: issue into a directory of its own (--out), so that copying \
             it to a server does not copy the CA key",
            out.display()
        );
    }
    let stem = a.stem.clone().unwrap_or_else(|| id.role().to_string());
    let (cert, key) = (
        out.join(format!("{stem}.pem")),
        out.join(format!("{stem}.key")),
    );
    if !a.force && (cert.exists() || key.exists()) {
        anyhow::bail!(
            "{} or {} exists: choose another --stem or --out, or --force to replace them",
            cert.display(),
            key.display()
        );
    }
    let issued = ca.issue(&id, a.days).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    std::fs::write(&cert, &issued.cert_pem).with_context(|| format!("write {}", cert.display()))?;
    wire::tls::write_private(&key, &issued.key_pem)
        .with_context(|| format!("write {}", key.display()))?;
    let ca_copy = out.join(CA_FILE);
    if !ca_copy.exists() {
        std::fs::write(&ca_copy, ca.cert_pem())
            .with_context(|| format!("write {}", ca_copy.display()))?;
    }
    println!(
        "issued {id} for {} days: {} and {}",
        a.days,
        cert.display(),
        key.display()
    );
    Ok(())
}

fn show(file: &Path) -> anyhow::Result<()> {
    let info = wire::tls::describe(file).map_err(anyhow::Error::msg)?;
    match &info.identity {
        Ok(id) => {
            println!("identity:   {id}");
            println!("role:       {}", id.role());
            if let Some(cell) = id.cell() {
                println!("cell:       {cell}");
            }
        }
        Err(e) if info.is_ca => println!("identity:   none (a CA certificate: {e})"),
        Err(e) => println!("identity:   none: {e}"),
    }
    println!("subject:    {}", info.subject);
    println!("issuer:     {}", info.issuer);
    println!("serial:     {}", info.serial);
    println!("valid from: {}", info.not_before);
    println!("valid to:   {}", info.not_after);
    let left = info.expires_in_secs;
    if left < 0 {
        println!("EXPIRED {} ago", humantime::format_duration(secs(-left)));
    } else {
        println!("expires in: {}", humantime::format_duration(secs(left)));
    }
    if !info.dns_names.is_empty() {
        println!("dns names:  {}", info.dns_names.join(", "));
    }
    if info.is_ca {
        println!("a CA certificate");
    }
    Ok(())
}

fn secs(s: i64) -> std::time::Duration {
    std::time::Duration::from_secs(s.unsigned_abs())
}
