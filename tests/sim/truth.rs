//! What the simulated server truly did, held against what the nodes concluded from their
//! views of it: every death a node declared, against how long the peer's record truly
//! stood still (issue: "every death declaration against the peer's true silence and
//! dead-after"). The driver scenarios (`nodes`, `data`, `items`, `dynamic`, `pipeline`)
//! keep the server's history of rank records and aborts ([`keep`]) and check every
//! abort for a dead peer at the end of a seed ([`check_deaths`]); and every barrier
//! passed, against the arrivals the ranks truly wrote ("every barrier pass against true
//! arrivals", [`check_barriers`]).

use rl_node::layout::Layout;
use rl_node::store::sim::SimWorld;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Deaths and barrier releases checked so far in this process (for `scripts/sim --json`).
static DEATHS: AtomicU64 = AtomicU64::new(0);
static RELEASES: AtomicU64 = AtomicU64::new(0);

/// The deaths and barrier releases checked against the server's history so far in this
/// process.
pub(crate) fn checked() -> (u64, u64) {
    (
        DEATHS.load(Ordering::Relaxed),
        RELEASES.load(Ordering::Relaxed),
    )
}

/// Keep the history of the names these checks read: every rank record (with its run and
/// barrier marks), every abort, and `cluster.json` (with its run: when the current run
/// began, for a directory where `--fresh` set an earlier run's generations aside and the
/// new run's reuse their names).
pub(crate) fn keep(world: &SimWorld) {
    world.keep_history_with(
        |path| {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            name == "abort.json"
                || name == "cluster.json"
                || (name.starts_with("rank-") && name.ends_with(".json"))
        },
        |path, bytes| {
            let name = path.file_name()?.to_str()?;
            if name == "abort.json" {
                return None;
            }
            let record: serde_json::Value = serde_json::from_slice(bytes).ok()?;
            let run = record["run_id"].as_str()?;
            if name == "cluster.json" {
                return Some(run.to_string());
            }
            Some(format!("{run} {}", Marks::of(&record)))
        },
    );
}

/// A rank record's barrier marks as the history keeps them: the last barrier the rank
/// arrived at, and (rank 0) the last it released, with its name.
#[derive(Debug, Clone, PartialEq, Default)]
struct Marks {
    arrived: Option<u64>,
    released: Option<(u64, String)>,
}

impl Marks {
    fn of(record: &serde_json::Value) -> Marks {
        let k = |m: &serde_json::Value| m["k"].as_u64();
        Marks {
            arrived: k(&record["arrived"]),
            released: k(&record["released"]).map(|k| {
                let name = record["released"]["name"].as_str().unwrap_or_default();
                (k, name.to_string())
            }),
        }
    }

    fn parse(s: &str) -> Marks {
        let mut parts = s.splitn(3, ' ');
        let num = |p: Option<&str>| p.and_then(|p| p.parse().ok());
        let arrived = num(parts.next());
        let released = num(parts.next()).map(|k| (k, parts.next().unwrap_or("").to_string()));
        Marks { arrived, released }
    }
}

impl std::fmt::Display for Marks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let arrived = self.arrived.map_or("-".to_string(), |k| k.to_string());
        match &self.released {
            Some((k, name)) => write!(f, "{arrived} {k} {name}"),
            None => write!(f, "{arrived} -"),
        }
    }
}

/// The current run of `layout` (its `cluster.json`) and when it began there: when
/// `cluster.json` first named it.
fn current_run(world: &SimWorld, layout: &Layout) -> Option<(String, Duration)> {
    let run = read(world, &layout.cluster())?["run_id"]
        .as_str()?
        .to_string();
    let began = world
        .history_of(&layout.cluster())
        .into_iter()
        .find(|(_, r)| r.as_deref() == Some(run.as_str()))
        .map_or(Duration::ZERO, |(t, _)| t);
    Some((run, began))
}

/// The history of a rank record written in run `run` only, each with what the record
/// said after its run id.
fn run_history(world: &SimWorld, path: &Path, run: &str) -> Vec<(Duration, String)> {
    world
        .history_of(path)
        .into_iter()
        .filter_map(|(t, summary)| {
            let (r, rest) = summary?
                .split_once(' ')
                .map(|(r, m)| (r.to_string(), m.to_string()))?;
            (r == run).then_some((t, rest))
        })
        .collect()
}

