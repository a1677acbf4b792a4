//! The walk of one iteration as an explicit list of steps: the 14 phases, the barriers
//! inside them (`eval-complete`, `training-complete`, `handoff-complete`), and which rank
//! does which piece of work.
//!
//! [`IterationWalk`] is a small state machine. The node asks it for the next [`Step`]
//! and performs it; the two decisions taken during the walk come back to it: the eval
//! decision rank 0 broadcasts ([`IterationWalk::eval_decided`]) and the ranks whose
//! training failed ([`IterationWalk::training_released`]). It owns the iteration's state
//! as the node learns it: the phase entered last, this rank's training outcome until it
//! is gathered, the failures released, and (rank 0) the shards gathered before a merge.
//! It does no I/O: the simulator walks the same steps.

use super::journal::{item, Resume};
use super::messages::{RankFailure, Shards, TrainFailed, TrainingFailures};
use super::phase::{eval_due, RlPhase};
use super::Phase;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Which rollouts an iteration runs (`cluster.rollout-split`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RolloutSplit {
    #[serde(rename = "")]
    All,
    TrainOnly,
    EvalOnly,
}

/// The journal item that marks an iteration complete for a walk: a rollout-only and an
/// update-only cluster complete iterations separately.
pub fn walk_item(rl_phase: RlPhase, split: RolloutSplit) -> String {
    let split = match split {
        RolloutSplit::All => "",
        RolloutSplit::TrainOnly => "-train-only",
        RolloutSplit::EvalOnly => "-eval-only",
    };
    let phase = match rl_phase {
        RlPhase::Both => "both",
        RlPhase::Rollout => "rollout",
        RlPhase::Update => "update",
    };
    format!("iteration-complete:{phase}{split}")
}

/// Whether iteration `iteration` runs the eval rollout: rank 0 decides, and broadcasts
/// the decision with the release of `files-ready`.
pub fn eval_decision(split: RolloutSplit, iteration: u64, interval: u64) -> bool {
    match split {
        RolloutSplit::EvalOnly => true,
        RolloutSplit::TrainOnly => false,
        RolloutSplit::All => eval_due(iteration, interval),
    }
}

/// Whether a run of rollout split `split` rolls out the train split (every iteration).
pub fn trains(split: RolloutSplit) -> bool {
    split != RolloutSplit::EvalOnly
}

/// The splits rolled out in `iteration`, the eval one as rank 0 decides it (released
/// with `files-ready`).
pub fn splits_rolled_out(split: RolloutSplit, iteration: u64, interval: u64) -> Vec<Split> {
    let mut out = Vec::with_capacity(2);
    if trains(split) {
        out.push(Split::Train);
    }
    if eval_decision(split, iteration, interval) {
        out.push(Split::Eval);
    }
    out
}

/// A rollout split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Eval,
}

impl Split {
    /// The split named `name` (`train`, `eval`).
    pub fn of(name: &str) -> Option<Split> {
        match name {
            "train" => Some(Split::Train),
            "eval" => Some(Split::Eval),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Eval => "eval",
        }
    }
}

/// The barriers of the walk, in order. Five are phases of their own; the others end a
/// phase that does work.
///
/// Each exists because some rank needs what another rank did before it goes on:
/// `sync-start` the plan (and a pipelined run's model) rank 0 releases; `rollout-complete`
/// every rank's committed shard, before rank 0 merges; `files-ready` the merged train file,
/// before anyone evaluates, with the eval decision in its release (a barrier of its own
/// with no work between the two would cost a round trip per iteration and decide
/// nothing more); `eval-complete` every eval shard, before rank 0 merges them;
/// `training-ready` the prepared data and a stopped server on every node, before torchrun's
/// rendezvous; `training-complete` every rank's training outcome, before the hand-off;
/// `handoff-complete` the checkpoint rank 0 published, before the servers restart on it;
/// `final-sync` every rank's numbers for metrics.jsonl, and no rank a whole iteration
/// ahead of another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Barrier {
    /// Gathers nothing; rank 0 broadcasts its plan fingerprints.
    SyncStart,
    RolloutComplete,
    /// Rank 0 broadcasts the eval decision (phase `eval-decision` waits for nothing more).
    FilesReady,
    EvalComplete,
    TrainingReady,
    /// Each rank gathers whether its training failed; rank 0 broadcasts the failures.
    TrainingComplete,
    /// Rank 0 broadcasts the model to serve next.
    HandoffComplete,
    FinalSync,
}

