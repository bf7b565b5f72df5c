//! Who is at the other end of a connection: the identity its certificate proves.
//!
//! Every hop is mutual TLS, and every certificate carries exactly one identity as a SAN
//! URI (`docs/security.md`):
//!
//! | identity | role |
//! |---|---|
//! | `lock://<cell>/replica/<name>` | a replica of `<cell>`: the only one that may speak the peer protocol to the cell's replicas |
//! | `lock://<cell>/proxy/<name>` | a proxy of `<cell>`: connects to the cell's replicas as a client and forwards for its own clients |
//! | `lock://client/<name>` | a client: connects to replicas or proxies of any cell that trusts its CA |
//! | `lock://directory/<name>` | a directory instance: serves the map of prefixes to cells to clients, and reads it from the root cell as a client of its own |
//!
//! A certificate's chain, validity and revocation are rustls' to check at the handshake;
//! the identity in it, and whether its role fits the connection ([`admit`]), are ours,
//! checked right after the handshake before any frame is read.

use std::fmt;

/// The URI scheme of every identity.
pub const SCHEME: &str = "lock://";

/// Longest cell or name in an identity.
pub const NAME_BYTES_MAX: usize = 64;

/// An identity a certificate proves.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Identity {
    /// `lock://client/<name>`: an application (or a tool such as `lockctl`).
    Client {
        /// The client's name.
        name: String,
    },
    /// `lock://<cell>/replica/<name>`: a replica of `cell`.
    Replica {
        /// The cell it belongs to.
        cell: String,
        /// Its name within the cell.
        name: String,
    },
    /// `lock://<cell>/proxy/<name>`: a proxy of `cell`.
    Proxy {
        /// The cell it serves.
        cell: String,
        /// Its name within the cell.
        name: String,
    },
    /// `lock://directory/<name>`: a directory instance (of no one cell).
    Directory {
        /// The instance's name.
        name: String,
    },
}

/// A part of an identity (a cell or a name): 1 to [`NAME_BYTES_MAX`] bytes of lowercase
/// ASCII letters, digits, `.`, `_` and `-`, not `.` or `..` (lowercase only, so two
/// spellings of one cell cannot differ).
fn check_part(what: &str, part: &str, uri: &str) -> Result<(), String> {
    if part.is_empty() || part.len() > NAME_BYTES_MAX {
        return Err(format!(
            "{uri:?}: the {what} must be 1 to {NAME_BYTES_MAX} characters"
        ));
    }
    if let Some(c) = first_bad_name_char(part) {
        return Err(format!(
            "{uri:?}: the {what} may hold only lowercase letters, digits, '.', '_' and '-', \
             not {c:?}"
        ));
    }
    if part == "." || part == ".." {
        return Err(format!("{uri:?}: the {what} cannot be {part:?}"));
    }
    Ok(())
}

/// The first character of `name` that a cell's, a name's or a group's name may not hold
/// (only lowercase ASCII letters, digits, `.`, `_` and `-` are allowed).
pub(crate) fn first_bad_name_char(name: &str) -> Option<char> {
    name.chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')))
}

