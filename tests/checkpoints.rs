//! Checkpoint hand-off with the real binary: training outputs laid out with symbolic links
//! (Hugging Face snapshots), links that leave the checkpoint, dangle or loop, a checkpoint
//! name that is taken, a hand-off fenced off because its generation was replaced, a
//! damaged or deleted `models/LATEST` on restart (checked against the journal, reported and
//! repaired by `recover`); a checkpoint moved (not copied) leaving excluded
//! files behind, with `keep-last` deleting old ones; a crash at each point of a moved
//! hand-off; `verify = "sizes"` against `"hash"`; and a copy across filesystems.

mod common;
use common::cluster::*;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// A one-node cluster whose training runs `train` (with the model it was given appended
/// to `models-seen` in the shared directory, one `iteration model` line per training).
fn cluster(train: &str, extra: &str) -> TestCluster {
    let command = format!("echo {{iteration}} {{model}} >> {{log_path}}/models-seen && {train}");
    TestCluster::new(
        1,
        &format!("[phases.train]\ncommand = '''{command}'''\n{extra}"),
    )
}

fn run(c: &TestCluster, iterations: u64) -> NodeProc {
    let mut n = c.spawn(0, &["--iterations", &iterations.to_string()]);
    n.wait(LIMIT);
    n
}

fn run_ok(c: &TestCluster, iterations: u64) -> NodeProc {
    let mut n = run(c, iterations);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    n
}

fn models(c: &TestCluster) -> PathBuf {
    c.log_path.join("models")
}

/// The entries of `models/`, sorted.
fn published(c: &TestCluster) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(models(c))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The model the training of `iteration` was given (the last such line).
fn model_seen(c: &TestCluster, iteration: u64) -> String {
    let text = fs::read_to_string(c.log_path.join("models-seen")).unwrap_or_default();
    text.lines()
        .rev()
        .filter_map(|l| l.split_once(' '))
        .find(|(it, _)| *it == iteration.to_string())
        .map(|(_, m)| m.to_string())
        .unwrap_or_else(|| panic!("no training of iteration {iteration} in:\n{text}"))
}

#[test]
fn a_hugging_face_snapshot_layout_is_published_with_the_content_of_its_links() {
    let c = cluster(
        "mkdir -p {output}/blobs {output}/snapshots/r1 && echo weights {iteration} > {output}/blobs/abc && ln -s ../../blobs/abc {output}/snapshots/r1/model.bin && ln -s snapshots/r1 {output}/current",
        "",
    );
    run_ok(&c, 1);
    let ckpt = models(&c).join("iter-0001");
    let m = rl_node::checkpoint::verify(&ckpt, &mut || {}).unwrap();
    let files: Vec<(String, Option<String>)> = m
        .files
        .iter()
        .map(|f| (f.path.clone(), f.link_target.clone()))
        .collect();
    assert_eq!(
        files,
        vec![
            ("blobs/abc".to_string(), None),
            (
                "current/model.bin".to_string(),
                Some("blobs/abc".to_string())
            ),
            (
                "snapshots/r1/model.bin".to_string(),
                Some("blobs/abc".to_string())
            ),
        ]
    );
    for f in ["snapshots/r1/model.bin", "current/model.bin"] {
        let p = ckpt.join(f);
        assert!(!fs::symlink_metadata(&p).unwrap().is_symlink(), "{f}");
        assert_eq!(fs::read_to_string(&p).unwrap(), "weights 1\n", "{f}");
    }
    assert_eq!(
        fs::read_to_string(models(&c).join("LATEST")).unwrap(),
        "iter-0001\n"
    );
}

/// The run fails (exit 1) naming `needle`, and nothing is published.
fn refused(train: &str, needles: &[&str]) {
    let c = cluster(train, "");
    let mut n = run(&c, 1);
    let stderr = n.stderr();
    assert_eq!(n.wait(LIMIT), 1, "{train}:\n{stderr}");
    for needle in needles {
        let needle = needle.replace(
            "{out}",
            &c.log_path
                .join("train/iter-0001/gen-1")
                .display()
                .to_string(),
        );
        assert!(
            stderr.contains(&needle),
            "{train}: expected `{needle}` in:\n{stderr}"
        );
    }
    assert!(
        stderr.contains("publishing")
            && stderr.contains("the model stays the base model (cluster.model is empty)"),
        "{stderr}"
    );
    assert_eq!(published(&c), Vec::<String>::new(), "{train}");
}

