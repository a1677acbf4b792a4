//! The run's own state is validated, never silently replaced (issue 9, first item).
//!
//! Each test runs a real cluster for a few iterations so there is a real run, damages one
//! of its state files the way a crash, a full disk or a careless hand would, then restarts
//! the real binary and checks that it refuses with exit 2 naming the file and writing
//! nothing, that `rl-node recover` explains and `--repair` repairs without deleting, and
//! that the run then resumes where it was instead of starting over.

mod common;
use common::cluster::*;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);
const WALK: &str = "iteration-complete:both";

/// One record per rank and iteration: a real committed shard, in microseconds.
const ROLLOUT: &str = r#"[phases.rollout]
command = "echo '{{\"rank\": {rank}, \"iteration\": {iteration}}}' > {output}"
"#;

fn cluster(num_nodes: u32) -> TestCluster {
    TestCluster::new(num_nodes, ROLLOUT)
}

fn state(c: &TestCluster, rel: &str) -> PathBuf {
    c.log_path.join(".rl-node").join(rel)
}

/// Run every rank with `--iterations n` (rank 0 also gets `master_args`) to exit 0;
/// returns each rank's stderr.
fn run(c: &TestCluster, n: u64, master_args: &[&str]) -> Vec<String> {
    let it = n.to_string();
    let mut nodes: Vec<NodeProc> = (0..c.num_nodes)
        .map(|r| {
            let mut args = vec!["--iterations", it.as_str()];
            if r == 0 {
                args.extend_from_slice(master_args);
            }
            c.spawn(r, &args)
        })
        .collect();
    nodes
        .iter_mut()
        .map(|p| {
            let code = p.wait(LIMIT);
            let err = p.stderr();
            assert_eq!(code, 0, "rank {} must finish; stderr:\n{err}", p.rank);
            err
        })
        .collect()
}

/// Restart the cluster over damaged state: rank 0 must exit 2 writing nothing (a worker
/// started with it waits and writes nothing either). Returns rank 0's stderr.
fn refused_restart(c: &TestCluster, n: u64) -> String {
    let before = snapshot(&c.log_path);
    let it = n.to_string();
    let mut master = c.spawn(0, &["--iterations", &it]);
    let mut workers: Vec<NodeProc> = (1..c.num_nodes)
        .map(|r| c.spawn(r, &["--iterations", &it]))
        .collect();
    let code = master.wait(LIMIT);
    let err = master.stderr();
    assert_eq!(
        code, 2,
        "rank 0 must refuse the damaged state; stderr:\n{err}"
    );
    for w in workers.iter_mut() {
        // Still waiting for a generation it can join: stop it (SIGTERM, as a user would).
        assert!(
            w.child.try_wait().unwrap().is_none(),
            "rank {} gave up:\n{}",
            w.rank,
            w.stderr()
        );
        w.signal(libc::SIGTERM);
        w.wait(LIMIT);
    }
    assert_unchanged(&before, &snapshot(&c.log_path), &err);
    err
}

/// Every file and directory under `dir` (nothing excluded): kind, size, mtime and a hash
/// of the contents.
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let m = fs::symlink_metadata(&p).unwrap();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            if m.is_file() {
                fs::read(&p).unwrap().hash(&mut h);
            }
            if m.is_dir() {
                stack.push(p.clone());
            }
            out.insert(
                p.strip_prefix(dir).unwrap().display().to_string(),
                format!(
                    "{} {} bytes mtime {}.{:09} hash {:x}",
                    if m.is_dir() { "dir" } else { "file" },
                    m.len(),
                    m.mtime(),
                    m.mtime_nsec(),
                    h.finish()
                ),
            );
        }
    }
    out
}

fn assert_unchanged(
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
    ctx: &str,
) {
    let mut diffs = vec![];
    for (k, v) in before {
        match after.get(k) {
            None => diffs.push(format!("removed {k}")),
            Some(w) if w != v => diffs.push(format!("changed {k}: {v} -> {w}")),
            _ => {}
        }
    }
    for k in after.keys().filter(|k| !before.contains_key(*k)) {
        diffs.push(format!("created {k}"));
    }
    assert!(
        diffs.is_empty(),
        "the shared directory changed:\n  {}\ncontext:\n{ctx}",
        diffs.join("\n  ")
    );
}

