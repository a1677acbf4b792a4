//! Pipelined mode with real processes (issue 14): a rollout cluster (`--rl-phase rollout`)
//! and an update cluster (`--rl-phase update`) over one shared directory, each with its own
//! `--num-nodes`, handing iterations over as `[pipeline] staleness` says.
//!
//! The commands are deterministic and depend on the model they are given: a rollout
//! record carries the content of `{model}` and `{model_version}`, a checkpoint is the hash
//! of its iteration's trajectories and the previous model. So equal files mean equal
//! schedules, and every file can be checked against the one it was derived from.

mod common;
use common::cluster::*;
use common::mountns::{self, PrivateViews};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Rollout: trace the start (with the newest published model at that moment), then one
/// record per rank from the model's content. Train: trace the trajectories' hash; rank 0
/// writes a checkpoint that hashes the trajectories and the previous model. Hand-off:
/// trace it (once per iteration that trained).
const COMMANDS: &str = r#"
[phases.rollout]
command = '''echo {iteration} {rank} v{model_version} latest=$(cat {log_path}/models/LATEST 2>/dev/null || echo none) g{gen} >> {log_path}/trace-rollout; m=$(cat {model}/w 2>/dev/null || echo base); echo '{"iteration": {iteration}, "rank": {rank}, "model_version": {model_version}, "staleness": {staleness}, "checkpoint": "{checkpoint_name}", "model": "'$m'", "value": '$(({iteration} * 100 + {rank} * 7))'}' > {output}'''
[phases.train]
command = '''echo {iteration} {rank} $(sha256sum < {trajectories} | cut -c1-16) g{gen} >> {log_path}/trace-train; SLEEP if [ {rank} = 0 ]; then mkdir -p {output}/checkpoint-1 && (cat {trajectories}; cat {model}/w 2>/dev/null || echo base) | sha256sum | cut -c1-16 > {output}/checkpoint-1/w; fi'''
[phases.handoff]
command = '''echo {iteration} g{gen} >> {log_path}/trace-handoff'''
"#;

/// One run directory, its configuration and its number of iterations.
struct Run {
    c: TestCluster,
    iterations: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Rollout,
    Update,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Rollout => "rollout",
            Side::Update => "update",
        }
    }
}

/// The configuration's tables after `[cluster]`: the commands (training pausing
/// `train_sleep` seconds, if given), `work.seed`, and `[pipeline] staleness` (None: the
/// synchronous loop).
fn config(staleness: Option<u64>, train_sleep: &str, seed: u64) -> String {
    let sleep = if train_sleep.is_empty() {
        String::new()
    } else {
        format!("sleep {train_sleep};")
    };
    let mut s = COMMANDS.replace("SLEEP", &sleep);
    s.push_str(&format!("\n[work]\nseed = {seed}\n"));
    if let Some(st) = staleness {
        s.push_str(&format!("\n[pipeline]\nstaleness = {st}\n"));
    }
    s
}

impl Run {
    fn new(staleness: Option<u64>, iterations: u64, train_sleep: &str) -> Run {
        Run::with_config(&config(staleness, train_sleep, 7), iterations)
    }

    fn with_config(text: &str, iterations: u64) -> Run {
        Run {
            c: TestCluster::pipelined(text),
            iterations,
        }
    }

    /// Start rank `rank` of one cluster of `nodes` nodes (`None`: the synchronous loop).
    fn spawn(&self, side: Option<Side>, nodes: u32, rank: u32, env: &[(&str, String)]) -> NodeProc {
        let its = self.iterations.to_string();
        let n = nodes.to_string();
        let mut args = vec!["--iterations", &its, "--num-nodes", &n];
        if let Some(s) = side {
            args.extend(["--rl-phase", s.name()]);
        }
        self.c.spawn_env(rank, &self.c.log_path, &args, env)
    }

    /// Every node of both clusters (rollout ranks first).
    fn spawn_pipeline(&self, rollout: u32, update: u32) -> Vec<(Side, NodeProc)> {
        let mut v: Vec<(Side, NodeProc)> = (0..rollout)
            .map(|r| {
                (
                    Side::Rollout,
                    self.spawn(Some(Side::Rollout), rollout, r, &[]),
                )
            })
            .collect();
        v.extend(
            (0..update).map(|r| (Side::Update, self.spawn(Some(Side::Update), update, r, &[]))),
        );
        v
    }

