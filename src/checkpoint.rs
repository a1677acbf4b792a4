//! Immutable model checkpoints: `models/iter-NNNN/` with a `manifest.json` (every file's
//! size and SHA-256) and a `models/LATEST` pointer switched atomically.
//!
//! A hand-off walks the training output (the *checkpoint root*) with `walkdir`, refusing
//! anything it cannot copy faithfully before it writes a byte: a symbolic link is followed
//! only while its target stays inside the root (Hugging Face snapshot layouts link
//! `snapshots/<rev>/file -> ../../blobs/<hash>`, which is fine when the root holds both),
//! and a link that leaves the root, dangles or loops is an error naming it. The content
//! is copied into a hidden directory private to the publishing generation
//! (`models/.iter-NNNN.gG.partial`), the manifest is written, and the directory is renamed
//! to its final name without ever replacing an existing checkpoint; only then is `LATEST`
//! rewritten, and never to an older checkpoint than a verified one it names. Both the
//! rename and the `LATEST` switch are preceded by a caller-supplied fence that checks this
//! node still owns the hand-off (is the current generation's rank 0): an older generation
//! that wakes up mid-copy stops there. The window between the fence and the rename (or the
//! `LATEST` write) is a few system calls; it is not closed, only made that small.
//!
//! A crash at any point leaves `LATEST` naming a complete, verifiable checkpoint (the old
//! or the new one); and a `LATEST` that is damaged anyway (empty, naming something outside
//! `models/`, missing, or not matching its manifest) is never served: [`latest`] falls
//! back to the newest checkpoint that verifies.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
pub const LATEST: &str = "LATEST";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub sha256: String,
    /// When the source held a symbolic link here: where it led, relative to the
    /// checkpoint root (e.g. `blobs/ab12…`). The checkpoint holds the content itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub source: String,
    pub files: Vec<FileEntry>,
    pub created_at: String,
    /// Globs (relative paths) of files the programs that read the checkpoint rewrite in
    /// place (`phases.handoff.mutable`, e.g. webgym's `scheduler.pt`): verification only
    /// requires them to exist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mutable: Vec<String>,
}

impl Manifest {
    fn is_mutable(&self, rel: &str) -> bool {
        self.mutable
            .iter()
            .filter_map(|g| glob::Pattern::new(g).ok())
            .any(|g| g.matches(rel))
    }
}

