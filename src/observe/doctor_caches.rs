//! What the doctor knows of a mount's name caches, per filesystem family: where their
//! values are read (MooseFS keeps its mount options in `<mount>/.params`, not in
//! /proc/mounts), which mount option turns each off, and the trash MooseFS keeps of every
//! file replaced or deleted (docs/shared-directory.md, "Checking a filesystem").
//!
//! Two caches matter to rl-node beyond the attribute cache. The *entry* cache (FUSE
//! `entry_timeout`) trusts a name → file mapping without asking the server, so a record
//! another node renamed over is read stale until it expires: every barrier hop can wait
//! that long. The *negative* cache trusts "no such name", so a directory another node made
//! answers EEXIST to `mkdir` and ENOENT to `stat` meanwhile. A value the doctor cannot read
//! is unknown, and said so; it is never taken for 0 s.

use super::doctor_report::{Check, Mount, Verdict};
use std::io::Read;
use std::path::Path;
use std::time::Duration;

/// How long `mfsgettrashtime` and `mfssettrashtime` may take: they ask the master, which
/// answers in milliseconds; one that cannot reach it retries for 9 s.
const TOOL_LIMIT: Duration = Duration::from_secs(5);
/// `.params` is a few kilobytes; a bound all the same.
const MAX_PARAMS: u64 = 64 * 1024;

/// The families whose caches and fixes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    MooseFs,
    GlusterFs,
    Nfs,
    Lustre,
    /// Any other FUSE filesystem (sshfs, s3fs, blobfuse, gcsfuse…): libfuse's options.
    Fuse,
    Local,
}

impl Family {
    pub(crate) fn of(m: &Mount) -> Family {
        let ty = m.fs_type.as_str();
        if m.source.starts_with("mfs#") || ty == "fuse.mfs" || ty == "fuse.moosefs" {
            Family::MooseFs
        } else if ty == "fuse.glusterfs" || ty == "glusterfs" {
            Family::GlusterFs
        } else if ty == "nfs" || ty == "nfs4" {
            Family::Nfs
        } else if ty == "lustre" {
            Family::Lustre
        } else if ty == "fuse" || ty.starts_with("fuse.") || ty == "fuseblk" {
            Family::Fuse
        } else {
            Family::Local
        }
    }

    /// The mount option that stops a rename over an existing name being read stale.
    pub(crate) fn entry_fix(self) -> &'static str {
        match self {
            Family::MooseFs => "mount with mfsentrycacheto=0 (mfsmount -o mfsentrycacheto=0)",
            Family::GlusterFs => "mount with entry-timeout=0 (mount -t glusterfs -o entry-timeout=0)",
            Family::Nfs => "mount with lookupcache=none, or a short actimeo (e.g. actimeo=1): NFS trusts a name while its directory's attributes are cached",
            Family::Fuse => "mount with entry_timeout=0 (-o entry_timeout=0; sshfs and other libfuse filesystems take it)",
            Family::Lustre | Family::Local => "set the filesystem's name (entry) cache timeout to 0",
        }
    }

    /// The mount option that stops a name another node made staying hidden.
    pub(crate) fn negative_fix(self) -> &'static str {
        match self {
            Family::MooseFs => "mount with mfsnegentrycacheto=0 (mfsmount -o mfsnegentrycacheto=0)",
            Family::GlusterFs => {
                "mount with negative-timeout=0 (mount -t glusterfs -o negative-timeout=0)"
            }
            Family::Nfs => "mount with lookupcache=positive",
            Family::Fuse => "mount with negative_timeout=0 (-o negative_timeout=0)",
            Family::Lustre | Family::Local => {
                "set the filesystem's negative-lookup cache timeout to 0"
            }
        }
    }

    /// The option that sets the entry cache, and the negative cache, for messages.
    pub(crate) fn keys(self) -> (&'static str, &'static str) {
        match self {
            Family::MooseFs => ("mfsentrycacheto", "mfsnegentrycacheto"),
            Family::GlusterFs => ("entry-timeout", "negative-timeout"),
            Family::Nfs => ("lookupcache", "lookupcache/acdirmax"),
            Family::Fuse => ("entry_timeout", "negative_timeout"),
            Family::Lustre | Family::Local => ("no entry cache", "no negative cache"),
        }
    }
}

/// MooseFS's kernel caches, from `.params` (seconds; `None`: not in it).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Params {
    pub attr: Option<f64>,
    pub entry: Option<f64>,
    pub direntry: Option<f64>,
    pub negentry: Option<f64>,
}

