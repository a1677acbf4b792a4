//! `rl-node doctor --nodes N`: what only several nodes can measure of a shared directory,
//! run by one doctor per node that meet in `DIR/.rl-node/doctor/<session>/`
//! (docs/shared-directory.md, "Checking a filesystem").
//!
//! The ranks talk only through files there, as rl-node's nodes do: each rank claims
//! `rank-R.json` by exclusive create and from then on rewrites it (rename over) with its
//! latest message, stamped with a position that only grows. A rank waits for a peer by
//! re-reading the peer's file until its position reaches the one expected; every wait ends
//! at `--timeout` without progress from that peer, and a rank that fails says so in its
//! file (an abort position beyond every other), so no rank waits for a dead one for long.
//!
//! The ordered pairs (writer, observer) are measured in a round-robin order that every rank
//! follows, so pairs of distinct ranks run at the same time and none can wait for another
//! in a cycle. Per pair, K rewrite samples one after the other: the writer rewrites its
//! file (ping), the observer answers (pong). Then the K new-name samples at once, so that
//! a pair waits out the observer's negative-lookup cache once rather than K times: the
//! observer looks up K names that do not exist yet (priming its cache for each) and
//! answers; the writer creates the K names, and the observer polls each until it appears,
//! timing each on its own, then acknowledges. Every step is said on stderr (a session on
//! a default NFS mount lasts minutes). Clocks are not trusted: the round trip is measured on the
//! writer's monotonic clock, the clock offset of each pair is taken NTP-style from the
//! exchange with the shortest round trip, and one-way latencies are wall-clock differences
//! corrected by that offset (uncertain by at most half that round trip). The new name's
//! delay is also given from the observer's miss, on its own monotonic clock alone.

use super::doctor_dirs::DirWait;
use super::doctor_report::{Check, Verdict};
use crate::error::{Cause, Failure};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often a waiting rank re-reads a peer's file or looks up the awaited name: the
/// resolution of every latency measured. Every 2 ms for the first 200 ms of a wait, then
/// every 10 ms: a wait that long is a cache's, measured well enough at 1 %, and a
/// server polled 500 times a second by every waiting rank for seconds would notice.
const POLL: Duration = Duration::from_millis(2);
const POLL_SLOW: Duration = Duration::from_millis(10);
const FAST_FOR: Duration = Duration::from_millis(200);

/// Sleeps until the next poll of a wait begun at `start`.
fn pause(start: Instant) {
    std::thread::sleep(if start.elapsed() < FAST_FOR {
        POLL
    } else {
        POLL_SLOW
    });
}
/// How often a rank waiting long says so on stderr.
const NOTE_EVERY: Duration = Duration::from_secs(10);
/// How often a rank polling a new name also reads its writer's file for an abort.
const ABORT_CHECK: Duration = Duration::from_millis(200);
/// How long a failing rank waits for its peers to see its abort before removing its files.
const LEAVE_GRACE: Duration = Duration::from_secs(5);
/// Above these, the cross-node checks warn.
const SLOW_REWRITE: Duration = Duration::from_secs(1);
const SLOW_NEW_NAME: Duration = Duration::from_secs(1);

/// The most ranks a session takes: its pair schedule and per-rank tables grow as N².
pub(crate) const MAX_NODES: u32 = 10_000;

/// Above this, a record renamed over reads stale to another node: an entry cache.
const STALE_RENAME: Duration = Duration::from_millis(200);
/// How often the writer renames over its probe record while the observer watches it.
const STALE_PERIOD: Duration = Duration::from_millis(20);
/// The longest the observer watches that record for two refreshes of its view.
const STALE_WINDOW: Duration = Duration::from_secs(30);

/// Stages of a rank's messages; a position compares stage first.
const CLAIMED: u8 = 0;
const MEASURING: u8 = 1;
const DONE: u8 = 2;
const ABORTED: u8 = 3;
/// Steps of one sample. The observer says it has begun the pair (BEGIN, sample 0) before
/// the writer's first ping: the writer's clock must not run while the observer is still
/// busy with its previous pair.
const BEGIN: u8 = 0;
const PING: u8 = 1;
const PONG: u8 = 2;
const ACK: u8 = 3;

/// What the command line asked of a session.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub nodes: u32,
    pub rank: Option<u32>,
    pub session: String,
    pub samples: u32,
    pub timeout: Duration,
}

/// A rank's place in its sequence of messages: (stage, pair, sample, step).
type Pos = (u8, u32, u32, u8);

/// The content of `rank-R.json`: who holds the rank and its latest message.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Msg {
    session: String,
    nodes: u32,
    rank: u32,
    host: String,
    pid: u32,
    /// Rank 0's names the new names of this session, so that a client still caching a
    /// name of an earlier session of the same name cannot find it early.
    nonce: u32,
    pos: Pos,
    /// Pong: when the ping was seen, and when the pong was written (wall clock, ns).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pong: Option<(i64, i64)>,
    /// The directories this rank created (`.rl-node`, `.rl-node/doctor`), for the cleanup.
    #[serde(default)]
    created: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    done: Option<Done>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    abort: Option<String>,
    /// The abort's exit code: a peer that gave up waiting for the same missing rank is
    /// this rank's own deadline, not a peer's failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    abort_code: Option<i32>,
}

/// What a rank hands rank 0 at the end: its own checks and its raw samples.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Done {
    node: NodeSummary,
    /// As writer: t1 ping written, t2 ping seen, t3 pong written, t4 pong seen (wall, ns;
    /// t2 and t3 on the observer's clock), and the round trip on the writer's monotonic one.
    pings: Vec<PingSample>,
    /// As observer.
    names: Vec<NameSample>,
    /// As observer: the record its writer kept renaming over, as this rank read it.
    #[serde(default)]
    stale: Vec<StaleRead>,
    /// As writer: how regularly it renamed over that record.
    #[serde(default)]
    stale_writes: Vec<StaleWrite>,
    /// As observer: `mkdir` and `stat` of the directory its writer made.
    #[serde(default)]
    eexist: Vec<EexistSample>,
}

/// The observer's reading of a record its writer renames over every [`STALE_PERIOD`].
/// On its own monotonic clock: no clock offset enters it (a slow exchange, as under an
/// entry cache, makes offsets uncertain by half a second).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct StaleRead {
    writer: u32,
    /// The longest this rank kept reading one version, from one change of the version it
    /// read to the next (with fewer than two changes: since the last one, or the whole
    /// window). That version was current at its first read, so it was replaced within
    /// one gap of the writer's renames: it read stale for this less that gap, at least.
    longest_ns: u64,
    /// How many times the version read changed: two make one whole period of the view.
    changes: u32,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct StaleWrite {
    observer: u32,
    /// The longest time between two renames: a version lived at most this long.
    max_gap_ns: u64,
}

/// What `mkdir` and `stat` said of a directory another node had made.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub(crate) enum Eexist {
    /// EEXIST, and stat found it at once.
    Agreed,
    /// EEXIST while stat answered ENOENT, for `ms` (`still`: and after that, when the wait
    /// ended).
    Lied { ms: f64, still: bool },
    /// The probe could not tell.
    Unclear { why: String },
}