#[test]
fn a_link_that_leaves_the_checkpoint_fails_the_run_naming_it() {
    refused(
        "mkdir -p {output}/checkpoint-1 && echo w > {output}/checkpoint-1/w.bin && echo secret > {output}/outside && ln -s ../outside {output}/checkpoint-1/tokenizer.json",
        &["checkpoint link {out}/checkpoint-1/tokenizer.json -> ../outside leaves the checkpoint directory {out}/checkpoint-1"],
    );
    refused(
        "mkdir -p {output} && echo w > {output}/w.bin && ln -s /etc/passwd {output}/config.json",
        &["checkpoint link {out}/config.json -> /etc/passwd leaves the checkpoint directory {out}"],
    );
}

#[test]
fn a_dangling_or_looping_link_fails_the_run_naming_it() {
    refused(
        "mkdir -p {output}/checkpoint-1 && echo w > {output}/checkpoint-1/w.bin && ln -s ../../blobs/gone {output}/checkpoint-1/model.bin",
        &["checkpoint link {out}/checkpoint-1/model.bin -> ../../blobs/gone is dangling: its target does not exist"],
    );
    refused(
        "mkdir -p {output}/sub && echo w > {output}/w.bin && ln -s .. {output}/sub/again",
        &["checkpoint link {out}/sub/again loops: it leads back to {out}"],
    );
}

#[test]
fn an_existing_checkpoint_that_does_not_verify_is_never_replaced() {
    let c = cluster("mkdir -p {output} && echo w > {output}/w.bin", "");
    let taken = models(&c).join("iter-0001");
    fs::create_dir_all(&taken).unwrap();
    fs::write(taken.join("w.bin"), b"someone else's").unwrap();
    let mut n = run(&c, 1);
    let stderr = n.stderr();
    assert_eq!(n.wait(LIMIT), 1, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} already exists and does not verify",
            taken.display()
        )),
        "{stderr}"
    );
    assert_eq!(published(&c), vec!["iter-0001"]);
    assert_eq!(fs::read(taken.join("w.bin")).unwrap(), b"someone else's");
}

#[test]
fn a_handoff_whose_generation_was_replaced_renames_nothing() {
    // The handoff command plays the new master: it bumps the generation in cluster.json
    // while this (now old) master is about to publish.
    let bump = r#"python3 -c 'import json, sys; p = sys.argv[1]; c = json.load(open(p)); c["gen"] += 1; json.dump(c, open(p, "w"))' {log_path}/.rl-node/cluster.json"#;
    let c = cluster(
        "mkdir -p {output} && echo w > {output}/w.bin",
        &format!("[phases.handoff]\ncommand = '''{bump}'''\n"),
    );
    let mut n = run(&c, 1);
    let stderr = n.stderr();
    // A replaced node stops like one whose peer failed (exit 3), naming the new generation.
    assert_eq!(n.wait(LIMIT), 3, "{stderr}");
    assert!(
        stderr.contains("generation 1 was replaced by generation 2")
            && stderr.contains("did not publish the checkpoint iter-0001"),
        "{stderr}"
    );
    // Only generation 1's own partial directory is left: no iter-0001, no LATEST.
    assert_eq!(published(&c), vec![".iter-0001.g1.partial"]);
    let out = std::process::Command::new(BIN)
        .args(["recover", "--log-path"])
        .arg(&c.log_path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains(
            "models/.iter-0001.g1.partial: a hand-off by generation 1 that did not finish"
        ),
        "{text}"
    );
    // It had moved the training output there: recover says not to delete it (the crash
    // tests below show the next start publishing such a checkpoint).
    assert!(
        text.contains(&format!(
            "it holds the checkpoint it moved out of {} (the only copy: do not delete it)",
            c.log_path.join("train/iter-0001/gen-1").display()
        )),
        "{text}"
    );
}

fn set_latest(c: &TestCluster, text: &str) {
    fs::write(models(c).join("LATEST"), text).unwrap();
}

fn spoil(c: &TestCluster, iteration: u64) {
    fs::write(
        models(c).join(format!("iter-{iteration:04}/w.bin")),
        b"modified",
    )
    .unwrap();
}