impl Barrier {
    pub fn name(self) -> &'static str {
        match self {
            Barrier::SyncStart => "sync-start",
            Barrier::RolloutComplete => "rollout-complete",
            Barrier::FilesReady => "files-ready",
            Barrier::EvalComplete => "eval-complete",
            Barrier::TrainingReady => "training-ready",
            Barrier::TrainingComplete => "training-complete",
            Barrier::HandoffComplete => "handoff-complete",
            Barrier::FinalSync => "final-sync",
        }
    }
}

/// What a node does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Enter a phase (the node publishes it in its record).
    Enter(Phase),
    Barrier(Barrier),
    /// This rank's rollout of a split, then its commit; journaled.
    Rollout(Split),
    /// Rank 0 merges a split's shards; journaled.
    Aggregate(Split),
    StopServer,
    /// Rank 0's prepare command; journaled.
    Prepare,
    /// This rank's part of training (journaled), or, with `reuse`, the outcome every
    /// rank journaled before a restart.
    Train {
        reuse: bool,
    },
    /// Rank 0 publishes the trained checkpoint and `LATEST`; journaled.
    Handoff,
    /// Rank 0: training failed on some rank (`on-failure = "keep-model"`), so nothing is
    /// handed off; journaled.
    SkipHandoff,
    /// Start the server on the new model; `last`: the last planned iteration, where it is
    /// not restarted.
    RestartServer {
        last: bool,
    },
    /// The end of the iteration: journal the walk's completion item.
    Complete,
}

impl Step {
    /// The journal item this step commits, if any (`Node::once` skips a step whose item
    /// the rank journaled before a restart). Training is journaled by outcome and the
    /// completion by the walk's item; neither is skipped this way.
    pub fn once_item(self) -> Option<&'static str> {
        match self {
            Step::Rollout(Split::Train) => Some(item::ROLLOUT_TRAIN),
            Step::Rollout(Split::Eval) => Some(item::ROLLOUT_EVAL),
            Step::Aggregate(Split::Train) => Some(item::AGGREGATE_TRAIN),
            Step::Aggregate(Split::Eval) => Some(item::AGGREGATE_EVAL),
            Step::Prepare => Some(item::PREPARE),
            Step::Handoff => Some(item::HANDOFF),
            Step::SkipHandoff => Some(item::HANDOFF_SKIPPED),
            _ => None,
        }
    }
}

/// What the walk depends on, fixed for a run. The default: a worker's walk of both
/// halves and every split, no prepare command, no last iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalkConfig {
    pub rl_phase: RlPhase,
    pub split: RolloutSplit,
    pub rank_0: bool,
    /// A prepare command is configured.
    pub prepare: bool,
    /// The last planned iteration (0: no limit).
    pub iterations: u64,
}

impl Default for WalkConfig {
    fn default() -> WalkConfig {
        WalkConfig {
            rl_phase: RlPhase::Both,
            split: RolloutSplit::All,
            rank_0: false,
            prepare: false,
            iterations: 0,
        }
    }
}