/// `rl-node <cmd> --log-path DIR <args>`: (exit code, stdout, stderr).
fn tool(cmd: &str, c: &TestCluster, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg(cmd)
        .arg("--log-path")
        .arg(&c.log_path)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A JSON-lines file, strictly: every line must parse.
fn json_lines(path: &Path) -> Vec<Value> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{} line {}: {e}: {l:?}", path.display(), i + 1))
        })
        .collect()
}

fn journal(c: &TestCluster, rank: u32) -> Vec<Value> {
    json_lines(&state(c, &format!("journal/rank-{rank}.jsonl")))
}

fn run_id(c: &TestCluster) -> String {
    let v: Value = serde_json::from_slice(&fs::read(state(c, "cluster.json")).unwrap()).unwrap();
    v["run_id"].as_str().unwrap().to_string()
}

/// No rank journaled any work of any iteration twice, and every rank completed
/// iterations 1..=n of `run`.
fn assert_each_iteration_once(c: &TestCluster, run: &str, n: u64, ctx: &str) {
    for r in 0..c.num_nodes {
        let mut seen: HashMap<(u64, String), usize> = HashMap::new();
        for e in journal(c, r) {
            assert_eq!(e["run_id"], run, "{ctx}: rank {r}: {e}");
            *seen
                .entry((
                    e["iteration"].as_u64().unwrap(),
                    e["item"].as_str().unwrap().into(),
                ))
                .or_default() += 1;
        }
        let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "{ctx}: rank {r} journaled work twice: {twice:?}"
        );
        for it in 1..=n {
            assert!(
                seen.contains_key(&(it, WALK.to_string())),
                "{ctx}: rank {r} has no completion of iteration {it}: {seen:?}"
            );
        }
        assert!(
            !seen.keys().any(|(it, _)| *it > n),
            "{ctx}: rank {r} went past iteration {n}: {seen:?}"
        );
    }
}

/// Side files `<name>.<prefix>*` next to `path`.
fn side_files(path: &Path, prefix: &str) -> Vec<PathBuf> {
    let name = format!("{}.{prefix}", path.file_name().unwrap().to_string_lossy());
    let mut v: Vec<PathBuf> = fs::read_dir(path.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&name))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

// ------------------------------------------------------------------ cluster.json

#[test]
fn a_damaged_cluster_record_is_refused_without_writing_and_rebuilt_by_recover() {
    type Damage = fn(&[u8]) -> Vec<u8>;
    let kinds: [(&str, Damage, &str); 4] = [
        ("empty", |_| vec![], "empty"),
        ("truncated", |b| b[..b.len() / 2].to_vec(), "truncated"),
        ("garbage", |_| b"not json at all".to_vec(), "not valid JSON"),
        (
            "wrong shape",
            |_| br#"{"proto":2,"run_id":5}"#.to_vec(),
            "wrong shape",
        ),
    ];
    for (kind, damage, says) in kinds {
        let c = cluster(2);
        run(&c, 2, &[]);
        let id = run_id(&c);
        let path = state(&c, "cluster.json");
        let original = fs::read(&path).unwrap();
        let damaged = damage(&original);
        fs::write(&path, &damaged).unwrap();

        let err = refused_restart(&c, 3);
        assert!(
            err.contains(".rl-node/cluster.json") && err.contains(says),
            "{kind}: {err}"
        );
        assert!(
            err.contains("rl-node recover"),
            "{kind}: the hint names recover: {err}"
        );

        // recover explains, read-only; status refuses and points at recover.
        let before = snapshot(&c.log_path);
        let (code, out, _) = tool("recover", &c, &[]);
        assert_eq!(code, 2, "{kind}: {out}");
        assert!(
            out.contains(".rl-node/cluster.json") && out.contains(says),
            "{kind}: {out}"
        );
        assert!(
            out.contains("repair: rebuild .rl-node/cluster.json from .rl-node/gen-1/cluster.json"),
            "{kind}: {out}"
        );
        let (code, sout, serr) = tool("status", &c, &[]);
        assert_eq!(code, 2, "{kind}: {sout}{serr}");
        assert!(
            serr.contains(".rl-node/cluster.json") && serr.contains(says),
            "{kind}: {serr}"
        );
        assert!(serr.contains("rl-node recover"), "{kind}: {serr}");
        assert_unchanged(&before, &snapshot(&c.log_path), kind);

        let (code, out, err) = tool("recover", &c, &["--repair"]);
        assert_eq!(code, 0, "{kind}: {out}{err}");
        assert!(
            out.contains("repaired: rebuilt .rl-node/cluster.json"),
            "{kind}: {out}"
        );
        let kept = side_files(&path, "damaged-");
        assert_eq!(kept.len(), 1, "{kind}: {kept:?}");
        assert_eq!(
            fs::read(&kept[0]).unwrap(),
            damaged,
            "{kind}: the damaged file is kept"
        );
        assert_eq!(
            fs::read(&path).unwrap(),
            original,
            "{kind}: rebuilt from the generation copy"
        );

        let errs = run(&c, 3, &[]);
        assert!(
            errs[0].contains(&format!("resuming run {id} at iteration 3")),
            "{kind}: {}",
            errs[0]
        );
        assert_eq!(run_id(&c), id, "{kind}");
        assert_each_iteration_once(&c, &id, 3, kind);
    }
}

