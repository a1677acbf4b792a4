//! The process a launcher sees: a small parent that runs the node in a child process.
//!
//! A node whose shared directory hangs (a hard-mounted NFS whose server is gone, a FUSE
//! daemon that stopped answering) has a thread in uninterruptible sleep in the kernel. Its
//! watchdog notices at `fs-timeout`, stops its commands and exits, but the kernel cannot
//! finish the exit of a process while one of its threads waits on the filesystem: a
//! launcher (srun, a shell, a test) would see a live pid until the filesystem answers.
//!
//! So `rl-node --master|--worker N` starts itself again as a child that does the node's
//! work, and stays its parent, touching nothing on the shared directory:
//! - it exits with the child's exit code, or dies of the signal that killed the child;
//! - it passes SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 and SIGCONT on to the child, and
//!   SIGTSTP too before stopping itself. The child runs in its own process group, so a
//!   terminal's Ctrl-C reaches it once, through here; a signal sent to every process of a
//!   job (Slurm) reaches it twice, and [`Deliveries`] counts that as one. Signals keep
//!   their order on the way (the node's first stop signal decides its exit): they are
//!   taken one at a time ([`next_signal`]), and each is passed on only once the node took
//!   the one before;
//! - when the child's watchdog fires, or the child is about to exit, it says so through a
//!   pipe. If it has not exited a [`MOMENT`] later and a thread of it waits in the kernel
//!   (state D; an exit that is merely slow gets up to [`SLOW_EXIT`] more), the parent
//!   prints what happened and exits on its behalf, with 4 (fs-timeout) or the code the
//!   child was exiting with.
//!
//! The child dies with the parent (`PR_SET_PDEATHSIG`), so a `kill -9` of the pid a
//! launcher knows still ends the node, whose guardian then stops its commands. Records and
//! messages name the parent's pid: it lives exactly as long as the node can still act (a
//! child left behind in the kernel has a fatal signal pending and never runs again).

use super::descendants::Proc;
use libc::{SIGCONT, SIGHUP, SIGINT, SIGTERM, SIGTSTP, SIGUSR1, SIGUSR2};
use rustix::fs::FileType;
use rustix::io::{Errno, FdFlags};
use rustix::process::{Pid, Signal};
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use crate::config::template::SUPERVISOR_ENV as ENV;

/// How long a node whose watchdog fired gets to exit (it stops its commands in about half
/// a second) before the supervisor calls it stuck.
const MOMENT: Duration = Duration::from_secs(2);

/// A direct delivery and a passed-on copy of one signal arrive this close together.
const SAME_DELIVERY: Duration = Duration::from_secs(1);

/// The signals passed on to the node.
const PASSED_ON: [i32; 7] = [SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT, SIGTSTP];

/// The most the supervisor waits for the node to take a signal it passed on before it
/// passes on the next one (a stopped node takes none).
const TAKEN_LIMIT: Duration = Duration::from_millis(100);

/// The node's end of the link to its supervisor.
pub struct Link {
    /// The supervisor's pid.
    pub parent: u32,
    pipe: OwnedFd,
}

impl Link {
    /// In the node process: the link its supervisor left in the environment (removed from
    /// it, so commands do not inherit it). None without one, or when the variable does not
    /// name this process's parent and a pipe (set by hand, or inherited from elsewhere).
    /// Call it while the process has a single thread.
    pub fn inherited() -> Option<Link> {
        let value = std::env::var(ENV).ok()?;
        std::env::remove_var(ENV);
        let (pid, fd) = value.split_once(':')?;
        let (parent, fd): (u32, RawFd) = (pid.parse().ok()?, fd.parse().ok()?);
        if Pid::as_raw(rustix::process::getppid()) as u32 != parent {
            return None;
        }
        // SAFETY: borrowed for the one fstat below, in a process with a single thread, so
        // nothing closes `fd` meanwhile; a number that is not an open fd makes fstat fail
        // with EBADF, and then nothing else is done with it.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let st = rustix::fs::fstat(borrowed).ok()?;
        if FileType::from_raw_mode(st.st_mode) != FileType::Fifo {
            return None;
        }
        // SAFETY: `fd` is open (fstat above) and a pipe, and the variable that named it
        // names this process's parent: it is the supervisor's write end, inherited by
        // number and claimed nowhere else in this process (the variable is removed, so
        // this runs once), so the Link may own and close it.
        let pipe = unsafe { OwnedFd::from_raw_fd(fd) };
        // Neither commands nor the guardian hold it: only this process writes to it.
        let _ = rustix::io::fcntl_setfd(&pipe, FdFlags::CLOEXEC);
        Some(Link { parent, pipe })
    }

