//! Hang forensics (docs/forensics.md) with real processes: a phase command that hangs, a
//! barrier that overruns, a peer frozen with SIGSTOP, and Python children asked about
//! through a `py-spy` placed first on the node's PATH (one that answers, one that hangs
//! and must be cut off). Each node writes `logs/iter-NNNN/rank-R.hang-K.txt` at
//! `timing.hang-report-at` of the timeout (here set through the environment), and the run
//! ends as it would have without the report.

mod common;

use common::cluster::*;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

/// Generous limit for anything that should happen within a few seconds.
const LIMIT: Duration = Duration::from_secs(30);

fn report_path(c: &TestCluster, iteration: u64, rank: u32, k: u32) -> PathBuf {
    c.log_path
        .join(format!("logs/iter-{iteration:04}/rank-{rank}.hang-{k}.txt"))
}

/// The report once it exists (written whole: it appears by an atomic link).
fn wait_report(c: &TestCluster, iteration: u64, rank: u32, k: u32) -> String {
    let path = report_path(c, iteration, rank, k);
    wait_until(LIMIT, &format!("{}", path.display()), || path.exists());
    fs::read_to_string(&path).unwrap()
}

/// The lines of the report's section about the process whose command line is `cmdline`:
/// its pid and the lines up to the next process.
fn process_section<'a>(report: &'a str, cmdline: &str) -> Option<(i32, Vec<&'a str>)> {
    let mut lines = report.lines();
    while let Some(l) = lines.next() {
        let Some(rest) = l.strip_prefix("### pid ") else {
            continue;
        };
        if rest.split_once("): ").map(|(_, c)| c) != Some(cmdline) {
            continue;
        }
        let pid = rest.split(' ').next().unwrap().parse().unwrap();
        let body = lines
            .by_ref()
            .take_while(|l| !l.starts_with("### ") && !l.starts_with("## "))
            .collect();
        return Some((pid, body));
    }
    None
}

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .any(|d| d.join(program).is_file())
}

#[test]
fn a_hanging_phase_command_gets_a_report_and_still_fails_at_its_timeout() {
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"sleep 1000; true\"\ntimeout = \"3s\"\n",
    );
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &env(&[("RL_NODE_TIMING_HANG_REPORT_AT", "0.3")]),
    );
    let report = wait_report(&c, 1, 0, 1);
    // Written at 0.9 s of the 3 s timeout: the command is still running then.
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_eq!(code, 4, "a phase timeout still exits 4:\n{err}");
    assert!(err.contains("did not finish within its timeout"), "{err}");

    assert!(report.starts_with("# rl-node hang report\n"), "{report}");
    assert!(
        report.contains("why: the rollout command (pid ")
            && report.contains("of its timeout of 3s (phases.rollout.timeout)"),
        "{report}"
    );
    for field in [
        "time: ",
        "host: ",
        "rank: 0\n",
        "generation: 1\n",
        "iteration: 1\n",
    ] {
        assert!(report.contains(field), "no {field:?} in:\n{report}");
    }
    let (pid, sleep) = process_section(&report, "sleep 1000")
        .unwrap_or_else(|| panic!("no section for sleep 1000:\n{report}"));
    assert!(pid > 0);
    assert!(sleep.contains(&"state: S (sleeping)"), "{sleep:?}");
    assert!(sleep.iter().any(|l| l.starts_with("wchan: ")), "{sleep:?}");
    assert!(sleep.contains(&"threads: 1"), "{sleep:?}");
    assert!(
        sleep.iter().any(|l| l.starts_with("kernel stack")),
        "{sleep:?}"
    );
    // Its parent, the command's shell, is in the report too.
    assert!(
        report.lines().any(|l| l.starts_with("### pid ")
            && l.ends_with("sh -c sleep 1000; true")
            && !l.contains(&format!("pid {pid} "))),
        "{report}"
    );
    assert!(
        report.contains("## py-spy\n(no Python process)\n"),
        "{report}"
    );
    assert!(report.contains("## nvidia-smi\n"), "{report}");
    if !on_path("nvidia-smi") {
        assert!(
            report.contains("nvidia-smi: not installed (not on PATH)"),
            "{report}"
        );
    }
    // One report for the one overrun, and the event and the log line that point to it.
    assert!(!report_path(&c, 1, 0, 2).exists());
    let events = c.events(0);
    let hang: Vec<_> = events
        .iter()
        .filter(|e| e["event"] == "hang-report")
        .collect();
    assert_eq!(hang.len(), 1, "{events:?}");
    assert_eq!(hang[0]["path"], "logs/iter-0001/rank-0.hang-1.txt");
    assert!(
        hang[0]["why"]
            .as_str()
            .unwrap()
            .contains("phases.rollout.timeout"),
        "{hang:?}"
    );
    assert!(
        err.contains("hang report logs/iter-0001/rank-0.hang-1.txt"),
        "{err}"
    );
    // The timeline marks the report on rank 0's lane and names its file.
    let page = c.dir.path().join("timeline.html");
    let out = std::process::Command::new(BIN)
        .args(["timeline", "--log-path"])
        .arg(&c.log_path)
        .arg("--out")
        .arg(&page)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(&page).unwrap();
    let marks: Vec<&str> = html
        .match_indices(r#"<g class="mark hang-report""#)
        .map(|(i, _)| &html[i..i + 600.min(html.len() - i)])
        .collect();
    assert_eq!(marks.len(), 1, "{html}");
    assert!(
        marks[0].contains("hang report logs/iter-0001/rank-0.hang-1.txt"),
        "{}",
        marks[0]
    );
}

