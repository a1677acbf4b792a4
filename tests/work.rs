//! Work planning with real node processes (docs/work.md): per-task items split by rank
//! weight, retries with backoff and jitter (and their limit), item failures within and
//! beyond `max-failed-fraction`, exact budgets of whole groups (a failed sample drops its
//! task's group, even across a restart, and a replacement task's group runs instead,
//! per-rank `{seed}` and `{samples}`), a node killed in the middle of a per-task
//! or a dynamic rollout, dynamic retries and permanent failures, how soon dynamic ranks
//! leave the pool, nodes whose task files differ, a rank with no tasks, and progress in
//! `rl-node status`.
//!
//! Every test writes its task file and rollout script into its own temporary directory
//! (absolute paths), runs with fast timing (heartbeat 200 ms, dead-after 3 s, poll 100 ms,
//! `work.retry-backoff = 100ms`) and waits on conditions, never on fixed sleeps.

mod common;
use common::cluster::*;
use rl_node::work::{self, Plan, Strategy};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Upper bound of any single wait; each test normally takes a few seconds.
const LIMIT: Duration = Duration::from_secs(25);
/// One iteration, no eval, no training command.
const ONE: &[&str] = &["--iterations", "1", "--eval-interval", "0"];

/// The per-task rollout script, run as
/// `sh rollout.sh {output} {task_id} {sample} {sample_seed} {task_json}`. It checks that
/// every placeholder agrees with its variable, runs the test's prefix (`@PREFIX@`: sleeps,
/// counters, logs), fails with exit 3 for a task marked `"fail": true`, and writes one
/// record naming the item to `{output}`.
const ITEM_SCRIPT: &str = r#"#!/bin/sh
out="$1"
if [ "$out" != "$RL_NODE_OUTPUT" ] || [ "$2" != "$RL_NODE_TASK_ID" ] || [ "$3" != "$RL_NODE_SAMPLE" ] \
   || [ "$4" != "$RL_NODE_SAMPLE_SEED" ] || [ "$5" != "$RL_NODE_TASK_JSON" ]; then
  echo "placeholders and variables disagree: $*" >&2
  exit 9
fi
@PREFIX@
case "$RL_NODE_TASK_JSON" in
  *'"fail": true'*) echo "task $RL_NODE_TASK_ID always fails" >&2; exit 3 ;;
esac
printf '{"task": "%s", "sample": %s, "seed": %s, "state": %s, "rank": %s, "iteration": %s}\n' \
  "$RL_NODE_TASK_ID" "$RL_NODE_SAMPLE" "$RL_NODE_SAMPLE_SEED" "$RL_NODE_STATE" "$RL_NODE_RANK" \
  "$RL_NODE_ITERATION" > "$out"
"#;

const ITEM_ARGS: &str = "{output} {task_id} {sample} {sample_seed} {task_json}";