/// Every barrier passed in the generations of `clusters`, held against what the ranks
/// truly wrote to the server (the history of [`keep`]):
/// - rank 0 released barrier k only after every rank's record said it had arrived at k
///   (or later) on the server: a release never counts a rank that had not arrived (the
///   join, barrier 0, included: a worker arrives there by joining, in its own record);
/// - a worker arrived at barrier k + 1 only after rank 0's release of barrier k was on
///   the server: no rank passes a barrier before it is released.
///
/// Both hold whatever each node's caches and topology (group leaders relaying) made it
/// see, so they judge the barrier's decisions, not how a node came to them. The number
/// of releases checked, or the first pass that breaks one.
pub(crate) fn check_barriers(world: &SimWorld, clusters: &[Layout]) -> Result<u64, String> {
    let mut checked = 0;
    for layout in clusters {
        let Some((run, _)) = current_run(world, layout) else {
            continue;
        };
        for gen in 1..=current_gen(world, layout) {
            let Some(nodes) = read(world, &layout.gen_cluster(gen))
                .and_then(|c| c["num_nodes"].as_u64())
                .map(|n| n as u32)
            else {
                continue;
            };
            let marks: Vec<Vec<(Duration, Marks)>> = (0..nodes)
                .map(|r| {
                    run_history(world, &layout.rank_record(gen, r), &run)
                        .into_iter()
                        .map(|(t, m)| (t, Marks::parse(&m)))
                        .collect()
                })
                .collect();
            let cluster = layout
                .cluster_name()
                .map(|c| format!("the {c} cluster's "))
                .unwrap_or_default();
            let at = |r: usize, k: u64| first_arrival(&marks[r], k);
            let releases = releases(&marks[0]);
            for (k, (released, name)) in releases.iter().enumerate() {
                let k = k as u64;
                for r in 0..nodes as usize {
                    match at(r, k) {
                        Some(arrived) if arrived <= *released => {}
                        arrived => {
                            return Err(format!(
                                "{cluster}rank 0 released barrier {k} ({name}) of generation {gen} at {released:?}, but rank {r}'s record {} on the server",
                                match arrived {
                                    Some(a) => format!("arrived there only at {a:?}"),
                                    None => "never arrived there".into(),
                                }
                            ))
                        }
                    }
                }
                checked += 1;
            }
            for (r, rank_marks) in marks.iter().enumerate().skip(1) {
                let last = rank_marks
                    .iter()
                    .filter_map(|(_, m)| m.arrived)
                    .max()
                    .unwrap_or(0);
                for k in 1..=last {
                    let arrived = at(r, k).expect("arrived up to its last");
                    let previous = releases.get(k as usize - 1).map(|(t, _)| *t);
                    if previous.is_none_or(|t| t > arrived) {
                        return Err(format!(
                            "{cluster}rank {r} of generation {gen} arrived at barrier {k} at {arrived:?}, before rank 0 released barrier {} ({})",
                            k - 1,
                            match previous {
                                Some(t) => format!("at {t:?}"),
                                None => "never".into(),
                            }
                        ));
                    }
                }
            }
        }
    }
    RELEASES.fetch_add(checked, Ordering::Relaxed);
    Ok(checked)
}

/// When `marks` (a rank's record's history) first said it had arrived at barrier `k` or
/// later.
fn first_arrival(marks: &[(Duration, Marks)], k: u64) -> Option<Duration> {
    marks
        .iter()
        .find(|(_, m)| m.arrived.is_some_and(|a| a >= k))
        .map(|(t, _)| *t)
}

/// From rank 0's record's history: for each barrier k (index k), when its release (or a
/// later one, which implies it) was first on the server, and the released barrier's name.
fn releases(marks: &[(Duration, Marks)]) -> Vec<(Duration, String)> {
    let mut out: Vec<(Duration, String)> = Vec::new();
    for (t, m) in marks {
        let Some((k, name)) = &m.released else {
            continue;
        };
        while (out.len() as u64) <= *k {
            let name = if out.len() as u64 == *k {
                name.clone()
            } else {
                "an earlier barrier".into()
            };
            out.push((*t, name));
        }
    }
    out
}

/// How the nodes of a seed judge: dead-after, and the longest a client's cache may hide a
/// peer's newest write (its attribute cache, or a FUSE mount's entry cache).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Judging {
    pub dead_after: Duration,
    pub stale: Duration,
}

