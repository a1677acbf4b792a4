//! `[phases.train] on-failure`: what a failed training command does. With the default
//! ("stop") the cluster stops as for any failed command; with "keep-model" (webgym's
//! run.sh) the failure is logged and journaled, no checkpoint is handed off, the server
//! restarts on the previous model and the next iteration runs with it. Real `rl-node`
//! processes over a temporary shared directory, with a real HTTP server standing in for
//! vLLM.

mod common;

use common::cluster::*;
use std::fs;
use std::time::Duration;

/// Generous: every run here takes a few seconds.
const LIMIT: Duration = Duration::from_secs(90);

/// A 2-node cluster whose commands record the `{model}` they were given, with `train` as
/// the training command and `train_keys` (e.g. `on-failure = "keep-model"`) in
/// `[phases.train]`.
fn cluster(train: &str, train_keys: &str) -> (TestCluster, Vec<u16>) {
    let config = format!(
        r#"
[phases.rollout]
command = "echo {{model}} > {{log_path}}/seen/rollout-{{iteration}}-{{rank}}; echo '{{\"rank\": {{rank}}}}' > {{output}}"
[phases.train]
command = "echo {{model}} > {{log_path}}/seen/train-{{iteration}}-{{rank}}-g{{gen}}; {train}"
{train_keys}
[phases.handoff]
command = "echo {{iteration}} >> {{log_path}}/seen/handoffs"
[server]
command = "exec python3 {server} {{server_port}} {{model}}"
start-timeout = "20s"
stop-grace = "2s"
"#,
        server = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/health_server.py"
        ),
    );
    let c = TestCluster::new(2, &config);
    // The [cluster] table opens the file: put the base model there.
    let text = fs::read_to_string(&c.config).unwrap();
    fs::write(
        &c.config,
        text.replacen("[cluster]\n", "[cluster]\nmodel = \"base-model\"\n", 1),
    )
    .unwrap();
    fs::create_dir_all(c.log_path.join("seen")).unwrap();
    let ports = (0..2).map(|_| free_port()).collect();
    (c, ports)
}

/// The policy under test, as a `[phases.train]` key.
const KEEP_MODEL: &str = "on-failure = \"keep-model\"";

/// Training that fails on rank 1 in iteration 1 (exit 3, after a line a user would look
/// for), and elsewhere writes a checkpoint.
const FAILS_ON_RANK_1_IN_ITERATION_1: &str = "if [ {iteration} = 1 ] && [ {rank} = 1 ]; then echo 'CUDA out of memory on rank 1'; exit 3; fi; mkdir -p {output}/checkpoint-1 && echo weights-{iteration} > {output}/checkpoint-1/weights";

fn spawn(
    c: &TestCluster,
    ports: &[u16],
    rank: u32,
    iterations: u64,
    env: &[(&str, String)],
) -> NodeProc {
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.push(("RL_NODE_SERVER_PORT", ports[rank as usize].to_string()));
    c.spawn_env(
        rank,
        &c.log_path,
        &["--iterations", &iterations.to_string()],
        &env,
    )
}

fn seen(c: &TestCluster, name: &str) -> String {
    let p = c.log_path.join("seen").join(name);
    fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_string()
}

fn journal(c: &TestCluster, rank: u32) -> Vec<serde_json::Value> {
    fs::read_to_string(
        c.log_path
            .join(format!(".rl-node/journal/rank-{rank}.jsonl")),
    )
    .unwrap_or_default()
    .lines()
    .filter_map(|l| serde_json::from_str(l).ok())
    .collect()
}

/// Journal entries of `rank` for (`iteration`, `item`).
fn entries(c: &TestCluster, rank: u32, iteration: u64, item: &str) -> Vec<serde_json::Value> {
    journal(c, rank)
        .into_iter()
        .filter(|e| e["iteration"].as_u64() == Some(iteration) && e["item"] == item)
        .collect()
}

