//! The command line: running a node is the default action (`rl-node --master …`,
//! `rl-node --worker 2 …`); other actions are subcommands. Flags of the old run.sh keep
//! their names and meaning.

use crate::config::{self, CliOverride, ConfigError};
use crate::error::{Cause, Ending, Failure};
use crate::logging::{self, LogFormat, LogLevel};
use crate::node::{self, NodeOptions, Stop};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "rl-node",
    version,
    about = "Run one node of a multi-node RL loop (rollout, aggregation, eval, training, hand-off) over a shared directory",
    after_help = "Exit codes: 0 done, 1 this node failed, 2 usage or configuration error, 3 another node failed or died, 4 a deadline passed, 75 stopped gracefully for a time limit (SIGUSR1/SIGUSR2; restart to resume), 129/130/143 interrupted by SIGHUP/SIGINT/SIGTERM."
)]
pub struct Cli {
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    settings: Settings,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Args, Debug)]
struct NodeArgs {
    /// Run as rank 0 (the master).
    #[arg(long, conflicts_with = "worker")]
    master: bool,
    /// Run as worker rank N (1..num-nodes-1).
    #[arg(long, value_name = "N")]
    worker: Option<u32>,
    /// Leave the inference server alone (do not stop or start it).
    #[arg(long)]
    debug_mode: bool,
    /// Start a new run in this directory: rank 0 sets the previous run's files aside
    /// (nothing is deleted), a worker waits for the new run. Without it, a restart resumes
    /// the run that is there. Give it to every node started together (srun does).
    #[arg(long)]
    fresh: bool,
    /// Print the node's log lines (stderr) of this level and above (default info;
    /// environment: RL_NODE_LOG_LEVEL).
    #[arg(long, value_enum, value_name = "LEVEL")]
    log_level: Option<LogLevel>,
    /// How the node's log lines (stderr) are written (default text; environment:
    /// RL_NODE_LOG_FORMAT).
    #[arg(long, value_enum, value_name = "FORMAT")]
    log_format: Option<LogFormat>,
}

/// Flags that set configuration keys (they override the environment and the file).
#[derive(Args, Debug, Default)]
struct Settings {
    /// TOML configuration file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Shared directory for flags, logs, trajectories and checkpoints.
    #[arg(long, value_name = "DIR")]
    log_path: Option<String>,
    #[arg(long, value_name = "DIR", help = with_default("Input data directory ({data_path})", "data-path"))]
    data_path: Option<String>,
    #[arg(long, value_name = "N", help = with_default("Number of nodes in the cluster (when neither this flag, RL_NODE_CLUSTER_NUM_NODES nor the config file sets it: NNODES, SLURM_NNODES, SLURM_JOB_NUM_NODES, or WORLD_SIZE outside a torchrun-style environment)", "num-nodes"))]
    num_nodes: Option<String>,
    #[arg(long, value_name = "K", help = with_default("Elastic mode: go on without a node that dies as long as K nodes are left (0: num-nodes, any loss stops the cluster)", "min-nodes"))]
    min_nodes: Option<String>,
    #[arg(long, value_name = "LIST", allow_hyphen_values = true, help = with_default("Rollout weight of each rank, e.g. 2,1,1", "rank-weights"))]
    rank_weights: Option<String>,
    #[arg(long, value_name = "PHASE", value_parser = ["both", "rollout", "update"], help = with_default("Which part of the iteration to run", "rl-phase"))]
    rl_phase: Option<String>,
    #[arg(long, value_name = "K", help = with_default("Run eval on iterations 1, 1+K, 1+2K, … (0: never)", "eval-interval"))]
    eval_interval: Option<String>,
    /// With --rl-phase rollout: only the train or only the eval rollout.
    #[arg(long, value_name = "SPLIT", value_parser = ["train-only", "eval-only"])]
    rollout_split: Option<String>,
    /// Stop cleanly once iteration N is complete (default: run until stopped).
    #[arg(long, value_name = "N")]
    iterations: Option<String>,
    #[arg(long, value_name = "PORT", help = with_default("Port of torchrun's rendezvous on rank 0 (MASTER_PORT)", "master-port"))]
    master_port: Option<String>,
    /// Extra arguments after `--` (e.g. Hydra overrides `env_config.max_steps=20`), passed
    /// shell-quoted where a command says `{extra_args}`; every node must get the same.
    #[arg(last = true, value_name = "ARGS")]
    extra_args: Vec<String>,
}