/// Every abort for a dead peer in the generations of `clusters` (each a cluster's layout:
/// one, or a pipelined run's two), held against the server's history: before the abort
/// was created, the peer's record must have gone unwritten for dead-after less what a
/// cache can hide. The number of deaths checked, or the first that breaks it.
///
/// A correct judge counts a peer's silence from the first look that found its newest
/// sequence number to its last look, and declares it only past dead-after of its own
/// clock (within 1 % of true time here). Its cache may hide writes made within `stale`
/// of a look, so what it saw still for dead-after was truly unwritten for at least
/// dead-after − `stale`, within the stretch that ends `stale` before the abort. The check
/// allows that, and a 2 % margin for clock rates.
pub(crate) fn check_deaths(
    world: &SimWorld,
    clusters: &[Layout],
    judging: Judging,
) -> Result<u64, String> {
    let mut deaths = 0;
    for layout in clusters {
        let own = layout.cluster_name().unwrap_or_default();
        let Some((run, began)) = current_run(world, layout) else {
            continue;
        };
        for gen in 1..=current_gen(world, layout) {
            let path = layout.abort(gen);
            let Some(abort) = read(world, &path) else {
                continue;
            };
            let reason = abort["reason"].as_str().unwrap_or_default();
            if !reason.starts_with("heartbeat still for") {
                continue;
            }
            // This run's abort: created since the run began here.
            let Some(created) = world.history(&path).into_iter().find(|t| *t >= began) else {
                return Err(format!("{} has no history", path.display()));
            };
            let culprit = abort["culprit"].as_u64().unwrap_or(u64::MAX) as u32;
            let of = abort["cluster"].as_str().unwrap_or(own);
            // The culprit's record in this generation, or for another cluster's rank
            // (its rank 0 judged while this cluster waited on it, or an abort adopted
            // from it), in any generation of that cluster.
            let (records, run): (Vec<_>, String) = if of == own {
                (vec![layout.rank_record(gen, culprit)], run.clone())
            } else {
                let theirs = layout
                    .other_cluster()
                    .filter(|o| o.cluster_name() == Some(of))
                    .ok_or_else(|| format!("{} names cluster {of}", path.display()))?;
                let their_run = current_run(world, &theirs).map(|(r, _)| r);
                (
                    (1..=current_gen(world, &theirs))
                        .map(|g| theirs.rank_record(g, culprit))
                        .collect(),
                    their_run.unwrap_or_default(),
                )
            };
            let end = created.saturating_sub(judging.stale);
            let longest = records
                .iter()
                .map(|r| {
                    let writes: Vec<Duration> = run_history(world, r, &run)
                        .into_iter()
                        .map(|(t, _)| t)
                        .collect();
                    longest_unwritten(&writes, end)
                })
                .max()
                .unwrap_or_default();
            let Some(longest) = longest else {
                // Never written before then: nothing a judge could have watched.
                continue;
            };
            let required = judging
                .dead_after
                .saturating_sub(judging.stale)
                .saturating_sub(judging.dead_after / 50);
            deaths += 1;
            if longest < required {
                return Err(format!(
                    "{} (created at {created:?}) declares {}'s rank {culprit} on {} dead ({reason}), but its record was never unwritten for longer than {longest:?} before (dead-after {:?}, caches hide up to {:?})",
                    path.display(),
                    if of.is_empty() { "the cluster" } else { of },
                    abort["culprit_host"].as_str().unwrap_or_default(),
                    judging.dead_after,
                    judging.stale
                ));
            }
        }
    }
    DEATHS.fetch_add(deaths, Ordering::Relaxed);
    Ok(deaths)
}

/// The longest stretch, ending by `end`, between writes of `writes` (in order), from the
/// first write on; `None` when there was none by `end`.
fn longest_unwritten(writes: &[Duration], end: Duration) -> Option<Duration> {
    let before: Vec<_> = writes.iter().copied().take_while(|w| *w <= end).collect();
    let first = *before.first()?;
    let mut longest = Duration::ZERO;
    let mut last = first;
    for w in before.into_iter().skip(1).chain(std::iter::once(end)) {
        longest = longest.max(w.saturating_sub(last));
        last = w;
    }
    Some(longest)
}