/// `.params` lines are `key: value`; a value that is not a number (`(not defined)`) is
/// unknown.
pub(crate) fn parse_params(text: &str) -> Params {
    let get = |key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().parse::<f64>().ok())?
        })
    };
    Params {
        attr: get("mfsattrcacheto"),
        entry: get("mfsentrycacheto"),
        direntry: get("mfsdirentrycacheto"),
        negentry: get("mfsnegentrycacheto"),
    }
}

/// `<mount point>/.params` of a MooseFS client, read with a bound.
pub(crate) fn read_params(mount_point: &str) -> Result<Params, String> {
    let path = Path::new(mount_point).join(".params");
    let mut text = String::new();
    std::fs::File::open(&path)
        .and_then(|f| f.take(MAX_PARAMS).read_to_string(&mut text))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(parse_params(&text))
}

/// Seconds as the report says them: `1s`, `0.5s`, or `unknown`.
pub(crate) fn secs(v: Option<f64>) -> String {
    match v {
        Some(s) => format!("{}s", (s * 1000.0).round() / 1000.0),
        None => "unknown".into(),
    }
}

/// The single-node checks of the two caches: one client cannot see another's changes, so
/// they say what the configured values imply (a session with `--nodes` measures them).
pub(crate) fn configured_checks(
    family: Option<Family>,
    entry: Option<f64>,
    negative: Option<f64>,
) -> Vec<Check> {
    let Some(f) = family else {
        let unknown = "no mount line holds the directory: its caches are unknown; run `rl-node doctor --nodes N` on every node to measure them";
        return vec![
            Check::not_ok(
                "eexist-enoent",
                Verdict::Warn,
                unknown.into(),
                "check that /proc is mounted".into(),
            ),
            Check::not_ok(
                "stale-rename",
                Verdict::Warn,
                unknown.into(),
                "check that /proc is mounted".into(),
            ),
        ];
    };
    let (entry_key, negative_key) = f.keys();
    let measure =
        "one node cannot observe it: run `rl-node doctor --nodes N` on every node to measure it";
    let eexist = match negative {
        Some(s) if s <= 0.0 => Check::ok("eexist-enoent", format!("negative-lookup cache {} ({negative_key}): a directory another node made is seen by stat as soon as mkdir finds it", secs(negative))),
        Some(_) => Check::not_ok("eexist-enoent", Verdict::Warn, format!("negative-lookup cache {} ({negative_key}): for that long after this client looked up a missing name that another node then made, mkdir and open(O_CREAT) of it answer EEXIST while stat answers ENOENT; {measure}", secs(negative)), f.negative_fix().into()),
        None => Check::not_ok("eexist-enoent", Verdict::Warn, format!("negative-lookup cache unknown ({negative_key} not shown): mkdir may answer EEXIST for a name stat cannot see for that long; {measure}"), f.negative_fix().into()),
    };
    let stale = match entry {
        Some(s) if s <= 0.0 => Check::ok("stale-rename", format!("entry cache {} ({entry_key}): a record another node renames over is read anew at the next open", secs(entry))),
        Some(_) => Check::not_ok("stale-rename", Verdict::Warn, format!("entry cache {} ({entry_key}): a record another node renames over can be read stale for that long, at every barrier hop (an arrival, its release); {measure}", secs(entry)), f.entry_fix().into()),
        None => Check::not_ok("stale-rename", Verdict::Warn, format!("entry cache unknown ({entry_key} not shown): a record another node renames over can be read stale for that long at every barrier hop; {measure}"), f.entry_fix().into()),
    };
    vec![eexist, stale]
}

/// MooseFS only: how long its trash keeps what rl-node replaces (`DIR/.rl-node`, whose
/// trash time new files there inherit, else DIR's), with the trash time when it could be
/// read.
pub(crate) fn trash_check(family: Option<Family>, dir: &Path) -> Option<(Check, Option<u64>)> {
    const NAME: &str = "trash";
    if family != Some(Family::MooseFs) {
        return None;
    }
    let state = dir.join(".rl-node");
    let (asked, advice) = if state.is_dir() {
        let advice = format!(
            "mfssettrashtime -r 0 {} (files made there inherit it)",
            state.display()
        );
        (state.as_path(), advice)
    } else {
        let advice = format!(
            "mkdir {0} && mfssettrashtime -r 0 {0} (before the first run: files made there inherit it)",
            state.display()
        );
        (dir, advice)
    };
    let why = "rl-node replaces its records by rename at every heartbeat and barrier, so MooseFS keeps each replaced version: about N+1 files per heartbeat interval while idle";
    let got = trash_time(asked);
    let time = got.as_ref().ok().copied();
    let check = match got {
        Ok(0) => Check::ok(NAME, format!("trash time of {} is 0 s (mfsgettrashtime): replaced files are freed at once", asked.display())),
        Ok(t) => Check::not_ok(NAME, Verdict::Warn, format!("MooseFS keeps every file replaced or deleted under {} in its trash for {t} s (mfsgettrashtime); {why}", asked.display()), advice),
        Err(e) => Check::not_ok(NAME, Verdict::Warn, format!("MooseFS keeps replaced and deleted files in its trash for the directory's trash time (1 day by default); it could not be read ({e}); {why}"), advice),
    };
    Some((check, time))
}

