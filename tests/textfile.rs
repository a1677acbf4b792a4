//! `[observe] prometheus-textfile` with real node processes (issue 15, docs/metrics.md):
//! each node rewrites its own file while it runs (phase, iteration, peers' heartbeat ages,
//! commands), the files pass `promtool check metrics` (the Prometheus project's own
//! checker, installed by scripts/test), and a path a node cannot write is refused before
//! it joins.

mod common;
use common::cluster::*;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Training in iteration 1 waits for the test's `go` file, so the test can look at the
/// files while both nodes are in phase training.
const COMMANDS: &str = r#"
[phases.rollout]
command = '''printf '{"r": {rank}}\n' > {output}'''
[phases.train]
command = '''if [ {iteration} = 1 ]; then while [ ! -e {log_path}/../go ]; do sleep 0.05; done; fi; mkdir -p {output}/c && echo {iteration} > {output}/c/w'''
"#;

fn with_textfile(c: &TestCluster, path: &str) {
    let mut t = fs::read_to_string(&c.config).unwrap();
    t.push_str(&format!("\n[observe]\nprometheus-textfile = '{path}'\n"));
    fs::write(&c.config, t).unwrap();
}

/// (name, labels) → value of every sample in a text-format file.
type Samples = BTreeMap<(String, BTreeMap<String, String>), f64>;

fn samples(path: &Path) -> Samples {
    let text = fs::read_to_string(path).unwrap_or_default();
    let mut out = Samples::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (
                n.to_string(),
                rest.trim_end_matches('}')
                    .split(',')
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').unwrap();
                        (k.to_string(), v.trim_matches('"').to_string())
                    })
                    .collect(),
            ),
            None => (series.to_string(), BTreeMap::new()),
        };
        out.insert((name, labels), value.parse().unwrap());
    }
    out
}

/// The value of the one sample of `name` whose labels include `labels` (every sample also
/// carries the run's id once the node has joined).
fn value(s: &Samples, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = s.iter().filter(|((n, l), _)| {
        n == name
            && labels
                .iter()
                .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            && l.keys()
                .all(|k| k == "run_id" || labels.iter().any(|(lk, _)| lk == k))
    });
    let one = found.next().map(|(_, v)| *v);
    assert!(
        found.next().is_none(),
        "{name} {labels:?}: more than one sample"
    );
    one
}

fn promtool_check(path: &Path) {
    let out = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(fs::File::open(path).unwrap())
        .output()
        .expect("promtool (Debian package prometheus; scripts/test installs it)");
    assert!(
        out.status.success(),
        "promtool check metrics {}:\n{}{}\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        fs::read_to_string(path).unwrap()
    );
}

