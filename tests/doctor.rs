//! `rl-node doctor` on real filesystems: local disk, tmpfs (/dev/shm) and, when the
//! substrate is there, an sshfs mount. It must pass on each, name the filesystem, print a
//! `[timing]` that parses, and leave nothing behind (least of all in a run's files).

mod common;

use common::cluster::BIN;
use common::sshfs::{self, SshfsCluster};
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

const CHECKS: [&str; 8] = [
    "mount",
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

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
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
    let t = text(&out);
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
    assert_eq!(out.status.code(), Some(0), "{block}\n{}", text(&out));
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
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
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
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains(&missing.display().to_string()),
        "{}",
        text(&out)
    );
    assert!(!missing.exists());
}

#[test]
fn sshfs_mount_is_named_with_its_cache_options() {
    let test = "sshfs_mount_is_named_with_its_cache_options";
    if !sshfs::require(test) {
        return;
    }
    let c = SshfsCluster::start(1, 5).unwrap_or_else(|e| panic!("{test}: start: {e}"));
    let out = doctor(c.mount(0), true);
    let t = text(&out);
    // Timing is not judged here (a loopback ssh is no server); the options are.
    assert!(matches!(out.status.code(), Some(0 | 1)), "{t}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["filesystem"]["fs_type"], "fuse.sshfs", "{t}");
    assert_eq!(v["caches"]["negative_secs"], 5, "{t}");
    assert_eq!(v["caches"]["attribute_secs"], 5, "{t}");
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