#[test]
fn a_barrier_wait_past_its_fraction_gets_a_report_naming_the_barrier() {
    // Rank 1's rollout takes 6 s; rank 0 waits for it at rollout-complete, past 0.1 of
    // the 20 s barrier-timeout, and the run still succeeds.
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"if [ {rank} = 1 ]; then sleep 6; fi; echo '{\\\"rank\\\": {rank}}' > {output}\"\n",
    );
    let vars = env(&[
        ("RL_NODE_TIMING_HANG_REPORT_AT", "0.1"),
        ("RL_NODE_TIMING_BARRIER_TIMEOUT", "20s"),
        // 0.1 of dead-after is when a silent heartbeat earns a report of its own; at
        // 10 s that is 5 heartbeats, so a heartbeat late under load cannot take the
        // report this test is about (the barrier's comes at 0.1 of 20 s).
        ("RL_NODE_TIMING_DEAD_AFTER", "10s"),
    ]);
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| c.spawn_env(r, &c.log_path, &["--iterations", "1"], &vars))
        .collect();
    for n in &mut nodes {
        let code = n.wait(LIMIT);
        assert_eq!(code, 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let report = fs::read_to_string(report_path(&c, 1, 0, 1))
        .unwrap_or_else(|e| panic!("no report of rank 0 ({e}):\n{}", nodes[0].stderr()));
    assert!(
        report.contains("why: barrier rollout-complete (iteration 1) waits for rank 1: ")
            && report.contains("of its timeout of 20s (timing.barrier-timeout)"),
        "{report}"
    );
    assert!(report.contains("phase: 2 (rollout-complete)\n"), "{report}");
    // Rank 0's call reached rank 1, whose report shows what its rollout was doing.
    let slow = fs::read_to_string(report_path(&c, 1, 1, 1))
        .unwrap_or_else(|e| panic!("no report of rank 1 ({e}):\n{}", nodes[1].stderr()));
    assert!(
        slow.contains(
            "why: rank 0 called for hang reports: barrier rollout-complete (iteration 1) waits for rank 1: "
        ),
        "{slow}"
    );
    assert!(slow.contains("phase: 1 (train-rollout)\n"), "{slow}");
    assert!(process_section(&slow, "sleep 6").is_some(), "{slow}");
    // One report each: a call is answered once.
    assert!(!report_path(&c, 1, 0, 2).exists() && !report_path(&c, 1, 1, 2).exists());
    assert!(c
        .events(0)
        .iter()
        .any(|e| e["event"] == "hang-report" && e["path"] == "logs/iter-0001/rank-0.hang-1.txt"));
}

/// A worker's call reaches the other workers through rank 0: rank 1 waits for the release
/// of rollout-complete past its fraction while rank 2's rollout is still running; rank 0
/// answers rank 1's call and relays it, and rank 2's report shows its slow rollout.
#[test]
fn a_workers_call_is_answered_by_rank_0_and_relayed_to_the_other_workers() {
    let c = TestCluster::new(
        3,
        "[phases.rollout]\ncommand = \"case {rank} in 0) sleep 1;; 2) sleep 8;; esac; echo '{\\\"rank\\\": {rank}}' > {output}\"\n",
    );
    let vars = env(&[
        ("RL_NODE_TIMING_HANG_REPORT_AT", "0.1"),
        ("RL_NODE_TIMING_BARRIER_TIMEOUT", "20s"),
        // 0.1 of dead-after is when a silent heartbeat earns a report of its own; at
        // 10 s that is 5 heartbeats, so a heartbeat late under load cannot take the
        // report this test is about (the barrier's comes at 0.1 of 20 s).
        ("RL_NODE_TIMING_DEAD_AFTER", "10s"),
    ]);
    let mut nodes: Vec<NodeProc> = (0..3)
        .map(|r| c.spawn_env(r, &c.log_path, &["--iterations", "1"], &vars))
        .collect();
    for n in &mut nodes {
        let code = n.wait(LIMIT);
        assert_eq!(code, 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let read = |rank: u32, k: u32| {
        fs::read_to_string(report_path(&c, 1, rank, k))
            .unwrap_or_else(|e| panic!("no report {k} of rank {rank}: {e}"))
    };
    let first = read(1, 1);
    assert!(
        first.contains("why: barrier rollout-complete (iteration 1): ")
            && first.contains(
                "(timing.barrier-timeout); waiting for rank 0 to release barrier rollout-complete (iteration 1)\n"
            ),
        "{first}"
    );
    let answer = read(0, 1);
    assert!(
        answer.contains("why: rank 1 called for hang reports: barrier rollout-complete"),
        "{answer}"
    );
    let relayed = read(2, 1);
    assert!(
        relayed.contains("why: rank 1 called for hang reports: barrier rollout-complete"),
        "{relayed}"
    );
    assert!(process_section(&relayed, "sleep 8").is_some(), "{relayed}");
    // Rank 1 answers no call of its own stall.
    assert!(!report_path(&c, 1, 1, 2).exists(), "{}", read(1, 2));
}

#[test]
fn a_peer_frozen_by_sigstop_is_named_in_the_survivors_reports_and_status_points_to_them() {
    let c = TestCluster::new(3, "[phases.rollout]\ncommand = \"sleep 1000; true\"\n");
    // dead-after 6 s: a report at 1.5 s of silence, with time to answer its call.
    let vars = env(&[
        ("RL_NODE_TIMING_HANG_REPORT_AT", "0.25"),
        ("RL_NODE_TIMING_DEAD_AFTER", "6s"),
    ]);
    let mut nodes: Vec<NodeProc> = (0..3)
        .map(|r| c.spawn_env(r, &c.log_path, &["--iterations", "1"], &vars))
        .collect();
    for r in 0..3 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    let frozen = nodes[1].node_process();
    let _ = common::kill(frozen, libc::SIGSTOP);
    wait_until(LIMIT, "rank 1's node process to be stopped", || {
        stopped(frozen)
    });
    // Rank 0 watches rank 1 and finds it silent.
    let report = wait_report(&c, 1, 0, 1);
    assert!(
        report.contains("why: rank 1 on ")
            && report.contains(" is silent: its heartbeat has been still for ")
            && report.contains("(dead at dead-after = 6s)"),
        "{report}"
    );
    // The survivor's own command, as it was while it waited.
    assert!(process_section(&report, "sleep 1000").is_some(), "{report}");
    // Rank 2 watches only rank 0, and reports on rank 0's call.
    let other = wait_report(&c, 1, 2, 1);
    assert!(
        other.contains("why: rank 0 called for hang reports: rank 1 on ")
            && other.contains(" is silent: "),
        "{other}"
    );
    assert!(process_section(&other, "sleep 1000").is_some(), "{other}");
    // Then rank 1 is declared dead as before.
    for n in [0, 2] {
        let code = nodes[n].wait(LIMIT);
        assert_eq!(code, 3, "rank {n}:\n{}", nodes[n].stderr());
    }
    assert!(
        nodes[0].stderr().contains("is dead"),
        "{}",
        nodes[0].stderr()
    );
    assert!(!report_path(&c, 1, 1, 1).exists(), "rank 1 was frozen");
    let (_, text) = status(&c.log_path, false);
    for r in [0, 2] {
        assert!(
            text.contains(&format!(
                "rank {r}: hang report logs/iter-0001/rank-{r}.hang-1.txt"
            )),
            "{text}"
        );
    }
    let (_, json) = status(&c.log_path, true);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["ranks"][0]["hang_report"], "logs/iter-0001/rank-0.hang-1.txt",
        "{json}"
    );
    let _ = common::kill(frozen, libc::SIGCONT);
    let code = nodes[1].wait(LIMIT);
    assert_ne!(code, 0, "{}", nodes[1].stderr());
}

/// A stand-in for py-spy: answers for a Python process whose command line says `answer`
/// and hangs (as a py-spy stuck on a process might) for one that says `hang`.
const FAKE_PY_SPY: &str = r#"#!/bin/sh
# py-spy dump --pid PID
pid=$3
if tr '\0' ' ' < /proc/$pid/cmdline | grep -q hang; then exec sleep 999.25; fi
echo "FAKE-PY-SPY-DUMP pid=$pid args=$*"
echo "Thread 1 (idle): MainThread"
"#;

#[test]
fn py_spy_on_path_is_asked_about_python_children_and_cut_off_when_it_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    fs::create_dir_all(&bin).unwrap();
    let fake = bin.join("py-spy");
    fs::write(&fake, FAKE_PY_SPY).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let sleeper = "import sys, time; time.sleep(1000)";
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"python3 -c '{sleeper}' answer & python3 -c '{sleeper}' hang & wait\"\ntimeout = \"10s\"\n"
        ),
    );
    let path = std::env::join_paths(std::iter::once(bin.clone()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    // A report at 2 s; the hanging py-spy is cut off 5 s later, before the 10 s timeout.
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &env(&[
            ("RL_NODE_TIMING_HANG_REPORT_AT", "0.2"),
            ("PATH", path.to_str().unwrap()),
        ]),
    );
    let report = wait_report(&c, 1, 0, 1);
    // The stuck py-spy was killed (its process group), not left behind until the node
    // stops: the report is written after the cut-off, while the node still runs.
    assert!(
        process_alive_with("sleep 999.25").is_empty(),
        "a stuck py-spy still runs"
    );
    let code = node.wait(LIMIT);
    assert_eq!(code, 4, "{}", node.stderr());
    let python = |tag: &str| {
        report
            .lines()
            .filter_map(|l| l.strip_prefix("### pid "))
            .find(|l| l.contains("python") && l.ends_with(&format!("time.sleep(1000) {tag}")))
            .and_then(|l| l.split(' ').next()?.parse::<i32>().ok())
            .unwrap_or_else(|| panic!("no python process `{tag}` in:\n{report}"))
    };
    let (answer, hang) = (python("answer"), python("hang"));
    assert!(
        report.contains(&format!(
            "$ py-spy dump --pid {answer}\nFAKE-PY-SPY-DUMP pid={answer} args=dump --pid {answer}\nThread 1 (idle): MainThread\n"
        )),
        "{report}"
    );
    assert!(
        report.contains(&format!(
            "$ py-spy dump --pid {hang}\n(py-spy dump --pid {hang}: no answer within its time limit of 5s; killed)\n"
        )),
        "{report}"
    );
}

