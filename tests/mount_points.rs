//! Every node may mount the shared directory where it likes. Each node here runs in a
//! mount namespace of its own and sees the share only at its own path
//! (`common::mountns`), so a path one node hands another leads nowhere, as between
//! machines. The commands are `tests/fixtures/model_probe.py`, which records what each
//! node's commands were told about the model.

mod common;
use common::cluster::*;
use common::moosefs::{self, Caches};
use common::mountns::{self, PrivateViews};
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const BASE: &str = "base-model";

/// A cluster whose rollout, training and server commands are the probe, with the base
/// model `BASE`.
fn probed_cluster(num_nodes: u32) -> TestCluster {
    let probe = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/model_probe.py");
    let c = TestCluster::new(
        num_nodes,
        &format!(
            r#"
[phases.rollout]
command = "python3 {probe} rollout"
[phases.train]
command = "python3 {probe} train"
[server]
command = "python3 {probe} server"
start-timeout = "20s"
stop-grace = "2s"
"#
        ),
    );
    c.set_model(BASE);
    c
}

/// Start every rank in its own view, with its own server port; `extra(rank)` is shell run
/// in that rank's namespace first.
fn spawn_views(
    c: &TestCluster,
    views: &PrivateViews,
    probes: &Path,
    iterations: u64,
    extra: impl Fn(u32) -> String,
) -> Vec<NodeProc> {
    let its = iterations.to_string();
    (0..c.num_nodes)
        .map(|r| {
            let env = [
                ("RL_NODE_SERVER_PORT", free_port().to_string()),
                ("PROBE_DIR", probes.display().to_string()),
            ];
            views.spawn(c, r, &["--iterations", &its], &env, &extra(r))
        })
        .collect()
}

/// What rank `rank`'s commands recorded, in order.
fn probed(probes: &Path, rank: u32) -> Vec<Value> {
    fs::read_to_string(probes.join(format!("rank-{rank}.jsonl")))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Every file of the run's own state (events aside: each node's log of what it did, in
/// its own terms) that holds `needle`.
fn state_files_holding(real: &Path, needle: &str) -> Vec<String> {
    let mut out = vec![];
    for e in walkdir::WalkDir::new(real).into_iter().flatten() {
        let rel = e.path().strip_prefix(real).unwrap().display().to_string();
        let state = rel.starts_with(".rl-node/") && !rel.starts_with(".rl-node/events/");
        let record = rel.ends_with("model.json")
            || rel.ends_with("manifest.json")
            || rel.ends_with("moved-from");
        if e.file_type().is_file()
            && (state || record)
            && fs::read(e.path()).is_ok_and(|b| String::from_utf8_lossy(&b).contains(needle))
        {
            out.push(rel);
        }
    }
    out
}

#[test]
fn nodes_that_each_mount_the_share_at_their_own_path_are_each_told_their_own_model() {
    mountns::require(
        "nodes_that_each_mount_the_share_at_their_own_path_are_each_told_their_own_model",
    );
    let c = probed_cluster(3);
    let views = PrivateViews::new(&c.log_path);
    each_told_their_own_model(&c, &views, &c.log_path);
}

/// The same on MooseFS, each node with its own `mfsmount` client (1 s caches) in its own
/// mount namespace, seeing only that client: what a real cluster's nodes do.
#[test]
fn nodes_each_with_their_own_moosefs_client_are_each_told_their_own_model() {
    let test = "nodes_each_with_their_own_moosefs_client_are_each_told_their_own_model";
    mountns::require(test);
    let Some(fs) = moosefs::start_for(test, 1, Some(Caches::all(1.0))) else {
        return;
    };
    let real = fs.mount(0).join("exp");
    let c = probed_cluster(3);
    let caches = Some(Caches::all(1.0));
    let client = fs.client_shell(Path::new("{at}"), "/exp", caches);
    let views = PrivateViews::with_client(&real, move |at| {
        client.replace("{at}", &at.display().to_string())
    });
    each_told_their_own_model(&c, &views, &real);
}

/// Run 3 iterations with every node in its view; `real` is where the test sees the share.
fn each_told_their_own_model(c: &TestCluster, views: &PrivateViews, real: &Path) {
    let probes = tempfile::tempdir().unwrap();
    let iterations = 3u64;
    let mut nodes = spawn_views(c, views, probes.path(), iterations, |_| String::new());
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    for r in 0..3u32 {
        let mine = views.at(r);
        let seen = probed(probes.path(), r);
        // The server starts before iteration 1 and again after each hand-off but the last;
        // a rollout and a training run in every iteration.
        let mut steps: Vec<(String, u64)> = seen
            .iter()
            .map(|s| {
                (
                    s["phase"].as_str().unwrap().to_string(),
                    s["iteration"].as_u64().unwrap(),
                )
            })
            .collect();
        steps.sort();
        let mut want: Vec<(String, u64)> = (1..=iterations)
            .flat_map(|i| [("rollout".to_string(), i), ("train".to_string(), i)])
            .chain((0..iterations).map(|i| ("server".to_string(), i)))
            .collect();
        want.sort();
        assert_eq!(steps, want, "rank {r}: {seen:#?}");
        for s in &seen {
            let it = s["iteration"].as_u64().unwrap();
            // A server restarts on the model its iteration's hand-off published; commands
            // of iteration i run on the model iteration i - 1 trained.
            let version = match s["phase"].as_str() {
                Some("server") => it,
                _ => it - 1,
            };
            let (model, name) = match version {
                0 => (BASE.to_string(), String::new()),
                v => (
                    mine.join(format!("models/iter-{v:04}"))
                        .display()
                        .to_string(),
                    format!("models/iter-{v:04}"),
                ),
            };
            let ctx = format!("rank {r}, mounted at {}: {s}", mine.display());
            assert_eq!(s["log_path"], mine.display().to_string(), "{ctx}");
            assert_eq!(s["model"], model.as_str(), "{ctx}");
            assert_eq!(s["model_version"], version, "{ctx}");
            assert_eq!(s["checkpoint_name"], name.as_str(), "{ctx}");
            assert_eq!(s["model_exists"], version > 0, "{ctx}");
        }
        // Each server after a hand-off loaded the checkpoint through this node's own mount.
        for i in 1..iterations {
            let log =
                fs::read_to_string(real.join(format!("logs/iter-{i:04}/rank-{r}.server.log")))
                    .unwrap_or_default();
            let at = mine.join(format!("models/iter-{i:04}"));
            assert!(
                log.contains(&format!(
                    "loaded weights of iteration {i} from {}",
                    at.display()
                )) && log.contains(&format!("serving model={}", at.display())),
                "rank {r}, iteration {i}: {log}"
            );
        }
    }
    // The trajectories carry the version of the model each rank rolled out with.
    for i in 1..=iterations {
        let merged =
            fs::read_to_string(real.join(format!("rollouts/iter-{i:04}/train.jsonl"))).unwrap();
        let records: Vec<Value> = merged
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records.len(), 3, "iteration {i}: {merged}");
        for (r, rec) in records.iter().enumerate() {
            assert_eq!(rec["rank"], r as u64, "iteration {i}: {merged}");
            assert_eq!(rec["model_version"], i - 1, "iteration {i}: {merged}");
            let name = match i - 1 {
                0 => String::new(),
                v => format!("models/iter-{v:04}"),
            };
            assert_eq!(
                rec["checkpoint_name"],
                name.as_str(),
                "iteration {i}: {merged}"
            );
        }
    }
    // No node's mount point is in what the nodes exchange.
    let views_dir = views.at(0).parent().unwrap().display().to_string();
    let leaked = state_files_holding(real, &views_dir);
    assert!(leaked.is_empty(), "absolute paths in {leaked:?}");
}

