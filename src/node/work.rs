//! Planned rollouts: every node computes the same plan for each iteration from the task
//! files (`crate::work::plan`), rank 0 broadcasts the plan's fingerprint with the release
//! of `sync-start` and a worker whose plan differs stops, saying why. Then:
//!
//! - `per-rank` (default): the rank's share is written to a task file (`{tasks}`) and its
//!   rollout command runs once, as without planning;
//! - `per-task`: the command runs once per (task, sample), `max-workers` at a time; each
//!   item's output is committed on its own (`items/…jsonl`, by rename), so a restart redoes
//!   only unfinished items; retryable exit codes are retried with backoff and jitter;
//!   with `exact-budget` a task's samples are kept or dropped as one group (GRPO and RLOO
//!   compare them with each other), and a dropped group is replaced by another task's;
//! - `dynamic`: no split; nodes claim items from the shared directory by an exclusive
//!   create of a lease named with the generation and an attempt number. When a claimant
//!   dies (its heartbeat still for `dead-after`), the next attempt's lease can be created
//!   by anyone, so its items are finished by the others in the same iteration. A committed
//!   item is never run again; all attempts of an item write the same seed's output, and the
//!   rename makes exactly one of them the item's file. Each lease carries its holder's
//!   pace, and a node leaves the pool's last items to faster live peers when they would
//!   finish them first (`protocol::lease::take_next`, with a bounded patience). The
//!   procedure is the sans-I/O `protocol::pool::PoolMachine`; `Node::dynamic_loop` drives
//!   it here, as the simulator does over its simulated directory.

use super::{Interrupt, Node, Stop};
use crate::config::{PhaseCommand, WorkMode};
use crate::events;
use crate::layout::{committed_item, dropped_group, set_aside_item};
use crate::process::ChildExit;
use crate::protocol::commit;
use crate::protocol::fence::Site;
use crate::protocol::messages::{PlanFingerprints, Plans};
use crate::protocol::pool::{self, Exit, Lease, PoolMachine};
use crate::protocol::AbortKind;
use crate::store::SharedDir;
use crate::work::plan::{self, Item, Plan, Strategy};
use crate::work::tasks::{self, TaskFile, TaskIds};
use compact_str::CompactString;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The task files, loaded once at start: ids and line positions (see `crate::work::tasks`),
/// shared with each rollout without copying.
#[derive(Default)]
pub(super) struct TaskSets {
    pub train: Option<Arc<TaskFile>>,
    pub eval: Option<Arc<TaskFile>>,
}

impl TaskSets {
    /// Load the configured task files; a bad file is a usage error (exit 2, nothing written).
    pub fn load(cfg: &crate::config::Config) -> Result<TaskSets, Stop> {
        let load = |key: &str, path: &str| -> Result<Option<Arc<TaskFile>>, Stop> {
            if path.is_empty() {
                return Ok(None);
            }
            tasks::load_tasks(Path::new(path), &cfg.tasks.id_field)
                .map(|t| Some(Arc::new(t)))
                .map_err(|e| Stop::usage(format!("tasks.{key}: {e}"), None))
        };
        let sets = TaskSets {
            train: load("train", &cfg.tasks.train)?,
            eval: load("eval", &cfg.tasks.eval)?,
        };
        let samples = u64::from(cfg.work.samples_per_task);
        for (split, file, tasks) in [
            ("train", &cfg.tasks.train, &sets.train),
            ("eval", &cfg.tasks.eval, &sets.eval),
        ] {
            // Each node holds an iteration's plan in memory: every item of it.
            let Some(t) = tasks else { continue };
            let planned =
                budget(split, &cfg.work).map_or(t.len() as u64, |b| b.min(t.len() as u64));
            let items = planned.saturating_mul(samples);
            if items > crate::config::ranges::MAX_ITEMS {
                return Err(Stop::usage(
                    format!(
                        "tasks.{split}: {file} holds {} tasks; with work.samples-per-task = {samples} an iteration would have {items} items, above the limit of {}",
                        t.len(),
                        crate::config::ranges::MAX_ITEMS
                    ),
                    Some("set work.tasks-per-iteration (train), or use fewer samples-per-task or a smaller task file".into()),
                ));
            }
        }
        if let Some(t) = &sets.train {
            let per_iteration = cfg.work.tasks_per_iteration;
            if per_iteration as usize > t.len() {
                return Err(Stop::usage(
                    format!(
                        "work.tasks-per-iteration is {per_iteration} but {} holds only {} tasks",
                        cfg.tasks.train,
                        t.len()
                    ),
                    Some(
                        "use at most the number of tasks (0 = all), or more samples-per-task"
                            .into(),
                    ),
                ));
            }
        }
        Ok(sets)
    }

    fn get(&self, split: &str) -> Option<&Arc<TaskFile>> {
        if split == "train" {
            self.train.as_ref()
        } else {
            self.eval.as_ref()
        }
    }
}

/// The JSON line a reused item process is handed for one item (docs/work.md, "Reused item
/// processes"): the values a command of its own would have had as placeholders, the task
/// record as it is in the task file (parsed, or as a string when it is not an object).
fn item_line(name: &str, item: &Item, task_json: &str, attempt: u32, output: &Path) -> String {
    let task: Value =
        serde_json::from_str(task_json).unwrap_or_else(|_| Value::String(task_json.into()));
    json!({
        "item": name,
        "task_id": item.task.as_str(),
        "task": task,
        "sample": item.sample,
        "sample_seed": item.seed,
        "state": item.state,
        "attempt": attempt,
        "output": output.to_string_lossy(),
    })
    .to_string()
}

/// What every item of one planned rollout shares.
struct Job<'a> {
    split: &'a str,
    phase: &'a str,
    pc: &'a PhaseCommand,
    tasks: &'a TaskFile,
}

/// One running item of a per-task or dynamic rollout.
struct Running {
    pos: usize,
    attempt: u32,
    partial: PathBuf,
}

/// Counts of a planned rollout, for the summary and the heartbeat.
#[derive(Default)]
struct Tally {
    /// Items of every group taken into the rollout, dropped ones included.
    total: usize,
    /// Items committed and kept (a dropped group's are set aside, so not counted).
    committed: usize,
    failed: Vec<String>,
    retries: u32,
    /// Items committed before a restart.
    reused: usize,
    /// `exact-budget`: groups dropped, and replacement groups drawn.
    dropped: usize,
    replacements: usize,
}

/// A task's samples on this rank: the unit `exact-budget` keeps or drops whole. Its items
/// are named from its first position, so a group costs no names until it is dropped.
struct Group {
    /// The k-th replacement group, or the k-th planned one.
    replacement: bool,
    k: usize,
    /// Its first item's position (among the rank's planned items, or the replacement
    /// items) and how many it has.
    first: usize,
    len: usize,
    task: CompactString,
    dropped: bool,
}

impl Group {
    /// `r{rank}-g{k}` for a planned group, `r{rank}-xg{k}` for a replacement; its record,
    /// once dropped, is `items/<name>.dropped.json`.
    fn name(&self, rank: u32) -> String {
        match self.replacement {
            true => format!("r{rank}-xg{:05}", self.k),
            false => format!("r{rank}-g{:05}", self.k),
        }
    }

    /// Its j-th item's name: `r{rank}-{pos}`, or `r{rank}-x{pos}` for a replacement (with
    /// one sample per task, the k-th replacement is `x{k}`, as before groups).
    fn item(&self, rank: u32, j: usize) -> String {
        match self.replacement {
            true => format!("r{rank}-x{:05}", self.first + j),
            false => item_name(self.first + j, Some(rank)),
        }
    }
}

/// A static item waiting to run (or to be retried), with its group's index.
struct Queued {
    name: String,
    item: Item,
    attempt: u32,
    group: usize,
}