/// A stand-in for a tool that never answers (a py-spy stuck on a process, an nvidia-smi
/// stuck on a driver): it says it started, starts a child of its own that hangs too, and
/// hangs. The leader sleeps `996.<ID>N1` and the child `996.<ID>N2` (ID: the test's pid,
/// N: 1 for py-spy, 2 for nvidia-smi), so the test can look for what is left of either.
const FAKE_HANGING_TOOL: &str = r#"#!/bin/sh
tool=$(basename "$0")
case $tool in py-spy) n=1;; *) n=2;; esac
echo "FAKE-$tool started"
sleep 996.<ID>${n}2 &
exec sleep 996.<ID>${n}1
"#;

/// A bin directory with the hanging tool as `py-spy` and `nvidia-smi`, and `sleep` as
/// `python-standin` (a process py-spy is asked about, which starts at once), and PATH with
/// it first.
/// A node's environment for a hang report of the tools [`hanging_tools`] put on `path`:
/// reports early, and no question to nvidia-smi at start.
fn with_hanging_tools(path: &str) -> Vec<(&'static str, String)> {
    env(&[
        ("RL_NODE_TIMING_HANG_REPORT_AT", "0.05"),
        ("PATH", path),
        // Not "auto": the node would ask the hanging nvidia-smi at start.
        ("RL_NODE_CLUSTER_GPUS_PER_NODE", "1"),
    ])
}

