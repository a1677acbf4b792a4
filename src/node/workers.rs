//! Reused item processes (`phases.<phase>.reuse-processes`): in per-task mode and the
//! dynamic strategy, the rollout or eval command is started once per worker slot (up to
//! `max-workers` of them) instead of once per item, and is handed one item at a time as a
//! JSON line on its standard input. It answers each on descriptor 3 (`RL_NODE_REPLY_FD`)
//! with `{"item": NAME}` once the item's output is written, or `{"item": NAME, "exit":
//! CODE}` for the exit code a command of its own would have had (a retryable code is
//! retried as for any item). Its output goes to `rank-R.<phase>.items/worker-K.log`.
//!
//! The item loops (`node::work`) do not know the difference: an item handed to a worker
//! gets a ticket, a negative number in place of a pid, and the worker's answer arrives as
//! that ticket's exit in the node's `exited`, as a process's would. Commits, retries,
//! fences and leases are the same code. A worker that ends, or says something that is not
//! an answer for the item it holds, costs that item ([`ChildExit::Unanswered`], or the
//! worker's own exit when it failed or was killed); the next item starts a new worker.
//!
//! Each worker has two threads of the node: one writes its items (a write to a worker
//! still loading its model never blocks the node's loop) and one reads its replies and
//! hands them to the loop as [`Event::Reply`].

use super::{Interrupt, Node, Stop};
use crate::process::{ChildExit, Event, Reply, WorkerPipes};
use crate::protocol::AbortKind;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};

/// The running item workers of the current rollout (none outside one).
#[derive(Default)]
pub(super) struct Workers {
    list: Vec<Worker>,
    /// The last ticket handed out (tickets count down from -1).
    last_ticket: i32,
    /// The last worker id handed out.
    last_id: u64,
    /// Which worker log each item's latest attempt went to, for messages about it.
    logs: std::collections::HashMap<(String, u32), PathBuf>,
}

struct Worker {
    /// Names it in its reply events (a pid can be reused once it is collected).
    id: u64,
    pid: i32,
    slot: usize,
    log: PathBuf,
    /// To its writer thread; dropped to close its standard input.
    items: Option<Sender<Vec<u8>>>,
    /// The item it was handed and has not answered: its ticket and name.
    holding: Option<(i32, String)>,
    /// Its exit, once collected.
    exit: Option<ChildExit>,
    /// Its replies ended (it and what it started closed descriptor 3).
    closed: bool,
}

impl Workers {
    /// Whether `id` is an item handed to a worker (a ticket), not a process.
    pub fn is_ticket(id: i32) -> bool {
        id < 0
    }

    /// Whether any worker is running or not yet collected.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The log of the worker the item `name`'s attempt `attempt` went to, if one did.
    pub fn log_of(&self, name: &str, attempt: u32) -> Option<&Path> {
        self.logs
            .get(&(name.to_string(), attempt))
            .map(PathBuf::as_path)
    }

    /// Where worker `id` is in the list, if it still is.
    fn index_of(&self, id: u64) -> Option<usize> {
        self.list.iter().position(|w| w.id == id)
    }

    /// A running worker holding nothing, that can be handed an item.
    fn idle(&self) -> Option<usize> {
        self.list
            .iter()
            .position(|w| w.holding.is_none() && w.exit.is_none() && w.items.is_some())
    }

    /// The lowest slot no worker uses.
    fn free_slot(&self) -> usize {
        (0..)
            .find(|s| self.list.iter().all(|w| w.slot != *s))
            .expect("a free slot")
    }
}

/// The longest reply line a worker may write (an answer is a few dozen bytes).
const MAX_REPLY: usize = 64 * 1024;

