//! Ordering inside a phase, as run.sh did: with `workers-wait = true` the workers start
//! their rollout only once rank 0's command creates `{ready_file}` (or ends), through the
//! node's wait loop, with a timeout and the usual abort and signal handling.

mod common;
use common::cluster::*;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

fn gated(rank0: &str, extra: &str) -> String {
    format!(
        r#"
[phases.rollout]
workers-wait = true
{extra}
command = "if [ {{rank}} = 0 ]; then {rank0}; else if [ -e {{log_path}}/released ]; then echo after > {{log_path}}/order-{{rank}}; else echo before > {{log_path}}/order-{{rank}}; fi; fi; echo '{{{{}}}}' > {{output}}"
"#
    )
}

#[test]
fn workers_start_only_after_rank_0s_command_creates_the_ready_file() {
    // Rank 0 notes "released" and only then creates the ready file; a worker that started
    // early would not see "released".
    let c = TestCluster::new(
        3,
        &gated(
            "sleep 0.5; touch {log_path}/released; touch {ready_file}; sleep 0.2",
            "",
        ),
    );
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    for rank in 1..3 {
        let order = fs::read_to_string(c.log_path.join(format!("order-{rank}"))).unwrap();
        assert_eq!(order.trim(), "after", "rank {rank}");
        assert!(
            nodes[rank as usize]
                .stderr()
                .contains("rollout let the workers start"),
            "{}",
            nodes[rank as usize].stderr()
        );
    }
}

#[test]
fn a_rank_0_command_that_never_creates_the_file_releases_the_workers_when_it_ends() {
    let c = TestCluster::new(2, &gated("sleep 0.3; touch {log_path}/released", ""));
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let order = fs::read_to_string(c.log_path.join("order-1")).unwrap();
    assert_eq!(order.trim(), "after");
}

#[test]
fn a_ready_file_that_does_not_come_in_time_stops_the_cluster_with_exit_4() {
    let c = TestCluster::new(
        2,
        &gated("exec sleep 60.93", "workers-wait-timeout = \"1s\""),
    );
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    let worker = nodes[1].wait(LIMIT);
    let err = nodes[1].stderr();
    assert_eq!(worker, 4, "{err}");
    assert!(
        err.contains("did not create") && err.contains("phases.rollout.workers-wait-timeout (1s)"),
        "{err}"
    );
    assert_eq!(nodes[0].wait(LIMIT), 3, "{}", nodes[0].stderr());
    wait_until(LIMIT, "rank 0's rollout to be stopped", || {
        process_alive_with("sleep 60.93").is_empty()
    });
}

#[test]
fn a_waiting_worker_honours_sigint_within_a_poll_and_status_shows_what_it_waits_for() {
    let c = TestCluster::new(2, &gated("exec sleep 60.94", ""));
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    wait_until(LIMIT, "the worker to wait for the ready file", || {
        c.record(1).is_some_and(|r| {
            r["progress"]
                .as_str()
                .is_some_and(|p| p.contains("to create") && p.contains("ready-iter-0001-train"))
        })
    });
    let (_, text) = status(&c.log_path, false);
    assert!(text.contains("ready-iter-0001-train"), "{text}");
    let started = std::time::Instant::now();
    nodes[1].signal(libc::SIGINT);
    assert_eq!(nodes[1].wait(LIMIT), 130, "{}", nodes[1].stderr());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(nodes[0].wait(LIMIT), 3, "{}", nodes[0].stderr());
}

#[test]
fn gate_misuse_is_refused_naming_the_key() {
    for (toml, key) in [
        (
            "[phases.rollout]\ncommand = \"touch {ready_file}\"\n",
            "phases.rollout.command",
        ),
        (
            "[phases.rollout]\nworkers-wait = true\nworkers-wait-timeout = \"0s\"\ncommand = \"true\"\n",
            "phases.rollout.workers-wait-timeout",
        ),
        (
            "[phases.train]\ncommand = \"touch {ready_file}\"\n",
            "phases.train.command",
        ),
    ] {
        let c = TestCluster::new(1, toml);
        let mut n = c.spawn(0, &[]);
        assert_eq!(n.wait(LIMIT), 2, "{toml}");
        assert!(n.stderr().contains(key), "{toml}: {}", n.stderr());
    }
}
