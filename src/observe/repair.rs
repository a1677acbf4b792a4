//! `rl-node recover` on damaged state: what is wrong with each of the run's own state files,
//! how it can be repaired, and (`--repair`) the repair itself.
//!
//! Repairs never delete: a damaged file or line is moved to a side file
//! (`<file>.damaged-<time>`) next to it, and what is rebuilt is rebuilt from evidence the
//! run wrote itself: `cluster.json` from the copy each generation writes into its
//! directory (`gen-G/cluster.json`), lost journal entries from the other journals and the
//! history (an iteration every rank must have completed), marked with a note saying so.

use crate::layout::Layout;
use crate::protocol::journal::{Entry, Tail};
use crate::protocol::{ClusterRecord, RankRecord, PROTO};
use crate::state::{self, HistoryEntry, StateError};
use crate::store::SharedDir;
use std::path::{Path, PathBuf};

/// One problem and what `--repair` does about it (`None`: it cannot; the message says
/// what to do instead).
pub struct Problem {
    pub what: String,
    pub repair: Option<Repair>,
    /// A restart copes with it by itself (an unfinished last line, set aside by its
    /// writer): reported, but not a reason to refuse or to withhold the report.
    pub tolerated: bool,
}

pub enum Repair {
    /// Replace `cluster.json` (set aside if present) by a generation's copy.
    RebuildCluster { from: PathBuf },
    /// Move a damaged record aside; the restart treats the generation as ended.
    SetAside { path: PathBuf },
    /// Move the lines of a JSON-lines file that cannot be read (and an unfinished last
    /// line) to a side file.
    DropBadLines { path: PathBuf, kind: LinesKind },
    /// Append rebuilt completion entries to a rank's journal.
    RebuildJournal { rank: u32, entries: Vec<Entry> },
    /// Point a missing or damaged `models/LATEST` (set aside if present) at the checkpoint
    /// a restart falls back to.
    PointLatest { checkpoint: PathBuf },
}

#[derive(Clone, Copy)]
pub enum LinesKind {
    Journal,
    History,
}

impl Repair {
    pub fn describe(&self, root: &Path) -> String {
        let rel = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
        match self {
            Repair::RebuildCluster { from } => format!(
                "rebuild .rl-node/cluster.json from {} (the damaged file, if any, is kept next to it)",
                rel(from)
            ),
            Repair::SetAside { path } => format!(
                "set {} aside (kept next to it as .damaged-<time>); the restart treats its generation as ended",
                rel(path)
            ),
            Repair::DropBadLines { path, .. } => format!(
                "move the lines of {} that cannot be read to a side file next to it (.damaged-<time>), keeping every good line",
                rel(path)
            ),
            Repair::RebuildJournal { rank, entries } => format!(
                "append {} rebuilt completion entr{} to rank {rank}'s journal (iterations {}), each marked as rebuilt from the evidence",
                entries.len(),
                if entries.len() == 1 { "y" } else { "ies" },
                iterations(entries)
            ),
            Repair::PointLatest { checkpoint } => format!(
                "point models/LATEST at {} (a damaged LATEST is kept next to it as .damaged-<time>)",
                checkpoint.file_name().unwrap_or_default().to_string_lossy()
            ),
        }
    }
}

fn iterations(entries: &[Entry]) -> String {
    match (entries.first(), entries.last()) {
        (Some(a), Some(b)) if a.iteration != b.iteration => {
            format!("{}-{}", a.iteration, b.iteration)
        }
        (Some(a), _) => a.iteration.to_string(),
        _ => String::new(),
    }
}

/// The newest generation copy of the cluster record that parses, if any.
fn newest_copy(layout: &Layout) -> Option<(PathBuf, ClusterRecord)> {
    let mut gens: Vec<u64> = std::fs::read_dir(layout.state_dir())
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("gen-")?.parse().ok())
        .collect();
    gens.sort_unstable_by(|a, b| b.cmp(a));
    gens.into_iter().find_map(|g| {
        let p = layout.gen_cluster(g);
        match crate::store::fs::read_strict::<ClusterRecord>(&p) {
            Ok(Some(c)) if c.proto == PROTO => Some((p, c)),
            _ => None,
        }
    })
}

/// What `recover` finds in the run's state before it reports on it.
pub struct Diagnosis {
    /// Everything wrong with the run's state.
    pub problems: Vec<Problem>,
    /// The cluster record to judge the rest by (the real one, or the one a repair would
    /// rebuild); `None` when there is none.
    pub cluster: Option<ClusterRecord>,
    /// `models/LATEST` as a restart resolves it ([`resolve_latest`]), as the state stands:
    /// the report's answer too unless a repair changes the state. `None`: not resolved
    /// (there is no cluster record to resolve it by).
    pub latest: Option<Option<crate::checkpoint::Latest>>,
}

