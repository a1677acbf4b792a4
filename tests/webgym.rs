//! examples/webgym/rl-node.toml runs webgym as webgym's scripts/run.sh ran it.
//!
//! A 3-node cluster runs the example configuration unchanged (except where the checkout
//! lives, the ports and fast timing) with stand-ins for `python` (scripts/rollout.py and
//! scripts/update_prepare.py), `vllm` and `llamafactory-cli` first on PATH
//! (tests/fixtures/webgym/bin). The stand-ins parse their command lines as the real
//! programs do (Hydra's override rules, vLLM's and LLaMA-Factory's options), refuse
//! anything the real ones would not accept, write their outputs where the real ones do,
//! and record the argv and environment they received.
//!
//! The conformance test compares what every program received in iteration 2 with golden
//! command lines written out by hand from run.sh's shell functions (microsoft/webgym,
//! scripts/run.sh and scripts/shell_functions/*.sh at 7492bc8; each golden cites its
//! lines), evaluated by a real bash exactly as run.sh evaluates them, so the quoting is
//! run.sh's own. Inputs: 3 ranks, weights 2,1,1, iteration 2, eval on (eval-interval 1)
//! with trailing Hydra overrides, and eval off (eval-interval 6) without. run.sh's values
//! map to rl-node's as the example documents: HOST_RUN_PATH = [env] WEBGYM, HOST_DATA_PATH
//! = --log-path, MODEL_PATH (= $LOG/model.pt, a copy of the last checkpoint) =
//! models/iter-0001, its path relative to save_path (run.sh: `basename`, the same thing for
//! $LOG/model.pt) = {checkpoint_name}, checkpoints/model_<timestamp> = this
//! iteration's training output, VLLM_PORT = server.port, NUM_GPUS = the node's GPUs.

// The stand-ins record the environment as JSON strings: `value == n` would compare a
// string with a number (always false), so the comparisons here are with `n.to_string()`.
#![allow(clippy::cmp_owned)]

mod common;
use common::webgym::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

impl Webgym {
    /// What the stand-ins recorded, in the order they started.
    fn calls(&self) -> Vec<Value> {
        fs::read_to_string(self.standin_log())
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// The one call of `prog` by `rank` in `iteration` (RL_NODE_ITERATION), `config`
    /// (`--config-name` for the Hydra programs, None otherwise).
    fn call(&self, prog: &str, rank: u32, iteration: u64, config: Option<&str>) -> Value {
        let found: Vec<Value> = self
            .calls()
            .into_iter()
            .filter(|c| {
                c["prog"] == prog
                    && c["env"]["RL_NODE_RANK"] == rank.to_string()
                    && c["env"]["RL_NODE_ITERATION"] == iteration.to_string()
                    && config.is_none_or(|name| argv(c).iter().any(|a| a == name))
            })
            .collect();
        assert_eq!(
            found.len(),
            1,
            "{prog} {config:?} of rank {rank} in iteration {iteration}: {found:#?}"
        );
        found.into_iter().next().unwrap()
    }

    /// The variables run.sh's golden lines use, for rank `r` in iteration 2.
    fn golden_vars(&self, r: u32) -> Vec<(&'static str, String)> {
        vec![
            ("HOST_RUN_PATH", self.webgym.display().to_string()),
            ("HOST_DATA_PATH", self.log.display().to_string()),
            ("DATA_PATH", self.data.display().to_string()),
            ("VLLM_PORT", self.ports[r as usize].to_string()),
            (
                "MODEL_PATH",
                self.log.join("models/iter-0001").display().to_string(),
            ),
            ("NUM_GPUS", self.gpus[r as usize].to_string()),
            ("MULTINODE_NUM_WORKERS", "3".into()),
            ("RANK", r.to_string()),
            ("WEIGHT", ["2", "1", "1"][r as usize].into()),
        ]
    }
}

/// The argv a stand-in received (for `python`, the script and what follows it).
fn argv(call: &Value) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    if let Some(s) = call["script"].as_str() {
        v.push(s.to_string());
    }
    v.extend(
        call["argv"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string()),
    );
    v
}

