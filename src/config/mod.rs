//! Configuration: one commented defaults file embedded in the binary, layered under the
//! user's TOML file, `RL_NODE_*` environment variables and the command line.
//!
//! Layering happens on `toml::Value` trees so every key has exactly one spelling (its
//! dotted path in `defaults.toml`), one environment name derived from it, and a recorded
//! source. The defaults file is also the schema: a key it does not list is unknown. Every
//! numeric and duration key has a range ([`ranges`]), checked on the layered values before
//! anything else, so that no value a run cannot use gets past the load.

pub(crate) mod ranges;
pub mod template;

pub use template::Template;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Value;

pub const DEFAULTS_TOML: &str = include_str!("defaults.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("unknown key `{key}` in {source_name}{suggestion}")]
    UnknownKey {
        key: String,
        source_name: String,
        suggestion: String,
    },
    #[error("{key} (from {source_name}): {message}")]
    Invalid {
        key: String,
        source_name: String,
        message: String,
    },
}

/// Where the effective value of a key came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Env(String),
    Cli(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "defaults"),
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Env(name) => write!(f, "environment {name}"),
            Source::Cli(flag) => write!(f, "{flag}"),
        }
    }
}

pub use crate::protocol::phase::RlPhase;

pub use crate::protocol::walk::{walk_item, RolloutSplit};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Cluster {
    pub num_nodes: u32,
    pub rank_weights: Vec<i64>,
    pub rl_phase: RlPhase,
    pub eval_interval: u64,
    pub rollout_split: RolloutSplit,
    pub iterations: u64,
    pub master_addr: String,
    pub master_port: u16,
    pub model: String,
    pub log_path: String,
    pub data_path: String,
    pub gpus_per_node: String,
    pub extra_args: String,
    /// The name of the eval split in `{split}` (run.sh: "test").
    pub eval_split: String,
    /// The first iteration rl-node runs; earlier ones ran before it (a run.sh directory).
    pub first_iteration: u64,
    /// From this many nodes on, barriers gather through group leaders
    /// (`protocol::topology`); 0: never.
    pub barrier_groups_from: u32,
    /// Elastic mode: the fewest nodes the run goes on with (0: `num_nodes`, no loss
    /// tolerated); see [`Config::min_nodes`].
    pub min_nodes: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Timing {
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    #[serde(with = "duration")]
    pub dead_after: Duration,
    #[serde(with = "duration")]
    pub poll_interval: Duration,
    #[serde(with = "duration")]
    pub join_timeout: Duration,
    #[serde(with = "duration")]
    pub barrier_timeout: Duration,
    #[serde(with = "duration")]
    pub kill_grace: Duration,
    #[serde(with = "duration")]
    pub fs_timeout: Duration,
    /// Hang forensics: the fraction of a timeout (or of dead-after) at which a node writes
    /// a hang report; 0: never (`"off"` in the file). See [`HANG_REPORT_AT`].
    pub hang_report_at: f64,
}

/// `timing.hang-report-at`: a fraction, or `"off"` (read as 0).
pub const HANG_REPORT_AT: &str = "timing.hang-report-at";

/// The configuration's command sections, in the order a rank runs them in an iteration:
/// the inference server, then the phase commands (`{phase}` is one of these).
pub const COMMANDS: [&str; 7] = [
    "server",
    "rollout",
    "eval",
    "aggregate",
    "prepare",
    "train",
    "handoff",
];

/// `timing.hang-report-at` as written in the file or the environment: a number, or `off`.
fn parse_hang_report_at(raw: &str) -> Result<Value, String> {
    let raw = raw.trim();
    if raw.eq_ignore_ascii_case("off") {
        return Ok(Value::Float(0.0));
    }
    raw.parse::<f64>()
        .map(Value::Float)
        .map_err(|_| format!("`{raw}` is neither a fraction of the timeout (e.g. 0.5) nor \"off\""))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PhaseCommand {
    pub command: String,
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// A rollout's or eval's `reuse-processes` (not a key of the other phases).
    #[serde(skip)]
    pub reuse_processes: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct HandoffCommand {
    pub command: String,
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// Glob of the checkpoint directory to publish under the training output.
    pub pick: String,
    /// Globs of checkpoint files that readers rewrite in place (not hash-verified).
    pub mutable: Vec<String>,
    /// `move` | `copy` (checked in `validate`; read through [`HandoffCommand::options`]).
    pub transfer: String,
    /// Globs of checkpoint files (or, ending in `/`, directories) not published.
    pub exclude: Vec<String>,
    /// `sizes` | `hash`: what a node checks before serving a checkpoint (see
    /// [`HandoffCommand::check`]).
    pub verify: String,
    /// How many of the newest checkpoints to keep (0: all).
    pub keep_last: u64,
    /// Whether `keep-last` spares the checkpoints that an eval measured.
    pub keep_eval: bool,
}

impl HandoffCommand {
    /// What a hand-off publishes and how.
    pub fn options(&self) -> crate::checkpoint::Options {
        crate::checkpoint::Options {
            mutable: self.mutable.clone(),
            exclude: self.exclude.clone(),
            transfer: crate::checkpoint::Transfer::parse(&self.transfer)
                .expect("validated at load"),
            created_at: None,
            mutation: None,
        }
    }

    /// What a node checks of a checkpoint before it serves or trains from it.
    pub fn check(&self) -> crate::checkpoint::Check {
        crate::checkpoint::Check::parse(&self.verify).expect("validated at load")
    }

    pub fn as_phase(&self) -> PhaseCommand {
        PhaseCommand {
            command: self.command.clone(),
            timeout: self.timeout,
            reuse_processes: false,
        }
    }
}

impl PhaseCommand {
    pub fn is_set(&self) -> bool {
        !self.command.trim().is_empty()
    }
}

/// `[phases.train]`: the training command, and what a failed one does to the cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TrainCommand {
    pub command: String,
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// `stop` | `keep-model` (checked in `validate`; read through [`TrainCommand::policy`]).
    pub on_failure: String,
}

/// What a rank's failed training command (non-zero exit, signal, timeout) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnTrainFailure {
    /// Stop the whole cluster, like any failed command (the default).
    Stop,
    /// Log it, keep the previous model (no hand-off) and go on with the next iteration,
    /// as webgym's run.sh did.
    KeepModel,
}

impl TrainCommand {
    pub fn as_phase(&self) -> PhaseCommand {
        PhaseCommand {
            command: self.command.clone(),
            timeout: self.timeout,
            reuse_processes: false,
        }
    }

    pub fn is_set(&self) -> bool {
        !self.command.trim().is_empty()
    }

    pub fn policy(&self) -> OnTrainFailure {
        OnTrainFailure::parse(&self.on_failure).expect("validated at load")
    }
}

impl OnTrainFailure {
    pub fn parse(s: &str) -> Option<OnTrainFailure> {
        match s {
            "stop" => Some(OnTrainFailure::Stop),
            "keep-model" => Some(OnTrainFailure::KeepModel),
            _ => None,
        }
    }
}

/// A rollout or eval phase: a command, and optionally workers that start theirs only
/// once rank 0's command says so (run.sh made workers wait for rank 0's rollout).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RolloutCommand {
    pub command: String,
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// Workers wait until rank 0's command creates `{ready_file}` (or ends).
    pub workers_wait: bool,
    #[serde(with = "duration")]
    pub workers_wait_timeout: Duration,
    /// Then wait this long more before starting (run.sh waited 120 s).
    #[serde(with = "duration")]
    pub workers_delay: Duration,
    /// A file rank 0's command creates by itself that releases the workers (a template).
    pub workers_wait_for: String,
    /// Per-task items: start the command once per worker slot and hand it items on its
    /// standard input (`node::workers`), rather than once per item.
    pub reuse_processes: bool,
    /// `stop` | `merge-survivors` (checked in `validate`; read through
    /// [`RolloutCommand::policy`]). Left out of the serialised configuration when it is
    /// the default, so that the fingerprint of a configuration that does not set it is
    /// the one it always was (a run started by an earlier version restarts unrefused).
    #[serde(skip_serializing_if = "is_stop")]
    pub on_failure: String,
}

fn is_stop(s: &str) -> bool {
    s == "stop"
}

/// What a rank's failed per-rank rollout or eval command (non-zero exit, signal, timeout)
/// does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRolloutFailure {
    /// Stop the whole cluster, like any failed command (the default).
    Stop,
    /// Log it, commit no shard for the rank and merge the other ranks' shards, as
    /// webgym's run.sh did.
    MergeSurvivors,
    /// Elastic mode: drop the node (it stops); the others go on without it, a stand-in
    /// running its rollout (a node whose GPU or host fails its command).
    DropNode,
}

impl OnRolloutFailure {
    pub fn parse(s: &str) -> Option<OnRolloutFailure> {
        match s {
            "stop" => Some(OnRolloutFailure::Stop),
            "merge-survivors" => Some(OnRolloutFailure::MergeSurvivors),
            "drop-node" => Some(OnRolloutFailure::DropNode),
            _ => None,
        }
    }
}

impl RolloutCommand {
    pub fn as_phase(&self) -> PhaseCommand {
        PhaseCommand {
            command: self.command.clone(),
            timeout: self.timeout,
            reuse_processes: self.reuse_processes,
        }
    }

    pub fn is_set(&self) -> bool {
        !self.command.trim().is_empty()
    }

