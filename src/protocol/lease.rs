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
//!
//! The end game is speed-aware ([`take_next`]): every lease carries its creator's pace
//! (mean item time, items at once), and a free node leaves the pool's last unclaimed items
//! to faster peers when they would finish all of them before it could finish one. A left
//! item is claimed anyway once it has waited for longer than the fastest peer needs to
//! take and finish it (a dead or stalled peer never keeps it unclaimed).

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
    /// [`take_next`] without patience: an item left to a faster peer waits for it forever,
    /// so a peer that dies (or never takes it) leaves it unclaimed.
    LeaveForever,
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
    let mutation = super::mutation(mutation);
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

/// How fast a rank runs items: what it publishes in every lease it creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// The mean time of its items so far (from start to exit, as its node saw them).
    pub item: Duration,
    /// Items it runs at once (`work.max-workers`).
    pub workers: u32,
}

/// What a free worker does with the pool's next unclaimed item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Claim it now.
    Claim,
    /// Leave it to faster peers, and look again at the latest after `recheck` (when it
    /// has waited its patience and is still unclaimed, it is claimed anyway).
    Leave { recheck: Duration },
}

/// Speed-aware end game: should this node's free worker claim the pool's next unclaimed
/// item, of `unclaimed` items nobody holds yet (this one included)?
///
/// Each peer worker is taken to be half-way through an item (free after half its mean
/// item time, then one item per mean item time); this node's free worker would finish
/// the item after its own mean time. Scheduling the unclaimed items one by one to
/// whichever worker finishes them first, this node gets one (and claims) unless the peers
/// finish every one of them before it could finish one: then leaving them to the peers
/// ends the pool sooner. Ties go to this node.
///
/// Liveness: a left item is claimed anyway once it has `waited` its patience, twice the
/// fastest peer's mean item time (by then that peer, free at the latest after one of its
/// items, would have claimed it), and never more than this node's own mean item time. So
/// a peer that died, stalled, or leaves the item too (inconsistent paces) delays it by
/// at most that. `peers` are the paces of the live peers only; without a pace of its
/// own (no item finished yet) a node always claims.
pub fn take_next(me: Option<Pace>, peers: &[Pace], unclaimed: usize, waited: Duration) -> Take {
    take_next_with(me, peers, unclaimed, waited, None)
}

