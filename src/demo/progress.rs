//! What the demo shows, read from the shared directory alone: the merged trajectories and
//! eval results of each iteration, and rank 0's event log for the time per phase.

use crate::layout::Layout;
use serde_json::Value;
use std::path::Path;

/// One line of `.rl-node/events/rank-R.jsonl`, as far as the demo cares.
#[derive(Debug, Clone)]
pub struct Event {
    pub gen: u64,
    pub iteration: u64,
    pub kind: String,
    /// `phase` for phase and command events, `name` for barriers.
    pub name: String,
    /// Seconds since the Unix epoch (millisecond resolution).
    pub t: f64,
}

pub fn read_events(shared: &Path, rank: u32) -> Vec<Event> {
    let path = Layout::new(shared)
        .state_dir()
        .join("events")
        .join(format!("rank-{rank}.jsonl"));
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let t = chrono::DateTime::parse_from_rfc3339(v["t"].as_str()?).ok()?;
            Some(Event {
                gen: v["gen"].as_u64().unwrap_or(0),
                iteration: v["iteration"].as_u64().unwrap_or(0),
                kind: v["event"].as_str().unwrap_or("").to_string(),
                name: v["phase"]
                    .as_str()
                    .or_else(|| v["name"].as_str())
                    .unwrap_or("")
                    .to_string(),
                t: t.timestamp_millis() as f64 / 1000.0,
            })
        })
        .collect()
}

/// The iterations rank 0 completed in generation `gen` (it passed the final barrier).
pub fn completed(events: &[Event], gen: u64) -> Vec<u64> {
    events
        .iter()
        .filter(|e| e.gen == gen && e.kind == "barrier" && e.name == "final-sync")
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
    let end = mine
        .iter()
        .find(|e| e.kind == "barrier" && e.name == "final-sync")?
        .t;
    let phases: Vec<&&Event> = mine.iter().filter(|e| e.kind == "phase").collect();
    let start = phases.first()?.t;
    let mut out = Vec::new();
    for (i, p) in phases.iter().enumerate() {
        let until = phases.get(i + 1).map(|n| n.t).unwrap_or(end);
        out.push((p.name.clone(), (until - p.t).max(0.0)));
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
    /// Seconds per group of [`GROUPS`].
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
