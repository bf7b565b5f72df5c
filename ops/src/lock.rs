//! `lockctl lock`: hold a lock while a command runs (like `etcdctl lock`), and stop the
//! command while the lease is in doubt.
//!
//! The command runs in a process group of its own. lockctl follows the session's events
//! and acts on the whole group at once (DESIGN.md, safety rule 6: a holder whose lease is
//! in doubt stops acting):
//!
//! - **Jeopardy** (the local lease ran out without a renewal; it ends before the cell's):
//!   SIGSTOP to the group by default (`--on-jeopardy stop`), SIGTERM with `term`, nothing
//!   with `ignore`.
//! - **Safe** (the session was renewed after all; the lock is still held): SIGCONT.
//! - **Expired** (the lock is lost): SIGTERM then SIGCONT (a stopped group cannot act on
//!   SIGTERM until it runs), SIGKILL if the group has not ended `--kill-after-secs` later;
//!   with `--on-expiry keep`, SIGCONT only.
//! - **Lost** while the session lives on (the lock's node was deleted by someone else, or
//!   its prefix moved to another cell; `LockGuard::lost`): as on expiry.
//!
//! Signals sent to lockctl (SIGINT, SIGTERM, SIGHUP) are passed on to the group. When
//! lockctl runs in the terminal's foreground, the command's group is made the foreground
//! group for as long as it runs, so it reads the terminal and gets Ctrl-C as before.

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use client_sdk::recipes::lock::LockMode;
use client_sdk::{Client, Lock, Session, SessionEvent, SessionState};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;

/// Options of `lockctl lock`.
#[derive(clap::Args, Debug)]
pub struct LockArgs {
    /// The lock's path (created if missing; its parent must exist).
    pub path: String,
    /// exclusive, read or write.
    #[arg(long, default_value = "exclusive", value_parser = ["exclusive", "read", "write"])]
    pub mode: String,
    /// Give up after this many seconds of waiting (exit status 3); wait forever if absent.
    #[arg(long)]
    pub wait_secs: Option<u64>,
    /// What to do with the command when the session falls into jeopardy (its local lease
    /// ran out without a renewal, so the lock may soon belong to someone else; this comes
    /// before the cell's lease ends): `stop` (SIGSTOP to its process group; SIGCONT if the
    /// session is safe again, the end of the command as below if it expires), `term` (end
    /// it now, as on expiry, and exit with status 4), or `ignore` (let it run: UNSAFE, it
    /// may go on acting after the lock was granted to another holder, and only fencing
    /// then protects the resource).
    #[arg(long, default_value = "stop", value_parser = ["stop", "term", "ignore"])]
    pub on_jeopardy: String,
    /// What to do with the command if the session expires, or the lock is lost while it
    /// lives on (its node deleted by someone else, or its prefix moved to another cell): `term`
    /// (SIGTERM, and SIGCONT in case it was stopped, then SIGKILL after --kill-after-secs)
    /// or `keep` (let it run, continuing it if stopped; its writes must then be refused by
    /// fencing).
    #[arg(long, default_value = "term", value_parser = ["term", "keep"])]
    pub on_expiry: String,
    /// Seconds between the SIGTERM that ends the command and the SIGKILL that follows if
    /// its process group has not ended by then.
    #[arg(long, default_value_t = 5)]
    pub kill_after_secs: u64,
    /// Data for the lock's node (what others see of this holder or candidate, e.g. its
    /// address; `lockctl elect --observe` prints it).
    #[arg(long)]
    pub data: Option<String>,
    /// The command to run while holding the lock; it gets LOCK_PATH, LOCK_NODE, LOCK_TOKEN
    /// and LOCK_SESSION in its environment. Without one, hold until Ctrl-C.
    #[arg(last = true)]
    pub command: Vec<String>,
    /// What the grant is called in the line printed on it (`acquired`, or `elected` for
    /// `lockctl elect`).
    #[arg(skip = "acquired")]
    pub granted: &'static str,
}

