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

#[test]
fn a_log_path_inside_another_runs_directories_or_a_dangling_link_is_refused() {
    let c = TestCluster::new(1, "[phases.rollout]\ncommand = \"echo '{}' > {output}\"\n");
    let mut n = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    for inside in [".rl-node", "rollouts/x", "models"] {
        let path = c.log_path.join(inside);
        let mut n = c.spawn_at(0, &path, &["--iterations", "1"]);
        assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
        let err = n.stderr();
        assert!(
            err.contains("a directory of the rl-node run in")
                && err.contains(&c.log_path.display().to_string()),
            "{inside}: {err}"
        );
    }
    let link = c.dir.path().join("shared-link");
    std::os::unix::fs::symlink(c.dir.path().join("not-mounted"), &link).unwrap();
    let mut n = c.spawn_at(0, &link, &["--iterations", "1"]);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    assert!(
        n.stderr().contains("is a symbolic link to") && n.stderr().contains("which does not exist"),
        "{}",
        n.stderr()
    );
}

/// A `--log-path` that is a symbolic-link loop (or lies under one) is refused as a loop,
/// naming the link that loops, by a node (exit 2, nothing written) and by the tools that
/// read a run, not as a directory that does not exist or a damaged run.
#[test]
fn a_log_path_that_is_a_symbolic_link_loop_is_refused_as_one() {
    let c = TestCluster::new(1, "");
    let (a, b) = (c.dir.path().join("a"), c.dir.path().join("b"));
    std::os::unix::fs::symlink("b", &a).unwrap();
    std::os::unix::fs::symlink("a", &b).unwrap();
    // What the test's directory holds besides the nodes' own output files.
    let made = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(c.dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("rank-"))
            .collect();
        v.sort();
        v
    };
    let before = made();
    let looping = format!(
        "{} is a symbolic-link loop ({} → b → a; ELOOP",
        a.display(),
        a.display()
    );
    for path in [a.clone(), a.join("run")] {
        let mut n = c.spawn_at(0, &path, &["--iterations", "1"]);
        assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
        let err = n.stderr();
        assert!(!err.contains("does not exist"), "{err}");
        let want = match path == a {
            true => format!("--log-path {looping}"),
            false => format!(
                "--log-path {} is inside {}, a symbolic-link loop ({} → b → a; ELOOP",
                path.display(),
                a.display(),
                a.display()
            ),
        };
        assert!(err.contains(&want), "expected `{want}` in:\n{err}");
    }
    for tool in ["status", "recover", "timeline"] {
        let out = std::process::Command::new(BIN)
            .args([tool, "--log-path"])
            .arg(&a)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{tool}: {err}");
        assert!(
            err.contains(&format!("--log-path {looping}")),
            "{tool}: {err}"
        );
    }
    // Nothing was made beside the loop, and the loop is as it was.
    assert_eq!(made(), before);
    assert_eq!(std::fs::read_link(&a).unwrap(), std::path::Path::new("b"));
    assert_eq!(std::fs::read_link(&b).unwrap(), std::path::Path::new("a"));
}

#[test]
fn a_data_path_missing_on_the_node_is_refused_at_start() {
    let c = TestCluster::new(1, "");
    refused(
        &c,
        &["--data-path", "/nonexistent/rl-node-data"],
        &[],
        &[
            "--data-path /nonexistent/rl-node-data",
            "does not exist on this node",
        ],
    );
}

#[test]
fn num_nodes_defaults_from_the_launchers_variables_and_says_so() {
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"echo '{\\\"r\\\": {rank}}' > {output}\"\n",
    );
    // The test cluster's config sets num-nodes; a config without it takes SLURM_NNODES.
    std::fs::write(
        &c.config,
        std::fs::read_to_string(&c.config)
            .unwrap()
            .replace("num-nodes = 1\n", ""),
    )
    .unwrap();
    std::fs::create_dir_all(&c.log_path).unwrap();
    let env = [("SLURM_NNODES", "2".to_string())];
    let mut master = c.spawn_env(0, &c.log_path, &["--iterations", "1"], &env);
    let mut worker = c.spawn_env(1, &c.log_path, &["--iterations", "1"], &env);
    assert_eq!(worker.wait(LIMIT), 0, "{}", worker.stderr());
    assert_eq!(master.wait(LIMIT), 0, "{}", master.stderr());
    assert!(
        master
            .stderr()
            .contains("num-nodes 2 (from environment SLURM_NNODES)"),
        "{}",
        master.stderr()
    );
}

#[test]
fn a_placeholder_without_a_value_in_this_mode_or_case_is_refused_naming_the_key() {
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"run --task {task_id} --out {output}\"\n",
    );
    refused(
        &c,
        &[],
        &[],
        &[
            "phases.rollout.command",
            "{task_id} has a value only in rollout and eval commands with work.mode = \"per-task\"",
            "work.mode is \"per-rank\"",
        ],
    );
    let c = TestCluster::new(1, "[phases.train]\ncommand = \"train --rank {RANK}\"\n");
    refused(
        &c,
        &[],
        &[],
        &[
            "phases.train.command",
            "`{RANK}`: placeholders are lower-case; did you mean `{rank}`?",
        ],
    );
}

