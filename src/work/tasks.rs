//! Task files: one JSON object per line, each task identified by an id field or its line
//! number. Loading checks every line (and reports the file and line of the first bad one)
//! so that a bad file stops a node at start, before anything is written.
//!
//! Memory is bounded by the ids, not the lines: a million-line file may hold far more
//! tasks than an iteration uses, so a loaded [`TaskFile`] keeps each task's id (all
//! planning needs) and where its line is — offset, length, line number and a 64-bit hash
//! — about 40 bytes a task besides the id. Lines are checked without building a
//! `serde_json::Value` (only the id field's value is built), and the few an iteration uses
//! are read again from the file, which stays open: a file renamed over the path does not
//! change the tasks, and a line changed in place is reported (its hash differs) rather than
//! handed to a command.

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::hash::Hasher;
use std::io::{self, BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Task ids in file order, in one buffer: all a plan needs of the tasks. `ids[k]` is the
/// id of task `k` (0-based, blank lines not counted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskIds {
    text: String,
    /// `text[ends[k-1]..ends[k]]` is the id of task `k`.
    ends: Vec<usize>,
}

impl TaskIds {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn push(&mut self, id: &str) {
        self.text.push_str(id);
        self.ends.push(self.text.len());
    }

    pub fn get(&self, k: usize) -> Option<&str> {
        let end = *self.ends.get(k)?;
        let start = if k == 0 { 0 } else { self.ends[k - 1] };
        Some(&self.text[start..end])
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len()).map(|k| &self[k])
    }

    fn shrink_to_fit(&mut self) {
        self.text.shrink_to_fit();
        self.ends.shrink_to_fit();
    }
}

impl std::ops::Index<usize> for TaskIds {
    type Output = str;

    fn index(&self, k: usize) -> &str {
        match self.get(k) {
            Some(id) => id,
            None => panic!("task {k} of {}", self.len()),
        }
    }
}

impl<S: AsRef<str>> FromIterator<S> for TaskIds {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut ids = TaskIds::default();
        for id in iter {
            ids.push(id.as_ref());
        }
        ids
    }
}

/// Where a task's line is: the trimmed line is `len` bytes at `offset` of the file.
#[derive(Clone, Copy, Debug)]
struct Span {
    offset: u64,
    len: u64,
    /// 1-based line number.
    line: u64,
    /// [`line_hash`] of the trimmed line.
    hash: u64,
}

/// A loaded task file: the tasks' ids and fingerprint in memory, their lines on disk.
#[derive(Debug)]
pub struct TaskFile {
    path: PathBuf,
    /// Open since the load, so that the lines read again are those that were checked.
    file: File,
    ids: TaskIds,
    spans: Vec<Span>,
    fingerprint: String,
}

impl TaskFile {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number of tasks (non-blank lines).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn ids(&self) -> &TaskIds {
        &self.ids
    }

    /// The 1-based line number of task `k`.
    pub fn line(&self, k: usize) -> u64 {
        self.spans[k].line
    }