    /// [`Run::spawn_pipeline`] with each node in a mount namespace of its own, seeing the
    /// shared directory only at a path of its own (`common::mountns`).
    fn spawn_pipeline_in_views(
        &self,
        views: &PrivateViews,
        rollout: u32,
        update: u32,
    ) -> Vec<(Side, NodeProc)> {
        let its = self.iterations.to_string();
        let sides = (0..rollout)
            .map(|r| (Side::Rollout, rollout, r))
            .chain((0..update).map(|r| (Side::Update, update, r)));
        sides
            .map(|(side, nodes, r)| {
                let n = nodes.to_string();
                let args = [
                    "--iterations",
                    &its,
                    "--num-nodes",
                    &n,
                    "--rl-phase",
                    side.name(),
                ];
                let node = format!("{}-{r}", side.name());
                (side, views.spawn_node(&self.c, &node, r, &args, &[], ""))
            })
            .collect()
    }

    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.c.log_path.join(rel)
    }

    fn read(&self, rel: &str) -> String {
        let p = self.path(rel);
        fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Lines of a trace file, split in words.
    fn trace(&self, name: &str) -> Vec<Vec<String>> {
        fs::read_to_string(self.path(name))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .collect()
    }

    fn model_json(&self, it: u64) -> serde_json::Value {
        serde_json::from_str(&self.read(&format!("rollouts/iter-{it:04}/model.json"))).unwrap()
    }

    /// A cluster's journal entries of one rank (pipelined: under `.rl-node/<cluster>/`).
    fn journal(&self, side: Side, rank: u32) -> Vec<serde_json::Value> {
        fs::read_to_string(self.path(&format!(
            ".rl-node/{}/journal/rank-{rank}.jsonl",
            side.name()
        )))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
    }

    /// The outputs two equivalent runs must have byte for byte: every iteration's merged
    /// trajectories and rank shards, every published model, LATEST.
    fn outputs(&self, rollout_nodes: u32) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for i in 1..=self.iterations {
            let mut files = vec![
                format!("rollouts/iter-{i:04}/train.jsonl"),
                format!("models/iter-{i:04}/w"),
            ];
            files.extend(
                (0..rollout_nodes).map(|r| format!("rollouts/iter-{i:04}/train/rank-{r}.jsonl")),
            );
            for f in files {
                let text = self.read(&f);
                out.insert(f, text);
            }
        }
        out.insert("models/LATEST".into(), self.read("models/LATEST"));
        out
    }
}

fn wait_all(nodes: &mut [(Side, NodeProc)], context: &str) {
    for (side, n) in nodes.iter_mut() {
        assert_eq!(
            n.wait(LIMIT),
            0,
            "{context}: {} rank {} failed:\n{}",
            side.name(),
            n.rank,
            n.stderr()
        );
    }
}

fn sha16(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))[..16].to_string()
}

/// The model version the exact rule gives iteration `i` (first iteration 1).
fn exact(i: u64, staleness: u64) -> u64 {
    i.saturating_sub(1 + staleness)
}

