//! Hang forensics in the node: when to write a hang report, and writing it off the loop
//! (docs/forensics.md).
//!
//! A wait that has run for `timing.hang-report-at` of its timeout (a barrier:
//! `barrier-timeout`; a phase command: its `phases.<phase>.timeout`), or a watched peer
//! whose heartbeat has been still for that fraction of `dead-after`, makes the node record
//! what its processes are doing ([`crate::process::forensics`]) in
//! `logs/iter-NNNN/rank-R.hang-K.txt`. The decisions are pure ([`due`], [`Reporter`]'s
//! counting): one report per overrunning wait and per silent spell of a peer, at most
//! [`MAX_PER_ITERATION`] per iteration.
//!
//! The node that finds the hang is rarely the one whose processes explain it (rank 0
//! waits at a barrier; the slow rank's rollout is what hangs). So it also publishes a call
//! ([`HangCall`]) in its record, and every node that reads it writes a report of its own:
//! workers read rank 0's record, and rank 0 reads every worker's and relays a worker's
//! call in its own record. A node frozen or stuck cannot answer, which is itself the
//! finding.
//!
//! The loop only decides and starts a thread; the thread collects (bounded by time limits)
//! and then writes the file. A write that hangs on the shared directory holds that thread
//! only: the loop goes on, and the watchdog judges the loop as before. When the thread is
//! done the loop hears of it at its next round: it logs the path, appends a `hang-report`
//! event and puts the path in the rank's record, where `rl-node status` finds it.
//!
//! When the node stops, it first stops the reports' tools ([`Reporter::stop_tools`]): a
//! `py-spy` or `nvidia-smi` that hangs is killed then rather than at its time limit, after
//! the node is gone, so the report is written within the stop's wait for it.

use super::Node;
use crate::events;
use crate::logging;
use crate::process::forensics as collect;
use crate::protocol::HangCall;
use crate::store::SharedDir;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Hang reports of one rank in one iteration, at most.
pub(crate) const MAX_PER_ITERATION: u32 = 5;

/// Reports being collected or written at once, at most: reports whose writes hang must not
/// pile up threads.
const MAX_IN_FLIGHT: usize = 2;

/// How long a stopping node waits for reports still being written, at most.
pub(crate) const SETTLE: Duration = Duration::from_secs(3);

/// Whether a wait that has run for `elapsed` of its `timeout` is due its hang report at
/// `fraction` of the timeout (0: never), unless it was `reported` already.
pub(crate) fn due(elapsed: Duration, timeout: Duration, fraction: f64, reported: bool) -> bool {
    if reported || fraction.is_nan() || fraction <= 0.0 || timeout.is_zero() {
        return false;
    }
    let at = Duration::try_from_secs_f64(timeout.as_secs_f64() * fraction).unwrap_or(Duration::MAX);
    elapsed >= at
}

/// A wait being watched for overrunning: a barrier, a phase command.
#[derive(Debug, Clone)]
pub(crate) struct Watched {
    /// What is waited for, e.g. `barrier rollout-complete (iteration 3)`.
    pub what: String,
    /// The configuration key of its timeout, e.g. `timing.barrier-timeout`.
    pub key: String,
    pub timeout: Duration,
    pub started: Instant,
    pub reported: bool,
}

/// Why a report is written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Trigger {
    /// A wait has run for `elapsed` of its `timeout` (`key`); `note` is what it waits for
    /// right now, as the node's "still waiting" lines say it.
    Wait {
        what: String,
        note: String,
        key: String,
        elapsed: Duration,
        timeout: Duration,
    },
    /// Peer `rank`'s heartbeat has been still for `silent` (it is dead at `dead_after`).
    Silent {
        rank: u32,
        host: String,
        silent: Duration,
        dead_after: Duration,
    },
    /// Another node's call for reports.
    Called(HangCall),
}

