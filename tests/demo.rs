//! `rl-node demo` and its toy workload (`rl-node __toy …`), driven as real processes.
//! Results are read from the files the run leaves behind, not from the demo's output.

use rl_node::demo::toy;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rl-node");

fn rl_node() -> Command {
    let mut cmd = Command::new(BIN);
    // Keep the test's own environment from leaking configuration in.
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_")
            || ["NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"].contains(&k.as_str())
        {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// Wait for `child` to exit within `limit`; kill it and fail the test otherwise.
fn wait_output(mut child: Child, limit: Duration, what: &str) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} still running after {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_demo(dir: &Path, extra: &[&str], limit: Duration) -> Output {
    let child = rl_node()
        .arg("demo")
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_output(child, limit, "rl-node demo")
}

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The (task, action, reward) lines of an iteration's merged train trajectories.
fn train_lines(shared: &Path, iteration: u64) -> Vec<(u64, u64, f64)> {
    let path = shared
        .join("rollouts")
        .join(format!("iter-{iteration:04}"))
        .join("train.jsonl");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["task"].as_u64().unwrap(),
                v["action"].as_u64().unwrap(),
                v["reward"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn mean(lines: &[(u64, u64, f64)]) -> f64 {
    lines.iter().map(|l| l.2).sum::<f64>() / lines.len() as f64
}

fn eval_accuracy(shared: &Path, iteration: u64) -> Option<f64> {
    let path = shared
        .join("rollouts")
        .join(format!("iter-{iteration:04}"))
        .join("eval.jsonl");
    let text = fs::read_to_string(path).ok()?;
    let v: Vec<bool> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["correct"]
                .as_bool()
                .unwrap()
        })
        .collect();
    Some(v.iter().filter(|c| **c).count() as f64 / v.len() as f64)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn weighted_split_sums_exactly_for_random_weights() {
    let mut rng = toy::SplitMix64::new(42);
    for _ in 0..5000 {
        let n = 1 + (rng.next_u64() % 12) as usize;
        let mut weights: Vec<u64> = (0..n).map(|_| rng.next_u64() % 10).collect();
        if weights.iter().all(|&w| w == 0) {
            weights[0] = 1;
        }
        let total = rng.next_u64() % 500;
        let counts = toy::split_counts(total, &weights);
        assert_eq!(
            counts.iter().sum::<u64>(),
            total,
            "{weights:?} over {total}: {counts:?}"
        );
        // Contiguous and covering: rank r's range starts where rank r-1's ends.
        let mut next = 0;
        for r in 0..n {
            let range = toy::split_range(total, &weights, r);
            assert_eq!(range.start, next);
            if weights[r] == 0 {
                assert!(range.is_empty());
            }
            next = range.end;
        }
        assert_eq!(next, total);
    }
}

#[test]
fn demo_learns_and_is_deterministic() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let args = [
        "--nodes",
        "3",
        "--iterations",
        "4",
        "--eval-interval",
        "2",
        "--seed",
        "7",
    ];
    let out = run_demo(a.path(), &args, Duration::from_secs(45));
    assert!(out.status.success(), "{}", show(&out));
    let shared_a = a.path().join("shared");
    let curve: Vec<f64> = (1..=4).map(|i| mean(&train_lines(&shared_a, i))).collect();
    assert!(
        curve[3] >= curve[0] + 0.25,
        "the mean reward did not rise clearly: {curve:?}"
    );
    assert!(
        curve[0] < 0.45,
        "iteration 1 should be near chance (0.25): {curve:?}"
    );
    for i in 1..=4 {
        assert_eq!(train_lines(&shared_a, i).len(), 32 * 4, "iteration {i}");
    }
    // Eval ran on iterations 1 and 3 only, and got better.
    let e1 = eval_accuracy(&shared_a, 1).expect("eval in iteration 1");
    let e3 = eval_accuracy(&shared_a, 3).expect("eval in iteration 3");
    assert!(eval_accuracy(&shared_a, 2).is_none() && eval_accuracy(&shared_a, 4).is_none());
    assert!(e3 > e1, "eval accuracy {e1} -> {e3}");
    // Every node's checkpoint hand-off happened: the last model is step 4.
    let latest = fs::read_to_string(shared_a.join("models").join("LATEST")).unwrap();
    let model = shared_a.join("models").join(latest.trim());
    let policy: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(model.join("policy.json")).unwrap()).unwrap();
    assert_eq!(policy["step"], 4, "{}", model.display());
    // The demo drew its run (`rl-node timeline`) and said where: a lane per node.
    let timeline = shared_a.join("timeline.html");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("timeline: {}", timeline.display())),
        "{}",
        show(&out)
    );
    let page = fs::read_to_string(&timeline).unwrap();
    assert!(
        page.contains(r#"data-lanes="3""#),
        "{}",
        &page[..page.len().min(2000)]
    );

    let out = run_demo(b.path(), &args, Duration::from_secs(45));
    assert!(out.status.success(), "{}", show(&out));
    let shared_b = b.path().join("shared");
    for i in 1..=4 {
        assert_eq!(
            train_lines(&shared_a, i),
            train_lines(&shared_b, i),
            "iteration {i} differs between two runs with the same seed"
        );
    }
}

