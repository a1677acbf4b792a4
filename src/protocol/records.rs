//! The records nodes exchange through the shared directory.
//!
//! Each rank owns one live record per generation (`gen-G/rank-R.json`), rewritten in
//! place: heartbeat sequence, phase, barrier position and — for rank 0 — barrier
//! releases. Rewriting a name that exists from the start of the generation is seen at the
//! next open by every NFS client, where waiting for a brand-new name can take a minute
//! under negative lookup caching (docs/shared-directory.md, "Why it is built this way").

use crate::exit::Cause;
use serde::{Deserialize, Serialize};

/// Protocol version. A live record with another version is ignored; a run whose
/// `cluster.json` has another version is refused (never read as "no run"). 2: generation-
/// specific command outputs and partial checkpoints, holder identity by start time.
pub const PROTO: u32 = 2;

/// Rank 0's record of the current generation (`.rl-node/cluster.json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterRecord {
    pub proto: u32,
    pub run_id: String,
    pub gen: u64,
    pub num_nodes: u32,
    pub rank_weights: Vec<u64>,
    pub fingerprint: String,
    /// The configuration every node must share, to say exactly what differs.
    pub config: serde_json::Value,
    pub master_addr: String,
    pub master_port: u16,
    pub host: String,
    pub pid: u32,
    /// Rank 0's machine and start time (`crate::holder`), so a reused pid is not taken
    /// for it.
    #[serde(default)]
    pub machine: String,
    #[serde(default)]
    pub pid_start: u64,
    /// Wall-clock time of the start, for display only.
    pub started_at: String,
    /// Why the previous generation ended, as far as rank 0 could tell.
    #[serde(default)]
    pub previous: Option<String>,
    /// Fingerprint of what may not change across restarts of one run.
    #[serde(default)]
    pub run_fingerprint: String,
    /// Where this generation begins (from the journals).
    #[serde(default)]
    pub resume: crate::protocol::journal::Resume,
    /// The filesystem rank 0 sees the shared directory on, for workers to compare with
    /// their own (none when rank 0 could not tell).
    #[serde(default)]
    pub filesystem: Option<Filesystem>,
    /// The generation's members, when not every rank is one (`None`: all of them): the
    /// survivors of a loss, under `cluster.min-nodes` (`super::membership`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub members: Option<super::membership::Members>,
}

/// The filesystem a node sees the shared directory on: its mount table's line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Filesystem {
    /// `/proc/mounts`' type: `nfs4`, `lustre`, `fuse.mfs`, `ext4`, ...
    pub fs_type: String,
    pub source: String,
    /// Where this node mounts it: named in this node's own messages, never written to the
    /// shared directory (nothing absolute crosses between nodes).
    #[serde(skip)]
    pub mount_point: String,
}

/// What a worker makes of rank 0's filesystem beside its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsVerdict {
    /// The same kind of filesystem (its source is not compared: clients may name one
    /// server differently).
    Same,
    /// Different kinds, either of which may be the file server's own view of the
    /// directory (rank 0 on the NFS server's disk, workers through NFS).
    Differs,
    /// This node sees a filesystem of this machine alone where rank 0 sees one no local
    /// disk can be the other end of (Lustre, GPFS, MooseFS, ...): the shared filesystem is
    /// not mounted here.
    NotShared,
}

impl Filesystem {
    /// `nfs4 (srv:/export at /nfs)`, or `nfs4 (srv:/export)` for another node's.
    pub fn describe(&self) -> String {
        match self.mount_point.as_str() {
            "" => format!("{} ({})", self.fs_type, self.source),
            at => format!("{} ({} at {at})", self.fs_type, self.source),
        }
    }

    /// The kind, with NFS's versions one kind (`nfs` and `nfs4` clients share a server).
    fn kind(&self) -> &str {
        match self.fs_type.as_str() {
            "nfs4" => "nfs",
            t => t,
        }
    }

    /// A filesystem of one machine's own disks or memory.
    fn is_local(&self) -> bool {
        const LOCAL: [&str; 12] = [
            "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "tmpfs",
            "overlay", "vfat",
        ];
        LOCAL.contains(&self.fs_type.as_str())
    }

