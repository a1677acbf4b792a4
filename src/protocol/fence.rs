//! Fencing: may a node of generation `gen` still commit?
//!
//! Every commit (a shard, an item, a merged file, a journal entry, the prepared data, a
//! checkpoint and `LATEST`) is preceded by a read of `cluster.json`. A node whose
//! generation was replaced while it was frozen (a paused VM, a hung kernel) stops there
//! without touching what the newer generation owns. The node does the read; this decides
//! on what it read, and words the refusal.

use super::ClusterRecord;
use std::path::Path;

/// What the fence read as the run's current generation.
#[derive(Debug, Clone, Copy)]
pub enum Seen<'a> {
    /// `cluster.json`, as read.
    Cluster(&'a ClusterRecord),
    /// `cluster.json` (this path) does not exist: the run was set aside or reset.
    Missing(&'a Path),
    /// `cluster.json` could not be read, for this reason.
    Unreadable(&'a str),
}

/// Which commit a fence guards: each is a mutation site of its own, so that the
/// simulator shows it catches a fenced node that makes that one commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// The rename of a rank's rollout (or eval) shard into place.
    ShardCommit,
    /// The append of a line to a rank's journal.
    JournalAppend,
    /// The rename of a merged rollout file into place (by the node or by the merge).
    MergePublish,
    /// The rename of a complete checkpoint to `models/iter-NNNN`.
    CheckpointRename,
    /// The write of `models/LATEST`.
    Latest,
    /// The move of an earlier attempt's file out of the way (`<path>.stale-genG`) before
    /// a commit: a node of a replaced generation must not move the current one's.
    SetAside,
    /// Any other commit (an item, the prepared data, a pruned checkpoint, ...).
    Other,
}

/// A deliberately broken fence, for the simulator's own tests (never set by the node):
/// shows that the simulator catches a fenced node that commits.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// Every check passes.
    Open,
    /// The checks before this one kind of commit pass; every other still holds.
    OpenAt(Site),
}

impl Mutation {
    /// Whether this mutation lets the fence before `site` pass whatever it read.
    pub fn opens(self, site: Site) -> bool {
        match self {
            Mutation::Open => true,
            Mutation::OpenAt(s) => s == site,
        }
    }
}

/// `Ok` when what was read still names generation `gen` of run `run_id`; otherwise why
/// not, in words for the node's message.
pub fn check(gen: u64, run_id: &str, seen: Seen<'_>) -> Result<(), String> {
    check_with(gen, run_id, seen, None)
}

#[doc(hidden)]
pub fn check_with(
    gen: u64,
    run_id: &str,
    seen: Seen<'_>,
    mutation: Option<Mutation>,
) -> Result<(), String> {
    check_at(gen, run_id, seen, Site::Other, mutation)
}

/// [`check`] of the fence before a commit at `site`, with its mutation if any.
#[doc(hidden)]
pub fn check_at(
    gen: u64,
    run_id: &str,
    seen: Seen<'_>,
    site: Site,
    mutation: Option<Mutation>,
) -> Result<(), String> {
    if super::mutation(mutation).is_some_and(|m| m.opens(site)) {
        return Ok(());
    }
    match seen {
        Seen::Cluster(c) if c.gen == gen && c.run_id == run_id => Ok(()),
        Seen::Cluster(c) if c.run_id == run_id => Err(format!(
            "generation {gen} was replaced by generation {} (rank 0: pid {} on {}, started {})",
            c.gen, c.pid, c.host, c.started_at
        )),
        Seen::Cluster(c) => Err(format!(
            "run {run_id} was replaced by run {} (generation {}, rank 0: pid {} on {})",
            c.run_id, c.gen, c.pid, c.host
        )),
        Seen::Missing(path) => Err(format!(
            "{} is gone (the run was set aside or reset), so generation {gen} is no longer current",
            path.display()
        )),
        Seen::Unreadable(e) => Err(format!(
            "cannot confirm that generation {gen} is still current: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(run_id: &str, gen: u64) -> ClusterRecord {
        serde_json::from_value(serde_json::json!({
            "proto": crate::protocol::PROTO, "run_id": run_id, "gen": gen, "num_nodes": 2,
            "rank_weights": [1, 1], "fingerprint": "", "config": null, "master_addr": "",
            "master_port": 0, "host": "node-a", "pid": 41, "started_at": "2026-11-23T10:00:00Z",
        }))
        .expect("a cluster record")
    }

    #[test]
    fn only_the_current_generation_of_the_same_run_may_commit() {
        assert_eq!(check(3, "r1", Seen::Cluster(&cluster("r1", 3))), Ok(()));
        let newer = check(3, "r1", Seen::Cluster(&cluster("r1", 4))).unwrap_err();
        assert_eq!(
            newer,
            "generation 3 was replaced by generation 4 (rank 0: pid 41 on node-a, started 2026-11-23T10:00:00Z)"
        );
        // An older generation in cluster.json (restored from a backup) is no licence
        // either.
        assert!(check(3, "r1", Seen::Cluster(&cluster("r1", 2))).is_err());
        let other = check(3, "r1", Seen::Cluster(&cluster("r2", 3))).unwrap_err();
        assert!(
            other.starts_with("run r1 was replaced by run r2"),
            "{other}"
        );
        let gone = check(
            3,
            "r1",
            Seen::Missing(Path::new("/nfs/x/.rl-node/cluster.json")),
        );
        assert!(gone
            .unwrap_err()
            .starts_with("/nfs/x/.rl-node/cluster.json is gone"));
        let unreadable = check(3, "r1", Seen::Unreadable("EIO")).unwrap_err();
        assert_eq!(
            unreadable,
            "cannot confirm that generation 3 is still current: EIO"
        );
    }
}
