//! The demo's toy workload: a contextual bandit small enough to learn in seconds, run
//! through the same interfaces a real job uses (an HTTP inference server, rollout and eval
//! commands writing JSONL to `{output}`, a data-parallel trainer that reads torchrun's
//! `NNODES`/`NODE_RANK`/`MASTER_ADDR`/`MASTER_PORT` and all-reduces over TCP).
//!
//! `T` tasks, `A` actions; task i's hidden best action is derived from (seed, i). Reward
//! 1.0 for the best action, 0.0 otherwise, so chance is exactly 1/A. The policy is a table
//! of logits (softmax per task), trained with REINFORCE and a per-task baseline.
//!
//! Everything is deterministic given the seed: sampling uses splitmix64 seeded by a hash
//! of (seed, iteration, task, sample index), and every floating-point sum runs in a fixed
//! order (lines in file order, ranks in rank order).

use crate::error::{Cause, Ending};
use clap::{Parser, Subcommand};
use serde::{Deserialize, Serialize};
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// File name of the policy inside a model directory.
pub const POLICY_FILE: &str = "policy.json";
/// Name of the checkpoint directory the trainer writes under `--out` (matched by the
/// hand-off's default `pick = "checkpoint-*"`).
pub const CHECKPOINT_DIR: &str = "checkpoint-final";
const FORMAT: &str = "rl-node-toy-policy/1";

// ------------------------------------------------------------------ randomness

use crate::rng::mix64;
pub use crate::rng::SplitMix64;

/// Hash a sequence of integers into one (order matters).
pub fn hash(parts: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for &p in parts {
        h = mix64(h ^ mix64(p.wrapping_add(0x9E37_79B9_7F4A_7C15)));
    }
    h
}

/// Task `task`'s hidden best action.
pub fn best_action(seed: u64, task: u32, actions: u32) -> u32 {
    (hash(&[seed, 0xB357, task as u64]) % actions as u64) as u32
}

/// The reward of `action` on `task` (1 for the hidden best action, else 0).
pub fn reward(seed: u64, task: u32, actions: u32, action: u32) -> f64 {
    if action == best_action(seed, task, actions) {
        1.0
    } else {
        0.0
    }
}

/// The seed of the j-th train sample of `task` in `iteration`.
pub fn sample_seed(seed: u64, iteration: u64, task: u32, j: u32) -> u64 {
    hash(&[seed, iteration, task as u64, j as u64])
}

// ------------------------------------------------------------------ the policy

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Policy {
    pub format: String,
    pub tasks: u32,
    pub actions: u32,
    /// Number of updates applied since the initial model.
    pub step: u64,
    pub logits: Vec<Vec<f64>>,
}

impl Policy {
    pub fn uniform(tasks: u32, actions: u32) -> Policy {
        Policy {
            format: FORMAT.into(),
            tasks,
            actions,
            step: 0,
            logits: vec![vec![0.0; actions as usize]; tasks as usize],
        }
    }

    pub fn probs(&self, task: u32) -> Vec<f64> {
        softmax(&self.logits[task as usize])
    }

    /// Sample an action of `task` with a PRNG seeded by `seed`: (action, probability).
    pub fn sample(&self, task: u32, seed: u64) -> (u32, f64) {
        let p = self.probs(task);
        let u = SplitMix64::new(seed).next_f64();
        let mut acc = 0.0;
        for (a, &pa) in p.iter().enumerate() {
            acc += pa;
            if u < acc {
                return (a as u32, pa);
            }
        }
        // Rounding left u above the last partial sum: take the last action with mass.
        let a = p.iter().rposition(|&x| x > 0.0).unwrap_or(0);
        (a as u32, p[a])
    }

