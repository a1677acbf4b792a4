//! Merging rank shards into one file per iteration and split, with partial recovery.
//!
//! For each rank the merge takes the committed shard (`rank-R.jsonl`, status
//! `complete`), else the file its command was writing when it stopped
//! (`rank-R.partial.jsonl`, status `partial`), else nothing (`missing`), and appends its
//! records in rank order, then file order. Records are streamed line by line (memory is
//! bounded by the longest record, never by the file; reading, validating, hashing and
//! writing run on threads of their own, see `jsonl`) into a temporary file beside the output, which is fsynced
//! and renamed to
//! `rollouts/iter-NNNN/<split>.jsonl`; a manifest `<out>.manifest.json` beside it says
//! where every byte came from. A crash never leaves a half-written merged file under the
//! final name, and a manifest, when present, describes the merged file beside it. An
//! existing merged file is never replaced (it may have been trained on) unless the caller
//! asks (`MergeOptions::replace`, `rl-node aggregate --overwrite` of an earlier salvage).
//!
//! What counts as a record: one JSON value per line, UTF-8. Blank lines are skipped. A
//! last line without a trailing newline that is not valid JSON is a torn record (the
//! writer died mid-write): it is dropped and reported. Any other invalid line is corrupt
//! in a committed shard (the merge fails and publishes nothing) and, in a partial file,
//! the point where reading that file stops (the records before it are kept). Unless
//! `strict_json` is set, the `NaN`, `Infinity` and `-Infinity` that Python's `json`
//! module writes and reads are accepted as they are.
//!
//! The node's phase 3 calls [`merge`] with `allow_missing = false`; `rl-node aggregate`
//! ([`main`]) is the same merge from the command line, for recovering what a failed
//! iteration left behind.
//!
//! The above is the JSONL format, the default. The [`Layout`]'s naming (`[aggregate]`,
//! see `crate::shards::naming`) chooses the file names and the format: `safetensors` and
//! `torch` shards are dicts of tensors concatenated along dim 0 into one safetensors file
//! (`crate::shards::safetensors`), and `command` hands the shard files to a user merge
//! command (`crate::shards::command`). Surveying ranks, refusing gaps, the temporary file,
//! the atomic publication and the manifest are the same for every format; a tensor shard
//! that cannot be read (or an input the merge command reports unreadable) fails the merge
//! naming it, or with `allow_missing` is left out and recorded (`DropKind::Unreadable`).
//!
//! The pieces: `survey` finds what each rank left, `jsonl` streams and validates records,
//! `tensors` and `command` merge the other formats, `manifest` and `error` are what a
//! merge returns, and `cli` is `rl-node aggregate`; this module holds [`merge`], which
//! runs them and publishes the result.

mod cli;
mod command;
mod error;
mod jsonl;
mod manifest;
mod survey;
mod tensors;

pub use cli::{main, AggregateArgs};
pub use error::AggregateError;
pub use manifest::{
    manifest_path, DigestAlgorithm, DropKind, Dropped, Manifest, MergedPiece, MergedTensor,
    RankDigest, RankEntry, RankStatus, RolloutModel, JSONL_DIGEST, MANIFEST_FORMAT,
};

use command::merge_command;
use jsonl::merge_sources;
use survey::{list_dir, survey};
use tensors::merge_tensors;

use crate::layout::Layout;
use crate::process::Registry;
use crate::shards::naming::Format;
use crate::store::SharedDir;
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Longest record accepted by default (a longer line is treated as invalid).
pub const DEFAULT_MAX_RECORD_BYTES: u64 = 1 << 30;

const IO_BUF: usize = 1 << 20;
/// Call `tick` at least this often (input bytes).
const TICK_BYTES: u64 = 16 << 20;