    pub fn policy(&self) -> OnRolloutFailure {
        OnRolloutFailure::parse(&self.on_failure).expect("validated at load")
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Phases {
    pub rollout: RolloutCommand,
    pub eval: RolloutCommand,
    pub aggregate: PhaseCommand,
    pub prepare: PhaseCommand,
    pub train: TrainCommand,
    pub handoff: HandoffCommand,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Server {
    pub command: String,
    pub port: u16,
    pub health_url: String,
    #[serde(with = "duration")]
    pub start_timeout: Duration,
    /// Attempts to start the server, each with the full `start_timeout`.
    pub start_attempts: u32,
    #[serde(with = "duration")]
    pub start_retry_delay: Duration,
    #[serde(with = "duration")]
    pub stop_grace: Duration,
    pub gpu_drain_mib: u64,
    #[serde(with = "duration")]
    pub gpu_drain_timeout: Duration,
}

/// `[pipeline]`: a rollout cluster and an update cluster overlapping (docs/pipeline.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Pipeline {
    /// -1: not pipelined.
    pub staleness: i64,
    pub model: PipelineModel,
    /// The poll of a wait for the other cluster.
    #[serde(with = "duration")]
    pub poll_interval: Duration,
}

/// `[observe]`: what rank 0 reports about each iteration (docs/metrics.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Observe {
    /// Top-level numeric fields of the merged train records summarised in
    /// `metrics.jsonl` (mean, min, max).
    pub metrics_fields: Vec<String>,
    /// A JSON file the train command writes (a template): its top-level numbers go into
    /// `metrics.jsonl` as `trainer/<key>`. Empty: none.
    pub train_metrics: String,
    /// Where each node rewrites its Prometheus text-format file for node_exporter's
    /// textfile collector (a template; `{rank}` tells ranks on one host apart). Empty: off.
    pub prometheus_textfile: String,
}

/// `[limits]`: the most rl-node reads of one file from the shared directory, by class
/// (`store::ReadLimit`; docs/shared-directory.md, "What rl-node trusts").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Limits {
    /// Journals, the start history, `metrics.jsonl`, event logs (MiB).
    pub journal_mib: u64,
    /// Manifests of checkpoints and merged files (MiB).
    pub manifest_mib: u64,
}

impl Limits {
    /// The range of both keys, in MiB: a limit must leave room for what a real run writes,
    /// and stay far below what would exhaust a node's memory.
    pub const RANGE_MIB: std::ops::RangeInclusive<u64> = 1..=65536;

    /// Make these the limits of this process's reads (`store::ReadLimit`).
    pub fn apply(&self) {
        crate::store::ReadLimit::configure(self.journal_mib, self.manifest_mib);
    }
}

/// Which model a pipelined rollout uses (`pipeline.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PipelineModel {
    Exact,
    Newest,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Tasks {
    pub train: String,
    pub eval: String,
    pub id_field: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkMode {
    PerRank,
    PerTask,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Work {
    pub strategy: crate::work::plan::Strategy,
    pub tasks_per_iteration: u64,
    pub samples_per_task: u32,
    pub seed: u64,
    pub mode: WorkMode,
    /// Node-local: not part of the fingerprint.
    pub max_workers: MaxWorkers,
    pub max_retries: u32,
    pub retryable_exit_codes: Vec<i32>,
    #[serde(with = "duration")]
    pub retry_backoff: Duration,
    pub max_failed_fraction: f64,
    pub exact_budget: bool,
}

/// `work.max-workers`: how many per-task items a node runs at once, a number or `"K/gpu"`.
/// Node-local, as run.sh users scaled their rollout workers to each node's GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxWorkers {
    Count(u32),
    /// K per GPU of this node, counted as for `{nproc_per_node}` (`cluster.gpus-per-node`).
    PerGpu(u32),
}

impl MaxWorkers {
    pub const KEY: &'static str = "work.max-workers";

    /// `"6"` or `"2/gpu"` (a zero or too many is refused by its range, `ranges::RANGES`).
    pub fn parse(raw: &str) -> Result<MaxWorkers, String> {
        let raw = raw.trim();
        if let Ok(n) = raw.parse::<u32>() {
            return Ok(MaxWorkers::Count(n));
        }
        raw.strip_suffix("/gpu")
            .and_then(|k| k.trim().parse::<u32>().ok())
            .map(MaxWorkers::PerGpu)
            .ok_or_else(|| {
                format!(
                    "`{raw}` is neither a number of workers nor \"K/gpu\" (K workers per GPU of this node, e.g. \"4/gpu\")"
                )
            })
    }

    /// Workers on a node with `gpus` GPUs (as resolved for `{nproc_per_node}`).
    pub fn resolve(self, gpus: u32) -> u32 {
        match self {
            MaxWorkers::Count(n) => n,
            MaxWorkers::PerGpu(k) => k.saturating_mul(gpus),
        }
    }

    /// As written in TOML: an integer, or the `"K/gpu"` string.
    fn to_toml(self) -> Value {
        match self {
            MaxWorkers::Count(n) => Value::Integer(n.into()),
            MaxWorkers::PerGpu(k) => Value::String(format!("{k}/gpu")),
        }
    }
}

impl fmt::Display for MaxWorkers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaxWorkers::Count(n) => write!(f, "{n}"),
            MaxWorkers::PerGpu(k) => write!(f, "\"{k}/gpu\""),
        }
    }
}

impl Serialize for MaxWorkers {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MaxWorkers::Count(n) => s.serialize_u32(*n),
            MaxWorkers::PerGpu(k) => s.serialize_str(&format!("{k}/gpu")),
        }
    }
}

impl<'de> Deserialize<'de> for MaxWorkers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<MaxWorkers, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u32),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(n) => Ok(MaxWorkers::Count(n)),
            Raw::Text(t) => MaxWorkers::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

/// `[aggregate]`: how rank shards are named and merged (see `crate::shards::naming`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Aggregate {
    /// auto | jsonl | safetensors | torch | command (checked in `validate`).
    pub format: String,
    pub shard_name: String,
    pub partial_name: String,
    pub output_name: String,
    /// The merge command of format `command`.
    pub command: String,
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// A rollout that writes nothing commits an empty shard instead of failing.
    pub allow_empty_shards: bool,
    /// The rollout command numbers its files from the merged files present: refuse a
    /// rollout whose `{split_iteration}` differs (checked before it starts).
    pub check_numbering: bool,
    /// How much of each JSONL line the merge checks: json | utf8 | none (checked in
    /// `validate`; see `crate::shards::naming::Validate`).
    pub validate: String,
}

impl Aggregate {
    /// The shard and merged file names (and format) these keys describe.
    pub fn naming(
        &self,
    ) -> Result<crate::shards::naming::Naming, crate::shards::naming::NamingError> {
        crate::shards::naming::Naming::new(
            &self.format,
            &self.shard_name,
            &self.partial_name,
            &self.output_name,
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    pub cluster: Cluster,
    pub tasks: Tasks,
    pub work: Work,
    pub timing: Timing,
    pub phases: Phases,
    pub aggregate: Aggregate,
    pub pipeline: Pipeline,
    pub observe: Observe,
    pub limits: Limits,
    pub server: Server,
    /// Variables every command gets (values are templates).
    pub env: BTreeMap<String, String>,
    /// Every template above, parsed once when the configuration is loaded and validated
    /// ([`Config::template`]).
    #[serde(skip)]
    templates: Templates,
}

/// The configuration's templates, parsed: by their text.
#[derive(Debug, Clone, Default)]
struct Templates(std::collections::HashMap<String, Template>);

impl Templates {
    /// Parse every template `c` holds, after `validate` has checked each (an empty
    /// `workers-wait-for`, which it skips, parses too).
    fn of(c: &Config) -> Templates {
        let p = &c.phases;
        let texts = [
            &p.rollout.command,
            &p.eval.command,
            &p.aggregate.command,
            &p.prepare.command,
            &p.train.command,
            &p.handoff.command,
            &p.rollout.workers_wait_for,
            &p.eval.workers_wait_for,
            &c.server.command,
            &c.server.health_url,
            &c.observe.train_metrics,
            &c.observe.prometheus_textfile,
        ]
        .into_iter()
        .chain(c.env.values());
        let mut parsed = std::collections::HashMap::new();
        for text in texts {
            if !parsed.contains_key(text) {
                let t = Template::parse(text).expect("validate checked every template");
                parsed.insert(text.clone(), t);
            }
        }
        Templates(parsed)
    }
}

impl Config {
    /// The parsed template of `text`, one of this configuration's templates (a command,
    /// `workers-wait-for`, the server's command or health URL, an `[env]` value), parsed
    /// once at load.
    pub fn template(&self, text: &str) -> &Template {
        self.templates
            .0
            .get(text)
            .unwrap_or_else(|| panic!("not a template of the loaded configuration: {text:?}"))
    }

    /// Whether `keep-last` spares the checkpoints an eval measured: only when an eval
    /// command runs at all; without one no checkpoint was measured.
    pub fn keeps_eval_checkpoints(&self) -> bool {
        self.phases.handoff.keep_eval && self.phases.eval.is_set()
    }

    pub fn weights(&self) -> Vec<u64> {
        if self.cluster.rank_weights.is_empty() {
            vec![1; self.cluster.num_nodes as usize]
        } else {
            self.cluster
                .rank_weights
                .iter()
                .map(|&w| w as u64)
                .collect()
        }
    }

    /// Shard and merged file names, with the eval split's name and eval cadence.
    pub fn naming(&self) -> crate::shards::naming::Naming {
        let every = match self.cluster.rollout_split {
            RolloutSplit::EvalOnly => 0,
            _ => self.cluster.eval_interval,
        };
        self.aggregate
            .naming()
            .expect("validated at load")
            .with_eval_split(&self.cluster.eval_split, every)
    }

    pub fn log_path(&self) -> PathBuf {
        PathBuf::from(&self.cluster.log_path)
    }

    /// The part of the configuration every node must agree on, as canonical JSON.
    /// Paths are left out: nodes may mount the shared directory at different places.
    pub fn shared_view(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("config serialises");
        if let Some(c) = v.get_mut("cluster").and_then(|c| c.as_object_mut()) {
            c.remove("log-path");
            c.remove("data-path");
            c.remove("master-addr");
            c.remove("gpus-per-node");
        }
        // Task files may live at different paths per node; the plan fingerprint checked
        // at every iteration covers their content.
        if let Some(t) = v.get_mut("tasks").and_then(|t| t.as_object_mut()) {
            t.remove("train");
            t.remove("eval");
        }
        // How many items a node runs at once changes neither the plan nor any output.
        if let Some(w) = v.get_mut("work").and_then(|w| w.as_object_mut()) {
            w.remove("max-workers");
        }
        // When a node writes a hang report changes nothing another node sees.
        if let Some(t) = v.get_mut("timing").and_then(|t| t.as_object_mut()) {
            t.remove("hang-report-at");
        }
        if let Some(obj) = v.as_object_mut() {
            obj.remove("server");
            // Only rank 0 reads it, for its report; outputs do not depend on it.
            obj.remove("observe");
        }
        v
    }

    /// What identifies a run across restarts: changing any of these mid-run would mix
    /// shards planned differently. Timing, timeouts, commands and `iterations` may change,
    /// and so may `rl-phase` / `rollout-split` (rollout and update clusters share a run).
    pub fn run_identity(&self) -> serde_json::Value {
        let c = &self.cluster;
        serde_json::json!({
            "cluster": {
                "num-nodes": c.num_nodes,
                "rank-weights": self.weights(),
                "eval-interval": c.eval_interval,
                "model": c.model,
            },
            "work": {
                "strategy": self.work.strategy,
                "seed": self.work.seed,
                "tasks-per-iteration": self.work.tasks_per_iteration,
                "samples-per-task": self.work.samples_per_task,
            }
        })
    }

    /// The journal item that marks an iteration complete for this walk of the phases: a
    /// rollout-only cluster completing iteration 3 says nothing about the update half.
    pub fn walk_item(&self) -> String {
        walk_item(self.cluster.rl_phase, self.cluster.rollout_split)
    }

    /// `pipeline.staleness` when the run is pipelined.
    /// The fewest nodes the run goes on with after losing some (`cluster.min-nodes`; 0
    /// means `num-nodes`: a loss stops the cluster).
    pub fn min_nodes(&self) -> u32 {
        match self.cluster.min_nodes {
            0 => self.cluster.num_nodes,
            k => k.min(self.cluster.num_nodes),
        }
    }

    /// Whether a node's loss is survived (`min-nodes` below `num-nodes`).
    pub fn elastic(&self) -> bool {
        self.min_nodes() < self.cluster.num_nodes
    }

    pub fn staleness(&self) -> Option<u64> {
        u64::try_from(self.pipeline.staleness).ok()
    }

    /// In a pipelined run, which of its two clusters this node belongs to: its state
    /// lives under `.rl-node/<cluster>/` (`Layout::with_cluster`).
    pub fn pipeline_cluster(&self) -> Option<&'static str> {
        self.staleness()?;
        match self.cluster.rl_phase {
            RlPhase::Rollout => Some("rollout"),
            RlPhase::Update => Some("update"),
            RlPhase::Both => None,
        }
    }

    /// What the two clusters of a pipelined run must agree on: the shared view without
    /// what may differ between them: which half each walks, its own nodes, its timing
    /// (each cluster judges its own nodes), and `iterations` (a cluster that stops earlier
    /// is reported by the one still waiting for it; a restart may extend the run).
    pub fn pipeline_fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut v = self.shared_view();
        if let Some(c) = v.get_mut("cluster").and_then(|c| c.as_object_mut()) {
            for k in [
                "rl-phase",
                "num-nodes",
                "rank-weights",
                "rollout-split",
                "iterations",
            ] {
                c.remove(k);
            }
        }
        if let Some(o) = v.as_object_mut() {
            o.remove("timing");
        }
        let canonical = serde_json::to_string(&v).expect("json");
        hex::encode(&Sha256::digest(canonical.as_bytes())[..8])
    }

