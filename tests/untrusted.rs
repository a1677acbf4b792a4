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

fn plant_link(at: &Path, target: &Path) {
    fs::create_dir_all(at.parent().unwrap()).unwrap();
    symlink(target, at).unwrap();
}

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

#[test]
fn a_link_planted_at_a_command_log_is_set_aside_and_the_victim_is_untouched() {
    let c = TestCluster::new(2, COMMANDS);
    let (victim, before) = victim(&c, ".bashrc");
    let logs = c.log_path.join("logs/iter-0001");
    let log = logs.join("rank-1.rollout.log");
    plant_link(&log, &victim);
    let nodes = run_to_end(&c, &["--iterations", "1", "--eval-interval", "0"]);
    assert_eq!(
        fs::read(&victim).unwrap(),
        before,
        "the victim file was written"
    );
    // The command's output went to a new, regular log at the same name.
    let meta = fs::symlink_metadata(&log).unwrap();
    assert!(
        meta.file_type().is_file(),
        "{log:?} is not a regular file now"
    );
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.contains("rollout-output-1"), "{text}");
    // The planted link is still there, under another name, pointing where it did.
    let aside = set_aside_in(&logs, "rank-1.rollout.log");
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(fs::read_link(&aside[0]).unwrap(), victim);
    let err = nodes[1].stderr();
    assert!(
        err.contains("rank-1.rollout.log is a symbolic link") && err.contains("moved it aside"),
        "rank 1 did not say what it refused:\n{err}"
    );
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
        let listing = || -> Vec<String> {
            let mut v: Vec<String> = walkdir(&c.log_path);
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

/// Every path below `dir`, not following links.
fn walkdir(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if e.file_type().unwrap().is_dir() {
                stack.push(p);
            }
        }
    }
    out
}
