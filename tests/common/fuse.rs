//! What the FUSE test substrates (`sshfs`, `moosefs`) share: a client mount whose daemon
//! runs in the foreground as our child (so we own its pid and reap it), how a mount is
//! recognised in `/proc/mounts`, the crash watchdog that cleans up after a test process
//! killed before its `Drop` ran, and the rule that a tempdir still holding a mount is
//! kept rather than removed through the network filesystem.

use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// How long to wait for one client mount to show up in /proc/mounts.
pub const MOUNT_DEADLINE: Duration = Duration::from_secs(20);
/// How long to wait for a daemon to exit after an unmount or a SIGTERM.
pub const EXIT_DEADLINE: Duration = Duration::from_secs(10);
pub const POLL_STEP: Duration = Duration::from_millis(25);

/// One client mount.
pub struct Mount {
    pub dir: PathBuf,
    /// The client daemon, started in the foreground (`-f`).
    pub child: Option<Child>,
}

impl Mount {
    /// Until `mounted(dir)` holds; an error naming `what` and the tail of its `log` if the
    /// client exits first or MOUNT_DEADLINE passes.
    pub fn wait_mounted(
        &mut self,
        what: &str,
        log: &Path,
        mounted: impl Fn(&Path) -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + MOUNT_DEADLINE;
        while !mounted(&self.dir) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!("{what} exited ({status}): {}", read_tail(log, 40)));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{what} did not appear in /proc/mounts within {MOUNT_DEADLINE:?}: {}",
                    read_tail(log, 40)
                ));
            }
            std::thread::sleep(POLL_STEP);
        }
        Ok(())
    }

    /// Reaps the client (killed past EXIT_DEADLINE), after its unmount.
    pub fn reap(&mut self) {
        if let Some(mut child) = self.child.take() {
            reap(&mut child, EXIT_DEADLINE);
        }
    }
}

/// Waits up to `deadline` for `child` to exit, then kills it; reaped either way.
pub fn reap(child: &mut Child, deadline: Duration) {
    let until = Instant::now() + deadline;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) if Instant::now() >= until => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Ok(None) => std::thread::sleep(POLL_STEP),
        }
    }
}

/// What is mounted at `dir` now (the topmost mount): its source and filesystem type, as
/// `/proc/mounts` writes them (escaped: `mfs#…` appears as `mfs\043…`).
pub fn mounted_at(dir: &Path) -> Option<(String, String)> {
    let mounts = fs::read_to_string("/proc/mounts").ok()?;
    let want = escape_mount_path(&dir.to_string_lossy());
    mounts.lines().rev().find_map(|line| {
        let mut f = line.split(' ');
        let (src, target, fstype) = (f.next()?, f.next()?, f.next()?);
        (target == want).then(|| (src.to_string(), fstype.to_string()))
    })
}

/// /proc/mounts escapes space, tab, newline and backslash as octal.
fn escape_mount_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for c in p.chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

/// The crash watchdog of a substrate: a shell script that blocks reading its stdin, whose
/// write end only the test process holds. A "done" line ([`Watchdog::dismiss`]) means the
/// substrate's `Drop` cleaned up; EOF, that the test process died without it (e.g. killed
/// by nextest's timeout), and the script cleans up instead.
pub struct Watchdog {
    child: Child,
    stdin: ChildStdin,
}

impl Watchdog {
    /// Everything is cleaned up: tell the script so, and reap it.
    pub fn dismiss(mut self) {
        let _ = self.stdin.write_all(b"done\n");
        drop(self.stdin);
        let _ = self.child.wait();
    }
}

/// Starts `script` (`sh -c`, `$0` = `name`, then `args`) in its own process group, so a
/// kill of the test's process group (nextest's timeout) does not take it down too.
pub fn spawn_watchdog(script: &str, name: &str, args: &[&OsStr]) -> Result<Watchdog, String> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(name)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("spawn {name}: {e}"))?;
    let stdin = child.stdin.take().expect("piped stdin");
    Ok(Watchdog { child, stdin })
}

/// Removes the substrate's tempdir, unless a mount under it is `still_mounted`: removing
/// it would then delete through the network filesystem, so it is kept and named.
pub fn release_tmp(tmp: Option<tempfile::TempDir>, still_mounted: bool, label: &str) {
    let Some(tmp) = tmp else {
        return;
    };
    if still_mounted {
        let path = tmp.keep();
        eprintln!(
            "{label} substrate: a mount under {} could not be unmounted; leaving it",
            path.display()
        );
    } else {
        drop(tmp);
    }
}

/// Last `lines` lines of a (small) log file; empty if unreadable.
pub fn read_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(16 * 1024);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
