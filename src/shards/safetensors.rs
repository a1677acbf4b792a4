//! safetensors shards: read each rank's header, check that the ranks agree, and stream
//! their tensors, concatenated along dim 0 in rank order, into one safetensors file.
//!
//! A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {…}}`)
//! and the tensors' bytes. Only headers are parsed (by the `safetensors` crate's own
//! validation, the code Python's `safetensors` runs too); tensor bytes are copied from
//! each input straight into the output with `copy_file_range` (in the kernel, like `cat`),
//! while a second thread reads the same ranges to hash them, so memory stays flat whatever
//! the size of the shards. The output's write-back is started as it grows, so the fsync
//! before publication is short. A file whose header promises more bytes than it holds (a
//! writer that died, a truncated copy) is [`ShardError::Unreadable`] before anything is
//! copied. Concatenating row-major tensors along dim 0 is concatenating their bytes, so
//! every output tensor is rank 0's bytes, then rank 1's, and so on.
//!
//! [`Shard::from_tensors`] wraps tensors already in memory (what the `torch` reader
//! returns) so that `torch.save` shards go through the same checks and writer.
//!
//! The output is deterministic: tensors are laid out as the `safetensors` crate lays them
//! out (by decreasing dtype alignment, then name), the header's keys are sorted, and its
//! `__metadata__` holds the entries every input agrees on.

use super::{ShardError, TensorData};
use ::safetensors::tensor::Metadata;
use ::safetensors::Dtype;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The largest header the `safetensors` crate (and so Python) accepts.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Bytes read per call for hashing (and for copying where `copy_file_range` is missing).
const BLOCK: usize = 1 << 20;
/// Bytes copied per `copy_file_range` round (between ticks and write-back hints).
const COPY_CHUNK: u64 = 16 << 20;
/// Call `tick` at least this often (bytes copied).
const TICK_BYTES: u64 = 16 << 20;
/// Start writing back the output every this many bytes, so the final fsync is short.
const WRITEBACK_BYTES: u64 = 64 << 20;

/// The name a safetensors header gives a dtype ("F32", "BF16", "BOOL", …).
pub fn dtype_name(d: Dtype) -> String {
    match serde_json::to_value(d) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{d:?}"),
    }
}

/// One tensor of a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorSpec {
    pub name: String,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Where its bytes are: a file offset for a file, an index into the in-memory
    /// tensors for [`Shard::from_tensors`].
    #[serde(skip)]
    start: u64,
    #[serde(skip)]
    pub len: u64,
}

fn ser_dtype<S: serde::Serializer>(d: &Dtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&dtype_name(*d))
}

#[derive(Debug)]
enum Data {
    File,
    Memory(Vec<Vec<u8>>),
}

/// One rank's shard: its tensors (by name) and where their bytes are.
#[derive(Debug)]
pub struct Shard {
    pub path: PathBuf,
    /// Sorted by name.
    pub tensors: Vec<TensorSpec>,
    pub metadata: BTreeMap<String, String>,
    /// Size of the file when its header was read.
    pub file_len: u64,
    data: Data,
}

