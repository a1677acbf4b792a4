//! The node's own driver on the simulated shared directory.
//!
//! The other scenarios drive the protocol core's decisions; this one runs the real `Node`
//! (`rl_node::run_in_process`: the join, the walk of every iteration with its barriers,
//! watching peers, aborts, journals and the shut-down, without the process's plumbing) as
//! a cluster of threads in one process, each node on its own `SimClient` of one
//! `SimWorld`: NFS-like attribute and negative-lookup caches that age in real time, so
//! every rank sees the others' records late, as over NFS. The clock is the real one and
//! the threads are scheduled by the OS, so a run is not replayed step for step (the
//! `nodes` scenario runs the same driver seeded and replayed); what is checked is what
//! must hold for every schedule:
//!
//! - with caches that hide changes for a while, the cluster completes every iteration,
//!   and the shared directory then holds what an uninterrupted run leaves: one
//!   generation in `history.jsonl`, `cluster.json` naming it, every rank's record done,
//!   and every rank's journal complete for every iteration, each iteration once;
//! - with write errors injected into one rank's client at a random moment (ENOSPC or EIO,
//!   one to many calls), the cluster either completes as above (a heartbeat write that
//!   failed and was retried) or every node stops, and every node that stops names the
//!   same cause.
//!
//! - with training commands (started by the fake launcher: no process, a scripted exit),
//!   a failing one stops every node naming its rank, phase and exit; with
//!   `on-failure = "keep-model"` the run goes on and the failure is journaled; one that
//!   runs past its timeout is stopped and named.
//!
//! Other phases have no command here: their outputs would be read and written outside
//! the store. Their barriers run.

use crate::{completed, train_of};
use rl_node::clock::{Clock, SystemClock};
use rl_node::layout::Layout;
use rl_node::protocol::journal;
use rl_node::protocol::{NodeState, RankRecord};
use rl_node::rng::SplitMix64 as Rng;
use rl_node::store::sim::{SimClient, SimWorld};
use rl_node::store::{OpClass, SharedDir};
use rl_node::{FakeRun, FakeScript};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROOT: &str = "/sim-run";

/// A file's content on the server ("" if it does not exist).
fn text(world: &SimWorld, path: &Path) -> String {
    String::from_utf8(world.content(path).unwrap_or_default()).expect("utf-8")
}

/// Rank `rank`'s journal entries, as the server holds them.
fn journal_of(world: &SimWorld, rank: u32) -> Vec<journal::Entry> {
    journal::parse(&text(world, &Layout::new(ROOT).journal(rank)))
}

/// No rank journaled an item of an iteration twice: nothing committed was redone.
fn assert_nothing_twice(entries: &[journal::Entry], context: &str) {
    let mut seen = std::collections::HashSet::new();
    for e in entries {
        assert!(
            seen.insert((e.iteration, e.item.clone())),
            "{context}: {} of iteration {} journaled twice: {entries:?}",
            e.item,
            e.iteration
        );
    }
}

/// A cluster's configuration: `nodes` ranks, `iterations` iterations, fast timing (a
/// heartbeat every 50 ms, dead-after 3 s, well above the caches' lifetimes).
fn config(dir: &Path, nodes: u32, iterations: u64) -> std::path::PathBuf {
    config_with(dir, nodes, iterations, "")
}

/// [`config`] with more TOML (e.g. a `[phases.train]` table).
fn config_with(dir: &Path, nodes: u32, iterations: u64, more: &str) -> std::path::PathBuf {
    let path = dir.join("rl.toml");
    std::fs::write(
        &path,
        format!(
            "[cluster]\nnum-nodes = {nodes}\nlog-path = \"{ROOT}\"\niterations = {iterations}\n\
             [timing]\nheartbeat-interval = \"50ms\"\npoll-interval = \"20ms\"\ndead-after = \"3s\"\n\
             join-timeout = \"8s\"\n{more}"
        ),
    )
    .expect("write the configuration");
    path
}