/// Everything wrong with the run's state at `layout` (see [`Diagnosis`]). `None`: no run
/// at all. The run's own `[limits]` are used from the record on, as its nodes use them.
pub fn diagnose(layout: &Layout) -> Option<Diagnosis> {
    let mut problems = Vec::new();
    let cluster = match state::read_cluster(&crate::store::Fs, layout) {
        Ok(Some(c)) => Some(c),
        Ok(None) => return None,
        Err(e @ StateError::OtherProto { .. }) => {
            problems.push(Problem {
                tolerated: false,
                what: format!("{e}; {}", e.hint(layout.root())),
                repair: None,
            });
            return Some(Diagnosis {
                problems,
                cluster: None,
                latest: None,
            });
        }
        Err(e) => match newest_copy(layout) {
            Some((from, c)) => {
                problems.push(Problem {
                    tolerated: false,
                    what: e.to_string(),
                    repair: Some(Repair::RebuildCluster { from }),
                });
                Some(c)
            }
            None => {
                problems.push(Problem {
                    tolerated: false,
                    what: format!(
                        "{e}; no generation directory holds a copy to rebuild it from (runs started by an older rl-node have none): add --fresh to rank 0 to set the run aside (nothing is deleted) and start a new one"
                    ),
                    repair: None,
                });
                None
            }
        },
    };
    let Some(c) = cluster.clone() else {
        return Some(Diagnosis {
            problems,
            cluster,
            latest: None,
        });
    };
    super::use_run_limits(&c);
    let r0 = layout.rank_record(c.gen, 0);
    if let Err(e) = crate::store::fs::read_strict::<RankRecord>(&r0) {
        problems.push(Problem {
            tolerated: false,
            what: e.to_string(),
            repair: Some(Repair::SetAside { path: r0 }),
        });
    }
    let (history, problem) = lines_problem::<HistoryEntry>(&layout.history(), LinesKind::History);
    problems.extend(problem);
    let mut journals: Vec<Vec<Entry>> = Vec::new();
    for r in 0..c.num_nodes {
        let (entries, problem) = lines_problem::<Entry>(&layout.journal(r), LinesKind::Journal);
        problems.extend(problem);
        journals.push(entries);
    }
    let walk = walk_of(&c);
    // After elastic mode dropped ranks, the last generation's members are the run.
    let ranks: Vec<u32> = c.members().ranks().to_vec();
    let members_journals: Vec<Vec<Entry>> = ranks
        .iter()
        .map(|&r| journals[r as usize].clone())
        .collect();
    for e in state::lost_journals(
        &crate::store::Fs,
        layout,
        &ranks,
        &members_journals,
        &history,
        &c.run_id,
        &walk,
    ) {
        let StateError::LostJournal { rank, .. } = &e else {
            continue;
        };
        let rank = *rank;
        let (mut floor, mut why) =
            state::evidence_floor(&ranks, &members_journals, &history, &c.run_id, &walk);
        // A walk that ends at the final-sync barrier journals its completion only after
        // every rank passed that barrier, i.e. finished the iteration's work: another
        // rank's completion of N proves this rank's, not just N − 1's. Rebuilding only up to
        // N − 1 would redo this rank's committed rollout of N and everyone's training.
        if walk_ends_at_final_sync(&c) {
            for (r, j) in journals.iter().enumerate() {
                let n = crate::protocol::journal::last_complete(j, &c.run_id, &walk);
                if r as u32 != rank && n > floor {
                    floor = n;
                    why = format!(
                        "rank {r} completed iteration {n}, which it journals only after every rank passed that iteration's final-sync barrier"
                    );
                }
            }
        }
        let last =
            crate::protocol::journal::last_complete(&journals[rank as usize], &c.run_id, &walk);
        let entries = (last + 1..=floor)
            .map(|iteration| Entry {
                run_id: c.run_id.clone(),
                gen: c.gen,
                rank,
                iteration,
                item: walk.clone(),
                at: crate::clock::wall_now(),
                note: Some(format!("rebuilt by rl-node recover --repair: {why}")),
                failed: None,
                checkpoint: None,
            })
            .collect();
        problems.push(Problem {
            tolerated: false,
            what: e.to_string(),
            repair: Some(Repair::RebuildJournal { rank, entries }),
        });
    }
    let rank_0: Vec<Entry> = journals
        .first()
        .map(|j| j.iter().filter(|e| e.run_id == c.run_id).cloned().collect())
        .unwrap_or_default();
    let latest = resolve_latest(layout, &c, &rank_0);
    problems.extend(latest.as_ref().and_then(|l| latest_problem(&c, l)));
    Some(Diagnosis {
        problems,
        cluster,
        latest: Some(latest),
    })
}