    /// The most likely action of `task`. Ties are broken by a fixed per-task rotation
    /// rather than the lowest index, so an untrained (uniform) policy scores chance on
    /// eval instead of the share of tasks whose best action happens to be 0.
    pub fn greedy(&self, task: u32) -> (u32, f64) {
        let p = self.probs(task);
        let n = p.len();
        let start = (hash(&[0x7135, task as u64]) % n as u64) as usize;
        let mut best = start;
        for k in 1..n {
            let a = (start + k) % n;
            if p[a] > p[best] {
                best = a;
            }
        }
        (best as u32, p[best])
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format is {:?}, expected {FORMAT:?}", self.format));
        }
        if self.tasks == 0 || self.actions == 0 {
            return Err("tasks and actions must be at least 1".into());
        }
        if self.logits.len() != self.tasks as usize {
            return Err(format!(
                "{} rows of logits for {} tasks",
                self.logits.len(),
                self.tasks
            ));
        }
        for (i, row) in self.logits.iter().enumerate() {
            if row.len() != self.actions as usize {
                return Err(format!(
                    "task {i} has {} logits for {} actions",
                    row.len(),
                    self.actions
                ));
            }
            if row.iter().any(|x| !x.is_finite()) {
                return Err(format!("task {i} has a logit that is not finite"));
            }
        }
        Ok(())
    }

    /// Load and validate `DIR/policy.json`.
    pub fn load(dir: &Path) -> Result<Policy, String> {
        let path = dir.join(POLICY_FILE);
        let text = fs::read_to_string(&path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                format!(
                    "no model at {}: {} is missing (make one with `rl-node __toy init-model --out DIR`)",
                    dir.display(),
                    path.display()
                )
            } else {
                format!("cannot read {}: {e}", path.display())
            }
        })?;
        let p: Policy = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not a toy policy: {e}", path.display()))?;
        p.validate()
            .map_err(|e| format!("{} is not a valid toy policy: {e}", path.display()))?;
        Ok(p)
    }

    /// Write `DIR/policy.json` through a temporary name and a rename.
    pub fn save(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)?;
        let path = dir.join(POLICY_FILE);
        let tmp = dir.join(format!(".{POLICY_FILE}.tmp-{}", std::process::id()));
        let mut f = File::create(&tmp)?;
        f.write_all(
            serde_json::to_string(self)
                .expect("policy serialises")
                .as_bytes(),
        )?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &path)
    }
}

pub fn softmax(logits: &[f64]) -> Vec<f64> {
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

// ------------------------------------------------------------------ work split

/// Split `total` items into contiguous shares proportional to `weights` (largest
/// remainder; ties go to the lower rank). The counts sum to exactly `total`.
pub fn split_counts(total: u64, weights: &[u64]) -> Vec<u64> {
    let sum: u64 = weights.iter().sum();
    if sum == 0 {
        return vec![0; weights.len()];
    }
    let t = total as u128;
    let s = sum as u128;
    let mut counts: Vec<u64> = weights
        .iter()
        .map(|&w| (t * w as u128 / s) as u64)
        .collect();
    let assigned: u64 = counts.iter().sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&r| (std::cmp::Reverse(t * weights[r] as u128 % s), r));
    for &r in order.iter().take((total - assigned) as usize) {
        counts[r] += 1;
    }
    counts
}

/// Rank `rank`'s contiguous range of `total` items.
pub fn split_range(total: u64, weights: &[u64], rank: usize) -> std::ops::Range<u64> {
    let counts = split_counts(total, weights);
    let start: u64 = counts[..rank].iter().sum();
    start..start + counts[rank]
}

fn parse_weights(s: &str, num_nodes: u32) -> Result<Vec<u64>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(vec![1; num_nodes as usize]);
    }
    let w: Vec<u64> = s
        .split(',')
        .map(|x| x.trim().parse::<u64>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--rank-weights {s}: {e}"))?;
    if w.len() != num_nodes as usize {
        return Err(format!(
            "--rank-weights {s} has {} weights for {num_nodes} nodes",
            w.len()
        ));
    }
    if w.iter().sum::<u64>() == 0 {
        return Err(format!("--rank-weights {s}: every weight is 0"));
    }
    Ok(w)
}

// ------------------------------------------------------------------ the command line

#[derive(Parser, Debug)]
#[command(name = "rl-node __toy", about = "The demo's toy workload")]
struct ToyCli {
    #[command(subcommand)]
    cmd: ToyCmd,
}

#[derive(Subcommand, Debug)]
enum ToyCmd {
    /// Write the initial checkpoint DIR/policy.json (uniform logits).
    InitModel {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 32)]
        tasks: u32,
        #[arg(long, default_value_t = 4)]
        actions: u32,
    },
    /// Serve the policy in DIR over HTTP on 127.0.0.1:PORT (/health, /act).
    Server {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        port: u16,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Ask the server for actions on this rank's share of the tasks; write JSONL.
    Rollout {
        #[arg(long)]
        server: String,
        #[arg(long, value_parser = ["train", "eval"])]
        split: String,
        #[arg(long, default_value_t = 0)]
        rank: u32,
        #[arg(long, default_value_t = 1)]
        num_nodes: u32,
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        rank_weights: String,
        #[arg(long, default_value_t = 1)]
        iteration: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 4)]
        samples: u32,
        #[arg(long, default_value_t = 32)]
        tasks: u32,
        #[arg(long)]
        out: PathBuf,
        /// The version of the model the server runs (`{model_version}`: the iteration
        /// that trained it, 0 for the base model), stamped into every record so training
        /// can tell how stale its data is.
        #[arg(long, default_value_t = 0)]
        model_version: u64,
        /// How many versions the model lags the iteration (`{staleness}`), stamped too.
        #[arg(long, default_value_t = 0)]
        staleness: u64,
        /// Take at least this many seconds (to slow a demo down enough to watch).
        #[arg(long, default_value_t = 0.0)]
        min_secs: f64,
    },
    /// One REINFORCE step, data-parallel over NNODES ranks with a TCP all-reduce.
    Train {
        #[arg(long)]
        trajectories: PathBuf,
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 4.0)]
        lr: f64,
        /// Seconds to wait for the peers (connect, gradient, sum) before giving up.
        #[arg(long, default_value_t = 60.0)]
        peer_timeout: f64,
        /// Take at least this many seconds (to slow a demo down enough to watch).
        #[arg(long, default_value_t = 0.0)]
        min_secs: f64,
    },
    /// Print the accuracy of an eval JSONL file.
    EvalScore {
        #[arg(long)]
        file: PathBuf,
    },
}

