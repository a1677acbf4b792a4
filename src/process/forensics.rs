//! What a node's processes are doing, for a hang report (docs/forensics.md).
//!
//! Finding the rank that hangs used to mean logging into every node and running `ps`,
//! `cat /proc/PID/stack` and `py-spy dump` by hand. A report collects the same, for every
//! descendant of the node process: pid, parent, command line, state, `wchan`, the kernel
//! stack (which shows a process in `D` state stuck on a hung filesystem) and the thread
//! count from `/proc`; `py-spy dump` of each Python process and `nvidia-smi`, where those
//! programs are on PATH.
//!
//! Nothing here may stall the node, so everything is bounded: the tree is walked without
//! reading any process's memory ([`super::descendants::under`]); the reads that can block
//! (a command line needs the process's memory lock, held by a process stuck in a page
//! fault) run on a thread of their own that the caller gives up on after a limit, keeping
//! what it had; each tool runs in a process group of its own that is killed at its time
//! limit. A missing tool is a line of the report, not an error. The caller runs all of this
//! off the node's loop and writes the text afterwards (the write may hang on the shared
//! directory itself; the collection never waits for it).
//!
//! A tool that hangs must not outlive the node, nor hold up its stop: while it runs, its
//! group is registered with the node's [`Registry`] (so the signal thread, the watchdog
//! and, after a `kill -9`, the guardian kill it with the commands), and when the node
//! stops ([`Tools::stop`]) every tool still running is killed at once and none starts, so
//! the report goes out with what was gathered, saying which tool was cut off.

use super::descendants::{self, stat_field};
use super::{spawn_waited, stop_group, unblocked_signals, which, ChildExit, Registry, Waited};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long `py-spy dump` and `nvidia-smi` may run before they are killed.
pub const TOOL_LIMIT: Duration = Duration::from_secs(5);

/// How long a tool being killed gets between SIGTERM and SIGKILL, as commands get
/// `kill-grace`: a moment to end cleanly (py-spy, to let go of the process it reads).
const TOOL_GRACE: Duration = Duration::from_millis(300);

/// How often a wait for a tool or for `/proc` looks whether the node is stopping.
const TICK: Duration = Duration::from_millis(50);

/// How long reading `/proc` for every descendant may take before the report goes out with
/// what was read so far.
pub const PROC_LIMIT: Duration = Duration::from_secs(5);

/// At most this many Python processes get a `py-spy dump` (each takes up to
/// [`TOOL_LIMIT`], all at once): a node running hundreds of them gets the first ones.
pub const MAX_PY_SPY: usize = 16;

/// At most this many bytes of one tool's output go into a report.
const MAX_TOOL_OUTPUT: usize = 256 * 1024;

/// Where a node's hang reports run their tools: the registry their process groups join
/// while they run (none outside a node), the groups running, and whether the node is
/// stopping.
#[derive(Clone, Default)]
pub(crate) struct Tools {
    registry: Option<Arc<Registry>>,
    running: Arc<Mutex<BTreeSet<i32>>>,
    stopping: Arc<AtomicBool>,
}

impl Tools {
    pub(crate) fn new(registry: Option<Arc<Registry>>) -> Tools {
        Tools {
            registry,
            ..Tools::default()
        }
    }

    /// The node is stopping: kill every tool running, its whole group (SIGTERM,
    /// [`TOOL_GRACE`], SIGKILL), and return once they are gone; from now on none starts
    /// and reading `/proc` gives up, so that the reports being collected go out with what
    /// they have.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let groups: Vec<i32> = self.running.lock().unwrap().iter().copied().collect();
        std::thread::scope(|s| {
            for g in groups {
                s.spawn(move || stop_group(g, TOOL_GRACE));
            }
        });
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
}

