//! The shared directory is not trusted: links and files that someone else planted at the
//! names rl-node writes are never written through. A victim file outside the run stays
//! byte for byte as it was; a planted log is set aside and written anew (the run goes on);
//! a planted state file stops the node at start with exit 2, before anything is written.

mod common;
use common::cluster::*;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Every phase writes a line of output to its command log (a shard for the rollout).
const COMMANDS: &str = r#"
[phases.rollout]
command = "echo rollout-output-{rank}; echo '{\"rank\": {rank}}' > {output}"
[phases.train]
command = "echo train-output-{rank}"
"#;

/// A file outside the run that a co-tenant would like rl-node to write into, with its
/// content: `~/.bashrc`, say.
fn victim(c: &TestCluster, name: &str) -> (PathBuf, Vec<u8>) {
    let dir = c.dir.path().join("victim-home");
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let content = b"# the victim's own file\nexport PATH=$HOME/bin:$PATH\n".to_vec();
    fs::write(&path, &content).unwrap();
    (path, content)
}

/// A symbolic link at `at` to `target`, planted by another user (`nobody`): rl-node
/// follows links of its own user (the user's own arrangement), never anyone else's.
fn plant_link(at: &Path, target: &Path) {
    fs::create_dir_all(at.parent().unwrap()).unwrap();
    symlink(target, at).unwrap();
    assert!(
        rustix::process::geteuid().is_root(),
        "planting a link as another user needs root (scripts/test runs the suite as root)"
    );
    std::os::unix::fs::lchown(at, Some(NOBODY), Some(NOBODY)).unwrap();
}

const NOBODY: u32 = 65534;

/// What is now at `dir`'s names that start with `prefix` and carry `.untrusted-`.
fn set_aside_in(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    let n = p.file_name().unwrap().to_string_lossy().into_owned();
                    n.starts_with(prefix) && n.contains(".untrusted-")
                })
                .collect()
        })
        .unwrap_or_default()
}

fn run_to_end(c: &TestCluster, args: &[&str]) -> Vec<NodeProc> {
    let mut nodes = c.spawn_all(args);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {} failed:\n{}", n.rank, n.stderr());
    }
    nodes
}

/// Plants a link to a victim file at `rank`'s log `log_name` of iteration 1, runs the
/// cluster `c` to its end, and checks that the victim is untouched, the command's output
/// (`output`) went to a new regular log at that name, the link is kept aside pointing where
/// it did, and the rank said what it moved aside.
fn assert_log_link_set_aside(c: &TestCluster, rank: usize, log_name: &str, output: &str) {
    let (victim, before) = victim(c, ".bashrc");
    let logs = c.log_path.join("logs/iter-0001");
    let log = logs.join(log_name);
    plant_link(&log, &victim);
    let nodes = run_to_end(c, &["--iterations", "1", "--eval-interval", "0"]);
    assert_eq!(
        fs::read(&victim).unwrap(),
        before,
        "the victim file was written"
    );
    let meta = fs::symlink_metadata(&log).unwrap();
    assert!(
        meta.file_type().is_file(),
        "{log:?} is not a regular file now"
    );
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.contains(output), "{text}");
    let aside = set_aside_in(&logs, log_name);
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(fs::read_link(&aside[0]).unwrap(), victim);
    let err = nodes[rank].stderr();
    assert!(
        err.contains(&format!("{log_name} is a symbolic link")) && err.contains("moved it aside"),
        "rank {rank} did not say what it set aside:\n{err}"
    );
}

#[test]
fn a_link_planted_at_a_command_log_is_set_aside_and_the_victim_is_untouched() {
    let c = TestCluster::new(2, COMMANDS);
    assert_log_link_set_aside(&c, 1, "rank-1.rollout.log", "rollout-output-1");
}

