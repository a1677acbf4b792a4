//! Happy paths with real node processes: every phase runs on the right ranks in the
//! right order, one node runs alone, partial `--rl-phase`s, status and show-config.

mod common;
use common::cluster::*;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Commands that append "iteration phase" to a per-rank trace and check their inputs.
const TRACE: &str = r#"
[phases.rollout]
command = "echo {iteration} rollout >> {log_path}/trace-{rank}; echo '{\"rank\": {rank}, \"model\": \"{model}\"}' > {output}"
[phases.eval]
command = "echo {iteration} eval >> {log_path}/trace-{rank}; echo '{\"eval\": {rank}}' > {output}"
[phases.prepare]
command = "echo {iteration} prepare >> {log_path}/trace-{rank}; wc -l < {trajectories} > {output}"
[phases.train]
command = "echo {iteration} train $NODE_RANK/$NNODES $MASTER_ADDR:$MASTER_PORT >> {log_path}/trace-{rank}; test -f $(dirname {trajectories})/prepared; mkdir -p {output}/checkpoint-{rank}; echo weights > {output}/checkpoint-{rank}/w"
[phases.handoff]
command = "echo {iteration} handoff >> {log_path}/trace-{rank}"
"#;

fn trace(c: &TestCluster, rank: u32) -> Vec<String> {
    fs::read_to_string(c.log_path.join(format!("trace-{rank}")))
        .unwrap_or_default()
        .lines()
        .map(|l| l.split(' ').take(2).collect::<Vec<_>>().join(" "))
        .collect()
}

fn expected(rank: u32, iterations: u64, eval_every: u64) -> Vec<String> {
    let mut v = vec![];
    for i in 1..=iterations {
        v.push(format!("{i} rollout"));
        if (i - 1) % eval_every == 0 {
            v.push(format!("{i} eval"));
        }
        if rank == 0 {
            v.push(format!("{i} prepare"));
        }
        v.push(format!("{i} train"));
        if rank == 0 {
            v.push(format!("{i} handoff"));
        }
    }
    v
}

