//! What the simulated server truly did, held against what the nodes concluded from their
//! views of it: every death a node declared, against how long the peer's record truly
//! stood still (issue: "every death declaration against the peer's true silence and
//! dead-after"). The driver scenarios (`nodes`, `data`, `items`, `dynamic`, `pipeline`)
//! keep the server's history of rank records and aborts ([`keep`]) and check every
//! abort for a dead peer at the end of a seed ([`check_deaths`]).

use rl_node::layout::Layout;
use rl_node::store::sim::SimWorld;
use std::path::Path;
use std::time::Duration;

/// Keep the history of the names this check reads: every rank record and every abort.
pub(crate) fn keep(world: &SimWorld) {
    world.keep_history(|path| {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        name == "abort.json" || (name.starts_with("rank-") && name.ends_with(".json"))
    });
}

/// How the nodes of a seed judge: dead-after, and the longest a client's cache may hide a
/// peer's newest write (its attribute cache, or a FUSE mount's entry cache).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Judging {
    pub dead_after: Duration,
    pub stale: Duration,
}

/// Every abort for a dead peer in the generations of `clusters` (each a cluster's layout:
/// one, or a pipelined run's two), held against the server's history: before the abort
/// was created, the peer's record must have gone unwritten for dead-after less what a
/// cache can hide. The number of deaths checked, or the first that breaks it.
///
/// A correct judge counts a peer's silence from the first look that found its newest
/// sequence number to its last look, and declares it only past dead-after of its own
/// clock (within 1 % of true time here). Its cache may hide writes made within `stale`
/// of a look, so what it saw still for dead-after was truly unwritten for at least
/// dead-after − `stale`, within the stretch that ends `stale` before the abort. The check
/// allows that, and a 2 % margin for clock rates.
pub(crate) fn check_deaths(
    world: &SimWorld,
    clusters: &[Layout],
    judging: Judging,
) -> Result<u64, String> {
    let mut deaths = 0;
    for layout in clusters {
        let own = layout.cluster_name().unwrap_or_default();
        for gen in 1..=current_gen(world, layout) {
            let path = layout.abort(gen);
            let Some(abort) = read(world, &path) else {
                continue;
            };
            let reason = abort["reason"].as_str().unwrap_or_default();
            if !reason.starts_with("heartbeat still for") {
                continue;
            }
            let Some(&created) = world.history(&path).first() else {
                return Err(format!("{} has no history", path.display()));
            };
            let culprit = abort["culprit"].as_u64().unwrap_or(u64::MAX) as u32;
            let of = abort["cluster"].as_str().unwrap_or(own);
            // The culprit's record in this generation, or for another cluster's rank
            // (its rank 0 judged while this cluster waited on it, or an abort adopted
            // from it), in any generation of that cluster.
            let records: Vec<_> = if of == own {
                vec![layout.rank_record(gen, culprit)]
            } else {
                let theirs = layout
                    .other_cluster()
                    .filter(|o| o.cluster_name() == Some(of))
                    .ok_or_else(|| format!("{} names cluster {of}", path.display()))?;
                (1..=current_gen(world, &theirs))
                    .map(|g| theirs.rank_record(g, culprit))
                    .collect()
            };
            let end = created.saturating_sub(judging.stale);
            let longest = records
                .iter()
                .map(|r| longest_unwritten(&world.history(r), end))
                .max()
                .unwrap_or_default();
            let Some(longest) = longest else {
                // Never written before then: nothing a judge could have watched.
                continue;
            };
            let required = judging
                .dead_after
                .saturating_sub(judging.stale)
                .saturating_sub(judging.dead_after / 50);
            deaths += 1;
            if longest < required {
                return Err(format!(
                    "{} (created at {created:?}) declares {}'s rank {culprit} on {} dead ({reason}), but its record was never unwritten for longer than {longest:?} before (dead-after {:?}, caches hide up to {:?})",
                    path.display(),
                    if of.is_empty() { "the cluster" } else { of },
                    abort["culprit_host"].as_str().unwrap_or_default(),
                    judging.dead_after,
                    judging.stale
                ));
            }
        }
    }
    Ok(deaths)
}

/// The longest stretch, ending by `end`, between writes of `writes` (in order), from the
/// first write on; `None` when there was none by `end`.
fn longest_unwritten(writes: &[Duration], end: Duration) -> Option<Duration> {
    let before: Vec<_> = writes.iter().copied().take_while(|w| *w <= end).collect();
    let first = *before.first()?;
    let mut longest = Duration::ZERO;
    let mut last = first;
    for w in before.into_iter().skip(1).chain(std::iter::once(end)) {
        longest = longest.max(w.saturating_sub(last));
        last = w;
    }
    Some(longest)
}

fn current_gen(world: &SimWorld, layout: &Layout) -> u64 {
    read(world, &layout.cluster())
        .and_then(|c| c["gen"].as_u64())
        .unwrap_or(0)
}

fn read(world: &SimWorld, path: &Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&world.content(path)?).ok()
}

#[test]
fn the_longest_stretch_counts_up_to_the_end_and_from_the_first_write() {
    let s = Duration::from_secs;
    assert_eq!(longest_unwritten(&[], s(10)), None);
    assert_eq!(longest_unwritten(&[s(11)], s(10)), None);
    assert_eq!(longest_unwritten(&[s(1), s(2), s(9)], s(10)), Some(s(7)));
    assert_eq!(longest_unwritten(&[s(1), s(2), s(3)], s(10)), Some(s(7)));
    assert_eq!(longest_unwritten(&[s(1), s(2), s(30)], s(10)), Some(s(8)));
}
