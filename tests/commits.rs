//! How a rank's rollout shard is committed, with the real binary: a command that writes the
//! shard name itself has it adopted (never replaced by an empty shard), writing both names
//! or neither is an error (unless empty shards are expected), a shard committed by a
//! crashed attempt is set aside and not merged twice; the custom merge's output is
//! committed the same way (never written to the merged file's name directly, an earlier
//! attempt's merged file set aside); a restart after `kill -9` is not
//! refused because the dead node's pid now belongs to an unrelated process; and messages
//! never show an empty model.

mod common;
use common::cluster::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Generous: everything here takes a few seconds on an idle machine.
const LIMIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------ helpers

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn iter_dir(c: &TestCluster, it: u64) -> PathBuf {
    c.log_path.join(format!("rollouts/iter-{it:04}"))
}

fn shard(c: &TestCluster, it: u64, rank: u32) -> PathBuf {
    iter_dir(c, it).join(format!("train/rank-{rank}.jsonl"))
}

fn merged(c: &TestCluster, it: u64) -> PathBuf {
    iter_dir(c, it).join("train.jsonl")
}

fn manifest(c: &TestCluster, it: u64) -> serde_json::Value {
    read_json(&iter_dir(c, it).join("train.jsonl.manifest.json"))
}

fn journal(c: &TestCluster, rank: u32) -> Vec<serde_json::Value> {
    fs::read_to_string(
        c.log_path
            .join(format!(".rl-node/journal/rank-{rank}.jsonl")),
    )
    .unwrap_or_default()
    .lines()
    .filter_map(|l| serde_json::from_str(l).ok())
    .collect()
}

fn phase_log(c: &TestCluster, it: u64, rank: u32) -> String {
    fs::read_to_string(
        c.log_path
            .join(format!("logs/iter-{it:04}/rank-{rank}.rollout.log")),
    )
    .unwrap_or_default()
}

/// Every node exits 0.
fn wait_done(nodes: &mut [NodeProc], context: &str) {
    for n in nodes.iter_mut() {
        assert_eq!(
            n.wait(LIMIT),
            0,
            "{context}: rank {} failed:\n{}",
            n.rank,
            n.stderr()
        );
    }
}

/// One JSON record per rank and iteration, written where `target` says (a shell word).
fn rollout(target: &str) -> String {
    format!(
        "[phases.rollout]\ncommand = \"echo '{{\\\"rank\\\": {{rank}}, \\\"iteration\\\": {{iteration}}}}' > {target}\"\n"
    )
}

fn record(rank: u32, it: u64) -> String {
    format!("{{\"rank\": {rank}, \"iteration\": {it}}}\n")
}

// ------------------------------------------------------------------ 1: adoption

/// webgym's rollout script names its own file: the shard name, next to `{output}`. That
/// file is adopted, merged like any shard, and recorded as written by the command; it is
/// never replaced by an empty shard.
#[test]
fn a_shard_written_by_the_command_itself_is_adopted_and_merged() {
    let c = TestCluster::new(2, &rollout("$(dirname {output})/rank-{rank}.jsonl"));
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    wait_done(&mut nodes, "adoption");
    for it in 1..=2 {
        let text = fs::read_to_string(merged(&c, it)).unwrap();
        assert_eq!(text, record(0, it) + &record(1, it), "iteration {it}");
        let m = manifest(&c, it);
        assert_eq!(m["records"], 2, "{m}");
        for r in 0..2u32 {
            let entry = &m["ranks"][r as usize];
            assert_eq!(entry["rank"], r, "{m}");
            assert_eq!(entry["status"], "complete", "{m}");
            assert_eq!(entry["records"], 1, "{m}");
            let adopted = entry["adopted"].as_str().unwrap_or_else(|| panic!("{m}"));
            assert!(
                adopted.starts_with("adopted") && adopted.contains(&format!("rank-{r}.jsonl")),
                "{m}"
            );
            // The committed shard is the command's own file, untouched.
            assert_eq!(fs::read_to_string(shard(&c, it, r)).unwrap(), record(r, it));
            let log = phase_log(&c, it, r);
            assert!(
                log.contains("itself (not {output}); adopted"),
                "rank {r} iteration {it} phase log:\n{log}"
            );
            let entry = journal(&c, r)
                .into_iter()
                .find(|e| e["iteration"] == it && e["item"] == "rollout-train")
                .unwrap_or_else(|| panic!("rank {r} journaled no rollout of iteration {it}"));
            assert!(
                entry["note"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("adopted")),
                "{entry}"
            );
        }
    }
    for n in &nodes {
        assert!(
            n.stderr().contains("itself; adopted"),
            "rank {}:\n{}",
            n.rank,
            n.stderr()
        );
        assert!(!n.stderr().contains("wrote no output"), "{}", n.stderr());
    }
}

