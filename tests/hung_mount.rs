//! A shared directory that stops answering, for real: two nodes on an sshfs mount whose
//! server is frozen. Each node's watchdog fires at fs-timeout, the node's commands die,
//! and the process the launcher waits on exits 4 on time, although the node process
//! itself stays in the kernel (state D) until the filesystem answers.

mod common;
use common::cluster::*;
use common::sshfs::{self, SshfsCluster};
use std::fs;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);
const FS_TIMEOUT: Duration = Duration::from_secs(3);

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

#[test]
fn a_hung_mount_ends_the_launched_process_with_exit_4_at_fs_timeout_and_kills_its_commands() {
    if !sshfs::require(
        "a_hung_mount_ends_the_launched_process_with_exit_4_at_fs_timeout_and_kills_its_commands",
    ) {
        return;
    }
    let fs = SshfsCluster::start(1, 1).expect("sshfs substrate");
    // Each rollout notes on local disk that it runs, then sleeps in its own group.
    let marks = tempfile::tempdir().unwrap();
    let c = TestCluster::new(
        2,
        &format!(
            "[phases.rollout]\ncommand = \"touch {}/rank-{{rank}}; exec sleep 300.81\"\n",
            marks.path().display()
        ),
    );
    let shared = fs.mount(0).join("exp");
    fs::create_dir_all(&shared).unwrap();
    let timeout = format!("{}s", FS_TIMEOUT.as_secs());
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| {
            c.spawn_env(
                r,
                &shared,
                &["--iterations", "1"],
                &[("RL_NODE_TIMING_FS_TIMEOUT", timeout.clone())],
            )
        })
        .collect();
    wait_until(LIMIT, "both rollouts to run", || {
        for n in nodes.iter_mut() {
            if let Ok(Some(st)) = n.child.try_wait() {
                panic!("rank {} exited ({st}):\n{}", n.rank, n.stderr());
            }
        }
        (0..2).all(|r| marks.path().join(format!("rank-{r}")).exists())
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
    assert_eq!(guardians.len(), 2, "one guardian per node");

    // Every call on the mount now waits for a server that does not answer. Each node's
    // next poll of its peer's record hangs.
    let frozen = fs.freeze_server();
    let froze = Instant::now();
    for (n, pid) in nodes.iter_mut().zip(&inner) {
        let code = n.wait(LIMIT);
        let after = froze.elapsed();
        let err = n.stderr();
        eprintln!("rank {}: exit {code} {after:?} after the freeze", n.rank);
        assert_eq!(code, 4, "rank {}:\n{err}", n.rank);
        // fs-timeout, the watchdog's tick, the node's half second to kill its commands,
        // the supervisor's 2 s moment; the rest is margin for a loaded machine.
        assert!(
            after < FS_TIMEOUT + Duration::from_secs(12),
            "rank {}: exit 4 came {after:?} after the freeze (fs-timeout {FS_TIMEOUT:?}):\n{err}",
            n.rank
        );
        assert!(
            err.contains(&format!(
                "node process {pid} is stuck in the kernel on the shared filesystem"
            )) && err.contains("it will exit when the filesystem answers")
                && err.contains("exiting with code 4 on its behalf"),
            "rank {}: the launched process must say why it exits:\n{err}",
            n.rank
        );
        assert!(err.contains("fs-timeout is 3s"), "{err}");
    }
    // The launched processes are gone; their node processes are still in the kernel.
    for pid in &inner {
        let states = thread_states(*pid);
        eprintln!("node process {pid}: thread states {states:?}");
        assert!(
            states.contains(&'D'),
            "node process {pid} is not stuck in the kernel (thread states {states:?})"
        );
    }
    // Their commands did not wait for the filesystem.
    wait_until(Duration::from_secs(10), "the rollouts to be killed", || {
        process_alive_with("sleep 300.81").is_empty()
    });

    // The filesystem answers: the stuck node processes finish exiting.
    drop(frozen);
    for pid in &inner {
        wait_until(LIMIT, &format!("node process {pid} to exit"), || gone(*pid));
    }
    wait_until(LIMIT, "the guardians to exit", || {
        guardians.iter().all(|g| gone(*g))
    });
    drop(nodes);
}