fn hanging_tools(dir: &std::path::Path) -> String {
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).unwrap();
    use std::os::unix::fs::PermissionsExt;
    for tool in ["py-spy", "nvidia-smi"] {
        let fake = bin.join(tool);
        let script = FAKE_HANGING_TOOL.replace("<ID>", &std::process::id().to_string());
        fs::write(&fake, script).unwrap();
        fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let sleep = std::process::Command::new("sh")
        .args(["-c", "command -v sleep"])
        .output()
        .unwrap();
    let sleep = String::from_utf8(sleep.stdout).unwrap();
    std::os::unix::fs::symlink(sleep.trim(), bin.join("python-standin")).unwrap();
    std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap()
    .into_string()
    .unwrap()
}

/// Processes of this test's hanging tools still alive, by what they are (`py-spy` or
/// `nvidia-smi`, `leader` or `child`).
fn tools_left() -> Vec<(i32, &'static str)> {
    [
        ("11", "py-spy leader"),
        ("12", "py-spy child"),
        ("21", "nvidia-smi leader"),
        ("22", "nvidia-smi child"),
    ]
    .into_iter()
    .flat_map(|(n, what)| {
        process_alive_with(&format!("sleep 996.{}{n}", std::process::id()))
            .into_iter()
            .map(move |p| (p, what))
    })
    .collect()
}

