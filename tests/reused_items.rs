//! Reused item processes (`phases.rollout.reuse-processes`, docs/work.md): a Python worker
//! started once per slot serves many items handed to it on standard input and answers on
//! descriptor 3, in per-task mode and with the dynamic strategy; a retryable answer and a
//! worker that dies holding an item cost only that attempt; a worker that answers wrongly
//! costs its item, saying where its log is; and a configuration that cannot work is
//! refused, naming the key.
//!
//! Fast timing (heartbeat 200 ms, dead-after 3 s, poll 100 ms); waits on conditions only.

mod common;
use common::cluster::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);
const ONE: &[&str] = &["--iterations", "1", "--eval-interval", "0"];

/// The worker: logs its start, then for each item line logs the item, runs the test's
/// `@ACT@` (Python, with `it` the item; it may exit or answer itself and `continue`),
/// writes one record to the item's `output` and answers `{"item": NAME}`.
const WORKER: &str = r#"import json, os, sys
d = "@DIR@"
rank = os.environ["RL_NODE_RANK"]
reply = os.fdopen(int(os.environ["RL_NODE_REPLY_FD"]), "w", buffering=1)
with open(f"{d}/starts.log", "a") as f:
    f.write(f"{os.getpid()} {rank}\n")
print("worker", os.getpid(), "ready", flush=True)
while True:
    line = sys.stdin.readline()
    if not line:
        break
    it = json.loads(line)
    with open(f"{d}/executed.log", "a") as f:
        f.write(f"{os.getpid()} {it['item']} {it['attempt']}\n")
@ACT@
    with open(it["output"], "w") as out:
        out.write(json.dumps({"task": it["task_id"], "sample": it["sample"],
                              "seed": it["sample_seed"], "prompt": it["task"]["prompt"],
                              "pid": os.getpid(), "rank": int(rank)}) + "\n")
    reply.write(json.dumps({"item": it["item"]}) + "\n")
"#;

struct Reused {
    c: TestCluster,
}

impl Reused {
    /// `nodes` nodes over `tasks` tasks (`{"id": "tNN", "prompt": "pNN"}`), `work` in
    /// `[work]`, the worker with `act`.
    fn new(nodes: u32, tasks: usize, work: &str, act: &str) -> Reused {
        let c = TestCluster::new(nodes, "");
        let dir = c.dir.path().to_path_buf();
        let task_path = dir.join("tasks.jsonl");
        let text: String = (0..tasks)
            .map(|i| format!("{{\"id\": \"t{i:02}\", \"prompt\": \"p{i:02}\"}}\n"))
            .collect();
        fs::write(&task_path, text).unwrap();
        let script = dir.join("worker.py");
        let body = WORKER
            .replace("@DIR@", &dir.display().to_string())
            .replace("@ACT@", act);
        fs::write(&script, body).unwrap();
        let mut config = fs::read_to_string(&c.config).unwrap();
        config.push_str(&format!(
            "\n[tasks]\ntrain = '{}'\n[work]\nretry-backoff = \"100ms\"\n{work}\n[phases.rollout]\ncommand = 'python3 {}'\nreuse-processes = true\n",
            task_path.display(),
            script.display()
        ));
        fs::write(&c.config, config).unwrap();
        Reused { c }
    }

    fn lines(&self, name: &str) -> Vec<Vec<String>> {
        fs::read_to_string(self.c.dir.path().join(name))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').map(str::to_string).collect())
            .collect()
    }

