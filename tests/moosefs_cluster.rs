//! The cluster on a real distributed filesystem: MooseFS (a master and chunkservers, like
//! Lustre's MDS and OSS), each node on its own `mfsmount` client, with MooseFS's default
//! caches and with 1 s attribute, entry, directory-entry and negative caches, as FUSE
//! filesystems are often mounted. Under those caches a rename over a record is read stale
//! for up to the entry timeout and a name another client made stays invisible to lookups
//! (while mkdir answers EEXIST) for up to the negative timeout; rl-node must pay neither
//! per barrier, and must never fail a start on them.

mod common;
use common::cluster::*;
use common::moosefs::{self, Caches, MooseFs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(180);

/// Every phase with a command: rollouts write a record, training writes a checkpoint that
/// the hand-off publishes, eval writes its record.
const COMMANDS: &str = r#"
[phases.rollout]
command = "echo '{\"rank\": {rank}, \"iteration\": {iteration}, \"model\": \"{model_version}\"}' > {output}"
[phases.eval]
command = "echo '{\"eval\": {rank}}' > {output}"
[phases.train]
command = "mkdir -p {output}/checkpoint-{rank} && echo w{iteration} > {output}/checkpoint-{rank}/weights"
"#;

/// The shared directory as node `rank` sees it: its own client's mount.
fn shared(fs: &MooseFs, rank: u32, name: &str) -> PathBuf {
    fs.mount(rank as usize).join(name)
}

/// Every rank on its own client (`fs` has one per rank), to the end: how long it took and
/// each rank's stderr.
fn run_all(c: &TestCluster, fs: &MooseFs, name: &str, args: &[&str]) -> (Duration, Vec<String>) {
    std::fs::create_dir_all(shared(fs, 0, name)).unwrap();
    let start = Instant::now();
    let mut nodes: Vec<NodeProc> = (0..c.num_nodes)
        .map(|r| c.spawn_at(r, &shared(fs, r, name), args))
        .collect();
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    let took = start.elapsed();
    if codes.iter().any(|c| *c != 0) {
        let all: Vec<String> = nodes
            .iter()
            .map(|n| format!("--- rank {} ---\n{}", n.rank, n.stderr()))
            .collect();
        panic!("exit codes {codes:?}:\n{}", all.join("\n"));
    }
    (took, nodes.iter().map(NodeProc::stderr).collect())
}

/// Every rank on its own client (`fs` has one per rank) in `exp`, rank `victim` holding
/// in its rollout of iteration 2 until it is killed with SIGKILL (exit 137); the others
/// still run.
fn kill_in_rollout_of_iteration_2(
    c: &TestCluster,
    fs: &MooseFs,
    args: &[&str],
    victim: usize,
) -> Vec<NodeProc> {
    std::fs::create_dir_all(shared(fs, 0, "exp")).unwrap();
    let mut nodes: Vec<NodeProc> = (0..3u32)
        .map(|r| {
            let hold = [("RL_NODE_TEST_HOLD_AT", "train-rollout@2".to_string())];
            c.spawn_env(
                r,
                &shared(fs, r, "exp"),
                args,
                if r as usize == victim { &hold } else { &[] },
            )
        })
        .collect();
    wait_until(
        LIMIT,
        &format!("rank {victim} to hold in its rollout"),
        || nodes[victim].stderr().contains("RL_NODE_TEST_HOLD_AT"),
    );
    nodes[victim].signal(libc::SIGKILL);
    assert_eq!(nodes[victim].wait(LIMIT), 137);
    nodes
}

/// Three iterations with eval, training and the hand-off of a checkpoint, each node on
/// its own client: every merged file complete, every iteration's model the one handed off
/// before it, and the time per iteration far below a cache period per barrier.
fn three_iterations(test: &str, caches: Option<Caches>, per_iteration: Duration) {
    let Some(fs) = moosefs::start_for(test, 3, caches) else {
        return;
    };
    let c = TestCluster::new(3, COMMANDS);
    let iterations = 3u64;
    let (took, stderr) = run_all(
        &c,
        &fs,
        "exp",
        &["--iterations", "3", "--eval-interval", "2"],
    );
    let root = shared(&fs, 0, "exp");
    // 3 s of dead-after is enough for 1 s caches (2 × 1 s + a heartbeat): no warning.
    assert!(
        !stderr[0].contains("is below twice the longest cache"),
        "{}",
        stderr[0]
    );
    for i in 1..=iterations {
        let merged =
            std::fs::read_to_string(root.join(format!("rollouts/iter-{i:04}/train.jsonl")))
                .unwrap();
        let lines: Vec<serde_json::Value> = merged
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "iteration {i}: {merged}");
        for l in &lines {
            assert_eq!(l["model"], (i - 1).to_string(), "iteration {i}: {merged}");
        }
    }
    let latest = std::fs::read_to_string(root.join("models/LATEST")).unwrap();
    assert_eq!(latest.trim(), "iter-0003");
    eprintln!("{test}: {iterations} iterations in {took:?}");
    assert!(
        took < per_iteration * iterations as u32 + Duration::from_secs(5),
        "took {took:?} for {iterations} iterations"
    );
}

