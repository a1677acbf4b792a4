//! Console output. Every line rl-node prints goes through here, because a node's stdout
//! and stderr may close under it: `rl-node … | head` once `head` exited, a dead `tee`, an
//! srun or ssh forwarder that went away. `println!`/`eprintln!` panic on such an error
//! (exit 101, no abort, peers left to find a dead node); here a write error is ignored, so
//! the node keeps running and its record, events and logs in the shared directory keep
//! telling what happens.

use std::io::Write;

/// Write to stdout, ignoring errors (see the module doc).
pub fn stdout(args: std::fmt::Arguments, newline: bool) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_fmt(args);
    if newline {
        let _ = o.write_all(b"\n");
    }
    let _ = o.flush();
}

/// Write to stderr, ignoring errors (see the module doc).
pub fn stderr(args: std::fmt::Arguments, newline: bool) {
    let mut e = std::io::stderr().lock();
    let _ = e.write_fmt(args);
    if newline {
        let _ = e.write_all(b"\n");
    }
}

/// Write bytes that are already formatted (a log line) to stderr, ignoring errors (see the
/// module doc).
pub fn stderr_bytes(buf: &[u8]) {
    let _ = std::io::stderr().lock().write_all(buf);
}

/// `println!` that never panics.
#[macro_export]
macro_rules! outln {
    () => { $crate::output::stdout(format_args!(""), true) };
    ($($t:tt)*) => { $crate::output::stdout(format_args!($($t)*), true) };
}

/// `print!` that never panics.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::output::stdout(format_args!($($t)*), false) };
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => { $crate::output::stderr(format_args!(""), true) };
    ($($t:tt)*) => { $crate::output::stderr(format_args!($($t)*), true) };
}

/// `eprint!` that never panics.
#[macro_export]
macro_rules! err {
    ($($t:tt)*) => { $crate::output::stderr(format_args!($($t)*), false) };
}
