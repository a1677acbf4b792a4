//! Crashes, restarts, generations and fencing.
//!
//! N ranks walk I iterations of the node's own walk (`protocol::walk::IterationWalk`: the
//! 14 phases with their barriers and sub-barriers, rank 0's merges, prepare and hand-off,
//! the eval rollout on the iterations the eval decision picks). A step that commits runs
//! its command for a few ticks, then checks the fence, commits its output, and appends
//! to its rank's journal, as `Node::once` does. Server steps take no time here.
//!
//! The decisions are the core's own, on what the simulated directory holds:
//! - the journals are parsed by `protocol::journal::parse_lines`, torn last lines
//!   included, and set aside as `state::repair_tail` does;
//! - where a restarted cluster begins is `protocol::journal::resume_point`;
//! - which steps a rank takes, and whether training is redone, is the walk's; which
//!   work it skips is `journal::has` of the step's item;
//! - whether a node may still commit is `protocol::fence::check`, on the true
//!   `cluster.json` (the fence opens the file: close-to-open consistency).
//!
//! Faults, drawn per seed: kill -9 of any rank at any tick (sometimes two at once, often
//! rank 0), a kill in the middle of a journal append (a torn last line), commands that
//! fail (none, or one in 400, 100 or 40), writes that fail with ENOSPC or EIO (a journal
//! append may leave part of its line), reads of `cluster.json` that hang (redone, or
//! the node ended by its watchdog after fs-timeout), and a survivor frozen through the restart that then wakes up still believing its
//! old generation. After a failure the other ranks of the generation stop within a
//! detection delay (liveness is the barrier scenario's subject); then every rank is
//! started again as a new generation.
//!
//! Invariants, after every tick:
//! - a node of a replaced generation never commits or journals;
//! - a rank journals an item only over its own output (no item committed by two
//!   attempts), and never twice;
//! - no generation trains an iteration every rank had journaled as trained when it began;
//! - `LATEST` names a committed checkpoint;
//! - the merge finds every rank's shard, prepare the merged data, training the prepared
//!   data, and the hand-off every rank's training output;
//!
//! and at the end: the run completed every iteration within a bound (one generation's
//! worth of ticks per failure), and every iteration's merged train and eval data,
//! checkpoint and `LATEST` equal those of an uninterrupted run: nothing lost, nothing
//! done twice.

use super::Violation;
use rl_node::protocol::fence::{self, Seen};
use rl_node::protocol::journal::{self, item, Entry, Lines, Tail};
use rl_node::protocol::phase::RlPhase;
use rl_node::protocol::walk::{self, Barrier, IterationWalk, RolloutSplit, Step, WalkConfig};
use rl_node::protocol::ClusterRecord;
use rl_node::rng::SplitMix64 as Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const WALK: &str = "iteration-complete:both";
const RUN: &str = "sim";

/// The broken variants a run may be given (never the node's).
#[derive(Debug, Clone, Copy, Default)]
pub struct Mutations {
    pub fence: Option<fence::Mutation>,
    pub resume: Option<journal::Mutation>,
}

/// Steps a node takes per iteration, about: for the run's time bound.
const STEPS_PER_ITERATION: u64 = 40;

/// The journal item a committing step appends.
fn item_of(step: Step) -> &'static str {
    match step {
        Step::Train { .. } => item::TRAIN,
        Step::Complete => WALK,
        s => s.once_item().expect("a committing step"),
    }
}

/// Where a process is inside its current step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Sub {
    Start,
    /// Its command runs for this many more ticks.
    Command(u32),
    Commit,
    /// Rank 0's hand-off: the checkpoint is committed; `LATEST` next.
    Latest,
    Journal,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Life {
    Running,
    /// Frozen until this tick (a survivor that sleeps through the restart).
    Frozen(u64),
    /// Stops at this tick: it has noticed its generation's failure.
    Stopping(u64),
    /// Inside a filesystem call that hangs until this tick. With `watchdog`, the call
    /// outlasts fs-timeout and the node's watchdog ends the node then; otherwise the call
    /// returns and the node redoes the step it was in.
    Hung {
        until: u64,
        watchdog: bool,
    },
    Stopped,
    Done,
}

struct Proc {
    rank: u32,
    gen: u64,
    journal: Vec<Entry>,
    resume: journal::Resume,
    walk: IterationWalk,
    /// The step under way (`None`: ask the walk for the next).
    step: Option<Step>,
    sub: Sub,
    life: Life,
}

impl Proc {
    fn iteration(&self) -> u64 {
        self.walk.iteration()
    }
}

/// A file an attempt wrote: the generation and rank that wrote it, and its content.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Output {
    gen: u64,
    rank: u32,
    content: u64,
}

