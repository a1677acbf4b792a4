//! The primitives under both halves of the real store: the confined walk
//! ([`super::beneath`]) and the filesystem calls ([`super::fs`]) count their operations,
//! create exclusively and name temporary files the same way, so each comes from here and
//! neither half imports the other's internals.

use super::{OpClass, OpCounts};
use rustix::fs::OFlags;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);
static COUNTS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];

pub(crate) fn count(class: OpClass) {
    COUNTS[class as usize].fetch_add(1, Ordering::Relaxed);
}

/// Operations on the shared directory by this process so far, by class.
pub(crate) fn op_counts() -> OpCounts {
    let mut c = OpCounts::default();
    for class in OpClass::ALL {
        c.add(class, COUNTS[class as usize].load(Ordering::Relaxed));
    }
    c
}

/// `flags` for an exclusive create, which fails on anything already at the name (a
/// symbolic link included, which it never follows).
pub(crate) fn excl(flags: OFlags) -> OFlags {
    flags | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// A temporary name beside `name` (the same directory): hidden, with this process's pid.
/// The caller creates it exclusively and asks again if a leftover of an earlier process
/// with the same pid holds it.
pub(crate) fn tmp_name(name: &Path) -> PathBuf {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let base = name.file_name().and_then(|s| s.to_str()).unwrap_or("file");
    name.with_file_name(format!(".{base}.tmp-{}-{n}", std::process::id()))
}