fn latest(c: &TestCluster) -> Option<String> {
    fs::read_to_string(c.log_path.join("models/LATEST"))
        .ok()
        .map(|s| s.trim().to_string())
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

/// The model a rank's server was started on in `iteration`'s restart (phase 12).
fn served_after(c: &TestCluster, iteration: u64, rank: u32) -> String {
    let log = c
        .log_path
        .join(format!("logs/iter-{iteration:04}/rank-{rank}.server.log"));
    let text = fs::read_to_string(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    text.rsplit("serving model=")
        .next()
        .and_then(|t| t.split_whitespace().next())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn keep_model_logs_the_failure_keeps_the_model_and_runs_the_next_iteration() {
    let (c, ports) = cluster(FAILS_ON_RANK_1_IN_ITERATION_1, KEEP_MODEL);

    let mut nodes: Vec<NodeProc> = (0..2).map(|r| spawn(&c, &ports, r, 2, &[])).collect();
    wait_ok(&mut nodes, "keep-model");
    let models = c.log_path.join("models");

    // Iteration 1 published nothing, though rank 0's own training wrote a checkpoint.
    assert!(c
        .log_path
        .join("train/iter-0001/gen-1/checkpoint-1/weights")
        .exists());
    assert!(
        !models.join("iter-0001").exists(),
        "iteration 1 was handed off"
    );
    assert_eq!(
        fs::read_to_string(c.log_path.join("seen/handoffs")).unwrap(),
        "2\n",
        "the handoff command runs in iteration 2 only"
    );
    // The servers restarted on the base model, and iteration 2's commands got it.
    for r in 0..2 {
        assert_eq!(served_after(&c, 1, r), "base-model", "rank {r}");
        assert_eq!(
            seen(&c, &format!("rollout-2-{r}")),
            "base-model",
            "rank {r}"
        );
        assert_eq!(
            seen(&c, &format!("train-2-{r}-g1")),
            "base-model",
            "rank {r}"
        );
    }
    // Iteration 2 trained and was published.
    assert_eq!(latest(&c).as_deref(), Some("iter-0002"));
    rl_node::checkpoint::verify(&models.join("iter-0002"), &mut || {}).unwrap();
    assert_eq!(
        fs::read_to_string(models.join("iter-0002/weights")).unwrap(),
        "weights-2\n"
    );

    // Rank 1 warned with the usual failure message: exit code, log, last lines.
    let e1 = nodes[1].stderr();
    assert!(e1.contains("[rank 1] warning: rank 1 on "), "{e1}");
    assert!(
        e1.contains("failed in phase 10 (training) of iteration 1: the train command failed with exit code 3"),
        "{e1}"
    );
    assert!(e1.contains("logs/iter-0001/rank-1.train.log"), "{e1}");
    assert!(e1.contains("| CUDA out of memory on rank 1"), "{e1}");
    assert!(!e1.contains("error:"), "{e1}");
    // Rank 0 says what became of the iteration.
    let e0 = nodes[0].stderr();
    let outcome =
        "iteration 1: training failed on rank(s) 1 (exit code 3); kept the base model (base-model)";
    assert!(e0.contains(outcome), "{e0}");
    assert!(!e0.contains("error:"), "{e0}");

    // The event, the journal and status record it.
    let ev: Vec<serde_json::Value> = c
        .events(1)
        .into_iter()
        .filter(|e| e["event"] == "train-failed")
        .collect();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0]["iteration"], 1);
    assert_eq!(ev[0]["failed"], "exit code 3");
    assert!(ev[0]["log"]
        .as_str()
        .unwrap()
        .ends_with("logs/iter-0001/rank-1.train.log"));
    let t = entries(&c, 1, 1, "train");
    assert_eq!(t.len(), 1, "{t:?}");
    assert_eq!(t[0]["failed"], "exit code 3");
    assert!(entries(&c, 0, 1, "train")[0].get("failed").is_none());
    assert!(entries(&c, 0, 1, "handoff").is_empty());
    assert_eq!(entries(&c, 0, 1, "handoff-skipped").len(), 1);
    assert_eq!(entries(&c, 0, 2, "handoff").len(), 1);
    for r in 0..2 {
        assert_eq!(entries(&c, r, 2, "iteration-complete:both").len(), 1);
    }
    let (ok, text) = status(&c.log_path, false);
    assert!(ok, "{text}");
    assert!(text.contains(outcome), "{text}");
    let (_, json) = status(&c.log_path, true);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["training_failures"][0]["iteration"], 1, "{v}");
}

