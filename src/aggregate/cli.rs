//! `rl-node aggregate`: the command-line arguments, [`main`] (which loads the
//! configuration, works out the number of ranks, runs [`merge`] and maps its outcome to an
//! exit code), and the per-rank summary and byte sizes it prints on stderr.
//!
//! It salvages what a stopped run left, so it must never destroy what the run committed:
//! by default it writes beside the run's merged file (`train.salvaged.jsonl`), never over
//! an existing file (`--overwrite` replaces an earlier salvage, never the run's merged
//! file or a shard), never the run's merged file once rank 0 journaled that merge
//! (`--commit` writes it only when it was never made), and never while a node of the run
//! still runs, judged as `rl-node status` judges it.

use super::human_bytes;
use super::survey::list_dir;
use super::{
    manifest_path, merge, AggregateError, Manifest, MergeOptions, RankEntry,
    DEFAULT_MAX_RECORD_BYTES,
};
use crate::error::{Cause, Ending, Failure};
use crate::layout::Layout;
use crate::shards::naming::Format;
use serde::Deserialize;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `rl-node aggregate`: merge what an iteration's ranks left (committed shards, else
/// partial files) into one JSONL file with a manifest.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Shard format and names come from the [aggregate] section of --config (or --format): jsonl, safetensors, torch or command; see docs/formats.md.\n\nThe merge goes to <log-path>/rollouts/iter-NNNN/<split>.salvaged.jsonl (the merged file's name with .salvaged before its extension) unless --out or --commit says otherwise; the run's own merged file is never replaced.\n\nExit codes: 0 merged (every rank complete, or --allow-missing), 1 a rank is missing or partial, or a shard unreadable, without --allow-missing, ranks disagree on tensors, a committed JSONL shard is corrupt or the merge command failed (nothing published), 2 usage or configuration error, the output exists (not replaced), a node of the run is still running, or --commit of an iteration whose merge rank 0 journaled (nothing written)."
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
    /// Where to write the merge (default: beside the run's merged file, its name with
    /// `.salvaged` before the extension: <log-path>/rollouts/iter-NNNN/<split>.salvaged.jsonl
    /// for JSONL); the manifest goes beside it as <FILE>.manifest.json. An existing FILE is
    /// not replaced (exit 2) unless --overwrite.
    #[arg(long, value_name = "FILE", conflicts_with = "commit")]
    pub out: Option<PathBuf>,
    /// Replace the output (the default one or --out FILE) if it exists, e.g. an earlier
    /// salvage. Refused for the run's merged file and for rank shards.
    #[arg(long, conflicts_with = "commit")]
    pub overwrite: bool,
    /// Write the run's own merged file (<log-path>/rollouts/iter-NNNN/<split>.jsonl,
    /// aggregate.output-name), for a stopped run that never merged this iteration: only if
    /// that file does not exist and rank 0 did not journal the iteration's merge; renamed
    /// into place without replacing anything.
    #[arg(long)]
    pub commit: bool,
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
    /// How much of each JSONL line is checked (overrides aggregate.validate): json (each
    /// line parsed), utf8 (UTF-8 without NUL, brackets closed; the default) or none (lines
    /// only). A last line without its newline is parsed at every level.
    #[arg(long, value_name = "LEVEL", value_parser = ["json", "utf8", "none"])]
    pub validate: Option<String>,
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
pub fn main(
    args: AggregateArgs,
    log_path: Option<String>,
    config: Option<PathBuf>,
) -> Result<Ending, Failure> {
    let flags = [
        ("--format", "aggregate.format", &args.format),
        ("--validate", "aggregate.validate", &args.validate),
    ];
    let overrides: Vec<crate::config::CliOverride> = flags
        .into_iter()
        .filter_map(|(flag, key, value)| {
            Some(crate::config::CliOverride {
                flag: flag.into(),
                key,
                value: value.clone()?,
            })
        })
        .collect();
    let loaded = match crate::config::load(
        config.as_deref(),
        &|name| std::env::var(name).ok(),
        &overrides,
    ) {
        Ok(l) => l,
        Err(e) => return Err(Failure::usage(e.to_string(), None)),
    };
    let Some(root) = log_path
        .or_else(|| Some(loaded.config.cluster.log_path.clone()))
        .filter(|p| !p.trim().is_empty())
    else {
        return Err(Failure::usage(
            "rl-node aggregate needs --log-path DIR (or RL_NODE_CLUSTER_LOG_PATH)",
            None,
        ));
    };
    let naming = loaded.config.naming();
    let format = naming.format();
    let layout = Layout::new(&root).with_naming(naming);
    if !layout.root().is_dir() {
        return Err(Failure::usage(
            format!("--log-path {root}: no such directory"),
            None,
        ));
    }
    let num_ranks = num_ranks(&args, &layout)?;
    let merged = layout.aggregated(args.iteration, &args.split);
    let out = match (&args.out, args.commit) {
        (Some(f), _) => f.clone(),
        (None, true) => merged.clone(),
        (None, false) => salvaged(&merged),
    };
    check_target(&layout, &args, num_ranks, &out)?;
    refuse_live(&layout)?;
    let opts = MergeOptions {
        allow_missing: args.allow_missing,
        out: Some(out.clone()),
        replace: args.overwrite,
        strict_json: args.strict_json,
        max_record_bytes: args.max_record_bytes.max(1),
        // `[env]` as the merge command gets it in a node; outside one, node values
        // such as {data_path} have none here.
        env: loaded
            .config
            .env
            .iter()
            .map(|(k, t)| {
                let t = loaded.config.template(t);
                (k.clone(), t.render_raw(&Default::default()))
            })
            .collect(),
        ..MergeOptions::from_config(&loaded.config.aggregate)
    };
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
        &crate::store::Fs,
        &layout,
        args.iteration,
        &args.split,
        num_ranks,
        &opts,
        &mut || {},
    ) {
        Ok(m) => {
            crate::err!("{}", summary(&m, format, &out));
            if args.json {
                crate::outln!("{}", serde_json::to_string_pretty(&m).expect("json"));
            }
            Ok(Ending::Done)
        }
        Err(e) => {
            if args.json {
                crate::outln!(
                    "{}",
                    serde_json::to_string_pretty(&e.to_json()).expect("json")
                );
            }
            let cause = match e {
                AggregateError::Unsupported { .. } | AggregateError::Exists { .. } => Cause::Usage,
                _ => Cause::Failed,
            };
            let mut failure = Failure::new(cause, e.to_string());
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
                failure.hint = Some(
                    match other_format_hint(&layout, args.iteration, &args.split) {
                        Some(hint) => format!("{hint}\n(--allow-missing merges what exists)"),
                        None => "--allow-missing merges what exists".to_string(),
                    },
                );
            } else if let AggregateError::Command { source } = &e {
                failure = failure.with_detail(source.tail());
            } else if let AggregateError::Exists { path } = &e {
                failure.hint = Some(exists_hint(path, &merged));
            }
            Err(failure)
        }
    }
}