/// One process as `/proc` shows it. Every field says why when it could not be read.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcInfo {
    pub pid: i32,
    pub ppid: Option<i32>,
    /// The name the kernel keeps (`comm`, at most 15 bytes).
    pub name: String,
    /// Arguments joined by spaces; `[name]` when it has none (a zombie).
    pub cmdline: String,
    /// `S (sleeping)`, `D (disk sleep)`… as `status` says it.
    pub state: String,
    pub wchan: String,
    /// The kernel stack, or `unreadable: <why>`.
    pub stack: Result<String, String>,
    pub threads: Option<u32>,
}

impl ProcInfo {
    /// Whether to ask `py-spy` about it: its program is a Python interpreter.
    pub fn is_python(&self) -> bool {
        let argv0 = self.cmdline.split(' ').next().unwrap_or("");
        let base = argv0.rsplit('/').next().unwrap_or("");
        self.name.starts_with("python") || base.starts_with("python")
    }
}

/// The name between the parentheses of a `/proc/<pid>/stat` line.
fn stat_name(stat: &str) -> Option<&str> {
    let start = stat.find('(')? + 1;
    let end = stat.rfind(')')?;
    stat.get(start..end)
}

/// A `Key:\tvalue` line of `/proc/<pid>/status`.
fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':').map(str::trim))
}

fn why(e: &std::io::Error) -> String {
    format!("unreadable: {e}")
}

/// Read what `/proc` says about `pid` (may block on a process stuck holding its memory
/// lock: see the module's documentation).
pub fn look(pid: i32) -> ProcInfo {
    let dir = PathBuf::from(format!("/proc/{pid}"));
    let stat = std::fs::read_to_string(dir.join("stat"));
    let status = std::fs::read_to_string(dir.join("status"));
    let name = stat
        .as_deref()
        .ok()
        .and_then(stat_name)
        .unwrap_or("?")
        .to_string();
    let ppid = stat
        .as_deref()
        .ok()
        .and_then(|s| stat_field(s, 1)?.parse().ok());
    let from_status = status
        .as_deref()
        .ok()
        .and_then(|s| status_field(s, "State"));
    let state = match (from_status, &stat) {
        (Some(s), _) => s.to_string(),
        (None, Ok(s)) => stat_field(s, 0).unwrap_or("?").to_string(),
        (None, Err(e)) => why(e),
    };
    let threads = status
        .as_deref()
        .ok()
        .and_then(|s| status_field(s, "Threads")?.parse().ok());
    let wchan = match std::fs::read_to_string(dir.join("wchan")) {
        // "0": running, or a kernel that hides addresses.
        Ok(w) if w.trim().is_empty() || w.trim() == "0" => {
            "0 (running, or hidden by the kernel)".into()
        }
        Ok(w) => w.trim().to_string(),
        Err(e) => why(&e),
    };
    let stack = std::fs::read_to_string(dir.join("stack"))
        .map(|s| s.trim_end().to_string())
        .map_err(|e| why(&e));
    let cmdline = match std::fs::read(dir.join("cmdline")) {
        Ok(raw) if !raw.is_empty() => raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect::<Vec<_>>()
            .join(" "),
        Ok(_) => format!("[{name}]"),
        Err(e) => why(&e),
    };
    ProcInfo {
        pid,
        ppid,
        name,
        cmdline,
        state,
        wchan,
        stack,
        threads,
    }
}

/// How many `/proc` readers of earlier reports passed their time limit and are still
/// blocked (a process stuck in the kernel holding its memory lock can keep one blocked
/// for good). While one is, a new report skips `/proc` instead of leaving one more thread
/// behind at each report. A count, not a flag: two reports can get stuck at once, and
/// the first to come free must not clear the other's mark.
static STUCK_READERS: AtomicUsize = AtomicUsize::new(0);

/// What [`read_bounded`]'s thread sends: the number of processes, then each one.
type Read = Result<ProcInfo, usize>;

