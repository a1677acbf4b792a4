//! The JSONL merge, as a pipeline of threads so that the work of a merge (reading,
//! validation, hashing, writing) is spread over the machine's cores:
//!
//! - the calling thread reads each source into blocks of whole lines (about [`BLOCK`]
//!   bytes; a line longer than a step is checked as it grows and never buffered past
//!   `max_record_bytes`, see [`read_source`]);
//! - validator threads check the lines of a block at the level asked ([`Validate`]:
//!   UTF-8 and brackets by default, or a full JSON parse with Python's `NaN`/`Infinity`
//!   accepted unless strict), blocks in parallel;
//! - the sequencer thread takes the judged blocks back in order, does the accounting
//!   (records, blank, torn and invalid lines, where a partial source stops, a corrupt
//!   committed one), drops what is not a record and hashes each source's merged bytes
//!   (XXH3-128: SHA-256 took a quarter of the merge's time);
//! - the writer thread puts them in the merged file and asks the kernel to start writing
//!   them back as it goes, so the final fsync has little left to do.
//!
//! On the real filesystem the writer does not write the bytes it was handed: it copies
//! the same byte ranges from the source file in the kernel (`copy_file_range`, as `cat`
//! does), which saves a copy through user space; where the kernel cannot (another
//! filesystem, an old kernel, the simulated directory) it writes them. The ranges are
//! read a moment before they are copied, from the same open file; shards are never
//! written again once committed, and a source that shrinks meanwhile fails the merge.
//!
//! Memory is bounded: blocks come from a fixed pool ([`POOL`] per validator) that the
//! reader waits on, so a slow writer slows the reader instead of buffering the merge.

use super::manifest::{xxh3_hex, JSONL_DIGEST};
use super::TICK_BYTES;
use super::{AggregateError, DropKind, Dropped, MergeOptions, RankEntry, RankStatus, Validate};
use crate::store::{DataRead, DataWrite, SharedDir};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};

/// A line longer than this is checked as it grows (at 1, 2, 4, … MiB) so that garbage
/// without newlines (e.g. the zero-filled tail a crash can leave) is not buffered whole.
const FIRST_STEP: u64 = 1 << 20;

/// Bytes of whole lines per block handed from the reader to the validators.
const BLOCK: usize = 1 << 20;

/// Bytes asked of the kernel per read.
const READ: usize = 256 << 10;

/// Blocks in flight per validator thread (reading, judging, hashing, writing).
const POOL: usize = 3;

/// Ask the kernel to write the merged file back every this many bytes.
const WRITEBACK: u64 = 8 << 20;

/// Where the merged bytes go: a file (written back as it grows) or, in tests, memory.
pub(super) trait Output: Write + Send {
    /// `len` bytes from `offset` on have been written.
    fn written(&mut self, _offset: u64, _len: u64) {}

    /// Append `len` bytes of `src` from `offset` in the kernel. `Ok(false)`: not possible
    /// here, nothing was appended (the caller writes the bytes itself).
    fn copy(&mut self, _src: &File, _offset: u64, _len: u64) -> io::Result<bool> {
        Ok(false)
    }
}

impl Output for Vec<u8> {}

impl Output for Box<dyn DataWrite + '_> {
    fn written(&mut self, offset: u64, len: u64) {
        DataWrite::written(&mut **self, offset, len);
    }
}

/// The merged file on the real filesystem: bytes copied in the kernel.
impl Output for File {
    fn written(&mut self, offset: u64, len: u64) {
        DataWrite::written(self, offset, len);
    }

    fn copy(&mut self, src: &File, offset: u64, len: u64) -> io::Result<bool> {
        use rustix::io::Errno;
        let (mut off, mut done) = (offset, 0u64);
        while done < len {
            let want = (len - done).min(1 << 30) as usize;
            match rustix::fs::copy_file_range(src, Some(&mut off), &*self, None, want) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "a shard ended before the bytes read from it: it changed during the merge",
                    ))
                }
                Ok(n) => done += n as u64,
                Err(Errno::INTR) => {}
                Err(e) => {
                    let e = io::Error::from(e);
                    // "Not here" before anything was appended: the caller writes the
                    // bytes instead.
                    if done == 0 && crate::store::fs::copy_unsupported(&e) {
                        return Ok(false);
                    }
                    return Err(e);
                }
            }
        }
        Ok(true)
    }
}

/// A source on the real filesystem, read from the same open file its bytes are later
/// copied from.
struct RealSource {
    file: Arc<File>,
    len: u64,
}

impl DataRead for RealSource {
    fn size(&self) -> u64 {
        self.len
    }

    fn read_more(&mut self, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
        crate::store::fs::read_more(&self.file, buf, max)
    }
}

/// Merged bytes for the writer: `data` in memory and, when the source is a real file,
/// where the same bytes are in it.
struct Chunk {
    data: Vec<u8>,
    copy: Option<Spans>,
}

/// `data` of a [`Chunk`] as ranges of its source, then maybe an added newline.
struct Spans {
    file: Arc<File>,
    /// (offset, length) in the source, in order.
    ranges: Vec<(u64, u64)>,
}

/// Put `c` at the end of `out`: copied from its source in the kernel while `kernel`
/// holds and the output can, else written from memory. Returns whether to copy in the
/// kernel next time.
fn put<W: Output>(out: &mut W, c: &Chunk, kernel: bool) -> io::Result<bool> {
    let Some(spans) = c.copy.as_ref().filter(|_| kernel) else {
        out.write_all(&c.data)?;
        return Ok(kernel);
    };
    let mut at = 0usize;
    for &(offset, len) in &spans.ranges {
        if !out.copy(&spans.file, offset, len)? {
            out.write_all(&c.data[at..])?;
            return Ok(false);
        }
        at += len as usize;
    }
    // A newline added to a last record without one.
    out.write_all(&c.data[at..])?;
    Ok(true)
}

