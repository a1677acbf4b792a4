//! Merging rank shards into one file per iteration and split, with partial recovery.
//!
//! For each rank the merge takes the committed shard (`rank-R.jsonl`, status
//! `complete`), else the file its command was writing when it stopped
//! (`rank-R.partial.jsonl`, status `partial`), else nothing (`missing`), and appends its
//! records in rank order, then file order. Records are streamed line by line (memory is
//! bounded by the longest record, never by the file; one thread reads and validates while
//! another hashes and writes) into a temporary file beside the output, which is fsynced
//! and renamed over
//! `rollouts/iter-NNNN/<split>.jsonl`; a manifest `<out>.manifest.json` beside it says
//! where every byte came from. A crash never leaves a half-written merged file under the
//! final name, and a manifest, when present, describes the merged file beside it.
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

use crate::layout::Layout;
use crate::node::procs::Registry;
use crate::shards::command::{self, CommandError};
use crate::shards::naming::Format;
use crate::shards::safetensors as st;
use crate::shards::ShardError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read as _, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The `format` of every manifest this version writes.
pub const MANIFEST_FORMAT: &str = "rl-node-aggregate/1";
/// Longest record accepted by default (a longer line is treated as invalid).
pub const DEFAULT_MAX_RECORD_BYTES: u64 = 1 << 30;

const IO_BUF: usize = 1 << 20;
/// A line longer than this is checked as it grows (at 1, 2, 4, … MiB) so that garbage
/// without newlines (e.g. the zero-filled tail a crash can leave) is not buffered whole.
const FIRST_STEP: u64 = 1 << 20;
/// Call `tick` at least this often (input bytes).
const TICK_BYTES: u64 = 16 << 20;

// ---------------------------------------------------------------------------------------
// Command line

/// `rl-node aggregate`: merge what an iteration's ranks left (committed shards, else
/// partial files) into one JSONL file with a manifest.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Shard format and names come from the [aggregate] section of --config (or --format): jsonl, safetensors, torch or command; see docs/formats.md.\n\nExit codes: 0 merged (every rank complete, or --allow-missing), 1 a rank is missing or partial, or a shard unreadable, without --allow-missing, ranks disagree on tensors, a committed JSONL shard is corrupt or the merge command failed (nothing published), 2 usage or configuration error."
)]
pub struct AggregateArgs {
    /// The run's shared directory.
    #[arg(long, value_name = "DIR")]
    pub log_path: Option<String>,
    /// The run's configuration file, for its `[aggregate]` settings (shard names, format).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Iteration to merge (1, 2, …).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub iteration: u64,
    /// Which rollout to merge.
    #[arg(long, value_name = "SPLIT", value_parser = ["train", "eval"])]
    pub split: String,
    /// Merge what exists even when ranks are missing or only partial (default: refuse
    /// and publish nothing unless every rank committed its shard).
    #[arg(long)]
    pub allow_missing: bool,
    /// The merged file (default: aggregate.output-name, <log-path>/rollouts/iter-NNNN/<split>.jsonl
    /// for JSONL); the manifest goes beside it as <FILE>.manifest.json.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Number of ranks (default: num_nodes of <log-path>/.rl-node/cluster.json; required
    /// when that file is absent).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub num_ranks: Option<u32>,
    /// Print the manifest as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Reject NaN, Infinity and -Infinity (accepted by default, as Python's json module
    /// writes and reads them).
    #[arg(long)]
    pub strict_json: bool,
    /// Longest record accepted; a longer line counts as invalid.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX_RECORD_BYTES)]
    pub max_record_bytes: u64,
    /// Shard format (overrides aggregate.format of --config / RL_NODE_AGGREGATE_FORMAT);
    /// shard and merged file names come from the [aggregate] section.
    #[arg(long, value_name = "FORMAT", value_parser = ["auto", "jsonl", "safetensors", "torch", "command"])]
    pub format: Option<String>,
}

/// Minimal view of `.rl-node/cluster.json`: only the field the merge needs.
#[derive(Deserialize)]
struct ClusterSize {
    num_nodes: u32,
}

/// `rl-node aggregate`. `config` is the global `--config` file: its `[aggregate]` section
/// (with the `RL_NODE_AGGREGATE_*` environment and `--format`) names and formats the shards.
pub fn main(args: AggregateArgs, log_path: Option<String>, config: Option<PathBuf>) -> i32 {
    use crate::exit;
    let overrides: Vec<crate::config::CliOverride> = args
        .format
        .iter()
        .map(|f| crate::config::CliOverride {
            flag: "--format".into(),
            key: "aggregate.format",
            value: f.clone(),
        })
        .collect();
    let loaded = match crate::config::load(
        config.as_deref(),
        &|name| std::env::var(name).ok(),
        &overrides,
    ) {
        Ok(l) => l,
        Err(e) => {
            crate::errln!("error: {e}");
            return exit::USAGE;
        }
    };
    let Some(root) = log_path
        .or_else(|| Some(loaded.config.cluster.log_path.clone()))
        .filter(|p| !p.trim().is_empty())
    else {
        crate::errln!(
            "error: rl-node aggregate needs --log-path DIR (or RL_NODE_CLUSTER_LOG_PATH)"
        );
        return exit::USAGE;
    };
    let naming = loaded.config.naming();
    let format = naming.format();
    let layout = Layout::new(&root).with_naming(naming);
    if !layout.root().is_dir() {
        crate::errln!("error: --log-path {root}: no such directory");
        return exit::USAGE;
    }
    let cluster = layout.cluster();
    let recorded = match crate::store::read(&cluster) {
        Ok(None) => None,
        Ok(Some(bytes)) => match serde_json::from_slice::<ClusterSize>(&bytes) {
            Ok(c) => Some(c.num_nodes),
            Err(e) if args.num_ranks.is_none() => {
                crate::errln!(
                    "error: cannot read num_nodes from {}: {e}; pass --num-ranks N",
                    cluster.display()
                );
                return exit::USAGE;
            }
            Err(_) => None,
        },
        Err(e) if args.num_ranks.is_none() => {
            crate::errln!(
                "error: cannot read {}: {e}; pass --num-ranks N",
                cluster.display()
            );
            return exit::USAGE;
        }
        Err(_) => None,
    };
    let num_ranks = match (args.num_ranks, recorded) {
        (Some(n), Some(c)) if n != c => {
            crate::errln!(
                "note: --num-ranks {n} overrides num_nodes {c} of {}",
                cluster.display()
            );
            n
        }
        (Some(n), _) => n,
        (None, Some(c)) if c > 0 => c,
        (None, Some(_)) => {
            crate::errln!(
                "error: {} says num_nodes 0; pass --num-ranks N",
                cluster.display()
            );
            return exit::USAGE;
        }
        (None, None) => {
            crate::errln!(
                "error: {} does not exist, so the number of ranks is unknown; pass --num-ranks N",
                cluster.display()
            );
            return exit::USAGE;
        }
    };
    let opts = MergeOptions {
        allow_missing: args.allow_missing,
        out: args.out.clone(),
        strict_json: args.strict_json,
        max_record_bytes: args.max_record_bytes.max(1),
        // `[env]` as the merge command gets it in a node; outside one, node values
        // such as {data_path} have none here.
        env: loaded
            .config
            .env
            .iter()
            .map(|(k, t)| {
                let t = crate::config::template::Template::parse(t).expect("validated at load");
                (k.clone(), t.render_raw(&Default::default()))
            })
            .collect(),
        ..MergeOptions::from_config(&loaded.config.aggregate)
    };
    let out = opts
        .out
        .clone()
        .unwrap_or_else(|| layout.aggregated(args.iteration, &args.split));
    let shard_dir = layout
        .shard(args.iteration, &args.split, 0)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    crate::errln!(
        "rl-node aggregate: iteration {}, {}, {num_ranks} rank{} in {}{}",
        args.iteration,
        args.split,
        if num_ranks == 1 { "" } else { "s" },
        shard_dir.display(),
        if format == Format::Jsonl {
            String::new()
        } else {
            format!(" ({format})")
        }
    );
    match merge(
        &layout,
        args.iteration,
        &args.split,
        num_ranks,
        &opts,
        &mut || {},
    ) {
        Ok(m) => {
            crate::err!(
                "{}",
                render_ranks_in(&m.ranks, if format.is_tensor() { "row" } else { "record" })
            );
            crate::err!("{}", render_problems(&m));
            if format.is_tensor() {
                crate::errln!(
                    "merged {} tensor{}, {} row{} ({}) into {}; manifest {}",
                    m.tensors.len(),
                    if m.tensors.len() == 1 { "" } else { "s" },
                    m.records,
                    if m.records == 1 { "" } else { "s" },
                    human_bytes(m.output_bytes.unwrap_or(m.bytes)),
                    out.display(),
                    manifest_path(&out).display()
                );
            } else if format == Format::Command {
                crate::errln!(
                    "merged {} shard{} ({}) with the merge command into {} ({}); manifest {}",
                    m.ranks.iter().filter(|r| r.sha256.is_some()).count(),
                    if m.ranks.iter().filter(|r| r.sha256.is_some()).count() == 1 {
                        ""
                    } else {
                        "s"
                    },
                    human_bytes(m.bytes),
                    out.display(),
                    human_bytes(m.output_bytes.unwrap_or(0)),
                    manifest_path(&out).display()
                );
            } else {
                crate::errln!(
                    "merged {} record{} ({}) into {}; manifest {}",
                    m.records,
                    if m.records == 1 { "" } else { "s" },
                    human_bytes(m.bytes),
                    out.display(),
                    manifest_path(&out).display()
                );
            }
            if args.json {
                crate::outln!("{}", serde_json::to_string_pretty(&m).expect("json"));
            }
            exit::DONE
        }
        Err(e) => {
            if let AggregateError::Incomplete { ranks, .. } = &e {
                crate::err!("{}", render_ranks(ranks));
                let m = Manifest::new(
                    args.iteration,
                    &args.split,
                    &out,
                    &opts,
                    ranks.clone(),
                    vec![],
                );
                crate::err!("{}", render_problems(&m));
                crate::errln!("error: {e}");
                if let Some(hint) = other_format_hint(&layout, args.iteration, &args.split) {
                    crate::errln!("hint: {hint}");
                }
                crate::errln!("(--allow-missing merges what exists)");
            } else {
                crate::errln!("error: {e}");
                if let AggregateError::Command { source } = &e {
                    if !source.tail().is_empty() {
                        crate::errln!("  last lines of the log:");
                        for line in source.tail().lines() {
                            crate::errln!("  | {line}");
                        }
                    }
                }
            }
            if args.json {
                crate::outln!(
                    "{}",
                    serde_json::to_string_pretty(&e.to_json()).expect("json")
                );
            }
            if matches!(e, AggregateError::Unsupported { .. }) {
                exit::USAGE
            } else {
                exit::FAILED
            }
        }
    }
}

