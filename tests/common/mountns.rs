//! Nodes that each see the shared directory at a path of their own, and only there, as
//! nodes of a real cluster do when each mounts the share where it likes.
//!
//! Each node runs in a mount namespace of its own (`unshare -m`, which needs root). Inside
//! it a private tmpfs covers an empty host directory (`parent`), the node's mount point
//! (`parent/rank-R`) is made in that tmpfs, the shared directory is attached there
//! ([`attach`]), and the real directory is covered by another tmpfs. So rank R reaches the
//! share only as `parent/rank-R`, a path that exists in no other node's namespace: a path
//! one node hands another is wrong there, as it would be between machines. The mounts go
//! away with the namespace when the node's processes are gone; nothing is mounted on the
//! host.

use super::cluster::{NodeProc, TestCluster};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The one step that makes the shared directory appear at `at` inside a node's namespace:
/// a bind mount of the real directory. A substrate with a filesystem client per node (one
/// `mfsmount` per node on MooseFS) replaces this with its client mount.
pub fn attach(real: &Path, at: &Path) -> String {
    format!("mount --bind {} {}", quote(real), quote(at))
}

/// Panics (never skips) when mount namespaces cannot be made here.
pub fn require(test: &str) {
    let ok = Command::new("unshare")
        .args(["-m", "--propagation", "private", "true"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{test} needs `unshare -m` (util-linux, run as root) to give each node a mount namespace of its own"
    );
}

/// Per-node views of one shared directory.
pub struct PrivateViews {
    /// Empty on the host; in each node's namespace, a tmpfs holding its mount point.
    parent: tempfile::TempDir,
    /// The shared directory itself, hidden in every node's namespace.
    real: PathBuf,
    /// The shell that makes the share appear at a node's mount point ([`attach`] unless a
    /// filesystem client of each node's own replaces it).
    attach: Box<dyn Fn(&Path) -> String>,
}

impl PrivateViews {
    pub fn new(real: &Path) -> PrivateViews {
        let bind = real.to_path_buf();
        PrivateViews::with_client(real, move |at| attach(&bind, at))
    }

    /// Views whose node each mounts the share with a client of its own: `client(at)` is
    /// the shell that mounts it at `at` (e.g. one `mfsmount` per node). `real` is where
    /// the test itself sees the share (hidden from the nodes).
    pub fn with_client(real: &Path, client: impl Fn(&Path) -> String + 'static) -> PrivateViews {
        std::fs::create_dir_all(real).unwrap();
        PrivateViews {
            parent: tempfile::Builder::new()
                .prefix("rl-node-views-")
                .tempdir()
                .unwrap(),
            real: real.to_path_buf(),
            attach: Box::new(client),
        }
    }

    /// Where rank `rank` sees the shared directory (inside its own namespace only).
    pub fn at(&self, rank: u32) -> PathBuf {
        self.at_node(&format!("rank-{rank}"))
    }

    /// Where the node called `node` sees the shared directory.
    pub fn at_node(&self, node: &str) -> PathBuf {
        self.parent.path().join(node)
    }

    /// Start rank `rank` of `c` in a mount namespace of its own with `--log-path` its own
    /// view; `extra` is more shell run in the namespace before the node starts (e.g. to
    /// hide part of the share from this node).
    pub fn spawn(
        &self,
        c: &TestCluster,
        rank: u32,
        args: &[&str],
        env: &[(&str, String)],
        extra: &str,
    ) -> NodeProc {
        self.spawn_node(c, &format!("rank-{rank}"), rank, args, env, extra)
    }

    /// [`PrivateViews::spawn`] for a node called `node` (its view is
    /// [`PrivateViews::at_node`]), where one rank number is not enough to tell nodes apart
    /// (the two clusters of a pipelined run).
    pub fn spawn_node(
        &self,
        c: &TestCluster,
        node: &str,
        rank: u32,
        args: &[&str],
        env: &[(&str, String)],
        extra: &str,
    ) -> NodeProc {
        let at = self.at_node(node);
        let script = format!(
            "set -e\nmount -t tmpfs -o size=1m,mode=0755 rl-node-views {parent}\nmkdir {at}\n{attach}\nmount -t tmpfs -o size=1m,mode=0755 rl-node-hidden {real}\n{extra}\nexec \"$@\"\n",
            parent = quote(self.parent.path()),
            at = quote(&at),
            attach = (self.attach)(&at),
            real = quote(&self.real),
        );
        let launcher: Vec<String> = ["unshare", "-m", "--propagation", "private", "sh", "-c"]
            .iter()
            .map(|s| s.to_string())
            .chain([script, "sh".to_string()])
            .collect();
        let (mut cmd, stderr_path) = c.command_via(&launcher, rank, &at, args, env);
        NodeProc::from_child(rank, cmd.spawn().unwrap(), stderr_path)
    }
}

/// `p` as one shell word.
pub fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}
