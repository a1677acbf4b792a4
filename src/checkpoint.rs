//! Immutable model checkpoints: `models/iter-NNNN/` with a `manifest.json` (every file's
//! size and SHA-256), its digest `manifest.sha256`, and a `models/LATEST` pointer switched
//! atomically.
//!
//! Everything here reaches the shared directory through the node's [`SharedDir`] (names,
//! listings, links, and the files' data alike), so the simulated directory runs the same
//! hand-off as a real one.
//!
//! A hand-off walks the training output (the *checkpoint root*), refusing anything it
//! cannot publish faithfully before it writes a byte: a symbolic link is followed
//! only while its target stays inside the root (Hugging Face snapshot layouts link
//! `snapshots/<rev>/file -> ../../blobs/<hash>`, which is fine when the root holds both),
//! and a link that leaves the root, dangles or loops is an error naming it.
//!
//! The content reaches a hidden directory private to the publishing generation
//! (`models/.iter-NNNN.gG.partial`) in one of two ways. *Moved* (the default,
//! [`Transfer::Move`]): the picked directory is renamed to `.iter-NNNN.gG.partial/moved`
//! (next to a `moved-from` file naming where it came from, written first), which costs
//! nothing however large the checkpoint; files the pick leaves out (`exclude`) are renamed
//! back to where they were, and every other file is hashed (and fsynced) once, in place.
//! A checkpoint holding symbolic links (whose content the checkpoint must hold, not the
//! link), or on another filesystem than `models/` (`EXDEV`), is *copied* instead, hashing
//! each buffer as it is copied, on a second thread. A moved checkpoint exists only in the
//! partial directory until it is published, so a hand-off that starts first finishes any
//! moved checkpoint an interrupted one left, whatever generation moved it
//! ([`pending_move`]), before it picks anything.
//!
//! Then the manifest is written, and the directory is renamed to its final name without
//! ever replacing an existing checkpoint; only then is `LATEST` rewritten, and never to an
//! older checkpoint than a verified one it names. Both the rename and the `LATEST` switch
//! are preceded by a caller-supplied fence that checks this node still owns the hand-off
//! (is the current generation's rank 0): an older generation that wakes up mid-copy stops
//! there. The window between the fence and the rename (or the `LATEST` write) is a few
//! system calls; it is not closed, only made that small.
//!
//! A crash at any point leaves `LATEST` naming a complete, verifiable checkpoint (the old
//! or the new one); and a `LATEST` that is deleted or damaged anyway (empty, naming
//! something outside `models/` or a missing directory, or not matching its manifest) is
//! never served: [`latest_as`] falls back to the newest checkpoint that verifies, checked
//! against what rank 0's journal says was published ([`Journaled`]), so that a lost
//! `LATEST` never silently sends the run back to its base model. Verifying is cheap by
//! default ([`Check::Sizes`]: the manifest against its digest, every file's existence and
//! size); [`Check::Hash`] re-hashes every file.
//!
//! [`prune`] keeps `models/` from growing without bound: it deletes checkpoints beyond the
//! newest N (never the one `LATEST` names, nor those the caller spares) by renaming each to
//! a hidden `.trash-` name first, so a crash mid-deletion leaves no half-deleted checkpoint
//! under a checkpoint's name; [`empty_trash`] finishes such a deletion.

use crate::layout::iteration_of;
use crate::protocol::fence::Site;
use crate::store::{DataRead, Kind, ReadLimit, SharedDir};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};

// The names inside `models/` and a checkpoint are the layout's.
use crate::layout::{checkpoint_partial, checkpoint_trash, latest_in, MOVED, MOVED_FROM};
pub use crate::layout::{LATEST, MANIFEST, MANIFEST_DIGEST};

/// How the picked checkpoint reaches `models/` (`phases.handoff.transfer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transfer {
    /// Rename it into `models/` (on the same filesystem, holding no links); else copy.
    #[default]
    Move,
    /// Always copy it: the training output stays as the trainer left it.
    Copy,
}

impl Transfer {
    pub fn parse(s: &str) -> Option<Transfer> {
        match s {
            "move" => Some(Transfer::Move),
            "copy" => Some(Transfer::Copy),
            _ => None,
        }
    }
}

/// How much a node checks of a checkpoint before it serves or trains from it
/// (`phases.handoff.verify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Check {
    /// The manifest against `manifest.sha256`, every listed file's existence and size, and
    /// no file the manifest does not list. A checkpoint without a digest (published by an
    /// earlier version) is checked as [`Check::Hash`].
    #[default]
    Sizes,
    /// All of that, and every file's SHA-256.
    Hash,
}

impl Check {
    pub fn parse(s: &str) -> Option<Check> {
        match s {
            "sizes" => Some(Check::Sizes),
            "hash" => Some(Check::Hash),
            _ => None,
        }
    }
}

/// What a hand-off publishes, and how.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Globs of files readers rewrite in place (recorded in the manifest, see [`Manifest`]).
    pub mutable: Vec<String>,
    /// Globs of files (or, ending in `/`, directories) the checkpoint leaves out, e.g.
    /// optimizer states. Relative to the checkpoint root, like `mutable`.
    pub exclude: Vec<String>,
    pub transfer: Transfer,
    /// When the manifest says the checkpoint was made, as the node's clock stamps it
    /// (`None`: the machine's clock, now).
    pub created_at: Option<String>,
    /// A hand-off broken on purpose (the simulator's own tests; ignored without the `sim`
    /// feature, see `crate::protocol::mutation`).
    #[doc(hidden)]
    pub mutation: Option<Mutation>,
}

/// A deliberately broken hand-off, for the simulator's own tests (never set by the node on
/// its own): shows that the simulator catches a `LATEST` naming a checkpoint that a crash
/// can take away.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A moved checkpoint's files are hashed but not fsynced before it is published: the
    /// trainer's buffered writes, which a crash of its machine loses, are all `LATEST`
    /// names.
    Unsynced,
}

impl Options {
    fn excludes(&self, rel: &Path) -> bool {
        excluded_by(&self.exclude, rel)
    }
}

/// Whether one of the globs `exclude` leaves out the file at `rel`: a glob matches the
/// file's relative path, or, ending in `/`, the relative path of a directory above it.
pub fn excluded_by(exclude: &[String], rel: &Path) -> bool {
    let rel_s = rel.to_string_lossy();
    exclude.iter().any(|g| match g.strip_suffix('/') {
        Some(dir) => glob::Pattern::new(dir).is_ok_and(|p| {
            rel.ancestors()
                .skip(1)
                .filter(|a| !a.as_os_str().is_empty())
                .any(|a| p.matches(&a.to_string_lossy()))
        }),
        None => glob::Pattern::new(g).is_ok_and(|p| p.matches(&rel_s)),
    })
}

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
    #[error("every file of {} is left out by phases.handoff.exclude: there is nothing to publish", root.display())]
    NothingLeft { root: PathBuf },
    #[error("{} has the name of rl-node's own manifest at the top of the checkpoint; publishing would replace it: rename it in the trainer, or leave it out with phases.handoff.exclude", path.display())]
    Reserved { path: PathBuf },
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
/// `RL_NODE_TEST_HOLD_AT=<point>` holds the thread that gets there until the process
/// ends, as a copy that takes forever would.
pub(crate) fn crash_point(point: &str) {
    if std::env::var("RL_NODE_TEST_CRASH_AT").is_ok_and(|v| v == point) {
        crate::errln!("RL_NODE_TEST_CRASH_AT={point}: aborting");
        std::process::abort();
    }
    if std::env::var("RL_NODE_TEST_HOLD_AT").is_ok_and(|v| v == point) {
        // A hand-off that takes as long as the test likes (a large copy), while the node's
        // loop goes on watching.
        crate::errln!("RL_NODE_TEST_HOLD_AT={point}: holding here until the process ends");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
    static STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if std::env::var("RL_NODE_TEST_STOP_AT").is_ok_and(|v| v == point)
        && !STOPPED.swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        crate::errln!("RL_NODE_TEST_STOP_AT={point}: stopping (SIGSTOP), once");
        use rustix::process::{kill_process, Signal};
        let node = crate::holder::node_process();
        if node != std::process::id() {
            if let Some(supervisor) = crate::process::pid(node as i32) {
                let _ = kill_process(supervisor, Signal::STOP);
            }
        }
        let _ = kill_process(rustix::process::getpid(), Signal::STOP);
    }
}

/// The newest directory directly under `dir` whose name matches the glob `pattern`
/// (`*`, `?`, `[…]`), by modification time then name; `None` if nothing matches. The
/// pattern is validated when the configuration is loaded (`phases.handoff.pick`).
pub fn pick(store: &dyn SharedDir, dir: &Path, pattern: &str) -> Option<PathBuf> {
    if pattern.is_empty() {
        return None;
    }
    let pattern = glob::Pattern::new(pattern).ok()?;
    store
        .read_dir(dir)
        .ok()?
        .into_iter()
        .filter(|n| pattern.matches(&n.to_string_lossy()))
        .map(|n| dir.join(n))
        .filter(|p| {
            store
                .lstat(p)
                .is_ok_and(|m| m.is_some_and(|m| m.kind == Kind::Dir))
        })
        .max_by_key(|p| {
            (
                store.modified(p).ok().flatten(),
                p.file_name().map(|n| n.to_owned()),
            )
        })
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
fn checkpoint_files(store: &dyn SharedDir, root: &Path) -> Result<Vec<SourceFile>, PublishError> {
    let real_root = store.canonicalize(root).map_err(io_at(root))?;
    let mut out = Vec::new();
    let mut walk = Walk {
        store,
        root,
        real_root: &real_root,
        ancestors: vec![(real_root.clone(), root.to_path_buf())],
        out: &mut out,
    };
    walk.dir(root, &real_root)?;
    Ok(out)
}

/// A walk of a checkpoint root that follows links (as `walkdir` with `follow_links`): the
/// directories it is in, by where they really are and where the walk found them, so
/// that a link back to one of them is refused as a loop.
struct Walk<'a> {
    store: &'a dyn SharedDir,
    root: &'a Path,
    real_root: &'a Path,
    ancestors: Vec<(PathBuf, PathBuf)>,
    out: &'a mut Vec<SourceFile>,
}

