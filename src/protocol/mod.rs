//! The coordination protocol, as pure logic over records and a clock: no processes, no
//! real time, no file I/O. The node runtime (`crate::node`) feeds it what it read from
//! the shared directory and the `Instant`s it observed, and acts on what it answers.

pub mod abort;
pub mod barrier;
pub mod commit;
pub mod fence;
pub mod handover;
pub mod join;
pub mod join_machine;
pub mod journal;
pub mod lease;
pub mod liveness;
pub mod machine;
pub mod membership;
pub mod messages;
pub mod phase;
pub mod pipeline;
pub mod pool;
pub mod records;
pub mod relay;
pub mod run_machine;
pub mod serving;
pub mod topology;
pub mod walk;
pub mod watch;

pub use liveness::Liveness;
pub use phase::Phase;
pub use records::*;

/// A deliberate mutation of one of the core's decisions (each module's `Mutation`), as
/// the simulator's own tests set one to show that they catch it: `m` with the `sim`
/// feature, else always `None`. Every decision reads its mutation through here, so that
/// without the feature the mutated branches fold away and none reaches a release binary.
#[inline(always)]
pub(crate) fn mutation<M>(m: Option<M>) -> Option<M> {
    if cfg!(feature = "sim") {
        m
    } else {
        None
    }
}
