//! Child processes: each command runs under `sh -c` in its own process group, output to a
//! log file; stopping means SIGTERM to the group, a grace period, then SIGKILL.
//!
//! Four mechanisms make sure no child or grandchild outlives its node:
//! - rl-node is a child subreaper, so orphaned grandchildren are re-parented to it and a
//!   single reaper thread collects them (nothing lingers as a zombie in a group we wait on);
//! - every group is registered in a [`Registry`] that the signal thread and the watchdog
//!   can kill without touching the filesystem;
//! - every command carries `RL_NODE_OWNER=<nonce>:<command id>`, so a descendant that left
//!   its group (`setsid`) is still found and stopped when its command ends or the node
//!   shuts down ([`descendants`]);
//! - a guardian process (`rl-node __guard <nonce>`) holds the other end of a pipe and, when
//!   the pipe closes (also when the node is `kill -9`ed), kills every registered group and
//!   every process whose environment carries the node's nonce. When the node's watchdog
//!   fires, it is told to stop the node's commands at once, as the node's own threads may
//!   be stuck in the filesystem.

pub(crate) mod descendants;
#[cfg(feature = "sim")]
pub mod fake;
pub(crate) mod forensics;
pub mod launcher;
pub(crate) mod ports;
pub(crate) mod spawn;
#[cfg(feature = "sim")]
pub use fake::{FakeLauncher, FakeRun, FakeScript};
pub use launcher::{Launcher, Processes};

/// Set for every command the node starts, to `<node nonce>:<command id>`: descendants
/// inherit it into any process group or session, so the node (and its guardian, after a
/// `kill -9`) can find and stop them ([`descendants`]).
pub const OWNER_ENV: &str = "RL_NODE_OWNER";

use rustix::process::{Pid, Signal};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufRead, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildExit {
    Success,
    Exit(i32),
    Signal(i32),
    /// A reused item process (`node::workers`) ended, or broke the reply protocol, while
    /// it held the item, without an answer for it; what it did is in its log.
    Unanswered,
}

impl ChildExit {
    fn from_wait_status(status: libc::c_int) -> ChildExit {
        if libc::WIFEXITED(status) {
            match libc::WEXITSTATUS(status) {
                0 => ChildExit::Success,
                c => ChildExit::Exit(c),
            }
        } else {
            ChildExit::Signal(libc::WTERMSIG(status))
        }
    }
}

/// How a successful exit reads ([`ChildExit::Success`] displayed): what readers of the
/// event log's `command` events compare an `exit` with.
pub const EXIT_SUCCESS: &str = "exit code 0";

impl std::fmt::Display for ChildExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChildExit::Success => f.write_str(EXIT_SUCCESS),
            ChildExit::Exit(c) => write!(f, "exit code {c}"),
            ChildExit::Signal(s) => write!(f, "killed by signal {s} ({})", signal_name(*s)),
            ChildExit::Unanswered => f.write_str("no answer from the item's worker process"),
        }
    }
}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGBUS => "SIGBUS",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        _ => "signal",
    }
}

/// Events the node's single loop reacts to.
#[derive(Debug)]
pub enum Event {
    /// A process that was our child ended (a command's leader, or an adopted orphan).
    Reaped { pid: i32, exit: ChildExit },
    /// First SIGINT, SIGTERM, SIGHUP, SIGUSR1 or SIGUSR2.
    Signal(i32),
    /// A helper thread of the node finished its work (a merge): look again now rather
    /// than at the next poll.
    Wake,
    /// Item worker `worker` (its id, not a pid) replied, or its replies ended
    /// (`node::workers`).
    Reply { worker: u64, reply: Reply },
}

/// What an item worker said on its descriptor 3, one line at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `{"item": NAME}` or `{"item": NAME, "exit": CODE}`: the item is done, with the exit
    /// code a command of its own would have had (0 if none is given).
    Done { item: String, exit: i32 },
    /// A line that is not such an object (quoted in the message).
    Garbled(String),
    /// The reply pipe reached its end: the worker and all it started are gone.
    Closed,
}

