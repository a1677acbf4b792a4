//! Every way a node can end is reported: a closed stdout/stderr, SIGHUP, SIGUSR1/SIGUSR2
//! (a batch system's time-limit warning), and a signal to a run that never waits.

mod common;

use common::cluster::*;
use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);

const SLOW_ROLLOUT: &str =
    "[phases.rollout]\ncommand = \"sleep 0.2; echo '{\\\"rank\\\": {rank}}' > {output}\"\n";

fn wait_both(a: &mut NodeProc, b: &mut NodeProc) -> (i32, i32) {
    (a.wait(LIMIT), b.wait(LIMIT))
}

#[test]
fn a_node_whose_stdout_and_stderr_are_closed_keeps_running_and_completes() {
    let c = TestCluster::new(2, SLOW_ROLLOUT);
    fs::create_dir_all(&c.log_path).unwrap();
    let mut master = c.spawn(0, &["--iterations", "3"]);
    // Rank 1 writes into pipes whose readers are gone, like `rl-node … | head` after
    // `head` exited: every write fails with EPIPE.
    let mut cmd = Command::new(BIN);
    cmd.args(["--worker", "1", "--config"])
        .arg(&c.config)
        .arg("--log-path")
        .arg(&c.log_path)
        .args(["--iterations", "3"]);
    let status = run_with_closed_output(&mut cmd, LIMIT, "rank 1");
    assert_eq!(
        status.code(),
        Some(0),
        "rank 1 must not die of its closed output ({status})"
    );
    assert_eq!(master.wait(LIMIT), 0, "{}", master.stderr());
    let merged = fs::read_to_string(c.log_path.join("rollouts/iter-0003/train.jsonl")).unwrap();
    assert_eq!(merged.lines().count(), 2, "{merged}");
}

#[test]
fn sighup_stops_the_cluster_with_an_abort_naming_the_node_and_the_signal() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"sleep 60.71; echo '{}' > {output}\"\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    for r in 0..2 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    let sent = Instant::now();
    nodes[1].signal(libc::SIGHUP);
    let (a, b) = {
        let (x, y) = nodes.split_at_mut(1);
        wait_both(&mut x[0], &mut y[0])
    };
    // Peers see the abort within a poll or two, far sooner than dead-after (3 s here).
    assert!(
        sent.elapsed() < Duration::from_millis(2500),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(b, 129, "rank 1:\n{}", nodes[1].stderr());
    assert_eq!(a, 3, "rank 0:\n{}", nodes[0].stderr());
    assert!(
        nodes[0].stderr().contains("interrupted by SIGHUP"),
        "{}",
        nodes[0].stderr()
    );
    assert!(
        !nodes[0].stderr().contains("is dead"),
        "{}",
        nodes[0].stderr()
    );
    wait_until(LIMIT, "the rollouts to be stopped", || {
        process_alive_with("sleep 60.71").is_empty()
    });
}

#[test]
fn sigusr1_stops_every_node_gracefully_with_exit_75_and_a_restart_resumes() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"if [ {iteration} = 2 ] && [ ! -e {log_path}/warned ]; then touch {log_path}/warned; sleep 60.72; fi; echo '{\\\"rank\\\": {rank}}' > {output}\"\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    wait_until(LIMIT, "iteration 2's rollout", || {
        c.log_path.join("warned").exists()
    });
    // Slurm's `--signal=USR1@N` sends the warning to the job's processes.
    nodes[0].signal(libc::SIGUSR1);
    let (a, b) = {
        let (x, y) = nodes.split_at_mut(1);
        wait_both(&mut x[0], &mut y[0])
    };
    assert_eq!(
        (a, b),
        (75, 75),
        "rank 0:\n{}\nrank 1:\n{}",
        nodes[0].stderr(),
        nodes[1].stderr()
    );
    for n in &nodes {
        assert!(
            n.stderr()
                .contains("time limit approaching (SIGUSR1 received)"),
            "{}",
            n.stderr()
        );
    }
    // Requeued: the same commands resume at iteration 2 and finish.
    let mut again = c.spawn_all(&["--iterations", "2"]);
    for n in again.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    }
    assert!(
        again[0].stderr().contains("at iteration 2"),
        "{}",
        again[0].stderr()
    );
}