/// Every command exits 0 at once (there are none unless a test configures them).
fn no_commands() -> Arc<FakeScript> {
    Arc::new(|_, _| FakeRun::Exit {
        after: Duration::ZERO,
        code: 0,
    })
}

/// A world with one client per node whose caches hide changes for `lifetime`.
fn world(nodes: u32, lifetime: Duration) -> (Arc<SimWorld>, Vec<Arc<SimClient>>) {
    let world = SimWorld::new();
    world
        .create_dir_all(Path::new(ROOT))
        .expect("the shared directory");
    let start = Instant::now();
    let clients = (0..nodes)
        .map(|_| Arc::new(world.client(move || start.elapsed(), lifetime, lifetime)))
        .collect();
    (world, clients)
}

/// Run every rank on its client, in threads; each rank's result.
fn run(config: &Path, clients: &[Arc<SimClient>]) -> Vec<Result<rl_node::Outcome, (i32, String)>> {
    run_scripted(config, clients, no_commands())
}

/// [`run`] with commands doing what `script` says.
fn run_scripted(
    config: &Path,
    clients: &[Arc<SimClient>],
    script: Arc<FakeScript>,
) -> Vec<Result<rl_node::Outcome, (i32, String)>> {
    spawn_scripted(config, clients, script)
        .into_iter()
        .map(|h| h.join().expect("a node panicked"))
        .collect()
}

/// What an uninterrupted run of `iterations` iterations leaves in the directory (read on
/// the server, not through a cache).
fn assert_complete(world: &SimWorld, nodes: u32, iterations: u64) {
    let layout = Layout::new(ROOT);
    let text = |p: &Path| {
        assert!(world.content(p).is_some(), "{} is missing", p.display());
        text(world, p)
    };
    let history = text(&layout.history());
    assert_eq!(history.lines().count(), 1, "one generation: {history}");
    let cluster: serde_json::Value =
        serde_json::from_str(&text(&layout.cluster())).expect("cluster.json parses");
    assert_eq!(cluster["gen"], 1, "{cluster}");
    let run_id = cluster["run_id"].as_str().expect("a run id").to_string();
    for rank in 0..nodes {
        let rec: RankRecord =
            serde_json::from_str(&text(&layout.rank_record(1, rank))).expect("a record");
        assert_eq!(rec.state, NodeState::Done, "rank {rank}: {rec:?}");
        let entries = journal_of(world, rank);
        // The journal's last item of an iteration is the walk's end of it.
        let last = entries.last().expect("entries").item.clone();
        for it in 1..=iterations {
            let done = entries
                .iter()
                .filter(|e| e.run_id == run_id && e.iteration == it && e.item == last)
                .count();
            assert_eq!(done, 1, "rank {rank}, iteration {it}: {entries:?}");
        }
        assert_eq!(
            journal::last_complete(&entries, &run_id, &last),
            iterations,
            "rank {rank}"
        );
    }
}

/// The real driver over NFS-like caches (100 ms and 500 ms: every record a rank reads is
/// up to that old; then 500 ms with close-to-open, as NFS mounted with `cto`) completes
/// every iteration, and the directory holds what an uninterrupted run leaves.
#[test]
fn the_nodes_driver_completes_a_run_through_stale_caches() {
    for (nodes, lifetime_ms, cto) in [(3, 100, false), (4, 500, false), (4, 500, true)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (world, clients) = world(nodes, Duration::from_millis(lifetime_ms));
        for c in &clients {
            c.set_close_to_open(cto);
        }
        let started = Instant::now();
        let results = run(&config(dir.path(), nodes, 2), &clients);
        // `scripts/sim --driver` prints this line.
        println!(
            "driver: {nodes} nodes, {lifetime_ms} ms caches{}: 2 iterations in {:.2} s (join and shut-down included)",
            if cto { " with close-to-open" } else { "" },
            started.elapsed().as_secs_f64()
        );
        for (rank, r) in results.iter().enumerate() {
            assert!(
                r.is_ok(),
                "{nodes} nodes, {lifetime_ms} ms caches, cto {cto}: rank {rank}: {r:?}"
            );
        }
        assert_complete(&world, nodes, 2);
        // Every rank's operations went through its client, and the caches answered some
        // of its reads.
        for (rank, c) in clients.iter().enumerate() {
            let (client, server) = (c.counts(), c.server_counts());
            assert!(client.get(OpClass::Rename) > 0, "rank {rank}: {client:?}");
            assert!(
                server.get(OpClass::Read) < client.get(OpClass::Read),
                "rank {rank}: the cache answered no read: {client:?} vs {server:?}"
            );
        }
    }
}

