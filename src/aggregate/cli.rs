//! `rl-node aggregate`: the command-line arguments, [`main`] (which loads the
//! configuration, works out the number of ranks, runs [`merge`] and maps its outcome to an
//! exit code), and the per-rank summary and byte sizes it prints on stderr.

use super::human_bytes;
use super::survey::list_dir;
use super::{
    manifest_path, merge, AggregateError, Manifest, MergeOptions, RankEntry,
    DEFAULT_MAX_RECORD_BYTES,
};
use crate::error::Failure;
use crate::layout::Layout;
use crate::shards::naming::Format;
use serde::Deserialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

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
pub fn main(
    args: AggregateArgs,
    log_path: Option<String>,
    config: Option<PathBuf>,
) -> Result<i32, Failure> {
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
    let cluster = layout.cluster();
    let recorded = match crate::store::read(&cluster) {
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
            return Err(Failure::usage(
                format!("{} says num_nodes 0; pass --num-ranks N", cluster.display()),
                None,
            ));
        }
        (None, None) => {
            return Err(Failure::usage(
                format!(
                    "{} does not exist, so the number of ranks is unknown; pass --num-ranks N",
                    cluster.display()
                ),
                None,
            ));
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
                let t = loaded.config.template(t);
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
            Ok(exit::DONE)
        }
        Err(e) => {
            if args.json {
                crate::outln!(
                    "{}",
                    serde_json::to_string_pretty(&e.to_json()).expect("json")
                );
            }
            let code = if matches!(e, AggregateError::Unsupported { .. }) {
                exit::USAGE
            } else {
                exit::FAILED
            };
            let mut failure = Failure {
                code,
                message: e.to_string(),
                hint: None,
                detail: None,
            };
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
            }
            Err(failure)
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
