//! Threads that take turns: a seeded scheduler that runs real multi-threaded code (the
//! node's driver, its heartbeat thread, fake commands) one thread at a time on simulated
//! time, so that a seed replays the same run exactly.
//!
//! Every thread of a simulation is a task of one [`Sched`]. Exactly one task runs at a
//! time; it gives up its turn at a *turn point* and the scheduler's generator picks the
//! next task from those ready. The turn points are every call to the simulated shared
//! directory ([`crate::store::sim::SimClient`]), every wait ([`Sched::wait`], which the
//! node's waits reach through [`SchedClock`]'s [`Scheduler::wait_turn`]) and the end of a
//! task.
//! Time moves only when every task waits: it jumps to the earliest deadline. So the
//! order of everything the tasks do, and the time each thing happens at, depends on the
//! seed alone. Tasks must not block on anything else (a lock held across a turn point, a
//! channel's blocking receive): those go through [`crate::clock`]'s helpers, which wait
//! here when the clock is a [`SchedClock`].
//!
//! A run ends when every task has ended. It fails, naming the tasks, when every task
//! waits with no deadline (nothing can ever wake them: a deadlock), when simulated time
//! passes the limit (a run that does not end), when the tasks take a million turns without
//! time moving (a spin: a loop that never waits), or when a task panics. The tasks of a
//! failed run stay parked; their threads are leaked.

use crate::clock::{Clock, Scheduler};
use crate::rng::SplitMix64;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::hash::Hasher;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

/// How many of the last turns a failure's trace shows.
const TRACE: usize = 40;

/// How many turns may pass without simulated time moving before the run fails as a spin:
/// a task that loops without ever waiting (a busy loop, in a real process a core at
/// 100 % that never gets anywhere). The busiest instant of a legitimate run (a 256-node
/// join) takes a few thousand.
const SPIN: u64 = 1_000_000;

/// The scheduler. See the module's documentation.
pub struct Sched {
    state: Mutex<State>,
    /// The thread that called [`Sched::run`] waits on this for the end.
    ended: Condvar,
}

