//! `rl-node doctor --log-path DIR`: check, from one node, what rl-node relies on in the
//! shared filesystem (docs/shared-directory.md, "Checking a filesystem"), before a run finds
//! out the hard way.
//!
//! Every probe works in a scratch directory of its own, `DIR/.rl-node/doctor/<host>-<pid>-<nonce>/`,
//! which is removed at the end (and so are `doctor/` and `.rl-node/` when this command
//! created them): a run's files are never opened, let alone written. Each check yields a
//! verdict with the measured evidence and, when not ok, what to change; the mount options
//! read from /proc/mounts and the measured fsync latency give a recommended `[timing]`.
//! What only several nodes can measure (how long one node's write takes to become visible
//! on another, clock offsets) is out of reach of a single process and is said to be so,
//! unless the doctor runs on every node at once with `--nodes N` (`doctor_nodes`).

use super::doctor_caches::{secs, Family};
use super::doctor_dirs::DirWait;
use super::doctor_report::{ms, Check, FuseDaemon, Mount, Verdict};
use crate::error::{Cause, Ending, Failure};
use serde::Serialize;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// The shared directory to check (only `DIR/.rl-node/doctor/` is written, then removed).
    #[arg(long, value_name = "DIR")]
    pub log_path: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Run on N nodes at once (one doctor per node, started within --timeout of each other)
    /// and measure what one node cannot: visibility between nodes, clock offsets. At most
    /// 10000 (the pairs measured grow as N²).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nodes: u32,
    /// This node's rank (0..N-1); by default the first free one is claimed.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
    /// The session the N doctors meet in, `DIR/.rl-node/doctor/<NAME>/` (letters, digits,
    /// `.`, `_`, `-`): give each concurrent group of doctors its own. Default:
    /// `slurm-<SLURM_JOB_ID>` inside a Slurm job (so that jobs sharing DIR do not mix),
    /// else `default`.
    #[arg(long, value_name = "NAME")]
    pub session: Option<String>,
    /// Samples per ordered pair of nodes (each costs up to a negative-lookup cache time).
    /// Default: 3.
    #[arg(long, value_name = "K")]
    pub samples: Option<u32>,
    /// Every wait for another node (the join, each answer, each new name) ends after this
    /// long without progress. Default: 2m.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub timeout: Option<Duration>,
}

/// A session's `--samples` and `--timeout` when not given.
const DEFAULT_SAMPLES: u32 = 3;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// How many times the writer renames over the record while a reader re-reads it.
const RENAMES: usize = 200;
/// How many fsyncs are timed (of a file, and of the directory).
const FSYNCS: usize = 10;
/// Below these, the free-space checks warn: a run writes trajectories, checkpoints, logs.
const MIN_FREE_BYTES: u64 = 1 << 30;
const MIN_FREE_INODES: u64 = 10_000;
/// An fsync slower than this warns: every commit of a record waits for one.
const SLOW_FSYNC: Duration = Duration::from_secs(1);

/// What the mount's caches imply for barriers: the longest a rewritten record and a new
/// name can stay unseen by another node, when they can be told from the options. `None`
/// is unknown (never 0 s).
#[derive(Serialize, Debug, Clone, Default, PartialEq)]
pub(crate) struct Caches {
    /// Attribute cache (a rewritten file's new size/mtime), seconds.
    pub attribute_secs: Option<f64>,
    /// Entry cache (a name → file mapping trusted without asking: a record renamed over
    /// is read stale meanwhile), seconds.
    pub entry_secs: Option<f64>,
    /// Negative lookup cache (a name looked up while missing), seconds.
    pub negative_secs: Option<f64>,
    /// One line per option that matters, and what it means.
    pub notes: Vec<String>,
    /// Something to change on the mount, if any.
    pub advice: Vec<String>,
}

impl Caches {
    /// The longest delay before another node sees a change, as far as the options tell
    /// (the known caches only: see [`Caches::unknown`]).
    pub(crate) fn visibility_secs(&self) -> f64 {
        [self.attribute_secs, self.entry_secs, self.negative_secs]
            .into_iter()
            .flatten()
            .fold(0.0, f64::max)
    }

    /// The caches whose value the options do not tell.
    pub(crate) fn unknown(&self) -> Vec<&'static str> {
        [
            ("attribute", self.attribute_secs),
            ("entry", self.entry_secs),
            ("negative", self.negative_secs),
        ]
        .into_iter()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| k)
        .collect()
    }

    /// The bound and the words of a wait for a directory another doctor made.
    fn dir_wait(&self, family: Option<Family>) -> DirWait {
        let f = family.unwrap_or(Family::Local);
        let (entry_key, negative_key) = f.keys();
        let longest = [self.entry_secs, self.negative_secs]
            .into_iter()
            .collect::<Option<Vec<f64>>>()
            .map(|v| v.into_iter().fold(0.0, f64::max));
        DirWait {
            bound: DirWait::for_caches(longest),
            negative: format!("{negative_key} {}", secs(self.negative_secs)),
            negative_fix: f.negative_fix().into(),
            entry: format!("{entry_key} {}", secs(self.entry_secs)),
            entry_fix: f.entry_fix().into(),
        }
    }
}

#[derive(Serialize, Debug, PartialEq)]
pub(crate) struct Timing {
    #[serde(rename = "poll-interval")]
    pub poll_interval: String,
    #[serde(rename = "dead-after")]
    pub dead_after: String,
    #[serde(rename = "fs-timeout")]
    pub fs_timeout: String,
    pub rule: String,
}

#[derive(Serialize, Debug)]
pub(crate) struct Report {
    dir: String,
    scratch: String,
    filesystem: Option<Mount>,
    caches: Caches,
    checks: Vec<Check>,
    timing: Timing,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<super::doctor_nodes::SessionReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    not_measured: Option<String>,
    /// The slowest fsync measured, for a session's `[timing]`.
    #[serde(skip)]
    slowest_fsync: Duration,
    /// `.rl-node` and `doctor` when this process created them but could not remove them.
    #[serde(skip)]
    left_dirs: Vec<String>,
    /// How long a directory another doctor made may stay unseen through this client's
    /// caches, the words for it and the mount options that turn those caches off.
    #[serde(skip)]
    dir_wait: DirWait,
    /// MooseFS with a trash time its tools could read.
    #[serde(skip)]
    keeps_trash: bool,
}

const NOT_MEASURED: &str = "not measured by a single node: how long a write on one node takes to become visible on another, and the clock offset between nodes (run `rl-node doctor --nodes N` on every node at once to measure them)";