/// Everything one finished pipelined run must show, from its own files: each iteration's
/// rollout model is the one the rule gives, its records came from that model, it was
/// trained exactly once on its committed trajectories, its checkpoint derives from those
/// and the previous model, and no rollout started ahead of the staleness bound.
fn assert_pipelined_run(run: &Run, rollout: u32, update: u32, staleness: u64, context: &str) {
    let rollout_trace = run.trace("trace-rollout");
    let train_trace = run.trace("trace-train");
    let handoffs = run.trace("trace-handoff");
    let mut prev_model = b"base\n".to_vec();
    for i in 1..=run.iterations {
        let v = exact(i, staleness);
        let ctx = format!("{context}, iteration {i}");
        // The manifest: exactly the rule's version.
        let m = run.model_json(i);
        assert_eq!(m["iteration"], i, "{ctx}: {m}");
        assert_eq!(m["model_version"], v, "{ctx}: {m}");
        assert_eq!(m["staleness"], i - 1 - v, "{ctx}: {m}");
        assert!(m["staleness"].as_u64().unwrap() <= staleness, "{ctx}: {m}");
        assert_eq!(m["rule"], "exact", "{ctx}: {m}");
        // Relative to the shared directory: each node resolves it on its own mount.
        let model_dir = if v == 0 {
            "base".to_string()
        } else {
            format!("models/iter-{v:04}")
        };
        assert_eq!(m["model"], model_dir.as_str(), "{ctx}: {m}");
        // The trajectories: one record per rollout rank, in rank order, made with that model.
        let model_content = if v == 0 {
            "base".to_string()
        } else {
            run.read(&format!("models/iter-{v:04}/w"))
                .trim()
                .to_string()
        };
        let traj = run.read(&format!("rollouts/iter-{i:04}/train.jsonl"));
        let records: Vec<serde_json::Value> = traj
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records.len(), rollout as usize, "{ctx}: {traj}");
        for (r, rec) in records.iter().enumerate() {
            assert_eq!(rec["rank"], r as u64, "{ctx}: {traj}");
            assert_eq!(rec["iteration"], i, "{ctx}: {traj}");
            assert_eq!(rec["model_version"], v, "{ctx}: {traj}");
            assert_eq!(rec["staleness"], m["staleness"], "{ctx}: {traj}");
            assert_eq!(rec["model"], model_content.as_str(), "{ctx}: {traj}");
            let ck = if v == 0 {
                String::new()
            } else {
                format!("models/iter-{v:04}")
            };
            assert_eq!(rec["checkpoint"], ck.as_str(), "{ctx}: {traj}");
        }
        // Rolled out once per rollout rank, with the version the rule gives, never ahead
        // of the newest published model by more than `staleness`.
        for r in 0..rollout {
            let lines: Vec<_> = rollout_trace
                .iter()
                .filter(|l| l[0] == i.to_string() && l[1] == r.to_string())
                .collect();
            assert_eq!(lines.len(), 1, "{ctx}: rollout rank {r}: {rollout_trace:?}");
            assert_eq!(lines[0][2], format!("v{v}"), "{ctx}: {lines:?}");
            let latest = lines[0][3]
                .strip_prefix("latest=")
                .and_then(|l| l.strip_prefix("iter-"))
                .map_or(0, |n| n.parse::<u64>().unwrap());
            assert!(
                latest >= v,
                "{ctx}: rollout rank {r} started when the newest model was of iteration {latest}, older than version {v}"
            );
            assert!(latest < i, "{ctx}: a model of iteration {latest} already?");
        }
        // Trained exactly once per update rank, on the committed trajectories.
        let hash = sha16(traj.as_bytes());
        for r in 0..update {
            let lines: Vec<_> = train_trace
                .iter()
                .filter(|l| l[0] == i.to_string() && l[1] == r.to_string())
                .collect();
            assert_eq!(lines.len(), 1, "{ctx}: update rank {r}: {train_trace:?}");
            assert_eq!(lines[0][2], hash, "{ctx}: trained on other trajectories");
        }
        let h: Vec<_> = handoffs.iter().filter(|l| l[0] == i.to_string()).collect();
        assert_eq!(h.len(), 1, "{ctx}: hand-offs {handoffs:?}");
        // The checkpoint derives from those trajectories and the previous model.
        let w = run.read(&format!("models/iter-{i:04}/w"));
        let mut input = traj.as_bytes().to_vec();
        input.extend_from_slice(&prev_model);
        assert_eq!(w, format!("{}\n", sha16(&input)), "{ctx}: checkpoint");
        prev_model = w.into_bytes();
    }
    assert_eq!(
        run.read("models/LATEST").trim(),
        format!("iter-{:04}", run.iterations),
        "{context}"
    );
}

/// A pipelined run of `rollout` + `update` nodes: checked on its own, and with staleness 0
/// byte for byte against the synchronous loop of `rollout` nodes with the same seed.
fn pipeline(rollout: u32, update: u32, staleness: u64) {
    let context = format!("{rollout}+{update} nodes, staleness {staleness}");
    let iterations = 4;
    let run = Run::new(Some(staleness), iterations, "");
    let mut nodes = run.spawn_pipeline(rollout, update);
    // The synchronous reference runs meanwhile, in a directory of its own.
    let sync = (staleness == 0).then(|| {
        let s = Run::new(None, iterations, "");
        // (Labelled "rollout" in messages only: these nodes walk whole iterations.)
        let mut n: Vec<(Side, NodeProc)> = (0..rollout)
            .map(|r| (Side::Rollout, s.spawn(None, rollout, r, &[])))
            .collect();
        wait_all(&mut n, &format!("{context}: the synchronous run"));
        s
    });
    wait_all(&mut nodes, &context);
    assert_pipelined_run(&run, rollout, update, staleness, &context);
    if let Some(sync) = sync {
        assert_eq!(
            run.outputs(rollout),
            sync.outputs(rollout),
            "{context}: the pipelined run's trajectories and models differ from the synchronous loop's"
        );
    }
}

