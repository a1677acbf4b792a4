//! Fault injection with real processes: kill -9 a node in each of the 14 phases (master and
//! worker), check the survivors stop naming it, restart every node, and check that the run
//! completes with every trajectory exactly once, no committed output produced twice, and a
//! verified model served at the end.

mod common;
use common::cluster::*;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);
const TASKS_PER_RANK: u32 = 3;
const ITERATIONS: u64 = 2;
const DEAD_AFTER: Duration = Duration::from_millis(1500);
const POLL: Duration = Duration::from_millis(100);

/// A deterministic workload: each rank writes one record per task of its shard; training
/// writes a checkpoint derived from the merged trajectories; a real HTTP server serves
/// the model; eval every iteration.
fn workload() -> String {
    format!(
        r#"
[cluster]
eval-interval = 1
[phases.rollout]
command = "for t in $(seq 0 {last}); do echo '{{\"task\": '$(({{rank}} * {n} + t))', \"iteration\": {{iteration}}, \"seed\": '$(({{iteration}} * 1000 + {{rank}} * {n} + t))'}}'; done > {{output}}"
[phases.eval]
command = "echo '{{\"eval\": {{rank}}, \"iteration\": {{iteration}}}}' > {{output}}"
[phases.prepare]
command = "wc -l < {{trajectories}} > {{output}}"
[phases.train]
command = "mkdir -p {{output}}/checkpoint-1 && cat {{trajectories}} > {{output}}/checkpoint-1/weights.jsonl"
[server]
command = "exec python3 {server} {{server_port}} {{model}}"
start-timeout = "20s"
stop-grace = "2s"
"#,
        last = TASKS_PER_RANK - 1,
        n = TASKS_PER_RANK,
        server = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/health_server.py"
        ),
    )
}

fn expected_iteration(num_nodes: u32, it: u64) -> String {
    let mut s = String::new();
    for r in 0..num_nodes {
        for t in 0..TASKS_PER_RANK {
            let task = r * TASKS_PER_RANK + t;
            s.push_str(&format!(
                "{{\"task\": {task}, \"iteration\": {it}, \"seed\": {}}}\n",
                it * 1000 + task as u64
            ));
        }
    }
    s
}

struct Cluster {
    c: TestCluster,
    ports: Vec<u16>,
}

impl Cluster {
    fn new(num_nodes: u32) -> Cluster {
        let c = TestCluster::new(num_nodes, "");
        // The workload's [cluster] keys go into the file's own [cluster] table.
        let text = fs::read_to_string(&c.config).unwrap();
        let w = workload();
        let (cluster_keys, rest) = w.split_once("[phases.rollout]").unwrap();
        let cluster_keys = cluster_keys.replace("[cluster]", "");
        fs::write(
            &c.config,
            text.replacen(
                "[cluster]\n",
                &format!("[cluster]\n{}", cluster_keys.trim_start()),
                1,
            ) + "\n[phases.rollout]"
                + rest,
        )
        .unwrap();
        let ports = (0..num_nodes).map(|_| free_port()).collect();
        Cluster { c, ports }
    }

    fn spawn(&self, rank: u32, extra_env: &[(&str, String)]) -> NodeProc {
        let mut env = vec![
            ("RL_NODE_SERVER_PORT", self.ports[rank as usize].to_string()),
            (
                "RL_NODE_TIMING_DEAD_AFTER",
                format!("{}ms", DEAD_AFTER.as_millis()),
            ),
        ];
        env.extend(extra_env.iter().cloned());
        self.c.spawn_env(
            rank,
            &self.c.log_path,
            &["--iterations", &ITERATIONS.to_string()],
            &env,
        )
    }

    fn spawn_all(&self) -> Vec<NodeProc> {
        (0..self.c.num_nodes).map(|r| self.spawn(r, &[])).collect()
    }