/// Whether the two processes of `tool` (its leader and its child) run.
fn tool_runs(tool: &str) -> bool {
    let left = tools_left();
    ["leader", "child"]
        .iter()
        .all(|w| left.iter().any(|(_, t)| *t == format!("{tool} {w}")))
}

/// A node that stops while its report's tools hang kills them (their whole process
/// groups), starts none after, and writes the report with what it had, naming the tool
/// that was killed: the node's stop does not wait for a tool's time limit, and no tool
/// outlives the node.
#[test]
fn a_node_that_stops_while_its_report_tools_hang_kills_them_and_writes_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let path = hanging_tools(dir.path());
    let go = dir.path().join("go");
    // The rollout fails once the test says so: after py-spy was started for the report.
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"python-standin 1000.5 & while [ ! -e {} ]; do sleep 0.05; done; exit 1\"\ntimeout = \"20s\"\n",
            go.display()
        ),
    );
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &with_hanging_tools(&path),
    );
    wait_until(LIMIT, "py-spy to run for the hang report", || {
        tool_runs("py-spy")
    });
    fs::write(&go, "").unwrap();
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_ne!(code, 0, "{err}");
    // Nothing of either tool outlives the node.
    let left = tools_left();
    assert!(left.is_empty(), "left behind: {left:?}\n{err}");
    let path = report_path(&c, 1, 0, 1);
    let report = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("no report {} ({e}):\n{err}", path.display()));
    let pid = report
        .lines()
        .filter_map(|l| l.strip_prefix("### pid "))
        .find(|l| l.ends_with("python-standin 1000.5"))
        .and_then(|l| l.split(' ').next()?.parse::<i32>().ok())
        .unwrap_or_else(|| panic!("no python process in:\n{report}"));
    assert!(
        report.contains(&format!(
            "$ py-spy dump --pid {pid}\nFAKE-py-spy started\n(py-spy dump --pid {pid}: no answer before the node stopped; killed)\n"
        )),
        "{report}"
    );
    assert!(
        report
            .contains("## nvidia-smi\n$ nvidia-smi\n(nvidia-smi: not run: the node is stopping)\n"),
        "{report}"
    );
    assert!(
        err.contains("hang report logs/iter-0001/rank-0.hang-1.txt"),
        "{err}"
    );
    // The tools are stopped as tools, not found later as leftovers of a command.
    assert!(!err.contains("left their command's process group"), "{err}");
}