impl Trigger {
    /// One line for the report's header, the log and the event.
    pub fn why(&self) -> String {
        let t =
            |d: &Duration| humantime::format_duration(Duration::from_millis(d.as_millis() as u64));
        match self {
            Trigger::Wait {
                what,
                note,
                key,
                elapsed,
                timeout,
            } => {
                // The note often extends `what` ("… waits for rank 1"): say it once.
                let (subject, tail) = match note.strip_prefix(what.as_str()) {
                    Some(rest) => (format!("{what}{rest}"), String::new()),
                    None if note.is_empty() => (what.clone(), String::new()),
                    None => (what.clone(), format!("; waiting for {note}")),
                };
                format!(
                    "{subject}: {} of its timeout of {} ({key}){tail}",
                    t(elapsed),
                    t(timeout)
                )
            }
            Trigger::Silent {
                rank,
                host,
                silent,
                dead_after,
            } => format!(
                "rank {rank}{} is silent: its heartbeat has been still for {} (dead at dead-after = {})",
                if host.is_empty() {
                    String::new()
                } else {
                    format!(" on {host}")
                },
                t(silent),
                t(dead_after)
            ),
            Trigger::Called(c) => format!("rank {} called for hang reports: {}", c.rank, c.why),
        }
    }
}

/// A report's thread is done: the file it wrote, or why it could not.
pub(crate) struct Written {
    pub path: PathBuf,
    pub why: String,
    pub result: Result<(), String>,
}

/// The node's hang reports: what was reported already, and the reports' threads.
pub(crate) struct Reporter {
    fraction: f64,
    /// The processes to look at: the node process and the pids to leave out (the
    /// guardian). `None`: a node with no processes of its own (the simulator's), which
    /// writes no reports.
    procs: Option<(i32, Vec<i32>)>,
    /// The iteration `count` counts.
    iteration: u64,
    count: u32,
    /// Peers reported silent in their current silent spell.
    silent: BTreeSet<u32>,
    /// This node's calls so far.
    calls: u64,
    /// Calls answered (or made) already: (rank, n).
    answered: BTreeSet<(u32, u64)>,
    /// Where the calls answered or made were made: (iteration, phase).
    stalls: BTreeSet<(u64, String)>,
    in_flight: usize,
    /// The barrier or phase command the current wait is watched for overrunning.
    watched: Option<Watched>,
    /// Where the reports run their tools.
    tools: collect::Tools,
    tx: Sender<Written>,
    rx: Receiver<Written>,
}

impl Reporter {
    pub fn new(fraction: f64, procs: Option<(i32, Vec<i32>)>, tools: collect::Tools) -> Reporter {
        let (tx, rx) = channel();
        Reporter {
            fraction,
            procs,
            tools,
            iteration: 0,
            count: 0,
            silent: BTreeSet::new(),
            calls: 0,
            answered: BTreeSet::new(),
            stalls: BTreeSet::new(),
            in_flight: 0,
            watched: None,
            tx,
            rx,
        }
    }

    /// The node is stopping: kill the tools of the reports being collected (returns once
    /// they are gone) and start none, so that those reports are written now with what
    /// they have.
    pub fn stop_tools(&self) {
        self.tools.stop();
    }

    fn enabled(&self) -> bool {
        self.procs.is_some() && self.fraction > 0.0
    }

    /// May a report start now in `iteration`? Its number K (1, 2, …) if so. A report that
    /// cannot start (too many this iteration, or still being written) is not retried: one
    /// report per trigger.
    fn allow(&mut self, iteration: u64) -> Option<u32> {
        if self.iteration != iteration {
            self.iteration = iteration;
            self.count = 0;
        }
        if self.count >= MAX_PER_ITERATION || self.in_flight >= MAX_IN_FLIGHT {
            return None;
        }
        self.count += 1;
        Some(self.count)
    }

    /// This node's next call, for a report it starts on its own finding (`why`) in
    /// `iteration` and `phase`.
    fn call(&mut self, rank: u32, iteration: u64, phase: &str, why: &str) -> HangCall {
        self.calls += 1;
        self.answered.insert((rank, self.calls));
        self.stalls.insert((iteration, phase.to_string()));
        HangCall {
            rank,
            n: self.calls,
            iteration,
            phase: phase.to_string(),
            why: why.to_string(),
        }
    }

