//! What a rehearsal finds before it starts a node: every command of every rank and
//! iteration rendered as `rl-node plan` renders it (`plan::build`, the node's own
//! rendering), expanded with its environment and read as shell text ([`super::shell`]),
//! for the programs to stand in for and the problems that show in the text itself; and
//! the disk the configured checkpoint retention needs.

use super::recorder::named_path;
use super::shell::{self, Word};
use super::{Finding, Request, Severity};
use crate::config::Config;
use crate::error::Failure;
use crate::plan::{self, Planned};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Placeholders that are empty by design in a fresh run: no arguments after `--`, no
/// earlier attempt to resume from, no checkpoint before the first hand-off.
const EMPTY_BY_DESIGN: [&str; 3] = ["extra_args", "resume_from", "checkpoint_name"];

/// Phases whose commands read what an earlier command of the iteration wrote.
const AFTER_PREPARE: [&str; 2] = ["phases.train", "phases.handoff"];

#[derive(Default)]
pub(crate) struct Scan {
    /// The programs the commands start that the recorder stands in for.
    pub programs: BTreeSet<String>,
    pub findings: Vec<Finding>,
    /// Files under the shared directory the training reads and the prepare command writes.
    pub prepared: Vec<String>,
    /// Whether a command starts a program by its path (which no stand-in can replace).
    pub by_path: bool,
}

/// Findings keyed by (severity, kind, message), with the places each was seen.
type Seen = BTreeMap<(Severity, &'static str, String), Vec<String>>;

struct Scanner<'a> {
    cfg: &'a Config,
    root: PathBuf,
    prepare: bool,
    scan: Scan,
    seen: Seen,
    prepared: BTreeSet<String>,
}

pub(crate) fn scan(cfg: &Config, nodes: u32, iterations: u64) -> Result<Scan, Failure> {
    let mut s = Scanner {
        cfg,
        root: cfg.log_path(),
        prepare: cfg.phases.prepare.is_set(),
        scan: Scan::default(),
        seen: Seen::new(),
        prepared: BTreeSet::new(),
    };
    for iteration in 1..=iterations {
        for rank in 0..nodes {
            let req = plan::Request {
                iteration,
                rank,
                phase: None,
                json: false,
            };
            for step in plan::build(cfg, &req)?.steps {
                s.step(
                    &step,
                    &format!("{} (rank {rank}, iteration {iteration})", step.config),
                );
            }
        }
    }
    s.merge_command();
    let mut scan = s.scan;
    scan.prepared = s.prepared.into_iter().collect();
    scan.findings = s
        .seen
        .into_iter()
        .map(|((severity, kind, message), places)| Finding {
            severity,
            kind,
            message,
            places,
        })
        .collect();
    Ok(scan)
}

impl Scanner<'_> {
    fn note(&mut self, severity: Severity, kind: &'static str, message: String, place: &str) {
        let places = self.seen.entry((severity, kind, message)).or_default();
        if !places.iter().any(|p| p == place) {
            places.push(place.to_string());
        }
    }

    fn step(&mut self, step: &Planned, place: &str) {
        let Some(command) = &step.command else {
            return;
        };
        // Per-task values and task files are given per work item, which plan does not render.
        let per_item = |n: &str| {
            crate::config::template::PER_TASK.contains(&n)
                || (n == "tasks"
                    && !(self.cfg.tasks.train.is_empty() && self.cfg.tasks.eval.is_empty()))
        };
        for name in &step.empty {
            if !EMPTY_BY_DESIGN.contains(&name.as_str()) && !per_item(name) {
                let msg = format!("{{{name}}} renders empty in the {} command", step.config);
                self.note(Severity::Error, "empty-placeholder", msg, place);
            }
        }
        let mut env: BTreeMap<String, String> = std::env::vars().collect();
        env.extend(step.env.iter().map(|e| (e.name.clone(), e.value.clone())));
        let (text, unset) = shell::expand(command, &env);
        for name in unset {
            let msg = format!(
                "${name} in the {} command is set neither by [env] nor in this environment: it renders empty unless the nodes' environment sets it",
                step.config
            );
            self.note(Severity::Warning, "empty-variable", msg, place);
        }
        for cmd in shell::commands(&text) {
            for prog in shell::programs(&cmd) {
                self.program(&prog, step, place);
            }
            for word in &cmd {
                if let Some(path) = named_path(&word.text) {
                    self.path(&path, word, step, place);
                }
            }
        }
    }

    /// `[aggregate] command` (format = "command"), which `plan` describes but does not
    /// render: only its programs matter here, its files are rl-node's.
    fn merge_command(&mut self) {
        let text = &self.cfg.aggregate.command;
        if text.trim().is_empty() {
            return;
        }
        let mut env: BTreeMap<String, String> = std::env::vars().collect();
        env.extend(self.cfg.env.clone());
        let (text, _) = shell::expand(text, &env);
        let step = Planned {
            config: "aggregate".into(),
            ..Default::default()
        };
        for cmd in shell::commands(&text) {
            for prog in shell::programs(&cmd) {
                self.program(&prog, &step, "aggregate");
            }
        }
    }

    fn program(&mut self, prog: &str, step: &Planned, place: &str) {
        if prog.contains('/') {
            self.scan.by_path = true;
            let msg = format!(
                "the {} command would run {prog}, a program named by its path, which no stand-in on PATH can replace: not rehearsed (start it through its interpreter, e.g. `python3 {prog}`, or put its directory on PATH)",
                step.config
            );
            self.note(Severity::Error, "program-by-path", msg, place);
        } else if !shell::REAL.contains(&prog) && !prog.is_empty() {
            self.scan.programs.insert(prog.to_string());
        }
    }

    /// A path a command names: under the shared directory, under the data path, or
    /// outside both.
    fn path(&mut self, path: &str, word: &Word, step: &Planned, place: &str) {
        let p = Path::new(path);
        let data = &self.cfg.cluster.data_path;
        if p.starts_with(&self.root) {
            if AFTER_PREPARE.contains(&step.config.as_str()) && !self.managed(p, step) {
                self.unwritten(path, word, step, place);
            }
        } else if !data.is_empty() && p.starts_with(data) {
            if !p.exists() {
                let msg = format!(
                    "{path} (under the data path) does not exist on this machine: the {} command would not find it",
                    step.config
                );
                self.note(Severity::Warning, "missing-input", msg, place);
            }
        } else if !p.exists() {
            let msg = format!(
                "the {} command names {path}, outside the shared directory and the data path, and not on this machine: every node's machine must have it, and what a command writes there no other node sees",
                step.config
            );
            self.note(Severity::Warning, "outside-shared", msg, place);
        }
    }

    /// rl-node's own files, and the command's output.
    fn managed(&self, p: &Path, step: &Planned) -> bool {
        let own = ["models", "rollouts", "train", "logs"];
        p == self.root
            || step.output.as_deref().is_some_and(|o| p.starts_with(o))
            || own.iter().any(|d| p.starts_with(self.root.join(d)))
    }

    /// A file under the shared directory the training reads that rl-node does not write.
    fn unwritten(&mut self, path: &str, word: &Word, step: &Planned, place: &str) {
        if self.prepare {
            // The prepare command's stand-in writes it, as the real command would.
            self.prepared.insert(path.to_string());
            return;
        }
        let (severity, how) = match word.read_by_shell {
            true => (Severity::Error, "reads"),
            false => (Severity::Warning, "names"),
        };
        let msg = format!(
            "the {} command {how} {path}, which nothing before it writes (rl-node does not, and there is no phases.prepare)",
            step.config
        );
        self.note(severity, "missing-input", msg, place);
    }
}

