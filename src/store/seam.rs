//! The store seam, kept closed: the code that commits to the shared directory (checkpoints,
//! merges, items, shards, the node's item and model checks, the run's state, recover and
//! repair) reaches it only through [`super::SharedDir`], so a simulated directory can stand
//! in and every operation is counted. This test reads those sources and fails on a direct
//! filesystem call that would bypass the trait; the few that stay are listed below, each
//! with why it is not a call on the shared directory's names.

use std::path::Path;

/// The sources that write the shared directory (their `#[cfg(test)]` modules excepted).
const SOURCES: &[&str] = &[
    "src/checkpoint.rs",
    "src/aggregate/mod.rs",
    "src/aggregate/cli.rs",
    "src/aggregate/command.rs",
    "src/aggregate/jsonl.rs",
    "src/aggregate/manifest.rs",
    "src/aggregate/survey.rs",
    "src/aggregate/tensors.rs",
    "src/shards/mod.rs",
    "src/shards/command.rs",
    "src/shards/naming.rs",
    "src/shards/safetensors.rs",
    "src/shards/torch.rs",
    "src/work/tasks.rs",
    "src/node/work.rs",
    "src/node/workers.rs",
    "src/node/model.rs",
    "src/state.rs",
    "src/observe/recover.rs",
    "src/observe/repair.rs",
];

/// Calls that change or probe a name without the store: a rename, a write, a create, a
/// directory made or removed, a walk or a link resolved, or an existence check (which the
/// store answers for a simulated directory, and counts).
const FORBIDDEN: &[&str] = &[
    "fs::rename(",
    "fs::write(",
    "File::create(",
    "fs::create_dir_all(",
    "fs::create_dir(",
    "fs::remove_dir(",
    "fs::remove_dir_all(",
    "fs::canonicalize(",
    "walkdir::",
    ".exists()",
    ".is_file()",
    ".is_dir()",
];

/// `(file, text of the line)` of the calls that stay, and why.
const ALLOWED: &[(&str, &str)] = &[
    // The metadata of the merge command's output, already fetched: a file type.
    ("src/shards/command.rs", "Ok(m) if m.is_file() => {}"),
    // `rl-node aggregate` checks its --log-path before anything else (a usage error), and
    // looks for the clusters that have a record (a read-only view, as `status` does).
    ("src/aggregate/cli.rs", "if !layout.root().is_dir() {"),
    ("src/aggregate/cli.rs", "if !l.cluster().exists() {"),
    // Recover's listing of leftovers: a file type of an entry already listed (read only).
    (
        "src/observe/recover.rs",
        "Ok(m) if m.is_file() => format!(\" ({} bytes)\", m.len()),",
    ),
];

/// The non-test part of `text`: up to its `#[cfg(test)]` module.
fn non_test(text: &str) -> &str {
    match text.find("#[cfg(test)]\nmod ") {
        Some(at) => &text[..at],
        None => text,
    }
}

/// Every forbidden call in the sources under `root` that is not allowed: `file:line: text`.
fn bypasses(root: &Path) -> Vec<String> {
    let mut found = vec![];
    for file in SOURCES {
        let text = std::fs::read_to_string(root.join(file)).expect("a listed source");
        for (i, line) in non_test(&text).lines().enumerate() {
            let code = line.trim();
            if code.starts_with("//") || !FORBIDDEN.iter().any(|f| code.contains(f)) {
                continue;
            }
            if !ALLOWED.iter().any(|(f, l)| f == file && *l == code) {
                found.push(format!("{file}:{}: {code}", i + 1));
            }
        }
    }
    found
}

#[test]
fn shared_directory_writers_go_through_the_store() {
    let found = bypasses(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(
        found.is_empty(),
        "direct filesystem calls outside src/store/ (use the SharedDir trait, or add the line to ALLOWED with why):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_allowed_line_is_still_there() {
    // An allowance whose line is gone would let a new call with the same text through.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (file, line) in ALLOWED {
        let text = std::fs::read_to_string(root.join(file)).expect("a listed source");
        assert!(
            non_test(&text).lines().any(|l| l.trim() == *line),
            "{file}: `{line}` is allowed but no longer there: remove it from ALLOWED"
        );
    }
}
