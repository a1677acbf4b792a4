//! Planned rollouts: every node computes the same plan for each iteration from the task
//! files (`crate::work::plan`), rank 0 broadcasts the plan's fingerprint with the release
//! of `sync-start` and a worker whose plan differs stops, saying why. Then:
//!
//! - `per-rank` (default): the rank's share is written to a task file (`{tasks}`) and its
//!   rollout command runs once, as without planning;
//! - `per-task`: the command runs once per (task, sample), `max-workers` at a time; each
//!   item's output is committed on its own (`items/…jsonl`, by rename), so a restart redoes
//!   only unfinished items; retryable exit codes are retried with backoff and jitter;
//! - `dynamic`: no split; nodes claim items from the shared directory by an exclusive
//!   create of a lease named with the generation and an attempt number. When a claimant
//!   dies (its heartbeat still for `dead-after`), the next attempt's lease can be created
//!   by anyone, so its items are finished by the others in the same iteration. A committed
//!   item is never run again; all attempts of an item write the same seed's output, and the
//!   rename makes exactly one of them the item's file. Each lease carries its holder's
//!   pace, and a node leaves the pool's last items to faster live peers when they would
//!   finish them first (`protocol::lease::take_next`, with a bounded patience).

use super::{Interrupt, Node, Stop};
use crate::config::{PhaseCommand, WorkMode};
use crate::events;
use crate::process::ChildExit;
use crate::protocol::lease::{self, Holder, Take};
use crate::protocol::AbortKind;
use crate::store;
use crate::work::plan::{self, Item, Plan, Strategy};
use crate::work::tasks::{self, TaskFile, TaskIds};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
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
        let budget = cfg.work.tasks_per_iteration;
        if let Some(t) = &sets.train {
            if budget as usize > t.len() {
                return Err(Stop::usage(
                    format!(
                        "work.tasks-per-iteration is {budget} but {} holds only {} tasks",
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
    total: usize,
    committed: usize,
    failed: Vec<String>,
    retries: u32,
}

/// The shortest time between two looks at the items a node awaits from its peers (each
/// look reads every peer's record and the leases of the items not committed yet).
const AWAITED_LOOK_MIN: Duration = Duration::from_millis(2);

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
        let budget =
            (split == "train" && w.tasks_per_iteration > 0).then_some(w.tasks_per_iteration);
        Some(plan::plan(&plan::PlanInput {
            tasks: tasks.ids(),
            weights: &self.cfg.weights(),
            budget,
            samples: w.samples_per_task,
            seed: w.seed,
            iteration: self.iteration,
            strategy: w.strategy,
        }))
    }

    /// The fingerprints rank 0 broadcasts with the release of `sync-start`: the plans and
    /// the task files' content (two files with the same ids plan alike but differ).
    pub(super) fn plan_fingerprints(&self) -> Value {
        let fp = |s: &str| self.plan_for(s).map(|p| p.fingerprint);
        let files = |s: &str| self.tasks.get(s).map(|t| t.fingerprint().to_owned());
        json!({"train": fp("train"), "eval": fp("eval"), "train-tasks": files("train"), "eval-tasks": files("eval")})
    }

    /// A worker compares rank 0's plan fingerprints with its own.
    pub(super) fn check_plans(&mut self, rank0: &Value) -> Result<(), Stop> {
        let mine = self.plan_fingerprints();
        if &mine == rank0 || rank0.is_null() {
            return Ok(());
        }
        let reason = format!(
            "this rank's plan of iteration {} differs from rank 0's (rank 0: {rank0}, here: {mine}): the task files (tasks.train / tasks.eval) differ between nodes",
            self.iteration
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
        let dir = self.layout.rollout_dir(self.iteration, split);
        if let Err(e) = self.store.create_dir_all(&dir.join("tasks")) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot create {}: {e}", dir.display()),
                None,
            ));
        }
        if self.is_master() {
            let _ = self.store.publish_json(&dir.join("plan.json"), &plan);
        }
        if plan.strategy == Strategy::Dynamic {
            return self.dynamic_rollout(split, phase, pc, plan);
        }
        // This rank's items only: the rest of the plan (every task's items when an iteration
        // uses the whole file) is freed before the rollout runs.
        let strategy = plan.strategy;
        let items = std::mem::take(&mut plan.ranks[self.rank as usize]);
        drop(plan);
        let tasks = Arc::clone(self.tasks.get(split).expect("planned"));
        // The rank's share: the task records themselves, in plan order, once per task,
        // streamed from the task file.
        let task_file = dir.join("tasks").join(format!("rank-{}.jsonl", self.rank));
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
                self.iteration, strategy
            ));
            let shard = self.layout.shard(self.iteration, split, self.rank);
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
                self.run_items(split, phase, pc, &tasks, names, Some(self.rank))?;
                self.commit_rank_shard(split, planned)
            }
        }
    }

    fn items_dir(&self, split: &str) -> PathBuf {
        self.layout.rollout_dir(self.iteration, split).join("items")
    }

    /// Concatenate this rank's `planned` committed items (plan order) and its replacements
    /// into its shard, so the aggregation and `rl-node aggregate` see per-task output like
    /// any other.
    fn commit_rank_shard(&mut self, split: &str, planned: usize) -> Result<(), Stop> {
        let dir = self.items_dir(split);
        let paths: Vec<PathBuf> = (0..planned)
            .map(|pos| dir.join(format!("{}.jsonl", item_name(pos, Some(self.rank)))))
            .chain(
                self.replacements
                    .iter()
                    .map(|n| dir.join(format!("{n}.jsonl"))),
            )
            .filter(|p| p.exists())
            .collect();
        let shard = self.layout.shard(self.iteration, split, self.rank);
        self.fence(&format!(
            "commit its {split} shard of iteration {}",
            self.iteration
        ))?;
        concat(&paths, &shard).map_err(|e| {
            self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot commit {}: {e}", shard.display()),
                None,
            )
        })
    }

    /// Rank 0 merges a dynamic rollout's committed items in pool order.
    pub(super) fn aggregate_items(&mut self, split: &str, plan: &Plan) -> Result<(), Stop> {
        let dir = self.items_dir(split);
        let paths: Vec<PathBuf> = (0..plan.pool.len())
            .map(|pos| dir.join(format!("{}.jsonl", item_name(pos, None))))
            .filter(|p| p.exists())
            .collect();
        let missing = plan.pool.len() - paths.len();
        if missing > 0 {
            self.warn(&format!(
                "{missing} of {} {split} items have no committed output",
                plan.pool.len()
            ));
        }
        let out = self.layout.aggregated(self.iteration, split);
        self.fence(&format!("publish {}", out.display()))?;
        concat(&paths, &out).map_err(|e| {
            self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot write {}: {e}", out.display()),
                None,
            )
        })?;
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
        Duration::from_secs_f64((base * jitter).min(300.0))
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
        let dir = self.items_dir(split);
        // In dynamic mode a takeover or a backup may run an item while its first claimant
        // still writes: every attempt writes its own partial file.
        // Every generation writes its own too: a node of an older generation that wakes up
        // (a frozen host) never writes the file a newer generation commits.
        let gen = self.gen();
        let partial = if name.starts_with('p') {
            dir.join(format!(
                "{name}.g{gen}.r{}.a{attempt}.partial.jsonl",
                self.rank
            ))
        } else {
            dir.join(format!("{name}.g{gen}.a{attempt}.partial.jsonl"))
        };
        let _ = self.store.remove_file(&partial);
        self.extra.insert("task_id", item.task.to_string());
        self.extra.insert("sample", item.sample.to_string());
        self.extra.insert("sample_seed", item.seed.to_string());
        self.extra.insert("state", item.state.to_string());
        self.extra.insert("task_json", task_json);
        let values = self.values(phase, Some(split), &partial);
        let command = self.cfg.template(&pc.command).render(&values);
        let env = self.command_env(&values);
        let log = self
            .layout
            .item_log(self.iteration, self.rank, phase, name, attempt);
        let header = format!(
            "rank {} iteration {} {phase} item {name} (task {}, sample {}, attempt {})",
            self.rank,
            self.iteration,
            item.task,
            item.sample,
            attempt + 1
        );
        // The phase log says where each item's own log is.
        self.append_log(
            &self.layout.phase_log(self.iteration, self.rank, phase),
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
    fn commit_item(&mut self, split: &str, name: &str, partial: &Path) -> Result<(), Stop> {
        self.fence(&format!("commit item {name}"))?;
        let done = self.items_dir(split).join(format!("{name}.jsonl"));
        let result = (|| {
            let committed = if self.store.stat(partial).is_ok_and(|m| m.is_some()) {
                self.store.sync_file(partial)?;
                self.store.rename_noreplace(partial, &done)
            } else {
                match self.store.create_new(&done, b"")? {
                    true => Ok(()),
                    false => Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists)),
                }
            };
            match committed {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let _ = self.store.remove_file(partial);
                }
                other => other?,
            }
            self.store.fsync_dir(done.parent().expect("has parent"))
        })();
        result.map_err(|e| {
            self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot commit item {name}: {e}"),
                None,
            )
        })
    }

    fn show_progress(&mut self, split: &str, t: &Tally) {
        let p = format!("{}/{} {split} items", t.committed, t.total);
        self.publisher().stage(|r| r.progress = Some(p.clone()));
        if progress_bar() {
            let width = 30;
            let filled = (t.committed * width).checked_div(t.total).unwrap_or(width);
            crate::err!(
                "\r[rank {}] [{}{}] {p}{}   ",
                self.rank,
                "#".repeat(filled),
                ".".repeat(width - filled),
                if t.failed.is_empty() {
                    String::new()
                } else {
                    format!(", {} failed", t.failed.len())
                }
            );
        }
    }

    /// Run static items (`names`: position and item) `max-workers` at a time; skip the ones
    /// committed before a restart; retry retryable failures; replace failures when
    /// `exact-budget`. Fails the phase if too many items failed.
    fn run_items(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        tasks: &TaskFile,
        names: Vec<(usize, Item)>,
        rank: Option<u32>,
    ) -> Result<(), Stop> {
        let job = Job {
            split,
            phase,
            pc,
            tasks,
        };
        let dir = self.items_dir(split);
        if let Err(e) = self.store.create_dir_all(&dir) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot create {}: {e}", dir.display()),
                None,
            ));
        }
        self.replacements.clear();
        let mut tally = Tally {
            total: names.len(),
            ..Tally::default()
        };
        let mut queue: VecDeque<(String, Item, u32)> = VecDeque::new();
        let mut reused = 0;
        for (pos, item) in names {
            let name = item_name(pos, rank);
            if dir.join(format!("{name}.jsonl")).exists() {
                tally.committed += 1;
                reused += 1;
            } else {
                queue.push_back((name, item, 0));
            }
        }
        if reused > 0 {
            self.info(&format!(
                "iteration {}: {reused} {split} item(s) committed before the restart are reused",
                self.iteration
            ));
        }
        let mut replacements = self.replacement_pool(split, tasks.ids());
        let mut delayed: Vec<(Instant, String, Item, u32)> = vec![];
        let mut running: HashMap<i32, (String, Item, u32, PathBuf)> = HashMap::new();
        let deadline = self.clock.now() + pc.timeout;
        let started = self.clock.now();
        loop {
            let now = self.clock.now();
            delayed.retain(|(at, name, item, attempt)| {
                if *at <= now {
                    queue.push_back((name.clone(), item.clone(), *attempt));
                    false
                } else {
                    true
                }
            });
            while running.len() < self.max_workers() {
                let Some((name, item, attempt)) = queue.pop_front() else {
                    break;
                };
                let (pid, partial) = self.spawn_item(&job, &item, &name, attempt)?;
                running.insert(pid, (name, item, attempt, partial));
            }
            self.show_progress(split, &tally);
            if running.is_empty() && queue.is_empty() && delayed.is_empty() {
                break;
            }
            let next_retry = delayed.iter().map(|d| d.0).min();
            self.waiting_note = format!(
                "{} {split} item(s) running, {} queued, {} waiting to retry",
                running.len(),
                queue.len(),
                delayed.len()
            );
            let pids: Vec<i32> = running.keys().copied().collect();
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
                        humantime::format_duration(pc.timeout),
                        self.waiting_note
                    ),
                        Some(&self.layout.phase_log(self.iteration, self.rank, phase)),
                    ))
                }
            };
            let (name, item, attempt, partial) = running.remove(&pid).expect("ours");
            self.reap(pid, None);
            match exit {
                ChildExit::Success => {
                    self.commit_item(split, &name, &partial)?;
                    tally.committed += 1;
                }
                ChildExit::Exit(code) if self.retryable(code, attempt) => {
                    let wait = self.retry_delay(&name, &item.task, attempt, code);
                    tally.retries += 1;
                    delayed.push((self.clock.now() + wait, name, item, attempt + 1));
                }
                other => {
                    tally.failed.push(format!(
                        "{name} (task {}, sample {}): {other}, log {}",
                        item.task,
                        item.sample,
                        self.layout
                            .item_log(self.iteration, self.rank, phase, &name, attempt)
                            .display()
                    ));
                    self.item_failed(&name, &item.task, other);
                    if self.cfg.work.exact_budget {
                        if let Some((rname, ritem)) = replacements.as_mut().and_then(Iterator::next)
                        {
                            self.replacements.push(rname.clone());
                            tally.total += 1;
                            // Committed before a restart: reuse it.
                            if dir.join(format!("{rname}.jsonl")).exists() {
                                tally.committed += 1;
                            } else {
                                queue.push_back((rname, ritem, 0));
                            }
                        }
                    }
                }
            }
        }
        if progress_bar() {
            crate::errln!();
        }
        self.waiting_note.clear();
        let failed = tally.failed.len();
        let planned = tally.total - self.replacements.len();
        self.info(&format!(
            "iteration {}: {split} items: {}/{} committed, {failed} failed, {} retries, in {:.2}s{}",
            self.iteration,
            tally.committed,
            tally.total,
            tally.retries,
            self.clock.elapsed(started).as_secs_f64(),
            if self.cfg.work.exact_budget && tally.committed < planned {
                format!(" (exact-budget: {} of the planned {planned} collected; no more replacement tasks)", tally.committed)
            } else {
                String::new()
            }
        ));
        self.event(events::Event::Items {
            split: split.to_string(),
            total: tally.total,
            committed: tally.committed,
            failed,
            mode: events::ItemsMode::Static {
                retries: tally.retries,
            },
        });
        let fraction = failed as f64 / tally.total.max(1) as f64;
        if failed > 0 && fraction > self.cfg.work.max_failed_fraction {
            return Err(self.fail(
                AbortKind::CommandFailed { exit: "item failures".into() },
                self.rank,
                None,
                format!(
                    "{failed} of {} {split} items failed, more than work.max-failed-fraction ({}): {}",
                    tally.total,
                    self.cfg.work.max_failed_fraction,
                    tally.failed.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
                ),
                Some(&self.layout.phase_log(self.iteration, self.rank, phase)),
            ));
        }
        Ok(())
    }

    /// Tasks outside this iteration's plan that this rank may use to replace failed items
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
            next: self.rank as usize,
            step: self.num_nodes() as usize,
            drawn: 0,
            rank: self.rank,
            seed: self.cfg.work.seed,
            iteration: self.iteration,
        })
    }

    // ------------------------------------------------------------------ dynamic leases

    fn lease(&self, split: &str, pos: usize, attempt: u32) -> PathBuf {
        self.layout
            .rollout_dir(self.iteration, split)
            .join("leases")
            .join(format!(
                "{}.g{}.a{attempt}",
                item_name(pos, None),
                self.gen()
            ))
    }

    /// Try to claim item `pos` at `attempt`: an exclusive create, first writer wins. The
    /// lease carries this node's pace (mean item time so far, items at once), which the
    /// peers walking past it use in the end game (`lease::take_next`).
    fn claim(
        &mut self,
        split: &str,
        pos: usize,
        attempt: u32,
        pace: Option<lease::Pace>,
    ) -> Result<bool, Stop> {
        let path = self.lease(split, pos, attempt);
        let rec = json!({
            "rank": self.rank,
            "gen": self.gen(),
            "nonce": self.nonce,
            "attempt": attempt,
            "item_ms": pace.map(|p| p.item.as_secs_f64() * 1000.0),
            "workers": self.max_workers(),
        });
        // No fsync: a lease is a live record (docs/shared-directory.md, "Durability").
        match self.store.create_new_live_json(&path, &rec) {
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
        self.layout
            .rollout_dir(self.iteration, split)
            .join("leases")
            .join(format!("{}.g{}.failed", item_name(pos, None), self.gen()))
    }

    /// The newest lease of item `pos` in this generation: (attempt, holder rank).
    fn newest_lease(&self, split: &str, pos: usize) -> Option<(u32, u32)> {
        let mut found = None;
        for attempt in 0.. {
            let Ok(Some(v)) = self
                .store
                .read_json::<Value>(&self.lease(split, pos, attempt))
            else {
                break;
            };
            found = Some((attempt, v["rank"].as_u64().unwrap_or(u64::MAX) as u32));
        }
        found
    }

    /// Item `pos`'s attempt-0 lease in this generation, if it exists: its holder and the
    /// pace the holder published in it.
    fn first_lease(&self, split: &str, pos: usize) -> Option<(u32, Option<lease::Pace>)> {
        let v = self
            .store
            .read_json::<Value>(&self.lease(split, pos, 0))
            .ok()??;
        let rank = v["rank"].as_u64().unwrap_or(u64::MAX) as u32;
        let pace = v["item_ms"]
            .as_f64()
            .filter(|ms| ms.is_finite() && *ms > 0.0)
            .map(|ms| lease::Pace {
                item: Duration::from_secs_f64(ms / 1000.0),
                workers: v["workers"].as_u64().unwrap_or(1).min(u32::MAX as u64) as u32,
            });
        Some((rank, pace))
    }

    /// The end game's decision for the item at the head of the pool
    /// ([`lease::take_next`]): first with every pace known; a leave is judged again with
    /// the live peers only (their records read now), so a dead peer is not waited for.
    fn take_next(
        &mut self,
        me: Option<lease::Pace>,
        paces: &HashMap<u32, lease::Pace>,
        unclaimed: usize,
        waited: Duration,
    ) -> Take {
        let all: Vec<lease::Pace> = paces.values().copied().collect();
        if lease::take_next(me, &all, unclaimed, waited) == Take::Claim {
            return Take::Claim;
        }
        self.observe_all_peers();
        let live: Vec<lease::Pace> = paces
            .iter()
            .filter(|(r, _)| !self.dead_peers.contains(r))
            .map(|(_, p)| *p)
            .collect();
        lease::take_next(me, &live, unclaimed, waited)
    }

    /// Read every peer's record to judge the liveness of lease holders (only needed while
    /// taking over a dead node's items).
    fn observe_all_peers(&mut self) {
        for r in 0..self.num_nodes() {
            if r == self.rank {
                continue;
            }
            // What a read shows is judged at the time it returned.
            let read = self.read_record(self.gen(), r);
            let now = self.clock.since_start();
            let failed = if let Some(rec) = read {
                self.watch.liveness.observe(r, rec.seq, now);
                rec.state.is_terminal() && rec.state != crate::protocol::NodeState::Done
            } else {
                self.watch.liveness.watch(r, now);
                false
            };
            // A peer that heartbeats again after a long freeze holds its new leases: its
            // items are not taken over at once (the simulator found that they were).
            if failed || self.watch.liveness.is_dead(r, now) {
                self.dead_peers.insert(r);
            } else {
                self.dead_peers.remove(&r);
            }
        }
    }

    fn dynamic_rollout(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        plan: Plan,
    ) -> Result<(), Stop> {
        let dir = self.items_dir(split);
        for d in [dir.clone(), dir.with_file_name("leases")] {
            if let Err(e) = self.store.create_dir_all(&d) {
                return Err(self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!("cannot create {}: {e}", d.display()),
                    None,
                ));
            }
        }
        let tasks = Arc::clone(self.tasks.get(split).expect("planned"));
        let pool = plan.pool;
        // A peer dying now does not stop the cluster: its items are taken over. The next
        // barrier still notices it.
        self.watch.tolerate_dead = true;
        let result = self.dynamic_loop(split, phase, pc, &tasks, &pool);
        self.watch.tolerate_dead = false;
        result
    }

    fn dynamic_loop(
        &mut self,
        split: &str,
        phase: &str,
        pc: &PhaseCommand,
        tasks: &TaskFile,
        pool: &[Item],
    ) -> Result<(), Stop> {
        let job = Job {
            split,
            phase,
            pc,
            tasks,
        };
        let dir = self.items_dir(split);
        let committed = |pos: usize| dir.join(format!("{}.jsonl", item_name(pos, None))).exists();
        let mut running: HashMap<i32, Running> = HashMap::new();
        // Retryable failures wait here (ready time, item, next attempt) instead of blocking.
        let mut delayed: Vec<(Instant, usize, u32)> = vec![];
        let mut mine = 0usize;
        let mut failed: Vec<String> = vec![];
        let mut cursor = 0usize;
        // End game: when this node is idle and a slower live peer has held an item for
        // longer than this node's own average item time, run a backup attempt; the first
        // commit wins and the other attempt is stopped.
        let mut item_secs: Vec<f64> = vec![];
        let mut first_seen: HashMap<usize, Instant> = HashMap::new();
        let mut started_at: HashMap<i32, Instant> = HashMap::new();
        let mut backups = 0usize;
        // Speed-aware end game: the peers' paces as their leases published them, and the
        // item this node leaves to faster peers (position, since when).
        let mut paces: HashMap<u32, lease::Pace> = HashMap::new();
        let mut left: Option<(usize, Instant)> = None;
        let mut left_items = 0usize;
        // Attempts that exited 0, committed once this node's next items have started.
        let mut finished: Vec<Running> = vec![];
        let deadline = self.clock.now() + pc.timeout;
        let started = self.clock.now();
        loop {
            let my_pace = (!item_secs.is_empty()).then(|| lease::Pace {
                item: Duration::from_secs_f64(
                    item_secs.iter().sum::<f64>() / item_secs.len() as f64,
                ),
                workers: self.max_workers() as u32,
            });
            // Retries whose backoff has passed, under the next attempt's lease.
            let now = self.clock.now();
            let ready: Vec<(Instant, usize, u32)> =
                delayed.iter().copied().filter(|d| d.0 <= now).collect();
            delayed.retain(|d| d.0 > now);
            for (_, pos, attempt) in ready {
                if self.claim(split, pos, attempt, my_pace)? {
                    let (pid, partial) =
                        self.spawn_item(&job, &pool[pos], &item_name(pos, None), attempt)?;
                    started_at.entry(pid).or_insert_with(|| self.clock.now());
                    running.insert(
                        pid,
                        Running {
                            pos,
                            attempt,
                            partial,
                        },
                    );
                }
            }
            // Claim new items in pool order. An item claimed already (the usual case behind
            // faster peers) is passed by reading its lease, which says how fast its holder
            // is; the last ones may be left to faster peers (`lease::take_next`).
            let mut recheck: Option<Instant> = None;
            while running.len() < self.max_workers() && cursor < pool.len() {
                let pos = cursor;
                if let Some((holder, pace)) = self.first_lease(split, pos) {
                    if let (Some(p), true) = (pace, holder != self.rank) {
                        paces.insert(holder, p);
                    }
                    cursor += 1;
                    continue;
                }
                if committed(pos) {
                    cursor += 1;
                    continue;
                }
                let since = match left {
                    Some((p, t)) if p == pos => t,
                    _ => self.clock.now(),
                };
                let waited = self.clock.elapsed(since);
                if let Take::Leave { recheck: after } =
                    self.take_next(my_pace, &paces, pool.len() - pos, waited)
                {
                    if left.is_none_or(|l| l.0 != pos) {
                        left_items += 1;
                    }
                    left = Some((pos, since));
                    recheck = Some(self.clock.now() + after);
                    break;
                }
                cursor += 1;
                if !self.claim(split, pos, 0, my_pace)? {
                    continue;
                }
                let (pid, partial) = self.spawn_item(&job, &pool[pos], &item_name(pos, None), 0)?;
                started_at.entry(pid).or_insert_with(|| self.clock.now());
                running.insert(
                    pid,
                    Running {
                        pos,
                        attempt: 0,
                        partial,
                    },
                );
            }
            // Commit what finished, now that this node's next items run: the commit's
            // fsyncs are not between one item and the next.
            for r in std::mem::take(&mut finished) {
                if committed(r.pos) {
                    // Another attempt (a takeover or a backup) committed first: one file.
                    let _ = self.store.remove_file(&r.partial);
                } else {
                    self.commit_item(split, &item_name(r.pos, None), &r.partial)?;
                    mine += 1;
                }
            }
            // Stop attempts whose item another rank committed meanwhile.
            let superseded: Vec<i32> = running
                .iter()
                .filter(|(_, r)| committed(r.pos))
                .map(|(pid, _)| *pid)
                .collect();
            for pid in superseded {
                let r = running.remove(&pid).expect("listed");
                self.launcher.stop(pid, self.cfg.timing.kill_grace);
                self.exited.remove(&pid);
                let _ = self.store.remove_file(&r.partial);
            }
            // At the end of the pool, take over items whose claimant died.
            let mut waiting_on_peers = 0;
            let mut awaited: Vec<usize> = vec![];
            // The fastest pace among the live holders awaited: their commits are looked
            // for at least four times per item of theirs.
            let mut awaited_pace: Option<Duration> = None;
            if cursor >= pool.len() {
                self.observe_all_peers();
                for (pos, item) in pool.iter().enumerate() {
                    if running.len() >= self.max_workers() {
                        break;
                    }
                    if committed(pos)
                        || running.values().any(|r| r.pos == pos)
                        || delayed.iter().any(|d| d.1 == pos)
                        || self.failed_marker(split, pos).exists()
                    {
                        continue;
                    }
                    let dead = &self.dead_peers;
                    let holder = lease::holder(self.newest_lease(split, pos), self.rank, |r| {
                        dead.contains(&r)
                    });
                    match holder {
                        Holder::Live {
                            attempt,
                            rank: holder,
                        } => {
                            let seen = *first_seen.entry(pos).or_insert_with(|| self.clock.now());
                            let avg = (!item_secs.is_empty()).then(|| {
                                Duration::from_secs_f64(
                                    item_secs.iter().sum::<f64>() / item_secs.len() as f64,
                                )
                            });
                            // One backup per item, of a first attempt only: a retry or a
                            // takeover is not backed up again.
                            let slower = lease::backup_due(attempt, self.clock.elapsed(seen), avg);
                            if slower && self.claim(split, pos, attempt + 1, my_pace)? {
                                backups += 1;
                                self.event(events::Event::Backup {
                                    item: item_name(pos, None),
                                    holder,
                                });
                                let (pid, partial) = self.spawn_item(
                                    &job,
                                    item,
                                    &item_name(pos, None),
                                    attempt + 1,
                                )?;
                                started_at.insert(pid, self.clock.now());
                                running.insert(
                                    pid,
                                    Running {
                                        pos,
                                        attempt: attempt + 1,
                                        partial,
                                    },
                                );
                            } else {
                                waiting_on_peers += 1;
                                awaited.push(pos);
                                if let Some(p) = paces.get(&holder) {
                                    awaited_pace =
                                        Some(awaited_pace.map_or(p.item, |a| a.min(p.item)));
                                }
                            }
                        }
                        Holder::Gone { attempt } => {
                            if self.claim(split, pos, attempt + 1, my_pace)? {
                                self.info(&format!(
                                    "iteration {}: taking over item {} (its claimant is dead)",
                                    self.iteration,
                                    item_name(pos, None)
                                ));
                                let (pid, partial) = self.spawn_item(
                                    &job,
                                    item,
                                    &item_name(pos, None),
                                    attempt + 1,
                                )?;
                                started_at.entry(pid).or_insert_with(|| self.clock.now());
                                running.insert(
                                    pid,
                                    Running {
                                        pos,
                                        attempt: attempt + 1,
                                        partial,
                                    },
                                );
                            } else {
                                // Someone took it over first (a lease this node's cache
                                // did not show yet): wait for it like any live holder's,
                                // or this node could finish while the taker dies too.
                                waiting_on_peers += 1;
                                awaited.push(pos);
                            }
                        }
                        Holder::Free => {
                            // Claimable in this generation (e.g. a lease of an earlier one only).
                            if self.claim(split, pos, 0, my_pace)? {
                                let (pid, partial) =
                                    self.spawn_item(&job, item, &item_name(pos, None), 0)?;
                                started_at.entry(pid).or_insert_with(|| self.clock.now());
                                running.insert(
                                    pid,
                                    Running {
                                        pos,
                                        attempt: 0,
                                        partial,
                                    },
                                );
                            } else {
                                // Claimed by another node meanwhile: wait for it.
                                waiting_on_peers += 1;
                                awaited.push(pos);
                            }
                        }
                    }
                }
            }
            let done = (0..pool.len()).filter(|p| committed(*p)).count();
            self.show_progress(
                split,
                &Tally {
                    total: pool.len(),
                    committed: done,
                    failed: failed.clone(),
                    retries: 0,
                },
            );
            if running.is_empty()
                && delayed.is_empty()
                && cursor >= pool.len()
                && waiting_on_peers == 0
            {
                break;
            }
            self.waiting_note = format!(
                "{} {split} item(s) running here, {waiting_on_peers} held by other ranks",
                running.len()
            );
            let pids: Vec<i32> = running.keys().copied().collect();
            let next_retry = delayed.iter().map(|d| d.0).min();
            // Look again (liveness of claimants, backups) at least every poll interval, and at
            // once when an item another rank holds is committed or marked failed.
            // While an item is left to faster peers: look again when its patience may have
            // run out, and at once when a peer claims it. While a peer's item is awaited:
            // a quarter of its pace at most (not under 2 ms; each look starts polling
            // afresh, at about a millisecond), so its commit is seen within a few
            // milliseconds, not a growing fraction of the wait.
            let now = self.clock.now();
            let poll_until = (now + self.cfg.timing.poll_interval)
                .min(recheck.unwrap_or(deadline))
                .min(awaited_pace.map_or(deadline, |p| now + (p / 4).max(AWAITED_LOOK_MIN)));
            let leaving = recheck.map(|_| self.lease(split, cursor, 0));
            let awaited: Vec<(PathBuf, PathBuf)> = awaited
                .iter()
                .chain(running.values().map(|r| &r.pos))
                .map(|&pos| {
                    (
                        dir.join(format!("{}.jsonl", item_name(pos, None))),
                        self.failed_marker(split, pos),
                    )
                })
                .collect();
            let clock = self.clock.clone();
            let waited = self.wait_item(deadline, &pids, || {
                let now = clock.now();
                let retry_due = next_retry.is_some_and(|t| now >= t);
                let settled = awaited
                    .iter()
                    .any(|(done, failed)| done.exists() || failed.exists());
                let taken = leaving.as_ref().is_some_and(|l| l.exists());
                now >= poll_until || retry_due || settled || taken
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
                            "the dynamic {phase} did not finish within its timeout: {}",
                            self.waiting_note
                        ),
                        None,
                    ));
                }
            };
            let r = running.remove(&pid).expect("ours");
            self.reap(pid, None);
            if let Some(t) = started_at.remove(&pid) {
                item_secs.push(self.clock.elapsed(t).as_secs_f64());
            }
            let name = item_name(r.pos, None);
            match exit {
                ChildExit::Success => finished.push(r),
                ChildExit::Exit(code) if self.retryable(code, r.attempt) => {
                    let wait = self.retry_delay(&name, &pool[r.pos].task, r.attempt, code);
                    delayed.push((self.clock.now() + wait, r.pos, r.attempt + 1));
                }
                other => {
                    failed.push(format!(
                        "{name} (task {}): {other}, log {}",
                        pool[r.pos].task,
                        self.layout
                            .item_log(self.iteration, self.rank, phase, &name, r.attempt)
                            .display()
                    ));
                    self.item_failed(&name, &pool[r.pos].task, other);
                    // Tell the other ranks not to wait for it.
                    let marker = self.failed_marker(split, r.pos);
                    let _ = self.store.create_new(&marker, other.to_string().as_bytes());
                }
            }
        }
        self.waiting_note.clear();
        self.info(&format!(
            "iteration {}: dynamic {split}: this rank committed {mine} of {} items in {:.2}s ({backups} backup attempt(s), {left_items} left to faster ranks){}",
            self.iteration,
            pool.len(),
            self.clock.elapsed(started).as_secs_f64(),
            if failed.is_empty() {
                String::new()
            } else {
                format!(", {} failed", failed.len())
            }
        ));
        self.event(events::Event::Items {
            split: split.to_string(),
            total: pool.len(),
            committed: mine,
            failed: failed.len(),
            mode: events::ItemsMode::Dynamic {
                backups,
                dynamic: true,
            },
        });
        // A shard per rank (items whose position mod ranks is this rank, whoever ran them),
        // so an aggregate command and `rl-node aggregate` see rank shards as usual.
        let n = self.num_nodes() as usize;
        let paths: Vec<PathBuf> = (0..pool.len())
            .filter(|pos| pos % n == self.rank as usize)
            .map(|pos| dir.join(format!("{}.jsonl", item_name(pos, None))))
            .filter(|p| p.exists())
            .collect();
        let shard = self.layout.shard(self.iteration, split, self.rank);
        if let Err(e) = concat(&paths, &shard) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("cannot commit {}: {e}", shard.display()),
                None,
            ));
        }
        let fraction = failed.len() as f64 / pool.len().max(1) as f64;
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
                Some(&self.layout.phase_log(self.iteration, self.rank, phase)),
            ));
        }
        Ok(())
    }
}