/// Write errors (ENOSPC or EIO) injected into one rank's client at a random moment: the
/// run completes, or every node stops and all name the same cause. Eight seeded cases.
#[test]
fn write_errors_on_one_client_complete_or_stop_every_node_with_one_cause() {
    for seed in 1..=8u64 {
        let mut rng = Rng::new(seed);
        let nodes = 3;
        let victim = rng.below(nodes as u64) as usize;
        let delay = Duration::from_millis(rng.below(1_500));
        let calls = [1, 3, 1_000_000][rng.below(3) as usize];
        let errno = if rng.below(2) == 0 {
            libc::ENOSPC
        } else {
            libc::EIO
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let (world, clients) = world(nodes, Duration::from_millis(100));
        let cfg = config(dir.path(), nodes, 2);
        let target = clients[victim].clone();
        let injector = std::thread::spawn(move || {
            std::thread::sleep(delay);
            target.fail_next(
                Some(OpClass::Write),
                calls,
                rl_node::store::sim::FaultError::Errno(errno),
            );
        });
        let results = run(&cfg, &clients);
        injector.join().expect("injector");
        let case = format!(
            "seed {seed}: rank {victim}'s writes fail ({} after {delay:?}, {calls} call(s))",
            if errno == libc::ENOSPC {
                "ENOSPC"
            } else {
                "EIO"
            }
        );
        if results.iter().all(|r| r.is_ok()) {
            println!("{case}: completed");
            assert_complete(&world, nodes, 2);
            continue;
        }
        println!("{case}: stopped: {results:?}");
        let failures: Vec<(usize, &(i32, String))> = results
            .iter()
            .enumerate()
            .filter_map(|(r, res)| res.as_ref().err().map(|e| (r, e)))
            .collect();
        assert_eq!(
            failures.len(),
            nodes as usize,
            "{case}: some nodes stopped, others completed: {results:?}"
        );
        // Every node names the failing rank (the cause), not a different one.
        for (rank, (code, message)) in &failures {
            assert_ne!(*code, 0, "{case}");
            let names_victim = message.contains(&format!("rank {victim}"))
                || (*rank == victim
                    && (message.contains("No space") || message.contains("Input/output")));
            assert!(names_victim, "{case}: rank {rank} says: {message}");
        }
    }
}

/// A node of the cluster "killed -9": from now on every call its client makes fails, so
/// it writes nothing more (its thread runs on until it gives up, invisible to the others),
/// and its machine crashes (what it wrote without a sync is lost).
fn kill(client: &SimClient) {
    client.fail_next(
        None,
        u64::MAX,
        rl_node::store::sim::FaultError::Errno(libc::EIO),
    );
    client.crash();
}

/// Kills at random moments, and the job restarted whole each time it ends without
/// completing (as a batch system's requeue does): the run resumes from the journals and
/// ends complete, with no iteration's item journaled twice by a rank, one run, and a
/// generation per start at most. Four seeded cases of one or two kills, rank 0's among
/// them.
#[test]
fn kills_and_requeues_resume_without_redoing_work() {
    for seed in 1..=4u64 {
        let mut rng = Rng::new(seed);
        let nodes = 3u32;
        let iterations = 3;
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = config(dir.path(), nodes, iterations);
        let (world, _) = world(0, Duration::ZERO);
        let start = Instant::now();
        let lifetime = Duration::from_millis(100);
        let kills = 1 + rng.below(2);
        let mut starts = 0;
        let mut log = Vec::new();
        loop {
            starts += 1;
            assert!(
                starts <= 6,
                "seed {seed}: not complete after 5 requeues: {log:?}"
            );
            let clients: Vec<Arc<SimClient>> = (0..nodes)
                .map(|_| Arc::new(world.client(move || start.elapsed(), lifetime, lifetime)))
                .collect();
            let killer = (starts as u64 <= kills).then(|| {
                // Every rank in turn across the cases, rank 0 too.
                let rank = (seed + starts as u64) as usize % nodes as usize;
                let victim = clients[rank].clone();
                let delay = Duration::from_millis(200 + rng.below(2_500));
                log.push(format!("start {starts}: kill rank {rank} after {delay:?}"));
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    kill(&victim);
                })
            });
            let results = run(&cfg, &clients);
            if let Some(k) = killer {
                k.join().expect("killer");
            }
            log.push(format!("start {starts}: {results:?}"));
            // Done: every rank completed, or found the run complete (exit 0).
            if results.iter().all(completed) {
                break;
            }
        }
        let layout = Layout::new(ROOT);
        let text = |p: &Path| text(&world, p);
        let history = text(&layout.history());
        let cluster: serde_json::Value =
            serde_json::from_str(&text(&layout.cluster())).expect("cluster.json");
        let run_id = cluster["run_id"].as_str().expect("run id").to_string();
        assert!(
            history
                .lines()
                .all(|l| l.contains(&format!("\"run_id\":\"{run_id}\""))),
            "seed {seed}: one run: {history}"
        );
        // Every generation formed is in the history (it is synced: a crash of rank 0's
        // machine lost it before), at most one per start.
        let generations = world
            .list(&layout.state_dir())
            .expect("the state directory")
            .iter()
            .filter(|n| n.to_string_lossy().starts_with("gen-"))
            .count();
        assert_eq!(
            history.lines().count(),
            generations,
            "seed {seed}: the history has a line per generation: {history}\n{log:?}"
        );
        assert!(
            generations <= starts,
            "seed {seed}: a generation per start at most: {history}\n{log:?}"
        );
        for rank in 0..nodes {
            let entries = journal_of(&world, rank);
            let last = entries.last().expect("entries").item.clone();
            assert_eq!(
                journal::last_complete(&entries, &run_id, &last),
                iterations,
                "seed {seed}: rank {rank}: {entries:?}\n{log:?}"
            );
            assert_nothing_twice(&entries, &format!("seed {seed}: rank {rank} ({log:?})"));
        }
        println!(
            "seed {seed}: {} start(s), {} generation(s): {log:?}",
            starts,
            history.lines().count()
        );
    }
}

