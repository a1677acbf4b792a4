//! examples/trackers/follow_metrics.py with the real tracker packages (docs/metrics.md,
//! "Into W&B or TensorBoard"): a 2-node cluster's metrics.jsonl, followed from before the
//! file exists, arrives in W&B (offline) and TensorBoard with `step = iteration`, each
//! iteration once, also across a restart of the script and a line still being written.
//!
//! The packages live in a virtualenv made by `scripts/trackers-env` (scripts/test runs
//! it); without it these tests fail, naming that command, rather than skip.

mod common;
use common::cluster::*;
use serde_json::Value;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

/// Each rank writes two records with a numeric `reward` that depends on the iteration
/// and the rank, so each iteration's `rollout/reward_mean` differs.
const COMMANDS: &str = r#"
[phases.rollout]
command = '''printf '{"reward": {iteration}.{rank}5}\n{"reward": -{iteration}}\n' > {output}'''
[phases.train]
command = "mkdir -p {output}/checkpoint-1; echo {iteration} > {output}/checkpoint-1/w"
[observe]
metrics-fields = ["reward"]
"#;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The virtualenv's python: fails (not skips) when scripts/trackers-env has not run.
fn python() -> PathBuf {
    let venv = std::env::var_os("RL_NODE_TRACKERS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv-trackers"));
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "no {}: run `scripts/trackers-env` (it installs wandb and tensorboard into {})",
        python.display(),
        venv.display()
    );
    python
}

/// follow_metrics.py as a child process, its stderr in a file for the failure message.
struct Follower {
    child: Child,
    stderr: PathBuf,
}

impl Follower {
    fn start(c: &TestCluster, tracker: &str, args: &[&str]) -> Follower {
        let stderr = c
            .dir
            .path()
            .join(format!("follow-{tracker}-{}.err", nonce()));
        let child = Command::new(python())
            .arg(repo().join("examples/trackers/follow_metrics.py"))
            .args(["--log-path", c.log_path.to_str().unwrap(), "--to", tracker])
            .args(["--poll", "0.1", "--rl-node", BIN])
            .args([
                "--state",
                c.dir.path().join("follow.state").to_str().unwrap(),
            ])
            .args(["--logdir", c.dir.path().join("tb").to_str().unwrap()])
            .args(args)
            .env("WANDB_MODE", "offline")
            .env("WANDB_DIR", c.dir.path())
            .env("WANDB_SILENT", "true")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Follower { child, stderr }
    }

    fn wait_ok(mut self) {
        let mut status = None;
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_until(LIMIT, "follow_metrics.py to end", || {
                status = self.child.try_wait().unwrap();
                status.is_some()
            })
        }));
        let err = fs::read_to_string(&self.stderr).unwrap_or_default();
        if waited.is_err() {
            let _ = self.child.kill();
            panic!("follow_metrics.py did not end within {LIMIT:?}; stderr:\n{err}");
        }
        assert!(
            status.unwrap().success(),
            "follow_metrics.py failed:\n{err}"
        );
    }
}