    fn journal(&self, rank: u32) -> Vec<serde_json::Value> {
        fs::read_to_string(
            self.c
                .log_path
                .join(format!(".rl-node/journal/rank-{rank}.jsonl")),
        )
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
    }

    /// The run completed: every iteration's trajectories exactly as an uninterrupted run
    /// writes them, no journaled output twice, and the served model verified.
    fn assert_complete_and_exact(&self, context: &str) {
        let n = self.c.num_nodes;
        for it in 1..=ITERATIONS {
            let merged = fs::read_to_string(
                self.c
                    .log_path
                    .join(format!("rollouts/iter-{it:04}/train.jsonl")),
            )
            .unwrap_or_else(|e| panic!("{context}: iteration {it}: {e}"));
            assert_eq!(
                merged,
                expected_iteration(n, it),
                "{context}: iteration {it}"
            );
        }
        let mut seen: BTreeMap<(u32, u64, String), usize> = BTreeMap::new();
        for r in 0..n {
            for e in self.journal(r) {
                *seen
                    .entry((
                        r,
                        e["iteration"].as_u64().unwrap(),
                        e["item"].as_str().unwrap().to_string(),
                    ))
                    .or_default() += 1;
            }
            for it in 1..=ITERATIONS {
                for item in [
                    "rollout-train",
                    "rollout-eval",
                    "train",
                    "iteration-complete:both",
                ] {
                    assert_eq!(
                        seen.get(&(r, it, item.to_string())),
                        Some(&1),
                        "{context}: rank {r} {item} of iteration {it}: {seen:?}"
                    );
                }
            }
        }
        assert!(
            seen.values().all(|c| *c == 1),
            "{context}: work journaled twice: {seen:?}"
        );
        let models = self.c.log_path.join("models");
        let latest = fs::read_to_string(models.join("LATEST")).unwrap();
        assert_eq!(latest.trim(), format!("iter-{ITERATIONS:04}"), "{context}");
        let latest = models.join(latest.trim());
        rl_node::checkpoint::verify(&latest, &mut || {})
            .unwrap_or_else(|e| panic!("{context}: {e}"));
        // The model trained in the last iteration saw exactly that iteration's trajectories.
        assert_eq!(
            fs::read_to_string(latest.join("weights.jsonl")).unwrap(),
            expected_iteration(n, ITERATIONS),
            "{context}"
        );
        // Every node's last server start was on the newest model published before it (the
        // last iteration does not restart the server only to stop it): that of iteration
        // ITERATIONS - 1, or the last one when a restart began by serving it.
        for r in 0..n {
            let last_log = (0..=ITERATIONS)
                .rev()
                .map(|it| {
                    self.c
                        .log_path
                        .join(format!("logs/iter-{it:04}/rank-{r}.server.log"))
                })
                .find(|p| p.exists())
                .unwrap_or_else(|| panic!("{context}: rank {r} never started its server"));
            let log = fs::read_to_string(&last_log).unwrap();
            let served = log
                .rsplit("models/iter-")
                .next()
                .and_then(|t| t.get(..4))
                .and_then(|t| t.parse::<u64>().ok())
                .unwrap_or(0);
            assert!(
                served + 1 >= ITERATIONS,
                "{context}: rank {r}'s last server start ({}) was on iteration {served}'s model: {log}",
                last_log.display()
            );
        }
    }
}

