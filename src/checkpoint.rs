//! Immutable model checkpoints: `models/iter-NNNN/` with a `manifest.json` (every file's
//! size and SHA-256) and a `models/LATEST` pointer switched atomically.
//!
//! A hand-off copies the training output into a hidden temporary directory, writes the
//! manifest, renames the directory to its final name and only then rewrites `LATEST`. A
//! crash at any point leaves `LATEST` naming a complete, verifiable checkpoint (the old or
//! the new one); the server is only ever started on a model that verifies.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
pub const LATEST: &str = "LATEST";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub source: String,
    pub files: Vec<FileEntry>,
    pub created_at: String,
}

/// Test-only fault injection: `RL_NODE_TEST_CRASH_AT=<point>` aborts the process at that
/// point (of a hand-off, or between committing work and journaling it), to prove a crash
/// there loses nothing and leaves nothing half-published.
/// `RL_NODE_TEST_STOP_AT=<point>` instead stops the whole process there (SIGSTOP), as a
/// paused VM or a hung host would, until a test sends SIGCONT.
pub(crate) fn crash_point(point: &str) {
    if std::env::var("RL_NODE_TEST_CRASH_AT").is_ok_and(|v| v == point) {
        eprintln!("RL_NODE_TEST_CRASH_AT={point}: aborting");
        std::process::abort();
    }
    if std::env::var("RL_NODE_TEST_STOP_AT").is_ok_and(|v| v == point) {
        eprintln!("RL_NODE_TEST_STOP_AT={point}: stopping (SIGSTOP)");
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}

/// The newest directory directly under `dir` whose name matches `pattern` (`*` matches
/// any run of characters), by modification time then name; `None` if nothing matches.
pub fn pick(dir: &Path, pattern: &str) -> Option<PathBuf> {
    if pattern.is_empty() {
        return None;
    }
    fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| glob_match(pattern, &e.file_name().to_string_lossy()))
        .max_by_key(|e| (e.metadata().and_then(|m| m.modified()).ok(), e.file_name()))
        .map(|e| e.path())
}

fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