    /// The watchdog fired: tell the supervisor. One short write to a pipe (atomic, and it
    /// never waits on the filesystem).
    pub fn stuck(&self, rank: u32, stuck: Duration, limit: Duration, what: &str) {
        let line = Stuck {
            rank,
            stuck,
            limit,
            what: what.replace(['\t', '\n'], " "),
        }
        .line();
        self.send(&line);
    }

    /// The node is about to exit with `code`: if the exit does not complete (a thread is
    /// stuck in the filesystem), the supervisor exits with `code` in its place.
    pub fn exiting(&self, rank: u32, code: i32) {
        self.send(&Exiting { rank, code }.line());
    }

    fn send(&self, line: &str) {
        let _ = rustix::io::write(&self.pipe, line.as_bytes());
    }
}

/// What the node reports through the link.
#[derive(Debug, PartialEq)]
enum Report {
    Stuck(Stuck),
    Exiting(Exiting),
}

impl Report {
    fn parse(line: &str) -> Option<Report> {
        Stuck::parse(line)
            .map(Report::Stuck)
            .or_else(|| Exiting::parse(line).map(Report::Exiting))
    }

    /// The code to exit with, and the one line to print, when the node process has not
    /// exited a moment after this report.
    fn verdict(&self, pid: i32) -> (i32, String) {
        match self {
            Report::Stuck(s) => (crate::exit::Cause::Deadline.exit_code(), s.message(pid)),
            Report::Exiting(e) => (e.code, e.message(pid)),
        }
    }
}

/// The node is exiting with a code.
#[derive(Debug, PartialEq)]
struct Exiting {
    rank: u32,
    code: i32,
}

impl Exiting {
    fn line(&self) -> String {
        format!("exiting\t{}\t{}\n", self.rank, self.code)
    }

    fn parse(line: &str) -> Option<Exiting> {
        let mut f = line.trim_end_matches('\n').split('\t');
        (f.next()? == "exiting").then_some(())?;
        Some(Exiting {
            rank: f.next()?.parse().ok()?,
            code: f.next()?.parse().ok()?,
        })
    }

    fn message(&self, pid: i32) -> String {
        log_line(
            self.rank,
            &format!(
                "node process {pid} is stuck in the kernel: it began to exit with code {} and a thread of it still waits there, most likely on the shared filesystem; it will exit when that answers; exiting with code {} on its behalf",
                self.code, self.code,
            ),
        )
    }
}

/// One error line in the node's log format (the supervisor writes it itself, from a
/// forked helper, not through `tracing`).
fn log_line(rank: u32, message: &str) -> String {
    let timestamp = chrono::Local::now().format(crate::logging::TIMESTAMP);
    if crate::logging::json() {
        let line = serde_json::json!({
            "timestamp": timestamp.to_string(),
            "level": "ERROR",
            "message": message,
            "rank": rank,
        });
        format!("{line}\n")
    } else {
        format!("{timestamp} [rank {rank}] error: {message}\n")
    }
}

/// What the node's watchdog reports through the link.
#[derive(Debug, PartialEq)]
struct Stuck {
    rank: u32,
    stuck: Duration,
    limit: Duration,
    what: String,
}

impl Stuck {
    fn line(&self) -> String {
        format!(
            "stuck\t{}\t{}\t{}\t{}\n",
            self.rank,
            self.stuck.as_millis(),
            self.limit.as_millis(),
            self.what
        )
    }

    fn parse(line: &str) -> Option<Stuck> {
        let mut f = line.trim_end_matches('\n').splitn(5, '\t');
        (f.next()? == "stuck").then_some(())?;
        let rank = f.next()?.parse().ok()?;
        let stuck = Duration::from_millis(f.next()?.parse().ok()?);
        let limit = Duration::from_millis(f.next()?.parse().ok()?);
        Some(Stuck {
            rank,
            stuck,
            limit,
            what: f.next()?.to_string(),
        })
    }

