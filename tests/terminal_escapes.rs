//! Control characters in data from the shared directory never reach a terminal raw. Host
//! names and abort reasons are written by other nodes, or by anyone who can write there; an
//! escape sequence in them (clear the screen, retitle the window, a C1 CSI) must show up
//! escaped in `status` and in the nodes' own error output, and the JSON forms must stay
//! valid and decode to the original text.

mod common;

use common::cluster::*;
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

/// Clear the screen, set the window title (OSC … BEL), a C1 CSI, DEL.
const HOSTILE: &str = "\u{1b}[2J\u{1b}]0;pwned\u{7}\u{9b}31m\u{7f}";
/// How the escaped form of HOSTILE's first sequences reads.
const SHOWN: &str = "\\u001b[2J\\u001b]0;pwned\\u0007\\u009b31m\\u007f";

/// Rank 1's rollout prints an escape into its log, waits until an abort record appears in
/// its generation (planted by the test) and fails; rank 0's rollout runs long.
const FAIL_AFTER_PLANT: &str = r#"
[phases.rollout]
command = "if [ {rank} = 1 ]; then printf 'tail\\033]0;pwned\\007\\n'; until ls {log_path}/.rl-node/gen-*/abort.json >/dev/null 2>&1; do sleep 0.05; done; exit 7; fi; sleep 61.37"
"#;

/// A control character other than a line break, with what precedes it, if `text` has one.
fn raw_control(text: &str) -> Option<String> {
    let at = text.find(|c: char| c.is_control() && c != '\n')?;
    let from = (0..=at.saturating_sub(60))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    Some(format!("{:?}", &text[from..]))
}

fn assert_no_raw_control(what: &str, text: &str) {
    if let Some(found) = raw_control(text) {
        panic!("{what} prints a raw control character: …{found}\nall of it:\n{text}");
    }
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

fn write_json(path: &Path, v: &Value) {
    fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// Two nodes in their rollout; the test plants an abort record whose host, reason and log
/// carry HOSTILE into the live generation; rank 1 then fails, finds that record already
/// there (first writer wins) and adopts it, and rank 0 adopts it from rank 1. Rank 1 logs
/// JSON. Returns the cluster, after both nodes exited, and their stderr.
fn run_with_a_planted_abort() -> (TestCluster, [String; 2]) {
    let c = TestCluster::new(2, FAIL_AFTER_PLANT);
    let mut rank0 = c.spawn(0, &["--iterations", "1"]);
    let mut rank1 = c.spawn(1, &["--iterations", "1", "--log-format", "json"]);
    for r in 0..2 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    let gen = read_json(&c.log_path.join(".rl-node/cluster.json"))["gen"]
        .as_u64()
        .unwrap();
    let abort = serde_json::json!({
        "kind": "command-failed", "exit": "exit code 7", "culprit": 1,
        "culprit_host": format!("host{HOSTILE}"), "phase": "1 (train-rollout)",
        "iteration": 1, "reason": format!("reason{HOSTILE}"),
        "log": format!("logs/{HOSTILE}.log"), "detected_by": 1, "silent_ms": null,
        "at": "2020-01-01T00:00:00.000+00:00"
    });
    let path = c.log_path.join(format!(".rl-node/gen-{gen}/abort.json"));
    let tmp = path.with_extension("planting");
    write_json(&tmp, &abort);
    fs::rename(&tmp, &path).unwrap();
    let codes = [rank0.wait(LIMIT), rank1.wait(LIMIT)];
    let err = [rank0.stderr(), rank1.stderr()];
    assert_eq!(codes, [3, 1], "rank 0:\n{}\nrank 1:\n{}", err[0], err[1]);
    (c, err)
}

#[test]
fn an_abort_planted_with_escapes_is_shown_escaped_by_every_node() {
    let (_c, [text0, json1]) = run_with_a_planted_abort();
    // Rank 0 (text): the adopted cause names the host, the reason and the log, escaped.
    assert_no_raw_control("rank 0's stderr", &text0);
    for shown in [
        format!("host{SHOWN}"),
        format!("reason{SHOWN}"),
        format!("logs/{SHOWN}.log"),
    ] {
        assert!(text0.contains(&shown), "{shown} missing:\n{text0}");
    }
    // Rank 1 (JSON log): every line is a JSON object with no raw control character, and
    // the escapes decode back to what the record said.
    assert_no_raw_control("rank 1's JSON log", &json1);
    let events: Vec<Value> = json1
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let last = events.last().expect("rank 1 logged its error");
    let message = last["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("host{HOSTILE}"))
            && message.contains(&format!("reason{HOSTILE}")),
        "{last}"
    );
}

#[test]
fn a_failed_command_s_log_tail_is_shown_escaped_line_by_line() {
    let c = TestCluster::new(
        1,
        r#"
[phases.rollout]
command = 'printf "first\033[2J\n\033]8;;http://evil.invalid/\007link\033]8;;\007\n"; exit 7'
"#,
    );
    let mut node = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(node.wait(LIMIT), 1, "{}", node.stderr());
    let err = node.stderr();
    assert_no_raw_control("the node's error", &err);
    assert!(
        err.contains("  | first\\u001b[2J\n")
            && err.contains("  | \\u001b]8;;http://evil.invalid/\\u0007link\\u001b]8;;\\u0007\n"),
        "the log's two lines, each escaped on a line of its own:\n{err}"
    );
}

/// `status` (text and `--json`) of the stopped run, whose rank records now also carry
/// HOSTILE as host name: (exit code, stdout + stderr).
fn status_of(c: &TestCluster, json: bool) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["status", "--log-path"]).arg(&c.log_path);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn status_shows_planted_host_names_and_abort_reasons_escaped() {
    let (c, _) = run_with_a_planted_abort();
    let state = c.log_path.join(".rl-node");
    let gen = read_json(&state.join("cluster.json"))["gen"]
        .as_u64()
        .unwrap();
    for r in 0..2 {
        let path = state.join(format!("gen-{gen}/rank-{r}.json"));
        let mut rec = read_json(&path);
        rec["host"] = Value::from(format!("rank{r}host{HOSTILE}"));
        write_json(&path, &rec);
    }

    let (code, out, err) = status_of(&c, false);
    assert_eq!(code, 0, "{out}{err}");
    assert_no_raw_control("status", &format!("{out}{err}"));
    for shown in [format!("reason{SHOWN}"), format!("rank1host{SHOWN}")] {
        assert!(out.contains(&shown), "{shown} missing:\n{out}");
    }

    // `--json`: valid, no raw control character, and it decodes to the planted text.
    let (code, out, err) = status_of(&c, true);
    assert_eq!(code, 0, "{out}{err}");
    assert_no_raw_control("status --json", &format!("{out}{err}"));
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    for want in [format!("rank1host{HOSTILE}"), format!("reason{HOSTILE}")] {
        assert!(
            find_str(&v, &want),
            "{want:?} is not in the decoded JSON:\n{out}"
        );
    }
}

/// Whether `want` is one of the strings anywhere in `v`.
fn find_str(v: &Value, want: &str) -> bool {
    match v {
        Value::String(s) => s == want,
        Value::Array(a) => a.iter().any(|x| find_str(x, want)),
        Value::Object(o) => o.values().any(|x| find_str(x, want)),
        _ => false,
    }
}