#[test]
fn a_one_node_run_without_commands_stops_on_the_first_sigterm_and_warns_at_start() {
    let c = TestCluster::new(1, "");
    fs::create_dir_all(&c.log_path).unwrap();
    let mut node = c.spawn(0, &[]);
    wait_until(LIMIT, "the node to loop", || {
        c.record(0)
            .is_some_and(|r| r["iteration"].as_u64() >= Some(3))
    });
    node.signal(libc::SIGTERM);
    assert_eq!(node.wait(LIMIT), 143, "{}", node.stderr());
    assert!(
        node.stderr()
            .contains("warning: no phase command is configured"),
        "{}",
        node.stderr()
    );
}

/// A fake `nvidia-smi` that reports GPU memory still in use, so a node that stopped its
/// server waits for the memory to drain (up to gpu-drain-timeout).
fn busy_gpu(dir: &std::path::Path) -> String {
    let bin = dir.join("fake-bin");
    fs::create_dir_all(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    fs::write(&smi, "#!/bin/sh\necho 40000\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

#[test]
fn sigint_and_a_peers_abort_are_honoured_within_a_poll_while_waiting_for_gpu_memory() {
    for interrupt in ["sigint", "abort"] {
        let c = TestCluster::new(
            2,
            &format!(
                "[server]\ncommand = \"exec python3 {} {{server_port}} {{model}} 0\"\nstart-timeout = \"20s\"\nstop-grace = \"2s\"\ngpu-drain-mib = 1000\ngpu-drain-timeout = \"5m\"\n[phases.rollout]\ncommand = \"echo '{{}}' > {{output}}\"\n",
                concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/health_server.py")
            ),
        );
        fs::create_dir_all(&c.log_path).unwrap();
        let path = busy_gpu(c.dir.path());
        let nodes: Vec<NodeProc> = (0..2)
            .map(|r| {
                c.spawn_env(
                    r,
                    &c.log_path,
                    &["--iterations", "1"],
                    &[
                        ("RL_NODE_SERVER_PORT", free_port().to_string()),
                        ("PATH", path.clone()),
                    ],
                )
            })
            .collect();
        let mut nodes = nodes;
        wait_until(LIMIT, "rank 1 to wait for GPU memory", || {
            nodes[1]
                .stderr()
                .contains("waiting for GPU memory to drain")
        });
        let sent = Instant::now();
        if interrupt == "sigint" {
            nodes[1].signal(libc::SIGINT);
            assert_eq!(nodes[1].wait(LIMIT), 130, "{}", nodes[1].stderr());
        } else {
            // Rank 0 (also draining) is stopped: its abort must reach rank 1 now.
            wait_until(LIMIT, "rank 0 to wait for GPU memory", || {
                nodes[0]
                    .stderr()
                    .contains("waiting for GPU memory to drain")
            });
            nodes[0].signal(libc::SIGTERM);
            assert_eq!(nodes[1].wait(LIMIT), 3, "{}", nodes[1].stderr());
            assert!(
                nodes[1].stderr().contains("interrupted by SIGTERM"),
                "{}",
                nodes[1].stderr()
            );
        }
        assert!(
            sent.elapsed() < Duration::from_secs(5),
            "{interrupt}: rank 1 took {:?} (the drain wait is 5 minutes)",
            sent.elapsed()
        );
        for n in nodes.iter_mut() {
            n.signal(libc::SIGTERM);
            n.wait(LIMIT);
        }
    }
}

#[test]
fn sigint_is_honoured_within_a_poll_while_rank_0_merges() {
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"echo x > {output}\"\n[aggregate]\nformat = \"command\"\ncommand = \"sleep 60.75; cat {inputs} > {output}\"\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let mut n = c.spawn(0, &["--iterations", "1"]);
    wait_until(LIMIT, "the merge command to run", || {
        !process_alive_with("sleep 60.75").is_empty()
    });
    let sent = Instant::now();
    n.signal(libc::SIGINT);
    assert_eq!(n.wait(LIMIT), 130, "{}", n.stderr());
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "{:?}",
        sent.elapsed()
    );
    wait_until(LIMIT, "the merge command to be stopped", || {
        process_alive_with("sleep 60.75").is_empty()
    });
}

/// One node whose rollout, on SIGTERM, takes `linger` seconds to finish (a graceful stop
/// that takes that long), started in a process group of its own like a shell's job. Waits
/// until the rollout runs. kill-grace is long, so only an escalation cuts the linger short.
fn lingering_job(tag: &str, linger: &str) -> (TestCluster, NodeProc) {
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"trap 'sleep {linger}; exit 0' TERM; sleep 300.{tag} & wait\"\n"
        ),
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let (mut cmd, stderr) = c.command(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_TIMING_KILL_GRACE", "60s".to_string())],
    );
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    let node = NodeProc::from_child(0, cmd.spawn().unwrap(), stderr);
    // The `sleep` itself, not the `sh -c` whose command line names it too: it starts
    // after the trap is set.
    wait_until(LIMIT, "the rollout to run", || {
        process_alive_with(&format!("sleep 300.{tag}"))
            .iter()
            .any(|p| fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.starts_with(b"sleep")))
    });
    (c, node)
}