mod pipelines {
    #[test]
    fn one_plus_one_staleness_0() {
        super::pipeline(1, 1, 0);
    }
    #[test]
    fn one_plus_one_staleness_1() {
        super::pipeline(1, 1, 1);
    }
    #[test]
    fn one_plus_one_staleness_2() {
        super::pipeline(1, 1, 2);
    }
    #[test]
    fn two_plus_two_staleness_0() {
        super::pipeline(2, 2, 0);
    }
    #[test]
    fn two_plus_two_staleness_1() {
        super::pipeline(2, 2, 1);
    }
    #[test]
    fn two_plus_two_staleness_2() {
        super::pipeline(2, 2, 2);
    }
    /// The clusters' sizes differ.
    #[test]
    fn two_plus_one_staleness_1() {
        super::pipeline(2, 1, 1);
    }
}

/// Every node of both clusters sees the shared directory at a path of its own, and only
/// there: each rollout node is told the model of each iteration on its own mount, and the
/// run is the one the staleness rule gives.
#[test]
fn two_plus_one_with_each_node_mounting_the_share_at_its_own_path() {
    mountns::require("two_plus_one_with_each_node_mounting_the_share_at_its_own_path");
    let run = Run::new(Some(1), 4, "");
    let views = PrivateViews::new(&run.c.log_path);
    let mut nodes = run.spawn_pipeline_in_views(&views, 2, 1);
    wait_all(&mut nodes, "2+1 nodes on their own mount points");
    assert_pipelined_run(&run, 2, 1, 1, "2+1 nodes on their own mount points");
}

/// The host a cluster's rank runs on, from its live record.
fn host_of(run: &Run, side: Side, rank: u32) -> String {
    run.c
        .record_in(Some(side.name()), rank)
        .and_then(|r| r["host"].as_str().map(str::to_string))
        .expect("the victim's record")
}

/// The journal item after which a rank never runs its command of an iteration again: a
/// rollout shard is committed (and reused) on its own; training only with the iteration
/// (a rank's `train` entry is redone when another rank's training was interrupted).
fn committed_item(side: Side) -> &'static str {
    match side {
        Side::Rollout => "rollout-train",
        Side::Update => "iteration-complete:update",
    }
}

/// The trace file of a cluster's command.
fn trace_of(side: Side) -> &'static str {
    match side {
        Side::Rollout => "trace-rollout",
        Side::Update => "trace-train",
    }
}