pub fn main(args: DoctorArgs) -> Result<Ending, Failure> {
    let path = args
        .log_path
        .clone()
        .or_else(|| std::env::var(crate::config::env_name("cluster.log-path")).ok())
        .ok_or_else(|| Failure::usage("rl-node doctor needs --log-path DIR", None))?;
    let dir = PathBuf::from(&path);
    super::check_log_path(&dir)?;
    match fs::metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(Failure::usage(
                format!("--log-path {path} is not a directory"),
                None,
            ))
        }
        Err(e) => {
            return Err(Failure::usage(
                format!("--log-path {path} does not exist or cannot be read ({e})"),
                Some(
                    "create the shared directory first, or pass the one the nodes will use".into(),
                ),
            ))
        }
    }
    let session = session_options(&args)?;
    let mut report = run(&dir)?;
    if let Some(opts) = session {
        report.not_measured = None;
        let summary = summary(&report);
        let outcome =
            super::doctor_nodes::run(&dir, opts, summary, &report.left_dirs, &report.dir_wait)?;
        report.checks.extend(outcome.checks);
        let mut unknown = report.caches.unknown();
        for u in &outcome.options_unknown {
            if !unknown.contains(&u.as_str()) {
                unknown.push(u);
            }
        }
        report.timing = recommend_with(
            report
                .caches
                .visibility_secs()
                .max(outcome.options_visibility_secs),
            &unknown,
            outcome.measured_visibility,
            report.slowest_fsync.max(outcome.slowest_fsync),
        );
        report.session = Some(outcome.report);
    }
    if args.json {
        crate::outln!("{}", serde_json::to_string_pretty(&report).expect("json"));
    } else {
        crate::out!("{}", render(&report));
    }
    // The report is the message: a failed check exits 1 without an `error:` line.
    let failed = report.checks.iter().any(|c| c.verdict == Verdict::Fail);
    Ok(if failed {
        Ending::Reported(Cause::Failed)
    } else {
        Ending::Done
    })
}

/// The session a multi-node doctor joins, or none for one node; bad flags are usage errors.
fn session_options(a: &DoctorArgs) -> Result<Option<super::doctor_nodes::Options>, Failure> {
    use super::doctor_nodes::{valid_session, Options, MAX_NODES};
    if a.nodes == 0 {
        return Err(Failure::usage("--nodes must be 1 or more", None));
    }
    // Checked before anything is created: the pair schedule (and its tables) grow as N².
    if a.nodes > MAX_NODES {
        return Err(Failure::usage(
            format!(
                "--nodes {} is out of range (1..{MAX_NODES}): a session measures every ordered pair, N×(N−1) of them",
                a.nodes
            ),
            None,
        ));
    }
    if a.nodes == 1 {
        // A session flag without a session would be silently ignored: refuse it instead.
        let given = [
            a.rank.map(|r| format!("--rank {r}")),
            a.session.as_ref().map(|s| format!("--session {s}")),
            a.samples.map(|k| format!("--samples {k}")),
            a.timeout
                .map(|t| format!("--timeout {}", humantime::format_duration(t))),
        ];
        if let Some(flag) = given.into_iter().flatten().next() {
            return Err(Failure::usage(
                format!("{flag} needs --nodes N of 2 or more"),
                None,
            ));
        }
        return Ok(None);
    }
    if let Some(r) = a.rank.filter(|r| *r >= a.nodes) {
        return Err(Failure::usage(
            format!(
                "--rank {r} is out of range for --nodes {} (0..{})",
                a.nodes,
                a.nodes - 1
            ),
            None,
        ));
    }
    // Every rank of one Slurm job sees the same job id; another job's doctors another.
    let session = a.session.clone().unwrap_or_else(|| {
        std::env::var("SLURM_JOB_ID")
            .ok()
            .map(|id| format!("slurm-{id}"))
            .filter(|s| valid_session(s))
            .unwrap_or_else(|| "default".into())
    });
    if !valid_session(&session) {
        return Err(Failure::usage(
            format!(
                "--session {session:?} is not a plain name (letters, digits, `.`, `_`, `-`; at most 64)"
            ),
            None,
        ));
    }
    let samples = a.samples.unwrap_or(DEFAULT_SAMPLES);
    if !(1..=1000).contains(&samples) {
        return Err(Failure::usage("--samples must be within 1..1000", None));
    }
    let timeout = a.timeout.unwrap_or(DEFAULT_TIMEOUT);
    // A deadline is now + timeout: the same bound as every duration of the configuration.
    let most = crate::config::ranges::MAX_DURATION;
    if timeout.is_zero() || timeout > most {
        return Err(Failure::usage(
            format!(
                "--timeout {} is out of range: more than 0 and at most {}",
                humantime::format_duration(timeout),
                humantime::format_duration(most)
            ),
            None,
        ));
    }
    Ok(Some(Options {
        nodes: a.nodes,
        rank: a.rank,
        session,
        samples,
        timeout,
    }))
}

/// This node's own findings, for rank 0's report (`rank` is filled in by the session,
/// once this node has claimed one).
fn summary(r: &Report) -> super::doctor_nodes::NodeSummary {
    let names = |v: Verdict| {
        r.checks
            .iter()
            .filter(|c| c.verdict == v)
            .map(|c| c.name.to_string())
            .collect()
    };
    super::doctor_nodes::NodeSummary {
        rank: 0,
        host: gethostname::gethostname().to_string_lossy().into_owned(),
        pid: std::process::id(),
        filesystem: r.filesystem.as_ref().map(|m| {
            format!(
                "{} at {} from {} ({})",
                m.fs_type,
                m.mount_point,
                m.source,
                m.options.join(",")
            )
        }),
        mount: r.filesystem.as_ref().map(|m| {
            format!(
                "{} ({}); attribute cache {}, entry cache {}, negative cache {}",
                m.fs_type,
                m.options.join(","),
                secs(r.caches.attribute_secs),
                secs(r.caches.entry_secs),
                secs(r.caches.negative_secs),
            )
        }),
        options_visibility_secs: r.caches.visibility_secs(),
        options_unknown: r.caches.unknown().iter().map(|u| u.to_string()).collect(),
        entry_fix: r.dir_wait.entry_fix.clone(),
        negative_fix: r.dir_wait.negative_fix.clone(),
        keeps_trash: r.keeps_trash,
        slowest_fsync_ms: r.slowest_fsync.as_secs_f64() * 1000.0,
        failed: names(Verdict::Fail),
        warned: names(Verdict::Warn),
    }
}

/// What `run` created and must remove, innermost last.
struct Scratch {
    created: Vec<PathBuf>,
    dir: PathBuf,
}

impl Scratch {
    /// `wait`: how long a directory another doctor made may stay unseen through this
    /// client's caches, and what to say if it stays so longer.
    fn create(root: &Path, wait: &DirWait) -> Result<Scratch, Failure> {
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        let base = root.join(".rl-node");
        let doctor = base.join("doctor");
        // The clock's nanoseconds as well: a pid reused after a doctor was killed must not
        // collide with what that one left.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = doctor.join(format!("{host}-{}-{nanos:08x}", std::process::id()));
        // No link someone planted at `.rl-node` or `doctor/` takes the probes elsewhere.
        crate::store::beneath::confine(root);
        Scratch::make([base, doctor, dir], wait)
    }

