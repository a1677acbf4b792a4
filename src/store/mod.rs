//! Access to the shared directory, behind one trait so that every operation on it is
//! counted by class and a simulated directory can stand in for the real one.
//!
//! - [`SharedDir`] is what the node does to the shared directory: atomic publish, tolerant
//!   and strict reads, exclusive create, rename without replacing, appends, directory
//!   creation, listing and removal, links read. Every implementation counts what it does
//!   in [`OpCounts`]; walks, `remove_dir_all` and `canonicalize` are built on those calls
//!   (on `dyn SharedDir`), so a simulated directory answers them too.
//! - [`fs`] is the real one ([`Fs`]; its free functions are its data plane: files written
//!   through an open handle, and the reads of tools that hold no store); it reaches
//!   every name it writes through [`beneath`], which never follows a link inside a run.
//! - `sim` (with the `sim` feature) is a simulated one: one directory tree in memory seen
//!   by many clients, each with the attribute and negative-lookup caches of an NFS client,
//!   on simulated time.
//!
//! Shared filesystems give few guarantees (docs/shared-directory.md): a rename within one
//! directory is atomic on NFS and Lustre but a copy on blob FUSE, so readers treat a
//! missing *or unparsable* file as "not yet" instead of trusting that a name implies
//! complete content.

pub mod beneath;
pub mod fs;
mod ops;
#[cfg(feature = "sim")]
pub mod sim;

#[cfg(test)]
mod seam;

pub use beneath::Untrusted;
pub use fs::Fs;

use serde::{de::DeserializeOwned, Serialize};
use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The classes of operation on the shared directory, one per kind of system call (what
/// `strace -c` would list): opening a file, `stat`, reading, writing, `rename` (and
/// `link`), `mkdir`, `fsync` (of a file or a directory), listing a directory, `unlink`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpClass {
    Open,
    Stat,
    Read,
    Write,
    Rename,
    Mkdir,
    Fsync,
    Readdir,
    Unlink,
}

impl OpClass {
    pub const ALL: [OpClass; 9] = [
        OpClass::Open,
        OpClass::Stat,
        OpClass::Read,
        OpClass::Write,
        OpClass::Rename,
        OpClass::Mkdir,
        OpClass::Fsync,
        OpClass::Readdir,
        OpClass::Unlink,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpClass::Open => "open",
            OpClass::Stat => "stat",
            OpClass::Read => "read",
            OpClass::Write => "write",
            OpClass::Rename => "rename",
            OpClass::Mkdir => "mkdir",
            OpClass::Fsync => "fsync",
            OpClass::Readdir => "readdir",
            OpClass::Unlink => "unlink",
        }
    }
}

/// Operations on the shared directory, by class. One call counts once whatever its size
/// (a read of a large file that takes several `read` calls counts one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts([u64; 9]);

impl OpCounts {
    pub fn get(&self, class: OpClass) -> u64 {
        self.0[class as usize]
    }

    pub fn add(&mut self, class: OpClass, n: u64) {
        self.0[class as usize] += n;
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// `open 12, stat 3, …` (classes with a zero count left out), as the node's last line
    /// and the benchmarks print it.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = OpClass::ALL
            .iter()
            .filter(|c| self.get(**c) > 0)
            .map(|c| format!("{} {}", c.name(), self.get(*c)))
            .collect();
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(", ")
        }
    }
}

impl std::ops::Sub for OpCounts {
    type Output = OpCounts;
    fn sub(self, o: OpCounts) -> OpCounts {
        let mut out = self;
        for (a, b) in out.0.iter_mut().zip(o.0) {
            *a = a.saturating_sub(b);
        }
        out
    }
}

impl std::ops::AddAssign for OpCounts {
    fn add_assign(&mut self, o: OpCounts) {
        for (a, b) in self.0.iter_mut().zip(o.0) {
            *a += b;
        }
    }
}

/// What `stat` says about a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub len: u64,
    pub kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

