//! What the demo shows, read from the shared directory alone: the merged trajectories and
//! eval results of each iteration, and rank 0's event log for the time per phase. In a
//! pipelined run each cluster has its own event log (`.rl-node/<cluster>/events/`); an
//! iteration's phases are split between them, so its report sums both.

use crate::events;
use crate::layout::Layout;
use serde_json::Value;
use std::path::Path;

pub use crate::observe::eventlog::{completed, phase_times, read_cluster_events, Event};

/// The columns the demo groups the 14 phases into.
pub const GROUPS: [&str; 6] = ["rollout", "eval", "server", "train", "handoff", "sync"];

pub fn group_of(phase: &str) -> &'static str {
    match phase {
        "train-rollout" => "rollout",
        "eval" => "eval",
        "stop-server" | "restart-server" => "server",
        "prepare-data" | "training" => "train",
        "handoff" => "handoff",
        _ => "sync",
    }
}

/// Mean reward and line count of `rollouts/iter-NNNN/train.jsonl`.
pub fn mean_reward(shared: &Path, iteration: u64) -> Option<(f64, u64)> {
    let text = std::fs::read_to_string(Layout::new(shared).aggregated(iteration, "train")).ok()?;
    let mut sum = 0.0;
    let mut n = 0u64;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).ok()?;
        sum += v["reward"].as_f64()?;
        n += 1;
    }
    (n > 0).then(|| (sum / n as f64, n))
}

/// The model version every line of `rollouts/iter-NNNN/train.jsonl` says it was rolled
/// out with; None if a line has none or they disagree.
pub fn model_version(shared: &Path, iteration: u64) -> Option<u64> {
    let text = std::fs::read_to_string(Layout::new(shared).aggregated(iteration, "train")).ok()?;
    let mut version = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).ok()?;
        let this = v["model_version"].as_u64()?;
        if version.is_some_and(|seen| seen != this) {
            return None;
        }
        version = Some(this);
    }
    version
}

/// (correct, total) of `rollouts/iter-NNNN/eval.jsonl`, if eval ran.
pub fn eval_accuracy(shared: &Path, iteration: u64) -> Option<(u64, u64)> {
    let path = Layout::new(shared).aggregated(iteration, "eval");
    if !path.exists() {
        return None;
    }
    super::toy::eval_counts(&path).ok().filter(|(_, n)| *n > 0)
}