/// `{output}` as usual: nothing is marked adopted (the control for the test above).
#[test]
fn a_shard_written_to_output_is_committed_and_not_marked_adopted() {
    let c = TestCluster::new(2, &rollout("{output}"));
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    wait_done(&mut nodes, "output");
    assert_eq!(
        fs::read_to_string(merged(&c, 1)).unwrap(),
        record(0, 1) + &record(1, 1)
    );
    let m = manifest(&c, 1);
    for r in 0..2 {
        assert!(m["ranks"][r].get("adopted").is_none(), "{m}");
        assert!(!phase_log(&c, 1, r as u32).contains("adopted"));
    }
    // Only the committed shard is left: the partial was renamed.
    let names: Vec<String> = fs::read_dir(iter_dir(&c, 1).join("train"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["rank-0.jsonl", "rank-1.jsonl"]);
}

// ------------------------------------------------------------------ 2: both names

/// Rank 1 writes `{output}` and the shard name: rl-node cannot tell which is the shard,
/// replaces neither, and fails the phase naming both (rank 1 exits 1, rank 0 exits 3);
/// nothing is merged.
#[test]
fn a_command_that_writes_both_output_and_the_shard_name_fails_naming_both() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"echo '{\\\"out\\\": {rank}}' > {output}; if [ {rank} = 1 ]; then echo '{\\\"own\\\": 1}' > $(dirname {output})/rank-1.jsonl; fi\"\n",
    );
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    let code1 = nodes[1].wait(LIMIT);
    let code0 = nodes[0].wait(LIMIT);
    let err1 = nodes[1].stderr();
    assert_eq!(code1, 1, "rank 1:\n{err1}");
    assert_eq!(code0, 3, "rank 0:\n{}", nodes[0].stderr());
    let partial = iter_dir(&c, 1).join("train/rank-1.partial.g1.jsonl");
    let own = shard(&c, 1, 1);
    let line = err1
        .lines()
        .find(|l| l.contains("wrote both"))
        .unwrap_or_else(|| panic!("no 'wrote both' line:\n{err1}"));
    assert!(
        line.contains(&partial.display().to_string()) && line.contains(&own.display().to_string()),
        "{line}"
    );
    // Neither file was replaced or removed.
    assert_eq!(fs::read_to_string(&partial).unwrap(), "{\"out\": 1}\n");
    assert_eq!(fs::read_to_string(&own).unwrap(), "{\"own\": 1}\n");
    // Nothing merged for that iteration.
    assert!(!merged(&c, 1).exists());
    assert!(!iter_dir(&c, 1).join("train.jsonl.manifest.json").exists());
    assert!(!journal(&c, 1)
        .iter()
        .any(|e| e["iteration"] == 1 && e["item"] == "rollout-train"));
}

// ------------------------------------------------------------------ 3: neither name

const WRITES_NOTHING_ON_RANK_1: &str = "[phases.rollout]\ncommand = \"if [ {rank} = 0 ]; then echo '{\\\"rank\\\": 0}' > {output}; fi\"\n";

#[test]
fn a_command_that_writes_nothing_fails_naming_both_paths() {
    let c = TestCluster::new(2, WRITES_NOTHING_ON_RANK_1);
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    let code1 = nodes[1].wait(LIMIT);
    let code0 = nodes[0].wait(LIMIT);
    let err1 = nodes[1].stderr();
    assert_eq!(code1, 1, "rank 1:\n{err1}");
    assert_eq!(code0, 3, "rank 0:\n{}", nodes[0].stderr());
    let partial = iter_dir(&c, 1).join("train/rank-1.partial.g1.jsonl");
    let line = err1
        .lines()
        .find(|l| l.contains("wrote no output"))
        .unwrap_or_else(|| panic!("no 'wrote no output' line:\n{err1}"));
    assert!(
        line.contains(&partial.display().to_string())
            && line.contains(&shard(&c, 1, 1).display().to_string()),
        "{line}"
    );
    // No empty shard was invented.
    assert!(!shard(&c, 1, 1).exists());
    assert!(!merged(&c, 1).exists());
}