/// The argv bash gives the shell text `words` with `vars` set, parsed once as run.sh's
/// `eval "${rollout_cmd}"` parses it (rollout_utils.sh:99, 185); for the commands run.sh
/// writes out directly, one parse is what the shell does too.
fn bash_argv(words: &str, vars: &[(&str, String)]) -> Vec<String> {
    let out = Command::new("bash")
        .arg("-c")
        .arg("args() { printf '%s\\0' \"$@\"; }; eval \"args $GOLDEN\"")
        .env("GOLDEN", words)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8(out.stdout).unwrap();
    s.split_terminator('\0').map(str::to_string).collect()
}

/// Golden: rollout_atomic_train (scripts/shell_functions/rollout_utils.sh:45-52 builds the
/// base command, 59-61 the multinode rank keys, 64-79 the load weights, 88-91 resume and
/// 94-96 HYDRA_OVERRIDES, 99 evals it), called from run.sh:1030/1036 with
/// rank_suffix=_rank_${MULTINODE_RANK}; model_to_serve = MODEL_PATH (resolve_model_to_serve,
/// common_utils.sh:56-58), checkpoint_name = basename MODEL_PATH (rollout_utils.sh:33-36),
/// which is MODEL_PATH relative to save_path ($LOG/model.pt), written so here.
const GOLDEN_ROLLOUT_TRAIN: &str = r#"${HOST_RUN_PATH}/scripts/rollout.py \
        --config-path ${HOST_RUN_PATH}/scripts/config/main \
        --config-name rollout_train \
        save_path=${HOST_DATA_PATH} \
	    data_path=${DATA_PATH} \
        env_config.vllm_server_url=http://localhost:${VLLM_PORT} \
        policy_config.base_model=${MODEL_PATH} \
        policy_config.checkpoint_path=${MODEL_PATH#${HOST_DATA_PATH}/} +env_config.multinode_rank_suffix=_rank_${RANK} +env_config.multinode_rank=${RANK} +env_config.multinode_total_workers=${MULTINODE_NUM_WORKERS} +env_config.rank_load_weight=${WEIGHT} +env_config.total_load_weight=4 +env_config.all_rank_weights=\'2,1,1\' ${HYDRA_OVERRIDES}"#;

/// Golden: rollout_atomic_test (rollout_utils.sh:132-139 base command, 145-147 rank
/// slicing keys, 150-165 load weights, 174-182 resume and HYDRA_OVERRIDES, 185 eval),
/// called from run.sh:1084/1093 as rollout_atomic_test "$MODEL_TO_SERVE" RANK 3.
const GOLDEN_ROLLOUT_TEST: &str = r#"${HOST_RUN_PATH}/scripts/rollout.py \
        --config-path ${HOST_RUN_PATH}/scripts/config/main \
        --config-name rollout_test \
        save_path=${HOST_DATA_PATH} \
        data_path=${DATA_PATH} \
        env_config.vllm_server_url=http://localhost:${VLLM_PORT} \
        policy_config.base_model=${MODEL_PATH} \
        policy_config.checkpoint_path=${MODEL_PATH#${HOST_DATA_PATH}/} +env_config.multinode_rank_suffix=_rank_${RANK} +env_config.test_rank=${RANK} +env_config.test_total_workers=3 +env_config.multinode_total_workers=3 +env_config.rank_load_weight=${WEIGHT} +env_config.total_load_weight=4 +env_config.all_rank_weights=\'2,1,1\' ${HYDRA_OVERRIDES}"#;

/// Golden: update_atomic's update_prepare call (training_utils.sh:219-227), from
/// run.sh:1131 as update_atomic "$MODEL_TO_SERVE" update_online true 3; output_checkpoint_dir
/// (training_utils.sh:203-204, checkpoints/model_<timestamp>) is the training output.
const GOLDEN_UPDATE_PREPARE: &str = r#""${HOST_RUN_PATH}/scripts/update_prepare.py" \
        --config-path "${HOST_RUN_PATH}/scripts/config/main" \
        --config-name "update_online" \
        hydra.job.chdir=False \
        policy_config.base_model="${MODEL_PATH}" \
        policy_config.checkpoint_path="${MODEL_PATH#${HOST_DATA_PATH}/}" \
        algorithm_config.model_output_name="${output_checkpoint_dir}" \
        +algorithm_config.num_nodes="3" \
        save_path="${HOST_DATA_PATH}""#;

/// Golden: start_vllm (vllm_utils.sh:134-145; REASONING_FLAGS empty for MODEL_TYPE
/// qwen-instruct, 115-119; NUM_GPUS from detect_num_gpus, common_utils.sh:69-83).
const GOLDEN_VLLM: &str = r#"serve "${MODEL_PATH}" \
            --host 0.0.0.0 \
            --port "${VLLM_PORT}" \
            --max-num-seqs 512 \
            --gpu-memory-utilization 0.95 \
            --max-model-len 32768 \
            --tensor-parallel-size 1 \
            --data-parallel-size ${NUM_GPUS} \
            --limit-mm-per-prompt '{"video": 0}' \
            --allowed-local-media-path "${HOST_DATA_PATH}""#;

/// Golden: run_llamafactory_training's multi-node call (training_utils.sh:127,
/// `llamafactory-cli train "${config_path}"`, config_path from run.sh:1135), plus the one
/// argument the example adds and documents: output_dir={output}, so that a training redone
/// after a restart writes its own generation's directory.
const GOLDEN_LLAMAFACTORY: &str = r#"train "${HOST_DATA_PATH}/llamafactory_data/train_config.yaml" output_dir="${output_checkpoint_dir}""#;

fn golden(words: &str, vars: &[(&str, String)]) -> Vec<String> {
    bash_argv(words, vars)
}

fn check_iteration_2(w: &Webgym, overrides: &[&str], eval: bool) {
    let train_output = w.log.join("train/iter-0002/gen-1").display().to_string();
    for r in 0..3u32 {
        let mut vars = w.golden_vars(r);
        // run.sh:167-183 joins the overrides with spaces (HYDRA_OVERRIDES).
        vars.push(("HYDRA_OVERRIDES", overrides.join(" ")));
        vars.push(("output_checkpoint_dir", train_output.clone()));

        let got = argv(&w.call("rollout.py", r, 2, Some("rollout_train")));
        assert_eq!(
            got,
            golden(GOLDEN_ROLLOUT_TRAIN, &vars),
            "rank {r} train rollout"
        );

        let test: Vec<Value> = w
            .calls()
            .into_iter()
            .filter(|c| {
                c["env"]["RL_NODE_RANK"] == r.to_string()
                    && c["env"]["RL_NODE_ITERATION"] == "2"
                    && argv(c).iter().any(|a| a == "rollout_test")
            })
            .collect();
        if eval {
            let got = argv(&w.call("rollout.py", r, 2, Some("rollout_test")));
            assert_eq!(
                got,
                golden(GOLDEN_ROLLOUT_TEST, &vars),
                "rank {r} test rollout"
            );
        } else {
            assert!(
                test.is_empty(),
                "rank {r} ran a test rollout in iteration 2: {test:#?}"
            );
        }

        let train = w.call("llamafactory-cli", r, 2, None);
        assert_eq!(
            argv(&train),
            golden(GOLDEN_LLAMAFACTORY, &vars),
            "rank {r} training"
        );
        // run_llamafactory_training's environment (training_utils.sh:68-74, 86-95, 111-116)
        // and run.sh's exports (run.sh:380, 416-417; vllm_utils.sh:104).
        let ip = Command::new("hostname").arg("-I").output().unwrap();
        let ip = String::from_utf8(ip.stdout).unwrap();
        let ip = ip.split_whitespace().next().unwrap_or("").to_string();
        let expect: BTreeMap<&str, String> = [
            ("NNODES", "3".to_string()),
            ("NODE_RANK", r.to_string()),
            ("NPROC_PER_NODE", w.gpus[r as usize].to_string()),
            ("MASTER_ADDR", ip),
            ("MASTER_PORT", "29500".into()),
            ("FORCE_TORCHRUN", "1".into()),
            ("HF_TRUST_REMOTE_CODE", "1".into()),
            ("DEEPSPEED_LOG_LEVEL", "WARNING".into()),
            ("DS_BUILD_OPS_VERBOSE", "0".into()),
            ("DS_BUILD_CPU_ADAM", "0".into()),
            ("DS_BUILD_FUSED_ADAM", "0".into()),
            ("WANDB_MODE", "online".into()),
            ("WANDB_INIT_TIMEOUT", "300".into()),
            ("WANDB_CONSOLE", "wrap".into()),
            (
                "HF_HOME",
                format!("{}/.cache/huggingface/hub/", w.data.display()),
            ),
            ("DISABLE_VERSION_CHECK", "1".into()),
            ("VLLM_USE_TRITON_FLASH_ATTN", "1".into()),
        ]
        .into_iter()
        .collect();
        for (k, v) in &expect {
            assert_eq!(train["env"][k], *v, "rank {r} training: {k}");
        }
        // What update_prepare wrote into wandb_env.sh reached the training (sourced).
        let wandb = fs::read_to_string(w.log.join("llamafactory_data/wandb_env.sh")).unwrap();
        assert!(wandb.contains("WANDB_PROJECT"), "{wandb}");
        assert!(
            train["env"]["WANDB_PROJECT"]
                .as_str()
                .is_some_and(|p| !p.is_empty()),
            "rank {r}: wandb_env.sh was not sourced"
        );

        // The server restarted on iteration 1's checkpoint in phase 12 of iteration 1.
        let servers: Vec<Value> = w
            .calls()
            .into_iter()
            .filter(|c| c["prog"] == "vllm" && c["env"]["RL_NODE_RANK"] == r.to_string())
            .filter(|c| c["env"]["RL_NODE_MODEL"] == vars[4].1.as_str())
            .collect();
        assert_eq!(
            servers.len(),
            1,
            "rank {r}: servers on iter-0001: {servers:#?}"
        );
        assert_eq!(
            argv(&servers[0]),
            golden(GOLDEN_VLLM, &vars),
            "rank {r} vLLM"
        );
        assert_eq!(servers[0]["env"]["HF_HOME"], expect["HF_HOME"]);
    }
    let prep = w.call("update_prepare.py", 0, 2, None);
    let mut vars = w.golden_vars(0);
    vars.push(("output_checkpoint_dir", train_output));
    assert_eq!(
        argv(&prep),
        golden(GOLDEN_UPDATE_PREPARE, &vars),
        "update_prepare"
    );
    for r in 1..3 {
        let other: Vec<Value> = w
            .calls()
            .into_iter()
            .filter(|c| {
                c["prog"] == "update_prepare.py" && c["env"]["RL_NODE_RANK"] == r.to_string()
            })
            .collect();
        assert!(
            other.is_empty(),
            "update_prepare runs on rank 0 only: {other:#?}"
        );
    }
}

/// How many trajectories webgym's loader (load_all_trajectories: `torch.load(path,
/// weights_only=False)`, then the `trajectories` of the dict) reads from a merged file, or
/// why it skips the file. The stand-in python holds that logic (for files without
/// tensors); this loads it as a module.
fn webgym_count(path: &Path) -> Result<usize, String> {
    let code = "import importlib.machinery as m, importlib.util as u, sys\n\
        l = m.SourceFileLoader('standin', sys.argv[1])\n\
        s = u.module_from_spec(u.spec_from_loader('standin', l))\n\
        l.exec_module(s)\n\
        print(len(s.webgym_load_trajectories(sys.argv[2])))";
    let out = Command::new("python3")
        .arg("-c")
        .arg(code)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/webgym/bin/python"
        ))
        .arg(path)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap())
}