#[test]
fn a_damaged_latest_is_never_used_the_newest_verified_checkpoint_is() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "",
    );
    run_ok(&c, 2);
    assert_eq!(
        model_seen(&c, 2),
        models(&c).join("iter-0001").display().to_string()
    );
    let model = |it: u64| {
        models(&c)
            .join(format!("iter-{it:04}"))
            .display()
            .to_string()
    };

    // Each case: damage LATEST, run one more iteration, which must train from the fallback.
    let cases: [(&str, Option<u64>, &str, u64); 4] = [
        ("", None, "models/LATEST is empty; using iter-0002, the newest verified checkpoint", 2),
        (
            "../../etc\n",
            None,
            "models/LATEST names `../../etc`, which is not a checkpoint in models/; using iter-0003, the newest verified checkpoint",
            3,
        ),
        (
            "iter-0009\n",
            None,
            "models/LATEST names iter-0009, which does not exist; using iter-0004, the newest verified checkpoint",
            4,
        ),
        // LATEST names the newest checkpoint, but one of its files was modified.
        (
            "iter-0005\n",
            Some(5),
            "models/LATEST names iter-0005, which does not verify (",
            4,
        ),
    ];
    let mut iteration = 2;
    for (latest, spoilt, warning, fallback) in cases {
        set_latest(&c, latest);
        if let Some(it) = spoilt {
            spoil(&c, it);
        }
        iteration += 1;
        let n = run_ok(&c, iteration);
        let stderr = n.stderr();
        assert!(
            stderr.contains(&format!("warning: {warning}")),
            "{latest:?}:\n{stderr}"
        );
        assert_eq!(
            model_seen(&c, iteration),
            model(fallback),
            "{latest:?}:\n{stderr}"
        );
        let events = c.events(0);
        assert!(
            events.iter().any(|e| e["event"] == "latest-fallback"
                && e["warning"]
                    .as_str()
                    .is_some_and(|w| w.starts_with(warning))),
            "{latest:?}: {events:?}"
        );
        // The hand-off of this iteration published past the damage.
        assert_eq!(
            fs::read_to_string(models(&c).join("LATEST")).unwrap(),
            format!("iter-{iteration:04}\n")
        );
    }
}

#[test]
fn no_verified_checkpoint_and_no_base_model_is_a_clear_error() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "",
    );
    run_ok(&c, 2);
    spoil(&c, 1);
    spoil(&c, 2);
    let mut n = run(&c, 3);
    let stderr = n.stderr();
    assert_eq!(n.wait(LIMIT), 1, "{stderr}");
    // Rank 0's journal records iter-0002 as published: no model to go on from, and the
    // base model would not do either (it would throw the training away).
    assert!(
        stderr.contains("models/LATEST names iter-0002, which does not verify (")
            && stderr.contains("), and none of the 2 checkpoint(s) in models/ verifies, but rank 0's journal records iter-0002 as published: going on from the base model would throw away the training of every iteration so far; restore models/iter-0002"),
        "{stderr}"
    );
    // Iteration 3 was never trained.
    assert!(!fs::read_to_string(c.log_path.join("models-seen"))
        .unwrap()
        .lines()
        .any(|l| l.starts_with("3 ")));
}

/// The handoff event of rank 0's last run, as `(transfer, excluded)`.
fn last_handoff(c: &TestCluster) -> (String, u64) {
    let e = c
        .events(0)
        .into_iter()
        .rfind(|e| e["event"] == "handoff")
        .expect("a handoff event");
    assert!(e["secs"].as_f64().is_some(), "{e}");
    (
        e["transfer"].as_str().unwrap_or_default().to_string(),
        e["excluded"].as_u64().unwrap_or(99),
    )
}