/// Start the threads that write `pipes.items` from a channel and read `pipes.replies` to
/// `wake`, for worker `id`.
fn serve(id: u64, pipes: WorkerPipes, wake: Sender<Event>) -> Sender<Vec<u8>> {
    let (tx, rx) = channel::<Vec<u8>>();
    let mut items = pipes.items;
    std::thread::Builder::new()
        .name("item-writer".into())
        .spawn(move || {
            // Ends when the node drops its sender (the worker's standard input then ends)
            // or the worker is gone (a write fails: its exit tells the node).
            for line in rx {
                if items.write_all(&line).is_err() {
                    break;
                }
            }
        })
        .expect("spawn an item writer thread");
    let mut replies = std::io::BufReader::new(pipes.replies);
    std::thread::Builder::new()
        .name("item-replies".into())
        .spawn(move || {
            let mut line = Vec::new();
            loop {
                line.clear();
                // At most one byte past the longest answer: a worker cannot make the node
                // hold an endless line.
                let limit = MAX_REPLY as u64 + 1;
                match (&mut replies).take(limit).read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let long = line.len() > MAX_REPLY;
                let reply = if long {
                    Reply::Garbled(format!("a line longer than {MAX_REPLY} bytes"))
                } else {
                    let text = line.strip_suffix(b"\n").unwrap_or(&line);
                    let text = text.strip_suffix(b"\r").unwrap_or(text);
                    if text.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    Reply::parse(text)
                };
                // After a line that long the worker is stopped: nothing more is read.
                if wake.send(Event::Reply { worker: id, reply }).is_err() || long {
                    return;
                }
            }
            let _ = wake.send(Event::Reply {
                worker: id,
                reply: Reply::Closed,
            });
        })
        .expect("spawn an item reply thread");
    tx
}

impl Node {
    /// Hand the item `name` (attempt `attempt`) to an idle worker, starting one when none
    /// is idle; its ticket. `line` is the item's JSON line.
    pub(super) fn hand_item(
        &mut self,
        phase: &str,
        split: &str,
        command: &str,
        name: &str,
        attempt: u32,
        line: String,
    ) -> Result<i32, Stop> {
        let i = match self.workers.idle() {
            Some(i) => i,
            None => self.start_worker(phase, split, command)?,
        };
        self.workers.last_ticket -= 1;
        let ticket = self.workers.last_ticket;
        let w = &mut self.workers.list[i];
        w.holding = Some((ticket, name.to_string()));
        let log = w.log.clone();
        let mut bytes = line.into_bytes();
        bytes.push(b'\n');
        // A writer thread that has stopped (its worker is gone) drops the line: the
        // worker's exit costs the item it holds, this one.
        let _ = w.items.as_ref().expect("idle").send(bytes);
        self.workers.logs.insert((name.to_string(), attempt), log);
        Ok(ticket)
    }