/// run.sh's files in run.sh's places, a merged file per iteration and split, and the
/// trained checkpoint published as models/iter-0002.
fn check_files(w: &Webgym, evals: &[u64]) {
    let py = |code: &str, path: &Path| -> String {
        let out = Command::new("python3")
            .arg("-c")
            .arg(code)
            .arg(path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let count =
        "import pickle,sys; d=pickle.load(open(sys.argv[1],'rb')); print(len(d['trajectories']))";
    for (split, rounds) in [("train", vec![1u64, 2]), ("test", evals.to_vec())] {
        let dir = w.log.join(format!("{split}_trajectories"));
        for n in &rounds {
            let mut total = 0;
            for r in 0..3 {
                let shard = dir.join(format!("{split}_trajectories.pt.iteration{n}_rank_{r}"));
                assert!(shard.is_file(), "{} missing", shard.display());
                total += py(count, &shard).parse::<usize>().unwrap();
            }
            // The merged file as webgym's loaders read it (torch.load, which skips a
            // plain pickle).
            let merged = dir.join(format!("{split}_trajectories.pt.iteration{n}"));
            assert_eq!(webgym_count(&merged), Ok(total), "{}", merged.display());
            assert!(merged
                .with_extension(format!("iteration{n}.manifest.json"))
                .is_file());
        }
        let stray: Vec<String> = fs::read_dir(&dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(".checkpoint"))
                    .collect()
            })
            .unwrap_or_default();
        assert!(stray.is_empty(), "partial files left: {stray:?}");
    }
    let yaml = fs::read_to_string(w.log.join("llamafactory_data/train_config.yaml")).unwrap();
    assert!(yaml.contains("train/iter-0002/gen-"), "{yaml}");
    let latest = fs::read_to_string(w.log.join("models/LATEST")).unwrap();
    assert_eq!(latest.trim(), "iter-0002");
    let model = w.log.join("models/iter-0002");
    assert!(model.join("model.safetensors").is_file() && model.join("manifest.json").is_file());
}

