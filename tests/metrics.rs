//! `metrics.jsonl` with real node processes (issue 15, docs/metrics.md): one line per
//! completed iteration from rank 0, whose numbers match the files they summarise; no
//! duplicate line after a restart; one set of lines per cluster in a pipelined run.

mod common;
use common::cluster::*;
use serde_json::Value;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Each rank writes three records: two with a numeric `reward` (that depend on the
/// iteration and the rank), one without. Training writes a checkpoint to hand off.
const COMMANDS: &str = r#"
[phases.rollout]
command = '''printf '{"rank": {rank}, "reward": {iteration}.{rank}5}\n{"rank": {rank}, "reward": -{iteration}}\n{"rank": {rank}, "reward": "n/a"}\n' > {output}'''
[phases.train]
command = "mkdir -p {output}/checkpoint-1; echo {iteration} > {output}/checkpoint-1/w"
[observe]
metrics-fields = ["reward", "rank"]
"#;

/// The keys every line has (docs/metrics.md), besides the per-phase times.
const KEYS: &[&str] = &[
    "iteration",
    "run",
    "generation",
    "cluster/live_nodes",
    "t",
    "time/iteration_s",
    "barrier/wait_s",
    "rollout/records",
    "rollout/bytes",
    "rollout/raw",
    "rollout/budget",
    "rollout/failed",
    "rollout/retries",
    "model/version",
    "model/staleness",
    "eval/ran",
];

fn lines(c: &TestCluster) -> Vec<Value> {
    fs::read_to_string(c.log_path.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// The iteration of each line, in order.
fn iterations(lines: &[Value]) -> Vec<u64> {
    lines
        .iter()
        .map(|l| l["iteration"].as_u64().unwrap())
        .collect()
}

fn wait_all(nodes: &mut [NodeProc]) {
    for n in nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {} failed:\n{}", n.rank, n.stderr());
    }
}

/// Check one line against the merged train split of its iteration and its manifest.
fn check_line(c: &TestCluster, line: &Value) {
    for k in KEYS {
        assert!(line.get(*k).is_some(), "no {k} in {line}");
    }
    let it = line["iteration"].as_u64().unwrap();
    let dir = c.log_path.join(format!("rollouts/iter-{it:04}"));
    let merged = fs::read_to_string(dir.join("train.jsonl")).unwrap();
    let rewards: Vec<f64> = merged
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).unwrap()["reward"].as_f64())
        .collect();
    let skipped = merged.lines().count() - rewards.len();
    assert!(!rewards.is_empty() && skipped > 0);
    let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    let min = rewards.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = rewards.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let close = |k: &str, want: f64| {
        let got = line[k].as_f64().unwrap_or_else(|| panic!("{k} in {line}"));
        assert!((got - want).abs() < 1e-9, "{k}: {got} != {want} in {line}");
    };
    close("rollout/reward_mean", mean);
    close("rollout/reward_min", min);
    close("rollout/reward_max", max);
    assert_eq!(line["rollout/reward_skipped"], skipped as u64, "{line}");
    assert_eq!(line["rollout/rank_skipped"], 0, "{line}");
    let manifest: Value =
        serde_json::from_slice(&fs::read(dir.join("train.jsonl.manifest.json")).unwrap()).unwrap();
    assert_eq!(line["rollout/records"], manifest["records"], "{line}");
    assert_eq!(line["rollout/bytes"], manifest["bytes"], "{line}");
    assert_eq!(line["rollout/raw"], manifest["records"], "{line}");
    assert!(line["time/iteration_s"].as_f64().unwrap() > 0.0, "{line}");
    assert!(line["time/train_rollout_s"].as_f64().is_some(), "{line}");
}

