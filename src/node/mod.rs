//! The per-node runtime: join a generation, walk the phases of each iteration in lock-step
//! with the peers, supervise commands, and stop everything with a precise message when
//! anything fails.
//!
//! One thread owns the node's state and runs every wait through [`Node::wait_for`], which
//! turns child exits, signals, helper threads' wake-ups and poll ticks into one decision:
//! the condition holds, an abort appeared, an awaited peer is dead, or the deadline
//! passed. Each round also does the wait's periodic duties (the `workers-wait-for` relay).
//! Helper threads do only what must not depend on this one: the heartbeat thread writes
//! our record, the reaper collects children, the signal thread escalates a second
//! Ctrl-C, the merge thread copies shards (and wakes the loop when done), a hang report's
//! thread collects and writes what the node's processes are doing (`forensics`), and the
//! watchdog ends the node if a filesystem call on the shared directory hangs.

mod commits;
pub(crate) mod context;
mod forensics;
mod jobs;
mod join;
use crate::metrics;
mod model;
mod numbering;
mod pipeline;
pub mod poll;
mod publisher;
mod regroup;
mod server;
mod signals;
pub mod supervisor;
mod survivors;
mod textfile;
mod watchdog;
mod work;
mod workers;

use crate::clock::{self, Clock};
use crate::config::{Config, Loaded, PhaseCommand};
use crate::events;
use crate::exercised;
use crate::exit::{self, Cause};
use crate::layout::Layout;
use crate::logging;
pub(crate) use crate::process::{self as procs, descendants, random_hex};
use crate::protocol::barrier::Progress;
use crate::protocol::commit;
use crate::protocol::fence::Site;
use crate::protocol::journal;
use crate::protocol::liveness::Stamp;
use crate::protocol::machine::{self, NodeMachine};
use crate::protocol::messages::{self as msg, Payload};
use crate::protocol::relay::Relay;
use crate::protocol::serving::Serving;
use crate::protocol::walk::{self, Barrier as WalkBarrier, IterationWalk, Split, Step, WalkConfig};
use crate::protocol::{AbortInfo, AbortKind, NodeState, Phase, RankRecord};
use crate::store::{Kind, SharedDir};
use procs::{ChildExit, Event, Registry};
use publisher::Publisher;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a node run ends when it does not finish: its cause and what to tell the user.
pub type Stop = crate::error::Failure;

/// How a node run ends when it stops for no failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every planned iteration ran.
    Completed,
    /// The run was complete up to `--iterations` already: nothing was done (exit 0).
    AlreadyComplete(crate::error::Notice),
}

/// Why a wait ended without its condition.
enum Interrupt {
    Stop(Stop),
    Deadline,
}

impl From<Stop> for Interrupt {
    fn from(s: Stop) -> Interrupt {
        Interrupt::Stop(s)
    }
}

/// How a phase command ended when it did not succeed.
#[derive(Debug, Clone, PartialEq)]
enum CommandFailure {
    /// It exited non-zero or was killed by a signal.
    Exit(ChildExit),
    /// It passed its phase timeout (and was stopped).
    TimedOut(Duration),
}

impl CommandFailure {
    fn abort_kind(&self) -> AbortKind {
        match self {
            CommandFailure::Exit(exit) => AbortKind::CommandFailed {
                exit: exit.to_string(),
            },
            CommandFailure::TimedOut(_) => AbortKind::Timeout,
        }
    }

    /// The sentence of the failure message.
    fn reason(&self, phase: &str, pc: &PhaseCommand) -> String {
        match self {
            CommandFailure::Exit(exit) => format!("the {phase} command failed with {exit}"),
            CommandFailure::TimedOut(_) => format!(
                "the {phase} command did not finish within its timeout of {} (phases.{phase}.timeout)",
                humantime::format_duration(pc.timeout)
            ),
        }
    }

    /// A few words for journals and summaries: `exit code 3`, `timed out after 10m`.
    fn short(&self) -> String {
        match self {
            CommandFailure::Exit(exit) => exit.to_string(),
            CommandFailure::TimedOut(t) => {
                format!("timed out after {}", humantime::format_duration(*t))
            }
        }
    }
}

pub struct NodeOptions {
    pub rank: u32,
    /// Where the rank came from, e.g. `--worker 2` or `SLURM_NODEID`.
    pub rank_source: String,
    pub debug_mode: bool,
    /// `--fresh`: set an existing run aside and start a new one.
    pub fresh: bool,
    /// The link to this node's supervisor, the process a launcher sees (None: this process
    /// is the one a launcher sees).
    pub supervisor: Option<Arc<supervisor::Link>>,
}

pub(crate) struct Node {
    cfg: Config,
    /// The shared directory: every operation on it goes through here (and is counted).
    store: Arc<dyn SharedDir>,
    /// The clock every deadline and liveness judgement is measured with.
    clock: Arc<dyn Clock>,
    rank: u32,
    layout: Layout,
    host: String,
    pid: u32,
    /// This process as recorded in its records (machine and start time with the pid).
    ident: crate::holder::ProcessId,
    /// Decisions broken on purpose (the simulator's own tests only).
    broken: Broken,
    /// Shared with the signal thread: decides the exit code once, whichever side stops
    /// first (`signals`).
    stopping: Arc<signals::Stopping>,
    nonce: String,
    fingerprint: String,
    events: Receiver<Event>,
    /// For the node's helper threads (the merge) to wake the wait loop when they finish.
    wake: Sender<Event>,
    /// Starts, stops and knows the node's commands.
    launcher: Arc<dyn procs::Launcher>,
    watchdog: watchdog::Watchdog,
    // Set once joined.
    publisher: Option<Publisher>,
    /// The node's coordination with its peers (watching them, barriers, aborts) and the
    /// protocol state it keeps (the generation, the walk, the journal, the model served,
    /// the relay, the hand-over), as the protocol's sans-I/O machine: this node performs
    /// what it asks (`drive_machine`).
    machine: NodeMachine,
    /// Exits reaped but not yet claimed by the wait that expects them.
    exited: HashMap<i32, ChildExit>,
    /// What the current wait is waiting for, and what sets its pace.
    waiting: poll::Waiting,
    /// The inference server, while it runs.
    server: Option<server::Server>,
    /// --debug-mode: leave the inference server alone.
    debug_mode: bool,
    /// --fresh: rank 0 sets an existing run aside; a worker waits for the new run.
    fresh: bool,
    /// Where `timing.dead-after` came from, for a node told it was declared dead.
    dead_after_source: crate::config::Source,
    /// Task files ([tasks]), loaded at start.
    tasks: work::TaskSets,
    /// Placeholder values of the running planned rollout ({tasks}, {task_id}, …).
    extra: std::collections::BTreeMap<&'static str, String>,
    /// Elastic mode: the dropped rank whose share the running command does in its place
    /// (its `{rank}`, shard and log).
    acting_for: Option<u32>,
    /// Elastic mode: the per-rank rollout command being waited for, which a regroup lets
    /// go on (and so `carried` into the next generation).
    rolling: Option<regroup::Carried>,
    /// Elastic mode: a rollout command started before the regroup, still to be waited for.
    carried: Option<regroup::Carried>,
    /// Elastic mode: the coordinator's view of dropped ranks asking to come back.
    rejoins: regroup::Rejoins,
    /// Elastic mode: `sync-start` released the members into this grown generation.
    moving_to: Option<u64>,
    /// Training processes on this node (`cluster.gpus-per-node`, counted at start).
    nproc_per_node: u32,
    /// Replacement items run for `exact-budget` in the current per-task rollout.
    replacements: Vec<String>,
    /// The current rollout's reused item processes (`phases.<phase>.reuse-processes`).
    workers: workers::Workers,
    /// This rank's event log, kept open.
    event_log: EventLog,
    /// This rank's numbers of the current iteration: rank 0's `metrics.jsonl` line, a
    /// worker's `final-sync` arrival.
    metrics: std::sync::Mutex<metrics::Collector>,
    /// Rank 0: `metrics.jsonl`, kept open.
    metrics_log: EventLog,
    /// Rank 0: the iterations `metrics.jsonl` had a line for when the node started.
    metrics_written: metrics::Written,
    /// Rank 0: the configured fields' statistics of the merged train split, computed
    /// while the iteration goes on.
    metrics_stats: Option<(
        crate::clock::Thread,
        std::sync::mpsc::Receiver<metrics::FieldStats>,
    )>,
    /// `[observe] prometheus-textfile`, when set (not in the simulator).
    textfile: std::sync::Mutex<Option<textfile::Textfile>>,
    /// Hang reports: when they are due, and their threads (`forensics`).
    hang: forensics::Reporter,
}

/// A log in the shared directory written through one open handle: one `write` per line,
/// no open, no directory creation (docs/shared-directory.md, "Durability": logs are not
/// synced). Reopened when the generation changes (`--fresh` may have moved the run's
/// directories aside) and after a failed write. Best effort: a log never stops the node,
/// and is never written through a planted link (one is set aside, `SharedDir::open_log`).
#[derive(Default)]
struct EventLog {
    handle: std::sync::Mutex<Option<(u64, Box<dyn std::io::Write + Send>)>>,
    /// A log refused at this name is said once, not at every line.
    refused: std::sync::atomic::AtomicBool,
}

impl EventLog {
    /// Append `line`; what the node should warn about (a planted link set aside, or a log
    /// that cannot be written safely), once.
    fn append(&self, store: &dyn SharedDir, path: &Path, gen: u64, line: &str) -> Option<String> {
        let mut handle = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        if handle.as_ref().is_some_and(|(g, _)| *g != gen) {
            *handle = None;
        }
        let mut note = None;
        if handle.is_none() {
            match store.open_log(path) {
                Ok((Some(w), said)) => {
                    *handle = Some((gen, w));
                    note = said;
                }
                // No handles here (the simulated directory): append by path.
                Ok((None, _)) => {
                    let _ = store.append(path, line.as_bytes(), false);
                    return None;
                }
                Err(e) => {
                    // Said once; another error (EIO) says nothing and silences nothing.
                    let first = crate::store::Untrusted::of(&e).is_some()
                        && !self
                            .refused
                            .swap(true, std::sync::atomic::Ordering::Relaxed);
                    return first.then(|| format!("not writing {}: {e}", path.display()));
                }
            }
        }
        if let Some((_, w)) = handle.as_mut() {
            if w.write_all(line.as_bytes()).is_err() {
                *handle = None;
            }
        }
        note
    }
}

/// Run a node until it finishes (Ok) or stops (the error says why).
pub fn run(loaded: &Loaded, opts: NodeOptions) -> Result<Outcome, Stop> {
    let cfg = loaded.config.clone();
    let num_nodes = cfg.cluster.num_nodes;
    // Setting a run aside moves the shared directories both clusters use, while the other
    // cluster may be running on them.
    if opts.fresh && cfg.staleness().is_some() {
        return Err(Stop::usage(
            "--fresh is refused in a pipelined run (pipeline.staleness is set): it would move the directories the other cluster is using",
            Some("start both clusters with a new --log-path, or stop both and move the old directory aside yourself".into()),
        ));
    }
    if opts.rank >= num_nodes {
        return Err(Stop::usage(
            format!(
                "rank {} ({}) is out of range: num-nodes is {} (from {}), so ranks are 0..={}",
                opts.rank,
                opts.rank_source,
                num_nodes,
                loaded.source_of("cluster.num-nodes"),
                num_nodes - 1
            ),
            Some("every node must be started with the same --num-nodes".into()),
        ));
    }
    if cfg.cluster.log_path.is_empty() {
        return Err(Stop::usage(
            "no shared directory: pass --log-path DIR (or set cluster.log-path)",
            None,
        ));
    }
    cfg.limits.apply();
    {
        let rank = opts.rank;
        crate::store::on_refusal(move |msg| logging::warn(rank, msg));
    }
    let layout = Layout::new(cfg.log_path())
        .with_naming(cfg.naming())
        .with_cluster(cfg.pipeline_cluster());
    preflight_log_path(&layout, opts.rank)?;
    preflight_state(&layout, opts.rank)?;
    warn_if_dead_after_below_caches(loaded, opts.rank);
    // Node-local input named on this node: discovered now, not by a command hours later.
    let data = &cfg.cluster.data_path;
    if !data.is_empty() && std::fs::metadata(data).is_err() {
        return Err(Stop::usage(
            format!(
                "--data-path {data} (cluster.data-path) does not exist on this node ({})",
                hostname()
            ),
            Some(
                "data-path is node-local: check it exists on every node, or leave it empty".into(),
            ),
        ));
    }
    let tasks = work::TaskSets::load(&cfg)?;
    let textfile = open_textfile(&cfg, opts.rank)?;
    // Before the reaper thread exists, which collects every child (nvidia-smi's too).
    let (nproc, nproc_source) = context::nproc_per_node(&cfg.cluster.gpus_per_node);

    let supervisor = opts.supervisor;
    if let Some(link) = &supervisor {
        crate::holder::set_node_process(link.parent);
        // This process is in a process group of its own, in the background of a terminal:
        // with `stty tostop`, its first line to the terminal would stop it silently.
        // SAFETY: signal() with SIG_IGN installs no handler code; the arguments are
        // integers.
        unsafe { libc::signal(libc::SIGTTOU, libc::SIG_IGN) };
    }
    // Before any thread exists, which then inherit it (`signals::block_stop_signals`).
    signals::block_stop_signals();
    let (tx, rx) = channel();
    procs::start_reaper(tx.clone());
    let registry = Registry::new();
    if let Err(e) = registry.start_guardian() {
        logging::warn(
            opts.rank,
            &format!("cannot start the guardian process ({e}); children may outlive a kill -9 of this node"),
        );
    }
    let host = hostname();
    let stopping = signals::Stopping::new(opts.rank, &host);
    signals::start_signal_thread(signals::SignalParts {
        tx: tx.clone(),
        registry: registry.clone(),
        rank: opts.rank,
        supervisor: supervisor.clone(),
        stopping: stopping.clone(),
    });
    let watchdog = watchdog::Watchdog::start(
        opts.rank,
        cfg.timing.fs_timeout,
        registry.clone(),
        supervisor,
    );

    let parts = Parts {
        store: Arc::new(crate::store::Fs),
        clock: Arc::new(crate::clock::SystemClock),
        events: rx,
        wake: tx,
        launcher: Arc::new(procs::Processes::new(registry)),
        watchdog,
        host,
        pid: crate::holder::node_process(),
        ident: crate::holder::this_process(),
        broken: Broken::default(),
        stopping: stopping.clone(),
    };
    let node = Node::assemble(cfg, layout, opts.rank, opts.debug_mode, opts.fresh, parts);
    *node.textfile.lock().unwrap_or_else(|e| e.into_inner()) = textfile;
    let result = drive(
        node,
        loaded,
        &opts.rank_source,
        tasks,
        (nproc, nproc_source),
    );
    stopping.loop_done();
    result
}

/// `[observe] prometheus-textfile` for rank `rank`, written once now so that a path this
/// node cannot write is refused (exit 2) before it joins anything.
fn open_textfile(cfg: &Config, rank: u32) -> Result<Option<textfile::Textfile>, Stop> {
    let text = &cfg.observe.prometheus_textfile;
    if text.trim().is_empty() {
        return Ok(None);
    }
    let template = cfg.template(text).clone();
    let job = context::batch_job();
    if job.is_none() && template.names().contains(&"job") {
        return Err(Stop::usage(
            format!("observe.prometheus-textfile: {{job}} in {text:?} is the batch job's id, and SLURM_JOB_ID is not set"),
            Some("use {job} only in jobs of a batch system, or name the file with {rank} and {run_id}".into()),
        ));
    }
    let values = {
        let job = job.clone().unwrap_or_default();
        move |run_id: &str| {
            std::collections::BTreeMap::from([
                ("rank", rank.to_string()),
                ("job", job.clone()),
                ("run_id", run_id.to_string()),
            ])
        }
    };
    // A name with {run_id} is known only once the node has joined its run.
    let now = (!template.names().contains(&"run_id"))
        .then(|| PathBuf::from(template.render_raw(&values(""))));
    let path_of_run: textfile::PathOf =
        Box::new(move |run_id| PathBuf::from(template.render_raw(&values(run_id))));
    let labels = textfile::Labels {
        cluster: cfg.pipeline_cluster().map(str::to_string),
        job,
        run_id: None,
        started: textfile::unix_now(),
    };
    let nodes = cfg.cluster.num_nodes;
    textfile::Textfile::open(now, path_of_run, rank, &labels, &hostname(), nodes)
        .map(Some)
        .map_err(|e| {
            Stop::usage(
                format!("observe.prometheus-textfile: {}", e.0),
                Some("the file is node-local: its directory must exist and be writable on every node (node_exporter's --collector.textfile.directory), or set prometheus-textfile = \"\"".into()),
            )
        })
}

/// Run rank `rank` of the configuration in the file `config` inside this process, on
/// `store` and `clock`: the node's own driver (the join, the walk of every iteration, its
/// barriers, watching peers, aborts, journals, the shut-down) without its process's
/// plumbing (no supervisor, reaper, signal handling, guardian or watchdog). For the
/// simulator (`tests/sim/driver.rs`), which runs a cluster of them on one simulated shared
/// directory. Commands start no process: `commands` scripts what each does
/// ([`procs::FakeLauncher`]), and may write their outputs through `store`. Rollouts, evals
/// and the prepare command run with their shards committed and merged (JSONL, the built-in
/// merge) on `store`; what still reads or writes outside it is refused
/// ([`in_process_refusal`]). `Err` is the exit code and the message.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn run_in_process(
    config: &Path,
    rank: u32,
    store: Arc<dyn SharedDir>,
    clock: Arc<dyn Clock>,
    commands: Arc<procs::FakeScript>,
) -> Result<Outcome, (i32, String)> {
    run_in_process_broken(config, rank, store, clock, commands, Broken::default())
}

