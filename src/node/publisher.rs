//! The heartbeat thread: the only writer of this node's live record.
//!
//! It republishes the record every heartbeat interval with a growing sequence number, and
//! at once whenever the node loop changes it (arriving at a barrier, releasing one,
//! aborting), so barrier latency is not tied to the heartbeat interval. Every sixth
//! periodic write it reads the record back first: another process's nonce there means two
//! processes claim this rank. Rank 0 also writes its view of its peers (`observed.json`)
//! with its periodic beats. Records are written without fsync (a live record needs atomic
//! replacement, not durability: docs/shared-directory.md, "Durability"). The watchdog
//! watches each write: one that does not return within `fs-timeout` ends the node like a
//! stuck node loop.

use super::watchdog::Watchdog;
use crate::clock::{self, Clock};
use crate::protocol::{wall_stamp, AbortInfo, NodeState, ObservedFile, RankRecord};
use crate::store::SharedDir;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How often (in periodic heartbeats) the heartbeat thread reads its record back to find
/// another process writing it: one read every 6 beats (30 s at the default interval)
/// instead of one per beat.
const READ_BACK_EVERY: u64 = 6;

/// How long a change made with [`Publisher::soon`] may wait for a write it can share (a
/// barrier arrival, a command's start) before it is written on its own.
pub const FOLD: Duration = Duration::from_millis(20);

struct Shared {
    record: RankRecord,
    dirty: bool,
    /// A change made with [`Publisher::soon`] is written by then at the latest.
    due: Option<Instant>,
    stop: bool,
    written_seq: u64,
    interval: Duration,
    /// Set when another process wrote our record (nonce differs): (host, pid).
    intruder: Option<(String, u32)>,
    last_error: Option<String>,
    /// Rank 0's observations of its peers (`Layout::observed`): written with periodic
    /// heartbeats when they changed, never with the writes a barrier waits for.
    observed: Option<Observed>,
}

struct Observed {
    path: PathBuf,
    ages_ms: Vec<(u32, u64)>,
    changed: bool,
}

pub struct Publisher {
    shared: Arc<(Mutex<Shared>, Condvar)>,
    clock: Arc<dyn Clock>,
    thread: Option<clock::Thread>,
}

/// The record as another thread than the node loop reaches it: a node's signal thread,
/// escalating a second signal while the loop is busy (a checkpoint copy) or stuck, marks
/// the record failed with the first signal's abort itself. Touches no file: the heartbeat
/// thread writes what it changes.
#[derive(Clone)]
pub(crate) struct RecordHandle {
    shared: Arc<(Mutex<Shared>, Condvar)>,
    clock: Arc<dyn Clock>,
}

impl RecordHandle {
    /// Mark the record failed with `abort` unless it carries an abort already, and have it
    /// written at once. Returns the abort the record carries now: the first one wins, as
    /// for `abort.json`.
    pub(crate) fn fail_with(&self, abort: AbortInfo) -> AbortInfo {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        s.record.state = NodeState::Failed;
        let first = s.record.abort.get_or_insert(abort).clone();
        s.dirty = true;
        drop(s);
        clock::notify(&*self.clock, Some(cv));
        first
    }

    /// `f` on the record as it stands (staged changes included).
    pub(crate) fn read<T>(&self, f: impl FnOnce(&RankRecord) -> T) -> T {
        f(&self.shared.0.lock().unwrap().record)
    }

    /// Wait until everything changed so far is on the shared directory, at most `limit`.
    pub(crate) fn flush(&self, limit: Duration) -> bool {
        let (m, cv) = &*self.shared;
        let deadline = self.clock.now() + limit;
        let mut s = m.lock().unwrap();
        while s.dirty || s.due.is_some() || s.written_seq < s.record.seq {
            if self.clock.now() >= deadline {
                return false;
            }
            s = clock::wait_timeout(&*self.clock, m, cv, s, Some(deadline));
        }
        true
    }
}

