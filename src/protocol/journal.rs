//! The journal: what each rank finished, and where a restarted cluster resumes.
//!
//! Each rank appends a line to its own journal (`.rl-node/journal/rank-R.jsonl`, one
//! writer) after a piece of work's outputs are committed: its rollout shard, rank 0's
//! aggregation, training, the hand-off, and the end of each iteration. A restart resumes
//! at the first iteration not completed by every rank; inside it, each rank skips work it
//! journaled, and training — all-or-nothing across ranks — is skipped only when every
//! rank journaled it. The iteration number comes from here, never from file names.
//!
//! With `phases.train.on-failure = "keep-model"` a rank whose training command failed
//! journals training too, marked `failed`: the attempt is over, and a restart does not
//! redo it any more than a successful one. A rank's latest training entry of an iteration
//! is its outcome (a redo whose outcome differs appends a new one), and an iteration whose
//! training every rank journaled, failed on any, publishes no checkpoint.
//!
//! With `phases.rollout.on-failure = "merge-survivors"` (or eval's) a rank whose rollout
//! command failed journals its rollout marked `failed` the same way: done, with no shard,
//! and carried again to rank 0 at `rollout-complete` after a restart.
//!
//! The fence check before an append is not atomic with it: a node frozen in between (a
//! paused VM) can wake after a newer generation of its rank journaled on, and append a
//! line of its replaced generation. Nothing but a rename is atomic on a shared
//! directory, and an append costs no read, so readers settle the journal instead
//! ([`settled`]): a line of a generation older than one journaled before it is such a
//! late write and is not taken as done (its work is redone, as after a crash before the
//! line), and a step journaled a second time counts once.

use serde::{Deserialize, Serialize};

/// Work items a rank journals. Barrier phases are not journaled: walking a barrier again
/// costs nothing and keeps every rank in lock-step.
pub mod item {
    pub const ROLLOUT_TRAIN: &str = "rollout-train";
    pub const ROLLOUT_EVAL: &str = "rollout-eval";
    pub const AGGREGATE_TRAIN: &str = "aggregate-train";
    pub const AGGREGATE_EVAL: &str = "aggregate-eval";
    pub const PREPARE: &str = "prepare";
    pub const TRAIN: &str = "train";
    pub const HANDOFF: &str = "handoff";
    /// Rank 0 published no checkpoint because training failed on some rank
    /// (`phases.train.on-failure = "keep-model"`); its note says where and which model
    /// was kept.
    pub const HANDOFF_SKIPPED: &str = "handoff-skipped";
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Entry {
    pub run_id: String,
    pub gen: u64,
    pub rank: u32,
    pub iteration: u64,
    pub item: String,
    /// Wall-clock time, for display only.
    #[serde(default)]
    pub at: String,
    /// Set on entries not written by the work itself, e.g. rebuilt by `rl-node recover
    /// --repair` from the history after a journal was lost: says where it came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// On a training entry: this rank's training command failed (`exit code 3`, `killed
    /// by signal 9 (SIGKILL)`, `timed out after 10m`) and the run went on without it
    /// (`phases.train.on-failure = "keep-model"`). On a rollout entry: its rollout
    /// command failed, it committed no shard, and the merge went on without it
    /// (`phases.<phase>.on-failure = "merge-survivors"`); a restart does not redo it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    /// On a hand-off entry: the checkpoint it published (`iter-NNNN`), the evidence a
    /// restart checks `models/LATEST` against (`checkpoint::Journaled`). Absent when
    /// nothing was published (training wrote nothing) and on entries of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
}

/// A JSON-lines state file (a journal, `history.jsonl`) as read: its entries, and a torn
/// last line if a crash interrupted an append.
#[derive(Debug, Clone, PartialEq)]
pub struct Lines<T> {
    pub entries: Vec<T>,
    pub tail: Tail,
    /// Byte length of the text up to and including the last complete line.
    pub clean_len: usize,
}

impl<T> Default for Lines<T> {
    fn default() -> Self {
        Lines {
            entries: Vec::new(),
            tail: Tail::Clean,
            clean_len: 0,
        }
    }
}

/// How a JSON-lines file ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tail {
    /// With a newline after its last entry (or empty).
    Clean,
    /// With a fragment after the last newline that does not parse: an append the writer
    /// did not finish (a crash mid-write). Tolerated; the writer sets it aside before its
    /// next append so that append starts on a new line.
    Torn(String),
}