/// A terminal's Ctrl-C reaches the whole foreground process group; `kill PID` reaches the
/// launched process alone; Slurm signals every process of a job step, the node process
/// included. Each is one delivery: one graceful stop (the rollout's trap runs to its end),
/// never the second-signal escalation.
#[test]
fn ctrl_c_to_the_process_group_kill_of_the_pid_or_a_signal_to_every_process_stops_the_node_once() {
    for (tag, delivery) in [("931", "group"), ("932", "pid"), ("933", "every process")] {
        let (_c, mut node) = lingering_job(tag, "3");
        let sig = if delivery == "every process" {
            libc::SIGTERM
        } else {
            libc::SIGINT
        };
        let sent = Instant::now();
        match delivery {
            "group" => {
                let _ = common::kill(-node.pid(), sig);
            }
            "pid" => node.signal(sig),
            _ => {
                let inner = node.node_process();
                node.signal(sig);
                let _ = common::kill(inner, sig);
            }
        }
        let code = node.wait(LIMIT);
        let err = node.stderr();
        assert_eq!(code, 128 + sig, "{delivery}:\n{err}");
        let name = if sig == libc::SIGINT {
            "SIGINT"
        } else {
            "SIGTERM"
        };
        assert_eq!(
            err.matches(&format!("received {name}; stopping")).count(),
            1,
            "{delivery}:\n{err}"
        );
        assert!(!err.contains("second"), "{delivery}: escalated:\n{err}");
        // The graceful stop waited for the rollout's trap (3 s).
        assert!(
            sent.elapsed() >= Duration::from_millis(2500),
            "{delivery}: stopped after {:?}, before the rollout's trap ended:\n{err}",
            sent.elapsed()
        );
    }
}

/// The control: two Ctrl-Cs to the process group are two deliveries, and the second kills
/// the rollout at once instead of waiting for its 60 s trap.
#[test]
fn a_second_ctrl_c_to_the_process_group_kills_at_once() {
    let (_c, mut node) = lingering_job("934", "60.934");
    let sent = Instant::now();
    let _ = common::kill(-node.pid(), libc::SIGINT);
    wait_until(LIMIT, "the graceful stop to begin", || {
        node.stderr().contains("received SIGINT; stopping")
    });
    let _ = common::kill(-node.pid(), libc::SIGINT);
    assert_eq!(node.wait(LIMIT), 130, "{}", node.stderr());
    let err = node.stderr();
    assert!(
        err.contains("second SIGINT: killing children now and exiting"),
        "{err}"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(30),
        "{:?}",
        sent.elapsed()
    );
    wait_until(LIMIT, "the rollout to be killed", || {
        process_alive_with("sleep 300.934").is_empty()
            && process_alive_with("sleep 60.934").is_empty()
    });
}

/// Peers would call a silent rank dead only after this: a minute, so that a peer reporting
/// anything within [`WELL_BEFORE_DEAD`] learned it from the signalled node's abort.
const LONG_DEAD_AFTER: &str = "60s";
const WELL_BEFORE_DEAD: Duration = Duration::from_secs(25);