/// The shared directory as the node uses it. Paths are absolute paths under the run's
/// directory (the real implementation hands them to the OS as they are).
///
/// Generic conveniences (JSON in and out) are on `dyn SharedDir` itself, so the trait
/// stays object-safe and the node holds an `Arc<dyn SharedDir>`.
pub trait SharedDir: Send + Sync {
    /// The whole file, if it is no larger than `limit` allows (else a [`TooLarge`] error
    /// naming it); a missing file is `None`. A symbolic link at `path` is not followed.
    fn read_limited(&self, path: &Path, limit: ReadLimit) -> io::Result<Option<Vec<u8>>>;

    /// [`SharedDir::read_limited`] of a file of the record class (live records, the cluster
    /// record, aborts, leases, pointers).
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        self.read_limited(path, ReadLimit::Record)
    }

    /// Replace `path` atomically with what `write` writes: a temporary file in the same
    /// directory, renamed over `path`. `durable` also fsyncs the file and the directory
    /// (for commits; a live record only needs the atomic replacement). On an error `path`
    /// is left as it was and no temporary file stays behind.
    fn publish_with(
        &self,
        path: &Path,
        durable: bool,
        write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<()>;

    /// Create `path` with `bytes` only if it does not exist yet: the first writer wins
    /// (`false` when another got there first). A commit: when it returns `true`, the file
    /// and its directory have been fsynced (the directory after the name was made), so a
    /// caller need not fsync the directory again.
    fn create_new(&self, path: &Path, bytes: &[u8]) -> io::Result<bool>;

    /// [`SharedDir::create_new`] without fsync, for a transient claim that needs only
    /// "first writer wins" (a dynamic rollout's lease: lost in a crash of the server, it
    /// costs a second attempt of the item, whose commit still keeps exactly one file).
    fn create_new_live(&self, path: &Path, bytes: &[u8]) -> io::Result<bool>;

    /// The last resort of a node that can no longer create files (a full disk, a quota):
    /// overwrite the existing file `path` in place with `bytes`, within the space the file
    /// already has (its length, or the blocks allocated to it), so no new space is needed
    /// on a filesystem that overwrites in place (ext4, xfs, tmpfs, NFS, Lustre; not
    /// copy-on-write ones). A shorter value is padded with spaces. Not atomic: a reader may
    /// see a mix for a moment, which the tolerant readers treat as "not yet". Fails with
    /// `FileTooLarge` when the value does not fit.
    fn overwrite_in_place(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;

    /// Append `bytes` to `path`, creating it (and its directory) if needed; `sync` makes
    /// the append durable before returning.
    fn append(&self, path: &Path, bytes: &[u8], sync: bool) -> io::Result<()>;

    /// An open handle on `path` for appending, creating the file (and its directory) if
    /// needed: a log written line by line costs one `write` per line instead of an open
    /// per line. Each write through it is counted. `None` where this store has no handles
    /// (the simulated directory): the caller appends by path instead.
    fn open_append(&self, path: &Path) -> io::Result<Option<Box<dyn Write + Send>>> {
        let _ = path;
        Ok(None)
    }

    /// The whole of `path`, opened with `O_CREAT` (an empty file, and its directory, are
    /// made when it is missing). An open that may create goes to the server whatever this
    /// client's negative-lookup cache says, so a name another client created is seen at
    /// once: the way a worker finds rank 0's first generation without waiting out that
    /// cache (docs/shared-directory.md, "A generation").
    fn read_or_create(&self, path: &Path) -> io::Result<Vec<u8>>;

    /// Make this client see `path` as the server has it: an exclusive create that is
    /// expected to fail (`EEXIST` drops a stale "no such file" from the lookup cache).
    /// `true` when `path` exists. If it did not, the empty file the create made is removed
    /// again (unless something replaced it meanwhile) and the answer is `false`.
    fn revalidate(&self, path: &Path) -> io::Result<bool>;

    /// Make this client see the names in directory `dir` as the server has them now (see
    /// [`fs::refresh`]): before reading what other nodes wrote there, on a filesystem whose
    /// clients cache lookups. Nothing where no such cache applies (the default).
    fn refresh(&self, dir: &Path) -> io::Result<()> {
        let _ = dir;
        Ok(())
    }

    /// How many reads this client can usefully have in flight at once, from as many
    /// threads: over a network filesystem each read waits for a round trip, and rank 0's
    /// poll of a large cluster reads every rank that has not arrived. One (read one after
    /// another) where reads are cheap or must stay on the caller's thread (the simulator).
    fn read_parallelism(&self) -> usize {
        1
    }

    /// Whether this client may answer lookups under `path` from a cache past other
    /// clients' changes (a FUSE mount; see [`fs::refresh`]).
    fn caches_lookups(&self, path: &Path) -> bool {
        let _ = path;
        false
    }

    /// A plain rename (replaces `dst`).
    fn rename(&self, src: &Path, dst: &Path) -> io::Result<()>;

    /// Rename `src` to `dst` only if nothing exists at `dst` (`AlreadyExists` otherwise).
    fn rename_noreplace(&self, src: &Path, dst: &Path) -> io::Result<()>;

    fn create_dir(&self, path: &Path) -> io::Result<()>;

    fn create_dir_all(&self, path: &Path) -> io::Result<()>;

    /// The names in a directory, in no particular order.
    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>>;

    fn remove_file(&self, path: &Path) -> io::Result<()>;

    /// Remove the empty directory `path` (`rmdir`; a link at `path` is not followed).
    fn remove_dir(&self, path: &Path) -> io::Result<()>;

    /// What the symbolic link `path` holds, as written in it (`EINVAL` when `path` is no
    /// link).
    fn read_link(&self, path: &Path) -> io::Result<PathBuf>;

    /// When what `path` names (a link itself) was last modified; `None` where the store
    /// keeps no times (the simulated directory). A missing `path` is a `NotFound` error.
    fn modified(&self, path: &Path) -> io::Result<Option<std::time::SystemTime>> {
        self.lstat(path)?
            .map(|_| None)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    /// Whether data files may be read on several threads at once. The simulated directory
    /// is one whose callers take turns on the simulation's scheduler, so not there.
    fn concurrent_data(&self) -> bool {
        true
    }

    /// `lstat` (a symlink is itself); `None` when nothing is there.
    fn lstat(&self, path: &Path) -> io::Result<Option<Meta>>;

    /// `stat` (a symlink is followed); `None` when nothing is there (or a dangling link).
    fn stat(&self, path: &Path) -> io::Result<Option<Meta>>;

    /// Make a file's content durable (open and fsync).
    fn sync_file(&self, path: &Path) -> io::Result<()>;

    /// Make a directory's entries durable (best effort where the filesystem refuses).
    fn fsync_dir(&self, path: &Path) -> io::Result<()>;

    /// The data plane (shards, merged files: as large as the user's data, so streamed a
    /// block at a time, never read whole): `path` opened for reading, following a link as
    /// `File::open` does. A missing file is a `NotFound` error.
    fn open_data(&self, path: &Path) -> io::Result<Box<dyn DataRead>>;

    /// The operating system's file at `path`, open for reading, where this store's files
    /// are the OS's (a merge copies from it in the kernel, `copy_file_range`); `None`
    /// where they are not (the simulated directory), and the caller reads through
    /// [`SharedDir::open_data`].
    fn open_os_file(&self, path: &Path) -> io::Result<Option<std::fs::File>> {
        let _ = path;
        Ok(None)
    }

    /// [`SharedDir::create_data`] as the operating system's file (for `copy_file_range`
    /// into it); `None` where this store's files are not the OS's.
    fn create_os_file(&self, path: &Path) -> io::Result<Option<std::fs::File>> {
        let _ = path;
        Ok(None)
    }

    /// A new, empty data file at `path` for writing (whatever stood at the name is removed
    /// first, never written through; see [`fs::create_file`]). What it writes is durable
    /// once [`DataWrite::sync_all`] returns.
    fn create_data(&self, path: &Path) -> io::Result<Box<dyn DataWrite + '_>>;

    /// What this store has done so far, by class.
    fn counts(&self) -> OpCounts;
}

/// A data file open for reading ([`SharedDir::open_data`]).
pub trait DataRead: Send {
    /// Its size when it was opened.
    fn size(&self) -> u64;

    /// Read at most `max` bytes onto the end of `buf`; how many (0 at the end of the file).
    fn read_more(&mut self, buf: &mut Vec<u8>, max: usize) -> io::Result<usize>;
}

/// A [`DataRead`] as a buffered reader, for parsers that take a `BufRead` (the metrics'
/// statistics of a merged file).
pub struct DataReader {
    data: Box<dyn DataRead>,
    buf: Vec<u8>,
    pos: usize,
}

impl DataReader {
    /// Bytes asked of the store at a time.
    const CHUNK: usize = 1 << 16;

    pub fn new(data: Box<dyn DataRead>) -> DataReader {
        DataReader {
            data,
            buf: Vec::with_capacity(Self::CHUNK),
            pos: 0,
        }
    }
}

impl std::io::Read for DataReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let n = {
            let got = std::io::BufRead::fill_buf(self)?;
            let n = got.len().min(out.len());
            out[..n].copy_from_slice(&got[..n]);
            n
        };
        std::io::BufRead::consume(self, n);
        Ok(n)
    }
}

