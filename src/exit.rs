//! The exit codes rl-node documents (docs/usage.md: "Exit codes"), and the one place that maps
//! the causes of a stop to them ([`Cause::exit_code`]) and the ends of a command that ran
//! to its end ([`Ending::exit_code`]). Commands return an [`Ending`] or a `Failure` (which
//! carries its [`Cause`]), never a number, so that a code cannot drift from its meaning.
//!
//! A node exits with one of these and nothing else: its stop's cause decides (an abort's
//! through `AbortInfo::cause_for`), and when signals follow one another the first decides
//! (`node::signals`). Two more outcomes come from outside the code's decisions, and the
//! docs/usage.md lists them too: 101 when rl-node panics (a bug), and death by a signal the node
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

/// Why a command stopped without doing its work. Each cause has one exit code
/// ([`Cause::exit_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// This node failed: its command failed, or it could not do its own work.
    Failed,
    /// Bad input: a flag, a file or the configuration; nothing was written.
    Usage,
    /// Another node failed or died.
    PeerFailed,
    /// A deadline passed (phase timeout, barrier or join timeout).
    Deadline,
    /// A time-limit warning (SIGUSR1 or SIGUSR2) stopped every node, to be resumed.
    TimeLimit,
    /// Interrupted by this signal (SIGINT, SIGTERM, SIGHUP).
    Interrupted(i32),
}

impl Cause {
    /// The exit code this cause ends the process with (docs/usage.md: "Exit codes"): the only
    /// place causes become numbers.
    pub fn exit_code(self) -> i32 {
        match self {
            Cause::Failed => FAILED,
            Cause::Usage => USAGE,
            Cause::PeerFailed => PEER_FAILED,
            Cause::Deadline => DEADLINE,
            Cause::TimeLimit => TIME_LIMIT,
            // The shell's convention for a death by that signal: SIGHUP 129, SIGINT 130,
            // SIGTERM 143. The number may come from an `abort.json` in the shared
            // directory, which anyone can write: one that is no signal is a failure, not
            // an overflow or an exit code outside 0-255.
            Cause::Interrupted(signal @ 1..=64) => 128 + signal,
            Cause::Interrupted(_) => FAILED,
        }
    }
}

/// How a command that ran to its end exits: it did its work, or it printed its own report
/// whose verdict is a [`Cause`] (a `Failure` is for a command stopped before its end, and
/// prints `error: …`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It did its work (or printed the help it was asked for).
    Done,
    /// It printed its report, which is the message (no `error:` line follows), and that
    /// report's verdict is this cause: a doctor check that failed, damaged state that
    /// `recover` lists, a demo run whose node failed, a usage error clap printed.
    Reported(Cause),
    /// The exit code of the node process this supervisor ran, passed on unchanged (the
    /// node decided it, through a [`Cause`] or [`Ending`] of its own).
    PassedOn(i32),
}

impl Ending {
    /// The exit code this ending ends the process with (docs/usage.md: "Exit codes").
    pub fn exit_code(self) -> i32 {
        match self {
            Ending::Done => DONE,
            Ending::Reported(cause) => cause.exit_code(),
            Ending::PassedOn(code) => code,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cause against docs/usage.md's table of exit codes, written out: a mapping
    /// changed in `exit_code` (or a constant changed in `exit`) fails here.
    #[test]
    fn each_cause_exits_with_its_documented_code() {
        let table = [
            (Cause::Failed, 1),
            (Cause::Usage, 2),
            (Cause::PeerFailed, 3),
            (Cause::Deadline, 4),
            (Cause::TimeLimit, 75),
            (Cause::Interrupted(libc::SIGHUP), 129),
            (Cause::Interrupted(libc::SIGINT), 130),
            (Cause::Interrupted(libc::SIGTERM), 143),
        ];
        for (cause, code) in table {
            assert_eq!(cause.exit_code(), code, "{cause:?}");
        }
        for nonsense in [0, -1, 65, i32::MAX, i32::MIN] {
            assert_eq!(Cause::Interrupted(nonsense).exit_code(), 1, "{nonsense}");
        }
        // The constants the code names are the same table.
        assert_eq!(
            [DONE, FAILED, USAGE, PEER_FAILED, DEADLINE],
            [0, 1, 2, 3, 4]
        );
        assert_eq!([TIME_LIMIT, SIGHUP, SIGINT, SIGTERM], [75, 129, 130, 143]);
        // A command that ran to its end: done is 0, a report's verdict its cause's code,
        // and a node's own code passes through its supervisor unchanged.
        assert_eq!(Ending::Done.exit_code(), 0);
        for (cause, code) in table {
            assert_eq!(Ending::Reported(cause).exit_code(), code, "{cause:?}");
        }
        assert_eq!(Ending::PassedOn(137).exit_code(), 137);
        // Every cause is in the table: a new one must be given its code here.
        for (cause, _) in table {
            match cause {
                Cause::Failed
                | Cause::Usage
                | Cause::PeerFailed
                | Cause::Deadline
                | Cause::TimeLimit
                | Cause::Interrupted(_) => {}
            }
        }
    }
}