/// The number of ranks: `--num-ranks`, else `num_nodes` of the run's `cluster.json`.
fn num_ranks(args: &AggregateArgs, layout: &Layout) -> Result<u32, Failure> {
    let cluster = layout.cluster();
    let recorded = match crate::store::fs::read(&cluster) {
        Ok(None) => None,
        Ok(Some(bytes)) => match serde_json::from_slice::<ClusterSize>(&bytes) {
            Ok(c) => Some(c.num_nodes),
            Err(e) if args.num_ranks.is_none() => {
                return Err(Failure::usage(
                    format!(
                        "cannot read num_nodes from {}: {e}; pass --num-ranks N",
                        cluster.display()
                    ),
                    None,
                ));
            }
            Err(_) => None,
        },
        Err(e) if args.num_ranks.is_none() => {
            return Err(Failure::usage(
                format!("cannot read {}: {e}; pass --num-ranks N", cluster.display()),
                None,
            ));
        }
        Err(_) => None,
    };
    match (args.num_ranks, recorded) {
        (Some(n), Some(c)) if n != c => {
            crate::errln!(
                "note: --num-ranks {n} overrides num_nodes {c} of {}",
                cluster.display()
            );
            Ok(n)
        }
        (Some(n), _) => Ok(n),
        (None, Some(c)) if c > 0 => Ok(c),
        (None, Some(_)) => Err(Failure::usage(
            format!("{} says num_nodes 0; pass --num-ranks N", cluster.display()),
            None,
        )),
        (None, None) => Err(Failure::usage(
            format!(
                "{} does not exist, so the number of ranks is unknown; pass --num-ranks N",
                cluster.display()
            ),
            None,
        )),
    }
}

