//! The inference-server lifecycle and checkpoint hand-off with a real HTTP server
//! (tests/fixtures/health_server.py) on real ports.

mod common;
use common::cluster::*;
use std::fs;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(60);

fn server_toml(delay: &str) -> String {
    format!(
        r#"
[server]
command = "exec python3 {} {{server_port}} {{model}} {delay}"
start-timeout = "20s"
stop-grace = "2s"
"#,
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/health_server.py"
        )
    )
}

/// Each node of a one-machine cluster needs its own server port.
fn spawn_with_ports(c: &TestCluster, args: &[&str]) -> (Vec<NodeProc>, Vec<u16>) {
    let ports: Vec<u16> = (0..c.num_nodes).map(|_| free_port()).collect();
    let nodes = (0..c.num_nodes)
        .map(|r| {
            c.spawn_env(
                r,
                &c.log_path,
                args,
                &[("RL_NODE_SERVER_PORT", ports[r as usize].to_string())],
            )
        })
        .collect();
    (nodes, ports)
}

fn get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split("\r\n\r\n").nth(1).map(str::to_string)
}

const TRAIN: &str = r#"
[phases.train]
command = "mkdir -p {output}/checkpoint-7 && echo 'weights {iteration}' > {output}/checkpoint-7/w.bin"
"#;

