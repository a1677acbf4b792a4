//! The real shared directory: the operations of [`SharedDir`] as system calls, each
//! counted by class in this process's [`OpCounts`] (the figures the node reports at exit
//! and the benchmarks print).
//!
//! Every write reaches its name through [`beneath`]: below a run's root no symbolic link
//! is followed, new files are created with `O_EXCL`, and a file that is appended to or
//! rewritten in place must be a regular file of this node's own. Every read takes at most a
//! bounded number of bytes ([`ReadLimit`]) and never follows a link at the last component.
//!
//! The free functions are the same operations for the parts of rl-node that do not hold a
//! store (aggregation, checkpoints, repair): they are counted too.

use super::beneath::{self, At};
use super::ops::{count, excl, op_counts, tmp_name};
use super::{
    Damaged, DataRead, DataWrite, Kind, Meta, OpClass, OpCounts, ReadLimit, SharedDir, TooLarge,
};
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use serde::{de::DeserializeOwned, Serialize};
use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The real shared directory (the OS's filesystem calls, counted).
#[derive(Debug, Default, Clone, Copy)]
pub struct Fs;

impl SharedDir for Fs {
    fn read_limited(&self, path: &Path, limit: ReadLimit) -> io::Result<Option<Vec<u8>>> {
        read_limited(path, limit)
    }

    /// NFS and FUSE clients serve concurrent requests (NFS's slot table holds dozens);
    /// eight keeps a 1,024-node poll round near 128 round trips without many threads.
    fn read_parallelism(&self) -> usize {
        8
    }

    fn publish_with(
        &self,
        path: &Path,
        durable: bool,
        write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<()> {
        publish_inner(path, durable, write)
    }

    fn create_new(&self, path: &Path, bytes: &[u8]) -> io::Result<bool> {
        create_new(path, bytes)
    }

    fn create_new_live(&self, path: &Path, bytes: &[u8]) -> io::Result<bool> {
        create_new_with(path, bytes, false)
    }

    fn overwrite_in_place(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        overwrite_bytes_in_place(path, bytes)
    }

    fn append(&self, path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
        let mut f = open_append(path)?;
        f.write_all(bytes)?;
        if sync {
            count(OpClass::Fsync);
            f.into_file().sync_all()?;
        }
        Ok(())
    }

    fn open_append(&self, path: &Path) -> io::Result<Option<Box<dyn Write + Send>>> {
        Ok(Some(Box::new(open_append(path)?)))
    }

    fn read_or_create(&self, path: &Path) -> io::Result<Vec<u8>> {
        // On FUSE a create of a name another client made answers EEXIST while the name
        // stays invisible (and can leave it so): a listing shows it, and it is read as is.
        // (A directory not there yet is made below.)
        if refresh_parent(path) {
            if let Some(bytes) = read_limited(path, ReadLimit::Record)? {
                return Ok(bytes);
            }
        }
        // Polled by a waiting node: a name its cache hides is a "not yet" (read as the
        // empty file a create would have made), not a wait here.
        match open_creating(path, OFlags::RDWR, Duration::ZERO) {
            Ok(mut f) => read_to_end_counted(&mut f, path, ReadLimit::Record),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn revalidate(&self, path: &Path) -> io::Result<bool> {
        // The exclusive-create probe below is what an NFS (or sshfs) client's negative cache
        // needs; on MooseFS it can leave the name invisible instead, and a listing does the
        // work there: tried first.
        if refresh_parent(path) && (self as &dyn SharedDir).exists(path) {
            return Ok(true);
        }
        let at = match beneath::at(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            other => other?,
        };
        count(OpClass::Open);
        match rfs::openat(at.fd(), at.name, excl(OFlags::WRONLY), file_mode()) {
            Err(Errno::EXIST) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(e.into()),
            Ok(fd) => {
                // It was not there, and now an empty file of ours is: remove it, unless the
                // name was replaced in the meantime (then it is someone else's).
                let mine = rfs::fstat(&fd)?.st_ino;
                count(OpClass::Stat);
                if rfs::statat(at.fd(), at.name, AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|s| s.st_ino == mine)
                {
                    count(OpClass::Unlink);
                    let _ = rfs::unlinkat(at.fd(), at.name, AtFlags::empty());
                }
                Ok(false)
            }
        }
    }

    fn rename(&self, src: &Path, dst: &Path) -> io::Result<()> {
        rename(src, dst)
    }

    fn rename_noreplace(&self, src: &Path, dst: &Path) -> io::Result<()> {
        rename_noreplace(src, dst)
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        create_dir(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        create_dir_all(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>> {
        read_dir(path)
    }

    fn refresh(&self, dir: &Path) -> io::Result<()> {
        refresh(dir)
    }

    fn caches_lookups(&self, path: &Path) -> bool {
        beneath::lookups_cached(path)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        remove_file(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let at = beneath::at(path)?;
        count(OpClass::Unlink);
        Ok(rfs::unlinkat(at.fd(), at.name, AtFlags::REMOVEDIR)?)
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        use std::os::unix::ffi::OsStringExt;
        let at = beneath::at(path)?;
        count(OpClass::Stat);
        let target = rfs::readlinkat(at.fd(), at.name, Vec::new())?;
        Ok(PathBuf::from(OsString::from_vec(target.into_bytes())))
    }

    fn modified(&self, path: &Path) -> io::Result<Option<std::time::SystemTime>> {
        count(OpClass::Stat);
        fs::symlink_metadata(path)?.modified().map(Some)
    }

    fn lstat(&self, path: &Path) -> io::Result<Option<Meta>> {
        count(OpClass::Stat);
        meta(fs::symlink_metadata(path))
    }

    fn stat(&self, path: &Path) -> io::Result<Option<Meta>> {
        count(OpClass::Stat);
        meta(fs::metadata(path))
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        count(OpClass::Open);
        let fd = rfs::open(path, read_flags(), Mode::empty())
            .map_err(|e| beneath::nofollow_error(path, e))?;
        count(OpClass::Fsync);
        File::from(fd).sync_all()
    }

    fn fsync_dir(&self, path: &Path) -> io::Result<()> {
        fsync_dir(path)
    }

    fn open_data(&self, path: &Path) -> io::Result<Box<dyn DataRead>> {
        let f = File::open(path)?;
        let len = f.metadata()?.len();
        Ok(Box::new(DataFile { f, len }))
    }

    fn create_data(&self, path: &Path) -> io::Result<Box<dyn DataWrite + '_>> {
        Ok(Box::new(create_file(path)?))
    }

    fn open_os_file(&self, path: &Path) -> io::Result<Option<File>> {
        // As `open_data`: following a link, as `File::open` does.
        Ok(Some(File::open(path)?))
    }

    fn create_os_file(&self, path: &Path) -> io::Result<Option<File>> {
        Ok(Some(create_file(path)?))
    }

    fn counts(&self) -> OpCounts {
        op_counts()
    }
}

/// A data file open for reading: read straight into the caller's buffer.
struct DataFile {
    f: File,
    len: u64,
}

impl DataRead for DataFile {
    fn size(&self) -> u64 {
        self.len
    }

    fn read_more(&mut self, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
        read_more(&self.f, buf, max)
    }
}

/// Read at most `max` bytes of `f` (from its offset) onto the end of `buf`, straight into
/// its spare capacity (no zeroing, no second buffer: a merge reads gigabytes this way).
/// Returns how many; 0 at the end of the file.
pub(crate) fn read_more(f: &File, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    let room = spare.len().min(max);
    let n = loop {
        match rustix::io::read(f, &mut spare[..room]) {
            Ok((filled, _)) => break filled.len(),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // SAFETY: read initialized the first `n` bytes of the spare capacity (`filled`).
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Errors with which `copy_file_range` says "not here" (old kernels, across filesystems,
/// filesystems without it) rather than that the data cannot be read or written: the
/// caller copies through user space instead.
pub(crate) fn copy_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSYS | libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::EBADF)
    )
}

impl DataWrite for File {
    fn written(&mut self, offset: u64, len: u64) {
        start_writeback(self, offset, len);
    }

    fn sync_all(&mut self) -> io::Result<()> {
        File::sync_all(self)
    }
}

/// New files: `rw-rw-rw-` less the umask, as `File::create` makes them.
fn file_mode() -> Mode {
    Mode::from_raw_mode(0o666)
}

fn dir_mode() -> Mode {
    Mode::from_raw_mode(0o777)
}

/// `flags` for an open of a name that may be there already: never following a link at
/// the last component, never waiting on a named pipe planted there.
fn nofollow(flags: OFlags) -> OFlags {
    flags | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC
}

fn read_flags() -> OFlags {
    nofollow(OFlags::RDONLY)
}

/// `path` opened for appending, created (with its directory) if needed; its writes are
/// counted. Refused ([`beneath::Untrusted`]) when the name is a symbolic link or a file
/// that is not this node's own (a hard link, a pipe, another user's file).
pub fn open_append(path: &Path) -> io::Result<CountedFile> {
    open_creating(path, OFlags::WRONLY | OFlags::APPEND, INVISIBLE_WAIT).map(CountedFile)
}

/// [`open_append`] for a command's log ([`SharedDir::open_log`]): a planted link or foreign
/// file at its name is set aside first; the note says so.
pub fn open_log(path: &Path) -> io::Result<(CountedFile, Option<String>)> {
    (&Fs as &dyn SharedDir).setting_aside(|| open_append(path))
}

/// Open `path` with `flags` and `O_CREAT` (never following a link), making its directory
/// first only when the open says it is missing; then check that it is a file this node may
/// write ([`beneath::check_writable`]).
/// `bound`: how long a name another client made may stay invisible before this gives up
/// ([`past_negative_cache`]).
fn open_creating(path: &Path, flags: OFlags, bound: Duration) -> io::Result<File> {
    let flags = nofollow(flags | OFlags::CREATE);
    // `O_CREAT` of a name another client made may answer EEXIST while this client's
    // negative-lookup cache still says it is missing (FUSE): seen past that cache.
    let open = |at: &At<'_>| {
        let once = || {
            count(OpClass::Open);
            rfs::openat(at.fd(), at.name, flags, file_mode())
        };
        match once() {
            Err(Errno::EXIST) => past_negative_cache(path, bound, once),
            other => other.map_err(|e| beneath::nofollow_error(path, e)),
        }
    };
    let first = beneath::at(path).and_then(|at| open(&at).map(|fd| (at, fd)));
    let (at, fd) = match first {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(d) = path.parent() {
                create_dir_all_within(d, bound)?;
            }
            let at = beneath::at(path)?;
            let fd = open(&at)?;
            (at, fd)
        }
        other => other?,
    };
    beneath::check_writable(fd.as_fd(), &at)?;
    // Blocking again: the file may be handed to a command as its output.
    rfs::fcntl_setfl(&fd, rfs::fcntl_getfl(&fd)? - OFlags::NONBLOCK)?;
    Ok(File::from(fd))
}

/// How long a name the server says exists (`EEXIST`) may stay invisible to this client's
/// lookups before rl-node gives up on it: longer than a negative-lookup cache a mount
/// would sensibly have, and bounded, so a node never waits without saying why.
pub(crate) const INVISIBLE_WAIT: Duration = Duration::from_secs(10);

/// `look` again (it answered that the name `path` does not exist, while the server said it
/// does: a negative-lookup cache, docs/shared-directory.md) until it finds it: first after a
/// listing of the directory, which refreshes a FUSE client's cached lookups at once
/// ([`refresh`]), then every 50 ms for at most [`INVISIBLE_WAIT`]; then an error saying
/// which cache is lying.
fn past_negative_cache<T>(
    path: &Path,
    bound: Duration,
    mut look: impl FnMut() -> Result<T, Errno>,
) -> io::Result<T> {
    let start = Instant::now();
    refresh_parent(path);
    loop {
        match look() {
            Err(Errno::NOENT) | Err(Errno::EXIST) if start.elapsed() < bound => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(Errno::NOENT) | Err(Errno::EXIST) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{} exists on the server (it answers EEXIST) but stayed invisible to this client for {:.1}s: \
                         the mount's negative-lookup cache hides it (MooseFS mfsnegentrycacheto, \
                         FUSE negative_timeout, NFS lookupcache); mount with a shorter one",
                        path.display(),
                        start.elapsed().as_secs_f64()
                    ),
                ))
            }
            Err(e) => return Err(beneath::nofollow_error(path, e)),
            Ok(v) => return Ok(v),
        }
    }
}

/// Files other nodes committed, which the protocol says exist: on a mount whose client
/// caches lookups (FUSE), wait until this client sees every one of them, at most
/// [`INVISIBLE_WAIT`] (a name it looked up while it was missing stays missing to it, in its
/// kernel and in its FUSE daemon, for the mount's negative timeout; a listing makes it
/// visible only for an entry timeout, too short to merge from). Elsewhere nothing waits.
/// How long it waited (`None`: not at all); a path still missing then is the merge's to
/// report.
pub fn await_visible(paths: &[PathBuf]) -> Option<Duration> {
    let dir = paths.first().and_then(|p| p.parent());
    if !dir.is_some_and(beneath::lookups_cached) {
        return None;
    }
    let start = Instant::now();
    let missing = |paths: &[PathBuf]| -> Vec<PathBuf> {
        paths
            .iter()
            .filter(|p| !(&Fs as &dyn SharedDir).exists(p))
            .cloned()
            .collect()
    };
    let mut left = missing(paths);
    if left.is_empty() {
        return None;
    }
    while !left.is_empty() && start.elapsed() < INVISIBLE_WAIT {
        std::thread::sleep(Duration::from_millis(100));
        left = missing(&left);
    }
    Some(start.elapsed())
}

/// [`refresh`] of the directory holding `path`; whether that is on a mount whose kernel
/// caches lookups (FUSE), i.e. whether anything was listed.
fn refresh_parent(path: &Path) -> bool {
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) if beneath::lookups_cached(dir) => {
            let _ = list_up(dir);
            true
        }
        _ => false,
    }
}

