//! The deadline enforcer that does no filesystem I/O.
//!
//! Any call on a hard-mounted NFS whose server is gone can block forever, in the node
//! loop as anywhere. The loop pets this watchdog with a note of what it is about to do,
//! and the heartbeat thread marks each write of the node's record; if the loop goes silent
//! or a heartbeat write does not return for `fs-timeout`, the watchdog ends the node,
//! naming the operation that hung. (A node with no peer to poll, waiting on its command,
//! touches the shared directory only through its heartbeat.) Its thread may itself be the
//! only one of the process still running, so the order is: tell the supervisor and the
//! guardian (pipes), signal the commands, and only then print (stderr may be a file on the
//! hung filesystem too). The process then exits with 4, which the kernel completes only
//! once the stuck call returns; the supervisor exits 4 for it meanwhile.

use super::procs::Registry;
use super::supervisor::Link;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct State {
    /// The node loop's last pet, and what it was about to do.
    petted: Instant,
    what: &'static str,
    armed: bool,
    /// When the heartbeat write still in progress began.
    heartbeat: Option<Instant>,
    /// While a job runs beside the loop (`Watchdog::for_job`): its last pet, and what it
    /// was about to do. The loop's own pets go on meanwhile and must not hide a job stuck
    /// in a call.
    job: Option<(Instant, &'static str)>,
}

impl State {
    /// What has been stuck for longer than `limit`, and for how long.
    fn stuck(&self, limit: Duration) -> Option<(Duration, &'static str)> {
        if !self.armed {
            return None;
        }
        let heartbeat = self
            .heartbeat
            .map(|since| (since.elapsed(), "writing the heartbeat record"));
        let job = self.job.map(|(petted, what)| (petted.elapsed(), what));
        [Some((self.petted.elapsed(), self.what)), heartbeat, job]
            .into_iter()
            .flatten()
            .filter(|(stuck, _)| *stuck > limit)
            .max_by_key(|(stuck, _)| *stuck)
    }
}

#[derive(Clone)]
pub struct Watchdog {
    state: Arc<Mutex<State>>,
    /// A job's handle (`Watchdog::for_job`): its pets are the job's, not the loop's.
    job: bool,
}

impl Watchdog {
    pub fn start(
        rank: u32,
        limit: Duration,
        registry: Arc<Registry>,
        supervisor: Option<Arc<Link>>,
    ) -> Watchdog {
        let state = Arc::new(Mutex::new(State {
            petted: Instant::now(),
            what: "starting",
            armed: true,
            heartbeat: None,
            job: None,
        }));
        let s = state.clone();
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(
                    Duration::from_millis(250)
                        .min(limit / 4)
                        .max(Duration::from_millis(10)),
                );
                let Some((stuck, what)) = s.lock().unwrap().stuck(limit) else {
                    continue;
                };
                if let Some(link) = &supervisor {
                    link.stuck(rank, stuck, limit, what);
                }
                registry.guardian_kill_now();
                registry.signal_all(rustix::process::Signal::TERM);
                let message = format!(
                    "stuck for {:.0}s while {what} (fs-timeout is {}): the shared directory is probably unreachable; killing children and exiting",
                    stuck.as_secs_f64(),
                    humantime::format_duration(limit)
                );
                // Not awaited: a print blocked on a hung stderr must not hold up the rest.
                let _ = std::thread::Builder::new()
                    .name("watchdog-say".into())
                    .spawn(move || crate::logging::error(rank, &message));
                std::thread::sleep(Duration::from_millis(500));
                registry.kill_all_now();
                // No exit handlers or buffer flushing: nothing more may wait on anything.
                // SAFETY: _exit takes only a status and has no preconditions; that it runs
                // no destructors or exit handlers is the point here.
                unsafe { libc::_exit(crate::exit::Cause::Deadline.exit_code()) };
            })
            .expect("spawn watchdog thread");
        Watchdog { state, job: false }
    }

    /// A watchdog that never fires: for a node run inside another process (the
    /// simulator's, and unit tests'), where ending the process would end every node in it.
    #[cfg(any(test, feature = "sim"))]
    pub fn inert() -> Watchdog {
        Watchdog {
            state: Arc::new(Mutex::new(State {
                petted: Instant::now(),
                what: "starting",
                armed: false,
                heartbeat: None,
                job: None,
            })),
            job: false,
        }
    }

    pub fn pet(&self, what: &'static str) {
        let mut s = self.state.lock().unwrap();
        if self.job {
            // Only while the job is watched: a job its node stopped waiting on is not.
            if let Some(job) = s.job.as_mut() {
                *job = (Instant::now(), what);
            }
            return;
        }
        s.petted = Instant::now();
        s.what = what;
        s.armed = true;
    }

    /// Watch a job that runs beside the loop, from now until [`Watchdog::job_over`]: the
    /// handle for the job to pet, which it must do as often as the loop would.
    pub fn for_job(&self, what: &'static str) -> Watchdog {
        self.state.lock().unwrap().job = Some((Instant::now(), what));
        Watchdog {
            state: self.state.clone(),
            job: true,
        }
    }

    /// The job is over, or no longer waited on.
    pub fn job_over(&self) {
        self.state.lock().unwrap().job = None;
    }

    /// Run `write`, one heartbeat write of the node's record, under watch.
    pub fn heartbeat<T>(&self, write: impl FnOnce() -> T) -> T {
        self.state.lock().unwrap().heartbeat = Some(Instant::now());
        let result = write();
        self.state.lock().unwrap().heartbeat = None;
        result
    }

    pub fn disarm(&self) {
        self.state.lock().unwrap().armed = false;
    }
}