    pub fn run_fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let canonical = serde_json::to_string(&self.run_identity()).expect("json");
        hex::encode(&Sha256::digest(canonical.as_bytes())[..8])
    }

    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let canonical = serde_json::to_string(&self.shared_view()).expect("json");
        hex::encode(&Sha256::digest(canonical.as_bytes())[..8])
    }
}

/// The effective configuration and where each key came from.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub sources: BTreeMap<String, Source>,
    value: Value,
}

impl Loaded {
    pub fn source_of(&self, key: &str) -> &Source {
        self.sources.get(key).unwrap_or(&Source::Default)
    }

    /// The effective configuration as TOML, each value annotated with its source when it
    /// is not the default.
    pub fn render(&self) -> String {
        let mut out = String::new();
        render_table(&self.value, "", &self.sources, &mut out);
        out
    }

    fn invalid(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            key: key.to_string(),
            source_name: self.source_of(key).to_string(),
            message: message.into(),
        }
    }
}

fn render_table(v: &Value, prefix: &str, sources: &BTreeMap<String, Source>, out: &mut String) {
    let Some(table) = v.as_table() else { return };
    let (leaves, tables): (Vec<_>, Vec<_>) = table.iter().partition(|(_, v)| !v.is_table());
    if !leaves.is_empty() && !prefix.is_empty() {
        out.push_str(&format!("\n[{prefix}]\n"));
    }
    for (k, v) in leaves {
        let path = join_key(prefix, k);
        let rendered = match v {
            Value::String(s) => toml::Value::String(s.clone()).to_string(),
            other => other.to_string(),
        };
        match sources.get(&path) {
            Some(src) if *src != Source::Default => {
                out.push_str(&format!("{k} = {rendered}   # from {src}\n"))
            }
            _ => out.push_str(&format!("{k} = {rendered}\n")),
        }
    }
    for (k, v) in tables {
        render_table(v, &join_key(prefix, k), sources, out);
    }
}

fn join_key(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_string()
    } else {
        format!("{prefix}.{k}")
    }
}

/// What `workers-wait-for` may name: values every rank has alike.
pub const WAIT_FOR_PLACEHOLDERS: &[&str] = &[
    "log_path",
    "iteration",
    "split",
    "split_iteration",
    "num_nodes",
    "gen",
];

/// An `[env]` variable name: a shell name, and not one rl-node sets itself.
fn check_env_name(name: &str) -> Result<(), String> {
    let shell_name = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !shell_name {
        return Err(format!(
            "`{name}` is not an environment variable name (letters, digits and `_`, not starting with a digit)"
        ));
    }
    if name.starts_with("RL_NODE_") {
        return Err(format!("`{name}`: RL_NODE_* variables are set by rl-node"));
    }
    if let Some((_, key, _)) = template::TORCHRUN_ENV.iter().find(|(n, _, _)| *n == name) {
        return Err(format!(
            "`{name}` is set by rl-node for the training command (from {{{key}}}); set the configuration key instead"
        ));
    }
    Ok(())
}

/// `cluster.num-nodes` -> `RL_NODE_CLUSTER_NUM_NODES`.
pub fn env_name(key: &str) -> String {
    format!("RL_NODE_{}", key.replace(['.', '-'], "_").to_uppercase())
}

/// A command-line override: the flag as the user typed it, the key, and the raw value.
pub struct CliOverride {
    pub flag: String,
    pub key: &'static str,
    pub value: String,
}

/// Build the effective configuration from defaults, an optional file, the environment
/// (`env` is passed in so tests do not depend on the process environment) and overrides.
pub fn load(
    file: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
    cli: &[CliOverride],
) -> Result<Loaded, ConfigError> {
    let defaults: Value = toml::from_str(DEFAULTS_TOML).expect("embedded defaults parse");
    let mut schema = Vec::new();
    leaf_paths(&defaults, "", &mut schema);
    let mut value = defaults.clone();
    let mut sources = BTreeMap::new();

    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let user: Value = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let mut user_paths = Vec::new();
        leaf_paths(&user, "", &mut user_paths);
        for (key, v) in user_paths {
            // `[env]` holds variable names of the user's choosing, each a string.
            if let Some(name) = key.strip_prefix("env.") {
                let Value::String(_) = v else {
                    return Err(ConfigError::Invalid {
                        key: key.clone(),
                        source_name: path.display().to_string(),
                        message: "an environment variable's value must be a string".into(),
                    });
                };
                check_env_name(name).map_err(|message| ConfigError::Invalid {
                    key: key.clone(),
                    source_name: path.display().to_string(),
                    message,
                })?;
                set_path(&mut value, &key, v);
                sources.insert(key, Source::File(path.to_path_buf()));
                continue;
            }
            let Some((_, template)) = schema.iter().find(|(k, _)| *k == key) else {
                return Err(ConfigError::UnknownKey {
                    suggestion: suggest(&key, &schema),
                    key,
                    source_name: path.display().to_string(),
                });
            };
            let v = match (key.as_str(), &v) {
                // A number or "K/gpu": the default (an integer) shows only one of them.
                (MaxWorkers::KEY, Value::String(raw)) => {
                    MaxWorkers::parse(raw).map(MaxWorkers::to_toml)
                }
                (MaxWorkers::KEY, Value::Integer(n)) => {
                    MaxWorkers::parse(&n.to_string()).map(MaxWorkers::to_toml)
                }
                (HANG_REPORT_AT, Value::String(raw)) => parse_hang_report_at(raw),
                // `gpus-per-node = 8` reads as naturally as "8" or "auto".
                ("cluster.gpus-per-node", Value::Integer(n)) => Ok(Value::String(n.to_string())),
                _ => coerce(&v, template),
            }
            .map_err(|message| ConfigError::Invalid {
                key: key.clone(),
                source_name: path.display().to_string(),
                message,
            })?;
            set_path(&mut value, &key, v);
            sources.insert(key, Source::File(path.to_path_buf()));
        }
    }

    for (key, template) in &schema {
        let name = env_name(key);
        if let Some(raw) = env(&name) {
            let v = if key == MaxWorkers::KEY {
                MaxWorkers::parse(&raw).map(MaxWorkers::to_toml)
            } else if key == HANG_REPORT_AT {
                parse_hang_report_at(&raw)
            } else {
                parse_as(&raw, template)
            }
            .map_err(|message| ConfigError::Invalid {
                key: key.clone(),
                source_name: format!("environment {name}"),
                message,
            })?;
            set_path(&mut value, key, v);
            sources.insert(key.clone(), Source::Env(name));
        }
    }

    for o in cli {
        let (_, template) = schema
            .iter()
            .find(|(k, _)| k == o.key)
            .expect("CLI flags map to known keys");
        let v = parse_as(&o.value, template).map_err(|message| ConfigError::Invalid {
            key: o.key.to_string(),
            source_name: o.flag.clone(),
            message,
        })?;
        set_path(&mut value, o.key, v);
        sources.insert(o.key.to_string(), Source::Cli(o.flag.clone()));
    }

    // Before the typed values exist: a number too large for its type (a port of 70000, a
    // u32 of 2^32) is reported with its range like any other value outside it.
    for b in ranges::RANGES {
        let v = get_path(&value, b.key).expect("every range is a key's");
        b.check(v).map_err(|message| ConfigError::Invalid {
            key: b.key.to_string(),
            source_name: sources.get(b.key).unwrap_or(&Source::Default).to_string(),
            message,
        })?;
    }
    let config: Config = value.clone().try_into().map_err(|e: toml::de::Error| {
        // serde names the field; find which layer set it to say where the bad value came from.
        let msg = e.to_string();
        let key = schema
            .iter()
            .map(|(k, _)| k)
            .find(|k| msg.contains(k.rsplit('.').next().unwrap_or(k)))
            .cloned()
            .unwrap_or_else(|| "configuration".into());
        ConfigError::Invalid {
            source_name: sources.get(&key).unwrap_or(&Source::Default).to_string(),
            key,
            message: msg.trim().to_string(),
        }
    })?;
    let mut loaded = Loaded {
        config,
        sources,
        value,
    };
    validate(&loaded)?;
    loaded.config.templates = Templates::of(&loaded.config);
    Ok(loaded)
}

