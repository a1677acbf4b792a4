//! Descendants that leave their command's process group.
//!
//! A command is stopped by signalling its process group, but a descendant can leave the
//! group (`setsid`, `setpgid`: daemons, launchers, some server stacks). So every command
//! gets `RL_NODE_OWNER=<node nonce>:<command id>` in its environment, which descendants
//! inherit into whatever group or session they move to.
//!
//! While the node lives, every descendant stays in its process tree: rl-node is a child
//! subreaper, so an orphan is re-parented to it, not to init. Walking the tree through
//! `/proc/<pid>/task/*/children` and reading each process's `/proc/<pid>/environ` says
//! whose it is: a process belongs to a command if it carries that command's marker, or if
//! it carries no marker of this node and its parent belongs to the command (a child that
//! cleared its environment while its parent still lived). After a `kill -9` of the node
//! the tree is gone (orphans go to init or another subreaper), so the guardian finds them
//! by the nonce alone, scanning `/proc/*/environ`.
//!
//! Limits: a process that clears its environment and is then orphaned after the node died
//! carries nothing to find it by; `environ` of a process of another user (setuid) is not
//! readable. Nothing here uses cgroups.
//!
//! Each process is pinned by a pidfd (Linux 5.3+) before it is examined, and signalled
//! through it, so a pid reused between the scan and the signal is never hit.

use super::OWNER_ENV;
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal};
use std::collections::{BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

/// A fresh nonce naming this node process in its children's environment: pid, start time
/// (clock ticks since boot) and random bits, so neither a restart nor a reused pid
/// repeats it. Contains no `:`.
pub fn new_nonce() -> String {
    let start = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_field(&s, 19).map(str::to_string))
        .unwrap_or_default();
    format!("{}-{start}-{}", std::process::id(), super::random_hex(6))
}

/// The marker of command `command` of the node with `nonce`.
pub fn marker(nonce: &str, command: u64) -> String {
    format!("{nonce}:{command}")
}

/// The `n`-th field (0 = state) after the command name in a `/proc/<pid>/stat` line.
pub(super) fn stat_field(stat: &str, n: usize) -> Option<&str> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(n)
}

/// A live process found by a scan, pinned by a pidfd where the kernel has them.
#[derive(Debug)]
pub struct Proc {
    pub pid: i32,
    id: Pid,
    fd: Option<OwnedFd>,
}

impl Proc {
    /// Pin `pid`; None if it is already gone (or names no process: 0, negative).
    pub(crate) fn open(pid: i32) -> Option<Proc> {
        let id = super::pid(pid)?;
        match rustix::process::pidfd_open(id, PidfdFlags::empty()) {
            Ok(fd) => Some(Proc {
                pid,
                id,
                fd: Some(fd),
            }),
            Err(Errno::SRCH) => None,
            // No pidfds (old kernel, seccomp): plain pids, with the reuse window.
            Err(_) => Some(Proc { pid, id, fd: None }),
        }
    }

    /// Has it exited (a zombie counts as exited)?
    fn exited(&self) -> bool {
        match &self.fd {
            Some(fd) => {
                // A pidfd is readable once its process has exited. A failed poll counts
                // as exited: nothing would ever say otherwise.
                let mut p = [PollFd::new(fd, PollFlags::IN)];
                !matches!(
                    rustix::event::poll(&mut p, Some(&Timespec::default())),
                    Ok(0)
                )
            }
            None => {
                let gone = rustix::process::test_kill_process(self.id).is_err();
                gone || std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
                    .ok()
                    .is_none_or(|s| stat_field(&s, 0) == Some("Z"))
            }
        }
    }

    /// Best effort: the process may be gone already.
    pub(crate) fn signal(&self, sig: Signal) {
        let _ = match &self.fd {
            Some(fd) => rustix::process::pidfd_send_signal(fd, sig),
            None => rustix::process::kill_process(self.id, sig),
        };
    }

    fn parent(&self) -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?;
        stat_field(&stat, 1)?.parse().ok()
    }
}

/// The value of `RL_NODE_OWNER` in a process's initial environment; None if it has none
/// or the environment cannot be read.
fn owner_of(pid: i32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let key = format!("{OWNER_ENV}=");
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(key.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Lists a process's children: from `/proc/<pid>/task/*/children`, or, on a kernel built
/// without them, from every process's parent in `/proc/*/stat`.
enum Children {
    Files,
    Map(HashMap<i32, Vec<i32>>),
}

impl Children {
    fn new() -> Children {
        let me = std::process::id();
        let tid = rustix::thread::gettid();
        if std::path::Path::new(&format!("/proc/{me}/task/{tid}/children")).exists() {
            return Children::Files;
        }
        let mut map: HashMap<i32, Vec<i32>> = HashMap::new();
        for pid in all_pids() {
            if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| stat_field(&s, 1).and_then(|p| p.parse().ok()))
            {
                map.entry(ppid).or_default().push(pid);
            }
        }
        Children::Map(map)
    }

    fn of(&self, pid: i32) -> Vec<i32> {
        match self {
            Children::Map(m) => m.get(&pid).cloned().unwrap_or_default(),
            Children::Files => {
                let mut out = Vec::new();
                let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                    return out;
                };
                for t in tasks.flatten() {
                    if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                        out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
                    }
                }
                out
            }
        }
    }
}

pub(super) fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// One live descendant of this process.
struct Member {
    proc: Proc,
    /// Index of the parent in the walk (None: a child of this process).
    parent: Option<usize>,
    /// The command of this node its environment names (None: no marker of this node).
    command: Option<u64>,
}

