//! The demo driver: write the configuration, start the nodes, show them working, report.

use super::progress::{self, IterationReport};
use super::toy;
use super::DemoArgs;
use crate::error::Failure;
use crate::exit;
use crate::observe::status::{self, Status};
use crate::protocol::phase::{eval_due, ALL as PHASES};
use crate::protocol::NodeState;
use std::fs;
use std::io::{self, Read, Seek, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
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

struct Plan {
    nodes: u32,
    iterations: u64,
    eval_interval: u64,
    seed: u64,
    weights: Vec<u64>,
    tasks: u32,
    actions: u32,
    samples: u32,
    lr: f64,
    pace: f64,
    kill: Option<(u32, &'static str)>,
    dir: PathBuf,
    shared: PathBuf,
    config: PathBuf,
    exe: PathBuf,
    master_port: u16,
    server_ports: Vec<u16>,
}

pub fn main(args: DemoArgs, globals: Globals) -> Result<i32, Failure> {
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
    let p = p.trim();
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
    let nodes = args.nodes;
    if !(1..=32).contains(&nodes) {
        return Err(format!("--nodes {nodes}: the demo runs 1 to 32 nodes"));
    }
    if iterations == 0 {
        return Err("--iterations 0: the demo needs at least one iteration".into());
    }
    if args.tasks == 0 || args.actions < 2 || args.samples == 0 {
        return Err("need --tasks ≥ 1, --actions ≥ 2 and --samples ≥ 1".into());
    }
    if !(args.pace.is_finite() && (0.0..=60.0).contains(&args.pace)) {
        return Err(format!("--pace {}: must be 0 to 60 seconds", args.pace));
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
        // Like the README's example: rank 0 takes twice the share of the others.
        None if nodes > 1 => (0..nodes).map(|r| if r == 0 { 2 } else { 1 }).collect(),
        None => vec![1],
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
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
    let dir = match args.dir {
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
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(Plan {
        nodes,
        iterations,
        eval_interval,
        seed: args.seed,
        weights,
        tasks: args.tasks,
        actions: args.actions,
        samples: args.samples,
        lr: args.lr,
        pace: args.pace,
        kill,
        shared: dir.join("shared"),
        config: dir.join("rl-node.toml"),
        dir,
        exe,
        master_port: 0,
        server_ports: Vec::new(),
    })
}

// ------------------------------------------------------------------ set-up

/// Ports below the kernel's ephemeral range, so no outgoing connection (rollouts, the
/// all-reduce) can be holding one when a server restarts on it; falls back to ports the
/// kernel picks.
fn free_ports(n: usize) -> io::Result<Vec<u16>> {
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
    format!("'{}'", s.replace('\'', r"'\''"))
        .replace('{', "{{")
        .replace('}', "}}")
}

/// A TOML basic string (JSON's escapes are valid TOML).
fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("string")
}

fn config_toml(p: &Plan) -> String {
    let exe = command_word(&p.exe.display().to_string());
    let pace = if p.pace > 0.0 {
        format!(" --min-secs {}", p.pace)
    } else {
        String::new()
    };
    let rollout = format!(
        "{exe} __toy rollout --server http://127.0.0.1:{{server_port}} --split {{split}} --rank {{rank}} \
         --num-nodes {{num_nodes}} --rank-weights {{rank_weights}} --iteration {{iteration}} \
         --seed {} --samples {} --tasks {} --out {{output}}{pace}",
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
    let weights: Vec<String> = p.weights.iter().map(|w| w.to_string()).collect();
    format!(
        r#"# Written by `rl-node demo`: {nodes} node(s) on this machine running the built-in toy
# workload (a {tasks}-task, {actions}-action contextual bandit learned with REINFORCE).
# Each node gets its own inference-server port through RL_NODE_SERVER_PORT
# (the environment overrides server.port below, which is rank 0's).

[cluster]
num-nodes = {nodes}
rank-weights = [{weights}]
eval-interval = {eval_interval}
iterations = {iterations}
master-addr = "127.0.0.1"
master-port = {master_port}
model = {model}

[timing]
heartbeat-interval = "500ms"
dead-after = "5s"
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

[server]
command = {server}
port = {port0}
health-url = "http://127.0.0.1:{{server_port}}/health"
start-timeout = "30s"
stop-grace = "2s"
gpu-drain-mib = 0
"#,
        nodes = p.nodes,
        tasks = p.tasks,
        actions = p.actions,
        weights = weights.join(", "),
        eval_interval = p.eval_interval,
        iterations = p.iterations,
        master_port = p.master_port,
        model = toml_str(&p.dir.join("model-0").display().to_string()),
        rollout = toml_str(&rollout),
        train = toml_str(&train),
        server = toml_str(&server),
        port0 = p.server_ports[0],
    )
}

fn prepare(p: &mut Plan) -> Result<(), String> {
    let ports =
        free_ports(p.nodes as usize + 1).map_err(|e| format!("cannot find free ports: {e}"))?;
    p.master_port = ports[0];
    p.server_ports = ports[1..].to_vec();
    let model = p.dir.join("model-0");
    toy::Policy::uniform(p.tasks, p.actions)
        .save(&model)
        .map_err(|e| format!("cannot write the initial model in {}: {e}", model.display()))?;
    fs::write(&p.config, config_toml(p))
        .map_err(|e| format!("cannot write {}: {e}", p.config.display()))?;
    Ok(())
}

// ------------------------------------------------------------------ nodes

struct NodeProc {
    rank: u32,
    child: Child,
    code: Option<i32>,
    log: PathBuf,
    /// Where this start's output begins in `log`.
    offset: u64,
}

fn spawn_node(p: &Plan, rank: u32) -> io::Result<NodeProc> {
    let log = p.dir.join(format!("node-{rank}.log"));
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
        .arg(&p.config)
        .arg("--log-path")
        .arg(&p.shared);
    // The demo's configuration is the file; nothing from this shell leaks in.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("RL_NODE_") {
            cmd.env_remove(&k);
        }
    }
    cmd.env(
        "RL_NODE_SERVER_PORT",
        p.server_ports[rank as usize].to_string(),
    )
    .stdin(Stdio::null())
    .stdout(f.try_clone()?)
    .stderr(f)
    // Own process group: Ctrl-C reaches the demo, which forwards it once.
    .process_group(0);
    // SAFETY: the closure runs in the forked child before exec and makes one prctl system
    // call, which is async-signal-safe (it neither allocates nor locks).
    unsafe {
        cmd.pre_exec(|| {
            // If the demo dies, its nodes stop too.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    Ok(NodeProc {
        rank,
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
            tty: unsafe { libc::isatty(1) == 1 },
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
        let _ = writeln!(out, "{s}");
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
                let cut: String = l.chars().take(width).collect();
                let _ = writeln!(out, "{cut}");
            }
            self.drawn = block.len();
        } else if compact != self.last_compact {
            let _ = writeln!(
                out,
                "  [{:6.1}s] {compact}",
                self.started.elapsed().as_secs_f64()
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
    // SAFETY: winsize is four u16s, for which all zero bytes is a valid value.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes a winsize into `ws`, a live local of that type.
    if unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_col > 0 {
        ws.ws_col as usize
    } else {
        80
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

fn table_header() -> String {
    let mut s = format!(
        "  {:>4}  {:>6} {:<10}  {:>5}  {:>6}  ",
        "iter", "reward", "", "eval", "secs"
    );
    for g in progress::GROUPS {
        s.push_str(&format!("{g:>8}"));
    }
    s
}

fn table_row(r: &IterationReport) -> String {
    let mut s = format!(
        "  {:>4}  {} {:<10}  {}  {}  ",
        r.iteration,
        fmt_opt(r.mean_reward, 6, 3),
        r.mean_reward.map(|m| bar(m, 10)).unwrap_or_default(),
        fmt_opt(r.eval_accuracy(), 5, 2),
        fmt_opt(r.secs, 6, 2),
    );
    for (_, secs) in &r.groups {
        s.push_str(&format!("{secs:>8.2}"));
    }
    s
}

// ------------------------------------------------------------------ the run

/// How one start of the cluster ended.
struct Round {
    gen: Option<u64>,
    codes: Vec<i32>,
    killed: Option<u32>,
    interrupted: bool,
}

struct Demo {
    plan: Plan,
    view: View,
    signals: Arc<AtomicUsize>,
    last_signal: Arc<AtomicUsize>,
    /// Per-iteration reports of the current generation, as they complete.
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
        let weights: Vec<String> = p.weights.iter().map(|w| w.to_string()).collect();
        let lines = vec![
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
            format!(
                "  config: {}   node output: {}",
                p.config.display(),
                p.dir.join("node-R.log").display()
            ),
            format!(
                "  ports: training rendezvous {}, inference servers {}",
                p.master_port,
                p.server_ports
                    .iter()
                    .enumerate()
                    .map(|(r, port)| format!("{port} (rank {r})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ];
        let mut lines = lines;
        lines.push(if p.pace > 0.0 {
            format!(
                "  pace: every rollout, eval and training command takes at least {}s",
                p.pace
            )
        } else {
            "  (the toy runs an iteration in about 0.1s: add --pace 0.5 to watch each phase go by)"
                .into()
        });
        if let Some((r, ph)) = p.kill {
            lines.push(format!(
                "  --kill-node: rank {r} gets SIGKILL when it reaches phase `{ph}` in iteration {KILL_ITERATION}; then every node is restarted once"
            ));
        }
        lines.push(String::new());
        for l in lines {
            self.say(&l);
        }
    }

    fn run(mut self) -> Result<i32, String> {
        let started = Instant::now();
        self.intro();
        let first = self.round(self.plan.kill, None)?;
        let mut rounds = vec![first];
        let first = &rounds[0];
        if first.killed.is_some() && !first.interrupted {
            let gen = first.gen;
            self.restart_pause();
            let second = self.round(None, gen)?;
            rounds.push(second);
        }
        self.view.end_live();
        self.summary(&rounds, started.elapsed());
        let last = rounds.last().expect("one round");
        if last.interrupted {
            return Ok(exit::SIGINT);
        }
        Ok(if last.codes.iter().all(|&c| c == exit::DONE) {
            exit::DONE
        } else {
            exit::FAILED
        })
    }

    /// Before restarting, let the ports of the old servers and trainers go.
    fn restart_pause(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut ports = self.plan.server_ports.clone();
        ports.push(self.plan.master_port);
        for port in ports {
            while TcpListener::bind(("127.0.0.1", port)).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let n = self.plan.nodes;
        self.say("");
        self.say(&format!(
            ">> restarting all {n} node(s) with the same commands over the same shared directory: a new generation (the earlier one's records are ignored)"
        ));
    }

    /// Start every node, watch them until all have exited. `kill`: kill -9 that rank when
    /// it reaches that phase in iteration 2. `prev_gen`: the generation of an earlier start.
    fn round(
        &mut self,
        kill: Option<(u32, &'static str)>,
        prev_gen: Option<u64>,
    ) -> Result<Round, String> {
        let mut nodes = Vec::new();
        for r in 0..self.plan.nodes {
            match spawn_node(&self.plan, r) {
                Ok(n) => nodes.push(n),
                Err(e) => {
                    for n in &mut nodes {
                        let _ = n.child.kill();
                        let _ = n.child.wait();
                    }
                    return Err(format!(
                        "cannot start node {r} ({}): {e}",
                        self.plan.exe.display()
                    ));
                }
            }
        }
        let pids: Vec<String> = nodes
            .iter()
            .map(|n| format!("rank {} pid {}", n.rank, n.child.id()))
            .collect();
        self.say(&format!(
            "started {} node(s): {}",
            nodes.len(),
            pids.join(", ")
        ));
        self.reports.clear();
        self.header_shown = false;

        let mut kill = kill;
        let mut killed = None;
        let mut killed_at: Option<Instant> = None;
        let mut forwarded = 0;
        let mut interrupted = false;
        let mut gen = None;
        let mut shown: Vec<u64> = Vec::new();
        let mut last_render = Instant::now() - REFRESH;
        loop {
            // Ctrl-C / SIGTERM: pass each one on to the nodes (a second one makes them
            // kill their commands at once).
            let count = self.signals.load(Ordering::SeqCst);
            if count > forwarded {
                forwarded = count;
                interrupted = true;
                let sig = self.last_signal.load(Ordering::SeqCst) as i32;
                for n in nodes.iter().filter(|n| n.code.is_none()) {
                    // SAFETY: kill takes only integers; the child is not reaped yet (no
                    // exit code), so the pid is still its own.
                    unsafe { libc::kill(n.child.id() as i32, sig) };
                }
                self.say(&format!(
                    ">> {}: stopping the nodes",
                    crate::node::procs::signal_name(sig)
                ));
            }
            for n in nodes.iter_mut().filter(|n| n.code.is_none()) {
                if let Ok(Some(st)) = n.child.try_wait() {
                    let code = exit_code(st);
                    n.code = Some(code);
                    let msg = format!(
                        "rank {} exited with code {code} ({})",
                        n.rank,
                        describe_code(code)
                    );
                    if code != exit::DONE || killed.is_some() {
                        self.view.line(&format!(">> {msg}"));
                    }
                }
            }
            let st = status::read(&self.plan.shared)
                .ok()
                .filter(|s| prev_gen.is_none_or(|g| s.gen > g));
            if let Some(s) = &st {
                gen = Some(s.gen);
            }

            if let (Some((kr, kphase)), Some(s)) = (kill, &st) {
                // Strike in the named phase of iteration 2; a phase can pass between two
                // looks, so if the rank is already beyond it, strike at once and say so.
                let target = PHASES.iter().position(|p| p.name() == kphase).unwrap_or(0) as u8;
                let now = s.ranks.get(kr as usize).filter(|r| {
                    r.state == Some(NodeState::Running)
                        && r.phase.as_deref().and_then(phase_number).is_some_and(|n| {
                            (r.iteration == KILL_ITERATION && n >= target)
                                || r.iteration > KILL_ITERATION
                        })
                });
                let node = &mut nodes[kr as usize];
                if let (Some(r), None) = (now, node.code) {
                    let pid = node.child.id();
                    let _ = node.child.kill();
                    let ph = r.phase.clone().unwrap_or_default();
                    let late = if phase_name(&ph) == kphase {
                        String::new()
                    } else {
                        format!(" (it had already left `{kphase}`)")
                    };
                    self.view.line(&format!(
                        ">> kill -9 rank {kr} (pid {pid}) in phase {ph} of iteration {}{late}; the others should notice its heartbeat stop within dead-after (5s)",
                        r.iteration
                    ));
                    kill = None;
                    killed = Some(kr);
                    killed_at = Some(Instant::now());
                }
            }
            // The survivors must stop on their own within dead-after; if they have not
            // long after that, something is wrong: stop them rather than hang.
            if killed_at.is_some_and(|t| t.elapsed() > KILL_STOP_LIMIT) {
                killed_at = None;
                let left: Vec<String> = nodes
                    .iter()
                    .filter(|n| n.code.is_none())
                    .map(|n| {
                        // SAFETY: kill takes only integers; the child is not reaped yet (no
                        // exit code), so the pid is still its own.
                        unsafe { libc::kill(n.child.id() as i32, libc::SIGTERM) };
                        format!("rank {}", n.rank)
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

            let all_done = nodes.iter().all(|n| n.code.is_some());
            if let Some(g) = gen {
                let events = progress::read_events(&self.plan.shared, 0);
                for it in progress::completed(&events, g) {
                    if !shown.contains(&it) {
                        shown.push(it);
                        let r = progress::iteration_report(&self.plan.shared, &events, g, it);
                        if !self.header_shown {
                            self.header_shown = true;
                            self.view.line(&table_header());
                        }
                        self.view.line(&table_row(&r));
                        self.reports.push(r);
                    }
                }
            }
            if all_done {
                break;
            }
            if last_render.elapsed() >= REFRESH {
                last_render = Instant::now();
                let (block, compact) = self.live_block(st.as_ref(), &nodes);
                self.view.live(&block, &compact);
            }
            std::thread::sleep(if kill.is_some() {
                KILL_POLL
            } else {
                REFRESH / 5
            });
        }
        self.view.end_live();
        let codes: Vec<i32> = nodes.iter().map(|n| n.code.unwrap_or(-1)).collect();
        if codes.iter().any(|&c| c != exit::DONE) && !interrupted {
            self.say("");
            for n in &nodes {
                if n.code == Some(exit::DONE) {
                    continue;
                }
                if killed == Some(n.rank) {
                    self.say(&format!(
                        "rank {} (killed by the demo): exit {}",
                        n.rank,
                        n.code.unwrap_or(-1)
                    ));
                    continue;
                }
                self.say(&format!("rank {} said ({}):", n.rank, n.log.display()));
                for l in failure_lines(n) {
                    self.say(&format!("    {l}"));
                }
            }
        }
        if let (Some((kr, kphase)), None, false) = (kill, killed, interrupted) {
            self.say(&format!(
                ">> --kill-node: rank {kr} never showed phase `{kphase}` in iteration {KILL_ITERATION} or later; nothing was killed"
            ));
        }
        Ok(Round {
            gen,
            codes,
            killed,
            interrupted,
        })
    }

    fn live_block(&self, st: Option<&Status>, nodes: &[NodeProc]) -> (Vec<String>, String) {
        let mut block = Vec::new();
        let mut compact = Vec::new();
        let total = self.plan.iterations;
        for n in nodes {
            let rs = st.and_then(|s| s.ranks.get(n.rank as usize));
            let (iteration, phase, state) = match rs {
                Some(r) if r.state.is_some() => (
                    r.iteration,
                    r.phase.clone().unwrap_or_else(|| "joining".into()),
                    format!("{:?}", r.state.unwrap()).to_lowercase(),
                ),
                _ => (0, "starting".into(), "starting".into()),
            };
            let state = match n.code {
                Some(c) => format!("exited {c}"),
                None => state,
            };
            let num = phase_number(&phase).map(|x| x as usize + 1).unwrap_or(0);
            let done_frac = if total == 0 {
                0.0
            } else {
                ((iteration.max(1) - 1) as f64 * 14.0 + num as f64) / (total as f64 * 14.0)
            };
            block.push(format!(
                "  rank {:<2} iteration {:>2}/{total} [{}] {:<20} {}",
                n.rank,
                iteration,
                bar(done_frac, 16),
                phase,
                state
            ));
            compact.push(format!(
                "r{} it{} {}",
                n.rank,
                iteration,
                if n.code.is_some() {
                    state.clone()
                } else {
                    phase_name(&phase).to_string()
                }
            ));
        }
        if let Some(s) = st {
            if let Some(a) = &s.abort {
                let first = a.describe();
                let first = first.lines().next().unwrap_or_default().to_string();
                block.push(format!("  stopping: {first}"));
                compact.push(format!("stopping: {first}"));
            }
        }
        block.push(format!(
            "  elapsed {:.1}s",
            self.view.started.elapsed().as_secs_f64()
        ));
        (block, compact.join(" | "))
    }

    fn summary(&mut self, rounds: &[Round], elapsed: Duration) {
        let p = &self.plan;
        let last = rounds.last().expect("a round");
        let mut out = Vec::new();
        out.push(String::new());
        out.push(format!(
            "summary{}:",
            last.gen
                .map(|g| format!(" (generation {g})"))
                .unwrap_or_default()
        ));
        if self.reports.is_empty() {
            out.push("  no iteration completed".into());
        } else {
            out.push(table_header());
            for r in &self.reports {
                out.push(table_row(r));
            }
            let first = self.reports.first().and_then(|r| r.mean_reward);
            let lastr = self.reports.last().and_then(|r| r.mean_reward);
            let evals: Vec<String> = self
                .reports
                .iter()
                .filter_map(|r| {
                    r.eval_accuracy()
                        .map(|a| format!("{a:.2} (it {})", r.iteration))
                })
                .collect();
            if let (Some(a), Some(b)) = (first, lastr) {
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
        for (i, r) in rounds.iter().enumerate() {
            let label = if rounds.len() > 1 {
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
                .enumerate()
                .map(|(rank, c)| format!("rank {rank}: {c}"))
                .collect();
            out.push(format!("exit codes ({label}): {}", codes.join(", ")));
        }
        if rounds.len() > 1 {
            let ok = last.codes.iter().all(|&c| c == exit::DONE);
            let killed = rounds[0].killed.unwrap_or(0);
            out.push(if ok {
                format!(
                    "recovered: after rank {killed} was killed with SIGKILL and the cluster stopped, one restart of all {} node(s) resumed where the journals said and completed the run through iteration {} (work committed before the crash was reused, not redone)",
                    p.nodes, p.iterations
                )
            } else {
                "NOT recovered: the restarted cluster did not complete (see the messages above)".into()
            });
        }
        out.push(format!("time: {:.1}s", elapsed.as_secs_f64()));
        out.push(String::new());
        let d = p.dir.display();
        out.push(format!("files, in {d}:"));
        for (name, what) in [
            ("rl-node.toml", "the configuration every node ran with"),
            ("node-R.log", "each node's own output"),
            (
                "shared/rollouts/iter-NNNN/",
                "train.jsonl (and eval.jsonl) of each iteration",
            ),
            (
                "shared/logs/iter-NNNN/",
                "each command's output, rank-R.<phase>.log",
            ),
            (
                "shared/models/",
                "the checkpoint each iteration handed off, and LATEST",
            ),
        ] {
            out.push(format!("  {name:<28} {what}"));
        }
        out.push(format!("  rl-node status --log-path {d}/shared"));
        for l in out {
            self.view.line(&l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_spec() {
        assert_eq!(parse_kill("1@training", 3).unwrap(), (1, "training"));
        assert_eq!(parse_kill("0@10", 3).unwrap(), (0, "training"));
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
        let plan = Plan {
            nodes: 3,
            iterations: 8,
            eval_interval: 2,
            seed: 1,
            weights: vec![2, 1, 1],
            tasks: 32,
            actions: 4,
            samples: 4,
            lr: 4.0,
            pace: 0.0,
            kill: None,
            shared: dir.join("shared"),
            config: dir.join("rl-node.toml"),
            dir: dir.clone(),
            exe: PathBuf::from("/opt/my bin/rl-node"),
            master_port: 29511,
            server_ports: vec![20001, 20002, 20003],
        };
        fs::create_dir_all(&dir).unwrap();
        fs::write(&plan.config, config_toml(&plan)).unwrap();
        let loaded = crate::config::load(
            Some(&plan.config),
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
        fs::remove_dir_all(&dir).unwrap();
    }
}