fn wait_done(nodes: &mut [NodeProc], context: &str) {
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

/// Kill -9 `victim` while it is in `phase` of iteration 2, then restart and finish.
fn kill_in_phase(victim: u32, phase: &str) {
    let context = format!("rank {victim} killed in {phase}");
    let cl = Cluster::new(2);
    let hold = [("RL_NODE_TEST_HOLD_AT", format!("{phase}@{ITERATIONS}"))];
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| {
            if r == victim {
                cl.spawn(r, &hold)
            } else {
                cl.spawn(r, &[])
            }
        })
        .collect();
    wait_until(LIMIT, &format!("{context}: the victim to hold"), || {
        nodes[victim as usize]
            .stderr()
            .contains("RL_NODE_TEST_HOLD_AT")
    });
    let killed = Instant::now();
    nodes[victim as usize].signal(libc::SIGKILL);
    assert_eq!(nodes[victim as usize].wait(LIMIT), 137, "{context}");
    let survivor = 1 - victim as usize;
    let code = nodes[survivor].wait(LIMIT);
    let took = killed.elapsed();
    let err = nodes[survivor].stderr();
    assert_eq!(code, 3, "{context}: survivor:\n{err}");
    assert!(
        err.contains(&format!("rank {victim} on ")) && err.contains("is dead"),
        "{context}:\n{err}"
    );
    // dead-after plus two poll intervals, plus slack for stopping children and exiting.
    assert!(
        took < DEAD_AFTER + POLL * 2 + Duration::from_secs(3),
        "{context}: survivor took {took:?}"
    );
    drop(nodes);
    let mut nodes = cl.spawn_all();
    wait_done(&mut nodes, &context);
    cl.assert_complete_and_exact(&context);
}

