//! `rl-node doctor` on real filesystems: local disk, tmpfs (/dev/shm) and, when the
//! substrate is there, an sshfs mount. It must pass on each, name the filesystem, print a
//! `[timing]` that parses, and leave nothing behind (least of all in a run's files).

mod common;

use common::cluster::BIN;
use common::doctor::{self, check};
use common::sshfs::{self, SshfsCluster};
use common::{finish_within, output_text};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant, SystemTime};

const CHECKS: [&str; 10] = [
    "mount",
    "eexist-enoent",
    "stale-rename",
    "rename-over",
    "exclusive-create",
    "hard-link",
    "fsync-file",
    "fsync-dir",
    "free-space",
    "free-inodes",
];

fn doctor(dir: &Path, json: bool) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(["doctor", "--log-path"]).arg(dir);
    if json {
        cmd.arg("--json");
    }
    cmd.env_remove("RL_NODE_CLUSTER_LOG_PATH").output().unwrap()
}

/// `stat -f -c %T`: the kernel's name for the filesystem type (ext4 shows as ext2/ext3).
fn stat_type(dir: &Path) -> String {
    let o = Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// A run's files, to prove doctor leaves them alone.
fn plant_run(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>, std::time::SystemTime)> {
    let files = [
        ".rl-node/cluster.json",
        ".rl-node/gen-0001/rank-0.json",
        "rollouts/iter-0001/rank-0.jsonl",
    ];
    files
        .iter()
        .map(|f| {
            let p = dir.join(f);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, format!("{{\"file\":\"{f}\"}}")).unwrap();
            let m = fs::metadata(&p).unwrap().modified().unwrap();
            (p.clone(), fs::read(&p).unwrap(), m)
        })
        .collect()
}

/// Everything the tests ask of one directory; returns the text output.
fn check_dir(dir: &Path, with_run: bool) -> String {
    let planted = if with_run { plant_run(dir) } else { vec![] };
    let before: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let out = doctor(dir, false);
    let t = output_text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    for c in CHECKS {
        let line = t
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(c))
            .unwrap_or_else(|| panic!("no {c} check:\n{t}"));
        assert!(line.starts_with("ok "), "{c} is not ok:\n{t}");
    }
    let ty = stat_type(dir);
    let shown = t
        .lines()
        .find_map(|l| l.strip_prefix("filesystem: "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no filesystem line:\n{t}"));
    if ty == "ext2/ext3" {
        assert!(
            shown.starts_with("ext"),
            "stat says {ty}, doctor {shown}:\n{t}"
        );
    } else {
        assert_eq!(shown, ty, "{t}");
    }
    let toml_text: String = t
        .lines()
        .skip_while(|l| *l != "[timing]")
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let v: toml::Table = toml::from_str(&toml_text).unwrap_or_else(|e| panic!("{e}:\n{t}"));
    let timing = v["timing"].as_table().unwrap();
    for k in ["poll-interval", "dead-after", "fs-timeout"] {
        let s = timing[k].as_str().unwrap();
        humantime::parse_duration(s).unwrap_or_else(|e| panic!("{k} = {s}: {e}"));
    }
    assert!(t.contains("not measured by a single node"), "{t}");
    // Nothing left behind, and a run's files untouched.
    let doctor_dir = dir.join(".rl-node/doctor");
    assert!(
        !doctor_dir.exists() || fs::read_dir(&doctor_dir).unwrap().next().is_none(),
        "left under {}",
        doctor_dir.display()
    );
    let after: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(before, after, "{t}");
    for (p, bytes, mtime) in planted {
        assert_eq!(fs::read(&p).unwrap(), bytes, "{}", p.display());
        assert_eq!(fs::metadata(&p).unwrap().modified().unwrap(), mtime);
    }
    t
}

#[test]
fn local_disk_passes_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let t = check_dir(tmp.path(), false);
    assert!(!tmp.path().join(".rl-node").exists(), "{t}");
    // The [timing] block is a configuration rl-node itself accepts.
    let block: String = t
        .lines()
        .skip_while(|l| *l != "[timing]")
        .take_while(|l| !l.is_empty())
        .map(|l| format!("{l}\n"))
        .collect();
    let config = tempfile::tempdir().unwrap();
    let file = config.path().join("rl-node.toml");
    fs::write(&file, &block).unwrap();
    let out = Command::new(BIN)
        .args(["show-config", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{block}\n{}", output_text(&out));
}

#[test]
fn a_runs_files_are_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    check_dir(tmp.path(), true);
}

#[test]
fn tmpfs_passes_and_is_named_tmpfs() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("SKIP: no /dev/shm");
        return;
    }
    let tmp = tempfile::tempdir_in(shm).unwrap();
    let t = check_dir(tmp.path(), false);
    assert!(t.contains("filesystem: tmpfs"), "{t}");
}