/// Make this client see the names in directory `dir` as the server has them now, where its
/// kernel may answer lookups from a cache past other clients' changes: on a FUSE mount
/// (entry and negative-entry timeouts), a listing of the directory (readdirplus) refreshes
/// every name in it at once. Elsewhere nothing: NFS revalidates a name at open, and a local
/// filesystem has no other client. Counted as the listing.
/// A directory the cache still calls missing is seen by listing its parent first (up to
/// a run's root, or the first directory that lists).
pub fn refresh(dir: &Path) -> io::Result<()> {
    if !beneath::lookups_cached(dir) {
        return Ok(());
    }
    list_up(dir)
}

/// [`refresh`] of `dir` on a mount known to cache lookups: a listing, and where the cache
/// still calls `dir` missing, its parent's first.
fn list_up(dir: &Path) -> io::Result<()> {
    match read_dir(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // The parent is on the same mount, unless `dir` is a mount point or a root.
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
            match parent {
                Some(p) if beneath::lookups_cached(p) && list_up(p).is_ok() => {
                    read_dir(dir).map(drop)
                }
                _ => Err(e),
            }
        }
        other => other.map(drop),
    }
}

/// Whether rl-node could write `path` safely: `Ok` when nothing is there yet or when it is
/// a regular file of this node's own (as [`open_append`] requires), reached without a link;
/// else the refusal ([`beneath::Untrusted`]). Opens nothing for writing, creates nothing
/// (but a probe file where the owner must be learnt). For a node's check of its state files
/// before it writes anything.
pub fn check_own_file(path: &Path) -> io::Result<()> {
    let at = match beneath::at(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        other => other?,
    };
    count(OpClass::Open);
    match rfs::openat(at.fd(), at.name, read_flags(), Mode::empty()) {
        Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(beneath::nofollow_error(path, e)),
        Ok(fd) => beneath::check_writable(fd.as_fd(), &at).map(drop),
    }
}