    /// The calls of `seen` (as the peers' records carry them) to answer: each call once,
    /// whoever carries it (its maker, or rank 0 relaying it), and one per place the
    /// callers were (iteration and phase), which this node's own call counts for too:
    /// every worker waiting at a barrier for a slow rank 0 calls, and rank 0's one report
    /// answers them all.
    ///
    /// Takes the calls by reference and clones only the new ones: this runs every poll
    /// round, and nearly every call seen has been answered already.
    fn unanswered<'c>(&mut self, seen: impl IntoIterator<Item = &'c HangCall>) -> Vec<HangCall> {
        seen.into_iter()
            .filter(|c| self.answered.insert((c.rank, c.n)))
            .filter(|c| self.stalls.insert((c.iteration, c.phase.clone())))
            .cloned()
            .collect()
    }

    /// The peers of `silent_for` (rank, how long its heartbeat has been still) that have
    /// just become due a report; a peer whose heartbeat advanced again is forgotten, so
    /// its next silent spell gets a report of its own. A heartbeat still for less than two
    /// of its intervals (`beat`) is ordinary jitter, whatever the fraction says: the
    /// configuration refuses a dead-after below that for the same reason.
    fn newly_silent(
        &mut self,
        silent_for: &[(u32, Duration)],
        dead_after: Duration,
        beat: Duration,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        let is_due = |silent: Duration, reported: bool| {
            silent >= beat * 2 && due(silent, dead_after, self.fraction, reported)
        };
        for &(rank, silent) in silent_for {
            let reported = self.silent.contains(&rank);
            if is_due(silent, reported) {
                self.silent.insert(rank);
                out.push(rank);
            } else if !is_due(silent, false) {
                self.silent.remove(&rank);
            }
        }
        out
    }
}

impl Node {
    /// Watch the wait that follows for overrunning `fraction` of `timeout` (whose
    /// configuration key is `key`), until [`Node::unwatch_wait`].
    pub(super) fn watch_wait(
        &mut self,
        what: String,
        key: String,
        timeout: Duration,
        started: Instant,
    ) {
        self.hang.watched = Some(Watched {
            what,
            key,
            timeout,
            started,
            reported: false,
        });
    }

    pub(super) fn unwatch_wait(&mut self) {
        self.hang.watched = None;
    }

    /// One round of the wait loop: hear of reports written, and start the ones due.
    pub(super) fn hang_round(&mut self) {
        while let Ok(w) = self.hang.rx.try_recv() {
            self.hang_written(w);
        }
        if !self.hang.enabled() {
            return;
        }
        let fraction = self.hang.fraction;
        let mut triggers = Vec::new();
        if let Some(w) = self.hang.watched.as_mut() {
            let elapsed = self.clock.now().saturating_duration_since(w.started);
            if due(elapsed, w.timeout, fraction, w.reported) {
                w.reported = true;
                triggers.push(Trigger::Wait {
                    what: w.what.clone(),
                    note: self.waiting.note.clone(),
                    key: w.key.clone(),
                    elapsed,
                    timeout: w.timeout,
                });
            }
        }
        if self.machine.watch.formed {
            let now = self.clock.since_start();
            let live: Vec<(u32, Duration)> = self
                .machine
                .watching()
                .watched(self.rank)
                .into_iter()
                .filter(|r| {
                    self.machine
                        .watch
                        .peers
                        .get(*r as usize)
                        .and_then(|p| p.as_ref())
                        .is_some_and(|p| !p.state.is_terminal())
                })
                .map(|r| (r, self.machine.watch.liveness.silent_for(r, now)))
                .collect();
            let (dead_after, beat) = (
                self.cfg.timing.dead_after,
                self.cfg.timing.heartbeat_interval,
            );
            for rank in self.hang.newly_silent(&live, dead_after, beat) {
                let host = self.machine.watch.peers[rank as usize]
                    .as_ref()
                    .map(|p| p.host.clone())
                    .unwrap_or_default();
                let silent = live
                    .iter()
                    .find(|(r, _)| *r == rank)
                    .map_or(Duration::ZERO, |(_, s)| *s);
                triggers.push(Trigger::Silent {
                    rank,
                    host,
                    silent,
                    dead_after,
                });
            }
        }
        // Own findings call every other node to report too.
        if !triggers.is_empty() {
            let why = triggers
                .iter()
                .map(Trigger::why)
                .collect::<Vec<_>>()
                .join("; ");
            let phase = self.phase_label();
            let call = self
                .hang
                .call(self.rank, self.machine.iteration(), &phase, &why);
            if let Some(p) = &self.publisher {
                p.update(|r| r.hang_call = Some(call));
            }
        }
        if self.machine.watch.formed {
            let rank = self.rank;
            let seen = self
                .machine
                .watch
                .peers
                .iter()
                .enumerate()
                .filter(|(r, _)| *r as u32 != rank)
                .filter_map(|(_, p)| p.as_ref()?.hang_call.as_ref());
            for call in self.hang.unanswered(seen) {
                // Workers read only rank 0's record: it passes a worker's call on (and a
                // group's leader its members' calls, to rank 0).
                if self.machine.gathers() {
                    if let Some(p) = &self.publisher {
                        let relayed = call.clone();
                        p.update(|r| r.hang_call = Some(relayed));
                    }
                }
                triggers.push(Trigger::Called(call));
            }
        }
        for t in triggers {
            self.start_hang_report(t);
        }
    }