impl Shard {
    /// Read and check a safetensors file's header. An empty file is a shard without
    /// tensors (what rl-node commits when a rollout command wrote nothing).
    pub fn open(path: &Path) -> Result<Shard, ShardError> {
        let io_err = |source| ShardError::Io {
            path: path.to_path_buf(),
            source,
        };
        let bad = |reason: String| ShardError::Unreadable {
            path: path.to_path_buf(),
            reason,
        };
        let mut f = File::open(path).map_err(io_err)?;
        let file_len = f.metadata().map_err(io_err)?.len();
        if file_len == 0 {
            return Ok(Shard {
                path: path.to_path_buf(),
                tensors: Vec::new(),
                metadata: BTreeMap::new(),
                file_len,
                data: Data::File,
            });
        }
        if file_len < 8 {
            return Err(bad(format!(
                "{file_len} bytes: too short for a safetensors header (truncated?)"
            )));
        }
        let mut n = [0u8; 8];
        f.read_exact(&mut n).map_err(io_err)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header length {n} is larger than safetensors allows ({MAX_HEADER_BYTES}): not a safetensors file"
            )));
        }
        if 8 + n > file_len {
            return Err(bad(format!(
                "truncated: the header is {n} bytes but the file has only {} after the length field",
                file_len - 8
            )));
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(io_err)?;
        let text = std::str::from_utf8(&header).map_err(|e| {
            bad(format!(
                "the header is not UTF-8 ({e}): not a safetensors file"
            ))
        })?;
        // The crate's own parse checks dtypes, shapes against byte sizes, and that the
        // data offsets tile the data section.
        let meta: Metadata = serde_json::from_str(text).map_err(|e| {
            bad(format!(
                "not a safetensors header of tensors: {}",
                describe_header_error(text, &e)
            ))
        })?;
        let data_start = 8 + n;
        let have = file_len - data_start;
        let want = meta.data_len() as u64;
        if want > have {
            return Err(bad(format!(
                "truncated: the header describes {want} bytes of tensor data but the file holds {have}"
            )));
        }
        if want < have {
            return Err(bad(format!(
                "{} bytes after the last tensor: not a well-formed safetensors file",
                have - want
            )));
        }
        let mut tensors: Vec<TensorSpec> = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| TensorSpec {
                name,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + info.data_offsets.0 as u64,
                len: (info.data_offsets.1 - info.data_offsets.0) as u64,
            })
            .collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let metadata = meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        Ok(Shard {
            path: path.to_path_buf(),
            tensors,
            metadata,
            file_len,
            data: Data::File,
        })
    }

    /// Tensors already in memory (e.g. read from a `torch.save` file), checked like a
    /// safetensors header would be.
    pub fn from_tensors(
        path: &Path,
        tensors: Vec<TensorData>,
        file_len: u64,
    ) -> Result<Shard, ShardError> {
        let bad = |reason: String| ShardError::Unreadable {
            path: path.to_path_buf(),
            reason,
        };
        let mut specs = Vec::with_capacity(tensors.len());
        let mut data = Vec::with_capacity(tensors.len());
        let mut seen = BTreeSet::new();
        for (i, t) in tensors.into_iter().enumerate() {
            if !seen.insert(t.name.clone()) {
                return Err(bad(format!("tensor `{}` appears twice", t.name)));
            }
            let dtype: Dtype = serde_json::from_value(serde_json::Value::String(
                t.dtype.safetensors_name().to_string(),
            ))
            .expect("every DType has a safetensors name");
            let want = t
                .shape
                .iter()
                .try_fold(t.dtype.size(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    bad(format!(
                        "tensor `{}`: shape {:?} overflows",
                        t.name, t.shape
                    ))
                })?;
            if want != t.data.len() {
                return Err(bad(format!(
                    "tensor `{}`: shape {:?} of {} needs {want} bytes but {} were read",
                    t.name,
                    t.shape,
                    t.dtype.safetensors_name(),
                    t.data.len()
                )));
            }
            specs.push(TensorSpec {
                name: t.name,
                dtype,
                shape: t.shape,
                start: i as u64,
                len: want as u64,
            });
            data.push(t.data);
        }
        let mut order: Vec<usize> = (0..specs.len()).collect();
        order.sort_by(|&a, &b| specs[a].name.cmp(&specs[b].name));
        let specs = order.iter().map(|&i| specs[i].clone()).collect();
        Ok(Shard {
            path: path.to_path_buf(),
            tensors: specs,
            metadata: BTreeMap::new(),
            file_len,
            data: Data::Memory(data),
        })
    }

    /// Rows this shard contributes: dim 0, when all its tensors share it (one row per
    /// trajectory, the usual layout); else `None`.
    pub fn rows(&self) -> Option<u64> {
        let mut dims = self.tensors.iter().map(|t| t.shape.first().copied());
        let first = dims.next()??;
        dims.all(|d| d == Some(first)).then_some(first as u64)
    }

    /// Bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

/// serde's message about a header, with a hint for the common case of a value that is not
/// a tensor description.
fn describe_header_error(text: &str, e: &serde_json::Error) -> String {
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(text) {
        for (k, v) in &map {
            if k == "__metadata__" {
                let strings = v
                    .as_object()
                    .is_some_and(|m| m.values().all(|x| x.is_string()));
                if !strings {
                    return format!("__metadata__ must map strings to strings, found {v}");
                }
                continue;
            }
            let ok = v.get("dtype").is_some()
                && v.get("shape").is_some()
                && v.get("data_offsets").is_some();
            if !ok {
                let shown: String = v.to_string().chars().take(80).collect();
                return format!("key `{k}` is not a tensor (dtype, shape, data_offsets): {shown}");
            }
        }
    }
    e.to_string()
}

/// One rank's shard taking part in a merge.
#[derive(Debug)]
pub struct Input {
    pub rank: u32,
    pub shard: Shard,
}

/// Bytes of one input inside one output tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Piece {
    pub rank: u32,
    /// dim 0 of the input tensor.
    pub rows: u64,
    /// Offset in the output's data section.
    pub offset: u64,
    pub bytes: u64,
    #[serde(skip)]
    input: usize,
    #[serde(skip)]
    src: usize,
}