/// Every descendant of process `root` except `spare` (and theirs), as `/proc` shows them,
/// parents before children; at most `limit` is spent reading, less if the node stops. The
/// second value says what was left out when the limit passed (or why nothing was read).
pub(crate) fn snapshot(
    root: i32,
    spare: &[i32],
    limit: Duration,
    tools: &Tools,
) -> (Vec<ProcInfo>, Option<String>) {
    let spare = spare.to_vec();
    read_bounded(limit, tools, move |tx| {
        let pids: Vec<i32> = descendants::under(root, &spare)
            .iter()
            .map(|p| p.pid)
            .collect();
        let _ = tx.send(Err(pids.len()));
        for pid in pids {
            if tx.send(Ok(look(pid))).is_err() {
                return;
            }
        }
    })
}

/// Run `read` on a thread of its own and keep what it sends within `limit` (or until the
/// node stops). A thread still running then is left behind and counted in
/// [`STUCK_READERS`] until it ends; while any is, `read` is not started at all.
fn read_bounded(
    limit: Duration,
    tools: &Tools,
    read: impl FnOnce(&mpsc::Sender<Read>) + Send + 'static,
) -> (Vec<ProcInfo>, Option<String>) {
    if STUCK_READERS.load(Ordering::SeqCst) > 0 {
        return (
            vec![],
            Some("/proc not read: the reader of an earlier report is still blocked (a process may be stuck in the kernel holding its memory lock)".into()),
        );
    }
    // Who leaves last counts the stuck reader down: the thread when it ends after the
    // caller gave up on it, or the caller when the thread ended in between.
    const RUNNING: u8 = 0;
    const DONE: u8 = 1;
    const ABANDONED: u8 = 2;
    let state = Arc::new(AtomicU8::new(RUNNING));
    struct Ends(Arc<AtomicU8>);
    impl Drop for Ends {
        fn drop(&mut self) {
            if self.0.swap(DONE, Ordering::SeqCst) == ABANDONED {
                STUCK_READERS.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    let deadline = Instant::now() + limit;
    let (tx, rx) = mpsc::channel();
    let ends = Ends(state.clone());
    let spawned = std::thread::Builder::new()
        .name("hang-proc".into())
        .spawn(move || {
            let _ends = ends;
            read(&tx);
        });
    if let Err(e) = spawned {
        return (
            vec![],
            Some(format!("cannot start a thread to read /proc: {e}")),
        );
    }
    let mut out = Vec::new();
    let mut total = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let stopping = tools.stopping();
        let got = match (left.is_zero(), stopping) {
            (false, false) => rx.recv_timeout(left.min(TICK)),
            _ => rx.try_recv().map_err(|e| match e {
                mpsc::TryRecvError::Empty => mpsc::RecvTimeoutError::Timeout,
                mpsc::TryRecvError::Disconnected => mpsc::RecvTimeoutError::Disconnected,
            }),
        };
        match got {
            Ok(Err(n)) => total = Some(n),
            Ok(Ok(p)) => out.push(p),
            // The thread is done: everything was read.
            Err(mpsc::RecvTimeoutError::Disconnected) => return (out, None),
            Err(mpsc::RecvTimeoutError::Timeout) if !left.is_zero() && !stopping => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {
                STUCK_READERS.fetch_add(1, Ordering::SeqCst);
                if state.swap(ABANDONED, Ordering::SeqCst) == DONE {
                    STUCK_READERS.fetch_sub(1, Ordering::SeqCst);
                }
                let missing = match total {
                    Some(n) => format!("{} of {n} processes", n - out.len()),
                    None => "the list of processes".into(),
                };
                let why = match stopping {
                    true => format!("the node stopped while /proc was read ({missing} not read)"),
                    false => format!(
                        "reading /proc did not finish within {}s ({missing} not read: a process may be stuck in the kernel holding its memory lock)",
                        limit.as_secs_f64()
                    ),
                };
                return (out, Some(why));
            }
        }
    }
}

/// How a tool run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolRun {
    /// It ended by itself: its exit and its output (stdout and stderr together).
    Ended(ChildExit, String),
    /// It was killed (its process group) before it ended, with what it wrote until then.
    Killed(Cut, String),
    /// It was not started: the node was stopping.
    NotStarted,
    /// It could not be started.
    CannotStart(String),
}

/// Why a tool was killed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cut {
    /// It passed its time limit.
    TimeLimit(Duration),
    /// The node stopped ([`Tools::stop`]).
    NodeStopping,
}

