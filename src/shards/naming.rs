//! Where rank shards, partial shards and merged files live, in which format they are, and
//! how much of each JSONL line a merge checks ([`Validate`]).
//!
//! The `[aggregate]` keys `format`, `shard-name`, `partial-name` and `output-name` become
//! one [`Naming`], which [`crate::layout::Layout`] consults for `shard`, `shard_partial`
//! and `aggregated`, so the rollout's `{output}`, the commit rename, phase 3, `rl-node
//! aggregate` and `{trajectories}` all agree. The defaults give the JSONL layout
//! (`rollouts/iter-NNNN/<split>/rank-R.jsonl`, `rank-R.partial.jsonl`,
//! `rollouts/iter-NNNN/<split>.jsonl`).
//!
//! A name is a small template, not shell text: `{rank}`, `{iteration}` (1, 2, …),
//! `{split}` and `{ext}` (the format's extension) are replaced; `{{` and `}}` are literal
//! braces. Shard and partial names are relative to `rollouts/iter-NNNN/<split>/`, the
//! output name to `rollouts/iter-NNNN/`; a name that starts with `{log_path}/` is relative
//! to the shared directory instead, which is how the old run.sh's
//! `train_trajectories.pt.iteration{N}_rank_{R}` files are named unchanged. No name may
//! leave the shared directory (nodes mount it at different places, and it is all they
//! share), `{rank}` appears exactly once, in the file name, of shard and partial names,
//! and never in the output name.

use crate::template::{self, braced_list, Braces, Dialect, Template};
use std::fmt;
use std::path::{Path, PathBuf};

/// The directory of an iteration under `rollouts/`, `logs/`, `models/` and `train/`:
/// `iter-0007`.
pub fn iter_dir(iteration: u64) -> String {
    format!("iter-{iteration:04}")
}

/// How rank shards are merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// One JSON record per line, concatenated in rank order.
    Jsonl,
    /// Dicts of tensors, concatenated along dim 0 into one safetensors file.
    Safetensors,
    /// Python `torch.save` dicts of tensors (the `torch` cargo feature), concatenated
    /// along dim 0 into one safetensors file.
    Torch,
    /// Any other format: `[aggregate] command` merges the shards rl-node found.
    Command,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Jsonl => "jsonl",
            Format::Safetensors => "safetensors",
            Format::Torch => "torch",
            Format::Command => "command",
        }
    }

    /// `{ext}` in shard and partial names.
    pub fn shard_ext(self) -> &'static str {
        match self {
            Format::Jsonl => "jsonl",
            Format::Safetensors => "safetensors",
            Format::Torch => "pt",
            Format::Command => "bin",
        }
    }

    /// `{ext}` in the output name: tensor formats are merged into safetensors.
    pub fn output_ext(self) -> &'static str {
        match self {
            Format::Torch => "safetensors",
            f => f.shard_ext(),
        }
    }

    /// Whether the merged file is a safetensors file rl-node writes itself.
    pub fn is_tensor(self) -> bool {
        matches!(self, Format::Safetensors | Format::Torch)
    }

    /// The format a file extension stands for (`auto`), if any.
    pub fn from_ext(ext: &str) -> Option<Format> {
        match ext {
            "jsonl" => Some(Format::Jsonl),
            "safetensors" => Some(Format::Safetensors),
            "pt" | "pth" => Some(Format::Torch),
            _ => None,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `[aggregate] format` setting: a format, or `auto` (by the shard name's extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatChoice {
    Auto,
    Fixed(Format),
}

impl FormatChoice {
    pub const CHOICES: &'static str = "auto, jsonl, safetensors, torch or command";

    pub fn parse(s: &str) -> Result<FormatChoice, String> {
        Ok(match s.trim() {
            "auto" | "" => FormatChoice::Auto,
            "jsonl" => FormatChoice::Fixed(Format::Jsonl),
            "safetensors" => FormatChoice::Fixed(Format::Safetensors),
            "torch" => FormatChoice::Fixed(Format::Torch),
            "command" => FormatChoice::Fixed(Format::Command),
            other => {
                return Err(format!(
                    "unknown format `{other}`: expected {}",
                    Self::CHOICES
                ))
            }
        })
    }
}

/// Which `[aggregate]` key a [`NamingError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Format,
    ShardName,
    PartialName,
    OutputName,
}

impl Key {
    pub fn config_key(self) -> &'static str {
        match self {
            Key::Format => "aggregate.format",
            Key::ShardName => "aggregate.shard-name",
            Key::PartialName => "aggregate.partial-name",
            Key::OutputName => "aggregate.output-name",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", .key.config_key())]
pub struct NamingError {
    pub key: Key,
    pub message: String,
}

/// What a name's placeholder stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Rank,
    Iteration,
    Split,
    SplitIteration,
    Ext,
}

/// The placeholders of a name (besides `{log_path}/` at its start).
const FIELDS: &[(&str, Field)] = &[
    ("rank", Field::Rank),
    ("iteration", Field::Iteration),
    ("split", Field::Split),
    ("split_iteration", Field::SplitIteration),
    ("ext", Field::Ext),
];

type Piece = template::Piece<Field>;

/// Names: not shell text, so every brace is a placeholder's or an escape (strict braces
/// of the crate's one template reader, [`crate::template`]), and a name has no NUL.
struct FileName;

impl Dialect for FileName {
    type Var = Field;
    type Error = String;
    const BRACES: Braces = Braces::Strict;

    fn var(&self, name: &str) -> Result<Field, String> {
        if let Some((_, field)) = FIELDS.iter().find(|(n, _)| *n == name) {
            return Ok(*field);
        }
        Err(match name {
            "log_path" => "`{log_path}` may only start a name".into(),
            other => format!(
                "unknown placeholder `{{{other}}}`; known: {}, and {{log_path}}/ at the start",
                braced_list(FIELDS.iter().map(|(n, _)| *n))
            ),
        })
    }

    fn text(&self, text: &str) -> Result<(), String> {
        match text.contains('\0') {
            true => Err("a name cannot contain a NUL byte".into()),
            false => Ok(()),
        }
    }
}

/// One parsed name template.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Name {
    /// Starts with `{log_path}/`: relative to the shared directory.
    anchored: bool,
    template: Template<Field>,
}

/// Values substituted into a name.
struct Values<'a> {
    rank: Option<u32>,
    iteration: u64,
    /// The split's name as commands see it (`{split}`: `train`, or the eval split's name).
    split: &'a str,
    /// `{split_iteration}`: the how-many-th rollout of this split.
    split_iteration: u64,
    ext: &'a str,
}

