//! A real distributed filesystem as a test substrate: MooseFS from Debian's packages, a
//! metadata master and two chunkservers (like Lustre's MDS and OSS) in a network namespace
//! of their own, and one `mfsmount` client per node, each an independent FUSE client with
//! its own kernel attribute, entry and negative-lookup caches, set by mount options.
//!
//! The chunkserver refuses a master on 127.0.0.0/8, so the namespace's loopback also
//! carries a private address (10.213.0.1); no packet leaves the namespace. The clients
//! join the namespace's network only (`nsenter --net`): their mounts are in the test's own
//! mount namespace, where the nodes see them.
//!
//! Requirements (installed by `scripts/test`): `moosefs-master`, `moosefs-chunkserver`,
//! `moosefs-client`, `iproute2` (`ip netns`), `util-linux` (`nsenter`), a usable
//! `/dev/fuse`, and root (network namespaces). Tests call [`require`] first: it panics
//! under CI when anything is missing, never skipping silently.
//!
//! Several clusters may run at once: each has its own namespace (named after the test
//! process and a counter), its own directories and its own daemons.

use std::fs;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::find_in_path;

/// The master's address, on the namespace's loopback.
const ADDR: &str = "10.213.0.1";
/// How long the master, the chunkservers and a first write may take to come up.
const START_DEADLINE: Duration = Duration::from_secs(60);
const MOUNT_DEADLINE: Duration = Duration::from_secs(20);
const EXIT_DEADLINE: Duration = Duration::from_secs(10);
const POLL_STEP: Duration = Duration::from_millis(25);

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// The kernel caches of a client mount, in seconds (`mfsattrcacheto`, `mfsentrycacheto`,
/// `mfsdirentrycacheto`, `mfsnegentrycacheto`). `None`: MooseFS's defaults (attributes
/// and directory entries 1 s, entries and negative entries 0 s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Caches {
    pub attr: f64,
    pub entry: f64,
    pub direntry: f64,
    pub negentry: f64,
}

impl Caches {
    /// Every cache at `secs`, as FUSE filesystems are often mounted.
    pub fn all(secs: f64) -> Caches {
        Caches {
            attr: secs,
            entry: secs,
            direntry: secs,
            negentry: secs,
        }
    }

    fn options(&self) -> String {
        format!(
            "mfsattrcacheto={},mfsentrycacheto={},mfsdirentrycacheto={},mfsnegentrycacheto={}",
            self.attr, self.entry, self.direntry, self.negentry
        )
    }
}

/// One client mount.
struct Mount {
    dir: PathBuf,
    /// `mfsmount -f` (foreground, so we own its pid and reap it).
    child: Option<Child>,
}

/// A MooseFS master and two chunkservers in a network namespace, mounted several times.
pub struct MooseFs {
    mounts: Vec<Mount>,
    daemons: Vec<Child>,
    netns: String,
    watchdog: Option<(Child, ChildStdin)>,
    root: PathBuf,
    tmp: Option<tempfile::TempDir>,
}

/// What is missing for the substrate (empty when everything is there).
pub fn missing() -> Vec<String> {
    let mut out = Vec::new();
    for (prog, pkg) in [
        ("mfsmaster", "moosefs-master"),
        ("mfschunkserver", "moosefs-chunkserver"),
        ("mfsmount", "moosefs-client"),
        ("ip", "iproute2"),
        ("nsenter", "util-linux"),
    ] {
        if find_in_path(prog).is_none() && !Path::new("/usr/sbin").join(prog).exists() {
            out.push(format!("{prog} (apt package {pkg})"));
        }
    }
    if !Path::new("/var/lib/mfs/metadata.mfs.empty").exists() {
        out.push("/var/lib/mfs/metadata.mfs.empty (apt package moosefs-master)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        out.push("/dev/fuse".into());
    }
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        out.push("root (network namespaces)".into());
    }
    out
}

/// The CI rule in one call: true when the substrate is usable; otherwise panics if `CI` is
/// set, else prints a skip note naming `test` and returns false.
pub fn require(test: &str) -> bool {
    super::require_substrate(test, "MooseFS", missing())
}

fn sbin(prog: &str) -> PathBuf {
    find_in_path(prog).unwrap_or_else(|| Path::new("/usr/sbin").join(prog))
}

