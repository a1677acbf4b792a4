//! A small, real filesystem of its own for write-error tests: a size-limited tmpfs that a
//! test can fill (ENOSPC) or mount read-only (EROFS). Needs root (or CAP_SYS_ADMIN), which
//! `scripts/test` and CI have. Unmounted (lazily, so a stuck test never keeps it) on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct SmallFs {
    _dir: tempfile::TempDir,
    mount: PathBuf,
}

impl SmallFs {
    /// Mount a tmpfs of `size` (e.g. "8m") with `options` (e.g. "ro"; "" for none).
    /// `None` (after the CI rule of [`skip`]) when this process may not mount.
    pub fn mount(test: &str, size: &str, options: &str) -> Option<SmallFs> {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("fs");
        std::fs::create_dir(&mount).unwrap();
        let opts = if options.is_empty() {
            format!("size={size}")
        } else {
            format!("size={size},{options}")
        };
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &opts, "tmpfs"])
            .arg(&mount)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallFs { _dir: dir, mount }),
            Ok(o) => skip(test, &String::from_utf8_lossy(&o.stderr)),
            Err(e) => skip(test, &e.to_string()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// Remount with `options` (e.g. "ro").
    pub fn remount(&self, options: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(&self.mount)
            .status()
            .unwrap();
        assert!(
            st.success(),
            "remount {options} of {}",
            self.mount.display()
        );
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

/// Never skip silently under CI (the rule of `common::skip_unless_ci`).
fn skip(test: &str, why: &str) -> Option<SmallFs> {
    super::skip_unless_ci(
        test,
        &format!(
            "cannot mount a tmpfs ({}); run as root, as scripts/test does",
            why.trim()
        ),
    );
    None
}