/// One iteration's walk.
#[derive(Debug, Clone)]
pub struct IterationWalk {
    cfg: WalkConfig,
    iteration: u64,
    reuse_training: bool,
    phases: &'static [Phase],
    next_phase: usize,
    queue: VecDeque<Step>,
    eval: Option<bool>,
    /// The ranks whose training failed, with why, once `training-complete` released.
    failures: Option<Vec<(u32, String)>>,
    /// The phase of the last [`Step::Enter`] yielded.
    phase: Option<Phase>,
    /// This rank's training outcome (`Some(why)`: failed), until `training-complete`
    /// gathers it.
    outcome: Option<String>,
    /// Rank 0: what the arrivals at `rollout-complete` or `eval-complete` said of a
    /// split's shards, until its merge takes them.
    shards: Option<(Split, Shards)>,
    done: bool,
}

impl IterationWalk {
    /// The walk of `iteration` in a generation that began at `resume`.
    pub fn new(cfg: WalkConfig, iteration: u64, resume: Resume) -> IterationWalk {
        IterationWalk {
            cfg,
            iteration,
            // Training is all-or-nothing across ranks: not redone only when every rank
            // journaled it (rank 0 found that in the journals when the generation began).
            reuse_training: resume.train_done && resume.iteration == iteration,
            phases: Phase::walk(cfg.rl_phase),
            next_phase: 0,
            queue: VecDeque::new(),
            eval: None,
            failures: None,
            phase: None,
            outcome: None,
            shards: None,
            done: false,
        }
    }

    /// A walk that takes no step: the node's state before its first iteration.
    pub fn idle() -> IterationWalk {
        let mut walk = IterationWalk::new(WalkConfig::default(), 0, Resume::default());
        walk.done = true;
        walk
    }

    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// The phase entered last (`None` before the first).
    pub fn phase(&self) -> Option<Phase> {
        self.phase
    }

    /// This rank's part of training ended: `Some(why)` if it failed.
    pub fn trained(&mut self, outcome: Option<String>) {
        self.outcome = outcome;
    }

    /// What this rank gathers at `training-complete`: why its training failed, if it did.
    pub fn training_gather(&mut self) -> Option<TrainFailed> {
        self.outcome.take().map(|failed| TrainFailed { failed })
    }

    /// Rank 0: `training-complete`'s release from every rank's arrival, in rank order:
    /// the ranks whose training failed (`None`: none did).
    pub fn training_decide(arrivals: Vec<Option<TrainFailed>>) -> Option<TrainingFailures> {
        let failed: Vec<RankFailure> = (0..)
            .zip(arrivals)
            .filter_map(|(rank, a)| {
                Some(RankFailure {
                    rank,
                    failed: a?.failed,
                })
            })
            .collect();
        (!failed.is_empty()).then_some(TrainingFailures { failed })
    }

    /// The ranks whose training failed, with why, as `training-complete` released them
    /// (empty before the release, and when none did).
    pub fn training_failures(&self) -> &[(u32, String)] {
        self.failures.as_deref().unwrap_or_default()
    }

    /// Rank 0: what the arrivals said of `split`'s shards, for its merge.
    pub fn shards_gathered(&mut self, split: Split, shards: Shards) {
        self.shards = Some((split, shards));
    }

    /// Rank 0: what the arrivals said of `split`'s shards, taken for its merge (`None`:
    /// not gathered in this iteration, as after a restart that reused the barrier).
    pub fn take_shards(&mut self, split: Split) -> Option<Shards> {
        match self.shards.take() {
            Some((s, shards)) if s == split => Some(shards),
            other => {
                self.shards = other;
                None
            }
        }
    }

    /// Rank 0's eval decision, as released with `files-ready`.
    pub fn eval_decided(&mut self, eval: bool) {
        self.eval = Some(eval);
    }

    /// `training-complete`'s release: the ranks whose training failed (`None`: none).
    /// Whether it failed anywhere.
    pub fn training_released(&mut self, released: Option<TrainingFailures>) -> bool {
        let failures: Vec<(u32, String)> = released
            .map(|r| r.failed.into_iter().map(|f| (f.rank, f.failed)).collect())
            .unwrap_or_default();
        let failed = !failures.is_empty();
        self.failures = Some(failures);
        failed
    }