impl Identity {
    /// Parses `lock://client/<name>`, `lock://<cell>/replica/<name>` or
    /// `lock://<cell>/proxy/<name>`; the error says what is wrong.
    pub fn parse(uri: &str) -> Result<Identity, String> {
        let rest = uri
            .strip_prefix(SCHEME)
            .ok_or_else(|| format!("{uri:?} is not an identity: it must start with {SCHEME:?}"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let id = match parts.as_slice() {
            ["client", name] => {
                check_part("client's name", name, uri)?;
                Identity::Client {
                    name: name.to_string(),
                }
            }
            ["directory", name] => {
                check_part("directory's name", name, uri)?;
                Identity::Directory {
                    name: name.to_string(),
                }
            }
            [cell, role @ ("replica" | "proxy"), name] => {
                check_part("cell", cell, uri)?;
                check_part("name", name, uri)?;
                if *cell == "client" {
                    return Err(format!("{uri:?}: \"client\" cannot be a cell's name"));
                }
                let (cell, name) = (cell.to_string(), name.to_string());
                if *role == "replica" {
                    Identity::Replica { cell, name }
                } else {
                    Identity::Proxy { cell, name }
                }
            }
            _ => {
                return Err(format!(
                    "{uri:?} is not an identity: expected {SCHEME}client/<name>, \
                     {SCHEME}<cell>/replica/<name>, {SCHEME}<cell>/proxy/<name> or \
                     {SCHEME}directory/<name>"
                ))
            }
        };
        Ok(id)
    }

    /// The role's name: `client`, `replica` or `proxy`.
    pub fn role(&self) -> &'static str {
        match self {
            Identity::Client { .. } => "client",
            Identity::Replica { .. } => "replica",
            Identity::Proxy { .. } => "proxy",
            Identity::Directory { .. } => "directory",
        }
    }

    /// The cell a replica or proxy belongs to (`None` for a client).
    pub fn cell(&self) -> Option<&str> {
        match self {
            Identity::Client { .. } | Identity::Directory { .. } => None,
            Identity::Replica { cell, .. } | Identity::Proxy { cell, .. } => Some(cell),
        }
    }

    /// The identity in a DER certificate: its one `lock://` SAN URI. A certificate with
    /// none, or with more than one, has no identity (the error says which).
    pub fn of_cert(der: &[u8]) -> Result<Identity, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("the certificate does not parse: {e}"))?;
        let subject = cert.subject().to_string();
        let sans = cert
            .subject_alternative_name()
            .map_err(|e| format!("certificate {subject:?}: bad subject alternative names: {e}"))?;
        let uris: Vec<&str> = sans
            .iter()
            .flat_map(|s| s.value.general_names.iter())
            .filter_map(|n| match n {
                // Counted whatever the scheme's case, so a second identity cannot hide as
                // `LOCK://...`; parsed only in lowercase.
                x509_parser::extensions::GeneralName::URI(u)
                    if u.len() >= SCHEME.len()
                        && u.as_bytes()[..SCHEME.len()].eq_ignore_ascii_case(SCHEME.as_bytes()) =>
                {
                    Some(*u)
                }
                _ => None,
            })
            .collect();
        match uris.as_slice() {
            [one] => Identity::parse(one),
            [] => Err(format!(
                "certificate {subject:?} carries no identity (a SAN URI {SCHEME}...); \
                 issue one with `lockctl certs issue`"
            )),
            many => Err(format!(
                "certificate {subject:?} carries {} identities ({}); it must carry one",
                many.len(),
                many.join(", ")
            )),
        }
    }

    /// The identity the other end of `conn` proved with its certificate (the leaf of the
    /// chain rustls verified at the handshake).
    pub fn of_connection(conn: &quinn::Connection) -> Result<Identity, String> {
        let chain = conn
            .peer_identity()
            .and_then(|p| {
                p.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                    .ok()
            })
            .ok_or_else(|| "the connection presented no certificate".to_string())?;
        let leaf = chain
            .first()
            .ok_or_else(|| "the connection presented an empty certificate chain".to_string())?;
        Identity::of_cert(leaf)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Client { name } => write!(f, "{SCHEME}client/{name}"),
            Identity::Replica { cell, name } => write!(f, "{SCHEME}{cell}/replica/{name}"),
            Identity::Proxy { cell, name } => write!(f, "{SCHEME}{cell}/proxy/{name}"),
            Identity::Directory { name } => write!(f, "{SCHEME}directory/{name}"),
        }
    }
}

impl std::str::FromStr for Identity {
    type Err = String;
    fn from_str(s: &str) -> Result<Identity, String> {
        Identity::parse(s)
    }
}

