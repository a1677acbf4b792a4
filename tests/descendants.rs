//! Descendants that leave their command's process group (`setsid`) must not outlive the
//! command, nor the node: on a normal run, on SIGTERM, on `kill -9` of the node (the
//! guardian), while a descendant of a command that still runs (the inference server) is
//! left alone until that command ends. Every test drives the real binary; a process in
//! state Z counts as gone.

mod common;

use common::cluster::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);
/// How long a stopped descendant may take to disappear.
const GONE_WITHIN: Duration = Duration::from_secs(10);

/// A shell fragment that starts `sleep <needle>` in a new session (`setsid -f` forks, so
/// the command's shell goes on) and writes its pid to `pidfile`.
fn setsid_sleeper(pidfile: &Path, needle: &str) -> String {
    format!(
        "setsid -f sh -c 'echo $$ > {}.tmp && mv {0}.tmp {0}; exec sleep {needle}' </dev/null >/dev/null 2>&1",
        pidfile.display()
    )
}

/// Fields of /proc/<pid>/stat after the command name: (state, pgid, session).
fn stat(pid: i32) -> Option<(char, i32, i32)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    Some((
        rest[0].chars().next()?,
        rest[2].parse().ok()?,
        rest[3].parse().ok()?,
    ))
}

/// Is `pid` still the live `sleep <needle>` (not gone, not a zombie, not a reused pid)?
fn alive(pid: i32, needle: &str) -> bool {
    let cmd = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
    cmd.contains(&format!("sleep {needle}")) && stat(pid).is_some_and(|(st, _, _)| st != 'Z')
}

