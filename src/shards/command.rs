//! The `command` format: a user merge command (`[aggregate] command`) merges the shard
//! files rl-node found, for formats rl-node cannot read itself (pickles of Python objects,
//! as the old run.sh wrote).
//!
//! rl-node still decides which shards exist, which are partial and which are missing,
//! refuses gaps without `--allow-missing`, hashes every input for the manifest, and
//! publishes the output atomically: the command writes `{output}`, a temporary name in
//! the output's directory, which rl-node renames only after the command exited 0. The
//! command may tell rl-node what it merged by writing a small JSON report to `{report}`
//! (`$RL_NODE_REPORT`): `{"records": {"<input path>": N, …}, "unreadable": {"<input
//! path>": "why", …}}`; an input reported unreadable is treated as an unreadable shard of
//! any format (refused without `--allow-missing`, else dropped and listed).
//!
//! The command runs as `sh -c` in its own process group, with stdin closed, like phase
//! commands. Its exit status comes back through a pipe rather than `waitpid`, because in
//! a node process another thread reaps every child.

use crate::process::{self as procs, Registry};
use crate::template::{braced_list, shell_word, Braces, Dialect, Template};
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Placeholders of `[aggregate] command`, with the variable that carries the same value.
pub const PLACEHOLDERS: &[(&str, &str, &str)] = &[
    (
        "inputs",
        "RL_NODE_INPUTS",
        "the shard files to merge, in rank order: space-separated and shell-quoted (the variable: one per line)",
    ),
    (
        "output",
        "RL_NODE_OUTPUT",
        "the file to write: a temporary name beside the merged file, renamed by rl-node after exit 0",
    ),
    (
        "report",
        "RL_NODE_REPORT",
        "where the command may write its JSON report (records per input, unreadable inputs)",
    ),
    ("iteration", "RL_NODE_ITERATION", "the iteration, from 1"),
    ("split", "RL_NODE_SPLIT", "`train` or `eval`"),
    ("num_ranks", "RL_NODE_NUM_RANKS", "the number of ranks"),
    (
        "input_ranks",
        "RL_NODE_INPUT_RANKS",
        "the ranks of the inputs, comma-separated (`0,2`)",
    ),
    ("log_path", "RL_NODE_LOG_PATH", "the shared directory"),
];

/// `[aggregate] command`: shell text with [`PLACEHOLDERS`], read by the crate's one
/// template reader ([`crate::template`], shell braces, as phase commands are).
struct MergeCommand;

impl Dialect for MergeCommand {
    type Var = &'static str;
    type Error = String;
    const BRACES: Braces = Braces::Shell;

    fn var(&self, name: &str) -> Result<&'static str, String> {
        PLACEHOLDERS
            .iter()
            .map(|(n, _, _)| *n)
            .find(|n| *n == name)
            .ok_or_else(|| {
                format!(
                    "unknown placeholder `{{{name}}}`; known: {}",
                    braced_list(PLACEHOLDERS.iter().map(|(n, _, _)| *n))
                )
            })
    }
}

fn parse(text: &str) -> Result<Template<&'static str>, String> {
    Template::parse(text, &MergeCommand)
}

/// Check a merge command template (for configuration validation).
pub fn check(template: &str) -> Result<(), String> {
    let template = parse(template)?;
    if !template.vars().any(|v| *v == "output") {
        return Err(
            "the merge command must write {output} (the temporary file rl-node publishes)".into(),
        );
    }
    Ok(())
}

/// One run of the merge command.
pub struct Job {
    pub template: String,
    /// Files to merge in rank order, and their ranks.
    pub inputs: Vec<PathBuf>,
    pub input_ranks: Vec<u32>,
    pub output: PathBuf,
    pub report: PathBuf,
    pub iteration: u64,
    pub split: String,
    pub num_ranks: u32,
    pub log_path: PathBuf,
    pub timeout: Duration,
    pub kill_grace: Duration,
    /// Append the command's output here; `None`: to rl-node's stderr.
    pub log: Option<PathBuf>,
    /// In a node: register the command's process group so no kill leaves it behind.
    pub registry: Option<Arc<Registry>>,
    /// `[env]`: set before the command's own variables.
    pub env: Vec<(String, String)>,
}