/// A line in the middle of a JSON-lines file that cannot be read: damage no crash of the
/// (append-only, single) writer can cause, so it is never skipped silently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    /// 1-based line number.
    pub line: usize,
    pub what: String,
    pub text: String,
}

/// Parse a JSON-lines state file strictly: every complete line must be an entry (blank
/// lines are skipped); only an unfinished last line (no newline after it) is tolerated,
/// and reported in `tail`. A last line that parses but lacks its newline is an entry.
pub fn parse_lines<T: serde::de::DeserializeOwned>(text: &str) -> Result<Lines<T>, BadLine> {
    let mut out = Lines::default();
    let (complete, fragment) = match text.rfind('\n') {
        Some(i) => (&text[..=i], &text[i + 1..]),
        None => ("", text),
    };
    out.clean_len = complete.len();
    for (i, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let entry = crate::json::parse_strict::<T>(line.as_bytes()).map_err(|what| BadLine {
            line: i + 1,
            what,
            text: line.chars().take(120).collect(),
        })?;
        out.entries.push(entry);
    }
    if !fragment.trim().is_empty() {
        match serde_json::from_str::<T>(fragment) {
            // Complete but for its newline: an entry (its writer adds the newline).
            Ok(entry) => out.entries.push(entry),
            Err(_) => out.tail = Tail::Torn(fragment.to_string()),
        }
    }
    Ok(out)
}

/// Parse a journal file leniently (display only: `status`); a torn last line is ignored.
/// The entries are [`settled`].
pub fn parse(text: &str) -> Vec<Entry> {
    settled(parse_raw(text))
}

/// Every line of a journal that parses, as written, late and repeated lines included
/// (for checks of what was appended: the simulator's "no step journaled twice").
pub fn parse_raw(text: &str) -> Vec<Entry> {
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A rank's journal as its readers take it: without the late lines of replaced
/// generations (a line of generation G after a line of the same run's generation G' > G:
/// its node was frozen between its fence check and its append, and a newer generation
/// has run since), and with each step once (a second line of a step already journaled,
/// from a node that woke in that window before its successor's line; for training, a
/// second line with the same outcome: a redo's differing outcome is kept, see
/// [`latest_train`]).
pub fn settled(entries: Vec<Entry>) -> Vec<Entry> {
    use std::collections::{HashMap, HashSet};
    // Linear in the journal (a long run's holds tens of thousands of lines).
    let mut newest: HashMap<String, u64> = HashMap::new();
    let mut steps: HashSet<(String, u64, String)> = HashSet::new();
    let mut trained: HashMap<(String, u64), Option<String>> = HashMap::new();
    let mut out: Vec<Entry> = Vec::with_capacity(entries.len());
    for e in entries {
        let gen = newest.entry(e.run_id.clone()).or_default();
        if e.gen < *gen {
            continue;
        }
        *gen = e.gen;
        let again = if e.item == item::TRAIN {
            let key = (e.run_id.clone(), e.iteration);
            trained.insert(key, e.failed.clone()).as_ref() == Some(&e.failed)
        } else {
            !steps.insert((e.run_id.clone(), e.iteration, e.item.clone()))
        };
        if !again {
            out.push(e);
        }
    }
    out
}

pub fn has(entries: &[Entry], run_id: &str, iteration: u64, item: &str) -> bool {
    entries
        .iter()
        .any(|e| e.run_id == run_id && e.iteration == iteration && e.item == item)
}

/// The latest entry of `item` in `iteration`, of a rank's journal.
pub fn newest<'a>(entries: &'a [Entry], iteration: u64, item: &str) -> Option<&'a Entry> {
    entries
        .iter()
        .rev()
        .find(|e| e.iteration == iteration && e.item == item)
}