struct Task {
    name: String,
    status: Status,
    /// The task waits on this for its turn.
    turn: Arc<Condvar>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Status {
    Ready,
    /// Waiting for a [`Sched::notify`] or, if any, this simulated time.
    Waiting(Option<Duration>),
    Done,
}

struct State {
    now: Duration,
    limit: Duration,
    rng: SplitMix64,
    /// Identifiers drawn by the tasks (nonces, run ids): a stream of their own, so that
    /// drawing one does not change the schedule.
    ids: SplitMix64,
    serial: u64,
    tasks: Vec<Task>,
    running: Option<usize>,
    started: bool,
    end: Option<Result<(), String>>,
    turns: u64,
    /// Turns given since simulated time last moved.
    turns_now: u64,
    /// A digest of every turn (task and time): equal digests, equal schedules.
    digest: std::hash::DefaultHasher,
    recent: VecDeque<String>,
}

impl State {
    /// Every waiting task is ready again (each checks whether what it waits for happened).
    fn wake_all(&mut self) {
        for t in &mut self.tasks {
            if let Status::Waiting(_) = t.status {
                t.status = Status::Ready;
            }
        }
    }
}

thread_local! {
    /// The scheduler and task this thread is, if it is one.
    static CURRENT: RefCell<Option<(Arc<Sched>, usize)>> = const { RefCell::new(None) };
}

/// The scheduler and task of the calling thread, if it is a task.
fn current() -> Option<(Arc<Sched>, usize)> {
    CURRENT.with(|c| c.borrow().clone())
}

/// A turn point for code that holds no [`Sched`] (the simulated shared directory): give
/// up the turn if the calling thread is a task, else nothing.
pub fn turn() {
    if let Some((s, me)) = current() {
        s.give_turn(me, Status::Ready);
    }
}

/// Whether the calling thread is a task of a scheduler.
pub fn is_task() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// Wait for a [`Sched::notify`], if the calling thread is a task (else nothing: callers
/// then wait by other means). Never while holding a lock another task may need.
pub fn wait_for_notify() {
    if let Some((s, me)) = current() {
        s.give_turn(me, Status::Waiting(None));
    }
}

/// Wake every waiting task, if the calling thread is a task.
pub fn notify_current() {
    if let Some((s, _)) = current() {
        s.notify();
    }
}

/// A task's thread: join it for the task's result.
pub struct TaskHandle<T> {
    id: usize,
    sched: Arc<Sched>,
    thread: std::thread::JoinHandle<T>,
}

impl<T> TaskHandle<T> {
    /// The task's result once it has ended (a task waits for it, taking turns; another
    /// thread waits for the run to end first). `Err` if it panicked.
    pub fn join(self) -> std::thread::Result<T> {
        if let Some((s, me)) = current() {
            assert!(Arc::ptr_eq(&s, &self.sched), "a task of another scheduler");
            while s.status(self.id) != Status::Done {
                s.give_turn(me, Status::Waiting(None));
            }
        }
        self.thread.join()
    }
}

impl Sched {
    /// A scheduler at simulated time zero whose runs fail past `limit` of simulated time.
    pub fn new(seed: u64, limit: Duration) -> Arc<Sched> {
        Arc::new(Sched {
            state: Mutex::new(State {
                now: Duration::ZERO,
                limit,
                rng: SplitMix64::new(seed),
                ids: SplitMix64::new(seed ^ 0x1d5_eed5),
                serial: 0,
                tasks: Vec::new(),
                running: None,
                started: false,
                end: None,
                turns: 0,
                turns_now: 0,
                digest: std::hash::DefaultHasher::new(),
                recent: VecDeque::new(),
            }),
            ended: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True simulated time.
    pub fn now(&self) -> Duration {
        self.lock().now
    }

    /// Turns taken so far.
    pub fn turns(&self) -> u64 {
        self.lock().turns
    }

    /// A digest of the schedule so far (which task ran at each turn, and when).
    pub fn digest(&self) -> u64 {
        self.lock().digest.finish()
    }

    /// `n` random bytes in hex, from the seed (for identifiers a real run draws at random).
    pub fn hex(&self, n: usize) -> String {
        let mut st = self.lock();
        (0..n)
            .map(|_| format!("{:02x}", st.ids.next_u64() as u8))
            .collect()
    }

    /// A number that grows with every call (for process ids).
    pub fn serial(&self) -> u64 {
        let mut st = self.lock();
        st.serial += 1;
        st.serial
    }

    /// Start `f` as a task: a thread that runs only in its turns. From a task or before
    /// [`Sched::run`].
    pub fn spawn<T: Send + 'static>(
        self: &Arc<Self>,
        name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<TaskHandle<T>> {
        let (id, turn) = {
            let mut st = self.lock();
            let turn = Arc::new(Condvar::new());
            st.tasks.push(Task {
                name: name.to_string(),
                status: Status::Ready,
                turn: turn.clone(),
            });
            (st.tasks.len() - 1, turn)
        };
        let sched = self.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                CURRENT.with(|c| *c.borrow_mut() = Some((sched.clone(), id)));
                drop(sched.await_turn(sched.lock(), id, &turn));
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                sched.finish(id, result.is_err());
                match result {
                    Ok(v) => v,
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            })?;
        Ok(TaskHandle {
            id,
            sched: self.clone(),
            thread,
        })
    }

    /// Run the tasks until every one has ended (`Ok`) or the run fails (`Err`: a deadlock,
    /// the time limit, a panic; with the last turns). From a thread that is not a task.
    pub fn run(&self) -> Result<(), String> {
        assert!(current().is_none(), "run from outside the tasks");
        let mut st = self.lock();
        assert!(!st.started, "a scheduler runs once");
        st.started = true;
        self.pick(&mut st);
        while st.end.is_none() {
            st = self.ended.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.end.clone().expect("ended")
    }

    /// Wake every waiting task (each checks again whether what it waits for happened).
    pub fn notify(&self) {
        self.lock().wake_all();
    }

    /// Wait (the calling task) until a [`Sched::notify`] or the simulated time `until`.
    pub fn wait(&self, until: Option<Duration>) {
        let (s, me) = current().expect("wait from a task");
        debug_assert!(std::ptr::eq(&*s, self));
        s.give_turn(me, Status::Waiting(until));
    }

    /// Let `d` of simulated time pass (the calling task).
    pub fn sleep(&self, d: Duration) {
        let until = self.now() + d;
        while self.now() < until {
            self.wait(Some(until));
        }
    }

    fn status(&self, id: usize) -> Status {
        self.lock().tasks[id].status
    }

    /// The calling task `me` gives up its turn, as `status`, and waits for its next one.
    fn give_turn(&self, me: usize, status: Status) {
        let mut st = self.lock();
        debug_assert_eq!(st.running, Some(me), "a task runs only in its turn");
        st.tasks[me].status = status;
        self.pick(&mut st);
        let turn = st.tasks[me].turn.clone();
        drop(self.await_turn(st, me, &turn));
    }

    fn await_turn<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        me: usize,
        turn: &Condvar,
    ) -> MutexGuard<'a, State> {
        // After a failed run nobody gets a turn again: the task stays parked.
        while st.running != Some(me) {
            st = turn.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st
    }

    fn finish(&self, me: usize, panicked: bool) {
        let mut st = self.lock();
        st.tasks[me].status = Status::Done;
        if panicked {
            let name = st.tasks[me].name.clone();
            self.fail(&mut st, format!("task {name} panicked"));
            return;
        }
        // A task's end may be what others wait for (a join).
        st.wake_all();
        self.pick(&mut st);
    }

    fn fail(&self, st: &mut State, why: String) {
        let trace: Vec<&str> = st.recent.iter().map(String::as_str).collect();
        let tasks: Vec<String> = st
            .tasks
            .iter()
            .filter(|t| t.status != Status::Done)
            .map(|t| match t.status {
                Status::Waiting(Some(until)) => format!("{} (waits until {until:?})", t.name),
                Status::Waiting(None) => format!("{} (waits for a notify)", t.name),
                _ => format!("{} (ready)", t.name),
            })
            .collect();
        st.end = Some(Err(format!(
            "{why} (simulated time {:?}, turn {}); tasks not ended: {}; the last turns:\n  {}",
            st.now,
            st.turns,
            tasks.join(", "),
            trace.join("\n  ")
        )));
        st.running = None;
        self.ended.notify_all();
    }

    /// Give the next turn: to a ready task picked by the generator; if none is ready, move
    /// time to the earliest deadline and wake the tasks waiting for it.
    fn pick(&self, st: &mut State) {
        if !st.started || st.end.is_some() {
            return;
        }
        loop {
            let ready: Vec<usize> = (0..st.tasks.len())
                .filter(|&i| st.tasks[i].status == Status::Ready)
                .collect();
            if !ready.is_empty() {
                let id = ready[st.rng.below(ready.len() as u64) as usize];
                st.turns += 1;
                st.turns_now += 1;
                if st.turns_now > SPIN {
                    let why = format!(
                        "a spin: {SPIN} turns without simulated time moving (a task loops without waiting)"
                    );
                    self.fail(st, why);
                    return;
                }
                let now = st.now;
                st.digest.write_usize(id);
                st.digest.write_u128(now.as_nanos());
                let line = format!("{:>10.3}s {}", now.as_secs_f64(), st.tasks[id].name);
                if st.recent.len() == TRACE {
                    st.recent.pop_front();
                }
                st.recent.push_back(line);
                st.running = Some(id);
                st.tasks[id].turn.notify_one();
                return;
            }
            let deadline = st
                .tasks
                .iter()
                .filter_map(|t| match t.status {
                    Status::Waiting(until) => until,
                    _ => None,
                })
                .min();
            match deadline {
                _ if st.tasks.iter().all(|t| t.status == Status::Done) => {
                    st.end = Some(Ok(()));
                    st.running = None;
                    self.ended.notify_all();
                    return;
                }
                None => {
                    let stuck: Vec<&str> = st
                        .tasks
                        .iter()
                        .filter(|t| t.status != Status::Done)
                        .map(|t| t.name.as_str())
                        .collect();
                    let why = format!(
                        "deadlock: every task waits with nothing to wake it ({})",
                        stuck.join(", ")
                    );
                    self.fail(st, why);
                    return;
                }
                Some(t) if t > st.limit => {
                    let limit = st.limit;
                    self.fail(st, format!("the run did not end within {limit:?}"));
                    return;
                }
                Some(t) => {
                    if t > st.now {
                        st.turns_now = 0;
                    }
                    st.now = st.now.max(t);
                    let now = st.now;
                    for task in &mut st.tasks {
                        if matches!(task.status, Status::Waiting(Some(u)) if u <= now) {
                            task.status = Status::Ready;
                        }
                    }
                }
            }
        }
    }
}

/// A node's clock under a [`Sched`]: simulated time at `rate` (1.01 runs 1 % fast), and a
/// wall clock that reads `wall_origin` at time zero. Its waits are the scheduler's.
pub struct SchedClock {
    sched: Arc<Sched>,
    origin: Instant,
    rate: f64,
    wall_origin: SystemTime,
}

impl SchedClock {
    pub fn new(sched: Arc<Sched>, rate: f64, wall_origin: SystemTime) -> SchedClock {
        assert!(rate > 0.0, "a clock runs forwards");
        SchedClock {
            sched,
            origin: Instant::now(),
            rate,
            wall_origin,
        }
    }

    /// The true simulated time at which this clock reads `at` (rounded up).
    fn true_time(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.origin).div_f64(self.rate) + Duration::from_nanos(1)
    }
}

impl Clock for SchedClock {
    fn now(&self) -> Instant {
        self.origin + self.since_start()
    }

