//! Every node started at once with the same command line, as `srun` starts them: with
//! `--fresh` over a finished run, and over a run killed in the middle of an iteration,
//! the nodes form the new run every time, whichever of them gets to run first. A worker
//! that looked before rank 0 set the old run aside must neither end at it ("nothing to
//! do") nor take the new run's generation 1 for the old run's.
//!
//! Each start is tried 20 times, alternately rank 0 first and rank 0 last, with no-op
//! commands, one iteration and fast timing; join-timeout is shortened so that a start
//! that does not form fails in seconds.

mod common;

use common::cluster::*;
use common::moosefs::{self, Caches};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TRIES: usize = 20;
/// Generous for anything that takes well under a second on an idle machine.
const LIMIT: Duration = Duration::from_secs(60);
/// While a rank is killed, its rollout waits for this file to go.
const HOLD: &str = "hold";

fn cluster() -> TestCluster {
    let c = TestCluster::new(3, "");
    let hold = c.dir.path().join(HOLD);
    let text = fs::read_to_string(&c.config)
        .unwrap()
        .replace("join-timeout = \"60s\"", "join-timeout = \"15s\"");
    // The rollout writes its (empty) shard, after a long sleep while `hold` exists.
    let rollout = format!(
        "[phases.rollout]\ncommand = \"if [ -e {} ]; then sleep 61.7; fi; : > {{output}}\"\n",
        hold.display()
    );
    fs::write(&c.config, format!("{text}{rollout}")).unwrap();
    c
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// The run id of the run at `log` (a view of the share). Through a FUSE mount with
/// entry and negative caches, this test's own look can be answered from the cache of a
/// name another process just replaced (as the nodes' can, who list the directory first):
/// listed, and read again until the cache gives way.
fn run_id(log: &Path) -> String {
    let path = log.join(".rl-node/cluster.json");
    wait_until(
        LIMIT,
        "cluster.json to be readable through this view",
        || {
            let _ = fs::read_dir(log.join(".rl-node")).map(|d| d.count());
            fs::read(&path).is_ok()
        },
    );
    read_json(&path)["run_id"]
        .as_str()
        .expect("run_id")
        .to_string()
}

/// Start every rank with `args`, back to back, rank r on its view of the share `views[r]`:
/// rank 0 first, or (`master_last`) last.
fn start_at_once(
    c: &TestCluster,
    views: &[PathBuf],
    master_last: bool,
    args: &[&str],
) -> Vec<NodeProc> {
    let order: &[u32] = if master_last { &[1, 2, 0] } else { &[0, 1, 2] };
    order
        .iter()
        .map(|&r| c.spawn_at(r, &views[r as usize], args))
        .collect()
}

/// On MooseFS, each node on its own client with 5 s negative (and 1 s other) caches: a
/// worker that looked for the new run's files before rank 0 made them caches "missing",
/// and `mkdir` of what rank 0 made answers EEXIST while it stays invisible. Twenty starts
/// at once over a finished run still form the new run every time.
#[test]
fn every_node_started_at_once_with_fresh_on_moosefs_with_negative_caches_forms_the_new_run() {
    let test =
        "every_node_started_at_once_with_fresh_on_moosefs_with_negative_caches_forms_the_new_run";
    let caches = Caches {
        negentry: 5.0,
        ..Caches::all(1.0)
    };
    let Some(fs) = moosefs::start_for(test, 3, Some(caches)) else {
        return;
    };
    let c = cluster();
    let views: Vec<PathBuf> = (0..3).map(|r| fs.mount(r).join("exp")).collect();
    std::fs::create_dir_all(&views[0]).unwrap();
    let mut first = start_at_once(&c, &views, false, &["--iterations", "1"]);
    assert_all_ran(&mut first, "the first run");
    let mut old = run_id(&views[0]);
    for i in 0..TRIES {
        let what = format!(
            "try {} of {TRIES} on MooseFS (rank 0 {})",
            i + 1,
            ["first", "last"][i % 2]
        );
        let mut nodes = start_at_once(&c, &views, i % 2 == 1, &["--iterations", "1", "--fresh"]);
        assert_all_ran(&mut nodes, &what);
        let new = run_id(&views[0]);
        assert_ne!(new, old, "{what}: the run was not started afresh");
        assert!(
            views[0].join("previous-runs").join(&old).is_dir(),
            "{what}: run {old} is not set aside"
        );
        old = new;
    }
}

/// Wait for every node; panic with every node's output unless all exit 0 having run
/// their iteration.
fn assert_all_ran(nodes: &mut [NodeProc], what: &str) {
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    let ran = |n: &NodeProc| n.stderr().contains("all 1 iteration(s) complete");
    if codes.iter().any(|&c| c != 0) || !nodes.iter().all(ran) {
        let report: Vec<String> = nodes
            .iter()
            .zip(&codes)
            .map(|(n, code)| format!("rank {} exited {code}:\n{}", n.rank, n.stderr()))
            .collect();
        panic!(
            "{what}: not every node ran the new run\n{}",
            report.join("\n")
        );
    }
}

/// The start over run `old` formed a new run, and `old` is set aside whole.
fn assert_new_run(c: &TestCluster, old: &str, what: &str) -> String {
    let new = run_id(&c.log_path);
    assert_ne!(new, old, "{what}: the run was not started afresh");
    let aside = c.log_path.join("previous-runs").join(old);
    assert_eq!(
        read_json(&aside.join(".rl-node/cluster.json"))["run_id"],
        old,
        "{what}: run {old} is not set aside in {}",
        aside.display()
    );
    new
}

#[test]
fn every_node_started_at_once_with_fresh_over_a_finished_run_forms_the_new_run() {
    let c = cluster();
    // Every rank on the one directory.
    let views = vec![c.log_path.clone(); 3];
    let mut first = c.spawn_all(&["--iterations", "1"]);
    assert_all_ran(&mut first, "the first run");
    let mut old = run_id(&c.log_path);
    for i in 0..TRIES {
        let what = format!(
            "try {} of {TRIES} (rank 0 {})",
            i + 1,
            ["first", "last"][i % 2]
        );
        let mut nodes = start_at_once(&c, &views, i % 2 == 1, &["--iterations", "1", "--fresh"]);
        assert_all_ran(&mut nodes, &what);
        old = assert_new_run(&c, &old, &what);
    }
}

#[test]
fn every_node_started_at_once_with_fresh_over_a_killed_run_forms_the_new_run() {
    let c = cluster();
    // Every rank on the one directory.
    let views = vec![c.log_path.clone(); 3];
    let hold = c.dir.path().join(HOLD);
    for i in 0..TRIES {
        let what = format!(
            "try {} of {TRIES} (rank 0 {})",
            i + 1,
            ["first", "last"][i % 2]
        );
        // A run killed (every node, SIGKILL) while its rollouts run. Rank 0 starts it
        // alone first, so that this start cannot race.
        fs::write(&hold, "").unwrap();
        let before = fs::read(c.log_path.join(".rl-node/cluster.json")).ok();
        let mut nodes = vec![c.spawn(0, &["--iterations", "1", "--fresh"])];
        wait_until(LIMIT, "rank 0 to start a run", || {
            let now = fs::read(c.log_path.join(".rl-node/cluster.json")).ok();
            now.is_some() && now != before
        });
        nodes.extend((1..3).map(|r| c.spawn(r, &["--iterations", "1"])));
        for r in 0..3 {
            c.wait_phase(r, 1, "train-rollout", LIMIT);
        }
        for n in &nodes {
            n.signal(libc::SIGKILL);
        }
        for n in &mut nodes {
            assert_eq!(n.wait(LIMIT), 128 + libc::SIGKILL);
        }
        let old = run_id(&c.log_path);
        fs::remove_file(&hold).unwrap();

        let mut nodes = start_at_once(&c, &views, i % 2 == 1, &["--iterations", "1", "--fresh"]);
        assert_all_ran(&mut nodes, &what);
        assert_new_run(&c, &old, &what);
    }
}
