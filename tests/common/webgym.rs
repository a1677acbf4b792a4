//! The webgym example (examples/webgym/rl-node.toml) as a 3-node test cluster, with the
//! stand-ins of tests/fixtures/webgym/bin for webgym's programs, vLLM and LLaMA-Factory
//! (tests/webgym.rs says what they check). Shared by the tests that run it.

use super::cluster::*;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const REPO: &str = env!("CARGO_MANIFEST_DIR");

pub struct Webgym {
    pub c: TestCluster,
    pub webgym: PathBuf,
    pub data: PathBuf,
    pub log: PathBuf,
    /// Each rank's inference server port.
    pub ports: Vec<u16>,
    /// Each rank's GPUs (`CUDA_VISIBLE_DEVICES`).
    pub gpus: Vec<u32>,
}

/// The example configuration, pointed at a stand-in webgym checkout in the test directory.
pub fn webgym_cluster(eval_interval: u64) -> Webgym {
    webgym_cluster_with(eval_interval, true)
}

/// [`webgym_cluster`], with the example's own `kill-grace` unless `fast_kill` (2 s).
pub fn webgym_cluster_with(eval_interval: u64, fast_kill: bool) -> Webgym {
    let c = TestCluster::new(3, "");
    let root = c.dir.path().to_path_buf();
    let webgym = root.join("webgym");
    let config_dir = webgym.join("scripts/config/main");
    fs::create_dir_all(&config_dir).unwrap();
    for f in ["rollout_train", "rollout_test", "update_online"] {
        fs::write(config_dir.join(format!("{f}.yaml")), "").unwrap();
    }
    for f in ["rollout.py", "update_prepare.py"] {
        fs::write(
            webgym.join("scripts").join(f),
            "# stand-in: see tests/fixtures/webgym\n",
        )
        .unwrap();
    }
    let data = root.join("data");
    fs::create_dir_all(&data).unwrap();
    let example = fs::read_to_string(format!("{REPO}/examples/webgym/rl-node.toml")).unwrap();
    let merge = format!("{REPO}/examples/webgym/merge_pickles.py");
    let mut text = example
        .replacen(
            "WEBGYM = \"/opt/webgym\"",
            &format!("WEBGYM = \"{}\"", webgym.display()),
            1,
        )
        .replacen(
            "WEBGYM_MERGE = \"/opt/rl-node/examples/webgym/merge_pickles.py\"",
            &format!("WEBGYM_MERGE = \"{merge}\""),
            1,
        )
        .replacen(
            "eval-interval = 6 ",
            &format!("eval-interval = {eval_interval} "),
            1,
        );
    assert!(text.contains(&webgym.display().to_string()) && text.contains(&merge));
    // Fast timing for a test; everything else is the example's.
    text = text.replacen("[timing]\n", "[timing]\njoin-timeout = \"60s\"\n", 1);
    if fast_kill {
        let grace = "\nkill-grace = \"30s\"\n";
        assert!(text.contains(grace), "the example's kill-grace changed");
        text = text.replacen(grace, "\nkill-grace = \"2s\"\n", 1);
    }
    fs::write(&c.config, text).unwrap();
    let log = c.log_path.clone();
    Webgym {
        c,
        webgym,
        data,
        log,
        ports: (0..3).map(|_| free_port()).collect(),
        gpus: vec![4, 2, 2],
    }
}

impl Webgym {
    pub fn standin_log(&self) -> PathBuf {
        self.c.dir.path().join("standin.jsonl")
    }

    /// The arguments every node gets: `--data-path`, and `extra` after `--`.
    pub fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["--data-path".to_string(), self.data.display().to_string()];
        if !extra.is_empty() {
            args.push("--".into());
            args.extend(extra.iter().map(|s| s.to_string()));
        }
        args
    }

    /// Rank `r`'s environment: the stand-ins first on PATH, its GPUs and server port, fast
    /// timing, two iterations; then `env`.
    pub fn node_env(&self, r: u32, env: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
        let path = format!(
            "{REPO}/tests/fixtures/webgym/bin:{}",
            std::env::var("PATH").unwrap_or_default()
        );
        let devices: Vec<String> = (0..self.gpus[r as usize]).map(|g| g.to_string()).collect();
        let mut e = vec![
            ("PATH", path),
            (
                "WEBGYM_STANDIN_LOG",
                self.standin_log().display().to_string(),
            ),
            ("CUDA_VISIBLE_DEVICES", devices.join(",")),
            ("RL_NODE_SERVER_PORT", self.ports[r as usize].to_string()),
            ("RL_NODE_CLUSTER_ITERATIONS", "2".into()),
            ("RL_NODE_TIMING_POLL_INTERVAL", "100ms".into()),
            ("RL_NODE_TIMING_HEARTBEAT_INTERVAL", "200ms".into()),
            ("RL_NODE_TIMING_DEAD_AFTER", "20s".into()),
            ("RL_NODE_SERVER_START_TIMEOUT", "30s".into()),
            ("RL_NODE_SERVER_STOP_GRACE", "5s".into()),
            ("RL_NODE_SERVER_GPU_DRAIN_MIB", "0".into()),
            ("RL_NODE_PHASES_ROLLOUT_WORKERS_DELAY", "0s".into()),
            ("RL_NODE_PHASES_EVAL_WORKERS_DELAY", "0s".into()),
        ];
        e.extend(env.iter().cloned());
        e
    }

    /// Start the three nodes as a user would, with `extra` after `--`.
    pub fn spawn(&self, extra: &[&str], env: &[(&'static str, String)]) -> Vec<NodeProc> {
        let args = self.args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        (0..3)
            .map(|r| {
                self.c
                    .spawn_env(r, &self.log, &args, &self.node_env(r, env))
            })
            .collect()
    }

    pub fn run(&self, extra: &[&str]) {
        let mut nodes = self.spawn(extra, &[]);
        for n in nodes.iter_mut() {
            let code = n.wait(LIMIT);
            assert_eq!(code, 0, "rank {} exited {code}:\n{}", n.rank, n.stderr());
        }
    }
}