/// Start every rank of `clients` in threads; their handles.
fn spawn(
    config: &Path,
    clients: &[Arc<SimClient>],
) -> Vec<std::thread::JoinHandle<Result<rl_node::Outcome, (i32, String)>>> {
    spawn_scripted(config, clients, no_commands())
}

type Node = std::thread::JoinHandle<Result<rl_node::Outcome, (i32, String)>>;

fn spawn_scripted(config: &Path, clients: &[Arc<SimClient>], script: Arc<FakeScript>) -> Vec<Node> {
    clients
        .iter()
        .enumerate()
        .map(|(rank, client)| {
            let (config, store, script) = (config.to_path_buf(), client.clone(), script.clone());
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
                    rl_node::run_in_process(&config, rank as u32, store, clock, script)
                })
                .expect("spawn a node")
        })
        .collect()
}

/// Wait (up to a minute) until `cond` holds.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within a minute");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A node frozen (every call of its client waits: a paused VM, a hung mount) for longer
/// than dead-after: the others stop; the job is started again and forms a new generation;
/// then the frozen node wakes up in the replaced one. It must stop without committing:
/// no journal entry of the old generation follows one of the new in any journal, and the
/// new generation completes the run with nothing journaled twice. Three seeded cases,
/// rank 0 frozen in one.
#[test]
fn a_node_frozen_past_dead_after_commits_nothing_when_it_wakes() {
    for seed in 1..=3u64 {
        let mut rng = Rng::new(seed);
        let nodes = 3u32;
        let iterations = 3;
        let victim = (seed % nodes as u64) as usize;
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = config(dir.path(), nodes, iterations);
        let lifetime = Duration::from_millis(100);
        let (world, first) = world(nodes, lifetime);
        let layout = Layout::new(ROOT);
        let round1 = spawn(&cfg, &first);
        let delay = Duration::from_millis(300 + rng.below(1_200));
        std::thread::sleep(delay);
        first[victim].pause();
        let mut frozen = None;
        for (rank, h) in round1.into_iter().enumerate() {
            if rank == victim {
                frozen = Some(h);
                continue;
            }
            let r = h.join().expect("a node panicked");
            assert!(
                r.as_ref()
                    .is_err_and(|(_, m)| m.contains(&format!("rank {victim}"))),
                "seed {seed}: rank {rank} went on without frozen rank {victim}: {r:?}"
            );
        }
        // The job again, on clients of its own: a new generation.
        let start = Instant::now();
        let second: Vec<Arc<SimClient>> = (0..nodes)
            .map(|_| Arc::new(world.client(move || start.elapsed(), lifetime, lifetime)))
            .collect();
        let round2 = spawn(&cfg, &second);
        wait_until("a second generation", || {
            world.content(&layout.cluster()).is_some_and(|b| {
                serde_json::from_slice::<serde_json::Value>(&b)
                    .is_ok_and(|c| c["gen"].as_u64() >= Some(2))
            })
        });
        first[victim].resume();
        for (rank, h) in round2.into_iter().enumerate() {
            let r = h.join().expect("a node panicked");
            assert!(
                r.is_ok(),
                "seed {seed}: rank {rank} of the new generation: {r:?}"
            );
        }
        let woken = frozen.expect("the frozen node").join().expect("panicked");
        assert!(
            woken.is_err(),
            "seed {seed}: the woken node completed: {woken:?}"
        );
        for rank in 0..nodes {
            let entries = journal_of(&world, rank);
            if let Some(i) = entries.iter().position(|e| e.gen >= 2) {
                let late: Vec<_> = entries[i..].iter().filter(|e| e.gen < 2).collect();
                assert!(
                    late.is_empty(),
                    "seed {seed}: rank {rank} journaled for a replaced generation after the new one began: {late:?}"
                );
            }
            assert_nothing_twice(&entries, &format!("seed {seed}: rank {rank}"));
        }
        assert_complete_resumed(&world, nodes, iterations);
        println!(
            "seed {seed}: rank {victim} frozen after {delay:?}; woke in the replaced generation: {woken:?}"
        );
    }
}

