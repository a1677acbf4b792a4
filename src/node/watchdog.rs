//! The deadline enforcer that does no filesystem I/O.
//!
//! Any call on a hard-mounted NFS whose server is gone can block forever, in the node
//! loop as anywhere. The loop pets this watchdog with a note of what it is about to do;
//! if it goes silent for `fs-timeout`, the watchdog kills the children's process groups
//! and exits the process, naming the operation that hung.

use super::procs::Registry;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Watchdog {
    state: Arc<Mutex<(Instant, &'static str, bool)>>,
}

impl Watchdog {
    pub fn start(rank: u32, limit: Duration, registry: Arc<Registry>) -> Watchdog {
        let state = Arc::new(Mutex::new((Instant::now(), "starting", true)));
        let s = state.clone();
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(250).min(limit / 4).max(Duration::from_millis(10)));
                    let (since, what, armed) = *s.lock().unwrap();
                    if !armed {
                        continue;
                    }
                    let stuck = since.elapsed();
                    if stuck > limit {
                        crate::logging::error(
                            rank,
                            &format!(
                                "stuck for {:.0}s while {what} (fs-timeout is {}): the shared directory is probably unreachable; killing children and exiting",
                                stuck.as_secs_f64(),
                                humantime::format_duration(limit)
                            ),
                        );
                        registry.signal_all(libc::SIGTERM);
                        std::thread::sleep(Duration::from_millis(500));
                        registry.signal_all(libc::SIGKILL);
                        std::process::exit(crate::exit::DEADLINE);
                    }
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
