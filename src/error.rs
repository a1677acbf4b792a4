//! How an rl-node command ends without doing its work: one type for every subcommand, and
//! the one place that prints it.
//!
//! A [`Failure`] carries its [`Cause`] (why the command stopped), the message, an optional
//! hint and an optional detail (the tail of a failing command's log). A command that ran
//! to its end returns an [`Ending`] instead: done, or the verdict of the report it printed.
//! Callers name the cause or the ending, never a number: `exit_code` on each alone maps
//! them to the documented codes ([`crate::exit`]), so that a code cannot drift from its
//! meaning at one call site. [`report`] prints a failure: `error: …`, the log tail,
//! `hint: …` on a terminal or in plain text, or one JSON event when the node logs JSON. A
//! command that finds nothing to do (a restart of a run that is already complete) has not
//! failed: it ends with a [`Notice`], which [`notify`] prints without `error:`, and exits
//! 0.

pub use crate::exit::{Cause, Ending};
use crate::logging;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub cause: Cause,
    pub message: String,
    pub hint: Option<String>,
    /// The tail of the failing command's log, shown under the message.
    pub detail: Option<String>,
}

impl Failure {
    /// A failure of `cause`, with no hint or detail yet.
    pub fn new(cause: Cause, message: impl Into<String>) -> Failure {
        Failure {
            cause,
            message: message.into(),
            hint: None,
            detail: None,
        }
    }

    /// Bad input: a flag, a file or the configuration (exit 2); nothing was written.
    pub fn usage(message: impl Into<String>, hint: Option<String>) -> Failure {
        Failure {
            hint,
            ..Failure::new(Cause::Usage, message)
        }
    }

    /// The command could not do its work (exit 1).
    pub fn failed(message: impl Into<String>) -> Failure {
        Failure::new(Cause::Failed, message)
    }

    /// The exit code of this failure's cause.
    pub fn exit_code(&self) -> i32 {
        self.cause.exit_code()
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Failure {
        self.hint = Some(hint.into());
        self
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Failure {
        let detail = detail.into();
        self.detail = (!detail.is_empty()).then_some(detail);
        self
    }
}

/// What a command that had nothing to do tells the user (it exits 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub message: String,
    pub hint: Option<String>,
}

impl From<crate::config::ConfigError> for Failure {
    fn from(e: crate::config::ConfigError) -> Failure {
        let hint = matches!(e, crate::config::ConfigError::UnknownKey { .. })
            .then(|| "`rl-node show-config` prints every key with its current value".into());
        Failure::usage(e.to_string(), hint)
    }
}

/// Print `f` for the user (`rank`: the node's rank, which prefixes the message).
pub fn report(rank: Option<u32>, f: &Failure) {
    if logging::json() {
        logging::report(
            rank,
            f.exit_code(),
            &f.message,
            f.hint.as_deref(),
            f.detail.as_deref(),
        );
        return;
    }
    let prefix = rank.map(|r| format!("rank {r}: ")).unwrap_or_default();
    crate::errln!("error: {prefix}{}", f.message);
    if let Some(d) = &f.detail {
        crate::errln!("  last lines of the log:");
        for line in d.lines() {
            crate::errln!("  | {line}");
        }
    }
    if let Some(h) = &f.hint {
        crate::errln!("hint: {h}");
    }
}

/// Print `n` for the user: like a failure's report, without `error:` (and as information,
/// with exit code 0, when the node logs JSON).
pub fn notify(rank: Option<u32>, n: &Notice) {
    if logging::json() {
        logging::notice(rank, &n.message, n.hint.as_deref());
        return;
    }
    let prefix = rank.map(|r| format!("rank {r}: ")).unwrap_or_default();
    crate::errln!("{prefix}{}", n.message);
    if let Some(h) = &n.hint {
        crate::errln!("hint: {h}");
    }
}

/// The exit code of a command's result, after reporting a failure.
pub fn finish(rank: Option<u32>, result: Result<Ending, Failure>) -> i32 {
    match result {
        Ok(ending) => ending.exit_code(),
        Err(f) => {
            report(rank, &f);
            f.exit_code()
        }
    }
}
