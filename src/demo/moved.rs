//! What moved in an elastic run (`--min-nodes`), read from every rank's event log: who was
//! lost and who saw it, each generation the survivors formed (its members, its
//! coordinator, where it resumed, how long after the kill its members first met), and who
//! stood in for which dropped rank's rollouts.

use crate::events::Event as Kind;
use crate::observe::eventlog::{read_cluster_events, Event};
use std::collections::BTreeMap;
use std::path::Path;

/// The name of the barrier a regrouped generation's members pass first.
const REGROUPED_BARRIER: &str = "regrouped";

/// Every rank's events (rank, its log) of the synchronous run in `shared`.
pub fn read_all(shared: &Path, nodes: u32) -> Vec<(u32, Vec<Event>)> {
    (0..nodes)
        .map(|r| (r, read_cluster_events(shared, None, r)))
        .collect()
}

/// A loss as the members left saw it.
#[derive(Debug, Default)]
struct Loss {
    reason: String,
    seen_by: Vec<u32>,
}

/// A generation formed after a loss.
#[derive(Debug, Default)]
struct Formed {
    members: Vec<u32>,
    coordinator: u32,
    /// The first iteration its coordinator walked in it.
    resumed_at: Option<u64>,
    /// When the last of its members passed its first barrier (seconds since the epoch).
    met: Option<f64>,
}

/// The lines saying what moved; empty when no member was lost. `killed_at`: when the demo
/// killed a node (seconds since the epoch), for the time to the survivors' first barrier.
pub fn what_moved(
    logs: &[(u32, Vec<Event>)],
    killed_at: Option<f64>,
    dead_after: u64,
) -> Vec<String> {
    let mut losses: BTreeMap<(u64, u32), Loss> = BTreeMap::new();
    let mut formed: BTreeMap<u64, Formed> = BTreeMap::new();
    // (stand-in, dropped rank, split) -> iterations
    let mut stood_in: BTreeMap<(u32, u32, String), Vec<u64>> = BTreeMap::new();
    for (rank, events) in logs {
        for e in events {
            match &e.event {
                Kind::MemberLost { lost, reason } => {
                    let l = losses.entry((e.gen, *lost)).or_default();
                    if l.reason.is_empty() {
                        l.reason = reason.clone();
                    }
                    if !l.seen_by.contains(rank) {
                        l.seen_by.push(*rank);
                    }
                }
                Kind::Regrouped {
                    members,
                    coordinator,
                } => {
                    let f = formed.entry(e.gen).or_default();
                    f.members = members.clone();
                    f.coordinator = *coordinator;
                }
                Kind::StoodIn { dropped, split } => {
                    let its = stood_in
                        .entry((*rank, *dropped, split.clone()))
                        .or_default();
                    if !its.contains(&e.iteration) {
                        its.push(e.iteration);
                    }
                }
                _ => {}
            }
        }
    }
    for (gen, f) in formed.iter_mut() {
        let of = |rank: u32| logs.iter().find(|(r, _)| *r == rank).map(|(_, e)| e);
        f.resumed_at = of(f.coordinator).and_then(|events| {
            events
                .iter()
                .filter(|e| e.gen == *gen && matches!(e.event, Kind::Phase { .. }))
                .map(|e| e.iteration)
                .min()
        });
        // Every member must have passed it for the generation to have met.
        let passed: Vec<f64> = f
            .members
            .iter()
            .filter_map(|m| {
                of(*m)?
                    .iter()
                    .find(|e| {
                        e.gen == *gen
                            && matches!(&e.event, Kind::Barrier { name, .. } if name == REGROUPED_BARRIER)
                    })
                    .map(|e| e.t)
            })
            .collect();
        if passed.len() == f.members.len() {
            f.met = passed.into_iter().reduce(f64::max);
        }
    }
    if losses.is_empty() && formed.is_empty() {
        return Vec::new();
    }
    let mut out = vec![
        "what moved (from the nodes' event logs, shared/.rl-node/events/rank-R.jsonl):".to_string(),
    ];
    for ((gen, lost), l) in &losses {
        let mut seen = l.seen_by.clone();
        seen.sort_unstable();
        out.push(format!(
            "  generation {gen}: rank {lost} lost ({}); seen by {}",
            l.reason,
            ranks(&seen)
        ));
    }
    for (gen, f) in &formed {
        let mut line = format!(
            "  generation {gen} formed of {}: rank {} coordinates",
            ranks(&f.members),
            f.coordinator
        );
        if let Some(it) = f.resumed_at {
            line.push_str(&format!(", resuming at iteration {it}"));
        }
        if let (Some(met), Some(kill)) = (f.met, killed_at) {
            line.push_str(&format!(
                "; its members met {:.1}s after the kill (dead-after {dead_after}s)",
                (met - kill).max(0.0)
            ));
        }
        out.push(line);
    }
    // Per (stand-in, dropped rank): the train rollout first, then eval.
    let mut by_pair: BTreeMap<(u32, u32), Vec<(u8, String)>> = BTreeMap::new();
    for ((by, dropped, split), its) in &stood_in {
        let mut its = its.clone();
        its.sort_unstable();
        let order = match split.as_str() {
            "train" => 0,
            "eval" => 1,
            _ => 2,
        };
        by_pair.entry((*by, *dropped)).or_default().push((
            order,
            format!(
                "its {split} rollout in iteration{} {}",
                if its.len() == 1 { "" } else { "s" },
                iterations(&its)
            ),
        ));
    }
    for ((by, dropped), mut what) in by_pair {
        what.sort();
        let what: Vec<String> = what.into_iter().map(|(_, w)| w).collect();
        out.push(format!(
            "  rank {by} stood in for rank {dropped}: {}",
            what.join("; ")
        ));
    }
    out
}