/// Runs `lockctl lock`. Returns the exit status.
pub async fn run(client: &Client, args: LockArgs) -> anyhow::Result<i32> {
    let session = client.open_session().await?;
    // Subscribed before acquiring, so no event between the grant and the command's start
    // is missed.
    let mut events = session.events();
    let mut lock = match args.mode.as_str() {
        "read" => Lock::read(&session, &args.path),
        "write" => Lock::write(&session, &args.path),
        _ => Lock::exclusive(&session, &args.path),
    };
    if let Some(d) = &args.data {
        lock = lock.with_data(d.clone().into_bytes());
    }
    let guard = match args.wait_secs {
        Some(s) => match lock
            .acquire_timeout(std::time::Duration::from_secs(s))
            .await?
        {
            Some(g) => g,
            None => {
                crate::say!("lockctl: {} not acquired within {s} s", args.path);
                session.close().await?;
                return Ok(3);
            }
        },
        None => lock.acquire().await?,
    };
    let seq = guard.sequencer().clone();
    let mode = match seq.mode {
        LockMode::Exclusive => "exclusive",
        LockMode::Read => "read",
        LockMode::Write => "write",
    };
    println!(
        "{} {} ({mode}) token={} node={} session={}",
        args.granted, seq.lock, seq.token, seq.node, seq.session
    );
    if args.command.is_empty() {
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = guard.wait_lost(), if session.state() != SessionState::Expired => {
                    crate::say!(
                        "lockctl: lock {} lost at {}: its node was deleted or its prefix moved to another cell",
                        seq.lock,
                        now_stamp()
                    );
                    drop(guard);
                    let _ = session.close().await;
                    return Ok(4);
                }
                e = events.recv() => {
                    let ev = event_or_state(&session, e);
                    report_hold(&seq.lock, &session, ev);
                    if ev == SessionEvent::Expired {
                        return Ok(4);
                    }
                }
            }
        }
        guard.release().await?;
        session.close().await?;
        return Ok(0);
    }

    let foreground = in_foreground();
    let mut cmd = tokio::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("LOCK_PATH", &seq.lock)
        .env("LOCK_NODE", &seq.node)
        .env("LOCK_TOKEN", seq.token.to_string())
        .env("LOCK_SESSION", seq.session.to_string())
        .stdin(Stdio::inherit());
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (setpgid, signal, tcsetpgrp, getpid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if foreground {
                // Take the terminal, as a shell does for a foreground job: ignore the
                // SIGTTOU a background group gets for it.
                let old = libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                libc::tcsetpgrp(0, libc::getpid());
                libc::signal(libc::SIGTTOU, old);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let group = child.id().expect("a child just spawned has a pid") as i32;
    let mut sup = Supervisor {
        lock: seq.lock.clone(),
        session: session.clone(),
        group,
        on_jeopardy: args.on_jeopardy.clone(),
        keep_on_expiry: args.on_expiry == "keep",
        kill_after: Duration::from_secs(args.kill_after_secs),
        stopped: false,
        held_unconfirmed: false,
        ended: None,
        reaped: Arc::new(AtomicBool::new(false)),
        killer: None,
    };
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut events_open = true;
    let status = loop {
        // The lock's own state (`LockGuard::confirmed`, `lost`): a listener first, then a
        // look, so that no change falls in between.
        let mut pin_changed = Box::pin(guard.changed());
        if sup.ended.is_none() && session.state() != SessionState::Expired {
            if guard.lost() {
                sup.lost();
            } else {
                sup.confirmed(guard.confirmed());
            }
        }
        tokio::select! {
            // Events first: a jeopardy reported is acted on before anything else.
            biased;
            e = events.recv(), if events_open => {
                if matches!(e, Err(RecvError::Closed)) {
                    events_open = false;
                }
                let ev = event_or_state(&session, e);
                // With the lock's state as it is now (a change since the loop's look
                // is looked at again at the loop's top).
                sup.on_event(ev, guard.confirmed());
            }
            _ = sigint.recv() => sup.forward(libc::SIGINT, "SIGINT"),
            _ = sigterm.recv() => sup.forward(libc::SIGTERM, "SIGTERM"),
            _ = sighup.recv() => sup.forward(libc::SIGHUP, "SIGHUP"),
            _ = &mut pin_changed, if sup.ended.is_none() => {
                // Looked at below, with a new listener taken first.
            }
            // While stopped, looked at again every 200 ms: a lease renewed without a
            // jeopardy in between wakes nothing else.
            _ = tokio::time::sleep(Duration::from_millis(200)), if sup.stopped && sup.ended.is_none() => {
                sup.resume(guard.confirmed(), "lock confirmed and lease valid again");
            }
            st = child.wait() => break st?,
        }
    };
    sup.reaped.store(true, Ordering::SeqCst);
    if foreground {
        take_terminal_back();
    }
    match sup.ended {
        Some(Ended::Expired) => {
            crate::say!(
                "lockctl: exit status 4: the session expired and the lock {} was lost while the command ran ({status})",
                seq.lock
            );
            return Ok(4);
        }
        Some(Ended::Lost) => {
            crate::say!(
                "lockctl: exit status 4: the lock {} was lost while the command ran (its node was deleted or its prefix moved) ({status})",
                seq.lock
            );
            drop(guard);
            let _ = session.close().await;
            return Ok(4);
        }
        Some(Ended::Jeopardy) => {
            // The session may have survived: free the lock for the next holder now if so
            // (if not, the cell frees it when the session expires).
            if session.state() != SessionState::Expired {
                if let Err(e) = guard.release().await {
                    crate::say!("lockctl: could not release {}: {e}", seq.lock);
                } else {
                    let _ = session.close().await;
                }
            }
            crate::say!(
                "lockctl: exit status 4: the command was ended because the session fell into jeopardy (--on-jeopardy term) ({status})"
            );
            return Ok(4);
        }
        None => {}
    }
    // The session may have expired without our hearing it yet (the command finished
    // first): releasing then tells us.
    match guard.release().await {
        Ok(()) => session.close().await?,
        Err(client_sdk::Error::SessionExpired { .. }) => {
            crate::say!(
                "lockctl: exit status 4: session expired at {}: lock {} was lost before the command ended ({status})",
                now_stamp(),
                seq.lock
            );
            return Ok(4);
        }
        Err(e) => return Err(e.into()),
    }
    Ok(status.code().unwrap_or(1))
}

/// Why lockctl ended the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// The session expired: the lock is lost.
    Expired,
    /// The session fell into jeopardy and `--on-jeopardy term` was given.
    Jeopardy,
    /// The lock's node went while the session lived on (deleted, or its prefix moved).
    Lost,
}