/// One tensor of the merged file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutTensor {
    pub name: String,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// `[begin, end)` in the data section, as in the header.
    pub data_offsets: [u64; 2],
    pub pieces: Vec<Piece>,
}

/// The merged file, before any byte is copied.
#[derive(Debug)]
pub struct Plan {
    pub tensors: Vec<OutTensor>,
    /// `__metadata__` of the output: the entries every input with tensors agrees on.
    pub metadata: BTreeMap<String, String>,
    /// `__metadata__` keys dropped because inputs disagree (for the manifest).
    pub dropped_metadata: Vec<String>,
    /// Length field and header, padded to 8 bytes.
    header: Vec<u8>,
    pub data_len: u64,
}

impl Plan {
    /// Size of the merged file.
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Check that the inputs agree (same keys, dtypes and trailing dimensions; no scalars)
/// and lay out the merged file. Inputs without tensors (an empty file) take no part.
pub fn plan(inputs: &[Input]) -> Result<Plan, ShardError> {
    let with: Vec<usize> = (0..inputs.len())
        .filter(|&i| !inputs[i].shard.tensors.is_empty())
        .collect();
    let mut out: Vec<OutTensor> = Vec::new();
    if let Some(&first) = with.first() {
        let r0 = &inputs[first];
        check_no_scalars(r0)?;
        let names0 = names(r0);
        for &i in &with[1..] {
            check_agrees(r0, &names0, &inputs[i])?;
        }
        out = concat(inputs, &with);
    }
    let data_len = lay_out(&mut out);
    let (metadata, dropped_metadata) = common_metadata(inputs, &with);
    let header = header_bytes(&out, &metadata)?;
    Ok(Plan {
        tensors: out,
        metadata,
        dropped_metadata: dropped_metadata.into_iter().collect(),
        header,
        data_len,
    })
}

fn mismatch(reason: String) -> ShardError {
    ShardError::Mismatch { reason }
}

/// The first input with tensors has no scalar: the others are compared with it.
fn check_no_scalars(r0: &Input) -> Result<(), ShardError> {
    for t in &r0.shard.tensors {
        if t.shape.is_empty() {
            return Err(mismatch(format!(
                "tensor `{}` of rank {} ({}) is a scalar (shape []): scalars cannot be concatenated along dim 0; store it with a leading dimension (shape [1])",
                t.name,
                r0.rank,
                r0.shard.path.display()
            )));
        }
    }
    Ok(())
}

/// The names of `r`'s tensors.
fn names(r: &Input) -> BTreeSet<&str> {
    r.shard.tensors.iter().map(|t| t.name.as_str()).collect()
}

/// `r` has the tensors of `r0` (whose names are `names0`), no others, each of the same
/// dtype and trailing dimensions.
fn check_agrees(r0: &Input, names0: &BTreeSet<&str>, r: &Input) -> Result<(), ShardError> {
    let names = names(r);
    let differ = |what: String| {
        mismatch(format!(
            "rank {} ({}) {what} (rank {} has {}; rank {} has {})",
            r.rank,
            r.shard.path.display(),
            r0.rank,
            list(names0),
            r.rank,
            list(&names)
        ))
    };
    if let Some(k) = names0.difference(&names).next() {
        return Err(differ(format!(
            "has no tensor `{k}`, which rank {} has",
            r0.rank
        )));
    }
    if let Some(k) = names.difference(names0).next() {
        return Err(differ(format!(
            "has a tensor `{k}` that rank {} does not have",
            r0.rank
        )));
    }
    // Same names, both sorted: zip pairs them.
    for (a, b) in r0.shard.tensors.iter().zip(&r.shard.tensors) {
        if a.dtype != b.dtype {
            return Err(mismatch(format!(
                "tensor `{}`: rank {} has dtype {} but rank {} ({}) has {}",
                a.name,
                r0.rank,
                dtype_name(a.dtype),
                r.rank,
                r.shard.path.display(),
                dtype_name(b.dtype)
            )));
        }
        if b.shape.is_empty() {
            return Err(mismatch(format!(
                "tensor `{}` of rank {} ({}) is a scalar (shape []): scalars cannot be concatenated along dim 0",
                b.name,
                r.rank,
                r.shard.path.display()
            )));
        }
        if a.shape[1..] != b.shape[1..] {
            return Err(mismatch(format!(
                "tensor `{}`: trailing dimensions differ: rank {} has shape {} but rank {} ({}) has {}; only dim 0 may differ between ranks",
                a.name,
                r0.rank,
                shape_str(&a.shape),
                r.rank,
                r.shard.path.display(),
                shape_str(&b.shape)
            )));
        }
    }
    Ok(())
}

/// Each tensor of the inputs `with` (which agree) as the concatenation of theirs along
/// dim 0, in rank order; offsets are not laid out yet.
fn concat(inputs: &[Input], with: &[usize]) -> Vec<OutTensor> {
    let r0 = &inputs[with[0]];
    let mut out = Vec::new();
    for (k, t) in r0.shard.tensors.iter().enumerate() {
        let mut shape = t.shape.clone();
        shape[0] = with
            .iter()
            .map(|&i| inputs[i].shard.tensors[k].shape[0])
            .sum();
        out.push(OutTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape,
            data_offsets: [0, 0],
            pieces: with
                .iter()
                .map(|&i| {
                    let s = &inputs[i].shard.tensors[k];
                    Piece {
                        rank: inputs[i].rank,
                        rows: s.shape[0] as u64,
                        offset: 0,
                        bytes: s.len,
                        input: i,
                        src: k,
                    }
                })
                .collect(),
        });
    }
    out
}