    /// Makes `chain` (`.rl-node/`, `doctor/`, the scratch directory, which must be new).
    fn make(chain: [PathBuf; 3], wait: &DirWait) -> Result<Scratch, Failure> {
        let mut s = Scratch {
            created: Vec::new(),
            dir: chain[2].clone(),
        };
        // Doctors on other nodes make and remove `.rl-node/` and `doctor/` meanwhile. On
        // an error, dropping `s` removes what this call made: an empty `.rl-node/` left
        // behind would read as a run that is starting.
        super::doctor_dirs::make_dirs(&chain, true, wait, &mut s.created)?;
        Ok(s)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // The scratch directory wholly; its parents only if this run made them and they
        // are empty (another rank's doctor may be using `doctor/`).
        if self.created.last() == Some(&self.dir) {
            let _ = fs::remove_dir_all(&self.dir);
        }
        for d in self.created.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    }
}

impl Scratch {
    /// Removes it (as dropping does) and names the parents this run created that are still
    /// there (another doctor was in them), so that a session can remove them at its end.
    fn remove(mut self) -> Vec<String> {
        let created = std::mem::take(&mut self.created);
        let dir = self.dir.clone();
        drop(Scratch {
            created: created.clone(),
            dir,
        });
        created
            .iter()
            .filter(|d| **d != self.dir && d.exists())
            .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect()
    }
}

fn run(dir: &Path) -> Result<Report, Failure> {
    let mount = mount_holding(dir);
    let caches = mount.as_ref().map(caches_of).unwrap_or_default();
    let family = mount.as_ref().map(Family::of);
    // Asked before the scratch exists: `.rl-node/` is then a run's, if there.
    let (trash, trash_secs) = super::doctor_caches::trash_check(family, dir).unzip();
    let keeps_trash = trash_secs.flatten().is_some_and(|t| t > 0);
    let dir_wait = caches.dir_wait(family);
    let scratch = Scratch::create(dir, &dir_wait)?;
    let s = &scratch.dir;
    if keeps_trash {
        super::doctor_caches::no_trash(s);
    }
    let mut checks = vec![mount_check(mount.as_ref(), &caches)];
    checks.extend(super::doctor_caches::configured_checks(
        family,
        caches.entry_secs,
        caches.negative_secs,
    ));
    checks.extend(trash);
    checks.push(rename_over(s));
    checks.push(exclusive_create(s));
    checks.push(hard_link(s));
    let (file_check, file_max) = fsync_file(s);
    let (dir_check, dir_max) = fsync_dir(s);
    checks.push(file_check);
    checks.push(dir_check);
    checks.extend(free_space(s));
    let slowest = file_max.max(dir_max);
    let timing = recommend(&caches, slowest);
    let scratch_shown = s.display().to_string();
    let left_dirs = scratch.remove();
    Ok(Report {
        dir: dir.display().to_string(),
        scratch: scratch_shown,
        filesystem: mount,
        caches,
        checks,
        timing,
        session: None,
        not_measured: Some(NOT_MEASURED.into()),
        slowest_fsync: slowest,
        left_dirs,
        dir_wait,
        keeps_trash,
    })
}

/// For a node at start: the longest time the mount holding `dir` may hide another node's
/// rewrite of a record from this one, as far as its options tell, and the options said,
/// when that matters for liveness: a FUSE mount's attribute, entry and negative caches
/// (NFS revalidates a record at every open). `None` when nothing is known or it is 0 s.
pub(crate) fn liveness_cache(dir: &Path) -> Option<(f64, String)> {
    let m = mount_holding(dir)?;
    if !m.fs_type.starts_with("fuse") {
        return None;
    }
    let c = caches_of(&m);
    let secs = c.visibility_secs();
    (secs > 0.0).then(|| {
        (
            secs,
            format!("{} ({}) at {}", m.source, m.fs_type, m.mount_point),
        )
    })
}

/// The filesystem holding `dir` (or its nearest existing ancestor) in words, e.g.
/// `ext4 (/dev/vda1 at /)`, for a node's message about a directory it cannot find.
pub(crate) fn filesystem_of(dir: &Path) -> Option<String> {
    filesystem(dir).map(|f| f.describe())
}

/// The mount table's line of the filesystem holding `dir` (or its nearest existing
/// ancestor), as rank 0 records it in the cluster record and workers compare it.
pub(crate) fn filesystem(dir: &Path) -> Option<crate::protocol::records::Filesystem> {
    let at = dir.ancestors().find_map(|d| fs::canonicalize(d).ok())?;
    let m = mount_of(&read_mounts().ok()?, &at)?;
    Some(crate::protocol::records::Filesystem {
        fs_type: m.fs_type,
        source: m.source,
        mount_point: m.mount_point,
    })
}

/// The /proc/mounts line of the mount holding `dir` (or its nearest ancestor that exists,
/// for a node whose directory is not made yet), with a FUSE daemon's options: sshfs and
/// other libfuse filesystems keep their caches on the daemon's command line.
fn mount_holding(dir: &Path) -> Option<Mount> {
    let mounts = read_mounts().ok()?;
    let at = dir.ancestors().find_map(|d| fs::canonicalize(d).ok())?;
    let mut m = mount_of(&mounts, &at)?;
    if m.fs_type.starts_with("fuse") {
        m.daemon = fuse_daemon(&m.mount_point);
    }
    Some(m)
}

fn read_mounts() -> std::io::Result<Vec<Mount>> {
    Ok(parse_mounts(&fs::read_to_string("/proc/mounts")?))
}

/// /proc/mounts lines; spaces and other bytes in paths are written as octal `\040`.
pub(crate) fn parse_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (source, point, ty, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
            Some(Mount {
                source: unescape(source),
                mount_point: unescape(point),
                fs_type: ty.to_string(),
                options: opts.split(',').map(str::to_string).collect(),
                daemon: None,
            })
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The FUSE daemon serving `mount_point`, found by its command line among this host's
/// processes (sshfs, s3fs, blobfuse2 and the like take the mount point as an argument and
/// their caching options as `-o`).
fn fuse_daemon(mount_point: &str) -> Option<FuseDaemon> {
    let want = Path::new(mount_point);
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(raw) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let cwd = fs::read_link(entry.path().join("cwd")).unwrap_or_default();
        let names_it = args.iter().skip(1).any(|a| {
            let a = Path::new(a);
            a == want || (a.is_relative() && cwd.join(a) == want)
        });
        if names_it && pid != std::process::id() {
            return Some(FuseDaemon {
                pid,
                options: daemon_options(&args),
            });
        }
    }
    None
}