#[test]
fn commands_equal_run_sh_with_eval_and_overrides() {
    let w = webgym_cluster(1);
    let overrides = [
        "env_config.vllm_timeout=300",
        "policy_config.temperature=0.7",
        "+env_config.note=from-rl-node",
    ];
    w.run(&overrides);
    check_iteration_2(&w, &overrides, true);
    check_files(&w, &[1, 2]);
    // Iteration 1 starts from the base model, with an empty checkpoint_path (run.sh:
    // resolve_model_to_serve's default, checkpoint_name "" while MODEL_PATH is absent).
    let first = argv(&w.call("rollout.py", 1, 1, Some("rollout_train")));
    assert!(first.contains(&"policy_config.base_model=Qwen/Qwen3-VL-8B-Instruct".to_string()));
    assert!(
        first.contains(&"policy_config.checkpoint_path=".to_string()),
        "{first:?}"
    );
}

#[test]
fn commands_equal_run_sh_without_eval_or_overrides() {
    let w = webgym_cluster(6);
    w.run(&[]);
    check_iteration_2(&w, &[], false);
    check_files(&w, &[1]);
}

/// Workers start their rollouts only once rank 0's rollout.py has reset the shared
/// instance pool, as run.sh's workers did (run.sh:1031-1035: instances_released, 120 s,
/// then train_sampling_complete). webgym raises train_sampling_complete *before* that
/// reset (the sampler runs before AsyncWebGym releases the instances), so a worker
/// released by it would start while rank 0 is still releasing instances; the stand-in
/// fails such a worker. Rank 0 samples slowly, so a worker that did not wait at all would
/// start first; the stand-in logs each call as it starts.
#[test]
fn workers_start_after_rank_0_released_the_instance_pool() {
    let w = webgym_cluster(1);
    let mut nodes = w.spawn(
        &[],
        &[
            ("WEBGYM_STANDIN_SAMPLE_DELAY", "1".into()),
            ("WEBGYM_STANDIN_RESET_SECONDS", "3".into()),
        ],
    );
    for n in nodes.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    for it in [1u64, 2] {
        for config in ["rollout_train", "rollout_test"] {
            let order: Vec<String> = w
                .calls()
                .into_iter()
                .filter(|c| {
                    argv(c).iter().any(|a| a == config)
                        && c["env"]["RL_NODE_ITERATION"] == it.to_string()
                })
                .map(|c| c["env"]["RL_NODE_RANK"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(order.len(), 3, "iteration {it} {config}: {order:?}");
            assert_eq!(order[0], "0", "iteration {it} {config}: {order:?}");
        }
    }
    // The example waits run.sh's 120 s after the flag (the test's environment sets 0 s).
    let example = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/webgym/rl-node.toml"
    ))
    .unwrap();
    let rollout = &example[example.find("[phases.rollout]").unwrap()..];
    let rollout = &rollout[..rollout.find("\n[phases.eval]").unwrap()];
    assert!(rollout.contains("workers-delay = \"120s\""), "{rollout}");
}

