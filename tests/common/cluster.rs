//! Start real `rl-node` processes over a temporary shared directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_rl-node");

/// Fast timing so failure paths run in seconds while exercising the real code.
pub const FAST_TIMING: &str = r#"
[timing]
heartbeat-interval = "200ms"
dead-after = "3s"
poll-interval = "100ms"
kill-grace = "1s"
join-timeout = "60s"
"#;

pub struct TestCluster {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub log_path: PathBuf,
    pub num_nodes: u32,
}

pub struct NodeProc {
    pub rank: u32,
    pub child: Child,
    pub stderr_path: PathBuf,
    code: Option<i32>,
}

impl TestCluster {
    /// A cluster of `num_nodes` with FAST_TIMING and `extra` TOML appended (phase commands…).
    pub fn new(num_nodes: u32, extra: &str) -> TestCluster {
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join("shared");
        let config = dir.path().join("rl-node.toml");
        fs::write(
            &config,
            format!("[cluster]\nnum-nodes = {num_nodes}\n{FAST_TIMING}\n{extra}\n"),
        )
        .unwrap();
        TestCluster {
            dir,
            config,
            log_path,
            num_nodes,
        }
    }

    /// Start rank `rank` (0 = --master) pointing at `log_path`, with extra CLI args.
    pub fn spawn_at(&self, rank: u32, log_path: &Path, args: &[&str]) -> NodeProc {
        self.spawn_env(rank, log_path, args, &[])
    }

