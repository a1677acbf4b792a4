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
//! commands. It is a [`procs::Waited`] child: in a node, whose reaper thread collects every
//! child, the reaper hands the command's exit back here instead of to the node; in
//! `rl-node aggregate`, which has no reaper, it is waited for directly. When it ends or
//! times out, its group is stopped (SIGTERM, the grace, SIGKILL), and in a node also its
//! descendants that left the group.

use crate::process::{self as procs, Registry};
use crate::template::{braced_list, shell_word, Braces, Dialect, Template};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::os::fd::AsFd;
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
/// `warn` hears what its caller should warn about, whatever the outcome: something planted
/// at the log's name that was set aside before the log was written anew.
pub fn run(
    job: &Job,
    tick: &mut dyn FnMut(),
    warn: &mut dyn FnMut(&str),
) -> Result<Vec<InputReport>, CommandError> {
    let rendered = job.render().map_err(CommandError::Template)?;
    let (stdout, stderr) = match &job.log {
        Some(log) => {
            // The log is the command's stdout and stderr (a real file, so the real store).
            if let Some(dir) = log.parent() {
                let store: &dyn crate::store::SharedDir = &crate::store::Fs;
                store.create_dir_all(dir).map_err(CommandError::Spawn)?;
            }
            let (f, set_aside) = crate::store::fs::open_log(log).map_err(CommandError::Spawn)?;
            if let Some(note) = set_aside {
                warn(&note);
            }
            let mut f = f.into_file();
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
            let dup = || io::stderr().as_fd().try_clone_to_owned().map(Stdio::from);
            (
                dup().map_err(CommandError::Spawn)?,
                dup().map_err(CommandError::Spawn)?,
            )
        }
    };

    // In a node, the command's mark for finding descendants that leave its group.
    let owner = job.registry.as_ref().map(|r| r.new_command());
    let mut cmd = Command::new("sh");
    procs::unblocked_signals(&mut cmd)
        .envs(owner.iter().map(|(_, (k, v))| (k, v)))
        .arg("-c")
        .arg(&rendered)
        .envs(job.env.iter().map(|(k, v)| (k, v)))
        .envs(job.env())
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0);
    let _ = crate::store::fs::remove_file(&job.report);
    let mut child = procs::spawn_waited(&mut cmd).map_err(CommandError::Spawn)?;
    drop(cmd);
    let pid = child.pid();
    if let (Some(r), Some((id, _))) = (&job.registry, &owner) {
        r.add(pid, *id);
    }
    let started = Instant::now();
    let exit = loop {
        let left = job.timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            break None;
        }
        let exit = child.wait_timeout(left.min(Duration::from_millis(250)));
        tick();
        if exit.is_some() {
            break exit;
        }
    };
    // Stop what is left of the group: all of it when the command timed out, else what it
    // left behind (daemons, a backgrounded writer); an empty group is done at once.
    child.stop_group(job.kill_grace);
    if let Some(r) = &job.registry {
        // The group is stopped above; this stops descendants that left it.
        r.stop(pid, job.kill_grace);
    }
    let tail = job
        .log
        .as_deref()
        .map(|l| procs::tail(l, 20))
        .unwrap_or_default();
    let Some(exit) = exit else {
        let _ = crate::store::fs::remove_file(&job.report);
        return Err(CommandError::TimedOut {
            timeout: job.timeout,
            log: job.log.clone(),
            tail,
        });
    };
    if let Some(exit) = failure(exit) {
        let _ = crate::store::fs::remove_file(&job.report);
        return Err(CommandError::Failed {
            exit,
            log: job.log.clone(),
            tail,
        });
    }
    match std::fs::metadata(&job.output) {
        Ok(m) if m.is_file() => {}
        _ => {
            let _ = crate::store::fs::remove_file(&job.report);
            return Err(CommandError::NoOutput {
                path: job.output.clone(),
            });
        }
    }
    let report = read_report(job);
    let _ = crate::store::fs::remove_file(&job.report);
    report
}

/// How a command that did not succeed failed, in the shell's words: its exit code, and
/// for a code above 128 the signal that code stands for. The command's shell killed by a
/// signal itself reads as the code a shell reports for that (128 + the signal).
fn failure(exit: procs::ChildExit) -> Option<String> {
    let code = match exit {
        procs::ChildExit::Success => return None,
        procs::ChildExit::Exit(c) => c,
        procs::ChildExit::Signal(s) => 128 + s,
        procs::ChildExit::Unanswered => 1,
    };
    Some(if code > 128 && code < 128 + 65 {
        format!(
            "exit code {code} (killed by signal {}, {})",
            code - 128,
            procs::signal_name(code - 128)
        )
    } else {
        format!("exit code {code}")
    })
}

