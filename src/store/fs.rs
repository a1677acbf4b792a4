//! The real shared directory: the operations of [`SharedDir`] as system calls, each
//! counted by class in this process's [`OpCounts`] (the figures the node reports at exit
//! and the benchmarks print).
//!
//! The free functions are the same operations for the parts of rl-node that do not hold a
//! store (aggregation, checkpoints, repair): they are counted too.

use super::{Damaged, Kind, Meta, OpClass, OpCounts, SharedDir};
use serde::{de::DeserializeOwned, Serialize};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);
static COUNTS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];

fn count(class: OpClass) {
    COUNTS[class as usize].fetch_add(1, Ordering::Relaxed);
}

/// Operations on the shared directory by this process so far, by class.
pub fn op_counts() -> OpCounts {
    let mut c = OpCounts::default();
    for class in OpClass::ALL {
        c.add(class, COUNTS[class as usize].load(Ordering::Relaxed));
    }
    c
}

/// The real shared directory (the OS's filesystem calls, counted).
#[derive(Debug, Default, Clone, Copy)]
pub struct Fs;

impl SharedDir for Fs {
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        read(path)
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
        let mut f = open_creating(
            path,
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false),
        )?;
        read_to_end_counted(&mut f)
    }

    fn revalidate(&self, path: &Path) -> io::Result<bool> {
        use std::os::unix::fs::MetadataExt;
        count(OpClass::Open);
        match OpenOptions::new().write(true).create_new(true).open(path) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
            Ok(f) => {
                // It was not there, and now an empty file of ours is: remove it, unless the
                // name was replaced in the meantime (then it is someone else's).
                let mine = f.metadata()?.ino();
                count(OpClass::Stat);
                if fs::symlink_metadata(path).is_ok_and(|m| m.ino() == mine) {
                    count(OpClass::Unlink);
                    let _ = fs::remove_file(path);
                }
                Ok(false)
            }
        }
    }

    fn rename(&self, src: &Path, dst: &Path) -> io::Result<()> {
        count(OpClass::Rename);
        fs::rename(src, dst)
    }

    fn rename_noreplace(&self, src: &Path, dst: &Path) -> io::Result<()> {
        rename_noreplace(src, dst)
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        count(OpClass::Mkdir);
        fs::create_dir(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        // As `std::fs::create_dir_all` does it, each system call counted: a stat, then a
        // mkdir of the path; a missing parent is made first (the same way) and the mkdir
        // tried again. So k missing levels cost 2k - 1 mkdirs.
        count(OpClass::Stat);
        if fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            return Ok(());
        }
        mkdir_p(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>> {
        count(OpClass::Open);
        count(OpClass::Readdir);
        fs::read_dir(path)?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        count(OpClass::Unlink);
        fs::remove_file(path)
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
        let f = File::open(path)?;
        count(OpClass::Fsync);
        f.sync_all()
    }

    fn fsync_dir(&self, path: &Path) -> io::Result<()> {
        fsync_dir(path)
    }

    fn counts(&self) -> OpCounts {
        op_counts()
    }
}

/// `path` opened for appending, created (with its directory) if needed; its writes are
/// counted. The directory is made only when the open says it is missing: no `stat` first.
pub fn open_append(path: &Path) -> io::Result<CountedFile> {
    open_creating(path, OpenOptions::new().create(true).append(true)).map(CountedFile)
}

/// Open `path` with `options` (which create), making its directory first only when the
/// open says it is missing; each open counted.
fn open_creating(path: &Path, options: &OpenOptions) -> io::Result<File> {
    count(OpClass::Open);
    match options.open(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(d) = path.parent() {
                Fs.create_dir_all(d)?;
            }
            count(OpClass::Open);
            options.open(path)
        }
        other => other,
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

fn mkdir_p(path: &Path) -> io::Result<()> {
    count(OpClass::Mkdir);
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match path.parent() {
                Some(parent) if parent != path && !parent.as_os_str().is_empty() => {
                    mkdir_p(parent)?
                }
                _ => return Err(e),
            }
            count(OpClass::Mkdir);
            match fs::create_dir(path) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    count(OpClass::Stat);
                    if path.is_dir() {
                        Ok(())
                    } else {
                        Err(e)
                    }
                }
                other => other,
            }
        }
        Err(e) => {
            // Another writer made it in the meantime, or something else is there.
            count(OpClass::Stat);
            if path.is_dir() {
                Ok(())
            } else {
                Err(e)
            }
        }
    }
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

