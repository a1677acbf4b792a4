//! `rl-node plan` prints what a rank would run in an iteration without running anything:
//! the command lines are the ones a real node renders (checked against the command lines a
//! real run of the webgym example logged), the environment carries `[env]` and the
//! trailing arguments, bad input is a usage error naming the flag, and nothing is written.

mod common;
use common::cluster::*;
use common::webgym::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

/// `rl-node plan ARGS` with `env` (and none of the test's own `RL_NODE_*` variables).
fn plan(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("plan").args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    cmd.output().unwrap()
}

fn plan_json(args: &[&str], env: &[(&str, String)]) -> Value {
    let out = plan(&[args, &["--json"]].concat(), env);
    assert!(
        out.status.success(),
        "plan {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The command lines of each section (`rollout`, `server`, ...) of a plan, in order.
fn planned_commands(plan: &Value) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for step in plan["steps"].as_array().unwrap() {
        if let Some(c) = step["command"].as_str() {
            let section = step["config"].as_str().unwrap().rsplit('.').next().unwrap();
            m.entry(section.to_string())
                .or_default()
                .push(c.to_string());
        }
    }
    m
}

/// The command lines a node logged for `iteration` (`### $ …` in
/// `logs/iter-NNNN/rank-R.PHASE.log`), by phase, with the server that serves it (started in
/// the iteration before: as iteration 0 when the node starts); the built-in merge's own
/// command (`aggregate`) is left out.
fn logged_commands(log: &Path, rank: u32, iteration: u64) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let logs = |i: u64| log.join(format!("logs/iter-{i:04}"));
    let serving = logs(iteration - 1).join(format!("rank-{rank}.server.log"));
    m.insert(
        "server".into(),
        commands_in(&fs::read_to_string(serving).unwrap()),
    );
    let dir = logs(iteration);
    for entry in fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let Some(phase) = name
            .strip_prefix(&format!("rank-{rank}."))
            .and_then(|n| n.strip_suffix(".log"))
        else {
            continue;
        };
        if phase == "aggregate" {
            continue;
        }
        let commands = commands_in(&fs::read_to_string(dir.join(&name)).unwrap());
        if !commands.is_empty() {
            m.entry(phase.to_string()).or_default().extend(commands);
        }
    }
    m
}

/// Every variable the plan gives a step equals what the program it starts received
/// (the stand-ins record their whole environment); the phases checked.
fn check_env(plan: &Value, standin_log: &Path, rank: u32, iteration: u64) -> Vec<String> {
    let var = |env: &Value, name: &str| env[name].as_str().map(str::to_string);
    let mut checked = Vec::new();
    for line in fs::read_to_string(standin_log).unwrap().lines() {
        let call: Value = serde_json::from_str(line).unwrap();
        let got = &call["env"];
        // The server serving `iteration` was started in the one before.
        let serving = var(got, "RL_NODE_PHASE").as_deref() == Some("server")
            && var(got, "RL_NODE_ITERATION") == Some((iteration - 1).to_string());
        if var(got, "RL_NODE_RANK") != Some(rank.to_string())
            || (var(got, "RL_NODE_ITERATION") != Some(iteration.to_string()) && !serving)
        {
            continue;
        }
        let step = plan["steps"].as_array().unwrap().iter().find(|s| {
            let env = s["env"].as_array().unwrap();
            let of = |n: &str| {
                env.iter()
                    .find(|e| e["name"] == n)
                    .and_then(|e| e["value"].as_str().map(str::to_string))
            };
            of("RL_NODE_PHASE") == var(got, "RL_NODE_PHASE")
                && of("RL_NODE_ITERATION") == var(got, "RL_NODE_ITERATION")
        });
        let Some(step) = step else { continue };
        for e in step["env"].as_array().unwrap() {
            let name = e["name"].as_str().unwrap();
            assert_eq!(
                var(got, name).as_deref(),
                e["value"].as_str(),
                "rank {rank}: {name} of {} as planned and as received",
                call["prog"]
            );
        }
        checked.push(var(got, "RL_NODE_PHASE").unwrap());
    }
    checked
}