/// The shared directory, as it truly is (durable: commits are fsynced, file and
/// directory, before they are journaled).
#[derive(Default)]
struct Disk {
    /// `cluster.json`'s generation.
    gen: u64,
    journals: Vec<String>,
    /// Rollout shards by (split, iteration, rank); merged files by (split, iteration).
    shards: BTreeMap<(&'static str, u64, u32), Output>,
    merged: BTreeMap<(&'static str, u64), Output>,
    prepared: BTreeMap<u64, Output>,
    trained: BTreeMap<(u64, u32), Output>,
    checkpoints: BTreeMap<u64, Output>,
    latest: Option<u64>,
    /// Outputs of earlier attempts moved out of the way (kept, never used).
    set_aside: u64,
    /// Which ranks of generation g arrived at barrier b of iteration i.
    arrived: BTreeMap<(u64, u64, &'static str), Vec<bool>>,
}

fn mix(a: u64, b: u64) -> u64 {
    let mut r = Rng::new(a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b);
    r.next_u64()
}

/// What an uninterrupted run commits.
fn shard_content(split: &str, it: u64, rank: u32) -> u64 {
    mix(mix(it, rank as u64), split.len() as u64)
}
fn merged_content(shards: impl Iterator<Item = u64>) -> u64 {
    shards.fold(0, mix)
}
fn prepared_content(merged: u64) -> u64 {
    mix(merged, 99)
}
fn trained_content(prepared: u64, rank: u32) -> u64 {
    mix(prepared, 1000 + rank as u64)
}
fn checkpoint_content(trained: impl Iterator<Item = u64>) -> u64 {
    trained.fold(7, mix)
}

fn cluster(gen: u64) -> ClusterRecord {
    ClusterRecord {
        host: "sim-0".into(),
        ..ClusterRecord::bare(RUN, gen, 0)
    }
}

#[derive(Default)]
pub struct Summary {
    pub ticks: u64,
    pub kills: u64,
    pub torn: u64,
    pub failed_commands: u64,
    /// Commits and journal appends that failed with ENOSPC or EIO.
    pub store_errors: u64,
    /// Filesystem calls that hung, and those that outlasted fs-timeout.
    pub hangs: u64,
    pub watchdog_ends: u64,
    pub frozen: u64,
    pub fenced: u64,
    pub generations: u64,
    pub set_aside: u64,
    pub checks: u64,
}

struct Sim {
    seed: u64,
    n: usize,
    iterations: u64,
    mutations: Mutations,
    rng: Rng,
    tick: u64,
    disk: Disk,
    procs: Vec<Proc>,
    /// Ticks at which a kill happens.
    kills_at: Vec<u64>,
    /// When the launcher starts the next generation, once the current one has stopped.
    restart_at: Option<u64>,
    /// One command in this many fails (0: none), drawn per seed.
    fail_one_in: u64,
    /// `cluster.eval-interval`, drawn per seed (0: never).
    eval_interval: u64,
    /// One commit or journal append in this many fails with ENOSPC or EIO, and one
    /// filesystem call in this many hangs (0: none); drawn per seed.
    store_error_one_in: u64,
    hang_one_in: u64,
    /// The journals said the run is complete when the launcher restarted it.
    complete: bool,
    /// Generations that failed (their remaining ranks stop once they notice).
    failed_generations: BTreeSet<u64>,
    /// The iterations every rank had journaled training for when each generation began.
    trained_at_start: BTreeMap<u64, BTreeSet<u64>>,
    trace: VecDeque<String>,
    s: Summary,
}

impl Sim {
    fn new(seed: u64, n: usize, mutations: Mutations) -> Sim {
        let mut rng = Rng::new(seed ^ 0xC0A5_7E57);
        let iterations = 2 + rng.below(3);
        // About (n + 4) ticks per step of every rank: spread the kills over the run.
        let length = iterations * STEPS_PER_ITERATION * (n as u64 * 2 + 4);
        let mut kills_at: Vec<u64> = (0..rng.below(4)).map(|_| rng.below(length)).collect();
        kills_at.sort_unstable();
        let fail_one_in = [0, 400, 100, 40][rng.below(4) as usize];
        let eval_interval = rng.below(3);
        let store_error_one_in = [0, 300, 60][rng.below(3) as usize];
        let hang_one_in = [0, 300, 60][rng.below(3) as usize];
        let mut sim = Sim {
            seed,
            n,
            iterations,
            mutations,
            rng,
            tick: 0,
            disk: Disk {
                journals: vec![String::new(); n],
                ..Disk::default()
            },
            procs: Vec::new(),
            kills_at,
            restart_at: None,
            fail_one_in,
            eval_interval,
            store_error_one_in,
            hang_one_in,
            complete: false,
            failed_generations: BTreeSet::new(),
            trained_at_start: BTreeMap::new(),
            trace: VecDeque::new(),
            s: Summary::default(),
        };
        sim.start_generation();
        sim
    }

    fn note(&mut self, line: String) {
        if self.trace.len() == 40 {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("t={} {line}", self.tick));
    }

    fn violation(&self, what: String) -> Violation {
        Violation {
            seed: self.seed,
            what,
            trace: self.trace.iter().cloned().collect(),
        }
    }

    /// The launcher starts every rank again: rank 0 writes the next generation into
    /// `cluster.json`, every journal is read (a torn last line set aside), and all ranks
    /// begin at the resume point.
    fn start_generation(&mut self) -> bool {
        let mut journals = Vec::with_capacity(self.n);
        for r in 0..self.n {
            let lines: Lines<Entry> = journal::parse_lines(&self.disk.journals[r])
                .unwrap_or_else(|e| panic!("seed {}: journal of rank {r}: {e:?}", self.seed));
            if let Tail::Torn(fragment) = &lines.tail {
                self.note(format!(
                    "rank {r}'s journal ends torn ({} bytes): set aside",
                    fragment.len()
                ));
                self.disk.journals[r].truncate(lines.clean_len);
            }
            journals.push(lines.entries);
        }
        let trained: BTreeSet<u64> = (1..=self.iterations)
            .filter(|&it| {
                journals
                    .iter()
                    .all(|j| journal::has(j, RUN, it, item::TRAIN))
            })
            .collect();
        let resume = journal::resume_point_with(&journals, RUN, WALK, self.mutations.resume);
        if resume.iteration > self.iterations {
            // `rl-node` says the run is complete and starts no generation (exit 0).
            self.note(format!(
                "the journals say every iteration is complete: no generation {} starts",
                self.disk.gen + 1
            ));
            return false;
        }
        self.disk.gen += 1;
        self.s.generations += 1;
        let gen = self.disk.gen;
        self.trained_at_start.insert(gen, trained);
        self.note(format!(
            "generation {gen} starts at iteration {} (training done there: {})",
            resume.iteration, resume.train_done
        ));
        // Processes of older generations stay as they are (frozen ones wake up later).
        self.procs.retain(|p| {
            matches!(
                p.life,
                Life::Frozen(_) | Life::Stopping(_) | Life::Running | Life::Hung { .. }
            )
        });
        for (r, journal) in journals.into_iter().enumerate() {
            let walk = IterationWalk::new(self.walk_config(r as u32), resume.iteration, resume);
            self.procs.push(Proc {
                rank: r as u32,
                gen,
                journal,
                resume,
                walk,
                step: None,
                sub: Sub::Start,
                life: Life::Running,
            });
        }
        true
    }

    /// The current generation failed at this tick (a kill or a failed command): every
    /// other rank of it notices within a detection delay; one may instead be frozen
    /// through the restart.
    fn generation_fails(&mut self, gen: u64) {
        self.failed_generations.insert(gen);
        let freeze_one = self.rng.below(3) == 0;
        let mut frozen = false;
        for i in 0..self.procs.len() {
            if self.procs[i].gen != gen || self.procs[i].life != Life::Running {
                continue;
            }
            if freeze_one && !frozen {
                frozen = true;
                let until = self.tick + 200 + self.rng.below(40 * self.n as u64 + 400);
                self.procs[i].life = Life::Frozen(until);
                self.s.frozen += 1;
                let r = self.procs[i].rank;
                self.note(format!(
                    "rank {r} of generation {gen} freezes until t={until}"
                ));
            } else {
                let at = self.tick + 1 + self.rng.below(8 * self.n as u64 + 20);
                self.procs[i].life = Life::Stopping(at);
            }
        }
    }

    /// Process `i` stops on a failure of its own; if its generation is the current one,
    /// that generation fails.
    fn fails(&mut self, i: usize) {
        self.procs[i].life = Life::Stopped;
        let gen = self.procs[i].gen;
        if gen == self.disk.gen {
            self.generation_fails(gen);
        }
    }

    /// Part of process `i`'s journal line reaches the file (an interrupted append): how
    /// many bytes of how many.
    fn torn_append(&mut self, i: usize) -> (usize, usize) {
        let line = self.journal_line(i);
        let cut = 1 + self.rng.below(line.len() as u64 - 2) as usize;
        let rank = self.procs[i].rank as usize;
        self.disk.journals[rank].push_str(&line[..cut]);
        self.s.torn += 1;
        (cut, line.len())
    }

    fn kill(&mut self, i: usize) {
        let (rank, gen) = (self.procs[i].rank, self.procs[i].gen);
        // Killed in the middle of a journal append: part of the line reached the file.
        if self.procs[i].sub == Sub::Journal && self.rng.below(2) == 0 {
            let (cut, len) = self.torn_append(i);
            self.note(format!(
                "rank {rank} killed while appending to its journal ({cut} of {len} bytes written)"
            ));
        } else {
            self.note(format!(
                "rank {rank} of generation {gen} killed (kill -9) at {:?} {:?}",
                self.step_of(i),
                self.procs[i].sub
            ));
        }
        self.procs[i].life = Life::Stopped;
        self.s.kills += 1;
    }

    fn step_of(&self, i: usize) -> Option<Step> {
        self.procs[i].step
    }

    fn walk_config(&self, rank: u32) -> WalkConfig {
        WalkConfig {
            rl_phase: RlPhase::Both,
            split: RolloutSplit::All,
            rank_0: rank == 0,
            prepare: true,
            iterations: self.iterations,
        }
    }

    fn journal_line(&self, i: usize) -> String {
        let p = &self.procs[i];
        let e = Entry {
            run_id: RUN.into(),
            gen: p.gen,
            rank: p.rank,
            iteration: p.iteration(),
            item: item_of(self.step_of(i).expect("a step under way")).into(),
            at: String::new(),
            note: None,
            failed: None,
            checkpoint: None,
        };
        format!("{}\n", serde_json::to_string(&e).unwrap())
    }

    fn run(mut self) -> Result<Summary, Violation> {
        // Each generation walks every iteration at most once, with time to notice a
        // failure, restart and wake frozen nodes; every failure may cost one generation.
        let n = self.n as u64;
        let generation = self.iterations * STEPS_PER_ITERATION * (n * 6 + 30)
            + (8 * n + 20)
            + 50
            + (40 * n + 600);
        loop {
            self.tick += 1;
            let failures =
                self.s.kills + self.s.failed_commands + self.s.store_errors + self.s.watchdog_ends;
            let bound = (failures + 1) * generation;
            if self.tick > bound {
                let procs: Vec<String> = self
                    .procs
                    .iter()
                    .map(|p| {
                        format!(
                            "rank {} of generation {} at iteration {} {:?} {:?}: {:?}",
                            p.rank,
                            p.gen,
                            p.iteration(),
                            p.step,
                            p.sub,
                            p.life
                        )
                    })
                    .collect();
                return Err(self.violation(format!(
                    "the run did not end within {bound} ticks ({failures} failures, {} generations); the nodes:\n  {}",
                    self.s.generations,
                    procs.join("\n  ")
                )));
            }
            // Kills.
            while self.kills_at.first().is_some_and(|&t| t <= self.tick) {
                self.kills_at.remove(0);
                let live: Vec<usize> = (0..self.procs.len())
                    .filter(|&i| {
                        self.procs[i].gen == self.disk.gen && self.procs[i].life == Life::Running
                    })
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let first = if self.rng.below(3) == 0 {
                    live.iter()
                        .copied()
                        .find(|&i| self.procs[i].rank == 0)
                        .unwrap_or(live[0])
                } else {
                    live[self.rng.below(live.len() as u64) as usize]
                };
                self.kill(first);
                if self.rng.below(4) == 0 {
                    if let Some(&second) = live.iter().find(|&&i| i != first) {
                        self.kill(second);
                    }
                }
                let gen = self.disk.gen;
                self.generation_fails(gen);
            }
            // Wake-ups and noticed failures.
            for i in 0..self.procs.len() {
                match self.procs[i].life {
                    Life::Frozen(t) if t <= self.tick => {
                        let (r, g) = (self.procs[i].rank, self.procs[i].gen);
                        self.note(format!(
                            "rank {r} of generation {g} wakes up at {:?} {:?}",
                            self.step_of(i),
                            self.procs[i].sub
                        ));
                        // Its generation failed while it slept: it goes on until it
                        // notices (within the detection delay) or is fenced.
                        let at = self.tick + 1 + self.rng.below(8 * self.n as u64 + 20);
                        self.procs[i].life = Life::Stopping(at);
                    }
                    Life::Hung { until, watchdog } if until <= self.tick => {
                        let (r, g) = (self.procs[i].rank, self.procs[i].gen);
                        if watchdog {
                            self.note(format!("rank {r} of generation {g}: a filesystem call outlasted fs-timeout; its watchdog ends it"));
                            self.s.watchdog_ends += 1;
                            self.fails(i);
                        } else if self.failed_generations.contains(&g) {
                            // Its generation failed during the hang: it notices soon.
                            let at = self.tick + 1 + self.rng.below(8 * self.n as u64 + 20);
                            self.procs[i].life = Life::Stopping(at);
                        } else {
                            self.procs[i].life = Life::Running;
                        }
                    }
                    Life::Stopping(t) if t <= self.tick => {
                        self.procs[i].life = Life::Stopped;
                        let r = self.procs[i].rank;
                        self.note(format!(
                            "rank {r} of generation {} stops: a peer failed",
                            self.procs[i].gen
                        ));
                    }
                    _ => {}
                }
            }
            self.procs.retain(|p| p.life != Life::Stopped);
            // The launcher, once no rank of the current generation runs.
            let current_runs = self.procs.iter().any(|p| {
                p.gen == self.disk.gen
                    && matches!(
                        p.life,
                        Life::Running | Life::Stopping(_) | Life::Hung { .. }
                    )
            });
            let current_done = self
                .procs
                .iter()
                .filter(|p| p.gen == self.disk.gen && p.life == Life::Done)
                .count()
                == self.n;
            let quiet = |p: &Proc| matches!(p.life, Life::Stopped | Life::Done);
            let old_quiet = self
                .procs
                .iter()
                .all(|p| p.gen == self.disk.gen || quiet(p));
            if (current_done && old_quiet) || (self.complete && self.procs.iter().all(quiet)) {
                return self.finish();
            }
            if current_done || self.complete {
                // Waiting for older generations' nodes to end.
            } else if !current_runs {
                match self.restart_at {
                    None => self.restart_at = Some(self.tick + 1 + self.rng.below(50)),
                    Some(t) if t <= self.tick => {
                        self.restart_at = None;
                        // A restart after the last commit finds the run complete.
                        self.complete = !self.start_generation();
                    }
                    Some(_) => {}
                }
            }
            // One tick of one running process.
            let runnable: Vec<usize> = (0..self.procs.len())
                .filter(|&i| matches!(self.procs[i].life, Life::Running | Life::Stopping(_)))
                .collect();
            if runnable.is_empty() {
                continue;
            }
            let i = runnable[self.rng.below(runnable.len() as u64) as usize];
            self.advance(i)?;
            self.check()?;
        }
    }

    /// Invariants of the directory after every tick.
    fn check(&mut self) -> Result<(), Violation> {
        self.s.checks += 1;
        if let Some(l) = self.disk.latest {
            if !self.disk.checkpoints.contains_key(&l) {
                return Err(self.violation(format!(
                    "LATEST names iteration {l}, whose checkpoint is not committed"
                )));
            }
        }
        Ok(())
    }

    /// Every rank's journal as it is on disk (complete lines).
    fn journals(&self) -> Vec<Vec<Entry>> {
        self.disk
            .journals
            .iter()
            .map(|t| journal::parse(t))
            .collect()
    }

    /// A commit or journal append by process `i`: the node checked the fence just before.
    /// Err when the fence stopped it (Ok(false)) or when a fenced node got through (a
    /// violation).
    fn fence(&mut self, i: usize, what: &str) -> Result<bool, Violation> {
        let current = cluster(self.disk.gen);
        let p = &self.procs[i];
        let verdict = fence::check_with(p.gen, RUN, Seen::Cluster(&current), self.mutations.fence);
        match verdict {
            Ok(()) if p.gen != self.disk.gen => Err(self.violation(format!(
                "rank {} of generation {} was allowed to {what} after generation {} replaced it",
                p.rank, p.gen, self.disk.gen
            ))),
            Ok(()) => Ok(true),
            Err(why) => {
                let r = p.rank;
                self.note(format!("rank {r} fenced: {why}: did not {what}"));
                self.s.fenced += 1;
                self.procs[i].life = Life::Stopped;
                Ok(false)
            }
        }
    }

    fn advance(&mut self, i: usize) -> Result<(), Violation> {
        let (rank, gen) = (self.procs[i].rank, self.procs[i].gen);
        let it = self.procs[i].iteration();
        let step = match self.procs[i].step {
            Some(step) => step,
            None => match self.procs[i].walk.next_step() {
                Some(step) => {
                    self.procs[i].step = Some(step);
                    step
                }
                None => {
                    self.next_iteration(i);
                    return Ok(());
                }
            },
        };
        match step {
            // Entering a phase and the server's steps take no time here.
            Step::Enter(_) | Step::StopServer | Step::RestartServer { .. } => {
                self.procs[i].step = None;
                return Ok(());
            }
            Step::Barrier(b) => {
                let n = self.n;
                let arrived = self
                    .disk
                    .arrived
                    .entry((gen, it, b.name()))
                    .or_insert_with(|| vec![false; n]);
                arrived[rank as usize] = true;
                if arrived.iter().all(|a| *a) {
                    // What rank 0 broadcasts with the release.
                    let interval = self.eval_interval;
                    let walk = &mut self.procs[i].walk;
                    match b {
                        Barrier::FilesReady => {
                            walk.eval_decided(walk::eval_decision(RolloutSplit::All, it, interval))
                        }
                        Barrier::TrainingComplete => {
                            walk.training_released(None);
                        }
                        _ => {}
                    }
                    self.procs[i].step = None;
                }
                return Ok(());
            }
            _ => {}
        }
        match self.procs[i].sub {
            Sub::Start => {
                let p = &self.procs[i];
                let skip = match step {
                    Step::Train { reuse } => reuse,
                    // `Node::once`, and `journal_item` for the completion.
                    s => journal::has(&p.journal, RUN, it, item_of(s)),
                };
                if skip {
                    self.note(format!(
                        "rank {rank} reuses {} of iteration {it}",
                        item_of(step)
                    ));
                    self.procs[i].step = None;
                    return Ok(());
                }
                // Training is a gang (torchrun): a generation redoes it together, and must
                // not redo an iteration every rank had journaled as trained when it began.
                if matches!(step, Step::Train { .. })
                    && self
                        .trained_at_start
                        .get(&gen)
                        .is_some_and(|t| t.contains(&it))
                {
                    return Err(self.violation(format!(
                        "rank {rank} of generation {gen} starts training iteration {it}, which every rank had journaled as trained when the generation began"
                    )));
                }
                self.procs[i].sub = if step == Step::Complete {
                    Sub::Journal
                } else {
                    Sub::Command(1 + self.rng.below(4) as u32)
                };
            }
            Sub::Command(left) if left > 1 => self.procs[i].sub = Sub::Command(left - 1),
            Sub::Command(_) => {
                if self.fail_one_in > 0 && self.rng.below(self.fail_one_in) == 0 {
                    self.s.failed_commands += 1;
                    self.note(format!(
                        "rank {rank}'s {} command of iteration {it} fails",
                        item_of(step)
                    ));
                    self.fails(i);
                    return Ok(());
                }
                self.procs[i].sub = Sub::Commit;
            }
            Sub::Commit => {
                if self.hangs(i, step, "commit") {
                    return Ok(());
                }
                if !self.fence(i, &format!("commit {} of iteration {it}", item_of(step)))? {
                    return Ok(());
                }
                if self.write_fails(i, step, "commit") {
                    return Ok(());
                }
                self.commit(i, step)?;
                self.procs[i].sub = if step == Step::Handoff {
                    Sub::Latest
                } else {
                    Sub::Journal
                };
            }
            Sub::Latest => {
                if !self.fence(i, &format!("publish LATEST = iteration {it}"))? {
                    return Ok(());
                }
                self.disk.latest = Some(it);
                self.note(format!("rank 0 publishes LATEST = iteration {it}"));
                self.procs[i].sub = Sub::Journal;
            }
            Sub::Journal => {
                if self.hangs(i, step, "journal") {
                    return Ok(());
                }
                let item = item_of(step);
                if !self.fence(i, &format!("journal {item} of iteration {it}"))? {
                    return Ok(());
                }
                if self.write_fails(i, step, "journal") {
                    return Ok(());
                }
                self.journal_append(i, step)?;
                self.procs[i].step = None;
                self.procs[i].sub = Sub::Start;
            }
        }
        Ok(())
    }

    /// The fence's read of `cluster.json` before a commit or a journal append hangs: the
    /// step is redone when the call returns, or the node's watchdog ends it after
    /// fs-timeout. True when it hung.
    fn hangs(&mut self, i: usize, step: Step, what: &str) -> bool {
        const FS_TIMEOUT: u64 = 40;
        if self.hang_one_in == 0 || self.rng.below(self.hang_one_in) != 0 {
            return false;
        }
        let ticks = 1 + self.rng.below(2 * FS_TIMEOUT);
        self.s.hangs += 1;
        let rank = self.procs[i].rank;
        self.note(format!(
            "rank {rank}'s read of cluster.json before its {what} of {} hangs for {ticks} ticks",
            item_of(step)
        ));
        self.procs[i].life = Life::Hung {
            until: self.tick + ticks.min(FS_TIMEOUT),
            watchdog: ticks >= FS_TIMEOUT,
        };
        true
    }

    /// The write of a commit or a journal append (after the fence) fails with ENOSPC or
    /// EIO: the node stops with the error and its generation fails; a journal append may
    /// have written part of its line. True when it failed.
    fn write_fails(&mut self, i: usize, step: Step, what: &str) -> bool {
        if self.store_error_one_in == 0 || self.rng.below(self.store_error_one_in) != 0 {
            return false;
        }
        let (rank, gen) = (self.procs[i].rank, self.procs[i].gen);
        let error = ["No space left on device", "Input/output error"][self.rng.below(2) as usize];
        self.s.store_errors += 1;
        if what == "journal" && self.rng.below(2) == 0 {
            self.torn_append(i);
        }
        self.note(format!(
            "rank {rank} of generation {gen} cannot {what} {}: {error}; it stops",
            item_of(step)
        ));
        self.fails(i);
        true
    }

    /// Commit process `i`'s output of `step`, as the node does: an earlier attempt's
    /// output (committed, not journaled) is set aside first, never replaced or merged.
    fn commit(&mut self, i: usize, step: Step) -> Result<(), Violation> {
        let (rank, gen) = (self.procs[i].rank, self.procs[i].gen);
        let it = self.procs[i].iteration();
        let out = |content| Output { gen, rank, content };
        let n = self.n as u32;
        match step {
            Step::Rollout(split) => {
                let key = (split.name(), it, rank);
                if self.disk.shards.remove(&key).is_some() {
                    self.disk.set_aside += 1;
                }
                let content = shard_content(split.name(), it, rank);
                self.disk.shards.insert(key, out(content));
            }
            Step::Aggregate(split) => {
                let mut parts = Vec::new();
                for r in 0..n {
                    match self.disk.shards.get(&(split.name(), it, r)) {
                        Some(o) => parts.push(o.content),
                        None => {
                            return Err(self.violation(format!(
                            "rank 0 merges the {} split of iteration {it} without rank {r}'s shard",
                            split.name()
                        )))
                        }
                    }
                }
                if self.disk.merged.remove(&(split.name(), it)).is_some() {
                    self.disk.set_aside += 1;
                }
                let content = merged_content(parts.into_iter());
                self.disk.merged.insert((split.name(), it), out(content));
            }
            Step::Prepare => {
                let Some(m) = self.disk.merged.get(&("train", it)).copied() else {
                    return Err(self.violation(format!(
                        "rank 0 prepares iteration {it} with no merged training data"
                    )));
                };
                if self.disk.prepared.remove(&it).is_some() {
                    self.disk.set_aside += 1;
                }
                self.disk
                    .prepared
                    .insert(it, out(prepared_content(m.content)));
            }
            Step::Train { .. } => {
                let Some(p) = self.disk.prepared.get(&it).copied() else {
                    return Err(self.violation(format!(
                        "rank {rank} trains iteration {it} with no prepared data"
                    )));
                };
                // A training's output directory is its generation's own.
                let content = trained_content(p.content, rank);
                self.disk.trained.insert((it, rank), out(content));
            }
            Step::Handoff => {
                let mut parts = Vec::new();
                for r in 0..n {
                    match self.disk.trained.get(&(it, r)) {
                        Some(o) => parts.push(o.content),
                        None => {
                            return Err(self.violation(format!(
                                "rank 0 hands off iteration {it} without rank {r}'s training output"
                            )))
                        }
                    }
                }
                if self.disk.checkpoints.remove(&it).is_some() {
                    self.disk.set_aside += 1;
                }
                let content = checkpoint_content(parts.into_iter());
                self.disk.checkpoints.insert(it, out(content));
            }
            other => unreachable!("{other:?} commits nothing"),
        }
        self.note(format!(
            "rank {rank} of generation {gen} commits {} of iteration {it}",
            item_of(step)
        ));
        Ok(())
    }

    /// Append the journal entry of `step`, checking that it records this attempt's own
    /// output and is not there already.
    fn journal_append(&mut self, i: usize, step: Step) -> Result<(), Violation> {
        let (rank, gen, it) = (
            self.procs[i].rank,
            self.procs[i].gen,
            self.procs[i].iteration(),
        );
        let item = item_of(step);
        let on_disk = journal::parse(&self.disk.journals[rank as usize]);
        if journal::has(&on_disk, RUN, it, item) {
            if matches!(step, Step::Train { .. }) {
                // A redo of training that succeeded like the attempt before it leaves the
                // journal as it was (`journal_train`).
                return Ok(());
            }
            return Err(self.violation(format!(
                "rank {rank} of generation {gen} journals {item} of iteration {it} a second time"
            )));
        }
        let own = match step {
            Step::Rollout(split) => self.disk.shards.get(&(split.name(), it, rank)),
            Step::Aggregate(split) => self.disk.merged.get(&(split.name(), it)),
            Step::Prepare => self.disk.prepared.get(&it),
            Step::Train { .. } => self.disk.trained.get(&(it, rank)),
            Step::Handoff => self.disk.checkpoints.get(&it),
            _ => None,
        };
        if step != Step::Complete && own.is_none_or(|o| (o.gen, o.rank) != (gen, rank)) {
            return Err(self.violation(format!(
                "rank {rank} of generation {gen} journals {item} of iteration {it} over another attempt's output ({own:?})"
            )));
        }
        let line = self.journal_line(i);
        self.disk.journals[rank as usize].push_str(&line);
        let entry: Entry = serde_json::from_str(&line).unwrap();
        self.procs[i].journal.push(entry);
        Ok(())
    }

    /// The walk of the current iteration is complete: on to the next, or done.
    fn next_iteration(&mut self, i: usize) {
        let next = self.procs[i].iteration() + 1;
        if next > self.iterations {
            self.procs[i].life = Life::Done;
            return;
        }
        let cfg = self.walk_config(self.procs[i].rank);
        let resume = self.procs[i].resume;
        self.procs[i].walk = IterationWalk::new(cfg, next, resume);
    }

    /// The end: what was committed equals what an uninterrupted run commits.
    fn finish(mut self) -> Result<Summary, Violation> {
        let n = self.n as u32;
        for it in 1..=self.iterations {
            let merged = |split| merged_content((0..n).map(|r| shard_content(split, it, r)));
            let prepared = prepared_content(merged("train"));
            let trained: Vec<u64> = (0..n).map(|r| trained_content(prepared, r)).collect();
            let checkpoint = checkpoint_content(trained.iter().copied());
            let eval = walk::eval_decision(RolloutSplit::All, it, self.eval_interval);
            for (split, due) in [("train", true), ("eval", eval)] {
                let got = self.disk.merged.get(&(split, it)).map(|o| o.content);
                if got != due.then(|| merged(split)) {
                    return Err(self.violation(format!(
                        "iteration {it}'s merged {split} data is {got:?}, not what an uninterrupted run merges"
                    )));
                }
            }
            let got = self.disk.checkpoints.get(&it).map(|o| o.content);
            if got != Some(checkpoint) {
                return Err(self.violation(format!(
                    "iteration {it}'s checkpoint is {got:?}, not what an uninterrupted run trains"
                )));
            }
            for (r, j) in self.journals().iter().enumerate() {
                for item in [item::ROLLOUT_TRAIN, WALK] {
                    let times = j
                        .iter()
                        .filter(|e| e.iteration == it && e.item == item)
                        .count();
                    if times != 1 {
                        return Err(self.violation(format!(
                            "rank {r} journaled {item} of iteration {it} {times} times"
                        )));
                    }
                }
            }
        }
        if self.disk.latest != Some(self.iterations) {
            return Err(self.violation(format!(
                "LATEST is {:?} at the end, not iteration {}",
                self.disk.latest, self.iterations
            )));
        }
        self.s.ticks = self.tick;
        self.s.set_aside = self.disk.set_aside;
        self.s.checks += self.iterations * (3 + 2 * n as u64);
        Ok(self.s)
    }
}

/// Run `seeds` seeds from `first` with 1..=max_nodes nodes; the first violation.
pub fn sweep(
    first: u64,
    seeds: u64,
    max_nodes: u64,
    mutations: Mutations,
) -> Result<Summary, Violation> {
    super::sweep(first, seeds, max_nodes, |seed, n| {
        Sim::new(seed, n, mutations).run()
    })
}

impl std::ops::AddAssign for Summary {
    fn add_assign(&mut self, o: Summary) {
        self.ticks += o.ticks;
        self.kills += o.kills;
        self.torn += o.torn;
        self.failed_commands += o.failed_commands;
        self.store_errors += o.store_errors;
        self.hangs += o.hangs;
        self.watchdog_ends += o.watchdog_ends;
        self.frozen += o.frozen;
        self.fenced += o.fenced;
        self.generations += o.generations;
        self.set_aside += o.set_aside;
        self.checks += o.checks;
    }
}

impl Summary {
    /// Faults injected: kills, torn appends, failed commands, write errors, hung calls and
    /// nodes frozen through a restart.
    pub fn faults(&self) -> u64 {
        self.kills + self.torn + self.failed_commands + self.store_errors + self.hangs + self.frozen
    }

    pub fn line(&self) -> String {
        format!(
            "{} ticks, {} generations; faults: {} kills (-9), {} torn journal appends, {} failed commands, {} ENOSPC/EIO, {} hung calls ({} ended by the watchdog), {} nodes frozen through a restart; {} commits fenced, {} earlier outputs set aside; {} invariant checks",
            self.ticks,
            self.generations,
            self.kills,
            self.torn,
            self.failed_commands,
            self.store_errors,
            self.hangs,
            self.watchdog_ends,
            self.frozen,
            self.fenced,
            self.set_aside,
            self.checks
        )
    }
}

#[test]
fn a_thousand_seeds_of_crashes_and_restarts_keep_the_invariants() {
    match sweep(1, 1_000, 16, Mutations::default()) {
        Ok(s) => {
            // The faults were really exercised.
            assert!(
                s.kills > 500 && s.torn > 20 && s.fenced > 20,
                "{}",
                s.line()
            );
            assert!(s.generations > 1_500, "{}", s.line());
        }
        Err(v) => panic!("{v}"),
    }
}

#[test]
fn the_same_crash_seed_replays_the_same_run() {
    super::assert_replays(77, |seed| {
        Sim::new(seed, 9, Mutations::default())
            .run()
            .map(|s| s.line())
    });
}

fn caught(m: Mutations) -> Violation {
    super::caught(|first, seeds, nodes| sweep(first, seeds, nodes, m))
}

/// The simulator has teeth: a fence that lets a node of a replaced generation commit
/// is caught …
#[test]
fn a_fenced_node_that_commits_is_caught() {
    let v = caught(Mutations {
        fence: Some(fence::Mutation::Open),
        ..Mutations::default()
    });
    assert!(v.what.contains("after generation"), "{v}");
}

/// … and so is a restart that resumes where the furthest rank got, not the slowest.
#[test]
fn a_resume_point_past_unfinished_work_is_caught() {
    let v = caught(Mutations {
        resume: Some(journal::Mutation::FromFastest),
        ..Mutations::default()
    });
    assert!(
        v.what.contains("0 times") || v.what.contains("not what"),
        "{v}"
    );
}