fn files_under(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out.sort();
    Ok(out)
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

/// Check every file the manifest lists (size and SHA-256). Files the manifest does not
/// list are not allowed either: the directory must be exactly what was published.
pub fn verify(dir: &Path, tick: &mut dyn FnMut()) -> Result<Manifest, String> {
    let mpath = dir.join(MANIFEST);
    let bytes = fs::read(&mpath).map_err(|e| format!("{}: {e}", mpath.display()))?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not a valid manifest: {e}", mpath.display()))?;
    for f in &m.files {
        let p = dir.join(&f.path);
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
    let present = files_under(dir).map_err(|e| e.to_string())?.len() - 1;
    if present != listed {
        return Err(format!(
            "{} holds {present} files but its manifest lists {listed}",
            dir.display()
        ));
    }
    Ok(m)
}

/// The checkpoint `models/LATEST` names, if any.
pub fn latest(models: &Path) -> Option<PathBuf> {
    let name = fs::read_to_string(models.join(LATEST)).ok()?;
    let name = name.trim();
    (!name.is_empty() && !name.contains('/')).then(|| models.join(name))
}

/// What `publish` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// `source` was copied into a new checkpoint.
    New(PathBuf),
    /// A complete, verified checkpoint of that name existed already (an earlier attempt
    /// published it); checkpoints are immutable, so it was kept and `source` was not copied.
    Kept(PathBuf),
}

impl Published {
    pub fn path(&self) -> &Path {
        match self {
            Published::New(p) | Published::Kept(p) => p,
        }
    }
}

/// Publish `source` as `models/<name>` and point `LATEST` at it. Idempotent: a complete,
/// verified `models/<name>` from an earlier attempt is kept; an incomplete one is set
/// aside, never deleted.
pub fn publish(
    source: &Path,
    models: &Path,
    name: &str,
    tick: &mut dyn FnMut(),
) -> io::Result<Published> {
    fs::create_dir_all(models)?;
    let dest = models.join(name);
    if dest.exists() {
        if verify(&dest, tick).is_ok() {
            point_latest(models, name)?;
            return Ok(Published::Kept(dest));
        }
        let aside = models.join(format!("{name}.invalid-{}", crate::protocol::wall_now()));
        fs::rename(&dest, aside)?;
    }
    let tmp = models.join(format!(".{name}.partial"));
    if tmp.exists() {
        // A half-copied directory from a crashed hand-off: not a checkpoint, just debris.
        fs::remove_dir_all(&tmp)?;
    }
    let mut files = Vec::new();
    for src in files_under(source)? {
        let rel = src.strip_prefix(source).expect("under source");
        let dst = tmp.join(rel);
        fs::create_dir_all(dst.parent().expect("has parent"))?;
        copy_synced(&src, &dst, tick)?;
        let (size, sha256) = sha256_file(&dst, tick)?;
        files.push(FileEntry {
            path: rel.to_string_lossy().into_owned(),
            size,
            sha256,
        });
        crash_point("handoff:mid-copy");
    }
    fs::create_dir_all(&tmp)?;
    let manifest = Manifest {
        name: name.to_string(),
        source: source.display().to_string(),
        files,
        created_at: crate::protocol::wall_now(),
    };
    let mut f = File::create(tmp.join(MANIFEST))?;
    f.write_all(&serde_json::to_vec_pretty(&manifest).map_err(io::Error::other)?)?;
    f.sync_all()?;
    crate::store::fsync_dir(&tmp)?;
    crash_point("handoff:before-rename");
    fs::rename(&tmp, &dest)?;
    crate::store::fsync_dir(models)?;
    crash_point("handoff:before-latest");
    point_latest(models, name)?;
    Ok(Published::New(dest))
}

fn point_latest(models: &Path, name: &str) -> io::Result<()> {
    crate::store::publish(&models.join(LATEST), format!("{name}\n").as_bytes())
}

fn copy_synced(src: &Path, dst: &Path, tick: &mut dyn FnMut()) -> io::Result<()> {
    let mut r = File::open(src)?;
    let mut w = File::create(dst)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n])?;
        tick();
    }
    w.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(root: &Path) {
        fs::create_dir_all(root.join("sub")).unwrap();
        fs::write(root.join("weights.bin"), vec![7u8; 3000]).unwrap();
        fs::write(root.join("sub/config.json"), b"{}").unwrap();
    }

    #[test]
    fn publish_verifies_and_moves_latest() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("train/checkpoint-20");
        tree(&src);
        let models = d.path().join("models");
        let out = publish(&src, &models, "iter-0001", &mut || {}).unwrap();
        assert!(matches!(out, Published::New(_)));
        let out = out.path().to_path_buf();
        assert_eq!(latest(&models), Some(out.clone()));
        let m = verify(&out, &mut || {}).unwrap();
        assert_eq!(m.files.len(), 2);
        // Publishing again keeps the verified checkpoint.
        assert_eq!(
            publish(&src, &models, "iter-0001", &mut || {}).unwrap(),
            Published::Kept(out.clone())
        );
        // Tampering is caught.
        fs::write(out.join("weights.bin"), vec![8u8; 3000]).unwrap();
        assert!(verify(&out, &mut || {})
            .unwrap_err()
            .contains("does not match"));
        fs::write(out.join("extra"), b"x").unwrap();
        assert!(verify(&out, &mut || {}).is_err());
    }

    #[test]
    fn picks_newest_matching_directory() {
        let d = tempfile::tempdir().unwrap();
        for n in ["checkpoint-10", "checkpoint-20", "logs"] {
            fs::create_dir_all(d.path().join(n)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            pick(d.path(), "checkpoint-*"),
            Some(d.path().join("checkpoint-20"))
        );
        assert_eq!(pick(d.path(), "nothing-*"), None);
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXcYYb"));
    }
}