/// Order the tensors and give each tensor and piece its place in the data section;
/// returns the data section's length.
fn lay_out(out: &mut [OutTensor]) -> u64 {
    // The safetensors crate's layout: decreasing alignment, then name.
    out.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
    let mut offset = 0u64;
    for t in out {
        let begin = offset;
        for p in &mut t.pieces {
            p.offset = offset;
            offset += p.bytes;
        }
        t.data_offsets = [begin, offset];
    }
    offset
}

/// The `__metadata__` entries every input with tensors has with the same value, and the
/// keys dropped because they do not.
fn common_metadata(
    inputs: &[Input],
    with: &[usize],
) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let mut metadata = BTreeMap::new();
    let mut dropped_metadata = BTreeSet::new();
    if let Some(&first) = with.first() {
        for (k, v) in &inputs[first].shard.metadata {
            if with
                .iter()
                .all(|&i| inputs[i].shard.metadata.get(k) == Some(v))
            {
                metadata.insert(k.clone(), v.clone());
            } else {
                dropped_metadata.insert(k.clone());
            }
        }
        for &i in with {
            for k in inputs[i].shard.metadata.keys() {
                if !metadata.contains_key(k) {
                    dropped_metadata.insert(k.clone());
                }
            }
        }
    }
    (metadata, dropped_metadata)
}

fn list(names: &BTreeSet<&str>) -> String {
    if names.is_empty() {
        return "none".into();
    }
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The length field and JSON header (sorted keys), padded with spaces to 8 bytes as the
/// `safetensors` crate pads it, and checked by the crate's own parser.
fn header_bytes(
    tensors: &[OutTensor],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, ShardError> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    for t in tensors {
        map.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": dtype_name(t.dtype),
                "shape": t.shape,
                "data_offsets": t.data_offsets,
            }),
        );
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(map)).expect("json");
    json.resize(json.len().next_multiple_of(8), b' ');
    if json.len() as u64 > MAX_HEADER_BYTES {
        return Err(ShardError::Mismatch {
            reason: format!(
                "the merged header would be {} bytes, more than safetensors allows ({MAX_HEADER_BYTES})",
                json.len()
            ),
        });
    }
    debug_assert!(serde_json::from_slice::<Metadata>(&json).is_ok());
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    Ok(bytes)
}

/// What was copied from one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub bytes: u64,
    /// SHA-256 of this input's bytes in the order they appear in the merged file.
    pub sha256: String,
}

/// Write the merged file to `out` (header, then every tensor's pieces in rank order),
/// copying each input's byte ranges directly from its file. Two threads: this one copies
/// with `copy_file_range` (in the kernel, as `cat` does; plain reads and writes where the
/// filesystems do not support it), the other reads the same ranges and hashes them
/// (SHA-256 is the slowest step, so it gets a core of its own). Memory is two small
/// buffers whatever the size of the shards; `tick` is called regularly. Returns what was
/// copied from each input (in the order of `inputs`); the caller fsyncs and publishes
/// `out`.
pub fn write(
    plan: &Plan,
    inputs: &[Input],
    out: &File,
    out_path: &Path,
    tick: &mut dyn FnMut(),
) -> Result<Vec<Copied>, ShardError> {
    write_with(plan, inputs, out, out_path, tick, true)
}