#[test]
fn with_allow_empty_shards_a_command_that_writes_nothing_commits_an_empty_shard() {
    let c = TestCluster::new(
        2,
        &format!("{WRITES_NOTHING_ON_RANK_1}[aggregate]\nallow-empty-shards = true\n"),
    );
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    wait_done(&mut nodes, "allow-empty-shards");
    assert_eq!(fs::read_to_string(shard(&c, 1, 1)).unwrap(), "");
    assert_eq!(
        fs::read_to_string(merged(&c, 1)).unwrap(),
        "{\"rank\": 0}\n"
    );
    let m = manifest(&c, 1);
    assert_eq!(m["ranks"][1]["status"], "complete", "{m}");
    assert_eq!(m["ranks"][1]["records"], 0, "{m}");
    assert!(m["ranks"][1].get("adopted").is_none(), "{m}");
    assert!(
        nodes[1].stderr().contains("empty shard committed"),
        "{}",
        nodes[1].stderr()
    );
}

// ------------------------------------------------------------------ 3b: links

/// The shared directory is untrusted: a link left as the shard (or as `{output}`), by the
/// command or by anyone else with write access, is never committed or adopted, so that
/// no file outside the run is read into the merge. Rank 1 fails naming the link; the file
/// it points at is not in any merged file.
#[test]
fn a_link_as_the_shard_or_as_output_is_refused_and_nothing_it_points_at_is_merged() {
    for (target, link) in [
        ("{output}", "train/rank-1.partial.g1.jsonl"),
        ("$(dirname {output})/rank-1.jsonl", "train/rank-1.jsonl"),
    ] {
        let c = TestCluster::new(
            2,
            &format!(
                "[phases.rollout]\ncommand = \"if [ {{rank}} = 0 ]; then echo '{{\\\"rank\\\": 0}}' > {{output}}; else echo '{{\\\"secret\\\": 1}}' > $(dirname {{output}})/../secret; ln -s ../secret {target}; fi\"\n"
            ),
        );
        let mut nodes = c.spawn_all(&["--iterations", "1"]);
        let code1 = nodes[1].wait(LIMIT);
        let code0 = nodes[0].wait(LIMIT);
        let err1 = nodes[1].stderr();
        assert_eq!(code1, 1, "{target}: rank 1:\n{err1}");
        assert_eq!(code0, 3, "{target}: rank 0:\n{}", nodes[0].stderr());
        let link = iter_dir(&c, 1).join(link);
        let line = err1
            .lines()
            .find(|l| l.contains("not a regular file"))
            .unwrap_or_else(|| panic!("{target}: no 'not a regular file' line:\n{err1}"));
        assert!(line.contains(&link.display().to_string()), "{line}");
        // Left as it was, and nothing merged or journaled.
        assert!(
            fs::symlink_metadata(&link).unwrap().is_symlink(),
            "{target}"
        );
        assert!(!merged(&c, 1).exists(), "{target}");
        assert!(!journal(&c, 1)
            .iter()
            .any(|e| e["iteration"] == 1 && e["item"] == "rollout-train"));
    }
}

// ------------------------------------------------------------------ 4: crash after commit

