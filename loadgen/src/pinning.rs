//! Keeping the servers and the load generator on separate cores (`--server-cpus`,
//! `--loadgen-cpus`), the same split for all three systems (issue 26).
//!
//! Every thread of every server process (our replicas and proxies, etcd's members,
//! ZooKeeper's JVMs) is bound to the server CPUs with `sched_setaffinity`, and every thread
//! of loadgen to its own; processes loadgen starts later (a takeover holder, the parts of a
//! split profile) inherit loadgen's. The servers' binding is applied again every second,
//! so a member restarted during a scenario (by `peers.sh restart` or a learner start) is
//! bound within a second of its start.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::cluster::{processes_of, System};

/// A set of CPUs, parsed from a list such as `0`, `0,1` or `0-3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cpus(pub Vec<usize>);

impl std::str::FromStr for Cpus {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Cpus> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (usize, usize) = (
                        a.parse().with_context(|| format!("CPU {a:?}"))?,
                        b.parse().with_context(|| format!("CPU {b:?}"))?,
                    );
                    if a > b {
                        bail!("CPU range {part:?} runs backwards");
                    }
                    out.extend(a..=b);
                }
                None => out.push(part.parse().with_context(|| format!("CPU {part:?}"))?),
            }
        }
        if out.is_empty() {
            bail!("no CPU in {s:?}");
        }
        let online = online_cpus();
        if let Some(c) = out.iter().find(|c| **c >= online) {
            bail!("CPU {c} does not exist here (CPUs 0-{})", online - 1);
        }
        out.sort_unstable();
        out.dedup();
        Ok(Cpus(out))
    }
}

impl std::fmt::Display for Cpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.iter().map(usize::to_string).collect();
        f.write_str(&names.join(","))
    }
}

fn online_cpus() -> usize {
    // SAFETY: sysconf reads a value.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1) as usize
}

/// The kernel's CPU set for `cpus`.
fn cpu_set(cpus: &Cpus) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it for CPUs
    // below CPU_SETSIZE (checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in &cpus.0 {
            if c < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(c, &mut set);
            }
        }
        set
    }
}

/// Binds the thread (or single-threaded process) `tid` to `cpus`.
fn bind(tid: i32, cpus: &Cpus) -> std::io::Result<()> {
    let set = cpu_set(cpus);
    // SAFETY: sched_setaffinity reads `set`, a valid cpu_set_t of the size given.
    if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `cmd`'s process start bound to `cpus`, and with it everything it starts. A
/// server sizes its thread pools by the CPUs it may use when it starts (Go's `GOMAXPROCS`,
/// the JVM's GC and JIT threads, tokio's workers): bound only after its start
/// ([`bind_servers`]), each would keep pools sized for the whole machine on one core.
pub fn start_on(cmd: &mut std::process::Command, cpus: &Cpus) {
    use std::os::unix::process::CommandExt;
    let set = cpu_set(cpus);
    // SAFETY: the closure runs in the child between fork and exec and makes one system
    // call on a copy of `set` made before the fork: async-signal-safe, no allocation.
    unsafe {
        cmd.pre_exec(move || {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Binds every thread of process `pid` to `cpus` (threads that end meanwhile are skipped).
fn bind_process(pid: u32, cpus: &Cpus) -> anyhow::Result<()> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("threads of process {pid}"))?;
    for t in tasks.flatten() {
        let Ok(tid) = t.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        match bind(tid, cpus) {
            Ok(()) => {}
            // The thread ended between the listing and the call.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => bail!("bind thread {tid} of {pid} to CPUs {cpus}: {e}"),
        }
    }
    Ok(())
}

/// Binds this process's threads to `cpus`.
pub fn bind_self(cpus: &Cpus) -> anyhow::Result<()> {
    bind_process(std::process::id(), cpus)
}

/// Binds the server processes of the cluster in `dir` to `cpus` now, and again every
/// second until the returned task is aborted. Fails if no server process is found.
pub fn bind_servers(
    system: System,
    dir: PathBuf,
    cpus: Cpus,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let procs = processes_of(system, &dir);
    if procs.is_empty() {
        bail!("no server process found to bind to CPUs {cpus}");
    }
    for (_, pid) in &procs {
        bind_process(*pid, &cpus)?;
    }
    Ok(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            for (_, pid) in processes_of(system, &dir) {
                // A member being killed or restarted may vanish meanwhile.
                let _ = bind_process(pid, &cpus);
            }
        }
    }))
}

