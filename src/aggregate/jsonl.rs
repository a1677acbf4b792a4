//! The JSONL merge: one source at a time, lines are read into blocks (never buffering more
//! than the longest accepted record), validated as JSON (Python's `NaN`/`Infinity`
//! accepted unless strict) and classified as records, blank, torn or invalid, while a
//! second thread hashes and writes the blocks ([`with_writer`]).

use super::{AggregateError, DropKind, Dropped, MergeOptions, RankEntry, RankStatus};
use super::{IO_BUF, TICK_BYTES};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read as _, Write};
use std::path::{Path, PathBuf};

/// A line longer than this is checked as it grows (at 1, 2, 4, … MiB) so that garbage
/// without newlines (e.g. the zero-filled tail a crash can leave) is not buffered whole.
const FIRST_STEP: u64 = 1 << 20;

/// Blocks of merged bytes handed from the reading thread to the writing one.
const BLOCK: usize = 1 << 20;

enum Msg {
    Data(Vec<u8>),
    /// The current source is done: record the hash of its bytes.
    EndSource,
}

/// The reading half's end of the pipeline: records are read straight into `block` (so a
/// valid one is never copied again and an invalid one is cut off with `truncate`), and
/// full blocks go to the writing thread, which hashes and writes them.
pub(super) struct Sink {
    block: Vec<u8>,
    tx: std::sync::mpsc::SyncSender<Msg>,
    recycled: std::sync::mpsc::Receiver<Vec<u8>>,
    tmp: PathBuf,
}

impl Sink {
    fn gone(&self) -> AggregateError {
        AggregateError::Write {
            path: self.tmp.clone(),
            source: io::Error::other("the writing thread stopped"),
        }
    }

    fn flush(&mut self) -> Result<(), AggregateError> {
        if self.block.is_empty() {
            return Ok(());
        }
        let next = self
            .recycled
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(BLOCK + (BLOCK >> 2)));
        let full = std::mem::replace(&mut self.block, next);
        self.tx.send(Msg::Data(full)).map_err(|_| self.gone())
    }

    pub(super) fn end_source(&mut self) -> Result<(), AggregateError> {
        self.flush()?;
        self.tx.send(Msg::EndSource).map_err(|_| self.gone())
    }
}

/// Run `produce` (on this thread) with a [`Sink`] whose bytes a second thread hashes and
/// writes to `w`, so that validating and hashing + writing overlap. Returns `w` and the
/// SHA-256 of the bytes of each source, in the order of `end_source` calls.
pub(super) fn with_writer<W: Write + Send>(
    w: W,
    tmp: &Path,
    produce: impl FnOnce(&mut Sink) -> Result<(), AggregateError>,
) -> Result<(W, Vec<String>), AggregateError> {
    use std::sync::mpsc::sync_channel;
    std::thread::scope(|s| {
        let (tx, rx) = sync_channel::<Msg>(4);
        let (give_back, recycled) = sync_channel::<Vec<u8>>(4);
        let writer = s.spawn(move || -> io::Result<(W, Vec<String>)> {
            let mut w = w;
            let mut hasher = Sha256::new();
            let mut hashes = Vec::new();
            for m in rx {
                match m {
                    Msg::Data(mut b) => {
                        hasher.update(&b);
                        w.write_all(&b)?;
                        if b.capacity() <= 4 * BLOCK {
                            b.clear();
                            let _ = give_back.try_send(b);
                        }
                    }
                    Msg::EndSource => hashes.push(hex::encode(hasher.finalize_reset())),
                }
            }
            w.flush()?;
            Ok((w, hashes))
        });
        let mut sink = Sink {
            block: Vec::with_capacity(BLOCK + (BLOCK >> 2)),
            tx,
            recycled,
            tmp: tmp.to_path_buf(),
        };
        let produced = produce(&mut sink);
        drop(sink); // ends the writer's loop
        let written = writer.join().expect("the aggregate writer thread panicked");
        match (produced, written) {
            (Ok(()), Ok(done)) => Ok(done),
            // The writer's error is the cause of the reader's "writer stopped".
            (Ok(()) | Err(AggregateError::Write { .. }), Err(source)) => {
                Err(AggregateError::Write {
                    path: tmp.to_path_buf(),
                    source,
                })
            }
            (Err(e), _) => Err(e),
        }
    })
}

