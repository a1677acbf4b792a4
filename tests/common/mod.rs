#![allow(dead_code)]
pub mod cluster;
pub mod doctor;
pub mod elastic;
pub mod fuse;
pub mod moosefs;
pub mod mountns;
pub mod smallfs;
pub mod sshfs;
pub mod webgym;

use std::path::{Path, PathBuf};

/// A program's path: the first executable `prog` in `PATH`, then in the system's usual
/// directories (`sbin` ones included, which a non-root `PATH` may lack).
pub fn find_in_path(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(prog))
        .find(|p| is_executable(p))
}

pub fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The CI rule for a substrate (sshfs, MooseFS) in one call: true when nothing is
/// `missing`; otherwise [`skip_unless_ci`] and false (the caller returns early).
pub fn require_substrate(test: &str, substrate: &str, missing: Vec<String>) -> bool {
    if missing.is_empty() {
        return true;
    }
    skip_unless_ci(
        test,
        &format!(
            "{substrate} substrate unavailable (missing: {}); run scripts/test to install it",
            missing.join(", ")
        ),
    );
    false
}

/// For a test that cannot run here (`why`): panics if `CI` is set (`scripts/test` sets
/// it: a test never skips silently there), else prints a skip note naming `test`, and
/// the caller returns early.
pub fn skip_unless_ci(test: &str, why: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{test}: {why} (CI is set: refusing to skip)");
    }
    eprintln!("SKIP {test}: {why}");
}

/// A finished process's stdout then stderr, as text.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Waits for `c` to exit (killing it past `limit`, then panicking with what it printed)
/// and returns its output.
pub fn finish_within(
    mut c: std::process::Child,
    limit: std::time::Duration,
) -> std::process::Output {
    let deadline = std::time::Instant::now() + limit;
    while c.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            panic!("still running after {limit:?}:\n{}", output_text(&o));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    c.wait_with_output().unwrap()
}

/// Grow (or cut) the existing file `path` to `len` bytes. Sparse: a size over rl-node's
/// read limits that takes no disk.
pub fn set_file_len(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .set_len(len)
        .unwrap();
}

/// kill(2) without `unsafe`: send `sig` (a libc signal number) to process `pid`, or to
/// process group `-pid` when `pid` is negative. Err is the kernel's refusal (ESRCH: gone).
pub fn kill(pid: i32, sig: i32) -> std::io::Result<()> {
    use rustix::process::{kill_process, kill_process_group, Pid, Signal};
    let sig = Signal::from_named_raw(sig).unwrap_or_else(|| panic!("signal {sig} has no name"));
    let Some(target) = pid.checked_abs().and_then(Pid::from_raw) else {
        return Err(std::io::ErrorKind::InvalidInput.into());
    };
    Ok(if pid < 0 {
        kill_process_group(target, sig)
    } else {
        kill_process(target, sig)
    }?)
}