/// A node killed with SIGKILL while its report's tool hangs: its guardian kills the
/// tool's process group, child included, as it kills the node's commands.
#[test]
fn a_node_killed_while_its_report_tool_hangs_leaves_no_tool_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = hanging_tools(dir.path());
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"sleep 1000; true\"\ntimeout = \"20s\"\n",
    );
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &with_hanging_tools(&path),
    );
    // No Python process: nvidia-smi is the tool that runs.
    wait_until(LIMIT, "nvidia-smi to run for the hang report", || {
        tool_runs("nvidia-smi")
    });
    let inner = node.node_process();
    let _ = common::kill(inner, libc::SIGKILL);
    let code = node.wait(LIMIT);
    assert_eq!(code, 128 + libc::SIGKILL, "{}", node.stderr());
    wait_until(LIMIT, "the hanging tool to be killed", || {
        tools_left().is_empty()
    });
}

#[test]
fn hang_report_at_off_writes_no_report_and_a_bad_value_is_refused_naming_the_key() {
    let c = TestCluster::new(
        1,
        "[phases.rollout]\ncommand = \"sleep 1000; true\"\ntimeout = \"2s\"\n",
    );
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &env(&[("RL_NODE_TIMING_HANG_REPORT_AT", "off")]),
    );
    assert_eq!(node.wait(LIMIT), 4, "{}", node.stderr());
    assert!(!report_path(&c, 1, 0, 1).exists());
    assert!(!c.events(0).iter().any(|e| e["event"] == "hang-report"));

    let mut bad = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &env(&[("RL_NODE_TIMING_HANG_REPORT_AT", "1.5")]),
    );
    assert_eq!(bad.wait(LIMIT), 2);
    let err = bad.stderr();
    assert!(
        err.contains("timing.hang-report-at") && err.contains("RL_NODE_TIMING_HANG_REPORT_AT"),
        "{err}"
    );
}

// ------------------------------------------------------------------ hung filesystems

/// Every thread of `pid` is gone (or a zombie).
fn gone(pid: i32) -> bool {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|t| {
        fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')')?.1.trim_start().chars().next())
            .is_none_or(|c| c == 'Z' || c == 'X')
    })
}

