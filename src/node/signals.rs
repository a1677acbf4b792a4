//! Stop signals: the thread that receives them, and what a second and a third one do.
//!
//! The first stop signal (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) becomes an
//! `Event::Signal` of the node loop, which publishes the abort that names it and stops
//! gracefully (`kill-grace`). It also decides the node's exit code: a later signal only
//! escalates, it never replaces the cause peers are told or the code the node exits with.
//! - The second kills every command's process group and descendant at once (SIGKILL) and
//!   makes the node exit within [`ESCALATED_EXIT`]. Before it exits, the first signal's
//!   abort is in the node's record: the loop's own if it published it, else one this side
//!   puts there itself (the loop may be busy in a checkpoint copy, or stuck), written by
//!   the heartbeat thread within [`PUBLISH_LIMIT`]. When that write cannot complete (a hung
//!   filesystem), the node says so on stderr and exits anyway.
//! - The third exits without waiting for the loop's shut-down (its final record and
//!   messages), but still not before the abort is written, within the same bounds: a
//!   storm of signals (a script's `kill` in a loop) is many escalations within
//!   microseconds, and must not turn a signalled node into a "dead" one. The write takes
//!   milliseconds on a filesystem that answers.
//!
//! None of this touches the shared directory from the signal thread: it takes the stop
//! signals (blocked in every thread, so none is handed to a loop waiting in a hung
//! filesystem call) one at a time and in order, and must stay free to take the next. The
//! escalation runs in a thread of its own and reaches the record only through the
//! heartbeat thread ([`RecordHandle`]).

use super::publisher::RecordHandle;
use super::supervisor::{self, Link};
use crate::logging;
use crate::process::{self as procs, Event, Registry};
use crate::protocol::{AbortInfo, AbortKind};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// After a second signal, the most the node waits for its loop to finish stopping before
/// it exits on its own.
const ESCALATED_EXIT: Duration = Duration::from_secs(5);

/// After a second signal, the most the node waits for its record with the abort to be
/// written (a record write takes milliseconds on a filesystem that answers).
const PUBLISH_LIMIT: Duration = Duration::from_secs(2);

/// The stop signals, as the node handles them.
pub(crate) const STOP_SIGNALS: [i32; 5] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// The abort a stop signal stands for: its kind and the sentence peers and the user read.
/// SIGUSR1/SIGUSR2 (a batch system's time-limit warning) stop every node gracefully, to be
/// resumed.
pub(crate) fn abort_for(sig: i32) -> (AbortKind, String) {
    let reason = if crate::protocol::records::is_time_limit(sig) {
        format!(
            "time limit approaching ({} received): every node stops gracefully; restart the same commands (e.g. requeue the job) to resume",
            procs::signal_name(sig)
        )
    } else {
        format!("interrupted by {}", procs::signal_name(sig))
    };
    (AbortKind::Signal { signal: sig }, reason)
}

/// How the node's stop is going, shared by the node loop and the signal side: the one
/// place that decides the node's exit code (first decision wins) and owns the exit.
pub(crate) struct Stopping {
    rank: u32,
    host: String,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    /// The first stop signal.
    first: Option<i32>,
    /// A second signal came: children are killed, the loop stops without grace.
    escalated: bool,
    /// A third signal came: exit once the abort is written.
    hurry: bool,
    /// The exit code, once decided.
    code: Option<i32>,
    /// The node's live record once it joined, and its cluster in a pipelined run.
    record: Option<(RecordHandle, Option<String>)>,
    /// The node loop returned; its thread exits the process.
    loop_done: bool,
    /// The escalation exits the process.
    exiting: bool,
}

