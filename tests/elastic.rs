//! Elastic mode (`[cluster] min-nodes` below `num-nodes`) with real processes: three
//! nodes, one killed with SIGKILL (its node process and its commands, like a machine that
//! dies) in the middle of iteration 2's rollout. The two survivors drop it after
//! `timing.dead-after`, form the next generation by themselves in the same processes, one
//! of them stands in for the dead rank's rollout (`{rank}` = the dead rank, so its shard
//! is still produced and merged), and they finish every iteration and exit 0. When rank 0
//! is the one killed, rank 1 coordinates (merge, hand-off, metrics.jsonl, whose lines
//! count the live nodes). Without `min-nodes` the same death still stops the cluster,
//! every survivor exiting 3 and naming the dead rank.

mod common;

use common::cluster::*;
use common::elastic::*;
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};

fn iter_dir(c: &TestCluster, it: u64) -> PathBuf {
    c.log_path.join(format!("rollouts/iter-{it:04}"))
}

/// The (rank, iteration, index) of each record of the JSON lines file `path`, in order.
fn records(path: &Path) -> Vec<(u64, u64, u64)> {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{}: {l:?}: {e}", path.display()));
            let field = |k: &str| {
                v[k].as_u64()
                    .unwrap_or_else(|| panic!("{}: no {k} in {l}", path.display()))
            };
            (field("rank"), field("it"), field("i"))
        })
        .collect()
}

/// What rank `rank`'s rollout writes in iteration `it`.
fn expected_shard(rank: u64, it: u64) -> Vec<(u64, u64, u64)> {
    (1..=PER_RANK).map(|i| (rank, it, i)).collect()
}

/// Every iteration's shards and merged train file hold exactly what the three ranks'
/// rollouts write, each record once (the dead rank's included, from its stand-in), and
/// the last hand-off published the last iteration's training.
fn assert_complete(c: &TestCluster) {
    for it in 1..=ITERATIONS {
        let dir = iter_dir(c, it);
        for r in 0..3u64 {
            let shard = dir.join(format!("train/rank-{r}.jsonl"));
            assert_eq!(
                records(&shard),
                expected_shard(r, it),
                "iteration {it}: {}",
                shard.display()
            );
        }
        let merged = dir.join("train.jsonl");
        let mut got = records(&merged);
        got.sort_unstable();
        let want: Vec<_> = (0..3).flat_map(|r| expected_shard(r, it)).collect();
        assert_eq!(
            got,
            want,
            "iteration {it}: {} must hold the 9 records of ranks 0, 1, 2, each once",
            merged.display()
        );
    }
    let models = c.log_path.join("models");
    let latest = fs::read_to_string(models.join("LATEST"))
        .unwrap_or_else(|e| panic!("{}: {e}", models.join("LATEST").display()));
    assert_eq!(latest.trim(), format!("iter-{ITERATIONS:04}"));
    let latest = models.join(latest.trim());
    rl_node::checkpoint::verify(&latest, &mut || {})
        .unwrap_or_else(|e| panic!("{}: {e}", latest.display()));
    assert_eq!(
        fs::read_to_string(latest.join("weights.jsonl")).unwrap(),
        fs::read_to_string(iter_dir(c, ITERATIONS).join("train.jsonl")).unwrap(),
        "the last checkpoint was trained on the last iteration's trajectories"
    );
}