/// `n` nodes with a long dead-after whose rollouts sleep (`sleep 300.<tag>`), each waited
/// for until it runs its rollout. The rollouts ignore SIGTERM, so a node's graceful stop
/// lasts its kill-grace: a second signal sent meanwhile always finds it still stopping.
fn nodes_in_their_rollout(n: u32, tag: &str) -> (TestCluster, Vec<NodeProc>) {
    let c = TestCluster::new(
        n,
        &format!("[phases.rollout]\ncommand = \"trap '' TERM; sleep 300.{tag}; echo '{{}}' > {{output}}\"\n"),
    );
    fs::create_dir_all(&c.log_path).unwrap();
    let nodes: Vec<NodeProc> = (0..n)
        .map(|r| {
            c.spawn_env(
                r,
                &c.log_path,
                &["--iterations", "1"],
                &[("RL_NODE_TIMING_DEAD_AFTER", LONG_DEAD_AFTER.to_string())],
            )
        })
        .collect();
    for r in 0..n {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    wait_until(LIMIT, "every rollout to run", || {
        process_alive_with(&format!("sleep 300.{tag}")).len() >= n as usize
    });
    (c, nodes)
}

/// Whether signal `sig` is pending for process `pid` (`ShdPnd` in its `/proc` status).
fn pending(pid: i32, sig: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("ShdPnd:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|mask| mask & (1 << (sig - 1)) != 0)
}

/// A peer stopped because of the signalled rank's abort: its exit code, a message naming
/// the rank and the signal, and no "dead".
fn assert_peer_names_the_signal(peer: &mut NodeProc, rank: u32, code: i32, signal: &str) {
    let got = peer.wait(WELL_BEFORE_DEAD);
    let err = peer.stderr();
    assert_eq!(got, code, "rank {}:\n{err}", peer.rank);
    assert!(
        err.contains(&format!("rank {rank} on")) && err.contains(signal),
        "rank {} does not name rank {rank} and {signal}:\n{err}",
        peer.rank
    );
    assert!(!err.contains("is dead"), "rank {}:\n{err}", peer.rank);
}

/// Two signals back to back at a worker in its rollout: the first decides (its abort is
/// published before the node exits, and its code, `own`, is the node's), the second only
/// kills the rollout at once. Rank 0 stops with the first signal's abort (`peer`, a
/// message with `named`) well before dead-after.
fn the_first_of_two_signals_decides(
    tag: &str,
    (first, second): (i32, i32),
    own: i32,
    peer: i32,
    named: &str,
) {
    let (_c, mut nodes) = nodes_in_their_rollout(2, tag);
    let sent = Instant::now();
    // The second follows as soon as the first left the pending set: two signals pending
    // at the same moment have no order (the kernel hands over the lowest number first).
    nodes[1].signal(first);
    wait_until(LIMIT, "the first signal to be taken", || {
        !pending(nodes[1].pid(), first)
    });
    nodes[1].signal(second);
    let code = nodes[1].wait(WELL_BEFORE_DEAD);
    let err = nodes[1].stderr();
    assert_eq!(code, own, "rank 1:\n{err}");
    assert_peer_names_the_signal(&mut nodes[0], 1, peer, named);
    // It says why it stopped, and that it escalated.
    assert!(err.contains(named), "rank 1:\n{err}");
    assert!(
        err.contains("killing children now"),
        "not escalated:\n{err}"
    );
    assert!(sent.elapsed() < WELL_BEFORE_DEAD, "{:?}", sent.elapsed());
    wait_until(LIMIT, "the rollouts to be stopped", || {
        process_alive_with(&format!("sleep 300.{tag}")).is_empty()
    });
}

#[test]
fn sigterm_then_sigint_exits_143_and_peers_learn_of_the_sigterm() {
    the_first_of_two_signals_decides(
        "941",
        (libc::SIGTERM, libc::SIGINT),
        143,
        3,
        "interrupted by SIGTERM",
    );
}

#[test]
fn sigint_twice_exits_130_and_peers_learn_of_the_sigint() {
    the_first_of_two_signals_decides(
        "942",
        (libc::SIGINT, libc::SIGINT),
        130,
        3,
        "interrupted by SIGINT",
    );
}

/// A time-limit warning followed by SIGTERM (a batch system's warning, then its kill):
/// still a graceful stop to be resumed, 75 everywhere, never 128 + a signal.
#[test]
fn sigusr1_then_sigterm_exits_75_everywhere() {
    the_first_of_two_signals_decides(
        "943",
        (libc::SIGUSR1, libc::SIGTERM),
        75,
        75,
        "(SIGUSR1 received)",
    );
}

/// A storm of SIGTERMs (a script's `kill` in a loop) at rank 0 during a long command:
/// every worker stops with rank 0's SIGTERM as the cause, never as a dead rank 0, and
/// rank 0 exits 143.
#[test]
fn a_storm_of_sigterms_at_rank_0_is_reported_as_its_signal_not_as_its_death() {
    let (_c, mut nodes) = nodes_in_their_rollout(3, "944");
    let node_process = nodes[0].node_process();
    for i in 0..200 {
        nodes[0].signal(libc::SIGTERM);
        // Some reach the node process directly too, as a batch system's would.
        if i % 4 == 0 {
            let _ = common::kill(node_process, libc::SIGTERM);
        }
    }
    let code = nodes[0].wait(WELL_BEFORE_DEAD);
    assert_eq!(code, 143, "rank 0:\n{}", nodes[0].stderr());
    for w in nodes[1..].iter_mut() {
        assert_peer_names_the_signal(w, 0, 3, "interrupted by SIGTERM");
    }
    wait_until(LIMIT, "the rollouts to be stopped", || {
        process_alive_with("sleep 300.944").is_empty()
    });
}
