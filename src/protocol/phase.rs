//! The 14 phases of one RL iteration (docs/phases.md).

use serde::{Deserialize, Serialize};

/// Which part of the iteration a node walks (`--rl-phase`): all of it, or the rollout or
/// update half of a split cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RlPhase {
    Both,
    Rollout,
    Update,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    SyncStart,
    TrainRollout,
    RolloutComplete,
    AggregateTrain,
    FilesReady,
    EvalDecision,
    Eval,
    StopServer,
    PrepareData,
    TrainingReady,
    Training,
    Handoff,
    RestartServer,
    FinalSync,
}

pub const ALL: [Phase; 14] = [
    Phase::SyncStart,
    Phase::TrainRollout,
    Phase::RolloutComplete,
    Phase::AggregateTrain,
    Phase::FilesReady,
    Phase::EvalDecision,
    Phase::Eval,
    Phase::StopServer,
    Phase::PrepareData,
    Phase::TrainingReady,
    Phase::Training,
    Phase::Handoff,
    Phase::RestartServer,
    Phase::FinalSync,
];

impl Phase {
    pub fn number(self) -> u8 {
        ALL.iter().position(|p| *p == self).expect("listed") as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::SyncStart => "sync-start",
            Phase::TrainRollout => "train-rollout",
            Phase::RolloutComplete => "rollout-complete",
            Phase::AggregateTrain => "aggregate-train",
            Phase::FilesReady => "files-ready",
            Phase::EvalDecision => "eval-decision",
            Phase::Eval => "eval",
            Phase::StopServer => "stop-server",
            Phase::PrepareData => "prepare-data",
            Phase::TrainingReady => "training-ready",
            Phase::Training => "training",
            Phase::Handoff => "handoff",
            Phase::RestartServer => "restart-server",
            Phase::FinalSync => "final-sync",
        }
    }

    /// The phases one iteration walks for an `--rl-phase`.
    pub fn walk(rl_phase: RlPhase) -> &'static [Phase] {
        match rl_phase {
            RlPhase::Both => &ALL,
            RlPhase::Rollout => &ALL[0..=6],
            RlPhase::Update => &ALL[7..=13],
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.number(), self.name())
    }
}

/// Eval runs on iterations 1, 1+k, 1+2k, … (k = 0: never).
pub fn eval_due(iteration: u64, interval: u64) -> bool {
    interval > 0 && iteration >= 1 && (iteration - 1).is_multiple_of(interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbering_and_walks() {
        assert_eq!(Phase::SyncStart.number(), 0);
        assert_eq!(Phase::FinalSync.number(), 13);
        assert_eq!(Phase::walk(RlPhase::Rollout).len(), 7);
        assert_eq!(Phase::walk(RlPhase::Update)[0], Phase::StopServer);
    }

    #[test]
    fn eval_schedule() {
        let due: Vec<u64> = (1..=13).filter(|i| eval_due(*i, 6)).collect();
        assert_eq!(due, vec![1, 7, 13]);
        assert!((1..=5).all(|i| eval_due(i, 1)));
        assert!(!(1..=5).any(|i| eval_due(i, 0)));
    }
}