#[test]
fn two_nodes_write_one_line_per_iteration_matching_the_merged_records() {
    let c = TestCluster::new(2, COMMANDS);
    let mut nodes = c.spawn_all(&["--iterations", "3", "--eval-interval", "2"]);
    wait_all(&mut nodes);
    let lines = lines(&c);
    assert_eq!(iterations(&lines), [1, 2, 3], "{lines:#?}");
    for l in &lines {
        check_line(&c, l);
        assert!(l.get("cluster").is_none(), "{l}");
        assert_eq!(l["cluster/live_nodes"], 2, "{l}");
        assert_eq!(
            l["model/version"],
            l["iteration"].as_u64().unwrap() - 1,
            "{l}"
        );
        assert_eq!(l["model/staleness"], 0, "{l}");
        // Per-rank rollouts: no planned budget, no item tally.
        assert_eq!(l["rollout/budget"], Value::Null, "{l}");
        assert_eq!(l["rollout/failed"], Value::Null, "{l}");
    }
    let evals: Vec<bool> = lines
        .iter()
        .map(|l| l["eval/ran"].as_bool().unwrap())
        .collect();
    assert_eq!(evals, [true, false, true]);
}

/// Rank 1's rollout is slow: rank 0 waits for it at rollout-complete. The spread over
/// ranks shows it (the slow rank's rollout time is the max, rank 0's the min, rank 0's
/// barrier wait covers it); the trainer's report becomes `trainer/*`; `train/*` says
/// what was trained.
#[test]
fn the_spread_over_ranks_and_the_trainers_numbers_are_in_each_line() {
    let commands = r#"
[phases.rollout]
command = '''if [ {rank} = 1 ]; then sleep 0.8; fi; printf '{"reward": 1}\n{"reward": 2}\n' > {output}'''
[phases.train]
command = '''mkdir -p {output}/checkpoint-1 && echo {iteration} > {output}/checkpoint-1/w && printf '{"train_loss": 0.{iteration}, "Epoch": 1, "note": "x"}' > {output}/all_results.json'''
"#;
    let c = TestCluster::new(2, commands);
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    wait_all(&mut nodes);
    let lines = lines(&c);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for l in &lines {
        let it = l["iteration"].as_u64().unwrap();
        let num = |k: &str| l[k].as_f64().unwrap_or_else(|| panic!("no {k} in {l}"));
        // The slow rank's rollout (>= 0.8 s) is the max; rank 0's (no sleep) the min.
        assert!(num("time/train_rollout_max_s") >= 0.8, "{l}");
        assert!(num("time/train_rollout_min_s") < 0.5, "{l}");
        let med = num("time/train_rollout_median_s");
        let mid = (num("time/train_rollout_min_s") + num("time/train_rollout_max_s")) / 2.0;
        assert!(
            (med - mid).abs() < 0.002,
            "median of two is their mean: {l}"
        );
        let waits = l["barrier/wait_by_rank_s"]
            .as_array()
            .expect("wait_by_rank");
        assert_eq!(waits.len(), 2, "{l}");
        // Rank 0 waited for rank 1's rollout; rank 1 hardly waited for anyone.
        assert!(waits[0].as_f64().unwrap() >= 0.5, "{l}");
        assert!(
            waits[1].as_f64().unwrap() < waits[0].as_f64().unwrap(),
            "{l}"
        );
        assert_eq!(l["train/ran"], true, "{l}");
        assert_eq!(l["train/samples_total"], 4, "{l}");
        assert_eq!(l["train/samples_total"], l["rollout/records"], "{l}");
        assert_eq!(l["train/failed_ranks"], 0, "{l}");
        assert_eq!(num("trainer/train_loss"), it as f64 / 10.0, "{l}");
        assert_eq!(l["trainer/epoch"], 1.0, "{l}");
        assert!(l.get("trainer/note").is_none(), "{l}");
    }
}

