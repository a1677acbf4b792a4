//! How the doctor makes its own directories (`.rl-node/`, `doctor/`, its scratch, a
//! session's directory) when doctors on several nodes make them at once, each through its
//! own client's caches (docs/shared-directory.md, "Checking a filesystem").
//!
//! On a FUSE client with a negative-lookup cache (MooseFS `mfsnegentrycacheto`, FUSE
//! `negative_timeout`), a name this client looked up while missing and another node then
//! made answers EEXIST to `mkdir` and ENOENT to `stat` until the cache expires, and a
//! directory inside it cannot be made (ENOENT); an entry cache can likewise name a
//! directory another doctor just removed. Both are normal, passing states, not an
//! unwritable directory: a read of the parent directory refreshes the client's view, and
//! what is left is waited out with a bound. When the bound passes, the error says which
//! cache keeps the stale answer and which mount option removes it.
//!
//! The shared-directory store is to tolerate the same states in its own directory
//! creation; once it does, [`make_dirs`] becomes a loop over it.

use crate::error::Failure;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Between two looks at a directory another client made (each one reads the parent).
const RETRY: Duration = Duration::from_millis(50);
/// The least a stale view is waited out, whatever the caches say.
const MIN_WAIT: Duration = Duration::from_secs(5);
/// The wait when the caches are unknown.
const UNKNOWN_WAIT: Duration = Duration::from_secs(30);

/// What the caches of this client are, for the bound of the wait and the error's words.
#[derive(Debug, Clone)]
pub(crate) struct DirWait {
    pub bound: Duration,
    /// The negative-lookup cache: its option and value, e.g. "mfsnegentrycacheto 1s".
    pub negative: String,
    /// The mount option that turns the negative-lookup cache off.
    pub negative_fix: String,
    /// The entry cache, likewise.
    pub entry: String,
    pub entry_fix: String,
}

impl DirWait {
    /// Twice the longest cache these caches may keep a stale name, plus a second (at least
    /// [`MIN_WAIT`]); [`UNKNOWN_WAIT`] when neither cache is known.
    pub(crate) fn for_caches(longest: Option<f64>) -> Duration {
        match longest {
            Some(s) => MIN_WAIT.max(Duration::from_secs_f64(
                (2.0 * s + 1.0).min(crate::config::ranges::MAX_DURATION.as_secs_f64()),
            )),
            None => UNKNOWN_WAIT,
        }
    }
}

/// Why a directory is not there yet.
#[derive(Debug, Clone, PartialEq)]
enum Stale {
    /// `mkdir` answers EEXIST, `stat` ENOENT: the negative-lookup cache hides it.
    Hidden(PathBuf),
    /// `mkdir` inside a directory `stat` sees answers ENOENT: the entry cache names a
    /// directory that is gone.
    Gone(PathBuf),
    /// The parent is not there (another doctor removed it): made again from the top.
    Removed(PathBuf),
}

/// Makes each of `chain` (each inside the one before; the first inside a directory that
/// exists) unless it is there, and adds those this call made to `made`, on an error as
/// well (for the caller to remove). With `fresh_last`, the last must be new: another's is
/// an error. A directory made by another client and not yet visible through this one, or
/// one removed under it, is waited for up to `wait.bound`.
pub(crate) fn make_dirs(
    chain: &[PathBuf],
    fresh_last: bool,
    wait: &DirWait,
    made: &mut Vec<PathBuf>,
) -> Result<(), Failure> {
    let deadline = Instant::now() + wait.bound;
    'again: loop {
        for (i, d) in chain.iter().enumerate() {
            let last = i + 1 == chain.len();
            let stale = match crate::store::fs::create_dir(d) {
                Ok(()) => {
                    // Made again after another doctor removed it: listed once.
                    if !made.contains(d) {
                        made.push(d.clone());
                    }
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    if fresh_last && last {
                        return Err(Failure::failed(format!(
                            "cannot create {}: it already exists (another doctor's?)",
                            d.display()
                        )));
                    }
                    if there(d) {
                        continue;
                    }
                    refresh(d);
                    if there(d) {
                        continue;
                    }
                    Stale::Hidden(d.clone())
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    let parent = d.parent().unwrap_or(d).to_path_buf();
                    refresh(&parent);
                    if fs::symlink_metadata(&parent).is_ok_and(|m| m.is_dir()) {
                        Stale::Gone(parent)
                    } else {
                        Stale::Removed(parent)
                    }
                }
                Err(e) => {
                    return Err(Failure::failed(format!(
                        "cannot create {} ({e}): rl-node could not write its state there either",
                        d.display()
                    )))
                }
            };
            if Instant::now() >= deadline {
                return Err(lying(&stale, d, wait));
            }
            std::thread::sleep(RETRY);
            continue 'again;
        }
        return Ok(());
    }
}

/// Whether `d` is there for this client. Something other than a directory there (a
/// planted link) counts as there: the next step, confined below the root, refuses it and
/// says what it is.
fn there(d: &Path) -> bool {
    fs::symlink_metadata(d).is_ok()
}