impl Publisher {
    /// Write the record once (synchronously, so errors surface to the caller), then keep
    /// it fresh from a dedicated thread.
    pub fn start(
        store: Arc<dyn SharedDir>,
        clock: Arc<dyn Clock>,
        path: PathBuf,
        mut record: RankRecord,
        interval: Duration,
        watchdog: Watchdog,
    ) -> std::io::Result<Publisher> {
        record.seq += 1;
        record.wall = wall_stamp(clock.wall());
        store.publish_live_json(&path, &record)?;
        let written_seq = record.seq;
        let shared = Arc::new((
            Mutex::new(Shared {
                record,
                dirty: false,
                due: None,
                stop: false,
                written_seq,
                interval,
                intruder: None,
                last_error: None,
                observed: None,
            }),
            Condvar::new(),
        ));
        let (s, c) = (shared.clone(), clock.clone());
        let thread = clock::spawn(&*clock, "heartbeat", move || {
            run(&*store, &*c, path, s, watchdog)
        })?;
        Ok(Publisher {
            shared,
            clock,
            thread: Some(thread),
        })
    }

    /// Change the record; it is written at once by the heartbeat thread.
    pub fn update(&self, f: impl FnOnce(&mut RankRecord)) {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        f(&mut s.record);
        log_context(&s.record);
        s.dirty = true;
        drop(s);
        clock::notify(&*self.clock, Some(cv));
    }

    /// Change the record and have it written within [`FOLD`]: with the next write if one
    /// comes by then (a phase entry goes out with the barrier arrival or the command
    /// start right after it), on its own otherwise.
    pub fn soon(&self, f: impl FnOnce(&mut RankRecord)) {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        f(&mut s.record);
        log_context(&s.record);
        if s.due.is_none() {
            s.due = Some(self.clock.now() + FOLD);
            drop(s);
            // The heartbeat thread waits until the next beat: it must wait until `due`.
            clock::notify(&*self.clock, Some(cv));
        }
    }

    /// Change the record without forcing a write: it goes out with the next heartbeat.
    pub fn stage(&self, f: impl FnOnce(&mut RankRecord)) {
        let record = &mut self.shared.0.lock().unwrap().record;
        f(record);
        log_context(record);
    }

    /// Rank 0's peer observations, for `path`: written with the next periodic heartbeat.
    pub fn stage_observed(&self, path: &std::path::Path, ages_ms: Vec<(u32, u64)>) {
        let mut s = self.shared.0.lock().unwrap();
        match &mut s.observed {
            Some(o) if o.path == path => {
                o.changed |= o.ages_ms != ages_ms;
                o.ages_ms = ages_ms;
            }
            slot => {
                *slot = Some(Observed {
                    path: path.to_path_buf(),
                    ages_ms,
                    changed: true,
                })
            }
        }
    }

    pub fn set_interval(&self, interval: Duration) {
        let (m, cv) = &*self.shared;
        m.lock().unwrap().interval = interval;
        clock::notify(&*self.clock, Some(cv));
    }

    pub fn intruder(&self) -> Option<(String, u32)> {
        self.shared.0.lock().unwrap().intruder.clone()
    }

    pub fn last_error(&self) -> Option<String> {
        self.shared.0.lock().unwrap().last_error.clone()
    }

    /// Wait until everything changed so far is on the shared directory, at most `limit`.
    pub fn flush(&self, limit: Duration) -> bool {
        self.handle().flush(limit)
    }

    /// The record for another thread (see [`RecordHandle`]).
    pub(crate) fn handle(&self) -> RecordHandle {
        RecordHandle {
            shared: self.shared.clone(),
            clock: self.clock.clone(),
        }
    }