    /// The supervisor's one line about a node left in the kernel.
    fn message(&self, pid: i32) -> String {
        log_line(
            self.rank,
            &format!(
                "node process {pid} is stuck in the kernel on the shared filesystem (no answer for {:.0}s while {}; fs-timeout is {}); its commands were killed, and it will exit when the filesystem answers; exiting with code 4 on its behalf",
                self.stuck.as_secs_f64(),
                self.what,
                humantime::format_duration(self.limit),
            ),
        )
    }
}

/// Run this node in a child process and wait for it (see the module doc). Returns the
/// exit code to exit with, or dies of the child's signal. Err when the child cannot be
/// started.
pub fn run_node_in_child() -> io::Result<i32> {
    // Blocked before the child and any thread exist, so a signal that comes meanwhile
    // waits to be passed on; the child gets the mask this process started with.
    // Nothing handles them, so a thread that did not block them would die of them.
    debug_assert!(
        std::fs::read_dir("/proc/self/task").map_or(true, |t| t.count() == 1),
        "the supervisor blocks its signals while it has a single thread"
    );
    let (read, write) = pipe()?;
    let (set, original) = block_signals(&PASSED_ON);
    let me = std::process::id();
    let write_fd = write.as_raw_fd();
    let mut args = std::env::args_os();
    // /proc/self/exe is this very binary, even if its file was replaced since.
    let mut cmd = Command::new("/proc/self/exe");
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    cmd.args(args)
        .env(ENV, format!("{me}:{write_fd}"))
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: prctl, getppid, fcntl (rustix's direct system
    // calls) and pthread_sigmask neither allocate nor lock (the mask is a copy of
    // `original`, plain data), the errors are built from errno numbers without allocating,
    // and `write_fd` is the child's inherited copy of the pipe's write end, open until exec.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the supervisor: a kill -9 of it ends the node.
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // It may have died before the line above.
            if Pid::as_raw(rustix::process::getppid()) as u32 != me {
                return Err(Errno::SRCH.into());
            }
            let write = BorrowedFd::borrow_raw(write_fd);
            if let Ok(flags) = rustix::io::fcntl_getfd(write) {
                let _ = rustix::io::fcntl_setfd(write, flags.difference(FdFlags::CLOEXEC));
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &original, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut child = cmd.spawn().inspect_err(|_| {
        // This process runs the node itself then (`cli`): as it started.
        // SAFETY: pthread_sigmask reads `original`, a live local, and writes no old mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &original, std::ptr::null_mut()) };
    })?;
    drop(write);
    let pid = child.id() as i32;
    // Pinned before it can be reaped: a signal passed on never hits a reused pid.
    let node = Arc::new(Proc::open(pid));

    let n = node.clone();
    std::thread::Builder::new()
        .name("pass-signals".into())
        .spawn(move || loop {
            let (sig, _) = next_signal(&set);
            // Every signal in PASSED_ON has a name.
            if let (Some(n), Some(named)) = (n.as_ref(), Signal::from_named_raw(sig)) {
                n.signal(named);
                wait_taken(pid, sig, TAKEN_LIMIT);
            }
            if sig == SIGTSTP {
                // Ctrl-Z: the node stopped above; now this process, as a shell expects.
                let me = rustix::process::getpid();
                let _ = rustix::process::kill_process(me, Signal::STOP);
            }
        })?;

    // Set once the child is reaped: from then on its own exit status is the answer.
    let reaped = Arc::new((Mutex::new(false), Condvar::new()));
    let r = reaped.clone();
    std::thread::Builder::new()
        .name("node-link".into())
        .spawn(move || {
            let lines = BufReader::new(std::fs::File::from(read)).lines();
            for line in lines.map_while(Result::ok) {
                let Some(report) = Report::parse(&line) else {
                    continue;
                };
                let (m, cv) = &*r;
                let mut done = cv
                    .wait_timeout_while(m.lock().unwrap(), MOMENT, |done| !*done)
                    .unwrap()
                    .0;
                // An exit that is only slow (a loaded machine) is not one stuck in the
                // kernel: while no thread of the node waits there (state D), give it up to
                // SLOW_EXIT more before answering for it.
                let slow_until = std::time::Instant::now() + SLOW_EXIT;
                while !*done && !in_kernel_wait(pid) && std::time::Instant::now() < slow_until {
                    done = cv
                        .wait_timeout_while(done, MOMENT / 4, |done| !*done)
                        .unwrap()
                        .0;
                }
                if *done {
                    return;
                }
                // Holding the lock: the main thread cannot exit with another code now.
                let (code, message) = report.verdict(pid);
                write_detached(&message);
                std::process::exit(code);
            }
        })?;

    let status = child.wait()?;
    let (m, cv) = &*reaped;
    *m.lock().unwrap() = true;
    cv.notify_all();
    match (status.code(), status.signal()) {
        (Some(code), _) => Ok(code),
        (None, Some(sig)) => die_of(sig),
        (None, None) => Ok(crate::exit::Cause::Failed.exit_code()),
    }
}

/// The most the supervisor waits for a node that reported its exit but is not in the
/// kernel (a slow exit, not a hung filesystem) before exiting on its behalf anyway.
const SLOW_EXIT: Duration = Duration::from_secs(20);

/// Does a thread of process `pid` wait uninterruptibly in the kernel (state D)? Reads only
/// `/proc`, which does not hang with the shared filesystem.
fn in_kernel_wait(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('D'))
            })
            .unwrap_or(false)
    })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?)
}