/// The merge command's log (`[aggregate] format = "command"`) is a command log too: a
/// link planted there is set aside, never written through, and the node says so.
#[test]
fn a_link_planted_at_the_merge_commands_log_is_set_aside_and_said() {
    let config = COMMANDS.to_string()
        + "[aggregate]\nformat = \"command\"\nshard-name = \"rank-{rank}.txt\"\n\
           output-name = \"{split}-merged.txt\"\ncommand = \"cat {inputs} > {output}; echo merge-output\"\n";
    let c = TestCluster::new(1, &config);
    assert_log_link_set_aside(&c, 0, "rank-0.aggregate.log", "merge-output");
}

#[test]
fn a_linked_logs_directory_is_never_entered() {
    let c = TestCluster::new(1, COMMANDS);
    let victim_dir = c.dir.path().join("victim-dir");
    fs::create_dir_all(&victim_dir).unwrap();
    fs::create_dir_all(&c.log_path).unwrap();
    plant_link(&c.log_path.join("logs"), &victim_dir);
    run_to_end(&c, &["--iterations", "1", "--eval-interval", "0"]);
    assert_eq!(
        fs::read_dir(&victim_dir).unwrap().count(),
        0,
        "rl-node wrote into the directory a planted link pointed at"
    );
    assert!(fs::symlink_metadata(c.log_path.join("logs"))
        .unwrap()
        .is_dir());
    let text = fs::read_to_string(c.log_path.join("logs/iter-0001/rank-0.rollout.log")).unwrap();
    assert!(text.contains("rollout-output-0"), "{text}");
    assert_eq!(set_aside_in(&c.log_path, "logs").len(), 1);
}

