//! A launcher for the simulator (`sim` feature): commands that start no process, each
//! doing what a script says on a timer thread of the node's clock, so that the node's
//! own driver runs in a simulation and hears of its commands' ends as of real children's.
//! A command may also write files through the node's shared directory as it runs (a
//! rollout writing its shard), so that what the node commits and merges is real data.

use super::launcher::Launcher;
use super::{ChildExit, Event, Leftovers, Registry};
use crate::clock::{self, Clock};
use crate::store::SharedDir;
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a fake command does: exit with `code` after `after`, or run until stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeRun {
    Exit {
        after: Duration,
        code: i32,
    },
    /// Append each of `writes` (a path and its bytes) through the node's shared directory
    /// in turn, spread over `after`, none synced (a script's buffered writes: a crash of
    /// its machine loses them), then exit with `code`. A write that fails ends the command
    /// at once with exit 1, as a script's unhandled I/O error does; a stopped command
    /// writes no more. Needs a launcher with a store ([`FakeLauncher::writing_to`]).
    Write {
        after: Duration,
        code: i32,
        writes: Vec<(PathBuf, Vec<u8>)>,
    },
    Forever,
}

/// The script of a [`FakeLauncher`]: what each command does, from its command line and
/// environment (e.g. `RANK`).
pub type FakeScript = dyn Fn(&str, &[(String, String)]) -> FakeRun + Send + Sync;

/// A launcher that starts no process: each command does what the script says, on a timer
/// thread, and its exit is sent to the node's channel as a real child's would be. A
/// stopped command "dies of" SIGTERM. For running the node's driver in a simulation.
pub struct FakeLauncher {
    events: Mutex<Sender<Event>>,
    clock: Arc<dyn Clock>,
    script: Arc<FakeScript>,
    next_pid: AtomicI32,
    /// The commands not yet stopped, and whether each has exited.
    running: Arc<Mutex<HashMap<i32, bool>>>,
    /// Where commands that write files write them (the node's own client).
    store: Option<Arc<dyn SharedDir>>,
}

impl FakeLauncher {
    /// Commands' time passes on `clock`, and under its scheduler if it has one.
    pub fn new(
        events: Sender<Event>,
        script: Arc<FakeScript>,
        clock: Arc<dyn Clock>,
    ) -> FakeLauncher {
        FakeLauncher {
            events: Mutex::new(events),
            clock,
            script,
            next_pid: AtomicI32::new(100_000),
            running: Arc::default(),
            store: None,
        }
    }

    /// Commands that write files ([`FakeRun::Write`]) write them to `store`.
    pub fn writing_to(mut self, store: Arc<dyn SharedDir>) -> FakeLauncher {
        self.store = Some(store);
        self
    }
}

/// A fake command's end: the exit of `pid`, sent only if it is still running (a stopped
/// one already "died").
fn exit(
    running: &Mutex<HashMap<i32, bool>>,
    events: &Sender<Event>,
    clock: &dyn Clock,
    pid: i32,
    code: i32,
) {
    if let Some(exited) = running.lock().unwrap().get_mut(&pid) {
        *exited = true;
        let exit = match code {
            0 => ChildExit::Success,
            c => ChildExit::Exit(c),
        };
        let _ = events.send(Event::Reaped { pid, exit });
        clock::notify(clock, None);
    }
}

/// Do `writes` of command `pid` through `store`, spread over `after`: the exit code (1
/// when a write failed), or `None` when the command was stopped meanwhile.
fn write_all(
    store: &dyn SharedDir,
    clock: &dyn Clock,
    running: &Mutex<HashMap<i32, bool>>,
    pid: i32,
    after: Duration,
    writes: &[(PathBuf, Vec<u8>)],
) -> Option<i32> {
    let step = after / (writes.len() as u32 + 1);
    for (path, bytes) in writes {
        clock.sleep(step);
        if !running.lock().unwrap().contains_key(&pid) {
            return None;
        }
        if store.append(path, bytes, false).is_err() {
            return Some(1);
        }
    }
    clock.sleep(step);
    Some(0)
}