/// When no rank has a shard under the configured names but default-named shards of
/// another format are there, say how to merge those.
fn other_format_hint(layout: &Layout, iteration: u64, split: &str) -> Option<String> {
    use crate::shards::naming::{Naming, DEFAULT_OUTPUT_NAME, DEFAULT_SHARD_NAME};
    let dir = layout.rollout_dir(iteration, split);
    let names = list_dir(&dir).ok()?;
    for f in [Format::Jsonl, Format::Safetensors, Format::Torch] {
        // (torch is refused by a build without the feature)
        let Ok(naming) = Naming::new(f.name(), DEFAULT_SHARD_NAME, "", DEFAULT_OUTPUT_NAME) else {
            continue;
        };
        if f == layout.naming().format() && naming == *layout.naming() {
            continue;
        }
        if let Some(n) = names
            .iter()
            .find(|n| naming.rank_of(n, iteration, split, true, true).is_some())
        {
            return Some(format!(
                "{} is a {f} shard: pass --format {f}, or --config with the run's [aggregate] section",
                dir.join(n).display()
            ));
        }
    }
    None
}

fn render_ranks(ranks: &[RankEntry]) -> String {
    render_ranks_in(ranks, "record")
}

/// Per rank: what was taken (`unit`s: records, or rows of tensor formats), else what is there.
fn render_ranks_in(ranks: &[RankEntry], unit: &str) -> String {
    let mut s = String::new();
    for r in ranks {
        let mut l = format!("  rank {:<3} {:<9}", r.rank, r.status.as_str());
        match &r.source {
            // Merged: what was taken.
            Some(src) if r.sha256.is_some() => {
                let _ = write!(
                    l,
                    " {:>9} {unit}{} {:>10}  {src}",
                    r.records,
                    if r.records == 1 { " " } else { "s" },
                    human_bytes(r.bytes)
                );
            }
            // Not read (nothing was merged): what is there.
            Some(src) => {
                let _ = write!(l, " {src} ({})", human_bytes(r.source_bytes));
            }
            None => {}
        }
        s.push_str(l.trim_end());
        s.push('\n');
    }
    s
}

fn render_problems(m: &Manifest) -> String {
    let mut s = String::new();
    let n: usize = m.problems.len() + m.ranks.iter().map(|r| r.problems.len()).sum::<usize>();
    if n > 0 {
        let _ = writeln!(s, "gaps ({n}):");
        for r in &m.ranks {
            for p in &r.problems {
                let _ = writeln!(s, "  rank {}: {p}", r.rank);
            }
        }
        for p in &m.problems {
            let _ = writeln!(s, "  {p}");
        }
    }
    s
}

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

// ---------------------------------------------------------------------------------------
// The merge

/// How to merge. The format and file names come from the [`Layout`]'s naming.
#[derive(Clone)]
pub struct MergeOptions {
    /// Merge what exists when a rank is missing or only partial (otherwise that is
    /// [`AggregateError::Incomplete`] and nothing is published); also drop an unreadable
    /// tensor shard (or one the merge command reports unreadable) instead of failing.
    pub allow_missing: bool,
    /// Merged file; default `Layout::aggregated(iteration, split)`.
    pub out: Option<PathBuf>,
    /// Reject Python's NaN / Infinity / -Infinity.
    pub strict_json: bool,
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
}

/// A check that this node may still publish (see `node::fence`).
pub type Fence = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

impl std::fmt::Debug for MergeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergeOptions")
            .field("allow_missing", &self.allow_missing)
            .field("out", &self.out)
            .field("strict_json", &self.strict_json)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("command", &self.command)
            .field("command_timeout", &self.command_timeout)
            .field("kill_grace", &self.kill_grace)
            .field("command_log", &self.command_log)
            .field("registry", &self.registry.is_some())
            .finish()
    }
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            allow_missing: false,
            out: None,
            strict_json: false,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            command: String::new(),
            command_timeout: Duration::from_secs(3600),
            kill_grace: Duration::from_secs(10),
            command_log: None,
            registry: None,
            env: Vec::new(),
            fence: None,
        }
    }
}

