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
    unsafe { libc::kill(server_pid, libc::SIGKILL) };
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
