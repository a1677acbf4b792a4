//! The heartbeat thread: the only writer of this node's live record.
//!
//! It republishes the record every heartbeat interval with a growing sequence number, and
//! at once whenever the node loop changes it (arriving at a barrier, releasing one,
//! aborting), so barrier latency is not tied to the heartbeat interval. Before each
//! periodic write it reads the record back: another process's nonce there means two
//! processes claim this rank. The watchdog watches each write: one that does not return
//! within `fs-timeout` ends the node like a stuck node loop.

use super::watchdog::Watchdog;
use crate::protocol::RankRecord;
use crate::store;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Shared {
    record: RankRecord,
    dirty: bool,
    stop: bool,
    written_seq: u64,
    interval: Duration,
    /// Set when another process wrote our record (nonce differs): (host, pid).
    intruder: Option<(String, u32)>,
    last_error: Option<String>,
}

pub struct Publisher {
    shared: Arc<(Mutex<Shared>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publisher {
    /// Write the record once (synchronously, so errors surface to the caller), then keep
    /// it fresh from a dedicated thread.
    pub fn start(
        path: PathBuf,
        mut record: RankRecord,
        interval: Duration,
        watchdog: Watchdog,
    ) -> std::io::Result<Publisher> {
        record.seq += 1;
        record.wall = crate::protocol::wall_now();
        store::publish_json(&path, &record)?;
        let written_seq = record.seq;
        let shared = Arc::new((
            Mutex::new(Shared {
                record,
                dirty: false,
                stop: false,
                written_seq,
                interval,
                intruder: None,
                last_error: None,
            }),
            Condvar::new(),
        ));
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || run(path, s, watchdog))?;
        Ok(Publisher {
            shared,
            thread: Some(thread),
        })
    }

    /// Change the record; it is written at once by the heartbeat thread.
    pub fn update(&self, f: impl FnOnce(&mut RankRecord)) {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        f(&mut s.record);
        s.dirty = true;
        cv.notify_all();
    }

    /// Change the record without forcing a write: it goes out with the next heartbeat.
    pub fn stage(&self, f: impl FnOnce(&mut RankRecord)) {
        f(&mut self.shared.0.lock().unwrap().record);
    }

    pub fn set_interval(&self, interval: Duration) {
        let (m, cv) = &*self.shared;
        m.lock().unwrap().interval = interval;
        cv.notify_all();
    }

    pub fn intruder(&self) -> Option<(String, u32)> {
        self.shared.0.lock().unwrap().intruder.clone()
    }

    pub fn last_error(&self) -> Option<String> {
        self.shared.0.lock().unwrap().last_error.clone()
    }

    /// Wait until everything changed so far is on the shared directory, at most `limit`.
    pub fn flush(&self, limit: Duration) -> bool {
        let (m, cv) = &*self.shared;
        let deadline = Instant::now() + limit;
        let mut s = m.lock().unwrap();
        while s.dirty || s.written_seq < s.record.seq {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = cv.wait_timeout(s, deadline - now).unwrap().0;
        }
        true
    }

    /// Final write and stop. Bounded: a hung filesystem must not keep the node alive.
    pub fn finish(mut self, f: impl FnOnce(&mut RankRecord), limit: Duration) -> bool {
        self.update(f);
        let ok = self.flush(limit);
        let (m, cv) = &*self.shared;
        m.lock().unwrap().stop = true;
        cv.notify_all();
        if ok {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        ok
    }
}

fn run(path: PathBuf, shared: Arc<(Mutex<Shared>, Condvar)>, watchdog: Watchdog) {
    let (m, cv) = &*shared;
    let mut next_beat = Instant::now();
    loop {
        let (record, periodic) = {
            let mut s = m.lock().unwrap();
            next_beat = next_beat.min(Instant::now() + s.interval);
            loop {
                if s.stop && !s.dirty {
                    return;
                }
                if s.dirty {
                    break;
                }
                let now = Instant::now();
                if now >= next_beat {
                    break;
                }
                s = cv.wait_timeout(s, next_beat - now).unwrap().0;
            }
            let periodic = !s.dirty;
            s.dirty = false;
            s.record.seq += 1;
            s.record.wall = crate::protocol::wall_now();
            next_beat = Instant::now() + s.interval;
            (s.record.clone(), periodic)
        };
        let (on_disk, result) = watchdog.heartbeat(|| {
            let on_disk = periodic
                .then(|| store::read_json::<RankRecord>(&path).ok().flatten())
                .flatten();
            (on_disk, store::publish_json(&path, &record))
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
            Err(e) => s.last_error = Some(format!("writing {}: {e}", path.display())),
        }
        cv.notify_all();
    }
}