/// Kill -9 rank 1 of `side` (2 + 2 nodes, staleness 1) when it enters `phase`, check that
/// every other node of both clusters stops with the diagnosis naming it, restart all of
/// them with the same commands, and compare with an uninterrupted run.
fn kill_and_resume(side: Side, phase: &str) {
    let context = format!("{} rank 1 killed in {phase}", side.name());
    let (staleness, iterations) = (1, 4);
    let reference = Run::new(Some(staleness), iterations, "");
    let mut ref_nodes = reference.spawn_pipeline(2, 2);

    let run = Run::new(Some(staleness), iterations, "");
    let hold = [("RL_NODE_TEST_HOLD_AT", phase.to_string())];
    let mut nodes: Vec<(Side, NodeProc)> = [Side::Rollout, Side::Update]
        .into_iter()
        .flat_map(|s| (0..2).map(move |r| (s, r)))
        .map(|(s, r)| {
            let env: &[(&str, String)] = if s == side && r == 1 { &hold } else { &[] };
            (s, run.spawn(Some(s), 2, r, env))
        })
        .collect();
    let victim = nodes
        .iter()
        .position(|(s, n)| *s == side && n.rank == 1)
        .unwrap();
    wait_until(LIMIT, &format!("{context}: the victim to hold"), || {
        nodes[victim].1.stderr().contains("RL_NODE_TEST_HOLD_AT")
    });
    let host = host_of(&run, side, 1);
    nodes[victim].1.signal(libc::SIGKILL);
    assert_eq!(nodes[victim].1.wait(LIMIT), 137, "{context}");
    let diagnosis = format!("the {} cluster's rank 1 on {host} is dead", side.name());
    for (s, n) in nodes.iter_mut() {
        if *s == side && n.rank == 1 {
            continue;
        }
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(
            code,
            3,
            "{context}: {} rank {} should stop as a peer failed:\n{err}",
            s.name(),
            n.rank
        );
        assert!(
            err.contains(&diagnosis),
            "{context}: {} rank {} does not say `{diagnosis}`:\n{err}",
            s.name(),
            n.rank
        );
    }
    drop(nodes);
    // What was committed before the stop (journaled), and how often each command had run.
    let committed_before: Vec<(Side, u32, u64)> = [Side::Rollout, Side::Update]
        .into_iter()
        .flat_map(|s| (0..2).map(move |r| (s, r)))
        .flat_map(|(s, r)| {
            let item = committed_item(s);
            run.journal(s, r)
                .into_iter()
                .filter(move |e| e["item"] == item)
                .map(move |e| (s, r, e["iteration"].as_u64().unwrap()))
        })
        .collect();
    assert!(
        !committed_before.is_empty(),
        "{context}: nothing was committed before the kill"
    );
    let runs_before = |run: &Run, (s, r, i): (Side, u32, u64)| {
        run.trace(trace_of(s))
            .iter()
            .filter(|l| l[0] == i.to_string() && l[1] == r.to_string())
            .count()
    };
    let counts_before: Vec<usize> = committed_before
        .iter()
        .map(|&k| runs_before(&run, k))
        .collect();
    let mut nodes = run.spawn_pipeline(2, 2);
    wait_all(&mut nodes, &format!("{context}: after the restart"));
    // Nothing committed before the stop ran again after the restart.
    for (k, before) in committed_before.iter().zip(counts_before) {
        assert_eq!(
            runs_before(&run, *k),
            before,
            "{context}: {} rank {} redid iteration {} after the restart, though it was committed",
            k.0.name(),
            k.1,
            k.2
        );
    }
    wait_all(&mut ref_nodes, &format!("{context}: the reference run"));
    assert_pipelined_run(&reference, 2, 2, staleness, "the reference run");
    assert_eq!(
        run.outputs(2),
        reference.outputs(2),
        "{context}: the resumed run's outputs differ from an uninterrupted run's"
    );
    for i in 1..=iterations {
        let m = run.model_json(i);
        let r = reference.model_json(i);
        for k in ["iteration", "model_version", "staleness", "rule"] {
            assert_eq!(m[k], r[k], "{context}: model.json of iteration {i}");
        }
    }
    // Nothing committed was done twice: each rank journaled each item once, and each
    // iteration was handed off once; a command the stop interrupted ran again only in a
    // later generation.
    for s in [Side::Rollout, Side::Update] {
        for r in 0..2 {
            let mut seen: BTreeMap<(u64, String), usize> = BTreeMap::new();
            // Training interrupted on another rank is redone, and journaled again.
            for e in run
                .journal(s, r)
                .into_iter()
                .filter(|e| e["item"] != "train")
            {
                *seen
                    .entry((
                        e["iteration"].as_u64().unwrap(),
                        e["item"].as_str().unwrap().to_string(),
                    ))
                    .or_default() += 1;
            }
            assert!(
                seen.values().all(|c| *c == 1),
                "{context}: {} rank {r} journaled work twice: {seen:?}",
                s.name()
            );
            let item = committed_item(s);
            for i in 1..=iterations {
                assert_eq!(
                    seen.get(&(i, item.to_string())),
                    Some(&1),
                    "{context}: {} rank {r}, iteration {i}: {seen:?}",
                    s.name()
                );
            }
        }
    }
    let handoffs = run.trace("trace-handoff");
    for i in 1..=iterations {
        let n = handoffs.iter().filter(|l| l[0] == i.to_string()).count();
        assert_eq!(n, 1, "{context}: iteration {i} handed off {n} times");
    }
    // Every training, the interrupted ones too, ran on its iteration's committed
    // trajectories.
    for l in run.trace("trace-train") {
        let i: u64 = l[0].parse().unwrap();
        let traj = run.read(&format!("rollouts/iter-{i:04}/train.jsonl"));
        assert_eq!(l[2], sha16(traj.as_bytes()), "{context}: {l:?}");
    }
    for name in ["trace-rollout", "trace-train"] {
        let mut seen: BTreeMap<(String, String, String), usize> = BTreeMap::new();
        for l in run.trace(name) {
            let gen = l.last().unwrap().clone();
            *seen.entry((l[0].clone(), l[1].clone(), gen)).or_default() += 1;
        }
        assert!(
            seen.values().all(|c| *c == 1),
            "{context}: {name}: a command ran twice in one generation: {seen:?}"
        );
    }
}

