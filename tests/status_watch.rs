//! `rl-node status --watch`: started before the nodes, it waits for the run, prints a line
//! (or with `--json` an object) whenever what a rank does changes (piped), follows the run
//! through restarts, and ends with the run: the final state and the last iterations'
//! times, exit 0 when it completed and 1 when it stayed stopped for `--restart-wait`.

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

/// Start `status --watch` on the cluster's directory (before any node), piped, with
/// `extra` flags.
fn watch(c: &TestCluster, extra: &[&str]) -> std::process::Child {
    Command::new(BIN)
        .args(["status", "--watch", "--every", "100ms", "--log-path"])
        .arg(&c.log_path)
        .args(extra)
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
            let _ = common::kill(pid as i32, libc::SIGKILL);
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
    let w = watch(&c, &[]);
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
    // Nobody restarts it: the watch gives up after --restart-wait.
    let w = watch(&c, &["--restart-wait", "1s"]);
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
fn a_watch_started_while_a_run_is_stopped_follows_its_restart_to_the_end_in_json() {
    // Training fails once, in iteration 2: the run stops; a restart completes it.
    let once = tempfile::tempdir().unwrap();
    let c = TestCluster::new(
        2,
        &format!(
            "[phases.rollout]\ncommand = \"sleep 0.2; echo '{{}}' > {{output}}\"\n\
             [phases.train]\ncommand = \"sleep 0.2; test {{iteration}} != 2 || test -e {0}/failed-{{rank}} || {{ touch {0}/failed-{{rank}}; exit 5; }}\"\n",
            once.path().display()
        ),
    );
    let args = ["--iterations", "3"];
    let mut nodes = c.spawn_all(&args);
    for n in &mut nodes {
        assert_ne!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    // Started between generations (as during a batch requeue), it keeps watching...
    let mut w = watch(&c, &["--json"]);
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = std::io::BufReader::new(w.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(stdout) {
            let _ = tx.send(line.unwrap());
        }
    });
    let mut lines = vec![rx.recv_timeout(LIMIT).expect("the watch's first object")];
    let mut nodes = c.spawn_all(&args);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    // ...and ends with the restarted run: exit 0, an object per change, the last complete.
    let (code, err) = finish(w);
    assert_eq!(code, 0, "{err}");
    lines.extend(rx.iter());
    let text = lines.join("\n");
    let objects: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{text}")))
        .collect();
    assert!(objects.iter().all(|o| o["schema_version"] == 1), "{text}");
    let states: Vec<(&str, u64)> = objects
        .iter()
        .map(|o| {
            (
                o["state"].as_str().unwrap(),
                o["generation"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(states.first(), Some(&("stopped", 1)), "{text}");
    assert_eq!(states.last(), Some(&("completed", 2)), "{text}");
    assert!(states.contains(&("running", 2)), "{text}");
    // Only changes: never the same object twice in a row (their reading time aside).
    for pair in objects.windows(2) {
        let strip = |o: &serde_json::Value| {
            let mut o = o.clone();
            o["observed_at"] = serde_json::Value::Null;
            o["watched_ms"] = serde_json::Value::Null;
            o
        };
        assert_ne!(strip(&pair[0]), strip(&pair[1]), "{text}");
    }
}

/// Elastic mode: a watch that would give up at the first stop (`--restart-wait 0s`)
/// follows an elastic cluster through the loss of rank 0 (the survivors regroup by
/// themselves: that is no stop) to its end, exit 0; its lines show rank 0 dropped, and
/// the final view the iteration times of the new coordinator, rank 1.
#[test]
fn a_watch_follows_an_elastic_run_through_a_loss_to_its_end() {
    let (c, marker) = common::elastic::cluster(0, "600.6", Some(2));
    std::fs::create_dir_all(&c.log_path).unwrap();
    let w = watch(&c, &["--restart-wait", "0s"]);
    common::elastic::survive_a_loss(&c, &marker, 0, "600.6");
    let (code, text) = finish(w);
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains("STOPPED"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("rank 0 dropped it 2 ") && l.contains(" | rank 1 ")),
        "{text}"
    );
    assert!(text.contains("state: completed"), "{text}");
    assert!(
        text.contains("last iterations (rank 1's time): ") && text.contains(", 3: "),
        "{text}"
    );
}
