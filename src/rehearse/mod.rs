//! `rl-node rehearse`: the user's real configuration run for one or two iterations on this
//! machine, before GPUs are spent. N real nodes (this binary, `--master` / `--worker R`, as
//! users start them) run over a fresh shared directory of the rehearsal's own, with every
//! external program the commands start replaced by a recorder ([`recorder`]) that logs its
//! argument vector, environment and working directory and leaves the files the phase
//! expects. The report is, per rank and phase, the command line the node ran, what the
//! program received, the files it named and those written in its place, and the problems
//! found: before the run from the rendered commands ([`scan`]: empty placeholders, programs
//! named by path, paths outside the shared directory, inputs nothing writes, the disk a
//! checkpoint retention needs, a taken server port), and during it from the nodes and the
//! recorder.
//!
//! Only what a rehearsal cannot do otherwise is changed: the shared directory (the user's
//! `log-path` is never written), the server port of ranks that share this machine, and
//! waits that only pace a real cluster (poll interval, `workers-delay`, the GPU drain).

pub(crate) mod recorder;
mod report;
mod scan;
mod shell;

use crate::config::Config;
use crate::error::{Cause, Ending, Failure};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) use recorder::intercept;

/// The most iterations a rehearsal runs: the first, and the second on the checkpoint the
/// first published.
pub(crate) const MAX_ITERATIONS: u64 = 2;

/// What the user asked for, besides the configuration.
pub(crate) struct Request {
    pub iterations: u64,
    /// `--model-size` in GB: the size of one checkpoint.
    pub model_size: Option<f64>,
    /// The rehearsal directory (created; must be empty or absent).
    pub dir: PathBuf,
    pub timeout: Duration,
    pub json: bool,
    /// The node flags to pass on (config, data path, … and the trailing arguments), all
    /// but `--log-path`.
    pub node_flags: Vec<String>,
    /// The user's shared directory, for the disk estimate; never written.
    pub user_log_path: Option<PathBuf>,
    /// `cluster.iterations` as the user's run would have it (0: until stopped).
    pub user_iterations: u64,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Severity {
    Error,
    Warning,
}

/// A problem the rehearsal found.
#[derive(Serialize, Clone, Debug)]
pub(crate) struct Finding {
    pub severity: Severity,
    /// A stable name for scripts: `empty-placeholder`, `port-taken`, …
    pub kind: &'static str,
    pub message: String,
    /// Where it was seen: `phases.train (rank 0, iteration 1)`, ….
    pub places: Vec<String>,
}

/// The shared directory of a rehearsal directory.
pub(crate) fn shared_dir(dir: &Path) -> PathBuf {
    dir.join("shared")
}

/// A fresh rehearsal directory: `dir` (empty or absent), else a new one under the
/// system's temporary directory.
pub(crate) fn make_dir(dir: Option<PathBuf>) -> Result<PathBuf, Failure> {
    let dir = match dir {
        Some(d) => {
            if std::fs::read_dir(&d).is_ok_and(|mut e| e.next().is_some()) {
                return Err(Failure::usage(
                    format!("--dir {}: not empty", d.display()),
                    Some("give an empty or absent directory; a rehearsal never reuses one".into()),
                ));
            }
            d
        }
        None => {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0);
            std::env::temp_dir().join(format!("rl-node-rehearse-{}-{stamp}", std::process::id()))
        }
    };
    std::fs::create_dir_all(shared_dir(&dir))
        .map_err(|e| Failure::failed(format!("cannot create {}: {e}", dir.display())))?;
    let dir = dir.canonicalize().unwrap_or(dir);
    Ok(dir)
}

/// Rehearse `cfg` (loaded with the rehearsal's shared directory and iterations).
pub(crate) fn main(cfg: &Config, req: Request) -> Result<Ending, Failure> {
    let nodes = cfg.cluster.num_nodes;
    let found = scan::scan(cfg, nodes, req.iterations)?;
    let mut findings = found.findings;
    findings.extend(scan::disk(cfg, &req));
    let ports = ports(cfg, nodes, &mut findings)?;
    let mut run = report::Run {
        dir: req.dir.clone(),
        nodes,
        iterations: req.iterations,
        ports: ports.clone(),
        ..Default::default()
    };
    if found.by_path {
        findings.push(Finding {
            severity: Severity::Error,
            kind: "not-rehearsed",
            message: "no node was started: a program named by its path would have run for real"
                .into(),
            places: Vec::new(),
        });
    } else {
        prepare(cfg, &req.dir, &found.programs, &found.prepared)?;
        run.exits = run_nodes(&req, nodes, &ports)?;
    }
    let report = report::build(run, cfg, findings);
    let _ = std::fs::write(
        req.dir.join("report.json"),
        serde_json::to_string_pretty(&report).expect("json"),
    );
    if req.json {
        crate::outln!("{}", serde_json::to_string_pretty(&report).expect("json"));
    } else {
        crate::out!("{}", report::render(&report));
    }
    Ok(match report.errors() {
        0 => Ending::Done,
        _ => Ending::Reported(Cause::Failed),
    })
}

