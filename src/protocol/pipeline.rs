//! The hand-over between the two clusters of a pipelined run (docs/pipeline.md), as pure
//! functions over their queue records.
//!
//! Each cluster's rank 0 keeps one record in `.rl-node/pipeline/<cluster>.json`, a commit
//! that only moves forward: the rollout cluster's says up to which iteration the train
//! trajectories are committed, the update cluster's up to which iteration training is
//! complete (its model published, or kept when training failed). Both are rewritten from
//! the journals at every start, so a crash between a journal line and the record costs
//! nothing. The rules:
//!
//! - the rollout cluster starts iteration `i` on the model of iteration
//!   `i - 1 - staleness` (the base model before the first iteration), once the update
//!   cluster has completed that iteration; so it is never more than `staleness`
//!   iterations ahead of the newest model;
//! - the update cluster trains iteration `i` once its trajectories are committed.
//!
//! The fence check before a record's rename is not atomic with it: a rank 0 frozen in
//! between (a paused VM) can wake after a newer generation moved the record on and
//! rename its older one over it. Nothing but the rename is atomic on a shared
//! directory, so the record carries its writer's run, generation and sequence number,
//! and neither readers nor writers let it move back: a reader keeps the newest record
//! it saw ([`newest`]), and a writer that finds a newer generation's record stops as
//! fenced instead of replacing it.

use serde::{Deserialize, Serialize};

/// One cluster's hand-over record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRecord {
    /// `rollout` or `update`.
    pub cluster: String,
    /// `Config::pipeline_fingerprint`: both clusters must run the same configuration.
    pub fingerprint: String,
    pub staleness: u64,
    /// Rollout: the newest iteration whose train trajectories are committed. Update: the
    /// newest iteration whose training is complete. 0: none yet.
    pub done: u64,
    /// Rollout: the model version each recent iteration was rolled out with (iteration,
    /// version; 0 = the base model), for `status`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<(u64, u64)>,
    /// The iteration the cluster is working on (0: none), for `status`.
    #[serde(default)]
    pub current: u64,
    /// The cluster's last iteration (`cluster.iterations`; 0 = unbounded).
    #[serde(default)]
    pub last: u64,
    /// Wall-clock time of the write, for people only.
    #[serde(default)]
    pub at: String,
    /// The writer's run id, generation and sequence number within that generation (from
    /// 1): within one run, the record with the greater (generation, sequence number) is
    /// the newer one, whatever order the renames reached the server in. Empty and 0 in
    /// a record of an earlier version of rl-node (not ordered against the others).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run: String,
    #[serde(default)]
    pub gen: u64,
    #[serde(default)]
    pub seq: u64,
}

impl QueueRecord {
    /// Whether this record was written before `other` by the same run (a late rename of
    /// a replaced generation's, or one a reader already saw superseded). Records of
    /// different runs are not ordered: a new run (`--fresh`) starts over.
    pub fn older_than(&self, other: &QueueRecord) -> bool {
        self.run == other.run && (self.gen, self.seq) < (other.gen, other.seq)
    }
}

/// What a reader acts on, given the newest record it saw before (`seen`) and the one it
/// just `read`: the read one, unless it is older (a late rename of a replaced generation
/// moved the file back; the newer one stays true, `done` only grows).
pub fn newest(seen: Option<QueueRecord>, read: QueueRecord) -> QueueRecord {
    match seen {
        Some(seen) if read.older_than(&seen) => seen,
        _ => read,
    }
}

/// Which model an iteration is rolled out with, as the rollout cluster's rank 0 releases
/// it at `sync-start` and records it (`rollouts/iter-NNNN/model.json`) before any rollout
/// starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutModel {
    pub iteration: u64,
    /// The iteration whose training produced the model; 0: the base model.
    pub model_version: u64,
    pub staleness: u64,
    /// The model: a checkpoint rl-node published relative to the shared directory
    /// (`models/iter-0001`; each node resolves it on its own mount, see `node::model`),
    /// else `cluster.model`. Records of earlier versions hold an absolute path.
    pub model: String,
    /// `exact` or `newest` (`pipeline.model`).
    pub rule: String,
}

