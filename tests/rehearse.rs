//! `rl-node rehearse` runs a configuration for real on N local nodes with every external
//! program replaced by a recorder: the webgym example rehearses to its end, its command
//! table is printed, and what the stand-ins received is what `rl-node plan` renders; each
//! kind of finding is shown on a configuration that has the problem, and nothing outside
//! the rehearsal's directory is written.

mod common;
use common::cluster::*;
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// `rl-node ARGS` with `env` and none of the test's own `RL_NODE_*` variables.
fn rl_node(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    cmd.output().unwrap()
}

/// Rehearse `config` into `dir` with `args`; its output and report.json.
fn rehearse(config: &Path, dir: &Path, args: &[&str]) -> (Output, Value) {
    rehearse_env(config, dir, args, &[])
}

fn rehearse_env(
    config: &Path,
    dir: &Path,
    args: &[&str],
    env: &[(&str, String)],
) -> (Output, Value) {
    let (config, dir_s) = (config.display().to_string(), dir.display().to_string());
    let base = [
        "rehearse",
        "--config",
        &config,
        "--dir",
        &dir_s,
        "--timeout",
        "3m",
    ];
    let out = rl_node(&[&base[..], args].concat(), env);
    let report = fs::read(dir.join("report.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    (out, report)
}

fn text(out: &Output) -> String {
    format!(
        "{}\n--- stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The findings of `kind` and `severity`, as their messages.
fn findings(report: &Value, severity: &str, kind: &str) -> Vec<String> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == severity && f["kind"] == kind)
        .map(|f| f["message"].as_str().unwrap().to_string())
        .collect()
}

/// The report's step of `rank`, `iteration` and `phase`.
fn step<'a>(report: &'a Value, rank: u32, iteration: u64, phase: &str) -> &'a Value {
    report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["rank"] == rank && s["iteration"] == iteration && s["phase"] == phase)
        .unwrap_or_else(|| panic!("no step rank {rank} iteration {iteration} {phase}"))
}

fn exits(report: &Value) -> Vec<Value> {
    report["exits"].as_array().unwrap().clone()
}

/// A line of the printed table: rank, iteration, phase, then `$ ` and the command.
fn table_has(stdout: &str, rank: u32, iteration: u64, phase: &str, command_start: &str) -> bool {
    stdout.lines().any(|l| {
        let mut w = l.split_whitespace();
        w.next() == Some(&rank.to_string())
            && w.next() == Some(&iteration.to_string())
            && w.next() == Some(phase)
            && l.contains(&format!("$ {command_start}"))
    })
}