impl MergeOptions {
    /// The defaults with the merge command of `[aggregate]`.
    pub fn from_config(a: &crate::config::Aggregate) -> MergeOptions {
        MergeOptions {
            command: a.command.clone(),
            command_timeout: a.timeout,
            ..MergeOptions::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RankStatus {
    /// The committed shard `rank-R.jsonl`.
    Complete,
    /// Only `rank-R.partial.jsonl`: the rank's command did not finish.
    Partial,
    /// Neither exists.
    Missing,
}

impl RankStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RankStatus::Complete => "complete",
            RankStatus::Partial => "partial",
            RankStatus::Missing => "missing",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DropKind {
    /// Last line, no trailing newline, not valid JSON: the writer died mid-record.
    Torn,
    /// An invalid line in a partial file: it and everything after it were not read.
    Invalid,
    /// A tensor shard that cannot be read (truncated, not a dict of tensors), or an input
    /// the merge command reported unreadable: the whole file was left out
    /// (`--allow-missing`).
    Unreadable,
}

/// Bytes of a source that were not merged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dropped {
    pub kind: DropKind,
    /// 1-based line of the source where the dropped bytes start.
    pub line: u64,
    /// Bytes dropped (for `invalid`: from that line to the end of the file).
    pub bytes: u64,
    pub reason: String,
}

/// What the merge took from one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    pub rank: u32,
    pub status: RankStatus,
    /// The file read, relative to the log path (absent when missing).
    pub source: Option<String>,
    /// Size of that file when the merge opened it.
    pub source_bytes: u64,
    /// Where this rank's records start in the merged file.
    pub offset: u64,
    pub records: u64,
    /// Bytes merged from this rank (a newline added to a last record counts).
    pub bytes: u64,
    /// SHA-256 of exactly the merged bytes taken from this rank (absent when missing, or
    /// when the merge stopped before reading it).
    pub sha256: Option<String>,
    pub dropped: Vec<Dropped>,
    /// Earlier attempts of this rank set aside (`rank-R.partial.jsonl.stale-genG`, older
    /// generations' `rank-R.partial.gG.jsonl`, a shard committed but not journaled before a
    /// crash, `rank-R.jsonl.stale-genG`); never merged.
    pub set_aside: Vec<String>,
    /// Set when the rank's rollout command wrote the committed shard name itself (instead
    /// of `{output}`) and rl-node adopted the file: says so, from the rank's journal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted: Option<String>,
    /// Every gap or oddity of this rank, for humans (file:line where it applies).
    pub problems: Vec<String>,
}

/// One tensor of a merged safetensors file, and which rank's bytes are where in it (a
/// rank's own tensor has shape `[rows, shape[1..]…]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// `[begin, end)` in the data section, as in the file's header.
    pub data_offsets: [u64; 2],
    pub pieces: Vec<MergedPiece>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedPiece {
    pub rank: u32,
    /// dim 0 taken from this rank.
    pub rows: u64,
    /// Offset in the data section.
    pub offset: u64,
    pub bytes: u64,
}

/// `<out>.manifest.json`: deterministic (no timestamps, paths relative to the log path),
/// so the same inputs give byte-identical output and manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub iteration: u64,
    pub split: String,
    /// File name of the merged file (the manifest sits beside it).
    pub output: String,
    pub num_ranks: u32,
    pub allow_missing: bool,
    /// Every rank complete and nothing dropped.
    pub complete: bool,
    pub records: u64,
    pub bytes: u64,
    pub torn_records: u64,
    pub dropped_bytes: u64,
    pub partial_ranks: Vec<u32>,
    pub missing_ranks: Vec<u32>,
    pub ranks: Vec<RankEntry>,
    /// Problems not tied to one of the ranks (e.g. shards of ranks beyond `num_ranks`).
    pub problems: Vec<String>,
    /// The shard format, when not JSONL (`safetensors`, `torch`, `command`). For tensor
    /// formats `records` counts rows (dim 0) and `bytes` tensor data; for `command`,
    /// `bytes` and `sha256` describe the files handed to the command and `records` what
    /// its report said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_format: Option<String>,
    /// Ranks whose shard could not be read and was left out (`--allow-missing`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable_ranks: Vec<u32>,
    /// Size of the merged file (non-JSONL formats).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<u64>,
    /// SHA-256 of the merged file (format `command`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_sha256: Option<String>,
    /// The merge command template (format `command`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// The merged file's tensors (tensor formats).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<MergedTensor>,
}