/// A per-task rollout's state while its items run (all of which a group's drop changes):
/// the groups taken in, the items running, queued and waiting to retry, the counts, and
/// with `exact-budget` the replacement groups not drawn yet.
struct Live<'t> {
    groups: Vec<Group>,
    running: HashMap<i32, (Queued, PathBuf)>,
    queue: VecDeque<Queued>,
    delayed: Vec<(Instant, Queued)>,
    tally: Tally,
    replacements: Option<Replacements<'t>>,
}

/// A dynamic rollout as the node drives it: the machine deciding (`protocol::pool`), and
/// what only the node knows: the processes of the attempts running here, and the items
/// that failed here with their logs.
struct Dynamic<'a> {
    job: Job<'a>,
    pool: &'a [Item],
    dir: PathBuf,
    machine: PoolMachine,
    running: HashMap<i32, Running>,
    failed: Vec<String>,
}

/// How many of `split`'s tasks an iteration plans: `work.tasks-per-iteration` for the train
/// split when it is set, else all of them (`None`).
fn budget(split: &str, w: &crate::config::Work) -> Option<u64> {
    (split == "train" && w.tasks_per_iteration > 0).then_some(w.tasks_per_iteration)
}

fn item_name(pos: usize, rank: Option<u32>) -> String {
    match rank {
        Some(r) => format!("r{r}-{pos:05}"),
        None => format!("p{pos:05}"),
    }
}

impl Node {
    /// Per-task items this node runs at once: `work.max-workers`, node-local, a number or
    /// K per GPU of this node (the count `{nproc_per_node}` has).
    pub(super) fn max_workers(&self) -> usize {
        self.cfg.work.max_workers.resolve(self.nproc_per_node) as usize
    }

    /// This iteration's plan for `split`, if tasks are configured for it.
    pub(super) fn plan_for(&self, split: &str) -> Option<Plan> {
        let tasks = self.tasks.get(split)?;
        let w = &self.cfg.work;
        Some(plan::plan(&plan::PlanInput {
            tasks: tasks.ids(),
            weights: &self.cfg.weights(),
            budget: budget(split, w),
            samples: w.samples_per_task,
            seed: w.seed,
            iteration: self.machine.iteration(),
            strategy: w.strategy,
        }))
    }

    /// The fingerprints rank 0 broadcasts with the release of `sync-start`: the plans and
    /// the task files' content (two files with the same ids plan alike but differ).
    pub(super) fn plan_fingerprints(&self) -> PlanFingerprints {
        let fp = |s: &str| self.plan_for(s).map(|p| p.fingerprint);
        let files = |s: &str| self.tasks.get(s).map(|t| t.fingerprint().to_owned());
        PlanFingerprints {
            train: fp("train"),
            eval: fp("eval"),
            train_tasks: files("train"),
            eval_tasks: files("eval"),
        }
    }

    /// A worker compares rank 0's plan fingerprints with its own, `mine`.
    pub(super) fn check_plans(
        &mut self,
        rank0: &Plans,
        mine: &PlanFingerprints,
    ) -> Result<(), Stop> {
        match rank0 {
            Plans::Unsent => return Ok(()),
            Plans::Sent(theirs) if theirs == mine => return Ok(()),
            _ => {}
        }
        let mine = serde_json::to_value(mine).expect("fingerprints are JSON");
        let reason = format!(
            "this rank's plan of iteration {} differs from rank 0's (rank 0: {}, here: {mine}): the task files (tasks.train / tasks.eval) differ between nodes",
            self.machine.iteration(),
            rank0.to_json()
        );
        Err(self.fail(AbortKind::Error, self.rank, None, reason, None))
    }