/// A command blocked on a mount whose server does not answer (not the shared directory):
/// the report shows it asleep in the kernel, in FUSE, which is what a hung NFS or FUSE
/// mount looks like from a node.
#[test]
fn a_command_stuck_on_a_hung_mount_is_reported_asleep_in_the_filesystem() {
    let test = "a_command_stuck_on_a_hung_mount_is_reported_asleep_in_the_filesystem";
    if !common::sshfs::require(test) {
        return;
    }
    let mount = common::sshfs::SshfsCluster::start(1, 1).expect("sshfs substrate");
    let target = mount.mount(0).join("never-looked-up");
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"stat {}; sleep 1000; true\"\ntimeout = \"8s\"\n",
            target.display()
        ),
    );
    // A first use of the mount, so that its server's session runs when frozen.
    fs::create_dir_all(mount.mount(0).join("warm")).unwrap();
    let frozen = mount.freeze_server();
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &env(&[("RL_NODE_TIMING_HANG_REPORT_AT", "0.2")]),
    );
    let report = wait_report(&c, 1, 0, 1);
    // The stat gets its answer now, and the command goes on to its timeout as before.
    drop(frozen);
    let code = node.wait(LIMIT);
    assert_eq!(code, 4, "{}", node.stderr());
    eprintln!("{report}");
    let (_, stat) = process_section(&report, &format!("stat {}", target.display()))
        .unwrap_or_else(|| panic!("no section for the stat:\n{report}"));
    let state = stat.iter().find_map(|l| l.strip_prefix("state: ")).unwrap();
    assert!(
        state.starts_with('S') || state.starts_with('D'),
        "asleep in the kernel, not {state}: {stat:?}"
    );
    let stack: Vec<&&str> = stat.iter().filter(|l| l.starts_with("  [<")).collect();
    assert!(
        stack.iter().any(|l| l.contains("fuse")),
        "its kernel stack is in FUSE: {stat:?}"
    );
    let wchan = stat.iter().find_map(|l| l.strip_prefix("wchan: ")).unwrap();
    assert!(!wchan.starts_with('0'), "{stat:?}");
}

/// The shared directory itself stops answering after a report was due: the report is
/// collected (its summary reaches the node's console) and its write hangs on a thread of
/// its own, while the watchdog ends the node at fs-timeout as it always did.
#[test]
fn a_report_whose_write_hangs_on_the_shared_directory_does_not_hold_up_the_watchdog() {
    let test = "a_report_whose_write_hangs_on_the_shared_directory_does_not_hold_up_the_watchdog";
    if !common::sshfs::require(test) {
        return;
    }
    let mount = common::sshfs::SshfsCluster::start(1, 1).expect("sshfs substrate");
    let marks = tempfile::tempdir().unwrap();
    let c = TestCluster::new(
        1,
        &format!(
            "[phases.rollout]\ncommand = \"touch {}/started; exec sleep 300.91\"\ntimeout = \"10s\"\n",
            marks.path().display()
        ),
    );
    let shared = mount.mount(0).join("exp");
    fs::create_dir_all(&shared).unwrap();
    // A report 2 s into the command; the heartbeat's write hangs at once, so the
    // watchdog fires at 5 s.
    let mut node = c.spawn_env(
        0,
        &shared,
        &["--iterations", "1"],
        &env(&[
            ("RL_NODE_TIMING_HANG_REPORT_AT", "0.2"),
            ("RL_NODE_TIMING_FS_TIMEOUT", "5s"),
        ]),
    );
    wait_until(LIMIT, "the rollout to run", || {
        marks.path().join("started").exists()
    });
    let inner = node.node_process();
    let frozen = mount.freeze_server();
    let froze = std::time::Instant::now();
    let code = node.wait(LIMIT);
    let after = froze.elapsed();
    let err = node.stderr();
    assert_eq!(code, 4, "{err}");
    assert!(after < Duration::from_secs(5 + 12), "{after:?}:\n{err}");
    assert!(
        err.contains("writing a hang report: the rollout command"),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.contains("hang report: ") && l.contains("S sleep 300.91")),
        "the summary comes before the write:\n{err}"
    );
    assert!(err.contains("fs-timeout is 5s"), "{err}");
    assert!(
        !err.contains("hang report logs/"),
        "the report cannot have been written:\n{err}"
    );
    wait_until(LIMIT, "the rollout to be killed", || {
        process_alive_with("sleep 300.91").is_empty()
    });
    drop(frozen);
    wait_until(LIMIT, "the node process to exit", || gone(inner));
}
