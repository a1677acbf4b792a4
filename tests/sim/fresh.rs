//! Every rank started at once with `--fresh` over a run already in the directory, as `srun`
//! starts a job's nodes with one command line: the node's own driver
//! (`rl_node::run_in_process_with`) under the seeded scheduler, as in `nodes`, replayed
//! exactly by the seed. A worker may look before rank 0 has set the old run aside, or
//! after: it must neither end at the old run nor miss the new one.
//!
//! Each seed draws a cluster, its caches, clocks and training commands as `nodes` does
//! (`nodes::draw`, without its faults), and a first run of it, started without `--fresh`:
//! run to its end, or killed whole at a random time after its rank 0 started the
//! generation (while it forms, mid-iteration, or after its end), by the batch system
//! (scancel: the processes die, their files stay) or by every machine crashing (what was
//! not synced is lost). Then the batch system starts every rank with `--fresh` in a random
//! order, each up to a second after the one before (often at the same instant): with the
//! caches the first run left (over a finished run), or as new processes with empty caches
//! (over a killed one).
//!
//! Checked for every seed:
//! - the job ends: no task waits forever and it ends within the simulated time limit;
//! - every rank of the `--fresh` start completes: none exits 0 with "nothing to do" (the
//!   run set aside was complete), none stops, and so rank 0 does not wait for a worker
//!   until join-timeout;
//! - the new run has a run id of its own, one generation, and every rank's journal
//!   complete in it;
//! - the first run is set aside whole: every file it left in the run's directories is in
//!   `previous-runs/<its run id>/` with the same content, and every other file it left
//!   (the metrics) still begins with what it held.

use crate::nodes::{self, clients, inject, node_clock, snapshot, text, train_script, Case};
use crate::nodes::{Fault, Summary, ROOT};
use crate::Violation;
use rl_node::layout::{Layout, RUN_DIRS};
use rl_node::protocol::join::Mutation;
use rl_node::protocol::journal;
use rl_node::rng::SplitMix64 as Rng;
use rl_node::sched::{Sched, TaskHandle};
use rl_node::store::sim::{FaultError, SimClient, SimWorld};
use rl_node::{Broken, FakeScript, InProcess, Outcome};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type RankResult = Result<Outcome, (i32, String)>;

/// One seed's first run and `--fresh` start.
#[derive(Debug, Clone)]
struct FreshCase {
    /// The cluster, caches and training commands (its faults are not used).
    base: Case,
    /// The first run is killed whole this long after its rank 0 started its generation
    /// (None: it runs to its end).
    killed_at: Option<Duration>,
    /// Killed by its machines crashing (losing what they did not sync), else by the batch
    /// system (scancel: the processes die, their files stay as they were).
    crashed: bool,
    /// The `--fresh` start: each rank, in the order the batch system starts them, and when,
    /// after the start began.
    order: Vec<(u32, Duration)>,
}