    /// Like `spawn_at`, with extra environment variables (set after the test's own
    /// RL_NODE_* variables are removed).
    pub fn spawn_env(
        &self,
        rank: u32,
        log_path: &Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> NodeProc {
        let (mut cmd, stderr_path) = self.command(rank, log_path, args, env);
        NodeProc {
            rank,
            child: cmd.spawn().unwrap(),
            stderr_path,
            code: None,
        }
    }

    /// The command `spawn_env` runs, and where its stderr goes, for a test to adjust
    /// (e.g. a process group of its own) before `NodeProc::from_child`.
    pub fn command(
        &self,
        rank: u32,
        log_path: &Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> (Command, PathBuf) {
        self.command_via(&[], rank, log_path, args, env)
    }

    /// Like `command`, with the node started through `launcher`: a program and its
    /// arguments, to which the node's command line is appended (e.g. `unshare -m sh -c
    /// SCRIPT sh`, whose script ends with `exec "$@"`). Empty: the node itself.
    pub fn command_via(
        &self,
        launcher: &[String],
        rank: u32,
        log_path: &Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> (Command, PathBuf) {
        let stderr_path = self
            .dir
            .path()
            .join(format!("rank-{rank}-{}.stderr", rand_suffix()));
        let mut cmd = match launcher.split_first() {
            None => Command::new(BIN),
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(BIN);
                c
            }
        };
        if rank == 0 {
            cmd.arg("--master");
        } else {
            cmd.arg("--worker").arg(rank.to_string());
        }
        cmd.arg("--config")
            .arg(&self.config)
            .arg("--log-path")
            .arg(log_path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(fs::File::create(stderr_path.with_extension("stdout")).unwrap())
            .stderr(fs::File::create(&stderr_path).unwrap());
        // Keep the test's own environment from leaking configuration in.
        for (k, _) in std::env::vars() {
            if k.starts_with("RL_NODE_")
                || [
                    "RANK",
                    "NODE_RANK",
                    "SLURM_NODEID",
                    "WORLD_SIZE",
                    "SLURM_NNODES",
                    "SLURM_JOB_NUM_NODES",
                ]
                .contains(&k.as_str())
            {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        (cmd, stderr_path)
    }

    pub fn spawn(&self, rank: u32, args: &[&str]) -> NodeProc {
        self.spawn_at(rank, &self.log_path, args)
    }

    pub fn spawn_all(&self, args: &[&str]) -> Vec<NodeProc> {
        (0..self.num_nodes).map(|r| self.spawn(r, args)).collect()
    }

    /// A cluster of one node per side for a pipelined run (`extra` sets `[pipeline]
    /// staleness`), whose base model, `base`, goes into the file's own `[cluster]` table.
    pub fn pipelined(extra: &str) -> TestCluster {
        let c = TestCluster::new(1, extra);
        c.set_model("base");
        c
    }

    /// Puts the base model `model` into the file's own `[cluster]` table.
    pub fn set_model(&self, model: &str) {
        let t = fs::read_to_string(&self.config).unwrap();
        let with = format!("[cluster]\nmodel = \"{model}\"\n");
        fs::write(&self.config, t.replacen("[cluster]\n", &with, 1)).unwrap();
    }

    /// One rollout node and one update node, each rank 0 of a cluster of one, running
    /// `iterations` iterations.
    pub fn spawn_rollout_and_update(&self, iterations: u64) -> Vec<NodeProc> {
        let its = iterations.to_string();
        ["rollout", "update"]
            .iter()
            .map(|side| {
                self.spawn(
                    0,
                    &["--iterations", &its, "--num-nodes", "1", "--rl-phase", side],
                )
            })
            .collect()
    }

    /// Read rank r's live record of the current generation (None if not there yet).
    pub fn record(&self, rank: u32) -> Option<serde_json::Value> {
        self.record_in(None, rank)
    }

    /// Like `record`, for one cluster of a pipelined run (`rollout` or `update`: its
    /// state lives under `.rl-node/<cluster>/`); None: the synchronous layout.
    pub fn record_in(&self, cluster: Option<&str>, rank: u32) -> Option<serde_json::Value> {
        let state = match cluster {
            Some(c) => self.log_path.join(".rl-node").join(c),
            None => self.log_path.join(".rl-node"),
        };
        record_under(&state, rank)
    }

    /// Wait until rank r's record shows `phase` (by name, e.g. "training") in `iteration`.
    pub fn wait_phase(&self, rank: u32, iteration: u64, phase: &str, limit: Duration) {
        wait_until(
            limit,
            &format!("rank {rank} in phase {phase} of iteration {iteration}"),
            || {
                self.record(rank).is_some_and(|r| {
                    r["phase"].as_str() == Some(phase) && r["iteration"].as_u64() == Some(iteration)
                })
            },
        );
    }

    /// Events of one rank (from `.rl-node/events/rank-R.jsonl`).
    pub fn events(&self, rank: u32) -> Vec<serde_json::Value> {
        fs::read_to_string(
            self.log_path
                .join(format!(".rl-node/events/rank-{rank}.jsonl")),
        )
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
    }
}

/// Run `rl-node status` (with `--json` if asked) on a shared directory: (success, stdout).
pub fn status(log_path: &Path, json: bool) -> (bool, String) {
    let mut cmd = Command::new(BIN);
    cmd.arg("status").arg("--log-path").arg(log_path);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl NodeProc {
    /// A node started some other way (e.g. under `unshare`), its stderr at `stderr_path`.
    #[allow(dead_code)]
    pub fn from_child(rank: u32, child: Child, stderr_path: PathBuf) -> NodeProc {
        NodeProc {
            rank,
            child,
            stderr_path,
            code: None,
        }
    }

    /// The pid the launcher knows: the node's supervisor.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The process that does the node's work: the supervisor's child (waits for it).
    pub fn node_process(&self) -> i32 {
        let mut node = 0;
        wait_until(
            Duration::from_secs(30),
            "the supervisor's node process",
            || {
                node = descendants(self.pid())
                    .into_iter()
                    .find(|p| parent_of(*p) == Some(self.pid()))
                    .unwrap_or(0);
                node > 0
            },
        );
        node
    }

    /// Wait for exit with a generous limit; panics (with the node's stderr) on timeout.
    pub fn wait(&mut self, limit: Duration) -> i32 {
        if let Some(c) = self.code {
            return c;
        }
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                use std::os::unix::process::ExitStatusExt;
                let c = st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0));
                self.code = Some(c);
                return c;
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!(
                    "rank {} did not exit within {limit:?}; stderr:\n{}",
                    self.rank,
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        let _ = super::kill(self.pid(), sig);
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        if self.code.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Poll `cond` until it holds; panic naming `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            panic!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The parent of `pid` (None if it is gone).
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Whether `pid` is stopped (state `T`: SIGSTOP), as `/proc` says; false once it is gone.
pub fn stopped(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// Every live descendant of `pid`, parents before children.
pub fn descendants(pid: i32) -> Vec<i32> {
    let all: Vec<(i32, i32)> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let p = e.file_name().to_string_lossy().parse::<i32>().ok()?;
            Some((p, parent_of(p)?))
        })
        .collect();
    let mut out = vec![];
    let mut parents = vec![pid];
    while let Some(parent) = parents.pop() {
        for (p, _) in all.iter().filter(|(_, pp)| *pp == parent) {
            out.push(*p);
            parents.push(*p);
        }
    }
    out
}

/// Is any process alive whose command line contains `needle`? (zombies excluded)
pub fn process_alive_with(needle: &str) -> Vec<i32> {
    let mut out = vec![];
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let stat = fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'));
        if cmd.contains(needle) && !zombie && pid != std::process::id() as i32 {
            out.push(pid);
        }
    }
    out
}

/// Run `cmd` (an rl-node) with its stdout and stderr pipes closed at once, like
/// `rl-node … | head` after `head` exited: every console write fails with EPIPE. Returns
/// its exit status; panics naming `what` if it does not finish within `limit`.
pub fn run_with_closed_output(
    cmd: &mut Command,
    limit: Duration,
    what: &str,
) -> std::process::ExitStatus {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") {
            cmd.env_remove(k);
        }
    }
    let mut child = cmd.spawn().unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let started = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Rank `rank`'s record of the current generation under the state directory `state`
/// (`<log-path>/.rl-node`, wherever the shared directory is mounted), as JSON.
pub fn record_under(state: &Path, rank: u32) -> Option<serde_json::Value> {
    let c: serde_json::Value =
        serde_json::from_slice(&fs::read(state.join("cluster.json")).ok()?).ok()?;
    let gen = c["gen"].as_u64()?;
    serde_json::from_slice(&fs::read(state.join(format!("gen-{gen}/rank-{rank}.json"))).ok()?).ok()
}