impl Reply {
    /// A reply line as the worker wrote it (without its newline).
    pub fn parse(line: &[u8]) -> Reply {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Line {
            item: String,
            #[serde(default)]
            exit: i32,
        }
        // serde would take a struct from an array too: only an object is an answer.
        let object = line.trim_ascii_start().starts_with(b"{");
        match serde_json::from_slice::<Line>(line) {
            Ok(l) if object => Reply::Done {
                item: l.item,
                exit: l.exit,
            },
            parsed => {
                let shown: String = String::from_utf8_lossy(line).chars().take(200).collect();
                let why = match parsed {
                    Err(e) => format!(": {e}"),
                    Ok(_) => ": not an object".into(),
                };
                Reply::Garbled(format!(
                    "{shown:?} is not a reply ({{\"item\": NAME}} or {{\"item\": NAME, \"exit\": CODE}}){why}"
                ))
            }
        }
    }
}

/// Process groups alive on this node (each with the id of the command that leads it),
/// shared with the signal thread and the watchdog.
pub struct Registry {
    groups: Mutex<BTreeMap<i32, u64>>,
    /// Groups of hang reports' tools (`py-spy`, `nvidia-smi`): no command's, and no exit
    /// the node waits for, but killed with the commands (by the signal thread, the
    /// watchdog, the guardian), so that a tool that hangs never outlives the node.
    tools: Mutex<BTreeSet<i32>>,
    guardian: Mutex<Option<ChildStdin>>,
    guardian_pid: AtomicI32,
    /// Names this node process in its commands' `RL_NODE_OWNER`.
    nonce: String,
    next_command: AtomicU64,
}

/// What a command left behind when it was stopped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Leftovers {
    /// Its process group still had members.
    pub group: bool,
    /// Descendants outside the group (`setsid`) that were stopped.
    pub outside: usize,
}

impl Leftovers {
    pub fn any(&self) -> bool {
        self.group || self.outside > 0
    }
}