#[test]
fn kill_a_rollout_node_mid_rollout_then_resume() {
    kill_and_resume(Side::Rollout, "train-rollout@3");
}

#[test]
fn kill_an_update_node_mid_training_then_resume() {
    kill_and_resume(Side::Update, "training@2");
}

/// Training much slower than rollout: the rollout cluster runs ahead, up to exactly
/// `staleness` iterations and never more.
fn never_more_than_staleness_ahead(staleness: u64) {
    let context = format!("slow training, staleness {staleness}");
    let run = Run::new(Some(staleness), 5, "1");
    let mut nodes = run.spawn_pipeline(1, 1);
    wait_all(&mut nodes, &context);
    assert_pipelined_run(&run, 1, 1, staleness, &context);
    // From the manifests and the rollout trace: when iteration i's rollout started, the
    // newest published model was at least version i-1-staleness (asserted above), and with
    // training this slow the rollout cluster did get the whole `staleness` ahead.
    let lags: Vec<u64> = run
        .trace("trace-rollout")
        .iter()
        .map(|l| {
            let i: u64 = l[0].parse().unwrap();
            let latest = l[3]
                .strip_prefix("latest=iter-")
                .map_or(0, |n| n.parse::<u64>().unwrap());
            i - 1 - latest
        })
        .collect();
    assert!(
        lags.iter().all(|&l| l <= staleness),
        "{context}: lags {lags:?}"
    );
    assert!(
        lags.contains(&staleness),
        "{context}: the rollout cluster never ran ahead: lags {lags:?}"
    );
    for i in 1..=5 {
        assert!(run.model_json(i)["staleness"].as_u64().unwrap() <= staleness);
    }
}

#[test]
fn slow_training_staleness_1_keeps_the_bound() {
    never_more_than_staleness_ahead(1);
}

#[test]
fn slow_training_staleness_2_keeps_the_bound() {
    never_more_than_staleness_ahead(2);
}