#[test]
fn keep_model_goes_on_when_every_rank_fails_by_timeout_or_signal() {
    // Iteration 1 publishes; in iteration 2 rank 0's training passes its timeout and rank
    // 1's is killed by a signal; iteration 3 trains on iteration 1's model.
    let train = "if [ {iteration} = 2 ] && [ {rank} = 0 ]; then exec sleep 60.57; fi; if [ {iteration} = 2 ]; then kill -9 $$; fi; mkdir -p {output}/checkpoint-1 && echo weights-{iteration} > {output}/checkpoint-1/weights";
    let (c, ports) = cluster(train, &format!("{KEEP_MODEL}\ntimeout = \"3s\""));

    let mut nodes: Vec<NodeProc> = (0..2).map(|r| spawn(&c, &ports, r, 3, &[])).collect();
    wait_ok(&mut nodes, "every rank fails");
    let models = c.log_path.join("models");
    assert!(models.join("iter-0001").exists());
    assert!(
        !models.join("iter-0002").exists(),
        "iteration 2 was handed off"
    );
    assert_eq!(latest(&c).as_deref(), Some("iter-0003"));
    let iter1 = models.join("iter-0001");
    for r in 0..2 {
        assert_eq!(
            served_after(&c, 2, r),
            iter1.display().to_string(),
            "rank {r}"
        );
        assert_eq!(
            seen(&c, &format!("train-3-{r}-g1")),
            iter1.display().to_string(),
            "rank {r}"
        );
    }
    let e0 = nodes[0].stderr();
    let outcome = "iteration 2: training failed on rank(s) 0 (timed out after 3s), 1 (killed by signal 9 (SIGKILL)); kept model iter-0001";
    assert!(e0.contains(outcome), "{e0}");
    assert!(
        e0.contains(
            "the train command did not finish within its timeout of 3s (phases.train.timeout)"
        ),
        "{e0}"
    );
    assert!(
        nodes[1]
            .stderr()
            .contains("the train command failed with killed by signal 9 (SIGKILL)"),
        "{}",
        nodes[1].stderr()
    );
    let (_, text) = status(&c.log_path, false);
    assert!(text.contains(outcome), "{text}");
    // The timed-out command left nothing running.
    assert!(
        process_alive_with("sleep 60.57").is_empty(),
        "the timed-out training is still running"
    );
}

#[test]
fn by_default_a_failed_training_stops_the_cluster() {
    let (c, ports) = cluster(FAILS_ON_RANK_1_IN_ITERATION_1, "");
    let mut nodes: Vec<NodeProc> = (0..2).map(|r| spawn(&c, &ports, r, 2, &[])).collect();
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    let e1 = nodes[1].stderr();
    assert_eq!(
        codes,
        vec![3, 1],
        "rank 1:\n{e1}\nrank 0:\n{}",
        nodes[0].stderr()
    );
    assert!(
        e1.contains("error: rank 1: rank 1 on ")
            && e1.contains("failed in phase 10 (training) of iteration 1: the train command failed with exit code 3"),
        "{e1}"
    );
    assert!(e1.contains("| CUDA out of memory on rank 1"), "{e1}");
    let e0 = nodes[0].stderr();
    assert!(
        e0.contains("the train command failed with exit code 3"),
        "{e0}"
    );
    assert!(
        entries(&c, 1, 1, "train").is_empty(),
        "a failed training was journaled"
    );
    assert!(latest(&c).is_none());
    assert!(!c.log_path.join("models/iter-0001").exists());
}

#[test]
fn an_unknown_on_failure_value_is_a_configuration_error() {
    let (c, ports) = cluster("true", "");
    let mut n = spawn(
        &c,
        &ports,
        0,
        1,
        &[("RL_NODE_PHASES_TRAIN_ON_FAILURE", "retry".to_string())],
    );
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    assert!(
        n.stderr()
            .contains("phases.train.on-failure (from environment RL_NODE_PHASES_TRAIN_ON_FAILURE): `retry` is neither"),
        "{}",
        n.stderr()
    );
    assert!(!c.log_path.join(".rl-node").exists());
}

