//! `[phases.rollout] on-failure = "merge-survivors"` (and eval's): a rank whose rollout
//! command fails commits no shard, and rank 0 merges the other ranks' shards, naming the
//! failed ranks in the manifest, as webgym's run.sh did. Every rank failing still stops
//! the cluster, a restart neither reruns a journaled failure nor merges twice, and values
//! that cannot apply are refused at start. Real `rl-node` processes over a temporary
//! shared directory.

mod common;

use common::cluster::*;
use serde_json::Value;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

/// Generous: every run here takes a few seconds.
const LIMIT: Duration = Duration::from_secs(90);

const MERGE_SURVIVORS: &str = "on-failure = \"merge-survivors\"";

/// A rollout that records each attempt (`seen/rollout-I-R`, one `gG` line per
/// generation), and fails with exit 7 when `fails` (a shell condition) holds, after
/// writing a line to `{output}` and one a user would look for in its log.
fn rollout(fails: &str, keys: &str) -> String {
    format!(
        r#"
[phases.rollout]
command = '''echo g{{gen}} >> {{log_path}}/seen/rollout-{{iteration}}-{{rank}}; if {fails}; then echo '{{"rank": {{rank}}, "partial": true}}' > {{output}}; echo 'browser crashed on rank {{rank}}'; exit 7; fi; echo '{{"rank": {{rank}}, "iteration": {{iteration}}}}' > {{output}}'''
{keys}
"#
    )
}

const RANK_1_IN_ITERATION_1: &str = "[ {iteration} = 1 ] && [ {rank} = 1 ]";

fn cluster(n: u32, config: &str) -> TestCluster {
    let c = TestCluster::new(n, config);
    fs::create_dir_all(c.log_path.join("seen")).unwrap();
    c
}

fn iter_dir(c: &TestCluster, it: u64) -> PathBuf {
    c.log_path.join(format!("rollouts/iter-{it:04}"))
}