impl Stopping {
    pub(crate) fn new(rank: u32, host: &str) -> Arc<Stopping> {
        Arc::new(Stopping {
            rank,
            host: host.to_string(),
            state: Mutex::default(),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node joined a generation: `record` is where its abort goes.
    pub(crate) fn joined(&self, record: RecordHandle, cluster: Option<String>) {
        self.lock().record = Some((record, cluster));
    }

    /// The node loop stops with `code`. Returns the code the node exits with: `code`, or
    /// the one decided before (by an escalation that found the loop still running).
    pub(crate) fn decide(&self, code: i32) -> i32 {
        *self.lock().code.get_or_insert(code)
    }

    /// Whether a second signal came: commands get no grace any more.
    pub(crate) fn escalated(&self) -> bool {
        self.lock().escalated
    }

    /// The node loop returned and its thread is about to exit the process. Never returns
    /// when an escalation is exiting it already (two threads must not both run `exit`).
    pub(crate) fn loop_done(&self) {
        let mut s = self.lock();
        if s.exiting {
            drop(s);
            park_forever();
        }
        s.loop_done = true;
        self.cv.notify_all();
    }

    fn first_signal(&self, sig: i32) {
        self.lock().first.get_or_insert(sig);
    }

    fn escalate(&self) {
        self.lock().escalated = true;
    }

    fn hurry(&self) {
        self.lock().hurry = true;
        self.cv.notify_all();
    }

    /// Make sure the first signal's abort is in the record: put it there unless the loop
    /// stopped already or the record carries an abort (the loop's own stop, which it
    /// decides). Returns the record to flush, and the abort when it is this side's: it
    /// then decides the exit code, and the loop, if it gets that far, adopts it.
    fn settle(&self) -> (Option<RecordHandle>, Option<AbortInfo>) {
        let mut s = self.lock();
        let record = s.record.as_ref().map(|(r, _)| r.clone());
        let taken = record
            .as_ref()
            .is_some_and(|r| r.read(|rec| rec.abort.is_some()));
        if s.code.is_some() || taken {
            return (record, None);
        }
        let info = self.own_abort(&s);
        if let Some(r) = &record {
            if r.fail_with(info.clone()) != info {
                // The loop's own abort got there first.
                return (record, None);
            }
        }
        let cluster = s.record.as_ref().and_then(|(_, c)| c.clone());
        s.code = Some(
            crate::protocol::abort::consequence(&info, self.rank, cluster.as_deref())
                .0
                .exit_code(),
        );
        (record, Some(info))
    }

    /// The first signal's abort, where the record says the node is.
    fn own_abort(&self, s: &State) -> AbortInfo {
        let (kind, reason) = abort_for(s.first.unwrap_or(libc::SIGTERM));
        let mut info = AbortInfo {
            kind,
            culprit: self.rank,
            culprit_host: self.host.clone(),
            phase: "join".into(),
            iteration: 0,
            reason,
            log: None,
            detected_by: self.rank,
            silent_ms: None,
            at: crate::clock::wall_now(),
            cluster: None,
            detected_in: None,
            dropped: false,
        };
        if let Some((r, c)) = &s.record {
            r.read(|rec| {
                info.culprit_host = rec.host.clone();
                info.iteration = rec.iteration;
                if let Some(p) = rec.phase {
                    info.phase = p.to_string();
                }
            });
            info.cluster = c.clone();
        }
        info
    }

    /// The code to exit with now: the one decided, else the one the record's abort
    /// means (the loop stopping for a reason of its own), else the first signal's.
    fn exit_code(&self, s: &State) -> i32 {
        if let Some(code) = s.code {
            return code;
        }
        let cluster = s.record.as_ref().and_then(|(_, c)| c.clone());
        let abort = s
            .record
            .as_ref()
            .and_then(|(r, _)| r.read(|rec| rec.abort.clone()));
        let info = abort.unwrap_or_else(|| self.own_abort(s));
        crate::protocol::abort::consequence(&info, self.rank, cluster.as_deref())
            .0
            .exit_code()
    }

    /// Wait until the loop is done, a third signal came, or `deadline`. Returns the code
    /// to exit with when this side exits the process (None: the loop's thread does).
    fn wait_to_exit(&self, deadline: Instant) -> Option<i32> {
        let mut s = self.lock();
        while !s.loop_done && !s.hurry {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if s.loop_done {
            return None;
        }
        s.exiting = true;
        Some(self.exit_code(&s))
    }
}

fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// Block the stop signals in the calling thread, and so in every thread it starts from
/// now on: call it before the node's first thread exists. Nothing handles them: the
/// signal thread takes them one at a time, in order ([`supervisor::next_signal`]), and
/// none reaches a thread that waits in a hung filesystem call.
pub(crate) fn block_stop_signals() -> libc::sigset_t {
    supervisor::block_signals(&STOP_SIGNALS).0
}

/// What the signal thread hands the escalation.
pub(crate) struct SignalParts {
    pub(crate) tx: Sender<Event>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) rank: u32,
    pub(crate) supervisor: Option<Arc<Link>>,
    pub(crate) stopping: Arc<Stopping>,
}

pub(crate) fn start_signal_thread(parts: SignalParts) {
    // SIGHUP (a closed terminal or ssh session) stops the node like SIGTERM, with an abort
    // peers see within a poll; SIGUSR1/SIGUSR2 (a batch system's time-limit warning) stop
    // every node gracefully with exit 75, to be resumed by a restart. `nohup` does not
    // help: rl-node handles SIGHUP itself (run it under setsid, tmux or a batch system).
    let set = block_stop_signals();
    // The sender tells a signal passed on by the supervisor from a direct one.
    let mut deliveries = supervisor::Deliveries::new(parts.supervisor.as_ref().map(|l| l.parent));
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut count = 0;
            loop {
                let (sig, sender) = supervisor::next_signal(&set);
                if !deliveries.is_new(sig, sender, Instant::now()) {
                    continue;
                }
                count += 1;
                on_delivery(&parts, count, sig);
            }
        })
        .expect("spawn signal thread");
}

/// The `count`th delivery of a stop signal (`sig`).
fn on_delivery(parts: &SignalParts, count: u32, sig: i32) {
    let rank = parts.rank;
    let name = procs::signal_name(sig);
    match count {
        1 => {
            parts.stopping.first_signal(sig);
            let _ = parts.tx.send(Event::Signal(sig));
        }
        2 => {
            parts.stopping.escalate();
            parts.registry.kill_all_now();
            logging::info(
                rank,
                &format!("second {name}: killing children now and exiting"),
            );
            let stopping = parts.stopping.clone();
            let registry = parts.registry.clone();
            let link = parts.supervisor.clone();
            let deadline = Instant::now() + ESCALATED_EXIT;
            let spawned = std::thread::Builder::new()
                .name("escalation".into())
                .spawn(move || escalate(&stopping, &registry, link.as_deref(), rank, deadline));
            if spawned.is_err() {
                // No thread for the wait: the exit itself cannot wait either.
                parts.stopping.settle();
                let code = parts.stopping.wait_to_exit(Instant::now());
                let code = code.unwrap_or(crate::exit::Cause::Failed.exit_code());
                exit_now(parts.supervisor.as_deref(), &parts.registry, rank, code);
            }
        }
        3 => {
            logging::info(
                rank,
                &format!("third signal ({name}): exiting as soon as the abort is written"),
            );
            parts.stopping.hurry();
        }
        // A storm: each is one more escalation, and there is nothing left to escalate.
        _ => {}
    }
}

/// The second signal's exit: decide the code, get the abort written (bounded), let the
/// loop finish until `deadline` (unless a third signal came), and exit.
fn escalate(
    stopping: &Stopping,
    registry: &Registry,
    link: Option<&Link>,
    rank: u32,
    deadline: Instant,
) {
    let (record, ours) = stopping.settle();
    let written = record.is_none_or(|r| r.flush(PUBLISH_LIMIT));
    if !written {
        say(
            rank,
            format!(
                "the abort could not be written to this node's record within {}s (is the shared directory hung?); exiting without it: peers will find this node's heartbeat still",
                PUBLISH_LIMIT.as_secs()
            ),
        );
    }
    // A loop that could not write (a hung filesystem) will not finish either.
    let deadline = if written { deadline } else { Instant::now() };
    let Some(code) = stopping.wait_to_exit(deadline) else {
        // The loop finished: its thread reports and exits.
        park_forever();
    };
    if let Some(info) = ours {
        // The loop, busy or stuck, will not say why: the node's final report.
        say(rank, info.describe());
    }
    exit_now(link, registry, rank, code);
}

/// Exit with `code` now, after a last SIGKILL to anything the loop started meanwhile.
fn exit_now(link: Option<&Link>, registry: &Registry, rank: u32, code: i32) -> ! {
    registry.kill_all_now();
    // The exit may not complete while a thread waits on a hung filesystem: the supervisor
    // then exits in its place.
    if let Some(link) = link {
        link.exiting(rank, code);
    }
    std::process::exit(code)
}

/// Print an error line without waiting long for it: stderr may be a file on the hung
/// filesystem.
fn say(rank: u32, message: String) {
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("escalation-say".into())
        .spawn(move || {
            logging::error(rank, &message);
            let _ = tx.send(());
        });
    let _ = rx.recv_timeout(Duration::from_millis(500));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, SystemClock};
    use crate::node::publisher::Publisher;
    use crate::node::watchdog::Watchdog;
    use crate::protocol::{NodeState, Phase, RankRecord};