/// Checks that involve more than one key, or more than a key's range (`ranges::RANGES`,
/// checked before). The groups run in this order, and the first error found is the one
/// reported.
fn validate(l: &Loaded) -> Result<(), ConfigError> {
    validate_cluster(l)?;
    validate_work(l)?;
    validate_timing(l)?;
    validate_phase_commands(l)?;
    validate_workers_wait(l)?;
    validate_reuse(l)?;
    validate_eval_split_and_env(l)?;
    validate_train_and_handoff(l)?;
    validate_rollout_failure(l)?;
    validate_aggregate(l)?;
    validate_server_and_observe(l)
}

/// `[cluster]` and `[pipeline]`: weights per rank, the rollout split and what a pipelined
/// run needs.
fn validate_cluster(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let w = &c.cluster.rank_weights;
    if !w.is_empty() && w.len() != c.cluster.num_nodes as usize {
        return Err(l.invalid(
            "cluster.rank-weights",
            format!(
                "{} weight(s) given but num-nodes is {} (from {}): give one weight per rank",
                w.len(),
                c.cluster.num_nodes,
                l.source_of("cluster.num-nodes")
            ),
        ));
    }
    if c.cluster.min_nodes > c.cluster.num_nodes {
        return Err(l.invalid(
            "cluster.min-nodes",
            format!(
                "{} is more than num-nodes ({}, from {}): the run cannot need more nodes than it has",
                c.cluster.min_nodes,
                c.cluster.num_nodes,
                l.source_of("cluster.num-nodes")
            ),
        ));
    }
    if c.elastic() {
        validate_elastic(l)?;
    }
    if c.cluster.rl_phase != RlPhase::Rollout && c.cluster.rollout_split != RolloutSplit::All {
        return Err(l.invalid(
            "cluster.rollout-split",
            format!(
                "only applies with rl-phase = rollout, but rl-phase is {} (from {})",
                format!("{:?}", c.cluster.rl_phase).to_lowercase(),
                l.source_of("cluster.rl-phase")
            ),
        ));
    }
    if let Some(s) = c.staleness() {
        if c.cluster.rl_phase == RlPhase::Both {
            return Err(l.invalid(
                "cluster.rl-phase",
                format!(
                    "a pipelined run (pipeline.staleness = {s}, from {}) has a rollout cluster and an update cluster: start each node with --rl-phase rollout or --rl-phase update",
                    l.source_of("pipeline.staleness")
                ),
            ));
        }
        if c.cluster.rollout_split != RolloutSplit::All {
            return Err(l.invalid(
                "cluster.rollout-split",
                "a pipelined rollout cluster runs both splits (eval on the iterations cluster.eval-interval names); leave rollout-split empty",
            ));
        }
        let keep = c.phases.handoff.keep_last;
        if keep > 0 && keep < s + 2 {
            return Err(l.invalid(
                "phases.handoff.keep-last",
                format!(
                    "keep-last = {keep} could delete a checkpoint the rollout cluster still needs: with pipeline.staleness = {s} it rolls out on a model up to {} versions old; keep at least {}",
                    s + 1,
                    s + 2
                ),
            ));
        }
    }
    Ok(())
}

/// Elastic mode (`min-nodes` below `num-nodes`) covers, so far, a whole iteration on one
/// cluster with statically planned (or unplanned) rollouts: a mode it does not cover is
/// refused at start, naming what to change, rather than found out at the first loss.
fn validate_elastic(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let why = |what: &str| {
        format!(
            "min-nodes = {} (from {}) is not supported with {what} yet: set min-nodes = 0 (any loss stops the cluster), or {}",
            c.cluster.min_nodes,
            l.source_of("cluster.min-nodes"),
            "see docs/elastic.md for what elastic mode covers"
        )
    };
    if c.staleness().is_some() {
        return Err(l.invalid(
            "cluster.min-nodes",
            why("a pipelined run (pipeline.staleness)"),
        ));
    }
    if c.cluster.rl_phase != RlPhase::Both {
        return Err(l.invalid("cluster.min-nodes", why("rl-phase = rollout or update")));
    }
    if c.work.strategy == crate::work::plan::Strategy::Dynamic {
        return Err(l.invalid("cluster.min-nodes", why("work.strategy = \"dynamic\"")));
    }
    for (key, rc) in [
        ("phases.rollout", &c.phases.rollout),
        ("phases.eval", &c.phases.eval),
    ] {
        if rc.workers_wait {
            return Err(l.invalid(
                "cluster.min-nodes",
                why(&format!(
                    "{key}.workers-wait (rank 0's command gates the workers')"
                )),
            ));
        }
    }
    Ok(())
}

/// `[work]`: the size of an iteration's plan, and what needs task files.
fn validate_work(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let w = &c.work;
    let items = w
        .tasks_per_iteration
        .saturating_mul(w.samples_per_task.into());
    if items > ranges::MAX_ITEMS {
        return Err(l.invalid(
            "work.samples-per-task",
            format!(
                "{} × tasks-per-iteration {} (from {}) is {items} items an iteration, above the limit of {} (every node holds an iteration's plan in memory)",
                w.samples_per_task,
                w.tasks_per_iteration,
                l.source_of("work.tasks-per-iteration"),
                ranges::MAX_ITEMS
            ),
        ));
    }
    let planned = planned(c);
    if !planned
        && (w.mode == WorkMode::PerTask || w.strategy == crate::work::plan::Strategy::Dynamic)
    {
        return Err(l.invalid(
            if w.mode == WorkMode::PerTask {
                "work.mode"
            } else {
                "work.strategy"
            },
            "needs task files: set tasks.train (and tasks.eval)",
        ));
    }
    Ok(())
}

/// `[timing]`: intervals that must agree with one another.
fn validate_timing(l: &Loaded) -> Result<(), ConfigError> {
    let t = &l.config.timing;
    if t.dead_after < t.heartbeat_interval * 2 {
        return Err(l.invalid(
            "timing.dead-after",
            format!(
                "{} is less than twice heartbeat-interval ({}): live peers would be declared dead",
                humantime::format_duration(t.dead_after),
                humantime::format_duration(t.heartbeat_interval)
            ),
        ));
    }
    Ok(())
}

/// Each phase's command: it parses, and every placeholder it uses has a value in that
/// phase and mode.
fn validate_phase_commands(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let w = &c.work;
    let planned = planned(c);
    for (name, p) in [
        ("rollout", &c.phases.rollout.as_phase()),
        ("eval", &c.phases.eval.as_phase()),
        ("aggregate", &c.phases.aggregate),
        ("prepare", &c.phases.prepare),
        ("train", &c.phases.train.as_phase()),
        ("handoff", &c.phases.handoff.as_phase()),
    ] {
        let key = format!("phases.{name}.command");
        let t = Template::parse(&p.command).map_err(|e| l.invalid(&key, e.to_string()))?;
        // A placeholder with no value in this mode or phase would become an empty string.
        for used in t.names() {
            if template::PER_TASK.contains(&used) {
                let rollout = name == "rollout" || name == "eval";
                if !rollout || w.mode != WorkMode::PerTask {
                    return Err(l.invalid(
                        &key,
                        format!(
                            "{{{used}}} has a value only in rollout and eval commands with work.mode = \"per-task\" (one command per task and sample){}",
                            if rollout {
                                format!("; work.mode is \"per-rank\" (from {})", l.source_of("work.mode"))
                            } else {
                                String::new()
                            }
                        ),
                    ));
                }
            }
            if used == "ready_file" {
                let gated = match name {
                    "rollout" => c.phases.rollout.workers_wait,
                    "eval" => c.phases.eval.workers_wait,
                    _ => false,
                };
                if !gated {
                    return Err(l.invalid(
                        &key,
                        format!("{{ready_file}} has a value only in a rollout or eval command whose phase sets workers-wait = true (phases.{name}.workers-wait)"),
                    ));
                }
            }
            if used == "resume_from"
                && !((name == "rollout" || name == "eval") && w.mode != WorkMode::PerTask)
            {
                return Err(l.invalid(
                    &key,
                    "{resume_from} (an earlier attempt's partial output) has a value only in rollout and eval commands with work.mode = \"per-rank\"; per-task items are redone one by one and need none",
                ));
            }
            if used == "tasks" && !planned {
                return Err(l.invalid(
                    &key,
                    "{tasks} (this rank's task file) needs task files: set tasks.train (and tasks.eval)",
                ));
            }
        }
    }
    Ok(())
}

/// `reuse-processes` of the rollout and eval phases: only where commands run per item,
/// and then the command line holds nothing that differs from item to item (each item's
/// values come on the worker's standard input).
fn validate_reuse(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let w = &c.work;
    for (name, r) in [("rollout", &c.phases.rollout), ("eval", &c.phases.eval)] {
        if !r.reuse_processes {
            continue;
        }
        let key = format!("phases.{name}.reuse-processes");
        if w.mode != WorkMode::PerTask && w.strategy != crate::work::plan::Strategy::Dynamic {
            return Err(l.invalid(
                &key,
                format!("reuses one process for many items, so it needs work.mode = \"per-task\" or work.strategy = \"dynamic\"; work.mode is \"per-rank\" (from {})", l.source_of("work.mode")),
            ));
        }
        if r.command.trim().is_empty() {
            return Err(l.invalid(
                &key,
                format!("needs a command to reuse: phases.{name}.command is empty"),
            ));
        }
        let t = Template::parse(&r.command).expect("validated before");
        if let Some(used) = t
            .names()
            .into_iter()
            .find(|u| template::PER_TASK.contains(u) || *u == "output")
        {
            return Err(l.invalid(
                &format!("phases.{name}.command"),
                format!("{{{used}}} differs from item to item, but with phases.{name}.reuse-processes = true the command starts once for many items: read the item's \"{}\" from the JSON line each item arrives as on standard input (docs/work.md, \"Reused item processes\")", if used == "task_json" { "task" } else { used }),
            ));
        }
    }
    Ok(())
}