/// Stream the valid records of one source into `sink`, filling `entry`'s counts, drops
/// and problems (the caller ends the source, which records its hash).
pub(super) fn scan_source(
    path: &Path,
    entry: &mut RankEntry,
    sink: &mut Sink,
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<(), AggregateError> {
    let rank = entry.rank;
    let rerr = |source| AggregateError::Read {
        rank,
        path: path.to_path_buf(),
        source,
    };
    let f = File::open(path).map_err(rerr)?;
    let len = f.metadata().map_err(rerr)?.len();
    entry.source_bytes = len;
    let committed = entry.status == RankStatus::Complete;
    let shown = entry.source.clone().unwrap_or_default();
    let mut r = BufReader::with_capacity(IO_BUF, f);
    let mut lineno = 0u64;
    let mut pos = 0u64; // byte offset of the current line in the source
    let mut since_tick = 0u64;
    loop {
        let start = sink.block.len();
        lineno += 1;
        let got = read_record(&mut r, &mut sink.block, start, opts).map_err(rerr)?;
        let (raw, newline, invalid) = match got {
            Record::Eof => break,
            Record::Line { newline } => {
                let line = &sink.block[start..];
                let raw = line.len() as u64;
                if line.iter().all(|b| b.is_ascii_whitespace()) {
                    sink.block.truncate(start);
                    pos += raw;
                    continue;
                }
                match validate(line, opts.strict_json) {
                    Ok(()) => {
                        if !newline {
                            sink.block.push(b'\n');
                        }
                        entry.records += 1;
                        entry.bytes += (sink.block.len() - start) as u64;
                        pos += raw;
                        since_tick += raw;
                        if sink.block.len() >= BLOCK {
                            sink.flush()?;
                        }
                        if since_tick >= TICK_BYTES {
                            since_tick = 0;
                            tick();
                        }
                        continue;
                    }
                    Err(why) => {
                        sink.block.truncate(start);
                        (raw, newline, why)
                    }
                }
            }
            Record::Bad {
                bytes,
                newline,
                why,
            } => {
                sink.block.truncate(start);
                (bytes, newline, why)
            }
        };
        // `invalid` is the reason the line at `lineno` (`raw` bytes) is not a record.
        if !newline {
            entry.dropped.push(Dropped {
                kind: DropKind::Torn,
                line: lineno,
                bytes: raw,
                reason: invalid.clone(),
            });
            entry.problems.push(format!(
                "{shown}:{lineno}: torn last record dropped ({raw} bytes, no trailing newline, not valid JSON: {invalid})"
            ));
        } else if committed {
            return Err(AggregateError::Corrupt {
                rank,
                path: path.to_path_buf(),
                line: lineno,
                reason: invalid,
            });
        } else {
            let rest = len.saturating_sub(pos).max(raw);
            entry.dropped.push(Dropped {
                kind: DropKind::Invalid,
                line: lineno,
                bytes: rest,
                reason: invalid.clone(),
            });
            entry.problems.push(format!(
                "{shown}:{lineno}: not valid JSON ({invalid}); stopped reading this partial file there ({rest} bytes from line {lineno} to the end dropped)"
            ));
        }
        break;
    }
    if sink.block.capacity() > 64 << 20 {
        // After a huge record, do not keep its buffer for the rest of the merge.
        sink.flush()?;
        sink.block = Vec::with_capacity(BLOCK + (BLOCK >> 2));
    }
    Ok(())
}

enum Record {
    Eof,
    /// The line is in the buffer (with its newline when it had one).
    Line {
        newline: bool,
    },
    /// A line known to be invalid before its end was read (garbage, or longer than the
    /// limit); it has been consumed without being buffered whole.
    Bad {
        bytes: u64,
        newline: bool,
        why: String,
    },
}

/// Read one line, appending it to `buf` (whose record starts at `start`), buffering at
/// most `max_record_bytes` (+ a step) of it.
fn read_record<R: BufRead>(
    r: &mut R,
    buf: &mut Vec<u8>,
    start: usize,
    opts: &MergeOptions,
) -> io::Result<Record> {
    let cap = opts.max_record_bytes;
    let mut step = FIRST_STEP.min(cap.saturating_add(1));
    let why = loop {
        let n = r.by_ref().take(step).read_until(b'\n', buf)? as u64;
        if buf.len() > start && buf.last() == Some(&b'\n') {
            return Ok(Record::Line { newline: true });
        }
        if n < step {
            // End of file.
            return Ok(if buf.len() == start {
                Record::Eof
            } else {
                Record::Line { newline: false }
            });
        }
        let have = (buf.len() - start) as u64;
        if have > cap {
            break format!("record longer than {cap} bytes");
        }
        if let Some(why) = prefix_invalid(&buf[start..], opts.strict_json) {
            break why;
        }
        step = have.min(cap.saturating_add(1) - have).max(1);
    };
    // Consume the rest of the line without keeping it.
    let mut bytes = (buf.len() - start) as u64;
    buf.truncate(start);
    let mut scratch = Vec::with_capacity(1 << 16);
    loop {
        scratch.clear();
        let n = r
            .by_ref()
            .take(IO_BUF as u64)
            .read_until(b'\n', &mut scratch)?;
        bytes += n as u64;
        if scratch.last() == Some(&b'\n') {
            return Ok(Record::Bad {
                bytes,
                newline: true,
                why,
            });
        }
        if n == 0 {
            return Ok(Record::Bad {
                bytes,
                newline: false,
                why,
            });
        }
    }
}

/// Errors reported this close to the end of a prefix may be artefacts of the cut (e.g. a
/// number cut after its `-`), so they do not prove the whole line invalid.
const PREFIX_MARGIN: usize = 16;

/// Whether a prefix of a line (more bytes follow) already proves the line invalid.
fn prefix_invalid(prefix: &[u8], strict: bool) -> Option<String> {
    if let Err(e) = simdutf8::compat::from_utf8(prefix) {
        if e.error_len().is_some() {
            return Some(format!("invalid UTF-8 at byte {}", e.valid_up_to() + 1));
        }
    }
    let check = |bytes: &[u8]| match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        Ok(_) => None,
        Err(e) if e.is_eof() => None,
        Err(e) if e.column() + PREFIX_MARGIN >= bytes.len() => None,
        Err(e) => Some(describe(&e)),
    };
    let why = check(prefix)?;
    if !strict {
        if let Some(fixed) = python_literals_as_numbers(prefix) {
            check(&fixed)?;
        }
    }
    Some(why)
}

