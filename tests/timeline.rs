//! `rl-node timeline` on real runs (issue 15): a running and then finished run, a crashed
//! run (a node killed with SIGKILL, every node gone) and its restart (two generations), a
//! pipelined run; a failed run whose survivors wait for a dead rank; an elastic run that
//! drops a rank and takes it back; the SVG is parsed and checked against the event logs,
//! the page is loaded in headless Chromium (scripts/test installs it; a test fails without
//! it) to see it run without errors, fit a 1280 px window and zoom; `--format trace` is
//! checked against the trace-event format.

mod common;
use common::cluster::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(90);

/// Rank 2's rollout is slower than the others', so ranks 0 and 1 wait for it at the
/// `rollout-complete` barrier; it starts only once its gate file exists. Training waits
/// for a gate file too, so a test can look at the run while every node is in it.
const COMMANDS: &str = r#"
[phases.rollout]
command = '''if [ {rank} = 2 ]; then while [ ! -e {log_path}/../rollout-gate-{iteration} ]; do sleep 0.05; done; sleep 0.8; else sleep 0.2; fi; printf '{"reward": {iteration}.{rank}5}\n' > {output}'''
[phases.train]
command = "while [ ! -e {log_path}/../gate-{iteration} ]; do sleep 0.05; done; sleep 0.2; mkdir -p {output}/checkpoint-1; echo {iteration} > {output}/checkpoint-1/w"
[observe]
metrics-fields = ["reward"]
"#;

/// Run `rl-node timeline` with `args`: (exit code, stdout, stderr).
fn timeline(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg("timeline")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Draw the run in `log_path` into `out` and return the page.
fn draw(log_path: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "--log-path",
        log_path.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, stdout, stderr) = timeline(&args);
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains(&format!("wrote {}", out.display())),
        "{stdout}"
    );
    fs::read_to_string(out).unwrap()
}

/// The page's SVG, parsed as XML (it must be well-formed).
fn svg(page: &str) -> String {
    let start = page.find("<svg").expect("an <svg>");
    let end = page.find("</svg>").expect("</svg>") + "</svg>".len();
    page[start..end].to_string()
}

fn class_has(n: &roxmltree::Node, c: &str) -> bool {
    n.attribute("class")
        .is_some_and(|v| v.split(' ').any(|x| x == c))
}

fn title(n: &roxmltree::Node) -> String {
    n.children()
        .find(|c| c.has_tag_name("title"))
        .and_then(|t| t.text())
        .unwrap_or_default()
        .to_string()
}

/// Lanes by label (`rank 0`, `rollout rank 1`…), in page order.
fn lanes<'a>(doc: &'a roxmltree::Document<'a>) -> Vec<roxmltree::Node<'a, 'a>> {
    doc.descendants()
        .filter(|n| n.has_tag_name("g") && class_has(n, "lane"))
        .collect()
}

fn in_lane<'a>(lane: &roxmltree::Node<'a, 'a>, class: &str) -> Vec<roxmltree::Node<'a, 'a>> {
    lane.descendants().filter(|n| class_has(n, class)).collect()
}

/// How many phase blocks a lane stands for: plain ones, plus what each mixed one merged.
fn phase_blocks(lane: &roxmltree::Node) -> usize {
    in_lane(lane, "block")
        .iter()
        .map(|b| {
            if class_has(b, "mixed") {
                b.attribute("data-n").unwrap().parse::<usize>().unwrap()
            } else {
                1
            }
        })
        .sum()
}

/// Phase events in rank `rank`'s event log (of one cluster), of generations `gens`.
fn phase_events(log_path: &Path, cluster: Option<&str>, rank: u32) -> usize {
    let dir = match cluster {
        Some(c) => log_path.join(".rl-node").join(c).join("events"),
        None => log_path.join(".rl-node/events"),
    };
    fs::read_to_string(dir.join(format!("rank-{rank}.jsonl")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "phase")
        .count()
}

/// Let training of `iteration` go on (the gate sits beside the shared directory).
fn open_gate(log_path: &Path, iteration: u64) {
    fs::write(
        log_path.parent().unwrap().join(format!("gate-{iteration}")),
        "",
    )
    .unwrap();
}

/// Let rank 2's rollout of `iterations` go on.
fn open_rollout_gates(log_path: &Path, iterations: &[u64]) {
    for i in iterations {
        let gate = log_path.parent().unwrap().join(format!("rollout-gate-{i}"));
        fs::write(gate, "").unwrap();
    }
}

fn wait_all(nodes: &mut [NodeProc]) -> Vec<i32> {
    nodes.iter_mut().map(|n| n.wait(LIMIT)).collect()
}

/// Chromium's binary, if installed.
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find_map(common::find_in_path)
}

