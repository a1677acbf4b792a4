//! Writing inside a run's directory without following a link that someone else planted.
//!
//! The shared directory is writable by other users and jobs (docs/shared-directory.md,
//! "What rl-node trusts"). A symbolic link planted at a name rl-node creates or appends to,
//! or at a directory on the way there, would make it write outside the run: its command
//! logs into a victim's `~/.bashrc`. So every create, append, rename, link, unlink and mkdir
//! below a run's root starts from a descriptor of the directory that holds the name, opened
//! from the root with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (on kernels before
//! 5.6, or where a sandbox refuses `openat2`, a walk of `O_NOFOLLOW` opens, one per
//! component); the name itself is created with `O_EXCL` (which never follows a link) or
//! opened with `O_NOFOLLOW`. A file rl-node appends to or rewrites must also be a regular
//! file with one link, owned by the user this process's new files are created as on that
//! filesystem ([`check_writable`]). Refusals are [`Untrusted`] errors naming the path.
//!
//! The root is a run's `--log-path` as given: links in it and above it are the user's own
//! choice and are followed, once, when the root is first opened (its descriptor is kept, so
//! a root renamed away later is not followed either). [`confine`] registers a root;
//! [`Layout::new`](crate::layout::Layout::new) registers every run directory. A path under no
//! registered root is still opened with `O_EXCL`/`O_NOFOLLOW` for its last component.

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{self as rfs, Mode, OFlags, ResolveFlags, CWD};
use rustix::io::Errno;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// An operation that rl-node refused because a name (the file, or a directory on its way)
/// is not what rl-node made: a symbolic link, a hard link, a file of another kind or of
/// another owner.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Untrusted {
    /// The file operated on.
    pub path: PathBuf,
    /// The name at fault: `path` itself or a directory on the way to it.
    pub at: PathBuf,
    pub message: String,
}

/// Why rl-node refuses a link: the end of every message about one.
const NO_LINKS: &str =
    "rl-node does not follow links inside the run's directory, which others may write";

impl Untrusted {
    /// `at` (the name at fault, `what` says how) on the way to `path`.
    fn error(path: &Path, at: &Path, what: impl std::fmt::Display) -> io::Error {
        let message = if path == at {
            format!("{} {what}", path.display())
        } else {
            format!("{}: {} {what}", path.display(), at.display())
        };
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            Untrusted {
                path: path.to_path_buf(),
                at: at.to_path_buf(),
                message,
            },
        )
    }

    /// The refusal inside `e`, if `e` is one.
    pub fn of(e: &io::Error) -> Option<&Untrusted> {
        e.get_ref().and_then(|e| e.downcast_ref::<Untrusted>())
    }
}

/// Roots kept at once: a node has one or two (a pipelined run's clusters share one); the
/// unit tests of one process make many, the oldest of which are dropped.
const MAX_ROOTS: usize = 64;

struct Root {
    path: PathBuf,
    /// Opened at the first write below it (a worker may start before rank 0 made it).
    fd: Option<Arc<OwnedFd>>,
    /// Whether it is on a FUSE filesystem, whose kernel client caches lookups (learnt
    /// when `fd` is opened).
    fuse: bool,
}

static ROOTS: Mutex<Vec<Root>> = Mutex::new(Vec::new());

/// Set once `openat2` was refused (an old kernel, a sandbox): the walk is used from then on.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

fn roots() -> MutexGuard<'static, Vec<Root>> {
    ROOTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Treat `root` as a run's directory: nothing below it is reached through a symbolic link
/// when rl-node writes. Idempotent.
pub fn confine(root: &Path) {
    if root.as_os_str().is_empty() {
        return;
    }
    let mut roots = roots();
    if roots.iter().any(|r| r.path == root) {
        return;
    }
    if roots.len() >= MAX_ROOTS {
        roots.remove(0);
    }
    roots.push(Root {
        path: root.to_path_buf(),
        fd: None,
        fuse: false,
    });
}

/// The registered root `path` lies strictly below (the deepest), and `path` relative to it.
fn root_of(path: &Path) -> Option<(PathBuf, PathBuf)> {
    let roots = roots();
    roots
        .iter()
        .filter(|r| path != r.path && path.starts_with(&r.path))
        .max_by_key(|r| r.path.as_os_str().len())
        .map(|r| {
            let rel = path.strip_prefix(&r.path).expect("starts with the root");
            (r.path.clone(), rel.to_path_buf())
        })
}

