//! rl-node: run a multi-node reinforcement-learning loop over a shared directory.
//!
//! The binary is a thin wrapper around [`cli::main`]; integration tests drive the same
//! binary as separate node processes.

// Every unsafe block says why it is sound, in a `// SAFETY:` comment above it.
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod aggregate;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod demo;
pub mod events;
pub mod exit;
pub mod holder;
pub mod json;
pub mod layout;
pub mod logging;
pub mod node;
pub mod observe;
pub mod output;
pub mod protocol;
pub mod rng;
pub mod shards;
pub mod state;
pub mod store;
pub mod template;
pub mod work;