#[test]
fn json_has_one_entry_per_check() {
    let tmp = tempfile::tempdir().unwrap();
    let out = doctor(tmp.path(), true);
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, CHECKS);
    for c in v["checks"].as_array().unwrap() {
        assert_eq!(c["verdict"], "ok", "{c}");
        assert!(!c["evidence"].as_str().unwrap().is_empty());
    }
    assert!(v["timing"]["dead-after"].is_string());
    assert!(v["filesystem"]["fs_type"].is_string());
    assert!(!tmp.path().join(".rl-node").exists());
}

#[test]
fn a_missing_directory_is_a_usage_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-dir");
    let out = doctor(&missing, false);
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    assert!(
        output_text(&out).contains(&missing.display().to_string()),
        "{}",
        output_text(&out)
    );
    assert!(!missing.exists());
}

/// A session timeout beyond any deadline the clock can hold (it used to panic adding it
/// to now, after the session directory was created) is refused before anything is written.
#[test]
fn an_absurd_session_timeout_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["doctor", "--log-path"])
        .arg(tmp.path())
        .args([
            "--nodes",
            "2",
            "--rank",
            "0",
            "--timeout",
            "400000000000years",
        ])
        .env_remove("RL_NODE_CLUSTER_LOG_PATH")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    assert!(
        output_text(&out)
            .contains("--timeout 400000000000years is out of range: more than 0 and at most 1year"),
        "{}",
        output_text(&out)
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn sshfs_mount_is_named_with_its_cache_options() {
    let test = "sshfs_mount_is_named_with_its_cache_options";
    if !sshfs::require(test) {
        return;
    }
    let c = SshfsCluster::start(1, 5).unwrap_or_else(|e| panic!("{test}: start: {e}"));
    let out = doctor(c.mount(0), true);
    let t = output_text(&out);
    // Timing is not judged here (a loopback ssh is no server); the options are.
    assert!(matches!(out.status.code(), Some(0 | 1)), "{t}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["filesystem"]["fs_type"], "fuse.sshfs", "{t}");
    assert_eq!(v["caches"]["negative_secs"].as_f64(), Some(5.0), "{t}");
    assert_eq!(v["caches"]["attribute_secs"].as_f64(), Some(5.0), "{t}");
    // sshfs is not given an entry_timeout here: unknown, and said so, not taken for 0 s.
    assert!(v["caches"]["entry_secs"].is_null(), "{t}");
    let stale = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "stale-rename")
        .unwrap();
    assert_eq!(stale["verdict"], "warn", "{t}");
    assert!(
        stale["evidence"]
            .as_str()
            .unwrap()
            .starts_with("entry cache unknown (entry_timeout not shown)"),
        "{t}"
    );
    assert!(
        stale["advice"]
            .as_str()
            .unwrap()
            .contains("entry_timeout=0"),
        "{t}"
    );
    assert!(
        v["timing"]["rule"]
            .as_str()
            .unwrap()
            .contains("unknown: entry cache, not counted"),
        "{t}"
    );
    let mount = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "mount")
        .unwrap();
    let ev = mount["evidence"].as_str().unwrap();
    assert!(
        ev.contains("negative_timeout=5") && ev.contains("cache_timeout=5"),
        "{ev}"
    );
    assert_eq!(
        mount["verdict"], "warn",
        "a 5 s negative cache is worth a warning: {t}"
    );
    assert!(
        !c.export().join(".rl-node").exists(),
        "left behind on the server: {t}"
    );
}

// ---- Several nodes at once (`--nodes N`): one doctor process per node. ----

/// Generous: a loaded CI machine, and sshfs samples that each wait out a negative cache.
const SESSION_LIMIT: Duration = Duration::from_secs(180);