/// The `model_version` and `staleness` every line of an iteration's merged train
/// trajectories carries (distinct pairs).
fn stamped_versions(shared: &Path, iteration: u64) -> Vec<(u64, u64)> {
    let path = shared
        .join("rollouts")
        .join(format!("iter-{iteration:04}"))
        .join("train.jsonl");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut v: Vec<(u64, u64)> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let field = |k: &str| {
                v[k].as_u64()
                    .unwrap_or_else(|| panic!("{}: a line without {k}: {l}", path.display()))
            };
            (field("model_version"), field("staleness"))
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn demo_pipeline_compares_with_the_synchronous_loop_and_still_learns() {
    let d = tempfile::tempdir().unwrap();
    let args = [
        "--pipeline",
        "--nodes",
        "4",
        "--iterations",
        "4",
        "--eval-interval",
        "2",
        "--seed",
        "7",
        "--pace",
        "0.2",
    ];
    let out = run_demo(d.path(), &args, Duration::from_secs(150));
    assert!(out.status.success(), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);

    // The ratio line. Its value depends on the machine's load: the benchmark
    // (scripts/bench-pipeline) judges it, the test only that it was measured.
    let line = stdout
        .lines()
        .find(|l| l.starts_with("time per iteration: pipelined"))
        .unwrap_or_else(|| panic!("no ratio line\n{}", show(&out)));
    let ratio: f64 = line
        .split("ratio ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no ratio in {line:?}"));
    assert!(ratio > 0.0 && ratio.is_finite(), "{line}");
    assert!(line.contains("2 + 2 nodes vs 4 nodes"), "{line}");

    // Both clusters' lanes were shown (output is not a terminal: the compact form).
    assert!(
        stdout.lines().any(|l| l.contains("rollout: r0 it")
            && l.contains("r1 it")
            && l.contains("|| update: r0 it")),
        "{}",
        show(&out)
    );
    assert!(stdout.contains("update rank 1: 0"), "{}", show(&out));

    // The pipelined run learned from stale-by-one rollouts, and said so.
    let piped = d.path().join("pipelined").join("shared");
    let sync = d.path().join("sync").join("shared");
    let curve: Vec<f64> = (1..=4).map(|i| mean(&train_lines(&piped, i))).collect();
    assert!(
        curve[3] >= curve[0] + 0.2,
        "the pipelined run's mean reward did not rise clearly: {curve:?}"
    );
    assert!(stdout.contains("it still rises"), "{}", show(&out));
    for i in 1..=4 {
        assert_eq!(train_lines(&piped, i).len(), 32 * 4, "iteration {i}");
    }

    // Every trajectory says which model rolled it out: with staleness 1, iteration i ran
    // on the model of iteration i-2 (the base model, version 0, for the first two); in
    // the synchronous loop on that of i-1.
    for i in 1..=4u64 {
        let exact = i.saturating_sub(2);
        let lag = if i >= 2 { 1 } else { 0 };
        assert_eq!(stamped_versions(&piped, i), [(exact, lag)], "iteration {i}");
        assert_eq!(stamped_versions(&sync, i), [(i - 1, 0)], "iteration {i}");
    }
    // Iteration 1 ran on the base model in both runs, with the same seeds: the same
    // samples, however the tasks were split between the nodes.
    let sorted = |mut v: Vec<(u64, u64, f64)>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    };
    assert_eq!(
        sorted(train_lines(&piped, 1)),
        sorted(train_lines(&sync, 1))
    );
}