/// A node flag's help with its real default: the `[cluster]` key's value in the built-in
/// defaults (`config::DEFAULTS_TOML`), which the flag overrides like the environment and
/// the file do, so clap's own `default_value` (always set) cannot be used.
fn with_default(help: &str, key: &str) -> String {
    let defaults: toml::Table = toml::from_str(config::DEFAULTS_TOML).unwrap_or_default();
    let value = defaults
        .get("cluster")
        .and_then(|c| c.get(key))
        .map(|v| match v {
            toml::Value::String(s) if s.is_empty() => "none".to_string(),
            toml::Value::String(s) => s.clone(),
            toml::Value::Array(a) if a.is_empty() => "every rank 1".to_string(),
            other => other.to_string(),
        })
        .unwrap_or_else(|| "?".into());
    format!("{help} (default: {value})")
}

/// `args` as one shell word each, space-separated: what `{extra_args}` expands to.
fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| crate::template::shell_word(a))
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show a run's state from the shared directory (works with every node dead).
    Status {
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
        /// The run's shared directory.
        #[arg(long, value_name = "DIR")]
        log_path: Option<String>,
        /// Keep showing the state until the run ends (redrawn on a terminal, a line per
        /// change when piped, a JSON object per change with --json), following it through
        /// restarts; exit 0 when it completed, 1 when it stayed stopped.
        #[arg(long)]
        watch: bool,
        /// With --watch: how often to refresh.
        #[arg(long, value_name = "DURATION", default_value = "2s", requires = "watch", value_parser = humantime::parse_duration)]
        every: std::time::Duration,
        /// With --watch: how long a stopped run is watched for a restart before the watch
        /// ends with exit 1 (0: at once).
        #[arg(long, value_name = "DURATION", default_value = "10m", requires = "watch", value_parser = humantime::parse_duration)]
        restart_wait: std::time::Duration,
        /// Exit with the code of the run's end, for a batch script's last line (so that
        /// `sacct` names the cause, not the 3 of the nodes a failure stopped): 0 when it
        /// completed (or has not ended), the culprit's own code when it stopped (1 a
        /// failed command or a node declared dead, 4 a deadline, 75 a time limit, 128+N a
        /// signal), 1 when every node is gone without a recorded cause.
        #[arg(long, conflicts_with = "watch")]
        exit_code: bool,
    },
    /// Print the effective configuration and where each value came from.
    ShowConfig(Settings),
    /// Print the commands, environment and files one rank would use in one iteration,
    /// without running or writing anything.
    Plan {
        #[command(flatten)]
        settings: Settings,
        /// The iteration to plan (from 1).
        #[arg(long, value_name = "I")]
        iteration: u64,
        /// The rank to plan (0 is the master).
        #[arg(long, value_name = "R")]
        rank: u32,
        /// Only this phase's command: server, rollout, eval, aggregate, prepare, train or
        /// handoff.
        #[arg(long, value_name = "PHASE")]
        phase: Option<String>,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Run this configuration for 1 or 2 iterations with N local nodes, every external
    /// program replaced by a recorder, and print each rank's command lines, environment and
    /// files per phase, and the problems found (exit 1 when there is an error among them).
    Rehearse {
        #[command(flatten)]
        settings: Settings,
        /// Local nodes to start (cluster.num-nodes; --num-nodes is the same).
        #[arg(long, value_name = "N")]
        nodes: Option<u32>,
        /// The size of one checkpoint in GB, for the disk the checkpoints need at
        /// phases.handoff.keep-last [default: the model directory's size, else estimated
        /// from the parameter count in cluster.model's name].
        #[arg(long, value_name = "GB")]
        model_size: Option<f64>,
        /// The rehearsal's directory (empty or absent) [default: a new one under the
        /// temporary directory]; kept for inspection either way.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Stop the nodes after this long.
        #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// Print JSON for scripts (also written as report.json in the rehearsal directory).
        #[arg(long)]
        json: bool,
    },
    /// Merge whatever rank output of an iteration survived (committed shards, else partial
    /// files) into one file with a manifest.
    Aggregate(crate::aggregate::AggregateArgs),
    /// Say where a stopped run stands, what a restart would redo, and (asked) set an
    /// incomplete iteration aside.
    Recover(crate::observe::recover::RecoverArgs),
    /// Check the shared filesystem rl-node relies on (atomic rename, exclusive create, hard
    /// links, fsync, free space, mount options) and recommend a `[timing]` for it.
    Doctor(crate::observe::doctor::DoctorArgs),
    /// Draw a run as one self-contained HTML page: a lane per rank with its phases,
    /// barrier waits, failures and restarts, and the time and reward of each iteration.
    Timeline(crate::observe::timeline::TimelineArgs),
    /// Run a small cluster on this machine with a built-in toy RL workload and watch it learn.
    Demo(crate::demo::DemoArgs),
    /// Print a shell completion script, e.g. `rl-node completions bash > /etc/bash_completion.d/rl-node`.
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `rl-node man > /usr/local/share/man/man1/rl-node.1`,
    /// or write one page per subcommand with `--out-dir /usr/local/share/man/man1`.
    Man {
        /// Write `rl-node.1` and an `rl-node-<subcommand>.1` for every subcommand into DIR
        /// (the pages `rl-node.1` refers to), and list them.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<std::path::PathBuf>,
    },
    /// The demo's toy workload (inference server, rollout, training, eval).
    #[command(name = "__toy", hide = true)]
    Toy(crate::demo::ToyArgs),
    #[command(name = "__guard", hide = true)]
    Guard {
        /// The node's nonce: processes whose RL_NODE_OWNER starts with it are stopped too.
        nonce: Option<String>,
    },
}