/// The note of a rank's shard of `split` in `iteration` that its command wrote itself and
/// the rank adopted (`adopted: …`), from the rank's journal: its latest rollout entry's.
pub fn adopted(entries: &[Entry], iteration: u64, split: &str) -> Option<String> {
    newest(entries, iteration, &format!("rollout-{split}"))
        .and_then(|e| e.note.clone())
        .filter(|n| n.starts_with("adopted"))
}

/// How a rank's rollout of `split` in `iteration` failed, from the rank's journal, when
/// its command failed and the run went on without its shard
/// (`phases.<phase>.on-failure = "merge-survivors"`): its latest rollout entry's `failed`.
pub fn rollout_failed(entries: &[Entry], iteration: u64, split: &str) -> Option<String> {
    newest(entries, iteration, &format!("rollout-{split}")).and_then(|e| e.failed.clone())
}

/// A rank's outcome of training in `iteration`: its latest training entry, if any.
pub fn latest_train<'a>(entries: &'a [Entry], run_id: &str, iteration: u64) -> Option<&'a Entry> {
    entries
        .iter()
        .rev()
        .find(|e| e.run_id == run_id && e.iteration == iteration && e.item == item::TRAIN)
}

/// The ranks (with why) whose latest training entry of `iteration` says it failed.
pub fn train_failures(journals: &[Vec<Entry>], run_id: &str, iteration: u64) -> Vec<(u32, String)> {
    journals
        .iter()
        .enumerate()
        .filter_map(|(r, j)| {
            let failed = latest_train(j, run_id, iteration)?.failed.clone()?;
            Some((r as u32, failed))
        })
        .collect()
}

/// The last iteration a rank completed in this run (0: none), by the walk's completion
/// item (`Config::walk_item`).
pub fn last_complete(entries: &[Entry], run_id: &str, walk_item: &str) -> u64 {
    entries
        .iter()
        .filter(|e| e.run_id == run_id && e.item == walk_item)
        .map(|e| e.iteration)
        .max()
        .unwrap_or(0)
}

/// Where a restarted cluster begins: the first iteration not completed by every rank,
/// and whether every rank already finished training in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Resume {
    pub iteration: u64,
    pub train_done: bool,
    /// Training is done everywhere, and failed on some rank (`on-failure = "keep-model"`):
    /// the hand-off of this iteration is skipped, not run on the failed output.
    #[serde(default)]
    pub train_failed: bool,
}

impl Resume {
    /// A run that continues one begun without rl-node (`cluster.first-iteration`, e.g.
    /// run.sh's iterations 1–30 in the same directory) starts at `first` at the earliest.
    pub fn not_before(self, first: u64) -> Resume {
        if self.iteration >= first {
            self
        } else {
            Resume {
                iteration: first,
                train_done: false,
                train_failed: false,
            }
        }
    }
}

pub fn resume_point(journals: &[Vec<Entry>], run_id: &str, walk_item: &str) -> Resume {
    resume_point_with(journals, run_id, walk_item, None)
}

/// This rank's journal of the current run as the node knows it: the entries read at
/// start (a resumed run's) and appended since, what the next entry carries, and a resume
/// point broken on purpose until it has acted. Pure state: the node reads and appends
/// the file.
#[derive(Debug, Default)]
pub struct Book {
    entries: Vec<Entry>,
    /// For the next entry: a note (the shard was adopted, the hand-off skipped).
    note: Option<String>,
    /// For the next entry: the checkpoint the hand-off published.
    checkpoint: Option<String>,
    /// For the next entry: how this rank's rollout command failed
    /// (`phases.<phase>.on-failure = "merge-survivors"`).
    failed: Option<String>,
    /// A resume point broken on purpose, until it acted ([`done_on_resume`]).
    late: Option<Mutation>,
}