/// The `rank` of each record of iteration `it`'s merged `split`, in order.
fn merged_ranks(c: &TestCluster, it: u64, split: &str) -> Vec<u64> {
    let p = iter_dir(c, it).join(format!("{split}.jsonl"));
    fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["rank"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

fn manifest(c: &TestCluster, it: u64, split: &str) -> Value {
    let p = iter_dir(c, it).join(format!("{split}.jsonl.manifest.json"));
    serde_json::from_slice(&fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

/// Journal entries of `rank` for (`iteration`, `item`).
fn entries(c: &TestCluster, rank: u32, iteration: u64, item: &str) -> Vec<Value> {
    fs::read_to_string(
        c.log_path
            .join(format!(".rl-node/journal/rank-{rank}.jsonl")),
    )
    .unwrap_or_default()
    .lines()
    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    .filter(|e| e["iteration"].as_u64() == Some(iteration) && e["item"] == item)
    .collect()
}

/// The generations that ran rank `rank`'s rollout of `iteration`.
fn attempts(c: &TestCluster, iteration: u64, rank: u32) -> String {
    fs::read_to_string(c.log_path.join(format!("seen/rollout-{iteration}-{rank}")))
        .unwrap_or_default()
}

fn wait_ok(nodes: &mut [NodeProc], context: &str) {
    for n in nodes.iter_mut() {
        assert_eq!(
            n.wait(LIMIT),
            0,
            "{context}: rank {} failed:\n{}",
            n.rank,
            n.stderr()
        );
    }
}

/// The manifest's entry of `rank` says it failed with exit code 7.
fn assert_failed_in_manifest(m: &Value, rank: usize) {
    let r = &m["ranks"][rank];
    assert_eq!(r["status"], "failed", "{m}");
    let reason = r["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("failed with exit code 7"), "{m}");
    assert!(reason.contains(&format!("rank-{rank}.")), "{m}");
    assert_eq!(m["failed_ranks"], serde_json::json!([rank]), "{m}");
    assert_eq!(m["complete"], false, "{m}");
}

#[test]
fn a_failed_rollout_is_left_out_and_the_survivors_are_merged() {
    let c = cluster(3, &rollout(RANK_1_IN_ITERATION_1, MERGE_SURVIVORS));
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    wait_ok(&mut nodes, "merge-survivors");

    // Iteration 1 merged ranks 0 and 2, each once; rank 1's partial output stays.
    assert_eq!(merged_ranks(&c, 1, "train"), [0, 2]);
    assert!(!iter_dir(&c, 1).join("train/rank-1.jsonl").exists());
    let partial = iter_dir(&c, 1).join("train/rank-1.partial.g1.jsonl");
    assert!(
        fs::read_to_string(&partial).unwrap().contains("partial"),
        "{}",
        partial.display()
    );
    let m = manifest(&c, 1, "train");
    assert_failed_in_manifest(&m, 1);
    assert_eq!(m["records"], 2, "{m}");
    // Iteration 2 merged every rank.
    assert_eq!(merged_ranks(&c, 2, "train"), [0, 1, 2]);
    assert_eq!(manifest(&c, 2, "train")["complete"], true);

    // Rank 1 journaled its rollout as failed; rank 0's merge names it.
    let r = entries(&c, 1, 1, "rollout-train");
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["failed"], "exit code 7");
    assert!(entries(&c, 1, 2, "rollout-train")[0]
        .get("failed")
        .is_none());
    let a = entries(&c, 0, 1, "aggregate-train");
    assert_eq!(a.len(), 1, "{a:?}");
    assert!(
        a[0]["note"]
            .as_str()
            .unwrap_or_default()
            .contains("rank 1 (exit code 7)"),
        "{a:?}"
    );
    assert!(entries(&c, 0, 2, "aggregate-train")[0]
        .get("note")
        .is_none());

    // The warning on rank 1: the usual failure message with its log and last lines.
    let e1 = nodes[1].stderr();
    assert!(e1.contains("[rank 1] warning: rank 1 on "), "{e1}");
    assert!(
        e1.contains("failed in phase 1 (train-rollout) of iteration 1: the rollout command failed with exit code 7"),
        "{e1}"
    );
    assert!(e1.contains("logs/iter-0001/rank-1.rollout.log"), "{e1}");
    assert!(e1.contains("| browser crashed on rank 1"), "{e1}");
    assert!(e1.contains("merge-survivors"), "{e1}");
    assert!(!e1.contains("error:"), "{e1}");
    // Rank 0's line.
    let e0 = nodes[0].stderr();
    let line = "iteration 1: merged 2 of 3 ranks' train shards; rank 1's rollout failed (exit code 7), log: ";
    assert!(e0.contains(line), "{e0}");
    assert!(e0.contains("logs/iter-0001/rank-1.rollout.log"), "{e0}");
    assert!(!e0.contains("iteration 2: merged"), "{e0}");

    // The events and metrics.jsonl.
    let failed: Vec<Value> = c
        .events(1)
        .into_iter()
        .filter(|e| e["event"] == "rollout-failed")
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        (
            &failed[0]["iteration"],
            &failed[0]["failed"],
            &failed[0]["split"]
        ),
        (&1.into(), &"exit code 7".into(), &"train".into())
    );
    let merged: Vec<Value> = c
        .events(0)
        .into_iter()
        .filter(|e| e["event"] == "survivors-merged")
        .collect();
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert_eq!(
        (&merged[0]["merged"], &merged[0]["ranks"]),
        (&2.into(), &3.into())
    );
    let metrics: Vec<Value> = fs::read_to_string(c.log_path.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let counts: Vec<&Value> = metrics.iter().map(|l| &l["rollout/failed_ranks"]).collect();
    assert_eq!(counts, [&Value::from(1), &Value::from(0)], "{metrics:?}");
}

#[test]
fn by_default_a_failed_rollout_still_stops_the_cluster() {
    let c = cluster(3, &rollout(RANK_1_IN_ITERATION_1, ""));
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    assert_eq!(codes, [3, 1, 3], "{}", nodes[1].stderr());
    assert!(
        nodes[1].stderr().contains("error: rank 1: rank 1 on "),
        "{}",
        nodes[1].stderr()
    );
    assert!(!iter_dir(&c, 1).join("train.jsonl").exists());
    assert!(entries(&c, 1, 1, "rollout-train").is_empty());
}

#[test]
fn when_every_rollout_fails_the_cluster_stops() {
    let c = cluster(3, &rollout("true", MERGE_SURVIVORS));
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    assert_eq!(codes, [1, 3, 3], "{}", nodes[0].stderr());
    let said = "no rank's train rollout succeeded (phases.rollout.on-failure = \"merge-survivors\"): rank 0 (exit code 7, log: ";
    for n in &nodes {
        let e = n.stderr();
        assert!(e.contains(said), "rank {}: {e}", n.rank);
        assert!(e.contains("there is nothing to merge or train on"), "{e}");
    }
    assert!(!iter_dir(&c, 1).join("train.jsonl").exists());
    assert!(entries(&c, 0, 1, "aggregate-train").is_empty());
    // Each rank's failure was its own and journaled; none was merged.
    for r in 0..3 {
        assert_eq!(
            entries(&c, r, 1, "rollout-train")[0]["failed"],
            "exit code 7"
        );
    }
}

/// Rank 0 is killed after every rank journaled its rollout (rank 1's as failed) and
/// before the merge: the restart reruns no rollout and merges the survivors once.
#[test]
fn a_restart_before_the_merge_reruns_no_failed_rollout_and_merges_once() {
    let c = cluster(3, &rollout(RANK_1_IN_ITERATION_1, MERGE_SURVIVORS));
    let hold = [("RL_NODE_TEST_HOLD_AT", "aggregate-train@1".to_string())];
    let args = ["--iterations", "1"];
    let mut nodes = vec![
        c.spawn_env(0, &c.log_path, &args, &hold),
        c.spawn(1, &args),
        c.spawn(2, &args),
    ];
    wait_until(LIMIT, "rank 0 to hold before the merge", || {
        nodes[0].stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    assert_eq!(
        entries(&c, 1, 1, "rollout-train")[0]["failed"],
        "exit code 7"
    );
    nodes[0].signal(libc::SIGKILL);
    assert_eq!(nodes[0].wait(LIMIT), 137);
    for n in &mut nodes[1..] {
        assert_eq!(n.wait(LIMIT), 3, "{}", n.stderr());
    }
    assert!(!iter_dir(&c, 1).join("train.jsonl").exists());
    drop(nodes);

    let mut nodes = c.spawn_all(&args);
    wait_ok(&mut nodes, "restart");
    for r in 0..3 {
        assert_eq!(attempts(&c, 1, r), "g1\n", "rank {r}'s rollout was rerun");
        assert_eq!(entries(&c, r, 1, "rollout-train").len(), 1, "rank {r}");
    }
    let e1 = nodes[1].stderr();
    assert!(
        e1.contains("iteration 1: rollout-train failed (exit code 7) before this generation began and the run went on without it; not redone"),
        "{e1}"
    );
    assert_eq!(merged_ranks(&c, 1, "train"), [0, 2]);
    assert_failed_in_manifest(&manifest(&c, 1, "train"), 1);
    assert_eq!(entries(&c, 0, 1, "aggregate-train").len(), 1);
    assert!(nodes[0].stderr().contains(
        "iteration 1: merged 2 of 3 ranks' train shards; rank 1's rollout failed (exit code 7)"
    ));
}

/// Rank 1 crashes after its rollout failed and before it journaled that: a failure the
/// journal does not hold is redone (and here succeeds), and every rank is merged.
#[test]
fn a_failed_rollout_that_was_not_journaled_is_redone() {
    let fails = "[ {iteration} = 1 ] && [ {rank} = 1 ] && [ {gen} = 1 ]";
    let c = cluster(3, &rollout(fails, MERGE_SURVIVORS));
    let args = ["--iterations", "1"];
    let crash = [(
        "RL_NODE_TEST_CRASH_AT",
        "after-commit:rollout-train@1".to_string(),
    )];
    let mut nodes = vec![
        c.spawn(0, &args),
        c.spawn_env(1, &c.log_path, &args, &crash),
        c.spawn(2, &args),
    ];
    assert_eq!(nodes[1].wait(LIMIT), 134, "{}", nodes[1].stderr());
    for r in [0, 2] {
        assert_eq!(nodes[r].wait(LIMIT), 3, "{}", nodes[r].stderr());
    }
    assert!(entries(&c, 1, 1, "rollout-train").is_empty());
    drop(nodes);

    let mut nodes = c.spawn_all(&args);
    wait_ok(&mut nodes, "restart");
    assert_eq!(attempts(&c, 1, 1), "g1\ng2\n");
    assert_eq!(merged_ranks(&c, 1, "train"), [0, 1, 2]);
    assert!(entries(&c, 1, 1, "rollout-train")[0]
        .get("failed")
        .is_none());
    assert_eq!(manifest(&c, 1, "train")["complete"], true);
}

#[test]
fn an_eval_that_fails_on_one_rank_is_merged_without_it() {
    let eval = format!(
        r#"
[phases.eval]
command = '''if [ {{rank}} = 1 ]; then echo 'eval crashed'; exit 7; fi; echo '{{"rank": {{rank}}}}' > {{output}}'''
{MERGE_SURVIVORS}
"#
    );
    let c = cluster(2, &format!("{}{eval}", rollout("false", "")));
    let mut nodes = c.spawn_all(&["--iterations", "1", "--eval-interval", "1"]);
    wait_ok(&mut nodes, "eval merge-survivors");
    assert_eq!(merged_ranks(&c, 1, "train"), [0, 1]);
    assert_eq!(merged_ranks(&c, 1, "eval"), [0]);
    assert_failed_in_manifest(&manifest(&c, 1, "eval"), 1);
    assert_eq!(
        entries(&c, 1, 1, "rollout-eval")[0]["failed"],
        "exit code 7"
    );
    let e0 = nodes[0].stderr();
    assert!(
        e0.contains("iteration 1: merged 1 of 2 ranks' eval shards; rank 1's eval failed (exit code 7), log: "),
        "{e0}"
    );
    assert!(e0.contains("logs/iter-0001/rank-1.eval.log"), "{e0}");
}

#[test]
fn on_failure_values_that_cannot_apply_are_refused_at_start() {
    let c = cluster(1, &rollout("false", ""));
    let unknown = [("RL_NODE_PHASES_ROLLOUT_ON_FAILURE", "retry".to_string())];
    let mut n = c.spawn_env(0, &c.log_path, &["--iterations", "1"], &unknown);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    assert!(
        n.stderr().contains("phases.rollout.on-failure (from environment RL_NODE_PHASES_ROLLOUT_ON_FAILURE): `retry` is not \"stop\""),
        "{}",
        n.stderr()
    );

    let tasks = c.dir.path().join("tasks.jsonl");
    fs::write(&tasks, "{\"id\": 1}\n{\"id\": 2}\n").unwrap();
    let per_task = [
        ("RL_NODE_TASKS_TRAIN", tasks.display().to_string()),
        ("RL_NODE_WORK_MODE", "per-task".to_string()),
        (
            "RL_NODE_PHASES_ROLLOUT_ON_FAILURE",
            "merge-survivors".to_string(),
        ),
    ];
    let mut n = c.spawn_env(0, &c.log_path, &["--iterations", "1"], &per_task);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    let e = n.stderr();
    assert!(
        e.contains("phases.rollout.on-failure (from environment RL_NODE_PHASES_ROLLOUT_ON_FAILURE): \"merge-survivors\" applies to one command per rank, but work.mode is \"per-task\""),
        "{e}"
    );
    assert!(e.contains("use work.max-failed-fraction"), "{e}");
    assert!(!c.log_path.join(".rl-node").exists());
}