#[test]
fn a_checkpoint_is_moved_leaving_excluded_files_behind_and_old_ones_are_deleted() {
    let c = cluster(
        "mkdir -p {output}/checkpoint-1 && echo w{iteration} > {output}/checkpoint-1/w.bin && head -c 5000 /dev/zero > {output}/checkpoint-1/optimizer.pt",
        "[phases.handoff]\nexclude = [\"optimizer*.pt\"]\nkeep-last = 1\n[phases.eval]\ncommand = \"echo '{}' > {output}\"\n",
    );
    // Evals at iterations 1, 4, 7: they measure iter-0003 and iter-0006.
    let mut n = c.spawn(0, &["--iterations", "5", "--eval-interval", "3"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    let stderr = n.stderr();
    assert!(
        stderr.contains("(moved; 1 file(s) left out by phases.handoff.exclude stay in "),
        "{stderr}"
    );
    assert_eq!(last_handoff(&c), ("move".into(), 1));
    let out = c.log_path.join("train/iter-0005/gen-1/checkpoint-1");
    assert_eq!(fs::read(out.join("optimizer.pt")).unwrap().len(), 5000);
    assert!(!out.join("w.bin").exists());
    let ckpt = models(&c).join("iter-0005");
    assert_eq!(fs::read_to_string(ckpt.join("w.bin")).unwrap(), "w5\n");
    assert!(!ckpt.join("optimizer.pt").exists());
    // The newest (LATEST), the one served before it, and the one an eval measured.
    assert_eq!(
        published(&c),
        vec!["LATEST", "iter-0003", "iter-0004", "iter-0005"]
    );
    let deleted: Vec<serde_json::Value> = c
        .events(0)
        .into_iter()
        .filter(|e| e["event"] == "checkpoints-deleted")
        .flat_map(|e| e["names"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(deleted, vec!["iter-0001", "iter-0002"]);
    // Each iteration trained from the previous one's checkpoint.
    assert_eq!(
        model_seen(&c, 5),
        models(&c).join("iter-0004").display().to_string()
    );
}

/// A crash at each point of a moved hand-off leaves `LATEST` valid (or absent: the base
/// model), and the restart publishes the moved checkpoint, not the older one a pick would
/// now find in the training output.
#[test]
fn a_crash_at_any_point_of_a_moved_handoff_is_finished_by_the_restart() {
    for (point, resumed) in [
        ("handoff:after-move", "resume"),
        ("handoff:mid-copy", "resume"),
        ("handoff:before-rename", "resume"),
        ("handoff:before-latest", "kept"),
    ] {
        let c = cluster(
            "mkdir -p {output}/checkpoint-0 {output}/checkpoint-1 && echo old > {output}/checkpoint-0/w.bin && for f in a b; do echo new-$f > {output}/checkpoint-1/$f; done",
            "[phases.handoff]\nexclude = [\"b\"]\n",
        );
        let mut n = c.spawn_env(
            0,
            &c.log_path,
            &["--iterations", "1"],
            &[("RL_NODE_TEST_CRASH_AT", point.to_string())],
        );
        assert_eq!(n.wait(LIMIT), 134, "{point}: {}", n.stderr());
        if let Ok(latest) = fs::read_to_string(models(&c).join("LATEST")) {
            rl_node::checkpoint::verify(&models(&c).join(latest.trim()), &mut || {})
                .unwrap_or_else(|e| panic!("{point}: LATEST is not valid: {e}"));
        }
        let n = run_ok(&c, 1);
        assert_eq!(last_handoff(&c).0, resumed, "{point}: {}", n.stderr());
        let ckpt = models(&c).join("iter-0001");
        let m = rl_node::checkpoint::verify(&ckpt, &mut || {}).unwrap();
        let files: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(files, vec!["a"], "{point}");
        assert_eq!(fs::read_to_string(ckpt.join("a")).unwrap(), "new-a\n");
        assert_eq!(published(&c), vec!["LATEST", "iter-0001"], "{point}");
        let out = c.log_path.join("train/iter-0001/gen-1");
        assert_eq!(
            fs::read_to_string(out.join("checkpoint-1/b")).unwrap(),
            "new-b\n",
            "{point}: the excluded file is back in the training output"
        );
        assert!(out.join("checkpoint-0/w.bin").exists(), "{point}");
    }
}

/// A one-node run of one iteration whose training writes a checkpoint that the hand-off
/// copies, started with the hand-off held before its rename
/// (`RL_NODE_TEST_HOLD_AT=handoff:before-rename`) and the environment `env`.
fn held_handoff(env: &[(&str, &str)]) -> (TestCluster, NodeProc) {
    let c = cluster(
        "mkdir -p {output}/checkpoint-1 && echo w > {output}/checkpoint-1/w.bin",
        "[phases.handoff]\ntransfer = \"copy\"\n",
    );
    let mut vars = vec![("RL_NODE_TEST_HOLD_AT", "handoff:before-rename".to_string())];
    vars.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
    let n = c.spawn_env(0, &c.log_path, &["--iterations", "1"], &vars);
    (c, n)
}

/// A hand-off that takes long (a large checkpoint copied, here held before its rename)
/// does not deafen rank 0: a SIGTERM stops it within a poll, with the documented code,
/// `LATEST` untouched, and the next start finishes the hand-off. (Before publication was a
/// job the loop watches, the node heard nothing until the copy ended.)
#[test]
fn a_sigterm_during_a_long_handoff_stops_the_node_and_the_restart_finishes_it() {
    let (c, mut n) = held_handoff(&[]);
    common::cluster::wait_until(LIMIT, "the hand-off to hold", || {
        n.stderr()
            .contains("RL_NODE_TEST_HOLD_AT=handoff:before-rename")
    });
    let sent = std::time::Instant::now();
    n.signal(libc::SIGTERM);
    assert_eq!(n.wait(LIMIT), 143, "{}", n.stderr());
    assert!(
        sent.elapsed() < Duration::from_secs(20),
        "stopped only after {:?}: {}",
        sent.elapsed(),
        n.stderr()
    );
    assert!(n.stderr().contains("SIGTERM"), "{}", n.stderr());
    assert!(!models(&c).join("LATEST").exists(), "{:?}", published(&c));
    assert!(
        !models(&c).join("iter-0001").exists(),
        "{:?}",
        published(&c)
    );
    let n = run_ok(&c, 1);
    let ckpt = models(&c).join("iter-0001");
    rl_node::checkpoint::verify(&ckpt, &mut || {})
        .unwrap_or_else(|e| panic!("{e}: {}", n.stderr()));
    assert_eq!(
        fs::read_to_string(models(&c).join("LATEST"))
            .unwrap()
            .trim(),
        "iter-0001"
    );
}

/// A hand-off stuck in a call (a copy hung on one file, here held before its rename)
/// ends the node at fs-timeout with exit 4, naming what hung, as a loop stuck in a call
/// would: the loop's own pets while it waits on the publication do not hide it.
#[test]
fn a_handoff_stuck_in_a_call_ends_the_node_at_fs_timeout() {
    let (c, mut n) = held_handoff(&[("RL_NODE_TIMING_FS_TIMEOUT", "3s")]);
    assert_eq!(n.wait(LIMIT), 4, "{}", n.stderr());
    let err = n.stderr();
    assert!(
        err.contains("RL_NODE_TEST_HOLD_AT=handoff:before-rename"),
        "{err}"
    );
    assert!(
        err.contains("while publishing the checkpoint (fs-timeout is 3s)"),
        "{err}"
    );
    assert!(!models(&c).join("LATEST").exists(), "{:?}", published(&c));
}

#[test]
fn nodes_check_sizes_unless_asked_to_hash() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "",
    );
    run_ok(&c, 1);
    // Same size, other content: the default check (sizes) does not read the content.
    let w = models(&c).join("iter-0001/w.bin");
    fs::write(&w, "X1\n").unwrap();
    run_ok(&c, 2);
    assert_eq!(
        model_seen(&c, 2),
        models(&c).join("iter-0001").display().to_string()
    );
    // With verify = "hash" it is caught, and the newest checkpoint that verifies is used.
    fs::write(models(&c).join("iter-0002/w.bin"), "X2\n").unwrap();
    fs::write(&w, "w1\n").unwrap();
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "3"],
        &[("RL_NODE_PHASES_HANDOFF_VERIFY", "hash".to_string())],
    );
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    let stderr = n.stderr();
    assert!(
        stderr.contains("warning: models/LATEST names iter-0002, which does not verify (")
            && stderr.contains("; using iter-0001, the newest verified checkpoint"),
        "{stderr}"
    );
    assert_eq!(
        model_seen(&c, 3),
        models(&c).join("iter-0001").display().to_string()
    );
}