/// The default output: the run's merged file with `.salvaged` before its extension
/// (`train.salvaged.jsonl`), or appended when it has none.
fn salvaged(merged: &Path) -> PathBuf {
    let name = match (merged.file_stem(), merged.extension()) {
        (Some(stem), Some(ext)) => format!(
            "{}.salvaged.{}",
            stem.to_string_lossy(),
            ext.to_string_lossy()
        ),
        _ => format!(
            "{}.salvaged",
            merged.file_name().unwrap_or_default().to_string_lossy()
        ),
    };
    merged.with_file_name(name)
}

/// Whether `a` and `b` name the same directory entry (their directories resolved, so
/// `x/../train.jsonl` or a symlinked directory is seen through).
fn same_place(a: &Path, b: &Path) -> bool {
    Places::default().same(a, b)
}

/// [`same_place`] for many comparisons: each directory is resolved once (the run's shards
/// of a split share one, which [`committed_at`] compares with every rank's names).
#[derive(Default)]
struct Places {
    resolved: HashMap<PathBuf, Option<PathBuf>>,
}

impl Places {
    /// `p` with its directory resolved; `None` when that directory cannot be.
    fn resolve(&mut self, p: &Path) -> Option<PathBuf> {
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = p.file_name()?;
        let dir = self
            .resolved
            .entry(dir.to_path_buf())
            .or_insert_with(|| dir.canonicalize().ok());
        Some(dir.as_ref()?.join(name))
    }

    fn same(&mut self, a: &Path, b: &Path) -> bool {
        match (self.resolve(a), self.resolve(b)) {
            (Some(a), Some(b)) => a == b,
            _ => a == b,
        }
    }
}

/// What the run committed (or its ranks left to merge) at `out`, if anything: the merged
/// file of either split or its manifest, or a rank's shard or partial file.
fn committed_at(layout: &Layout, iteration: u64, num_ranks: u32, out: &Path) -> Option<String> {
    let name = out.file_name()?.to_string_lossy().into_owned();
    let mut places = Places::default();
    let mut same_place = |a: &Path, b: &Path| places.same(a, b);
    for split in ["train", "eval"] {
        let merged = layout.aggregated(iteration, split);
        if same_place(out, &merged) {
            return Some(format!("the run's merged {split} file"));
        }
        if same_place(out, &manifest_path(&merged)) {
            return Some(format!("the manifest of the run's merged {split} file"));
        }
        for rank in 0..num_ranks {
            let shard = layout.shard(iteration, split, rank);
            let partial = layout.shard_partial(iteration, split, rank);
            // A partial file carries the generation that wrote it (`rank-R.partial.gG.jsonl`).
            let partial_of_a_gen = partial.file_name().is_some_and(|p| {
                crate::layout::gen_of(&name, &p.to_string_lossy()).is_some()
                    && same_place(out, &partial.with_file_name(&name))
            });
            if same_place(out, &shard) {
                return Some(format!("rank {rank}'s {split} shard"));
            }
            if same_place(out, &partial) || partial_of_a_gen {
                return Some(format!("rank {rank}'s partial {split} shard"));
            }
        }
    }
    None
}

