//! `rl-node recover`: replaces the manual clean-up after a crash. It says where the run
//! stands (per rank: last complete iteration, last journaled work, whether the process
//! recorded as holding the rank is alive), what a restart would reuse and redo, and which
//! incomplete files lie around. Read-only unless asked: `--discard-iteration N` sets an
//! incomplete iteration aside (moved, never deleted) so a restart redoes it from scratch.

use crate::error::{Cause, Ending, Failure};
use crate::layout::{iter_dir, Layout};
use crate::protocol::journal::{self, item, Entry};
use crate::protocol::walk::RolloutSplit;
use crate::protocol::{phase::eval_due, ClusterRecord, NodeState, RankRecord};
use crate::shards::naming::Naming;
use crate::store::{self, Fs, SharedDir};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct RecoverArgs {
    /// The run's shared directory.
    #[arg(long, value_name = "DIR")]
    pub log_path: Option<String>,
    /// Set iteration N aside (its trajectories, training output, logs, hand-off and journal
    /// entries, moved under previous-runs/), so a restart redoes it from scratch.
    #[arg(long, value_name = "N")]
    pub discard_iteration: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Repair damaged state files: rebuild `cluster.json` from its generation copy, move
    /// unreadable records and lines to side files, rebuild lost journal entries from the
    /// other journals and the history. Nothing is deleted. Refused while a node runs.
    #[arg(long)]
    pub repair: bool,
    /// In a pipelined run (docs/pipeline.md): the cluster to look at, `rollout` or `update`.
    #[arg(long, value_name = "NAME", value_parser = ["rollout", "update"])]
    pub cluster: Option<String>,
}

struct Out;
impl Out {
    fn line(&self, s: &str) {
        crate::outln!("{s}");
    }
}

/// Report damaged state and what `--repair` does (or did) about it. `None` when the state
/// is usable afterwards (the normal report follows), else how `recover` ends.
fn damaged_state(
    layout: &Layout,
    problems: &[super::repair::Problem],
    cluster: Option<&ClusterRecord>,
    repair: bool,
    _args: &RecoverArgs,
) -> Result<Option<Ending>, Failure> {
    let out = Out;
    if !repair && problems.iter().all(|p| p.tolerated) {
        // What a crash mid-append leaves: a restart copes with it, so this is a note, and
        // the report of where the run stands (what recover is for after a crash) follows.
        for p in problems {
            out.line(&format!("note: {}", p.what));
        }
        out.line("");
        return Ok(None);
    }
    out.line(&format!(
        "the run's state in {} is damaged:",
        layout.root().display()
    ));
    for (i, p) in problems.iter().enumerate() {
        out.line(&format!("  {}. {}", i + 1, p.what));
        match &p.repair {
            Some(r) => out.line(&format!("     repair: {}", r.describe(layout.root()))),
            None => out.line("     repair: none possible from the files alone (see above)"),
        }
    }
    let repairable = problems.iter().all(|p| p.repair.is_some());
    if !repair {
        out.line("");
        if repairable {
            out.line(&format!(
                "run `rl-node recover --log-path {} --repair` to make these repairs (nothing is deleted), or add --fresh to rank 0 to set the whole run aside and start a new one",
                layout.root().display()
            ));
        } else {
            out.line("some of this cannot be repaired from the files alone: add --fresh to rank 0 to set the run aside (nothing is deleted) and start a new one");
        }
        return Ok(Some(Ending::Reported(Cause::Usage)));
    }
    if !repairable {
        return Err(Failure::usage(
            "--repair: some problems cannot be repaired (see above); nothing was changed",
            None,
        ));
    }
    if let Some(c) = cluster {
        let heartbeat = c.config["timing"]["heartbeat-interval"]
            .as_str()
            .and_then(|s| humantime::parse_duration(s).ok())
            .unwrap_or(Duration::from_secs(5));
        for r in 0..c.num_nodes {
            let rec = store::fs::read_json::<RankRecord>(&layout.rank_record(c.gen, r))
                .ok()
                .flatten();
            if let Some(rec) = rec {
                let h = holder(layout, &rec, heartbeat);
                if h.starts_with("LIVE") {
                    return Err(Failure::usage(
                        format!("--repair: rank {r} is still running ({h}): stop every node first; nothing was changed"),
                        None,
                    ));
                }
            }
        }
    }
    out.line("");
    for p in problems {
        let r = p.repair.as_ref().expect("repairable");
        match super::repair::apply(&Fs, layout, r) {
            Ok(did) => out.line(&format!("repaired: {did}")),
            Err(e) => return Err(Failure::failed(format!("--repair: {e}"))),
        }
    }
    out.line("");
    Ok(None)
}