    /// Final write and stop. Bounded: a hung filesystem must not keep the node alive.
    pub fn finish(mut self, f: impl FnOnce(&mut RankRecord), limit: Duration) -> bool {
        self.update(f);
        let ok = self.flush(limit);
        let (m, cv) = &*self.shared;
        m.lock().unwrap().stop = true;
        clock::notify(&*self.clock, Some(cv));
        if ok {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        ok
    }
}

fn run(
    store: &dyn SharedDir,
    clock: &dyn Clock,
    path: PathBuf,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    watchdog: Watchdog,
) {
    let (m, cv) = &*shared;
    let mut next_beat = clock.now();
    // Periodic beats written so far, for the read-back (at the first and every
    // READ_BACK_EVERY-th after it).
    let mut beats: u64 = 0;
    loop {
        let (record, read_back, observed) = {
            let mut s = m.lock().unwrap();
            next_beat = next_beat.min(clock.now() + s.interval);
            loop {
                if s.stop && !s.dirty {
                    return;
                }
                if s.dirty {
                    break;
                }
                let now = clock.now();
                if now >= next_beat || s.due.is_some_and(|d| now >= d) {
                    break;
                }
                let until = s.due.map_or(next_beat, |d| d.min(next_beat));
                s = clock::wait_timeout(clock, m, cv, s, Some(until));
            }
            let periodic = !s.dirty && s.due.is_none();
            s.dirty = false;
            s.due = None;
            s.record.seq += 1;
            s.record.wall = wall_stamp(clock.wall());
            next_beat = clock.now() + s.interval;
            let observed = match &mut s.observed {
                Some(o) if periodic && o.changed => {
                    o.changed = false;
                    Some((o.path.clone(), o.ages_ms.clone()))
                }
                _ => None,
            };
            // A second process is found within a few heartbeats without a read per beat.
            let read_back = periodic && beats.is_multiple_of(READ_BACK_EVERY);
            beats += u64::from(periodic);
            (s.record.clone(), read_back, observed)
        };
        let (on_disk, result) = watchdog.heartbeat(|| {
            let on_disk = read_back
                .then(|| store.read_json::<RankRecord>(&path).ok().flatten())
                .flatten();
            let result = publish(store, &path, &record);
            if let Some((path, ages)) = &observed {
                // For `status` only: a failure here is not the record's.
                let _ = store.publish_live_json(path, &ObservedFile { ages_ms: ages });
            }
            (on_disk, result)
        });
        // Someone else writing our record means a second process claims this rank.
        if let Some(on_disk) = on_disk {
            if on_disk.nonce != record.nonce && on_disk.gen == record.gen {
                let mut s = m.lock().unwrap();
                s.intruder = Some((on_disk.host.clone(), on_disk.pid));
            }
        }
        let mut s = m.lock().unwrap();
        match result {
            Ok(()) => {
                s.written_seq = s.written_seq.max(record.seq);
                s.last_error = None;
            }
            Err((error, in_place)) => {
                if in_place {
                    s.written_seq = s.written_seq.max(record.seq);
                }
                s.last_error = Some(error);
            }
        }
        drop(s);
        clock::notify(clock, Some(cv));
    }
}

/// Publish the record; on failure, the error and whether the record went out in place.
fn publish(
    store: &dyn SharedDir,
    path: &std::path::Path,
    record: &RankRecord,
) -> Result<(), (String, bool)> {
    store.publish_live_json(path, record).map_err(|e| {
        let error = format!("{e} (writing {})", path.display());
        // A stopping node that cannot create files (full disk, quota) still tells its
        // peers why, over the record it already has (see `write_in_place`).
        match record.abort.is_some() || record.state.is_terminal() {
            true => match write_in_place(store, path, record) {
                Ok(()) => (error, true),
                Err(e2) => (format!("{error}; writing it in place: {e2}"), false),
            },
            false => (error, false),
        }
    })
}

/// Overwrite the record in place (`SharedDir::overwrite_in_place`), as little of it as
/// peers need if the whole does not fit: identity, state, and the abort with a short reason.
fn write_in_place(
    store: &dyn SharedDir,
    path: &std::path::Path,
    record: &RankRecord,
) -> std::io::Result<()> {
    match store.overwrite_json_in_place(path, record) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::FileTooLarge | std::io::ErrorKind::StorageFull
            ) =>
        {
            let mut slim = serde_json::to_value(record).map_err(std::io::Error::other)?;
            if let Some(reason) = slim.pointer_mut("/abort/reason") {
                if let Some(text) = reason.as_str() {
                    // The cause, without the path ("… (writing /…/rank-1.json)").
                    let short = text.split(" (writing ").next().unwrap_or(text);
                    *reason = short.chars().take(160).collect::<String>().into();
                }
            }
            strip_defaults(&mut slim);
            store.overwrite_json_in_place(path, &slim)
        }
        other => other,
    }
}