/// A tool's process group while it runs: registered with the node's registry, and killed
/// (what is left of it) when dropped, however the run ends, a panic included.
struct ToolGroup<'t> {
    child: Waited,
    tools: &'t Tools,
}

impl ToolGroup<'_> {
    fn start<'a>(cmd: &mut Command, tools: &'a Tools) -> std::io::Result<ToolGroup<'a>> {
        // Its descendants carry the node's mark, so that one that leaves the group is
        // still found, and its group is known to the guardian.
        if let Some(r) = &tools.registry {
            let (_, (key, mark)) = r.new_command();
            cmd.env(key, mark);
        }
        let child = spawn_waited(cmd)?;
        if let Some(r) = &tools.registry {
            r.add_tool(child.pid());
        }
        tools.running.lock().unwrap().insert(child.pid());
        Ok(ToolGroup { child, tools })
    }
}

impl Drop for ToolGroup<'_> {
    fn drop(&mut self) {
        let pgid = self.child.pid();
        // Also after its leader ended: what it left running may hold the output pipe (an
        // empty group is done at once).
        self.child.stop_group(TOOL_GRACE);
        self.tools.running.lock().unwrap().remove(&pgid);
        if let Some(r) = &self.tools.registry {
            r.remove_tool(pgid);
        }
    }
}

/// Run `program args…` with stdout and stderr together, in a process group of its own
/// that is killed at `limit` or when the node stops (`tools`). Works with or without the
/// node's reaper.
pub(crate) fn run_tool(program: &Path, args: &[&str], limit: Duration, tools: &Tools) -> ToolRun {
    if tools.stopping() {
        return ToolRun::NotStarted;
    }
    let mut cmd = Command::new("sh");
    // Under `sh`, which always starts (as `spawn_waited` requires); `exec` keeps one
    // process, and `2>&1` puts its complaints next to its output.
    cmd.arg("-c")
        .arg(r#"exec "$0" "$@" 2>&1"#)
        .arg(program)
        .args(args);
    use std::os::unix::process::CommandExt;
    unblocked_signals(&mut cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0);
    let deadline = Instant::now() + limit;
    let mut group = match ToolGroup::start(&mut cmd, tools) {
        Ok(g) => g,
        Err(e) => return ToolRun::CannotStart(e.to_string()),
    };
    let Some(mut stdout) = group.child.take_stdout() else {
        return ToolRun::CannotStart("no pipe for its output".into());
    };
    // Read while it runs (a full pipe would stop it); a descendant that keeps the pipe
    // open must not keep the caller waiting, hence the channel.
    let (out_tx, out_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = std::io::Read::read_to_end(
            &mut std::io::Read::take(&mut stdout, MAX_TOOL_OUTPUT as u64),
            &mut out,
        );
        let _ = out_tx.send(out);
    });
    let ended = loop {
        if tools.stopping() {
            break Err(Cut::NodeStopping);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(Cut::TimeLimit(limit));
        }
        if let Some(exit) = group.child.wait_timeout(left.min(TICK)) {
            // Killed by the node's own stop of its descendants, which may come first.
            if tools.stopping() && matches!(exit, ChildExit::Signal(_)) {
                break Err(Cut::NodeStopping);
            }
            break Ok(exit);
        }
    };
    // What is left of its group goes now, and with it the pipe's last writers.
    drop(group);
    let left = deadline.saturating_duration_since(Instant::now());
    let out = out_rx
        .recv_timeout(left.max(Duration::from_millis(500)))
        .unwrap_or_default();
    let out = String::from_utf8_lossy(&out).into_owned();
    match ended {
        Ok(exit) => ToolRun::Ended(exit, out),
        Err(cut) => ToolRun::Killed(cut, out),
    }
}

