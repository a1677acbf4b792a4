//! README.md's first run, as a new user would follow it: its configuration file, its
//! `rl-node plan` line and its `srun` line, taken from the README itself, run on three
//! nodes of this machine with stand-ins for vLLM, Python and torchrun on `PATH` that do
//! what the README says the user's scripts must do and check what rl-node gives them. If
//! the README's configuration or command lines stop working, this fails.

mod common;
use common::cluster::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn readme() -> String {
    fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap()
}

/// The README's one TOML block.
fn readme_config(readme: &str) -> String {
    let start = readme
        .find("```toml\n")
        .expect("README has a ```toml block")
        + 8;
    let len = readme[start..].find("```").expect("the block ends");
    readme[start..start + len].to_string()
}

/// The arguments after `rl-node` of the README's command line that starts with `first`
/// (a backslash continues it on the next line).
fn readme_command(readme: &str, first: &str) -> Vec<String> {
    let at = readme
        .find(first)
        .unwrap_or_else(|| panic!("README has no line starting {first:?}"));
    let mut line = String::new();
    for l in readme[at..].lines() {
        match l.trim().strip_suffix('\\') {
            Some(l) => line.push_str(l),
            None => {
                line.push_str(l.trim());
                break;
            }
        }
        line.push(' ');
    }
    let words: Vec<String> = line.split_whitespace().map(String::from).collect();
    let i = words
        .iter()
        .position(|w| w == "rl-node")
        .expect("an rl-node command");
    words[i + 1..].to_vec()
}

fn write_exe(path: &Path, script: &str) {
    fs::write(path, script).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// Stand-ins for the README's programs. Each appends its command line to `calls.log`
/// and fails (exit 9) when rl-node did not give it what the README promises.
fn stand_ins(bin: &Path, calls: &Path) {
    let log = calls.display();
    write_exe(
        &bin.join("vllm"),
        &format!(
            r#"#!/bin/sh
echo "vllm $*" >> {log}
[ "$1" = serve ] && [ -f "$2/config.json" ] || {{ echo "vllm: no model at $2" >&2; exit 9; }}
while [ $# -gt 0 ]; do [ "$1" = --port ] && port=$2; shift; done
d=$(mktemp -d) && touch "$d/health"
exec python3 -m http.server --bind 127.0.0.1 --directory "$d" "$port"
"#
        ),
    );
    write_exe(
        &bin.join("torchrun"),
        &format!(
            r#"#!/bin/sh
echo "torchrun $*" >> {log}
[ -n "$NNODES" ] && [ -n "$NODE_RANK" ] && [ -n "$MASTER_ADDR" ] && [ -n "$MASTER_PORT" ] || exit 9
while [ $# -gt 0 ]; do
    case "$1" in --*) shift 2 ;; *) break ;; esac
done
exec python "$@"
"#
        ),
    );
    write_exe(
        &bin.join("python"),
        &format!(
            r#"#!/bin/sh
echo "python $*" >> {log}
script=$1; shift
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2 ;; --rank) rank=$2 ;; --iteration) it=$2 ;; --server) server=$2 ;;
        --data) data=$2 ;; --output-dir) outdir=$2 ;; --model) model=$2 ;;
    esac
    shift
done
case "$script" in
    rollout.py)
        python3 -c "import urllib.request; urllib.request.urlopen('${{server%/v1}}/health')" || exit 9
        echo "{{\"rank\": $rank, \"iteration\": $it, \"reward\": 1}}" > "$out" ;;
    train.py)
        [ -f "$model/config.json" ] || exit 9
        [ "$(wc -l < "$data")" -eq "$NNODES" ] || {{ echo "train.py: $data has not $NNODES lines" >&2; exit 9; }}
        mkdir -p "$outdir/checkpoint-1" && echo '{{"trained": true}}' > "$outdir/checkpoint-1/config.json" ;;
    *) exit 9 ;;
esac
"#
        ),
    );
}