impl Registry {
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry {
            groups: Mutex::new(BTreeMap::new()),
            tools: Mutex::new(BTreeSet::new()),
            guardian: Mutex::new(None),
            guardian_pid: AtomicI32::new(0),
            nonce: descendants::new_nonce(),
            next_command: AtomicU64::new(1),
        })
    }

    /// Start the guardian process. Best effort: without it, a `kill -9` of the node
    /// leaves its children running, so failing to start it is reported by the caller.
    pub fn start_guardian(&self) -> io::Result<()> {
        let exe = std::env::current_exe()?;
        let mut child = unblocked_signals(&mut Command::new(exe))
            .arg("__guard")
            .arg(&self.nonce)
            .env_remove(OWNER_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        self.guardian_pid
            .store(child.id() as i32, Ordering::Relaxed);
        *self.guardian.lock().unwrap() = child.stdin.take();
        Ok(())
    }

    fn tell_guardian(&self, line: String) {
        if let Some(g) = self.guardian.lock().unwrap().as_mut() {
            let _ = g.write_all(line.as_bytes());
            let _ = g.flush();
        }
    }

    /// The watchdog fired: the guardian stops every registered group and every descendant
    /// of the node now, without waiting for the node to exit (which a thread stuck in the
    /// filesystem can delay until the filesystem answers).
    pub fn guardian_kill_now(&self) {
        self.tell_guardian("!\n".to_string());
    }

    /// A new command id and the `RL_NODE_OWNER` variable that marks the command's
    /// processes as its own.
    pub fn new_command(&self) -> (u64, (String, String)) {
        let id = self.next_command.fetch_add(1, Ordering::Relaxed);
        (
            id,
            (OWNER_ENV.to_string(), descendants::marker(&self.nonce, id)),
        )
    }

    /// Register the group `pgid` led by command `command` (from [`Registry::new_command`]).
    pub fn add(&self, pgid: i32, command: u64) {
        self.groups.lock().unwrap().insert(pgid, command);
        self.tell_guardian(format!("+{pgid}\n"));
    }

    fn remove(&self, pgid: i32) -> Option<u64> {
        let command = self.groups.lock().unwrap().remove(&pgid);
        self.tell_guardian(format!("-{pgid}\n"));
        command
    }

    /// Register the group `pgid` of a hang report's tool until [`Registry::remove_tool`]:
    /// the guardian knows it as it knows the commands' groups.
    pub(crate) fn add_tool(&self, pgid: i32) {
        self.tools.lock().unwrap().insert(pgid);
        self.tell_guardian(format!("+{pgid}\n"));
    }

    pub(crate) fn remove_tool(&self, pgid: i32) {
        self.tools.lock().unwrap().remove(&pgid);
        self.tell_guardian(format!("-{pgid}\n"));
    }

    /// Is `pid` the leader of a registered group (a command whose exit someone awaits)?
    pub fn contains(&self, pid: i32) -> bool {
        self.groups.lock().unwrap().contains_key(&pid)
    }

    pub fn groups(&self) -> Vec<i32> {
        self.groups.lock().unwrap().keys().copied().collect()
    }

    /// The command of group `pgid` ended (its leader exited) or must end: stop what is
    /// left of its group and its descendants outside the group (SIGTERM, `grace`,
    /// SIGKILL), and forget it. Descendants of other commands are left alone.
    pub fn stop(&self, pgid: i32, grace: Duration) -> Leftovers {
        let group = group_alive(pgid);
        if group {
            stop_group(pgid, grace);
        }
        let command = self.groups.lock().unwrap().get(&pgid).copied();
        let outside = command
            .map(|c| descendants::stop(|| descendants::of_command(&self.nonce, c), grace))
            .unwrap_or(0);
        self.remove(pgid);
        Leftovers { group, outside }
    }

    /// At shutdown, after the groups were stopped: stop every remaining descendant of this
    /// process (except the guardian) and anything else that carries this node's nonce.
    /// Returns how many there were.
    pub fn stop_descendants(&self, grace: Duration) -> usize {
        let spare = [self.guardian_pid.load(Ordering::Relaxed)];
        descendants::stop(|| descendants::all(&self.nonce, &spare, true), grace)
    }

    /// The guardian's pid (0: none): a descendant of the node that is no command's.
    pub fn guardian(&self) -> i32 {
        self.guardian_pid.load(Ordering::Relaxed)
    }

    /// Signal every registered group, the tools' too (no filesystem access: safe from any
    /// thread).
    pub fn signal_all(&self, sig: Signal) {
        let tools: Vec<i32> = self.tools.lock().unwrap().iter().copied().collect();
        for g in self.groups().into_iter().chain(tools) {
            signal_group(g, sig);
        }
    }

    /// SIGKILL every group and every descendant (except the guardian) at once. Reads only
    /// `/proc/*/task/*/children`, never another process's memory, so it cannot block on
    /// a child stuck in the filesystem.
    pub fn kill_all_now(&self) {
        self.signal_all(Signal::KILL);
        let spare = [self.guardian_pid.load(Ordering::Relaxed)];
        descendants::kill(descendants::all(&self.nonce, &spare, false));
    }
}

/// Start `cmd` with no signal blocked: the node blocks its stop signals in every thread
/// (its signal thread takes them: `node::signals` says why), and a child would inherit
/// that mask and never see SIGTERM.
pub fn unblocked_signals(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: it allocates nothing and takes no lock, and
    // calls only sigemptyset and pthread_sigmask (both async-signal-safe) on a local
    // sigset_t, for which all zero bytes is a valid value.
    unsafe {
        cmd.pre_exec(|| {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            Ok(())
        })
    }
}

/// `raw` as a process or group id. Only a positive number names one: kill(2) reads 0 as
/// "this process's group" and -1 as "every process", which no caller here means.
pub(crate) fn pid(raw: i32) -> Option<Pid> {
    if raw > 0 {
        Pid::from_raw(raw)
    } else {
        None
    }
}

/// Send `sig` to process group `pgid` (best effort: the group may be gone already).
fn signal_group(pgid: i32, sig: Signal) {
    if let Some(g) = pid(pgid) {
        let _ = rustix::process::kill_process_group(g, sig);
    }
}

pub fn group_alive(pgid: i32) -> bool {
    pid(pgid).is_some_and(|g| rustix::process::test_kill_process_group(g).is_ok())
}

/// SIGTERM the group, wait up to `grace` for it to empty, then SIGKILL and wait a little
/// more. Returns true if the group is gone.
pub fn stop_group(pgid: i32, grace: Duration) -> bool {
    stop_group_collecting(pgid, grace, &mut || {})
}