fn commands_in(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.strip_prefix("### $ "))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_webgym_plan_is_what_a_real_run_ran() {
    // Two iterations: the second runs on the checkpoint the first published, and the
    // server the first restarted on it.
    let w = webgym_cluster(6);
    w.run(&[]);
    let config = w.c.config.display().to_string();
    let log = w.log.display().to_string();
    for (rank, iteration) in [(0u32, 1u64), (2, 1), (0, 2), (2, 2)] {
        let mut args: Vec<String> = [
            "--config",
            &config,
            "--log-path",
            &log,
            "--iteration",
            &iteration.to_string(),
            "--rank",
            &rank.to_string(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(w.args(&[]));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = plan_json(&args, &w.node_env(rank, &[]));
        let planned = planned_commands(&p);
        let logged = logged_commands(&w.log, rank, iteration);
        let at = format!("rank {rank}, iteration {iteration}");
        assert_eq!(planned, logged, "{at}: plan vs what the node ran");
        let checked = check_env(&p, &w.standin_log(), rank, iteration);
        let expected: &[&str] = match iteration {
            // Eval is due in iteration 1 (eval-interval 6), not in 2.
            1 => &["server", "rollout", "eval", "train"],
            _ => &["server", "rollout", "train"],
        };
        for phase in expected {
            assert!(checked.contains(&phase.to_string()), "{at}: {checked:?}");
        }
        // Rank 0 alone prepares.
        assert_eq!(
            planned.contains_key("prepare"),
            rank == 0,
            "{at}: {planned:#?}"
        );
    }
}

#[test]
fn the_plan_shows_the_env_table_and_the_trailing_arguments() {
    let c = TestCluster::new(
        2,
        r#"
[env]
GREETING = "hello from rank {rank} of {num_nodes}"
[phases.rollout]
command = "echo rollout {extra_args} > {output}"
[phases.train]
command = "echo train {output}"
"#,
    );
    let config = c.config.display().to_string();
    let log = c.log_path.display().to_string();
    let args = [
        "--config",
        &config,
        "--log-path",
        &log,
        "--iteration",
        "3",
        "--rank",
        "1",
        "--",
        "env_config.max_steps=20",
        "two words",
    ];
    let out = plan(&args, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("echo rollout env_config.max_steps=20 'two words' > "),
        "{text}"
    );
    assert!(text.contains("GREETING=hello from rank 1 of 2"), "{text}");
    let p = plan_json(&args[..8], &[]);
    let train = p["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["config"] == "phases.train")
        .expect("a training step");
    let env: BTreeMap<&str, &str> = train["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e["value"].as_str().unwrap()))
        .collect();
    assert_eq!(env["GREETING"], "hello from rank 1 of 2");
    assert_eq!(env["NODE_RANK"], "1");
    assert_eq!(env["NNODES"], "2");
    assert_eq!(env["RL_NODE_ITERATION"], "3");
    let output = log.clone() + "/train/iter-0003/gen-1";
    assert_eq!(train["output"], output.as_str());
    assert_eq!(train["command"], format!("echo train {output}").as_str());
    assert!(!c.log_path.exists(), "plan wrote into the shared directory");
}

#[test]
fn bad_input_is_a_usage_error_naming_the_flag() {
    let c = TestCluster::new(3, "[phases.rollout]\ncommand = \"true\"\n");
    let config = c.config.display().to_string();
    let log = c.log_path.display().to_string();
    let base = ["--config", config.as_str(), "--log-path", log.as_str()];
    for (extra, flag) in [
        (&["--iteration", "1", "--rank", "3"][..], "--rank 3"),
        (
            &["--iteration", "1", "--rank", "1", "--num-nodes", "1"][..],
            "--rank 1",
        ),
        (&["--iteration", "0", "--rank", "0"][..], "--iteration 0"),
        (
            &["--iteration", "1", "--rank", "0", "--phase", "rollot"][..],
            "--phase rollot",
        ),
    ] {
        let out = plan(&[&base[..], extra].concat(), &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(flag), "{extra:?}: {err}");
        assert!(out.stdout.is_empty(), "{extra:?}");
    }
    assert!(!c.log_path.exists(), "plan wrote into the shared directory");
}
