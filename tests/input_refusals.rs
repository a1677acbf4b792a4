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