/// [`write`], optionally without `copy_file_range` (the fallback, also for tests).
fn write_with(
    plan: &Plan,
    inputs: &[Input],
    out: &File,
    out_path: &Path,
    tick: &mut dyn FnMut(),
    kernel_copy: bool,
) -> Result<Vec<Copied>, ShardError> {
    let m = Merger {
        plan,
        inputs,
        files: open_inputs(inputs)?,
        out,
        out_path,
    };
    out.write_all_at(&plan.header, 0).map_err(|e| m.werr(e))?;

    let stop = std::sync::atomic::AtomicBool::new(false);
    let (hashed, copied) = std::thread::scope(|s| {
        let hasher = s.spawn(|| m.hash(&stop));
        let copied = m.copy(tick, kernel_copy);
        if copied.is_err() {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let hashed = hasher
            .join()
            .expect("the safetensors hashing thread panicked");
        (hashed, copied)
    });
    copied?;
    Ok(hashed?
        .into_iter()
        .map(|(bytes, h)| Copied {
            bytes,
            sha256: hex::encode(h.finalize()),
        })
        .collect())
}

/// Each input's file, open for reading, where it has tensors and is read from a file.
fn open_inputs(inputs: &[Input]) -> Result<Vec<Option<File>>, ShardError> {
    inputs
        .iter()
        .map(|i| match i.shard.data {
            Data::File if !i.shard.tensors.is_empty() => File::open(&i.shard.path)
                .map(Some)
                .map_err(|source| ShardError::Io {
                    path: i.shard.path.clone(),
                    source,
                }),
            _ => Ok(None),
        })
        .collect()
}

fn shrank(input: &Input) -> ShardError {
    ShardError::Unreadable {
        path: input.shard.path.clone(),
        reason: format!(
            "the file shrank while it was being merged (it was {} bytes)",
            input.shard.file_len
        ),
    }
}

/// A failed read of `input`: past its end, it shrank.
fn rerr(input: &Input, e: io::Error) -> ShardError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        shrank(input)
    } else {
        ShardError::Io {
            path: input.shard.path.clone(),
            source: e,
        }
    }
}

/// One [`write`] under way: what the copying and the hashing thread share.
struct Merger<'a> {
    plan: &'a Plan,
    inputs: &'a [Input],
    /// From [`open_inputs`].
    files: Vec<Option<File>>,
    out: &'a File,
    out_path: &'a Path,
}

impl Merger<'_> {
    fn werr(&self, source: io::Error) -> ShardError {
        ShardError::Io {
            path: self.out_path.to_path_buf(),
            source,
        }
    }

    /// The hashing thread: each input's byte count and SHA-256, over the ranges the copy
    /// copies, in the order they appear in the merged file. Gives up early once `stop`
    /// is set (the copy failed).
    fn hash(&self, stop: &std::sync::atomic::AtomicBool) -> Result<Vec<(u64, Sha256)>, ShardError> {
        let mut sums: Vec<(u64, Sha256)> = self.inputs.iter().map(|_| (0, Sha256::new())).collect();
        let mut buf = vec![0u8; BLOCK];
        for t in &self.plan.tensors {
            for p in &t.pieces {
                let input = &self.inputs[p.input];
                let spec = &input.shard.tensors[p.src];
                let sum = &mut sums[p.input];
                match &input.shard.data {
                    Data::Memory(data) => sum.1.update(&data[spec.start as usize]),
                    Data::File => {
                        let f = self.files[p.input].as_ref().expect("opened above");
                        let mut done = 0u64;
                        while done < spec.len {
                            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                                return Ok(sums);
                            }
                            let n = ((spec.len - done) as usize).min(BLOCK);
                            f.read_exact_at(&mut buf[..n], spec.start + done)
                                .map_err(|e| rerr(input, e))?;
                            sum.1.update(&buf[..n]);
                            done += n as u64;
                        }
                    }
                }
                sum.0 += spec.len;
            }
        }
        Ok(sums)
    }

    /// The copying thread: every tensor's pieces, in chunks, to their place after the
    /// header, calling `tick` and starting writeback as it goes.
    fn copy(&self, tick: &mut dyn FnMut(), kernel_copy: bool) -> Result<(), ShardError> {
        let header_len = self.plan.header.len() as u64;
        let mut kernel_copy = kernel_copy;
        let mut buf = Vec::new();
        let mut since_tick = 0u64;
        let mut synced = header_len;
        for t in &self.plan.tensors {
            for p in &t.pieces {
                let input = &self.inputs[p.input];
                let spec = &input.shard.tensors[p.src];
                let mut done = 0u64;
                while done < spec.len {
                    let at = header_len + p.offset + done;
                    let n = (spec.len - done).min(COPY_CHUNK);
                    match &input.shard.data {
                        Data::Memory(data) => {
                            let src = &data[spec.start as usize];
                            self.out
                                .write_all_at(&src[done as usize..(done + n) as usize], at)
                                .map_err(|e| self.werr(e))?;
                        }
                        Data::File => self.copy_from_file(
                            p.input,
                            spec.start + done,
                            at,
                            n,
                            &mut kernel_copy,
                            &mut buf,
                        )?,
                    }
                    done += n;
                    since_tick += n;
                    if since_tick >= TICK_BYTES {
                        since_tick = 0;
                        tick();
                    }
                    let end = at + n;
                    if end - synced >= WRITEBACK_BYTES {
                        crate::store::fs::start_writeback(self.out, synced, end - synced);
                        synced = end;
                    }
                }
            }
        }
        Ok(())
    }

    /// Copy `n` bytes of input `i`'s file at `from` to the output at `at`: in the kernel
    /// while `kernel_copy` holds (cleared where the filesystems do not support it), else
    /// by reads and writes through `buf`.
    fn copy_from_file(
        &self,
        i: usize,
        from: u64,
        at: u64,
        n: u64,
        kernel_copy: &mut bool,
        buf: &mut Vec<u8>,
    ) -> Result<(), ShardError> {
        let input = &self.inputs[i];
        let f = self.files[i].as_ref().expect("opened above");
        let mut left = n;
        if *kernel_copy {
            match copy_range(f, from, self.out, at, left) {
                Ok(k) if k == left => left = 0,
                // Past the input's end: it shrank.
                Ok(_) => return Err(shrank(input)),
                Err(e) if crate::store::fs::copy_unsupported(&e) => *kernel_copy = false,
                // A full disk is the output's; other errors are taken as the input's (the
                // copy reads it).
                Err(e) if out_of_space(&e) => return Err(self.werr(e)),
                Err(e) => return Err(rerr(input, e)),
            }
        }
        if left > 0 {
            buf.resize(BLOCK, 0);
            let mut off = 0u64;
            while off < left {
                let k = ((left - off) as usize).min(BLOCK);
                f.read_exact_at(&mut buf[..k], from + off)
                    .map_err(|e| rerr(input, e))?;
                self.out
                    .write_all_at(&buf[..k], at + off)
                    .map_err(|e| self.werr(e))?;
                off += k as u64;
            }
        }
        Ok(())
    }
}