    /// The next step; `None` once the iteration is complete.
    ///
    /// # Panics
    /// When the walk reaches the eval phase before [`Self::eval_decided`], or the
    /// hand-off before [`Self::training_released`]: the node feeds both as the barriers
    /// release.
    pub fn next_step(&mut self) -> Option<Step> {
        loop {
            if let Some(step) = self.queue.pop_front() {
                if let Step::Enter(phase) = step {
                    self.phase = Some(phase);
                }
                return Some(step);
            }
            if self.done {
                return None;
            }
            let Some(&phase) = self.phases.get(self.next_phase) else {
                self.done = true;
                return Some(Step::Complete);
            };
            self.next_phase += 1;
            self.queue.push_back(Step::Enter(phase));
            self.expand(phase);
        }
    }

    fn expand(&mut self, phase: Phase) {
        let (cfg, q) = (self.cfg, &mut self.queue);
        let trains = trains(cfg.split);
        match phase {
            Phase::SyncStart => q.push_back(Step::Barrier(Barrier::SyncStart)),
            Phase::TrainRollout if trains => q.push_back(Step::Rollout(Split::Train)),
            Phase::TrainRollout => {}
            Phase::RolloutComplete => q.push_back(Step::Barrier(Barrier::RolloutComplete)),
            Phase::AggregateTrain if trains && cfg.rank_0 => {
                q.push_back(Step::Aggregate(Split::Train))
            }
            Phase::AggregateTrain => {}
            Phase::FilesReady => q.push_back(Step::Barrier(Barrier::FilesReady)),
            // Decided: the decision came with files-ready's release.
            Phase::EvalDecision => {}
            Phase::Eval => {
                let eval = self
                    .eval
                    .expect("the eval decision is released before the eval phase");
                if eval {
                    q.push_back(Step::Rollout(Split::Eval));
                    q.push_back(Step::Barrier(Barrier::EvalComplete));
                    if cfg.rank_0 {
                        q.push_back(Step::Aggregate(Split::Eval));
                    }
                }
            }
            Phase::StopServer => q.push_back(Step::StopServer),
            Phase::PrepareData if cfg.rank_0 && cfg.prepare => q.push_back(Step::Prepare),
            Phase::PrepareData => {}
            Phase::TrainingReady => q.push_back(Step::Barrier(Barrier::TrainingReady)),
            Phase::Training => {
                q.push_back(Step::Train {
                    reuse: self.reuse_training,
                });
                q.push_back(Step::Barrier(Barrier::TrainingComplete));
            }
            Phase::Handoff => {
                if cfg.rank_0 {
                    let failed = !self
                        .failures
                        .as_ref()
                        .expect("training-complete is released before the hand-off")
                        .is_empty();
                    q.push_back(if failed {
                        Step::SkipHandoff
                    } else {
                        Step::Handoff
                    });
                }
                q.push_back(Step::Barrier(Barrier::HandoffComplete));
            }
            Phase::RestartServer => q.push_back(Step::RestartServer {
                last: cfg.iterations > 0 && self.iteration >= cfg.iterations,
            }),
            Phase::FinalSync => q.push_back(Step::Barrier(Barrier::FinalSync)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rank_0: bool) -> WalkConfig {
        WalkConfig {
            rl_phase: RlPhase::Both,
            split: RolloutSplit::All,
            rank_0,
            prepare: true,
            iterations: 3,
        }
    }

    /// `training-complete`'s release when rank 1's training failed, or none did.
    fn released(failed: bool) -> Option<TrainingFailures> {
        IterationWalk::training_decide(vec![
            None,
            failed.then(|| TrainFailed {
                failed: "exit 3".into(),
            }),
        ])
    }

    /// Walk to the end, answering the two decisions as given.
    fn steps(mut w: IterationWalk, eval: bool, failed: bool) -> Vec<Step> {
        let mut out = Vec::new();
        while let Some(s) = w.next_step() {
            match s {
                Step::Barrier(Barrier::FilesReady) => w.eval_decided(eval),
                Step::Barrier(Barrier::TrainingComplete) => {
                    w.training_released(released(failed));
                }
                _ => {}
            }
            out.push(s);
        }
        out
    }

    fn work(steps: &[Step]) -> Vec<Step> {
        steps
            .iter()
            .copied()
            .filter(|s| !matches!(s, Step::Enter(_)))
            .collect()
    }

    #[test]
    fn rank_0_walks_every_phase_with_the_sub_barriers_in_order() {
        let all = steps(
            IterationWalk::new(cfg(true), 1, Resume::default()),
            true,
            false,
        );
        let entered: Vec<Phase> = all
            .iter()
            .filter_map(|s| match s {
                Step::Enter(p) => Some(*p),
                _ => None,
            })
            .collect();
        assert_eq!(entered, crate::protocol::phase::ALL);
        use Barrier as B;
        assert_eq!(
            work(&all),
            vec![
                Step::Barrier(B::SyncStart),
                Step::Rollout(Split::Train),
                Step::Barrier(B::RolloutComplete),
                Step::Aggregate(Split::Train),
                Step::Barrier(B::FilesReady),
                Step::Rollout(Split::Eval),
                Step::Barrier(B::EvalComplete),
                Step::Aggregate(Split::Eval),
                Step::StopServer,
                Step::Prepare,
                Step::Barrier(B::TrainingReady),
                Step::Train { reuse: false },
                Step::Barrier(B::TrainingComplete),
                Step::Handoff,
                Step::Barrier(B::HandoffComplete),
                Step::RestartServer { last: false },
                Step::Barrier(B::FinalSync),
                Step::Complete,
            ]
        );
    }

    #[test]
    fn every_rank_passes_the_same_barriers() {
        for (eval, failed) in [(false, false), (true, false), (true, true), (false, true)] {
            let barriers = |rank_0| -> Vec<Step> {
                steps(
                    IterationWalk::new(cfg(rank_0), 2, Resume::default()),
                    eval,
                    failed,
                )
                .into_iter()
                .filter(|s| matches!(s, Step::Barrier(_)))
                .collect()
            };
            assert_eq!(
                barriers(true),
                barriers(false),
                "eval {eval}, failed {failed}"
            );
        }
    }

    #[test]
    fn a_worker_does_no_rank_0_work_and_a_failed_training_hands_nothing_off() {
        let w = work(&steps(
            IterationWalk::new(cfg(false), 3, Resume::default()),
            false,
            true,
        ));
        assert!(!w.iter().any(|s| matches!(
            s,
            Step::Aggregate(_) | Step::Prepare | Step::Handoff | Step::SkipHandoff
        )));
        assert!(w.contains(&Step::RestartServer { last: true }));
        let r0 = work(&steps(
            IterationWalk::new(cfg(true), 3, Resume::default()),
            false,
            true,
        ));
        assert!(r0.contains(&Step::SkipHandoff) && !r0.contains(&Step::Handoff));
        assert!(!r0.contains(&Step::Rollout(Split::Eval)));
    }

    #[test]
    fn training_is_reused_only_in_the_resume_iteration_when_every_rank_trained() {
        let resume = Resume {
            iteration: 4,
            train_done: true,
            train_failed: false,
        };
        let reuse = |it| {
            work(&steps(
                IterationWalk::new(cfg(true), it, resume),
                false,
                false,
            ))
            .contains(&Step::Train { reuse: true })
        };
        assert!(reuse(4));
        assert!(!reuse(5));
        let partial = Resume {
            train_done: false,
            ..resume
        };
        let w = work(&steps(
            IterationWalk::new(cfg(true), 4, partial),
            false,
            false,
        ));
        assert!(w.contains(&Step::Train { reuse: false }));
    }

    #[test]
    fn split_clusters_walk_their_half() {
        let rollout = WalkConfig {
            rl_phase: RlPhase::Rollout,
            ..cfg(true)
        };
        let w = work(&steps(
            IterationWalk::new(rollout, 1, Resume::default()),
            true,
            false,
        ));
        assert_eq!(w.last(), Some(&Step::Complete));
        assert!(!w
            .iter()
            .any(|s| matches!(s, Step::Train { .. } | Step::StopServer)));
        let update = WalkConfig {
            rl_phase: RlPhase::Update,
            ..cfg(true)
        };
        let mut walk = IterationWalk::new(update, 1, Resume::default());
        let mut w = Vec::new();
        while let Some(s) = walk.next_step() {
            if s == Step::Barrier(Barrier::TrainingComplete) {
                walk.training_released(None);
            }
            w.push(s);
        }
        assert_eq!(w[0], Step::Enter(Phase::StopServer));
        assert!(!w.iter().any(|s| matches!(s, Step::Rollout(_))));
        let eval_only = WalkConfig {
            split: RolloutSplit::EvalOnly,
            ..cfg(true)
        };
        let w = work(&steps(
            IterationWalk::new(eval_only, 1, Resume::default()),
            true,
            false,
        ));
        assert!(!w.contains(&Step::Rollout(Split::Train)));
        assert!(!w.contains(&Step::Aggregate(Split::Train)));
        assert!(w.contains(&Step::Rollout(Split::Eval)));
    }

    #[test]
    fn the_walk_keeps_the_iterations_state_as_the_node_learns_it() {
        let mut w = IterationWalk::new(cfg(true), 2, Resume::default());
        assert_eq!(w.phase(), None);
        let mut gathered = None;
        while let Some(s) = w.next_step() {
            match s {
                Step::Enter(p) => assert_eq!(w.phase(), Some(p)),
                Step::Barrier(Barrier::RolloutComplete) => {
                    w.shards_gathered(Split::Train, Shards::default())
                }
                Step::Aggregate(Split::Train) => {
                    assert_eq!(w.take_shards(Split::Eval), None, "not eval's");
                    assert!(w.take_shards(Split::Train).is_some());
                    assert_eq!(w.take_shards(Split::Train), None, "taken once");
                }
                Step::Barrier(Barrier::FilesReady) => w.eval_decided(false),
                Step::Train { .. } => w.trained(Some("exit 3".into())),
                Step::Barrier(Barrier::TrainingComplete) => {
                    assert!(w.training_failures().is_empty(), "not released yet");
                    gathered = w.training_gather();
                    assert_eq!(w.training_gather(), None, "gathered once");
                    let release = IterationWalk::training_decide(vec![None, gathered.clone()]);
                    assert!(w.training_released(release));
                }
                Step::Handoff => panic!("a failed training hands nothing off"),
                _ => {}
            }
        }
        assert_eq!(gathered.map(|g| g.failed), Some("exit 3".to_string()));
        assert_eq!(w.training_failures(), &[(1, "exit 3".to_string())]);
        assert_eq!(w.phase(), Some(Phase::FinalSync));
        assert_eq!(IterationWalk::training_decide(vec![None, None]), None);
        let mut idle = IterationWalk::idle();
        assert_eq!(
            (idle.next_step(), idle.iteration(), idle.phase()),
            (None, 0, None)
        );
    }

    #[test]
    fn the_eval_decision_follows_the_split_and_the_interval() {
        assert!(eval_decision(RolloutSplit::EvalOnly, 2, 0));
        assert!(!eval_decision(RolloutSplit::TrainOnly, 1, 1));
        assert!(eval_decision(RolloutSplit::All, 7, 6));
        assert!(!eval_decision(RolloutSplit::All, 6, 6));
        assert_eq!(
            walk_item(RlPhase::Rollout, RolloutSplit::TrainOnly),
            "iteration-complete:rollout-train-only"
        );
    }
}