/// Every rank's journal complete for every iteration of the run `cluster.json` names.
fn assert_complete_resumed(world: &SimWorld, nodes: u32, iterations: u64) {
    let layout = Layout::new(ROOT);
    let text = |p: &Path| text(world, p);
    let cluster: serde_json::Value =
        serde_json::from_str(&text(&layout.cluster())).expect("cluster.json");
    let run_id = cluster["run_id"].as_str().expect("run id");
    for rank in 0..nodes {
        let entries = journal_of(world, rank);
        let last = entries.last().expect("entries").item.clone();
        assert_eq!(
            journal::last_complete(&entries, run_id, &last),
            iterations,
            "rank {rank}: {entries:?}"
        );
    }
}

/// The training command of the tests: it says its rank and iteration.
const TRAIN: &str = "[phases.train]\ncommand = \"train rank={rank} iteration={iteration}\"\n";

/// Training takes 30 ms and exits 0, except on rank 2 in iteration 2: exit 3.
fn rank_2_fails_in_iteration_2() -> Arc<FakeScript> {
    Arc::new(|command, _| {
        let code = if train_of(command) == (2, 2) { 3 } else { 0 };
        FakeRun::Exit {
            after: Duration::from_millis(30),
            code,
        }
    })
}

/// Training fails on rank 2 in iteration 2 (exit 3): every node stops, every one naming
/// rank 2; rank 2 says the training command failed with exit code 3; iteration 1 is
/// complete everywhere and iteration 2 nowhere.
#[test]
fn a_training_command_that_fails_stops_every_node_naming_its_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config_with(dir.path(), 3, 3, TRAIN);
    let (world, clients) = world(3, Duration::from_millis(100));
    let results = run_scripted(&cfg, &clients, rank_2_fails_in_iteration_2());
    for (rank, r) in results.iter().enumerate() {
        let (code, message) = r.as_ref().expect_err("every node stops");
        assert!(
            *code != 0 && message.contains("rank 2"),
            "rank {rank}: {r:?}"
        );
    }
    let (_, own) = results[2].as_ref().unwrap_err();
    assert!(
        own.contains("train") && own.contains("exit code 3"),
        "{own}"
    );
    for rank in 0..3 {
        let entries = journal_of(&world, rank);
        assert!(
            entries.iter().any(|e| e.iteration == 1)
                && entries
                    .iter()
                    .all(|e| e.iteration == 1 || e.item != "train" || rank != 2),
            "rank {rank}: {entries:?}"
        );
        let last = entries
            .iter()
            .rfind(|e| e.iteration == 1)
            .expect("iteration 1")
            .item
            .clone();
        assert!(
            !entries.iter().any(|e| e.iteration == 2 && e.item == last),
            "rank {rank} completed iteration 2: {entries:?}"
        );
    }
}