impl Values<'_> {
    /// `pieces` with the values in: names are file names, so each value goes in as it is.
    fn render(&self, pieces: &[Piece]) -> String {
        template::render(pieces, |field, s| match field {
            Field::Rank => s.push_str(&self.rank.map(|r| r.to_string()).unwrap_or_default()),
            Field::Iteration => s.push_str(&self.iteration.to_string()),
            Field::Split => s.push_str(self.split),
            Field::SplitIteration => s.push_str(&self.split_iteration.to_string()),
            Field::Ext => s.push_str(self.ext),
        })
    }
}

impl Name {
    fn parse(text: &str) -> Result<Name, String> {
        let (anchored, rest) = match text.strip_prefix("{log_path}") {
            Some("") => {
                return Err("`{log_path}` alone names the shared directory, not a file".into())
            }
            Some(r) if r.starts_with('/') => (true, r.trim_start_matches('/')),
            Some(_) => return Err("`{log_path}` must be followed by `/`".into()),
            None => (false, text),
        };
        if rest.is_empty() {
            return Err("empty name".into());
        }
        if rest.starts_with('/') {
            return Err(format!(
                "`{text}` is an absolute path; write it relative to the directory it lives in, or as `{{log_path}}/…` (nodes may mount the shared directory at different places)"
            ));
        }
        Ok(Name {
            anchored,
            template: Template::parse(rest, &FileName)?,
        })
    }

    fn pieces(&self) -> &[Piece] {
        self.template.pieces()
    }

    fn render(&self, v: &Values) -> String {
        v.render(self.pieces())
    }

    fn count(&self, what: Field) -> usize {
        self.template.vars().filter(|f| **f == what).count()
    }

    /// Where the last path component starts: (piece index, byte offset in that literal).
    fn last_component_start(&self) -> (usize, usize) {
        for (i, p) in self.pieces().iter().enumerate().rev() {
            if let Piece::Text(t) = p {
                if let Some(k) = t.rfind('/') {
                    return (i, k + 1);
                }
            }
        }
        (0, 0)
    }

    /// The pieces of the file name (the last path component).
    fn file_pieces(&self) -> Vec<Piece> {
        let (i, k) = self.last_component_start();
        let mut out = Vec::new();
        for (j, p) in self.pieces().iter().enumerate().skip(i) {
            match p {
                Piece::Text(t) if j == i => {
                    if !t[k..].is_empty() {
                        out.push(Piece::Text(t[k..].to_string()));
                    }
                }
                p => out.push(p.clone()),
            }
        }
        out
    }