/// The `-o a,b` and `-oa,b` options of a FUSE daemon's arguments.
pub(crate) fn daemon_options(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let list = match a.as_str() {
            "-o" => it.next().map(String::as_str),
            // GlusterFS's client: `--entry-timeout=0`.
            s if s.starts_with("--") && s.contains('=') => {
                out.push(s[2..].to_string());
                continue;
            }
            s => s.strip_prefix("-o"),
        };
        if let Some(list) = list {
            out.extend(
                list.split(',')
                    .filter(|o| !o.is_empty())
                    .map(str::to_string),
            );
        }
    }
    out
}

/// The mount holding `path` (canonical): the longest mount point that is a prefix of it,
/// the last such line winning (a later mount over the same point hides earlier ones).
pub(crate) fn mount_of(mounts: &[Mount], path: &Path) -> Option<Mount> {
    let mut best: Option<&Mount> = None;
    for m in mounts {
        if path.starts_with(&m.mount_point)
            && best.is_none_or(|b| m.mount_point.len() >= b.mount_point.len())
        {
            best = Some(m);
        }
    }
    best.cloned()
}

/// The options that matter for barriers, and what each implies.
pub(crate) fn caches_of(m: &Mount) -> Caches {
    let mut c = Caches::default();
    match Family::of(m) {
        Family::MooseFs => moosefs_caches(m, &mut c),
        Family::GlusterFs => glusterfs_caches(m, &mut c),
        Family::Nfs => nfs_caches(m, &mut c),
        Family::Fuse => fuse_caches(m, &mut c),
        Family::Lustre => {
            c.attribute_secs = Some(0.0);
            c.entry_secs = Some(0.0);
            c.negative_secs = Some(0.0);
            let lock = ["flock", "localflock", "noflock"]
                .into_iter()
                .find(|o| m.option(o).is_some())
                .unwrap_or("noflock (none given)");
            c.notes.push(format!("Lustre is coherent across clients (no attribute or negative cache delays); {lock}: rl-node does not rely on flock across nodes"));
        }
        Family::Local => {
            let ty = &m.fs_type;
            c.attribute_secs = Some(0.0);
            c.entry_secs = Some(0.0);
            c.negative_secs = Some(0.0);
            c.notes.push(format!("{ty}: a local filesystem: every change is seen at once on this host, but only this host can see it"));
        }
    }
    c
}

/// NFS: close-to-open, with attribute and lookup caches from the options (Linux defaults
/// otherwise).
fn nfs_caches(m: &Mount, c: &mut Caches) {
    // Close-to-open: an open revalidates the name, so a rename over is seen at once.
    c.entry_secs = Some(0.0);
    // Linux NFS defaults: acregmax 60 s, acdirmax 60 s; actimeo sets all four.
    let actimeo = m.secs("actimeo");
    if m.option("noac").is_some() {
        c.attribute_secs = Some(0.0);
        c.notes
            .push("noac: no attribute caching; every stat asks the server (fresh, slower)".into());
    } else {
        let reg = m.secs("acregmax").or(actimeo).unwrap_or(60.0);
        let dir = m.secs("acdirmax").or(actimeo).unwrap_or(60.0);
        c.attribute_secs = Some(reg.max(dir));
        c.notes.push(format!(
            "attribute cache: acregmax {reg}s, acdirmax {dir}s: a rewritten record's size and mtime may look unchanged for up to {}s (an open revalidates it: close-to-open), and a listing may be {dir}s stale",
            reg.max(dir)
        ));
    }
    let lookup = m.option("lookupcache").unwrap_or("all");
    match lookup {
        "none" | "pos" | "positive" => {
            c.negative_secs = Some(0.0);
            c.notes.push(format!("lookupcache={lookup}: a missing name is looked up again at every open, so a new file is seen at once"));
        }
        _ => {
            let dir = if m.option("noac").is_some() {
                0.0
            } else {
                m.secs("acdirmax").or(actimeo).unwrap_or(60.0)
            };
            c.negative_secs = Some(dir);
            if dir > 0.0 {
                c.notes.push(format!("lookupcache={lookup}: a name looked up while missing stays missing for up to {dir}s (acdirmax), so each wait for a new file can cost that much"));
                c.advice.push(
                    "mount with lookupcache=positive so a new name is seen at its next lookup"
                        .into(),
                );
            }
        }
    }
    if m.option("sync").is_some() {
        c.notes
            .push("sync: every write goes to the server at once (slower writes)".into());
    }
    if m.option("soft").is_some() {
        c.notes.push("soft: a call to an unreachable server fails with EIO after its retries instead of hanging".into());
        c.advice.push("prefer hard (the default): a soft mount can turn a slow server into a lost or torn write; rl-node's fs-timeout already stops a node stuck on a hard mount".into());
    } else {
        c.notes.push("hard: a call to an unreachable server hangs until it answers; rl-node's fs-timeout stops the node's commands meanwhile".into());
    }
}

/// Any other FUSE filesystem: libfuse's timeouts, from /proc/mounts and its daemon.
fn fuse_caches(m: &Mount, c: &mut Caches) {
    let ty = &m.fs_type;
    let keys = [
        "cache",
        "cache_timeout",
        "attr_timeout",
        "entry_timeout",
        "negative_timeout",
        "ac_attr_timeout",
        "auto_cache",
        "kernel_cache",
        "file_cache_timeout",
        "attr_timeout_secs",
    ];
    let shown: Vec<String> = keys
        .iter()
        .filter_map(|k| {
            m.option(k).map(|v| {
                if v.is_empty() {
                    k.to_string()
                } else {
                    format!("{k}={v}")
                }
            })
        })
        .collect();
    let attr = [
        "attr_timeout",
        "cache_timeout",
        "ac_attr_timeout",
        "file_cache_timeout",
    ]
    .iter()
    .filter_map(|k| m.secs(k))
    .reduce(f64::max);
    let neg = m.secs("negative_timeout");
    c.attribute_secs = attr;
    c.entry_secs = m.secs("entry_timeout");
    c.negative_secs = neg;
    let from = match &m.daemon {
        Some(d) => format!(
            "/proc/mounts and the FUSE daemon's command line (pid {})",
            d.pid
        ),
        None => "/proc/mounts".to_string(),
    };
    if shown.is_empty() {
        c.notes.push(format!("{ty}: {from} show no caching options (the FUSE daemon keeps them); its caches may delay other nodes' changes by its own timeouts (blob FUSE: minutes)"));
    } else {
        c.notes
            .push(format!("{ty} caching options: {}", shown.join(", ")));
    }
    if let Some(a) = attr {
        c.notes.push(format!(
            "attribute cache: a rewritten file may look unchanged for up to {a}s"
        ));
    }
    if let Some(e) = c.entry_secs.filter(|e| *e > 0.0) {
        c.notes.push(format!(
            "entry_timeout={e}: a file another node renames over may be read stale for up to {e}s"
        ));
    }
    if let Some(n) = neg.filter(|n| *n > 0.0) {
        c.notes.push(format!("negative_timeout={n}: a name looked up while missing stays missing for up to {n}s, so each wait for a new file can cost that much"));
        c.advice.push(format!("mount with negative_timeout=0 so a new name is seen at its next lookup (now up to {n}s per wait for a new file)"));
    }
    c.notes.push("rename on some FUSE filesystems (blob storage) is copy + delete: see the rename-over check".into());
}