/// Acts on the command's process group as the session's events arrive. Every action is a
/// `kill(2)` and a line on stderr: nothing here waits.
struct Supervisor {
    lock: String,
    session: Session,
    /// The command's process group (its pid).
    group: i32,
    on_jeopardy: String,
    keep_on_expiry: bool,
    kill_after: Duration,
    /// SIGSTOPped and not continued since.
    stopped: bool,
    /// Stopped (also) because the lock is unconfirmed (`LockGuard::confirmed`): continued
    /// only once it is confirmed again and the session is not in jeopardy.
    held_unconfirmed: bool,
    ended: Option<Ended>,
    /// Set once the command has been waited for: its pid (the group's id) may be reused
    /// from then on, so the killer thread must not signal it.
    reaped: Arc<AtomicBool>,
    /// The thread that SIGKILLs the group `kill_after` after the SIGTERM that ends it.
    killer: Option<std::thread::JoinHandle<()>>,
}

impl Supervisor {
    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
        if unsafe { libc::kill(-self.group, sig) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                crate::say!("lockctl: cannot signal process group {}: {e}", self.group);
            }
        }
    }

    fn forward(&self, sig: i32, name: &str) {
        self.signal(sig);
        let note = if self.stopped {
            " (it is stopped: the signal takes effect when it is continued or ended)"
        } else {
            ""
        };
        crate::say!(
            "lockctl: {name} passed on to the command's process group {}{note}",
            self.group
        );
    }

    /// SIGTERM (and SIGCONT, so that a stopped group can act on it), SIGKILL later.
    fn end(&mut self, why: Ended) {
        self.signal(libc::SIGTERM);
        self.signal(libc::SIGCONT);
        self.stopped = false;
        self.ended = Some(why);
        if self.killer.is_some() {
            return;
        }
        // A thread of its own, not a timer of the async runtime: the SIGKILL is the last
        // word on a command that must stop, and must come on time even if the runtime's
        // timers are late (a CI run saw this loop's tokio timer fire 32.8 s late, while
        // the process was otherwise idle, waiting on a cell that did not answer).
        let (group, after, reaped) = (self.group, self.kill_after, self.reaped.clone());
        self.killer = Some(std::thread::spawn(move || {
            std::thread::sleep(after);
            if reaped.load(Ordering::SeqCst) {
                return;
            }
            // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
            if unsafe { libc::kill(-group, libc::SIGKILL) } == 0 {
                crate::say!(
                    "lockctl: the command did not end within {} s of SIGTERM: SIGKILL to process group {group}",
                    after.as_secs()
                );
            }
        }));
    }

    /// The lock is (`true`) or is not confirmed: while it is not, its node may be changing
    /// hands (an invalidation of it came, or the session's event stream broke and the
    /// library is reading it again at the leader), so the command is stopped as at
    /// jeopardy (unless `--on-jeopardy ignore`), and continued once it is confirmed again.
    fn confirmed(&mut self, confirmed: bool) {
        let group = self.group;
        if !confirmed && !self.held_unconfirmed && self.on_jeopardy != "ignore" {
            self.held_unconfirmed = true;
            if !self.stopped {
                self.signal(libc::SIGSTOP);
                self.stopped = true;
                crate::say!(
                    "lockctl: lock {} unconfirmed at {} (its node is being read again at the leader): stopped the command (SIGSTOP to process group {group})",
                    self.lock,
                    now_stamp()
                );
            }
        } else if confirmed && self.held_unconfirmed {
            self.resume(true, "lock confirmed again");
        }
    }

    /// Continues the command if it is stopped and may act again: its lock confirmed
    /// (`confirmed`), the session healthy and its lease valid. Otherwise it stays stopped
    /// (and `held_unconfirmed` as it was), to be looked at again: at the next change, or
    /// at the loop's tick while stopped.
    fn resume(&mut self, confirmed: bool, why: &str) {
        if !self.stopped
            || !confirmed
            || self.ended.is_some()
            || self.session.state() != SessionState::Healthy
            || !self.session.lease_valid()
        {
            return;
        }
        let group = self.group;
        self.held_unconfirmed = false;
        self.signal(libc::SIGCONT);
        self.stopped = false;
        crate::say!(
            "lockctl: {why} at {}: still holding {}: continued the command (SIGCONT to process group {group})",
            now_stamp(),
            self.lock
        );
    }

    /// The lock was lost while the session lives on: as on expiry.
    fn lost(&mut self) {
        let what = format!(
            "lock {} lost at {} (its node was deleted or its prefix moved)",
            self.lock,
            now_stamp()
        );
        self.gone(Ended::Lost, &what);
    }

    /// The lock is gone (`why`, said as `what`): the command is ended, or with
    /// `--on-expiry keep` continued and left to run.
    fn gone(&mut self, why: Ended, what: &str) {
        let group = self.group;
        if self.keep_on_expiry {
            if self.stopped {
                self.signal(libc::SIGCONT);
                self.stopped = false;
            }
            self.ended = Some(why);
            crate::say!(
                "lockctl: {what}: the command goes on (--on-expiry keep: only fencing protects the resource)"
            );
        } else {
            self.end(why);
            crate::say!(
                "lockctl: {what}: ending the command (SIGTERM to process group {group}, SIGKILL in {} s)",
                self.kill_after.as_secs()
            );
        }
    }

    fn on_event(&mut self, ev: SessionEvent, confirmed: bool) {
        // A jeopardy flushes the session's cache, and with it the lock's confirmation:
        // the jeopardy is the reason given, the lock is held unconfirmed without a word.
        if !confirmed && self.ended.is_none() {
            if ev == SessionEvent::Jeopardy && self.on_jeopardy != "ignore" {
                self.held_unconfirmed = true;
            } else {
                self.confirmed(false);
            }
        }
        let group = self.group;
        match ev {
            SessionEvent::FailOver => {}
            _ if self.ended.is_some() => {
                if ev == SessionEvent::Expired && self.ended == Some(Ended::Jeopardy) {
                    self.ended = Some(Ended::Expired);
                    crate::say!(
                        "lockctl: session expired at {}: lock {} lost",
                        now_stamp(),
                        self.lock
                    );
                }
            }
            SessionEvent::Jeopardy => {
                let what = match self.on_jeopardy.as_str() {
                    "stop" if self.stopped => {
                        "the command is stopped already (its lock was unconfirmed)".to_string()
                    }
                    "stop" => {
                        self.signal(libc::SIGSTOP);
                        self.stopped = true;
                        format!("stopped the command (SIGSTOP to process group {group})")
                    }
                    "term" => {
                        self.end(Ended::Jeopardy);
                        format!(
                            "ending the command (SIGTERM to process group {group}, SIGKILL in {} s)",
                            self.kill_after.as_secs()
                        )
                    }
                    _ => "the command goes on (--on-jeopardy ignore: UNSAFE, only fencing \
                          protects the resource once the lock is granted to another holder)"
                        .to_string(),
                };
                let lease = self.session.lease();
                // One conversion to wall-clock time, so the two stamps are exactly one
                // lease apart (two conversions can differ by a microsecond).
                let sent = wall(self.session.local_deadline() - wire::local_lease(lease));
                crate::say!(
                    "lockctl: session in jeopardy at {}: no renewal since the KeepAlive sent at {}; the cell's lease lasts until {} at the earliest: {what}",
                    now_stamp(),
                    stamp(sent),
                    stamp(sent + lease),
                );
            }
            SessionEvent::Safe => {
                if self.stopped && !confirmed {
                    crate::say!(
                        "lockctl: session safe again at {}: still holding {}, not yet confirmed: the command stays stopped",
                        now_stamp(),
                        self.lock
                    );
                } else if self.stopped {
                    self.resume(confirmed, "session safe again");
                } else {
                    crate::say!(
                        "lockctl: session safe again at {}: still holding {}",
                        now_stamp(),
                        self.lock
                    );
                }
            }
            SessionEvent::Expired => {
                let what = format!(
                    "session expired at {}: lock {} lost",
                    now_stamp(),
                    self.lock
                );
                self.gone(Ended::Expired, &what);
            }
        }
    }
}