/// Rank 1 sees its own `models/` (a tmpfs made by `setup`, a shell snippet given that
/// directory), not the one rank 0 publishes into: it must stop at the hand-off, before its
/// server restarts, saying that the checkpoint rank 0 published `problem` where it looked.
fn assert_refused_before_the_server(setup: impl Fn(&str) -> String, problem: &str) {
    let c = probed_cluster(2);
    let views = PrivateViews::new(&c.log_path);
    fs::create_dir_all(c.log_path.join("models")).unwrap();
    let hidden = views.at(1).join("models");
    let probes = tempfile::tempdir().unwrap();
    let mut nodes = spawn_views(&c, &views, probes.path(), 2, |r| match r {
        1 => format!(
            "mount -t tmpfs -o size=1m rl-node-other-models {0}\n{1}",
            mountns::quote(&hidden),
            setup(&mountns::quote(&hidden))
        ),
        _ => String::new(),
    });
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    let (err0, err1) = (nodes[0].stderr(), nodes[1].stderr());
    assert_eq!(codes, vec![3, 1], "rank 0:\n{err0}\nrank 1:\n{err1}");
    // Rank 1 names the checkpoint as rank 0 published it and where it looked for it.
    let said = format!(
        "rank 0 published the checkpoint models/iter-0001, which rank 1 looked for at {}: it {problem}",
        hidden.join("iter-0001").display()
    );
    let error = err1
        .lines()
        .find(|l| l.contains("error:"))
        .unwrap_or_else(|| panic!("no error line:\n{err1}"));
    assert!(
        error.contains(&said) && error.contains("phase 11 (handoff)"),
        "{err1}"
    );
    assert!(
        !error.contains("server"),
        "the server is not to blame: {err1}"
    );
    assert!(
        err1.contains(
            "hint: every node must see the directory rank 0 writes at its own --log-path"
        ),
        "{err1}"
    );
    // Its server was never started on it; rank 0 names rank 1 and why.
    let servers: Vec<u64> = probed(probes.path(), 1)
        .iter()
        .filter(|s| s["phase"] == "server")
        .map(|s| s["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(servers, vec![0], "{err1}");
    assert!(!c.log_path.join("logs/iter-0001/rank-1.server.log").exists());
    assert!(
        err0.contains("rank 1 on ") && err0.contains(&said),
        "{err0}"
    );
}

/// What rank 0 publishes never reaches rank 1 (a stale mount, or `models/` a link to a
/// node-local disk).
#[test]
fn a_checkpoint_a_node_cannot_see_is_refused_before_its_server_starts() {
    mountns::require("a_checkpoint_a_node_cannot_see_is_refused_before_its_server_starts");
    assert_refused_before_the_server(|_| String::new(), "does not exist");
}

/// Rank 1 finds a directory of that name, but not the checkpoint rank 0 published (no
/// manifest): it is not served unverified.
#[test]
fn a_checkpoint_a_node_sees_without_its_manifest_is_refused_before_its_server_starts() {
    mountns::require(
        "a_checkpoint_a_node_sees_without_its_manifest_is_refused_before_its_server_starts",
    );
    assert_refused_before_the_server(
        |models| format!("mkdir {models}/iter-0001 && echo stale > {models}/iter-0001/weights"),
        "has no manifest.json (it is not a complete checkpoint)",
    );
}