impl Manifest {
    fn new(
        iteration: u64,
        split: &str,
        out: &Path,
        opts: &MergeOptions,
        ranks: Vec<RankEntry>,
        problems: Vec<String>,
    ) -> Manifest {
        let sum = |f: &dyn Fn(&RankEntry) -> u64| ranks.iter().map(f).sum::<u64>();
        let with = |s: RankStatus| -> Vec<u32> {
            ranks
                .iter()
                .filter(|r| r.status == s)
                .map(|r| r.rank)
                .collect()
        };
        let complete = ranks
            .iter()
            .all(|r| r.status == RankStatus::Complete && r.dropped.is_empty());
        Manifest {
            format: MANIFEST_FORMAT.to_string(),
            iteration,
            split: split.to_string(),
            output: out
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            num_ranks: ranks.len() as u32,
            allow_missing: opts.allow_missing,
            complete,
            records: sum(&|r| r.records),
            bytes: sum(&|r| r.bytes),
            torn_records: sum(&|r| {
                r.dropped
                    .iter()
                    .filter(|d| d.kind == DropKind::Torn)
                    .count() as u64
            }),
            dropped_bytes: sum(&|r| r.dropped.iter().map(|d| d.bytes).sum()),
            partial_ranks: with(RankStatus::Partial),
            missing_ranks: with(RankStatus::Missing),
            unreadable_ranks: ranks
                .iter()
                .filter(|r| r.dropped.iter().any(|d| d.kind == DropKind::Unreadable))
                .map(|r| r.rank)
                .collect(),
            ranks,
            problems,
            shard_format: None,
            output_bytes: None,
            output_sha256: None,
            command: None,
            tensors: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AggregateError {
    /// Some rank has no committed shard and `allow_missing` is off; nothing was published.
    #[error("{message}")]
    Incomplete {
        missing: Vec<u32>,
        partial: Vec<u32>,
        message: String,
        /// What was found for every rank (not read: records and hashes are empty).
        ranks: Vec<RankEntry>,
    },
    /// A committed shard holds a line that is not a JSON record; nothing was published.
    #[error("rank {rank}'s committed shard {}:{line} is not valid JSON ({reason}); nothing was published", .path.display())]
    Corrupt {
        rank: u32,
        path: PathBuf,
        line: u64,
        reason: String,
    },
    /// A tensor shard (or an input the merge command reported) that cannot be read;
    /// without `allow_missing` nothing was published.
    #[error("rank {rank}'s {} shard {} is unreadable ({format}): {reason}; nothing was published (--allow-missing merges the other ranks without it)", if *.committed { "committed" } else { "partial" }, .path.display())]
    Unreadable {
        rank: u32,
        path: PathBuf,
        format: String,
        reason: String,
        committed: bool,
    },
    /// Ranks disagree on tensor keys, dtypes or trailing dimensions; nothing was published.
    #[error("the ranks' shards cannot be concatenated: {reason}; nothing was published")]
    Mismatch { reason: String },
    /// The merge command failed, timed out or wrote nothing; nothing was published.
    #[error("{source}; nothing was published")]
    Command {
        #[source]
        source: CommandError,
    },
    /// The configured format cannot be merged by this build or configuration.
    #[error("{message}")]
    Unsupported { message: String },
    #[error("cannot read {} (rank {rank}): {source}", .path.display())]
    Read {
        rank: u32,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot list {}: {source}", .path.display())]
    List { path: PathBuf, source: io::Error },
    #[error("cannot write {}: {source}", .path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("invalid split {split:?}: expected a plain name such as train or eval")]
    BadSplit { split: String },
    #[error("the number of ranks must be at least 1")]
    NoRanks,
    /// The fence refused (`MergeOptions::fence`): this node's generation was replaced.
    #[error("stopped before publishing: {reason}; nothing was published")]
    Fenced { reason: String },
}

impl AggregateError {
    /// The error as JSON for `--json` (the manifest's counterpart when nothing was published).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let mut v = json!({"error": self.to_string(), "published": false});
        match self {
            AggregateError::Incomplete {
                missing,
                partial,
                ranks,
                ..
            } => {
                v["kind"] = json!("incomplete");
                v["missing_ranks"] = json!(missing);
                v["partial_ranks"] = json!(partial);
                v["ranks"] = json!(ranks);
            }
            AggregateError::Corrupt {
                rank, path, line, ..
            } => {
                v["kind"] = json!("corrupt");
                v["rank"] = json!(rank);
                v["path"] = json!(path.display().to_string());
                v["line"] = json!(line);
            }
            AggregateError::Read { rank, path, .. } => {
                v["kind"] = json!("read");
                v["rank"] = json!(rank);
                v["path"] = json!(path.display().to_string());
            }
            AggregateError::List { path, .. } | AggregateError::Write { path, .. } => {
                v["kind"] = json!("io");
                v["path"] = json!(path.display().to_string());
            }
            AggregateError::Unreadable {
                rank,
                path,
                reason,
                committed,
                ..
            } => {
                v["kind"] = json!("unreadable");
                v["rank"] = json!(rank);
                v["path"] = json!(path.display().to_string());
                v["reason"] = json!(reason);
                v["committed"] = json!(committed);
            }
            AggregateError::Mismatch { reason } => {
                v["kind"] = json!("mismatch");
                v["reason"] = json!(reason);
            }
            AggregateError::Command { source } => {
                v["kind"] = json!("command");
                if !source.tail().is_empty() {
                    v["log_tail"] = json!(source.tail());
                }
            }
            AggregateError::BadSplit { .. }
            | AggregateError::NoRanks
            | AggregateError::Unsupported { .. } => {
                v["kind"] = json!("usage");
            }
            AggregateError::Fenced { .. } => {
                v["kind"] = json!("fenced");
            }
        }
        v
    }
}

/// The manifest of merged file `out`: `<out>.manifest.json`.
pub fn manifest_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".manifest.json");
    out.with_file_name(name)
}

/// Merge the shards of `split` of `iteration` for ranks `0..num_ranks` (see the module
/// documentation) into `opts.out` (default `layout.aggregated(iteration, split)`) and its
/// manifest. `tick` is called regularly so a long merge keeps a watchdog informed.
pub fn merge(
    layout: &Layout,
    iteration: u64,
    split: &str,
    num_ranks: u32,
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<Manifest, AggregateError> {
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
    let listing = list_dir(&shard_dir)?;
    let partial_listing = if partial_dir == shard_dir {
        None
    } else {
        Some(list_dir(&partial_dir)?)
    };
    let mut problems = Vec::new();
    let mut ranks = Vec::with_capacity(num_ranks as usize);
    for rank in 0..num_ranks {
        let names = partial_listing.as_ref().unwrap_or(&listing);
        ranks.push(survey(
            layout, iteration, split, rank, names, &listing, &rel,
        )?);
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

    let gaps: Vec<&RankEntry> = ranks
        .iter()
        .filter(|r| r.status != RankStatus::Complete)
        .collect();
    if !opts.allow_missing && !gaps.is_empty() {
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
        return Err(AggregateError::Incomplete {
            missing: gaps
                .iter()
                .filter(|r| r.status == RankStatus::Missing)
                .map(|r| r.rank)
                .collect(),
            partial: gaps
                .iter()
                .filter(|r| r.status == RankStatus::Partial)
                .map(|r| r.rank)
                .collect(),
            message: format!("{}; nothing was published", said.join(", ")),
            ranks,
        });
    }

    let out = opts
        .out
        .clone()
        .unwrap_or_else(|| layout.aggregated(iteration, split));
    let out_dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let werr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| AggregateError::Write { path, source }
    };
    std::fs::create_dir_all(&out_dir).map_err(werr(&out_dir))?;
    let tmp = temp_path(&out);
    let mut extras = Extras::default();
    let written = (|| -> Result<(), AggregateError> {
        match format {
            Format::Jsonl => {}
            Format::Safetensors | Format::Torch => {
                extras = merge_tensors(layout, format, &mut ranks, opts, &tmp, tick)?;
                return Ok(());
            }
            Format::Command => {
                extras = merge_command(layout, iteration, split, &mut ranks, opts, &tmp, tick)?;
                return Ok(());
            }
        }
        let f = File::create(&tmp).map_err(werr(&tmp))?;
        let (f, hashes) = with_writer(f, &tmp, |sink| {
            let mut offset = 0u64;
            for entry in ranks.iter_mut() {
                entry.offset = offset;
                if entry.status == RankStatus::Missing {
                    continue;
                }
                tick();
                let path = layout
                    .root()
                    .join(entry.source.as_deref().unwrap_or_default());
                scan_source(&path, entry, sink, opts, tick)?;
                sink.end_source()?;
                offset += entry.bytes;
            }
            Ok(())
        })?;
        let mut hashes = hashes.into_iter();
        for entry in ranks.iter_mut().filter(|e| e.status != RankStatus::Missing) {
            entry.sha256 = hashes.next();
        }
        f.sync_all().map_err(werr(&tmp))?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }

    problems.extend(std::mem::take(&mut extras.problems));
    let mut manifest = Manifest::new(iteration, split, &out, opts, ranks, problems);
    if format != Format::Jsonl {
        manifest.shard_format = Some(format.name().to_string());
        manifest.output_bytes = extras.output_bytes;
        manifest.output_sha256 = extras.output_sha256;
        manifest.command = extras.command;
        manifest.tensors = extras.tensors;
    }
    let mpath = manifest_path(&out);
    let published = (|| -> Result<(), AggregateError> {
        // An old manifest must not describe the new merged file, even for a moment.
        match std::fs::remove_file(&mpath) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(werr(&mpath)(e)),
        }
        if let Some(fence) = &opts.fence {
            fence().map_err(|reason| AggregateError::Fenced { reason })?;
        }
        std::fs::rename(&tmp, &out).map_err(werr(&out))?;
        crate::store::fsync_dir(&out_dir).map_err(werr(&out_dir))?;
        crate::store::publish_json(&mpath, &manifest).map_err(werr(&mpath))
    })();
    if let Err(e) = published {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(manifest)
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
    entry.sha256 = None;
    Ok(())
}

/// safetensors / torch: read every available rank's header (or tensors), check that they
/// agree, and stream the concatenation into `tmp` (fsynced).
fn merge_tensors(
    layout: &Layout,
    format: Format,
    ranks: &mut [RankEntry],
    opts: &MergeOptions,
    tmp: &Path,
    tick: &mut dyn FnMut(),
) -> Result<Extras, AggregateError> {
    let mut inputs: Vec<st::Input> = Vec::new();
    let mut entry_of: Vec<usize> = Vec::new();
    for (i, entry) in ranks.iter_mut().enumerate() {
        if entry.status == RankStatus::Missing {
            continue;
        }
        tick();
        let path = layout
            .root()
            .join(entry.source.as_deref().unwrap_or_default());
        let rerr = |source| AggregateError::Read {
            rank: entry.rank,
            path: path.clone(),
            source,
        };
        let read = match format {
            Format::Torch => {
                let len = std::fs::metadata(&path).map_err(rerr)?.len();
                if len == 0 {
                    st::Shard::from_tensors(&path, Vec::new(), 0)
                } else {
                    crate::shards::read_torch_dict(&path)
                        .and_then(|ts| st::Shard::from_tensors(&path, ts, len))
                }
            }
            _ => st::Shard::open(&path),
        };
        match read {
            Ok(shard) => {
                entry.source_bytes = shard.file_len;
                if shard.tensors.is_empty() {
                    entry.problems.push(format!(
                        "{}: {}: this rank contributes nothing",
                        entry.source.as_deref().unwrap_or_default(),
                        if shard.file_len == 0 {
                            "empty file"
                        } else {
                            "no tensors"
                        }
                    ));
                }
                inputs.push(st::Input {
                    rank: entry.rank,
                    shard,
                });
                entry_of.push(i);
            }
            Err(ShardError::Unreadable { reason, .. }) => {
                entry.source_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                unreadable(entry, &path, format.name(), reason, opts)?;
            }
            Err(ShardError::Io { source, .. }) => return Err(rerr(source)),
            Err(ShardError::Mismatch { reason }) => {
                return Err(AggregateError::Mismatch { reason })
            }
        }
    }
    let plan = st::plan(&inputs).map_err(|e| AggregateError::Mismatch {
        reason: match e {
            ShardError::Mismatch { reason } => reason,
            other => other.to_string(),
        },
    })?;
    let werr = |source| AggregateError::Write {
        path: tmp.to_path_buf(),
        source,
    };
    let f = File::create(tmp).map_err(werr)?;
    let copied = st::write(&plan, &inputs, &f, tmp, tick).map_err(|e| {
        let rank_of = |p: &Path| {
            inputs
                .iter()
                .find(|i| i.shard.path == p)
                .map(|i| i.rank)
                .unwrap_or(0)
        };
        match e {
            ShardError::Io { path, source } if path == tmp => {
                AggregateError::Write { path, source }
            }
            ShardError::Io { path, source } => AggregateError::Read {
                rank: rank_of(&path),
                path,
                source,
            },
            ShardError::Unreadable { path, reason } => {
                let rank = rank_of(&path);
                AggregateError::Unreadable {
                    rank,
                    committed: ranks[rank as usize].status == RankStatus::Complete,
                    path,
                    format: format.name().to_string(),
                    reason,
                }
            }
            ShardError::Mismatch { reason } => AggregateError::Mismatch { reason },
        }
    })?;
    f.sync_all().map_err(werr)?;
    for (k, input) in inputs.iter().enumerate() {
        let e = &mut ranks[entry_of[k]];
        e.bytes = copied[k].bytes;
        e.sha256 = Some(copied[k].sha256.clone());
        e.records = input.shard.rows().unwrap_or(0);
    }
    let mut problems = Vec::new();
    if !plan.dropped_metadata.is_empty() {
        problems.push(format!(
            "__metadata__ entries that differ between ranks were left out of the merged file: {}",
            plan.dropped_metadata.join(", ")
        ));
    }
    Ok(Extras {
        tensors: plan
            .tensors
            .iter()
            .map(|t| MergedTensor {
                name: t.name.clone(),
                dtype: st::dtype_name(t.dtype),
                shape: t.shape.clone(),
                data_offsets: t.data_offsets,
                pieces: t
                    .pieces
                    .iter()
                    .map(|p| MergedPiece {
                        rank: p.rank,
                        rows: p.rows,
                        offset: p.offset,
                        bytes: p.bytes,
                    })
                    .collect(),
            })
            .collect(),
        output_bytes: Some(plan.file_len()),
        output_sha256: None,
        command: None,
        problems,
    })
}

/// SHA-256 and size of a file, read in blocks.
fn hash_file(path: &Path, tick: &mut dyn FnMut()) -> io::Result<(u64, String)> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; IO_BUF];
    let mut n = 0u64;
    let mut since_tick = 0u64;
    loop {
        let k = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..k]);
        n += k as u64;
        since_tick += k as u64;
        if since_tick >= TICK_BYTES {
            since_tick = 0;
            tick();
        }
    }
    Ok((n, hex::encode(h.finalize())))
}