    /// Start a worker for `phase` of `split` in the lowest free slot; its index.
    fn start_worker(&mut self, phase: &str, split: &str, command: &str) -> Result<usize, Stop> {
        let slot = self.workers.free_slot();
        let log = self
            .layout
            .worker_log(self.machine.iteration(), self.rank, phase, slot);
        for k in crate::config::template::PER_TASK {
            self.extra.remove(k);
        }
        let values = self.values(phase, Some(split), Path::new(""));
        let command = self.cfg.template(command).render(&values);
        let mut env = self.command_env(&values);
        env.push((
            "RL_NODE_REPLY_FD".into(),
            crate::process::spawn::REPLY_FD.to_string(),
        ));
        let header = format!(
            "rank {} iteration {} {phase} worker {slot} (reused for {split} items)",
            self.rank,
            self.machine.iteration()
        );
        self.append_log(
            &self
                .layout
                .phase_log(self.machine.iteration(), self.rank, phase),
            &format!("### {header}: log {}\n", log.display()),
        );
        self.watchdog.pet("starting an item worker");
        let (pid, pipes) = self
            .launcher
            .start_worker(&command, &env, &log, &header)
            .map_err(|e| {
                self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!("cannot start the {phase} command as an item worker: {e}"),
                    Some(&log),
                )
            })?;
        self.workers.last_id += 1;
        let id = self.workers.last_id;
        let items = serve(id, pipes, self.wake.clone());
        self.workers.list.push(Worker {
            id,
            pid,
            slot,
            log,
            items: Some(items),
            holding: None,
            exit: None,
            closed: false,
        });
        Ok(self.workers.list.len() - 1)
    }

    /// Whether `pid` is a worker's process; if so its exit is taken in.
    pub(super) fn worker_exited(&mut self, pid: i32, exit: ChildExit) -> bool {
        let Some(i) = self
            .workers
            .list
            .iter()
            .position(|w| w.pid == pid && w.exit.is_none())
        else {
            return false;
        };
        self.workers.list[i].exit = Some(exit);
        // What it left in its group goes now, so that its replies' pipe closes.
        self.reap(pid, Some(&self.workers.list[i].log.clone()));
        let id = self.workers.list[i].id;
        self.settle_worker(id);
        true
    }

    /// Worker `id` replied (or its replies ended).
    pub(super) fn worker_replied(&mut self, id: u64, reply: Reply) {
        let Some(i) = self.workers.index_of(id) else {
            // A worker stopped meanwhile.
            return;
        };
        let w = &mut self.workers.list[i];
        match reply {
            Reply::Closed => {
                w.closed = true;
                self.settle_worker(id);
            }
            Reply::Done { item, exit } if w.holding.as_ref().is_some_and(|h| h.1 == item) => {
                let (ticket, _) = w.holding.take().expect("held");
                let exit = match exit {
                    0 => ChildExit::Success,
                    c => ChildExit::Exit(c),
                };
                self.exited.insert(ticket, exit);
            }
            Reply::Done { item, .. } => {
                let held = match &w.holding {
                    Some((_, h)) => format!("it holds {h}"),
                    None => "it holds no item".into(),
                };
                self.worker_broke(id, &format!("it answered for item {item}, but {held}"));
            }
            Reply::Garbled(what) => self.worker_broke(id, &format!("it wrote {what}")),
        }
    }

    /// Worker `id` broke the reply protocol: said in its log, and stopped; the item it
    /// held goes unanswered.
    fn worker_broke(&mut self, id: u64, what: &str) {
        let i = self.workers.index_of(id).expect("listed");
        let w = self.workers.list.remove(i);
        self.append_log(
            &w.log,
            &format!("### rl-node: this worker is stopped: {what} on descriptor 3, where only answers {{\"item\": NAME}} or {{\"item\": NAME, \"exit\": CODE}} for the item it was handed may go\n"),
        );
        self.launcher.stop(w.pid, self.cfg.timing.kill_grace);
        if let Some((ticket, _)) = w.holding {
            self.exited.insert(ticket, ChildExit::Unanswered);
        }
    }

    /// Forget worker `id` once both its exit and the end of its replies are known (no
    /// answer can come after them); the item it still held gets the worker's exit.
    fn settle_worker(&mut self, id: u64) {
        let Some(i) = self.workers.index_of(id) else {
            return;
        };
        let Worker {
            closed: true,
            exit: Some(exit),
            ..
        } = self.workers.list[i]
        else {
            return;
        };
        let w = self.workers.list.remove(i);
        let Some((ticket, item)) = &w.holding else {
            return;
        };
        self.append_log(
            &w.log,
            &format!("### rl-node: this worker ended ({exit}) while it held item {item}, without an answer for it\n"),
        );
        let exit = match exit {
            ChildExit::Success => ChildExit::Unanswered,
            other => other,
        };
        self.exited.insert(*ticket, exit);
    }

    /// An item ended: a process's leftovers are stopped ([`Node::reap`]); a worker that
    /// ran it lives on for the next item.
    pub(super) fn item_ended(&mut self, id: i32) {
        if !Workers::is_ticket(id) {
            self.reap(id, None);
        }
    }

    /// Stop the items `ids` at once: their processes, and the workers of the tickets
    /// among them (a worker does not stop one item for another; it is started again for
    /// the next item). Their exits are forgotten.
    pub(super) fn stop_items(&mut self, ids: &[i32]) {
        let mut pids = Vec::new();
        for &id in ids {
            self.exited.remove(&id);
            if !Workers::is_ticket(id) {
                pids.push(id);
                continue;
            }
            let held = |w: &Worker| w.holding.as_ref().is_some_and(|h| h.0 == id);
            if let Some(i) = self.workers.list.iter().position(held) {
                let w = self.workers.list.remove(i);
                self.append_log(
                    &w.log,
                    &format!(
                        "### rl-node: this worker is stopped with the item it holds ({})\n",
                        w.holding.as_ref().expect("held").1
                    ),
                );
                pids.push(w.pid);
            }
        }
        self.launcher.stop_many(&pids, self.cfg.timing.kill_grace);
    }

    /// The rollout is over: every worker's standard input ends, and the workers get
    /// `kill-grace` to exit before what is left of them is stopped.
    pub(super) fn finish_workers(&mut self) -> Result<(), Stop> {
        if self.workers.is_empty() {
            return Ok(());
        }
        for w in &mut self.workers.list {
            w.items = None;
        }
        let deadline = self.clock.now() + self.cfg.timing.kill_grace;
        let waited = self.wait_for(deadline, |n| Ok(n.workers.is_empty().then_some(())));
        match waited {
            Ok(()) | Err(Interrupt::Deadline) => {}
            Err(Interrupt::Stop(s)) => return Err(s),
        }
        let left: Vec<Worker> = std::mem::take(&mut self.workers.list);
        let pids: Vec<i32> = left.iter().map(|w| w.pid).collect();
        self.launcher.stop_many(&pids, self.cfg.timing.kill_grace);
        self.workers.logs.clear();
        Ok(())
    }
}
