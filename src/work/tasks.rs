//! Task files: one JSON object per line, each task identified by an id field or its line
//! number. Loading checks every line (and reports the file and line of the first bad one)
//! so that a bad file stops a node at start, before anything is written.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// One task: a line of the task file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    /// 1-based line number in the task file.
    pub line: u64,
    /// The JSON line as in the file, trimmed.
    pub raw: String,
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
    #[error("task file {}: task id {id:?} appears on line {first} and again on line {second}", .path.display())]
    DuplicateId {
        path: PathBuf,
        id: String,
        first: u64,
        second: u64,
    },
    #[error("task file {} holds no tasks", .path.display())]
    NoTasks { path: PathBuf },
}

/// Read a JSONL task file. Every non-blank line must be a JSON object (a UTF-8 byte-order
/// mark at the start of the file is ignored). A task's id is the value of `id_field` when
/// present — a non-empty string as is, an integer in decimal — else its 1-based line number.
/// Ids must be unique (an explicit id `"7"` and the id of an id-less task on line 7
/// collide). Errors: the file cannot be read, a line is not a JSON object (file and line
/// reported), an id field of another type, a duplicate id (both lines reported), no tasks.
pub fn load_tasks(path: &Path, id_field: &str) -> Result<Vec<Task>, TaskError> {
    let bytes = std::fs::read(path).map_err(|source| TaskError::Read {
        path: path.to_owned(),
        source,
    })?;
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
    let mut tasks = Vec::new();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for (n, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = n as u64 + 1;
        let bad = |reason: String| TaskError::BadLine {
            path: path.to_owned(),
            line,
            reason,
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
            return Err(bad(format!(
                "expected a JSON object, found {}",
                kind(&value)
            )));
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
                })
            }
        };
        if let Some(&first) = seen.get(&id) {
            return Err(TaskError::DuplicateId {
                path: path.to_owned(),
                id,
                first,
                second: line,
            });
        }
        seen.insert(id.clone(), line);
        tasks.push(Task {
            id,
            line,
            raw: text.to_owned(),
        });
    }
    if tasks.is_empty() {
        return Err(TaskError::NoTasks {
            path: path.to_owned(),
        });
    }
    Ok(tasks)
}

/// sha256 (hex, 16 chars) of the canonical JSON of every task's `[id, raw]`, in order.
/// [`Plan::fingerprint`] covers ids, not contents: two task files with the same ids (e.g.
/// ids from line numbers) but different lines plan alike; compare this too to catch that.
pub fn tasks_fingerprint(tasks: &[Task]) -> String {
    let pairs: Vec<(&str, &str)> = tasks
        .iter()
        .map(|t| (t.id.as_str(), t.raw.as_str()))
        .collect();
    let canonical = serde_json::to_string(&pairs).expect("json");
    hex::encode(&Sha256::digest(canonical.as_bytes())[..8])
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tasks.jsonl");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn ids_from_strings_integers_and_line_numbers() {
        let (_d, path) = file(
            "\u{feff}{\"id\": \"alpha\", \"x\": 1}\n\n  {\"id\": 17}  \r\n{\"x\": 2}\n{\"id\": -3}\n",
        );
        let ts = load_tasks(&path, "id").unwrap();
        assert_eq!(
            ts,
            vec![
                Task {
                    id: "alpha".into(),
                    line: 1,
                    raw: "{\"id\": \"alpha\", \"x\": 1}".into()
                },
                Task {
                    id: "17".into(),
                    line: 3,
                    raw: "{\"id\": 17}".into()
                },
                Task {
                    id: "4".into(),
                    line: 4,
                    raw: "{\"x\": 2}".into()
                },
                Task {
                    id: "-3".into(),
                    line: 5,
                    raw: "{\"id\": -3}".into()
                },
            ]
        );
        // Another id field: every id is a line number.
        let ids: Vec<String> = load_tasks(&path, "name")
            .unwrap()
            .into_iter()
            .map(|t| t.id)
            .collect();
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