/// Deliberately broken decisions of the protocol core, for showing that the simulator
/// catches them in the node's own driver. Set only by `run_in_process_broken` (`sim`
/// feature); without the feature the core ignores them ([`crate::protocol::mutation`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Broken {
    /// The fence before each commit ([`crate::protocol::fence`]).
    pub fence: Option<crate::protocol::fence::Mutation>,
    /// Every barrier's decisions ([`crate::protocol::barrier`]).
    pub barrier: Option<crate::protocol::barrier::Mutation>,
    /// The pipelined rollout gate ([`crate::protocol::pipeline`]).
    pub pipeline: Option<crate::protocol::pipeline::Mutation>,
    /// A worker's look for a generation to join ([`crate::protocol::join::look_with`]).
    pub join: Option<crate::protocol::join::Mutation>,
    /// The built-in merge ([`crate::aggregate::merge`]).
    pub merge: Option<crate::aggregate::Mutation>,
    /// The checkpoint hand-off ([`crate::checkpoint::publish_opts`]).
    pub checkpoint: Option<crate::checkpoint::Mutation>,
    /// The journal: where a restarted rank resumes in it ([`journal::Book`]), when it is
    /// written and how its torn tail is handled.
    pub journal: Option<crate::protocol::journal::Mutation>,
    /// Whether an abort read in another rank's record is adopted and relayed
    /// ([`crate::protocol::abort::adopted`]).
    pub abort: Option<crate::protocol::abort::Mutation>,
    /// The procedure of every commit of a command's output ([`commit::CommitMachine`]).
    pub commit: Option<commit::Mutation>,
    /// The one liveness judgement: of the peers, and of the other cluster's rank 0 in a
    /// pipelined run ([`crate::protocol::liveness`]).
    pub liveness: Option<crate::protocol::liveness::Mutation>,
}

/// How an in-process node is started besides its configuration: what the command line
/// would say (`--fresh`), and the decisions broken on purpose.
#[cfg(feature = "sim")]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InProcess {
    /// `--fresh`, as srun gives it to every node.
    pub fresh: bool,
    pub broken: Broken,
}

/// [`run_in_process`] with some of the core's decisions broken on purpose.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn run_in_process_broken(
    config: &Path,
    rank: u32,
    store: Arc<dyn SharedDir>,
    clock: Arc<dyn Clock>,
    commands: Arc<procs::FakeScript>,
    broken: Broken,
) -> Result<Outcome, (i32, String)> {
    let start = InProcess {
        broken,
        ..InProcess::default()
    };
    run_in_process_with(config, rank, store, clock, commands, start)
}

/// [`run_in_process`] started as `start` says (`--fresh`, broken decisions).
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn run_in_process_with(
    config: &Path,
    rank: u32,
    store: Arc<dyn SharedDir>,
    clock: Arc<dyn Clock>,
    commands: Arc<procs::FakeScript>,
    start: InProcess,
) -> Result<Outcome, (i32, String)> {
    let level = logging::resolve(None, logging::LEVEL_ENV, logging::LogLevel::Info)
        .unwrap_or(logging::LogLevel::Info);
    logging::init(level, logging::LogFormat::Text);
    let loaded = crate::config::load(Some(config), &|_| None, &[])
        .map_err(|e| (Cause::Usage.exit_code(), e.to_string()))?;
    let cfg = loaded.config.clone();
    if let Some(why) = in_process_refusal(&cfg) {
        return Err((
            Cause::Usage.exit_code(),
            format!("an in-process node cannot run this configuration: {why}"),
        ));
    }
    if rank >= cfg.cluster.num_nodes {
        return Err((
            Cause::Usage.exit_code(),
            format!("rank {rank} is out of range"),
        ));
    }
    let layout = Layout::new(cfg.log_path())
        .with_naming(cfg.naming())
        .with_cluster(cfg.pipeline_cluster());
    let (wake, events) = channel();
    // Each rank is a process of a host of its own, as the others judge it: nodes of one
    // process would otherwise take each other for themselves.
    // The two clusters of a pipelined run are machines of their own.
    let (host, machine) = match cfg.pipeline_cluster() {
        Some(c) => (
            format!("sim-{c}-host-{rank}"),
            format!("sim-{c}-machine-{rank}"),
        ),
        None => (format!("sim-host-{rank}"), format!("sim-machine-{rank}")),
    };
    // A pid of its own per call: a restarted rank is another process.
    static PIDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1_000);
    let ident = crate::holder::ProcessId {
        host: host.clone(),
        machine,
        pid: match clock::scheduler(&*clock) {
            Some(s) => 1_000 + s.serial() as u32,
            None => PIDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        },
        start: 0,
    };
    let launcher = Arc::new(
        procs::FakeLauncher::new(wake.clone(), commands, clock.clone()).writing_to(store.clone()),
    );
    let parts = Parts {
        store,
        clock,
        events,
        wake,
        launcher,
        watchdog: watchdog::Watchdog::inert(),
        stopping: signals::Stopping::new(rank, &host),
        host,
        pid: ident.pid,
        ident,
        broken: start.broken,
    };
    // Task files are the user's own input, outside the shared directory: read as a node
    // reads them.
    let tasks = work::TaskSets::load(&cfg).map_err(|s| (s.exit_code(), s.message))?;
    let node = Node::assemble(cfg, layout, rank, false, start.fresh, parts);
    let source = format!("in-process rank {rank}");
    drive(node, &loaded, &source, tasks, (1, source.clone()))
        .map_err(|s| (s.exit_code(), s.message))
}

/// What an in-process node ([`run_in_process`]) cannot run, because it would read or
/// write real files outside the node's store, or start a real process.
#[cfg(feature = "sim")]
fn in_process_refusal(cfg: &Config) -> Option<&'static str> {
    let p = &cfg.phases;
    if !cfg.server.command.trim().is_empty() {
        return Some("the inference server is a real process checked over HTTP ([server] command)");
    }
    if p.aggregate.is_set() {
        return Some(
            "a merge command is a real process reading real files ([phases.aggregate] command)",
        );
    }
    if cfg.naming().format() != crate::shards::naming::Format::Jsonl {
        return Some("only JSONL shards are merged through the store (aggregate.format)");
    }
    None
}

/// `n` random bytes in hex (nonces, run ids): drawn from the simulation's seed when the
/// clock has a scheduler, so that a seed replays the same run, else at random.
fn random_id(clock: &dyn Clock, n: usize) -> String {
    match clock::scheduler(clock) {
        Some(s) => s.hex(n),
        None => random_hex(n),
    }
}

/// What a node runs with besides its configuration: the shared directory and the clock,
/// and its process's plumbing (the channel the reaper, the signal thread and helper threads
/// send on, the process groups it started, the watchdog) and identity.
struct Parts {
    store: Arc<dyn SharedDir>,
    clock: Arc<dyn Clock>,
    events: Receiver<Event>,
    wake: Sender<Event>,
    launcher: Arc<dyn procs::Launcher>,
    watchdog: watchdog::Watchdog,
    host: String,
    pid: u32,
    ident: crate::holder::ProcessId,
    broken: Broken,
    /// Shared with the signal thread: the exit code, decided once.
    stopping: Arc<signals::Stopping>,
}

impl Node {
    fn assemble(
        cfg: Config,
        layout: Layout,
        rank: u32,
        debug_mode: bool,
        fresh: bool,
        parts: Parts,
    ) -> Node {
        let nonce = random_id(&*parts.clock, 8);
        // Only a node with processes of its own (not the simulator's) has any to report on.
        let registry = parts.launcher.registry();
        let hang = forensics::Reporter::new(
            cfg.timing.hang_report_at,
            registry
                .as_ref()
                .map(|r| (std::process::id() as i32, vec![r.guardian()])),
            crate::process::forensics::Tools::new(registry),
        );
        let machine = regroup::machine_for(
            &cfg,
            &parts.host,
            layout.cluster_name(),
            rank,
            None,
            &parts.broken,
        )
        .with_serving(Serving::new(cfg.cluster.model.clone()));
        Node {
            store: parts.store,
            clock: parts.clock,
            rank,
            layout,
            host: parts.host,
            pid: parts.pid,
            ident: parts.ident,
            broken: parts.broken,
            stopping: parts.stopping,
            nonce,
            fingerprint: cfg.fingerprint(),
            events: parts.events,
            wake: parts.wake,
            launcher: parts.launcher,
            watchdog: parts.watchdog,
            publisher: None,
            machine,
            exited: HashMap::new(),
            waiting: poll::Waiting::default(),
            server: None,
            debug_mode,
            fresh,
            dead_after_source: crate::config::Source::Default,
            tasks: work::TaskSets::default(),
            extra: Default::default(),
            acting_for: None,
            rolling: None,
            carried: None,
            rejoins: regroup::Rejoins::new(cfg.timing.dead_after),
            moving_to: None,
            nproc_per_node: 0,
            replacements: Vec::new(),
            workers: Default::default(),
            event_log: EventLog::default(),
            metrics: Default::default(),
            metrics_log: EventLog::default(),
            metrics_written: Default::default(),
            metrics_stats: None,
            textfile: Default::default(),
            hang,
            cfg,
        }
    }
}

/// The node's life once assembled: what it says at start, the join, every iteration, and
/// the shut-down.
fn drive(
    mut node: Node,
    loaded: &Loaded,
    rank_source: &str,
    tasks: work::TaskSets,
    (nproc, nproc_source): (u32, String),
) -> Result<Outcome, Stop> {
    node.tasks = tasks;
    node.dead_after_source = loaded.source_of("timing.dead-after").clone();
    let create_root = node.is_master() && !node.store.is_dir(node.layout.root());
    let p = &node.cfg.phases;
    if !(p.rollout.is_set()
        || p.eval.is_set()
        || p.aggregate.is_set()
        || p.prepare.is_set()
        || p.train.is_set()
        || !p.handoff.command.trim().is_empty()
        || !node.cfg.server.command.trim().is_empty())
    {
        node.warn(
            "no phase command is configured (phases.*.command and server.command are all empty): every iteration does nothing; set them in --config, e.g. [phases.rollout] command = \"…\"",
        );
    }
    if *loaded.source_of("cluster.num-nodes") != crate::config::Source::Default {
        node.info(&format!(
            "num-nodes {} (from {})",
            node.cfg.cluster.num_nodes,
            loaded.source_of("cluster.num-nodes")
        ));
    }
    // Resolved before anything is written; the cluster record publishes the address.
    if node.rank == 0 && node.cfg.cluster.master_addr == "ip" {
        match context::first_ip_address() {
            Some(ip) => node.cfg.cluster.master_addr = ip,
            None => {
                return Err(Stop::usage(
                    "cluster.master-addr = \"ip\": this host has no IP address other than loopback and link-local ones",
                    Some("set cluster.master-addr to an address workers can reach, or \"\" for the host name".into()),
                ))
            }
        }
    }
    node.nproc_per_node = nproc;
    if p.train.is_set() {
        node.info(&format!(
            "training processes on this node (NPROC_PER_NODE): {nproc} ({nproc_source})"
        ));
    }
    let planned = node.tasks.train.is_some() || node.tasks.eval.is_some();
    if planned
        && (node.cfg.work.mode == crate::config::WorkMode::PerTask
            || node.cfg.work.strategy == crate::work::plan::Strategy::Dynamic)
    {
        let per = match node.cfg.work.max_workers {
            crate::config::MaxWorkers::PerGpu(_) => format!(", {nproc} GPU(s) from {nproc_source}"),
            crate::config::MaxWorkers::Count(_) => String::new(),
        };
        node.info(&format!(
            "rollout items at once on this node: {} (work.max-workers = {} from {}{per})",
            node.max_workers(),
            node.cfg.work.max_workers,
            loaded.source_of(crate::config::MaxWorkers::KEY)
        ));
    }
    let node_process = if node.pid == std::process::id() {
        String::new()
    } else {
        format!(" (node process {})", std::process::id())
    };
    node.info(&format!(
        "rank {} ({}) on {}, pid {}{node_process}; shared directory {}",
        node.rank,
        rank_source,
        node.host,
        node.pid,
        node.layout.root().display()
    ));
    // Elastic mode: a run that goes on without this rank takes it back at an iteration.
    if let Some(current) = node.live_generation() {
        let result = match node.rejoin(current) {
            Ok(regroup::Rejoined::Joined(cluster)) => {
                node.textfile_for_run();
                let first = node
                    .join_regrouped(*cluster)
                    .and_then(|()| node.run_iterations());
                node.go_on(first).map(|()| Outcome::Completed)
            }
            Ok(regroup::Rejoined::Complete(n)) => Ok(Outcome::AlreadyComplete(n)),
            Err(stop) => Err(stop),
        };
        return node.shut_down(result);
    }
    let result = match node.create_root(create_root).and_then(|()| node.join()) {
        Ok(join::Joined::Formed) => {
            node.machine.watch.formed = true;
            node.textfile_for_run();
            node.run_elastic().map(|()| Outcome::Completed)
        }
        Ok(join::Joined::AlreadyComplete(n)) => Ok(Outcome::AlreadyComplete(n)),
        Err(stop) => Err(stop),
    };
    node.shut_down(result)
}

impl Node {
    fn info(&self, msg: &str) {
        logging::info(self.rank, msg);
    }

