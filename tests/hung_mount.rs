//! A shared directory that stops answering, for real: nodes on an sshfs mount whose server
//! is frozen. The node's watchdog fires at fs-timeout, the node's commands die, and the
//! process the launcher waits on exits on time, although the node process itself stays in
//! the kernel (state D) until the filesystem answers.

mod common;
use common::cluster::*;
use common::sshfs::{self, SshfsCluster};
use std::fs;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);

/// The states (R, S, D, Z…) of every thread of `pid`; empty once it is gone.
fn thread_states(pid: i32) -> Vec<char> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let stat = fs::read_to_string(t.path().join("stat")).ok()?;
            stat.rsplit_once(')')?.1.trim_start().chars().next()
        })
        .collect()
}

fn gone(pid: i32) -> bool {
    thread_states(pid).iter().all(|s| *s == 'Z' || *s == 'X')
}

/// Nodes over one sshfs mount, each in a rollout that sleeps (`sleep 300.<tag>`).
struct Hung {
    nodes: Vec<NodeProc>,
    /// The node process under each launched process.
    inner: Vec<i32>,
    guardians: Vec<i32>,
    needle: String,
    _c: TestCluster,
    _marks: tempfile::TempDir,
    fs: SshfsCluster,
}

impl Hung {
    fn start(num_nodes: u32, tag: &str, fs_timeout: &str) -> Hung {
        let fs = SshfsCluster::start(1, 1).expect("sshfs substrate");
        // Each rollout notes on local disk that it runs, then sleeps in its own group.
        let marks = tempfile::tempdir().unwrap();
        let needle = format!("sleep 300.{tag}");
        let c = TestCluster::new(
            num_nodes,
            &format!(
                "[phases.rollout]\ncommand = \"touch {}/rank-{{rank}}; exec {needle}\"\n",
                marks.path().display()
            ),
        );
        let shared = fs.mount(0).join("exp");
        fs::create_dir_all(&shared).unwrap();
        let mut nodes: Vec<NodeProc> = (0..num_nodes)
            .map(|r| {
                c.spawn_env(
                    r,
                    &shared,
                    &["--iterations", "1"],
                    &[("RL_NODE_TIMING_FS_TIMEOUT", fs_timeout.to_string())],
                )
            })
            .collect();
        wait_until(LIMIT, "every rollout to run", || {
            for n in nodes.iter_mut() {
                if let Ok(Some(st)) = n.child.try_wait() {
                    panic!("rank {} exited ({st}):\n{}", n.rank, n.stderr());
                }
            }
            (0..num_nodes).all(|r| marks.path().join(format!("rank-{r}")).exists())
        });
        let inner: Vec<i32> = nodes.iter().map(NodeProc::node_process).collect();
        let guardians: Vec<i32> = inner
            .iter()
            .flat_map(|p| descendants(*p))
            .filter(|p| {
                fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("__guard"))
            })
            .collect();
        assert_eq!(guardians.len(), nodes.len(), "one guardian per node");
        Hung {
            nodes,
            inner,
            guardians,
            needle,
            _c: c,
            _marks: marks,
            fs,
        }
    }

    /// Each launched process exits `code` within `within` of `since` (`what` happened then),
    /// saying that its node process is stuck in the kernel; returns each one's stderr.
    fn expect_exits(
        &mut self,
        code: i32,
        (since, what): (Instant, &str),
        within: Duration,
    ) -> Vec<String> {
        let mut out = vec![];
        for (n, pid) in self.nodes.iter_mut().zip(&self.inner) {
            let got = n.wait(LIMIT);
            let after = since.elapsed();
            let err = n.stderr();
            eprintln!("rank {}: exit {got} {after:?} after {what}", n.rank);
            assert_eq!(got, code, "rank {}:\n{err}", n.rank);
            assert!(
                after < within,
                "rank {}: exit {code} came {after:?} after {what}, not within {within:?}:\n{err}",
                n.rank
            );
            assert!(
                err.contains(&format!("node process {pid} is stuck in the kernel"))
                    && err.contains(&format!("exiting with code {code} on its behalf")),
                "rank {}: the launched process must say why it exits:\n{err}",
                n.rank
            );
            // In the node's log format: a dated, zoned time, then the rank.
            let line = err
                .lines()
                .find(|l| l.contains(&format!("node process {pid} is stuck in the kernel")))
                .unwrap();
            let (stamp, rest) = line.split_once(' ').unwrap();
            assert!(
                chrono::DateTime::parse_from_rfc3339(stamp).is_ok()
                    && rest.starts_with(&format!("[rank {}] error: ", n.rank)),
                "rank {}: {line}",
                n.rank
            );
            out.push(err);
        }
        out
    }

    /// The node processes are in the kernel, their commands are gone; once the server
    /// answers, the node processes and their guardians exit.
    fn expect_stuck_then_thaw(&self, frozen: sshfs::Frozen) {
        for pid in &self.inner {
            let states = thread_states(*pid);
            eprintln!("node process {pid}: thread states {states:?}");
            assert!(
                states.contains(&'D'),
                "node process {pid} is not stuck in the kernel (thread states {states:?})"
            );
        }
        wait_until(Duration::from_secs(10), "the rollouts to be killed", || {
            process_alive_with(&self.needle).is_empty()
        });
        drop(frozen);
        for pid in &self.inner {
            wait_until(LIMIT, &format!("node process {pid} to exit"), || gone(*pid));
        }
        wait_until(LIMIT, "the guardians to exit", || {
            self.guardians.iter().all(|g| gone(*g))
        });
    }
}

