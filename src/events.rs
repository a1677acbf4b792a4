//! The event log: one JSON object per line in `.rl-node/events/rank-R.jsonl`, appended by
//! rank R alone (`Node::event`). It is for people, the demo and tests, not the protocol:
//! nothing in a run decides anything from it.
//!
//! Every kind of event is a variant of [`Event`]; [`EventRecord`] adds what every line
//! carries (generation, iteration, rank, wall-clock time). A line is the record's fields
//! and the event's side by side, with the kind under `"event"`:
//!
//! ```text
//! {"event":"barrier","gen":1,"iteration":1,"k":1,"name":"sync-start","rank":0,"t":"…","waited_ms":1}
//! ```
//!
//! This module is plain data: it imports no runtime, only the phase names of the core.

use crate::protocol::Phase;
use serde::{Deserialize, Serialize};

/// One line of the event log: an [`Event`] and where and when it happened.
///
/// The event's fields come first in declaration order (`flatten`) so that the order of a
/// line's keys does not depend on how `serde_json` orders maps: see [`EventRecord::to_line`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    #[serde(flatten)]
    pub event: Event,
    /// The generation of the rank that wrote the line.
    pub gen: u64,
    /// The iteration it was in (0 before the first).
    pub iteration: u64,
    /// The rank that wrote the line.
    pub rank: u32,
    /// Wall clock, RFC 3339 with milliseconds (`protocol::wall_stamp`).
    pub t: String,
}

impl EventRecord {
    /// The line as written, newline included. The record goes through a
    /// `serde_json::Value` on its way to text, as the ad-hoc `json!` objects it replaced
    /// did, so its keys come out in the same order as theirs: the order of
    /// `serde_json::Map` (sorted by name with serde_json's default features; declaration
    /// order, which is the order the old objects were built in, with `preserve_order`).
    pub fn to_line(&self) -> String {
        let value = serde_json::to_value(self).expect("an event is plain data");
        format!("{value}\n")
    }

    /// Parse one line; `None` for a line that is not an event this build knows (a torn
    /// last line, another version's event, anything else).
    pub fn parse(line: &str) -> Option<EventRecord> {
        serde_json::from_str(line).ok()
    }
}