/// `models/LATEST` as a restart resolves it, with rank 0's journal entries of the run
/// (`rank_0`) as evidence; `None` for a rollout-only cluster, which hands nothing off.
pub fn resolve_latest(
    layout: &Layout,
    c: &ClusterRecord,
    rank_0: &[Entry],
) -> Option<crate::checkpoint::Latest> {
    if rl_phase_of(c) == crate::config::RlPhase::Rollout {
        return None;
    }
    let check = c.config["phases"]["handoff"]["verify"]
        .as_str()
        .and_then(crate::checkpoint::Check::parse)
        .unwrap_or_default();
    let journaled = crate::checkpoint::Journaled::from_journal(rank_0, &walk_of(c));
    Some(crate::checkpoint::latest_as(
        &crate::store::Fs,
        &layout.models(),
        check,
        &journaled,
        &mut || {},
    ))
}

/// A restart that falls back from a missing or damaged `models/LATEST` to a verified
/// checkpoint copes by itself (tolerated; `--repair` points `LATEST` there); one that
/// would have to stop instead is damage no repair can undo.
fn latest_problem(c: &ClusterRecord, latest: &crate::checkpoint::Latest) -> Option<Problem> {
    let base = c.config["cluster"]["model"].as_str().unwrap_or_default();
    if let Some(reason) = latest.stop(base) {
        return Some(Problem {
            what: format!("a restart stops: {reason}"),
            repair: None,
            tolerated: false,
        });
    }
    let crate::checkpoint::Latest::Damaged {
        fallback: Ok(p), ..
    } = latest
    else {
        return None;
    };
    Some(Problem {
        what: format!(
            "{} (a restart does so by itself; --repair points models/LATEST at it)",
            latest.warning(base).unwrap_or_default()
        ),
        repair: Some(Repair::PointLatest {
            checkpoint: p.clone(),
        }),
        tolerated: true,
    })
}

/// The `cluster.rl-phase` recorded in a cluster record's configuration (`both` where it
/// has none that parses: the default).
fn rl_phase_of(c: &ClusterRecord) -> crate::config::RlPhase {
    serde_json::from_value(c.config["cluster"]["rl-phase"].clone())
        .unwrap_or(crate::config::RlPhase::Both)
}

/// The walk's completion item recorded in a cluster record's configuration.
pub fn walk_of(c: &ClusterRecord) -> String {
    let split = serde_json::from_value(c.config["cluster"]["rollout-split"].clone())
        .unwrap_or(crate::config::RolloutSplit::All);
    crate::config::walk_item(rl_phase_of(c), split)
}

/// Whether the walk recorded in a cluster record ends with the final-sync barrier (every
/// walk but a rollout-only one, which ends with each rank's own eval).
fn walk_ends_at_final_sync(c: &ClusterRecord) -> bool {
    crate::protocol::phase::Phase::walk(rl_phase_of(c)).last()
        == Some(&crate::protocol::phase::Phase::FinalSync)
}

/// The entries of a JSON-lines file that parse (to judge the rest by), and its problem:
/// any unreadable line, or a torn last one.
fn lines_problem<T: serde::de::DeserializeOwned>(
    path: &Path,
    kind: LinesKind,
) -> (Vec<T>, Option<Problem>) {
    let strict = state::read_lines::<T>(&crate::store::Fs, path).map(|l| l.tail);
    let text = crate::store::fs::read_file(path, crate::store::ReadLimit::Journal)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let good: Vec<T> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let problem = match strict {
        Ok(Tail::Clean) => None,
        Ok(Tail::Torn(f)) => Some(Problem {
            tolerated: true,
            what: format!(
                "{} (tolerated: its writer sets it aside at its next start)",
                state::torn_note(path, &f)
            ),
            repair: Some(Repair::DropBadLines {
                path: path.to_path_buf(),
                kind,
            }),
        }),
        Err(e) => Some(Problem {
            tolerated: false,
            what: e.to_string(),
            repair: Some(Repair::DropBadLines {
                path: path.to_path_buf(),
                kind,
            }),
        }),
    };
    (good, problem)
}

fn stamp() -> String {
    chrono::Local::now()
        .format("damaged-%Y%m%dT%H%M%S")
        .to_string()
}

/// A file a repair replaces, kept next to it as `.damaged-<time>` if anything is there
/// (even a dangling link, which the replacement would otherwise drop); the note saying
/// where it went, or nothing.
fn set_aside_damaged(
    store: &dyn SharedDir,
    layout: &Layout,
    path: &Path,
) -> Result<String, String> {
    let aside = state::set_aside(store, path, &stamp())
        .map_err(|e| format!("cannot move {}: {e}", path.display()))?;
    Ok(aside
        .map(|a| {
            let rel = a.strip_prefix(layout.root()).unwrap_or(&a);
            format!(" (the damaged one is {})", rel.display())
        })
        .unwrap_or_default())
}