    /// The last extension of the file name: `Some("jsonl")`, `Some("{ext}")`, or `None`
    /// when the name has none, or one with another placeholder in it.
    fn extension(&self) -> Option<String> {
        const OTHER: char = '\u{1}';
        let mut file = String::new();
        for p in self.file_pieces() {
            match p {
                Piece::Text(t) => file.push_str(&t),
                Piece::Var(Field::Ext) => file.push_str("{ext}"),
                Piece::Var(_) => file.push(OTHER),
            }
        }
        let dot = file.rfind('.')?;
        let ext = &file[dot + 1..];
        (dot > 0 && !ext.is_empty() && !ext.contains(OTHER)).then(|| ext.to_string())
    }
}

/// Resolve `rendered` (a relative path, `/`-separated) against `base` (components under
/// the shared directory), lexically. Err when it climbs out of the shared directory.
fn resolve(base: &[String], rendered: &str) -> Result<Vec<String>, String> {
    let mut parts: Vec<String> = base.to_vec();
    for c in rendered.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(format!("`{rendered}` leaves the shared directory"));
                }
            }
            c => parts.push(c.to_string()),
        }
    }
    if parts.is_empty() {
        return Err(format!("`{rendered}` names the shared directory itself"));
    }
    Ok(parts)
}

/// Shard names, partial names, merged file names and the format of one configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Naming {
    format: Format,
    shard: Name,
    partial: Name,
    output: Name,
    /// The templates as configured (`partial` derived when it was empty), for messages.
    texts: [String; 3],
    /// What `{split}` says for the eval split (`cluster.eval-split`).
    eval_label: String,
    /// Evals happen every this many iterations (`{split_iteration}` of eval counts them);
    /// 0: every iteration's eval is its own (eval-only runs).
    eval_every: u64,
}

/// The default shard name: `rank-{rank}.{ext}`.
pub const DEFAULT_SHARD_NAME: &str = "rank-{rank}.{ext}";
/// The default output name: `{split}.{ext}`.
pub const DEFAULT_OUTPUT_NAME: &str = "{split}.{ext}";

impl Default for Naming {
    /// The JSONL layout: `rank-R.jsonl`, `rank-R.partial.jsonl`, `<split>.jsonl`.
    fn default() -> Naming {
        Naming::new("jsonl", DEFAULT_SHARD_NAME, "", DEFAULT_OUTPUT_NAME)
            .expect("the default naming is valid")
    }
}

impl Naming {
    /// Build from the `[aggregate]` keys; `partial` empty means derived from `shard`
    /// (`.partial` inserted before the extension, or appended when there is none).
    /// `torch` (also by `auto`) is refused in a build without the `torch` feature.
    pub fn new(
        format: &str,
        shard: &str,
        partial: &str,
        output: &str,
    ) -> Result<Naming, NamingError> {
        let err = |key: Key| move |message: String| NamingError { key, message };
        let choice = FormatChoice::parse(format).map_err(err(Key::Format))?;
        let shard_name = Name::parse(shard).map_err(err(Key::ShardName))?;
        let format = match choice {
            FormatChoice::Fixed(f) => f,
            FormatChoice::Auto => shard_name
                .extension()
                .and_then(|e| Format::from_ext(&e))
                .unwrap_or(Format::Jsonl),
        };
        if format == Format::Torch && !super::torch_available() {
            return Err(NamingError {
                key: Key::Format,
                message: format!(
                    "{}torch shards need an rl-node built with the `torch` cargo feature (cargo build --release --features torch); this one was built without it. Alternatives: write safetensors shards (format = \"safetensors\"), or merge with your own script (format = \"command\")",
                    if choice == FormatChoice::Auto {
                        format!("format auto picked torch for shard-name `{shard}`: ")
                    } else {
                        String::new()
                    }
                ),
            });
        }
        let partial_text = if partial.trim().is_empty() {
            derive_partial(shard)
        } else {
            partial.to_string()
        };
        let partial_name =
            Name::parse(&partial_text).map_err(err(if partial.trim().is_empty() {
                Key::ShardName
            } else {
                Key::PartialName
            }))?;
        let output_name = Name::parse(output).map_err(err(Key::OutputName))?;
        let naming = Naming {
            format,
            shard: shard_name,
            partial: partial_name,
            output: output_name,
            texts: [shard.to_string(), partial_text, output.to_string()],
            eval_label: "eval".into(),
            eval_every: 1,
        };
        naming.check()?;
        Ok(naming)
    }

    /// The eval split's name in `{split}` and how often evals happen (for
    /// `{split_iteration}`; 0: every iteration).
    pub fn with_eval_split(mut self, label: &str, every: u64) -> Naming {
        self.eval_label = label.to_string();
        self.eval_every = every;
        self
    }

