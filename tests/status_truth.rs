//! `rl-node status` never lies: a rank is shown alive or dead from evidence status checks
//! itself (the kernel for processes on this machine, a heartbeat that advances or not while
//! it watches for ranks elsewhere), never from the heartbeat age a dead node last wrote.

mod common;

use common::cluster::*;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

const LONG_ROLLOUT: &str = "[phases.rollout]\ncommand = \"sleep 60.73; echo '{}' > {output}\"\n";

/// `rl-node status` as run on this machine, or (`host`) from another host name, where the
/// kernel cannot be asked and heartbeats must be watched.
fn status_from(c: &TestCluster, host: Option<&str>) -> (i32, String) {
    let out = match host {
        None => Command::new(BIN)
            .args(["status", "--log-path"])
            .arg(&c.log_path)
            .output()
            .unwrap(),
        Some(h) => Command::new("unshare")
            .args([
                "--uts",
                "sh",
                "-c",
                &format!("hostname {h} && exec \"$@\""),
                "sh",
                BIN,
                "status",
                "--log-path",
            ])
            .arg(&c.log_path)
            .output()
            .unwrap(),
    };
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Two nodes, both inside their (long) rollout of iteration 1.
fn two_nodes_in_their_rollout() -> (TestCluster, Vec<NodeProc>) {
    let c = TestCluster::new(2, LONG_ROLLOUT);
    std::fs::create_dir_all(&c.log_path).unwrap();
    let nodes = c.spawn_all(&["--iterations", "1"]);
    for r in 0..2 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    (c, nodes)
}

#[test]
fn status_of_a_cluster_whose_nodes_were_all_killed_says_so() {
    let (c, mut nodes) = two_nodes_in_their_rollout();
    // While they run, both are alive, from here and from elsewhere.
    let (code, text) = status_from(&c, None);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("state: running"), "{text}");
    assert!(!text.contains("DEAD"), "{text}");
    let (code, text) = status_from(&c, Some("elsewhere"));
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("state: running") && text.contains("watched for"),
        "{text}"
    );

    for n in nodes.iter_mut() {
        n.signal(libc::SIGKILL);
        n.wait(LIMIT);
    }
    let (code, text) = status_from(&c, None);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("state: stopped (every node is gone"),
        "{text}"
    );
    assert_eq!(text.matches("DEAD").count(), 2, "{text}");
    // From another host the kernel cannot tell; the still heartbeats do.
    let (code, text) = status_from(&c, Some("elsewhere"));
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("state: stopped (every node is gone"),
        "{text}"
    );
    assert!(text.contains("watched for"), "{text}");
    wait_until(LIMIT, "the rollouts to be stopped", || {
        process_alive_with("sleep 60.73").is_empty()
    });
}

#[test]
fn status_of_a_cluster_with_one_node_killed_says_stalled_and_names_it() {
    let (c, mut nodes) = two_nodes_in_their_rollout();
    nodes[1].signal(libc::SIGKILL);
    nodes[1].wait(LIMIT);
    // Before rank 0 notices (dead-after is 3 s), status already knows.
    let (code, text) = status_from(&c, None);
    assert_eq!(code, 0, "{text}");
    if !text.contains("STOPPED") {
        assert!(text.contains("state: stalled (rank 1 gone"), "{text}");
    }
    nodes[0].signal(libc::SIGTERM);
    nodes[0].wait(LIMIT);
}

