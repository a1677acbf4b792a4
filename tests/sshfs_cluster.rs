//! The cluster over a real network-filesystem client: each node mounts the shared
//! directory through its own sshfs client (5 s attribute, listing and negative-lookup
//! caches, like NFS). A protocol that waited for brand-new file names or counted
//! arrivals by listing the directory would pay up to 5 s per barrier here.

mod common;
use common::cluster::*;
use common::sshfs::{self, SshfsCluster};
use std::time::{Duration, Instant};

const CACHE_SECS: u32 = 5;

#[test]
fn three_nodes_over_separate_sshfs_mounts_keep_their_speed() {
    if !sshfs::require("three_nodes_over_separate_sshfs_mounts_keep_their_speed") {
        return;
    }
    let fs = SshfsCluster::start(3, CACHE_SECS).expect("sshfs substrate");
    let c = TestCluster::new(
        3,
        r#"
[phases.rollout]
command = "echo '{\"rank\": {rank}, \"iteration\": {iteration}}' > {output}"
[phases.train]
command = "true"
"#,
    );
    let iterations = 3u64;
    let shared = fs.mount(0).join("exp");
    std::fs::create_dir_all(&shared).unwrap();
    let start = Instant::now();
    // Every node uses its own client of the one exported directory.
    let mut nodes: Vec<NodeProc> = (0..3u32)
        .map(|r| {
            c.spawn_at(
                r,
                &fs.mount(r as usize).join("exp"),
                &["--iterations", &iterations.to_string()],
            )
        })
        .collect();
    for n in &mut nodes {
        assert_eq!(
            n.wait(Duration::from_secs(120)),
            0,
            "rank {}:\n{}",
            n.rank,
            n.stderr()
        );
    }
    let elapsed = start.elapsed();
    // The merged trajectories are complete as seen by the export itself.
    for i in 1..=iterations {
        let merged = std::fs::read_to_string(
            fs.export()
                .join(format!("exp/rollouts/iter-{i:04}/train.jsonl")),
        )
        .unwrap();
        assert_eq!(merged.lines().count(), 3, "iteration {i}: {merged}");
    }
    // 7 barriers per iteration (sync-start, rollout-complete, files-ready, eval-decision,
    // eval-complete, training-ready, training-complete, handoff-complete, final-sync with
    // eval on iteration 1). Budget: the join (a worker may look up cluster.json before it
    // exists and pay one negative-cache period) plus, per barrier, two poll intervals
    // (100 ms each) — far below one cache period per barrier (27 barriers x 5 s).
    let barriers = 9 * iterations + 1;
    let budget =
        Duration::from_secs(CACHE_SECS as u64 + 5) + Duration::from_millis(200) * barriers as u32;
    eprintln!(
        "sshfs: {iterations} iterations, {barriers} barriers in {elapsed:?} (budget {budget:?})"
    );
    assert!(elapsed < budget, "took {elapsed:?}, budget {budget:?}");
    for line in nodes[0]
        .stderr()
        .lines()
        .filter(|l| l.contains("complete in") || l.contains("joined"))
    {
        eprintln!("rank 0: {line}");
    }
    drop(nodes);
    drop(fs);
}