    fn merged(&self) -> Vec<Value> {
        let p = self.c.log_path.join("rollouts/iter-0001/train.jsonl");
        fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn run_ok(&self) -> String {
        let mut nodes = self.c.spawn_all(ONE);
        let mut err = String::new();
        for n in nodes.iter_mut() {
            let code = n.wait(LIMIT);
            err.push_str(&n.stderr());
            assert_eq!(code, 0, "rank {}:\n{}", n.rank, n.stderr());
        }
        err
    }
}

/// (task, sample) → how often it is in the merged file.
fn counts(merged: &[Value]) -> BTreeMap<(String, u64), usize> {
    let mut m = BTreeMap::new();
    for v in merged {
        let k = (
            v["task"].as_str().unwrap().to_string(),
            v["sample"].as_u64().unwrap(),
        );
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

fn every_item_once(merged: &[Value], tasks: usize, samples: u64) {
    let m = counts(merged);
    let want: BTreeMap<(String, u64), usize> = (0..tasks)
        .flat_map(|t| (0..samples).map(move |s| ((format!("t{t:02}"), s), 1)))
        .collect();
    assert_eq!(m, want, "merged: {merged:?}");
}

#[test]
fn per_task_items_are_served_by_one_process_per_slot_and_merged_exactly_once() {
    let w = Reused::new(
        2,
        10,
        "mode = \"per-task\"\nsamples-per-task = 2\nmax-workers = 2",
        "",
    );
    w.run_ok();
    let merged = w.merged();
    every_item_once(&merged, 10, 2);
    // Each item's record came from a worker of the rank that planned it, and carries the
    // item's values: its task record parsed, its seed.
    for v in &merged {
        let t = v["task"].as_str().unwrap();
        assert_eq!(v["prompt"].as_str().unwrap(), t.replace('t', "p"), "{v}");
        assert!(v["seed"].as_u64().is_some(), "{v}");
    }
    // 20 items, at most max-workers processes per node, each serving several.
    let starts = w.lines("starts.log");
    assert!((2..=4).contains(&starts.len()), "worker starts: {starts:?}");
    let executed = w.lines("executed.log");
    assert_eq!(executed.len(), 20, "{executed:?}");
    let pids: std::collections::BTreeSet<&str> = executed.iter().map(|l| l[0].as_str()).collect();
    assert!(pids.len() <= 4, "{pids:?}");
    // The workers' output is in their logs, and their standard input ended at the end of
    // the rollout: each exited on its own (no process is left).
    let log =
        w.c.log_path
            .join("logs/iter-0001/rank-0.rollout.items/worker-0.log");
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.contains("ready"), "{text}");
    assert!(!text.contains("stopped"), "{text}");
    let script = w.c.dir.path().join("worker.py");
    assert_eq!(
        process_alive_with(&script.display().to_string()),
        Vec::<i32>::new()
    );
}

#[test]
fn a_retryable_answer_and_a_worker_that_dies_holding_an_item_cost_only_that_attempt() {
    // t03's first attempt: the worker exits 75 (retryable) while holding it; t05's first
    // attempt is answered with exit 75. Both are retried and committed. Every other item
    // takes half a second, so the surviving worker is still busy when the next item is
    // handed out after the death (an instant one could serve all the rest alone before
    // the death is noticed under load, and no replacement would be needed).
    let act = r#"    if it["attempt"] == 0 and it["task_id"] == "t03":
        os._exit(75)
    if it["attempt"] == 0 and it["task_id"] == "t05":
        reply.write(json.dumps({"item": it["item"], "exit": 75}) + "\n")
        continue
    __import__("time").sleep(0.5)"#;
    let w = Reused::new(1, 8, "mode = \"per-task\"\nmax-workers = 2", act);
    w.run_ok();
    every_item_once(&w.merged(), 8, 1);
    let retries: Vec<Value> =
        w.c.events(0)
            .into_iter()
            .filter(|e| e["event"] == "retry")
            .collect();
    let retried: std::collections::BTreeSet<&str> = retries
        .iter()
        .map(|e| e["task"].as_str().unwrap())
        .collect();
    assert_eq!(retried, ["t03", "t05"].into_iter().collect(), "{retries:?}");
    assert!(retries.iter().all(|e| e["exit"] == 75), "{retries:?}");
    // The worker that died was replaced by a new one; the others served on.
    let starts = w.lines("starts.log");
    assert_eq!(starts.len(), 3, "{starts:?}");
    let log = w.c.log_path.join("logs/iter-0001/rank-0.rollout.items");
    let said: String = fs::read_dir(&log)
        .unwrap()
        .flatten()
        .map(|e| fs::read_to_string(e.path()).unwrap())
        .collect();
    assert!(
        said.contains("this worker ended (exit code 75) while it held item"),
        "{said}"
    );
}

#[test]
fn dynamic_ranks_hand_their_claims_to_reused_workers_and_commit_each_once() {
    let w = Reused::new(
        3,
        12,
        "strategy = \"dynamic\"\nmode = \"per-task\"\nsamples-per-task = 2\nmax-workers = 2",
        "",
    );
    w.run_ok();
    every_item_once(&w.merged(), 12, 2);
    let starts = w.lines("starts.log");
    assert!(starts.len() <= 6, "{starts:?}");
    assert!(w.lines("executed.log").len() >= 24);
}

#[test]
fn a_worker_that_answers_for_another_item_fails_its_item_and_names_its_log() {
    let act = r#"    if it["task_id"] == "t02":
        reply.write(json.dumps({"item": "not-" + it["item"]}) + "\n")
        continue"#;
    let w = Reused::new(1, 4, "mode = \"per-task\"\nmax-workers = 1", act);
    let mut node = w.c.spawn(0, ONE);
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("no answer from the item's worker process")
            && err.contains("rank-0.rollout.items/worker-0.log"),
        "{err}"
    );
    let log =
        w.c.log_path
            .join("logs/iter-0001/rank-0.rollout.items/worker-0.log");
    let text = fs::read_to_string(log).unwrap();
    assert!(
        text.contains("this worker is stopped: it answered for item not-"),
        "{text}"
    );
}

#[test]
fn a_reply_line_without_end_fails_its_item_at_the_bound_not_by_holding_it_all() {
    // 1 MB on descriptor 3 and never a newline: the node reads at most 64 KiB of it.
    let act = r#"    if it["task_id"] == "t01":
        reply.write("x" * (1 << 20))
        reply.flush()
        import time
        time.sleep(60)"#;
    let w = Reused::new(1, 3, "mode = \"per-task\"\nmax-workers = 1", act);
    let mut node = w.c.spawn(0, ONE);
    let code = node.wait(LIMIT);
    let err = node.stderr();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("no answer from the item's worker process"),
        "{err}"
    );
    let log =
        w.c.log_path
            .join("logs/iter-0001/rank-0.rollout.items/worker-0.log");
    let text = fs::read_to_string(log).unwrap();
    assert!(
        text.contains("this worker is stopped: it wrote a line longer than 65536 bytes"),
        "{text}"
    );
    let script = w.c.dir.path().join("worker.py").display().to_string();
    assert_eq!(process_alive_with(&script), Vec::<i32>::new());
}