    /// Rank 0 makes a `--log-path` that did not exist (its parent does: see
    /// `preflight_log_path`), and says so: a path nobody meant to create shows in the log.
    fn create_root(&self, missing: bool) -> Result<(), Stop> {
        if !missing {
            return Ok(());
        }
        let root = self.layout.root();
        match self.store.create_dir(root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(Stop::usage(
                    format!("--log-path {}: cannot create it: {e}", root.display()),
                    None,
                ))
            }
        }
        self.info(&format!(
            "created the shared directory {} (--log-path did not exist; rank 0 creates only its last component)",
            root.display()
        ));
        Ok(())
    }

    fn warn(&self, msg: &str) {
        logging::warn(self.rank, msg);
    }

    fn debug(&self, msg: &str) {
        logging::debug(self.rank, msg);
    }

    /// Whether this rank coordinates its generation: rank 0, or in elastic mode the
    /// lowest member once rank 0 was dropped.
    fn is_master(&self) -> bool {
        match &self.machine.settings().members {
            Some(m) => m.coordinator() == self.rank,
            None => self.rank == 0,
        }
    }

    fn num_nodes(&self) -> u32 {
        self.cfg.cluster.num_nodes
    }

    fn gen(&self) -> u64 {
        self.machine.cluster().map(|c| c.gen).unwrap_or(0)
    }

    /// Fencing: is this node still of the run's current generation? Checked immediately
    /// before every commit (a shard, an item, the merged file, a journal entry, the
    /// prepared data, a checkpoint and `LATEST`). A node of a generation that was
    /// replaced while it was frozen (a paused VM, a hung kernel) stops here without
    /// touching what the newer generation owns. The residual window — between this read
    /// and the rename it guards — is documented in docs/shared-directory.md.
    fn fence(&mut self, what: &str) -> Result<(), Stop> {
        self.fence_at(Site::Other, what)
    }

    /// [`Node::fence`] before a commit at `site` (what a deliberately opened fence of the
    /// simulator's tests names).
    fn fence_at(&mut self, site: Site, what: &str) -> Result<(), Stop> {
        self.watchdog
            .pet("checking that this generation is current");
        let check = fence_check(
            &*self.store,
            &self.layout,
            self.gen(),
            self.run_id(),
            site,
            self.broken.fence,
        );
        self.watchdog.pet("checked the generation");
        check.map_err(|f| self.fenced(&f.why, what))
    }

    /// The stop of a node whose generation was replaced (see [`Node::fence`]).
    fn fenced(&mut self, why: &str, what: &str) -> Stop {
        exercised::note(exercised::Path::FencedWrites);
        self.event(events::Event::Fenced {
            what: what.to_string(),
            why: why.to_string(),
        });
        Stop::new(
            Cause::PeerFailed,
            format!("{why}: this node did not {what}, and stops without touching the newer generation's files"),
        )
        .with_hint("nothing to do: the current generation carries on (rl-node status shows it)")
    }

    /// A [`Node::fence`] that other threads (the merge, the hand-off) can call, told at
    /// each call which commit it guards.
    fn fence_fn(&self) -> impl Fn(Site) -> Result<(), String> + Send + Sync + 'static {
        let (store, layout) = (self.store.clone(), self.layout.clone());
        let (gen, run, broken) = (self.gen(), self.run_id().to_string(), self.broken.fence);
        move |site| fence_check(&*store, &layout, gen, &run, site, broken).map_err(|f| f.why)
    }

    fn run_id(&self) -> &str {
        self.machine
            .cluster()
            .map(|c| c.run_id.as_str())
            .unwrap_or("")
    }

    /// The record of the generation just joined, from now on also where a second
    /// signal puts the first one's abort if this loop has not (`signals`).
    fn set_publisher(&mut self, publisher: Publisher) {
        let cluster = self.layout.cluster_name().map(str::to_string);
        self.stopping.joined(publisher.handle(), cluster);
        self.publisher = Some(publisher);
    }

    /// The heartbeat thread publishing `record` at `path` from now on, every `interval`.
    fn publish_from_now(
        &self,
        path: PathBuf,
        record: RankRecord,
        interval: Duration,
    ) -> std::io::Result<Publisher> {
        Publisher::start(
            self.store.clone(),
            self.clock.clone(),
            path,
            record,
            interval,
            self.watchdog.clone(),
        )
    }

    fn publisher(&self) -> &Publisher {
        self.publisher.as_ref().expect("joined")
    }

    fn phase_label(&self) -> String {
        self.machine.position().phase.clone()
    }

    // ---------------------------------------------------------------- the one wait loop

    /// Wait until `check` answers `Some`, polling the cluster's health between checks with
    /// an adaptive interval (from about a millisecond up to `poll-interval`). Ends early on
    /// an abort, a dead awaited peer, a signal, or `deadline`.
    fn wait_for<T>(
        &mut self,
        deadline: Instant,
        mut check: impl FnMut(&mut Node) -> Result<Option<T>, Stop>,
    ) -> Result<T, Interrupt> {
        let mut step = poll::first_step(self.cfg.timing.poll_interval);
        let started = self.clock.now();
        let mut next_note = Duration::from_secs(10);
        loop {
            self.watchdog.pet("polling the shared directory");
            self.poll_cluster()?;
            self.hang_round();
            self.relay_round();
            self.rejoin_round();
            self.textfile_round();
            if let Some(v) = check(self)? {
                return Ok(v);
            }
            let now = self.clock.now();
            if now >= deadline {
                return Err(Interrupt::Deadline);
            }
            if now - started >= next_note && !self.waiting.note.is_empty() {
                self.info(&format!(
                    "still waiting after {:.0}s: {}",
                    (now - started).as_secs_f64(),
                    self.waiting.note
                ));
                next_note = (next_note * 3).min(next_note + Duration::from_secs(300));
            }
            let mut timeout = step.min(deadline - now);
            // The machine's next due (a read, a heartbeat that would have been still for
            // dead-after, the write-error stop) wakes the loop in time.
            if let Some(due) = self
                .machine
                .poll_timeout()
                .filter(|_| self.publisher.is_some())
            {
                let until = due.saturating_sub(self.clock.since_start());
                timeout = timeout.min(until.max(Duration::from_millis(1)));
            }
            let t = &self.cfg.timing;
            // The relay looks at least twice a second; an idle node about twice a second
            // (docs/shared-directory.md, "What a node does to the directory, counted").
            let max_step = self.waiting.max_step(
                self.machine.relay_pace(),
                t.poll_interval,
                t.heartbeat_interval,
            );
            step = poll::next_step(step, max_step);
            match clock::recv_timeout(&*self.clock, &self.events, timeout) {
                Ok(ev) => self.handle_event(ev)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => unreachable!("the reaper holds a sender"),
            }
            while let Ok(ev) = self.events.try_recv() {
                self.handle_event(ev)?;
            }
        }
    }

    /// Rewrite the Prometheus textfile if it is due (`textfile::Textfile::tick`); a
    /// failed write is reported when its message changes, and never stops the node.
    fn textfile_round(&mut self) {
        let refresh = self.cfg.timing.heartbeat_interval;
        let now = Instant::now();
        let msg = self.with_textfile(|t| {
            let result = t.tick(now, refresh).err();
            if result == t.last_error {
                return None;
            }
            let msg = match &result {
                Some(e) => {
                    format!("observe.prometheus-textfile: cannot write {e}; the node goes on")
                }
                None => "observe.prometheus-textfile: written again".to_string(),
            };
            t.last_error = result;
            Some(msg)
        });
        if let Some(msg) = msg.flatten() {
            self.warn(&msg);
        }
    }

    /// The run is known: the Prometheus textfile carries its id from now on (and goes to
    /// its name, when that holds `{run_id}`).
    fn textfile_for_run(&mut self) {
        let run_id = self.run_id().to_string();
        let mut slot = self.textfile.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = slot.take() {
            match t.for_run(&run_id) {
                Ok(t) => *slot = Some(t),
                Err(e) => {
                    drop(slot);
                    self.warn(&format!(
                        "observe.prometheus-textfile: {}; the node goes on without it",
                        e.0
                    ));
                }
            }
        }
    }

    /// `f` on the Prometheus textfile, if one is configured.
    fn with_textfile<T>(&self, f: impl FnOnce(&mut textfile::Textfile) -> T) -> Option<T> {
        self.textfile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .map(f)
    }

    fn handle_event(&mut self, ev: Event) -> Result<(), Stop> {
        match ev {
            Event::Reaped { pid, exit } => {
                // Orphans re-parented to us are reaped too; only a registered command's
                // exit is awaited. Keeping the others would let a later command that
                // gets a reused pid seem to have exited at once.
                if !self.launcher.contains(pid) || self.worker_exited(pid, exit) {
                    return Ok(());
                }
                self.check_server_exit(pid, exit)?;
                self.exited.insert(pid, exit);
                Ok(())
            }
            Event::Wake => Ok(()),
            Event::Reply { worker, reply } => {
                self.worker_replied(worker, reply);
                Ok(())
            }
            Event::Signal(sig) => {
                self.info(&format!(
                    "received {}{}; stopping (children get {} to exit; signal again to kill them now)",
                    procs::signal_name(sig),
                    if crate::protocol::records::is_time_limit(sig) { " (time limit approaching)" } else { "" },
                    humantime::format_duration(self.cfg.timing.kill_grace)
                ));
                let (kind, reason) = signals::abort_for(sig);
                Err(self.fail(kind, self.rank, None, reason, None))
            }
        }
    }

    /// Hand the machine what the heartbeat thread knows and the time, and perform what it
    /// asks: read what this node watches (rank 0: every rank; a worker: rank 0), and stop
    /// on an abort, a dead peer, a replaced process or this node's failing writes.
    fn poll_cluster(&mut self) -> Result<(), Stop> {
        let Some(publisher) = &self.publisher else {
            return Ok(());
        };
        let input = machine::Input::Publisher {
            write_error: publisher.last_error(),
            intruder: publisher.intruder(),
        };
        let now = self.clock.since_start();
        self.machine.handle(now, input);
        self.machine.tick(now);
        self.drive_machine()?;
        // Pipelined mode: the other cluster's abort stops this one too.
        self.watch_other(false)
    }

    /// Where the node is, as the machine judges and names it in the aborts it writes.
    /// Perform the machine's effects until it has none: the one place this node acts on
    /// its coordination with its peers. A stop is returned as the node's.
    fn drive_machine(&mut self) -> Result<(), Stop> {
        use machine::{Effect, Input};
        while let Some(effect) = self.machine.poll_effect() {
            match effect {
                Effect::Read(ranks) => {
                    let gen = self.gen();
                    // A FUSE client may serve a peer's record from its entry cache (the
                    // file a rename replaced): one listing of the generation's directory
                    // refreshes every name in it.
                    let _ = self.store.refresh(&self.layout.gen_dir(gen));
                    let reads = self.read_records(gen, &ranks);
                    let now = self.clock.since_start();
                    self.machine.handle(now, Input::Records(reads));
                }
                Effect::Record(change) => self.change_record(change),
                Effect::CreateAbort(mut info) => {
                    info.at = self.wall_stamp();
                    self.watchdog.pet("publishing the abort");
                    let path = self.layout.abort(self.gen());
                    let input = match self.store.create_new_json(&path, &info) {
                        // Someone failed first: theirs is the cause, ours a consequence.
                        // (Seen past a negative-lookup cache: the create said it exists.)
                        Ok(created) => Input::AbortCreated {
                            created,
                            first: (!created)
                                .then(|| {
                                    let _ = self.store.refresh(&self.layout.gen_dir(self.gen()));
                                    self.store.read_json::<AbortInfo>(&path).ok().flatten()
                                })
                                .flatten(),
                        },
                        Err(e) => Input::AbortNotWritten {
                            error: format!("{}: {e}", path.display()),
                        },
                    };
                    let now = self.clock.since_start();
                    self.machine.handle(now, input);
                }
                Effect::Warn(w) => self.warn(&w),
                Effect::Stop(info) => return Err(self.adopt_abort(info)),
            }
        }
        Ok(())
    }

    fn change_record(&mut self, change: machine::Change) {
        use machine::Change;
        match change {
            Change::Arrived(mark) => self.publisher().update(|r| r.arrived = Some(mark)),
            Change::Released(mark) => self.publisher().update(|r| {
                r.released = Some(mark);
                r.waiting_for.clear();
            }),
            Change::GroupArrived(mark) => self.publisher().update(|r| {
                r.group = Some(mark);
                r.waiting_for.clear();
            }),
            // For `status` only: it goes out with the next heartbeat (or is cleared by the
            // release), not as a write of its own that the release could queue behind.
            Change::WaitingFor(missing) => {
                if let Some((_, name)) = self.machine.at_barrier() {
                    self.waiting.note = format!(
                        "barrier {name} (iteration {}) waits for {}",
                        self.machine.iteration(),
                        ranks_list(&missing)
                    );
                }
                self.publisher().stage(|r| r.waiting_for = missing);
            }
            // For `rl-node status`: heartbeat ages as this node observes them. Rank 0's
            // (one entry per peer) goes to a file of its own, which workers never read; a
            // worker's (rank 0 alone) stays in its record.
            Change::Observed(observed) => {
                self.with_textfile(|t| t.peer_ages(&observed));
                if let Some(p) = &self.publisher {
                    match (self.is_master(), self.machine.cluster()) {
                        (true, Some(c)) => p.stage_observed(&self.layout.observed(c.gen), observed),
                        _ => p.stage(|rec| rec.observed_ms = observed),
                    }
                }
            }
        }
    }

    // ---------------------------------------------------------------- failure

    fn abort_info(
        &mut self,
        kind: AbortKind,
        culprit: u32,
        culprit_host: Option<String>,
        reason: String,
        log: Option<&Path>,
    ) -> AbortInfo {
        // Relative: the other nodes mount the shared directory where they like.
        let log = log.map(|p| self.layout.relative(p));
        let mut info = self
            .machine
            .abort_info(kind, culprit, culprit_host, reason, log);
        info.at = self.wall_stamp();
        info
    }

    /// This node detected a failure: publish it (first writer wins) and stop.
    fn fail(
        &mut self,
        kind: AbortKind,
        culprit: u32,
        culprit_host: Option<String>,
        reason: String,
        log: Option<&Path>,
    ) -> Stop {
        let info = self.abort_info(kind, culprit, culprit_host, reason, log);
        self.publish_abort(info)
    }

    /// Publish `info` as the generation's abort through the machine (the first creator's
    /// is the cause) and stop with the cause.
    fn publish_abort(&mut self, info: AbortInfo) -> Stop {
        self.machine.fail(info.clone(), self.publisher.is_some());
        match self.drive_machine() {
            Err(stop) => stop,
            // The machine had stopped already: its cause is the one.
            Ok(()) => {
                let first = self.machine.stopped().cloned().unwrap_or(info);
                self.adopt_abort(first)
            }
        }
    }

    /// Stop because of `info`, telling our watchers (rank 0 relays it to every worker).
    fn adopt_abort(&mut self, info: AbortInfo) -> Stop {
        self.machine.adopt(info.clone());
        // The record's first abort is the cause: a second signal may have put the first
        // one's there while this loop was busy (`signals`).
        let info = match &self.publisher {
            Some(p) => p.handle().fail_with(info),
            None => info,
        };
        // Said with the log where this node finds it (a log that cannot be placed on this
        // node's mount stays as written).
        let mut info = info;
        if let Some(log) = &info.log {
            if let Ok(p) = crate::layout::resolve_recorded(self.layout.root(), Path::new(log)) {
                info.log = Some(p.display().to_string());
            }
        }
        let (cause, hint) =
            crate::protocol::abort::consequence(&info, self.rank, self.layout.cluster_name());
        // Declared dead while alive: what happened, as this node can tell it.
        let dead_after = format!(
            "{}, timing.dead-after from {}",
            humantime::format_duration(self.cfg.timing.dead_after),
            self.dead_after_source
        );
        let (message, hint) = match crate::protocol::abort::declared_dead(
            &info,
            self.rank,
            self.layout.cluster_name(),
            &dead_after,
        ) {
            Some((message, hint)) => (message, Some(hint)),
            None => (info.describe(), hint),
        };
        let detail = info
            .log
            .as_ref()
            .filter(|_| info.culprit == self.rank)
            .map(|l| procs::tail(Path::new(l), 20))
            .filter(|t| !t.is_empty());
        Stop {
            cause,
            message,
            hint,
            detail,
        }
    }

    fn shut_down(mut self, result: Result<Outcome, Stop>) -> Result<Outcome, Stop> {
        let result = self.decide(result);
        // A second signal leaves no grace.
        let grace = match self.stopping.escalated() {
            true => Duration::ZERO,
            false => self.cfg.timing.kill_grace,
        };
        // A report's tool that hangs is killed now, not at its time limit: its report is
        // then written before the node is gone, and the tool does not outlive it.
        self.watchdog.pet("stopping the hang reports' tools");
        self.hang.stop_tools();
        // Running commands, then descendants that left their groups (`setsid`), including
        // those of commands that were still running.
        let groups = self.launcher.running();
        if groups > 0 {
            self.info(&format!(
                "stopping {groups} running command(s) (SIGTERM, then SIGKILL after {})",
                humantime::format_duration(grace)
            ));
        }
        self.watchdog.pet("stopping children");
        let n = self.launcher.stop_all(grace);
        if n > 0 {
            self.info(&format!(
                "stopped {n} process(es) that had left their command's process group"
            ));
        }
        // Reports started before the stop belong with it (their event, the record); a
        // write that hangs is left behind well before the watchdog would call it stuck.
        self.watchdog.pet("waiting for hang reports being written");
        self.settle_hang_reports(forensics::SETTLE.min(self.cfg.timing.fs_timeout / 2));
        // A failure that published no abort (e.g. a worker's join-timeout after it joined)
        // is published as this rank's own in its final record, so that its peers stop with
        // its reason instead of finding only "failed" (the seeded driver simulation found
        // rank 0 waiting for such a worker at the first barrier).
        let own = match &result {
            Err(stop) => Some(self.abort_info(
                AbortKind::Error,
                self.rank,
                None,
                stop.message.clone(),
                None,
            )),
            _ => None,
        };
        if let Some(p) = self.publisher.take() {
            self.watchdog.pet("writing the final record");
            let done = result.is_ok();
            p.finish(
                |r| {
                    if done {
                        r.state = NodeState::Done;
                    } else if !r.state.is_terminal() {
                        r.state = NodeState::Failed;
                        if r.abort.is_none() {
                            r.abort = own;
                        }
                    }
                    r.waiting_for.clear();
                },
                Duration::from_secs(5),
            );
        }
        self.watchdog.disarm();
        result
    }

    /// The loop's outcome, decided once with the signal side (`signals::Stopping`): an
    /// escalation that found the loop busy before it stopped put the first signal's abort
    /// in the record, and that abort, not what the loop ran into since, is the outcome.
    fn decide(&mut self, result: Result<Outcome, Stop>) -> Result<Outcome, Stop> {
        let code = result
            .as_ref()
            .map_or_else(Stop::exit_code, |_| exit::Ending::Done.exit_code());
        if self.stopping.decide(code) == code {
            return result;
        }
        let first = self
            .publisher
            .as_ref()
            .and_then(|p| p.handle().read(|r| r.abort.clone()));
        match first {
            Some(info) => Err(self.adopt_abort(info)),
            None => result,
        }
    }

    // ---------------------------------------------------------------- barriers

    /// Arrive at the next barrier with `gather`; rank 0 waits for every rank, computes the
    /// broadcast with `decide` from the gathered payloads and releases; workers wait for
    /// the release and get the broadcast.
    fn barrier<G: Payload + Clone, B: Payload>(
        &mut self,
        name: &str,
        gather: G,
        decide: impl FnOnce(Vec<G>) -> B,
    ) -> Result<B, Stop> {
        self.barrier_with(name, gather, |_, payloads| decide(payloads))
    }

    /// [`Node::barrier`], whose `decide` may act on the node (the coordinator forming a
    /// generation it releases the members into).
    fn barrier_with<G: Payload + Clone, B: Payload>(
        &mut self,
        name: &str,
        gather: G,
        decide: impl FnOnce(&mut Node, Vec<G>) -> B,
    ) -> Result<B, Stop> {
        let k = self.machine.arrive(name, &gather);
        let deadline = self.clock.now() + self.cfg.timing.barrier_timeout;
        let started = self.clock.now();
        self.watch_wait(
            format!("barrier {name} (iteration {})", self.machine.iteration()),
            "timing.barrier-timeout".into(),
            self.cfg.timing.barrier_timeout,
            started,
        );
        let passed = self.pass_barrier(name, deadline, decide);
        self.machine.leave_barrier();
        self.unwatch_wait();
        let broadcast = passed?;
        self.waiting.note.clear();
        let waited = self.clock.elapsed(started);
        self.debug(&format!(
            "iteration {}: barrier {name} passed after {:.3}s",
            self.machine.iteration(),
            waited.as_secs_f64()
        ));
        self.event(events::Event::Barrier {
            name: name.to_string(),
            k,
            waited_ms: waited.as_millis() as u64,
        });
        Ok(broadcast)
    }

    /// The wait of [`Node::barrier`]: publish the arrival; rank 0 waits for every rank,
    /// decides and releases; a worker waits for the release.
    fn pass_barrier<G: Payload + Clone, B: Payload>(
        &mut self,
        name: &str,
        deadline: Instant,
        decide: impl FnOnce(&mut Node, Vec<G>) -> B,
    ) -> Result<B, Stop> {
        self.drive_machine()?;
        if self.is_master() {
            let waited = self.wait_for(deadline, |n| {
                let progress = n.machine.progress::<G, B>();
                n.drive_machine()?;
                match progress {
                    Progress::Waiting { .. } => Ok(None),
                    Progress::Complete { payloads } => Ok(Some(payloads)),
                    Progress::Released { .. } => {
                        unreachable!("rank 0 releases, it is not released")
                    }
                }
            });
            let payloads = self.end_wait(waited, || format!("barrier {name} did not complete"))?;
            let broadcast = decide(self, payloads);
            self.machine.release(&broadcast);
            self.drive_machine()?;
            Ok(broadcast)
        } else {
            self.waiting.note = format!(
                "rank 0 to release barrier {name} (iteration {})",
                self.machine.iteration()
            );
            // A group's leader publishes its group's arrival from here (an effect).
            let waited = self.wait_for(deadline, |n| {
                let progress = n.machine.progress::<G, B>();
                n.drive_machine()?;
                match progress {
                    Progress::Released { broadcast } => Ok(Some(broadcast)),
                    _ => Ok(None),
                }
            });
            self.end_wait(waited, || format!("barrier {name} was not released"))
        }
    }

    fn end_wait<T>(
        &mut self,
        r: Result<T, Interrupt>,
        what: impl FnOnce() -> String,
    ) -> Result<T, Stop> {
        match r {
            Ok(v) => Ok(v),
            Err(Interrupt::Stop(s)) => Err(s),
            Err(Interrupt::Deadline) => {
                let reason = format!(
                    "{} within barrier-timeout ({}); {}",
                    what(),
                    humantime::format_duration(self.cfg.timing.barrier_timeout),
                    self.waiting.note
                );
                Err(self.fail(AbortKind::Timeout, self.rank, None, reason, None))
            }
        }
    }

    // ---------------------------------------------------------------- the iteration

    fn run_iterations(&mut self) -> Result<(), Stop> {
        let last = self.cfg.cluster.iterations;
        let resume = self.machine.cluster().expect("joined").resume;
        let mut iteration = resume.iteration.max(1);
        let run_id = self.run_id().to_string();
        // This rank is its journal's only writer: an unfinished last line (a crash
        // mid-append) is set aside first, so the next entry starts on a line of its own.
        let path = self.layout.journal(self.rank);
        let repaired = if journal::sets_torn_tail_aside(self.broken.journal) {
            crate::state::repair_tail(&*self.store, &path, self.gen())
        } else {
            Ok(None)
        };
        match repaired {
            Ok(Some(aside)) => self.info(&format!(
                "{}: the unfinished last line (a crash mid-append) was set aside in {}",
                path.display(),
                aside.display()
            )),
            Ok(None) => {}
            Err(e) => return Err(self.fail(AbortKind::Error, self.rank, None, e, None)),
        }
        let entries = match crate::state::read_journal(&*self.store, &path) {
            Ok(lines) => lines.entries,
            Err(e) => {
                let hint = e.hint(self.layout.root());
                let mut stop = self.fail(AbortKind::Error, self.rank, None, e.to_string(), None);
                stop.cause = Cause::Usage;
                stop.hint = Some(hint);
                return Err(stop);
            }
        };
        self.machine
            .open_journal(journal::Book::open(entries, &run_id, self.broken.journal));
        if last > 0 && iteration > last {
            self.info(&format!("all {last} iteration(s) were already complete"));
            return Ok(());
        }
        if self.is_master() {
            self.empty_checkpoint_trash()?;
            // One read per start: a small file, one line per iteration.
            let bytes = self
                .store
                .read_limited(&self.layout.metrics(), crate::store::ReadLimit::Journal)
                .ok()
                .flatten();
            self.metrics_written = metrics::Written::read(
                bytes.as_deref().unwrap_or_default(),
                &run_id,
                self.cfg.pipeline_cluster(),
            );
        }
        self.use_latest_checkpoint()?;
        self.pipeline_begin()?;
        // A pipelined rollout cluster starts its server on the model the staleness rule
        // gives the first iteration it runs (`use_rollout_model`); an update cluster has none.
        if self.cfg.cluster.rl_phase != crate::config::RlPhase::Update
            && self.cfg.staleness().is_none()
        {
            self.start_server()?;
        }
        loop {
            if last > 0 && iteration > last {
                self.stop_server()?;
                self.info(&format!(
                    "all {last} iteration(s) complete ({} barriers; shared-directory operations: {})",
                    self.machine.k(),
                    self.store.counts().summary()
                ));
                return Ok(());
            }
            let resume = self.machine.cluster().expect("joined").resume;
            let walk = IterationWalk::new(self.walk_config(), iteration, resume);
            self.machine.begin_iteration(walk);
            let started = self.clock.now();
            self.metrics_collector().reset();
            self.note_model_used();
            while let Some(step) = self.machine.next_step() {
                self.step(step)?;
            }
            self.write_metrics(started);
            self.info(&format!(
                "iteration {iteration} complete in {:.2}s{}",
                self.clock.elapsed(started).as_secs_f64(),
                if self.machine.walk().training_failures().is_empty() {
                    ""
                } else {
                    " (training failed: no new model)"
                }
            ));
            iteration += 1;
        }
    }

    /// The newest published checkpoint that verifies, if any, is the model to serve and
    /// train from (see `checkpoint::latest_as`); a missing or damaged `models/LATEST` is
    /// reported, and checked against what rank 0's journal says was published.
    fn use_latest_checkpoint(&mut self) -> Result<(), Stop> {
        self.watchdog.pet("verifying the latest checkpoint");
        let journaled = self.journaled_handoffs();
        let wd = self.watchdog.clone();
        let check = self.cfg.phases.handoff.check();
        let started = self.clock.now();
        let latest = crate::checkpoint::latest_as(
            &*self.store,
            &self.layout.models(),
            check,
            &journaled,
            &mut || wd.pet("verifying the latest checkpoint"),
        );
        let checked = self.clock.elapsed(started).as_secs_f64();
        let base = self.cfg.cluster.model.clone();
        if let Some(reason) = latest.stop(&base) {
            return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
        }
        if let Some(warning) = latest.warning(&base) {
            self.warn(&warning);
            self.event(events::Event::LatestFallback { warning });
        }
        if let Some(p) = latest.path() {
            // `latest_as` verified it, as `phases.handoff.verify` says.
            let serving = self.machine.serving_mut();
            serving.adopt_verified(p.display().to_string());
            let model = serving.model().to_string();
            self.info(&format!(
                "model: {model} (checked in {checked:.4}s, phases.handoff.verify = \"{}\")",
                self.cfg.phases.handoff.verify
            ));
        }
        Ok(())
    }

    /// What rank 0's journal says about this run's hand-offs (every rank reads the same
    /// file, so all resolve `models/LATEST` alike). A rollout-only walk hands nothing off:
    /// its journal says nothing about `models/`, and a pipelined rollout cluster serves
    /// each iteration's model by version anyway (`model_of_version`).
    fn journaled_handoffs(&mut self) -> crate::checkpoint::Journaled {
        if self.cfg.cluster.rl_phase == crate::config::RlPhase::Rollout {
            return Default::default();
        }
        let walk = self.cfg.walk_item();
        // Elastic mode: whichever rank coordinated an iteration journaled its hand-off.
        if self.cfg.elastic() {
            self.watchdog.pet("reading the ranks' journals");
            let run_id = self.run_id().to_string();
            let ranks: Vec<u32> = (0..self.num_nodes()).collect();
            let entries: Vec<journal::Entry> = self
                .journals_of(&ranks)
                .into_iter()
                .flatten()
                .filter(|e| e.run_id == run_id)
                .collect();
            return crate::checkpoint::Journaled::from_journal(&entries, &walk);
        }
        if self.rank == 0 {
            return crate::checkpoint::Journaled::from_journal(
                self.machine.journal().entries(),
                &walk,
            );
        }
        self.watchdog.pet("reading rank 0's journal");
        let run_id = self.run_id().to_string();
        let entries: Vec<journal::Entry> = self
            .store
            .read_limited(&self.layout.journal(0), crate::store::ReadLimit::Journal)
            .ok()
            .flatten()
            .map(|b| journal::parse(&String::from_utf8_lossy(&b)))
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.run_id == run_id)
            .collect();
        crate::checkpoint::Journaled::from_journal(&entries, &walk)
    }

    /// Rank 0, at start: finish deleting the checkpoints a crash interrupted the deletion of
    /// (`phases.handoff.keep-last`; see `checkpoint::prune`).
    fn empty_checkpoint_trash(&mut self) -> Result<(), Stop> {
        self.watchdog.pet("deleting old checkpoints");
        match crate::checkpoint::empty_trash(&*self.store, &self.layout.models()) {
            Ok(removed) if removed.is_empty() => Ok(()),
            Ok(removed) => {
                self.info(&format!(
                    "finished deleting {} (interrupted by a crash)",
                    removed.join(", ")
                ));
                Ok(())
            }
            Err(e) => {
                let reason = format!("deleting old checkpoints failed: {e}");
                Err(self.fail(AbortKind::Error, self.rank, None, reason, None))
            }
        }
    }

    fn enter(&mut self, phase: Phase) -> Result<(), Stop> {
        // A run whose phases never wait (one node, no commands) must still see a signal:
        // look at pending events at every phase, not only inside waits.
        while let Ok(ev) = self.events.try_recv() {
            self.handle_event(ev)?;
        }
        self.unwatch_wait();
        let it = self.machine.iteration();
        // Written with what comes next (a barrier arrival, a command's start) when that
        // is within publisher::FOLD, on its own otherwise: one write instead of two per
        // barrier phase, and the record never says an old phase for more than FOLD.
        self.publisher().soon(|r| {
            r.phase = Some(phase);
            r.iteration = it;
            r.state = NodeState::Running;
        });
        self.event(events::Event::Phase {
            phase,
            n: phase.number(),
        });
        self.test_hold(phase)
    }

    /// Test-only fault injection: `RL_NODE_TEST_HOLD_AT=<phase>@<iteration>` parks the node
    /// on entering that phase (heartbeat still running) so a test can kill it there, even
    /// in a barrier phase that otherwise lasts microseconds.
    fn test_hold(&mut self, phase: Phase) -> Result<(), Stop> {
        let Ok(spec) = std::env::var("RL_NODE_TEST_HOLD_AT") else {
            return Ok(());
        };
        if spec == format!("{}@{}", phase.name(), self.machine.iteration()) {
            self.info(&format!(
                "RL_NODE_TEST_HOLD_AT={spec}: holding here until killed"
            ));
            loop {
                self.watchdog.pet("holding for a test");
                // Signals still end the hold like any wait.
                if let Ok(ev) =
                    clock::recv_timeout(&*self.clock, &self.events, Duration::from_millis(50))
                {
                    self.handle_event(ev)?;
                }
            }
        }
        Ok(())
    }

    /// What this node's walk of an iteration depends on.
    fn walk_config(&self) -> WalkConfig {
        WalkConfig {
            rl_phase: self.cfg.cluster.rl_phase,
            split: self.cfg.cluster.rollout_split,
            rank_0: self.is_master(),
            prepare: self.cfg.phases.prepare.is_set(),
            iterations: self.cfg.cluster.iterations,
        }
    }

    /// Perform one step of the iteration's walk (`protocol::walk`), feeding the walk the
    /// decisions its barriers release.
    fn step(&mut self, step: Step) -> Result<(), Stop> {
        let cfg = self.cfg.clone();
        match step {
            Step::Enter(phase) => self.enter(phase)?,
            Step::Barrier(WalkBarrier::SyncStart) => self.sync_start()?,
            Step::Barrier(WalkBarrier::FilesReady) => {
                let eval = self.files_ready()?;
                self.machine.walk_mut().eval_decided(eval);
            }
            Step::Barrier(WalkBarrier::TrainingComplete) => self.training_complete()?,
            Step::Barrier(WalkBarrier::HandoffComplete) => self.handoff_complete()?,
            Step::Barrier(WalkBarrier::FinalSync) => self.final_sync()?,
            Step::Barrier(b @ WalkBarrier::RolloutComplete) => {
                self.shards_complete(b, Split::Train)?
            }
            Step::Barrier(b @ WalkBarrier::EvalComplete) => self.shards_complete(b, Split::Eval)?,
            Step::Barrier(b) => self.barrier(b.name(), (), |_| ())?,
            Step::Rollout(Split::Train) => {
                self.once(journal::item::ROLLOUT_TRAIN, |n| {
                    n.any_rollout("train", "rollout", &cfg.phases.rollout)
                })?;
                self.stand_in_rollouts(Split::Train, &cfg.phases.rollout)?;
                self.open_gate("train", &cfg.phases.rollout);
            }
            Step::Rollout(Split::Eval) => {
                self.once(journal::item::ROLLOUT_EVAL, |n| {
                    n.any_rollout("eval", "eval", &cfg.phases.eval)
                })?;
                self.stand_in_rollouts(Split::Eval, &cfg.phases.eval)?;
                self.open_gate("eval", &cfg.phases.eval);
            }
            Step::Aggregate(Split::Train) => {
                self.once(journal::item::AGGREGATE_TRAIN, |n| {
                    n.any_aggregate("train", cfg.phases.rollout.is_set())
                })?;
                self.start_field_stats();
                // Pipelined: the update cluster may train this iteration now.
                self.queue_advanced()?;
            }
            Step::Aggregate(Split::Eval) => {
                self.once(journal::item::AGGREGATE_EVAL, |n| {
                    n.any_aggregate("eval", cfg.phases.eval.is_set())
                })?;
            }
            // Pipelined update cluster: no server to stop; its iteration starts once the
            // rollout cluster committed the trajectories.
            Step::StopServer if self.cfg.staleness().is_some() => {
                self.wait_for_trajectories()?;
            }
            Step::StopServer => self.stop_server()?,
            Step::Prepare => {
                self.once(journal::item::PREPARE, |n| n.prepare(&cfg.phases.prepare))?;
            }
            Step::Train { reuse } => self.train_step(reuse)?,
            // Nothing trained to hand off: the model stays, LATEST is unchanged.
            Step::SkipHandoff => self.skip_handoff()?,
            Step::Handoff => self.once(journal::item::HANDOFF, |n| n.handoff())?,
            Step::RestartServer { last: true } => {
                // After the last planned iteration the node stops the server at once:
                // starting it on the new checkpoint only to stop it would waste minutes
                // of a real model's load time.
                if !self.cfg.server.command.trim().is_empty() {
                    self.info("last iteration: the server is not restarted");
                }
            }
            // The pipelined rollout cluster restarts its servers (`use_rollout_model`).
            Step::RestartServer { .. } if self.cfg.staleness().is_some() => {}
            Step::RestartServer { last: false } => self.start_server()?,
            Step::Complete => {
                let item = self.cfg.walk_item();
                self.journal_item(&item)?;
                self.queue_advanced()?;
            }
        }
        Ok(())
    }

    /// `sync-start`: every node plans the iteration itself; rank 0's plan travels with
    /// the release and a worker whose plan differs stops. A pipelined rollout cluster's
    /// rank 0 also releases the model the staleness rule gives this iteration (waiting
    /// for the update cluster first; its workers wait for the same themselves, so all
    /// arrive together).
    fn sync_start(&mut self) -> Result<(), Stop> {
        self.make_iteration_dirs()?;
        let mine = self.plan_fingerprints();
        let model = self.choose_rollout_model()?;
        let name = WalkBarrier::SyncStart.name();
        let released = self.barrier_with(name, (), |node, _| msg::SyncStart {
            plans: msg::Plans::Sent(mine.clone()),
            pipeline: model,
            grown: node.grow_generation(),
        })?;
        // Released into a grown generation (ranks came back): the iteration starts there.
        if let Some(gen) = released.grown {
            self.moving_to = Some(gen);
            return Err(Stop::failed(format!(
                "moving to generation {gen} (ranks came back)"
            )));
        }
        if !self.is_master() {
            self.check_plans(&released.plans, &mine)?;
        }
        self.use_rollout_model(released.pipeline)?;
        self.note_model_used();
        Ok(())
    }

    /// `rollout-complete` and `eval-complete`: every rank's shard of `split` is committed,
    /// or its command failed and the run goes on without it (`merge-survivors`). A rank
    /// whose command wrote its shard name itself says so with its arrival (its journal's
    /// note), so rank 0's merge records it without reading every rank's journal (at 64
    /// nodes those reads were an eighth of rank 0's shared-directory operations); a rank
    /// whose command failed says how, from its journal too (so also after a restart).
    fn shards_complete(&mut self, b: WalkBarrier, split: Split) -> Result<(), Stop> {
        let it = self.machine.iteration();
        let note = journal::adopted(self.machine.journal().entries(), it, split.name());
        let failed = journal::rollout_failed(self.machine.journal().entries(), it, split.name());
        let mut gathered = None;
        let (members, n) = (self.members(), self.num_nodes());
        self.barrier(b.name(), msg::ShardArrival::of(note, failed), |arrivals| {
            gathered = Some(msg::Shards::gathered_from(members.ranks(), n, arrivals))
        })?;
        if let Some(shards) = gathered.as_ref().filter(|s| s.none_survived()) {
            return Err(self.no_survivors(split.name(), shards));
        }
        if let Some(shards) = gathered {
            self.machine.walk_mut().shards_gathered(split, shards);
        }
        Ok(())
    }

    /// `files-ready`: the merged train file is there; its release says whether this
    /// iteration evaluates, as rank 0 decides it.
    fn files_ready(&mut self) -> Result<bool, Stop> {
        let (split, iteration) = (self.cfg.cluster.rollout_split, self.machine.iteration());
        let interval = self.cfg.cluster.eval_interval;
        let name = WalkBarrier::FilesReady.name();
        let decision = self.barrier(name, (), |_| msg::EvalDecision {
            eval: walk::eval_decision(split, iteration, interval),
        })?;
        self.metrics_collector().eval_decided(decision.eval);
        Ok(decision.eval)
    }

    /// `training-complete`: each rank says whether its training failed; rank 0's release
    /// lists the ranks where it did, so every rank knows whether a model is handed off.
    /// Whether training failed anywhere.
    fn training_complete(&mut self) -> Result<(), Stop> {
        let gather = self.machine.walk_mut().training_gather();
        let name = WalkBarrier::TrainingComplete.name();
        let released = self.barrier(name, gather, IterationWalk::training_decide)?;
        if self.machine.walk_mut().training_released(released) {
            let summary = self.train_failure_summary();
            self.warn(&format!(
                "iteration {}: {summary}",
                self.machine.iteration()
            ));
        }
        if self.is_master() && self.cfg.phases.train.is_set() {
            self.note_trained();
        }
        Ok(())
    }

    /// `handoff-complete`: workers take the model rank 0 handed off (relative to the
    /// shared directory: each node resolves it on its own mount).
    fn handoff_complete(&mut self) -> Result<(), Stop> {
        let model = self.model_record(self.machine.serving().model());
        let name = WalkBarrier::HandoffComplete.name();
        let released = self.barrier(name, (), |_| Some(msg::Handoff { model }))?;
        match released {
            Some(h) if !self.is_master() => self.adopt_model(&h.model).map(|_| ()),
            _ => Ok(()),
        }
    }

    /// `final-sync`: each rank's numbers for metrics.jsonl travel with its arrival.
    fn final_sync(&mut self) -> Result<(), Stop> {
        let metrics = self.metrics_collector().numbers();
        let mut gathered = None;
        let name = WalkBarrier::FinalSync.name();
        self.barrier(name, Some(msg::FinalSync { metrics }), |arrivals| {
            gathered = Some(arrivals);
        })?;
        if let Some(arrivals) = gathered {
            let numbers = arrivals.into_iter().map(|a| a.map(|f| f.metrics)).collect();
            let ranks = metrics::by_rank(self.members().ranks(), self.num_nodes(), numbers);
            self.metrics_collector().gathered(ranks);
        }
        Ok(())
    }

    /// Training, or on `reuse` the outcome journaled before a restart (training
    /// completed on every rank then).
    fn train_step(&mut self, reuse: bool) -> Result<(), Stop> {
        let it = self.machine.iteration();
        let outcome = if reuse {
            let failed = journal::latest_train(self.machine.journal().entries(), self.run_id(), it)
                .and_then(|e| e.failed.clone());
            self.info(&format!(
                "iteration {it}: training completed on every rank before the restart; not redone{}",
                failed
                    .as_ref()
                    .map(|f| format!(" (it failed on this rank: {f})"))
                    .unwrap_or_default()
            ));
            failed
        } else {
            let failed = if self.cfg.phases.train.is_set() {
                let out = self.layout.train_output(it, self.gen());
                self.train(&out)?
            } else {
                None
            };
            self.journal_train(failed.clone())?;
            failed
        };
        self.machine.walk_mut().trained(outcome);
        Ok(())
    }

    /// The rollout of `split`: planned when task files are configured, else one command
    /// per rank that splits its own data.
    fn any_rollout(
        &mut self,
        split: &str,
        phase: &str,
        rc: &crate::config::RolloutCommand,
    ) -> Result<(), Stop> {
        let pc = &rc.as_phase();
        if !pc.is_set() {
            return Ok(());
        }
        self.extra.clear();
        self.check_numbering(split, phase)?;
        // Workers start only once rank 0's command lets them (`workers-wait`).
        let gate = rc.workers_wait.then(|| self.ready_file(split));
        if let Some(marker) = &gate {
            self.extra
                .insert("ready_file", marker.display().to_string());
            if !self.is_master() {
                self.wait_for_rank_0s_ready(split, phase, marker, rc)?;
            }
        }
        match (&gate, self.is_master()) {
            (Some(marker), true) if !rc.workers_wait_for.trim().is_empty() => {
                self.relay_ready(split, phase, rc, marker.clone())?
            }
            _ => {}
        };
        let result = match self.plan_for(split) {
            Some(plan) => self.planned_rollout(split, phase, pc, plan),
            None => self.rollout(split, phase, pc),
        };
        self.machine.end_relay();
        self.extra.clear();
        self.publisher().stage(|r| r.progress = None);
        result
    }

    /// Rank 0 with `workers-wait-for`: the file its command creates by itself (e.g.
    /// webgym's `multinode_flags/instances_released_rank_0`) releases the workers.
    /// A left-over one is removed before the command starts (only rank 0 removes and
    /// watches it, so no worker can mistake an old one for this iteration's); while the
    /// command runs, the wait loop looks for it (`relay_round`) and then creates
    /// `{ready_file}`.
    fn relay_ready(
        &mut self,
        split: &str,
        phase: &str,
        rc: &crate::config::RolloutCommand,
        marker: PathBuf,
    ) -> Result<(), Stop> {
        let values = self.values(phase, Some(split), Path::new(""));
        let watched = PathBuf::from(self.cfg.template(&rc.workers_wait_for).render_raw(&values));
        self.watchdog
            .pet("removing a left-over workers-wait-for file");
        match self.store.remove_file(&watched) {
            Ok(()) => self.info(&format!(
                "removed the left-over {} before the {phase} command (phases.{phase}.workers-wait-for)",
                watched.display()
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                let reason = format!(
                    "cannot remove the left-over {} (phases.{phase}.workers-wait-for): {e}",
                    watched.display()
                );
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
        }
        self.machine.start_relay(Relay::new(watched, marker, phase));
        Ok(())
    }

    /// One look of the relay, at each round of the wait loop: once rank 0's command has
    /// created its file, create `{ready_file}` (once).
    fn relay_round(&mut self) {
        let Some(relay) = self.machine.relay() else {
            return;
        };
        let found = self.store.exists(relay.watched());
        if let Some(release) = self.machine.relay_looked(found) {
            let _ = self
                .store
                .create_new(&release.marker, release.note.as_bytes());
        }
    }

    /// This generation's `{ready_file}` of the current iteration's `split` rollout.
    fn ready_file(&self, split: &str) -> PathBuf {
        self.layout.gen_dir(self.gen()).join(format!(
            "ready-iter-{:04}-{split}",
            self.machine.iteration()
        ))
    }

    /// Rank 0, once its rollout of `split` is done (now or before a restart): create the
    /// ready file if its command did not, so no worker waits for a file that never comes.
    fn open_gate(&mut self, split: &str, rc: &crate::config::RolloutCommand) {
        if !rc.workers_wait || !self.is_master() || !rc.is_set() {
            return;
        }
        let marker = self.ready_file(split);
        self.watchdog.pet("publishing the ready file");
        if self.store.read(&marker).ok().flatten().is_none() {
            let _ = self.store.create_new(
                &marker,
                b"created by rl-node: rank 0's command ended without creating it\n",
            );
        }
    }

    /// A worker's wait for rank 0's `{ready_file}` (`phases.<phase>.workers-wait`), then
    /// `workers-delay`; through the one wait loop, so an abort, a dead rank 0 or a signal
    /// ends it within a poll.
    fn wait_for_rank_0s_ready(
        &mut self,
        split: &str,
        phase: &str,
        marker: &Path,
        rc: &crate::config::RolloutCommand,
    ) -> Result<(), Stop> {
        self.waiting.note = format!(
            "waiting for rank 0's {phase} command to create {} (phases.{phase}.workers-wait)",
            marker.display()
        );
        let note = self.waiting.note.clone();
        self.publisher().update(|r| r.progress = Some(note));
        let m = marker.to_path_buf();
        let deadline = self.clock.now() + rc.workers_wait_timeout;
        let waited = self.wait_for(deadline, move |n| {
            Ok(n.store.read(&m).ok().flatten().map(|_| ()))
        });
        match waited {
            Ok(()) => {}
            Err(Interrupt::Stop(s)) => return Err(s),
            Err(Interrupt::Deadline) => {
                let reason = format!(
                    "rank 0's {phase} command did not create {} within phases.{phase}.workers-wait-timeout ({})",
                    marker.display(),
                    humantime::format_duration(rc.workers_wait_timeout)
                );
                return Err(self.fail(AbortKind::Timeout, self.rank, None, reason, None));
            }
        }
        if !rc.workers_delay.is_zero() {
            self.waiting.note = format!(
                "phases.{phase}.workers-delay ({}) after rank 0's ready file",
                humantime::format_duration(rc.workers_delay)
            );
            let deadline = self.clock.now() + rc.workers_delay;
            let waited = self.wait_for(deadline, |_| Ok(None::<()>));
            if let Err(Interrupt::Stop(s)) = waited {
                return Err(s);
            }
        }
        self.info(&format!(
            "iteration {}: rank 0's {split} rollout let the workers start",
            self.machine.iteration()
        ));
        self.waiting.note.clear();
        self.publisher().update(|r| r.progress = None);
        Ok(())
    }

    /// Rank 0's merge: a dynamic rollout's items, else the rank shards.
    fn any_aggregate(&mut self, split: &str, have_shards: bool) -> Result<(), Stop> {
        match self.plan_for(split) {
            Some(plan)
                if plan.strategy == crate::work::plan::Strategy::Dynamic
                    && have_shards
                    && !self.cfg.phases.aggregate.is_set() =>
            {
                self.aggregate_items(split, &plan)
            }
            _ => self.aggregate(split, have_shards),
        }
    }

    /// Run this rank's rollout for `split` and commit its shard: the command writes
    /// this generation's partial file (`{output}`, `rank-R.partial.gG.jsonl`), which is
    /// renamed to `rank-R.jsonl` only after the command exited 0 and only while this
    /// generation is current. rl-node never replaces a file it did not write: a shard
    /// left by an earlier attempt is set aside first, and a command that wrote the shard
    /// name itself has that file adopted.
    fn rollout(&mut self, split: &str, phase: &str, pc: &PhaseCommand) -> Result<(), Stop> {
        if !pc.is_set() {
            return Ok(());
        }
        let (it, rank, gen) = (self.machine.iteration(), self.acting_rank(), self.gen());
        let partial = self.layout.shard_partial_gen(it, split, rank, gen);
        let shard = self.layout.shard(it, split, rank);
        self.watchdog.pet("preparing the rollout directory");
        for dir in [partial.parent(), shard.parent()].into_iter().flatten() {
            self.make_dir(dir)?;
        }
        // Elastic mode: this rollout's command, started before a regroup, went on
        // running through it; it is waited for and its output committed, not run again.
        let carried = self
            .carried
            .take()
            .filter(|c| c.iteration == it && c.split == split && c.rank == rank);
        let (partial, ran) = match carried {
            Some(c) => {
                self.info(&format!(
                    "iteration {it}: the {split} rollout started before the regroup goes on (pid {}); not started again",
                    c.running.pid
                ));
                self.set_aside_earlier("shard", &shard)?;
                let ran = self.wait_command(phase, pc, c.running, c.log);
                (c.partial, ran)
            }
            None => {
                // Left by an earlier attempt (committed but not journaled, or this
                // generation's own partial): kept (never lose trajectories), out of the
                // way, never merged.
                for (what, path) in [("shard", &shard), ("partial shard", &partial)] {
                    self.set_aside_earlier(what, path)?;
                }
                let resume_from = self.earlier_partial(split);
                if let Some(p) = &resume_from {
                    self.info(&format!(
                        "iteration {it}: the {split} rollout may resume from the earlier attempt's {} ({{resume_from}})",
                        p.display()
                    ));
                }
                self.extra.insert(
                    "resume_from",
                    resume_from
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                );
                let started = self.start_command(phase, pc, Some(split), &partial, false);
                self.extra.remove("resume_from");
                let (running, log) = started?;
                // Until it is waited out: a regroup meanwhile lets it go on (`regroup`).
                self.rolling = Some(regroup::Carried {
                    iteration: it,
                    split: split.to_string(),
                    rank,
                    partial: partial.clone(),
                    running: running.clone(),
                    log: log.clone(),
                });
                let ran = self.wait_command(phase, pc, running, log);
                if ran.is_ok() {
                    self.rolling = None;
                }
                (partial, ran)
            }
        };
        let (log, ended) = ran?;
        if let Err(failure) = ended {
            // A stand-in's failure is its own: the dropped rank's shard is not left out.
            if let Some(r) = self.acting_for {
                let reason = format!(
                    "{} (standing in for dropped rank {r})",
                    failure.reason(phase, pc)
                );
                return Err(self.fail(failure.abort_kind(), self.rank, None, reason, Some(&log)));
            }
            // Stops the cluster, but with `merge-survivors`: then no shard is committed.
            return self.rollout_failed(split, phase, pc, &failure, &log);
        }
        let rules = commit::Rules {
            site: Site::ShardCommit,
            output: partial.clone(),
            dest: shard.clone(),
            look: true,
            dirs: false,
            synced: false,
            written: commit::Written::Adopt,
            nothing: match self.cfg.aggregate.allow_empty_shards {
                true => commit::Nothing::Empty,
                false => commit::Nothing::Refuse,
            },
            taken: commit::Taken::Fail,
            journal_first: journal::journals_before_commit(self.broken.journal)
                .then(|| format!("rollout-{split}")),
        };
        let what = format!("commit its {split} shard of iteration {it}");
        let outcome = self.commit(rules, &what)?;
        let (partial_d, shard_d) = (partial.display(), shard.display());
        let adopted = match outcome {
            commit::Outcome::Committed { adopted, empty } => {
                if adopted {
                    self.append_log(&log, &format!("### rl-node: the command wrote {shard_d} itself (not {{output}}); adopted as this rank's shard\n"));
                    self.info(&format!(
                        "the {phase} command wrote the shard {shard_d} itself; adopted"
                    ));
                    self.machine
                        .journal_mut()
                        .note(format!("adopted: the command wrote {shard_d} itself"));
                }
                if empty {
                    self.append_log(&log, &format!("### rl-node: the command wrote no {partial_d}; committing an empty shard (aggregate.allow-empty-shards)\n"));
                    self.info(&format!("the {phase} command wrote no output; empty shard committed (aggregate.allow-empty-shards)"));
                }
                adopted
            }
            commit::Outcome::Refused(why) => {
                let reason = match why {
                    commit::Refusal::Both => format!("the {phase} command wrote both {{output}} ({partial_d}) and the shard name itself ({shard_d}): rl-node does not know which is the shard and replaces neither"),
                    commit::Refusal::Nothing => format!("the {phase} command exited 0 but wrote no output: neither {{output}} ({partial_d}) nor {shard_d} exists"),
                    commit::Refusal::NotAFile(p) => format!("cannot commit {}: not a regular file", p.display()),
                    commit::Refusal::WroteFinal => unreachable!("a shard the command wrote is adopted"),
                };
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, Some(&log)));
            }
            commit::Outcome::Failed { taken: true, .. } => {
                let reason = format!("cannot commit {shard_d}: another writer created it while this rank's command ran (not replaced)");
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
            commit::Outcome::Failed { error, .. } => {
                let reason = format!("cannot commit {shard_d}: {error}");
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
            commit::Outcome::Lost => unreachable!("a shard's commit does not yield"),
        };
        exercised::note(exercised::Path::ShardCommits);
        self.event(events::Event::Commit {
            split: split.to_string(),
            path: shard.display().to_string(),
            adopted,
        });
        Ok(())
    }

    /// Elastic mode: the per-rank rollouts of `split` of the dropped ranks this member
    /// stands in for, each under the dropped rank's number (`{rank}`, shard, log), unless
    /// the rank committed it itself before it was lost (its journal says so). Journaled
    /// in this rank's journal, so a restart does not redo it.
    fn stand_in_rollouts(
        &mut self,
        split: Split,
        rc: &crate::config::RolloutCommand,
    ) -> Result<(), Stop> {
        if !rc.as_phase().is_set() {
            return Ok(());
        }
        let (name, phase) = match split {
            Split::Train => ("train", "rollout"),
            Split::Eval => ("eval", "eval"),
        };
        let item = format!("rollout-{name}");
        let it = self.machine.iteration();
        for r in self.standing_in_for() {
            if self.dropped_rank_did(r, &item) {
                self.info(&format!(
                    "iteration {it}: dropped rank {r} committed its {name} rollout before it was lost; not redone"
                ));
                continue;
            }
            self.info(&format!(
                "iteration {it}: running dropped rank {r}'s {name} rollout in its place"
            ));
            self.acting_for = Some(r);
            let done = self.once(&format!("{item}.for-rank-{r}"), |n| {
                n.any_rollout(name, phase, rc)
            });
            self.acting_for = None;
            done?;
            self.event(events::Event::StoodIn {
                dropped: r,
                split: name.to_string(),
            });
        }
        Ok(())
    }

    /// The partial output an earlier generation's attempt at this rollout left where it was
    /// (its name carries its generation): offered to the command to continue from, never
    /// changed. A command that names its own partial file (webgym's `….checkpoint`) left
    /// it under the configured partial name, without a generation: that one comes first.
    fn earlier_partial(&self, split: &str) -> Option<PathBuf> {
        let (it, rank, gen) = (self.machine.iteration(), self.acting_rank(), self.gen());
        std::iter::once(self.layout.shard_partial(it, split, rank))
            .chain(
                (1..gen)
                    .rev()
                    .map(|g| self.layout.shard_partial_gen(it, split, rank, g)),
            )
            .find(|p| {
                self.store
                    .stat(p)
                    .ok()
                    .flatten()
                    .is_some_and(|m| m.len > 0 || m.kind == Kind::Dir)
            })
    }

    /// Move a file an earlier attempt left at `path` (committed but not journaled, or this
    /// generation's own partial) to `<path>.stale-genG`: kept, never lost, never merged,
    /// and out of the way so a commit never has to replace it.
    /// Fenced: the file may be the current generation's, committed after this node's
    /// generation was replaced (a node frozen in its rollout wakes up to commit).
    fn set_aside_earlier(&mut self, what: &str, path: &Path) -> Result<(), Stop> {
        if !self.store.exists(path) {
            return Ok(());
        }
        self.fence_at(
            Site::SetAside,
            &format!("set the earlier {what} {} aside", path.display()),
        )?;
        let aside =
            crate::state::side_path(&*self.store, path, &format!("stale-gen{}", self.gen()));
        if let Err(e) = self.store.rename(path, &aside) {
            let reason = format!(
                "cannot set the earlier {what} {} aside: {e}",
                path.display()
            );
            return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
        }
        self.info(&format!(
            "an earlier attempt's {what} {} was set aside as {} (kept, not used)",
            path.display(),
            aside.display()
        ));
        Ok(())
    }

    /// Rank 0's prepare command writes this generation's `prepared.gG.partial` (`{output}`),
    /// renamed to `rollouts/iter-NNNN/prepared` (a file or a directory) when it exits 0
    /// and this generation is still current. A `prepared` left by an earlier attempt is
    /// set aside first, never replaced.
    fn prepare(&mut self, pc: &PhaseCommand) -> Result<(), Stop> {
        let (it, gen) = (self.machine.iteration(), self.gen());
        let out = self.layout.prepared_partial(it, gen);
        let done = self.layout.prepared(it);
        self.set_aside_earlier("prepared data", &done)?;
        self.set_aside_earlier("prepared data", &out)?;
        if let Some(dir) = out.parent() {
            let _ = self.store.create_dir_all(dir);
        }
        self.run_command("prepare", pc, None, &out, false)?;
        if !self.store.exists(&out) {
            // Prepare commands may write elsewhere (e.g. a data directory of their own).
            return Ok(());
        }
        let rules = commit::Rules {
            site: Site::Other,
            output: out.clone(),
            dest: done.clone(),
            look: false,
            dirs: true,
            synced: false,
            written: commit::Written::NotLooked,
            nothing: commit::Nothing::Refuse,
            taken: commit::Taken::Fail,
            journal_first: None,
        };
        let what = format!("commit the prepared data of iteration {it}");
        // Durable before its name is: the journal entry that follows says it is there, and
        // a crash must not leave the name with the command's unwritten-back data lost.
        if let commit::Outcome::Failed { error, .. } = self.commit(rules, &what)? {
            let reason = format!(
                "cannot commit {} as {}: {error}",
                out.display(),
                done.display()
            );
            return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
        }
        Ok(())
    }

    /// Rank 0 merges the iteration's committed shards of `split` (built-in JSONL
    /// concatenation in rank order, or the configured aggregate command).
    fn aggregate(&mut self, split: &str, have_shards: bool) -> Result<(), Stop> {
        let it = self.machine.iteration();
        let out = self.layout.aggregated(it, split);
        let pc = self.cfg.phases.aggregate.clone();
        // The shards (and items, which only a merge command reads) were committed by other
        // ranks' clients: a FUSE mount may still answer lookups of them from its cache (a
        // run's names set aside by --fresh, names looked up before they existed).
        let shards = self.layout.rollout_dir(it, split);
        if pc.is_set() {
            let _ = self.store.refresh(&shards);
            let _ = self.store.refresh(&self.layout.items_dir(it, split));
            return self.aggregate_command(split, &pc);
        }
        if !have_shards {
            return Ok(());
        }
        let _ = self.store.refresh(&shards);
        // Committed by an attempt that crashed before journaling it: kept, out of the
        // way, so the merge never replaces a file (it may have been used meanwhile).
        self.set_aside_earlier("merged file", &out)?;
        self.set_aside_earlier("merge manifest", &crate::aggregate::manifest_path(&out))?;
        self.watchdog.pet("aggregating shards");
        let mut opts = crate::aggregate::MergeOptions::from_config(&self.cfg.aggregate); // allow_missing: false
        opts.command_log = Some(self.layout.phase_log(it, self.rank, "aggregate"));
        (opts.registry, opts.kill_grace) = (self.launcher.registry(), self.cfg.timing.kill_grace);
        let fence = self.fence_fn();
        opts.mutation = self.broken.merge;
        let gathered = Split::of(split).and_then(|s| self.machine.walk_mut().take_shards(s));
        if let Some(g) = &gathered {
            opts.adopted = Some(g.adopted.clone());
            opts.failed = self.failed_for_merge(g, split);
        }
        let left_out = opts.failed.clone();
        opts.rollout_model =
            self.machine
                .serving()
                .rollout_of(it)
                .map(|m| crate::aggregate::RolloutModel {
                    // Relative to the shared directory, like every path of a manifest (a
                    // `model.json` of an earlier version holds an absolute one).
                    model: self
                        .model_from_record(&m.model)
                        .map(|p| self.model_record(&p))
                        .unwrap_or_else(|_| m.model.clone()),
                    model_version: m.model_version,
                    staleness: m.staleness,
                });
        let values = self.values("aggregate", Some(split), &out);
        opts.env = self
            .command_env(&values)
            .into_iter()
            .filter(|(k, _)| self.cfg.env.contains_key(k))
            .collect();
        let n = self.num_nodes();
        // The merge is a job the node's wait loop watches, so a peer's abort or a Ctrl-C
        // is honoured within a poll even while a large merge (or a merge command) runs;
        // its own deadline is the merge command's timeout, else none.
        let (layout, split_owned) = (self.layout.clone(), split.to_string());
        let (rank, store) = (self.rank, self.store.clone());
        let merged = self.job("aggregating shards", move |cancel, wd| {
            let fence = cancel.fenced(fence);
            opts.fence = Some(std::sync::Arc::new(move || fence(Site::MergePublish)));
            // Every rank committed its shard before it arrived at the barrier that let
            // this merge start: on a FUSE mount, this client may still say one is missing.
            let shards: Vec<PathBuf> = (0..n)
                .filter(|r| !left_out.contains_key(r))
                .map(|r| layout.shard(it, &split_owned, r))
                .collect();
            wd.pet("waiting for the shards to be visible");
            // Only a real mount's client caches lookups (a simulated one has no such wait).
            let dir = shards.first().and_then(|s| s.parent());
            let cached = dir.is_some_and(|d| store.caches_lookups(d));
            let waited = cached.then(|| crate::store::fs::await_visible(&shards)).flatten();
            if let Some(waited) = waited {
                logging::warn(
                    rank,
                    &format!(
                        "waited {:.1}s for this node's client to see the {split_owned} shards other ranks committed (its negative-lookup cache; a shorter negative timeout on the mount avoids the wait)",
                        waited.as_secs_f64()
                    ),
                );
            }
            crate::aggregate::merge(&*store, &layout, it, &split_owned, n, &opts, &mut || {
                wd.pet("aggregating shards")
            })
        })?;
        let merged = merged.unwrap_or_else(|| {
            Err(crate::aggregate::AggregateError::Write {
                path: out.clone(),
                source: std::io::Error::other("the merge thread panicked"),
            })
        });
        match merged {
            Ok(summary) => {
                exercised::note(exercised::Path::Merges);
                if let Some(g) = &gathered {
                    self.survivors_merged(g, split);
                }
                self.event(events::Event::Aggregate {
                    split: split.to_string(),
                    merged: events::Aggregated::Shards {
                        records: summary.records,
                        bytes: summary.bytes,
                    },
                });
                Ok(())
            }
            Err(crate::aggregate::AggregateError::Fenced { reason }) => {
                Err(self.fenced(&reason, &format!("publish {}", out.display())))
            }
            Err(e) => Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("aggregating {split} shards into {}: {e}", out.display()),
                None,
            )),
        }
    }

    /// Rank 0's `[phases.aggregate] command` writes this generation's partial merged file
    /// (`{output}`, `train.partial.gG.jsonl`), renamed to the merged file only after the
    /// command exited 0 and only while this generation is current, never over an existing
    /// file: a merge of an older generation that wakes up (a frozen host) writes its own
    /// partial, which nobody commits. A merged file an earlier attempt committed but did
    /// not journal is set aside first; older generations' partials stay where they are.
    fn aggregate_command(&mut self, split: &str, pc: &PhaseCommand) -> Result<(), Stop> {
        let (it, gen) = (self.machine.iteration(), self.gen());
        let out = self.layout.aggregated_partial(it, split, gen);
        let done = self.layout.aggregated(it, split);
        self.set_aside_earlier("merged file", &done)?;
        self.set_aside_earlier("partial merged file", &out)?;
        if let Some(dir) = out.parent() {
            self.make_dir(dir)?;
        }
        let log = self.run_command("aggregate", pc, Some(split), &out, false)?;
        let rules = commit::Rules {
            site: Site::MergePublish,
            output: out.clone(),
            dest: done.clone(),
            look: true,
            dirs: true,
            synced: false,
            written: commit::Written::Refuse,
            nothing: commit::Nothing::Refuse,
            taken: commit::Taken::Fail,
            journal_first: None,
        };
        let what = format!("commit the merged {split} file of iteration {it}");
        let (out_d, done_d) = (out.display(), done.display());
        let (reason, log) = match self.commit(rules, &what)? {
            commit::Outcome::Committed { .. } => {
                exercised::note(exercised::Path::Merges);
                return Ok(());
            }
            commit::Outcome::Refused(why) => (match why {
                commit::Refusal::NotAFile(_) => format!("the aggregate command's {{output}} {out_d} is not a regular file or a directory; not committed"),
                commit::Refusal::Both => format!("the aggregate command wrote both {{output}} ({out_d}) and the merged file's name itself ({done_d}): rl-node does not know which is the merge and replaces neither"),
                commit::Refusal::WroteFinal => format!("the aggregate command wrote the merged file {done_d} itself instead of {{output}} ({out_d}): rl-node commits only {{output}}, which it renames into place after the command exits 0"),
                commit::Refusal::Nothing => format!("the aggregate command exited 0 but wrote no output: {{output}} ({out_d}) does not exist"),
            }, Some(&log)),
            commit::Outcome::Failed { taken: true, .. } => (format!("cannot commit {done_d}: another writer created it while the aggregate command ran (not replaced)"), None),
            commit::Outcome::Failed { error, .. } => (format!("cannot commit {out_d} as {done_d}: {error}"), None),
            commit::Outcome::Lost => unreachable!("a merge's commit does not yield"),
        };
        Err(self.fail(
            AbortKind::Error,
            self.rank,
            None,
            reason,
            log.map(PathBuf::as_path),
        ))
    }

    /// Run `work` unless this rank journaled `item` for the current iteration; journal it
    /// once its outputs are committed.
    fn once(
        &mut self,
        item: &str,
        work: impl FnOnce(&mut Node) -> Result<(), Stop>,
    ) -> Result<(), Stop> {
        let (it, run_id) = (self.machine.iteration(), self.run_id().to_string());
        if self.machine.journal_mut().done(&run_id, it, item) {
            // A rollout that failed under `merge-survivors` is done too, with no output.
            match self.machine.journal().failure(it, item) {
                Some(f) => self.info(&format!(
                    "iteration {it}: {item} failed ({f}) before this generation began and the run went on without it; not redone"
                )),
                None => self.info(&format!(
                    "iteration {it}: {item} was completed before this generation began; reusing its output"
                )),
            }
            self.event(events::Event::Reused {
                item: item.to_string(),
            });
            return Ok(());
        }
        work(self)?;
        crate::checkpoint::crash_point(&format!(
            "after-commit:{item}@{}",
            self.machine.iteration()
        ));
        self.journal_item(item)
    }

    /// Append `item` for the current iteration to this rank's journal, durably, unless it
    /// is there.
    fn journal_item(&mut self, item: &str) -> Result<(), Stop> {
        if self
            .machine
            .journal()
            .has(self.run_id(), self.machine.iteration(), item)
        {
            return Ok(());
        }
        self.append_journal(item, None)
    }

    /// Append `item` (with `failed`, for training) for the current iteration to this
    /// rank's journal, durably.
    fn append_journal(&mut self, item: &str, failed: Option<String>) -> Result<(), Stop> {
        let entry = journal::Entry {
            run_id: self.run_id().to_string(),
            gen: self.gen(),
            rank: self.rank,
            iteration: self.machine.iteration(),
            item: item.to_string(),
            at: self.wall_stamp(),
            note: None,
            failed,
            checkpoint: None,
        };
        let entry = self.machine.journal_mut().next(entry);
        self.fence_at(
            Site::JournalAppend,
            &format!("journal {item} of iteration {}", self.machine.iteration()),
        )?;
        let path = self.layout.journal(self.rank);
        self.watchdog.pet("writing the journal");
        let line = format!("{}\n", serde_json::to_string(&entry).expect("json"));
        if let Err(e) = self.store.append(&path, line.as_bytes(), true) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot write the journal {}: {e}", path.display()),
                None,
            ));
        }
        self.event(events::Event::Journal {
            item: item.to_string(),
        });
        self.machine.journal_mut().appended(entry);
        Ok(())
    }

    /// Rank 0, on a mount whose client caches lookups (FUSE): make the directories every
    /// rank writes into this iteration before the barrier that lets them. A directory
    /// another client made can stay invisible to a node that looked for it too early (its
    /// negative cache), and to rank 0 itself when it set an earlier one aside (`--fresh`);
    /// made here, by rank 0 first, no node's cache ever held it as missing while it was
    /// made. Elsewhere each rank makes what it needs when it needs it.
    fn make_iteration_dirs(&mut self) -> Result<(), Stop> {
        if !self.is_master() || !self.store.caches_lookups(self.layout.root()) {
            return Ok(());
        }
        let (it, l) = (self.machine.iteration(), &self.layout);
        let mut dirs = vec![];
        if let Some(logs) = l.phase_log(it, 0, "rollout").parent() {
            dirs.push(logs.to_path_buf());
        }
        if self.cfg.cluster.rl_phase != crate::config::RlPhase::Rollout {
            dirs.push(l.train_output(it, self.gen()));
        }
        if self.cfg.cluster.rl_phase != crate::config::RlPhase::Update {
            let c = &self.cfg.cluster;
            for split in walk::splits_rolled_out(c.rollout_split, it, c.eval_interval) {
                dirs.push(l.rollout_dir(it, split.name()));
            }
        }
        for d in dirs {
            self.make_dir(&d)?;
        }
        Ok(())
    }

    /// `create_dir_all` of `dir`; a failure is this rank's.
    fn make_dir(&mut self, dir: &Path) -> Result<(), Stop> {
        self.store.create_dir_all(dir).map_err(|e| {
            let reason = format!("cannot create {}: {e}", dir.display());
            self.fail(AbortKind::Error, self.rank, None, reason, None)
        })
    }

    /// This rank's training command (phase 10). A failure stops the cluster, unless
    /// `phases.train.on-failure = "keep-model"`: then it is logged with the usual failure
    /// message, recorded as an event, and returned (why, in a few words) so that it is
    /// journaled and reported at the `training-complete` barrier.
    fn train(&mut self, out: &Path) -> Result<Option<String>, Stop> {
        let tc = self.cfg.phases.train.clone();
        let pc = tc.as_phase();
        // `{output}` exists, as this node's client sees it, before the command runs: every
        // rank's trainer writes into it, and on a FUSE mount a `mkdir -p` of a directory
        // another rank's client made can fail with "File exists" while it stays invisible.
        self.make_dir(out)?;
        let (log, ended) = self.run_command_to_end("train", &pc, None, out, true)?;
        let Err(failure) = ended else {
            return Ok(None);
        };
        self.hold_for_a_loss(&format!("the train command {}", failure.short()))?;
        if tc.policy() == crate::config::OnTrainFailure::Stop {
            return Err(self.command_failed("train", &pc, &failure, &log));
        }
        let goes_on = format!(
            "phases.train.on-failure = \"keep-model\": the cluster goes on; this iteration publishes no checkpoint and the model stays {}",
            self.machine.serving().label()
        );
        let reason = self.warn_survived("train", &pc, &failure, &log, &goes_on);
        self.event(events::Event::TrainFailed {
            failed: failure.short(),
            reason,
            log: log.display().to_string(),
        });
        Ok(Some(failure.short()))
    }

    /// Elastic mode: a command spread over the nodes (torchrun's training) fails on the
    /// survivors as soon as one node dies, well before the death is declared. Before its
    /// failure is taken as this rank's, the node watches its peers for dead-after (and a
    /// poll): a member declared dead meanwhile is the cause, and the members left redo
    /// the command without it (the stop returned here ends the generation).
    fn hold_for_a_loss(&mut self, what: &str) -> Result<(), Stop> {
        if !self.cfg.elastic() {
            return Ok(());
        }
        let t = &self.cfg.timing;
        let hold = t.dead_after + 2 * t.poll_interval + t.heartbeat_interval;
        self.info(&format!(
            "{what}; watching the other nodes for {} before taking it as this rank's failure (a node lost meanwhile is the cause)",
            humantime::format_duration(hold)
        ));
        self.waiting.note = format!("a node lost after {what}");
        let until = self.clock.now() + hold;
        let held = self.wait_for(until, |_| Ok(None::<()>));
        self.waiting.note.clear();
        match held {
            Err(Interrupt::Stop(stop)) => Err(stop),
            Ok(()) | Err(Interrupt::Deadline) => Ok(()),
        }
    }

    /// Warn of a failed `phase` command the cluster survives, as its abort would have
    /// said it (who, where, why, the log and its last lines), then `goes_on`: what the
    /// cluster does instead. Returns the reason, for the event.
    fn warn_survived(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        failure: &CommandFailure,
        log: &Path,
        goes_on: &str,
    ) -> String {
        let info = self.abort_info(
            failure.abort_kind(),
            self.rank,
            None,
            failure.reason(phase, pc),
            Some(log),
        );
        let mut message = info.describe();
        let tail = procs::tail(log, 20);
        if !tail.is_empty() {
            message.push_str("\n  last lines of the log:");
            for line in tail.lines() {
                message.push_str(&format!("\n  | {line}"));
            }
        }
        message.push_str(&format!("\n  {goes_on}"));
        self.warn(&message);
        info.reason
    }

    /// Journal this rank's outcome of training in the current iteration: its latest entry
    /// is the outcome, so a redo appends one only when the outcome differs (a redo that
    /// succeeds like the attempt before it leaves the journal as it was).
    fn journal_train(&mut self, failed: Option<String>) -> Result<(), Stop> {
        let latest = journal::latest_train(
            self.machine.journal().entries(),
            self.run_id(),
            self.machine.iteration(),
        );
        if latest.is_some_and(|e| e.failed == failed) {
            return Ok(());
        }
        self.append_journal(journal::item::TRAIN, failed)
    }

    /// `training failed on rank(s) 1 (exit code 3); kept model iter-0002`, for the
    /// current iteration's failures.
    fn train_failure_summary(&self) -> String {
        let ranks: Vec<String> = self
            .machine
            .walk()
            .training_failures()
            .iter()
            .map(|(r, why)| format!("{r} ({why})"))
            .collect();
        format!(
            "training failed on rank(s) {}; kept {}",
            ranks.join(", "),
            self.machine.serving().kept_label(&self.layout.models())
        )
    }

    /// Rank 0, when this iteration's training failed somewhere: no hand-off command, no
    /// publication, `models/LATEST` unchanged. Journaled (with the outcome as its note) so
    /// `rl-node status` shows it.
    fn skip_handoff(&mut self) -> Result<(), Stop> {
        let summary = self.train_failure_summary();
        let it = self.machine.iteration();
        if self
            .machine
            .journal()
            .has(self.run_id(), it, journal::item::HANDOFF_SKIPPED)
        {
            return Ok(());
        }
        self.info(&format!(
            "iteration {it}: no checkpoint is handed off (phases.train.on-failure = \"keep-model\"); the model stays {}",
            self.machine.serving().label()
        ));
        let failed = self
            .machine
            .walk()
            .training_failures()
            .iter()
            .map(|(r, why)| events::RankFailure {
                rank: *r,
                failed: why.clone(),
            })
            .collect();
        self.event(events::Event::HandoffSkipped {
            failed,
            model: self.machine.serving().model().to_string(),
            summary: summary.clone(),
        });
        self.machine.journal_mut().note(summary);
        self.journal_item(journal::item::HANDOFF_SKIPPED)
    }

    /// Rank 0 publishes the iteration's training output as an immutable checkpoint and
    /// switches `models/LATEST` to it (see `crate::checkpoint`).
    fn handoff(&mut self) -> Result<(), Stop> {
        let cfg = self.cfg.phases.handoff.clone();
        // Training writes into its generation's directory; when it was not redone after a
        // restart, the generation that trained is the one in rank 0's journal.
        let trained_in = self
            .machine
            .journal()
            .newest(self.machine.iteration(), journal::item::TRAIN)
            .map_or(self.gen(), |e| e.gen);
        let train_out = self
            .layout
            .train_output(self.machine.iteration(), trained_in);
        let name = crate::layout::iter_dir(self.machine.iteration());
        let models = self.layout.models();
        // A checkpoint an interrupted hand-off moved out of the training output is there no
        // more: publishing it (or keeping the one published) comes before any pick.
        let moved =
            crate::checkpoint::pending_move(&*self.store, &models, &name, self.gen()).is_some();
        let unfinished = moved || self.store.exists_followed(&models.join(&name));
        if moved {
            // The handoff command had finished before the checkpoint was moved.
            self.info(&format!(
                "iteration {}: a hand-off interrupted after moving the checkpoint is finished; the handoff command is not run again",
                self.machine.iteration()
            ));
        } else if !cfg.command.trim().is_empty() {
            self.run_command("handoff", &cfg.as_phase(), None, &train_out, false)?;
        }
        let has_files = |d: &Path| self.store.read_dir(d).is_ok_and(|e| !e.is_empty());
        let source = if unfinished {
            Some(train_out.clone())
        } else {
            crate::checkpoint::pick(&*self.store, &train_out, &cfg.pick)
                .or_else(|| has_files(&train_out).then(|| train_out.clone()))
        };
        let Some(source) = source else {
            if self.cfg.phases.train.is_set() {
                self.warn(&format!(
                    "training wrote nothing under {}; the model stays {}",
                    train_out.display(),
                    self.machine.serving().label()
                ));
            }
            return Ok(());
        };
        self.watchdog.pet("publishing the checkpoint");
        let started = self.clock.now();
        // Checked inside, right before the rename and before LATEST.
        let fence = self.fence_fn();
        let previous = self.machine.serving().model().to_string();
        let mut opts = cfg.options();
        opts.mutation = self.broken.checkpoint;
        opts.created_at = Some(self.wall_stamp());
        // A job the loop watches: a copy of a large checkpoint (and its hashes) takes
        // minutes, in which a peer's abort or a Ctrl-C is honoured within a poll.
        let (store, gen) = (self.store.clone(), self.gen());
        let (from, to, named) = (source.clone(), models.clone(), name.clone());
        let outcome = self.job("publishing the checkpoint", move |cancel, wd| {
            let mut fence = cancel.fenced(fence);
            crate::checkpoint::publish_opts(
                &*store,
                &from,
                &to,
                &named,
                gen,
                &opts,
                &mut fence,
                &mut || wd.pet("publishing the checkpoint"),
            )
        })?;
        let outcome = outcome.unwrap_or_else(|| {
            Err(crate::checkpoint::PublishError::Io {
                path: models.join(&name),
                source: std::io::Error::other("the checkpoint job panicked"),
            })
        });
        let fence = self.fence_fn();
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(crate::checkpoint::PublishError::Fenced { reason, .. }) => {
                return Err(self.fenced(&reason, &format!("publish the checkpoint {name}")));
            }
            Err(e) => {
                // An older generation woken mid-publication finds its partial directory
                // taken over: that is being fenced off, not a failure of its own.
                if let Err(reason) = fence(Site::Other) {
                    return Err(self.fenced(&reason, &format!("publish the checkpoint {name}")));
                }
                let reason = format!(
                    "publishing {} as {name} failed: {e}; the model stays {}",
                    source.display(),
                    self.machine.serving().label()
                );
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
        };
        let secs = self.clock.elapsed(started).as_secs_f64();
        let source = outcome.source.clone();
        match &outcome.published {
            crate::checkpoint::Published::Kept(p) => self.warn(&format!(
                "{} was already published by an earlier attempt; checkpoints are immutable, so it is kept and {} is not published",
                p.display(),
                source.display()
            )),
            crate::checkpoint::Published::LatestAhead { latest, .. } => self.warn(&format!(
                "models/LATEST already names {}, a newer verified checkpoint; it only moves forward, so it is left alone",
                latest.display()
            )),
            crate::checkpoint::Published::New(_) => {}
        }
        let dest = outcome.published.path().to_path_buf();
        self.machine.serving_mut().adopt(dest.display().to_string());
        self.machine.journal_mut().checkpoint(name.clone());
        let how = match &outcome.how {
            crate::checkpoint::How::Moved => "moved".to_string(),
            crate::checkpoint::How::Resumed => {
                "moved by an interrupted hand-off, finished".to_string()
            }
            crate::checkpoint::How::Copied { why: None } => {
                "copied (phases.handoff.transfer = \"copy\")".to_string()
            }
            crate::checkpoint::How::Copied { why: Some(why) } => {
                format!("copied, not moved: {why}")
            }
            crate::checkpoint::How::Existing => "kept".to_string(),
        };
        let excluded = match outcome.excluded {
            0 => String::new(),
            n => format!(
                "; {n} file(s) left out by phases.handoff.exclude stay in {}",
                source.display()
            ),
        };
        self.info(&format!(
            "iteration {}: published checkpoint {} from {} in {secs:.2}s ({how}{excluded})",
            self.machine.iteration(),
            dest.display(),
            source.display(),
        ));
        exercised::note(exercised::Path::Handoffs);
        self.event(events::Event::Handoff {
            model: self.machine.serving().model().to_string(),
            source: source.display().to_string(),
            transfer: outcome.how.label().to_string(),
            excluded: outcome.excluded,
            secs,
        });
        self.prune_checkpoints(&previous)
    }

    /// Rank 0, after a hand-off: delete checkpoints beyond `phases.handoff.keep-last`
    /// (see `checkpoint::prune`), sparing the eval iterations' and `previous`, the model
    /// served until this hand-off (the fallback until the new one is live).
    fn prune_checkpoints(&mut self, previous: &str) -> Result<(), Stop> {
        let keep_last = self.cfg.phases.handoff.keep_last as usize;
        if keep_last == 0 {
            return Ok(());
        }
        let models = self.layout.models();
        let previous = Path::new(previous)
            .strip_prefix(&models)
            .ok()
            .and_then(|p| crate::layout::iteration_of(&p.to_string_lossy()));
        let (split, interval) = (
            self.cfg.cluster.rollout_split,
            self.cfg.cluster.eval_interval,
        );
        // iter-NNNN is served through iteration NNNN + 1: what that iteration's eval measured.
        let keep_eval = self.cfg.keeps_eval_checkpoints();
        let spare = move |it: u64| {
            Some(it) == previous
                || (keep_eval && crate::protocol::walk::eval_decision(split, it + 1, interval))
        };
        self.watchdog.pet("deleting old checkpoints");
        let (fence, store) = (self.fence_fn(), self.store.clone());
        // A job the loop watches: deleting a large checkpoint takes a while on a network
        // filesystem.
        let pruned = self.job("deleting old checkpoints", move |cancel, _| {
            let mut fence = cancel.fenced(fence);
            crate::checkpoint::prune(&*store, &models, keep_last, &spare, &mut fence)
        })?;
        let pruned = pruned.unwrap_or_else(|| {
            Err(crate::checkpoint::PublishError::Io {
                path: self.layout.models(),
                source: std::io::Error::other("the prune job panicked"),
            })
        });
        match pruned {
            Ok(deleted) if deleted.is_empty() => Ok(()),
            Ok(deleted) => {
                self.info(&format!(
                    "deleted checkpoint(s) {} (phases.handoff.keep-last = {keep_last})",
                    deleted.join(", ")
                ));
                self.event(events::Event::CheckpointsDeleted { names: deleted });
                Ok(())
            }
            Err(crate::checkpoint::PublishError::Fenced { reason, .. }) => {
                Err(self.fenced(&reason, "delete old checkpoints"))
            }
            Err(e) => {
                let reason = format!("deleting old checkpoints failed: {e}");
                Err(self.fail(AbortKind::Error, self.rank, None, reason, None))
            }
        }
    }

    /// Start `command` in its own process group, registered for stopping (also by the
    /// guardian if this node is killed) and marked with `RL_NODE_OWNER` so descendants
    /// that leave the group are found too; a failure to start is this node's failure.
    fn spawn_supervised(
        &mut self,
        what: &str,
        command: &str,
        env: &[(String, String)],
        log: &Path,
        header: &str,
    ) -> Result<procs::Running, Stop> {
        self.watchdog.pet("starting a command");
        let mut started = self.launcher.start(command, env, log, header);
        // A link or a foreign file planted at the log's name (or on the way) is set aside,
        // never written through; the command then gets a new log (docs/shared-directory.md,
        // "What rl-node trusts").
        if let Some(refused) = started.as_ref().err().and_then(crate::store::Untrusted::of) {
            let refused = refused.clone();
            match self.store.set_aside_untrusted(&refused) {
                Ok(aside) => {
                    self.warn(&crate::store::set_aside_note(&refused, &aside));
                    started = self.launcher.start(command, env, log, header);
                }
                Err(e) => self.warn(&format!("{refused}; cannot move it aside: {e}")),
            }
        }
        match started {
            Ok(pid) => Ok(procs::Running {
                pid,
                started: self.clock.now(),
            }),
            Err(e) => Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot start {what}: {e}"),
                Some(log),
            )),
        }
    }

    /// A command's leader exited: stop whatever it left behind, in its process group or
    /// outside it (noting it in `log`, if given), and forget the group.
    fn reap(&mut self, pid: i32, log: Option<&Path>) {
        self.watchdog.pet("stopping leftover processes");
        let left = self.launcher.stop(pid, self.cfg.timing.kill_grace);
        if let (true, Some(log)) = (left.any(), log) {
            let outside = match left.outside {
                0 => String::new(),
                n => format!(" ({n} outside its process group)"),
            };
            self.append_log(
                log,
                &format!("### rl-node: the command left processes behind{outside}; stopped them\n"),
            );
        }
    }

    /// Run a phase command in its own process group and wait for it, watching the cluster;
    /// its failure (non-zero exit, signal, timeout) stops the cluster. Returns the log path.
    fn run_command(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        split: Option<&str>,
        output: &Path,
        torchrun_env: bool,
    ) -> Result<PathBuf, Stop> {
        let (log, ended) = self.run_command_to_end(phase, pc, split, output, torchrun_env)?;
        match ended {
            Ok(()) => Ok(log),
            Err(failure) => Err(self.command_failed(phase, pc, &failure, &log)),
        }
    }

    /// The stop of a node whose `phase` command failed: published as the abort.
    fn command_failed(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        failure: &CommandFailure,
        log: &Path,
    ) -> Stop {
        self.fail(
            failure.abort_kind(),
            self.rank,
            None,
            failure.reason(phase, pc),
            Some(log),
        )
    }

    /// Run a phase command and wait for it like [`Node::run_command`], but hand its
    /// failure back instead of stopping: the log path and how it ended. A stop of the
    /// node or the cluster meanwhile (abort, dead peer, signal) is still a `Stop`.
    fn run_command_to_end(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        split: Option<&str>,
        output: &Path,
        torchrun_env: bool,
    ) -> Result<(PathBuf, Result<(), CommandFailure>), Stop> {
        let (running, log) = self.start_command(phase, pc, split, output, torchrun_env)?;
        self.wait_command(phase, pc, running, log)
    }

    /// Start a phase command in its own process group: it runs, and logs to the path
    /// returned.
    fn start_command(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        split: Option<&str>,
        output: &Path,
        torchrun_env: bool,
    ) -> Result<(procs::Running, PathBuf), Stop> {
        let values = self.values(phase, split, output);
        let command = self.cfg.template(&pc.command).render(&values);
        let mut env = self.command_env(&values);
        if torchrun_env {
            env.extend(context::torchrun_env(&values));
        }
        // A stand-in's log is filed under the dropped rank, naming who wrote it.
        let log = match self.acting_for {
            Some(r) => self.layout.phase_log(
                self.machine.iteration(),
                r,
                &format!("{phase}.by-rank-{}", self.rank),
            ),
            None => self
                .layout
                .phase_log(self.machine.iteration(), self.rank, phase),
        };
        let standing_in = self
            .acting_for
            .map(|r| format!(" (standing in for dropped rank {r})"))
            .unwrap_or_default();
        let header = format!(
            "rank {} iteration {} phase {phase}{standing_in}",
            self.rank,
            self.machine.iteration()
        );
        let running = self.spawn_supervised(
            &format!("the {phase} command"),
            &command,
            &env,
            &log,
            &header,
        )?;
        self.info(&format!(
            "iteration {}: {phase} started (pid {}, log {})",
            self.machine.iteration(),
            running.pid,
            log.display()
        ));
        Ok((running, log))
    }

    /// Wait for the `phase` command `running` (logging to `log`) like
    /// [`Node::run_command_to_end`].
    fn wait_command(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        running: procs::Running,
        log: PathBuf,
    ) -> Result<(PathBuf, Result<(), CommandFailure>), Stop> {
        let pid = running.pid;
        self.waiting.note = format!("the {phase} command (pid {pid})");
        let deadline = running.started + pc.timeout;
        // Nothing waits on the peers while the command runs: read them at the idle
        // cadence (its exit still wakes the loop at once).
        self.waiting.idle = true;
        self.watch_wait(
            format!("the {phase} command (pid {pid})"),
            format!("phases.{phase}.timeout"),
            pc.timeout,
            running.started,
        );
        let waited = self.wait_for(deadline, |n| Ok(n.exited.remove(&pid)));
        self.unwatch_wait();
        self.waiting.idle = false;
        self.waiting.note.clear();
        let exit = match waited {
            Ok(exit) => exit,
            Err(Interrupt::Stop(s)) => return Err(s),
            Err(Interrupt::Deadline) => {
                self.watchdog.pet("stopping a command");
                self.launcher.stop(pid, self.cfg.timing.kill_grace);
                // The node may go on (a training failure with on-failure = "keep-model"):
                // an exit of this pid must not be mistaken later for a new command's.
                self.exited.remove(&pid);
                return Ok((log, Err(CommandFailure::TimedOut(pc.timeout))));
            }
        };
        self.reap(pid, Some(&log));
        let secs = self.clock.elapsed(running.started).as_secs_f64();
        self.event(events::Event::Command {
            phase: phase.to_string(),
            exit: exit.to_string(),
            secs,
        });
        if exit != ChildExit::Success {
            return Ok((log, Err(CommandFailure::Exit(exit))));
        }
        self.info(&format!(
            "iteration {}: {phase} finished in {secs:.2}s",
            self.machine.iteration()
        ));
        Ok((log, Ok(())))
    }

    fn values(
        &self,
        phase: &str,
        split: Option<&str>,
        output: &Path,
    ) -> std::collections::BTreeMap<&'static str, String> {
        let c = self.machine.cluster().expect("joined");
        let members = self.members();
        let rollout_model = self
            .machine
            .serving()
            .rollout_of(self.machine.iteration())
            .map(|m| (m.model_version, m.staleness));
        context::placeholder_values(&context::CommandInputs {
            cfg: &self.cfg,
            layout: &self.layout,
            rank: self.acting_rank(),
            live: members.ranks(),
            node_rank: members.position(self.rank).unwrap_or(self.rank),
            iteration: self.machine.iteration(),
            phase,
            split,
            output,
            model: self.machine.serving().model(),
            master_addr: &c.master_addr,
            master_port: c.master_port,
            gen: c.gen,
            run_id: &c.run_id,
            nproc_per_node: self.nproc_per_node,
            rollout_model,
            extra: &self.extra,
        })
    }

    /// The environment a command gets besides the node's own ([`context::command_env`]).
    pub(super) fn command_env(
        &self,
        values: &std::collections::BTreeMap<&'static str, String>,
    ) -> Vec<(String, String)> {
        context::command_env(&self.cfg, values)
    }

    /// Append one line to this rank's event log (`.rl-node/events/rank-R.jsonl`; one
    /// writer, one open handle). Best effort: the event log is for people and tests, not
    /// the protocol.
    fn event(&self, event: events::Event) {
        let record = events::EventRecord {
            event,
            gen: self.gen(),
            iteration: self.machine.iteration(),
            rank: self.rank,
            t: self.wall_stamp(),
        };
        let path = self
            .layout
            .state_dir()
            .join("events")
            .join(format!("rank-{}.jsonl", self.rank));
        let line = record.to_line();
        logging::event(self.rank, &line);
        // Every rank keeps its numbers: rank 0 for its line, workers for their
        // `final-sync` arrival (the spread over ranks).
        self.metrics_collector()
            .observe(&record.event, self.clock.now());
        self.with_textfile(|t| t.observe(&record.event, record.iteration, record.gen));
        if let Some(note) = self
            .event_log
            .append(&*self.store, &path, record.gen, &line)
        {
            self.warn(&note);
        }
    }

    fn metrics_collector(&self) -> std::sync::MutexGuard<'_, metrics::Collector> {
        self.metrics.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank 0: the model this iteration runs with, as `{model_version}` and `{staleness}`
    /// say now (at its start, and again once a pipelined rollout chose its model), before
    /// the hand-off replaces it.
    fn note_model_used(&mut self) {
        if !self.is_master() {
            return;
        }
        let values = self.values("metrics", None, Path::new(""));
        let num = |k: &str| values.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
        let (version, staleness) = (num("model_version"), num("staleness"));
        self.metrics_collector().model_used(version, staleness);
    }

    /// Rank 0, once `training-complete` is released: what training did, for
    /// `metrics.jsonl`: the records of the train split it trained on (its merge's
    /// manifest), the ranks where it failed, and the trainer's own numbers from the
    /// `[observe] train-metrics` file, read before the hand-off moves the output away.
    /// Two small reads; a missing or unreadable file only leaves keys out.
    fn note_trained(&mut self) {
        let manifest = crate::aggregate::manifest_path(
            &self.layout.aggregated(self.machine.iteration(), "train"),
        );
        let samples = self
            .store
            .read_limited(&manifest, crate::store::ReadLimit::Manifest)
            .ok()
            .flatten()
            .and_then(|b| serde_json::from_slice::<crate::aggregate::Manifest>(&b).ok())
            .map(|m| m.records);
        let trainer = if self.cfg.observe.train_metrics.trim().is_empty() {
            Default::default()
        } else {
            let out = self
                .layout
                .train_output(self.machine.iteration(), self.gen());
            let values = self.values("train", Some("train"), &out);
            let path = self
                .cfg
                .template(&self.cfg.observe.train_metrics)
                .render_raw(&values);
            self.store
                .read(Path::new(&path))
                .ok()
                .flatten()
                .map(|b| metrics::trainer_numbers(&b))
                .unwrap_or_default()
        };
        let failed = self.machine.walk().training_failures().len();
        let mut c = self.metrics_collector();
        c.trained(samples, failed);
        c.trainer(trainer);
    }

    /// Rank 0, after the train split is merged: read it for `[observe] metrics-fields` on
    /// a thread, while the iteration goes on (joined by [`Node::write_metrics`]).
    fn start_field_stats(&mut self) {
        let fields = self.cfg.observe.metrics_fields.clone();
        let path = self.layout.aggregated(self.machine.iteration(), "train");
        // Only a JSONL merge has records to read; tensor formats have none.
        if !self.is_master() || fields.is_empty() || path.extension() != Some("jsonl".as_ref()) {
            return;
        }
        let store = self.store.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        // A thread of the clock's (a task that takes turns, in a simulation), reading
        // through the store like every read of the shared directory.
        let thread = crate::clock::spawn(&*self.clock, "metrics", move || {
            let _ = tx.send(metrics::file_stats(&*store, &path, &fields));
        });
        self.metrics_stats = thread.ok().map(|t| (t, rx));
    }

    /// Rank 0, at the end of an iteration: append its line to `metrics.jsonl` unless the
    /// file had one for it already (a restarted run). Best effort, like any log.
    fn write_metrics(&mut self, started: Instant) {
        if !self.is_master() {
            return;
        }
        let fields = &self.cfg.observe.metrics_fields;
        let stats = self
            .metrics_stats
            .take()
            .and_then(|(thread, stats)| {
                thread.join();
                stats.try_recv().ok()
            })
            .unwrap_or_else(|| metrics::FieldStats::empty(fields));
        if self
            .metrics_written
            .iterations
            .contains(&self.machine.iteration())
        {
            self.debug(&format!(
                "iteration {}: metrics.jsonl has its line already",
                self.machine.iteration()
            ));
            return;
        }
        let now = self.clock.now();
        let mut collector = self.metrics_collector();
        collector.close(now);
        let fixed = metrics::Fixed {
            iteration: self.machine.iteration(),
            run: self.run_id().to_string(),
            generation: self.gen(),
            cluster: self.cfg.pipeline_cluster(),
            t: self.wall_stamp(),
            elapsed: now.saturating_duration_since(started),
            live_nodes: self.members().len(),
            budget: self
                .plan_for("train")
                .map(|p| (p.pool.len() + p.ranks.iter().map(Vec::len).sum::<usize>()) as u64),
        };
        let mut line = collector.line(&fixed, &stats);
        drop(collector);
        line.push('\n');
        if std::mem::take(&mut self.metrics_written.torn_tail) {
            line.insert(0, '\n');
        }
        if let Some(note) =
            self.metrics_log
                .append(&*self.store, &self.layout.metrics(), self.gen(), &line)
        {
            self.warn(&note);
        }
        self.metrics_written
            .iterations
            .insert(self.machine.iteration());
    }

    /// Rank `rank`'s record in generation `gen` as read now; missing, torn or unreadable
    /// is `None` ("not yet": a live record is judged by what it says, not by its name).
    fn read_record(&self, gen: u64, rank: u32) -> Option<RankRecord> {
        read_rank_record(&*self.store, &self.layout, gen, rank)
    }

    /// These ranks' records of generation `gen`, in their order, each stamped with when
    /// its read was sent and when it returned (see `Watch::round_stamped`). One after
    /// another for a few ranks; for more, from up to the store's `read_parallelism` threads at once, one per
    /// [`poll::READS_PER_THREAD`] ranks ([`poll::read_run`]), so that a poll round of a
    /// large cluster over a network filesystem costs a few round trips, not one per rank.
    fn read_records(&self, gen: u64, ranks: &[u32]) -> Vec<(u32, Option<RankRecord>, Stamp)> {
        let (store, layout, clock) = (&*self.store, &self.layout, &*self.clock);
        let read = |ranks: &[u32]| -> Vec<(u32, Option<RankRecord>, Stamp)> {
            ranks
                .iter()
                .map(|&r| {
                    let (record, at) = stamped(clock, || read_rank_record(store, layout, gen, r));
                    (r, record, at)
                })
                .collect()
        };
        let run = poll::read_run(ranks.len(), store.read_parallelism());
        if run >= ranks.len() {
            return read(ranks);
        }
        std::thread::scope(|s| {
            let runs: Vec<_> = ranks
                .chunks(run)
                .map(|c| s.spawn(move || read(c)))
                .collect();
            runs.into_iter()
                .flat_map(|h| h.join().expect("a record read does not panic"))
                .collect()
        })
    }

    /// Now on this node's wall clock, as records and journals stamp it.
    fn wall_stamp(&self) -> String {
        crate::protocol::wall_stamp(self.clock.wall())
    }

    /// Append a line to a log in the shared directory (an event log, a command's log):
    /// best effort, a log never stops the node.
    fn append_log(&self, path: &Path, text: &str) {
        let _ = self.store.append(path, text.as_bytes(), false);
    }
}