/// Rank 1 crashes after committing its shard and before journaling it; the restart redoes
/// the rollout, sets the committed shard aside (content kept) and merges only the redo.
fn crash_between_commit_and_journal(target: &str, context: &str) {
    // Each attempt writes a distinct record (nanoseconds), so a shard merged twice or the
    // wrong attempt merged shows.
    let c = TestCluster::new(
        2,
        &format!(
            "[phases.rollout]\ncommand = \"echo '{{\\\"rank\\\": {{rank}}, \\\"attempt\\\": '$(date +%s%N)'}}' > {target}\"\n"
        ),
    );
    // Rank 0 notices the crash after dead-after: keep it short.
    let fast = ("RL_NODE_TIMING_DEAD_AFTER", "1500ms".to_string());
    let mut nodes = vec![
        c.spawn_env(
            0,
            &c.log_path,
            &["--iterations", "1"],
            std::slice::from_ref(&fast),
        ),
        c.spawn_env(
            1,
            &c.log_path,
            &["--iterations", "1"],
            &[
                (
                    "RL_NODE_TEST_CRASH_AT",
                    "after-commit:rollout-train@1".to_string(),
                ),
                fast.clone(),
            ],
        ),
    ];
    assert_eq!(
        nodes[1].wait(LIMIT),
        134,
        "{context}: {}",
        nodes[1].stderr()
    );
    assert_eq!(nodes[0].wait(LIMIT), 3, "{context}: {}", nodes[0].stderr());
    let committed = shard(&c, 1, 1);
    let first = fs::read_to_string(&committed)
        .unwrap_or_else(|e| panic!("{context}: the crashed attempt's shard: {e}"));
    assert!(first.contains("\"attempt\""), "{context}: {first}");
    assert!(!journal(&c, 1)
        .iter()
        .any(|e| e["iteration"] == 1 && e["item"] == "rollout-train"));
    drop(nodes);

    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    wait_done(&mut nodes, context);
    // Set aside in the new generation (2), its content intact.
    let dir = iter_dir(&c, 1).join("train");
    let aside: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("rank-1.jsonl.stale-gen")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{context}: {aside:?}");
    assert_eq!(
        aside[0].file_name().unwrap().to_string_lossy(),
        "rank-1.jsonl.stale-gen2",
        "{context}"
    );
    assert_eq!(fs::read_to_string(&aside[0]).unwrap(), first, "{context}");
    let second = fs::read_to_string(&committed).unwrap();
    assert_ne!(second, first, "{context}: the rollout was not redone");
    assert!(
        nodes[1].stderr().contains("was set aside as"),
        "{context}: {}",
        nodes[1].stderr()
    );
    // Rank 0's shard reused; rank 1's merged once: the redo only.
    let text = fs::read_to_string(merged(&c, 1)).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{context}: {text}");
    assert!(lines[0].starts_with("{\"rank\": 0,"), "{context}: {text}");
    assert_eq!(format!("{}\n", lines[1]), second, "{context}: {text}");
    assert!(!text.contains(first.trim()), "{context}: {text}");
    let m = manifest(&c, 1);
    assert_eq!(m["records"], 2, "{context}: {m}");
    // The manifest says which earlier attempt was set aside.
    assert_eq!(
        m["ranks"][1]["set_aside"],
        serde_json::json!(["rollouts/iter-0001/train/rank-1.jsonl.stale-gen2"]),
        "{context}: {m}"
    );
    assert_eq!(
        m["ranks"][0]["set_aside"],
        serde_json::json!([]),
        "{context}: {m}"
    );
    assert_eq!(
        journal(&c, 1)
            .iter()
            .filter(|e| e["iteration"] == 1 && e["item"] == "rollout-train")
            .count(),
        1,
        "{context}"
    );
}

#[test]
fn a_shard_committed_before_a_crash_is_set_aside_and_not_merged_twice() {
    crash_between_commit_and_journal("{output}", "{output}");
}

#[test]
fn an_adopted_shard_committed_before_a_crash_is_set_aside_and_not_merged_twice() {
    crash_between_commit_and_journal("$(dirname {output})/rank-{rank}.jsonl", "adopted");
}

// ------------------------------------------------------------------ 5: the custom merge

/// `[phases.aggregate] command`: each attempt writes one distinct record (nanoseconds) to
/// `target` (a shell word).
fn custom_merge(target: &str) -> String {
    format!(
        "{}[phases.aggregate]\ncommand = \"echo '{{\\\"attempt\\\": '$(date +%s%N)'}}' > {target}\"\n",
        rollout("{output}")
    )
}

/// The custom merge's `{output}` is its generation's partial file, committed as the merged
/// file; a merged file committed by an attempt that crashed before journaling it is set
/// aside (content kept), never replaced, and the redo is committed in its place.
#[test]
fn a_custom_merge_committed_before_a_crash_is_set_aside_and_the_redo_committed() {
    let c = TestCluster::new(1, &custom_merge("{output}"));
    let mut first = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[(
            "RL_NODE_TEST_CRASH_AT",
            "after-commit:aggregate-train@1".to_string(),
        )],
    );
    assert_eq!(first.wait(LIMIT), 134, "{}", first.stderr());
    let earlier = fs::read_to_string(merged(&c, 1)).unwrap();
    assert!(earlier.contains("\"attempt\""), "{earlier}");
    // Committed from generation 1's own partial, which is gone.
    assert!(!iter_dir(&c, 1).join("train.partial.g1.jsonl").exists());
    let mut again = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(again.wait(LIMIT), 0, "{}", again.stderr());
    assert_eq!(
        fs::read_to_string(iter_dir(&c, 1).join("train.jsonl.stale-gen2")).unwrap(),
        earlier,
        "the earlier merge is kept aside"
    );
    let redo = fs::read_to_string(merged(&c, 1)).unwrap();
    assert_ne!(redo, earlier, "the merge was not redone");
    assert!(!iter_dir(&c, 1).join("train.partial.g2.jsonl").exists());
    assert_eq!(
        journal(&c, 0)
            .iter()
            .filter(|e| e["iteration"] == 1 && e["item"] == "aggregate-train")
            .count(),
        1
    );
}