fn current_gen(world: &SimWorld, layout: &Layout) -> u64 {
    read(world, &layout.cluster())
        .and_then(|c| c["gen"].as_u64())
        .unwrap_or(0)
}

fn read(world: &SimWorld, path: &Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&world.content(path)?).ok()
}

#[test]
fn the_longest_stretch_counts_up_to_the_end_and_from_the_first_write() {
    let s = Duration::from_secs;
    assert_eq!(longest_unwritten(&[], s(10)), None);
    assert_eq!(longest_unwritten(&[s(11)], s(10)), None);
    assert_eq!(longest_unwritten(&[s(1), s(2), s(9)], s(10)), Some(s(7)));
    assert_eq!(longest_unwritten(&[s(1), s(2), s(3)], s(10)), Some(s(7)));
    assert_eq!(longest_unwritten(&[s(1), s(2), s(30)], s(10)), Some(s(8)));
}

/// Both rules of [`check_barriers`] on a history written by hand: a release before a
/// rank's arrival, and a worker that arrives at the next barrier before the release.
#[test]
fn a_release_before_an_arrival_and_a_pass_before_a_release_are_caught() {
    use rl_node::store::SharedDir;
    use std::sync::Arc;
    let layout = Layout::new("/job");
    let world = SimWorld::new();
    keep(&world);
    let now = Arc::new(AtomicU64::new(0));
    let at = now.clone();
    let client = world.client(
        move || Duration::from_millis(at.load(Ordering::SeqCst)),
        Duration::ZERO,
        Duration::ZERO,
    );
    let store: &dyn SharedDir = &client;
    world.create_dir_all(&layout.gen_dir(1)).unwrap();
    let json = |v: serde_json::Value| serde_json::to_vec(&v).unwrap();
    store
        .publish(
            &layout.cluster(),
            &json(serde_json::json!({"gen": 1, "run_id": "r1"})),
        )
        .unwrap();
    store
        .publish(
            &layout.gen_cluster(1),
            &json(serde_json::json!({"gen": 1, "num_nodes": 2})),
        )
        .unwrap();
    let mark = |k: u64, name: &str| serde_json::json!({"k": k, "iteration": 1, "name": name});
    // (ms, rank, arrived, released): each a write of that rank's record.
    let write = |ms: u64, rank: u32, arrived: u64, released: Option<u64>| {
        now.store(ms, Ordering::SeqCst);
        let mut record = serde_json::json!({"run_id": "r1", "arrived": mark(arrived, "b")});
        if let Some(k) = released {
            record["released"] = mark(k, "b");
        }
        store
            .publish(&layout.rank_record(1, rank), &json(record))
            .unwrap();
    };
    let check = || check_barriers(&world, std::slice::from_ref(&layout));
    // An earlier run's record at the same name (set aside by `--fresh`): not this run's.
    now.store(1, Ordering::SeqCst);
    let old = serde_json::json!({"run_id": "r0", "released": mark(3, "b")});
    store
        .publish(&layout.rank_record(1, 0), &json(old))
        .unwrap();
    // Rank 0 forms the generation before rank 1 joins it.
    write(10, 0, 0, None);
    write(20, 1, 0, None);
    write(25, 0, 0, Some(0));
    write(30, 1, 1, None);
    write(40, 0, 1, Some(1));
    write(50, 1, 2, None);
    write(60, 0, 2, Some(2));
    assert_eq!(check(), Ok(3));
    // Rank 1 arrives at barrier 4 before rank 0 released barrier 3.
    write(70, 1, 3, None);
    write(80, 1, 4, None);
    let e = check().unwrap_err();
    assert!(
        e.contains("rank 1 of generation 1 arrived at barrier 4 at 80ms, before rank 0 released barrier 3 (never)"),
        "{e}"
    );
    // Rank 0's release of barrier 3 (with 4's) comes after that pass: still too late.
    write(90, 0, 4, Some(4));
    let e = check().unwrap_err();
    assert!(
        e.contains("arrived at barrier 4 at 80ms, before rank 0 released barrier 3 (at 90ms)"),
        "{e}"
    );
    // A release of a barrier rank 1 never arrived at.
    write(100, 0, 5, Some(5));
    let e = check().unwrap_err();
    assert!(
        e.contains("rank 0 released barrier 5 (b) of generation 1 at 100ms, but rank 1's record never arrived there"),
        "{e}"
    );
}
