//! A simulated shared directory: one directory tree in memory (the server's true content,
//! [`SimWorld`]) seen by many clients ([`SimClient`], one per simulated node), each with the
//! caches of an NFS client, on simulated time. Deterministic: no threads, no real clock.
//!
//! What a client models:
//! - **Attribute cache** (`actimeo`): a read or `stat` of a path this client fetched (or
//!   wrote) less than the attribute lifetime ago is answered from its cache, possibly
//!   stale; after that it asks the server again.
//! - **Negative lookup cache** (`lookupcache`): a lookup that found nothing less than the
//!   negative lifetime ago still says "not found", even if another client created the
//!   file since.
//! - **Its own writes** update its own cache at once (close-to-open on its own client).
//! - **Mutations** always reach the server and act on the true content there: `rename`
//!   within a directory is atomic, `create_new` is exclusive across clients (a hard link of
//!   a temporary file, the first wins), `rename_noreplace` never replaces, errors are the
//!   OS's (a missing parent is `NotFound`, `create_dir` on an existing path
//!   `AlreadyExists`, ...). Files are inodes behind names, so a hard link and an in-place
//!   overwrite behave as they do on a real filesystem.
//!
//! Counts: [`SharedDir::counts`] is what the client did, counted exactly as
//! [`super::Fs`] counts the same call (so figures from the two compare);
//! [`SimClient::server_counts`] and [`SimWorld::server_counts`] are the operations that
//! reached the server (cache misses and every mutation), which is what loads an NFS server.
//!
//! Faults the simulator can inject: the next N operations of a class (or of any class)
//! fail with an error kind or errno ([`SimClient::fail_next`]); the N-th operation from
//! now (of a class, or of any) pauses the client, fails, or hangs for a while and then
//! lands, maybe answering an error although it landed ([`SimClient::at_call`]: counted by
//! operation, not by path, so a fault drawn for a seed still hits when the node stops
//! using a path); each call takes a simulated latency ([`SimClient::set_latency`]), and each
//! request that reaches the server a round trip ([`SimClient::set_round_trip`]); an
//! append lands only a prefix of its bytes ([`SimClient::tear_next_append`]); the server
//! restarts, and for an outage every operation that reaches it hangs or fails
//! ([`SimWorld::restart_after`]); a handle on a file another client removed or replaced
//! reads `ESTALE`; and a client's machine crashes
//! ([`SimClient::crash`]): what it wrote without a sync since the file was last synced
//! (appends with `sync = false`, non-durable publishes) is lost from the world: such a
//! file falls back to its last synced content, a non-durable publish to what the name
//! held durably before it, and a file never synced is gone (but an empty one in a
//! directory fsynced since: it has no data, and the name is durable with its inode).
//!
//! - **FUSE** (optional, [`SimClient::set_fuse`]): as a MooseFS, sshfs or blob FUSE mount,
//!   a name → file mapping is trusted for an entry timeout (a record renamed over is read
//!   stale through an open, close-to-open or not), a name looked up as missing stays
//!   missing for a negative timeout while `mkdir`, an exclusive create and `O_CREAT` of it
//!   answer `EEXIST`, a listing refreshes every name in a directory, and
//!   `RENAME_NOREPLACE` may be missing (`EINVAL`: the store's link-and-unlink fallback).
//! - **Close-to-open** (optional, [`SimClient::set_close_to_open`]): as an NFS client
//!   mounted with `cto` (the default), each open of a file it has cached attributes for
//!   asks the server for them again (a GETATTR, counted as a server `stat`), so a read sees
//!   the latest content at once; `stat` without an open, and a cached "not found", still
//!   answer from the caches. Off (the default here), a client behaves like sshfs with its
//!   cache or blob FUSE: a read within the attribute lifetime returns the cached copy.
//!
//! Simplifications: without close-to-open, a read whose attributes are still valid costs
//! the server nothing; `read_dir` always asks the server; there are no symlinks, and no
//! times (a checkpoint `pick` among several directories goes by name).

use super::{DataRead, DataWrite, Kind, Meta, OpClass, OpCounts, SharedDir};
use crate::clock::{Clock, SimClock};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::io::{self, Write};
use std::ops::Bound;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// What a directory entry names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Dir,
    File(u64),
}

/// A file's content: what readers see now, what survives a crash (`None`: the file is
/// gone after a crash), and the clients whose unsynced writes make the difference.
#[derive(Debug, Default)]
struct Inode {
    data: Vec<u8>,
    durable: Option<Vec<u8>>,
    unsynced: BTreeSet<u64>,
    links: u32,
}

#[derive(Debug)]
struct World {
    entries: BTreeMap<PathBuf, Entry>,
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
    next_client: u64,
    server: OpCounts,
    /// Keep files whose last name went (a FUSE filesystem's trash: an entry cached by a
    /// client still reads the old file), as soon as a client mounts FUSE-like.
    trash: bool,
    /// A server restart armed to happen at a count of server operations from now.
    restart: Option<(u64, Duration, Outage)>,
    /// The server is down until then (simulated time): [`SimWorld::restart_after`].
    down: Option<(Duration, Outage)>,
    restarts: u64,
    /// The simulated time of the call under way (set by every call as it takes the lock).
    now: Duration,
    /// [`SimWorld::keep_history`]: which names to keep it for, and when each was given a
    /// file (by a rename or a link: how a commit, a record or an exclusive create lands).
    history: Option<History>,
}

/// [`SimWorld::keep_history`]: the names it is kept for, and when each was given a file,
/// with what the file said then as `summary` gives it (the few fields a check reads).
#[derive(Debug)]
struct History {
    keep: fn(&Path) -> bool,
    summary: Option<Summary>,
    changes: HashMap<PathBuf, Vec<(Duration, Option<String>)>>,
}

/// What of a file's content the history keeps: a check's few fields, not every byte of
/// every heartbeat.
pub type Summary = fn(&Path, &[u8]) -> Option<String>;

