//! Shard formats: safetensors merges (dtypes, disagreements between ranks, truncated and
//! foreign files, partial recovery), the `command` format with the old run.sh's pickles
//! and its real Python merge script, configured names, and phase 3 of a real cluster in
//! both formats. Fixtures are made here; Python checks run only where Python (and, for
//! reading safetensors back, its `safetensors` package) is installed, and print a skip
//! note otherwise. `RL_NODE_TEST_PYTHON` picks the interpreter (default `python3`).

mod common;

use common::cluster::{wait_until, TestCluster};
use rl_node::shards::safetensors as st;
use rl_node::shards::{DType, TensorData};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_rl-node");

fn python() -> String {
    std::env::var("RL_NODE_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Whether `python -c code` runs; prints a skip note for `what` when it does not.
fn python_has(code: &str, what: &str) -> bool {
    let ok = Command::new(python())
        .args(["-c", code])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!(
            "note: skipping the Python part ({what}): `{} -c {code:?}` does not run here",
            python()
        );
    }
    ok
}

fn tensor(name: &str, dtype: DType, shape: &[usize], seed: u8) -> TensorData {
    let n = shape.iter().product::<usize>() * dtype.size();
    let data = (0..n)
        .map(|i| match dtype {
            DType::Bool => (i + seed as usize).is_multiple_of(3) as u8,
            _ => (i as u8).wrapping_mul(37).wrapping_add(seed),
        })
        .collect();
    TensorData {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// A rank's rollout tensors with `rows` trajectories of `t` steps.
fn rollout(rows: usize, t: usize, seed: u8) -> Vec<TensorData> {
    vec![
        tensor("token_ids", DType::I64, &[rows, t], seed),
        tensor("logprobs", DType::F32, &[rows, t], seed.wrapping_add(1)),
        tensor("values", DType::BF16, &[rows, t], seed.wrapping_add(2)),
        tensor("mask", DType::Bool, &[rows, t], seed),
        tensor("rewards", DType::F32, &[rows], seed.wrapping_add(3)),
    ]
}

fn st_bytes(ts: &[TensorData]) -> Vec<u8> {
    st::to_bytes(ts, &BTreeMap::new())
}

struct Run {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    config: PathBuf,
}

impl Run {
    /// A shared directory recording `num_nodes`, with `[aggregate]` settings in a config.
    fn new(num_nodes: u32, aggregate: &str) -> Run {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("shared");
        fs::create_dir_all(root.join("rollouts/iter-0001/train")).unwrap();
        fs::create_dir_all(root.join(".rl-node")).unwrap();
        fs::write(
            root.join(".rl-node/cluster.json"),
            serde_json::json!({"num_nodes": num_nodes}).to_string(),
        )
        .unwrap();
        let config = tmp.path().join("rl-node.toml");
        fs::write(&config, format!("[aggregate]\n{aggregate}\n")).unwrap();
        Run {
            _tmp: tmp,
            root,
            config,
        }
    }

    fn put(&self, rel: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let p = self.root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, bytes).unwrap();
        p
    }

    fn aggregate(&self, extra: &[&str]) -> Output {
        let mut c = Command::new(BIN);
        c.arg("aggregate")
            .arg("--config")
            .arg(&self.config)
            .arg("--log-path")
            .arg(&self.root)
            .args(["--iteration", "1", "--split", "train"])
            .args(extra);
        for (k, _) in std::env::vars() {
            if k.starts_with("RL_NODE_") {
                c.env_remove(k);
            }
        }
        c.output().unwrap()
    }

    fn manifest(&self, out: &Path) -> Value {
        let mut name = out.file_name().unwrap().to_os_string();
        name.push(".manifest.json");
        serde_json::from_slice(&fs::read(out.with_file_name(name)).unwrap()).unwrap()
    }

    /// Every file under rollouts/iter-0001 (relative), temporary files included.
    fn files(&self) -> Vec<String> {
        fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
            for e in fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(base, &p, out);
                } else {
                    out.push(p.strip_prefix(base).unwrap().display().to_string());
                }
            }
        }
        let mut v = Vec::new();
        walk(&self.root, &self.root.join("rollouts"), &mut v);
        v.sort();
        v
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn sha256(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// The merged tensors by name.
fn read_back(path: &Path) -> BTreeMap<String, TensorData> {
    st::read_all(path)
        .unwrap()
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect()
}

/// What the merge of `ranks` (in order) must hold.
fn concat(ranks: &[&Vec<TensorData>]) -> BTreeMap<String, TensorData> {
    let mut out: BTreeMap<String, TensorData> = BTreeMap::new();
    for r in ranks {
        for t in r.iter() {
            let e = out.entry(t.name.clone()).or_insert_with(|| TensorData {
                shape: {
                    let mut s = t.shape.clone();
                    s[0] = 0;
                    s
                },
                data: Vec::new(),
                ..t.clone()
            });
            e.shape[0] += t.shape[0];
            e.data.extend_from_slice(&t.data);
        }
    }
    out
}

#[test]
fn safetensors_shards_of_several_dtypes_concatenate_along_dim_0_and_read_back() {
    let r = Run::new(3, "format = \"safetensors\"");
    let shards = [rollout(4, 8, 1), rollout(1, 8, 50), rollout(3, 8, 99)];
    for (rank, ts) in shards.iter().enumerate() {
        r.put(
            &format!("rollouts/iter-0001/train/rank-{rank}.safetensors"),
            st_bytes(ts),
        );
    }
    let o = r.aggregate(&["--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("merged 5 tensors, 8 rows"),
        "{}",
        stderr(&o)
    );
    let out = r.root.join("rollouts/iter-0001/train.salvaged.safetensors");
    let got = read_back(&out);
    assert_eq!(got, concat(&[&shards[0], &shards[1], &shards[2]]));
    // The safetensors crate (what Python's package runs) accepts the file as a whole.
    let bytes = fs::read(&out).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(parsed.tensor("token_ids").unwrap().shape(), &[8, 8]);
    assert_eq!(parsed.tensor("rewards").unwrap().shape(), &[8]);

    let m = r.manifest(&out);
    let printed: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(printed, m);
    assert_eq!(m["shard_format"], "safetensors");
    assert_eq!(m["complete"], true);
    assert_eq!(m["records"], 8);
    assert_eq!(m["output_bytes"], bytes.len() as u64);
    for (rank, ts) in shards.iter().enumerate() {
        let e = &m["ranks"][rank];
        assert_eq!(e["status"], "complete");
        assert_eq!(
            e["source"],
            format!("rollouts/iter-0001/train/rank-{rank}.safetensors")
        );
        assert_eq!(e["records"], ts[0].shape[0] as u64);
        let data: usize = ts.iter().map(|t| t.data.len()).sum();
        assert_eq!(e["bytes"], data as u64);
        assert!(e["sha256"].as_str().unwrap().len() == 64);
    }
    // Per-tensor shapes and where each rank's rows are.
    let tokens = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "token_ids")
        .unwrap();
    assert_eq!(tokens["dtype"], "I64");
    assert_eq!(tokens["shape"], serde_json::json!([8, 8]));
    let rows: Vec<u64> = tokens["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["rows"].as_u64().unwrap())
        .collect();
    assert_eq!(rows, vec![4, 1, 3]);
    let [b, e] = [0, 1].map(|i| tokens["data_offsets"][i].as_u64().unwrap() as usize);
    let data_start = bytes.len() - parsed_data_len(&bytes);
    assert_eq!(
        &bytes[data_start + b..data_start + e],
        &got["token_ids"].data[..]
    );
    // The hash of a rank covers exactly the bytes taken from it, in output order.
    let order: Vec<&Value> = m["tensors"].as_array().unwrap().iter().collect();
    let mut rank1 = Vec::new();
    for t in &order {
        let p = &t["pieces"][1];
        let off = data_start + p["offset"].as_u64().unwrap() as usize;
        rank1.extend_from_slice(&bytes[off..off + p["bytes"].as_u64().unwrap() as usize]);
    }
    assert_eq!(m["ranks"][1]["sha256"], sha256(&rank1));

    // Run twice (replacing the first salvage): the same bytes, the same manifest, no
    // temporary file left.
    let first = (bytes.clone(), m.clone());
    assert_eq!(code(&r.aggregate(&["--overwrite"])), 0);
    assert_eq!((fs::read(&out).unwrap(), r.manifest(&out)), first);
    assert_eq!(
        r.files(),
        vec![
            "rollouts/iter-0001/train.salvaged.safetensors",
            "rollouts/iter-0001/train.salvaged.safetensors.manifest.json",
            "rollouts/iter-0001/train/rank-0.safetensors",
            "rollouts/iter-0001/train/rank-1.safetensors",
            "rollouts/iter-0001/train/rank-2.safetensors",
        ]
    );

    // And in Python, where its safetensors package is installed.
    if python_has(
        "import safetensors",
        "reading the merge with Python's safetensors",
    ) {
        let script = r#"
import hashlib, json, sys, safetensors
with open(sys.argv[1], "rb") as f:
    out = {n: {"dtype": t["dtype"], "shape": list(t["shape"]), "sha256": hashlib.sha256(bytes(t["data"])).hexdigest()}
           for n, t in safetensors.deserialize(f.read())}
with safetensors.safe_open(sys.argv[1], "numpy") as f:
    assert sorted(f.keys()) == sorted(out), (f.keys(), out)
print(json.dumps(out))
"#;
        let o = Command::new(python())
            .args(["-c", script])
            .arg(&out)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        if !o.status.success() && stderr(&o).contains("numpy") {
            eprintln!(
                "note: Python's safe_open needs numpy, which is missing: {}",
                stderr(&o)
            );
        } else {
            assert!(o.status.success(), "{}", stderr(&o));
            let py: Value = serde_json::from_str(&text).unwrap();
            for (name, t) in &got {
                assert_eq!(py[name]["dtype"], t.dtype.safetensors_name(), "{name}");
                assert_eq!(py[name]["shape"], serde_json::json!(t.shape), "{name}");
                assert_eq!(py[name]["sha256"], sha256(&t.data), "{name}");
            }
        }
    }
}

fn parsed_data_len(bytes: &[u8]) -> usize {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes.len() - 8 - n
}

#[test]
fn ranks_that_disagree_are_refused_naming_the_rank_the_key_and_both_values() {
    let cases: Vec<(&str, Vec<TensorData>, Vec<&str>)> = vec![
        (
            "trailing dimension",
            vec![
                tensor("token_ids", DType::I64, &[2, 16], 0),
                tensor("rewards", DType::F32, &[2], 0),
            ],
            vec![
                "tensor `token_ids`",
                "rank 0 has shape [3, 8]",
                "rank 1",
                "[2, 16]",
            ],
        ),
        (
            "dtype",
            vec![
                tensor("token_ids", DType::I32, &[2, 8], 0),
                tensor("rewards", DType::F32, &[2], 0),
            ],
            vec!["tensor `token_ids`", "rank 0 has dtype I64", "has I32"],
        ),
        (
            "keys",
            vec![tensor("token_ids", DType::I64, &[2, 8], 0)],
            vec!["rank 1", "no tensor `rewards`"],
        ),
    ];
    for (what, other, needles) in cases {
        let r = Run::new(2, "format = \"safetensors\"");
        r.put(
            "rollouts/iter-0001/train/rank-0.safetensors",
            st_bytes(&[
                tensor("token_ids", DType::I64, &[3, 8], 0),
                tensor("rewards", DType::F32, &[3], 0),
            ]),
        );
        r.put(
            "rollouts/iter-0001/train/rank-1.safetensors",
            st_bytes(&other),
        );
        let before = r.files();
        let o = r.aggregate(&["--allow-missing", "--json"]);
        assert_eq!(code(&o), 1, "{what}: {}", stderr(&o));
        let err = stderr(&o);
        for n in needles {
            assert!(err.contains(n), "{what}: missing {n:?} in {err}");
        }
        assert!(err.contains("nothing was published"), "{err}");
        let j: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["kind"], "mismatch");
        assert_eq!(r.files(), before, "{what}: nothing may be written");
    }
}

fn truncated(ts: &[TensorData], cut: usize) -> Vec<u8> {
    let b = st_bytes(ts);
    b[..b.len() - cut].to_vec()
}

#[test]
fn unreadable_shards_are_reported_and_allow_missing_merges_the_rest() {
    let r = Run::new(4, "shard-name = \"rank-{rank}.safetensors\"");
    let (s0, s3) = (rollout(2, 4, 1), rollout(5, 4, 2));
    r.put("rollouts/iter-0001/train/rank-0.safetensors", st_bytes(&s0));
    // Rank 1 committed a truncated file (the writer's last bytes never arrived).
    let bad = r.put(
        "rollouts/iter-0001/train/rank-1.safetensors",
        truncated(&rollout(3, 4, 7), 5),
    );
    // Rank 2 died mid-write: only its partial file, truncated too.
    r.put(
        "rollouts/iter-0001/train/rank-2.partial.safetensors",
        truncated(&rollout(3, 4, 8), 100),
    );
    // Rank 3 died after writing everything, before the commit.
    r.put(
        "rollouts/iter-0001/train/rank-3.partial.safetensors",
        st_bytes(&s3),
    );

    // Without --allow-missing: refused, and the gaps are listed.
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rank 2 has only a partial shard"), "{err}");
    assert!(err.contains("rank 3 has only a partial shard"), "{err}");
    assert!(!r
        .root
        .join("rollouts/iter-0001/train.salvaged.safetensors")
        .exists());

    // Without the run's [aggregate] settings, rl-node says what it sees.
    let o = Command::new(BIN)
        .args([
            "aggregate",
            "--iteration",
            "1",
            "--split",
            "train",
            "--log-path",
        ])
        .arg(&r.root)
        .env_remove("RL_NODE_AGGREGATE_FORMAT")
        .env_remove("RL_NODE_AGGREGATE_SHARD_NAME")
        .output()
        .unwrap();
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("rank-0.safetensors is a safetensors shard: pass --format safetensors"),
        "{}",
        stderr(&o)
    );

    // A committed shard that cannot be read is refused by name, even when every rank
    // committed (here: ranks 2 and 3 moved out of the way).
    let r2 = Run::new(2, "format = \"safetensors\"");
    r2.put("rollouts/iter-0001/train/rank-0.safetensors", st_bytes(&s0));
    r2.put(
        "rollouts/iter-0001/train/rank-1.safetensors",
        fs::read(&bad).unwrap(),
    );
    let o = r2.aggregate(&["--json"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("rank 1's committed shard")
            && err.contains("rank-1.safetensors")
            && err.contains("truncated"),
        "{err}"
    );
    assert!(err.contains("--allow-missing"), "{err}");
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (j["kind"].as_str(), j["rank"].as_u64()),
        (Some("unreadable"), Some(1))
    );

    // With --allow-missing: what can be read is merged; the rest is listed.
    let o = r.aggregate(&["--allow-missing"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("rank 1: rollouts/iter-0001/train/rank-1.safetensors: unreadable"),
        "{err}"
    );
    assert!(
        err.contains("rank 2: rollouts/iter-0001/train/rank-2.partial.safetensors: unreadable"),
        "{err}"
    );
    let out = r.root.join("rollouts/iter-0001/train.salvaged.safetensors");
    assert_eq!(read_back(&out), concat(&[&s0, &s3]));
    let m = r.manifest(&out);
    assert_eq!(m["complete"], false);
    assert_eq!(m["unreadable_ranks"], serde_json::json!([1, 2]));
    assert_eq!(m["partial_ranks"], serde_json::json!([2, 3]));
    let statuses: Vec<&str> = m["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["complete", "complete", "partial", "partial"]);
    assert_eq!(m["ranks"][1]["dropped"][0]["kind"], "unreadable");
    assert!(m["ranks"][1]["sha256"].is_null());
    assert_eq!(m["ranks"][3]["records"], 5);
    assert_eq!(m["records"], 7);
}

#[test]
fn a_header_holding_a_non_tensor_value_is_unreadable() {
    let r = Run::new(1, "format = \"safetensors\"");
    let hdr = br#"{"rewards":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"task":"click the button"}"#;
    let mut f = (hdr.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(hdr);
    f.extend_from_slice(&1.0f32.to_le_bytes());
    r.put("rollouts/iter-0001/train/rank-0.safetensors", f);
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("key `task` is not a tensor"),
        "{}",
        stderr(&o)
    );
}

#[cfg(not(feature = "torch"))]
#[test]
fn torch_shards_need_the_torch_feature_and_say_so() {
    let r = Run::new(1, "");
    r.put("rollouts/iter-0001/train/rank-0.pt", b"PK");
    let o = r.aggregate(&["--format", "torch"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--features torch"), "{}", stderr(&o));
    // auto picks torch for a .pt shard name, and is refused the same way.
    let r = Run::new(1, "shard-name = \"rank-{rank}.pt\"");
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("format auto picked torch"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn configured_names_place_shards_and_the_merge_anywhere_under_the_shared_directory() {
    let r = Run::new(
        2,
        "shard-name = \"{log_path}/tensors/{split}.iteration{iteration}_rank_{rank}.safetensors\"\n\
         output-name = \"{log_path}/tensors/{split}.iteration{iteration}.{ext}\"",
    );
    let (a, b) = (rollout(2, 3, 1), rollout(1, 3, 2));
    r.put("tensors/train.iteration1_rank_0.safetensors", st_bytes(&a));
    r.put("tensors/train.iteration1_rank_1.safetensors", st_bytes(&b));
    // Another iteration's and an extra rank's files are not merged; the extra is named.
    r.put("tensors/train.iteration2_rank_0.safetensors", st_bytes(&b));
    r.put("tensors/train.iteration1_rank_2.safetensors", st_bytes(&b));
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "tensors/train.iteration1_rank_2.safetensors exists but there are only 2 ranks"
        ),
        "{}",
        stderr(&o)
    );
    let out = r.root.join("tensors/train.iteration1.salvaged.safetensors");
    assert_eq!(read_back(&out), concat(&[&a, &b]));
    assert_eq!(
        r.manifest(&out)["ranks"][1]["source"],
        "tensors/train.iteration1_rank_1.safetensors"
    );

    // Names that would leave the shared directory are configuration errors.
    let bad = Run::new(1, "shard-name = \"../../../../rank-{rank}.jsonl\"");
    let o = bad.aggregate(&[]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("aggregate.shard-name"),
        "{}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains("leaves the shared directory"),
        "{}",
        stderr(&o)
    );
}

/// The old run.sh's pickles: `{'trajectories': [...], 'metadata': {...}}` per rank.
const MAKE_PICKLES: &str = r#"
import pickle, sys
root, n = sys.argv[1], int(sys.argv[2])
for r in range(n):
    obj = {"trajectories": [{"task": f"t{r}-{i}", "reward": r + i / 10, "steps": [("click", i)] * (i + 1)} for i in range(r + 2)],
           "metadata": {"iteration": 1, "rank": r, "model": "policy-v1"}}
    with open(f"{root}/train_trajectories.pt.iteration1_rank_{r}", "wb") as f:
        pickle.dump(obj, f)
"#;

/// The merged file as `torch.load` reads the legacy format the example script writes
/// without torch: pickles of torch's magic number, its protocol version and system info,
/// then the object.
const SHOW_PICKLE: &str = r#"
import json, pickle, sys
with open(sys.argv[1], "rb") as f:
    assert pickle.load(f) == 0x1950a86a20f9469cfc6c, "torch's magic number"
    assert pickle.load(f) == 1001, "torch's legacy protocol version"
    pickle.load(f)
    m = pickle.load(f)
print(json.dumps({"tasks": [t["task"] for t in m["trajectories"]], "metadata": m["metadata"]}, default=str))
"#;

fn merge_script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/webgym/merge_pickles.py")
        .display()
        .to_string()
}

#[test]
fn the_command_format_merges_the_old_run_sh_pickles_with_the_example_script() {
    if !python_has("import pickle", "the pickle merge command") {
        return;
    }
    let r = Run::new(
        4,
        &format!(
            "format = \"command\"\n\
             shard-name = \"{{log_path}}/{{split}}_trajectories.pt.iteration{{iteration}}_rank_{{rank}}\"\n\
             output-name = \"{{log_path}}/{{split}}_trajectories.pt.iteration{{iteration}}\"\n\
             command = \"{} {} --output {{output}} {{inputs}}\"",
            python(),
            merge_script()
        ),
    );
    let py = Command::new(python())
        .args(["-c", MAKE_PICKLES])
        .arg(&r.root)
        .arg("4")
        .output()
        .unwrap();
    assert!(py.status.success(), "{}", stderr(&py));
    // Rank 3 died mid-write: its partial pickle is cut short, and no committed shard.
    let full = r.root.join("train_trajectories.pt.iteration1_rank_3");
    let bytes = fs::read(&full).unwrap();
    fs::write(
        full.with_file_name("train_trajectories.pt.iteration1_rank_3.partial"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    fs::remove_file(&full).unwrap();

    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("rank 3 has only a partial shard"),
        "{}",
        stderr(&o)
    );

    let o = r.aggregate(&["--allow-missing"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rank 3: train_trajectories.pt.iteration1_rank_3.partial: unreadable (merge command: truncated or corrupt pickle"), "{err}");
    let out = r.root.join("train_trajectories.pt.salvaged.iteration1");
    let show = Command::new(python())
        .args(["-c", SHOW_PICKLE])
        .arg(&out)
        .output()
        .unwrap();
    assert!(show.status.success(), "{}", stderr(&show));
    let merged: Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(
        merged["tasks"],
        serde_json::json!(["t0-0", "t0-1", "t1-0", "t1-1", "t1-2", "t2-0", "t2-1", "t2-2", "t2-3"])
    );
    assert_eq!(merged["metadata"]["model"], "policy-v1");
    assert_eq!(merged["metadata"]["num_trajectories"], 9);
    assert!(
        merged["metadata"].get("rank").is_none(),
        "ranks disagree on `rank`"
    );
    let from: Vec<u64> = merged["metadata"]["merged_from"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(from, vec![0, 1, 2]);

    let m = r.manifest(&out);
    assert_eq!(m["shard_format"], "command");
    assert_eq!(m["unreadable_ranks"], serde_json::json!([3]));
    assert_eq!(m["partial_ranks"], serde_json::json!([3]));
    let records: Vec<u64> = m["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["records"].as_u64().unwrap())
        .collect();
    assert_eq!(records, vec![2, 3, 4, 0]);
    assert_eq!(m["records"], 9);
    let shard0 = fs::read(r.root.join("train_trajectories.pt.iteration1_rank_0")).unwrap();
    assert_eq!(m["ranks"][0]["sha256"], sha256(&shard0));
    assert_eq!(m["output_sha256"], sha256(&fs::read(&out).unwrap()));
    assert!(m["command"].as_str().unwrap().contains("merge_pickles.py"));

    // A committed shard the script cannot read is refused by name without --allow-missing
    // (--overwrite: the salvage above may be replaced).
    fs::write(
        r.root.join("train_trajectories.pt.iteration1_rank_3"),
        b"\x80\x04K\x05.",
    )
    .unwrap(); // pickle of 5
    let o = r.aggregate(&["--overwrite"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("rank 3's committed shard")
            && stderr(&o).contains("expected a dict with 'trajectories', found int"),
        "{}",
        stderr(&o)
    );

    // A failing merge command publishes nothing and says how it failed.
    let before = fs::read(&out).unwrap();
    fs::write(
        &r.config,
        "[aggregate]\nformat = \"command\"\nshard-name = \"{log_path}/{split}_trajectories.pt.iteration{iteration}_rank_{rank}\"\n\
         output-name = \"{log_path}/{split}_trajectories.pt.iteration{iteration}\"\n\
         command = \"echo disk full >&2; echo partial > {output}; exit 7\"\n",
    )
    .unwrap();
    let o = r.aggregate(&["--allow-missing", "--overwrite"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the merge command failed with exit code 7"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("disk full"), "{}", stderr(&o));
    assert_eq!(fs::read(&out).unwrap(), before);
    let leftovers: Vec<_> = fs::read_dir(&r.root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != ".rl-node")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn jsonl_is_still_the_default_and_the_config_is_checked() {
    let r = Run::new(1, "");
    r.put("rollouts/iter-0001/train/rank-0.jsonl", "{\"a\":1}\n");
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let m = r.manifest(&r.root.join("rollouts/iter-0001/train.salvaged.jsonl"));
    assert!(
        m.get("shard_format").is_none() && m.get("tensors").is_none(),
        "{m}"
    );

    for (toml, needle) in [
        ("format = \"command\"", "aggregate.command"),
        ("format = \"parquet\"", "unknown format `parquet`"),
        (
            "command = \"x {output}\"",
            "only used with format = \"command\"",
        ),
        (
            "format = \"command\"\ncommand = \"cat {inputs}\"",
            "must write {output}",
        ),
    ] {
        let bad = Run::new(1, toml);
        let o = bad.aggregate(&[]);
        assert_eq!(code(&o), 2, "{toml}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{toml}: {}", stderr(&o));
    }
}

/// A fixture directory with each rank's safetensors shard, for rollout commands to copy.
fn fixtures(dir: &Path, shards: &[Vec<TensorData>]) -> PathBuf {
    let d = dir.join("fixtures");
    fs::create_dir_all(&d).unwrap();
    for (rank, ts) in shards.iter().enumerate() {
        fs::write(d.join(format!("rank-{rank}.safetensors")), st_bytes(ts)).unwrap();
    }
    d
}

#[test]
fn phase_3_of_a_cluster_merges_safetensors_shards() {
    let shards = [rollout(3, 5, 1), rollout(2, 5, 9)];
    let c0 = TestCluster::new(2, "");
    let fx = fixtures(c0.dir.path(), &shards);
    let c = TestCluster::new(
        2,
        &format!(
            "[aggregate]\nformat = \"safetensors\"\n\
             [phases.rollout]\ncommand = \"cp {}/rank-{{rank}}.safetensors {{output}}\"\n\
             [phases.prepare]\ncommand = \"cp {{trajectories}} {{output}}\"\n",
            fx.display()
        ),
    );
    let mut nodes = c.spawn_all(&["--iterations", "1", "--eval-interval", "0"]);
    for n in &mut nodes {
        assert_eq!(n.wait(Duration::from_secs(60)), 0, "{}", n.stderr());
    }
    let it = c.log_path.join("rollouts/iter-0001");
    assert!(it.join("train/rank-0.safetensors").exists());
    assert!(it.join("train/rank-1.safetensors").exists());
    let merged = it.join("train.safetensors");
    assert_eq!(read_back(&merged), concat(&[&shards[0], &shards[1]]));
    // {trajectories} named the merged safetensors file.
    assert_eq!(
        fs::read(it.join("prepared")).unwrap(),
        fs::read(&merged).unwrap()
    );
    let m: Value =
        serde_json::from_slice(&fs::read(it.join("train.safetensors.manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        (m["complete"].as_bool(), m["records"].as_u64()),
        (Some(true), Some(5))
    );
}

#[test]
fn phase_3_of_a_cluster_runs_the_merge_command() {
    let c = TestCluster::new(
        2,
        "[aggregate]\nformat = \"command\"\nshard-name = \"rank-{rank}.txt\"\n\
         output-name = \"{split}-merged.txt\"\n\
         command = \"cat {inputs} > {output}; echo merged {input_ranks} of {num_ranks}\"\n\
         [phases.rollout]\ncommand = \"echo rank {rank} > {output}\"\n",
    );
    let mut nodes = c.spawn_all(&["--iterations", "1", "--eval-interval", "0"]);
    for n in &mut nodes {
        assert_eq!(n.wait(Duration::from_secs(60)), 0, "{}", n.stderr());
    }
    let it = c.log_path.join("rollouts/iter-0001");
    assert!(it.join("train/rank-1.txt").exists());
    assert_eq!(
        fs::read_to_string(it.join("train-merged.txt")).unwrap(),
        "rank 0\nrank 1\n"
    );
    let log = c.log_path.join("logs/iter-0001/rank-0.aggregate.log");
    wait_until(Duration::from_secs(5), "the aggregate log", || log.exists());
    assert!(fs::read_to_string(&log)
        .unwrap()
        .contains("merged 0,1 of 2"));
    let m: Value =
        serde_json::from_slice(&fs::read(it.join("train-merged.txt.manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["shard_format"], "command");
    assert_eq!(m["complete"], true);
}

/// With the `torch` feature: `torch.save` shards (made by the torch reader's own fixture
/// script) go through the same checks and writer as safetensors shards.
#[cfg(feature = "torch")]
#[test]
fn torch_shards_merge_into_safetensors_and_bad_ones_are_named() {
    let fx = tempfile::tempdir().unwrap();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/make_torch_fixtures.py");
    let o = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(&script)
        .arg(fx.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let shard = |r: &Run, rank: u32, file: &str| {
        r.put(
            &format!("rollouts/iter-0001/train/rank-{rank}.pt"),
            fs::read(fx.path().join(file)).unwrap(),
        );
    };

    let r = Run::new(2, "format = \"torch\"");
    shard(&r, 0, "rank-0.pt");
    shard(&r, 1, "rank-0.pt");
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let one = rl_node::shards::read_torch_dict(&fx.path().join("rank-0.pt")).unwrap();
    let out = r.root.join("rollouts/iter-0001/train.salvaged.safetensors");
    assert_eq!(read_back(&out), concat(&[&one, &one]));
    assert_eq!(r.manifest(&out)["shard_format"], "torch");

    // Ranks whose trailing dimensions differ are refused naming both shapes.
    let r = Run::new(2, "shard-name = \"rank-{rank}.pt\"");
    shard(&r, 0, "rank-0.pt");
    shard(&r, 1, "rank-1.pt");
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("trailing dimensions differ"),
        "{}",
        stderr(&o)
    );
    // So is a scalar, even in one rank (the every-dtype fixture holds one).
    let r = Run::new(1, "format = \"torch\"");
    shard(&r, 0, "mixed.pt");
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("tensor `scalar`") && stderr(&o).contains("is a scalar"),
        "{}",
        stderr(&o)
    );

    // A dict holding a non-tensor value is unreadable; --allow-missing leaves it out.
    let r = Run::new(2, "format = \"torch\"");
    shard(&r, 0, "rank-0.pt");
    shard(&r, 1, "non_tensor.pt");
    let o = r.aggregate(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("rank 1's committed shard") && stderr(&o).contains("not a tensor"),
        "{}",
        stderr(&o)
    );
    let o = r.aggregate(&["--allow-missing"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = r.root.join("rollouts/iter-0001/train.salvaged.safetensors");
    assert_eq!(read_back(&out), concat(&[&one]));
    assert_eq!(r.manifest(&out)["unreadable_ranks"], serde_json::json!([1]));
}