impl std::io::BufRead for DataReader {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
            self.data.read_more(&mut self.buf, Self::CHUNK)?;
        }
        Ok(&self.buf[self.pos..])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.buf.len());
    }
}

/// A data file open for writing ([`SharedDir::create_data`]).
pub trait DataWrite: Write + Send {
    /// The `len` bytes from `offset` on were written: a real file starts writing them back
    /// so that the final sync has little left to do.
    fn written(&mut self, offset: u64, len: u64) {
        let _ = (offset, len);
    }

    /// Make everything written durable (fsync).
    fn sync_all(&mut self) -> io::Result<()>;
}

impl dyn SharedDir + '_ {
    /// A durable [`SharedDir::publish_with`] of `bytes`.
    pub fn publish(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.publish_with(path, true, &mut |w| w.write_all(bytes))
    }

    /// A durable publish of `value` as JSON (streamed: a plan can be over 100 MB).
    pub fn publish_json<T: Serialize>(&self, path: &Path, value: &T) -> io::Result<()> {
        self.publish_with(path, true, &mut |w| fs::write_json(w, value))
    }

    /// A live record (a rank's heartbeat record, a placeholder): replaced atomically, not
    /// made durable. Live records are transient: a node that loses one in a machine crash
    /// starts a new generation anyway, and readers treat a missing or torn record as "not
    /// yet" (docs/shared-directory.md, "Durability").
    pub fn publish_live_json<T: Serialize>(&self, path: &Path, value: &T) -> io::Result<()> {
        self.publish_with(path, false, &mut |w| fs::write_json(w, value))
    }

    /// [`SharedDir::overwrite_in_place`] of `value` as compact JSON.
    pub fn overwrite_json_in_place<T: Serialize>(&self, path: &Path, value: &T) -> io::Result<()> {
        self.overwrite_in_place(path, &serde_json::to_vec(value).map_err(io::Error::other)?)
    }

    pub fn create_new_json<T: Serialize>(&self, path: &Path, value: &T) -> io::Result<bool> {
        self.create_new(path, &fs::json_bytes(value)?)
    }

    /// [`SharedDir::create_new_live`] of `value` as JSON.
    pub fn create_new_live_json<T: Serialize>(&self, path: &Path, value: &T) -> io::Result<bool> {
        self.create_new_live(path, &fs::json_bytes(value)?)
    }

    /// A live record: missing or unparsable (torn, half-copied) is `None` ("not yet").
    pub fn read_json<T: DeserializeOwned>(&self, path: &Path) -> io::Result<Option<T>> {
        Ok(self
            .read(path)?
            .and_then(|b| serde_json::from_slice(&b).ok()))
    }

    /// One of the run's own state files: missing is `Ok(None)`, anything unusable is
    /// `Err(Damaged)` naming the file and what is wrong (see [`fs::read_strict`]).
    pub fn read_strict<T: DeserializeOwned>(&self, path: &Path) -> Result<Option<T>, Damaged> {
        fs::parse_strict_read(path, self.read(path))
    }

    /// [`SharedDir::read_limited`] as `std::fs::read` answers: a missing file is a
    /// `NotFound` error naming it.
    pub fn read_file(&self, path: &Path, limit: ReadLimit) -> io::Result<Vec<u8>> {
        self.read_limited(path, limit)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} does not exist", path.display()),
            )
        })
    }

    /// Everything below the directory `root` (not `root` itself), as `lstat` sees it (a
    /// link is listed, never followed): each directory's names sorted, a directory before
    /// what it holds. What a checkpoint's walks are built on.
    pub fn walk(&self, root: &Path) -> io::Result<Vec<(PathBuf, Meta)>> {
        let mut out = Vec::new();
        self.walk_into(root, &mut out)?;
        Ok(out)
    }

    fn walk_into(&self, dir: &Path, out: &mut Vec<(PathBuf, Meta)>) -> io::Result<()> {
        let mut names = self.read_dir(dir)?;
        names.sort();
        for name in names {
            let path = dir.join(name);
            // Gone since the listing: nothing to walk.
            let Some(meta) = self.lstat(&path)? else {
                continue;
            };
            out.push((path.clone(), meta));
            if meta.kind == Kind::Dir {
                self.walk_into(&path, out)?;
            }
        }
        Ok(())
    }

    /// `std::fs::remove_dir_all`: `path` and everything below it, links removed, never
    /// followed. A missing `path` is a `NotFound` error.
    pub fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        match self.lstat(path)? {
            None => return Err(io::Error::from_raw_os_error(libc::ENOENT)),
            Some(m) if m.kind != Kind::Dir => return self.remove_file(path),
            Some(_) => {}
        }
        // Reversed, the walk lists what a directory holds before the directory.
        for (p, meta) in self.walk(path)?.into_iter().rev() {
            let removed = match meta.kind {
                Kind::Dir => self.remove_dir(&p),
                _ => self.remove_file(&p),
            };
            match removed {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        self.remove_dir(path)
    }

    /// `std::fs::canonicalize` through the store: the absolute `path` with every link in
    /// it resolved (at most 40, else `ELOOP`), `.` and `..` taken out. A missing part is a
    /// `NotFound` error.
    pub fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        use std::path::Component;
        let parts = |p: &Path| -> Vec<OsString> {
            p.components()
                .filter_map(|c| match c {
                    Component::Normal(s) => Some(s.to_os_string()),
                    Component::ParentDir => Some(OsString::from("..")),
                    _ => None,
                })
                .rev()
                .collect()
        };
        let mut todo = parts(path);
        let mut out = PathBuf::from("/");
        let mut links = 0;
        while let Some(part) = todo.pop() {
            if part == ".." {
                out.pop();
                continue;
            }
            out.push(&part);
            let meta = self
                .lstat(&out)?
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
            if meta.kind != Kind::Symlink {
                continue;
            }
            links += 1;
            if links > 40 {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            let target = self.read_link(&out)?;
            out.pop();
            if target.is_absolute() {
                out = PathBuf::from("/");
            }
            todo.extend(parts(&target));
        }
        Ok(out)
    }

    pub fn exists(&self, path: &Path) -> bool {
        self.lstat(path).is_ok_and(|m| m.is_some())
    }

    /// Whether `path` names something, as `Path::exists` answers: a link is followed (a
    /// dangling one is not there), and an error reading it is "no".
    pub fn exists_followed(&self, path: &Path) -> bool {
        self.stat(path).is_ok_and(|m| m.is_some())
    }

    /// Whether `path` is a directory, as `Path::is_dir` answers (a link is followed).
    pub fn is_dir(&self, path: &Path) -> bool {
        self.stat(path)
            .is_ok_and(|m| m.is_some_and(|m| m.kind == Kind::Dir))
    }

    /// Whether `path` is a regular file, as `Path::is_file` answers (a link is followed).
    pub fn is_file(&self, path: &Path) -> bool {
        self.stat(path)
            .is_ok_and(|m| m.is_some_and(|m| m.kind == Kind::File))
    }

    /// Move the name a refusal is about (a planted link, a foreign file; [`Untrusted::at`])
    /// out of the way, to `<name>.untrusted-<pid>-<n>` beside it: renamed, never followed
    /// nor deleted, so whoever looks finds it. Where it went.
    pub fn set_aside_untrusted(&self, refused: &Untrusted) -> io::Result<PathBuf> {
        let name = refused
            .at
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut last = None;
        for n in 0..16 {
            let aside = refused
                .at
                .with_file_name(format!("{name}.untrusted-{}-{n}", std::process::id()));
            match self.rename_noreplace(&refused.at, &aside) {
                Ok(()) => return Ok(aside),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)))
    }

    /// [`SharedDir::open_append`] for a log: where a planted link or a foreign file stands at
    /// its name (or on the way to it), that is set aside ([`Self::set_aside_untrusted`]) and
    /// a new log begun; the note says so, for the node to warn. A log is never written
    /// through such a name, and never stops the node for one.
    pub fn open_log(&self, path: &Path) -> io::Result<(Option<LogHandle>, Option<String>)> {
        self.setting_aside(|| self.open_append(path))
    }

    /// `open()`, and where it is refused for what stands at the name (a planted link, a
    /// foreign file), that set aside and `open()` again; the note says so.
    pub(crate) fn setting_aside<T>(
        &self,
        open: impl Fn() -> io::Result<T>,
    ) -> io::Result<(T, Option<String>)> {
        match open() {
            Err(e) => match Untrusted::of(&e) {
                Some(refused) => {
                    let aside = self.set_aside_untrusted(refused)?;
                    Ok((open()?, Some(set_aside_note(refused, &aside))))
                }
                None => Err(e),
            },
            Ok(w) => Ok((w, None)),
        }
    }
}