/// How to merge. The format and file names come from the [`Layout`]'s naming.
#[derive(Clone)]
pub struct MergeOptions {
    /// Merge what exists when a rank is missing or only partial (otherwise that is
    /// [`AggregateError::Incomplete`] and nothing is published); also drop an unreadable
    /// tensor shard (or one the merge command reports unreadable) instead of failing.
    pub allow_missing: bool,
    /// Merged file; default `Layout::aggregated(iteration, split)`.
    pub out: Option<PathBuf>,
    /// Replace an existing merged file (`rl-node aggregate --overwrite`). Otherwise an
    /// existing one is refused before anything is read ([`AggregateError::Exists`]) and
    /// the merge is renamed into place without replacing anything created meanwhile.
    pub replace: bool,
    /// Reject Python's NaN / Infinity / -Infinity (wherever a line is parsed as JSON).
    pub strict_json: bool,
    /// How much of each JSONL line is checked (`[aggregate] validate`).
    pub validate: Validate,
    /// Longest record accepted; a longer line counts as invalid.
    pub max_record_bytes: u64,
    /// Format `command`: the merge command (`[aggregate] command`) and its timeout.
    pub command: String,
    pub command_timeout: Duration,
    /// Between SIGTERM and SIGKILL when the merge command is stopped.
    pub kill_grace: Duration,
    /// Where the merge command's output goes; `None`: rl-node's stderr.
    pub command_log: Option<PathBuf>,
    /// A node's process registry, so the merge command is stopped with the node.
    pub registry: Option<Arc<Registry>>,
    /// Variables the merge command gets besides its own (`[env]`).
    pub env: Vec<(String, String)>,
    /// Called immediately before the merged file is published: an error (this node's
    /// generation was replaced) stops the merge with nothing published.
    pub fence: Option<Fence>,
    /// Pipelined runs: recorded in the manifest.
    pub rollout_model: Option<manifest::RolloutModel>,
    /// The ranks whose command wrote its shard name itself, with their journal's note, as
    /// their arrivals at the barrier before the node's merge carried them; `None`
    /// (`rl-node aggregate`): read from each rank's journal.
    pub adopted: Option<BTreeMap<u32, String>>,
    /// The ranks whose rollout command failed, with why, as their arrivals at the barrier
    /// before the node's merge carried them (`phases.<phase>.on-failure =
    /// "merge-survivors"`): left out unread, recorded as `failed` in the manifest, and no
    /// gap. Empty for `rl-node aggregate`, which salvages what such a rank left.
    pub failed: BTreeMap<u32, String>,
    /// A merge broken on purpose (the simulator's own tests; ignored without the `sim`
    /// feature, see `crate::protocol::mutation`).
    #[doc(hidden)]
    pub mutation: Option<Mutation>,
}

pub use crate::shards::naming::Validate;

/// A deliberately broken merge, for the simulator's own tests (never set by the node on
/// its own): shows that the simulator catches records merged twice.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A rank's partial file beside its committed shard is merged too.
    PartialToo,
}

/// A check that this node may still publish (see `node::fence`).
pub type Fence = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

impl std::fmt::Debug for MergeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergeOptions")
            .field("allow_missing", &self.allow_missing)
            .field("out", &self.out)
            .field("replace", &self.replace)
            .field("strict_json", &self.strict_json)
            .field("validate", &self.validate)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("command", &self.command)
            .field("command_timeout", &self.command_timeout)
            .field("kill_grace", &self.kill_grace)
            .field("command_log", &self.command_log)
            .field("registry", &self.registry.is_some())
            .field("rollout_model", &self.rollout_model)
            .field("adopted", &self.adopted)
            .field("failed", &self.failed)
            .finish()
    }
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            allow_missing: false,
            out: None,
            replace: false,
            strict_json: false,
            validate: Validate::default(),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            command: String::new(),
            command_timeout: Duration::from_secs(3600),
            kill_grace: Duration::from_secs(10),
            command_log: None,
            registry: None,
            env: Vec::new(),
            fence: None,
            rollout_model: None,
            adopted: None,
            failed: BTreeMap::new(),
            mutation: None,
        }
    }
}

impl MergeOptions {
    /// The defaults with the merge command and validation level of `[aggregate]` (the
    /// level was checked when the configuration was loaded).
    pub fn from_config(a: &crate::config::Aggregate) -> MergeOptions {
        MergeOptions {
            validate: a.validate.parse().unwrap_or_default(),
            command: a.command.clone(),
            command_timeout: a.timeout,
            ..MergeOptions::default()
        }
    }
}

