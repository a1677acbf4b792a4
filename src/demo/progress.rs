//! What the demo shows, read from the shared directory alone: the merged trajectories and
//! eval results of each iteration, and rank 0's event log for the time per phase.

use crate::events::{self, EventRecord};
use crate::layout::Layout;
use crate::protocol::walk::Barrier;
use serde_json::Value;
use std::path::Path;

/// One line of `.rl-node/events/rank-R.jsonl`, with its time in seconds.
#[derive(Debug, Clone)]
pub struct Event {
    pub gen: u64,
    pub iteration: u64,
    pub event: events::Event,
    /// Seconds since the Unix epoch (millisecond resolution).
    pub t: f64,
}

impl Event {
    /// Passing the last barrier of an iteration: the iteration is complete.
    fn is_final_sync(&self) -> bool {
        matches!(&self.event, events::Event::Barrier { name, .. } if name == Barrier::FinalSync.name())
    }
}

/// Rank `rank`'s events. Lines that are not events this build knows (a torn last line,
/// another version's event) are skipped, as are lines whose time does not parse.
pub fn read_events(shared: &Path, rank: u32) -> Vec<Event> {
    let path = Layout::new(shared)
        .state_dir()
        .join("events")
        .join(format!("rank-{rank}.jsonl"));
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(EventRecord::parse)
        .filter_map(|r| {
            let t = chrono::DateTime::parse_from_rfc3339(&r.t).ok()?;
            Some(Event {
                gen: r.gen,
                iteration: r.iteration,
                event: r.event,
                t: t.timestamp_millis() as f64 / 1000.0,
            })
        })
        .collect()
}

/// The iterations rank 0 completed in generation `gen` (it passed the final barrier).
pub fn completed(events: &[Event], gen: u64) -> Vec<u64> {
    events
        .iter()
        .filter(|e| e.gen == gen && e.is_final_sync())
        .map(|e| e.iteration)
        .collect()
}

/// Rank 0's time in each phase of `iteration` (phases in walk order) and the total, or
/// None if the iteration is not complete in `gen`.
pub fn phase_times(
    events: &[Event],
    gen: u64,
    iteration: u64,
) -> Option<(f64, Vec<(String, f64)>)> {
    let mine: Vec<&Event> = events
        .iter()
        .filter(|e| e.gen == gen && e.iteration == iteration)
        .collect();
    let end = mine.iter().find(|e| e.is_final_sync())?.t;
    let phases: Vec<(crate::protocol::Phase, f64)> = mine
        .iter()
        .filter_map(|e| match e.event {
            events::Event::Phase { phase, .. } => Some((phase, e.t)),
            _ => None,
        })
        .collect();
    let start = phases.first()?.1;
    let mut out = Vec::new();
    for (i, (phase, t)) in phases.iter().enumerate() {
        let until = phases.get(i + 1).map(|n| n.1).unwrap_or(end);
        out.push((phase.name().to_string(), (until - t).max(0.0)));
    }
    Some(((end - start).max(0.0), out))
}

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
    let (mean_reward, train_samples) = match mean_reward(shared, iteration) {
        Some((m, n)) => (Some(m), n),
        None => (None, 0),
    };
    let times = phase_times(events, gen, iteration);
    let mut groups: Vec<(&'static str, f64)> = GROUPS.iter().map(|g| (*g, 0.0)).collect();
    if let Some((_, phases)) = &times {
        for (p, s) in phases {
            let g = group_of(p);
            if let Some(slot) = groups.iter_mut().find(|(n, _)| *n == g) {
                slot.1 += s;
            }
        }
    }
    IterationReport {
        iteration,
        mean_reward,
        train_samples,
        eval: eval_accuracy(shared, iteration),
        secs: times.as_ref().map(|t| t.0),
        groups,
        phases: times.map(|t| t.1).unwrap_or_default(),
    }
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

        let events = read_events(dir.path(), 0);
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