/// [`stop_group`], calling `collect` before each look at the group (a caller that waits
/// for the group's leader itself collects it there).
fn stop_group_collecting(pgid: i32, grace: Duration, collect: &mut dyn FnMut()) -> bool {
    signal_group(pgid, Signal::TERM);
    // A process stopped by SIGSTOP would never act on SIGTERM.
    signal_group(pgid, Signal::CONT);
    if wait_group_empty(pgid, grace, collect) {
        return true;
    }
    signal_group(pgid, Signal::KILL);
    wait_group_empty(pgid, Duration::from_secs(5), collect)
}

fn wait_group_empty(pgid: i32, limit: Duration, collect: &mut dyn FnMut()) -> bool {
    let start = Instant::now();
    let mut step = Duration::from_millis(1);
    loop {
        collect();
        if !group_alive(pgid) {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(step);
        step = (step * 2).min(Duration::from_millis(50));
    }
}

/// Become the reaper of our descendants and start the thread that collects every child
/// that ends, sending `Event::Reaped`, except a [`Waited`] child's, whose exit goes to its
/// starter. Nothing else in the node process may wait on children (it would race with this
/// thread).
pub fn start_reaper(tx: Sender<Event>) {
    REAPER.store(true, Ordering::SeqCst);
    // Any pid turns it on (prctl's argument is a flag).
    let _ = rustix::process::set_child_subreaper(Some(rustix::process::getpid()));
    std::thread::Builder::new()
        .name("reaper".into())
        .spawn(move || {
            loop {
                let waited = rustix::process::wait(rustix::process::WaitOptions::empty());
                if let Ok(Some((pid, status))) = waited {
                    let pid = pid.as_raw_pid();
                    let exit = ChildExit::from_wait_status(status.as_raw());
                    // A child started by `spawn_waited` is its starter's to hear about.
                    let waiter = WAITERS.lock().unwrap().remove(&pid);
                    if let Some(w) = waiter {
                        let _ = w.send(exit);
                        continue;
                    }
                    if tx.send(Event::Reaped { pid, exit }).is_err() {
                        return;
                    }
                    continue;
                }
                if matches!(waited, Err(rustix::io::Errno::INTR)) {
                    continue;
                }
                // No children right now (ECHILD): look again shortly.
                std::thread::sleep(Duration::from_millis(5));
            }
        })
        .expect("spawn reaper thread");
}

/// Whether this process's reaper runs (then nothing else may wait for a child).
static REAPER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Children started by [`spawn_waited`] while the reaper runs, and where their exits go.
static WAITERS: Mutex<BTreeMap<i32, Sender<ChildExit>>> = Mutex::new(BTreeMap::new());

/// A child whose exit its starter hears about, not the node: with the node's reaper
/// running, the reaper hands the child's exit to this handle (its waiter); without it (a
/// process with no reaper, such as `rl-node aggregate`), the handle waits for the child
/// itself. Either way, nothing else may wait for it.
pub(crate) struct Waited {
    /// Waited for through std only when there is no reaper; with the reaper, std must
    /// never wait for it (the two would race for its exit).
    child: Child,
    pid: i32,
    /// With the reaper: where it sends the child's exit.
    exits: Option<Receiver<ChildExit>>,
    exit: Option<ChildExit>,
}

/// Start `cmd` as a [`Waited`] child. The child is registered as a waiter before the
/// reaper can collect it (the reaper takes the same lock before it looks for a waiter),
/// so its exit never reaches the node.
///
/// `cmd` must always exec (run it under `sh`, which is always there): std waits for a
/// child whose exec failed, which the reaper would have collected first.
pub(crate) fn spawn_waited(cmd: &mut Command) -> io::Result<Waited> {
    let mut waiters = WAITERS.lock().unwrap();
    let child = cmd.spawn()?;
    let pid = child.id() as i32;
    let exits = REAPER.load(Ordering::SeqCst).then(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        waiters.insert(pid, tx);
        rx
    });
    drop(waiters);
    Ok(Waited {
        child,
        pid,
        exits,
        exit: None,
    })
}