/// Merge the shards of `split` of `iteration` for ranks `0..num_ranks` (see the module
/// documentation) into `opts.out` (default `layout.aggregated(iteration, split)`) and its
/// manifest, on `store` (the node's shared directory; `rl-node aggregate` uses the real
/// one). `tick` is called regularly so a long merge keeps a watchdog informed.
///
/// The JSONL merge reads and writes through `store` alone; the other formats hand real
/// files to a tensor library or a user's command, so they need the real directory.
pub fn merge(
    store: &dyn SharedDir,
    layout: &Layout,
    iteration: u64,
    split: &str,
    num_ranks: u32,
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<Manifest, AggregateError> {
    let format = check_request(layout, split, num_ranks, opts)?;
    let (mut ranks, mut problems) = survey_ranks(store, layout, iteration, split, num_ranks, opts)?;
    if !opts.allow_missing && ranks.iter().any(|r| r.status.is_gap()) {
        return Err(incomplete(layout, iteration, split, ranks));
    }

    let out = opts
        .out
        .clone()
        .unwrap_or_else(|| layout.aggregated(iteration, split));
    let out_dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !opts.replace {
        match store.lstat(&out) {
            Ok(Some(_)) => return Err(AggregateError::Exists { path: out }),
            Ok(None) => {}
            Err(e) => return Err(werr(&out)(e)),
        }
    }
    store.create_dir_all(&out_dir).map_err(werr(&out_dir))?;
    let tmp = temp_path(&out);
    let merged = write_merged(
        store, layout, iteration, split, &mut ranks, opts, &tmp, tick,
    );
    let mut extras = match merged {
        Ok(extras) => extras,
        Err(e) => {
            let _ = store.remove_file(&tmp);
            return Err(e);
        }
    };

    problems.extend(std::mem::take(&mut extras.problems));
    let mut manifest = Manifest::new(iteration, split, &out, opts, ranks, problems);
    if format != Format::Jsonl {
        manifest.shard_format = Some(format.name().to_string());
        manifest.output_bytes = extras.output_bytes;
        manifest.output_sha256 = extras.output_sha256;
        manifest.command = extras.command;
        manifest.tensors = extras.tensors;
    }
    if let Err(e) = publish(store, opts, &tmp, &out, &out_dir, &manifest) {
        let _ = store.remove_file(&tmp);
        return Err(e);
    }
    Ok(manifest)
}

/// Refuse a merge that cannot be done before looking at any file: a split that is not a
/// plain name, no ranks, or a format this build or configuration cannot merge.
fn check_request(
    layout: &Layout,
    split: &str,
    num_ranks: u32,
    opts: &MergeOptions,
) -> Result<Format, AggregateError> {
    if split.is_empty() || split.contains(['/', '\\']) || split.starts_with('.') {
        return Err(AggregateError::BadSplit {
            split: split.to_string(),
        });
    }
    if num_ranks == 0 {
        return Err(AggregateError::NoRanks);
    }
    let format = layout.naming().format();
    if format == Format::Command && opts.command.trim().is_empty() {
        return Err(AggregateError::Unsupported {
            message: "format command needs a merge command ([aggregate] command, e.g. \"python3 merge.py --output {output} {inputs}\")".into(),
        });
    }
    if format == Format::Torch && !crate::shards::torch_available() {
        return Err(AggregateError::Unsupported {
            message: "format torch needs an rl-node built with the `torch` cargo feature (cargo build --release --features torch)".into(),
        });
    }
    Ok(format)
}

/// What each of ranks `0..num_ranks` left, and a problem for every shard or partial file
/// of a rank beyond them.
fn survey_ranks(
    store: &dyn SharedDir,
    layout: &Layout,
    iteration: u64,
    split: &str,
    num_ranks: u32,
    opts: &MergeOptions,
) -> Result<(Vec<RankEntry>, Vec<String>), AggregateError> {
    let rel = |p: &Path| -> String {
        p.strip_prefix(layout.root())
            .unwrap_or(p)
            .display()
            .to_string()
    };
    // Shards and partial files usually share a directory (rollouts/iter-NNNN/<split>/).
    let dir_of = |p: PathBuf| p.parent().map(Path::to_path_buf).unwrap_or_default();
    let shard_dir = dir_of(layout.shard(iteration, split, 0));
    let partial_dir = dir_of(layout.shard_partial(iteration, split, 0));
    let listing = list_dir(store, &shard_dir)?;
    let partial_listing = if partial_dir == shard_dir {
        None
    } else {
        Some(list_dir(store, &partial_dir)?)
    };
    let mut problems = Vec::new();
    let mut ranks = Vec::with_capacity(num_ranks as usize);
    for rank in 0..num_ranks {
        if let Some(reason) = opts.failed.get(&rank) {
            ranks.push(RankEntry::failed(rank, reason));
            continue;
        }
        let names = partial_listing.as_ref().unwrap_or(&listing);
        let adopted = opts.adopted.as_ref();
        let (entry, beside) = survey(
            store, layout, iteration, split, rank, names, &listing, adopted, &rel,
        )?;
        let doubled = beside
            .filter(|_| crate::protocol::mutation(opts.mutation) == Some(Mutation::PartialToo));
        if let Some(partial) = doubled {
            let mut again = entry.clone();
            again.source = Some(partial);
            ranks.push(entry);
            ranks.push(again);
            continue;
        }
        ranks.push(entry);
    }
    let mut extra = |dir: &Path, name: &String, in_shard: bool, in_partial: bool| {
        let found = layout
            .naming()
            .rank_of(name, iteration, split, in_shard, in_partial);
        if let Some((r, _)) = found {
            if r >= num_ranks {
                problems.push(format!(
                    "{} exists but there {} only {num_ranks} rank{}: not merged",
                    rel(&dir.join(name)),
                    if num_ranks == 1 { "is" } else { "are" },
                    if num_ranks == 1 { "" } else { "s" }
                ));
            }
        }
    };
    for name in &listing {
        extra(&shard_dir, name, true, partial_listing.is_none());
    }
    for name in partial_listing.iter().flatten() {
        extra(&partial_dir, name, false, true);
    }
    Ok((ranks, problems))
}

/// The refusal of a merge with gaps (without `allow_missing`): every rank that has no
/// committed shard, and what it has instead.
fn incomplete(
    layout: &Layout,
    iteration: u64,
    split: &str,
    ranks: Vec<RankEntry>,
) -> AggregateError {
    let gaps: Vec<&RankEntry> = ranks.iter().filter(|r| r.status.is_gap()).collect();
    let said: Vec<String> = gaps
        .iter()
        .map(|r| match r.status {
            RankStatus::Partial => format!(
                "rank {} has only a partial shard {} (its command did not finish)",
                r.rank,
                layout
                    .root()
                    .join(r.source.as_deref().unwrap_or(""))
                    .display()
            ),
            _ => format!(
                "rank {} has no shard ({} does not exist)",
                r.rank,
                layout.shard(iteration, split, r.rank).display()
            ),
        })
        .collect();
    let missing = gaps
        .iter()
        .filter(|r| r.status == RankStatus::Missing)
        .map(|r| r.rank)
        .collect();
    let partial = gaps
        .iter()
        .filter(|r| r.status == RankStatus::Partial)
        .map(|r| r.rank)
        .collect();
    AggregateError::Incomplete {
        missing,
        partial,
        message: format!("{}; nothing was published", said.join(", ")),
        ranks,
    }
}

/// Write the merged file to `tmp`, in the layout's format, and fsync it.
#[allow(clippy::too_many_arguments)]
fn write_merged(
    store: &dyn SharedDir,
    layout: &Layout,
    iteration: u64,
    split: &str,
    ranks: &mut [RankEntry],
    opts: &MergeOptions,
    tmp: &Path,
    tick: &mut dyn FnMut(),
) -> Result<Extras, AggregateError> {
    match layout.naming().format() {
        Format::Jsonl => {}
        format @ (Format::Safetensors | Format::Torch) => {
            return merge_tensors(layout, format, ranks, opts, tmp, tick);
        }
        Format::Command => {
            return merge_command(layout, iteration, split, ranks, opts, tmp, tick);
        }
    }
    // An OS file where the store has them, so that the merge can copy into it in the
    // kernel. An empty merge (every rank's shard empty) is not fsynced: it has no data,
    // and the manifest's publish fsyncs the directory after the rename ([`publish`]),
    // which makes its name and inode durable before the merge is journaled.
    // Whether it is empty is known only after the merge: it fills in each rank's bytes.
    let empty = |ranks: &[RankEntry]| ranks.iter().all(|r| r.bytes == 0);
    if let Some(f) = store.create_os_file(tmp).map_err(werr(tmp))? {
        let f = merge_sources(store, f, tmp, layout.root(), ranks, opts, tick)?;
        if !empty(ranks) {
            f.sync_all().map_err(werr(tmp))?;
        }
    } else {
        let f = store.create_data(tmp).map_err(werr(tmp))?;
        let mut f = merge_sources(store, f, tmp, layout.root(), ranks, opts, tick)?;
        if !empty(ranks) {
            f.sync_all().map_err(werr(tmp))?;
        }
    }
    Ok(Extras::default())
}

/// Put the merged file `tmp` in place as `out` and its manifest beside it.
fn publish(
    store: &dyn SharedDir,
    opts: &MergeOptions,
    tmp: &Path,
    out: &Path,
    out_dir: &Path,
    manifest: &Manifest,
) -> Result<(), AggregateError> {
    let mpath = manifest_path(out);
    // An old manifest must not describe the new merged file, even for a moment.
    match store.remove_file(&mpath) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(werr(&mpath)(e)),
    }
    if let Some(fence) = &opts.fence {
        fence().map_err(|reason| AggregateError::Fenced { reason })?;
    }
    let renamed = if opts.replace {
        store.rename(tmp, out)
    } else {
        store.rename_noreplace(tmp, out)
    };
    renamed.map_err(|e| match e.kind() {
        io::ErrorKind::AlreadyExists => AggregateError::Exists {
            path: out.to_path_buf(),
        },
        _ => werr(out)(e),
    })?;
    // The manifest's durable publish syncs this same directory after its own rename,
    // which makes the merged file's rename durable with it: one directory sync for both.
    // A crash before it may lose the merged file's name too, which costs nothing: the
    // merge is not journaled yet, so it runs again.
    debug_assert_eq!(
        mpath.parent(),
        Some(out_dir),
        "the manifest lies beside its file"
    );
    store.publish_json(&mpath, manifest).map_err(werr(&mpath))
}

