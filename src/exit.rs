//! The exit codes rl-node documents (README: "Exit codes"), in one place.
//!
//! A node exits with one of these and nothing else: its stop's cause decides
//! (`AbortInfo::exit_code_for`), and when signals follow one another the first decides
//! (`node::signals`). Two more outcomes come from outside the code's decisions, and the
//! README lists them too: 101 when rl-node panics (a bug), and death by a signal the node
//! does not handle (`kill -9`, the OOM killer, a crash), which the supervisor passes on by
//! dying of the same signal (a shell shows 128 + its number).

/// Every planned iteration is complete.
pub const DONE: i32 = 0;
/// This node failed: its command failed, or it could not do its own work.
pub const FAILED: i32 = 1;
/// Usage or configuration error; nothing was written to the shared directory.
pub const USAGE: i32 = 2;
/// Stopped because another node failed or died.
pub const PEER_FAILED: i32 = 3;
/// A deadline passed (phase timeout, barrier or join timeout).
pub const DEADLINE: i32 = 4;
/// Stopped early on request, to be resumed: SIGUSR1 or SIGUSR2 (Slurm's
/// `--signal=USR1@N` pre-timeout warning) reached a node, and every node stopped
/// gracefully. 75 is EX_TEMPFAIL: "try again later" — restart (requeue) to resume.
pub const TIME_LIMIT: i32 = 75;
/// Interrupted by SIGHUP (a closed terminal or ssh session).
pub const SIGHUP: i32 = 129;
/// Interrupted by SIGINT.
pub const SIGINT: i32 = 130;
/// Interrupted by SIGTERM.
pub const SIGTERM: i32 = 143;