/// A custom merge that writes the merged file's name itself (here through
/// `{trajectories}`) instead of `{output}`, or writes nothing, fails naming the files;
/// rl-node commits nothing and removes nothing.
#[test]
fn a_custom_merge_that_does_not_write_its_output_fails_naming_it() {
    for (target, says) in [
        ("{trajectories}", "itself instead of {output}"),
        ("/dev/null", "wrote no output"),
    ] {
        let c = TestCluster::new(1, &custom_merge(target));
        let mut node = c.spawn(0, &["--iterations", "1"]);
        assert_eq!(node.wait(LIMIT), 1, "{target}: {}", node.stderr());
        let err = node.stderr();
        let line = err
            .lines()
            .find(|l| l.contains(says))
            .unwrap_or_else(|| panic!("{target}: no '{says}' line:\n{err}"));
        let partial = iter_dir(&c, 1).join("train.partial.g1.jsonl");
        assert!(line.contains(&partial.display().to_string()), "{line}");
        assert!(!partial.exists(), "{target}");
        if target == "{trajectories}" {
            assert!(
                line.contains(&merged(&c, 1).display().to_string()),
                "{line}"
            );
            // What the command wrote is left as it is.
            assert!(fs::read_to_string(merged(&c, 1))
                .unwrap()
                .contains("\"attempt\""));
        } else {
            assert!(!merged(&c, 1).exists(), "{target}");
        }
        assert!(!journal(&c, 0)
            .iter()
            .any(|e| e["item"] == "aggregate-train"));
    }
}

// ------------------------------------------------------------------ 6: pid reuse

/// Descendants of `pid` whose command line contains `needle`.
fn descendants_with(pid: i32, needle: &str) -> Vec<i32> {
    descendants(pid)
        .into_iter()
        .filter(|p| {
            let cmd = fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(needle)
        })
        .collect()
}

/// Is `pid` a live (not zombie) process?
fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')').is_some_and(|(_, r)| {
            !r.trim_start().starts_with('Z') && !r.trim_start().starts_with('X')
        })
    })
}

/// Make the kernel give `pid` (free now) to a new, unrelated `sleep 300`: write pid-1 to
/// /proc/sys/kernel/ns_last_pid and spawn at once. Another process may take the pid in
/// between; retry. `Err` says why it is impossible here.
fn spawn_with_pid(pid: i32) -> Result<Child, String> {
    const NS_LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";
    let mut last = String::new();
    for _ in 0..200 {
        if alive(pid) || Path::new(&format!("/proc/{pid}")).exists() {
            // Taken (or a zombie not yet reaped): wait for it to go.
            last = format!("pid {pid} is in use by another process");
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        // CRIU's convention: hold an exclusive flock on ns_last_pid while using it.
        let f = fs::OpenOptions::new()
            .write(true)
            .open(NS_LAST_PID)
            .map_err(|e| format!("cannot open {NS_LAST_PID}: {e}"))?;
        use std::io::Write;
        let _ = rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive);
        let mut w = &f;
        if let Err(e) = w.write_all((pid - 1).to_string().as_bytes()) {
            return Err(format!("cannot write {NS_LAST_PID}: {e}"));
        }
        let child = Command::new("sleep")
            .arg("300")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot spawn sleep: {e}"))?;
        drop(f);
        if child.id() as i32 == pid {
            return Ok(child);
        }
        last = format!("the sleep got pid {} instead of {pid}", child.id());
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
    }
    Err(last)
}