/// With `on-failure = "keep-model"` the same failure is journaled on rank 2 and the run
/// completes every iteration.
#[test]
fn a_training_failure_with_keep_model_is_journaled_and_the_run_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config_with(
        dir.path(),
        3,
        3,
        &format!("{TRAIN}on-failure = \"keep-model\"\n"),
    );
    let (world, clients) = world(3, Duration::from_millis(100));
    let results = run_scripted(&cfg, &clients, rank_2_fails_in_iteration_2());
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    assert_complete(&world, 3, 3);
    let failed: Vec<_> = journal_of(&world, 2)
        .into_iter()
        .filter(|e| e.failed.is_some())
        .map(|e| (e.iteration, e.item, e.failed.unwrap_or_default()))
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        (failed[0].0, failed[0].1.as_str()),
        (2, "train"),
        "{failed:?}"
    );
    assert!(failed[0].2.contains("exit code 3"), "{failed:?}");
}

/// A training command that runs past `phases.train.timeout` on rank 1 is stopped by the
/// launcher, and every node stops naming rank 1 and the timeout.
#[test]
fn a_training_command_past_its_timeout_is_stopped_and_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config_with(dir.path(), 3, 2, &format!("{TRAIN}timeout = \"500ms\"\n"));
    let (_world, clients) = world(3, Duration::from_millis(100));
    let script: Arc<FakeScript> = Arc::new(|command, _| {
        if train_of(command).0 == 1 {
            FakeRun::Forever
        } else {
            FakeRun::Exit {
                after: Duration::from_millis(30),
                code: 0,
            }
        }
    });
    let results = run_scripted(&cfg, &clients, script);
    for (rank, r) in results.iter().enumerate() {
        let (_, message) = r.as_ref().expect_err("every node stops");
        assert!(message.contains("rank 1"), "rank {rank}: {r:?}");
    }
    let (_, own) = results[1].as_ref().unwrap_err();
    assert!(own.contains("timeout"), "{own}");
}
