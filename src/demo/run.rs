//! The demo driver: write the configuration, start the nodes, show them working, report.

use super::progress::{self, IterationReport};
use super::toy;
use super::DemoArgs;
use crate::error::{Cause, Ending, Failure};
use crate::exit;
use crate::layout::Layout;
use crate::protocol::phase::{eval_due, ALL as PHASES};
use crate::protocol::records::{AbortInfo, RankRecord};
use crate::protocol::NodeState;
use rustix::process::{kill_process, Pid, Signal};
use std::fs;
use std::io::{self, Read, Seek, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the view refreshes.
const REFRESH: Duration = Duration::from_millis(250);
/// How often status is read while a kill is pending (phases can be short).
const KILL_POLL: Duration = Duration::from_millis(10);
/// How long after a `--kill-node` kill the other nodes may take to stop by themselves.
const KILL_STOP_LIMIT: Duration = Duration::from_secs(60);
/// The iteration in which `--kill-node` strikes.
const KILL_ITERATION: u64 = 2;
/// `timing.dead-after` of the demo's nodes: how long a node's heartbeat may stay still
/// before it is declared dead. Elastic mode's is shorter, as the survivors go on after it
/// (still well above what a busy machine stalls a heartbeat thread for).
const DEAD_AFTER_SECS: u64 = 5;
const ELASTIC_DEAD_AFTER_SECS: u64 = 3;

struct Plan {
    nodes: u32,
    iterations: u64,
    eval_interval: u64,
    seed: u64,
    tasks: u32,
    actions: u32,
    samples: u32,
    lr: f64,
    pace: f64,
    kill: Option<(u32, &'static str)>,
    /// `--min-nodes`: elastic mode (`cluster.min-nodes`), the survivors of a kill go on.
    min_nodes: Option<u32>,
    dir: PathBuf,
    exe: PathBuf,
    /// What the demo starts, in turn: the synchronous loop, and with `--pipeline` a
    /// pipelined run after it.
    runs: Vec<RunSpec>,
}

/// The clusters of a pipelined run, in the order an iteration passes through them.
const PIPELINE_CLUSTERS: [&str; 2] = ["rollout", "update"];

/// One run of the demo over its own shared directory: the synchronous loop (one cluster
/// of `nodes` nodes) or a pipelined run (a rollout and an update cluster of `nodes` each).
#[derive(Clone, Debug)]
struct RunSpec {
    /// `None`: the synchronous loop; else `pipeline.staleness`.
    staleness: Option<u64>,
    /// Holds the run's config, shared directory and node logs.
    dir: PathBuf,
    shared: PathBuf,
    config: PathBuf,
    /// Nodes per cluster.
    nodes: u32,
    weights: Vec<u64>,
    master_port: u16,
    /// The inference server port of each rank that runs one (the synchronous loop's
    /// ranks; the rollout cluster's: the update cluster has no server).
    server_ports: Vec<u16>,
}

/// One node process of a run: its cluster (`None` in the synchronous loop) and rank.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Lane {
    cluster: Option<&'static str>,
    rank: u32,
}

impl Lane {
    fn label(&self) -> String {
        match self.cluster {
            None => format!("rank {}", self.rank),
            Some(c) => format!("{c} rank {}", self.rank),
        }
    }
}

impl Plan {
    /// `timing.dead-after` in seconds.
    fn dead_after(&self) -> u64 {
        if self.min_nodes.is_some() {
            ELASTIC_DEAD_AFTER_SECS
        } else {
            DEAD_AFTER_SECS
        }
    }
}

impl RunSpec {
    fn label(&self) -> String {
        match self.staleness {
            None => "synchronous".into(),
            Some(k) => format!("pipelined (staleness {k})"),
        }
    }

    /// The run's clusters; the last one completes an iteration (its final barrier).
    fn clusters(&self) -> Vec<Option<&'static str>> {
        match self.staleness {
            None => vec![None],
            Some(_) => PIPELINE_CLUSTERS.iter().map(|c| Some(*c)).collect(),
        }
    }

    fn lanes(&self) -> Vec<Lane> {
        self.clusters()
            .into_iter()
            .flat_map(|cluster| (0..self.nodes).map(move |rank| Lane { cluster, rank }))
            .collect()
    }

    fn log(&self, lane: Lane) -> PathBuf {
        self.dir.join(match lane.cluster {
            None => format!("node-{}.log", lane.rank),
            Some(c) => format!("{c}-{}.log", lane.rank),
        })
    }

    fn server_port(&self, lane: Lane) -> Option<u16> {
        match lane.cluster {
            None | Some("rollout") => self.server_ports.get(lane.rank as usize).copied(),
            Some(_) => None,
        }
    }
}

/// Rollout weights of `n` nodes like docs/usage.md's example: rank 0 takes twice the share.
fn default_weights(n: u32) -> Vec<u64> {
    if n > 1 {
        (0..n).map(|r| if r == 0 { 2 } else { 1 }).collect()
    } else {
        vec![1]
    }
}

pub fn main(args: DemoArgs, globals: Globals) -> Result<Ending, Failure> {
    let mut plan = plan(args, globals).map_err(|e| Failure::usage(format!("demo: {e}"), None))?;
    prepare(&mut plan).map_err(|e| Failure::failed(format!("demo: {e}")))?;
    Demo::new(plan)
        .run()
        .map_err(|e| Failure::failed(format!("demo: {e}")))
}

// ------------------------------------------------------------------ options

/// Node flags the demo honours. The top-level command line declares them as global, so
/// clap hands them to the CLI's settings; `cli.rs` passes them here.
#[derive(Default, Debug)]
pub struct Globals {
    pub iterations: Option<String>,
    pub eval_interval: Option<String>,
    pub rank_weights: Option<String>,
}

fn parse_kill(s: &str, nodes: u32) -> Result<(u32, &'static str), String> {
    let (r, p) = s
        .split_once('@')
        .ok_or_else(|| format!("--kill-node {s}: expected R@PHASE, e.g. 1@training"))?;
    let rank: u32 = r
        .trim()
        .parse()
        .map_err(|_| format!("--kill-node {s}: {r:?} is not a rank"))?;
    if rank >= nodes {
        return Err(format!(
            "--kill-node {s}: rank {rank} does not exist (--nodes {nodes}: ranks 0..={})",
            nodes - 1
        ));
    }
    // `rollout` is the phase people mean by it: the train rollout.
    let p = match p.trim() {
        "rollout" => "train-rollout",
        p => p,
    };
    let phase = PHASES
        .iter()
        .find(|ph| ph.name() == p || p.parse::<u8>().ok() == Some(ph.number()))
        .ok_or_else(|| {
            let names: Vec<&str> = PHASES.iter().map(|p| p.name()).collect();
            format!(
                "--kill-node {s}: unknown phase {p:?}; phases are {}",
                names.join(", ")
            )
        })?;
    Ok((rank, phase.name()))
}

/// The demo's sizes: each flag within a range a toy run on one machine can use, and the
/// toy's tables (a policy of tasks × actions, tasks × samples trajectories an iteration)
/// bounded, so that an absurd value is refused instead of aborting an allocation.
fn check_sizes(args: &DemoArgs, iterations: u64, eval_interval: u64) -> Result<(), String> {
    const MOST: u64 = 1_000_000;
    let (tasks, actions, samples) = (
        u64::from(args.tasks),
        u64::from(args.actions),
        u64::from(args.samples),
    );
    for (flag, value, min, max) in [
        ("--iterations", iterations, 1, 1000),
        ("--eval-interval", eval_interval, 0, 1000),
        ("--tasks", tasks, 1, 100_000),
        ("--actions", actions, 2, 1000),
        ("--samples", samples, 1, 1000),
        ("--staleness", args.staleness, 0, 100),
    ] {
        if !(min..=max).contains(&value) {
            return Err(format!("{flag} {value}: the demo takes {min} to {max}"));
        }
    }
    for (what, product) in [
        ("--tasks × --actions", tasks * actions),
        ("--tasks × --samples", tasks * samples),
    ] {
        if product > MOST {
            return Err(format!(
                "{what} is {product}: the toy holds at most {MOST} (use fewer tasks)"
            ));
        }
    }
    Ok(())
}