pub fn main(args: Vec<String>) -> Result<Ending, crate::error::Failure> {
    let argv = std::iter::once("rl-node __toy".to_string()).chain(args);
    let cli = match ToyCli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            // Clap printed the usage error (or the help it was asked for) itself.
            let _ = e.print();
            return Ok(if e.use_stderr() {
                Ending::Reported(Cause::Usage)
            } else {
                Ending::Done
            });
        }
    };
    let started = Instant::now();
    let min_secs = match &cli.cmd {
        ToyCmd::Rollout { min_secs, .. } | ToyCmd::Train { min_secs, .. } => *min_secs,
        _ => 0.0,
    };
    let (what, result) = match cli.cmd {
        ToyCmd::InitModel {
            out,
            tasks,
            actions,
        } => ("init-model", init_model(&out, tasks, actions)),
        ToyCmd::Server { model, port, seed } => ("server", serve(&model, port, seed)),
        ToyCmd::Rollout {
            server,
            split,
            rank,
            num_nodes,
            rank_weights,
            iteration,
            seed,
            samples,
            tasks,
            out,
            model_version,
            staleness,
            min_secs: _,
        } => (
            "rollout",
            rollout(&RolloutArgs {
                model_version,
                staleness,
                server,
                eval: split == "eval",
                rank,
                num_nodes,
                rank_weights,
                iteration,
                seed,
                samples,
                tasks,
                out,
            }),
        ),
        ToyCmd::Train {
            trajectories,
            model,
            out,
            lr,
            peer_timeout,
            min_secs: _,
        } => (
            "train",
            train_main(&trajectories, &model, &out, lr, peer_timeout),
        ),
        ToyCmd::EvalScore { file } => ("eval-score", eval_score(&file)),
    };
    match result {
        Ok(()) => {
            if min_secs.is_finite() && min_secs > 0.0 {
                let want = Duration::from_secs_f64(min_secs.min(3600.0));
                std::thread::sleep(want.saturating_sub(started.elapsed()));
            }
            Ok(Ending::Done)
        }
        Err(e) => Err(crate::error::Failure::failed(format!("toy {what}: {e}"))),
    }
}

fn init_model(out: &Path, tasks: u32, actions: u32) -> Result<(), String> {
    if tasks == 0 || actions < 2 {
        return Err("need at least 1 task and 2 actions".into());
    }
    Policy::uniform(tasks, actions)
        .save(out)
        .map_err(|e| format!("cannot write {}: {e}", out.join(POLICY_FILE).display()))?;
    crate::errln!(
        "toy init-model: wrote {} ({tasks} tasks, {actions} actions, uniform)",
        out.join(POLICY_FILE).display()
    );
    Ok(())
}

// ------------------------------------------------------------------ server