    /// A filesystem served by daemons no single machine's local directory stands for:
    /// distributed filesystems and FUSE clients of them. (Not NFS, SMB or sshfs, whose
    /// server may be this very node looking at its own disk.)
    fn is_distributed(&self) -> bool {
        const DISTRIBUTED: [&str; 6] = ["lustre", "gpfs", "ceph", "beegfs", "glusterfs", "wekafs"];
        DISTRIBUTED.contains(&self.fs_type.as_str())
            || (self.fs_type.starts_with("fuse.") && self.fs_type != "fuse.sshfs")
    }

    /// This node's filesystem (`self`) against rank 0's.
    pub fn against(&self, rank0: &Filesystem) -> FsVerdict {
        if self.kind() == rank0.kind() {
            FsVerdict::Same
        } else if self.is_local() && rank0.is_distributed() {
            FsVerdict::NotShared
        } else {
            FsVerdict::Differs
        }
    }
}

impl ClusterRecord {
    /// Generation `gen` of run `run_id` on `num_nodes` nodes, every other field empty:
    /// what tests and the simulator fill in (`ClusterRecord { host, ..ClusterRecord::bare(…) }`).
    pub fn bare(run_id: &str, gen: u64, num_nodes: u32) -> ClusterRecord {
        ClusterRecord {
            proto: PROTO,
            run_id: run_id.to_string(),
            gen,
            num_nodes,
            rank_weights: vec![],
            fingerprint: String::new(),
            config: serde_json::Value::Null,
            master_addr: String::new(),
            master_port: 0,
            host: String::new(),
            pid: 0,
            machine: String::new(),
            pid_start: 0,
            started_at: String::new(),
            previous: None,
            run_fingerprint: String::new(),
            resume: Default::default(),
            filesystem: None,
            members: None,
        }
    }

    /// The generation's members (every rank, unless it was formed by survivors).
    pub fn members(&self) -> super::membership::Members {
        self.members
            .clone()
            .unwrap_or_else(|| super::membership::Members::all(self.num_nodes))
    }
}

