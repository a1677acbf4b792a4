//! A node's log lines: stamped with the date, the time and the UTC offset, filtered by
//! `--log-level` (or RL_NODE_LOG_LEVEL), and one JSON object per line with
//! `--log-format json` (or RL_NODE_LOG_FORMAT), the final report included.

mod common;

use common::cluster::*;
use std::fs;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

/// Run one node of a one-node cluster to its end: (exit code, stderr).
fn run_one(extra: &str, args: &[&str], env: &[(&str, String)]) -> (i32, String) {
    let c = TestCluster::new(1, extra);
    let mut node = c.spawn_env(0, &c.log_path, args, env);
    let code = node.wait(LIMIT);
    (code, node.stderr())
}

#[test]
fn each_line_carries_the_date_the_time_and_the_utc_offset_and_the_rank() {
    // A POSIX TZ rule needs no time zone database: local time is UTC+05:30 here.
    let before = chrono::Utc::now();
    let (code, err) = run_one(
        "",
        &["--iterations", "1"],
        &[("TZ", "RLN-05:30".to_string())],
    );
    let after = chrono::Utc::now();
    assert_eq!(code, 0, "{err}");
    assert!(err.lines().count() >= 3, "{err}");
    for line in err.lines() {
        let (stamp, rest) = line.split_once(' ').unwrap();
        let t = chrono::DateTime::parse_from_rfc3339(stamp)
            .unwrap_or_else(|e| panic!("`{stamp}` is not an RFC 3339 time ({e}):\n{err}"));
        assert_eq!(t.offset().local_minus_utc(), 5 * 3600 + 30 * 60, "{line}");
        let slack = chrono::Duration::seconds(1);
        assert!(
            before - slack <= t && t <= after + slack,
            "{t} is not between {before} and {after}"
        );
        // Milliseconds, so that lines of one second keep their order when merged.
        assert_eq!(stamp.len(), "2026-11-23T11:52:12.123+05:30".len(), "{line}");
        assert!(rest.starts_with("[rank 0] "), "{line}");
    }
    assert!(
        err.contains("[rank 0] warning: no phase command is configured"),
        "{err}"
    );
    assert!(err.contains("[rank 0] all ranks joined"), "{err}");
}

/// Every line of a node's stderr, parsed; panics naming the line that is not JSON.
fn json_lines(err: &str) -> Vec<serde_json::Value> {
    err.lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}\nstderr:\n{err}"))
        })
        .collect()
}

#[test]
fn log_format_json_writes_one_object_per_line_final_report_included() {
    // Rank 1's rollout fails in iteration 2: its report and rank 0's are events too.
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"if [ {rank} = 1 ] && [ {iteration} = 2 ]; then echo 'out of tokens' >&2; exit 7; fi; echo '{}' > {output}\"\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    // The flag on rank 0, the environment on rank 1.
    let mut master = c.spawn(0, &["--iterations", "3", "--log-format", "json"]);
    let mut worker = c.spawn_env(
        1,
        &c.log_path,
        &["--iterations", "3"],
        &[("RL_NODE_LOG_FORMAT", "json".to_string())],
    );
    assert_eq!(worker.wait(LIMIT), 1, "{}", worker.stderr());
    assert_eq!(master.wait(LIMIT), 3, "{}", master.stderr());
    for n in [&master, &worker] {
        let err = n.stderr();
        let lines = json_lines(&err);
        assert!(lines.len() >= 4, "{err}");
        for l in &lines {
            let stamp = l["timestamp"].as_str().unwrap_or_default();
            chrono::DateTime::parse_from_rfc3339(stamp)
                .unwrap_or_else(|e| panic!("`{stamp}`: {e}\n{l}"));
            assert!(
                ["ERROR", "WARN", "INFO"].contains(&l["level"].as_str().unwrap_or_default()),
                "{l}"
            );
            assert!(!l["message"].as_str().unwrap_or_default().is_empty(), "{l}");
            assert_eq!(l["rank"].as_u64(), Some(n.rank as u64), "{l}");
        }
        let said = |text: &str| {
            lines
                .iter()
                .any(|l| l["level"] == "INFO" && l["message"].as_str().unwrap().contains(text))
        };
        assert!(said("iteration 1 complete"), "{err}");
        if n.rank == 0 {
            assert!(said("all ranks joined"), "{err}");
        } else {
            assert!(said("joined generation 1"), "{err}");
        }
        // The last line is the node's final report, with its exit code as a field.
        let last = lines.last().unwrap();
        assert_eq!(last["level"], "ERROR", "{err}");
        let code = if n.rank == 0 { 3 } else { 1 };
        assert_eq!(last["exit_code"].as_i64(), Some(code), "{last}");
    }
    let report = json_lines(&worker.stderr()).pop().unwrap();
    let message = report["message"].as_str().unwrap();
    assert!(message.contains("rollout"), "{report}");
    assert!(message.contains("exit code 7"), "{report}");
    assert!(
        report["log_tail"]
            .as_array()
            .is_some_and(|t| t.iter().any(|l| l == "out of tokens")),
        "the failed command's last log lines are a field, one string per line: {report}"
    );
    // The message's further lines (the log's path) are details, not embedded newlines.
    assert!(
        report["details"]
            .as_array()
            .is_some_and(|d| d.iter().any(|l| l.as_str().unwrap().starts_with("log: "))),
        "{report}"
    );
    // What the node was doing are fields of their own, in its final report too.
    assert_eq!(report["iteration"], 2, "{report}");
    assert_eq!(report["phase"], "train-rollout", "{report}");
    assert_eq!(report["generation"], 1, "{report}");
    assert!(
        report["run"].as_str().is_some_and(|r| r.len() > 4),
        "{report}"
    );
    assert!(report["host"].is_string(), "{report}");
    for n in [&master, &worker] {
        let lines = json_lines(&n.stderr());
        // No value holds a newline.
        fn strings(v: &serde_json::Value, out: &mut Vec<String>) {
            match v {
                serde_json::Value::String(s) => out.push(s.clone()),
                serde_json::Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
                serde_json::Value::Object(m) => m.values().for_each(|v| strings(v, out)),
                _ => {}
            }
        }
        let mut all = vec![];
        lines.iter().for_each(|l| strings(l, &mut all));
        assert!(all.iter().all(|s| !s.contains('\n')), "{all:?}");
        // Every event the node records is a line, its kind in `event`, with its fields.
        let barriers: Vec<_> = lines.iter().filter(|l| l["event"] == "barrier").collect();
        assert!(
            barriers.iter().any(|l| l["name"] == "sync-start"
                && l["iteration"] == 1
                && l["run"] == report["run"]),
            "{barriers:?}"
        );
    }
}