/// What a node says after it set `refused.at` aside as `aside` and began a new log.
pub fn set_aside_note(refused: &Untrusted, aside: &Path) -> String {
    format!(
        "{refused}; moved it aside to {} and wrote {} anew",
        aside.display(),
        refused.path.display()
    )
}

/// What an in-place overwrite writes over a file of `old` bytes with `allocated` bytes of
/// blocks: `value`, padded with spaces to the old length and ended with a newline; or
/// `FileTooLarge` when it does not fit (see [`SharedDir::overwrite_in_place`]).
pub(crate) fn in_place_bytes(
    value: &[u8],
    old: usize,
    allocated: usize,
    path: &Path,
) -> io::Result<Vec<u8>> {
    let room = old.max(allocated);
    if value.len() + 1 > room {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!(
                "{} bytes do not fit in the {room} bytes {} has",
                value.len() + 1,
                path.display()
            ),
        ));
    }
    let mut bytes = value.to_vec();
    bytes.resize(old.max(value.len() + 1) - 1, b' ');
    bytes.push(b'\n');
    Ok(bytes)
}

/// What a file rl-node reads from the shared directory is, for how many of its bytes
/// rl-node reads at most. Anyone who can write the shared directory can plant a file of any
/// size at a name rl-node reads (docs/shared-directory.md, "What rl-node trusts"), and a
/// node or `rl-node status` must not read a gigabyte into memory because of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadLimit {
    /// Live records, the cluster record, aborts, leases, pointers, the doorbell: written by
    /// rl-node itself and small at any cluster size (4 MiB; not configurable).
    Record,
    /// Append-only state that grows with the run: journals, the start history,
    /// `metrics.jsonl`, event logs (`[limits] journal-mib`, 256 MiB).
    Journal,
    /// Manifests of checkpoints and merged files, which grow with their files and ranks
    /// (`[limits] manifest-mib`, 64 MiB).
    Manifest,
}

