//! Rank 0 records the filesystem it sees the shared directory on (`cluster.json`'s
//! `filesystem`: the mount table's type, source and mount point), and a worker compares it
//! with its own: a worker that sees a local disk where rank 0 sees a filesystem no local
//! disk can stand for (Lustre, GPFS, MooseFS, ...) is refused at once, naming both, and
//! rank 0 says why the rank is missing; where one side may be the file server's own disk
//! (NFS, sshfs) the worker warns and runs.

mod common;
use common::cluster::*;
use common::sshfs::{self, SshfsCluster};
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

fn cluster_json(c: &TestCluster) -> serde_json::Value {
    serde_json::from_slice(&fs::read(c.log_path.join(".rl-node/cluster.json")).unwrap()).unwrap()
}

/// The cluster record of a rank 0 on Lustre, read by a worker whose `--log-path` is a
/// directory of this machine's own disk (the share not mounted on its node, a stale copy
/// of the run there). The record is rank 0's own, its `filesystem` set to Lustre's.
#[test]
fn a_worker_on_a_local_disk_where_rank_0_has_lustre_is_refused_naming_both() {
    let c = TestCluster::new(2, "");
    let mut rank0 = c.spawn(0, &["--iterations", "1"]);
    let path = c.log_path.join(".rl-node/cluster.json");
    wait_until(LIMIT, "rank 0's cluster.json", || path.is_file());
    let mut record = cluster_json(&c);
    let mine = record["filesystem"].clone();
    assert!(
        mine["fs_type"].is_string() && mine["source"].is_string(),
        "rank 0 records its filesystem: {record}"
    );
    assert!(
        mine.get("mount_point").is_none(),
        "no absolute path crosses: {mine}"
    );
    record["filesystem"] = serde_json::json!({
        "fs_type": "lustre", "source": "10.0.0.1@tcp:/scratch"
    });
    let planted = path.with_extension("planted");
    fs::write(&planted, serde_json::to_vec(&record).unwrap()).unwrap();
    fs::rename(&planted, &path).unwrap();

    let mut worker = c.spawn(1, &["--iterations", "1"]);
    assert_eq!(worker.wait(LIMIT), 2, "{}", worker.stderr());
    let said = worker.stderr();
    let local = format!(
        "{} ({} at ",
        mine["fs_type"].as_str().unwrap(),
        mine["source"].as_str().unwrap(),
    );
    assert!(
        said.contains("lustre (10.0.0.1@tcp:/scratch);") && said.contains(&local),
        "names both filesystems:\n{said}"
    );
    assert!(
        said.contains("the shared filesystem is not mounted on this node"),
        "{said}"
    );
    // Rank 0 hears why rank 1 is missing now, not at join-timeout.
    wait_until(LIMIT, "rank 0 to report the refusal", || {
        rank0
            .stderr()
            .contains("rank 1 was refused: it sees the shared directory on")
    });
    rank0.signal(libc::SIGTERM);
    rank0.wait(LIMIT);
}

/// Rank 0 through an sshfs client, the worker on the exported directory itself (it is the
/// file server): the kinds differ, which a file server's own view explains, so the
/// worker warns, naming both, and the run completes.
#[test]
fn a_worker_on_the_file_servers_own_disk_warns_and_runs() {
    if !sshfs::require("a_worker_on_the_file_servers_own_disk_warns_and_runs") {
        return;
    }
    let fs = SshfsCluster::start(1, 0).expect("sshfs substrate");
    let c = TestCluster::new(2, "[phases.train]\ncommand = \"true\"\n");
    let (client, server) = (fs.mount(0).join("exp"), fs.export().join("exp"));
    std::fs::create_dir_all(&server).unwrap();
    let mut nodes = [
        c.spawn_at(0, &client, &["--iterations", "1"]),
        c.spawn_at(1, &server, &["--iterations", "1"]),
    ];
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let said = nodes[1].stderr();
    assert!(
        said.contains("warning: rank 0 (on ")
            && said.contains("sees the shared directory on fuse.sshfs")
            && said.contains("fine when one of them is the file server's own disk"),
        "{said}"
    );
    assert!(!nodes[0].stderr().contains("was refused"));
}