fn plan(args: DemoArgs, g: Globals) -> Result<Plan, String> {
    let num = |flag: &str, v: Option<String>, default: u64| -> Result<u64, String> {
        match v {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| format!("{flag} {v}: not a number")),
        }
    };
    let iterations = num("--iterations", g.iterations, 8)?;
    let eval_interval = num("--eval-interval", g.eval_interval, 2)?;
    let nodes = args.nodes.unwrap_or(if args.pipeline { 4 } else { 3 });
    if !(1..=32).contains(&nodes) {
        return Err(format!("--nodes {nodes}: the demo runs 1 to 32 nodes"));
    }
    if args.pipeline {
        if nodes < 2 || nodes % 2 == 1 {
            return Err(format!(
                "--pipeline --nodes {nodes}: a pipelined run splits the nodes evenly into a rollout cluster and an update cluster, so it needs an even number, at least 2 (e.g. --nodes 2 for 1 + 1, --nodes 4 for 2 + 2)"
            ));
        }
        if args.kill_node.is_some() {
            return Err("--kill-node is not available with --pipeline".into());
        }
        if args.min_nodes.is_some() {
            return Err(
                "--min-nodes is not available with --pipeline (elastic mode does not cover pipelined runs yet)"
                    .into(),
            );
        }
        if g.rank_weights.is_some() {
            return Err(
                "--rank-weights is not available with --pipeline (each cluster gives rank 0 twice the share of the others)"
                    .into(),
            );
        }
    }
    let pace = args.pace.unwrap_or(if args.pipeline { 0.5 } else { 0.0 });
    if iterations == 0 {
        return Err("--iterations 0: the demo needs at least one iteration".into());
    }
    if args.tasks == 0 || args.actions < 2 || args.samples == 0 {
        return Err("need --tasks ≥ 1, --actions ≥ 2 and --samples ≥ 1".into());
    }
    check_sizes(&args, iterations, eval_interval)?;
    if !(pace.is_finite() && (0.0..=60.0).contains(&pace)) {
        return Err(format!("--pace {pace}: must be 0 to 60 seconds"));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(format!("--lr {}: must be a positive number", args.lr));
    }
    let weights: Vec<u64> = match g.rank_weights {
        Some(w) => {
            let w: Vec<u64> = w
                .split(',')
                .map(|x| x.trim().parse::<u64>())
                .collect::<Result<_, _>>()
                .map_err(|_| format!("--rank-weights {w}: expected a list like 2,1,1"))?;
            if w.len() != nodes as usize || w.iter().sum::<u64>() == 0 {
                return Err(format!(
                    "--rank-weights needs {nodes} weights (one per node), not all 0"
                ));
            }
            w
        }
        None => default_weights(nodes),
    };
    let kill = match &args.kill_node {
        None => None,
        Some(s) => {
            let k = parse_kill(s, nodes)?;
            if iterations < KILL_ITERATION {
                return Err(format!(
                    "--kill-node strikes in iteration {KILL_ITERATION}: pass --iterations {KILL_ITERATION} or more"
                ));
            }
            Some(k)
        }
    };
    if let Some(k) = args.min_nodes {
        if nodes < 2 {
            return Err(format!(
                "--min-nodes {k}: elastic mode needs at least 2 nodes to go on without one (--nodes {nodes})"
            ));
        }
        if !(1..nodes).contains(&k) {
            return Err(format!(
                "--min-nodes {k}: the nodes go on while at least K are left, so K must be 1 to {} (fewer than --nodes {nodes})",
                nodes - 1
            ));
        }
    }
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
    let dir = run_dir(args.dir)?;
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let run = |staleness: Option<u64>, sub: Option<&str>, nodes: u32, weights: Vec<u64>| {
        let d = sub.map_or(dir.clone(), |s| dir.join(s));
        RunSpec {
            staleness,
            shared: d.join("shared"),
            config: d.join("rl-node.toml"),
            dir: d,
            nodes,
            weights,
            master_port: 0,
            server_ports: Vec::new(),
        }
    };
    // The synchronous run keeps the demo's usual layout unless a pipelined one follows.
    let runs = if args.pipeline {
        vec![
            run(None, Some("sync"), nodes, weights),
            run(
                Some(args.staleness),
                Some("pipelined"),
                nodes / 2,
                default_weights(nodes / 2),
            ),
        ]
    } else {
        vec![run(None, None, nodes, weights)]
    };
    Ok(Plan {
        nodes,
        iterations,
        eval_interval,
        seed: args.seed,
        tasks: args.tasks,
        actions: args.actions,
        samples: args.samples,
        lr: args.lr,
        pace,
        kill,
        min_nodes: args.min_nodes,
        dir,
        exe,
        runs,
    })
}

/// The demo's directory: `--dir` (empty or new), else a new one under the temporary
/// directory.
fn run_dir(dir: Option<PathBuf>) -> Result<PathBuf, String> {
    let dir = match dir {
        Some(d) => {
            fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
            let empty = fs::read_dir(&d)
                .map_err(|e| format!("cannot read {}: {e}", d.display()))?
                .next()
                .is_none();
            if !empty {
                return Err(format!(
                    "--dir {} is not empty: the demo needs an empty or new directory",
                    d.display()
                ));
            }
            d
        }
        None => {
            let d = std::env::temp_dir().join(format!(
                "rl-node-demo-{}-{}",
                chrono::Local::now().format("%Y%m%d-%H%M%S"),
                std::process::id()
            ));
            fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
            d
        }
    };
    Ok(dir)
}

// ------------------------------------------------------------------ set-up

/// Ports below the kernel's ephemeral range, so no outgoing connection (rollouts, the
/// all-reduce) can be holding one when a server restarts on it; falls back to ports the
/// kernel picks.
pub(crate) fn free_ports(n: usize) -> io::Result<Vec<u16>> {
    let lo = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|x| x.parse::<u32>().ok())
        })
        .unwrap_or(32768);
    let mut held = Vec::new();
    if lo > 12000 {
        let span = (lo - 10000).min(20000);
        let start = lo - span;
        let mut rng = toy::SplitMix64::new(
            std::process::id() as u64
                ^ std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0),
        );
        for _ in 0..200 {
            if held.len() == n {
                break;
            }
            let port = (start + (rng.next_u64() % span as u64) as u32) as u16;
            // Free on every address (the trainer listens on 0.0.0.0).
            if let Ok(l) = TcpListener::bind(("0.0.0.0", port)) {
                held.push(l);
            }
        }
    }
    while held.len() < n {
        held.push(TcpListener::bind("127.0.0.1:0")?);
    }
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// Quote for `sh`, then protect braces from the placeholder parser.
fn command_word(s: &str) -> String {
    crate::template::shell_word(s)
        .replace('{', "{{")
        .replace('}', "}}")
}

/// A TOML basic string (JSON's escapes are valid TOML).
fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("string")
}

fn config_toml(p: &Plan, r: &RunSpec) -> String {
    let exe = command_word(&p.exe.display().to_string());
    let pace = if p.pace > 0.0 {
        format!(" --min-secs {}", p.pace)
    } else {
        String::new()
    };
    let rollout = format!(
        "{exe} __toy rollout --server http://127.0.0.1:{{server_port}} --split {{split}} --rank {{rank}} \
         --num-nodes {{num_nodes}} --rank-weights {{rank_weights}} --iteration {{iteration}} \
         --seed {} --samples {} --tasks {} --model-version {{model_version}} --staleness {{staleness}} \
         --out {{output}}{pace}",
        p.seed, p.samples, p.tasks
    );
    let train = format!(
        "{exe} __toy train --trajectories {{trajectories}} --model {{model}} --out {{output}} --lr {} --peer-timeout 30{pace}",
        p.lr
    );
    let server = format!(
        "{exe} __toy server --model {{model}} --port {{server_port}} --seed {}",
        p.seed
    );
    let weights: Vec<String> = r.weights.iter().map(|w| w.to_string()).collect();
    let elastic = match p.min_nodes {
        Some(k) => format!(
            "# Elastic mode: a node declared dead (its heartbeat still for dead-after) is\n# dropped, and the others go on while at least {k} are left (docs/elastic.md).\nmin-nodes = {k}\n"
        ),
        None => String::new(),
    };
    let (what, pipeline) = match r.staleness {
        None => (format!("{} node(s)", r.nodes), String::new()),
        Some(k) => (
            format!(
                "a pipelined run, {n} rollout node(s) (--rl-phase rollout) and {n} update node(s) (--rl-phase update),",
                n = r.nodes
            ),
            format!(
                "\n# Iteration i is rolled out on the model trained on iteration i-1-{k}, while\n# the update cluster trains earlier iterations.\n[pipeline]\nstaleness = {k}\n"
            ),
        ),
    };
    format!(
        r#"# Written by `rl-node demo`: {what} on this machine running the built-in toy
# workload (a {tasks}-task, {actions}-action contextual bandit learned with REINFORCE).
# Each node that runs an inference server gets its own port through RL_NODE_SERVER_PORT
# (the environment overrides server.port below, which is rank 0's).

[cluster]
num-nodes = {nodes}
rank-weights = [{weights}]
eval-interval = {eval_interval}
iterations = {iterations}
master-addr = "127.0.0.1"
master-port = {master_port}
model = {model}
{elastic}
[timing]
heartbeat-interval = "500ms"
dead-after = "{dead_after}s"
poll-interval = "200ms"
kill-grace = "2s"
join-timeout = "60s"
barrier-timeout = "5m"

[phases.rollout]
command = {rollout}
timeout = "2m"

[phases.eval]
command = {rollout}
timeout = "2m"

[phases.train]
command = {train}
timeout = "2m"

[phases.handoff]
timeout = "2m"
pick = "checkpoint-*"

# metrics.jsonl (one line per iteration) summarises each record's reward.
[observe]
metrics-fields = ["reward"]

[server]
command = {server}
port = {port0}
health-url = "http://127.0.0.1:{{server_port}}/health"
start-timeout = "30s"
stop-grace = "2s"
gpu-drain-mib = 0
{pipeline}"#,
        nodes = r.nodes,
        tasks = p.tasks,
        actions = p.actions,
        weights = weights.join(", "),
        eval_interval = p.eval_interval,
        iterations = p.iterations,
        master_port = r.master_port,
        model = toml_str(&p.dir.join("model-0").display().to_string()),
        dead_after = p.dead_after(),
        rollout = toml_str(&rollout),
        train = toml_str(&train),
        server = toml_str(&server),
        port0 = r.server_ports[0],
    )
}