/// The open root `root` (opened now if it was not yet); `stale` drops a descriptor whose
/// directory is no longer the one at `root` (removed and made again) first.
fn root_fd(root: &Path, stale: bool) -> io::Result<Arc<OwnedFd>> {
    let mut roots = roots();
    let entry = roots.iter_mut().find(|r| r.path == root);
    if let Some(Root { fd: Some(fd), .. }) = &entry {
        if !stale {
            return Ok(Arc::clone(fd));
        }
    }
    super::ops::count(super::OpClass::Open);
    let fd = Arc::new(rfs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?);
    if let Some(entry) = entry {
        entry.fd = Some(Arc::clone(&fd));
        entry.fuse = rfs::fstatfs(&*fd).is_ok_and(|s| is_fuse(&s));
    }
    Ok(fd)
}

/// `statfs`'s `f_type` of a FUSE filesystem (linux/magic.h).
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Whether `s` describes a FUSE filesystem. `f_type`'s width differs between C libraries
/// (glibc's `long`, musl's `unsigned long`): the cast is needed on some of them.
#[allow(clippy::unnecessary_cast)]
fn is_fuse(s: &rfs::StatFs) -> bool {
    s.f_type as i64 == FUSE_SUPER_MAGIC
}

/// Whether a client's kernel may answer lookups of names under `path` from its own cache
/// past another client's changes: a FUSE filesystem (MooseFS, GlusterFS, blobfuse,
/// gcsfuse, sshfs), whose entry and negative-entry timeouts the kernel trusts without
/// asking (docs/shared-directory.md). NFS revalidates at open; a local filesystem has
/// no other client.
/// Asked every poll round: answered from the deepest registered root holding `path` (or
/// being it), under one lock, once that root is open.
pub(crate) fn lookups_cached(path: &Path) -> bool {
    let unopened = {
        let roots = roots();
        let holder = roots
            .iter()
            .filter(|r| path.starts_with(&r.path))
            .max_by_key(|r| r.path.as_os_str().len());
        match holder {
            Some(Root {
                fd: Some(_), fuse, ..
            }) => return *fuse,
            Some(r) => Some(r.path.clone()),
            None => None,
        }
    };
    match unopened {
        Some(root) => {
            root_fd(&root, false).is_ok() && roots().iter().any(|r| r.path == root && r.fuse)
        }
        None => rfs::statfs(path).is_ok_and(|s| is_fuse(&s)),
    }
}

/// Whether the directory at `root` is still the one `fd` holds.
fn same_dir(root: &Path, fd: &OwnedFd) -> bool {
    match (rfs::stat(root), rfs::fstat(fd)) {
        (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
        _ => false,
    }
}

/// The directory that holds a name, ready for the `*at` system calls.
pub(crate) enum Dir {
    /// No root applies: the name is a whole path (relative to the working directory).
    Cwd,
    /// The name lies directly in a root.
    Root(Arc<OwnedFd>),
    /// A directory below a root, opened (`O_PATH`) without following a link.
    Below(OwnedFd),
}

impl Dir {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Dir::Cwd => CWD,
            Dir::Root(fd) => fd.as_fd(),
            Dir::Below(fd) => fd.as_fd(),
        }
    }
}

/// A name in a directory: what the `*at` system calls take. `path` is the name as the
/// caller gave it, for messages.
pub(crate) struct At<'a> {
    pub dir: Dir,
    pub name: &'a Path,
    pub path: &'a Path,
}

impl At<'_> {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.dir.fd()
    }

    /// The directory holding the name, opened for reading (to list or fsync it).
    pub(crate) fn open_dir(&self) -> io::Result<OwnedFd> {
        super::ops::count(super::OpClass::Open);
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        Ok(match &self.dir {
            Dir::Cwd => {
                let parent = match self.path.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                rfs::open(parent, flags, Mode::empty())?
            }
            dir => rfs::openat(dir.fd(), ".", flags, Mode::empty())?,
        })
    }
}

/// `path` as a directory descriptor and a last component, reached without following a
/// symbolic link below its root (an [`Untrusted`] error if there is one on the way).
pub(crate) fn at(path: &Path) -> io::Result<At<'_>> {
    let Some((root, rel)) = root_of(path) else {
        return Ok(At {
            dir: Dir::Cwd,
            name: path,
            path,
        });
    };
    let name = Path::new(path.file_name().unwrap_or(OsStr::new(".")));
    let parent = rel.parent().unwrap_or(Path::new(""));
    let dir = with_root(&root, |fd| {
        if parent.as_os_str().is_empty() {
            return Ok(Dir::Root(Arc::clone(fd)));
        }
        open_beneath(fd, &root, parent, OFlags::PATH | OFlags::DIRECTORY).map(Dir::Below)
    })?;
    Ok(At { dir, name, path })
}