#[test]
fn server_restarts_on_each_published_checkpoint() {
    let c = TestCluster::new(2, &format!("{}{TRAIN}", server_toml("0")));
    let model0 = c.dir.path().join("model-0");
    fs::create_dir_all(&model0).unwrap();
    fs::write(
        c.config.clone(),
        fs::read_to_string(&c.config).unwrap().replacen(
            "[cluster]\n",
            &format!("[cluster]\nmodel = \"{}\"\n", model0.display()),
            1,
        ),
    )
    .unwrap();
    let (mut nodes, _) = spawn_with_ports(&c, &["--iterations", "2"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    // Started twice per node: on the initial model, then on iteration 1's hand-off; not
    // after the last iteration, whose server would only be stopped again.
    let log = |it: u32, r: u32| {
        fs::read_to_string(
            c.log_path
                .join(format!("logs/iter-{it:04}/rank-{r}.server.log")),
        )
        .unwrap_or_default()
    };
    for r in 0..2 {
        assert!(
            log(0, r).contains(&format!("model={}", model0.display())),
            "{}",
            log(0, r)
        );
        assert!(log(1, r).contains("models/iter-0001"), "{}", log(1, r));
        assert!(!log(2, r).contains("models/iter-0002"), "{}", log(2, r));
    }
    let models = c.log_path.join("models");
    assert_eq!(
        fs::read_to_string(models.join("LATEST")).unwrap().trim(),
        "iter-0002"
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(models.join("iter-0001/manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["files"][0]["path"], "w.bin");
    assert_eq!(
        fs::read_to_string(models.join("iter-0001/w.bin")).unwrap(),
        "weights 1\n"
    );
    // The servers were stopped when the nodes finished.
    wait_until(LIMIT, "the servers to stop", || {
        process_alive_with(&c.log_path.display().to_string()).is_empty()
    });
}

#[test]
fn a_server_that_never_becomes_healthy_fails_its_node_with_exit_1() {
    let c = TestCluster::new(
        2,
        "[server]\ncommand = \"exec sleep 59.1\"\nstart-timeout = \"2s\"\nstop-grace = \"1s\"\n",
    );
    let (mut nodes, _) = spawn_with_ports(&c, &["--iterations", "1"]);
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    // Both time out on their own server; the first to publish is the culprit, the other
    // may report it instead of its own (exit 3).
    assert!(codes.contains(&1), "{codes:?}");
    assert!(codes.iter().all(|c| *c == 1 || *c == 3), "{codes:?}");
    let culprit = codes.iter().position(|c| *c == 1).unwrap();
    let err = nodes[culprit].stderr();
    assert!(
        err.contains("did not answer http://127.0.0.1:") && err.contains("server.start-timeout"),
        "{err}"
    );
    wait_until(LIMIT, "the sleeping servers to be stopped", || {
        process_alive_with("sleep 59.1").is_empty()
    });
}

#[test]
fn a_taken_port_is_refused_and_the_others_stop() {
    let c = TestCluster::new(2, &server_toml("0"));
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = squatter.local_addr().unwrap().port();
    let mut master = c.spawn_env(
        0,
        &c.log_path,
        &[],
        &[("RL_NODE_SERVER_PORT", free_port().to_string())],
    );
    let mut worker = c.spawn_env(
        1,
        &c.log_path,
        &[],
        &[("RL_NODE_SERVER_PORT", taken.to_string())],
    );
    assert_eq!(worker.wait(LIMIT), 1, "{}", worker.stderr());
    assert!(
        worker
            .stderr()
            .contains(&format!("server port {taken} is already in use")),
        "{}",
        worker.stderr()
    );
    assert_eq!(master.wait(LIMIT), 3, "{}", master.stderr());
    assert!(master.stderr().contains("rank 1"), "{}", master.stderr());
    drop(squatter);
}

/// A server left over from an earlier run (run.sh's vLLM on 8999) holds the port: the
/// refusal names the port and the pid holding it, found through /proc, so the user knows
/// what to stop.
#[test]
fn a_port_held_by_a_leftover_server_is_refused_naming_its_pid() {
    use std::io::BufRead;
    let c = TestCluster::new(2, &server_toml("0"));
    let taken = free_port();
    let mut leftover = std::process::Command::new("python3")
        .arg("-c")
        .arg("import socket, sys, time\ns = socket.socket(socket.AF_INET6)\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('::', int(sys.argv[1])))\ns.listen()\nprint('listening', flush=True)\ntime.sleep(300)")
        .arg(taken.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(leftover.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening");
    let mut master = c.spawn_env(
        0,
        &c.log_path,
        &[],
        &[("RL_NODE_SERVER_PORT", free_port().to_string())],
    );
    let mut worker = c.spawn_env(
        1,
        &c.log_path,
        &[],
        &[("RL_NODE_SERVER_PORT", taken.to_string())],
    );
    let code = worker.wait(LIMIT);
    let _ = leftover.kill();
    let _ = leftover.wait();
    let err = worker.stderr();
    assert_eq!(code, 1, "{err}");
    let named = format!(
        "server port {taken} is already in use by pid {} (",
        leftover.id()
    );
    let at = err.find(&named).unwrap_or_else(|| panic!("{err}"));
    let line = err[at..].lines().next().unwrap();
    assert!(
        line.contains("python3 -c import socket, sys, time s = socket.socket"),
        "{line}"
    );
    assert_eq!(master.wait(LIMIT), 3, "{}", master.stderr());
}

#[test]
fn a_server_dying_mid_rollout_stops_the_cluster() {
    let c = TestCluster::new(
        2,
        &format!(
            "{}\n[phases.rollout]\ncommand = \"sleep 58.3\"\n",
            server_toml("0")
        ),
    );
    let (mut nodes, ports) = spawn_with_ports(&c, &[]);
    c.wait_phase(1, 1, "train-rollout", LIMIT);
    assert_eq!(get(ports[1], "/health").as_deref(), Some("ok"));
    let server_pid = process_alive_with(&format!("health_server.py {}", ports[1]))[0];
    let killed = Instant::now();
    let _ = common::kill(server_pid, libc::SIGKILL);
    let w = nodes[1].wait(LIMIT);
    let m = nodes[0].wait(LIMIT);
    assert_eq!(
        (m, w),
        (3, 1),
        "{}\n{}",
        nodes[0].stderr(),
        nodes[1].stderr()
    );
    assert!(killed.elapsed() < Duration::from_secs(10));
    assert!(
        nodes[1]
            .stderr()
            .contains("inference server exited unexpectedly with killed by signal 9"),
        "{}",
        nodes[1].stderr()
    );
    wait_until(LIMIT, "rollouts to be stopped", || {
        process_alive_with("sleep 58.3").is_empty()
    });
}

#[test]
fn training_failure_on_one_rank_stops_all_ranks_and_keeps_the_model() {
    let c = TestCluster::new(
        3,
        "[phases.train]\ncommand = \"if [ {rank} = 2 ]; then sleep 0.5; echo collective broken; exit 3; fi; sleep 57.7\"\n",
    );
    let started = Instant::now();
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    assert_eq!(codes, vec![3, 3, 1]);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        nodes[0].stderr().contains("rank 2") && nodes[0].stderr().contains("10 (training)"),
        "{}",
        nodes[0].stderr()
    );
    assert!(!c.log_path.join("models/LATEST").exists());
    wait_until(LIMIT, "training to be stopped on every rank", || {
        process_alive_with("sleep 57.7").is_empty()
    });
}

#[test]
fn a_crash_in_the_middle_of_the_handoff_leaves_a_valid_model_that_the_server_starts_on() {
    for point in [
        "handoff:mid-copy",
        "handoff:before-rename",
        "handoff:before-latest",
    ] {
        let c = TestCluster::new(
            1,
            &format!(
                "{}\n[phases.train]\ncommand = \"mkdir -p {{output}}/checkpoint-1 && for f in a b c; do echo {{iteration}}$f > {{output}}/checkpoint-1/$f; done\"\n",
                server_toml("0")
            ),
        );
        let port = free_port();
        // Iteration 1 publishes iter-0001; iteration 2 crashes while publishing iter-0002.
        let mut n = c.spawn_env(
            0,
            &c.log_path,
            &["--iterations", "1"],
            &[("RL_NODE_SERVER_PORT", port.to_string())],
        );
        assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
        // (Without resume a start begins at iteration 1, whose verified iter-0001 is reused.)
        let mut n = c.spawn_env(
            0,
            &c.log_path,
            &["--iterations", "2"],
            &[
                ("RL_NODE_SERVER_PORT", port.to_string()),
                ("RL_NODE_TEST_CRASH_AT", point.to_string()),
            ],
        );
        assert_eq!(n.wait(LIMIT), 134, "{point}: {}", n.stderr());
        // The guardian stops the crashed node's server.
        wait_until(LIMIT, "the crashed node's server to stop", || {
            get(port, "/health").is_none()
        });
        let models = c.log_path.join("models");
        let latest = fs::read_to_string(models.join("LATEST")).unwrap();
        let latest = models.join(latest.trim());
        rl_node::checkpoint::verify(&latest, &mut || {})
            .unwrap_or_else(|e| panic!("{point}: LATEST is not valid: {e}"));
        // Restart: the server starts on a verified model (the old or the new one).
        let mut n = c.spawn_env(
            0,
            &c.log_path,
            &["--iterations", "1"],
            &[("RL_NODE_SERVER_PORT", port.to_string())],
        );
        assert_eq!(n.wait(LIMIT), 0, "{point}: {}", n.stderr());
        let first_start =
            fs::read_to_string(c.log_path.join("logs/iter-0000/rank-0.server.log")).unwrap();
        let last = first_start
            .lines()
            .rfind(|l| l.starts_with("serving model="))
            .unwrap()
            .to_string();
        assert!(
            last.contains(&latest.display().to_string()),
            "{point}: {last} vs {}",
            latest.display()
        );
    }
}

#[test]
fn the_last_iteration_does_not_restart_the_server_only_to_stop_it() {
    let c = TestCluster::new(1, &format!("{}{TRAIN}", server_toml("0")));
    let (mut nodes, _) = spawn_with_ports(&c, &["--iterations", "2"]);
    assert_eq!(nodes[0].wait(LIMIT), 0, "{}", nodes[0].stderr());
    let err = nodes[0].stderr();
    // Started at the beginning and after iteration 1's hand-off; not after iteration 2's.
    assert_eq!(err.matches("server starting on").count(), 2, "{err}");
    assert!(
        err.contains("last iteration: the server is not restarted"),
        "{err}"
    );
}

/// `[server]` for tests/fixtures/flaky_server.py: its first `fails` starts on each rank
/// fail (rank 0: the server exits; rank 1: it answers 503 while holding the port and
/// leaves a grandchild in a session of its own).
fn flaky_toml(c: &TestCluster, fails: u32, attempts: u32, delay: &str) -> String {
    format!(
        r#"
[server]
command = "exec python3 {} {{server_port}} {} {{rank}} {fails}"
start-timeout = "8s"
stop-grace = "2s"
start-attempts = {attempts}
start-retry-delay = "{delay}"
"#,
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/flaky_server.py"
        ),
        c.dir.path().display(),
    )
}

fn flaky_cluster(num_nodes: u32, fails: u32, attempts: u32, delay: &str) -> TestCluster {
    let c = TestCluster::new(num_nodes, "");
    let text = fs::read_to_string(&c.config).unwrap();
    fs::write(
        &c.config,
        format!("{text}{}", flaky_toml(&c, fails, attempts, delay)),
    )
    .unwrap();
    c
}

/// How many times rank r's flaky server was started.
fn starts(c: &TestCluster, rank: u32) -> usize {
    fs::read_to_string(c.dir.path().join(format!("attempts-{rank}")))
        .unwrap_or_default()
        .lines()
        .count()
}

fn server_log(c: &TestCluster, rank: u32) -> String {
    fs::read_to_string(
        c.log_path
            .join(format!("logs/iter-0000/rank-{rank}.server.log")),
    )
    .unwrap_or_default()
}

fn failed_starts(c: &TestCluster, rank: u32) -> Vec<serde_json::Value> {
    c.events(rank)
        .into_iter()
        .filter(|e| e["event"] == "server-start-failed")
        .collect()
}

#[test]
fn a_server_start_that_fails_is_retried_and_the_run_completes() {
    let c = flaky_cluster(2, 1, 2, "200ms");
    let (mut nodes, ports) = spawn_with_ports(&c, &["--iterations", "1"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    // One failed start and one that served (the last iteration does not restart it).
    assert_eq!((starts(&c, 0), starts(&c, 1)), (2, 2));
    for (rank, why) in [
        (0, "the server exited with exit code 3 while starting".to_string()),
        (
            1,
            format!(
                "the server did not answer http://127.0.0.1:{}/health with 2xx within server.start-timeout (8s)",
                ports[1]
            ),
        ),
    ] {
        let err = nodes[rank].stderr();
        assert!(
            err.contains(&format!(
                "warning: server start attempt 1 of 2 failed: {why}; retrying in 200ms"
            )),
            "rank {rank}:\n{err}"
        );
    }
    for rank in 0..2 {
        // Every attempt is in the server log, each under a line naming it.
        let log = server_log(&c, rank);
        let a1 = log
            .find("start attempt 1 of 2\n")
            .unwrap_or_else(|| panic!("{log}"));
        let a2 = log
            .find("start attempt 2 of 2\n")
            .unwrap_or_else(|| panic!("{log}"));
        assert!(a1 < a2, "{log}");
        assert!(
            log[a1..a2].contains(&format!("rank {rank} attempt 1 ")),
            "{log}"
        );
        assert!(
            log[a2..].contains(&format!("rank {rank} attempt 2 ")),
            "{log}"
        );
        // rank 1's second attempt found its port free and the first attempt's
        // grandchild (in a session of its own) gone, or it would have exited 9.
        let failed = failed_starts(&c, rank);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert_eq!(
            (
                &failed[0]["attempt"],
                &failed[0]["attempts"],
                &failed[0]["retry"]
            ),
            (&1.into(), &2.into(), &true.into())
        );
        assert!(c
            .events(rank)
            .iter()
            .any(|e| e["event"] == "server-start" && e["attempt"] == 2));
    }
}

#[test]
fn with_one_start_attempt_the_same_server_fails_the_run() {
    let c = flaky_cluster(2, 1, 1, "200ms");
    let ports = [free_port(), free_port()];
    // Rank 0's server exits at once; rank 1's answers 503 for longer than the test waits
    // ([server] is per node), so rank 0 fails first.
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| {
            let mut env = vec![("RL_NODE_SERVER_PORT", ports[r as usize].to_string())];
            if r == 1 {
                env.push(("RL_NODE_SERVER_START_TIMEOUT", "10m".into()));
            }
            c.spawn_env(r, &c.log_path, &["--iterations", "1"], &env)
        })
        .collect();
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    assert_eq!(
        codes,
        vec![1, 3],
        "{}\n{}",
        nodes[0].stderr(),
        nodes[1].stderr()
    );
    let err = nodes[0].stderr();
    assert!(
        err.contains("the server exited with exit code 3 while starting; gave up after 1 attempt (server.start-attempts = 1)"),
        "{err}"
    );
    assert!(!err.contains("retrying"), "{err}");
    assert_eq!(starts(&c, 0), 1);
    wait_until(LIMIT, "rank 1's server and its grandchild to stop", || {
        process_alive_with(&c.dir.path().display().to_string()).is_empty()
            && process_alive_with(&format!("sleep 3600.1{}", ports[1])).is_empty()
    });
}

#[test]
fn a_server_that_fails_every_start_stops_after_exactly_start_attempts() {
    let c = flaky_cluster(1, 100, 3, "100ms");
    let (mut nodes, _) = spawn_with_ports(&c, &["--iterations", "1"]);
    assert_eq!(nodes[0].wait(LIMIT), 1, "{}", nodes[0].stderr());
    assert_eq!(starts(&c, 0), 3);
    let err = nodes[0].stderr();
    for attempt in 1..=2 {
        assert!(
            err.contains(&format!("server start attempt {attempt} of 3 failed: the server exited with exit code 3 while starting; retrying in 100ms")),
            "{err}"
        );
    }
    assert!(!err.contains("attempt 3 of 3 failed"), "{err}");
    assert!(
        err.contains("the server exited with exit code 3 while starting; gave up after 3 attempts (server.start-attempts = 3)"),
        "{err}"
    );
    let failed = failed_starts(&c, 0);
    let retries: Vec<_> = failed
        .iter()
        .map(|e| {
            (
                e["attempt"].as_u64().unwrap(),
                e["retry"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(retries, vec![(1, true), (2, true), (3, false)]);
    let log = server_log(&c, 0);
    for attempt in 1..=3 {
        assert_eq!(
            log.matches(&format!("start attempt {attempt} of 3\n"))
                .count(),
            1,
            "{log}"
        );
    }
}

#[test]
fn the_retry_delay_keeps_the_heartbeat_and_ends_on_a_peers_abort() {
    // Rank 1 fails its first start and then waits a retry delay of 10 minutes.
    let c = flaky_cluster(2, 1, 2, "10m");
    let ports = [free_port(), free_port()];
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| {
            let mut env = vec![("RL_NODE_SERVER_PORT", ports[r as usize].to_string())];
            if r == 0 {
                // Rank 0 never fails: [server] is per node.
                env.push(("RL_NODE_SERVER_START_RETRY_DELAY", "100ms".into()));
            }
            c.spawn_env(r, &c.log_path, &[], &env)
        })
        .collect();
    wait_until(LIMIT, "rank 1's first start to fail", || {
        !failed_starts(&c, 1).is_empty()
    });
    // Rank 1 heartbeats through the delay: its sequence advances over more than
    // dead-after (3s at 200ms beats) and rank 0 does not declare it dead.
    let seq = |c: &TestCluster| c.record(1).and_then(|r| r["seq"].as_u64()).unwrap_or(0);
    let from = seq(&c);
    wait_until(LIMIT, "rank 1's heartbeat to advance by 20 beats", || {
        seq(&c) >= from + 20
    });
    assert!(
        nodes[0].child.try_wait().unwrap().is_none(),
        "{}",
        nodes[0].stderr()
    );
    assert_eq!(starts(&c, 1), 1, "still in the delay");
    nodes[0].signal(libc::SIGTERM);
    assert_eq!(nodes[0].wait(LIMIT), 143, "{}", nodes[0].stderr());
    assert_eq!(nodes[1].wait(LIMIT), 3, "{}", nodes[1].stderr());
    assert_eq!(starts(&c, 1), 1, "no second start after the abort");
}

#[test]
fn zero_start_attempts_is_a_configuration_error() {
    let c = TestCluster::new(1, "[server]\nstart-attempts = 0\n");
    let mut n = c.spawn(0, &[]);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    assert!(
        n.stderr().contains("server.start-attempts"),
        "{}",
        n.stderr()
    );
    assert!(!c.log_path.join(".rl-node").exists(), "nothing written");
}
