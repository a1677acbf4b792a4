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
    // Up to 8 barriers per iteration (sync-start, rollout-complete, files-ready,
    // eval-complete when eval runs, training-ready, training-complete, handoff-complete,
    // final-sync). Budget: the join (a worker may look up cluster.json before it
    // exists and pay one negative-cache period) plus, per barrier, two poll intervals
    // (100 ms each) — far below one cache period per barrier (27 barriers x 5 s).
    let barriers = 8 * iterations + 1;
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

/// Workers started on a fresh directory before rank 0 look up `cluster.json` while it does
/// not exist, and their clients cache that "no such file" (here for 60 s, NFS's longest
/// default). Rank 0 rings the doorbell (`.rl-node/doorbell`) after publishing the
/// generation; a waiting worker opens it with `O_CREAT`, which the server answers, and so
/// joins without waiting out its cache.
#[test]
fn workers_started_first_join_a_fresh_run_without_waiting_out_their_lookup_cache() {
    if !sshfs::require(
        "workers_started_first_join_a_fresh_run_without_waiting_out_their_lookup_cache",
    ) {
        return;
    }
    const NEGATIVE_SECS: u32 = 60;
    let fs = SshfsCluster::start(3, NEGATIVE_SECS).expect("sshfs substrate");
    let c = TestCluster::new(3, "[phases.train]\ncommand = \"true\"\n");
    std::fs::create_dir_all(fs.mount(0).join("exp")).unwrap();
    let mut nodes: Vec<NodeProc> = (1..3u32)
        .map(|r| c.spawn_at(r, &fs.mount(r as usize).join("exp"), &["--iterations", "1"]))
        .collect();
    // Both workers have looked for cluster.json (and found it missing): each rang for
    // the doorbell, which its first look creates.
    let bell = fs.export().join("exp/.rl-node/doorbell");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(bell.exists()
        && nodes.iter().all(|n| {
            n.stderr()
                .contains("waiting for rank 0 to start a generation")
        }))
    {
        assert!(
            Instant::now() < deadline,
            "the workers did not start: bell {}\n{}\n{}",
            bell.exists(),
            nodes[0].stderr(),
            nodes[1].stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let start = Instant::now();
    nodes.insert(
        0,
        c.spawn_at(0, &fs.mount(0).join("exp"), &["--iterations", "1"]),
    );
    for n in &mut nodes {
        assert_eq!(
            n.wait(Duration::from_secs(180)),
            0,
            "rank {}:\n{}",
            n.rank,
            n.stderr()
        );
    }
    let elapsed = start.elapsed();
    // Without the doorbell no worker could see cluster.json before its cached "no such
    // file" expired: 60 s after its look.
    assert!(
        elapsed < Duration::from_secs(NEGATIVE_SECS as u64 / 2),
        "the run took {elapsed:?}: a worker waited out its {NEGATIVE_SECS} s lookup cache\n{}",
        nodes[1].stderr()
    );
    let bell_text = std::fs::read_to_string(&bell).unwrap();
    assert!(bell_text.starts_with("{\"gen\":1,"), "{bell_text}");
    drop(nodes);
    drop(fs);
}