/// One task line: `{"id": "tNN", "prompt": "solve problem N"}`, plus `"fail": true` if asked.
fn task_line(i: usize, fail: bool) -> String {
    format!(
        r#"{{"id": "t{i:02}", "prompt": "solve problem {i}"{}}}"#,
        if fail { r#", "fail": true"# } else { "" }
    )
}

fn task_text(n: usize, fail: &[usize]) -> String {
    (0..n)
        .map(|i| task_line(i, fail.contains(&i)) + "\n")
        .collect()
}

fn jsonl(path: &Path) -> Vec<Value> {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// (task, sample) of a trajectory record.
fn key(v: &Value) -> (String, u64) {
    (
        v["task"].as_str().unwrap().to_string(),
        v["sample"].as_u64().unwrap(),
    )
}

fn item_key(i: &work::Item) -> (String, u64) {
    (i.task.to_string(), u64::from(i.sample))
}

/// Iteration 1's merged records are the plan's items, rank by rank in plan order.
fn assert_merged_in_plan_order(w: &Work, plan: &Plan) {
    let merged: Vec<(String, u64)> = w.merged(1).iter().map(key).collect();
    assert_eq!(
        merged,
        plan.ranks
            .iter()
            .flatten()
            .map(item_key)
            .collect::<Vec<_>>()
    );
}

fn mean(v: &[u64]) -> f64 {
    v.iter().sum::<u64>() as f64 / v.len().max(1) as f64
}

/// Append the planning configuration to a cluster's config file.
fn append_config(config: &Path, tasks: &Path, work: &str, command: &str) {
    let mut text = fs::read_to_string(config).unwrap();
    text.push_str(&format!(
        "\n[tasks]\ntrain = '{}'\n\n[work]\nretry-backoff = \"100ms\"\n{work}\n\n[phases.rollout]\ncommand = '''{command}'''\n",
        tasks.display()
    ));
    fs::write(config, text).unwrap();
}

/// A cluster with a task file and a rollout script in its temporary directory.
struct Work {
    c: TestCluster,
    tasks: PathBuf,
    work: String,
    command: String,
}

impl Work {
    /// `script` may use `@DIR@` for the test's temporary directory; the command is
    /// `sh <script> <args>`.
    fn new(nodes: u32, tasks: &str, work: &str, script: &str, args: &str) -> Work {
        let c = TestCluster::new(nodes, "");
        let dir = c.dir.path().to_path_buf();
        let task_path = dir.join("tasks.jsonl");
        fs::write(&task_path, tasks).unwrap();
        let script_path = dir.join("rollout.sh");
        fs::write(
            &script_path,
            script.replace("@DIR@", &dir.display().to_string()),
        )
        .unwrap();
        let command = format!("sh {} {args}", script_path.display());
        append_config(&c.config, &task_path, work, &command);
        Work {
            c,
            tasks: task_path,
            work: work.to_string(),
            command,
        }
    }

    /// Per-task mode with ITEM_SCRIPT and the given prefix.
    fn per_task(nodes: u32, tasks: &str, work: &str, prefix: &str) -> Work {
        Work::new(
            nodes,
            tasks,
            &format!("mode = \"per-task\"\n{work}"),
            &ITEM_SCRIPT.replace("@PREFIX@", prefix),
            ITEM_ARGS,
        )
    }

    fn dir(&self) -> &Path {
        self.c.dir.path()
    }

    fn train_dir(&self, it: u64) -> PathBuf {
        self.c.log_path.join(format!("rollouts/iter-{it:04}/train"))
    }

    fn plan(&self, it: u64) -> Plan {
        let p = self.train_dir(it).join("plan.json");
        serde_json::from_slice(&fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
            .unwrap()
    }

    fn tasks(&self) -> work::TaskFile {
        work::load_tasks(&self.tasks, "id").unwrap()
    }

    fn merged(&self, it: u64) -> Vec<Value> {
        jsonl(
            &self
                .c
                .log_path
                .join(format!("rollouts/iter-{it:04}/train.jsonl")),
        )
    }

    /// Names (without `.jsonl`) of the committed items of iteration `it` starting with
    /// `prefix` (`r1-`, `p`, …); `.partial.jsonl` files do not count.
    fn committed(&self, it: u64, prefix: &str) -> BTreeSet<String> {
        fs::read_dir(self.train_dir(it).join("items"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| {
                        let n = e.file_name().to_string_lossy().into_owned();
                        (n.starts_with(prefix)
                            && n.ends_with(".jsonl")
                            && !n.ends_with(".partial.jsonl"))
                        .then(|| n.trim_end_matches(".jsonl").to_string())
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn partials(&self, it: u64) -> Vec<String> {
        fs::read_dir(self.train_dir(it).join("items"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains(".partial"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Rank r's events named `name` of iteration `it`.
    fn events(&self, rank: u32, name: &str, it: u64) -> Vec<Value> {
        self.c
            .events(rank)
            .into_iter()
            .filter(|e| e["event"] == name && e["iteration"] == it)
            .collect()
    }

    /// The single "items" event of rank r's train rollout of iteration `it` in the last
    /// generation that ran one.
    fn items_event(&self, rank: u32, it: u64) -> Value {
        let ev: Vec<Value> = self
            .events(rank, "items", it)
            .into_iter()
            .filter(|e| e["split"] == "train")
            .collect();
        ev.last()
            .cloned()
            .unwrap_or_else(|| panic!("rank {rank}: no items event in iteration {it}"))
    }

    fn executed_log(&self) -> Vec<Vec<String>> {
        fs::read_to_string(self.dir().join("executed.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').map(str::to_string).collect())
            .collect()
    }
}

fn wait_ok(nodes: &mut [NodeProc], context: &str) {
    for n in nodes.iter_mut() {
        let code = n.wait(LIMIT);
        assert_eq!(
            code,
            0,
            "{context}: rank {} exited {code}:\n{}",
            n.rank,
            n.stderr()
        );
    }
}

/// The plan every node computes (the library's own), to compare with `plan.json`.
fn expected_plan(
    w: &Work,
    weights: &[u64],
    budget: Option<u64>,
    samples: u32,
    seed: u64,
    it: u64,
    strategy: Strategy,
) -> Plan {
    let tasks = w.tasks();
    work::plan(&work::PlanInput {
        tasks: tasks.ids(),
        weights,
        budget,
        samples,
        seed,
        iteration: it,
        strategy,
    })
}

// ---------------------------------------------------------------------------- 1. split

#[test]
fn per_task_items_follow_the_weighted_split_and_are_merged_exactly_once() {
    let w = Work::per_task(
        3,
        &task_text(10, &[]),
        "samples-per-task = 2\nseed = 7\nmax-workers = 3",
        "",
    );
    let mut nodes = w.c.spawn_all(&[
        "--iterations",
        "2",
        "--eval-interval",
        "0",
        "--rank-weights",
        "2,1,1",
    ]);
    wait_ok(&mut nodes, "weighted per-task");
    let tasks = w.tasks();
    let all: BTreeSet<(String, u64)> = tasks
        .ids()
        .iter()
        .flat_map(|id| (0..2).map(move |k| (id.to_owned(), k)))
        .collect();
    for it in 1..=2u64 {
        let dir = w.train_dir(it);
        let plan = w.plan(it);
        assert!(plan.fingerprint_matches(), "iteration {it}");
        assert_eq!(
            plan,
            expected_plan(&w, &[2, 1, 1], None, 2, 7, it, Strategy::Weighted),
            "iteration {it}: plan.json is not the plan every node computes"
        );
        // 10 tasks over weights 2,1,1: 5, 3, 2 tasks, so 10, 6, 4 items.
        let items: Vec<usize> = plan.ranks.iter().map(Vec::len).collect();
        assert_eq!(items, [10, 6, 4], "iteration {it}");
        for (r, share) in plan.ranks.iter().enumerate() {
            let r = r as u32;
            // Task order of the share, each task once; every sample of a task is on this
            // rank, consecutively.
            let mut order: Vec<usize> = vec![];
            for i in share {
                if order.last() != Some(&i.task_index) {
                    assert!(
                        !order.contains(&i.task_index),
                        "iteration {it}: task {} split across rank {r}'s share",
                        i.task
                    );
                    order.push(i.task_index);
                }
            }
            assert_eq!(
                order.len(),
                [5, 3, 2][r as usize],
                "iteration {it} rank {r}"
            );
            // The rank's task file holds the task records themselves, in plan order.
            let expected: String = order
                .iter()
                .map(|&t| format!("{}\n", tasks.raw(t).unwrap()))
                .collect();
            assert_eq!(
                fs::read_to_string(dir.join(format!("tasks/rank-{r}.jsonl"))).unwrap(),
                expected,
                "iteration {it} rank {r}: task file"
            );
            // One committed item per position, nothing left partial.
            let names: BTreeSet<String> =
                (0..share.len()).map(|p| format!("r{r}-{p:05}")).collect();
            assert_eq!(
                w.committed(it, &format!("r{r}-")),
                names,
                "iteration {it} rank {r}"
            );
            // The shard: the items in plan order, each with its derived seed.
            let shard = jsonl(&dir.join(format!("rank-{r}.jsonl")));
            assert_eq!(shard.len(), share.len(), "iteration {it} rank {r}");
            for (rec, item) in shard.iter().zip(share) {
                assert_eq!(key(rec), item_key(item), "iteration {it} rank {r}");
                assert_eq!(rec["rank"], r);
                assert_eq!(rec["iteration"], it);
                assert_eq!(rec["seed"].as_u64(), Some(item.seed));
                assert_eq!(item.seed, work::sample_seed(7, it, &item.task, item.sample));
                assert_eq!(rec["state"].as_u64(), Some(u64::from(item.sample)));
            }
            let ev = w.items_event(r, it);
            assert_eq!(ev["total"], share.len(), "{ev}");
            assert_eq!(ev["committed"], share.len(), "{ev}");
            assert_eq!(ev["failed"], 0, "{ev}");
            assert_eq!(ev["retries"], 0, "{ev}");
        }
        assert!(
            w.partials(it).is_empty(),
            "iteration {it}: {:?}",
            w.partials(it)
        );
        // The merge: rank order, plan order; every (task, sample) exactly once.
        let merged: Vec<(String, u64)> = w.merged(it).iter().map(key).collect();
        let planned: Vec<(String, u64)> = plan.ranks.iter().flatten().map(item_key).collect();
        assert_eq!(merged, planned, "iteration {it}");
        assert_eq!(
            merged.iter().cloned().collect::<BTreeSet<_>>(),
            all,
            "iteration {it}"
        );
        assert_eq!(merged.len(), 20, "iteration {it}");
    }
    // Iteration 2 walks the next epoch of the cursor, not the same order again.
    let order = |it| -> Vec<String> {
        w.plan(it)
            .ranks
            .concat()
            .iter()
            .map(|i| i.task.to_string())
            .collect()
    };
    assert_ne!(order(1), order(2));
}

// ---------------------------------------------------------------------------- 2. retries

#[test]
fn retryable_exits_are_retried_with_growing_backoff_until_every_item_commits() {
    // Each item exits 75 (retryable by default) on its first two attempts.
    let prefix = r#"f="@DIR@/counts/$RL_NODE_TASK_ID-$RL_NODE_SAMPLE.count"
n=$(cat "$f" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$f"
[ "$n" -gt 2 ] || exit 75"#;
    let w = Work::per_task(
        2,
        &task_text(4, &[]),
        "samples-per-task = 2\nmax-workers = 4",
        prefix,
    );
    fs::create_dir(w.dir().join("counts")).unwrap();
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "retries");
    let (mut first, mut second) = (vec![], vec![]);
    let (mut items, mut retries) = (0u64, 0u64);
    for r in 0..2 {
        let ev = w.items_event(r, 1);
        let total = ev["total"].as_u64().unwrap();
        assert_eq!(ev["committed"], total, "rank {r}: {ev}");
        assert_eq!(ev["failed"], 0, "rank {r}: {ev}");
        assert_eq!(ev["retries"], 2 * total, "rank {r}: {ev}");
        items += total;
        retries += 2 * total;
        let mut attempts: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for e in w.events(r, "retry", 1) {
            assert_eq!(e["exit"], 75, "{e}");
            assert!(e["gen"].is_u64() && e["t"].is_string(), "{e}");
            assert!(
                e["task"].as_str().is_some_and(|t| t.starts_with('t')),
                "{e}"
            );
            let attempt = e["attempt"].as_u64().unwrap();
            let delay = e["delay_ms"].as_u64().unwrap();
            // retry-backoff 100ms, doubling, jitter -50 % .. +50 %.
            let base = 100 << (attempt - 1);
            assert!(
                delay >= base / 2 && delay < base * 3 / 2,
                "attempt {attempt}: delay {delay} ms outside [{}, {}): {e}",
                base / 2,
                base * 3 / 2
            );
            match attempt {
                1 => first.push(delay),
                2 => second.push(delay),
                _ => panic!("unexpected attempt: {e}"),
            }
            attempts
                .entry(e["item"].as_str().unwrap().to_string())
                .or_default()
                .push(attempt);
        }
        assert_eq!(attempts.len() as u64, total, "rank {r}: {attempts:?}");
        assert!(
            attempts.values().all(|a| a == &[1, 2]),
            "rank {r}: {attempts:?}"
        );
    }
    assert_eq!(items, 8);
    // metrics.jsonl counts every rank's retries, not only rank 0's (they travel to rank
    // 0 with the final-sync arrivals).
    let line: serde_json::Value = serde_json::from_str(
        fs::read_to_string(w.c.log_path.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(line["rollout/retries"], retries, "{line}");
    assert_eq!(line["rollout/failed"], 0, "{line}");
    assert!(
        mean(&second) > mean(&first),
        "backoff did not grow: attempt 1 delays {first:?}, attempt 2 delays {second:?}"
    );
    // Each item ran exactly three times: two retryable failures and a success.
    let counts: Vec<String> = fs::read_dir(w.dir().join("counts"))
        .unwrap()
        .flatten()
        .map(|e| fs::read_to_string(e.path()).unwrap().trim().to_string())
        .collect();
    assert_eq!(counts.len(), 8);
    assert!(counts.iter().all(|c| c == "3"), "{counts:?}");
    let merged: BTreeSet<(String, u64)> = w.merged(1).iter().map(key).collect();
    assert_eq!(merged.len(), 8);
    assert_eq!(w.merged(1).len(), 8);
}

#[test]
fn an_item_that_stays_retryable_fails_after_max_retries() {
    // t01 exits 75 every time; everything else succeeds at once.
    let prefix = r#"echo "$RL_NODE_TASK_ID" >> "@DIR@/attempts.log"
[ "$RL_NODE_TASK_ID" != t01 ] || exit 75"#;
    let w = Work::per_task(
        2,
        &task_text(4, &[]),
        "max-retries = 2\nmax-failed-fraction = 0.5",
        prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "retries exhausted");
    let attempts = fs::read_to_string(w.dir().join("attempts.log")).unwrap();
    assert_eq!(
        attempts.lines().filter(|l| *l == "t01").count(),
        3,
        "{attempts}"
    );
    let r = (0..2)
        .find(|&r| !w.events(r, "item-failed", 1).is_empty())
        .expect("an item-failed event");
    let failed = w.events(r, "item-failed", 1);
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["task"], "t01");
    assert!(
        failed[0]["exit"].as_str().unwrap().contains("75"),
        "{}",
        failed[0]
    );
    let retries: Vec<u64> = w
        .events(r, "retry", 1)
        .iter()
        .map(|e| e["attempt"].as_u64().unwrap())
        .collect();
    assert_eq!(retries, [1, 2]);
    let ev = w.items_event(r, 1);
    assert_eq!(
        (ev["failed"].as_u64(), ev["retries"].as_u64()),
        (Some(1), Some(2)),
        "{ev}"
    );
    let merged: BTreeSet<String> = w.merged(1).iter().map(|v| key(v).0).collect();
    assert_eq!(merged, ["t00", "t02", "t03"].map(String::from).into());
}

// ---------------------------------------------------------------------------- 3. failures

const FAILING: usize = 4;

/// 9 tasks over 3 equal ranks (3 items each), task t04 always exits 3. Returns the cluster
/// and the rank that plans t04.
fn failing_task_cluster(work: &str) -> (Work, u32) {
    let w = Work::per_task(3, &task_text(9, &[FAILING]), work, "");
    let plan = expected_plan(&w, &[1, 1, 1], None, 1, 0, 1, Strategy::Weighted);
    let culprit = plan
        .ranks
        .iter()
        .position(|s| s.iter().any(|i| i.task_index == FAILING))
        .unwrap() as u32;
    (w, culprit)
}

#[test]
fn a_permanent_item_failure_beyond_max_failed_fraction_fails_its_node() {
    let (w, culprit) = failing_task_cluster("max-failed-fraction = 0.0");
    let mut nodes = w.c.spawn_all(ONE);
    for n in nodes.iter_mut() {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        if n.rank == culprit {
            assert_eq!(code, 1, "rank {}:\n{err}", n.rank);
            assert!(err.contains("max-failed-fraction"), "{err}");
            assert!(err.contains("t04"), "{err}");
        } else {
            assert_eq!(code, 3, "rank {}:\n{err}", n.rank);
            assert!(err.contains(&format!("rank {culprit}")), "{err}");
        }
    }
    assert_eq!(
        w.plan(1),
        expected_plan(&w, &[1, 1, 1], None, 1, 0, 1, Strategy::Weighted)
    );
    // Exit 3 is not retryable: one failure, no retry.
    let failed = w.events(culprit, "item-failed", 1);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["task"], "t04");
    assert!(w.events(culprit, "retry", 1).is_empty());
    let ev = w.items_event(culprit, 1);
    assert_eq!(
        (ev["total"].as_u64(), ev["failed"].as_u64()),
        (Some(3), Some(1)),
        "{ev}"
    );
    assert!(!w.c.log_path.join("rollouts/iter-0001/train.jsonl").exists());
}

#[test]
fn item_failures_within_max_failed_fraction_are_left_out_of_the_merge() {
    let (w, culprit) = failing_task_cluster("max-failed-fraction = 0.5");
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "within max-failed-fraction");
    for r in 0..3 {
        let ev = w.items_event(r, 1);
        let failed = u64::from(r == culprit);
        assert_eq!(ev["total"], 3, "rank {r}: {ev}");
        assert_eq!(ev["failed"], failed, "rank {r}: {ev}");
        assert_eq!(ev["committed"], 3 - failed, "rank {r}: {ev}");
    }
    let merged: Vec<(String, u64)> = w.merged(1).iter().map(key).collect();
    let expected: BTreeSet<(String, u64)> = (0..9)
        .filter(|&i| i != FAILING)
        .map(|i| (format!("t{i:02}"), 0))
        .collect();
    assert_eq!(merged.len(), 8, "{merged:?}");
    assert_eq!(merged.into_iter().collect::<BTreeSet<_>>(), expected);
    assert_eq!(
        jsonl(&w.train_dir(1).join(format!("rank-{culprit}.jsonl"))).len(),
        2
    );
}

// ---------------------------------------------------------------------------- 4. exact budget

#[test]
fn exact_budget_replaces_a_failed_task_with_one_outside_the_plan() {
    const SEED: u64 = 3;
    // Plan first (ids only matter), then mark one planned task as failing: one whose rank
    // has replacement candidates (tasks outside the plan, index ≡ rank mod 2).
    let probe = Work::per_task(2, &task_text(12, &[]), "", "");
    let plan = expected_plan(&probe, &[1, 1], Some(6), 1, SEED, 1, Strategy::Weighted);
    let used: BTreeSet<usize> = plan.ranks.iter().flatten().map(|i| i.task_index).collect();
    let (culprit, failing) = (0..2u32)
        .find_map(|r| {
            (0..12)
                .any(|i| !used.contains(&i) && i % 2 == r as usize)
                .then(|| (r, plan.ranks[r as usize][0].task_index))
        })
        .expect("a rank with replacement candidates");
    drop(probe);
    let w = Work::per_task(
        2,
        &task_text(12, &[failing]),
        &format!(
            "tasks-per-iteration = 6\nseed = {SEED}\nexact-budget = true\nmax-failed-fraction = 0.5"
        ),
        "",
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "exact budget");
    assert_eq!(w.plan(1), plan);
    let merged: Vec<String> = w
        .merged(1)
        .iter()
        .map(|v| v["task"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(merged.len(), 6, "{merged:?}");
    let ids: BTreeSet<&String> = merged.iter().collect();
    assert_eq!(ids.len(), 6, "a task twice: {merged:?}");
    let failing_id = format!("t{failing:02}");
    assert!(!ids.contains(&failing_id), "{merged:?}");
    let planned: BTreeSet<String> = plan
        .ranks
        .iter()
        .flatten()
        .map(|i| i.task.to_string())
        .collect();
    let outside: Vec<&&String> = ids.iter().filter(|t| !planned.contains(**t)).collect();
    assert_eq!(outside.len(), 1, "replacements: {outside:?}");
    // The replacement comes from the failing rank's own set (index ≡ rank mod 2).
    let idx: usize = outside[0][1..].parse().unwrap();
    assert_eq!(idx % 2, culprit as usize, "replacement {}", outside[0]);
    assert!(!used.contains(&idx));
    let ev = w.items_event(culprit, 1);
    assert_eq!(ev["failed"], 1, "{ev}");
    assert_eq!(ev["total"], 4, "{ev}");
    assert_eq!(ev["committed"], 3, "{ev}");
    assert_eq!(w.items_event(1 - culprit, 1)["committed"], 3);
}

/// Records of a merge, by task: their sample numbers and seeds, in merge order.
fn by_task(merged: &[Value]) -> BTreeMap<String, Vec<(u64, u64)>> {
    let mut m: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    for v in merged {
        m.entry(v["task"].as_str().unwrap().to_string())
            .or_default()
            .push((v["sample"].as_u64().unwrap(), v["seed"].as_u64().unwrap()));
    }
    m
}

/// Every sample of `task`, with its seed from (seed, iteration 1, task, sample).
fn whole_group(seed: u64, task: &str, samples: u32) -> Vec<(u64, u64)> {
    (0..samples)
        .map(|s| (u64::from(s), work::sample_seed(seed, 1, task, s)))
        .collect()
}

/// A prefix that fails (exit 3) sample 1 of task `id` only.
fn fail_sample_one(id: &str) -> String {
    format!(
        r#"echo "$RL_NODE_TASK_ID $RL_NODE_SAMPLE $$ $RL_NODE_GEN $RL_NODE_RANK" >> "@DIR@/executed.log"
if [ "$RL_NODE_TASK_ID" = "{id}" ] && [ "$RL_NODE_SAMPLE" = 1 ]; then echo "sample 1 of {id} always fails" >&2; exit 3; fi"#
    )
}

#[test]
fn exact_budget_drops_a_failed_samples_whole_group_and_runs_a_whole_replacement_group() {
    const SEED: u64 = 5;
    const SAMPLES: u32 = 3;
    let probe = Work::per_task(2, &task_text(12, &[]), "", "");
    let plan = expected_plan(
        &probe,
        &[1, 1],
        Some(4),
        SAMPLES,
        SEED,
        1,
        Strategy::Weighted,
    );
    drop(probe);
    let used: BTreeSet<usize> = plan.ranks.iter().flatten().map(|i| i.task_index).collect();
    // A rank with replacement candidates (index ≡ rank mod 2, outside the plan); its
    // first task's sample 1 fails.
    let culprit = (0..2u32)
        .find(|&r| (0..12).any(|i| !used.contains(&i) && i % 2 == r as usize))
        .expect("a rank with replacement candidates");
    let failing = plan.ranks[culprit as usize][0].task.to_string();
    // One item at a time: sample 0 commits before sample 1 fails, sample 2 never starts.
    let w = Work::per_task(
        2,
        &task_text(12, &[]),
        &format!(
            "tasks-per-iteration = 4\nsamples-per-task = {SAMPLES}\nseed = {SEED}\nexact-budget = true\nmax-failed-fraction = 0.5\nmax-workers = 1"
        ),
        &fail_sample_one(&failing),
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "exact budget of groups");
    assert_eq!(w.plan(1), plan);
    let merged = w.merged(1);
    // The budget: tasks-per-iteration × samples-per-task, in complete groups only.
    assert_eq!(merged.len(), 4 * SAMPLES as usize, "{merged:?}");
    let groups = by_task(&merged);
    assert_eq!(groups.len(), 4, "{groups:?}");
    for (task, samples) in &groups {
        assert_eq!(samples, &whole_group(SEED, task, SAMPLES), "task {task}");
    }
    assert!(!groups.contains_key(&failing), "{groups:?}");
    let planned: BTreeSet<String> = plan
        .ranks
        .iter()
        .flatten()
        .map(|i| i.task.to_string())
        .collect();
    let outside: Vec<&String> = groups.keys().filter(|t| !planned.contains(*t)).collect();
    assert_eq!(outside.len(), 1, "replacements: {outside:?}");
    let idx: usize = outside[0][1..].parse().unwrap();
    assert_eq!(idx % 2, culprit as usize, "replacement {}", outside[0]);
    assert!(!used.contains(&idx));
    // The failed group: its committed sample 0 is set aside (kept, not merged), its
    // sample 2 never ran, and the decision is recorded.
    let items = w.train_dir(1).join("items");
    let aside = jsonl(&items.join(format!("r{culprit}-00000.jsonl.dropped")));
    assert_eq!(key(&aside[0]), (failing.clone(), 0));
    let record: Value = serde_json::from_slice(
        &fs::read(items.join(format!("r{culprit}-g00000.dropped.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(record["task"], failing.as_str(), "{record}");
    let ran: Vec<u64> = w
        .executed_log()
        .iter()
        .filter(|l| l[0] == failing)
        .map(|l| l[1].parse().unwrap())
        .collect();
    assert_eq!(ran, [0, 1], "the failed group's samples that ran");
    // The replacement group's items, named from the replacement positions.
    for s in 0..SAMPLES {
        let rec = jsonl(&items.join(format!("r{culprit}-x{s:05}.jsonl")));
        assert_eq!(key(&rec[0]), (outside[0].clone(), u64::from(s)));
    }
    let ev = w.items_event(culprit, 1);
    assert_eq!(ev["failed"], 1, "{ev}");
    assert_eq!(ev["total"], 3 * SAMPLES, "{ev}");
    assert_eq!(ev["committed"], 2 * SAMPLES, "{ev}");
    assert_eq!(
        ev["groups"],
        serde_json::json!({"planned": 2, "complete": 2, "dropped": 1, "replacements": 1}),
        "{ev}"
    );
    let other = w.items_event(1 - culprit, 1);
    assert_eq!(other["committed"], 2 * SAMPLES, "{other}");
    assert_eq!(other["groups"]["dropped"], 0, "{other}");
    let err = nodes[culprit as usize].stderr();
    assert!(
        err.contains(&format!(
            "task {failing}'s group r{culprit}-g00000 is dropped"
        )),
        "{err}"
    );
}

#[test]
fn a_dropped_groups_running_samples_are_stopped_not_waited_for() {
    let probe = Work::per_task(1, &task_text(4, &[]), "", "");
    let plan = expected_plan(&probe, &[1], Some(1), 3, 0, 1, Strategy::Weighted);
    drop(probe);
    let a = plan.ranks[0][0].task.to_string();
    // Samples 0 and 2 of the one planned task would run for a minute; sample 1 fails at
    // once. The rollout ends in time only if the node stops them when it drops the group.
    let prefix = format!(
        "{}\nif [ \"$RL_NODE_TASK_ID\" = \"{a}\" ]; then sleep 60; fi",
        fail_sample_one(&a)
    );
    let w = Work::per_task(
        1,
        &task_text(4, &[]),
        "tasks-per-iteration = 1\nsamples-per-task = 3\nexact-budget = true\nmax-failed-fraction = 0.5\nmax-workers = 3",
        &prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "siblings stopped");
    let groups = by_task(&w.merged(1));
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert!(!groups.contains_key(&a), "{groups:?}");
    let logs = w.c.log_path.join("logs/iter-0001/rank-0.rollout.items");
    for item in ["r0-00000", "r0-00002"] {
        let log = fs::read_to_string(logs.join(format!("{item}.a0.log"))).unwrap();
        assert!(
            log.contains(&format!("so task {a}'s group r0-g00000 is dropped")),
            "{item}: {log}"
        );
    }
    let err = nodes[0].stderr();
    assert!(err.contains("2 running one(s) stopped"), "{err}");
}

#[test]
fn a_replacement_group_committed_before_a_crash_is_reused_and_the_drop_stays() {
    const SEED: u64 = 11;
    let probe = Work::per_task(1, &task_text(6, &[]), "", "");
    let plan = expected_plan(&probe, &[1], Some(2), 2, SEED, 1, Strategy::Weighted);
    drop(probe);
    let (a, b) = (
        plan.ranks[0][0].task.to_string(),
        plan.ranks[0][2].task.to_string(),
    );
    // Sample 1 of A fails; sample 1 of B hangs in generation 1 until the node is killed,
    // after the replacement group has committed.
    let prefix = format!(
        "{}\nif [ \"$RL_NODE_GEN\" = 1 ] && [ \"$RL_NODE_TASK_ID\" = \"{b}\" ] && [ \"$RL_NODE_SAMPLE\" = 1 ]; then sleep 30; fi",
        fail_sample_one(&a)
    );
    let w = Work::per_task(
        1,
        &task_text(6, &[]),
        &format!(
            "tasks-per-iteration = 2\nsamples-per-task = 2\nseed = {SEED}\nexact-budget = true\nmax-failed-fraction = 0.5\nmax-workers = 2"
        ),
        &prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_until(LIMIT, "the replacement group to commit", || {
        w.committed(1, "r0-x").len() == 2
    });
    nodes[0].signal(libc::SIGKILL);
    assert_eq!(nodes[0].wait(LIMIT), 137);
    drop(nodes);
    assert!(
        !w.committed(1, "r0-").contains("r0-00003"),
        "B's sample 1 hung"
    );

    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "restart");
    let err = nodes[0].stderr();
    assert!(
        err.contains("1 train group(s) dropped before the restart stay dropped"),
        "{err}"
    );
    assert!(
        err.contains("3 train item(s) committed before the restart are reused"),
        "{err}"
    );
    // Generation 2 ran B's sample 1 only: not A's group, not the replacement.
    let log = w.executed_log();
    let gen2: Vec<(String, String)> = log
        .iter()
        .filter(|l| l[3] == "2")
        .map(|l| (l[0].clone(), l[1].clone()))
        .collect();
    assert_eq!(gen2, [(b.clone(), "1".to_string())], "{log:?}");
    let groups = by_task(&w.merged(1));
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert!(!groups.contains_key(&a), "{groups:?}");
    for (task, samples) in &groups {
        assert_eq!(samples, &whole_group(SEED, task, 2), "task {task}");
    }
    // The uninterrupted run's counts.
    let ev = w.items_event(0, 1);
    assert_eq!(ev["gen"], 2, "{ev}");
    assert_eq!(
        (
            ev["total"].as_u64(),
            ev["committed"].as_u64(),
            ev["failed"].as_u64()
        ),
        (Some(6), Some(4), Some(1)),
        "{ev}"
    );
    assert_eq!(
        ev["groups"],
        serde_json::json!({"planned": 2, "complete": 2, "dropped": 1, "replacements": 1}),
        "{ev}"
    );
}

#[test]
fn per_rank_commands_get_the_iterations_seed_and_sample_count() {
    let script = r#"#!/bin/sh
# sh rollout.sh {output} {seed} {samples}
[ "$2" = "$RL_NODE_SEED" ] && [ "$3" = "$RL_NODE_SAMPLES" ] || { echo "placeholders and variables disagree: $*" >&2; exit 9; }
printf '{"rank": %s, "iteration": %s, "seed": "%s", "samples": "%s"}\n' "$RL_NODE_RANK" "$RL_NODE_ITERATION" "$2" "$3" > "$1"
"#;
    let w = Work::new(
        2,
        &task_text(4, &[]),
        "samples-per-task = 3\nseed = 42",
        script,
        "{output} {seed} {samples}",
    );
    let mut nodes =
        w.c.spawn_all(&["--iterations", "2", "--eval-interval", "0"]);
    wait_ok(&mut nodes, "seed and samples");
    // The documented example (docs/commands.md).
    assert_eq!(work::iteration_seed(42, 1), 525683850799873524);
    for it in 1..=2u64 {
        let merged = w.merged(it);
        assert_eq!(merged.len(), 2, "{merged:?}");
        for rec in &merged {
            assert_eq!(rec["iteration"], it);
            assert_eq!(
                rec["seed"],
                work::iteration_seed(42, it).to_string(),
                "{rec}"
            );
            assert_eq!(rec["samples"], "3", "{rec}");
        }
    }
    assert_ne!(work::iteration_seed(42, 1), work::iteration_seed(42, 2));
}

// ---------------------------------------------------------------------------- 5. restart

#[test]
fn a_node_killed_mid_rollout_redoes_only_its_unfinished_items() {
    let prefix = r#"echo "$RL_NODE_TASK_ID $RL_NODE_SAMPLE $$ $RL_NODE_GEN $RL_NODE_RANK" >> "@DIR@/executed.log"
sleep 0.2"#;
    let w = Work::per_task(2, &task_text(8, &[]), "max-workers = 1", prefix);
    let mut nodes = w.c.spawn_all(ONE);
    wait_until(LIMIT, "rank 1 to commit 2 items", || {
        w.committed(1, "r1-").len() >= 2
    });
    nodes[1].signal(libc::SIGKILL);
    let at_kill = w.committed(1, "r1-");
    assert_eq!(nodes[1].wait(LIMIT), 137);
    assert!(
        at_kill.len() < 4,
        "rank 1 finished before the kill: {at_kill:?}"
    );
    let code = nodes[0].wait(LIMIT);
    let err = nodes[0].stderr();
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("rank 1 on") && err.contains("is dead"),
        "{err}"
    );
    drop(nodes);
    // What generation 1 left committed: only the rest may run again.
    let plan = w.plan(1);
    let name_of = |it: &work::Item| -> String {
        let r = plan.ranks.iter().position(|s| s.contains(it)).unwrap();
        let p = plan.ranks[r].iter().position(|x| x == it).unwrap();
        format!("r{r}-{p:05}")
    };
    let done_gen1: BTreeSet<String> = w.committed(1, "r");
    assert!(at_kill.is_subset(&done_gen1));

    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "restart");
    let err1 = nodes[1].stderr();
    assert!(
        err1.contains(&format!(
            "{} train item(s) committed before the restart are reused",
            done_gen1.iter().filter(|n| n.starts_with("r1-")).count()
        )),
        "{err1}"
    );
    let log = w.executed_log();
    let mut runs: BTreeMap<(String, u64), Vec<String>> = BTreeMap::new();
    for l in &log {
        runs.entry((l[0].clone(), l[1].parse().unwrap()))
            .or_default()
            .push(l[3].clone());
    }
    let mut twice = vec![];
    for item in plan.ranks.iter().flatten() {
        let name = name_of(item);
        let gens = runs.get(&item_key(item)).cloned().unwrap_or_default();
        if done_gen1.contains(&name) {
            assert_eq!(gens, ["1"], "{name} was committed in generation 1: {log:?}");
        } else {
            // Not committed before the restart: run (exactly once) in generation 2, after at
            // most one attempt cut short by the kill.
            assert_eq!(
                gens.iter().filter(|g| *g == "2").count(),
                1,
                "{name}: {log:?}"
            );
            assert!(gens.len() <= 2, "{name}: {log:?}");
            if gens.len() == 2 {
                twice.push(name.clone());
            }
        }
        if at_kill.contains(&name) {
            assert_eq!(gens.len(), 1, "{name}");
        }
    }
    assert!(
        twice.len() <= 1,
        "more items in flight than max-workers: {twice:?}"
    );
    assert!(twice.iter().all(|n| n.starts_with("r1-")), "{twice:?}");
    assert_eq!(log.len(), 8 + twice.len(), "{log:?}");
    assert_merged_in_plan_order(&w, &plan);
}

// ---------------------------------------------------------------------------- 6. dynamic

fn lease_files(w: &Work) -> Vec<(String, Value)> {
    fs::read_dir(w.train_dir(1).join("leases"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    let v = serde_json::from_slice(&fs::read(e.path()).ok()?).ok()?;
                    Some((n, v))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn dynamic_survivors_take_over_a_dead_nodes_items_in_the_same_iteration() {
    let prefix = r#"echo "$RL_NODE_TASK_ID $RL_NODE_SAMPLE $$ $RL_NODE_GEN $RL_NODE_RANK" >> "@DIR@/executed.log"
sleep 0.3"#;
    let w = Work::per_task(
        3,
        &task_text(12, &[]),
        "strategy = \"dynamic\"\nsamples-per-task = 2\nmax-workers = 2",
        prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    // At least 7 leases, and rank 2 holds one whose item is not committed.
    wait_until(LIMIT, "7 leases with one of rank 2 in flight", || {
        let leases = lease_files(&w);
        let done = w.committed(1, "p");
        leases.len() >= 7
            && leases
                .iter()
                .any(|(n, v)| v["rank"] == 2 && !done.contains(n.split('.').next().unwrap()))
    });
    nodes[2].signal(libc::SIGKILL);
    assert_eq!(nodes[2].wait(LIMIT), 137);
    for n in nodes[..2].iter_mut() {
        let code = n.wait(LIMIT);
        let err = n.stderr();
        assert_eq!(code, 3, "rank {}:\n{err}", n.rank);
        assert!(
            err.contains("rank 2 on") && err.contains("is dead"),
            "rank {}:\n{err}",
            n.rank
        );
    }
    // Ranks 0 and 1 finished every item of the iteration before stopping.
    let plan = w.plan(1);
    assert_eq!(plan.pool.len(), 24);
    let all: BTreeSet<String> = (0..24).map(|p| format!("p{p:05}")).collect();
    assert_eq!(w.committed(1, "p"), all, "items missing after the takeover");
    let leases = lease_files(&w);
    let holder: BTreeMap<String, u64> = leases
        .iter()
        .filter(|(n, _)| n.ends_with(".a0"))
        .map(|(n, v)| {
            (
                n.split('.').next().unwrap().to_string(),
                v["rank"].as_u64().unwrap(),
            )
        })
        .collect();
    let takeovers: Vec<&(String, Value)> =
        leases.iter().filter(|(n, _)| n.ends_with(".a1")).collect();
    assert!(!takeovers.is_empty(), "no takeover lease: {leases:?}");
    // A second attempt is either a takeover of the dead rank's item or an end-game backup
    // of a slower live rank's item (recorded as a "backup" event by the rank that ran it).
    let backups: Vec<String> = (0..2)
        .flat_map(|r| w.c.events(r))
        .filter(|e| e["event"] == "backup")
        .map(|e| e["item"].as_str().unwrap().to_string())
        .collect();
    for (n, v) in &takeovers {
        let item = n.split('.').next().unwrap();
        assert!(
            holder.get(item) == Some(&2) || backups.iter().any(|b| b == item),
            "{n}: a second attempt of an item rank 2 did not hold, and no backup event"
        );
        assert!(v["rank"] == 0 || v["rank"] == 1, "{n}: {v}");
        assert_eq!(v["attempt"], 1, "{n}: {v}");
    }
    // Every item rank 2 held was finished by the survivors (checked above); some second
    // attempt ran for at least one of them.
    assert!(
        takeovers
            .iter()
            .any(|(n, _)| holder.get(n.split('.').next().unwrap()) == Some(&2)),
        "no second attempt of rank 2's items: {takeovers:?}"
    );
    drop(nodes);

    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "dynamic restart");
    let agg = w.events(0, "aggregate", 1);
    assert!(
        agg.last()
            .is_some_and(|e| e["items"] == 24 && e["missing"] == 0),
        "{agg:?}"
    );
    let merged: Vec<(String, u64)> = w.merged(1).iter().map(key).collect();
    assert_eq!(
        merged,
        plan.pool.iter().map(item_key).collect::<Vec<_>>(),
        "pool order"
    );
    assert_eq!(merged.iter().collect::<BTreeSet<_>>().len(), 24);
    // Nothing ran again after the restart; only items cut short by the kill ran twice.
    let log = w.executed_log();
    assert!(
        log.iter().all(|l| l[3] == "1"),
        "ran after the restart: {log:?}"
    );
    let mut count: BTreeMap<(String, String), usize> = BTreeMap::new();
    for l in &log {
        *count.entry((l[0].clone(), l[1].clone())).or_default() += 1;
    }
    assert_eq!(count.len(), 24);
    let twice = count.values().filter(|c| **c == 2).count();
    assert!(count.values().all(|c| *c <= 2), "{count:?}");
    // Each item rank 2 had started was cut short and run again by its taker (a lease
    // claimed just before the kill may not have started its command yet).
    assert!(twice <= takeovers.len(), "{count:?} {takeovers:?}");
}

#[test]
fn dynamic_retries_under_a_new_lease_and_nobody_waits_for_a_failed_item() {
    // Every item exits 75 on its first attempt; t01 then fails for good (exit 3).
    let prefix = r#"f="@DIR@/counts/$RL_NODE_TASK_ID-$RL_NODE_SAMPLE.count"
n=$(cat "$f" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$f"
[ "$n" -gt 1 ] || exit 75"#;
    let w = Work::per_task(
        3,
        &task_text(6, &[1]),
        "strategy = \"dynamic\"\nmax-workers = 2\nmax-failed-fraction = 0.5",
        prefix,
    );
    fs::create_dir(w.dir().join("counts")).unwrap();
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "dynamic retries");
    let retried: BTreeSet<String> = (0..3)
        .flat_map(|r| w.events(r, "retry", 1))
        .map(|e| {
            assert_eq!(
                (e["attempt"].as_u64(), e["exit"].as_u64()),
                (Some(1), Some(75)),
                "{e}"
            );
            e["item"].as_str().unwrap().to_string()
        })
        .collect();
    let all: BTreeSet<String> = (0..6).map(|p| format!("p{p:05}")).collect();
    assert_eq!(retried, all);
    // Each retry ran under its attempt-1 lease.
    let leases: BTreeSet<String> = lease_files(&w).into_iter().map(|(n, _)| n).collect();
    for p in &all {
        assert!(
            leases
                .iter()
                .any(|n| n.starts_with(&format!("{p}.")) && n.ends_with(".a1")),
            "{p}: {leases:?}"
        );
    }
    let failed: Vec<Value> = (0..3).flat_map(|r| w.events(r, "item-failed", 1)).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["task"], "t01");
    let merged: BTreeSet<String> = w.merged(1).iter().map(|v| key(v).0).collect();
    assert_eq!(
        merged,
        ["t00", "t02", "t03", "t04", "t05"].map(String::from).into()
    );
    let agg = w.events(0, "aggregate", 1);
    assert!(
        agg.last()
            .is_some_and(|e| e["items"] == 5 && e["missing"] == 1),
        "{agg:?}"
    );
}

/// Two ranks, four tasks: t01's first attempt (whoever claims it) does `first`, any later
/// attempt of it (the other rank's backup, once its own items are done) does `backup`;
/// the other tasks take 0.1 s. Both ranks exit 0; the leases directory's names after, and
/// both ranks' logs.
fn run_with_backup(first: &str, backup: &str, work: &str) -> (Work, Vec<String>, String) {
    let prefix = format!(
        r#"if [ "$RL_NODE_TASK_ID" = t01 ]; then
  if mkdir "@DIR@/t01-first" 2>/dev/null; then {first}; else {backup}; fi
else
  sleep 0.1
fi"#
    );
    let w = Work::per_task(
        2,
        &task_text(4, &[]),
        &format!("strategy = \"dynamic\"\nmax-workers = 1\n{work}"),
        &prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "a dynamic rollout with a backup");
    let names = fs::read_dir(w.train_dir(1).join("leases"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let logs = nodes.iter().map(|n| n.stderr()).collect();
    (w, names, logs)
}

/// The item of task t01, as a pool position name (`p0000N`): the one with a backup lease.
fn backed_up(names: &[String]) -> String {
    let backup = names.iter().find(|n| n.ends_with(".a1"));
    let backup = backup.unwrap_or_else(|| panic!("no backup lease: {names:?}"));
    backup[..6].to_string()
}

/// An attempt that fails for good does not fail its item while another attempt of it
/// runs: a backup's failure leaves the item to its first attempt, and a first attempt's
/// failure leaves it to its backup. With the default `max-failed-fraction` of 0, a failed
/// item would stop the run; it finishes with every task merged.
#[test]
fn a_failed_attempt_leaves_its_item_to_the_attempt_still_running() {
    for (first, backup, failed) in [
        ("sleep 2", "exit 3", "a1"),
        ("sleep 1; exit 3", "sleep 2", "a0"),
    ] {
        let (w, names, logs) = run_with_backup(first, backup, "");
        let item = backed_up(&names);
        let said = format!("attempt {} of item {item} (task t01) failed", &failed[1..]);
        assert!(
            logs.contains(&said),
            "{first} / {backup}: {said:?} in\n{logs}"
        );
        assert!(
            logs.contains("1 attempt(s) failed here, 0 item(s) failed for good counted here"),
            "{first} / {backup}: {logs}"
        );
        assert!(
            names
                .iter()
                .any(|n| n.starts_with(&item) && n.ends_with(&format!(".{failed}.failed"))),
            "{first} / {backup}: attempt {failed}'s failure is marked: {names:?}"
        );
        assert!(
            !names.iter().any(|n| n.ends_with(".g1.failed")),
            "{first} / {backup}: the item is not failed: {names:?}"
        );
        let failed: Vec<Value> = (0..2).flat_map(|r| w.events(r, "item-failed", 1)).collect();
        assert!(failed.is_empty(), "{first} / {backup}: {failed:?}");
        let merged: BTreeSet<String> = w.merged(1).iter().map(|v| key(v).0).collect();
        assert_eq!(
            merged,
            ["t00", "t01", "t02", "t03"].map(String::from).into()
        );
    }
}

/// When every attempt of an item fails (its first and its backup), the item fails for
/// good once, counted by one rank, and is left out of the merge within
/// `max-failed-fraction`.
#[test]
fn an_item_whose_every_attempt_failed_fails_once() {
    let (w, names, logs) =
        run_with_backup("sleep 1; exit 3", "exit 3", "max-failed-fraction = 0.5");
    assert!(
        logs.contains("1 attempt(s) failed here, 1 item(s) failed for good counted here")
            && logs.contains("1 attempt(s) failed here, 0 item(s) failed for good counted here"),
        "one rank counts the item, the other only its attempt: {logs}"
    );
    let item = backed_up(&names);
    for marker in [".a0.failed", ".a1.failed", ".g1.failed"] {
        assert!(
            names
                .iter()
                .any(|n| n.starts_with(&item) && n.ends_with(marker)),
            "{marker}: {names:?}"
        );
    }
    let failed: Vec<Value> = (0..2).flat_map(|r| w.events(r, "item-failed", 1)).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["task"], "t01");
    let merged: BTreeSet<String> = w.merged(1).iter().map(|v| key(v).0).collect();
    assert_eq!(merged, ["t00", "t02", "t03"].map(String::from).into());
}

/// The shared directory is untrusted (docs/shared-directory.md): a lease someone else
/// wrote, with a pace no duration can hold and fields of the wrong type, is read with the
/// usual fallbacks (no pace, one worker) and never stops the node; its item, held by a
/// rank that never finishes it, is backed up and committed.
#[test]
fn a_malformed_lease_neither_stops_a_dynamic_rollout_nor_loses_its_item() {
    let leases = run_with_planted_leases(
        r#"printf '{"rank": 7, "item_ms": 1e300, "workers": "many", "gen": "?"}' > "@DIR@/lease.tmp"
  mv "@DIR@/lease.tmp" "$leases/p00003.g$RL_NODE_GEN.a0""#,
    );
    let backup = leases
        .iter()
        .find(|(n, _)| n.starts_with("p00003.") && n.ends_with(".a1"));
    assert!(
        backup.is_some_and(|(_, v)| v["rank"] == 0),
        "the planted item's backup lease: {leases:?}"
    );
}

/// A retry's lease whose rank is no rank of the cluster (here not a number) is nobody's:
/// the item is taken over at once, not waited for until the phase timeout (nobody backs
/// up a retry).
#[test]
fn a_retry_lease_naming_no_rank_is_taken_over_not_waited_for() {
    let leases = run_with_planted_leases(
        r#"for a in 0 1; do
    printf '{"rank": "x", "gen": 1}' > "@DIR@/lease.tmp"
    mv "@DIR@/lease.tmp" "$leases/p00003.g$RL_NODE_GEN.a$a"
  done"#,
    );
    let taken = leases
        .iter()
        .find(|(n, _)| n.starts_with("p00003.") && n.ends_with(".a2"));
    assert!(
        taken.is_some_and(|(_, v)| v["rank"] == 0),
        "the planted item's takeover lease: {leases:?}"
    );
}

/// One node's dynamic rollout of 4 items, its first item's command running `plant` (shell,
/// with `$leases` the lease directory) once: every item committed; the leases after.
fn run_with_planted_leases(plant: &str) -> Vec<(String, Value)> {
    let prefix = format!(
        r#"leases="$(dirname "$(dirname "$RL_NODE_OUTPUT")")/leases"
if [ "$(basename "$RL_NODE_OUTPUT" | cut -c1-6)" = p00000 ] && [ ! -e "@DIR@/planted" ]; then
  touch "@DIR@/planted"
  {plant}
fi
sleep 0.1"#
    );
    let w = Work::per_task(
        1,
        &task_text(4, &[]),
        "strategy = \"dynamic\"\nmax-workers = 1",
        &prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "planted leases");
    assert!(w.dir().join("planted").exists(), "the lease was planted");
    let all: BTreeSet<String> = (0..4).map(|p| format!("p{p:05}")).collect();
    assert_eq!(w.committed(1, "p"), all);
    lease_files(&w)
}

/// Ranks of speeds 1:2:4 share the pool (the slow one leaving the last items to the faster
/// ones, `lease::take_next`): every item is committed exactly once, each lease after a
/// rank's first item publishes its pace, and a restart runs nothing again.
#[test]
fn dynamic_ranks_of_unequal_speed_commit_every_item_exactly_once() {
    let prefix = r#"echo "$RL_NODE_TASK_ID $RL_NODE_SAMPLE $$ $RL_NODE_GEN $RL_NODE_RANK" >> "@DIR@/executed.log"
case "$RL_NODE_RANK" in 0) sleep 0.4 ;; 1) sleep 0.2 ;; *) sleep 0.1 ;; esac"#;
    let w = Work::per_task(
        3,
        &task_text(18, &[]),
        "strategy = \"dynamic\"\nmax-workers = 1",
        prefix,
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "unequal speeds");
    let plan = w.plan(1);
    assert_eq!(plan.pool.len(), 18);
    let all: BTreeSet<String> = (0..18).map(|p| format!("p{p:05}")).collect();
    assert_eq!(w.committed(1, "p"), all);
    assert!(w.partials(1).is_empty(), "{:?}", w.partials(1));
    let merged: Vec<(String, u64)> = w.merged(1).iter().map(key).collect();
    assert_eq!(
        merged,
        plan.pool.iter().map(item_key).collect::<Vec<_>>(),
        "every task once, in pool order"
    );
    // The rank shards and the merged file were committed from temporaries: none is left.
    let iter_dir = w.train_dir(1).parent().unwrap().to_path_buf();
    let temporaries: Vec<_> = walkdir::WalkDir::new(&iter_dir)
        .into_iter()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .map(|e| e.path().to_path_buf())
        .collect();
    assert!(temporaries.is_empty(), "{temporaries:?}");
    for r in 0..3 {
        assert!(
            iter_dir.join(format!("train/rank-{r}.jsonl")).is_file(),
            "rank {r}'s shard"
        );
    }
    // Each item has one first lease; a rank's leases after its first item carry its pace.
    let leases = lease_files(&w);
    let firsts: Vec<&(String, Value)> = leases.iter().filter(|(n, _)| n.ends_with(".a0")).collect();
    assert_eq!(firsts.len(), 18, "{leases:?}");
    let mut paces: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (n, v) in &leases {
        assert_eq!(v["workers"], 1, "{n}: {v}");
        if let Some(ms) = v["item_ms"].as_f64() {
            paces
                .entry(v["rank"].as_u64().unwrap())
                .or_default()
                .push(ms);
        }
    }
    let slowest = |r: u64| {
        paces
            .get(&r)
            .map_or(0.0, |p| p.iter().cloned().fold(0.0, f64::max))
    };
    let fastest = |r: u64| {
        paces
            .get(&r)
            .map_or(f64::MAX, |p| p.iter().cloned().fold(f64::MAX, f64::min))
    };
    // An item's time is taken from just after its command was started (a node descheduled
    // right after the fork sees a little less than the sleep).
    for r in 0..3u64 {
        let sleep = [400.0, 200.0, 100.0][r as usize];
        assert!(
            fastest(r) >= 0.9 * sleep,
            "rank {r}: paces {paces:?}; leases {leases:?}"
        );
    }
    assert!(slowest(2) < fastest(0), "{paces:?}; leases {leases:?}");
    // Every item ran, at most twice (a backup of a slow attempt).
    let log = w.executed_log();
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for l in &log {
        *count.entry(l[0].clone()).or_default() += 1;
    }
    assert_eq!(count.len(), 18, "{log:?}");
    assert!(count.values().all(|c| *c <= 2), "{count:?}");
    drop(nodes);

    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "restart after a complete dynamic rollout");
    assert_eq!(
        w.executed_log().len(),
        log.len(),
        "ran again after the restart"
    );
    assert_eq!(w.merged(1).len(), 18);
}

/// Wall-clock seconds of an event's `t`.
fn event_secs(e: &Value) -> f64 {
    let t = e["t"].as_str().unwrap();
    // 2026-11-22T00:59:22.123+00:00: seconds of the day are enough within one test.
    let time = &t[11..23];
    let (h, rest) = time.split_at(2);
    let (m, sec) = rest[1..].split_at(2);
    h.parse::<f64>().unwrap() * 3600.0
        + m.parse::<f64>().unwrap() * 60.0
        + sec[1..].parse::<f64>().unwrap()
}

#[test]
fn dynamic_ranks_leave_the_pool_promptly_when_the_last_item_commits() {
    // t00 takes 1 s, t01 is instant: whoever runs t01 then waits at the end of the pool
    // for t00 (to take it over if its claimant died). With poll-interval 4 s it must still
    // notice t00's commit about as fast as any adaptive wait ("waits start polling every
    // millisecond or so and back off to this interval"), not a whole interval later.
    let prefix = r#"[ "$RL_NODE_TASK_ID" != t00 ] || sleep 1"#;
    let w = Work::per_task(
        2,
        &task_text(2, &[]),
        "strategy = \"dynamic\"\nmax-workers = 1",
        prefix,
    );
    let slow_poll = [("RL_NODE_TIMING_POLL_INTERVAL", "4s".to_string())];
    let mut nodes: Vec<NodeProc> = (0..2)
        .map(|r| w.c.spawn_env(r, &w.c.log_path, ONE, &slow_poll))
        .collect();
    wait_ok(&mut nodes, "dynamic end of pool");
    // The rank that ran t00 enters rollout-complete right after committing it; the other
    // one should follow within a fraction of a second.
    let entered: Vec<f64> = (0..2)
        .map(|r| {
            let e = w
                .events(r, "phase", 1)
                .into_iter()
                .find(|e| e["phase"] == "rollout-complete")
                .unwrap_or_else(|| panic!("rank {r}: no rollout-complete phase event"));
            event_secs(&e)
        })
        .collect();
    let diff = (entered[0] - entered[1]).abs();
    let late = diff.min(86400.0 - diff); // across midnight
    assert!(
        late < 1.0,
        "a rank entered rollout-complete {late:.2}s after the other, which committed the pool's last item"
    );
}

// ---------------------------------------------------------------------------- 7. agreement

/// Rank 0 with `w`'s task file, rank 1 with its own copy at another path (own config
/// file, differing only in `tasks.train`), edited or not. Returns [rank 0, rank 1].
fn run_with_worker_copy(edit: bool) -> (Work, Vec<NodeProc>, TestCluster) {
    let text = task_text(6, &[]);
    let w = Work::per_task(2, &text, "", "");
    let other = TestCluster::new(2, "");
    let copy = other.dir.path().join("tasks-copy.jsonl");
    let copied = if edit {
        text.replace("solve problem 3", "solve problem 3 (edited)")
    } else {
        text
    };
    fs::write(&copy, copied).unwrap();
    append_config(&other.config, &copy, &w.work, &w.command);
    let nodes = vec![w.c.spawn(0, ONE), other.spawn_at(1, &w.c.log_path, ONE)];
    (w, nodes, other)
}

#[test]
fn a_worker_whose_task_file_differs_stops_saying_so() {
    let (_w, mut nodes, _other) = run_with_worker_copy(true);
    let code = nodes[1].wait(LIMIT);
    let err = nodes[1].stderr();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("plan") && err.contains("task files"), "{err}");
    let code = nodes[0].wait(LIMIT);
    let err = nodes[0].stderr();
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("rank 1") && err.contains("task files"),
        "{err}"
    );
}

#[test]
fn the_same_task_file_at_another_path_is_accepted() {
    let (w, mut nodes, _other) = run_with_worker_copy(false);
    wait_ok(&mut nodes, "same tasks, other path");
    assert_eq!(w.merged(1).len(), 6);
}

// ---------------------------------------------------------------------------- 8. empty rank

#[test]
fn a_rank_without_tasks_says_so_commits_an_empty_shard_and_finishes() {
    let script = r#"#!/bin/sh
# sh rollout.sh {tasks} {output}
echo "$RL_NODE_RANK" >> "@DIR@/ran.log"
[ "$1" = "$RL_NODE_TASKS" ] || { echo "{tasks} is not RL_NODE_TASKS" >&2; exit 9; }
while IFS= read -r line; do
  printf '{"rank": %s, "task": %s}\n' "$RL_NODE_RANK" "$line"
done < "$1" > "$2"
"#;
    let w = Work::new(
        3,
        &task_text(2, &[]),
        "strategy = \"contiguous\"",
        script,
        "{tasks} {output}",
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "empty rank");
    let err = nodes[2].stderr();
    assert!(err.contains("no train tasks for this rank"), "{err}");
    for n in &nodes[..2] {
        assert!(!n.stderr().contains("no train tasks"), "rank {}", n.rank);
    }
    let dir = w.train_dir(1);
    let plan = w.plan(1);
    assert_eq!(
        plan.ranks.iter().map(Vec::len).collect::<Vec<_>>(),
        [1, 1, 0]
    );
    assert_eq!(fs::read_to_string(dir.join("rank-2.jsonl")).unwrap(), "");
    assert_eq!(
        fs::read_to_string(dir.join("tasks/rank-2.jsonl")).unwrap(),
        ""
    );
    let ran: BTreeSet<String> = fs::read_to_string(w.dir().join("ran.log"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        ran,
        ["0".to_string(), "1".to_string()].into(),
        "rank 2 ran its command"
    );
    let merged = w.merged(1);
    assert_eq!(merged.len(), 2);
    let tasks = w.tasks();
    for (r, rec) in merged.iter().enumerate() {
        assert_eq!(rec["rank"], r);
        let expected: Value =
            serde_json::from_str(&tasks.raw(plan.ranks[r][0].task_index).unwrap()).unwrap();
        assert_eq!(rec["task"], expected);
    }
}

// ---------------------------------------------------------------------------- 9. progress

#[test]
fn status_shows_per_task_progress() {
    // Rank 0's second item waits for the test's go-ahead, so its progress stays at 1/2.
    let prefix = r#"if [ "$RL_NODE_RANK" = 0 ]; then
  if [ -f "@DIR@/one-done" ]; then
    while [ ! -f "@DIR@/go" ]; do sleep 0.05; done
  fi
  touch "@DIR@/one-done"
fi"#;
    let w = Work::per_task(2, &task_text(4, &[]), "max-workers = 1", prefix);
    let mut nodes = w.c.spawn_all(ONE);
    // The heartbeat carries the progress…
    wait_until(LIMIT, "rank 0's record to show 1/2 items", || {
        w.c.record(0)
            .is_some_and(|r| r["progress"] == "1/2 train items")
    });
    // …and `rl-node status` shows it (docs/work.md: "`rl-node status` shows `37/120 train items`").
    let (_, json) = status(&w.c.log_path, true);
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["ranks"][0]["progress"], "1/2 train items",
        "status --json: {json}"
    );
    let (_, text) = status(&w.c.log_path, false);
    assert!(text.contains("1/2 train items"), "status: {text}");
    fs::write(w.dir().join("go"), "").unwrap();
    wait_ok(&mut nodes, "progress");
    assert_eq!(w.merged(1).len(), 4);
}

#[test]
fn each_per_task_item_writes_its_own_log() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = dir.path().join("tasks.jsonl");
    fs::write(
        &tasks,
        (0..6)
            .map(|i| format!("{{\"id\": \"t{i}\"}}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let c = common::cluster::TestCluster::new(
        1,
        &format!(
            "[tasks]\ntrain = \"{}\"\n[work]\nmode = \"per-task\"\nmax-workers = 4\n[phases.rollout]\ncommand = \"for i in 1 2 3; do echo {{task_id}}-line-$i; sleep 0.02; done; echo '{{}}' > {{output}}\"\n",
            tasks.display()
        ),
    );
    let mut n = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(
        n.wait(std::time::Duration::from_secs(60)),
        0,
        "{}",
        n.stderr()
    );
    let items = c.log_path.join("logs/iter-0001/rank-0.rollout.items");
    let mut logs: Vec<_> = fs::read_dir(&items)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    logs.sort();
    assert_eq!(logs.len(), 6, "{logs:?}");
    for log in &logs {
        let text = fs::read_to_string(log).unwrap();
        let task = text
            .lines()
            .find_map(|l| l.strip_suffix("-line-1"))
            .unwrap_or_else(|| panic!("{}: {text}", log.display()))
            .to_string();
        // Only its own lines: concurrent items never interleave.
        for l in text
            .lines()
            .filter(|l| !l.starts_with("###") && l.contains("-line-"))
        {
            assert!(
                l.starts_with(&format!("{task}-line-")),
                "{}: {text}",
                log.display()
            );
        }
    }
    let phase_log =
        fs::read_to_string(c.log_path.join("logs/iter-0001/rank-0.rollout.log")).unwrap();
    assert_eq!(
        phase_log.matches("rank-0.rollout.items/").count(),
        6,
        "{phase_log}"
    );
}

// ---------------------------------------------------------------------------- 10. task lines

/// The task lines a per-task item receives (`RL_NODE_TASK_JSON`) and a rank's share
/// (`tasks/rank-R.jsonl`) holds are those of the file, byte for byte, though the node keeps
/// only their positions: including the file's last task, a line longer than the loader's
/// 64 KiB buffer, behind a byte-order mark, CRLF endings, blank lines and stray spaces.
#[test]
fn items_and_shares_get_the_task_lines_byte_for_byte() {
    let n = 5000;
    let mut text = String::from("\u{feff}");
    for i in 0..n - 1 {
        if i % 700 == 3 {
            text.push_str("\r\n  \r\n");
        }
        text.push_str(&format!(
            " {{\"id\": \"task-{i:05}\",\t\"prompt\": \"what is {i} + {}? \\\"quoted\\\" $HOME `x` %s \\\\ é 日本\"}}  \r\n",
            i % 89
        ));
    }
    // The last task: longer than the loader's buffer, without a final line ending.
    text.push_str(&format!(
        "{{\"id\": \"the-last\", \"prompt\": \"{}\"}}",
        "long ".repeat(14_000)
    ));
    // The file's task lines as they are: after the BOM, split at \n, trimmed, non-blank.
    let lines: Vec<&str> = text
        .trim_start_matches('\u{feff}')
        .split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines.len(), n);
    assert!(lines[n - 1].len() > 70_000);
    // A seed whose first iteration of 16 tasks holds the last one.
    let budget = 16;
    let seed = (0..)
        .find(|&s| work::iteration_tasks(n, budget, s, 1).contains(&(n - 1)))
        .unwrap();
    let script = r#"#!/bin/sh
printf '%s\n' "$RL_NODE_TASK_JSON" > "$RL_NODE_OUTPUT"
"#;
    let w = Work::new(
        2,
        &text,
        &format!(
            "mode = \"per-task\"\ntasks-per-iteration = {budget}\nseed = {seed}\nmax-workers = 4"
        ),
        script,
        "",
    );
    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "task lines");
    let plan = w.plan(1);
    let dir = w.train_dir(1);
    let mut seen_last = false;
    for (r, share) in plan.ranks.iter().enumerate() {
        assert!(!share.is_empty(), "rank {r}");
        let mut expected_share = String::new();
        for (pos, item) in share.iter().enumerate() {
            let line = lines[item.task_index];
            seen_last |= item.task_index == n - 1;
            let path = dir.join(format!("items/r{r}-{pos:05}.jsonl"));
            assert_eq!(
                fs::read_to_string(&path).unwrap(),
                format!("{line}\n"),
                "{}: task {}",
                path.display(),
                item.task
            );
            expected_share.push_str(line);
            expected_share.push('\n');
        }
        assert_eq!(
            fs::read_to_string(dir.join(format!("tasks/rank-{r}.jsonl"))).unwrap(),
            expected_share,
            "rank {r}'s share"
        );
    }
    assert!(seen_last, "the plan holds the last task");
}

/// A task file edited in place during the rollout: the next item's line no longer is what
/// the node loaded, and the node stops naming the file and line instead of handing the new
/// line to the command as if it were the planned task.
#[test]
fn a_task_file_changed_in_place_stops_the_node_naming_the_line() {
    // The first item rewrites the file in place (same inode, same length, other content).
    let script = r#"#!/bin/sh
sed 's/solve/SOLVE/' "@DIR@/tasks.jsonl" > "@DIR@/edited"
cat "@DIR@/edited" > "@DIR@/tasks.jsonl"
echo '{}' > "$RL_NODE_OUTPUT"
"#;
    let w = Work::new(
        1,
        &task_text(4, &[]),
        "mode = \"per-task\"\nmax-workers = 1",
        script,
        "",
    );
    let mut nodes = w.c.spawn_all(ONE);
    let code = nodes[0].wait(LIMIT);
    let err = nodes[0].stderr();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("tasks.train: task file {}:", w.tasks.display()))
            && err.contains("changed after rl-node loaded it at start"),
        "{err}"
    );
    // Exactly one item ran: the one that edited the file.
    assert_eq!(w.committed(1, "r0-").len(), 1);
}

// ---------------------------------------------------------------------------- 11. workers per node

/// An item's prefix that records how many items of its rank run at once: it makes a
/// marker under `@DIR@/running-R/`, appends the number of markers there to
/// `@DIR@/seen-R`, waits for `@DIR@/release` when asked to (`@HOLD@`), and removes its
/// marker before it exits. A marker lives within its item's process, so the count never
/// exceeds the items the node runs at once.
const CONCURRENCY: &str = r#"run="@DIR@/running-$RL_NODE_RANK"
mkdir -p "$run"
mkdir "$run/$RL_NODE_TASK_ID-$RL_NODE_SAMPLE"
ls "$run" | wc -l >> "@DIR@/seen-$RL_NODE_RANK"
if [ "@HOLD@" = hold ]; then
  while [ ! -e "@DIR@/release" ]; do sleep 0.02; done
else
  sleep 0.05
fi
rmdir "$run/$RL_NODE_TASK_ID-$RL_NODE_SAMPLE""#;

fn concurrency(hold: bool) -> String {
    CONCURRENCY.replace("@HOLD@", if hold { "hold" } else { "no" })
}

/// The counts of items running at once that rank r's items saw as they started.
fn seen(w: &Work, rank: u32) -> Vec<usize> {
    fs::read_to_string(w.dir().join(format!("seen-{rank}")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Rank r's items running now (their markers).
fn running(w: &Work, rank: u32) -> usize {
    fs::read_dir(w.dir().join(format!("running-{rank}")))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn a_node_with_its_own_max_workers_is_not_refused() {
    let w = Work::per_task(
        2,
        &task_text(8, &[]),
        "samples-per-task = 2\nmax-workers = 3",
        &concurrency(false),
    );
    let mut nodes = vec![
        w.c.spawn(0, ONE),
        w.c.spawn_env(
            1,
            &w.c.log_path,
            ONE,
            &[("RL_NODE_WORK_MAX_WORKERS", "1".into())],
        ),
    ];
    wait_ok(&mut nodes, "max-workers differs per node");
    assert!(
        nodes[1].stderr().contains(
            "rollout items at once on this node: 1 (work.max-workers = 1 from environment RL_NODE_WORK_MAX_WORKERS)"
        ),
        "{}",
        nodes[1].stderr()
    );
    assert!(
        nodes[0]
            .stderr()
            .contains("rollout items at once on this node: 3 (work.max-workers = 3 from "),
        "{}",
        nodes[0].stderr()
    );
    let plan = w.plan(1);
    for r in 0..2 {
        let s = seen(&w, r);
        assert_eq!(s.len(), plan.ranks[r as usize].len(), "rank {r}: {s:?}");
        let limit = if r == 0 { 3 } else { 1 };
        assert!(s.iter().all(|n| *n <= limit), "rank {r}: {s:?}");
    }
    assert_merged_in_plan_order(&w, &plan);
}

#[test]
fn max_workers_per_gpu_runs_k_items_per_gpu_of_the_node() {
    // 14 items, "2/gpu" on a node of 3 GPUs: 6 at once. Each item holds until the test
    // releases it, so the first 6 fill every slot and a 7th can start only after one ends.
    let w = Work::per_task(
        1,
        &task_text(7, &[]),
        "samples-per-task = 2\nmax-workers = \"2/gpu\"",
        &concurrency(true),
    );
    let mut node = w.c.spawn_env(
        0,
        &w.c.log_path,
        ONE,
        &[("RL_NODE_CLUSTER_GPUS_PER_NODE", "3".into())],
    );
    // Until the release no marker goes away, so the last of the first 6 items to count
    // sees all 6.
    wait_until(LIMIT, "an item to see 6 items run at once", || {
        seen(&w, 0).contains(&6)
    });
    assert_eq!(running(&w, 0), 6);
    fs::write(w.dir().join("release"), "").unwrap();
    assert_eq!(node.wait(LIMIT), 0, "{}", node.stderr());
    let s = seen(&w, 0);
    assert_eq!(s.len(), 14, "{s:?}");
    assert_eq!(s.iter().max(), Some(&6), "{s:?}");
    assert!(
        node.stderr()
            .contains("rollout items at once on this node: 6 (work.max-workers = \"2/gpu\" from ")
            && node
                .stderr()
                .contains(", 3 GPU(s) from cluster.gpus-per-node)"),
        "{}",
        node.stderr()
    );
    assert_eq!(w.merged(1).len(), 14);
}

#[test]
fn a_malformed_max_workers_is_refused_naming_the_key() {
    for (work, env) in [
        ("max-workers = \"4/node\"", None),
        ("max-workers = \"0/gpu\"", None),
        ("max-workers = 0", None),
        ("max-workers = -3", None),
        ("max-workers = 4", Some("four")),
    ] {
        let w = Work::per_task(1, &task_text(2, &[]), work, "");
        let env: Vec<(&str, String)> = env
            .map(|v| vec![("RL_NODE_WORK_MAX_WORKERS", v.to_string())])
            .unwrap_or_default();
        let mut node = w.c.spawn_env(0, &w.c.log_path, ONE, &env);
        assert_eq!(node.wait(LIMIT), 2, "{work} {env:?}: {}", node.stderr());
        assert!(
            node.stderr().contains("work.max-workers"),
            "{work} {env:?}: {}",
            node.stderr()
        );
        assert!(!w.c.log_path.join(".rl-node").exists(), "nothing written");
    }
}

/// A per-task rank that crashes after committing its shard (the concatenation of its
/// items) and before journaling the rollout: the restart runs none of its committed items
/// again, sets the earlier shard aside (kept) and commits the concatenation anew; each
/// item is merged once. Before, the restart found the shard's name taken and stopped,
/// at every restart.
#[test]
fn a_per_task_shard_committed_before_a_crash_is_set_aside_and_the_run_completes() {
    let prefix = r#"echo "$RL_NODE_TASK_ID $RL_NODE_GEN" >> "@DIR@/executed.log""#;
    let w = Work::per_task(2, &task_text(6, &[]), "", prefix);
    let fast = ("RL_NODE_TIMING_DEAD_AFTER", "1500ms".to_string());
    let crash = (
        "RL_NODE_TEST_CRASH_AT",
        "after-commit:rollout-train@1".to_string(),
    );
    let mut nodes = vec![
        w.c.spawn_env(0, &w.c.log_path, ONE, std::slice::from_ref(&fast)),
        w.c.spawn_env(1, &w.c.log_path, ONE, &[crash, fast.clone()]),
    ];
    assert_eq!(nodes[1].wait(LIMIT), 134, "{}", nodes[1].stderr());
    assert_eq!(nodes[0].wait(LIMIT), 3, "{}", nodes[0].stderr());
    let shard = w.train_dir(1).join("rank-1.jsonl");
    let first = fs::read_to_string(&shard).expect("the crashed attempt's shard");
    let ran_before = fs::read_to_string(w.dir().join("executed.log")).unwrap();
    drop(nodes);

    let mut nodes = w.c.spawn_all(ONE);
    wait_ok(&mut nodes, "restart after the shard's commit");
    let aside = w.train_dir(1).join("rank-1.jsonl.stale-gen2");
    assert_eq!(fs::read_to_string(&aside).unwrap(), first, "kept as it was");
    assert_eq!(
        fs::read_to_string(&shard).unwrap(),
        first,
        "the same items again"
    );
    // No item of rank 1 ran again: each task ran once, in generation 1.
    let ran = fs::read_to_string(w.dir().join("executed.log")).unwrap();
    assert_eq!(ran, ran_before, "items ran again after the restart");
    let merged: Vec<(String, u64)> = w.merged(1).iter().map(key).collect();
    let unique: BTreeSet<&(String, u64)> = merged.iter().collect();
    assert_eq!((merged.len(), unique.len()), (6, 6), "{merged:?}");
}
