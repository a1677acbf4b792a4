//! `rl-node aggregate`: partial recovery of an iteration's rollout shards, through the real
//! binary. Committed shards are `rollouts/iter-NNNN/<split>/rank-R.jsonl`, unfinished ones
//! `rank-R.partial.jsonl`; the merge goes to `rollouts/iter-NNNN/<split>.salvaged.jsonl`
//! with a manifest `<that>.manifest.json` beside it, never over the run's merged file
//! (`<split>.jsonl`) nor any existing file unless asked, and never into a live run.

mod common;

use common::cluster::{descendants, wait_until, NodeProc, TestCluster};
use proptest::prelude::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_rl-node");

struct Run {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Run {
    /// A shared directory whose `.rl-node/cluster.json` says `num_nodes` (if any).
    fn new(num_nodes: Option<u32>) -> Run {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("shared");
        fs::create_dir_all(root.join("rollouts/iter-0001/train")).unwrap();
        if let Some(n) = num_nodes {
            fs::create_dir_all(root.join(".rl-node")).unwrap();
            // Only num_nodes matters to the merge; the rest of rank 0's record is ignored.
            let rec = serde_json::json!({"proto": 1, "gen": 4, "num_nodes": n, "run_id": "x"});
            fs::write(root.join(".rl-node/cluster.json"), rec.to_string()).unwrap();
        }
        Run { _tmp: tmp, root }
    }

    fn split_dir(&self) -> PathBuf {
        self.root.join("rollouts/iter-0001/train")
    }

    fn committed(&self, rank: u32, text: impl AsRef<[u8]>) -> &Self {
        fs::write(self.split_dir().join(format!("rank-{rank}.jsonl")), text).unwrap();
        self
    }

    fn partial(&self, rank: u32, text: impl AsRef<[u8]>) -> &Self {
        fs::write(
            self.split_dir().join(format!("rank-{rank}.partial.jsonl")),
            text,
        )
        .unwrap();
        self
    }

    /// Where `rl-node aggregate` writes by default.
    fn out(&self) -> PathBuf {
        self.root.join("rollouts/iter-0001/train.salvaged.jsonl")
    }

    fn manifest_path(&self) -> PathBuf {
        self.root
            .join("rollouts/iter-0001/train.salvaged.jsonl.manifest.json")
    }

    /// The run's own merged file (what phase 3 commits).
    fn merged(&self) -> PathBuf {
        self.root.join("rollouts/iter-0001/train.jsonl")
    }

    fn manifest(&self) -> Value {
        serde_json::from_slice(&fs::read(self.manifest_path()).unwrap()).unwrap()
    }

    /// `rl-node aggregate --log-path ROOT --iteration 1 --split train EXTRA…`
    fn aggregate(&self, extra: &[&str]) -> Output {
        let mut c = Command::new(BIN);
        c.arg("aggregate")
            .arg("--log-path")
            .arg(&self.root)
            .args(["--iteration", "1", "--split", "train"])
            .args(extra)
            .env_remove("RL_NODE_CLUSTER_LOG_PATH");
        c.output().unwrap()
    }