#[test]
fn three_nodes_on_moosefs_with_default_caches() {
    three_iterations(
        "three_nodes_on_moosefs_with_default_caches",
        None,
        Duration::from_secs(3),
    );
}

#[test]
fn three_nodes_on_moosefs_with_one_second_caches() {
    three_iterations(
        "three_nodes_on_moosefs_with_one_second_caches",
        Some(Caches::all(1.0)),
        Duration::from_secs(3),
    );
}

/// Barriers in two levels (`barrier-groups-from = 4`: ranks 1 and 3 lead groups of 2) over
/// five clients with 1 s caches: a leader reads its member's record and publishes its
/// group's arrival by rename over its own, rank 0 reads only the leaders, and all of it
/// through the caches that read a renamed-over record stale. Every iteration merges every
/// rank once, each with the model handed off before it, with no cache period per hop.
#[test]
fn five_nodes_in_groups_pass_barriers_through_their_leaders_with_one_second_caches() {
    let test = "five_nodes_in_groups_pass_barriers_through_their_leaders_with_one_second_caches";
    let Some(fs) = moosefs::start_for(test, 5, Some(Caches::all(1.0))) else {
        return;
    };
    let c = TestCluster::new(5, COMMANDS);
    let config = std::fs::read_to_string(&c.config).unwrap();
    let grouped = config.replacen("[cluster]\n", "[cluster]\nbarrier-groups-from = 4\n", 1);
    assert_ne!(grouped, config);
    std::fs::write(&c.config, grouped).unwrap();
    let iterations = 2u64;
    let (took, _) = run_all(&c, &fs, "exp", &["--iterations", "2"]);
    let root = shared(&fs, 0, "exp");
    for i in 1..=iterations {
        let path = root.join(format!("rollouts/iter-{i:04}/train.jsonl"));
        let merged = std::fs::read_to_string(path).unwrap();
        let mut ranks: Vec<u64> = merged
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .inspect(|l| assert_eq!(l["model"], (i - 1).to_string(), "{merged}"))
            .map(|l| l["rank"].as_u64().unwrap())
            .collect();
        ranks.sort();
        assert_eq!(ranks, vec![0, 1, 2, 3, 4], "iteration {i}: {merged}");
    }
    // The leaders published their groups' arrivals up to the last barrier; the members
    // had none to publish.
    let record = |r: u32| record_under(&root.join(".rl-node"), r).expect("a record");
    let last = record(0)["released"]["k"].as_u64().unwrap();
    for r in [1, 3] {
        let rec = record(r);
        assert_eq!(rec["group"]["k"].as_u64(), Some(last), "rank {r}: {rec}");
    }
    for r in [2, 4] {
        let rec = record(r);
        assert!(rec.get("group").is_none(), "rank {r}: {rec}");
    }
    // How long it took is a figure, not a check: under a loaded machine's MooseFS
    // daemons it varies tenfold (a hang is caught by the nodes' own deadlines).
    eprintln!("{test}: {iterations} iterations in {took:?}");
}

