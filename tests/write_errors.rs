//! A node that cannot write says so as the cause: a full shared disk is reported as "No
//! space left on device" by the node that hit it and by its peers (the stopping node writes
//! its abort over the record it already has, which needs no new space), never as only
//! "rank 1 is dead"; a read-only shared directory is reported as read-only, not as a
//! permission problem. Real filesystems: a small tmpfs per test (root, as in CI).

mod common;

use common::cluster::*;
use common::smallfs::SmallFs;
use std::io::Write;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

const LONG_ROLLOUT: &str = "[phases.rollout]\ncommand = \"sleep 60.81; echo '{}' > {output}\"\n";

/// Fill the filesystem at `dir` until it refuses another byte.
fn fill(dir: &std::path::Path) {
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let block = vec![0u8; 64 * 1024];
    loop {
        if let Err(e) = f.write_all(&block) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "filling: {e}");
            break;
        }
    }
    // Whatever partial block the last write left is full too.
    while f.write_all(&[0u8]).is_ok() {}
}

#[test]
fn a_full_shared_disk_is_reported_as_the_cause_not_as_a_dead_node() {
    let Some(fs) = SmallFs::mount(
        "a_full_shared_disk_is_reported_as_the_cause_not_as_a_dead_node",
        "8m",
        "",
    ) else {
        return;
    };
    let mut c = TestCluster::new(2, LONG_ROLLOUT);
    c.log_path = fs.path().join("run");
    let mut nodes = c.spawn_all(&[]);
    for r in 0..2 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    fill(fs.path());

    // Each node stops on its own (long before dead-after would judge anyone) and names
    // the real error, whether it hit it first or adopted a peer's.
    for n in &mut nodes {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert!(
            code == 1 || code == 3,
            "rank {} exit {code}:\n{err}",
            n.rank
        );
        let last = err
            .lines()
            .rev()
            .find(|l| l.starts_with("error:"))
            .unwrap_or("");
        assert!(
            last.contains("stopped writing to the shared directory: No space left on device"),
            "rank {}'s final error names the cause:\n{err}",
            n.rank
        );
        // A hang report may say that a peer went silent (it did: its heartbeat could not
        // be written either); no conclusion may blame a dead node.
        let blames = err
            .lines()
            .filter(|l| !l.contains("hang report"))
            .any(|l| l.contains("is dead") || l.contains("heartbeat has been still"));
        assert!(
            !blames,
            "rank {} blames a dead node instead of the full disk:\n{err}",
            n.rank
        );
    }
    // The abort is on the shared directory even though no file could be created: each
    // record was overwritten in place, so peers and `status` can read why.
    for r in 0..2 {
        let rec = c
            .record(r)
            .expect("record readable after the in-place write");
        assert_eq!(rec["state"], "failed", "rank {r}: {rec}");
        let reason = rec["abort"]["reason"].as_str().unwrap_or("");
        assert!(
            reason.contains("No space left on device"),
            "rank {r}: {rec}"
        );
    }
    let (_, out) = status(&c.log_path, false);
    assert!(out.contains("No space left on device"), "status:\n{out}");
    // No empty temporary files left behind by the failed creates.
    let gen_dir = c.log_path.join(".rl-node/gen-1");
    let leftovers: Vec<_> = std::fs::read_dir(&gen_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn a_read_only_shared_directory_is_refused_as_read_only_not_as_permission() {
    let Some(fs) = SmallFs::mount(
        "a_read_only_shared_directory_is_refused_as_read_only_not_as_permission",
        "8m",
        "",
    ) else {
        return;
    };
    std::fs::create_dir(fs.path().join("run")).unwrap();
    fs.remount("ro");
    let c = TestCluster::new(1, LONG_ROLLOUT);
    // An existing directory on the read-only filesystem, and one that would be created.
    for name in ["run", "new-run"] {
        let mut n = c.spawn_at(0, &fs.path().join(name), &[]);
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 2, "{name}: {err}");
        assert!(err.contains("read-only"), "{name}: {err}");
        assert!(!err.contains("permission denied"), "{name}: {err}");
    }
    assert!(
        std::fs::read_dir(fs.path().join("run"))
            .unwrap()
            .next()
            .is_none(),
        "nothing was written"
    );
}