impl Launcher for FakeLauncher {
    fn start(
        &self,
        command: &str,
        env: &[(String, String)],
        _log: &Path,
        _header: &str,
    ) -> io::Result<i32> {
        let pid = self.next_pid.fetch_add(1, Ordering::Relaxed);
        self.running.lock().unwrap().insert(pid, false);
        let (after, code, writes) = match (self.script)(command, env) {
            FakeRun::Forever => return Ok(pid),
            FakeRun::Exit { after, code } => (after, code, Vec::new()),
            FakeRun::Write {
                after,
                code,
                writes,
            } => (after, code, writes),
        };
        let store = match (&self.store, writes.is_empty()) {
            (_, true) => None,
            (Some(s), false) => Some(s.clone()),
            (None, false) => {
                return Err(io::Error::other(
                    "a fake command that writes files needs a launcher with a store",
                ))
            }
        };
        let (events, running) = (self.events.lock().unwrap().clone(), self.running.clone());
        let c = self.clock.clone();
        clock::spawn(&*self.clock, &format!("command {pid}"), move || {
            let code = match &store {
                None => {
                    c.sleep(after);
                    code
                }
                Some(store) => match write_all(&**store, &*c, &running, pid, after, &writes) {
                    None => return,
                    Some(0) => code,
                    Some(failed) => failed,
                },
            };
            exit(&running, &events, &*c, pid, code);
        })?;
        Ok(pid)
    }

    fn stop(&self, pid: i32, _grace: Duration) -> Leftovers {
        let was = self.running.lock().unwrap().remove(&pid);
        if was == Some(false) {
            let _ = self.events.lock().unwrap().send(Event::Reaped {
                pid,
                exit: ChildExit::Signal(libc::SIGTERM),
            });
        }
        Leftovers {
            group: was == Some(false),
            outside: 0,
        }
    }

    fn contains(&self, pid: i32) -> bool {
        self.running.lock().unwrap().contains_key(&pid)
    }

    fn running(&self) -> usize {
        self.running.lock().unwrap().len()
    }

    fn stop_all(&self, grace: Duration) -> usize {
        let pids: Vec<i32> = self.running.lock().unwrap().keys().copied().collect();
        for pid in pids {
            self.stop(pid, grace);
        }
        0
    }

    fn registry(&self) -> Option<Arc<Registry>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_fake_command_exits_as_scripted_or_dies_of_sigterm_when_stopped() {
        let (tx, rx) = channel();
        let script: Arc<FakeScript> = Arc::new(|command, env| {
            if command == "forever" {
                return FakeRun::Forever;
            }
            let code = env
                .iter()
                .find(|(k, _)| k == "CODE")
                .map_or(0, |(_, v)| v.parse().unwrap());
            FakeRun::Exit {
                after: Duration::from_millis(5),
                code,
            }
        });
        let fake = FakeLauncher::new(tx, script, Arc::new(crate::clock::SystemClock));
        let log = Path::new("/nonexistent/log");
        let a = fake
            .start("x", &[("CODE".into(), "3".into())], log, "")
            .unwrap();
        let b = fake.start("forever", &[], log, "").unwrap();
        assert!(fake.contains(a) && fake.contains(b) && a != b);
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(matches!(got, Event::Reaped { pid, exit: ChildExit::Exit(3) } if pid == a));
        assert!(fake.contains(a), "known until the node stops it");
        assert_eq!(fake.stop(a, Duration::ZERO), Leftovers::default());
        assert!(!fake.contains(a));
        assert!(fake.stop(b, Duration::ZERO).group);
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(
            matches!(got, Event::Reaped { pid, exit: ChildExit::Signal(s) } if pid == b && s == libc::SIGTERM)
        );
        assert_eq!((fake.running(), fake.stop_all(Duration::ZERO)), (0, 0));
    }

    #[test]
    fn a_writing_command_appends_its_pieces_then_exits_and_a_failed_write_is_exit_1() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out/rank-0.partial.g1.jsonl");
        // A directory where the second command's file should be: its write fails.
        let blocked = d.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        let (o, b) = (out.clone(), blocked.clone());
        let script: Arc<FakeScript> = Arc::new(move |command, _| FakeRun::Write {
            after: Duration::from_millis(6),
            code: 3,
            writes: match command {
                "ok" => vec![
                    (o.clone(), b"{\"a\":1}\n".to_vec()),
                    (o.clone(), b"{\"b\":2}\n".to_vec()),
                ],
                _ => vec![(b.clone(), b"x\n".to_vec())],
            },
        });
        let (tx, rx) = channel();
        let clock = Arc::new(crate::clock::SystemClock);
        let bare = FakeLauncher::new(tx.clone(), script.clone(), clock.clone());
        let log = Path::new("/nonexistent/log");
        assert!(
            bare.start("ok", &[], log, "").is_err(),
            "no store to write to"
        );
        let fake = FakeLauncher::new(tx, script, clock).writing_to(Arc::new(crate::store::Fs));
        let a = fake.start("ok", &[], log, "").unwrap();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(matches!(got, Event::Reaped { pid, exit: ChildExit::Exit(3) } if pid == a));
        assert_eq!(std::fs::read(&out).unwrap(), b"{\"a\":1}\n{\"b\":2}\n");
        let b = fake.start("blocked", &[], log, "").unwrap();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(matches!(got, Event::Reaped { pid, exit: ChildExit::Exit(1) } if pid == b));
    }
}