impl MooseFs {
    /// A master and two chunkservers, and `n` client mounts with `caches` (`None`: the
    /// defaults), each of a fresh, empty filesystem.
    pub fn start(n: usize, caches: Option<Caches>) -> Result<MooseFs, String> {
        let tmp = tempfile::Builder::new()
            .prefix("rl-node-mfs-")
            .tempdir()
            .map_err(|e| format!("tempdir: {e}"))?;
        let root = tmp.path().to_path_buf();
        let netns = format!(
            "rlmfs-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let mut fs = MooseFs {
            mounts: Vec::new(),
            daemons: Vec::new(),
            netns,
            watchdog: None,
            root,
            tmp: Some(tmp),
        };
        // On any error `fs` is dropped, which cleans up whatever started.
        fs.watchdog = Some(spawn_watchdog(&fs.root, &fs.netns)?);
        fs.make_netns()?;
        fs.start_daemons()?;
        for i in 0..n {
            let dir = fs.root.join(format!("mnt{i}"));
            fs.mount_at(&dir, caches)?;
        }
        fs.wait_writable()?;
        Ok(fs)
    }

    /// The i-th client mount point.
    pub fn mount(&self, i: usize) -> &Path {
        &self.mounts[i].dir
    }

    /// Mount one more client at `dir` (made if missing) with `caches`.
    pub fn mount_at(&mut self, dir: &Path, caches: Option<Caches>) -> Result<(), String> {
        fs::create_dir_all(dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let i = self.mounts.len();
        let log_path = self.root.join(format!("mount{i}.log"));
        let log = fs::File::create(&log_path).map_err(|e| format!("mount log: {e}"))?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.netns))
            .arg(sbin("mfsmount"))
            .arg(dir)
            .args(["-f", "-H", ADDR]);
        if let Some(c) = caches {
            cmd.arg("-o").arg(c.options());
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().map_err(|e| e.to_string())?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| format!("spawn mfsmount: {e}"))?;
        self.mounts.push(Mount {
            dir: dir.to_path_buf(),
            child: Some(child),
        });
        let deadline = Instant::now() + MOUNT_DEADLINE;
        while !is_mfs_mount(dir) {
            let m = self.mounts.last_mut().expect("just pushed");
            if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                m.child = None;
                return Err(format!(
                    "mfsmount {} exited ({status}): {}",
                    dir.display(),
                    tail(&log_path)
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "mfsmount {} did not appear in /proc/mounts within {MOUNT_DEADLINE:?}: {}",
                    dir.display(),
                    tail(&log_path)
                ));
            }
            std::thread::sleep(POLL_STEP);
        }
        Ok(())
    }

    /// The command that mounts one more client of this filesystem at a mount point: for a
    /// test that mounts it itself, e.g. inside a mount namespace of a node's own (the
    /// caller adds the mount point; `-f` keeps it in the foreground).
    pub fn mount_command(&self, caches: Option<Caches>) -> Vec<String> {
        let mut v = vec![
            "nsenter".to_string(),
            format!("--net=/run/netns/{}", self.netns),
            sbin("mfsmount").display().to_string(),
            "-f".into(),
            "-H".into(),
            ADDR.into(),
        ];
        if let Some(c) = caches {
            v.push("-o".into());
            v.push(c.options());
        }
        v
    }

    /// The shell that mounts one more client of this filesystem at `at`, showing its
    /// directory `subfolder` (e.g. `/exp`), as a daemon: for a node that mounts the share
    /// in a mount namespace of its own (`common::mountns`). Stopped with the cluster.
    pub fn client_shell(&self, at: &Path, subfolder: &str, caches: Option<Caches>) -> String {
        let opts = caches
            .map(|c| format!(" -o {}", c.options()))
            .unwrap_or_default();
        format!(
            "nsenter --net=/run/netns/{} {} '{}' -H {ADDR} -S {subfolder}{opts}",
            self.netns,
            sbin("mfsmount").display(),
            at.display()
        )
    }

    /// The command prefix that runs a program in the filesystem's network namespace,
    /// where MooseFS's tools (`mfsgettrashtime`, `mfssettrashtime`) reach its master.
    pub fn net_command(&self) -> Vec<String> {
        vec!["nsenter".into(), format!("--net=/run/netns/{}", self.netns)]
    }

    fn make_netns(&self) -> Result<(), String> {
        run("ip", &["netns", "add", &self.netns])?;
        run("ip", &["-n", &self.netns, "link", "set", "lo", "up"])?;
        run(
            "ip",
            &[
                "-n",
                &self.netns,
                "addr",
                "add",
                &format!("{ADDR}/32"),
                "dev",
                "lo",
            ],
        )
    }

    /// Configuration files, then the master and two chunkservers, each in the namespace.
    fn start_daemons(&mut self) -> Result<(), String> {
        let r = &self.root.clone();
        let mkdir = |d: &Path| fs::create_dir_all(d).map_err(|e| format!("mkdir: {e}"));
        let write = |p: &Path, text: &str| {
            fs::write(p, text).map_err(|e| format!("write {}: {e}", p.display()))
        };
        mkdir(&r.join("master"))?;
        fs::copy(
            "/var/lib/mfs/metadata.mfs.empty",
            r.join("master/metadata.mfs"),
        )
        .map_err(|e| format!("metadata: {e}"))?;
        write(&r.join("exports.cfg"), "* / rw,alldirs,admin,maproot=0\n")?;
        write(&r.join("topology.cfg"), "")?;
        write(
            &r.join("master.cfg"),
            &format!(
                "WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {0}/master\n\
                 EXPORTS_FILENAME = {0}/exports.cfg\nTOPOLOGY_FILENAME = {0}/topology.cfg\n\
                 MATOML_LISTEN_HOST = {ADDR}\nMATOCS_LISTEN_HOST = {ADDR}\n\
                 MATOCL_LISTEN_HOST = {ADDR}\nNICE_LEVEL = 0\nLOCK_MEMORY = 0\n",
                r.display()
            ),
        )?;
        self.daemon("master", "mfsmaster", &r.join("master.cfg"))?;
        self.wait_log("master", "daemon initialized properly")?;
        for n in 1..=2 {
            mkdir(&r.join(format!("cs{n}")))?;
            mkdir(&r.join(format!("cs{n}-data")))?;
            write(
                &r.join(format!("hdd{n}.cfg")),
                &format!("{}/cs{n}-data\n", r.display()),
            )?;
            write(
                &r.join(format!("cs{n}.cfg")),
                &format!(
                    "WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {0}/cs{n}\n\
                     HDD_CONF_FILENAME = {0}/hdd{n}.cfg\nMASTER_HOST = {ADDR}\n\
                     BIND_HOST = {ADDR}\nCSSERV_LISTEN_HOST = {ADDR}\n\
                     CSSERV_LISTEN_PORT = 94{n}2\nHDD_LEAVE_SPACE_DEFAULT = 64MiB\n\
                     NICE_LEVEL = 0\n",
                    r.display()
                ),
            )?;
            self.daemon(
                &format!("cs{n}"),
                "mfschunkserver",
                &r.join(format!("cs{n}.cfg")),
            )?;
        }
        for n in 1..=2 {
            self.wait_log(&format!("cs{n}"), "connected to Master")?;
        }
        Ok(())
    }

    /// Until daemon `name`'s log says `what` (it exiting first is an error).
    fn wait_log(&mut self, name: &str, what: &str) -> Result<(), String> {
        let log = self.root.join(format!("{name}.log"));
        let deadline = Instant::now() + START_DEADLINE;
        while !fs::read_to_string(&log).is_ok_and(|t| t.contains(what)) {
            for d in self.daemons.iter_mut() {
                if let Ok(Some(status)) = d.try_wait() {
                    return Err(format!("MooseFS {name} exited ({status}): {}", self.logs()));
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "MooseFS {name} did not say `{what}`: {}",
                    self.logs()
                ));
            }
            std::thread::sleep(POLL_STEP);
        }
        Ok(())
    }

    fn daemon(&mut self, name: &str, prog: &str, cfg: &Path) -> Result<(), String> {
        let log = fs::File::create(self.root.join(format!("{name}.log")))
            .map_err(|e| format!("{name} log: {e}"))?;
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.netns))
            .arg(sbin(prog))
            .arg("-c")
            .arg(cfg)
            .args(["-f", "start"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().map_err(|e| e.to_string())?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| format!("spawn {prog}: {e}"))?;
        self.daemons.push(child);
        Ok(())
    }

    /// Until a file written through the first mount reads back through the last: the
    /// chunkservers registered and the filesystem takes data.
    fn wait_writable(&mut self) -> Result<(), String> {
        let (Some(first), Some(last)) = (self.mounts.first(), self.mounts.last()) else {
            return Ok(());
        };
        let probe = first.dir.join(".substrate-probe");
        let seen = last.dir.join(".substrate-probe");
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            let ok =
                fs::write(&probe, b"ready").is_ok() && fs::read(&seen).is_ok_and(|b| b == b"ready");
            if ok {
                let _ = fs::remove_file(&probe);
                return Ok(());
            }
            for (i, d) in self.daemons.iter_mut().enumerate() {
                if let Ok(Some(status)) = d.try_wait() {
                    return Err(format!(
                        "MooseFS daemon {i} exited ({status}): {}",
                        self.logs()
                    ));
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "MooseFS took no data within {START_DEADLINE:?}: {}",
                    self.logs()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn logs(&self) -> String {
        ["master", "cs1", "cs2"]
            .iter()
            .map(|n| {
                format!(
                    "\n--- {n} ---\n{}",
                    tail(&self.root.join(format!("{n}.log")))
                )
            })
            .collect()
    }
}

impl Drop for MooseFs {
    fn drop(&mut self) {
        // Clients first (the master still answers), then the daemons, then the namespace.
        for m in self.mounts.iter_mut().rev() {
            unmount(&m.dir);
            if let Some(mut child) = m.child.take() {
                reap(&mut child);
            }
            if is_mfs_mount(&m.dir) {
                unmount(&m.dir);
            }
        }
        // Clients that nodes mounted in namespaces of their own ([`MooseFs::client_shell`])
        // run in this network namespace too.
        let ours: Vec<u32> = self.daemons.iter().map(Child::id).collect();
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.netns])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                match pid.parse::<u32>() {
                    Ok(p) if !ours.contains(&p) => {
                        // SAFETY: kill(2) with a pid and a signal number.
                        unsafe { libc::kill(p as i32, libc::SIGTERM) };
                    }
                    _ => {}
                }
            }
        }
        for d in self.daemons.iter_mut().rev() {
            // SAFETY: kill(2) with a pid of our own child and a signal number.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
            reap(d);
        }
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .stderr(Stdio::null())
            .status();
        if let Some((mut child, mut stdin)) = self.watchdog.take() {
            let _ = stdin.write_all(b"done\n");
            drop(stdin);
            let _ = child.wait();
        }
        // Never remove the directory through a mount that is still there.
        if self.mounts.iter().any(|m| is_mfs_mount(&m.dir)) {
            if let Some(tmp) = self.tmp.take() {
                let path = tmp.keep();
                eprintln!(
                    "MooseFS substrate: a mount under {} could not be unmounted; leaving it",
                    path.display()
                );
            }
        } else {
            drop(self.tmp.take());
        }
    }
}