fn draw(seed: u64, max_nodes: u64) -> FreshCase {
    let base = nodes::draw(seed, max_nodes);
    let mut rng = Rng::new(seed ^ 0x0f4e_5400);
    // An iteration takes its training command and some 10 to 30 s of barriers.
    let run = (base.train + Duration::from_secs(30)) * base.iterations as u32;
    let killed_at =
        (rng.below(2) == 0).then(|| Duration::from_millis(rng.below(run.as_millis() as u64 + 1)));
    let crashed = rng.below(2) == 0;
    let mut ranks: Vec<u32> = (0..base.nodes).collect();
    for i in (1..ranks.len()).rev() {
        ranks.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut at = Duration::ZERO;
    let order = ranks
        .into_iter()
        .map(|rank| {
            if rng.below(3) != 0 {
                at += Duration::from_millis(rng.below(1_000));
            }
            (rank, at)
        })
        .collect();
    FreshCase {
        base,
        killed_at,
        crashed,
        order,
    }
}

/// What one seed's job did.
#[derive(Clone, Default)]
struct Job {
    log: Vec<String>,
    /// The first run's results, rank by rank.
    first: Vec<RankResult>,
    /// Every file the first run left, with its content, as the `--fresh` start began.
    old: Vec<(PathBuf, Vec<u8>)>,
    /// The `--fresh` start's results, rank by rank, and when each ended after it began.
    fresh: Vec<(RankResult, Duration)>,
    turns: u64,
    digest: u64,
    ended_at: Duration,
}

/// Start rank `rank` on its machine `client`, as `start.0` says, `start.1` from now.
fn start_rank(
    sched: &Arc<Sched>,
    config: &Path,
    (rank, client): (u32, Arc<SimClient>),
    rng: &mut Rng,
    script: Arc<FakeScript>,
    start: (InProcess, Duration),
) -> TaskHandle<RankResult> {
    let clock = node_clock(sched, rng);
    let (s, config) = (sched.clone(), config.to_path_buf());
    let name = match start.0.fresh {
        true => format!("--fresh rank {rank}"),
        false => format!("first run rank {rank}"),
    };
    sched
        .spawn(&name, move || {
            s.sleep(start.1);
            rl_node::run_in_process_with(&config, rank, client, clock, script, start.0)
        })
        .expect("spawn a rank")
}

/// Kill the first run whole, if the case says so, `killed_at` after its generation started:
/// every process (each call of its client fails from then on, as after a kill -9), and
/// maybe every machine with it.
fn kill_first_run(
    sched: &Arc<Sched>,
    world: &SimWorld,
    machines: &[Arc<SimClient>],
    case: &FreshCase,
) {
    let Some(at) = case.killed_at else {
        return;
    };
    // Once the run exists (its generation is in the history): a kill before anything was
    // written leaves no run to set aside.
    let history = Layout::new(ROOT).history();
    let give_up = sched.now() + Duration::from_secs(600);
    while world.content(&history).is_none() && sched.now() < give_up {
        sched.sleep(Duration::from_millis(100));
    }
    if case.crashed {
        let kills = (0..case.base.nodes)
            .map(|rank| Fault::Kill { rank, at })
            .collect();
        return inject(sched, machines, kills);
    }
    sched.sleep(at);
    for m in machines {
        m.fail_next(None, u64::MAX, FaultError::Errno(libc::EIO));
    }
}

/// The batch system: the first run (killed or not), then every rank with `--fresh`.
fn batch_system(
    sched: &Arc<Sched>,
    world: &Arc<SimWorld>,
    job: &Mutex<Job>,
    case: &FreshCase,
    config: &Path,
    seed: u64,
    broken: Broken,
) {
    let mut rng = Rng::new(seed ^ 0x000b_a7c4);
    let base = &case.base;
    let script = train_script(base.train, Vec::new());
    let machines = clients(sched, world, base);
    let ranks: Vec<_> = (0..base.nodes)
        .map(|rank| {
            let machine = (rank, machines[rank as usize].clone());
            let first = (InProcess::default(), Duration::ZERO);
            start_rank(sched, config, machine, &mut rng, script.clone(), first)
        })
        .collect();
    let injector = {
        let (s, world) = (sched.clone(), world.clone());
        let (machines, case) = (machines.clone(), case.clone());
        sched
            .spawn("the first run's kill", move || {
                kill_first_run(&s, &world, &machines, &case)
            })
            .expect("spawn the kill")
    };
    let first: Vec<RankResult> = ranks
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect();
    injector.join().expect("the kill panicked");
    let mut old = Vec::new();
    snapshot(world, Path::new(ROOT), &mut old);
    {
        let mut j = job.lock().unwrap();
        j.log.push(format!(
            "first run (killed at {:?}, crashed: {}): {first:?}",
            case.killed_at, case.crashed
        ));
        j.first = first;
        j.old = old;
    }
    // After a kill, new processes: clients of their own with empty caches.
    let machines = match case.killed_at {
        Some(_) => clients(sched, world, base),
        None => machines,
    };
    let began = sched.now();
    let fresh = InProcess {
        fresh: true,
        broken,
    };
    let mut ranks: Vec<_> = case
        .order
        .iter()
        .map(|&(rank, at)| {
            let machine = (rank, machines[rank as usize].clone());
            let h = start_rank(
                sched,
                config,
                machine,
                &mut rng,
                script.clone(),
                (fresh, at),
            );
            (rank, h)
        })
        .collect();
    ranks.sort_by_key(|r| r.0);
    let mut results = Vec::new();
    for (_, h) in ranks {
        let r = h.join().expect("a rank panicked");
        results.push((r, sched.now() - began));
    }
    let mut j = job.lock().unwrap();
    j.log.push(format!(
        "--fresh start (rank, at) {:?}: {results:?}",
        case.order
    ));
    j.fresh = results;
}

fn run_job(
    seed: u64,
    case: &FreshCase,
    config: &Path,
    broken: Broken,
) -> (Result<(), String>, Arc<SimWorld>, Job) {
    let sched = Sched::new(seed, Duration::from_secs(3_600 * 3));
    let world = SimWorld::new();
    world
        .create_dir_all(Path::new(ROOT))
        .expect("the shared directory");
    crate::truth::keep(&world);
    let job = Arc::new(Mutex::new(Job::default()));
    let batch = {
        let (sched, world, job, case) = (sched.clone(), world.clone(), job.clone(), case.clone());
        let config = config.to_path_buf();
        move || batch_system(&sched, &world, &job, &case, &config, seed, broken)
    };
    sched.spawn("batch system", batch).expect("spawn");
    let (ended, mut job) = crate::nodes::run_to_end(&sched, job);
    job.turns = sched.turns();
    job.digest = sched.digest();
    job.ended_at = sched.now();
    (ended, world, job)
}

/// Every rank of the `--fresh` start completed; else what each that did not did.
fn check_fresh_ranks(job: &Job, nodes: u32) -> Result<u64, String> {
    if job.fresh.len() != nodes as usize {
        return Err(format!(
            "{} of {nodes} ranks of the --fresh start ended",
            job.fresh.len()
        ));
    }
    let mut wrong = Vec::new();
    for (rank, (r, at)) in job.fresh.iter().enumerate() {
        match r {
            Ok(Outcome::Completed) => {}
            Ok(Outcome::AlreadyComplete(n)) => wrong.push(format!(
                "rank {rank} exited 0 after {at:?} with \"nothing to do\": {}",
                n.message
            )),
            Err((code, m)) if rank == 0 && m.contains("join-timeout") => wrong.push(format!(
                "rank 0 waited for its workers until join-timeout ({at:?}, exit {code}): {m}"
            )),
            Err((code, m)) => wrong.push(format!(
                "rank {rank} stopped after {at:?} (exit {code}): {m}"
            )),
        }
    }
    if wrong.is_empty() {
        Ok(nodes as u64)
    } else {
        Err(format!(
            "the --fresh start did not form the new run: {}",
            wrong.join("; ")
        ))
    }
}

/// The new run: a run id of its own, one generation, every rank's journal complete.
fn check_new_run(world: &SimWorld, case: &FreshCase, old_run: Option<&str>) -> Result<u64, String> {
    let layout = Layout::new(ROOT);
    let cluster: serde_json::Value = serde_json::from_str(&text(world, &layout.cluster()))
        .map_err(|e| format!("cluster.json: {e}"))?;
    let run_id = cluster["run_id"].as_str().unwrap_or_default();
    if Some(run_id) == old_run || cluster["gen"] != 1 {
        return Err(format!("not a new run's first generation: {cluster}"));
    }
    let history = text(world, &layout.history());
    if history.lines().count() != 1 || !history.contains(&format!("\"run_id\":\"{run_id}\"")) {
        return Err(format!("not one generation of run {run_id}: {history}"));
    }
    for rank in 0..case.base.nodes {
        let entries = journal::parse(&text(world, &layout.journal(rank)));
        let last_item = entries.last().map(|e| e.item.clone()).unwrap_or_default();
        if journal::last_complete(&entries, run_id, &last_item) != case.base.iterations {
            return Err(format!(
                "rank {rank}'s journal is not complete in run {run_id}: {entries:?}"
            ));
        }
    }
    Ok(2 + case.base.nodes as u64)
}

/// The first run, set aside whole: its files in the run's directories are under
/// `previous-runs/<run id>/` as they were; the others still begin with what they held.
fn check_set_aside(
    world: &SimWorld,
    old: &[(PathBuf, Vec<u8>)],
    old_run: Option<&str>,
) -> Result<u64, String> {
    let aside = Layout::new(ROOT).previous_runs();
    let names = world.list(&aside).unwrap_or_default();
    let mut checks = 0;
    for (path, data) in old {
        checks += 1;
        let rel = path.strip_prefix(ROOT).expect("under the root");
        if !RUN_DIRS.iter().any(|d| rel.starts_with(d)) {
            if !world.content(path).unwrap_or_default().starts_with(data) {
                return Err(format!("{} of the first run was changed", rel.display()));
            }
            continue;
        }
        let [name] = names.as_slice() else {
            return Err(format!(
                "previous-runs/ holds {names:?}, not the one run set aside"
            ));
        };
        if old_run.is_some_and(|r| name.to_str() != Some(r)) {
            return Err(format!("previous-runs/{name:?} is not run {old_run:?}"));
        }
        let moved = aside.join(name).join(rel);
        if world.content(&moved).as_ref() != Some(data) {
            return Err(format!(
                "{} of the first run is not in {} as it was",
                rel.display(),
                moved.display()
            ));
        }
    }
    Ok(checks)
}

/// Run one seed and check it: its summary and its replay line.
pub fn run_seed(seed: u64, max_nodes: u64) -> Result<(Summary, String), Violation> {
    run_seed_broken(seed, max_nodes, Broken::default())
}

pub(crate) fn run_seed_broken(
    seed: u64,
    max_nodes: u64,
    broken: Broken,
) -> Result<(Summary, String), Violation> {
    let case = draw(seed, max_nodes);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = nodes::config(dir.path(), &case.base);
    let (ended, world, job) = run_job(seed, &case, &config, broken);
    let violation = |what: String| Violation {
        seed,
        what: format!("{what}\ncase: {case:?}"),
        trace: job.log.clone(),
    };
    ended.map_err(|e| violation(format!("the job did not end: {e}")))?;
    let mut checks = 1;
    if case.killed_at.is_none()
        && !job
            .first
            .iter()
            .all(|r| matches!(r, Ok(Outcome::Completed)))
    {
        return Err(violation("the first run did not complete".into()));
    }
    let old_run = job
        .old
        .iter()
        .find(|(p, _)| *p == Layout::new(ROOT).cluster())
        .and_then(|(_, c)| serde_json::from_slice::<serde_json::Value>(c).ok())
        .and_then(|c| c["run_id"].as_str().map(str::to_string));
    checks += check_fresh_ranks(&job, case.base.nodes).map_err(violation)?;
    checks += check_new_run(&world, &case, old_run.as_deref()).map_err(violation)?;
    checks += check_set_aside(&world, &job.old, old_run.as_deref()).map_err(violation)?;
    // The new run's only: its generations reuse the names of those set aside.
    let layout = std::slice::from_ref(&Layout::new(ROOT)).to_vec();
    let deaths = crate::truth::check_deaths(&world, &layout, case.base.judging())
        .map_err(|e| violation(format!("a death declared too soon: {e}")))?;
    let releases = crate::truth::check_barriers(&world, &layout)
        .map_err(|e| violation(format!("a barrier passed against the true arrivals: {e}")))?;
    let summary = Summary {
        runs: 1,
        starts: 2,
        faults: case.killed_at.map_or(0, |_| case.base.nodes as u64),
        turns: job.turns,
        node_seconds: job.ended_at.as_secs_f64() * case.base.nodes as f64,
        checks,
        deaths,
        releases,
    };
    let line = format!(
        "seed {seed}: {} nodes, {} iterations, {:?} caches, first run killed at {:?} (crashed: {}), --fresh (rank, at) {:?}: {} turns, schedule {:016x}, directory {:016x}, ended at {:?}; {:?}",
        case.base.nodes,
        case.base.iterations,
        case.base.lifetime,
        case.killed_at,
        case.crashed,
        case.order,
        job.turns,
        job.digest,
        nodes::digest(&world, Path::new(ROOT)),
        job.ended_at,
        job.fresh,
    );
    Ok((summary, line))
}

/// Seeds `first..first+seeds` of 2..=max_nodes nodes.
pub fn sweep(first: u64, seeds: u64, max_nodes: u64) -> Result<Summary, Violation> {
    sweep_broken(first, seeds, max_nodes, Broken::default())
}

fn sweep_broken(
    first: u64,
    seeds: u64,
    max_nodes: u64,
    broken: Broken,
) -> Result<Summary, Violation> {
    let mut total = Summary::default();
    for seed in first..first + seeds {
        total += run_seed_broken(seed, max_nodes, broken)?.0;
    }
    Ok(total)
}

fn broken(m: Mutation) -> Broken {
    Broken {
        join: Some(m),
        ..Broken::default()
    }
}

/// The sweep's seeds and largest cluster: about 15 s in a debug build.
const SEEDS: u64 = 30;
const MAX_NODES: u64 = 4;

/// The first seed of the sweep that catches `m`, and what it found.
fn caught(m: Mutation) -> Violation {
    (1..=SEEDS)
        .find_map(|seed| run_seed_broken(seed, MAX_NODES, broken(m)).err())
        .unwrap_or_else(|| panic!("{m:?} not caught in {SEEDS} seeds"))
}

#[test]
fn the_same_seed_replays_the_same_fresh_start_exactly() {
    crate::assert_replays(3, |seed| run_seed(seed, MAX_NODES).map(|r| r.1));
}

#[test]
fn every_rank_started_at_once_with_fresh_forms_the_new_run() {
    let s = sweep(1, SEEDS, MAX_NODES).unwrap_or_else(|v| panic!("{v}"));
    println!(
        "fresh: seeds 1..{SEEDS} of 2..={MAX_NODES} nodes: {}",
        s.line()
    );
    assert!(s.faults > 0, "no first run was killed: {s:?}");
}

/// Skipped generations remembered by number only: a worker that skipped generation 1 of
/// the run set aside never joins generation 1 of the new run, and rank 0 waits for it
/// until join-timeout.
#[test]
fn skipped_generations_remembered_by_number_only_are_caught() {
    let v = caught(Mutation::SkippedByNumberOnly);
    println!("caught: {v}");
    assert!(
        v.what.contains("until join-timeout")
            && v.what.contains("no generation to join within join-timeout"),
        "{v}"
    );
}

/// The run read first taken as complete: a worker that looked before rank 0 set it aside
/// exits 0 with "nothing to do", and rank 0 waits for it until join-timeout.
#[test]
fn the_run_set_aside_taken_as_complete_is_caught() {
    let v = caught(Mutation::EndAtTheRunSetAside);
    println!("caught: {v}");
    assert!(
        v.what.contains("with \"nothing to do\"") && v.what.contains("join-timeout"),
        "{v}"
    );
}

/// Seed 5 of 2..=4 nodes: the first run was killed mid-iteration (scancel), and rank 1,
/// started 157 ms before rank 0, skipped its generation 1 (rank 0 running without it).
/// Remembered by number only, that skip hid the new run's generation 1.
#[test]
fn the_fresh_race_of_seed_5_a_worker_that_skipped_the_killed_runs_generation_1_joins_the_new_one() {
    let (_, line) = run_seed(5, MAX_NODES).unwrap_or_else(|v| panic!("{v}"));
    assert!(line.contains("crashed: false"), "{line}");
    let v = run_seed_broken(5, MAX_NODES, broken(Mutation::SkippedByNumberOnly))
        .expect_err("the mutation is not caught by seed 5");
    assert!(
        v.what
            .contains("rank 0 waited for its workers until join-timeout")
            && v.what.contains("rank 1 stopped")
            && v.what.contains("no generation to join within join-timeout"),
        "{v}"
    );
}

/// Seed 12 of 2..=4 nodes: over a finished run, ranks 3, 2 and 1 started up to 530 ms
/// before rank 0 and read the finished run first. Taken as complete, it ended them with
/// "nothing to do".
#[test]
fn the_fresh_race_of_seed_12_workers_that_looked_first_do_not_end_at_the_finished_run() {
    let (_, line) = run_seed(12, MAX_NODES).unwrap_or_else(|v| panic!("{v}"));
    assert!(line.contains("killed at None"), "{line}");
    let v = run_seed_broken(12, MAX_NODES, broken(Mutation::EndAtTheRunSetAside))
        .expect_err("the mutation is not caught by seed 12");
    assert!(
        v.what.contains("exited 0") && v.what.contains("nothing to do"),
        "{v}"
    );
}

/// Seed 106 of 2..=6 nodes (a 300-seed run found it): the first run was killed while its
/// generation formed, its rank 0's record at sequence number 3. Rank 1, started 471 ms
/// after rank 0, watched that record for dead-after; rank 0 judged it gone first, set the
/// run aside and started generation 1 of the new run, its record at sequence number 3 as
/// well. Rank 1 took it for the record it had watched for dead-after, judged the new rank
/// 0 gone at its first look, skipped the new run's generation 1 and waited until
/// join-timeout. A worker now watches each process's record on its own (by its nonce).
#[test]
fn the_fresh_race_of_seed_106_a_new_rank_0_record_is_not_judged_by_the_old_ones_watch() {
    let (_, line) = run_seed(106, 6).unwrap_or_else(|v| panic!("{v}"));
    assert!(line.contains("killed at Some(375ms)"), "{line}");
}