/// The same link, made by the node's own user, is the user's arrangement and is followed.
#[test]
fn a_directory_link_of_the_users_own_is_followed() {
    let c = TestCluster::new(1, COMMANDS);
    let elsewhere = c.dir.path().join("logs-elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    fs::create_dir_all(&c.log_path).unwrap();
    symlink(&elsewhere, c.log_path.join("logs")).unwrap();
    run_to_end(&c, &["--iterations", "1", "--eval-interval", "0"]);
    let text = fs::read_to_string(elsewhere.join("iter-0001/rank-0.rollout.log")).unwrap();
    assert!(text.contains("rollout-output-0"), "{text}");
    assert!(set_aside_in(&c.log_path, "logs").is_empty());
}

#[test]
fn links_at_the_event_log_and_metrics_are_set_aside_and_victims_untouched() {
    let c = TestCluster::new(1, COMMANDS);
    let (bashrc, bashrc_before) = victim(&c, ".bashrc");
    let (profile, profile_before) = victim(&c, ".profile");
    plant_link(&c.log_path.join(".rl-node/events/rank-0.jsonl"), &bashrc);
    plant_link(&c.log_path.join("metrics.jsonl"), &profile);
    let nodes = run_to_end(&c, &["--iterations", "2", "--eval-interval", "0"]);
    assert_eq!(fs::read(&bashrc).unwrap(), bashrc_before);
    assert_eq!(fs::read(&profile).unwrap(), profile_before);
    // Both logs were written anew, as regular files with this run's lines.
    let events = fs::read_to_string(c.log_path.join(".rl-node/events/rank-0.jsonl")).unwrap();
    assert!(events.lines().count() > 5, "{events}");
    let metrics = fs::read_to_string(c.log_path.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    let err = nodes[0].stderr();
    assert!(
        err.contains("events/rank-0.jsonl is a symbolic link"),
        "{err}"
    );
    assert!(err.contains("metrics.jsonl is a symbolic link"), "{err}");
}

#[test]
fn a_hard_link_at_a_command_log_is_set_aside_and_the_victim_is_untouched() {
    let c = TestCluster::new(1, COMMANDS);
    // A hard link needs the same filesystem: the victim lives beside the run.
    let (victim, before) = victim(&c, "notes.txt");
    let log = c.log_path.join("logs/iter-0001/rank-0.train.log");
    fs::create_dir_all(log.parent().unwrap()).unwrap();
    fs::hard_link(&victim, &log).unwrap();
    let nodes = run_to_end(&c, &["--iterations", "1", "--eval-interval", "0"]);
    assert_eq!(
        fs::read(&victim).unwrap(),
        before,
        "the victim file was written"
    );
    assert_eq!(
        fs::metadata(&victim).unwrap().nlink(),
        2,
        "the link was not kept aside"
    );
    assert!(fs::read_to_string(&log).unwrap().contains("train-output-0"));
    let err = nodes[0].stderr();
    assert!(err.contains("rank-0.train.log has 2 hard links"), "{err}");
}

/// A planted state file (a journal, the doorbell, the history, the run's directories)
/// stops the node at once with exit 2 naming it, and nothing is written anywhere.
#[test]
fn a_link_planted_at_a_state_file_stops_the_node_before_it_writes() {
    for (name, rank) in [
        (".rl-node/journal/rank-1.jsonl", 1),
        (".rl-node/journal/rank-0.jsonl", 0),
        (".rl-node/doorbell", 0),
        (".rl-node/history.jsonl", 0),
        (".rl-node", 0),
        ("rollouts", 1),
    ] {
        let c = TestCluster::new(2, COMMANDS);
        let (victim, before) = victim(&c, ".bashrc");
        let target = if name.contains('.') && !name.ends_with(".rl-node") {
            victim.clone()
        } else {
            victim.parent().unwrap().to_path_buf()
        };
        plant_link(&c.log_path.join(name), &target);
        // Every path below the run's directory, not following links.
        let listing = || -> Vec<String> {
            let mut v: Vec<String> = walkdir::WalkDir::new(&c.log_path)
                .min_depth(1)
                .into_iter()
                .flatten()
                .map(|e| {
                    let rel = e.path().strip_prefix(&c.log_path).unwrap();
                    rel.display().to_string()
                })
                .collect();
            v.sort();
            v
        };
        let before_tree = listing();
        let mut node = c.spawn(rank, &["--iterations", "1"]);
        let code = node.wait(LIMIT);
        let err = node.stderr();
        assert_eq!(code, 2, "{name}: rank {rank} exit {code}:\n{err}");
        assert!(
            err.contains(&format!("{name} is a symbolic link")),
            "{name}: the message does not name it:\n{err}"
        );
        assert_eq!(fs::read(&victim).unwrap(), before, "{name}: victim written");
        assert_eq!(
            fs::read_dir(victim.parent().unwrap()).unwrap().count(),
            1,
            "{name}: something was written beside the victim"
        );
        assert_eq!(
            listing(),
            before_tree,
            "{name}: the node wrote to the run's directory"
        );
    }
}

/// The peak resident memory of process `pid` so far, in MiB (`VmHWM`).
fn peak_rss_mib(pid: i32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb / 1024
}

/// The largest peak resident memory of this process's waited-for children, in MiB.
fn children_peak_rss_mib() -> u64 {
    // SAFETY: `rusage` is plain integers, for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes only into the struct we own and pass (rustix has no
    // getrusage).
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    usage.ru_maxrss as u64 / 1024
}

/// A gigabyte-sized file (sparse: it takes no disk) at `path`, replacing what was there.
fn plant_huge(path: &Path) {
    let tmp = path.with_extension("planting");
    let f = fs::File::create(&tmp).unwrap();
    f.set_len(1 << 30).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A 1 GiB file planted as a peer's record is refused by rank 0 with a warning that names
/// it, and neither rank 0 nor `rl-node status` reads it into memory.
#[test]
fn a_planted_huge_record_is_refused_in_bounded_memory() {
    let c = TestCluster::new(2, COMMANDS);
    let mut rank0 = c.spawn(0, &["--iterations", "1"]);
    let record = c.log_path.join(".rl-node/gen-1/rank-1.json");
    wait_until(LIMIT, "rank 0's first generation", || record.exists());
    plant_huge(&record);
    wait_until(LIMIT, "rank 0's warning about the record", || {
        rank0.stderr().contains("rank-1.json is larger than 4 MiB")
    });
    let node = rank0.node_process();
    // Rank 0 goes on polling the planted record: let it write its own record (every
    // heartbeat, its seq grows) three more times, polling all the while.
    let seq = || c.record(0).and_then(|r| r["seq"].as_u64());
    let warned_at = seq().expect("rank 0's record");
    wait_until(LIMIT, "rank 0 to write its record three more times", || {
        seq().is_some_and(|s| s >= warned_at + 3)
    });
    let peak = peak_rss_mib(node);
    assert!(peak < 128, "rank 0's peak memory is {peak} MiB");
    let out = std::process::Command::new(BIN)
        .args(["status", "--log-path"])
        .arg(&c.log_path)
        .output()
        .unwrap();
    let status_peak = children_peak_rss_mib();
    assert!(
        status_peak < 128,
        "status's peak memory is {status_peak} MiB"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank-1.json is larger than 4 MiB"),
        "status did not say what it refused:\n{err}"
    );
    rank0.signal(libc::SIGTERM);
    rank0.wait(LIMIT);
}

/// A journal larger than `[limits] journal-mib` stops its node at start, naming the file
/// and the key that sets the limit, without reading it into memory.
#[test]
fn a_journal_over_the_limit_is_refused_naming_the_key() {
    let c = TestCluster::new(1, COMMANDS);
    let mut first = c.spawn(0, &["--iterations", "1", "--eval-interval", "0"]);
    assert_eq!(first.wait(LIMIT), 0, "{}", first.stderr());
    let journal = c.log_path.join(".rl-node/journal/rank-0.jsonl");
    // The journal grown to 300 MiB (sparse: no disk): over the default limit of 256 MiB.
    common::set_file_len(&journal, 300 << 20);
    let mut node = c.spawn(0, &["--iterations", "2", "--eval-interval", "0"]);
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("rank-0.jsonl is larger than 256 MiB") && err.contains("limits.journal-mib"),
        "{err}"
    );
    let peak = children_peak_rss_mib();
    assert!(peak < 128, "the node's peak memory is {peak} MiB");
    // The key decides: 2 MiB is refused at a 1 MiB limit, and read at the default.
    common::set_file_len(&journal, 2 << 20);
    let mut lowered = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "2", "--eval-interval", "0"],
        &[("RL_NODE_LIMITS_JOURNAL_MIB", "1".into())],
    );
    assert_eq!(lowered.wait(LIMIT), 2);
    assert!(
        lowered
            .stderr()
            .contains("rank-0.jsonl is larger than 1 MiB"),
        "{}",
        lowered.stderr()
    );
    let mut raised = c.spawn(0, &["--iterations", "2", "--eval-interval", "0"]);
    let code = raised.wait(LIMIT);
    let err = raised.stderr();
    assert_eq!(code, 0, "{err}");
    assert!(
        !err.contains("is larger than"),
        "the raised limit was not used:\n{err}"
    );
}

/// `rl-node doctor` makes its scratch directory under `.rl-node/doctor/`: a planted link
/// there does not take its probes outside the run.
#[test]
fn doctor_does_not_follow_a_planted_scratch_directory() {
    let c = TestCluster::new(1, "");
    let victim_dir = c.dir.path().join("victim-dir");
    fs::create_dir_all(&victim_dir).unwrap();
    plant_link(&c.log_path.join(".rl-node/doctor"), &victim_dir);
    let out = std::process::Command::new(BIN)
        .args(["doctor", "--log-path"])
        .arg(&c.log_path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("doctor is a symbolic link"), "{err}");
    assert_eq!(
        fs::read_dir(&victim_dir).unwrap().count(),
        0,
        "doctor wrote into the link's target"
    );
}