#[test]
fn a_cluster_record_of_another_protocol_version_is_refused_naming_both_and_fresh_sets_it_aside() {
    let c = cluster(2);
    run(&c, 2, &[]);
    let id = run_id(&c);
    let path = state(&c, "cluster.json");
    let mut v: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(v["proto"], 2, "this rl-node speaks protocol 2: {v}");
    v["proto"] = 1.into();
    fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();

    let err = refused_restart(&c, 3);
    assert!(
        err.contains(".rl-node/cluster.json")
            && err.contains("protocol version 1")
            && err.contains("version 2"),
        "{err}"
    );
    assert!(
        err.contains("--fresh") && err.contains("rl-node version that started it"),
        "{err}"
    );
    let (code, out, _) = tool("recover", &c, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("protocol version 1") && out.contains("--fresh"),
        "{out}"
    );

    let errs = run(&c, 2, &["--fresh"]);
    assert!(
        errs[0].contains(&format!("run {id} set aside")),
        "{}",
        errs[0]
    );
    let aside = c.log_path.join("previous-runs").join(&id);
    assert!(
        aside.join(".rl-node/journal/rank-1.jsonl").exists(),
        "{}",
        errs[0]
    );
    let kept: Value =
        serde_json::from_slice(&fs::read(aside.join(".rl-node/cluster.json")).unwrap()).unwrap();
    assert_eq!(kept["proto"], 1, "the old record is kept as it was");
    let new = run_id(&c);
    assert_ne!(new, id);
    assert_each_iteration_once(&c, &new, 2, "after --fresh");
}

// ------------------------------------------------------------------ rank record