impl Settings {
    fn overrides(&self) -> Vec<CliOverride> {
        let mut v = Vec::new();
        let mut add = |flag: &str, key: &'static str, value: &Option<String>| {
            if let Some(value) = value {
                v.push(CliOverride {
                    flag: flag.to_string(),
                    key,
                    value: value.clone(),
                });
            }
        };
        add("--log-path", "cluster.log-path", &self.log_path);
        add("--data-path", "cluster.data-path", &self.data_path);
        add("--num-nodes", "cluster.num-nodes", &self.num_nodes);
        add("--min-nodes", "cluster.min-nodes", &self.min_nodes);
        add("--rank-weights", "cluster.rank-weights", &self.rank_weights);
        add("--rl-phase", "cluster.rl-phase", &self.rl_phase);
        add(
            "--eval-interval",
            "cluster.eval-interval",
            &self.eval_interval,
        );
        add(
            "--rollout-split",
            "cluster.rollout-split",
            &self.rollout_split,
        );
        add("--iterations", "cluster.iterations", &self.iterations);
        add("--master-port", "cluster.master-port", &self.master_port);
        if !self.extra_args.is_empty() {
            v.push(CliOverride {
                flag: "-- (extra arguments)".into(),
                key: "cluster.extra-args",
                value: shell_words(&self.extra_args),
            });
        }
        v
    }

    /// The flags that give a node these settings, but `--log-path`.
    fn node_flags(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(c) = &self.config {
            v.push("--config".to_string());
            v.push(c.display().to_string());
        }
        for o in self.overrides() {
            if o.flag.starts_with("--") && o.flag != "--log-path" {
                v.push(o.flag);
                v.push(o.value);
            }
        }
        if !self.extra_args.is_empty() {
            v.push("--".into());
            v.extend(self.extra_args.iter().cloned());
        }
        v
    }

    fn load(&self) -> Result<config::Loaded, ConfigError> {
        config::check_env_names(std::env::vars().map(|(k, _)| k))?;
        let env = |name: &str| std::env::var(name).ok();
        let mut overrides = self.overrides();
        let loaded = config::load(self.config.as_deref(), &env, &overrides)?;
        // Like the rank: when nothing set num-nodes, the launcher's count is the default.
        if *loaded.source_of("cluster.num-nodes") == config::Source::Default {
            let found =
                from_launcher(&COUNT_VARS, &env).map_err(|(var, v, why)| ConfigError::Invalid {
                    key: "cluster.num-nodes".into(),
                    source_name: format!("environment {var}"),
                    message: format!(
                        "{var}={v} {why}; set NNODES (the number of nodes) or pass --num-nodes"
                    ),
                })?;
            if let Some((var, v)) = found {
                overrides.push(config::CliOverride {
                    flag: format!("environment {var}"),
                    key: "cluster.num-nodes",
                    value: v.trim().to_string(),
                });
                return config::load(self.config.as_deref(), &env, &overrides);
            }
        }
        Ok(loaded)
    }
}