/// A line as the reader found it.
enum Line {
    /// In the block's bytes, ending at `end` (with its newline when it had one).
    Text {
        end: usize,
        newline: bool,
        verdict: Verdict,
    },
    /// Known to be invalid before its end was read (garbage, or longer than the limit):
    /// consumed without being buffered.
    Bad {
        bytes: u64,
        newline: bool,
        why: String,
    },
}

enum Verdict {
    /// Not judged (yet, or because an earlier line of the block ends the source).
    Unjudged,
    Record,
    Blank,
    Invalid(String),
}

/// Consecutive lines of one source.
struct Block {
    data: Vec<u8>,
    lines: Vec<Line>,
}

/// What the reader sends down the pipeline, in order (`seq`).
enum Item {
    Start(Source),
    Block(Block),
    End,
}

/// One source, as the sequencer needs to account for it.
struct Source {
    rank: u32,
    path: PathBuf,
    shown: String,
    committed: bool,
    /// Its size when the reader opened it.
    len: u64,
    /// The open file, when its bytes can be copied in the kernel.
    file: Option<Arc<File>>,
}

/// What the sequencer found in one source.
#[derive(Default)]
struct Tally {
    records: u64,
    bytes: u64,
    dropped: Vec<Dropped>,
    problems: Vec<String>,
    /// `algorithm:hex` of the bytes merged.
    digest: String,
}