/// Everything the demo prints about one iteration.
#[derive(Debug, Clone)]
pub struct IterationReport {
    pub iteration: u64,
    pub mean_reward: Option<f64>,
    pub train_samples: u64,
    /// The model the train rollout ran on, as its trajectories say.
    pub model_version: Option<u64>,
    pub eval: Option<(u64, u64)>,
    /// Rank 0's wall time for the iteration.
    pub secs: Option<f64>,
    /// Seconds per group of phases (`GROUPS`).
    pub groups: Vec<(&'static str, f64)>,
    /// Seconds per phase, in walk order.
    pub phases: Vec<(String, f64)>,
}

impl IterationReport {
    pub fn eval_accuracy(&self) -> Option<f64> {
        self.eval.map(|(ok, n)| ok as f64 / n as f64)
    }
}

/// Report on `iteration` of generation `gen` of the run in `shared` (the shared directory).
pub fn iteration_report(
    shared: &Path,
    events: &[Event],
    gen: u64,
    iteration: u64,
) -> IterationReport {
    cluster_report(shared, &[(events, gen)], iteration)
}

/// Report on `iteration` from the event logs of every cluster that worked on it, each
/// with its generation: one for the synchronous loop, the rollout cluster's and the
/// update cluster's for a pipelined run. The phases are those of the clusters in turn;
/// `secs` is the last cluster's wall time for the iteration.
pub fn cluster_report(
    shared: &Path,
    clusters: &[(&[Event], u64)],
    iteration: u64,
) -> IterationReport {
    let (mean_reward, train_samples) = match mean_reward(shared, iteration) {
        Some((m, n)) => (Some(m), n),
        None => (None, 0),
    };
    let mut groups: Vec<(&'static str, f64)> = GROUPS.iter().map(|g| (*g, 0.0)).collect();
    let mut phases = Vec::new();
    let mut secs = None;
    for (events, gen) in clusters {
        let times = phase_times(events, *gen, iteration);
        if let Some((total, ps)) = times {
            for (p, s) in &ps {
                let g = group_of(p);
                if let Some(slot) = groups.iter_mut().find(|(n, _)| *n == g) {
                    slot.1 += s;
                }
            }
            phases.extend(ps);
            secs = Some(total);
        }
    }
    IterationReport {
        iteration,
        mean_reward,
        train_samples,
        model_version: model_version(shared, iteration),
        eval: eval_accuracy(shared, iteration),
        secs,
        groups,
        phases,
    }
}

/// When rank 0 of a cluster ended each iteration of generation `gen`, and when it entered
/// its first phase: (first phase, [(iteration, end)]). The makespan of a run is the
/// last end minus the first start.
pub fn iteration_ends(events: &[Event], gen: u64) -> (Option<f64>, Vec<(u64, f64)>) {
    let start = events
        .iter()
        .find(|e| e.gen == gen && matches!(e.event, events::Event::Phase { .. }))
        .map(|e| e.t);
    let ends = events
        .iter()
        .filter(|e| e.gen == gen && e.ends_iteration())
        .fold(Vec::<(u64, f64)>::new(), |mut v, e| {
            // The update cluster ends an iteration twice (final barrier, then its journal):
            // the first is the end.
            if !v.iter().any(|(i, _)| *i == e.iteration) {
                v.push((e.iteration, e.t));
            }
            v
        });
    (start, ends)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventRecord;
    use crate::protocol::Phase;

    fn line(gen: u64, iteration: u64, t: &str, event: events::Event) -> String {
        EventRecord {
            event,
            gen,
            iteration,
            rank: 0,
            t: t.into(),
        }
        .to_line()
    }

    fn phase(p: Phase) -> events::Event {
        events::Event::Phase {
            phase: p,
            n: p.number(),
        }
    }

    fn barrier(name: &str) -> events::Event {
        events::Event::Barrier {
            name: name.into(),
            k: 1,
            waited_ms: 0,
        }
    }

    #[test]
    fn phase_times_come_from_the_typed_lines_and_other_lines_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let events_dir = Layout::new(dir.path()).state_dir().join("events");
        std::fs::create_dir_all(&events_dir).unwrap();
        let mut text = String::new();
        text += &line(
            1,
            1,
            "2026-01-01T00:00:00.000+00:00",
            phase(Phase::SyncStart),
        );
        text += "{\"event\":\"from-a-later-version\",\"gen\":1}\n";
        text += &line(1, 1, "2026-01-01T00:00:01.000+00:00", barrier("sync-start"));
        text += &line(
            1,
            1,
            "2026-01-01T00:00:01.500+00:00",
            phase(Phase::TrainRollout),
        );
        text += "not json\n";
        text += &line(
            1,
            1,
            "2026-01-01T00:00:04.000+00:00",
            phase(Phase::FinalSync),
        );
        text += &line(1, 1, "2026-01-01T00:00:04.250+00:00", barrier("final-sync"));
        // An iteration that did not pass final-sync, and a torn last line.
        text += &line(
            1,
            2,
            "2026-01-01T00:00:05.000+00:00",
            phase(Phase::SyncStart),
        );
        text += "{\"event\":\"barrier\",\"name\":\"final-s";
        std::fs::write(events_dir.join("rank-0.jsonl"), text).unwrap();

        let events = read_cluster_events(dir.path(), None, 0);
        assert_eq!(events.len(), 6);
        assert_eq!(completed(&events, 1), [1]);
        assert!(completed(&events, 2).is_empty());
        let (total, phases) = phase_times(&events, 1, 1).unwrap();
        assert_eq!(total, 4.25);
        assert_eq!(
            phases,
            [
                ("sync-start".to_string(), 1.5),
                ("train-rollout".to_string(), 2.5),
                ("final-sync".to_string(), 0.25),
            ]
        );
        assert!(phase_times(&events, 1, 2).is_none());
    }
}