impl Eexist {
    /// How long stat did not see a directory mkdir said exists, if it did not.
    fn lied_ms(&self) -> Option<f64> {
        match self {
            Eexist::Lied { ms, .. } => Some(*ms),
            _ => None,
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct EexistSample {
    writer: u32,
    outcome: Eexist,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct PingSample {
    observer: u32,
    t: [i64; 4],
    rtt_ns: u64,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct NameSample {
    writer: u32,
    /// The writer's wall clock just before the rename that created the name.
    created_ns: i64,
    /// This rank's wall clock when it first found the name.
    seen_ns: i64,
    /// From this rank's failed lookup to its finding the name, on its monotonic clock.
    after_miss_ns: u64,
}

/// One rank's own (single-node) findings, as rank 0 shows them.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct NodeSummary {
    pub rank: u32,
    pub host: String,
    pub pid: u32,
    /// Filesystem type, mount point and options, as /proc/mounts of that node shows them.
    pub filesystem: Option<String>,
    /// What must be alike on every node: the type, the mount options and the cache
    /// delays they imply (not the mount point or the server's name for it).
    pub mount: Option<String>,
    /// The longest cache delay that node's mount options imply, seconds (known caches).
    pub options_visibility_secs: f64,
    /// The caches its options do not tell (`entry`, `negative`, `attribute`).
    #[serde(default)]
    pub options_unknown: Vec<String>,
    /// The mount options that turn that node's entry and negative caches off.
    #[serde(default)]
    pub entry_fix: String,
    #[serde(default)]
    pub negative_fix: String,
    /// MooseFS whose tools answered with a trash time: the session keeps no trash.
    #[serde(default)]
    pub keeps_trash: bool,
    pub slowest_fsync_ms: f64,
    pub failed: Vec<String>,
    pub warned: Vec<String>,
}

/// Median, max and min of some samples, in milliseconds.
#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
pub(crate) struct Stat {
    pub median_ms: f64,
    pub max_ms: f64,
    pub min_ms: f64,
    pub samples: usize,
}

impl Stat {
    fn of(mut v: Vec<f64>) -> Option<Stat> {
        // Sorts `v`, so its ends are the extremes.
        let median = crate::metrics::median(&mut v)?;
        let n = v.len();
        Some(Stat {
            median_ms: median,
            max_ms: v[n - 1],
            min_ms: v[0],
            samples: n,
        })
    }
}

/// Visibility from one node (writer) to another (observer).
#[derive(Serialize, Debug, Clone)]
pub(crate) struct PairReport {
    pub writer: u32,
    pub observer: u32,
    /// A file rewritten by rename over an existing name, until the observer reads the new
    /// content (offset-corrected).
    pub rewrite: Option<Stat>,
    /// A new name, from its creation until the observer finds it (offset-corrected).
    pub new_name: Option<Stat>,
    /// A new name, from the observer's failed lookup until it finds it (observer's clock
    /// only; includes the writer's reaction).
    pub new_name_after_miss: Option<Stat>,
    /// Ping + pong, on the writer's monotonic clock.
    pub round_trip: Option<Stat>,
    /// How long a record the writer renamed over stayed stale to the observer, at worst,
    /// over at least two refreshes of the observer's view: the observer's longest reading
    /// of one version less the writer's longest gap between renames, each on its own
    /// monotonic clock (no clock offset enters it).
    pub stale_rename_ms: Option<f64>,
    /// The observer saw fewer than two refreshes within the window: at least that long.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stale_at_least: bool,
    /// `mkdir` (EEXIST) then `stat` by the observer of a directory the writer made.
    pub eexist: Option<Eexist>,
}

/// How far rank `b`'s wall clock is ahead of rank `a`'s.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct Offset {
    pub a: u32,
    pub b: u32,
    pub offset_ms: f64,
    /// Half the shortest round trip: the offset is right within this.
    pub uncertainty_ms: f64,
}

/// The session part of a doctor's report.
#[derive(Serialize, Debug)]
pub(crate) struct SessionReport {
    pub session: String,
    pub nodes: u32,
    pub rank: u32,
    pub samples: u32,
    /// Every rank's own findings (rank 0's report; the others list only themselves).
    pub members: Vec<NodeSummary>,
    /// Rank 0's report only.
    pub pairs: Vec<PairReport>,
    pub clock_offsets: Vec<Offset>,
    /// For ranks other than 0: who prints the whole report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reported_by: Option<String>,
    pub method: &'static str,
}

const METHOD: &str = "ranks take turns per ordered pair (writer, observer), whose clock starts once the observer says it has begun the pair; per rewrite sample the writer rewrites its file by rename over (ping) and the observer answers (pong); for the new-name samples, all at once, the observer looks up one name per sample that does not exist yet, and a directory in the writer's probe directory, and reads the writer's probe record; the observer then makes `sig/primed` beside that directory, and the writer, as soon as a listing of `sig/` shows it, makes the directory and `sig/go`; once it has read the answer, the writer makes those names, and renames over the probe record every 20ms; the observer polls each name until found, timing each, takes mkdir then stat of the directory once a listing of `sig/` shows `go`, and reads the probe record until its view of it has been refreshed twice. Round trips are timed on the writer's monotonic clock; each pair's clock offset is taken NTP-style from its exchange with the shortest round trip; one-way latencies are wall-clock differences corrected by that offset (right within half that round trip); new_name_after_miss and the EEXIST-then-ENOENT time use the observer's clock alone, and the probe record's staleness the observer's longest reading of one version less the writer's longest gap between renames, each on its own monotonic clock";

/// What the measurements add to a report: the cross-node checks, the largest visibility
/// delay measured, and the slowest fsync and longest option-implied delay of any rank.
pub(crate) struct Outcome {
    pub checks: Vec<Check>,
    pub report: SessionReport,
    pub measured_visibility: Option<Duration>,
    pub options_visibility_secs: f64,
    /// The caches some node's options do not tell.
    pub options_unknown: Vec<String>,
    pub slowest_fsync: Duration,
}

/// The round-robin order of the ordered pairs: round r of the circle method gives ⌊n/2⌋
/// disjoint pairs, measured one way then the other. Every rank walks this list in order.
pub(crate) fn schedule(n: u32) -> Vec<(u32, u32)> {
    let m = n + n % 2; // a dummy rank evens out an odd count
    let mut ring: Vec<u32> = (0..m).collect();
    let mut out = Vec::new();
    for _ in 0..m.saturating_sub(1) {
        let round: Vec<(u32, u32)> = (0..m as usize / 2)
            .map(|i| (ring[i], ring[m as usize - 1 - i]))
            .filter(|&(a, b)| a < n && b < n)
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        out.extend(round.iter().copied());
        out.extend(round.iter().map(|&(a, b)| (b, a)));
        ring[1..].rotate_right(1);
    }
    out
}

/// Every rank's probe results, each with the rank that took it.
#[derive(Default)]
pub(crate) struct Probes {
    /// (observer, its reading)
    stale: Vec<(u32, StaleRead)>,
    /// (writer, its renames)
    stale_writes: Vec<(u32, StaleWrite)>,
    /// (observer, its probe)
    eexist: Vec<(u32, EexistSample)>,
}

/// Rank 0's reading of every rank's samples: per ordered pair, and the clock offsets.
pub(crate) fn analyse(
    n: u32,
    pings: &[(u32, PingSample)],
    names: &[(u32, NameSample)],
    probes: &Probes,
) -> (Vec<PairReport>, Vec<Offset>) {
    let ms = |ns: f64| ns / 1e6;
    // θ(b − a) for a < b, from the exchange with the shortest round trip either way.
    let mut offsets = Vec::new();
    let mut theta = std::collections::HashMap::new();
    for a in 0..n {
        for b in a + 1..n {
            let best = pings
                .iter()
                .filter(|(w, p)| (*w == a && p.observer == b) || (*w == b && p.observer == a))
                .map(|(w, p)| {
                    let [t1, t2, t3, t4] = p.t.map(|x| x as f64);
                    let th = ((t2 - t1) + (t3 - t4)) / 2.0; // observer − writer
                    let delay = ((t4 - t1) - (t3 - t2)).max(0.0);
                    (if *w == a { th } else { -th }, delay)
                })
                .min_by(|x, y| x.1.total_cmp(&y.1));
            if let Some((th, delay)) = best {
                theta.insert((a, b), th);
                offsets.push(Offset {
                    a,
                    b,
                    offset_ms: ms(th),
                    uncertainty_ms: ms(delay / 2.0),
                });
            }
        }
    }
    // How far o's clock is ahead of w's.
    let off = |w: u32, o: u32| -> f64 {
        if w < o {
            theta.get(&(w, o)).copied().unwrap_or(0.0)
        } else {
            -theta.get(&(o, w)).copied().unwrap_or(0.0)
        }
    };
    let mut pairs = Vec::new();
    for (w, o) in schedule(n) {
        let mine: Vec<&PingSample> = pings
            .iter()
            .filter(|(pw, p)| *pw == w && p.observer == o)
            .map(|(_, p)| p)
            .collect();
        let seen: Vec<&NameSample> = names
            .iter()
            .filter(|(po, s)| *po == o && s.writer == w)
            .map(|(_, s)| s)
            .collect();
        let read = probes
            .stale
            .iter()
            .find(|(po, r)| *po == o && r.writer == w);
        let wrote = probes
            .stale_writes
            .iter()
            .find(|(pw, s)| *pw == w && s.observer == o);
        let (stale_rename_ms, stale_at_least) = match (read, wrote) {
            // Read for that long, less the most it could have lived before its
            // replacement: what is left was read after the replacement.
            (Some((_, r)), Some((_, s))) => (
                Some(ms((r.longest_ns as f64 - s.max_gap_ns as f64).max(0.0))),
                r.changes < 2,
            ),
            _ => (None, false),
        };
        pairs.push(PairReport {
            writer: w,
            observer: o,
            rewrite: Stat::of(
                mine.iter()
                    .map(|p| ms((p.t[1] - p.t[0]) as f64 - off(w, o)).max(0.0))
                    .collect(),
            ),
            new_name: Stat::of(
                seen.iter()
                    .map(|s| ms((s.seen_ns - s.created_ns) as f64 - off(w, o)).max(0.0))
                    .collect(),
            ),
            new_name_after_miss: Stat::of(
                seen.iter().map(|s| ms(s.after_miss_ns as f64)).collect(),
            ),
            round_trip: Stat::of(mine.iter().map(|p| ms(p.rtt_ns as f64)).collect()),
            stale_rename_ms,
            stale_at_least,
            eexist: probes
                .eexist
                .iter()
                .find(|(po, e)| *po == o && e.writer == w)
                .map(|(_, e)| e.outcome.clone()),
        });
    }
    (pairs, offsets)
}

/// A duration for the progress lines: ms below a second, seconds below 2 minutes.
fn secs(d: Duration) -> String {
    match d.as_secs_f64() {
        s if s < 1.0 => super::doctor_report::ms(d),
        s if s < 120.0 => format!("{s:.2}s"),
        s => format!("{:.0} min", s / 60.0),
    }
}

fn wall_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// A rank's part in a session, from its claim to its cleanup.
struct Member {
    root: PathBuf,
    dir: PathBuf,
    opts: Options,
    me: Msg,
    /// Names this rank created in the session directory (its own file, the new names).
    own: Vec<PathBuf>,
    /// Every rank's last message read (rank 0 uses their `created` for the cleanup).
    peers: Vec<Option<Msg>>,
    /// The signal (SIGINT, SIGTERM, SIGHUP) that arrived during the session, or 0: every
    /// wait checks it, so that an interrupted rank tells the others and removes its files.
    signal: Arc<AtomicUsize>,
}

/// Runs this rank's part of the session; `summary` is its own single-node findings.
/// `left_dirs`: the parents (`.rl-node`, `doctor`) its single-node checks created and
/// could not remove, which the session's cleanup removes when empty. `wait`: how long a
/// directory another doctor made may stay unseen through this client's caches.
pub(crate) fn run(
    root: &Path,
    opts: Options,
    summary: NodeSummary,
    left_dirs: &[String],
    wait: &DirWait,
) -> Result<Outcome, Failure> {
    let mut m = Member::join(root, opts, summary.clone(), left_dirs, wait)?;
    let result = m.measure(summary);
    match result {
        Ok(outcome) => {
            m.finish(true);
            Ok(outcome)
        }
        Err(f) => {
            m.leave(Some(&f));
            Err(f)
        }
    }
}

impl Member {
    fn join(
        root: &Path,
        opts: Options,
        summary: NodeSummary,
        left_dirs: &[String],
        wait: &DirWait,
    ) -> Result<Member, Failure> {
        let base = root.join(".rl-node");
        let doctor = base.join("doctor");
        let dir = doctor.join(&opts.session);
        // No link someone planted at `.rl-node` or `doctor/` takes the session elsewhere.
        crate::store::beneath::confine(root);
        // The other ranks make the same directories at once, and their single-node checks
        // remove `doctor/` (and `.rl-node/`) they made: seen or waited for, made again.
        let mut made = Vec::new();
        super::doctor_dirs::make_dirs(
            &[base.clone(), doctor.clone(), dir.clone()],
            false,
            wait,
            &mut made,
        )?;
        let mut created = left_dirs.to_vec();
        for (d, name) in [(&base, ".rl-node"), (&doctor, "doctor")] {
            if made.contains(d) && !created.iter().any(|c| c == name) {
                created.push(name.to_string());
            }
        }
        if summary.keeps_trash {
            super::doctor_caches::no_trash(&dir);
        }
        let me = Msg {
            session: opts.session.clone(),
            nodes: opts.nodes,
            rank: 0,
            host: summary.host.clone(),
            pid: std::process::id(),
            nonce: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
                ^ std::process::id().rotate_left(16),
            pos: (CLAIMED, 0, 0, 0),
            pong: None,
            created,
            done: None,
            abort: None,
            abort_code: None,
        };
        let n = opts.nodes;
        let mut m = Member {
            root: root.to_path_buf(),
            dir,
            peers: vec![None; n as usize],
            opts,
            me,
            own: Vec::new(),
            signal: Arc::new(AtomicUsize::new(0)),
        };
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        for sig in [SIGINT, SIGTERM, SIGHUP] {
            // Without the handler, a signal only ends the session as a kill would.
            let _ = signal_hook::flag::register_usize(sig, Arc::clone(&m.signal), sig as usize);
        }
        let ranks: Vec<u32> = match m.opts.rank {
            Some(r) => vec![r],
            None => (0..n).collect(),
        };
        let mut holders = Vec::new();
        for r in ranks {
            m.me.rank = r;
            let path = m.file(r);
            // First writer wins (an exclusive create), and the claim appears whole.
            match store().create_new_live_json(&path, &m.me) {
                Ok(true) => {
                    m.own.push(path.clone());
                    break;
                }
                Ok(false) => {
                    holders.push(match read(&path) {
                        Some(h) => {
                            // Only on this host can a pid tell that its doctor is gone.
                            let gone = h.host == m.me.host
                                && !Path::new(&format!("/proc/{}", h.pid)).exists();
                            let gone = if gone { ", no longer running" } else { "" };
                            format!("rank {r} by {} pid {}{gone}", h.host, h.pid)
                        }
                        None => format!("rank {r}"),
                    });
                }
                Err(e) => {
                    m.leave(None);
                    return Err(Failure::failed(format!(
                        "cannot create {}: {e}",
                        path.display()
                    )));
                }
            }
        }
        if m.own.is_empty() {
            let what = match m.opts.rank {
                Some(r) => format!(
                    "--rank {r} of doctor session {} is already claimed",
                    m.opts.session
                ),
                None => format!(
                    "every rank of doctor session {} (--nodes {n}) is already claimed",
                    m.opts.session
                ),
            };
            let f = Failure::usage(
                format!("{what} ({})", holders.join(", ")),
                Some(format!(
                    "another doctor is using it, or one was killed and left it: pick another --session, or remove {}",
                    m.dir.display()
                )),
            );
            m.leave(None);
            return Err(f);
        }
        m.wait_all_joined().inspect_err(|f| m.leave(Some(f)))?;
        Ok(m)
    }

    fn file(&self, rank: u32) -> PathBuf {
        self.dir.join(format!("rank-{rank}.json"))
    }

    fn who(&self, rank: u32) -> String {
        match &self.peers[rank as usize] {
            Some(p) => format!("rank {rank} ({} pid {})", p.host, p.pid),
            None => format!("rank {rank}"),
        }
    }

    /// Rewrites this rank's file by rename over.
    fn send(&mut self) -> Result<(), Failure> {
        let path = self.file(self.me.rank);
        store().publish_live_json(&path, &self.me).map_err(|e| {
            // Rank 0 removes the session when it stops: that is why, not this rank.
            if e.kind() == ErrorKind::NotFound && self.session_gone() {
                self.session_removed()
            } else {
                Failure::failed(format!("cannot rewrite {}: {e}", path.display()))
            }
        })
    }

    /// Re-reads every rank's file until each holds a claim of this session, or the
    /// timeout passes without a new rank arriving.
    fn wait_all_joined(&mut self) -> Result<(), Failure> {
        let n = self.opts.nodes;
        let mut deadline = Instant::now() + self.opts.timeout;
        let started = Instant::now();
        let mut note = started + NOTE_EVERY;
        loop {
            let mut missing = Vec::new();
            let mut gave_up = None;
            for r in 0..n {
                let seen = self.peers[r as usize].is_some();
                if seen && r == self.me.rank {
                    continue;
                }
                // A rank already joined is read again each round: it may stop (an abort, a
                // Ctrl-C) while the others are awaited, and must not go unseen.
                match read(&self.file(r)) {
                    Some(p) => {
                        if p.nodes != n {
                            return Err(Failure::usage(
                                format!(
                                    "rank {r} of doctor session {} ({} pid {}) was started with --nodes {}, this one with --nodes {n}",
                                    self.opts.session, p.host, p.pid, p.nodes
                                ),
                                Some("start every node's doctor with the same --nodes".into()),
                            ));
                        }
                        if p.abort_code == Some(Cause::Deadline.exit_code()) {
                            gave_up = Some(p.clone());
                        } else {
                            self.check_peer(&p)?;
                        }
                        if !seen {
                            deadline = Instant::now() + self.opts.timeout;
                        }
                        self.peers[r as usize] = Some(p);
                    }
                    // Rank 0 removes the session when it fails, as the other waits watch.
                    None if seen && r == 0 && !self.dir.exists() => {
                        return Err(self.session_removed())
                    }
                    None if seen => {}
                    None => missing.push(r),
                }
            }
            if missing.is_empty() {
                return match gave_up {
                    Some(p) => self.check_peer(&p),
                    None => Ok(()),
                };
            }
            self.interrupted()?;
            // A peer that gave up waiting for the same ranks met this rank's deadline too.
            if Instant::now() >= deadline || gave_up.is_some() {
                let joined: Vec<String> = (0..n)
                    .filter(|r| self.peers[*r as usize].is_some())
                    .map(|r| self.who(r))
                    .collect();
                let list: Vec<String> = missing.iter().map(u32::to_string).collect();
                return Err(Failure::new(
                    Cause::Deadline,
                    format!(
                        "doctor session {}: rank{} {} never joined within {} (joined: {})",
                        self.opts.session,
                        if missing.len() > 1 { "s" } else { "" },
                        list.join(", "),
                        humantime::format_duration(self.opts.timeout),
                        joined.join(", ")
                    ),
                )
                .with_hint(format!(
                        "start `rl-node doctor --log-path DIR --nodes {n}` on every node within --timeout of each other (or raise --timeout)"
                    )));
            }
            if Instant::now() >= note {
                note += NOTE_EVERY;
                let list: Vec<String> = missing.iter().map(u32::to_string).collect();
                self.say(format!(
                    "waiting for rank{} {} to join ({} so far, --timeout {})",
                    if missing.len() > 1 { "s" } else { "" },
                    list.join(", "),
                    secs(started.elapsed()),
                    humantime::format_duration(self.opts.timeout)
                ));
            }
            std::thread::sleep(POLL_SLOW);
        }
    }

    /// Waits until `rank`'s position reaches `at`; returns its message. The timeout counts
    /// from the peer's last progress, so a peer busy with other pairs is waited for.
    fn wait(&mut self, rank: u32, at: Pos, what: &str) -> Result<Msg, Failure> {
        self.wait_doing(rank, at, what, |_| Ok(()))
    }

    /// As [`Member::wait`], calling `each` between two reads of the peer's file.
    fn wait_doing(
        &mut self,
        rank: u32,
        at: Pos,
        what: &str,
        mut each: impl FnMut(&mut Member) -> Result<(), Failure>,
    ) -> Result<Msg, Failure> {
        let path = self.file(rank);
        let mut last: Option<Pos> = None;
        let mut deadline = Instant::now() + self.opts.timeout;
        let started = Instant::now();
        let mut checked = Instant::now();
        let mut note = started + NOTE_EVERY;
        loop {
            if checked.elapsed() >= ABORT_CHECK {
                checked = Instant::now();
                self.watch_coordinator(rank)?;
            }
            if Instant::now() >= note {
                note += NOTE_EVERY;
                self.say(format!(
                    "still waiting for {} ({what}) after {}",
                    self.who(rank),
                    secs(started.elapsed())
                ));
            }
            if let Some(p) = read(&path) {
                self.check_peer(&p)?;
                if p.pos >= at {
                    self.peers[rank as usize] = Some(p.clone());
                    return Ok(p);
                }
                if last != Some(p.pos) {
                    last = Some(p.pos);
                    deadline = Instant::now() + self.opts.timeout;
                }
            }
            self.interrupted()?;
            if Instant::now() >= deadline {
                return Err(self.silent(rank, what));
            }
            each(self)?;
            pause(started);
        }
    }

    /// While waiting for `peer`, a look at rank 0 as well: a rank that fails stops its
    /// partners, they stop theirs, and rank 0 stops everyone else, who all watch it. Rank 0
    /// removes the session when it fails: that stops them too.
    fn watch_coordinator(&self, peer: u32) -> Result<(), Failure> {
        if self.me.rank == 0 || peer == 0 {
            return Ok(());
        }
        match read(&self.file(0)) {
            Some(p) => self.check_peer(&p),
            None if !self.dir.exists() => Err(self.session_removed()),
            None => Ok(()),
        }
    }

    /// Whether the session directory is gone, after a write in it found it missing. A
    /// client that caches lookups (FUSE) still sees a directory another client removed for
    /// its entry timeout: it is asked again until it agrees or the store's bound for a
    /// name such a cache keeps stale passes.
    fn session_gone(&self) -> bool {
        let bound = if store().caches_lookups(&self.dir) {
            crate::store::fs::INVISIBLE_WAIT
        } else {
            Duration::ZERO
        };
        let start = Instant::now();
        loop {
            if !self.dir.exists() {
                return true;
            }
            if start.elapsed() >= bound {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn session_removed(&self) -> Failure {
        Failure::new(
            Cause::PeerFailed,
            format!(
                "doctor session {}: the session directory {} was removed (by {}, stopping?)",
                self.opts.session,
                self.dir.display(),
                self.who(0)
            ),
        )
    }

    /// A signal that arrived ends this rank's part (exit 128 + signal).
    fn interrupted(&self) -> Result<(), Failure> {
        match self.signal.load(Ordering::Relaxed) {
            0 => Ok(()),
            sig => Err(Failure::new(
                Cause::Interrupted(sig as i32),
                format!(
                    "doctor session {}: rank {} interrupted by {}",
                    self.opts.session,
                    self.me.rank,
                    crate::process::signal_name(sig as i32)
                ),
            )),
        }
    }

    fn check_peer(&self, p: &Msg) -> Result<(), Failure> {
        match &p.abort {
            Some(why) if p.pos.0 == ABORTED => Err(Failure::new(
                Cause::PeerFailed,
                format!(
                    "doctor session {}: rank {} ({} pid {}) stopped: {why}",
                    self.opts.session, p.rank, p.host, p.pid
                ),
            )),
            _ => Ok(()),
        }
    }

    fn silent(&self, rank: u32, what: &str) -> Failure {
        Failure::new(
            Cause::Deadline,
            format!(
                "doctor session {}: {} made no progress for {} ({what})",
                self.opts.session,
                self.who(rank),
                humantime::format_duration(self.opts.timeout)
            ),
        )
        .with_hint("is its doctor still running? raise --timeout on a slow filesystem")
    }

    /// A line of progress on stderr (stdout holds the report): a session can last
    /// minutes, and must not look hung.
    fn say(&self, what: String) {
        crate::errln!("doctor session {}: {what}", self.opts.session);
    }

    /// Rank 0, after its first pair's new names: what the rest of the session will cost.
    /// `took`: how long `observer` took to find them; `elapsed` since the measurements
    /// began, over `done` of `rounds` rounds.
    fn estimate(
        &self,
        observer: u32,
        took: Duration,
        elapsed: Duration,
        done: usize,
        rounds: usize,
    ) {
        let left = elapsed.mul_f64((rounds - done) as f64 / done as f64);
        let why = if took >= SLOW_NEW_NAME {
            " (negative-lookup cache); NFS lookupcache=positive or FUSE negative_timeout=0 would shorten the session"
        } else {
            ""
        };
        self.say(format!(
            "a new name takes about {} to be seen by rank {observer}{why}; the session will take about {} more ({} of {rounds} rounds left)",
            secs(took),
            secs(left),
            rounds - done
        ));
    }

    /// The observer's lookup that misses a new name before its writer creates it.
    fn miss(&self, name: &Path) -> Result<(), Failure> {
        match fs::metadata(name) {
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Ok(_) => Err(Failure::failed(format!(
                "{} exists before its writer created it: another doctor in session {}?",
                name.display(),
                self.opts.session
            ))),
            Err(e) => Err(Failure::failed(format!(
                "cannot look up {}: {e}",
                name.display()
            ))),
        }
    }

    fn measure(&mut self, mut summary: NodeSummary) -> Result<Outcome, Failure> {
        let me = self.me.rank;
        summary.rank = me;
        let (mut pings, mut names) = (Vec::new(), Vec::new());
        let (mut stale, mut stale_writes, mut eexist) = (Vec::new(), Vec::new(), Vec::new());
        let k_all = self.opts.samples;
        let schedule = schedule(self.opts.nodes);
        // ⌊N/2⌋ pairs run at once: a round.
        let per_round = (self.opts.nodes / 2).max(1) as usize;
        let rounds = schedule.len().div_ceil(per_round);
        let started = Instant::now();
        self.say(format!(
            "{} nodes, {k_all} samples per ordered pair, {rounds} rounds; this is rank {me}",
            self.opts.nodes
        ));
        let mut estimated = me != 0;
        for (pi, (w, o)) in schedule.into_iter().enumerate() {
            if w != me && o != me {
                continue;
            }
            let round = format!("round {}/{rounds}: rank {w} → rank {o}", pi / per_round + 1);
            let at = |k, step| (MEASURING, pi as u32, k, step);
            // The pair's clock starts once both have begun it: the observer may still be
            // busy with its previous pair, which is no part of a rewrite's delay.
            if o == me {
                self.me.pos = at(0, BEGIN);
                self.me.pong = None;
                self.send()?;
            } else {
                self.wait(o, at(0, BEGIN), &format!("it to begin rank {w} → rank {o}"))?;
            }
            // Rewrites, one after the other: each is seen within a poll or an attribute
            // cache, so they are quick.
            for k in 0..k_all {
                if w == me {
                    self.me.pos = at(k, PING);
                    self.me.pong = None;
                    let t1 = wall_ns();
                    let start = Instant::now();
                    self.send()?;
                    let what = format!("its answer to ping {k} of rank {w} → rank {o}");
                    let pong = self.wait(o, at(k, PONG), &what)?;
                    let (t4, rtt) = (wall_ns(), start.elapsed());
                    let Some((t2, t3)) = pong.pong.filter(|_| pong.pos == at(k, PONG)) else {
                        return Err(Failure::failed(format!(
                            "doctor session {}: rank {o} skipped sample {k} of rank {w} → rank {o} (is another doctor using rank {o}?)",
                            self.opts.session
                        )));
                    };
                    pings.push(PingSample {
                        observer: o,
                        t: [t1, t2, t3, t4],
                        rtt_ns: rtt.as_nanos() as u64,
                    });
                    self.say(format!(
                        "{round}: rewrite {}/{k_all}: seen and answered after {} (round trip)",
                        k + 1,
                        secs(rtt)
                    ));
                } else {
                    self.wait(
                        w,
                        at(k, PING),
                        &format!("its ping {k} of rank {w} → rank {o}"),
                    )?;
                    let t2 = wall_ns();
                    self.me.pos = at(k, PONG);
                    self.me.pong = Some((t2, wall_ns()));
                    self.send()?;
                }
            }
            // New names, all K at once (step K): each one a name of its own that the
            // observer looked up and missed before its writer created it, and whose
            // delay is measured on its own; taking them together waits out the
            // negative-lookup cache once per pair instead of K times. The two probes of
            // the caches run meanwhile, at no extra wait.
            let (observer, took) = if w == me {
                let (took, writes) = self.names_as_writer(pi, w, o, &round)?;
                stale_writes.push(writes);
                (o, took)
            } else {
                let (found, read, probe) = self.names_as_observer(pi, w, o, &round)?;
                let took = found
                    .iter()
                    .map(|s: &NameSample| Duration::from_nanos(s.after_miss_ns))
                    .max()
                    .unwrap_or_default();
                names.extend(found);
                stale.push(read);
                eexist.push(probe);
                (me, took)
            };
            if !estimated {
                estimated = true;
                let done = pi / per_round + 1;
                self.estimate(observer, took, started.elapsed(), done, rounds);
            }
        }
        self.say(format!(
            "rank {me}'s measurements done after {}",
            secs(started.elapsed())
        ));
        self.me.pos = (DONE, 0, 0, 0);
        self.me.done = Some(Done {
            node: summary,
            pings,
            names,
            stale,
            stale_writes,
            eexist,
        });
        self.send()?;
        self.outcome()
    }

    /// After this rank's measurements: rank 0 collects every rank's results and reads
    /// them; the others report their own checks only.
    fn outcome(&mut self) -> Result<Outcome, Failure> {
        let (me, n) = (self.me.rank, self.opts.nodes);
        let mut members = Vec::new();
        let mut all_pings = Vec::new();
        let mut all_names = Vec::new();
        let mut probes = Probes::default();
        let mut reported_by = None;
        if me == 0 {
            for r in 0..n {
                let msg = if r == 0 {
                    self.me.clone()
                } else {
                    self.wait(r, (DONE, 0, 0, 0), "its results")?
                };
                let Some(d) = msg.done else {
                    return Err(Failure::failed(format!(
                        "doctor session {}: rank {r} ended without results",
                        self.opts.session
                    )));
                };
                members.push(d.node);
                all_pings.extend(d.pings.into_iter().map(|p| (r, p)));
                all_names.extend(d.names.into_iter().map(|s| (r, s)));
                probes.stale.extend(d.stale.into_iter().map(|s| (r, s)));
                probes
                    .stale_writes
                    .extend(d.stale_writes.into_iter().map(|s| (r, s)));
                probes.eexist.extend(d.eexist.into_iter().map(|s| (r, s)));
            }
        } else {
            members.push(self.me.done.as_ref().expect("set above").node.clone());
            reported_by = Some(self.who(0));
        }
        let (pairs, clock_offsets) = if me == 0 {
            analyse(n, &all_pings, &all_names, &probes)
        } else {
            (Vec::new(), Vec::new())
        };
        let checks = if me == 0 {
            cross_checks(&members, &pairs, &clock_offsets)
        } else {
            Vec::new()
        };
        let measured_visibility = pairs
            .iter()
            .flat_map(|p| {
                [p.rewrite, p.new_name]
                    .into_iter()
                    .flatten()
                    .map(|s| s.max_ms)
                    .chain(p.stale_rename_ms)
                    .chain(p.eexist.as_ref().and_then(Eexist::lied_ms))
            })
            .max_by(f64::total_cmp)
            .map(|ms| Duration::from_secs_f64(ms / 1000.0));
        Ok(Outcome {
            checks,
            measured_visibility,
            options_visibility_secs: members
                .iter()
                .map(|m| m.options_visibility_secs)
                .fold(0.0, f64::max),
            options_unknown: {
                let mut u: Vec<String> = members
                    .iter()
                    .flat_map(|m| m.options_unknown.iter().cloned())
                    .collect();
                u.sort();
                u.dedup();
                u
            },
            slowest_fsync: Duration::from_secs_f64(
                members
                    .iter()
                    .map(|m| m.slowest_fsync_ms)
                    .fold(0.0, f64::max)
                    / 1000.0,
            ),
            report: SessionReport {
                session: self.opts.session.clone(),
                nodes: n,
                rank: me,
                samples: self.opts.samples,
                members,
                pairs,
                clock_offsets,
                reported_by,
                method: METHOD,
            },
        })
    }

    fn name(&self, w: u32, o: u32, k: u32) -> PathBuf {
        let nonce = self.peers[0].as_ref().map_or(0, |p| p.nonce);
        self.dir.join(format!("new-{nonce:08x}-{w}-{o}-{k}"))
    }

    /// Creates the observer's new name whole (written aside, renamed into place), holding
    /// the wall time just before the rename.
    fn create_name(&mut self, w: u32, o: u32, k: u32) -> Result<(), Failure> {
        let name = self.name(w, o, k);
        let tmp = self.dir.join(format!(
            ".{}.tmp",
            name.file_name().expect("a name").to_string_lossy()
        ));
        self.own.push(tmp.clone());
        self.own.push(name.clone());
        crate::store::fs::create_file(&tmp)
            .and_then(|mut f| {
                f.write_all(wall_ns().to_string().as_bytes())?;
                drop(f);
                crate::store::fs::rename(&tmp, &name)
            })
            .map_err(|e| Failure::failed(format!("cannot create {}: {e}", name.display())))
    }

    /// The writer's probe directory of pair `w` → `o` (the observer's EEXIST probe is a
    /// directory made in it), and its record renamed over (the staleness probe).
    fn probe_paths(&self, w: u32, o: u32) -> (PathBuf, PathBuf) {
        let nonce = self.peers[0].as_ref().map_or(0, |p| p.nonce);
        (
            self.dir.join(format!("p-{nonce:08x}-{w}-{o}")),
            self.dir.join(format!("stale-{nonce:08x}-{w}-{o}")),
        )
    }

    /// Replaces the probe record by `version`; returns the instant just before.
    fn rename_stale(&mut self, record: &Path, version: u32) -> Result<Instant, Failure> {
        let tmp = record.with_extension("tmp");
        if version == 0 {
            self.own.push(tmp.clone());
            self.own.push(record.to_path_buf());
        }
        let fail = |e: std::io::Error| {
            Failure::failed(format!("cannot rename over {}: {e}", record.display()))
        };
        let mut f = crate::store::fs::create_file(&tmp).map_err(fail)?;
        let t = Instant::now();
        f.write_all(version.to_string().as_bytes()).map_err(fail)?;
        drop(f);
        crate::store::fs::rename(&tmp, record).map_err(fail)?;
        Ok(t)
    }

    /// The writer's part of a pair's new names and probes: make the probe directory and
    /// record, and once the observer has looked up what does not exist yet, make the
    /// directory it probes and the new names, then rename over the record every
    /// [`STALE_PERIOD`] until the observer acknowledges. How long that took, and how
    /// regular the renames were.
    fn names_as_writer(
        &mut self,
        pi: usize,
        w: u32,
        o: u32,
        round: &str,
    ) -> Result<(Duration, StaleWrite), Failure> {
        let k_all = self.opts.samples;
        let at = |k, step| (MEASURING, pi as u32, k, step);
        let (probe, record) = self.probe_paths(w, o);
        let sig = probe.join("sig");
        for d in [&probe, &sig] {
            self.own.push(d.clone());
            crate::store::fs::create_dir(d)
                .map_err(|e| Failure::failed(format!("cannot create {}: {e}", d.display())))?;
        }
        let mut version = 0;
        let mut renamed = self.rename_stale(&record, version)?;
        self.me.pos = at(k_all, PING);
        self.me.pong = None;
        self.send()?;
        // `d` as soon as a listing shows the observer's `primed` (its lookup of `d` has
        // just missed: its negative cache, if any, hides `d` for nearly a whole period);
        // else once its answer is read.
        let mut made = false;
        self.wait_doing(
            o,
            at(k_all, PONG),
            &format!("it to look up the new names of rank {w} → rank {o}"),
            |m| {
                if !made && listed(&sig, "primed") {
                    made = true;
                    m.make_probed(&probe)?;
                }
                Ok(())
            },
        )?;
        let created = Instant::now();
        if !made {
            self.make_probed(&probe)?;
        }
        for k in 0..k_all {
            self.create_name(w, o, k)?;
        }
        self.say(format!(
            "{round}: created {k_all} new names and a directory; rank {o} polls them, and reads a record renamed over every {}",
            secs(STALE_PERIOD)
        ));
        let mut writes = StaleWrite {
            observer: o,
            max_gap_ns: 0,
        };
        let mut next = Instant::now();
        self.wait_doing(
            o,
            at(k_all, ACK),
            &format!("it to find the new names of rank {w} → rank {o}"),
            |m| {
                if Instant::now() >= next {
                    next = Instant::now() + STALE_PERIOD;
                    version += 1;
                    let t = m.rename_stale(&record, version)?;
                    // Version 0 lived through the lookups: the observer does not count it.
                    if version > 1 {
                        let gap = t.duration_since(renamed).as_nanos() as u64;
                        writes.max_gap_ns = writes.max_gap_ns.max(gap);
                    }
                    renamed = t;
                }
                Ok(())
            },
        )?;
        let took = created.elapsed();
        self.say(format!(
            "{round}: rank {o} found all {k_all} new names after {}",
            secs(took)
        ));
        // The probes, by name: a listing for the final removal may be stale on a client
        // that caches listings (sshfs), and would leave them.
        let _ = fs::remove_file(sig.join("go"));
        let _ = fs::remove_file(record.with_extension("tmp"));
        let _ = fs::remove_file(&record);
        for d in [probe.join("d"), sig, probe] {
            let _ = fs::remove_dir(d);
        }
        Ok((took, writes))
    }

    /// The writer's making of the observer's probed directory `d`, then of `sig/go`, the
    /// observer's signal that `d` is made.
    fn make_probed(&mut self, probe: &Path) -> Result<(), Failure> {
        let (d, go) = (probe.join("d"), probe.join("sig/go"));
        self.own.push(d.clone());
        self.own.push(go.clone());
        match crate::store::fs::create_dir(&d) {
            // EEXIST: the observer's mkdir came first (its probe says it could not tell).
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(Failure::failed(format!(
                    "cannot create {}: {e}",
                    d.display()
                )))
            }
        }
        crate::store::fs::create_file(&go)
            .map(drop)
            .map_err(|e| Failure::failed(format!("cannot create {}: {e}", go.display())))
    }

    /// The observer's part: look up what its writer will make (priming this client's
    /// negative-lookup cache for each) and read the probe record once, answer, then poll
    /// until every name is found and both probes are done, and acknowledge.
    fn names_as_observer(
        &mut self,
        pi: usize,
        w: u32,
        o: u32,
        round: &str,
    ) -> Result<(Vec<NameSample>, StaleRead, EexistSample), Failure> {
        let k_all = self.opts.samples;
        let at = |k, step| (MEASURING, pi as u32, k, step);
        self.wait(
            w,
            at(k_all, PING),
            &format!("its new names of rank {w} → rank {o}"),
        )?;
        let (probe, record) = self.probe_paths(w, o);
        let primed = probe.join("sig/primed");
        let mut eexist = EexistProbe::new(probe);
        self.miss(&eexist.target())?;
        // Tells the writer, through a listing (which no cache delays here), to make `d`.
        self.own.push(primed.clone());
        crate::store::fs::create_file(&primed)
            .map_err(|e| Failure::failed(format!("cannot create {}: {e}", primed.display())))?;
        let mut stale = StaleProbe::new(record, STALE_WINDOW.min(self.opts.timeout));
        stale.step();
        let mut missed = Vec::new();
        for k in 0..k_all {
            let name = self.name(w, o, k);
            self.miss(&name)?;
            missed.push((name, Instant::now()));
        }
        self.me.pos = at(k_all, PONG);
        self.send()?;
        let found = self.poll_names(w, missed, round, &mut eexist, &mut stale)?;
        // Before the acknowledgement, so that the writer can remove `sig/` after it.
        let _ = fs::remove_file(&primed);
        self.me.pos = at(k_all, ACK);
        self.send()?;
        let outcome = eexist.outcome();
        if let Some(ms) = outcome.lied_ms() {
            self.say(format!(
                "{round}: mkdir of rank {w}'s directory answered EEXIST while stat answered ENOENT for {} (negative-lookup cache)",
                secs(Duration::from_secs_f64(ms / 1000.0))
            ));
        }
        Ok((found, stale.reading(w), EexistSample { writer: w, outcome }))
    }

    /// Polls the new names of `w`, each missed at its instant, until every one is found;
    /// each sample is that name's own (its writer's creation time is in it). Meanwhile,
    /// and until they are done too, each poll takes a step of both probes.
    fn poll_names(
        &mut self,
        w: u32,
        mut missed: Vec<(PathBuf, Instant)>,
        round: &str,
        eexist: &mut EexistProbe,
        stale: &mut StaleProbe,
    ) -> Result<Vec<NameSample>, Failure> {
        let k_all = missed.len();
        let mut found = Vec::new();
        let start = Instant::now();
        let mut deadline = start + self.opts.timeout;
        let mut checked = Instant::now();
        let mut note = start + NOTE_EVERY;
        loop {
            let mut i = 0;
            while i < missed.len() {
                let (name, at) = &missed[i];
                match crate::store::fs::read_file(name, crate::store::ReadLimit::Record) {
                    Ok(b) => {
                        if let Some(t) = std::str::from_utf8(&b).ok().and_then(|s| s.parse().ok()) {
                            let after = at.elapsed();
                            found.push(NameSample {
                                writer: w,
                                created_ns: t,
                                seen_ns: wall_ns(),
                                after_miss_ns: after.as_nanos() as u64,
                            });
                            self.say(format!(
                                "{round}: new name {}/{k_all} seen {} after its miss",
                                found.len(),
                                secs(after)
                            ));
                            missed.remove(i);
                            deadline = Instant::now() + self.opts.timeout;
                            continue;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(Failure::failed(format!(
                            "cannot read {}: {e}",
                            name.display()
                        )))
                    }
                }
                i += 1;
            }
            // The names come after the probed directory: once all are found, it exists.
            eexist.step(missed.is_empty(), self.opts.timeout);
            stale.step();
            if missed.is_empty() && eexist.done() && stale.done {
                break;
            }
            self.interrupted()?;
            if checked.elapsed() >= ABORT_CHECK {
                checked = Instant::now();
                if let Some(p) = read(&self.file(w)) {
                    self.check_peer(&p)?;
                }
                self.watch_coordinator(w)?;
            }
            if Instant::now() >= note && !missed.is_empty() {
                note += NOTE_EVERY;
                self.say(format!(
                    "{round}: {} of {k_all} new names not seen yet after {} (a negative-lookup cache)",
                    missed.len(),
                    secs(start.elapsed())
                ));
            }
            if Instant::now() >= deadline && !missed.is_empty() {
                return Err(Failure::new(
                    Cause::Deadline,
                    format!(
                        "doctor session {}: new name {} from {} not seen within {}",
                        self.opts.session,
                        missed[0].0.display(),
                        self.who(w),
                        humantime::format_duration(self.opts.timeout)
                    ),
                )
                .with_hint("a negative-lookup cache longer than --timeout? raise --timeout"));
            }
            pause(start);
        }
        Ok(found)
    }

    /// Success: rank 0, having every rank's results, removes the session; the others leave
    /// their files to it.
    fn finish(&mut self, ok: bool) {
        // Only a rank 0 that holds its claim speaks for the session: a doctor refused its
        // rank must not remove the session of the one that holds it.
        let coordinator = self.me.rank == 0 && !self.own.is_empty();
        if coordinator || !ok {
            if coordinator {
                let _ = fs::remove_dir_all(&self.dir);
            } else {
                // The probe directory's `d` before the directory itself.
                for p in self.own.iter().rev() {
                    let _ = fs::remove_file(p).or_else(|_| fs::remove_dir(p));
                }
                let _ = fs::remove_dir(&self.dir);
            }
            let mut created: Vec<String> = self.me.created.clone();
            for p in self.peers.iter().flatten() {
                created.extend(p.created.iter().cloned());
            }
            // `doctor/` is the doctors' own (no run writes there): removed when empty, even
            // if a doctor of another session made it. `.rl-node/` only if a rank of this
            // session made it: an empty one may be a run's that is starting.
            let base = self.root.join(".rl-node");
            let _ = fs::remove_dir(base.join("doctor"));
            if created.iter().any(|c| c == ".rl-node") {
                let _ = fs::remove_dir(&base);
            }
        }
    }

    /// Failure: say so in this rank's file, give the peers a moment to read it, then
    /// remove this rank's files (rank 0: the whole session, which none can finish now).
    fn leave(&mut self, failure: Option<&Failure>) {
        if let Some(f) = failure.filter(|_| !self.own.is_empty()) {
            let why = &f.message;
            self.me.pos = (ABORTED, 0, 0, 0);
            self.me.abort = Some(why.lines().next().unwrap_or(why).to_string());
            self.me.abort_code = Some(f.exit_code());
            if self.send().is_ok() {
                let deadline = Instant::now() + LEAVE_GRACE.min(self.opts.timeout);
                let others: Vec<u32> = (0..self.opts.nodes)
                    .filter(|r| *r != self.me.rank)
                    .collect();
                while Instant::now() < deadline {
                    // Rank 0 at DONE is still reading the others' results, this one's
                    // included: it must find the abort, not a file gone.
                    let waiting = others.iter().any(|r| {
                        read(&self.file(*r)).is_some_and(|p| {
                            p.pos.0 == MEASURING
                                || p.pos.0 == CLAIMED
                                || (*r == 0 && p.pos.0 == DONE)
                        })
                    });
                    if !waiting {
                        break;
                    }
                    std::thread::sleep(POLL * 10);
                }
            }
        }
        self.finish(false);
    }
}

/// The observer's probe of "EEXIST but not there": it looks up `d` in its writer's
/// probe directory while missing; once a listing of `sig/` beside it (a listing asks the
/// server, and refreshes nothing of the probe directory's own names) shows the `go` the
/// writer makes right after `d`, `mkdir d` must answer EEXIST, and `stat d` then tells
/// whether this client's negative-lookup cache still hides it, and for how long.
struct EexistProbe {
    dir: PathBuf,
    state: ProbeState,
}

enum ProbeState {
    Waiting,
    /// `mkdir` answered EEXIST and `stat` ENOENT at this instant.
    Hidden(Instant),
    Done(Eexist),
}

impl EexistProbe {
    fn new(dir: PathBuf) -> EexistProbe {
        EexistProbe {
            dir,
            state: ProbeState::Waiting,
        }
    }

    fn target(&self) -> PathBuf {
        self.dir.join("d")
    }

    fn done(&self) -> bool {
        matches!(self.state, ProbeState::Done(_))
    }

    /// One look. `names_found`: the new names, made after `d`, are all seen, so `d` is
    /// there even if the directory's change could not be seen. `limit`: the longest a
    /// hidden `d` is waited for.
    fn step(&mut self, names_found: bool, limit: Duration) {
        match &self.state {
            ProbeState::Waiting => {
                let go = listed(&self.dir.join("sig"), "go");
                // Looked up again while it is missing: a negative cache that expires before
                // the writer makes `d` is primed anew, so the probe still finds it hiding
                // `d`; without one, `d` is found as soon as it is made.
                let seen = !go && fs::metadata(self.target()).is_ok();
                if go || seen || names_found {
                    self.state = self.make(!go && !seen);
                }
            }
            ProbeState::Hidden(since) => {
                let ms = since.elapsed().as_secs_f64() * 1000.0;
                if fs::metadata(self.target()).is_ok() {
                    self.state = ProbeState::Done(Eexist::Lied { ms, still: false });
                } else if since.elapsed() >= limit {
                    self.state = ProbeState::Done(Eexist::Lied { ms, still: true });
                }
            }
            ProbeState::Done(_) => {}
        }
    }

    /// `mkdir d`, then `stat d`. `late`: taken only after the names were found (no `go`
    /// was listed), when the caches of the lookups have had their time.
    fn make(&self, late: bool) -> ProbeState {
        let d = self.target();
        match crate::store::fs::create_dir(&d) {
            Err(e) if e.kind() == ErrorKind::AlreadyExists => match fs::metadata(&d) {
                Ok(_) if late => ProbeState::Done(Eexist::Unclear {
                    why: "a listing never showed the writer's signal, so mkdir came only after the new names were found, when the caches had expired".into(),
                }),
                Ok(_) => ProbeState::Done(Eexist::Agreed),
                Err(e) if e.kind() == ErrorKind::NotFound => ProbeState::Hidden(Instant::now()),
                Err(e) => ProbeState::Done(Eexist::Unclear {
                    why: format!("stat after EEXIST: {e}"),
                }),
            },
            Ok(()) => ProbeState::Done(Eexist::Unclear {
                why: "mkdir made it: the writer's had not reached the server yet".into(),
            }),
            Err(e) => ProbeState::Done(Eexist::Unclear {
                why: format!("mkdir: {e}"),
            }),
        }
    }

    fn outcome(self) -> Eexist {
        match self.state {
            ProbeState::Done(e) => e,
            // Not reached: the poll ends only when the probe is done.
            _ => Eexist::Unclear {
                why: "not finished".into(),
            },
        }
    }
}

/// The observer's reading of the record its writer renames over every [`STALE_PERIOD`]:
/// the version read changes only when this client's view of the name is refreshed, so
/// after two changes it has seen one whole period of that view, and the longest it kept
/// reading one version tells how long a rename over stays stale here.
struct StaleProbe {
    path: PathBuf,
    last: Option<u32>,
    /// When the version read last changed.
    changed: Option<Instant>,
    changes: u32,
    longest: Duration,
    started: Instant,
    limit: Duration,
    done: bool,
}

impl StaleProbe {
    fn new(path: PathBuf, limit: Duration) -> StaleProbe {
        StaleProbe {
            path,
            last: None,
            changed: None,
            changes: 0,
            longest: Duration::ZERO,
            started: Instant::now(),
            limit,
            done: false,
        }
    }

    fn step(&mut self) {
        if self.done {
            return;
        }
        let read = crate::store::fs::read_file(&self.path, crate::store::ReadLimit::Record);
        let version = read
            .ok()
            .and_then(|b| String::from_utf8(b).ok()?.parse::<u32>().ok());
        if let Some(v) = version {
            if self.last.is_some_and(|l| l != v) {
                let now = Instant::now();
                // The first change ends the version read before the renames began.
                if let Some(c) = self.changed {
                    self.longest = self.longest.max(now - c);
                }
                self.changed = Some(now);
                self.changes += 1;
            }
            self.last = Some(v);
        }
        if self.changes >= 2 || self.started.elapsed() >= self.limit {
            self.done = true;
        }
    }

    fn reading(&self, writer: u32) -> StaleRead {
        let window = self.started.elapsed();
        // Fewer than two changes: the version read last was read at least this long.
        let since = self.changed.map_or(window, |c| c.elapsed());
        StaleRead {
            writer,
            longest_ns: if self.changes < 2 {
                since.as_nanos() as u64
            } else {
                self.longest.as_nanos() as u64
            },
            changes: self.changes,
        }
    }
}

/// Whether a listing of `dir` shows `name`: a listing asks the server, where a lookup of a
/// name may be answered from this client's caches.
fn listed(dir: &Path, name: &str) -> bool {
    crate::store::fs::read_dir(dir).is_ok_and(|l| l.iter().any(|n| n == name))
}

/// A rank's file: missing, unreadable or torn is `None` ("not yet").
fn read(path: &Path) -> Option<Msg> {
    store().read_json(path).ok().flatten()
}

/// The shared directory's helpers (a rank's file is a live record: replaced whole, not
/// fsynced; a claim is an exclusive create), as the nodes' records use them.
fn store() -> &'static dyn crate::store::SharedDir {
    &crate::store::fs::Fs
}

/// The cross-node verdicts (rank 0).
fn cross_checks(members: &[NodeSummary], pairs: &[PairReport], offsets: &[Offset]) -> Vec<Check> {
    let mut checks = Vec::new();
    // Every node's own checks, and whether they mount the directory alike.
    let mut bad = Vec::new();
    let mut verdict = Verdict::Ok;
    for m in members {
        let mut what = Vec::new();
        if !m.failed.is_empty() {
            verdict = Verdict::Fail;
            what.push(format!("FAIL {}", m.failed.join(", ")));
        }
        if !m.warned.is_empty() {
            if verdict == Verdict::Ok {
                verdict = Verdict::Warn;
            }
            what.push(format!("warn {}", m.warned.join(", ")));
        }
        if !what.is_empty() {
            bad.push(format!(
                "rank {} on {}: {}",
                m.rank,
                m.host,
                what.join(", ")
            ));
        }
    }
    let mut kinds: Vec<&str> = members
        .iter()
        .map(|m| m.mount.as_deref().unwrap_or("unknown"))
        .collect();
    kinds.sort();
    kinds.dedup();
    let alike = if kinds.len() == 1 {
        format!("all {} nodes mount it alike ({})", members.len(), kinds[0])
    } else {
        if verdict == Verdict::Ok {
            verdict = Verdict::Warn;
        }
        format!("the nodes mount it differently: {}", kinds.join(" | "))
    };
    let evidence = if bad.is_empty() {
        format!("every node's own checks passed; {alike}")
    } else {
        format!("{}; {alike}", bad.join("; "))
    };
    checks.push(if verdict == Verdict::Ok {
        Check::ok("nodes", evidence)
    } else {
        Check::not_ok("nodes", verdict, evidence, "run `rl-node doctor` on the named node for the evidence and what to change; mount the directory with the same options everywhere".into())
    });

    let worst = |f: fn(&PairReport) -> Option<Stat>| -> Option<(f64, f64, String)> {
        let all: Vec<(Stat, String)> = pairs
            .iter()
            .filter_map(|p| f(p).map(|s| (s, format!("rank {} → rank {}", p.writer, p.observer))))
            .collect();
        let max = all
            .iter()
            .max_by(|a, b| a.0.max_ms.total_cmp(&b.0.max_ms))?;
        let med = all.iter().map(|a| a.0.median_ms).fold(0.0, f64::max);
        Some((med, max.0.max_ms, max.1.clone()))
    };
    let ms = |v: f64| super::doctor_report::ms(Duration::from_secs_f64(v / 1000.0));
    if let Some((med, max, at)) = worst(|p| p.rewrite) {
        let ev = format!(
            "a file renamed over by one node was read anew by the other within {} (largest median of {} ordered pairs), at worst {} ({at})",
            ms(med),
            pairs.len(),
            ms(max)
        );
        checks.push(if max <= SLOW_REWRITE.as_secs_f64() * 1000.0 {
            Check::ok("cross-rewrite", ev)
        } else {
            Check::not_ok("cross-rewrite", Verdict::Warn, ev, "every heartbeat and barrier position is such a rewrite: see cross-stale-rename for the cache that delays it (an entry cache; NFS: the attribute cache, actimeo/acregmax); the [timing] below allows for it".into())
        });
    }
    checks.extend(stale_rename_check(members, pairs));
    checks.extend(eexist_check(members, pairs));
    if let Some((med, max, at)) = worst(|p| p.new_name) {
        let ev = format!(
            "a name created by one node after the other looked it up and missed was found within {} (largest median), at worst {} ({at}): the other node's negative-lookup cache",
            ms(med),
            ms(max)
        );
        checks.push(if max <= SLOW_NEW_NAME.as_secs_f64() * 1000.0 {
            Check::ok("cross-new-name", ev)
        } else {
            Check::not_ok("cross-new-name", Verdict::Warn, ev, "each wait for a brand-new file (a barrier release, a checkpoint) can cost this much: mount NFS with lookupcache=positive, FUSE with negative_timeout=0".into())
        });
    }
    if !offsets.is_empty() {
        let worst = offsets
            .iter()
            .max_by(|a, b| a.offset_ms.abs().total_cmp(&b.offset_ms.abs()))
            .expect("not empty");
        checks.push(Check::ok(
            "clock-offset",
            format!(
                "largest between rank {} and rank {}: {:+.1}ms (±{:.1}ms); for information: rl-node never compares clocks of different nodes",
                worst.a, worst.b, worst.offset_ms, worst.uncertainty_ms
            ),
        ));
    }
    checks
}

/// The fix of `rank`'s mount (the observer's: its client's caches are the stale ones).
fn fix_of(members: &[NodeSummary], rank: u32, pick: fn(&NodeSummary) -> &String) -> String {
    members
        .iter()
        .find(|m| m.rank == rank)
        .map(pick)
        .filter(|f| !f.is_empty())
        .cloned()
        .unwrap_or_else(|| "set the filesystem's name cache timeouts to 0".into())
}

/// How long a record another node renamed over read stale, at worst: what each barrier
/// hop (an arrival, its release) can wait.
fn stale_rename_check(members: &[NodeSummary], pairs: &[PairReport]) -> Option<Check> {
    const NAME: &str = "cross-stale-rename";
    let worst = pairs
        .iter()
        .filter_map(|p| p.stale_rename_ms.map(|s| (s, p)))
        .max_by(|a, b| a.0.total_cmp(&b.0))?;
    let (stale, p) = worst;
    let d = Duration::from_secs_f64(stale / 1000.0);
    let short: Vec<String> = pairs
        .iter()
        .filter(|p| p.stale_at_least)
        .map(|p| format!("rank {} → rank {}", p.writer, p.observer))
        .collect();
    let mut ev = format!(
        "a record renamed over by one node read stale to the other for up to {}{} (rank {} → rank {}, watched over two refreshes of the reader's view): each barrier hop (an arrival, its release) can wait that long, up to {} per barrier",
        super::doctor_report::ms(d),
        if p.stale_at_least { " at least" } else { "" },
        p.writer,
        p.observer,
        super::doctor_report::ms(d * 2)
    );
    if !short.is_empty() {
        ev.push_str(&format!(
            "; {} saw fewer than two refreshes within {}: at least",
            short.join(", "),
            secs(STALE_WINDOW)
        ));
    }
    Some(if d <= STALE_RENAME {
        Check::ok(NAME, ev)
    } else {
        Check::not_ok(
            NAME,
            Verdict::Warn,
            ev,
            format!(
                "{} (rank {}'s mount): this client trusts a name for that long without asking the server; the [timing] below allows for it",
                fix_of(members, p.observer, |m| &m.entry_fix),
                p.observer
            ),
        )
    })
}

/// Whether `mkdir` of a directory another node made answered EEXIST while `stat` could
/// not see it, and for how long.
fn eexist_check(members: &[NodeSummary], pairs: &[PairReport]) -> Option<Check> {
    const NAME: &str = "cross-eexist-enoent";
    let taken: Vec<&PairReport> = pairs.iter().filter(|p| p.eexist.is_some()).collect();
    if taken.is_empty() {
        return None;
    }
    let lied = taken
        .iter()
        .filter_map(|p| match p.eexist {
            Some(Eexist::Lied { ms, still }) => Some((ms, still, *p)),
            _ => None,
        })
        .max_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((ms, still, p)) = lied {
        let d = super::doctor_report::ms(Duration::from_secs_f64(ms / 1000.0));
        return Some(Check::not_ok(
            NAME,
            Verdict::Warn,
            format!(
                "mkdir of a directory another node had made answered EEXIST while stat answered ENOENT for {}{d} (rank {} → rank {}): the reader's negative-lookup cache; rl-node waits each such directory out, with a bound",
                if still { "more than " } else { "" },
                p.writer,
                p.observer
            ),
            format!(
                "{} (rank {}'s mount)",
                fix_of(members, p.observer, |m| &m.negative_fix),
                p.observer
            ),
        ));
    }
    let agreed = taken
        .iter()
        .filter(|p| p.eexist == Some(Eexist::Agreed))
        .count();
    if agreed > 0 {
        return Some(Check::ok(
            NAME,
            format!("mkdir of a directory another node had made answered EEXIST and stat found it at once ({agreed} of {} ordered pairs)", taken.len()),
        ));
    }
    let why = taken
        .iter()
        .find_map(|p| match &p.eexist {
            Some(Eexist::Unclear { why }) => Some(why.clone()),
            _ => None,
        })
        .unwrap_or_default();
    Some(Check::not_ok(
        NAME,
        Verdict::Warn,
        format!("no ordered pair could tell whether mkdir and stat agree on a directory another node made: {why}"),
        "see each node's eexist-enoent check for its configured negative-lookup cache".into(),
    ))
}

/// The session's part of the text report.
pub(crate) fn render(s: &mut String, r: &SessionReport) {
    use std::fmt::Write;
    let ms = |v: f64| super::doctor_report::ms(Duration::from_secs_f64(v.max(0.0) / 1000.0));
    let _ = writeln!(
        s,
        "\ndoctor session {}: rank {} of {} nodes, {} samples per ordered pair",
        r.session, r.rank, r.nodes, r.samples
    );
    if let Some(by) = &r.reported_by {
        let _ = writeln!(
            s,
            "{by} prints the measurements between all nodes and the [timing] for all of them (this rank's own checks are above)"
        );
        return;
    }
    for m in &r.members {
        let _ = writeln!(
            s,
            "  rank {} on {} (pid {}): {}",
            m.rank,
            m.host,
            m.pid,
            m.filesystem.as_deref().unwrap_or("filesystem unknown")
        );
    }
    let _ = writeln!(
        s,
        "\n  writer → observer   rewrite median/max      new name median/max     new name since miss     round trip median"
    );
    let pair = |st: Option<Stat>| {
        st.map_or("-".to_string(), |s| {
            format!("{} / {}", ms(s.median_ms), ms(s.max_ms))
        })
    };
    for p in &r.pairs {
        let _ = writeln!(
            s,
            "  rank {} → rank {}    {:<23} {:<23} {:<23} {}",
            p.writer,
            p.observer,
            pair(p.rewrite),
            pair(p.new_name),
            pair(p.new_name_after_miss),
            p.round_trip.map_or("-".into(), |s| ms(s.median_ms))
        );
    }
    let _ = writeln!(
        s,
        "\n  writer → observer   rename over read stale   mkdir EEXIST while stat ENOENT"
    );
    for p in &r.pairs {
        let eexist = match &p.eexist {
            None => "-".to_string(),
            Some(Eexist::Agreed) => "no: stat found it".into(),
            Some(Eexist::Lied { ms: t, still }) => {
                format!("{}{}", if *still { "more than " } else { "" }, ms(*t))
            }
            Some(Eexist::Unclear { .. }) => "could not tell".into(),
        };
        let stale = p.stale_rename_ms.map_or("-".into(), |t| {
            format!(
                "{}{}",
                if p.stale_at_least { "at least " } else { "" },
                ms(t)
            )
        });
        let _ = writeln!(
            s,
            "  rank {} → rank {}    {:<24} {eexist}",
            p.writer, p.observer, stale
        );
    }
    for o in &r.clock_offsets {
        let _ = writeln!(
            s,
            "  clock of rank {} − clock of rank {}: {:+.1}ms (±{:.1}ms)",
            o.b, o.a, o.offset_ms, o.uncertainty_ms
        );
    }
    let _ = writeln!(s, "  method: {}", r.method);
}

/// A session name is one path component of letters, digits, `.`, `_` and `-`.
pub(crate) fn valid_session(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_has_every_ordered_pair_once_in_disjoint_rounds() {
        for n in 2..=9 {
            let s = schedule(n);
            let mut all: Vec<(u32, u32)> = s.clone();
            all.sort();
            let want: Vec<(u32, u32)> = (0..n)
                .flat_map(|a| (0..n).filter(move |b| *b != a).map(move |b| (a, b)))
                .collect();
            assert_eq!(all, want, "n = {n}");
            // Consecutive blocks of ⌊n/2⌋ pairs share no rank: they run at once.
            for block in s.chunks((n / 2) as usize) {
                let mut ranks: Vec<u32> = block.iter().flat_map(|&(a, b)| [a, b]).collect();
                ranks.sort();
                let len = ranks.len();
                ranks.dedup();
                assert_eq!(ranks.len(), len, "n = {n}: {block:?}");
            }
        }
        assert_eq!(schedule(2), [(0, 1), (1, 0)]);
        assert!(schedule(1).is_empty());
    }

    fn ping(observer: u32, t: [i64; 4]) -> PingSample {
        PingSample {
            observer,
            t,
            rtt_ns: (t[3] - t[0]) as u64,
        }
    }

    #[test]
    fn offsets_and_one_way_latencies_survive_a_skewed_clock() {
        // Rank 1's clock is 1 s ahead; each rewrite takes 5 ms one way, the observer
        // answers 1 ms after seeing the ping. A second exchange is slower (20 ms out).
        let skew = 1_000_000_000;
        let ms = 1_000_000;
        let pings = vec![
            (0, ping(1, [0, 5 * ms + skew, 6 * ms + skew, 11 * ms])),
            (
                0,
                ping(1, [100 * ms, 120 * ms + skew, 121 * ms + skew, 126 * ms]),
            ),
            (1, ping(0, [skew, 5 * ms, 6 * ms, 11 * ms + skew])),
        ];
        let names = vec![(
            1,
            NameSample {
                writer: 0,
                created_ns: 200 * ms,
                seen_ns: 2200 * ms + skew,
                after_miss_ns: 2010 * ms as u64,
            },
        )];
        let (pairs, offsets) = analyse(2, &pings, &names, &Probes::default());
        assert_eq!(offsets.len(), 1);
        assert!((offsets[0].offset_ms - 1000.0).abs() < 1e-6, "{offsets:?}");
        assert!((offsets[0].uncertainty_ms - 5.0).abs() < 1e-6);
        let p01 = pairs
            .iter()
            .find(|p| (p.writer, p.observer) == (0, 1))
            .unwrap();
        let rw = p01.rewrite.unwrap();
        assert_eq!(rw.samples, 2);
        assert!(
            (rw.min_ms - 5.0).abs() < 1e-6 && (rw.max_ms - 20.0).abs() < 1e-6,
            "{rw:?}"
        );
        let nn = p01.new_name.unwrap();
        assert!((nn.median_ms - 2000.0).abs() < 1e-6, "{nn:?}");
        assert!((p01.new_name_after_miss.unwrap().median_ms - 2010.0).abs() < 1e-6);
        assert!((p01.round_trip.unwrap().max_ms - 26.0).abs() < 1e-6);
        let p10 = pairs
            .iter()
            .find(|p| (p.writer, p.observer) == (1, 0))
            .unwrap();
        assert!((p10.rewrite.unwrap().median_ms - 5.0).abs() < 1e-6);
        assert!(p10.new_name.is_none());
    }

    fn member(rank: u32, fs: &str, failed: &[&str]) -> NodeSummary {
        NodeSummary {
            rank,
            host: format!("node-{rank}"),
            pid: 100 + rank,
            filesystem: Some(format!("{fs} at /mnt/{rank}")),
            mount: Some(fs.into()),
            options_visibility_secs: 0.0,
            options_unknown: Vec::new(),
            entry_fix: format!("{fs}: entry_timeout=0"),
            negative_fix: format!("{fs}: negative_timeout=0"),
            keeps_trash: false,
            slowest_fsync_ms: 1.0,
            failed: failed.iter().map(|s| s.to_string()).collect(),
            warned: Vec::new(),
        }
    }

    fn stat(ms: f64) -> Option<Stat> {
        Stat::of(vec![ms])
    }

    #[test]
    fn verdicts_name_the_node_and_the_slow_pair() {
        let pairs = vec![
            PairReport {
                writer: 0,
                observer: 1,
                rewrite: stat(3.0),
                new_name: stat(2000.0),
                new_name_after_miss: stat(2003.0),
                round_trip: stat(6.0),
                stale_rename_ms: None,
                stale_at_least: false,
                eexist: None,
            },
            PairReport {
                writer: 1,
                observer: 0,
                rewrite: stat(2.0),
                new_name: stat(5.0),
                new_name_after_miss: stat(8.0),
                round_trip: stat(5.0),
                stale_rename_ms: None,
                stale_at_least: false,
                eexist: None,
            },
        ];
        let offsets = vec![Offset {
            a: 0,
            b: 1,
            offset_ms: 40_000.0,
            uncertainty_ms: 3.0,
        }];
        let members = [
            member(0, "nfs4 (rw)", &[]),
            member(1, "nfs4 (rw)", &["rename-over"]),
        ];
        let c = cross_checks(&members, &pairs, &offsets);
        let by = |n: &str| c.iter().find(|c| c.name == n).unwrap();
        assert_eq!(by("nodes").verdict, Verdict::Fail);
        let ev = &by("nodes").evidence;
        assert!(ev.contains("rank 1 on node-1: FAIL rename-over;"), "{ev}");
        assert!(ev.contains("mount it alike (nfs4 (rw))"), "{ev}");
        assert_eq!(by("cross-rewrite").verdict, Verdict::Ok);
        assert_eq!(by("cross-new-name").verdict, Verdict::Warn);
        assert!(by("cross-new-name").evidence.contains("rank 0 → rank 1"));
        // A clock 40 s off is reported, never judged.
        assert_eq!(by("clock-offset").verdict, Verdict::Ok);
        assert!(by("clock-offset").evidence.contains("+40000.0ms"));
        // Mounted differently: a warning naming both.
        let members = [
            member(0, "nfs4 (rw)", &[]),
            member(1, "fuse.sshfs (rw)", &[]),
        ];
        let c = cross_checks(&members, &pairs[1..], &[]);
        assert_eq!(c[0].verdict, Verdict::Warn);
        assert!(c[0].evidence.contains("fuse.sshfs (rw) | nfs4 (rw)"));
        assert_eq!(c.len(), 3, "no clock-offset check without offsets");
    }

    /// Rank 1's clock 1 s ahead changes nothing: the staleness of a rename over is the
    /// longest the observer read one version, on its own clock, less the longest a version
    /// lived before its replacement; the EEXIST probe's outcome goes to its pair.
    #[test]
    fn stale_renames_are_net_of_the_renames_gap_and_need_no_clock_offset() {
        let skew = 1_000_000_000;
        let ms = 1_000_000;
        let pings = vec![(0, ping(1, [0, 5 * ms + skew, 6 * ms + skew, 11 * ms]))];
        let probes = Probes {
            stale: vec![(
                1,
                StaleRead {
                    writer: 0,
                    longest_ns: 1020 * ms as u64,
                    changes: 2,
                },
            )],
            stale_writes: vec![(
                0,
                StaleWrite {
                    observer: 1,
                    max_gap_ns: 25 * ms as u64,
                },
            )],
            eexist: vec![(
                1,
                EexistSample {
                    writer: 0,
                    outcome: Eexist::Lied {
                        ms: 870.0,
                        still: false,
                    },
                },
            )],
        };
        let (pairs, _) = analyse(2, &pings, &[], &probes);
        let p01 = pairs
            .iter()
            .find(|p| (p.writer, p.observer) == (0, 1))
            .unwrap();
        let stale = p01.stale_rename_ms.unwrap();
        assert!((stale - 995.0).abs() < 1e-6, "{stale}");
        assert!(!p01.stale_at_least);
        assert_eq!(
            p01.eexist,
            Some(Eexist::Lied {
                ms: 870.0,
                still: false
            })
        );
        let p10 = pairs
            .iter()
            .find(|p| (p.writer, p.observer) == (1, 0))
            .unwrap();
        assert_eq!((p10.stale_rename_ms, &p10.eexist), (None, &None));
    }

    fn probed(w: u32, o: u32, stale: f64, eexist: Eexist) -> PairReport {
        PairReport {
            writer: w,
            observer: o,
            rewrite: stat(3.0),
            new_name: stat(3.0),
            new_name_after_miss: stat(3.0),
            round_trip: stat(6.0),
            stale_rename_ms: Some(stale),
            stale_at_least: false,
            eexist: Some(eexist),
        }
    }

    /// The new checks name the worst pair and give the fix of the observer's mount (its
    /// client holds the stale view), and pass when nothing was stale.
    #[test]
    fn cache_checks_warn_with_the_observers_fix() {
        let members = [member(0, "fuse.sshfs", &[]), member(1, "fuse.mfs", &[])];
        let lied = Eexist::Lied {
            ms: 950.0,
            still: false,
        };
        let pairs = [
            probed(0, 1, 990.0, lied.clone()),
            probed(1, 0, 4.0, Eexist::Agreed),
        ];
        let c = cross_checks(&members, &pairs, &[]);
        let by = |n: &str| c.iter().find(|c| c.name == n).unwrap();
        let stale = by("cross-stale-rename");
        assert_eq!(stale.verdict, Verdict::Warn);
        assert!(
            stale.evidence.contains("up to 990ms (rank 0 → rank 1")
                && stale.evidence.contains("up to 1980ms per barrier"),
            "{}",
            stale.evidence
        );
        let json = serde_json::to_value(stale).unwrap();
        assert!(json["advice"]
            .as_str()
            .unwrap()
            .starts_with("fuse.mfs: entry_timeout=0 (rank 1's mount)"));
        let eexist = by("cross-eexist-enoent");
        assert_eq!(eexist.verdict, Verdict::Warn);
        assert!(
            eexist
                .evidence
                .contains("answered ENOENT for 950ms (rank 0 → rank 1)"),
            "{}",
            eexist.evidence
        );
        let json = serde_json::to_value(eexist).unwrap();
        assert_eq!(
            json["advice"],
            "fuse.mfs: negative_timeout=0 (rank 1's mount)"
        );
        // Nothing stale, mkdir and stat agreeing: both ok.
        let pairs = [
            probed(0, 1, 3.0, Eexist::Agreed),
            probed(1, 0, 0.0, Eexist::Agreed),
        ];
        let c = cross_checks(&members, &pairs, &[]);
        for n in ["cross-stale-rename", "cross-eexist-enoent"] {
            let check = c.iter().find(|c| c.name == n).unwrap();
            assert_eq!(check.verdict, Verdict::Ok, "{check:?}");
        }
    }

    #[test]
    fn session_names_are_one_plain_component() {
        assert!(valid_session("default") && valid_session("job-42.a_b"));
        for bad in ["", "..", ".x", "a/b", "a b", &"x".repeat(65)] {
            assert!(!valid_session(bad), "{bad}");
        }
    }
}