#[derive(Debug, Serialize)]
pub struct RankState {
    pub rank: u32,
    pub last_complete_iteration: u64,
    pub last_work: Option<String>,
    pub record_state: Option<NodeState>,
    pub process: String,
    /// For the resume iteration: work this rank would reuse and redo.
    pub reuse: Vec<String>,
    pub redo: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub run_id: String,
    pub gen: u64,
    pub resume_iteration: u64,
    pub training_redone_everywhere: bool,
    /// The resume iteration's training is done everywhere but failed on these ranks
    /// (`phases.train.on-failure = "keep-model"`): not redone, and nothing handed off.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub training_failures: Vec<String>,
    pub ranks: Vec<RankState>,
    pub incomplete_files: Vec<String>,
    /// The checkpoint a restart serves and trains from (`None`: the base model), as it
    /// resolves `models/LATEST` against rank 0's journal.
    pub latest_model: Option<String>,
    /// Why that is not simply what `models/LATEST` names, or why a restart would stop.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latest_warning: Option<String>,
    /// The run's planned last iteration (`--iterations`; 0: until stopped).
    pub planned_iterations: u64,
    /// Every planned iteration is complete on every rank: a restart has nothing to do.
    pub complete: bool,
}

struct Run {
    layout: Layout,
    cluster: ClusterRecord,
    journals: Vec<Vec<Entry>>,
    walk: String,
    eval_interval: u64,
}

fn load(layout: &Layout) -> Result<Run, String> {
    let cluster = super::read_cluster(layout)?;
    let layout = layout.clone().with_naming(naming_of(&cluster.config));
    let eval_interval = cluster.config["cluster"]["eval-interval"]
        .as_u64()
        .unwrap_or(1);
    let journals = (0..cluster.num_nodes)
        .map(|r| {
            crate::store::fs::read_text(&layout.journal(r), crate::store::ReadLimit::Journal)
                .map(|t| journal::parse(&t))
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e.run_id == cluster.run_id)
                .collect()
        })
        .collect();
    Ok(Run {
        layout,
        journals,
        walk: super::repair::walk_of(&cluster),
        eval_interval,
        cluster,
    })
}

/// Whether the process a record names is alive: written on this machine, ask the kernel
/// (pid and start time, so a reused pid is not taken for it); elsewhere, watch its
/// heartbeat sequence for a few heartbeat intervals.
fn holder(layout: &Layout, rec: &RankRecord, heartbeat: Duration) -> String {
    if rec.state.is_terminal() || rec.state == NodeState::Vacant {
        return format!("{:?}", rec.state).to_lowercase();
    }
    match crate::holder::local(&rec.holder()) {
        crate::holder::Local::Alive => {
            return format!("LIVE (pid {} on {})", rec.pid, rec.host);
        }
        crate::holder::Local::Gone => {
            return format!(
                "stale: pid {} on {} is gone (it was {:?})",
                rec.pid, rec.host, rec.state
            );
        }
        crate::holder::Local::Elsewhere => {}
    }
    let path = layout.rank_record(rec.gen, rec.rank);
    let deadline = Instant::now() + heartbeat * 3;
    while Instant::now() < deadline {
        std::thread::sleep(heartbeat / 4);
        if store::fs::read_json::<RankRecord>(&path)
            .ok()
            .flatten()
            .is_some_and(|r| r.seq != rec.seq)
        {
            return format!(
                "LIVE (pid {} on {}: its heartbeat advances)",
                rec.pid, rec.host
            );
        }
    }
    format!(
        "stale: pid {} on {}: heartbeat still for {:?}",
        rec.pid,
        rec.host,
        heartbeat * 3
    )
}