/// Why a hand-off did not publish. Nothing under `models/` changed unless said otherwise.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("checkpoint link {} -> {} leaves the checkpoint directory {}", link.display(), target.display(), root.display())]
    LinkLeaves {
        link: PathBuf,
        target: PathBuf,
        root: PathBuf,
    },
    #[error("checkpoint link {} -> {} is dangling: its target does not exist", link.display(), target.display())]
    Dangling { link: PathBuf, target: PathBuf },
    #[error("checkpoint link {} loops: {what}", link.display())]
    Loop { link: PathBuf, what: String },
    #[error("{} is neither a file, a directory nor a link to one; it cannot be part of a checkpoint", path.display())]
    Special { path: PathBuf },
    #[error("{} already exists and does not verify ({problem}); checkpoints are never replaced: move it aside to publish again", path.display())]
    Exists { path: PathBuf, problem: String },
    /// The fence refused: this node no longer owns the hand-off. The partial directory is
    /// left where it is (the owner of the generation may remove it).
    #[error("stopped before {step}: {reason}")]
    Fenced { step: String, reason: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> PublishError + '_ {
    move |source| PublishError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Test-only fault injection: `RL_NODE_TEST_CRASH_AT=<point>` aborts the process at that
/// point (of a hand-off, or between committing work and journaling it), to prove a crash
/// there loses nothing and leaves nothing half-published.
/// `RL_NODE_TEST_STOP_AT=<point>` instead stops the whole node there (SIGSTOP: its
/// supervisor, then this process) the first time it gets there, as a paused VM or a hung
/// host would, until a test sends SIGCONT (to the supervisor, which passes it on).
pub(crate) fn crash_point(point: &str) {
    if std::env::var("RL_NODE_TEST_CRASH_AT").is_ok_and(|v| v == point) {
        crate::errln!("RL_NODE_TEST_CRASH_AT={point}: aborting");
        std::process::abort();
    }
    static STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if std::env::var("RL_NODE_TEST_STOP_AT").is_ok_and(|v| v == point)
        && !STOPPED.swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        crate::errln!("RL_NODE_TEST_STOP_AT={point}: stopping (SIGSTOP), once");
        let node = crate::holder::node_process();
        if node != std::process::id() {
            // SAFETY: kill takes only integers and touches no memory of this process.
            unsafe { libc::kill(node as i32, libc::SIGSTOP) };
        }
        // SAFETY: raise takes only a signal number; SIGSTOP runs no handler in this
        // process.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}

/// The newest directory directly under `dir` whose name matches the glob `pattern`
/// (`*`, `?`, `[…]`), by modification time then name; `None` if nothing matches. The
/// pattern is validated when the configuration is loaded (`phases.handoff.pick`).
pub fn pick(dir: &Path, pattern: &str) -> Option<PathBuf> {
    if pattern.is_empty() {
        return None;
    }
    let pattern = glob::Pattern::new(pattern).ok()?;
    fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| pattern.matches(&e.file_name().to_string_lossy()))
        .max_by_key(|e| (e.metadata().and_then(|m| m.modified()).ok(), e.file_name()))
        .map(|e| e.path())
}

/// Whether `pattern` is a valid `pick` glob; the error says what is wrong with it.
pub fn check_pick_pattern(pattern: &str) -> Result<(), String> {
    glob::Pattern::new(pattern)
        .map(|_| ())
        .map_err(|e| format!("`{pattern}` is not a valid glob pattern: {e}"))
}

/// One file of a checkpoint to copy: read from `src` (through any links), written at `rel`.
struct SourceFile {
    src: PathBuf,
    rel: PathBuf,
    link_target: Option<String>,
}

/// Every file under `root`, following links that stay inside it, sorted by path. Refuses
/// (naming the path) links that leave the root, dangle or loop, and special files.
fn checkpoint_files(root: &Path) -> Result<Vec<SourceFile>, PublishError> {
    let real_root = fs::canonicalize(root).map_err(io_at(root))?;
    let mut out = Vec::new();
    let walk = walkdir::WalkDir::new(root)
        .follow_links(true)
        .sort_by_file_name();
    for entry in walk {
        let entry = entry.map_err(|e| walk_error(root, e))?;
        let path = entry.path();
        let mut link_target = None;
        if entry.path_is_symlink() {
            let target = fs::canonicalize(path).map_err(io_at(path))?;
            let Ok(inside) = target.strip_prefix(&real_root) else {
                return Err(PublishError::LinkLeaves {
                    link: path.to_path_buf(),
                    target: fs::read_link(path).unwrap_or(target),
                    root: root.to_path_buf(),
                });
            };
            link_target = Some(inside.to_string_lossy().into_owned());
        }
        let t = entry.file_type();
        if t.is_dir() {
            continue;
        }
        if !t.is_file() {
            return Err(PublishError::Special {
                path: path.to_path_buf(),
            });
        }
        let rel = path
            .strip_prefix(root)
            .expect("walkdir stays under its root");
        out.push(SourceFile {
            src: path.to_path_buf(),
            rel: rel.to_path_buf(),
            link_target,
        });
    }
    Ok(out)
}

/// What walkdir could not follow, as the refusal that names it.
fn walk_error(root: &Path, e: walkdir::Error) -> PublishError {
    let path = e.path().unwrap_or(root).to_path_buf();
    if let Some(ancestor) = e.loop_ancestor() {
        return PublishError::Loop {
            what: format!("it leads back to {}, which contains it", ancestor.display()),
            link: path,
        };
    }
    let is_link = fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
    let io = e
        .into_io_error()
        .unwrap_or_else(|| io::Error::other("walk failed"));
    if is_link && io.raw_os_error() == Some(libc::ELOOP) {
        return PublishError::Loop {
            what: "following it leads through too many links (a cycle of links)".into(),
            link: path,
        };
    }
    if is_link && io.kind() == io::ErrorKind::NotFound {
        return PublishError::Dangling {
            target: fs::read_link(&path).unwrap_or_default(),
            link: path,
        };
    }
    PublishError::Io { path, source: io }
}

fn sha256_file(path: &Path, tick: &mut dyn FnMut()) -> io::Result<(u64, String)> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
        tick();
    }
    Ok((size, hex::encode(h.finalize())))
}