/// Which server a connection reached: what [`admit`] checks a caller's identity against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener<'a> {
    /// A replica of this cell.
    Replica {
        /// The replica's cell.
        cell: &'a str,
    },
    /// A proxy of this cell.
    Proxy {
        /// The proxy's cell.
        cell: &'a str,
    },
    /// A directory instance.
    Directory,
}

/// Whether `who` may use a connection to `listener`, on the peer protocol (`peer`) or
/// the client protocol. A replica takes the peer protocol only from replicas of its own
/// cell, and the client protocol from clients, from directory instances (which read the
/// root cell's map as clients of their own) and from proxies of its own cell; a proxy and
/// a directory instance take the client protocol from clients only. The error is the reason the connection
/// is closed with, written for whoever configured the refused side.
pub fn admit(listener: Listener<'_>, who: &Identity, peer: bool) -> Result<(), String> {
    match (listener, who, peer) {
        (Listener::Replica { cell }, Identity::Replica { cell: c, .. }, true) if c == cell => {
            Ok(())
        }
        (Listener::Replica { cell }, _, true) => Err(format!(
            "{who} may not speak the peer protocol: only replicas of cell {cell:?} may"
        )),
        (Listener::Replica { .. }, Identity::Client { .. } | Identity::Directory { .. }, false) => {
            Ok(())
        }
        (Listener::Replica { cell }, Identity::Proxy { cell: c, .. }, false) if c == cell => Ok(()),
        (Listener::Replica { cell }, Identity::Proxy { .. }, false) => Err(format!(
            "{who} is a proxy of another cell; this replica serves cell {cell:?}"
        )),
        (Listener::Replica { .. }, Identity::Replica { .. }, false) => Err(format!(
            "{who} is a replica's certificate; a client needs a client certificate \
             (lock://client/<name>)"
        )),
        (Listener::Proxy { .. } | Listener::Directory, Identity::Client { .. }, false) => Ok(()),
        (Listener::Directory, _, _) => Err(format!(
            "{who} may not connect to a directory instance: only clients \
             (lock://client/<name>) may"
        )),
        (Listener::Proxy { cell }, _, _) => Err(format!(
            "{who} may not connect to a proxy of cell {cell:?}: only clients \
             (lock://client/<name>) may"
        )),
    }
}

/// The close code a server gives a connection whose identity it refused ([`admit`], or
/// a certificate without an identity); the close reason says why.
pub const CLOSE_REFUSED_IDENTITY: u32 = 4;

/// Checks the identity of the other end of a connection just accepted by `listener`
/// (`peer`: on the peer protocol). Refused: the connection is closed with
/// [`CLOSE_REFUSED_IDENTITY`] and the reason, which is also returned.
pub fn check_accepted(
    conn: &quinn::Connection,
    listener: Listener<'_>,
    peer: bool,
) -> Result<Identity, String> {
    let r = Identity::of_connection(conn).and_then(|who| admit(listener, &who, peer).map(|_| who));
    if let Err(reason) = &r {
        tracing::info!(remote = %conn.remote_address(), "refused a connection: {reason}");
        conn.close(CLOSE_REFUSED_IDENTITY.into(), reason.as_bytes());
    }
    r
}

/// Whom a dialer expects at the other end ([`check_dialed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialed<'a> {
    /// A replica of this cell, dialed on the peer protocol.
    PeerOf {
        /// The dialing replica's cell.
        cell: &'a str,
    },
    /// A server of the client protocol: a replica or a proxy (of any cell its CA
    /// vouches for; a client that knows its cell would name it here).
    Server,
    /// A directory instance.
    Directory,
    /// A replica or a proxy of this cell (a router reaching the cell the directory
    /// names: a wrong endpoint in the map must not be served by another cell).
    Cell {
        /// The cell.
        cell: &'a str,
    },
}