/// How clients see a server that is down: a hard mount's calls hang until it is back, a
/// soft mount's fail with this error (`EIO`, `ETIMEDOUT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    Hang,
    Fail(FaultError),
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// `path` absolute and without `.` components (`..` is not resolved: nothing uses it).
fn norm(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::ParentDir => out.push(".."),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

impl World {
    /// `dir` and every directory above it exist (the errors of a path walk otherwise).
    fn walk(&self, dir: &Path) -> io::Result<()> {
        let mut ancestors: Vec<&Path> = dir.ancestors().collect();
        ancestors.reverse();
        for a in ancestors {
            match self.entries.get(a) {
                Some(Entry::Dir) => {}
                Some(Entry::File(_)) => return Err(errno(libc::ENOTDIR)),
                None => return Err(errno(libc::ENOENT)),
            }
        }
        Ok(())
    }

    /// What `path` names: `Ok(None)` when its directory exists but it does not.
    fn lookup(&self, path: &Path) -> io::Result<Option<Entry>> {
        if let Some(parent) = path.parent() {
            self.walk(parent)?;
        }
        Ok(self.entries.get(path).copied())
    }

    fn data(&self, ino: u64) -> &[u8] {
        &self.inodes[&ino].data
    }

    /// The content of a file opened earlier: `ESTALE` when it is gone (its last name
    /// removed or renamed over by another client, as an NFS server answers a stale handle).
    fn handle_data(&self, ino: u64) -> io::Result<Vec<u8>> {
        self.inodes
            .get(&ino)
            .map(|i| i.data.clone())
            .ok_or_else(|| errno(libc::ESTALE))
    }

    /// Open `path` for writing, creating it (empty) if it does not exist; `truncate`
    /// empties an existing one.
    fn open_create(&mut self, path: &Path, truncate: bool) -> io::Result<u64> {
        match self.lookup(path)? {
            Some(Entry::Dir) => Err(errno(libc::EISDIR)),
            Some(Entry::File(ino)) => {
                if truncate {
                    self.inodes.get_mut(&ino).expect("linked").data.clear();
                }
                Ok(ino)
            }
            None => {
                self.next_ino += 1;
                let ino = self.next_ino;
                self.inodes.insert(
                    ino,
                    Inode {
                        links: 1,
                        ..Inode::default()
                    },
                );
                self.entries.insert(path.to_path_buf(), Entry::File(ino));
                Ok(ino)
            }
        }
    }

    /// `O_CREAT | O_EXCL`.
    fn create_excl(&mut self, path: &Path) -> io::Result<u64> {
        if self.lookup(path)?.is_some() {
            return Err(errno(libc::EEXIST));
        }
        self.open_create(path, false)
    }

    /// Write to a file as `client` without syncing.
    /// A file another client removed while this call waited (a pause, a hang) takes the
    /// write and keeps nothing, as an unlinked open file does.
    fn write(&mut self, ino: u64, client: u64, f: impl FnOnce(&mut Vec<u8>)) {
        if let Some(inode) = self.inodes.get_mut(&ino) {
            f(&mut inode.data);
            inode.unsynced.insert(client);
        }
    }

    fn sync(&mut self, ino: u64) {
        if let Some(inode) = self.inodes.get_mut(&ino) {
            inode.durable = Some(inode.data.clone());
            inode.unsynced.clear();
        }
    }

    /// A directory's fsync: the names in it are durable, and so is an empty file one of
    /// them holds that was never synced (an empty file has no data of its own to lose; on
    /// a real filesystem its inode is made durable with the name that holds it). A file
    /// with unsynced data keeps to its last fsync.
    fn sync_empty_in(&mut self, dir: &Path) {
        let inos: Vec<u64> = self
            .below(dir)
            .into_iter()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| match self.entries.get(&p) {
                Some(Entry::File(ino)) => Some(*ino),
                _ => None,
            })
            .collect();
        for ino in inos {
            if let Some(inode) = self.inodes.get_mut(&ino) {
                if inode.durable.is_none() && inode.data.is_empty() {
                    inode.durable = Some(Vec::new());
                    inode.unsynced.clear();
                }
            }
        }
    }

    fn drop_link(&mut self, ino: u64) {
        let inode = self.inodes.get_mut(&ino).expect("linked");
        inode.links -= 1;
        if inode.links == 0 && !self.trash {
            self.inodes.remove(&ino);
        }
    }

    fn unlink(&mut self, path: &Path) -> io::Result<()> {
        match self.lookup(path)? {
            None => Err(errno(libc::ENOENT)),
            Some(Entry::Dir) => Err(errno(libc::EISDIR)),
            Some(Entry::File(ino)) => {
                self.entries.remove(path);
                self.drop_link(ino);
                Ok(())
            }
        }
    }

    fn hard_link(&mut self, src: &Path, dst: &Path) -> io::Result<()> {
        let ino = match self.lookup(src)? {
            None => return Err(errno(libc::ENOENT)),
            Some(Entry::Dir) => return Err(errno(libc::EPERM)),
            Some(Entry::File(ino)) => ino,
        };
        if self.lookup(dst)?.is_some() {
            return Err(errno(libc::EEXIST));
        }
        self.entries.insert(dst.to_path_buf(), Entry::File(ino));
        self.inodes.get_mut(&ino).expect("linked").links += 1;
        self.changed(dst);
        Ok(())
    }

    /// The paths strictly below `dir`.
    fn below(&self, dir: &Path) -> Vec<PathBuf> {
        self.entries
            .range::<Path, _>((Bound::Excluded(dir), Bound::Unbounded))
            .map(|(p, _)| p)
            .take_while(|p| p.starts_with(dir))
            .cloned()
            .collect()
    }

    /// Note that `path` was given a file now ([`SimWorld::keep_history`]).
    fn changed(&mut self, path: &Path) {
        let now = self.now;
        let Some(h) = self.history.as_ref().filter(|h| (h.keep)(path)) else {
            return;
        };
        let summary = h.summary.and_then(|summary| match self.entries.get(path) {
            Some(Entry::File(ino)) => summary(path, self.data(*ino)),
            _ => None,
        });
        let h = self.history.as_mut().expect("kept");
        h.changes
            .entry(path.to_path_buf())
            .or_default()
            .push((now, summary));
    }

    /// `rename(2)`, or `renameat2(RENAME_NOREPLACE)`: atomic, with the OS's errors.
    fn rename(&mut self, src: &Path, dst: &Path, noreplace: bool) -> io::Result<()> {
        let renamed = self.rename_entry(src, dst, noreplace);
        if renamed.is_ok() && src != dst {
            self.changed(dst);
        }
        renamed
    }

    fn rename_entry(&mut self, src: &Path, dst: &Path, noreplace: bool) -> io::Result<()> {
        let s = self.lookup(src)?.ok_or_else(|| errno(libc::ENOENT))?;
        let d = self.lookup(dst)?;
        if noreplace && d.is_some() {
            return Err(errno(libc::EEXIST));
        }
        if src == dst {
            return Ok(());
        }
        if s == Entry::Dir && dst.starts_with(src) {
            return Err(errno(libc::EINVAL));
        }
        match (s, d) {
            (_, None) => {}
            (Entry::File(a), Some(Entry::File(b))) if a == b => return Ok(()),
            (Entry::File(a), Some(Entry::File(b))) => {
                // Replacing a file with one never synced (a live publish): after a crash
                // the name holds what it durably held before.
                if self.inodes[&a].durable.is_none() {
                    let before = self.inodes[&b].durable.clone();
                    self.inodes.get_mut(&a).expect("linked").durable = before;
                }
                self.entries.remove(dst);
                self.drop_link(b);
            }
            (Entry::File(_), Some(Entry::Dir)) => return Err(errno(libc::EISDIR)),
            (Entry::Dir, Some(Entry::File(_))) => return Err(errno(libc::ENOTDIR)),
            (Entry::Dir, Some(Entry::Dir)) => {
                if !self.below(dst).is_empty() {
                    return Err(errno(libc::ENOTEMPTY));
                }
                self.entries.remove(dst);
            }
        }
        let mut moved = self.below(src);
        moved.push(src.to_path_buf());
        for p in moved {
            let e = self.entries.remove(&p).expect("listed");
            let to = dst.join(p.strip_prefix(src).expect("below"));
            self.entries.insert(norm(&to), e);
        }
        Ok(())
    }

    fn rmdir(&mut self, path: &Path) -> io::Result<()> {
        match self.lookup(path)? {
            None => Err(errno(libc::ENOENT)),
            Some(Entry::File(_)) => Err(errno(libc::ENOTDIR)),
            Some(Entry::Dir) if !self.below(path).is_empty() => Err(errno(libc::ENOTEMPTY)),
            Some(Entry::Dir) => {
                self.entries.remove(path);
                Ok(())
            }
        }
    }

    fn mkdir(&mut self, path: &Path) -> io::Result<()> {
        if self.lookup(path)?.is_some() {
            return Err(errno(libc::EEXIST));
        }
        self.entries.insert(path.to_path_buf(), Entry::Dir);
        Ok(())
    }

    /// `std::fs::create_dir_all`.
    fn mkdir_all(&mut self, path: &Path) -> io::Result<()> {
        match self.lookup(path) {
            Ok(Some(Entry::Dir)) => Ok(()),
            Ok(Some(Entry::File(_))) => Err(errno(libc::EEXIST)),
            Ok(None) => self.mkdir(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.mkdir_all(path.parent().expect("the root exists"))?;
                self.mkdir(path)
            }
            Err(e) => Err(e),
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>> {
        match self.lookup(dir)? {
            None => Err(errno(libc::ENOENT)),
            Some(Entry::File(_)) => Err(errno(libc::ENOTDIR)),
            Some(Entry::Dir) => Ok(self
                .below(dir)
                .into_iter()
                .filter(|p| p.parent() == Some(dir))
                .map(|p| p.file_name().expect("named").to_os_string())
                .collect()),
        }
    }

    fn crash(&mut self, client: u64) {
        let mut gone = Vec::new();
        for (ino, inode) in self.inodes.iter_mut() {
            if inode.unsynced.remove(&client) {
                inode.unsynced.clear();
                match &inode.durable {
                    Some(d) => inode.data = d.clone(),
                    None => gone.push(*ino),
                }
            }
        }
        if !gone.is_empty() {
            self.entries
                .retain(|_, e| !matches!(e, Entry::File(i) if gone.contains(i)));
            for ino in gone {
                self.inodes.remove(&ino);
            }
        }
    }
}

/// The shared directory's true content, as its server holds it. Shared by the clients
/// (`Arc<SimWorld>`); its own methods are the simulator's view and count nothing.
#[derive(Debug)]
pub struct SimWorld {
    inner: Mutex<World>,
}

impl SimWorld {
    /// An empty tree (only `/`).
    pub fn new() -> Arc<SimWorld> {
        let mut entries = BTreeMap::new();
        entries.insert(PathBuf::from("/"), Entry::Dir);
        Arc::new(SimWorld {
            inner: Mutex::new(World {
                entries,
                inodes: HashMap::new(),
                next_ino: 0,
                next_client: 0,
                server: OpCounts::default(),
                trash: false,
                restart: None,
                down: None,
                restarts: 0,
                now: Duration::ZERO,
                history: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        self.inner.lock().unwrap()
    }

    /// From now on, note when each name `keep` accepts is given a file (by a rename or a
    /// link: how a commit, a record or an exclusive create lands), on the server's
    /// timeline: the truth what a client concluded (a peer's heartbeat still, say) is
    /// held against.
    pub fn keep_history(&self, keep: fn(&Path) -> bool) {
        self.lock().history = Some(History {
            keep,
            summary: None,
            changes: HashMap::new(),
        });
    }

    /// [`SimWorld::keep_history`], keeping with each change what `summary` makes of the
    /// file given ([`SimWorld::history_of`]).
    pub fn keep_history_with(&self, keep: fn(&Path) -> bool, summary: Summary) {
        self.lock().history = Some(History {
            keep,
            summary: Some(summary),
            changes: HashMap::new(),
        });
    }

    /// When `path` was given a file, in order (empty without [`SimWorld::keep_history`]
    /// for it).
    pub fn history(&self, path: &Path) -> Vec<Duration> {
        self.history_of(path).into_iter().map(|(t, _)| t).collect()
    }

    /// When `path` was given a file, in order, each with what the summary of
    /// [`SimWorld::keep_history_with`] made of it (`None`: none kept, or none made).
    pub fn history_of(&self, path: &Path) -> Vec<(Duration, Option<String>)> {
        let w = self.lock();
        w.history
            .as_ref()
            .and_then(|h| h.changes.get(&norm(path)).cloned())
            .unwrap_or_default()
    }

    /// A client on simulated time `now` (its cache ages by it) with the given attribute
    /// cache and negative-lookup cache lifetimes (NFS's `actimeo` and `lookupcache`: 0 to
    /// 60 s; zero caches nothing).
    pub fn client(
        self: &Arc<Self>,
        now: impl Fn() -> Duration + Send + Sync + 'static,
        attr_lifetime: Duration,
        negative_lifetime: Duration,
    ) -> SimClient {
        let id = {
            let mut w = self.lock();
            w.next_client += 1;
            w.next_client
        };
        SimClient {
            id,
            world: self.clone(),
            now: Box::new(now),
            clock: None,
            attr_lifetime,
            negative_lifetime,
            state: Mutex::new(ClientState::default()),
            paused: (Mutex::new(false), std::sync::Condvar::new()),
            pause_at: Mutex::new(None),
            sleep: Mutex::new(None),
        }
    }

    /// A client on `clock`'s time, which its calls' latency advances.
    pub fn client_with_clock(
        self: &Arc<Self>,
        clock: Arc<SimClock>,
        attr_lifetime: Duration,
        negative_lifetime: Duration,
    ) -> SimClient {
        let c = clock.clone();
        let mut client = self.client(move || c.since_start(), attr_lifetime, negative_lifetime);
        client.clock = Some(clock);
        client
    }

    /// Make `path` and the directories above it (setting up a run, uncounted).
    pub fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.lock().mkdir_all(&norm(path))
    }

    /// A file's true content now (`None`: no file there).
    pub fn content(&self, path: &Path) -> Option<Vec<u8>> {
        let w = self.lock();
        match w.lookup(&norm(path)) {
            Ok(Some(Entry::File(ino))) => Some(w.data(ino).to_vec()),
            _ => None,
        }
    }

    /// What a file would hold after every client crashed now (`None`: it would be gone).
    pub fn durable_content(&self, path: &Path) -> Option<Vec<u8>> {
        let w = self.lock();
        match w.lookup(&norm(path)) {
            Ok(Some(Entry::File(ino))) => w.inodes[&ino].durable.clone(),
            _ => None,
        }
    }

    /// The names in a directory, sorted.
    pub fn list(&self, dir: &Path) -> io::Result<Vec<OsString>> {
        self.lock().list(&norm(dir))
    }

    /// Every operation that reached the server, from all clients.
    pub fn server_counts(&self) -> OpCounts {
        self.lock().server
    }

    /// The server restarts when `ops` more operations (of any client) have reached it: for
    /// `outage` of simulated time after that, every operation that reaches it hangs (a
    /// hard mount: until it is back) or fails (a soft mount), while what clients answer
    /// from their caches still answers. Nothing written is lost: an NFS client resends
    /// writes the server had not made stable (its write verifier changed), and what a
    /// client's fsync returned for was stable.
    pub fn restart_after(&self, ops: u64, outage: Duration, how: Outage) {
        self.lock().restart = Some((ops.max(1), outage, how));
    }

    /// How many server restarts have begun.
    pub fn restarts(&self) -> u64 {
        self.lock().restarts
    }

    /// Disarm a restart armed by [`SimWorld::restart_after`] that has not begun.
    pub fn cancel_restart(&self) {
        self.lock().restart = None;
    }

    /// Until when the server is down, if a restart began (it may be over by now).
    pub fn down_until(&self) -> Option<Duration> {
        self.lock().down.map(|d| d.0)
    }
}

/// What a client has cached about a path.
#[derive(Debug, Clone)]
enum Cached {
    File(Vec<u8>),
    Dir,
}

impl Cached {
    fn meta(&self) -> Meta {
        match self {
            Cached::File(d) => Meta {
                len: d.len() as u64,
                kind: Kind::File,
            },
            Cached::Dir => Meta {
                len: 4096,
                kind: Kind::Dir,
            },
        }
    }
}

/// How an injected fault fails: an error kind, or an errno (`libc::ENOSPC` surfaces as
/// `StorageFull`, `libc::EIO` as an I/O error), as the OS would return it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultError {
    Kind(io::ErrorKind),
    Errno(i32),
}

impl FaultError {
    fn error(self) -> io::Error {
        match self {
            FaultError::Kind(k) => io::Error::new(k, "injected fault"),
            FaultError::Errno(e) => errno(e),
        }
    }
}

impl From<io::ErrorKind> for FaultError {
    fn from(k: io::ErrorKind) -> FaultError {
        FaultError::Kind(k)
    }
}

#[derive(Debug)]
struct Fault {
    class: Option<OpClass>,
    left: u64,
    error: FaultError,
}

/// What happens at a counted operation ([`SimClient::at_call`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnCall {
    /// The machine freezes just before it (as [`SimClient::pause`], until
    /// [`SimClient::resume`]); the operation goes on after that.
    Pause,
    /// It fails with this error.
    Fail(FaultError),
    /// It blocks for `for_` of simulated time (a server that answers late), then goes
    /// on. With `then`, a rename lands and its caller gets that error (a retransmitted
    /// request answered after the first one landed); any other operation fails with it
    /// instead of landing.
    Hang {
        for_: Duration,
        then: Option<FaultError>,
    },
}

/// An [`OnCall`] armed for the `left`-th operation of `class` (any: `None`) from now.
#[derive(Debug)]
struct Trigger {
    class: Option<OpClass>,
    left: u64,
    what: OnCall,
}

/// A FUSE mount's caches ([`SimClient::set_fuse`]), as measured on MooseFS, sshfs and the
/// like (shared/DESIGN.md section 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fuse {
    /// How long a name → file mapping is trusted without asking the server: an open by
    /// name within it reads the file the name named then, even if another client renamed
    /// a new one over it.
    pub entry: Duration,
    /// How long a name looked up as missing stays missing to `stat` and `open`, while the
    /// server answers `mkdir` and `O_CREAT` of it with `EEXIST`.
    pub negative: Duration,
    /// Whether `renameat2(RENAME_NOREPLACE)` works; without it, it answers `EINVAL` and
    /// the store falls back as `store::fs::rename_noreplace` does.
    pub noreplace: bool,
}

#[derive(Debug, Default)]
struct ClientState {
    attr: HashMap<PathBuf, (Duration, Cached)>,
    negative: HashMap<PathBuf, Duration>,
    counts: OpCounts,
    server: OpCounts,
    faults: Vec<Fault>,
    latency: Duration,
    /// What each request that reaches the server adds ([`SimClient::set_round_trip`]).
    round_trip: Duration,
    latency_spent: Duration,
    tear: Option<usize>,
    tmp: u64,
    close_to_open: bool,
    triggers: Vec<Trigger>,
    fuse: Option<Fuse>,
    /// A FUSE client's entry cache: what a name named, and when it looked.
    names: HashMap<PathBuf, (Duration, Entry)>,
    /// A rename that landed after a hang whose caller gets this error.
    late: Option<io::Error>,
    /// The triggers that fired, in order.
    fired: Vec<(Option<OpClass>, OnCall)>,
}

/// One simulated node's view of the shared directory (an NFS client).
pub struct SimClient {
    id: u64,
    world: Arc<SimWorld>,
    now: Box<dyn Fn() -> Duration + Send + Sync>,
    clock: Option<Arc<SimClock>>,
    attr_lifetime: Duration,
    negative_lifetime: Duration,
    state: Mutex<ClientState>,
    /// While true every call waits (a hung mount, a frozen machine): see [`SimClient::pause`].
    paused: (Mutex<bool>, std::sync::Condvar),
    /// Pause at the next call on a path containing this: see [`SimClient::pause_at`].
    pause_at: Mutex<Option<String>>,
    /// How a call that hangs lets simulated time pass: [`SimClient::set_sleep`].
    sleep: Mutex<Option<Sleep>>,
}

type Sleep = Arc<dyn Fn(Duration) + Send + Sync>;

impl std::fmt::Debug for SimClient {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("SimClient")
            .field("id", &self.id)
            .field("attr_lifetime", &self.attr_lifetime)
            .field("negative_lifetime", &self.negative_lifetime)
            .finish_non_exhaustive()
    }
}

impl SimClient {
    /// `create_new`: a temporary file hard-linked to `path` (an `O_EXCL` create where
    /// links fail), fsynced with its directory if `durable`.
    fn create_new_with(&self, path: &Path, bytes: &[u8], durable: bool) -> io::Result<bool> {
        let path = norm(path);
        let mut c = self.begin(&path);
        let tmp = c.tmp_name(&path);
        if let Err(e) = c.write_tmp(&tmp, bytes, durable) {
            c.remove_tmp(&tmp);
            return Err(e);
        }
        let linked = c
            .op(OpClass::Rename)
            .and_then(|()| c.w.hard_link(&tmp, &path));
        let late = c.landed();
        c.remove_tmp(&tmp);
        match linked {
            Ok(()) if late.is_err() => {
                c.forget(&path);
                late.map(|()| true)
            }
            Ok(()) => {
                c.remember(&path, Some(Cached::File(bytes.to_vec())));
                if let (Some(dir), true) = (path.parent(), durable) {
                    c.fsync_dir(dir)?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // The server said it exists: whatever this client cached about it is wrong
                // (a FUSE client's negative entry stays: "EEXIST but not there").
                if !c.hidden(&path) {
                    c.forget(&path);
                }
                Ok(false)
            }
            Err(_) => c.create_excl(&path, bytes, durable),
        }
    }

    /// This client's number in its world (what [`Inode::unsynced`] records).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn world(&self) -> &Arc<SimWorld> {
        &self.world
    }

    /// What this client's calls made the server do (cache misses and every mutation).
    pub fn server_counts(&self) -> OpCounts {
        self.state.lock().unwrap().server
    }

    /// The next `n` operations of `class` (of any class: `None`) on this client fail with
    /// `error`. Operations are the system calls [`SharedDir::counts`] counts; a call
    /// whose operation fails gives up as the real one does (a publish removes its
    /// temporary file).
    pub fn fail_next(&self, class: Option<OpClass>, n: u64, error: impl Into<FaultError>) {
        self.state.lock().unwrap().faults.push(Fault {
            class,
            left: n,
            error: error.into(),
        });
    }

    /// Each call from now on takes `latency` of simulated time: it advances this client's
    /// clock when it has one ([`SimWorld::client_with_clock`]) and adds to
    /// [`SimClient::latency_spent`] either way.
    pub fn set_latency(&self, latency: Duration) {
        self.state.lock().unwrap().latency = latency;
    }

    /// Each request that reaches the server from now on takes `round_trip` (an NFS round
    /// trip), on top of a call's [`SimClient::set_latency`]: a call its caches answer
    /// costs nothing, a publish costs each request it sends. Counted in
    /// [`SimClient::latency_spent`]; unlike a call's latency it does not advance the
    /// client's clock (it is met holding the world).
    pub fn set_round_trip(&self, round_trip: Duration) {
        self.state.lock().unwrap().round_trip = round_trip;
    }

    /// Simulated time this client's calls have taken so far.
    pub fn latency_spent(&self) -> Duration {
        self.state.lock().unwrap().latency_spent
    }

    /// The next append lands only its first `prefix` bytes (unsynced) and fails with EIO,
    /// as a write cut short by a killed process or machine.
    pub fn tear_next_append(&self, prefix: usize) {
        self.state.lock().unwrap().tear = Some(prefix);
    }

    /// This client's machine crashes: every file it wrote without a sync since that file
    /// was last synced falls back to its last synced content (a non-durable publish to
    /// what the name held durably before; a file never synced is gone), and its caches
    /// are gone. Pending faults and the latency stay.
    pub fn crash(&self) {
        let mut st = self.state.lock().unwrap();
        st.attr.clear();
        st.negative.clear();
        st.names.clear();
        st.tear = None;
        self.world.lock().crash(self.id);
    }

    /// From now on every call of this client waits, until [`SimClient::resume`]: its
    /// machine is frozen (a paused VM) or its mount hangs, as far as the shared directory
    /// sees it. For clients used from several threads (the node's driver, also as tasks
    /// of a [`crate::sched::Sched`]); a single-threaded simulation would wait forever.
    pub fn pause(&self) {
        *self.paused.0.lock().unwrap() = true;
    }

    /// Pause (as [`SimClient::pause`]) at the start of the next call on a path that
    /// contains `fragment`. Only for a fault aimed at one commit to show what one
    /// deliberate mutation breaks (a regression seed); the faults a sweep draws are armed
    /// by call count ([`SimClient::at_call`]), which removing a call cannot remove.
    pub fn pause_at(&self, fragment: &str) {
        *self.pause_at.lock().unwrap() = Some(fragment.to_string());
    }

    /// Whether calls wait now ([`SimClient::pause`], or an [`OnCall::Pause`] that hit).
    pub fn is_paused(&self) -> bool {
        *self.paused.0.lock().unwrap()
    }

    /// Let calls through again; the ones waiting go on. Also disarms an [`OnCall::Pause`]
    /// not yet reached (a thaw ends every freeze of the client, armed ones too).
    pub fn resume(&self) {
        *self.pause_at.lock().unwrap() = None;
        self.state
            .lock()
            .unwrap()
            .triggers
            .retain(|t| t.what != OnCall::Pause);
        *self.paused.0.lock().unwrap() = false;
        self.paused.1.notify_all();
        crate::sched::notify_current();
    }

    /// Arm `what` for the `nth` operation (1: the next) of `class` (of any class: `None`)
    /// from now. Operations are the system calls [`SharedDir::counts`] counts, whichever
    /// call makes them, so a fault drawn this way hits whatever the node does then, not a
    /// path it may stop using. A pause or a hang lets other clients act while it lasts,
    /// so a call can find its world changed halfway (a publish whose rename comes after a
    /// freeze).
    pub fn at_call(&self, nth: u64, class: Option<OpClass>, what: OnCall) {
        self.state.lock().unwrap().triggers.push(Trigger {
            class,
            left: nth.max(1),
            what,
        });
    }

    /// The faults armed with [`SimClient::at_call`] that fired so far (the class each was
    /// armed for, and what it did).
    pub fn fired(&self) -> Vec<(Option<OpClass>, OnCall)> {
        self.state.lock().unwrap().fired.clone()
    }

    /// How calls that hang let simulated time pass: `sleep` (e.g. a task's sleep on the
    /// simulation's scheduler). Without one, a client on a clock advances it; else a hang
    /// takes no time.
    pub fn set_sleep(&self, sleep: impl Fn(Duration) + Send + Sync + 'static) {
        *self.sleep.lock().unwrap() = Some(Arc::new(sleep));
    }

    /// Mount FUSE-like (`Some`): names are cached for an entry timeout and a negative
    /// timeout instead of NFS's attribute and lookup caches (see [`Fuse`]); a listing
    /// ([`SharedDir::refresh`]) refreshes every name in a directory at once.
    pub fn set_fuse(&self, fuse: Option<Fuse>) {
        if fuse.is_some() {
            self.world.lock().trash = true;
        }
        let mut st = self.state.lock().unwrap();
        st.fuse = fuse;
        st.names.clear();
    }

    fn sleep(&self, d: Duration) {
        let sleep = self.sleep.lock().unwrap().clone();
        match (sleep, &self.clock) {
            (Some(sleep), _) => sleep(d),
            (None, Some(clock)) => clock.advance(d),
            (None, None) => {}
        }
    }

    /// Wait while [`SimClient::pause`] holds (holding no lock of the client or world).
    fn wait_while_paused(&self) {
        let mut paused = self.paused.0.lock().unwrap();
        while *paused {
            if crate::sched::is_task() {
                // Wait for a turn, not holding the lock the other tasks need.
                drop(paused);
                crate::sched::wait_for_notify();
                paused = self.paused.0.lock().unwrap();
                continue;
            }
            paused = self.paused.1.wait(paused).unwrap();
        }
    }

    /// Revalidate a file's cached attributes with the server at every open, as an NFS
    /// client with close-to-open consistency does (see the module's documentation).
    pub fn set_close_to_open(&self, on: bool) {
        self.state.lock().unwrap().close_to_open = on;
    }

    /// Forget everything cached (as `echo 3 > drop_caches` would).
    pub fn drop_caches(&self) {
        let mut st = self.state.lock().unwrap();
        st.attr.clear();
        st.negative.clear();
        st.names.clear();
    }

    /// Start a call on `path` (faults are armed by operation count; a path only for an
    /// aimed [`SimClient::pause_at`]).
    fn begin(&self, path: &Path) -> Call<'_> {
        // Every call is a turn point of a simulation whose threads take turns.
        crate::sched::turn();
        let hit = {
            let mut at = self.pause_at.lock().unwrap();
            let hit = at
                .as_deref()
                .is_some_and(|f| path.to_string_lossy().contains(f));
            if hit {
                *at = None;
            }
            hit
        };
        if hit {
            *self.paused.0.lock().unwrap() = true;
        }
        self.wait_while_paused();
        let mut st = self.state.lock().unwrap();
        // A late error belongs to the call whose rename hung.
        st.late = None;
        if !st.latency.is_zero() {
            let l = st.latency;
            st.latency_spent += l;
            if let Some(clock) = &self.clock {
                clock.advance(l);
            }
        }
        let now = (self.now)();
        let mut w = self.world.lock();
        w.now = now;
        Call {
            client: self,
            st: Held::new(&self.state, st),
            w: Held::new(&self.world.inner, w),
            now,
        }
    }
}

