//! [`AggregateError`]: why a merge published nothing, as a message for humans and, with
//! `--json`, as JSON ([`AggregateError::to_json`]).

use super::RankEntry;
use crate::shards::command::CommandError;
use std::io;
use std::path::PathBuf;

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
    /// The output exists and `MergeOptions::replace` is off; nothing was published.
    #[error("{} already exists and is not replaced; nothing was published", .path.display())]
    Exists { path: PathBuf },
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
            AggregateError::Exists { path } => {
                v["kind"] = json!("exists");
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
