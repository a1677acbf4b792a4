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
            && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            && l.keys().all(|k| k == "run_id" || labels.iter().any(|(lk, _)| lk == k))
    });
    let one = found.next().map(|(_, v)| *v);
    assert!(found.next().is_none(), "{name} {labels:?}: more than one sample");
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
        assert_eq!(
            value(&s, "rl_node_commands_failed_total", &train),
            None,
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
