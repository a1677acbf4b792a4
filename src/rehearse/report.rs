//! The rehearsal's report: per rank, iteration and phase, the command lines the node ran
//! (the `### $` lines of its phase logs) and what each stand-in received (the recorder's
//! log), then every finding. The same report is written as `report.json` in the rehearsal
//! directory and printed as text (or JSON with `--json`).

use super::recorder::{self, Call};
use super::{shared_dir, Finding, Severity};
use crate::config::Config;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What ran, before it is read back.
#[derive(Default)]
pub(crate) struct Run {
    pub dir: PathBuf,
    pub nodes: u32,
    pub iterations: u64,
    /// Each rank's server port.
    pub ports: Vec<u16>,
    /// Each node's exit code (`None`: stopped at the deadline); empty when none started.
    pub exits: Vec<Option<i32>>,
}

#[derive(Serialize)]
pub(crate) struct Report {
    pub dir: String,
    pub shared: String,
    pub nodes: u32,
    pub iterations: u64,
    pub ports: Vec<u16>,
    pub exits: Vec<Option<i32>>,
    pub steps: Vec<Step>,
    pub findings: Vec<Finding>,
}

impl Report {
    pub fn errors(&self) -> usize {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
            .count()
    }
}

/// One phase of one rank in one iteration.
#[derive(Serialize)]
pub(crate) struct Step {
    pub rank: u32,
    pub iteration: u64,
    pub phase: String,
    /// The command lines the node ran, as it logged them.
    pub commands: Vec<String>,
    /// The stand-ins' calls, in order.
    pub calls: Vec<Call>,
}

/// The steps by rank, iteration and phase (in the order an iteration runs them).
type Steps = BTreeMap<(u32, u64, usize, String), Step>;

fn slot<'a>(steps: &'a mut Steps, rank: u32, iteration: u64, phase: &str) -> &'a mut Step {
    let order = crate::config::COMMANDS
        .iter()
        .position(|p| *p == phase)
        .unwrap_or(crate::config::COMMANDS.len());
    steps
        .entry((rank, iteration, order, phase.to_string()))
        .or_insert_with(|| Step {
            rank,
            iteration,
            phase: phase.to_string(),
            commands: Vec::new(),
            calls: Vec::new(),
        })
}

pub(crate) fn build(run: Run, cfg: &Config, mut findings: Vec<Finding>) -> Report {
    let shared = shared_dir(&run.dir);
    let mut steps: Steps = BTreeMap::new();
    for (rank, iteration, phase, commands) in logged_commands(&shared) {
        slot(&mut steps, rank, iteration, &phase).commands = commands;
    }
    for call in calls(&run.dir) {
        let (Ok(rank), Ok(iteration)) = (
            call.var("RL_NODE_RANK").parse::<u32>(),
            call.var("RL_NODE_ITERATION").parse::<u64>(),
        ) else {
            continue;
        };
        let phase = call.var("RL_NODE_PHASE").to_string();
        slot(&mut steps, rank, iteration, &phase).calls.push(call);
    }
    let steps: Vec<Step> = steps.into_values().collect();
    findings.extend(call_findings(&steps, cfg, &shared));
    findings.extend(exit_findings(&run));
    findings.sort_by_key(|f| f.severity);
    Report {
        dir: run.dir.display().to_string(),
        shared: shared.display().to_string(),
        nodes: run.nodes,
        iterations: run.iterations,
        ports: run.ports,
        exits: run.exits,
        steps,
        findings,
    }
}

/// The `### $ …` lines of every phase log: (rank, iteration, phase, command lines).
fn logged_commands(shared: &Path) -> Vec<(u32, u64, String, Vec<String>)> {
    let mut out = Vec::new();
    let Ok(iters) = std::fs::read_dir(shared.join("logs")) else {
        return out;
    };
    for it in iters.flatten() {
        let name = it.file_name().to_string_lossy().into_owned();
        let Some(iteration) = crate::layout::iteration_of(&name) else {
            continue;
        };
        let Ok(files) = std::fs::read_dir(it.path()) else {
            continue;
        };
        for f in files.flatten() {
            let fname = f.file_name().to_string_lossy().into_owned();
            let Some((rank, phase)) = fname
                .strip_prefix("rank-")
                .and_then(|n| n.strip_suffix(".log"))
                .and_then(|n| n.split_once('.'))
            else {
                continue;
            };
            let Ok(rank) = rank.parse::<u32>() else {
                continue;
            };
            let text = std::fs::read_to_string(f.path()).unwrap_or_default();
            let commands: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("### $ "))
                .map(str::to_string)
                .collect();
            if !commands.is_empty() {
                out.push((rank, iteration, phase.to_string(), commands));
            }
        }
    }
    out
}