#[test]
fn a_hung_mount_ends_the_launched_processes_with_exit_4_at_fs_timeout_and_kills_their_commands() {
    if !sshfs::require("a_hung_mount_ends_the_launched_processes_with_exit_4_at_fs_timeout_and_kills_their_commands") {
        return;
    }
    let mut h = Hung::start(2, "81", "3s");
    // Every call on the mount now waits for a server that does not answer: each node's
    // next poll of its peer's record hangs.
    let frozen = h.fs.freeze_server();
    let froze = Instant::now();
    // fs-timeout, the watchdog's tick, the node's half second to kill its commands, the
    // supervisor's 2 s; the rest is margin for a loaded machine.
    let errs = h.expect_exits(4, (froze, "the freeze"), Duration::from_secs(3 + 12));
    // Each node both polls its peer's record and writes its own heartbeat; whichever call
    // reached the frozen mount first is the one stuck longest and the one named.
    for err in errs {
        assert!(
            [
                "polling the shared directory",
                "writing the heartbeat record"
            ]
            .iter()
            .any(|what| err.contains(&format!(
                "on the shared filesystem (no answer for 3s while {what}; fs-timeout is 3s)"
            ))) && err
                .contains("its commands were killed, and it will exit when the filesystem answers"),
            "{err}"
        );
    }
    h.expect_stuck_then_thaw(frozen);
}

/// One node has no peer to poll while its command runs: its heartbeat write is what hangs.
#[test]
fn a_hung_mount_under_a_single_node_waiting_on_its_command_ends_with_exit_4_at_fs_timeout() {
    if !sshfs::require(
        "a_hung_mount_under_a_single_node_waiting_on_its_command_ends_with_exit_4_at_fs_timeout",
    ) {
        return;
    }
    let mut h = Hung::start(1, "82", "3s");
    let frozen = h.fs.freeze_server();
    let froze = Instant::now();
    let errs = h.expect_exits(4, (froze, "the freeze"), Duration::from_secs(3 + 12));
    assert!(
        errs[0].contains("while writing the heartbeat record"),
        "{}",
        errs[0]
    );
    h.expect_stuck_then_thaw(frozen);
}

/// The user presses Ctrl-C twice at a node whose mount hangs (fs-timeout is far off): the
/// second signal's exit, after its bounded wait for the first one's abort to be written,
/// cannot complete in the kernel either, and the launched process exits with its code
/// instead.
#[test]
fn a_second_signal_to_a_node_stuck_on_a_hung_mount_ends_the_launched_process_at_once() {
    if !sshfs::require(
        "a_second_signal_to_a_node_stuck_on_a_hung_mount_ends_the_launched_process_at_once",
    ) {
        return;
    }
    let mut h = Hung::start(1, "83", "10m");
    let frozen = h.fs.freeze_server();
    h.nodes[0].signal(libc::SIGTERM);
    // The first signal stops the node gracefully: it publishes an abort, which hangs.
    wait_until(LIMIT, "the first SIGTERM to be handled", || {
        h.nodes[0].stderr().contains("received SIGTERM; stopping")
    });
    let second = Instant::now();
    h.nodes[0].signal(libc::SIGTERM);
    let errs = h.expect_exits(143, (second, "the second signal"), Duration::from_secs(12));
    assert!(
        errs[0].contains("second SIGTERM: killing children now and exiting"),
        "{}",
        errs[0]
    );
    // Its abort could not be written: the node says so before it gives up on it.
    assert!(
        errs[0].contains("the abort could not be written to this node's record within 2s"),
        "{}",
        errs[0]
    );
    h.expect_stuck_then_thaw(frozen);
}
