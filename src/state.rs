//! The run's own state, read strictly: `.rl-node/cluster.json`, the rank journals and
//! `history.jsonl`.
//!
//! These files are how a restart knows what was done. Reading them leniently (a damaged
//! file taken for a missing one) is how a run gets silently replaced by a new one, so
//! here a file is either valid, missing, or an error that names it and says what is
//! wrong. The one damage a crash can cause by itself — an append cut short, leaving an
//! unfinished last line — is tolerated and reported; the writer sets the fragment aside
//! (`<file>.torn-genG`) before its next append, so that append starts on a new line.
//!
//! Journals are also checked against each other and against the history: a rank cannot
//! have completed iteration N unless every rank completed N − 1 (iteration N has barriers
//! every rank passes only after journaling N − 1), and a generation that resumed at
//! iteration R saw every rank complete R − 1. A journal with less than that was lost or
//! truncated; redoing its work silently would duplicate trajectories, so it is an error.

use crate::layout::Layout;
use crate::protocol::journal::{self, BadLine, Entry, Lines, Tail};
use crate::protocol::{ClusterRecord, PROTO};
use crate::store::{self, SharedDir};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One line of `.rl-node/history.jsonl`: a start of the cluster (a generation), or a
/// `recover --discard-iteration` that set iterations aside.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HistoryEntry {
    #[serde(default)]
    pub gen: u64,
    pub run_id: String,
    #[serde(default)]
    pub started_at: String,
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub pid: u32,
    /// The iteration the generation began at: every rank had completed the one before.
    #[serde(default)]
    pub resume_iteration: u64,
    #[serde(default)]
    pub previous: Option<String>,
    /// The walk's completion item (`Config::walk_item`) the resume iteration refers to.
    #[serde(default)]
    pub walk: String,
    /// Set by `recover --discard-iteration N`: iterations N and later were set aside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discarded_from: Option<u64>,
}

/// Why the run's state cannot be used as it is. Each names the file at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("{0}")]
    Damaged(#[from] store::Damaged),
    #[error("{path} was written by protocol version {found} of rl-node; this rl-node speaks version {ours}", path = .path.display())]
    OtherProto {
        path: PathBuf,
        found: u64,
        ours: u32,
    },
    #[error("{path} is missing, but the run's journals and history record committed work ({evidence})", path = .path.display())]
    MissingCluster { path: PathBuf, evidence: String },
    #[error("{path} is damaged at line {line}: {what} (line: {text})", path = .path.display())]
    BadLine {
        path: PathBuf,
        line: usize,
        what: String,
        text: String,
    },
    #[error("rank {rank}'s journal {path} is {state}, but {evidence}: its work would be redone and duplicated", path = .path.display())]
    LostJournal {
        rank: u32,
        path: PathBuf,
        /// "missing", "empty" or "complete only up to iteration N".
        state: String,
        evidence: String,
    },
}

impl StateError {
    /// What the user can do about it.
    pub fn hint(&self, log_path: &Path) -> String {
        let dir = log_path.display();
        match self {
            StateError::OtherProto { .. } => "finish this run with the rl-node version that started it, or start a new run in this directory with --fresh on rank 0 (the old run's files are moved to previous-runs/, nothing is deleted)".to_string(),
            _ => format!(
                "`rl-node recover --log-path {dir}` explains what is wrong and how to repair it (`--repair`); or add --fresh to rank 0 to set the run aside (nothing is deleted) and start a new one"
            ),
        }
    }
}

/// The cluster record, strictly: missing is `Ok(None)` only when nothing else says a run
/// exists; another protocol version and any damage are errors.
pub fn read_cluster(
    store: &dyn SharedDir,
    layout: &Layout,
) -> Result<Option<ClusterRecord>, StateError> {
    let path = layout.cluster();
    let bytes = match store.read(&path) {
        Ok(Some(b)) => b,
        Ok(None) => {
            return match run_evidence(store, layout) {
                Some(evidence) => Err(StateError::MissingCluster { path, evidence }),
                None => Ok(None),
            }
        }
        Err(e) => {
            return Err(store::Damaged {
                path,
                what: format!("it cannot be read: {e}"),
            }
            .into())
        }
    };
    // The version first, so that an upgrade is named as such and not as "wrong shape".
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
        if let Some(found) = v.get("proto").and_then(|p| p.as_u64()) {
            if found != PROTO as u64 {
                return Err(StateError::OtherProto {
                    path,
                    found,
                    ours: PROTO,
                });
            }
        }
    }
    crate::json::parse_strict::<ClusterRecord>(&bytes)
        .map(Some)
        .map_err(|what| store::Damaged { path, what }.into())
}

