//! The plan of one iteration: its tasks (a circular cursor over the task file) and their
//! split across ranks, exactly and deterministically.
//!
//! **Which tasks.** Take the infinite sequence `perm(seed, 0) ++ perm(seed, 1) ++ …`, where
//! `perm(seed, epoch)` is a Fisher–Yates shuffle of the task indices `0..T` driven by
//! splitmix64 from a seed derived (SHA-256) from `(seed, epoch)`. Iteration `i` (1-based)
//! takes positions `[(i-1)·B, i·B)`, B being the budget (tasks per iteration; all `T` when
//! unset). Consecutive iterations therefore walk the whole task set before any task
//! repeats, and iteration `i` is computed from `i` alone, never from earlier iterations.
//! When B exceeds T an iteration spans more than one epoch and the same task may appear
//! twice (or more) in it; that happens only then. Those occurrences carry identical items
//! (same task, same sample numbers, same seeds).
//!
//! **Who does them.** The iteration's B tasks are split across the W ranks by a
//! [`Strategy`]; every task then yields `samples` items (sample `0..M`, consecutive, all on
//! the same rank). Each item carries a seed from [`sample_seed`] and a `state` (the sample
//! number, except for [`Strategy::Rotate`]).
//!
//! Why so strict: the old shell script split 1024 tasks over three equal ranks as
//! `1024 / 3` each and silently dropped one; here every split is an exact partition (the
//! tests check it on random small inputs), and everything is computed with integer
//! arithmetic, a self-contained PRNG and SHA-256, so every platform agrees bit for bit. The
//! [`Plan::fingerprint`] lets nodes check that they agree.

use crate::work::tasks::TaskIds;
use compact_str::CompactString;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// How an iteration's tasks are split across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Counts proportional to the rank weights (largest remainder, ties to the lower
    /// rank); rank r gets the r-th contiguous slice of the iteration's tasks.
    Weighted,
    /// Equal counts (the first `B mod W` ranks get one more), contiguous slices; weights
    /// are ignored.
    Contiguous,
    /// The iteration's k-th task goes to rank `k mod W`; weights are ignored.
    RoundRobin,
    /// Rounds of `Σw` tasks: in each, rank 0 takes `w_0` consecutive tasks, then rank 1
    /// takes `w_1`, …; the last, partial round continues in the same order.
    Interleaved,
    /// Rank r owns the tasks whose file index is `r mod W` and handles one of them per
    /// iteration, cycling through them in file order; the budget and the cursor are
    /// ignored, and `state` counts samples across iterations.
    Rotate,
    /// No split: every item of the iteration goes to a shared pool, in order.
    Dynamic,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [
        Strategy::Weighted,
        Strategy::Contiguous,
        Strategy::RoundRobin,
        Strategy::Interleaved,
        Strategy::Rotate,
        Strategy::Dynamic,
    ];

    /// The name used in configuration and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Weighted => "weighted",
            Strategy::Contiguous => "contiguous",
            Strategy::RoundRobin => "round-robin",
            Strategy::Interleaved => "interleaved",
            Strategy::Rotate => "rotate",
            Strategy::Dynamic => "dynamic",
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub struct PlanInput<'a> {
    /// The task ids, in file order.
    pub tasks: &'a TaskIds,
    /// One weight per rank, all > 0; `weights.len()` is the number of ranks W.
    pub weights: &'a [u64],
    /// Tasks per iteration; `None` = all tasks. Ignored by [`Strategy::Rotate`].
    pub budget: Option<u64>,
    /// Samples per task, >= 1.
    pub samples: u32,
    pub seed: u64,
    /// 1-based.
    pub iteration: u64,
    pub strategy: Strategy,
}

/// Why a [`PlanInput`] cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("there are no tasks to plan")]
    NoTasks,
    #[error("there are no ranks (no weights)")]
    NoRanks,
    #[error("the weight of rank {rank} is 0; every weight must be at least 1")]
    ZeroWeight { rank: usize },
    #[error("the budget is 0 tasks per iteration; it must be at least 1")]
    ZeroBudget,
    #[error("samples per task is 0; it must be at least 1")]
    ZeroSamples,
    #[error("iteration 0 does not exist; iterations count from 1")]
    ZeroIteration,
}

impl PlanInput<'_> {
    /// The preconditions of [`plan`]: at least one task and one rank, every weight, the
    /// budget (when set), the samples and the iteration at least 1.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.tasks.is_empty() {
            return Err(PlanError::NoTasks);
        }
        if self.weights.is_empty() {
            return Err(PlanError::NoRanks);
        }
        if let Some(rank) = self.weights.iter().position(|&w| w == 0) {
            return Err(PlanError::ZeroWeight { rank });
        }
        if self.budget == Some(0) {
            return Err(PlanError::ZeroBudget);
        }
        if self.samples == 0 {
            return Err(PlanError::ZeroSamples);
        }
        if self.iteration == 0 {
            return Err(PlanError::ZeroIteration);
        }
        Ok(())
    }
}

