//! Proves the sshfs test substrate (tests/common/sshfs.rs) behaves like NFS
//! clients on different nodes: atomic rename-over is seen at once through
//! another client, while a negative lookup is cached per client until its
//! timeout expires.

mod common;

use common::sshfs::{self, SshfsCluster};
use std::fs;
use std::io::ErrorKind;
use std::time::{Duration, Instant};

/// Cache timeout handed to sshfs (cache_timeout / negative_timeout).
const CACHE_SECS: u32 = 5;

/// Starts a 2-client cluster, or returns None (skip) when the substrate is
/// unavailable outside CI; inside CI (`CI` set) an unavailable substrate panics.
fn cluster(test: &str) -> Option<SshfsCluster> {
    if !sshfs::require(test) {
        return None;
    }
    Some(SshfsCluster::start(2, CACHE_SECS).unwrap_or_else(|e| panic!("{test}: start: {e}")))
}

#[test]
fn rename_over_existing_is_visible_through_other_mount_at_once() {
    let Some(c) = cluster("rename_over_existing_is_visible_through_other_mount_at_once") else {
        return;
    };
    let (m0, m1) = (c.mount(0), c.mount(1));

    fs::write(m0.join("f"), b"old").unwrap();
    // Prime mount 1's caches (entry, attributes, sshfs stat cache, page cache).
    assert_eq!(fs::read(m1.join("f")).unwrap(), b"old");
    assert_eq!(fs::metadata(m1.join("f")).unwrap().len(), 3);

    // Atomic replace through mount 0: temp file + rename over the existing name.
    // The new content is deliberately longer than the old one, so a stale
    // cached size on mount 1 would show up as a truncated read.
    let new = b"new content, longer than the old one";
    fs::write(m0.join("f.tmp"), new).unwrap();
    fs::rename(m0.join("f.tmp"), m0.join("f")).unwrap();
    assert_eq!(fs::read(c.export().join("f")).unwrap(), new, "export");

    // Read through mount 1 at once: open() goes to the server, so it sees the
    // new file (close-to-open consistency, as on NFS).
    let got = fs::read(m1.join("f")).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(new),
        "mount 1 must see the renamed-over file immediately"
    );
}

#[test]
fn negative_lookup_is_cached_per_mount_until_timeout() {
    let Some(c) = cluster("negative_lookup_is_cached_per_mount_until_timeout") else {
        return;
    };
    let (m0, m1) = (c.mount(0), c.mount(1));
    let name = "appears-later";

    // Mount 1 looks the name up while it does not exist: a negative entry.
    let err = fs::metadata(m1.join(name)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);

    // Another client creates it.
    fs::write(m0.join(name), b"hello").unwrap();
    let created = Instant::now();
    assert!(fs::metadata(m0.join(name)).is_ok(), "creator sees it");
    assert!(c.export().join(name).exists(), "server has it");

    // Mount 1 still trusts its cached negative lookup.
    let err = fs::metadata(m1.join(name))
        .expect_err("mount 1 should still have the negative lookup cached (negative_timeout)");
    assert_eq!(err.kind(), ErrorKind::NotFound);

    // ...until the negative cache expires.
    let deadline = created + Duration::from_secs(30);
    loop {
        match fs::read(m1.join(name)) {
            Ok(data) => {
                assert_eq!(data, b"hello");
                eprintln!(
                    "negative lookup expired on mount 1 after {:?} (negative_timeout={CACHE_SECS}s)",
                    created.elapsed()
                );
                break;
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => panic!("unexpected error reading via mount 1: {e}"),
        }
        assert!(
            Instant::now() < deadline,
            "mount 1 never saw the file created via mount 0 within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