#[test]
fn a_damaged_rank_record_of_the_last_generation_is_refused_and_set_aside_by_recover() {
    let c = cluster(2);
    run(&c, 2, &[]);
    let id = run_id(&c);
    let path = state(&c, "gen-1/rank-0.json");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();

    let err = refused_restart(&c, 3);
    assert!(
        err.contains(".rl-node/gen-1/rank-0.json") && err.contains("truncated"),
        "{err}"
    );

    let (code, out, _) = tool("recover", &c, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("gen-1/rank-0.json") && out.contains("repair: set"),
        "{out}"
    );
    let (code, out, err) = tool("recover", &c, &["--repair"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!path.exists());
    let kept = side_files(&path, "damaged-");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(fs::read(&kept[0]).unwrap(), &bytes[..bytes.len() / 2]);

    let errs = run(&c, 3, &[]);
    assert!(
        errs[0].contains(&format!("resuming run {id} at iteration 3")),
        "{}",
        errs[0]
    );
    assert_each_iteration_once(&c, &id, 3, "after setting the record aside");
}

// ------------------------------------------------------------------ journals

#[test]
fn journal_lines_damaged_in_the_middle_are_refused_moved_aside_and_rebuilt_from_evidence() {
    let c = cluster(2);
    run(&c, 3, &[]);
    let id = run_id(&c);
    let path = state(&c, "journal/rank-1.jsonl");
    let text = fs::read_to_string(&path).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    // Line 2 (some work of iteration 1), and rank 1's completions of iterations 2 and 3:
    // the only proof left that rank 1 completed them is rank 0's journal.
    let completion = |it: u64| {
        lines
            .iter()
            .position(|l| {
                let e: Value = serde_json::from_str(l).unwrap();
                e["item"] == WALK && e["iteration"] == it
            })
            .unwrap()
    };
    let (c2, c3) = (completion(2), completion(3));
    assert!(1 < c2 && c2 < c3 && c3 + 1 == lines.len(), "{text}");
    for i in [1, c2, c3] {
        lines[i] = format!("garbage of line {}", i + 1);
    }
    fs::write(&path, lines.join("\n") + "\n").unwrap();

    let err = refused_restart(&c, 4);
    assert!(
        err.contains(".rl-node/journal/rank-1.jsonl") && err.contains("line 2"),
        "{err}"
    );
    assert!(err.contains("garbage of line 2"), "{err}");

    let (code, out, _) = tool("recover", &c, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("rank-1.jsonl is damaged at line 2"), "{out}");
    assert!(out.contains("rank 0 completed iteration 3"), "{out}");
    let (code, out, err) = tool("recover", &c, &["--repair"]);
    assert_eq!(code, 0, "{out}{err}");
    let aside = side_files(&path, "damaged-");
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(
        fs::read_to_string(&aside[0]).unwrap(),
        format!(
            "line 2: garbage of line 2\nline {a}: garbage of line {a}\nline {b}: garbage of line {b}\n",
            a = c2 + 1,
            b = c3 + 1
        )
    );
    // Every good line kept as it was, then the rebuilt completions, each with a note.
    let repaired = journal(&c, 1);
    let good: Vec<Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(repaired[..good.len()], good[..]);
    let rebuilt = &repaired[good.len()..];
    assert_eq!(
        rebuilt
            .iter()
            .map(|e| e["iteration"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 3],
        "{rebuilt:?}"
    );
    for e in rebuilt {
        assert_eq!(e["item"], WALK, "{e}");
        assert!(
            e["note"]
                .as_str()
                .is_some_and(|n| n.contains("rebuilt by rl-node recover --repair")
                    && n.contains("rank 0 completed iteration 3")),
            "{e}"
        );
    }

    let errs = run(&c, 4, &[]);
    assert!(
        errs[0].contains(&format!("resuming run {id} at iteration 4")),
        "{}",
        errs[0]
    );
    assert_each_iteration_once(&c, &id, 4, "after repairing rank 1's journal");
}

/// recover judges the run's state by the run's own `[limits]`, as its nodes do: a journal
/// over the run's journal-mib is damage it names with the key, not a journal it reads as
/// empty (and reports as nothing done) once it has taken those limits on.
#[test]
fn recover_judges_the_journals_by_the_runs_own_limits() {
    let c = cluster(1);
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_LIMITS_JOURNAL_MIB", "1".into())],
    );
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    // 2 MiB (sparse): over the run's 1 MiB, far under the default limit.
    let journal = state(&c, "journal/rank-0.jsonl");
    common::set_file_len(&journal, 2 << 20);
    let before = snapshot(&c.log_path);
    let (code, out, err) = tool("recover", &c, &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        out.contains("rank-0.jsonl is larger than 1 MiB") && out.contains("limits.journal-mib"),
        "{out}{err}"
    );
    assert_unchanged(&before, &snapshot(&c.log_path), &out);
}

#[test]
fn a_torn_last_line_is_tolerated_reported_and_set_aside_so_the_next_entry_starts_a_new_line() {
    let c = cluster(2);
    run(&c, 2, &[]);
    let id = run_id(&c);
    let journal1 = state(&c, "journal/rank-1.jsonl");
    let history = state(&c, "history.jsonl");
    let jfrag = r#"{"run_id":"x","ge"#;
    let hfrag = r#"{"gen":7,"run_id":"#;
    for (p, frag) in [(&journal1, jfrag), (&history, hfrag)] {
        let mut t = fs::read_to_string(p).unwrap();
        t.push_str(frag);
        fs::write(p, t).unwrap();
    }

    // recover, the tool for after a crash, notes the torn lines and still says where the
    // run stands (read-only).
    let before = snapshot(&c.log_path);
    let (code, out, err) = tool("recover", &c, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("note: ") && out.contains("rank-1.jsonl ends with an unfinished line"),
        "{out}"
    );
    assert!(
        out.contains("history.jsonl ends with an unfinished line"),
        "{out}"
    );
    // The run was started with --iterations 2, so it is complete (a larger --iterations
    // extends it, as below).
    assert!(
        out.contains("the run is complete: all 2 planned iteration(s) are done"),
        "{out}"
    );
    assert_unchanged(&before, &snapshot(&c.log_path), &out);

    let errs = run(&c, 3, &[]);
    assert!(
        errs[0].contains(&format!("resuming run {id} at iteration 3")),
        "{}",
        errs[0]
    );
    assert!(
        errs[0].contains(".rl-node/journal/rank-1.jsonl ends with an unfinished line")
            && errs[0].contains(".rl-node/history.jsonl ends with an unfinished line"),
        "rank 0 reports both: {}",
        errs[0]
    );
    assert!(
        errs[1].contains("rank-1.jsonl: the unfinished last line") && errs[1].contains("set aside"),
        "rank 1 sets its own aside: {}",
        errs[1]
    );
    for (p, frag) in [(&journal1, jfrag), (&history, hfrag)] {
        let torn = side_files(p, "torn-gen");
        assert_eq!(torn.len(), 1, "{torn:?}");
        assert_eq!(
            fs::read_to_string(&torn[0]).unwrap(),
            frag,
            "{}",
            torn[0].display()
        );
        let text = fs::read_to_string(p).unwrap();
        assert!(text.ends_with('\n') && !text.contains(frag), "{text}");
    }
    // Every line parses again (json_lines is strict); the new entries are whole.
    assert_each_iteration_once(&c, &id, 3, "after a torn tail");
    let hist = json_lines(&history);
    assert_eq!(hist.len(), 2, "{hist:?}");
    assert_eq!(hist[1]["gen"], 2);
    assert_eq!(hist[1]["resume_iteration"], 3);
    let (code, out, err) = tool("status", &c, &[]);
    assert_eq!(code, 0, "{out}{err}");
}

/// Rank 1's journal lost (deleted or emptied) after a 2-node run of 3 iterations: rank
/// 0's journal proves rank 1's work.
#[test]
fn a_lost_worker_journal_is_refused_and_rebuilt_from_the_other_journal() {
    for (how, lose) in [
        (
            "missing",
            (|p: &Path| fs::remove_file(p).unwrap()) as fn(&Path),
        ),
        ("empty", |p: &Path| fs::write(p, "").unwrap()),
    ] {
        let c = cluster(2);
        run(&c, 3, &[]);
        let id = run_id(&c);
        let path = state(&c, "journal/rank-1.jsonl");
        lose(&path);

        let err = refused_restart(&c, 4);
        assert!(
            err.contains("rank 1's journal")
                && err.contains(".rl-node/journal/rank-1.jsonl")
                && err.contains(&format!("is {how}"))
                && err.contains("rank 0 completed iteration 3"),
            "{how}: {err}"
        );
        let (code, out, _) = tool("recover", &c, &[]);
        assert_eq!(code, 2, "{how}: {out}");
        assert!(
            out.contains("rank 1's journal") && out.contains("rebuilt"),
            "{how}: {out}"
        );
        let (code, out, err) = tool("recover", &c, &["--repair"]);
        assert_eq!(code, 0, "{how}: {out}{err}");
        let rebuilt = journal(&c, 1);
        assert_eq!(
            rebuilt
                .iter()
                .map(|e| e["iteration"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            vec![1, 2, 3],
            "{how}: {rebuilt:?}"
        );
        assert!(
            rebuilt
                .iter()
                .all(|e| e["item"] == WALK && e["note"].is_string()),
            "{rebuilt:?}"
        );

        let errs = run(&c, 4, &[]);
        assert!(
            errs[0].contains(&format!("resuming run {id} at iteration 4")),
            "{how}: {}",
            errs[0]
        );
        assert_each_iteration_once(&c, &id, 4, how);
    }
}

/// A single node: only the history proves what its lost journal held.
#[test]
fn a_lost_journal_of_a_single_node_is_refused_by_the_history() {
    let c = cluster(1);
    run(&c, 2, &[]);
    // A second generation, which resumed at iteration 3: every rank completed 2.
    run(&c, 3, &[]);
    let id = run_id(&c);
    let path = state(&c, "journal/rank-0.jsonl");
    fs::remove_file(&path).unwrap();

    let err = refused_restart(&c, 4);
    assert!(
        err.contains("rank 0's journal")
            && err.contains("is missing")
            && err.contains("history.jsonl says generation 2 resumed at iteration 3"),
        "{err}"
    );
    let (code, out, err) = tool("recover", &c, &["--repair"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("appended rebuilt completion entries for iteration(s) 1-2"),
        "{out}"
    );

    let errs = run(&c, 4, &[]);
    assert!(
        errs[0].contains(&format!("resuming run {id} at iteration 3")),
        "{}",
        errs[0]
    );
    assert_each_iteration_once(&c, &id, 4, "single node");
    let j = journal(&c, 0);
    assert!(j
        .iter()
        .filter(|e| e["iteration"].as_u64() < Some(3))
        .all(|e| e["note"].is_string()));
}

// ------------------------------------------------------------------ missing cluster.json

#[test]
fn a_missing_cluster_record_with_journals_is_refused_and_fresh_sets_the_run_aside() {
    let c = cluster(2);
    run(&c, 2, &[]);
    let id = run_id(&c);
    fs::remove_file(state(&c, "cluster.json")).unwrap();

    let err = refused_restart(&c, 3);
    assert!(
        err.contains(".rl-node/cluster.json is missing, but the run's journals and history record committed work"),
        "{err}"
    );
    let (code, out, _) = tool("recover", &c, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("is missing"), "{out}");

    let errs = run(&c, 2, &["--fresh"]);
    assert!(
        errs[0].contains(&format!("run {id} set aside")),
        "{}",
        errs[0]
    );
    let aside = c.log_path.join("previous-runs").join(&id);
    for r in 0..2 {
        let old = json_lines(&aside.join(format!(".rl-node/journal/rank-{r}.jsonl")));
        assert!(
            old.iter().all(|e| e["run_id"] == id.as_str()) && old.len() > 2,
            "{old:?}"
        );
    }
    let new = run_id(&c);
    assert_ne!(new, id);
    assert_each_iteration_once(&c, &new, 2, "after --fresh");
    let hist = json_lines(&state(&c, "history.jsonl"));
    assert!(hist.iter().all(|h| h["run_id"] == new.as_str()), "{hist:?}");
}

// ------------------------------------------------------------------ history

#[test]
fn a_damaged_middle_line_of_the_history_is_named_by_status_and_refused() {
    let c = cluster(1);
    for n in 1..=3 {
        run(&c, n, &[]);
    }
    let path = state(&c, "history.jsonl");
    let text = fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    lines[1] = r#"{"gen": oops"#;
    fs::write(&path, lines.join("\n") + "\n").unwrap();

    let before = snapshot(&c.log_path);
    let (code, out, err) = tool("status", &c, &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(".rl-node/history.jsonl is damaged at line 2")
            && err.contains("rl-node recover"),
        "{err}"
    );
    assert_unchanged(&before, &snapshot(&c.log_path), &err);
    let err = refused_restart(&c, 4);
    assert!(
        err.contains(".rl-node/history.jsonl is damaged at line 2"),
        "{err}"
    );
}