/// Check every file the manifest lists (size and SHA-256; a file the manifest calls
/// mutable only has to exist). Files the manifest does not list are not allowed either,
/// nor links: the directory must be exactly what was published.
pub fn verify(dir: &Path, tick: &mut dyn FnMut()) -> Result<Manifest, String> {
    let mpath = dir.join(MANIFEST);
    let bytes = fs::read(&mpath).map_err(|e| format!("{}: {e}", mpath.display()))?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not a valid manifest: {e}", mpath.display()))?;
    for f in &m.files {
        if !Path::new(&f.path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(format!(
                "{} lists `{}`, which is not a path inside the checkpoint",
                mpath.display(),
                f.path
            ));
        }
        let p = dir.join(&f.path);
        if m.is_mutable(&f.path) {
            if !p.is_file() {
                return Err(format!("{} is missing", p.display()));
            }
            continue;
        }
        let (size, sha) = sha256_file(&p, tick).map_err(|e| format!("{}: {e}", p.display()))?;
        if size != f.size || sha != f.sha256 {
            return Err(format!(
                "{} does not match the manifest (size {size}, expected {})",
                p.display(),
                f.size
            ));
        }
    }
    let listed = m.files.len();
    let mut present = 0usize;
    for e in walkdir::WalkDir::new(dir).min_depth(1) {
        let e = e.map_err(|e| e.to_string())?;
        if e.path_is_symlink() {
            return Err(format!(
                "{} is a link; a published checkpoint holds only files",
                e.path().display()
            ));
        }
        if !e.file_type().is_dir() && e.path() != mpath {
            present += 1;
        }
    }
    if present != listed {
        return Err(format!(
            "{} holds {present} files but its manifest lists {listed}",
            dir.display()
        ));
    }
    Ok(m)
}

/// The iteration of a checkpoint directory name `iter-NNNN`; `None` for anything else.
pub fn iteration_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("iter-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The checkpoint `models/LATEST` names, as written, without checking it (for reports and
/// repairs; [`latest`] is what may be served).
pub fn latest_named(models: &Path) -> Option<PathBuf> {
    let name = fs::read_to_string(models.join(LATEST)).ok()?;
    let name = name.trim();
    is_plain_name(name).then(|| models.join(name))
}

/// A single, ordinary name of an entry in `models/` (no `/`, not `.` or `..`).
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != "." && name != ".." && !name.contains('\0')
}

/// The model to serve and train from, according to `models/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Latest {
    /// `models/LATEST` names this checkpoint and it verifies.
    Checkpoint(PathBuf),
    /// There is no `models/LATEST`: nothing was published yet, the base model applies.
    Base,
    /// `models/LATEST` cannot be used (`problem` says why); `fallback` is the newest
    /// checkpoint that verifies, or `None` when there is none (the base model applies).
    Damaged {
        problem: String,
        fallback: Option<PathBuf>,
    },
}

impl Latest {
    /// The checkpoint to use; `None`: the base model (`cluster.model`).
    pub fn path(&self) -> Option<&Path> {
        match self {
            Latest::Checkpoint(p) => Some(p),
            Latest::Damaged {
                fallback: Some(p), ..
            } => Some(p),
            _ => None,
        }
    }

    /// What to tell the user when `LATEST` was not usable; `base` is `cluster.model`.
    /// `None` when there is nothing to say. (When `fallback` is `None` and `base` is empty
    /// there is no model at all: the caller must stop, see [`Latest::no_model`].)
    pub fn warning(&self, base: &str) -> Option<String> {
        let Latest::Damaged { problem, fallback } = self else {
            return None;
        };
        Some(match fallback {
            Some(p) => format!(
                "{problem}; using {}, the newest verified checkpoint",
                p.file_name().unwrap_or_default().to_string_lossy()
            ),
            None if base.is_empty() => format!(
                "{problem}, and no checkpoint under models/ verifies; there is no base model either (cluster.model is empty)"
            ),
            None => format!(
                "{problem}, and no checkpoint under models/ verifies; using the base model {base} (cluster.model)"
            ),
        })
    }

    /// `LATEST` is unusable, nothing verifies and there is no base model to fall back on.
    pub fn no_model(&self, base: &str) -> bool {
        matches!(self, Latest::Damaged { fallback: None, .. }) && base.trim().is_empty()
    }
}