/// Reads `d`'s parent whole: a listing asks the server, and refreshes this client's view
/// of the names in it (a FUSE client's negative and entry caches).
fn refresh(d: &Path) {
    if let Some(p) = d.parent() {
        let _ = crate::store::fs::read_dir(p);
    }
}

/// The error once the bound has passed: which cache still answers wrongly, and its fix.
fn lying(stale: &Stale, d: &Path, wait: &DirWait) -> Failure {
    let bound = humantime::format_duration(Duration::from_secs(wait.bound.as_secs()));
    let (message, hint) = match stale {
        Stale::Hidden(p) => (
            format!(
                "cannot create {}: mkdir answers \"File exists\" while stat cannot find it, still after {bound} and after re-reading {}: this client's negative-lookup cache ({}) keeps hiding a directory another node made",
                p.display(),
                p.parent().unwrap_or(p).display(),
                wait.negative
            ),
            format!("{} (then a name another node makes is seen at its next lookup)", wait.negative_fix),
        ),
        Stale::Gone(p) => (
            format!(
                "cannot create {}: {} is there for stat, but a directory made in it answers \"No such file or directory\", still after {bound}: this client's entry cache ({}) names a directory another node removed",
                d.display(),
                p.display(),
                wait.entry
            ),
            format!("{} (then a name is looked up again at each use)", wait.entry_fix),
        ),
        Stale::Removed(p) => (
            format!(
                "cannot create {}: {} keeps disappearing (removed by another doctor each time it is made?) for {bound}",
                d.display(),
                p.display()
            ),
            "start the doctors of one group with one --session, and other groups with others".into(),
        ),
    };
    let mut f = Failure::failed(message);
    f.hint = Some(hint);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait() -> DirWait {
        DirWait {
            bound: Duration::from_millis(200),
            negative: "mfsnegentrycacheto 1s".into(),
            negative_fix: "mount with mfsnegentrycacheto=0".into(),
            entry: "mfsentrycacheto 1s".into(),
            entry_fix: "mount with mfsentrycacheto=0".into(),
        }
    }

    /// What `make_dirs` made, or its error with what it made before it.
    fn made(chain: &[PathBuf], fresh_last: bool) -> Result<Vec<PathBuf>, (Failure, Vec<PathBuf>)> {
        let mut made = Vec::new();
        match make_dirs(chain, fresh_last, &wait(), &mut made) {
            Ok(()) => Ok(made),
            Err(f) => Err((f, made)),
        }
    }

    #[test]
    fn a_chain_is_made_once_and_made_again_after_removal() {
        let tmp = tempfile::tempdir().unwrap();
        let a = tmp.path().join("a");
        let chain = [a.clone(), a.join("b"), a.join("b/c")];
        assert_eq!(made(&chain, false).unwrap(), chain);
        // Already there: nothing made, nothing refused.
        assert!(made(&chain, false).unwrap().is_empty());
        // A unique last one must be new.
        let (e, none) = made(&chain, true).unwrap_err();
        assert!(e.message.contains("already exists"), "{}", e.message);
        assert!(none.is_empty());
        fs::remove_dir_all(&a).unwrap();
        assert_eq!(made(&chain, true).unwrap(), chain);
    }

    #[test]
    fn what_was_made_before_an_error_is_handed_back() {
        let tmp = tempfile::tempdir().unwrap();
        let a = tmp.path().join("a");
        // A name longer than any filesystem takes.
        let chain = [a.clone(), a.join("b"), a.join("b").join("x".repeat(300))];
        let (e, made) = made(&chain, true).unwrap_err();
        assert!(e.message.contains("cannot create"), "{}", e.message);
        assert_eq!(made, chain[..2]);
    }

    #[test]
    fn the_bound_of_the_wait_follows_the_caches() {
        assert_eq!(DirWait::for_caches(Some(1.0)), MIN_WAIT);
        assert_eq!(DirWait::for_caches(Some(60.0)), Duration::from_secs(121));
        assert_eq!(DirWait::for_caches(None), UNKNOWN_WAIT);
    }

    #[test]
    fn the_error_names_the_cache_that_lies_and_its_fix() {
        let w = wait();
        let d = Path::new("/m/.rl-node/doctor");
        let f = lying(&Stale::Hidden(d.into()), d, &w);
        assert!(
            f.message
                .contains("mkdir answers \"File exists\" while stat cannot find it")
                && f.message
                    .contains("negative-lookup cache (mfsnegentrycacheto 1s)")
                && f.message.contains("re-reading /m/.rl-node"),
            "{}",
            f.message
        );
        assert!(f
            .hint
            .unwrap()
            .starts_with("mount with mfsnegentrycacheto=0"));
        let f = lying(&Stale::Gone("/m/.rl-node".into()), d, &w);
        assert!(
            f.message.contains("entry cache (mfsentrycacheto 1s)"),
            "{}",
            f.message
        );
        assert!(!f.message.contains("could not write its state"));
    }
}