/// What in the directory says a run committed work, if anything: non-empty journals or
/// history. (Generation directories alone hold only live records.)
pub fn run_evidence(store: &dyn SharedDir, layout: &Layout) -> Option<String> {
    let mut found = Vec::new();
    let non_empty = |p: &Path| store.stat(p).ok().flatten().is_some_and(|m| m.len > 0);
    if non_empty(&layout.history()) {
        found.push(layout.history().display().to_string());
    }
    let dir = layout.journal(0);
    let dir = dir.parent().expect("journal dir");
    if let Ok(names) = store.read_dir(dir) {
        let mut journals: Vec<String> = names
            .into_iter()
            .filter(|n| n.to_string_lossy().ends_with(".jsonl"))
            .map(|n| dir.join(n))
            .filter(|p| store.lstat(p).ok().flatten().is_some_and(|m| m.len > 0))
            .map(|p| p.display().to_string())
            .collect();
        journals.sort();
        found.extend(journals);
    }
    (!found.is_empty()).then(|| found.join(", "))
}

/// Read a JSON-lines state file strictly (missing: empty).
pub fn read_lines<T: serde::de::DeserializeOwned>(
    store: &dyn SharedDir,
    path: &Path,
) -> Result<Lines<T>, StateError> {
    let text = match store.read_limited(path, store::ReadLimit::Journal) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(Lines::default()),
        Err(e) => {
            return Err(store::Damaged {
                path: path.to_path_buf(),
                what: format!("it cannot be read: {e}"),
            }
            .into())
        }
    };
    let text = String::from_utf8(text).map_err(|e| store::Damaged {
        path: path.to_path_buf(),
        what: format!(
            "it is not UTF-8 text (byte {})",
            e.utf8_error().valid_up_to()
        ),
    })?;
    journal::parse_lines(&text).map_err(|b: BadLine| StateError::BadLine {
        path: path.to_path_buf(),
        line: b.line,
        what: b.what,
        text: b.text,
    })
}

pub fn read_history(
    store: &dyn SharedDir,
    layout: &Layout,
) -> Result<Lines<HistoryEntry>, StateError> {
    read_lines(store, &layout.history())
}

/// Every rank's journal (`num_nodes` of them), strictly.
pub fn read_journals(
    store: &dyn SharedDir,
    layout: &Layout,
    num_nodes: u32,
) -> Result<Vec<Lines<Entry>>, StateError> {
    (0..num_nodes)
        .map(|r| read_journal(store, &layout.journal(r)))
        .collect()
}

/// One rank's journal, strictly, its entries [`journal::settled`]: without the late
/// lines of replaced generations, each step once.
pub fn read_journal(store: &dyn SharedDir, path: &Path) -> Result<Lines<Entry>, StateError> {
    let mut lines = read_lines::<Entry>(store, path)?;
    lines.entries = journal::settled(lines.entries);
    Ok(lines)
}

/// The iteration every rank must have completed, by the evidence of the other journals
/// and the history: (iteration, why).
pub fn evidence_floor(
    ranks: &[u32],
    journals: &[Vec<Entry>],
    history: &[HistoryEntry],
    run_id: &str,
    walk: &str,
) -> (u64, String) {
    let mut floor = (0, String::new());
    for (r, j) in ranks.iter().zip(journals) {
        let last = journal::last_complete(j, run_id, walk);
        if last >= 2 && last - 1 > floor.0 {
            floor = (
                last - 1,
                format!(
                    "rank {r} completed iteration {last}, which every rank starts only after completing iteration {}",
                    last - 1
                ),
            );
        }
    }
    let mut hist = (0, String::new());
    for h in history.iter().filter(|h| h.run_id == run_id) {
        if let Some(n) = h.discarded_from {
            if hist.0 >= n {
                hist = (n.saturating_sub(1), String::new());
            }
        } else if h.walk == walk && h.resume_iteration >= 2 && h.resume_iteration - 1 > hist.0 {
            hist = (
                h.resume_iteration - 1,
                format!(
                    "history.jsonl says generation {} resumed at iteration {} after every rank completed iteration {}",
                    h.gen,
                    h.resume_iteration,
                    h.resume_iteration - 1
                ),
            );
        }
    }
    if hist.0 > floor.0 && !hist.1.is_empty() {
        floor = hist;
    }
    floor
}

