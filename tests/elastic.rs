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
    configure(&c, Some(2), &phases);
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
/// or with what elastic mode does not cover yet (a dynamic rollout), is refused with exit
/// 2 naming the key.
#[test]
fn min_nodes_out_of_reach_or_with_a_dynamic_rollout_is_refused_at_start() {
    let c = TestCluster::new(3, "");
    let text = fs::read_to_string(&c.config).unwrap();
    let tasks = c.dir.path().join("tasks.jsonl");
    fs::write(&tasks, "{\"id\": \"t1\"}\n").unwrap();
    for (keys, says) in [
        ("min-nodes = 4\n", "more than num-nodes"),
        ("min-nodes = 2\n", "work.strategy = \"dynamic\""),
    ] {
        let mut cfg = text.replacen("[cluster]\n", &format!("[cluster]\n{keys}"), 1);
        if says.contains("dynamic") {
            cfg += &format!(
                "\n[tasks]\ntrain = '{}'\n[work]\nmode = \"per-task\"\nstrategy = \"dynamic\"\n",
                tasks.display()
            );
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

/// Every iteration's merged train file holds the records of every rank once.
fn assert_merged_complete(c: &TestCluster, iterations: u64) {
    for it in 1..=iterations {
        let merged = iter_dir(c, it).join("train.jsonl");
        let mut got = records(&merged);
        got.sort_unstable();
        let want: Vec<_> = (0..3).flat_map(|r| expected_shard(r, it)).collect();
        assert_eq!(got, want, "iteration {it}: {}", merged.display());
    }
}

/// The members of the run's current generation, as `cluster.json` lists them (every
/// rank when it lists none).
fn members(c: &TestCluster) -> Vec<u64> {
    let v: Value = serde_json::from_str(
        &fs::read_to_string(c.log_path.join(".rl-node/cluster.json")).unwrap_or_default(),
    )
    .unwrap_or(Value::Null);
    match v["members"].as_array() {
        Some(m) => m.iter().filter_map(Value::as_u64).collect(),
        None => vec![0, 1, 2],
    }
}

/// A process started again for a dropped rank asks to come back, and the coordinator
/// takes it into a generation it forms at the next iteration's start: the cluster grows
/// back to three, and the rank runs its own rollouts again.
#[test]
fn a_dropped_rank_started_again_rejoins_at_the_next_iteration() {
    let victim = 2;
    let sleep = "600.5";
    let (c, marker) = cluster(victim, sleep, Some(2));
    // Slow enough that the rank started again finds the run still going.
    let text = fs::read_to_string(&c.config).unwrap();
    fs::write(
        &c.config,
        text.replace("done > {output}'''", "done > {output}; sleep 1'''"),
    )
    .unwrap();
    let iterations = 6;
    let its = iterations.to_string();
    let mut nodes = c.spawn_all(&["--iterations", &its]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    kill_machine(&mut nodes[victim as usize], &marker, sleep);
    wait_until(LIMIT, "the survivors to drop rank 2", || {
        members(&c) == [0, 1]
    });
    let mut again = c.spawn(victim, &["--iterations", &its]);
    let _again_logs = ShowLogsOnFailure::new(&c, std::slice::from_ref(&again));
    let code = again.wait(LIMIT);
    let err = again.stderr();
    assert_eq!(code, 0, "rank 2 started again:\n{err}");
    assert!(err.contains("asking to come back"), "{err}");
    for n in nodes.iter_mut().filter(|n| n.rank != victim) {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    assert_eq!(members(&c), [0, 1, 2], "the cluster grew back");
    assert_merged_complete(&c, iterations);
    // From the iteration it came back at on, rank 2 rolled out itself, and nobody stood
    // in for it.
    let back = (1..=iterations)
        .rev()
        .find(|&it| journaled(&c, victim, it, "rollout-train").is_empty())
        .expect("rank 2 missed an iteration")
        + 1;
    assert!(back <= iterations, "rank 2 never rolled out again");
    for it in back..=iterations {
        for r in [0, 1] {
            assert!(
                journaled(&c, r, it, "rollout-train.for-rank-2").is_empty(),
                "rank {r} stood in for rank 2 in iteration {it}, after it came back"
            );
        }
    }
}

/// A run that dropped a rank and finished resumes, when every node is started again for
/// more iterations, where its last generation's members got to, not at the iteration the
/// dropped rank's journal stops at.
#[test]
fn a_restart_after_a_drop_resumes_where_the_members_got_to() {
    let c = survivors_finish(2, "600.6");
    let mut nodes = c.spawn_all(&["--iterations", "4"]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    for n in nodes.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    // Iterations 1-3 were not run again: each rank's rollout of them is journaled once.
    for it in 1..=ITERATIONS {
        for r in [0, 1] {
            assert_eq!(
                journaled(&c, r, it, "rollout-train").len(),
                1,
                "rank {r} rolled out iteration {it} again"
            );
        }
    }
    assert_eq!(journaled(&c, 2, 4, "rollout-train").len(), 1);
    assert_merged_complete(&c, 4);
    assert_eq!(members(&c), [0, 1, 2]);
}

/// Rank 0 dies (aborts, as a kill -9 would stop it) at `point` of its coordinator's work:
/// after committing a merge but before journaling it, or in the middle of a hand-off.
/// Rank 1 takes over and does that work again from what is on the shared directory: every
/// merged file holds each record once, and `models/LATEST` names a verified checkpoint of
/// the last iteration's training.
fn coordinator_dies_at(point: &str) {
    let (c, _marker) = cluster(9, "600.9", Some(2));
    let its = ITERATIONS.to_string();
    let log_path = c.log_path.clone();
    let mut nodes = vec![c.spawn_env(
        0,
        &log_path,
        &["--iterations", &its],
        &[("RL_NODE_TEST_CRASH_AT", point.to_string())],
    )];
    nodes.extend((1..3).map(|r| c.spawn(r, &["--iterations", &its])));
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    let code = nodes[0].wait(LIMIT);
    assert_ne!(code, 0, "rank 0 stopped at {point}:\n{}", nodes[0].stderr());
    assert!(nodes[0].stderr().contains(point), "{}", nodes[0].stderr());
    for n in nodes.iter_mut().skip(1) {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    assert_complete(&c);
}

#[test]
fn rank_0_dead_between_a_merge_and_its_journal_is_merged_again_by_rank_1() {
    coordinator_dies_at("after-commit:aggregate-train@2");
}

#[test]
fn rank_0_dead_in_the_middle_of_a_handoff_is_handed_off_by_rank_1() {
    coordinator_dies_at("handoff:before-latest");
}

#[test]
fn rank_0_dead_after_moving_a_checkpoint_is_handed_off_by_rank_1() {
    coordinator_dies_at("handoff:after-move");
}

/// Per-task mode: rank 2 is killed after committing two of its four items of iteration 2.
/// Its stand-in runs only the two it did not commit (its third was running when it
/// died), and commits rank 2's shard from all four: every (task, sample) of every
/// iteration's plan is in the merged file once, and no item of rank 2 ran twice to the
/// end.
#[test]
fn per_task_a_dropped_ranks_uncommitted_items_are_done_by_its_stand_in() {
    let c = TestCluster::new(3, "");
    let tasks = c.dir.path().join("tasks.jsonl");
    let tasks_text: String = (0..12)
        .map(|t| format!("{{\"id\": \"t{t:02}\"}}\n"))
        .collect();
    fs::write(&tasks, tasks_text).unwrap();
    let dir = c.dir.path().display().to_string();
    let item = format!(
        r#"
[tasks]
train = '{tasks}'

[work]
mode = "per-task"
max-workers = 1

[phases.rollout]
command = '''if [ {{rank}} = 2 ] && [ {{iteration}} = {KILLED_IN} ] && [ ! -e '{dir}/marker' ]; then n=$(cat '{dir}/count' 2>/dev/null || echo 0); n=$((n+1)); echo $n > '{dir}/count'; if [ $n = 3 ]; then touch '{dir}/marker'; sleep 600.8; fi; fi; echo '{{"task": "{{task_id}}", "sample": {{sample}}, "it": {{iteration}}}}' > {{output}}; echo '{{rank}} {{iteration}} {{task_id}}' >> '{dir}/ran' '''
"#,
        tasks = tasks.display()
    );
    configure(&c, Some(2), &item);
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    let marker = c.dir.path().join("marker");
    kill_machine(&mut nodes[2], &marker, "600.8");
    for n in nodes.iter_mut().take(2) {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    for it in 1..=ITERATIONS {
        let merged = iter_dir(&c, it).join("train.jsonl");
        let mut got: Vec<String> = fs::read_to_string(&merged)
            .unwrap_or_else(|e| panic!("{}: {e}", merged.display()))
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                assert_eq!(v["it"].as_u64(), Some(it));
                v["task"].as_str().unwrap().to_string()
            })
            .collect();
        got.sort();
        let want: Vec<String> = (0..12).map(|t| format!("t{t:02}")).collect();
        assert_eq!(got, want, "iteration {it}: every task's sample once");
    }
    // Every item ran to its end once (the killed one never reached its end).
    let ran = fs::read_to_string(c.dir.path().join("ran")).unwrap();
    let mut lines: Vec<&str> = ran.lines().collect();
    let total = lines.len();
    lines.sort_unstable();
    lines.dedup();
    assert_eq!(lines.len(), total, "an item ran to its end twice:\n{ran}");
    assert_eq!(total, 12 * ITERATIONS as usize, "{ran}");
}

/// Two of three nodes die at once with `min-nodes = 2`: rank 0, left alone, stops with
/// the diagnosis of a dead peer, naming the ranks lost and the ranks left.
#[test]
fn below_min_nodes_the_last_node_stops_naming_who_was_lost() {
    let c = TestCluster::new(3, "");
    let dir = c.dir.path().display().to_string();
    let phases = format!(
        r#"
[phases.rollout]
command = '''if [ {{rank}} != 0 ] && [ {{iteration}} = {KILLED_IN} ]; then touch '{dir}/marker-{{rank}}'; sleep 600.{{rank}}0; fi; echo '{{}}' > {{output}}'''
"#
    );
    configure(&c, Some(2), &phases);
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    for r in [1, 2] {
        let marker = c.dir.path().join(format!("marker-{r}"));
        kill_machine(&mut nodes[r], &marker, &format!("600.{r}0"));
    }
    let code = nodes[0].wait(LIMIT);
    let err = nodes[0].stderr();
    assert_eq!(code, 3, "rank 0 stops as for a dead peer:\n{err}");
    assert!(
        err.contains("below cluster.min-nodes = 2") && err.contains("1 node(s) left (0)"),
        "rank 0 names who was lost and who is left:\n{err}"
    );
    assert!(!iter_dir(&c, KILLED_IN).join("train.jsonl").exists());
}

/// The inference servers of the nodes left go on serving through a regroup (a real
/// server's restart costs minutes): each starts once at the start and once after each
/// hand-off but the last, as without a loss.
#[test]
fn the_servers_of_the_nodes_left_are_not_restarted_by_a_regroup() {
    let victim = 2;
    let sleep = "600.11";
    let (c, marker) = cluster(victim, sleep, Some(2));
    let server = format!(
        "\n[server]\ncommand = \"exec python3 {} {{server_port}} {{model}}\"\nstart-timeout = \"20s\"\nstop-grace = \"2s\"\n",
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/health_server.py")
    );
    configure(&c, None, &server);
    let its = ITERATIONS.to_string();
    let mut nodes: Vec<NodeProc> = (0..3)
        .map(|r| {
            c.spawn_env(
                r,
                &c.log_path,
                &["--iterations", &its],
                &[("RL_NODE_SERVER_PORT", free_port().to_string())],
            )
        })
        .collect();
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    kill_machine(&mut nodes[victim as usize], &marker, sleep);
    for n in nodes.iter_mut().filter(|n| n.rank != victim) {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    assert_complete(&c);
    for r in [0, 1] {
        let events = c.events(r);
        let kinds: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
        assert!(kinds.contains(&"regrouped"), "rank {r}: {kinds:?}");
        let starts = kinds.iter().filter(|k| **k == "server-start").count();
        assert_eq!(
            starts, ITERATIONS as usize,
            "rank {r}: one start, and one after each hand-off but the last: {kinds:?}"
        );
    }
}

/// `on-failure = "drop-node"`: rank 2's rollout command fails in iteration 2 (a node
/// whose GPU fails, say), so rank 2 is dropped: it stops with its failure and the message
/// that it was dropped; the others regroup without it, a stand-in runs its rollout (which
/// succeeds elsewhere), and they finish with every record merged once.
#[test]
fn a_node_whose_rollout_fails_with_drop_node_is_dropped_and_the_others_finish() {
    let c = TestCluster::new(3, "");
    let phases = format!(
        r#"
[phases.rollout]
on-failure = "drop-node"
command = '''if [ {{rank}} = 2 ] && [ {{iteration}} = {KILLED_IN} ] && [ {{gen}} = 1 ]; then echo 'CUDA error: an illegal memory access' >&2; exit 7; fi; for i in $(seq 1 {PER_RANK}); do echo '{{"rank": {{rank}}, "it": {{iteration}}, "i": '$i'}}'; done > {{output}}'''

[phases.train]
command = "mkdir -p {{output}}/checkpoint-1 && cat {{trajectories}} > {{output}}/checkpoint-1/weights.jsonl"
"#
    );
    configure(&c, Some(2), &phases);
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    let code = nodes[2].wait(LIMIT);
    let err = nodes[2].stderr();
    assert_eq!(code, 1, "rank 2 stops with its command's failure:\n{err}");
    assert!(
        err.contains("exit code 7") && err.contains("this node is dropped"),
        "{err}"
    );
    for n in nodes.iter_mut().take(2) {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 0, "rank {}:\n{err}", n.rank);
        assert!(err.contains("rank 2 lost"), "rank {}:\n{err}", n.rank);
    }
    assert_complete(&c);
}

/// `drop-node` needs elastic mode: without `min-nodes` below `num-nodes` it is refused
/// at start, naming the key and what to set.
#[test]
fn drop_node_without_elastic_mode_is_refused_at_start() {
    let c = TestCluster::new(3, "");
    configure(
        &c,
        None,
        "\n[phases.rollout]\non-failure = \"drop-node\"\ncommand = \"true\"\n",
    );
    let mut n = c.spawn(0, &["--iterations", "1"]);
    let code = n.wait(LIMIT);
    let err = n.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("phases.rollout.on-failure") && err.contains("set min-nodes below num-nodes"),
        "{err}"
    );
}

/// The survivors are still rolling out when the death is declared: their rollout
/// commands go on through the regroup and are committed in the next generation, not
/// started again. Each survivor starts its rollout of every iteration once.
#[test]
fn rollouts_running_at_the_regroup_go_on_and_are_not_started_again() {
    let c = TestCluster::new(3, "");
    let dir = c.dir.path().display().to_string();
    let phases = format!(
        r#"
[phases.rollout]
command = '''echo "{{rank}} {{iteration}}" >> '{dir}/started'; if [ {{iteration}} = {KILLED_IN} ] && [ ! -e '{dir}/marker' ]; then if [ {{rank}} = 2 ]; then touch '{dir}/marker'; sleep 600.12; else sleep 5; fi; fi; for i in $(seq 1 {PER_RANK}); do echo '{{"rank": {{rank}}, "it": {{iteration}}, "i": '$i'}}'; done > {{output}}'''

[phases.train]
command = "mkdir -p {{output}}/checkpoint-1 && cat {{trajectories}} > {{output}}/checkpoint-1/weights.jsonl"
"#
    );
    configure(&c, Some(2), &phases);
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(&c, &nodes);
    kill_machine(&mut nodes[2], &c.dir.path().join("marker"), "600.12");
    for n in nodes.iter_mut().take(2) {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 0, "rank {}:\n{err}", n.rank);
        assert!(
            err.contains("started before the regroup goes on"),
            "rank {}:\n{err}",
            n.rank
        );
    }
    assert_complete(&c);
    let started = fs::read_to_string(c.dir.path().join("started")).unwrap();
    for r in [0, 1] {
        for it in 1..=ITERATIONS {
            let n = started
                .lines()
                .filter(|l| *l == format!("{r} {it}"))
                .count();
            assert_eq!(
                n, 1,
                "rank {r} started iteration {it}'s rollout {n} times:\n{started}"
            );
        }
    }
}