/// Workers started before rank 0 on a fresh directory look up `cluster.json` while it does
/// not exist, and their clients cache that (here for 30 s); on FUSE an `O_CREAT` of the
/// doorbell answers EEXIST for it too. They still join at once: a listing of the state
/// directory refreshes their lookups.
#[test]
fn workers_started_first_join_past_their_negative_cache() {
    let test = "workers_started_first_join_past_their_negative_cache";
    const NEGATIVE_SECS: f64 = 30.0;
    let caches = Caches {
        negentry: NEGATIVE_SECS,
        ..Caches::all(1.0)
    };
    let Some(fs) = moosefs::start_for(test, 3, Some(caches)) else {
        return;
    };
    let c = TestCluster::new(3, "[phases.train]\ncommand = \"true\"\n");
    std::fs::create_dir_all(shared(&fs, 0, "exp")).unwrap();
    let mut nodes: Vec<NodeProc> = (1..3u32)
        .map(|r| c.spawn_at(r, &shared(&fs, r, "exp"), &["--iterations", "1"]))
        .collect();
    wait_until(LIMIT, "the workers to wait for rank 0", || {
        nodes.iter().all(|n| {
            n.stderr()
                .contains("waiting for rank 0 to start a generation")
        })
    });
    let start = Instant::now();
    nodes.insert(
        0,
        c.spawn_at(0, &shared(&fs, 0, "exp"), &["--iterations", "1"]),
    );
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let took = start.elapsed();
    // dead-after (3 s here) is below twice the 30 s negative cache plus a heartbeat: said.
    let err = nodes[0].stderr();
    assert!(
        err.contains("timing.dead-after (3s, from")
            && err.contains("is below twice the longest cache")
            && err.contains("raise timing.dead-after to at least 1m 1s"),
        "{err}"
    );
    assert!(
        took < Duration::from_secs_f64(NEGATIVE_SECS / 2.0),
        "the run took {took:?}: a worker waited out its {NEGATIVE_SECS} s negative cache\n{}",
        nodes[1].stderr()
    );
}

/// A worker killed (-9) in its rollout of iteration 2 on 1 s caches: the others stop
/// naming it, a restart of the same commands finishes the run, and iteration 1, complete
/// before the kill, is not redone.
#[test]
fn a_run_killed_mid_rollout_resumes_without_redoing_finished_work() {
    let test = "a_run_killed_mid_rollout_resumes_without_redoing_finished_work";
    let Some(fs) = moosefs::start_for(test, 3, Some(Caches::all(1.0))) else {
        return;
    };
    let c = TestCluster::new(
        3,
        &format!("{COMMANDS}\n[phases.prepare]\ncommand = \"cp {{trajectories}} {{output}}\"\n")
            .replace(
                "[phases.rollout]\ncommand = \"",
                "[phases.rollout]\ncommand = \"echo {iteration} >> {log_path}/trace-{rank}; ",
            ),
    );
    let args = ["--iterations", "3", "--eval-interval", "0"];
    let mut nodes = kill_in_rollout_of_iteration_2(&c, &fs, &args, 1);
    for r in [0, 2] {
        let code = nodes[r].wait(LIMIT);
        let err = nodes[r].stderr();
        assert_eq!(code, 3, "rank {r}:\n{err}");
        assert!(
            err.contains("rank 1 on ") && err.contains("is dead"),
            "rank {r}:\n{err}"
        );
    }
    drop(nodes);
    run_all(&c, &fs, "exp", &args);
    let root = shared(&fs, 0, "exp");
    for r in 0..3 {
        let trace = std::fs::read_to_string(root.join(format!("trace-{r}"))).unwrap();
        let ones = trace.lines().filter(|l| *l == "1").count();
        assert_eq!(ones, 1, "rank {r} redid iteration 1's rollout: {trace}");
    }
    for i in 1..=3 {
        let merged =
            std::fs::read_to_string(root.join(format!("rollouts/iter-{i:04}/train.jsonl")))
                .unwrap();
        assert_eq!(merged.lines().count(), 3, "iteration {i}: {merged}");
    }
}