/// The directory `path` itself, reached as [`at`] reaches names (`None` when no root
/// applies or `path` is a root).
pub(crate) fn dir_below(path: &Path, flags: OFlags) -> io::Result<Option<OwnedFd>> {
    let Some((root, rel)) = root_of(path) else {
        return Ok(None);
    };
    with_root(&root, |fd| {
        open_beneath(fd, &root, &rel, flags | OFlags::DIRECTORY)
    })
    .map(Some)
}

/// `f` on the root's descriptor; once more on a fresh one if `f` found nothing and the
/// root is no longer the directory the descriptor holds (made again, e.g. by a test).
fn with_root<T>(root: &Path, mut f: impl FnMut(&Arc<OwnedFd>) -> io::Result<T>) -> io::Result<T> {
    let fd = root_fd(root, false)?;
    match f(&fd) {
        Err(e)
            if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESTALE))
                && !same_dir(root, &fd) =>
        {
            f(&root_fd(root, true)?)
        }
        other => other,
    }
}

/// Open `rel` below the root `fd` (at `root`) without following any symbolic link.
fn open_beneath(fd: &OwnedFd, root: &Path, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    let flags = flags | OFlags::CLOEXEC;
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        for _ in 0..8 {
            super::ops::count(super::OpClass::Open);
            match rfs::openat2(fd, rel, flags, Mode::empty(), resolve) {
                Ok(fd) => return Ok(fd),
                // A rename raced the walk: try again.
                Err(Errno::AGAIN) => continue,
                Err(Errno::NOSYS) | Err(Errno::PERM) => {
                    NO_OPENAT2.store(true, Ordering::Relaxed);
                    break;
                }
                // A link on the way: the walk tells the user's own links from planted ones.
                Err(Errno::LOOP) | Err(Errno::XDEV) => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    walk(fd, root, rel, flags)
}

/// [`open_beneath`] one component at a time, each opened with `O_NOFOLLOW`. A symbolic
/// link on the way to a directory is followed only if it belongs to this node's user (the
/// owner its own files get there): the user's own arrangement (`models/` linked to another
/// filesystem, say), which nobody else can make; anyone else's is refused.
fn walk(fd: &OwnedFd, root: &Path, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    let parts: Vec<&OsStr> = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} leaves {}", rel.display(), root.display()),
            )),
        })
        .collect::<io::Result<_>>()?;
    let mut cur: Option<OwnedFd> = None;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let f = if last {
            flags | OFlags::NOFOLLOW
        } else {
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
        };
        let dir = cur.as_ref().map_or(fd.as_fd(), |d| d.as_fd());
        super::ops::count(super::OpClass::Open);
        let next = match rfs::openat(dir, *part, f, Mode::empty()) {
            Ok(next) => next,
            Err(Errno::LOOP) | Err(Errno::NOTDIR) if is_link_at(dir, part) => {
                let to_dir = !last || f.contains(OFlags::DIRECTORY);
                if !(to_dir && own_link(dir, part)?) {
                    return Err(link_on_the_way(root, rel));
                }
                super::ops::count(super::OpClass::Open);
                rfs::openat(dir, *part, f - OFlags::NOFOLLOW, Mode::empty())?
            }
            Err(e) => return Err(e.into()),
        };
        cur = Some(next);
    }
    cur.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty path"))
}

/// Whether the link `name` in `dir` belongs to this node's user (see [`check_writable`]).
fn own_link(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<bool> {
    super::ops::count(super::OpClass::Stat);
    let st = rfs::statat(dir, name, rfs::AtFlags::SYMLINK_NOFOLLOW)?;
    Ok(st.st_uid == own_owner(st.st_uid, st.st_dev, dir)?)
}

fn is_link_at(dir: BorrowedFd<'_>, name: &OsStr) -> bool {
    rfs::statat(dir, name, rfs::AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|s| rfs::FileType::from_raw_mode(s.st_mode) == rfs::FileType::Symlink)
}

/// The refusal for a symbolic link met on the way from `root` to `rel`: which component
/// it is and where it points, found by looking at each (for the message only).
fn link_on_the_way(root: &Path, rel: &Path) -> io::Error {
    let mut p = root.to_path_buf();
    for c in rel.components() {
        p.push(c);
        if let Ok(target) = std::fs::read_link(&p) {
            return Untrusted::error(
                &root.join(rel),
                &p,
                format_args!("is a symbolic link (to {}); {NO_LINKS}", target.display()),
            );
        }
    }
    let path = root.join(rel);
    Untrusted::error(
        &path,
        &path,
        format_args!("is reached through a symbolic link; {NO_LINKS}"),
    )
}

/// The error for a last component that `O_NOFOLLOW` refused (`ELOOP`).
pub(crate) fn link_refused(path: &Path) -> io::Error {
    let target = std::fs::read_link(path)
        .map(|t| format!(" (to {})", t.display()))
        .unwrap_or_default();
    Untrusted::error(
        path,
        path,
        format_args!("is a symbolic link{target}; {NO_LINKS}"),
    )
}

/// Map `ELOOP` from an `O_NOFOLLOW` open of `path` to the refusal that names it.
pub(crate) fn nofollow_error(path: &Path, e: Errno) -> io::Error {
    if e == Errno::LOOP {
        link_refused(path)
    } else {
        e.into()
    }
}

/// The owner, by filesystem (`st_dev`), that this process's new files get there: usually
/// its own user, but e.g. `nobody` for root on an NFS export with root squashing.
static OWN_UID: Mutex<Option<HashMap<u64, u32>>> = Mutex::new(None);

/// Remember who owns a file this process just created (`st`), once per filesystem.
fn learn_owner(st: &rfs::Stat) {
    let mut known = OWN_UID.lock().unwrap_or_else(|e| e.into_inner());
    let known = known.get_or_insert_with(HashMap::new);
    if known.len() < 64 {
        known.entry(st.st_dev).or_insert(st.st_uid);
    }
}

fn known_owner(dev: u64) -> Option<u32> {
    OWN_UID
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&dev).copied())
}

