//! Proves the MooseFS test substrate (tests/common/moosefs.rs) shows what real FUSE
//! clients of a distributed filesystem do (shared/DESIGN.md section 2): with default
//! caches a rename over an existing name is seen at once through another client; with an
//! entry cache it is read stale for up to that cache's time while a rewrite in place is
//! seen at once; with a negative cache, `mkdir` of a name another client made answers
//! EEXIST while `stat` still answers ENOENT.

mod common;

use common::moosefs::{self, Caches};
use std::fs;
use std::io::{ErrorKind, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

/// Replace `path`'s content by rename, as an atomic publish does.
fn rename_over(path: &std::path::Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// How long until `cond` holds (panics after 30 s).
fn until(mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(30), "never");
        std::thread::sleep(Duration::from_millis(5));
    }
    start.elapsed()
}

#[test]
fn with_default_caches_a_rename_over_is_seen_at_once() {
    let Some(c) = moosefs::start_for("with_default_caches_a_rename_over_is_seen_at_once", 2, None)
    else {
        return;
    };
    let (a, b) = (c.mount(0).join("rec"), c.mount(1).join("rec"));
    rename_over(&a, b"one");
    assert_eq!(fs::read(&b).unwrap(), b"one");
    rename_over(&a, b"two, longer than one");
    assert_eq!(fs::read(&b).unwrap(), b"two, longer than one");
    // And a name made by one client is there for the other at once.
    let _ = fs::metadata(c.mount(1).join("d"));
    fs::create_dir(c.mount(0).join("d")).unwrap();
    assert!(fs::metadata(c.mount(1).join("d")).unwrap().is_dir());
}

#[test]
fn an_entry_cache_reads_a_rename_over_stale_but_a_rewrite_in_place_at_once() {
    let test = "an_entry_cache_reads_a_rename_over_stale_but_a_rewrite_in_place_at_once";
    let caches = Caches {
        attr: 0.0,
        entry: 2.0,
        direntry: 0.0,
        negentry: 0.0,
    };
    let Some(c) = moosefs::start_for(test, 2, Some(caches)) else {
        return;
    };
    let (a, b) = (c.mount(0).join("rec"), c.mount(1).join("rec"));
    rename_over(&a, b"one");
    assert_eq!(fs::read(&b).unwrap(), b"one");
    rename_over(&a, b"two");
    assert_eq!(
        fs::read(&b).unwrap(),
        b"one",
        "the entry cache still names the old file"
    );
    let stale = until(|| fs::read(&b).unwrap() == b"two");
    assert!(stale > Duration::from_millis(500), "{stale:?}");
    // The same file rewritten in place (same inode): no entry to be stale.
    let mut f = fs::OpenOptions::new().write(true).open(&a).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(b"six").unwrap();
    drop(f);
    assert_eq!(fs::read(&b).unwrap(), b"six");
}

#[test]
fn a_negative_cache_answers_eexist_to_mkdir_while_stat_answers_enoent() {
    let test = "a_negative_cache_answers_eexist_to_mkdir_while_stat_answers_enoent";
    let Some(c) = moosefs::start_for(test, 2, Some(Caches::all(2.0))) else {
        return;
    };
    let (a, b) = (c.mount(0).join("gen-1"), c.mount(1).join("gen-1"));
    assert_eq!(fs::metadata(&b).unwrap_err().kind(), ErrorKind::NotFound);
    fs::create_dir(&a).unwrap();
    assert_eq!(
        fs::create_dir(&b).unwrap_err().kind(),
        ErrorKind::AlreadyExists
    );
    assert_eq!(fs::metadata(&b).unwrap_err().kind(), ErrorKind::NotFound);
    // O_CREAT of a name cached as missing: EEXIST too.
    let f = c.mount(1).join("bell");
    assert!(fs::metadata(&f).is_err());
    fs::write(c.mount(0).join("bell"), b"").unwrap();
    let created = fs::OpenOptions::new().create(true).append(true).open(&f);
    assert_eq!(created.unwrap_err().kind(), ErrorKind::AlreadyExists);
    let waited = until(|| fs::metadata(&b).is_ok());
    assert!(waited > Duration::from_millis(500), "{waited:?}");
}