    /// Task `k`'s JSON line as in the file, trimmed (no line ending), read again from the
    /// file. Errors: the file cannot be read, or the line is no longer what was loaded.
    pub fn raw(&self, k: usize) -> Result<String, TaskError> {
        let span = self.spans[k];
        let changed = || TaskError::Changed {
            path: self.path.clone(),
            line: span.line,
        };
        let mut buf = vec![0; span.len as usize];
        match self.file.read_exact_at(&mut buf, span.offset) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(changed()),
            Err(source) => {
                return Err(TaskError::Read {
                    path: self.path.clone(),
                    source,
                })
            }
        }
        if line_hash(&buf) != span.hash {
            return Err(changed());
        }
        String::from_utf8(buf).map_err(|_| changed())
    }

    /// sha256 (hex, 16 chars) of the canonical JSON of every task's `[id, raw]`, in order
    /// (the JSON array `[["id","line"],…]` as serde_json writes it), computed at load.
    /// [`crate::work::Plan::fingerprint`] covers ids, not contents: two task files with the
    /// same ids (e.g. ids from line numbers) but different lines plan alike; compare this
    /// too to catch that.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("cannot read task file {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("task file {}:{line}: {reason}", .path.display())]
    BadLine {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error(
        "task file {}:{line}: the id field `{field}` must be a non-empty string or an integer, found {found}",
        .path.display()
    )]
    BadId {
        path: PathBuf,
        line: u64,
        field: String,
        /// The offending value, as JSON.
        found: String,
    },
    #[error(
        "task file {}:{line}: the id `{id}` (field `{field}`) holds the control character U+{code:04X}: an id reaches commands, their environment and log lines, so it must be printable text",
        .path.display(),
        id = .id.escape_debug(),
        code = u32::from(*.control)
    )]
    ControlInId {
        path: PathBuf,
        line: u64,
        field: String,
        id: String,
        control: char,
    },
    #[error("task file {}: task id {id:?} appears on line {first} and again on line {second}", .path.display())]
    DuplicateId {
        path: PathBuf,
        id: String,
        first: u64,
        second: u64,
    },
    #[error("task file {} holds no tasks", .path.display())]
    NoTasks { path: PathBuf },
    #[error(
        "task file {}:{line} changed after rl-node loaded it at start (a task file must stay as it is while the run uses it; restart every node to use the new file)",
        .path.display()
    )]
    Changed { path: PathBuf, line: u64 },
}

/// Read a JSONL task file. Every non-blank line must be a JSON object (a UTF-8 byte-order
/// mark at the start of the file is ignored; lines are trimmed, so `\r\n` endings do). A
/// task's id is the value of `id_field` when present — a non-empty string as is, an
/// integer in decimal — else its 1-based line number. Ids must be unique (an explicit id
/// `"7"` and the id of an id-less task on line 7 collide) and hold no control character
/// ([`control_in_id`]). Errors: the file cannot be read, a line is not a JSON object (file
/// and line reported), an id field of another type or with a control character, a
/// duplicate id (both lines reported), no tasks. When there are several, the error
/// reported is the first one met reading the file from the top.
pub fn load_tasks(path: &Path, id_field: &str) -> Result<TaskFile, TaskError> {
    let read_error = |source| TaskError::Read {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(read_error)?;
    let mut reader = BufReader::with_capacity(1 << 16, &file);
    let mut ids = TaskIds::default();
    let mut spans: Vec<Span> = Vec::new();
    let mut fingerprint = FingerprintWriter::new();
    let mut buf = Vec::new();
    // File offset of the line in `buf`.
    let mut offset = 0u64;
    for line in 1u64.. {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf).map_err(read_error)?;
        if n == 0 {
            break;
        }
        let start = offset;
        offset += n as u64;
        let mut bytes = buf.strip_suffix(b"\n").unwrap_or(&buf);
        let mut bom = 0;
        if line == 1 {
            if let Some(rest) = bytes.strip_prefix(b"\xEF\xBB\xBF") {
                bytes = rest;
                bom = 3;
            }
        }
        // The first error in the file: a duplicate among the lines above, else this line's.
        let fail = |e: TaskError| Err(first_duplicate(path, &ids, &spans).unwrap_or(e));
        let bad = |reason: String| TaskError::BadLine {
            path: path.to_owned(),
            line,
            reason,
        };
        let untrimmed = match std::str::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => return fail(bad(format!("not UTF-8 ({e})"))),
        };
        let text = untrimmed.trim();
        if text.is_empty() {
            continue;
        }
        let id = match parse_line(text, id_field) {
            Err(e) => return fail(bad(format!("not valid JSON ({e})"))),
            Ok(Line::Other(kind)) => {
                return fail(bad(format!("expected a JSON object, found {kind}")))
            }
            Ok(Line::Object(id)) => match id {
                None => line.to_string(),
                Some(serde_json::Value::String(s)) if !s.is_empty() => s,
                Some(v @ serde_json::Value::Number(_)) if v.is_i64() || v.is_u64() => v.to_string(),
                Some(other) => {
                    return fail(TaskError::BadId {
                        path: path.to_owned(),
                        line,
                        field: id_field.to_owned(),
                        found: other.to_string(),
                    })
                }
            },
        };
        if let Some(control) = control_in_id(&id) {
            return fail(TaskError::ControlInId {
                path: path.to_owned(),
                line,
                field: id_field.to_owned(),
                id,
                control,
            });
        }
        let trimmed_at = text.as_ptr() as usize - untrimmed.as_ptr() as usize;
        spans.push(Span {
            offset: start + bom + trimmed_at as u64,
            len: text.len() as u64,
            line,
            hash: line_hash(text.as_bytes()),
        });
        fingerprint.push(&id, text);
        ids.push(&id);
    }
    if let Some(e) = first_duplicate(path, &ids, &spans) {
        return Err(e);
    }
    if ids.is_empty() {
        return Err(TaskError::NoTasks {
            path: path.to_owned(),
        });
    }
    ids.shrink_to_fit();
    spans.shrink_to_fit();
    Ok(TaskFile {
        path: path.to_owned(),
        file,
        ids,
        spans,
        fingerprint: fingerprint.finish(),
    })
}