/// `workers-wait` and `workers-wait-for` of the rollout and eval phases.
fn validate_workers_wait(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let w = &c.work;
    for (name, r) in [("rollout", &c.phases.rollout), ("eval", &c.phases.eval)] {
        if !r.workers_wait {
            continue;
        }
        if w.mode == WorkMode::PerTask {
            return Err(l.invalid(
                &format!("phases.{name}.workers-wait"),
                format!("needs work.mode = \"per-rank\" (one command per rank, which rank 0's command releases); work.mode is \"per-task\" (from {})", l.source_of("work.mode")),
            ));
        }
    }
    for (name, r) in [("rollout", &c.phases.rollout), ("eval", &c.phases.eval)] {
        if r.workers_wait_for.trim().is_empty() {
            continue;
        }
        let key = format!("phases.{name}.workers-wait-for");
        if !r.workers_wait {
            return Err(l.invalid(
                &key,
                format!("releases waiting workers, so it needs phases.{name}.workers-wait = true"),
            ));
        }
        let t = Template::parse(&r.workers_wait_for).map_err(|e| l.invalid(&key, e.to_string()))?;
        if let Some(bad) = t
            .names()
            .into_iter()
            .find(|n| !WAIT_FOR_PLACEHOLDERS.contains(n))
        {
            return Err(l.invalid(
                &key,
                format!(
                    "{{{bad}}} cannot be used in a file name every rank computes; use {}",
                    WAIT_FOR_PLACEHOLDERS
                        .iter()
                        .map(|n| format!("{{{n}}}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
            ));
        }
    }
    Ok(())
}

/// The eval split's name, and the `[env]` templates.
fn validate_eval_split_and_env(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let es = &c.cluster.eval_split;
    if es.is_empty()
        || es == "train"
        || !es
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-')
    {
        return Err(l.invalid(
            "cluster.eval-split",
            format!("`{es}` cannot name the eval split: use letters, digits, `-` or `_`, and not \"train\""),
        ));
    }
    for (name, text) in &c.env {
        Template::parse(text).map_err(|e| l.invalid(&format!("env.{name}"), e.to_string()))?;
    }
    Ok(())
}

/// `on-failure` of the rollout and eval phases: a known value, and `merge-survivors` only
/// where one command per rank writes one shard that rl-node's own merge takes.
fn validate_rollout_failure(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    let w = &c.work;
    let splits = [
        ("rollout", &c.phases.rollout, "tasks.train", &c.tasks.train),
        ("eval", &c.phases.eval, "tasks.eval", &c.tasks.eval),
    ];
    for (name, r, tasks_key, tasks) in splits {
        let key = format!("phases.{name}.on-failure");
        let policy = OnRolloutFailure::parse(&r.on_failure).ok_or_else(|| {
            l.invalid(
                &key,
                format!(
                    "`{}` is not \"stop\" (a failed {name} command stops the cluster), \"merge-survivors\" (it is logged, the rank commits no shard and rank 0 merges the other ranks' shards) or \"drop-node\" (elastic mode: the node is dropped and the others go on)",
                    r.on_failure
                ),
            )
        })?;
        if policy == OnRolloutFailure::Stop {
            continue;
        }
        if policy == OnRolloutFailure::DropNode && !c.elastic() {
            return Err(l.invalid(
                &key,
                format!(
                    "\"drop-node\" drops the node and lets the others go on, which needs elastic mode: cluster.min-nodes (from {}) is num-nodes, so any loss stops the cluster; set min-nodes below num-nodes",
                    l.source_of("cluster.min-nodes")
                ),
            ));
        }
        let per_item = if tasks.is_empty() {
            None
        } else if w.mode == WorkMode::PerTask {
            Some(format!(
                "work.mode is \"per-task\" (from {})",
                l.source_of("work.mode")
            ))
        } else if w.strategy == crate::work::plan::Strategy::Dynamic {
            Some(format!(
                "work.strategy is \"dynamic\" (from {})",
                l.source_of("work.strategy")
            ))
        } else {
            None
        };
        if let Some(mode) = per_item {
            return Err(l.invalid(
                &key,
                format!("\"{}\" applies to one command per rank, but {mode} with {tasks_key} set: each item's failure is counted on its own there; use work.max-failed-fraction (and work.max-retries) to let some items fail", r.on_failure),
            ));
        }
        if policy == OnRolloutFailure::MergeSurvivors && c.phases.aggregate.is_set() {
            return Err(l.invalid(
                &key,
                format!("\"merge-survivors\" needs rl-node's own merge to leave a failed rank out, but phases.aggregate.command (from {}) merges the shards itself: use [aggregate] format = \"command\" with [aggregate] command instead, whose {{inputs}} are the surviving ranks' shards", l.source_of("phases.aggregate.command")),
            ));
        }
    }
    Ok(())
}

/// What happens after training: `on-failure`, and the hand-off's patterns, transfer,
/// retention and verification.
fn validate_train_and_handoff(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    if OnTrainFailure::parse(&c.phases.train.on_failure).is_none() {
        return Err(l.invalid(
            "phases.train.on-failure",
            format!(
                "`{}` is neither \"stop\" (a failed training command stops the cluster) nor \"keep-model\" (it is logged, the previous model is kept and the next iteration runs)",
                c.phases.train.on_failure
            ),
        ));
    }
    crate::checkpoint::check_pick_pattern(&c.phases.handoff.pick)
        .map_err(|e| l.invalid("phases.handoff.pick", e))?;
    for g in &c.phases.handoff.mutable {
        crate::checkpoint::check_pick_pattern(g)
            .map_err(|e| l.invalid("phases.handoff.mutable", e))?;
    }
    for g in &c.phases.handoff.exclude {
        let glob = g.strip_suffix('/').unwrap_or(g);
        if glob.is_empty() {
            return Err(l.invalid(
                "phases.handoff.exclude",
                "an empty pattern would leave out nothing (or, as \"/\", everything)",
            ));
        }
        crate::checkpoint::check_pick_pattern(glob)
            .map_err(|e| l.invalid("phases.handoff.exclude", e))?;
    }
    if crate::checkpoint::Transfer::parse(&c.phases.handoff.transfer).is_none() {
        return Err(l.invalid(
            "phases.handoff.transfer",
            format!(
                "`{}` is neither \"move\" (rename the checkpoint into models/ when it can, else copy) nor \"copy\" (always copy; the training output stays as it is)",
                c.phases.handoff.transfer
            ),
        ));
    }
    let h = &c.phases.handoff;
    let (split, interval) = (c.cluster.rollout_split, c.cluster.eval_interval);
    if h.keep_last > 0
        && c.keeps_eval_checkpoints()
        && (2..=9).all(|it| crate::protocol::walk::eval_decision(split, it, interval))
    {
        // Every checkpoint is one an eval measured: keep-last would never delete anything.
        return Err(l.invalid(
            "phases.handoff.keep-last",
            format!(
                "keep-last = {} would delete nothing: every iteration runs eval (cluster.eval-interval = {interval}, or the eval-only split) and keep-eval = true keeps every checkpoint an eval measured; set phases.handoff.keep-eval = false to keep only the newest {}, or a larger cluster.eval-interval",
                h.keep_last, h.keep_last
            ),
        ));
    }
    if crate::checkpoint::Check::parse(&c.phases.handoff.verify).is_none() {
        return Err(l.invalid(
            "phases.handoff.verify",
            format!(
                "`{}` is neither \"sizes\" (the manifest's digest and every file's size) nor \"hash\" (every file's SHA-256)",
                c.phases.handoff.verify
            ),
        ));
    }
    Ok(())
}

/// `[server]` and `[observe]` templates.
fn validate_server_and_observe(l: &Loaded) -> Result<(), ConfigError> {
    let c = &l.config;
    for (key, text) in [
        ("server.command", &c.server.command),
        ("server.health-url", &c.server.health_url),
        ("observe.train-metrics", &c.observe.train_metrics),
        (
            "observe.prometheus-textfile",
            &c.observe.prometheus_textfile,
        ),
    ] {
        Template::parse(text).map_err(|e| l.invalid(key, e.to_string()))?;
    }
    let prom = Template::parse(&c.observe.prometheus_textfile).expect("parsed above");
    if let Some(name) = prom
        .names()
        .into_iter()
        .find(|n| !["rank", "run_id", "job"].contains(n))
    {
        return Err(l.invalid(
            "observe.prometheus-textfile",
            format!("only {{rank}}, {{run_id}} and {{job}} (the batch job's id) can be used in this path, not {{{name}}}: the file is named once, when the node starts (with {{run_id}}: when it has joined its run)"),
        ));
    }
    Ok(())
}

/// Task files are given: the work is planned from them.
fn planned(c: &Config) -> bool {
    !c.tasks.train.is_empty() || !c.tasks.eval.is_empty()
}

/// `[aggregate]`: names, format and merge command, and what the chosen format rules out.
fn validate_aggregate(l: &Loaded) -> Result<(), ConfigError> {
    use crate::shards::naming::Format;
    let c = &l.config;
    let a = &c.aggregate;
    let naming = a
        .naming()
        .map_err(|e| l.invalid(e.key.config_key(), e.message))?;
    let format = naming.format();
    if let Err(m) = a.validate.parse::<crate::shards::naming::Validate>() {
        return Err(l.invalid("aggregate.validate", m));
    }
    if a.check_numbering && !naming.output_numbered() {
        return Err(l.invalid(
            "aggregate.check-numbering",
            format!(
                "needs {{split_iteration}} once in the file name of aggregate.output-name (`{}`): the numbers are read from the merged files' names",
                a.output_name
            ),
        ));
    }
    if format == Format::Command {
        if a.command.trim().is_empty() {
            return Err(l.invalid(
                "aggregate.command",
                "format is command, so a merge command is needed, e.g. \"python3 merge.py --output {output} {inputs}\"",
            ));
        }
        crate::shards::command::check(&a.command).map_err(|m| l.invalid("aggregate.command", m))?;
    } else if !a.command.trim().is_empty() {
        return Err(l.invalid(
            "aggregate.command",
            format!(
                "only used with format = \"command\", but the format is {format} (aggregate.format from {})",
                l.source_of("aggregate.format")
            ),
        ));
    }
    if format != Format::Jsonl {
        let w = &c.work;
        if planned(c)
            && (w.mode == WorkMode::PerTask || w.strategy == crate::work::plan::Strategy::Dynamic)
        {
            return Err(l.invalid(
                if w.mode == WorkMode::PerTask { "work.mode" } else { "work.strategy" },
                format!(
                    "per-task mode and the dynamic strategy concatenate JSONL items, but aggregate.format is {format} (from {}): use per-rank mode with a static strategy",
                    l.source_of("aggregate.format")
                ),
            ));
        }
    }
    Ok(())
}

fn leaf_paths(v: &Value, prefix: &str, out: &mut Vec<(String, Value)>) {
    if let Some(t) = v.as_table() {
        for (k, v) in t {
            let p = join_key(prefix, k);
            if v.is_table() {
                leaf_paths(v, &p, out);
            } else {
                out.push((p, v.clone()));
            }
        }
    }
}

fn get_path<'v>(root: &'v Value, key: &str) -> Option<&'v Value> {
    key.split('.').try_fold(root, |v, part| v.get(part))
}

fn set_path(root: &mut Value, key: &str, v: Value) {
    let mut cur = root;
    let parts: Vec<&str> = key.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        cur = cur
            .as_table_mut()
            .expect("schema tables")
            .entry(part.to_string())
            .or_insert_with(|| Value::Table(Default::default()));
    }
    cur.as_table_mut()
        .expect("schema tables")
        .insert(parts[parts.len() - 1].to_string(), v);
}