/// The error of a failed write to `path`.
fn werr(path: &Path) -> impl FnOnce(io::Error) -> AggregateError {
    let path = path.to_path_buf();
    move |source| AggregateError::Write { path, source }
}

/// Say `msg` as a warning: a log line in a node (a process whose log subscriber is
/// installed; the message names the file, and so the rank), else a `warning:` line on
/// stderr (`rl-node aggregate`).
fn warn(msg: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{msg}");
    } else {
        crate::errln!("warning: {msg}");
    }
}

/// What a non-JSONL merge adds to the manifest.
#[derive(Default)]
struct Extras {
    tensors: Vec<MergedTensor>,
    output_bytes: Option<u64>,
    output_sha256: Option<String>,
    command: Option<String>,
    problems: Vec<String>,
}

/// A shard that cannot be read: fatal without `allow_missing`, else the rank is left out
/// and that is recorded.
fn unreadable(
    entry: &mut RankEntry,
    path: &Path,
    what: &str,
    reason: String,
    opts: &MergeOptions,
) -> Result<(), AggregateError> {
    let committed = entry.status == RankStatus::Complete;
    if !opts.allow_missing {
        return Err(AggregateError::Unreadable {
            rank: entry.rank,
            path: path.to_path_buf(),
            format: what.to_string(),
            reason,
            committed,
        });
    }
    let shown = entry.source.clone().unwrap_or_default();
    entry.problems.push(format!(
        "{shown}: unreadable ({what}: {reason}); left out of the merge"
    ));
    entry.dropped.push(Dropped {
        kind: DropKind::Unreadable,
        line: 0,
        bytes: entry.source_bytes,
        reason,
    });
    entry.records = 0;
    entry.bytes = 0;
    entry.digest = None;
    entry.sha256 = None;
    Ok(())
}

