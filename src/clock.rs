//! Time as the node sees it, behind one trait so that a simulation can run the node's
//! timing on simulated time.
//!
//! - [`SystemClock`] is the real one: `Instant::now`, `thread::sleep`, `SystemTime::now`.
//! - `SimClock` (with the `sim` feature) is simulated: time moves only when someone sleeps
//!   or the simulator advances it, and it can run fast or slow and have its wall clock
//!   skewed, as the clocks of different machines do.
//! - `sched::SchedClock` (with the `sim` feature) is simulated time under a scheduler whose
//!   threads take turns: the node's waits ([`recv_timeout`], [`wait_timeout`]) and threads
//!   ([`spawn`]) go through the clock's [`Scheduler`] so that they take turns there.
//!
//! This module defines the [`Scheduler`] seam and the scheduler implements it: the clock
//! depends on no simulator. Without the `sim` feature no clock has a scheduler, and every
//! helper below is the OS's primitive.

use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

pub trait Clock: Send + Sync {
    /// Monotonic now: deadlines and liveness are measured with it.
    fn now(&self) -> Instant;

    /// Wait `d` of this clock's time.
    fn sleep(&self, d: Duration);

    /// Wall-clock time: only for what people read (timestamps in journals and logs), never
    /// for a decision between nodes.
    fn wall(&self) -> SystemTime;

    /// Monotonic time since this clock's origin: what the protocol core is fed.
    fn since_start(&self) -> Duration;

    /// How long ago `since`, an instant of this clock, was.
    fn elapsed(&self, since: Instant) -> Duration {
        self.now().saturating_duration_since(since)
    }

    /// The scheduler this clock's threads take turns under (`None`: the OS's threads).
    #[cfg(feature = "sim")]
    fn scheduler(&self) -> Option<&dyn Scheduler> {
        None
    }
}

/// Threads that take turns on a clock's time (the simulator's `sched`): what a clock that
/// has one routes its waits, wakes and threads through instead of the OS's.
pub trait Scheduler: Send + Sync {
    /// Give up the calling task's turn until a [`Scheduler::notify`] or `deadline` (of
    /// the clock's time).
    fn wait_turn(&self, deadline: Option<Instant>);

    /// Wake every waiting task.
    fn notify(&self);

    /// Start `f` as a task named `name`; what joins it (false if it panicked).
    fn spawn(
        &self,
        name: &str,
        f: Box<dyn FnOnce() + Send>,
    ) -> std::io::Result<Box<dyn FnOnce() -> bool + Send>>;

    /// `n` random bytes in hex, from the simulation's seed (for identifiers a real run
    /// draws at random), so that a seed replays the same run.
    fn hex(&self, n: usize) -> String;

    /// A number that grows with every call (for process ids).
    fn serial(&self) -> u64;
}

/// `clock`'s scheduler, if it has one: never without the `sim` feature, so that the
/// scheduler's branches below fold away in a release binary.
#[inline(always)]
pub(crate) fn scheduler(clock: &dyn Clock) -> Option<&dyn Scheduler> {
    #[cfg(feature = "sim")]
    return clock.scheduler();
    #[cfg(not(feature = "sim"))]
    {
        let _ = clock;
        None
    }
}

/// Receive from `rx`, waiting at most `timeout` of `clock`'s time.
pub fn recv_timeout<T>(
    clock: &dyn Clock,
    rx: &Receiver<T>,
    timeout: Duration,
) -> Result<T, RecvTimeoutError> {
    let Some(s) = scheduler(clock) else {
        return rx.recv_timeout(timeout);
    };
    let deadline = clock.now() + timeout;
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) if clock.now() >= deadline => {
                return Err(RecvTimeoutError::Timeout)
            }
            Err(TryRecvError::Empty) => s.wait_turn(Some(deadline)),
        }
    }
}

/// `cv.wait_timeout` until `deadline` of `clock`'s time (`None`: no deadline), for the
/// `guard` of `lock`. May wake early, as a condition variable may: callers check again.
pub fn wait_timeout<'a, T>(
    clock: &dyn Clock,
    lock: &'a Mutex<T>,
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    deadline: Option<Instant>,
) -> MutexGuard<'a, T> {
    if let Some(s) = scheduler(clock) {
        drop(guard);
        s.wait_turn(deadline);
        return lock.lock().unwrap();
    }
    match deadline {
        None => cv.wait(guard).unwrap(),
        Some(d) => {
            let left = d.saturating_duration_since(clock.now());
            cv.wait_timeout(guard, left).unwrap().0
        }
    }
}