/// Each rank's server port: rank 0 the configured one when it is free on this machine
/// (else a finding, and a free one), the others free ones, as the ranks share this machine.
fn ports(cfg: &Config, nodes: u32, findings: &mut Vec<Finding>) -> Result<Vec<u16>, Failure> {
    let configured = cfg.server.port;
    let mut free = crate::demo::free_ports(nodes as usize)
        .map_err(|e| Failure::failed(format!("cannot find free ports on this machine: {e}")))?;
    if cfg.server.command.trim().is_empty() {
        return Ok(free);
    }
    match std::net::TcpListener::bind(("0.0.0.0", configured)) {
        Ok(_) => free[0] = configured,
        Err(e) => findings.push(Finding {
            severity: Severity::Error,
            kind: "port-taken",
            message: format!(
                "server.port {configured} is already taken on this machine ({e}): the server would not start here; the rehearsal used port {} for rank 0",
                free[0]
            ),
            places: vec!["server".into()],
        }),
    }
    Ok(free)
}

/// The stand-ins' links and what they are told.
fn prepare(
    cfg: &Config,
    dir: &Path,
    programs: &std::collections::BTreeSet<String>,
    prepared: &[String],
) -> Result<(), Failure> {
    let cannot = |what: &Path, e: std::io::Error| {
        Failure::failed(format!("cannot write {}: {e}", what.display()))
    };
    let exe = std::env::current_exe()
        .map_err(|e| Failure::failed(format!("cannot find this rl-node binary: {e}")))?;
    let bin = dir.join(recorder::BIN);
    std::fs::create_dir_all(&bin).map_err(|e| cannot(&bin, e))?;
    for p in programs {
        let link = bin.join(p);
        std::os::unix::fs::symlink(&exe, &link).map_err(|e| cannot(&link, e))?;
    }
    let spec = recorder::Spec {
        format: cfg.naming().format().name().to_string(),
        pick: cfg.phases.handoff.pick.clone(),
        env_keys: cfg.env.keys().cloned().collect(),
        prepared: prepared.to_vec(),
    };
    let path = dir.join(recorder::SPEC);
    std::fs::write(&path, serde_json::to_string_pretty(&spec).expect("json"))
        .map_err(|e| cannot(&path, e))
}

/// Waits that pace a real cluster and only slow a rehearsal down; none changes a command.
const PACE: [(&str, &str); 5] = [
    ("RL_NODE_TIMING_POLL_INTERVAL", "200ms"),
    ("RL_NODE_PHASES_ROLLOUT_WORKERS_DELAY", "0s"),
    ("RL_NODE_PHASES_EVAL_WORKERS_DELAY", "0s"),
    ("RL_NODE_SERVER_GPU_DRAIN_MIB", "0"),
    ("RL_NODE_SERVER_START_RETRY_DELAY", "1s"),
];

/// Start the nodes, wait for them all (at most `req.timeout`), and return their exit codes
/// (`None`: stopped at the deadline).
fn run_nodes(req: &Request, nodes: u32, ports: &[u16]) -> Result<Vec<Option<i32>>, Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::failed(format!("cannot find this rl-node binary: {e}")))?;
    let path = format!(
        "{}:{}",
        req.dir.join(recorder::BIN).display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..nodes {
        let log = req.dir.join(format!("rank-{rank}.log"));
        let out = std::fs::File::create(&log)
            .map_err(|e| Failure::failed(format!("cannot write {}: {e}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(|e| Failure::failed(e.to_string()))?;
        let mut cmd = Command::new(&exe);
        match rank {
            0 => cmd.arg("--master"),
            r => cmd.arg("--worker").arg(r.to_string()),
        };
        cmd.arg("--log-path")
            .arg(shared_dir(&req.dir))
            .args(&req.node_flags)
            .env("PATH", &path)
            .env(recorder::DIR_ENV, &req.dir)
            .env("RL_NODE_SERVER_PORT", ports[rank as usize].to_string())
            .envs(PACE)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        children.push(spawn(cmd)?);
    }
    let deadline = Instant::now() + req.timeout;
    let mut exits: Vec<Option<i32>> = vec![None; children.len()];
    while exits.iter().any(Option::is_none) && Instant::now() < deadline {
        for (c, e) in children.iter_mut().zip(exits.iter_mut()) {
            if e.is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    use std::os::unix::process::ExitStatusExt;
                    *e = Some(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for (c, e) in children.iter_mut().zip(&exits) {
        if e.is_none() {
            // Past the deadline: SIGTERM lets the node stop its commands.
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_child(c),
                rustix::process::Signal::TERM,
            );
            let _ = c.wait();
        }
    }
    Ok(exits)
}

fn spawn(mut cmd: Command) -> Result<Child, Failure> {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and makes one prctl system
    // call (rustix's, direct), which is async-signal-safe (it neither allocates nor locks).
    unsafe {
        cmd.pre_exec(|| {
            // If the rehearsal dies, its nodes stop too.
            let _ = rustix::process::set_parent_process_death_signal(Some(
                rustix::process::Signal::TERM,
            ));
            Ok(())
        });
    }
    cmd.spawn()
        .map_err(|e| Failure::failed(format!("cannot start a node: {e}")))
}