/// Every file and directory under `dir` except `.rl-node/doctor/`, with content and mtime:
/// what a run owns, which doctor must not touch.
fn tree(dir: &Path) -> Vec<(PathBuf, Option<Vec<u8>>, SystemTime)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().to_path_buf();
            if rel == Path::new(".rl-node/doctor") {
                continue;
            }
            let m = fs::metadata(&p).unwrap();
            if m.is_dir() {
                todo.push(p.clone());
                // `.rl-node/` gains and loses `doctor/`: its mtime moves, its content not.
                let mtime = if rel == Path::new(".rl-node") {
                    SystemTime::UNIX_EPOCH
                } else {
                    m.modified().unwrap()
                };
                out.push((rel, None, mtime));
            } else {
                out.push((rel, Some(fs::read(&p).unwrap()), m.modified().unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Runs doctors on `dirs` (one per node: the same directory, or one mount per node) with
/// `--nodes dirs.len() --json` and `args`; checks that every one finished with a report and
/// exit `codes`, that they found each other, that the run's files planted in `root` are
/// untouched and the session is gone; returns rank 0's JSON report.
fn session(root: &Path, dirs: &[&Path], args: &[&str], codes: &[i32]) -> serde_json::Value {
    session_outputs(root, dirs, args, codes).0
}

/// `session`, also returning every doctor's stderr (its progress lines), by rank.
fn session_outputs(
    root: &Path,
    dirs: &[&Path],
    args: &[&str],
    codes: &[i32],
) -> (serde_json::Value, Vec<String>) {
    plant_run(root);
    let before = tree(root);
    let n = dirs.len().to_string();
    let mut all = vec!["--nodes", &n, "--json"];
    all.extend_from_slice(args);
    let children: Vec<Child> = dirs.iter().map(|d| doctor::spawn(&[], d, &all)).collect();
    let pids: Vec<u64> = children.iter().map(|c| u64::from(c.id())).collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| finish_within(c, SESSION_LIMIT))
        .collect();
    let mut rank0 = None;
    let mut ranks = Vec::new();
    let mut stderrs = vec![String::new(); dirs.len()];
    for o in &outs {
        let t = output_text(o);
        assert!(
            o.status.code().is_some_and(|c| codes.contains(&c)),
            "exit {:?}:\n{t}",
            o.status
        );
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}:\n{t}"));
        let s = &v["session"];
        ranks.push(s["rank"].as_u64().unwrap());
        stderrs[s["rank"].as_u64().unwrap() as usize] = String::from_utf8_lossy(&o.stderr).into();
        assert_eq!(s["nodes"].as_u64(), Some(dirs.len() as u64), "{t}");
        if s["rank"] == 0 {
            rank0 = Some(v.clone());
        } else {
            assert!(
                s["reported_by"].as_str().unwrap().starts_with("rank 0 ("),
                "{t}"
            );
            assert!(s["pairs"].as_array().unwrap().is_empty(), "{t}");
        }
    }
    ranks.sort();
    assert_eq!(ranks, (0..dirs.len() as u64).collect::<Vec<_>>());
    let v = rank0.expect("a rank 0");
    // Rank 0 reports exactly these processes: no other session's.
    let mut members: Vec<u64> = v["session"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["pid"].as_u64().unwrap())
        .collect();
    members.sort();
    let mut want = pids.clone();
    want.sort();
    assert_eq!(members, want, "{v:#}");
    let pairs = v["session"]["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), dirs.len() * (dirs.len() - 1), "{v:#}");
    assert_eq!(before, tree(root), "the run's files changed");
    (v, stderrs)
}

/// Whether the session holds a new name ending in `suffix` (`-W-O-K`).
fn new_name_exists(session: &Path, suffix: &str) -> bool {
    fs::read_dir(session).is_ok_and(|d| {
        d.flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("new-") && n.ends_with(suffix)
        })
    })
}

fn pair(v: &serde_json::Value, w: u64, o: u64) -> &serde_json::Value {
    v["session"]["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["writer"] == w && p["observer"] == o)
        .unwrap_or_else(|| panic!("no pair {w} → {o}: {v:#}"))
}

fn median(p: &serde_json::Value, what: &str) -> f64 {
    assert_eq!(p[what]["samples"], 3, "{what}: {p:#}");
    p[what]["median_ms"].as_f64().unwrap()
}

/// Two processes on one host's directory: every change is seen within a few polls, and
/// the two clocks are one.
fn two_local_processes(dir: &Path) {
    let v = session(dir, &[dir, dir], &["--session", "local"], &[0]);
    for (w, o) in [(0, 1), (1, 0)] {
        let p = pair(&v, w, o);
        for what in ["rewrite", "new_name", "new_name_after_miss", "round_trip"] {
            let m = median(p, what);
            assert!(m < 250.0, "{what} {w} → {o}: {m} ms\n{v:#}");
        }
    }
    let off = &v["session"]["clock_offsets"][0];
    assert!(
        off["offset_ms"].as_f64().unwrap().abs() < 50.0,
        "one host, one clock: {off}"
    );
    for c in ["nodes", "cross-rewrite", "cross-new-name", "clock-offset"] {
        assert_eq!(check(&v, c)["verdict"], "ok", "{v:#}");
    }
    assert!(v.get("not_measured").is_none(), "{v:#}");
    assert!(!dir.join(".rl-node/doctor").exists(), "session left behind");
}

#[test]
fn two_processes_on_local_disk_see_each_other_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    two_local_processes(tmp.path());
}

#[test]
fn two_processes_on_tmpfs_see_each_other_at_once() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("SKIP: no /dev/shm");
        return;
    }
    let tmp = tempfile::tempdir_in(shm).unwrap();
    two_local_processes(tmp.path());
}

