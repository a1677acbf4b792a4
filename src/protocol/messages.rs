//! What each barrier gathers from every rank and what rank 0 broadcasts with its release.
//!
//! A payload travels as JSON inside a rank's live record (`Mark::payload`): the record is
//! one envelope for every barrier, so the payload's type is known only to the barrier
//! that reads it ([`super::barrier::Barrier`] is typed by its gather and broadcast). A
//! peer's record is untrusted input (DESIGN.md, section 3 rule 14): a payload that does
//! not decode is never an error, it reads as the type's empty value — no failure, no
//! eval, no model — the way a missing field read before payloads were typed. The JSON
//! shapes are those of protocol version 2; `Option<T>` payloads are `null` when absent.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// A barrier's gather or broadcast: how it is written into a record and read back.
pub trait Payload: Sized {
    fn write(&self) -> Value;
    /// A payload as read from a record (untrusted): never fails.
    fn read(v: &Value) -> Self;
}

/// A payload that is its serde JSON, read as its `Default` when it does not decode.
pub trait Plain: Serialize + DeserializeOwned + Default {}

impl<T: Plain> Payload for T {
    fn write(&self) -> Value {
        serde_json::to_value(self).expect("a payload is JSON")
    }

    fn read(v: &Value) -> T {
        T::deserialize(v).unwrap_or_default()
    }
}

/// The barriers that carry nothing: `null`.
impl Plain for () {}
/// `null` when absent; a value that does not decode as `T` reads as absent.
impl<T: Serialize + DeserializeOwned> Plain for Option<T> {}

/// The join (barrier 0): a rank's arrival, and rank 0's release, name the process that
/// holds the record, for a human reading it. No rank acts on it: a holder is judged by
/// the record's own `host`, `pid` and `nonce` (the worker nonces rank 0 keeps at the
/// release come from there too), and an arrival counts by its position alone, so a
/// payload that does not decode (`None`) changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Joined {
    pub host: String,
    pub pid: u32,
}

/// `files-ready`'s release: whether this iteration evaluates (rank 0 decides).
/// Unreadable: no eval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvalDecision {
    pub eval: bool,
}

impl Plain for EvalDecision {}

/// A rank's `training-complete` arrival when its training failed (`None`: it did not,
/// or the arrival does not decode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainFailed {
    pub failed: String,
}

/// A rank's `rollout-complete` or `eval-complete` arrival when there is something to say
/// about its shard (`None`: it committed its shard as `{output}`, or the arrival does not
/// decode). What it says comes from its journal, so a restart that reuses the rollout
/// says it again. Protocol 2's `{"note": …}` is this with only `note`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardArrival {
    /// Its command wrote the shard name itself and the rank adopted that file: the note
    /// its journal holds, which rank 0's merge records in the manifest without reading
    /// every rank's journal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Its command failed (`exit code 7`, `timed out after 4h`) and
    /// `phases.<phase>.on-failure = "merge-survivors"`: it committed no shard, and the
    /// merge goes on without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

impl ShardArrival {
    /// What a rank arrives with: nothing (`null`) when it has neither a note nor a failure.
    pub fn of(note: Option<String>, failed: Option<String>) -> Option<ShardArrival> {
        (note.is_some() || failed.is_some()).then_some(ShardArrival { note, failed })
    }
}

/// What rank 0 makes of the arrivals at `rollout-complete` or `eval-complete`: which
/// shards were adopted, and which ranks failed (with why) and are merged without.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shards {
    pub num_ranks: u32,
    pub adopted: BTreeMap<u32, String>,
    pub failed: BTreeMap<u32, String>,
}

impl Shards {
    /// The arrivals of ranks `0..`, in rank order.
    pub fn gathered(arrivals: Vec<Option<ShardArrival>>) -> Shards {
        let ranks: Vec<u32> = (0..arrivals.len() as u32).collect();
        Shards::gathered_from(&ranks, arrivals.len() as u32, arrivals)
    }

    /// The arrivals of a generation's members `ranks` (in their order) in a cluster of
    /// `num_ranks`: a dropped rank's shard is a stand-in's, committed under its number.
    pub fn gathered_from(
        ranks: &[u32],
        num_ranks: u32,
        arrivals: Vec<Option<ShardArrival>>,
    ) -> Shards {
        debug_assert_eq!(ranks.len(), arrivals.len(), "one arrival per member");
        let mut s = Shards {
            num_ranks,
            ..Shards::default()
        };
        for (&rank, a) in ranks.iter().zip(arrivals) {
            let Some(a) = a else { continue };
            if let Some(note) = a.note {
                s.adopted.insert(rank, note);
            }
            if let Some(failed) = a.failed {
                s.failed.insert(rank, failed);
            }
        }
        debug_assert!(s.failed.keys().all(|&r| r < s.num_ranks));
        s
    }