/// A lock a call holds, which it can let go of while it waits (a pause, a hang) and take
/// back.
struct Held<'a, T> {
    mutex: &'a Mutex<T>,
    guard: Option<MutexGuard<'a, T>>,
}

impl<'a, T> Held<'a, T> {
    fn new(mutex: &'a Mutex<T>, guard: MutexGuard<'a, T>) -> Self {
        Held {
            mutex,
            guard: Some(guard),
        }
    }
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_ref().expect("held")
    }
}

impl<T> std::ops::DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("held")
    }
}

/// One call in progress: the client's state and the world, both locked.
struct Call<'a> {
    client: &'a SimClient,
    st: Held<'a, ClientState>,
    w: Held<'a, World>,
    now: Duration,
}

impl Call<'_> {
    /// Let go of both locks while `wait` runs (other clients act meanwhile), then take
    /// them back in the order [`SimClient::begin`] takes them; time has passed.
    fn unlocked(&mut self, wait: impl FnOnce(&SimClient)) {
        self.w.guard = None;
        self.st.guard = None;
        wait(self.client);
        self.st.guard = Some(self.st.mutex.lock().unwrap());
        self.w.guard = Some(self.w.mutex.lock().unwrap());
        self.now = (self.client.now)();
        self.w.now = self.now;
    }

    /// The trigger armed for this operation, if its count is reached.
    fn triggered(&mut self, class: OpClass) -> Option<OnCall> {
        let mut hit = None;
        for t in self.st.triggers.iter_mut() {
            if t.class.is_none_or(|c| c == class) {
                t.left -= 1;
                if t.left == 0 && hit.is_none() {
                    hit = Some((t.class, t.what));
                }
            }
        }
        self.st.triggers.retain(|t| t.left > 0);
        self.st.fired.extend(hit);
        hit.map(|h| h.1)
    }

    fn fault(&mut self, class: OpClass) -> io::Result<()> {
        match self.triggered(class) {
            None => {}
            Some(OnCall::Fail(e)) => return Err(e.error()),
            Some(OnCall::Pause) => {
                *self.client.paused.0.lock().unwrap() = true;
                self.unlocked(SimClient::wait_while_paused);
            }
            Some(OnCall::Hang { for_, then }) => {
                self.unlocked(|c| c.sleep(for_));
                match then {
                    Some(e) if class == OpClass::Rename => self.st.late = Some(e.error()),
                    Some(e) => return Err(e.error()),
                    None => {}
                }
            }
        }
        let hit = self
            .st
            .faults
            .iter_mut()
            .find(|f| f.left > 0 && f.class.is_none_or(|c| c == class));
        let result = match hit {
            Some(f) => {
                f.left -= 1;
                Err(f.error.error())
            }
            None => Ok(()),
        };
        self.st.faults.retain(|f| f.left > 0);
        result
    }

    /// One operation that reaches the server.
    fn op(&mut self, class: OpClass) -> io::Result<()> {
        self.st.counts.add(class, 1);
        self.server(class)
    }

    /// A request that reaches the server: counted there, and held up (or failed) while
    /// the server is down.
    fn server(&mut self, class: OpClass) -> io::Result<()> {
        self.st.server.add(class, 1);
        let round_trip = self.st.round_trip;
        self.st.latency_spent += round_trip;
        self.w.server.add(class, 1);
        if let Some((left, outage, how)) = self.w.restart.as_mut() {
            *left -= 1;
            if *left == 0 {
                let down = (self.now + *outage, *how);
                self.w.restart = None;
                self.w.down = Some(down);
                self.w.restarts += 1;
            }
        }
        if let Some((until, how)) = self.w.down {
            if self.now >= until {
                self.w.down = None;
            } else {
                match how {
                    Outage::Fail(e) => return Err(e.error()),
                    Outage::Hang => {
                        let left = until - self.now;
                        self.unlocked(|c| c.sleep(left));
                    }
                }
            }
        }
        self.fault(class)
    }

    /// The error a rename that landed after a hang gives its caller, if it has one.
    fn landed(&mut self) -> io::Result<()> {
        match self.st.late.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A request the client sends to the server on its own, within another call (the
    /// GETATTR of an open's close-to-open check): the server counts it, the caller's
    /// system calls do not include it.
    fn implied(&mut self, class: OpClass) -> io::Result<()> {
        self.server(class)
    }

    /// Open `path` creating it (not truncating), making its directory first only when the
    /// open says it is missing, as `store::fs` does; the inode.
    fn open_creating(&mut self, path: &Path) -> io::Result<u64> {
        let hidden = self.hidden(path);
        let opened = self.op(OpClass::Open).and_then(|()| {
            if hidden && matches!(self.w.lookup(path), Ok(Some(_))) {
                // FUSE: the server has the name its negative entry hides.
                return Err(errno(libc::EEXIST));
            }
            self.w.open_create(path, false)
        });
        let opened = match opened {
            // The store's `past_negative_cache`: a listing of the directory, then again.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && hidden => {
                if let Some(d) = path.parent() {
                    self.list_refresh(d)?;
                }
                self.op(OpClass::Open)?;
                self.w.open_create(path, false)
            }
            other => other,
        };
        let ino = match opened {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if let Some(d) = path.parent() {
                    self.create_dir_all(d)?;
                }
                self.op(OpClass::Open)?;
                self.w.open_create(path, false)
            }
            other => other,
        }?;
        // The real store's check that the file is a regular one of its own (an `fstat` of
        // the open file, answered with the attributes the open brought).
        self.cached(OpClass::Stat)?;
        Ok(ino)
    }

    /// One operation answered from this client's cache.
    fn cached(&mut self, class: OpClass) -> io::Result<()> {
        self.st.counts.add(class, 1);
        self.fault(class)
    }

    /// What the cache says about `path` now: `None` to ask the server, `Some(None)` for a
    /// fresh negative entry, `Some(Some(..))` for fresh attributes (and content).
    fn fresh(&self, path: &Path) -> Option<Option<Cached>> {
        let negative = self
            .st
            .fuse
            .map_or(self.client.negative_lifetime, |f| f.negative);
        if let Some(at) = self.st.negative.get(path) {
            if self.now.saturating_sub(*at) < negative {
                return Some(None);
            }
        }
        if let Some(fuse) = self.st.fuse {
            // FUSE: the name's file as it is now, whatever the name names on the server.
            return match self.st.names.get(path) {
                Some((at, e)) if self.now.saturating_sub(*at) < fuse.entry => match e {
                    Entry::Dir => Some(Some(Cached::Dir)),
                    Entry::File(ino) => self
                        .w
                        .inodes
                        .get(ino)
                        .map(|i| Some(Cached::File(i.data.clone()))),
                },
                _ => None,
            };
        }
        match self.st.attr.get(path) {
            Some((at, c)) if self.now.saturating_sub(*at) < self.client.attr_lifetime => {
                Some(Some(c.clone()))
            }
            _ => None,
        }
    }

    /// Cache what the server said about `path` (or what this client just wrote there).
    fn remember(&mut self, path: &Path, what: Option<Cached>) {
        let now = self.now;
        match what {
            Some(c) => {
                self.st.negative.remove(path);
                self.st.attr.insert(path.to_path_buf(), (now, c));
                if self.st.fuse.is_some() {
                    match self.w.entries.get(path).copied() {
                        Some(e) => self.st.names.insert(path.to_path_buf(), (now, e)),
                        None => self.st.names.remove(path),
                    };
                }
            }
            None => {
                self.st.attr.remove(path);
                self.st.names.remove(path);
                self.st.negative.insert(path.to_path_buf(), now);
            }
        }
    }

    /// Drop what is cached about `path` and below it.
    fn forget(&mut self, path: &Path) {
        self.st.attr.retain(|p, _| !p.starts_with(path));
        self.st.negative.retain(|p, _| !p.starts_with(path));
        self.st.names.retain(|p, _| !p.starts_with(path));
    }

    /// Whether this FUSE client's negative timeout still hides `path` (the server may
    /// have it).
    fn hidden(&self, path: &Path) -> bool {
        self.st.fuse.is_some() && matches!(self.fresh(path), Some(None))
    }

    /// A FUSE client's listing of `dir` (readdirplus): every name in it is cached as the
    /// server has it now, and no name in it stays cached as missing ([`super::fs::refresh`]).
    fn list_refresh(&mut self, dir: &Path) -> io::Result<Vec<OsString>> {
        self.op(OpClass::Open)?;
        let names = self.w.list(dir)?;
        self.op(OpClass::Readdir)?;
        if self.st.fuse.is_some() {
            let now = self.now;
            self.st.names.retain(|p, _| p.parent() != Some(dir));
            self.st.negative.retain(|p, _| p.parent() != Some(dir));
            for n in &names {
                let p = dir.join(n);
                if let Some(e) = self.w.entries.get(&p).copied() {
                    self.st.names.insert(p, (now, e));
                }
            }
        }
        Ok(names)
    }

    /// Cache `path` as the server has it now.
    fn refresh(&mut self, path: &Path) {
        let what = match self.w.lookup(path) {
            Ok(Some(Entry::File(ino))) => Some(Cached::File(self.w.data(ino).to_vec())),
            Ok(Some(Entry::Dir)) => Some(Cached::Dir),
            _ => None,
        };
        self.forget(path);
        if let Some(c) = what {
            self.remember(path, Some(c));
        }
    }

    fn tmp_name(&mut self, path: &Path) -> PathBuf {
        self.st.tmp += 1;
        let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("file");
        path.with_file_name(format!(".{name}.tmp-sim{}-{}", self.client.id, self.st.tmp))
    }

    /// Remove a temporary file this client made, if it made it (the real store removes
    /// one only after its exclusive create succeeded).
    fn remove_tmp(&mut self, tmp: &Path) {
        if !matches!(self.w.lookup(tmp), Ok(Some(_))) {
            return;
        }
        if self.op(OpClass::Unlink).is_ok() {
            let _ = self.w.unlink(tmp);
        }
    }

    /// [`super::fs::fsync_dir`]: best effort where the directory cannot be opened.
    fn fsync_dir(&mut self, dir: &Path) -> io::Result<()> {
        let opened = self
            .op(OpClass::Open)
            .and_then(|()| match self.w.lookup(dir)? {
                Some(_) => Ok(()),
                None => Err(errno(libc::ENOENT)),
            });
        match opened {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
            Ok(()) => {}
        }
        match self.op(OpClass::Fsync) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Ok(()),
            Ok(()) => {
                self.w.sync_empty_in(dir);
                Ok(())
            }
            other => other,
        }
    }

    fn publish(
        &mut self,
        path: &Path,
        tmp: &Path,
        durable: bool,
        write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<Vec<u8>> {
        let id = self.client.id;
        self.op(OpClass::Open)?;
        let ino = self.w.open_create(tmp, true)?;
        self.op(OpClass::Write)?;
        let mut buf = Vec::new();
        write(&mut buf)?;
        self.w.write(ino, id, |d| d.clone_from(&buf));
        if durable {
            self.op(OpClass::Fsync)?;
            self.w.sync(ino);
        }
        self.op(OpClass::Rename)?;
        self.w.rename(tmp, path, false)?;
        self.landed()?;
        if durable {
            if let Some(dir) = path.parent() {
                self.fsync_dir(dir)?;
            }
        }
        Ok(buf)
    }

    /// Write `bytes` to a new temporary file and fsync it if `durable` (`create_new`'s
    /// first step).
    fn write_tmp(&mut self, tmp: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
        let id = self.client.id;
        self.op(OpClass::Open)?;
        let ino = self.w.open_create(tmp, true)?;
        self.op(OpClass::Write)?;
        self.w.write(ino, id, |d| d.extend_from_slice(bytes));
        // As the real store: an empty file is not fsynced; its directory's fsync after the
        // link makes it durable ([`World::sync_empty_in`]).
        if durable && !bytes.is_empty() {
            self.op(OpClass::Fsync)?;
            self.w.sync(ino);
        }
        Ok(())
    }

    /// `O_EXCL` create of `path` with `bytes`, fsynced if `durable` (`create_new` without
    /// hard links).
    fn create_excl(&mut self, path: &Path, bytes: &[u8], durable: bool) -> io::Result<bool> {
        let id = self.client.id;
        self.op(OpClass::Open)?;
        let ino = match self.w.create_excl(path) {
            Ok(ino) => ino,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(e),
        };
        self.op(OpClass::Write)?;
        self.w.write(ino, id, |d| d.extend_from_slice(bytes));
        if durable && !bytes.is_empty() {
            self.op(OpClass::Fsync)?;
            self.w.sync(ino);
        }
        self.remember(path, Some(Cached::File(bytes.to_vec())));
        // As after a link: `create_new` leaves the name durable too.
        if let (Some(dir), true) = (path.parent(), durable) {
            self.fsync_dir(dir)?;
        }
        Ok(true)
    }

    /// [`super::fs`]'s `create_dir_all`: a stat, and a mkdir per missing level.
    fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        let hidden = self.hidden(path);
        match self.fresh(path) {
            Some(Some(Cached::Dir)) => return self.cached(OpClass::Stat),
            _ => self.op(OpClass::Stat)?,
        }
        let there = self.w.lookup(path).ok().flatten();
        if hidden && there.is_some() {
            // FUSE: `stat` says missing, `mkdir` EEXIST; the store lists the parent and
            // looks again (`past_negative_cache`).
            self.op(OpClass::Mkdir)?;
            if let Some(d) = path.parent() {
                self.list_refresh(d)?;
            }
            self.op(OpClass::Stat)?;
        }
        if there == Some(Entry::Dir) {
            self.remember(path, Some(Cached::Dir));
            return Ok(());
        }
        let missing = path
            .ancestors()
            .take_while(|a| !matches!(self.w.lookup(a), Ok(Some(_))))
            .count();
        // As std (and `store::fs`) do it: k missing levels cost 2k - 1 mkdirs; a mkdir
        // that fails because something else is there is followed by a stat.
        for _ in 0..(2 * missing).saturating_sub(1).max(1) {
            self.op(OpClass::Mkdir)?;
        }
        if missing == 0 {
            self.op(OpClass::Stat)?;
        }
        self.w.mkdir_all(path)?;
        self.remember(path, Some(Cached::Dir));
        Ok(())
    }

    /// `store::fs::rename_noreplace` where `renameat2(RENAME_NOREPLACE)` answered `EINVAL`
    /// (that rename already counted): a directory is renamed after a `stat` of `dst`
    /// (through this client's caches) finds nothing there; a file is hard-linked to `dst`
    /// and `src` removed. Not atomic: a pause between the steps shows both names.
    fn rename_noreplace_fallback(&mut self, src: &Path, dst: &Path) -> io::Result<()> {
        self.op(OpClass::Stat)?;
        let s = self.w.lookup(src)?.ok_or_else(|| errno(libc::ENOENT))?;
        if s == Entry::Dir {
            if self.stat(dst)?.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} already exists", dst.display()),
                ));
            }
            self.op(OpClass::Rename)?;
            self.w.rename(src, dst, false)?;
        } else {
            self.op(OpClass::Rename)?;
            if let Err(e) = self.w.hard_link(src, dst) {
                if e.kind() == io::ErrorKind::AlreadyExists && !self.hidden(dst) {
                    self.forget(dst);
                }
                return Err(e);
            }
            self.op(OpClass::Unlink)?;
            self.w.unlink(src)?;
        }
        self.forget(src);
        self.refresh(dst);
        self.landed()
    }

    fn stat(&mut self, path: &Path) -> io::Result<Option<Meta>> {
        if let Some(fresh) = self.fresh(path) {
            self.cached(OpClass::Stat)?;
            return Ok(fresh.map(|c| c.meta()));
        }
        self.op(OpClass::Stat)?;
        let what = match self.w.lookup(path) {
            Ok(Some(Entry::File(ino))) => Some(Cached::File(self.w.data(ino).to_vec())),
            Ok(Some(Entry::Dir)) => Some(Cached::Dir),
            Ok(None) => None,
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let meta = what.as_ref().map(Cached::meta);
        self.remember(path, what);
        Ok(meta)
    }
}