/// Refuse to write through `fd` (opened at `at`) unless it is a regular file with one link
/// and the owner this process's files get on its filesystem: its effective user, or the one
/// a file it creates in that directory gets (learnt once per filesystem). What `fstat`
/// said of it.
pub(crate) fn check_writable(fd: BorrowedFd<'_>, at: &At<'_>) -> io::Result<rfs::Stat> {
    super::ops::count(super::OpClass::Stat);
    let st = rfs::fstat(fd)?;
    let kind = rfs::FileType::from_raw_mode(st.st_mode);
    if kind != rfs::FileType::RegularFile {
        return Err(Untrusted::error(
            at.path,
            at.path,
            format_args!("is {}, not a regular file", kind_name(kind)),
        ));
    }
    if st.st_nlink > 1 {
        return Err(Untrusted::error(
            at.path,
            at.path,
            format_args!(
                "has {} hard links: another name shares its content, possibly outside the run",
                st.st_nlink
            ),
        ));
    }
    let own = match &at.dir {
        // The name is a whole path: a probe goes into its directory, not the working one.
        Dir::Cwd if st.st_uid != rustix::process::geteuid().as_raw() => {
            own_owner(st.st_uid, st.st_dev, at.open_dir()?.as_fd())?
        }
        dir => own_owner(st.st_uid, st.st_dev, dir.fd())?,
    };
    if st.st_uid != own {
        return Err(Untrusted::error(
            at.path,
            at.path,
            format_args!(
                "belongs to uid {}, not to uid {} (the owner of the files this node creates there)",
                st.st_uid, own
            ),
        ));
    }
    Ok(st)
}

/// The owner this process's own files get on the filesystem `dev` (`uid` is the owner of
/// the name in question): usually its effective user; where the filesystem says otherwise
/// (root on an NFS export that squashes root), a file made in `dir` tells, once.
fn own_owner(uid: u32, dev: u64, dir: BorrowedFd<'_>) -> io::Result<u32> {
    if uid == rustix::process::geteuid().as_raw() {
        return Ok(uid);
    }
    match known_owner(dev) {
        Some(own) => Ok(own),
        None => probe_owner(dir),
    }
}

/// Create (and remove) an empty file in `dir` to learn who owns this process's files.
fn probe_owner(dir: BorrowedFd<'_>) -> io::Result<u32> {
    let name = super::ops::tmp_name(Path::new("owner-probe"));
    super::ops::count(super::OpClass::Open);
    let fd = rfs::openat(
        dir,
        &name,
        super::ops::excl(OFlags::WRONLY),
        Mode::from_raw_mode(0o600),
    )?;
    let st = rfs::fstat(&fd);
    if let Ok(st) = &st {
        learn_owner(st);
    }
    super::ops::count(super::OpClass::Unlink);
    let _ = rfs::unlinkat(dir, &name, rfs::AtFlags::empty());
    Ok(st?.st_uid)
}

fn kind_name(kind: rfs::FileType) -> &'static str {
    match kind {
        rfs::FileType::Directory => "a directory",
        rfs::FileType::Symlink => "a symbolic link",
        rfs::FileType::Fifo => "a named pipe",
        rfs::FileType::Socket => "a socket",
        rfs::FileType::CharacterDevice => "a character device",
        rfs::FileType::BlockDevice => "a block device",
        _ => "not a regular file",
    }
}
