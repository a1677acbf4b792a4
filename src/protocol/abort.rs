//! Aborts: which failure is the cause when several nodes detect one at once, and what the
//! cause means for each node.
//!
//! The node that detects a failure creates the generation's `abort.json` exclusively and
//! puts the abort in its own record; rank 0 relays a worker's abort in its record, where
//! every worker finds it ([`super::watch`]). When two nodes detect failures at once, the
//! first to create `abort.json` is the cause and the other adopts it ([`cause`]), so every
//! node ends naming the same cause. Pure: the node does the create and the read.

use super::{AbortInfo, AbortKind};
use crate::exit::Cause;

/// A deliberately broken abort procedure, for the simulator's own tests (never set by
/// the node): shows that the simulator catches a node that runs on after an abort.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// An abort read in another rank's record is ignored: this node neither stops on it
    /// nor (rank 0) relays it to the workers.
    Ignored,
}

/// Whether a node stops on (and, rank 0, relays) an abort it read in another rank's
/// record: always, but for [`Mutation::Ignored`].
#[doc(hidden)]
pub fn adopted(mutation: Option<Mutation>) -> bool {
    super::mutation(mutation) != Some(Mutation::Ignored)
}

/// The cause, after trying to create `abort.json` with `mine`: ours if we created it (or
/// could not write it at all), else the first one's as read (ours if it cannot be read).
pub fn cause(mine: AbortInfo, created: bool, first: Option<AbortInfo>) -> AbortInfo {
    match (created, first) {
        (false, Some(first)) => first,
        _ => mine,
    }
}

/// What stopping because of `info` means for rank `me` of the cluster `cluster` (a
/// pipelined run's side; None otherwise): why it stops and a hint.
pub fn consequence(info: &AbortInfo, me: u32, cluster: Option<&str>) -> (Cause, Option<String>) {
    let cause = info.cause_for(me);
    // Pipelined: a failure in the other cluster is a peer's, whatever its rank number.
    if let Some(c) = info.cluster.as_deref().filter(|c| Some(*c) != cluster) {
        let cause = match cause {
            Cause::TimeLimit => cause,
            _ => Cause::PeerFailed,
        };
        let hint = format!(
            "the cause is in the {c} cluster, on its rank {}: see that node's output{}; restart both clusters with the same commands to resume",
            info.culprit,
            info.log
                .as_ref()
                .map(|l| format!(" and {l}"))
                .unwrap_or_default()
        );
        return (cause, Some(hint));
    }
    let hint = match (&info.kind, cause) {
        (AbortKind::PeerDead, _) => Some(format!(
            "check rank {}'s own output and its host; restart every node with the same command to start a new generation",
            info.culprit
        )),
        (_, Cause::PeerFailed) => Some(format!(
            "the cause is on rank {}: see its output{}",
            info.culprit,
            info.log
                .as_ref()
                .map(|l| format!(" and {l}"))
                .unwrap_or_default()
        )),
        _ => None,
    };
    (cause, hint)
}