/// Resolve `models/LATEST` to a checkpoint that verifies. A `LATEST` that is empty,
/// names something outside `models/`, names a missing directory or one that does not
/// verify against its manifest is never used: the newest `models/iter-NNNN` (by iteration
/// number) that verifies is, with the problem reported in [`Latest::Damaged`].
pub fn latest(models: &Path, tick: &mut dyn FnMut()) -> Latest {
    let pointer = models.join(LATEST);
    let problem = match fs::read(&pointer) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Latest::Base,
        Err(e) => format!("models/LATEST cannot be read ({e})"),
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let name = text.trim();
            if name.is_empty() {
                "models/LATEST is empty".to_string()
            } else if !is_plain_name(name) {
                format!("models/LATEST names `{name}`, which is not a checkpoint in models/")
            } else {
                let dir = models.join(name);
                if !dir.exists() {
                    format!("models/LATEST names {name}, which does not exist")
                } else {
                    match verify(&dir, tick) {
                        Ok(_) => return Latest::Checkpoint(dir),
                        Err(e) => {
                            format!("models/LATEST names {name}, which does not verify ({e})")
                        }
                    }
                }
            }
        }
    };
    Latest::Damaged {
        problem,
        fallback: newest_verified(models, tick),
    }
}

/// The `models/iter-NNNN` with the highest iteration that verifies.
fn newest_verified(models: &Path, tick: &mut dyn FnMut()) -> Option<PathBuf> {
    let mut found: Vec<(u64, PathBuf)> = fs::read_dir(models)
        .ok()?
        .flatten()
        .filter_map(|e| Some((iteration_of(e.file_name().to_str()?)?, e.path())))
        .collect();
    found.sort();
    found
        .into_iter()
        .rev()
        .map(|(_, p)| p)
        .find(|p| verify(p, tick).is_ok())
}

/// What `publish` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// `source` was copied into a new checkpoint and `LATEST` names it.
    New(PathBuf),
    /// A complete, verified checkpoint of that name existed already (an earlier attempt
    /// published it); checkpoints are immutable, so it was kept and `source` was not copied.
    Kept(PathBuf),
    /// The checkpoint `path` is published (new or kept) but `LATEST` already names a newer
    /// checkpoint that verifies, `latest`, and was left alone: it only moves forward.
    LatestAhead { path: PathBuf, latest: PathBuf },
}

impl Published {
    pub fn path(&self) -> &Path {
        match self {
            Published::New(p) | Published::Kept(p) => p,
            Published::LatestAhead { path, .. } => path,
        }
    }
}

/// The hidden directory generation `gen` fills while publishing `name`. Per generation, so
/// an older generation's rank 0 that wakes up mid-copy never writes into (or renames) the
/// directory the current one is filling.
pub fn partial_dir(models: &Path, name: &str, gen: u64) -> PathBuf {
    models.join(format!(".{name}.g{gen}.partial"))
}

/// Whether `file_name` is a hand-off's partial directory (`.iter-NNNN.gG.partial`, or the
/// `.iter-NNNN.partial` of earlier versions).
pub fn is_partial_dir_name(file_name: &str) -> bool {
    file_name.starts_with(".iter-") && file_name.ends_with(".partial")
}

/// Publish `source` (the checkpoint root) as `models/<name>` and point `LATEST` at it, as
/// generation `gen`. `fence` is called immediately before the final rename and before the
/// `LATEST` switch; if it fails nothing more is done and its reason is returned.
///
/// Idempotent: a complete, verified `models/<name>` from an earlier attempt is kept. An
/// existing `models/<name>` that does not verify is an error: a checkpoint is never
/// replaced, and nothing is copied.
pub fn publish(
    source: &Path,
    models: &Path,
    name: &str,
    gen: u64,
    fence: &mut dyn FnMut() -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    publish_with(source, models, name, gen, &[], fence, tick)
}