/// What happened. The tag is the line's `"event"` key; each variant's fields are the
/// line's other keys, under the names given here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Event {
    /// Rank 0 started a generation; `previous` describes the one it replaced, if any.
    Generation { previous: Option<String> },
    /// Rank 0 read why a worker was refused its rank at join (the text names the rank).
    Refused { why: String },
    /// The rank entered a phase; `n` is its number in the walk (0 to 13).
    Phase { phase: Phase, n: u8 },
    /// The rank passed barrier `name`, the `k`-th of its generation, after waiting.
    Barrier {
        name: String,
        k: u64,
        waited_ms: u64,
    },
    /// A phase command ended (`phase` is the command's: rollout, eval, prepare, train…);
    /// `exit` as a person reads it (`exit code 0`).
    Command {
        phase: String,
        exit: String,
        secs: f64,
    },
    /// The rank committed its shard of `split` (`adopted`: the command wrote it in place).
    Commit {
        split: String,
        path: String,
        adopted: bool,
    },
    /// Rank 0 merged a split.
    Aggregate {
        split: String,
        #[serde(flatten)]
        merged: Aggregated,
    },
    /// A journaled item was done before a restart and is reused, not redone.
    Reused { item: String },
    /// The rank journaled an item.
    Journal { item: String },
    /// Training failed on this rank and `phases.train.on-failure = "keep-model"`.
    TrainFailed {
        failed: String,
        reason: String,
        log: String,
    },
    /// This rank's rollout (or eval) command failed and
    /// `phases.<phase>.on-failure = "merge-survivors"`: it commits no shard of `split`.
    RolloutFailed {
        split: String,
        failed: String,
        reason: String,
        log: String,
    },
    /// Rank 0 merged `split` without the ranks whose command failed: `merged` of `ranks`
    /// ranks' shards.
    SurvivorsMerged {
        split: String,
        merged: u32,
        ranks: u32,
        failed: Vec<RankFailure>,
    },
    /// Rank 0 handed off no checkpoint because training failed somewhere.
    HandoffSkipped {
        failed: Vec<RankFailure>,
        model: String,
        summary: String,
    },
    /// Rank 0 published `model`, a checkpoint of `source`, in `secs`: by `transfer`
    /// (`move`, `copy`, `resume`: a checkpoint an interrupted hand-off had moved, `kept`:
    /// published already), leaving out `excluded` files.
    Handoff {
        model: String,
        source: String,
        transfer: String,
        excluded: usize,
        secs: f64,
    },
    /// Elastic mode: the generation's member `lost` was lost (`reason`: why it was
    /// counted lost); the members left regroup without it.
    MemberLost { lost: u32, reason: String },
    /// Elastic mode: this rank joined the line's generation, of `members` (ranks) and
    /// coordinated by `coordinator`, formed after a loss.
    Regrouped { members: Vec<u32>, coordinator: u32 },
    /// Elastic mode: this rank ran dropped rank `dropped`'s `split` rollout in its place.
    StoodIn { dropped: u32, split: String },
    /// Pipelined mode: rank 0 waited `secs` for the other cluster (`what`).
    PipelineWait { what: String, secs: f64 },
    /// Pipelined mode: the model this iteration is rolled out with.
    RolloutModel {
        model: String,
        model_version: u64,
        staleness: u64,
    },
    /// Rank 0 deleted these checkpoints (`phases.handoff.keep-last`).
    CheckpointsDeleted { names: Vec<String> },
    /// `models/LATEST` could not be used and the node fell back to an older model.
    LatestFallback { warning: String },
    /// The rank's generation was replaced while it was about to do `what`.
    Fenced { what: String, why: String },
    /// The inference server answered its health check.
    ServerStart {
        model: String,
        secs: f64,
        attempt: u32,
    },
    /// A start of the inference server failed (`retry`: another attempt follows).
    ServerStartFailed {
        attempt: u32,
        attempts: u32,
        reason: String,
        retry: bool,
    },
    /// The inference server was stopped.
    ServerStop { secs: f64 },
    /// A work item exited with a retryable code; `attempt` is the retry's (1 = first
    /// retry).
    Retry {
        item: String,
        task: String,
        attempt: u32,
        exit: i32,
        delay_ms: u64,
    },
    /// A work item failed for good.
    ItemFailed {
        item: String,
        task: String,
        exit: String,
    },
    /// The tally of this rank's items of a split.
    Items {
        split: String,
        total: usize,
        committed: usize,
        failed: usize,
        #[serde(flatten)]
        mode: ItemsMode,
    },
    /// The rank started a backup attempt of `item`, held by the slower rank `holder`.
    Backup { item: String, holder: u32 },
    /// The rank wrote a hang report (docs/forensics.md): `path` relative to the log path
    /// (`logs/iter-0003/rank-1.hang-1.txt`), `why` the overrunning wait or silent peer.
    HangReport { path: String, why: String },
}

/// What an `aggregate` event reports: the two merges write different keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Aggregated {
    /// Rank shards merged into one file (`records` merged, `bytes` written).
    Shards { records: u64, bytes: u64 },
    /// A dynamic rollout's committed items concatenated; `missing` had no output.
    Items { items: usize, missing: usize },
}

/// The keys an `items` event has beyond the counts, by how the items were handed out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ItemsMode {
    /// A static plan: the retries of this rank's items, and with `work.exact-budget` its
    /// groups (a task's samples, kept or dropped whole).
    Static {
        retries: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        groups: Option<Groups>,
    },
    /// A dynamic pool (`work.mode = "dynamic"`): the backup attempts this rank started.
    /// `dynamic` is always `true`; it is in the line to say which tally this is.
    Dynamic { backups: usize, dynamic: bool },
}