/// End this process by signal `sig`, as the node ended, so a launcher sees the same.
fn die_of(sig: i32) -> ! {
    // The node may have crashed (SIGSEGV, SIGABRT): no core file of this process.
    let _ = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable);
    // SAFETY: system calls with integer arguments, and signal-set calls on a local sigset_t
    // (all zero bytes is a valid value) with a null pointer for the old mask, which
    // pthread_sigmask allows; SIG_DFL installs no handler code.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        // To this thread, which alone does not block it: a thread waiting for it in
        // `next_signal` would take it instead of dying of it.
        libc::raise(sig);
    }
    // A signal whose default action is not to end the process.
    std::process::exit(128 + sig)
}

/// Block `signals` in the calling thread (and so in the threads it starts from now on).
/// Returns the set, for [`next_signal`], and the mask the thread had before.
pub(crate) fn block_signals(signals: &[i32]) -> (libc::sigset_t, libc::sigset_t) {
    // SAFETY: signal-set calls on local sigset_t values (all zero bytes is a valid value);
    // pthread_sigmask reads `set` and writes the old mask into `old`, both live locals.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &sig in signals {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        (set, old)
    }
}

/// The next of the signals in `set` (blocked in every thread: [`block_signals`]) sent to
/// this process, and its sender's pid when a process sent it with kill(2) or sigqueue(3)
/// (not for signals the kernel generates, such as a terminal's Ctrl-C). Signals are taken
/// one at a time in the order they come; only signals pending at the same moment come
/// lowest number first (the kernel's order), and one sent again while still pending
/// counts once.
pub(crate) fn next_signal(set: &libc::sigset_t) -> (i32, Option<i32>) {
    loop {
        // SAFETY: libc::siginfo_t is plain C data for which all zero bytes is a valid
        // value; sigwaitinfo reads `set` and writes into `info`, both live; si_pid reads
        // an int of the union the kernel filled in, which for si_code <= 0 (kill(2),
        // sigqueue(3)) is the sender's pid.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let sig = libc::sigwaitinfo(set, &mut info);
            if sig > 0 {
                return (sig, (info.si_code <= 0).then(|| info.si_pid()));
            }
        }
        // EINTR: interrupted by another signal's handler; wait again.
    }
}

/// Wait, at most `limit`, until process `pid` has taken signal `sig` (it is no longer
/// pending for the process: `ShdPnd` in `/proc/<pid>/status`). Reads only `/proc`.
fn wait_taken(pid: i32, sig: i32, limit: Duration) {
    let until = Instant::now() + limit;
    let bit = 1u64 << (sig - 1);
    while Instant::now() < until {
        let pending = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("ShdPnd:"))
                    .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            });
        match pending {
            Some(mask) if mask & bit != 0 => std::thread::sleep(Duration::from_micros(200)),
            _ => return,
        }
    }
}