    /// Run this rank's planned rollout of `split`.
    pub(super) fn planned_rollout(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        mut plan: Plan,
    ) -> Result<(), Stop> {
        let dir = self.layout.rollout_dir(self.machine.iteration(), split);
        if let Err(e) = self
            .store
            .create_dir_all(&self.layout.tasks_dir(self.machine.iteration(), split))
        {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot create {}: {e}", dir.display()),
                None,
            ));
        }
        if self.is_master() {
            let _ = self
                .store
                .publish_json(&self.layout.plan(self.machine.iteration(), split), &plan);
        }
        if plan.strategy == Strategy::Dynamic {
            return self.dynamic_rollout(split, phase, pc, plan);
        }
        // This rank's items only: the rest of the plan (every task's items when an iteration
        // uses the whole file) is freed before the rollout runs.
        let strategy = plan.strategy;
        let items = std::mem::take(&mut plan.ranks[self.acting_rank() as usize]);
        drop(plan);
        let tasks = Arc::clone(self.tasks.get(split).expect("planned"));
        // The rank's share: the task records themselves, in plan order, once per task,
        // streamed from the task file.
        let task_file = self
            .layout
            .task_file(self.machine.iteration(), split, self.acting_rank());
        let mut task_error = None;
        let written = self.store.publish_with(&task_file, true, &mut |w| {
            let mut last = None;
            for it in &items {
                if last == Some(it.task_index) {
                    continue;
                }
                last = Some(it.task_index);
                match tasks.raw(it.task_index) {
                    Ok(raw) => {
                        w.write_all(raw.as_bytes())?;
                        w.write_all(b"\n")?;
                    }
                    Err(e) => {
                        task_error = Some(e);
                        return Err(std::io::Error::other("the task file"));
                    }
                }
            }
            Ok(())
        });
        if let Some(e) = task_error {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("tasks.{split}: {e}"),
                None,
            ));
        }
        if let Err(e) = written {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot write {}: {e}", task_file.display()),
                None,
            ));
        }
        self.extra.insert("tasks", task_file.display().to_string());
        if items.is_empty() {
            self.info(&format!(
                "iteration {}: no {split} tasks for this rank ({:?} strategy); it takes part in every barrier",
                self.machine.iteration(), strategy
            ));
            let shard = self
                .layout
                .shard(self.machine.iteration(), split, self.acting_rank());
            return self.store.publish(&shard, b"").map_err(|e| {
                self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!("cannot commit {}: {e}", shard.display()),
                    None,
                )
            });
        }
        match self.cfg.work.mode {
            WorkMode::PerRank => {
                drop(items);
                self.rollout(split, phase, pc)
            }
            WorkMode::PerTask => {
                let planned = items.len();
                let names: Vec<(usize, Item)> = items.into_iter().enumerate().collect();
                self.run_items(split, phase, pc, &tasks, names)?;
                self.commit_rank_shard(split, planned)
            }
        }
    }

    /// Where item `name`'s attempt `attempt` logged: its own log, or its worker's.
    fn item_log(&self, phase: &str, name: &str, attempt: u32) -> PathBuf {
        match self.workers.log_of(name, attempt) {
            Some(log) => log.to_path_buf(),
            None => self.layout.item_log(
                self.machine.iteration(),
                self.acting_rank(),
                phase,
                name,
                attempt,
            ),
        }
    }

    fn items_dir(&self, split: &str) -> PathBuf {
        self.layout.items_dir(self.machine.iteration(), split)
    }

    /// Concatenate this rank's `planned` committed items (plan order) and its replacements
    /// into its shard, so the aggregation and `rl-node aggregate` see per-task output like
    /// any other.
    fn commit_rank_shard(&mut self, split: &str, planned: usize) -> Result<(), Stop> {
        let dir = self.items_dir(split);
        let paths: Vec<PathBuf> = (0..planned)
            .map(|pos| committed_item(&dir, &item_name(pos, Some(self.acting_rank()))))
            .chain(self.replacements.iter().map(|n| committed_item(&dir, n)))
            .filter(|p| self.store.exists_followed(p))
            .collect();
        let shard = self
            .layout
            .shard(self.machine.iteration(), split, self.acting_rank());
        let what = format!(
            "commit its {split} shard of iteration {}",
            self.machine.iteration()
        );
        self.commit_concat(Site::ShardCommit, &paths, &shard, "shard", &what)?;
        crate::exercised::note(crate::exercised::Path::ShardCommits);
        Ok(())
    }

    /// Concatenate `paths` into a temporary file beside `out`, synced, and commit it as
    /// `out` ([`Node::commit`]: the fence, a rename that never replaces, the directory's
    /// fsync). The fence comes after the copy, right before the rename it guards. An
    /// earlier attempt's `out` (the `noun`, for the message) is set aside first. A
    /// temporary left by a failed commit is removed: it is this node's own.
    fn commit_concat(
        &mut self,
        site: Site,
        paths: &[PathBuf],
        out: &Path,
        noun: &str,
        what: &str,
    ) -> Result<(), Stop> {
        // Committed by an attempt that crashed before journaling it: kept, out of the way
        // (its content is the same items' concatenation, never lost, never merged twice).
        self.set_aside_earlier(noun, out)?;
        let tmp = crate::layout::temp_path(out, &self.nonce);
        let outcome = match concat(&*self.store, paths, &tmp) {
            Ok(()) => {
                let rules = commit::Rules {
                    site,
                    output: tmp.clone(),
                    dest: out.to_path_buf(),
                    look: false,
                    dirs: false,
                    synced: true,
                    written: commit::Written::NotLooked,
                    nothing: commit::Nothing::Refuse,
                    taken: commit::Taken::Fail,
                    journal_first: None,
                };
                self.commit(rules, what)
            }
            Err(e) => Ok(commit::Outcome::Failed {
                path: tmp.clone(),
                error: e.to_string(),
                taken: false,
            }),
        };
        if !matches!(outcome, Ok(commit::Outcome::Committed { .. })) {
            let _ = self.store.remove_file(&tmp);
        }
        let reason = match outcome? {
            commit::Outcome::Committed { .. } => return Ok(()),
            commit::Outcome::Failed { taken: true, .. } => {
                "another writer created it meanwhile (not replaced)".to_string()
            }
            commit::Outcome::Failed { error, .. } => error,
            o => unreachable!("a concatenation's commit ended {o:?}"),
        };
        Err(self.fail(
            AbortKind::Error,
            self.rank,
            None,
            format!("cannot commit {}: {reason}", out.display()),
            None,
        ))
    }

    /// Rank 0 merges a dynamic rollout's committed items in pool order.
    pub(super) fn aggregate_items(&mut self, split: &str, plan: &Plan) -> Result<(), Stop> {
        let dir = self.items_dir(split);
        let paths: Vec<PathBuf> = (0..plan.pool.len())
            .map(|pos| committed_item(&dir, &item_name(pos, None)))
            .filter(|p| self.store.exists_followed(p))
            .collect();
        let missing = plan.pool.len() - paths.len();
        if missing > 0 {
            self.warn(&format!(
                "{missing} of {} {split} items have no committed output",
                plan.pool.len()
            ));
        }
        let out = self.layout.aggregated(self.machine.iteration(), split);
        let what = format!("publish {}", out.display());
        self.commit_concat(Site::MergePublish, &paths, &out, "merged file", &what)?;
        crate::exercised::note(crate::exercised::Path::Merges);
        self.event(events::Event::Aggregate {
            split: split.to_string(),
            merged: events::Aggregated::Items {
                items: paths.len(),
                missing,
            },
        });
        Ok(())
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let base = self.cfg.work.retry_backoff.as_secs_f64() * 2f64.powi(attempt as i32);
        // Jitter in [0.5, 1.5) so retries of many items do not hit a rate limit together.
        let jitter = 0.5
            + (u64::from_str_radix(&super::random_id(&*self.clock, 2), 16).unwrap_or(0) as f64
                / 65536.0);
        let most = crate::config::ranges::MAX_RETRY_DELAY.as_secs_f64();
        Duration::from_secs_f64((base * jitter).min(most))
    }

    /// Wait until one of the items `pids` exits (`Some`), or `look_again` says there is
    /// something else to do (`None`), watching the cluster like every wait.
    fn wait_item(
        &mut self,
        deadline: Instant,
        pids: &[i32],
        mut look_again: impl FnMut() -> bool,
    ) -> Result<Option<(i32, ChildExit)>, Interrupt> {
        self.wait_for(deadline, |n| {
            if let Some(&pid) = pids.iter().find(|p| n.exited.contains_key(p)) {
                return Ok(Some(Some((pid, n.exited.remove(&pid).expect("present")))));
            }
            Ok(look_again().then_some(None))
        })
    }

    fn retryable(&self, code: i32, attempt: u32) -> bool {
        self.cfg.work.retryable_exit_codes.contains(&code) && attempt < self.cfg.work.max_retries
    }

    /// The delay before retrying an item that exited with a retryable `code`; recorded.
    fn retry_delay(&mut self, name: &str, task: &str, attempt: u32, code: i32) -> Duration {
        let wait = self.backoff(attempt);
        self.event(events::Event::Retry {
            item: name.to_string(),
            task: task.to_string(),
            attempt: attempt + 1,
            exit: code,
            delay_ms: wait.as_millis() as u64,
        });
        wait
    }

    fn item_failed(&mut self, name: &str, task: &str, exit: ChildExit) {
        self.event(events::Event::ItemFailed {
            item: name.to_string(),
            task: task.to_string(),
            exit: exit.to_string(),
        });
    }

    fn spawn_item(
        &mut self,
        job: &Job,
        item: &Item,
        name: &str,
        attempt: u32,
    ) -> Result<(i32, PathBuf), Stop> {
        let (split, phase, pc) = (job.split, job.phase, job.pc);
        // The line is read again from the task file: only its position was kept.
        let task_json = job.tasks.raw(item.task_index).map_err(|e| {
            self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("tasks.{split}: {e}"),
                None,
            )
        })?;
        // In dynamic mode a takeover or a backup may run an item while its first claimant
        // still writes: every attempt writes its own partial file.
        // Every generation writes its own too: a node of an older generation that wakes up
        // (a frozen host) never writes the file a newer generation commits.
        let dynamic = name.starts_with('p');
        let partial = self.layout.item_partial(
            self.machine.iteration(),
            split,
            name,
            self.gen(),
            dynamic.then_some(self.rank),
            attempt,
        );
        let _ = self.store.remove_file(&partial);
        if pc.reuse_processes {
            let line = item_line(name, item, &task_json, attempt, &partial);
            let ticket = self.hand_item(phase, split, &pc.command, name, attempt, line)?;
            return Ok((ticket, partial));
        }
        self.extra.insert("task_id", item.task.to_string());
        self.extra.insert("sample", item.sample.to_string());
        self.extra.insert("sample_seed", item.seed.to_string());
        self.extra.insert("state", item.state.to_string());
        self.extra.insert("task_json", task_json);
        let values = self.values(phase, Some(split), &partial);
        let command = self.cfg.template(&pc.command).render(&values);
        let env = self.command_env(&values);
        let log = self.layout.item_log(
            self.machine.iteration(),
            self.acting_rank(),
            phase,
            name,
            attempt,
        );
        let header = format!(
            "rank {} iteration {} {phase} item {name} (task {}, sample {}, attempt {})",
            self.rank,
            self.machine.iteration(),
            item.task,
            item.sample,
            attempt + 1
        );
        // The phase log says where each item's own log is.
        self.append_log(
            &self
                .layout
                .phase_log(self.machine.iteration(), self.acting_rank(), phase),
            &format!("### {header}: log {}\n", log.display()),
        );
        let running = self.spawn_supervised(
            &format!("the {phase} command"),
            &command,
            &env,
            &log,
            &header,
        )?;
        Ok((running.pid, partial))
    }

    /// Commit an item's output while this generation is current, never replacing an
    /// existing commit: when another attempt (a takeover, a backup, an older generation's
    /// node inside the fencing window) committed first, its file stays and ours is dropped.
    /// Whether ours is the item's file.
    fn commit_item(&mut self, split: &str, name: &str, partial: &Path) -> Result<bool, Stop> {
        let rules = commit::Rules {
            site: Site::Other,
            output: partial.to_path_buf(),
            dest: committed_item(&self.items_dir(split), name),
            look: true,
            dirs: false,
            synced: false,
            written: commit::Written::NotLooked,
            nothing: commit::Nothing::Empty,
            taken: commit::Taken::Yield,
            journal_first: None,
        };
        let reason = match self.commit(rules, &format!("commit item {name}"))? {
            commit::Outcome::Committed { .. } => return Ok(true),
            commit::Outcome::Lost => return Ok(false),
            commit::Outcome::Refused(commit::Refusal::NotAFile(p)) => {
                format!("{} is not a regular file", p.display())
            }
            commit::Outcome::Refused(why) => unreachable!("an item's commit refuses {why:?}"),
            commit::Outcome::Failed { error, .. } => error,
        };
        Err(self.fail(
            AbortKind::Error,
            self.rank,
            None,
            format!("cannot commit item {name}: {reason}"),
            None,
        ))
    }

    fn show_progress(&mut self, split: &str, t: &Tally) {
        let p = format!("{}/{} {split} items", t.committed, t.total);
        self.publisher().stage(|r| r.progress = Some(p.clone()));
        if progress_bar() {
            let width = 30;
            let filled = (t.committed * width).checked_div(t.total).unwrap_or(width);
            crate::output::stderr_after(
                "\r",
                format_args!(
                    "[rank {}] [{}{}] {}{}   ",
                    self.rank,
                    "#".repeat(filled),
                    ".".repeat(width - filled),
                    crate::output::escape(&p),
                    if t.failed.is_empty() {
                        String::new()
                    } else {
                        format!(", {} failed", t.failed.len())
                    }
                ),
                false,
            );
        }
    }

    /// Run this rank's static items (`names`: position and item) `max-workers` at a time;
    /// skip the ones committed before a restart; retry retryable failures. With
    /// `exact-budget` the unit is a task's group of samples: an item that fails for good
    /// drops its whole group (`drop_group`) and a replacement task's whole group runs
    /// instead. Fails the phase if too many items (groups, with `exact-budget`) failed.
    fn run_items(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        tasks: &TaskFile,
        names: Vec<(usize, Item)>,
    ) -> Result<(), Stop> {
        let job = Job {
            split,
            phase,
            pc,
            tasks,
        };
        let dir = self.items_dir(split);
        self.make_dir(&dir)?;
        self.replacements.clear();
        let mut live = Live {
            groups: vec![],
            running: HashMap::new(),
            queue: VecDeque::new(),
            delayed: vec![],
            tally: Tally::default(),
            replacements: None,
        };
        self.enter_planned_groups(&dir, names, &mut live)?;
        // Groups dropped before a restart are replaced again, by the same tasks: the k-th
        // drop always takes the k-th candidate, and a replacement committed then is reused.
        live.replacements = self.replacement_pool(split, tasks.ids());
        let owed = live.tally.dropped;
        self.draw_replacements(owed, &dir, &mut live)?;
        if live.tally.reused > 0 {
            self.info(&format!(
                "iteration {}: {} {split} item(s) committed before the restart are reused",
                self.machine.iteration(),
                live.tally.reused
            ));
        }
        if live.tally.dropped > 0 {
            self.info(&format!(
                "iteration {}: {} {split} group(s) dropped before the restart stay dropped (exact-budget)",
                self.machine.iteration(), live.tally.dropped
            ));
        }
        let deadline = self.clock.now() + pc.timeout;
        let started = self.clock.now();
        self.watch_items(phase, pc.timeout, started);
        self.run_static_loop(&job, &dir, deadline, &mut live)?;
        self.finish_workers()?;
        self.unwatch_wait();
        if progress_bar() {
            crate::errln!();
        }
        self.waiting.note.clear();
        self.report_static(split, started, &live);
        self.static_verdict(split, phase, &live)
    }

    /// Take this rank's planned items into the rollout, each task's samples as one group.
    fn enter_planned_groups(
        &mut self,
        dir: &Path,
        names: Vec<(usize, Item)>,
        live: &mut Live,
    ) -> Result<(), Stop> {
        // Every sample of a task is consecutive in a rank's items (the plan's invariant): a
        // group starts at each sample 0, or where the task changes.
        let starts: Vec<usize> = (0..names.len())
            .filter(|&i| {
                i == 0
                    || names[i].1.sample == 0
                    || names[i].1.task_index != names[i - 1].1.task_index
            })
            .collect();
        let count = names.len();
        let mut names = names.into_iter();
        for (k, &start) in starts.iter().enumerate() {
            let end = starts.get(k + 1).copied().unwrap_or(count);
            let items: Vec<(usize, Item)> = names.by_ref().take(end - start).collect();
            let group = Group {
                replacement: false,
                k,
                first: items[0].0,
                len: items.len(),
                task: items[0].1.task.clone(),
                dropped: false,
            };
            let items = items.into_iter().map(|(_, item)| item).collect();
            self.enter_group(dir, group, items, live)?;
        }
        Ok(())
    }

    /// Start queued items (and retries whose backoff has passed) `max-workers` at a time
    /// and handle each exit, until nothing runs, is queued or waits to retry.
    fn run_static_loop(
        &mut self,
        job: &Job,
        dir: &Path,
        deadline: Instant,
        live: &mut Live,
    ) -> Result<(), Stop> {
        let (split, phase) = (job.split, job.phase);
        loop {
            let now = self.clock.now();
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut live.delayed)
                .into_iter()
                .partition(|(at, _)| *at <= now);
            live.delayed = later;
            live.queue.extend(due.into_iter().map(|(_, q)| q));
            while live.running.len() < self.max_workers() {
                let Some(q) = live.queue.pop_front() else {
                    break;
                };
                let (pid, partial) = self.spawn_item(job, &q.item, &q.name, q.attempt)?;
                live.running.insert(pid, (q, partial));
            }
            self.show_progress(split, &live.tally);
            if live.running.is_empty() && live.queue.is_empty() && live.delayed.is_empty() {
                return Ok(());
            }
            let next_retry = live.delayed.iter().map(|d| d.0).min();
            self.waiting.note = format!(
                "{} {split} item(s) running, {} queued, {} waiting to retry",
                live.running.len(),
                live.queue.len(),
                live.delayed.len()
            );
            let pids: Vec<i32> = live.running.keys().copied().collect();
            let clock = self.clock.clone();
            let waited = self.wait_item(deadline, &pids, || {
                next_retry.is_some_and(|t| clock.now() >= t)
            });
            let (pid, exit) = match waited {
                Ok(Some(x)) => x,
                Ok(None) => continue,
                Err(Interrupt::Stop(s)) => return Err(s),
                Err(Interrupt::Deadline) => {
                    return Err(self.fail(
                        AbortKind::Timeout,
                        self.rank,
                        None,
                        format!(
                        "the {phase} items did not finish within phases.{phase}.timeout ({}): {}",
                        humantime::format_duration(job.pc.timeout),
                        self.waiting.note
                    ),
                        Some(&self.layout.phase_log(
                            self.machine.iteration(),
                            self.acting_rank(),
                            phase,
                        )),
                    ))
                }
            };
            self.static_exit(job, dir, live, pid, exit)?;
        }
    }

    /// Item `pid` exited: commit its output, queue its retry after a backoff, or count it
    /// failed for good (with `exact-budget`, dropping its group for a replacement).
    fn static_exit(
        &mut self,
        job: &Job,
        dir: &Path,
        live: &mut Live,
        pid: i32,
        exit: ChildExit,
    ) -> Result<(), Stop> {
        let (q, partial) = live.running.remove(&pid).expect("ours");
        self.item_ended(pid);
        match exit {
            ChildExit::Success => {
                self.commit_item(job.split, &q.name, &partial)?;
                live.tally.committed += 1;
            }
            ChildExit::Exit(code) if self.retryable(code, q.attempt) => {
                let wait = self.retry_delay(&q.name, &q.item.task, q.attempt, code);
                live.tally.retries += 1;
                let at = self.clock.now() + wait;
                live.delayed.push((
                    at,
                    Queued {
                        attempt: q.attempt + 1,
                        ..q
                    },
                ));
            }
            other => {
                let failure = format!(
                    "{} (task {}, sample {}): {other}, log {}",
                    q.name,
                    q.item.task,
                    q.item.sample,
                    self.item_log(job.phase, &q.name, q.attempt).display()
                );
                live.tally.failed.push(failure.clone());
                self.item_failed(&q.name, &q.item.task, other);
                if self.cfg.work.exact_budget {
                    self.drop_group(job.phase, dir, q.group, &failure, live)?;
                    self.draw_replacements(1, dir, live)?;
                }
            }
        }
        Ok(())
    }

    /// The per-task rollout's summary: a log line and the `items` event.
    fn report_static(&mut self, split: &str, started: Instant, live: &Live) {
        let (tally, groups) = (&live.tally, &live.groups);
        let exact = self.cfg.work.exact_budget;
        let failed = tally.failed.len();
        let planned_groups = groups.iter().filter(|g| !g.replacement).count();
        let complete = groups.iter().filter(|g| !g.dropped).count();
        let budget = if exact {
            format!(
                "; exact-budget: {complete} complete group(s) for {planned_groups} planned, {} dropped, {} replacement(s){}",
                tally.dropped,
                tally.replacements,
                if complete < planned_groups {
                    format!(" ({complete} of the planned {planned_groups} groups collected; no more replacement tasks)")
                } else {
                    String::new()
                }
            )
        } else {
            String::new()
        };
        self.info(&format!(
            "iteration {}: {split} items: {}/{} committed, {failed} failed, {} retries, in {:.2}s{budget}",
            self.machine.iteration(),
            tally.committed,
            tally.total,
            tally.retries,
            self.clock.elapsed(started).as_secs_f64(),
        ));
        self.event(events::Event::Items {
            split: split.to_string(),
            total: tally.total,
            committed: tally.committed,
            failed,
            mode: events::ItemsMode::Static {
                retries: tally.retries,
                groups: exact.then_some(events::Groups {
                    planned: planned_groups,
                    complete,
                    dropped: tally.dropped,
                    replacements: tally.replacements,
                }),
            },
        });
    }

    /// Fail the phase if more items (groups, with `exact-budget`) failed than
    /// `work.max-failed-fraction` allows.
    fn static_verdict(&mut self, split: &str, phase: &str, live: &Live) -> Result<(), Stop> {
        let tally = &live.tally;
        let failed = tally.failed.len();
        // With exact-budget a failure costs its whole group: count groups.
        let (lost, of, unit) = if self.cfg.work.exact_budget {
            (tally.dropped, live.groups.len(), "groups (an item failed)")
        } else {
            (failed, tally.total, "items failed")
        };
        let fraction = lost as f64 / of.max(1) as f64;
        if lost > 0 && fraction > self.cfg.work.max_failed_fraction {
            return Err(self.fail(
                AbortKind::CommandFailed {
                    exit: "item failures".into(),
                },
                self.rank,
                None,
                format!(
                    "{lost} of {of} {split} {unit}, more than work.max-failed-fraction ({}): {}",
                    self.cfg.work.max_failed_fraction,
                    tally
                        .failed
                        .iter()
                        .take(3)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
                Some(
                    &self
                        .layout
                        .phase_log(self.machine.iteration(), self.acting_rank(), phase),
                ),
            ));
        }
        Ok(())
    }

    /// Take a group into the rollout. With `exact-budget` a group dropped before a restart
    /// stays dropped (its record says so, and a set-aside the crash interrupted is
    /// finished); otherwise its items committed before a restart are reused and the others
    /// queued.
    fn enter_group(
        &mut self,
        dir: &Path,
        group: Group,
        items: Vec<Item>,
        live: &mut Live,
    ) -> Result<(), Stop> {
        let Live {
            groups,
            queue,
            tally,
            ..
        } = live;
        let gi = groups.len();
        tally.total += group.len;
        if self.cfg.work.exact_budget {
            let record = dropped_group(dir, &group.name(self.acting_rank()));
            if self.store.exists(&record) {
                let why = self
                    .store
                    .read_json::<Value>(&record)
                    .ok()
                    .flatten()
                    .and_then(|v| v["failed"].as_str().map(str::to_string))
                    .unwrap_or_else(|| record.display().to_string());
                tally.failed.push(format!("{why} (before the restart)"));
                tally.dropped += 1;
                self.set_aside(dir, &group)?;
                groups.push(Group {
                    dropped: true,
                    ..group
                });
                return Ok(());
            }
        }
        for (j, item) in items.into_iter().enumerate() {
            let name = group.item(self.acting_rank(), j);
            if self.store.exists_followed(&committed_item(dir, &name)) {
                tally.committed += 1;
                tally.reused += 1;
            } else {
                queue.push_back(Queued {
                    name,
                    item,
                    attempt: 0,
                    group: gi,
                });
            }
        }
        groups.push(group);
        Ok(())
    }

    /// Draw `owed` replacement groups from the pool, and one more for each that was
    /// dropped before a restart; when the pool runs out the budget stays short.
    fn draw_replacements(
        &mut self,
        mut owed: usize,
        dir: &Path,
        live: &mut Live,
    ) -> Result<(), Stop> {
        while owed > 0 {
            let Some((k, items)) = live.replacements.as_mut().and_then(Iterator::next) else {
                return Ok(());
            };
            owed -= 1;
            let group = Group {
                replacement: true,
                k,
                first: k * items.len(),
                len: items.len(),
                task: items[0].task.clone(),
                dropped: false,
            };
            let me = self.acting_rank();
            self.replacements
                .extend((0..group.len).map(|j| group.item(me, j)));
            live.tally.replacements += 1;
            let before = live.tally.dropped;
            self.enter_group(dir, group, items, live)?;
            owed += live.tally.dropped - before;
        }
        Ok(())
    }

    /// `exact-budget`: an item of group `gi` failed for good, so the whole group leaves the
    /// iteration (GRPO and RLOO compare a task's samples with each other; a group missing a
    /// sample is not one). The decision is recorded first, durably
    /// (`<group>.dropped.json`), so a restart keeps it; then the group's running samples are
    /// stopped (their output would be set aside anyway), its queued ones forgotten, and its
    /// committed ones set aside (`<item>.jsonl.dropped`: kept, never merged).
    fn drop_group(
        &mut self,
        phase: &str,
        dir: &Path,
        gi: usize,
        failure: &str,
        live: &mut Live,
    ) -> Result<(), Stop> {
        let name = live.groups[gi].name(self.acting_rank());
        let task = live.groups[gi].task.clone();
        self.fence(&format!("drop the group {name}"))?;
        let record = dropped_group(dir, &name);
        let items: Vec<String> = (0..live.groups[gi].len)
            .map(|j| live.groups[gi].item(self.acting_rank(), j))
            .collect();
        let rec =
            json!({"task": task.as_str(), "items": items, "failed": failure, "gen": self.gen()});
        if let Err(e) = self.store.create_new_json(&record, &rec) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot record {}: {e}", record.display()),
                None,
            ));
        }
        live.groups[gi].dropped = true;
        let siblings: Vec<i32> = live
            .running
            .iter()
            .filter(|(_, (q, _))| q.group == gi)
            .map(|(pid, _)| *pid)
            .collect();
        // All at once: siblings that ignore SIGTERM cost one kill-grace together.
        self.stop_items(&siblings);
        for pid in &siblings {
            let (q, _) = live.running.remove(pid).expect("listed");
            self.append_log(
                &self.item_log(phase, &q.name, q.attempt),
                &format!("### rl-node: stopped: {failure} failed for good, so task {task}'s group {name} is dropped (exact-budget)\n"),
            );
        }
        live.queue.retain(|q| q.group != gi);
        live.delayed.retain(|(_, q)| q.group != gi);
        let set_aside = self.set_aside(dir, &live.groups[gi])?;
        live.tally.committed -= set_aside;
        live.tally.dropped += 1;
        self.info(&format!(
            "iteration {}: task {task}'s group {name} is dropped (exact-budget: its samples are used together or not at all): {} committed sample(s) set aside as <item>.jsonl.dropped, {} running one(s) stopped",
            self.machine.iteration(),
            set_aside,
            siblings.len()
        ));
        Ok(())
    }

    /// While the items of `phase` run (until [`Node::unwatch_wait`] after their loop): a
    /// hang report when they overrun hang-report-at of the phase's `timeout`.
    fn watch_items(&mut self, phase: &str, timeout: Duration, started: Instant) {
        self.watch_wait(
            format!(
                "the {phase} items of iteration {}",
                self.machine.iteration()
            ),
            format!("phases.{phase}.timeout"),
            timeout,
            started,
        );
    }

    /// Rename a dropped group's committed items to `<item>.jsonl.dropped`, so no shard
    /// includes them and they stay for inspection. Returns how many there were.
    ///
    /// Fenced here, immediately before the renames: the items directory is shared by
    /// every generation, and a node that paused since its last check (in `drop_group`,
    /// during the kill-grace wait for the group's running samples) must not rename items
    /// a newer generation committed.
    fn set_aside(&mut self, dir: &Path, group: &Group) -> Result<usize, Stop> {
        self.fence(&format!(
            "set aside the group {}'s items",
            group.name(self.acting_rank())
        ))?;
        let mut moved = 0;
        for j in 0..group.len {
            let name = group.item(self.acting_rank(), j);
            let done = committed_item(dir, &name);
            if !self.store.exists_followed(&done) {
                continue;
            }
            let aside = set_aside_item(dir, &name);
            if let Err(e) = self.store.rename_noreplace(&done, &aside) {
                return Err(self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!(
                        "cannot set {} aside as {}: {e}",
                        done.display(),
                        aside.display()
                    ),
                    None,
                ));
            }
            moved += 1;
        }
        if moved > 0 {
            let _ = self.store.fsync_dir(dir);
        }
        Ok(moved)
    }

    /// Tasks outside this iteration's plan that this rank may use to replace failed groups
    /// (`exact-budget`), if any: disjoint between ranks (task index mod ranks),
    /// deterministic.
    fn replacement_pool<'t>(&self, split: &str, ids: &'t TaskIds) -> Option<Replacements<'t>> {
        if !self.cfg.work.exact_budget {
            return None;
        }
        let plan = self.plan_for(split)?;
        let mut used = vec![false; ids.len()];
        for item in plan.ranks.iter().flatten() {
            used[item.task_index] = true;
        }
        Some(Replacements {
            ids,
            used,
            next: self.acting_rank() as usize,
            step: self.num_nodes() as usize,
            drawn: 0,
            samples: self.cfg.work.samples_per_task,
            seed: self.cfg.work.seed,
            iteration: self.machine.iteration(),
        })
    }

    // ------------------------------------------------------------------ dynamic leases

    fn lease(&self, split: &str, pos: usize, attempt: u32) -> PathBuf {
        self.layout.lease(
            self.machine.iteration(),
            split,
            &item_name(pos, None),
            self.gen(),
            attempt,
        )
    }

    /// Try to claim item `pos` with `lease`: an exclusive create, first writer wins. The
    /// lease carries this node's pace, which the peers walking past it use in the end
    /// game (`lease::take_next`).
    fn claim(&mut self, split: &str, pos: usize, lease: &Lease) -> Result<bool, Stop> {
        let path = self.lease(split, pos, lease.attempt);
        // No fsync: a lease is a live record (docs/shared-directory.md, "Durability").
        match self.store.create_new_live_json(&path, lease) {
            Ok(won) => Ok(won),
            Err(e) => Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot create lease {}: {e}", path.display()),
                None,
            )),
        }
    }

    /// Marks an item that failed for good (not retryable), so nobody waits for it.
    fn failed_marker(&self, split: &str, pos: usize) -> PathBuf {
        self.layout.failed_item(
            self.machine.iteration(),
            split,
            &item_name(pos, None),
            self.gen(),
        )
    }

    /// Item `pos`'s lease of `attempt` in this generation, if it exists and is readable
    /// (whatever it holds: a malformed one reads with the fallbacks of [`Lease`]).
    fn read_lease(&self, split: &str, pos: usize, attempt: u32) -> Option<Lease> {
        self.store
            .read_json::<Lease>(&self.lease(split, pos, attempt))
            .ok()
            .flatten()
    }

    /// The leases of item `pos` in this generation, attempt 0 first, up to the first
    /// missing or unreadable one.
    fn leases_of(&self, split: &str, pos: usize) -> Vec<Lease> {
        (0..)
            .map_while(|attempt| self.read_lease(split, pos, attempt))
            .collect()
    }

    /// Marks one attempt of an item over: it failed (docs/work.md, "Dynamic leases").
    fn failed_attempt_marker(&self, split: &str, pos: usize, attempt: u32) -> PathBuf {
        self.layout.failed_attempt(
            self.machine.iteration(),
            split,
            &item_name(pos, None),
            self.gen(),
            attempt,
        )
    }

    /// Read every peer's record and judge it with the node's machine (its one liveness
    /// judgement): the ranks dead now.
    fn observe_all_peers(&mut self) -> BTreeSet<u32> {
        let gen = self.gen();
        let reads: Vec<_> = (0..self.num_nodes())
            .filter(|&r| r != self.rank)
            .map(|r| {
                let (read, at) = super::stamped(&*self.clock, || {
                    self.read_record(gen, r).map(|rec| (rec.seq, rec.state))
                });
                (r, read, at)
            })
            .collect();
        self.machine.judge_peers(reads).clone()
    }

    fn dynamic_rollout(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        plan: Plan,
    ) -> Result<(), Stop> {
        let dir = self.items_dir(split);
        for d in [
            dir.clone(),
            self.layout.leases_dir(self.machine.iteration(), split),
        ] {
            self.make_dir(&d)?;
        }
        let tasks = Arc::clone(self.tasks.get(split).expect("planned"));
        let pool = plan.pool;
        // A peer dying now does not stop the cluster: its items are taken over. The next
        // barrier still notices it.
        self.machine.watch.tolerate_dead = true;
        let result = self.dynamic_loop(split, phase, pc, &tasks, &pool);
        self.machine.watch.tolerate_dead = false;
        result
    }

    /// Drive the pool's machine (`protocol::pool`) until every item is committed or
    /// failed for good here or elsewhere, then write this rank's shard: a round at a
    /// time, and between rounds a wait for an attempt to exit or for a change the
    /// machine looks at.
    fn dynamic_loop(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        tasks: &TaskFile,
        pool: &[Item],
    ) -> Result<(), Stop> {
        let machine = PoolMachine::new(pool::Settings {
            rank: self.rank,
            num_nodes: self.num_nodes(),
            gen: self.gen(),
            nonce: self.nonce.clone(),
            items: pool.len(),
            workers: self.max_workers() as u32,
            poll_interval: self.cfg.timing.poll_interval,
        });
        let mut d = Dynamic {
            job: Job {
                split,
                phase,
                pc,
                tasks,
            },
            pool,
            dir: self.items_dir(split),
            machine,
            running: HashMap::new(),
            failed: vec![],
        };
        let deadline = self.clock.now() + pc.timeout;
        let started = self.clock.now();
        self.watch_items(phase, pc.timeout, started);
        loop {
            d.machine.tick(self.clock.since_start());
            self.drive_pool(&mut d)?;
            let done = (0..pool.len())
                .filter(|&p| self.pool_item_committed(&d.dir, p))
                .count();
            self.show_progress(
                split,
                &Tally {
                    total: pool.len(),
                    committed: done,
                    failed: d.failed.clone(),
                    ..Tally::default()
                },
            );
            if d.machine.finished() {
                break;
            }
            self.waiting.note = format!(
                "{} {split} item(s) running here, {} held by other ranks",
                d.machine.running(),
                d.machine.awaited()
            );
            let (pid, exit) = match self.wait_dynamic(&d, deadline) {
                Ok(Some(x)) => x,
                Ok(None) => continue,
                Err(Interrupt::Stop(s)) => return Err(s),
                Err(Interrupt::Deadline) => {
                    return Err(self.fail(
                        AbortKind::Timeout,
                        self.rank,
                        None,
                        format!(
                            "the dynamic {phase} did not finish within its timeout: {}",
                            self.waiting.note
                        ),
                        None,
                    ));
                }
            };
            self.dynamic_exit(&mut d, pid, exit);
            self.drive_pool(&mut d)?;
        }
        self.finish_workers()?;
        self.unwatch_wait();
        self.waiting.note.clear();
        self.report_dynamic(&d, started);
        self.commit_dynamic_shard(&d)?;
        self.dynamic_verdict(&d)
    }

    /// Perform the pool machine's effects on the shared directory and the launcher,
    /// handing each question's answer back at once, until it asks nothing more.
    fn drive_pool(&mut self, d: &mut Dynamic) -> Result<(), Stop> {
        use pool::{Effect, Input, Note};
        let split = d.job.split;
        while let Some(effect) = d.machine.poll_effect() {
            let answer = match effect {
                Effect::ReadFirstLease(pos) => Input::FirstLease(self.read_lease(split, pos, 0)),
                Effect::ReadLeases(pos) => Input::Leases(self.leases_of(split, pos)),
                Effect::LookCommitted(pos) => {
                    Input::Committed(self.pool_item_committed(&d.dir, pos))
                }
                Effect::LookFailed(pos) => {
                    Input::Failed(self.store.exists_followed(&self.failed_marker(split, pos)))
                }
                Effect::LookAttemptFailed { pos, attempt } => Input::AttemptFailed(
                    self.store
                        .exists_followed(&self.failed_attempt_marker(split, pos, attempt)),
                ),
                Effect::JudgePeers => Input::Peers(self.observe_all_peers()),
                Effect::CreateLease { pos, lease, .. } => {
                    Input::LeaseCreated(self.claim(split, pos, &lease)?)
                }
                Effect::Commit { pos, attempt } => {
                    let partial = self.pool_partial(split, pos, attempt);
                    Input::CommitDone(self.commit_item(split, &item_name(pos, None), &partial)?)
                }
                Effect::Start { pos, attempt } => {
                    let (pid, partial) =
                        self.spawn_item(&d.job, &d.pool[pos], &item_name(pos, None), attempt)?;
                    d.running.insert(
                        pid,
                        Running {
                            pos,
                            attempt,
                            partial,
                        },
                    );
                    continue;
                }
                Effect::Stop { pos, attempt } => {
                    let found = d
                        .running
                        .iter()
                        .find(|(_, r)| (r.pos, r.attempt) == (pos, attempt))
                        .map(|(pid, _)| *pid);
                    let pid = found.expect("the machine stops an attempt of ours");
                    let r = d.running.remove(&pid).expect("found");
                    self.stop_items(&[pid]);
                    let _ = self.store.remove_file(&r.partial);
                    continue;
                }
                Effect::Discard { pos, attempt } => {
                    // Another attempt (a takeover or a backup) committed first: one file.
                    let _ = self
                        .store
                        .remove_file(&self.pool_partial(split, pos, attempt));
                    continue;
                }
                Effect::MarkAttemptFailed { pos, attempt, why } => {
                    self.pool_attempt_failed(d, pos, attempt, &why);
                    continue;
                }
                Effect::MarkFailed { pos, attempt, why } => {
                    Input::MarkedFailed(self.pool_item_failed(d, pos, attempt, &why))
                }
                Effect::Note(Note::Backup { pos, holder }) => {
                    self.event(events::Event::Backup {
                        item: item_name(pos, None),
                        holder,
                    });
                    continue;
                }
                Effect::Note(Note::TakeOver { pos, .. }) => {
                    self.info(&format!(
                        "iteration {}: taking over item {} (its claimant is dead)",
                        self.machine.iteration(),
                        item_name(pos, None)
                    ));
                    continue;
                }
                Effect::Note(Note::Left { .. }) => continue,
            };
            d.machine.handle(self.clock.since_start(), answer);
        }
        Ok(())
    }

    /// Whether the pool's item `pos` is committed (by any rank, any attempt).
    fn pool_item_committed(&self, dir: &Path, pos: usize) -> bool {
        self.store
            .exists_followed(&committed_item(dir, &item_name(pos, None)))
    }

    /// Where this node's attempt of the pool's item `pos` writes (as `spawn_item` names
    /// it: every attempt and generation its own file).
    fn pool_partial(&self, split: &str, pos: usize, attempt: u32) -> PathBuf {
        self.layout.item_partial(
            self.machine.iteration(),
            split,
            &item_name(pos, None),
            self.gen(),
            Some(self.rank),
            attempt,
        )
    }

    /// This node's attempt of item `pos` failed for good: marked, so that the item fails
    /// only once every attempt has (a backup's failure leaves the first attempt running).
    fn pool_attempt_failed(&mut self, d: &Dynamic, pos: usize, attempt: u32, why: &str) {
        let name = item_name(pos, None);
        let marker = self.failed_attempt_marker(d.job.split, pos, attempt);
        let _ = self.store.create_new(&marker, why.as_bytes());
        self.info(&format!(
            "iteration {}: attempt {attempt} of item {name} (task {}) failed ({why}), log {}; the item fails only if no other attempt commits it",
            self.machine.iteration(),
            d.pool[pos].task,
            self.item_log(d.job.phase, &name, attempt).display()
        ));
    }

    /// Every attempt of item `pos` is over without a commit: marked failed for good so
    /// that nobody waits for it, and, when this node's create of the marker won, counted
    /// here (one node counts each item). An error creating it counts too.
    fn pool_item_failed(
        &mut self,
        d: &mut Dynamic,
        pos: usize,
        attempt: Option<u32>,
        why: &str,
    ) -> bool {
        let marker = self.failed_marker(d.job.split, pos);
        if matches!(self.store.create_new(&marker, why.as_bytes()), Ok(false)) {
            return false;
        }
        let name = item_name(pos, None);
        let task = &d.pool[pos].task;
        let log = match attempt {
            Some(a) => format!(", log {}", self.item_log(d.job.phase, &name, a).display()),
            None => String::new(),
        };
        d.failed.push(format!("{name} (task {task}): {why}{log}"));
        self.event(events::Event::ItemFailed {
            item: name,
            task: task.to_string(),
            exit: why.to_string(),
        });
        true
    }

    /// Wait until one of this node's attempts exits (`Some`), or there is something else
    /// to look at (`None`): the machine's next timeout, or a change it looks at (an
    /// awaited item committed or marked failed, an item running here committed elsewhere,
    /// the left item claimed: [`PoolMachine::looks`]).
    fn wait_dynamic(
        &mut self,
        d: &Dynamic,
        deadline: Instant,
    ) -> Result<Option<(i32, ChildExit)>, Interrupt> {
        let split = d.job.split;
        let pids: Vec<i32> = d.running.keys().copied().collect();
        let (now, since_start) = (self.clock.now(), self.clock.since_start());
        let poll_until = d
            .machine
            .poll_timeout()
            .map_or(deadline, |t| now + t.saturating_sub(since_start))
            .min(deadline);
        let looks = d.machine.looks();
        let leaving = looks.leaving.map(|pos| self.lease(split, pos, 0));
        let item = |pos| committed_item(&d.dir, &item_name(pos, None));
        let settle: Vec<(PathBuf, PathBuf)> = looks
            .settle
            .into_iter()
            .map(|pos| (item(pos), self.failed_marker(split, pos)))
            .collect();
        let superseding: Vec<PathBuf> = looks.superseding.into_iter().map(item).collect();
        let clock = self.clock.clone();
        let store = Arc::clone(&self.store);
        self.wait_item(deadline, &pids, || {
            let settled = settle
                .iter()
                .any(|(done, failed)| store.exists_followed(done) || store.exists_followed(failed));
            let superseded = superseding.iter().any(|done| store.exists_followed(done));
            let taken = leaving.as_ref().is_some_and(|l| store.exists_followed(l));
            clock.now() >= poll_until || settled || superseded || taken
        })
    }

    /// Attempt `pid` exited: judged (a retryable exit waits for its backoff) and handed to
    /// the machine.
    fn dynamic_exit(&mut self, d: &mut Dynamic, pid: i32, exit: ChildExit) {
        let r = d.running.remove(&pid).expect("ours");
        self.item_ended(pid);
        let exit = match exit {
            ChildExit::Success => Exit::Success,
            ChildExit::Exit(code) if self.retryable(code, r.attempt) => {
                let name = item_name(r.pos, None);
                let task = d.pool[r.pos].task.clone();
                Exit::Retry {
                    after: self.retry_delay(&name, &task, r.attempt, code),
                }
            }
            other => Exit::Failed {
                why: other.to_string(),
            },
        };
        let input = pool::Input::Exited {
            pos: r.pos,
            attempt: r.attempt,
            exit,
        };
        d.machine.handle(self.clock.since_start(), input);
    }

    /// The dynamic rollout's summary: a log line and the `items` event.
    fn report_dynamic(&mut self, d: &Dynamic, started: Instant) {
        let (split, pool, failed) = (d.job.split, d.pool, &d.failed);
        let stats = d.machine.stats();
        self.info(&format!(
            "iteration {}: dynamic {split}: this rank committed {} of {} items in {:.2}s ({} backup attempt(s), {} left to faster ranks){}",
            self.machine.iteration(),
            stats.mine,
            pool.len(),
            self.clock.elapsed(started).as_secs_f64(),
            stats.backups,
            stats.left,
            // An item one of these attempts belonged to may have been committed by another
            // attempt, or found failed and counted by another node.
            match (stats.failed_attempts, failed.len()) {
                (0, 0) => String::new(),
                (a, f) => format!(
                    ", {a} attempt(s) failed here, {f} item(s) failed for good counted here"
                ),
            }
        ));
        self.event(events::Event::Items {
            split: split.to_string(),
            total: pool.len(),
            committed: stats.mine,
            failed: failed.len(),
            mode: events::ItemsMode::Dynamic {
                backups: stats.backups,
                dynamic: true,
            },
        });
    }

    /// A shard per rank (items whose position mod ranks is this rank, whoever ran them),
    /// so an aggregate command and `rl-node aggregate` see rank shards as usual.
    fn commit_dynamic_shard(&mut self, d: &Dynamic) -> Result<(), Stop> {
        let n = self.num_nodes() as usize;
        let paths: Vec<PathBuf> = (0..d.pool.len())
            .filter(|pos| pos % n == self.rank as usize)
            .map(|pos| committed_item(&d.dir, &item_name(pos, None)))
            .filter(|p| self.store.exists_followed(p))
            .collect();
        let shard = self
            .layout
            .shard(self.machine.iteration(), d.job.split, self.rank);
        let what = format!(
            "commit its {} shard of iteration {}",
            d.job.split,
            self.machine.iteration()
        );
        self.commit_concat(Site::ShardCommit, &paths, &shard, "shard", &what)
    }

    /// Fail the phase if more of the pool's items failed here than
    /// `work.max-failed-fraction` allows.
    fn dynamic_verdict(&mut self, d: &Dynamic) -> Result<(), Stop> {
        let (split, failed) = (d.job.split, &d.failed);
        let fraction = failed.len() as f64 / d.pool.len().max(1) as f64;
        if !failed.is_empty() && fraction > self.cfg.work.max_failed_fraction {
            return Err(self.fail(
                AbortKind::CommandFailed {
                    exit: "item failures".into(),
                },
                self.rank,
                None,
                format!(
                    "{} {split} items failed here, more than work.max-failed-fraction: {}",
                    failed.len(),
                    failed
                        .iter()
                        .take(3)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
                Some(
                    &self
                        .layout
                        .phase_log(self.machine.iteration(), self.rank, d.job.phase),
                ),
            ));
        }
        Ok(())
    }
}