/// Wake whoever waits on `cv`, through [`wait_timeout`] or [`recv_timeout`] too.
pub fn notify(clock: &dyn Clock, cv: Option<&Condvar>) {
    if let Some(cv) = cv {
        cv.notify_all();
    }
    if let Some(s) = scheduler(clock) {
        s.notify();
    }
}

/// A thread started by [`spawn`].
pub enum Thread {
    Os(std::thread::JoinHandle<()>),
    /// A task of a [`Scheduler`]: what joins it.
    Task(Box<dyn FnOnce() -> bool + Send>),
}

impl Thread {
    /// Wait for the thread's end (taking turns, under a scheduler); false if it panicked.
    pub fn join(self) -> bool {
        match self {
            Thread::Os(h) => h.join().is_ok(),
            Thread::Task(join) => join(),
        }
    }
}

/// Start a thread named `name`: an OS thread, or a task of `clock`'s scheduler.
pub fn spawn(
    clock: &dyn Clock,
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<Thread> {
    match scheduler(clock) {
        Some(s) => s.spawn(name, Box::new(f)).map(Thread::Task),
        None => std::thread::Builder::new()
            .name(name.to_string())
            .spawn(f)
            .map(Thread::Os),
    }
}

/// Now, as records and journals stamp it ([`crate::protocol::wall_stamp`]), for code
/// that holds no [`Clock`] (checkpoint manifests, repairs, the supervisor).
pub fn wall_now() -> String {
    crate::protocol::wall_stamp(SystemTime::now())
}

/// The machine's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

fn origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d)
    }

    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }

    fn since_start(&self) -> Duration {
        origin().elapsed()
    }
}

/// A simulated clock. Its time is simulated time (advanced by [`SimClock::advance`] or
/// by sleeping) scaled by its rate: a rate of 1.01 runs 1 % fast. Its wall clock is the
/// simulated time plus a fixed skew from an arbitrary epoch.
#[cfg(feature = "sim")]
#[derive(Debug)]
pub struct SimClock {
    origin: Instant,
    /// Simulated (true) time since the origin.
    elapsed: Mutex<Duration>,
    rate: f64,
    wall_origin: SystemTime,
}

#[cfg(feature = "sim")]
impl SimClock {
    /// A clock at simulated time zero, running at `rate` (1.0: exact), whose wall clock
    /// reads `wall_origin` at time zero.
    pub fn new(rate: f64, wall_origin: SystemTime) -> SimClock {
        assert!(rate > 0.0, "a clock runs forwards");
        SimClock {
            origin: Instant::now(),
            elapsed: Mutex::new(Duration::ZERO),
            rate,
            wall_origin,
        }
    }

    /// Move true simulated time forwards by `d`.
    pub fn advance(&self, d: Duration) {
        *self.elapsed.lock().unwrap() += d;
    }

    /// True simulated time since the origin (what the simulator schedules by).
    pub fn true_elapsed(&self) -> Duration {
        *self.elapsed.lock().unwrap()
    }
}

#[cfg(feature = "sim")]
impl Clock for SimClock {
    fn now(&self) -> Instant {
        self.origin + self.since_start()
    }

    fn sleep(&self, d: Duration) {
        // `d` of this clock's time is d / rate of true time.
        self.advance(d.div_f64(self.rate));
    }

    fn wall(&self) -> SystemTime {
        self.wall_origin + self.true_elapsed()
    }

    fn since_start(&self) -> Duration {
        self.true_elapsed().mul_f64(self.rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "sim")]
    #[test]
    fn a_simulated_clock_moves_only_when_told_and_at_its_rate() {
        let fast = SimClock::new(1.01, SystemTime::UNIX_EPOCH);
        let t0 = fast.now();
        assert_eq!(fast.now(), t0, "no real time passes on a simulated clock");
        fast.advance(Duration::from_secs(100));
        assert_eq!(fast.since_start(), Duration::from_secs(101));
        assert_eq!(fast.now() - t0, Duration::from_secs(101));
        assert_eq!(
            fast.wall(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(100)
        );
        // Sleeping 10.1 s of a 1 % fast clock takes 10 s of true time.
        fast.sleep(Duration::from_millis(10_100));
        assert_eq!(fast.true_elapsed(), Duration::from_secs(110));
    }

    #[test]
    fn the_system_clock_is_monotonic() {
        let c = SystemClock;
        let (a, b) = (c.since_start(), c.since_start());
        assert!(b >= a);
        assert!(c.now() <= Instant::now());
    }
}
