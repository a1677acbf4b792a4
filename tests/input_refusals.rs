//! Input limits and helpful refusals: each is refused at start with exit 2, naming the
//! key (or variable) at fault, before anything is written to the shared directory.

mod common;

use common::cluster::*;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

fn refused(c: &TestCluster, args: &[&str], env: &[(&str, String)], needles: &[&str]) {
    let mut n = c.spawn_env(0, &c.log_path, args, env);
    let code = n.wait(LIMIT);
    let err = n.stderr();
    assert_eq!(code, 2, "{err}");
    for needle in needles {
        assert!(err.contains(needle), "expected `{needle}` in:\n{err}");
    }
    assert!(
        !c.log_path.join(".rl-node").exists(),
        "a refused start wrote to the shared directory:\n{err}"
    );
}

#[test]
fn a_cluster_above_the_node_limit_is_refused_naming_the_limit() {
    let c = TestCluster::new(1, "");
    refused(
        &c,
        &["--num-nodes", "5000"],
        &[],
        &["cluster.num-nodes", "5000 is above the limit of 4096 nodes"],
    );
}

#[test]
fn zero_timeouts_are_refused_like_the_other_zero_timings() {
    for key in ["fs-timeout", "join-timeout", "barrier-timeout"] {
        let c = TestCluster::new(1, "");
        let var = format!("RL_NODE_TIMING_{}", key.replace('-', "_").to_uppercase());
        refused(
            &c,
            &[],
            &[(var.as_str(), "0s".to_string())],
            &[&format!("timing.{key}"), "must be greater than zero"],
        );
    }
}

#[test]
fn a_misspelt_rl_node_variable_is_an_error_with_the_nearest_key() {
    let c = TestCluster::new(1, "");
    refused(
        &c,
        &[],
        &[("RL_NODE_TIMING_DEAD_AFTR", "90s".to_string())],
        &[
            "RL_NODE_TIMING_DEAD_AFTR",
            "did you mean `RL_NODE_TIMING_DEAD_AFTER`",
        ],
    );
}

#[test]
fn a_worker_refused_at_join_is_reported_by_rank_0_and_status_within_a_poll() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"echo '{\\\"r\\\": {rank}}' > {output}\"\n",
    );
    std::fs::create_dir_all(&c.log_path).unwrap();
    let mut master = c.spawn(0, &["--iterations", "1"]);
    wait_until(LIMIT, "rank 0 to start a generation", || {
        c.log_path.join(".rl-node/cluster.json").exists()
    });
    let mut wrong = c.spawn_env(
        1,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_CLUSTER_EVAL_INTERVAL", "3".to_string())],
    );
    assert_eq!(wrong.wait(LIMIT), 2, "{}", wrong.stderr());
    let expected = "rank 1 was refused: cluster.eval-interval differs (rank 0 has 1, rank 1 has 3)";
    wait_until(
        Duration::from_secs(10),
        "rank 0 to report the refusal",
        || master.stderr().contains(expected),
    );
    let (_, text) = status(&c.log_path, false);
    assert!(text.contains(expected), "{text}");
    // The refusal did not disturb the run: a correct worker joins and it completes.
    let mut worker = c.spawn(1, &["--iterations", "1"]);
    assert_eq!(worker.wait(LIMIT), 0, "{}", worker.stderr());
    assert_eq!(master.wait(LIMIT), 0, "{}", master.stderr());
}