/// Ranks whose journal holds less than the evidence says they completed.
pub fn lost_journals(
    store: &dyn SharedDir,
    layout: &Layout,
    ranks: &[u32],
    journals: &[Vec<Entry>],
    history: &[HistoryEntry],
    run_id: &str,
    walk: &str,
) -> Vec<StateError> {
    let (floor, why) = evidence_floor(ranks, journals, history, run_id, walk);
    ranks
        .iter()
        .zip(journals)
        .filter_map(|(&r, j)| {
            let last = journal::last_complete(j, run_id, walk);
            (last < floor).then(|| {
                let path = layout.journal(r);
                let state = if !store.exists(&path) {
                    "missing".to_string()
                } else if j.is_empty() {
                    "empty".to_string()
                } else if last == 0 {
                    "without any completed iteration".to_string()
                } else {
                    format!("complete only up to iteration {last}")
                };
                StateError::LostJournal {
                    rank: r,
                    path,
                    state,
                    evidence: why.clone(),
                }
            })
        })
        .collect()
}

/// The journals rank 0 checked (with the history) before it starts a generation of
/// `cluster`'s run, and the torn tails it found (tolerated; each writer repairs its own).
pub struct Checked {
    pub journals: Vec<Vec<Entry>>,
    pub torn: Vec<String>,
}

/// Validate the journals and history of a run before a restart writes anything.
pub fn check_run(
    store: &dyn SharedDir,
    layout: &Layout,
    cluster: &ClusterRecord,
    walk: &str,
) -> Result<Checked, StateError> {
    let history = read_history(store, layout)?;
    let lines = read_journals(store, layout, cluster.num_nodes)?;
    let mut torn = Vec::new();
    if let Tail::Torn(f) = &history.tail {
        torn.push(torn_note(&layout.history(), f));
    }
    for (r, l) in lines.iter().enumerate() {
        if let Tail::Torn(f) = &l.tail {
            torn.push(torn_note(&layout.journal(r as u32), f));
        }
    }
    // After elastic mode dropped ranks, the last generation's members are the run: a
    // dropped rank journaled nothing since it was dropped.
    let ranks: Vec<u32> = cluster.members().ranks().to_vec();
    let mut all: Vec<Option<Vec<Entry>>> = lines.into_iter().map(|l| Some(l.entries)).collect();
    let journals: Vec<Vec<Entry>> = ranks
        .iter()
        .map(|&r| {
            all.get_mut(r as usize)
                .and_then(Option::take)
                .unwrap_or_default()
        })
        .collect();
    if let Some(e) = lost_journals(
        store,
        layout,
        &ranks,
        &journals,
        &history.entries,
        &cluster.run_id,
        walk,
    )
    .into_iter()
    .next()
    {
        return Err(e);
    }
    Ok(Checked { journals, torn })
}

pub fn torn_note(path: &Path, fragment: &str) -> String {
    format!(
        "{} ends with an unfinished line (a crash mid-append; {} bytes: {:?}): ignored, and set aside before the next append",
        path.display(),
        fragment.len(),
        fragment.chars().take(60).collect::<String>()
    )
}

/// Set an unfinished last line of a JSON-lines file aside (`<file>.torn-genG`) and
/// rewrite the file without it, so the next append starts on a new line. Returns where
/// the fragment went, if there was one. Only the file's own writer calls this.
pub fn repair_tail(
    store: &dyn SharedDir,
    path: &Path,
    gen: u64,
) -> Result<Option<PathBuf>, String> {
    let Ok(Some(text)) = store.read_limited(path, store::ReadLimit::Journal) else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&text).into_owned();
    let Some(cut) = torn_cut(&text) else {
        return Ok(None);
    };
    if serde_json::from_str::<serde_json::Value>(&text[cut..]).is_ok() {
        // A complete entry that only lacks its newline: keep it, add the newline.
        store
            .publish(path, format!("{text}\n").as_bytes())
            .map_err(|e| format!("cannot end {} with a newline: {e}", path.display()))?;
        return Ok(None);
    }
    let aside = side_path(store, path, &format!("torn-gen{gen}"));
    let (clean, fragment) = text.split_at(cut);
    store
        .publish(&aside, fragment.as_bytes())
        .and_then(|()| store.publish(path, clean.as_bytes()))
        .map_err(|e| {
            format!(
                "cannot set the unfinished last line of {} aside: {e}",
                path.display()
            )
        })?;
    Ok(Some(aside))
}