#[test]
fn each_node_rewrites_its_own_file_while_it_runs_and_promtool_accepts_it() {
    let c = TestCluster::new(2, COMMANDS);
    let dir = c.dir.path().join("textfile");
    fs::create_dir(&dir).unwrap();
    with_textfile(&c, &format!("{}/rl-node-{{rank}}.prom", dir.display()));
    let file = |r: u32| -> PathBuf { dir.join(format!("rl-node-{r}.prom")) };
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    for r in 0..2u32 {
        let rank = r.to_string();
        let me = [("rank", rank.as_str())];
        wait_until(
            LIMIT,
            &format!("rank {r}'s file to show phase training"),
            || {
                let s = samples(&file(r));
                value(
                    &s,
                    "rl_node_phase",
                    &[("rank", &rank), ("phase", "training")],
                ) == Some(1.0)
                    && value(&s, "rl_node_iteration", &me) == Some(1.0)
            },
        );
        let s = samples(&file(r));
        assert_eq!(value(&s, "rl_node_running", &me), Some(1.0), "{s:?}");
        assert_eq!(value(&s, "rl_node_phase_number", &me), Some(10.0), "{s:?}");
        assert_eq!(
            value(
                &s,
                "rl_node_commands_total",
                &[("rank", &rank), ("command", "rollout")]
            ),
            Some(1.0),
            "{s:?}"
        );
        promtool_check(&file(r));
    }
    // Rank 0 sees rank 1's heartbeat, and rank 1 rank 0's; the ages are refreshed while
    // the nodes wait (no event happens during training).
    for (r, peer) in [(0u32, "1"), (1, "0")] {
        let rank = r.to_string();
        wait_until(
            LIMIT,
            &format!("rank {r}'s file to show peer {peer}'s age"),
            || {
                value(
                    &samples(&file(r)),
                    "rl_node_peer_heartbeat_age_seconds",
                    &[("rank", &rank), ("peer", peer)],
                )
                .is_some()
            },
        );
    }
    let before = fs::metadata(file(0)).unwrap().modified().unwrap();
    wait_until(
        LIMIT,
        "rank 0's file to be rewritten during training",
        || fs::metadata(file(0)).unwrap().modified().unwrap() > before,
    );
    fs::write(c.dir.path().join("go"), "").unwrap();
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {} failed:\n{}", n.rank, n.stderr());
    }
    for r in 0..2u32 {
        let rank = r.to_string();
        let me = [("rank", rank.as_str())];
        let s = samples(&file(r));
        assert_eq!(value(&s, "rl_node_running", &me), Some(0.0), "{s:?}");
        assert_eq!(value(&s, "rl_node_iteration", &me), Some(2.0), "{s:?}");
        let train = [("rank", rank.as_str()), ("command", "train")];
        assert_eq!(
            value(&s, "rl_node_commands_total", &train),
            Some(2.0),
            "{s:?}"
        );
        // Every command's counters exist from the start, at 0 until one fails.
        assert_eq!(
            value(&s, "rl_node_commands_failed_total", &train),
            Some(0.0),
            "{s:?}"
        );
        // Every barrier of two iterations was counted (the event log has one line each).
        let barriers = c
            .events(r)
            .iter()
            .filter(|e| e["event"] == "barrier")
            .count() as f64;
        assert_eq!(
            value(&s, "rl_node_barriers_total", &me),
            Some(barriers),
            "{s:?}"
        );
        promtool_check(&file(r));
    }
    // Nothing but the two files: the temporary files were renamed over them.
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 2);
}

#[test]
fn a_path_the_node_cannot_write_is_refused_before_it_joins() {
    let c = TestCluster::new(1, COMMANDS);
    with_textfile(&c, "/nonexistent-textfile-dir/rl-node.prom");
    let mut n = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    let err = n.stderr();
    assert!(err.contains("observe.prometheus-textfile"), "{err}");
    assert!(
        err.contains("/nonexistent-textfile-dir/rl-node.prom"),
        "{err}"
    );
    // Refused before it joined: no run was created in the shared directory.
    assert!(!c.log_path.join(".rl-node/cluster.json").exists(), "{err}");
}

#[test]
fn a_placeholder_other_than_rank_is_refused_with_the_key() {
    let c = TestCluster::new(1, COMMANDS);
    with_textfile(&c, "/tmp/rl-node-{iteration}.prom");
    let mut n = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    let err = n.stderr();
    assert!(
        err.contains("observe.prometheus-textfile") && err.contains("{iteration}"),
        "{err}"
    );
}

/// The metric names an expression file mentions (`rl_node_…`).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for (at, _) in text.match_indices("rl_node_") {
        let name: String = text[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(name);
    }
    names
}

