//! What a merge returns and writes beside the merged file: the [`Manifest`]
//! (`<out>.manifest.json`, see [`manifest_path`]) with one [`RankEntry`] per rank (its
//! [`RankStatus`], the bytes [`Dropped`] from it) and, for tensor formats, where each
//! rank's rows are in every [`MergedTensor`].
//!
//! A rank's bytes carry a digest. The JSONL merge writes `digest`, `xxh3-128:<hex>`: a
//! non-cryptographic 128-bit hash fast enough not to slow a merge that runs at disk speed
//! (the digest tells whether bytes are the ones merged; whoever can rewrite a shard can
//! rewrite the manifest beside it too, so a cryptographic hash would add no protection).
//! Tensor and command merges, and JSONL merges of earlier versions (format
//! `rl-node-aggregate/1`), wrote `sha256`; [`RankEntry::digest`] reads either.

use super::MergeOptions;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The `format` of every manifest this version writes.
/// (`rl-node-aggregate/1`: JSONL ranks carried `sha256` instead of `digest`.)
pub const MANIFEST_FORMAT: &str = "rl-node-aggregate/2";

/// The algorithm of the `digest` the JSONL merge writes for each rank.
pub const JSONL_DIGEST: DigestAlgorithm = DigestAlgorithm::Xxh3_128;

/// A digest algorithm a manifest may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestAlgorithm {
    /// XXH3, 128 bits, seed 0, hex as the xxHash tools print it (`xxh128sum`).
    Xxh3_128,
    Sha256,
}

impl DigestAlgorithm {
    pub fn name(self) -> &'static str {
        match self {
            DigestAlgorithm::Xxh3_128 => "xxh3-128",
            DigestAlgorithm::Sha256 => "sha256",
        }
    }

    fn from_name(name: &str) -> Option<DigestAlgorithm> {
        [DigestAlgorithm::Xxh3_128, DigestAlgorithm::Sha256]
            .into_iter()
            .find(|a| a.name() == name)
    }

    /// The hex digest of `bytes`.
    pub fn hex_of(self, bytes: &[u8]) -> String {
        match self {
            DigestAlgorithm::Xxh3_128 => xxh3_hex(xxhash_rust::xxh3::xxh3_128(bytes)),
            DigestAlgorithm::Sha256 => {
                use sha2::Digest;
                hex::encode(sha2::Sha256::digest(bytes))
            }
        }
    }
}

/// An XXH3-128 value in hex, most significant byte first (the xxHash tools' canonical form).
pub(crate) fn xxh3_hex(h: u128) -> String {
    format!("{h:032x}")
}

/// A rank's digest as a manifest states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankDigest<'a> {
    pub algorithm: DigestAlgorithm,
    pub hex: &'a str,
}

impl RankDigest<'_> {
    /// Whether `bytes` are the bytes this digest was made of.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        self.algorithm.hex_of(bytes).eq_ignore_ascii_case(self.hex)
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
    /// The rank's rollout command failed and the run merged the other ranks without it
    /// (`phases.<phase>.on-failure = "merge-survivors"`): nothing of it is read, whatever
    /// it left; `reason` says why.
    Failed,
}

impl RankStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RankStatus::Complete => "complete",
            RankStatus::Partial => "partial",
            RankStatus::Missing => "missing",
            RankStatus::Failed => "failed",
        }
    }

    /// Whether the merge reads a file of the rank (its shard or its partial file).
    pub fn has_source(self) -> bool {
        matches!(self, RankStatus::Complete | RankStatus::Partial)
    }

    /// A rank the merge refuses to go without unless `allow_missing`: one whose shard is
    /// not committed, for no reason the run recorded.
    pub fn is_gap(self) -> bool {
        matches!(self, RankStatus::Partial | RankStatus::Missing)
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
    /// Digest of exactly the merged bytes taken from this rank, `algorithm:hex`
    /// (`xxh3-128:…`; absent when missing, or when the merge stopped before reading it).
    /// Written by the JSONL merge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// SHA-256 (hex) of the same bytes: what tensor and command merges write, and JSONL
    /// manifests of format `rl-node-aggregate/1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    /// Why the rank is left out (`failed`): its rollout command's failure and log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl RankEntry {
    /// Rank `rank` with `status` and nothing found or merged yet.
    pub(super) fn new(rank: u32, status: RankStatus) -> RankEntry {
        RankEntry {
            rank,
            status,
            source: None,
            source_bytes: 0,
            offset: 0,
            records: 0,
            bytes: 0,
            digest: None,
            sha256: None,
            dropped: Vec::new(),
            set_aside: Vec::new(),
            adopted: None,
            problems: Vec::new(),
            reason: None,
        }
    }

    /// A rank whose rollout command failed, left out of the merge for `reason`.
    pub(super) fn failed(rank: u32, reason: &str) -> RankEntry {
        RankEntry {
            reason: Some(reason.to_string()),
            ..RankEntry::new(rank, RankStatus::Failed)
        }
    }

    /// Whether bytes of this rank were merged (it has a digest).
    pub fn was_merged(&self) -> bool {
        self.digest.is_some() || self.sha256.is_some()
    }

    /// The digest of this rank's merged bytes, from `digest` or else `sha256`; `None` when
    /// nothing of the rank was merged, or `digest` names an algorithm this version does
    /// not know.
    pub fn digest(&self) -> Option<RankDigest<'_>> {
        if let Some(d) = &self.digest {
            let (name, hex) = d.split_once(':')?;
            return Some(RankDigest {
                algorithm: DigestAlgorithm::from_name(name)?,
                hex,
            });
        }
        self.sha256.as_deref().map(|hex| RankDigest {
            algorithm: DigestAlgorithm::Sha256,
            hex,
        })
    }

    /// The file this rank's data is read from: `source`, relative to the shared
    /// directory `root`.
    pub(super) fn source_path(&self, root: &Path) -> PathBuf {
        root.join(self.source.as_deref().unwrap_or_default())
    }
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
    /// Ranks whose rollout command failed, merged without
    /// (`phases.<phase>.on-failure = "merge-survivors"`; each rank's `reason` says why).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_ranks: Vec<u32>,
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
    /// Pipelined runs: the model these trajectories were rolled out with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_model: Option<RolloutModel>,
}