/// Both nodes are killed at the start of iteration 3 and rank 1's journal loses its
/// completion of iteration 2 (as if it had died before journaling it), so the restarted
/// cluster walks iteration 2 again, on rank 0 too: rank 0 must not write its line again.
#[test]
fn a_resumed_run_does_not_repeat_a_line() {
    let c = TestCluster::new(2, COMMANDS);
    let hold = [("RL_NODE_TEST_HOLD_AT", "sync-start@3".to_string())];
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| c.spawn_env(r, &c.log_path, &["--iterations", "3"], &hold))
        .collect();
    wait_until(LIMIT, "both nodes to hold in iteration 3", || {
        nodes.iter().all(|n| n.stderr().contains("holding here"))
    });
    for n in &mut nodes {
        n.signal(libc::SIGKILL);
        n.wait(LIMIT);
    }
    assert_eq!(lines(&c).len(), 2);
    let journal = c.log_path.join(".rl-node/journal/rank-1.jsonl");
    let text = fs::read_to_string(&journal).unwrap();
    let kept: Vec<&str> = text.lines().collect();
    let last: Value = serde_json::from_str(kept[kept.len() - 1]).unwrap();
    assert_eq!(last["iteration"], 2, "{last}");
    fs::write(&journal, format!("{}\n", kept[..kept.len() - 1].join("\n"))).unwrap();

    let mut nodes = c.spawn_all(&["--iterations", "3"]);
    wait_all(&mut nodes);
    assert!(
        nodes[0].stderr().contains("iteration 2 complete"),
        "iteration 2 was not walked again:\n{}",
        nodes[0].stderr()
    );
    let lines = lines(&c);
    assert_eq!(iterations(&lines), [1, 2, 3], "{lines:#?}");
    for l in &lines {
        check_line(&c, l);
    }
    // Each line says which start of the cluster wrote it.
    let gens: Vec<u64> = lines
        .iter()
        .map(|l| l["generation"].as_u64().unwrap())
        .collect();
    assert_eq!(gens, [1, 1, 2], "{lines:#?}");
}

/// Every command gets the run's id, `{run_id}` and `RL_NODE_RUN_ID` (to group a
/// trainer's own tracking with the run's), the same as metrics.jsonl's `run` and the
/// cluster record's.
#[test]
fn commands_get_the_run_id_of_the_metrics_lines() {
    let seen = tempfile::tempdir().unwrap();
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"echo '{{}}' > {{output}}\"\n\
             [phases.train]\ncommand = \"echo {{run_id}} $RL_NODE_RUN_ID >> {}/seen\"\n",
            seen.path().display()
        ),
    );
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    wait_all(&mut nodes);
    let run = lines(&c)[0]["run"].as_str().unwrap().to_string();
    let cluster: Value =
        serde_json::from_slice(&fs::read(c.log_path.join(".rl-node/cluster.json")).unwrap())
            .unwrap();
    assert_eq!(cluster["run_id"], run.as_str());
    let text = fs::read_to_string(seen.path().join("seen")).unwrap();
    assert_eq!(text, format!("{run} {run}\n{run} {run}\n"));
}

/// A pipelined run of one rollout node and one update node: each cluster's rank 0 writes
/// its own line per iteration, with `cluster`.
#[test]
fn a_pipelined_run_has_lines_from_both_clusters() {
    let extra = format!("{COMMANDS}\n[pipeline]\nstaleness = 1\n");
    let c = TestCluster::pipelined(&extra);
    let mut nodes = c.spawn_rollout_and_update(3);
    wait_all(&mut nodes);
    let lines = lines(&c);
    for side in ["rollout", "update"] {
        let its: Vec<u64> = lines
            .iter()
            .filter(|l| l["cluster"] == side)
            .map(|l| l["iteration"].as_u64().unwrap())
            .collect();
        assert_eq!(its, [1, 2, 3], "{side}: {lines:#?}");
    }
    assert_eq!(lines.len(), 6, "{lines:#?}");
    for l in lines.iter().filter(|l| l["cluster"] == "rollout") {
        check_line(&c, l);
        assert!(l["model/staleness"].as_u64().unwrap() <= 1, "{l}");
    }
    for l in lines.iter().filter(|l| l["cluster"] == "update") {
        assert!(l["time/training_s"].as_f64().is_some(), "{l}");
        assert_eq!(l["rollout/records"], Value::Null, "{l}");
    }
}