impl Walk<'_> {
    /// The entries of the directory found at `path`, which really is `real`, sorted by name.
    fn dir(&mut self, path: &Path, real: &Path) -> Result<(), PublishError> {
        let mut names = self.store.read_dir(real).map_err(io_at(path))?;
        names.sort();
        for name in names {
            let (path, real) = (path.join(&name), real.join(&name));
            let Some(meta) = self.store.lstat(&real).map_err(io_at(&path))? else {
                continue;
            };
            let (kind, real, link_target) = if meta.kind == Kind::Symlink {
                let (kind, target, inside) = self.follow(&path, &real)?;
                (kind, target, Some(inside))
            } else {
                (meta.kind, real, None)
            };
            match kind {
                Kind::Dir => {
                    if let Some((_, seen)) = self.ancestors.iter().find(|(r, _)| *r == real) {
                        return Err(PublishError::Loop {
                            what: format!("it leads back to {}, which contains it", seen.display()),
                            link: path,
                        });
                    }
                    self.ancestors.push((real.clone(), path.clone()));
                    self.dir(&path, &real)?;
                    self.ancestors.pop();
                }
                Kind::File => {
                    let rel = path
                        .strip_prefix(self.root)
                        .expect("the walk stays under its root");
                    self.out.push(SourceFile {
                        src: path.clone(),
                        rel: rel.to_path_buf(),
                        link_target,
                    });
                }
                _ => return Err(PublishError::Special { path }),
            }
        }
        Ok(())
    }

    /// The link found at `path` (really at `real`): what it leads to (its kind and where it
    /// really is) and where that is relative to the root; refused when that leaves the
    /// root, does not exist or loops.
    fn follow(&self, path: &Path, real: &Path) -> Result<(Kind, PathBuf, String), PublishError> {
        let store = self.store;
        let target = match store.canonicalize(real) {
            Ok(t) => t,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(PublishError::Loop {
                    what: "following it leads through too many links (a cycle of links)".into(),
                    link: path.to_path_buf(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(PublishError::Dangling {
                    target: store.read_link(real).unwrap_or_default(),
                    link: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_at(path)(e)),
        };
        let Ok(inside) = target.strip_prefix(self.real_root) else {
            return Err(PublishError::LinkLeaves {
                link: path.to_path_buf(),
                target: store.read_link(real).unwrap_or(target),
                root: self.root.to_path_buf(),
            });
        };
        let inside = inside.to_string_lossy().into_owned();
        let kind = store
            .lstat(&target)
            .map_err(io_at(path))?
            .map_or(Kind::Other, |m| m.kind);
        Ok((kind, target, inside))
    }
}

fn sha256_file(
    store: &dyn SharedDir,
    path: &Path,
    tick: &mut dyn FnMut(),
) -> io::Result<(u64, String)> {
    sha256_of(&mut *store.open_data(path)?, tick)
}

/// [`sha256_file`], and fsync the file: a moved checkpoint's files are the trainer's,
/// which nothing synced.
fn sha256_synced(
    store: &dyn SharedDir,
    path: &Path,
    sync: bool,
    tick: &mut dyn FnMut(),
) -> io::Result<(u64, String)> {
    let hashed = sha256_file(store, path, tick)?;
    if sync {
        store.sync_file(path)?;
    }
    Ok(hashed)
}

fn sha256_of(f: &mut dyn DataRead, tick: &mut dyn FnMut()) -> io::Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = Vec::with_capacity(1 << 20);
    let mut size = 0u64;
    loop {
        buf.clear();
        let n = f.read_more(&mut buf, 1 << 20)?;
        if n == 0 {
            break;
        }
        h.update(&buf);
        size += n as u64;
        tick();
    }
    Ok((size, hex::encode(h.finalize())))
}

/// Check every file the manifest lists (size and SHA-256; a file the manifest calls
/// mutable only has to exist). Files the manifest does not list are not allowed either,
/// nor links: the directory must be exactly what was published. On the real filesystem,
/// for tools that hold no store.
pub fn verify(dir: &Path, tick: &mut dyn FnMut()) -> Result<Manifest, String> {
    verify_as(&crate::store::Fs, dir, Check::Hash, tick)
}

/// [`verify`], hashing every file only with [`Check::Hash`] (or when the checkpoint has
/// no manifest digest); with [`Check::Sizes`] the manifest must match its digest and
/// every file its size.
pub fn verify_as(
    store: &dyn SharedDir,
    dir: &Path,
    check: Check,
    tick: &mut dyn FnMut(),
) -> Result<Manifest, String> {
    let mpath = dir.join(MANIFEST);
    let bytes = store
        .read_file(&mpath, ReadLimit::Manifest)
        .map_err(|e| format!("{}: {e}", mpath.display()))?;
    let dpath = dir.join(MANIFEST_DIGEST);
    let digest = match store.read_file(&dpath, ReadLimit::Record) {
        Ok(b) => Some(String::from_utf8(b).map_err(|e| format!("{}: {e}", dpath.display()))?),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", dpath.display())),
    };
    if let Some(text) = &digest {
        let want = text.split_whitespace().next().unwrap_or_default();
        if want != hex::encode(Sha256::digest(&bytes)) {
            return Err(format!(
                "{} does not match {} (the manifest was changed or is incomplete)",
                mpath.display(),
                MANIFEST_DIGEST
            ));
        }
    }
    let hash = check == Check::Hash || digest.is_none();
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
            if !store.is_file(&p) {
                return Err(format!("{} is missing", p.display()));
            }
            continue;
        }
        let mismatch = |size: u64| {
            format!(
                "{} does not match the manifest (size {size}, expected {})",
                p.display(),
                f.size
            )
        };
        if hash {
            let (size, sha) =
                sha256_file(store, &p, tick).map_err(|e| format!("{}: {e}", p.display()))?;
            if size != f.size || sha != f.sha256 {
                return Err(mismatch(size));
            }
        } else {
            let meta = store
                .lstat(&p)
                .and_then(|m| m.ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT)))
                .map_err(|e| format!("{}: {e}", p.display()))?;
            if meta.kind != Kind::File || meta.len != f.size {
                return Err(mismatch(meta.len));
            }
            tick();
        }
    }
    let listed = m.files.len();
    let mut present = 0usize;
    for (path, meta) in store
        .walk(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
    {
        if meta.kind == Kind::Symlink {
            return Err(format!(
                "{} is a link; a published checkpoint holds only files",
                path.display()
            ));
        }
        if meta.kind != Kind::Dir && path != mpath && path != dpath {
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

/// The checkpoint `models/LATEST` names, as written, without checking it (for reports and
/// repairs; [`latest`] is what may be served).
pub fn latest_named(store: &dyn SharedDir, models: &Path) -> Option<PathBuf> {
    let name = store
        .read_file(&latest_in(models), ReadLimit::Record)
        .ok()?;
    let name = String::from_utf8(name).ok()?;
    let name = name.trim();
    is_plain_name(name).then(|| models.join(name))
}

/// A single, ordinary name of an entry in `models/` (no `/`, not `.` or `..`).
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != "." && name != ".." && !name.contains('\0')
}

/// What rank 0's journal says about the run's hand-offs: the evidence a fallback from an
/// unusable `models/LATEST` is bounded by and checked against (the run's own state is
/// evidence, never a default). [`Journaled::default`]: no journal to go by, no bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journaled {
    /// The newest iteration whose hand-off rank 0 journaled (published, skipped, or the
    /// whole iteration complete): no checkpoint of a later iteration was ever published as
    /// far as the run knows. `None`: no bound.
    pub through: Option<u64>,
    /// The newest checkpoint (`iter-NNNN`) a journaled hand-off published.
    pub published: Option<String>,
}

impl Journaled {
    /// From rank 0's journal entries of this run, for a walk that hands off; `walk_item`
    /// is its completion item (`Config::walk_item`).
    pub fn from_journal(entries: &[crate::protocol::journal::Entry], walk_item: &str) -> Journaled {
        use crate::protocol::journal::item;
        let through = entries
            .iter()
            .filter(|e| {
                [item::HANDOFF, item::HANDOFF_SKIPPED, walk_item].contains(&e.item.as_str())
            })
            .map(|e| e.iteration)
            .max()
            .unwrap_or(0);
        let published = entries
            .iter()
            .filter(|e| e.item == item::HANDOFF)
            .filter_map(|e| {
                let name = e.checkpoint.as_deref()?;
                (is_plain_name(name) && iteration_of(name).is_some())
                    .then(|| (e.iteration, name.to_string()))
            })
            .max()
            .map(|(_, name)| name);
        Journaled {
            through: Some(through),
            published,
        }
    }
}

/// The model to serve and train from, according to `models/` and rank 0's journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Latest {
    /// `models/LATEST` names this checkpoint and it verifies.
    Checkpoint(PathBuf),
    /// Nothing was published yet (no `models/LATEST`, and no checkpoint the journal
    /// knows of): the base model applies.
    Base,
    /// `models/LATEST` names `path`, which verifies, but is older than `published`, the
    /// newest checkpoint rank 0's journal records as published. rl-node only moves
    /// `LATEST` forward, so someone wrote it (to go back on purpose): it is used, and said.
    Behind { path: PathBuf, published: String },
    /// `models/LATEST` is missing or cannot be used (`problem` says why). `fallback`: the
    /// newest checkpoint that verifies and that the journal does not place after its last
    /// hand-off, or why there is none (the base model applies). `published`: the newest
    /// checkpoint rank 0's journal records as published, when the fallback is older than
    /// it (training goes back), or there is none (see [`Latest::stop`]).
    Damaged {
        problem: String,
        fallback: Result<PathBuf, String>,
        published: Option<String>,
    },
}

impl Latest {
    /// The checkpoint to use; `None`: the base model (`cluster.model`).
    pub fn path(&self) -> Option<&Path> {
        match self {
            Latest::Checkpoint(p) | Latest::Behind { path: p, .. } => Some(p),
            Latest::Damaged {
                fallback: Ok(p), ..
            } => Some(p),
            _ => None,
        }
    }

    /// What to tell the user when `LATEST` was not used as it is; `base` is
    /// `cluster.model`. `None` when there is nothing to say. When [`Latest::stop`] says
    /// to stop, that is the message instead.
    pub fn warning(&self, base: &str) -> Option<String> {
        let name = |p: &Path| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        };
        match self {
            Latest::Checkpoint(_) | Latest::Base => None,
            Latest::Behind { path, published } => Some(format!(
                "models/LATEST names {}, older than {published}, which rank 0's journal records as published (rl-node only moves LATEST forward, so it was written by hand); using {}, as LATEST says",
                name(path),
                name(path)
            )),
            Latest::Damaged {
                problem,
                fallback: Ok(p),
                published,
            } => Some(format!(
                "{problem}; using {}, the newest verified checkpoint{}",
                name(p),
                published
                    .as_ref()
                    .map(|k| format!(
                        ", older than {k}, which rank 0's journal records as published: training goes back to an older model"
                    ))
                    .unwrap_or_default()
            )),
            Latest::Damaged {
                problem,
                fallback: Err(none),
                ..
            } => Some(if base.trim().is_empty() {
                format!("{problem}, and {none}; there is no base model either (cluster.model is empty)")
            } else {
                format!("{problem}, and {none}; using the base model {base} (cluster.model)")
            }),
        }
    }

    /// Why the node must stop instead of serving anything, if it must: `LATEST` is
    /// unusable, no checkpoint verifies, and either there is no base model, or rank 0's
    /// journal records a published checkpoint, so going on from the base model would
    /// silently throw every iteration of training away.
    pub fn stop(&self, base: &str) -> Option<String> {
        let Latest::Damaged {
            problem,
            fallback: Err(none),
            published,
        } = self
        else {
            return None;
        };
        match published {
            Some(k) => Some(format!(
                "{problem}, and {none}, but rank 0's journal records {k} as published: going on from the base model would throw away the training of every iteration so far; restore models/{k} (with its manifest) from a copy, or start the run over with --fresh on rank 0 (the old run is set aside, nothing is deleted)"
            )),
            None if base.trim().is_empty() => Some(format!(
                "{}: there is no model to serve or train from; repair models/LATEST or set cluster.model",
                self.warning(base).unwrap_or_default()
            )),
            None => None,
        }
    }
}