impl Job {
    fn values(&self) -> BTreeMap<&'static str, (String, String)> {
        let show = |p: &Path| p.display().to_string();
        let mut v = BTreeMap::new();
        v.insert(
            "inputs",
            (
                self.inputs
                    .iter()
                    .map(|p| shell_word(&show(p)))
                    .collect::<Vec<_>>()
                    .join(" "),
                self.inputs
                    .iter()
                    .map(|p| show(p))
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
        );
        let plain = |s: String| (shell_word(&s), s);
        v.insert("output", plain(show(&self.output)));
        v.insert("report", plain(show(&self.report)));
        v.insert("iteration", plain(self.iteration.to_string()));
        v.insert("split", plain(self.split.clone()));
        v.insert("num_ranks", plain(self.num_ranks.to_string()));
        let ranks = self
            .input_ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",");
        v.insert(
            "input_ranks",
            (
                if ranks.is_empty() {
                    "''".into()
                } else {
                    ranks.clone()
                },
                ranks,
            ),
        );
        v.insert("log_path", plain(show(&self.log_path)));
        v
    }

    /// The command line, placeholders substituted.
    pub fn render(&self) -> Result<String, String> {
        let template = parse(&self.template)?;
        let values = self.values();
        Ok(template.render(|name, out| out.push_str(&values[name].0)))
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        let values = self.values();
        let mut env: Vec<(&'static str, String)> = PLACEHOLDERS
            .iter()
            .map(|(name, var, _)| (*var, values[name].1.clone()))
            .collect();
        env.push(("RL_NODE_PHASE", "aggregate".into()));
        env
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("invalid merge command: {0}")]
    Template(String),
    #[error("cannot start the merge command: {0}")]
    Spawn(io::Error),
    #[error("the merge command failed with {exit}{}", log_note(.log))]
    Failed {
        exit: String,
        log: Option<PathBuf>,
        tail: String,
    },
    #[error("the merge command did not finish within its timeout of {} (aggregate.timeout); it was stopped{}", humantime::format_duration(*.timeout), log_note(.log))]
    TimedOut {
        timeout: Duration,
        log: Option<PathBuf>,
        tail: String,
    },
    #[error("the merge command exited 0 but wrote no {}: it must write its merged file to {{output}}", .path.display())]
    NoOutput { path: PathBuf },
    #[error("the merge command's report {} is not valid ({reason}); expected {{\"records\": {{\"<input>\": N}}, \"unreadable\": {{\"<input>\": \"why\"}}}}", .path.display())]
    BadReport { path: PathBuf, reason: String },
}

fn log_note(log: &Option<PathBuf>) -> String {
    match log {
        Some(p) => format!(" (log: {})", p.display()),
        None => String::new(),
    }
}

impl CommandError {
    /// The last lines of the command's log, when it has one.
    pub fn tail(&self) -> &str {
        match self {
            CommandError::Failed { tail, .. } | CommandError::TimedOut { tail, .. } => tail,
            _ => "",
        }
    }
}

/// What the command said about one input (absent: nothing).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InputReport {
    pub records: Option<u64>,
    pub unreadable: Option<String>,
}