/// The generation a cluster record publishes, as the survivors' regroup reads it.
impl From<&ClusterRecord> for super::membership::Regrouped {
    fn from(c: &ClusterRecord) -> super::membership::Regrouped {
        super::membership::Regrouped {
            gen: c.gen,
            members: c.members(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeState {
    /// Placeholder rank 0 creates for a rank that has not joined yet.
    Vacant,
    Joining,
    Running,
    /// Finished every planned iteration.
    Done,
    /// Stopped because of a failure (its own or a peer's); see `abort`.
    Failed,
    /// Gave up on this generation before it formed (e.g. rank 0 vanished while joining).
    Left,
}

impl NodeState {
    pub fn is_terminal(self) -> bool {
        matches!(self, NodeState::Done | NodeState::Failed | NodeState::Left)
    }
}

/// A barrier position: barrier number `k` of the generation (every rank walks the same
/// sequence), named for humans, with an optional gathered payload.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Mark {
    pub k: u64,
    pub iteration: u64,
    pub name: String,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub payload: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum AbortKind {
    CommandFailed { exit: String },
    Timeout,
    PeerDead,
    Signal { signal: i32 },
    Error,
}

/// A node's call for hang reports (docs/forensics.md): a wait of `rank` overran its
/// fraction of its timeout, or a peer fell silent; every node that reads the call writes
/// a report of its own processes, once per (`rank`, `n`) and at most once per
/// (`iteration`, `phase`). Rank 0 relays a worker's call
/// in its own record, since workers read only rank 0's.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HangCall {
    /// The rank whose wait or whose watch found the hang.
    pub rank: u32,
    /// Counts that rank's calls (1, 2, …).
    pub n: u64,
    /// Where the caller was: one stall makes several nodes call (every worker waiting for
    /// a slow rank 0), and a node answers one call per iteration and phase of the caller.
    pub iteration: u64,
    pub phase: String,
    pub why: String,
}

/// Who stopped the cluster and why. The first abort of a generation wins.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AbortInfo {
    #[serde(flatten)]
    pub kind: AbortKind,
    /// The rank at fault.
    pub culprit: u32,
    pub culprit_host: String,
    pub phase: String,
    pub iteration: u64,
    pub reason: String,
    /// The culprit's command log, relative to the shared directory (every node mounts it
    /// where it likes; the reader places it on its own mount with
    /// `layout::resolve_recorded`).
    #[serde(default)]
    pub log: Option<String>,
    /// The rank that noticed and published it.
    pub detected_by: u32,
    /// For a dead peer: how long its heartbeat had been still, by the detector's clock.
    #[serde(default)]
    pub silent_ms: Option<u64>,
    pub at: String,
    /// In a pipelined run, the cluster (`rollout`, `update`) the culprit belongs to, so
    /// both clusters stop with the same diagnosis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// The cluster of `detected_by`, when it differs from the culprit's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detected_in: Option<String>,
    /// Elastic mode: the culprit is dropped and the others go on without it, rather than
    /// stop (`phases.<phase>.on-failure = "drop-node"`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dropped: bool,
}

/// Whether `signal` is a batch system's time-limit warning (SIGUSR1 or SIGUSR2, as Slurm's
/// `--signal` sends): the whole cluster stops gracefully, to be resumed.
pub fn is_time_limit(signal: i32) -> bool {
    signal == libc::SIGUSR1 || signal == libc::SIGUSR2
}

impl AbortInfo {
    /// Why `rank` stops because of this abort (its exit code: docs/usage.md, exit codes).
    pub fn cause_for(&self, rank: u32) -> Cause {
        // A time-limit warning stops the whole cluster gracefully, to be resumed: every
        // node says so with the same code, whichever received the signal.
        if let AbortKind::Signal { signal } = self.kind {
            if is_time_limit(signal) {
                return Cause::TimeLimit;
            }
        }
        if self.culprit != rank || self.detected_by != rank {
            return Cause::PeerFailed;
        }
        self.cause()
    }

    /// What stopped the cluster, as the culprit's own exit code says it (a batch job's
    /// record should show this, not the victims' 3): a node declared dead is a failure
    /// of that node (it was killed or crashed; its own code is lost with it).
    pub fn cause(&self) -> Cause {
        match self.kind {
            AbortKind::Signal { signal } if is_time_limit(signal) => Cause::TimeLimit,
            AbortKind::Timeout => Cause::Deadline,
            AbortKind::Signal { signal } => Cause::Interrupted(signal),
            AbortKind::PeerDead | AbortKind::CommandFailed { .. } | AbortKind::Error => {
                Cause::Failed
            }
        }
    }

    /// One paragraph a user can act on.
    pub fn describe(&self) -> String {
        let whose = |c: &Option<String>| {
            c.as_ref()
                .map(|c| format!("the {c} cluster's "))
                .unwrap_or_default()
        };
        let culprit = whose(&self.cluster);
        let mut s = match &self.kind {
            AbortKind::PeerDead => format!(
                "{culprit}rank {} on {} is dead: its heartbeat has been still for {} (last seen in phase {} of iteration {}); noticed by {}rank {}",
                self.culprit,
                self.culprit_host,
                self.silent_ms
                    .map(|ms| format!("{:.1}s", ms as f64 / 1000.0))
                    .unwrap_or_else(|| "?".into()),
                self.phase,
                self.iteration,
                whose(&self.detected_in.clone().or(self.cluster.clone())),
                self.detected_by
            ),
            _ => format!(
                "{culprit}rank {} on {} failed in phase {} of iteration {}: {}",
                self.culprit, self.culprit_host, self.phase, self.iteration, self.reason
            ),
        };
        if let Some(log) = &self.log {
            s.push_str(&format!("\n  log: {log}"));
        }
        s
    }
}

/// A rank's live record in one generation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RankRecord {
    pub proto: u32,
    pub run_id: String,
    pub gen: u64,
    pub rank: u32,
    pub host: String,
    pub pid: u32,
    /// The holder's machine and start time (`crate::holder`): with host and pid, who
    /// holds the rank, so a dead node's pid reused by another process is not taken for it.
    #[serde(default)]
    pub machine: String,
    #[serde(default)]
    pub pid_start: u64,
    /// Random per process: tells two processes claiming one rank apart.
    pub nonce: String,
    /// Grows at every write; liveness is judged by watching it advance.
    pub seq: u64,
    pub state: NodeState,
    pub iteration: u64,
    pub phase: Option<crate::protocol::Phase>,
    #[serde(default)]
    pub progress: Option<String>,
    /// The last barrier this rank arrived at.
    #[serde(default)]
    pub arrived: Option<Mark>,
    /// Rank 0 only: the last barrier released (implies all earlier ones).
    #[serde(default)]
    pub released: Option<Mark>,
    /// A group's leader (`super::topology`) only: the last barrier every rank of its
    /// group arrived at, with their gathered values in rank order (its own first) as
    /// the payload's array. What rank 0 reads instead of each member's arrival.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Mark>,
    /// Rank 0 (and a group's leader), while it waits at a barrier: the ranks that have
    /// not arrived.
    #[serde(default)]
    pub waiting_for: Vec<u32>,
    /// Rank 0 only: heartbeat age of each peer as rank 0 observes it (ms).
    #[serde(default)]
    pub observed_ms: Vec<(u32, u64)>,
    #[serde(default)]
    pub abort: Option<AbortInfo>,
    /// Written into a still-vacant placeholder by a process that was refused this rank
    /// (e.g. its configuration differs), so rank 0 and `status` can say why the rank does
    /// not join instead of waiting silently. Nothing else about the slot changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The newest hang report this rank wrote, relative to the log path
    /// (docs/forensics.md), for `status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_report: Option<String>,
    /// The newest call for hang reports this rank made or (rank 0) relays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_call: Option<HangCall>,
    /// Wall-clock time of this write, for display only.
    pub wall: String,
}

/// What `Layout::observed` holds: rank 0's view of its peers' heartbeat ages (ms), for
/// `rl-node status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObservedFile<A = Vec<(u32, u64)>> {
    pub ages_ms: A,
}