/// This rank's replacement groups, in task order, drawn one at a time as groups are
/// dropped: a million-task file costs a flag per task here, not an item.
struct Replacements<'t> {
    ids: &'t TaskIds,
    /// Whether each task is in this iteration's plan.
    used: Vec<bool>,
    /// The next candidate task index; candidates are `rank, rank + ranks, …`.
    next: usize,
    step: usize,
    drawn: usize,
    samples: u32,
    seed: u64,
    iteration: u64,
}

impl Iterator for Replacements<'_> {
    /// The k-th replacement group: k, and every sample of its task, seeded from (seed,
    /// iteration, task id, sample) like a planned task's.
    type Item = (usize, Vec<Item>);

    fn next(&mut self) -> Option<(usize, Vec<Item>)> {
        while self.next < self.ids.len() {
            let i = self.next;
            self.next += self.step;
            if self.used[i] {
                continue;
            }
            let k = self.drawn;
            self.drawn += 1;
            let id = &self.ids[i];
            let items = (0..self.samples.max(1))
                .map(|sample| Item {
                    task: id.into(),
                    task_index: i,
                    sample,
                    seed: plan::sample_seed(self.seed, self.iteration, id, sample),
                    state: u64::from(sample),
                })
                .collect();
            return Some((k, items));
        }
        None
    }
}
/// Concatenate files (each record ending in a newline, blank lines dropped) into a new
/// file `out`, streamed, and make it durable.
fn concat(store: &dyn SharedDir, paths: &[PathBuf], out: &Path) -> std::io::Result<()> {
    use std::io::Write;
    store.create_dir_all(out.parent().unwrap_or(Path::new(".")))?;
    let mut w = std::io::BufWriter::new(store.create_data(out)?);
    let mut buf = Vec::new();
    for p in paths {
        let mut r = store.open_data(p)?;
        buf.clear();
        loop {
            let n = r.read_more(&mut buf, 1 << 16)?;
            // Whole lines only, but at the end of the file: its last line may lack a newline.
            let end = match n {
                0 => buf.len(),
                _ => buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1),
            };
            for line in buf[..end].split_inclusive(|&b| b == b'\n') {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                w.write_all(line)?;
                if line.last() != Some(&b'\n') {
                    w.write_all(b"\n")?;
                }
            }
            buf.drain(..end);
            if n == 0 {
                break;
            }
        }
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// A progress bar is drawn on a terminal, not between the lines of a JSON log.
fn progress_bar() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr()) && !crate::logging::json()
}