/// What `read` returns, stamped by `clock` with when it was sent and when it returned
/// (`liveness::Stamp`): an unchanged heartbeat in it proves stillness only up to the send.
fn stamped<T>(clock: &dyn Clock, read: impl FnOnce() -> T) -> (T, Stamp) {
    let sent = clock.since_start();
    let got = read();
    (got, Stamp::new(sent, clock.since_start()))
}

/// Rank `rank`'s record of generation `gen`; `None`: missing, unreadable or unparsable.
fn read_rank_record(
    store: &dyn SharedDir,
    layout: &Layout,
    gen: u64,
    rank: u32,
) -> Option<RankRecord> {
    store
        .read_json::<RankRecord>(&layout.rank_record(gen, rank))
        .ok()
        .flatten()
}

/// Why [`fence_check`] failed.
pub(crate) struct Fenced {
    /// In words, for the node's message.
    pub why: String,
}

/// `Ok` when `cluster.json` still names generation `gen` of run `run_id`: the read, with
/// the decision in [`crate::protocol::fence`].
pub(crate) fn fence_check(
    store: &dyn SharedDir,
    layout: &Layout,
    gen: u64,
    run_id: &str,
    site: Site,
    broken: Option<crate::protocol::fence::Mutation>,
) -> Result<(), Fenced> {
    use crate::protocol::fence::Seen;
    let check = |seen| crate::protocol::fence::check_at(gen, run_id, seen, site, broken);
    let fenced = |why| Fenced { why };
    // `cluster.json` is replaced by rename: a FUSE client's entry cache could answer with
    // the file it replaced (another generation's), fencing out a current node.
    let _ = store.refresh(&layout.state_dir());
    match crate::state::read_cluster(store, layout) {
        Ok(Some(c)) => check(Seen::Cluster(&c)).map_err(fenced),
        Ok(None) | Err(crate::state::StateError::MissingCluster { .. }) => {
            check(Seen::Missing(&layout.cluster())).map_err(fenced)
        }
        Err(e) => check(Seen::Unreadable(&e.to_string())).map_err(fenced),
    }
}