/// `models/` on another filesystem (a link to tmpfs `/dev/shm`) than the training output
/// (the test's temporary directory, on disk): the checkpoint is copied, and says why.
#[test]
fn a_checkpoint_on_another_filesystem_is_copied() {
    use std::os::unix::fs::MetadataExt;
    let c = cluster(
        "mkdir -p {output}/checkpoint-1 && echo w > {output}/checkpoint-1/w.bin",
        "",
    );
    let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("skipped: no /dev/shm to put models/ on another filesystem");
        return;
    };
    if fs::metadata(c.dir.path()).unwrap().dev() == fs::metadata(shm.path()).unwrap().dev() {
        eprintln!("skipped: /dev/shm is on the same filesystem as the temporary directory");
        return;
    }
    fs::create_dir_all(&c.log_path).unwrap();
    std::os::unix::fs::symlink(shm.path(), models(&c)).unwrap();
    let n = run_ok(&c, 1);
    assert!(
        n.stderr()
            .contains("(copied, not moved: it is on another filesystem than models/)"),
        "{}",
        n.stderr()
    );
    assert_eq!(last_handoff(&c), ("copy".into(), 0));
    assert!(c
        .log_path
        .join("train/iter-0001/gen-1/checkpoint-1/w.bin")
        .exists());
    rl_node::checkpoint::verify(&models(&c).join("iter-0001"), &mut || {}).unwrap();
}