static LIMIT_MIB: [std::sync::atomic::AtomicU64; 3] = [
    std::sync::atomic::AtomicU64::new(4),
    std::sync::atomic::AtomicU64::new(256),
    std::sync::atomic::AtomicU64::new(64),
];

impl ReadLimit {
    /// The most bytes read of a file of this class.
    pub fn bytes(self) -> u64 {
        self.mib() << 20
    }

    pub fn mib(self) -> u64 {
        LIMIT_MIB[self as usize].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The configuration key that raises it, if one does.
    pub fn key(self) -> Option<&'static str> {
        match self {
            ReadLimit::Record => None,
            ReadLimit::Journal => Some("limits.journal-mib"),
            ReadLimit::Manifest => Some("limits.manifest-mib"),
        }
    }

    fn what(self) -> &'static str {
        match self {
            ReadLimit::Record => "record",
            ReadLimit::Journal => "journal or log",
            ReadLimit::Manifest => "manifest",
        }
    }

    /// Set the configurable limits (`[limits]`), in MiB; for this process.
    pub fn configure(journal_mib: u64, manifest_mib: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        LIMIT_MIB[ReadLimit::Journal as usize].store(journal_mib, Relaxed);
        LIMIT_MIB[ReadLimit::Manifest as usize].store(manifest_mib, Relaxed);
    }
}