impl RankRecord {
    /// Rank `rank`'s slot in generation `gen` of run `run_id` as rank 0 creates it before
    /// anyone holds it: no holder, sequence 0, no barrier marks. The holder fills in its
    /// identity and state (`RankRecord { state, host, ..RankRecord::vacant(…) }`).
    pub fn vacant(run_id: &str, gen: u64, rank: u32) -> RankRecord {
        RankRecord {
            proto: PROTO,
            run_id: run_id.to_string(),
            gen,
            rank,
            host: String::new(),
            pid: 0,
            machine: String::new(),
            pid_start: 0,
            nonce: String::new(),
            seq: 0,
            state: NodeState::Vacant,
            iteration: 0,
            phase: None,
            progress: None,
            arrived: None,
            released: None,
            group: None,
            waiting_for: vec![],
            observed_ms: vec![],
            abort: None,
            refused: None,
            hang_report: None,
            hang_call: None,
            wall: String::new(),
        }
    }

    pub fn belongs_to(&self, run_id: &str, gen: u64, rank: u32) -> bool {
        self.proto == PROTO && self.run_id == run_id && self.gen == gen && self.rank == rank
    }

    /// The process holding this record.
    pub fn holder(&self) -> crate::holder::ProcessId {
        crate::holder::ProcessId {
            host: self.host.clone(),
            machine: self.machine.clone(),
            pid: self.pid,
            start: self.pid_start,
        }
    }

    pub fn arrived_at(&self, k: u64) -> bool {
        self.arrived.as_ref().is_some_and(|m| m.k >= k)
    }

    pub fn released_at(&self, k: u64) -> bool {
        self.released.as_ref().is_some_and(|m| m.k >= k)
    }

    /// A group's leader: the group mark of barrier `k` or later, which holds its group's
    /// gathered values.
    pub fn grouped_at(&self, k: u64) -> Option<&Mark> {
        self.group.as_ref().filter(|m| m.k >= k)
    }
}