/// Whether `who`, found at the other end of a connection dialed expecting `expect`, is
/// what was expected; else why not.
pub fn expect_dialed(expect: Dialed<'_>, who: &Identity) -> Result<(), String> {
    match (expect, who) {
        (Dialed::PeerOf { cell }, Identity::Replica { cell: c, .. }) if c == cell => Ok(()),
        (Dialed::PeerOf { cell }, _) => Err(format!("{who} is not a replica of cell {cell:?}")),
        (Dialed::Server, Identity::Replica { .. } | Identity::Proxy { .. }) => Ok(()),
        (Dialed::Server, Identity::Client { .. } | Identity::Directory { .. }) => Err(format!(
            "{who} is a {}, not a replica or a proxy",
            who.role()
        )),
        (Dialed::Directory, Identity::Directory { .. }) => Ok(()),
        (
            Dialed::Cell { cell },
            Identity::Replica { cell: c, .. } | Identity::Proxy { cell: c, .. },
        ) if c == cell => Ok(()),
        (Dialed::Cell { cell }, _) => Err(format!(
            "{who} is not a replica or a proxy of cell {cell:?}, the cell expected at this \
             endpoint"
        )),
        (Dialed::Directory, _) => Err(format!(
            "{who} is a {}, not a directory instance (lock://directory/<name>)",
            who.role()
        )),
    }
}