impl Waited {
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// The child's standard output, when it was piped.
    pub(crate) fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// Wait at most `limit` for the child's exit (`Duration::ZERO`: just look). Once it
    /// is known, it is returned at once every time.
    pub(crate) fn wait_timeout(&mut self, limit: Duration) -> Option<ChildExit> {
        if self.exit.is_some() {
            return self.exit;
        }
        self.exit = match &self.exits {
            // The waiter stays registered until the reaper sends the exit, so the channel
            // cannot be closed before the exit is in it.
            Some(rx) => rx.recv_timeout(limit).ok(),
            None => {
                let deadline = Instant::now() + limit;
                loop {
                    // An error (the child is not ours to wait for, which cannot happen
                    // without the reaper) counts as still running: callers keep their
                    // deadlines.
                    if let Ok(Some(status)) = self.child.try_wait() {
                        use std::os::unix::process::ExitStatusExt;
                        break Some(ChildExit::from_wait_status(status.into_raw()));
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break None;
                    }
                    std::thread::sleep(left.min(Duration::from_millis(10)));
                }
            }
        };
        self.exit
    }

    /// Stop the process group the child leads (started with `process_group(0)`) as
    /// [`stop_group`] does, collecting the child meanwhile: a leader that exited but was
    /// not collected stays in its group as a zombie and keeps the group alive. Returns true
    /// if the group is gone.
    pub(crate) fn stop_group(&mut self, grace: Duration) -> bool {
        let pgid = self.pid;
        stop_group_collecting(pgid, grace, &mut || {
            self.wait_timeout(Duration::ZERO);
        })
    }
}

/// Run `program` with `args` to its end, at most `timeout`, and return its exit and its
/// standard output (its standard error is discarded): for short helper programs such as
/// `nvidia-smi`. A program that is not installed exits 127. `None` when it cannot be
/// started or runs too long (it is then killed).
///
/// It runs in a process group of its own, killed when the program ends or runs too long:
/// a hanging `nvidia-smi` that started a child of its own leaves nothing behind.
///
/// It works with or without the node's reaper, as a [`Waited`] child. The program runs
/// under `sh`, which always starts, as [`spawn_waited`] requires.
pub fn capture(program: &str, args: &[&str], timeout: Duration) -> Option<(ChildExit, Vec<u8>)> {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"command -v "$0" >/dev/null || exit 127; exec "$0" "$@""#)
        .arg(program)
        .args(args);
    unblocked_signals(&mut cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0);
    let deadline = Instant::now() + timeout;
    let mut child = spawn_waited(&mut cmd).ok()?;
    let mut stdout = child.take_stdout()?;
    // Read while it runs (a full pipe would stop it); a descendant that keeps the pipe
    // open must not keep this caller waiting, hence the channel.
    let (out_tx, out_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut out);
        let _ = out_tx.send(out);
    });
    let exit = child.wait_timeout(deadline.saturating_duration_since(Instant::now()));
    // What it left running (all of it, when it runs too long), which may also hold the
    // pipe open; an empty group is done at once.
    child.stop_group(Duration::ZERO);
    let exit = exit?;
    let left = deadline.saturating_duration_since(Instant::now());
    let out = out_rx.recv_timeout(left.max(Duration::from_secs(1))).ok()?;
    Some((exit, out))
}

/// A running command.
#[derive(Debug, Clone)]
pub struct Running {
    pub pid: i32,
    pub started: Instant,
}

/// `log` opened for a command's output, with the `header` line and the command line
/// appended first.
fn command_log(command: &str, log: &Path, header: &str) -> io::Result<std::fs::File> {
    // Counted like every operation on the shared directory; the header in one write.
    let mut out = crate::store::fs::open_append(log)?;
    out.write_all(
        format!(
            "### rl-node {} {header}\n### $ {command}\n",
            crate::clock::wall_now()
        )
        .as_bytes(),
    )?;
    Ok(out.into_file())
}