    fn sleep(&self, d: Duration) {
        self.sched.sleep(d.div_f64(self.rate));
    }

    fn wall(&self) -> SystemTime {
        self.wall_origin + self.sched.now()
    }

    fn since_start(&self) -> Duration {
        self.sched.now().mul_f64(self.rate)
    }

    fn scheduler(&self) -> Option<&dyn Scheduler> {
        Some(self)
    }
}

impl Scheduler for SchedClock {
    fn wait_turn(&self, deadline: Option<Instant>) {
        self.sched.wait(deadline.map(|d| self.true_time(d)));
    }

    fn notify(&self) {
        self.sched.notify();
    }

    fn spawn(
        &self,
        name: &str,
        f: Box<dyn FnOnce() + Send>,
    ) -> std::io::Result<Box<dyn FnOnce() -> bool + Send>> {
        let task = self.sched.spawn(name, f)?;
        Ok(Box::new(move || task.join().is_ok()))
    }

    fn hex(&self, n: usize) -> String {
        self.sched.hex(n)
    }

    fn serial(&self) -> u64 {
        self.sched.serial()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Three tasks that each record their turns; the order they interleave in.
    fn interleaving(seed: u64) -> (Vec<u64>, u64) {
        let sched = Sched::new(seed, Duration::from_secs(60));
        let log = Arc::new(Mutex::new(Vec::new()));
        for id in 0..3 {
            let (s, log) = (sched.clone(), log.clone());
            sched
                .spawn(&format!("t{id}"), move || {
                    for _ in 0..5 {
                        log.lock().unwrap().push(id);
                        turn();
                        s.sleep(Duration::from_millis(10 * (id + 1)));
                    }
                })
                .unwrap();
        }
        sched.run().unwrap();
        let log = log.lock().unwrap().clone();
        (log, sched.digest())
    }

    #[test]
    fn a_seed_replays_the_same_interleaving_and_others_differ() {
        let a = interleaving(7);
        assert_eq!(a, interleaving(7));
        assert_eq!(a.0.len(), 15);
        let others = (8..20).filter(|&s| interleaving(s).0 != a.0).count();
        assert!(others > 0, "the seed chooses the interleaving");
    }

    #[test]
    fn time_jumps_to_the_earliest_deadline_when_every_task_waits() {
        let sched = Sched::new(1, Duration::from_secs(3600));
        let s = sched.clone();
        let woke = Arc::new(AtomicU64::new(0));
        let w = woke.clone();
        sched
            .spawn("sleeper", move || {
                s.sleep(Duration::from_secs(100));
                w.store(s.now().as_secs(), Ordering::SeqCst);
            })
            .unwrap();
        sched.run().unwrap();
        assert_eq!(woke.load(Ordering::SeqCst), 100);
        assert_eq!(sched.now(), Duration::from_secs(100));
    }

    /// A task that keeps taking turns at one instant, never waiting (a node's loop whose
    /// wake-up condition its round never clears), fails the run as a spin, naming it;
    /// one that waits between its turns does not.
    #[test]
    fn a_task_that_loops_without_waiting_fails_as_a_spin() {
        let sched = Sched::new(1, Duration::from_secs(10));
        let s = sched.clone();
        sched
            .spawn("patient", move || s.sleep(Duration::from_secs(5)))
            .unwrap();
        sched
            .spawn("spinner", || loop {
                turn()
            })
            .unwrap();
        let err = sched.run().unwrap_err();
        assert!(
            err.contains("a spin") && err.contains("spinner (ready)"),
            "{err}"
        );
        assert!(err.contains("simulated time 0ns"), "{err}");

        let sched = Sched::new(1, Duration::from_secs(10));
        let s = sched.clone();
        sched
            .spawn("busy but waiting", move || {
                for _ in 0..SPIN / 1_000 {
                    for _ in 0..2_000 {
                        turn();
                    }
                    s.sleep(Duration::from_millis(1));
                }
            })
            .unwrap();
        sched.run().unwrap();
    }

    #[test]
    fn a_deadlock_and_a_run_past_its_limit_fail_naming_the_tasks() {
        let sched = Sched::new(1, Duration::from_secs(10));
        let s = sched.clone();
        sched.spawn("stuck", move || s.wait(None)).unwrap();
        let err = sched.run().unwrap_err();
        assert!(err.contains("deadlock") && err.contains("stuck"), "{err}");

        let sched = Sched::new(1, Duration::from_secs(10));
        let s = sched.clone();
        sched
            .spawn("forever", move || loop {
                s.sleep(Duration::from_secs(1))
            })
            .unwrap();
        let err = sched.run().unwrap_err();
        assert!(err.contains("did not end within 10s"), "{err}");
        assert!(err.contains("forever"), "the trace names the task: {err}");
    }

    #[test]
    fn a_task_joins_another_and_a_notify_wakes_a_waiter() {
        let sched = Sched::new(3, Duration::from_secs(10));
        let flag = Arc::new(Mutex::new(false));
        let (s, f) = (sched.clone(), flag.clone());
        sched
            .spawn("parent", move || {
                let (s2, f2) = (s.clone(), f.clone());
                let child = s
                    .spawn("child", move || {
                        s2.sleep(Duration::from_secs(2));
                        *f2.lock().unwrap() = true;
                        s2.notify();
                        7
                    })
                    .unwrap();
                while !*f.lock().unwrap() {
                    s.wait(None);
                }
                assert_eq!(s.now(), Duration::from_secs(2));
                child.join().unwrap()
            })
            .unwrap();
        sched.run().unwrap();
        assert!(*flag.lock().unwrap());
    }

    #[test]
    fn a_panicking_task_fails_the_run() {
        let sched = Sched::new(1, Duration::from_secs(10));
        sched.spawn("bad", || panic!("boom")).unwrap();
        let err = sched.run().unwrap_err();
        assert!(err.contains("task bad panicked"), "{err}");
    }
}