#[test]
fn log_level_drops_the_lines_below_it_and_the_flag_wins_over_the_environment() {
    // Default info: information, no debug lines.
    let (code, err) = run_one("", &["--iterations", "1"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("] all ranks joined"), "{err}");
    assert!(!err.contains("debug: "), "{err}");

    // warn: the warning stays, information goes.
    let (code, err) = run_one("", &["--iterations", "1", "--log-level", "warn"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("[rank 0] warning: no phase command is configured"),
        "{err}"
    );
    assert!(!err.contains("all ranks joined"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    // error (from the environment): no warning; a failure is still reported.
    let level = [("RL_NODE_LOG_LEVEL", "error".to_string())];
    let (code, err) = run_one("", &["--iterations", "1"], &level);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err, "", "nothing at or above error to say");
    let (code, err) = run_one(
        "[phases.rollout]\ncommand = \"exit 7\"\n",
        &["--iterations", "1"],
        &level,
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("error: rank 0: "), "{err}");
    assert!(err.contains("exit code 7"), "{err}");
    assert!(!err.contains("[rank 0]"), "{err}");

    // debug: the flag wins over the environment, and barriers are logged.
    let (code, err) = run_one("", &["--iterations", "1", "--log-level", "debug"], &level);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("[rank 0] debug: iteration 1: barrier sync-start passed after"),
        "{err}"
    );
    assert!(err.contains("] all ranks joined"), "{err}");
}

#[test]
fn bad_log_settings_are_refused_with_exit_2_naming_the_option_or_variable() {
    let c = TestCluster::new(1, "");
    // (flag, environment variable, what the refusal names)
    let cases = [
        (Some(["--log-level", "loud"]), None, "--log-level"),
        (Some(["--log-format", "xml"]), None, "--log-format"),
        (
            None,
            Some(("RL_NODE_LOG_LEVEL", "loud")),
            "RL_NODE_LOG_LEVEL=loud",
        ),
        (
            None,
            Some(("RL_NODE_LOG_FORMAT", "xml")),
            "RL_NODE_LOG_FORMAT=xml",
        ),
    ];
    for (flag, var, named) in cases {
        let args = flag.as_ref().map(|f| &f[..]).unwrap_or(&[]);
        let env: Vec<(&str, String)> = var.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let mut node = c.spawn_env(0, &c.log_path, args, &env);
        let code = node.wait(LIMIT);
        let err = node.stderr();
        assert_eq!(code, 2, "{args:?} {env:?}: {err}");
        assert!(err.contains(named), "{args:?} {env:?}: {err}");
        assert!(!c.log_path.join(".rl-node").exists(), "{err}");
    }
    // Only a node logs: other commands refuse the flags.
    let out = Command::new(BIN)
        .args([
            "status",
            "--log-path",
            "/nonexistent",
            "--log-level",
            "info",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn json_debug_logging_into_a_closed_stderr_does_not_stop_the_node() {
    let c = TestCluster::new(1, "");
    let mut cmd = Command::new(BIN);
    cmd.args(["--master", "--config"])
        .arg(&c.config)
        .arg("--log-path")
        .arg(&c.log_path)
        .args([
            "--iterations",
            "3",
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ]);
    let status = run_with_closed_output(&mut cmd, LIMIT, "the node");
    assert_eq!(status.code(), Some(0), "{status}");
}
