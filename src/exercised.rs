//! Counts of the production paths a simulated run went through: a shard committed, a
//! merged file published, a generation formed, a write the fence refused, and so on.
//! A simulator that passes every invariant proves little about a path it never ran, so
//! `scripts/sim --json` reports these next to its violations. Each count is one call of
//! [`note`] at the point of commit in the node's own code, never in a model of it.
//!
//! The simulated nodes of one sweep are threads of one process, so the counters are
//! process-global atomics: a sweep [`reset`]s them first. Without the `sim` feature
//! [`note`] is an empty inline function and the counters do not exist, so a release
//! binary pays nothing.

/// The production paths counted, each with its key in `scripts/sim --json`'s `exercised`
/// object. A new path is one line here and one [`note`] where it commits.
macro_rules! paths {
    ($($(#[$doc:meta])* $name:ident => $key:literal,)*) => {
        #[doc(hidden)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Path {
            $($(#[$doc])* $name,)*
        }

        impl Path {
            /// Every path, in the order of the report.
            pub const ALL: &'static [Path] = &[$(Path::$name,)*];

            /// Its key in the report.
            pub fn key(self) -> &'static str {
                match self {
                    $(Path::$name => $key,)*
                }
            }
        }
    };
}

paths! {
    /// A rank's rollout shard committed (renamed into place).
    ShardCommits => "shard_commits",
    /// Rank 0's merged file of an iteration published.
    Merges => "merges",
    /// A hand-off completed: the checkpoint published.
    Handoffs => "handoffs",
    /// `models/LATEST` pointed at a new checkpoint.
    LatestSwitches => "latest_switches",
    /// An item of a dynamic rollout taken over from a dead claimant.
    LeaseTakeovers => "lease_takeovers",
    /// A generation formed: rank 0 published its `cluster.json`.
    Generations => "generations",
    /// A commit the fence refused (this node's generation was replaced).
    FencedWrites => "fenced_writes",
}

#[cfg(feature = "sim")]
mod counts {
    use super::Path;
    use std::sync::atomic::{AtomicU64, Ordering};

    static COUNTS: [AtomicU64; Path::ALL.len()] = [const { AtomicU64::new(0) }; Path::ALL.len()];

    pub fn note(p: Path) {
        COUNTS[p as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot() -> Vec<(&'static str, u64)> {
        Path::ALL
            .iter()
            .map(|&p| (p.key(), COUNTS[p as usize].load(Ordering::Relaxed)))
            .collect()
    }

    pub fn reset() {
        for &p in Path::ALL {
            COUNTS[p as usize].store(0, Ordering::Relaxed);
        }
    }
}

/// Count one pass through `p` (the `sim` feature only).
#[cfg(feature = "sim")]
#[inline]
pub fn note(p: Path) {
    counts::note(p)
}

/// Without the `sim` feature: nothing.
#[cfg(not(feature = "sim"))]
#[inline(always)]
pub fn note(_: Path) {}

/// Every path's key and count since the last [`reset`], in the order of [`Path::ALL`].
#[cfg(feature = "sim")]
pub fn snapshot() -> Vec<(&'static str, u64)> {
    counts::snapshot()
}

/// Set every count to zero (before a sweep).
#[cfg(feature = "sim")]
pub fn reset() {
    counts::reset()
}