/// Every live descendant of process `root`, parents before children. With `environ`, each
/// one's marker is read (for this node's `nonce`); without, no process's memory is touched
/// (reading `environ` can block on a process stuck in a page fault).
fn tree(root: i32, nonce: &str, environ: bool) -> Vec<Member> {
    let children = Children::new();
    let prefix = format!("{nonce}:");
    let mut out: Vec<Member> = Vec::new();
    let mut queue: Vec<(i32, Option<usize>)> =
        children.of(root).into_iter().map(|c| (c, None)).collect();
    let mut next = 0;
    while next < queue.len() {
        let (pid, parent) = queue[next];
        next += 1;
        let Some(proc) = Proc::open(pid) else {
            continue;
        };
        // The pid may have been reused since its parent listed it.
        let parent_pid = parent.map_or(root, |i| out[i].proc.pid);
        if proc.parent() != Some(parent_pid) {
            continue;
        }
        let command = if environ {
            owner_of(pid).and_then(|v| v.strip_prefix(&prefix)?.parse().ok())
        } else {
            None
        };
        let kids = children.of(pid);
        // Still the process pinned above, so what was read is its own.
        if proc.exited() {
            continue;
        }
        let index = out.len();
        out.push(Member {
            proc,
            parent,
            command,
        });
        queue.extend(kids.into_iter().map(|c| (c, Some(index))));
    }
    out
}

/// Live descendants of this process that belong to command `command` of this node.
pub fn of_command(nonce: &str, command: u64) -> Vec<Proc> {
    let members = tree(std::process::id() as i32, nonce, true);
    let mut owned = vec![false; members.len()];
    for (i, m) in members.iter().enumerate() {
        owned[i] = match m.command {
            Some(c) => c == command,
            None => m.parent.is_some_and(|p| owned[p]),
        };
    }
    members
        .into_iter()
        .zip(owned)
        .filter_map(|(m, own)| own.then_some(m.proc))
        .collect()
}

/// Every live descendant of this process except `spare` (the guardian) and its own, then,
/// with `environ`, any other process that carries this node's nonce.
pub fn all(nonce: &str, spare: &[i32], environ: bool) -> Vec<Proc> {
    let mut out = under(std::process::id() as i32, spare);
    if environ {
        let known: BTreeSet<i32> = out.iter().map(|p| p.pid).collect();
        out.extend(
            with_nonce(nonce)
                .into_iter()
                .filter(|p| !known.contains(&p.pid) && !spare.contains(&p.pid)),
        );
    }
    out
}

/// Every live descendant of process `root` except `spare` and their own, found without
/// reading any process's memory (the guardian's look at its node's tree, while the node
/// may be stuck in the filesystem).
pub fn under(root: i32, spare: &[i32]) -> Vec<Proc> {
    let members = tree(root, "", false);
    let mut spared = vec![false; members.len()];
    for (i, m) in members.iter().enumerate() {
        spared[i] = spare.contains(&m.proc.pid) || m.parent.is_some_and(|p| spared[p]);
    }
    members
        .into_iter()
        .zip(spared)
        .filter_map(|(m, s)| (!s).then_some(m.proc))
        .collect()
}

/// Every live process of this user whose environment carries `nonce` (the guardian's
/// scan, after the node's tree is gone).
pub fn with_nonce(nonce: &str) -> Vec<Proc> {
    let me = std::process::id() as i32;
    let prefix = format!("{nonce}:");
    all_pids()
        .into_iter()
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let proc = Proc::open(pid)?;
            let ours = owner_of(pid).is_some_and(|v| v.starts_with(&prefix));
            (ours && !proc.exited()).then_some(proc)
        })
        .collect()
}

/// SIGTERM (with SIGCONT, for a stopped process) everything `find` returns, wait up to
/// `grace` for it to exit, SIGKILL the rest; then look again (something may have forked
/// meanwhile), a few rounds at most. Returns how many processes were signalled.
pub fn stop(mut find: impl FnMut() -> Vec<Proc>, grace: Duration) -> usize {
    let mut seen = BTreeSet::new();
    for _ in 0..4 {
        let procs = find();
        if procs.is_empty() {
            break;
        }
        seen.extend(procs.iter().map(|p| p.pid));
        for p in &procs {
            p.signal(Signal::TERM);
            p.signal(Signal::CONT);
        }
        if !wait_exited(&procs, grace) {
            for p in &procs {
                p.signal(Signal::KILL);
            }
            wait_exited(&procs, Duration::from_secs(5));
        }
    }
    seen.len()
}

/// SIGKILL every process of `procs`, without waiting.
pub fn kill(procs: Vec<Proc>) {
    for p in &procs {
        p.signal(Signal::KILL);
    }
}

fn wait_exited(procs: &[Proc], limit: Duration) -> bool {
    let start = Instant::now();
    let mut step = Duration::from_millis(1);
    while !procs.iter().all(Proc::exited) {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(step);
        step = (step * 2).min(Duration::from_millis(50));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_survive_spaces_and_parens_in_the_name() {
        let line = "42 (a) b (c)) S 7 42 42 0 -1";
        assert_eq!(stat_field(line, 0), Some("S"));
        assert_eq!(stat_field(line, 1), Some("7"));
        assert_eq!(stat_field(line, 3), Some("42"));
    }

    #[test]
    fn a_nonce_has_no_colon_and_differs_each_time() {
        let (a, b) = (new_nonce(), new_nonce());
        assert!(!a.contains(':'), "{a}");
        assert_ne!(a, b);
        assert_eq!(marker(&a, 3), format!("{a}:3"));
    }
}