/// The first control character of an id (C0 including NUL, DEL, C1), if any. An id
/// becomes a command's argument and `RL_NODE_TASK_ID` (where a NUL cannot be passed at
/// all), a log line and a line of `rl-node status`, where an escape sequence would reach
/// the operator's terminal. JSON strings may carry any of them (`\u0000`, `\u001b`).
/// A `/` is fine: item files are named from their position in the plan, never from ids.
pub(crate) fn control_in_id(id: &str) -> Option<char> {
    id.chars().find(|c| c.is_control())
}

/// The duplicate id met first reading from the top: the smallest line whose id an earlier
/// line has, with the earliest line having it. By sorting, so that no second copy of the
/// ids (a set) is kept while loading.
fn first_duplicate(path: &Path, ids: &TaskIds, spans: &[Span]) -> Option<TaskError> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    // Equal ids end up adjacent, in file order.
    order.sort_unstable_by(|&a, &b| ids[a].cmp(&ids[b]).then(a.cmp(&b)));
    let mut found: Option<(usize, usize)> = None;
    for k in 1..order.len() {
        let (first, second) = (order[k - 1], order[k]);
        let group_start = k == 1 || ids[order[k - 2]] != ids[first];
        if group_start && ids[first] == ids[second] && found.is_none_or(|(_, s)| second < s) {
            found = Some((first, second));
        }
    }
    let (first, second) = found?;
    Some(TaskError::DuplicateId {
        path: path.to_owned(),
        id: ids[second].to_owned(),
        first: spans[first].line,
        second: spans[second].line,
    })
}

/// The hash of a trimmed line kept to notice a line changed after the load. Not
/// persisted, so std's hasher (fixed keys, stable within a build) is enough.
fn line_hash(bytes: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    h.write(bytes);
    h.finish()
}

/// [`TaskFile::fingerprint`], fed one task at a time: the same bytes `serde_json::to_string`
/// writes for the whole `Vec<(&str, &str)>`, streamed into SHA-256.
struct FingerprintWriter {
    sha: Sha256,
    empty: bool,
}

impl FingerprintWriter {
    fn new() -> Self {
        let mut sha = Sha256::new();
        sha.update(b"[");
        FingerprintWriter { sha, empty: true }
    }

    fn push(&mut self, id: &str, raw: &str) {
        if !self.empty {
            self.sha.update(b",");
        }
        self.empty = false;
        serde_json::to_writer(super::ShaWriter(&mut self.sha), &(id, raw))
            .expect("hashing cannot fail");
    }

    fn finish(mut self) -> String {
        self.sha.update(b"]");
        hex::encode(&self.sha.finalize()[..8])
    }
}

/// What a task line holds, as far as loading cares.
enum Line {
    /// An object and the value of its id field, if any (the last one when the key repeats,
    /// as in a `serde_json::Map`).
    Object(Option<serde_json::Value>),
    /// Not an object: which kind of JSON value, for the message.
    Other(&'static str),
}

/// Parse one line as `serde_json::from_str::<Value>` would — the same syntax, the same
/// number and string checks, the same errors — without building the value: every visit
/// goes through `deserialize_any`, as `Value`'s does, and only the id field's value is kept.
fn parse_line(text: &str, id_field: &str) -> Result<Line, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let line = LineSeed { id_field }.deserialize(&mut de)?;
    de.end()?;
    Ok(line)
}