#[doc(hidden)]
pub fn take_next_with(
    me: Option<Pace>,
    peers: &[Pace],
    unclaimed: usize,
    waited: Duration,
    mutation: Option<Mutation>,
) -> Take {
    let mutation = super::mutation(mutation);
    let Some(me) = me else {
        return Take::Claim;
    };
    let mine = me.item.as_nanos();
    // Items the peers finish before this node would finish one: a peer worker of mean m,
    // free after m/2, finishes its j-th item at m/2 + j·m; count the j ≥ 1 with
    // m/2 + j·m < mine, i.e. 2·j·m < 2·mine − m (in whole nanoseconds: ties are exact).
    let mut before = 0u128;
    let mut fastest: Option<Duration> = None;
    for p in peers.iter().filter(|p| p.workers > 0 && !p.item.is_zero()) {
        let m = p.item.as_nanos();
        let slots = match (2 * mine).checked_sub(m) {
            Some(room) if room > 0 => (room - 1) / (2 * m),
            _ => 0,
        };
        if slots > 0 {
            fastest = Some(fastest.map_or(p.item, |f| f.min(p.item)));
            before += slots * u128::from(p.workers);
        }
    }
    let Some(fastest) = fastest.filter(|_| unclaimed as u128 <= before) else {
        return Take::Claim;
    };
    let patience = (fastest * 2).min(me.item);
    if waited >= patience && mutation != Some(Mutation::LeaveForever) {
        return Take::Claim;
    }
    Take::Leave {
        recheck: patience.saturating_sub(waited),
    }
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

    fn pace(ms: u64, workers: u32) -> Pace {
        Pace {
            item: Duration::from_millis(ms),
            workers,
        }
    }

    /// scripts/bench-balance's ranks: 0.16, 0.08 and 0.04 s per item.
    #[test]
    fn the_slow_rank_leaves_the_last_items_to_faster_peers() {
        let peers = [pace(80, 1), pace(40, 1)];
        let me = Some(pace(160, 1));
        // The 0.08 s peer finishes one item before 0.16 s (0.04 + 0.08), the 0.04 s one
        // three (0.02 + 0.04·j for j = 1..3): four items are better left to them.
        for unclaimed in 1..=4 {
            assert!(
                matches!(
                    take_next(me, &peers, unclaimed, Duration::ZERO),
                    Take::Leave { .. }
                ),
                "{unclaimed}"
            );
        }
        assert_eq!(take_next(me, &peers, 5, Duration::ZERO), Take::Claim);
        assert_eq!(take_next(me, &peers, 1000, Duration::ZERO), Take::Claim);
        // The fast ranks always claim: nobody finishes an item before they do.
        let fast = [pace(160, 1), pace(80, 1)];
        assert_eq!(
            take_next(Some(pace(40, 1)), &fast, 1, Duration::ZERO),
            Take::Claim
        );
        let mid = [pace(160, 1), pace(40, 1)];
        // 0.08 s against a 0.04 s peer: 0.02 + 0.04 = 0.06 < 0.08, so one is left.
        assert!(matches!(
            take_next(Some(pace(80, 1)), &mid, 1, Duration::ZERO),
            Take::Leave { .. }
        ));
        assert_eq!(
            take_next(Some(pace(80, 1)), &mid, 2, Duration::ZERO),
            Take::Claim
        );
    }

    #[test]
    fn equal_or_unknown_paces_always_claim() {
        let s = Duration::ZERO;
        assert_eq!(
            take_next(Some(pace(100, 1)), &[pace(100, 8)], 1, s),
            Take::Claim
        );
        // 0.07 s: 0.035 + 0.07 > 0.1.
        assert_eq!(
            take_next(Some(pace(100, 1)), &[pace(70, 4)], 1, s),
            Take::Claim
        );
        assert_eq!(take_next(None, &[pace(1, 64)], 1, s), Take::Claim);
        assert_eq!(take_next(Some(pace(100, 1)), &[], 1, s), Take::Claim);
        assert_eq!(
            take_next(Some(pace(100, 1)), &[pace(0, 1), pace(10, 0)], 1, s),
            Take::Claim
        );
    }

    #[test]
    fn more_workers_on_a_peer_take_more_of_the_last_items() {
        let me = Some(pace(160, 1));
        // Three items per worker before 0.16 s: 8 workers take 24.
        let peers = [pace(40, 8)];
        assert!(matches!(
            take_next(me, &peers, 24, Duration::ZERO),
            Take::Leave { .. }
        ));
        assert_eq!(take_next(me, &peers, 25, Duration::ZERO), Take::Claim);
    }

    /// A left item waits at most twice the fastest peer's item time (never more than this
    /// node's own): a peer that died, stalled or never takes it does not keep it.
    #[test]
    fn a_left_item_is_claimed_once_its_patience_runs_out() {
        let me = Some(pace(160, 1));
        let peers = [pace(80, 1), pace(40, 1)];
        let ms = Duration::from_millis;
        assert_eq!(
            take_next(me, &peers, 1, ms(30)),
            Take::Leave { recheck: ms(50) }
        );
        assert_eq!(take_next(me, &peers, 1, ms(80)), Take::Claim);
        // A dead peer is not among `peers`: without the fast one, the 0.08 s peer alone
        // takes one item, and the patience is its 0.16 s, capped at this node's own.
        assert_eq!(
            take_next(me, &[pace(80, 1)], 1, ms(0)),
            Take::Leave { recheck: ms(160) }
        );
        assert_eq!(take_next(me, &[pace(80, 1)], 1, ms(160)), Take::Claim);
        // Without patience the item would wait forever (the simulator's broken variant).
        #[cfg(feature = "sim")]
        assert!(matches!(
            take_next_with(me, &peers, 1, ms(1_000_000), Some(Mutation::LeaveForever)),
            Take::Leave { .. }
        ));
    }

    /// The reference: list scheduling, item by item, to the worker that finishes it first
    /// (peer workers free after half their item time, this node's free worker now; ties
    /// to this node). Does this node's free worker get an item?
    fn list_schedule_gives_me_one(me: u64, peers: &[(u64, u32)], unclaimed: usize) -> bool {
        // Times in half-milliseconds, so that m/2 is whole.
        let mut free: Vec<(u64, u64)> = peers
            .iter()
            .filter(|&&(m, _)| m > 0)
            .flat_map(|&(m, w)| (0..w).map(move |_| (m, 2 * m)))
            .collect();
        let mine = 2 * me;
        for _ in 0..unclaimed {
            let best = free.iter_mut().min_by_key(|(f, m)| *f + *m);
            match best {
                Some((f, m)) if *f + *m < mine => *f += *m,
                _ => return true,
            }
        }
        false
    }

    use proptest::prelude::{prop, prop_assert, prop_assert_eq, proptest};

    proptest! {
        #[test]
        fn the_decision_is_list_scheduling_and_never_starves_an_item(
            me in 1u64..500,
            peers in prop::collection::vec((0u64..500, 0u32..5), 0..6),
            unclaimed in 1usize..40,
            waited in 0u64..600,
        ) {
            let paces: Vec<Pace> = peers.iter().map(|&(m, w)| pace(m, w)).collect();
            let d = take_next(Some(pace(me, 1)), &paces, unclaimed, Duration::ZERO);
            prop_assert_eq!(
                d == Take::Claim,
                list_schedule_gives_me_one(me, &peers, unclaimed),
                "{:?}", d
            );
            let later = take_next(
                Some(pace(me, 1)),
                &paces,
                unclaimed,
                Duration::from_millis(waited),
            );
            match later {
                // Never leaves after its own item time: an item is never starved.
                Take::Leave { recheck } => {
                    prop_assert!(waited < me);
                    prop_assert!(recheck > Duration::ZERO);
                    prop_assert!(Duration::from_millis(waited) + recheck <= Duration::from_millis(me));
                    // Only to a peer at least 1.5 times as fast.
                    prop_assert!(peers.iter().any(|&(m, w)| w > 0 && m > 0 && 3 * m < 2 * me));
                }
                Take::Claim => {}
            }
            // More unclaimed items never turn a claim into a leave.
            if d == Take::Claim {
                prop_assert_eq!(
                    take_next(Some(pace(me, 1)), &paces, unclaimed + 1, Duration::ZERO),
                    Take::Claim
                );
            }
            // The fastest never leaves.
            if peers.iter().all(|&(m, _)| m >= me) {
                prop_assert_eq!(d, Take::Claim);
            }
        }
    }
}