/// A run of three nodes, looked at while ranks 0 and 1 wait for rank 2 at a barrier of
/// iteration 2 (an open wait naming rank 2), while every node trains in iteration 2
/// (open blocks), then once it finished: a lane per rank with the host; a block per phase event; rank
/// 2's slow rollout hatched as the others' wait, naming rank 2; the commands' exits and
/// log paths in the hover text; iteration times and the reward from metrics.jsonl.
#[test]
fn a_running_then_finished_run_has_a_lane_per_rank_and_a_block_per_phase() {
    let c = TestCluster::new(3, COMMANDS);
    let out = c.dir.path().join("run.html");
    open_gate(&c.log_path, 1);
    open_rollout_gates(&c.log_path, &[1]);
    let mut nodes = c.spawn_all(&["--iterations", "2"]);

    // Running, ranks 0 and 1 waiting for rank 2 at rollout-complete of iteration 2 (for
    // a second, so that the wait is wide enough to be drawn on its own): an open wait
    // naming rank 2, from rank 0's record.
    wait_until(LIMIT, "rank 0 to wait for rank 2", || {
        c.record(0)
            .is_some_and(|r| r["iteration"] == 2 && r["waiting_for"] == serde_json::json!([2]))
    });
    lasted_a_second(&c, &[0, 1], "rollout-complete");
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    for l in &lanes(&doc)[..2] {
        let open: Vec<_> = in_lane(l, "wait")
            .into_iter()
            .filter(|w| class_has(w, "open"))
            .collect();
        assert_eq!(open.len(), 1, "{}", l.attribute("data-lane").unwrap());
        assert_eq!(open[0].attribute("data-barrier"), Some("rollout-complete"));
        assert_eq!(open[0].attribute("data-waited-for"), Some("2"));
        assert!(
            title(&open[0]).contains("still waiting"),
            "{}",
            title(&open[0])
        );
    }
    open_rollout_gates(&c.log_path, &[2]);

    for r in 0..3 {
        c.wait_phase(r, 2, "training", LIMIT);
    }
    lasted_a_second(&c, &[0, 1, 2], "training");

    // Running: every lane ends in an open training block of iteration 2.
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let ls = lanes(&doc);
    assert_eq!(ls.len(), 3);
    for l in &ls {
        let last = in_lane(l, "block").pop().unwrap();
        assert!(class_has(&last, "open"), "{}", title(&last));
        assert_eq!(last.attribute("data-phase"), Some("training"));
        assert_eq!(last.attribute("data-iteration"), Some("2"));
        let label = l.descendants().find_map(|n| n.text()).unwrap_or_default();
        assert!(
            label.starts_with(&format!("{} · ", l.attribute("data-lane").unwrap()))
                && label.ends_with(" · running"),
            "{label}"
        );
    }

    open_gate(&c.log_path, 2);
    let codes = wait_all(&mut nodes);
    assert_eq!(codes, [0, 0, 0]);
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let ls = lanes(&doc);
    let ranks: Vec<&str> = ls
        .iter()
        .map(|l| l.attribute("data-rank").unwrap())
        .collect();
    assert_eq!(ranks, ["0", "1", "2"]);
    let svg_el = doc.root_element();
    assert_eq!(svg_el.attribute("data-lanes"), Some("3"));
    for (r, l) in ls.iter().enumerate() {
        // Every phase event is drawn, on its own or inside a mixed block.
        assert_eq!(
            phase_blocks(l),
            phase_events(&c.log_path, None, r as u32),
            "rank {r}"
        );
        // Rollout and training last long enough to be blocks of their own, one per
        // iteration, with what the hover shows.
        for phase in ["train-rollout", "training"] {
            let blocks: Vec<_> = in_lane(l, "block")
                .into_iter()
                .filter(|b| !class_has(b, "mixed") && b.attribute("data-phase") == Some(phase))
                .collect();
            assert_eq!(blocks.len(), 2, "rank {r} {phase}");
            for (i, b) in blocks.iter().enumerate() {
                let t = title(b);
                let cmd = if phase == "training" {
                    "train"
                } else {
                    "rollout"
                };
                for want in [
                    format!("{phase} · rank {r} · iteration {}", i + 1),
                    format!("host {}", gethost()),
                    "start 20".to_string(),
                    "duration ".to_string(),
                    format!("log: logs/iter-000{}/rank-{r}.{cmd}.log", i + 1),
                    format!("{cmd} command: exit code 0"),
                ] {
                    assert!(t.contains(&want), "rank {r}: no {want:?} in {t}");
                }
                assert!(!class_has(b, "open"), "{t}");
            }
        }
        assert!(
            in_lane(l, "mark").is_empty(),
            "rank {r}: marks in a clean run"
        );
    }
    // Ranks 0 and 1 waited for rank 2 at rollout-complete, hatched, in both iterations.
    for r in [0, 1] {
        let waits: Vec<_> = in_lane(&ls[r], "wait")
            .into_iter()
            .filter(|w| w.attribute("data-barrier") == Some("rollout-complete"))
            .collect();
        assert_eq!(waits.len(), 2, "rank {r}");
        for w in waits {
            assert_eq!(w.attribute("fill"), Some("url(#hatch)"));
            assert_eq!(w.attribute("data-waited-for"), Some("2"), "{}", title(&w));
            assert!(title(&w).contains("waiting for rank(s) 2"), "{}", title(&w));
            let width: f64 = w.attribute("width").unwrap().parse().unwrap();
            assert!(width > 10.0, "{width}");
        }
    }
    // The hatch is a pattern of the page.
    assert!(doc
        .descendants()
        .any(|n| n.has_tag_name("pattern") && n.attribute("id") == Some("hatch")));
    // One generation; iteration times from metrics.jsonl, and the mean reward.
    let gens: Vec<_> = doc.descendants().filter(|n| class_has(n, "gen")).collect();
    assert_eq!(gens.len(), 1);
    let its: Vec<_> = doc
        .descendants()
        .filter(|n| class_has(n, "iteration"))
        .collect();
    assert_eq!(its.len(), 2);
    assert!(
        title(&its[1]).starts_with("iteration 2: "),
        "{}",
        title(&its[1])
    );
    assert!(title(&its[1]).contains("\ntraining "), "{}", title(&its[1]));
    let values: Vec<String> = doc
        .descendants()
        .filter(|n| class_has(n, "value"))
        .map(|n| title(&n))
        .collect();
    // Mean of 1.05, 1.15, 1.25 and of 2.05, 2.15, 2.25.
    assert_eq!(
        values,
        [
            "iteration 1: mean reward 1.150",
            "iteration 2: mean reward 2.150"
        ]
    );

    // Only iteration 2: half the blocks, none of iteration 1.
    let page2 = draw(&c.log_path, &out, &["--iterations", "2..2"]);
    let text2 = svg(&page2);
    let doc2 = roxmltree::Document::parse(&text2).unwrap();
    for l in lanes(&doc2) {
        assert!(in_lane(&l, "block")
            .iter()
            .all(|b| b.attribute("data-iteration").is_none_or(|i| i == "2")));
        assert!(phase_blocks(&l) > 0 && phase_blocks(&l) < phase_blocks(&ls[0]));
    }

    // In a real browser: the script ran without errors and sees the same lanes and
    // blocks as the SVG says.
    let chrome = chromium().expect(
        "chromium is not installed (scripts/test installs it): the page must be checked in a browser",
    );
    let dom = Command::new(chrome)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"])
        .arg(format!("file://{}", out.display()))
        .output()
        .unwrap();
    // The page of the last draw (iteration 2 only).
    let dom = String::from_utf8_lossy(&dom.stdout).into_owned();
    let body = &dom[dom.find("<body").expect("a body")..];
    let body = &body[..body.find('>').unwrap()];
    assert!(body.contains(r#"data-timeline="ok""#), "{body}");
    assert!(!body.contains("data-error"), "{body}");
    assert!(body.contains(r#"data-lanes="3""#), "{body}");
    let blocks = doc2.root_element().attribute("data-blocks").unwrap();
    assert!(
        body.contains(&format!(r#"data-blocks="{blocks}""#)),
        "{body} vs {blocks}"
    );
}

/// Wait until each of `ranks` has been in `phase` for a second by its record's last write
/// (the heartbeat rewrites it), so that its open block (or wait) is wide enough to be
/// drawn on its own, not merged into a mixed block.
fn lasted_a_second(c: &TestCluster, ranks: &[u32], phase: &str) {
    let t = |s: &str| {
        chrono::DateTime::parse_from_rfc3339(s)
            .unwrap()
            .timestamp_millis()
    };
    wait_until(
        LIMIT,
        &format!("the ranks to be in {phase} for a second"),
        || {
            ranks.iter().all(|&r| {
                let entered = c
                    .events(r)
                    .iter()
                    .rev()
                    .find(|e| e["event"] == "phase" && e["phase"] == phase)
                    .map(|e| t(e["t"].as_str().unwrap()));
                let wall = c.record(r).map(|rec| t(rec["wall"].as_str().unwrap()));
                matches!((entered, wall), (Some(a), Some(b)) if b - a >= 1000)
            })
        },
    );
}

fn gethost() -> String {
    let out = Command::new("hostname").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Rank 2 is killed with SIGKILL while training in iteration 2; the others notice and
/// stop, so every node is gone. The page marks rank 2's lane with the failure and its
/// message, and its training block is open. Restarted, the run completes in a second
/// generation: the page separates the two and says why the first ended.
#[test]
fn a_crashed_run_marks_the_failure_and_its_restart_is_a_second_generation() {
    let c = TestCluster::new(3, COMMANDS);
    let out = c.dir.path().join("run.html");
    open_gate(&c.log_path, 1);
    open_rollout_gates(&c.log_path, &[1, 2]);
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    c.wait_phase(2, 2, "training", LIMIT);
    lasted_a_second(&c, &[2], "training");
    nodes[2].signal(libc::SIGKILL);
    let codes = wait_all(&mut nodes);
    assert_ne!(codes[0], 0);
    assert_ne!(codes[1], 0);

    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let ls = lanes(&doc);
    assert_eq!(ls.len(), 3);
    let failures: Vec<(usize, String)> = ls
        .iter()
        .enumerate()
        .flat_map(|(r, l)| {
            in_lane(l, "failure")
                .into_iter()
                .map(move |m| (r, title(&m)))
        })
        .collect();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let (r, msg) = &failures[0];
    assert_eq!(*r, 2);
    assert!(
        msg.contains("rank 2 on") && msg.contains("is dead"),
        "{msg}"
    );
    // The message is on the page, not only in the hover text, in a row of its own.
    let shown = doc
        .descendants()
        .find(|n| class_has(n, "failure-text"))
        .and_then(|r| r.descendants().find(|n| n.has_tag_name("text")))
        .and_then(|t| t.text())
        .unwrap()
        .to_string();
    assert!(shown.starts_with("rank 2: "), "{shown}");
    let last = in_lane(&ls[2], "block").pop().unwrap();
    assert_eq!(last.attribute("data-phase"), Some("training"));
    assert!(class_has(&last, "open"), "{}", title(&last));
    for l in &ls {
        assert!(in_lane(l, "block")
            .iter()
            .all(|b| b.attribute("data-gen").is_none_or(|g| g == "1")));
    }

    // The trace of the stopped run: the failure is an instant event.
    let trace = trace_of(&c.log_path);
    let failures: Vec<&serde_json::Value> = trace
        .iter()
        .filter(|e| e["ph"] == "i" && e["cat"] == "failure")
        .collect();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["tid"], 1 + 2 * 3, "rank 2's phase track");
    assert!(failures[0]["args"]["detail"]
        .as_str()
        .unwrap()
        .contains("is dead"));

    // Restart every node, after a downtime of at least six seconds (more than the
    // generation lasted): the run resumes and completes in generation 2.
    let stopped = std::time::Instant::now();
    wait_until(LIMIT, "six seconds of downtime", || {
        stopped.elapsed() >= Duration::from_secs(6)
    });
    open_gate(&c.log_path, 2);
    let mut nodes = c.spawn_all(&["--iterations", "2"]);
    assert_eq!(wait_all(&mut nodes), [0, 0, 0]);
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let gens: Vec<(String, String)> = doc
        .descendants()
        .filter(|n| class_has(n, "gen"))
        .map(|n| (n.attribute("data-gen").unwrap().to_string(), title(&n)))
        .collect();
    assert_eq!(gens.len(), 2, "{gens:?}");
    assert_eq!(gens[0].0, "1");
    assert_eq!(gens[1].0, "2");
    assert!(
        gens[1].1.contains("the previous generation ended:") && gens[1].1.contains("is dead"),
        "{}",
        gens[1].1
    );
    let ls = lanes(&doc);
    for (r, l) in ls.iter().enumerate() {
        assert_eq!(
            phase_blocks(l),
            phase_events(&c.log_path, None, r as u32),
            "rank {r}"
        );
        let gens: std::collections::BTreeSet<&str> = in_lane(l, "block")
            .iter()
            .filter_map(|b| b.attribute("data-gen"))
            .collect();
        assert!(
            gens.contains("1") && gens.contains("2"),
            "rank {r}: {gens:?}"
        );
    }
    // The failure of generation 1 is still marked.
    assert_eq!(in_lane(&ls[2], "failure").len(), 1);
    // The downtime between the generations is collapsed into a labelled band, and the
    // page says how much of the wall time went into iterations that completed.
    let down: Vec<_> = doc
        .descendants()
        .filter(|n| class_has(n, "downtime"))
        .collect();
    assert_eq!(down.len(), 1);
    let secs: f64 = down[0].attribute("data-secs").unwrap().parse().unwrap();
    assert!(secs >= 6.0, "{secs}");
    let band = down[0].children().find(|n| n.has_tag_name("rect")).unwrap();
    assert_eq!(band.attribute("width"), Some("70.0"));
    let texts: Vec<&str> = down[0].descendants().filter_map(|n| n.text()).collect();
    assert!(texts.contains(&"downtime"), "{texts:?}");
    assert!(title(&down[0]).contains("generation 2 began after it"));
    let summary = &page[page.find("<p>").unwrap()..];
    assert!(summary.starts_with("<p>goodput "), "{}", &summary[..200]);
    // Generation 2's line lies at the band's end: drawn after the downtime.
    let gen2 = doc
        .descendants()
        .find(|n| class_has(n, "gen") && n.attribute("data-gen") == Some("2"))
        .unwrap();
    let line = gen2.children().find(|n| n.has_tag_name("line")).unwrap();
    let x: f64 = line.attribute("x1").unwrap().parse().unwrap();
    let b0: f64 = band.attribute("x").unwrap().parse().unwrap();
    assert!(x >= b0 + 60.0 && x <= b0 + 70.5, "{x} vs {b0}");

    // The trace of both generations: every rank's phases as complete events.
    let trace = trace_of(&c.log_path);
    for r in 0..3u64 {
        let phases: Vec<&serde_json::Value> = trace
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "phase" && e["tid"] == 1 + r * 3)
            .collect();
        assert_eq!(
            phases.len(),
            phase_events(&c.log_path, None, r as u32),
            "rank {r}"
        );
        // Training waits for its gate: at least the 0.2 s its command sleeps after it.
        let training: f64 = phases
            .iter()
            .filter(|e| e["name"] == "training" && e["args"]["generation"] == 2)
            .map(|e| e["dur"].as_f64().unwrap())
            .sum();
        assert!(
            (200_000.0..60_000_000.0).contains(&training),
            "rank {r}: {training} us"
        );
        let commands = trace
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "command" && e["tid"] == 3 + r * 3)
            .count();
        assert!(commands >= 2, "rank {r}: {commands} commands");
        let name = trace
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["tid"] == 1 + r * 3)
            .unwrap();
        assert!(name["args"]["name"]
            .as_str()
            .unwrap()
            .starts_with(&format!("rank {r}")));
    }
    let gens: Vec<&serde_json::Value> = trace
        .iter()
        .filter(|e| e["ph"] == "i" && e["cat"] == "generation")
        .collect();
    assert_eq!(gens.len(), 2);
    let labels = trace
        .iter()
        .find(|e| e["ph"] == "M" && e["name"] == "process_labels")
        .unwrap();
    assert!(labels["args"]["labels"]
        .as_str()
        .unwrap()
        .contains("generation 2 from"));
}

/// `rl-node timeline --format trace` on the run in `log_path`: its events, each checked
/// against the trace-event format's required fields and their types.
fn trace_of(log_path: &Path) -> Vec<serde_json::Value> {
    let (code, stdout, stderr) = timeline(&[
        "--log-path",
        log_path.to_str().unwrap(),
        "--format",
        "trace",
    ]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let path = log_path.join("timeline.json");
    assert!(
        stdout.contains(&format!("wrote {}", path.display())),
        "{stdout}"
    );
    let doc: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(doc["displayTimeUnit"], "ms");
    let events = doc["traceEvents"].as_array().expect("traceEvents").clone();
    assert!(!events.is_empty());
    for e in &events {
        assert!(e["name"].is_string(), "{e}");
        assert!(e["pid"].is_u64() && e["tid"].is_u64(), "{e}");
        let ts = e["ts"].as_f64().unwrap_or_else(|| panic!("no ts: {e}"));
        assert!(ts >= 0.0, "{e}");
        match e["ph"].as_str() {
            Some("X") => assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{e}"),
            Some("i") => assert!(["g", "p", "t"].contains(&e["s"].as_str().unwrap()), "{e}"),
            Some("M") => assert!(e["args"].is_object(), "{e}"),
            _ => panic!("a phase this trace does not use: {e}"),
        }
    }
    events
}

/// A pipelined run (one rollout node, one update node): both clusters' lanes, labelled;
/// `--cluster` keeps one.
#[test]
fn a_pipelined_run_has_both_clusters_lanes() {
    // Rollouts much slower than training, so that the update cluster waits for the
    // rollout cluster's trajectories whatever the machine's load (a 0.1 s rollout could
    // be over before a loaded machine started the update node).
    let extra = r#"
[phases.rollout]
command = '''sleep 1.5; printf '{"reward": {iteration}}\n' > {output}'''
[phases.train]
command = "sleep 0.1; mkdir -p {output}/checkpoint-1; echo {iteration} > {output}/checkpoint-1/w"
[observe]
metrics-fields = ["reward"]
[pipeline]
staleness = 1
"#;
    let c = TestCluster::pipelined(extra);
    let mut nodes = c.spawn_rollout_and_update(2);
    assert_eq!(wait_all(&mut nodes), [0, 0]);
    let out = c.dir.path().join("run.html");
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let ls = lanes(&doc);
    let labels: Vec<&str> = ls
        .iter()
        .map(|l| l.attribute("data-lane").unwrap())
        .collect();
    assert_eq!(labels, ["rollout rank 0", "update rank 0"]);
    for (l, cluster) in ls.iter().zip(["rollout", "update"]) {
        assert_eq!(l.attribute("data-cluster"), Some(cluster));
        assert_eq!(phase_blocks(l), phase_events(&c.log_path, Some(cluster), 0));
        assert!(phase_blocks(l) > 0);
    }
    // Cluster headings, a generation per cluster, iteration times per cluster.
    let headings: Vec<&str> = doc
        .descendants()
        .filter(|n| class_has(n, "cluster"))
        .filter_map(|n| n.text())
        .collect();
    assert_eq!(headings, ["rollout cluster", "update cluster"]);
    assert_eq!(doc.descendants().filter(|n| class_has(n, "gen")).count(), 2);
    let charts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.attribute("id") == Some("iteration-times"))
        .filter_map(|n| n.attribute("data-cluster"))
        .collect();
    assert_eq!(charts, ["rollout", "update"]);
    // The update cluster's waits for the rollout cluster's trajectories are drawn as
    // waits (hatched blue), not as the phase it waits in.
    let logged: Vec<f64> =
        fs::read_to_string(c.log_path.join(".rl-node/update/events/rank-0.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == "pipeline-wait")
            .map(|v| v["secs"].as_f64().unwrap())
            .collect();
    assert!(logged.iter().any(|s| *s >= 0.05), "{logged:?}");
    let drawn: Vec<_> = in_lane(&ls[1], "pipeline");
    assert!(
        drawn.len() >= logged.iter().filter(|s| **s >= 0.05).count(),
        "{} drawn, {logged:?} logged",
        drawn.len()
    );
    for w in &drawn {
        assert_eq!(w.attribute("fill"), Some("url(#hatch-pipeline)"));
        assert!(title(w).contains("(the other cluster;"), "{}", title(w));
    }

    let page = draw(&c.log_path, &out, &["--cluster", "update"]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let labels: Vec<String> = lanes(&doc)
        .iter()
        .map(|l| l.attribute("data-lane").unwrap().to_string())
        .collect();
    assert_eq!(labels, ["update rank 0"]);
}

/// Bad input: exit 2, naming what is wrong; nothing written.
#[test]
fn bad_input_is_refused_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().to_str().unwrap();
    let (code, _, err) = timeline(&["--log-path", p]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no rl-node run in"), "{err}");
    assert!(!dir.path().join("timeline.html").exists());
    let (code, _, err) = timeline(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--log-path"), "{err}");

    // A finished one-node run, then bad flags on it.
    let c = TestCluster::new(1, "");
    let mut n = c.spawn_all(&["--iterations", "1"]);
    assert_eq!(wait_all(&mut n), [0]);
    let lp = c.log_path.to_str().unwrap();
    for (range, want) in [
        ("5..3", "--iterations 5..3: the range is empty"),
        ("x..3", "--iterations x..3"),
        ("..", "--iterations ..: give at least one end"),
        (
            "5..",
            "--iterations 5..: the run has no event of those iterations",
        ),
        (
            "7..9",
            "--iterations 7..9: the run has no event of those iterations",
        ),
    ] {
        let (code, _, err) = timeline(&["--log-path", lp, "--iterations", range]);
        assert_eq!(code, 2, "{range}: {err}");
        assert!(err.contains(want), "{range}: {err}");
    }
    let (code, _, err) = timeline(&["--log-path", lp, "--cluster", "rollout"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--cluster rollout") && err.contains("not pipelined"),
        "{err}"
    );
    assert!(!c.log_path.join("timeline.html").exists());
    // And a good one: the default place.
    let (code, out, err) = timeline(&["--log-path", lp, "--iterations", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("timeline.html"), "{out}");
    assert!(c.log_path.join("timeline.html").exists());
}

/// `--cluster rollout` on a pipelined run whose rollout cluster never started: refused
/// with exit 2, the message naming the flag (not only "no rl-node run …").
#[test]
fn a_cluster_that_never_started_is_refused_naming_the_flag() {
    let c = TestCluster::pipelined("[pipeline]\nstaleness = 1\n");
    let update = c.spawn(
        0,
        &[
            "--iterations",
            "1",
            "--num-nodes",
            "1",
            "--rl-phase",
            "update",
        ],
    );
    let lp = c.log_path.to_str().unwrap();
    // Until the update cluster's record exists the run is not yet a pipelined one.
    let start = std::time::Instant::now();
    let (code, err) = loop {
        let (code, _, err) = timeline(&["--log-path", lp, "--cluster", "rollout"]);
        if !err.contains("is not pipelined") {
            break (code, err);
        }
        assert!(
            start.elapsed() < LIMIT,
            "the update cluster did not start: {err}\nits node: {}",
            update.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--cluster rollout: no rl-node run"), "{err}");
    assert!(!c.log_path.join("timeline.html").exists());
}

/// Rank 2's training waits for a gate the test never opens before killing it; the others'
/// training takes 0.3 s, after which they wait for rank 2 at the barrier that ends it.
const DEAD_RANK: &str = r#"
[phases.rollout]
command = '''sleep 0.1; printf '{"reward": 1}\n' > {output}'''
[phases.train]
command = "if [ {rank} = 2 ]; then while [ ! -e {log_path}/../release-2 ]; do sleep 0.05; done; fi; sleep 0.3; mkdir -p {output}/checkpoint-1; echo 1 > {output}/checkpoint-1/w"
"#;

/// The page loaded in headless Chromium at a window `width` px wide, with a script of the
/// test's own appended that measures what was laid out and then turns the mouse wheel over
/// the first open wait: `<body>`'s attributes as the page and that script left them.
fn in_browser(page: &Path, width: u32) -> String {
    let chrome = chromium().expect(
        "chromium is not installed (scripts/test installs it): the page must be checked in a browser",
    );
    let measure = r#"<script>
(function () {
  var b = document.body, W = window.innerWidth, svg = document.getElementById('timeline');
  var s = svg.getBoundingClientRect(), k = s.width / svg.viewBox.baseVal.width;
  var plotL = s.left + Number(svg.getAttribute('data-plot-x')) * k;
  var plotR = plotL + Number(svg.getAttribute('data-plot-w')) * k;
  var right = 0, left = 1e9, clipped = [];
  var els = document.querySelectorAll('h2, p, svg text, svg rect, svg line');
  for (var i = 0; i < els.length; i++) {
    var el = els[i];
    if (el.closest('defs')) continue;
    var r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    right = Math.max(right, r.right); left = Math.min(left, r.left);
    // Text in the zoomable time area must lie inside it (it would be cut off there).
    if (el.tagName === 'text' && el.closest('.tz') && (r.left < plotL - 1 || r.right > plotR + 1))
      clipped.push(el.textContent);
  }
  b.setAttribute('data-inner-width', W);
  b.setAttribute('data-scroll-width', document.documentElement.scrollWidth);
  b.setAttribute('data-max-right', right.toFixed(1));
  b.setAttribute('data-min-left', left.toFixed(1));
  // A lane's label must end before its lane begins (the lane would cover it).
  var labels = document.querySelectorAll('g.lane > text');
  for (var j = 0; j < labels.length; j++)
    if (labels[j].getBoundingClientRect().right > plotL) clipped.push(labels[j].textContent);
  b.setAttribute('data-clipped', JSON.stringify(clipped));
  var label = document.querySelector('g.lane text').getBoundingClientRect().width;
  var w = document.querySelector('rect.wait.open');
  var r0 = w.getBoundingClientRect();
  svg.dispatchEvent(new WheelEvent('wheel', { deltaY: -600, clientX: r0.left + r0.width / 2,
    clientY: r0.top + 2, bubbles: true, cancelable: true }));
  var r1 = w.getBoundingClientRect();
  b.setAttribute('data-wait-px', r0.width.toFixed(1) + ' ' + r1.width.toFixed(1));
  b.setAttribute('data-label-px', label.toFixed(1) + ' ' +
    document.querySelector('g.lane text').getBoundingClientRect().width.toFixed(1));
})();
</script></body>"#;
    let html = fs::read_to_string(page)
        .unwrap()
        .replace("</body>", measure);
    let probe = page.with_extension("probe.html");
    fs::write(&probe, html).unwrap();
    let out = Command::new(chrome)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--window-size={width},900"))
        .arg("--dump-dom")
        .arg(format!("file://{}", probe.display()))
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    let body = &dom[dom.find("<body").expect("a body")..];
    body[..body.find('>').unwrap()].to_string()
}

/// An attribute of the `<body>` tag text `body`.
fn attr(body: &str, name: &str) -> String {
    let key = format!(" {name}=\"");
    let at = body
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in {body}"))
        + key.len();
    html_unescape(&body[at..at + body[at..].find('"').unwrap()])
}

fn html_unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

fn num(s: &str) -> f64 {
    s.parse().unwrap_or_else(|_| panic!("not a number: {s}"))
}

/// Rank 2 is killed with SIGKILL in its training while ranks 0 and 1, whose training
/// ended, wait for it at the barrier after training; they stop once they notice it dead.
/// The page draws their wait as a hatched open wait for rank 2, lasting past rank 2's
/// last sign of life and saying it is dead; rank 2's lane is labelled `dead`, theirs
/// `stopped by a peer`; the failure's message is in a row of its own. In Chromium at
/// 1280 px nothing is cut off, and the wheel zooms the lanes' time, not their labels.
#[test]
fn a_failed_run_draws_the_survivors_wait_for_the_dead_rank() {
    let c = TestCluster::new(3, DEAD_RANK);
    let out = c.dir.path().join("run.html");
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    wait_until(LIMIT, "ranks 0 and 1 to wait for rank 2", || {
        c.record(0)
            .is_some_and(|r| r["phase"] == "training" && r["waiting_for"] == serde_json::json!([2]))
    });
    // A second of waiting while rank 2 is alive, then rank 2 dies.
    lasted_a_second(&c, &[0, 1], "training");
    nodes[2].signal(libc::SIGKILL);
    let codes = wait_all(&mut nodes);
    fs::write(c.dir.path().join("release-2"), "").unwrap();
    assert_ne!(codes[0], 0);
    assert_ne!(codes[1], 0);

    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let ls = lanes(&doc);
    assert_eq!(
        states(&ls),
        ["stopped by a peer", "stopped by a peer", "dead"]
    );

    // Where rank 2's last block ends: its last sign of life.
    let end_of =
        |n: &roxmltree::Node| num(n.attribute("x").unwrap()) + num(n.attribute("width").unwrap());
    let dead_last = in_lane(&ls[2], "block").pop().unwrap();
    assert_eq!(dead_last.attribute("data-phase"), Some("training"));
    let dead_at = end_of(&dead_last);
    for l in &ls[..2] {
        let waits: Vec<_> = in_lane(l, "wait")
            .into_iter()
            .filter(|w| class_has(w, "open"))
            .collect();
        assert_eq!(waits.len(), 1, "{}", l.attribute("data-lane").unwrap());
        let w = &waits[0];
        assert_eq!(w.attribute("fill"), Some("url(#hatch)"));
        assert_eq!(w.attribute("data-waited-for"), Some("2"));
        assert_eq!(w.attribute("data-dead"), Some("2"));
        let t = title(w);
        assert!(
            t.contains("waiting for rank(s) 2") && t.contains("rank 2 is dead"),
            "{t}"
        );
        // It begins before rank 2's death and goes on after it, over the training block.
        let x0 = num(w.attribute("x").unwrap());
        assert!(
            x0 < dead_at && end_of(w) > dead_at + 20.0,
            "{x0} {} {dead_at}\n{t}\n{}",
            end_of(w),
            title(&dead_last)
        );
        let training = in_lane(l, "block")
            .into_iter()
            .rfind(|b| b.attribute("data-phase") == Some("training"))
            .unwrap();
        assert!(title(&training).contains("train command: exit code 0"));
        assert!(num(training.attribute("x").unwrap()) <= x0);
    }
    // The failure: a line on rank 2's lane, its message in a row below the lanes.
    assert_eq!(in_lane(&ls[2], "failure").len(), 1);
    let rows: Vec<_> = doc
        .descendants()
        .filter(|n| class_has(n, "failure-text"))
        .collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].attribute("data-rank"), Some("2"));
    assert!(!rows[0].ancestors().any(|a| class_has(&a, "lane")));
    let shown = rows[0]
        .descendants()
        .find(|n| n.has_tag_name("text"))
        .unwrap();
    assert!(
        shown.text().unwrap().contains("is dead"),
        "{:?}",
        shown.text()
    );

    let body = in_browser(&out, 1280);
    assert!(
        body.contains(r#"data-timeline="ok""#) && !body.contains("data-error"),
        "{body}"
    );
    let inner = num(&attr(&body, "data-inner-width"));
    assert_eq!(inner, 1280.0, "{body}");
    assert!(num(&attr(&body, "data-scroll-width")) <= inner, "{body}");
    assert!(num(&attr(&body, "data-max-right")) <= inner, "{body}");
    assert!(num(&attr(&body, "data-min-left")) >= 0.0, "{body}");
    assert_eq!(attr(&body, "data-clipped"), "[]", "{body}");
    let px: Vec<f64> = attr(&body, "data-wait-px").split(' ').map(num).collect();
    assert!(
        px[0] > 5.0 && px[1] > px[0] * 1.5,
        "the wheel did not zoom: {px:?}"
    );
    let label: Vec<f64> = attr(&body, "data-label-px").split(' ').map(num).collect();
    assert!(
        (label[0] - label[1]).abs() < 0.5,
        "the labels zoomed too: {label:?}"
    );
}

/// Rank 1's rollout command fails: its lane is labelled `culprit`, rank 0's (stopped
/// because of it) `stopped by a peer`.
#[test]
fn the_culprit_and_the_rank_it_stopped_are_labelled_apart() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = '''if [ {rank} = 1 ]; then exit 3; fi; sleep 0.2; printf '{\"reward\": 1}\\n' > {output}'''\n",
    );
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    let codes = wait_all(&mut nodes);
    assert_eq!(codes[1], 1, "{}", nodes[1].stderr());
    assert_ne!(codes[0], 0);
    let out = c.dir.path().join("run.html");
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    assert_eq!(states(&lanes(&doc)), ["stopped by a peer", "culprit"]);
}

/// Each lane's state as its label shows it (`rank 0 · host · state`).
fn states(lanes: &[roxmltree::Node]) -> Vec<String> {
    lanes
        .iter()
        .map(|l| {
            let label = l.descendants().find_map(|n| n.text()).unwrap();
            label.rsplit(" · ").next().unwrap().to_string()
        })
        .collect()
}

/// Elastic mode: rank 0 is killed mid-rollout; ranks 1 and 2 regroup into generation 2
/// without it; then every node is started again and generation 3 takes it back. The page
/// marks both membership changes (who was dropped and why, who is back); rank 0's lane
/// ends at the regroup (no block of generation 2) and resumes at generation 3; the trace
/// says the same; in Chromium the page runs and nothing is cut off.
#[test]
fn an_elastic_run_marks_its_membership_changes_and_the_dropped_lane_ends_and_resumes() {
    let c = common::elastic::dropped_then_back(0, "600.8", |_| {});
    let out = c.dir.path().join("run.html");
    let page = draw(&c.log_path, &out, &[]);
    let text = svg(&page);
    let doc = roxmltree::Document::parse(&text).unwrap();
    let line_x = |n: &roxmltree::Node, class: &str| -> f64 {
        let line = n
            .descendants()
            .find(|l| l.has_tag_name("line") && (class.is_empty() || class_has(l, class)))
            .unwrap_or_else(|| panic!("no line {class:?} in {}", title(n)));
        num(line.attribute("x1").unwrap())
    };
    let gens: Vec<roxmltree::Node> = doc.descendants().filter(|n| class_has(n, "gen")).collect();
    let by_gen = |g: &str| {
        *gens
            .iter()
            .find(|n| n.attribute("data-gen") == Some(g))
            .unwrap_or_else(|| panic!("no generation {g}"))
    };
    assert_eq!(gens.len(), 3, "generations 1, 2 and 3");
    assert!(!class_has(&by_gen("1"), "membership"));
    let dropped = by_gen("2");
    assert!(class_has(&dropped, "membership"), "{}", title(&dropped));
    assert_eq!(dropped.attribute("data-dropped"), Some("0"));
    assert_eq!(dropped.attribute("data-members"), Some("1,2"));
    let tip = title(&dropped);
    assert!(
        tip.contains("rank 0 dropped: heartbeat still for")
            && tip.contains("coordinator: rank 1")
            && tip.contains("formed by the members left"),
        "{tip}"
    );
    let shown = dropped
        .descendants()
        .find_map(|n| n.text())
        .unwrap_or_default();
    assert!(
        dropped
            .descendants()
            .any(|n| n.text() == Some("generation 2: rank 0 dropped")),
        "{shown}"
    );
    let back = by_gen("3");
    assert!(class_has(&back, "membership"), "{}", title(&back));
    assert_eq!(back.attribute("data-rejoined"), Some("0"));
    assert!(back
        .descendants()
        .any(|n| n.text() == Some("generation 3: rank 0 back")));

    // Rank 0's lane: its stretch without membership, from the regroup to generation 3.
    let ls = lanes(&doc);
    assert_eq!(ls.len(), 3);
    let absent = in_lane(&ls[0], "absent");
    assert_eq!(absent.len(), 1, "{}", title(&ls[0]));
    assert_eq!(absent[0].attribute("data-from-gen"), Some("2"));
    assert_eq!(absent[0].attribute("data-back-gen"), Some("3"));
    let (end, resume) = (
        line_x(&absent[0], "lane-end"),
        line_x(&absent[0], "lane-resume"),
    );
    assert!((end - line_x(&dropped, "")).abs() < 0.2, "{end}");
    assert!((resume - line_x(&back, "")).abs() < 0.2, "{resume}");
    assert!(
        title(&absent[0]).contains("dropped: heartbeat still for"),
        "{}",
        title(&absent[0])
    );
    let blocks = |l: &roxmltree::Node, gen: &str| -> Vec<(f64, f64)> {
        in_lane(l, "block")
            .iter()
            .filter(|b| b.attribute("data-gen") == Some(gen))
            .map(|b| {
                let x = num(b.attribute("x").unwrap());
                (x, x + num(b.attribute("width").unwrap()))
            })
            .collect()
    };
    assert!(
        blocks(&ls[0], "2").is_empty(),
        "rank 0 had no part in generation 2"
    );
    assert!(blocks(&ls[0], "1").iter().all(|b| b.1 <= end + 0.2));
    let gen3 = blocks(&ls[0], "3");
    assert!(!gen3.is_empty() && gen3.iter().all(|b| b.0 >= resume - 0.2));
    for l in &ls[1..] {
        assert!(in_lane(l, "absent").is_empty());
        assert!(!blocks(l, "2").is_empty());
    }
    for (r, l) in ls.iter().enumerate() {
        assert_eq!(
            phase_blocks(l),
            phase_events(&c.log_path, None, r as u32),
            "rank {r}"
        );
    }
    assert!(
        page.contains(
            "membership changes: generation 2: rank 0 dropped, generation 3: rank 0 back"
        ),
        "{}",
        &page[page.find("<p>").unwrap()..][..400]
    );

    // The trace: the generation starts carry the membership, rank 0's phase track its
    // stretch without membership.
    let trace = trace_of(&c.log_path);
    let membership = |g: u64| {
        trace
            .iter()
            .find(|e| e["cat"] == "generation" && e["args"]["generation"] == g)
            .unwrap_or_else(|| panic!("no generation {g} in the trace"))["args"]["membership"]
            .clone()
    };
    assert_eq!(membership(1), serde_json::Value::Null);
    assert_eq!(membership(2)["dropped"][0]["rank"], 0);
    assert_eq!(membership(2)["members"], serde_json::json!([1, 2]));
    assert_eq!(membership(3)["rejoined"], serde_json::json!([0]));
    let absent: Vec<&serde_json::Value> = trace
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "membership")
        .collect();
    assert_eq!(absent.len(), 1, "{absent:?}");
    assert_eq!(absent[0]["tid"], 1, "rank 0's phase track");
    assert_eq!(
        (
            &absent[0]["args"]["dropped_from"],
            &absent[0]["args"]["back_in"]
        ),
        (&2.into(), &3.into())
    );

    let body = in_browser(&out, 1280);
    assert!(
        body.contains(r#"data-timeline="ok""#) && !body.contains("data-error"),
        "{body}"
    );
    assert_eq!(attr(&body, "data-clipped"), "[]", "{body}");
    assert!(num(&attr(&body, "data-scroll-width")) <= 1280.0, "{body}");
}