#[test]
fn two_sshfs_clients_measure_the_negative_cache() {
    let test = "two_sshfs_clients_measure_the_negative_cache";
    if !sshfs::require(test) {
        return;
    }
    // Two clients with negative_timeout=2 (and cache_timeout=2, attr_timeout=0).
    let c = SshfsCluster::start(2, 2).unwrap_or_else(|e| panic!("{test}: start: {e}"));
    // rename-over may fail on one sshfs client (see the single-node test): exit 0 or 1.
    let start = Instant::now();
    let (v, stderrs) = session_outputs(
        c.export(),
        &[c.mount(0), c.mount(1)],
        &["--session", "sshfs", "--timeout", "60s"],
        &[0, 1],
    );
    let took = start.elapsed();
    for (w, o) in [(0, 1), (1, 0)] {
        let p = pair(&v, w, o);
        let new = median(p, "new_name");
        assert!(
            (1000.0..=4000.0).contains(&new),
            "a new name {w} → {o} after a miss should take about negative_timeout=2s: {new} ms\n{v:#}"
        );
        let miss = median(p, "new_name_after_miss");
        assert!((1000.0..=4000.0).contains(&miss), "{miss} ms\n{v:#}");
        let rewrite = median(p, "rewrite");
        assert!(
            rewrite < new / 2.0,
            "a rewrite is no new name: {rewrite} ms\n{v:#}"
        );
    }
    let off = &v["session"]["clock_offsets"][0];
    assert!(
        off["offset_ms"].as_f64().unwrap().abs() < 200.0,
        "one host, one clock: {off}"
    );
    assert_eq!(check(&v, "cross-new-name")["verdict"], "warn", "{v:#}");
    // Two clients with the same options, at different mount points: alike.
    let nodes = check(&v, "nodes")["evidence"].as_str().unwrap();
    assert!(nodes.contains("all 2 nodes mount it alike"), "{nodes}");
    assert!(
        v["timing"]["rule"]
            .as_str()
            .unwrap()
            .contains("measured between nodes"),
        "{v:#}"
    );
    assert!(!c.export().join(".rl-node/doctor").exists());
    // The 3 new names of a pair are taken at once: each pair waits out the 2 s negative
    // cache once, not 3 times (2 pairs: about 4 s of the session, not 12).
    assert!(
        took < Duration::from_secs(10),
        "the session took {took:?}\n{v:#}"
    );
    // Progress on stderr (stdout held the JSON, parsed above): the plan, every sample
    // of each rank's pairs, and rank 0's estimate of the rest after its first pair.
    for (rank, err) in stderrs.iter().enumerate() {
        assert!(
            err.contains("doctor session sshfs: 2 nodes, 3 samples per ordered pair, 2 rounds"),
            "rank {rank}:\n{err}"
        );
        for (w, o) in [(0, 1), (1, 0)] {
            let round = format!("round {}/2: rank {w} → rank {o}", w + 1);
            let lines = |what: &str| {
                err.lines()
                    .filter(|l| l.contains(&round) && l.contains(what))
                    .count()
            };
            if w == rank {
                assert_eq!(lines(": rewrite "), 3, "rank {rank}:\n{err}");
                assert!(
                    err.contains(&format!("{round}: rewrite 3/3: seen and answered after ")),
                    "rank {rank}:\n{err}"
                );
                assert_eq!(
                    lines("found all 3 new names after "),
                    1,
                    "rank {rank}:\n{err}"
                );
            } else {
                assert_eq!(lines(": new name "), 3, "rank {rank}:\n{err}");
                assert!(
                    err.contains(&format!("{round}: new name 3/3 seen ")),
                    "rank {rank}:\n{err}"
                );
            }
        }
    }
    let est = stderrs[0]
        .lines()
        .find(|l| l.contains("a new name takes about "))
        .unwrap_or_else(|| panic!("no estimate:\n{}", stderrs[0]));
    assert!(
        est.contains("to be seen by rank 1 (negative-lookup cache)")
            && est.contains("the session will take about ")
            && est.contains("(1 of 2 rounds left)"),
        "{est}"
    );
    assert!(
        !stderrs[1].contains("a new name takes about "),
        "only rank 0 estimates: {}",
        stderrs[1]
    );
}

/// A long wait is never silent: a doctor waiting for its peer to join says so on stderr
/// every 10 s, and the session goes on once the peer arrives.
#[test]
fn a_long_wait_is_said_on_stderr() {
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let args = [
        "--nodes",
        "2",
        "--session",
        "late",
        "--timeout",
        "60s",
        "--json",
    ];
    let mut a = doctor::spawn(&[], dir, &args);
    let (tx, rx) = std::sync::mpsc::channel();
    let err = a.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(err).lines() {
            let line = line.unwrap();
            all.push_str(&line);
            all.push('\n');
            let _ = tx.send(line);
        }
        all
    });
    let note = "doctor session late: waiting for rank 1 to join (";
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.starts_with(note) => {
                assert!(l.contains(" so far, --timeout 1m)"), "{l}");
                break;
            }
            Ok(_) => {}
            Err(e) => panic!("no `{note}` line ({e})"),
        }
    }
    let b = doctor::spawn(&[], dir, &args);
    for (c, name) in [(a, "rank 0"), (b, "rank 1")] {
        let o = finish_within(c, SESSION_LIMIT);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", output_text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["session"]["nodes"], 2);
    }
    let err = reader.join().unwrap();
    assert!(
        err.contains(
            "doctor session late: 2 nodes, 3 samples per ordered pair, 2 rounds; this is rank 0"
        ),
        "{err}"
    );
}

