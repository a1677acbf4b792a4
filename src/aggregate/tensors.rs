//! The safetensors and torch merge: every available rank's shard is opened (a torch shard
//! read as a dict of tensors), the ranks are checked to agree on names, dtypes and
//! trailing dimensions, and the tensors are concatenated along dim 0 into one safetensors
//! file (`crate::shards::safetensors`).

use super::{unreadable, AggregateError, Extras, MergeOptions, MergedPiece, MergedTensor};
use super::{RankEntry, RankStatus};
use crate::layout::Layout;
use crate::shards::naming::Format;
use crate::shards::safetensors as st;
use crate::shards::ShardError;
use std::path::Path;

/// safetensors / torch: read every available rank's header (or tensors), check that they
/// agree, and stream the concatenation into `tmp` (fsynced).
pub(super) fn merge_tensors(
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
        if !entry.status.has_source() {
            continue;
        }
        tick();
        let path = entry.source_path(layout.root());
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
    let f = crate::store::fs::create_file(tmp).map_err(werr)?;
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
