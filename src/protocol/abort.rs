//! Aborts: which failure is the cause when several nodes detect one at once, and what the
//! cause means for each node.
//!
//! The node that detects a failure creates the generation's `abort.json` exclusively and
//! puts the abort in its own record; rank 0 relays a worker's abort in its record, where
//! every worker finds it ([`super::watch`]). When two nodes detect failures at once, the
//! first to create `abort.json` is the cause and the other adopts it ([`cause`]), so every
//! node ends naming the same cause. Pure: the node does the create and the read.

use super::{AbortInfo, AbortKind};
use crate::exit;

/// The cause, after trying to create `abort.json` with `mine`: ours if we created it (or
/// could not write it at all), else the first one's as read (ours if it cannot be read).
pub fn cause(mine: AbortInfo, created: bool, first: Option<AbortInfo>) -> AbortInfo {
    match (created, first) {
        (false, Some(first)) => first,
        _ => mine,
    }
}

/// What stopping because of `info` means for rank `me`: its exit code and a hint.
pub fn consequence(info: &AbortInfo, me: u32) -> (i32, Option<String>) {
    let code = info.exit_code_for(me);
    let hint = match (&info.kind, code) {
        (AbortKind::PeerDead, _) => Some(format!(
            "check rank {}'s own output and its host; restart every node with the same command to start a new generation",
            info.culprit
        )),
        (_, exit::PEER_FAILED) => Some(format!(
            "the cause is on rank {}: see its output{}",
            info.culprit,
            info.log
                .as_ref()
                .map(|l| format!(" and {l}"))
                .unwrap_or_default()
        )),
        _ => None,
    };
    (code, hint)
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
        assert_eq!(consequence(&failed, 1), (exit::FAILED, None));
        let (code, hint) = consequence(&failed, 0);
        assert_eq!(code, exit::PEER_FAILED);
        assert_eq!(
            hint.unwrap(),
            "the cause is on rank 1: see its output and logs/iter-0004/rank-1.train.log"
        );
        let dead = abort(2, 0, AbortKind::PeerDead);
        let (code, hint) = consequence(&dead, 0);
        assert_eq!(code, exit::PEER_FAILED);
        assert!(hint.unwrap().starts_with("check rank 2's own output"));
        let late = abort(0, 0, AbortKind::Timeout);
        assert_eq!(consequence(&late, 0), (exit::DEADLINE, None));
    }
}