/// One unit of work: one sample of one task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// The task's id; inline up to 24 bytes, so that a plan of every task of a large file
    /// costs no allocation per item.
    pub task: CompactString,
    /// The task's index in the task file (0-based, blank lines not counted).
    pub task_index: usize,
    pub sample: u32,
    /// [`sample_seed`] of (seed, iteration, task id, sample).
    pub seed: u64,
    /// The sample number, except for [`Strategy::Rotate`]: `(iteration-1)·samples + sample`
    /// (wrapping), a circular index so that parallel environments never start from the
    /// same initial state; commands take it modulo their number of states.
    pub state: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub iteration: u64,
    pub strategy: Strategy,
    /// Items of each rank, in plan order (every sample of a task goes to the same rank).
    /// For Dynamic: every rank's list is empty and `pool` holds all items in plan order.
    pub ranks: Vec<Vec<Item>>,
    pub pool: Vec<Item>,
    /// sha256 (hex, 16 chars) of the canonical JSON of (iteration, strategy, ranks, pool).
    pub fingerprint: String,
}

impl Plan {
    /// Whether `fingerprint` is that of the plan's contents (e.g. after reading a plan back).
    pub fn fingerprint_matches(&self) -> bool {
        self.fingerprint == fingerprint(self.iteration, self.strategy, &self.ranks, &self.pool)
    }
}

/// The canonical JSON is the array `[iteration, strategy, ranks, pool]` as serde_json
/// writes it (struct fields in declaration order, no whitespace).
/// Streamed into SHA-256, not held: it is about 100 bytes an item.
fn fingerprint(iteration: u64, strategy: Strategy, ranks: &[Vec<Item>], pool: &[Item]) -> String {
    let mut sha = Sha256::new();
    serde_json::to_writer(
        crate::work::ShaWriter(&mut sha),
        &(iteration, strategy, ranks, pool),
    )
    .expect("json");
    hex::encode(&sha.finalize()[..8])
}

/// The plan of one iteration.
///
/// # Panics
/// When [`PlanInput::validate`] fails; callers holding unchecked input call it first.
pub fn plan(input: &PlanInput) -> Plan {
    if let Err(e) = input.validate() {
        panic!("invalid plan input: {e}");
    }
    let w = input.weights.len();
    let m = input.samples;
    let t = input.tasks.len();
    let items_of = |task_index: usize, state_base: u64, out: &mut Vec<Item>| {
        let task = &input.tasks[task_index];
        for sample in 0..m {
            out.push(Item {
                task: task.into(),
                task_index,
                sample,
                seed: sample_seed(input.seed, input.iteration, task, sample),
                state: state_base.wrapping_add(u64::from(sample)),
            });
        }
    };

    let mut ranks: Vec<Vec<Item>> = vec![Vec::new(); w];
    let mut pool = Vec::new();
    match input.strategy {
        Strategy::Rotate => {
            let base = (input.iteration - 1).wrapping_mul(u64::from(m));
            for (r, items) in ranks.iter_mut().enumerate() {
                if let Some(task_index) = rotate_task(t, w, r, input.iteration) {
                    items_of(task_index, base, items);
                }
            }
        }
        Strategy::Dynamic => {
            let budget = input.budget.unwrap_or(t as u64);
            let order = iteration_tasks(t, budget, input.seed, input.iteration);
            pool.reserve_exact(order.len() * m as usize);
            for task_index in order {
                items_of(task_index, 0, &mut pool);
            }
        }
        strategy => {
            let budget = input.budget.unwrap_or(t as u64);
            let order = iteration_tasks(t, budget, input.seed, input.iteration);
            let assigned = assign(order.len(), input.weights, strategy);
            for (items, positions) in ranks.iter_mut().zip(assigned) {
                items.reserve_exact(positions.len() * m as usize);
                for p in positions {
                    items_of(order[p], 0, items);
                }
            }
        }
    }
    let fingerprint = fingerprint(input.iteration, input.strategy, &ranks, &pool);
    Plan {
        iteration: input.iteration,
        strategy: input.strategy,
        ranks,
        pool,
        fingerprint,
    }
}

/// The task rank `r` of `w` handles in `iteration` under [`Strategy::Rotate`]: position
/// `(iteration-1) mod len` of its list `[r, r+w, r+2w, …] ∩ 0..t`; `None` when the list is
/// empty (`r >= t`).
fn rotate_task(t: usize, w: usize, r: usize, iteration: u64) -> Option<usize> {
    if r >= t {
        return None;
    }
    let len = (t - 1 - r) / w + 1;
    let k = ((iteration - 1) % len as u64) as usize;
    Some(r + k * w)
}