/// `models/LATEST` as a restart resolves it, against rank 0's journal of the run.
fn resolve_latest(run: &Run) -> Option<crate::checkpoint::Latest> {
    let rank_0 = run.journals.first().map(Vec::as_slice).unwrap_or_default();
    super::repair::resolve_latest(&run.layout, &run.cluster, rank_0)
}

/// Where the run stands; `latest` is `models/LATEST` as a restart resolves it
/// ([`resolve_latest`]).
fn report(run: &Run, latest: Option<crate::checkpoint::Latest>) -> Report {
    let l = &run.layout;
    let c = &run.cluster;
    let base = c.config["cluster"]["model"].as_str().unwrap_or_default();
    let resume = journal::resume_point(&run.journals, &c.run_id, &run.walk);
    let it = resume.iteration;
    let heartbeat = c.config["timing"]["heartbeat-interval"]
        .as_str()
        .and_then(|s| humantime::parse_duration(s).ok())
        .unwrap_or(Duration::from_secs(5));
    let eval = eval_due(it, run.eval_interval);
    let ranks = (0..c.num_nodes)
        .map(|r| {
            let j = &run.journals[r as usize];
            let rec = store::fs::read_json::<RankRecord>(&l.rank_record(c.gen, r))
                .ok()
                .flatten();
            // Only work this run has: a phase without a command does nothing to redo.
            let has = |phase: &str| {
                c.config["phases"][phase]["command"]
                    .as_str()
                    .is_some_and(|cmd| !cmd.trim().is_empty())
            };
            let (rollout, evals) = (has("rollout"), eval && has("eval"));
            let mut work = vec![];
            if rollout {
                work.push(item::ROLLOUT_TRAIN);
            }
            if evals {
                work.push(item::ROLLOUT_EVAL);
            }
            if r == 0 {
                if rollout || has("aggregate") {
                    work.push(item::AGGREGATE_TRAIN);
                }
                if has("prepare") {
                    work.push(item::PREPARE);
                }
                if evals {
                    work.push(item::AGGREGATE_EVAL);
                }
            }
            if has("train") {
                work.push(item::TRAIN);
            }
            // Training that failed (on-failure = "keep-model") and is done everywhere
            // is never handed off.
            if r == 0 && (has("train") || has("handoff")) && !resume.train_failed {
                work.push(item::HANDOFF);
            }
            let (mut reuse, mut redo) = (vec![], vec![]);
            for w in work {
                let done = if w == item::TRAIN {
                    resume.train_done
                } else {
                    journal::has(j, &c.run_id, it, w)
                };
                if done {
                    reuse.push(w.to_string());
                } else {
                    redo.push(w.to_string());
                }
            }
            RankState {
                rank: r,
                last_complete_iteration: journal::last_complete(j, &c.run_id, &run.walk),
                last_work: j.last().map(|e| {
                    format!(
                        "{} of iteration {} (generation {})",
                        e.item, e.iteration, e.gen
                    )
                }),
                record_state: rec.as_ref().map(|r| r.state),
                process: rec
                    .as_ref()
                    .map(|rec| holder(l, rec, heartbeat))
                    .unwrap_or_else(|| "no record".into()),
                reuse,
                redo,
            }
        })
        .collect();
    Report {
        run_id: c.run_id.clone(),
        gen: c.gen,
        resume_iteration: it,
        training_failures: if resume.train_failed {
            journal::train_failures(&run.journals, &c.run_id, it)
                .into_iter()
                .map(|(r, why)| format!("rank {r}: {why}"))
                .collect()
        } else {
            vec![]
        },
        training_redone_everywhere: !resume.train_done
            && c.config["phases"]["train"]["command"]
                .as_str()
                .is_some_and(|cmd| !cmd.trim().is_empty()),
        ranks,
        incomplete_files: incomplete_files(l, it),
        planned_iterations: c.config["cluster"]["iterations"].as_u64().unwrap_or(0),
        complete: {
            let planned = c.config["cluster"]["iterations"].as_u64().unwrap_or(0);
            planned > 0 && it > planned
        },
        latest_model: latest
            .as_ref()
            .and_then(|l| l.path())
            .map(|p| p.display().to_string()),
        latest_warning: latest.and_then(|l| l.stop(base).or_else(|| l.warning(base))),
    }
}

