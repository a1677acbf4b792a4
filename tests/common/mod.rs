#![allow(dead_code)]
pub mod cluster;
pub mod moosefs;
pub mod mountns;
pub mod smallfs;
pub mod sshfs;

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