/// Journal entries of `rank` for (`iteration`, `item`).
fn journaled(c: &TestCluster, rank: u32, iteration: u64, item: &str) -> Vec<Value> {
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

/// Kills `victim` mid-rollout of iteration `KILLED_IN` in an elastic cluster and checks
/// that the survivors finish the run with every rank's trajectories.
fn survivors_finish(victim: u32, sleep: &str) -> TestCluster {
    let (c, marker) = cluster(victim, sleep, Some(2));
    let nodes = survive_a_loss(&c, &marker, victim, sleep);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    for n in nodes.iter().filter(|n| n.rank != victim) {
        let err = n.stderr();
        assert!(
            err.contains(&format!("rank {victim}")),
            "rank {} must say what became of rank {victim}:\n{err}",
            n.rank
        );
    }
    assert_complete(&c);
    c
}

#[test]
fn a_worker_killed_mid_rollout_is_dropped_and_the_survivors_finish() {
    let c = survivors_finish(2, "600.1");
    // Rank 0 stayed the coordinator: it merged every iteration.
    for it in 1..=ITERATIONS {
        assert_eq!(
            journaled(&c, 0, it, "aggregate-train").len(),
            1,
            "rank 0 merged iteration {it} once"
        );
    }
}

#[test]
fn rank_0_killed_mid_rollout_moves_the_coordinator() {
    let c = survivors_finish(0, "600.2");
    // Rank 0 merged iteration 1; after its death rank 1, the lowest live rank, merged the
    // others (rank 0's rollout of iteration 2 never finished, so it could not have).
    assert_eq!(journaled(&c, 0, 1, "aggregate-train").len(), 1);
    for it in KILLED_IN..=ITERATIONS {
        assert!(
            journaled(&c, 0, it, "aggregate-train").is_empty(),
            "the dead rank 0 merged iteration {it}"
        );
        assert_eq!(
            journaled(&c, 1, it, "aggregate-train").len(),
            1,
            "rank 1 merged iteration {it} once"
        );
        assert!(
            journaled(&c, 2, it, "aggregate-train").is_empty(),
            "rank 2 merged iteration {it}"
        );
    }
    // metrics.jsonl, written by the coordinator of each generation, says how many nodes
    // each iteration ran on, and keeps each rank's barrier wait under its rank.
    let metrics = fs::read_to_string(c.log_path.join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let seen: Vec<(u64, u64, u64)> = lines
        .iter()
        .map(|l| {
            let n = |k: &str| l[k].as_u64().unwrap_or_else(|| panic!("no {k} in {l}"));
            (n("iteration"), n("generation"), n("cluster/live_nodes"))
        })
        .collect();
    assert_eq!(seen, [(1, 1, 3), (2, 2, 2), (3, 2, 2)], "{metrics}");
    for l in &lines[1..] {
        let waits = l["barrier/wait_by_rank_s"].as_array().unwrap();
        assert_eq!(waits.len(), 3, "{l}");
        assert!(
            waits[0].is_null(),
            "the dropped rank 0 reported nothing: {l}"
        );
        assert!(waits[1].is_number() && waits[2].is_number(), "{l}");
    }
}

#[test]
fn without_min_nodes_a_death_still_stops_the_cluster() {
    let victim = 2;
    let sleep = "600.3";
    let (c, marker) = cluster(victim, sleep, None);
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    kill_machine(&mut nodes[victim as usize], &marker, sleep);
    for n in nodes.iter_mut().filter(|n| n.rank != victim) {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 3, "rank {} must exit 3 (a peer died):\n{err}", n.rank);
        assert!(
            err.contains(&format!("error: rank {}: ", n.rank)),
            "rank {}:\n{err}",
            n.rank
        );
        assert!(
            err.contains(&format!("rank {victim} on ")) && err.contains("is dead"),
            "rank {} must name rank {victim} as dead:\n{err}",
            n.rank
        );
    }
    // Nothing was merged after the death, and no later iteration started.
    assert!(iter_dir(&c, 1).join("train.jsonl").exists());
    assert!(!iter_dir(&c, KILLED_IN).join("train.jsonl").exists());
    assert!(!iter_dir(&c, KILLED_IN)
        .join(format!("train/rank-{victim}.jsonl"))
        .exists());
    assert!(!iter_dir(&c, KILLED_IN + 1).exists());
}

/// A training spread over the nodes (torchrun) fails on the survivors a moment after one
/// node dies, long before the death is declared. In elastic mode each survivor holds its
/// failure for dead-after: the death is found meanwhile, and the two survivors redo that
/// iteration's training by themselves, with `NNODES` = 2 and `NODE_RANK` their position.
#[test]
fn a_training_failed_by_a_death_is_redone_by_the_survivors() {
    let c = TestCluster::new(3, "");
    let marker = c.dir.path().join("rank-2-train-started");
    let m = marker.display();
    let phases = format!(
        r#"
[phases.rollout]
command = '''for i in $(seq 1 {PER_RANK}); do echo '{{"rank": {{rank}}, "it": {{iteration}}, "i": '$i'}}'; done > {{output}}'''

[phases.train]
command = '''if [ {{gen}} = 1 ] && [ {{iteration}} = {KILLED_IN} ]; then if [ {{rank}} = 2 ]; then touch '{m}'; sleep 600.4; else sleep 2; echo 'lost a peer' >&2; exit 1; fi; fi; mkdir -p {{output}}/checkpoint-1 && cat {{trajectories}} > {{output}}/checkpoint-1/weights.jsonl && echo "$NNODES $NODE_RANK {{live_ranks}} {{num_live}}" > {{output}}/nodes-{{rank}}.txt'''
"#
    );
    let text = fs::read_to_string(&c.config).unwrap();
    fs::write(
        &c.config,
        text.replacen("[cluster]\n", "[cluster]\nmin-nodes = 2\n", 1) + &phases,
    )
    .unwrap();
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    kill_machine(&mut nodes[2], &marker, "600.4");
    for n in nodes.iter_mut().filter(|n| n.rank != 2) {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 0, "rank {}:\n{err}", n.rank);
        assert!(
            err.contains("watching the other nodes for"),
            "rank {} held its training failure:\n{err}",
            n.rank
        );
    }
    // The redone training of the killed iteration, in generation 2, by ranks 0 and 1.
    let out = c.log_path.join(format!("train/iter-{KILLED_IN:04}/gen-2"));
    for (rank, line) in [(0, "2 0 0,1 2"), (1, "2 1 0,1 2")] {
        let p = out.join(format!("nodes-{rank}.txt"));
        assert_eq!(
            fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                .trim(),
            line,
            "{}",
            p.display()
        );
    }
    let latest = fs::read_to_string(c.log_path.join("models/LATEST")).unwrap();
    assert_eq!(latest.trim(), format!("iter-{ITERATIONS:04}"));
    // Every iteration's merged file still holds every rank's records once (a stand-in
    // ran rank 2's rollout of iteration 3).
    for it in 1..=ITERATIONS {
        let mut got = records(&iter_dir(&c, it).join("train.jsonl"));
        got.sort_unstable();
        let want: Vec<_> = (0..3).flat_map(|r| expected_shard(r, it)).collect();
        assert_eq!(got, want, "iteration {it}");
    }
}