/// The model a pipelined iteration was rolled out with (docs/pipeline.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutModel {
    pub model: String,
    /// The iteration whose training produced it; 0: the base model.
    pub model_version: u64,
    /// How many versions it lags the iteration.
    pub staleness: u64,
}

impl Manifest {
    pub(super) fn new(
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
            failed_ranks: with(RankStatus::Failed),
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
            rollout_model: opts.rollout_model.clone(),
        }
    }
}

/// The manifest of merged file `out`: `<out>.manifest.json`.
pub fn manifest_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".manifest.json");
    out.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh3_digests_are_written_as_the_xxhash_tools_print_them() {
        // XXH3-128 of nothing, seed 0: 99aa06d3014798d86001c324468d497f (xxh128sum).
        assert_eq!(
            DigestAlgorithm::Xxh3_128.hex_of(b""),
            "99aa06d3014798d86001c324468d497f"
        );
    }

    /// A manifest as the JSONL merge wrote it before digests were named: still read, and
    /// its ranks' SHA-256 still checked against their bytes.
    #[test]
    fn an_earlier_sha256_manifest_is_still_read_and_verified() {
        let old = r#"{"format":"rl-node-aggregate/1","iteration":1,"split":"train",
            "output":"train.jsonl","num_ranks":2,"allow_missing":true,"complete":false,
            "records":1,"bytes":8,"torn_records":0,"dropped_bytes":0,"partial_ranks":[],
            "missing_ranks":[1],"ranks":[
              {"rank":0,"status":"complete","source":"rollouts/iter-0001/train/rank-0.jsonl",
               "source_bytes":8,"offset":0,"records":1,"bytes":8,
               "sha256":"c46e038996130ca73c5590df502cea086d20082b8e8048b41614aa97409e6fde",
               "dropped":[],"set_aside":[],"problems":[]},
              {"rank":1,"status":"missing","source":null,"source_bytes":0,"offset":8,
               "records":0,"bytes":0,"sha256":null,"dropped":[],"set_aside":[],"problems":[]}],
            "problems":[]}"#;
        let m: Manifest = serde_json::from_str(old).unwrap();
        let bytes = b"{\"r\":0}\n";
        let d = m.ranks[0].digest().unwrap();
        assert_eq!(d.algorithm, DigestAlgorithm::Sha256);
        assert!(d.matches(bytes));
        assert!(!d.matches(b"{\"r\":1}\n"));
        assert!(m.ranks[0].was_merged());
        assert!(m.ranks[1].digest().is_none() && !m.ranks[1].was_merged());

        // This version's: the algorithm is named with the value; an unknown one is no digest.
        let mut r = m.ranks[0].clone();
        (r.sha256, r.digest) = (
            None,
            Some(format!("xxh3-128:{}", JSONL_DIGEST.hex_of(bytes))),
        );
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("sha256").is_none(), "{json}");
        let r: RankEntry = serde_json::from_value(json).unwrap();
        assert!(r.digest().unwrap().matches(bytes));
        let other = RankEntry {
            digest: Some("blake9:00".into()),
            ..r
        };
        assert!(other.digest().is_none() && other.was_merged());
    }

    #[test]
    fn manifest_path_is_beside_the_output() {
        assert_eq!(
            manifest_path(Path::new("/a/train.jsonl")),
            Path::new("/a/train.jsonl.manifest.json")
        );
    }
}