/// The run's shard names, as its nodes make them: `[aggregate]` and the eval split of the
/// configuration in its cluster record (the default names where it has none).
fn naming_of(config: &serde_json::Value) -> Naming {
    let naming = serde_json::from_value::<crate::config::Aggregate>(config["aggregate"].clone())
        .ok()
        .and_then(|a| a.naming().ok())
        .unwrap_or_default();
    let cluster = &config["cluster"];
    let every = match serde_json::from_value(cluster["rollout-split"].clone()) {
        Ok(RolloutSplit::EvalOnly) => 0,
        _ => cluster["eval-interval"].as_u64().unwrap_or(1),
    };
    naming.with_eval_split(cluster["eval-split"].as_str().unwrap_or("eval"), every)
}

/// The iterations whose files to look through: every one up to `resume` (a custom shard
/// name may place shards outside `rollouts/`) and those with a directory under
/// `rollouts/`, which the second set holds.
fn iterations_to_look_at(l: &Layout, resume: u64) -> (BTreeSet<u64>, BTreeSet<u64>) {
    let dirs: BTreeSet<u64> = std::fs::read_dir(l.root().join("rollouts"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let n: u64 = name.strip_prefix("iter-")?.parse().ok()?;
                    (iter_dir(n) == name).then_some(n)
                })
                .collect()
        })
        .unwrap_or_default();
    let all = (1..=resume).chain(dirs.iter().copied()).collect();
    (all, dirs)
}

/// Incomplete files found so far: each directory is listed once, each file reported once
/// (a name without `{iteration}` places every iteration's file in one directory).
struct Found<'l> {
    layout: &'l Layout,
    listed: BTreeMap<PathBuf, Vec<String>>,
    files: BTreeSet<PathBuf>,
    out: Vec<String>,
}

impl Found<'_> {
    /// Report each file of `dir` that `what` describes (what it is, from its name).
    fn look(&mut self, dir: Option<&Path>, what: impl Fn(&str) -> Option<String>) {
        let Some(dir) = dir else { return };
        let names = self.listed.entry(dir.to_path_buf()).or_insert_with(|| {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| e.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names
        });
        for name in names.iter() {
            let Some(what) = what(name) else { continue };
            let f = dir.join(name);
            if !self.files.insert(f.clone()) {
                continue;
            }
            let size = match std::fs::symlink_metadata(&f) {
                Ok(m) if m.is_file() => format!(" ({} bytes)", m.len()),
                _ => String::new(),
            };
            let rel = f.strip_prefix(self.layout.root()).unwrap_or(&f);
            self.out.push(format!("{}{size}: {what}", rel.display()));
        }
    }
}

