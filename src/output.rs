//! Console output. Every line rl-node prints goes through here, for two reasons.
//!
//! A node's stdout and stderr may close under it: `rl-node … | head` once `head` exited, a
//! dead `tee`, an srun or ssh forwarder that went away. `println!`/`eprintln!` panic on such
//! an error (exit 101, no abort, peers left to find a dead node); here a write error is
//! ignored, so the node keeps running and its record, events and logs in the shared
//! directory keep telling what happens.
//!
//! What rl-node prints is made of data it does not control: host names and abort reasons
//! other nodes wrote into the shared directory (which anyone with write access there can
//! forge), task and item ids, file names, a failed command's log. A control character in
//! such data would reach the operator's terminal raw: an escape sequence can clear the
//! screen, retitle the window, plant a hyperlink or rewrite what was printed above it. So
//! the writers here escape every control character of what they print ([`escape_lines`]),
//! at the one place no call site can bypass; only the line breaks between lines survive,
//! and the few terminal controls rl-node draws itself (a watch's clear-screen, a progress
//! bar's carriage return) go through [`stdout_after`]/[`stderr_after`], which take them as
//! `&'static str`, apart from the data. The escape, `\u001b`, is the same inside a JSON
//! string, so `--json` output and the JSON log stay valid and decode to the original text.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::Write;

/// `s` with every control character (C0, DEL, C1) written as a `\u00XX` escape, line
/// breaks included: for one value shown on one line.
pub(crate) fn escape(s: &str) -> Cow<'_, str> {
    escape_with(s, false)
}

/// Like [`escape`], but `\n` stays a line break: for text of several lines (a report, a
/// log's last lines), each line escaped.
pub(crate) fn escape_lines(s: &str) -> Cow<'_, str> {
    escape_with(s, true)
}

fn escape_with(s: &str, keep_newlines: bool) -> Cow<'_, str> {
    // char::is_control is exactly the Cc category: U+0000–U+001F, U+007F, U+0080–U+009F.
    let hostile = |c: char| c.is_control() && !(keep_newlines && c == '\n');
    if !s.contains(hostile) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if hostile(c) {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Write `control` (rl-node's own terminal control, never data), then `args` escaped.
fn write(w: &mut impl Write, control: &'static str, args: std::fmt::Arguments, newline: bool) {
    let text = match args.as_str() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(args.to_string()),
    };
    let _ = w.write_all(control.as_bytes());
    let _ = w.write_all(escape_lines(&text).as_bytes());
    if newline {
        let _ = w.write_all(b"\n");
    }
    let _ = w.flush();
}

/// Write to stdout, escaped, ignoring errors (see the module doc).
pub fn stdout(args: std::fmt::Arguments, newline: bool) {
    write(&mut std::io::stdout().lock(), "", args, newline);
}

/// Write to stderr, escaped, ignoring errors (see the module doc).
pub fn stderr(args: std::fmt::Arguments, newline: bool) {
    write(&mut std::io::stderr().lock(), "", args, newline);
}

/// Write the terminal control `control` (a clear-screen), then `args` escaped, to stdout.
pub(crate) fn stdout_after(control: &'static str, args: std::fmt::Arguments, newline: bool) {
    write(&mut std::io::stdout().lock(), control, args, newline);
}

/// Write the terminal control `control` (a carriage return), then `args` escaped, to
/// stderr.
pub(crate) fn stderr_after(control: &'static str, args: std::fmt::Arguments, newline: bool) {
    write(&mut std::io::stderr().lock(), control, args, newline);
}

/// Write a line that is already formatted (a log line, text or JSON) to stderr, escaped,
/// ignoring errors (see the module doc).
pub fn stderr_bytes(buf: &[u8]) {
    let text = String::from_utf8_lossy(buf);
    let _ = std::io::stderr()
        .lock()
        .write_all(escape_lines(&text).as_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_controls_are_shown_not_obeyed() {
        let cases = [
            ("\x1b", "\\u001b"),
            ("a\x1b[2Jb", "a\\u001b[2Jb"),
            (
                "\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07",
                "\\u001b]8;;http://evil.example/\\u0007click\\u001b]8;;\\u0007",
            ),
            ("nul\0", "nul\\u0000"),
            ("del\x7f", "del\\u007f"),
            ("csi\u{9b}31m", "csi\\u009b31m"),
            ("\u{80}\u{9f}", "\\u0080\\u009f"),
            ("bell\x07", "bell\\u0007"),
            ("back\x08space", "back\\u0008space"),
            ("safe\rforged", "safe\\u000dforged"),
            ("tab\t", "tab\\u0009"),
        ];
        for (raw, shown) in cases {
            assert_eq!(escape(raw), shown, "{raw:?}");
            assert_eq!(escape_lines(raw), shown, "{raw:?}");
        }
    }

    #[test]
    fn line_breaks_are_kept_only_by_escape_lines() {
        assert_eq!(escape("one\ntwo"), "one\\u000atwo");
        assert_eq!(escape_lines("one\x1b[2J\ntwo\n"), "one\\u001b[2J\ntwo\n");
        assert_eq!(escape_lines("crlf\r\n"), "crlf\\u000d\n");
    }

    #[test]
    fn ordinary_text_is_untouched_and_not_copied() {
        for s in [
            "",
            "plain ascii [rank 1] ok",
            "é",
            "日本",
            "naïve → ✓ 🚀",
            "a\\u001b",
        ] {
            assert!(matches!(escape(s), Cow::Borrowed(b) if b == s), "{s:?}");
            assert!(
                matches!(escape_lines(s), Cow::Borrowed(b) if b == s),
                "{s:?}"
            );
        }
        // U+00A0 (no-break space) follows C1 and is no control.
        assert_eq!(escape("\u{a0}"), "\u{a0}");
    }

    #[test]
    fn escaped_json_stays_valid_and_decodes_to_the_original() {
        let hostile = "host\x1b[2J\x1b]0;pwned\x07\u{9b}\x7f\n";
        let json = serde_json::to_string_pretty(&serde_json::json!({ "host": hostile })).unwrap();
        let shown = escape_lines(&json);
        assert!(
            !shown.contains(|c: char| c.is_control() && c != '\n'),
            "{shown}"
        );
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(back["host"], hostile);
    }
}