impl SimClient {
    /// The whole file as this client sees it (caches, close-to-open), or `None`.
    fn read_whole(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let path = norm(path);
        let mut c = self.begin(&path);
        let fresh = c.fresh(&path);
        // Close-to-open: an open of a cached file asks the server for its attributes (a
        // GETATTR, the `stat` below); its data is read again only if it changed.
        let revalidating = match &fresh {
            Some(Some(Cached::File(cached))) if c.st.close_to_open && c.st.fuse.is_none() => {
                Some(cached.clone())
            }
            _ => None,
        };
        match fresh {
            _ if revalidating.is_some() => {}
            Some(None) => {
                c.cached(OpClass::Open)?;
                return Ok(None);
            }
            Some(Some(Cached::File(data))) => {
                c.cached(OpClass::Open)?;
                // Not a system call of the reader's; still a point a fault can hit.
                c.fault(OpClass::Stat)?;
                c.cached(OpClass::Read)?;
                return Ok(Some(data));
            }
            Some(Some(Cached::Dir)) => {
                c.cached(OpClass::Open)?;
                // The read that fails (EISDIR), as on a real client.
                c.st.counts.add(OpClass::Read, 1);
                return Err(errno(libc::EISDIR));
            }
            None => {}
        }
        if revalidating.is_some() {
            c.cached(OpClass::Open)?;
        } else {
            c.op(OpClass::Open)?;
        }
        match c.w.lookup(&path) {
            Ok(None) => {
                c.remember(&path, None);
                Ok(None)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                c.remember(&path, None);
                Ok(None)
            }
            Err(e) => Err(e),
            Ok(Some(Entry::Dir)) => {
                c.remember(&path, Some(Cached::Dir));
                c.st.counts.add(OpClass::Read, 1);
                Err(errno(libc::EISDIR))
            }
            Ok(Some(Entry::File(ino))) => {
                c.implied(OpClass::Stat)?;
                let data = c.w.handle_data(ino)?;
                if revalidating.as_ref() == Some(&data) {
                    c.cached(OpClass::Read)?;
                } else {
                    c.op(OpClass::Read)?;
                }
                c.remember(&path, Some(Cached::File(data.clone())));
                Ok(Some(data))
            }
        }
    }
}