/// Every file a crash (or a stop) can leave unfinished, under the names the run's layout
/// gives them: partial shards of both splits, per-task items, merges' temporary files,
/// prepared data and hand-offs. `resume` is the iteration a restart resumes at.
fn incomplete_files(l: &Layout, resume: u64) -> Vec<String> {
    let mut found = Found {
        layout: l,
        listed: BTreeMap::new(),
        files: BTreeSet::new(),
        out: vec![],
    };
    let by = |gen: Option<u64>| {
        gen.map(|g| format!(" of generation {g}"))
            .unwrap_or_default()
    };
    let (iterations, with_dir) = iterations_to_look_at(l, resume);
    for it in iterations {
        let iteration = l.root().join("rollouts").join(iter_dir(it));
        // Nothing to list under an iteration's directory that does not exist.
        let listable = |d: &Path| !d.starts_with(&iteration) || with_dir.contains(&it);
        for split in ["train", "eval"] {
            let label = l.naming().split_label(split);
            let partial = l.shard_partial(it, split, 0);
            found.look(partial.parent().filter(|d| listable(d)), |name| {
                let (rank, gen) = l.shard_partial_of(it, split, name)?;
                Some(format!(
                    "rank {rank}'s {label} rollout{} that did not finish; `rl-node aggregate --allow-missing` can merge it",
                    by(gen)
                ))
            });
            let items = l.items_dir(it, split);
            found.look(Some(items.as_path()).filter(|d| listable(d)), |name| {
                let (item, gen) = crate::layout::item_partial_of(name)?;
                Some(format!(
                    "item {item} of a per-task {label} rollout{} that did not finish; a restart runs it again",
                    by(Some(gen))
                ))
            });
            let merged = l.aggregated(it, split);
            let target = merged.file_name().unwrap_or_default().to_string_lossy();
            let shown = merged.strip_prefix(l.root()).unwrap_or(&merged).display();
            found.look(merged.parent().filter(|d| listable(d)), |name| {
                crate::layout::is_temp_of(name, &target).then(|| {
                    format!(
                        "a merge into {shown} that did not finish (delete it once no node runs)"
                    )
                })
            });
            found.look(merged.parent().filter(|d| listable(d)), |name| {
                let gen = l.aggregated_partial_of(it, split, name)?;
                Some(format!(
                    "the merge command's output for {shown}{} that was not committed; a restart merges again",
                    by(Some(gen))
                ))
            });
        }
        found.look(Some(iteration.as_path()).filter(|d| listable(d)), |name| {
            let gen = l.prepared_partial_of(it, name)?;
            Some(format!(
                "prepared data{} that did not finish; a restart prepares it again",
                by(Some(gen))
            ))
        });
    }
    let mut out = found.out;
    out.extend(incomplete_handoffs(l));
    out
}

/// Hand-offs that did not finish (`models/.iter-NNNN.gG.partial`).
fn incomplete_handoffs(l: &Layout) -> Vec<String> {
    let mut out = vec![];
    let rel = |p: &Path| p.strip_prefix(l.root()).unwrap_or(p).display().to_string();
    if let Ok(models) = std::fs::read_dir(l.models()) {
        for e in models.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if crate::checkpoint::is_partial_dir_name(&name) {
                let by = name
                    .rsplit_once(".g")
                    .and_then(|(_, g)| g.strip_suffix(".partial")?.parse::<u64>().ok())
                    .map(|g| format!(" by generation {g}"))
                    .unwrap_or_default();
                match crate::checkpoint::moved_from(&crate::store::Fs, &e.path()) {
                    // The training output itself, moved there: the next start publishes it.
                    Some(from) => out.push(format!("{}: a hand-off{by} that did not finish; it holds the checkpoint it moved out of {} (the only copy: do not delete it), which the next start of the run publishes", rel(&e.path()), from.display())),
                    None => out.push(format!("{}: a hand-off{by} that did not finish (not a checkpoint; delete it once no node of that generation runs)", rel(&e.path()))),
                }
            }
        }
    }
    out
}