    /// The ranks whose shard is merged, in rank order.
    pub fn survivors(&self) -> Vec<u32> {
        (0..self.num_ranks)
            .filter(|r| !self.failed.contains_key(r))
            .collect()
    }

    /// Every rank's command failed: there is nothing to merge.
    pub fn none_survived(&self) -> bool {
        self.num_ranks > 0 && self.survivors().is_empty()
    }

    /// `rank 1 (exit code 7), rank 2 (timed out after 1s)`, with each rank's log as
    /// `log_of` names it.
    pub fn failures(&self, log_of: impl Fn(u32) -> String) -> String {
        let each = self
            .failed
            .iter()
            .map(|(r, why)| format!("rank {r} ({why}, log: {})", log_of(*r)));
        each.collect::<Vec<_>>().join("; ")
    }

    /// Rank 0's line about a merge without some ranks (`None`: none failed):
    /// `merged 2 of 3 ranks' train shards; rank 1's rollout failed (exit code 7), log: …`.
    pub fn summary(
        &self,
        split: &str,
        command: &str,
        log_of: impl Fn(u32) -> String,
    ) -> Option<String> {
        if self.failed.is_empty() {
            return None;
        }
        let each = self
            .failed
            .iter()
            .map(|(r, why)| format!("rank {r}'s {command} failed ({why}), log: {}", log_of(*r)));
        Some(format!(
            "merged {} of {} ranks' {split} shards; {}",
            self.survivors().len(),
            self.num_ranks,
            each.collect::<Vec<_>>().join("; ")
        ))
    }

    /// The note of rank 0's journal entry for the merge (`None`: none failed).
    pub fn journal_note(&self, command: &str) -> Option<String> {
        if self.failed.is_empty() {
            return None;
        }
        let each = self
            .failed
            .iter()
            .map(|(r, why)| format!("rank {r} ({why})"));
        Some(format!(
            "merged without the ranks whose {command} command failed: {}",
            each.collect::<Vec<_>>().join(", ")
        ))
    }
}

/// `training-complete`'s release when training failed somewhere (`None`: nowhere, or
/// the release does not decode): every rank then knows no model is handed off.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingFailures {
    /// An entry that does not decode is left out, the others kept.
    #[serde(deserialize_with = "each_readable")]
    pub failed: Vec<RankFailure>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankFailure {
    pub rank: u32,
    pub failed: String,
}

/// `handoff-complete`'s release: the model rank 0 handed off, relative to the shared
/// directory (each node resolves it on its own mount). `None`: unreadable, keep yours.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    pub model: String,
}

/// A rank's `final-sync` arrival: its numbers for `metrics.jsonl` (`N`, the metrics'
/// own type). `None`: it sent none, or they do not decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinalSync<N> {
    pub metrics: N,
}

/// `sync-start`'s release: rank 0's plan fingerprints, which a worker compares with its
/// own, and in a pipelined rollout cluster the model the iteration rolls out with (`M`).
#[derive(Debug, Clone, PartialEq)]
pub struct SyncStart<M> {
    pub plans: Plans,
    /// A model that does not decode reads as none, leaving the plans readable.
    pub pipeline: Option<M>,
    /// Elastic mode: the generation the members go to before this iteration starts, formed
    /// for ranks that came back.
    pub grown: Option<u64>,
}

impl<M> Default for SyncStart<M> {
    fn default() -> Self {
        SyncStart {
            plans: Plans::Unsent,
            pipeline: None,
            grown: None,
        }
    }
}

/// Rank 0's plan fingerprints as a worker received them.
#[derive(Debug, Clone, PartialEq)]
pub enum Plans {
    /// A `null` release: nothing to compare.
    Unsent,
    Sent(PlanFingerprints),
    /// Not fingerprints: kept as read, to be shown as differing from this rank's.
    Unreadable(Value),
}

impl Plans {
    /// The fingerprints as JSON, for the message of a worker whose own plan differs.
    pub fn to_json(&self) -> Value {
        match self {
            Plans::Unsent => Value::Null,
            Plans::Sent(p) => serde_json::to_value(p).expect("fingerprints are JSON"),
            Plans::Unreadable(v) => v.clone(),
        }
    }
}

/// The plans of both splits and the task files' content (two files with the same ids
/// plan alike but differ); `None` where the split has no tasks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PlanFingerprints {
    pub train: Option<String>,
    pub eval: Option<String>,
    pub train_tasks: Option<String>,
    pub eval_tasks: Option<String>,
}