fn calls(dir: &Path) -> Vec<Call> {
    std::fs::read_to_string(dir.join(recorder::LOG))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// What the stand-ins saw: arguments naming files under the shared directory or the data
/// path that did not exist (and are not the command's output), and what they could not
/// write.
fn call_findings(steps: &[Step], cfg: &Config, shared: &Path) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    let data = &cfg.cluster.data_path;
    for s in steps {
        let place = format!("{} (rank {}, iteration {})", s.phase, s.rank, s.iteration);
        for c in &s.calls {
            let outputs = [c.var("RL_NODE_OUTPUT"), c.var("RL_NODE_TRAIN_OUTPUT")];
            for (path, exists) in &c.paths {
                let p = Path::new(path);
                let ours = p.starts_with(shared) || (!data.is_empty() && p.starts_with(data));
                let output = outputs.iter().any(|o| !o.is_empty() && p.starts_with(o));
                if *exists || !ours || output {
                    continue;
                }
                out.push(Finding {
                    severity: Severity::Warning,
                    kind: "missing-input",
                    message: format!(
                        "{} was given {path}, which did not exist when it started",
                        c.prog
                    ),
                    places: vec![place.clone()],
                });
            }
            for p in &c.problems {
                out.push(Finding {
                    severity: Severity::Warning,
                    kind: "stand-in",
                    message: p.clone(),
                    places: vec![place.clone()],
                });
            }
        }
    }
    out
}

/// A node that did not finish is an error, with the last lines it printed.
fn exit_findings(run: &Run) -> Vec<Finding> {
    let mut out = Vec::new();
    for (rank, exit) in run.exits.iter().enumerate() {
        let what = match exit {
            Some(0) => continue,
            Some(code) => format!("rank {rank} exited {code}"),
            None => format!("rank {rank} did not finish within --timeout and was stopped"),
        };
        let log = run.dir.join(format!("rank-{rank}.log"));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines
            .iter()
            .position(|l| l.starts_with("error:"))
            .unwrap_or(lines.len().saturating_sub(5));
        let tail = lines[from..]
            .iter()
            .take(8)
            .copied()
            .collect::<Vec<_>>()
            .join("\n    ");
        out.push(Finding {
            severity: Severity::Error,
            kind: "node-failed",
            message: format!("{what} ({}):\n    {tail}", log.display()),
            places: vec![format!("rank {rank}")],
        });
    }
    out
}

/// Variables shown in the table besides the `[env]` keys (every one is in report.json).
const SHOWN: [&str; 6] = [
    "RL_NODE_OUTPUT",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
];

pub(crate) fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rl-node rehearse: {} nodes, {} iteration(s) on this machine; every external program replaced by a recorder",
        r.nodes, r.iterations
    );
    let _ = writeln!(
        s,
        "rehearsal directory (kept): {}\n  shared directory: {}\n  calls: {}/{}\n  node output: {}/rank-R.log\n  server ports used: {}\n",
        r.dir,
        r.shared,
        r.dir,
        recorder::LOG,
        r.dir,
        r.ports.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(s, "RANK  ITER  PHASE      COMMAND");
    for st in &r.steps {
        let head = format!("{:<4}  {:<4}  {:<9}", st.rank, st.iteration, st.phase);
        let mut first = true;
        for c in &st.commands {
            let _ = writeln!(s, "{}  $ {c}", if first { head.as_str() } else { "" });
            first = false;
        }
        if first {
            let _ = writeln!(s, "{head}  (no command logged)");
        }
        for c in &st.calls {
            let _ = writeln!(
                s,
                "{:24}ran: {} (stand-in), in {}",
                "",
                shell_line(&c.argv),
                c.cwd
            );
            let env: Vec<String> = c
                .env
                .iter()
                .filter(|(k, _)| {
                    SHOWN.contains(&k.as_str())
                        || !(k.starts_with("RL_NODE_")
                            || k.as_str() == "PATH"
                            || k.as_str() == "CUDA_VISIBLE_DEVICES")
                })
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            if !env.is_empty() {
                let _ = writeln!(s, "{:24}env: {}", "", env.join(" "));
            }
            let read: Vec<&str> = c
                .paths
                .iter()
                .filter(|(p, e)| *e && !c.wrote.contains(p))
                .map(|(p, _)| p.as_str())
                .collect();
            if !read.is_empty() {
                let _ = writeln!(s, "{:24}reads: {}", "", read.join(" "));
            }
            if !c.wrote.is_empty() {
                let _ = writeln!(s, "{:24}wrote (in its place): {}", "", c.wrote.join(" "));
            }
        }
    }
    let errors = r.errors();
    let _ = writeln!(s, "\nFindings:");
    if r.findings.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for f in &r.findings {
        let sev = match f.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        let _ = writeln!(s, "  {sev} [{}]: {}", f.kind, f.message);
        if !f.places.is_empty() {
            let mut places = f.places.clone();
            if places.len() > 4 {
                let more = places.len() - 3;
                places.truncate(3);
                places.push(format!("{more} more"));
            }
            let _ = writeln!(s, "    at: {}", places.join("; "));
        }
    }
    let _ = writeln!(
        s,
        "\n{errors} error(s), {} warning(s)",
        r.findings.len() - errors
    );
    s
}

fn shell_line(argv: &[String]) -> String {
    let mut v = vec![argv[0].clone()];
    v.extend(argv[1..].iter().map(|a| crate::template::shell_word(a)));
    v.join(" ")
}