macro_rules! phase_cases {
    ($($name:ident: $phase:expr,)*) => {
        mod kill_worker {
            $( #[test] fn $name() { super::kill_in_phase(1, $phase); } )*
        }
        mod kill_master {
            $( #[test] fn $name() { super::kill_in_phase(0, $phase); } )*
        }
    };
}

phase_cases! {
    p00_sync_start: "sync-start",
    p01_train_rollout: "train-rollout",
    p02_rollout_complete: "rollout-complete",
    p03_aggregate_train: "aggregate-train",
    p04_files_ready: "files-ready",
    p05_eval_decision: "eval-decision",
    p06_eval: "eval",
    p07_stop_server: "stop-server",
    p08_prepare_data: "prepare-data",
    p09_training_ready: "training-ready",
    p10_training: "training",
    p11_handoff: "handoff",
    p12_restart_server: "restart-server",
    p13_final_sync: "final-sync",
}

#[test]
fn sigterm_then_restart_completes_exactly() {
    let cl = Cluster::new(2);
    let mut nodes: Vec<NodeProc> = vec![
        cl.spawn(0, &[]),
        cl.spawn(1, &[("RL_NODE_TEST_HOLD_AT", "training@2".to_string())]),
    ];
    wait_until(LIMIT, "rank 1 to hold", || {
        nodes[1].stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    nodes[1].signal(libc::SIGTERM);
    assert_eq!(nodes[1].wait(LIMIT), 143);
    assert_eq!(nodes[0].wait(LIMIT), 3);
    drop(nodes);
    let mut nodes = cl.spawn_all();
    wait_done(&mut nodes, "after SIGTERM");
    cl.assert_complete_and_exact("after SIGTERM");
}

#[test]
fn a_crash_between_committing_a_shard_and_journaling_it_redoes_only_that_shard() {
    let cl = Cluster::new(2);
    let mut nodes: Vec<NodeProc> = vec![
        cl.spawn(0, &[]),
        cl.spawn(
            1,
            &[(
                "RL_NODE_TEST_CRASH_AT",
                "after-commit:rollout-train@2".to_string(),
            )],
        ),
    ];
    assert_eq!(nodes[1].wait(LIMIT), 134, "{}", nodes[1].stderr());
    assert_eq!(nodes[0].wait(LIMIT), 3);
    // The shard is committed but not journaled.
    assert!(cl
        .c
        .log_path
        .join("rollouts/iter-0002/train/rank-1.jsonl")
        .exists());
    assert!(!cl
        .journal(1)
        .iter()
        .any(|e| e["iteration"] == 2 && e["item"] == "rollout-train"));
    drop(nodes);
    let mut nodes = cl.spawn_all();
    wait_done(&mut nodes, "crash after commit");
    cl.assert_complete_and_exact("crash after commit");
    // Rank 0's shard of iteration 2 was reused, rank 1's was redone (same records).
    let reused = |r: u32| {
        cl.c.events(r)
            .iter()
            .any(|e| e["event"] == "reused" && e["item"] == "rollout-train" && e["iteration"] == 2)
    };
    assert!(reused(0) && !reused(1));
}

#[test]
fn restarting_only_some_nodes_waits_for_the_others_and_says_so() {
    let cl = Cluster::new(3);
    let mut nodes: Vec<NodeProc> = (0..3)
        .map(|r| {
            if r == 2 {
                cl.spawn(
                    r,
                    &[("RL_NODE_TEST_HOLD_AT", "train-rollout@2".to_string())],
                )
            } else {
                cl.spawn(r, &[])
            }
        })
        .collect();
    wait_until(LIMIT, "rank 2 to hold", || {
        nodes[2].stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    nodes[2].signal(libc::SIGKILL);
    for n in nodes.iter_mut() {
        n.wait(LIMIT);
    }
    drop(nodes);
    // Only ranks 0 and 1 come back: they wait, and status says for whom.
    let mut first = vec![cl.spawn(0, &[]), cl.spawn(1, &[])];
    wait_until(LIMIT, "status to show rank 0 waiting for rank 2", || {
        serde_json::from_str::<serde_json::Value>(&status(&cl.c.log_path, true).1)
            .ok()
            .is_some_and(|s| s["waiting_for"] == serde_json::json!([2]) && s["gen"] == 2)
    });
    for n in first.iter_mut() {
        assert!(
            n.child.try_wait().unwrap().is_none(),
            "rank {} gave up:\n{}",
            n.rank,
            n.stderr()
        );
    }
    let (_, text) = status(&cl.c.log_path, false);
    assert!(text.contains("rank 0 is waiting for: rank 2"), "{text}");
    first.push(cl.spawn(2, &[]));
    wait_done(&mut first, "partial restart");
    cl.assert_complete_and_exact("partial restart");
}

#[test]
fn a_worker_started_long_before_the_master_waits_for_it() {
    let cl = Cluster::new(2);
    let mut worker = cl.spawn(1, &[]);
    wait_until(LIMIT, "the worker to say it waits", || {
        worker
            .stderr()
            .contains("waiting for rank 0 to start a generation")
    });
    // Well past dead-after and several polls: still waiting, not failed.
    let t = Instant::now();
    wait_until(LIMIT, "a while to pass", || t.elapsed() > DEAD_AFTER * 2);
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "{}",
        worker.stderr()
    );
    let mut master = cl.spawn(0, &[]);
    assert_eq!(master.wait(LIMIT), 0, "{}", master.stderr());
    assert_eq!(worker.wait(LIMIT), 0, "{}", worker.stderr());
    cl.assert_complete_and_exact("worker first");
    let _ = Path::new("");
}

fn recover(log_path: &Path, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(BIN)
        .arg("recover")
        .arg("--log-path")
        .arg(log_path)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn recover_reports_what_a_restart_redoes_and_discards_an_incomplete_iteration() {
    let cl = Cluster::new(2);
    let mut nodes: Vec<NodeProc> = vec![
        cl.spawn(0, &[]),
        cl.spawn(
            1,
            &[("RL_NODE_TEST_HOLD_AT", "train-rollout@2".to_string())],
        ),
    ];
    wait_until(LIMIT, "rank 1 to hold", || {
        nodes[1].stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    // Rank 0 finishes its own rollout of iteration 2 and waits for rank 1.
    wait_until(LIMIT, "rank 0 to commit its shard", || {
        cl.journal(0)
            .iter()
            .any(|e| e["iteration"] == 2 && e["item"] == "rollout-train")
    });
    nodes[1].signal(libc::SIGKILL);
    assert_eq!(nodes[0].wait(LIMIT), 3);
    nodes[1].wait(LIMIT);
    drop(nodes);
    let partial =
        cl.c.log_path
            .join("rollouts/iter-0002/train/rank-1.partial.jsonl");
    fs::write(&partial, "{\"task\": 3}\n{\"ta").unwrap();
    let before = fs::read_to_string(cl.c.log_path.join(".rl-node/journal/rank-0.jsonl")).unwrap();

    let (code, text, _) = recover(&cl.c.log_path, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("a restart resumes at iteration 2"), "{text}");
    assert!(text.contains("rank 0: reuses [rollout-train]"), "{text}");
    assert!(
        text.contains("rank 1: reuses [], redoes [rollout-train"),
        "{text}"
    );
    assert!(text.contains("stale: pid"), "{text}");
    assert!(
        text.contains("rollouts/iter-0002/train/rank-1.partial.jsonl"),
        "{text}"
    );
    // Read-only unless asked.
    assert_eq!(
        fs::read_to_string(cl.c.log_path.join(".rl-node/journal/rank-0.jsonl")).unwrap(),
        before
    );

    let (code, _, err) = recover(&cl.c.log_path, &["--discard-iteration", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("complete on every rank"), "{err}");

    let (code, _, err) = recover(&cl.c.log_path, &["--discard-iteration", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(!cl.c.log_path.join("rollouts/iter-0002").exists(), "{err}");
    assert!(!cl.journal(0).iter().any(|e| e["iteration"] == 2), "{err}");
    let aside: Vec<_> = fs::read_dir(cl.c.log_path.join("previous-runs"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(aside.len(), 1);
    assert!(aside[0]
        .path()
        .join("rollouts/iter-0002/train/rank-1.partial.jsonl")
        .exists());

    let mut nodes = cl.spawn_all();
    wait_done(&mut nodes, "after discard");
    cl.assert_complete_and_exact("after discard");
    // The discarded iteration's rollout was redone by rank 0 too.
    assert!(!cl
        .c
        .events(0)
        .iter()
        .any(|e| e["event"] == "reused" && e["iteration"] == 2));
}

/// A rollout killed after it wrote part of its shard leaves its generation's partial file
/// (`rank-R.partial.gG.jsonl`); `recover` lists it under that name, in its report and in
/// `--json`'s `incomplete_files`.
#[test]
fn recover_lists_the_partial_shard_of_a_killed_rollout_under_its_real_name() {
    let marks = tempfile::tempdir().unwrap();
    let started = marks.path().join("started");
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"echo '{{\\\"task\\\": 1}}' > {{output}}; touch {}; exec sleep 1000\"\n",
            started.display()
        ),
    );
    let mut node = c.spawn(0, &["--iterations", "1"]);
    wait_until(LIMIT, "the rollout to write part of its shard", || {
        started.exists()
    });
    node.signal(libc::SIGKILL);
    node.wait(LIMIT);
    let partial = "rollouts/iter-0001/train/rank-0.partial.g1.jsonl";
    let bytes = fs::metadata(c.log_path.join(partial))
        .unwrap_or_else(|e| panic!("{partial}: {e}\n{}", node.stderr()))
        .len();
    assert!(bytes > 0);

    let (code, text, err) = recover(&c.log_path, &[]);
    assert_eq!(code, 0, "{text}{err}");
    let listed = text
        .split_once("\nincomplete files:\n")
        .map(|(_, l)| l)
        .unwrap_or_else(|| panic!("no incomplete files listed:\n{text}"));
    assert!(
        listed.lines().any(|l| l
            .trim_start()
            .starts_with(&format!("{partial} ({bytes} bytes): "))),
        "{text}"
    );
    let (code, json, err) = recover(&c.log_path, &["--json"]);
    assert_eq!(code, 0, "{json}{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let files: Vec<&str> = v["incomplete_files"]
        .as_array()
        .unwrap_or_else(|| panic!("{json}"))
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    assert_eq!(files.len(), 1, "{json}");
    assert!(
        files[0].starts_with(&format!("{partial} ({bytes} bytes): ")),
        "{json}"
    );
}