fn nonce() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// What the tracker holds: {series: {"group", "scalars": {key: [[step, value], ...]}}}.
fn read_back(c: &TestCluster, tracker: &str) -> Value {
    let root = match tracker {
        "wandb" => c.dir.path().to_path_buf(),
        _ => c.dir.path().join("tb"),
    };
    let out = Command::new(python())
        .arg(repo().join("tests/fixtures/read_trackers.py"))
        .arg(tracker)
        .arg(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "read_trackers.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn metrics_lines(c: &TestCluster) -> Vec<Value> {
    fs::read_to_string(c.log_path.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The tracker has exactly one series, the run's, in the run's group for W&B, and for
/// each key, one point per line of `lines` with the line's iteration and value.
fn assert_logged(c: &TestCluster, tracker: &str, lines: &[Value]) {
    let got = read_back(c, tracker);
    let run = lines[0]["run"].as_str().unwrap();
    let series = got.as_object().unwrap();
    assert_eq!(series.keys().collect::<Vec<_>>(), [run], "{got}");
    if tracker == "wandb" {
        assert_eq!(got[run]["group"], run, "{got}");
    }
    // TensorBoard keeps float32: compare to its precision.
    let tolerance = if tracker == "wandb" { 1e-12 } else { 1e-6 };
    for key in ["rollout/reward_mean", "time/iteration_s", "rollout/records"] {
        let points = got[run]["scalars"][key]
            .as_array()
            .unwrap_or_else(|| panic!("no {key} in {got}"));
        let steps: Vec<u64> = points.iter().map(|p| p[0].as_u64().unwrap()).collect();
        let want: Vec<u64> = lines
            .iter()
            .map(|l| l["iteration"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, want, "{key}: {got}");
        for (p, l) in points.iter().zip(lines) {
            let (v, w) = (p[1].as_f64().unwrap(), l[key].as_f64().unwrap());
            assert!(
                (v - w).abs() <= tolerance * w.abs().max(1.0),
                "{key}: {v} != {w}"
            );
        }
    }
}

/// The cluster runs 3 iterations while the script follows the file from before it
/// exists; a second start of the script logs nothing again; a line still being written
/// is logged once it is complete, and only then.
fn follow_a_run(tracker: &str, until: &[&str]) {
    python();
    let c = TestCluster::new(2, COMMANDS);
    let follower = Follower::start(&c, tracker, until);
    let mut nodes = c.spawn_all(&["--iterations", "3"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {} failed:\n{}", n.rank, n.stderr());
    }
    follower.wait_ok();
    let lines = metrics_lines(&c);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_logged(&c, tracker, &lines);

    // A restarted script with the same state logs nothing twice.
    Follower::start(&c, tracker, &["--iterations", "3"]).wait_ok();
    assert_logged(&c, tracker, &lines);

    // Iteration 4's line, torn: the script stops at iteration 3 without taking it.
    let mut fourth = lines[2].clone();
    fourth["iteration"] = 4.into();
    fourth["rollout/reward_mean"] = 4.25.into();
    let text = format!("{fourth}\n");
    let (head, tail) = text.split_at(text.len() / 2);
    let mut file = fs::OpenOptions::new()
        .append(true)
        .open(c.log_path.join("metrics.jsonl"))
        .unwrap();
    file.write_all(head.as_bytes()).unwrap();
    Follower::start(&c, tracker, &["--iterations", "3"]).wait_ok();
    assert_logged(&c, tracker, &lines);
    // Completed, it is logged once, with its values.
    let waiting = Follower::start(&c, tracker, &["--iterations", "4"]);
    file.write_all(tail.as_bytes()).unwrap();
    waiting.wait_ok();
    let mut all = lines.clone();
    all.push(fourth);
    assert_logged(&c, tracker, &all);
}

#[test]
fn wandb_offline_gets_each_iteration_once_with_the_files_numbers() {
    follow_a_run("wandb", &["--until-complete"]);
}

#[test]
fn tensorboard_gets_each_iteration_once_with_the_files_numbers() {
    follow_a_run("tensorboard", &["--iterations", "3"]);
}

/// A pipelined run: the two clusters' lines interleave (the rollout cluster runs ahead)
/// and each cluster has its own `run` id, yet each cluster is its own series with steps
/// 1..3: a W&B run per cluster, both in the `--group` given, or a TensorBoard directory
/// per `run` with a tag prefix per cluster.
fn follow_a_pipelined_run(tracker: &str) {
    python();
    let c = TestCluster::pipelined(&format!("{COMMANDS}\n[pipeline]\nstaleness = 1\n"));
    // W&B ends with the run, TensorBoard at iteration 3 of both clusters.
    let until = match tracker {
        "wandb" => &["--until-complete", "--group", "both"][..],
        _ => &["--iterations", "3", "--group", "both"][..],
    };
    let follower = Follower::start(&c, tracker, until);
    let mut nodes = c.spawn_rollout_and_update(3);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    follower.wait_ok();
    let lines = metrics_lines(&c);
    let got = read_back(&c, tracker);
    assert_eq!(got.as_object().unwrap().len(), 2, "{got}");
    for side in ["rollout", "update"] {
        let mine: Vec<&Value> = lines.iter().filter(|l| l["cluster"] == side).collect();
        let run = mine[0]["run"].as_str().unwrap();
        let (series, key) = match tracker {
            "wandb" => (format!("{run}-{side}"), "time/iteration_s".to_string()),
            _ => (run.to_string(), format!("{side}/time/iteration_s")),
        };
        if tracker == "wandb" {
            assert_eq!(got[&series]["group"], "both", "{got}");
        }
        let points = got[&series]["scalars"][&key]
            .as_array()
            .unwrap_or_else(|| panic!("no {series} {key} in {got}"));
        assert_eq!(points.len(), 3, "{side}: {got}");
        for (p, l) in points.iter().zip(&mine) {
            assert_eq!(p[0], l["iteration"], "{side}: {got}");
            let (v, w) = (
                p[1].as_f64().unwrap(),
                l["time/iteration_s"].as_f64().unwrap(),
            );
            assert!((v - w).abs() <= 1e-6 * w.max(1.0), "{side}: {v} != {w}");
        }
    }
}

#[test]
fn wandb_gets_a_pipelined_runs_clusters_as_two_runs_of_one_group() {
    follow_a_pipelined_run("wandb");
}

#[test]
fn tensorboard_gets_a_pipelined_runs_clusters_under_their_own_prefix() {
    follow_a_pipelined_run("tensorboard");
}