#[test]
fn three_nodes_walk_every_phase_in_order() {
    let c = TestCluster::new(3, &format!("{TRACE}\n"));
    let mut nodes = c.spawn_all(&[
        "--iterations",
        "3",
        "--eval-interval",
        "2",
        "--rank-weights",
        "2,1,1",
    ]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {} failed:\n{}", n.rank, n.stderr());
    }
    for r in 0..3 {
        assert_eq!(
            trace(&c, r),
            expected(r, 3, 2),
            "rank {r} ran the wrong phases"
        );
    }
    // Rank 0's built-in aggregation merged every rank's committed shard, in rank order,
    // before prepare ran (prepare counted 3 records).
    for i in 1..=3u64 {
        let dir = c.log_path.join(format!("rollouts/iter-{i:04}"));
        let merged = fs::read_to_string(dir.join("train.jsonl")).unwrap();
        let ranks: Vec<i64> = merged
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["rank"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert_eq!(ranks, vec![0, 1, 2], "iteration {i}");
        assert_eq!(
            fs::read_to_string(dir.join("prepared")).unwrap().trim(),
            "3"
        );
        assert!(
            !dir.join("train/rank-1.partial.jsonl").exists(),
            "shard not committed"
        );
        // Eval ran (and was aggregated) only on iterations 1 and 3.
        assert_eq!(
            dir.join("eval.jsonl").exists(),
            i != 2,
            "eval on iteration {i}"
        );
    }
    // The hand-off of iteration 1 is the model every rank rolls out with in iteration 2.
    let it2 = fs::read_to_string(c.log_path.join("rollouts/iter-0002/train/rank-2.jsonl")).unwrap();
    assert!(it2.contains("models/iter-0001"), "{it2}");
    // Training got torchrun's variables with rank 0's published address.
    let t = fs::read_to_string(c.log_path.join("trace-2")).unwrap();
    assert!(t.contains("1 train 2/3 "), "{t}");
    assert!(t.contains(":29500"), "{t}");
    // Per-iteration, per-rank, per-phase logs exist.
    assert!(c.log_path.join("logs/iter-0003/rank-1.train.log").exists());
    // Barrier order is the same on every rank.
    let names = |r| -> Vec<String> {
        c.events(r)
            .iter()
            .filter(|e| e["event"] == "barrier")
            .map(|e| format!("{}:{}", e["iteration"], e["name"]))
            .collect()
    };
    assert_eq!(names(0), names(1));
    assert_eq!(names(0), names(2));
    assert!(names(0).contains(&"3:\"final-sync\"".to_string()));

    let (ok, text) = status(&c.log_path, false);
    assert!(ok && text.contains("state: completed"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&status(&c.log_path, true).1).unwrap();
    assert_eq!(v["ranks"].as_array().unwrap().len(), 3);
    assert_eq!(v["ranks"][2]["iteration"], 3);
    // Each node's last line counts what it did to the shared directory, by class: a
    // worker at least read rank 0's record, published its own (write, fsync, rename) and
    // appended its journal and events.
    for n in &nodes {
        let err = n.stderr();
        let line = err
            .lines()
            .find(|l| l.contains("shared-directory operations: "))
            .unwrap_or_else(|| panic!("rank {}: no counts in\n{err}", n.rank));
        let counts = line.split("shared-directory operations: ").nth(1).unwrap();
        let count = |class: &str| -> u64 {
            counts
                .trim_end_matches(')')
                .split(", ")
                .find_map(|p| p.strip_prefix(&format!("{class} ")))
                .map(|n| n.parse().unwrap())
                .unwrap_or(0)
        };
        for class in ["open", "stat", "read", "write", "rename", "fsync"] {
            assert!(count(class) > 0, "rank {}: no {class} in {line}", n.rank);
        }
        // Journal entries and published records are each fsynced; reads outnumber
        // publishes because every poll reads.
        assert!(count("read") > count("rename"), "rank {}: {line}", n.rank);
    }
}

#[test]
fn one_node_runs_the_same_phases_alone() {
    let c = TestCluster::new(1, TRACE);
    let mut n = c.spawn(0, &["--iterations", "2"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    assert_eq!(trace(&c, 0), expected(0, 2, 1));
    assert!(c.log_path.join("rollouts/iter-0002/train.jsonl").exists());
}

#[test]
fn rollout_and_update_run_their_halves() {
    let c = TestCluster::new(2, TRACE);
    let mut nodes = c.spawn_all(&[
        "--iterations",
        "2",
        "--rl-phase",
        "rollout",
        "--rollout-split",
        "train-only",
    ]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    assert_eq!(trace(&c, 0), vec!["1 rollout", "2 rollout"]);
    assert_eq!(trace(&c, 1), vec!["1 rollout", "2 rollout"]);
    // The update half then consumes what the rollout half aggregated.
    let mut nodes = c.spawn_all(&["--iterations", "2", "--rl-phase", "update"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    assert_eq!(
        trace(&c, 0)[2..],
        [
            "1 prepare",
            "1 train",
            "1 handoff",
            "2 prepare",
            "2 train",
            "2 handoff"
        ]
    );
    assert_eq!(trace(&c, 1)[2..], ["1 train", "2 train"]);
    assert_eq!(
        fs::read_to_string(c.log_path.join("rollouts/iter-0002/prepared"))
            .unwrap()
            .trim(),
        "2"
    );
}

#[test]
fn show_config_reports_sources() {
    let c = TestCluster::new(2, "");
    let out = std::process::Command::new(BIN)
        .args(["show-config", "--config"])
        .arg(&c.config)
        .args(["--eval-interval", "6"])
        .env("RL_NODE_TIMING_DEAD_AFTER", "90s")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("eval-interval = 6   # from --eval-interval"),
        "{text}"
    );
    assert!(
        text.contains("dead-after = \"90s\"   # from environment RL_NODE_TIMING_DEAD_AFTER"),
        "{text}"
    );
    assert!(text.contains("num-nodes = 2   # from "), "{text}");
}

#[test]
fn shipped_example_configs_load() {
    for example in [
        "examples/local/rl-node.toml",
        "examples/webgym/rl-node.toml",
    ] {
        let out = std::process::Command::new(BIN)
            .args(["show-config", "--config"])
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/").to_string() + example)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{example}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// examples/local/run.sh runs the binary `RL_NODE_BIN` names; exported for it, the
/// variable reaches the nodes too, which accept it (it is no configuration key).
#[test]
fn the_local_example_runs_with_rl_node_bin_exported() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    let mut cmd = std::process::Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/local/run.sh"
    ));
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.arg(&shared).env("RL_NODE_BIN", BIN).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let merged = std::fs::read_to_string(shared.join("rollouts/iter-0004/train.jsonl"))
        .unwrap_or_else(|e| panic!("{e}:\n{stdout}\n{stderr}"));
    // rank-weights = [2, 1, 1]: one record per unit of weight.
    assert_eq!(merged.lines().count(), 4, "{merged}");
}