/// Which model (`pipeline.model`) iteration `iteration` may be rolled out with, given the
/// update cluster's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutGate {
    /// Go, with the model of this iteration (0: the base model, `cluster.model`).
    Go { version: u64 },
    /// The update cluster must first complete iteration `needs`.
    Wait { needs: u64 },
}

/// The model version the exact rule gives iteration `iteration` (0: the base model).
pub fn exact_version(iteration: u64, staleness: u64, first_iteration: u64) -> u64 {
    match iteration.checked_sub(1 + staleness) {
        Some(v) if v >= first_iteration => v,
        _ => 0,
    }
}

/// Whether the rollout cluster may start `iteration`, and on which model. `trained` is
/// the update cluster's `done`; `newest` is `pipeline.model = "newest"`.
pub fn rollout_gate(
    iteration: u64,
    staleness: u64,
    first_iteration: u64,
    trained: u64,
    newest: bool,
) -> RolloutGate {
    let exact = exact_version(iteration, staleness, first_iteration);
    if exact > trained {
        return RolloutGate::Wait { needs: exact };
    }
    // Never a model trained on trajectories of this iteration or later (there are none:
    // training of i needs i's trajectories), never older than the exact one.
    let newest_done = trained.min(iteration.saturating_sub(1));
    let version = if newest && newest_done >= first_iteration {
        newest_done.max(exact)
    } else {
        exact
    };
    RolloutGate::Go { version }
}

/// A deliberately broken rollout gate, for the simulator's own tests (never set by the
/// node): shows that the simulator catches a rollout cluster that runs ahead.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// The gate counts one iteration more trained than the update cluster's record says.
    OneAhead,
}

/// [`rollout_gate`], broken on purpose when `mutation` is set.
#[doc(hidden)]
pub fn rollout_gate_with(
    iteration: u64,
    staleness: u64,
    first_iteration: u64,
    trained: u64,
    newest: bool,
    mutation: Option<Mutation>,
) -> RolloutGate {
    let mutation = super::mutation(mutation);
    let trained = match mutation {
        Some(Mutation::OneAhead) => trained + 1,
        None => trained,
    };
    rollout_gate(iteration, staleness, first_iteration, trained, newest)
}

/// Whether the update cluster may train `iteration`, given the rollout cluster's `done`.
pub fn update_ready(iteration: u64, rolled_out: u64) -> bool {
    rolled_out >= iteration
}

/// How many model versions behind its iteration a rollout ran (`i - 1 - version`, the
/// base model counting as version `first_iteration - 1`).
pub fn staleness_of(iteration: u64, version: u64, first_iteration: u64) -> u64 {
    let v = if version == 0 {
        first_iteration.saturating_sub(1)
    } else {
        version
    };
    iteration.saturating_sub(1).saturating_sub(v)
}