impl SharedDir for SimClient {
    fn read_limited(&self, path: &Path, limit: super::ReadLimit) -> io::Result<Option<Vec<u8>>> {
        let data = self.read_whole(path)?;
        match data {
            Some(d) if d.len() as u64 > limit.bytes() => Err(super::TooLarge::error(path, limit)),
            other => Ok(other),
        }
    }

    fn publish_with(
        &self,
        path: &Path,
        durable: bool,
        write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        let tmp = c.tmp_name(&path);
        match c.publish(&path, &tmp, durable, write) {
            Ok(data) => {
                c.remember(&path, Some(Cached::File(data)));
                Ok(())
            }
            Err(e) => {
                c.remove_tmp(&tmp);
                Err(e)
            }
        }
    }

    fn create_new(&self, path: &Path, bytes: &[u8]) -> io::Result<bool> {
        self.create_new_with(path, bytes, true)
    }

    fn create_new_live(&self, path: &Path, bytes: &[u8]) -> io::Result<bool> {
        self.create_new_with(path, bytes, false)
    }

    fn read_or_create(&self, path: &Path) -> io::Result<Vec<u8>> {
        let path = norm(path);
        let mut c = self.begin(&path);
        // An open that may create is the server's to answer: no cache is consulted.
        if c.st.fuse.is_some() {
            // As the store does on FUSE: a listing first, so no name stays hidden.
            if let Some(d) = path.parent() {
                let _ = c.list_refresh(d);
            }
        }
        let ino = c.open_creating(&path)?;
        c.op(OpClass::Read)?;
        let data = c.w.handle_data(ino)?;
        c.remember(&path, Some(Cached::File(data.clone())));
        Ok(data)
    }

    fn revalidate(&self, path: &Path) -> io::Result<bool> {
        let path = norm(path);
        let mut c = self.begin(&path);
        if c.st.fuse.is_some() {
            // The store lists the directory on FUSE (an exclusive create would leave the
            // name hidden there).
            if let Some(d) = path.parent() {
                let _ = c.list_refresh(d);
            }
            return Ok(matches!(c.w.lookup(&path), Ok(Some(_))));
        }
        c.op(OpClass::Open)?;
        // The server's answer replaces what this client cached (the real create of an
        // absent file and its removal are one step here).
        c.refresh(&path);
        Ok(matches!(c.w.lookup(&path), Ok(Some(_))))
    }

    fn overwrite_in_place(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Open)?;
        let ino = match c.w.lookup(&path)? {
            None => return Err(errno(libc::ENOENT)),
            Some(Entry::Dir) => return Err(errno(libc::EISDIR)),
            Some(Entry::File(ino)) => ino,
        };
        c.op(OpClass::Stat)?;
        let old = c.w.handle_data(ino)?.len();
        // Blocks of 4 KiB, as a local filesystem or NFS allocates them.
        let allocated = old.div_ceil(4096) * 4096;
        let bytes = super::in_place_bytes(bytes, old, allocated, &path)?;
        c.op(OpClass::Write)?;
        let id = self.id;
        c.w.write(ino, id, |d| d.clone_from(&bytes));
        c.op(OpClass::Fsync)?;
        c.w.sync(ino);
        c.remember(&path, Some(Cached::File(bytes)));
        Ok(())
    }

    fn append(&self, path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        let ino = c.open_creating(&path)?;
        c.op(OpClass::Write)?;
        let id = self.id;
        if let Some(prefix) = c.st.tear.take() {
            let part = &bytes[..prefix.min(bytes.len())];
            c.w.write(ino, id, |d| d.extend_from_slice(part));
            c.forget(&path);
            return Err(errno(libc::EIO));
        }
        c.w.write(ino, id, |d| d.extend_from_slice(bytes));
        if sync {
            c.op(OpClass::Fsync)?;
            c.w.sync(ino);
        }
        let data = c.w.handle_data(ino).unwrap_or_default();
        c.remember(&path, Some(Cached::File(data)));
        Ok(())
    }

    fn rename(&self, src: &Path, dst: &Path) -> io::Result<()> {
        let (src, dst) = (norm(src), norm(dst));
        let mut c = self.begin(&src);
        c.op(OpClass::Rename)?;
        c.w.rename(&src, &dst, false)?;
        c.forget(&src);
        c.refresh(&dst);
        c.landed()
    }

    fn rename_noreplace(&self, src: &Path, dst: &Path) -> io::Result<()> {
        let (src, dst) = (norm(src), norm(dst));
        let mut c = self.begin(&src);
        c.op(OpClass::Rename)?;
        if c.st.fuse.is_some_and(|f| !f.noreplace) {
            // renameat2 answered EINVAL: the store's fallback.
            return c.rename_noreplace_fallback(&src, &dst);
        }
        match c.w.rename(&src, &dst, true) {
            Ok(()) => {
                c.forget(&src);
                c.refresh(&dst);
                c.landed()
            }
            Err(e) => {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    c.forget(&dst);
                }
                Err(e)
            }
        }
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Mkdir)?;
        match c.w.mkdir(&path) {
            Ok(()) => {
                c.remember(&path, Some(Cached::Dir));
                Ok(())
            }
            Err(e) => {
                // A FUSE client's negative entry outlives the server's EEXIST.
                if !c.hidden(&path) {
                    c.forget(&path);
                }
                Err(e)
            }
        }
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let path = norm(path);
        self.begin(&path).create_dir_all(&path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>> {
        let path = norm(path);
        let mut c = self.begin(&path);
        // A missing directory fails at the open, before any readdir (as on a real client).
        c.list_refresh(&path)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Unlink)?;
        c.w.unlink(&path)?;
        c.forget(&path);
        Ok(())
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Unlink)?;
        c.w.rmdir(&path)?;
        c.forget(&path);
        Ok(())
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Stat)?;
        // There are no links here: whatever is at `path` is not one.
        match c.w.lookup(&path)? {
            None => Err(errno(libc::ENOENT)),
            Some(_) => Err(errno(libc::EINVAL)),
        }
    }

    fn concurrent_data(&self) -> bool {
        false
    }

    fn refresh(&self, dir: &Path) -> io::Result<()> {
        let dir = norm(dir);
        let mut c = self.begin(&dir);
        if c.st.fuse.is_none() {
            return Ok(());
        }
        c.list_refresh(&dir).map(drop)
    }

    fn caches_lookups(&self, _path: &Path) -> bool {
        self.state.lock().unwrap().fuse.is_some()
    }

    fn lstat(&self, path: &Path) -> io::Result<Option<Meta>> {
        let path = norm(path);
        self.begin(&path).stat(&path)
    }

    fn stat(&self, path: &Path) -> io::Result<Option<Meta>> {
        let path = norm(path);
        self.begin(&path).stat(&path)
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Open)?;
        let entry = c.w.lookup(&path)?.ok_or_else(|| errno(libc::ENOENT))?;
        c.op(OpClass::Fsync)?;
        if let Entry::File(ino) = entry {
            c.w.sync(ino);
        }
        Ok(())
    }

    fn fsync_dir(&self, path: &Path) -> io::Result<()> {
        let path = norm(path);
        self.begin(&path).fsync_dir(&path)
    }

    fn open_data(&self, path: &Path) -> io::Result<Box<dyn DataRead>> {
        let data = self.read_whole(path)?.ok_or_else(|| errno(libc::ENOENT))?;
        let ino = match self.world.lock().lookup(&norm(path)) {
            Ok(Some(Entry::File(ino))) => Some(ino),
            _ => None,
        };
        Ok(Box::new(SimRead {
            data,
            at: 0,
            world: self.world.clone(),
            ino,
        }))
    }

    fn create_data(&self, path: &Path) -> io::Result<Box<dyn DataWrite + '_>> {
        let path = norm(path);
        let mut c = self.begin(&path);
        c.op(OpClass::Open)?;
        if let Some(Entry::File(_)) = c.w.lookup(&path)? {
            c.op(OpClass::Unlink)?;
            c.w.unlink(&path)?;
        }
        let ino = c.w.create_excl(&path)?;
        // A new file, never synced: a crash of this client loses it.
        c.w.write(ino, self.id, |_| {});
        c.remember(&path, Some(Cached::File(Vec::new())));
        Ok(Box::new(SimWrite {
            client: self,
            path,
            pending: Vec::new(),
        }))
    }

    fn counts(&self) -> OpCounts {
        self.state.lock().unwrap().counts
    }
}

/// A data file open for reading: the content this client saw when it opened it, through
/// a handle on the file: once the file is gone from the server (another client removed
/// it, or renamed another over it), a read is `ESTALE`, as an NFS server answers.
struct SimRead {
    data: Vec<u8>,
    at: usize,
    world: Arc<SimWorld>,
    ino: Option<u64>,
}