/// A rollout that crashed is redone after the restart with its own `.checkpoint` file
/// as `+env_config.resume_checkpoint_path=` (run.sh's --resume, rollout_utils.sh:88-91),
/// and the file is not touched by rl-node before the command takes it over.
#[test]
fn a_crashed_rollout_resumes_from_its_checkpoint_file() {
    let w = webgym_cluster(6);
    let mut nodes = w.spawn(&[], &[("WEBGYM_STANDIN_FAIL_ROLLOUT", "1:train:1".into())]);
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    assert_eq!(codes[1], 1, "{}", nodes[1].stderr());
    let partial = w
        .log
        .join("train_trajectories/train_trajectories.pt.iteration1_rank_1.checkpoint");
    assert!(
        partial.is_file(),
        "the crashed rollout left no checkpoint file"
    );
    let before = fs::read(&partial).unwrap();

    w.run(&[]);
    let resumed: Vec<Value> = w
        .calls()
        .into_iter()
        .filter(|c| {
            c["env"]["RL_NODE_RANK"] == "1"
                && c["env"]["RL_NODE_ITERATION"] == "1"
                && argv(c).iter().any(|a| a == "rollout_train")
        })
        .collect();
    assert_eq!(resumed.len(), 2, "{resumed:#?}");
    let flag = format!("+env_config.resume_checkpoint_path={}", partial.display());
    assert!(!argv(&resumed[0]).contains(&flag));
    assert_eq!(
        argv(&resumed[1]).last(),
        Some(&flag),
        "{:?}",
        argv(&resumed[1])
    );
    assert_eq!(
        resumed[1]["env"]["RL_NODE_RESUME_FROM"],
        partial.display().to_string()
    );
    // The stand-in kept the checkpoint's trajectories and renamed the file to the shard.
    let shard = w
        .log
        .join("train_trajectories/train_trajectories.pt.iteration1_rank_1");
    assert!(!partial.exists() && shard.is_file());
    let n = |bytes: &[u8]| -> usize {
        let out = Command::new("python3")
            .arg("-c")
            .arg("import pickle,sys; print(len(pickle.load(sys.stdin.buffer)['trajectories']))")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut ch| {
                use std::io::Write;
                ch.stdin.take().unwrap().write_all(bytes)?;
                ch.wait_with_output()
            })
            .unwrap();
        String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    assert!(n(&fs::read(&shard).unwrap()) >= n(&before));
    check_files(&w, &[1]);
}

