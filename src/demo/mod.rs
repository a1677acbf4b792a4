//! `rl-node demo`: a real, small RL loop out of the box.
//!
//! The demo starts N nodes of this very binary on this machine over a fresh shared
//! directory, with a toy workload ([`toy`], run through the hidden `rl-node __toy`
//! subcommand) in place of vLLM, the rollout script and torchrun: an HTTP inference
//! server per node, rollout and eval commands that query it and write JSONL, and a
//! data-parallel trainer that all-reduces over TCP. It shows the nodes' phases live, the
//! reward and eval accuracy per iteration, and ends with a summary.
//!
//! `--pipeline` runs the same task twice in one invocation, so the two are measured on the
//! same machine at the same time of day: first the synchronous loop on all N nodes, then
//! a pipelined run (docs/pipeline.md) with N/2 rollout and N/2 update nodes, and compares
//! their time per iteration and their learning curves.

mod moved;
mod progress;
mod run;
pub mod toy;

use clap::Args;
use std::path::PathBuf;

pub use progress::{iteration_report, IterationReport};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Number of nodes to start on this machine [default: 3, or 4 with --pipeline: 2
    /// rollout + 2 update nodes].
    #[arg(long, value_name = "N")]
    pub nodes: Option<u32>,
    /// Run the synchronous loop on N nodes, then a pipelined run with N/2 rollout nodes
    /// and N/2 update nodes (N even), and compare their time per iteration.
    #[arg(long)]
    pub pipeline: bool,
    /// With --pipeline: how many model versions the rollouts may lag (pipeline.staleness).
    #[arg(long, value_name = "K", default_value_t = 1, requires = "pipeline")]
    pub staleness: u64,
    /// Iterations to run [default: 8].
    #[arg(long, value_name = "K")]
    pub iterations: Option<String>,
    /// Eval on iterations 1, 1+K, 1+2K, … [default: 2].
    #[arg(long, value_name = "K")]
    pub eval_interval: Option<String>,
    /// Rollout weight of each rank, e.g. 2,1,1 [default: rank 0 twice the others].
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    pub rank_weights: Option<String>,
    /// Directory for the run (config, shared directory, node logs); default: a fresh
    /// temporary directory, kept and printed. Must be empty or absent.
    #[arg(long, value_name = "PATH")]
    pub dir: Option<PathBuf>,
    /// Seed of the toy task (hidden best actions) and of every sample.
    #[arg(long, value_name = "S", default_value_t = 1)]
    pub seed: u64,
    /// Kill -9 rank R when it reaches phase PHASE (a name like `training`, or its number)
    /// in iteration 2, watch every other node stop, then restart all nodes once (with
    /// --min-nodes: the others go on without it, no restart).
    #[arg(long, value_name = "R@PHASE")]
    pub kill_node: Option<String>,
    /// Elastic mode (cluster.min-nodes): the nodes go on without a node that dies as long
    /// as K nodes are left (K from 1 to N-1); with --kill-node they drop the killed rank,
    /// regroup and finish the run without a restart.
    #[arg(long, value_name = "K")]
    pub min_nodes: Option<u32>,
    /// Toy task size: number of tasks (contexts).
    #[arg(long, value_name = "T", default_value_t = 32)]
    pub tasks: u32,
    /// Toy task size: actions per task (chance reward is 1/A).
    #[arg(long, value_name = "A", default_value_t = 4)]
    pub actions: u32,
    /// Train samples per task and iteration.
    #[arg(long, value_name = "K", default_value_t = 4)]
    pub samples: u32,
    /// Make every rollout, eval and training command take at least this many seconds,
    /// to watch the phases go by (the default run takes about a second) [default: 0, or
    /// 0.5 with --pipeline, so that rollout and training cost enough to overlap].
    #[arg(long, value_name = "SECS")]
    pub pace: Option<f64>,
    /// Learning rate of the REINFORCE step.
    #[arg(long, value_name = "X", default_value_t = 4.0)]
    pub lr: f64,
}

#[derive(Args, Debug)]
pub struct ToyArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// Free ports for servers on this machine (`rl-node rehearse` uses them too).
pub(crate) use run::free_ports;
pub use run::Globals;

pub fn demo_main(
    args: DemoArgs,
    globals: Globals,
) -> Result<crate::error::Ending, crate::error::Failure> {
    run::main(args, globals)
}

pub fn toy_main(args: ToyArgs) -> Result<crate::error::Ending, crate::error::Failure> {
    toy::main(args.args)
}