/// After `kill -9` of rank 0, its pid goes to an unrelated process: a restart must judge
/// the holder by pid *and* start time, see that the record's process is gone, resume and
/// complete; never "already held by a live process".
#[test]
fn a_restart_after_kill_9_is_not_refused_when_the_dead_nodes_pid_was_reused() {
    let c = TestCluster::new(1, &rollout("{output}"));
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "2"],
        &[("RL_NODE_TEST_HOLD_AT", "train-rollout@2".to_string())],
    );
    wait_until(LIMIT, "rank 0 to hold in iteration 2", || {
        node.stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    let old_pid = node.pid();
    let rec = c.record(0).expect("rank 0's record");
    assert_eq!(rec["pid"], old_pid, "{rec}");
    // Its guardian (a child of its node process) outlives it briefly (it stops the node's
    // commands, then exits).
    let guardians = descendants_with(old_pid, "__guard");
    assert!(!guardians.is_empty(), "no guardian under pid {old_pid}");
    node.signal(libc::SIGKILL);
    assert_eq!(node.wait(LIMIT), 137);
    wait_until(LIMIT, "the killed node's guardian to exit", || {
        guardians.iter().all(|g| !alive(*g))
    });
    drop(node);

    let mut impostor = match spawn_with_pid(old_pid) {
        Ok(child) => child,
        Err(why) => {
            eprintln!("SKIPPED: cannot give pid {old_pid} to another process: {why}");
            return;
        }
    };
    assert!(alive(old_pid));

    let mut node = c.spawn(0, &["--iterations", "2"]);
    let code = node.wait(LIMIT);
    let err = node.stderr();
    let _ = impostor.kill();
    let _ = impostor.wait();
    assert!(!err.contains("already held by a live process"), "{err}");
    assert_eq!(code, 0, "{err}");
    // It resumed the run where the killed node left it (iteration 1 was complete).
    assert!(
        err.contains("resuming run") && err.contains("at iteration 2"),
        "{err}"
    );
    assert!(
        err.contains(&format!("pid {old_pid} on")) && err.contains("stopped heartbeating"),
        "{err}"
    );
    for it in 1..=2 {
        assert_eq!(fs::read_to_string(merged(&c, it)).unwrap(), record(0, it));
    }
    let cluster = read_json(&c.log_path.join(".rl-node/cluster.json"));
    assert_eq!(cluster["gen"], 2, "{cluster}");
}

/// The control: while the recorded process really is alive (same pid, same start time),
/// a second rank 0 is refused.
#[test]
fn a_second_master_is_refused_while_the_first_is_alive() {
    let c = TestCluster::new(1, &rollout("{output}"));
    let mut first = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_TEST_HOLD_AT", "train-rollout@1".to_string())],
    );
    wait_until(LIMIT, "rank 0 to hold", || {
        first.stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    let mut second = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(second.wait(LIMIT), 2, "{}", second.stderr());
    assert!(
        second.stderr().contains("already held by a live process"),
        "{}",
        second.stderr()
    );
    first.signal(libc::SIGKILL);
    first.wait(LIMIT);
}

// ------------------------------------------------------------------ 6: empty model

/// No `cluster.model`, a server, and a training command that writes nothing: every message
/// names "the base model (cluster.model is empty)" instead of an empty value.
#[test]
fn messages_never_show_an_empty_model() {
    let c = TestCluster::new(
        1,
        &format!(
            r#"{}
[phases.train]
command = "true"
[server]
command = "exec python3 {} {{server_port}} {{model}}"
start-timeout = "20s"
stop-grace = "2s"
"#,
            rollout("{output}"),
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/health_server.py"
            )
        ),
    );
    let text = fs::read_to_string(&c.config).unwrap();
    assert!(!text.contains("model ="), "{text}");
    let mut node = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_SERVER_PORT", free_port().to_string())],
    );
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_eq!(code, 0, "{err}");
    const BASE: &str = "the base model (cluster.model is empty)";
    let starting: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("server starting on"))
        .collect();
    assert!(!starting.is_empty(), "{err}");
    for l in &starting {
        assert!(
            l.contains(&format!("server starting on {BASE} (pid")),
            "{l}"
        );
    }
    let stays: Vec<&str> = err.lines().filter(|l| l.contains("stays ")).collect();
    assert!(!stays.is_empty(), "no 'the model stays' warning:\n{err}");
    for l in err.lines() {
        assert!(!l.contains("starting on  ("), "{l}");
        assert!(!l.contains(" on  ("), "empty value: {l}");
        if let Some((_, after)) = l.split_once("stays ") {
            assert!(
                !after.trim().is_empty() && !after.starts_with(' ') && !after.starts_with(';'),
                "empty model after 'stays': {l}"
            );
        }
    }
    for l in &stays {
        assert!(l.contains(&format!("stays {BASE}")), "{l}");
    }
    // The server really ran, on an empty model argument.
    let log =
        fs::read_to_string(c.log_path.join("logs/iter-0000/rank-0.server.log")).unwrap_or_default();
    assert!(log.contains("serving model= on port"), "{log}");
}