/// run.sh kept the previous model when training failed and went on (run.sh:1153, the
/// copy only after rc 0): the example's `on-failure = "keep-model"`. update_prepare.py
/// rewrote that model's scheduler.pt in place meanwhile, which the manifest allows
/// (`mutable`), so the servers restart on it and iteration 3 trains from it.
#[test]
fn a_failed_training_keeps_the_previous_model() {
    let w = webgym_cluster(6);
    let mut nodes = w.spawn(
        &[],
        &[
            ("WEBGYM_STANDIN_FAIL_TRAIN", "1:2".into()),
            ("RL_NODE_CLUSTER_ITERATIONS", "3".into()),
        ],
    );
    for n in nodes.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    let models = w.log.join("models");
    assert!(models.join("iter-0001").is_dir());
    assert!(
        !models.join("iter-0002").exists(),
        "a failed training published a model"
    );
    assert_eq!(
        fs::read_to_string(models.join("LATEST")).unwrap().trim(),
        "iter-0003"
    );
    let sched = fs::read_to_string(models.join("iter-0001/scheduler.pt")).unwrap();
    assert!(sched.contains("rewritten"), "{sched}");
    let kept = models.join("iter-0001").display().to_string();
    for r in 0..3 {
        let third = argv(&w.call("rollout.py", r, 3, Some("rollout_train")));
        assert!(
            third.contains(&format!("policy_config.base_model={kept}")),
            "rank {r}: {third:?}"
        );
        let servers = w
            .calls()
            .into_iter()
            .filter(|c| c["prog"] == "vllm" && c["env"]["RL_NODE_RANK"] == r.to_string())
            .filter(|c| c["env"]["RL_NODE_MODEL"] == kept.as_str())
            .count();
        assert_eq!(
            servers, 2,
            "rank {r}: vLLM started on iter-0001 after iterations 1 and 2"
        );
    }
    assert!(
        nodes[0]
            .stderr()
            .contains("iteration 2: training failed on rank(s) 1"),
        "{}",
        nodes[0].stderr()
    );
}

