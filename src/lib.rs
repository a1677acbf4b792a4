//! rl-node: run a multi-node reinforcement-learning loop over a shared directory.
//!
//! The binary is a thin wrapper around [`cli::main`]; integration tests drive the same
//! binary as separate node processes.

// Every unsafe block says why it is sound, in a `// SAFETY:` comment above it.
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod aggregate;
pub mod checkpoint;
pub mod cli;
pub mod clock;
pub(crate) mod config;
pub mod demo;
pub(crate) mod error;
pub(crate) mod events;
#[doc(hidden)]
pub mod exercised;
pub(crate) mod exit;
pub(crate) mod holder;
pub(crate) mod json;
pub mod layout;
pub(crate) mod logging;
pub(crate) mod metrics;
pub(crate) mod node;
/// The node's poll pacing and read split, which the simulator's latency projection runs.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub use node::poll;
#[cfg(feature = "sim")]
#[doc(hidden)]
pub use node::{
    run_in_process, run_in_process_broken, run_in_process_with, Broken, InProcess, Outcome,
};
#[cfg(feature = "sim")]
#[doc(hidden)]
pub use process::{FakeRun, FakeScript};
pub(crate) mod observe;
pub(crate) mod output;
pub(crate) mod plan;
pub(crate) mod process;
pub mod protocol;
pub(crate) mod rehearse;
pub mod rng;
#[cfg(feature = "sim")]
pub mod sched;
pub mod shards;
pub(crate) mod state;
pub mod store;
pub(crate) mod template;
pub mod work;