fn tmp_name(path: &Path) -> std::path::PathBuf {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("file");
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

fn remove_tmp(tmp: &Path) {
    count(OpClass::Unlink);
    let _ = fs::remove_file(tmp);
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
    count(OpClass::Fsync);
    match d.sync_all() {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Ok(()),
        other => other,
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

fn publish_inner(
    path: &Path,
    durable: bool,
    write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let tmp = tmp_name(path);
    let result = (|| {
        count(OpClass::Open);
        let mut w = io::BufWriter::new(File::create(&tmp)?);
        count(OpClass::Write);
        write(&mut w)?;
        let f = w.into_inner().map_err(io::IntoInnerError::into_error)?;
        if durable {
            count(OpClass::Fsync);
            f.sync_all()?;
        }
        drop(f);
        count(OpClass::Rename);
        fs::rename(&tmp, path)?;
        if durable {
            if let Some(dir) = path.parent() {
                fsync_dir(dir)?;
            }
        }
        Ok(())
    })();
    if result.is_err() {
        remove_tmp(&tmp);
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
    count(OpClass::Rename);
    match renameat2_noreplace(src, dst) {
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
            ) => {}
        other => return other,
    }
    let exists = || {
        io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} already exists", dst.display()),
        )
    };
    count(OpClass::Stat);
    if fs::symlink_metadata(src)?.is_dir() {
        count(OpClass::Stat);
        if fs::symlink_metadata(dst).is_ok() {
            return Err(exists());
        }
        count(OpClass::Rename);
        return fs::rename(src, dst);
    }
    count(OpClass::Rename);
    match fs::hard_link(src, dst) {
        Ok(()) => {
            count(OpClass::Unlink);
            fs::remove_file(src)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(e),
        // No hard links (blob FUSE): check, then rename.
        Err(_) => {
            count(OpClass::Stat);
            if fs::symlink_metadata(dst).is_ok() {
                return Err(exists());
            }
            count(OpClass::Rename);
            fs::rename(src, dst)
        }
    }
}

#[cfg(target_os = "linux")]
fn renameat2_noreplace(src: &Path, dst: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let s = CString::new(src.as_os_str().as_bytes())?;
    let d = CString::new(dst.as_os_str().as_bytes())?;
    // SAFETY: both are valid NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            s.as_ptr(),
            libc::AT_FDCWD,
            d.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn renameat2_noreplace(_: &Path, _: &Path) -> io::Result<()> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
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

pub fn publish_json<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    (&Fs as &dyn SharedDir).publish_json(path, value)
}

/// The last resort of a node that can no longer create files (a full disk, a quota):
/// overwrite the existing file `path` in place with `value` as compact JSON, within the
/// space the file already has (its length, or the blocks allocated to it), so no new space
/// is needed on a filesystem that overwrites in place (ext4, xfs, tmpfs, NFS, Lustre; not
/// copy-on-write ones). A shorter value is padded with spaces. Not atomic: a reader may see
/// a mix for a moment, which the tolerant readers treat as "not yet". Fails with
/// `FileTooLarge` when the value does not fit.
pub fn overwrite_in_place<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    (&Fs as &dyn SharedDir).overwrite_json_in_place(path, value)
}

fn overwrite_bytes_in_place(path: &Path, value: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    count(OpClass::Open);
    let mut f = OpenOptions::new().write(true).open(path)?;
    count(OpClass::Stat);
    let meta = f.metadata()?;
    let allocated = (meta.blocks() * 512) as usize;
    let bytes = super::in_place_bytes(value, meta.len() as usize, allocated, path)?;
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

/// [`create_new`], with the file and its directory fsynced only if `durable`.
fn create_new_with(path: &Path, bytes: &[u8], durable: bool) -> io::Result<bool> {
    let tmp = tmp_name(path);
    let written = (|| {
        count(OpClass::Open);
        let mut f = File::create(&tmp)?;
        count(OpClass::Write);
        f.write_all(bytes)?;
        if !durable {
            return Ok(());
        }
        count(OpClass::Fsync);
        f.sync_all()
    })();
    if let Err(e) = written {
        // A full disk leaves an empty file behind; nobody else would remove it.
        remove_tmp(&tmp);
        return Err(e);
    }
    count(OpClass::Rename);
    let linked = fs::hard_link(&tmp, path);
    remove_tmp(&tmp);
    match linked {
        Ok(()) => {
            if let (Some(dir), true) = (path.parent(), durable) {
                fsync_dir(dir)?;
            }
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        // Filesystems without hard links (blob FUSE): O_EXCL create; readers validate content.
        Err(_) => {
            count(OpClass::Open);
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    count(OpClass::Write);
                    f.write_all(bytes)?;
                    if durable {
                        count(OpClass::Fsync);
                        f.sync_all()?;
                    }
                    Ok(true)
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

pub fn create_new_json<T: Serialize>(path: &Path, value: &T) -> io::Result<bool> {
    (&Fs as &dyn SharedDir).create_new_json(path, value)
}

/// Read a file; a missing file is `None`. Counted as the open, the `stat` std does for
/// the size and one read.
pub fn read(path: &Path) -> io::Result<Option<Vec<u8>>> {
    count(OpClass::Open);
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    read_to_end_counted(&mut f).map(Some)
}

/// The rest of a regular file, each `read` system call counted. No `fstat` for a size hint
/// and no read that only confirms the end (what `std::fs::read` does): a live record is
/// read in one call. A read that returns less than it asked for is the end of a regular
/// file (local filesystems, NFS, Lustre and FUSE return short reads only there), and the
/// file cannot grow under the reader that matters: records are replaced by rename.
fn read_to_end_counted(f: &mut File) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut buf = vec![0u8; 16 * 1024];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        count(OpClass::Read);
        let n = match f.read(&mut buf[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let asked = buf.len() - len;
        len += n;
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
            "open 2, stat 1, mkdir 1",
            "made its directory once"
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
        assert_eq!(first.summary(), "open 2, stat 1, write 1, mkdir 1");
        let next = counted(|| store.append(&log, b"b\n", true).unwrap());
        assert_eq!(next.summary(), "open 1, write 1, fsync 1");
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
        publish_json(&p, &value).unwrap();
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
