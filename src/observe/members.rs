//! Who was a member of each generation of a run, for the views (`status`, `timeline`):
//! in elastic mode (`[cluster] min-nodes`) the members left after a loss form the next
//! generation without the rank lost, and a later generation (a restart of every node)
//! takes it back. Each generation's record (`gen-N/cluster.json`) says who its members
//! were; [`changes`] says, generation by generation, who was dropped and who came back.

use crate::layout::Layout;
use crate::protocol::{AbortInfo, AbortKind, ClusterRecord};
use crate::store;
use serde::Serialize;
use std::collections::BTreeMap;

/// The members of each of `gens` of run `run_id` that has a readable record of its own
/// (a number spent by a regroup, or a generation of another run, has none), in order.
pub fn read(
    layout: &Layout,
    run_id: &str,
    gens: impl IntoIterator<Item = u64>,
) -> BTreeMap<u64, Vec<u32>> {
    gens.into_iter()
        .filter_map(|gen| {
            let c = store::fs::read_json::<ClusterRecord>(&layout.gen_cluster(gen))
                .ok()
                .flatten()
                .filter(|c| c.run_id == run_id && c.gen == gen)?;
            Some((gen, c.members().ranks().to_vec()))
        })
        .collect()
}

/// How the members of generation `gen` differ from those of `previous`, the generation
/// before it whose members are known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub gen: u64,
    pub previous: u64,
    pub members: Vec<u32>,
    /// Members of `previous` that `gen` went on without.
    pub dropped: Vec<u32>,
    /// Ranks of `gen` that were not members of `previous`: back after a drop.
    pub rejoined: Vec<u32>,
}

/// Every generation after the first known one whose members differ from the one before.
pub fn changes(members: &BTreeMap<u64, Vec<u32>>) -> Vec<Change> {
    members
        .iter()
        .zip(members.iter().skip(1))
        .filter_map(|((&previous, before), (&gen, now))| {
            let dropped: Vec<u32> = before
                .iter()
                .copied()
                .filter(|r| !now.contains(r))
                .collect();
            let rejoined: Vec<u32> = now
                .iter()
                .copied()
                .filter(|r| !before.contains(r))
                .collect();
            (!dropped.is_empty() || !rejoined.is_empty()).then(|| Change {
                gen,
                previous,
                members: now.clone(),
                dropped,
                rejoined,
            })
        })
        .collect()
}

/// Why and when a rank was dropped: the abort of the generation it was lost in, when
/// that abort names it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Dropped {
    pub rank: u32,
    /// The generation it was lost in (its last as a member).
    pub lost_in: u64,
    /// The first generation formed without it.
    pub dropped_from: u64,
    /// Why: the abort's reason (`heartbeat still for 3.0s`); `None` when no abort of
    /// `lost_in` names the rank.
    pub reason: Option<String>,
    /// The abort, described as the nodes' logs and `status` describe a stop.
    pub described: Option<String>,
    /// When it was declared lost (the detector's clock, RFC 3339), by which rank, and
    /// where it was then.
    pub at: Option<String>,
    pub detected_by: Option<u32>,
    pub iteration: Option<u64>,
    pub phase: Option<String>,
}

impl Dropped {
    /// Rank `rank`, which generation `change.gen` went on without, with the abort of the
    /// generation it was lost in (if any).
    pub fn of(rank: u32, change: &Change, abort: Option<&AbortInfo>) -> Dropped {
        let abort = abort.filter(|a| a.culprit == rank && a.cluster.is_none());
        Dropped {
            rank,
            lost_in: change.previous,
            dropped_from: change.gen,
            reason: abort.map(|a| a.reason.clone()),
            described: abort.map(|a| a.describe()),
            at: abort.map(|a| a.at.clone()),
            detected_by: abort.map(|a| a.detected_by),
            iteration: abort.map(|a| a.iteration),
            phase: abort.map(|a| a.phase.clone()),
        }
    }

    /// `rank 0 in generation 1 (declared dead by rank 2 at …): heartbeat still for 3.0s`.
    pub fn summary(&self) -> String {
        let when = match (&self.detected_by, &self.at) {
            (Some(by), Some(at)) => format!(" (declared lost by rank {by} at {at})"),
            _ => String::new(),
        };
        format!(
            "rank {} in generation {}{when}: {}",
            self.rank,
            self.lost_in,
            self.reason
                .as_deref()
                .unwrap_or("no abort of that generation names it")
        )
    }
}