/// The rank and where it came from: `--master` / `--worker N`, else the environment
/// variables schedulers and launchers set.
fn resolve_rank(args: &NodeArgs) -> Result<(u32, String), Stop> {
    if args.master {
        return Ok((0, "--master".into()));
    }
    if let Some(w) = args.worker {
        if w == 0 {
            return Err(Stop::usage(
                "--worker 0 names rank 0, which is the master",
                Some("start rank 0 with --master".into()),
            ));
        }
        return Ok((w, format!("--worker {w}")));
    }
    let env = |name: &str| std::env::var(name).ok();
    let found = from_launcher(&RANK_VARS, &env).map_err(|(var, v, why)| {
        Stop::usage(
            format!("{var}={v} {why}"),
            Some("set NODE_RANK (this node's index) or pass --master / --worker N".into()),
        )
    })?;
    if let Some((var, v)) = found {
        let r = v
            .trim()
            .parse::<u32>()
            .map_err(|_| Stop::usage(format!("{var}={v} is not a rank number"), None))?;
        return Ok((r, format!("from {var}")));
    }
    Err(Stop::usage(
        "no rank: pass --master or --worker N",
        Some("or set NODE_RANK or SLURM_NODEID (RANK outside a torchrun-style environment)".into()),
    ))
}

/// The variables rl-node gives the commands it runs (`RL_NODE_NUM_NODES`, `RL_NODE_RANK`,
/// ...; not those that are also a key's, such as `RL_NODE_SERVER_PORT`) configure nothing
/// when set for rl-node itself: a node started with one, outside a
/// command of another node (no `RL_NODE_OWNER`), is refused, naming what rl-node reads
/// instead, rather than ignoring it and running with another rank count.
fn no_command_variables(env: &dyn Fn(&str) -> Option<String>) -> Result<(), Failure> {
    if env(config::template::OWNER_ENV).is_some() {
        return Ok(());
    }
    let keys = config::key_env_names();
    let Some((name, value)) = config::template::PLACEHOLDERS
        .iter()
        .filter(|(_, name, _)| !keys.iter().any(|k| k == name))
        .find_map(|(_, name, _)| env(name).map(|v| (*name, v)))
    else {
        return Ok(());
    };
    let suffix = &name["RL_NODE".len()..];
    let hint = match keys.iter().find(|k| k.ends_with(suffix)) {
        Some(key) => format!("rl-node itself reads {key} (or the flag)"),
        None if name == "RL_NODE_RANK" => "pass --master / --worker N, or set NODE_RANK".into(),
        None => "unset it; `rl-node show-config` lists the variables rl-node reads".into(),
    };
    Err(Failure::usage(
        format!(
            "{name}={value} is set, but rl-node only gives that variable to the commands it runs"
        ),
        Some(hint),
    ))
}

