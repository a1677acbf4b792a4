//! Surveying what each rank left before anything is read: its committed shard, else the
//! newest generation's partial file, else nothing, plus earlier attempts set aside
//! (`.stale-genG`, older generations' partials) and whether the rank's command wrote its
//! shard name itself (adopted, from the rank's journal).

use super::human_bytes;
use super::{AggregateError, RankEntry, RankStatus};
use crate::layout::Layout;
use crate::store::SharedDir;
use std::collections::BTreeMap;
use std::io;
use std::path::Path;

/// Sorted file names of `dir` (empty when it does not exist).
pub(super) fn list_dir(store: &dyn SharedDir, dir: &Path) -> Result<Vec<String>, AggregateError> {
    let entries = match store.read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(AggregateError::List {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut names: Vec<String> = entries
        .into_iter()
        .filter_map(|n| n.to_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}

/// The journal note of a rank whose rollout command wrote its shard name itself: as its
/// arrival carried it (`known`, the node's merge), else from the rank's journal.
fn adopted_by_command(
    store: &dyn SharedDir,
    layout: &Layout,
    iteration: u64,
    split: &str,
    rank: u32,
    known: Option<&BTreeMap<u32, String>>,
) -> Option<String> {
    if let Some(known) = known {
        return known.get(&rank).cloned();
    }
    let bytes = store
        .read_limited(&layout.journal(rank), crate::store::ReadLimit::Journal)
        .ok()??;
    let text = String::from_utf8_lossy(&bytes);
    crate::protocol::journal::adopted(&crate::protocol::journal::parse(&text), iteration, split)
}

/// Generation G of `<partial>.stale-genG`: an earlier attempt's partial file set aside
/// (`Node::set_aside_earlier`; before partials were generation-specific, at this name).
fn stale_gen_of(name: &str, partial: &str) -> Option<u64> {
    let g = name.strip_prefix(partial)?.strip_prefix(".stale-gen")?;
    g.parse().ok()
}

#[allow(clippy::too_many_arguments)]
/// What `rank` left (its entry), and a partial file beside its committed shard, which
/// the merge ignores (relative to the log path).
pub(super) fn survey(
    store: &dyn SharedDir,
    layout: &Layout,
    iteration: u64,
    split: &str,
    rank: u32,
    listing: &[String],
    shard_listing: &[String],
    adopted: Option<&BTreeMap<u32, String>>,
    rel: &dyn Fn(&Path) -> String,
) -> Result<(RankEntry, Option<String>), AggregateError> {
    let size = |p: &Path| -> Result<Option<u64>, AggregateError> {
        match store.stat(p) {
            Ok(Some(m)) if m.kind == crate::store::Kind::File => Ok(Some(m.len)),
            Ok(None) => Ok(None),
            Ok(Some(_)) => Err(AggregateError::Read {
                rank,
                path: p.to_path_buf(),
                source: io::Error::other("not a regular file"),
            }),
            Err(source) => Err(AggregateError::Read {
                rank,
                path: p.to_path_buf(),
                source,
            }),
        }
    };
    let committed = layout.shard(iteration, split, rank);
    let base = layout.shard_partial(iteration, split, rank);
    let dir = base.parent().map(Path::to_path_buf).unwrap_or_default();
    let partial_name = base
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut stale: Vec<(u64, &String)> = listing
        .iter()
        .filter_map(|n| stale_gen_of(n, &partial_name).map(|g| (g, n)))
        .collect();
    stale.sort();
    let mut set_aside: Vec<String> = stale.iter().map(|(_, n)| rel(&dir.join(n))).collect();
    // A shard committed by an attempt that crashed before journaling it is set aside by the
    // redo (`rank-R.jsonl.stale-genG`): an earlier attempt too, never merged.
    let committed_dir = committed
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let committed_name = committed
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut stale_shards: Vec<(u64, &String)> = shard_listing
        .iter()
        .filter_map(|n| stale_gen_of(n, &committed_name).map(|g| (g, n)))
        .collect();
    stale_shards.sort();
    set_aside.extend(
        stale_shards
            .iter()
            .map(|(_, n)| rel(&committed_dir.join(n))),
    );
    // Each generation writes its own partial file (`rank-R.partial.gG.jsonl`): the newest
    // generation's is this rank's partial; older ones (a node that woke up late) are not.
    let mut by_gen: Vec<(u64, &String)> = listing
        .iter()
        .filter_map(|n| crate::layout::gen_of(n, &partial_name).map(|g| (g, n)))
        .collect();
    by_gen.sort();
    // A partial file the listing shows (one of this generation's, or the old name).
    let partial_listed = !by_gen.is_empty() || listing.contains(&partial_name);
    let partial = match by_gen.pop() {
        Some((_, newest)) => {
            if listing.contains(&partial_name) {
                set_aside.push(rel(&base));
            }
            set_aside.extend(by_gen.iter().map(|(_, n)| rel(&dir.join(n))));
            dir.join(newest)
        }
        None => base,
    };
    let adopted = adopted_by_command(store, layout, iteration, split, rank, adopted);
    let mut problems = Vec::new();
    let mut beside = None;
    let (status, source, source_bytes) = if let Some(n) = size(&committed)? {
        // Beside a committed shard a partial file is only worth a warning: looked at when
        // the listing shows one (a stat per rank and split less in every merge).
        let leftover = match partial_listed {
            true => size(&partial)?,
            false => None,
        };
        if let Some(p) = leftover {
            beside = Some(rel(&partial));
            problems.push(format!(
                "a partial file also exists and was ignored: {} ({})",
                rel(&partial),
                human_bytes(p)
            ));
        }
        (RankStatus::Complete, Some(rel(&committed)), n)
    } else if let Some(n) = size(&partial)? {
        problems.push(format!(
            "only a partial file, {}: the rank's command did not finish",
            rel(&partial)
        ));
        (RankStatus::Partial, Some(rel(&partial)), n)
    } else {
        problems.push(format!(
            "missing: neither {} nor {} exists",
            rel(&committed),
            partial.file_name().unwrap().to_string_lossy()
        ));
        (RankStatus::Missing, None, 0)
    };
    if status != RankStatus::Complete && !set_aside.is_empty() {
        problems.push(format!(
            "earlier attempts set aside (not merged): {}",
            set_aside.join(", ")
        ));
    }
    let entry = RankEntry {
        adopted: adopted.filter(|_| status == RankStatus::Complete),
        source,
        source_bytes,
        set_aside,
        problems,
        ..RankEntry::new(rank, status)
    };
    Ok((entry, beside))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rank-R.jsonl` → (R, false), `rank-R.partial.jsonl` → (R, true) (canonical decimal R
    /// only), in the default layout.
    fn shard_name_rank(name: &str) -> Option<(u32, bool)> {
        crate::shards::naming::Naming::default().rank_of(name, 1, "train", true, true)
    }

    /// Generation G of `rank-R.partial.jsonl.stale-genG` for this rank, in the default layout.
    fn stale_gen(name: &str, rank: u32) -> Option<u64> {
        stale_gen_of(name, &format!("rank-{rank}.partial.jsonl"))
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_name_rank("rank-3.jsonl"), Some((3, false)));
        assert_eq!(shard_name_rank("rank-12.partial.jsonl"), Some((12, true)));
        assert_eq!(shard_name_rank("rank-03.jsonl"), None);
        assert_eq!(shard_name_rank("rank-1.partial.jsonl.stale-gen2"), None);
        assert_eq!(stale_gen("rank-1.partial.jsonl.stale-gen12", 1), Some(12));
        assert_eq!(stale_gen("rank-1.partial.jsonl.stale-gen12", 2), None);
    }
}