    /// Collect and write a report on a thread of its own.
    fn start_hang_report(&mut self, trigger: Trigger) {
        let Some((root, spare)) = self.hang.procs.clone() else {
            return;
        };
        let why = trigger.why();
        let Some(k) = self.hang.allow(self.machine.iteration()) else {
            self.debug(&format!(
                "no hang report for: {why} ({MAX_PER_ITERATION} this iteration already, or {MAX_IN_FLIGHT} still being written)"
            ));
            return;
        };
        let supervisor = match self.pid {
            pid if pid == root as u32 => String::new(),
            pid => format!(" (its supervisor, which records name: {pid})"),
        };
        let header = format!(
            "# rl-node hang report\nwhy: {why}\ntime: {}\nhost: {}\nrank: {}\ngeneration: {}\niteration: {}\nphase: {}\nnode process: {root}{supervisor}\nhang-report-at: {}\n",
            self.wall_stamp(),
            self.host,
            self.rank,
            self.gen(),
            self.machine.iteration(),
            self.phase_label(),
            self.hang.fraction,
        );
        let job = Job {
            store: self.store.clone(),
            first: self
                .layout
                .hang_report(self.machine.iteration(), self.rank, k),
            layout: self.layout.clone(),
            iteration: self.machine.iteration(),
            rank: self.rank,
            k,
            header,
            root,
            spare,
            tools: self.hang.tools.clone(),
            why: why.clone(),
            tx: self.hang.tx.clone(),
        };
        let (tx, first, what) = (job.tx.clone(), job.first.clone(), why.clone());
        match std::thread::Builder::new()
            .name("hang-report".into())
            .spawn(move || {
                // The loop counts reports in flight: it must hear of this one in any case.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run())).is_err() {
                    let _ = tx.send(Written {
                        path: first,
                        why: what,
                        result: Err("the report's thread panicked".into()),
                    });
                }
            }) {
            Ok(_) => {
                self.hang.in_flight += 1;
                self.info(&format!("writing a hang report: {why}"));
            }
            Err(e) => self.warn(&format!("cannot start the hang report ({why}): {e}")),
        }
    }

    fn hang_written(&mut self, w: Written) {
        self.hang.in_flight = self.hang.in_flight.saturating_sub(1);
        let rel = w
            .path
            .strip_prefix(self.layout.root())
            .unwrap_or(&w.path)
            .display()
            .to_string();
        match w.result {
            Ok(()) => {
                self.info(&format!("hang report {rel} ({})", w.why));
                self.event(events::Event::HangReport {
                    path: rel.clone(),
                    why: w.why,
                });
                if let Some(p) = &self.publisher {
                    p.stage(|r| r.hang_report = Some(rel));
                }
            }
            Err(e) => self.warn(&format!(
                "cannot write the hang report {rel} ({}): {e}",
                w.why
            )),
        }
    }

    /// At shut-down: hear of the reports still being written, waiting `limit` at most
    /// (a report started just before a failure belongs with it).
    pub(super) fn settle_hang_reports(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.hang.in_flight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.hang.rx.recv_timeout(left) {
                Ok(w) => self.hang_written(w),
                Err(_) => break,
            }
        }
    }
}

/// One report's work, on its own thread.
struct Job {
    store: Arc<dyn SharedDir>,
    layout: crate::layout::Layout,
    first: PathBuf,
    iteration: u64,
    rank: u32,
    k: u32,
    header: String,
    root: i32,
    spare: Vec<i32>,
    tools: collect::Tools,
    why: String,
    tx: Sender<Written>,
}