fn render(r: &Report) -> String {
    let mut s = format!(
        "run {}, generation {}\nlatest model: {}\n",
        r.run_id,
        r.gen,
        r.latest_model
            .as_deref()
            .unwrap_or("(none published; cluster.model)")
    );
    if let Some(w) = &r.latest_warning {
        s.push_str(&format!("  warning: {w}\n"));
    }
    s.push('\n');
    s.push_str(&format!(
        "{:<5} {:>9}  {:<44} {}\n",
        "RANK", "COMPLETE", "LAST JOURNALED WORK", "PROCESS"
    ));
    for k in &r.ranks {
        s.push_str(&format!(
            "{:<5} {:>9}  {:<44} {}\n",
            k.rank,
            k.last_complete_iteration,
            k.last_work.as_deref().unwrap_or("-"),
            k.process
        ));
    }
    if r.complete {
        s.push_str(&format!(
            "\nthe run is complete: all {} planned iteration(s) are done on every rank; a restart with the same --iterations has nothing to do (a larger --iterations extends the run)\n",
            r.planned_iterations
        ));
        return s;
    }
    s.push_str(&format!(
        "\na restart resumes at iteration {}:\n",
        r.resume_iteration
    ));
    for k in &r.ranks {
        s.push_str(&format!(
            "  rank {}: reuses [{}], redoes [{}]\n",
            k.rank,
            k.reuse.join(", "),
            k.redo.join(", ")
        ));
    }
    if !r.training_failures.is_empty() {
        s.push_str(&format!(
            "  (training of this iteration failed ({}) and is not redone; no checkpoint is handed off, the model stays)\n",
            r.training_failures.join(", ")
        ));
    }
    if r.training_redone_everywhere {
        s.push_str("  (training is all-or-nothing: it is redone on every rank unless every rank finished it)\n");
    }
    if !r.incomplete_files.is_empty() {
        s.push_str("\nincomplete files:\n");
        for f in &r.incomplete_files {
            s.push_str(&format!("  {f}\n"));
        }
    }
    s
}

/// Move iteration `n`'s outputs under `previous-runs/` and drop its journal entries.
fn discard(store: &dyn SharedDir, run: &Run, rep: &Report, n: u64) -> Result<Vec<String>, String> {
    if let Some(live) = rep.ranks.iter().find(|k| k.process.starts_with("LIVE")) {
        return Err(format!(
            "rank {} is still running ({}): stop every node before discarding an iteration",
            live.rank, live.process
        ));
    }
    if n < rep.resume_iteration {
        return Err(format!(
            "iteration {n} is complete on every rank; only an incomplete iteration (≥ {}) can be discarded",
            rep.resume_iteration
        ));
    }
    let l = &run.layout;
    let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S").to_string();
    let dest = l.discarded(&run.cluster.run_id, n, &stamp);
    let mut moved = vec![];
    let name = iter_dir(n);
    for (what, src) in l.iteration_outputs(n) {
        if store.exists_followed(&src) {
            let to = dest.output(what, n);
            let parent = to.parent().expect("under its top directory");
            store.create_dir_all(parent).map_err(|e| e.to_string())?;
            store
                .rename(&src, &to)
                .map_err(|e| format!("moving {}: {e}", src.display()))?;
            moved.push(format!("{what}/{name}"));
        }
    }
    // A hand-off of this iteration that moved its checkpoint out of the training output
    // and did not finish: the redo would publish it instead of its own.
    let partials: Vec<String> = std::fs::read_dir(l.models())
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|f| {
                    f.starts_with(&format!(".{name}.g"))
                        && crate::checkpoint::is_partial_dir_name(f)
                })
                .collect()
        })
        .unwrap_or_default();
    for partial in partials {
        let src = l.models().join(&partial);
        store
            .create_dir_all(&dest.models())
            .map_err(|e| e.to_string())?;
        store
            .rename(&src, &dest.models().join(&partial))
            .map_err(|e| format!("moving {}: {e}", src.display()))?;
        moved.push(format!("models/{partial}"));
    }
    // LATEST must not name a checkpoint that was set aside.
    if let Some(latest) = crate::checkpoint::latest_named(&crate::store::Fs, &l.models()) {
        if !store.exists_followed(&latest) {
            let mut earlier: Vec<PathBuf> = std::fs::read_dir(l.models())
                .map(|d| d.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            earlier.retain(|p| {
                p.file_name()
                    .is_some_and(|f| f.to_string_lossy().starts_with("iter-"))
                    && crate::checkpoint::verify(p, &mut || {}).is_ok()
            });
            earlier.sort();
            let pointer = l.latest();
            match earlier.last() {
                Some(p) => {
                    let name = p
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned();
                    store
                        .publish(&pointer, format!("{name}\n").as_bytes())
                        .map_err(|e| e.to_string())?;
                    moved.push(format!("models/LATEST now names {name}"));
                }
                None => {
                    store
                        .rename(&pointer, &dest.latest())
                        .map_err(|e| e.to_string())?;
                    moved.push("models/LATEST (no earlier checkpoint: the run restarts from cluster.model)".into());
                }
            }
        }
    }
    for r in 0..run.cluster.num_nodes {
        let path = l.journal(r);
        let Ok(text) = crate::store::fs::read_text(&path, crate::store::ReadLimit::Journal) else {
            continue;
        };
        let kept: String = text
            .lines()
            .filter(|line| {
                serde_json::from_str::<Entry>(line)
                    .map(|e| e.run_id != run.cluster.run_id || e.iteration < n)
                    .unwrap_or(true)
            })
            .map(|line| format!("{line}\n"))
            .collect();
        if kept.len() != text.len() {
            let journal = dest.journal(r);
            store
                .create_dir_all(journal.parent().expect("in journal/"))
                .map_err(|e| e.to_string())?;
            store
                .publish(&journal, text.as_bytes())
                .map_err(|e| e.to_string())?;
            store
                .publish(&path, kept.as_bytes())
                .map_err(|e| e.to_string())?;
            moved.push(format!("journal entries of iteration {n}+ of rank {r}"));
        }
    }
    // The history says iterations up to some resume point were complete everywhere;
    // record that n and later were set aside, so that is not read as lost journals.
    let mark = crate::state::HistoryEntry {
        gen: 0,
        run_id: run.cluster.run_id.clone(),
        started_at: crate::clock::wall_now(),
        host: gethostname::gethostname().to_string_lossy().into_owned(),
        pid: std::process::id(),
        resume_iteration: 0,
        previous: None,
        walk: run.walk.clone(),
        discarded_from: Some(n),
    };
    let _ = crate::state::repair_tail(store, &l.history(), run.cluster.gen);
    {
        let line = format!("{}\n", serde_json::to_string(&mark).expect("json"));
        store
            .append(&l.history(), line.as_bytes(), true)
            .map_err(|e| format!("cannot write {}: {e}", l.history().display()))?;
    }
    moved.push(format!("(all in {})", dest.root().display()));
    Ok(moved)
}

