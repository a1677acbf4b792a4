//! The coordination protocol, as pure logic over records and a clock: no processes, no
//! real time, no file I/O. The node runtime (`crate::node`) feeds it what it read from
//! the shared directory and the `Instant`s it observed, and acts on what it answers.

pub mod abort;
pub mod barrier;
pub mod fence;
pub mod join;
pub mod journal;
pub mod lease;
pub mod liveness;
pub mod phase;
pub mod pipeline;
pub mod records;
pub mod walk;
pub mod watch;

pub use liveness::Liveness;
pub use phase::Phase;
pub use records::*;