/// A directory run.sh used (iterations 1 and 2 done: merged train files 1–2, test file 1,
/// its last model in model.pt) continues under rl-node at iteration 3
/// (`cluster.first-iteration`), with webgym's own file numbering carrying on.
#[test]
fn a_run_sh_directory_continues_at_its_next_iteration() {
    let w = webgym_cluster(6);
    let pickle = |path: &Path, n: usize| {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let out = Command::new("python3")
            .arg("-c")
            .arg("import pickle,sys; pickle.dump({'trajectories': [{'task_id': i} for i in range(int(sys.argv[2]))], 'metadata': {}}, open(sys.argv[1], 'wb'))")
            .arg(path)
            .arg(n.to_string())
            .status()
            .unwrap();
        assert!(out.success());
    };
    pickle(
        &w.log
            .join("train_trajectories/train_trajectories.pt.iteration1"),
        4,
    );
    pickle(
        &w.log
            .join("train_trajectories/train_trajectories.pt.iteration2"),
        4,
    );
    pickle(
        &w.log
            .join("test_trajectories/test_trajectories.pt.iteration1"),
        2,
    );
    let model = w.log.join("model.pt");
    fs::create_dir_all(&model).unwrap();
    fs::write(model.join("config.json"), "{}").unwrap();
    let mut nodes = w.spawn(
        &[],
        &[
            ("RL_NODE_CLUSTER_FIRST_ITERATION", "3".into()),
            ("RL_NODE_CLUSTER_ITERATIONS", "3".into()),
            ("RL_NODE_CLUSTER_MODEL", model.display().to_string()),
        ],
    );
    for n in nodes.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    assert!(nodes[0]
        .stderr()
        .contains("at iteration 3 (cluster.first-iteration"));
    let dir = w.log.join("train_trajectories");
    for r in 0..3 {
        assert!(dir
            .join(format!("train_trajectories.pt.iteration3_rank_{r}"))
            .is_file());
    }
    assert!(dir.join("train_trajectories.pt.iteration3").is_file());
    // The rollouts asked for the model run.sh left, and rl-node published iteration 3's.
    let first = argv(&w.call("rollout.py", 1, 3, Some("rollout_train")));
    assert!(first.contains(&format!("policy_config.base_model={}", model.display())));
    assert!(!w.log.join("rollouts/iter-0001").exists());
    assert_eq!(
        fs::read_to_string(w.log.join("models/LATEST"))
            .unwrap()
            .trim(),
        "iter-0003"
    );
}