/// `min-nodes` is checked at start, before anything is written: more than `num-nodes`,
/// or with what elastic mode does not cover yet, is refused with exit 2 naming the key.
#[test]
fn min_nodes_out_of_reach_or_with_task_files_is_refused_at_start() {
    let c = TestCluster::new(3, "");
    let text = fs::read_to_string(&c.config).unwrap();
    let tasks = c.dir.path().join("tasks.jsonl");
    fs::write(&tasks, "{\"id\": \"t1\"}\n").unwrap();
    for (keys, says) in [
        ("min-nodes = 4\n", "more than num-nodes"),
        ("min-nodes = 2\n", "task files"),
    ] {
        let mut cfg = text.replacen("[cluster]\n", &format!("[cluster]\n{keys}"), 1);
        if says == "task files" {
            cfg += &format!("\n[tasks]\ntrain = '{}'\n", tasks.display());
        }
        fs::write(&c.config, cfg).unwrap();
        let mut n = c.spawn(0, &["--iterations", "1"]);
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 2, "{keys}:\n{err}");
        assert!(
            err.contains("cluster.min-nodes") && err.contains(says),
            "{keys}:\n{err}"
        );
        assert!(
            !c.log_path.join(".rl-node/cluster.json").exists(),
            "nothing is written before the refusal"
        );
    }
}