    /// Every name under `rollouts/iter-0001` (relative), temporary files included.
    fn files(&self) -> BTreeSet<String> {
        let base = self.root.join("rollouts/iter-0001");
        let mut out = BTreeSet::new();
        let mut stack = vec![base.clone()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                out.insert(p.strip_prefix(&base).unwrap().display().to_string());
                if p.is_dir() {
                    stack.push(p);
                }
            }
        }
        out
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A rank's `digest` in the manifest: XXH3-128 as the xxHash tools print it.
fn digest(bytes: &[u8]) -> String {
    format!("xxh3-128:{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------------------- tests

#[test]
fn complete_ranks_merge_in_rank_order_with_a_manifest_and_are_byte_identical_when_rerun() {
    let r = Run::new(Some(3));
    // Blank lines are skipped; a valid last record without a newline gets one.
    r.committed(2, "{\"r\":2,\"i\":0}\n")
        .committed(0, "{\"r\":0,\"i\":0}\n\n{\"r\":0,\"i\":1}\n")
        .committed(1, "  \n{\"r\":1,\"i\":0, \"s\": \"h\u{e9}\"}");
    let o = r.aggregate(&["--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));

    let parts = [
        "{\"r\":0,\"i\":0}\n{\"r\":0,\"i\":1}\n".to_string(),
        "{\"r\":1,\"i\":0, \"s\": \"h\u{e9}\"}\n".to_string(),
        "{\"r\":2,\"i\":0}\n".to_string(),
    ];
    let merged = fs::read(r.out()).unwrap();
    assert_eq!(merged, parts.concat().as_bytes());

    let m = r.manifest();
    assert_eq!(m["format"], "rl-node-aggregate/2");
    assert_eq!(m["iteration"], 1);
    assert_eq!(m["split"], "train");
    assert_eq!(m["output"], "train.salvaged.jsonl");
    assert_eq!(m["num_ranks"], 3);
    assert_eq!(m["complete"], true);
    assert_eq!(m["records"], 4);
    assert_eq!(m["bytes"], merged.len() as u64);
    assert_eq!(m["torn_records"], 0);
    assert_eq!(m["missing_ranks"], serde_json::json!([]));
    let mut offset = 0;
    for (rank, part) in parts.iter().enumerate() {
        let e = &m["ranks"][rank];
        assert_eq!(e["rank"], rank);
        assert_eq!(e["status"], "complete");
        assert_eq!(
            e["source"],
            format!("rollouts/iter-0001/train/rank-{rank}.jsonl")
        );
        assert_eq!(e["records"], if rank == 0 { 2 } else { 1 });
        assert_eq!(e["bytes"], part.len());
        assert_eq!(e["offset"], offset);
        assert_eq!(e["digest"], digest(part.as_bytes()));
        assert_eq!(e["dropped"], serde_json::json!([]));
        offset += part.len();
    }
    // --json prints the manifest that was written.
    let printed: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(printed, m);
    // The human summary has a line per rank.
    let err = stderr(&o);
    for rank in 0..3 {
        assert!(err.contains(&format!("rank {rank}")), "{err}");
    }
    assert_eq!(
        r.files(),
        set(&[
            "train",
            "train.salvaged.jsonl",
            "train.salvaged.jsonl.manifest.json",
            "train/rank-0.jsonl",
            "train/rank-1.jsonl",
            "train/rank-2.jsonl"
        ])
    );

    // Again, replacing the first salvage: byte-identical output and manifest.
    let manifest_bytes = fs::read(r.manifest_path()).unwrap();
    let o = r.aggregate(&["--overwrite"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(fs::read(r.out()).unwrap(), merged);
    assert_eq!(fs::read(r.manifest_path()).unwrap(), manifest_bytes);

    // The shared directory mounted elsewhere gives the same manifest (paths are relative).
    let moved = tempfile::tempdir().unwrap();
    let other = moved.path().join("elsewhere");
    assert!(Command::new("cp")
        .arg("-a")
        .arg(&r.root)
        .arg(&other)
        .status()
        .unwrap()
        .success());
    fs::remove_file(other.join("rollouts/iter-0001/train.salvaged.jsonl")).unwrap();
    let o = Command::new(BIN)
        .args(["aggregate", "--iteration", "1", "--split", "train"])
        .env("RL_NODE_CLUSTER_LOG_PATH", &other) // the flag's environment form
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        fs::read(other.join("rollouts/iter-0001/train.salvaged.jsonl.manifest.json")).unwrap(),
        manifest_bytes
    );
}

#[test]
fn a_partial_rank_with_a_torn_record_is_refused_unless_allow_missing() {
    let r = Run::new(Some(3));
    r.committed(0, "{\"r\":0}\n")
        .partial(
            1,
            "{\"r\":1,\"i\":0}\n\n{\"r\":1,\"i\":1}\n{\"r\":1,\"i\":2,\"tok",
        )
        .committed(2, "{\"r\":2}\n");
    let before = r.files();

    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rank 1 has only a partial shard"), "{err}");
    assert!(err.contains("rank-1.partial.jsonl"), "{err}");
    assert!(err.contains("nothing was published"), "{err}");
    assert_eq!(
        r.files(),
        before,
        "nothing published, no temporary file left"
    );

    let o = r.aggregate(&["--allow-missing", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        fs::read_to_string(r.out()).unwrap(),
        "{\"r\":0}\n{\"r\":1,\"i\":0}\n{\"r\":1,\"i\":1}\n{\"r\":2}\n"
    );
    let err = stderr(&o);
    assert!(
        err.contains(
            "rollouts/iter-0001/train/rank-1.partial.jsonl:4: torn last record dropped (17 bytes"
        ),
        "{err}"
    );
    let m = r.manifest();
    assert_eq!(m["complete"], false);
    assert_eq!(m["partial_ranks"], serde_json::json!([1]));
    assert_eq!(m["torn_records"], 1);
    assert_eq!(m["dropped_bytes"], 17);
    let e = &m["ranks"][1];
    assert_eq!(e["status"], "partial");
    assert_eq!(e["source"], "rollouts/iter-0001/train/rank-1.partial.jsonl");
    assert_eq!(e["records"], 2);
    assert_eq!(e["dropped"][0]["kind"], "torn");
    assert_eq!(e["dropped"][0]["line"], 4);
    assert_eq!(e["dropped"][0]["bytes"], 17);
    assert_eq!(
        e["digest"],
        digest(b"{\"r\":1,\"i\":0}\n{\"r\":1,\"i\":1}\n")
    );
    assert_eq!(serde_json::from_slice::<Value>(&o.stdout).unwrap(), m);
}

#[test]
fn a_missing_rank_is_named_and_recorded_as_missing_with_allow_missing() {
    let r = Run::new(Some(3));
    r.committed(0, "{\"r\":0}\n").committed(1, "{\"r\":1}\n");
    // An earlier attempt set aside is reported, never merged.
    fs::write(
        r.split_dir().join("rank-2.partial.jsonl.stale-gen3"),
        "{\"old\":true}\n",
    )
    .unwrap();
    let o = r.aggregate(&["--json"]);
    assert_eq!(code(&o), 1);
    let err = stderr(&o);
    assert!(err.contains("rank 2 has no shard"), "{err}");
    assert!(err.contains("rank-2.jsonl does not exist"), "{err}");
    assert!(!r.out().exists() && !r.manifest_path().exists());
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["kind"], "incomplete");
    assert_eq!(j["published"], false);
    assert_eq!(j["missing_ranks"], serde_json::json!([2]));

    let o = r.aggregate(&["--allow-missing"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        fs::read_to_string(r.out()).unwrap(),
        "{\"r\":0}\n{\"r\":1}\n"
    );
    let m = r.manifest();
    assert_eq!(m["missing_ranks"], serde_json::json!([2]));
    let e = &m["ranks"][2];
    assert_eq!(e["status"], "missing");
    assert_eq!(e["source"], Value::Null);
    assert_eq!(e["records"], 0);
    assert_eq!(
        e["set_aside"],
        serde_json::json!(["rollouts/iter-0001/train/rank-2.partial.jsonl.stale-gen3"])
    );
    assert!(stderr(&o).contains("rank 2: missing"), "{}", stderr(&o));
}

#[test]
fn invalid_json_mid_file_fails_a_committed_shard_and_ends_a_partial_one() {
    let r = Run::new(Some(3));
    r.committed(0, "{\"r\":0}\n")
        .committed(1, "{\"r\":1}\n{\"r\":1 oops}\n{\"r\":1,\"i\":2}\n")
        .committed(2, "{\"r\":2}\n");
    // An earlier salvage, which only --overwrite may replace: a failed merge keeps it.
    fs::write(r.out(), "previous merge\n").unwrap();
    let before = r.files();
    // The bad line has its braces: only the full JSON check refuses it.
    for extra in [
        &["--overwrite", "--validate", "json"][..],
        &["--allow-missing", "--overwrite", "--validate", "json"][..],
    ] {
        let o = r.aggregate(extra);
        assert_eq!(code(&o), 1);
        let err = stderr(&o);
        assert!(
            err.contains("rollouts/iter-0001/train/rank-1.jsonl:2 is not valid JSON"),
            "{err}"
        );
        assert!(err.contains("nothing was published"), "{err}");
        assert_eq!(fs::read_to_string(r.out()).unwrap(), "previous merge\n");
        assert_eq!(r.files(), before);
    }

    // The same bytes in a partial file: the records before the bad line are kept.
    fs::rename(
        r.split_dir().join("rank-1.jsonl"),
        r.split_dir().join("rank-1.partial.jsonl"),
    )
    .unwrap();
    let o = r.aggregate(&["--allow-missing", "--overwrite", "--validate", "json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        fs::read_to_string(r.out()).unwrap(),
        "{\"r\":0}\n{\"r\":1}\n{\"r\":2}\n"
    );
    let err = stderr(&o);
    assert!(
        err.contains("rollouts/iter-0001/train/rank-1.partial.jsonl:2: not valid JSON"),
        "{err}"
    );
    let e = &r.manifest()["ranks"][1];
    assert_eq!(e["dropped"][0]["kind"], "invalid");
    assert_eq!(e["dropped"][0]["line"], 2);
    assert_eq!(e["dropped"][0]["bytes"], 27);
}

#[test]
fn usage_errors_exit_2_and_write_nothing() {
    let r = Run::new(None);
    r.committed(0, "{}\n");
    let before = r.files();
    // No cluster.json and no --num-ranks.
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("--num-ranks"), "{}", stderr(&o));
    // Unknown split, bad iteration, no log path.
    let run = |args: &[&str]| {
        Command::new(BIN)
            .arg("aggregate")
            .args(args)
            .env_remove("RL_NODE_CLUSTER_LOG_PATH")
            .output()
            .unwrap()
    };
    let root = r.root.to_str().unwrap();
    for args in [
        &["--log-path", root, "--iteration", "1", "--split", "test"][..],
        &["--log-path", root, "--iteration", "0", "--split", "train"],
        &["--log-path", root, "--iteration", "x", "--split", "train"],
        &["--iteration", "1", "--split", "train", "--num-ranks", "1"],
        &[
            "--log-path",
            "/nonexistent/dir",
            "--iteration",
            "1",
            "--split",
            "train",
            "--num-ranks",
            "1",
        ],
    ] {
        let o = run(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
    }
    assert_eq!(r.files(), before);

    // --num-ranks stands in for cluster.json.
    let o = r.aggregate(&["--num-ranks", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(fs::read_to_string(r.out()).unwrap(), "{}\n");
}

#[test]
fn the_validation_level_comes_from_the_flag_or_the_config_and_a_bad_one_is_named() {
    let r = Run::new(Some(1));
    // Its braces are in place but it is not JSON: only the full parse refuses it.
    let shard = "{\"r\":0}\n{\"r\":1 oops}\n";
    r.committed(0, shard);
    let cfg = r.root.parent().unwrap().join("rl-node.toml");
    fs::write(&cfg, "[aggregate]\nvalidate = \"strict\"\n").unwrap();
    let cfg = cfg.to_str().unwrap();
    let before = r.files();
    for (args, named) in [
        (&["--validate", "strict"][..], "--validate"),
        (&["--config", cfg][..], "aggregate.validate"),
    ] {
        let o = r.aggregate(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(named), "{args:?}: {}", stderr(&o));
        assert_eq!(r.files(), before);
    }

    // The default (utf8) takes the line, as documented.
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(fs::read_to_string(r.out()).unwrap(), shard);

    // json from the configuration refuses the committed shard; the flag overrides it.
    fs::write(cfg, "[aggregate]\nvalidate = \"json\"\n").unwrap();
    let o = r.aggregate(&["--config", cfg, "--overwrite"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("rank-0.jsonl:2 is not valid JSON"),
        "{}",
        stderr(&o)
    );
    assert_eq!(fs::read_to_string(r.out()).unwrap(), shard);
    let o = r.aggregate(&["--config", cfg, "--overwrite", "--validate", "utf8"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn out_puts_the_merge_and_its_manifest_elsewhere() {
    let r = Run::new(Some(1));
    r.committed(0, "[1]\n[2]\n");
    let dest = r.root.join("recovered/iter1.jsonl");
    let o = r.aggregate(&["--out", dest.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(fs::read_to_string(&dest).unwrap(), "[1]\n[2]\n");
    let m: Value = serde_json::from_slice(
        &fs::read(r.root.join("recovered/iter1.jsonl.manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(m["output"], "iter1.jsonl");
    assert_eq!(m["records"], 2);
    assert!(!r.out().exists() && !r.merged().exists());
}

// ------------------------------------------------------------------ property

#[derive(Debug, Clone)]
enum Kind {
    Committed,
    Partial,
    Missing,
}

#[derive(Debug, Clone)]
struct Shard {
    kind: Kind,
    /// Records, each followed by this many blank lines.
    records: Vec<(Value, u8)>,
    /// Drop the newline after the last record (when there is no tail).
    no_final_newline: bool,
    /// An invalid line after the records, followed by more records that must not be merged.
    garbage: Option<(String, Vec<Value>)>,
    /// A torn last record: this many bytes of a record, no newline.
    torn: Option<(Value, usize)>,
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "\\PC{0,10}".prop_map(Value::String),
    ];
    let inner = leaf.prop_recursive(2, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,3}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    // Records are objects (as trajectories are), so every cut of one is torn.
    prop::collection::btree_map("[a-z\u{e9}\"]{1,4}", inner, 1..4)
        .prop_map(|m| Value::Object(m.into_iter().collect()))
}

fn shard() -> impl Strategy<Value = Shard> {
    (
        prop_oneof![
            Just(Kind::Committed),
            Just(Kind::Partial),
            Just(Kind::Missing)
        ],
        prop::collection::vec((value(), 0u8..2), 0..5),
        any::<bool>(),
        prop::option::weighted(
            0.3,
            (
                prop_oneof![
                    Just("not json".to_string()),
                    Just("{\"a\":".to_string()),
                    Just("\u{0}\u{0}\u{0}".to_string()),
                    Just("[1,2]]".to_string()),
                    Just("{\"a\":1} {\"b\":2}".to_string()),
                ],
                prop::collection::vec(value(), 0..3),
            ),
        ),
        prop::option::weighted(0.3, (value(), any::<prop::sample::Index>())),
    )
        .prop_map(|(kind, records, no_final_newline, garbage, torn)| Shard {
            kind,
            records,
            no_final_newline,
            garbage,
            torn: torn.map(|(v, i)| {
                let len = serde_json::to_string(&v).unwrap().len();
                (v, 1 + i.index(len - 1))
            }),
        })
}

impl Shard {
    fn bytes(&self) -> Vec<u8> {
        let mut s = String::new();
        for (i, (v, blanks)) in self.records.iter().enumerate() {
            s += &serde_json::to_string(v).unwrap();
            let last = i + 1 == self.records.len();
            if !(last && self.no_final_newline && self.garbage.is_none() && self.torn.is_none()) {
                s.push('\n');
            }
            for _ in 0..*blanks {
                s.push('\n');
            }
        }
        if let Some((g, after)) = &self.garbage {
            s += g;
            s.push('\n');
            for v in after {
                s += &serde_json::to_string(v).unwrap();
                s.push('\n');
            }
        }
        if let Some((v, cut)) = &self.torn {
            s += &serde_json::to_string(v).unwrap()[..]
                .char_indices()
                .take_while(|(i, _)| i < cut)
                .map(|(_, c)| c)
                .collect::<String>();
        }
        s.into_bytes()
    }

    /// Whether the merge at `level` refuses this shard's garbage line (as documented:
    /// json parses it; utf8 refuses invalid UTF-8, NUL and a line whose brackets do not
    /// close, and parses a line that starts with neither; none takes every line).
    fn refused(&self, level: &str) -> bool {
        let Some((g, _)) = &self.garbage else {
            return false;
        };
        match level {
            "json" => true,
            "utf8" => !matches!(g.as_str(), "[1,2]]" | "{\"a\":1} {\"b\":2}"),
            _ => false,
        }
    }

    /// What the merge at `level` must take from this shard.
    fn expected(&self, level: &str) -> String {
        if matches!(self.kind, Kind::Missing) {
            return String::new();
        }
        let mut lines: Vec<String> = self
            .records
            .iter()
            .map(|(v, _)| serde_json::to_string(v).unwrap())
            .collect();
        if let Some((g, after)) = self.garbage.as_ref().filter(|_| !self.refused(level)) {
            lines.push(g.clone());
            lines.extend(after.iter().map(|v| serde_json::to_string(v).unwrap()));
        }
        lines.into_iter().map(|l| l + "\n").collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// For random shards, the merged file is each rank's valid records in rank order, or,
    /// when a committed shard is corrupt, the merge fails and publishes nothing.
    #[test]
    fn merged_output_is_every_ranks_valid_records_in_order(
        shards in prop::collection::vec(shard(), 1..5),
        level in prop_oneof![Just("json"), Just("utf8"), Just("none")],
    ) {
        let r = Run::new(Some(shards.len() as u32));
        for (rank, s) in shards.iter().enumerate() {
            match s.kind {
                Kind::Committed => { r.committed(rank as u32, s.bytes()); }
                Kind::Partial => { r.partial(rank as u32, s.bytes()); }
                Kind::Missing => {}
            }
        }
        let o = r.aggregate(&["--allow-missing", "--json", "--validate", level]);
        let corrupt = shards.iter().position(|s| matches!(s.kind, Kind::Committed) && s.refused(level));
        if let Some(rank) = corrupt {
            prop_assert_eq!(code(&o), 1, "{}", stderr(&o));
            prop_assert!(stderr(&o).contains(&format!("rank {rank}'s committed shard")), "{}", stderr(&o));
            prop_assert!(!r.out().exists());
            prop_assert!(!r.manifest_path().exists());
        } else {
            prop_assert_eq!(code(&o), 0, "{}", stderr(&o));
            let expected: String = shards.iter().map(|s| s.expected(level)).collect();
            prop_assert_eq!(fs::read_to_string(r.out()).unwrap(), expected);
            let m = r.manifest();
            for (rank, s) in shards.iter().enumerate() {
                let e = &m["ranks"][rank];
                let want = match s.kind {
                    Kind::Committed => "complete",
                    Kind::Partial => "partial",
                    Kind::Missing => "missing",
                };
                prop_assert_eq!(&e["status"], want);
                prop_assert_eq!(&e["records"], &Value::from(s.expected(level).lines().count()));
                // Reading a partial file stops at its garbage line, before any torn tail.
                let torn = !matches!(s.kind, Kind::Missing) && s.torn.is_some() && !s.refused(level);
                prop_assert_eq!(m["ranks"][rank]["dropped"].as_array().unwrap().iter()
                    .filter(|d| d["kind"] == "torn").count(), usize::from(torn));
                if !matches!(s.kind, Kind::Missing) {
                    prop_assert_eq!(&e["digest"], &Value::from(digest(s.expected(level).as_bytes())));
                }
            }
        }
    }
}

#[test]
fn the_node_publishes_a_manifest_beside_its_merge() {
    // Exercised through the library call phase 3 uses (allow_missing off).
    let r = Run::new(None);
    r.committed(0, "{\"a\":1}\n").committed(1, "{\"b\":2}\n");
    let layout = rl_node::layout::Layout::new(&r.root);
    let opts = rl_node::aggregate::MergeOptions::default();
    let m = rl_node::aggregate::merge(
        &rl_node::store::Fs,
        &layout,
        1,
        "train",
        2,
        &opts,
        &mut || {},
    )
    .unwrap();
    assert_eq!(m.records, 2);
    assert!(r.merged().exists());
    assert!(r
        .root
        .join("rollouts/iter-0001/train.jsonl.manifest.json")
        .exists());
    let e = rl_node::aggregate::merge(
        &rl_node::store::Fs,
        &layout,
        1,
        "train",
        3,
        &opts,
        &mut || {},
    )
    .unwrap_err();
    assert!(
        matches!(&e, rl_node::aggregate::AggregateError::Incomplete { missing, .. } if missing == &[2]),
        "{e}"
    );
}

// ------------------------------------------------------------------ a real run's files

/// `rl-node aggregate --log-path <c.log_path> --iteration 1 --split train EXTRA…`
fn aggregate_run(c: &TestCluster, extra: &[&str]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("aggregate")
        .arg("--log-path")
        .arg(&c.log_path)
        .args(["--iteration", "1", "--split", "train"])
        .args(extra);
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_") {
            cmd.env_remove(k);
        }
    }
    cmd.output().unwrap()
}

/// Every file under `dir` (relative) with its bytes.
fn snapshot(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, fs::read(&p).unwrap());
            }
        }
    }
    out
}

const LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

#[test]
fn a_committed_journaled_merge_is_never_touched_and_the_salvage_lands_beside_it() {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"echo '{\\\"rank\\\": {rank}}' > {output}\"\n",
    );
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    let it = c.log_path.join("rollouts/iter-0001");
    let merged = it.join("train.jsonl");
    let journal = fs::read_to_string(c.log_path.join(".rl-node/journal/rank-0.jsonl")).unwrap();
    assert!(journal.contains("\"aggregate-train\""), "{journal}");
    let committed = fs::read(&merged).unwrap();
    let committed_manifest = fs::read(it.join("train.jsonl.manifest.json")).unwrap();
    let untouched = |context: &str| {
        assert_eq!(fs::read(&merged).unwrap(), committed, "{context}");
        assert_eq!(
            fs::read(it.join("train.jsonl.manifest.json")).unwrap(),
            committed_manifest,
            "{context}"
        );
    };

    // By default the salvage goes beside the merged file.
    let o = aggregate_run(&c, &[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let salvaged = it.join("train.salvaged.jsonl");
    assert_eq!(fs::read(&salvaged).unwrap(), committed);
    assert!(it.join("train.salvaged.jsonl.manifest.json").exists());
    assert!(
        stderr(&o).contains(&salvaged.display().to_string()),
        "{}",
        stderr(&o)
    );
    untouched("rl-node aggregate");

    // A rank's shard goes missing: --allow-missing merges the rest, into the salvage only.
    fs::rename(
        it.join("train/rank-1.jsonl"),
        c.dir.path().join("rank-1.jsonl"),
    )
    .unwrap();
    let o = aggregate_run(&c, &["--allow-missing"]);
    assert_eq!(
        code(&o),
        2,
        "the earlier salvage is not replaced: {}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    let o = aggregate_run(&c, &["--allow-missing", "--overwrite"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(fs::read_to_string(&salvaged).unwrap(), "{\"rank\": 0}\n");
    untouched("rl-node aggregate --allow-missing");

    // Asking for the run's merged file by any name is refused, nothing written.
    let merged_arg = merged.display().to_string();
    let dotted = it.join("train/../train.jsonl").display().to_string();
    for args in [
        &["--commit", "--allow-missing"][..],
        &["--out", &merged_arg, "--allow-missing"],
        &["--out", &merged_arg, "--overwrite", "--allow-missing"],
        &["--out", &dotted, "--overwrite", "--allow-missing"],
    ] {
        let before = snapshot(&c.log_path);
        let o = aggregate_run(&c, args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("train.jsonl"),
            "{args:?}: {}",
            stderr(&o)
        );
        assert_eq!(snapshot(&c.log_path), before, "{args:?} wrote something");
    }
    // Even when the merged file is gone, rank 0's journal says it was made (and trained
    // on): --commit does not make another one.
    fs::rename(&merged, c.dir.path().join("train.jsonl")).unwrap();
    let o = aggregate_run(&c, &["--commit", "--allow-missing"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("journaled") && stderr(&o).contains("rank-0.jsonl"),
        "{}",
        stderr(&o)
    );
    assert!(!merged.exists());
    // A journal larger than rl-node reads (grown to 300 MiB, sparse) cannot tell: refused,
    // naming it, without reading it.
    let journal = c.log_path.join(".rl-node/journal/rank-0.jsonl");
    common::set_file_len(&journal, 300 << 20);
    let o = aggregate_run(&c, &["--commit", "--allow-missing"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot be told")
            && stderr(&o).contains(&format!("{} is larger than 256 MiB", journal.display())),
        "{}",
        stderr(&o)
    );
    assert!(!merged.exists());
}

/// Two nodes whose rank 1 rolls out until `<shared>/go` exists, having written one record
/// to its partial file; rank 0 has committed its shard.
fn a_run_mid_rollout() -> (TestCluster, Vec<NodeProc>) {
    let c = TestCluster::new(
        2,
        "[phases.rollout]\ncommand = \"echo '{\\\"rank\\\": {rank}}' > {output}; if [ {rank} = 1 ]; then touch {log_path}/rolling; while [ ! -e {log_path}/go ]; do sleep 0.05; done; fi\"\n",
    );
    let nodes = c.spawn_all(&["--iterations", "1"]);
    wait_until(
        LIMIT,
        "rank 1 mid-rollout, rank 0's shard committed",
        || {
            c.log_path.join("rolling").exists()
                && c.log_path
                    .join("rollouts/iter-0001/train/rank-0.jsonl")
                    .exists()
        },
    );
    (c, nodes)
}

#[test]
fn a_live_run_is_refused_naming_its_running_ranks_and_nothing_is_written() {
    let (c, mut nodes) = a_run_mid_rollout();
    let before = snapshot(&c.log_path.join("rollouts"));
    for extra in [
        &[][..],
        &["--allow-missing"],
        &["--commit", "--allow-missing"],
    ] {
        let o = aggregate_run(&c, extra);
        assert_eq!(code(&o), 2, "{extra:?}: {}", stderr(&o));
        let err = stderr(&o);
        let pids = [nodes[0].pid(), nodes[1].pid()];
        assert!(
            err.contains("is live")
                && err.contains("generation 1")
                && err.contains(&format!("rank 0 (pid {}", pids[0]))
                && err.contains(&format!("rank 1 (pid {}", pids[1]))
                && err.contains("stop every node"),
            "{extra:?}: {err}"
        );
        assert_eq!(snapshot(&c.log_path.join("rollouts")), before, "{extra:?}");
    }
    // The run itself is not disturbed.
    fs::write(c.log_path.join("go"), "").unwrap();
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
}

#[test]
fn a_dead_run_that_never_merged_is_salvaged_and_can_be_committed_once() {
    let (c, nodes) = a_run_mid_rollout();
    // Every process of both nodes dies at once (kill -9 of the hosts' jobs).
    for n in &nodes {
        let mut all = descendants(n.pid());
        all.push(n.pid());
        for p in all {
            let _ = common::kill(p, libc::SIGKILL);
        }
    }
    drop(nodes);
    let it = c.log_path.join("rollouts/iter-0001");
    let o = aggregate_run(&c, &[]);
    assert_eq!(code(&o), 1, "rank 1 is only partial: {}", stderr(&o));
    let o = aggregate_run(&c, &["--allow-missing"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let salvage = fs::read_to_string(it.join("train.salvaged.jsonl")).unwrap();
    assert_eq!(salvage, "{\"rank\": 0}\n{\"rank\": 1}\n");
    assert!(!it.join("train.jsonl").exists());
    // The iteration was never merged: --commit makes the salvage the run's merged file...
    let o = aggregate_run(&c, &["--commit", "--allow-missing"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(fs::read_to_string(it.join("train.jsonl")).unwrap(), salvage);
    let m: Value =
        serde_json::from_slice(&fs::read(it.join("train.jsonl.manifest.json")).unwrap()).unwrap();
    assert_eq!(m["partial_ranks"], serde_json::json!([1]));
    // ...once: it never replaces it.
    let o = aggregate_run(&c, &["--commit", "--allow-missing"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    assert_eq!(fs::read_to_string(it.join("train.jsonl")).unwrap(), salvage);

    // Restarted, the run redoes the merge it never journaled; the salvage is set aside,
    // not replaced.
    fs::write(c.log_path.join("go"), "").unwrap();
    let mut nodes = c.spawn_all(&["--iterations", "1"]);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    assert_eq!(
        fs::read_to_string(it.join("train.jsonl.stale-gen2")).unwrap(),
        salvage
    );
    assert!(it.join("train.jsonl.manifest.json.stale-gen2").exists());
    assert_eq!(
        fs::read_to_string(it.join("train.jsonl")).unwrap(),
        "{\"rank\": 0}\n{\"rank\": 1}\n"
    );
    let m: Value =
        serde_json::from_slice(&fs::read(it.join("train.jsonl.manifest.json")).unwrap()).unwrap();
    assert_eq!(m["complete"], true, "{m}");
}