/// run.sh kept one model (model.pt, replaced every iteration); 100+ GB per checkpoint for
/// an 8B model with its optimizer state. The example keeps the newest one, and during a
/// hand-off the one still served: after three iterations, iter-0002 and iter-0003.
#[test]
fn the_example_keeps_one_model_as_run_sh_did() {
    let w = webgym_cluster(6);
    let mut nodes = w.spawn(&[], &[("RL_NODE_CLUSTER_ITERATIONS", "3".into())]);
    for n in nodes.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    let mut models: Vec<String> = fs::read_dir(w.log.join("models"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("iter-") || n.starts_with(".trash-"))
        .collect();
    models.sort();
    assert_eq!(models, ["iter-0002", "iter-0003"]);
}

/// run.sh gave a training past its timeout 30 s between SIGTERM and SIGKILL, for wandb's
/// upload and the checkpoint save (training_utils.sh:150-162); the example's kill-grace
/// does the same. The stand-in needs 15 s after SIGTERM.
#[test]
fn a_training_past_its_timeout_gets_run_sh_s_30_s_grace() {
    let w = webgym_cluster_with(6, false);
    let mut nodes = w.spawn(
        &[],
        &[
            ("WEBGYM_STANDIN_HANG_TRAIN", "0:1:15".into()),
            ("RL_NODE_PHASES_TRAIN_TIMEOUT", "3s".into()),
            ("RL_NODE_CLUSTER_ITERATIONS", "1".into()),
        ],
    );
    for n in nodes.iter_mut() {
        assert_eq!(n.wait(LIMIT), 0, "rank {}: {}", n.rank, n.stderr());
    }
    let done = w
        .log
        .join("train/iter-0001/gen-1/standin-graceful-shutdown-done");
    assert!(
        done.is_file(),
        "the training was killed before its graceful shut-down ended:\n{}",
        nodes[0].stderr()
    );
}

/// A directory run.sh used with `--eval-interval 2` (iterations 1 and 2: train files 1–2,
/// test file 1), continued with eval in every iteration: webgym would write test file 2
/// in iteration 3, where rl-node counts eval number 3. The mismatch is refused before
/// iteration 3's first rollout starts, naming both numbers and the file that sets
/// webgym's (not after the rollout, as "exited 0 but wrote no output").
#[test]
fn a_test_file_number_webgym_would_not_write_is_refused_before_the_rollout() {
    let w = webgym_cluster(1);
    for (split, n) in [("train", 1), ("train", 2), ("test", 1)] {
        let path = w.log.join(format!(
            "{split}_trajectories/{split}_trajectories.pt.iteration{n}"
        ));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let out = Command::new("python3")
            .arg("-c")
            .arg("import pickle,sys; pickle.dump({'trajectories': [{'task_id': 0}], 'metadata': {}}, open(sys.argv[1], 'wb'))")
            .arg(&path)
            .status()
            .unwrap();
        assert!(out.success());
    }
    let mut nodes = w.spawn(
        &[],
        &[
            ("RL_NODE_CLUSTER_FIRST_ITERATION", "3".into()),
            ("RL_NODE_CLUSTER_ITERATIONS", "3".into()),
        ],
    );
    let codes: Vec<i32> = nodes.iter_mut().map(|n| n.wait(LIMIT)).collect();
    let err = nodes[0].stderr();
    assert_eq!(codes[0], 1, "{err}");
    assert!(
        err.contains("would write test file number 2, rl-node expects number 3"),
        "{err}"
    );
    assert!(
        err.contains("test_trajectories.pt.iteration1 (number 1)"),
        "{err}"
    );
    assert!(err.contains("cluster.eval-interval (1)"), "{err}");
    assert!(!err.contains("wrote no output"), "{err}");
    // Refused before any rollout of iteration 3 ran.
    let rollouts: Vec<Value> = w
        .calls()
        .into_iter()
        .filter(|c| {
            c["script"]
                .as_str()
                .is_some_and(|s| s.ends_with("rollout.py"))
        })
        .collect();
    assert!(rollouts.is_empty(), "{rollouts:#?}");
}

/// merge_pickles.py never writes a file webgym's loader skips: whatever its shards are
/// (webgym's torch.save zip archives, torch.save's legacy format, plain pickles), and
/// without torch (this machine has none), the merged file is one `torch.load(…,
/// weights_only=False)` reads, checked with webgym's loader logic. A plain pickle, what
/// `--output-format pickle` wrote, is skipped by it ("Invalid magic number").
#[test]
fn merge_pickles_writes_what_webgyms_loader_reads() {
    let dir = tempfile::tempdir().unwrap();
    let shards: Vec<_> = ["zip", "legacy", "pickle"]
        .iter()
        .map(|kind| dir.path().join(format!("shard.{kind}")))
        .collect();
    let make = r#"
import io, pickle, sys, zipfile
sys.path.insert(0, sys.argv[1])
from merge_pickles import save_torch_legacy
obj = lambda n, r: {'trajectories': [{'task_id': f'{r}-{i}'} for i in range(n)], 'metadata': {'split': 'train'}}
with zipfile.ZipFile(sys.argv[2], 'w') as z:  # torch.save's default layout, no tensors
    z.writestr('archive/data.pkl', pickle.dumps(obj(3, 0), protocol=2))
    z.writestr('archive/byteorder', 'little')
    z.writestr('archive/version', '3\n')
with open(sys.argv[3], 'wb') as f:
    save_torch_legacy(obj(2, 1), f)
with open(sys.argv[4], 'wb') as f:
    pickle.dump(obj(1, 2), f)
"#;
    let merge_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/webgym");
    let st = Command::new("python3")
        .arg("-c")
        .arg(make)
        .arg(merge_dir)
        .args(&shards)
        .status()
        .unwrap();
    assert!(st.success());
    // A plain pickle is what webgym's loader skips.
    assert!(
        webgym_count(&shards[2])
            .unwrap_err()
            .contains("Invalid magic number"),
        "the loader logic must refuse a plain pickle"
    );
    assert_eq!(webgym_count(&shards[0]), Ok(3));
    assert_eq!(webgym_count(&shards[1]), Ok(2));
    let merged = dir.path().join("merged");
    let out = Command::new("python3")
        .arg(format!("{merge_dir}/merge_pickles.py"))
        .arg("--output")
        .arg(&merged)
        .args(&shards)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(webgym_count(&merged), Ok(6));
    // The option that wrote plain pickles is gone.
    let out = Command::new("python3")
        .arg(format!("{merge_dir}/merge_pickles.py"))
        .args(["--output-format", "pickle", "--output"])
        .arg(dir.path().join("other"))
        .arg(&shards[2])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!dir.path().join("other").exists());
}