/// Where the unfinished last line of `text` begins, if it has one.
fn torn_cut(text: &str) -> Option<usize> {
    let cut = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
    (!text[cut..].trim().is_empty()).then_some(cut)
}

/// Move whatever is at `path` (a file, a directory, a link, dangling or not: looked at, never
/// followed) to [`side_path`]`(path, suffix)`; where it went, or `None` when nothing was
/// there. Nothing is deleted: a repair keeps what it replaces.
pub fn set_aside(
    store: &dyn SharedDir,
    path: &Path,
    suffix: &str,
) -> std::io::Result<Option<PathBuf>> {
    if !store.exists(path) {
        return Ok(None);
    }
    let aside = side_path(store, path, suffix);
    store.rename(path, &aside)?;
    Ok(Some(aside))
}

/// `<file>.<suffix>`, numbered if taken.
pub fn side_path(store: &dyn SharedDir, path: &Path, suffix: &str) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut p = path.with_file_name(format!("{name}.{suffix}"));
    let mut n = 1;
    while store.exists_followed(&p) {
        n += 1;
        p = path.with_file_name(format!("{name}.{suffix}-{n}"));
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(rank: u32, iteration: u64) -> Entry {
        Entry {
            run_id: "r".into(),
            gen: 1,
            rank,
            iteration,
            item: "done".into(),
            at: String::new(),
            note: None,
            failed: None,
            checkpoint: None,
        }
    }

    fn h(gen: u64, resume: u64) -> HistoryEntry {
        HistoryEntry {
            gen,
            run_id: "r".into(),
            started_at: String::new(),
            host: String::new(),
            pid: 0,
            resume_iteration: resume,
            previous: None,
            walk: "done".into(),
            discarded_from: None,
        }
    }

    #[test]
    fn a_journal_behind_the_evidence_is_lost() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        // Rank 0 completed 1..3, rank 1's journal is empty: rank 1 must have completed 2.
        let js = vec![vec![e(0, 1), e(0, 2), e(0, 3)], vec![]];
        let lost = lost_journals(
            &crate::store::Fs,
            &l,
            &[0, 1, 2][..js.len()],
            &js,
            &[],
            "r",
            "done",
        );
        assert_eq!(lost.len(), 1);
        let msg = lost[0].to_string();
        assert!(
            msg.contains("rank 1's journal") && msg.contains("missing"),
            "{msg}"
        );
        assert!(msg.contains("rank 0 completed iteration 3"), "{msg}");
        // One iteration apart is normal (a crash mid-iteration).
        let js = vec![vec![e(0, 1), e(0, 2)], vec![e(1, 1)]];
        assert!(lost_journals(
            &crate::store::Fs,
            &l,
            &[0, 1, 2][..js.len()],
            &js,
            &[],
            "r",
            "done"
        )
        .is_empty());
        // A single rank: only the history can tell.
        let js = vec![vec![]];
        let lost = lost_journals(
            &crate::store::Fs,
            &l,
            &[0, 1, 2][..js.len()],
            &js,
            &[h(1, 1), h(2, 4)],
            "r",
            "done",
        );
        assert!(
            lost[0]
                .to_string()
                .contains("generation 2 resumed at iteration 4"),
            "{}",
            lost[0]
        );
        // …unless iterations were discarded since.
        let discard = HistoryEntry {
            discarded_from: Some(1),
            ..h(0, 0)
        };
        assert!(lost_journals(
            &crate::store::Fs,
            &l,
            &[0, 1, 2][..js.len()],
            &js,
            &[h(2, 4), discard],
            "r",
            "done"
        )
        .is_empty());
    }

    #[test]
    fn a_torn_tail_is_set_aside_and_the_file_ends_with_a_newline() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("rank-0.jsonl");
        std::fs::write(&p, "{\"a\":1}\n{\"a\":").unwrap();
        let aside = repair_tail(&crate::store::Fs, &p, 3).unwrap().unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"a\":1}\n");
        assert_eq!(std::fs::read_to_string(&aside).unwrap(), "{\"a\":");
        assert!(aside.ends_with("rank-0.jsonl.torn-gen3"));
        assert_eq!(repair_tail(&crate::store::Fs, &p, 3).unwrap(), None);
        // A whole entry without its newline is kept.
        std::fs::write(&p, "{\"a\":1}\n{\"a\":2}").unwrap();
        assert_eq!(repair_tail(&crate::store::Fs, &p, 3).unwrap(), None);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"a\":2}\n"
        );
    }
}