/// Where a node's rank comes from when no flag gives it, most specific first: the per-node
/// variables of torchrun and Slurm, then `RANK`, which counts nodes only outside a
/// torchrun-style environment.
const RANK_VARS: [&str; 3] = ["NODE_RANK", "SLURM_NODEID", "RANK"];
/// The same for the number of nodes.
const COUNT_VARS: [&str; 4] = [
    "NNODES",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "WORLD_SIZE",
];

/// A launcher variable that counts processes: `(variable, value, why)`.
type PerProcess = (&'static str, String, String);

/// The first of `vars` that is set, with its value. `RANK` and `WORLD_SIZE` count processes
/// where `LOCAL_RANK` or `LOCAL_WORLD_SIZE` is set beside them (an environment prepared for
/// torchrun, with more than one process per node): taken as nodes, `RANK=8 WORLD_SIZE=24`
/// would make node 8 of 24 and wait for nodes that never come, so that is an error
/// `(variable, value, why)` rather than a guess. One process per node
/// (`LOCAL_WORLD_SIZE=1`) counts nodes.
fn from_launcher(
    vars: &[&'static str],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(&'static str, String)>, PerProcess> {
    let Some((var, v)) = vars.iter().find_map(|&var| env(var).map(|v| (var, v))) else {
        return Ok(None);
    };
    if !matches!(var, "RANK" | "WORLD_SIZE") {
        return Ok(Some((var, v)));
    }
    let local = ["LOCAL_WORLD_SIZE", "LOCAL_RANK"]
        .into_iter()
        .find_map(|l| env(l).map(|lv| (l, lv)));
    match local {
        Some(("LOCAL_WORLD_SIZE", n)) if n.trim() == "1" => Ok(Some((var, v))),
        Some((l, lv)) => Err((
            var,
            v,
            format!(
                "counts processes, not nodes, in this torchrun-style environment ({l}={lv} is set)"
            ),
        )),
        None => Ok(Some((var, v))),
    }
}

/// What plain `rl-node` (no arguments) prints: the common commands, not an error about a
/// missing rank.
const SUMMARY: &str = "\
rl-node: run one node of a multi-node RL loop over a shared directory

  rl-node --master   --config rl.toml --log-path /nfs/exp1 --num-nodes 3   rank 0
  rl-node --worker N --config rl.toml --log-path /nfs/exp1 --num-nodes 3   rank N
  rl-node demo                             watch 3 nodes learn a toy task on this machine
  rl-node status  --log-path DIR           what every rank is doing (or did)
  rl-node recover --log-path DIR           where a stopped run stands, and repairs
  rl-node doctor  --log-path DIR           check the shared filesystem rl-node relies on
  rl-node timeline --log-path DIR          draw the run as one HTML page (DIR/timeline.html)
  rl-node aggregate --log-path DIR --iteration N --split train   merge what survived
  rl-node show-config [--config FILE]      the effective configuration and its sources
  rl-node plan --config FILE --iteration I --rank R   the commands a rank would run, run nothing
  rl-node rehearse --config FILE --nodes N   run it 1-2 iterations here, every program recorded

rl-node --help lists every option; README.md and docs/usage.md have the details.";

pub fn main() -> i32 {
    let (rank, result) = run();
    crate::error::finish(rank, result)
}

/// Run the command line; the rank is the node's when one ran (its report names it).
fn run() -> (Option<u32>, Result<Ending, Failure>) {
    // Started under a program's name in a rehearsal: the recorder, not rl-node.
    if let Some(code) = crate::rehearse::intercept() {
        return (None, Ok(Ending::PassedOn(code)));
    }
    if std::env::args_os().len() == 1 {
        crate::errln!("{SUMMARY}");
        return (None, Ok(Ending::Reported(Cause::Usage)));
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            // Clap printed the usage error (or the help it was asked for) itself.
            let ending = if e.use_stderr() {
                Ending::Reported(Cause::Usage)
            } else {
                Ending::Done
            };
            return (None, Ok(ending));
        }
    };
    let result = match cli.command {
        Some(Command::Guard { nonce }) => Ok(node::procs::guardian_main(nonce.as_deref())),
        Some(Command::Aggregate(args)) => {
            let (log_path, config) = (args.log_path.clone(), args.config.clone());
            crate::aggregate::main(args, log_path, config)
        }
        Some(Command::Recover(args)) => {
            let log_path = args.log_path.clone();
            crate::observe::recover::main(args, log_path)
        }
        Some(Command::Doctor(args)) => crate::observe::doctor::main(args),
        Some(Command::Timeline(args)) => crate::observe::timeline::main(args),
        Some(Command::Demo(args)) => {
            let g = crate::demo::Globals {
                iterations: args.iterations.clone(),
                eval_interval: args.eval_interval.clone(),
                rank_weights: args.rank_weights.clone(),
            };
            crate::demo::demo_main(args, g)
        }
        Some(Command::Toy(args)) => crate::demo::toy_main(args),
        Some(Command::Completions { shell }) => {
            crate::out!("{}", completion_script(shell));
            Ok(Ending::Done)
        }
        Some(Command::Man { out_dir: None }) => {
            let mut buf = Vec::new();
            match clap_mangen::Man::new(visible_command()).render(&mut buf) {
                Ok(()) => {
                    crate::out!("{}", String::from_utf8_lossy(&buf));
                    Ok(Ending::Done)
                }
                Err(e) => Err(Failure::failed(format!("cannot render the man page: {e}"))),
            }
        }
        Some(Command::Man { out_dir: Some(dir) }) => write_man_pages(&dir),
        Some(Command::ShowConfig(settings)) => settings.load().map_err(Failure::from).map(|l| {
            crate::out!(
                "# effective rl-node configuration (fingerprint {})\n{}",
                l.config.fingerprint(),
                l.render()
            );
            Ending::Done
        }),
        Some(Command::Plan {
            settings,
            iteration,
            rank,
            phase,
            json,
        }) => settings.load().map_err(Failure::from).and_then(|l| {
            let req = crate::plan::Request {
                iteration,
                rank,
                phase,
                json,
            };
            crate::plan::main(&l.config, req)
        }),
        Some(Command::Rehearse {
            settings,
            nodes,
            model_size,
            dir,
            timeout,
            json,
        }) => rehearse(settings, nodes, model_size, dir, timeout, json),
        Some(Command::Status {
            json,
            log_path,
            watch,
            every,
            restart_wait,
            exit_code,
        }) => {
            if watch {
                let o = crate::observe::live::WatchOptions {
                    every,
                    json,
                    restart_wait,
                };
                watch_status(log_path, o)
            } else {
                status(json, log_path, exit_code)
            }
        }
        None => return run_node(cli),
    };
    (None, result)
}

/// `rl-node rehearse`: the settings as the user's nodes would have them, but with the
/// rehearsal's shared directory, nodes and iterations.
fn rehearse(
    mut settings: Settings,
    nodes: Option<u32>,
    model_size: Option<f64>,
    dir: Option<PathBuf>,
    timeout: std::time::Duration,
    json: bool,
) -> Result<Ending, Failure> {
    if let Some(n) = nodes {
        if n == 0 {
            return Err(Failure::usage("--nodes 0: a rehearsal needs a node", None));
        }
        if settings
            .num_nodes
            .as_ref()
            .is_some_and(|m| m.trim() != n.to_string())
        {
            return Err(Failure::usage(
                "--nodes and --num-nodes differ: give one of them",
                None,
            ));
        }
        settings.num_nodes = Some(n.to_string());
    }
    if model_size.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
        return Err(Failure::usage("--model-size: a size in GB above 0", None));
    }
    let iterations = match settings.iterations.take().as_deref().map(str::trim) {
        None => 1,
        Some(k) => match k.parse::<u64>() {
            Ok(k @ 1..=crate::rehearse::MAX_ITERATIONS) => k,
            _ => {
                return Err(Failure::usage(
                    format!(
                        "--iterations {k}: a rehearsal runs 1 to {} iterations",
                        crate::rehearse::MAX_ITERATIONS
                    ),
                    None,
                ))
            }
        },
    };
    // The user's own run, for the disk its checkpoints need; it is never written.
    let user = settings.load().map_err(Failure::from)?.config;
    let user_log_path = (!user.cluster.log_path.trim().is_empty()).then(|| user.log_path());
    settings.iterations = Some(iterations.to_string());
    let node_flags = settings.node_flags();
    let dir = crate::rehearse::make_dir(dir)?;
    settings.log_path = Some(crate::rehearse::shared_dir(&dir).display().to_string());
    let loaded = settings.load().map_err(Failure::from)?;
    let req = crate::rehearse::Request {
        iterations,
        model_size,
        dir,
        timeout,
        json,
        node_flags,
        user_log_path,
        user_iterations: user.cluster.iterations,
    };
    crate::rehearse::main(&loaded.config, req)
}