/// Copy `len` bytes from `src` at `src_off` to `dst` at `dst_off` in the kernel
/// (`copy_file_range`). Returns fewer than `len` only at the end of `src`.
fn copy_range(src: &File, src_off: u64, dst: &File, dst_off: u64, len: u64) -> io::Result<u64> {
    let (mut off_in, mut off_out) = (src_off, dst_off);
    let mut done = 0u64;
    while done < len {
        let want = (len - done).min(1 << 30) as usize;
        let n = match rustix::fs::copy_file_range(
            src,
            Some(&mut off_in),
            dst,
            Some(&mut off_out),
            want,
        ) {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                let e = io::Error::from(e);
                // Nothing copied yet: let the caller fall back from the start of the range.
                if done == 0 || !crate::store::fs::copy_unsupported(&e) {
                    return Err(e);
                }
                return Ok(done);
            }
        };
        if n == 0 {
            break;
        }
        done += n as u64;
    }
    Ok(done)
}

fn out_of_space(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG)
    )
}

/// Serialize tensors to safetensors bytes (for tests and small fixtures; large merges go
/// through [`plan`] and [`write`]). Panics on tensors whose data does not fit their shape.
pub fn to_bytes(tensors: &[TensorData], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let shard = Shard::from_tensors(Path::new("memory"), tensors.to_vec(), 0)
        .expect("tensor data fits its shape");
    let Data::Memory(data) = &shard.data else {
        unreachable!("from_tensors keeps data in memory")
    };
    let mut order: Vec<&TensorSpec> = shard.tensors.iter().collect();
    order.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
    let mut offset = 0;
    let out: Vec<OutTensor> = order
        .iter()
        .map(|t| {
            offset += t.len;
            OutTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data_offsets: [offset - t.len, offset],
                pieces: Vec::new(),
            }
        })
        .collect();
    let mut bytes = header_bytes(&out, metadata).expect("small header");
    for t in order {
        bytes.extend_from_slice(&data[t.start as usize]);
    }
    bytes
}

