//! How a node starts its commands: a command line of plain words runs as the program
//! itself (no `sh -c`), which signals reach like any command; a line that needs a shell
//! still runs under `sh`; and a program that does not exist fails as it did under the
//! shell (exit code 127, the shell's "not found" in the command's log).

mod common;

use common::cluster::*;
use std::fs;
use std::time::{Duration, Instant};

/// Generous limit for anything that should happen within a few seconds.
const LIMIT: Duration = Duration::from_secs(30);

/// A plain command's process is the program, a child of the node process, and a SIGTERM
/// to the node stops it at once (its signal mask is empty although the node blocks its
/// stop signals), not after the 60 s kill-grace.
#[test]
fn a_plain_command_is_the_program_itself_and_sigterm_stops_it() {
    let c = TestCluster::new(1, "[phases.rollout]\ncommand = \"sleep 300.951\"\n");
    fs::create_dir_all(&c.log_path).unwrap();
    let grace = [("RL_NODE_TIMING_KILL_GRACE", "60s".to_string())];
    let mut node = c.spawn_env(0, &c.log_path, &["--iterations", "1"], &grace);
    let mut sleep = vec![];
    wait_until(LIMIT, "the rollout's sleep", || {
        sleep = process_alive_with("sleep 300.951");
        !sleep.is_empty()
    });
    assert_eq!(sleep.len(), 1, "one process, no shell around it: {sleep:?}");
    let cmdline = fs::read(format!("/proc/{}/cmdline", sleep[0])).unwrap();
    assert!(cmdline.starts_with(b"sleep\0"), "{cmdline:?}");
    assert_eq!(parent_of(sleep[0]), Some(node.node_process()));

    let sent = Instant::now();
    node.signal(libc::SIGTERM);
    let code = node.wait(LIMIT * 2);
    let err = node.stderr();
    assert_eq!(code, 143, "{err}");
    assert!(
        sent.elapsed() < Duration::from_secs(20),
        "the node waited {:?} for its command: SIGTERM did not reach it\n{err}",
        sent.elapsed()
    );
    assert!(process_alive_with("sleep 300.951").is_empty(), "{err}");
}

/// One node, one iteration of the rollout only, with `command`: its exit code, stderr
/// and rollout log.
fn rollout(command: &str) -> (i32, String, String) {
    let c = TestCluster::new(
        1,
        // The commands write no output: an empty shard is the rollout's result.
        &format!(
            "[phases.rollout]\ncommand = '''{command}'''\n[aggregate]\nallow-empty-shards = true\n"
        ),
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let args = ["--iterations", "1", "--rl-phase", "rollout"];
    let mut node = c.spawn_at(0, &c.log_path, &args);
    let code = node.wait(LIMIT * 2);
    let log = c.log_path.join("logs/iter-0001/rank-0.rollout.log");
    (
        code,
        node.stderr(),
        fs::read_to_string(log).unwrap_or_default(),
    )
}

#[test]
fn plain_and_shell_commands_run_and_a_missing_program_fails_as_under_the_shell() {
    let (code, err, log) = rollout("printenv RL_NODE_OWNER");
    assert_eq!(code, 0, "{err}");
    assert!(log.contains("\n### $ printenv RL_NODE_OWNER\n"), "{log}");
    // The node's mark on its commands is in the program's environment.
    assert!(
        log.lines().any(|l| !l.starts_with('#') && l.contains(':')),
        "{log}"
    );

    let (code, err, log) = rollout("printf 'via %s\\n' shell >&2; exit 0");
    assert_eq!(code, 0, "{err}");
    assert!(log.contains("via shell"), "{log}");

    for command in [
        "rl-node-no-such-program --x",
        "rl-node-no-such-program 'x y' >&2",
    ] {
        let (code, err, log) = rollout(command);
        assert_eq!(code, 1, "{command}: {err}");
        assert!(
            err.contains("the rollout command failed with exit code 127"),
            "{command}: {err}"
        );
        assert!(
            log.contains("rl-node-no-such-program: not found"),
            "{command}: {log}"
        );
        assert!(
            err.contains("rl-node-no-such-program: not found"),
            "{command}: {err}"
        );
    }
}