/// [`publish`], recording `mutable` (globs of files readers may rewrite in place) in the
/// manifest.
pub fn publish_with(
    source: &Path,
    models: &Path,
    name: &str,
    gen: u64,
    mutable: &[String],
    fence: &mut dyn FnMut() -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    fs::create_dir_all(models).map_err(io_at(models))?;
    let dest = models.join(name);
    if dest.exists() {
        return keep_existing(models, name, &dest, fence, tick);
    }
    // Everything is checked before anything is written: a refused link leaves no trace.
    let sources = checkpoint_files(source)?;
    let tmp = partial_dir(models, name, gen);
    if tmp.exists() {
        // This generation's own debris from a crashed attempt: not a checkpoint.
        fs::remove_dir_all(&tmp).map_err(io_at(&tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io_at(&tmp))?;
    let mut files = Vec::new();
    for f in sources {
        let dst = tmp.join(&f.rel);
        let parent = dst.parent().expect("has parent");
        fs::create_dir_all(parent).map_err(io_at(parent))?;
        copy_synced(&f.src, &dst, tick)?;
        let (size, sha256) = sha256_file(&dst, tick).map_err(io_at(&dst))?;
        files.push(FileEntry {
            path: f.rel.to_string_lossy().into_owned(),
            size,
            sha256,
            link_target: f.link_target,
        });
        crash_point("handoff:mid-copy");
    }
    let manifest = Manifest {
        name: name.to_string(),
        source: source.display().to_string(),
        files,
        created_at: crate::clock::wall_now(),
        mutable: mutable.to_vec(),
    };
    let mpath = tmp.join(MANIFEST);
    (|| {
        let mut f = File::create(&mpath)?;
        crate::store::fs::write_json(&mut f, &manifest)?;
        f.sync_all()
    })()
    .map_err(io_at(&mpath))?;
    crate::store::fsync_dir(&tmp).map_err(io_at(&tmp))?;
    crash_point("handoff:before-rename");
    fence().map_err(|reason| PublishError::Fenced {
        step: format!("renaming {} to {name}", tmp.display()),
        reason,
    })?;
    match crate::store::rename_noreplace(&tmp, &dest) {
        Ok(()) => {}
        Err(e) if is_exists(&e) => {
            // Published meanwhile by someone else: theirs stands if it verifies.
            let kept = keep_existing(models, name, &dest, fence, tick);
            if kept.is_ok() {
                let _ = fs::remove_dir_all(&tmp);
            }
            return kept;
        }
        Err(e) => return Err(io_at(&dest)(e)),
    }
    crate::store::fsync_dir(models).map_err(io_at(models))?;
    crash_point("handoff:before-latest");
    Ok(match point_latest(models, name, fence, tick)? {
        None => Published::New(dest),
        Some(latest) => Published::LatestAhead { path: dest, latest },
    })
}

fn is_exists(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::AlreadyExists || e.raw_os_error() == Some(libc::ENOTEMPTY)
}

/// `models/<name>` exists: keep it (and point `LATEST` at it) if it verifies, else refuse.
fn keep_existing(
    models: &Path,
    name: &str,
    dest: &Path,
    fence: &mut dyn FnMut() -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    if let Err(problem) = verify(dest, tick) {
        return Err(PublishError::Exists {
            path: dest.to_path_buf(),
            problem,
        });
    }
    Ok(match point_latest(models, name, fence, tick)? {
        None => Published::Kept(dest.to_path_buf()),
        Some(latest) => Published::LatestAhead {
            path: dest.to_path_buf(),
            latest,
        },
    })
}

/// Point `LATEST` at `name`, unless it names a newer checkpoint that verifies (returned:
/// `LATEST` only moves forward). The fence is checked right before the write.
fn point_latest(
    models: &Path,
    name: &str,
    fence: &mut dyn FnMut() -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Option<PathBuf>, PublishError> {
    if let (Some(current), Some(ours)) = (latest_named(models), iteration_of(name)) {
        let newer = current
            .file_name()
            .and_then(|n| iteration_of(&n.to_string_lossy()))
            .is_some_and(|theirs| theirs > ours);
        if newer && verify(&current, tick).is_ok() {
            return Ok(Some(current));
        }
    }
    fence().map_err(|reason| PublishError::Fenced {
        step: format!("pointing models/LATEST at {name}"),
        reason,
    })?;
    let pointer = models.join(LATEST);
    crate::store::publish(&pointer, format!("{name}\n").as_bytes()).map_err(io_at(&pointer))?;
    Ok(None)
}

fn copy_synced(src: &Path, dst: &Path, tick: &mut dyn FnMut()) -> Result<(), PublishError> {
    let mut r = File::open(src).map_err(io_at(src))?;
    let mut w = File::create(dst).map_err(io_at(dst))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf).map_err(io_at(src))?;
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n]).map_err(io_at(dst))?;
        tick();
    }
    w.sync_all().map_err(io_at(dst))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tree(root: &Path) {
        fs::create_dir_all(root.join("sub")).unwrap();
        fs::write(root.join("weights.bin"), vec![7u8; 3000]).unwrap();
        fs::write(root.join("sub/config.json"), b"{}").unwrap();
    }

    fn open() -> Result<(), String> {
        Ok(())
    }

    /// A file the manifest calls mutable may be rewritten in place (webgym's
    /// update_prepare.py rewrites the resumed model's scheduler.pt); any other change,
    /// or its removal, still fails verification.
    #[test]
    fn mutable_files_may_change_but_not_vanish() {
        let d = tempfile::tempdir().unwrap();
        let (src, models) = (d.path().join("src"), d.path().join("models"));
        tree(&src);
        fs::write(src.join("scheduler.pt"), b"lr 1e-6").unwrap();
        let mutable = vec!["scheduler.pt".to_string()];
        publish_with(
            &src,
            &models,
            "iter-0001",
            1,
            &mutable,
            &mut open,
            &mut || {},
        )
        .unwrap();
        let dir = models.join("iter-0001");
        let m = verify(&dir, &mut || {}).unwrap();
        assert_eq!(m.mutable, mutable);
        fs::write(dir.join("scheduler.pt"), b"lr 2e-6, rewritten in place").unwrap();
        verify(&dir, &mut || {}).unwrap();
        fs::remove_file(dir.join("scheduler.pt")).unwrap();
        let e = verify(&dir, &mut || {}).unwrap_err();
        assert!(e.contains("scheduler.pt is missing"), "{e}");
        fs::write(dir.join("scheduler.pt"), b"back").unwrap();
        fs::write(dir.join("weights.bin"), b"changed").unwrap();
        let e = verify(&dir, &mut || {}).unwrap_err();
        assert!(e.contains("weights.bin does not match the manifest"), "{e}");
    }

    fn publish_as(src: &Path, models: &Path, name: &str) -> Result<Published, PublishError> {
        publish(src, models, name, 1, &mut open, &mut || {})
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn publish_verifies_and_moves_latest() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("train/checkpoint-20");
        tree(&src);
        let models = d.path().join("models");
        let out = publish_as(&src, &models, "iter-0001").unwrap();
        assert!(matches!(out, Published::New(_)));
        let out = out.path().to_path_buf();
        assert_eq!(latest(&models, &mut || {}), Latest::Checkpoint(out.clone()));
        let m = verify(&out, &mut || {}).unwrap();
        assert_eq!(m.files.len(), 2);
        assert!(m.files.iter().all(|f| f.link_target.is_none()));
        // Publishing again keeps the verified checkpoint.
        assert_eq!(
            publish_as(&src, &models, "iter-0001").unwrap(),
            Published::Kept(out.clone())
        );
        // Tampering is caught.
        fs::write(out.join("weights.bin"), vec![8u8; 3000]).unwrap();
        assert!(verify(&out, &mut || {})
            .unwrap_err()
            .contains("does not match"));
        // ... and a checkpoint that does not verify is never replaced.
        let err = publish_as(&src, &models, "iter-0001").unwrap_err();
        assert!(matches!(err, PublishError::Exists { .. }), "{err}");
        assert!(err
            .to_string()
            .contains("iter-0001 already exists and does not verify"));
        fs::write(out.join("weights.bin"), vec![7u8; 3000]).unwrap();
        fs::write(out.join("extra"), b"x").unwrap();
        assert!(verify(&out, &mut || {}).is_err());
    }

    #[test]
    fn manifests_without_link_targets_still_parse() {
        let old = r#"{"name": "iter-0001", "source": "/x", "created_at": "t",
            "files": [{"path": "w.bin", "size": 1, "sha256": "ab"}]}"#;
        let m: Manifest = serde_json::from_str(old).unwrap();
        assert_eq!(m.files[0].link_target, None);
        assert!(!serde_json::to_string(&m).unwrap().contains("link_target"));
    }

    #[test]
    fn links_inside_the_checkpoint_are_followed_and_recorded() {
        // A Hugging Face cache layout: the snapshot links every file into blobs/.
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        fs::create_dir_all(src.join("blobs")).unwrap();
        fs::create_dir_all(src.join("snapshots/r1")).unwrap();
        fs::write(src.join("blobs/abc"), b"weights").unwrap();
        symlink("../../blobs/abc", src.join("snapshots/r1/model.bin")).unwrap();
        symlink("snapshots/r1", src.join("current")).unwrap();
        let models = d.path().join("models");
        let out = publish_as(&src, &models, "iter-0001").unwrap();
        let m = verify(out.path(), &mut || {}).unwrap();
        let listed: Vec<(&str, Option<&str>)> = m
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.link_target.as_deref()))
            .collect();
        assert_eq!(
            listed,
            vec![
                ("blobs/abc", None),
                ("current/model.bin", Some("blobs/abc")),
                ("snapshots/r1/model.bin", Some("blobs/abc")),
            ]
        );
        let copied = out.path().join("snapshots/r1/model.bin");
        assert!(!fs::symlink_metadata(&copied).unwrap().is_symlink());
        assert_eq!(fs::read(copied).unwrap(), b"weights");
    }

    fn refused(src: &Path, models: &Path) -> String {
        let err = publish_as(src, models, "iter-0001")
            .unwrap_err()
            .to_string();
        assert!(
            names(models).is_empty(),
            "{err}: nothing may be written, found {:?}",
            names(models)
        );
        err
    }

    #[test]
    fn links_that_leave_the_checkpoint_dangle_or_loop_are_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let models = d.path().join("models");
        let outside = d.path().join("outside");
        fs::write(&outside, b"secret").unwrap();

        let src = d.path().join("leaves");
        tree(&src);
        symlink("../../outside", src.join("sub/w.bin")).unwrap();
        let err = refused(&src, &models);
        assert_eq!(
            err,
            format!(
                "checkpoint link {}/sub/w.bin -> ../../outside leaves the checkpoint directory {}",
                src.display(),
                src.display()
            )
        );

        // A directory link that leaves: refused before anything under it is read.
        let src = d.path().join("dir-leaves");
        tree(&src);
        symlink(d.path(), src.join("up")).unwrap();
        assert!(refused(&src, &models).contains("up -> "), "leaves");

        let src = d.path().join("dangling");
        tree(&src);
        symlink("blobs/missing", src.join("model.bin")).unwrap();
        let err = refused(&src, &models);
        assert!(
            err.contains("model.bin -> blobs/missing is dangling"),
            "{err}"
        );

        let src = d.path().join("loop");
        tree(&src);
        symlink("..", src.join("sub/again")).unwrap();
        let err = refused(&src, &models);
        assert!(err.contains("sub/again loops"), "{err}");

        let src = d.path().join("cycle");
        tree(&src);
        symlink("b", src.join("a")).unwrap();
        symlink("a", src.join("b")).unwrap();
        let err = refused(&src, &models);
        assert!(err.contains("cycle/a loops"), "{err}");
    }

    #[test]
    fn a_fence_that_fails_stops_before_the_rename_and_before_latest() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        let mut replaced = || Err("generation 1 was replaced by generation 2".to_string());
        let err = publish(&src, &models, "iter-0001", 1, &mut replaced, &mut || {}).unwrap_err();
        assert!(
            err.to_string().starts_with("stopped before renaming")
                && err
                    .to_string()
                    .ends_with("generation 1 was replaced by generation 2"),
            "{err}"
        );
        // Only this generation's partial directory is left; the next generation uses its own.
        assert_eq!(names(&models), vec![".iter-0001.g1.partial"]);
        let out = publish(&src, &models, "iter-0001", 2, &mut open, &mut || {}).unwrap();
        assert!(matches!(out, Published::New(_)));
        assert_eq!(
            names(&models),
            vec![".iter-0001.g1.partial", "LATEST", "iter-0001"]
        );
        // The fence is also checked before LATEST moves (here: on an idempotent re-publish).
        fs::remove_file(models.join(LATEST)).unwrap();
        let mut calls = 0;
        let mut second_fails = || {
            calls += 1;
            Err(format!("call {calls}"))
        };
        let err = publish(&src, &models, "iter-0001", 3, &mut second_fails, &mut || {})
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("stopped before pointing models/LATEST at iter-0001"),
            "{err}"
        );
        assert!(!models.join(LATEST).exists());
        // The same generation cleans up its own stale partial on its next attempt.
        publish(&src, &models, "iter-0002", 1, &mut open, &mut || {}).unwrap();
        assert!(!models.join(".iter-0002.g1.partial").exists());
    }

    #[test]
    fn latest_only_moves_forward() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        publish_as(&src, &models, "iter-0002").unwrap();
        let out = publish_as(&src, &models, "iter-0001").unwrap();
        assert_eq!(
            out,
            Published::LatestAhead {
                path: models.join("iter-0001"),
                latest: models.join("iter-0002")
            }
        );
        assert_eq!(
            fs::read_to_string(models.join(LATEST)).unwrap(),
            "iter-0002\n"
        );
        // A newer LATEST that does not verify does not hold it back.
        fs::write(models.join("iter-0002/weights.bin"), b"x").unwrap();
        assert_eq!(
            publish_as(&src, &models, "iter-0001").unwrap(),
            Published::Kept(models.join("iter-0001"))
        );
        assert_eq!(
            fs::read_to_string(models.join(LATEST)).unwrap(),
            "iter-0001\n"
        );
    }

    #[test]
    fn a_damaged_latest_falls_back_to_the_newest_verified_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        assert_eq!(latest(&models, &mut || {}), Latest::Base);
        for it in [1, 2, 10] {
            publish_as(&src, &models, &format!("iter-{it:04}")).unwrap();
        }
        // iter-0010 sorts before iter-0002 by name; by iteration it is the newest.
        let pointer = models.join(LATEST);
        let newest = models.join("iter-0010");
        let cases = [
            ("", "models/LATEST is empty"),
            (
                "../../etc\n",
                "models/LATEST names `../../etc`, which is not a checkpoint in models/",
            ),
            (
                "/etc",
                "models/LATEST names `/etc`, which is not a checkpoint in models/",
            ),
            (
                "..",
                "models/LATEST names `..`, which is not a checkpoint in models/",
            ),
            (
                "iter-0009\n",
                "models/LATEST names iter-0009, which does not exist",
            ),
        ];
        for (text, problem) in cases {
            fs::write(&pointer, text).unwrap();
            let l = latest(&models, &mut || {});
            assert_eq!(
                l,
                Latest::Damaged {
                    problem: problem.into(),
                    fallback: Some(newest.clone())
                },
                "{text:?}"
            );
            assert_eq!(
                l.warning("base").unwrap(),
                format!("{problem}; using iter-0010, the newest verified checkpoint")
            );
        }
        // LATEST names a checkpoint whose file was modified: the newest that verifies.
        fs::write(&pointer, "iter-0010\n").unwrap();
        fs::write(newest.join("weights.bin"), b"changed").unwrap();
        let l = latest(&models, &mut || {});
        assert_eq!(l.path(), Some(models.join("iter-0002").as_path()));
        let w = l.warning("").unwrap();
        assert!(
            w.starts_with("models/LATEST names iter-0010, which does not verify (")
                && w.ends_with("); using iter-0002, the newest verified checkpoint"),
            "{w}"
        );
        assert!(!l.no_model(""));
        // Nothing verifies: the base model, or no model at all.
        for it in [1, 2] {
            fs::write(models.join(format!("iter-{it:04}/weights.bin")), b"changed").unwrap();
        }
        let l = latest(&models, &mut || {});
        assert_eq!(l.path(), None);
        assert!(l.no_model("") && !l.no_model("/models/base"));
        assert!(l
            .warning("/models/base")
            .unwrap()
            .ends_with("no checkpoint under models/ verifies; using the base model /models/base (cluster.model)"));
        assert!(!l.warning("").unwrap().contains("  "));
    }

    #[test]
    fn picks_the_newest_directory_matching_a_glob() {
        let d = tempfile::tempdir().unwrap();
        for n in ["checkpoint-10", "checkpoint-20", "checkpoint-x", "logs"] {
            fs::create_dir_all(d.path().join(n)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        fs::write(d.path().join("checkpoint-99"), b"a file, not a directory").unwrap();
        let p = |pattern| pick(d.path(), pattern).map(|p| p.file_name().unwrap().to_owned());
        assert_eq!(p("checkpoint-*"), Some("checkpoint-x".into()));
        assert_eq!(p("checkpoint-[0-9]*"), Some("checkpoint-20".into()));
        assert_eq!(p("checkpoint-?0"), Some("checkpoint-20".into()));
        assert_eq!(p("checkpoint-1*"), Some("checkpoint-10".into()));
        assert_eq!(p("*o*s"), Some("logs".into()));
        assert_eq!(p("logs"), Some("logs".into()));
        assert_eq!(p("nothing-*"), None);
        assert_eq!(p(""), None);
        assert!(check_pick_pattern("checkpoint-[0-9]*").is_ok());
        let err = check_pick_pattern("checkpoint-[").unwrap_err();
        assert!(
            err.starts_with("`checkpoint-[` is not a valid glob pattern"),
            "{err}"
        );
    }

    #[test]
    fn checkpoint_names() {
        assert_eq!(iteration_of("iter-0012"), Some(12));
        assert_eq!(iteration_of("iter-12345"), Some(12345));
        for bad in [
            "iter-",
            "iter-0001.invalid-x",
            "iter-+1",
            ".iter-0001.g1.partial",
            "LATEST",
        ] {
            assert_eq!(iteration_of(bad), None, "{bad}");
        }
        assert!(is_partial_dir_name(".iter-0001.g3.partial"));
        assert!(is_partial_dir_name(".iter-0001.partial"));
        assert_eq!(
            partial_dir(Path::new("/m"), "iter-0001", 3),
            Path::new("/m/.iter-0001.g3.partial")
        );
    }
}