/// Drop what readers default anyway (nulls, empty lists, the holder details and
/// barrier marks of a node that is stopping).
fn strip_defaults(v: &mut serde_json::Value) {
    if let Some(obj) = v.as_object_mut() {
        for key in ["machine", "pid_start", "arrived", "released", "log"] {
            obj.remove(key);
        }
        obj.retain(|_, x| !(x.is_null() || x.as_array().is_some_and(|a| a.is_empty())));
        obj.values_mut().for_each(strip_defaults);
    }
}

/// The node's JSON log lines say what its record says it is doing.
fn log_context(r: &RankRecord) {
    if !crate::logging::json() {
        return;
    }
    crate::logging::set_context(crate::logging::Context {
        run: r.run_id.clone(),
        generation: r.gen,
        iteration: r.iteration,
        phase: r.phase.map(|p| p.name()),
        host: r.host.clone(),
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::protocol::Phase;
    use crate::store::Fs;

    /// The record at `path` as a reader finds it (also for `node::signals`' tests).
    pub(crate) fn on_disk(path: &std::path::Path) -> RankRecord {
        crate::store::fs::read_json::<RankRecord>(path)
            .unwrap()
            .unwrap()
    }

    /// With a heartbeat far away, only `soon`'s deadline or a forced write can write.
    fn start(dir: &std::path::Path) -> (Publisher, PathBuf) {
        let path = dir.join("rank-0.json");
        let clock: Arc<dyn Clock> = Arc::new(clock::SystemClock);
        let p = Publisher::start(
            Arc::new(Fs),
            clock,
            path.clone(),
            RankRecord::vacant("run", 1, 0),
            Duration::from_secs(3600),
            Watchdog::inert(),
        )
        .unwrap();
        (p, path)
    }

    #[test]
    fn a_change_made_soon_shares_the_next_forced_write() {
        let d = tempfile::tempdir().unwrap();
        let (p, path) = start(d.path());
        // The heartbeat thread beats once as it starts; after that, an hour of quiet.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while on_disk(&path).seq < 2 {
            assert!(std::time::Instant::now() < deadline, "no first beat");
            std::thread::sleep(Duration::from_millis(5));
        }
        let first = on_disk(&path).seq;
        p.soon(|r| r.phase = Some(Phase::TrainRollout));
        p.update(|r| r.iteration = 7);
        assert!(p.flush(Duration::from_secs(60)));
        let r = on_disk(&path);
        assert_eq!((r.phase, r.iteration), (Some(Phase::TrainRollout), 7));
        assert_eq!(
            r.seq,
            first + 1,
            "the phase and the forced change in one write"
        );
    }

    #[test]
    fn a_change_made_soon_is_written_on_its_own_when_nothing_else_comes() {
        let d = tempfile::tempdir().unwrap();
        let (p, path) = start(d.path());
        p.soon(|r| r.phase = Some(Phase::TrainRollout));
        // No forced write follows and the heartbeat is an hour away: only FOLD's deadline
        // can write it (waited for with a generous limit, not timed).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while on_disk(&path).phase != Some(Phase::TrainRollout) {
            assert!(std::time::Instant::now() < deadline, "never written");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