/// Wait for the pid file and check that the sleeper really left the node's process group
/// and session.
fn sleeper_pid(pidfile: &Path, needle: &str, node: &NodeProc) -> i32 {
    let mut pid = 0;
    wait_until(LIMIT, &format!("{}", pidfile.display()), || {
        pid = fs::read_to_string(pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        pid > 0 && alive(pid, needle)
    });
    let (_, pgid, sid) = stat(pid).expect("sleeper stat");
    let (_, node_pgid, node_sid) = stat(node.pid()).expect("node stat");
    assert_eq!(sid, pid, "the sleeper must lead its own session");
    assert_ne!(
        pgid, node_pgid,
        "the sleeper must be outside the node's group"
    );
    assert_ne!(
        sid, node_sid,
        "the sleeper must be outside the node's session"
    );
    pid
}

/// Wait until the sleeper is gone; kill it and fail if it is not.
fn wait_gone(pid: i32, needle: &str, what: &str, node: &NodeProc) {
    let start = std::time::Instant::now();
    while alive(pid, needle) {
        if start.elapsed() > GONE_WITHIN {
            let _ = common::kill(pid, libc::SIGKILL);
            panic!(
                "{what} (pid {pid}, sleep {needle}) still alive after {GONE_WITHIN:?}; node stderr:\n{}",
                node.stderr()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills a sleeper left behind by a failed assertion, so it cannot outlive the test.
struct Reap(Vec<(i32, &'static str)>);

impl Drop for Reap {
    fn drop(&mut self) {
        for (pid, needle) in &self.0 {
            if alive(*pid, needle) {
                let _ = common::kill(*pid, libc::SIGKILL);
            }
        }
    }
}

/// One node whose rollout starts a `setsid` sleeper; `then` is the rest of the rollout.
fn cluster(tag: &str, needle: &str, then: &str) -> (TestCluster, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join(format!("{tag}.pid"));
    let toml = format!(
        "[phases.rollout]\ncommand = '''{}; {then}'''\n",
        setsid_sleeper(&pidfile, needle)
    );
    (TestCluster::new(1, &toml), dir, pidfile)
}

const WRITE_OUTPUT: &str = r#"echo '{{"ok": 1}}' > {output}"#;

#[test]
fn a_setsid_grandchild_is_stopped_when_its_rollout_ends_and_the_run_completes() {
    let needle = "300.11";
    let (c, _dir, pidfile) = cluster("a", needle, &format!("sleep 0.5; {WRITE_OUTPUT}"));
    let mut node = c.spawn(0, &["--iterations", "1"]);
    let pid = sleeper_pid(&pidfile, needle, &node);
    let _reap = Reap(vec![(pid, "300.11")]);
    assert_eq!(node.wait(LIMIT), 0, "stderr:\n{}", node.stderr());
    wait_gone(pid, needle, "the rollout's setsid grandchild", &node);
    let log = fs::read_to_string(c.log_path.join("logs/iter-0001/rank-0.rollout.log")).unwrap();
    assert!(
        log.contains("left processes behind"),
        "the rollout log must say what was stopped:\n{log}"
    );
}

#[test]
fn a_setsid_grandchild_is_stopped_when_the_node_gets_sigterm() {
    let needle = "300.12";
    let (c, _dir, pidfile) = cluster("b", needle, "sleep 300.02");
    let mut node = c.spawn(0, &["--iterations", "1"]);
    let pid = sleeper_pid(&pidfile, needle, &node);
    let _reap = Reap(vec![(pid, "300.12")]);
    wait_stderr(&node, "iteration 1: rollout started");
    node.signal(libc::SIGTERM);
    assert_eq!(node.wait(LIMIT), 143, "stderr:\n{}", node.stderr());
    // Gone by the time the node has exited, not later.
    let err = node.stderr();
    assert!(
        !alive(pid, needle),
        "the setsid grandchild outlived the node's exit; stderr:\n{err}"
    );
    assert!(
        err.contains("stopped 1 process(es) that had left their command's process group"),
        "{err}"
    );
}

#[test]
fn a_setsid_grandchild_is_stopped_by_the_guardian_after_kill_9() {
    let needle = "300.13";
    let (c, _dir, pidfile) = cluster("c", needle, "sleep 300.03");
    let mut node = c.spawn(0, &["--iterations", "1"]);
    let pid = sleeper_pid(&pidfile, needle, &node);
    let _reap = Reap(vec![(pid, "300.13")]);
    wait_stderr(&node, "iteration 1: rollout started");
    node.signal(libc::SIGKILL);
    assert_eq!(node.wait(LIMIT), 128 + libc::SIGKILL);
    wait_gone(pid, needle, "the setsid grandchild of a killed node", &node);
    wait_until(GONE_WITHIN, "the rollout's own sleep to stop", || {
        process_alive_with("sleep 300.03").is_empty()
    });
}

#[test]
fn a_running_servers_setsid_descendant_survives_a_rollouts_end_and_not_the_node() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (server_pidfile, rollout_pidfile, go) = (
        dir.join("server.pid"),
        dir.join("rollout.pid"),
        dir.join("go"),
    );
    let (server_needle, rollout_needle) = ("300.14", "300.15");
    let health = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/health_server.py"
    );
    // The eval phase holds the node (server still up) until the test says go.
    let toml = format!(
        r#"
[server]
command = '''{}; exec python3 {health} {{server_port}} {{model}} 0'''
start-timeout = "20s"
stop-grace = "2s"
[phases.rollout]
command = '''{}; sleep 0.5; {WRITE_OUTPUT}'''
[phases.eval]
command = '''i=0; while [ ! -e {} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; {WRITE_OUTPUT}'''
"#,
        setsid_sleeper(&server_pidfile, server_needle),
        setsid_sleeper(&rollout_pidfile, rollout_needle),
        go.display()
    );
    let c = TestCluster::new(1, &toml);
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1", "--eval-interval", "1"],
        &[("RL_NODE_SERVER_PORT", free_port().to_string())],
    );
    let server_desc = sleeper_pid(&server_pidfile, server_needle, &node);
    let rollout_gc = sleeper_pid(&rollout_pidfile, rollout_needle, &node);
    let _reap = Reap(vec![(server_desc, "300.14"), (rollout_gc, "300.15")]);

    // The rollout ended: its grandchild goes, the server's descendant stays.
    wait_stderr(&node, "iteration 1: eval started");
    wait_gone(
        rollout_gc,
        rollout_needle,
        "the rollout's setsid grandchild",
        &node,
    );
    assert!(
        alive(server_desc, server_needle),
        "the running server's setsid descendant was stopped with the rollout; stderr:\n{}",
        node.stderr()
    );

    fs::write(&go, "").unwrap();
    assert_eq!(node.wait(LIMIT), 0, "stderr:\n{}", node.stderr());
    assert!(
        !alive(server_desc, server_needle),
        "the server's setsid descendant outlived the node; stderr:\n{}",
        node.stderr()
    );
}

fn wait_stderr(node: &NodeProc, needle: &str) {
    wait_until(LIMIT, &format!("stderr to show {needle:?}"), || {
        node.stderr().contains(needle)
    });
}

/// The documented limit: a descendant that clears its environment and is orphaned carries
/// no command's mark, so it survives its command; it is still in the node's process tree
/// and is stopped when the node shuts down.
#[test]
fn a_setsid_grandchild_with_a_cleared_environment_is_stopped_at_shutdown() {
    let needle = "300.16";
    let tmp = tempfile::tempdir().unwrap();
    let (pidfile, go) = (tmp.path().join("e.pid"), tmp.path().join("go"));
    let toml = format!(
        r#"
[phases.rollout]
command = '''setsid -f env -i sh -c 'echo $$ > {p}.tmp && mv {p}.tmp {p}; exec /bin/sleep {needle}' </dev/null >/dev/null 2>&1; sleep 0.5; {WRITE_OUTPUT}'''
[phases.eval]
command = '''i=0; while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; {WRITE_OUTPUT}'''
"#,
        p = pidfile.display(),
        go = go.display()
    );
    let c = TestCluster::new(1, &toml);
    let mut node = c.spawn(0, &["--iterations", "1", "--eval-interval", "1"]);
    let pid = sleeper_pid(&pidfile, needle, &node);
    let _reap = Reap(vec![(pid, "300.16")]);
    wait_stderr(&node, "iteration 1: eval started");
    assert!(
        alive(pid, needle),
        "an unmarked orphan cannot be told apart; it is left until shutdown"
    );
    fs::write(&go, "").unwrap();
    assert_eq!(node.wait(LIMIT), 0, "stderr:\n{}", node.stderr());
    assert!(
        !alive(pid, needle),
        "the unmarked grandchild outlived the node; stderr:\n{}",
        node.stderr()
    );
}
