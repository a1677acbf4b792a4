//! Every path rl-node reads or writes, in one place.
//!
//! Protocol state lives under `<log-path>/.rl-node/`; barrier, heartbeat and abort
//! records are namespaced by generation so nothing from an earlier start is mistaken for
//! current. User-facing outputs (trajectories, logs, models) live beside it.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
}

pub fn iter_dir(iteration: u64) -> String {
    format!("iter-{iteration:04}")
}

impl Layout {
    pub fn new(log_path: impl Into<PathBuf>) -> Layout {
        Layout {
            root: log_path.into(),
        }
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

    /// A rank's committed shard.
    pub fn shard(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.rollout_dir(iteration, split)
            .join(format!("rank-{rank}.jsonl"))
    }

    /// Where a rank's command writes while it runs (`{output}`); renamed to `shard` on success.
    pub fn shard_partial(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.rollout_dir(iteration, split)
            .join(format!("rank-{rank}.partial.jsonl"))
    }

    /// The iteration's merged trajectories for a split.
    pub fn aggregated(&self, iteration: u64, split: &str) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join(format!("{split}.jsonl"))
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