/// Refuse (exit 2, nothing written) a target rl-node aggregate must not write: any
/// existing file without `--overwrite`; with it, anything the run committed; and the
/// run's merged file once rank 0 journaled its merge (it may have been trained on).
fn check_target(
    layout: &Layout,
    args: &AggregateArgs,
    num_ranks: u32,
    out: &Path,
) -> Result<(), Failure> {
    let merged = layout.aggregated(args.iteration, &args.split);
    if args.overwrite {
        if let Some(what) = committed_at(layout, args.iteration, num_ranks, out) {
            return Err(Failure::usage(
                format!(
                    "--overwrite: {} is {what}; rl-node aggregate never replaces it; nothing was written",
                    out.display()
                ),
                Some(format!(
                    "write the merge elsewhere: drop --out for the default {}, or pass another --out FILE",
                    salvaged(&merged).display()
                )),
            ));
        }
    } else if std::fs::symlink_metadata(out).is_ok() {
        return Err(Failure::usage(
            format!(
                "{} already exists and rl-node aggregate does not replace it; nothing was written",
                out.display()
            ),
            Some(exists_hint(out, &merged)),
        ));
    }
    if same_place(out, &merged) {
        let salvage = || {
            Some(format!(
                "salvage without --commit (or --out): the merge goes to {}",
                salvaged(&merged).display()
            ))
        };
        let journaled = merge_journaled(layout, args.iteration, &args.split).map_err(|e| {
            Failure::usage(
                format!(
                    "{} is iteration {}'s merged {} file, and whether rank 0 journaled its merge (so the run may have trained on it) cannot be told: {e}; nothing was written",
                    out.display(),
                    args.iteration,
                    args.split
                ),
                salvage(),
            )
        })?;
        if let Some(journal) = journaled {
            return Err(Failure::usage(
                format!(
                    "{} is iteration {}'s merged {} file, whose merge rank 0 journaled ({}): the run may have trained on it, so rl-node aggregate does not write it; nothing was written",
                    out.display(),
                    args.iteration,
                    args.split,
                    journal.display()
                ),
                salvage(),
            ));
        }
    }
    Ok(())
}

/// What to do about an output that exists.
fn exists_hint(out: &Path, merged: &Path) -> String {
    if same_place(out, merged) {
        format!(
            "it is the run's merged file, which may have been trained on: salvage without --commit (or --out) to write {}, or pass another --out FILE",
            salvaged(merged).display()
        )
    } else {
        "pass another --out FILE, or add --overwrite to replace this earlier salvage".into()
    }
}