#[test]
fn reuse_is_refused_where_it_cannot_work_naming_the_key() {
    for (work, command, key, says) in [
        (
            "",
            "python3 w.py",
            "phases.rollout.reuse-processes",
            "work.mode = \"per-task\"",
        ),
        (
            "mode = \"per-task\"",
            "python3 w.py {task_id}",
            "phases.rollout.command",
            "{task_id} differs from item to item",
        ),
        (
            "mode = \"per-task\"",
            "python3 w.py --out {output}",
            "phases.rollout.command",
            "{output} differs from item to item",
        ),
    ] {
        let c = TestCluster::new(1, "");
        let tasks = c.dir.path().join("tasks.jsonl");
        fs::write(&tasks, "{\"id\": \"a\"}\n").unwrap();
        let mut config = fs::read_to_string(&c.config).unwrap();
        config.push_str(&format!(
            "\n[tasks]\ntrain = '{}'\n[work]\n{work}\n[phases.rollout]\ncommand = '{command}'\nreuse-processes = true\n",
            tasks.display()
        ));
        fs::write(&c.config, config).unwrap();
        let mut node = c.spawn(0, ONE);
        let code = node.wait(LIMIT);
        let err = node.stderr();
        assert_eq!(code, 2, "{work} {command}: {err}");
        assert!(err.contains(key) && err.contains(says), "{err}");
        assert!(!c.log_path.join("rollouts").exists(), "{err}");
    }
}