/// The disk the checkpoints take at the configured retention, against the free space of
/// the user's shared directory (or, without one here, of the rehearsal's).
pub(crate) fn disk(cfg: &Config, req: &Request) -> Vec<Finding> {
    let Some((size, source)) = model_size(cfg, req.model_size) else {
        return vec![Finding {
            severity: Severity::Warning,
            kind: "disk-unknown",
            message: format!(
                "the size of a checkpoint of {:?} is unknown: pass --model-size GB for an estimate of the disk phases.handoff.keep-last needs",
                cfg.cluster.model
            ),
            places: vec!["phases.handoff".into()],
        }];
    };
    // Measured where the run will write, when that is on this machine; else only a hint.
    let (at, severity) = match req.user_log_path.as_deref().and_then(existing_ancestor) {
        Some(at) => (at, Severity::Error),
        None => (req.dir.clone(), Severity::Warning),
    };
    let Ok(st) = rustix::fs::statvfs(&at) else {
        return Vec::new();
    };
    let free = st.f_bavail as f64 * st.f_frsize as f64 / 1e9;
    let keep = cfg.phases.handoff.keep_last;
    // Beyond keep-last: the one served before the hand-off and the training output being
    // written.
    let (count, what) = match (keep, req.user_iterations) {
        (0, 0) => {
            let lasts = (free / size).floor();
            return vec![Finding {
                severity: Severity::Warning,
                kind: "disk-fill",
                message: format!(
                    "phases.handoff.keep-last = 0 keeps every checkpoint ({size:.1} GB each, {source}) and the run has no end (cluster.iterations = 0): the {free:.0} GB free at {} last about {lasts} of them",
                    at.display()
                ),
                places: vec!["phases.handoff".into()],
            }];
        }
        (0, n) => (n, format!("keep-last = 0 keeps all {n} iterations' checkpoints")),
        (k, _) => (k + 2, format!("keep-last = {k}, plus the one served during a hand-off and the training output being written")),
    };
    let need = count as f64 * size;
    if need <= free {
        return Vec::new();
    }
    let whose = match severity {
        Severity::Error => "",
        Severity::Warning => {
            " (the shared directory is not on this machine: give --log-path to measure its disk)"
        }
    };
    vec![Finding {
        severity,
        kind: "disk-fill",
        message: format!(
            "the checkpoints would fill the disk: {what}: {count} × {size:.1} GB ({source}) = {need:.0} GB, but {} has {free:.0} GB free{whose}",
            at.display()
        ),
        places: vec!["phases.handoff".into()],
    }]
}

/// One checkpoint's size in GB and where it came from: `--model-size`, the model
/// directory's files, or the parameter count in its name (`…-8B…`, 2 bytes a parameter).
fn model_size(cfg: &Config, given: Option<f64>) -> Option<(f64, String)> {
    if let Some(gb) = given {
        return Some((gb, "--model-size".into()));
    }
    let model = Path::new(&cfg.cluster.model);
    if model.is_dir() {
        let bytes: u64 = std::fs::read_dir(model)
            .ok()?
            .filter_map(|e| e.ok()?.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum();
        return Some((
            bytes as f64 / 1e9,
            format!("the files of {}", model.display()),
        ));
    }
    let name = cfg.cluster.model.to_ascii_lowercase();
    let params = name
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))
        .find_map(|part| part.strip_suffix('b')?.parse::<f64>().ok())?;
    Some((
        params * 2.0,
        format!(
            "estimated from the name {:?}: {params}B parameters at 2 bytes; --model-size sets it",
            cfg.cluster.model
        ),
    ))
}

fn existing_ancestor(p: &Path) -> Option<PathBuf> {
    p.ancestors().find(|a| a.exists()).map(Path::to_path_buf)
}