/// `refused`, and the shared directory not even created: the refusal came at load.
fn refused_untouched(c: &TestCluster, args: &[&str], env: &[(&str, String)], needles: &[&str]) {
    refused(c, args, env, needles);
    assert!(
        !c.log_path.exists(),
        "a refused start created the shared directory {}",
        c.log_path.display()
    );
}

/// A cluster whose config also names a two-task train file, for the values a plan uses.
fn with_tasks(extra: &str) -> TestCluster {
    let c = TestCluster::new(1, extra);
    let tasks = c.dir.path().join("tasks.jsonl");
    std::fs::write(&tasks, "{\"id\": \"a\"}\n{\"id\": \"b\"}\n").unwrap();
    let mut text = std::fs::read_to_string(&c.config).unwrap();
    text.push_str(&format!("\n[tasks]\ntrain = '{}'\n", tasks.display()));
    std::fs::write(&c.config, text).unwrap();
    c
}

/// A duration that overflowed the clock (exit 101 once the run's state was written) and a
/// sample count whose plan could not be allocated (an abort) are refused at load with exit
/// 2, naming the key, the value, the accepted range and where the value came from: the
/// file, a variable or a flag.
#[test]
fn absurd_durations_and_counts_are_refused_at_load_naming_key_value_range_and_source() {
    let c = TestCluster::new(1, "");
    let text = std::fs::read_to_string(&c.config).unwrap().replace(
        "[timing]\n",
        "[timing]\nbarrier-timeout = \"400000000000years\"\n",
    );
    std::fs::write(&c.config, text).unwrap();
    let file = format!("(from {})", c.config.display());
    refused_untouched(
        &c,
        &["--iterations", "1"],
        &[],
        &[
            "timing.barrier-timeout",
            &file,
            "400000000000years",
            "1ms to 1year",
        ],
    );
    let c = with_tasks("[work]\nsamples-per-task = 4294967295\n");
    let file = format!("(from {})", c.config.display());
    refused_untouched(
        &c,
        &["--iterations", "1"],
        &[],
        &["work.samples-per-task", &file, "4294967295", "1 to 100000"],
    );
    let c = TestCluster::new(1, "[phases.rollout]\ncommand = \"true\"\n");
    refused_untouched(
        &c,
        &["--iterations", "1"],
        &[(
            "RL_NODE_PHASES_ROLLOUT_TIMEOUT",
            "400000000000years".to_string(),
        )],
        &[
            "phases.rollout.timeout (from environment RL_NODE_PHASES_ROLLOUT_TIMEOUT)",
            "400000000000years",
            "1ms to 1year",
        ],
    );
    let c = TestCluster::new(1, "");
    refused_untouched(
        &c,
        &["--iterations", "1", "--eval-interval", "100000000000"],
        &[],
        &[
            "cluster.eval-interval (from --eval-interval)",
            "100000000000",
            "0 to 1000000",
        ],
    );
}

/// Every task of the file (tasks-per-iteration = 0) times samples-per-task is the plan each
/// node holds in memory: above its limit, refused at load naming the file and the key.
#[test]
fn an_iteration_of_too_many_items_is_refused_naming_the_task_file() {
    let c = with_tasks("[work]\nsamples-per-task = 100000\n");
    let tasks = c.dir.path().join("tasks.jsonl");
    let lines: String = (0..101)
        .map(|i| format!("{{\"id\": \"t{i}\"}}\n"))
        .collect();
    std::fs::write(&tasks, lines).unwrap();
    refused_untouched(
        &c,
        &["--iterations", "1"],
        &[],
        &[
            &format!("tasks.train: {} holds 101 tasks", tasks.display()),
            "work.samples-per-task = 100000",
            "10100000 items, above the limit of 10000000",
        ],
    );
}

/// A task id holding a control character (here NUL and ESC, written as JSON escapes on
/// line 3) would reach commands, their environment and the logs: it is refused at load,
/// naming the task file and the line, before anything is written.
#[test]
fn a_task_id_with_a_control_character_is_refused_naming_the_file_and_line() {
    for escape in ["\\u0000", "\\u001b"] {
        let c = with_tasks(
            "[work]\nmode = \"per-task\"\n[phases.rollout]\ncommand = \"echo '{}' > {output}\"\n",
        );
        let tasks = c.dir.path().join("tasks.jsonl");
        std::fs::write(
            &tasks,
            format!("{{\"id\": \"a\"}}\n{{\"id\": \"b\"}}\n{{\"id\": \"c{escape}[31md\"}}\n"),
        )
        .unwrap();
        refused_untouched(
            &c,
            &["--iterations", "1"],
            &[],
            &[
                &format!("task file {}:3", tasks.display()),
                "control character",
            ],
        );
    }
}