/// MooseFS keeps its mount options in `<mount point>/.params`, not in /proc/mounts.
fn moosefs_caches(m: &Mount, c: &mut Caches) {
    match super::doctor_caches::read_params(&m.mount_point) {
        Ok(p) => {
            (c.attribute_secs, c.entry_secs, c.negative_secs) = (p.attr, p.entry, p.negentry);
            c.notes.push(format!(
                "MooseFS caches from {}/.params: mfsattrcacheto {}, mfsentrycacheto {}, mfsdirentrycacheto {}, mfsnegentrycacheto {}",
                m.mount_point,
                secs(p.attr),
                secs(p.entry),
                secs(p.direntry),
                secs(p.negentry)
            ));
        }
        Err(e) => c
            .notes
            .push(format!("MooseFS: {e}: its caches are unknown")),
    }
    if let Some(e) = c.entry_secs.filter(|e| *e > 0.0) {
        c.notes.push(format!("mfsentrycacheto {e}s: a file another node renames over may be read stale for up to {e}s"));
    }
    if let Some(n) = c.negative_secs.filter(|n| *n > 0.0) {
        c.notes.push(format!("mfsnegentrycacheto {n}s: a name looked up while missing stays missing for up to {n}s, and mkdir of it answers EEXIST meanwhile"));
        c.advice.push(format!("mount with mfsnegentrycacheto=0 so a new name is seen at its next lookup (now up to {n}s per wait for a new file)"));
    }
    c.notes
        .push("MooseFS keeps replaced and deleted files in its trash: see the trash check".into());
}

/// GlusterFS's client takes its caches as `--attribute-timeout=` and the like (from the
/// mount's `-o`); when the client is found, an option it lacks has GlusterFS's default.
fn glusterfs_caches(m: &Mount, c: &mut Caches) {
    let default = |v: f64| m.daemon.as_ref().map(|_| v);
    c.attribute_secs = m.secs("attribute-timeout").or(default(1.0));
    c.entry_secs = m.secs("entry-timeout").or(default(1.0));
    c.negative_secs = m.secs("negative-timeout").or(default(0.0));
    c.notes.push(format!(
        "GlusterFS caches (from its client's command line, else its defaults): attribute-timeout {}, entry-timeout {}, negative-timeout {}",
        secs(c.attribute_secs),
        secs(c.entry_secs),
        secs(c.negative_secs)
    ));
    if let Some(n) = c.negative_secs.filter(|n| *n > 0.0) {
        c.advice.push(format!("mount with negative-timeout=0 so a new name is seen at its next lookup (now up to {n}s per wait for a new file)"));
    }
}

fn mount_check(m: Option<&Mount>, c: &Caches) -> Check {
    let Some(m) = m else {
        return Check::not_ok(
            "mount",
            Verdict::Warn,
            "no /proc/mounts line holds the directory".into(),
            "check that /proc is mounted; the cache options could not be read, so the [timing] below assumes none".into(),
        );
    };
    let evidence = format!(
        "type {} at {} from {} ({}); {}",
        m.fs_type,
        m.mount_point,
        m.source,
        m.options.join(","),
        c.notes.join("; ")
    );
    if c.advice.is_empty() {
        Check::ok("mount", evidence)
    } else {
        Check::not_ok("mount", Verdict::Warn, evidence, c.advice.join("; "))
    }
}

/// A record's content that tells a whole file from a torn one: a length line, then that
/// many bytes of one repeated letter.
fn record(i: usize) -> Vec<u8> {
    let body = vec![b'a' + (i % 26) as u8; 4096 + i % 1000];
    let mut v = format!("{}\n", body.len()).into_bytes();
    v.extend_from_slice(&body);
    v
}

fn whole(bytes: &[u8]) -> bool {
    let Some(nl) = bytes.iter().position(|&b| b == b'\n') else {
        return false;
    };
    let (head, body) = (&bytes[..nl], &bytes[nl + 1..]);
    std::str::from_utf8(head)
        .ok()
        .and_then(|h| h.parse::<usize>().ok())
        == Some(body.len())
        && body.first().is_some_and(|&c| body.iter().all(|&b| b == c))
}

/// A reader re-reads a record while a writer replaces it by rename `RENAMES` times: it must
/// never find the name missing or the content torn, which is what rl-node's records rely on.
fn rename_over(dir: &Path) -> Check {
    const NAME: &str = "rename-over";
    let target = dir.join("record");
    if let Err(e) = fs::write(&target, record(0)) {
        return Check::not_ok(
            NAME,
            Verdict::Fail,
            format!("cannot write {}: {e}", target.display()),
            "make the directory writable by this user".into(),
        );
    }
    let done = AtomicBool::new(false);
    let (mut reads, mut missing, mut torn, mut other) = (0u64, 0u64, 0u64, None);
    let writer = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let (mut reads, mut missing, mut torn, mut other) = (0u64, 0u64, 0u64, None);
            while !done.load(Ordering::Acquire) {
                match fs::read(&target) {
                    Ok(b) if whole(&b) => {}
                    Ok(_) => torn += 1,
                    Err(e) if e.kind() == ErrorKind::NotFound => missing += 1,
                    Err(e) => other = Some(e.to_string()),
                }
                reads += 1;
            }
            (reads, missing, torn, other)
        });
        let wrote = (|| -> std::io::Result<Duration> {
            let start = Instant::now();
            for i in 1..=RENAMES {
                let tmp = dir.join(format!("record.tmp{i}"));
                fs::write(&tmp, record(i))?;
                fs::rename(&tmp, &target)?;
            }
            Ok(start.elapsed())
        })();
        done.store(true, Ordering::Release);
        (reads, missing, torn, other) = reader.join().expect("reader thread");
        wrote
    });
    let took = match writer {
        Ok(t) => t,
        Err(e) => return Check::not_ok(NAME, Verdict::Fail, format!("writing or renaming over {}: {e}", target.display()), "rl-node publishes every record by rename over the old one: it needs rename to work here".into()),
    };
    let evidence = format!(
        "{RENAMES} renames over an existing file in {}, a reader re-read it {reads} times: {missing} missing, {torn} torn{}",
        ms(took),
        other.as_deref().map(|e| format!(", other error: {e}")).unwrap_or_default()
    );
    if missing == 0 && torn == 0 && other.is_none() {
        Check::ok(NAME, evidence)
    } else {
        Check::not_ok(NAME, Verdict::Fail, evidence, "rl-node publishes every record by rename over the old one and expects a reader to find the old or the new one, never none or half of one; here a reader on this very client did not (blob FUSE renames by copy + delete; a FUSE client may drop the name while it renames): put the shared directory on NFS, Lustre or GPFS, or a FUSE mount whose rename is atomic for readers".into())
    }
}