impl Book {
    /// The book of run `run_id` from the journal's `entries` (every run's), as a rank
    /// restarting with them takes them ([`resumed`]).
    pub fn open(entries: Vec<Entry>, run_id: &str, mutation: Option<Mutation>) -> Book {
        let entries: Vec<Entry> = entries.into_iter().filter(|e| e.run_id == run_id).collect();
        if entries.is_empty() {
            return Book::default();
        }
        Book {
            entries: resumed(entries, mutation),
            late: mutation,
            ..Book::default()
        }
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Whether `item` of `iteration` is done: journaled, or skipped by a resume point
    /// broken on purpose ([`done_on_resume`]).
    pub fn done(&mut self, run_id: &str, iteration: u64, item: &str) -> bool {
        done_on_resume(&self.entries, run_id, iteration, item, &mut self.late)
    }

    /// Whether `item` of `iteration` is journaled.
    pub fn has(&self, run_id: &str, iteration: u64, item: &str) -> bool {
        has(&self.entries, run_id, iteration, item)
    }

    /// The latest entry of `item` in `iteration` ([`newest`]).
    pub fn newest(&self, iteration: u64, item: &str) -> Option<&Entry> {
        newest(&self.entries, iteration, item)
    }

    /// How `item` of `iteration` failed, if its newest entry says it did.
    pub fn failure(&self, iteration: u64, item: &str) -> Option<&str> {
        self.newest(iteration, item)
            .and_then(|e| e.failed.as_deref())
    }

    /// The next entry carries `note`.
    pub fn note(&mut self, note: String) {
        self.note = Some(note);
    }

    /// The next entry names the checkpoint `name`.
    pub fn checkpoint(&mut self, name: String) {
        self.checkpoint = Some(name);
    }

    /// The next entry says how this rank's rollout failed.
    pub fn failed(&mut self, why: String) {
        self.failed = Some(why);
    }

    /// The next entry: `entry` with what was noted for it (taken: noted once, carried
    /// once); `entry.failed`, when set, is kept over a noted failure.
    pub fn next(&mut self, mut entry: Entry) -> Entry {
        entry.note = entry.note.or_else(|| self.note.take());
        entry.failed = entry.failed.or_else(|| self.failed.take());
        entry.checkpoint = entry.checkpoint.or_else(|| self.checkpoint.take());
        entry
    }

    /// `entry` was appended durably.
    pub fn appended(&mut self, entry: Entry) {
        self.entries.push(entry);
    }
}

/// A deliberately broken resume point, for the simulator's own tests (never set by the
/// node): shows that the simulator catches work lost across a restart.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// Resume after the iteration the furthest rank completed, not the slowest.
    FromFastest,
    /// A restarted rank resumes one step early: the last item it journaled before the
    /// restart is taken as not done, and done again.
    OneEarly,
    /// A restarted rank resumes one step late: the first item it had not journaled is
    /// taken as done, and skipped.
    OneLate,
    /// A rank journals its rollout before it commits the shard (renames it into place),
    /// not after: a crash in between leaves a journaled step with no output.
    BeforeCommit,
    /// A rank appends to its journal after a torn last line (a crash mid-append) without
    /// setting that line aside first: the next entry is glued to the fragment.
    KeepTornTail,
}

/// Whether a rank journals its rollout before committing the shard: never, but for
/// [`Mutation::BeforeCommit`].
#[doc(hidden)]
pub fn journals_before_commit(mutation: Option<Mutation>) -> bool {
    super::mutation(mutation) == Some(Mutation::BeforeCommit)
}

/// Whether a rank sets its journal's torn last line aside before appending again:
/// always, but for [`Mutation::KeepTornTail`].
#[doc(hidden)]
pub fn sets_torn_tail_aside(mutation: Option<Mutation>) -> bool {
    super::mutation(mutation) != Some(Mutation::KeepTornTail)
}

/// What a rank restarting with its journal `entries` (of this run) takes as done: all of
/// them, but for a resume point broken on purpose ([`Mutation::OneEarly`]: the last one).
fn resumed(mut entries: Vec<Entry>, mutation: Option<Mutation>) -> Vec<Entry> {
    if super::mutation(mutation) == Some(Mutation::OneEarly) {
        entries.pop();
    }
    entries
}

