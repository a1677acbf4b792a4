//! Lease claims of dynamic rollouts (`work.mode = "dynamic"`): who may run an item.
//!
//! Nodes claim items by an exclusive create of a lease named with the item, the
//! generation and an attempt number (`leases/pNNNNN.gG.aA`); the first creator of a name
//! wins. At the end of the pool a node looks at every item not yet committed: an item
//! whose newest lease is held by a live peer is waited for (or, when that peer is slow,
//! backed up once); one whose holder is dead, or is this node itself without a running
//! attempt, is taken over under the next attempt's lease; one without a lease in this
//! generation is claimed afresh. All attempts of an item write the same seed's output and
//! the commit renames without replacing, so exactly one attempt's file becomes the item.

use std::time::Duration;

/// Who holds an item's newest lease in this generation, as this node judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// No lease in this generation: claim attempt 0.
    Free,
    /// A live peer holds `attempt`: wait for it, or back it up when it is slow.
    Live { attempt: u32, rank: u32 },
    /// Its holder is dead (or is this node, with no attempt running): take it over.
    Gone { attempt: u32 },
}

impl Holder {
    /// The attempt a claim of this item takes (backup or takeover: the next one).
    pub fn next_attempt(self) -> u32 {
        match self {
            Holder::Free => 0,
            Holder::Live { attempt, .. } | Holder::Gone { attempt } => attempt + 1,
        }
    }
}

/// A deliberately broken judge, for the simulator's own tests (never set by the node).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A holder is live whatever liveness says: a dead node's items are never taken over.
    TrustEveryHolder,
}

/// Judge the holder of an item from its newest lease (attempt, holder rank), this node's
/// rank, and whether a rank is dead by this node's liveness judgement.
pub fn holder(newest: Option<(u32, u32)>, me: u32, dead: impl Fn(u32) -> bool) -> Holder {
    holder_with(newest, me, dead, None)
}

#[doc(hidden)]
pub fn holder_with(
    newest: Option<(u32, u32)>,
    me: u32,
    dead: impl Fn(u32) -> bool,
    mutation: Option<Mutation>,
) -> Holder {
    match newest {
        None => Holder::Free,
        Some((attempt, rank)) if mutation == Some(Mutation::TrustEveryHolder) => {
            Holder::Live { attempt, rank }
        }
        Some((attempt, rank)) if rank != me && !dead(rank) => Holder::Live { attempt, rank },
        Some((attempt, _)) => Holder::Gone { attempt },
    }
}

/// Back up a live holder's item (end game): only a first attempt, once this node has
/// watched it held for longer than this node's own average item time.
pub fn backup_due(attempt: u32, held_for: Duration, average_item: Option<Duration>) -> bool {
    attempt == 0 && average_item.is_some_and(|a| held_for > a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_judged_from_the_newest_lease_and_liveness() {
        let nobody_dead = |_| false;
        assert_eq!(holder(None, 1, nobody_dead), Holder::Free);
        assert_eq!(
            holder(Some((0, 2)), 1, nobody_dead),
            Holder::Live {
                attempt: 0,
                rank: 2
            }
        );
        assert_eq!(
            holder(Some((2, 2)), 1, |r| r == 2),
            Holder::Gone { attempt: 2 }
        );
        // Its own lease with no attempt running (e.g. a retry that was never started).
        assert_eq!(
            holder(Some((1, 1)), 1, nobody_dead),
            Holder::Gone { attempt: 1 }
        );
        assert_eq!(Holder::Free.next_attempt(), 0);
        assert_eq!(Holder::Gone { attempt: 2 }.next_attempt(), 3);
    }

    #[test]
    fn only_a_slow_first_attempt_is_backed_up() {
        let s = Duration::from_secs;
        assert!(backup_due(0, s(11), Some(s(10))));
        assert!(!backup_due(0, s(9), Some(s(10))));
        assert!(!backup_due(1, s(100), Some(s(10))));
        assert!(!backup_due(0, s(100), None));
    }
}