/// Ports (distinct for every run: one run's servers may still be letting theirs go when
/// the next starts), the initial model both runs start from, and each run's config.
fn prepare(p: &mut Plan) -> Result<(), String> {
    let wanted: usize = p.runs.iter().map(|r| r.nodes as usize + 1).sum();
    let mut ports = free_ports(wanted)
        .map_err(|e| format!("cannot find free ports: {e}"))?
        .into_iter();
    for r in &mut p.runs {
        r.master_port = ports.next().expect("a port");
        r.server_ports = ports.by_ref().take(r.nodes as usize).collect();
    }
    let model = p.dir.join("model-0");
    toy::Policy::uniform(p.tasks, p.actions)
        .save(&model)
        .map_err(|e| format!("cannot write the initial model in {}: {e}", model.display()))?;
    for r in &p.runs {
        fs::create_dir_all(&r.dir)
            .map_err(|e| format!("cannot create {}: {e}", r.dir.display()))?;
        fs::write(&r.config, config_toml(p, r))
            .map_err(|e| format!("cannot write {}: {e}", r.config.display()))?;
    }
    Ok(())
}

// ------------------------------------------------------------------ nodes

struct NodeProc {
    lane: Lane,
    child: Child,
    code: Option<i32>,
    log: PathBuf,
    /// Where this start's output begins in `log`.
    offset: u64,
}