#[test]
fn a_rank_that_never_arrives_is_named_at_the_join_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let args = ["--nodes", "3", "--session", "short", "--timeout", "3s"];
    let a = doctor::spawn(&[], dir, &args);
    let b = doctor::spawn(&[], dir, &args);
    for o in [
        finish_within(a, SESSION_LIMIT),
        finish_within(b, SESSION_LIMIT),
    ] {
        let t = output_text(&o);
        assert_eq!(o.status.code(), Some(4), "{t}");
        assert!(
            t.contains("doctor session short: rank 2 never joined within 3s"),
            "{t}"
        );
    }
    assert!(!dir.join(".rl-node").exists(), "left behind");
}

#[test]
fn two_sessions_in_one_directory_do_not_mix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    plant_run(dir);
    let before = tree(dir);
    let spawn = |s: &str| -> Vec<Child> {
        (0..2)
            .map(|_| doctor::spawn(&[], dir, &["--nodes", "2", "--json", "--session", s]))
            .collect()
    };
    let (a, b) = (spawn("a"), spawn("b"));
    for (name, group) in [("a", a), ("b", b)] {
        let mut pids: Vec<u64> = group.iter().map(|c| u64::from(c.id())).collect();
        pids.sort();
        let mut members = None;
        for c in group {
            let o = finish_within(c, SESSION_LIMIT);
            assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["session"]["session"], name);
            if v["session"]["rank"] == 0 {
                let mut m: Vec<u64> = v["session"]["members"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["pid"].as_u64().unwrap())
                    .collect();
                m.sort();
                members = Some(m);
            }
        }
        assert_eq!(members, Some(pids), "session {name}");
    }
    assert_eq!(before, tree(dir));
    assert!(!dir.join(".rl-node/doctor").exists());
}

#[test]
fn a_claimed_rank_is_refused_naming_its_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let first = doctor::spawn(
        &[],
        dir,
        &[
            "--nodes",
            "2",
            "--rank",
            "0",
            "--session",
            "c",
            "--timeout",
            "60s",
        ],
    );
    let claim = dir.join(".rl-node/doctor/c/rank-0.json");
    let deadline = Instant::now() + SESSION_LIMIT;
    while !fs::read_to_string(&claim).is_ok_and(|s| s.contains("\"pid\"")) {
        assert!(Instant::now() < deadline, "no claim of rank 0");
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = finish_within(
        doctor::spawn(&[], dir, &["--nodes", "2", "--rank", "0", "--session", "c"]),
        SESSION_LIMIT,
    );
    let t = output_text(&second);
    assert_eq!(second.status.code(), Some(2), "{t}");
    assert!(
        t.contains("--rank 0 of doctor session c is already claimed")
            && t.contains(&format!("pid {}", first.id())),
        "{t}"
    );
    // The first one is not disturbed: its claim stays, its partner arrives, both finish.
    let held: serde_json::Value = serde_json::from_slice(&fs::read(&claim).unwrap()).unwrap();
    assert_eq!(held["pid"].as_u64(), Some(u64::from(first.id())));
    let partner = doctor::spawn(&[], dir, &["--nodes", "2", "--rank", "1", "--session", "c"]);
    for o in [
        finish_within(first, SESSION_LIMIT),
        finish_within(partner, SESSION_LIMIT),
    ] {
        assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    }
    assert!(!dir.join(".rl-node").exists());
}

/// Two doctors of session `name` (with `--timeout timeout`) on a pair of sshfs clients
/// whose 2 s negative cache keeps the session going for seconds, once their measurements
/// have started: the cluster, the session directory, rank 0's doctor and rank 1's.
fn midway(test: &str, name: &str, timeout: &str) -> (SshfsCluster, PathBuf, Child, Child) {
    let c = SshfsCluster::start(2, 2).unwrap_or_else(|e| panic!("{test}: start: {e}"));
    let args = ["--nodes", "2", "--session", name, "--timeout", timeout];
    let mut kids = vec![
        doctor::spawn(&[], c.mount(0), &args),
        doctor::spawn(&[], c.mount(1), &args),
    ];
    let session = c.export().join(format!(".rl-node/doctor/{name}"));
    let deadline = Instant::now() + SESSION_LIMIT;
    while !new_name_exists(&session, "-0-1-0") {
        if let Some(i) = kids
            .iter_mut()
            .position(|k| k.try_wait().unwrap().is_some())
        {
            let o = kids.remove(i).wait_with_output().unwrap();
            panic!(
                "a doctor ended before the measurements started:\n{}",
                output_text(&o)
            );
        }
        assert!(Instant::now() < deadline, "the measurements never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let rank1: serde_json::Value =
        serde_json::from_slice(&fs::read(session.join("rank-1.json")).unwrap()).unwrap();
    let pid = rank1["pid"].as_u64().unwrap() as u32;
    let i = kids.iter().position(|k| k.id() == pid).unwrap();
    let rank1 = kids.remove(i);
    (c, session, kids.remove(0), rank1)
}

#[test]
fn a_rank_killed_midway_stops_the_others_at_the_deadline() {
    let test = "a_rank_killed_midway_stops_the_others_at_the_deadline";
    if !sshfs::require(test) {
        return;
    }
    let (_c, session, rank0, mut killed) = midway(test, "k", "5s");
    let pid = killed.id();
    killed.kill().unwrap();
    killed.wait().unwrap();
    let start = Instant::now();
    let o = finish_within(rank0, SESSION_LIMIT);
    let t = output_text(&o);
    assert_eq!(o.status.code(), Some(4), "{t}");
    assert!(
        t.contains("rank 1 (") && t.contains(&format!("pid {pid}) made no progress for 5s")),
        "{t}"
    );
    assert!(start.elapsed() < Duration::from_secs(60), "{t}");
    assert!(!session.exists(), "rank 0 removes the session: {t}");
}

/// A rank's position in its file: `[stage, pair, sample, step]` (stage 2 = done).
fn position(session: &Path, rank: u32) -> Option<Vec<u64>> {
    let b = fs::read(session.join(format!("rank-{rank}.json"))).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&b).ok()?;
    v["pos"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap()).collect())
}