fn watch_status(
    log_path: Option<String>,
    o: crate::observe::live::WatchOptions,
) -> Result<Ending, Failure> {
    let path = crate::observe::log_path_of("status", log_path)?;
    if o.every.is_zero() {
        return Err(Failure::usage("--every must be above zero", None));
    }
    Ok(crate::observe::live::watch(&path, &o))
}

fn status(json: bool, log_path: Option<String>, exit_code: bool) -> Result<Ending, Failure> {
    use crate::observe::status::{self as st, RunState};
    let path = crate::observe::log_path_of("status", log_path)?;
    let root = path.as_path();
    // `--exit-code`: the code of the run's end (see the flag's help).
    let end = |s: &st::Status| match (s.state, &s.abort) {
        (RunState::Stopped, Some(a)) => Ending::Reported(a.cause()),
        (RunState::Stopped, None) => Ending::Reported(crate::exit::Cause::Failed),
        _ => Ending::Done,
    };
    if st::is_pipelined(root) {
        let p = st::read_pipeline(root);
        if json {
            crate::outln!("{}", serde_json::to_string_pretty(&p).expect("json"));
        } else {
            crate::out!("{}", st::render_pipeline(&p));
        }
        // The cluster that stopped first carries the cause (the other was stopped by it).
        let ended = [&p.rollout, &p.update]
            .into_iter()
            .filter_map(|c| c.as_ref().ok())
            .map(end)
            .find(|e| *e != Ending::Done);
        return Ok(ended.filter(|_| exit_code).unwrap_or(Ending::Done));
    }
    let mut s = st::read(root).map_err(|e| Failure::usage(e.to_string(), None))?;
    st::judge(root, &mut s);
    if json {
        crate::outln!("{}", serde_json::to_string_pretty(&s).expect("json"));
    } else {
        crate::out!("{}", st::render(&s));
    }
    Ok(if exit_code { end(&s) } else { Ending::Done })
}