/// The positions (indices into the iteration's task list of length `b`) each rank gets,
/// in order, for the strategies that split a list. Always a partition of `0..b`.
fn assign(b: usize, weights: &[u64], strategy: Strategy) -> Vec<Vec<usize>> {
    let w = weights.len();
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); w];
    let slices = |counts: Vec<u64>, out: &mut Vec<Vec<usize>>| {
        let mut start = 0usize;
        for (r, c) in counts.into_iter().enumerate() {
            let end = start + c as usize;
            out[r].extend(start..end);
            start = end;
        }
        debug_assert_eq!(start, b);
    };
    match strategy {
        Strategy::Weighted => slices(weighted_counts(b as u64, weights), &mut out),
        Strategy::Contiguous => {
            let (q, rem) = (b / w, b % w);
            let counts = (0..w).map(|r| (q + usize::from(r < rem)) as u64).collect();
            slices(counts, &mut out)
        }
        Strategy::RoundRobin => {
            for p in 0..b {
                out[p % w].push(p);
            }
        }
        Strategy::Interleaved => {
            // Cumulative upper bounds of each rank's run inside a round of Σw tasks.
            let mut bounds = Vec::with_capacity(w);
            let mut total: u128 = 0;
            for &x in weights {
                total += u128::from(x);
                bounds.push(total);
            }
            for p in 0..b {
                let offset = p as u128 % total;
                let r = bounds.partition_point(|&end| end <= offset);
                out[r].push(p);
            }
        }
        Strategy::Rotate | Strategy::Dynamic => unreachable!("{strategy} does not split a list"),
    }
    out
}

/// How many of `budget` tasks each rank gets under [`Strategy::Weighted`]: the largest
/// remainder method on `budget·w_r/Σw` (each rank gets the floor of its quota, and the
/// ranks with the largest remainders one more, ties to the lower rank). The counts always
/// sum to `budget`, and each differs from its exact quota by less than one.
///
/// # Panics
/// When `weights` is empty or all zero.
pub fn weighted_counts(budget: u64, weights: &[u64]) -> Vec<u64> {
    let total: u128 = weights.iter().map(|&x| u128::from(x)).sum();
    assert!(total > 0, "weighted_counts needs a positive total weight");
    let b = u128::from(budget);
    let mut counts: Vec<u64> = Vec::with_capacity(weights.len());
    let mut remainders: Vec<(u128, usize)> = Vec::with_capacity(weights.len());
    for (r, &x) in weights.iter().enumerate() {
        let share = b * u128::from(x);
        counts.push((share / total) as u64);
        remainders.push((share % total, r));
    }
    let left = budget - counts.iter().sum::<u64>();
    // Largest remainder first; equal remainders: lower rank first.
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, r) in remainders.iter().take(left as usize) {
        counts[r] += 1;
    }
    counts
}

/// The task indices of `iteration` (1-based), in order, before splitting: positions
/// `[(iteration-1)·budget, iteration·budget)` of the circular cursor
/// `perm(seed, 0) ++ perm(seed, 1) ++ …` over `0..n_tasks` (see the module doc). Empty
/// when `n_tasks` or `budget` is 0. With `budget > n_tasks` a task may appear more than
/// once.
///
/// # Panics
/// When `iteration` is 0.
pub fn iteration_tasks(n_tasks: usize, budget: u64, seed: u64, iteration: u64) -> Vec<usize> {
    assert!(iteration >= 1, "iterations count from 1");
    if n_tasks == 0 || budget == 0 {
        return Vec::new();
    }
    let t = n_tasks as u128;
    let start = u128::from(iteration - 1) * u128::from(budget);
    let end = start + u128::from(budget);
    let mut out = Vec::with_capacity(budget as usize);
    let mut pos = start;
    while pos < end {
        let epoch = pos / t;
        let offset = (pos % t) as usize;
        let take = (end - pos).min(t - offset as u128) as usize;
        let perm = permutation(n_tasks, seed, epoch);
        if out.is_empty() && take == n_tasks {
            // A whole epoch (every task in one iteration): no second copy of a large list.
            out = perm;
        } else {
            out.extend_from_slice(&perm[offset..offset + take]);
        }
        pos += take as u128;
    }
    out
}

/// `perm(seed, epoch)`: a Fisher–Yates shuffle of `0..n` driven by splitmix64, seeded
/// from SHA-256 of `"rl-node/perm/v1\0" ‖ seed (u64 LE) ‖ epoch (u128 LE)`.
fn permutation(n: usize, seed: u64, epoch: u128) -> Vec<usize> {
    let mut h = Sha256::new();
    h.update(b"rl-node/perm/v1\0");
    h.update(seed.to_le_bytes());
    h.update(epoch.to_le_bytes());
    let mut rng = crate::rng::SplitMix64::new(first_u64(&h.finalize()));
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}

fn first_u64(digest: &[u8]) -> u64 {
    u64::from_le_bytes(digest[..8].try_into().expect("a digest has 8 bytes"))
}