/// Rank 0 done and collecting results while ranks 2 and 3 still measure the last round:
/// rank 3 is interrupted, rank 2 stops because of it, and rank 0, waiting for rank 2's
/// results, is told why (exit 3) instead of finding rank 2's file gone and waiting out
/// --timeout (exit 4): a failing rank keeps its file (up to its 5 s grace) while rank 0
/// is at DONE.
#[test]
fn rank_0_collecting_results_is_told_of_an_abort_in_the_last_round() {
    let test = "rank_0_collecting_results_is_told_of_an_abort_in_the_last_round";
    if !sshfs::require(test) {
        return;
    }
    // A new name waits out a 2 s negative cache: each pair's last step takes seconds.
    let c = SshfsCluster::start(4, 2).unwrap_or_else(|e| panic!("{test}: start: {e}"));
    let kids: Vec<Child> = (0..4)
        .map(|r| {
            let r = r.to_string();
            let args = [
                "--nodes",
                "4",
                "--session",
                "l",
                "--timeout",
                "60s",
                "--rank",
                &r,
            ];
            doctor::spawn(&[], c.mount(r.parse().unwrap()), &args)
        })
        .collect();
    let session = c.export().join(".rl-node/doctor/l");
    // 12 ordered pairs, two at a time: the last round is pairs 10 and 11, (1, 0) and (3, 2).
    let deadline = Instant::now() + SESSION_LIMIT;
    while !position(&session, 3).is_some_and(|p| p[0] == 1 && p[1] >= 10) {
        assert!(
            Instant::now() < deadline,
            "rank 3 never reached the last round"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid3 = kids[3].id() as i32;
    common::kill(pid3, libc::SIGSTOP).unwrap();
    let p3 = position(&session, 3).unwrap();
    assert_eq!(p3[0], 1, "rank 3 finished before it was stopped: {p3:?}");
    while position(&session, 0).is_none_or(|p| p[0] != 2) {
        assert!(Instant::now() < deadline, "rank 0 never got done");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Rank 0 is held while rank 2 stops, so that it reads rank 2's file only after rank 2
    // has left or is waiting for it to read the abort: never by chance in between.
    let pid0 = kids[0].id() as i32;
    common::kill(pid0, libc::SIGSTOP).unwrap();
    common::kill(pid3, libc::SIGINT).unwrap();
    common::kill(pid3, libc::SIGCONT).unwrap();
    while position(&session, 2).is_some_and(|p| p[0] != 3) {
        assert!(Instant::now() < deadline, "rank 2 never stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    common::kill(pid0, libc::SIGCONT).unwrap();
    let start = Instant::now();
    let mut kids = kids.into_iter();
    let rank0 = kids.next().unwrap();
    let o = finish_within(rank0, SESSION_LIMIT);
    let t = output_text(&o);
    assert_eq!(o.status.code(), Some(3), "{t}");
    assert!(
        t.contains("rank 2 (") && t.contains("stopped: doctor session l: rank 3 ("),
        "{t}"
    );
    // Well before the 60 s timeout: the abort, not the deadline, stopped rank 0.
    assert!(start.elapsed() < Duration::from_secs(30), "{t}");
    for k in kids {
        finish_within(k, SESSION_LIMIT);
    }
    assert!(!session.exists(), "{t}");
}

#[test]
fn doctors_of_one_slurm_job_meet_in_its_session() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let spawn = |job: &str| {
        doctor::command(&[], dir, &["--nodes", "2", "--json"])
            .env("SLURM_JOB_ID", job)
            .spawn()
            .unwrap()
    };
    // Two jobs sharing the directory, two nodes each: each job's pair meets.
    let kids = [spawn("77"), spawn("78"), spawn("77"), spawn("78")];
    for (i, k) in kids.into_iter().enumerate() {
        let o = finish_within(k, SESSION_LIMIT);
        assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let want = if i % 2 == 0 { "slurm-77" } else { "slurm-78" };
        assert_eq!(v["session"]["session"], want, "{v:#}");
    }
    // Both sessions are gone. `.rl-node/` itself is removed only by a session that made
    // it, and only if it is empty: when the other job's session finishes last, the empty
    // directory stays (an empty `.rl-node/` may be a run's that is starting).
    assert!(!dir.join(".rl-node/doctor").exists());
    if dir.join(".rl-node").exists() {
        assert_eq!(fs::read_dir(dir.join(".rl-node")).unwrap().count(), 0);
    }
}

#[test]
fn session_flags_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    for (args, want) in [
        (
            &["--nodes", "2", "--rank", "2"][..],
            "--rank 2 is out of range for --nodes 2",
        ),
        (
            &["--rank", "1"][..],
            "--rank 1 needs --nodes N of 2 or more",
        ),
        (
            &["--nodes", "2", "--session", "../x"][..],
            "--session \"../x\" is not a plain name",
        ),
        (&["--nodes", "0"][..], "--nodes must be 1 or more"),
        // Session flags without a session are refused, not silently ignored.
        (
            &["--session", "../x", "--samples", "0", "--timeout", "0s"][..],
            "--session ../x needs --nodes N of 2 or more",
        ),
        (
            &["--samples", "0"][..],
            "--samples 0 needs --nodes N of 2 or more",
        ),
        (
            &["--nodes", "1", "--timeout", "5s"][..],
            "--timeout 5s needs --nodes N of 2 or more",
        ),
        // Refused before anything is created, not an abort on a huge allocation.
        (
            &["--nodes", "4000000000"][..],
            "--nodes 4000000000 is out of range (1..10000)",
        ),
        (
            &["--nodes", "10001", "--rank", "0"][..],
            "--nodes 10001 is out of range (1..10000)",
        ),
    ] {
        let o = finish_within(doctor::spawn(&[], tmp.path(), args), SESSION_LIMIT);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", output_text(&o));
        assert!(
            output_text(&o).contains(want),
            "{args:?}: {}",
            output_text(&o)
        );
    }
    assert!(!tmp.path().join(".rl-node").exists());
}

#[test]
fn doctors_started_with_different_node_counts_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let a = doctor::spawn(
        &[],
        dir,
        &["--nodes", "2", "--session", "m", "--timeout", "60s"],
    );
    let b = doctor::spawn(
        &[],
        dir,
        &["--nodes", "3", "--session", "m", "--timeout", "60s"],
    );
    for o in [
        finish_within(a, SESSION_LIMIT),
        finish_within(b, SESSION_LIMIT),
    ] {
        let t = output_text(&o);
        assert_eq!(o.status.code(), Some(2), "{t}");
        assert!(
            t.contains("was started with --nodes 3, this one with --nodes 2")
                || t.contains("was started with --nodes 2, this one with --nodes 3"),
            "{t}"
        );
    }
    assert!(!dir.join(".rl-node").exists());
}

#[test]
fn an_interrupted_rank_tells_the_others_and_leaves_nothing() {
    let test = "an_interrupted_rank_tells_the_others_and_leaves_nothing";
    if !sshfs::require(test) {
        return;
    }
    let (_c, session, rank0, interrupted) = midway(test, "i", "60s");
    let t = interrupt_rank_1(rank0, interrupted, "i");
    assert!(!session.exists(), "{t}");
}

/// SIGINT to rank 1's doctor of session `name` (its peer `rank0` runs with a 60 s
/// `--timeout`): rank 1 exits 130 saying so, and rank 0 exits 3 with rank 1's reason,
/// well before its timeout. Rank 0's output.
fn interrupt_rank_1(rank0: Child, rank1: Child, name: &str) -> String {
    let pid = rank1.id();
    common::kill(pid as i32, libc::SIGINT).unwrap();
    let start = Instant::now();
    let o = finish_within(rank1, SESSION_LIMIT);
    let t = output_text(&o);
    assert_eq!(o.status.code(), Some(130), "{t}");
    assert!(
        t.contains(&format!(
            "doctor session {name}: rank 1 interrupted by SIGINT"
        )),
        "{t}"
    );
    let o = finish_within(rank0, SESSION_LIMIT);
    let t = output_text(&o);
    assert_eq!(o.status.code(), Some(3), "{t}");
    assert!(
        t.contains(&format!(
            "pid {pid}) stopped: doctor session {name}: rank 1 interrupted by SIGINT"
        )),
        "{t}"
    );
    // Well before the 60 s timeout: the abort, not the deadline, stopped rank 0.
    assert!(start.elapsed() < Duration::from_secs(30), "{t}");
    t
}

/// A rank interrupted while the session waits for a rank still to join: the ranks already
/// joined see it at once (they re-read each other while waiting), not at the join timeout.
#[test]
fn a_rank_interrupted_during_the_join_is_seen_by_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let args = |r: &'static str| {
        [
            "--nodes",
            "3",
            "--session",
            "j",
            "--timeout",
            "60s",
            "--rank",
            r,
        ]
    };
    let rank0 = doctor::spawn(&[], dir, &args("0"));
    let rank1 = doctor::spawn(&[], dir, &args("1"));
    // Rank 2 never starts: both wait in the join once their claims exist.
    let session = dir.join(".rl-node/doctor/j");
    let deadline = Instant::now() + SESSION_LIMIT;
    while !(session.join("rank-0.json").exists() && session.join("rank-1.json").exists()) {
        assert!(Instant::now() < deadline, "the two ranks never claimed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = interrupt_rank_1(rank0, rank1, "j");
    assert!(!dir.join(".rl-node").exists(), "{t}");
}

/// A pair's clock starts only once both ranks have begun it. With three ranks the
/// round-robin order is (1, 2), (2, 1), (0, 2), …: rank 1 is held for 2 s right after it
/// claims its rank, so rank 2 is busy with its first two pairs that long while rank 0,
/// idle, begins (0, 2) at once. Rank 0's first rewrite sample to rank 2 must not count that
/// wait (it was taken for a 2 s rewrite, a `cross-rewrite` warning and a longer
/// dead-after).
#[test]
fn a_pairs_first_rewrite_does_not_count_the_observers_previous_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let kids: Vec<Child> = (0..3)
        .map(|r| {
            let r = r.to_string();
            doctor::spawn(
                &[],
                dir,
                &["--nodes", "3", "--session", "clock", "--json", "--rank", &r],
            )
        })
        .collect();
    let claim = dir.join(".rl-node/doctor/clock/rank-1.json");
    let deadline = Instant::now() + SESSION_LIMIT;
    while !claim.exists() {
        assert!(Instant::now() < deadline, "rank 1 never claimed");
        std::thread::sleep(Duration::from_millis(1));
    }
    let pid1 = kids[1].id() as i32;
    common::kill(pid1, libc::SIGSTOP).unwrap();
    // The stall under test (not a wait for a condition): rank 2 cannot finish its pairs
    // with rank 1 meanwhile.
    std::thread::sleep(Duration::from_secs(2));
    common::kill(pid1, libc::SIGCONT).unwrap();
    let outs: Vec<Output> = kids
        .into_iter()
        .map(|k| finish_within(k, SESSION_LIMIT))
        .collect();
    let o = &outs[0];
    assert_eq!(o.status.code(), Some(0), "{}", output_text(o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let p = pair(&v, 0, 2);
    let max = p["rewrite"]["max_ms"].as_f64().unwrap();
    assert!(
        max < 1000.0,
        "rank 0 → rank 2 rewrite at worst {max} ms:\n{v:#}"
    );
    assert_eq!(check(&v, "cross-rewrite")["verdict"], "ok", "{v:#}");
    assert_eq!(v["timing"]["dead-after"], "60s", "{v:#}");
    assert!(!dir.join(".rl-node").exists());
}

#[test]
fn three_nodes_measure_all_six_ordered_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let v = session(d, &[d, d, d], &["--session", "three"], &[0]);
    for w in 0..3 {
        for o in (0..3).filter(|o| *o != w) {
            let p = pair(&v, w, o);
            for what in ["rewrite", "new_name", "round_trip"] {
                assert!(median(p, what) < 250.0, "{what} {w} → {o}: {v:#}");
            }
        }
    }
    assert_eq!(v["session"]["clock_offsets"].as_array().unwrap().len(), 3);
    assert!(!d.join(".rl-node/doctor").exists());
}

#[test]
fn rank_0_stopping_stops_ranks_busy_with_each_other() {
    let test = "rank_0_stopping_stops_ranks_busy_with_each_other";
    if !sshfs::require(test) {
        return;
    }
    // Three clients: the round-robin order measures rank 1 ↔ rank 2 first, while rank 0
    // waits for rank 2. Rank 0 is interrupted then: ranks 1 and 2, who wait only for each
    // other, must stop at once all the same.
    let c = SshfsCluster::start(3, 2).unwrap_or_else(|e| panic!("{test}: start: {e}"));
    let args = ["--nodes", "3", "--session", "z", "--timeout", "60s"];
    let mut kids: Vec<Child> = (0..3)
        .map(|i| doctor::spawn(&[], c.mount(i), &args))
        .collect();
    let session = c.export().join(".rl-node/doctor/z");
    let deadline = Instant::now() + SESSION_LIMIT;
    while !new_name_exists(&session, "-1-2-0") {
        assert!(Instant::now() < deadline, "the measurements never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let rank0: serde_json::Value =
        serde_json::from_slice(&fs::read(session.join("rank-0.json")).unwrap()).unwrap();
    let pid = rank0["pid"].as_u64().unwrap() as u32;
    let i = kids.iter().position(|k| k.id() == pid).unwrap();
    let interrupted = kids.remove(i);
    common::kill(pid as i32, libc::SIGINT).unwrap();
    let start = Instant::now();
    let o = finish_within(interrupted, SESSION_LIMIT);
    assert_eq!(o.status.code(), Some(130), "{}", output_text(&o));
    for k in kids {
        let o = finish_within(k, SESSION_LIMIT);
        let t = output_text(&o);
        assert_eq!(o.status.code(), Some(3), "{t}");
        assert!(
            t.contains("doctor session z: rank 0 (")
                && (t.contains("interrupted by SIGINT") || t.contains("was removed")),
            "{t}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "not at --timeout"
    );
    assert!(!session.exists());
}