#[test]
fn the_readme_first_run_works_as_written_on_three_nodes() {
    let readme = readme();
    let dir = tempfile::tempdir().unwrap();
    let (bin, model, shared) = (
        dir.path().join("bin"),
        dir.path().join("base-model"),
        dir.path().join("exp1"),
    );
    fs::create_dir_all(&bin).unwrap();
    fs::create_dir_all(&model).unwrap();
    fs::write(model.join("config.json"), "{}").unwrap();
    let calls = dir.path().join("calls.log");
    stand_ins(&bin, &calls);

    // The README's file, with this machine's model, and fast timing.
    let config = readme_config(&readme).replace(
        "/shared/models/Qwen2.5-7B-Instruct",
        model.to_str().unwrap(),
    );
    assert!(config.contains(model.to_str().unwrap()), "{config}");
    let config_path = dir.path().join("rl-node.toml");
    fs::write(&config_path, format!("{config}\n{FAST_TIMING}")).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let here = |args: Vec<String>| -> Vec<String> {
        args.into_iter()
            .map(|a| match a.as_str() {
                "rl-node.toml" => config_path.display().to_string(),
                "/shared/exp1" => shared.display().to_string(),
                "100" => "3".to_string(),
                _ => a,
            })
            .collect()
    };

    // `rl-node plan …` as the README writes it: rank 1's training is torchrun.
    let plan = Command::new(BIN)
        .args(here(readme_command(&readme, "rl-node plan")))
        .env_remove("RL_NODE_LOG_LEVEL")
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&plan.stdout);
    assert!(
        plan.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    assert!(shown.contains("torchrun --nnodes"), "{shown}");
    assert!(!shared.exists(), "plan wrote the shared directory");

    // The `srun` line's rl-node arguments, on three nodes as Slurm would start them; here
    // on one machine, so each server gets a port of its own (a node-local setting).
    let args = here(readme_command(&readme, "srun --nodes=3"));
    assert!(!args.iter().any(|a| a == "--master" || a == "--worker"));
    let mut nodes: Vec<_> = (0..3)
        .map(|rank| {
            let stderr = dir.path().join(format!("rank-{rank}.stderr"));
            let child = Command::new(BIN)
                .args(&args)
                .env("PATH", &path)
                .env("SLURM_NODEID", rank.to_string())
                .env("SLURM_NNODES", "3")
                .env("RL_NODE_SERVER_PORT", free_port().to_string())
                .env_remove("RL_NODE_LOG_LEVEL")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(fs::File::create(&stderr).unwrap())
                .spawn()
                .unwrap();
            NodeProc::from_child(rank, child, stderr)
        })
        .collect();
    for n in &mut nodes {
        let code = n.wait(Duration::from_secs(240));
        assert_eq!(code, 0, "rank {}: {}", n.rank, n.stderr());
    }

    // What the README promises: merged trajectories, published checkpoints, the server
    // restarted on each, the next iteration trained from it, one checkpoint kept.
    let merged = fs::read_to_string(shared.join("rollouts/iter-0003/train.jsonl")).unwrap();
    assert_eq!(merged.lines().count(), 3, "{merged}");
    // keep-last = 1: the newest, and the one served before it, are all that is left.
    let mut kept: Vec<String> = fs::read_dir(shared.join("models"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("iter-"))
        .collect();
    kept.sort();
    assert_eq!(kept, ["iter-0002", "iter-0003"]);
    let log = fs::read_to_string(&calls).unwrap();
    let served = |m: &str| {
        log.lines()
            .filter(|l| l.starts_with(&format!("vllm serve {m} ")))
            .count()
    };
    assert_eq!(served(model.to_str().unwrap()), 3, "{log}");
    let first = shared.join("models/iter-0001");
    assert_eq!(served(first.to_str().unwrap()), 3, "{log}");
    assert_eq!(
        log.lines()
            .filter(|l| l.starts_with("torchrun ")
                && l.contains(&format!("--model {}", first.display())))
            .count(),
        3,
        "iteration 2 trains from iteration 1's checkpoint on every rank:\n{log}"
    );
}