/// O_EXCL: the second create of one name must fail, or two nodes could both believe they
/// were first.
fn exclusive_create(dir: &Path) -> Check {
    const NAME: &str = "exclusive-create";
    let p = dir.join("exclusive");
    let create = || OpenOptions::new().write(true).create_new(true).open(&p);
    let advice = "rl-node needs O_EXCL create to be exclusive (NFSv3+ and Lustre give it); use a filesystem that does".to_string();
    match create() {
        Err(e) => Check::not_ok(
            NAME,
            Verdict::Fail,
            format!("first create of {} failed: {e}", p.display()),
            advice,
        ),
        Ok(_) => match create() {
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Check::ok(
                NAME,
                "a second O_EXCL create of the same name failed with EEXIST, as it must".into(),
            ),
            Err(e) => Check::not_ok(
                NAME,
                Verdict::Fail,
                format!("the second O_EXCL create failed, but not with EEXIST: {e}"),
                advice,
            ),
            Ok(_) => Check::not_ok(
                NAME,
                Verdict::Fail,
                "a second O_EXCL create of the same name succeeded".into(),
                advice,
            ),
        },
    }
}

/// link(2) onto an existing name must fail: the abort and other first-writer-wins files are
/// written aside and hard-linked into place.
fn hard_link(dir: &Path) -> Check {
    const NAME: &str = "hard-link";
    let (a, b, target) = (dir.join("link-a"), dir.join("link-b"), dir.join("linked"));
    if let Err(e) = fs::write(&a, b"a").and_then(|()| fs::write(&b, b"b")) {
        return Check::not_ok(
            NAME,
            Verdict::Fail,
            format!("cannot write in {}: {e}", dir.display()),
            "make the directory writable by this user".into(),
        );
    }
    match fs::hard_link(&a, &target) {
        Err(e) => Check::not_ok(NAME, Verdict::Warn, format!("no hard links here: link failed with {e}"), "rl-node then falls back to an O_EXCL create for first-writer-wins files (the abort), which a reader may find before it is fully written, and to check-then-rename when it moves output into place, which is not atomic; prefer a filesystem with hard links (NFS, Lustre, GPFS)".into()),
        Ok(()) => match fs::hard_link(&b, &target) {
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                let same = fs::read(&target).map(|t| t == b"a").unwrap_or(false);
                if same {
                    Check::ok(NAME, "link onto a new name succeeded; link onto an existing name failed with EEXIST and left the first file".into())
                } else {
                    Check::not_ok(NAME, Verdict::Fail, "link onto an existing name failed, but the first file's content changed".into(), "first-writer-wins is not safe here; use NFS, Lustre or GPFS".into())
                }
            }
            Err(e) => Check::not_ok(NAME, Verdict::Fail, format!("link onto an existing name failed, but not with EEXIST: {e}"), "rl-node tells 'someone was first' by EEXIST; use a filesystem that reports it".into()),
            Ok(()) => Check::not_ok(NAME, Verdict::Fail, "link onto an existing name succeeded (it must fail)".into(), "first-writer-wins is broken here: two nodes could both claim the abort; use NFS, Lustre or GPFS".into()),
        },
    }
}

/// Timed fsyncs: `op` run `FSYNCS` times. Returns the check and the slowest one.
fn timed(
    name: &'static str,
    what: &str,
    mut op: impl FnMut(usize) -> std::io::Result<()>,
) -> (Check, Duration) {
    let mut times = Vec::with_capacity(FSYNCS);
    for i in 0..FSYNCS {
        let start = Instant::now();
        if let Err(e) = op(i) {
            return (
                Check::not_ok(name, Verdict::Fail, format!("fsync of {what} failed: {e}"), "rl-node fsyncs every state file and its directory before it counts as written; a filesystem whose fsync fails cannot hold a run's state".into()),
                Duration::ZERO,
            );
        }
        times.push(start.elapsed());
    }
    times.sort();
    let (median, max) = (times[times.len() / 2], times[times.len() - 1]);
    let evidence = format!(
        "{FSYNCS} fsyncs of {what}: median {}, slowest {}",
        ms(median),
        ms(max)
    );
    if max > SLOW_FSYNC {
        let c = Check::not_ok(name, Verdict::Warn, evidence, format!("fsync is slower than {}: every record commit waits for it; a loaded server? the recommended fs-timeout below accounts for it", ms(SLOW_FSYNC)));
        (c, max)
    } else {
        (Check::ok(name, evidence), max)
    }
}

fn fsync_file(dir: &Path) -> (Check, Duration) {
    let p = dir.join("fsync");
    timed("fsync-file", "a 4 KiB file after each write", |i| {
        let mut f = File::create(&p)?;
        f.write_all(&record(i)[..4096])?;
        f.sync_all()
    })
}

fn fsync_dir(dir: &Path) -> (Check, Duration) {
    timed("fsync-dir", "the directory after each new name", |i| {
        fs::write(dir.join(format!("entry{i}")), b"x")?;
        File::open(dir)?.sync_all()
    })
}

fn free_space(dir: &Path) -> Vec<Check> {
    let c = match std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) {
        Ok(c) => c,
        Err(e) => {
            return vec![Check::not_ok(
                "free-space",
                Verdict::Warn,
                e.to_string(),
                "use a path without NUL".into(),
            )]
        }
    };
    let st = match rustix::fs::statvfs(c.as_c_str()) {
        Ok(st) => st,
        Err(e) => {
            return vec![Check::not_ok(
                "free-space",
                Verdict::Warn,
                format!("statvfs failed: {}", std::io::Error::from(e)),
                "free space could not be read; check it with df".into(),
            )];
        }
    };
    let (bytes, total, inodes, files) = (
        st.f_bavail * st.f_frsize,
        st.f_blocks * st.f_frsize,
        st.f_favail,
        st.f_files,
    );
    let space_ev = format!("{} free of {}", gib(bytes), gib(total));
    let space = if bytes < MIN_FREE_BYTES {
        Check::not_ok("free-space", Verdict::Warn, space_ev, format!("less than {} free: trajectories, checkpoints and logs will fill it; free space or use a larger filesystem", gib(MIN_FREE_BYTES)))
    } else {
        Check::ok("free-space", space_ev)
    };
    // Some filesystems (FUSE, btrfs) report no inode counts: nothing to judge.
    let inodes = if files == 0 {
        Check::ok(
            "free-inodes",
            "the filesystem reports no inode counts (no fixed limit)".into(),
        )
    } else if inodes < MIN_FREE_INODES {
        Check::not_ok("free-inodes", Verdict::Warn, format!("{inodes} free of {files}"), format!("fewer than {MIN_FREE_INODES} free inodes: every rank writes several files per iteration; remove old runs or use another filesystem"))
    } else {
        Check::ok("free-inodes", format!("{inodes} free of {files}"))
    };
    vec![space, inodes]
}