/// A file named by rank, batch job and run (`rl-node-{rank}-{job}-{run_id}.prom`): two
/// runs on one host write two files whose samples carry their own run's id, which
/// promtool accepts; the example alert rules pass `promtool check rules` and their unit
/// tests, and every metric they and the example Grafana dashboard use is in the file.
#[test]
fn runs_on_one_host_write_their_own_files_which_the_example_rules_and_dashboard_fit() {
    let c = TestCluster::new(2, COMMANDS);
    fs::write(c.dir.path().join("go"), "").unwrap();
    let dir = c.dir.path().join("textfile");
    fs::create_dir(&dir).unwrap();
    with_textfile(
        &c,
        &format!("{}/rl-node-{{rank}}-{{job}}-{{run_id}}.prom", dir.display()),
    );
    let job = [("SLURM_JOB_ID", "4242".to_string())];
    for fresh in [&[][..], &["--fresh"][..]] {
        let args = [&["--iterations", "1"][..], fresh].concat();
        let mut nodes: Vec<_> = (0..2)
            .map(|r| c.spawn_env(r, &c.log_path, &args, &job))
            .collect();
        for n in &mut nodes {
            assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
        }
    }
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 4, "{files:?}");
    let mut runs = std::collections::BTreeSet::new();
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let (rank, run) = name
            .strip_prefix("rl-node-")
            .and_then(|r| r.strip_suffix(".prom"))
            .and_then(|r| r.split_once("-4242-"))
            .unwrap_or_else(|| panic!("{name}"));
        let s = samples(f);
        let me = [("rank", rank), ("job", "4242"), ("run_id", run)];
        assert_eq!(value(&s, "rl_node_running", &me), Some(0.0), "{s:?}");
        assert_eq!(value(&s, "rl_node_iteration", &me), Some(1.0), "{s:?}");
        assert!(
            value(&s, "rl_node_last_iteration_timestamp_seconds", &me).is_some_and(|t| t > 1.0e9),
            "{s:?}"
        );
        assert!(
            value(
                &s,
                "rl_node_phase_seconds_total",
                &[
                    ("rank", rank),
                    ("job", "4242"),
                    ("run_id", run),
                    ("phase", "train-rollout")
                ]
            )
            .is_some(),
            "{s:?}"
        );
        promtool_check(f);
        runs.insert(run.to_string());
    }
    assert_eq!(runs.len(), 2, "two runs: {runs:?}");

    // The example rules and dashboard use only metrics the files have.
    let written: std::collections::BTreeSet<String> = files
        .iter()
        .flat_map(|f| samples(f).into_keys().map(|(n, _)| n))
        .collect();
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let rules = examples.join("prometheus/rl-node-rules.yml");
    let dashboard = examples.join("grafana/rl-node-dashboard.json");
    let dash: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&dashboard).unwrap()).unwrap();
    assert!(
        dash["panels"].as_array().is_some_and(|p| p.len() >= 6),
        "{dash}"
    );
    for f in [&rules, &dashboard] {
        let used = metric_names(&fs::read_to_string(f).unwrap());
        assert!(used.len() >= 5, "{}: {used:?}", f.display());
        let missing: Vec<_> = used.difference(&written).collect();
        assert!(
            missing.is_empty(),
            "{} uses {missing:?}, not in {written:?}",
            f.display()
        );
    }
    for args in [
        vec!["check", "rules", rules.to_str().unwrap()],
        vec!["test", "rules", "rl-node-rules.test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(&args)
            .current_dir(examples.join("prometheus"))
            .output()
            .expect("promtool (Debian package prometheus; scripts/test installs it)");
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_job_in_the_name_outside_a_batch_job_is_refused_naming_the_variable() {
    let c = TestCluster::new(1, COMMANDS);
    with_textfile(&c, "/tmp/rl-node-{rank}-{job}.prom");
    let (mut cmd, stderr) = c.command(0, &c.log_path, &["--iterations", "1"], &[]);
    cmd.env_remove("SLURM_JOB_ID");
    let mut n = NodeProc::from_child(0, cmd.spawn().unwrap(), stderr);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    let err = n.stderr();
    assert!(
        err.contains("observe.prometheus-textfile") && err.contains("SLURM_JOB_ID"),
        "{err}"
    );
}

/// Elastic mode: rank 2 is killed mid-rollout and ranks 0 and 1 go on without it. Their
/// files say the generation they finished in (2) has two live nodes; the killed node's
/// file stays as it was (three live nodes, generation 1, still `running`); promtool
/// accepts all three.
#[test]
fn the_survivors_of_a_loss_count_two_live_nodes() {
    let (c, marker) = common::elastic::cluster(2, "600.7", Some(2));
    let dir = c.dir.path().join("textfile");
    fs::create_dir(&dir).unwrap();
    with_textfile(&c, &format!("{}/rl-node-{{rank}}.prom", dir.display()));
    let file = |r: u32| -> PathBuf { dir.join(format!("rl-node-{r}.prom")) };
    common::elastic::survive_a_loss(&c, &marker, 2, "600.7");
    for (r, live, generation, running) in
        [(0, 2.0, 2.0, 0.0), (1, 2.0, 2.0, 0.0), (2, 3.0, 1.0, 1.0)]
    {
        let rank = r.to_string();
        let me = [("rank", rank.as_str())];
        let s = samples(&file(r));
        assert_eq!(
            value(&s, "rl_node_live_nodes", &me),
            Some(live),
            "rank {r}: {s:?}"
        );
        assert_eq!(
            value(&s, "rl_node_generation", &me),
            Some(generation),
            "rank {r}: {s:?}"
        );
        assert_eq!(
            value(&s, "rl_node_running", &me),
            Some(running),
            "rank {r}: {s:?}"
        );
        promtool_check(&file(r));
    }
}