/// `mfsgettrashtime PATH`: `PATH: 86400`.
fn trash_time(path: &Path) -> Result<u64, String> {
    let out = run_tool("mfsgettrashtime", &[path])?;
    parse_trash_time(&out).ok_or_else(|| {
        format!(
            "mfsgettrashtime said {:?}",
            out.lines().last().unwrap_or("").trim()
        )
    })
}

pub(crate) fn parse_trash_time(out: &str) -> Option<u64> {
    out.lines()
        .rev()
        .find_map(|l| l.rsplit_once(": ")?.1.trim().parse().ok())
}

/// Best effort, when MooseFS's tools answered and it keeps a trash: files made under
/// `dir` (the doctor's own scratch and session, full of renamed-over records) are freed
/// at once instead of kept for a day.
pub(crate) fn no_trash(dir: &Path) {
    let _ = run_tool("mfssettrashtime", &[Path::new("0"), dir]);
}

/// A MooseFS tool's output, or why there is none.
fn run_tool(name: &str, args: &[&Path]) -> Result<String, String> {
    use crate::process::forensics::{run_tool, ToolRun, Tools};
    let prog = crate::process::which(name).ok_or_else(|| format!("{name} not installed"))?;
    let args: Vec<String> = args.iter().map(|a| a.display().to_string()).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match run_tool(&prog, &args, TOOL_LIMIT, &Tools::new(None)) {
        ToolRun::Ended(crate::process::ChildExit::Success, out) => Ok(out),
        ToolRun::Ended(exit, out) => Err(format!(
            "{name} failed ({exit:?}): {}",
            out.lines().last().unwrap_or("").trim()
        )),
        ToolRun::Killed(..) => Err(format!(
            "{name} did not answer within {}s",
            TOOL_LIMIT.as_secs()
        )),
        ToolRun::NotStarted => Err(format!("{name} not started")),
        ToolRun::CannotStart(e) => Err(format!("{name} cannot start: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_read_and_what_is_not_a_number_is_unknown() {
        let p = parse_params(
            "mfsmaster: 10.0.0.1\nmfsattrcacheto: 1.000\nmfsentrycacheto: 0.500\nmfsdirentrycacheto: 1.000\nmfsnegentrycacheto: (not defined)\n",
        );
        assert_eq!(
            p,
            Params {
                attr: Some(1.0),
                entry: Some(0.5),
                direntry: Some(1.0),
                negentry: None
            }
        );
        assert_eq!(parse_params("").entry, None);
        assert_eq!(
            (secs(p.entry), secs(p.negentry)),
            ("0.5s".into(), "unknown".into())
        );
    }

    #[test]
    fn configured_caches_give_the_familys_fix_and_unknown_is_not_zero() {
        let c = configured_checks(Some(Family::MooseFs), Some(1.0), Some(0.0));
        assert_eq!((c[0].name, c[0].verdict), ("eexist-enoent", Verdict::Ok));
        assert_eq!((c[1].name, c[1].verdict), ("stale-rename", Verdict::Warn));
        assert!(
            c[1].evidence.contains("entry cache 1s (mfsentrycacheto)"),
            "{}",
            c[1].evidence
        );
        let json = serde_json::to_value(&c[1]).unwrap();
        assert!(json["advice"]
            .as_str()
            .unwrap()
            .contains("mfsentrycacheto=0"));
        let c = configured_checks(Some(Family::Fuse), None, None);
        assert!(c.iter().all(|c| c.verdict == Verdict::Warn));
        assert!(
            c[0].evidence.starts_with("negative-lookup cache unknown"),
            "{}",
            c[0].evidence
        );
        assert!(
            c[1].evidence.starts_with("entry cache unknown"),
            "{}",
            c[1].evidence
        );
        let c = configured_checks(Some(Family::Local), Some(0.0), Some(0.0));
        assert!(c.iter().all(|c| c.verdict == Verdict::Ok));
    }

    #[test]
    fn trash_times_are_read_from_the_tools_line() {
        assert_eq!(parse_trash_time("/mnt/mfs/.rl-node: 86400\n"), Some(86400));
        assert_eq!(parse_trash_time("/mnt/a: b: 0\n"), Some(0));
        assert_eq!(parse_trash_time("can't connect to master\n"), None);
    }
}