/// Resolve `models/LATEST` to a checkpoint that verifies, without evidence from a journal
/// (see [`latest_as`]).
pub fn latest(store: &dyn SharedDir, models: &Path, tick: &mut dyn FnMut()) -> Latest {
    latest_as(store, models, Check::Hash, &Journaled::default(), tick)
}

/// Resolve `models/LATEST` to a checkpoint that verifies (as `check` says). A `LATEST`
/// that is missing, empty, names something outside `models/`, a missing directory or one
/// that does not verify is never used: the newest `models/iter-NNNN` (by iteration number)
/// that verifies is, with the problem reported in [`Latest::Damaged`].
///
/// `journaled` bounds that fallback. A checkpoint under its final name is complete: it is
/// renamed there only once every file is written, fsynced and listed in its manifest (a
/// copy in progress lives under `.iter-NNNN.gG.partial`, which is no checkpoint name), so
/// a half-copied leftover never verifies. But a complete one may still not be the run's
/// model yet: a hand-off interrupted after its rename, before it journaled, is redone
/// by the restart (it keeps the checkpoint and points `LATEST` at it then), and one
/// placed in `models/` by someone else was never the run's at all. So the fallback is the
/// newest that verifies among those of iterations whose hand-off the journal records,
/// never a newer one. A missing `LATEST` with no such checkpoint and nothing published
/// according to the journal is the ordinary state before the first hand-off: `Base`,
/// said by nobody.
pub fn latest_as(
    store: &dyn SharedDir,
    models: &Path,
    check: Check,
    journaled: &Journaled,
    tick: &mut dyn FnMut(),
) -> Latest {
    let problem = match pointer(store, models, check, tick) {
        Ok(dir) => return behind(dir, journaled),
        Err(problem) => problem,
    };
    let found = newest_verified(store, models, journaled.through, check, tick);
    let problem = match problem {
        Some(p) => p,
        None if found.candidates == 0 && journaled.published.is_none() => return Latest::Base,
        None => "models/LATEST is missing".to_string(),
    };
    let fallback = found
        .fallback
        .clone()
        .ok_or_else(|| found.none(&problem, journaled.through));
    // Training goes back when the fallback is older than what the journal says was
    // published (or there is none).
    let published = journaled
        .published
        .clone()
        .filter(|k| fallback.as_ref().map_or(true, |p| older_than(p, k)));
    Latest::Damaged {
        problem,
        fallback,
        published,
    }
}

/// What `models/LATEST` names, if that is a checkpoint that verifies; else what is wrong
/// with it (`None`: there is no `LATEST`).
fn pointer(
    store: &dyn SharedDir,
    models: &Path,
    check: Check,
    tick: &mut dyn FnMut(),
) -> Result<PathBuf, Option<String>> {
    let bytes = match store.read_file(&latest_in(models), ReadLimit::Record) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(None),
        Err(e) => return Err(Some(format!("models/LATEST cannot be read ({e})"))),
    };
    let text = String::from_utf8_lossy(&bytes);
    let name = text.trim();
    if name.is_empty() {
        return Err(Some("models/LATEST is empty".to_string()));
    }
    if !is_plain_name(name) {
        return Err(Some(format!(
            "models/LATEST names `{name}`, which is not a checkpoint in models/"
        )));
    }
    let dir = models.join(name);
    if !store.exists_followed(&dir) {
        return Err(Some(format!(
            "models/LATEST names {name}, which does not exist"
        )));
    }
    match verify_as(store, &dir, check, tick) {
        Ok(_) => Ok(dir),
        Err(e) => Err(Some(format!(
            "models/LATEST names {name}, which does not verify ({e})"
        ))),
    }
}

/// `LATEST` verifies: [`Latest::Checkpoint`], or [`Latest::Behind`] when it names an
/// older checkpoint than the journal's newest published one.
fn behind(dir: PathBuf, journaled: &Journaled) -> Latest {
    match &journaled.published {
        Some(k) if older_than(&dir, k) => Latest::Behind {
            path: dir,
            published: k.clone(),
        },
        _ => Latest::Checkpoint(dir),
    }
}

/// Whether the checkpoint `dir` is of an earlier iteration than the checkpoint named
/// `published` (false when either name carries none).
fn older_than(dir: &Path, published: &str) -> bool {
    match (dir_iteration(dir), iteration_of(published)) {
        (Some(ours), Some(theirs)) => ours < theirs,
        _ => false,
    }
}

/// The iteration of the checkpoint at `dir`, from its name (`iter-NNNN`).
fn dir_iteration(dir: &Path) -> Option<u64> {
    dir.file_name()
        .and_then(|n| iteration_of(&n.to_string_lossy()))
}

/// The outcome of looking for a fallback.
struct Found {
    /// The newest checkpoint that verifies.
    fallback: Option<PathBuf>,
    /// How many checkpoints were looked at, and how many newer ones were not.
    candidates: usize,
    newer: usize,
    /// The newest one looked at, when it does not verify: its name and why.
    newest_error: Option<(String, String)>,
}

impl Found {
    /// Why there is no fallback, for a message after `problem`.
    fn none(&self, problem: &str, through: Option<u64>) -> String {
        match (self.candidates, &self.newest_error) {
            (0, _) if self.newer == 0 => "models/ holds no checkpoint".to_string(),
            (0, _) => format!(
                "models/ holds no checkpoint of an iteration whose hand-off rank 0's journal records (iteration {} or earlier; the hand-off of a newer one did not finish)",
                through.unwrap_or_default()
            ),
            (n, Some((name, e))) if !problem.contains(e.as_str()) => format!(
                "none of the {n} checkpoint(s) in models/ verifies (the newest, {name}: {e})"
            ),
            (n, _) => format!("none of the {n} checkpoint(s) in models/ verifies"),
        }
    }
}

/// The `models/iter-NNNN` with the highest iteration (at most `through`, if given) that
/// verifies.
fn newest_verified(
    store: &dyn SharedDir,
    models: &Path,
    through: Option<u64>,
    check: Check,
    tick: &mut dyn FnMut(),
) -> Found {
    let all = checkpoints(store, models);
    let candidates: Vec<&(u64, PathBuf)> = all
        .iter()
        .filter(|(i, _)| through.is_none_or(|t| *i <= t))
        .collect();
    let mut found = Found {
        fallback: None,
        candidates: candidates.len(),
        newer: all.len() - candidates.len(),
        newest_error: None,
    };
    for (_, p) in candidates.iter().rev() {
        match verify_as(store, p, check, tick) {
            Ok(_) => {
                found.fallback = Some(p.clone());
                break;
            }
            Err(e) if found.newest_error.is_none() => {
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                found.newest_error = Some((name.into_owned(), e));
            }
            Err(_) => {}
        }
    }
    found
}

/// Every `models/iter-NNNN`, by iteration.
fn checkpoints(store: &dyn SharedDir, models: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = store
        .read_dir(models)
        .map(|d| {
            d.into_iter()
                .filter_map(|n| Some((iteration_of(n.to_str()?)?, models.join(n))))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// The `models/iter-NNNN` with the highest iteration at most `iteration` that verifies:
/// the model as it was once iteration `iteration` was trained (a failed training
/// publishes nothing, so the one before stands).
pub fn newest_at_most(
    store: &dyn SharedDir,
    models: &Path,
    iteration: u64,
    check: Check,
    tick: &mut dyn FnMut(),
) -> Option<PathBuf> {
    newest_verified(store, models, Some(iteration), check, tick).fallback
}

/// What `publish` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// `source` became a new checkpoint and `LATEST` names it.
    New(PathBuf),
    /// A complete, verified checkpoint of that name existed already (an earlier attempt
    /// published it); checkpoints are immutable, so it was kept and `source` was not used.
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

/// How a hand-off's content reached `models/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum How {
    /// The picked directory was renamed into `models/`.
    Moved,
    /// A checkpoint an interrupted hand-off had moved (see [`pending_move`]) was published.
    Resumed,
    /// Copied; `why` says why it was not moved (`None`: `transfer = "copy"`).
    Copied { why: Option<String> },
    /// Nothing was published: the checkpoint existed already.
    Existing,
}

impl How {
    /// One word for events and benchmarks.
    pub fn label(&self) -> &'static str {
        match self {
            How::Moved => "move",
            How::Resumed => "resume",
            How::Copied { .. } => "copy",
            How::Existing => "kept",
        }
    }
}

/// What [`publish_opts`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub published: Published,
    pub how: How,
    /// Files the pick left out (`Options::exclude`): not copied, or, when moved, put back
    /// where they were in the training output.
    pub excluded: usize,
    /// Where the checkpoint came from (for a resumed one: the training output it was
    /// moved from).
    pub source: PathBuf,
}

/// The hidden directory generation `gen` fills while publishing `name`. Per generation, so
/// an older generation's rank 0 that wakes up mid-copy never writes into (or renames) the
/// directory the current one is filling.
pub fn partial_dir(models: &Path, name: &str, gen: u64) -> PathBuf {
    checkpoint_partial(models, name, gen)
}

/// Whether `file_name` is a hand-off's partial directory (`.iter-NNNN.gG.partial`, or the
/// `.iter-NNNN.partial` of earlier versions).
pub fn is_partial_dir_name(file_name: &str) -> bool {
    file_name.starts_with(".iter-") && file_name.ends_with(".partial")
}

/// Whether the partial directory `dir` holds a checkpoint moved out of the training
/// output (which exists nowhere else until it is published), and where it was moved from.
///
/// `moved-from` holds that place relative to the shared directory (the parent of
/// `models/`), since the rank 0 that finishes the hand-off after a restart may be another
/// machine, mounting the directory elsewhere. An absolute path (a source outside the
/// shared directory, or a partial directory of an earlier version) is used as it is.
pub fn moved_from(store: &dyn SharedDir, dir: &Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    if !store.is_dir(&dir.join(MOVED)) {
        return None;
    }
    let bytes = store
        .read_file(&dir.join(MOVED_FROM), ReadLimit::Record)
        .ok()?;
    let recorded = PathBuf::from(std::ffi::OsString::from_vec(bytes));
    if recorded.is_absolute() {
        return Some(recorded);
    }
    let root = dir.parent()?.parent()?;
    crate::layout::resolve_recorded(root, &recorded).ok()
}