/// command: hash the available shards, hand them to the merge command in rank order, and
/// take in its report; the command wrote `tmp` (fsynced here).
fn merge_command(
    layout: &Layout,
    iteration: u64,
    split: &str,
    ranks: &mut [RankEntry],
    opts: &MergeOptions,
    tmp: &Path,
    tick: &mut dyn FnMut(),
) -> Result<Extras, AggregateError> {
    let mut inputs = Vec::new();
    let mut input_ranks = Vec::new();
    let mut entry_of = Vec::new();
    for (i, e) in ranks.iter_mut().enumerate() {
        if e.status == RankStatus::Missing {
            continue;
        }
        tick();
        let path = layout.root().join(e.source.as_deref().unwrap_or_default());
        let (bytes, sha) = hash_file(&path, tick).map_err(|source| AggregateError::Read {
            rank: e.rank,
            path: path.clone(),
            source,
        })?;
        e.source_bytes = bytes;
        e.bytes = bytes;
        e.sha256 = Some(sha);
        inputs.push(path);
        input_ranks.push(e.rank);
        entry_of.push(i);
    }
    let mut report = tmp.as_os_str().to_os_string();
    report.push(".report.json");
    let job = command::Job {
        template: opts.command.clone(),
        inputs,
        input_ranks,
        output: tmp.to_path_buf(),
        report: PathBuf::from(report),
        iteration,
        split: layout.naming().split_label(split).to_string(),
        num_ranks: ranks.len() as u32,
        log_path: layout.root().to_path_buf(),
        timeout: opts.command_timeout,
        kill_grace: opts.kill_grace,
        log: opts.command_log.clone(),
        registry: opts.registry.clone(),
        env: opts.env.clone(),
    };
    let reports = command::run(&job, tick).map_err(|source| AggregateError::Command { source })?;
    for (k, r) in reports.into_iter().enumerate() {
        let e = &mut ranks[entry_of[k]];
        if let Some(n) = r.records {
            e.records = n;
        }
        if let Some(why) = r.unreadable {
            unreadable(e, &job.inputs[k], "merge command", why, opts)?;
        }
    }
    let werr = |source| AggregateError::Write {
        path: tmp.to_path_buf(),
        source,
    };
    File::open(tmp).and_then(|f| f.sync_all()).map_err(werr)?;
    let (bytes, sha) = hash_file(tmp, tick).map_err(werr)?;
    Ok(Extras {
        output_bytes: Some(bytes),
        output_sha256: Some(sha),
        command: Some(opts.command.clone()),
        ..Extras::default()
    })
}

fn temp_path(out: &Path) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = out.file_name().and_then(|s| s.to_str()).unwrap_or("out");
    out.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Sorted file names of `dir` (empty when it does not exist).
