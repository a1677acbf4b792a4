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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::find_in_path;
use super::fuse::{self, read_tail, reap, Mount, Watchdog, EXIT_DEADLINE, POLL_STEP};

/// The master's address, on the namespace's loopback.
const ADDR: &str = "10.213.0.1";
/// How long the master, the chunkservers and a first write may take to come up.
const START_DEADLINE: Duration = Duration::from_secs(60);

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

/// A MooseFS master and two chunkservers in a network namespace, mounted several times.
pub struct MooseFs {
    mounts: Vec<Mount>,
    /// The master and the chunkservers, by name (`master`, `cs1`, `cs2`: their logs').
    daemons: Vec<(String, Child)>,
    netns: String,
    watchdog: Option<Watchdog>,
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
        if find_in_path(prog).is_none() {
            out.push(format!("{prog} (apt package {pkg})"));
        }
    }
    if !Path::new("/var/lib/mfs/metadata.mfs.empty").exists() {
        out.push("/var/lib/mfs/metadata.mfs.empty (apt package moosefs-master)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        out.push("/dev/fuse".into());
    }
    if !rustix::process::geteuid().is_root() {
        out.push("root (network namespaces)".into());
    }
    out
}

/// The CI rule in one call: true when the substrate is usable; otherwise panics if `CI` is
/// set, else prints a skip note naming `test` and returns false.
pub fn require(test: &str) -> bool {
    super::require_substrate(test, "MooseFS", missing())
}

/// The substrate for `test`: `None` when it is missing and `CI` is not set (the rule of
/// [`require`]); panics naming `test` when it cannot start.
pub fn start_for(test: &str, n: usize, caches: Option<Caches>) -> Option<MooseFs> {
    if !require(test) {
        return None;
    }
    Some(MooseFs::start(n, caches).unwrap_or_else(|e| panic!("{test}: {e}")))
}

/// `prog` where [`missing`] found it (`sbin` directories included).
fn program(prog: &str) -> PathBuf {
    find_in_path(prog).unwrap_or_else(|| prog.into())
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
        fs.watchdog = Some(fuse::spawn_watchdog(
            WATCHDOG_SH,
            "rl-node-mfs-watchdog",
            &[fs.root.as_os_str(), fs.netns.as_ref()],
        )?);
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
        let mut cmd = self.in_netns("mfsmount");
        cmd.arg(dir).args(["-f", "-H", ADDR]);
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
        let m = self.mounts.last_mut().expect("just pushed");
        m.wait_mounted(
            &format!("mfsmount {}", dir.display()),
            &log_path,
            is_mfs_mount,
        )
    }

    /// The shell that mounts one more client of this filesystem at `at`, showing its
    /// directory `subfolder` (e.g. `/exp`), as a daemon: for a node that mounts the share
    /// in a mount namespace of its own (`common::mountns`). Stopped with the cluster.
    pub fn client_shell(&self, at: &Path, subfolder: &str, caches: Option<Caches>) -> String {
        let opts = caches
            .map(|c| format!(" -o {}", c.options()))
            .unwrap_or_default();
        format!(
            "{} {} '{}' -H {ADDR} -S {subfolder}{opts}",
            self.net_command().join(" "),
            program("mfsmount").display(),
            at.display()
        )
    }

    /// The command prefix that runs a program in the filesystem's network namespace,
    /// where MooseFS's tools (`mfsgettrashtime`, `mfssettrashtime`) reach its master.
    pub fn net_command(&self) -> Vec<String> {
        vec!["nsenter".into(), format!("--net=/run/netns/{}", self.netns)]
    }

    /// A command that runs MooseFS's `prog` in the filesystem's network namespace.
    fn in_netns(&self, prog: &str) -> Command {
        let net = self.net_command();
        let mut cmd = Command::new(&net[0]);
        cmd.args(&net[1..]).arg(program(prog));
        cmd
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
            self.all_running()?;
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
        let child = self
            .in_netns(prog)
            .arg("-c")
            .arg(cfg)
            .args(["-f", "start"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().map_err(|e| e.to_string())?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| format!("spawn {prog}: {e}"))?;
        self.daemons.push((name.to_string(), child));
        Ok(())
    }

    /// An error naming the first daemon that has exited, with every daemon's log.
    fn all_running(&mut self) -> Result<(), String> {
        for (name, d) in self.daemons.iter_mut() {
            if let Ok(Some(status)) = d.try_wait() {
                let name = name.clone();
                return Err(format!("MooseFS {name} exited ({status}): {}", self.logs()));
            }
        }
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
            self.all_running()?;
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
                    read_tail(&self.root.join(format!("{n}.log")), 20)
                )
            })
            .collect()
    }
}

impl Drop for MooseFs {
    fn drop(&mut self) {
        // Clients first (the master still answers), then the daemons, then the namespace.
        // A lazy unmount detaches even a busy mount: a second one could do no more.
        for m in self.mounts.iter_mut().rev() {
            unmount(&m.dir);
            m.reap();
        }
        // Clients that nodes mounted in namespaces of their own ([`MooseFs::client_shell`])
        // run in this network namespace too.
        let ours: Vec<u32> = self.daemons.iter().map(|(_, d)| d.id()).collect();
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.netns])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                match pid.parse::<u32>() {
                    Ok(p) if !ours.contains(&p) => {
                        let _ = super::kill(p as i32, libc::SIGTERM);
                    }
                    _ => {}
                }
            }
        }
        for (_, d) in self.daemons.iter_mut().rev() {
            let _ = super::kill(d.id() as i32, libc::SIGTERM);
            reap(d, EXIT_DEADLINE);
        }
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .stderr(Stdio::null())
            .status();
        if let Some(w) = self.watchdog.take() {
            w.dismiss();
        }
        let still = self.mounts.iter().any(|m| is_mfs_mount(&m.dir));
        fuse::release_tmp(self.tmp.take(), still, "MooseFS");
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
    // `/proc/mounts` writes the source's `#` as `\043`.
    fuse::mounted_at(dir)
        .is_some_and(|(src, _)| src.starts_with("mfs#") || src.starts_with("mfs\\043"))
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