/// `source` as a checkpoint's records name it (`moved-from`, the manifest's `source`):
/// relative to the shared directory `models/` is in, when it is inside it.
fn recorded_source(models: &Path, source: &Path) -> PathBuf {
    models
        .parent()
        .and_then(|root| crate::layout::shared_relative_path(root, source))
        .unwrap_or(source)
        .to_path_buf()
}

/// The partial directory of a hand-off of `name` by generation `gen` or an earlier one that
/// moved the checkpoint out of the training output and did not finish: the newest such
/// generation's. Found by exact names, not by listing `models/` (a listing on a shared
/// filesystem can miss an entry another client created for up to a minute).
pub fn pending_move(store: &dyn SharedDir, models: &Path, name: &str, gen: u64) -> Option<PathBuf> {
    (1..=gen)
        .rev()
        .map(|g| partial_dir(models, name, g))
        .find(|p| moved_from(store, p).is_some())
}

/// Publish `source` (the checkpoint root) as `models/<name>` by copying it, and point
/// `LATEST` at it, as generation `gen`. `fence` is called immediately before the final
/// rename and before the `LATEST` switch; if it fails nothing more is done and its reason
/// is returned.
///
/// Idempotent: a complete, verified `models/<name>` from an earlier attempt is kept. An
/// existing `models/<name>` that does not verify is an error: a checkpoint is never
/// replaced, and nothing is copied.
pub fn publish(
    store: &dyn SharedDir,
    source: &Path,
    models: &Path,
    name: &str,
    gen: u64,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    publish_with(store, source, models, name, gen, &[], fence, tick)
}

/// [`publish`], recording `mutable` (globs of files readers may rewrite in place) in the
/// manifest.
#[allow(clippy::too_many_arguments)]
pub fn publish_with(
    store: &dyn SharedDir,
    source: &Path,
    models: &Path,
    name: &str,
    gen: u64,
    mutable: &[String],
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    let opts = Options {
        mutable: mutable.to_vec(),
        transfer: Transfer::Copy,
        ..Options::default()
    };
    publish_opts(store, source, models, name, gen, &opts, fence, tick).map(|o| o.published)
}

/// [`publish`] as `opts` say: moved or copied, leaving out excluded files. A moved
/// checkpoint an interrupted hand-off of `name` left (see [`pending_move`]) is published
/// first, instead of `source`.
#[allow(clippy::too_many_arguments)]
pub fn publish_opts(
    store: &dyn SharedDir,
    source: &Path,
    models: &Path,
    name: &str,
    gen: u64,
    opts: &Options,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Outcome, PublishError> {
    store.create_dir_all(models).map_err(io_at(models))?;
    let dest = models.join(name);
    if store.exists_followed(&dest) {
        return Ok(Outcome {
            published: keep_existing(store, models, name, &dest, fence, tick)?,
            how: How::Existing,
            excluded: 0,
            source: source.to_path_buf(),
        });
    }
    let tmp = partial_dir(models, name, gen);
    if let Some(pending) = pending_move(store, models, name, gen) {
        claim(store, models, &pending, &tmp)?;
        let at = Partial {
            store,
            tmp: &tmp,
            models,
            name,
        };
        return finish_moved(&at, opts, How::Resumed, fence, tick);
    }
    // Everything is checked before anything is written: a refused link leaves no trace.
    let sources = checkpoint_files(store, source)?;
    if sources.iter().all(|f| opts.excludes(&f.rel)) {
        return Err(PublishError::NothingLeft {
            root: source.to_path_buf(),
        });
    }
    if let Some(f) = sources.iter().find(|f| {
        (f.rel == Path::new(MANIFEST) || f.rel == Path::new(MANIFEST_DIGEST))
            && !opts.excludes(&f.rel)
    }) {
        return Err(PublishError::Reserved {
            path: source.join(&f.rel),
        });
    }
    if store.exists_followed(&tmp) {
        // This generation's own debris from a crashed copy (a moved checkpoint in it was
        // found above): not a checkpoint.
        store.remove_dir_all(&tmp).map_err(io_at(&tmp))?;
    }
    let at = Partial {
        store,
        tmp: &tmp,
        models,
        name,
    };
    let why = match opts.transfer {
        Transfer::Copy => None,
        Transfer::Move => match not_movable(store, source) {
            Some(why) => Some(why),
            None => match move_into(store, models, source, &tmp) {
                Ok(()) => {
                    crash_point("handoff:after-move");
                    return finish_moved(&at, opts, How::Moved, fence, tick);
                }
                Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                    Some("it is on another filesystem than models/".to_string())
                }
                Err(e) => return Err(io_at(source)(e)),
            },
        },
    };
    let recorded = recorded_source(models, source);
    copy_into(store, sources, &tmp, opts, tick).and_then(|(files, excluded)| {
        write_manifest(store, &tmp, name, &recorded, files, opts)?;
        Ok(Outcome {
            published: commit(&at, &tmp, true, fence, tick)?,
            how: How::Copied { why },
            excluded,
            source: source.to_path_buf(),
        })
    })
}

/// Why `source` cannot be renamed into `models/` as it is, if it cannot: a checkpoint
/// holds the content of the links its training output had, never the links.
fn not_movable(store: &dyn SharedDir, source: &Path) -> Option<String> {
    if store
        .lstat(source)
        .is_ok_and(|m| m.is_some_and(|m| m.kind == Kind::Symlink))
    {
        return Some("it is a symbolic link".into());
    }
    store
        .walk(source)
        .ok()?
        .into_iter()
        .find(|(_, m)| m.kind == Kind::Symlink)
        .map(|(p, _)| {
            format!(
                "it holds a symbolic link ({}), whose content a checkpoint must hold instead",
                p.display()
            )
        })
}

/// A hand-off's partial directory `tmp` in `models/`, filled to publish `name`.
struct Partial<'a> {
    store: &'a dyn SharedDir,
    tmp: &'a Path,
    models: &'a Path,
    name: &'a str,
}

/// Rename `source` to `tmp/moved`, having written `tmp/moved-from` (durably) first: from
/// the rename on, the partial directory says by itself what it holds and where it came from.
/// Nothing is left behind when the rename fails.
fn move_into(store: &dyn SharedDir, models: &Path, source: &Path, tmp: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    store.create_dir(tmp)?;
    let moved = (|| {
        let recorded = recorded_source(models, source);
        write_synced(
            store,
            &tmp.join(MOVED_FROM),
            recorded.as_os_str().as_bytes(),
        )?;
        store.fsync_dir(tmp)?;
        store.fsync_dir(models)?;
        store.rename(source, &tmp.join(MOVED))
    })();
    if let Err(e) = moved {
        let _ = store.remove_dir_all(tmp);
        return Err(e);
    }
    store.fsync_dir(tmp)?;
    if let Some(parent) = source.parent() {
        store.fsync_dir(parent)?;
    }
    Ok(())
}