/// Whether `line` (one line, possibly with its newline) is one JSON value in UTF-8.
fn validate(line: &[u8], strict: bool) -> Result<(), String> {
    if let Err(e) = simdutf8::compat::from_utf8(line) {
        return Err(format!("invalid UTF-8 at byte {}", e.valid_up_to() + 1));
    }
    match serde_json::from_slice::<serde::de::IgnoredAny>(line) {
        Ok(_) => Ok(()),
        Err(e) => {
            if !strict {
                if let Some(fixed) = python_literals_as_numbers(line) {
                    if serde_json::from_slice::<serde::de::IgnoredAny>(&fixed).is_ok() {
                        return Ok(());
                    }
                }
            }
            Err(describe(&e))
        }
    }
}

/// serde_json's message without its "at line 1 column N" (the line is the file's, not 1).
fn describe(e: &serde_json::Error) -> String {
    let s = e.to_string();
    let msg = s.split(" at line ").next().unwrap_or(&s);
    format!("{msg} at byte {}", e.column())
}

/// A copy of `line` with every `NaN`, `Infinity` and `-Infinity` token outside strings
/// (where a value may start) replaced by a same-length number padded with spaces, or
/// `None` when there is none. Lets serde_json check Python's JSON dialect.
fn python_literals_as_numbers(line: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut in_str = false;
    let mut escaped = false;
    let mut prev = b'['; // the start of the line is where a value may start
    let mut i = 0;
    while i < line.len() {
        let b = line[i];
        if in_str {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_str = false;
                prev = b'"';
            }
            i += 1;
            continue;
        }
        match b {
            b' ' | b'\t' | b'\r' | b'\n' => {
                i += 1;
                continue;
            }
            b'"' => in_str = true,
            b'N' | b'I' | b'-' if matches!(prev, b'[' | b',' | b':') => {
                let rest = &line[i..];
                let (len, sign) = if rest.starts_with(b"NaN") {
                    (3, 0)
                } else if rest.starts_with(b"Infinity") {
                    (8, 0)
                } else if rest.starts_with(b"-Infinity") {
                    (9, 1)
                } else {
                    (0, 0)
                };
                if len > 0 {
                    let o = out.get_or_insert_with(|| line.to_vec());
                    o[i + sign] = b'0';
                    o[i + sign + 1..i + len].fill(b' ');
                    prev = b'0';
                    i += len;
                    continue;
                }
            }
            _ => {}
        }
        prev = b;
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts() -> MergeOptions {
        MergeOptions::default()
    }

    /// Scan `bytes` as one source file: what was merged from it, and its entry.
    fn scan_bytes(
        bytes: &[u8],
        committed: bool,
        o: &MergeOptions,
    ) -> Result<(Vec<u8>, RankEntry), AggregateError> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("src.jsonl");
        std::fs::write(&p, bytes).unwrap();
        let mut e = RankEntry {
            rank: 0,
            status: if committed {
                RankStatus::Complete
            } else {
                RankStatus::Partial
            },
            source: Some("src.jsonl".into()),
            source_bytes: 0,
            offset: 0,
            records: 0,
            bytes: 0,
            sha256: None,
            dropped: vec![],
            set_aside: vec![],
            adopted: None,
            problems: vec![],
        };
        let (out, hashes) = with_writer(Vec::new(), Path::new("tmp"), |sink| {
            scan_source(&p, &mut e, sink, o, &mut || {})?;
            sink.end_source()
        })?;
        assert_eq!(hashes, vec![hex::encode(Sha256::digest(&out))]);
        assert_eq!(e.bytes, out.len() as u64);
        Ok((out, e))
    }

    #[test]
    fn concatenates_and_fixes_missing_newline() {
        let (out, e) = scan_bytes(b"{\"r\":0}\n\n  \n{\"r\":1}", true, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n{\"r\":1}\n");
        assert_eq!(e.records, 2);
        assert!(e.dropped.is_empty());
    }

    #[test]
    fn torn_last_record_is_dropped_with_its_line_and_size() {
        let (out, e) = scan_bytes(b"{\"r\":0}\n\n{\"r\":1, \"x\": [1,", false, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n");
        assert_eq!(e.dropped.len(), 1);
        let d = &e.dropped[0];
        assert_eq!((d.kind, d.line, d.bytes), (DropKind::Torn, 3, 16));
        assert!(
            e.problems[0].contains("src.jsonl:3: torn last record"),
            "{:?}",
            e.problems
        );
    }

    #[test]
    fn invalid_middle_line_fails_a_committed_shard_and_ends_a_partial() {
        let bytes = b"{\"r\":0}\n{\"r\":1}\nnot json\n{\"r\":3}\n";
        match scan_bytes(bytes, true, &opts()).unwrap_err() {
            AggregateError::Corrupt { line, .. } => assert_eq!(line, 3),
            e => panic!("{e}"),
        }
        let (out, e) = scan_bytes(bytes, false, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n{\"r\":1}\n");
        assert_eq!(e.dropped[0].kind, DropKind::Invalid);
        assert_eq!(e.dropped[0].line, 3);
        assert_eq!(e.dropped[0].bytes, 17);
        assert!(e.problems[0].contains("src.jsonl:3: not valid JSON"));
    }

    #[test]
    fn a_valid_last_line_without_newline_is_kept_and_invalid_utf8_is_not() {
        let (out, _) = scan_bytes(b"[1]\n\"a\"", true, &opts()).unwrap();
        assert_eq!(out, b"[1]\n\"a\"\n");
        let (out, e) = scan_bytes(b"[1]\n\"\xff\"", true, &opts()).unwrap();
        assert_eq!(out, b"[1]\n");
        assert!(e.dropped[0].reason.contains("UTF-8"));
    }

    #[test]
    fn python_nan_and_infinity_are_accepted_unless_strict() {
        let line = b"{\"a\": NaN, \"b\": [Infinity, -Infinity], \"NaN\": \"NaN\"}\n";
        assert!(validate(line, false).is_ok());
        assert!(validate(line, true).is_err());
        for bad in [
            &b"[1NaN]"[..],
            b"[NaNa]",
            b"{\"a\": -NaN}",
            b"[Infinity5]",
            b"NaN NaN",
        ] {
            assert!(
                validate(bad, false).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let (out, _) = scan_bytes(line, true, &opts()).unwrap();
        assert_eq!(out, line);
    }

    #[test]
    fn long_garbage_lines_are_not_buffered_and_long_records_are_kept() {
        // A crash can leave a zero-filled tail without newlines.
        let mut bytes = b"{\"r\":0}\n".to_vec();
        bytes.extend(std::iter::repeat_n(0u8, 5 << 20));
        let (out, e) = scan_bytes(&bytes, false, &opts()).unwrap();
        assert_eq!(out, b"{\"r\":0}\n");
        assert_eq!(e.dropped[0].kind, DropKind::Torn);
        assert_eq!(e.dropped[0].bytes, 5 << 20);

        let big = format!("{{\"x\": \"{}\", \"n\": -1}}\n", "y".repeat(3 << 20));
        let (out, e) = scan_bytes(big.as_bytes(), true, &opts()).unwrap();
        assert_eq!(out, big.as_bytes());
        assert_eq!(e.records, 1);

        let small = MergeOptions {
            max_record_bytes: 1000,
            ..opts()
        };
        let text = format!("[1]\n[\"{}\"]\n[2]\n", "z".repeat(5000));
        let (out, e) = scan_bytes(text.as_bytes(), false, &small).unwrap();
        assert_eq!(out, b"[1]\n");
        assert!(e.dropped[0].reason.contains("longer than 1000"));
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec(("[a-z\"\\\\]{0,4}", inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Checking a valid line piecewise never calls it invalid, wherever it is cut.
        #[test]
        fn no_prefix_of_a_valid_line_is_judged_invalid(v in json_value(), pad in 0usize..3, cut in any::<prop::sample::Index>()) {
            let mut text = serde_json::to_string(&v).unwrap();
            if pad > 0 {
                text = serde_json::to_string_pretty(&v).unwrap().replace('\n', " ");
            }
            let bytes = text.as_bytes();
            let k = cut.index(bytes.len() + 1);
            prop_assert!(validate(bytes, true).is_ok());
            prop_assert_eq!(prefix_invalid(&bytes[..k], true), None);
        }

        /// The validator agrees with serde_json + UTF-8 on arbitrary (often invalid) bytes.
        #[test]
        fn validation_matches_serde_json(bytes in prop::collection::vec(prop_oneof![
            Just(b'{'), Just(b'}'), Just(b'['), Just(b']'), Just(b'"'), Just(b':'), Just(b','),
            Just(b'1'), Just(b'-'), Just(b'e'), Just(b'.'), Just(b' '), Just(b'\\'), Just(b'N'),
            Just(0xffu8), any::<u8>()], 0..24)) {
            let expected = std::str::from_utf8(&bytes).is_ok()
                && serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok();
            prop_assert_eq!(validate(&bytes, true).is_ok(), expected);
            if expected {
                prop_assert!(validate(&bytes, false).is_ok());
            }
        }
    }
}