fn query_params(url: &str) -> Vec<(String, String)> {
    url.split_once('?')
        .map(|(_, q)| q)
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Answer one request of the toy server: (status, JSON body).
pub fn handle(policy: &Policy, seed: u64, model: &str, url: &str) -> (u16, serde_json::Value) {
    use serde_json::json;
    let path = url.split('?').next().unwrap_or("");
    match path {
        "/health" => (
            200,
            json!({"status": "ok", "model": model, "step": policy.step,
                   "tasks": policy.tasks, "actions": policy.actions}),
        ),
        "/act" => {
            let params = query_params(url);
            let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
            let task = match get("task").map(|t| t.parse::<u32>()) {
                Some(Ok(t)) if t < policy.tasks => t,
                _ => {
                    return (
                        400,
                        json!({"error": format!("task must be 0..{}", policy.tasks)}),
                    )
                }
            };
            let greedy = matches!(get("greedy"), Some("1") | Some("true"));
            let (action, prob) = if greedy {
                policy.greedy(task)
            } else {
                match get("sample_seed").map(|s| s.parse::<u64>()) {
                    Some(Ok(s)) => policy.sample(task, hash(&[seed, s])),
                    _ => {
                        return (
                            400,
                            json!({"error": "sample_seed (an unsigned integer) or greedy=1 is required"}),
                        )
                    }
                }
            };
            (200, json!({"action": action, "prob": prob}))
        }
        _ => (
            404,
            json!({"error": format!("no such endpoint {path}; try /health or /act")}),
        ),
    }
}

fn serve(model: &Path, port: u16, seed: u64) -> Result<(), String> {
    let policy = Policy::load(model)?;
    let addr = format!("127.0.0.1:{port}");
    let server =
        tiny_http::Server::http(&addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let model_s = model.display().to_string();
    crate::errln!(
        "toy server: serving {} (step {}, {} tasks x {} actions) on http://{addr}",
        model_s,
        policy.step,
        policy.tasks,
        policy.actions
    );
    let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..])
        .expect("static header");
    for req in server.incoming_requests() {
        let (status, body) = if *req.method() == tiny_http::Method::Get {
            handle(&policy, seed, &model_s, req.url())
        } else {
            (405, serde_json::json!({"error": "only GET"}))
        };
        let resp = tiny_http::Response::from_string(body.to_string())
            .with_status_code(status)
            .with_header(header.clone());
        let _ = req.respond(resp);
    }
    Ok(())
}

// ------------------------------------------------------------------ rollout

struct RolloutArgs {
    server: String,
    eval: bool,
    rank: u32,
    num_nodes: u32,
    rank_weights: String,
    iteration: u64,
    seed: u64,
    samples: u32,
    tasks: u32,
    out: PathBuf,
    model_version: u64,
    staleness: u64,
}

#[derive(Deserialize)]
struct Act {
    action: u32,
    prob: f64,
}

fn rollout(a: &RolloutArgs) -> Result<(), String> {
    if a.num_nodes == 0 || a.rank >= a.num_nodes {
        return Err(format!(
            "--rank {} is out of range for --num-nodes {}",
            a.rank, a.num_nodes
        ));
    }
    let weights = parse_weights(&a.rank_weights, a.num_nodes)?;
    let range = split_range(a.tasks as u64, &weights, a.rank as usize);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into();
    let base = a.server.trim_end_matches('/').to_string();
    let ask = |query: String| -> Result<Act, String> {
        let url = format!("{base}/act?{query}");
        let mut resp = agent.get(&url).call().map_err(|e| {
            format!("cannot reach the inference server at {base} ({e}); is the [server] command running on this node?")
        })?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("reading the answer to {url}: {e}"))?;
        if status != 200 {
            return Err(format!("{url} answered {status}: {}", body.trim()));
        }
        serde_json::from_str(&body).map_err(|e| format!("{url} answered {body:?}: {e}"))
    };
    if let Some(d) = a.out.parent() {
        fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }
    let file =
        File::create(&a.out).map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let mut w = BufWriter::new(file);
    let werr = |e: io::Error| format!("writing {}: {e}", a.out.display());
    // The reward needs the number of actions; the server knows it.
    let actions = {
        let url = format!("{base}/health");
        let mut resp = agent.get(&url).call().map_err(|e| {
            format!("cannot reach the inference server at {base} ({e}); is the [server] command running on this node?")
        })?;
        let body = resp
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("reading {url}: {e}"))?;
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{url} answered {body:?}: {e}"))?;
        let (tasks, actions) = (v["tasks"].as_u64(), v["actions"].as_u64());
        if tasks != Some(a.tasks as u64) {
            return Err(format!(
                "the server's model has {tasks:?} tasks, the rollout was asked for {}",
                a.tasks
            ));
        }
        actions.ok_or_else(|| format!("{url} did not say how many actions: {body}"))? as u32
    };
    let (mut n, mut total) = (0u64, 0.0f64);
    for task in range.clone() {
        let task = task as u32;
        if a.eval {
            let act = ask(format!("task={task}&greedy=1"))?;
            let correct = act.action == best_action(a.seed, task, actions);
            total += if correct { 1.0 } else { 0.0 };
            n += 1;
            let line = serde_json::json!({"task": task, "action": act.action, "correct": correct,
                                          "iteration": a.iteration, "rank": a.rank,
                                          "model_version": a.model_version, "staleness": a.staleness});
            writeln!(w, "{line}").map_err(werr)?;
        } else {
            for j in 0..a.samples {
                let s = sample_seed(a.seed, a.iteration, task, j);
                let act = ask(format!("task={task}&sample_seed={s}"))?;
                let r = reward(a.seed, task, actions, act.action);
                total += r;
                n += 1;
                let line = serde_json::json!({"task": task, "action": act.action, "reward": r,
                                              "sample_seed": s, "prob": act.prob,
                                              "iteration": a.iteration, "rank": a.rank,
                                              "model_version": a.model_version, "staleness": a.staleness});
                writeln!(w, "{line}").map_err(werr)?;
            }
        }
        w.flush().map_err(werr)?;
    }
    let f = w.into_inner().map_err(|e| werr(e.into_error()))?;
    f.sync_all().map_err(werr)?;
    crate::errln!(
        "toy rollout: rank {} {} tasks {}..{}: {n} lines, mean {} {:.3}",
        a.rank,
        if a.eval { "eval" } else { "train" },
        range.start,
        range.end,
        if a.eval { "accuracy" } else { "reward" },
        if n > 0 { total / n as f64 } else { 0.0 }
    );
    Ok(())
}