/// A file larger than its class allows ([`ReadLimit`]): not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is larger than {} MiB, the most rl-node reads of a {} ({})", .path.display(), .limit.mib(), .limit.what(), advice(.limit))]
pub struct TooLarge {
    pub path: PathBuf,
    pub limit: ReadLimit,
}

impl TooLarge {
    pub(crate) fn error(path: &Path, limit: ReadLimit) -> io::Error {
        io::Error::new(
            io::ErrorKind::FileTooLarge,
            TooLarge {
                path: path.to_path_buf(),
                limit,
            },
        )
    }

    /// The refusal inside `e`, if `e` is one.
    pub fn of(e: &io::Error) -> Option<&TooLarge> {
        e.get_ref().and_then(|e| e.downcast_ref::<TooLarge>())
    }
}

/// An open log a node appends to line by line ([`SharedDir::open_log`]).
pub type LogHandle = Box<dyn Write + Send>;

/// Who hears of a read refused because of what stood at the name (too large, a link): a
/// node's own warning, set at its start ([`on_refusal`]); else a `warning:` line on stderr.
static REPORTER: std::sync::OnceLock<Reporter> = std::sync::OnceLock::new();

type Reporter = Box<dyn Fn(&str) + Send + Sync>;

/// Names already reported (each once per process; bounded).
static REPORTED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Route this process's reports of refused reads to `report` (once; later calls do nothing).
pub fn on_refusal(report: impl Fn(&str) + Send + Sync + 'static) {
    let _ = REPORTER.set(Box::new(report));
}

/// Say, once per name, that a read of `path` was refused (`e`): a reader that treats the
/// file as "not yet" (a live record) would otherwise wait without a word.
pub(crate) fn report_refusal(path: &Path, e: &io::Error) {
    {
        let mut seen = REPORTED.lock().unwrap_or_else(|e| e.into_inner());
        if seen.iter().any(|p| p == path) || seen.len() >= 1024 {
            return;
        }
        seen.push(path.to_path_buf());
    }
    let msg = format!("not reading {}: {e}", path.display());
    match REPORTER.get() {
        Some(report) => report(&msg),
        None => crate::errln!("warning: {msg}"),
    }
}

fn advice(limit: &ReadLimit) -> String {
    match limit.key() {
        Some(key) => format!(
            "raise {key} if this run really has one that large; else something else wrote it"
        ),
        None => "rl-node never writes one that large: something else wrote it".into(),
    }
}

/// A state file that exists but cannot be used: which file and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is damaged: {what}", .path.display())]
pub struct Damaged {
    pub path: PathBuf,
    pub what: String,
}