/// A new file at `path` holding `bytes`, made durable.
fn write_synced(store: &dyn SharedDir, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = store.create_data(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Take over the moved checkpoint in `pending` (another generation's partial directory,
/// or this one's) into this generation's `tmp`: by renaming, so an older generation that
/// wakes up finds nothing left to publish.
fn claim(
    store: &dyn SharedDir,
    models: &Path,
    pending: &Path,
    tmp: &Path,
) -> Result<(), PublishError> {
    if pending == tmp {
        return Ok(());
    }
    if store.exists_followed(tmp) {
        store.remove_dir_all(tmp).map_err(io_at(tmp))?;
    }
    store.create_dir(tmp).map_err(io_at(tmp))?;
    let from = pending.join(MOVED_FROM);
    let to = tmp.join(MOVED_FROM);
    (|| {
        write_synced(store, &to, &store.read_file(&from, ReadLimit::Record)?)?;
        store.fsync_dir(tmp)?;
        store.fsync_dir(models)
    })()
    .map_err(io_at(&to))?;
    let moved = pending.join(MOVED);
    store
        .rename(&moved, &tmp.join(MOVED))
        .map_err(io_at(&moved))?;
    store.fsync_dir(tmp).map_err(io_at(tmp))?;
    // What is left of the other generation's directory is its note of where it came from.
    let _ = store.remove_dir_all(pending);
    Ok(())
}

/// Publish the checkpoint moved into `tmp/moved`: put excluded files back where they
/// were, hash (and fsync) the rest once, write the manifest, rename, point `LATEST`.
fn finish_moved(
    at: &Partial<'_>,
    opts: &Options,
    how: How,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Outcome, PublishError> {
    let (store, tmp) = (at.store, at.tmp);
    let from = moved_from(store, tmp).ok_or_else(|| PublishError::Io {
        path: tmp.join(MOVED_FROM),
        source: io::Error::new(io::ErrorKind::NotFound, "the moved checkpoint is missing"),
    })?;
    let moved = tmp.join(MOVED);
    let excluded = put_back_excluded(store, &moved, &from, opts)?;
    let mut sources = checkpoint_files(store, &moved)?;
    // An interrupted attempt's manifest is rewritten below.
    sources.retain(|f| f.rel != Path::new(MANIFEST) && f.rel != Path::new(MANIFEST_DIGEST));
    let sync = crate::protocol::mutation(opts.mutation) != Some(Mutation::Unsynced);
    let hashed = hash_in_place(store, &sources, sync, tick)?;
    let files = sources
        .into_iter()
        .zip(hashed)
        .map(|(f, (size, sha256))| FileEntry {
            path: f.rel.to_string_lossy().into_owned(),
            size,
            sha256,
            link_target: None,
        })
        .collect();
    // The trainer's directories were never synced either (what a directory holds first).
    let below = store.walk(&moved).map_err(io_at(&moved))?;
    for (d, _) in below.iter().rev().filter(|(_, m)| m.kind == Kind::Dir) {
        store.fsync_dir(d).map_err(io_at(d))?;
    }
    store.fsync_dir(&moved).map_err(io_at(&moved))?;
    let recorded = recorded_source(at.models, &from);
    write_manifest(store, &moved, at.name, &recorded, files, opts)?;
    Ok(Outcome {
        published: commit(at, &moved, false, fence, tick)?,
        how,
        excluded,
        source: from,
    })
}

/// Hash (and, with `sync`, fsync) `files` in place, several at once (the largest first,
/// one thread per core, at most 4; one after another where the store takes no concurrent
/// readers): a moved checkpoint's only pass over its data, which a copy's I/O does not
/// hide. Returns each file's size and SHA-256, in the order of `files`. This thread waits
/// for the hashers, calling `tick` only when their bytes advance (a read hung on the
/// filesystem is not hidden from the watchdog), and the crash point after each file.
fn hash_in_place(
    store: &dyn SharedDir,
    files: &[SourceFile],
    sync: bool,
    tick: &mut dyn FnMut(),
) -> Result<Vec<(u64, String)>, PublishError> {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::mpsc::RecvTimeoutError;
    if !store.concurrent_data() {
        return files
            .iter()
            .map(|f| {
                let hashed = sha256_synced(store, &f.src, sync, tick).map_err(io_at(&f.src));
                crash_point("handoff:mid-copy");
                hashed
            })
            .collect();
    }
    let mut order: Vec<usize> = (0..files.len()).collect();
    let size = |i: &usize| {
        store
            .stat(&files[*i].src)
            .ok()
            .flatten()
            .map_or(0, |m| m.len)
    };
    order.sort_by_key(|i| std::cmp::Reverse(size(i)));
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
        .min(files.len().max(1));
    let next = AtomicUsize::new(0);
    let chunks = AtomicU64::new(0);
    let (done, results) = std::sync::mpsc::channel::<(usize, io::Result<(u64, String)>)>();
    std::thread::scope(|s| {
        for _ in 0..workers {
            let done = done.clone();
            let (order, next, chunks) = (&order, &next, &chunks);
            s.spawn(move || loop {
                let Some(&i) = order.get(next.fetch_add(1, Ordering::SeqCst)) else {
                    return;
                };
                let hashed = sha256_synced(store, &files[i].src, sync, &mut || {
                    chunks.fetch_add(1, Ordering::Relaxed);
                });
                if done.send((i, hashed)).is_err() {
                    return;
                }
            });
        }
        drop(done);
        let mut out: Vec<Option<(u64, String)>> = vec![None; files.len()];
        let mut failed = None;
        let mut seen = 0;
        loop {
            match results.recv_timeout(std::time::Duration::from_millis(100)) {
                Ok((i, Ok(hashed))) => {
                    out[i] = Some(hashed);
                    crash_point("handoff:mid-copy");
                }
                Ok((i, Err(e))) => {
                    // Stop handing out files; the first failure is the one reported.
                    next.store(files.len(), Ordering::SeqCst);
                    failed.get_or_insert_with(|| io_at(&files[i].src)(e));
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            let now = chunks.load(Ordering::Relaxed);
            if now != seen {
                seen = now;
                tick();
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(out
                .into_iter()
                .map(|h| h.expect("every file was hashed"))
                .collect()),
        }
    })
}

/// Rename the files of `moved` that `opts` exclude back to the same relative path under
/// `from`, the training output (recreating its directories), and remove the directories
/// that leaves empty. Idempotent: a resumed hand-off puts back what a crash left.
fn put_back_excluded(
    store: &dyn SharedDir,
    moved: &Path,
    from: &Path,
    opts: &Options,
) -> Result<usize, PublishError> {
    if opts.exclude.is_empty() {
        return Ok(0);
    }
    let mut excluded = Vec::new();
    for (path, meta) in store.walk(moved).map_err(io_at(moved))? {
        let rel = path.strip_prefix(moved).expect("under its root");
        if meta.kind != Kind::Dir && opts.excludes(rel) {
            excluded.push(rel.to_path_buf());
        }
    }
    for rel in &excluded {
        let back = from.join(rel);
        let parent = back.parent().expect("has a parent");
        store.create_dir_all(parent).map_err(io_at(parent))?;
        store
            .rename_noreplace(&moved.join(rel), &back)
            .map_err(io_at(&back))?;
    }
    // Directories emptied by it (a DeepSpeed global_step*/ of optimizer states); reversed,
    // the walk lists what a directory holds before the directory.
    for (path, meta) in store.walk(moved).unwrap_or_default().into_iter().rev() {
        if meta.kind == Kind::Dir {
            let _ = store.remove_dir(&path);
        }
    }
    if !excluded.is_empty() {
        store.fsync_dir(from).map_err(io_at(from))?;
    }
    Ok(excluded.len())
}

/// Copy the files of `sources` that `opts` keep into `tmp`, hashing each as it is copied.
fn copy_into(
    store: &dyn SharedDir,
    sources: Vec<SourceFile>,
    tmp: &Path,
    opts: &Options,
    tick: &mut dyn FnMut(),
) -> Result<(Vec<FileEntry>, usize), PublishError> {
    store.create_dir_all(tmp).map_err(io_at(tmp))?;
    let mut files = Vec::new();
    let mut excluded = 0;
    for f in sources {
        if opts.excludes(&f.rel) {
            excluded += 1;
            continue;
        }
        let dst = tmp.join(&f.rel);
        let parent = dst.parent().expect("has parent");
        store.create_dir_all(parent).map_err(io_at(parent))?;
        let (size, sha256) = copy_hashed(store, &f.src, &dst, tick)?;
        files.push(FileEntry {
            path: f.rel.to_string_lossy().into_owned(),
            size,
            sha256,
            link_target: f.link_target,
        });
        crash_point("handoff:mid-copy");
    }
    Ok((files, excluded))
}

/// Write `dir/manifest.json` and its digest `dir/manifest.sha256`, durably. `source` as
/// [`recorded_source`] gives it.
fn write_manifest(
    store: &dyn SharedDir,
    dir: &Path,
    name: &str,
    source: &Path,
    files: Vec<FileEntry>,
    opts: &Options,
) -> Result<(), PublishError> {
    let manifest = Manifest {
        name: name.to_string(),
        source: source.display().to_string(),
        files,
        created_at: opts
            .created_at
            .clone()
            .unwrap_or_else(crate::clock::wall_now),
        mutable: opts.mutable.clone(),
    };
    let mpath = dir.join(MANIFEST);
    let bytes = crate::store::fs::json_bytes(&manifest).map_err(io_at(&mpath))?;
    let write = |path: &Path, bytes: &[u8]| -> Result<(), PublishError> {
        write_synced(store, path, bytes).map_err(io_at(path))
    };
    write(&mpath, &bytes)?;
    let digest = format!("{}  {MANIFEST}\n", hex::encode(Sha256::digest(&bytes)));
    write(&dir.join(MANIFEST_DIGEST), digest.as_bytes())?;
    store.fsync_dir(dir).map_err(io_at(dir))
}

/// Rename the complete checkpoint `ready` to `models/<name>` (never replacing one) and
/// point `LATEST` at it; the fence is checked right before each. When `name` was
/// published meanwhile and verifies, it is kept, and `ready` removed if `discard` (a copy;
/// a moved checkpoint is left where it is).
fn commit(
    at: &Partial<'_>,
    ready: &Path,
    discard: bool,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    let (store, models, name) = (at.store, at.models, at.name);
    let dest = models.join(name);
    crash_point("handoff:before-rename");
    fence(Site::CheckpointRename).map_err(|reason| PublishError::Fenced {
        step: format!("renaming {} to {name}", ready.display()),
        reason,
    })?;
    match store.rename_noreplace(ready, &dest) {
        Ok(()) => {}
        Err(e) if is_exists(&e) => {
            // Published meanwhile by someone else: theirs stands if it verifies.
            let kept = keep_existing(store, models, name, &dest, fence, tick);
            if kept.is_ok() && discard {
                let _ = store.remove_dir_all(ready);
            }
            return kept;
        }
        Err(e) => return Err(io_at(&dest)(e)),
    }
    store.fsync_dir(models).map_err(io_at(models))?;
    if !discard {
        // A moved checkpoint's partial directory now holds only its `moved-from` note.
        if let Some(tmp) = ready.parent() {
            let _ = store.remove_dir_all(tmp);
        }
    }
    crash_point("handoff:before-latest");
    Ok(match point_latest(store, models, name, fence, tick)? {
        None => Published::New(dest),
        Some(latest) => Published::LatestAhead { path: dest, latest },
    })
}

fn is_exists(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::AlreadyExists || e.raw_os_error() == Some(libc::ENOTEMPTY)
}

/// `models/<name>` exists: keep it (and point `LATEST` at it) if it verifies, else refuse.
fn keep_existing(
    store: &dyn SharedDir,
    models: &Path,
    name: &str,
    dest: &Path,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Published, PublishError> {
    if let Err(problem) = verify_as(store, dest, Check::Hash, tick) {
        return Err(PublishError::Exists {
            path: dest.to_path_buf(),
            problem,
        });
    }
    Ok(match point_latest(store, models, name, fence, tick)? {
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
    store: &dyn SharedDir,
    models: &Path,
    name: &str,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
    tick: &mut dyn FnMut(),
) -> Result<Option<PathBuf>, PublishError> {
    if let (Some(current), Some(ours)) = (latest_named(store, models), iteration_of(name)) {
        let newer = dir_iteration(&current).is_some_and(|theirs| theirs > ours);
        if newer && verify_as(store, &current, Check::Hash, tick).is_ok() {
            return Ok(Some(current));
        }
    }
    fence(Site::Latest).map_err(|reason| PublishError::Fenced {
        step: format!("pointing models/LATEST at {name}"),
        reason,
    })?;
    let pointer = latest_in(models);
    store
        .publish(&pointer, format!("{name}\n").as_bytes())
        .map_err(io_at(&pointer))?;
    crate::exercised::note(crate::exercised::Path::LatestSwitches);
    Ok(None)
}

/// Copy `src` to `dst` (fsynced) and return its size and SHA-256, hashed from the same
/// buffers on a second thread while the next one is read: one pass over the data. The
/// kernel is asked to write back as it goes, so the final fsync has little left to do.
fn copy_hashed(
    store: &dyn SharedDir,
    src: &Path,
    dst: &Path,
    tick: &mut dyn FnMut(),
) -> Result<(u64, String), PublishError> {
    const CHUNK: usize = 4 << 20;
    const WRITEBACK: u64 = 32 << 20;
    let mut r = store.open_data(src).map_err(io_at(src))?;
    let mut w = store.create_data(dst).map_err(io_at(dst))?;
    let (full, to_hash) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
    let (give_back, empty) = std::sync::mpsc::channel::<Vec<u8>>();
    let (copied, sha) = std::thread::scope(|s| {
        let hasher = s.spawn(move || {
            let mut h = Sha256::new();
            for buf in to_hash {
                h.update(&buf);
                let _ = give_back.send(buf);
            }
            hex::encode(h.finalize())
        });
        let copied = (|| -> Result<u64, PublishError> {
            let mut size = 0u64;
            loop {
                let mut buf = empty.try_recv().unwrap_or_default();
                buf.clear();
                let n = read_full(&mut *r, &mut buf, CHUNK).map_err(io_at(src))?;
                if n == 0 {
                    return Ok(size);
                }
                buf.truncate(n);
                w.write_all(&buf).map_err(io_at(dst))?;
                let synced = size - size % WRITEBACK;
                size += n as u64;
                if size - synced >= WRITEBACK {
                    w.written(synced, size - synced);
                }
                if full.send(buf).is_err() {
                    unreachable!("the hasher outlives the copy");
                }
                tick();
            }
        })();
        drop(full);
        (copied, hasher.join().expect("the hasher does not panic"))
    });
    let size = copied?;
    w.sync_all().map_err(io_at(dst))?;
    Ok((size, sha))
}

/// Read onto the end of `buf` until it holds `want` bytes or the file ends; the number of
/// bytes read.
fn read_full(r: &mut dyn DataRead, buf: &mut Vec<u8>, want: usize) -> io::Result<usize> {
    let mut n = 0;
    while n < want {
        match r.read_more(buf, want - n) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Delete the checkpoints of `models/` beyond the newest `keep_last` (by iteration), except
/// the one `LATEST` names and those `spare` keeps (by iteration). Each is first renamed to
/// `.trash-iter-NNNN` and `models/` fsynced, then removed: a crash mid-deletion leaves a
/// hidden name that [`empty_trash`] removes, never a half-deleted `iter-NNNN` that would
/// fail verification. `fence` is checked before the first rename. Returns the names
/// deleted; `keep_last = 0` keeps everything.
pub fn prune(
    store: &dyn SharedDir,
    models: &Path,
    keep_last: usize,
    spare: &dyn Fn(u64) -> bool,
    fence: &mut dyn FnMut(Site) -> Result<(), String>,
) -> Result<Vec<String>, PublishError> {
    if keep_last == 0 {
        return Ok(vec![]);
    }
    let latest = latest_named(store, models).and_then(|p| Some(p.file_name()?.to_owned()));
    let mut found: Vec<(u64, String)> = store
        .read_dir(models)
        .map_err(io_at(models))?
        .into_iter()
        .filter_map(|n| {
            let name = n.into_string().ok()?;
            Some((iteration_of(&name)?, name))
        })
        .filter(|(_, name)| {
            let meta = store.lstat(&models.join(name));
            meta.is_ok_and(|m| m.is_some_and(|m| m.kind == Kind::Dir))
        })
        .collect();
    found.sort();
    let doomed: Vec<String> = found
        .into_iter()
        .rev()
        .skip(keep_last)
        .filter(|(it, name)| latest.as_deref() != Some(name.as_ref()) && !spare(*it))
        .map(|(_, name)| name)
        .collect();
    if doomed.is_empty() {
        return Ok(doomed);
    }
    fence(Site::Other).map_err(|reason| PublishError::Fenced {
        step: format!("deleting {}", doomed.join(", ")),
        reason,
    })?;
    for name in &doomed {
        let trash = checkpoint_trash(models, name);
        if store.exists_followed(&trash) {
            store.remove_dir_all(&trash).map_err(io_at(&trash))?;
        }
        store
            .rename_noreplace(&models.join(name), &trash)
            .map_err(io_at(&trash))?;
    }
    store.fsync_dir(models).map_err(io_at(models))?;
    crash_point("prune:before-remove");
    empty_trash(store, models)?;
    Ok(doomed)
}

/// Remove what a [`prune`] renamed to `.trash-…` and did not finish removing; returns the
/// names removed.
pub fn empty_trash(store: &dyn SharedDir, models: &Path) -> Result<Vec<String>, PublishError> {
    let mut removed = Vec::new();
    let Ok(entries) = store.read_dir(models) else {
        return Ok(removed);
    };
    for n in entries {
        let name = n.to_string_lossy().into_owned();
        if crate::layout::is_checkpoint_trash(&name) {
            let path = models.join(&n);
            match store.remove_dir_all(&path) {
                Ok(()) => removed.push(name),
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => return Err(io_at(&path)(err)),
            }
        }
    }
    removed.sort();
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Fs;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn tree(root: &Path) {
        fs::create_dir_all(root.join("sub")).unwrap();
        fs::write(root.join("weights.bin"), vec![7u8; 3000]).unwrap();
        fs::write(root.join("sub/config.json"), b"{}").unwrap();
    }

    fn open(_: Site) -> Result<(), String> {
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
            &Fs,
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
        publish(&Fs, src, models, name, 1, &mut open, &mut || {})
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
        assert_eq!(
            latest(&Fs, &models, &mut || {}),
            Latest::Checkpoint(out.clone())
        );
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
        let mut replaced = |_| Err("generation 1 was replaced by generation 2".to_string());
        let err = publish(
            &Fs,
            &src,
            &models,
            "iter-0001",
            1,
            &mut replaced,
            &mut || {},
        )
        .unwrap_err();
        assert!(
            err.to_string().starts_with("stopped before renaming")
                && err
                    .to_string()
                    .ends_with("generation 1 was replaced by generation 2"),
            "{err}"
        );
        // Only this generation's partial directory is left; the next generation uses its own.
        assert_eq!(names(&models), vec![".iter-0001.g1.partial"]);
        let out = publish(&Fs, &src, &models, "iter-0001", 2, &mut open, &mut || {}).unwrap();
        assert!(matches!(out, Published::New(_)));
        assert_eq!(
            names(&models),
            vec![".iter-0001.g1.partial", "LATEST", "iter-0001"]
        );
        // The fence is also checked before LATEST moves (here: on an idempotent re-publish).
        fs::remove_file(models.join(LATEST)).unwrap();
        let mut calls = 0;
        let mut second_fails = |_| {
            calls += 1;
            Err(format!("call {calls}"))
        };
        let err = publish(
            &Fs,
            &src,
            &models,
            "iter-0001",
            3,
            &mut second_fails,
            &mut || {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("stopped before pointing models/LATEST at iter-0001"),
            "{err}"
        );
        assert!(!models.join(LATEST).exists());
        // The same generation cleans up its own stale partial on its next attempt.
        publish(&Fs, &src, &models, "iter-0002", 1, &mut open, &mut || {}).unwrap();
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
        assert_eq!(latest(&Fs, &models, &mut || {}), Latest::Base);
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
            let l = latest(&Fs, &models, &mut || {});
            assert_eq!(
                l,
                Latest::Damaged {
                    problem: problem.into(),
                    fallback: Ok(newest.clone()),
                    published: None,
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
        let l = latest(&Fs, &models, &mut || {});
        assert_eq!(l.path(), Some(models.join("iter-0002").as_path()));
        let w = l.warning("").unwrap();
        assert!(
            w.starts_with("models/LATEST names iter-0010, which does not verify (")
                && w.ends_with("); using iter-0002, the newest verified checkpoint"),
            "{w}"
        );
        assert_eq!(l.stop(""), None);
        // Nothing verifies: the base model, or no model at all.
        for it in [1, 2] {
            fs::write(models.join(format!("iter-{it:04}/weights.bin")), b"changed").unwrap();
        }
        let l = latest(&Fs, &models, &mut || {});
        assert_eq!(l.path(), None);
        assert!(l.stop("").is_some_and(|s| s.ends_with(
            "there is no base model either (cluster.model is empty): there is no model to serve or train from; repair models/LATEST or set cluster.model"
        )));
        assert_eq!(l.stop("/models/base"), None);
        let w = l.warning("/models/base").unwrap();
        assert!(
            w.ends_with(", and none of the 3 checkpoint(s) in models/ verifies; using the base model /models/base (cluster.model)"),
            "{w}"
        );
        assert!(!l.warning("").unwrap().contains("  "));
    }

    #[test]
    fn a_missing_latest_falls_back_to_the_newest_verified_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        for it in [1, 2, 3] {
            publish_as(&src, &models, &format!("iter-{it:04}")).unwrap();
        }
        fs::remove_file(models.join(LATEST)).unwrap();
        // The newest one does not verify: it is skipped for the newest that does.
        fs::write(models.join("iter-0003/weights.bin"), b"changed").unwrap();
        let l = latest(&Fs, &models, &mut || {});
        assert_eq!(
            l,
            Latest::Damaged {
                problem: "models/LATEST is missing".into(),
                fallback: Ok(models.join("iter-0002")),
                published: None,
            }
        );
        assert_eq!(
            l.warning("base").as_deref(),
            Some("models/LATEST is missing; using iter-0002, the newest verified checkpoint")
        );
        assert_eq!(l.stop(""), None);
        // None verifies: the base model, said.
        fs::write(models.join("iter-0002/weights.bin"), b"changed").unwrap();
        fs::write(models.join("iter-0001/weights.bin"), b"changed").unwrap();
        let l = latest(&Fs, &models, &mut || {});
        assert_eq!(l.path(), None);
        let w = l.warning("/base").unwrap();
        assert!(
            w.starts_with("models/LATEST is missing, and none of the 3 checkpoint(s) in models/ verifies (the newest, iter-0003: ")
                && w.ends_with("; using the base model /base (cluster.model)"),
            "{w}"
        );
        // An empty models/ (or none): the first start, nothing to say.
        let empty = d.path().join("empty");
        fs::create_dir_all(&empty).unwrap();
        assert_eq!(latest(&Fs, &empty, &mut || {}), Latest::Base);
        assert_eq!(Latest::Base.warning("/base"), None);
    }

    fn handoff(iteration: u64, checkpoint: Option<&str>) -> crate::protocol::journal::Entry {
        crate::protocol::journal::Entry {
            run_id: "r".into(),
            gen: 1,
            rank: 0,
            iteration,
            item: crate::protocol::journal::item::HANDOFF.into(),
            at: String::new(),
            note: None,
            failed: None,
            checkpoint: checkpoint.map(str::to_string),
        }
    }

    /// The journal's evidence: the fallback never goes past the last journaled hand-off,
    /// a missing `LATEST` before the first one is quiet, and a published checkpoint that
    /// is gone stops the node instead of restarting from the base model.
    #[test]
    fn the_journal_bounds_and_checks_the_fallback() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        let walk = "iteration-complete:both";
        let j = |n: u64| {
            let entries: Vec<_> = (1..=n)
                .map(|it| handoff(it, Some(&format!("iter-{it:04}"))))
                .collect();
            Journaled::from_journal(&entries, walk)
        };
        assert_eq!(
            j(2),
            Journaled {
                through: Some(2),
                published: Some("iter-0002".into())
            }
        );
        let resolve = |j: &Journaled| latest_as(&Fs, &models, Check::Sizes, j, &mut || {});
        // A first hand-off interrupted after its rename, before LATEST and its journal
        // entry: the restart redoes it; until then the base model, quietly.
        publish_as(&src, &models, "iter-0001").unwrap();
        fs::remove_file(models.join(LATEST)).unwrap();
        assert_eq!(resolve(&j(0)), Latest::Base);
        // Journaled up to 2, iter-0003 complete but not journaled (or put there by
        // someone else): never newer than the journal.
        for it in [2, 3] {
            publish_as(&src, &models, &format!("iter-{it:04}")).unwrap();
        }
        fs::remove_file(models.join(LATEST)).unwrap();
        let l = resolve(&j(2));
        assert_eq!(l.path(), Some(models.join("iter-0002").as_path()));
        assert_eq!(
            l.warning("").as_deref(),
            Some("models/LATEST is missing; using iter-0002, the newest verified checkpoint")
        );
        // Hand-offs that published nothing (training wrote nothing) bound it too.
        let nothing =
            Journaled::from_journal(&[handoff(1, Some("iter-0001")), handoff(2, None)], walk);
        assert_eq!(
            resolve(&nothing).path(),
            Some(models.join("iter-0002").as_path())
        );
        // The journal's newest checkpoint does not verify: an older one, said so.
        fs::write(models.join("iter-0002/weights.bin"), b"changed").unwrap();
        let l = resolve(&j(2));
        assert_eq!(l.path(), Some(models.join("iter-0001").as_path()));
        assert_eq!(
            l.warning("").as_deref(),
            Some("models/LATEST is missing; using iter-0001, the newest verified checkpoint, older than iter-0002, which rank 0's journal records as published: training goes back to an older model")
        );
        // LATEST written by hand to an older checkpoint: used, and said.
        fs::write(models.join(LATEST), "iter-0001\n").unwrap();
        let l = resolve(&j(2));
        assert_eq!(
            l,
            Latest::Behind {
                path: models.join("iter-0001"),
                published: "iter-0002".into()
            }
        );
        assert!(l.warning("").unwrap().contains("older than iter-0002"));
        fs::remove_file(models.join(LATEST)).unwrap();
        // Nothing the journal published verifies, or models/ is empty: a stop, with or
        // without a base model, never a silent restart from it.
        fs::write(models.join("iter-0001/weights.bin"), b"changed").unwrap();
        let stop = resolve(&j(2)).stop("/base").unwrap();
        assert!(
            stop.starts_with("models/LATEST is missing, and none of the 2 checkpoint(s) in models/ verifies (the newest, iter-0002: ")
                && stop.contains("but rank 0's journal records iter-0002 as published: going on from the base model would throw away the training of every iteration so far"),
            "{stop}"
        );
        fs::remove_dir_all(&models).unwrap();
        let stop = resolve(&j(2)).stop("/base").unwrap();
        assert!(
            stop.starts_with("models/LATEST is missing, and models/ holds no checkpoint, but rank 0's journal records iter-0002 as published"),
            "{stop}"
        );
    }

    #[test]
    fn picks_the_newest_directory_matching_a_glob() {
        let d = tempfile::tempdir().unwrap();
        for n in ["checkpoint-10", "checkpoint-20", "checkpoint-x", "logs"] {
            fs::create_dir_all(d.path().join(n)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        fs::write(d.path().join("checkpoint-99"), b"a file, not a directory").unwrap();
        let p = |pattern| pick(&Fs, d.path(), pattern).map(|p| p.file_name().unwrap().to_owned());
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

    fn moving(exclude: &[&str]) -> Options {
        Options {
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
            ..Options::default()
        }
    }

    fn publish_moving(
        src: &Path,
        models: &Path,
        name: &str,
        gen: u64,
        opts: &Options,
    ) -> Result<Outcome, PublishError> {
        publish_opts(&Fs, src, models, name, gen, opts, &mut open, &mut || {})
    }

    /// A training output with two checkpoints, the newer one with optimizer states.
    fn train_out(root: &Path) -> PathBuf {
        let older = root.join("checkpoint-10");
        tree(&older);
        let newer = root.join("checkpoint-20");
        tree(&newer);
        fs::write(newer.join("weights.bin"), vec![9u8; 5000]).unwrap();
        fs::write(newer.join("optimizer.pt"), vec![1u8; 7000]).unwrap();
        fs::create_dir_all(newer.join("global_step20")).unwrap();
        fs::write(newer.join("global_step20/optim_states.pt"), b"adam").unwrap();
        newer
    }

    #[test]
    fn a_checkpoint_on_the_same_filesystem_is_moved_and_hashed_once() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("train/iter-0001/gen-1");
        let src = train_out(&out);
        let models = d.path().join("models");
        let o = publish_moving(&src, &models, "iter-0001", 1, &moving(&[])).unwrap();
        assert_eq!(o.how, How::Moved);
        assert_eq!(o.source, src);
        let dir = models.join("iter-0001");
        assert_eq!(o.published, Published::New(dir.clone()));
        // The pick left the training output; its sibling stayed.
        assert!(!src.exists());
        assert_eq!(names(&out), vec!["checkpoint-10"]);
        assert_eq!(names(&models), vec!["LATEST", "iter-0001"]);
        let m = verify(&dir, &mut || {}).unwrap();
        // Relative to the shared directory, which other nodes mount elsewhere.
        assert_eq!(m.source, "train/iter-0001/gen-1/checkpoint-20");
        let listed: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            listed,
            vec![
                "global_step20/optim_states.pt",
                "optimizer.pt",
                "sub/config.json",
                "weights.bin"
            ]
        );
        assert_eq!(fs::read(dir.join("weights.bin")).unwrap(), vec![9u8; 5000]);
        verify_as(&Fs, &dir, Check::Sizes, &mut || {}).unwrap();
        // The digest is sha256sum's format.
        let digest = fs::read_to_string(dir.join(MANIFEST_DIGEST)).unwrap();
        let sum = hex::encode(Sha256::digest(fs::read(dir.join(MANIFEST)).unwrap()));
        assert_eq!(digest, format!("{sum}  manifest.json\n"));

        // The pick may be the training output itself (nothing matched `pick`).
        let gen_dir = d.path().join("train/iter-0002/gen-1");
        tree(&gen_dir);
        let o = publish_moving(&gen_dir, &models, "iter-0002", 1, &moving(&[])).unwrap();
        assert_eq!(o.how, How::Moved);
        assert!(!gen_dir.exists());
        verify(&models.join("iter-0002"), &mut || {}).unwrap();
    }

    #[test]
    fn links_or_asking_for_it_copy_instead_of_moving() {
        let d = tempfile::tempdir().unwrap();
        let models = d.path().join("models");
        let src = d.path().join("snapshot");
        tree(&src);
        symlink("weights.bin", src.join("model.bin")).unwrap();
        let o = publish_moving(&src, &models, "iter-0001", 1, &moving(&[])).unwrap();
        assert_eq!(
            o.how,
            How::Copied {
                why: Some(format!(
                    "it holds a symbolic link ({}), whose content a checkpoint must hold instead",
                    src.join("model.bin").display()
                ))
            }
        );
        assert!(src.join("model.bin").is_symlink());
        verify(&models.join("iter-0001"), &mut || {}).unwrap();

        let src = d.path().join("plain");
        tree(&src);
        let copy = Options {
            transfer: Transfer::Copy,
            ..Options::default()
        };
        let o = publish_moving(&src, &models, "iter-0002", 1, &copy).unwrap();
        assert_eq!(o.how, How::Copied { why: None });
        assert_eq!(names(&src), vec!["sub", "weights.bin"]);
        let m = verify_as(&Fs, &models.join("iter-0002"), Check::Sizes, &mut || {}).unwrap();
        let sha = hex::encode(Sha256::digest(vec![7u8; 3000]));
        assert_eq!(m.files[1].sha256, sha, "hashed while copying");
    }

    /// `models/` on another filesystem than the training output (tmpfs `/dev/shm` against
    /// the temporary directory, on disk): the rename fails with `EXDEV` and the checkpoint is
    /// copied. Skipped, saying so, where the two are one filesystem or `/dev/shm` is missing.
    #[test]
    fn across_filesystems_the_checkpoint_is_copied() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("skipped: no /dev/shm to put models/ on another filesystem");
            return;
        };
        let dev = |p: &Path| fs::metadata(p).unwrap().dev();
        if dev(d.path()) == dev(shm.path()) {
            eprintln!("skipped: /dev/shm is on the same filesystem as the temporary directory");
            return;
        }
        let src = d.path().join("checkpoint-1");
        tree(&src);
        let models = shm.path().join("models");
        let o = publish_moving(&src, &models, "iter-0001", 1, &moving(&[])).unwrap();
        assert_eq!(
            o.how,
            How::Copied {
                why: Some("it is on another filesystem than models/".into())
            }
        );
        assert_eq!(names(&src), vec!["sub", "weights.bin"]);
        assert_eq!(names(&models), vec!["LATEST", "iter-0001"]);
        verify(&models.join("iter-0001"), &mut || {}).unwrap();
    }

    #[test]
    fn excluded_files_are_not_published_and_a_moved_checkpoint_leaves_them_behind() {
        let opts = moving(&["optimizer*.pt", "global_step*/"]);
        for transfer in [Transfer::Move, Transfer::Copy] {
            let d = tempfile::tempdir().unwrap();
            let src = train_out(&d.path().join("out"));
            let models = d.path().join("models");
            let opts = Options {
                transfer,
                ..opts.clone()
            };
            let o = publish_moving(&src, &models, "iter-0001", 1, &opts).unwrap();
            assert_eq!(o.excluded, 2, "{transfer:?}");
            let dir = models.join("iter-0001");
            let m = verify(&dir, &mut || {}).unwrap();
            let listed: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
            assert_eq!(
                listed,
                vec!["sub/config.json", "weights.bin"],
                "{transfer:?}"
            );
            assert_eq!(
                names(&dir),
                vec![MANIFEST, MANIFEST_DIGEST, "sub", "weights.bin"]
            );
            // They stay in the training output, where they were.
            assert_eq!(
                fs::read(src.join("optimizer.pt")).unwrap(),
                vec![1u8; 7000],
                "{transfer:?}"
            );
            assert_eq!(
                fs::read(src.join("global_step20/optim_states.pt")).unwrap(),
                b"adam"
            );
            if transfer == Transfer::Move {
                assert_eq!(names(&src), vec!["global_step20", "optimizer.pt"]);
            }
        }
        assert!(excluded_by(&["a/".into()], Path::new("a/b/c")));
        assert!(!excluded_by(&["a/".into()], Path::new("a")));
        assert!(!excluded_by(&["b/".into()], Path::new("a/b")));
        assert!(excluded_by(&["*/b/".into()], Path::new("a/b/c")));
        assert!(!excluded_by(
            &["optimizer.pt".into()],
            Path::new("sub/optimizer.pt")
        ));

        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        let err = publish_moving(&src, &models, "iter-0001", 1, &moving(&["*"])).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "every file of {} is left out by phases.handoff.exclude: there is nothing to publish",
                src.display()
            )
        );
        assert!(names(&models).is_empty());
        assert_eq!(names(&src), vec!["sub", "weights.bin"]);
    }

    #[test]
    fn a_trainer_file_named_like_the_manifest_is_refused_unless_left_out() {
        for transfer in [Transfer::Move, Transfer::Copy] {
            let d = tempfile::tempdir().unwrap();
            let src = d.path().join("out");
            tree(&src);
            fs::write(src.join(MANIFEST), b"{\"trainer\": true}").unwrap();
            let models = d.path().join("models");
            let opts = Options {
                transfer,
                ..Options::default()
            };
            let err = publish_moving(&src, &models, "iter-0001", 1, &opts).unwrap_err();
            assert!(
                matches!(&err, PublishError::Reserved { path } if path == &src.join(MANIFEST)),
                "{err}"
            );
            assert!(err.to_string().contains("phases.handoff.exclude"), "{err}");
            // Nothing moved or written: the trainer's file is where it was.
            assert!(!models.join("iter-0001").exists());
            assert_eq!(
                fs::read(src.join(MANIFEST)).unwrap(),
                b"{\"trainer\": true}"
            );
            // Left out, it stays in the training output and the rest is published.
            let opts = Options {
                exclude: vec![MANIFEST.to_string()],
                ..opts
            };
            publish_moving(&src, &models, "iter-0001", 1, &opts).unwrap();
            verify(&models.join("iter-0001"), &mut || {}).unwrap();
            assert_eq!(
                fs::read(src.join(MANIFEST)).unwrap(),
                b"{\"trainer\": true}"
            );
        }
    }

    /// Each state a crash can leave a moved hand-off in, rebuilt by hand (a crash point
    /// aborts the process; tests/checkpoints.rs crashes the real binary there): the next
    /// generation publishes the moved checkpoint, not what it would pick now.
    #[test]
    fn a_moved_checkpoint_an_interrupted_handoff_left_is_published_by_the_next_one() {
        let opts = moving(&["optimizer.pt"]);
        for state in [
            "after-move",
            "excluded-half-put-back",
            "before-rename",
            "before-latest",
        ] {
            let d = tempfile::tempdir().unwrap();
            let out = d.path().join("out");
            let src = train_out(&out);
            let models = d.path().join("models");
            fs::create_dir_all(&models).unwrap();
            let g1 = partial_dir(&models, "iter-0001", 1);
            match state {
                "after-move" => move_into(&Fs, &models, &src, &g1).unwrap(),
                "excluded-half-put-back" => {
                    move_into(&Fs, &models, &src, &g1).unwrap();
                    fs::create_dir_all(&src).unwrap();
                    fs::rename(g1.join("moved/optimizer.pt"), src.join("optimizer.pt")).unwrap();
                }
                "before-rename" => {
                    let mut fenced = |_| Err("replaced".to_string());
                    let e = publish_opts(
                        &Fs,
                        &src,
                        &models,
                        "iter-0001",
                        1,
                        &opts,
                        &mut fenced,
                        &mut || {},
                    )
                    .unwrap_err();
                    assert!(matches!(e, PublishError::Fenced { .. }), "{e}");
                    assert!(g1.join("moved").join(MANIFEST).exists());
                }
                _ => {
                    let mut calls = 0;
                    let mut second_fails = |_| {
                        calls += 1;
                        if calls == 1 {
                            Ok(())
                        } else {
                            Err("replaced".to_string())
                        }
                    };
                    publish_opts(
                        &Fs,
                        &src,
                        &models,
                        "iter-0001",
                        1,
                        &opts,
                        &mut second_fails,
                        &mut || {},
                    )
                    .unwrap_err();
                    assert!(models.join("iter-0001").exists() && !models.join(LATEST).exists());
                }
            }
            assert!(!src.join("weights.bin").exists(), "{state}");
            // What a pick would find now is the older checkpoint: it must not be published.
            let older = out.join("checkpoint-10");
            let o = publish_moving(&older, &models, "iter-0001", 2, &opts).unwrap();
            let dir = models.join("iter-0001");
            assert_eq!(
                latest(&Fs, &models, &mut || {}),
                Latest::Checkpoint(dir.clone())
            );
            assert_eq!(
                fs::read(dir.join("weights.bin")).unwrap(),
                vec![9u8; 5000],
                "{state}"
            );
            if state == "before-latest" {
                assert_eq!(o.how, How::Existing);
            } else {
                assert_eq!(o.how, How::Resumed, "{state}");
                assert_eq!(o.source, src, "{state}");
                // Only what is still in the moved checkpoint is put back now.
                assert_eq!(o.excluded, usize::from(state == "after-move"), "{state}");
            }
            assert_eq!(names(&models), vec!["LATEST", "iter-0001"], "{state}");
            assert!(!verify(&dir, &mut || {})
                .unwrap()
                .files
                .iter()
                .any(|f| f.path == "optimizer.pt"));
            assert_eq!(fs::read(src.join("optimizer.pt")).unwrap(), vec![1u8; 7000]);
            assert_eq!(names(&older), vec!["sub", "weights.bin"], "{state}");
        }
    }

    /// A hand-off interrupted after the move is finished by a rank 0 that mounts the
    /// shared directory elsewhere (here: the directory itself moved): `moved-from` is
    /// relative to it, so the excluded files go back into the training output as that
    /// rank 0 sees it.
    #[test]
    fn an_interrupted_move_is_finished_from_another_mount_point() {
        let d = tempfile::tempdir().unwrap();
        let (here, there) = (d.path().join("mnt-a"), d.path().join("mnt-b"));
        let src = train_out(&here.join("train/iter-0001/gen-1"));
        let models = here.join("models");
        fs::create_dir_all(&models).unwrap();
        let g1 = partial_dir(&models, "iter-0001", 1);
        move_into(&Fs, &models, &src, &g1).unwrap();
        assert_eq!(
            fs::read_to_string(g1.join(MOVED_FROM)).unwrap(),
            "train/iter-0001/gen-1/checkpoint-20"
        );
        fs::rename(&here, &there).unwrap();
        let models = there.join("models");
        let src = there.join("train/iter-0001/gen-1/checkpoint-20");
        let older = there.join("train/iter-0001/gen-1/checkpoint-10");
        let o =
            publish_moving(&older, &models, "iter-0001", 2, &moving(&["optimizer.pt"])).unwrap();
        assert_eq!(o.how, How::Resumed);
        assert_eq!(o.source, src);
        assert_eq!(fs::read(src.join("optimizer.pt")).unwrap(), vec![1u8; 7000]);
        let m = verify(&models.join("iter-0001"), &mut || {}).unwrap();
        assert_eq!(m.source, "train/iter-0001/gen-1/checkpoint-20");
    }

    #[test]
    fn sizes_catch_a_missing_or_truncated_file_and_a_changed_manifest_hash_catches_content() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        publish_moving(&src, &models, "iter-0001", 1, &moving(&[])).unwrap();
        let dir = models.join("iter-0001");
        let w = dir.join("weights.bin");
        let sizes = |dir: &Path| verify_as(&Fs, dir, Check::Sizes, &mut || {});
        let hash = |dir: &Path| verify_as(&Fs, dir, Check::Hash, &mut || {});
        sizes(&dir).unwrap();

        // Same size, other content: only a re-hash sees it.
        fs::write(&w, vec![8u8; 3000]).unwrap();
        sizes(&dir).unwrap();
        let e = hash(&dir).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{} does not match the manifest (size 3000, expected 3000)",
                w.display()
            )
        );
        // Truncated.
        fs::write(&w, vec![7u8; 2999]).unwrap();
        let e = sizes(&dir).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{} does not match the manifest (size 2999, expected 3000)",
                w.display()
            )
        );
        // Missing.
        fs::remove_file(&w).unwrap();
        let e = sizes(&dir).unwrap_err();
        assert!(e.starts_with(&format!("{}: ", w.display())), "{e}");
        fs::write(&w, vec![7u8; 3000]).unwrap();
        hash(&dir).unwrap();
        // A manifest changed to fit a changed file no longer matches its digest.
        let mpath = dir.join(MANIFEST);
        let text = fs::read_to_string(&mpath).unwrap();
        fs::write(&mpath, text.replace("\"size\":3000", "\"size\":2999")).unwrap();
        fs::write(&w, vec![7u8; 2999]).unwrap();
        let e = sizes(&dir).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{} does not match manifest.sha256 (the manifest was changed or is incomplete)",
                mpath.display()
            )
        );
        // Without a digest (an earlier version's checkpoint) every file is hashed.
        fs::remove_file(dir.join(MANIFEST_DIGEST)).unwrap();
        let e = sizes(&dir).unwrap_err();
        assert!(
            e.contains("weights.bin does not match the manifest (size 2999"),
            "{e}"
        );
        fs::write(&mpath, text).unwrap();
        fs::write(&w, vec![8u8; 3000]).unwrap();
        assert!(sizes(&dir)
            .unwrap_err()
            .contains("does not match the manifest"));
    }

    #[test]
    fn pruning_keeps_the_newest_the_spared_and_latest_and_finishes_after_a_crash() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("out");
        tree(&src);
        let models = d.path().join("models");
        for it in 1..=8 {
            publish_as(&src, &models, &format!("iter-{it:04}")).unwrap();
        }
        // LATEST names an older one (a fallback after damage, say).
        fs::write(models.join(LATEST), "iter-0003\n").unwrap();
        assert_eq!(
            prune(&Fs, &models, 0, &|_| false, &mut open).unwrap(),
            Vec::<String>::new()
        );
        let mut fenced = |_| Err("replaced".to_string());
        assert!(matches!(
            prune(&Fs, &models, 2, &|_| false, &mut fenced),
            Err(PublishError::Fenced { .. })
        ));
        assert_eq!(names(&models).len(), 9);
        // Spared: eval iterations (here 1 and 5, say).
        let deleted = prune(&Fs, &models, 2, &|it| it == 1 || it == 5, &mut open).unwrap();
        assert_eq!(deleted, vec!["iter-0006", "iter-0004", "iter-0002"]);
        assert_eq!(
            names(&models),
            vec![
                "LATEST",
                "iter-0001",
                "iter-0003",
                "iter-0005",
                "iter-0007",
                "iter-0008"
            ]
        );
        // A crash between the rename to trash and the removal: the next start finishes it.
        fs::rename(models.join("iter-0007"), models.join(".trash-iter-0007")).unwrap();
        assert_eq!(empty_trash(&Fs, &models).unwrap(), vec![".trash-iter-0007"]);
        assert!(!names(&models).iter().any(|n| n.contains("0007")));
        assert_eq!(
            latest(&Fs, &models, &mut || {}),
            Latest::Checkpoint(models.join("iter-0003"))
        );
    }
}
