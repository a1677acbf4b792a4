//! An elastic cluster (`[cluster] min-nodes` below `num-nodes`) of real processes that
//! loses a node: three nodes, one killed with SIGKILL (its node process and its commands,
//! like a machine that dies) in the middle of iteration `KILLED_IN`'s rollout; the two
//! survivors drop it and finish. tests/elastic.rs checks what they do; the tests of the
//! views (status, metrics, the Prometheus textfile, the timeline) check what they show.

use super::cluster::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Generous: a passing test takes about 15 s (three iterations, one dead-after of 3 s).
pub const LIMIT: Duration = Duration::from_secs(120);
pub const ITERATIONS: u64 = 3;
/// Records each rank's rollout writes per iteration.
pub const PER_RANK: u64 = 3;
/// The iteration in which the victim is killed.
pub const KILLED_IN: u64 = 2;

/// A cluster of 3 nodes whose rollout writes `PER_RANK` records naming its rank, its
/// iteration and their index, and whose training writes a checkpoint holding the merged
/// trajectories. In iteration `KILLED_IN` the rollout of rank `victim` first creates
/// `marker` and then sleeps `sleep` seconds (a distinctive number, for this test's
/// process); once `marker` exists, no run sleeps, so a survivor standing in for `victim`
/// (same command, `{rank}` = `victim`) writes its records at once. `min_nodes`: the
/// `[cluster] min-nodes` key, if any.
pub fn cluster(victim: u32, sleep: &str, min_nodes: Option<u32>) -> (TestCluster, PathBuf) {
    let c = TestCluster::new(3, "");
    let marker = c.dir.path().join(format!("rank-{victim}-rollout-started"));
    let m = marker.display();
    let phases = format!(
        r#"
[phases.rollout]
command = '''if [ {{rank}} = {victim} ] && [ {{iteration}} = {KILLED_IN} ] && [ ! -e '{m}' ]; then touch '{m}'; sleep {sleep}; fi; for i in $(seq 1 {PER_RANK}); do echo '{{"rank": {{rank}}, "it": {{iteration}}, "i": '$i'}}'; done > {{output}}'''

[phases.train]
command = "mkdir -p {{output}}/checkpoint-1 && cat {{trajectories}} > {{output}}/checkpoint-1/weights.jsonl"
"#
    );
    configure(&c, min_nodes, &phases);
    (c, marker)
}

/// Adds `[cluster] min-nodes` (if any) and `extra` (more tables) to `c`'s config file.
pub fn configure(c: &TestCluster, min_nodes: Option<u32>, extra: &str) {
    let text = fs::read_to_string(&c.config).unwrap();
    let keys = min_nodes.map_or(String::new(), |k| format!("min-nodes = {k}\n"));
    fs::write(
        &c.config,
        text.replacen("[cluster]\n", &format!("[cluster]\n{keys}"), 1) + extra,
    )
    .unwrap();
}

/// On a panic (a failed assertion, a deadline), prints what the nodes said and every
/// command's log, so a failure explains itself.
pub struct ShowLogsOnFailure {
    nodes: Vec<(u32, PathBuf)>,
    log_path: PathBuf,
}

impl ShowLogsOnFailure {
    pub fn new(c: &TestCluster, nodes: &[NodeProc]) -> ShowLogsOnFailure {
        ShowLogsOnFailure {
            nodes: nodes
                .iter()
                .map(|n| (n.rank, n.stderr_path.clone()))
                .collect(),
            log_path: c.log_path.clone(),
        }
    }
}

impl Drop for ShowLogsOnFailure {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for (rank, path) in &self.nodes {
            eprintln!(
                "===== rank {rank}'s stderr ({}):\n{}",
                path.display(),
                fs::read_to_string(path).unwrap_or_default()
            );
        }
        let mut logs = vec![];
        files_under(&self.log_path.join("logs"), &mut logs);
        logs.sort();
        for p in logs {
            eprintln!(
                "===== {}:\n{}",
                p.display(),
                fs::read_to_string(&p).unwrap_or_default()
            );
        }
        let cluster = self.log_path.join(".rl-node/cluster.json");
        eprintln!(
            "===== {}:\n{}",
            cluster.display(),
            fs::read_to_string(&cluster).unwrap_or_default()
        );
    }
}