/// Whether `a`, the abort of a generation of `members` in a run whose `[cluster]
/// min-nodes` is `min_nodes` (0: every node), is a loss the members left go on from by
/// themselves: a member other than them declared dead (or dropped for its command's
/// failure, `on-failure = "drop-node"`), enough left.
pub fn survived(a: &AbortInfo, members: &[u32], num_nodes: u32, min_nodes: u32) -> bool {
    let min = if min_nodes == 0 { num_nodes } else { min_nodes };
    (a.kind == AbortKind::PeerDead || a.dropped)
        && a.cluster.is_none()
        && min < num_nodes
        && members.contains(&a.culprit)
        && (members.len() as u32).saturating_sub(1) >= min
}

/// `rank 1, rank 2`.
pub fn ranks_list(ranks: &[u32]) -> String {
    let v: Vec<String> = ranks.iter().map(|r| format!("rank {r}")).collect();
    v.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_say_who_was_dropped_and_who_came_back() {
        let members = BTreeMap::from([
            (1, vec![0, 1, 2]),
            (2, vec![1, 2]),
            // Generation 3 was a spent number: no record.
            (4, vec![1, 2]),
            (5, vec![0, 1, 2]),
        ]);
        assert_eq!(
            changes(&members),
            [
                Change {
                    gen: 2,
                    previous: 1,
                    members: vec![1, 2],
                    dropped: vec![0],
                    rejoined: vec![],
                },
                Change {
                    gen: 5,
                    previous: 4,
                    members: vec![0, 1, 2],
                    dropped: vec![],
                    rejoined: vec![0],
                },
            ]
        );
        assert!(changes(&BTreeMap::from([(1, vec![0, 1])])).is_empty());
    }

    fn lost(culprit: u32, kind: AbortKind) -> AbortInfo {
        AbortInfo {
            kind,
            culprit,
            culprit_host: "h".into(),
            phase: "1 (train-rollout)".into(),
            iteration: 2,
            reason: "heartbeat still for 3.0s".into(),
            log: None,
            detected_by: 1,
            silent_ms: Some(3000),
            at: "2026-01-01T00:00:00.000+00:00".into(),
            cluster: None,
            detected_in: None,
            dropped: false,
        }
    }

    /// Only the death of a member, in elastic mode, with `min-nodes` members left, is
    /// gone on from; any other stop stops the run.
    #[test]
    fn a_loss_is_survived_in_elastic_mode_with_enough_members_left() {
        let dead = |r| lost(r, AbortKind::PeerDead);
        assert!(survived(&dead(0), &[0, 1, 2], 3, 2));
        assert!(!survived(&dead(0), &[0, 1, 2], 3, 0), "no min-nodes");
        assert!(
            !survived(&dead(0), &[0, 1, 2], 3, 3),
            "min-nodes = num-nodes"
        );
        assert!(!survived(&dead(1), &[1, 2], 3, 2), "one left of two");
        assert!(!survived(&dead(0), &[1, 2], 3, 1), "not a member");
        assert!(survived(&dead(2), &[1, 2], 3, 1));
        let timeout = lost(0, AbortKind::Timeout);
        assert!(!survived(&timeout, &[0, 1, 2], 3, 2), "a timeout");
    }

    /// The abort of the generation a rank was lost in says why, when it names that rank.
    #[test]
    fn a_drop_says_why_from_the_abort_that_names_the_rank() {
        let change = Change {
            gen: 2,
            previous: 1,
            members: vec![1, 2],
            dropped: vec![0],
            rejoined: vec![],
        };
        let d = Dropped::of(0, &change, Some(&lost(0, AbortKind::PeerDead)));
        assert_eq!(
            d.summary(),
            "rank 0 in generation 1 (declared lost by rank 1 at 2026-01-01T00:00:00.000+00:00): heartbeat still for 3.0s"
        );
        assert!(d.described.unwrap().starts_with("rank 0 on h is dead"));
        let other = Dropped::of(0, &change, Some(&lost(2, AbortKind::PeerDead)));
        assert_eq!((other.reason, other.at), (None, None));
        assert_eq!(
            Dropped::of(0, &change, None).summary(),
            "rank 0 in generation 1: no abort of that generation names it"
        );
    }
}
