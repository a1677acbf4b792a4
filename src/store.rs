//! Access to the shared directory: atomic publish, tolerant reads, exclusive create.
//!
//! Shared filesystems give few guarantees (see DESIGN.md §2): a rename within one
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
    WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = tmp_name(path);
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
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

pub fn publish_json<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    publish(path, &bytes)
}

/// Create `path` with `bytes` only if it does not exist yet: first writer wins.
/// Returns false when another writer got there first.
pub fn create_new(path: &Path, bytes: &[u8]) -> io::Result<bool> {
    let tmp = tmp_name(path);
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
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
pub fn read_json<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    Ok(read(path)?.and_then(|b| serde_json::from_slice(&b).ok()))
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
    fn create_new_first_writer_wins() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("abort.json");
        assert!(create_new(&p, b"first").unwrap());
        assert!(!create_new(&p, b"second").unwrap());
        assert_eq!(fs::read(&p).unwrap(), b"first");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
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
}