fn temp_path(out: &Path) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    crate::layout::temp_path(
        out,
        &format!(
            "{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ),
    )
}

/// A byte count for people: `512 B`, `1.5 MiB`.
fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> MergeOptions {
        MergeOptions::default()
    }

    #[test]
    fn merge_refuses_gaps_without_touching_the_output() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(1, "train")).unwrap();
        std::fs::write(l.shard(1, "train", 0), "{}\n").unwrap();
        std::fs::write(l.aggregated(1, "train"), "old\n").unwrap();
        let e = merge(&crate::store::Fs, &l, 1, "train", 2, &opts(), &mut || {}).unwrap_err();
        assert!(matches!(&e, AggregateError::Incomplete { missing, .. } if missing == &[1]));
        assert!(e.to_string().contains("rank 1 has no shard"), "{e}");
        assert!(e.to_string().contains("rank-1.jsonl"), "{e}");
        assert_eq!(
            std::fs::read_to_string(l.aggregated(1, "train")).unwrap(),
            "old\n"
        );
        let names: Vec<_> = std::fs::read_dir(d.path().join("rollouts/iter-0001"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    /// A shard the rank's command wrote itself is marked adopted in the manifest: from the
    /// notes the node's merge was handed (the ranks' arrivals carried them; no journal is
    /// read), or, for `rl-node aggregate`, from each rank's journal.
    #[test]
    fn adopted_shards_are_named_from_the_notes_handed_over_else_from_the_journals() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(1, "train")).unwrap();
        std::fs::create_dir_all(l.journal(1).parent().unwrap()).unwrap();
        for r in 0..2 {
            std::fs::write(l.shard(1, "train", r), "{}\n").unwrap();
        }
        let entry = crate::protocol::journal::Entry {
            run_id: "run".into(),
            gen: 1,
            rank: 1,
            iteration: 1,
            item: "rollout-train".into(),
            at: String::new(),
            note: Some("adopted: the command wrote rank-1.jsonl itself".into()),
            failed: None,
            checkpoint: None,
        };
        let line = format!("{}\n", serde_json::to_string(&entry).unwrap());
        std::fs::write(l.journal(1), line).unwrap();
        let adopted = |o: &MergeOptions| {
            let out = l.aggregated(1, "train");
            let _ = std::fs::remove_file(&out);
            let _ = std::fs::remove_file(manifest_path(&out));
            let m = merge(&crate::store::Fs, &l, 1, "train", 2, o, &mut || {}).unwrap();
            let ranks = m.ranks.into_iter();
            ranks.map(|e| e.adopted).collect::<Vec<_>>()
        };
        assert_eq!(adopted(&opts()), vec![None, entry.note.clone()]);
        let handed = MergeOptions {
            adopted: Some([(0, "adopted: as rank 0 said".to_string())].into()),
            ..opts()
        };
        assert_eq!(
            adopted(&handed),
            vec![Some("adopted: as rank 0 said".to_string()), None],
            "the notes handed over, and no journal read"
        );
    }

    /// A partial file left beside a committed shard is named in the rank's problems: the
    /// merge looks for one only where the listing shows it (one stat less per rank in
    /// every merge), and still finds it.
    #[test]
    fn a_partial_file_beside_a_committed_shard_is_named() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(1, "train")).unwrap();
        for r in 0..2 {
            std::fs::write(l.shard(1, "train", r), "{}\n").unwrap();
        }
        std::fs::write(l.shard_partial_gen(1, "train", 1, 2), "{\"torn\"").unwrap();
        let m = merge(&crate::store::Fs, &l, 1, "train", 2, &opts(), &mut || {}).unwrap();
        assert!(m.ranks[0].problems.is_empty(), "{:?}", m.ranks[0]);
        assert!(
            m.ranks[1].problems[0].starts_with("a partial file also exists and was ignored"),
            "{:?}",
            m.ranks[1]
        );
    }

    #[test]
    fn merge_never_replaces_an_existing_output_unless_asked() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(1, "train")).unwrap();
        std::fs::write(l.shard(1, "train", 0), "{\"new\":1}\n").unwrap();
        let out = l.aggregated(1, "train");
        std::fs::write(&out, "trained on\n").unwrap();
        let e = merge(&crate::store::Fs, &l, 1, "train", 1, &opts(), &mut || {}).unwrap_err();
        assert!(
            matches!(&e, AggregateError::Exists { path } if path == &out),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "trained on\n");
        assert!(!manifest_path(&out).exists());
        assert_eq!(std::fs::read_dir(out.parent().unwrap()).unwrap().count(), 2);
        // A symlink at the output counts as a file there: not followed, not replaced.
        std::fs::remove_file(&out).unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &out).unwrap();
        let e = merge(&crate::store::Fs, &l, 1, "train", 1, &opts(), &mut || {}).unwrap_err();
        assert!(matches!(e, AggregateError::Exists { .. }), "{e}");
        assert!(!d.path().join("elsewhere").exists());
        std::fs::remove_file(&out).unwrap();
        std::fs::write(&out, "an earlier salvage\n").unwrap();
        let replace = MergeOptions {
            replace: true,
            ..opts()
        };
        merge(&crate::store::Fs, &l, 1, "train", 1, &replace, &mut || {}).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "{\"new\":1}\n");
    }

    #[test]
    fn merge_publishes_in_rank_order_with_a_manifest() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(2, "eval")).unwrap();
        std::fs::write(l.shard(2, "eval", 1), "{\"r\":1}\n").unwrap();
        std::fs::write(l.shard(2, "eval", 0), "{\"r\":0}").unwrap();
        let mut ticks = 0;
        let m = merge(&crate::store::Fs, &l, 2, "eval", 2, &opts(), &mut || {
            ticks += 1
        })
        .unwrap();
        assert!(ticks >= 2);
        let out = l.aggregated(2, "eval");
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "{\"r\":0}\n{\"r\":1}\n"
        );
        assert!(m.complete);
        assert_eq!((m.records, m.bytes), (2, 16));
        assert_eq!(m.ranks[1].offset, 8);
        let on_disk: Manifest =
            serde_json::from_slice(&std::fs::read(manifest_path(&out)).unwrap()).unwrap();
        assert_eq!(on_disk, m);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(out.parent().unwrap()).unwrap().count(), 3);
    }

    /// A rank whose rollout failed (`merge-survivors`) is left out unread, whatever it
    /// left (here a partial file and a shard its command wrote itself before failing),
    /// recorded as failed with its reason, and is no gap; the others merge in rank order.
    #[test]
    fn a_failed_rank_is_left_out_and_named_in_the_manifest() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(1, "train")).unwrap();
        for r in [0, 2] {
            std::fs::write(l.shard(1, "train", r), format!("{{\"r\":{r}}}\n")).unwrap();
        }
        std::fs::write(
            l.shard_partial_gen(1, "train", 1, 1),
            "{\"r\":\"partial\"}\n",
        )
        .unwrap();
        let failed = MergeOptions {
            failed: [(1, "the rollout command failed with exit code 7".to_string())].into(),
            ..opts()
        };
        let m = merge(&crate::store::Fs, &l, 1, "train", 3, &failed, &mut || {}).unwrap();
        let out = l.aggregated(1, "train");
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "{\"r\":0}\n{\"r\":2}\n"
        );
        assert_eq!(m.failed_ranks, [1]);
        assert!(m.missing_ranks.is_empty() && m.partial_ranks.is_empty());
        assert!(!m.complete, "a merge without a rank is not complete");
        assert_eq!(m.records, 2);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(manifest_path(&out)).unwrap()).unwrap();
        let r1 = &json["ranks"][1];
        assert_eq!(r1["status"], "failed", "{json}");
        assert_eq!(r1["reason"], "the rollout command failed with exit code 7");
        assert_eq!(
            (&r1["records"], &r1["source"]),
            (&0.into(), &serde_json::Value::Null)
        );
        assert!(json["ranks"][0].get("reason").is_none(), "{json}");
        // Without the failure handed over, the partial file is a gap, as always.
        std::fs::remove_file(&out).unwrap();
        std::fs::remove_file(manifest_path(&out)).unwrap();
        let e = merge(&crate::store::Fs, &l, 1, "train", 3, &opts(), &mut || {}).unwrap_err();
        assert!(matches!(&e, AggregateError::Incomplete { partial, .. } if partial == &[1]));
    }
}