/// What a live node named dead by a peer (`info`: a dead-peer abort whose culprit is `me`
/// of `cluster`, detected by another rank) is told: the detector stopped seeing its
/// heartbeat for `dead_after` (the value and where it was set, e.g. "5s, timing.dead-after
/// from rl-node.toml"), although this node ran; why a live node's heartbeat looks still,
/// and what to change. None for any other abort: "rank 2 is dead … check rank 2's own
/// output" sent rank 2 to look at itself for a failure it did not have.
pub fn declared_dead(
    info: &AbortInfo,
    me: u32,
    cluster: Option<&str>,
    dead_after: &str,
) -> Option<(String, String)> {
    if info.kind != AbortKind::PeerDead
        || info.culprit != me
        || info.cluster.as_deref() != cluster
        || (info.detected_by == me && info.detected_in.is_none())
    {
        return None;
    }
    let detector = match &info.detected_in {
        Some(c) => format!("the {c} cluster's rank {}", info.detected_by),
        None => format!("rank {}", info.detected_by),
    };
    let silent = info
        .silent_ms
        .map(|ms| format!(" for {:.1}s", ms as f64 / 1000.0))
        .unwrap_or_default();
    let message = format!(
        "{detector} declared this node (rank {me} on {}) dead: it saw this node's heartbeat still{silent}, longer than dead-after ({dead_after}), while this node was alive and writing it (last seen in phase {} of iteration {})",
        info.culprit_host, info.phase, info.iteration
    );
    let hint = format!(
        "a live node's heartbeat looks still to {detector} when its writes stay invisible there for longer than dead-after: a cache of the shared filesystem mount (attribute, entry or data cache, on either node's mount) still showing an older record, writes of this node that stalled (an overloaded or unreachable file server), or this host paused (a suspended VM, SIGSTOP, heavy swapping). Raise timing.dead-after above twice the mount's longest attribute or entry cache plus one heartbeat-interval, or mount with smaller caches; `rl-node doctor --nodes N`, run on every node at once, measures how long a rewrite takes to be seen. Then restart every node with the same command to start a new generation"
    );
    Some((message, hint))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn abort(culprit: u32, detected_by: u32, kind: AbortKind) -> AbortInfo {
        AbortInfo {
            kind,
            culprit,
            culprit_host: format!("h{culprit}"),
            phase: "train".into(),
            iteration: 4,
            reason: "exit code 1".into(),
            log: Some("logs/iter-0004/rank-1.train.log".into()),
            detected_by,
            silent_ms: None,
            at: String::new(),
            cluster: None,
            detected_in: None,
            dropped: false,
        }
    }

    #[test]
    fn the_first_abort_created_is_the_cause() {
        let mine = abort(2, 2, AbortKind::Error);
        let first = abort(1, 1, AbortKind::Error);
        assert_eq!(cause(mine.clone(), true, None), mine);
        assert_eq!(cause(mine.clone(), false, Some(first.clone())), first);
        assert_eq!(cause(mine.clone(), false, None), mine, "unreadable: ours");
    }

    #[test]
    fn the_culprit_fails_and_everyone_else_names_it() {
        let failed = abort(1, 1, AbortKind::Error);
        assert_eq!(consequence(&failed, 1, None), (Cause::Failed, None));
        let (code, hint) = consequence(&failed, 0, None);
        assert_eq!(code, Cause::PeerFailed);
        assert_eq!(
            hint.unwrap(),
            "the cause is on rank 1: see its output and logs/iter-0004/rank-1.train.log"
        );
        let dead = abort(2, 0, AbortKind::PeerDead);
        let (code, hint) = consequence(&dead, 0, None);
        assert_eq!(code, Cause::PeerFailed);
        assert!(hint.unwrap().starts_with("check rank 2's own output"));
        let late = abort(0, 0, AbortKind::Timeout);
        assert_eq!(consequence(&late, 0, None), (Cause::Deadline, None));
    }

    #[test]
    fn a_live_rank_named_dead_is_told_what_its_detector_saw_and_what_to_change() {
        let mut dead = abort(2, 0, AbortKind::PeerDead);
        dead.silent_ms = Some(5_120);
        let words = "5s, timing.dead-after from rl-node.toml";
        let (message, hint) = declared_dead(&dead, 2, None, words).unwrap();
        assert_eq!(
            message,
            "rank 0 declared this node (rank 2 on h2) dead: it saw this node's heartbeat still for 5.1s, longer than dead-after (5s, timing.dead-after from rl-node.toml), while this node was alive and writing it (last seen in phase train of iteration 4)"
        );
        assert!(
            hint.contains("a cache of the shared filesystem mount"),
            "{hint}"
        );
        assert!(
            hint.contains("Raise timing.dead-after above twice"),
            "{hint}"
        );
        // Everyone else, and any other abort, keeps the usual words.
        assert_eq!(declared_dead(&dead, 1, None, words), None);
        assert_eq!(declared_dead(&dead, 0, None, words), None);
        let failed = abort(2, 2, AbortKind::Error);
        assert_eq!(declared_dead(&failed, 2, None, words), None);
        // Pipelined: rank 2 of the other cluster is another node; a detector in the other
        // cluster is named with its cluster.
        dead.cluster = Some("rollout".into());
        assert_eq!(declared_dead(&dead, 2, Some("update"), words), None);
        let (message, _) = declared_dead(&dead, 2, Some("rollout"), words).unwrap();
        assert!(
            message.starts_with("rank 0 declared this node"),
            "{message}"
        );
        dead.detected_in = Some("update".into());
        dead.detected_by = 2;
        let (message, hint) = declared_dead(&dead, 2, Some("rollout"), words).unwrap();
        assert!(
            message
                .starts_with("the update cluster's rank 2 declared this node (rank 2 on h2) dead"),
            "{message}"
        );
        assert!(
            hint.contains("looks still to the update cluster's rank 2"),
            "{hint}"
        );
    }
}