/// `rl-node recover --discard-iteration` sets aside a moved checkpoint an interrupted
/// hand-off of that iteration left, so the redone iteration publishes its own training.
#[test]
fn discarding_an_iteration_sets_aside_its_moved_checkpoint() {
    let c = cluster(
        "mkdir -p {output}/checkpoint-1 && cat {log_path}/attempt > {output}/checkpoint-1/w.bin",
        "[phases.handoff]\ncommand = 'echo handoff >> {log_path}/handoffs'\n",
    );
    fs::create_dir_all(&c.log_path).unwrap();
    fs::write(c.log_path.join("attempt"), "first\n").unwrap();
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_TEST_CRASH_AT", "handoff:after-move".to_string())],
    );
    assert_eq!(n.wait(LIMIT), 134, "{}", n.stderr());
    assert_eq!(published(&c), vec![".iter-0001.g1.partial"]);
    let out = std::process::Command::new(BIN)
        .args(["recover", "--log-path"])
        .arg(&c.log_path)
        .args(["--discard-iteration", "1"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("models/.iter-0001.g1.partial"), "{text}");
    assert_eq!(published(&c), Vec::<String>::new());
    fs::write(c.log_path.join("attempt"), "second\n").unwrap();
    let n = run_ok(&c, 1);
    assert_eq!(last_handoff(&c).0, "move", "{}", n.stderr());
    assert_eq!(
        fs::read_to_string(models(&c).join("iter-0001/w.bin")).unwrap(),
        "second\n"
    );
    // The handoff command ran once per attempt that got to it.
    assert_eq!(
        fs::read_to_string(c.log_path.join("handoffs")).unwrap(),
        "handoff\nhandoff\n"
    );
}

/// A restart that finishes a moved hand-off does not run the handoff command again: it
/// ran before the checkpoint was moved, and the checkpoint is no longer where it looked.
#[test]
fn finishing_a_moved_handoff_does_not_run_the_handoff_command_again() {
    let c = cluster(
        "mkdir -p {output}/checkpoint-1 && echo w > {output}/checkpoint-1/w.bin",
        "[phases.handoff]\ncommand = 'test -f {output}/checkpoint-1/w.bin && echo handoff >> {log_path}/handoffs'\n",
    );
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &["--iterations", "1"],
        &[("RL_NODE_TEST_CRASH_AT", "handoff:after-move".to_string())],
    );
    assert_eq!(n.wait(LIMIT), 134, "{}", n.stderr());
    let n = run_ok(&c, 1);
    assert!(
        n.stderr().contains("a hand-off interrupted after moving the checkpoint is finished; the handoff command is not run again"),
        "{}",
        n.stderr()
    );
    assert_eq!(last_handoff(&c).0, "resume");
    assert_eq!(
        fs::read_to_string(c.log_path.join("handoffs")).unwrap(),
        "handoff\n"
    );
}