#[test]
fn sigterm_stops_the_node_and_its_workers_while_they_hold_items() {
    let act = r#"    import time
    time.sleep(300)"#;
    let w = Reused::new(1, 4, "mode = \"per-task\"\nmax-workers = 2", act);
    let mut node = w.c.spawn(0, ONE);
    wait_until(LIMIT, "two items handed to two workers", || {
        w.lines("executed.log").len() == 2
    });
    let script = w.c.dir.path().join("worker.py").display().to_string();
    assert_eq!(process_alive_with(&script).len(), 2);
    node.signal(libc::SIGTERM);
    let code = node.wait(LIMIT);
    assert_eq!(code, 143, "{}", node.stderr());
    assert_eq!(process_alive_with(&script), Vec::<i32>::new());
    // Nothing was committed for the items they held.
    let items = w.c.log_path.join("rollouts/iter-0001/train/items");
    let committed: Vec<String> = fs::read_dir(&items)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jsonl") && !n.contains(".partial"))
        .collect();
    assert!(committed.is_empty(), "{committed:?}");
}

#[test]
fn a_dropped_groups_samples_held_by_workers_are_stopped_with_their_workers() {
    // The first sample 1 handed out fails for good and names its task; that task's other
    // samples wait to learn it and then would run for a minute. The rollout ends in time
    // only if dropping the group stops the workers holding them. The name is written
    // whole, then renamed into place: a sample that found the file created but not yet
    // written read no task, took itself for another task's and committed.
    let act = r#"    import time
    failed = f"{d}/failed_task"
    if it["sample"] == 1 and not os.path.exists(failed):
        with open(f"{failed}.{os.getpid()}", "w") as f:
            f.write(it["task_id"])
        os.rename(f"{failed}.{os.getpid()}", failed)
        reply.write(json.dumps({"item": it["item"], "exit": 3}) + "\n")
        continue
    while it["sample"] != 1 and not os.path.exists(failed):
        time.sleep(0.02)
    if open(failed).read() == it["task_id"]:
        time.sleep(60)"#;
    let w = Reused::new(
        1,
        4,
        "mode = \"per-task\"\ntasks-per-iteration = 1\nsamples-per-task = 3\nexact-budget = true\nmax-failed-fraction = 0.5\nmax-workers = 3",
        act,
    );
    let err = w.run_ok();
    let failed = fs::read_to_string(w.c.dir.path().join("failed_task")).unwrap();
    let merged = w.merged();
    let tasks: std::collections::BTreeSet<&str> =
        merged.iter().map(|v| v["task"].as_str().unwrap()).collect();
    assert_eq!(merged.len(), 3, "{merged:?}");
    assert_eq!(tasks.len(), 1, "{merged:?}");
    assert!(!tasks.contains(failed.as_str()), "{merged:?}");
    assert!(err.contains("2 running one(s) stopped"), "{err}");
    let logs = w.c.log_path.join("logs/iter-0001/rank-0.rollout.items");
    let stopped = fs::read_dir(&logs)
        .unwrap()
        .flatten()
        .filter(|e| {
            fs::read_to_string(e.path())
                .unwrap()
                .contains("this worker is stopped with the item it holds")
        })
        .count();
    assert_eq!(stopped, 2, "two workers' logs say they were stopped");
    let script = w.c.dir.path().join("worker.py").display().to_string();
    assert_eq!(process_alive_with(&script), Vec::<i32>::new());
}