    /// What `{split}` says for `split` (`train` or `eval`, rl-node's own names).
    pub fn split_label<'a>(&'a self, split: &'a str) -> &'a str {
        if split == "eval" {
            &self.eval_label
        } else {
            split
        }
    }

    /// `{split_iteration}`: the iteration for train; for eval, how many evals there have
    /// been up to and including `iteration`'s (webgym numbers its test files so).
    pub fn split_iteration(&self, split: &str, iteration: u64) -> u64 {
        if split == "eval" && self.eval_every > 0 && iteration > 0 {
            (iteration - 1) / self.eval_every + 1
        } else {
            iteration
        }
    }

    fn values<'a>(
        &'a self,
        rank: Option<u32>,
        iteration: u64,
        split: &'a str,
        ext: &'a str,
    ) -> Values<'a> {
        Values {
            rank,
            iteration,
            split: self.split_label(split),
            split_iteration: self.split_iteration(split, iteration),
            ext,
        }
    }

    fn check(&self) -> Result<(), NamingError> {
        for (key, name, text) in [
            (Key::ShardName, &self.shard, &self.texts[0]),
            (Key::PartialName, &self.partial, &self.texts[1]),
        ] {
            let e = |message: String| NamingError { key, message };
            if name.count(Field::Rank) != 1 {
                return Err(e(format!(
                    "`{text}` must contain {{rank}} exactly once (each rank needs its own file)"
                )));
            }
            if !name.file_pieces().contains(&Piece::Var(Field::Rank)) {
                return Err(e(format!(
                    "`{text}`: {{rank}} must be in the file name, not in a directory"
                )));
            }
        }
        if self.output.count(Field::Rank) > 0 {
            return Err(NamingError {
                key: Key::OutputName,
                message: format!(
                    "`{}` cannot contain {{rank}}: the merged file is one for all ranks",
                    self.texts[2]
                ),
            });
        }
        // Try the names out on a sample, so a name that leaves the shared directory or
        // collides is refused at start-up rather than in phase 3.
        let root = Path::new("/r");
        for it in [1, 12345] {
            for split in ["train", "eval"] {
                let shard = self
                    .try_shard(root, it, split, 0)
                    .map_err(|message| NamingError {
                        key: Key::ShardName,
                        message,
                    })?;
                let partial =
                    self.try_partial(root, it, split, 0)
                        .map_err(|message| NamingError {
                            key: Key::PartialName,
                            message,
                        })?;
                let out = self
                    .try_output(root, it, split)
                    .map_err(|message| NamingError {
                        key: Key::OutputName,
                        message,
                    })?;
                if shard == partial {
                    return Err(NamingError {
                        key: Key::PartialName,
                        message: format!(
                            "`{}` gives the same file as shard-name `{}`: a rank's unfinished output must not carry its committed name",
                            self.texts[1], self.texts[0]
                        ),
                    });
                }
                if out == shard || out == partial {
                    return Err(NamingError {
                        key: Key::OutputName,
                        message: format!(
                            "`{}` gives the same file as rank 0's shard",
                            self.texts[2]
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// The default names with another format's extension (for tests and tools). Panics
    /// for `Torch` in a build without the `torch` feature.
    pub fn for_format(format: Format) -> Naming {
        Naming::new(format.name(), DEFAULT_SHARD_NAME, "", DEFAULT_OUTPUT_NAME)
            .expect("the default names are valid for every format")
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The shard-name, partial-name and output-name templates in effect.
    pub fn templates(&self) -> (&str, &str, &str) {
        (&self.texts[0], &self.texts[1], &self.texts[2])
    }

    fn split_base(iteration: u64, split: &str) -> Vec<String> {
        vec!["rollouts".into(), iter_dir(iteration), split.to_string()]
    }

    fn place(
        &self,
        root: &Path,
        name: &Name,
        base: Vec<String>,
        v: &Values,
    ) -> Result<PathBuf, String> {
        let base = if name.anchored { Vec::new() } else { base };
        let parts = resolve(&base, &name.render(v))?;
        let mut p = root.to_path_buf();
        p.extend(parts);
        Ok(p)
    }

    fn try_shard(
        &self,
        root: &Path,
        iteration: u64,
        split: &str,
        rank: u32,
    ) -> Result<PathBuf, String> {
        let v = self.values(Some(rank), iteration, split, self.format.shard_ext());
        self.place(root, &self.shard, Self::split_base(iteration, split), &v)
    }

    fn try_partial(
        &self,
        root: &Path,
        iteration: u64,
        split: &str,
        rank: u32,
    ) -> Result<PathBuf, String> {
        let v = self.values(Some(rank), iteration, split, self.format.shard_ext());
        self.place(root, &self.partial, Self::split_base(iteration, split), &v)
    }

    fn try_output(&self, root: &Path, iteration: u64, split: &str) -> Result<PathBuf, String> {
        let v = self.values(None, iteration, split, self.format.output_ext());
        let mut base = Self::split_base(iteration, split);
        base.pop();
        self.place(root, &self.output, base, &v)
    }

    /// A rank's committed shard under the shared directory `root`.
    pub fn shard(&self, root: &Path, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.try_shard(root, iteration, split, rank)
            .expect("names were checked when the naming was built")
    }

    /// Where a rank's command writes while it runs; renamed to [`Naming::shard`].
    pub fn partial(&self, root: &Path, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.try_partial(root, iteration, split, rank)
            .expect("names were checked when the naming was built")
    }

    /// The merged file of an iteration's split.
    pub fn output(&self, root: &Path, iteration: u64, split: &str) -> PathBuf {
        self.try_output(root, iteration, split)
            .expect("names were checked when the naming was built")
    }

    /// Which rank's shard (false) or partial file (true) a file name in the shard
    /// (resp. partial) directory is, for ranks 0, 1, … written in canonical decimal.
    /// `shard_dir` tells which of the two directories the name was listed in (they are
    /// usually the same one).
    pub fn rank_of(
        &self,
        name: &str,
        iteration: u64,
        split: &str,
        in_shard_dir: bool,
        in_partial_dir: bool,
    ) -> Option<(u32, bool)> {
        let try_one = |n: &Name| -> Option<u32> {
            let v = self.values(None, iteration, split, self.format.shard_ext());
            let file = n.file_pieces();
            let at = file.iter().position(|p| *p == Piece::Var(Field::Rank))?;
            let (pre, post) = (v.render(&file[..at]), v.render(&file[at + 1..]));
            let num = name
                .strip_prefix(pre.as_str())?
                .strip_suffix(post.as_str())?;
            let r: u32 = num.parse().ok()?;
            (r.to_string() == num).then_some(r)
        };
        // A partial name is usually the shard name plus something, so try it first.
        if in_partial_dir {
            if let Some(r) = try_one(&self.partial) {
                return Some((r, true));
            }
        }
        if in_shard_dir {
            if let Some(r) = try_one(&self.shard) {
                return Some((r, false));
            }
        }
        None
    }

    /// Whether the merged file's name carries `{split_iteration}` once, in its file name
    /// (what `aggregate.check-numbering` reads the numbers of the outputs present from).
    pub fn output_numbered(&self) -> bool {
        self.output.count(Field::SplitIteration) == 1
            && self
                .output
                .file_pieces()
                .contains(&Piece::Var(Field::SplitIteration))
    }

    /// The `{split_iteration}` of a merged file of `split` named `name` (a file name in
    /// the directory of `output(…, iteration, split)`), in canonical decimal; None for
    /// any other name (a rank's shard, a manifest, a set-aside file).
    pub fn split_iteration_of_output(
        &self,
        name: &str,
        iteration: u64,
        split: &str,
    ) -> Option<u64> {
        let v = self.values(None, iteration, split, self.format.output_ext());
        let file = self.output.file_pieces();
        let at = file
            .iter()
            .position(|p| *p == Piece::Var(Field::SplitIteration))?;
        let (pre, post) = (v.render(&file[..at]), v.render(&file[at + 1..]));
        let num = name
            .strip_prefix(pre.as_str())?
            .strip_suffix(post.as_str())?;
        let n: u64 = num.parse().ok()?;
        (n.to_string() == num).then_some(n)
    }
}

/// `rank-{rank}.{ext}` → `rank-{rank}.partial.{ext}`; `x.jsonl` → `x.partial.jsonl`; a
/// name whose last extension holds a placeholder (or has none) gets `.partial` appended.
pub fn derive_partial(shard: &str) -> String {
    let file_start = shard.rfind('/').map(|k| k + 1).unwrap_or(0);
    let file = &shard[file_start..];
    if let Some(dot) = file.rfind('.') {
        let ext = &file[dot + 1..];
        let plain = !ext.is_empty()
            && dot > 0
            && (ext == "{ext}" || ext.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        if plain {
            let at = file_start + dot;
            return format!("{}.partial{}", &shard[..at], &shard[at..]);
        }
    }
    format!("{shard}.partial")
}

/// How much of each JSONL line the merge checks before taking it as a record
/// (`[aggregate] validate`, `rl-node aggregate --validate`). Every level checks the lines
/// themselves: blank lines are skipped, a line longer than `max_record_bytes` is not a
/// record, and a last line without its newline is parsed as JSON (a torn record is caught
/// at every level; only that one line can lack its newline, so this costs nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Validate {
    /// Every line parsed as one JSON value, in UTF-8.
    Json,
    /// Every line valid UTF-8 without NUL bytes; a line that starts with `{` or `[`
    /// (after whitespace) must end with the matching `}` or `]`, any other line is
    /// parsed as JSON. Catches garbage, binary and zero-filled lines at the speed of the
    /// UTF-8 check; not a malformed object whose brackets are in place.
    #[default]
    Utf8,
    /// Lines only.
    None,
}

impl Validate {
    pub const NAMES: [&'static str; 3] = ["json", "utf8", "none"];

    pub fn name(self) -> &'static str {
        match self {
            Validate::Json => "json",
            Validate::Utf8 => "utf8",
            Validate::None => "none",
        }
    }
}

impl std::str::FromStr for Validate {
    type Err = String;

    fn from_str(s: &str) -> Result<Validate, String> {
        match s {
            "json" => Ok(Validate::Json),
            "utf8" => Ok(Validate::Utf8),
            "none" => Ok(Validate::None),
            _ => Err(format!(
                "`{s}` is not a validation level: json (every line parsed), utf8 (UTF-8 and brackets) or none (lines only)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(format: &str, shard: &str, partial: &str, output: &str) -> Result<Naming, NamingError> {
        Naming::new(format, shard, partial, output)
    }

    /// webgym's layout: the eval split is called `test` in names and counted by eval
    /// round; rl-node's own directories keep `eval`.
    #[test]
    fn the_eval_split_has_its_own_name_and_numbering() {
        let d = n(
            "command",
            "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}_rank_{rank}",
            "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}_rank_{rank}.checkpoint",
            "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}",
        )
        .unwrap()
        .with_eval_split("test", 6);
        let root = Path::new("/s");
        assert_eq!(
            d.shard(root, 13, "eval", 1),
            Path::new("/s/test_trajectories/test_trajectories.pt.iteration3_rank_1")
        );
        assert_eq!(
            d.partial(root, 7, "eval", 2),
            Path::new("/s/test_trajectories/test_trajectories.pt.iteration2_rank_2.checkpoint")
        );
        assert_eq!(
            d.output(root, 7, "train"),
            Path::new("/s/train_trajectories/train_trajectories.pt.iteration7")
        );
        assert_eq!(
            d.rank_of(
                "test_trajectories.pt.iteration3_rank_2",
                13,
                "eval",
                true,
                true
            ),
            Some((2, false))
        );
        assert_eq!(d.split_label("eval"), "test");
        assert_eq!(d.split_label("train"), "train");
        // Every iteration evaluates in an eval-only run: the round is the iteration.
        let every = d.clone().with_eval_split("test", 0);
        assert_eq!(every.split_iteration("eval", 5), 5);
        assert_eq!(d.split_iteration("eval", 1), 1);
        assert_eq!(d.split_iteration("eval", 12), 2);
    }

    #[test]
    fn defaults_are_the_jsonl_layout() {
        let d = Naming::default();
        let root = Path::new("/nfs/exp");
        assert_eq!(d.format(), Format::Jsonl);
        assert_eq!(
            d.shard(root, 3, "train", 2),
            Path::new("/nfs/exp/rollouts/iter-0003/train/rank-2.jsonl")
        );
        assert_eq!(
            d.partial(root, 3, "eval", 0),
            Path::new("/nfs/exp/rollouts/iter-0003/eval/rank-0.partial.jsonl")
        );
        assert_eq!(
            d.output(root, 3, "train"),
            Path::new("/nfs/exp/rollouts/iter-0003/train.jsonl")
        );
        let s = Naming::for_format(Format::Safetensors);
        assert_eq!(
            s.shard(root, 1, "train", 0),
            Path::new("/nfs/exp/rollouts/iter-0001/train/rank-0.safetensors")
        );
        assert_eq!(
            s.partial(root, 1, "train", 0),
            Path::new("/nfs/exp/rollouts/iter-0001/train/rank-0.partial.safetensors")
        );
        assert_eq!(
            s.output(root, 1, "train"),
            Path::new("/nfs/exp/rollouts/iter-0001/train.safetensors")
        );
    }

    #[test]
    fn auto_goes_by_the_shard_extension() {
        let f = |shard: &str| n("auto", shard, "", DEFAULT_OUTPUT_NAME).unwrap().format();
        assert_eq!(f("rank-{rank}.{ext}"), Format::Jsonl);
        assert_eq!(f("rank-{rank}.jsonl"), Format::Jsonl);
        assert_eq!(f("rank-{rank}.safetensors"), Format::Safetensors);
        assert_eq!(f("r{rank}"), Format::Jsonl);
        assert_eq!(
            f("{log_path}/train_trajectories.pt.iteration{iteration}_rank_{rank}"),
            Format::Jsonl
        );
        if !crate::shards::torch_available() {
            let e = n("auto", "rank-{rank}.pt", "", DEFAULT_OUTPUT_NAME).unwrap_err();
            assert_eq!(e.key, Key::Format);
            assert!(e.message.contains("--features torch"), "{e}");
            assert!(n("torch", DEFAULT_SHARD_NAME, "", DEFAULT_OUTPUT_NAME).is_err());
        } else {
            assert_eq!(f("rank-{rank}.pth"), Format::Torch);
        }
    }

    #[test]
    fn merged_files_are_recognised_by_their_split_iteration() {
        let webgym = n(
            "command",
            "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}_rank_{rank}",
            "",
            "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}",
        )
        .unwrap()
        .with_eval_split("test", 6);
        assert!(webgym.output_numbered());
        let of = |name: &str| webgym.split_iteration_of_output(name, 7, "eval");
        assert_eq!(of("test_trajectories.pt.iteration3"), Some(3));
        assert_eq!(of("test_trajectories.pt.iteration12"), Some(12));
        for other in [
            "test_trajectories.pt.iteration3_rank_0",
            "test_trajectories.pt.iteration3.manifest.json",
            "test_trajectories.pt.iteration03",
            "train_trajectories.pt.iteration3",
            "test_trajectories.pt.iteration",
        ] {
            assert_eq!(of(other), None, "{other}");
        }
        assert!(!Naming::default().output_numbered());
    }

    #[test]
    fn the_old_run_sh_layout_is_expressible() {
        let old = n(
            "command",
            "{log_path}/{split}_trajectories.pt.iteration{iteration}_rank_{rank}",
            "",
            "{log_path}/{split}_trajectories.pt.iteration{iteration}",
        )
        .unwrap();
        let root = Path::new("/nfs/exp");
        assert_eq!(
            old.shard(root, 7, "train", 1),
            Path::new("/nfs/exp/train_trajectories.pt.iteration7_rank_1")
        );
        assert_eq!(
            old.partial(root, 7, "train", 1),
            Path::new("/nfs/exp/train_trajectories.pt.iteration7_rank_1.partial")
        );
        assert_eq!(
            old.output(root, 7, "train"),
            Path::new("/nfs/exp/train_trajectories.pt.iteration7")
        );
        // The same, relative to rollouts/iter-NNNN/<split>/.
        let rel = n(
            "command",
            "../../../train_trajectories.pt.iteration{iteration}_rank_{rank}",
            "",
            "x",
        )
        .unwrap();
        assert_eq!(
            rel.shard(root, 7, "train", 1),
            old.shard(root, 7, "train", 1)
        );
        assert_eq!(
            old.rank_of(
                "train_trajectories.pt.iteration7_rank_12",
                7,
                "train",
                true,
                true
            ),
            Some((12, false))
        );
        assert_eq!(
            old.rank_of(
                "train_trajectories.pt.iteration7_rank_1.partial",
                7,
                "train",
                true,
                true
            ),
            Some((1, true))
        );
        assert_eq!(
            old.rank_of(
                "train_trajectories.pt.iteration8_rank_1",
                7,
                "train",
                true,
                true
            ),
            None
        );
    }

    #[test]
    fn partial_names_are_derived() {
        assert_eq!(
            derive_partial("rank-{rank}.{ext}"),
            "rank-{rank}.partial.{ext}"
        );
        assert_eq!(
            derive_partial("a/rank-{rank}.jsonl"),
            "a/rank-{rank}.partial.jsonl"
        );
        assert_eq!(
            derive_partial("x.pt.iteration{iteration}_rank_{rank}"),
            "x.pt.iteration{iteration}_rank_{rank}.partial"
        );
        assert_eq!(derive_partial("d.v/r{rank}"), "d.v/r{rank}.partial");
        assert_eq!(derive_partial(".r{rank}"), ".r{rank}.partial");
    }

    #[test]
    fn bad_names_are_refused_with_the_key() {
        let cases = [
            (
                n("parquet", DEFAULT_SHARD_NAME, "", "o"),
                Key::Format,
                "unknown format",
            ),
            (
                n("jsonl", "rank.jsonl", "", "o"),
                Key::ShardName,
                "exactly once",
            ),
            (
                n("jsonl", "r{rank}/x{rank}", "", "o"),
                Key::ShardName,
                "exactly once",
            ),
            (
                n("jsonl", "r{rank}/x.jsonl", "", "o"),
                Key::ShardName,
                "file name",
            ),
            (
                n("jsonl", "/abs/r{rank}", "", "o"),
                Key::ShardName,
                "absolute",
            ),
            (
                n("jsonl", "../../../../r{rank}", "", "o"),
                Key::ShardName,
                "leaves the shared directory",
            ),
            (
                n("jsonl", "r{rank}{bad}", "", "o"),
                Key::ShardName,
                "unknown placeholder",
            ),
            (n("jsonl", "r{rank", "", "o"), Key::ShardName, "unclosed"),
            (
                n("jsonl", "a/{log_path}/r{rank}", "", "o"),
                Key::ShardName,
                "may only start",
            ),
            (
                n("jsonl", DEFAULT_SHARD_NAME, "rank-{rank}.{ext}", "o"),
                Key::PartialName,
                "same file",
            ),
            (
                n("jsonl", DEFAULT_SHARD_NAME, "", "{split}/rank-{rank}.x"),
                Key::OutputName,
                "cannot contain {rank}",
            ),
            (
                n("jsonl", DEFAULT_SHARD_NAME, "", "{split}/rank-0.jsonl"),
                Key::OutputName,
                "same file",
            ),
            (
                n("jsonl", DEFAULT_SHARD_NAME, "", "{log_path}"),
                Key::OutputName,
                "shared directory",
            ),
        ];
        for (got, key, needle) in cases {
            let e = got.unwrap_err();
            assert_eq!(e.key, key, "{e}");
            assert!(e.to_string().contains(needle), "{e}");
            assert!(e.to_string().starts_with(key.config_key()), "{e}");
        }
    }

    #[test]
    fn name_syntax_messages() {
        let err = |t: &str| Name::parse(t).unwrap_err();
        assert_eq!(
            err("r{rank}{}"),
            "unknown placeholder `{}`; known: {rank} {iteration} {split} {split_iteration} {ext}, and {log_path}/ at the start"
        );
        assert_eq!(
            err("{log_path}//r{rank"),
            "unclosed `{` at byte 1; write `{{` for a literal brace"
        );
        assert_eq!(
            err("r}{rank}"),
            "unmatched `}` at byte 1; write `}}` for a literal brace"
        );
        assert_eq!(err("a\0{nope}"), "a name cannot contain a NUL byte");
        assert!(err("{nope}a\0").starts_with("unknown placeholder `{nope}`"));
        assert!(err("r{rank}{RANK}").starts_with("unknown placeholder `{RANK}`"));
        assert_eq!(
            err("a/{log_path}/r{rank}"),
            "`{log_path}` may only start a name"
        );
        // `$` is no shell syntax in a name.
        let n = Name::parse("${rank}").unwrap();
        assert_eq!(
            n.pieces(),
            [Piece::Text("$".into()), Piece::Var(Field::Rank)]
        );
        let n = Name::parse("{log_path}/d{{x}}/{split}{rank}.{ext}").unwrap();
        assert!(n.anchored);
        assert_eq!(
            n.pieces(),
            [
                Piece::Text("d{x}/".into()),
                Piece::Var(Field::Split),
                Piece::Var(Field::Rank),
                Piece::Text(".".into()),
                Piece::Var(Field::Ext)
            ]
        );
        assert_eq!(n.extension().as_deref(), Some("{ext}"));
    }

    #[test]
    fn ranks_are_recognised_in_canonical_decimal_only() {
        let d = Naming::default();
        assert_eq!(
            d.rank_of("rank-3.jsonl", 1, "train", true, true),
            Some((3, false))
        );
        assert_eq!(
            d.rank_of("rank-12.partial.jsonl", 1, "train", true, true),
            Some((12, true))
        );
        assert_eq!(
            d.rank_of("rank-12.partial.jsonl", 1, "train", true, false),
            None
        );
        assert_eq!(d.rank_of("rank-03.jsonl", 1, "train", true, true), None);
        assert_eq!(
            d.rank_of("rank-1.partial.jsonl.stale-gen2", 1, "train", true, true),
            None
        );
        assert_eq!(
            d.rank_of("rank-1.safetensors", 1, "train", true, true),
            None
        );
        let literal_braces = n("jsonl", "r{{x}}{rank}.{ext}", "", "o").unwrap();
        assert_eq!(
            literal_braces.shard(Path::new("/r"), 1, "t", 4),
            Path::new("/r/rollouts/iter-0001/t/r{x}4.jsonl")
        );
    }
}
