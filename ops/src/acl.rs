//! `lockctl acl`: read and change ACLs, groups and admins (`docs/security.md`, "ACLs").

use clap::Subcommand;
use client_sdk::Client;
use wire::acl::{Acl, Principal, Right};

/// `lockctl acl ...`
#[derive(Subcommand, Debug)]
pub enum AclCommand {
    /// Print a node's ACL: each right with the entries it is granted to (needs the read
    /// or the admin right on the node).
    #[command(after_help = "Examples:\n  lockctl acl get /payments")]
    Get {
        /// Path.
        path: String,
    },
    /// Replace a node's ACL (needs the admin right on it, or to be a cell admin). A right
    /// not given is granted to nobody but the cell's admins. Entries: an identity
    /// (lock://client/payments-api), a prefix of identities (lock://client/payments-*),
    /// a group (group:payments) or everyone (*); repeat a flag or separate entries with
    /// commas. Children created later inherit the new ACL; existing ones keep theirs.
    ///
    /// Example, "the payments team may lock under /payments and nobody else may":
    ///   lockctl acl group set payments lock://client/payments-api lock://client/payments-worker
    ///   lockctl acl set /payments --read group:payments --create group:payments --write group:payments
    #[command(after_help = "Examples:\n  \
        lockctl acl set /payments --read group:payments --create group:payments --write group:payments\n  \
        lockctl acl set /app/config --read '*' --write lock://client/deployer --admin lock://client/ops")]
    Set {
        /// Path.
        path: String,
        /// Who may read (get, exists, children, watches, cached reads).
        #[arg(long, value_delimiter = ',')]
        read: Vec<String>,
        /// Who may set data and delete.
        #[arg(long, value_delimiter = ',')]
        write: Vec<String>,
        /// Who may create children (taking a lock, joining a group).
        #[arg(long, value_delimiter = ',')]
        create: Vec<String>,
        /// Who may change this ACL.
        #[arg(long, value_delimiter = ',')]
        admin: Vec<String>,
    },
    /// Print the cell's admins and groups.
    #[command(after_help = "Examples:\n  lockctl acl ls")]
    Ls,
    /// Groups of identities that ACL entries name as group:NAME (admins only).
    #[command(subcommand)]
    #[command(after_help = "Examples:\n  \
        lockctl acl group set payments lock://client/payments-api lock://client/payments-worker\n  \
        lockctl acl group rm payments")]
    Group(GroupCommand),
    /// The cell's admins: they pass every ACL and may change ACLs, groups and admins.
    #[command(subcommand)]
    #[command(after_help = "Examples:\n  \
        lockctl acl admins add lock://client/ops-alice\n  \
        lockctl acl admins rm lock://client/ops-bob")]
    Admins(AdminsCommand),
}

/// `lockctl acl group ...`
#[derive(Subcommand, Debug)]
pub enum GroupCommand {
    /// Create or replace a group with these members (identity URIs).
    #[command(
        after_help = "Examples:\n  lockctl acl group set payments lock://client/payments-api lock://client/payments-worker"
    )]
    Set {
        /// The group's name.
        name: String,
        /// Its members.
        members: Vec<String>,
    },
    /// Remove a group (entries naming it then match nobody).
    #[command(after_help = "Examples:\n  lockctl acl group rm payments")]
    Rm {
        /// The group's name.
        name: String,
    },
}

/// `lockctl acl admins ...`
#[derive(Subcommand, Debug)]
pub enum AdminsCommand {
    /// Make an identity a cell admin.
    #[command(after_help = "Examples:\n  lockctl acl admins add lock://client/ops-alice")]
    Add {
        /// The identity URI.
        identity: String,
    },
    /// Remove a cell admin (the last one stays).
    #[command(after_help = "Examples:\n  lockctl acl admins rm lock://client/ops-bob")]
    Rm {
        /// The identity URI.
        identity: String,
    },
}

fn entries(right: Right, list: &[String]) -> anyhow::Result<Vec<Principal>> {
    list.iter()
        .filter(|s| !s.is_empty())
        .map(|s| Principal::parse(s).map_err(|e| anyhow::anyhow!("--{right}: {e}")))
        .collect()
}

/// Prints an ACL one right per line.
pub fn print_acl(path: &str, acl: &Acl) {
    println!("{path}");
    for right in Right::ALL {
        let list: Vec<String> = acl.entries(right).iter().map(|p| p.to_string()).collect();
        let shown = if list.is_empty() {
            "(admins only)".to_string()
        } else {
            list.join(", ")
        };
        println!("  {:<7} {shown}", format!("{right}:"));
    }
}

/// Runs one `lockctl acl` command.
pub async fn run(client: &Client, cmd: AclCommand) -> anyhow::Result<()> {
    match cmd {
        AclCommand::Get { path } => {
            let acl = client.get_acl(&path).await?;
            print_acl(&path, &acl);
        }
        AclCommand::Set {
            path,
            read,
            write,
            create,
            admin,
        } => {
            let acl = Acl {
                read: entries(Right::Read, &read)?,
                write: entries(Right::Write, &write)?,
                create: entries(Right::Create, &create)?,
                admin: entries(Right::Admin, &admin)?,
            };
            acl.check().map_err(anyhow::Error::msg)?;
            let index = client.set_acl(&path, acl).await?;
            let now = client.get_acl(&path).await?;
            print_acl(&path, &now);
            eprintln!("(applied at index {index})");
        }
        AclCommand::Ls => {
            let s = client.security().await?;
            println!("admins: {}", s.admins.join(", "));
            if s.groups.is_empty() {
                println!("groups: none");
            }
            for (name, members) in s.groups {
                println!("group:{name}: {}", members.join(", "));
            }
        }
        AclCommand::Group(GroupCommand::Set { name, members }) => {
            let n = members.len();
            client.set_group(&name, members).await?;
            println!("group:{name} now has {n} members");
        }
        AclCommand::Group(GroupCommand::Rm { name }) => {
            client.remove_group(&name).await?;
            println!("group:{name} removed");
        }
        AclCommand::Admins(AdminsCommand::Add { identity }) => {
            client.set_admin(&identity, true).await?;
            println!("{identity} is an admin");
        }
        AclCommand::Admins(AdminsCommand::Rm { identity }) => {
            client.set_admin(&identity, false).await?;
            println!("{identity} is no longer an admin");
        }
    }
    Ok(())
}
