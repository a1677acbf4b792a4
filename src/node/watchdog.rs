//! The deadline enforcer that does no filesystem I/O.
//!
//! Any call on a hard-mounted NFS whose server is gone can block forever, in the node
//! loop as anywhere. The loop pets this watchdog with a note of what it is about to do;
//! if it goes silent for `fs-timeout`, the watchdog ends the node, naming the operation
//! that hung. Its thread may itself be the only one of the process still running, so the
//! order is: tell the supervisor and the guardian (pipes), signal the commands, and only
//! then print (stderr may be a file on the hung filesystem too). The process then exits
//! with 4, which the kernel completes only once the stuck call returns; the supervisor
//! exits 4 for it meanwhile.

use super::procs::Registry;
use super::supervisor::Link;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Watchdog {
    state: Arc<Mutex<(Instant, &'static str, bool)>>,
}

impl Watchdog {
    pub fn start(
        rank: u32,
        limit: Duration,
        registry: Arc<Registry>,
        supervisor: Option<Link>,
    ) -> Watchdog {
        let state = Arc::new(Mutex::new((Instant::now(), "starting", true)));
        let s = state.clone();
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(
                    Duration::from_millis(250)
                        .min(limit / 4)
                        .max(Duration::from_millis(10)),
                );
                let (since, what, armed) = *s.lock().unwrap();
                if !armed {
                    continue;
                }
                let stuck = since.elapsed();
                if stuck > limit {
                    if let Some(link) = &supervisor {
                        link.stuck(rank, stuck, limit, what);
                    }
                    registry.guardian_kill_now();
                    registry.signal_all(libc::SIGTERM);
                    let message = format!(
                        "error: stuck for {:.0}s while {what} (fs-timeout is {}): the shared directory is probably unreachable; killing children and exiting",
                        stuck.as_secs_f64(),
                        humantime::format_duration(limit)
                    );
                    // Not awaited: a print blocked on a hung stderr must not hold up the rest.
                    let _ = std::thread::Builder::new()
                        .name("watchdog-say".into())
                        .spawn(move || super::say(rank, &message));
                    std::thread::sleep(Duration::from_millis(500));
                    registry.kill_all_now();
                    // No exit handlers or buffer flushing: nothing more may wait on anything.
                    unsafe { libc::_exit(crate::exit::DEADLINE) };
                }
            })
            .expect("spawn watchdog thread");
        Watchdog { state }
    }

    pub fn pet(&self, what: &'static str) {
        let mut s = self.state.lock().unwrap();
        s.0 = Instant::now();
        s.1 = what;
        s.2 = true;
    }

    pub fn disarm(&self) {
        self.state.lock().unwrap().2 = false;
    }
}