impl<M: Serialize + DeserializeOwned> Payload for SyncStart<M> {
    fn write(&self) -> Value {
        #[derive(Serialize)]
        struct Wire<'a, M> {
            #[serde(flatten)]
            plans: &'a PlanFingerprints,
            #[serde(skip_serializing_if = "Option::is_none")]
            pipeline: &'a Option<M>,
            #[serde(skip_serializing_if = "Option::is_none")]
            grown: Option<u64>,
        }
        match &self.plans {
            Plans::Sent(plans) => serde_json::to_value(Wire {
                plans,
                pipeline: &self.pipeline,
                grown: self.grown,
            })
            .expect("sync-start is JSON"),
            other => other.to_json(),
        }
    }

    fn read(v: &Value) -> Self {
        #[derive(Deserialize)]
        struct Pipeline<M> {
            pipeline: Option<M>,
        }
        #[derive(Deserialize)]
        struct Grown {
            grown: Option<u64>,
        }
        // The fingerprints are what remains without the model, and only if they are
        // exactly what a rank writes: a missing or extra key is no plan a worker may
        // agree with (it differs from every rank's, which names all four).
        let mut rest = v.clone();
        if let Some(o) = rest.as_object_mut() {
            o.remove("pipeline");
            o.remove("grown");
        }
        let plans = match PlanFingerprints::deserialize(&rest) {
            _ if v.is_null() => Plans::Unsent,
            Ok(p) if serde_json::to_value(&p).is_ok_and(|w| w == rest) => Plans::Sent(p),
            _ => Plans::Unreadable(rest),
        };
        let pipeline = Pipeline::deserialize(v).ok().and_then(|p| p.pipeline);
        let grown = Grown::deserialize(v).ok().and_then(|g| g.grown);
        SyncStart {
            plans,
            pipeline,
            grown,
        }
    }
}

