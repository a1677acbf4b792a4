//! The portable binary of `scripts/build-static` runs where the C library is old or absent:
//! it is static and stripped, and it runs `--version` and a 1-node demo iteration in a root
//! that holds nothing but itself, a static shell and the kernel's `/dev/null` and `/proc`.
//!
//! The shell is there because every phase command of the demo is run with `sh -c`, as a
//! user's commands are: it is the user's, not rl-node's. busybox-static provides it
//! (scripts/test installs it). One test: building the release binary takes minutes, and
//! every check uses the same build (scripts/test builds it before the suite).

mod common;

use common::{finish_within, output_text};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `scripts/build-static`'s binary: the path on its last line of output.
fn build_static() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-static");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(out.status.success(), "scripts/build-static: {}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let bin = PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("scripts/build-static printed nothing"),
    );
    assert!(
        common::is_executable(&bin),
        "scripts/build-static's last line is not an executable: {stdout:?}"
    );
    bin
}

/// What `ldd` says of `path`.
fn ldd(path: &Path) -> String {
    let out = Command::new("ldd").arg(path).output().expect("ldd");
    output_text(&out)
}

fn is_static(path: &Path) -> bool {
    let said = ldd(path);
    said.contains("statically linked") || said.contains("not a dynamic executable")
}

/// An empty root in `dir`: `bin` as /rl-node, `shell` as /bin/sh, the null device and a
/// mount point for /proc. Nothing else: no C library, no loader, no /etc.
fn empty_root(dir: &Path, bin: &Path, shell: &Path) {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::create_dir_all(dir.join("dev")).unwrap();
    std::fs::create_dir_all(dir.join("proc")).unwrap();
    std::fs::copy(bin, dir.join("rl-node")).unwrap();
    std::fs::copy(shell, dir.join("bin/sh")).unwrap();
    use rustix::fs::{makedev, mknodat, FileType, Mode, CWD};
    let null = dir.join("dev/null");
    let mode = Mode::from_raw_mode(0o666);
    if let Err(e) = mknodat(CWD, &null, FileType::CharacterDevice, mode, makedev(1, 3)) {
        panic!(
            "mknod {}/dev/null (the test runs as root, as in CI): {}",
            dir.display(),
            std::io::Error::from(e)
        );
    }
}

/// Run `/rl-node args…` inside `root`: a mount and PID namespace with `root` as `/`, a
/// fresh /proc, and an environment of PATH=/bin alone.
fn in_root(root: &Path, args: &[&str], limit: Duration) -> std::process::Output {
    let child = Command::new("unshare")
        .args([
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc=/proc",
        ])
        .arg(format!("--root={}", root.display()))
        .arg("/rl-node")
        .args(args)
        .env_clear()
        .env("PATH", "/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare (util-linux)");
    finish_within(child, limit)
}

#[test]
fn static_binary_runs_in_an_empty_root() {
    let bin = build_static();

    // ldd tells the two apart: the normal build is dynamic, the portable one is not.
    let glibc = ldd(Path::new(common::cluster::BIN));
    assert!(
        glibc.contains("libc.so"),
        "ldd of the glibc build:\n{glibc}"
    );
    assert!(is_static(&bin), "ldd {}:\n{}", bin.display(), ldd(&bin));
    let sections = Command::new("readelf")
        .arg("--section-headers")
        .arg(&bin)
        .output();
    let sections = output_text(&sections.expect("readelf (binutils)"));
    assert!(
        sections.contains(".text") && !sections.contains(".symtab"),
        "{} is not stripped:\n{sections}",
        bin.display()
    );

    let shell =
        common::find_in_path("busybox").expect("busybox: scripts/test installs busybox-static");
    assert!(
        is_static(&shell),
        "{} is not static:\n{}",
        shell.display(),
        ldd(&shell)
    );
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    empty_root(&root, &bin, &shell);

    let version = in_root(&root, &["--version"], Duration::from_secs(60));
    assert!(
        version.status.success(),
        "--version:\n{}",
        output_text(&version)
    );
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        concat!("rl-node ", env!("CARGO_PKG_VERSION"))
    );

    let demo = in_root(
        &root,
        &["demo", "--nodes", "1", "--iterations", "1", "--dir", "/run"],
        Duration::from_secs(180),
    );
    assert!(demo.status.success(), "demo:\n{}", output_text(&demo));
    // What the iteration left: its merged trajectories and the checkpoint it handed off.
    let shared = root.join("run/shared");
    let train = std::fs::read_to_string(shared.join("rollouts/iter-0001/train.jsonl"))
        .unwrap_or_else(|e| panic!("train.jsonl: {e}\n{}", output_text(&demo)));
    assert!(
        train.lines().filter(|l| !l.trim().is_empty()).count() > 0,
        "empty train.jsonl"
    );
    let latest = std::fs::read_to_string(shared.join("models/LATEST"))
        .unwrap_or_else(|e| panic!("models/LATEST: {e}\n{}", output_text(&demo)));
    assert!(!latest.trim().is_empty(), "empty models/LATEST");
}