/// Read a whole safetensors file into memory (for tests and small files).
pub fn read_all(path: &Path) -> Result<Vec<TensorData>, ShardError> {
    let shard = Shard::open(path)?;
    let bytes = std::fs::read(path).map_err(|source| ShardError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    shard
        .tensors
        .iter()
        .map(|t| {
            let dtype =
                super::DType::from_safetensors_name(&dtype_name(t.dtype)).ok_or_else(|| {
                    ShardError::Unreadable {
                        path: path.to_path_buf(),
                        reason: format!(
                            "tensor `{}`: dtype {} has no rl-node DType",
                            t.name,
                            dtype_name(t.dtype)
                        ),
                    }
                })?;
            Ok(TensorData {
                name: t.name.clone(),
                dtype,
                shape: t.shape.clone(),
                data: bytes[t.start as usize..(t.start + t.len) as usize].to_vec(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::DType;
    use super::*;

    fn t(name: &str, dtype: DType, shape: &[usize], seed: u8) -> TensorData {
        let n = shape.iter().product::<usize>() * dtype.size();
        TensorData {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data: (0..n)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect(),
        }
    }

    fn file(dir: &Path, name: &str, tensors: &[TensorData]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, to_bytes(tensors, &BTreeMap::new())).unwrap();
        p
    }

    fn merge(paths: &[PathBuf]) -> Result<(Vec<u8>, Plan, Vec<Copied>), ShardError> {
        let inputs: Vec<Input> = paths
            .iter()
            .enumerate()
            .map(|(r, p)| {
                Shard::open(p).map(|shard| Input {
                    rank: r as u32,
                    shard,
                })
            })
            .collect::<Result<_, _>>()?;
        let plan = plan(&inputs)?;
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out.safetensors");
        let f = File::create(&out).unwrap();
        let copied = write(&plan, &inputs, &f, &out, &mut || {})?;
        Ok((std::fs::read(&out).unwrap(), plan, copied))
    }

    #[test]
    fn bytes_round_trip_through_the_crate() {
        let d = tempfile::tempdir().unwrap();
        let ts = vec![
            t("b", DType::BF16, &[2, 3], 1),
            t("a", DType::Bool, &[2], 2),
            t("c", DType::I64, &[2, 1], 3),
        ];
        let p = file(d.path(), "x.safetensors", &ts);
        let bytes = std::fs::read(&p).unwrap();
        let st = ::safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 3);
        assert_eq!(st.tensor("b").unwrap().data(), &ts[0].data[..]);
        let back = read_all(&p).unwrap();
        let mut want = ts.clone();
        want.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(back, want);
    }

    #[test]
    fn concatenates_along_dim_0_in_rank_order() {
        let d = tempfile::tempdir().unwrap();
        let r0 = vec![t("x", DType::F32, &[2, 2], 0), t("m", DType::Bool, &[2], 9)];
        let r1 = vec![t("m", DType::Bool, &[3], 7), t("x", DType::F32, &[3, 2], 5)];
        let paths = [file(d.path(), "0", &r0), file(d.path(), "1", &r1)];
        let (bytes, plan, copied) = merge(&paths).unwrap();
        let st = ::safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let x = st.tensor("x").unwrap();
        assert_eq!(x.shape(), &[5, 2]);
        assert_eq!(x.data(), [&r0[0].data[..], &r1[1].data[..]].concat());
        assert_eq!(
            st.tensor("m").unwrap().data(),
            [&r0[1].data[..], &r1[0].data[..]].concat()
        );
        // f32 before bool: the crate's layout.
        assert_eq!(plan.tensors[0].name, "x");
        assert_eq!(copied[0].bytes, 16 + 2);
        let want0 = Sha256::digest([&r0[0].data[..], &r0[1].data[..]].concat());
        assert_eq!(copied[0].sha256, hex::encode(want0));
    }

    #[test]
    fn the_fallback_copy_and_memory_inputs_give_the_same_bytes() {
        let d = tempfile::tempdir().unwrap();
        let r0 = vec![
            t("x", DType::I64, &[300_000, 1], 3),
            t("y", DType::BF16, &[300_000], 4),
        ];
        let r1 = vec![t("y", DType::BF16, &[5], 6), t("x", DType::I64, &[5, 1], 7)];
        let paths = [file(d.path(), "0", &r0), file(d.path(), "1", &r1)];
        let (kernel, _, copied) = merge(&paths).unwrap();
        let inputs: Vec<Input> = paths
            .iter()
            .enumerate()
            .map(|(r, p)| Input {
                rank: r as u32,
                shard: Shard::open(p).unwrap(),
            })
            .collect();
        let plan = plan(&inputs).unwrap();
        let out = d.path().join("fallback");
        let f = File::create(&out).unwrap();
        let again = write_with(&plan, &inputs, &f, &out, &mut || {}, false).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), kernel);
        assert_eq!(again, copied);
        // The same tensors from memory (as the torch reader hands them over).
        let mem: Vec<Input> = [&r0, &r1]
            .iter()
            .enumerate()
            .map(|(r, ts)| Input {
                rank: r as u32,
                shard: Shard::from_tensors(Path::new("m"), ts.to_vec(), 0).unwrap(),
            })
            .collect();
        let plan = super::plan(&mem).unwrap();
        let out = d.path().join("memory");
        let f = File::create(&out).unwrap();
        assert_eq!(write(&plan, &mem, &f, &out, &mut || {}).unwrap(), copied);
        assert_eq!(std::fs::read(&out).unwrap(), kernel);
    }

    #[test]
    fn disagreements_name_the_rank_key_and_both_values() {
        let d = tempfile::tempdir().unwrap();
        let base = file(
            d.path(),
            "0",
            &[t("x", DType::F32, &[2, 4], 0), t("y", DType::I64, &[2], 0)],
        );
        let case = |name: &str, ts: &[TensorData]| -> String {
            let other = file(d.path(), name, ts);
            match merge(&[base.clone(), other]) {
                Err(ShardError::Mismatch { reason }) => reason,
                other => panic!("{other:?}"),
            }
        };
        let m = case("keys", &[t("x", DType::F32, &[2, 4], 0)]);
        assert!(m.contains("rank 1") && m.contains("no tensor `y`"), "{m}");
        let m = case(
            "extra",
            &[
                t("x", DType::F32, &[2, 4], 0),
                t("y", DType::I64, &[2], 0),
                t("z", DType::I64, &[2], 0),
            ],
        );
        assert!(m.contains("tensor `z` that rank 0 does not have"), "{m}");
        let m = case(
            "dtype",
            &[t("x", DType::BF16, &[2, 4], 0), t("y", DType::I64, &[2], 0)],
        );
        assert!(
            m.contains("tensor `x`: rank 0 has dtype F32 but rank 1") && m.contains("has BF16"),
            "{m}"
        );
        let m = case(
            "trailing",
            &[t("x", DType::F32, &[3, 5], 0), t("y", DType::I64, &[3], 0)],
        );
        assert!(
            m.contains("[2, 4]") && m.contains("[3, 5]") && m.contains("tensor `x`"),
            "{m}"
        );
        let m = case(
            "scalar",
            &[t("x", DType::F32, &[2, 4], 0), t("y", DType::I64, &[], 0)],
        );
        assert!(m.contains("scalar"), "{m}");
    }

    #[test]
    fn truncated_and_foreign_files_are_unreadable() {
        let d = tempfile::tempdir().unwrap();
        let p = file(d.path(), "ok", &[t("x", DType::F32, &[4, 4], 0)]);
        let bytes = std::fs::read(&p).unwrap();
        let reason = |b: &[u8]| {
            let q = d.path().join("bad");
            std::fs::write(&q, b).unwrap();
            match Shard::open(&q) {
                Err(ShardError::Unreadable { reason, .. }) => reason,
                other => panic!("{other:?}"),
            }
        };
        assert!(reason(&bytes[..bytes.len() - 1]).contains("truncated"));
        assert!(reason(&bytes[..20]).contains("truncated"));
        assert!(reason(&bytes[..5]).contains("too short"));
        assert!(reason(&[bytes.clone(), vec![0]].concat()).contains("after the last tensor"));
        assert!(reason(b"{\"not\": \"safetensors\"}\n").contains("larger than"));
        let hdr = br#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"note":"hello"}"#;
        let mut f = (hdr.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(hdr);
        f.extend_from_slice(&[0; 4]);
        assert!(
            reason(&f).contains("key `note` is not a tensor"),
            "{}",
            reason(&f)
        );
        // An empty file is a shard without tensors, which takes no part in the checks.
        std::fs::write(d.path().join("empty"), b"").unwrap();
        let (bytes, _, _) = merge(&[d.path().join("empty"), p.clone()]).unwrap();
        assert_eq!(
            ::safetensors::SafeTensors::deserialize(&bytes)
                .unwrap()
                .tensor("x")
                .unwrap()
                .shape(),
            &[4, 4]
        );
    }

    #[test]
    fn metadata_is_kept_where_ranks_agree() {
        let d = tempfile::tempdir().unwrap();
        let ts = [t("x", DType::U8, &[1], 0)];
        let m = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let a = d.path().join("a");
        let b = d.path().join("b");
        std::fs::write(&a, to_bytes(&ts, &m(&[("format", "pt"), ("rank", "0")]))).unwrap();
        std::fs::write(&b, to_bytes(&ts, &m(&[("format", "pt"), ("rank", "1")]))).unwrap();
        let (bytes, plan, _) = merge(&[a, b]).unwrap();
        assert_eq!(plan.dropped_metadata, vec!["rank".to_string()]);
        let (_, meta) = ::safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata()
                .as_ref()
                .unwrap()
                .get("format")
                .map(String::as_str),
            Some("pt")
        );
        assert_eq!(meta.metadata().as_ref().unwrap().len(), 1);
    }
}