/// Rank 0 is killed after the `training-complete` barrier of an iteration whose training
/// failed on rank 1: the restart neither retrains it nor hands it off.
#[test]
fn a_restart_after_a_failed_training_neither_retrains_nor_hands_off() {
    let (c, ports) = cluster(FAILS_ON_RANK_1_IN_ITERATION_1, KEEP_MODEL);
    let hold = [("RL_NODE_TEST_HOLD_AT", "handoff@1".to_string())];
    let mut nodes = vec![spawn(&c, &ports, 0, 2, &hold), spawn(&c, &ports, 1, 2, &[])];
    wait_until(LIMIT, "rank 0 to hold in the hand-off", || {
        nodes[0].stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    nodes[0].signal(libc::SIGKILL);
    assert_eq!(nodes[0].wait(LIMIT), 137);
    assert_eq!(nodes[1].wait(LIMIT), 3, "{}", nodes[1].stderr());
    drop(nodes);

    let mut nodes: Vec<NodeProc> = (0..2).map(|r| spawn(&c, &ports, r, 2, &[])).collect();
    wait_ok(&mut nodes, "restart");
    // Training of iteration 1 ran once per rank (generation 1), never again.
    for r in 0..2 {
        assert!(c.log_path.join(format!("seen/train-1-{r}-g1")).exists());
        assert!(
            !c.log_path.join(format!("seen/train-1-{r}-g2")).exists(),
            "rank {r} retrained iteration 1"
        );
        assert_eq!(entries(&c, r, 1, "train").len(), 1, "rank {r}");
    }
    let e0 = nodes[0].stderr();
    assert!(
        e0.contains("iteration 1: training completed on every rank before the restart; not redone"),
        "{e0}"
    );
    assert!(
        e0.contains("iteration 1: training failed on rank(s) 1 (exit code 3); kept the base model (base-model)"),
        "{e0}"
    );
    // Not handed off: no command, no checkpoint; iteration 2 trained on the base model.
    assert_eq!(
        fs::read_to_string(c.log_path.join("seen/handoffs")).unwrap(),
        "2\n"
    );
    assert!(!c.log_path.join("models/iter-0001").exists());
    assert_eq!(latest(&c).as_deref(), Some("iter-0002"));
    for r in 0..2 {
        assert_eq!(seen(&c, &format!("train-2-{r}-g2")), "base-model");
    }
}

/// A crash after rank 1 journaled its failed training but before rank 0 trained: training
/// is all-or-nothing, so the restart redoes it on every rank, and its new outcome (here a
/// success) is the one that counts: iteration 1 is handed off.
#[test]
fn a_failed_training_journaled_on_some_ranks_only_is_redone_everywhere() {
    // Fails on rank 1 in generation 1 only.
    let train = "if [ {iteration} = 1 ] && [ {rank} = 1 ] && [ {gen} = 1 ]; then echo 'CUDA out of memory on rank 1'; exit 3; fi; mkdir -p {output}/checkpoint-1 && echo weights-{iteration}-g{gen} > {output}/checkpoint-1/weights";
    let (c, ports) = cluster(train, KEEP_MODEL);
    let hold = [("RL_NODE_TEST_HOLD_AT", "training@1".to_string())];
    let mut nodes = vec![spawn(&c, &ports, 0, 1, &hold), spawn(&c, &ports, 1, 1, &[])];
    wait_until(LIMIT, "rank 1 to journal its failed training", || {
        entries(&c, 1, 1, "train")
            .iter()
            .any(|e| e["failed"] == "exit code 3")
    });
    wait_until(LIMIT, "rank 0 to hold in training", || {
        nodes[0].stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    nodes[0].signal(libc::SIGKILL);
    assert_eq!(nodes[0].wait(LIMIT), 137);
    assert_eq!(nodes[1].wait(LIMIT), 3, "{}", nodes[1].stderr());
    drop(nodes);

    let mut nodes: Vec<NodeProc> = (0..2).map(|r| spawn(&c, &ports, r, 1, &[])).collect();
    wait_ok(&mut nodes, "restart");
    for r in 0..2 {
        assert!(
            c.log_path.join(format!("seen/train-1-{r}-g2")).exists(),
            "rank {r} did not redo training"
        );
    }
    // Rank 1's journal: the failure, then the redo's success (its latest outcome).
    let t = entries(&c, 1, 1, "train");
    assert_eq!(t.len(), 2, "{t:?}");
    assert_eq!(t[0]["failed"], "exit code 3");
    assert!(t[1].get("failed").is_none(), "{t:?}");
    // Rank 0 trained once, successfully: one entry.
    assert_eq!(entries(&c, 0, 1, "train").len(), 1);
    assert_eq!(latest(&c).as_deref(), Some("iter-0001"));
    assert_eq!(
        fs::read_to_string(c.log_path.join("models/iter-0001/weights")).unwrap(),
        "weights-1-g2\n"
    );
}