/// A wall-clock time as records and journals carry it: RFC 3339 with milliseconds, in
/// local time. The time is handed in; the core reads no clock.
pub fn wall_stamp(t: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Local>::from(t)
        .format("%Y-%m-%dT%H:%M:%S%.3f%:z")
        .to_string()
}

/// Which ranks have not arrived at barrier `k`. `records[r]` is what was read for rank r
/// (None: missing or not of this generation). Rank 0 is never missing from its own view.
pub fn missing_arrivals(records: &[Option<RankRecord>], k: u64) -> Vec<u32> {
    records
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, r)| !r.as_ref().is_some_and(|r| r.arrived_at(k)))
        .map(|(i, _)| i as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: u32, k: Option<u64>) -> RankRecord {
        RankRecord {
            state: NodeState::Running,
            iteration: 1,
            arrived: k.map(|k| Mark {
                k,
                iteration: 1,
                name: "b".into(),
                payload: serde_json::Value::Null,
            }),
            ..RankRecord::vacant("r", 1, rank)
        }
    }

    #[test]
    fn barrier_counts_only_ranks_at_or_past_k() {
        let recs = vec![
            Some(rec(0, Some(3))),
            Some(rec(1, Some(3))),
            Some(rec(2, Some(2))),
            None,
        ];
        assert_eq!(missing_arrivals(&recs, 3), vec![2, 3]);
        assert_eq!(missing_arrivals(&recs, 2), vec![3]);
    }

    #[test]
    fn causes_and_their_exit_codes() {
        let mut a = AbortInfo {
            kind: AbortKind::CommandFailed { exit: "1".into() },
            culprit: 2,
            culprit_host: "h".into(),
            phase: "1 (train-rollout)".into(),
            iteration: 1,
            reason: "x".into(),
            log: None,
            detected_by: 2,
            silent_ms: None,
            at: String::new(),
            cluster: None,
            detected_in: None,
            dropped: false,
        };
        assert_eq!(a.cause_for(2).exit_code(), 1);
        assert_eq!(a.cause_for(0).exit_code(), 3);
        a.kind = AbortKind::Timeout;
        assert_eq!(a.cause_for(2).exit_code(), 4);
        a.kind = AbortKind::Signal { signal: 15 };
        assert_eq!(a.cause_for(2).exit_code(), 143);
        a.kind = AbortKind::PeerDead;
        a.detected_by = 0;
        assert_eq!(a.cause_for(0).exit_code(), 3);
    }

    /// In a pipelined run both clusters print one diagnosis, naming the culprit's cluster
    /// (and the detector's, when it is the other one).
    #[test]
    fn a_pipelined_abort_names_the_cluster() {
        let mut a = AbortInfo {
            kind: AbortKind::CommandFailed { exit: "1".into() },
            culprit: 1,
            culprit_host: "host-b".into(),
            phase: "10 (training)".into(),
            iteration: 7,
            reason: "the train command failed with exit code 1".into(),
            log: None,
            detected_by: 1,
            silent_ms: None,
            at: String::new(),
            cluster: Some("update".into()),
            detected_in: None,
            dropped: false,
        };
        assert_eq!(
            a.describe(),
            "the update cluster's rank 1 on host-b failed in phase 10 (training) of iteration 7: the train command failed with exit code 1"
        );
        a.kind = AbortKind::PeerDead;
        a.culprit = 0;
        a.silent_ms = Some(60_000);
        a.detected_by = 0;
        a.detected_in = Some("rollout".into());
        assert_eq!(
            a.describe(),
            "the update cluster's rank 0 on host-b is dead: its heartbeat has been still for 60.0s (last seen in phase 10 (training) of iteration 7); noticed by the rollout cluster's rank 0"
        );
        // Unchanged outside pipelined runs.
        a.cluster = None;
        a.detected_in = None;
        assert!(a.describe().starts_with("rank 0 on host-b is dead"));
        assert!(a.describe().ends_with("noticed by rank 0"));
    }
}
