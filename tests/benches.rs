//! Every benchmark script of scripts/ passes, in its tiny mode, against the release binary.
//!
//! The figures in README.md and docs/ come from these scripts, and the scripts read what the
//! node writes (file names, events, log lines): a change of the node can break a script
//! without any other test noticing, and the breakage would surface only on the day someone
//! re-measures. `BENCH_TINY=1` runs each script's code paths at the smallest sizes, with
//! its own consistency checks, and prints no figure ("tiny: not a figure"). The scripts
//! measure the release build (as the figures do), which scripts/test builds before the
//! suite; without it these tests fail rather than skip.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where the scripts look for the release binary (CARGO_TARGET_DIR, else target/).
fn release_bin() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|t| root.join(t))
        .unwrap_or_else(|| root.join("target"));
    target.join("release").join("rl-node")
}

/// `scripts/NAME ARGS` with BENCH_TINY=1: its output (stdout and stderr), after checking
/// that it exited 0 within `limit` and said it printed no figure.
fn tiny(name: &str, args: &[&str], limit: Duration) -> String {
    let bin = release_bin();
    assert!(
        common::is_executable(&bin),
        "{} is missing: run cargo build --release (the benchmark scripts measure the release \
         build; scripts/test builds it before the suite)",
        bin.display()
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out");
    let out = std::fs::File::create(&out_path).unwrap();
    let mut cmd = Command::new(root.join("scripts").join(name));
    cmd.args(args)
        .current_dir(root)
        .env("BENCH_TINY", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    // Its own process group, so that a script past its deadline goes with its nodes.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("scripts/{name}: {e}"));
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = common::kill(-(child.id() as i32), 9);
            let _ = child.wait();
            panic!(
                "BENCH_TINY=1 scripts/{name} {args:?} still running after {limit:?}:\n{}",
                read(&out_path)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = read(&out_path);
    eprintln!(
        "scripts/{name} {args:?} (tiny) took {:.1?}",
        start.elapsed()
    );
    assert!(
        status.success(),
        "BENCH_TINY=1 scripts/{name} {args:?}: {status}\n{text}"
    );
    assert!(
        text.contains("tiny: not a figure"),
        "BENCH_TINY=1 scripts/{name} {args:?} did not say it printed no figure:\n{text}"
    );
    text
}

fn read(path: &Path) -> String {
    let mut s = String::new();
    std::fs::File::open(path)
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    s
}

fn assert_says(text: &str, name: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            text.contains(line),
            "scripts/{name} (tiny) never printed {line:?}:\n{text}"
        );
    }
}

#[test]
fn bench_redo_redoes_only_the_crashed_rollout() {
    let text = tiny("bench-redo", &[], Duration::from_secs(120));
    assert_says(
        &text,
        "bench-redo",
        &[
            "ok   rank 2 was killed by SIGKILL",
            "work redone / work the crashed node had finished before the crash",
            "all checks passed",
        ],
    );
}

#[test]
fn bench_handoff_pairs_every_case_with_cp() {
    let text = tiny("bench-handoff", &[], Duration::from_secs(150));
    assert_says(
        &text,
        "bench-handoff",
        &[
            "hand-off / cp -r: median of 2 pairs (min-max)",
            "\nmove ",
            "\nmove-exclude ",
            "\ncopy ",
            "verify = \"sizes\"",
            "verify = \"hash\"",
        ],
    );
    // The cross-filesystem case runs wherever /dev/shm is a filesystem of its own.
    assert!(
        text.contains("\nexdev ") || text.contains("exdev skipped: "),
        "no exdev row and no reason:\n{text}"
    );
}

#[test]
fn bench_tensors_pairs_the_merge_with_cat() {
    let text = tiny("bench-tensors", &[], Duration::from_secs(90));
    assert_says(
        &text,
        "bench-tensors",
        &["merge throughput / cat's, paired by round", "\nmerge "],
    );
}

#[test]
fn bench_aggregate_pairs_the_merge_with_cat_for_both_shapes() {
    let text = tiny("bench-aggregate", &[], Duration::from_secs(90));
    assert_says(
        &text,
        "bench-aggregate",
        &[
            "merged file identical to cat's output",
            "pairs (cat time / merge time)",
            "UTF-8  merge (default validation)",
            "ASCII  merge (default validation)",
        ],
    );
}

#[test]
fn bench_overhead_runs_every_part() {
    let text = tiny("bench-overhead", &[], Duration::from_secs(170));
    assert_says(
        &text,
        "bench-overhead",
        &[
            "local disk / tmpfs, paired: median",
            "\nlocal disk (/var/tmp) ",
            "2. Shared-directory operations per node per barrier",
            "  3 nodes  rank 0:",
            "3. Shared-directory system calls per node per idle second",
        ],
    );
    let text = tiny("bench-overhead", &["--strace"], Duration::from_secs(90));
    assert_says(
        &text,
        "bench-overhead --strace",
        &["4. The counter against strace", "\nall "],
    );
    let text = tiny(
        "bench-overhead",
        &["--against", "HEAD"],
        Duration::from_secs(90),
    );
    assert_says(
        &text,
        "bench-overhead --against HEAD",
        &[
            "6. This build against HEAD",
            "time per iteration, this build / HEAD",
            "CPU time per iteration, this build / HEAD",
        ],
    );
}

#[test]
fn bench_pipeline_checks_both_modes() {
    let text = tiny("bench-pipeline", &[], Duration::from_secs(120));
    assert_says(
        &text,
        "bench-pipeline",
        &[
            "target pipelined / synchronous <= ",
            "target pipelined within 5 % of ideal",
        ],
    );
}

#[test]
fn bench_balance_checks_every_strategy() {
    let text = tiny("bench-balance", &[], Duration::from_secs(120));
    assert_says(
        &text,
        "bench-balance",
        &[
            "  weighted 1,1,1 ",
            "  dynamic ",
            "  weighted 1,2,4 ",
            "target: dynamic within 10% of ideal",
        ],
    );
}

#[test]
fn bench_tasks_checks_the_share() {
    let text = tiny("bench-tasks", &[], Duration::from_secs(90));
    assert_says(
        &text,
        "bench-tasks",
        &[
            "every task",
            "baseline",
            "target: peak RSS at most 3x the file size",
        ],
    );
}

#[test]
fn bench_timeline_renders_a_page() {
    let text = tiny("bench-timeline", &[], Duration::from_secs(90));
    assert_says(&text, "bench-timeline", &["rl-node timeline: "]);
}

#[test]
fn bench_spawn_pairs_the_node_with_a_spawn_loop() {
    let text = tiny("bench-spawn", &[], Duration::from_secs(90));
    assert_says(
        &text,
        "bench-spawn",
        &[
            "\nposix_spawn cp ",
            "\nsh -c cp ",
            "\nnode plain ",
            "\nnode shell ",
            "\nnode reused ",
            "'added' is the node's wall time per item minus posix_spawn cp's",
        ],
    );
}

#[test]
fn bench_elastic_kills_a_worker_in_every_scenario() {
    let text = tiny("bench-elastic", &[], Duration::from_secs(150));
    assert_says(
        &text,
        "bench-elastic",
        &[
            "1. From the kill -9 of the last rank (a worker) to the death declared",
            "2. Work done again, as a fraction of the dead rank's share",
            "ok   committed, 3 nodes: the 2 survivors finished the run with exit 0",
            "ok   committed, 3 nodes: the stand-in ran rank 2's share once (8 of 8 tasks)",
            "ok   busy, 3 nodes: rollouts/iter-0002/train.jsonl holds 24 records (want 24), 0 duplicated",
            "ok   resume, 3 nodes: with {resume_from} the stand-in ran the ",
            "all checks passed",
        ],
    );
}