/// Run this process as a node (the default action).
fn run_node(cli: Cli) -> (Option<u32>, Result<Ending, Failure>) {
    let level = logging::resolve(cli.node.log_level, logging::LEVEL_ENV, LogLevel::Info);
    let format = logging::resolve(cli.node.log_format, logging::FORMAT_ENV, LogFormat::Text);
    match (level, format) {
        (Ok(level), Ok(format)) => logging::init(level, format),
        (Err(e), _) | (_, Err(e)) => return (None, Err(Failure::usage(e.to_string(), None))),
    }
    if let Err(e) = no_command_variables(&|name| std::env::var(name).ok()) {
        return (None, Err(e));
    }
    // Before the configuration is read (this reads and removes the supervisor's variable):
    // either this is the node process its supervisor started, or this process
    // becomes the supervisor of one (node::supervisor says why).
    let supervisor = match node::supervisor::Link::inherited() {
        Some(link) => Some(std::sync::Arc::new(link)),
        None => match node::supervisor::run_node_in_child() {
            Ok(code) => return (None, Ok(Ending::PassedOn(code))),
            Err(e) => {
                crate::errln!("warning: cannot start the node in a child process ({e}); running it in this one, which a hung shared filesystem can keep alive past fs-timeout");
                None
            }
        },
    };
    let loaded = match cli.settings.load() {
        Ok(l) => l,
        Err(e) => return (None, Err(e.into())),
    };
    let (rank, rank_source) = match resolve_rank(&cli.node) {
        Ok(r) => r,
        Err(s) => return (None, Err(s)),
    };
    let opts = NodeOptions {
        rank,
        rank_source,
        debug_mode: cli.node.debug_mode,
        fresh: cli.node.fresh,
        supervisor: supervisor.clone(),
    };
    let result = node::run(&loaded, opts);
    let code = result
        .as_ref()
        .map_or_else(Stop::exit_code, |_| Ending::Done.exit_code());
    // First, as printing may block on a hung filesystem and so may the exit: the
    // supervisor exits with this code if this process cannot.
    if let Some(link) = &supervisor {
        link.exiting(rank, code);
    }
    if let Ok(node::Outcome::AlreadyComplete(notice)) = &result {
        crate::error::notify(Some(rank), notice);
    }
    (Some(rank), result.map(|_| Ending::Done))
}

