//! `rl-node status --watch`: started before the nodes, it waits for the run, prints a line
//! whenever what a rank does changes (piped), and ends with the run: the final state and
//! the last iterations' times, exit 0 when it completed and 1 when it stopped.

mod common;

use common::cluster::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Commands that take a little while, so that phases change between refreshes; training
/// fails with exit 5 in iteration `fail_at` (0: never).
fn commands(fail_at: u64) -> String {
    format!(
        "[phases.rollout]\ncommand = \"sleep 0.2; echo '{{}}' > {{output}}\"\n\
         [phases.train]\ncommand = \"sleep 0.2; test {{iteration}} != {fail_at} || exit 5\"\n"
    )
}

/// Start `status --watch` on the cluster's directory (before any node), piped.
fn watch(c: &TestCluster) -> std::process::Child {
    Command::new(BIN)
        .args(["status", "--watch", "--every", "100ms", "--log-path"])
        .arg(&c.log_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Wait for the watch to end on its own; its exit code and output.
fn finish(child: std::process::Child) -> (i32, String) {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(LIMIT) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: kill takes only integers.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("status --watch did not end with the run within {LIMIT:?}");
        }
    };
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn a_watch_started_before_the_nodes_follows_the_run_and_ends_with_it() {
    let c = TestCluster::new(2, &commands(0));
    std::fs::create_dir_all(&c.log_path).unwrap();
    let w = watch(&c);
    let mut nodes = c.spawn_all(&["--iterations", "3"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    let (code, text) = finish(w);
    assert_eq!(code, 0, "{text}");
    let lines: Vec<&str> = text.lines().collect();
    // A line per change, each stamped; the phases went by.
    let changes: Vec<&&str> = lines
        .iter()
        .filter(|l| l.contains("rank 0 ") && l.contains(" | rank 1 "))
        .collect();
    assert!(changes.len() >= 3, "{text}");
    for l in &changes {
        let stamp = l.split(' ').next().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(stamp).is_ok(), "{l}");
    }
    assert!(
        text.contains("(train-rollout)") && text.contains("(training)"),
        "{text}"
    );
    // Never the same line twice in a row: only changes are printed.
    for pair in changes.windows(2) {
        let strip = |l: &str| l.split_once(' ').unwrap().1.to_string();
        assert_ne!(strip(pair[0]), strip(pair[1]), "{text}");
    }
    // The end: the final state and the iterations' times.
    assert!(text.contains("state: completed"), "{text}");
    assert!(
        text.contains("last iterations (rank 0's time): 1: ") && text.contains(", 3: "),
        "{text}"
    );
}

#[test]
fn a_watch_of_a_run_that_stops_ends_with_exit_1_and_the_diagnosis() {
    let c = TestCluster::new(2, &commands(2));
    std::fs::create_dir_all(&c.log_path).unwrap();
    let w = watch(&c);
    let mut nodes = c.spawn_all(&["--iterations", "3"]);
    for n in &mut nodes {
        assert_ne!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    let (code, text) = finish(w);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("state: STOPPED: rank ")
            && text.contains("failed in phase 10 (training) of iteration 2: the train command failed with exit code 5"),
        "{text}"
    );
}

#[test]
fn watch_and_json_do_not_combine() {
    let out = Command::new(BIN)
        .args(["status", "--watch", "--json", "--log-path", "/nonexistent"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--json"));
}