    use crate::node::publisher::tests::on_disk;

    /// Rank 1's record in a tempdir, in phase 1 of iteration 3, its heartbeat an hour away.
    fn record(dir: &std::path::Path) -> (Publisher, std::path::PathBuf) {
        let path = dir.join("rank-1.json");
        let mut rec = RankRecord::vacant("run", 1, 1);
        rec.host = "node-b".into();
        rec.state = NodeState::Running;
        rec.phase = Some(Phase::TrainRollout);
        rec.iteration = 3;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let p = Publisher::start(
            Arc::new(crate::store::Fs),
            clock,
            path.clone(),
            rec,
            Duration::from_secs(3600),
            Watchdog::inert(),
        )
        .unwrap();
        (p, path)
    }

    /// The code a node that got `signals` (the first, then escalations) and had not joined
    /// exits with.
    fn exit_code(signals: &[i32]) -> i32 {
        let s = Stopping::new(1, "node-b");
        for &sig in signals {
            s.first_signal(sig);
        }
        s.settle();
        s.wait_to_exit(Instant::now()).unwrap()
    }

    #[test]
    fn an_escalation_exits_with_the_first_signals_documented_code() {
        assert_eq!(exit_code(&[libc::SIGTERM]), crate::exit::SIGTERM);
        assert_eq!(exit_code(&[libc::SIGINT]), crate::exit::SIGINT);
        assert_eq!(exit_code(&[libc::SIGHUP]), crate::exit::SIGHUP);
        // Never 128 + SIGUSR1 (138): a time-limit warning is exit 75.
        assert_eq!(exit_code(&[libc::SIGUSR1]), crate::exit::TIME_LIMIT);
        assert_eq!(exit_code(&[libc::SIGUSR2]), crate::exit::TIME_LIMIT);
        // A later signal does not replace the first.
        assert_eq!(
            exit_code(&[libc::SIGUSR1, libc::SIGTERM, libc::SIGUSR1]),
            crate::exit::TIME_LIMIT
        );
        assert_eq!(
            exit_code(&[libc::SIGTERM, libc::SIGINT]),
            crate::exit::SIGTERM
        );
    }

