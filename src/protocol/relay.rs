//! Rank 0's relay of `workers-wait-for` (`phases.<phase>.workers-wait-for`): while rank
//! 0's rollout command runs, a file that command creates by itself (e.g. webgym's
//! `multinode_flags/instances_released_rank_0`) is turned into the generation's
//! `{ready_file}` the workers wait for, once.
//!
//! Only rank 0 watches the command's file, so no worker can mistake a left-over one for
//! this iteration's; the workers wait for the marker, whose name carries the generation
//! and the iteration. The relay is a duty of the node's one wait loop, not a thread: at
//! each round the node looks for the watched file and hands the answer here, which says
//! whether to create the marker now (and with what note) and ends the relay when it has.
//! The looks are at most [`RELAY_POLL`] apart.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How often the relay looks for rank 0's file, at most.
pub const RELAY_POLL: Duration = Duration::from_millis(500);

/// One relay, from the start of rank 0's command until the marker is created or the
/// command ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relay {
    /// The file rank 0's command creates by itself.
    watched: PathBuf,
    /// The `{ready_file}` the workers wait for.
    marker: PathBuf,
    /// The phase whose command runs (`rollout`, `eval`).
    phase: String,
}

/// What the node creates when the watched file appeared: the marker, with its note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub marker: PathBuf,
    pub note: String,
}

impl Relay {
    pub fn new(watched: PathBuf, marker: PathBuf, phase: impl Into<String>) -> Relay {
        Relay {
            watched,
            marker,
            phase: phase.into(),
        }
    }

    /// The file to look for.
    pub fn watched(&self) -> &Path {
        &self.watched
    }

    /// A look at the watched file: `found`, the marker to create, saying what released it.
    pub fn looked(&self, found: bool) -> Option<Release> {
        found.then(|| Release {
            marker: self.marker.clone(),
            note: format!(
                "rank 0's {} command created {}\n",
                self.phase,
                self.watched.display()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_is_created_once_the_watched_file_is_found_and_names_it() {
        let relay = Relay::new(
            "/shared/flags/released_rank_0".into(),
            "/shared/.rl-node/gen-2/ready-iter-0003-train".into(),
            "rollout",
        );
        assert_eq!(relay.watched(), Path::new("/shared/flags/released_rank_0"));
        assert_eq!(relay.looked(false), None, "not yet");
        let release = relay.looked(true).expect("found");
        assert_eq!(
            release.marker,
            Path::new("/shared/.rl-node/gen-2/ready-iter-0003-train")
        );
        assert_eq!(
            release.note,
            "rank 0's rollout command created /shared/flags/released_rank_0\n"
        );
    }
}
