//! A rank's event log read back (`.rl-node/events/rank-R.jsonl`, or
//! `.rl-node/<cluster>/events/` in a pipelined run): which iterations rank 0 completed,
//! and how long each phase took. `status --watch` and the demo read it.

use crate::events::{self, EventRecord};
use crate::layout::Layout;
use crate::protocol::walk::Barrier;
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
    pub fn is_final_sync(&self) -> bool {
        matches!(&self.event, events::Event::Barrier { name, .. } if name == Barrier::FinalSync.name())
    }

    /// A pipelined rollout cluster has no final barrier: its iteration ends when rank 0
    /// journals `iteration-complete:rollout`.
    pub fn ends_iteration(&self) -> bool {
        self.is_final_sync()
            || matches!(&self.event, events::Event::Journal { item } if item.starts_with("iteration-complete"))
    }
}

/// Rank `rank`'s events in one cluster of a pipelined run (`None`: the synchronous loop).
/// Lines that are not events this build knows (a torn last line, another version's event)
/// are skipped, as are lines whose time does not parse. Of a log larger than
/// `[limits] journal-mib` only that much of its end is read (the latest events).
pub fn read_cluster_events(shared: &Path, cluster: Option<&'static str>, rank: u32) -> Vec<Event> {
    let path = Layout::new(shared)
        .with_cluster(cluster)
        .state_dir()
        .join("events")
        .join(format!("rank-{rank}.jsonl"));
    let limit = crate::store::ReadLimit::Journal.bytes();
    let Ok(Some(bytes)) = crate::store::fs::read_tail(&path, limit) else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&bytes);
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
    let end = mine.iter().find(|e| e.ends_iteration())?.t;
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