// ------------------------------------------------------------------ training

/// One train trajectory line (other fields are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct Sample {
    pub task: u32,
    pub action: u32,
    pub reward: f64,
}

pub fn read_samples(path: &Path) -> Result<Vec<Sample>, String> {
    let f = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| format!("reading {}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let s: Sample = serde_json::from_str(&line)
            .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        out.push(s);
    }
    Ok(out)
}

/// The REINFORCE gradient (ascent direction) of rank `rank` of `nnodes`: the samples whose
/// index is `rank` mod `nnodes`, with a per-task baseline (the task's mean reward over the
/// whole batch) and each task's contribution averaged over its samples. Summing the
/// gradients of every rank gives the full-batch gradient.
pub fn gradient(
    policy: &Policy,
    samples: &[Sample],
    rank: u32,
    nnodes: u32,
) -> Result<Vec<Vec<f64>>, String> {
    let (t, a) = (policy.tasks as usize, policy.actions as usize);
    let mut count = vec![0u64; t];
    let mut sum = vec![0.0f64; t];
    for (i, s) in samples.iter().enumerate() {
        if s.task as usize >= t || s.action as usize >= a || !s.reward.is_finite() {
            return Err(format!(
                "trajectory {} (task {}, action {}, reward {}) does not fit the model ({t} tasks, {a} actions)",
                i + 1,
                s.task,
                s.action,
                s.reward
            ));
        }
        count[s.task as usize] += 1;
        sum[s.task as usize] += s.reward;
    }
    let probs: Vec<Vec<f64>> = (0..policy.tasks).map(|i| policy.probs(i)).collect();
    let mut g = vec![vec![0.0f64; a]; t];
    for (i, s) in samples.iter().enumerate() {
        if i as u64 % nnodes as u64 != rank as u64 {
            continue;
        }
        let task = s.task as usize;
        let n = count[task] as f64;
        let adv = (s.reward - sum[task] / n) / n;
        for (j, gj) in g[task].iter_mut().enumerate() {
            let onehot = if j == s.action as usize { 1.0 } else { 0.0 };
            *gj += adv * (onehot - probs[task][j]);
        }
    }
    Ok(g)
}

pub fn apply(policy: &mut Policy, grad: &[Vec<f64>], lr: f64) {
    for (row, g) in policy.logits.iter_mut().zip(grad) {
        for (x, gx) in row.iter_mut().zip(g) {
            *x += lr * gx;
        }
    }
    policy.step += 1;
}

fn add_into(total: &mut [Vec<f64>], g: &[Vec<f64>]) {
    for (row, grow) in total.iter_mut().zip(g) {
        for (x, y) in row.iter_mut().zip(grow) {
            *x += y;
        }
    }
}

#[derive(Serialize, Deserialize)]
struct GradMsg {
    rank: u32,
    nnodes: u32,
    grad: Vec<Vec<f64>>,
}

#[derive(Serialize, Deserialize)]
struct SumMsg {
    sum: Vec<Vec<f64>>,
}

fn env_u32(name: &str, default: Option<u32>) -> Result<u32, String> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| format!("{name}={v} is not a number")),
        Err(_) => default.ok_or_else(|| format!("{name} is not set (the trainer reads torchrun's NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT)")),
    }
}