fn read_report(job: &Job) -> Result<Vec<InputReport>, CommandError> {
    let mut out = vec![InputReport::default(); job.inputs.len()];
    // One line per input: a manifest's size class.
    let text = match crate::store::fs::read_file(&job.report, crate::store::ReadLimit::Manifest) {
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
        let reports = run(&j, &mut || {}, &mut |_| {}).unwrap();
        assert_eq!(std::fs::read_to_string(&j.output).unwrap(), "AC");
        assert_eq!(reports[0].records, Some(5));
        assert_eq!(reports[1].unreadable.as_deref(), Some("bad"));
        assert!(!j.report.exists());

        let j = job(d.path(), "echo oops >&2; exit 3; {output}");
        let e = run(&j, &mut || {}, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("exit code 3"), "{e}");
        assert!(e.tail().contains("oops"), "{}", e.tail());

        let j = job(d.path(), "kill -9 $$; {output}");
        let e = run(&j, &mut || {}, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("SIGKILL"), "{e}");

        let j = job(d.path(), "true {output}");
        let _ = std::fs::remove_file(&j.output);
        let e = run(&j, &mut || {}, &mut |_| {}).unwrap_err();
        assert!(matches!(e, CommandError::NoOutput { .. }), "{e}");

        let mut j = job(d.path(), "sleep 30; touch {output}");
        j.timeout = Duration::from_millis(300);
        let t = Instant::now();
        let e = run(&j, &mut || {}, &mut |_| {}).unwrap_err();
        assert!(matches!(e, CommandError::TimedOut { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    /// How a failed command's end reads, as a shell would say it: its exit code, and for a
    /// code above 128 the signal it stands for, also when the command's own shell was
    /// killed (there is no shell around it to say so).
    #[test]
    fn failures_read_as_a_shell_would_say_them() {
        let d = tempfile::tempdir().unwrap();
        for (template, exit) in [
            ("exit 3; {output}", "exit code 3"),
            ("exit 200; {output}", "exit code 200"),
            (
                "exit 130; {output}",
                "exit code 130 (killed by signal 2, SIGINT)",
            ),
            (
                "kill -9 $$; {output}",
                "exit code 137 (killed by signal 9, SIGKILL)",
            ),
            (
                "kill -TERM $$; {output}",
                "exit code 143 (killed by signal 15, SIGTERM)",
            ),
        ] {
            let j = job(d.path(), template);
            let e = run(&j, &mut || {}, &mut |_| {}).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "the merge command failed with {exit} (log: {})",
                    d.path().join("merge.log").display()
                ),
                "{template}"
            );
        }
    }

    /// A command past its timeout is stopped with its whole group, SIGKILL for what
    /// ignores SIGTERM, its leader collected (this test's process has no reaper), and
    /// reported as timed out, while `tick` kept being called.
    #[test]
    fn a_command_past_its_timeout_is_stopped_with_its_group() {
        let d = tempfile::tempdir().unwrap();
        let mut j = job(
            d.path(),
            r#"trap '' TERM; echo $$ > "$RL_NODE_LOG_PATH/pid"; sleep 30 & sleep 31; touch {output}"#,
        );
        j.timeout = Duration::from_millis(600);
        j.kill_grace = Duration::from_millis(200);
        let t = Instant::now();
        let mut ticks = 0;
        let e = run(&j, &mut || ticks += 1, &mut |_| {}).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(
            e.to_string().starts_with(
                "the merge command did not finish within its timeout of 600ms (aggregate.timeout); it was stopped (log: "
            ),
            "{e}"
        );
        assert!(ticks >= 3, "{ticks} ticks");
        let pid: i32 = std::fs::read_to_string(d.path().join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(!procs::group_alive(pid), "its group {pid} is gone");
        assert!(!j.output.exists());
    }

    /// In a node, whose reaper collects every child, the command's exit still comes back
    /// to `run` (never to the node) with the same messages, a timeout still stops it, and
    /// its group is forgotten by the registry. (Each nextest test is a process of its own,
    /// so the reaper started here collects no other test's children.)
    #[test]
    fn in_a_node_the_reaper_hands_the_commands_exit_back() {
        let (tx, rx) = std::sync::mpsc::channel();
        procs::start_reaper(tx);
        let registry = Registry::new();
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a b"), "A").unwrap();
        std::fs::write(d.path().join("c"), "C").unwrap();
        let with = |template: &str| {
            let mut j = job(
                d.path(),
                &format!(r#"echo $$ >> "$RL_NODE_LOG_PATH/pids"; {template}"#),
            );
            j.registry = Some(registry.clone());
            j
        };
        let log = d.path().join("merge.log");
        let j = with("cat {inputs} > {output}");
        run(&j, &mut || {}, &mut |_| {}).unwrap();
        assert_eq!(std::fs::read_to_string(&j.output).unwrap(), "AC");
        for (template, exit) in [
            ("exit 3; {output}", "exit code 3"),
            (
                "kill -9 $$; {output}",
                "exit code 137 (killed by signal 9, SIGKILL)",
            ),
        ] {
            let e = run(&with(template), &mut || {}, &mut |_| {}).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "the merge command failed with {exit} (log: {})",
                    log.display()
                )
            );
        }
        let mut j = with("sleep 30; touch {output}");
        j.timeout = Duration::from_millis(300);
        let t = Instant::now();
        let e = run(&j, &mut || {}, &mut |_| {}).unwrap_err();
        assert!(matches!(e, CommandError::TimedOut { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

        assert!(registry.groups().is_empty(), "{:?}", registry.groups());
        let leaders: Vec<i32> = std::fs::read_to_string(d.path().join("pids"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(leaders.len(), 4);
        for pid in &leaders {
            assert!(!procs::group_alive(*pid), "group {pid} is gone");
        }
        for ev in rx.try_iter() {
            if let procs::Event::Reaped { pid, exit } = ev {
                assert!(!leaders.contains(&pid), "the node heard of {pid}: {exit:?}");
            }
        }
    }
}
