//! Jobs: long work the node's loop hands to a thread of its own and waits on while it goes
//! on watching, as every wait does (a peer's abort or death, a signal, the other cluster):
//! the built-in merge and the checkpoint's publication (its copy or move, its hashes and
//! its switch of `models/LATEST`). The result comes back to the loop, which wakes for it
//! at once.
//!
//! A job pets its own handle of the node's watchdog (`Watchdog::for_job`): the loop's pets
//! while it waits must not hide a job stuck in a filesystem call, which ends the node at
//! `fs-timeout` as the loop stuck in one would.
//!
//! A job the loop stopped waiting on (the node stops: an abort, a signal) is cancelled:
//! its fence refuses every commit from then on, so the work left running until the
//! process exits never commits anything its node no longer stands behind. (In the
//! simulator a node is a task, not a process, and the job would otherwise outlive it.)

use super::watchdog::Watchdog;
use super::{Interrupt, Node, Stop};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A job's cancellation, as the job sees it: set once the node stopped waiting on it.
#[derive(Clone, Default)]
pub(super) struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub(super) fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// `fence`, refusing every commit once the job is cancelled.
    pub(super) fn fenced<A>(
        &self,
        fence: impl Fn(A) -> Result<(), String> + Send + Sync + 'static,
    ) -> impl Fn(A) -> Result<(), String> + Send + Sync + 'static {
        let cancel = self.clone();
        move |site| {
            if cancel.is_set() {
                return Err(
                    "this node stopped while the job ran; it commits nothing more".to_string(),
                );
            }
            fence(site)
        }
    }
}

impl Node {
    /// Run `work` as the job `name` and wait for what it returns, watching as every wait
    /// does; `Ok(None)` if it panicked. A stop while it runs cancels it (see the module's
    /// documentation). `work` gets its own handle of the node's watchdog to pet, so that
    /// a job stuck in a filesystem call ends the node as the loop stuck in one would.
    pub(super) fn job<T: Send + 'static>(
        &mut self,
        name: &'static str,
        work: impl FnOnce(Cancel, Watchdog) -> T + Send + 'static,
    ) -> Result<Option<T>, Stop> {
        let (tx, rx) = std::sync::mpsc::channel();
        let cancel = Cancel::default();
        let watchdog = self.watchdog.for_job(name);
        let (wake, clock, theirs) = (self.wake.clone(), self.clock.clone(), cancel.clone());
        // A thread of the clock's: a task that takes turns, in a simulation.
        crate::clock::spawn(&*self.clock, name, move || {
            let _ = tx.send(work(theirs, watchdog));
            let _ = wake.send(super::Event::Wake);
            crate::clock::notify(&*clock, None);
        })
        .unwrap_or_else(|e| panic!("spawn the {name} job: {e}"));
        let far = self.clock.now() + Duration::from_secs(365 * 24 * 3600);
        let got = self.wait_for(far, |_| match rx.try_recv() {
            Ok(r) => Ok(Some(Some(r))),
            Err(std::sync::mpsc::TryRecvError::Empty) => Ok(None),
            // Dropped without a result: it panicked.
            Err(std::sync::mpsc::TryRecvError::Disconnected) => Ok(Some(None)),
        });
        self.watchdog.job_over();
        match got {
            Ok(r) => Ok(r),
            Err(Interrupt::Stop(s)) => {
                cancel.0.store(true, Ordering::SeqCst);
                Err(s)
            }
            Err(Interrupt::Deadline) => unreachable!("no deadline"),
        }
    }
}