/// Rank 0's journal, if it records the merge of `split` of `iteration` (in a pipelined
/// run, the rollout cluster's rank 0 merges). A journal that cannot be read (larger than
/// rl-node reads, a planted link) is an error naming it: the merge may be journaled there.
fn merge_journaled(
    layout: &Layout,
    iteration: u64,
    split: &str,
) -> Result<Option<PathBuf>, String> {
    use crate::protocol::journal::{self, item};
    let wanted = if split == "eval" {
        item::AGGREGATE_EVAL
    } else {
        item::AGGREGATE_TRAIN
    };
    for l in [layout.clone(), layout.clone().with_cluster(Some("rollout"))] {
        let path = l.journal(0);
        let read = crate::store::fs::read_limited(&path, crate::store::ReadLimit::Journal);
        let Some(text) = read.map_err(|e| {
            // A refusal (too large, a link) names the file itself.
            if crate::store::TooLarge::of(&e).is_some() || crate::store::Untrusted::of(&e).is_some()
            {
                e.to_string()
            } else {
                format!("{}: {e}", path.display())
            }
        })?
        else {
            continue;
        };
        if journal::parse(&String::from_utf8_lossy(&text))
            .iter()
            .any(|e| e.iteration == iteration && e.item == wanted)
        {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// Refuse (exit 2, nothing written) while a node of the run runs, judged as `rl-node
/// status` judges it: the kernel for a node on this machine, else a heartbeat that still
/// advances. A run that stopped, crashed or whose nodes all died can be salvaged.
fn refuse_live(layout: &Layout) -> Result<(), Failure> {
    use crate::observe::status;
    let root = layout.root();
    let clusters: Vec<(&str, Layout)> = if status::is_pipelined(root) {
        ["rollout", "update"]
            .into_iter()
            .map(|c| (c, layout.clone().with_cluster(Some(c))))
            .collect()
    } else {
        vec![("", layout.clone())]
    };
    let mut live = Vec::new();
    for (name, l) in clusters {
        if !l.cluster().exists() {
            continue;
        }
        let mut s = match status::read_layout(&l) {
            Ok(s) => s,
            Err(e) => {
                crate::errln!(
                    "note: cannot tell whether the run's nodes are running ({}); make sure every node stopped",
                    e.lines().next().unwrap_or_default()
                );
                continue;
            }
        };
        status::judge_layout(&l, &mut s);
        let ranks: Vec<String> = s
            .ranks
            .iter()
            .filter(|r| r.process == Some(status::Process::Alive))
            .map(|r| format!("rank {} (pid {} on {})", r.rank, r.pid, r.host))
            .collect();
        if !ranks.is_empty() {
            let cluster = match name {
                "" => String::new(),
                n => format!("the {n} cluster's "),
            };
            live.push(format!(
                "{cluster}generation {} has {} running",
                s.gen,
                ranks.join(", ")
            ));
        }
    }
    if live.is_empty() {
        return Ok(());
    }
    Err(Failure::usage(
        format!(
            "the run in {} is live: {}; rl-node aggregate does not touch a running run, and wrote nothing",
            root.display(),
            live.join("; ")
        ),
        Some(format!(
            "stop every node (or wait until the run ends), then salvage; `rl-node status --log-path {}` shows what runs",
            root.display()
        )),
    ))
}

/// What was merged, per rank and in total, and where it went (stderr).
fn summary(m: &Manifest, format: Format, out: &Path) -> String {
    let mut s = render_ranks_in(&m.ranks, if format.is_tensor() { "row" } else { "record" });
    s.push_str(&render_problems(m));
    let merged = m.ranks.iter().filter(|r| r.was_merged()).count();
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let line = if format.is_tensor() {
        format!(
            "merged {} tensor{}, {} row{} ({}) into {}",
            m.tensors.len(),
            plural(m.tensors.len()),
            m.records,
            plural(m.records as usize),
            human_bytes(m.output_bytes.unwrap_or(m.bytes)),
            out.display(),
        )
    } else if format == Format::Command {
        format!(
            "merged {merged} shard{} ({}) with the merge command into {} ({})",
            plural(merged),
            human_bytes(m.bytes),
            out.display(),
            human_bytes(m.output_bytes.unwrap_or(0)),
        )
    } else {
        format!(
            "merged {} record{} ({}) into {}",
            m.records,
            plural(m.records as usize),
            human_bytes(m.bytes),
            out.display(),
        )
    };
    let _ = writeln!(s, "{line}; manifest {}", manifest_path(out).display());
    s
}

/// When no rank has a shard under the configured names but default-named shards of
/// another format are there, say how to merge those.
fn other_format_hint(layout: &Layout, iteration: u64, split: &str) -> Option<String> {
    use crate::shards::naming::{Naming, DEFAULT_OUTPUT_NAME, DEFAULT_SHARD_NAME};
    let dir = layout.rollout_dir(iteration, split);
    let names = list_dir(&crate::store::Fs, &dir).ok()?;
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
            Some(src) if r.was_merged() => {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_salvage_goes_beside_the_merged_file_with_salvaged_before_its_extension() {
        assert_eq!(
            salvaged(Path::new("/r/rollouts/iter-0001/train.jsonl")),
            Path::new("/r/rollouts/iter-0001/train.salvaged.jsonl")
        );
        assert_eq!(
            salvaged(Path::new("/r/train_trajectories.pt.iteration3")),
            Path::new("/r/train_trajectories.pt.salvaged.iteration3")
        );
        assert_eq!(
            salvaged(Path::new("/r/merged")),
            Path::new("/r/merged.salvaged")
        );
    }

    #[test]
    fn committed_files_are_recognised_by_any_spelling_of_their_path() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        std::fs::create_dir_all(l.rollout_dir(2, "train")).unwrap();
        std::fs::create_dir_all(l.rollout_dir(2, "eval")).unwrap();
        let it = d.path().join("rollouts/iter-0002");
        for (path, what) in [
            (it.join("train.jsonl"), "the run's merged train file"),
            (it.join("eval/../eval.jsonl"), "the run's merged eval file"),
            (
                it.join("train.jsonl.manifest.json"),
                "the manifest of the run's merged train file",
            ),
            (it.join("train/rank-1.jsonl"), "rank 1's train shard"),
            (
                it.join("train/rank-1.partial.g4.jsonl"),
                "rank 1's partial train shard",
            ),
        ] {
            assert_eq!(
                committed_at(&l, 2, 2, &path).as_deref(),
                Some(what),
                "{path:?}"
            );
        }
        for path in [
            it.join("train.salvaged.jsonl"),
            it.join("train/rank-2.jsonl"),
            d.path().join("rollouts/iter-0001/train.jsonl"),
        ] {
            assert_eq!(committed_at(&l, 2, 2, &path), None, "{path:?}");
        }
    }
}