fn ranks_list(ranks: &[u32]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| format!("rank {r}")).collect();
    names.join(", ")
}

fn hostname() -> String {
    gethostname::gethostname().to_string_lossy().into_owned()
}

/// Refuse a log path we cannot use before writing anything.
fn preflight_log_path(layout: &Layout, rank: u32) -> Result<(), Stop> {
    let root = layout.root();
    let hint =
        Some("pass a --log-path on the shared filesystem that this user can write".to_string());
    // Inside another run's own directories, this run would mix its files into that one's
    // (and a --fresh there would move this run away): refuse.
    for dir in root.ancestors() {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let parent = dir.parent();
        let owner = parent.filter(|p| p.join(".rl-node").is_dir());
        if let (Some(name), Some(owner)) = (name, owner) {
            if crate::layout::RUN_DIRS.contains(&name.as_str()) || name == "previous-runs" {
                return Err(Stop::usage(
                    format!(
                        "--log-path {} is inside {}/{name}, a directory of the rl-node run in {}",
                        root.display(),
                        owner.display(),
                        owner.display()
                    ),
                    Some(
                        "use a directory of its own (e.g. a sibling of that run's directory)"
                            .into(),
                    ),
                ));
            }
        }
    }
    // A symbolic-link loop is not a missing directory: name the link to fix.
    if let Some(why) = crate::layout::symlink_loop(root) {
        return Err(Stop::usage(
            format!("--log-path {why}"),
            Some("fix the link so that it leads to the shared directory".into()),
        ));
    }
    // A dangling symbolic link: say so (creating it would fail with "File exists").
    if let Ok(m) = std::fs::symlink_metadata(root) {
        if m.file_type().is_symlink() && std::fs::metadata(root).is_err() {
            let target = std::fs::read_link(root).unwrap_or_default();
            return Err(Stop::usage(
                format!(
                    "--log-path {} is a symbolic link to {}, which does not exist",
                    root.display(),
                    target.display()
                ),
                Some(
                    "create the link's target (e.g. mount the shared filesystem) or fix the link"
                        .into(),
                ),
            ));
        }
    }
    match std::fs::metadata(root) {
        Ok(m) if !m.is_dir() => Err(Stop::usage(
            format!("--log-path {} is not a directory", root.display()),
            hint,
        )),
        Ok(_) => {
            // The run's own directory if it has one; a `--fresh` on rank 0 may move it aside
            // between our look and our probe (all ranks started at once), so a state
            // directory that vanished sends us back to the root rank 0 will create it in.
            let state = layout.state_dir();
            let (probe, probed) = match writable(&state) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    (root.to_path_buf(), writable(root))
                }
                probed => (state, probed),
            };
            if let Err(e) = probed {
                return Err(Stop::usage(
                    format!(
                        "--log-path {}: {} (cannot write to {})",
                        root.display(),
                        why_not_writable(&e),
                        probe.display()
                    ),
                    hint,
                ));
            }
            Ok(())
        }
        // A worker may start before rank 0 created the directory; rank 0 creates it, but
        // only its last component: a missing parent is a typo or a filesystem not
        // mounted on this node, and creating the whole path would run the job on a
        // local directory no other node sees.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if rank != 0 {
                return Ok(());
            }
            let parent = root.parent().unwrap_or(root);
            if !parent.is_dir() {
                let existing = root.ancestors().skip(1).find(|p| p.is_dir());
                return Err(Stop::usage(
                    format!(
                        "--log-path {} does not exist, nor does its parent {}: rank 0 creates only the last component",
                        root.display(),
                        parent.display()
                    ),
                    Some(format!(
                        "check the path for a typo and that the shared filesystem is mounted on this node{}",
                        existing.map_or(String::new(), |p| format!(" (the nearest existing directory is {})", p.display()))
                    )),
                ));
            }
            match writable(parent) {
                Err(e) => Err(Stop::usage(
                    format!(
                        "--log-path {} does not exist and cannot be created: {} on {}",
                        root.display(),
                        why_not_writable(&e),
                        parent.display()
                    ),
                    hint,
                )),
                Ok(()) => Ok(()),
            }
        }
        Err(e) => Err(Stop::usage(
            format!("--log-path {}: {e}", root.display()),
            hint,
        )),
    }
}