/// Whether a rank skips `item` of `iteration` as done: [`has`], but for a resume point
/// broken on purpose ([`Mutation::OneLate`], taken — it acts once — from `late`: the
/// first item not journaled is skipped too).
fn done_on_resume(
    entries: &[Entry],
    run_id: &str,
    iteration: u64,
    item: &str,
    late: &mut Option<Mutation>,
) -> bool {
    if has(entries, run_id, iteration, item) {
        return true;
    }
    super::mutation(late.take()) == Some(Mutation::OneLate)
}

#[doc(hidden)]
pub fn resume_point_with(
    journals: &[Vec<Entry>],
    run_id: &str,
    walk_item: &str,
    mutation: Option<Mutation>,
) -> Resume {
    let mutation = super::mutation(mutation);
    let done = journals.iter().map(|j| last_complete(j, run_id, walk_item));
    let done = if mutation == Some(Mutation::FromFastest) {
        done.max()
    } else {
        done.min()
    };
    let iteration = done.unwrap_or(0) + 1;
    let train_done = !journals.is_empty()
        && journals
            .iter()
            .all(|j| has(j, run_id, iteration, item::TRAIN));
    let train_failed = train_done && !train_failures(journals, run_id, iteration).is_empty();
    Resume {
        iteration,
        train_done,
        train_failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `cluster.first-iteration` only moves a run forward: a journal further on wins.
    #[test]
    fn first_iteration_is_a_lower_bound() {
        let fresh = Resume {
            iteration: 1,
            train_done: false,
            train_failed: false,
        };
        assert_eq!(fresh.not_before(31).iteration, 31);
        let later = Resume {
            iteration: 40,
            train_done: true,
            train_failed: false,
        };
        let r = later.not_before(31);
        assert_eq!((r.iteration, r.train_done), (40, true));
        assert_eq!(fresh.not_before(1).iteration, 1);
    }

    /// The book keeps its run's entries only; what is noted for the next entry is carried
    /// by that entry and not by the one after; a failure given with the entry wins.
    #[test]
    fn a_book_carries_each_note_once_and_keeps_its_runs_entries() {
        let mut other = e(0, 1, "rollout-train");
        other.run_id = "older".into();
        let mut book = Book::open(vec![other, e(0, 1, "rollout-train")], "r", None);
        assert_eq!(book.entries().len(), 1);
        assert!(book.has("r", 1, "rollout-train") && !book.has("r", 1, "train"));
        book.note("adopted".into());
        book.checkpoint("iter-0001".into());
        book.failed("exit code 7".into());
        let first = book.next(e(0, 1, "rollout-eval"));
        assert_eq!(first.note.as_deref(), Some("adopted"));
        assert_eq!(first.checkpoint.as_deref(), Some("iter-0001"));
        assert_eq!(first.failed.as_deref(), Some("exit code 7"));
        book.appended(first);
        assert_eq!(book.failure(1, "rollout-eval"), Some("exit code 7"));
        assert_eq!(book.next(e(0, 1, "train")), e(0, 1, "train"));
        book.failed("exit code 7".into());
        let given = book.next(failed(0, 1, "exit code 3"));
        assert_eq!(given.failed.as_deref(), Some("exit code 3"));
    }

    /// The broken resume points: one early forgets the last entry; one late skips the
    /// first item not journaled, once.
    #[test]
    fn a_books_broken_resume_points_act_as_named() {
        let entries = || vec![e(0, 1, "rollout-train"), e(0, 1, "train")];
        let mut early = Book::open(entries(), "r", Some(Mutation::OneEarly));
        assert!(early.done("r", 1, "rollout-train") && !early.done("r", 1, "train"));
        let mut late = Book::open(entries(), "r", Some(Mutation::OneLate));
        assert!(late.done("r", 1, "handoff"), "skipped once");
        assert!(!late.done("r", 1, "iteration-complete"), "and only once");
        let mut fresh = Book::open(vec![], "r", Some(Mutation::OneLate));
        assert!(
            !fresh.done("r", 1, "rollout-train"),
            "a fresh run has no resume point"
        );
    }

    const ITERATION: &str = "iteration-complete:both";

    fn e(rank: u32, iteration: u64, item: &str) -> Entry {
        Entry {
            run_id: "r".into(),
            gen: 1,
            rank,
            iteration,
            item: item.into(),
            at: String::new(),
            note: None,
            failed: None,
            checkpoint: None,
        }
    }

    fn failed(rank: u32, iteration: u64, why: &str) -> Entry {
        Entry {
            failed: Some(why.into()),
            ..e(rank, iteration, item::TRAIN)
        }
    }

    /// A rollout journaled as failed (`merge-survivors`) is done, and says how it failed
    /// for its split and iteration only.
    #[test]
    fn a_failed_rollout_is_done_and_says_how() {
        let j = vec![
            e(1, 1, item::ROLLOUT_TRAIN),
            Entry {
                failed: Some("exit code 7".into()),
                ..e(1, 2, item::ROLLOUT_TRAIN)
            },
        ];
        assert!(has(&j, "r", 2, item::ROLLOUT_TRAIN));
        assert_eq!(
            rollout_failed(&j, 2, "train").as_deref(),
            Some("exit code 7")
        );
        assert_eq!(rollout_failed(&j, 1, "train"), None);
        assert_eq!(rollout_failed(&j, 2, "eval"), None);
        assert_eq!(adopted(&j, 2, "train"), None);
    }

    #[test]
    fn resumes_at_the_first_iteration_not_complete_everywhere() {
        let j0 = vec![
            e(0, 1, ITERATION),
            e(0, 2, item::ROLLOUT_TRAIN),
            e(0, 2, item::TRAIN),
        ];
        let j1 = vec![e(1, 1, ITERATION), e(1, 2, item::TRAIN)];
        assert_eq!(
            resume_point(&[j0.clone(), j1.clone()], "r", ITERATION),
            Resume {
                iteration: 2,
                train_done: true,
                train_failed: false
            }
        );
        // Training incomplete on one rank: redo it everywhere.
        let j2 = vec![e(2, 1, ITERATION)];
        assert_eq!(
            resume_point(&[j0, j1, j2], "r", ITERATION),
            Resume {
                iteration: 2,
                train_done: false,
                train_failed: false
            }
        );
        // Entries of another run do not count.
        let other = vec![Entry {
            run_id: "old".into(),
            ..e(0, 5, ITERATION)
        }];
        assert_eq!(resume_point(&[other], "r", ITERATION).iteration, 1);
    }

    #[test]
    fn a_failed_training_counts_as_done_and_its_latest_outcome_wins() {
        let j0 = vec![e(0, 1, ITERATION), e(0, 2, item::TRAIN)];
        // Failed on rank 1: done everywhere (not redone), and failed.
        let j1 = vec![e(1, 1, ITERATION), failed(1, 2, "exit code 3")];
        let r = resume_point(&[j0.clone(), j1.clone()], "r", ITERATION);
        assert_eq!(
            r,
            Resume {
                iteration: 2,
                train_done: true,
                train_failed: true
            }
        );
        assert_eq!(
            train_failures(&[j0.clone(), j1.clone()], "r", 2),
            vec![(1, "exit code 3".to_string())]
        );
        // Journaled failed on one rank, not at all on another: redone everywhere, as a
        // success would be.
        let j2 = vec![e(2, 1, ITERATION)];
        let r = resume_point(&[j0.clone(), j1.clone(), j2], "r", ITERATION);
        assert!(!r.train_done && !r.train_failed, "{r:?}");
        // A redo that succeeded after a failure: its newer entry is the outcome.
        let mut j1 = j1;
        j1.push(e(1, 2, item::TRAIN));
        let r = resume_point(&[j0.clone(), j1.clone()], "r", ITERATION);
        assert!(r.train_done && !r.train_failed, "{r:?}");
        assert!(train_failures(&[j0, j1], "r", 2).is_empty());
    }

    /// A node frozen between its fence check and its append wakes after its successor
    /// (a newer generation of its rank) journaled on: its line is set aside, and a step
    /// journaled by both counts once.
    #[test]
    fn late_lines_of_a_replaced_generation_are_set_aside() {
        let g = |gen, iteration, item: &str| Entry {
            gen,
            ..e(0, iteration, item)
        };
        let failed_late = Entry {
            failed: Some("exit code 3".into()),
            ..g(1, 2, item::TRAIN)
        };
        let lines = vec![
            g(1, 1, ITERATION),
            g(2, 2, item::TRAIN),
            g(2, 2, item::HANDOFF),
            // Generation 1's training of iteration 2 failed before it froze: its line
            // must not override the outcome of the successor's training.
            failed_late,
            g(2, 2, ITERATION),
            // Woke before its successor's line of the same step: one line counts.
            g(2, 3, item::TRAIN),
            g(2, 3, item::TRAIN),
        ];
        let text: String = lines
            .iter()
            .map(|l| serde_json::to_string(l).unwrap() + "\n")
            .collect();
        let want = vec![
            g(1, 1, ITERATION),
            g(2, 2, item::TRAIN),
            g(2, 2, item::HANDOFF),
            g(2, 2, ITERATION),
            g(2, 3, item::TRAIN),
        ];
        assert_eq!(parse(&text), want);
        assert_eq!(settled(lines.clone()), want);
        assert!(latest_train(&settled(lines), "r", 2)
            .unwrap()
            .failed
            .is_none());
        // A redo whose outcome differs, in one generation, is kept: the latest wins.
        let redo = vec![failed(0, 2, "exit code 3"), e(0, 2, item::TRAIN)];
        assert_eq!(settled(redo.clone()), redo);
        // Generations of another run are not compared: a new run starts at 1 again.
        let other = Entry {
            run_id: "new".into(),
            ..g(1, 1, ITERATION)
        };
        let runs = vec![g(3, 1, ITERATION), other];
        assert_eq!(settled(runs.clone()), runs);
    }

    #[test]
    fn a_torn_last_line_is_ignored() {
        let text = format!(
            "{}\n{{\"run_id\":\"r\",\"ge",
            serde_json::to_string(&e(0, 1, item::TRAIN)).unwrap()
        );
        assert_eq!(parse(&text), vec![e(0, 1, item::TRAIN)]);
    }

    #[test]
    fn strict_parsing_tolerates_only_a_torn_last_line() {
        let good = serde_json::to_string(&e(0, 1, item::TRAIN)).unwrap();
        let p = parse_lines::<Entry>(&format!("{good}\n{{\"run_id\":\"r\",\"ge")).unwrap();
        assert_eq!(p.entries, vec![e(0, 1, item::TRAIN)]);
        assert_eq!(p.tail, Tail::Torn("{\"run_id\":\"r\",\"ge".into()));
        assert_eq!(p.clean_len, good.len() + 1);
        // Damage in the middle is an error naming the line.
        let bad = parse_lines::<Entry>(&format!("{good}\ngarbage\n{good}\n")).unwrap_err();
        assert_eq!(bad.line, 2);
        assert!(bad.what.contains("not valid JSON"), "{bad:?}");
        // A complete line of the wrong shape too.
        let bad = parse_lines::<Entry>(&format!("{good}\n{{\"run_id\":1}}\n")).unwrap_err();
        assert!(bad.what.contains("wrong shape"), "{bad:?}");
        // Blank lines are harmless; an empty file is clean.
        assert_eq!(
            parse_lines::<Entry>(&format!("\n{good}\n\n"))
                .unwrap()
                .entries
                .len(),
            1
        );
        assert_eq!(parse_lines::<Entry>("").unwrap().tail, Tail::Clean);
    }

    proptest! {
        /// The resume iteration is one past the slowest rank's last complete iteration,
        /// whatever the other entries say.
        #[test]
        fn resume_is_after_the_slowest_rank(lasts in proptest::collection::vec(0u64..20, 1..8)) {
            let journals: Vec<Vec<Entry>> = lasts.iter().enumerate().map(|(r, &last)| {
                let mut j: Vec<Entry> = (1..=last).map(|i| e(r as u32, i, ITERATION)).collect();
                j.push(e(r as u32, last + 1, item::ROLLOUT_TRAIN));
                j
            }).collect();
            let min = *lasts.iter().min().unwrap();
            prop_assert_eq!(resume_point(&journals, "r", ITERATION).iteration, min + 1);
        }
    }
}