/// Checks the identity of the server at the other end of a connection just dialed
/// expecting `expect` (the CA signed its certificate; this checks its role). Not what was
/// expected, or no identity: the connection is closed with
/// [`CLOSE_REFUSED_IDENTITY`] and the reason is returned.
pub fn check_dialed(conn: &quinn::Connection, expect: Dialed<'_>) -> Result<Identity, String> {
    let r = Identity::of_connection(conn).and_then(|who| expect_dialed(expect, &who).map(|_| who));
    if let Err(reason) = &r {
        conn.close(CLOSE_REFUSED_IDENTITY.into(), reason.as_bytes());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dialer_takes_only_the_role_it_dialed_for() {
        let id = |s: &str| Identity::parse(s).unwrap();
        let peer = Dialed::PeerOf { cell: "a" };
        assert!(expect_dialed(peer, &id("lock://a/replica/2")).is_ok());
        for other in ["lock://b/replica/2", "lock://a/proxy/p", "lock://client/x"] {
            let e = expect_dialed(peer, &id(other)).unwrap_err();
            assert!(e.contains("not a replica of cell \"a\""), "{other}: {e}");
        }
        for server in ["lock://a/replica/1", "lock://b/proxy/p"] {
            assert!(
                expect_dialed(Dialed::Server, &id(server)).is_ok(),
                "{server}"
            );
        }
        let e = expect_dialed(Dialed::Server, &id("lock://client/x")).unwrap_err();
        assert!(e.contains("not a replica or a proxy"), "{e}");
        let e = expect_dialed(Dialed::Server, &id("lock://directory/d1")).unwrap_err();
        assert!(e.contains("not a replica or a proxy"), "{e}");
        assert!(expect_dialed(Dialed::Directory, &id("lock://directory/d1")).is_ok());
        let a = Dialed::Cell { cell: "a" };
        assert!(expect_dialed(a, &id("lock://a/replica/1")).is_ok());
        assert!(expect_dialed(a, &id("lock://a/proxy/p")).is_ok());
        for other in [
            "lock://b/replica/1",
            "lock://b/proxy/p",
            "lock://client/x",
            "lock://directory/d",
        ] {
            let e = expect_dialed(a, &id(other)).unwrap_err();
            assert!(
                e.contains("not a replica or a proxy of cell \"a\""),
                "{other}: {e}"
            );
        }
        for other in ["lock://a/replica/1", "lock://a/proxy/p", "lock://client/x"] {
            let e = expect_dialed(Dialed::Directory, &id(other)).unwrap_err();
            assert!(e.contains("not a directory instance"), "{other}: {e}");
        }
    }

    /// A directory instance: `lock://directory/<name>`, of no cell; it reads the root
    /// cell as a client (never on the peer protocol, never through a proxy), and only
    /// clients connect to it.
    #[test]
    fn a_directory_instance_is_a_client_of_the_root_cell_and_serves_clients() {
        let d = Identity::parse("lock://directory/d-1").unwrap();
        assert_eq!(d.to_string(), "lock://directory/d-1");
        assert_eq!((d.role(), d.cell()), ("directory", None));
        assert!(Identity::parse("lock://directory/D").is_err());
        let root = Listener::Replica { cell: "root" };
        assert!(admit(root, &d, false).is_ok());
        assert!(admit(root, &d, true).is_err());
        assert!(admit(Listener::Proxy { cell: "root" }, &d, false).is_err());
        let client = Identity::parse("lock://client/app").unwrap();
        assert!(admit(Listener::Directory, &client, false).is_ok());
        for other in [
            "lock://root/replica/1",
            "lock://root/proxy/p",
            "lock://directory/d-2",
        ] {
            let who = Identity::parse(other).unwrap();
            assert!(admit(Listener::Directory, &who, false).is_err(), "{other}");
        }
    }

    #[test]
    fn identities_parse_and_print_back() {
        for uri in [
            "lock://client/payments-api",
            "lock://cell-a/replica/3",
            "lock://cell_a.eu/proxy/p1",
        ] {
            let id = Identity::parse(uri).unwrap();
            assert_eq!(id.to_string(), uri);
        }
        assert_eq!(
            Identity::parse("lock://cell-a/replica/3").unwrap(),
            Identity::Replica {
                cell: "cell-a".into(),
                name: "3".into()
            }
        );
        assert_eq!(Identity::parse("lock://client/x").unwrap().cell(), None);
    }

    #[test]
    fn malformed_identities_are_refused_with_the_reason() {
        let cases = [
            ("https://client/x", "must start with"),
            ("lock://client", "expected"),
            ("lock://client/", "1 to 64"),
            ("lock://client/a/b", "expected"),
            ("lock://cell/admin/x", "expected"),
            ("lock://client/replica/x", "cannot be a cell"),
            ("lock://cell/replica/a b", "not ' '"),
            ("lock://cell/replica/ä", "not 'ä'"),
            ("lock://Cell-A/replica/1", "not 'C'"),
            ("lock://../replica/1", "cannot be"),
            ("LOCK://client/x", "must start with"),
        ];
        for (uri, why) in cases {
            let e = Identity::parse(uri).unwrap_err();
            assert!(e.contains(why), "{uri}: {e}");
        }
        let long = format!("lock://client/{}", "a".repeat(NAME_BYTES_MAX + 1));
        assert!(Identity::parse(&long).is_err());
    }

    #[test]
    fn only_the_cells_replicas_speak_the_peer_protocol() {
        let replica = Listener::Replica { cell: "a" };
        let proxy = Listener::Proxy { cell: "a" };
        let id = |s: &str| Identity::parse(s).unwrap();
        let ok = |l, s: &str, peer| admit(l, &id(s), peer).is_ok();
        // The peer protocol: replicas of this cell only.
        assert!(ok(replica, "lock://a/replica/2", true));
        assert!(!ok(replica, "lock://b/replica/2", true));
        assert!(!ok(replica, "lock://a/proxy/1", true));
        assert!(!ok(replica, "lock://client/x", true));
        // The client protocol at a replica: clients, and this cell's proxies.
        assert!(ok(replica, "lock://client/x", false));
        assert!(ok(replica, "lock://a/proxy/1", false));
        assert!(!ok(replica, "lock://b/proxy/1", false));
        assert!(!ok(replica, "lock://a/replica/2", false));
        // A proxy: clients only.
        assert!(ok(proxy, "lock://client/x", false));
        assert!(!ok(proxy, "lock://a/proxy/2", false));
        assert!(!ok(proxy, "lock://a/replica/1", false));
        assert!(!ok(proxy, "lock://client/x", true));
        let why = admit(replica, &id("lock://client/x"), true).unwrap_err();
        assert!(why.contains("may not speak the peer protocol"), "{why}");
    }
}