/// The recommended `[timing]`. The rule (also printed):
/// - poll-interval: a poll more often than the caches refresh only loads the server, so
///   a tenth of the longest cache delay V, within 1 s (the default) and 10 s;
/// - dead-after: a heartbeat (every 5 s) may be unseen for V, and a slow fsync delays its
///   commit, so max(60 s (the default), 3 V + 2 heartbeats + 10 × slowest fsync): never
///   below 2 V + one heartbeat, under which a live rank can be declared dead;
/// - fs-timeout: a call slower than this is taken for a hung mount, so it must sit well
///   above the slowest measured call: max(2 m (the default), 100 × slowest fsync).
///
/// Each is rounded up to whole seconds (minutes from 2 m on).
pub(crate) fn recommend(c: &Caches, slowest_fsync: Duration) -> Timing {
    recommend_with(c.visibility_secs(), &c.unknown(), None, slowest_fsync)
}

/// As [`recommend`], with V the larger of what the mount options imply (`options_secs`,
/// `unknown` naming the caches they do not tell) and the slowest visibility measured
/// between nodes (a rewrite, a new name, a stale rename), if any.
pub(crate) fn recommend_with(
    options_secs: f64,
    unknown: &[&str],
    measured: Option<Duration>,
    slowest_fsync: Duration,
) -> Timing {
    let measured_secs = measured.map(|d| d.as_secs_f64());
    let v = options_secs.max(measured_secs.unwrap_or(0.0));
    let f = slowest_fsync.as_secs_f64();
    let poll = (v / 10.0).clamp(1.0, 10.0);
    let dead = (3.0 * v + 10.0 + 10.0 * f).max(60.0);
    let fs_timeout = (100.0 * f).max(120.0);
    Timing {
        poll_interval: duration(poll),
        dead_after: duration(dead),
        fs_timeout: duration(fs_timeout),
        rule: format!(
            "V = longest cache delay from the mount options ({}{}){}, F = slowest fsync ({}); poll-interval = V/10 within 1s..10s; dead-after = max(60s, 3V + 2 heartbeats (10s) + 10F), never below 2V + one heartbeat; fs-timeout = max(2m, 100F)",
            secs(Some(options_secs)),
            if unknown.is_empty() {
                String::new()
            } else {
                format!(
                    "; unknown: {} cache{}, not counted{}",
                    unknown.join(", "),
                    if unknown.len() > 1 { "s" } else { "" },
                    if measured.is_some() { "" } else { ": measure with --nodes N" }
                )
            },
            measured.map(|d| format!(" or measured between nodes ({}), the larger", ms(d))).unwrap_or_default(),
            ms(slowest_fsync)
        ),
    }
}

