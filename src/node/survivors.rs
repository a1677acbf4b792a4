//! `phases.rollout.on-failure = "merge-survivors"` (and eval's), on the node: a rank whose
//! rollout command fails says so, journals the rollout as done with its failure and
//! commits no shard; rank 0 merges the other ranks' shards, and stops the cluster when no
//! rank's command succeeded. Who failed and what is merged is decided from the barrier's
//! arrivals by [`msg::Shards`]; this is only what the node does about it. With the default,
//! `stop`, none of it runs: a failed command stops the cluster as any other does.

use super::{CommandFailure, Node, Stop};
use crate::config::{OnRolloutFailure, PhaseCommand, RolloutCommand};
use crate::events;
use crate::protocol::messages as msg;
use crate::protocol::AbortKind;
use std::path::Path;

impl Node {
    /// The command of `split`'s rollout: `rollout` for train, `eval` for eval.
    pub(super) fn rollout_of(&self, split: &str) -> (&'static str, &RolloutCommand) {
        match split {
            "eval" => ("eval", &self.cfg.phases.eval),
            _ => ("rollout", &self.cfg.phases.rollout),
        }
    }

    /// This rank's rollout command of `split` failed: under `stop` that stops the cluster
    /// (the error to return); under `merge-survivors` it is logged with the usual failure
    /// message, recorded as an event and kept for the rollout's journal entry, and the
    /// rank goes on to the barrier with no shard.
    pub(super) fn rollout_failed(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        failure: &CommandFailure,
        log: &Path,
    ) -> Result<(), Stop> {
        match self.rollout_of(split).1.policy() {
            OnRolloutFailure::Stop => return Err(self.command_failed(phase, pc, failure, log)),
            OnRolloutFailure::DropNode => return Err(self.drop_this_node(phase, pc, failure, log)),
            OnRolloutFailure::MergeSurvivors => {}
        }
        let partial =
            self.layout
                .shard_partial_gen(self.machine.iteration(), split, self.rank, self.gen());
        let goes_on = format!(
            "phases.{phase}.on-failure = \"merge-survivors\": the cluster goes on; this rank commits no {split} shard and rank 0 merges iteration {}'s other shards without it (what the command wrote stays in {}, never merged)",
            self.machine.iteration(),
            partial.display()
        );
        let reason = self.warn_survived(phase, pc, failure, log, &goes_on);
        self.event(events::Event::RolloutFailed {
            split: split.to_string(),
            failed: failure.short(),
            reason,
            log: log.display().to_string(),
        });
        self.machine.journal_mut().failed(failure.short());
        Ok(())
    }

    /// `phases.<phase>.on-failure = "drop-node"` (elastic mode): this node's command
    /// failed, so it is dropped: its abort says so, the others regroup without it (a
    /// stand-in runs its rollout), and this node stops with the failure.
    fn drop_this_node(
        &mut self,
        phase: &str,
        pc: &PhaseCommand,
        failure: &CommandFailure,
        log: &Path,
    ) -> Stop {
        let reason = failure.reason(phase, pc);
        let mut info = self.abort_info(failure.abort_kind(), self.rank, None, reason, Some(log));
        info.dropped = true;
        let mut stop = self.publish_abort(info);
        stop.message = format!(
            "{}; this node is dropped (phases.{phase}.on-failure = \"drop-node\"): the others go on without it",
            stop.message
        );
        stop
    }

    /// Rank 0, when every rank's rollout command of `split` failed: nothing to merge
    /// (or train on), so the cluster stops.
    pub(super) fn no_survivors(&mut self, split: &str, shards: &msg::Shards) -> Stop {
        let (phase, _) = self.rollout_of(split);
        let it = self.machine.iteration();
        let failures =
            shards.failures(|r| self.layout.phase_log(it, r, phase).display().to_string());
        let reason = format!(
            "no rank's {split} rollout succeeded (phases.{phase}.on-failure = \"merge-survivors\"): {failures}; there is nothing to merge{}",
            if split == "train" { " or train on" } else { "" }
        );
        self.fail(AbortKind::Error, self.rank, None, reason, None)
    }

    /// Rank 0, before its merge of `split`: the ranks to leave out, each with the reason
    /// its manifest entry gives (the failure and the rank's log, relative to the shared
    /// directory like every path of a manifest).
    pub(super) fn failed_for_merge(
        &self,
        shards: &msg::Shards,
        split: &str,
    ) -> std::collections::BTreeMap<u32, String> {
        let (phase, _) = self.rollout_of(split);
        let it = self.machine.iteration();
        shards
            .failed
            .iter()
            .map(|(&r, why)| {
                let log = self.layout.relative(&self.layout.phase_log(it, r, phase));
                (
                    r,
                    format!("the {phase} command failed with {why}; log {log}"),
                )
            })
            .collect()
    }

    /// Rank 0, after a merge of `split` without some ranks: say so, record the event, and
    /// name them in the merge's journal entry.
    pub(super) fn survivors_merged(&mut self, shards: &msg::Shards, split: &str) {
        let (phase, _) = self.rollout_of(split);
        let it = self.machine.iteration();
        let log_of = |r| self.layout.phase_log(it, r, phase).display().to_string();
        let Some(summary) = shards.summary(split, phase, log_of) else {
            return;
        };
        self.warn(&format!("iteration {it}: {summary}"));
        self.event(events::Event::SurvivorsMerged {
            split: split.to_string(),
            merged: shards.survivors().len() as u32,
            ranks: shards.num_ranks,
            failed: shards
                .failed
                .iter()
                .map(|(&rank, why)| events::RankFailure {
                    rank,
                    failed: why.clone(),
                })
                .collect(),
        });
        if let Some(note) = shards.journal_note(phase) {
            self.machine.journal_mut().note(note);
        }
    }
}