/// The newest iteration `done` up to which a cluster's journal shows `item` for every
/// iteration from `first` on (the journal's iterations, any order).
pub fn done_through(first: u64, iterations: impl IntoIterator<Item = u64>) -> u64 {
    let mut seen: Vec<u64> = iterations.into_iter().filter(|&i| i >= first).collect();
    seen.sort_unstable();
    seen.dedup();
    let mut done = first.saturating_sub(1);
    for i in seen {
        if i == done + 1 {
            done = i;
        } else if i > done + 1 {
            break;
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(gen: u64, seq: u64, done: u64) -> QueueRecord {
        QueueRecord {
            cluster: "update".into(),
            fingerprint: "f".into(),
            staleness: 1,
            done,
            versions: vec![],
            current: 0,
            last: 5,
            at: String::new(),
            run: "r".into(),
            gen,
            seq,
        }
    }

    /// A late rename of a replaced generation's record (a rank 0 frozen between its fence
    /// check and its rename) does not move a reader back; a newer one moves it on.
    #[test]
    fn a_reader_keeps_the_newest_record() {
        let seen = record(2, 3, 4);
        assert_eq!(newest(Some(seen.clone()), record(1, 9, 2)), seen);
        assert_eq!(newest(Some(seen.clone()), record(2, 2, 3)), seen);
        assert_eq!(newest(Some(seen.clone()), record(2, 4, 4)), record(2, 4, 4));
        assert_eq!(newest(Some(seen), record(3, 1, 4)), record(3, 1, 4));
        assert_eq!(newest(None, record(1, 1, 0)), record(1, 1, 0));
        // Another run (`--fresh`) starts over.
        let fresh = QueueRecord {
            run: "s".into(),
            ..record(1, 1, 0)
        };
        assert_eq!(newest(Some(record(2, 3, 4)), fresh.clone()), fresh);
    }

    #[test]
    fn staleness_1_rolls_out_i_plus_1_on_the_model_of_i_minus_1() {
        // Iterations 1 and 2 start on the base model; 3 needs the model of 1.
        assert_eq!(
            rollout_gate(1, 1, 1, 0, false),
            RolloutGate::Go { version: 0 }
        );
        assert_eq!(
            rollout_gate(2, 1, 1, 0, false),
            RolloutGate::Go { version: 0 }
        );
        assert_eq!(
            rollout_gate(3, 1, 1, 0, false),
            RolloutGate::Wait { needs: 1 }
        );
        assert_eq!(
            rollout_gate(3, 1, 1, 1, false),
            RolloutGate::Go { version: 1 }
        );
        // Staleness 0 alternates: i needs i-1.
        assert_eq!(
            rollout_gate(2, 0, 1, 0, false),
            RolloutGate::Wait { needs: 1 }
        );
        assert_eq!(
            rollout_gate(2, 0, 1, 1, false),
            RolloutGate::Go { version: 1 }
        );
        // A run that starts at iteration 5 (earlier ones ran before rl-node).
        assert_eq!(
            rollout_gate(6, 1, 5, 0, false),
            RolloutGate::Go { version: 0 }
        );
        assert_eq!(
            rollout_gate(7, 1, 5, 4, false),
            RolloutGate::Wait { needs: 5 }
        );
    }

    #[test]
    fn newest_takes_a_newer_model_when_one_is_done_never_an_older_one() {
        assert_eq!(
            rollout_gate(4, 2, 1, 3, true),
            RolloutGate::Go { version: 3 }
        );
        assert_eq!(
            rollout_gate(4, 2, 1, 3, false),
            RolloutGate::Go { version: 1 }
        );
        assert_eq!(
            rollout_gate(2, 2, 1, 0, true),
            RolloutGate::Go { version: 0 }
        );
        assert_eq!(
            rollout_gate(5, 2, 1, 1, true),
            RolloutGate::Wait { needs: 2 }
        );
    }

    #[test]
    fn done_through_stops_at_the_first_gap() {
        assert_eq!(done_through(1, []), 0);
        assert_eq!(done_through(1, [1, 2, 2, 4]), 2);
        assert_eq!(done_through(5, [5, 6, 3]), 6);
        assert_eq!(done_through(5, [6]), 4);
    }

    proptest! {
        /// The two gates together never let the rollout cluster get more than `staleness`
        /// iterations ahead of the newest model, never train an iteration before its
        /// trajectories, and always let one of the two clusters go (no deadlock), for any
        /// interleaving of the two clusters' steps.
        #[test]
        fn any_interleaving_keeps_the_bound_and_never_deadlocks(
            staleness in 0u64..4,
            first in 1u64..4,
            newest: bool,
            order in proptest::collection::vec(any::<bool>(), 1..80),
        ) {
            let last = first + 12;
            let (mut rolled, mut trained) = (first - 1, first - 1);
            for pick_rollout in order {
                let next_r = rolled + 1;
                let r_go = next_r <= last
                    && matches!(rollout_gate(next_r, staleness, first, trained, newest), RolloutGate::Go { .. });
                let u_go = trained < last && update_ready(trained + 1, rolled);
                prop_assert!(r_go || u_go || (rolled == last && trained == last));
                if r_go && (pick_rollout || !u_go) {
                    if let RolloutGate::Go { version } = rollout_gate(next_r, staleness, first, trained, newest) {
                        prop_assert!(version <= trained || version == 0);
                        prop_assert!(version < next_r);
                        let lag = staleness_of(next_r, version, first);
                        prop_assert!(lag <= staleness, "iteration {} on version {} lags {}", next_r, version, lag);
                    }
                    rolled = next_r;
                } else if u_go {
                    trained += 1;
                    prop_assert!(trained <= rolled);
                }
                // Never more than staleness + 1 iterations rolled out beyond the newest model.
                prop_assert!(rolled <= trained + staleness + 1);
            }
        }
    }
}
