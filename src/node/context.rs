//! The environment a command sees. Every placeholder value is also exported as the
//! `RL_NODE_*` variable listed in `config::template::PLACEHOLDERS`; the training command
//! additionally gets the variables torchrun and llamafactory-cli read.
//!
//! The values are a function of plain inputs ([`CommandInputs`]), not of a running node,
//! so that `rl-node plan` renders exactly what a node would, without joining a cluster.

use crate::config::template::PLACEHOLDERS;
pub use crate::config::template::TORCHRUN_ENV;
use crate::config::Config;
use crate::layout::Layout;

use std::collections::BTreeMap;
use std::path::Path;

/// Everything a command's placeholder values depend on. A node knows some of these only
/// once it joined (master address, generation, model); `rl-node plan` supplies what they
/// will be in a fresh run.
pub(crate) struct CommandInputs<'a> {
    pub cfg: &'a Config,
    pub layout: &'a Layout,
    pub rank: u32,
    /// The live ranks (every rank unless elastic mode dropped some); `node_rank` is this
    /// node's position among them.
    pub live: &'a [u32],
    pub node_rank: u32,
    pub iteration: u64,
    pub phase: &'a str,
    pub split: Option<&'a str>,
    pub output: &'a Path,
    /// The model the command uses (`{model}`): a published checkpoint or `cluster.model`.
    pub model: &'a str,
    pub master_addr: &'a str,
    pub master_port: u16,
    pub gen: u64,
    /// The run's id, as in the cluster record and `metrics.jsonl`'s `run`.
    pub run_id: &'a str,
    pub nproc_per_node: u32,
    /// A pipelined rollout's model version and staleness, when chosen for this iteration;
    /// otherwise the version is read from the model's path.
    pub rollout_model: Option<(u64, u64)>,
    /// Values only some commands have (`{ready_file}`, `{resume_from}`, ...).
    pub extra: &'a BTreeMap<&'static str, String>,
}

/// The value of every placeholder for one command.
pub(crate) fn placeholder_values(i: &CommandInputs) -> BTreeMap<&'static str, String> {
    let (cfg, layout) = (i.cfg, i.layout);
    let weights = cfg.weights();
    let mut v = BTreeMap::new();
    v.insert("rank", i.rank.to_string());
    v.insert("num_nodes", cfg.cluster.num_nodes.to_string());
    v.insert("num_live", i.live.len().to_string());
    v.insert(
        "live_ranks",
        i.live
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
    );
    v.insert("node_rank", i.node_rank.to_string());
    v.insert("iteration", i.iteration.to_string());
    let naming = layout.naming();
    v.insert(
        "split",
        i.split
            .map(|s| naming.split_label(s))
            .unwrap_or("")
            .to_string(),
    );
    v.insert(
        "split_iteration",
        naming
            .split_iteration(i.split.unwrap_or("train"), i.iteration)
            .to_string(),
    );
    // run.sh's checkpoint_name: the model's path relative to save_path (the shared
    // directory), which webgym joins with save_path to name the model it asks for.
    let published = Path::new(i.model).parent() == Some(layout.models().as_path());
    v.insert(
        "checkpoint_name",
        Path::new(i.model)
            .strip_prefix(layout.root())
            .ok()
            .filter(|_| published)
            .and_then(|rel| rel.to_str())
            .unwrap_or("")
            .to_string(),
    );
    v.insert(
        "train_output",
        layout
            .train_output(i.iteration, i.gen)
            .display()
            .to_string(),
    );
    v.insert("phase", i.phase.to_string());
    v.insert("log_path", layout.root().display().to_string());
    v.insert("data_path", cfg.cluster.data_path.clone());
    v.insert("output", i.output.display().to_string());
    v.insert(
        "trajectories",
        layout
            .aggregated(i.iteration, "train")
            .display()
            .to_string(),
    );
    v.insert("model", i.model.to_string());
    v.insert("master_addr", i.master_addr.to_string());
    v.insert("master_port", i.master_port.to_string());
    v.insert("nproc_per_node", i.nproc_per_node.to_string());
    v.insert("extra_args", cfg.cluster.extra_args.clone());
    v.insert("server_port", cfg.server.port.to_string());
    v.insert("rank_weight", weights[i.rank as usize].to_string());
    v.insert("total_weight", weights.iter().sum::<u64>().to_string());
    v.insert(
        "rank_weights",
        weights
            .iter()
            .map(|w| w.to_string())
            .collect::<Vec<_>>()
            .join(","),
    );
    v.insert("gen", i.gen.to_string());
    v.insert("run_id", i.run_id.to_string());
    v.insert("job", batch_job().unwrap_or_default());
    // The model's version: the iteration whose training produced it (0: the base
    // model), and how many versions it lags the iteration (pipelined rollouts).
    let (version, staleness) = i.rollout_model.unwrap_or_else(|| {
        let version = Path::new(i.model)
            .file_name()
            .and_then(|n| crate::layout::iteration_of(&n.to_string_lossy()))
            .filter(|_| published)
            .unwrap_or(0);
        (version, 0)
    });
    v.insert("model_version", version.to_string());
    v.insert("staleness", staleness.to_string());
    v.insert(
        "seed",
        crate::work::iteration_seed(cfg.work.seed, i.iteration).to_string(),
    );
    v.insert("samples", cfg.work.samples_per_task.to_string());
    for (k, val) in i.extra {
        v.insert(k, val.clone());
    }
    v
}