/// A crash while deleting old checkpoints (after they were renamed to `.trash-…`, before
/// they were removed) leaves no checkpoint half-deleted under its name; rank 0's next start
/// finishes the deletion.
#[test]
fn a_crash_mid_deletion_is_finished_at_the_next_start() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "[phases.handoff]\nkeep-last = 1\n",
    );
    let args = ["--iterations", "3", "--eval-interval", "0"];
    let mut n = c.spawn_env(
        0,
        &c.log_path,
        &args,
        &[("RL_NODE_TEST_CRASH_AT", "prune:before-remove".to_string())],
    );
    assert_eq!(n.wait(LIMIT), 134, "{}", n.stderr());
    // Iteration 3's hand-off deleted iter-0001 (iter-0002 was served until then).
    assert_eq!(
        published(&c),
        vec![".trash-iter-0001", "LATEST", "iter-0002", "iter-0003"]
    );
    let mut n = c.spawn(0, &args);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    assert!(
        n.stderr()
            .contains("finished deleting .trash-iter-0001 (interrupted by a crash)"),
        "{}",
        n.stderr()
    );
    // The restart served iter-0003 from its start, so the hand-off it finished no longer
    // spares iter-0002 as the model served before it.
    assert_eq!(published(&c), vec!["LATEST", "iter-0003"]);
}

