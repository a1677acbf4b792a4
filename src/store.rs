//! Access to the shared directory: atomic publish, tolerant reads, exclusive create.
//!
//! Shared filesystems give few guarantees (docs/shared-directory.md): a rename within one
//! directory is atomic on NFS and Lustre but a copy on blob FUSE, so readers treat a
//! missing *or unparsable* file as "not yet" instead of trusting that a name implies
//! complete content.

use serde::{de::DeserializeOwned, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);
static READS: AtomicU64 = AtomicU64::new(0);
static WRITES: AtomicU64 = AtomicU64::new(0);

/// Shared-directory operations of this process so far: (reads, atomic writes). Reported
/// at exit so the overhead benchmark can print operations per barrier.
pub fn op_counts() -> (u64, u64) {
    (
        READS.load(Ordering::Relaxed),
        WRITES.load(Ordering::Relaxed),
    )
}

fn tmp_name(path: &Path) -> std::path::PathBuf {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("file");
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    // Some FUSE filesystems refuse fsync on directories; durability is best effort there.
    match File::open(dir).and_then(|d| d.sync_all()) {
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
    WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = tmp_name(path);
    let result = (|| {
        let mut w = io::BufWriter::new(File::create(&tmp)?);
        write(&mut w)?;
        let f = w.into_inner().map_err(io::IntoInnerError::into_error)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            fsync_dir(dir)?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
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
    if fs::symlink_metadata(src)?.is_dir() {
        if fs::symlink_metadata(dst).is_ok() {
            return Err(exists());
        }
        return fs::rename(src, dst);
    }
    match fs::hard_link(src, dst) {
        Ok(()) => fs::remove_file(src),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(e),
        // No hard links (blob FUSE): check, then rename.
        Err(_) => {
            if fs::symlink_metadata(dst).is_ok() {
                return Err(exists());
            }
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

pub fn publish_json<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    // Streamed: a plan of a million items is over 100 MB of JSON.
    publish_with(path, |w| {
        // An I/O error comes back as itself (e.g. a full filesystem stays `StorageFull`).
        serde_json::to_writer_pretty(&mut *w, value).map_err(io::Error::from)?;
        w.write_all(b"\n")
    })
}

/// The last resort of a node that can no longer create files (a full disk, a quota):
/// overwrite the existing file `path` in place with `value` as compact JSON, within the
/// space the file already has (its length, or the blocks allocated to it), so no new space
/// is needed on a filesystem that overwrites in place (ext4, xfs, tmpfs, NFS, Lustre; not
/// copy-on-write ones). A shorter value is padded with spaces. Not atomic: a reader may see
/// a mix for a moment, which the tolerant readers treat as "not yet". Fails with
/// `FileTooLarge` when the value does not fit.
pub fn overwrite_in_place<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    WRITES.fetch_add(1, Ordering::Relaxed);
    let mut bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    let mut f = OpenOptions::new().write(true).open(path)?;
    let meta = f.metadata()?;
    let old = meta.len() as usize;
    let allocated = (meta.blocks() * 512) as usize;
    if bytes.len() + 1 > old.max(allocated) {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!(
                "{} bytes do not fit in the {} bytes {} has",
                bytes.len() + 1,
                old.max(allocated),
                path.display()
            ),
        ));
    }
    bytes.resize(old.max(bytes.len() + 1) - 1, b' ');
    bytes.push(b'\n');
    f.write_all(&bytes)?;
    f.sync_all()
}

/// Create `path` with `bytes` only if it does not exist yet: first writer wins.
/// Returns false when another writer got there first.
pub fn create_new(path: &Path, bytes: &[u8]) -> io::Result<bool> {
    let tmp = tmp_name(path);
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        // A full disk leaves an empty file behind; nobody else would remove it.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            if let Some(dir) = path.parent() {
                fsync_dir(dir)?;
            }
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        // Filesystems without hard links (blob FUSE): O_EXCL create; readers validate content.
        Err(_) => match OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(mut f) => {
                f.write_all(bytes)?;
                f.sync_all()?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        },
    }
}

pub fn create_new_json<T: Serialize>(path: &Path, value: &T) -> io::Result<bool> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    create_new(path, &bytes)
}

/// Read a file; a missing file is `None`.
pub fn read(path: &Path) -> io::Result<Option<Vec<u8>>> {
    READS.fetch_add(1, Ordering::Relaxed);
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Read and parse a JSON record; missing or unparsable (torn, half-copied) is `None`.
/// For live records only, where a torn read means "not yet": the run's own state files
/// (cluster record, journals, history) are read with [`read_strict`] instead.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    Ok(read(path)?.and_then(|b| serde_json::from_slice(&b).ok()))
}

/// A state file that exists but cannot be used: which file and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is damaged: {what}", .path.display())]
pub struct Damaged {
    pub path: std::path::PathBuf,
    pub what: String,
}

/// Read and parse one of the run's own state files. Missing is `Ok(None)`; present but
/// empty, torn, garbage or of the wrong shape is `Err(Damaged)` naming the file and what is
/// wrong — never "no file" (docs/shared-directory.md, "The run's own state is
/// validated"). I/O errors other than not-found are reported as damage too, with the OS
/// error.
pub fn read_strict<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, Damaged> {
    let bytes = match read(path) {
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
        let mut expected = serde_json::to_vec_pretty(&value).unwrap();
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