struct LineSeed<'f> {
    id_field: &'f str,
}

impl<'de> DeserializeSeed<'de> for LineSeed<'_> {
    type Value = Line;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Line, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for LineSeed<'_> {
    type Value = Line;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Line, E> {
        Ok(Line::Other("a boolean"))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Line, E> {
        Ok(Line::Other("a number"))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Line, E> {
        Ok(Line::Other("a number"))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Line, E> {
        Ok(Line::Other("a number"))
    }

    fn visit_str<E>(self, _: &str) -> Result<Line, E> {
        Ok(Line::Other("a string"))
    }

    fn visit_unit<E>(self) -> Result<Line, E> {
        Ok(Line::Other("null"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Line, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Line::Other("an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Line, A::Error> {
        let mut id = None;
        while let Some(is_id) = map.next_key_seed(IsKey(self.id_field))? {
            if is_id {
                id = Some(map.next_value::<serde_json::Value>()?);
            } else {
                map.next_value::<Checked>()?;
            }
        }
        Ok(Line::Object(id))
    }
}

/// A map key, compared with the id field's name.
struct IsKey<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for IsKey<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for IsKey<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

/// Any JSON value, parsed and checked like `Value` (unlike [`serde::de::IgnoredAny`], which skips
/// numbers and escapes without checking them: `1e400` or a lone surrogate `"\ud800"`
/// would pass), and dropped.
struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Checked, D::Error> {
        d.deserialize_any(CheckedVisitor)
    }
}

struct CheckedVisitor;

impl<'de> Visitor<'de> for CheckedVisitor {
    type Value = Checked;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
        while map.next_entry::<Checked, Checked>()?.is_some() {}
        Ok(Checked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tasks.jsonl");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// (id, line, raw) of every task and the contents fingerprint, or the error's message.
    type Loaded = Result<(Vec<(String, u64, String)>, String), String>;

    /// (id, line, raw) of every task, the lines read again from the file.
    fn triples(ts: &TaskFile) -> Vec<(String, u64, String)> {
        (0..ts.len())
            .map(|k| (ts.ids()[k].to_owned(), ts.line(k), ts.raw(k).unwrap()))
            .collect()
    }

    /// The loader before issue 10, which kept every line in memory, verbatim but for its
    /// result ([`Loaded`]) and the later refusal of ids with control characters. The
    /// bounded loader must agree with it on every file.
    fn old_load_tasks(path: &Path, id_field: &str) -> Loaded {
        let bytes = std::fs::read(path).map_err(|source| {
            TaskError::Read {
                path: path.to_owned(),
                source,
            }
            .to_string()
        })?;
        let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
        let mut tasks = Vec::new();
        let mut seen: std::collections::BTreeMap<String, u64> = Default::default();
        for (n, raw) in bytes.split(|&b| b == b'\n').enumerate() {
            let line = n as u64 + 1;
            let bad = |reason: String| {
                TaskError::BadLine {
                    path: path.to_owned(),
                    line,
                    reason,
                }
                .to_string()
            };
            let text = std::str::from_utf8(raw)
                .map_err(|e| bad(format!("not UTF-8 ({e})")))?
                .trim();
            if text.is_empty() {
                continue;
            }
            let value: serde_json::Value =
                serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
            let Some(object) = value.as_object() else {
                let kind = match value {
                    serde_json::Value::Null => "null",
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    serde_json::Value::String(_) => "a string",
                    serde_json::Value::Array(_) => "an array",
                    serde_json::Value::Object(_) => "an object",
                };
                return Err(bad(format!("expected a JSON object, found {kind}")));
            };
            let id = match object.get(id_field) {
                None => line.to_string(),
                Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
                Some(v @ serde_json::Value::Number(num)) if num.is_i64() || num.is_u64() => {
                    v.to_string()
                }
                Some(other) => {
                    return Err(TaskError::BadId {
                        path: path.to_owned(),
                        line,
                        field: id_field.to_owned(),
                        found: other.to_string(),
                    }
                    .to_string())
                }
            };
            if let Some(control) = control_in_id(&id) {
                return Err(TaskError::ControlInId {
                    path: path.to_owned(),
                    line,
                    field: id_field.to_owned(),
                    id,
                    control,
                }
                .to_string());
            }
            if let Some(&first) = seen.get(&id) {
                return Err(TaskError::DuplicateId {
                    path: path.to_owned(),
                    id,
                    first,
                    second: line,
                }
                .to_string());
            }
            seen.insert(id.clone(), line);
            tasks.push((id, line, text.to_owned()));
        }
        if tasks.is_empty() {
            return Err(TaskError::NoTasks {
                path: path.to_owned(),
            }
            .to_string());
        }
        let pairs: Vec<(&str, &str)> = tasks.iter().map(|t| (&*t.0, &*t.2)).collect();
        let canonical = serde_json::to_string(&pairs).unwrap();
        let fingerprint = hex::encode(&Sha256::digest(canonical.as_bytes())[..8]);
        Ok((tasks, fingerprint))
    }

    fn new_load_tasks(path: &Path, id_field: &str) -> Loaded {
        let ts = load_tasks(path, id_field).map_err(|e| e.to_string())?;
        Ok((triples(&ts), ts.fingerprint().to_owned()))
    }

    /// Lines that exercise every rule of the loader and of JSON as `serde_json::Value`
    /// reads it: ids of each type, repeated keys, escapes equal to plain ids, numbers out
    /// of range, lone surrogates, control characters, depth, trailing text, kinds that are
    /// not objects, whitespace only (Unicode too), invalid UTF-8.
    const LINES: &[&[u8]] = &[
        br#"{"id": "a"}"#,
        br#"{"id": "b", "x": [1, {"y": null, "z": [true, false]}], "w": -2.5e-3}"#,
        br#"{"id": "\u0061"}"#,
        r#"{"id": "é", "prompt": "naïve → 日本"}"#.as_bytes(),
        br#"{"id": 7}"#,
        br#"{"id": -3}"#,
        br#"{"id": 2}"#,
        br#"{"id": "3"}"#,
        br#"{"id": 18446744073709551615}"#,
        br#"{"id": 18446744073709551616}"#,
        br#"{"id": -0}"#,
        br#"{"id": 1e2}"#,
        br#"{"id": 1.5}"#,
        br#"{"id": ""}"#,
        br#"{"id": null}"#,
        br#"{"id": [1, "a"]}"#,
        br#"{"id": {"k": 1}}"#,
        br#"{"id": 1, "id": "z"}"#,
        br#"{"id": "q", "id": 2.5}"#,
        br#"{"i\u0064": "escaped-key"}"#,
        br#"{"id": "c\u0000d"}"#,
        br#"{"id": "\u001b[31mred"}"#,
        br#"{"id": "del\u007f"}"#,
        br#"{"id": "c1\u0085"}"#,
        "{\"id\": \"raw-c1-\u{9b}\"}".as_bytes(),
        br#"{"id": "a/b", "name": "\u0007"}"#,
        br#"{}"#,
        br#"{"x": 2}"#,
        br#"{"name": "n1"}"#,
        br#"{"x": 1e400}"#,
        br#"{"x": -1e400}"#,
        br#"{"x": "\ud800"}"#,
        br#"{"x": "\ud800\u0041"}"#,
        br#"{"x": "\udc00"}"#,
        br#"{"x": "\ud83d\ude00"}"#,
        b"{\"x\": \"tab\there\"}",
        br#"{"x": "\q"}"#,
        br#"{"x": 01}"#,
        br#"{"a": 1,}"#,
        br#"{"a": 1} x"#,
        br#"{1: 2}"#,
        br#"{"id": "a""#,
        br#"[1, 2]"#,
        br#""str""#,
        br#"3"#,
        br#"true"#,
        br#"null"#,
        // 128 levels deep, the most serde_json accepts, and 129.
        concat!(
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
            "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
        )
        .as_bytes(),
        concat!(
            "{\"d\": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
            "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
        )
        .as_bytes(),
        b"",
        b"   ",
        b"\t",
        "\u{a0}\u{2003}".as_bytes(),
        b"\r",
        b"{\"x\": \"\xff\"}",
        b"\xEF\xBB\xBF{\"id\": \"bom-inside\"}",
    ];

    /// Files of up to 12 lines: mostly valid tasks whose ids sometimes repeat (or equal
    /// another line's number), some of [`LINES`], with stray whitespace, byte-order marks
    /// and either line ending.
    fn file_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        let body = prop_oneof![
            5 => (0u32..20).prop_map(|n| format!(r#"{{"id": "v{n}", "prompt": "p{n}"}}"#).into_bytes()),
            1 => (0u32..15).prop_map(|n| format!(r#"{{"id": {n}}}"#).into_bytes()),
            1 => (0u32..15).prop_map(|n| format!(r#"{{"prompt": "line-numbered {n}"}}"#).into_bytes()),
            3 => prop::sample::select(LINES.to_vec()).prop_map(<[u8]>::to_vec),
        ];
        let line = (
            body,
            prop::sample::select(vec!["", "", "", "", "", "", " ", "\t", "\u{feff}"]),
            prop::sample::select(vec!["", "", "", " ", "\r", " \r", "\u{3000}"]),
        );
        (
            any::<bool>(),
            prop::collection::vec(line, 0..12),
            prop::sample::select(vec!["\n", "\r\n"]),
            any::<bool>(),
        )
            .prop_map(|(bom, lines, eol, final_eol)| {
                let mut out = Vec::new();
                if bom {
                    out.extend_from_slice(b"\xEF\xBB\xBF");
                }
                for (k, (body, before, after)) in lines.iter().enumerate() {
                    if k > 0 {
                        out.extend_from_slice(eol.as_bytes());
                    }
                    out.extend_from_slice(before.as_bytes());
                    out.extend_from_slice(body);
                    out.extend_from_slice(after.as_bytes());
                }
                if final_eol {
                    out.extend_from_slice(eol.as_bytes());
                }
                out
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// On any file, the bounded loader finds the same tasks (ids, line numbers, the
        /// lines read again byte for byte), the same contents fingerprint, or the same
        /// first error with the same message, as the loader that kept every line.
        #[test]
        fn loads_like_the_loader_that_kept_every_line(
            bytes in file_bytes(),
            id_field in prop::sample::select(vec!["id", "name"]),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tasks.jsonl");
            std::fs::write(&path, &bytes).unwrap();
            prop_assert_eq!(
                new_load_tasks(&path, id_field),
                old_load_tasks(&path, id_field),
                "file {:?}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }

    #[test]
    fn ids_from_strings_integers_and_line_numbers() {
        let (_d, path) = file(
            "\u{feff}{\"id\": \"alpha\", \"x\": 1}\n\n  {\"id\": 17}  \r\n{\"x\": 2}\n{\"id\": -3}\n",
        );
        let ts = load_tasks(&path, "id").unwrap();
        assert_eq!(
            triples(&ts),
            vec![
                ("alpha".into(), 1, "{\"id\": \"alpha\", \"x\": 1}".into()),
                ("17".into(), 3, "{\"id\": 17}".into()),
                ("4".into(), 4, "{\"x\": 2}".into()),
                ("-3".into(), 5, "{\"id\": -3}".into()),
            ]
        );
        // Another id field: every id is a line number.
        let by_name = load_tasks(&path, "name").unwrap();
        let ids: Vec<&str> = by_name.ids().iter().collect();
        assert_eq!(ids, vec!["1", "3", "4", "5"]);
    }

    #[test]
    fn a_bad_line_is_reported_with_file_and_line() {
        let (_d, path) = file("{\"id\": 1}\n{\"id\": 2\n");
        let err = load_tasks(&path, "id").unwrap_err();
        assert!(matches!(err, TaskError::BadLine { line: 2, .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("{}:2: not valid JSON", path.display())),
            "{msg}"
        );

        let (_d, path) = file("{}\n[1, 2]\n");
        let msg = load_tasks(&path, "id").unwrap_err().to_string();
        assert!(
            msg.contains(":2: expected a JSON object, found an array"),
            "{msg}"
        );

        let (_d, path) = file("{}\n{\"id\": 1.5}\n");
        let err = load_tasks(&path, "id").unwrap_err();
        assert!(
            matches!(&err, TaskError::BadId { line: 2, found, .. } if found == "1.5"),
            "{err:?}"
        );
        let (_d, path) = file("{\"id\": \"\"}\n");
        assert!(matches!(
            load_tasks(&path, "id").unwrap_err(),
            TaskError::BadId { line: 1, .. }
        ));

        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("raw.jsonl");
        std::fs::write(&raw, b"{}\n{\"id\": \"\xff\"}\n").unwrap();
        let err = load_tasks(&raw, "id").unwrap_err();
        assert!(matches!(err, TaskError::BadLine { line: 2, .. }), "{err:?}");
    }

    #[test]
    fn an_id_with_a_control_character_is_refused_naming_file_and_line() {
        for (escape, code) in [
            ("\\u0000", 0x00),
            ("\\u001b", 0x1b),
            ("\\u007f", 0x7f),
            ("\\u009b", 0x9b),
            ("\u{85}", 0x85),
        ] {
            let (_d, path) = file(&format!(
                "{{\"id\": \"a\"}}\n{{\"id\": \"b\"}}\n{{\"id\": \"c{escape}[31md\"}}\n"
            ));
            let err = load_tasks(&path, "id").unwrap_err();
            assert!(
                matches!(&err, TaskError::ControlInId { line: 3, control, .. } if u32::from(*control) == code),
                "{escape}: {err:?}"
            );
            let msg = err.to_string();
            assert!(
                msg.starts_with(&format!("task file {}:3: the id `c", path.display()))
                    && msg.contains(&format!("holds the control character U+{code:04X}")),
                "{msg}"
            );
            // The id is shown escaped: the message itself carries no control character.
            assert!(!msg.chars().any(char::is_control), "{msg:?}");
        }
        // Printable ids pass, `/` and non-ASCII letters included; other fields may hold
        // any JSON string.
        let (_d, path) = file("{\"id\": \"a/b\", \"p\": \"\\u0000\\u001b\"}\n{\"id\": \"日本\"}\n");
        let ids: Vec<String> = load_tasks(&path, "id")
            .unwrap()
            .ids()
            .iter()
            .map(str::to_owned)
            .collect();
        assert_eq!(ids, ["a/b", "日本"]);
    }

    #[test]
    fn duplicate_ids_report_both_lines() {
        let (_d, path) = file("{\"id\": \"a\"}\n{\"id\": \"b\"}\n\n{\"id\": \"a\"}\n");
        let err = load_tasks(&path, "id").unwrap_err();
        assert!(
            matches!(&err, TaskError::DuplicateId { id, first: 1, second: 4, .. } if id == "a"),
            "{err:?}"
        );
        assert!(err
            .to_string()
            .contains("\"a\" appears on line 1 and again on line 4"));
        // An explicit id equal to another task's line number collides too.
        let (_d, path) = file("{\"id\": 2}\n{}\n");
        assert!(matches!(
            load_tasks(&path, "id").unwrap_err(),
            TaskError::DuplicateId {
                first: 1,
                second: 2,
                ..
            }
        ));
    }

    #[test]
    fn a_large_file_reads_back_every_line_as_it_was() {
        // Lines crossing the reader's 64 KiB buffer, longer than it, CRLF endings, blank
        // and whitespace-only lines, no final newline: every task, up to the last, reads
        // back as the loader that kept every line had it.
        let mut text = String::from("\u{feff}");
        for i in 0..40_000 {
            match i % 997 {
                0 => text.push_str("\r\n"),
                1 => text.push_str("  \t \r\n"),
                2 => text.push_str(&format!(
                    "{{\"id\": \"long-{i}\", \"prompt\": \"{}\"}}\r\n",
                    "x".repeat(100_000 + i)
                )),
                _ => text.push_str(&format!(
                    " {{\"id\": \"task-{i:06}\", \"prompt\": \"add {i} and {}\"}} \r\n",
                    i % 89
                )),
            }
        }
        text.push_str("{\"id\": \"the-last\", \"prompt\": \"é\"}");
        let (_d, path) = file(&text);
        let old = old_load_tasks(&path, "id").unwrap();
        let ts = load_tasks(&path, "id").unwrap();
        assert_eq!(ts.len(), old.0.len());
        assert_eq!(ts.fingerprint(), old.1);
        assert_eq!(triples(&ts), old.0);
        let last = ts.len() - 1;
        assert_eq!(
            ts.raw(last).unwrap(),
            "{\"id\": \"the-last\", \"prompt\": \"é\"}"
        );
        assert_eq!(ts.line(last), 40_001);
    }

    #[test]
    fn a_line_changed_after_the_load_is_reported_not_used() {
        let (d, path) = file("{\"id\": \"a\"}\n{\"id\": \"b\"}\n");
        let ts = load_tasks(&path, "id").unwrap();
        // A file renamed over the path (how editors and `mv` replace files) does not
        // change the tasks: the loaded file stays open.
        let other = d.path().join("other.jsonl");
        std::fs::write(&other, "{\"id\": \"c\"}\n{\"id\": \"d\"}\n").unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert_eq!(ts.raw(1).unwrap(), "{\"id\": \"b\"}");

        // Changed in place, same length: reported with the file and line.
        let ts = load_tasks(&path, "id").unwrap();
        std::fs::write(&path, "{\"id\": \"c\"}\n{\"id\": \"e\"}\n").unwrap();
        assert_eq!(ts.raw(0).unwrap(), "{\"id\": \"c\"}");
        let err = ts.raw(1).unwrap_err();
        assert!(matches!(err, TaskError::Changed { line: 2, .. }), "{err:?}");
        assert!(
            err.to_string().contains(&format!(
                "{}:2 changed after rl-node loaded it",
                path.display()
            )),
            "{err}"
        );
        // Truncated: the line is gone.
        std::fs::write(&path, "{\"id\": \"c\"}\n").unwrap();
        assert!(matches!(
            ts.raw(1).unwrap_err(),
            TaskError::Changed { line: 2, .. }
        ));
    }

    #[test]
    fn the_fingerprint_covers_contents_and_the_plan_only_ids() {
        let (_a, a) = file("{\"id\":\"t0\"}\n{\"id\":\"t1\"}\n{\"id\":\"t2\"}\n");
        let (_b, b) = file("{\"id\":\"t0\"}\n{\"id\":\"t1\",\"x\":1}\n{\"id\":\"t2\"}\n");
        let (ta, tb) = (load_tasks(&a, "id").unwrap(), load_tasks(&b, "id").unwrap());
        assert_eq!(
            ta.fingerprint(),
            load_tasks(&a, "id").unwrap().fingerprint()
        );
        assert_ne!(ta.fingerprint(), tb.fingerprint());
        assert_eq!(ta.fingerprint().len(), 16);
        // The plans alike: only ids enter a plan.
        let plan = |ids| {
            crate::work::plan(&crate::work::PlanInput {
                tasks: ids,
                weights: &[1, 1],
                budget: None,
                samples: 1,
                seed: 7,
                iteration: 1,
                strategy: crate::work::Strategy::Weighted,
            })
        };
        assert_eq!(plan(ta.ids()).fingerprint, plan(tb.ids()).fingerprint);
    }

    #[test]
    fn unreadable_and_empty_files() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.jsonl");
        let err = load_tasks(&missing, "id").unwrap_err();
        assert!(matches!(err, TaskError::Read { .. }));
        assert!(err.to_string().contains("nope.jsonl"));
        let (_d, path) = file("\n  \n");
        assert!(matches!(
            load_tasks(&path, "id").unwrap_err(),
            TaskError::NoTasks { .. }
        ));
    }
}