/// The merge of `entries`' sources (read through `store`), in order, into `out`: fills each entry's offset,
/// source size, counts, drops, problems and digest (a missing entry only gets its
/// offset), and returns `out` with everything written (not synced).
pub(super) fn merge_sources<W: Output>(
    store: &dyn SharedDir,
    out: W,
    tmp: &Path,
    root: &Path,
    entries: &mut [RankEntry],
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<W, AggregateError> {
    merge_in_blocks(store, BLOCK, out, tmp, root, entries, opts, tick)
}

/// [`merge_sources`] with blocks of about `block` bytes (tests use tiny ones).
#[allow(clippy::too_many_arguments)]
fn merge_in_blocks<W: Output>(
    store: &dyn SharedDir,
    block: usize,
    out: W,
    tmp: &Path,
    root: &Path,
    entries: &mut [RankEntry],
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<W, AggregateError> {
    let validators = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4);
    let check = Check::of(opts);
    // The number (from 1) of the last source the sequencer stopped reading.
    let stopped = AtomicUsize::new(0);
    let gone = || AggregateError::Write {
        path: tmp.to_path_buf(),
        source: io::Error::other("the writing thread stopped"),
    };
    let (tallies, written) = std::thread::scope(|s| {
        let (work_tx, work_rx) = sync_channel::<(u64, Item)>(validators * POOL);
        let work_rx = Arc::new(Mutex::new(work_rx));
        let (judged_tx, judged_rx) = channel::<(u64, Item)>();
        let (write_tx, write_rx) = sync_channel::<Chunk>(POOL);
        let (recycle_tx, recycle_rx) = channel::<Vec<u8>>();
        for _ in 0..validators {
            let work_rx = Arc::clone(&work_rx);
            let judged_tx = judged_tx.clone();
            s.spawn(move || loop {
                let next = work_rx.lock().map(|rx| rx.recv());
                let Ok(Ok((seq, mut item))) = next else { break };
                if let Item::Block(b) = &mut item {
                    judge(b, check);
                }
                if judged_tx.send((seq, item)).is_err() {
                    break;
                }
            });
        }
        // Only the validators hold the work queue: if they all stop (the sequencer failed),
        // the reader's next send fails instead of waiting forever.
        drop(work_rx);
        drop(judged_tx);
        let recycle = recycle_tx.clone();
        let stopped = &stopped;
        let sequencer = s.spawn(move || sequence(judged_rx, write_tx, recycle, stopped));
        let writer = s.spawn(move || -> io::Result<W> {
            let mut out = out;
            let (mut total, mut synced) = (0u64, 0u64);
            let mut kernel = true;
            for chunk in write_rx {
                kernel = put(&mut out, &chunk, kernel)?;
                total += chunk.data.len() as u64;
                if total - synced >= WRITEBACK {
                    out.written(synced, total - synced);
                    synced = total;
                }
                give_back(&recycle_tx, chunk.data);
            }
            out.flush()?;
            Ok(out)
        });
        let mut reader = Reader {
            work: work_tx,
            seq: 0,
            recycled: recycle_rx,
            allocated: 0,
            pool: validators * POOL,
            block,
        };
        let mut read = Ok(());
        let mut number = 0;
        for entry in entries.iter_mut() {
            if !entry.status.has_source() {
                continue;
            }
            tick();
            number += 1;
            read = read_source(store, root, number, entry, &mut reader, stopped, opts, tick);
            if read.is_err() {
                break;
            }
        }
        drop(reader); // ends the pipeline
        let tallies = sequencer.join().expect("the aggregate sequencer panicked");
        let written = writer.join().expect("the aggregate writer panicked");
        (tallies.and_then(|t| read.map(|()| t)), written)
    });
    let (tallies, out) = match (tallies, written) {
        (Ok(t), Ok(out)) => (t, out),
        // The writer's error is the cause of the others' "writer stopped".
        (Ok(_) | Err(AggregateError::Write { .. }), Err(source)) => {
            return Err(AggregateError::Write {
                path: tmp.to_path_buf(),
                source,
            })
        }
        (Err(e), _) => return Err(e),
    };
    let mut tallies = tallies.into_iter();
    let mut offset = 0;
    for entry in entries.iter_mut() {
        entry.offset = offset;
        if !entry.status.has_source() {
            continue;
        }
        let t = tallies.next().ok_or_else(gone)?;
        entry.records = t.records;
        entry.bytes = t.bytes;
        entry.dropped.extend(t.dropped);
        entry.problems.extend(t.problems);
        entry.digest = Some(t.digest);
        offset += t.bytes;
    }
    Ok(out)
}

/// The reader's end of the pipeline: numbers what it sends, and hands out blocks from
/// the pool (waiting for one to come back when all are in flight).
struct Reader {
    work: SyncSender<(u64, Item)>,
    seq: u64,
    recycled: Receiver<Vec<u8>>,
    allocated: usize,
    pool: usize,
    /// Bytes per block.
    block: usize,
}

impl Reader {
    fn send(&mut self, item: Item) -> Result<(), ()> {
        self.seq += 1;
        self.work.send((self.seq, item)).map_err(|_| ())
    }

    fn buffer(&mut self) -> Result<Vec<u8>, ()> {
        if let Ok(b) = self.recycled.try_recv() {
            return Ok(b);
        }
        if self.allocated < self.pool {
            self.allocated += 1;
            return Ok(Vec::with_capacity(self.block + (self.block >> 2)));
        }
        self.recycled.recv().map_err(|_| ())
    }
}

/// Return a block's buffer to the pool, empty; one grown by a huge record is not kept.
fn give_back(pool: &Sender<Vec<u8>>, mut data: Vec<u8>) {
    if data.capacity() > 4 * BLOCK {
        data = Vec::new();
    }
    data.clear();
    let _ = pool.send(data);
}

/// Read the source of `entry` (the `number`th, from 1) into blocks of lines for the
/// pipeline; stops early when the sequencer says the source ended at an invalid line.
///
/// The file is read straight into the block (no copy through a second buffer), a
/// kernel read at a time; complete lines are found with `memchr`, and the unfinished
/// last line of a full block moves to the next one. A line still unfinished at
/// 1, 2, 4, … MiB (or past `max_record_bytes`) is checked as it stands, and when that
/// proves it invalid it is consumed without being buffered (see [`skip_line`]).
#[allow(clippy::too_many_arguments)]
fn read_source(
    store: &dyn SharedDir,
    root: &Path,
    number: usize,
    entry: &mut RankEntry,
    reader: &mut Reader,
    stopped: &AtomicUsize,
    opts: &MergeOptions,
    tick: &mut dyn FnMut(),
) -> Result<(), AggregateError> {
    let path = entry.source_path(root);
    let rank = entry.rank;
    let rerr = |source| AggregateError::Read {
        rank,
        path: path.clone(),
        source,
    };
    // The pipeline only breaks when the sequencer or the writer stopped: their error is
    // the one reported.
    let broken = || AggregateError::Write {
        path: PathBuf::new(),
        source: io::Error::other("the merge pipeline stopped"),
    };
    let (mut f, file) = open_source(store, &path).map_err(rerr)?;
    let len = f.size();
    entry.source_bytes = len;
    reader
        .send(Item::Start(Source {
            rank,
            path: path.clone(),
            shown: entry.source.clone().unwrap_or_default(),
            committed: entry.status == RankStatus::Complete,
            len,
            file,
        }))
        .map_err(|()| broken())?;
    let cap = opts.max_record_bytes;
    let first_check = FIRST_STEP.min(cap.saturating_add(1));
    let chunk = READ.min(reader.block).max(1);
    let mut block = Block {
        data: reader.buffer().map_err(|()| broken())?,
        lines: Vec::new(),
    };
    // The unfinished line is `block.data[start..]`; its first `scanned` bytes hold no
    // newline, and it is checked when it reaches `check_at` bytes.
    let (mut start, mut scanned, mut check_at) = (0usize, 0usize, first_check);
    let mut since_tick = 0u64;
    let mut eof = false;
    loop {
        while let Some(i) = memchr::memchr(b'\n', &block.data[start + scanned..]) {
            let end = start + scanned + i + 1;
            let bytes = (end - start) as u64;
            if bytes - 1 > cap {
                // Ended within the last read, but longer than any record may be.
                block.data.drain(start..end);
                block.lines.push(Line::Bad {
                    bytes,
                    newline: true,
                    why: format!("record longer than {cap} bytes"),
                });
            } else {
                block.lines.push(Line::Text {
                    end,
                    newline: true,
                    verdict: Verdict::Unjudged,
                });
                start = end;
            }
            since_tick += bytes;
            (scanned, check_at) = (0, first_check);
        }
        scanned = block.data.len() - start;
        if since_tick >= TICK_BYTES {
            since_tick = 0;
            tick();
        }
        if start >= reader.block || block.lines.len() >= BLOCK / 16 {
            // Send the complete lines; the unfinished one starts the next block.
            let mut next = reader.buffer().map_err(|()| broken())?;
            next.extend_from_slice(&block.data[start..]);
            block.data.truncate(start);
            let full = std::mem::replace(
                &mut block,
                Block {
                    data: next,
                    lines: Vec::new(),
                },
            );
            reader.send(Item::Block(full)).map_err(|()| broken())?;
            start = 0;
            if stopped.load(Ordering::Relaxed) == number {
                block.data.clear();
                break;
            }
        }
        let unfinished = (block.data.len() - start) as u64;
        if eof {
            if unfinished > cap {
                block.data.truncate(start);
                block.lines.push(Line::Bad {
                    bytes: unfinished,
                    newline: false,
                    why: format!("record longer than {cap} bytes"),
                });
            } else if unfinished > 0 {
                block.lines.push(Line::Text {
                    end: block.data.len(),
                    newline: false,
                    verdict: Verdict::Unjudged,
                });
            }
            break;
        }
        if unfinished >= check_at {
            let why = if unfinished > cap {
                Some(format!("record longer than {cap} bytes"))
            } else {
                prefix_invalid(&block.data[start..], Check::of(opts))
            };
            if let Some(why) = why {
                block.data.truncate(start);
                let (rest, newline) = skip_line(&mut *f, &mut block.data, chunk).map_err(rerr)?;
                block.lines.push(Line::Bad {
                    bytes: unfinished + rest,
                    newline,
                    why,
                });
                since_tick += unfinished + rest;
                (scanned, check_at) = (0, first_check);
                eof = !newline;
                continue;
            }
            check_at = unfinished.saturating_mul(2).min(cap.saturating_add(1));
        }
        eof = f.read_more(&mut block.data, chunk).map_err(rerr)? == 0;
    }
    // Sent even without lines: the sequencer gives its buffer back to the pool.
    reader.send(Item::Block(block)).map_err(|()| broken())?;
    reader.send(Item::End).map_err(|()| broken())
}

/// A source open for reading, and the file itself when the merge may copy from it.
type Opened = (Box<dyn DataRead>, Option<Arc<File>>);

/// `path` opened for reading, and the file itself when the merge may copy from it.
fn open_source(store: &dyn SharedDir, path: &Path) -> io::Result<Opened> {
    let Some(file) = store.open_os_file(path)? else {
        return Ok((store.open_data(path)?, None));
    };
    let file = Arc::new(file);
    let len = file.metadata()?.len();
    let source = RealSource {
        file: Arc::clone(&file),
        len,
    };
    Ok((Box::new(source), Some(file)))
}

/// Consume the rest of a line known to be invalid, reading into `buf`'s spare room and
/// keeping none of it; the bytes after its newline stay at the end of `buf`. Returns the
/// bytes consumed (with the newline) and whether there was a newline (else: end of file).
fn skip_line(f: &mut dyn DataRead, buf: &mut Vec<u8>, chunk: usize) -> io::Result<(u64, bool)> {
    let keep = buf.len();
    let mut bytes = 0u64;
    loop {
        let n = f.read_more(buf, chunk)?;
        if n == 0 {
            return Ok((bytes, false));
        }
        if let Some(i) = memchr::memchr(b'\n', &buf[keep..]) {
            bytes += i as u64 + 1;
            buf.drain(keep..keep + i + 1);
            return Ok((bytes, true));
        }
        bytes += n as u64;
        buf.truncate(keep);
    }
}

/// How lines are checked: the level, and whether a JSON parse refuses Python's literals.
#[derive(Clone, Copy)]
struct Check {
    level: Validate,
    strict: bool,
}

impl Check {
    fn of(opts: &MergeOptions) -> Check {
        Check {
            level: opts.validate,
            strict: opts.strict_json,
        }
    }
}

/// Judge each line of `b` until the first that is not a record (which ends its source).
fn judge(b: &mut Block, check: Check) {
    // One pass over the whole block proves every line UTF-8 without NUL (no UTF-8
    // sequence holds a newline byte); only a block that fails is checked line by line.
    let clean = check.level == Validate::Utf8
        && simdutf8::basic::from_utf8(&b.data).is_ok()
        && memchr::memchr(0, &b.data).is_none();
    let mut start = 0;
    for line in &mut b.lines {
        match line {
            Line::Text {
                end,
                newline,
                verdict,
            } => {
                let text = &b.data[start..*end];
                start = *end;
                if text.iter().all(|c| c.is_ascii_whitespace()) {
                    *verdict = Verdict::Blank;
                } else if let Err(why) = check_line(text, *newline, check, clean) {
                    *verdict = Verdict::Invalid(why);
                    return;
                } else {
                    *verdict = Verdict::Record;
                }
            }
            Line::Bad { .. } => return,
        }
    }
}

/// The sequencer: takes judged items back in order, accounts for every line, keeps the
/// records' bytes (a last record gets its missing newline), hashes them per source and
/// passes them to the writer. Returns one tally per source.
fn sequence(
    judged: Receiver<(u64, Item)>,
    write: SyncSender<Chunk>,
    recycle: Sender<Vec<u8>>,
    stopped: &AtomicUsize,
) -> Result<Vec<Tally>, AggregateError> {
    let mut early: BTreeMap<u64, Item> = BTreeMap::new();
    let mut next = 1u64;
    let mut tallies: Vec<Tally> = Vec::new();
    let mut source: Option<Source> = None;
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    debug_assert_eq!(JSONL_DIGEST, super::DigestAlgorithm::Xxh3_128);
    let mut tally = Tally::default();
    // Per source: lines seen, bytes of the source before the current line, and whether it
    // ended (at an invalid line) before its end.
    let (mut lineno, mut pos, mut done) = (0u64, 0u64, false);
    let mut sources = 0usize;
    let writer_gone = || AggregateError::Write {
        path: PathBuf::new(),
        source: io::Error::other("the writing thread stopped"),
    };
    for (seq, item) in judged {
        early.insert(seq, item);
        while let Some(item) = early.remove(&next) {
            next += 1;
            match item {
                Item::Start(s) => {
                    source = Some(s);
                    sources += 1;
                    tally = Tally::default();
                    (lineno, pos, done) = (0, 0, false);
                }
                Item::End => {
                    tally.digest =
                        format!("{}:{}", JSONL_DIGEST.name(), xxh3_hex(hasher.digest128()));
                    hasher.reset();
                    tallies.push(std::mem::take(&mut tally));
                }
                Item::Block(mut b) => {
                    let src = source.as_ref().expect("a block follows its source's start");
                    if !done {
                        let mut ranges = Vec::new();
                        let at = (&mut lineno, &mut pos);
                        done = account(&mut b, src, &mut tally, at, &mut ranges)?;
                        if done {
                            stopped.store(sources, Ordering::Relaxed);
                        }
                        if !b.data.is_empty() {
                            hasher.update(&b.data);
                            let copy = src.file.as_ref().map(|file| Spans {
                                file: Arc::clone(file),
                                ranges,
                            });
                            let chunk = Chunk { data: b.data, copy };
                            write.send(chunk).map_err(|_| writer_gone())?;
                            continue;
                        }
                    }
                    give_back(&recycle, b.data);
                }
            }
        }
    }
    Ok(tallies)
}

/// Account for the lines of `b` (of source `src`), leaving in `b.data` only the bytes
/// merged and in `ranges` where they are in the source (`(lineno, pos)`: the lines and
/// bytes of the source before `b`, moved past it). Returns whether the source ends in
/// this block (at a line that is not a record); a committed source with an invalid line
/// is [`AggregateError::Corrupt`].
fn account(
    b: &mut Block,
    src: &Source,
    tally: &mut Tally,
    (lineno, pos): (&mut u64, &mut u64),
    ranges: &mut Vec<(u64, u64)>,
) -> Result<bool, AggregateError> {
    let (mut start, mut kept) = (0usize, 0usize);
    let mut ended = false;
    let mut add_newline = false;
    for line in &b.lines {
        *lineno += 1;
        let (raw, newline, why) = match line {
            Line::Text {
                end,
                newline,
                verdict,
            } => {
                let (from, to) = (start, *end);
                start = to;
                match verdict {
                    Verdict::Record => {
                        if kept != from {
                            b.data.copy_within(from..to, kept);
                        }
                        let len = (to - from) as u64;
                        match ranges.last_mut() {
                            Some((offset, n)) if *offset + *n == *pos => *n += len,
                            _ => ranges.push((*pos, len)),
                        }
                        kept += to - from;
                        tally.records += 1;
                        tally.bytes += (to - from) as u64;
                        if !newline {
                            // Only the last line of a source lacks its newline.
                            add_newline = true;
                            tally.bytes += 1;
                        }
                        *pos += (to - from) as u64;
                        continue;
                    }
                    Verdict::Blank => {
                        *pos += (to - from) as u64;
                        continue;
                    }
                    Verdict::Invalid(why) => ((to - from) as u64, *newline, why.clone()),
                    Verdict::Unjudged => unreachable!("lines after an invalid one are not read"),
                }
            }
            Line::Bad {
                bytes,
                newline,
                why,
            } => (*bytes, *newline, why.clone()),
        };
        // The line at `lineno` (`raw` bytes) is not a record: it ends the source.
        let shown = &src.shown;
        let line_no = *lineno;
        if !newline {
            tally.dropped.push(Dropped {
                kind: DropKind::Torn,
                line: line_no,
                bytes: raw,
                reason: why.clone(),
            });
            tally.problems.push(format!(
                "{shown}:{line_no}: torn last record dropped ({raw} bytes, no trailing newline, not valid JSON: {why})"
            ));
        } else if src.committed {
            return Err(AggregateError::Corrupt {
                rank: src.rank,
                path: src.path.clone(),
                line: line_no,
                reason: why,
            });
        } else {
            let rest = src.len.saturating_sub(*pos).max(raw);
            tally.dropped.push(Dropped {
                kind: DropKind::Invalid,
                line: line_no,
                bytes: rest,
                reason: why.clone(),
            });
            tally.problems.push(format!(
                "{shown}:{line_no}: not valid JSON ({why}); stopped reading this partial file there ({rest} bytes from line {line_no} to the end dropped)"
            ));
        }
        ended = true;
        break;
    }
    b.data.truncate(kept);
    if add_newline {
        b.data.push(b'\n');
    }
    Ok(ended)
}

/// Errors reported this close to the end of a prefix may be artefacts of the cut (e.g. a
/// number cut after its `-`), so they do not prove the whole line invalid.
const PREFIX_MARGIN: usize = 16;

/// Whether the line `text` (not blank) is a record at `check`'s level. A line without its
/// newline (the last of its source: where a writer that died stopped) is parsed as JSON
/// at every level. `clean`: `text` is known to be UTF-8 without NUL.
fn check_line(text: &[u8], newline: bool, check: Check, clean: bool) -> Result<(), String> {
    match check.level {
        _ if !newline => validate(text, check.strict),
        Validate::Json => validate(text, check.strict),
        Validate::None => Ok(()),
        Validate::Utf8 => {
            if !clean {
                utf8_without_nul(text)?;
            }
            let first = text.iter().position(|c| !c.is_ascii_whitespace());
            let last = text.iter().rposition(|c| !c.is_ascii_whitespace());
            let (Some(first), Some(last)) = (first, last) else {
                return Ok(());
            };
            let close = match text[first] {
                b'{' => b'}',
                b'[' => b']',
                // A number, string or literal: short, so parsed in full.
                _ => return validate(text, check.strict),
            };
            if last == first || text[last] != close {
                return Err(format!(
                    "starts with `{}` but does not end with `{}` (byte {})",
                    text[first] as char,
                    close as char,
                    last + 1
                ));
            }
            Ok(())
        }
    }
}

/// `text` is UTF-8 and holds no NUL byte (JSON has none; a crash can leave zero-filled
/// blocks in a file).
fn utf8_without_nul(text: &[u8]) -> Result<(), String> {
    if let Err(e) = simdutf8::compat::from_utf8(text) {
        return Err(format!("invalid UTF-8 at byte {}", e.valid_up_to() + 1));
    }
    match memchr::memchr(0, text) {
        Some(i) => Err(format!("NUL byte at byte {}", i + 1)),
        None => Ok(()),
    }
}

/// Whether a prefix of a line (more bytes follow) already proves the line invalid at
/// `check`'s level (at level `none` nothing does: any line that ends is a record).
fn prefix_invalid(prefix: &[u8], check: Check) -> Option<String> {
    let strict = check.strict;
    if check.level == Validate::None {
        return None;
    }
    if let Err(e) = simdutf8::compat::from_utf8(prefix) {
        if e.error_len().is_some() {
            return Some(format!("invalid UTF-8 at byte {}", e.valid_up_to() + 1));
        }
    }
    if check.level == Validate::Utf8 {
        if let Some(i) = memchr::memchr(0, prefix) {
            return Some(format!("NUL byte at byte {}", i + 1));
        }
        // A line that starts like an object or array is checked at its end only.
        if let Some(&c) = prefix.iter().find(|c| !c.is_ascii_whitespace()) {
            if c == b'{' || c == b'[' {
                return None;
            }
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

    fn xxh3(bytes: &[u8]) -> String {
        format!("xxh3-128:{}", JSONL_DIGEST.hex_of(bytes))
    }

    /// Scan `bytes` as one source file: what was merged from it, and its entry.
    fn scan_bytes(
        bytes: &[u8],
        committed: bool,
        o: &MergeOptions,
    ) -> Result<(Vec<u8>, RankEntry), AggregateError> {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("rank-0.jsonl"), bytes).unwrap();
        let e = entry(0, committed);
        let mut entries = [e];
        let out = merge_sources(
            &crate::store::Fs,
            Vec::new(),
            Path::new("tmp"),
            d.path(),
            &mut entries,
            o,
            &mut || {},
        )?;
        let [e] = entries;
        assert_eq!(e.digest, Some(xxh3(&out)));
        assert_eq!(e.bytes, out.len() as u64);
        Ok((out, e))
    }

    const DEFAULT: u64 = super::super::DEFAULT_MAX_RECORD_BYTES;

    /// Merged bytes, records, and the drop (kind, line, bytes) if any.
    type Modelled = (Vec<u8>, u64, Option<(DropKind, u64, u64)>);

    /// What the merge of one source must give, line by line as documented (the model the
    /// pipeline is checked against): merged bytes, records, and the drop or the line of a
    /// corrupt committed source.
    fn model(bytes: &[u8], committed: bool, cap: u64, check: Check) -> Result<Modelled, u64> {
        let mut out = Vec::new();
        let (mut records, mut pos, mut lineno) = (0, 0u64, 0u64);
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            lineno += 1;
            let newline = line.ends_with(b"\n");
            // A line longer than the cap is not a record, blank or not.
            let within = (line.len() - usize::from(newline)) as u64 <= cap;
            if within && line.iter().all(|b| b.is_ascii_whitespace()) {
            } else if within && check_line(line, newline, check, false).is_ok() {
                out.extend_from_slice(line);
                if !newline {
                    out.push(b'\n');
                }
                records += 1;
            } else if !newline {
                return Ok((
                    out,
                    records,
                    Some((DropKind::Torn, lineno, line.len() as u64)),
                ));
            } else if committed {
                return Err(lineno);
            } else {
                let rest = bytes.len() as u64 - pos;
                return Ok((out, records, Some((DropKind::Invalid, lineno, rest))));
            }
            pos += line.len() as u64;
        }
        Ok((out, records, None))
    }

    fn entry(rank: u32, committed: bool) -> RankEntry {
        RankEntry {
            rank,
            status: if committed {
                RankStatus::Complete
            } else {
                RankStatus::Partial
            },
            source: Some(format!("rank-{rank}.jsonl")),
            source_bytes: 0,
            offset: 0,
            records: 0,
            bytes: 0,
            digest: None,
            sha256: None,
            dropped: vec![],
            set_aside: vec![],
            adopted: None,
            problems: vec![],
            reason: None,
        }
    }

    /// Merge `sources` (bytes, committed) with blocks of `block` bytes; a source given as
    /// `None` is a missing rank.
    fn merge_all(
        sources: &[Option<(Vec<u8>, bool)>],
        block: usize,
        cap: u64,
        level: Validate,
    ) -> Result<(Vec<u8>, Vec<RankEntry>), AggregateError> {
        let d = tempfile::tempdir().unwrap();
        let mut entries = Vec::new();
        for (rank, s) in sources.iter().enumerate() {
            let mut e = entry(rank as u32, s.as_ref().is_some_and(|s| s.1));
            match s {
                Some((bytes, _)) => {
                    std::fs::write(d.path().join(format!("rank-{rank}.jsonl")), bytes).unwrap()
                }
                None => {
                    e.status = RankStatus::Missing;
                    e.source = None;
                }
            }
            entries.push(e);
        }
        let out = merge_in_blocks(
            &crate::store::Fs,
            block,
            Vec::new(),
            Path::new("tmp"),
            d.path(),
            &mut entries,
            &MergeOptions {
                max_record_bytes: cap,
                validate: level,
                ..opts()
            },
            &mut || {},
        )?;
        Ok((out, entries))
    }

    /// Check a merge of `sources` against the model, source by source.
    fn check_against_model(
        sources: &[Option<(Vec<u8>, bool)>],
        block: usize,
        cap: u64,
        level: Validate,
    ) {
        let check = Check {
            level,
            strict: false,
        };
        let mut want = Vec::new();
        let mut corrupt = None;
        for (rank, s) in sources.iter().enumerate() {
            let Some((bytes, committed)) = s else {
                continue;
            };
            match model(bytes, *committed, cap, check) {
                Ok(m) => want.push((rank, m)),
                Err(line) => {
                    corrupt = Some((rank, line));
                    break;
                }
            }
        }
        let got = merge_all(sources, block, cap, level);
        if let Some((rank, line)) = corrupt {
            match got {
                Err(AggregateError::Corrupt {
                    rank: r, line: l, ..
                }) => assert_eq!((r as usize, l), (rank, line)),
                other => panic!(
                    "rank {rank} line {line} should be corrupt: {:?}",
                    other.map(|o| o.0.len())
                ),
            }
            return;
        }
        let (out, entries) = got.unwrap();
        let mut whole = Vec::new();
        for (rank, (bytes, records, drop)) in want {
            let e = &entries[rank];
            assert_eq!(e.offset, whole.len() as u64, "rank {rank}");
            assert_eq!(
                (e.records, e.bytes),
                (records, bytes.len() as u64),
                "rank {rank}"
            );
            assert_eq!(e.digest, Some(xxh3(&bytes)), "rank {rank}");
            let dropped: Vec<_> = e
                .dropped
                .iter()
                .map(|d| (d.kind, d.line, d.bytes))
                .collect();
            assert_eq!(dropped, drop.into_iter().collect::<Vec<_>>(), "rank {rank}");
            whole.extend_from_slice(&bytes);
        }
        assert_eq!(out, whole);
    }

    /// `n` records of about 100 bytes each, numbered from `from`.
    fn records(from: usize, n: usize) -> Vec<u8> {
        (from..from + n)
            .map(|i| format!("{{\"i\": {i}, \"text\": \"{}\"}}\n", "é→x".repeat(i % 30)))
            .collect::<String>()
            .into_bytes()
    }

    #[test]
    fn many_blocks_of_several_sources_come_out_in_order_with_their_accounting() {
        let mut partial = records(0, 5000);
        partial.extend_from_slice(b"{\"cut\": \n");
        partial.extend(records(5000, 5000));
        let mut committed = records(10_000, 3000);
        committed.extend_from_slice(b"\n  \n");
        committed.extend(records(13_000, 3000));
        committed.extend_from_slice(b"[\"no newline\"]");
        let torn = [records(20_000, 4000), b"{\"torn\": [1,".to_vec()].concat();
        let sources = vec![
            Some((committed.clone(), true)),
            None,
            Some((partial, false)),
            Some((torn, false)),
            Some((committed, true)),
        ];
        for block in [1 << 20, 4096, 100] {
            for level in [Validate::Json, Validate::Utf8, Validate::None] {
                check_against_model(&sources, block, DEFAULT, level);
            }
        }
    }

    #[test]
    fn a_corrupt_line_deep_in_a_committed_source_fails_the_merge_at_its_line() {
        let mut bad = records(0, 8000);
        bad.extend_from_slice(b"not json\n");
        bad.extend(records(8000, 100));
        let sources = vec![Some((records(0, 10), true)), Some((bad, true))];
        for block in [1 << 20, 4096] {
            for level in [Validate::Json, Validate::Utf8, Validate::None] {
                check_against_model(&sources, block, DEFAULT, level);
            }
        }
        match merge_all(&sources, 4096, DEFAULT, Validate::Utf8).unwrap_err() {
            AggregateError::Corrupt { rank, line, .. } => assert_eq!((rank, line), (1, 8001)),
            e => panic!("{e}"),
        }
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
            e.problems[0].contains("rank-0.jsonl:3: torn last record"),
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
        assert!(e.problems[0].contains("rank-0.jsonl:3: not valid JSON"));
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

    /// What each level catches (the line ends a partial source) and lets through (the
    /// line is merged), line by line, between two good records.
    #[test]
    fn each_level_catches_what_it_promises_and_lets_through_what_it_does_not_check() {
        use Validate::{Json, None as Lines, Utf8};
        let cases: [(&[u8], &[Validate]); 8] = [
            // (the middle line, the levels that refuse it)
            (b"{\"a\": 1, \"b\"}", &[Json]),
            (b"[1, 2,, 3]", &[Json]),
            (b"{\"a\": \"\xff\"}", &[Json, Utf8]),
            (b"{\"a\": \x00\x00\x00 1}", &[Json, Utf8]),
            (b"{\"a\": 1, \"b\": [1", &[Json, Utf8]),
            (b"\x00\x00\x00\x00", &[Json, Utf8]),
            (b"garbage", &[Json, Utf8]),
            (b"\"a string\" 5", &[Json, Utf8]),
        ];
        for (line, refused_by) in cases {
            let bytes = [&b"{\"r\":0}\n"[..], line, b"\n{\"r\":2}\n"].concat();
            for level in [Json, Utf8, Lines] {
                let o = MergeOptions {
                    validate: level,
                    ..opts()
                };
                let (out, e) = scan_bytes(&bytes, false, &o).unwrap();
                let shown = String::from_utf8_lossy(line);
                if refused_by.contains(&level) {
                    assert_eq!(out, b"{\"r\":0}\n", "{level:?} lets {shown:?} through");
                    assert_eq!(
                        (e.dropped[0].kind, e.dropped[0].line),
                        (DropKind::Invalid, 2)
                    );
                } else {
                    assert_eq!(out, bytes, "{level:?} refuses {shown:?}");
                    assert!(e.dropped.is_empty());
                }
            }
        }
        // A torn last line is caught at every level, brackets or not, and a complete one kept.
        for level in [Json, Utf8, Lines] {
            let o = MergeOptions {
                validate: level,
                ..opts()
            };
            for torn in [
                &b"{\"r\":1, \"x\": {\"y\": 2}"[..],
                b"{\"r\":1, \"b\"}",
                b"\x00\x00",
            ] {
                let bytes = [&b"{\"r\":0}\n"[..], torn].concat();
                let (out, e) = scan_bytes(&bytes, false, &o).unwrap();
                assert_eq!(out, b"{\"r\":0}\n", "{level:?}");
                assert_eq!(e.dropped[0].kind, DropKind::Torn, "{level:?}");
            }
            let (out, _) = scan_bytes(b"{\"r\":0}\n{\"r\":1}", false, &o).unwrap();
            assert_eq!(out, b"{\"r\":0}\n{\"r\":1}\n", "{level:?}");
        }
        // At level utf8 a bracketed line in a committed shard is not parsed; garbage is.
        let utf8 = opts();
        assert!(scan_bytes(b"{\"a\": nan}\n", true, &utf8).is_ok());
        assert!(matches!(
            scan_bytes(b"nan\n", true, &utf8),
            Err(AggregateError::Corrupt { line: 1, .. })
        ));
    }

    /// An output that copies in the kernel like the merged file does, and counts it.
    struct Counting {
        f: File,
        copied: u64,
    }

    impl Write for Counting {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.f.write(b)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.f.flush()
        }
    }

    impl Output for Counting {
        fn copy(&mut self, src: &File, offset: u64, len: u64) -> io::Result<bool> {
            let copied = self.f.copy(src, offset, len)?;
            self.copied += if copied { len } else { 0 };
            Ok(copied)
        }
    }

    #[test]
    fn on_a_real_file_the_records_are_copied_in_the_kernel_around_what_is_dropped() {
        let d = tempfile::tempdir().unwrap();
        let mut committed = records(0, 3000);
        committed.extend_from_slice(b"\n  \n");
        committed.extend(records(3000, 2000));
        committed.extend_from_slice(b"[\"no newline\"]");
        let partial = [records(5000, 1000), b"{\"torn\": [1,".to_vec()].concat();
        let mut entries = Vec::new();
        for (rank, (bytes, done)) in [(&committed, true), (&partial, false)]
            .into_iter()
            .enumerate()
        {
            std::fs::write(d.path().join(format!("rank-{rank}.jsonl")), bytes).unwrap();
            entries.push(entry(rank as u32, done));
        }
        let out = Counting {
            f: File::create(d.path().join("merged")).unwrap(),
            copied: 0,
        };
        let out = merge_in_blocks(
            &crate::store::Fs,
            4096,
            out,
            Path::new("tmp"),
            d.path(),
            &mut entries,
            &opts(),
            &mut || {},
        )
        .unwrap();
        drop(out.f);
        let merged = std::fs::read(d.path().join("merged")).unwrap();
        let check = Check::of(&opts());
        let (want0, ..) = model(&committed, true, DEFAULT, check).unwrap();
        let (want1, ..) = model(&partial, false, DEFAULT, check).unwrap();
        assert_eq!(merged, [want0.clone(), want1.clone()].concat());
        // Everything but the newline added to the committed shard's last record.
        assert_eq!(out.copied, merged.len() as u64 - 1);
        assert_eq!(entries[0].digest, Some(xxh3(&want0)));
        assert_eq!(entries[1].digest, Some(xxh3(&want1)));
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
            for level in [Validate::Json, Validate::Utf8, Validate::None] {
                let check = Check { level, strict: true };
                prop_assert_eq!(prefix_invalid(&bytes[..k], check), None);
            }
        }

        /// Whatever the lines and however they fall into blocks, the pipeline merges what
        /// the line-by-line model says, with the same counts, drops and hashes.
        #[test]
        fn the_pipeline_merges_what_the_line_model_says(
            sources in prop::collection::vec(
                (prop::collection::vec(prop_oneof![
                    4 => json_value().prop_map(|v| format!("{v}\n")),
                    1 => Just("\n".to_string()),
                    1 => Just(" \t\n".to_string()),
                    1 => Just("{\"a\": 1\n".to_string()),
                    1 => Just("[NaN, Infinity]\n".to_string()),
                ], 0..40),
                prop_oneof![Just(""), Just("[1"), Just("[1]"), Just("  ")],
                any::<bool>(),
                any::<bool>()),
                1..4),
            block in 1usize..400,
            cap in prop_oneof![Just(DEFAULT), 0u64..40],
            level in prop_oneof![Just(Validate::Json), Just(Validate::Utf8), Just(Validate::None)],
        ) {
            let sources: Vec<_> = sources
                .into_iter()
                .map(|(lines, tail, committed, missing)| {
                    (!missing).then(|| ([lines.concat().into_bytes(), tail.as_bytes().to_vec()].concat(), committed))
                })
                .collect();
            check_against_model(&sources, block, cap, level);
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