/// A file value must have the default's type; a string where a list of integers is
/// expected is accepted in the command-line form ("2,1,1").
fn coerce(v: &Value, template: &Value) -> Result<Value, String> {
    match (template, v) {
        (Value::Array(_), Value::String(s)) => parse_as(s, template),
        (Value::Float(_), Value::Integer(i)) => Ok(Value::Float(*i as f64)),
        (Value::String(_), Value::String(_))
        | (Value::Integer(_), Value::Integer(_))
        | (Value::Float(_), Value::Float(_))
        | (Value::Boolean(_), Value::Boolean(_))
        | (Value::Array(_), Value::Array(_)) => Ok(v.clone()),
        _ => Err(format!(
            "expected {}, found {} `{}`",
            type_name(template),
            type_name(v),
            v
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a number",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "a list",
        Value::Table(_) => "a table",
    }
}

/// Parse a string from the environment or the command line as the default's type.
fn parse_as(raw: &str, template: &Value) -> Result<Value, String> {
    let raw = raw.trim();
    match template {
        Value::Integer(_) => raw
            .parse::<i64>()
            .map(Value::Integer)
            .map_err(|_| format!("expected an integer, got `{raw}`")),
        Value::Float(_) => raw
            .parse::<f64>()
            .map(Value::Float)
            .map_err(|_| format!("expected a number, got `{raw}`")),
        Value::Boolean(_) => match raw {
            "true" | "1" | "yes" => Ok(Value::Boolean(true)),
            "false" | "0" | "no" => Ok(Value::Boolean(false)),
            _ => Err(format!("expected true or false, got `{raw}`")),
        },
        Value::Array(_) => {
            if raw.is_empty() {
                return Ok(Value::Array(vec![]));
            }
            raw.split(',')
                .map(|s| {
                    s.trim().parse::<i64>().map(Value::Integer).map_err(|_| {
                        format!(
                            "expected a comma-separated list of integers like `2,1,1`, got `{raw}`"
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array)
        }
        _ => Ok(Value::String(raw.to_string())),
    }
}

/// The rl-node binary the scripts shipped with rl-node run (`examples/local/run.sh`,
/// `scripts/doctor-nodes`): a user exports it for them, and rl-node itself ignores it.
pub const BIN_ENV: &str = "RL_NODE_BIN";

/// rl-node's own `RL_NODE_*` variables that are not configuration keys: what every
/// command sees (one per placeholder, and the owner marker), the node's log settings, the
/// mark of a node process started by its supervisor, the binary its scripts run, the
/// test-suite switch and test-only fault injection (`RL_NODE_TEST_*`).
fn own_variable(name: &str) -> bool {
    name == template::OWNER_ENV
        || name == BIN_ENV
        || name == crate::logging::LEVEL_ENV
        || name == crate::logging::FORMAT_ENV
        || name == template::SUPERVISOR_ENV
        || name == "RL_NODE_TORCH_TESTS"
        || name.starts_with("RL_NODE_TEST_")
        || template::PLACEHOLDERS
            .iter()
            .any(|(_, env, _)| *env == name)
}

/// The environment variable of every configuration key (`RL_NODE_<SECTION>_<KEY>`).
pub fn key_env_names() -> Vec<String> {
    let defaults: Value = toml::from_str(DEFAULTS_TOML).expect("embedded defaults parse");
    let mut schema = Vec::new();
    leaf_paths(&defaults, "", &mut schema);
    schema.iter().map(|(k, _)| env_name(k)).collect()
}

/// An `RL_NODE_*` variable in `vars` that is neither a configuration key's variable nor
/// one of rl-node's own is a mistake (a typo would otherwise be ignored silently): an
/// error naming it, with the nearest key's variable suggested.
pub fn check_env_names(vars: impl Iterator<Item = String>) -> Result<(), ConfigError> {
    let known = key_env_names();
    let mut names: Vec<String> = vars.filter(|n| n.starts_with("RL_NODE_")).collect();
    names.sort();
    for name in names {
        if known.contains(&name) || own_variable(&name) {
            continue;
        }
        let best = known
            .iter()
            .map(|k| (edit_distance(&name, k), k))
            .min_by_key(|(d, _)| *d);
        return Err(ConfigError::UnknownKey {
            suggestion: match best {
                Some((d, k)) if d <= 4 => format!(" (did you mean `{k}`?)"),
                _ => " (configuration keys map to RL_NODE_<SECTION>_<KEY>, e.g. RL_NODE_TIMING_DEAD_AFTER; `rl-node show-config` lists the keys)".to_string(),
            },
            key: name,
            source_name: "the environment".into(),
        });
    }
    Ok(())
}

fn suggest(key: &str, schema: &[(String, Value)]) -> String {
    let best = schema
        .iter()
        .map(|(k, _)| (edit_distance(key, k), k))
        .min_by_key(|(d, _)| *d);
    match best {
        Some((d, k)) if d <= 3 => format!(" (did you mean `{k}`?)"),
        _ => String::new(),
    }
}

/// Levenshtein distance (the `strsim` crate clap itself uses for its suggestions).
fn edit_distance(a: &str, b: &str) -> usize {
    strsim::levenshtein(a, b)
}

/// Durations as humantime strings ("30s", "10m").
pub mod duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::ranges::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn cli(flag: &str, key: &'static str, value: &str) -> CliOverride {
        CliOverride {
            flag: flag.into(),
            key,
            value: value.into(),
        }
    }

    #[test]
    fn defaults_load_and_every_key_has_an_env_name() {
        let l = load(None, &no_env, &[]).unwrap();
        assert_eq!(l.config.cluster.num_nodes, 1);
        assert_eq!(l.config.timing.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(
            env_name("phases.rollout.command"),
            "RL_NODE_PHASES_ROLLOUT_COMMAND"
        );
    }

    #[test]
    fn every_template_is_parsed_once_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "[phases.train]\ncommand = \"train --rank {rank} --out {output}\"\n[env]\nRUN = \"{log_path}/run\"\n",
        )
        .unwrap();
        let c = load(Some(&f), &no_env, &[]).unwrap().config;
        assert_eq!(
            c.template(&c.phases.train.command).names(),
            ["rank", "output"]
        );
        assert_eq!(c.template(&c.env["RUN"]).names(), ["log_path"]);
        assert_eq!(
            c.template(&c.server.health_url),
            &Template::parse(&c.server.health_url).unwrap()
        );
        // A copy of the configuration (each node holds one) keeps them.
        let copy = c.clone();
        assert_eq!(copy.template(&copy.phases.train.command).names().len(), 2);
    }

    #[test]
    fn precedence_is_cli_then_env_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "[cluster]\nnum-nodes = 2\neval-interval = 4\n[timing]\ndead-after = \"30s\"\n",
        )
        .unwrap();
        let env = |n: &str| match n {
            "RL_NODE_CLUSTER_NUM_NODES" => Some("3".to_string()),
            "RL_NODE_CLUSTER_EVAL_INTERVAL" => Some("5".to_string()),
            _ => None,
        };
        let l = load(
            Some(&f),
            &env,
            &[cli("--num-nodes", "cluster.num-nodes", "4")],
        )
        .unwrap();
        assert_eq!(l.config.cluster.num_nodes, 4);
        assert_eq!(l.config.cluster.eval_interval, 5);
        assert_eq!(l.config.timing.dead_after, Duration::from_secs(30));
        assert_eq!(
            l.source_of("cluster.eval-interval"),
            &Source::Env("RL_NODE_CLUSTER_EVAL_INTERVAL".into())
        );
        assert!(l.render().contains("num-nodes = 4   # from --num-nodes"));
    }

    #[test]
    fn unknown_environment_variables_are_reported_with_the_nearest_key() {
        let e = check_env_names(["RL_NODE_TIMING_DEAD_AFTR".to_string()].into_iter())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`RL_NODE_TIMING_DEAD_AFTR` in the environment"),
            "{e}"
        );
        assert!(
            e.contains("did you mean `RL_NODE_TIMING_DEAD_AFTER`"),
            "{e}"
        );
        // rl-node's own variables (what its commands see) and real keys are fine.
        check_env_names(
            [
                "RL_NODE_RANK",
                "RL_NODE_OWNER",
                "RL_NODE_LOG_LEVEL",
                "RL_NODE_LOG_FORMAT",
                "RL_NODE_BIN",
                "RL_NODE_TIMING_DEAD_AFTER",
                "RL_NODE_TEST_CRASH_AT",
                "HOME",
            ]
            .iter()
            .map(|s| s.to_string()),
        )
        .unwrap();
    }

    /// `[env]` takes any variable name except rl-node's own; its values are templates;
    /// the eval split's name and `workers-wait-for` are checked at load.
    #[test]
    fn env_table_eval_split_and_wait_for_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let load_text = |text: &str| {
            std::fs::write(&f, text).unwrap();
            load(Some(&f), &no_env, &[]).map_err(|e| e.to_string())
        };
        let ok = load_text("[env]\nHF_HOME = \"{data_path}/hf\"\nX_1 = \"1\"\n").unwrap();
        assert_eq!(ok.config.env["HF_HOME"], "{data_path}/hf");
        for (text, want) in [
            (
                "[env]\nRL_NODE_RANK = \"3\"\n",
                "RL_NODE_* variables are set by rl-node",
            ),
            (
                "[env]\nNNODES = \"3\"\n",
                "is set by rl-node for the training command",
            ),
            (
                "[env]\n\"1X\" = \"3\"\n",
                "is not an environment variable name",
            ),
            ("[env]\nX = 3\n", "must be a string"),
            ("[env]\nX = \"{nope}\"\n", "env.X"),
            ("[cluster]\neval-split = \"train\"\n", "cluster.eval-split"),
            (
                "[cluster]\nfirst-iteration = 0\n",
                "cluster.first-iteration",
            ),
            (
                "[cluster]\neval-split = \"a b\"\n",
                "cannot name the eval split",
            ),
            (
                "[phases.rollout]\nworkers-wait-for = \"{log_path}/f\"\n",
                "needs phases.rollout.workers-wait = true",
            ),
            (
                "[phases.eval]\nworkers-wait = true\nworkers-wait-for = \"{log_path}/{output}\"\n",
                "{output} cannot be used",
            ),
        ] {
            let e = load_text(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn gpus_per_node_may_be_written_as_a_number() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[cluster]\ngpus-per-node = 8\n").unwrap();
        let l = load(Some(&f), &no_env, &[]).unwrap();
        assert_eq!(l.config.cluster.gpus_per_node, "8");
    }

    #[test]
    fn unknown_key_is_reported_with_suggestion() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[phases.rollout]\ncomand = \"x\"\n").unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(e.contains("unknown key `phases.rollout.comand`"), "{e}");
        assert!(e.contains("did you mean `phases.rollout.command`"), "{e}");
    }

    /// Each layer's value is checked against its key's range before any typed value
    /// exists: the message names the key, the layer, the value and the range.
    #[test]
    fn a_value_outside_its_range_is_refused_naming_key_source_value_and_range() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[work]\nsamples-per-task = 4294967295\n").unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "work.samples-per-task (from {}): 4294967295 is above the limit of 100000 (range: 1 to 100000)",
                f.display()
            )),
            "{e}"
        );
        let env = |n: &str| {
            (n == "RL_NODE_TIMING_BARRIER_TIMEOUT").then(|| "400000000000years".to_string())
        };
        let e = load(None, &env, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with("timing.barrier-timeout (from environment RL_NODE_TIMING_BARRIER_TIMEOUT): 400000000000years is above the limit of 1year (range: 1ms to 1year)"),
            "{e}"
        );
        // Too large for its type (u16) is a range error too, not serde's.
        let e = load(
            None,
            &no_env,
            &[cli("--master-port", "cluster.master-port", "70000")],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("cluster.master-port (from --master-port): 70000 is above the limit of 65535 (range: 1 to 65535)"),
            "{e}"
        );
        let e = load(
            None,
            &no_env,
            &[cli("--iterations", "cluster.iterations", "-1")],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with(
                "cluster.iterations (from --iterations): -1 is out of range: it must be at least 0"
            ),
            "{e}"
        );
        // The plan of an iteration: tasks × samples.
        std::fs::write(
            &f,
            "[work]\ntasks-per-iteration = 100000\nsamples-per-task = 101\n",
        )
        .unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "work.samples-per-task (from {0}): 101 × tasks-per-iteration 100000 (from {0}) is 10100000 items an iteration, above the limit of 10000000",
                f.display()
            )),
            "{e}"
        );
        std::fs::write(
            &f,
            "[work]\ntasks-per-iteration = 100000\nsamples-per-task = 100\n",
        )
        .unwrap();
        assert!(load(Some(&f), &no_env, &[]).is_ok());
    }

    #[test]
    fn weight_errors_name_the_flag() {
        let e = load(
            None,
            &no_env,
            &[
                cli("--num-nodes", "cluster.num-nodes", "3"),
                cli("--rank-weights", "cluster.rank-weights", "2,1"),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--rank-weights"), "{e}");
        assert!(e.contains("2 weight(s) given but num-nodes is 3"), "{e}");
        let e = load(
            None,
            &no_env,
            &[
                cli("--num-nodes", "cluster.num-nodes", "2"),
                cli("--rank-weights", "cluster.rank-weights", "1,-1"),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("the weight of rank 1 is -1"), "{e}");
    }

    #[test]
    fn bad_duration_and_type_errors_name_the_source() {
        let e = load(
            None,
            &|n: &str| (n == "RL_NODE_TIMING_DEAD_AFTER").then(|| "soon".to_string()),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("RL_NODE_TIMING_DEAD_AFTER"), "{e}");
        assert!(e.contains("invalid duration `soon`"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[cluster]\nnum-nodes = \"three\"\n").unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(
            e.contains("cluster.num-nodes") && e.contains("expected an integer"),
            "{e}"
        );
    }

    #[test]
    fn an_invalid_pick_pattern_is_a_config_error_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[phases.handoff]\npick = \"checkpoint-[\"\n").unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "phases.handoff.pick (from {}): `checkpoint-[` is not a valid glob pattern",
                f.display()
            )),
            "{e}"
        );
        std::fs::write(&f, "[phases.handoff]\npick = \"checkpoint-[0-9]*\"\n").unwrap();
        assert!(load(Some(&f), &no_env, &[]).is_ok());
    }

    #[test]
    fn train_on_failure_is_stop_by_default_and_checked() {
        let d = load(None, &no_env, &[]).unwrap();
        assert_eq!(d.config.phases.train.policy(), OnTrainFailure::Stop);
        let keep = load(
            None,
            &|n: &str| (n == "RL_NODE_PHASES_TRAIN_ON_FAILURE").then(|| "keep-model".into()),
            &[],
        )
        .unwrap();
        assert_eq!(keep.config.phases.train.policy(), OnTrainFailure::KeepModel);
        // Every node must agree on it.
        assert_ne!(d.config.fingerprint(), keep.config.fingerprint());
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[phases.train]\non-failure = \"retry\"\n").unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "phases.train.on-failure (from {}): `retry` is neither \"stop\"",
                f.display()
            )),
            "{e}"
        );
        // Only training has the policy.
        std::fs::write(&f, "[phases.prepare]\non-failure = \"keep-model\"\n").unwrap();
        let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
        assert!(e.contains("unknown key `phases.prepare.on-failure`"), "{e}");
    }

    #[test]
    fn rollout_on_failure_is_stop_by_default_and_checked() {
        let d = load(None, &no_env, &[]).unwrap();
        assert_eq!(d.config.phases.rollout.policy(), OnRolloutFailure::Stop);
        assert_eq!(d.config.phases.eval.policy(), OnRolloutFailure::Stop);
        // The default is left out of the shared view: a configuration that does not set
        // it has the fingerprint it had before the key existed.
        let view = d.config.shared_view();
        for phase in ["rollout", "eval"] {
            assert!(view["phases"][phase].get("on-failure").is_none(), "{view}");
        }
        let env =
            |n: &str| (n == "RL_NODE_PHASES_ROLLOUT_ON_FAILURE").then(|| "merge-survivors".into());
        let merge = load(None, &env, &[]).unwrap();
        assert_eq!(
            merge.config.phases.rollout.policy(),
            OnRolloutFailure::MergeSurvivors
        );
        assert_eq!(merge.config.phases.eval.policy(), OnRolloutFailure::Stop);
        // Every node must agree on it.
        assert_ne!(d.config.fingerprint(), merge.config.fingerprint());

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let refused = |text: &str| {
            std::fs::write(&f, text).unwrap();
            load(Some(&f), &no_env, &[]).unwrap_err().to_string()
        };
        let e = refused("[phases.eval]\non-failure = \"keep-model\"\n");
        assert!(
            e.starts_with(&format!(
                "phases.eval.on-failure (from {}): `keep-model` is not \"stop\"",
                f.display()
            )),
            "{e}"
        );
        let tasks = dir.path().join("t.jsonl");
        std::fs::write(&tasks, "{\"id\": 1}\n").unwrap();
        let t = tasks.display();
        // Per-task mode and the dynamic strategy count each item's failure instead.
        for (work, said) in [
            ("mode = \"per-task\"", "work.mode is \"per-task\""),
            ("strategy = \"dynamic\"", "work.strategy is \"dynamic\""),
        ] {
            let e = refused(&format!(
                "[tasks]\ntrain = \"{t}\"\n[work]\n{work}\n[phases.rollout]\non-failure = \"merge-survivors\"\n"
            ));
            assert!(e.starts_with("phases.rollout.on-failure (from "), "{e}");
            assert!(e.contains(said), "{e}");
            assert!(e.contains("use work.max-failed-fraction"), "{e}");
        }
        // A user merge command cannot be told which ranks to leave out.
        let e = refused("[phases.aggregate]\ncommand = \"true\"\n[phases.eval]\non-failure = \"merge-survivors\"\n");
        assert!(e.starts_with("phases.eval.on-failure (from "), "{e}");
        assert!(e.contains("[aggregate] format = \"command\""), "{e}");
        // Per-rank mode with a static plan is one command per rank, as is a per-task
        // run's eval without eval tasks.
        for text in [
            format!("[tasks]\ntrain = \"{t}\"\n[phases.rollout]\non-failure = \"merge-survivors\"\n"),
            format!("[tasks]\ntrain = \"{t}\"\n[work]\nmode = \"per-task\"\n[phases.eval]\non-failure = \"merge-survivors\"\n"),
        ] {
            std::fs::write(&f, &text).unwrap();
            let l = load(Some(&f), &no_env, &[]).unwrap_or_else(|e| panic!("{text}: {e}"));
            let c = &l.config.phases;
            assert!(
                [c.rollout.policy(), c.eval.policy()].contains(&OnRolloutFailure::MergeSurvivors)
            );
        }
    }

    #[test]
    fn handoff_options_have_defaults_and_are_checked() {
        use crate::checkpoint::{Check, Transfer};
        let d = load(None, &no_env, &[]).unwrap().config.phases.handoff;
        let o = d.options();
        assert_eq!(o.transfer, Transfer::Move);
        assert!(o.exclude.is_empty());
        assert_eq!(d.check(), Check::Sizes);
        assert_eq!(d.keep_last, 0);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "[phases.handoff]\ntransfer = \"copy\"\nverify = \"hash\"\nkeep-last = 3\nkeep-eval = false\nexclude = [\"optimizer*.pt\", \"global_step*/\"]\n",
        )
        .unwrap();
        let h = load(Some(&f), &no_env, &[]).unwrap().config.phases.handoff;
        assert_eq!(h.options().transfer, Transfer::Copy);
        assert_eq!(h.options().exclude, vec!["optimizer*.pt", "global_step*/"]);
        assert_eq!((h.check(), h.keep_last), (Check::Hash, 3));
        assert!(!h.keep_eval, "the test file sets keep-eval = false");
        // Without an eval command no checkpoint was measured: keep-eval spares none, and
        // keep-last with eval due every iteration is no contradiction.
        std::fs::write(&f, "[phases.handoff]\nkeep-last = 1\n").unwrap();
        let c = load(Some(&f), &no_env, &[]).unwrap().config;
        assert!(c.phases.handoff.keep_eval && !c.keeps_eval_checkpoints());
        // With eval every few iterations, keep-eval has something to spare.
        std::fs::write(
            &f,
            "[cluster]\neval-interval = 5\n[phases.handoff]\nkeep-last = 2\n",
        )
        .unwrap();
        let h = load(Some(&f), &no_env, &[]).unwrap().config.phases.handoff;
        assert!(h.keep_eval && h.keep_last == 2);
        for (text, key, says) in [
            (
                "transfer = \"rename\"",
                "transfer",
                "`rename` is neither \"move\"",
            ),
            ("verify = \"none\"", "verify", "`none` is neither \"sizes\""),
            (
                "exclude = [\"opt[\"]",
                "exclude",
                "`opt[` is not a valid glob pattern",
            ),
            (
                "exclude = [\"/\"]",
                "exclude",
                "an empty pattern would leave out nothing",
            ),
            ("keep-last = -1", "keep-last", ""),
            (
                "keep-last = 2\n[phases.eval]\ncommand = \"eval.sh\"",
                "keep-last",
                "keep-last = 2 would delete nothing",
            ),
        ] {
            std::fs::write(&f, format!("[phases.handoff]\n{text}\n")).unwrap();
            let e = load(Some(&f), &no_env, &[]).unwrap_err().to_string();
            assert!(
                e.contains(&format!("phases.handoff.{key}")) && e.contains(says),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn rollout_split_needs_rollout_phase() {
        let e = load(
            None,
            &no_env,
            &[cli(
                "--rollout-split",
                "cluster.rollout-split",
                "train-only",
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("only applies with rl-phase = rollout"), "{e}");
    }

    #[test]
    fn a_pipelined_run_needs_a_half_per_cluster_and_enough_kept_checkpoints() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("rl.toml");
        let load_text = |text: &str| {
            std::fs::write(&f, text).unwrap();
            load(Some(&f), &no_env, &[])
        };
        let off = load_text("").unwrap().config;
        assert_eq!((off.staleness(), off.pipeline_cluster()), (None, None));
        let rollout = load_text(
            "[cluster]\nrl-phase = \"rollout\"\nnum-nodes = 2\n[pipeline]\nstaleness = 1\n",
        )
        .unwrap()
        .config;
        assert_eq!(
            (rollout.staleness(), rollout.pipeline_cluster()),
            (Some(1), Some("rollout"))
        );
        let update = load_text("[cluster]\nrl-phase = \"update\"\nnum-nodes = 3\nrank-weights = [1, 1, 2]\n[pipeline]\nstaleness = 1\n")
            .unwrap()
            .config;
        assert_eq!(update.pipeline_cluster(), Some("update"));
        // The halves and their node counts may differ; the rest may not.
        assert_eq!(
            rollout.pipeline_fingerprint(),
            update.pipeline_fingerprint()
        );
        assert_ne!(rollout.fingerprint(), update.fingerprint());
        let other_seed = load_text(
            "[cluster]\nrl-phase = \"update\"\n[work]\nseed = 9\n[pipeline]\nstaleness = 1\n",
        )
        .unwrap()
        .config;
        assert_ne!(
            rollout.pipeline_fingerprint(),
            other_seed.pipeline_fingerprint()
        );
        for (text, says) in [
            ("[pipeline]\nstaleness = 1\n", "cluster.rl-phase (from defaults): a pipelined run (pipeline.staleness = 1, from"),
            ("[pipeline]\nstaleness = -2\n", "pipeline.staleness (from"),
            (
                "[cluster]\nrl-phase = \"rollout\"\nrollout-split = \"train-only\"\n[pipeline]\nstaleness = 0\n",
                "cluster.rollout-split (from",
            ),
            (
                "[cluster]\nrl-phase = \"update\"\neval-interval = 5\n[pipeline]\nstaleness = 2\n[phases.handoff]\nkeep-last = 3\n",
                "keep-last = 3 could delete a checkpoint the rollout cluster still needs",
            ),
            ("[pipeline]\nmodel = \"latest\"\n", "pipeline.model"),
        ] {
            let e = load_text(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
        assert!(load_text("[cluster]\nrl-phase = \"update\"\neval-interval = 5\n[pipeline]\nstaleness = 2\n[phases.handoff]\nkeep-last = 4\n").is_ok());
    }

    #[test]
    fn fingerprint_ignores_paths_but_not_commands() {
        let a = load(
            None,
            &no_env,
            &[cli("--log-path", "cluster.log-path", "/a")],
        )
        .unwrap();
        let b = load(
            None,
            &no_env,
            &[cli("--log-path", "cluster.log-path", "/b")],
        )
        .unwrap();
        assert_eq!(a.config.fingerprint(), b.config.fingerprint());
        let c = load(
            None,
            &|n: &str| (n == "RL_NODE_PHASES_TRAIN_COMMAND").then(|| "x".to_string()),
            &[],
        )
        .unwrap();
        assert_ne!(a.config.fingerprint(), c.config.fingerprint());
    }

    #[test]
    fn max_workers_is_a_number_or_k_per_gpu_and_node_local() {
        assert_eq!(MaxWorkers::parse(" 6 "), Ok(MaxWorkers::Count(6)));
        assert_eq!(MaxWorkers::parse("4/gpu"), Ok(MaxWorkers::PerGpu(4)));
        assert_eq!(MaxWorkers::PerGpu(2).resolve(3), 6);
        assert_eq!(MaxWorkers::Count(5).resolve(8), 5);
        for bad in ["", "4/node", "/gpu", "-1", "x/gpu", "2.5", "-2/gpu"] {
            assert!(MaxWorkers::parse(bad).is_err(), "{bad}");
        }
        let env = |v: &'static str| {
            move |n: &str| (n == "RL_NODE_WORK_MAX_WORKERS").then(|| v.to_string())
        };
        let per_gpu = load(None, &env("2/gpu"), &[]).unwrap();
        assert_eq!(per_gpu.config.work.max_workers, MaxWorkers::PerGpu(2));
        let count = load(None, &env("7"), &[]).unwrap();
        assert_eq!(count.config.work.max_workers, MaxWorkers::Count(7));
        let default = load(None, &no_env, &[]).unwrap();
        assert_eq!(default.config.work.max_workers, MaxWorkers::Count(4));
        assert_eq!(per_gpu.config.fingerprint(), default.config.fingerprint());
        assert_eq!(count.config.fingerprint(), default.config.fingerprint());
        let e = load(None, &env("4/node"), &[]).unwrap_err().to_string();
        assert!(
            e.starts_with("work.max-workers (from environment RL_NODE_WORK_MAX_WORKERS): `4/node`"),
            "{e}"
        );
        let e = load(None, &env("0/gpu"), &[]).unwrap_err().to_string();
        assert!(
            e.contains("work.max-workers") && e.contains("at least 1"),
            "{e}"
        );
    }

    #[test]
    fn hang_report_at_is_a_fraction_or_off_and_node_local() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let load_text = |text: &str| {
            std::fs::write(&f, text).unwrap();
            load(Some(&f), &no_env, &[]).map_err(|e| e.to_string())
        };
        let default = load(None, &no_env, &[]).unwrap();
        assert_eq!(default.config.timing.hang_report_at, 0.5);
        for (text, want) in [("0.3", 0.3), ("0", 0.0), ("\"off\"", 0.0), ("\"OFF\"", 0.0)] {
            let l = load_text(&format!("[timing]\nhang-report-at = {text}\n")).unwrap();
            assert_eq!(l.config.timing.hang_report_at, want, "{text}");
            assert_eq!(
                l.config.fingerprint(),
                default.config.fingerprint(),
                "{text}"
            );
        }
        let env = |v: &'static str| {
            move |n: &str| (n == "RL_NODE_TIMING_HANG_REPORT_AT").then(|| v.to_string())
        };
        assert_eq!(
            load(None, &env("off"), &[])
                .unwrap()
                .config
                .timing
                .hang_report_at,
            0.0
        );
        assert_eq!(
            load(None, &env("0.25"), &[])
                .unwrap()
                .config
                .timing
                .hang_report_at,
            0.25
        );
        for text in ["1", "1.5", "-0.1", "\"half\"", "\"nan\""] {
            let e = load_text(&format!("[timing]\nhang-report-at = {text}\n")).unwrap_err();
            assert!(e.starts_with("timing.hang-report-at"), "{text}: {e}");
        }
        let e = load(None, &env("soon"), &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "timing.hang-report-at (from environment RL_NODE_TIMING_HANG_REPORT_AT): `soon`"
            ),
            "{e}"
        );
    }
}
