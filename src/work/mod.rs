//! Work planning: which rank does which task, with which seed, in each iteration.
//!
//! The rollout of an RL iteration is a list of tasks (one JSON object per line of a task
//! file), each sampled a few times, spread over the ranks. [`plan`] decides that split
//! exactly and deterministically from the task list, the rank weights, the seed and the
//! iteration number alone, so every node computes the same plan without talking to the
//! others, a restarted node recomputes the plan of the iteration it resumes, and an
//! iteration's plan never depends on what earlier iterations did.
//!
//! This module is pure: nothing here touches the shared directory or runs commands. The
//! only I/O is [`load_tasks`], which reads the task file.

pub mod plan;
pub mod tasks;

pub use plan::{
    iteration_seed, iteration_tasks, plan, sample_seed, weighted_counts, Item, Plan, PlanError,
    PlanInput, Strategy,
};
pub use tasks::{load_tasks, TaskError, TaskFile, TaskIds};

/// An `io::Write` into a SHA-256, so that fingerprints of large values (a plan of a million
/// items, the contents of a task file) are computed from their JSON without holding it.
pub(crate) struct ShaWriter<'a>(pub(crate) &'a mut sha2::Sha256);

impl std::io::Write for ShaWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        sha2::Digest::update(self.0, bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
