//! A live rank that rank 0 declares dead is told what happened from its own point of
//! view: rank 0 saw its heartbeat still for longer than dead-after (the value and where
//! it was set) while it was running, why a live node's heartbeat looks still (caches of
//! the shared mount, stalled writes, a paused host), and what to change. Its peers keep
//! saying that it is dead and that its own output tells why.
//!
//! The worker is made to look dead without dying: its node process is stopped
//! (SIGSTOP, a paused host) until rank 0 has declared it dead and stopped, then
//! continued.

mod common;

use common::cluster::*;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

fn stop_signal(pid: i32, sig: i32) {
    common::kill(pid, sig).unwrap_or_else(|e| panic!("kill({pid}, {sig}): {e}"));
}

#[test]
fn a_live_rank_declared_dead_is_told_why_its_heartbeat_looked_still_and_what_to_change() {
    let c = TestCluster::new(3, "[phases.rollout]\ncommand = \"sleep 47.{rank}\"\n");
    let mut nodes = c.spawn_all(&[]);
    for r in 0..3 {
        c.wait_phase(r, 1, "train-rollout", LIMIT);
    }
    let victim = nodes[2].node_process();
    stop_signal(victim, libc::SIGSTOP);
    // Rank 0 declares rank 2 dead after dead-after (3 s) and stops, and rank 1 with it.
    let codes: Vec<i32> = nodes[..2].iter_mut().map(|n| n.wait(LIMIT)).collect();
    stop_signal(victim, libc::SIGCONT);
    let code = nodes[2].wait(LIMIT);
    let err: Vec<String> = nodes.iter().map(|n| n.stderr()).collect();
    assert_eq!(codes, [3, 3], "rank 0:\n{}\nrank 1:\n{}", err[0], err[1]);
    assert_eq!(code, 3, "rank 2:\n{}", err[2]);

    // The live rank: what rank 0 saw, against which dead-after, and what to do.
    let mine = &err[2];
    let config = c.config.display().to_string();
    for words in [
        "error: rank 2: rank 0 declared this node (rank 2 on ",
        ") dead: it saw this node's heartbeat still for ",
        &format!("longer than dead-after (3s, timing.dead-after from {config}), while this node was alive and writing it (last seen in phase 1 (train-rollout) of iteration 1)"),
        "a cache of the shared filesystem mount",
        "writes of this node that stalled",
        "this host paused",
        "Raise timing.dead-after above twice the mount's longest attribute or entry cache plus one heartbeat-interval, or mount with smaller caches",
        "`rl-node doctor --nodes N`",
    ] {
        assert!(mine.contains(words), "rank 2 must say {words:?}:\n{mine}");
    }
    assert!(!mine.contains("is dead"), "{mine}");
    assert!(!mine.contains("check rank 2's own output"), "{mine}");

    // Its peers: unchanged, rank 2 is dead and its own output says why.
    for (r, theirs) in err[..2].iter().enumerate() {
        for words in [
            format!("error: rank {r}: rank 2 on "),
            " is dead: its heartbeat has been still for ".to_string(),
            "(last seen in phase 1 (train-rollout) of iteration 1); noticed by rank 0".to_string(),
            "hint: check rank 2's own output and its host".to_string(),
        ] {
            assert!(
                theirs.contains(&words),
                "rank {r} must say {words:?}:\n{theirs}"
            );
        }
    }
}