fn list_dir(dir: &Path) -> Result<Vec<String>, AggregateError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(AggregateError::List {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut names = Vec::new();
    for e in entries {
        let e = e.map_err(|source| AggregateError::List {
            path: dir.to_path_buf(),
            source,
        })?;
        if let Some(n) = e.file_name().to_str() {
            names.push(n.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// `rank-R.jsonl` → (R, false), `rank-R.partial.jsonl` → (R, true) (canonical decimal R
/// only), in the default layout.
#[cfg(test)]
fn shard_name_rank(name: &str) -> Option<(u32, bool)> {
    crate::shards::naming::Naming::default().rank_of(name, 1, "train", true, true)
}

/// Generation G of `rank-R.partial.jsonl.stale-genG` for this rank, in the default layout.
#[cfg(test)]
fn stale_gen(name: &str, rank: u32) -> Option<u64> {
    stale_gen_of(name, &format!("rank-{rank}.partial.jsonl"))
}

/// The journal note of a rank whose rollout command wrote its shard name itself.
fn adopted_by_command(layout: &Layout, iteration: u64, split: &str, rank: u32) -> Option<String> {
    let text = std::fs::read_to_string(layout.journal(rank)).ok()?;
    let item = format!("rollout-{split}");
    crate::protocol::journal::parse(&text)
        .into_iter()
        .rev()
        .find(|e| e.iteration == iteration && e.item == item)
        .and_then(|e| e.note)
        .filter(|n| n.starts_with("adopted"))
}

/// Generation G of `<partial>.stale-genG`: an earlier attempt's partial file set aside
/// (`Node::set_aside_earlier`; before partials were generation-specific, at this name).
fn stale_gen_of(name: &str, partial: &str) -> Option<u64> {
    let g = name.strip_prefix(partial)?.strip_prefix(".stale-gen")?;
    g.parse().ok()
}

fn survey(
    layout: &Layout,
    iteration: u64,
    split: &str,
    rank: u32,
    listing: &[String],
    shard_listing: &[String],
    rel: &dyn Fn(&Path) -> String,
) -> Result<RankEntry, AggregateError> {
    let size = |p: &Path| -> Result<Option<u64>, AggregateError> {
        match std::fs::metadata(p) {
            Ok(m) if m.is_file() => Ok(Some(m.len())),
            Ok(_) => Err(AggregateError::Read {
                rank,
                path: p.to_path_buf(),
                source: io::Error::other("not a regular file"),
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
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
    let adopted = adopted_by_command(layout, iteration, split, rank);
    let mut problems = Vec::new();
    let (status, source, source_bytes) = if let Some(n) = size(&committed)? {
        if let Some(p) = size(&partial)? {
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
    Ok(RankEntry {
        rank,
        status,
        adopted: adopted.filter(|_| status == RankStatus::Complete),
        source,
        source_bytes,
        offset: 0,
        records: 0,
        bytes: 0,
        sha256: None,
        dropped: Vec::new(),
        set_aside,
        problems,
    })
}

/// Blocks of merged bytes handed from the reading thread to the writing one.
const BLOCK: usize = 1 << 20;

enum Msg {
    Data(Vec<u8>),
    /// The current source is done: record the hash of its bytes.
    EndSource,
}

/// The reading half's end of the pipeline: records are read straight into `block` (so a
/// valid one is never copied again and an invalid one is cut off with `truncate`), and
/// full blocks go to the writing thread, which hashes and writes them.
struct Sink {
    block: Vec<u8>,
    tx: std::sync::mpsc::SyncSender<Msg>,
    recycled: std::sync::mpsc::Receiver<Vec<u8>>,
    tmp: PathBuf,
}

impl Sink {
    fn gone(&self) -> AggregateError {
        AggregateError::Write {
            path: self.tmp.clone(),
            source: io::Error::other("the writing thread stopped"),
        }
    }

    fn flush(&mut self) -> Result<(), AggregateError> {
        if self.block.is_empty() {
            return Ok(());
        }
        let next = self
            .recycled
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(BLOCK + (BLOCK >> 2)));
        let full = std::mem::replace(&mut self.block, next);
        self.tx.send(Msg::Data(full)).map_err(|_| self.gone())
    }

    fn end_source(&mut self) -> Result<(), AggregateError> {
        self.flush()?;
        self.tx.send(Msg::EndSource).map_err(|_| self.gone())
    }
}

/// Run `produce` (on this thread) with a [`Sink`] whose bytes a second thread hashes and
/// writes to `w`, so that validating and hashing + writing overlap. Returns `w` and the
/// SHA-256 of the bytes of each source, in the order of `end_source` calls.
fn with_writer<W: Write + Send>(
    w: W,
    tmp: &Path,
    produce: impl FnOnce(&mut Sink) -> Result<(), AggregateError>,
) -> Result<(W, Vec<String>), AggregateError> {
    use std::sync::mpsc::sync_channel;
    std::thread::scope(|s| {
        let (tx, rx) = sync_channel::<Msg>(4);
        let (give_back, recycled) = sync_channel::<Vec<u8>>(4);
        let writer = s.spawn(move || -> io::Result<(W, Vec<String>)> {
            let mut w = w;
            let mut hasher = Sha256::new();
            let mut hashes = Vec::new();
            for m in rx {
                match m {
                    Msg::Data(mut b) => {
                        hasher.update(&b);
                        w.write_all(&b)?;
                        if b.capacity() <= 4 * BLOCK {
                            b.clear();
                            let _ = give_back.try_send(b);
                        }
                    }
                    Msg::EndSource => hashes.push(hex::encode(hasher.finalize_reset())),
                }
            }
            w.flush()?;
            Ok((w, hashes))
        });
        let mut sink = Sink {
            block: Vec::with_capacity(BLOCK + (BLOCK >> 2)),
            tx,
            recycled,
            tmp: tmp.to_path_buf(),
        };
        let produced = produce(&mut sink);
        drop(sink); // ends the writer's loop
        let written = writer.join().expect("the aggregate writer thread panicked");
        match (produced, written) {
            (Ok(()), Ok(done)) => Ok(done),
            // The writer's error is the cause of the reader's "writer stopped".
            (Ok(()) | Err(AggregateError::Write { .. }), Err(source)) => {
                Err(AggregateError::Write {
                    path: tmp.to_path_buf(),
                    source,
                })
            }
            (Err(e), _) => Err(e),
        }
    })
}

/// Stream the valid records of one source into `sink`, filling `entry`'s counts, drops
/// and problems (the caller ends the source, which records its hash).
fn scan_source(
    path: &Path,
    entry: &mut RankEntry,
    sink: &mut Sink,
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<(), AggregateError> {
    let rank = entry.rank;
    let rerr = |source| AggregateError::Read {
        rank,
        path: path.to_path_buf(),
        source,
    };
    let f = File::open(path).map_err(rerr)?;
    let len = f.metadata().map_err(rerr)?.len();
    entry.source_bytes = len;
    let committed = entry.status == RankStatus::Complete;
    let shown = entry.source.clone().unwrap_or_default();
    let mut r = BufReader::with_capacity(IO_BUF, f);
    let mut lineno = 0u64;
    let mut pos = 0u64; // byte offset of the current line in the source
    let mut since_tick = 0u64;
    loop {
        let start = sink.block.len();
        lineno += 1;
        let got = read_record(&mut r, &mut sink.block, start, opts).map_err(rerr)?;
        let (raw, newline, invalid) = match got {
            Record::Eof => break,
            Record::Line { newline } => {
                let line = &sink.block[start..];
                let raw = line.len() as u64;
                if line.iter().all(|b| b.is_ascii_whitespace()) {
                    sink.block.truncate(start);
                    pos += raw;
                    continue;
                }
                match validate(line, opts.strict_json) {
                    Ok(()) => {
                        if !newline {
                            sink.block.push(b'\n');
                        }
                        entry.records += 1;
                        entry.bytes += (sink.block.len() - start) as u64;
                        pos += raw;
                        since_tick += raw;
                        if sink.block.len() >= BLOCK {
                            sink.flush()?;
                        }
                        if since_tick >= TICK_BYTES {
                            since_tick = 0;
                            tick();
                        }
                        continue;
                    }
                    Err(why) => {
                        sink.block.truncate(start);
                        (raw, newline, why)
                    }
                }
            }
            Record::Bad {
                bytes,
                newline,
                why,
            } => {
                sink.block.truncate(start);
                (bytes, newline, why)
            }
        };
        // `invalid` is the reason the line at `lineno` (`raw` bytes) is not a record.
        if !newline {
            entry.dropped.push(Dropped {
                kind: DropKind::Torn,
                line: lineno,
                bytes: raw,
                reason: invalid.clone(),
            });
            entry.problems.push(format!(
                "{shown}:{lineno}: torn last record dropped ({raw} bytes, no trailing newline, not valid JSON: {invalid})"
            ));
        } else if committed {
            return Err(AggregateError::Corrupt {
                rank,
                path: path.to_path_buf(),
                line: lineno,
                reason: invalid,
            });
        } else {
            let rest = len.saturating_sub(pos).max(raw);
            entry.dropped.push(Dropped {
                kind: DropKind::Invalid,
                line: lineno,
                bytes: rest,
                reason: invalid.clone(),
            });
            entry.problems.push(format!(
                "{shown}:{lineno}: not valid JSON ({invalid}); stopped reading this partial file there ({rest} bytes from line {lineno} to the end dropped)"
            ));
        }
        break;
    }
    if sink.block.capacity() > 64 << 20 {
        // After a huge record, do not keep its buffer for the rest of the merge.
        sink.flush()?;
        sink.block = Vec::with_capacity(BLOCK + (BLOCK >> 2));
    }
    Ok(())
}

enum Record {
    Eof,
    /// The line is in the buffer (with its newline when it had one).
    Line {
        newline: bool,
    },
    /// A line known to be invalid before its end was read (garbage, or longer than the
    /// limit); it has been consumed without being buffered whole.
    Bad {
        bytes: u64,
        newline: bool,
        why: String,
    },
}

/// Read one line, appending it to `buf` (whose record starts at `start`), buffering at
/// most `max_record_bytes` (+ a step) of it.
fn read_record<R: BufRead>(
    r: &mut R,
    buf: &mut Vec<u8>,
    start: usize,
    opts: &MergeOptions,
) -> io::Result<Record> {
    let cap = opts.max_record_bytes;
    let mut step = FIRST_STEP.min(cap.saturating_add(1));
    let why = loop {
        let n = r.by_ref().take(step).read_until(b'\n', buf)? as u64;
        if buf.len() > start && buf.last() == Some(&b'\n') {
            return Ok(Record::Line { newline: true });
        }
        if n < step {
            // End of file.
            return Ok(if buf.len() == start {
                Record::Eof
            } else {
                Record::Line { newline: false }
            });
        }
        let have = (buf.len() - start) as u64;
        if have > cap {
            break format!("record longer than {cap} bytes");
        }
        if let Some(why) = prefix_invalid(&buf[start..], opts.strict_json) {
            break why;
        }
        step = have.min(cap.saturating_add(1) - have).max(1);
    };
    // Consume the rest of the line without keeping it.
    let mut bytes = (buf.len() - start) as u64;
    buf.truncate(start);
    let mut scratch = Vec::with_capacity(1 << 16);
    loop {
        scratch.clear();
        let n = r
            .by_ref()
            .take(IO_BUF as u64)
            .read_until(b'\n', &mut scratch)?;
        bytes += n as u64;
        if scratch.last() == Some(&b'\n') {
            return Ok(Record::Bad {
                bytes,
                newline: true,
                why,
            });
        }
        if n == 0 {
            return Ok(Record::Bad {
                bytes,
                newline: false,
                why,
            });
        }
    }
}

/// Errors reported this close to the end of a prefix may be artefacts of the cut (e.g. a
/// number cut after its `-`), so they do not prove the whole line invalid.
const PREFIX_MARGIN: usize = 16;

/// Whether a prefix of a line (more bytes follow) already proves the line invalid.
fn prefix_invalid(prefix: &[u8], strict: bool) -> Option<String> {
    if let Err(e) = std::str::from_utf8(prefix) {
        if e.error_len().is_some() {
            return Some(format!("invalid UTF-8 at byte {}", e.valid_up_to() + 1));
        }
    }
    let check = |bytes: &[u8]| match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        Ok(_) => None,
        Err(e) if e.is_eof() => None,
        Err(e) if e.column() + PREFIX_MARGIN >= bytes.len() => None,
        Err(e) => Some(describe(&e)),
    };
    let why = check(prefix)?;
    if !strict {
        if let Some(fixed) = python_literals_as_numbers(prefix) {
            check(&fixed)?;
        }
    }
    Some(why)
}

/// Whether `line` (one line, possibly with its newline) is one JSON value in UTF-8.
fn validate(line: &[u8], strict: bool) -> Result<(), String> {
    if let Err(e) = std::str::from_utf8(line) {
        return Err(format!("invalid UTF-8 at byte {}", e.valid_up_to() + 1));
    }
    match serde_json::from_slice::<serde::de::IgnoredAny>(line) {
        Ok(_) => Ok(()),
        Err(e) => {
            if !strict {
                if let Some(fixed) = python_literals_as_numbers(line) {
                    if serde_json::from_slice::<serde::de::IgnoredAny>(&fixed).is_ok() {
                        return Ok(());
                    }
                }
            }
            Err(describe(&e))
        }
    }
}

/// serde_json's message without its "at line 1 column N" (the line is the file's, not 1).
fn describe(e: &serde_json::Error) -> String {
    let s = e.to_string();
    let msg = s.split(" at line ").next().unwrap_or(&s);
    format!("{msg} at byte {}", e.column())
}

/// A copy of `line` with every `NaN`, `Infinity` and `-Infinity` token outside strings
/// (where a value may start) replaced by a same-length number padded with spaces, or
/// `None` when there is none. Lets serde_json check Python's JSON dialect.
fn python_literals_as_numbers(line: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut in_str = false;
    let mut escaped = false;
    let mut prev = b'['; // the start of the line is where a value may start
    let mut i = 0;
    while i < line.len() {
        let b = line[i];
        if in_str {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_str = false;
                prev = b'"';
            }
            i += 1;
            continue;
        }
        match b {
            b' ' | b'\t' | b'\r' | b'\n' => {
                i += 1;
                continue;
            }
            b'"' => in_str = true,
            b'N' | b'I' | b'-' if matches!(prev, b'[' | b',' | b':') => {
                let rest = &line[i..];
                let (len, sign) = if rest.starts_with(b"NaN") {
                    (3, 0)
                } else if rest.starts_with(b"Infinity") {
                    (8, 0)
                } else if rest.starts_with(b"-Infinity") {
                    (9, 1)
                } else {
                    (0, 0)
                };
                if len > 0 {
                    let o = out.get_or_insert_with(|| line.to_vec());
                    o[i + sign] = b'0';
                    o[i + sign + 1..i + len].fill(b' ');
                    prev = b'0';
                    i += len;
                    continue;
                }
            }
            _ => {}
        }
        prev = b;
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts() -> MergeOptions {
        MergeOptions::default()
    }

    /// Scan `bytes` as one source file: what was merged from it, and its entry.
    fn scan_bytes(
        bytes: &[u8],
        committed: bool,
        o: &MergeOptions,
    ) -> Result<(Vec<u8>, RankEntry), AggregateError> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("src.jsonl");
        std::fs::write(&p, bytes).unwrap();
        let mut e = RankEntry {
            rank: 0,
            status: if committed {
                RankStatus::Complete
            } else {
                RankStatus::Partial
            },
            source: Some("src.jsonl".into()),
            source_bytes: 0,
            offset: 0,
            records: 0,
            bytes: 0,
            sha256: None,
            dropped: vec![],
            set_aside: vec![],
            adopted: None,
            problems: vec![],
        };
        let (out, hashes) = with_writer(Vec::new(), Path::new("tmp"), |sink| {
            scan_source(&p, &mut e, sink, o, &mut || {})?;
            sink.end_source()
        })?;
        assert_eq!(hashes, vec![hex::encode(Sha256::digest(&out))]);
        assert_eq!(e.bytes, out.len() as u64);
        Ok((out, e))
    }

    #[test]
    fn concatenates_and_fixes_missing_newline() {
        let (out, e) = scan_bytes(b"{\"r\":0}\n\n  \n{\"r\":1}", true, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n{\"r\":1}\n");
        assert_eq!(e.records, 2);
        assert!(e.dropped.is_empty());
    }

    #[test]
    fn torn_last_record_is_dropped_with_its_line_and_size() {
        let (out, e) = scan_bytes(b"{\"r\":0}\n\n{\"r\":1, \"x\": [1,", false, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n");
        assert_eq!(e.dropped.len(), 1);
        let d = &e.dropped[0];
        assert_eq!((d.kind, d.line, d.bytes), (DropKind::Torn, 3, 16));
        assert!(
            e.problems[0].contains("src.jsonl:3: torn last record"),
            "{:?}",
            e.problems
        );
    }

    #[test]
    fn invalid_middle_line_fails_a_committed_shard_and_ends_a_partial() {
        let bytes = b"{\"r\":0}\n{\"r\":1}\nnot json\n{\"r\":3}\n";
        match scan_bytes(bytes, true, &opts()).unwrap_err() {
            AggregateError::Corrupt { line, .. } => assert_eq!(line, 3),
            e => panic!("{e}"),
        }
        let (out, e) = scan_bytes(bytes, false, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n{\"r\":1}\n");
        assert_eq!(e.dropped[0].kind, DropKind::Invalid);
        assert_eq!(e.dropped[0].line, 3);
        assert_eq!(e.dropped[0].bytes, 17);
        assert!(e.problems[0].contains("src.jsonl:3: not valid JSON"));
    }

    #[test]
    fn a_valid_last_line_without_newline_is_kept_and_invalid_utf8_is_not() {
        let (out, _) = scan_bytes(b"[1]\n\"a\"", true, &opts()).unwrap();
        assert_eq!(out, b"[1]\n\"a\"\n");
        let (out, e) = scan_bytes(b"[1]\n\"\xff\"", true, &opts()).unwrap();
        assert_eq!(out, b"[1]\n");
        assert!(e.dropped[0].reason.contains("UTF-8"));
    }

    #[test]
    fn python_nan_and_infinity_are_accepted_unless_strict() {
        let line = b"{\"a\": NaN, \"b\": [Infinity, -Infinity], \"NaN\": \"NaN\"}\n";
        assert!(validate(line, false).is_ok());
        assert!(validate(line, true).is_err());
        for bad in [
            &b"[1NaN]"[..],
            b"[NaNa]",
            b"{\"a\": -NaN}",
            b"[Infinity5]",
            b"NaN NaN",
        ] {
            assert!(
                validate(bad, false).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let (out, _) = scan_bytes(line, true, &opts()).unwrap();
        assert_eq!(out, line);
    }

    #[test]
    fn long_garbage_lines_are_not_buffered_and_long_records_are_kept() {
        // A crash can leave a zero-filled tail without newlines.
        let mut bytes = b"{\"r\":0}\n".to_vec();
        bytes.extend(std::iter::repeat_n(0u8, 5 << 20));
        let (out, e) = scan_bytes(&bytes, false, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n");
        assert_eq!(e.dropped[0].kind, DropKind::Torn);
        assert_eq!(e.dropped[0].bytes, 5 << 20);

        let big = format!("{{\"x\": \"{}\", \"n\": -1}}\n", "y".repeat(3 << 20));
        let (out, e) = scan_bytes(big.as_bytes(), true, &opts()).unwrap();
        assert_eq!(out, big.as_bytes());
        assert_eq!(e.records, 1);

        let small = MergeOptions {
            max_record_bytes: 1000,
            ..opts()
        };
        let text = format!("[1]\n[\"{}\"]\n[2]\n", "z".repeat(5000));
        let (out, e) = scan_bytes(text.as_bytes(), false, &small).unwrap();
        assert_eq!(out, b"[1]\n");
        assert!(e.dropped[0].reason.contains("longer than 1000"));
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_name_rank("rank-3.jsonl"), Some((3, false)));
        assert_eq!(shard_name_rank("rank-12.partial.jsonl"), Some((12, true)));
        assert_eq!(shard_name_rank("rank-03.jsonl"), None);
        assert_eq!(shard_name_rank("rank-1.partial.jsonl.stale-gen2"), None);
        assert_eq!(stale_gen("rank-1.partial.jsonl.stale-gen12", 1), Some(12));
        assert_eq!(stale_gen("rank-1.partial.jsonl.stale-gen12", 2), None);
        assert_eq!(
            manifest_path(Path::new("/a/train.jsonl")),
            Path::new("/a/train.jsonl.manifest.json")
        );
    }

    #[test]
    fn merge_refuses_gaps_without_touching_the_output() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(1, "train")).unwrap();
        std::fs::write(l.shard(1, "train", 0), "{}\n").unwrap();
        std::fs::write(l.aggregated(1, "train"), "old\n").unwrap();
        let e = merge(&l, 1, "train", 2, &opts(), &mut || {}).unwrap_err();
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

    #[test]
    fn merge_publishes_in_rank_order_with_a_manifest() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(2, "eval")).unwrap();
        std::fs::write(l.shard(2, "eval", 1), "{\"r\":1}\n").unwrap();
        std::fs::write(l.shard(2, "eval", 0), "{\"r\":0}").unwrap();
        let mut ticks = 0;
        let m = merge(&l, 2, "eval", 2, &opts(), &mut || ticks += 1).unwrap();
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

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec(("[a-z\"\\\\]{0,4}", inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Checking a valid line piecewise never calls it invalid, wherever it is cut.
        #[test]
        fn no_prefix_of_a_valid_line_is_judged_invalid(v in json_value(), pad in 0usize..3, cut in any::<prop::sample::Index>()) {
            let mut text = serde_json::to_string(&v).unwrap();
            if pad > 0 {
                text = serde_json::to_string_pretty(&v).unwrap().replace('\n', " ");
            }
            let bytes = text.as_bytes();
            let k = cut.index(bytes.len() + 1);
            prop_assert!(validate(bytes, true).is_ok());
            prop_assert_eq!(prefix_invalid(&bytes[..k], true), None);
        }

        /// The validator agrees with serde_json + UTF-8 on arbitrary (often invalid) bytes.
        #[test]
        fn validation_matches_serde_json(bytes in prop::collection::vec(prop_oneof![
            Just(b'{'), Just(b'}'), Just(b'['), Just(b']'), Just(b'"'), Just(b':'), Just(b','),
            Just(b'1'), Just(b'-'), Just(b'e'), Just(b'.'), Just(b' '), Just(b'\\'), Just(b'N'),
            Just(0xffu8), any::<u8>()], 0..24)) {
            let expected = std::str::from_utf8(&bytes).is_ok()
                && serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok();
            prop_assert_eq!(validate(&bytes, true).is_ok(), expected);
            if expected {
                prop_assert!(validate(&bytes, false).is_ok());
            }
        }
    }
}
