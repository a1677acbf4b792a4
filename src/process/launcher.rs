//! How a node starts its commands, stops them and knows them: one trait, [`Launcher`],
//! with the real implementation ([`Processes`]: process groups, the node's reaper and the
//! [`Registry`]) and, with the `sim` feature, a fake for the simulator (`FakeLauncher` in
//! `process::fake`: scripted exits on a timer, no process at all).
//!
//! A started command's end reaches the node as every child's does, as
//! [`Event::Reaped`] on the node's event channel, so the node's one wait loop hears of
//! real and fake commands alike.

#[cfg(doc)]
use super::Event;
use super::{spawn_shell, spawn_worker, stop_group, Leftovers, Registry, WorkerPipes};
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Starts, stops and knows a node's commands (see the module's documentation).
pub trait Launcher: Send + Sync {
    /// Start `sh -c command` with `env` in a process group of its own, its output
    /// appended to `log` after a `header` line; its pid (the group's id). Its exit arrives
    /// as [`Event::Reaped`].
    fn start(
        &self,
        command: &str,
        env: &[(String, String)],
        log: &Path,
        header: &str,
    ) -> io::Result<i32>;

    /// Start `command` as [`Launcher::start`] does, as an item worker: items go to it on
    /// its standard input, its replies come back on its descriptor 3 (the node's ends of
    /// both pipes are returned).
    fn start_worker(
        &self,
        command: &str,
        env: &[(String, String)],
        log: &Path,
        header: &str,
    ) -> io::Result<(i32, WorkerPipes)> {
        let _ = (command, env, log, header);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this launcher starts no item workers",
        ))
    }

    /// The command `pid` ended or must end: stop what is left of it (SIGTERM, `grace`,
    /// SIGKILL) and forget it.
    fn stop(&self, pid: i32, grace: Duration) -> Leftovers;

    /// [`Launcher::stop`] for several commands at once: each gets `grace` from the same
    /// moment, so stopping N commands that ignore SIGTERM costs one `grace`, not N.
    fn stop_many(&self, pids: &[i32], grace: Duration) {
        for &pid in pids {
            self.stop(pid, grace);
        }
    }

    /// Whether `pid` is a command of this launcher not yet stopped (an exit of any other
    /// pid, such as an adopted orphan's, is nobody's to wait for).
    fn contains(&self, pid: i32) -> bool;

    /// How many commands are running (not yet stopped).
    fn running(&self) -> usize;

    /// At shut-down: stop every command still running, at once, then what they left
    /// outside their groups. How many leftovers outside the groups there were.
    fn stop_all(&self, grace: Duration) -> usize;

    /// The registry of the node's process groups, for what stops them from other threads
    /// (the merge command); `None` for a fake.
    fn registry(&self) -> Option<Arc<Registry>>;
}

/// The real launcher: `sh -c` in a process group of its own, registered (with the
/// `RL_NODE_OWNER` mark, so descendants that leave the group are found) for stopping by
/// the node, its guardian and its watchdog.
pub struct Processes {
    registry: Arc<Registry>,
}

impl Processes {
    pub fn new(registry: Arc<Registry>) -> Processes {
        Processes { registry }
    }
}

impl Launcher for Processes {
    fn start(
        &self,
        command: &str,
        env: &[(String, String)],
        log: &Path,
        header: &str,
    ) -> io::Result<i32> {
        let (id, owner) = self.registry.new_command();
        let mut env = env.to_vec();
        env.push(owner);
        let running = spawn_shell(command, &env, log, header)?;
        self.registry.add(running.pid, id);
        Ok(running.pid)
    }

    fn start_worker(
        &self,
        command: &str,
        env: &[(String, String)],
        log: &Path,
        header: &str,
    ) -> io::Result<(i32, WorkerPipes)> {
        let (id, owner) = self.registry.new_command();
        let mut env = env.to_vec();
        env.push(owner);
        let (running, pipes) = spawn_worker(command, &env, log, header)?;
        self.registry.add(running.pid, id);
        Ok((running.pid, pipes))
    }

    fn stop(&self, pid: i32, grace: Duration) -> Leftovers {
        self.registry.stop(pid, grace)
    }

    fn stop_many(&self, pids: &[i32], grace: Duration) {
        std::thread::scope(|s| {
            for &pid in pids {
                let registry = &self.registry;
                s.spawn(move || registry.stop(pid, grace));
            }
        });
    }

    fn contains(&self, pid: i32) -> bool {
        self.registry.contains(pid)
    }

    fn running(&self) -> usize {
        self.registry.groups().len()
    }

    fn stop_all(&self, grace: Duration) -> usize {
        let handles: Vec<_> = self
            .registry
            .groups()
            .into_iter()
            .map(|g| std::thread::spawn(move || stop_group(g, grace)))
            .collect();
        for h in handles {
            let _ = h.join();
        }
        self.registry.stop_descendants(grace)
    }

    fn registry(&self) -> Option<Arc<Registry>> {
        Some(self.registry.clone())
    }
}