/// The command line as users see it: rl-node's own hidden commands (`__toy`, `__guard`)
/// are left out, so no completion offers them and no man page names them.
fn visible_command() -> clap::Command {
    use clap::CommandFactory;
    let full = Cli::command();
    let mut c = clap::Command::new("rl-node")
        .about(full.get_about().cloned().unwrap_or_default())
        .args(full.get_arguments().cloned())
        .groups(full.get_groups().cloned());
    if full.get_version().is_some() {
        c = c.version(env!("CARGO_PKG_VERSION"));
    }
    c.subcommands(full.get_subcommands().filter(|s| !s.is_hide_set()).cloned())
}

/// `shell`'s completion script. clap_complete's bash script spells a hyphenated program's
/// subcommand states two ways (`rl__node__subcmd__status` where it walks the words,
/// `rl__subcmd__node__subcmd__status` in the arms that complete them: clap issue 6421),
/// so no option after a subcommand ever completed; the arms are respelled here.
fn completion_script(shell: clap_complete::Shell) -> String {
    let mut buf = Vec::new();
    clap_complete::generate(shell, &mut visible_command(), "rl-node", &mut buf);
    let script = String::from_utf8_lossy(&buf).into_owned();
    match shell {
        clap_complete::Shell::Bash => script.replace("rl__subcmd__node", "rl__node"),
        _ => script,
    }
}

/// `rl-node man --out-dir DIR`: a page per subcommand, listed as they are written.
fn write_man_pages(dir: &std::path::Path) -> Result<Ending, Failure> {
    if !dir.is_dir() {
        return Err(Failure::usage(
            format!("--out-dir {}: not a directory", dir.display()),
            None,
        ));
    }
    clap_mangen::generate_to(visible_command(), dir).map_err(|e| {
        Failure::failed(format!(
            "cannot write the man pages into {}: {e}",
            dir.display()
        ))
    })?;
    let mut pages: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| Failure::failed(format!("{}: {e}", dir.display())))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("rl-node") && n.ends_with(".1"))
        .collect();
    pages.sort();
    for p in pages {
        crate::out!("{}\n", dir.join(p).display());
    }
    Ok(Ending::Done)
}
