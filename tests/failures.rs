//! Failure paths of a real cluster: a node killed with SIGKILL, a failing command, a
//! phase timeout, signals with children that ignore SIGTERM, and stale records left by
//! earlier generations. Every test starts real `rl-node` processes over a temporary
//! shared directory with fast timing (heartbeat 200 ms, dead-after 3 s, poll 100 ms,
//! kill-grace 1 s).

mod common;

use common::cluster::*;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Generous limit for anything that should happen within a few seconds.
const LIMIT: Duration = Duration::from_secs(30);

// ------------------------------------------------------------------ helpers

/// Wait for every node to exit; returns each node's exit code and the moment its exit
/// was observed (polled together, so a node's time is not delayed by waiting on another).
/// Wait for every node of a cluster; see `wait_exits`.
fn wait_all(nodes: &mut [NodeProc]) -> Vec<(i32, Instant)> {
    let mut all: Vec<&mut NodeProc> = nodes.iter_mut().collect();
    wait_exits(&mut all, LIMIT)
}

/// How long after `since` the last of `exits` happened.
fn last_exit_since(exits: &[(i32, Instant)], since: Instant) -> Duration {
    exits
        .iter()
        .map(|(_, at)| at.duration_since(since))
        .max()
        .unwrap()
}

fn wait_exits(nodes: &mut [&mut NodeProc], limit: Duration) -> Vec<(i32, Instant)> {
    let start = Instant::now();
    let mut seen: Vec<Option<Instant>> = vec![None; nodes.len()];
    while seen.iter().any(|s| s.is_none()) {
        for (i, n) in nodes.iter_mut().enumerate() {
            if seen[i].is_none() && n.child.try_wait().unwrap().is_some() {
                seen[i] = Some(Instant::now());
            }
        }
        if start.elapsed() > limit {
            let report: Vec<String> = nodes
                .iter()
                .zip(&seen)
                .map(|(n, s)| {
                    format!(
                        "rank {} {}; stderr:\n{}",
                        n.rank,
                        if s.is_some() {
                            "exited"
                        } else {
                            "STILL RUNNING"
                        },
                        n.stderr()
                    )
                })
                .collect();
            panic!(
                "nodes did not all exit within {limit:?}:\n{}",
                report.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    nodes
        .iter_mut()
        .zip(seen)
        // The status is cached by `Child`, so this returns at once.
        .map(|(n, s)| (n.wait(LIMIT), s.unwrap()))
        .collect()
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn current_gen(c: &TestCluster) -> u64 {
    read_json(&c.log_path.join(".rl-node/cluster.json"))["gen"]
        .as_u64()
        .expect("gen")
}

fn abort_record(c: &TestCluster) -> serde_json::Value {
    let gen = current_gen(c);
    read_json(&c.log_path.join(format!(".rl-node/gen-{gen}/abort.json")))
}

/// Wait until no live process has `needle` in its command line.
fn wait_no_process(needle: &str, limit: Duration) {
    let start = Instant::now();
    loop {
        let pids = process_alive_with(needle);
        if pids.is_empty() {
            return;
        }
        if start.elapsed() > limit {
            let cmds: Vec<String> = pids
                .iter()
                .map(|p| {
                    let c = fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                    format!("{p}: {}", String::from_utf8_lossy(&c).replace('\0', " "))
                })
                .collect();
            // Do not leave them behind for the next test run.
            for p in &pids {
                let _ = common::kill(*p, libc::SIGKILL);
            }
            panic!(
                "processes matching {needle:?} still alive after {limit:?}:\n{}",
                cmds.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_stderr(node: &NodeProc, needle: &str, limit: Duration) {
    let start = Instant::now();
    while !node.stderr().contains(needle) {
        if start.elapsed() > limit {
            panic!(
                "rank {}'s stderr did not show {needle:?} within {limit:?}:\n{}",
                node.rank,
                node.stderr()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Events of `rank` in generation `gen`.
fn gen_events(c: &TestCluster, rank: u32, gen: u64) -> Vec<serde_json::Value> {
    c.events(rank)
        .into_iter()
        .filter(|e| e["gen"].as_u64() == Some(gen))
        .collect()
}

/// The `t` (wall clock, same host, same format: compares as text) of the first event of
/// `rank` in `gen` matching `pred`.
fn event_time(
    c: &TestCluster,
    rank: u32,
    gen: u64,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> String {
    gen_events(c, rank, gen)
        .into_iter()
        .find(|e| pred(e))
        .and_then(|e| e["t"].as_str().map(str::to_string))
        .unwrap_or_else(|| {
            panic!(
                "rank {rank} has no event {what} in generation {gen}: {:?}",
                c.events(rank)
            )
        })
}

// ------------------------------------------------------------------ many ranks

/// Twelve nodes: rank 0 reads its eleven peers' records from two threads at once in each
/// poll round. Every record still reaches the rank it belongs to: iteration 1 passes all
/// its barriers, and when rank 9 is killed in iteration 2's rollout, rank 0 names rank 9
/// as the dead one (a mixed-up read would name another rank, or none).
#[test]
fn twelve_nodes_read_in_parallel_pass_their_barriers_and_name_a_killed_rank() {
    let c = TestCluster::new(
        12,
        "[phases.rollout]\ncommand = \"if [ {iteration} = 2 ]; then sleep 9{rank}1; fi; echo '{{}}' > {output}\"\n",
    );
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    let limit = Duration::from_secs(120);
    for r in 0..12 {
        c.wait_phase(r, 2, "train-rollout", limit);
    }
    wait_until(limit, "rank 9's sleep to run", || {
        !process_alive_with("sleep 991").is_empty()
    });
    nodes[9].signal(libc::SIGKILL);
    let mut rank0: Vec<&mut NodeProc> = nodes.iter_mut().filter(|n| n.rank == 0).collect();
    let exits = wait_exits(&mut rank0, limit);
    let err = rank0[0].stderr();
    assert_eq!(exits[0].0, 3, "{err}");
    assert!(
        err.contains("rank 9 on ") && err.contains("is dead"),
        "{err}"
    );
    let abort = abort_record(&c);
    assert_eq!(abort["culprit"], 9, "{abort}");
    for n in nodes.iter_mut().filter(|n| n.rank != 9) {
        n.wait(limit);
    }
}

/// Ten nodes gathering through group leaders (`barrier-groups-from = 4`: groups of three
/// workers, 1-3, 4-6 and 7-9, led by 1, 4 and 7). Iteration 1 passes every barrier with
/// rank 0 reading only the leaders, and its merged file holds every rank's record (what
/// each rank gathered reached rank 0 through its leader). In iteration 2 rank 5, a member
/// rank 0 never reads, is killed: its leader declares it dead, and rank 0 names it.
#[test]
fn ten_nodes_in_groups_pass_barriers_through_leaders_and_a_leader_names_a_killed_member() {
    let c = TestCluster::new(
        10,
        "[phases.rollout]\ncommand = \"if [ {iteration} = 2 ]; then sleep 8{rank}2; fi; echo '{{\\\"rank\\\": {rank}}}' > {output}\"\n",
    );
    let config = std::fs::read_to_string(&c.config).unwrap();
    std::fs::write(
        &c.config,
        config.replacen("[cluster]\n", "[cluster]\nbarrier-groups-from = 4\n", 1),
    )
    .unwrap();
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    let limit = Duration::from_secs(120);
    for r in 0..10 {
        c.wait_phase(r, 2, "train-rollout", limit);
    }
    let merged =
        std::fs::read_to_string(c.log_path.join("rollouts/iter-0001/train.jsonl")).unwrap();
    let mut ranks: Vec<u64> = merged
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["rank"]
                .as_u64()
                .unwrap()
        })
        .collect();
    ranks.sort();
    assert_eq!(ranks, (0..10).collect::<Vec<_>>(), "{merged}");
    // The leaders published their groups' arrivals; a member has none to publish.
    for r in [1, 4, 7] {
        let rec = c.record(r).unwrap();
        assert!(rec["group"]["k"].as_u64().unwrap() > 0, "rank {r}: {rec}");
    }
    assert!(c.record(5).unwrap().get("group").is_none());
    wait_until(limit, "rank 5's sleep to run", || {
        !process_alive_with("sleep 852").is_empty()
    });
    nodes[5].signal(libc::SIGKILL);
    let mut rank0: Vec<&mut NodeProc> = nodes.iter_mut().filter(|n| n.rank == 0).collect();
    let exits = wait_exits(&mut rank0, limit);
    let err = rank0[0].stderr();
    assert_eq!(exits[0].0, 3, "{err}");
    assert!(
        err.contains("rank 5 on ") && err.contains("is dead"),
        "{err}"
    );
    let abort = abort_record(&c);
    assert_eq!(
        (abort["culprit"].as_u64(), abort["detected_by"].as_u64()),
        (Some(5), Some(4)),
        "{abort}"
    );
    for n in nodes.iter_mut().filter(|n| n.rank != 5) {
        n.wait(limit);
    }
}

// ------------------------------------------------------------------ 1, 2: kill -9

/// Kill `victim` with SIGKILL while all 3 ranks run a long rollout; the survivors must stop
/// with exit 3 once the victim's heartbeat has been still for dead-after.
fn kill_nine_during_long_phase(victim: u32, tag: &str) {
    // `sleep <tag><rank>`: one distinctive command per rank and per test.
    let c = TestCluster::new(
        3,
        &format!("[phases.rollout]\ncommand = \"sleep {tag}{{rank}}\"\n"),
    );
    let mut nodes = c.spawn_all(&[]);
    for r in 0..3 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    // The victim's command is running and registered with its guardian.
    wait_stderr(
        &nodes[victim as usize],
        "iteration 1: rollout started",
        LIMIT,
    );
    wait_until(LIMIT, "the victim's sleep to run", || {
        !process_alive_with(&format!("sleep {tag}{victim}")).is_empty()
    });

    let killed_at = Instant::now();
    nodes[victim as usize].signal(libc::SIGKILL);

    let mut survivors: Vec<&mut NodeProc> = nodes.iter_mut().filter(|n| n.rank != victim).collect();
    let exits = wait_exits(&mut survivors, LIMIT);
    for (n, (code, at)) in survivors.iter().zip(&exits) {
        let secs = at.duration_since(killed_at).as_secs_f64();
        eprintln!(
            "rank {} exited {code} {secs:.3}s after the SIGKILL of rank {victim}",
            n.rank
        );
        let err = n.stderr();
        assert_eq!(
            *code, 3,
            "rank {} must exit 3 (peer died); stderr:\n{err}",
            n.rank
        );
        // dead-after 3 s + two poll intervals + slack for stopping children.
        assert!(
            secs < 3.0 + 0.2 + 5.0,
            "rank {} took {secs:.3}s to stop; stderr:\n{err}",
            n.rank
        );
        // Not before the heartbeat could have gone still for dead-after.
        assert!(
            secs > 2.0,
            "rank {} stopped after only {secs:.3}s: not heartbeat-based?\n{err}",
            n.rank
        );
        assert!(err.contains(&format!("error: rank {}: ", n.rank)), "{err}");
        assert!(
            err.contains(&format!("rank {victim} on ")),
            "stderr must name rank {victim}:\n{err}"
        );
        assert!(
            err.contains("is dead"),
            "stderr must say the rank is dead:\n{err}"
        );
        assert!(err.contains("its heartbeat has been still for"), "{err}");
        assert!(
            err.contains("(last seen in phase 1 (train-rollout) of iteration 1)"),
            "{err}"
        );
    }
    assert_eq!(nodes[victim as usize].wait(LIMIT), 128 + libc::SIGKILL);

    let abort = abort_record(&c);
    assert_eq!(abort["kind"], "peer-dead", "{abort}");
    assert_eq!(abort["culprit"], victim, "{abort}");

    // The survivors stopped their commands; the victim's guardian stopped its command.
    wait_no_process(&format!("sleep {tag}"), LIMIT);
}

#[test]
fn kill_nine_of_a_worker_stops_the_others_with_exit_3() {
    kill_nine_during_long_phase(2, "61.5");
}

#[test]
fn kill_nine_of_the_master_stops_the_workers_with_exit_3() {
    kill_nine_during_long_phase(0, "61.6");
}

// ------------------------------------------------------------------ 3: a failing command

#[test]
fn a_failing_command_on_one_worker_stops_everyone_promptly() {
    let c = TestCluster::new(
        3,
        "[phases.rollout]\ncommand = \"if [ {rank} = 1 ]; then echo boom-from-rank-1; exit 7; fi; sleep 62.5\"\n",
    );
    let started = Instant::now();
    let mut nodes = c.spawn_all(&[]);
    let exits = wait_all(&mut nodes);
    let total = last_exit_since(&exits, started);
    eprintln!(
        "all 3 ranks exited {:.3}s after start: {:?}",
        total.as_secs_f64(),
        exits.iter().map(|e| e.0).collect::<Vec<_>>()
    );

    let err: Vec<String> = nodes.iter().map(|n| n.stderr()).collect();
    assert_eq!(
        exits[1].0, 1,
        "rank 1's command failed: exit 1; stderr:\n{}",
        err[1]
    );
    assert_eq!(
        exits[0].0, 3,
        "rank 0 stops because of rank 1: exit 3; stderr:\n{}",
        err[0]
    );
    assert_eq!(
        exits[2].0, 3,
        "rank 2 stops because of rank 1: exit 3; stderr:\n{}",
        err[2]
    );
    // The abort relay, not heartbeat death (dead-after is 3 s), stopped ranks 0 and 2.
    assert!(total < Duration::from_secs(10), "took {total:?}");

    let e1 = &err[1];
    assert!(e1.contains("error: rank 1: rank 1 on "), "{e1}");
    assert!(
        e1.contains("failed in phase 1 (train-rollout) of iteration 1"),
        "{e1}"
    );
    assert!(
        e1.contains("the rollout command failed with exit code 7"),
        "{e1}"
    );
    assert!(
        e1.contains("log: ") && e1.contains("logs/iter-0001/rank-1.rollout.log"),
        "{e1}"
    );
    assert!(
        e1.contains("  | boom-from-rank-1"),
        "rank 1 must show its log tail:\n{e1}"
    );
    for r in [0, 2] {
        let e = &err[r];
        assert!(
            e.contains(&format!("error: rank {r}: rank 1 on ")),
            "rank {r} must name rank 1:\n{e}"
        );
        assert!(e.contains("exit code 7"), "{e}");
        assert!(e.contains("hint: the cause is on rank 1"), "{e}");
        assert!(
            !e.contains("is dead"),
            "rank {r} must learn of the failure by relay, not by heartbeat:\n{e}"
        );
    }
    let log = fs::read_to_string(c.log_path.join("logs/iter-0001/rank-1.rollout.log")).unwrap();
    assert!(log.contains("boom-from-rank-1"), "{log}");

    let abort = abort_record(&c);
    assert_eq!(abort["culprit"], 1, "{abort}");
    assert_eq!(abort["kind"], "command-failed", "{abort}");
    assert_eq!(abort["exit"], "exit code 7", "{abort}");
    wait_no_process("sleep 62.5", LIMIT);
}

// ------------------------------------------------------------------ 4: phase timeout

#[test]
fn a_phase_timeout_stops_the_cluster_with_exit_4() {
    let c = TestCluster::new(
        2,
        "[phases.train]\ncommand = \"sleep 63.3\"\ntimeout = \"1s\"\n",
    );
    let started = Instant::now();
    let mut nodes = c.spawn_all(&[]);
    let exits = wait_all(&mut nodes);
    let codes: Vec<i32> = exits.iter().map(|e| e.0).collect();
    let total = last_exit_since(&exits, started);
    eprintln!(
        "exit codes {codes:?}, {:.3}s after start",
        total.as_secs_f64()
    );
    for n in &nodes {
        let err = n.stderr();
        assert!(
            codes[n.rank as usize] == 4 || codes[n.rank as usize] == 3,
            "rank {} exited {}; stderr:\n{err}",
            n.rank,
            codes[n.rank as usize]
        );
        assert!(
            err.contains("did not finish within its timeout"),
            "rank {}:\n{err}",
            n.rank
        );
        assert!(
            err.contains("phases.train.timeout"),
            "rank {}:\n{err}",
            n.rank
        );
        assert!(
            err.contains("phase 10 (training)"),
            "rank {}:\n{err}",
            n.rank
        );
    }
    assert!(
        codes.contains(&4),
        "the rank whose timeout fired exits 4: {codes:?}"
    );
    let abort = abort_record(&c);
    assert_eq!(abort["kind"], "timeout", "{abort}");
    assert_eq!(
        codes[abort["culprit"].as_u64().unwrap() as usize],
        4,
        "the culprit exits 4: {abort}"
    );
    wait_no_process("sleep 63.3", LIMIT);
}

// ------------------------------------------------------------------ 5: signals

/// A rollout whose grandchild ignores SIGTERM (`needle` must be unique to the test).
/// Whether a process whose command line starts with `needle` runs (the command, not a
/// shell that names it).
fn sleep_started(needle: &str) -> bool {
    process_alive_with(needle).into_iter().any(|pid| {
        fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            String::from_utf8_lossy(&c)
                .replace('\0', " ")
                .starts_with(needle)
        })
    })
}

fn term_ignoring_rollout(needle: &str) -> String {
    format!("[phases.rollout]\ncommand = '''sh -c 'trap \"\" TERM; {needle}' & wait'''\n")
}

fn signal_stops_children_that_ignore_sigterm(sig: i32, expected: i32, needle: &str) {
    let c = TestCluster::new(1, &term_ignoring_rollout(needle));
    let mut node = c.spawn(0, &[]);
    c.wait_phase(0, 1, "train-rollout", LIMIT);
    // The command itself (`sleep …`), not a shell whose command line names it: only once
    // it runs has the shell set its trap, so it ignores SIGTERM.
    wait_until(LIMIT, needle, || sleep_started(needle));
    wait_stderr(&node, "iteration 1: rollout started", LIMIT);

    let sent = Instant::now();
    node.signal(sig);
    let code = node.wait(LIMIT);
    let secs = sent.elapsed().as_secs_f64();
    eprintln!("exit {code} {secs:.3}s after the signal");
    let err = node.stderr();
    assert_eq!(code, expected, "stderr:\n{err}");
    assert!(err.contains("interrupted by"), "{err}");
    // The grandchild ignores SIGTERM: only SIGKILL after kill-grace (1 s) ends it.
    assert!(
        secs > 0.8,
        "exited after {secs:.3}s, before kill-grace: {err}"
    );
    wait_no_process(needle, LIMIT);
    let rec = c.record(0).expect("record");
    assert_eq!(rec["state"], "failed", "{rec}");
}

#[test]
fn sigterm_stops_a_grandchild_that_ignores_sigterm_and_exits_143() {
    signal_stops_children_that_ignore_sigterm(libc::SIGTERM, 143, "sleep 77.7");
}

#[test]
fn sigint_stops_a_grandchild_that_ignores_sigterm_and_exits_130() {
    signal_stops_children_that_ignore_sigterm(libc::SIGINT, 130, "sleep 77.8");
}

#[test]
fn a_second_sigterm_kills_the_children_at_once() {
    let needle = "sleep 77.9";
    let c = TestCluster::new(1, &term_ignoring_rollout(needle));
    // The helper's spawn clears RL_NODE_*; start the master by hand with a long grace
    // (the environment overrides the config file's kill-grace of 1 s).
    let stderr_path = c.dir.path().join("rank-0-long-grace.stderr");
    let mut cmd = Command::new(BIN);
    cmd.arg("--master")
        .arg("--config")
        .arg(&c.config)
        .arg("--log-path")
        .arg(&c.log_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&stderr_path).unwrap());
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") || k == "RANK" || k == "NODE_RANK" || k == "SLURM_NODEID" {
            cmd.env_remove(k);
        }
    }
    cmd.env("RL_NODE_TIMING_KILL_GRACE", "30s");
    let mut child = KillOnDrop(cmd.spawn().unwrap());
    let stderr = || fs::read_to_string(&stderr_path).unwrap_or_default();
    let wait_stderr = |needle: &str| {
        wait_until(LIMIT, &format!("stderr to show {needle:?}"), || {
            stderr().contains(needle)
        })
    };
    c.wait_phase(0, 1, "train-rollout", LIMIT);
    // The command itself (`sleep …`), not a shell whose command line names it: only once
    // it runs has the shell set its trap, so it ignores SIGTERM.
    wait_until(LIMIT, needle, || sleep_started(needle));
    wait_stderr("iteration 1: rollout started");

    let pid = child.0.id() as i32;
    let _ = common::kill(pid, libc::SIGTERM);
    // The node is now in its 30 s grace period.
    wait_stderr("SIGKILL after 30s");
    assert!(
        !process_alive_with(needle).is_empty(),
        "the grandchild ignores SIGTERM"
    );
    let second = Instant::now();
    let _ = common::kill(pid, libc::SIGTERM);
    let status = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            second.elapsed() < LIMIT,
            "no exit after the second SIGTERM:\n{}",
            stderr()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let secs = second.elapsed().as_secs_f64();
    eprintln!("exit {status} {secs:.3}s after the second SIGTERM");
    let err = stderr();
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(
        err.contains("second SIGTERM: killing children now"),
        "{err}"
    );
    assert!(
        secs < 5.0,
        "the second SIGTERM must not wait for kill-grace (30s): {secs:.3}s\n{err}"
    );
    wait_no_process(needle, Duration::from_secs(5));
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ------------------------------------------------------------------ 6: generations

/// A rollout that writes one record to `{output}`; rank 0 is a little slower so the
/// lock-step check below has something to prove.
const WRITE_ROLLOUT: &str = r#"[phases.rollout]
command = "if [ {rank} = 0 ]; then sleep 0.3; fi; echo '{{\"rank\": {rank}, \"iteration\": {iteration}}}' > {output}"
"#;

/// Generation `gen` ran iterations 1..=last in lock-step on both ranks, to completion.
/// Generation `gen` ran iterations `first..=last` to completion (a resumed generation
/// starts past what earlier ones completed).
fn assert_generation_ran(c: &TestCluster, gen: u64, first: u64, last: u64) {
    for r in 0..2 {
        let rec = read_json(&c.log_path.join(format!(".rl-node/gen-{gen}/rank-{r}.json")));
        assert_eq!(rec["gen"], gen, "{rec}");
        assert_eq!(rec["state"], "done", "{rec}");
        assert_eq!(rec["iteration"], last, "{rec}");
        assert_eq!(rec["phase"], "final-sync", "{rec}");
        assert!(rec["abort"].is_null(), "{rec}");
        let ev = gen_events(c, r, gen);
        for it in first..=last {
            for name in [
                "sync-start",
                "rollout-complete",
                "files-ready",
                "final-sync",
            ] {
                assert!(
                    ev.iter().any(|e| e["event"] == "barrier"
                        && e["name"] == name
                        && e["iteration"] == it),
                    "rank {r} has no barrier {name} of iteration {it} in generation {gen}: {ev:?}"
                );
            }
            assert!(
                ev.iter()
                    .any(|e| e["event"] == "commit" && e["iteration"] == it),
                "rank {r} committed no shard in iteration {it} of generation {gen}: {ev:?}"
            );
        }
        // Barrier numbers of a generation start at 1 and grow by one.
        let ks: Vec<u64> = ev
            .iter()
            .filter(|e| e["event"] == "barrier")
            .map(|e| e["k"].as_u64().unwrap())
            .collect();
        assert_eq!(
            ks,
            (1..=ks.len() as u64).collect::<Vec<_>>(),
            "rank {r} gen {gen}"
        );
    }
    for it in first..=last {
        // Rank 1 cannot pass rollout-complete before rank 0 committed its (slower) shard.
        let r0_commit = event_time(c, 0, gen, "commit", |e| {
            e["event"] == "commit" && e["iteration"] == it
        });
        let r1_passed = event_time(c, 1, gen, "barrier rollout-complete", |e| {
            e["event"] == "barrier" && e["name"] == "rollout-complete" && e["iteration"] == it
        });
        assert!(
            r1_passed >= r0_commit,
            "gen {gen} iteration {it}: rank 1 passed rollout-complete at {r1_passed}, before rank 0 committed at {r0_commit}"
        );
        let merged = fs::read_to_string(
            c.log_path
                .join(format!("rollouts/iter-{it:04}/train.jsonl")),
        )
        .unwrap();
        for r in 0..2 {
            assert!(
                merged.contains(&format!("{{\"rank\": {r}, \"iteration\": {it}}}")),
                "iteration {it} trajectories lack rank {r}: {merged}"
            );
        }
    }
}

fn run_to_completion(c: &TestCluster, args: &[&str]) {
    let mut nodes = c.spawn_all(args);
    let exits = wait_all(&mut nodes);
    for (n, (code, _)) in nodes.iter().zip(exits) {
        assert_eq!(
            code,
            0,
            "rank {} must finish; stderr:\n{}",
            n.rank,
            n.stderr()
        );
    }
}

#[test]
fn a_restart_runs_a_new_generation_and_ignores_the_previous_ones_records() {
    let c = TestCluster::new(2, WRITE_ROLLOUT);
    run_to_completion(&c, &["--iterations", "1"]);
    assert_eq!(current_gen(&c), 1);
    assert_generation_ran(&c, 1, 1, 1);

    // The same run, extended: generation 2 resumes after iteration 1 and never redoes it.
    run_to_completion(&c, &["--iterations", "2"]);
    assert_eq!(current_gen(&c), 2);
    assert_generation_ran(&c, 2, 2, 2);
    for r in 0..2 {
        assert!(
            !gen_events(&c, r, 2)
                .iter()
                .any(|e| e["iteration"] == 1 && e["event"] != "generation"),
            "rank {r} redid iteration 1 in generation 2"
        );
    }
    let (_, text) = status(&c.log_path, false);
    assert!(
        text.contains("generation 1 of run") && text.contains("at iteration 1"),
        "{text}"
    );
    assert!(
        text.contains("at iteration 2; before it, generation 1 completed"),
        "{text}"
    );
    let cluster = read_json(&c.log_path.join(".rl-node/cluster.json"));
    assert!(
        cluster["previous"]
            .as_str()
            .is_some_and(|p| p.contains("generation 1 completed")),
        "{cluster}"
    );
    for r in 0..2 {
        assert_eq!(c.record(r).unwrap()["gen"], 2);
    }
}

/// A record of a process that is long gone, on a host that is not this one.
fn stale_record(run_id: &str, gen: u64, rank: u32, state: &str) -> serde_json::Value {
    let mark = serde_json::json!({"k": 999, "iteration": 50, "name": "final-sync"});
    serde_json::json!({
        "proto": 1,
        "run_id": run_id,
        "gen": gen,
        "rank": rank,
        "host": "stale-host.invalid",
        "pid": 4_000_000 + rank,
        "nonce": format!("stale{rank}"),
        "seq": 123_456,
        "state": state,
        "iteration": 50,
        "phase": "training",
        "arrived": mark,
        "released": mark,
        "waiting_for": [],
        "observed_ms": [],
        "abort": null,
        "wall": "2020-01-01T00:00:00.000+00:00"
    })
}

fn write_json(path: &Path, v: &serde_json::Value) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

#[test]
fn stale_records_of_other_runs_and_generations_do_not_confuse_a_fresh_cluster() {
    let c = TestCluster::new(2, WRITE_ROLLOUT);
    let state = c.log_path.join(".rl-node");
    // An earlier run, generation 7, that never stopped cleanly…
    write_json(
        &state.join("cluster.json"),
        &serde_json::json!({
            "proto": 2, "run_id": "0ldrun", "gen": 7, "num_nodes": 2, "rank_weights": [1, 1],
            "fingerprint": "0000000000000000", "config": {}, "master_addr": "stale-host.invalid",
            "master_port": 29500, "host": "stale-host.invalid", "pid": 4000000,
            "started_at": "2020-01-01T00:00:00.000+00:00", "previous": null
        }),
    );
    for r in 0..2 {
        write_json(
            &state.join(format!("gen-7/rank-{r}.json")),
            &stale_record("0ldrun", 7, r, "running"),
        );
        // …records already in the next generation's directory, claiming far-away barriers…
        write_json(
            &state.join(format!("gen-8/rank-{r}.json")),
            &stale_record("0ldrun", 8, r, "running"),
        );
        // …and a generation of yet another run.
        write_json(
            &state.join(format!("gen-1/rank-{r}.json")),
            &stale_record("0th3r", 1, r, "running"),
        );
    }

    // The worker comes first and meets only the stale generation 7…
    let mut worker = c.spawn(1, &["--iterations", "2"]);
    wait_stderr(
        &worker,
        "generation 7 is already running without this rank",
        LIMIT,
    );
    // …rank 0 refuses to mix a new cluster into that other run and writes nothing…
    let before = fs::read_dir(&state).unwrap().count();
    let mut refused = c.spawn(0, &["--iterations", "2"]);
    assert_eq!(refused.wait(LIMIT), 2, "{}", refused.stderr());
    assert!(
        refused.stderr().contains("holds run 0ldrun") && refused.stderr().contains("--fresh"),
        "{}",
        refused.stderr()
    );
    assert_eq!(fs::read_dir(&state).unwrap().count(), before);
    // …and with --fresh sets it aside (nothing deleted) and starts a new run; the waiting
    // worker joins it.
    let mut master = c.spawn(0, &["--iterations", "2", "--fresh"]);
    let exits = wait_exits(&mut [&mut master, &mut worker], LIMIT);
    assert_eq!(exits[0].0, 0, "rank 0:\n{}", master.stderr());
    assert_eq!(exits[1].0, 0, "rank 1:\n{}", worker.stderr());
    let cluster = read_json(&state.join("cluster.json"));
    assert_eq!(cluster["gen"], 1, "{cluster}");
    assert!(c
        .log_path
        .join("previous-runs/0ldrun/.rl-node/gen-7/rank-0.json")
        .exists());
    assert!(c
        .log_path
        .join("previous-runs/0ldrun/.rl-node/gen-8/rank-1.json")
        .exists());
    assert!(
        cluster["previous"]
            .as_str()
            .is_some_and(|p| p.contains("generation 7 ended without a clean stop")),
        "{cluster}"
    );
    assert_ne!(cluster["run_id"], "0ldrun", "{cluster}");
    for r in 0..2 {
        let rec = c.record(r).unwrap();
        assert_eq!(rec["run_id"], cluster["run_id"], "{rec}");
        assert_ne!(rec["nonce"], format!("stale{r}"), "{rec}");
    }
    assert_generation_ran(&c, 1, 1, 2);
}

/// `cluster.json` is the only record of which generations exist. When it is gone (deleted
/// to "reset" a run, unreadable, or from another protocol version) rank 0 starts at
/// generation 1 again, in a directory an earlier run may have left an `abort.json` in.
/// That stale first-writer-wins record must not be taken for the cause of a new failure.
#[test]
fn a_stale_abort_record_left_in_a_generation_directory_is_not_adopted() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"if [ {rank} = 1 ]; then echo boom-from-rank-1; exit 7; fi; sleep 64.4\"\n",
    );
    let state = c.log_path.join(".rl-node");
    for r in 0..2 {
        write_json(
            &state.join(format!("gen-1/rank-{r}.json")),
            &stale_record("0ldrun", 1, r, "failed"),
        );
    }
    write_json(
        &state.join("gen-1/abort.json"),
        &serde_json::json!({
            "kind": "command-failed", "exit": "exit code 9", "culprit": 5,
            "culprit_host": "stale-host.invalid", "phase": "10 (training)", "iteration": 40,
            "reason": "the train command failed with exit code 9", "log": null,
            "detected_by": 5, "silent_ms": null, "at": "2020-01-01T00:00:00.000+00:00"
        }),
    );

    let mut nodes = c.spawn_all(&[]);
    let exits = wait_all(&mut nodes);
    let err: Vec<String> = nodes.iter().map(|n| n.stderr()).collect();
    for (r, e) in err.iter().enumerate() {
        assert!(
            !e.contains("rank 5") && !e.contains("stale-host.invalid"),
            "rank {r} reports the earlier run's failure as the cause:\n{e}"
        );
        assert!(
            e.contains("the rollout command failed with exit code 7"),
            "rank {r}:\n{e}"
        );
    }
    assert_eq!(
        exits[1].0, 1,
        "rank 1's own command failed: exit 1\n{}",
        err[1]
    );
    assert_eq!(exits[0].0, 3, "{}", err[0]);
    assert!(err[1].contains("  | boom-from-rank-1"), "{}", err[1]);
    let abort = abort_record(&c);
    assert_eq!(abort["culprit"], 1, "{abort}");
    wait_no_process("sleep 64.4", LIMIT);
}

// ------------------------------------------------------------------ a signal to one node

#[test]
fn sigterm_to_one_worker_stops_the_cluster() {
    let c = TestCluster::new(3, "[phases.rollout]\ncommand = \"sleep 65.5\"\n");
    let mut nodes = c.spawn_all(&[]);
    for r in 0..3 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    wait_stderr(&nodes[1], "iteration 1: rollout started", LIMIT);
    let sent = Instant::now();
    nodes[1].signal(libc::SIGTERM);
    let exits = wait_all(&mut nodes);
    let latest = last_exit_since(&exits, sent);
    eprintln!(
        "exit codes {:?}, all {:.3}s after the SIGTERM",
        exits.iter().map(|e| e.0).collect::<Vec<_>>(),
        latest.as_secs_f64()
    );
    let err: Vec<String> = nodes.iter().map(|n| n.stderr()).collect();
    assert_eq!(exits[1].0, 143, "{}", err[1]);
    for r in [0, 2] {
        assert_eq!(exits[r].0, 3, "rank {r}:\n{}", err[r]);
        assert!(
            err[r].contains("rank 1 on ") && err[r].contains("interrupted by SIGTERM"),
            "rank {r}:\n{}",
            err[r]
        );
    }
    // The relay, not heartbeat death (dead-after 3 s).
    assert!(latest < Duration::from_millis(2500), "{latest:?}");
    let abort = abort_record(&c);
    assert_eq!(abort["culprit"], 1, "{abort}");
    assert_eq!(abort["kind"], "signal", "{abort}");
    wait_no_process("sleep 65.5", LIMIT);
}