/// This rank's replacement items, in task order, drawn one at a time as items fail: a
/// million-task file costs a flag per task here, not an item.
struct Replacements<'t> {
    ids: &'t TaskIds,
    /// Whether each task is in this iteration's plan.
    used: Vec<bool>,
    /// The next candidate task index; candidates are `rank, rank + ranks, …`.
    next: usize,
    step: usize,
    drawn: usize,
    rank: u32,
    seed: u64,
    iteration: u64,
}

impl Iterator for Replacements<'_> {
    /// The item's name and the item (sample 0).
    type Item = (String, Item);

    fn next(&mut self) -> Option<(String, Item)> {
        while self.next < self.ids.len() {
            let i = self.next;
            self.next += self.step;
            if self.used[i] {
                continue;
            }
            let k = self.drawn;
            self.drawn += 1;
            let id = &self.ids[i];
            let item = Item {
                task: id.into(),
                task_index: i,
                sample: 0,
                seed: plan::sample_seed(self.seed, self.iteration, id, 0),
                state: 0,
            };
            return Some((format!("r{}-x{k:05}", self.rank), item));
        }
        None
    }
}

/// Concatenate files (each record ending in a newline) into `out`, streaming through a
/// temporary file that is renamed over `out`.
fn concat(paths: &[PathBuf], out: &Path) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader, BufWriter, Write};
    let dir = out.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        out.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let mut w = BufWriter::new(std::fs::File::create(&tmp)?);
    for p in paths {
        let mut r = BufReader::new(std::fs::File::open(p)?);
        let mut line = Vec::new();
        loop {
            line.clear();
            if r.read_until(b'\n', &mut line)? == 0 {
                break;
            }
            if line.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            w.write_all(&line)?;
        }
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, out)?;
    store::fsync_dir(dir)
}

/// A progress bar is drawn on a terminal, not between the lines of a JSON log.
fn progress_bar() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr()) && !crate::logging::json()
}