    #[test]
    fn the_loops_decision_stands_against_a_later_escalation() {
        let s = Stopping::new(1, "node-b");
        assert_eq!(s.decide(crate::exit::USAGE), crate::exit::USAGE);
        assert_eq!(s.decide(crate::exit::FAILED), crate::exit::USAGE);
        s.first_signal(libc::SIGINT);
        assert!(s.settle().1.is_none(), "nothing of its own to publish");
        assert_eq!(s.wait_to_exit(Instant::now()), Some(crate::exit::USAGE));
    }

    #[test]
    fn an_escalation_that_finds_the_loop_undecided_writes_the_first_signals_abort() {
        let d = tempfile::tempdir().unwrap();
        let (p, path) = record(d.path());
        let s = Stopping::new(1, "here");
        s.joined(p.handle(), None);
        s.first_signal(libc::SIGTERM);
        let (record, ours) = s.settle();
        assert!(record.unwrap().flush(Duration::from_secs(60)));
        let rec = on_disk(&path);
        assert_eq!(rec.state, NodeState::Failed);
        let abort = rec.abort.unwrap();
        assert_eq!(Some(&abort), ours.as_ref());
        assert_eq!(
            abort.kind,
            AbortKind::Signal {
                signal: libc::SIGTERM
            }
        );
        assert_eq!((abort.culprit, abort.detected_by), (1, 1));
        assert_eq!(abort.culprit_host, "node-b", "the record's host");
        assert_eq!(
            (abort.phase.as_str(), abort.iteration),
            ("1 (train-rollout)", 3)
        );
        assert_eq!(abort.reason, "interrupted by SIGTERM");
        // The loop, handling the first signal late or failing meanwhile, is told the code.
        assert_eq!(s.decide(crate::exit::FAILED), 143);
        assert_eq!(s.wait_to_exit(Instant::now()), Some(143));
    }

    #[test]
    fn an_abort_the_loop_put_in_the_record_is_its_stop_not_the_signals() {
        let d = tempfile::tempdir().unwrap();
        let (p, _path) = record(d.path());
        let s = Stopping::new(1, "here");
        s.joined(p.handle(), None);
        let peers = AbortInfo {
            kind: AbortKind::Error,
            culprit: 2,
            culprit_host: "node-c".into(),
            phase: "1 (train-rollout)".into(),
            iteration: 3,
            reason: "the rollout command failed with exit code 7".into(),
            log: None,
            detected_by: 0,
            silent_ms: None,
            at: String::new(),
            cluster: None,
            detected_in: None,
            dropped: false,
        };
        assert_eq!(p.handle().fail_with(peers.clone()), peers);
        s.first_signal(libc::SIGINT);
        let (_, ours) = s.settle();
        assert!(ours.is_none());
        assert_eq!(p.handle().read(|r| r.abort.clone()), Some(peers));
        // Until the loop decides, the record's abort says what stopping means here.
        assert_eq!(
            s.wait_to_exit(Instant::now()),
            Some(crate::exit::PEER_FAILED)
        );
    }

    #[test]
    fn the_escalation_exits_at_its_deadline_on_a_third_signal_or_not_at_all() {
        let s = Stopping::new(1, "here");
        s.first_signal(libc::SIGTERM);
        assert!(
            s.wait_to_exit(Instant::now()).is_some(),
            "the deadline passed"
        );
        let s = Stopping::new(1, "here");
        s.first_signal(libc::SIGTERM);
        s.hurry();
        assert!(s
            .wait_to_exit(Instant::now() + Duration::from_secs(600))
            .is_some());
        let s = Stopping::new(1, "here");
        s.loop_done();
        assert!(
            s.wait_to_exit(Instant::now() + Duration::from_secs(600))
                .is_none(),
            "the loop's thread exits"
        );
    }
}