/// A pipelined run (a rollout cluster and an update cluster of one node each), each node
/// on its own client with 1 s caches: every iteration's trajectories reach training.
#[test]
fn a_pipelined_run_on_moosefs_with_one_second_caches() {
    let test = "a_pipelined_run_on_moosefs_with_one_second_caches";
    let Some(fs) = moosefs::start_for(test, 3, Some(Caches::all(1.0))) else {
        return;
    };
    let c = TestCluster::pipelined(&format!("{COMMANDS}\n[pipeline]\nstaleness = 1\n"));
    std::fs::create_dir_all(shared(&fs, 0, "exp")).unwrap();
    let mut nodes: Vec<NodeProc> = ["rollout", "update"]
        .iter()
        .enumerate()
        .map(|(i, side)| {
            c.spawn_at(
                0,
                &shared(&fs, i as u32, "exp"),
                &["--iterations", "3", "--num-nodes", "1", "--rl-phase", side],
            )
        })
        .collect();
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    let root = shared(&fs, 2, "exp");
    for i in 1..=3 {
        let merged =
            std::fs::read_to_string(root.join(format!("rollouts/iter-{i:04}/train.jsonl")))
                .unwrap();
        assert_eq!(merged.lines().count(), 1, "iteration {i}: {merged}");
    }
    assert_eq!(
        std::fs::read_to_string(root.join("models/LATEST"))
            .unwrap()
            .trim(),
        "iter-0003"
    );
}

/// Elastic mode on MooseFS with 1 s caches, each node on its own client: rank 0 is
/// killed in the middle of iteration 2's rollout; ranks 1 and 2 regroup (rank 1
/// coordinating, one of them standing in for rank 0's rollout) and go on; rank 0 started
/// again on its own client asks to come back and is taken in at an iteration's start.
/// Every iteration's merged file holds every rank's record once, and all three finish.
#[test]
fn elastic_rank_0_killed_and_started_again_on_moosefs_with_one_second_caches() {
    let test = "elastic_rank_0_killed_and_started_again_on_moosefs_with_one_second_caches";
    let Some(fs) = moosefs::start_for(test, 3, Some(Caches::all(1.0))) else {
        return;
    };
    let c = TestCluster::new(
        3,
        &COMMANDS.replace("> {output}\"", "> {output}; sleep 1\""),
    );
    let text = std::fs::read_to_string(&c.config).unwrap();
    std::fs::write(
        &c.config,
        text.replacen("[cluster]\n", "[cluster]\nmin-nodes = 2\n", 1),
    )
    .unwrap();
    let args = ["--iterations", "6", "--eval-interval", "0"];
    let mut nodes = kill_in_rollout_of_iteration_2(&c, &fs, &args, 0);
    let root = shared(&fs, 1, "exp");
    wait_until(LIMIT, "ranks 1 and 2 to regroup without rank 0", || {
        std::fs::read_to_string(root.join(".rl-node/cluster.json"))
            .is_ok_and(|t| t.contains("\"members\":[1,2]"))
    });
    let mut again = c.spawn_at(0, &shared(&fs, 0, "exp"), &args);
    for n in nodes.iter_mut().skip(1).chain(std::iter::once(&mut again)) {
        let code = n.wait(LIMIT);
        assert_eq!(code, 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    assert!(
        again.stderr().contains("asking to come back"),
        "{}",
        again.stderr()
    );
    for i in 1..=6 {
        let merged =
            std::fs::read_to_string(root.join(format!("rollouts/iter-{i:04}/train.jsonl")))
                .unwrap();
        let mut ranks: Vec<u64> = merged
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                assert_eq!(v["iteration"].as_u64(), Some(i), "{merged}");
                v["rank"].as_u64().unwrap()
            })
            .collect();
        ranks.sort_unstable();
        assert_eq!(ranks, [0, 1, 2], "iteration {i}: {merged}");
    }
    let latest = std::fs::read_to_string(root.join("models/LATEST")).unwrap();
    assert_eq!(latest.trim(), "iter-0006");
}