#[test]
fn recover_on_a_completed_run_says_it_is_complete() {
    let c = TestCluster::new(1, "[phases.rollout]\ncommand = \"echo '{}' > {output}\"\n");
    let mut n = c.spawn(0, &["--iterations", "2"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    let out = Command::new(BIN)
        .args(["recover", "--log-path"])
        .arg(&c.log_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("the run is complete: all 2 planned iteration(s) are done on every rank"),
        "{text}"
    );
    assert!(!text.contains("a restart resumes"), "{text}");
}

#[test]
fn recover_lists_only_the_work_this_run_has() {
    // Only a rollout command: no prepare, training or hand-off to redo.
    let c = TestCluster::new(1, "[phases.rollout]\ncommand = \"echo '{}' > {output}\"\n");
    std::fs::create_dir_all(&c.log_path).unwrap();
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "3"],
        &[("RL_NODE_TEST_HOLD_AT", "train-rollout@2".to_string())],
    );
    wait_until(LIMIT, "rank 0 to hold in iteration 2", || {
        n.stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    n.signal(libc::SIGKILL);
    n.wait(LIMIT);
    let out = Command::new(BIN)
        .args(["recover", "--log-path"])
        .arg(&c.log_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("a restart resumes at iteration 2"), "{text}");
    assert!(
        text.contains("redoes [rollout-train, aggregate-train]"),
        "{text}"
    );
    for absent in [
        "prepare",
        ", train",
        "handoff",
        "rollout-eval",
        "training is all-or-nothing",
    ] {
        assert!(!text.contains(absent), "{absent}:\n{text}");
    }
}

#[test]
fn restarting_a_completed_run_starts_no_empty_generation() {
    let c = TestCluster::new(2, "[phases.rollout]\ncommand = \"echo '{}' > {output}\"\n");
    let mut first = c.spawn_all(&["--iterations", "2"]);
    for n in first.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    let history = || std::fs::read_to_string(c.log_path.join(".rl-node/history.jsonl")).unwrap();
    let before = history();
    // The same commands again: both ranks say there is nothing to do and exit 0 at once.
    let mut again = c.spawn_all(&["--iterations", "2"]);
    for n in again.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
        assert!(
            n.stderr().contains("already completed iteration 2"),
            "{}",
            n.stderr()
        );
        assert!(!n.stderr().contains("error"), "{}", n.stderr());
    }
    assert_eq!(history(), before, "no new generation");
    let (_, text) = status(&c.log_path, false);
    assert!(
        text.contains("generation 1") && text.contains("state: completed"),
        "{text}"
    );
}

/// `status` and `status --json` of the same moment: the JSON's run state is `want`, the
/// text's `state:` line is the JSON's `state_detail`, and each rank's row of the text is
/// what the JSON says of it (state, host, pid, iteration, phase, culprit or stopped by).
fn assert_text_and_json_agree(c: &TestCluster, want: &str) -> serde_json::Value {
    let json = status(&c.log_path, true).1;
    let text = status(&c.log_path, false).1;
    let v: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(v["schema_version"], 1, "{json}");
    assert_eq!(v["state"], want, "{json}\n{text}");
    assert_eq!(v["generation"], v["gen"], "{json}");
    let detail = v["state_detail"].as_str().unwrap();
    assert!(
        text.contains(&format!("state: {detail}\n")),
        "{detail:?} in\n{text}"
    );
    assert!(
        text.contains(&format!("generation {}", v["generation"])),
        "{text}"
    );
    for r in v["ranks"].as_array().unwrap() {
        let state = match r["state"].as_str().unwrap() {
            "dead" => "DEAD".to_string(),
            s => s.to_string(),
        };
        let phase = match r["phase"].as_u64() {
            Some(n) => format!("{n} ({})", r["phase_name"].as_str().unwrap()),
            None => "-".into(),
        };
        let row = format!(
            "{:<5} {:<9} {:<20} {:>8} {:>5}  {:<22}",
            r["rank"].as_u64().unwrap(),
            state,
            r["host"].as_str().unwrap(),
            r["pid"].as_u64().unwrap(),
            r["iteration"].as_u64().unwrap(),
            phase
        );
        let line = text
            .lines()
            .find(|l| l.starts_with(&row))
            .unwrap_or_else(|| panic!("no row {row:?} in\n{text}\nfor {r}"));
        if r["culprit"] == true {
            assert!(line.contains("the culprit"), "{line}");
        }
        if let Some(by) = r["stopped_by"].as_str() {
            assert!(line.contains(&format!("stopped by {by}")), "{line}");
        }
    }
    v
}

#[test]
fn text_and_json_agree_in_every_state_of_a_run() {
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let c = TestCluster::new(
        2,
        &format!(
            "[phases.rollout]\ncommand = \"while [ ! -e {} ]; do sleep 0.1; done; echo '{{}}' > {{output}}\"\n",
            go.display()
        ),
    );
    std::fs::create_dir_all(&c.log_path).unwrap();
    let args = ["--iterations", "1"];
    // Rank 0 alone: the cluster forms.
    let mut first = c.spawn(0, &args);
    wait_until(LIMIT, "rank 0's record", || c.record(0).is_some());
    let v = assert_text_and_json_agree(&c, "starting");
    assert_eq!(v["ranks"][1]["state"], "vacant", "{v}");
    let mut second = c.spawn(1, &args);
    for r in 0..2 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    let v = assert_text_and_json_agree(&c, "running");
    assert_eq!(v["ranks"][0]["phase"], 1, "{v}");
    assert_eq!(v["ranks"][0]["phase_name"], "train-rollout", "{v}");
    // Rank 1 killed: stalled at once (before rank 0 notices, after dead-after)...
    second.signal(libc::SIGKILL);
    second.wait(LIMIT);
    let v = assert_text_and_json_agree(&c, "stalled");
    assert_eq!(v["ranks"][1]["state"], "dead", "{v}");
    // ...then stopped by rank 0, which names rank 1 the culprit.
    assert_ne!(first.wait(LIMIT), 0, "{}", first.stderr());
    let v = assert_text_and_json_agree(&c, "stopped");
    assert_eq!(v["ranks"][1]["culprit"], true, "{v}");
    assert_eq!(v["ranks"][0]["stopped_by"], "rank 1", "{v}");
    assert_eq!(v["ranks"][0]["state"], "failed", "{v}");
    // Restarted: rank 0 forms generation 2 and waits for rank 1.
    let mut first = c.spawn(0, &args);
    wait_until(LIMIT, "generation 2", || {
        c.record(0).is_some_and(|r| r["gen"] == 2)
    });
    let v = assert_text_and_json_agree(&c, "restarting");
    assert_eq!(v["generation"], 2, "{v}");
    let mut second = c.spawn(1, &args);
    std::fs::write(&go, "").unwrap();
    assert_eq!(first.wait(LIMIT), 0, "{}", first.stderr());
    assert_eq!(second.wait(LIMIT), 0, "{}", second.stderr());
    let v = assert_text_and_json_agree(&c, "completed");
    assert_eq!(v["ranks"][1]["state"], "done", "{v}");
}

/// `status --exit-code` after the nodes ended: the code of the run's end as the culprit
/// exited with it, where srun and sacct report the highest code of all nodes (the 3 of
/// the nodes the failure stopped): 1 for a failed command, 4 for a phase timeout, 0 for a
/// completed run, and 0 without the flag whatever the run's state.
#[test]
fn status_exit_code_is_the_culprits_not_the_victims() {
    let exit_code = |c: &TestCluster, flag: bool| {
        let mut cmd = Command::new(BIN);
        cmd.args(["status", "--log-path"]).arg(&c.log_path);
        if flag {
            cmd.arg("--exit-code");
        }
        let out = cmd.output().unwrap();
        assert!(!out.stdout.is_empty());
        out.status.code().unwrap_or(-1)
    };
    for (rollout, culprit, want) in [
        (
            "if [ {rank} = 1 ]; then exit 7; fi; echo '{}' > {output}",
            1,
            1,
        ),
        (
            "if [ {rank} = 1 ]; then sleep 30; fi; echo '{}' > {output}\"\ntimeout = \"1s",
            4,
            4,
        ),
        ("echo '{}' > {output}", 0, 0),
    ] {
        let c = TestCluster::new(2, &format!("[phases.rollout]\ncommand = \"{rollout}\"\n"));
        let mut nodes = c.spawn_all(&["--iterations", "1"]);
        let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
        let victims = if want == 0 {
            vec![0, 0]
        } else {
            vec![3, culprit]
        };
        assert_eq!(codes, victims, "{rollout}");
        assert_eq!(exit_code(&c, true), want, "{rollout}");
        assert_eq!(exit_code(&c, false), 0, "{rollout}");
    }
}

/// Elastic mode: rank 0 is killed mid-rollout; ranks 1 and 2 drop it and go on in
/// generation 2, which `status` shows as theirs: running, rank 1 coordinating, rank 0
/// `dropped` (when, why and where, from generation 1's abort and its last record), not
/// missing. Every node started again takes rank 0 back: generation 3's status and its
/// history say so, and the text and the JSON agree all along.
#[test]
fn status_of_an_elastic_run_names_the_dropped_rank_and_then_the_one_back() {
    let c = common::elastic::dropped_then_back(0, "600.5", |c| {
        let v = assert_text_and_json_agree(c, "running");
        assert_eq!(v["generation"], 2, "{v}");
        assert_eq!(v["members"], serde_json::json!([1, 2]), "{v}");
        assert_eq!(v["coordinator"], 1, "{v}");
        assert_eq!(v["dropped"], serde_json::json!([0]), "{v}");
        let r0 = &v["ranks"][0];
        assert_eq!(r0["state"], "dropped", "{v}");
        assert_eq!(r0["record_state"], serde_json::Value::Null, "{v}");
        assert_eq!(
            (&r0["iteration"], &r0["phase_name"]),
            (&serde_json::json!(2), &serde_json::json!("train-rollout")),
            "where rank 0 was when it died: {v}"
        );
        let d = &r0["dropped"];
        assert_eq!(
            (&d["lost_in"], &d["dropped_from"]),
            (&1.into(), &2.into()),
            "{v}"
        );
        assert!(
            d["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("heartbeat still for")),
            "{v}"
        );
        assert!([1, 2].contains(&d["detected_by"].as_u64().unwrap()), "{v}");
        assert!(
            d["at"]
                .as_str()
                .is_some_and(|t| chrono::DateTime::parse_from_rfc3339(t).is_ok()),
            "{v}"
        );
        let text = status(&c.log_path, false).1;
        for want in [
            "rank 1 (coordinator): ",
            "members: rank 1, rank 2 (2 of 3 nodes; rank 1 coordinates)",
            "dropped: rank 0 in generation 1 (declared lost by rank ",
            "; members rank 1, rank 2 (dropped rank 0)",
            "dropped in generation 1: heartbeat still for",
        ] {
            assert!(text.contains(want), "{want:?} in:\n{text}");
        }
        assert!(
            !text.contains("missing") && !text.contains("not joined"),
            "{text}"
        );
    });
    let v = assert_text_and_json_agree(&c, "completed");
    assert_eq!(v["generation"], 3, "{v}");
    assert_eq!(v["members"], serde_json::json!([0, 1, 2]), "{v}");
    assert_eq!(v["coordinator"], 0, "{v}");
    assert_eq!(v["dropped"], serde_json::json!([]), "{v}");
    assert_eq!(v["rejoined"], serde_json::json!([0]), "{v}");
    assert_eq!(v["ranks"][0]["state"], "done", "{v}");
    let history = v["history"].as_array().unwrap();
    let by_gen = |gen: u64| {
        history
            .iter()
            .find(|h| h["gen"] == gen)
            .unwrap_or_else(|| panic!("no generation {gen} in {v}"))
    };
    assert_eq!(by_gen(2)["dropped"], serde_json::json!([0]), "{v}");
    assert_eq!(by_gen(3)["rejoined"], serde_json::json!([0]), "{v}");
    let text = status(&c.log_path, false).1;
    for want in [
        "back in this generation: rank 0",
        "; members rank 0, rank 1, rank 2 (rank 0 back)",
    ] {
        assert!(text.contains(want), "{want:?} in:\n{text}");
    }
}