/// A list whose entries are read one by one: an entry that does not decode is dropped.
fn each_readable<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let raw = Vec::<Value>::deserialize(d)?;
    Ok(raw.iter().filter_map(|v| T::deserialize(v).ok()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_json_shapes_of_protocol_2_are_kept() {
        assert_eq!(().write(), Value::Null);
        assert_eq!(EvalDecision { eval: true }.write(), json!({"eval": true}));
        let joined = Joined {
            host: "node-a".into(),
            pid: 4711,
        };
        assert_eq!(
            Some(joined.clone()).write(),
            json!({"host": "node-a", "pid": 4711})
        );
        assert_eq!(
            Option::<Joined>::read(&json!({"host": "node-a", "pid": 4711})),
            Some(joined)
        );
        assert_eq!(None::<TrainFailed>.write(), Value::Null);
        assert_eq!(
            Some(TrainFailed { failed: "x".into() }).write(),
            json!({"failed": "x"})
        );
        let failures = TrainingFailures {
            failed: vec![RankFailure {
                rank: 2,
                failed: "exit 1".into(),
            }],
        };
        assert_eq!(
            Some(failures).write(),
            json!({"failed": [{"rank": 2, "failed": "exit 1"}]})
        );
        assert_eq!(
            Some(Handoff {
                model: "models/iter-0001".into()
            })
            .write(),
            json!({"model": "models/iter-0001"})
        );
        assert_eq!(
            Some(FinalSync {
                metrics: json!({"wait_s": 1.0})
            })
            .write(),
            json!({"metrics": {"wait_s": 1.0}})
        );
        let plans = PlanFingerprints {
            train: Some("p".into()),
            train_tasks: Some("t".into()),
            ..Default::default()
        };
        let bare = json!({"train": "p", "eval": null, "train-tasks": "t", "eval-tasks": null});
        let s = SyncStart::<u64> {
            plans: Plans::Sent(plans.clone()),
            pipeline: None,
            grown: None,
        };
        assert_eq!(s.write(), bare);
        assert_eq!(SyncStart::<u64>::read(&bare), s);
        let mut with_model = bare.clone();
        with_model["pipeline"] = json!(7);
        let s = SyncStart {
            pipeline: Some(7),
            ..s
        };
        assert_eq!(s.write(), with_model);
        assert_eq!(SyncStart::read(&with_model), s);
        // Elastic mode: the generation the members go to; the plans stay readable.
        let mut grown = with_model.clone();
        grown["grown"] = json!(4);
        let s = SyncStart {
            grown: Some(4),
            ..s
        };
        assert_eq!(s.write(), grown);
        assert_eq!(SyncStart::read(&grown), s);
    }

    /// A peer's payload is untrusted: what does not decode reads as what a missing
    /// field read as before (no eval, no failure, no model), never an error.
    #[test]
    fn an_unreadable_payload_reads_as_empty() {
        for odd in [json!({"eval": "yes"}), json!({}), json!(3), Value::Null] {
            assert_eq!(EvalDecision::read(&odd), EvalDecision { eval: false });
        }
        assert_eq!(Option::<TrainFailed>::read(&json!({"failed": 5})), None);
        assert_eq!(Option::<Handoff>::read(&json!({"model": ["a"]})), None);
        for odd in [
            json!({"pid": 5}),
            json!({"host": "h", "pid": -1}),
            json!("h"),
        ] {
            assert_eq!(Option::<Joined>::read(&odd), None);
        }
        assert_eq!(
            Option::<TrainingFailures>::read(&json!({"failed": 5})),
            None
        );
        // One odd entry of the failure list is dropped, not the list.
        let list = json!({"failed": [{"rank": 1, "failed": "x"}, {"rank": "two"}, 7]});
        assert_eq!(
            Option::<TrainingFailures>::read(&list).unwrap().failed,
            [RankFailure {
                rank: 1,
                failed: "x".into()
            }]
        );
        assert_eq!(
            Option::<FinalSync<EvalDecision>>::read(&json!({"metrics": 1})),
            None
        );
    }

    /// A shard arrival writes protocol 2's shapes when it has no failure (`null`, or the
    /// adopted note alone), and rank 0 reads who failed and what survives from the
    /// arrivals alone; an arrival that does not decode says nothing.
    #[test]
    fn shard_arrivals_say_who_failed_and_what_survives() {
        assert_eq!(ShardArrival::of(None, None).write(), Value::Null);
        let adopted = ShardArrival::of(Some("adopted: x".into()), None);
        assert_eq!(adopted.write(), json!({"note": "adopted: x"}));
        let failed = ShardArrival::of(None, Some("exit code 7".into()));
        assert_eq!(failed.write(), json!({"failed": "exit code 7"}));
        assert_eq!(Option::<ShardArrival>::read(&failed.write()), failed);
        assert_eq!(Option::<ShardArrival>::read(&json!({"failed": 7})), None);

        let s = Shards::gathered(vec![None, failed.clone(), adopted.clone()]);
        assert_eq!(s.survivors(), [0, 2]);
        assert!(!s.none_survived());
        assert_eq!(s.adopted, BTreeMap::from([(2, "adopted: x".to_string())]));
        assert_eq!(
            s.summary("train", "rollout", |r| format!("rank-{r}.log")).unwrap(),
            "merged 2 of 3 ranks' train shards; rank 1's rollout failed (exit code 7), log: rank-1.log"
        );
        assert_eq!(
            s.journal_note("rollout").unwrap(),
            "merged without the ranks whose rollout command failed: rank 1 (exit code 7)"
        );
        let all = Shards::gathered(vec![failed.clone(), failed.clone()]);
        assert!(all.none_survived());
        assert_eq!(
            all.failures(|r| format!("l{r}")),
            "rank 0 (exit code 7, log: l0); rank 1 (exit code 7, log: l1)"
        );
        let none = Shards::gathered(vec![None, adopted]);
        assert_eq!(none.survivors(), [0, 1]);
        assert_eq!(none.summary("train", "rollout", |_| String::new()), None);
        assert_eq!(none.journal_note("rollout"), None);
        assert!(!Shards::gathered(vec![]).none_survived());
    }

    #[test]
    fn sync_start_keeps_unreadable_plans_apart_from_absent_ones() {
        assert_eq!(SyncStart::<u64>::read(&Value::Null).plans, Plans::Unsent);
        let s = SyncStart::<u64>::read(&json!({"train": 5, "pipeline": 3}));
        assert_eq!(s.plans, Plans::Unreadable(json!({"train": 5})));
        assert_eq!(
            s.plans.to_json(),
            json!({"train": 5}),
            "shown without the model"
        );
        assert_eq!(s.pipeline, Some(3));
        // Only the exact shape a rank writes is a plan: a key missing (all of them, or
        // all but the model) or one more is not, whatever the keys that are there say.
        let all = json!({"train": "p", "eval": null, "train-tasks": null, "eval-tasks": null});
        for odd in [
            json!({}),
            json!({"pipeline": 3}),
            json!({"train": "p"}),
            json!({"train": "p", "eval": null, "train-tasks": null, "eval-tasks": null, "x": 1}),
        ] {
            let s = SyncStart::<u64>::read(&odd);
            assert!(
                matches!(s.plans, Plans::Unreadable(_)),
                "{odd}: {:?}",
                s.plans
            );
        }
        // An unreadable model leaves the plans readable.
        let mut with_model = all.clone();
        with_model["pipeline"] = json!("x");
        let s = SyncStart::<u64>::read(&with_model);
        assert_eq!(s.pipeline, None);
        assert!(matches!(s.plans, Plans::Sent(p) if p.train.as_deref() == Some("p")));
        assert_eq!(SyncStart::<u64>::read(&all).plans.to_json(), all);
    }
}