/// Warn when `timing.dead-after` is shorter than the mount's caches allow: on a FUSE mount
/// a peer's rewritten record can look unchanged to this node for up to the longest of its
/// attribute, entry and negative caches, so a live peer could be judged dead. Liveness
/// holds at dead-after ≥ 2 × that cache + one heartbeat (docs/shared-directory.md).
fn warn_if_dead_after_below_caches(loaded: &Loaded, rank: u32) {
    let cfg = &loaded.config;
    let Some((cache, mount)) = crate::observe::doctor::liveness_cache(&cfg.log_path()) else {
        return;
    };
    let needed = Duration::from_secs_f64(2.0 * cache) + cfg.timing.heartbeat_interval;
    if cfg.timing.dead_after < needed {
        logging::warn(
            rank,
            &format!(
                "timing.dead-after ({}, from {}) is below twice the longest cache of the shared directory's mount plus one heartbeat ({}: its caches hide a change for up to {cache}s): a live node could be judged dead; raise timing.dead-after to at least {} or mount with shorter caches (`rl-node doctor` measures them)",
                humantime::format_duration(cfg.timing.dead_after),
                loaded.source_of("timing.dead-after"),
                mount,
                humantime::format_duration(Duration::from_secs(needed.as_secs_f64().ceil() as u64))
            ),
        );
    }
}