/// Start `command` (under `sh -c` when it needs a shell: [`spawn`]) in a new process
/// group with output appended to `log`.
pub fn spawn_shell(
    command: &str,
    env: &[(String, String)],
    log: &Path,
    header: &str,
) -> io::Result<Running> {
    let out = command_log(command, log, header)?;
    let io = spawn::Io {
        out: std::os::fd::AsFd::as_fd(&out),
        worker: None,
    };
    let pid = spawn::start(command, env, io)?;
    // The reaper thread collects it.
    Ok(Running {
        pid,
        started: Instant::now(),
    })
}

/// The node's ends of an item worker's pipes: it writes items to `items` (the worker's
/// standard input) and reads replies from `replies` (the worker's descriptor 3).
pub struct WorkerPipes {
    pub items: std::fs::File,
    pub replies: std::fs::File,
}

/// A pipe whose two ends are close-on-exec descriptors above 9 (so that no dup2 onto
/// 0..3 in a starting command reads a descriptor an earlier one replaced).
fn high_pipe() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use rustix::io::fcntl_dupfd_cloexec;
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let high = |fd: std::os::fd::OwnedFd| -> io::Result<_> { Ok(fcntl_dupfd_cloexec(&fd, 10)?) };
    Ok((high(r)?, high(w)?))
}

/// Start `command` as [`spawn_shell`] does, as an item worker: standard input from a
/// pipe the node writes items to, and descriptor 3 a pipe it reads replies from
/// (`docs/work.md`, "Reused item processes").
pub fn spawn_worker(
    command: &str,
    env: &[(String, String)],
    log: &Path,
    header: &str,
) -> io::Result<(Running, WorkerPipes)> {
    let out = command_log(command, log, header)?;
    let (items_r, items_w) = high_pipe()?;
    let (replies_r, replies_w) = high_pipe()?;
    let io = spawn::Io {
        out: std::os::fd::AsFd::as_fd(&out),
        worker: Some((
            std::os::fd::AsFd::as_fd(&items_r),
            std::os::fd::AsFd::as_fd(&replies_w),
        )),
    };
    let pid = spawn::start(command, env, io)?;
    // The worker's ends close here: the node holds only its own, so the worker sees the
    // end of its items when the node drops `items`, and the node the end of the replies
    // when the worker (and whatever it started) is gone.
    Ok((
        Running {
            pid,
            started: Instant::now(),
        },
        WorkerPipes {
            items: items_w.into(),
            replies: replies_r.into(),
        },
    ))
}

/// `sh` as found on this process's PATH, looked up once: a program name is otherwise
/// searched for in the forked child before every command (an `execve` per PATH entry
/// that lacks it: about a millisecond per per-task item on a long PATH).
fn shell() -> &'static Path {
    static SHELL: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    SHELL.get_or_init(|| which("sh").unwrap_or_else(|| "sh".into()))
}

/// `name` as found on this process's PATH, like the shell would: the first executable
/// file of that name in one of its (absolute) directories. A relative PATH entry is
/// skipped: what it names depends on the directory a command later runs in.
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .filter(|d| d.is_absolute())
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