/// With eval in every iteration (the default), `keep-last` alone would keep every
/// checkpoint (each is one an eval measured): the start refuses it, naming the key, and
/// `keep-eval = false` deletes all but the newest (and the one served until the last
/// hand-off).
#[test]
fn keep_last_with_eval_every_iteration_needs_keep_eval_false() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "[phases.handoff]\nkeep-last = 1\n[phases.eval]\ncommand = \"echo '{}' > {output}\"\n",
    );
    let mut n = c.spawn(0, &["--iterations", "3"]);
    assert_eq!(n.wait(LIMIT), 2, "{}", n.stderr());
    assert!(
        n.stderr().contains("phases.handoff.keep-last") && n.stderr().contains("keep-eval = false"),
        "{}",
        n.stderr()
    );
    assert!(!c.log_path.join("models").join("iter-0001").exists());

    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "[phases.handoff]\nkeep-last = 1\nkeep-eval = false\n[phases.eval]\ncommand = \"echo '{}' > {output}\"\n",
    );
    let mut n = c.spawn(0, &["--iterations", "3"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    assert_eq!(published(&c), vec!["LATEST", "iter-0002", "iter-0003"]);

    // Without an eval command no checkpoint was measured: keep-eval spares none, and the
    // default eval cadence is no contradiction.
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "[phases.handoff]\nkeep-last = 1\n",
    );
    let mut n = c.spawn(0, &["--iterations", "3"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    assert_eq!(published(&c), vec!["LATEST", "iter-0002", "iter-0003"]);
}

/// `rl-node recover --log-path` on the cluster's directory, with `args`: (exit code,
/// stdout and stderr).
fn recover(c: &TestCluster, args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(BIN)
        .args(["recover", "--log-path"])
        .arg(&c.log_path)
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// A deleted `models/LATEST` on a two-node cluster: the restart trains and serves from the
/// newest verified checkpoint (not from the base model, not from a checkpoint newer than
/// the journal's last hand-off), and every node says so; `recover` reports it.
#[test]
fn a_deleted_latest_resumes_from_the_newest_verified_checkpoint_and_says_so() {
    let server = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/health_server.py"
    );
    let c = TestCluster::new(
        2,
        &format!(
            r#"
[phases.train]
command = '''echo {{rank}} {{iteration}} {{model}} >> {{log_path}}/trained && mkdir -p {{output}} && echo w{{iteration}} > {{output}}/w.bin'''
[server]
command = '''echo {{rank}} {{model}} >> {{log_path}}/served && exec python3 {server} {{server_port}} {{model}}'''
start-timeout = "20s"
stop-grace = "2s"
"#
        ),
    );
    let base = c.dir.path().join("base-model");
    fs::create_dir_all(&base).unwrap();
    let toml = fs::read_to_string(&c.config).unwrap();
    let toml = toml.replacen(
        "[cluster]\n",
        &format!("[cluster]\nmodel = \"{}\"\n", base.display()),
        1,
    );
    fs::write(&c.config, toml).unwrap();
    let ports: Vec<String> = (0..2).map(|_| free_port().to_string()).collect();
    let start = |iterations: &str| -> Vec<NodeProc> {
        (0..2)
            .map(|r| {
                c.spawn_env(
                    r,
                    &c.log_path,
                    &["--iterations", iterations],
                    &[("RL_NODE_SERVER_PORT", ports[r as usize].clone())],
                )
            })
            .collect()
    };
    for mut n in start("3") {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
        // The first start has no LATEST either: nothing to say about it.
        assert!(!n.stderr().contains("LATEST"), "{}", n.stderr());
    }
    let checkpoint = |it: u64| models(&c).join(format!("iter-{it:04}"));
    // A complete checkpoint newer than any hand-off the journal records.
    fs::create_dir_all(checkpoint(7)).unwrap();
    for f in ["w.bin", "manifest.json", "manifest.sha256"] {
        fs::copy(checkpoint(3).join(f), checkpoint(7).join(f)).unwrap();
    }
    rl_node::checkpoint::verify(&checkpoint(7), &mut || {}).unwrap();
    fs::remove_file(models(&c).join("LATEST")).unwrap();

    let (code, text) = recover(&c, &[]);
    assert_eq!(code, 0, "{text}");
    let warning = "models/LATEST is missing; using iter-0003, the newest verified checkpoint";
    assert!(text.contains(warning), "{text}");
    assert!(
        text.contains(&format!("latest model: {}", checkpoint(3).display())),
        "{text}"
    );

    let served_before = fs::read_to_string(c.log_path.join("served")).unwrap();
    for mut n in start("4") {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
        assert!(
            n.stderr().contains(&format!("warning: {warning}")),
            "rank {}: {}",
            n.rank,
            n.stderr()
        );
    }
    let trained = fs::read_to_string(c.log_path.join("trained")).unwrap();
    for r in 0..2 {
        assert!(
            trained.contains(&format!("{r} 4 {}\n", checkpoint(3).display())),
            "rank {r}:\n{trained}"
        );
        // The server each node started on restart (the last iteration restarts none).
        let served = fs::read_to_string(c.log_path.join("served")).unwrap();
        let restarted: Vec<&str> = served[served_before.len()..]
            .lines()
            .filter(|l| l.starts_with(&format!("{r} ")))
            .collect();
        assert_eq!(
            restarted,
            vec![format!("{r} {}", checkpoint(3).display())],
            "{served}"
        );
    }
    assert_eq!(
        fs::read_to_string(models(&c).join("LATEST")).unwrap(),
        "iter-0004\n"
    );
}

/// Every checkpoint gone while the journal records published ones: the restart stops,
/// naming what is missing, instead of training on from the base model; `recover` reports
/// it as damage.
#[test]
fn a_run_whose_published_checkpoints_are_gone_stops_instead_of_restarting_from_the_base_model() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "",
    );
    let base = c.dir.path().join("base-model");
    fs::create_dir_all(&base).unwrap();
    let toml = fs::read_to_string(&c.config).unwrap().replacen(
        "[cluster]\n",
        &format!("[cluster]\nmodel = \"{}\"\n", base.display()),
        1,
    );
    fs::write(&c.config, toml).unwrap();
    run_ok(&c, 2);
    fs::remove_dir_all(models(&c)).unwrap();
    let mut n = run(&c, 3);
    let stderr = n.stderr();
    assert_eq!(n.wait(LIMIT), 1, "{stderr}");
    let why = "models/LATEST is missing, and models/ holds no checkpoint, but rank 0's journal records iter-0002 as published";
    assert!(stderr.contains(why), "{stderr}");
    assert!(
        !fs::read_to_string(c.log_path.join("models-seen"))
            .unwrap()
            .lines()
            .any(|l| l.starts_with("3 ")),
        "iteration 3 was trained"
    );
    let (code, text) = recover(&c, &[]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains(why), "{text}");
}

/// `recover --repair` points a missing `models/LATEST` at the checkpoint a restart would
/// fall back to; the restart then has nothing to warn about.
#[test]
fn recover_repair_points_a_missing_latest_at_the_newest_verified_checkpoint() {
    let c = cluster(
        "mkdir -p {output} && echo w{iteration} > {output}/w.bin",
        "",
    );
    run_ok(&c, 2);
    fs::remove_file(models(&c).join("LATEST")).unwrap();
    let (code, text) = recover(&c, &["--repair"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("repaired: models/LATEST now names iter-0002"),
        "{text}"
    );
    assert_eq!(
        fs::read_to_string(models(&c).join("LATEST")).unwrap(),
        "iter-0002\n"
    );
    let n = run_ok(&c, 3);
    assert!(!n.stderr().contains("LATEST"), "{}", n.stderr());
    assert_eq!(
        model_seen(&c, 3),
        models(&c).join("iter-0002").display().to_string()
    );
}