/// Run the merge command, calling `tick` while it runs. On success the output exists as
/// a regular file; returns the report for each input (in the order of `job.inputs`).
pub fn run(job: &Job, tick: &mut dyn FnMut()) -> Result<Vec<InputReport>, CommandError> {
    let rendered = job.render().map_err(CommandError::Template)?;
    let (stdout, stderr) = match &job.log {
        Some(log) => {
            if let Some(dir) = log.parent() {
                std::fs::create_dir_all(dir).map_err(CommandError::Spawn)?;
            }
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(CommandError::Spawn)?;
            writeln!(
                f,
                "### rl-node {} merge command (iteration {}, {})\n### $ {rendered}",
                chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ"),
                job.iteration,
                job.split
            )
            .map_err(CommandError::Spawn)?;
            let e = f.try_clone().map_err(CommandError::Spawn)?;
            (Stdio::from(f), Stdio::from(e))
        }
        None => {
            // stdout too goes to stderr: rl-node's own stdout may carry --json output.
            let err = io::stderr().as_raw_fd();
            let dup = |fd| -> io::Result<Stdio> {
                // SAFETY: fcntl(F_DUPFD_CLOEXEC) takes integers only and returns a new fd
                // or -1.
                let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
                if d < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: `d` was just returned by fcntl, so it is open and owned by
                // nothing else.
                Ok(Stdio::from(unsafe { OwnedFd::from_raw_fd(d) }))
            };
            (
                dup(err).map_err(CommandError::Spawn)?,
                dup(err).map_err(CommandError::Spawn)?,
            )
        }
    };

    // The exit status of the command comes back as text through fd 3 of the wrapper.
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two fds into `fds`, an array of exactly two c_ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(CommandError::Spawn(io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded, so both fds are new and open, and each is wrapped (owned)
    // once.
    let (rfd, wfd) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let w = wfd.as_raw_fd();
    // In a node, the command's mark for finding descendants that leave its group.
    let owner = job.registry.as_ref().map(|r| r.new_command());
    let mut cmd = Command::new("sh");
    crate::process::unblocked_signals(&mut cmd);
    cmd.envs(owner.iter().map(|(_, (k, v))| (k, v)));
    cmd.arg("-c")
        .arg(r#"sh -c "$1" 3>&-; echo "$?" >&3"#)
        .arg("rl-node-merge")
        .arg(&rendered)
        .envs(job.env.iter().map(|(k, v)| (k, v)))
        .envs(job.env())
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: fcntl and dup2 are plain system calls, the
    // errors are built from errno without allocating, and `w` is the child's inherited copy
    // of the pipe's write end.
    unsafe {
        cmd.pre_exec(move || {
            if w == 3 {
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(w, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let _ = std::fs::remove_file(&job.report);
    let mut child = cmd.spawn().map_err(CommandError::Spawn)?;
    drop(wfd);
    drop(cmd);
    let pid = child.id() as i32;
    if let (Some(r), Some((id, _))) = (&job.registry, &owner) {
        r.add(pid, *id);
    }
    let started = Instant::now();
    let mut status = Vec::new();
    let mut pipe = std::fs::File::from(rfd);
    let timed_out = loop {
        let left = job.timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            break true;
        }
        let mut pfd = libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.min(Duration::from_millis(250)).as_millis().max(1) as i32;
        // SAFETY: `pfd` is a live pollfd and the count is 1; its fd belongs to `pipe`,
        // which is open.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        tick();
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break false;
        }
        if n == 0 {
            continue;
        }
        let mut buf = [0u8; 64];
        match pipe.read(&mut buf) {
            Ok(0) => break false,
            Ok(k) => status.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break false,
        }
    };
    if timed_out {
        stop(&mut child, pid, job.kill_grace);
    }
    // In rl-node aggregate nothing else reaps the child; in a node the reaper thread may
    // have been first, and then this returns at once with an error.
    let _ = child.wait();
    if procs::group_alive(pid) {
        // The command left processes behind (daemons, a backgrounded writer).
        stop(&mut child, pid, job.kill_grace);
    }
    if let Some(r) = &job.registry {
        // The group is stopped above; this stops descendants that left it.
        r.stop(pid, job.kill_grace);
    }
    let tail = job
        .log
        .as_deref()
        .map(|l| procs::tail(l, 20))
        .unwrap_or_default();
    if timed_out {
        let _ = std::fs::remove_file(&job.report);
        return Err(CommandError::TimedOut {
            timeout: job.timeout,
            log: job.log.clone(),
            tail,
        });
    }
    let code: Option<i32> = std::str::from_utf8(&status)
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let exit = match code {
        Some(0) => None,
        Some(c) if c > 128 && c < 128 + 65 => Some(format!(
            "exit code {c} (killed by signal {}, {})",
            c - 128,
            procs::signal_name(c - 128)
        )),
        Some(c) => Some(format!("exit code {c}")),
        None => Some("its shell killed by a signal".into()),
    };
    if let Some(exit) = exit {
        let _ = std::fs::remove_file(&job.report);
        return Err(CommandError::Failed {
            exit,
            log: job.log.clone(),
            tail,
        });
    }
    match std::fs::metadata(&job.output) {
        Ok(m) if m.is_file() => {}
        _ => {
            let _ = std::fs::remove_file(&job.report);
            return Err(CommandError::NoOutput {
                path: job.output.clone(),
            });
        }
    }
    let report = read_report(job);
    let _ = std::fs::remove_file(&job.report);
    report
}

/// SIGTERM the group, `grace`, then SIGKILL; reap the leader meanwhile (an unreaped
/// leader would keep the group "alive" as a zombie).
fn stop(child: &mut std::process::Child, pgid: i32, grace: Duration) {
    let gone = |child: &mut std::process::Child, limit: Duration| {
        let start = Instant::now();
        loop {
            let _ = child.try_wait();
            if !procs::group_alive(pgid) {
                return true;
            }
            if start.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    // SAFETY: killpg takes only integers and touches no memory of this process.
    unsafe {
        libc::killpg(pgid, libc::SIGTERM);
        libc::killpg(pgid, libc::SIGCONT);
    }
    if !gone(child, grace) {
        // SAFETY: killpg takes only integers and touches no memory of this process.
        unsafe {
            libc::killpg(pgid, libc::SIGKILL);
        }
        gone(child, Duration::from_secs(5));
    }
}

fn read_report(job: &Job) -> Result<Vec<InputReport>, CommandError> {
    let mut out = vec![InputReport::default(); job.inputs.len()];
    let text = match std::fs::read(&job.report) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => {
            return Err(CommandError::BadReport {
                path: job.report.clone(),
                reason: e.to_string(),
            })
        }
    };
    let bad = |reason: String| CommandError::BadReport {
        path: job.report.clone(),
        reason,
    };
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let index = |key: &str| -> Result<usize, CommandError> {
        job.inputs
            .iter()
            .position(|p| p.display().to_string() == key)
            .ok_or_else(|| bad(format!("`{key}` is not one of the inputs")))
    };
    if let Some(records) = v.get("records") {
        let m = records
            .as_object()
            .ok_or_else(|| bad("`records` must be an object".into()))?;
        for (k, n) in m {
            let n = n
                .as_u64()
                .ok_or_else(|| bad(format!("records of `{k}` must be a count")))?;
            out[index(k)?].records = Some(n);
        }
    }
    if let Some(unreadable) = v.get("unreadable") {
        let m = unreadable
            .as_object()
            .ok_or_else(|| bad("`unreadable` must be an object".into()))?;
        for (k, why) in m {
            let why = why
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| why.to_string());
            out[index(k)?].unreadable = Some(why);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(dir: &Path, template: &str) -> Job {
        Job {
            template: template.into(),
            inputs: vec![dir.join("a b"), dir.join("c")],
            input_ranks: vec![0, 2],
            output: dir.join(".out.tmp"),
            report: dir.join(".report"),
            iteration: 3,
            split: "train".into(),
            num_ranks: 3,
            log_path: dir.to_path_buf(),
            timeout: Duration::from_secs(20),
            kill_grace: Duration::from_secs(1),
            log: Some(dir.join("merge.log")),
            registry: None,
            env: Vec::new(),
        }
    }

    /// docs/formats.md lists every placeholder of the merge command with its variable.
    #[test]
    fn docs_list_every_placeholder() {
        let doc = include_str!("../../docs/formats.md");
        for (name, var, _) in PLACEHOLDERS {
            assert!(
                doc.contains(&format!("| `{{{name}}}` | `{var}` |")),
                "docs/formats.md misses {{{name}}} / {var}"
            );
        }
    }

    #[test]
    fn templates_are_checked_and_rendered() {
        assert!(check("cat {inputs} > {output}").is_ok());
        assert!(check("cat {inputs}").unwrap_err().contains("{output}"));
        assert!(check("x {inptus} {output}")
            .unwrap_err()
            .contains("unknown placeholder `{inptus}`"));
        assert!(check("x ${HOME} {a,b} {{x}} {output}").is_ok());
        let d = tempfile::tempdir().unwrap();
        let j = job(
            d.path(),
            "m {inputs} -o {output} -r {input_ranks} ${HOME} {{x}}",
        );
        let r = j.render().unwrap();
        assert!(
            r.starts_with(&format!(
                "m '{}/a b' {}/c -o ",
                d.path().display(),
                d.path().display()
            )),
            "{r}"
        );
        assert!(r.ends_with("-r 0,2 ${HOME} {x}"), "{r}");
    }

    #[test]
    fn template_mistakes() {
        assert_eq!(
            check("x {output} {inputs").unwrap_err(),
            "unclosed `{` at byte 11; write `{{` for a literal brace"
        );
        assert_eq!(
            check("x {output} {rank}").unwrap_err(),
            "unknown placeholder `{rank}`; known: {inputs} {output} {report} {iteration} {split} {num_ranks} {input_ranks} {log_path}"
        );
        // No case hint here (unlike phase commands): `{OUTPUT}` is shell text.
        assert!(check("x {OUTPUT} {output}").is_ok());
        assert!(check("{output}{{output}}").is_ok());
        assert!(check("{{output}}")
            .unwrap_err()
            .contains("must write {output}"));
    }

    #[test]
    fn runs_with_env_and_reports_and_failures() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a b"), "A").unwrap();
        std::fs::write(d.path().join("c"), "C").unwrap();
        let j = job(
            d.path(),
            r#"cat {inputs} > {output} && printf '{{"records": {{"%s": 5}}, "unreadable": {{"%s": "bad"}}}}' "$(echo "$RL_NODE_INPUTS" | head -1)" "$(echo "$RL_NODE_INPUTS" | tail -1)" > "$RL_NODE_REPORT""#,
        );
        let reports = run(&j, &mut || {}).unwrap();
        assert_eq!(std::fs::read_to_string(&j.output).unwrap(), "AC");
        assert_eq!(reports[0].records, Some(5));
        assert_eq!(reports[1].unreadable.as_deref(), Some("bad"));
        assert!(!j.report.exists());

        let j = job(d.path(), "echo oops >&2; exit 3; {output}");
        let e = run(&j, &mut || {}).unwrap_err();
        assert!(e.to_string().contains("exit code 3"), "{e}");
        assert!(e.tail().contains("oops"), "{}", e.tail());

        let j = job(d.path(), "kill -9 $$; {output}");
        let e = run(&j, &mut || {}).unwrap_err();
        assert!(e.to_string().contains("SIGKILL"), "{e}");

        let j = job(d.path(), "true {output}");
        let _ = std::fs::remove_file(&j.output);
        let e = run(&j, &mut || {}).unwrap_err();
        assert!(matches!(e, CommandError::NoOutput { .. }), "{e}");

        let mut j = job(d.path(), "sleep 30; touch {output}");
        j.timeout = Duration::from_millis(300);
        let t = Instant::now();
        let e = run(&j, &mut || {}).unwrap_err();
        assert!(matches!(e, CommandError::TimedOut { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }
}