/// Whether `p` is a file with an execute bit set, as a shell's PATH search takes it.
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The last `n` lines of a log file, for failure messages.
/// Only the last 64 KiB are read, whatever the log's size.
pub fn tail(path: &Path, n: usize) -> String {
    let Ok(Some(text)) = crate::store::fs::read_tail(path, 64 * 1024) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with("### ")).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `rl-node __guard [NONCE]`: read `+pgid` / `-pgid` lines from stdin; on a `!` line (the
/// node's watchdog fired) stop the groups and the node's descendants at once; when stdin
/// closes (the node exited or was killed), stop every group still registered and every
/// process whose environment carries `RL_NODE_OWNER=<NONCE>:` (descendants that left their
/// group; after a `kill -9` they are no longer in the node's process tree).
pub fn guardian_main(nonce: Option<&str>) -> crate::exit::Ending {
    // SAFETY: signal() with SIG_IGN installs no handler code; the arguments are integers.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    let node = Pid::as_raw(rustix::process::getppid());
    let mut groups = BTreeSet::new();
    let stdin = io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        if line == "!" {
            stop_now(&groups, node);
            continue;
        }
        let (op, num) = line.split_at(1.min(line.len()));
        if let Ok(g) = num.trim().parse::<i32>() {
            match op {
                "+" => {
                    groups.insert(g);
                }
                "-" => {
                    groups.remove(&g);
                }
                _ => {}
            }
        }
    }
    let grace = Duration::from_secs(2);
    let live: Vec<i32> = groups.into_iter().filter(|g| group_alive(*g)).collect();
    for g in &live {
        signal_group(*g, Signal::TERM);
    }
    let deadline = Instant::now() + grace;
    // The groups' grace runs meanwhile.
    if let Some(nonce) = nonce.filter(|n| !n.is_empty()) {
        descendants::stop(|| descendants::with_nonce(nonce), grace);
    }
    while Instant::now() < deadline && live.iter().any(|g| group_alive(*g)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for g in &live {
        signal_group(*g, Signal::KILL);
    }
    crate::exit::Ending::Done
}

/// The node's watchdog fired: SIGTERM its groups and every descendant of the node but this
/// guardian, SIGKILL what is left half a second later (as the watchdog does). Reads only
/// `/proc/*/task/*/children` and `/proc/*/stat`, never a process's memory, so nothing here
/// waits on a process stuck in the filesystem. Environments are scanned for the nonce only
/// once the node is gone (end of input).
fn stop_now(groups: &BTreeSet<i32>, node: i32) {
    if Pid::as_raw(rustix::process::getppid()) != node {
        // The node is gone already; the end of input follows.
        return;
    }
    for g in groups {
        signal_group(*g, Signal::TERM);
        signal_group(*g, Signal::CONT);
    }
    let me = std::process::id() as i32;
    descendants::stop(
        || descendants::under(node, &[me]),
        Duration::from_millis(500),
    );
    for g in groups {
        signal_group(*g, Signal::KILL);
    }
}

/// `bytes` random bytes from the kernel (`getrandom`), as hex (a clock-and-pid mix if it
/// cannot give them): nonces naming a node's processes and records.
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if getrandom::fill(&mut buf).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        buf = (t ^ (std::process::id() as u128) << 64).to_le_bytes()[..bytes.min(16)].to_vec();
    }
    hex::encode(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_workers_reply_is_an_answer_for_an_item_or_said_to_be_garbled() {
        let done = |item: &str, exit| Reply::Done {
            item: item.into(),
            exit,
        };
        assert_eq!(
            Reply::parse(br#"{"item": "r1-00002"}"#),
            done("r1-00002", 0)
        );
        assert_eq!(
            Reply::parse(br#"{"exit": 75, "item": "p00003"}"#),
            done("p00003", 75)
        );
        for bad in [
            &b"done r1-00002"[..],
            br#"{"item": 3}"#,
            br#"{"item": "a", "exit": "75"}"#,
            br#"{"item": "a", "status": "ok"}"#,
            br#"["a"]"#,
        ] {
            match Reply::parse(bad) {
                Reply::Garbled(m) => assert!(m.contains("is not a reply"), "{m}"),
                other => panic!("{}: {other:?}", String::from_utf8_lossy(bad)),
            }
        }
    }

    fn sh(script: &str, timeout: Duration) -> Option<(ChildExit, Vec<u8>)> {
        capture("sh", &["-c", script], timeout)
    }

    /// Live processes (not zombies) whose command line contains `needle`.
    pub(super) fn alive_with(needle: &str) -> Vec<i32> {
        descendants::all_pids()
            .into_iter()
            .filter(|pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| descendants::stat_field(&s, 0).map(|f| f == "Z"))
                    .unwrap_or(true);
                !zombie
                    && String::from_utf8_lossy(&cmd)
                        .replace('\0', " ")
                        .contains(needle)
            })
            .collect()
    }

    /// The life of [`Waited`] children, with or without the reaper: one that exits, and
    /// one that leads a group and ignores SIGTERM (stopped: SIGKILL after the grace, and
    /// the leader collected meanwhile, else its zombie would keep the group alive).
    /// Returns their pids.
    fn waited_children() -> Vec<i32> {
        let mut quick = spawn_waited(Command::new("sh").args(["-c", "exit 4"])).unwrap();
        let four = Some(ChildExit::Exit(4));
        assert_eq!(quick.wait_timeout(Duration::from_secs(10)), four);
        assert_eq!(quick.wait_timeout(Duration::ZERO), four, "remembered");

        let mut group = spawn_waited(
            unblocked_signals(&mut Command::new("sh"))
                .args(["-c", "trap '' TERM; echo started; exec sleep 30"])
                .stdout(Stdio::piped())
                .process_group(0),
        )
        .unwrap();
        let mut line = String::new();
        io::BufReader::new(group.take_stdout().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "started\n");
        let started = Instant::now();
        assert_eq!(group.wait_timeout(Duration::from_millis(100)), None);
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(group.stop_group(Duration::from_millis(200)), "group gone");
        assert!(!group_alive(group.pid()));
        assert_eq!(
            group.wait_timeout(Duration::ZERO),
            Some(ChildExit::Signal(libc::SIGKILL))
        );
        vec![quick.pid(), group.pid()]
    }

    /// Each nextest test is a process of its own: this one has no reaper.
    #[test]
    fn waited_without_the_reaper_waits_for_its_child_itself() {
        waited_children();
    }

    /// With the node's reaper collecting every child, a [`Waited`] child's exit still
    /// reaches its starter, and never the node.
    #[test]
    fn waited_with_the_reaper_gets_its_childs_exit_and_the_node_does_not() {
        let (tx, rx) = channel();
        start_reaper(tx);
        let pids = waited_children();
        std::thread::sleep(Duration::from_millis(200));
        let heard: Vec<_> = rx.try_iter().collect();
        assert!(heard.is_empty(), "the node heard {heard:?} ({pids:?})");
        assert!(WAITERS.lock().unwrap().is_empty(), "no waiter left behind");
    }

    /// A program that runs too long is killed with its process group: a hanging
    /// `nvidia-smi` leaves no child of its own behind.
    #[test]
    fn capture_kills_the_group_of_a_program_that_runs_too_long() {
        let child = format!("sleep 300.{}1", std::process::id());
        let leader = format!("sleep 300.{}2", std::process::id());
        let started = Instant::now();
        assert!(sh(
            &format!("{child} & exec {leader}"),
            Duration::from_millis(300)
        )
        .is_none());
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(alive_with(&leader), Vec::<i32>::new());
        assert_eq!(alive_with(&child), Vec::<i32>::new());
    }

    /// Each nextest test is a process of its own: this one has no reaper.
    #[test]
    fn capture_without_the_reaper_waits_for_its_child() {
        let (exit, out) = sh("echo one; echo two; exit 3", Duration::from_secs(10)).expect("ran");
        assert_eq!(exit, ChildExit::Exit(3));
        assert_eq!(out, b"one\ntwo\n");
        let missing = capture("no-such-program-here", &[], Duration::from_secs(10));
        assert_eq!(missing, Some((ChildExit::Exit(127), vec![])));
    }

    /// With the node's reaper collecting every child, `capture` still gets its own
    /// child's exit, and the node hears nothing of it; a program that is not installed
    /// exits 127 (std would panic waiting for a child whose exec failed); a child that
    /// runs too long is killed.
    #[test]
    fn capture_with_the_reaper_gets_its_childs_exit_and_the_node_does_not() {
        let (tx, rx) = channel();
        start_reaper(tx);
        for _ in 0..20 {
            let (exit, out) = sh("printf gpu; exit 0", Duration::from_secs(10)).expect("ran");
            assert_eq!((exit, out.as_slice()), (ChildExit::Success, &b"gpu"[..]));
        }
        let missing = capture("no-such-program-here", &[], Duration::from_secs(10));
        assert_eq!(missing, Some((ChildExit::Exit(127), vec![])));
        let started = Instant::now();
        assert!(sh("exec sleep 30", Duration::from_millis(200)).is_none());
        assert!(started.elapsed() < Duration::from_secs(10));
        // A child the node starts itself still reaches the node (the reaper collects it).
        #[allow(clippy::zombie_processes)]
        let other = Command::new("true").spawn().unwrap();
        let pid = other.id() as i32;
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Event::Reaped { pid: p, exit }) => {
                assert_eq!((p, exit), (pid, ChildExit::Success));
            }
            other => panic!("{other:?}"),
        }
        assert!(WAITERS.lock().unwrap().is_empty(), "no waiter left behind");
    }
}