/// Refuse to start (exit 2, before anything is written) when a directory of the run, or a
/// state file this rank writes, is a symbolic link, or a file that is not this node's own:
/// others may write the shared directory, and rl-node must never write through what they
/// planted (docs/shared-directory.md, "What rl-node trusts"). Logs (commands' logs, event
/// logs, `metrics.jsonl`) are not checked here: one refused later is set aside and written
/// anew.
fn preflight_state(layout: &Layout, rank: u32) -> Result<(), Stop> {
    use crate::store::fs::{check_dir, check_own_file, read_dir};
    let state = layout.state_dir();
    let mut dirs: Vec<PathBuf> = layout
        .run_dirs()
        .into_iter()
        .filter(|d| !d.ends_with("logs"))
        .collect();
    dirs.extend([state.clone(), state.join("journal")]);
    // `.rl-node` is a run directory too when the run has no cluster name.
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    let mut files = vec![layout.journal(rank)];
    if rank == 0 {
        files.extend([layout.cluster(), layout.doorbell(), layout.history()]);
    }
    // Only names a listing shows are looked at: a lookup of a name that is not there yet
    // would leave a "missing" in a FUSE client's negative cache, where rank 0 is about to
    // make it (a `mkdir -p` of it by a command would then fail with "File exists"). Each
    // directory is listed once.
    let mut listings: HashMap<PathBuf, Vec<std::ffi::OsString>> = HashMap::new();
    let mut listed = |p: &Path| {
        let (Some(dir), Some(name)) = (p.parent(), p.file_name()) else {
            return false;
        };
        listings
            .entry(dir.to_path_buf())
            .or_insert_with(|| read_dir(dir).unwrap_or_default())
            .iter()
            .any(|n| n == name)
    };
    let refused = dirs
        .iter()
        .filter(|d| listed(d))
        .find_map(|d| check_dir(d).err())
        .or_else(|| {
            files
                .iter()
                .filter(|f| listed(f))
                .find_map(|f| check_own_file(f).err())
        });
    match refused {
        None => Ok(()),
        Some(e) => Err(Stop::usage(
            format!("the run's directory is not safe to write: {e}"),
            Some(match crate::store::Untrusted::of(&e) {
                Some(u) => format!(
                    "rl-node did not make {}: move it out of the run's directory (or start the run in a directory only you can write)",
                    u.at.display()
                ),
                None => "check the path and its permissions".into(),
            }),
        )),
    }
}

/// Can this user create files in directory `p`? The error says why not.
fn writable(p: &Path) -> std::io::Result<()> {
    use rustix::fs::Access;
    use std::os::unix::ffi::OsStrExt;
    // A path with a NUL byte is checked as "", which the kernel answers with ENOENT (a
    // missing directory's error), not refused here with EINVAL.
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap_or_default();
    Ok(rustix::fs::access(
        c.as_c_str(),
        Access::WRITE_OK | Access::EXEC_OK,
    )?)
}

/// A read-only filesystem is not a permission problem: say which it is.
fn why_not_writable(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EROFS) => "the filesystem is mounted read-only".into(),
        Some(libc::EACCES) | Some(libc::EPERM) => "permission denied".into(),
        _ => e.to_string(),
    }
}