/// The report's section for one tool run, headed by the command line.
fn tool_section(out: &mut String, shown: &str, run: &ToolRun) {
    let _ = writeln!(out, "$ {shown}");
    match run {
        ToolRun::Ended(exit, text) => {
            out.push_str(text.trim_end());
            out.push('\n');
            if *exit != ChildExit::Success {
                let _ = writeln!(out, "({shown} ended with {exit})");
            }
        }
        ToolRun::Killed(cut, text) => {
            if !text.trim().is_empty() {
                out.push_str(text.trim_end());
                out.push('\n');
            }
            let why = match cut {
                Cut::TimeLimit(limit) => {
                    format!(
                        "no answer within its time limit of {}s",
                        limit.as_secs_f64()
                    )
                }
                Cut::NodeStopping => "no answer before the node stopped".into(),
            };
            let _ = writeln!(out, "({shown}: {why}; killed)");
        }
        ToolRun::NotStarted => {
            let _ = writeln!(out, "({shown}: not run: the node is stopping)");
        }
        ToolRun::CannotStart(e) => {
            let _ = writeln!(out, "({shown}: cannot start: {e})");
        }
    }
}

/// What a hang report says after its header, and the one line for the node's log.
pub struct Collected {
    pub text: String,
    /// See [`summary`].
    pub summary: String,
}

/// Everything a hang report says after its header: each descendant of `root` (except
/// `spare`) from `/proc`, `py-spy dump` of the Python ones and `nvidia-smi`, the tools run
/// as `tools` says.
pub(crate) fn collect(root: i32, spare: &[i32], tools: &Tools) -> Collected {
    let (procs, unfinished) = snapshot(root, spare, PROC_LIMIT, tools);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## processes under the node process {root}: {}",
        procs.len()
    );
    if let Some(u) = &unfinished {
        let _ = writeln!(out, "({u})");
    }
    for p in &procs {
        out.push('\n');
        let ppid = p.ppid.map_or("?".to_string(), |p| p.to_string());
        let _ = writeln!(out, "### pid {} (ppid {ppid}): {}", p.pid, p.cmdline);
        let _ = writeln!(out, "state: {}", p.state);
        let threads = p.threads.map_or("?".to_string(), |t| t.to_string());
        let _ = writeln!(out, "threads: {threads}");
        let _ = writeln!(out, "wchan: {}", p.wchan);
        match &p.stack {
            Ok(s) if s.is_empty() => out.push_str("kernel stack: (empty)\n"),
            Ok(s) => {
                out.push_str("kernel stack:\n");
                for l in s.lines() {
                    let _ = writeln!(out, "  {l}");
                }
            }
            Err(e) => {
                let _ = writeln!(out, "kernel stack: {e}");
            }
        }
    }

    out.push_str("\n## py-spy\n");
    let python: Vec<&ProcInfo> = procs.iter().filter(|p| p.is_python()).collect();
    match which("py-spy") {
        _ if python.is_empty() => out.push_str("(no Python process)\n"),
        None => out.push_str("py-spy: not installed (not on PATH)\n"),
        Some(py_spy) => {
            let shown = python.len().min(MAX_PY_SPY);
            if python.len() > shown {
                let _ = writeln!(
                    out,
                    "({} Python processes; the first {shown} are dumped)",
                    python.len()
                );
            }
            // All at once: N stuck dumps cost one time limit, not N.
            let runs: Vec<(i32, ToolRun)> = std::thread::scope(|s| {
                let handles: Vec<_> = python[..shown]
                    .iter()
                    .map(|p| {
                        let (pid, py_spy) = (p.pid, &py_spy);
                        s.spawn(move || {
                            let pid_arg = pid.to_string();
                            (
                                pid,
                                run_tool(py_spy, &["dump", "--pid", &pid_arg], TOOL_LIMIT, tools),
                            )
                        })
                    })
                    .collect();
                handles.into_iter().filter_map(|h| h.join().ok()).collect()
            });
            for (pid, run) in runs {
                tool_section(&mut out, &format!("py-spy dump --pid {pid}"), &run);
            }
        }
    }

    out.push_str("\n## nvidia-smi\n");
    match which("nvidia-smi") {
        None => out.push_str("nvidia-smi: not installed (not on PATH)\n"),
        Some(smi) => tool_section(
            &mut out,
            "nvidia-smi",
            &run_tool(&smi, &[], TOOL_LIMIT, tools),
        ),
    }
    Collected {
        text: out,
        summary: summary(&procs),
    }
}