/// The event received, or, when events were missed (the receiver lagged) or can no longer
/// come, the one the session's state now stands for.
fn event_or_state(session: &Session, e: Result<SessionEvent, RecvError>) -> SessionEvent {
    match e {
        Ok(ev) => ev,
        Err(RecvError::Closed) => SessionEvent::Expired,
        Err(RecvError::Lagged(_)) => match session.state() {
            SessionState::Healthy => SessionEvent::Safe,
            SessionState::Jeopardy => SessionEvent::Jeopardy,
            SessionState::Expired => SessionEvent::Expired,
        },
    }
}

/// Reports a session event on stderr while holding without a command.
fn report_hold(lock: &str, session: &Session, ev: SessionEvent) {
    match ev {
        SessionEvent::Jeopardy => {
            let lease = session.lease();
            let sent = session.local_deadline() - wire::local_lease(lease);
            crate::say!(
                "lockctl: session in jeopardy at {}: no renewal since the KeepAlive sent at {}: stop acting on {lock}",
                now_stamp(),
                stamp(wall(sent))
            );
        }
        SessionEvent::Safe => crate::say!(
            "lockctl: session safe again at {}: still holding {lock}",
            now_stamp()
        ),
        SessionEvent::FailOver => {}
        SessionEvent::Expired => crate::say!(
            "lockctl: session expired at {}: lock {lock} lost",
            now_stamp()
        ),
    }
}

/// True when stdin is a terminal whose foreground process group is ours.
fn in_foreground() -> bool {
    // SAFETY: plain queries of file descriptor 0 and of this process.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// Makes our process group the terminal's foreground group again.
fn take_terminal_back() {
    // SAFETY: as a shell does; SIGTTOU is ignored for the call, as a background group
    // would otherwise be stopped by it.
    unsafe {
        let old = libc::signal(libc::SIGTTOU, libc::SIG_IGN);
        libc::tcsetpgrp(0, libc::getpgrp());
        libc::signal(libc::SIGTTOU, old);
    }
}

/// The wall-clock time of `at`.
fn wall(at: Instant) -> SystemTime {
    let (now, wall_now) = (Instant::now(), SystemTime::now());
    if at <= now {
        wall_now - (now - at)
    } else {
        wall_now + (at - now)
    }
}

fn stamp(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

fn now_stamp() -> String {
    stamp(SystemTime::now())
}