fn train_main(
    trajectories: &Path,
    model: &Path,
    out: &Path,
    lr: f64,
    peer_timeout: f64,
) -> Result<(), String> {
    let nnodes = env_u32("NNODES", Some(1))?.max(1);
    let rank = env_u32("NODE_RANK", Some(0))?;
    if rank >= nnodes {
        return Err(format!(
            "NODE_RANK={rank} is out of range for NNODES={nnodes}"
        ));
    }
    let started = Instant::now();
    let mut policy = Policy::load(model)?;
    let samples = read_samples(trajectories)?;
    let g = gradient(&policy, &samples, rank, nnodes)?;
    let timeout = Duration::from_secs_f64(peer_timeout.max(0.1));
    let sum = if nnodes == 1 {
        g
    } else {
        let port = env_u32("MASTER_PORT", None)?;
        let port = u16::try_from(port).map_err(|_| format!("MASTER_PORT={port} is not a port"))?;
        let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        if rank == 0 {
            all_reduce_master(g, nnodes, port, timeout)?
        } else {
            all_reduce_worker(g, rank, nnodes, &addr, port, timeout)?
        }
    };
    apply(&mut policy, &sum, lr);
    let mean = if samples.is_empty() {
        0.0
    } else {
        samples.iter().map(|s| s.reward).sum::<f64>() / samples.len() as f64
    };
    if rank == 0 {
        let dir = out.join(CHECKPOINT_DIR);
        policy
            .save(&dir)
            .map_err(|e| format!("cannot write {}: {e}", dir.join(POLICY_FILE).display()))?;
        crate::errln!(
            "toy train: rank 0 of {nnodes}: {} samples (mean reward {mean:.3}), step {} written to {} in {:.2}s",
            samples.len(),
            policy.step,
            dir.display(),
            started.elapsed().as_secs_f64()
        );
    } else {
        crate::errln!(
            "toy train: rank {rank} of {nnodes}: gradient of {} samples all-reduced in {:.2}s",
            samples.len().div_ceil(nnodes as usize),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn read_line_from(stream: &TcpStream, deadline: Instant, who: &str) -> Result<String, String> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(remaining.max(Duration::from_millis(10))))
        .map_err(|e| format!("{who}: {e}"))?;
    let mut line = String::new();
    match BufReader::new(stream).read_line(&mut line) {
        Ok(0) => Err(format!(
            "{who} closed the connection (did it fail? see its log)"
        )),
        Ok(_) if !line.ends_with('\n') => Err(format!("{who} closed the connection mid-message")),
        Ok(_) => Ok(line),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(format!("{who} sent nothing in time"))
        }
        Err(e) => Err(format!("{who}: {e} (did it fail? see its log)")),
    }
}

/// Rank 0: accept one connection per worker, sum the gradients in rank order, send the
/// sum back to every worker. Returns the sum exactly as the workers receive it.
fn all_reduce_master(
    own: Vec<Vec<f64>>,
    nnodes: u32,
    port: u16,
    timeout: Duration,
) -> Result<Vec<Vec<f64>>, String> {
    let bind = format!("0.0.0.0:{port}");
    let listener = TcpListener::bind(&bind).map_err(|e| {
        format!("cannot listen on {bind} for the all-reduce: {e} (is MASTER_PORT in use?)")
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("{bind}: {e}"))?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<(TcpStream, Vec<Vec<f64>>)>> = (0..nnodes).map(|_| None).collect();
    let mut waiting = nnodes - 1;
    while waiting > 0 {
        let (stream, from) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..nnodes)
                        .filter(|r| peers[*r as usize].is_none())
                        .map(|r| format!("rank {r}"))
                        .collect();
                    return Err(format!(
                        "all-reduce: {} did not connect to {bind} within {:.0?} (NNODES={nnodes})",
                        missing.join(", "),
                        timeout
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(format!("all-reduce: accept on {bind}: {e}")),
        };
        stream
            .set_nonblocking(false)
            .map_err(|e| format!("all-reduce: {e}"))?;
        let who = format!("a peer from {from}");
        let line =
            read_line_from(&stream, deadline, &who).map_err(|e| format!("all-reduce: {e}"))?;
        let msg: GradMsg = serde_json::from_str(&line)
            .map_err(|e| format!("all-reduce: {who} sent a malformed gradient: {e}"))?;
        if msg.nnodes != nnodes || msg.rank == 0 || msg.rank >= nnodes {
            return Err(format!(
                "all-reduce: {who} says it is rank {} of {}, but this job has NNODES={nnodes}",
                msg.rank, msg.nnodes
            ));
        }
        if peers[msg.rank as usize].is_some() {
            return Err(format!("all-reduce: two peers claim rank {}", msg.rank));
        }
        if msg.grad.len() != own.len() || msg.grad.iter().zip(&own).any(|(a, b)| a.len() != b.len())
        {
            return Err(format!(
                "all-reduce: rank {}'s gradient has a different shape (another model?)",
                msg.rank
            ));
        }
        peers[msg.rank as usize] = Some((stream, msg.grad));
        waiting -= 1;
    }
    // Sum in rank order so every run adds the same numbers in the same order.
    let mut total = own;
    for p in peers.iter().flatten() {
        add_into(&mut total, &p.1);
    }
    let line = serde_json::to_string(&SumMsg { sum: total }).expect("json") + "\n";
    for (r, p) in peers.iter_mut().enumerate() {
        if let Some((stream, _)) = p {
            stream
                .set_write_timeout(Some(timeout))
                .and_then(|()| stream.write_all(line.as_bytes()))
                .and_then(|()| stream.flush())
                .map_err(|e| format!("all-reduce: sending the sum to rank {r}: {e}"))?;
        }
    }
    // Apply exactly what the workers parse, so every rank holds identical weights.
    let parsed: SumMsg = serde_json::from_str(&line).expect("own json");
    Ok(parsed.sum)
}

fn all_reduce_worker(
    own: Vec<Vec<f64>>,
    rank: u32,
    nnodes: u32,
    addr: &str,
    port: u16,
    timeout: Duration,
) -> Result<Vec<Vec<f64>>, String> {
    let target = format!("{addr}:{port}");
    let deadline = Instant::now() + timeout;
    let mut last_err = String::from("no attempt");
    let stream = loop {
        match target.to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                let mut connected = None;
                for a in &addrs {
                    match TcpStream::connect_timeout(a, Duration::from_secs(1)) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last_err = e.to_string(),
                    }
                }
                if let Some(s) = connected {
                    break s;
                }
            }
            Err(e) => last_err = format!("cannot resolve: {e}"),
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "all-reduce: cannot connect to rank 0 at {target} (MASTER_ADDR:MASTER_PORT) within {timeout:.0?}: {last_err}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = stream.set_nodelay(true);
    let msg = serde_json::to_string(&GradMsg {
        rank,
        nnodes,
        grad: own,
    })
    .expect("json")
        + "\n";
    (&stream)
        .write_all(msg.as_bytes())
        .and_then(|()| (&stream).flush())
        .map_err(|e| format!("all-reduce: sending the gradient to rank 0 at {target}: {e}"))?;
    let line = read_line_from(&stream, deadline, &format!("rank 0 at {target}"))
        .map_err(|e| format!("all-reduce: waiting for the sum: {e}"))?;
    let sum: SumMsg = serde_json::from_str(&line)
        .map_err(|e| format!("all-reduce: malformed sum from rank 0: {e}"))?;
    Ok(sum.sum)
}