/// One line naming each process and what it waits on, for the node's own log (which may
/// be readable when the report's write hangs on the shared directory).
pub fn summary(procs: &[ProcInfo]) -> String {
    if procs.is_empty() {
        return "no processes".into();
    }
    procs
        .iter()
        .map(|p| {
            let state = p.state.split(' ').next().unwrap_or("?");
            let cmd: String = p.cmdline.chars().take(40).collect();
            format!("{} {state} {cmd}", p.pid)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::super::tests::alive_with;
    use super::*;

    #[test]
    fn stat_and_status_fields_are_read_as_the_kernel_writes_them() {
        let stat = "42 (py (x) thon) S 7 42 42 0 -1";
        assert_eq!(stat_name(stat), Some("py (x) thon"));
        assert_eq!(stat_field(stat, 0), Some("S"));
        assert_eq!(stat_field(stat, 1), Some("7"));
        let status = "Name:\tsleep\nState:\tD (disk sleep)\nThreads:\t3\n";
        assert_eq!(status_field(status, "State"), Some("D (disk sleep)"));
        assert_eq!(status_field(status, "Threads"), Some("3"));
        assert_eq!(status_field(status, "Thread"), None);
    }

    #[test]
    fn python_is_recognised_by_its_name_or_its_program() {
        let p = |name: &str, cmdline: &str| ProcInfo {
            pid: 1,
            ppid: None,
            name: name.into(),
            cmdline: cmdline.into(),
            state: "S".into(),
            wchan: "0".into(),
            stack: Ok(String::new()),
            threads: Some(1),
        };
        assert!(p("python3", "python3 -c x").is_python());
        assert!(p("pt_main_thread", "/usr/bin/python3.11 train.py").is_python());
        assert!(!p("sh", "sh -c python3 x.py").is_python());
        assert!(!p("sleep", "sleep 1000").is_python());
    }

    #[test]
    fn a_tool_that_hangs_is_killed_at_its_limit_with_its_group_and_one_that_ends_is_read() {
        let sh = which("sh").expect("sh on PATH");
        let tools = Tools::default();
        let started = Instant::now();
        let run = run_tool(
            &sh,
            &["-c", "echo out; echo err >&2; exit 3"],
            TOOL_LIMIT,
            &tools,
        );
        match run {
            ToolRun::Ended(exit, text) => {
                assert_eq!(exit, ChildExit::Exit(3));
                assert!(text.contains("out") && text.contains("err"), "{text}");
            }
            other => panic!("{other:?}"),
        }
        let limit = Duration::from_millis(300);
        let (child, leader) = hanging("a");
        let script = format!("echo before; {child} & exec {leader}");
        let run = run_tool(&sh, &["-c", &script], limit, &tools);
        // What it wrote before it was killed is kept.
        assert_eq!(
            run,
            ToolRun::Killed(Cut::TimeLimit(limit), "before\n".into())
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(alive_with(&leader), Vec::<i32>::new());
        assert_eq!(alive_with(&child), Vec::<i32>::new(), "its child too");
        let mut text = String::new();
        tool_section(&mut text, "x", &run);
        assert_eq!(
            text,
            "$ x\nbefore\n(x: no answer within its time limit of 0.3s; killed)\n"
        );
    }

    /// Two `sleep` command lines unique to this test process and `tag`: a tool's child
    /// and its leader.
    fn hanging(tag: &str) -> (String, String) {
        let id = std::process::id();
        let n = match tag {
            "a" => 1,
            _ => 2,
        };
        (format!("sleep 200.{id}{n}1"), format!("sleep 200.{id}{n}2"))
    }

    /// When the node stops, a tool running is killed at once with its group, long before
    /// its time limit, and no tool starts after.
    #[test]
    fn a_tool_running_when_the_node_stops_is_killed_and_none_starts_after() {
        let sh = which("sh").expect("sh on PATH");
        let tools = Tools::default();
        let (child, leader) = hanging("b");
        let script = format!("echo started; {child} & exec {leader}");
        let started = Instant::now();
        let run = std::thread::scope(|s| {
            let running = s.spawn(|| run_tool(&sh, &["-c", &script], TOOL_LIMIT * 10, &tools));
            let deadline = Instant::now() + Duration::from_secs(30);
            while alive_with(&leader).is_empty() || alive_with(&child).is_empty() {
                assert!(Instant::now() < deadline, "the tool never started");
                std::thread::sleep(Duration::from_millis(10));
            }
            tools.stop();
            running.join().unwrap()
        });
        assert_eq!(run, ToolRun::Killed(Cut::NodeStopping, "started\n".into()));
        assert!(started.elapsed() < TOOL_LIMIT, "{:?}", started.elapsed());
        assert_eq!(alive_with(&leader), Vec::<i32>::new());
        assert_eq!(alive_with(&child), Vec::<i32>::new(), "its child too");
        let mut text = String::new();
        tool_section(&mut text, "x", &run);
        assert_eq!(
            text,
            "$ x\nstarted\n(x: no answer before the node stopped; killed)\n"
        );
        assert_eq!(
            run_tool(&sh, &["-c", "echo never"], TOOL_LIMIT, &tools),
            ToolRun::NotStarted
        );
    }

    #[test]
    fn the_summary_names_each_process_with_its_state() {
        let proc = |pid, cmdline: &str, state: &str| ProcInfo {
            pid,
            ppid: Some(1),
            name: "x".into(),
            cmdline: cmdline.into(),
            state: state.into(),
            wchan: "x".into(),
            stack: Ok(String::new()),
            threads: Some(1),
        };
        let procs = [
            proc(7, "sleep 1000", "S (sleeping)"),
            proc(8, "cat", "D (disk sleep)"),
        ];
        assert_eq!(summary(&procs), "7 S sleep 1000; 8 D cat");
        assert_eq!(summary(&[]), "no processes");
        // The command line is cut at 40 characters.
        let long = proc(9, &"a".repeat(50), "R (running)");
        assert_eq!(summary(&[long]), format!("9 R {}", "a".repeat(40)));
    }

    #[test]
    fn a_proc_reader_stuck_past_its_limit_makes_later_reports_skip_proc_until_it_ends() {
        let limit = Duration::from_millis(100);
        let (unblock, blocked) = mpsc::channel::<()>();
        // A reader that blocks, as one on a process stuck in the kernel would.
        let tools = Tools::default();
        let (procs, why) = read_bounded(limit, &tools, move |tx| {
            let _ = tx.send(Err(1));
            let _ = blocked.recv();
        });
        assert!(procs.is_empty());
        let why = why.expect("the limit passed");
        assert!(why.contains("1 of 1 processes not read"), "{why}");
        // While it is blocked, the next report does not start another reader.
        let started = Arc::new(AtomicUsize::new(0));
        let s = started.clone();
        let (_, why) = read_bounded(limit, &tools, move |_| {
            s.fetch_add(1, Ordering::SeqCst);
        });
        assert!(why.expect("skipped").contains("still blocked"));
        assert_eq!(started.load(Ordering::SeqCst), 0);
        // Once it ends, reports read /proc again.
        unblock.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while STUCK_READERS.load(Ordering::SeqCst) > 0 {
            assert!(
                Instant::now() < deadline,
                "the stuck reader was never counted down"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let s = started.clone();
        let (procs, why) = read_bounded(limit, &tools, move |tx| {
            s.fetch_add(1, Ordering::SeqCst);
            let _ = tx.send(Err(0));
        });
        assert_eq!((procs, why), (vec![], None));
        assert_eq!(started.load(Ordering::SeqCst), 1);
    }
}