/// Wait up to EXIT_DEADLINE for `child`, then kill it.
fn reap(child: &mut Child) {
    let deadline = Instant::now() + EXIT_DEADLINE;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Ok(None) => std::thread::sleep(POLL_STEP),
        }
    }
}

fn run(prog: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("spawn {prog}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{prog} {}: {} {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Whether `dir` is a MooseFS client mount now.
pub fn is_mfs_mount(dir: &Path) -> bool {
    let Ok(mounts) = fs::read_to_string("/proc/mounts") else {
        return false;
    };
    let want = dir.display().to_string();
    mounts.lines().any(|l| {
        let mut f = l.split(' ');
        let (src, at) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
        // `/proc/mounts` writes the source's `#` as `\043`.
        (src.starts_with("mfs#") || src.starts_with("mfs\\043")) && at == want
    })
}

fn unmount(dir: &Path) {
    let _ = Command::new("umount")
        .arg("-l")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Cleanup for a test process that dies without running `Drop` (e.g. nextest's
/// timeout): it blocks reading stdin, whose write end only the test process holds; a
/// "done" line means `Drop` cleaned up, EOF that the test is gone: it lazily unmounts every
/// MooseFS mount under the cluster's directory, kills what runs in its namespace, deletes
/// the namespace and removes the directory once nothing is mounted there.
const WATCHDOG_SH: &str = r#"
root=$1; netns=$2
IFS= read -r line
[ "$line" = done ] && exit 0
mounted() { awk -v r="$root/" 'index($1, "mfs") == 1 && index($2, r) == 1 { print $2 }' /proc/mounts; }
for m in $(mounted); do umount -l "$m" 2>/dev/null; done
for pid in $(ip netns pids "$netns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
ip netns delete "$netns" 2>/dev/null
[ -z "$(mounted)" ] && rm -rf "$root"
exit 0
"#;

fn spawn_watchdog(root: &Path, netns: &str) -> Result<(Child, ChildStdin), String> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG_SH)
        .arg("rl-node-mfs-watchdog")
        .arg(root)
        .arg(netns)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("spawn watchdog: {e}"))?;
    let stdin = child.stdin.take().expect("piped stdin");
    Ok((child, stdin))
}