/// The update cluster is started with `other` configuration text while the rollout
/// cluster runs the test's own.
fn different_configurations_are_refused(other: &str, what: &str) {
    let run = Run::new(Some(0), 3, "");
    let mut rollout = run.spawn(Some(Side::Rollout), 1, 0, &[]);
    // The rollout cluster has committed iteration 1 and waits for its model.
    wait_until(LIMIT, "the rollout cluster's queue record", || {
        fs::read_to_string(run.path(".rl-node/pipeline/rollout.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|q| q["done"] == 1)
    });
    let mut second = Run::with_config(other, 3);
    second.c.log_path = run.c.log_path.clone();
    let mut update = second.spawn(Some(Side::Update), 1, 0, &[]);
    let code = update.wait(LIMIT);
    let err = update.stderr();
    assert_eq!(code, 2, "{what}: the second cluster:\n{err}");
    assert!(
        err.contains("the rollout cluster runs another configuration (fingerprint"),
        "{what}: the second cluster:\n{err}"
    );
    // The first cluster does not wait forever either: it stops with the same diagnosis,
    // as caused by the update cluster.
    let code = rollout.wait(LIMIT);
    let rerr = rollout.stderr();
    assert_eq!(code, 3, "{what}: the first cluster:\n{rerr}");
    assert!(
        rerr.contains("the update cluster's rank 0 on ")
            && rerr.contains("runs another configuration (fingerprint"),
        "{what}: the first cluster:\n{rerr}"
    );
}

#[test]
fn clusters_with_different_seeds_are_refused() {
    different_configurations_are_refused(&config(Some(0), "", 8), "work.seed");
}

#[test]
fn clusters_with_different_train_commands_are_refused() {
    // The same commands but for a pause in training.
    different_configurations_are_refused(&config(Some(0), "0", 7), "phases.train.command");
}

#[test]
fn a_pipelined_configuration_with_rl_phase_both_is_refused() {
    let run = Run::new(Some(1), 2, "");
    let mut n = run.spawn(None, 1, 0, &[]);
    let code = n.wait(LIMIT);
    let err = n.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cluster.rl-phase"), "{err}");
    assert!(
        !run.path(".rl-node").exists(),
        "something was written: {err}"
    );
}

/// After a pipelined run, `status` shows both clusters and the queue with each
/// iteration's model version; `recover` asks which cluster and reports it; a cluster
/// restarted after the other finished every iteration has nothing to wait for.
#[test]
fn status_and_recover_show_both_clusters_of_a_finished_pipeline() {
    let run = Run::new(Some(1), 3, "");
    let mut nodes = run.spawn_pipeline(1, 1);
    wait_all(&mut nodes, "1+1 nodes, staleness 1");
    let (ok, text) = status(&run.c.log_path, false);
    assert!(ok, "{text}");
    for want in [
        "pipelined run (pipeline.staleness = 1)",
        "queue: trajectories committed up to iteration 3; rolling out none; training none; models published up to iteration 3",
        "rolled out: 1 on base model (staleness 0), 2 on base model (staleness 1), 3 on model 1 (staleness 1)",
        "== rollout cluster ==",
        "== update cluster ==",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    assert_eq!(text.matches("state: completed").count(), 2, "{text}");
    let (ok, json) = status(&run.c.log_path, true);
    assert!(ok, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (v["rolled_out"].as_u64(), v["trained"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(v["rollout"]["Ok"]["num_nodes"], 1, "{v}");
    // The run's state from both clusters' (docs/status.md).
    assert_eq!(
        (&v["schema_version"], &v["state"]),
        (&1.into(), &"completed".into()),
        "{v}"
    );
    assert_eq!(v["update"]["Ok"]["state"], "completed", "{v}");
    assert_eq!(v["versions"][2], serde_json::json!([3, 1, 1]), "{v}");

    let recover = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .arg("recover")
            .arg("--log-path")
            .arg(&run.c.log_path)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, text) = recover(&[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("holds a pipelined run") && text.contains("--cluster rollout"),
        "{text}"
    );
    let (code, text) = recover(&["--cluster", "update"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("the run is complete"), "{text}");
    let (code, text) = recover(&["--cluster", "rollout", "--discard-iteration", "2"]);
    assert_eq!(code, Some(2), "{text}");

    // Both restarted with more iterations, the update cluster alone: the rollout cluster
    // finished earlier and is not running, so the update cluster's wait for iteration 4
    // ends with a message that says the rollout cluster is not running, not a hang.
    let mut update = run.c.spawn_env(
        0,
        &run.c.log_path,
        &[
            "--iterations",
            "4",
            "--num-nodes",
            "1",
            "--rl-phase",
            "update",
        ],
        &[("RL_NODE_TIMING_JOIN_TIMEOUT", "2s".to_string())],
    );
    let code = update.wait(LIMIT);
    let err = update.stderr();
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("the rollout cluster finished its iterations"),
        "{err}"
    );
}

/// `pipeline.model = "newest"`: an iteration never gets an older model than the exact
/// rule's, and model.json says which rule chose it.
#[test]
fn the_newest_rule_never_rolls_out_on_an_older_model_than_the_exact_one() {
    let run = Run::with_config(&(config(Some(2), "", 7) + "model = \"newest\"\n"), 4);
    let mut nodes = run.spawn_pipeline(1, 1);
    wait_all(&mut nodes, "1+1 nodes, staleness 2, newest");
    for i in 1..=4u64 {
        let m = run.model_json(i);
        let v = m["model_version"].as_u64().unwrap();
        assert_eq!(m["rule"], "newest", "{m}");
        assert!(v >= exact(i, 2) && v < i, "iteration {i}: {m}");
        assert_eq!(m["staleness"].as_u64().unwrap(), (i - 1) - v, "{m}");
    }
}
