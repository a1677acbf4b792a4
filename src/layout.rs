//! Every path rl-node reads or writes, in one place.
//!
//! Protocol state lives under `<log-path>/.rl-node/`; barrier, heartbeat and abort
//! records are namespaced by generation so nothing from an earlier start is mistaken for
//! current. User-facing outputs (trajectories, logs, models) live beside it.

use crate::shards::naming::Naming;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
    /// Names and format of rank shards and merged files (`[aggregate]`).
    naming: Naming,
}

pub fn iter_dir(iteration: u64) -> String {
    format!("iter-{iteration:04}")
}

impl Layout {
    pub fn new(log_path: impl Into<PathBuf>) -> Layout {
        Layout {
            root: log_path.into(),
            naming: Naming::default(),
        }
    }

    /// The same layout with shard and merged file names (and format) from `[aggregate]`.
    pub fn with_naming(mut self, naming: Naming) -> Layout {
        self.naming = naming;
        self
    }

    pub fn naming(&self) -> &Naming {
        &self.naming
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root.join(".rl-node")
    }

    /// Rank 0's record of the current generation (rewritten at every start).
    pub fn cluster(&self) -> PathBuf {
        self.state_dir().join("cluster.json")
    }

    pub fn gen_dir(&self, gen: u64) -> PathBuf {
        self.state_dir().join(format!("gen-{gen}"))
    }

    /// A copy of the generation's cluster record, written once when it starts, from which
    /// `rl-node recover --repair` rebuilds a damaged `cluster.json`.
    pub fn gen_cluster(&self, gen: u64) -> PathBuf {
        self.gen_dir(gen).join("cluster.json")
    }

    /// Rank r's live record in generation `gen`: heartbeat, position, release, abort.
    pub fn rank_record(&self, gen: u64, rank: u32) -> PathBuf {
        self.gen_dir(gen).join(format!("rank-{rank}.json"))
    }

    /// Rank r's journal of completed work (append-only, one writer).
    pub fn journal(&self, rank: u32) -> PathBuf {
        self.state_dir()
            .join("journal")
            .join(format!("rank-{rank}.jsonl"))
    }

    /// One line per start of the cluster, appended by rank 0.
    pub fn history(&self) -> PathBuf {
        self.state_dir().join("history.jsonl")
    }

    /// Where `--fresh` sets an earlier run's files aside.
    pub fn previous_runs(&self) -> PathBuf {
        self.root.join("previous-runs")
    }

    /// The directories a run writes, which `--fresh` moves aside together.
    pub fn run_dirs(&self) -> Vec<PathBuf> {
        [".rl-node", "rollouts", "logs", "models", "train"]
            .iter()
            .map(|d| self.root.join(d))
            .collect()
    }

    /// The first-writer-wins abort record of a generation.
    pub fn abort(&self, gen: u64) -> PathBuf {
        self.gen_dir(gen).join("abort.json")
    }

    pub fn rollout_dir(&self, iteration: u64, split: &str) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join(split)
    }

    /// A rank's committed shard (default `rollout_dir/rank-R.jsonl`; `aggregate.shard-name`).
    pub fn shard(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.naming.shard(&self.root, iteration, split, rank)
    }

    /// Where a rank's command writes while it runs (`{output}`); renamed to `shard` on
    /// success (default `rank-R.partial.jsonl`; `aggregate.partial-name`).
    pub fn shard_partial(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.naming.partial(&self.root, iteration, split, rank)
    }

    /// Where an earlier attempt's partial shard is set aside in generation `gen`
    /// (`<partial>.stale-genG`), never merged and never deleted.
    pub fn stale_partial(&self, iteration: u64, split: &str, rank: u32, gen: u64) -> PathBuf {
        let mut name = self.shard_partial(iteration, split, rank).into_os_string();
        name.push(format!(".stale-gen{gen}"));
        PathBuf::from(name)
    }

    /// The iteration's merged trajectories for a split (default
    /// `rollouts/iter-NNNN/<split>.jsonl`; `aggregate.output-name`).
    pub fn aggregated(&self, iteration: u64, split: &str) -> PathBuf {
        self.naming.output(&self.root, iteration, split)
    }

    pub fn prepared(&self, iteration: u64) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join("prepared")
    }

    pub fn train_output(&self, iteration: u64) -> PathBuf {
        self.root.join("train").join(iter_dir(iteration))
    }

    /// Immutable published checkpoints and the `LATEST` pointer.
    pub fn models(&self) -> PathBuf {
        self.root.join("models")
    }

    /// Captured output of one phase command of one rank.
    pub fn phase_log(&self, iteration: u64, rank: u32, phase: &str) -> PathBuf {
        self.root
            .join("logs")
            .join(iter_dir(iteration))
            .join(format!("rank-{rank}.{phase}.log"))
    }
}
