//! Refusals: usage and configuration errors end with exit 2, a message that says what is
//! wrong, and nothing written to the shared directory (README: "nothing was written").

mod common;

use common::cluster::*;
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);

// ------------------------------------------------------------------ helpers

/// Every file and directory under `root`, relative, except the short-lived temporary
/// files an atomic publish makes (`.name.tmp-PID-N`) while a running node heartbeats, and
/// rank 0's `observed.json`, which appears at one of its poll rounds.
fn tree(root: &Path) -> BTreeSet<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<PathBuf>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // Temporary files, and rank 0's view of its peers for `status`, which rank 0
            // (not a refused node) writes first at some poll round of its own.
            if name.contains(".tmp-") || name == "observed.json" {
                continue;
            }
            let p = e.path();
            out.insert(p.strip_prefix(root).unwrap().to_path_buf());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(root, &p, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// Run one refused node to its end and return its stderr, asserting exit 2.
fn refused(mut node: NodeProc) -> String {
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_eq!(code, 2, "must be refused with exit 2; stderr:\n{err}");
    assert!(
        err.starts_with("error: ") || err.contains("\nerror: "),
        "{err}"
    );
    err
}

/// A refusal before any cluster exists: exit 2 and the shared directory not even created.
fn refused_before_start(c: &TestCluster, rank: u32, args: &[&str]) -> String {
    let err = refused(c.spawn(rank, args));
    assert!(
        !c.log_path.exists(),
        "a refused node must write nothing, but {} exists: {:?}",
        c.log_path.display(),
        tree(&c.log_path)
    );
    err
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// Stop the nodes of a running cluster (SIGTERM; their commands stop with them).
/// The refusal must not have disturbed the running cluster.
fn assert_still_running(nodes: &mut [NodeProc]) {
    for n in nodes.iter_mut() {
        assert!(
            n.child.try_wait().unwrap().is_none(),
            "rank {} stopped:\n{}",
            n.rank,
            n.stderr()
        );
    }
}

fn stop_all(nodes: &mut [NodeProc]) {
    for n in nodes.iter() {
        n.signal(libc::SIGTERM);
    }
    for n in nodes.iter_mut() {
        n.wait(LIMIT);
    }
}

// ------------------------------------------------------------------ 7: configuration mismatch

#[test]
fn a_worker_with_a_different_configuration_is_refused_and_writes_nothing() {
    let c = TestCluster::new(2, "");
    let mut master = c.spawn(0, &["--num-nodes", "2", "--eval-interval", "3"]);
    // Rank 0 has finished writing what a start writes (its history line comes last).
    wait_until(LIMIT, "rank 0 to open generation 1", || {
        c.record(0).is_some_and(|r| r["state"] == "joining")
            && fs::metadata(c.log_path.join(".rl-node/history.jsonl")).is_ok_and(|m| m.len() > 0)
    });
    let state = c.log_path.join(".rl-node");
    let slot = state.join("gen-1/rank-1.json");
    let before = tree(&c.log_path);
    let slot_before = fs::read(&slot).unwrap();

    let err = refused(c.spawn(1, &["--eval-interval", "5"]));
    assert!(
        err.contains("error: rank 1: this node's configuration differs from rank 0's"),
        "{err}"
    );
    assert!(
        err.contains("cluster.eval-interval: rank 0 has 3, this node has 5"),
        "the message must name the key and both values:\n{err}"
    );
    assert!(
        !err.contains("cluster.num-nodes"),
        "num-nodes agrees:\n{err}"
    );

    assert_eq!(
        tree(&c.log_path),
        before,
        "the refused worker must not create files"
    );
    // The only write: why it was refused, in its still-vacant placeholder, where rank 0
    // reads; everything else about the slot is as rank 0 wrote it.
    let mut slot_now = read_json(&slot);
    assert_eq!(slot_now["state"], "vacant");
    let why = slot_now["refused"].as_str().unwrap_or_default().to_string();
    assert!(
        why.starts_with(
            "rank 1 was refused: cluster.eval-interval differs (rank 0 has 3, rank 1 has 5)"
        ),
        "{slot_now}"
    );
    let mut was: serde_json::Value = serde_json::from_slice(&slot_before).unwrap();
    for v in [&mut slot_now, &mut was] {
        let o = v.as_object_mut().unwrap();
        o.remove("refused");
        o.remove("wall");
    }
    assert_eq!(slot_now, was, "rank 1's slot must otherwise stay untouched");
    assert!(!state.join("events/rank-1.jsonl").exists());

    // Rank 0 is still waiting for its worker, and says why rank 1 did not join.
    wait_until(LIMIT, "rank 0 to report the refusal", || {
        master.stderr().contains(&why)
    });
    assert!(
        master.child.try_wait().unwrap().is_none(),
        "{}",
        master.stderr()
    );
    master.signal(libc::SIGTERM);
    assert_eq!(master.wait(LIMIT), 143, "{}", master.stderr());
}

// ------------------------------------------------------------------ 8: duplicate rank

/// A running 2-node cluster in a long rollout, with its command logs created.
fn running_cluster(tag: &str) -> (TestCluster, Vec<NodeProc>) {
    let c = TestCluster::new(2, &format!("[phases.rollout]\ncommand = \"sleep {tag}\"\n"));
    let nodes = c.spawn_all(&[]);
    for r in 0..2 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
        wait_until(LIMIT, "the rollout to start", || {
            nodes[r as usize]
                .stderr()
                .contains("iteration 1: rollout started")
        });
    }
    (c, nodes)
}

#[test]
fn a_second_worker_for_a_held_rank_is_refused_and_writes_nothing() {
    let (c, mut nodes) = running_cluster("62.8");
    let first_pid = nodes[1].pid();
    let before = tree(&c.log_path);

    let err = refused(c.spawn(1, &[]));
    assert!(err.contains("already held by a live process"), "{err}");
    assert!(
        err.contains(&format!("pid {first_pid} on ")),
        "the message must name the holder's pid {first_pid}:\n{err}"
    );

    assert_eq!(
        tree(&c.log_path),
        before,
        "the refused worker must not create files"
    );
    // The cluster did not notice: rank 1 is still the first process, still running.
    let rec = c.record(1).unwrap();
    assert_eq!(rec["pid"], first_pid, "{rec}");
    assert_eq!(rec["state"], "running", "{rec}");
    assert_still_running(&mut nodes);
    stop_all(&mut nodes);
}

#[test]
fn a_second_master_for_a_running_cluster_is_refused_and_writes_nothing() {
    let (c, mut nodes) = running_cluster("62.9");
    let first_pid = nodes[0].pid();
    let before = tree(&c.log_path);

    let err = refused(c.spawn(0, &[]));
    assert!(
        err.contains("rank 0 is already held by a live process"),
        "{err}"
    );
    assert!(err.contains(&format!("pid {first_pid} on ")), "{err}");

    assert_eq!(
        tree(&c.log_path),
        before,
        "the refused master must not create files"
    );
    let cluster = read_json(&c.log_path.join(".rl-node/cluster.json"));
    assert_eq!(cluster["gen"], 1, "{cluster}");
    assert_eq!(cluster["pid"], first_pid, "{cluster}");
    assert_still_running(&mut nodes);
    stop_all(&mut nodes);
}

// ------------------------------------------------------------------ 9-11: ranks and weights

#[test]
fn a_rank_beyond_num_nodes_is_refused() {
    let c = TestCluster::new(3, "");
    let err = refused_before_start(&c, 3, &[]);
    assert!(err.contains("rank 3 (--worker 3) is out of range"), "{err}");
    assert!(err.contains("num-nodes is 3"), "{err}");
    assert!(err.contains("0..=2"), "{err}");
}

/// `check-numbering` reads the numbers from the merged files' names: an output-name
/// without `{split_iteration}` in its file name is refused at start, naming the key.
#[test]
fn check_numbering_without_split_iteration_in_the_output_name_is_refused() {
    let c = TestCluster::new(1, "[aggregate]\ncheck-numbering = true\n");
    let err = refused_before_start(&c, 0, &[]);
    assert!(err.contains("aggregate.check-numbering"), "{err}");
    assert!(err.contains("{split_iteration}"), "{err}");
    assert!(err.contains("`{split}.{ext}`"), "{err}");
}

#[test]
fn a_wrong_number_of_rank_weights_is_refused() {
    let c = TestCluster::new(3, "");
    for rank in [0, 1] {
        let err = refused_before_start(&c, rank, &["--rank-weights", "1,1"]);
        assert!(err.contains("--rank-weights"), "{err}");
        assert!(
            err.contains("2 weight(s) given but num-nodes is 3"),
            "{err}"
        );
    }
}

#[test]
fn a_zero_or_negative_rank_weight_is_refused_naming_the_rank_and_value() {
    let c = TestCluster::new(3, "");
    for (weights, value) in [("1,0,1", "0"), ("1,-1,1", "-1")] {
        let err = refused_before_start(&c, 0, &["--rank-weights", weights]);
        assert!(err.contains("--rank-weights"), "{err}");
        assert!(
            err.contains(&format!("the weight of rank 1 is {value}")),
            "the message must name rank 1 and {value}:\n{err}"
        );
    }
    // The same from the config file.
    let c = TestCluster::new(3, "");
    fs::write(
        &c.config,
        fs::read_to_string(&c.config)
            .unwrap()
            .replace("num-nodes = 3", "num-nodes = 3\nrank-weights = [2, 1, 0]"),
    )
    .unwrap();
    let err = refused_before_start(&c, 0, &[]);
    assert!(err.contains("the weight of rank 2 is 0"), "{err}");
    assert!(
        err.contains(&c.config.display().to_string()),
        "the file must be named:\n{err}"
    );
}

// ------------------------------------------------------------------ 12: permissions

/// `setpriv … BIN` as user nobody, or None when that is impossible here.
fn as_nobody(c: &TestCluster) -> Option<Vec<String>> {
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    let Some(setpriv) = setpriv else {
        eprintln!("skipped: setpriv not found");
        return None;
    };
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: not running as root, cannot switch to nobody");
        return None;
    }
    let prefix: Vec<String> = ["--reuid=65534", "--regid=65534", "--clear-groups"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let runs = |bin: &str| {
        Command::new(setpriv)
            .args(&prefix)
            .arg(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut bin = BIN.to_string();
    if !runs(&bin) {
        // The build directory is not reachable by nobody: use a copy.
        let copy = c.dir.path().join("rl-node");
        fs::copy(BIN, &copy).unwrap();
        fs::set_permissions(&copy, fs::Permissions::from_mode(0o755)).unwrap();
        bin = copy.display().to_string();
        assert!(runs(&bin), "nobody cannot run {bin}");
    }
    let mut cmd = vec![setpriv.to_string()];
    cmd.extend(prefix);
    cmd.push(bin);
    Some(cmd)
}

fn run_as_nobody(
    cmd: &[String],
    c: &TestCluster,
    rank_args: &[&str],
    log_path: &Path,
) -> (i32, String) {
    let mut command = Command::new(&cmd[0]);
    command
        .args(&cmd[1..])
        .args(rank_args)
        .arg("--config")
        .arg(&c.config)
        .arg("--log-path")
        .arg(log_path)
        .stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") || LAUNCHER_VARS.contains(&k.as_str()) {
            command.env_remove(k);
        }
    }
    let start = Instant::now();
    let out = command.output().unwrap();
    assert!(start.elapsed() < LIMIT);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_log_path_this_user_cannot_write_is_refused() {
    let c = TestCluster::new(2, "");
    // tempdir() is 0700: let nobody reach the config file and the log path.
    fs::set_permissions(c.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(&c.config, fs::Permissions::from_mode(0o644)).unwrap();
    let Some(cmd) = as_nobody(&c) else { return };
    fs::create_dir(&c.log_path).unwrap();
    fs::set_permissions(&c.log_path, fs::Permissions::from_mode(0o755)).unwrap();

    for rank_args in [&["--master"][..], &["--worker", "1"][..]] {
        let (code, err) = run_as_nobody(&cmd, &c, rank_args, &c.log_path);
        assert_eq!(code, 2, "{rank_args:?}: {err}");
        assert!(err.contains("permission denied"), "{rank_args:?}: {err}");
        assert!(
            err.contains(&c.log_path.display().to_string()),
            "the path must be named: {err}"
        );
        assert!(
            tree(&c.log_path).is_empty(),
            "nothing may be written: {:?}",
            tree(&c.log_path)
        );
    }

    // A log path that does not exist under a directory nobody cannot write: rank 0
    // would have to create it.
    let missing = c.log_path.join("run");
    let (code, err) = run_as_nobody(&cmd, &c, &["--master"], &missing);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("permission denied"), "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(tree(&c.log_path).is_empty(), "{:?}", tree(&c.log_path));
}

// ------------------------------------------------------------------ 13: phase flags

#[test]
fn an_unknown_rl_phase_is_refused_listing_the_possible_values() {
    let c = TestCluster::new(1, "");
    let err = refused_before_start(&c, 0, &["--rl-phase", "fast"]);
    assert!(
        err.contains("'fast'") && err.contains("--rl-phase"),
        "{err}"
    );
    for v in ["both", "rollout", "update"] {
        assert!(err.contains(v), "possible value {v} missing:\n{err}");
    }
}

#[test]
fn a_rollout_split_without_rl_phase_rollout_is_refused() {
    let c = TestCluster::new(1, "");
    let err = refused_before_start(
        &c,
        0,
        &["--rollout-split", "train-only", "--rl-phase", "both"],
    );
    assert!(err.contains("rollout-split"), "{err}");
    assert!(
        err.contains("only applies with rl-phase = rollout"),
        "{err}"
    );
    assert!(err.contains("(from --rl-phase)"), "{err}");
}

/// The message says where rl-phase came from; a file path or an environment variable
/// name must be shown as it is, not lower-cased.
#[test]
fn a_rollout_split_refusal_names_the_rl_phase_source_verbatim() {
    let c = TestCluster::new(1, "");
    let dir = c.dir.path().join("Configs");
    fs::create_dir(&dir).unwrap();
    let config = dir.join("RL-Node.toml");
    fs::write(&config, "[cluster]\nrl-phase = \"update\"\n").unwrap();
    let out = Command::new(BIN)
        .args(["--master", "--rollout-split", "train-only", "--config"])
        .arg(&config)
        .arg("--log-path")
        .arg(&c.log_path)
        .env_remove("RL_NODE_CLUSTER_RL_PHASE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("rl-phase is update"), "{err}");
    assert!(
        err.contains(&format!("(from {})", config.display())),
        "the config file must be named as it is ({}):\n{err}",
        config.display()
    );

    let out = Command::new(BIN)
        .args(["--master", "--rollout-split", "train-only", "--log-path"])
        .arg(&c.log_path)
        .env("RL_NODE_CLUSTER_RL_PHASE", "both")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("(from environment RL_NODE_CLUSTER_RL_PHASE)"),
        "the variable must be named as it is:\n{err}"
    );
    assert!(!c.log_path.exists());
}

// ------------------------------------------------------------------ 14: unknown key

#[test]
fn an_unknown_config_key_is_refused_with_a_suggestion() {
    let c = TestCluster::new(2, "[phases.rollout]\ncomand = \"x\"\n");
    let err = refused_before_start(&c, 0, &[]);
    assert!(err.contains("unknown key `phases.rollout.comand`"), "{err}");
    assert!(
        err.contains(&c.config.display().to_string()),
        "the file must be named:\n{err}"
    );
    assert!(
        err.contains("did you mean `phases.rollout.command`?"),
        "{err}"
    );
    // A worker is refused the same way.
    let err = refused_before_start(&c, 1, &[]);
    assert!(err.contains("unknown key `phases.rollout.comand`"), "{err}");
}

/// An `RL_NODE_*` variable far from every key: the hint names the subcommand that lists
/// the keys as it is really called.
#[test]
fn an_unknown_environment_variable_is_refused_naming_show_config() {
    let c = TestCluster::new(1, "");
    let node = c.spawn_env(
        0,
        &c.log_path,
        &[],
        &[("RL_NODE_QQQQQQQQ", "1".to_string())],
    );
    let err = refused(node);
    assert!(!c.log_path.exists());
    assert!(
        err.contains("unknown key `RL_NODE_QQQQQQQQ` in the environment"),
        "{err}"
    );
    assert!(
        err.contains("`rl-node show-config` lists the keys"),
        "{err}"
    );
}

// ------------------------------------------------------------------ 15: no usable rank

#[test]
fn worker_zero_is_refused() {
    let c = TestCluster::new(2, "");
    // The helper's spawn(0) would pass --master: run by hand.
    let (code, err) = run_plain(&c, &["--worker", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--worker 0 names rank 0, which is the master"),
        "{err}"
    );
    assert!(err.contains("hint: start rank 0 with --master"), "{err}");
    assert!(!c.log_path.exists());
}

/// Run the binary with `args` (no --master/--worker added) against the cluster's config
/// and log path, with no rank in the environment.
fn run_plain(c: &TestCluster, args: &[&str]) -> (i32, String) {
    run_plain_env(c, args, &[])
}

fn run_plain_env(c: &TestCluster, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    run_env(c, args, &c.log_path, env)
}

fn run_with_log_path(c: &TestCluster, args: &[&str], log_path: &Path) -> (i32, String) {
    run_env(c, args, log_path, &[])
}

fn run_env(c: &TestCluster, args: &[&str], log_path: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .arg("--config")
        .arg(&c.config)
        .arg("--log-path")
        .arg(log_path)
        .stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") || LAUNCHER_VARS.contains(&k.as_str()) {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn no_rank_at_all_is_refused() {
    let c = TestCluster::new(2, "");
    let (code, err) = run_plain(&c, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no rank: pass --master or --worker N"),
        "{err}"
    );
    assert!(err.contains("NODE_RANK or SLURM_NODEID"), "{err}");
    assert!(!c.log_path.exists());

    let (code, err) = run_plain_env(&c, &[], &[("RANK", "one")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("RANK=one is not a rank number"), "{err}");
    assert!(!c.log_path.exists());

    let (code, err) = run_plain(&c, &["--master", "--worker", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--master") && err.contains("--worker"),
        "{err}"
    );
    assert!(!c.log_path.exists());
}

/// What launchers set to say which node this is, all removed before a test sets its own.
const LAUNCHER_VARS: [&str; 11] = [
    "RANK",
    "NODE_RANK",
    "SLURM_NODEID",
    "WORLD_SIZE",
    "NNODES",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "RL_NODE_OWNER",
    "RL_NODE_NUM_NODES",
];

#[test]
fn a_torchrun_environment_is_refused_and_per_node_variables_come_first() {
    // A configuration that leaves num-nodes to the launcher, as a batch script's would.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("rl-node.toml");
    std::fs::write(&config, "[timing]\njoin-timeout = \"1s\"\n").unwrap();
    let log_path = dir.path().join("shared");
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .arg("--config")
            .arg(&config)
            .arg("--log-path")
            .arg(&log_path)
            .stdin(Stdio::null());
        for (k, _) in std::env::vars() {
            if k.starts_with("RL_NODE_") || LAUNCHER_VARS.contains(&k.as_str()) {
                cmd.env_remove(k);
            }
        }
        let out = cmd.envs(env.iter().copied()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code().unwrap_or(-1), err)
    };
    // torchrun's view of node 2 of 3 with 8 GPUs each: RANK and WORLD_SIZE count processes.
    let torchrun = [
        ("RANK", "16"),
        ("WORLD_SIZE", "24"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "8"),
    ];
    let (code, err) = run(&["--num-nodes", "3"], &torchrun);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("RANK=16 counts processes, not nodes"), "{err}");
    assert!(err.contains("LOCAL_WORLD_SIZE=8"), "{err}");
    assert!(err.contains("NODE_RANK"), "{err}");
    assert!(
        !log_path.exists(),
        "a refused node wrote {}",
        log_path.display()
    );
    let (code, err) = run(&["--worker", "2"], &torchrun);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("WORLD_SIZE=24 counts processes"), "{err}");
    assert!(err.contains("NNODES"), "{err}");
    assert!(
        !log_path.exists(),
        "a refused node wrote {}",
        log_path.display()
    );

    // The per-node pair beside them is what a node is: rank 2 of 3 (alone, it waits for
    // rank 0 until the join-timeout; its log says where its identity came from).
    let mut both: Vec<(&str, &str)> = torchrun.to_vec();
    both.extend([("NODE_RANK", "2"), ("NNODES", "3")]);
    let (_, err) = run(&[], &both);
    assert!(err.contains("rank 2 (from NODE_RANK)"), "{err}");
    assert!(
        err.contains("num-nodes 3 (from environment NNODES)"),
        "{err}"
    );

    // One process per node: RANK and WORLD_SIZE count nodes.
    let per_node = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "1"),
    ];
    let (_, err) = run(&[], &per_node);
    assert!(err.contains("rank 1 (from RANK)"), "{err}");
    assert!(
        err.contains("num-nodes 2 (from environment WORLD_SIZE)"),
        "{err}"
    );
}

#[test]
fn a_variable_rl_node_gives_its_commands_is_refused_when_set_for_rl_node_itself() {
    let c = TestCluster::new(2, "");
    let (code, err) = run_plain_env(&c, &["--master"], &[("RL_NODE_NUM_NODES", "3")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("RL_NODE_NUM_NODES=3 is set"), "{err}");
    assert!(err.contains("RL_NODE_CLUSTER_NUM_NODES"), "{err}");
    assert!(!c.log_path.exists());
    let (code, err) = run_plain_env(&c, &[], &[("RL_NODE_RANK", "1")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--worker N, or set NODE_RANK"), "{err}");
    // Inside a command another node runs (RL_NODE_OWNER set), they are that node's.
    let (code, err) = run_plain_env(
        &c,
        &["--master", "--iterations", "1"],
        &[
            ("RL_NODE_NUM_NODES", "3"),
            ("RL_NODE_OWNER", "x"),
            ("RL_NODE_TIMING_JOIN_TIMEOUT", "1s"),
        ],
    );
    assert!(!err.contains("RL_NODE_NUM_NODES=3 is set"), "{code}: {err}");
}

#[test]
fn a_log_path_that_is_a_file_is_refused() {
    let c = TestCluster::new(2, "");
    fs::write(&c.log_path, b"not a directory\n").unwrap();
    for rank in [0, 1] {
        let err = refused(c.spawn(rank, &[]));
        assert!(
            err.contains(&format!(
                "--log-path {} is not a directory",
                c.log_path.display()
            )),
            "{err}"
        );
        assert_eq!(fs::read(&c.log_path).unwrap(), b"not a directory\n");
    }
}

#[test]
fn rank_0_creates_only_the_last_component_of_a_missing_log_path_and_says_so() {
    let c = TestCluster::new(1, "");
    // A typo (or a filesystem not mounted here) one level up: refused, nothing made.
    let typo = c.dir.path().join("sahred/exp");
    let (code, err) = run_with_log_path(&c, &["--master"], &typo);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nor does its parent"), "{err}");
    assert!(
        err.contains(&format!(
            "nearest existing directory is {}",
            c.dir.path().display()
        )),
        "{err}"
    );
    assert!(
        !c.dir.path().join("sahred").exists(),
        "a refused rank 0 made the path"
    );

    // Its parent exists: rank 0 makes it, and the log says so.
    let fresh = c.dir.path().join("exp2");
    let (code, err) = run_with_log_path(&c, &["--master", "--iterations", "1"], &fresh);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("created the shared directory {}", fresh.display())),
        "{err}"
    );
    let (code, err) = run_with_log_path(&c, &["--master", "--iterations", "1", "--fresh"], &fresh);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("created the shared directory"), "{err}");
}

#[test]
fn a_worker_never_creates_the_log_path_and_says_where_it_looked() {
    let c = TestCluster::new(2, "");
    let typo = c.dir.path().join("sahred/exp");
    let (code, err) = run_env(
        &c,
        &["--worker", "1"],
        &typo,
        &[("RL_NODE_TIMING_JOIN_TIMEOUT", "2s")],
    );
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains(&format!(
            "--log-path {} does not exist on this node",
            typo.display()
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "the nearest directory that exists here, {}, is on ",
            c.dir.path().display()
        )),
        "{err}"
    );
    assert!(
        !c.dir.path().join("sahred").exists(),
        "the worker made the path"
    );
}