/// The seed of one sample: the first 8 bytes (little-endian) of SHA-256 of
/// `"rl-node/sample-seed/v1\0" ‖ seed (u64 LE) ‖ iteration (u64 LE) ‖ len(task) (u64 LE) ‖
/// task (UTF-8) ‖ sample (u32 LE)`.
pub fn sample_seed(seed: u64, iteration: u64, task: &str, sample: u32) -> u64 {
    let mut h = Sha256::new();
    h.update(b"rl-node/sample-seed/v1\0");
    h.update(seed.to_le_bytes());
    h.update(iteration.to_le_bytes());
    h.update((task.len() as u64).to_le_bytes());
    h.update(task.as_bytes());
    h.update(sample.to_le_bytes());
    first_u64(&h.finalize())
}

/// The seed of one iteration, as commands get it in `{seed}`: the first 8 bytes
/// (little-endian) of SHA-256 of `"rl-node/iteration-seed/v1\0" ‖ seed (u64 LE) ‖
/// iteration (u64 LE)`, derived like [`sample_seed`] (its own domain string, so it never
/// equals a sample's seed by construction).
pub fn iteration_seed(seed: u64, iteration: u64) -> u64 {
    let mut h = Sha256::new();
    h.update(b"rl-node/iteration-seed/v1\0");
    h.update(seed.to_le_bytes());
    h.update(iteration.to_le_bytes());
    first_u64(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    // Explicit imports: the prelude's `Strategy` trait would clash with ours.
    use proptest::prelude::{
        any, prop, prop_assert, prop_assert_eq, prop_assert_ne, proptest, Just,
    };
    use proptest::strategy::Strategy as _;
    use std::collections::BTreeMap;

    fn tasks(n: usize) -> TaskIds {
        (0..n).map(|i| format!("t{i}")).collect()
    }

    fn input<'a>(
        tasks: &'a TaskIds,
        weights: &'a [u64],
        budget: Option<u64>,
        samples: u32,
        iteration: u64,
        strategy: Strategy,
    ) -> PlanInput<'a> {
        PlanInput {
            tasks,
            weights,
            budget,
            samples,
            seed: 7,
            iteration,
            strategy,
        }
    }

    /// (task_index, sample, state) of each rank's items.
    fn shape(p: &Plan) -> Vec<Vec<(usize, u32, u64)>> {
        p.ranks
            .iter()
            .map(|items| {
                items
                    .iter()
                    .map(|i| (i.task_index, i.sample, i.state))
                    .collect()
            })
            .collect()
    }

    // --- the split -------------------------------------------------------------------

    #[test]
    fn the_old_scripts_lost_task_is_not_lost() {
        // run.sh gave each of 3 equal ranks 1024 / 3 = 341 tasks: 1023 in all.
        let counts = weighted_counts(1024, &[1, 1, 1]);
        assert_eq!(counts, vec![342, 341, 341]);
        assert_eq!(counts.iter().sum::<u64>(), 1024);
        let ts = tasks(1024);
        let p = plan(&input(&ts, &[1, 1, 1], None, 1, 1, Strategy::Weighted));
        let lens: Vec<usize> = p.ranks.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![342, 341, 341]);
    }

    #[test]
    fn weighted_counts_by_largest_remainder() {
        // 5·(2,1,1)/4 = 2.5, 1.25, 1.25: floors 2,1,1, the one left goes to rank 0.
        assert_eq!(weighted_counts(5, &[2, 1, 1]), vec![3, 1, 1]);
        // Equal remainders: the lower ranks win.
        assert_eq!(weighted_counts(2, &[1, 1, 1]), vec![1, 1, 0]);
        assert_eq!(weighted_counts(1, &[1, 1, 1]), vec![1, 0, 0]);
        // 10·(1,2,3)/6 = 1.67, 3.33, 5: floors 1,3,5, remainders 4,2,0 → rank 0.
        assert_eq!(weighted_counts(10, &[1, 2, 3]), vec![2, 3, 5]);
        // A larger remainder on a higher rank beats a lower rank.
        // 3·(1,3)/4 = 0.75, 2.25 → 1, 2.
        assert_eq!(weighted_counts(3, &[1, 3]), vec![1, 2]);
        assert_eq!(weighted_counts(0, &[1, 2]), vec![0, 0]);
        // Huge weights do not overflow.
        assert_eq!(
            weighted_counts(u64::MAX, &[u64::MAX, u64::MAX]),
            vec![u64::MAX / 2 + 1, u64::MAX / 2]
        );
    }

    #[test]
    fn assign_examples() {
        let a = |b, w: &[u64], s| assign(b, w, s);
        assert_eq!(
            a(7, &[2, 1, 1], Strategy::Weighted),
            // 7·(2,1,1)/4 = 3.5, 1.75, 1.75 → 3,1,1 + 2 left for ranks 1, 2 (remainder 3 > 2).
            vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]]
        );
        assert_eq!(
            a(7, &[5, 1, 1], Strategy::Contiguous),
            vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]]
        );
        assert_eq!(
            a(8, &[1, 1, 1], Strategy::Contiguous),
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]
        );
        assert_eq!(
            a(7, &[2, 1, 1], Strategy::RoundRobin),
            vec![vec![0, 3, 6], vec![1, 4], vec![2, 5]]
        );
        assert_eq!(
            a(11, &[2, 1, 3], Strategy::Interleaved),
            // Rounds of 6: [0 0 1 2 2 2] [0 0 1 2 2].
            vec![vec![0, 1, 6, 7], vec![2, 8], vec![3, 4, 5, 9, 10]]
        );
        // Fewer tasks than ranks.
        assert_eq!(
            a(2, &[1, 1, 1, 1], Strategy::Contiguous),
            vec![vec![0], vec![1], vec![], vec![]]
        );
        assert_eq!(
            a(2, &[1, 1, 1, 1], Strategy::Weighted),
            vec![vec![0], vec![1], vec![], vec![]]
        );
    }

    #[test]
    fn plan_examples_for_each_strategy() {
        let ts = tasks(5);
        let w = [2, 1];
        let order = iteration_tasks(5, 4, 7, 1);
        let o = |k: usize| order[k];
        // weighted: 4·(2,1)/3 = 2.67, 1.33 → 3, 1.
        let p = plan(&input(&ts, &w, Some(4), 2, 1, Strategy::Weighted));
        assert_eq!(
            shape(&p),
            vec![
                vec![
                    (o(0), 0, 0),
                    (o(0), 1, 1),
                    (o(1), 0, 0),
                    (o(1), 1, 1),
                    (o(2), 0, 0),
                    (o(2), 1, 1)
                ],
                vec![(o(3), 0, 0), (o(3), 1, 1)],
            ]
        );
        assert!(p.pool.is_empty());
        let p = plan(&input(&ts, &w, Some(4), 1, 1, Strategy::Contiguous));
        assert_eq!(
            shape(&p),
            vec![
                vec![(o(0), 0, 0), (o(1), 0, 0)],
                vec![(o(2), 0, 0), (o(3), 0, 0)]
            ]
        );
        let p = plan(&input(&ts, &w, Some(4), 1, 1, Strategy::RoundRobin));
        assert_eq!(
            shape(&p),
            vec![
                vec![(o(0), 0, 0), (o(2), 0, 0)],
                vec![(o(1), 0, 0), (o(3), 0, 0)]
            ]
        );
        let p = plan(&input(&ts, &w, Some(4), 1, 1, Strategy::Interleaved));
        assert_eq!(
            shape(&p),
            vec![
                vec![(o(0), 0, 0), (o(1), 0, 0), (o(3), 0, 0)],
                vec![(o(2), 0, 0)]
            ]
        );
        let p = plan(&input(&ts, &w, Some(4), 2, 1, Strategy::Dynamic));
        assert_eq!(p.ranks, vec![Vec::<Item>::new(), Vec::new()]);
        let pool: Vec<(usize, u32)> = p.pool.iter().map(|i| (i.task_index, i.sample)).collect();
        assert_eq!(
            pool,
            vec![
                (o(0), 0),
                (o(0), 1),
                (o(1), 0),
                (o(1), 1),
                (o(2), 0),
                (o(2), 1),
                (o(3), 0),
                (o(3), 1)
            ]
        );
    }

    #[test]
    fn rotate_example() {
        // 5 tasks over 2 ranks: rank 0 owns [0, 2, 4], rank 1 owns [1, 3]. 2 samples.
        let ts = tasks(5);
        let at = |i| shape(&plan(&input(&ts, &[1, 1], Some(1), 2, i, Strategy::Rotate)));
        assert_eq!(
            at(1),
            vec![vec![(0, 0, 0), (0, 1, 1)], vec![(1, 0, 0), (1, 1, 1)]]
        );
        assert_eq!(
            at(2),
            vec![vec![(2, 0, 2), (2, 1, 3)], vec![(3, 0, 2), (3, 1, 3)]]
        );
        assert_eq!(
            at(3),
            vec![vec![(4, 0, 4), (4, 1, 5)], vec![(1, 0, 4), (1, 1, 5)]]
        );
        assert_eq!(
            at(4),
            vec![vec![(0, 0, 6), (0, 1, 7)], vec![(3, 0, 6), (3, 1, 7)]]
        );
        // More ranks than tasks: rank 2 has nothing.
        let ts = tasks(2);
        let p = plan(&input(&ts, &[1, 1, 1], None, 1, 9, Strategy::Rotate));
        assert_eq!(shape(&p), vec![vec![(0, 0, 8)], vec![(1, 0, 8)], vec![]]);
    }

    #[test]
    fn items_carry_ids_and_sample_seeds() {
        let ts = tasks(3);
        let p = plan(&input(&ts, &[1], None, 2, 4, Strategy::Contiguous));
        for item in &p.ranks[0] {
            assert_eq!(item.task, ts[item.task_index]);
            assert_eq!(item.seed, sample_seed(7, 4, &item.task, item.sample));
        }
        assert!(p.fingerprint_matches());
        assert_eq!(p.fingerprint.len(), 16);
        let mut other = p.clone();
        other.ranks[0].swap(0, 1);
        assert!(!other.fingerprint_matches());
        let back: Plan = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert_eq!(
            serde_json::to_string(&Strategy::RoundRobin).unwrap(),
            "\"round-robin\""
        );
    }

    #[test]
    fn sample_seeds_separate_their_inputs() {
        let s = sample_seed(1, 2, "a", 3);
        assert_ne!(s, sample_seed(2, 2, "a", 3));
        assert_ne!(s, sample_seed(1, 3, "a", 3));
        assert_ne!(s, sample_seed(1, 2, "b", 3));
        assert_ne!(s, sample_seed(1, 2, "a", 4));
        // The task is length-prefixed: no ambiguity between the id and what follows.
        assert_ne!(sample_seed(1, 2, "a", 0), sample_seed(1, 2, "a\0", 0));
    }

    /// Pinned outputs: the plan must not change across versions or platforms, or a
    /// restarted node would plan a different iteration than the one it resumes. If this
    /// fails after an intended change, the change breaks resuming runs made before it.
    #[test]
    fn outputs_are_pinned() {
        assert_eq!(sample_seed(42, 1, "task-1", 0), PINNED_SAMPLE_SEED);
        assert_eq!(iteration_seed(42, 1), PINNED_ITERATION_SEED);
        assert_eq!(iteration_tasks(10, 10, 42, 1), PINNED_PERM);
        assert_eq!(iteration_tasks(10, 4, 42, 3), PINNED_WRAP);
    }
    // Cross-checked against an independent implementation (Python: hashlib + the
    // splitmix64 / Lemire / Fisher–Yates steps as documented above).
    const PINNED_SAMPLE_SEED: u64 = 8510437985749027410;
    const PINNED_ITERATION_SEED: u64 = 525683850799873524;
    const PINNED_PERM: [usize; 10] = [4, 3, 9, 8, 5, 2, 0, 1, 7, 6];
    // Positions 8..12: the last two of epoch 0, then the first two of epoch 1.
    const PINNED_WRAP: [usize; 4] = [7, 6, 2, 3];

    #[test]
    fn invalid_input_is_reported() {
        let ts = tasks(3);
        let ok = input(&ts, &[1, 2], Some(2), 1, 1, Strategy::Weighted);
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(
            PlanInput {
                tasks: &TaskIds::default(),
                ..input(&ts, &[1], None, 1, 1, Strategy::Weighted)
            }
            .validate(),
            Err(PlanError::NoTasks)
        );
        assert_eq!(
            input(&ts, &[], None, 1, 1, Strategy::Weighted).validate(),
            Err(PlanError::NoRanks)
        );
        assert_eq!(
            input(&ts, &[1, 0], None, 1, 1, Strategy::Weighted).validate(),
            Err(PlanError::ZeroWeight { rank: 1 })
        );
        assert_eq!(
            input(&ts, &[1], Some(0), 1, 1, Strategy::Weighted).validate(),
            Err(PlanError::ZeroBudget)
        );
        assert_eq!(
            input(&ts, &[1], None, 0, 1, Strategy::Weighted).validate(),
            Err(PlanError::ZeroSamples)
        );
        assert_eq!(
            input(&ts, &[1], None, 1, 0, Strategy::Weighted).validate(),
            Err(PlanError::ZeroIteration)
        );
    }

    #[test]
    #[should_panic(expected = "invalid plan input: the weight of rank 0 is 0")]
    fn plan_panics_on_invalid_input() {
        let ts = tasks(3);
        plan(&input(&ts, &[0], None, 1, 1, Strategy::Weighted));
    }

    // --- the cursor ------------------------------------------------------------------

    #[test]
    fn the_cursor_wraps_into_the_next_epoch() {
        // 5 tasks, budget 3: iteration 2 takes the last 2 of epoch 0 and the first of epoch 1.
        let epoch0 = iteration_tasks(5, 5, 9, 1);
        let epoch1 = iteration_tasks(5, 5, 9, 2);
        assert_eq!(iteration_tasks(5, 3, 9, 1), epoch0[..3]);
        assert_eq!(
            iteration_tasks(5, 3, 9, 2),
            [epoch0[3], epoch0[4], epoch1[0]]
        );
        assert_eq!(iteration_tasks(5, 3, 9, 3), epoch1[1..4]);
        // A budget above the task count spans epochs: tasks repeat within the iteration.
        let big = iteration_tasks(2, 5, 9, 1);
        assert_eq!(big.len(), 5);
        assert_eq!(big[..2], iteration_tasks(2, 2, 9, 1)[..]);
        assert_eq!(big[2..4], iteration_tasks(2, 2, 9, 2)[..]);
        // Degenerate sizes.
        assert!(iteration_tasks(0, 5, 9, 1).is_empty());
        assert!(iteration_tasks(5, 0, 9, 1).is_empty());
        // Far iterations cost one permutation, not a walk from the start.
        assert_eq!(iteration_tasks(3, 1, 9, u64::MAX).len(), 1);
    }

    #[test]
    fn epochs_are_shuffled_differently() {
        let a = iteration_tasks(50, 50, 1, 1);
        let b = iteration_tasks(50, 50, 1, 2);
        let c = iteration_tasks(50, 50, 2, 1);
        assert_ne!(a, b);
        assert_ne!(a, c);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
    }

    // --- properties ------------------------------------------------------------------

    fn static_split() -> impl proptest::strategy::Strategy<Value = Strategy> {
        prop::sample::select(vec![
            Strategy::Weighted,
            Strategy::Contiguous,
            Strategy::RoundRobin,
            Strategy::Interleaved,
        ])
    }

    /// (T, budget ∈ {None} ∪ 1..=T, weights of 1..9 ranks in 1..5, samples 1..4).
    fn sizes() -> impl proptest::strategy::Strategy<Value = (usize, Option<u64>, Vec<u64>, u32)> {
        (1usize..200).prop_flat_map(|t| {
            (
                Just(t),
                prop::option::of(1..=t as u64),
                prop::collection::vec(1u64..5, 1..9),
                1u32..4,
            )
        })
    }

    proptest! {
        /// Every static split except rotate is an exact partition: the ranks' items, taken
        /// together, are the iteration's tasks × samples as a multiset (nothing lost,
        /// nothing doubled, even when a task occurs twice), every task occurrence's samples
        /// 0..M sit consecutively on one rank, and state = sample. The rank counts are
        /// those the strategy promises.
        #[test]
        fn static_splits_partition_the_iteration(
            (t, budget, weights, samples) in sizes(),
            strategy in static_split(),
            seed in any::<u64>(),
            iteration in 1u64..50,
        ) {
            let ts = tasks(t);
            let p = plan(&PlanInput { tasks: &ts, weights: &weights, budget, samples, seed, iteration, strategy });
            let b = budget.unwrap_or(t as u64);
            let order = iteration_tasks(t, b, seed, iteration);
            prop_assert_eq!(order.len() as u64, b);
            prop_assert!(p.pool.is_empty());
            prop_assert_eq!(p.ranks.len(), weights.len());

            let mut expected: BTreeMap<(usize, u32), usize> = BTreeMap::new();
            for &k in &order {
                for s in 0..samples {
                    *expected.entry((k, s)).or_default() += 1;
                }
            }
            let mut got: BTreeMap<(usize, u32), usize> = BTreeMap::new();
            let mut counts = Vec::new();
            for items in &p.ranks {
                prop_assert_eq!(items.len() % samples as usize, 0);
                for chunk in items.chunks(samples as usize) {
                    for (s, item) in chunk.iter().enumerate() {
                        prop_assert_eq!(item.task_index, chunk[0].task_index);
                        prop_assert_eq!(item.sample, s as u32);
                        prop_assert_eq!(item.state, s as u64);
                        prop_assert_eq!(&item.task, &ts[item.task_index]);
                        *got.entry((item.task_index, item.sample)).or_default() += 1;
                    }
                }
                counts.push((items.len() / samples as usize) as u64);
            }
            prop_assert_eq!(got, expected);
            prop_assert_eq!(counts.iter().sum::<u64>(), b);

            let w = weights.len() as u64;
            let total: u64 = weights.iter().sum();
            match strategy {
                Strategy::Weighted => {
                    for (r, &c) in counts.iter().enumerate() {
                        // |c - b·w_r/Σw| < 1
                        let exact = b * weights[r];
                        prop_assert!(c * total + total > exact && exact + total > c * total);
                    }
                }
                Strategy::Contiguous | Strategy::RoundRobin => {
                    for (r, &c) in counts.iter().enumerate() {
                        prop_assert_eq!(c, b / w + u64::from((r as u64) < b % w));
                    }
                }
                Strategy::Interleaved => {
                    for (r, &c) in counts.iter().enumerate() {
                        let before: u64 = weights[..r].iter().sum();
                        let tail = (b % total).saturating_sub(before).min(weights[r]);
                        prop_assert_eq!(c, b / total * weights[r] + tail);
                    }
                }
                _ => unreachable!(),
            }
        }

        /// Same input, same plan (fingerprint included); another seed, another plan.
        #[test]
        fn plans_are_deterministic_and_follow_the_seed(
            (t, budget, weights, samples) in sizes(),
            strategy in prop::sample::select(Strategy::ALL.to_vec()),
            seed in any::<u64>(),
            iteration in 1u64..1000,
        ) {
            let ts = tasks(t);
            let inp = PlanInput { tasks: &ts, weights: &weights, budget, samples, seed, iteration, strategy };
            let a = plan(&inp);
            let b = plan(&inp);
            prop_assert_eq!(&a, &b);
            prop_assert!(a.fingerprint_matches());
            let other = plan(&PlanInput { seed: seed.wrapping_add(1), ..inp });
            prop_assert_ne!(&a.fingerprint, &other.fingerprint);
            prop_assert_ne!(&a, &other);
        }

        /// The cursor. With k = ceil(T/B), iterations 1..=k together are positions
        /// [0, k·B) of the sequence: the first T of them are every task exactly once, the
        /// other k·B − T (< B, zero when B divides T) are the start of the next epoch, so
        /// every task occurs once or twice, and exactly once when B divides T. Also the
        /// chunking is irrelevant: iterations 1..=n with budget B list the same tasks as
        /// iterations 1..=n·B with budget 1.
        #[test]
        fn the_cursor_walks_every_task_before_repeating(
            t in 1usize..200,
            b_raw in any::<prop::sample::Index>(),
            seed in any::<u64>(),
            n in 1u64..4,
        ) {
            let b = b_raw.index(t) as u64 + 1;
            let k = (t as u64).div_ceil(b);
            let walk: Vec<usize> = (1..=k).flat_map(|i| iteration_tasks(t, b, seed, i)).collect();
            prop_assert_eq!(walk.len() as u64, k * b);
            let mut first: Vec<usize> = walk[..t].to_vec();
            first.sort_unstable();
            prop_assert_eq!(first, (0..t).collect::<Vec<_>>());
            let mut occurrences = vec![0u32; t];
            for &x in &walk {
                occurrences[x] += 1;
            }
            prop_assert!(occurrences.iter().all(|&c| c == 1 || c == 2));
            if (t as u64).is_multiple_of(b) {
                prop_assert!(occurrences.iter().all(|&c| c == 1));
            }
            prop_assert_eq!(&walk[t..], &iteration_tasks(t, t as u64, seed, 2)[..walk.len() - t]);

            let chunked: Vec<usize> = (1..=n).flat_map(|i| iteration_tasks(t, b, seed, i)).collect();
            let single: Vec<usize> = (1..=n * b).flat_map(|i| iteration_tasks(t, 1, seed, i)).collect();
            prop_assert_eq!(chunked, single);
        }

        /// Rotate: each rank has at most one task per iteration (exactly one when it owns
        /// any, i.e. r < T), always one of its own (index ≡ r mod W), with all samples and
        /// state (i−1)·M + sample; over iterations 1..=W·len_r the rank walks its list in
        /// file order W times; the budget changes nothing.
        #[test]
        fn rotate_cycles_each_ranks_list(
            t in 1usize..40,
            weights in prop::collection::vec(1u64..5, 1..9),
            samples in 1u32..4,
            budget in prop::option::of(1u64..50),
            seed in any::<u64>(),
        ) {
            let ts = tasks(t);
            let w = weights.len();
            let lists: Vec<Vec<usize>> = (0..w).map(|r| (r..t).step_by(w).collect()).collect();
            let longest = lists.iter().map(Vec::len).max().unwrap() as u64;
            let mut walked: Vec<Vec<usize>> = vec![Vec::new(); w];
            for i in 1..=(w as u64 * longest.max(1)) {
                let inp = PlanInput { tasks: &ts, weights: &weights, budget, samples, seed, iteration: i, strategy: Strategy::Rotate };
                let p = plan(&inp);
                prop_assert_eq!(&p, &plan(&PlanInput { budget: None, ..inp }));
                prop_assert!(p.pool.is_empty());
                for (r, items) in p.ranks.iter().enumerate() {
                    if lists[r].is_empty() {
                        prop_assert!(items.is_empty());
                        continue;
                    }
                    prop_assert_eq!(items.len(), samples as usize);
                    for (s, item) in items.iter().enumerate() {
                        prop_assert_eq!(item.task_index, items[0].task_index);
                        prop_assert_eq!(item.task_index % w, r);
                        prop_assert_eq!(item.sample, s as u32);
                        prop_assert_eq!(item.state, (i - 1) * samples as u64 + s as u64);
                    }
                    walked[r].push(items[0].task_index);
                }
            }
            for r in 0..w {
                let len = lists[r].len();
                if len == 0 {
                    continue;
                }
                let cycles: Vec<usize> = lists[r].iter().copied().cycle().take(w * len).collect();
                prop_assert_eq!(&walked[r][..w * len], &cycles[..]);
            }
        }
    }
}