// ------------------------------------------------------------------ eval score

/// Accuracy of an eval JSONL file: (correct, total).
pub fn eval_counts(path: &Path) -> Result<(u64, u64), String> {
    let f = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let (mut ok, mut n) = (0, 0);
    for line in BufReader::new(f).lines() {
        let line = line.map_err(|e| format!("reading {}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("{}: {e}", path.display()))?;
        n += 1;
        if v["correct"].as_bool() == Some(true) {
            ok += 1;
        }
    }
    Ok((ok, n))
}

fn eval_score(file: &Path) -> Result<(), String> {
    let (ok, n) = eval_counts(file)?;
    if n == 0 {
        return Err(format!("{} has no eval lines", file.display()));
    }
    crate::outln!("accuracy {:.4} ({ok}/{n})", ok as f64 / n as f64);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sums_exactly_and_is_contiguous() {
        let mut rng = SplitMix64::new(7);
        for _ in 0..2000 {
            let n = 1 + (rng.next_u64() % 9) as usize;
            let weights: Vec<u64> = (0..n).map(|_| rng.next_u64() % 6).collect();
            let total = rng.next_u64() % 200;
            let counts = split_counts(total, &weights);
            if weights.iter().sum::<u64>() == 0 {
                assert!(counts.iter().all(|&c| c == 0));
                continue;
            }
            assert_eq!(counts.iter().sum::<u64>(), total, "{weights:?} {total}");
            let mut next = 0;
            for r in 0..n {
                let range = split_range(total, &weights, r);
                assert_eq!(range.start, next);
                next = range.end;
                // Largest remainder: never more than one away from the exact quota.
                let quota = total as f64 * weights[r] as f64 / weights.iter().sum::<u64>() as f64;
                assert!(
                    (counts[r] as f64 - quota).abs() < 1.0,
                    "{weights:?} {total} {counts:?}"
                );
            }
            assert_eq!(next, total);
        }
        assert_eq!(split_counts(32, &[2, 1, 1]), vec![16, 8, 8]);
        assert_eq!(split_counts(10, &[1, 1, 1]), vec![4, 3, 3]);
    }

    #[test]
    fn best_actions_look_uniform() {
        let mut hist = [0u32; 4];
        for t in 0..4000 {
            hist[best_action(1, t, 4) as usize] += 1;
        }
        assert!(hist.iter().all(|&h| (900..1100).contains(&h)), "{hist:?}");
    }

    #[test]
    fn sampling_follows_the_policy() {
        let mut p = Policy::uniform(1, 3);
        p.logits[0] = vec![0.0, (2.0f64).ln(), 0.0];
        let mut hist = [0u32; 3];
        for s in 0..8000 {
            hist[p.sample(0, hash(&[1, s])).0 as usize] += 1;
        }
        assert!((1800..2200).contains(&hist[0]), "{hist:?}");
        assert!((3800..4200).contains(&hist[1]), "{hist:?}");
        assert_eq!(p.greedy(0).0, 1);
        // A uniform policy's greedy answers are right about 1/A of the time.
        let u = Policy::uniform(4000, 4);
        let right = (0..4000)
            .filter(|&t| u.greedy(t).0 == best_action(1, t, 4))
            .count();
        assert!((900..1100).contains(&right), "{right}");
    }

    /// The training loop on its own (no server, no processes): reward rises from chance.
    fn simulate(nnodes: u32, iterations: u64) -> Vec<f64> {
        let (seed, tasks, actions, samples, lr) = (1, 32, 4, 4, 4.0);
        let mut policy = Policy::uniform(tasks, actions);
        let mut curve = Vec::new();
        for it in 1..=iterations {
            let mut batch = Vec::new();
            for task in 0..tasks {
                for j in 0..samples {
                    let s = sample_seed(seed, it, task, j);
                    let (a, _) = policy.sample(task, hash(&[seed, s]));
                    batch.push(Sample {
                        task,
                        action: a,
                        reward: reward(seed, task, actions, a),
                    });
                }
            }
            curve.push(batch.iter().map(|s| s.reward).sum::<f64>() / batch.len() as f64);
            let mut total = gradient(&policy, &batch, 0, nnodes).unwrap();
            for r in 1..nnodes {
                add_into(&mut total, &gradient(&policy, &batch, r, nnodes).unwrap());
            }
            apply(&mut policy, &total, lr);
        }
        curve
    }

    #[test]
    fn training_improves_reward_deterministically() {
        let curve = simulate(3, 8);
        assert!(curve[0] < 0.45, "{curve:?}");
        assert!(curve[7] >= 0.8, "{curve:?}");
        assert_eq!(curve, simulate(3, 8));
        // The data-parallel split changes only the summation order.
        let one = simulate(1, 8);
        for (a, b) in curve.iter().zip(&one) {
            assert!((a - b).abs() < 0.05, "{curve:?} vs {one:?}");
        }
    }

    #[test]
    fn gradient_parts_sum_to_the_full_gradient() {
        let mut p = Policy::uniform(3, 3);
        p.logits[1] = vec![0.5, -0.2, 0.1];
        let batch: Vec<Sample> = (0..20)
            .map(|i| Sample {
                task: i % 3,
                action: (i * 7 % 3),
                reward: (i % 2) as f64,
            })
            .collect();
        let full = gradient(&p, &batch, 0, 1).unwrap();
        let mut parts = gradient(&p, &batch, 0, 3).unwrap();
        for r in 1..3 {
            add_into(&mut parts, &gradient(&p, &batch, r, 3).unwrap());
        }
        for (a, b) in full.iter().flatten().zip(parts.iter().flatten()) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn server_answers() {
        let p = Policy::uniform(4, 2);
        let (s, v) = handle(&p, 1, "m", "/health");
        assert_eq!(s, 200);
        assert_eq!(v["tasks"], 4);
        let (s, v) = handle(&p, 1, "m", "/act?task=3&greedy=1");
        assert_eq!((s, v["action"].as_u64()), (200, Some(p.greedy(3).0 as u64)));
        let (s, _) = handle(&p, 1, "m", "/act?task=4&greedy=1");
        assert_eq!(s, 400);
        let (s, _) = handle(&p, 1, "m", "/act?task=1");
        assert_eq!(s, 400);
        let a = handle(&p, 1, "m", "/act?task=1&sample_seed=99");
        assert_eq!(a, handle(&p, 1, "m", "/act?task=1&sample_seed=99"));
        assert_eq!(handle(&p, 1, "m", "/nope").0, 404);
    }

    #[test]
    fn policy_round_trips_and_refuses_garbage() {
        let d = std::env::temp_dir().join(format!("toy-policy-{}", std::process::id()));
        let mut p = Policy::uniform(3, 2);
        p.logits[2] = vec![0.1 + 0.2, -1.0 / 3.0];
        p.save(&d).unwrap();
        assert_eq!(Policy::load(&d).unwrap(), p);
        fs::write(d.join(POLICY_FILE), "{}").unwrap();
        assert!(Policy::load(&d).unwrap_err().contains("not a toy policy"));
        fs::remove_dir_all(&d).unwrap();
        assert!(Policy::load(&d).unwrap_err().contains("missing"));
    }
}