#[test]
fn the_webgym_example_rehearses_and_the_recorder_got_what_plan_renders() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    fs::create_dir_all(&data).unwrap();
    let dir = tmp.path().join("rehearsal");
    let config = Path::new(REPO).join("examples/webgym/rl-node.toml");
    let data_s = data.display().to_string();
    // Another port than the example's 8999, which something on this machine may hold.
    let port = free_port();
    let (out, report) = rehearse_env(
        &config,
        &dir,
        &["--nodes", "3", "--iterations", "1", "--data-path", &data_s],
        &[("RL_NODE_SERVER_PORT", port.to_string())],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert_eq!(exits(&report), vec![Value::from(0); 3], "{all}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The command table: the server before iteration 1, rank 0's and a worker's rollout,
    // the training through llamafactory-cli (FORCE_TORCHRUN) on every rank.
    assert!(stdout.contains("RANK  ITER  PHASE      COMMAND"), "{all}");
    assert!(table_has(&stdout, 0, 0, "server", "vllm serve "), "{all}");
    assert!(table_has(&stdout, 0, 1, "rollout", "python "), "{all}");
    assert!(table_has(&stdout, 2, 1, "rollout", "python "), "{all}");
    assert!(table_has(&stdout, 0, 1, "train", ". "), "{all}");
    assert!(table_has(&stdout, 1, 1, "train", ". "), "{all}");
    // The stand-ins ran in the programs' place and wrote what the phases expect: rank 0's
    // training a checkpoint that rl-node published.
    let train = &step(&report, 0, 1, "train")["calls"][0];
    assert_eq!(train["prog"], "llamafactory-cli");
    assert_eq!(train["env"]["NODE_RANK"], "0");
    assert_eq!(train["env"]["NNODES"], "3");
    let shared = Path::new(report["shared"].as_str().unwrap());
    assert!(shared.join("models/iter-0001").is_dir(), "{all}");
    assert_eq!(report["ports"][0], port);
    let serve = &step(&report, 1, 0, "server")["calls"][0];
    assert_eq!(
        (&serve["prog"], &serve["argv"][1]),
        (&"vllm".into(), &"serve".into())
    );
    // What each stand-in received is what `rl-node plan` renders for that rank.
    let ports: Vec<u64> = report["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap())
        .collect();
    for rank in [0u32, 2] {
        let config_s = config.display().to_string();
        let shared_s = shared.display().to_string();
        let rank_s = rank.to_string();
        let args = [
            "plan",
            "--config",
            &config_s,
            "--log-path",
            &shared_s,
            "--data-path",
            &data_s,
            "--iterations",
            "1",
            "--iteration",
            "1",
            "--rank",
            &rank_s,
            "--json",
        ];
        let env = [("RL_NODE_SERVER_PORT", ports[rank as usize].to_string())];
        let p = rl_node(&args, &env);
        assert!(p.status.success(), "{}", text(&p));
        let plan: Value = serde_json::from_slice(&p.stdout).unwrap();
        let mut compared = Vec::new();
        for planned in plan["steps"].as_array().unwrap() {
            let Some(command) = planned["command"].as_str() else {
                continue;
            };
            let phase = planned["config"]
                .as_str()
                .unwrap()
                .rsplit('.')
                .next()
                .unwrap();
            let iteration = if phase == "server" { 0 } else { 1 };
            let s = step(&report, rank, iteration, phase);
            assert_eq!(
                s["commands"][0], command,
                "rank {rank} {phase}: plan vs node"
            );
            let call = &s["calls"][0];
            for e in planned["env"].as_array().unwrap() {
                let name = e["name"].as_str().unwrap();
                assert_eq!(
                    call["env"][name], e["value"],
                    "rank {rank} {phase}: {name} as planned and as the stand-in received it"
                );
            }
            compared.push(phase.to_string());
        }
        let expected: &[&str] = match rank {
            0 => &["server", "rollout", "eval", "prepare", "train"],
            _ => &["server", "rollout", "eval", "train"],
        };
        assert_eq!(compared, expected, "rank {rank}");
    }
}

/// A small cluster whose commands start programs that do not exist here: the rehearsal
/// stands in for any name.
fn small(extra: &str) -> TestCluster {
    TestCluster::new(
        2,
        &format!("[phases.rollout]\ncommand = \"my-rollout --out {{output}}\"\n{extra}\n"),
    )
}

#[test]
fn a_placeholder_that_renders_empty_is_an_error_and_the_run_still_goes_through() {
    let c = small("[phases.train]\ncommand = \"my-train --data={data_path} --out {output}\"\n");
    let dir = c.dir.path().join("rehearsal");
    let (out, report) = rehearse(&c.config, &dir, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let empty = findings(&report, "error", "empty-placeholder");
    assert_eq!(
        empty,
        ["{data_path} renders empty in the phases.train command"],
        "{all}"
    );
    assert!(
        all.contains("error [empty-placeholder]: {data_path} renders empty"),
        "{all}"
    );
    // The stand-ins wrote JSONL shards rl-node merged, and a checkpoint it published.
    assert_eq!(exits(&report), vec![Value::from(0); 2], "{all}");
    let train = &step(&report, 1, 1, "train")["calls"][0];
    assert_eq!(train["argv"][1], "--data=");
    assert!(c
        .dir
        .path()
        .join("rehearsal/shared/models/iter-0001")
        .is_dir());
    assert!(
        !c.log_path.exists(),
        "the configuration's shared directory was written"
    );
}

#[test]
fn a_taken_server_port_is_an_error_and_rank_0_serves_on_another() {
    let held = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let c = small(&format!(
        "[phases.train]\ncommand = \"my-train --out {{output}}\"\n[server]\ncommand = \"my-server --port {{server_port}}\"\nport = {port}\nstart-timeout = \"30s\"\n"
    ));
    let dir = c.dir.path().join("rehearsal");
    let (out, report) = rehearse(&c.config, &dir, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let taken = findings(&report, "error", "port-taken");
    assert_eq!(taken.len(), 1, "{all}");
    assert!(
        taken[0].starts_with(&format!("server.port {port} is already taken")),
        "{all}"
    );
    assert_eq!(exits(&report), vec![Value::from(0); 2], "{all}");
    let server = &step(&report, 0, 0, "server")["calls"][0];
    assert_eq!(server["prog"], "my-server");
    assert_ne!(
        server["env"]["RL_NODE_SERVER_PORT"],
        port.to_string().as_str()
    );
    drop(held);
}

#[test]
fn a_path_outside_the_shared_directory_is_a_warning() {
    let c = small(
        "[phases.train]\ncommand = \"my-train --out {output} --cache /nonexistent-rl-node-rehearse/cache\"\n",
    );
    let dir = c.dir.path().join("rehearsal");
    let (out, report) = rehearse(&c.config, &dir, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    let outside = findings(&report, "warning", "outside-shared");
    assert_eq!(outside.len(), 1, "{all}");
    assert!(
        outside[0].starts_with("the phases.train command names /nonexistent-rl-node-rehearse/cache, outside the shared directory"),
        "{all}"
    );
    assert!(!Path::new("/nonexistent-rl-node-rehearse").exists());
}

#[test]
fn an_input_nothing_writes_is_an_error_and_the_prepare_stand_in_writes_it() {
    let train =
        "[phases.train]\ncommand = \". {log_path}/prepared/env.sh && my-train --out {output}\"\n";
    let c = small(train);
    let dir = c.dir.path().join("rehearsal");
    let (out, report) = rehearse(&c.config, &dir, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let missing = findings(&report, "error", "missing-input");
    let env_sh = dir.join("shared/prepared/env.sh");
    assert_eq!(
        missing,
        [format!("the phases.train command reads {}, which nothing before it writes (rl-node does not, and there is no phases.prepare)", env_sh.display())],
        "{all}"
    );
    // With a prepare command, its stand-in writes it as the real one would, and the
    // training runs.
    let c = small(&format!(
        "{train}[phases.prepare]\ncommand = \"my-prepare\"\n"
    ));
    let dir = c.dir.path().join("rehearsal");
    let (out, report) = rehearse(&c.config, &dir, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(
        findings(&report, "error", "missing-input").is_empty(),
        "{all}"
    );
    let prepare = &step(&report, 0, 1, "prepare")["calls"][0];
    let env_sh = dir.join("shared/prepared/env.sh").display().to_string();
    assert_eq!(prepare["wrote"], serde_json::json!([env_sh]), "{all}");
    assert_eq!(exits(&report), vec![Value::from(0); 2], "{all}");
}

#[test]
fn checkpoints_that_would_fill_the_disk_are_an_error() {
    let c = small("[phases.train]\ncommand = \"my-train --out {output}\"\n[phases.handoff]\nkeep-last = 2\nkeep-eval = false\n");
    fs::create_dir_all(&c.log_path).unwrap();
    let dir = c.dir.path().join("rehearsal");
    let log = c.log_path.display().to_string();
    // 100 PB a checkpoint.
    let (out, report) = rehearse(
        &c.config,
        &dir,
        &["--log-path", &log, "--model-size", "100000000"],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let full = findings(&report, "error", "disk-fill");
    assert_eq!(full.len(), 1, "{all}");
    assert!(
        full[0].starts_with("the checkpoints would fill the disk: keep-last = 2, plus the one served during a hand-off and the training output being written: 4 × 100000000.0 GB (--model-size)"),
        "{all}"
    );
    // The user's shared directory is measured, never written.
    assert_eq!(fs::read_dir(&c.log_path).unwrap().count(), 0);
}

#[test]
fn a_program_named_by_its_path_is_not_run() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"/opt/nowhere/rollout.py --out {output}\"\n",
    );
    let dir = c.dir.path().join("rehearsal");
    let (out, report) = rehearse(&c.config, &dir, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let by_path = findings(&report, "error", "program-by-path");
    assert_eq!(by_path.len(), 1, "{all}");
    assert!(
        by_path[0].contains("would run /opt/nowhere/rollout.py"),
        "{all}"
    );
    assert!(exits(&report).is_empty(), "a node was started: {all}");
    assert!(!dir.join("shared/logs").exists());
}

#[test]
fn bad_input_is_a_usage_error_naming_the_flag() {
    let c = small("");
    let config = c.config.display().to_string();
    for (args, flag) in [
        (&["--iterations", "3"][..], "--iterations 3"),
        (&["--nodes", "0"][..], "--nodes 0"),
        (&["--model-size", "0"][..], "--model-size"),
    ] {
        let out = rl_node(
            &[&["rehearse", "--config", &config][..], args].concat(),
            &[],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