impl DataRead for SimRead {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }

    fn read_more(&mut self, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
        if self
            .ino
            .is_some_and(|ino| !self.world.lock().inodes.contains_key(&ino))
        {
            return Err(errno(libc::ESTALE));
        }
        let n = max.min(self.data.len() - self.at);
        buf.extend_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// A data file open for writing. What it writes reaches the server when it is synced (as
/// an NFS client writes back at close or fsync), in one append that a fault can fail or
/// tear and a crash before the fsync loses. Writing touches nothing else, so a thread
/// that is not a task of the simulation's scheduler (a merge's writer) may write.
struct SimWrite<'a> {
    client: &'a SimClient,
    path: PathBuf,
    pending: Vec<u8>,
}

impl Write for SimWrite<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl DataWrite for SimWrite<'_> {
    fn sync_all(&mut self) -> io::Result<()> {
        let pending = std::mem::take(&mut self.pending);
        if pending.is_empty() {
            self.client.sync_file(&self.path)
        } else {
            self.client.append(&self.path, &pending, true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    const S: Duration = Duration::from_secs(1);

    fn clock() -> Arc<SimClock> {
        Arc::new(SimClock::new(1.0, SystemTime::UNIX_EPOCH))
    }

    /// A world with `/run` and two clients on one clock, with these cache lifetimes.
    fn two(
        attr: Duration,
        negative: Duration,
    ) -> (Arc<SimWorld>, Arc<SimClock>, SimClient, SimClient) {
        let world = SimWorld::new();
        world.create_dir_all(Path::new("/run")).unwrap();
        let t = clock();
        let a = world.client_with_clock(t.clone(), attr, negative);
        let b = world.client_with_clock(t.clone(), attr, negative);
        (world, t, a, b)
    }

    fn names(world: &SimWorld, dir: &str) -> Vec<String> {
        world
            .list(Path::new(dir))
            .unwrap()
            .into_iter()
            .map(|n| n.into_string().unwrap())
            .collect()
    }

    #[test]
    fn a_read_within_the_attribute_lifetime_is_stale_then_fresh() {
        let (world, t, a, b) = two(3 * S, 3 * S);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/r.json");
        a.publish(p, b"one").unwrap();
        assert_eq!(b.read(p).unwrap().unwrap(), b"one");
        t.advance(S);
        a.publish(p, b"two").unwrap();
        assert_eq!(
            a.read(p).unwrap().unwrap(),
            b"two",
            "a client sees its own write at once"
        );
        let server = world.server_counts();
        t.advance(S);
        assert_eq!(
            b.read(p).unwrap().unwrap(),
            b"one",
            "2 s after b fetched it: cached"
        );
        assert_eq!(
            world.server_counts(),
            server,
            "a cached read costs the server nothing"
        );
        t.advance(S);
        assert_eq!(
            b.read(p).unwrap().unwrap(),
            b"two",
            "3 s after: fetched again"
        );
        assert_eq!(
            (world.server_counts() - server).summary(),
            "open 1, stat 1, read 1"
        );
        // stat answers from the same cache.
        a.publish(p, b"three!").unwrap();
        assert_eq!(b.stat(p).unwrap().unwrap().len, 3);
        t.advance(3 * S);
        assert_eq!(b.stat(p).unwrap().unwrap().len, 6);
    }

    #[test]
    fn close_to_open_sees_a_change_at_the_next_open_and_rereads_only_changed_data() {
        let (world, t, a, b) = two(3 * S, 3 * S);
        b.set_close_to_open(true);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/r.json");
        a.publish(p, b"one").unwrap();
        assert_eq!(b.read(p).unwrap().unwrap(), b"one");
        let server = world.server_counts();
        assert_eq!(b.read(p).unwrap().unwrap(), b"one");
        assert_eq!(
            (world.server_counts() - server).summary(),
            "stat 1",
            "an unchanged file costs a GETATTR, its data comes from the cache"
        );
        t.advance(S);
        a.publish(p, b"two").unwrap();
        let server = world.server_counts();
        assert_eq!(
            b.read(p).unwrap().unwrap(),
            b"two",
            "within the attribute lifetime, the open sees the change"
        );
        assert_eq!((world.server_counts() - server).summary(), "stat 1, read 1");
        // A cached "not found" still hides a file created since, and stat (no open) still
        // answers from the attribute cache.
        let q = Path::new("/run/later.json");
        assert!(b.read(q).unwrap().is_none());
        a.publish(q, b"x").unwrap();
        assert!(b.read(q).unwrap().is_none());
        a.publish(p, b"three!").unwrap();
        assert_eq!(b.stat(p).unwrap().unwrap().len, 3);
        a.remove_file(p).unwrap();
        assert!(b.read(p).unwrap().is_none(), "the open finds it gone");
    }

    #[test]
    fn no_attribute_cache_reads_the_server_every_time() {
        let (world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/r.json");
        a.publish(p, b"one").unwrap();
        assert_eq!(b.read(p).unwrap().unwrap(), b"one");
        a.publish(p, b"two").unwrap();
        assert_eq!(b.read(p).unwrap().unwrap(), b"two");
        assert_eq!(world.content(p).unwrap(), b"two");
    }

    #[test]
    fn an_open_that_may_create_and_a_failed_exclusive_create_see_past_the_negative_cache() {
        let (world, _t, a, b) = two(Duration::ZERO, 60 * S);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let (cluster, bell) = (Path::new("/run/s/cluster.json"), Path::new("/run/s/bell"));
        // Worker `b` looks before rank 0 `a` starts: both names are "no such file" to it.
        assert!(b.read(cluster).unwrap().is_none());
        assert!(b.read(bell).unwrap().is_none());
        assert_eq!(
            b.read_or_create(bell).unwrap(),
            b"",
            "made empty, with its directory"
        );
        a.publish(cluster, b"gen 1").unwrap();
        a.append(bell, b"gen 1\n", false).unwrap();
        assert!(
            b.read(cluster).unwrap().is_none(),
            "still cached as missing"
        );
        assert_eq!(b.read_or_create(bell).unwrap(), b"gen 1\n");
        assert!(b.revalidate(cluster).unwrap());
        assert_eq!(b.read(cluster).unwrap().unwrap(), b"gen 1");
        // A probe of a name that is not there leaves nothing behind.
        assert!(!b.revalidate(Path::new("/run/s/other.json")).unwrap());
        assert_eq!(
            names(&world, "/run/s").len(),
            2,
            "bell and cluster.json only"
        );
    }

    #[test]
    fn the_negative_cache_hides_a_file_another_client_created_until_it_expires() {
        let (_world, t, a, b) = two(Duration::ZERO, 5 * S);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/abort.json");
        assert!(b.read(p).unwrap().is_none());
        t.advance(S);
        assert!(a.create_new(p, b"rank 3 is dead").unwrap());
        assert_eq!(a.read(p).unwrap().unwrap(), b"rank 3 is dead");
        t.advance(3 * S);
        assert!(
            b.read(p).unwrap().is_none(),
            "4 s after the lookup: still not found"
        );
        assert!(!b.exists(p));
        t.advance(S);
        assert_eq!(b.read(p).unwrap().unwrap(), b"rank 3 is dead");
        assert!(b.exists(p));
    }

    #[test]
    fn create_new_is_first_writer_wins_across_clients() {
        let (world, _t, a, b) = two(60 * S, 60 * S);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/abort.json");
        // b's cache says nothing is there: the exclusive create goes to the server anyway.
        assert!(b.read(p).unwrap().is_none());
        assert!(a.create_new(p, b"first").unwrap());
        assert!(!b.create_new(p, b"second").unwrap());
        assert!(!a.create_new(p, b"third").unwrap());
        assert_eq!(world.content(p).unwrap(), b"first");
        assert_eq!(
            b.read(p).unwrap().unwrap(),
            b"first",
            "losing dropped b's negative entry"
        );
        assert_eq!(
            names(&world, "/run"),
            ["abort.json"],
            "no temporary file stays"
        );
        // A missing directory is the OS's NotFound.
        let e = a
            .create_new(Path::new("/run/gen-9/abort.json"), b"x")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn rename_noreplace_never_replaces() {
        let (world, _t, a, b) = two(60 * S, 60 * S);
        let (a, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let (x, y) = (Path::new("/run/x"), Path::new("/run/y"));
        assert!(b.read(y).unwrap().is_none());
        a.publish(x, b"a's").unwrap();
        a.rename_noreplace(x, y).unwrap();
        assert!(world.content(x).is_none());
        b.publish(x, b"b's").unwrap();
        let e = b.rename_noreplace(x, y).unwrap_err();
        assert_eq!(
            e.kind(),
            io::ErrorKind::AlreadyExists,
            "b's negative entry does not matter"
        );
        assert_eq!(world.content(y).unwrap(), b"a's");
        assert_eq!(world.content(x).unwrap(), b"b's");
        // A plain rename replaces.
        b.rename(x, y).unwrap();
        assert_eq!(world.content(y).unwrap(), b"b's");
        // Directories: not onto an empty one either; a whole tree moves.
        a.create_dir_all(Path::new("/run/d/sub")).unwrap();
        a.publish(Path::new("/run/d/sub/f"), b"1").unwrap();
        a.create_dir(Path::new("/run/e")).unwrap();
        let e = b
            .rename_noreplace(Path::new("/run/d"), Path::new("/run/e"))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        let e = b.create_dir(Path::new("/run/e")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        b.rename(Path::new("/run/d"), Path::new("/run/e")).unwrap();
        assert_eq!(world.content(Path::new("/run/e/sub/f")).unwrap(), b"1");
        assert!(world.list(Path::new("/run/d")).is_err());
        assert_eq!(names(&world, "/run"), ["e", "y"]);
    }

    #[test]
    fn a_crash_loses_unsynced_writes_and_keeps_synced_ones() {
        let (world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let (ad, b): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let log = Path::new("/run/journal/rank-1.jsonl");
        ad.append(log, b"a\n", true).unwrap();
        ad.append(log, b"b\n", false).unwrap();
        assert_eq!(
            b.read(log).unwrap().unwrap(),
            b"a\nb\n",
            "visible before the crash"
        );
        // A durable record, then a live (unsynced) one over it; an unsynced new file.
        let rec = Path::new("/run/rank-1.json");
        ad.publish(rec, b"durable").unwrap();
        ad.publish_with(rec, false, &mut |w| w.write_all(b"live"))
            .unwrap();
        let new = Path::new("/run/new.json");
        ad.publish_with(new, false, &mut |w| w.write_all(b"never synced"))
            .unwrap();
        // Another client's unsynced write is not a's to lose.
        let other = Path::new("/run/b.jsonl");
        b.append(other, b"b's\n", false).unwrap();
        a.crash();
        assert_eq!(b.read(log).unwrap().unwrap(), b"a\n");
        assert_eq!(b.read(rec).unwrap().unwrap(), b"durable");
        assert!(b.read(new).unwrap().is_none(), "never synced: gone");
        assert_eq!(world.content(other).unwrap(), b"b's\n");
        // Synced afterwards: survives.
        ad.append(log, b"c\n", false).unwrap();
        ad.sync_file(log).unwrap();
        a.crash();
        assert_eq!(world.content(log).unwrap(), b"a\nc\n");
    }

    #[test]
    fn a_data_file_lands_at_its_sync_and_is_read_as_the_client_sees_it() {
        let (world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let (ad, bd): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let path = Path::new("/run/merged.jsonl.tmp");
        world.create_dir_all(path.parent().unwrap()).unwrap();
        let mut w = ad.create_data(path).unwrap();
        w.write_all(b"{\"a\":1}\n").unwrap();
        w.flush().unwrap();
        assert_eq!(
            world.content(path).unwrap(),
            b"",
            "not written back before the sync"
        );
        w.sync_all().unwrap();
        drop(w);
        let mut r = bd.open_data(path).unwrap();
        let mut buf = Vec::new();
        assert_eq!((r.size(), r.read_more(&mut buf, 3).unwrap()), (8, 3));
        while r.read_more(&mut buf, 3).unwrap() > 0 {}
        assert_eq!(buf, b"{\"a\":1}\n");
        let gone = bd.open_data(Path::new("/run/none")).err().unwrap();
        assert_eq!(gone.kind(), io::ErrorKind::NotFound);
        // Created anew over what stood there; written but never synced: lost in a crash.
        let mut w = ad.create_data(path).unwrap();
        w.write_all(b"lost").unwrap();
        drop(w);
        a.crash();
        assert!(
            world.content(path).is_none(),
            "a new file never synced is gone"
        );
    }

    #[test]
    fn an_empty_file_is_durable_with_its_directory_not_by_a_sync_of_its_own() {
        let (world, _t, a, _b) = two(Duration::ZERO, Duration::ZERO);
        let ad: &dyn SharedDir = &a;
        let dir = Path::new("/run/train");
        world.create_dir_all(dir).unwrap();
        // An empty shard: its directory's fsync after the link, and no fsync of the file.
        let before = a.counts();
        assert!(ad.create_new(&dir.join("rank-0.jsonl"), b"").unwrap());
        assert_eq!((a.counts() - before).get(OpClass::Fsync), 1);
        // An empty merge: a data file never synced, renamed, then the directory fsynced.
        let tmp = dir.join("merged.tmp");
        drop(ad.create_data(&tmp).unwrap());
        ad.rename(&tmp, &dir.join("merged")).unwrap();
        // Written but never synced, in the same directory: its fsync makes it no more durable.
        ad.append(&dir.join("data"), b"lost", false).unwrap();
        ad.fsync_dir(dir).unwrap();
        a.crash();
        assert_eq!(world.content(&dir.join("rank-0.jsonl")).unwrap(), b"");
        assert_eq!(world.content(&dir.join("merged")).unwrap(), b"");
        assert!(world.content(&dir.join("data")).is_none());
        // Not in a directory fsynced since it was made: gone.
        drop(ad.create_data(&dir.join("late")).unwrap());
        a.crash();
        assert!(world.content(&dir.join("late")).is_none());
    }

    #[test]
    fn a_torn_append_lands_a_prefix() {
        let (world, _t, a, _b) = two(Duration::ZERO, Duration::ZERO);
        let log = Path::new("/run/journal.jsonl");
        let ad: &dyn SharedDir = &a;
        ad.append(log, b"{\"done\": 1}\n", true).unwrap();
        a.tear_next_append(5);
        let e = ad.append(log, b"{\"done\": 2}\n", true).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert_eq!(world.content(log).unwrap(), b"{\"done\": 1}\n{\"don");
        assert_eq!(ad.read(log).unwrap().unwrap(), b"{\"done\": 1}\n{\"don");
        // Unsynced: a crash now takes the torn part away.
        a.crash();
        assert_eq!(world.content(log).unwrap(), b"{\"done\": 1}\n");
    }

    #[test]
    fn an_injected_enospc_is_storage_full_and_leaves_no_temporary_file() {
        let (world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let (ad, bd): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/rank-0.json");
        ad.publish(p, b"old").unwrap();
        a.fail_next(Some(OpClass::Write), 1, FaultError::Errno(libc::ENOSPC));
        let before = a.counts();
        let e = ad.publish(p, b"new").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{e}");
        assert_eq!((a.counts() - before).summary(), "open 1, write 1, unlink 1");
        assert_eq!(bd.read(p).unwrap().unwrap(), b"old");
        assert_eq!(bd.read_dir(Path::new("/run")).unwrap(), ["rank-0.json"]);
        // On the fsync of create_new's temporary file; and the fault is used up.
        a.fail_next(Some(OpClass::Fsync), 1, FaultError::Errno(libc::ENOSPC));
        let abort = Path::new("/run/abort.json");
        let e = ad.create_new(abort, b"x").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert_eq!(names(&world, "/run"), ["rank-0.json"]);
        assert!(ad.create_new(abort, b"x").unwrap());
        // Any class: the next two operations whatever they are.
        a.fail_next(None, 2, FaultError::Errno(libc::EIO));
        assert!(ad.read(p).is_err());
        assert!(ad.stat(p).is_err());
        assert!(ad.read(p).unwrap().is_some());
        // A failed unlink of the temporary file leaves it, as on a real filesystem.
        a.fail_next(Some(OpClass::Rename), 1, io::ErrorKind::PermissionDenied);
        a.fail_next(Some(OpClass::Unlink), 1, io::ErrorKind::PermissionDenied);
        assert!(ad.publish(p, b"newer").is_err());
        assert_eq!(names(&world, "/run").len(), 3);
    }

    #[test]
    fn latency_advances_the_clients_clock() {
        let (_world, t, a, _b) = two(3 * S, 3 * S);
        let p = Path::new("/run/r");
        let ad: &dyn SharedDir = &a;
        ad.publish(p, b"1").unwrap();
        a.set_latency(Duration::from_millis(1_500));
        let server = a.server_counts();
        assert!(ad.read(p).unwrap().is_some());
        assert_eq!(t.true_elapsed(), Duration::from_millis(1_500));
        assert_eq!(a.server_counts(), server, "1.5 s after its publish: cached");
        // The publish was 3 s ago by the time of this read: it goes to the server.
        assert!(ad.read(p).unwrap().is_some());
        assert_eq!(t.true_elapsed(), 3 * S);
        assert_eq!(a.latency_spent(), 3 * S);
        assert_eq!(
            (a.server_counts() - server).summary(),
            "open 1, stat 1, read 1"
        );
    }

    #[test]
    fn a_round_trip_is_spent_per_request_that_reaches_the_server() {
        let (_world, t, a, _b) = two(3 * S, 3 * S);
        let p = Path::new("/run/r");
        let ad: &dyn SharedDir = &a;
        let rt = Duration::from_millis(2);
        a.set_round_trip(rt);
        ad.publish(p, b"1").unwrap();
        let sent = a.server_counts().total();
        assert!(sent >= 3, "a publish sends its requests: {sent}");
        assert_eq!(a.latency_spent(), rt * sent as u32);
        // Within the cache lifetime a read is answered locally: no round trip.
        assert!(ad.read(p).unwrap().is_some());
        assert_eq!(a.server_counts().total(), sent);
        assert_eq!(a.latency_spent(), rt * sent as u32);
        assert_eq!(
            t.true_elapsed(),
            Duration::ZERO,
            "the clock is the caller's"
        );
    }

    #[test]
    fn a_fault_at_the_nth_call_hits_whatever_call_makes_it() {
        let (world, _t, a, _b) = two(Duration::ZERO, Duration::ZERO);
        let ad: &dyn SharedDir = &a;
        let (p, q) = (Path::new("/run/rank-0.json"), Path::new("/run/rank-1.json"));
        // The second rename from now, whichever publish makes it.
        a.at_call(
            2,
            Some(OpClass::Rename),
            OnCall::Fail(FaultError::Errno(libc::EIO)),
        );
        ad.publish(p, b"first").unwrap();
        let e = ad.publish(q, b"second").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert_eq!(
            names(&world, "/run"),
            ["rank-0.json"],
            "its temporary file removed"
        );
        ad.publish(q, b"third").unwrap();
        // Any class: the third operation from now, here the read of a whole-file read.
        let before = a.counts();
        a.at_call(3, None, OnCall::Fail(FaultError::Errno(libc::EIO)));
        let e = ad.read(p).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert_eq!((a.counts() - before).summary(), "open 1, read 1");
        assert_eq!(ad.read(p).unwrap().unwrap(), b"first");
        assert_eq!(a.fired().len(), 2);
    }

    #[test]
    fn a_pause_at_a_call_freezes_the_client_halfway_through_a_publish() {
        let (world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let p = Path::new("/run/rank-0.json");
        (&a as &dyn SharedDir).publish(p, b"old").unwrap();
        let a = Arc::new(a);
        a.at_call(1, Some(OpClass::Rename), OnCall::Pause);
        let frozen = {
            let a = a.clone();
            std::thread::spawn(move || (&*a as &dyn SharedDir).publish(p, b"new"))
        };
        while !a.is_paused() {
            std::thread::yield_now();
        }
        // Frozen with its temporary file written and not renamed: others go on meanwhile.
        assert_eq!(
            names(&world, "/run").len(),
            2,
            "{:?}",
            names(&world, "/run")
        );
        assert_eq!((&b as &dyn SharedDir).read(p).unwrap().unwrap(), b"old");
        (&b as &dyn SharedDir).publish(p, b"b's").unwrap();
        a.at_call(1, None, OnCall::Pause);
        a.resume();
        frozen.join().unwrap().unwrap();
        assert_eq!(
            world.content(p).unwrap(),
            b"new",
            "the rename landed after the thaw"
        );
        assert_eq!(names(&world, "/run"), ["rank-0.json"]);
        // The thaw disarmed the pause armed during the freeze.
        (&*a as &dyn SharedDir).publish(p, b"newer").unwrap();
        assert!(!a.is_paused());
    }

    #[test]
    fn a_hung_rename_lands_late_and_may_answer_an_error_after_landing() {
        let (world, t, a, _b) = two(Duration::ZERO, Duration::ZERO);
        let ad: &dyn SharedDir = &a;
        let (x, y) = (Path::new("/run/x"), Path::new("/run/y"));
        let hang = |then| OnCall::Hang { for_: 30 * S, then };
        a.at_call(1, Some(OpClass::Rename), hang(None));
        ad.publish(y, b"1").unwrap();
        assert_eq!(t.true_elapsed(), 30 * S, "the caller blocked for the hang");
        assert_eq!(world.content(y).unwrap(), b"1");
        // Landed, and the caller hears ENOENT (the retransmission found `x` gone).
        ad.publish(x, b"2").unwrap();
        a.at_call(
            1,
            Some(OpClass::Rename),
            hang(Some(FaultError::Errno(libc::ENOENT))),
        );
        let e = ad.rename(x, y).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert_eq!(world.content(y).unwrap(), b"2");
        assert!(world.content(x).is_none());
        assert_eq!(t.true_elapsed(), 60 * S);
        // Any other operation fails instead of landing.
        a.at_call(
            1,
            Some(OpClass::Mkdir),
            hang(Some(FaultError::Errno(libc::EIO))),
        );
        assert!(ad.create_dir(Path::new("/run/d")).is_err());
        assert!(world.list(Path::new("/run/d")).is_err());
    }

    #[test]
    fn a_server_restart_fails_or_holds_up_every_clients_server_calls() {
        let (world, t, a, b) = two(10 * S, Duration::ZERO);
        let (ad, bd): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/r");
        ad.publish(p, b"1").unwrap();
        assert_eq!(bd.read(p).unwrap().unwrap(), b"1");
        // A soft mount: every call that reaches the server fails for 20 s.
        let timed_out = FaultError::Errno(libc::ETIMEDOUT);
        world.restart_after(1, 20 * S, Outage::Fail(timed_out));
        let e = ad.publish(p, b"2").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ETIMEDOUT));
        assert_eq!(world.restarts(), 1);
        assert_eq!(bd.read(p).unwrap().unwrap(), b"1", "from b's cache");
        assert!(bd.read(Path::new("/run/other")).is_err());
        t.advance(20 * S);
        ad.publish(p, b"3").unwrap();
        assert_eq!(
            world.content(p).unwrap(),
            b"3",
            "nothing lost, back at once"
        );
        // A hard mount: a call waits until the server is back.
        world.restart_after(2, 45 * S, Outage::Hang);
        ad.publish(p, b"4").unwrap();
        assert_eq!(t.true_elapsed(), 65 * S);
        assert_eq!(world.content(p).unwrap(), b"4");
    }

    #[test]
    fn a_fuse_entry_timeout_reads_a_renamed_over_record_stale_through_an_open() {
        let (_world, t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let fuse = Fuse {
            entry: 5 * S,
            negative: 5 * S,
            noreplace: true,
        };
        b.set_fuse(Some(fuse));
        b.set_close_to_open(true);
        let (ad, bd): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/rank-0.json");
        ad.publish(p, b"one").unwrap();
        assert_eq!(bd.read(p).unwrap().unwrap(), b"one");
        t.advance(S);
        ad.publish(p, b"two").unwrap();
        assert_eq!(
            bd.read(p).unwrap().unwrap(),
            b"one",
            "renamed over: read stale through the cached name, close-to-open or not"
        );
        t.advance(4 * S);
        assert_eq!(bd.read(p).unwrap().unwrap(), b"two");
        assert!(bd.caches_lookups(p));
        assert!(!ad.caches_lookups(p));
    }

    #[test]
    fn a_fuse_negative_timeout_answers_eexist_for_a_name_stat_cannot_see() {
        let (world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        b.set_fuse(Some(Fuse {
            entry: Duration::ZERO,
            negative: 5 * S,
            noreplace: true,
        }));
        let (ad, bd): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let (d, abort) = (Path::new("/run/gen-2"), Path::new("/run/abort.json"));
        assert!(bd.stat(d).unwrap().is_none());
        assert!(bd.read(abort).unwrap().is_none());
        ad.create_dir(d).unwrap();
        assert!(ad.create_new(abort, b"rank 1").unwrap());
        let e = bd.create_dir(d).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(bd.stat(d).unwrap().is_none(), "EEXIST, and still not there");
        assert!(!bd.create_new(abort, b"rank 2").unwrap());
        assert!(
            bd.read(abort).unwrap().is_none(),
            "lost the create, cannot read it"
        );
        // create_dir_all and an append get past it as the store does: a listing.
        let before = b.counts();
        bd.create_dir_all(d).unwrap();
        assert_eq!(
            (b.counts() - before).summary(),
            "open 1, stat 2, mkdir 1, readdir 1"
        );
        assert!(bd.stat(d).unwrap().is_some());
        bd.refresh(Path::new("/run")).unwrap();
        assert_eq!(bd.read(abort).unwrap().unwrap(), b"rank 1");
        let log = Path::new("/run/log");
        assert!(bd.read(log).unwrap().is_none());
        ad.append(log, b"a\n", false).unwrap();
        bd.append(log, b"b\n", false).unwrap();
        assert_eq!(world.content(log).unwrap(), b"a\nb\n");
    }

    #[test]
    fn without_rename_noreplace_fuse_falls_back_to_a_link_and_never_replaces() {
        let (world, _t, a, _b) = two(Duration::ZERO, Duration::ZERO);
        a.set_fuse(Some(Fuse {
            entry: Duration::ZERO,
            negative: Duration::ZERO,
            noreplace: false,
        }));
        let ad: &dyn SharedDir = &a;
        let (x, y, z) = (
            Path::new("/run/x"),
            Path::new("/run/y"),
            Path::new("/run/z"),
        );
        ad.publish(x, b"x").unwrap();
        ad.publish(z, b"z").unwrap();
        let before = a.counts();
        ad.rename_noreplace(x, y).unwrap();
        assert_eq!(
            (a.counts() - before).summary(),
            "stat 1, rename 2, unlink 1",
            "renameat2's EINVAL, then link and unlink"
        );
        let e = ad.rename_noreplace(z, y).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(world.content(y).unwrap(), b"x");
        // Not atomic: cut between the link and the unlink, both names hold the file.
        a.at_call(
            1,
            Some(OpClass::Unlink),
            OnCall::Fail(FaultError::Errno(libc::EIO)),
        );
        assert!(ad.rename_noreplace(z, Path::new("/run/w")).is_err());
        assert_eq!(names(&world, "/run"), ["w", "y", "z"]);
    }

    #[test]
    fn a_handle_on_a_file_renamed_over_by_another_client_reads_estale() {
        let (_world, _t, a, b) = two(Duration::ZERO, Duration::ZERO);
        let (ad, bd): (&dyn SharedDir, &dyn SharedDir) = (&a, &b);
        let p = Path::new("/run/merged.jsonl");
        ad.publish(p, b"one\n").unwrap();
        let mut r = bd.open_data(p).unwrap();
        let mut buf = Vec::new();
        assert_eq!(r.read_more(&mut buf, 2).unwrap(), 2);
        ad.publish(p, b"two\n").unwrap();
        let e = r.read_more(&mut buf, 2).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESTALE));
        // Opened again: the new file.
        let mut r = bd.open_data(p).unwrap();
        assert_eq!(r.read_more(&mut buf, 9).unwrap(), 4);
    }

    /// The same calls on the real store (a temporary directory) and on a simulated one
    /// rooted at the same path give the same results and the same counts, call by call.
    #[test]
    fn counts_and_results_equal_the_real_stores() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().to_path_buf();
        let world = SimWorld::new();
        world.create_dir_all(&root).unwrap();
        let sim = world.client(|| Duration::ZERO, 3 * S, 3 * S);
        type Step = Box<dyn Fn(&dyn SharedDir, &Path) -> String>;
        fn show<T: std::fmt::Debug>(r: io::Result<T>) -> String {
            format!("{:?}", r.map_err(|e| e.kind()))
        }
        let meta = |m: io::Result<Option<Meta>>| {
            show(m.map(|m| m.map(|m| (m.kind, (m.kind == Kind::File).then_some(m.len)))))
        };
        let steps: Vec<(&str, Step)> = vec![
            (
                "mkdir -p two levels",
                Box::new(|s, r| show(s.create_dir_all(&r.join("a/b")))),
            ),
            (
                "mkdir -p existing",
                Box::new(|s, r| show(s.create_dir_all(&r.join("a/b")))),
            ),
            (
                "mkdir existing",
                Box::new(|s, r| show(s.create_dir(&r.join("a")))),
            ),
            (
                "mkdir missing parent",
                Box::new(|s, r| show(s.create_dir(&r.join("x/y")))),
            ),
            ("mkdir", Box::new(|s, r| show(s.create_dir(&r.join("c"))))),
            (
                "durable publish",
                Box::new(|s, r| show(s.publish(&r.join("a/r.json"), b"one"))),
            ),
            (
                "live publish",
                Box::new(|s, r| {
                    show(s.publish_with(&r.join("a/r.json"), false, &mut |w| w.write_all(b"two")))
                }),
            ),
            (
                "publish, missing dir",
                Box::new(|s, r| show(s.publish(&r.join("x/r.json"), b"1"))),
            ),
            (
                "publish, writer fails",
                Box::new(|s, r| {
                    show(s.publish_with(&r.join("a/r.json"), true, &mut |_| {
                        Err(io::Error::other("no"))
                    }))
                }),
            ),
            ("read", Box::new(|s, r| show(s.read(&r.join("a/r.json"))))),
            (
                "read missing",
                Box::new(|s, r| show(s.read(&r.join("a/none")))),
            ),
            (
                "read missing dir",
                Box::new(|s, r| show(s.read(&r.join("x/none")))),
            ),
            (
                "read a directory",
                Box::new(|s, r| show(s.read(&r.join("a")))),
            ),
            (
                "first append",
                Box::new(|s, r| show(s.append(&r.join("ev/rank-0.jsonl"), b"a\n", false))),
            ),
            (
                "synced append",
                Box::new(|s, r| show(s.append(&r.join("ev/rank-0.jsonl"), b"b\n", true))),
            ),
            (
                "read_dir",
                Box::new(|s, r| {
                    show(s.read_dir(r).map(|mut v| {
                        v.sort();
                        v
                    }))
                }),
            ),
            (
                "read_dir missing",
                Box::new(|s, r| show(s.read_dir(&r.join("x")))),
            ),
            (
                "read_dir of a file",
                Box::new(|s, r| show(s.read_dir(&r.join("a/r.json")))),
            ),
            (
                "lstat file",
                Box::new(move |s, r| meta(s.lstat(&r.join("a/r.json")))),
            ),
            ("stat dir", Box::new(move |s, r| meta(s.stat(&r.join("a"))))),
            (
                "stat missing",
                Box::new(move |s, r| meta(s.stat(&r.join("none")))),
            ),
            (
                "create_new",
                Box::new(|s, r| show(s.create_new(&r.join("a/abort.json"), b"1"))),
            ),
            (
                "create_new again",
                Box::new(|s, r| show(s.create_new(&r.join("a/abort.json"), b"2"))),
            ),
            (
                "create_new missing dir",
                Box::new(|s, r| show(s.create_new(&r.join("x/abort"), b"2"))),
            ),
            (
                "rename_noreplace",
                Box::new(|s, r| show(s.rename_noreplace(&r.join("a/r.json"), &r.join("a/s.json")))),
            ),
            (
                "rename_noreplace onto a file",
                Box::new(|s, r| {
                    show(s.rename_noreplace(&r.join("a/abort.json"), &r.join("a/s.json")))
                }),
            ),
            (
                "rename_noreplace onto an empty dir",
                Box::new(|s, r| show(s.rename_noreplace(&r.join("a/b"), &r.join("c")))),
            ),
            (
                "rename replacing",
                Box::new(|s, r| show(s.rename(&r.join("a/abort.json"), &r.join("a/s.json")))),
            ),
            (
                "rename missing",
                Box::new(|s, r| show(s.rename(&r.join("a/abort.json"), &r.join("a/t")))),
            ),
            (
                "rename a dir onto an empty one",
                Box::new(|s, r| show(s.rename(&r.join("a/b"), &r.join("c")))),
            ),
            (
                "sync_file",
                Box::new(|s, r| show(s.sync_file(&r.join("a/s.json")))),
            ),
            (
                "sync_file missing",
                Box::new(|s, r| show(s.sync_file(&r.join("a/none")))),
            ),
            (
                "fsync_dir",
                Box::new(|s, r| show(s.fsync_dir(&r.join("a")))),
            ),
            (
                "fsync_dir missing",
                Box::new(|s, r| show(s.fsync_dir(&r.join("x")))),
            ),
            (
                "overwrite in place",
                Box::new(|s, r| show(s.overwrite_in_place(&r.join("a/s.json"), b"9"))),
            ),
            (
                "overwrite too large",
                Box::new(|s, r| show(s.overwrite_in_place(&r.join("a/s.json"), &[b'x'; 5000]))),
            ),
            (
                "overwrite missing",
                Box::new(|s, r| show(s.overwrite_in_place(&r.join("a/none"), b"9"))),
            ),
            (
                "remove_file",
                Box::new(|s, r| show(s.remove_file(&r.join("ev/rank-0.jsonl")))),
            ),
            (
                "remove_file missing",
                Box::new(|s, r| show(s.remove_file(&r.join("ev/rank-0.jsonl")))),
            ),
            (
                "remove_file of a dir",
                Box::new(|s, r| show(s.remove_file(&r.join("ev")))),
            ),
            (
                "mkdir -p a tree",
                Box::new(|s, r| show(s.create_dir_all(&r.join("t/u")))),
            ),
            (
                "publish in it",
                Box::new(|s, r| show(s.publish(&r.join("t/u/f"), b"x"))),
            ),
            (
                "walk",
                Box::new(|s, r| {
                    show(s.walk(&r.join("t")).map(|v| {
                        v.into_iter()
                            .map(|(p, m)| (p.strip_prefix(r).unwrap().to_path_buf(), m.kind))
                            .collect::<Vec<_>>()
                    }))
                }),
            ),
            (
                "canonicalize",
                Box::new(|s, r| {
                    show(
                        s.canonicalize(&r.join("t/../t/./u/f"))
                            .map(|p| p.strip_prefix(r).unwrap().to_path_buf()),
                    )
                }),
            ),
            (
                "canonicalize missing",
                Box::new(|s, r| show(s.canonicalize(&r.join("t/none/f")))),
            ),
            (
                "rmdir not empty",
                Box::new(|s, r| show(s.remove_dir(&r.join("t")))),
            ),
            (
                "rmdir a file",
                Box::new(|s, r| show(s.remove_dir(&r.join("t/u/f")))),
            ),
            (
                "read_link of a file",
                Box::new(|s, r| show(s.read_link(&r.join("t/u/f")))),
            ),
            (
                "read_link missing",
                Box::new(|s, r| show(s.read_link(&r.join("t/u/none")))),
            ),
            (
                "remove_dir_all",
                Box::new(|s, r| show(s.remove_dir_all(&r.join("t")))),
            ),
            (
                "rmdir missing",
                Box::new(|s, r| show(s.remove_dir(&r.join("t")))),
            ),
            (
                "remove_dir_all missing",
                Box::new(|s, r| show(s.remove_dir_all(&r.join("t")))),
            ),
            (
                "read after",
                Box::new(|s, r| show(s.read(&r.join("a/s.json")))),
            ),
            (
                "read_dir after",
                Box::new(|s, r| {
                    show(s.read_dir(&r.join("a")).map(|mut v| {
                        v.sort();
                        v
                    }))
                }),
            ),
        ];
        let real = crate::store::Fs;
        for (what, step) in &steps {
            let before = (real.counts(), sim.counts());
            let (r, s) = (step(&real, &root), step(&sim, &root));
            let counts = (real.counts() - before.0, sim.counts() - before.1);
            assert_eq!(s, r, "{what}: result");
            assert_eq!(counts.1.summary(), counts.0.summary(), "{what}: counts");
        }
        // And the trees hold the same.
        for dir in ["", "a", "c", "ev"] {
            let mut real: Vec<_> = std::fs::read_dir(root.join(dir))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            real.sort();
            assert_eq!(world.list(&root.join(dir)).unwrap(), real, "{dir}");
            for name in real {
                let p = root.join(dir).join(name);
                if p.is_file() {
                    assert_eq!(world.content(&p).unwrap(), std::fs::read(&p).unwrap());
                }
            }
        }
    }
}