/// How many threads of the cluster's server processes are bound to exactly `cpus`, of
/// how many: checked at the end of a run, for the report.
pub fn check_servers(system: System, dir: &std::path::Path, cpus: &Cpus) -> (usize, usize) {
    count_bound(
        processes_of(system, dir).into_iter().map(|(_, pid)| pid),
        cpus,
    )
}

/// How many threads of process `root` and of every process below it are bound to exactly
/// `cpus`, of how many: for a cluster started as one process tree (`lockctl dev
/// --cells 2`, which [`start_on`] bound at its start).
pub fn check_tree(root: u32, cpus: &Cpus) -> (usize, usize) {
    count_bound(tree_of(root), cpus)
}

/// How many threads of the processes `pids` are bound to exactly `cpus`, of how many
/// (processes that ended meanwhile count for nothing).
fn count_bound(pids: impl IntoIterator<Item = u32>, cpus: &Cpus) -> (usize, usize) {
    let (mut bound, mut total) = (0, 0);
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Ok(tid) = t.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            total += 1;
            bound += usize::from(bound_to(tid, cpus));
        }
    }
    (bound, total)
}

/// `root` and every live process below it, from each process's parent in `/proc`.
fn tree_of(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": the command may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parent_of.push((pid, ppid));
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

/// True if the thread `tid`'s affinity is exactly `cpus`.
fn bound_to(tid: i32, cpus: &Cpus) -> bool {
    // SAFETY: as in `bind`; sched_getaffinity writes within the set it is given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return false;
        }
        (0..online_cpus()).all(|c| libc::CPU_ISSET(c, &set) == cpus.0.contains(&c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_bad_ones_are_refused() {
        assert_eq!("0".parse::<Cpus>().unwrap(), Cpus(vec![0]));
        if online_cpus() >= 2 {
            assert_eq!("1,0-1".parse::<Cpus>().unwrap(), Cpus(vec![0, 1]));
        }
        assert!("".parse::<Cpus>().is_err());
        assert!("1-0".parse::<Cpus>().is_err());
        assert!("x".parse::<Cpus>().is_err());
        assert!("100000".parse::<Cpus>().is_err());
    }

    #[test]
    fn a_child_process_is_bound_with_every_thread() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let cpus = Cpus(vec![0]);
        bind_process(child.id(), &cpus).unwrap();
        assert!(bound_to(child.id() as i32, &cpus));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Every thread of a process tree started with `start_on` counts as bound, the
    /// children's included; a tree started without it does not.
    #[test]
    fn a_process_tree_started_on_cpus_is_counted_bound_to_them() {
        let cpus = Cpus(vec![0]);
        let spawn = |pin: bool| {
            let mut cmd = std::process::Command::new("sh");
            cmd.args(["-c", "sleep 30 & sleep 30 & wait"]);
            if pin {
                start_on(&mut cmd, &cpus);
            }
            cmd.spawn().unwrap()
        };
        let (mut pinned, mut free) = (spawn(true), spawn(false));
        // Both sleeps started (bounded wait).
        for _ in 0..100 {
            if tree_of(pinned.id()).len() == 3 && tree_of(free.id()).len() == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let (bound, total) = check_tree(pinned.id(), &cpus);
        assert_eq!(total, 3, "the shell and its two children");
        assert_eq!(bound, total);
        if online_cpus() >= 2 {
            assert_eq!(check_tree(free.id(), &cpus).0, 0);
        }
        for c in [&mut pinned, &mut free] {
            for pid in tree_of(c.id()).into_iter().skip(1) {
                // SAFETY: kill(2) on a sleep this test started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// A process started with `start_on` runs bound from its first instruction: what it
    /// reads of its own affinity (as Go and the JVM do to size their thread pools) is the
    /// one CPU, and so is what a process it starts inherits.
    #[test]
    fn a_process_started_on_cpus_sees_only_them_and_so_do_its_children() {
        let cpus = Cpus(vec![0]);
        let mut cmd = std::process::Command::new("sh");
        cmd.args([
            "-c",
            "grep Cpus_allowed_list /proc/self/status; sh -c 'grep Cpus_allowed_list /proc/self/status'",
        ]);
        start_on(&mut cmd, &cpus);
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let lists: Vec<&str> = text
            .lines()
            .map(|l| l.split_whitespace().last().unwrap_or(""))
            .collect();
        assert_eq!(lists, ["0", "0"], "{text}");
    }
}
