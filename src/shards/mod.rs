//! Tensor shard formats: rank shards that are dictionaries of tensors (token ids,
//! log-probs, rewards, masks), concatenated along dim 0 across ranks.
//!
//! `safetensors` is read and written in pure Rust; `torch` (Python `torch.save` dicts of
//! tensors) needs libtorch and lives behind the `torch` cargo feature; `command` hands the
//! shard list to a user merge command (e.g. for pickles of Python objects).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub mod command;
pub mod naming;
pub mod safetensors;
#[cfg(feature = "torch")]
pub mod torch;

/// Element types the readers and the safetensors writer agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The dtype a safetensors header name stands for, if rl-node has it.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        Some(match name {
            "F64" => DType::F64,
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "I16" => DType::I16,
            "I8" => DType::I8,
            "U8" => DType::U8,
            "BOOL" => DType::Bool,
            _ => return None,
        })
    }

    /// The dtype's name in a safetensors header.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }
}

/// One named tensor: row-major (C-contiguous), little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The file cannot be read as a shard of its format (truncated, not a dict of tensors…).
    #[error("{path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    /// Ranks disagree on keys, dtypes or trailing dimensions.
    #[error("{reason}")]
    Mismatch { reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Whether this build reads `torch.save` shards (the `torch` cargo feature).
pub fn torch_available() -> bool {
    cfg!(feature = "torch")
}

/// Read a `torch.save` dict of tensors with the `torch` feature; without it, say how to
/// get one.
pub fn read_torch_dict(path: &Path) -> Result<Vec<TensorData>, ShardError> {
    #[cfg(feature = "torch")]
    {
        torch::read_torch_dict(path)
    }
    #[cfg(not(feature = "torch"))]
    {
        Err(ShardError::Unreadable {
            path: path.to_path_buf(),
            reason: "this rl-node was built without the `torch` cargo feature, so it cannot read torch.save files (cargo build --release --features torch)".into(),
        })
    }
}
