//! Fencing: a node of an older generation never touches what a newer generation owns.
//!
//! Each test freezes real `rl-node` processes with SIGSTOP (what a paused VM or a hung
//! host looks like to everyone else), lets the cluster restart without them, and wakes
//! them with SIGCONT while the new generation is at work.

mod common;

use common::cluster::*;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);

/// `pid` and every process below it (rl-node is a child subreaper, so its commands'
/// descendants stay in its tree).
fn tree(pid: i32) -> Vec<i32> {
    let mut parent_of = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.to_string()) else {
            continue;
        };
        let ppid: i32 = rest.split_whitespace().nth(1).unwrap().parse().unwrap();
        parent_of.push((p, ppid));
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

/// Freeze (SIGSTOP) or wake (SIGCONT) a whole node: the process and all its descendants.
fn signal_tree(pids: &[i32], sig: i32) {
    for &p in pids {
        let _ = common::kill(p, sig);
    }
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {l:?}: {e}", path.display()))
        })
        .collect()
}

fn wait_exit(n: &mut NodeProc) -> i32 {
    n.wait(LIMIT)
}

/// The rollout: rank 1's first attempt rolls out forever and, when stopped, flushes a
/// record into its `{output}` (like a Python rollout flushing on SIGTERM); every later
/// attempt of rank 1 waits for the test's go-ahead, so it is mid-rollout when the frozen
/// node wakes up.
const ROLLOUT: &str = r#"#!/bin/sh
rank=$1; out=$2; shared=$3
if [ "$rank" = 1 ] && mkdir "$shared/first-attempt" 2>/dev/null; then
  trap 'echo "{\"rank\":1,\"from\":\"dead-generation\"}" >> "$out"; exit 0' TERM
  echo "{\"rank\":1,\"from\":\"dead-generation-start\"}" >> "$out"
  while :; do sleep 0.05; done
fi
if [ "$rank" = 1 ]; then
  touch "$shared/second-attempt"
  while [ ! -e "$shared/go" ]; do sleep 0.05; done
fi
echo "{\"rank\":$rank,\"from\":\"live\"}" >> "$out"
"#;