#[test]
fn demo_pipeline_refuses_an_odd_node_count() {
    for n in ["3", "1"] {
        let d = tempfile::tempdir().unwrap();
        let out = run_demo(
            d.path(),
            &["--pipeline", "--nodes", n],
            Duration::from_secs(20),
        );
        assert_eq!(out.status.code(), Some(2), "{}", show(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("even number, at least 2"), "{err}");
    }
}

/// Sizes no toy run needs, which used to abort allocating the toy's tables (or run for
/// hours), are refused at once naming the flag and its range.
#[test]
fn demo_refuses_absurd_sizes_naming_the_flag() {
    for (flags, says) in [
        (
            &["--samples", "4294967295"][..],
            "--samples 4294967295: the demo takes 1 to 1000",
        ),
        (
            &["--tasks", "4294967295", "--actions", "4294967295"][..],
            "--tasks 4294967295: the demo takes 1 to 100000",
        ),
        (
            &["--iterations", "100000000000"][..],
            "--iterations 100000000000: the demo takes 1 to 1000",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let out = run_demo(d.path(), flags, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", show(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{flags:?}: {err}");
    }
}

#[test]
fn demo_refuses_a_non_empty_dir_and_bad_kill_spec() {
    let d = tempfile::tempdir().unwrap();
    fs::write(d.path().join("x"), "").unwrap();
    let out = run_demo(d.path(), &[], Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not empty"),
        "{}",
        show(&out)
    );
    let e = tempfile::tempdir().unwrap();
    let out = run_demo(
        e.path(),
        &["--kill-node", "1@trainig"],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown phase"),
        "{}",
        show(&out)
    );
}

#[test]
fn demo_kill_node_stops_the_others_then_recovers() {
    let d = tempfile::tempdir().unwrap();
    let out = run_demo(
        d.path(),
        &["--iterations", "3", "--kill-node", "1@training"],
        Duration::from_secs(50),
    );
    assert!(out.status.success(), "{}", show(&out));
    // Ranks 0 and 2 stopped in the first start. Killing rank 1 inside the training
    // all-reduce races two true reports: its heartbeat going still (after dead-after), or
    // a peer's trainer failing at once on the broken connection; the first one wins, as
    // with a real torchrun collective.
    for r in [0, 2] {
        let log = fs::read_to_string(d.path().join(format!("node-{r}.log"))).unwrap();
        let dead = log.contains("rank 1 on") && log.contains("is dead");
        let collective = log.contains("failed in phase 10 (training) of iteration 2");
        assert!(dead || collective, "node-{r}.log:\n{log}");
    }
    // The restart is a second generation that completed every iteration.
    let st = rl_node()
        .args(["status", "--json", "--log-path"])
        .arg(d.path().join("shared"))
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(s["gen"], 2, "{s}");
    for r in s["ranks"].as_array().unwrap() {
        assert_eq!(r["state"], "done", "{s}");
        assert_eq!(r["iteration"], 3, "{s}");
    }
}

/// `--min-nodes 2 --kill-node R@PHASE`: the survivors drop the killed rank, regroup in
/// the same processes and finish every iteration; nobody is restarted. Returns the demo's
/// stdout after checking what every elastic run must show.
fn elastic_kill(dir: &Path, kill: &str, victim: u32) -> String {
    let out = run_demo(
        dir,
        &[
            "--iterations",
            "4",
            "--seed",
            "7",
            "--pace",
            "0.3",
            "--min-nodes",
            "2",
            "--kill-node",
            kill,
        ],
        Duration::from_secs(150),
    );
    assert!(out.status.success(), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    // One start of the nodes, no restart: the survivors exited 0, the victim was killed.
    assert_eq!(
        stdout.matches("started 3 node(s)").count(),
        1,
        "{}",
        show(&out)
    );
    assert!(!stdout.contains(">> restarting"), "{}", show(&out));
    let codes: Vec<String> = (0..3)
        .map(|r| format!("rank {r}: {}", if r == victim { 137 } else { 0 }))
        .collect();
    assert!(
        stdout.contains(&format!("exit codes (nodes): {}", codes.join(", "))),
        "{}",
        show(&out)
    );
    assert!(
        stdout.contains(&format!(
            "went on: after rank {victim} was killed with SIGKILL, the other 2 node(s) regrouped without it and completed every iteration through 4 without a restart"
        )),
        "{}",
        show(&out)
    );
    // Every survivor's log says it was one process from start to end: one join, of
    // generation 1, and then the regroup into generation 2.
    for r in (0..3).filter(|r| *r != victim) {
        let log = fs::read_to_string(dir.join(format!("node-{r}.log"))).unwrap();
        assert_eq!(
            log.matches("generation 1 of run").count(),
            1,
            "node-{r}.log:\n{log}"
        );
        assert!(
            log.contains(&format!("generation 1: rank {victim} lost"))
                && log.contains("joined generation 2 of "),
            "node-{r}.log:\n{log}"
        );
    }
    // The run is complete in generation 2 (a restart would be generation 3): every
    // iteration merged all 32 x 4 trajectories, and the last model is step 4.
    let shared = dir.join("shared");
    let st = rl_node()
        .args(["status", "--json", "--log-path"])
        .arg(&shared)
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(s["gen"], 2, "{s}");
    for i in 1..=4 {
        assert_eq!(train_lines(&shared, i).len(), 32 * 4, "iteration {i}");
        // Its table row was printed.
        assert!(
            stdout
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{i}   0."))),
            "no row for iteration {i}\n{}",
            show(&out)
        );
    }
    let latest = fs::read_to_string(shared.join("models").join("LATEST")).unwrap();
    assert_eq!(latest.trim(), "iter-0004");
    let policy: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(shared.join("models/iter-0004/policy.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(policy["step"], 4);
    let curve: Vec<f64> = (1..=4).map(|i| mean(&train_lines(&shared, i))).collect();
    assert!(
        curve[3] >= curve[0] + 0.25,
        "the mean reward did not rise clearly: {curve:?}"
    );
    stdout
}

/// The printed "what moved" line that starts with `start`.
fn moved_line<'a>(stdout: &'a str, start: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?}:\n{stdout}"))
}

#[test]
fn demo_elastic_worker_killed_mid_rollout_goes_on_without_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let stdout = elastic_kill(d.path(), "2@rollout", 2);
    assert!(
        stdout.contains(">> kill -9 rank 2 (pid ")
            && stdout.contains("in phase 1 (train-rollout) of iteration 2;"),
        "{stdout}"
    );
    assert!(
        stdout.contains("what moved (from the nodes' event logs"),
        "{stdout}"
    );
    let lost = moved_line(&stdout, "  generation 1: rank 2 lost (heartbeat still for ");
    assert!(lost.ends_with("; seen by rank 0, rank 1"), "{lost}");
    let formed = moved_line(
        &stdout,
        "  generation 2 formed of rank 0, rank 1: rank 0 coordinates, resuming at iteration 2; its members met ",
    );
    assert!(
        formed.ends_with("s after the kill (dead-after 3s)"),
        "{formed}"
    );
    // Rank 2 was killed before it committed iteration 2's rollout: rank 1 ran it, and
    // every later one, train and eval, under rank 2's number.
    assert!(
        stdout.contains(
            "\n  rank 1 stood in for rank 2: its train rollout in iterations 2-4; its eval rollout in iteration 3\n"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            ">> generation 2: rank 0, rank 1 regrouped without rank 2 (rank 0 coordinates)"
        ),
        "{stdout}"
    );
}

#[test]
fn demo_elastic_rank_0_killed_in_training_goes_on_without_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let stdout = elastic_kill(d.path(), "0@training", 0);
    let lost = moved_line(&stdout, "  generation 1: rank 0 lost (heartbeat still for ");
    assert!(lost.ends_with("; seen by rank 1, rank 2"), "{lost}");
    moved_line(
        &stdout,
        "  generation 2 formed of rank 1, rank 2: rank 1 coordinates, resuming at iteration 2; its members met ",
    );
    // Rank 0 had committed iteration 2's rollout: its stand-in (rank 2: the coordinator
    // is dealt dropped ranks last) runs its rollouts from iteration 3 on.
    assert!(
        stdout.contains(
            "\n  rank 2 stood in for rank 0: its train rollout in iterations 3-4; its eval rollout in iteration 3\n"
        ),
        "{stdout}"
    );
    // Iteration 2's training, broken by the death, was redone by the two survivors.
    let redone = d.path().join("shared/logs/iter-0002/rank-1.train.log");
    let log = fs::read_to_string(&redone).unwrap();
    assert!(
        log.contains("/train/iter-0002/gen-2 ") && log.contains("toy train: rank 0 of 2:"),
        "{}:\n{log}",
        redone.display()
    );
}

/// `--min-nodes` without sense is refused with exit 2, naming the flag.
#[test]
fn demo_refuses_min_nodes_it_cannot_use() {
    for (flags, says) in [
        (
            &["--min-nodes", "3"][..],
            "--min-nodes 3: the nodes go on while at least K are left, so K must be 1 to 2",
        ),
        (
            &["--pipeline", "--min-nodes", "1"][..],
            "--min-nodes is not available with --pipeline",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let out = run_demo(d.path(), flags, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", show(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(
            fs::read_dir(d.path()).unwrap().next().is_none(),
            "{flags:?}: nothing is written before the refusal"
        );
    }
}

#[test]
fn toy_pieces_work_on_their_own() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("m0");
    let st = rl_node()
        .args([
            "__toy",
            "init-model",
            "--tasks",
            "12",
            "--actions",
            "3",
            "--out",
        ])
        .arg(&model)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", show(&st));

    // A server on a missing model refuses to start.
    let out = rl_node()
        .args(["__toy", "server", "--port", "1", "--model"])
        .arg(d.path().join("nope"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("policy.json is missing"));

    let port = free_port();
    let mut server = rl_node()
        .args([
            "__toy",
            "server",
            "--seed",
            "3",
            "--port",
            &port.to_string(),
            "--model",
        ])
        .arg(&model)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let health = format!("http://127.0.0.1:{port}/health");
    let deadline = Instant::now() + Duration::from_secs(20);
    while ureq::get(&health).call().is_err() {
        assert!(
            Instant::now() < deadline,
            "the toy server never answered {health}"
        );
        assert!(
            server.try_wait().unwrap().is_none(),
            "the toy server exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Three ranks weighted 2,1,1 over 12 tasks: 6, 3 and 3 tasks, 2 samples each.
    let mut shards = Vec::new();
    for r in 0..3 {
        let out_file = d.path().join(format!("rank-{r}.jsonl"));
        let st = rl_node()
            .args([
                "__toy",
                "rollout",
                "--server",
                &format!("http://127.0.0.1:{port}"),
            ])
            .args([
                "--split",
                "train",
                "--rank",
                &r.to_string(),
                "--num-nodes",
                "3",
            ])
            .args(["--rank-weights", "2,1,1", "--iteration", "1", "--seed", "3"])
            .args(["--samples", "2", "--tasks", "12", "--out"])
            .arg(&out_file)
            .output()
            .unwrap();
        assert!(st.status.success(), "{}", show(&st));
        let text = fs::read_to_string(&out_file).unwrap();
        assert_eq!(text.lines().count(), [12, 6, 6][r], "rank {r}");
        shards.push(text);
    }
    let train = d.path().join("train.jsonl");
    fs::write(&train, shards.concat()).unwrap();
    let eval = d.path().join("eval.jsonl");
    let st = rl_node()
        .args([
            "__toy",
            "rollout",
            "--server",
            &format!("http://127.0.0.1:{port}"),
        ])
        .args(["--split", "eval", "--tasks", "12", "--seed", "3", "--out"])
        .arg(&eval)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", show(&st));
    let score = rl_node()
        .args(["__toy", "eval-score", "--file"])
        .arg(&eval)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&score.stdout).starts_with("accuracy "),
        "{}",
        show(&score)
    );
    let _ = server.kill();
    let _ = server.wait();

    // Two-rank data-parallel training over TCP gives the same model as one rank.
    let master_port = free_port().to_string();
    let spawn_rank = |rank: u32, nnodes: u32, out: &PathBuf| -> Child {
        rl_node()
            .args(["__toy", "train", "--lr", "2", "--trajectories"])
            .arg(&train)
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(out)
            .env("NNODES", nnodes.to_string())
            .env("NODE_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &master_port)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let two = d.path().join("two");
    let r0 = spawn_rank(0, 2, &two);
    let r1 = spawn_rank(1, 2, &two);
    let o1 = wait_output(r1, Duration::from_secs(30), "train rank 1");
    let o0 = wait_output(r0, Duration::from_secs(30), "train rank 0");
    assert!(o0.status.success(), "{}", show(&o0));
    assert!(o1.status.success(), "{}", show(&o1));
    let one = d.path().join("one");
    let o = wait_output(
        spawn_rank(0, 1, &one),
        Duration::from_secs(30),
        "train alone",
    );
    assert!(o.status.success(), "{}", show(&o));
    let load = |dir: &Path| toy::Policy::load(&dir.join(toy::CHECKPOINT_DIR)).unwrap();
    let (p2, p1) = (load(&two), load(&one));
    assert_eq!(p2.step, 1);
    for (a, b) in p2.logits.iter().flatten().zip(p1.logits.iter().flatten()) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    assert!(
        p2.logits.iter().flatten().any(|x| *x != 0.0),
        "the update changed nothing"
    );
}

#[test]
fn training_fails_promptly_when_a_peer_never_connects() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("m0");
    toy::Policy::uniform(4, 2).save(&model).unwrap();
    let train = d.path().join("train.jsonl");
    fs::write(
        &train,
        "{\"task\":0,\"action\":1,\"reward\":1.0}\n{\"task\":1,\"action\":0,\"reward\":0.0}\n",
    )
    .unwrap();
    let port = free_port().to_string();
    let run = |rank: &str, port: &str| -> Output {
        let child = rl_node()
            .args(["__toy", "train", "--peer-timeout", "2", "--trajectories"])
            .arg(&train)
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(d.path().join("out"))
            .env("NNODES", "2")
            .env("NODE_RANK", rank)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_output(child, Duration::from_secs(20), "toy train")
    };
    // Rank 0 of 2 whose rank 1 never connects.
    let started = Instant::now();
    let out = run("0", &port);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1 did not connect"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(!d.path().join("out").join(toy::CHECKPOINT_DIR).exists());
    // Rank 1 of 2 pointed at a port where no rank 0 listens.
    let out = run("1", &port);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect to rank 0"), "{err}");

    // A peer that connects and then dies: rank 0 fails at once, not after the timeout.
    let child = rl_node()
        .args(["__toy", "train", "--peer-timeout", "30", "--trajectories"])
        .arg(&train)
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(d.path().join("out"))
        .env("NNODES", "2")
        .env("NODE_RANK", "0")
        .env("MASTER_PORT", &port)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let started = Instant::now();
    loop {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())) {
            drop(s);
            break;
        }
        assert!(Instant::now() < deadline, "rank 0 never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = wait_output(child, Duration::from_secs(20), "toy train rank 0");
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut err = String::new();
    (&out.stderr[..]).read_to_string(&mut err).unwrap();
    assert!(err.contains("closed the connection"), "{err}");
}