/// The environment a command gets besides the node's own: the `[env]` table, then
/// every placeholder's `RL_NODE_*` variable.
pub(crate) fn command_env(
    cfg: &Config,
    values: &BTreeMap<&'static str, String>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = cfg
        .env
        .iter()
        .map(|(k, t)| (k.clone(), cfg.template(t).render_raw(values)))
        .collect();
    env.extend(env_for(values));
    env
}

pub fn env_for(values: &BTreeMap<&'static str, String>) -> Vec<(String, String)> {
    PLACEHOLDERS
        .iter()
        .filter_map(|(name, env, _)| values.get(name).map(|v| (env.to_string(), v.clone())))
        .collect()
}

pub fn torchrun_env(values: &BTreeMap<&'static str, String>) -> Vec<(String, String)> {
    TORCHRUN_ENV
        .iter()
        .map(|(env, key, _)| {
            (
                env.to_string(),
                values.get(key).cloned().unwrap_or_default(),
            )
        })
        .collect()
}

/// Training processes on this node (`cluster.gpus-per-node`) and where the number came
/// from: a number as given; "auto": the devices in `CUDA_VISIBLE_DEVICES` when set, else
/// the GPUs `nvidia-smi --list-gpus` lists, else 1 (no GPU: one CPU process).
pub fn nproc_per_node(setting: &str) -> (u32, String) {
    if let Ok(n) = setting.trim().parse::<u32>() {
        return (n, "cluster.gpus-per-node".into());
    }
    if let Ok(devices) = std::env::var("CUDA_VISIBLE_DEVICES") {
        let n = devices.split(',').filter(|d| !d.trim().is_empty()).count() as u32;
        if n > 0 {
            return (n, format!("CUDA_VISIBLE_DEVICES={devices}"));
        }
    }
    match list_gpus() {
        Some(n) if n > 0 => (n, "nvidia-smi --list-gpus".into()),
        _ => (1, "no GPU found".into()),
    }
}

/// GPUs `nvidia-smi --list-gpus` lists; None without nvidia-smi, on failure, or after
/// 30 s (a wedged driver must not keep the node from starting). Waits on its child
/// itself: call it before the node's reaper thread starts.
fn list_gpus() -> Option<u32> {
    let (exit, out) = crate::process::capture(
        "nvidia-smi",
        &["--list-gpus"],
        std::time::Duration::from_secs(30),
    )?;
    if exit != crate::process::ChildExit::Success {
        return None;
    }
    let out = String::from_utf8_lossy(&out);
    Some(out.lines().filter(|l| l.starts_with("GPU ")).count() as u32)
}

/// This host's first IP address that is not loopback or link-local, IPv4 before IPv6, in
/// interface order: the address `hostname -I` prints first.
pub fn first_ip_address() -> Option<String> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut found: Vec<IpAddr> = Vec::new();
    // SAFETY: getifaddrs fills a list that is read here and freed once: each node and its
    // address are read only when non-null and before the free, and an address is read as a
    // sockaddr_in or sockaddr_in6 only when its sa_family says that is what it is.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return None;
        }
        let mut cur = head;
        while !cur.is_null() {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() {
                match (*addr).sa_family as i32 {
                    libc::AF_INET => {
                        let a = &*(addr as *const libc::sockaddr_in);
                        found.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))));
                    }
                    libc::AF_INET6 => {
                        let a = &*(addr as *const libc::sockaddr_in6);
                        found.push(IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    let usable = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified(),
        IpAddr::V6(v6) => {
            !v6.is_loopback() && !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80
        }
    };
    found
        .iter()
        .find(|ip| ip.is_ipv4() && usable(ip))
        .or_else(|| found.iter().find(|ip| usable(ip)))
        .map(|ip| ip.to_string())
}

/// The batch job this node runs in (`{job}`): Slurm's `SLURM_JOB_ID`, if set.
pub(crate) fn batch_job() -> Option<String> {
    std::env::var("SLURM_JOB_ID")
        .ok()
        .filter(|j| !j.trim().is_empty())
}
