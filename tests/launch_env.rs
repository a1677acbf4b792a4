//! What the training command learns about its node and rank 0, as run.sh gave it:
//! `NPROC_PER_NODE` (this node's GPUs, or a number; nodes may differ) and a `MASTER_ADDR`
//! that can be rank 0's IP address (`cluster.master-addr = "ip"`, run.sh's `hostname -I`).

mod common;
use common::cluster::*;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// One iteration whose training writes what it was given to `{log_path}/train-{rank}`.
const TRAIN_ENV: &str = r#"
[phases.rollout]
command = "echo '{}' > {output}"
[phases.train]
command = "echo \"$NPROC_PER_NODE {nproc_per_node} $MASTER_ADDR {master_addr}\" > {log_path}/train-{rank}; mkdir -p {output}/checkpoint-1; echo w > {output}/checkpoint-1/w"
"#;

fn seen(c: &TestCluster, rank: u32) -> Vec<String> {
    fs::read_to_string(c.log_path.join(format!("train-{rank}")))
        .unwrap_or_else(|e| panic!("rank {rank} wrote no train-{rank}: {e}"))
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Add `line` to the `[cluster]` table of the test's configuration file.
fn cluster_key(c: &TestCluster, line: &str) {
    let text = fs::read_to_string(&c.config).unwrap();
    fs::write(
        &c.config,
        text.replacen("[cluster]\n", &format!("[cluster]\n{line}\n"), 1),
    )
    .unwrap();
}

/// A stand-in `nvidia-smi` on PATH listing `n` GPUs, as the real one prints them.
fn fake_nvidia_smi(dir: &std::path::Path, n: u32) -> String {
    let bin = dir.join(format!("gpus-{n}"));
    fs::create_dir_all(&bin).unwrap();
    let mut list = String::new();
    for i in 0..n {
        list.push_str(&format!(
            "echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{i})'\n"
        ));
    }
    let script = bin.join("nvidia-smi");
    fs::write(
        &script,
        format!("#!/bin/sh\n[ \"$1\" = --list-gpus ] || exit 9\n{list}"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

#[test]
fn nproc_per_node_counts_each_nodes_own_gpus_or_takes_a_number() {
    let c = TestCluster::new(3, TRAIN_ENV);
    let path = fake_nvidia_smi(c.dir.path(), 2);
    // Rank 0: CUDA_VISIBLE_DEVICES wins; rank 1: nvidia-smi lists 2; rank 2: a number set
    // for this node only (node-local, so the cluster still forms).
    let mut nodes = vec![
        c.spawn_env(
            0,
            &c.log_path,
            &["--iterations", "1"],
            &[
                ("CUDA_VISIBLE_DEVICES", "0,1,2".into()),
                ("PATH", path.clone()),
            ],
        ),
        c.spawn_env(1, &c.log_path, &["--iterations", "1"], &[("PATH", path)]),
        c.spawn_env(
            2,
            &c.log_path,
            &["--iterations", "1"],
            &[("RL_NODE_CLUSTER_GPUS_PER_NODE", "5".into())],
        ),
    ];
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    for (rank, want) in [(0, "3"), (1, "2"), (2, "5")] {
        let v = seen(&c, rank);
        assert_eq!(
            (v[0].as_str(), v[1].as_str()),
            (want, want),
            "rank {rank}: {v:?}"
        );
    }
    assert!(
        nodes[1]
            .stderr()
            .contains("NPROC_PER_NODE): 2 (nvidia-smi --list-gpus)"),
        "the node says where the count came from:\n{}",
        nodes[1].stderr()
    );
}

#[test]
fn without_a_gpu_nproc_per_node_is_one() {
    let c = TestCluster::new(1, TRAIN_ENV);
    // No nvidia-smi on this PATH, no CUDA_VISIBLE_DEVICES.
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("PATH", "/usr/bin:/bin".into())],
    );
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    assert_eq!(seen(&c, 0)[..2], ["1", "1"]);
}

#[test]
fn a_bad_gpus_per_node_is_refused_naming_the_key() {
    let c = TestCluster::new(1, "");
    cluster_key(&c, "gpus-per-node = \"all\"");
    let mut n = c.spawn(0, &[]);
    assert_eq!(n.wait(LIMIT), 2);
    let err = n.stderr();
    assert!(
        err.contains("cluster.gpus-per-node") && err.contains("all"),
        "{err}"
    );
    assert!(!c.log_path.join(".rl-node").exists(), "nothing written");
}

#[test]
fn master_addr_ip_publishes_rank_0s_ip_address_to_every_rank() {
    let c = TestCluster::new(2, TRAIN_ENV);
    cluster_key(&c, "master-addr = \"ip\"");
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let addr = seen(&c, 0)[2].clone();
    let ip: std::net::IpAddr = addr.parse().unwrap_or_else(|_| panic!("not an IP: {addr}"));
    assert!(!ip.is_loopback(), "{ip}");
    // An address of this host: it can be bound.
    std::net::UdpSocket::bind((ip, 0)).unwrap_or_else(|e| panic!("{ip} is not local: {e}"));
    for rank in 0..2 {
        let v = seen(&c, rank);
        assert_eq!(
            (v[2].as_str(), v[3].as_str()),
            (addr.as_str(), addr.as_str()),
            "rank {rank}"
        );
    }
}