/// `exact-budget`'s count of one rank's groups in an `items` event: `planned` groups of
/// the plan, `complete` ones in the shard (all their samples committed), `dropped` ones
/// (a sample failed for good; their committed samples set aside) and `replacements` drawn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Groups {
    pub planned: usize,
    pub complete: usize,
    pub dropped: usize,
    pub replacements: usize,
}

/// One rank's failure (of its training in a `handoff-skipped` event, of its rollout in a
/// `survivors-merged` one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankFailure {
    pub rank: u32,
    pub failed: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// The exact-budget groups of the `items` examples: one dropped and replaced.
    const GROUPS: Groups = Groups {
        planned: 3,
        complete: 3,
        dropped: 1,
        replacements: 1,
    };

    fn record(event: Event) -> EventRecord {
        EventRecord {
            event,
            gen: 3,
            iteration: 2,
            rank: 1,
            t: "2026-01-02T03:04:05.678+00:00".into(),
        }
    }

    /// One of each variant (and of each shape of the two that have two).
    fn every_kind() -> Vec<Event> {
        vec![
            Event::Generation { previous: None },
            Event::Generation {
                previous: Some("generation 1 of run abc".into()),
            },
            Event::Refused {
                why: "rank 2 was refused: …".into(),
            },
            Event::Phase {
                phase: Phase::TrainRollout,
                n: Phase::TrainRollout.number(),
            },
            Event::Barrier {
                name: "sync-start".into(),
                k: 1,
                waited_ms: 12,
            },
            Event::Command {
                phase: "rollout".into(),
                exit: "exit code 0".into(),
                secs: 0.25,
            },
            Event::Commit {
                split: "train".into(),
                path: "/s/rollouts/iter-0002/train.rank-1.jsonl".into(),
                adopted: false,
            },
            Event::Aggregate {
                split: "train".into(),
                merged: Aggregated::Shards {
                    records: 10,
                    bytes: 400,
                },
            },
            Event::Aggregate {
                split: "train".into(),
                merged: Aggregated::Items {
                    items: 24,
                    missing: 1,
                },
            },
            Event::Reused {
                item: "rollout-train".into(),
            },
            Event::Journal {
                item: "train".into(),
            },
            Event::TrainFailed {
                failed: "exit code 3".into(),
                reason: "the train command failed with exit code 3".into(),
                log: "/s/logs/iter-0002/rank-1.train.log".into(),
            },
            Event::HandoffSkipped {
                failed: vec![RankFailure {
                    rank: 1,
                    failed: "exit code 3".into(),
                }],
                model: "base-model".into(),
                summary: "training failed on rank(s) 1 (exit code 3)".into(),
            },
            Event::RolloutFailed {
                split: "train".into(),
                failed: "exit code 7".into(),
                reason: "the rollout command failed with exit code 7".into(),
                log: "/s/logs/iter-0002/rank-1.rollout.log".into(),
            },
            Event::SurvivorsMerged {
                split: "train".into(),
                merged: 2,
                ranks: 3,
                failed: vec![RankFailure {
                    rank: 1,
                    failed: "exit code 7".into(),
                }],
            },
            Event::Handoff {
                model: "/s/models/iter-0002".into(),
                source: "/s/train-out".into(),
                transfer: "move".into(),
                excluded: 1,
                secs: 0.5,
            },
            Event::CheckpointsDeleted {
                names: vec!["iter-0001".into()],
            },
            Event::LatestFallback {
                warning: "models/LATEST names a missing checkpoint".into(),
            },
            Event::Fenced {
                what: "commit".into(),
                why: "generation 4 replaced it".into(),
            },
            Event::ServerStart {
                model: "base-model".into(),
                secs: 1.5,
                attempt: 2,
            },
            Event::ServerStartFailed {
                attempt: 1,
                attempts: 2,
                reason: "the server exited".into(),
                retry: true,
            },
            Event::ServerStop { secs: 0.125 },
            Event::Retry {
                item: "p00001".into(),
                task: "t01".into(),
                attempt: 1,
                exit: 75,
                delay_ms: 80,
            },
            Event::ItemFailed {
                item: "p00001".into(),
                task: "t01".into(),
                exit: "exit code 3".into(),
            },
            Event::Items {
                split: "train".into(),
                total: 6,
                committed: 5,
                failed: 1,
                mode: ItemsMode::Static {
                    retries: 2,
                    groups: Some(GROUPS),
                },
            },
            Event::Items {
                split: "train".into(),
                total: 6,
                committed: 3,
                failed: 0,
                mode: ItemsMode::Dynamic {
                    backups: 1,
                    dynamic: true,
                },
            },
            Event::Backup {
                item: "p00004".into(),
                holder: 2,
            },
            Event::MemberLost {
                lost: 2,
                reason: "rank 2's heartbeat was still for 60s".into(),
            },
            Event::Regrouped {
                members: vec![0, 1, 3],
                coordinator: 0,
            },
            Event::StoodIn {
                dropped: 2,
                split: "train".into(),
            },
            Event::PipelineWait {
                what: "the update cluster to finish training iteration 3".into(),
                secs: 1.5,
            },
            Event::RolloutModel {
                model: "/nfs/exp1/models/iter-0003".into(),
                model_version: 3,
                staleness: 1,
            },
            Event::HangReport {
                path: "logs/iter-0002/rank-1.hang-1.txt".into(),
                why: "barrier rollout-complete waited 5s".into(),
            },
        ]
    }

    /// The tag each variant is written under; a match without a wildcard, so that a new
    /// variant is seen here (and belongs in `every_kind`).
    fn tag(e: &Event) -> &'static str {
        match e {
            Event::Generation { .. } => "generation",
            Event::Refused { .. } => "refused",
            Event::Phase { .. } => "phase",
            Event::Barrier { .. } => "barrier",
            Event::Command { .. } => "command",
            Event::Commit { .. } => "commit",
            Event::Aggregate { .. } => "aggregate",
            Event::Reused { .. } => "reused",
            Event::Journal { .. } => "journal",
            Event::TrainFailed { .. } => "train-failed",
            Event::HandoffSkipped { .. } => "handoff-skipped",
            Event::RolloutFailed { .. } => "rollout-failed",
            Event::SurvivorsMerged { .. } => "survivors-merged",
            Event::Handoff { .. } => "handoff",
            Event::CheckpointsDeleted { .. } => "checkpoints-deleted",
            Event::LatestFallback { .. } => "latest-fallback",
            Event::Fenced { .. } => "fenced",
            Event::ServerStart { .. } => "server-start",
            Event::ServerStartFailed { .. } => "server-start-failed",
            Event::ServerStop { .. } => "server-stop",
            Event::Retry { .. } => "retry",
            Event::ItemFailed { .. } => "item-failed",
            Event::Items { .. } => "items",
            Event::Backup { .. } => "backup",
            Event::MemberLost { .. } => "member-lost",
            Event::Regrouped { .. } => "regrouped",
            Event::StoodIn { .. } => "stood-in",
            Event::PipelineWait { .. } => "pipeline-wait",
            Event::RolloutModel { .. } => "rollout-model",
            Event::HangReport { .. } => "hang-report",
        }
    }

    fn keys(v: &Value) -> Vec<&str> {
        v.as_object().unwrap().keys().map(String::as_str).collect()
    }

    #[test]
    fn every_kind_round_trips_through_a_line() {
        let kinds = every_kind();
        let mut tags = std::collections::BTreeSet::new();
        for event in kinds {
            let expected_tag = tag(&event);
            let r = record(event);
            let line = r.to_line();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            assert_eq!(EventRecord::parse(&line).as_ref(), Some(&r), "{line}");
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["event"], expected_tag, "{line}");
            tags.insert(expected_tag);
            // The common fields are the line's, never nested.
            assert_eq!(
                (&v["gen"], &v["iteration"], &v["rank"]),
                (&json!(3), &json!(2), &json!(1))
            );
        }
        // Every variant (Aggregate and Items twice, once per shape).
        assert_eq!(tags.len(), 30, "{tags:?}");
    }

    /// Every kind's line (both shapes of `aggregate` and `items`) is the text the ad-hoc
    /// `json!` object of its call site wrote: the same keys with the same values, in the
    /// same order.
    #[test]
    fn lines_have_the_keys_and_values_they_always_had() {
        let t = "2026-01-02T03:04:05.678+00:00";
        let cases = [
            (
                Event::Barrier {
                    name: "rollout-complete".into(),
                    k: 4,
                    waited_ms: 17,
                },
                json!({"event": "barrier", "name": "rollout-complete", "k": 4, "waited_ms": 17}),
            ),
            (
                Event::Commit {
                    split: "eval".into(),
                    path: "/s/x.jsonl".into(),
                    adopted: true,
                },
                json!({"event": "commit", "split": "eval", "path": "/s/x.jsonl", "adopted": true}),
            ),
            (
                Event::Reused {
                    item: "rollout-train".into(),
                },
                json!({"event": "reused", "item": "rollout-train"}),
            ),
            (
                Event::ServerStart {
                    model: "m".into(),
                    secs: 2.5,
                    attempt: 2,
                },
                json!({"event": "server-start", "model": "m", "secs": 2.5, "attempt": 2}),
            ),
            (
                Event::TrainFailed {
                    failed: "exit code 3".into(),
                    reason: "why".into(),
                    log: "/s/l.log".into(),
                },
                json!({"event": "train-failed", "failed": "exit code 3", "reason": "why", "log": "/s/l.log"}),
            ),
            (
                Event::Phase {
                    phase: Phase::FinalSync,
                    n: 13,
                },
                json!({"event": "phase", "phase": "final-sync", "n": 13}),
            ),
            (
                Event::Generation { previous: None },
                json!({"event": "generation", "previous": null}),
            ),
            (
                Event::HandoffSkipped {
                    failed: vec![RankFailure {
                        rank: 2,
                        failed: "timed out after 1s".into(),
                    }],
                    model: "m".into(),
                    summary: "s".into(),
                },
                json!({"event": "handoff-skipped", "failed": [{"rank": 2, "failed": "timed out after 1s"}], "model": "m", "summary": "s"}),
            ),
            (
                Event::Aggregate {
                    split: "train".into(),
                    merged: Aggregated::Items {
                        items: 5,
                        missing: 1,
                    },
                },
                json!({"event": "aggregate", "split": "train", "items": 5, "missing": 1}),
            ),
            (
                Event::Aggregate {
                    split: "eval".into(),
                    merged: Aggregated::Shards {
                        records: 7,
                        bytes: 99,
                    },
                },
                json!({"event": "aggregate", "split": "eval", "records": 7, "bytes": 99}),
            ),
            (
                Event::Items {
                    split: "train".into(),
                    total: 6,
                    committed: 6,
                    failed: 0,
                    mode: ItemsMode::Dynamic {
                        backups: 2,
                        dynamic: true,
                    },
                },
                json!({"event": "items", "split": "train", "total": 6, "committed": 6, "failed": 0, "backups": 2, "dynamic": true}),
            ),
            (
                Event::Retry {
                    item: "p00000".into(),
                    task: "t00".into(),
                    attempt: 1,
                    exit: 75,
                    delay_ms: 100,
                },
                json!({"event": "retry", "item": "p00000", "task": "t00", "attempt": 1, "exit": 75, "delay_ms": 100}),
            ),
            (
                Event::Generation {
                    previous: Some("generation 1 stopped".into()),
                },
                json!({"event": "generation", "previous": "generation 1 stopped"}),
            ),
            (
                Event::Refused {
                    why: "rank 2 was refused: x".into(),
                },
                json!({"event": "refused", "why": "rank 2 was refused: x"}),
            ),
            (
                Event::Command {
                    phase: "train".into(),
                    exit: "exit code 0".into(),
                    secs: 0.002635503,
                },
                json!({"event": "command", "phase": "train", "exit": "exit code 0", "secs": 0.002635503}),
            ),
            (
                Event::Journal {
                    item: "train".into(),
                },
                json!({"event": "journal", "item": "train"}),
            ),
            (
                Event::Handoff {
                    model: "/s/models/iter-0002".into(),
                    source: "/s/train/ckpt".into(),
                    transfer: "copy".into(),
                    excluded: 0,
                    secs: 1.5,
                },
                json!({"event": "handoff", "model": "/s/models/iter-0002", "source": "/s/train/ckpt",
                       "transfer": "copy", "excluded": 0, "secs": 1.5}),
            ),
            (
                Event::CheckpointsDeleted {
                    names: vec!["iter-0001".into()],
                },
                json!({"event": "checkpoints-deleted", "names": ["iter-0001"]}),
            ),
            (
                Event::LatestFallback {
                    warning: "w".into(),
                },
                json!({"event": "latest-fallback", "warning": "w"}),
            ),
            (
                Event::Fenced {
                    what: "publish x".into(),
                    why: "y".into(),
                },
                json!({"event": "fenced", "what": "publish x", "why": "y"}),
            ),
            (
                Event::ServerStartFailed {
                    attempt: 1,
                    attempts: 2,
                    reason: "r".into(),
                    retry: true,
                },
                json!({"event": "server-start-failed", "attempt": 1, "attempts": 2, "reason": "r", "retry": true}),
            ),
            (
                Event::ServerStop { secs: 0.5 },
                json!({"event": "server-stop", "secs": 0.5}),
            ),
            (
                Event::ItemFailed {
                    item: "p00001".into(),
                    task: "t01".into(),
                    exit: "exit code 75".into(),
                },
                json!({"event": "item-failed", "item": "p00001", "task": "t01", "exit": "exit code 75"}),
            ),
            (
                Event::Items {
                    split: "eval".into(),
                    total: 4,
                    committed: 3,
                    failed: 1,
                    mode: ItemsMode::Static {
                        retries: 2,
                        groups: Some(GROUPS),
                    },
                },
                json!({"event": "items", "split": "eval", "total": 4, "committed": 3, "failed": 1, "retries": 2,
                       "groups": {"planned": 3, "complete": 3, "dropped": 1, "replacements": 1}}),
            ),
            (
                Event::Backup {
                    item: "p00003".into(),
                    holder: 2,
                },
                json!({"event": "backup", "item": "p00003", "holder": 2}),
            ),
        ];
        let mut covered = std::collections::BTreeSet::new();
        for (event, mut expected) in cases {
            covered.insert(tag(&event));
            // What `Node::event` added to every object.
            let obj = expected.as_object_mut().unwrap();
            obj.insert("gen".into(), json!(3));
            obj.insert("iteration".into(), json!(2));
            obj.insert("rank".into(), json!(1));
            obj.insert("t".into(), json!(t));
            let line = record(event).to_line();
            // Same text, not just the same value: the keys in the same order.
            assert_eq!(line, format!("{expected}\n"));
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(keys(&v), keys(&expected), "{line}");
        }
        assert_eq!(
            covered.len(),
            22,
            "a kind without its line here: {covered:?}"
        );
    }

    #[test]
    fn a_phase_is_written_under_its_name() {
        for p in crate::protocol::phase::ALL {
            let v = serde_json::to_value(Event::Phase {
                phase: p,
                n: p.number(),
            })
            .unwrap();
            assert_eq!(v["phase"], p.name());
        }
    }

    #[test]
    fn lines_that_are_not_events_are_not_parsed() {
        for line in [
            "",
            "{\"event\":\"barrier\",\"gen\":1",
            "{\"event\":\"no-such-event\",\"gen\":1,\"iteration\":0,\"rank\":0,\"t\":\"x\"}",
            "{\"event\":\"reused\",\"gen\":1,\"iteration\":0,\"rank\":0}",
            "[1,2]",
        ] {
            assert_eq!(EventRecord::parse(line), None, "{line}");
        }
        // Keys it does not know are no reason to skip a line.
        let line = "{\"event\":\"reused\",\"item\":\"x\",\"gen\":1,\"iteration\":0,\"rank\":0,\"t\":\"x\",\"new\":1}";
        assert!(EventRecord::parse(line).is_some());
    }
}