fn duration(secs: f64) -> String {
    let s = secs.ceil() as u64;
    if s >= 120 {
        format!("{}m", s.div_ceil(60))
    } else {
        format!("{s}s")
    }
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "rl-node doctor: {}", r.dir);
    if let Some(m) = &r.filesystem {
        let _ = writeln!(
            s,
            "filesystem: {} ({} on {})",
            m.fs_type, m.source, m.mount_point
        );
    }
    let _ = writeln!(s, "scratch: {} (removed)\n", r.scratch);
    for c in &r.checks {
        let _ = writeln!(s, "{:<5} {:<19} {}", c.verdict.word(), c.name, c.evidence);
        if let Some(a) = &c.advice {
            let _ = writeln!(s, "      {:<19} change: {a}", "");
        }
    }
    if let Some(n) = &r.session {
        super::doctor_nodes::render(&mut s, n);
    }
    let (fails, warns) = (
        r.checks
            .iter()
            .filter(|c| c.verdict == Verdict::Fail)
            .count(),
        r.checks
            .iter()
            .filter(|c| c.verdict == Verdict::Warn)
            .count(),
    );
    let _ = writeln!(
        s,
        "\n{} checks: {} ok, {warns} warn, {fails} failed\n",
        r.checks.len(),
        r.checks.len() - warns - fails
    );
    let _ = writeln!(
        s,
        "# Recommended for this filesystem. Rule: {}",
        r.timing.rule
    );
    let _ = writeln!(s, "[timing]");
    let _ = writeln!(s, "poll-interval = \"{}\"", r.timing.poll_interval);
    let _ = writeln!(s, "dead-after = \"{}\"", r.timing.dead_after);
    let _ = writeln!(s, "fs-timeout = \"{}\"", r.timing.fs_timeout);
    if let Some(n) = &r.not_measured {
        let _ = writeln!(s, "\nNote: {n}.");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_that_cannot_be_made_leaves_nothing_it_made() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join(".rl-node");
        let doctor = base.join("doctor");
        // A name longer than any filesystem takes: mkdir fails after the first two.
        let dir = doctor.join("x".repeat(300));
        let wait = Caches::default().dir_wait(None);
        assert!(Scratch::make([base.clone(), doctor, dir], &wait).is_err());
        // An empty `.rl-node/` left behind would read as a run that is starting.
        assert!(!base.exists(), "{} left behind", base.display());
    }

    fn mount(ty: &str, opts: &str) -> Mount {
        parse_mounts(&format!("srv:/x /mnt/a\\040b {ty} {opts} 0 0\n")).remove(0)
    }

    #[test]
    fn mounts_are_parsed_and_the_longest_prefix_holds_a_path() {
        let ms = parse_mounts("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw,size=1k 0 0\n");
        assert_eq!(
            mount_of(&ms, Path::new("/dev/shm/x")).unwrap().fs_type,
            "tmpfs"
        );
        assert_eq!(
            mount_of(&ms, Path::new("/dev/shmx")).unwrap().fs_type,
            "ext4"
        );
        assert_eq!(mount("nfs", "rw").mount_point, "/mnt/a b");
    }

    #[test]
    fn nfs_defaults_cache_new_names_for_a_minute() {
        let c = caches_of(&mount("nfs4", "rw,hard"));
        assert_eq!(
            (c.attribute_secs, c.negative_secs),
            (Some(60.0), Some(60.0))
        );
        assert!(!c.advice.is_empty());
        let c = caches_of(&mount("nfs", "rw,actimeo=3,lookupcache=positive"));
        assert_eq!((c.attribute_secs, c.negative_secs), (Some(3.0), Some(0.0)));
        assert!(c.advice.is_empty());
        let c = caches_of(&mount("nfs", "rw,noac,soft"));
        assert_eq!((c.attribute_secs, c.negative_secs), (Some(0.0), Some(0.0)));
        assert_eq!(c.advice.len(), 1);
    }

    #[test]
    fn fuse_options_are_read_when_shown() {
        let c = caches_of(&mount(
            "fuse.sshfs",
            "rw,cache_timeout=5,negative_timeout=7",
        ));
        assert_eq!((c.attribute_secs, c.negative_secs), (Some(5.0), Some(7.0)));
        let c = caches_of(&mount("fuse.sshfs", "rw,user_id=0"));
        assert_eq!((c.attribute_secs, c.negative_secs), (None, None));
        let args: Vec<String> = [
            "sshfs",
            "-f",
            "-o",
            "a=1,negative_timeout=4",
            "-oattr_timeout=0",
            "h:/x",
            "/m",
        ]
        .map(String::from)
        .into();
        let mut m = mount("fuse.sshfs", "rw");
        m.daemon = Some(FuseDaemon {
            pid: 1,
            options: daemon_options(&args),
        });
        assert_eq!(
            m.daemon.as_ref().unwrap().options,
            ["a=1", "negative_timeout=4", "attr_timeout=0"]
        );
        let c = caches_of(&m);
        assert_eq!((c.attribute_secs, c.negative_secs), (Some(0.0), Some(4.0)));
    }

    #[test]
    fn timing_follows_the_rule() {
        let local = recommend(&Caches::default(), Duration::from_millis(2));
        assert_eq!(
            (
                local.poll_interval.as_str(),
                local.dead_after.as_str(),
                local.fs_timeout.as_str()
            ),
            ("1s", "60s", "2m")
        );
        let nfs = caches_of(&mount("nfs", "rw"));
        let t = recommend(&nfs, Duration::from_secs(2));
        assert_eq!(
            (
                t.poll_interval.as_str(),
                t.dead_after.as_str(),
                t.fs_timeout.as_str()
            ),
            ("6s", "4m", "4m")
        );
    }

    #[test]
    fn a_measured_delay_raises_v_over_the_options() {
        // sshfs negative_timeout=2 measured at 2.3 s, options saying 2 s: V = 2.3 s.
        let t = recommend_with(2.0, &[], Some(Duration::from_millis(2300)), Duration::ZERO);
        assert_eq!(t.poll_interval, "1s");
        assert!(
            t.rule.contains("measured between nodes (2300ms)"),
            "{}",
            t.rule
        );
        // A default NFS mount measured slow: 90 s of new-name delay beats acdirmax 60 s.
        let t = recommend_with(60.0, &[], Some(Duration::from_secs(90)), Duration::ZERO);
        assert_eq!(
            (t.poll_interval.as_str(), t.dead_after.as_str()),
            ("9s", "5m")
        );
        // Measured faster than the options say: the options still bound it.
        let t = recommend_with(60.0, &[], Some(Duration::from_millis(5)), Duration::ZERO);
        assert_eq!(
            (t.poll_interval.as_str(), t.dead_after.as_str()),
            ("6s", "4m")
        );
    }

    /// Liveness holds (no live rank declared dead) at dead-after ≥ 2 × the longest cache +
    /// one heartbeat: a MooseFS entry cache alone counts, and an unknown cache is said.
    #[test]
    fn dead_after_covers_twice_the_longest_cache_and_a_heartbeat() {
        let heartbeat = 5.0;
        let entry_only = Caches {
            attribute_secs: Some(0.0),
            entry_secs: Some(30.0),
            negative_secs: Some(0.0),
            ..Caches::default()
        };
        let t = recommend(&entry_only, Duration::ZERO);
        let dead = humantime::parse_duration(&t.dead_after)
            .unwrap()
            .as_secs_f64();
        assert!(dead >= 2.0 * 30.0 + heartbeat, "{t:?}");
        for (attr, entry, neg) in [(1.0, 1.0, 1.0), (60.0, 0.0, 60.0), (0.0, 7.5, 2.0)] {
            let c = Caches {
                attribute_secs: Some(attr),
                entry_secs: Some(entry),
                negative_secs: Some(neg),
                ..Caches::default()
            };
            let t = recommend(&c, Duration::from_millis(3));
            let dead = humantime::parse_duration(&t.dead_after)
                .unwrap()
                .as_secs_f64();
            let longest: f64 = attr.max(entry).max(neg);
            assert!(dead >= 2.0 * longest + heartbeat, "{c:?}: {t:?}");
        }
        let unknown = Caches {
            attribute_secs: Some(1.0),
            ..Caches::default()
        };
        assert_eq!(unknown.unknown(), ["entry", "negative"]);
        let t = recommend(&unknown, Duration::ZERO);
        assert!(
            t.rule.contains(
                "(1s; unknown: entry, negative caches, not counted: measure with --nodes N)"
            ),
            "{}",
            t.rule
        );
    }

    #[test]
    fn moosefs_is_told_by_its_source_and_its_caches_unknown_without_params() {
        let m =
            parse_mounts("mfs\\04310.0.0.1:9421 /no/such/mount fuse rw,user_id=0 0 0\n").remove(0);
        assert_eq!(m.source, "mfs#10.0.0.1:9421");
        assert_eq!(Family::of(&m), Family::MooseFs);
        let c = caches_of(&m);
        assert_eq!(
            (c.attribute_secs, c.entry_secs, c.negative_secs),
            (None, None, None)
        );
        assert!(
            c.notes[0].starts_with("MooseFS: cannot read /no/such/mount/.params"),
            "{:?}",
            c.notes
        );
        assert_eq!(c.visibility_secs(), 0.0);
        assert_eq!(c.unknown().len(), 3);
    }

    #[test]
    fn glusterfs_caches_come_from_its_clients_arguments_else_its_defaults() {
        let args: Vec<String> = [
            "/usr/sbin/glusterfs",
            "--process-name",
            "fuse",
            "--volfile-server=srv",
            "--entry-timeout=0",
            "/mnt/g",
        ]
        .map(String::from)
        .into();
        let mut m = mount("fuse.glusterfs", "rw");
        assert_eq!(Family::of(&m), Family::GlusterFs);
        let c = caches_of(&m);
        assert_eq!(
            c.unknown(),
            ["attribute", "entry", "negative"],
            "no client found"
        );
        m.daemon = Some(FuseDaemon {
            pid: 1,
            options: daemon_options(&args),
        });
        let c = caches_of(&m);
        assert_eq!(
            (c.attribute_secs, c.entry_secs, c.negative_secs),
            (Some(1.0), Some(0.0), Some(0.0))
        );
    }

    #[test]
    fn torn_records_are_told_from_whole_ones() {
        assert!(whole(&record(3)));
        assert!(!whole(&record(3)[..100]));
        assert!(!whole(b""));
    }
}
