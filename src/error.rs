//! How an rl-node command ends with an error: one type for every subcommand, and the one
//! place that prints it.
//!
//! A [`Failure`] carries the exit code (the documented ones in [`crate::exit`]), the
//! message, an optional hint and an optional detail (the tail of a failing command's log).
//! [`report`] prints it: `error: …`, the log tail, `hint: …` on a terminal or in plain
//! text, or one JSON event when the node logs JSON. A failure whose code is
//! [`exit::DONE`] is not an error (a restart of a run that is already complete): it prints
//! its message without `error:`.

use crate::exit;
use crate::logging;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub code: i32,
    pub message: String,
    pub hint: Option<String>,
    /// The tail of the failing command's log, shown under the message.
    pub detail: Option<String>,
}

impl Failure {
    /// Bad input: a flag, a file or the configuration (exit 2); nothing was written.
    pub fn usage(message: impl Into<String>, hint: Option<String>) -> Failure {
        Failure {
            code: exit::USAGE,
            message: message.into(),
            hint,
            detail: None,
        }
    }

    /// The command could not do its work (exit 1).
    pub fn failed(message: impl Into<String>) -> Failure {
        Failure {
            code: exit::FAILED,
            message: message.into(),
            hint: None,
            detail: None,
        }
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
            f.code,
            &f.message,
            f.hint.as_deref(),
            f.detail.as_deref(),
        );
        return;
    }
    let prefix = rank.map(|r| format!("rank {r}: ")).unwrap_or_default();
    if f.code == exit::DONE {
        crate::errln!("{prefix}{}", f.message);
    } else {
        crate::errln!("error: {prefix}{}", f.message);
    }
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

/// The exit code of a command's result, after reporting a failure.
pub fn finish(rank: Option<u32>, result: Result<i32, Failure>) -> i32 {
    match result {
        Ok(code) => code,
        Err(f) => {
            report(rank, &f);
            f.code
        }
    }
}