pub fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            files_under(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// A process's command line, arguments separated by spaces ("" once it is gone).
pub fn cmdline(pid: i32) -> String {
    String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
        .replace('\0', " ")
}

/// Whether `pid` is alive (a zombie is not).
pub fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Waits until `victim`'s rollout of iteration `KILLED_IN` has created `marker` and its
/// `sleep` runs under the victim's node, then kills the victim like a machine that dies:
/// SIGKILL to its supervisor, its node process and everything below them, and to the
/// process group of each (a command leads its own group). Waits for all of them to be
/// gone.
pub fn kill_machine(victim: &mut NodeProc, marker: &Path, sleep: &str) {
    wait_until(
        LIMIT,
        &format!("{} to be created", marker.display()),
        || marker.exists(),
    );
    let sleeper = format!("sleep {sleep} ");
    wait_until(
        LIMIT,
        &format!("rank {}'s `{sleeper}` to run", victim.rank),
        || {
            descendants(victim.pid())
                .iter()
                .any(|p| cmdline(*p).starts_with(&sleeper))
        },
    );
    let below = descendants(victim.pid());
    victim.signal(libc::SIGKILL);
    for p in &below {
        let _ = super::kill(*p, libc::SIGKILL);
    }
    for p in &below {
        let _ = super::kill(-*p, libc::SIGKILL);
    }
    assert_eq!(
        victim.wait(LIMIT),
        128 + libc::SIGKILL,
        "rank {}:\n{}",
        victim.rank,
        victim.stderr()
    );
    wait_until(
        Duration::from_secs(10),
        &format!("rank {}'s processes to be gone", victim.rank),
        || below.iter().all(|p| !alive(*p)),
    );
}

/// Kills `victim` of the elastic cluster `c` (made by [`cluster`] with `sleep`, whose
/// rollout creates `marker`) mid-rollout of iteration `KILLED_IN`, the nodes started with
/// `--iterations ITERATIONS`, and waits for the two survivors to finish every iteration
/// (exit 0). Their processes, ended, are returned (the victim's too).
pub fn survive_a_loss(c: &TestCluster, marker: &Path, victim: u32, sleep: &str) -> Vec<NodeProc> {
    let mut nodes = c.spawn_all(&["--iterations", &ITERATIONS.to_string()]);
    let _logs = ShowLogsOnFailure::new(c, &nodes);
    kill_machine(&mut nodes[victim as usize], marker, sleep);
    for n in nodes.iter_mut().filter(|n| n.rank != victim) {
        let code = n.wait(LIMIT);
        assert_eq!(
            code, 0,
            "rank {} must finish after rank {victim} was dropped (its stderr is below)",
            n.rank
        );
    }
    nodes
}

/// Makes the training of the elastic cluster `c` (made by [`cluster`]) wait, in
/// generation 2 only (the one the survivors form), until the returned gate file exists.
pub fn hold_training_in_generation_2(c: &TestCluster) -> PathBuf {
    let gate = c.dir.path().join("generation-2-training-gate");
    let text = fs::read_to_string(&c.config).unwrap();
    let held = text.replacen(
        "command = \"mkdir -p {output}/checkpoint-1",
        &format!(
            "command = \"if [ {{gen}} = 2 ]; then while [ ! -e '{}' ]; do sleep 0.05; done; fi; mkdir -p {{output}}/checkpoint-1",
            gate.display()
        ),
        1,
    );
    assert_ne!(held, text, "the training command of `cluster` changed");
    fs::write(&c.config, held).unwrap();
    gate
}

/// A rank dropped and taken back: in the elastic cluster of 3 nodes (`min-nodes = 2`),
/// `victim` is killed mid-rollout of iteration `KILLED_IN`; the survivors form generation
/// 2 and train in it, where `while_dropped` looks at the run; then they are stopped
/// (SIGTERM) and every node, the victim's rank included, is started again: generation 3
/// takes `victim` back and the run completes. `sleep` is the victim's distinctive sleep.
pub fn dropped_then_back(
    victim: u32,
    sleep: &str,
    while_dropped: impl FnOnce(&TestCluster),
) -> TestCluster {
    let (c, marker) = cluster(victim, sleep, Some(2));
    hold_training_in_generation_2(&c);
    let args = ["--iterations", &ITERATIONS.to_string()];
    let mut nodes = c.spawn_all(&args);
    {
        let _logs = ShowLogsOnFailure::new(&c, &nodes);
        kill_machine(&mut nodes[victim as usize], &marker, sleep);
        for r in (0..3).filter(|&r| r != victim) {
            wait_until(
                LIMIT,
                &format!("rank {r} to train in generation 2, without rank {victim}"),
                || {
                    c.record(r)
                        .is_some_and(|rec| rec["gen"] == 2 && rec["phase"] == "training")
                },
            );
        }
        while_dropped(&c);
        for n in nodes.iter_mut().filter(|n| n.rank != victim) {
            n.signal(libc::SIGTERM);
            assert_ne!(n.wait(LIMIT), 0, "rank {} stopped by SIGTERM", n.rank);
        }
    }
    let mut again = c.spawn_all(&args);
    let _logs = ShowLogsOnFailure::new(&c, &again);
    for n in again.iter_mut() {
        assert_eq!(
            n.wait(LIMIT),
            0,
            "rank {} must finish the run started again (its stderr is below)",
            n.rank
        );
    }
    let cluster: serde_json::Value =
        serde_json::from_slice(&fs::read(c.log_path.join(".rl-node/cluster.json")).unwrap())
            .unwrap();
    assert_eq!(cluster["gen"], 3, "{cluster}");
    assert!(cluster.get("members").is_none(), "every rank: {cluster}");
    c
}