#[test]
fn a_host_frozen_mid_rollout_that_wakes_after_a_restart_does_not_reach_the_new_generations_trajectories(
) {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("rollout.sh");
    fs::write(&script, ROLLOUT).unwrap();
    let c = TestCluster::new(
        2,
        &format!(
            "[phases.rollout]\ncommand = \"sh {} {{rank}} {{output}} {{log_path}}\"\n",
            script.display()
        ),
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let mut first = c.spawn_all(&["--iterations", "1"]);
    wait_until(LIMIT, "rank 1's first rollout to start", || {
        c.log_path.join("first-attempt").exists()
            && fs::read_dir(c.log_path.join("rollouts/iter-0001/train"))
                .map(|d| {
                    d.flatten()
                        .any(|e| e.file_name().to_string_lossy().contains(".g1."))
                })
                .unwrap_or(false)
    });
    // Freeze rank 1's whole host: the node, its guardian and its rollout.
    let frozen = tree(first[1].pid());
    signal_tree(&frozen, libc::SIGSTOP);
    wait_until(LIMIT, "rank 1 to be stopped", || stopped(first[1].pid()));
    // Rank 0 declares it dead and stops; the cluster is restarted without the frozen node.
    let code = wait_exit(&mut first[0]);
    assert_eq!(code, 3, "rank 0 of generation 1:\n{}", first[0].stderr());
    let mut master = c.spawn(0, &["--iterations", "1"]);
    let mut worker = c.spawn(1, &["--iterations", "1"]);
    wait_until(LIMIT, "generation 2's rank 1 to be mid-rollout", || {
        c.log_path.join("second-attempt").exists()
    });
    // The frozen host wakes up while generation 2 rolls out iteration 1.
    signal_tree(&frozen, libc::SIGCONT);
    let old = wait_exit(&mut first[1]);
    assert_ne!(old, 0, "the woken node must stop:\n{}", first[1].stderr());
    let train = c.log_path.join("rollouts/iter-0001/train");
    assert!(
        !train.join("rank-1.jsonl").exists(),
        "the woken node of generation 1 committed a shard:\n{}",
        first[1].stderr()
    );
    // What it flushed stays in its own generation's file, which nobody commits.
    let old_partial = lines(&train.join("rank-1.partial.g1.jsonl"));
    assert!(
        old_partial.iter().any(|r| r["from"] == "dead-generation"),
        "{old_partial:?}\n{}",
        first[1].stderr()
    );
    // Generation 2 finishes its rollout and the run completes.
    fs::write(c.log_path.join("go"), "").unwrap();
    let started = Instant::now();
    assert_eq!(wait_exit(&mut worker), 0, "rank 1:\n{}", worker.stderr());
    assert_eq!(wait_exit(&mut master), 0, "rank 0:\n{}", master.stderr());
    assert!(started.elapsed() < LIMIT);
    let merged = lines(&c.log_path.join("rollouts/iter-0001/train.jsonl"));
    assert_eq!(
        merged,
        vec![
            serde_json::json!({"rank": 0, "from": "live"}),
            serde_json::json!({"rank": 1, "from": "live"}),
        ],
        "train.jsonl must hold exactly the live generation's records"
    );
    let manifest: serde_json::Value = serde_json::from_slice(
        &fs::read(
            c.log_path
                .join("rollouts/iter-0001/train.jsonl.manifest.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(
        manifest["ranks"][1]["source"], "rollouts/iter-0001/train/rank-1.jsonl",
        "{manifest}"
    );
}

#[test]
fn of_two_masters_started_at_once_the_one_that_does_not_own_the_run_leaves_within_a_poll() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"echo '{\\\"rank\\\": {rank}}' > {output}\"\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    // Two masters at the same instant, no worker yet.
    let mut a = c.spawn(0, &["--iterations", "1"]);
    let mut b = c.spawn(0, &["--iterations", "1"]);
    // The one whose cluster.json was overwritten leaves quickly (not after join-timeout).
    let started = Instant::now();
    let loser = loop {
        if a.child.try_wait().unwrap().is_some() {
            break 0;
        }
        if b.child.try_wait().unwrap().is_some() {
            break 1;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "neither master left:\n--- a\n{}\n--- b\n{}",
            a.stderr(),
            b.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let (lost, won) = if loser == 0 {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert_eq!(lost.wait(LIMIT), 2, "{}", lost.stderr());
    let err = lost.stderr();
    let cluster: serde_json::Value =
        serde_json::from_slice(&fs::read(c.log_path.join(".rl-node/cluster.json")).unwrap())
            .unwrap();
    if err.contains("already held by a live process") {
        // Started a moment later, it saw the other's generation first: refused outright.
        eprintln!("note: the second master saw the first one's generation and was refused");
    } else {
        assert!(err.contains("another rank 0 owns this run"), "{err}");
        assert!(
            err.contains(&format!("generation {}", cluster["gen"]))
                && err.contains(&format!("pid {}", cluster["pid"])),
            "the loser names the generation that owns the run ({cluster}):\n{err}"
        );
    }
    // The winner forms the cluster with the worker and completes.
    let mut worker = c.spawn(1, &["--iterations", "1"]);
    assert_eq!(worker.wait(LIMIT), 0, "{}", worker.stderr());
    assert_eq!(won.wait(LIMIT), 0, "{}", won.stderr());
}

/// Start `rl-node --master` on another host name (a UTS namespace of its own), as a
/// replacement master on another machine would be: it cannot ask this kernel about the
/// old master and judges it by its heartbeat, like any remote holder.
fn spawn_master_on(c: &TestCluster, host: &str, args: &[&str], env: &[(&str, &str)]) -> NodeProc {
    let stderr_path = c.dir.path().join(format!("{host}.stderr"));
    let mut cmd = std::process::Command::new("unshare");
    cmd.arg("--uts")
        .arg("sh")
        .arg("-c")
        .arg(format!("hostname {host} && exec \"$@\""))
        .arg("sh")
        .arg(BIN)
        .arg("--master")
        .arg("--config")
        .arg(&c.config)
        .arg("--log-path")
        .arg(&c.log_path)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&stderr_path).unwrap());
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    NodeProc::from_child(0, cmd.spawn().unwrap(), stderr_path)
}

fn unshare_works() -> bool {
    std::process::Command::new("unshare")
        .args(["--uts", "true"])
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_master_frozen_mid_handoff_that_wakes_after_a_new_master_took_over_publishes_nothing() {
    if !unshare_works() {
        panic!("this test needs `unshare --uts` (root, util-linux) to give the new master another host name");
    }
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"echo '{\\\"r\\\": 1}' > {output}\"\n\
         [phases.train]\ncommand = \"mkdir -p {output}/checkpoint-1 && for f in a b c; do echo weights-$f > {output}/checkpoint-1/$f; done\"\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let stop_mid_copy = [("RL_NODE_TEST_STOP_AT", "handoff:mid-copy")];
    // The old master freezes after copying the first file of the checkpoint.
    let mut old = spawn_master_on(&c, "host-a", &["--iterations", "1"], &stop_mid_copy);
    wait_until(LIMIT, "the old master to freeze mid-copy", || {
        stopped(old.pid())
    });
    let models = c.log_path.join("models");
    assert!(models.join(".iter-0001.g1.partial").is_dir());
    // A new master on another host takes over, and freezes mid-copy too.
    let mut new = spawn_master_on(&c, "host-b", &["--iterations", "1"], &stop_mid_copy);
    wait_until(LIMIT, "the new master to freeze mid-copy", || {
        stopped(new.pid())
    });
    assert!(
        models.join(".iter-0001.g2.partial").is_dir(),
        "{}",
        new.stderr()
    );
    // The old master wakes first: it must not publish, switch LATEST or touch generation 2's copy.
    let _ = common::kill(old.pid(), libc::SIGCONT);
    assert_eq!(old.wait(LIMIT), 3, "{}", old.stderr());
    let err = old.stderr();
    assert!(
        err.contains("generation 1 was replaced by generation 2"),
        "{err}"
    );
    assert!(
        !models.join("iter-0001").exists(),
        "the old master published:\n{err}"
    );
    assert!(
        !models.join("LATEST").exists(),
        "the old master switched LATEST:\n{err}"
    );
    // The new master finishes its publication.
    let _ = common::kill(new.pid(), libc::SIGCONT);
    assert_eq!(new.wait(LIMIT), 0, "{}", new.stderr());
    assert_eq!(
        fs::read_to_string(models.join("LATEST")).unwrap().trim(),
        "iter-0001"
    );
    for f in ["a", "b", "c"] {
        assert_eq!(
            fs::read_to_string(models.join("iter-0001").join(f)).unwrap(),
            format!("weights-{f}\n")
        );
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(models.join("iter-0001/manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["files"].as_array().unwrap().len(), 3, "{manifest}");
}

/// The custom merge (`[phases.aggregate] command`): the first attempt (generation 1's)
/// waits for the test's go-ahead and then writes eight records of its own; every later
/// attempt merges at once, writing four.
const MERGE: &str = r#"#!/bin/sh
out=$1; shared=$2
if mkdir "$shared/first-merge" 2>/dev/null; then
  touch "$shared/old-merging"
  while [ ! -e "$shared/wake-old-merge" ]; do sleep 0.05; done
  : > "$out"
  for i in 1 2 3 4 5 6 7 8; do echo "{\"from\":\"old-generation\",\"i\":$i}" >> "$out"; done
  touch "$shared/old-merge-done"
  exit 0
fi
for i in 1 2 3 4; do echo "{\"from\":\"new-generation\",\"i\":$i}" >> "$out"; done
"#;

/// The pids among `pids` whose command line contains `needle`.
fn running(pids: &[i32], needle: &str) -> Vec<i32> {
    pids.iter()
        .copied()
        .filter(|p| {
            fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

#[test]
fn a_master_frozen_mid_merge_that_wakes_after_a_new_master_trained_on_the_merge_does_not_overwrite_it(
) {
    if !unshare_works() {
        panic!("this test needs `unshare --uts` (root, util-linux) to give the new master another host name");
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("merge.sh");
    fs::write(&script, MERGE).unwrap();
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"echo '{{\\\"r\\\": 1}}' > {{output}}\"\n\
             [phases.aggregate]\ncommand = \"sh {} {{output}} {{log_path}}\"\n\
             [phases.train]\ncommand = \"mkdir -p {{output}}/checkpoint-1 && cp {{trajectories}} {{output}}/checkpoint-1/trained-on.jsonl\"\n",
            script.display()
        ),
    );
    fs::create_dir_all(&c.log_path).unwrap();
    // Generation 1's master starts its merge, and its host freezes in the middle of it.
    let mut old = spawn_master_on(&c, "host-a", &["--iterations", "1"], &[]);
    wait_until(LIMIT, "the old master's merge to start", || {
        c.log_path.join("old-merging").exists()
    });
    let frozen = tree(old.pid());
    signal_tree(&frozen, libc::SIGSTOP);
    wait_until(LIMIT, "the old master to be stopped", || stopped(old.pid()));
    // A new master on another host takes the run over once the old one's heartbeat stood
    // still for dead-after, merges, trains on the merged file and completes.
    let mut new = spawn_master_on(&c, "host-b", &["--iterations", "1"], &[]);
    assert_eq!(new.wait(LIMIT), 0, "{}", new.stderr());
    let merged = c.log_path.join("rollouts/iter-0001/train.jsonl");
    let committed = fs::read_to_string(&merged).unwrap();
    let records = lines(&merged);
    assert_eq!(records.len(), 4, "{records:?}");
    assert!(records.iter().all(|r| r["from"] == "new-generation"));
    assert_eq!(
        fs::read_to_string(c.log_path.join("models/iter-0001/trained-on.jsonl")).unwrap(),
        committed,
        "generation 2 trained on its merge"
    );
    // The old host wakes: its merge command runs first and finishes (what a woken host
    // may well do before the node notices anything), then the node itself.
    fs::write(c.log_path.join("wake-old-merge"), "").unwrap();
    let merge_cmd = running(&frozen, "merge.sh");
    assert!(!merge_cmd.is_empty(), "the old merge command is gone");
    let merge_tree: Vec<i32> = merge_cmd.iter().flat_map(|&p| tree(p)).collect();
    signal_tree(&merge_tree, libc::SIGCONT);
    wait_until(LIMIT, "the old merge command to finish", || {
        c.log_path.join("old-merge-done").exists()
    });
    signal_tree(&frozen, libc::SIGCONT);
    assert_eq!(old.wait(LIMIT), 3, "{}", old.stderr());
    let err = old.stderr();
    assert!(
        err.contains("generation 1 was replaced by generation 2")
            && err.contains("did not commit the merged train file of iteration 1"),
        "{err}"
    );
    assert_eq!(
        fs::read_to_string(&merged).unwrap(),
        committed,
        "the old master's merge replaced the merged file generation 2 trained on:\n{err}"
    );
    // What the old merge wrote stays in its own generation's file, which nobody commits.
    let old_partial = lines(&c.log_path.join("rollouts/iter-0001/train.partial.g1.jsonl"));
    assert_eq!(old_partial.len(), 8, "{old_partial:?}");
    assert!(old_partial.iter().all(|r| r["from"] == "old-generation"));
}