impl Job {
    fn run(self) {
        // Everything is collected before the shared directory is touched.
        let body = collect::collect(self.root, &self.spare, &self.tools);
        logging::info(self.rank, &format!("hang report: {}", body.summary));
        let text = format!("{}\n{}", self.header, body.text);
        let (path, result) = self.write(text.as_bytes());
        let _ = self.tx.send(Written {
            path,
            why: self.why,
            result,
        });
    }

    /// Write under the first free name from `first` on: never over an existing report
    /// (an earlier generation's of this iteration). Atomic, not synced: a log.
    fn write(&self, bytes: &[u8]) -> (PathBuf, Result<(), String>) {
        if let Some(dir) = self.first.parent() {
            if let Err(e) = self.store.create_dir_all(dir) {
                return (self.first.clone(), Err(format!("{}: {e}", dir.display())));
            }
        }
        for k in self.k..self.k + 100 {
            let path = self.layout.hang_report(self.iteration, self.rank, k);
            match self.store.create_new_live(&path, bytes) {
                Ok(true) => return (path, Ok(())),
                Ok(false) => continue,
                Err(e) => return (path, Err(e.to_string())),
            }
        }
        (
            self.first.clone(),
            Err("100 reports of this iteration exist already".into()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_wait_is_due_once_at_its_fraction_of_the_timeout() {
        assert!(!due(S(4), S(10), 0.5, false));
        assert!(due(S(5), S(10), 0.5, false));
        assert!(due(S(9), S(10), 0.5, false));
        // Once reported, never again for the same wait.
        assert!(!due(S(9), S(10), 0.5, true));
        // Off.
        assert!(!due(S(9), S(10), 0.0, false));
        assert!(!due(S(9), S(10), f64::NAN, false));
        assert!(!due(S(9), Duration::ZERO, 0.5, false));
        // A fraction of a long timeout.
        assert!(!due(Duration::from_millis(2_699), S(9), 0.3, false));
        assert!(due(Duration::from_millis(2_700), S(9), 0.3, false));
        assert!(!due(S(43_199), S(86_400), 0.5, false));
        assert!(due(S(43_200), S(86_400), 0.5, false));
    }

    #[test]
    fn reports_are_counted_per_iteration_and_bounded() {
        let mut r = Reporter::new(0.5, Some((1, vec![])), collect::Tools::default());
        let ks: Vec<Option<u32>> = (0..7)
            .map(|_| {
                let k = r.allow(3);
                // Each finishes at once.
                r.in_flight = 0;
                k
            })
            .collect();
        assert_eq!(
            ks,
            [Some(1), Some(2), Some(3), Some(4), Some(5), None, None]
        );
        // A new iteration counts from 1 again.
        assert_eq!(r.allow(4), Some(1));
        // Reports still being written hold further ones back.
        r.in_flight = MAX_IN_FLIGHT;
        assert_eq!(r.allow(4), None);
        r.in_flight = 0;
        assert_eq!(r.allow(4), Some(2));
    }

    #[test]
    fn a_silent_peer_is_reported_once_per_silent_spell() {
        let mut r = Reporter::new(0.5, Some((1, vec![])), collect::Tools::default());
        let (dead_after, beat) = (S(10), Duration::from_millis(500));
        let ms = Duration::from_millis;
        assert_eq!(
            r.newly_silent(&[(1, ms(100)), (2, S(4))], dead_after, beat),
            Vec::<u32>::new()
        );
        assert_eq!(
            r.newly_silent(&[(1, ms(200)), (2, S(5))], dead_after, beat),
            [2]
        );
        // Still silent: already reported.
        assert_eq!(
            r.newly_silent(&[(1, ms(300)), (2, S(7))], dead_after, beat),
            Vec::<u32>::new()
        );
        // Its heartbeat advanced, then stood still again: a new spell, a new report.
        assert_eq!(
            r.newly_silent(&[(1, ms(100)), (2, ms(10))], dead_after, beat),
            Vec::<u32>::new()
        );
        assert_eq!(
            r.newly_silent(&[(1, S(6)), (2, S(6))], dead_after, beat),
            [1, 2]
        );
        // Off: nobody is ever due.
        let mut off = Reporter::new(0.0, Some((1, vec![])), collect::Tools::default());
        assert!(off.newly_silent(&[(1, S(60))], dead_after, beat).is_empty());
        // A small fraction does not make a heartbeat's jitter a silence: at 0.1 of a 3 s
        // dead-after (300 ms) with a 200 ms beat, the report waits for 400 ms.
        let mut eager = Reporter::new(0.1, Some((1, vec![])), collect::Tools::default());
        let (dead_after, beat) = (S(3), ms(200));
        assert!(eager
            .newly_silent(&[(1, ms(301))], dead_after, beat)
            .is_empty());
        assert_eq!(eager.newly_silent(&[(1, ms(400))], dead_after, beat), [1]);
    }

    #[test]
    fn each_call_is_answered_once_whoever_carries_it() {
        let mut r = Reporter::new(0.5, Some((1, vec![])), collect::Tools::default());
        let call = |rank, n, iteration, phase: &str| HangCall {
            rank,
            n,
            iteration,
            phase: phase.into(),
            why: format!("{rank}/{n}"),
        };
        // Its own calls count from 1 and are never answered by itself.
        let own = r.call(2, 1, "2 (rollout-complete)", "barrier x");
        assert_eq!((own.rank, own.n), (2, 1));
        assert!(r.unanswered([&own]).is_empty());
        // Rank 0's call, read again at every round: answered once.
        let c0 = call(0, 1, 1, "1 (train-rollout)");
        assert_eq!(r.unanswered([&c0]), std::slice::from_ref(&c0));
        assert!(r.unanswered([&c0]).is_empty());
        // Rank 1's call as rank 1 made it and as rank 0 relays it: one answer.
        let c1 = call(1, 1, 2, "1 (train-rollout)");
        assert_eq!(r.unanswered([&c1, &c1]), [c1]);
        // Another worker's call from the same stall as this node's own: no second report.
        assert!(r
            .unanswered([&call(3, 1, 1, "2 (rollout-complete)")])
            .is_empty());
        // A later call of the same rank, from elsewhere, is a new one.
        let later = call(0, 2, 1, "10 (training)");
        assert_eq!(r.unanswered([&later]), [later]);
        assert_eq!(r.call(2, 1, "10 (training)", "y").n, 2);
    }

    #[test]
    fn the_reason_names_the_wait_its_timeout_and_key_or_the_silent_peer() {
        let w = Trigger::Wait {
            what: "barrier rollout-complete (iteration 3)".into(),
            note: "barrier rollout-complete (iteration 3) waits for rank 1".into(),
            key: "timing.barrier-timeout".into(),
            elapsed: Duration::from_millis(3_012),
            timeout: S(10),
        };
        assert_eq!(
            w.why(),
            "barrier rollout-complete (iteration 3) waits for rank 1: 3s 12ms of its timeout of 10s (timing.barrier-timeout)"
        );
        let worker = Trigger::Wait {
            what: "barrier rollout-complete (iteration 3)".into(),
            note: "rank 0 to release barrier rollout-complete (iteration 3)".into(),
            key: "timing.barrier-timeout".into(),
            elapsed: Duration::from_millis(3_012),
            timeout: S(10),
        };
        assert_eq!(
            worker.why(),
            "barrier rollout-complete (iteration 3): 3s 12ms of its timeout of 10s (timing.barrier-timeout); waiting for rank 0 to release barrier rollout-complete (iteration 3)"
        );
        let s = Trigger::Silent {
            rank: 1,
            host: "node-b".into(),
            silent: Duration::from_millis(1_500),
            dead_after: S(4),
        };
        assert_eq!(
            s.why(),
            "rank 1 on node-b is silent: its heartbeat has been still for 1s 500ms (dead at dead-after = 4s)"
        );
        let c = Trigger::Called(HangCall {
            rank: 0,
            n: 1,
            iteration: 1,
            phase: "2 (rollout-complete)".into(),
            why: "barrier b (iteration 1) waits for rank 1: 2s of its timeout of 10s (timing.barrier-timeout)".into(),
        });
        assert_eq!(
            c.why(),
            "rank 0 called for hang reports: barrier b (iteration 1) waits for rank 1: 2s of its timeout of 10s (timing.barrier-timeout)"
        );
    }
}