/// Write `text` to stderr from a forked process, waiting for it at most a second. When
/// stderr is a file on the hung filesystem itself the write blocks in the kernel, and a
/// process with a thread blocked there could not exit; the writer may stay behind instead,
/// and prints when the filesystem answers. Escaped like all output (`crate::output`): the
/// line names what the node was doing, which can hold a path from the shared directory.
fn write_detached(text: &str) {
    let text = crate::output::escape_lines(text);
    let bytes = text.as_bytes();
    // SAFETY: the forked writer calls only write(2) (rustix's direct system call) and
    // _exit(2), which is safe after a fork of a process with threads (only
    // async-signal-safe calls are), and reads `bytes`, its copy of this process's memory,
    // without allocating.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut done = 0;
        while done < bytes.len() {
            match rustix::io::write(rustix::stdio::stderr(), &bytes[done..]) {
                Ok(n) if n > 0 => done += n,
                _ => break,
            }
        }
        // SAFETY: _exit takes only a status; it ends the forked child without running the
        // atexit handlers or flushing the buffers it copied from this process.
        unsafe { libc::_exit(0) };
    }
    let Some(pid) = crate::process::pid(pid) else {
        crate::err!("{text}");
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        // Still running: Ok(None). Reaped, or an error: done either way.
        if !matches!(
            rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG),
            Ok(None)
        ) {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Tells one delivery of a signal to the node from two. A signal sent to every process of
/// a job (Slurm does) reaches the node directly and again passed on by its supervisor; the
/// node escalates on a second signal, so such a pair must count once. A passed-on copy and
/// a direct delivery of the same signal within [`SAME_DELIVERY`] of each other are one
/// delivery; two copies from the same side (two Ctrl-Cs) are two.
pub struct Deliveries {
    supervisor: Option<i32>,
    /// The last delivery that was not paired yet: signal, passed on, when.
    last: Option<(i32, bool, Instant)>,
}

impl Deliveries {
    /// `supervisor`: the pid whose signals are passed-on copies (None: every signal counts).
    pub fn new(supervisor: Option<u32>) -> Deliveries {
        Deliveries {
            supervisor: supervisor.map(|p| p as i32),
            last: None,
        }
    }

    /// Is this signal, sent by `sender` (None: the kernel or unknown), a new delivery?
    pub fn is_new(&mut self, sig: i32, sender: Option<i32>, now: Instant) -> bool {
        let Some(supervisor) = self.supervisor else {
            return true;
        };
        let passed_on = sender == Some(supervisor);
        if let Some((s, p, at)) = self.last.take() {
            if s == sig && p != passed_on && now.saturating_duration_since(at) < SAME_DELIVERY {
                return false;
            }
        }
        self.last = Some((sig, passed_on, now));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_direct_signal_and_its_passed_on_copy_are_one_delivery_in_either_order() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Deliveries::new(Some(10));
        assert!(d.is_new(SIGTERM, Some(99), t));
        assert!(!d.is_new(SIGTERM, Some(10), t + ms(5)));
        let mut d = Deliveries::new(Some(10));
        assert!(d.is_new(SIGTERM, Some(10), t));
        assert!(!d.is_new(SIGTERM, None, t + ms(5)));
        // A second pair is a second delivery.
        assert!(d.is_new(SIGTERM, Some(10), t + ms(300)));
        assert!(!d.is_new(SIGTERM, None, t + ms(301)));
    }

    #[test]
    fn two_copies_from_one_side_another_signal_or_a_late_copy_are_two_deliveries() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Deliveries::new(Some(10));
        assert!(d.is_new(SIGINT, Some(10), t));
        assert!(d.is_new(SIGINT, Some(10), t + ms(100)));
        let mut d = Deliveries::new(Some(10));
        assert!(d.is_new(SIGINT, None, t));
        assert!(d.is_new(SIGTERM, Some(10), t + ms(1)));
        let mut d = Deliveries::new(Some(10));
        assert!(d.is_new(SIGINT, None, t));
        assert!(d.is_new(SIGINT, Some(10), t + ms(1500)));
        // Without a supervisor every signal counts.
        let mut d = Deliveries::new(None);
        assert!(d.is_new(SIGINT, None, t));
        assert!(d.is_new(SIGINT, Some(10), t + ms(1)));
    }

    #[test]
    fn the_reports_survive_the_pipe() {
        let s = Stuck {
            rank: 3,
            stuck: Duration::from_millis(3250),
            limit: Duration::from_secs(3),
            what: "polling the shared directory".into(),
        };
        assert_eq!(Report::parse(&s.line()), Some(Report::Stuck(s)));
        let e = Exiting { rank: 2, code: 143 };
        assert_eq!(Report::parse(&e.line()), Some(Report::Exiting(e)));
        assert_eq!(Report::parse("hello"), None);
    }
}
