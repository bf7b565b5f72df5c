//! Test hosts in network namespaces, and the network faults the suite injects between them.
//!
//! `Hosts::up(prefix, n)` creates hosts `PREFIX-1 .. PREFIX-n` on `10.77.0.0/24`, joined
//! by a bridge that lives in a namespace of its own (`PREFIX-sw`). The root namespace gets
//! no address in that subnet and no host has a default route, so nothing a test does ever
//! leaves the namespaces it created. Faults are nftables rules in a `chaos` table of each
//! host and `tbf` shaping on its interface; [`Hosts::heal`] removes them all, and dropping
//! [`Hosts`] deletes every namespace.
//!
//! Needs root, `ip` (iproute2), `nft` (nftables) and `tc`. This kernel has no `netem`, so
//! loss is nftables' `numgen random` and slowness is `tbf`.

use std::process::{Command, Stdio};

/// The subnet the hosts live on (`SUBNET.i` is host `i`).
pub const SUBNET: &str = "10.77.0";

/// Why namespaces cannot be used here (not root, a tool missing), or `None` if they can.
pub fn unavailable() -> Option<String> {
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root".into());
    }
    for (tool, package) in [("ip", "iproute2"), ("nft", "nftables"), ("tc", "iproute2")] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("`{tool}` not found (apt-get install -y {package})"));
        }
    }
    None
}

/// Runs a command; the error names it and carries its stderr.
fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    run(Command::new("ip").args(args))
}

/// A set of hosts, each in its own network namespace; deleted when dropped.
#[derive(Debug)]
pub struct Hosts {
    prefix: String,
    n: usize,
    /// Created by this handle (deleted when it is dropped), or attached to.
    owned: bool,
}

impl Hosts {
    /// Creates hosts `1..=n` (at most 250). Leftovers of an earlier run with the same
    /// prefix are deleted first.
    pub fn up(prefix: &str, n: usize) -> Result<Hosts, String> {
        if n == 0 || n > 250 {
            return Err(format!("{n} hosts: between 1 and 250"));
        }
        let hosts = Hosts {
            prefix: prefix.to_string(),
            n,
            owned: true,
        };
        hosts.delete_all();
        let sw = hosts.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "set", "lo", "up"])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 1..=n {
            let h = hosts.name(i);
            let port = format!("v{i}");
            ip(&["netns", "add", &h])?;
            ip(&[
                "link", "add", &port, "netns", &sw, "type", "veth", "peer", "name", "eth0",
                "netns", &h,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &port, "up"])?;
            ip(&["-n", &h, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                &h,
                "addr",
                "add",
                &format!("{}/24", hosts.addr(i)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &h, "link", "set", "eth0", "up"])?;
        }
        // Bridge ports reach the forwarding state.
        std::thread::sleep(std::time::Duration::from_millis(1_000));
        Ok(hosts)
    }

    /// A handle on hosts another process created (with the same prefix and count); its
    /// drop deletes nothing.
    pub fn attach(prefix: &str, n: usize) -> Hosts {
        Hosts {
            prefix: prefix.to_string(),
            n,
            owned: false,
        }
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there are no hosts (never, once `up` succeeded).
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Host `i`'s namespace name.
    pub fn name(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("{SUBNET}.{i}")
    }

    /// A command that runs `program` inside host `i` (`ip netns exec` execs it, so the
    /// child's PID is the program's).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name(i)]).arg(program);
        c
    }

    fn nft(&self, i: usize, args: &[&str]) -> Result<(), String> {
        run(Command::new("ip")
            .args(["netns", "exec", &self.name(i), "nft"])
            .args(args))
    }

    fn chaos_table(&self, i: usize) -> Result<(), String> {
        // `add` is idempotent for tables and chains.
        self.nft(i, &["add", "table", "inet", "chaos"])?;
        self.nft(
            i,
            &["add chain inet chaos in { type filter hook input priority 0; policy accept; }"],
        )?;
        self.nft(
            i,
            &["add chain inet chaos out { type filter hook output priority 0; policy accept; }"],
        )
    }

    /// Host `at` drops every packet arriving from host `from` (a one-way cut: what `at`
    /// sends still reaches `from`).
    pub fn drop_from(&self, at: usize, from: usize) -> Result<(), String> {
        self.chaos_table(at)?;
        self.nft(
            at,
            &[
                "add",
                "rule",
                "inet",
                "chaos",
                "in",
                "ip",
                "saddr",
                &self.addr(from),
                "drop",
            ],
        )
    }

    /// Cuts every link between the hosts of `a` and the hosts of `b`, both ways.
    pub fn split(&self, a: &[usize], b: &[usize]) -> Result<(), String> {
        for &x in a {
            for &y in b {
                self.drop_from(x, y)?;
                self.drop_from(y, x)?;
            }
        }
        Ok(())
    }

    /// Cuts host `i` off from every other host.
    pub fn isolate(&self, i: usize) -> Result<(), String> {
        let others: Vec<usize> = (1..=self.n).filter(|j| *j != i).collect();
        self.split(&[i], &others)
    }

    /// Host `i` drops `pct` % of the packets arriving at it, at random.
    pub fn loss(&self, i: usize, pct: u8) -> Result<(), String> {
        self.chaos_table(i)?;
        self.nft(
            i,
            &[
                "add",
                "rule",
                "inet",
                "chaos",
                "in",
                "numgen",
                "random",
                "mod",
                "100",
                "<",
                &pct.min(100).to_string(),
                "drop",
            ],
        )
    }

    /// Host `i` drops `pct` % of the UDP packets arriving for the given local ports, at
    /// random, or all of them at 100 (one client process cut off, say, while the host's
    /// others are fine).
    pub fn loss_to_ports(&self, i: usize, ports: &[u16], pct: u8) -> Result<(), String> {
        if ports.is_empty() {
            return Ok(());
        }
        self.chaos_table(i)?;
        let set = format!(
            "{{ {} }}",
            ports
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let pct = pct.min(100).to_string();
        let mut rule = vec!["add", "rule", "inet", "chaos", "in", "udp", "dport", &set];
        if pct != "100" {
            // (nftables refuses `< 100` for `mod 100`: all is simply no condition.)
            rule.extend(["numgen", "random", "mod", "100", "<", &pct]);
        }
        rule.push("drop");
        self.nft(i, &rule)
    }

    /// Shapes host `i`'s outgoing traffic to `kbit` kbit/s (tbf; queued up to 2 s).
    pub fn slow(&self, i: usize, kbit: u32) -> Result<(), String> {
        run(Command::new("ip").args([
            "netns",
            "exec",
            &self.name(i),
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            &format!("{kbit}kbit"),
            "burst",
            "32kbit",
            "latency",
            "2s",
        ]))
    }

    /// Removes every fault (nftables rules and shaping) from every host.
    pub fn heal(&self) -> Result<(), String> {
        for i in 1..=self.n {
            // Absent tables and qdiscs are not errors here.
            let _ = self.nft(i, &["delete", "table", "inet", "chaos"]);
            let _ = run(Command::new("ip").args([
                "netns",
                "exec",
                &self.name(i),
                "tc",
                "qdisc",
                "del",
                "dev",
                "eth0",
                "root",
            ]));
        }
        Ok(())
    }

    fn delete_all(&self) {
        for i in 1..=self.n.max(8) {
            let _ = ip(&["netns", "del", &self.name(i)]);
        }
        let _ = ip(&["netns", "del", &self.switch()]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if self.owned {
            self.delete_all();
        }
    }
}