pub fn main(args: RecoverArgs, log_path: Option<String>) -> Result<Ending, Failure> {
    let path = super::log_path_of("recover", log_path)?;
    let cluster: Option<&'static str> = match args.cluster.as_deref() {
        Some("rollout") => Some("rollout"),
        Some("update") => Some("update"),
        _ => None,
    };
    if cluster.is_none() && super::status::is_pipelined(&path) {
        return Err(Failure::usage(
            format!(
                "{} holds a pipelined run: name one of its clusters",
                path.display()
            ),
            Some("rl-node recover --log-path DIR --cluster rollout (or --cluster update)".into()),
        ));
    }
    if cluster.is_some() && args.discard_iteration.is_some() {
        return Err(Failure::usage(
            "--discard-iteration is refused in a pipelined run: the iteration's files are shared by both clusters, and the other may have used them",
            Some("stop both clusters and start over in a new --log-path, or set the files aside by hand".into()),
        ));
    }
    let layout = Layout::new(&path).with_cluster(cluster);
    // LATEST as the diagnosis resolved it (each checkpoint verified, with verify = "hash"
    // every file hashed), unless a repair changed the state since.
    let mut latest = None;
    if let Some(d) = super::repair::diagnose(&layout) {
        if !d.problems.is_empty() {
            if let Some(ending) =
                damaged_state(&layout, &d.problems, d.cluster.as_ref(), args.repair, &args)?
            {
                return Ok(ending);
            }
        }
        let repaired = args.repair && !d.problems.is_empty();
        if !repaired {
            latest = d.latest;
        }
    }
    let run = load(&layout).map_err(|e| Failure::usage(e.to_string(), None))?;
    let latest = latest.unwrap_or_else(|| resolve_latest(&run));
    let rep = report(&run, latest);
    if args.json {
        crate::outln!("{}", serde_json::to_string_pretty(&rep).expect("json"));
    } else {
        crate::out!("{}", render(&rep));
    }
    if let Some(n) = args.discard_iteration {
        match discard(&Fs, &run, &rep, n) {
            Ok(moved) => {
                crate::errln!("iteration {n} set aside:");
                for m in moved {
                    crate::errln!("  {m}");
                }
            }
            Err(e) => {
                return Err(Failure::usage(
                    format!("--discard-iteration {n}: {e}"),
                    None,
                ))
            }
        }
    }
    Ok(Ending::Done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// The configuration a cluster record holds, with `env` set (`RL_NODE_*` variables).
    fn recorded_config(env: &[(&str, &str)]) -> serde_json::Value {
        let lookup = |name: &str| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        };
        crate::config::load(None, &lookup, &[])
            .expect("valid configuration")
            .config
            .shared_view()
    }

    fn touch(path: &Path, bytes: &[u8]) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }

    /// A partial file of each kind the layout names, with the run's own shard names and
    /// eval split, next to committed files of the same places: each partial is listed
    /// once, under its name, and nothing committed is.
    #[test]
    fn every_incomplete_file_is_listed_under_the_name_the_layout_gives_it() {
        let dir = tempfile::tempdir().unwrap();
        let config = recorded_config(&[
            ("RL_NODE_AGGREGATE_SHARD_NAME", "out_{rank}.{ext}"),
            ("RL_NODE_CLUSTER_EVAL_SPLIT", "test"),
        ]);
        let l = Layout::new(dir.path()).with_naming(naming_of(&config));
        let partials = [
            l.shard_partial_gen(1, "train", 1, 2),
            l.shard_partial_gen(2, "eval", 0, 3),
            l.shard_partial(2, "train", 0),
            l.item_partial(2, "train", "p00003", 3, Some(1), 0),
            l.item_partial(2, "eval", "r0-00001", 3, None, 2),
            crate::layout::temp_path(&l.aggregated(2, "train"), "77-0"),
            l.aggregated_partial(2, "train", 3),
            l.prepared_partial(2, 3),
        ];
        for p in &partials {
            touch(p, b"{\"a\": 1}\n");
        }
        let committed = [
            l.shard(1, "train", 1),
            l.shard(2, "eval", 0),
            l.items_dir(2, "train").join("p00003.jsonl"),
            l.aggregated(1, "train"),
            l.prepared(1),
        ];
        for p in &committed {
            touch(p, b"{}\n");
        }
        let listed = incomplete_files(&l, 2);
        let rel = |p: &Path| p.strip_prefix(dir.path()).unwrap().display().to_string();
        assert_eq!(listed.len(), partials.len(), "{listed:#?}");
        for p in &partials {
            let name = rel(p);
            assert!(
                listed
                    .iter()
                    .any(|l| l.starts_with(&format!("{name} (9 bytes): "))),
                "{name} not in {listed:#?}"
            );
        }
        assert_eq!(
            rel(&partials[0]),
            "rollouts/iter-0001/train/out_1.partial.g2.jsonl"
        );
        let eval = listed
            .iter()
            .find(|f| f.starts_with("rollouts/iter-0002/eval/out_0.partial.g3.jsonl"))
            .unwrap();
        assert!(
            eval.ends_with(": rank 0's test rollout of generation 3 that did not finish; `rl-node aggregate --allow-missing` can merge it"),
            "{eval}"
        );
        assert!(
            listed.iter().any(|f| f.ends_with(
                ": item p00003 of a per-task train rollout of generation 3 that did not finish; a restart runs it again"
            )),
            "{listed:#?}"
        );
        assert!(
            listed.iter().any(|f| f.ends_with(
                ": a merge into rollouts/iter-0002/train.jsonl that did not finish (delete it once no node runs)"
            )),
            "{listed:#?}"
        );
        assert!(
            listed.iter().any(|f| f.ends_with(
                ": prepared data of generation 3 that did not finish; a restart prepares it again"
            )),
            "{listed:#?}"
        );
    }
}