/// Carry out one repair; says what it did.
pub fn apply(store: &dyn SharedDir, layout: &Layout, repair: &Repair) -> Result<String, String> {
    let rel = |p: &Path| {
        p.strip_prefix(layout.root())
            .unwrap_or(p)
            .display()
            .to_string()
    };
    match repair {
        Repair::RebuildCluster { from } => {
            let target = layout.cluster();
            let note = set_aside_damaged(store, layout, &target)?;
            let bytes = crate::store::fs::read_file(from, crate::store::ReadLimit::Record)
                .map_err(|e| format!("cannot read {}: {e}", from.display()))?;
            store
                .publish(&target, &bytes)
                .map_err(|e| format!("cannot write {}: {e}", target.display()))?;
            Ok(format!(
                "rebuilt .rl-node/cluster.json from {}{note}",
                rel(from)
            ))
        }
        Repair::SetAside { path } => {
            let aside = state::side_path(store, path, &stamp());
            store
                .rename(path, &aside)
                .map_err(|e| format!("cannot move {}: {e}", path.display()))?;
            Ok(format!("set {} aside as {}", rel(path), rel(&aside)))
        }
        Repair::DropBadLines { path, kind } => {
            let text = crate::store::fs::read_file(path, crate::store::ReadLimit::Journal)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let text = String::from_utf8_lossy(&text).into_owned();
            let ok = |l: &str| match kind {
                LinesKind::Journal => crate::json::parse_strict::<Entry>(l.as_bytes()).is_ok(),
                LinesKind::History => {
                    crate::json::parse_strict::<HistoryEntry>(l.as_bytes()).is_ok()
                }
            };
            let (mut keep, mut drop) = (String::new(), String::new());
            let complete = text.ends_with('\n');
            let lines: Vec<&str> = text.lines().collect();
            for (i, l) in lines.iter().enumerate() {
                let last_unterminated = i + 1 == lines.len() && !complete;
                if l.trim().is_empty() {
                    continue;
                }
                if ok(l) {
                    keep.push_str(l);
                    keep.push('\n');
                } else {
                    drop.push_str(&format!(
                        "line {}{}: {l}\n",
                        i + 1,
                        if last_unterminated {
                            " (unfinished)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            let aside = state::side_path(store, path, &stamp());
            store
                .publish(&aside, drop.as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", aside.display()))?;
            store
                .publish(path, keep.as_bytes())
                .map_err(|e| format!("cannot rewrite {}: {e}", path.display()))?;
            Ok(format!(
                "moved {} unreadable line(s) of {} to {}",
                drop.lines().count(),
                rel(path),
                rel(&aside)
            ))
        }
        Repair::RebuildJournal { rank, entries } => {
            let path = layout.journal(*rank);
            let mut text = crate::store::fs::read_text(&path, crate::store::ReadLimit::Journal)
                .unwrap_or_default();
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            for e in entries {
                text.push_str(&serde_json::to_string(e).expect("json"));
                text.push('\n');
            }
            store
                .publish(&path, text.as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(format!(
                "appended rebuilt completion entries for iteration(s) {} to {}",
                iterations(entries),
                rel(&path)
            ))
        }
        Repair::PointLatest { checkpoint } => {
            let pointer = layout.latest();
            let note = set_aside_damaged(store, layout, &pointer)?;
            let name = checkpoint.file_name().unwrap_or_default().to_string_lossy();
            store
                .publish(&pointer, format!("{name}\n").as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", pointer.display()))?;
            Ok(format!("models/LATEST now names {name}{note}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A rebuild replaces `cluster.json` and keeps what was there, even a dangling link,
    /// which the replacement would otherwise drop.
    #[test]
    fn a_rebuild_keeps_a_dangling_link_at_cluster_json_aside() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let from = layout.gen_cluster(3);
        fs::create_dir_all(from.parent().unwrap()).unwrap();
        fs::write(&from, b"{\"copy\": true}\n").unwrap();
        let target = layout.cluster();
        std::os::unix::fs::symlink(dir.path().join("gone"), &target).unwrap();
        let did = apply(&crate::store::Fs, &layout, &Repair::RebuildCluster { from }).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"{\"copy\": true}\n");
        let aside: Vec<PathBuf> = fs::read_dir(target.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("cluster.json.damaged-"))
            .collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
        assert_eq!(fs::read_link(&aside[0]).unwrap(), dir.path().join("gone"));
        let rel = aside[0].strip_prefix(dir.path()).unwrap().display();
        assert!(
            did.ends_with(&format!("(the damaged one is {rel})")),
            "{did}"
        );
    }
}