fn ranks(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(|r| format!("rank {r}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Sorted iterations, runs of consecutive ones shortened: `2-5, 7`.
fn iterations(its: &[u64]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < its.len() {
        let mut j = i;
        while j + 1 < its.len() && its[j + 1] == its[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", its[i], its[j])
        } else {
            its[i].to_string()
        });
        i = j + 1;
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Phase;

    fn ev(gen: u64, iteration: u64, t: f64, event: Kind) -> Event {
        Event {
            gen,
            iteration,
            event,
            t,
        }
    }

    fn barrier(gen: u64, t: f64) -> Event {
        ev(
            gen,
            2,
            t,
            Kind::Barrier {
                name: REGROUPED_BARRIER.into(),
                k: 1,
                waited_ms: 0,
            },
        )
    }

    #[test]
    fn iteration_runs_are_shortened() {
        assert_eq!(iterations(&[2, 3, 4, 5, 7]), "2-5, 7");
        assert_eq!(iterations(&[3, 5, 7]), "3, 5, 7");
        assert_eq!(iterations(&[4]), "4");
        assert_eq!(iterations(&[]), "");
    }

    #[test]
    fn nothing_moved_without_a_loss() {
        let logs = vec![(0, vec![barrier(1, 1.0)]), (1, vec![])];
        assert!(what_moved(&logs, None, 3).is_empty());
    }

    /// Rank 0 killed: ranks 1 and 2 saw it, formed generation 2 coordinated by rank 1,
    /// and rank 2 stood in for rank 0's rollouts.
    #[test]
    fn a_loss_a_generation_and_a_stand_in() {
        let lost = |t| {
            ev(
                1,
                2,
                t,
                Kind::MemberLost {
                    lost: 0,
                    reason: "heartbeat still for 3.1s".into(),
                },
            )
        };
        let regrouped = |t| {
            ev(
                2,
                2,
                t,
                Kind::Regrouped {
                    members: vec![1, 2],
                    coordinator: 1,
                },
            )
        };
        let phase = |it, t| {
            ev(
                2,
                it,
                t,
                Kind::Phase {
                    phase: Phase::TrainRollout,
                    n: Phase::TrainRollout.number(),
                },
            )
        };
        let stood = |it, split: &str| {
            ev(
                2,
                it,
                20.0,
                Kind::StoodIn {
                    dropped: 0,
                    split: split.into(),
                },
            )
        };
        let logs = vec![
            (0, vec![phase(1, 1.0)]),
            (
                1,
                vec![
                    lost(13.0),
                    regrouped(13.5),
                    barrier(2, 13.6),
                    phase(2, 14.0),
                ],
            ),
            (
                2,
                vec![
                    lost(13.1),
                    regrouped(13.6),
                    barrier(2, 13.9),
                    stood(2, "train"),
                    stood(3, "train"),
                    stood(4, "train"),
                    stood(3, "eval"),
                ],
            ),
        ];
        let lines = what_moved(&logs, Some(10.0), 3);
        assert_eq!(
            lines[1..],
            [
                "  generation 1: rank 0 lost (heartbeat still for 3.1s); seen by rank 1, rank 2",
                "  generation 2 formed of rank 1, rank 2: rank 1 coordinates, resuming at iteration 2; its members met 3.9s after the kill (dead-after 3s)",
                "  rank 2 stood in for rank 0: its train rollout in iterations 2-4; its eval rollout in iteration 3",
            ],
            "{lines:#?}"
        );
    }
}