/// Whether `path` is a directory reached without a link below its root (`Ok` when it is
/// missing, to be made); else why not.
pub fn check_dir(path: &Path) -> io::Result<()> {
    match beneath::dir_below(path, OFlags::PATH) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// A file whose writes are counted (each `write` call is one system call).
pub struct CountedFile(File);

impl CountedFile {
    /// The file itself (e.g. to hand to a child process as its output).
    pub fn into_file(self) -> File {
        self.0
    }
}

impl Write for CountedFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        count(OpClass::Write);
        self.0.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `path` and every missing directory above it. Below a run's root the existing part is
/// opened without following a link (one open when it all exists); elsewhere as
/// `std::fs::create_dir_all` does it: a stat, then a mkdir of each missing level.
pub fn create_dir_all(path: impl AsRef<Path>) -> io::Result<()> {
    create_dir_all_within(path.as_ref(), INVISIBLE_WAIT)
}

/// [`create_dir_all`], giving a directory another client made at most `bound` to become
/// visible to this one.
fn create_dir_all_within(path: &Path, bound: Duration) -> io::Result<()> {
    match beneath::dir_below(path, OFlags::PATH) {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => {
            count(OpClass::Stat);
            if fs::metadata(path).is_ok_and(|m| m.is_dir()) {
                return Ok(());
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    mkdir_p(path, bound)
}

/// Make `path`, making its missing parents first (each the same way). A name that is
/// already there counts as made only if it is a directory and not a link to one.
fn mkdir_p(path: &Path, bound: Duration) -> io::Result<()> {
    let mkdir = || -> io::Result<()> {
        let at = beneath::at(path)?;
        count(OpClass::Mkdir);
        match rfs::mkdirat(at.fd(), at.name, dir_mode()) {
            Ok(()) => Ok(()),
            // Another writer made it in the meantime, or something else is there (which
            // a negative-lookup cache may hide for a while).
            Err(Errno::EXIST) => {
                let there = past_negative_cache(path, bound, || {
                    count(OpClass::Stat);
                    rfs::statat(at.fd(), at.name, AtFlags::SYMLINK_NOFOLLOW)
                });
                match there {
                    Ok(st) if rfs::FileType::from_raw_mode(st.st_mode).is_dir() => Ok(()),
                    Ok(st)
                        if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Symlink =>
                    {
                        if matches!(at.dir, beneath::Dir::Cwd)
                            && fs::metadata(path).is_ok_and(|m| m.is_dir())
                        {
                            // Outside any run's root a link to a directory is the user's own.
                            Ok(())
                        } else {
                            Err(beneath::link_refused(path))
                        }
                    }
                    Ok(_) => Err(Errno::EXIST.into()),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e.into()),
        }
    };
    match mkdir() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match path.parent() {
                Some(parent) if parent != path && !parent.as_os_str().is_empty() => {
                    mkdir_p(parent, bound)?
                }
                _ => return Err(e),
            }
            mkdir()
        }
        other => other,
    }
}

/// `mkdir` of `path`, reached as every write reaches its name (no link followed below a
/// run's root).
pub fn create_dir(path: impl AsRef<Path>) -> io::Result<()> {
    let path = path.as_ref();
    let at = beneath::at(path)?;
    count(OpClass::Mkdir);
    Ok(rfs::mkdirat(at.fd(), at.name, dir_mode())?)
}

/// A new, empty file at `path` for writing, as `File::create` makes one but never through a
/// link: whatever is at the name (a leftover of an earlier attempt, or something planted)
/// is removed first (a link itself, never what it points to), then the file is created
/// exclusively. For the data plane's files inside directories rl-node made.
pub fn create_file(path: impl AsRef<Path>) -> io::Result<File> {
    let path = path.as_ref();
    let at = beneath::at(path)?;
    for _ in 0..8 {
        count(OpClass::Open);
        match rfs::openat(at.fd(), at.name, excl(OFlags::WRONLY), file_mode()) {
            Ok(fd) => return Ok(File::from(fd)),
            Err(Errno::EXIST) => {
                count(OpClass::Unlink);
                match rfs::unlinkat(at.fd(), at.name, AtFlags::empty()) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(beneath::nofollow_error(path, e)),
        }
    }
    Err(Errno::EXIST.into())
}

/// Copy the file `from` to a new file `to` ([`create_file`]), with its permissions, the
/// bytes moved by the kernel where it can (`copy_file_range`, through `std::io::copy`).
pub fn copy_file(from: impl AsRef<Path>, to: impl AsRef<Path>) -> io::Result<u64> {
    let (from, to) = (from.as_ref(), to.as_ref());
    let mut src = File::open(from)?;
    let mut dst = create_file(to)?;
    let n = io::copy(&mut src, &mut dst)?;
    dst.set_permissions(src.metadata()?.permissions())?;
    Ok(n)
}

/// The names in directory `path` (reached as every write reaches its directory).
pub fn read_dir(path: &Path) -> io::Result<Vec<OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let fd = match beneath::dir_below(path, OFlags::RDONLY)? {
        Some(fd) => fd,
        None => {
            count(OpClass::Open);
            rfs::open(
                path,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )?
        }
    };
    count(OpClass::Readdir);
    let mut names = Vec::new();
    for entry in rfs::Dir::read_from(&fd)? {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsStr::from_bytes(name).to_os_string());
        }
    }
    Ok(names)
}

/// Remove the name `path` (a link itself, never what it points to).
pub fn remove_file(path: &Path) -> io::Result<()> {
    let at = beneath::at(path)?;
    count(OpClass::Unlink);
    Ok(rfs::unlinkat(at.fd(), at.name, AtFlags::empty())?)
}

/// A plain rename (replaces `dst`), each side reached without following a link.
pub fn rename(src: impl AsRef<Path>, dst: impl AsRef<Path>) -> io::Result<()> {
    let (src, dst) = (src.as_ref(), dst.as_ref());
    let (from, to) = (beneath::at(src)?, beneath::at(dst)?);
    count(OpClass::Rename);
    Ok(rfs::renameat(from.fd(), from.name, to.fd(), to.name)?)
}

fn meta(m: io::Result<fs::Metadata>) -> io::Result<Option<Meta>> {
    match m {
        Ok(m) => {
            let t = m.file_type();
            let kind = if t.is_file() {
                Kind::File
            } else if t.is_dir() {
                Kind::Dir
            } else if t.is_symlink() {
                Kind::Symlink
            } else {
                Kind::Other
            };
            Ok(Some(Meta { len: m.len(), kind }))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Tries at a fresh temporary name before giving up (leftovers of a crashed process with
/// the same pid, which a container gives every start).
const TMP_TRIES: usize = 64;

/// A new temporary file beside `at`'s name, created exclusively: its name (relative to
/// `at`'s directory) and the open file.
fn create_tmp(at: &At<'_>) -> io::Result<(PathBuf, File)> {
    let mut last = None;
    for _ in 0..TMP_TRIES {
        let tmp = tmp_name(at.name);
        count(OpClass::Open);
        match rfs::openat(at.fd(), &tmp, excl(OFlags::WRONLY), file_mode()) {
            Ok(fd) => return Ok((tmp, File::from(fd))),
            Err(Errno::EXIST) => last = Some(Errno::EXIST),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last.unwrap_or(Errno::EXIST).into())
}

fn remove_tmp(at: &At<'_>, tmp: &Path) {
    count(OpClass::Unlink);
    let _ = rfs::unlinkat(at.fd(), tmp, AtFlags::empty());
}

/// Ask the kernel to start writing a range of `f` back now (Linux), so the fsync before
/// the rename does not have to write the whole file at once (the data plane: merges,
/// checkpoint copies; not counted). Best effort.
pub fn start_writeback(f: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    // SAFETY: sync_file_range takes an fd that is open for the call (borrowed from `f`) and
    // integers only.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::sync_file_range(
            f.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, offset, len);
}

pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    // Some FUSE filesystems refuse fsync on directories; durability is best effort there.
    count(OpClass::Open);
    let d = match File::open(dir) {
        Ok(d) => d,
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    sync_dir_fd(d.into())
}

/// fsync an open directory, best effort (see [`fsync_dir`]).
fn sync_dir_fd(d: OwnedFd) -> io::Result<()> {
    count(OpClass::Fsync);
    match File::from(d).sync_all() {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// fsync the directory that holds `at`'s name.
fn sync_parent(at: &At<'_>) -> io::Result<()> {
    match at.open_dir() {
        Ok(d) => sync_dir_fd(d),
        Err(e) if e.kind() != io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Write to a temporary file in the same directory, fsync, rename over `path`, fsync
/// the directory. Readers see the old content or the new, never a mix (where rename is atomic).
pub fn publish(path: &Path, bytes: &[u8]) -> io::Result<()> {
    publish_with(path, |w| w.write_all(bytes))
}

/// [`publish`] of what `write` writes (through a buffer), for content too large to hold
/// in memory first. On an error, from `write` or the filesystem, `path` is left as it was.
pub fn publish_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let mut write = Some(write);
    publish_inner(path, true, &mut |w| (write.take().expect("called once"))(w))
}

/// The rename over `path` replaces whatever name is there (a planted link is replaced,
/// never followed); the temporary file is new, made with `O_EXCL`.
fn publish_inner(
    path: &Path,
    durable: bool,
    write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let at = beneath::at(path)?;
    let (tmp, f) = create_tmp(&at)?;
    let result = (|| {
        let mut w = io::BufWriter::new(f);
        count(OpClass::Write);
        write(&mut w)?;
        let f = w.into_inner().map_err(io::IntoInnerError::into_error)?;
        if durable {
            count(OpClass::Fsync);
            f.sync_all()?;
        }
        drop(f);
        count(OpClass::Rename);
        rfs::renameat(at.fd(), &tmp, at.fd(), at.name)?;
        if durable {
            sync_parent(&at)?;
        }
        Ok(())
    })();
    if result.is_err() {
        remove_tmp(&at, &tmp);
    }
    result
}

/// Rename `src` to `dst` only if nothing exists at `dst`: never replaces (error
/// `AlreadyExists`, or `ENOTEMPTY` from some filesystems for a directory).
///
/// Atomic where the filesystem supports `renameat2(RENAME_NOREPLACE)` (local filesystems,
/// NFS). Where it does not (`EINVAL`/`ENOSYS`/`EOPNOTSUPP`, e.g. FUSE): a file is hard-linked
/// to `dst` (which fails if `dst` exists) and `src` removed; a directory is renamed after
/// checking that `dst` does not exist. That leaves a window of one system call in which
/// another writer can create `dst`; a plain rename then fails if `dst` is a non-empty
/// directory, so only an *empty* directory created in that window could be replaced.
pub fn rename_noreplace(src: &Path, dst: &Path) -> io::Result<()> {
    let (from, to) = (beneath::at(src)?, beneath::at(dst)?);
    count(OpClass::Rename);
    match rfs::renameat_with(
        from.fd(),
        from.name,
        to.fd(),
        to.name,
        RenameFlags::NOREPLACE,
    ) {
        Err(Errno::INVAL) | Err(Errno::NOSYS) | Err(Errno::OPNOTSUPP) => {}
        other => return Ok(other?),
    }
    let exists = || {
        io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} already exists", dst.display()),
        )
    };
    let there = |at: &At<'_>| {
        count(OpClass::Stat);
        rfs::statat(at.fd(), at.name, AtFlags::SYMLINK_NOFOLLOW)
    };
    if rfs::FileType::from_raw_mode(there(&from)?.st_mode).is_dir() {
        if there(&to).is_ok() {
            return Err(exists());
        }
        count(OpClass::Rename);
        return Ok(rfs::renameat(from.fd(), from.name, to.fd(), to.name)?);
    }
    count(OpClass::Rename);
    match rfs::linkat(from.fd(), from.name, to.fd(), to.name, AtFlags::empty()) {
        Ok(()) => {
            count(OpClass::Unlink);
            Ok(rfs::unlinkat(from.fd(), from.name, AtFlags::empty())?)
        }
        Err(Errno::EXIST) => Err(Errno::EXIST.into()),
        // No hard links (blob FUSE): check, then rename.
        Err(_) => {
            if there(&to).is_ok() {
                return Err(exists());
            }
            count(OpClass::Rename);
            Ok(rfs::renameat(from.fd(), from.name, to.fd(), to.name)?)
        }
    }
}

/// `value` as compact JSON and a newline, written to `w` (an I/O error comes back as
/// itself, so a full filesystem stays `StorageFull`). Compact: peers re-read live records
/// every poll round, and `jq` prints any of these files readably.
pub(crate) fn write_json<T: Serialize + ?Sized>(w: &mut dyn Write, value: &T) -> io::Result<()> {
    serde_json::to_writer(&mut *w, value).map_err(io::Error::from)?;
    w.write_all(b"\n")
}

pub(crate) fn json_bytes<T: Serialize + ?Sized>(value: &T) -> io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The existing file is opened without following a link and must be this node's own
/// ([`beneath::check_writable`]).
fn overwrite_bytes_in_place(path: &Path, value: &[u8]) -> io::Result<()> {
    let at = beneath::at(path)?;
    count(OpClass::Open);
    let fd = rfs::openat(at.fd(), at.name, nofollow(OFlags::WRONLY), Mode::empty())
        .map_err(|e| beneath::nofollow_error(path, e))?;
    let meta = beneath::check_writable(fd.as_fd(), &at)?;
    let mut f = File::from(fd);
    let allocated = (meta.st_blocks as u64 * 512) as usize;
    let bytes = super::in_place_bytes(value, meta.st_size as usize, allocated, path)?;
    count(OpClass::Write);
    f.write_all(&bytes)?;
    count(OpClass::Fsync);
    f.sync_all()
}

/// Create `path` with `bytes` only if it does not exist yet: first writer wins.
/// Returns false when another writer got there first.
pub fn create_new(path: &Path, bytes: &[u8]) -> io::Result<bool> {
    create_new_with(path, bytes, true)
}

/// [`create_new`], with the file and its directory fsynced only if `durable`. The content
/// is written to a new temporary file first and hard-linked to `path` (which fails if
/// anything, a link included, is there), so a reader never meets a half-written claim.
fn create_new_with(path: &Path, bytes: &[u8], durable: bool) -> io::Result<bool> {
    let at = beneath::at(path)?;
    let (tmp, mut f) = create_tmp(&at)?;
    let written = (|| {
        count(OpClass::Write);
        f.write_all(bytes)?;
        // An empty file has no data to sync: the directory's fsync after the link (below)
        // makes its name, and the inode the name holds, durable.
        if !durable || bytes.is_empty() {
            return Ok(());
        }
        count(OpClass::Fsync);
        f.sync_all()
    })();
    drop(f);
    if let Err(e) = written {
        // A full disk leaves an empty file behind; nobody else would remove it.
        remove_tmp(&at, &tmp);
        return Err(e);
    }
    count(OpClass::Rename);
    let linked = rfs::linkat(at.fd(), &tmp, at.fd(), at.name, AtFlags::empty());
    remove_tmp(&at, &tmp);
    match linked {
        Ok(()) => {
            if durable {
                sync_parent(&at)?;
            }
            Ok(true)
        }
        Err(Errno::EXIST) => Ok(false),
        // Filesystems without hard links (blob FUSE): O_EXCL create; readers validate content.
        Err(_) => {
            count(OpClass::Open);
            match rfs::openat(at.fd(), at.name, excl(OFlags::WRONLY), file_mode()) {
                Ok(fd) => {
                    let mut f = File::from(fd);
                    count(OpClass::Write);
                    f.write_all(bytes)?;
                    if durable {
                        // Empty: nothing to sync but the name, which the directory's is.
                        if !bytes.is_empty() {
                            count(OpClass::Fsync);
                            f.sync_all()?;
                        }
                        // As after the link: callers count on the name being durable too.
                        sync_parent(&at)?;
                    }
                    Ok(true)
                }
                Err(Errno::EXIST) => Ok(false),
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// Read a file of the record class ([`ReadLimit::Record`]); a missing file is `None`.
pub fn read(path: &Path) -> io::Result<Option<Vec<u8>>> {
    read_limited(path, ReadLimit::Record)
}

/// Read a file of at most `limit`'s bytes; a missing file is `None`, a larger one an error
/// ([`TooLarge`]) that names it. A symbolic link at `path` is refused, not followed.
/// Counted as the open and each read.
pub fn read_limited(path: &Path, limit: ReadLimit) -> io::Result<Option<Vec<u8>>> {
    count(OpClass::Open);
    let read = match rfs::open(path, read_flags(), Mode::empty()) {
        // A file of a large class is measured first, so one over its limit is not read at
        // all; a record (small, and read at every poll) is not: at most 4 MiB are read.
        Ok(fd) if limit != ReadLimit::Record => {
            count(OpClass::Stat);
            match rfs::fstat(&fd) {
                Ok(st) if st.st_size as u64 > limit.bytes() => Err(TooLarge::error(path, limit)),
                _ => read_to_end_counted(&mut File::from(fd), path, limit).map(Some),
            }
        }
        Ok(fd) => read_to_end_counted(&mut File::from(fd), path, limit).map(Some),
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => Err(beneath::nofollow_error(path, e)),
    };
    if let Err(e) = &read {
        if TooLarge::of(e).is_some() || beneath::Untrusted::of(e).is_some() {
            super::report_refusal(path, e);
        }
    }
    read
}

/// [`read_limited`] as `std::fs::read` answers: a missing file is a `NotFound` error.
pub fn read_file(path: &Path, limit: ReadLimit) -> io::Result<Vec<u8>> {
    read_limited(path, limit)?.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} does not exist", path.display()),
        )
    })
}

/// [`read_file`] as `std::fs::read_to_string` answers (invalid UTF-8 is `InvalidData`).
pub fn read_text(path: &Path, limit: ReadLimit) -> io::Result<String> {
    String::from_utf8(read_file(path, limit)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The last `max` bytes of `path` at most (all of it when it is smaller), never following a
/// link at the last component; a missing file is `None`. For logs that may be larger than
/// anything worth holding (a command's log, an event log read back): where it was cut, the
/// partial first line is dropped.
pub fn read_tail(path: &Path, max: u64) -> io::Result<Option<Vec<u8>>> {
    use std::io::{Read, Seek, SeekFrom};
    count(OpClass::Open);
    let mut f = match rfs::open(path, read_flags(), Mode::empty()) {
        Ok(fd) => File::from(fd),
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(beneath::nofollow_error(path, e)),
    };
    count(OpClass::Stat);
    let len = f.metadata()?.len();
    let start = len.saturating_sub(max);
    if start > 0 {
        f.seek(SeekFrom::Start(start))?;
    }
    let mut buf = Vec::new();
    count(OpClass::Read);
    (&mut f).take(max).read_to_end(&mut buf)?;
    if start > 0 {
        let cut = memchr::memchr(b'\n', &buf).map_or(buf.len(), |i| i + 1);
        buf.drain(..cut);
    }
    Ok(Some(buf))
}

/// The rest of a file, at most `limit`'s bytes, each `read` system call counted. No
/// `fstat` for a size hint and no read that only confirms the end (what `std::fs::read`
/// does): a live record is read in one call. A read that returns less than it asked for
/// is the end of a regular file (local filesystems, NFS, Lustre and FUSE return short
/// reads only there), and the file cannot grow under the reader that matters: records are
/// replaced by rename.
fn read_to_end_counted(f: &mut File, path: &Path, limit: ReadLimit) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let max = limit.bytes();
    let mut buf = vec![0u8; 16 * 1024];
    let mut len = 0;
    loop {
        // Here `len <= max` (a read past it returned): the buffer grows to at most one
        // byte past the limit, so a file over it is seen to be.
        if len == buf.len() {
            let grown = (buf.len() * 2).min(usize::try_from(max + 1).unwrap_or(usize::MAX));
            buf.resize(grown, 0);
        }
        count(OpClass::Read);
        let n = match f.read(&mut buf[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // A named pipe planted at the name, opened without waiting for a writer.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
            Err(e) => return Err(e),
        };
        let asked = buf.len() - len;
        len += n;
        if len as u64 > max {
            return Err(TooLarge::error(path, limit));
        }
        if n == 0 || n < asked {
            buf.truncate(len);
            return Ok(buf);
        }
    }
}

/// Read and parse a JSON record; missing or unparsable (torn, half-copied) is `None`.
/// For live records only, where a torn read means "not yet": the run's own state files
/// (cluster record, journals, history) are read with [`read_strict`] instead.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    (&Fs as &dyn SharedDir).read_json(path)
}

/// Read and parse one of the run's own state files. Missing is `Ok(None)`; present but
/// empty, torn, garbage or of the wrong shape is `Err(Damaged)` naming the file and what is
/// wrong — never "no file" (docs/shared-directory.md, "The run's own state is
/// validated"). I/O errors other than not-found are reported as damage too, with the OS
/// error.
pub fn read_strict<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, Damaged> {
    (&Fs as &dyn SharedDir).read_strict(path)
}

pub(crate) fn parse_strict_read<T: DeserializeOwned>(
    path: &Path,
    read: io::Result<Option<Vec<u8>>>,
) -> Result<Option<T>, Damaged> {
    let bytes = match read {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(None),
        Err(e) => {
            return Err(Damaged {
                path: path.to_path_buf(),
                what: format!("it cannot be read: {e}"),
            })
        }
    };
    crate::json::parse_strict(&bytes)
        .map(Some)
        .map_err(|what| Damaged {
            path: path.to_path_buf(),
            what,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `f` did, by class (each nextest test is a process of its own, so nothing else
    /// counts at the same time).
    fn counted(f: impl FnOnce()) -> OpCounts {
        let before = op_counts();
        f();
        op_counts() - before
    }

    #[test]
    fn every_call_is_counted_by_class() {
        let d = tempfile::tempdir().unwrap();
        let store: &dyn SharedDir = &Fs;
        let p = d.path().join("r.json");
        let durable = counted(|| store.publish(&p, b"one").unwrap());
        assert_eq!(
            durable.summary(),
            "open 2, write 1, rename 1, fsync 2",
            "temporary file, its write and fsync, the rename, the directory's open and fsync"
        );
        let live = counted(|| {
            store
                .publish_with(&p, false, &mut |w| w.write_all(b"two"))
                .unwrap()
        });
        assert_eq!(live.summary(), "open 1, write 1, rename 1");
        let read = counted(|| assert_eq!(store.read(&p).unwrap().unwrap(), b"two"));
        assert_eq!(
            read.summary(),
            "open 1, read 1",
            "no fstat, no read to confirm the end"
        );
        // A file larger than the first read's buffer is read whole.
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let d2 = tempfile::tempdir().unwrap();
        fs::write(d2.path().join("big"), &big).unwrap();
        let read_big =
            counted(|| assert_eq!(store.read(&d2.path().join("big")).unwrap().unwrap(), big));
        assert_eq!(read_big.get(OpClass::Open), 1);
        assert!(read_big.get(OpClass::Read) >= 2);
        let events = d2.path().join("events/rank-0.jsonl");
        let mut handle = None;
        let opened = counted(|| handle = store.open_append(&events).unwrap());
        assert_eq!(
            opened.summary(),
            "open 2, stat 2, mkdir 1",
            "made its directory once; one fstat checks the file is its own"
        );
        let mut handle = handle.expect("the real store has handles");
        let lines = counted(|| {
            handle.write_all(b"x\n").unwrap();
            handle.write_all(b"y\n").unwrap();
        });
        assert_eq!(lines.summary(), "write 2", "one write per line, no open");
        assert_eq!(fs::read(&events).unwrap(), b"x\ny\n");
        let missing = counted(|| assert!(store.read(&d.path().join("no")).unwrap().is_none()));
        assert_eq!(missing.summary(), "open 1");
        let log = d.path().join("events/rank-0.jsonl");
        let first = counted(|| store.append(&log, b"a\n", false).unwrap());
        assert_eq!(first.summary(), "open 2, stat 2, write 1, mkdir 1");
        let next = counted(|| store.append(&log, b"b\n", true).unwrap());
        assert_eq!(next.summary(), "open 1, stat 1, write 1, fsync 1");
        assert_eq!(fs::read(&log).unwrap(), b"a\nb\n");
        let listed = counted(|| assert_eq!(store.read_dir(d.path()).unwrap().len(), 2));
        assert_eq!(listed.summary(), "open 1, readdir 1");
        assert_eq!(
            store.lstat(&p).unwrap(),
            Some(Meta {
                len: 3,
                kind: Kind::File
            })
        );
        assert_eq!(store.lstat(&d.path().join("no")).unwrap(), None);
    }

    #[test]
    fn read_or_create_makes_an_empty_file_once_and_revalidate_leaves_nothing_behind() {
        let d = tempfile::tempdir().unwrap();
        let store: &dyn SharedDir = &Fs;
        let bell = d.path().join("state/bell");
        assert_eq!(store.read_or_create(&bell).unwrap(), b"");
        store.append(&bell, b"gen 1\n", false).unwrap();
        assert_eq!(
            store.read_or_create(&bell).unwrap(),
            b"gen 1\n",
            "not truncated"
        );
        let cluster = d.path().join("state/cluster.json");
        assert!(!store.revalidate(&cluster).unwrap());
        assert!(!cluster.exists(), "the probe's empty file was removed");
        fs::write(&cluster, b"{}").unwrap();
        assert!(store.revalidate(&cluster).unwrap());
        assert_eq!(
            fs::read(&cluster).unwrap(),
            b"{}",
            "an existing file is left as it is"
        );
        assert!(!store.revalidate(&d.path().join("no-dir/x")).unwrap());
    }

    #[test]
    fn publish_replaces_and_leaves_no_temp_files() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.json");
        publish(&p, b"one").unwrap();
        publish(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn streamed_publishes_write_what_they_wrote_and_nothing_on_an_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("plan.json");
        let value = serde_json::json!({"ranks": [[{"task": "t1", "seed": 7}], []], "pool": []});
        (&Fs as &dyn SharedDir).publish_json(&p, &value).unwrap();
        let mut expected = serde_json::to_vec(&value).unwrap();
        expected.push(b'\n');
        assert_eq!(fs::read(&p).unwrap(), expected);
        // A writer that fails halfway: the old content stays, no temporary file is left.
        let err = publish_with(&p, |w| {
            w.write_all(b"half")?;
            Err(io::Error::other("gave up"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "gave up");
        assert_eq!(fs::read(&p).unwrap(), expected);
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn create_new_first_writer_wins() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("abort.json");
        assert!(create_new(&p, b"first").unwrap());
        assert!(!create_new(&p, b"second").unwrap());
        assert_eq!(fs::read(&p).unwrap(), b"first");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn strict_reads_say_what_is_wrong() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct R {
            gen: u64,
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("cluster.json");
        assert!(read_strict::<R>(&p).unwrap().is_none());
        for (bytes, says) in [
            (&b""[..], "empty"),
            (b"{\"gen\": 1", "truncated"),
            (b"\x00\x01garbage", "not valid JSON"),
            (b"{\"gen\": \"x\"}", "wrong shape"),
            (b"[1, 2]", "wrong shape"),
        ] {
            fs::write(&p, bytes).unwrap();
            let e = read_strict::<R>(&p).unwrap_err();
            assert!(e.what.contains(says), "{bytes:?}: {e}");
            assert!(e.to_string().contains("cluster.json is damaged"), "{e}");
        }
        fs::write(&p, b"{\"gen\": 3}").unwrap();
        assert_eq!(read_strict::<R>(&p).unwrap().unwrap().gen, 3);
    }

    #[test]
    fn torn_json_reads_as_not_yet() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.json");
        fs::write(&p, b"{\"a\": 1").unwrap();
        assert!(read_json::<serde_json::Value>(&p).unwrap().is_none());
        assert!(read_json::<serde_json::Value>(&d.path().join("missing"))
            .unwrap()
            .is_none());
    }

    #[test]
    fn rename_noreplace_never_replaces() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        fs::write(&a, b"new").unwrap();
        rename_noreplace(&a, &b).unwrap();
        assert!(!a.exists());
        assert_eq!(fs::read(&b).unwrap(), b"new");
        fs::write(&a, b"newer").unwrap();
        let e = rename_noreplace(&a, &b).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(fs::read(&b).unwrap(), b"new");
        assert_eq!(fs::read(&a).unwrap(), b"newer");
        // Directories, including onto an empty one (which a plain rename would replace).
        let (x, y) = (d.path().join("x"), d.path().join("y"));
        fs::create_dir_all(x.join("sub")).unwrap();
        fs::write(x.join("sub/f"), b"1").unwrap();
        fs::create_dir(&y).unwrap();
        let e = rename_noreplace(&x, &y).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert!(x.join("sub/f").exists());
        fs::remove_dir(&y).unwrap();
        rename_noreplace(&x, &y).unwrap();
        assert_eq!(fs::read(y.join("sub/f")).unwrap(), b"1");
        assert!(!x.exists());
    }
}