fn spawn_node(p: &Plan, run: &RunSpec, lane: Lane) -> io::Result<NodeProc> {
    let rank = lane.rank;
    let log = run.log(lane);
    let mut f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)?;
    let offset = f.seek(io::SeekFrom::End(0))?;
    let mut cmd = Command::new(&p.exe);
    if rank == 0 {
        cmd.arg("--master");
    } else {
        cmd.arg("--worker").arg(rank.to_string());
    }
    cmd.arg("--config")
        .arg(&run.config)
        .arg("--log-path")
        .arg(&run.shared);
    if let Some(c) = lane.cluster {
        cmd.arg("--rl-phase").arg(c);
    }
    // The demo's configuration is the file; nothing from this shell leaks in.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("RL_NODE_") {
            cmd.env_remove(&k);
        }
    }
    if let Some(port) = run.server_port(lane) {
        cmd.env("RL_NODE_SERVER_PORT", port.to_string());
    }
    cmd.stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        // Own process group: Ctrl-C reaches the demo, which forwards it once.
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec and makes one prctl system
    // call (rustix's, direct), which is async-signal-safe (it neither allocates nor locks).
    unsafe {
        cmd.pre_exec(|| {
            // If the demo dies, its nodes stop too.
            let _ = rustix::process::set_parent_process_death_signal(Some(
                rustix::process::Signal::TERM,
            ));
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    Ok(NodeProc {
        lane,
        child,
        code: None,
        log,
        offset,
    })
}

fn exit_code(st: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

fn describe_code(code: i32) -> &'static str {
    match code {
        exit::DONE => "done",
        exit::FAILED => "this node failed",
        exit::USAGE => "usage or configuration error",
        exit::PEER_FAILED => "stopped: another node failed or died",
        exit::DEADLINE => "a deadline passed",
        exit::TIME_LIMIT => "stopped for its time limit (SIGUSR1/SIGUSR2); restart to resume",
        exit::SIGHUP => "interrupted (SIGHUP)",
        exit::SIGINT => "interrupted (SIGINT)",
        exit::SIGTERM => "interrupted (SIGTERM)",
        137 => "killed (SIGKILL)",
        _ => "failed",
    }
}

/// The failure message a node printed in this start (from its first `error:` line on).
fn failure_lines(n: &NodeProc) -> Vec<String> {
    let mut text = String::new();
    if let Ok(mut f) = fs::File::open(&n.log) {
        if f.seek(io::SeekFrom::Start(n.offset)).is_ok() {
            let _ = f.read_to_string(&mut text);
        }
    }
    let lines: Vec<&str> = text.lines().collect();
    match lines.iter().position(|l| l.starts_with("error:")) {
        Some(i) => lines[i..].iter().take(12).map(|s| s.to_string()).collect(),
        None => lines
            .iter()
            .rev()
            .take(3)
            .rev()
            .map(|s| s.to_string())
            .collect(),
    }
}

// ------------------------------------------------------------------ the view

struct View {
    tty: bool,
    /// Lines of the live block currently on screen (tty only).
    drawn: usize,
    last_compact: String,
    started: Instant,
}

impl View {
    fn new() -> View {
        View {
            // SAFETY: isatty takes only an fd number.
            tty: std::io::IsTerminal::is_terminal(&std::io::stdout()),
            drawn: 0,
            last_compact: String::new(),
            started: Instant::now(),
        }
    }

    fn clear_block(&mut self, out: &mut impl Write) {
        if self.tty && self.drawn > 0 {
            let _ = write!(out, "\x1b[{}F\x1b[J", self.drawn);
            self.drawn = 0;
        }
    }

    /// A line that stays (an iteration's result, an event).
    fn line(&mut self, s: &str) {
        let mut out = io::stdout().lock();
        self.clear_block(&mut out);
        let _ = writeln!(out, "{}", crate::output::escape_lines(s));
        let _ = out.flush();
    }

    /// The live block: redrawn in place on a terminal, else one line when it changes.
    fn live(&mut self, block: &[String], compact: &str) {
        let mut out = io::stdout().lock();
        if self.tty {
            self.clear_block(&mut out);
            // A wrapped line would break the redraw: cut lines to the terminal's width.
            let width = terminal_width().saturating_sub(1).max(20);
            for l in block {
                let cut: String = crate::output::escape(l).chars().take(width).collect();
                let _ = writeln!(out, "{cut}");
            }
            self.drawn = block.len();
        } else if compact != self.last_compact {
            let _ = writeln!(
                out,
                "  [{:6.1}s] {}",
                self.started.elapsed().as_secs_f64(),
                crate::output::escape(compact)
            );
            self.last_compact = compact.to_string();
        }
        let _ = out.flush();
    }

    fn end_live(&mut self) {
        let mut out = io::stdout().lock();
        self.clear_block(&mut out);
        let _ = out.flush();
    }
}

fn terminal_width() -> usize {
    match rustix::termios::tcgetwinsize(io::stdout()) {
        Ok(ws) if ws.ws_col > 0 => ws.ws_col as usize,
        _ => 80,
    }
}

fn phase_name(status_phase: &str) -> &str {
    // "10 (training)" -> "training"
    status_phase
        .split_once('(')
        .map(|(_, r)| r.trim_end_matches(')'))
        .unwrap_or(status_phase)
}

fn phase_number(status_phase: &str) -> Option<u8> {
    status_phase.split_whitespace().next()?.parse().ok()
}

fn bar(fraction: f64, width: usize) -> String {
    let f = fraction.clamp(0.0, 1.0);
    let full = (f * width as f64).round() as usize;
    format!("{}{}", "#".repeat(full), ".".repeat(width - full))
}

fn fmt_opt(v: Option<f64>, width: usize, prec: usize) -> String {
    match v {
        Some(x) => format!("{x:>width$.prec$}"),
        None => format!("{:>width$}", "-"),
    }
}

/// The per-iteration table; a pipelined run's also names the model each iteration was
/// rolled out with.
fn table_header(pipelined: bool) -> String {
    let mut s = format!(
        "  {:>4}  {:>6} {:<10}  {:>5}  {:>6}  ",
        "iter", "reward", "", "eval", "secs"
    );
    if pipelined {
        s.push_str(&format!("{:>6}", "model"));
    }
    for g in progress::GROUPS {
        s.push_str(&format!("{g:>8}"));
    }
    s
}

fn table_row(r: &IterationReport, pipelined: bool) -> String {
    let mut s = format!(
        "  {:>4}  {} {:<10}  {}  {}  ",
        r.iteration,
        fmt_opt(r.mean_reward, 6, 3),
        r.mean_reward.map(|m| bar(m, 10)).unwrap_or_default(),
        fmt_opt(r.eval_accuracy(), 5, 2),
        fmt_opt(r.secs, 6, 2),
    );
    if pipelined {
        let v = r
            .model_version
            .map(|v| format!("v{v}"))
            .unwrap_or_else(|| "-".into());
        s.push_str(&format!("{v:>6}"));
    }
    for (_, secs) in &r.groups {
        s.push_str(&format!("{secs:>8.2}"));
    }
    s
}

// ------------------------------------------------------------------ the run

/// How one start of a run's nodes ended.
struct Round {
    /// The generation of the cluster that completes iterations (the synchronous loop's,
    /// or the update cluster's).
    gen: Option<u64>,
    /// Exit code of each lane, in `RunSpec::lanes` order.
    codes: Vec<(Lane, i32)>,
    killed: Option<u32>,
    /// When, in seconds since the epoch.
    killed_wall: Option<f64>,
    interrupted: bool,
}

/// What a round's watch loop carries from one look to the next.
struct Watch {
    /// The pending `--kill-node` strike; `None` once struck.
    kill: Option<(u32, &'static str)>,
    killed: Option<u32>,
    killed_at: Option<Instant>,
    /// When the kill was sent, in seconds since the epoch (to compare with event logs).
    killed_wall: Option<f64>,
    /// Signals already passed on to the nodes (any: the round was interrupted).
    forwarded: usize,
    /// The newest generation seen of each cluster, in `RunSpec::clusters` order.
    gens: Vec<Option<u64>>,
    /// Every generation seen of each cluster, with its coordinator, oldest first (more
    /// than one in a round only when elastic mode regrouped).
    seen: Vec<Vec<(u64, u32)>>,
    /// Iterations whose table row is printed.
    shown: Vec<u64>,
}

impl Watch {
    fn interrupted(&self) -> bool {
        self.forwarded > 0
    }
}

/// What one run (`RunSpec`) left for the summary.
struct RunResult {
    spec: RunSpec,
    /// Elastic mode: the rank the demo killed is not waited for.
    elastic: bool,
    rounds: Vec<Round>,
    reports: Vec<IterationReport>,
    /// From the first phase any node entered to the end of the last iteration (rank 0's
    /// event logs), in the last round.
    makespan: Option<f64>,
}

impl RunResult {
    /// Every node of the last round exited 0 (in elastic mode, every node but the one
    /// killed), and every iteration was reported complete.
    fn ok(&self, iterations: u64) -> bool {
        let Some(last) = self.rounds.last() else {
            return false;
        };
        let killed =
            |lane: &Lane| self.elastic && lane.cluster.is_none() && last.killed == Some(lane.rank);
        let codes = last
            .codes
            .iter()
            .all(|(lane, c)| *c == exit::DONE || killed(lane));
        let all = !self.elastic
            || (1..=iterations).all(|i| self.reports.iter().any(|r| r.iteration == i));
        codes && all
    }

    fn rewards(&self) -> Option<(f64, f64)> {
        Some((
            self.reports.first()?.mean_reward?,
            self.reports.last()?.mean_reward?,
        ))
    }
}

/// One cluster's state as its records say (`rl-node status` for one cluster of a run).
struct ClusterView {
    gen: u64,
    /// The generation's members (every rank, unless some were dropped) and coordinator.
    members: Vec<u32>,
    coordinator: u32,
    ranks: Vec<Option<RankRecord>>,
    abort: Option<AbortInfo>,
}

fn cluster_view(shared: &Path, cluster: Option<&'static str>) -> Option<ClusterView> {
    let layout = Layout::new(shared).with_cluster(cluster);
    let c = crate::observe::read_cluster(&layout).ok()?;
    let ranks = crate::observe::status::read_records(&layout, &c);
    let abort = crate::observe::status::read_abort(&layout, c.gen, &ranks);
    let members = c.members();
    Some(ClusterView {
        gen: c.gen,
        members: members.ranks().to_vec(),
        coordinator: members.coordinator(),
        ranks,
        abort,
    })
}

struct Demo {
    plan: Plan,
    view: View,
    signals: Arc<AtomicUsize>,
    last_signal: Arc<AtomicUsize>,
    /// Per-iteration reports of the current round, as they complete.
    reports: Vec<IterationReport>,
    header_shown: bool,
}

impl Demo {
    fn new(plan: Plan) -> Demo {
        let signals = Arc::new(AtomicUsize::new(0));
        let last_signal = Arc::new(AtomicUsize::new(0));
        if let Ok(mut s) = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGTERM,
        ]) {
            let (count, last) = (signals.clone(), last_signal.clone());
            let _ = std::thread::Builder::new()
                .name("demo-signals".into())
                .spawn(move || {
                    for sig in s.forever() {
                        last.store(sig as usize, Ordering::SeqCst);
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                });
        }
        Demo {
            plan,
            view: View::new(),
            signals,
            last_signal,
            reports: Vec::new(),
            header_shown: false,
        }
    }

    fn say(&mut self, s: &str) {
        self.view.line(s);
    }

    fn intro(&mut self) {
        let p = &self.plan;
        let evals: Vec<String> = (1..=p.iterations)
            .filter(|i| eval_due(*i, p.eval_interval))
            .map(|i| i.to_string())
            .collect();
        let sync = &p.runs[0];
        let weights: Vec<String> = sync.weights.iter().map(|w| w.to_string()).collect();
        let mut lines = vec![
            format!(
                "rl-node demo: {} node(s) on this machine, {} iteration(s), eval on iteration(s) {}, seed {}",
                p.nodes,
                p.iterations,
                if evals.is_empty() { "none".into() } else { evals.join(", ") },
                p.seed
            ),
            format!(
                "  toy task: {} tasks x {} actions (chance reward {:.2}), {} samples per task, lr {}, rank weights {}",
                p.tasks,
                p.actions,
                1.0 / p.actions as f64,
                p.samples,
                p.lr,
                weights.join(",")
            ),
            format!("  directory: {} (kept)", p.dir.display()),
        ];
        for r in &p.runs {
            let lead = if p.runs.len() > 1 {
                format!("  {}: ", r.label())
            } else {
                "  ".into()
            };
            let logs = match r.staleness {
                None => r.dir.join("node-R.log"),
                Some(_) => r.dir.join("{rollout,update}-R.log"),
            };
            lines.push(format!(
                "{lead}config: {}   node output: {}",
                r.config.display(),
                logs.display()
            ));
            let servers_of = if r.staleness.is_some() {
                "rollout rank"
            } else {
                "rank"
            };
            lines.push(format!(
                "{}ports: training rendezvous {}, inference servers {}",
                " ".repeat(lead.len()),
                r.master_port,
                r.server_ports
                    .iter()
                    .enumerate()
                    .map(|(rank, port)| format!("{port} ({servers_of} {rank})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if let Some(k) = p.runs.iter().find_map(|r| r.staleness) {
            let half = p.nodes / 2;
            lines.push(format!(
                "  --pipeline: first the synchronous loop on {} nodes, then a pipelined run: {half} rollout node(s) keep their inference servers up and roll out iteration i on the model trained on iteration i-1-{k}, while {half} update node(s) train the iterations before it",
                p.nodes
            ));
        }
        lines.push(if p.pace > 0.0 {
            format!(
                "  pace: every rollout, eval and training command takes at least {}s",
                p.pace
            )
        } else {
            "  (the toy runs an iteration in about 0.1s: add --pace 0.5 to watch each phase go by)"
                .into()
        });
        if let Some(k) = p.min_nodes {
            lines.push(format!(
                "  --min-nodes {k}: elastic mode; a node declared dead (dead-after {}s) is dropped and the others go on while at least {k} are left",
                p.dead_after()
            ));
        }
        if let Some((r, ph)) = p.kill {
            lines.push(format!(
                "  --kill-node: rank {r} gets SIGKILL when it reaches phase `{ph}` in iteration {KILL_ITERATION}; {}",
                if p.min_nodes.is_some() {
                    "the others drop it and finish the run without a restart"
                } else {
                    "then every node is restarted once"
                }
            ));
        }
        lines.push(String::new());
        for l in lines {
            self.say(&l);
        }
    }

    fn run(mut self) -> Result<Ending, String> {
        let started = Instant::now();
        self.intro();
        let mut results = Vec::new();
        let multi = self.plan.runs.len() > 1;
        for spec in self.plan.runs.clone() {
            if multi {
                self.say(&format!("== {} run ({})", spec.label(), spec.dir.display()));
            }
            let kill = if spec.staleness.is_none() {
                self.plan.kill
            } else {
                None
            };
            let first = self.round(&spec, kill, None)?;
            let mut rounds = vec![first];
            let first = &rounds[0];
            if first.killed.is_some() && !first.interrupted && self.plan.min_nodes.is_none() {
                let gen = first.gen;
                self.restart_pause(&spec);
                let second = self.round(&spec, None, gen)?;
                rounds.push(second);
            }
            self.view.end_live();
            let makespan = rounds
                .last()
                .and_then(|r| r.gen)
                .and_then(|_| makespan(&spec));
            let result = RunResult {
                spec,
                elastic: self.plan.min_nodes.is_some(),
                rounds,
                reports: std::mem::take(&mut self.reports),
                makespan,
            };
            let stop = !result.ok(self.plan.iterations)
                || result.rounds.last().is_some_and(|r| r.interrupted);
            results.push(result);
            if stop {
                break;
            }
            if multi {
                self.say("");
            }
        }
        self.summary(&results, started.elapsed());
        let last = results.last().expect("one run");
        if last.rounds.last().is_some_and(|r| r.interrupted) {
            return Ok(Ending::Reported(Cause::Interrupted(libc::SIGINT)));
        }
        Ok(
            if results.len() == self.plan.runs.len()
                && results.iter().all(|r| r.ok(self.plan.iterations))
            {
                Ending::Done
            } else {
                Ending::Reported(Cause::Failed)
            },
        )
    }

    /// Before restarting, let the ports of the old servers and trainers go.
    fn restart_pause(&mut self, run: &RunSpec) {
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut ports = run.server_ports.clone();
        ports.push(run.master_port);
        for port in ports {
            while TcpListener::bind(("127.0.0.1", port)).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let n = run.lanes().len();
        self.say("");
        self.say(&format!(
            ">> restarting all {n} node(s) with the same commands over the same shared directory: a new generation (the earlier one's records are ignored)"
        ));
    }

    /// Start every node of `run`, watch them until all have exited. `kill`: kill -9 that
    /// rank when it reaches that phase in iteration 2. `prev_gen`: the generation of an
    /// earlier start.
    fn round(
        &mut self,
        run: &RunSpec,
        kill: Option<(u32, &'static str)>,
        prev_gen: Option<u64>,
    ) -> Result<Round, String> {
        let mut nodes = self.start_nodes(run)?;
        self.reports.clear();
        self.header_shown = false;

        let clusters = run.clusters();
        let mut w = Watch {
            kill,
            killed: None,
            killed_at: None,
            killed_wall: None,
            forwarded: 0,
            gens: vec![None; clusters.len()],
            seen: vec![Vec::new(); clusters.len()],
            shown: Vec::new(),
        };
        let mut last_render = Instant::now() - REFRESH;
        loop {
            self.forward_signals(&nodes, &mut w);
            self.reap(&mut nodes, w.killed);
            let views: Vec<Option<ClusterView>> = clusters
                .iter()
                .map(|c| {
                    cluster_view(&run.shared, *c).filter(|s| prev_gen.is_none_or(|g| s.gen > g))
                })
                .collect();
            for (i, v) in views.iter().enumerate() {
                let Some(v) = v else { continue };
                if w.gens[i].is_some_and(|g| v.gen > g) {
                    self.regrouped(run, v);
                }
                w.gens[i] = Some(v.gen);
                if !w.seen[i].iter().any(|(g, _)| *g == v.gen) {
                    w.seen[i].push((v.gen, v.coordinator));
                }
            }
            self.strike(&mut nodes, &views, &mut w);
            self.stop_stragglers(&nodes, &mut w);

            let all_done = nodes.iter().all(|n| n.code.is_some());
            self.report_iterations(run, &clusters, &w.seen, &mut w.shown);
            if all_done {
                break;
            }
            if last_render.elapsed() >= REFRESH {
                last_render = Instant::now();
                let (block, compact) = self.live_block(&clusters, &views, &nodes);
                self.view.live(&block, &compact);
            }
            std::thread::sleep(if w.kill.is_some() {
                KILL_POLL
            } else {
                REFRESH / 5
            });
        }
        self.view.end_live();
        let codes: Vec<(Lane, i32)> = nodes
            .iter()
            .map(|n| (n.lane, n.code.unwrap_or(-1)))
            .collect();
        let elastic = self.plan.min_nodes.is_some();
        let unexpected = codes.iter().any(|(lane, c)| {
            *c != exit::DONE && !(elastic && lane.cluster.is_none() && w.killed == Some(lane.rank))
        });
        if unexpected && !w.interrupted() {
            self.explain_exits(&nodes, w.killed);
        }
        if let (Some((kr, kphase)), None, false) = (w.kill, w.killed, w.interrupted()) {
            self.say(&format!(
                ">> --kill-node: rank {kr} never showed phase `{kphase}` in iteration {KILL_ITERATION} or later; nothing was killed"
            ));
        }
        Ok(Round {
            gen: *w.gens.last().expect("a cluster"),
            codes,
            killed: w.killed,
            killed_wall: w.killed_wall,
            interrupted: w.interrupted(),
        })
    }

    /// Start one process per lane of `run`; if one cannot start, kill those already
    /// started.
    fn start_nodes(&mut self, run: &RunSpec) -> Result<Vec<NodeProc>, String> {
        let mut nodes = Vec::new();
        for lane in run.lanes() {
            match spawn_node(&self.plan, run, lane) {
                Ok(n) => nodes.push(n),
                Err(e) => {
                    for n in &mut nodes {
                        let _ = n.child.kill();
                        let _ = n.child.wait();
                    }
                    return Err(format!(
                        "cannot start node {} ({}): {e}",
                        lane.label(),
                        self.plan.exe.display()
                    ));
                }
            }
        }
        let pids: Vec<String> = nodes
            .iter()
            .map(|n| format!("{} pid {}", n.lane.label(), n.child.id()))
            .collect();
        self.say(&format!(
            "started {} node(s): {}",
            nodes.len(),
            pids.join(", ")
        ));
        Ok(nodes)
    }

    /// Ctrl-C / SIGTERM: pass each one on to the nodes (a second one makes them kill
    /// their commands at once).
    fn forward_signals(&mut self, nodes: &[NodeProc], w: &mut Watch) {
        let count = self.signals.load(Ordering::SeqCst);
        if count > w.forwarded {
            w.forwarded = count;
            let sig = self.last_signal.load(Ordering::SeqCst) as i32;
            // SIGINT or SIGTERM: both have names.
            if let Some(named) = Signal::from_named_raw(sig) {
                // The children are not reaped yet (no exit code): their pids are their own.
                for n in nodes.iter().filter(|n| n.code.is_none()) {
                    let _ = kill_process(Pid::from_child(&n.child), named);
                }
            }
            self.say(&format!(
                ">> {}: stopping the nodes",
                crate::node::procs::signal_name(sig)
            ));
        }
    }

    /// Record the exit code of each node that has exited since the last look.
    fn reap(&mut self, nodes: &mut [NodeProc], killed: Option<u32>) {
        for n in nodes.iter_mut().filter(|n| n.code.is_none()) {
            if let Ok(Some(st)) = n.child.try_wait() {
                let code = exit_code(st);
                n.code = Some(code);
                let msg = format!(
                    "{} exited with code {code} ({})",
                    n.lane.label(),
                    describe_code(code)
                );
                if code != exit::DONE || killed.is_some() {
                    self.view.line(&format!(">> {msg}"));
                }
            }
        }
    }

    /// `--kill-node`: kill -9 the named rank once the first cluster's records show it
    /// in the named phase of iteration 2.
    fn strike(&mut self, nodes: &mut [NodeProc], views: &[Option<ClusterView>], w: &mut Watch) {
        let (Some((kr, kphase)), Some(s)) = (w.kill, &views[0]) else {
            return;
        };
        // Strike in the named phase of iteration 2; a phase can pass between two
        // looks, so if the rank is already beyond it, strike at once and say so.
        let target = PHASES.iter().position(|p| p.name() == kphase).unwrap_or(0) as u8;
        let now = s
            .ranks
            .get(kr as usize)
            .and_then(|r| r.as_ref())
            .filter(|r| {
                r.state == NodeState::Running
                    && r.phase.is_some_and(|p| {
                        (r.iteration == KILL_ITERATION && p.number() >= target)
                            || r.iteration > KILL_ITERATION
                    })
            });
        let node = &mut nodes[kr as usize];
        if let (Some(r), None) = (now, node.code) {
            let pid = node.child.id();
            let _ = node.child.kill();
            let ph = r.phase.map(|p| p.to_string()).unwrap_or_default();
            let late = if phase_name(&ph) == kphase {
                String::new()
            } else {
                format!(" (it had already left `{kphase}`)")
            };
            let dead_after = self.plan.dead_after();
            let then = if self.plan.min_nodes.is_some() {
                format!("the others should find its heartbeat still after dead-after ({dead_after}s), drop it and go on")
            } else {
                format!(
                    "the others should notice its heartbeat stop within dead-after ({dead_after}s)"
                )
            };
            self.view.line(&format!(
                ">> kill -9 rank {kr} (pid {pid}) in phase {ph} of iteration {}{late}; {then}",
                r.iteration
            ));
            w.kill = None;
            w.killed = Some(kr);
            w.killed_at = Some(Instant::now());
            w.killed_wall = Some(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0),
            );
        }
    }

    /// The survivors must stop on their own within dead-after; if they have not
    /// long after that, something is wrong: stop them rather than hang.
    fn stop_stragglers(&mut self, nodes: &[NodeProc], w: &mut Watch) {
        // In elastic mode the survivors go on: they are not stragglers.
        if self.plan.min_nodes.is_some()
            || w.killed_at.is_none_or(|t| t.elapsed() <= KILL_STOP_LIMIT)
        {
            return;
        }
        w.killed_at = None;
        let left: Vec<String> = nodes
            .iter()
            .filter(|n| n.code.is_none())
            .map(|n| {
                // Not reaped yet (no exit code): the pid is still its own.
                let _ = kill_process(Pid::from_child(&n.child), Signal::TERM);
                n.lane.label()
            })
            .collect();
        if !left.is_empty() {
            self.view.line(&format!(
                ">> {} still running {}s after the kill: sending SIGTERM",
                left.join(", "),
                KILL_STOP_LIMIT.as_secs()
            ));
        }
    }

    /// Print a table row for each iteration completed since the last look (once the
    /// last cluster has a generation). An iteration is complete when the coordinator of
    /// a generation of the last cluster passed its final barrier: rank 0, or after an
    /// elastic regroup the lowest live rank; `seen` has every generation of each cluster
    /// with its coordinator.
    fn report_iterations(
        &mut self,
        run: &RunSpec,
        clusters: &[Option<&'static str>],
        seen: &[Vec<(u64, u32)>],
        shown: &mut Vec<u64>,
    ) {
        let (Some((last_cluster, before)), Some((last_seen, seen_before))) =
            (clusters.split_last(), seen.split_last())
        else {
            return;
        };
        if last_seen.is_empty() {
            return;
        }
        // The clusters before the last (a pipelined run's rollout cluster), in their
        // newest generation.
        let others: Vec<(Vec<progress::Event>, u64)> = before
            .iter()
            .zip(seen_before)
            .filter_map(|(c, s)| {
                let (g, coordinator) = *s.last()?;
                Some((
                    progress::read_cluster_events(&run.shared, *c, coordinator),
                    g,
                ))
            })
            .collect();
        for &(g, coordinator) in last_seen {
            let last_events =
                progress::read_cluster_events(&run.shared, *last_cluster, coordinator);
            for it in progress::completed(&last_events, g) {
                if shown.contains(&it) {
                    continue;
                }
                shown.push(it);
                let parts: Vec<(&[progress::Event], u64)> = others
                    .iter()
                    .map(|(e, g)| (e.as_slice(), *g))
                    .chain(std::iter::once((last_events.as_slice(), g)))
                    .collect();
                let mut r = progress::cluster_report(&run.shared, &parts, it);
                if run.staleness.is_some() {
                    // The clusters overlap: what an iteration costs is the time
                    // between two models, not the sum of its phases.
                    r.secs = iteration_interval(&parts, &last_events, g, it);
                }
                if !self.header_shown {
                    self.header_shown = true;
                    self.view.line(&table_header(run.staleness.is_some()));
                }
                self.view.line(&table_row(&r, run.staleness.is_some()));
                self.reports.push(r);
            }
        }
    }

    /// A cluster's generation was replaced within a round: elastic mode's survivors
    /// regrouped without a lost node.
    fn regrouped(&mut self, run: &RunSpec, v: &ClusterView) {
        let dropped: Vec<String> = (0..run.nodes)
            .filter(|r| !v.members.contains(r))
            .map(|r| format!("rank {r}"))
            .collect();
        let members: Vec<String> = v.members.iter().map(|r| format!("rank {r}")).collect();
        self.view.line(&format!(
            ">> generation {}: {} regrouped without {} (rank {} coordinates)",
            v.gen,
            members.join(", "),
            if dropped.is_empty() {
                "anyone".to_string()
            } else {
                dropped.join(", ")
            },
            v.coordinator
        ));
    }

    /// After a round that did not end well: what each node that failed said, in turn.
    fn explain_exits(&mut self, nodes: &[NodeProc], killed: Option<u32>) {
        self.say("");
        for n in nodes {
            if n.code == Some(exit::DONE) {
                continue;
            }
            if killed == Some(n.lane.rank) && n.lane.cluster.is_none() {
                self.say(&format!(
                    "rank {} (killed by the demo): exit {}",
                    n.lane.rank,
                    n.code.unwrap_or(-1)
                ));
                continue;
            }
            self.say(&format!("{} said ({}):", n.lane.label(), n.log.display()));
            for l in failure_lines(n) {
                self.say(&format!("    {l}"));
            }
        }
    }

    /// One line per node, the clusters of a pipelined run side by side (stacked when the
    /// terminal is too narrow), and a compact form for output that is not a terminal.
    fn live_block(
        &self,
        clusters: &[Option<&'static str>],
        views: &[Option<ClusterView>],
        nodes: &[NodeProc],
    ) -> (Vec<String>, String) {
        let total = self.plan.iterations;
        let mut columns: Vec<Vec<String>> = Vec::new();
        let mut compact = Vec::new();
        for (c, view) in clusters.iter().zip(views) {
            let mut column = Vec::new();
            let mut parts = Vec::new();
            if let Some(name) = c {
                column.push(format!(
                    "  {name} cluster ({} node(s))",
                    nodes.iter().filter(|n| n.lane.cluster == *c).count()
                ));
            }
            for n in nodes.iter().filter(|n| n.lane.cluster == *c) {
                let rec = view
                    .as_ref()
                    .and_then(|v| v.ranks.get(n.lane.rank as usize))
                    .and_then(|r| r.as_ref());
                let (iteration, phase, state) = match rec {
                    Some(r) => (
                        r.iteration,
                        r.phase
                            .map(|p| p.to_string())
                            .unwrap_or_else(|| "joining".into()),
                        format!("{:?}", r.state).to_lowercase(),
                    ),
                    None => (0, "starting".into(), "starting".into()),
                };
                let state = match n.code {
                    Some(code) => format!("exited {code}"),
                    None => state,
                };
                // The update cluster has no server to stop: in that phase it waits for
                // the rollout cluster's trajectories.
                let phase = if *c == Some("update") && phase_name(&phase) == "stop-server" {
                    phase.replace("stop-server", "awaiting rollout")
                } else {
                    phase
                };
                let num = phase_number(&phase).map(|x| x as usize + 1).unwrap_or(0);
                let done_frac = if total == 0 {
                    0.0
                } else {
                    ((iteration.max(1) - 1) as f64 * 14.0 + num as f64) / (total as f64 * 14.0)
                };
                let name = match c {
                    None => format!("rank {:<2}", n.lane.rank),
                    Some(_) => format!("r{:<2}", n.lane.rank),
                };
                column.push(if c.is_none() {
                    format!(
                        "  {name} iteration {:>2}/{total} [{}] {:<20} {}",
                        iteration,
                        bar(done_frac, 16),
                        phase,
                        state
                    )
                } else {
                    format!(
                        "  {name} it {:>2}/{total} [{}] {:<20} {:<8}",
                        iteration,
                        bar(done_frac, 8),
                        phase,
                        state
                    )
                });
                parts.push(format!(
                    "r{} it{} {}",
                    n.lane.rank,
                    iteration,
                    if n.code.is_some() {
                        state.clone()
                    } else {
                        phase_name(&phase).to_string()
                    }
                ));
            }
            compact.push(match c {
                None => parts.join(" | "),
                Some(name) => format!("{name}: {}", parts.join(", ")),
            });
            columns.push(column);
        }
        let width = columns
            .iter()
            .flatten()
            .map(|l| l.chars().count())
            .max()
            .unwrap_or(0);
        let mut block = Vec::new();
        if columns.len() > 1 && (width + 2) * columns.len() <= terminal_width() {
            let rows = columns.iter().map(Vec::len).max().unwrap_or(0);
            for i in 0..rows {
                let mut line = String::new();
                for (j, col) in columns.iter().enumerate() {
                    let cell = col.get(i).map(String::as_str).unwrap_or("");
                    if j + 1 < columns.len() {
                        line.push_str(&format!("{cell:<w$}  ", w = width));
                    } else {
                        line.push_str(cell);
                    }
                }
                block.push(line.trim_end().to_string());
            }
        } else {
            block.extend(columns.into_iter().flatten());
        }
        for (c, v) in clusters.iter().zip(views) {
            if let Some(a) = v.as_ref().and_then(|v| v.abort.as_ref()) {
                let first = a.describe();
                let first = first.lines().next().unwrap_or_default().to_string();
                let who = c.map(|c| format!(" ({c} cluster)")).unwrap_or_default();
                block.push(format!("  stopping{who}: {first}"));
                compact.push(format!("stopping{who}: {first}"));
            }
        }
        block.push(format!(
            "  elapsed {:.1}s",
            self.view.started.elapsed().as_secs_f64()
        ));
        (block, compact.join(" || "))
    }

    fn summary(&mut self, results: &[RunResult], elapsed: Duration) {
        let p = &self.plan;
        let multi = results.len() > 1 || p.runs.len() > 1;
        let mut out = Vec::new();
        for res in results {
            let last = res.rounds.last().expect("a round");
            out.push(String::new());
            out.push(format!(
                "summary{}{}:",
                if multi {
                    format!(" of the {} run", res.spec.label())
                } else {
                    String::new()
                },
                last.gen
                    .map(|g| format!(" (generation {g})"))
                    .unwrap_or_default()
            ));
            let pipelined = res.spec.staleness.is_some();
            if res.reports.is_empty() {
                out.push("  no iteration completed".into());
            } else {
                out.push(table_header(pipelined));
                for r in &res.reports {
                    out.push(table_row(r, pipelined));
                }
                if pipelined {
                    out.push(
                        "  (secs: from the previous model to this one; the columns add up to more, as the clusters overlap)"
                            .into(),
                    );
                }
                let evals: Vec<String> = res
                    .reports
                    .iter()
                    .filter_map(|r| {
                        r.eval_accuracy()
                            .map(|a| format!("{a:.2} (it {})", r.iteration))
                    })
                    .collect();
                if let Some((a, b)) = res.rewards() {
                    out.push(format!(
                        "  mean train reward {a:.3} -> {b:.3} (chance {:.3}); eval accuracy {}",
                        1.0 / p.actions as f64,
                        if evals.is_empty() {
                            "-".into()
                        } else {
                            evals.join(", ")
                        }
                    ));
                }
            }
            out.push(String::new());
            for (i, r) in res.rounds.iter().enumerate() {
                let label = if res.rounds.len() > 1 {
                    if i == 0 {
                        "first start"
                    } else {
                        "after the restart"
                    }
                } else {
                    "nodes"
                };
                let codes: Vec<String> = r
                    .codes
                    .iter()
                    .map(|(lane, c)| format!("{}: {c}", lane.label()))
                    .collect();
                out.push(format!("exit codes ({label}): {}", codes.join(", ")));
            }
            if res.rounds.len() > 1 {
                let killed = res.rounds[0].killed.unwrap_or(0);
                out.push(if res.ok(p.iterations) {
                    format!(
                        "recovered: after rank {killed} was killed with SIGKILL and the cluster stopped, one restart of all {} node(s) resumed where the journals said and completed the run through iteration {} (work committed before the crash was reused, not redone)",
                        res.spec.nodes, p.iterations
                    )
                } else {
                    "NOT recovered: the restarted cluster did not complete (see the messages above)".into()
                });
            }
            if res.elastic {
                out.extend(elastic_summary(p, res, last));
            }
        }
        if let [sync, piped] = results {
            out.push(String::new());
            out.extend(comparison(p, sync, piped));
        }
        out.push(format!("time: {:.1}s", elapsed.as_secs_f64()));
        out.push(String::new());
        let d = p.dir.display();
        out.push(format!("files, in {d}:"));
        let sub = |res: &RunSpec| -> String {
            res.dir
                .strip_prefix(&p.dir)
                .ok()
                .filter(|s| !s.as_os_str().is_empty())
                .map(|s| format!("{}/", s.display()))
                .unwrap_or_default()
        };
        for spec in &p.runs {
            let s = sub(spec);
            let logs = if spec.staleness.is_some() {
                "rollout-R.log, update-R.log"
            } else {
                "node-R.log"
            };
            for (name, what) in [
                (
                    format!("{s}rl-node.toml"),
                    "the configuration every node ran with",
                ),
                (format!("{s}{logs}"), "each node's own output"),
                (
                    format!("{s}shared/rollouts/iter-NNNN/"),
                    "train.jsonl (and eval.jsonl) of each iteration",
                ),
                (
                    format!("{s}shared/logs/iter-NNNN/"),
                    "each command's output, rank-R.<phase>.log",
                ),
                (
                    format!("{s}shared/models/"),
                    "the checkpoint each iteration handed off, and LATEST",
                ),
            ] {
                out.push(format!("  {name:<38} {what}"));
            }
            if spec.staleness.is_none() {
                out.push(format!(
                    "  rl-node status --log-path {}",
                    spec.shared.display()
                ));
            }
        }
        // The timeline of each run that started (open it in a browser).
        for spec in &p.runs {
            if !spec.shared.join(".rl-node").exists() {
                continue;
            }
            out.push(match write_timeline(&spec.shared) {
                Ok(path) => format!("timeline: {}", path.display()),
                Err(e) => format!("timeline: not written: {e}"),
            });
        }
        for l in out {
            self.view.line(&l);
        }
    }
}

/// Elastic mode's end of a run's summary: what moved, as the event logs say, and whether
/// the survivors went on to the end.
fn elastic_summary(p: &Plan, res: &RunResult, last: &Round) -> Vec<String> {
    let logs = super::moved::read_all(&res.spec.shared, res.spec.nodes);
    let moved = super::moved::what_moved(&logs, last.killed_wall, p.dead_after());
    let mut out = Vec::new();
    if moved.is_empty() && last.killed.is_none() {
        return out;
    }
    out.push(String::new());
    if moved.is_empty() {
        out.push("what moved: nothing (no node was found lost)".into());
    }
    out.extend(moved);
    if let Some(killed) = last.killed {
        let others = res.spec.nodes - 1;
        out.push(if res.ok(p.iterations) {
            format!(
                "went on: after rank {killed} was killed with SIGKILL, the other {others} node(s) regrouped without it and completed every iteration through {} without a restart",
                p.iterations
            )
        } else {
            format!(
                "did NOT go on: after rank {killed} was killed, the other {others} node(s) did not complete the run (see the messages above)"
            )
        });
    }
    out
}

/// Draw the run in `shared` into `shared/timeline.html` (as `rl-node timeline` does).
fn write_timeline(shared: &Path) -> Result<PathBuf, String> {
    let (page, _) = crate::observe::timeline::render_run(shared, None, None, None)?;
    let path = shared.join("timeline.html");
    crate::store::fs::publish(&path, page.as_bytes())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// Seconds from the previous model (or the run's first phase) to iteration `it`'s model.
fn iteration_interval(
    clusters: &[(&[progress::Event], u64)],
    last: &[progress::Event],
    gen: u64,
    it: u64,
) -> Option<f64> {
    let (_, ends) = progress::iteration_ends(last, gen);
    let end = ends.iter().find(|(i, _)| *i == it)?.1;
    let before = ends
        .iter()
        .filter(|(i, _)| *i < it)
        .map(|(_, t)| *t)
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))));
    let start = before.or_else(|| {
        clusters
            .iter()
            .filter_map(|(e, g)| progress::iteration_ends(e, *g).0)
            .reduce(f64::min)
    })?;
    Some((end - start).max(0.0))
}

/// A run's makespan from its event logs: from the first phase any cluster's rank 0
/// entered to the end of the last iteration, in the clusters' newest generations.
fn makespan(run: &RunSpec) -> Option<f64> {
    let mut start: Option<f64> = None;
    let mut end: Option<f64> = None;
    for c in run.clusters() {
        let gen = cluster_view(&run.shared, c)?.gen;
        let events = progress::read_cluster_events(&run.shared, c, 0);
        let (s, ends) = progress::iteration_ends(&events, gen);
        start = match (start, s) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(t) = ends.iter().map(|(_, t)| *t).reduce(f64::max) {
            end = Some(end.map_or(t, |e: f64| e.max(t)));
        }
    }
    Some(end? - start?)
}

/// The lines comparing the synchronous run with the pipelined one.
fn comparison(p: &Plan, sync: &RunResult, piped: &RunResult) -> Vec<String> {
    let mut out = Vec::new();
    let k = piped.spec.staleness.unwrap_or(0);
    let n = p.iterations as f64;
    match (sync.makespan, piped.makespan) {
        (Some(a), Some(b)) if a > 0.0 => out.push(format!(
            "time per iteration: pipelined {:.2}s vs synchronous {:.2}s: ratio {:.2} (pipelined / synchronous; {} + {} nodes vs {} nodes, {} iterations, pace {}s)",
            b / n,
            a / n,
            b / a,
            piped.spec.nodes,
            piped.spec.nodes,
            sync.spec.nodes,
            p.iterations,
            p.pace
        )),
        _ => out.push("time per iteration: not measured (a run did not complete)".into()),
    }
    let versions: Vec<String> = piped
        .reports
        .iter()
        .map(|r| {
            r.model_version
                .map(|v| format!("{}:v{v}", r.iteration))
                .unwrap_or_else(|| format!("{}:?", r.iteration))
        })
        .collect();
    out.push(format!(
        "model each pipelined iteration was rolled out with (iteration:version, from its trajectories): {}",
        versions.join(" ")
    ));
    if let (Some((s0, s1)), Some((p0, p1))) = (sync.rewards(), piped.rewards()) {
        let rises = p1 > p0 + 0.05;
        out.push(format!(
            "learning from stale data: the pipelined run's mean train reward went {p0:.3} -> {p1:.3} (synchronous {s0:.3} -> {s1:.3}): {}",
            if rises {
                format!("it still rises with rollouts up to {k} model version(s) behind")
            } else {
                format!("it did NOT rise with rollouts {k} model version(s) behind")
            }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_are_refused_naming_the_flag() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            demo: DemoArgs,
        }
        let sizes = |flags: &[&str]| {
            let cli =
                Cli::try_parse_from(std::iter::once("demo").chain(flags.iter().copied())).unwrap();
            check_sizes(&cli.demo, 8, 2)
        };
        assert_eq!(sizes(&[]), Ok(()));
        let e = sizes(&["--samples", "4294967295"]).unwrap_err();
        assert_eq!(e, "--samples 4294967295: the demo takes 1 to 1000");
        let e = sizes(&["--tasks", "100000", "--actions", "1000"]).unwrap_err();
        assert!(e.starts_with("--tasks × --actions is 100000000"), "{e}");
        assert!(sizes(&["--pipeline", "--staleness", "101"]).is_err());
        assert!(check_sizes(
            &Cli::try_parse_from(["demo"]).unwrap().demo,
            100_000_000_000,
            2
        )
        .is_err());
    }

    /// `--min-nodes` without sense is refused naming the flag, before anything is written.
    #[test]
    fn min_nodes_out_of_range_or_with_pipeline_is_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            demo: DemoArgs,
        }
        let refused = |flags: &[&str]| {
            let cli =
                Cli::try_parse_from(std::iter::once("demo").chain(flags.iter().copied())).unwrap();
            match plan(cli.demo, Globals::default()) {
                Ok(_) => panic!("{flags:?} was accepted"),
                Err(e) => e,
            }
        };
        for (flags, says) in [
            (&["--min-nodes", "3"][..], "--min-nodes 3: "),
            (&["--min-nodes", "0"][..], "K must be 1 to 2"),
            (
                &["--nodes", "5", "--min-nodes", "7"][..],
                "K must be 1 to 4",
            ),
            (
                &["--nodes", "1", "--min-nodes", "1"][..],
                "at least 2 nodes",
            ),
            (
                &["--pipeline", "--min-nodes", "1"][..],
                "--min-nodes is not available with --pipeline",
            ),
        ] {
            let e = refused(flags);
            assert!(
                e.contains(says) && e.contains("--min-nodes"),
                "{flags:?}: {e}"
            );
        }
    }

    #[test]
    fn kill_spec() {
        assert_eq!(parse_kill("1@training", 3).unwrap(), (1, "training"));
        assert_eq!(parse_kill("0@10", 3).unwrap(), (0, "training"));
        assert_eq!(parse_kill("2@rollout", 3).unwrap(), (2, "train-rollout"));
        assert!(parse_kill("3@training", 3).is_err());
        assert!(parse_kill("1@trianing", 3)
            .unwrap_err()
            .contains("unknown phase"));
        assert!(parse_kill("1", 3).is_err());
    }

    #[test]
    fn command_words_survive_shell_and_placeholders() {
        assert_eq!(command_word("/a b/x"), "'/a b/x'");
        assert_eq!(command_word("/a'{b}"), r"'/a'\''{{b}}'");
    }

    #[test]
    fn the_config_loads() {
        let dir = std::env::temp_dir().join(format!("demo-config-{}", std::process::id()));
        let run = RunSpec {
            staleness: None,
            shared: dir.join("shared"),
            config: dir.join("rl-node.toml"),
            dir: dir.clone(),
            nodes: 3,
            weights: vec![2, 1, 1],
            master_port: 29511,
            server_ports: vec![20001, 20002, 20003],
        };
        let plan = Plan {
            nodes: 3,
            iterations: 8,
            eval_interval: 2,
            seed: 1,
            tasks: 32,
            actions: 4,
            samples: 4,
            lr: 4.0,
            pace: 0.0,
            kill: None,
            min_nodes: None,
            dir: dir.clone(),
            exe: PathBuf::from("/opt/my bin/rl-node"),
            runs: vec![run.clone()],
        };
        fs::create_dir_all(&dir).unwrap();
        fs::write(&run.config, config_toml(&plan, &run)).unwrap();
        let loaded = crate::config::load(
            Some(&run.config),
            &|n: &str| (n == "RL_NODE_SERVER_PORT").then(|| "20002".to_string()),
            &[],
        )
        .unwrap();
        assert_eq!(loaded.config.cluster.num_nodes, 3);
        assert_eq!(loaded.config.server.port, 20002);
        assert!(loaded
            .config
            .phases
            .rollout
            .command
            .contains("'/opt/my bin/rl-node' __toy rollout"));
        assert_eq!(loaded.config.staleness(), None);
        assert!(!loaded.config.elastic());
        assert_eq!(
            loaded.config.timing.dead_after,
            Duration::from_secs(DEAD_AFTER_SECS)
        );

        // Elastic mode: min-nodes, and a shorter dead-after.
        let elastic = Plan {
            min_nodes: Some(2),
            ..plan
        };
        fs::write(&run.config, config_toml(&elastic, &run)).unwrap();
        let loaded = crate::config::load(Some(&run.config), &|_: &str| None, &[]).unwrap();
        assert_eq!(loaded.config.cluster.min_nodes, 2);
        assert!(loaded.config.elastic());
        assert_eq!(
            loaded.config.timing.dead_after,
            Duration::from_secs(ELASTIC_DEAD_AFTER_SECS)
        );
        let plan = Plan {
            min_nodes: None,
            ..elastic
        };

        // The pipelined run's: 2 nodes per cluster, staleness 1.
        let piped = RunSpec {
            staleness: Some(1),
            nodes: 2,
            weights: vec![2, 1],
            server_ports: vec![20004, 20005],
            ..run
        };
        fs::write(&piped.config, config_toml(&plan, &piped)).unwrap();
        let loaded = crate::config::load(
            Some(&piped.config),
            &|n: &str| (n == "RL_NODE_CLUSTER_RL_PHASE").then(|| "rollout".to_string()),
            &[],
        )
        .unwrap();
        assert_eq!(loaded.config.staleness(), Some(1));
        assert_eq!(loaded.config.cluster.num_nodes, 2);
        assert_eq!(loaded.config.server.port, 20004);
        assert_eq!(
            piped
                .lanes()
                .iter()
                .map(|l| piped.server_port(*l))
                .collect::<Vec<_>>(),
            [Some(20004), Some(20005), None, None]
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
