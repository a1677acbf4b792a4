//! The stand-in for every external program of a rehearsal. `rl-node rehearse` puts a
//! directory first on the nodes' `PATH` that holds, for each program the configuration's
//! commands start, a symbolic link to this very binary; run under such a name (and with
//! [`DIR_ENV`] set), `rl-node` records the call and does what the phase expects of the
//! program instead of running it: it writes `{output}` in the configured format, a
//! checkpoint tree for the training on rank 0, the files the training reads that the
//! prepare command would write, or answers health checks on the server port until it is
//! stopped. The real program never runs, so a rehearsal spends no GPU and touches nothing
//! but the rehearsal's own directory.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The rehearsal directory, given to the nodes (and so to every command they run). Not an
/// `RL_NODE_*` name: a node refuses those it does not read.
pub(crate) const DIR_ENV: &str = "RL_REHEARSAL_DIR";
/// The stand-ins' links, in the rehearsal directory.
pub(crate) const BIN: &str = "bin";
/// What the stand-ins record, a JSON line per call.
pub(crate) const LOG: &str = "recorder.jsonl";
/// What rehearse tells the stand-ins ([`Spec`]).
pub(crate) const SPEC: &str = "rehearsal.json";

/// Variables a call's record keeps besides `RL_NODE_*` and the `[env]` keys.
const KEPT_ENV: [&str; 7] = [
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
    "CUDA_VISIBLE_DEVICES",
    "PATH",
];

/// What the stand-ins need to know of the configuration.
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct Spec {
    /// The shard format (`jsonl`, `safetensors`, `torch`, `command`).
    pub format: String,
    /// `phases.handoff.pick`: the checkpoint directory the training writes.
    pub pick: String,
    /// The `[env]` keys, kept in the records.
    pub env_keys: Vec<String>,
    /// Files under the shared directory the training reads that rl-node does not write:
    /// the prepare command's stand-in creates them (empty), as the real one would.
    pub prepared: Vec<String>,
}

/// One call of a stand-in.
#[derive(Serialize, Deserialize, Clone)]
pub(crate) struct Call {
    pub prog: String,
    pub argv: Vec<String>,
    pub cwd: String,
    pub pid: u32,
    pub env: BTreeMap<String, String>,
    /// The absolute paths its arguments name (`/x`, `key=/x`, `--flag=/x`) and whether each
    /// existed when it was called.
    pub paths: Vec<(String, bool)>,
    /// What the stand-in wrote in the program's place.
    pub wrote: Vec<String>,
    /// What it could not do in the program's place.
    pub problems: Vec<String>,
}

impl Call {
    pub fn var(&self, name: &str) -> &str {
        self.env.get(name).map(String::as_str).unwrap_or("")
    }
}

/// Run as a stand-in when this process was started under the name of one (a link in the
/// rehearsal's `bin`); `None` otherwise. The exit code when it was one.
pub(crate) fn intercept() -> Option<i32> {
    let dir = PathBuf::from(std::env::var_os(DIR_ENV)?);
    let argv: Vec<String> = std::env::args().collect();
    let name = Path::new(argv.first()?)
        .file_name()?
        .to_string_lossy()
        .into_owned();
    let own = std::env::current_exe().ok()?;
    if own.file_name().is_some_and(|n| n.to_string_lossy() == name) {
        return None;
    }
    if std::fs::symlink_metadata(dir.join(BIN).join(&name)).is_err() {
        return None;
    }
    Some(stand_in(&dir, name, argv))
}

fn stand_in(dir: &Path, prog: String, argv: Vec<String>) -> i32 {
    let spec: Spec = std::fs::read(dir.join(SPEC))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let env: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with("RL_NODE_") || KEPT_ENV.contains(&k.as_str()) || spec.env_keys.contains(k)
        })
        .collect();
    let paths = argv[1..]
        .iter()
        .filter_map(|a| named_path(a))
        .map(|p| {
            let exists = Path::new(&p).exists();
            (p, exists)
        })
        .collect();
    let mut call = Call {
        prog,
        argv,
        cwd: std::env::current_dir()
            .map(|d| d.display().to_string())
            .unwrap_or_default(),
        pid: std::process::id(),
        env,
        paths,
        wrote: Vec::new(),
        problems: Vec::new(),
    };
    let serve = call.var("RL_NODE_PHASE") == "server";
    if !serve {
        act(&spec, &mut call);
    }
    let line = serde_json::to_string(&call).expect("json") + "\n";
    // One write of one line on an O_APPEND file: the calls of all nodes interleave whole.
    let logged = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(LOG))
        .and_then(|mut f| f.write_all(line.as_bytes()));
    println!(
        "rl-node rehearse: stand-in for `{}` ({} on rank {}): recorded, the program did not run",
        call.prog,
        call.var("RL_NODE_PHASE"),
        call.var("RL_NODE_RANK")
    );
    for p in &call.problems {
        eprintln!("rl-node rehearse: {p}");
    }
    if let Err(e) = logged {
        eprintln!("rl-node rehearse: cannot record the call: {e}");
        return 1;
    }
    if serve {
        return serve_health(call.var("RL_NODE_SERVER_PORT"));
    }
    0
}

/// The absolute path an argument names: `/x`, `key=/x` or `--flag=/x`.
pub(crate) fn named_path(arg: &str) -> Option<String> {
    let value = match arg.split_once('=') {
        Some((k, v)) if !k.contains('/') => v,
        _ => arg,
    };
    let value = value.trim_matches(|c| c == '\'' || c == '"');
    (value.starts_with('/') && value.len() > 1).then(|| value.to_string())
}

/// Write what the phase expects the program to leave.
fn act(spec: &Spec, call: &mut Call) {
    let output = call.var("RL_NODE_OUTPUT").to_string();
    let rank0 = call.var("RL_NODE_RANK") == "0";
    let result = match call.var("RL_NODE_PHASE") {
        "rollout" | "eval" | "aggregate" if !output.is_empty() => {
            shard(&spec.format, call, Path::new(&output))
        }
        "prepare" => prepared(spec, call),
        "train" if rank0 && !output.is_empty() => checkpoint(spec, call, Path::new(&output)),
        _ => Ok(()),
    };
    if let Err(e) = result {
        call.problems.push(format!(
            "the stand-in for {} could not write: {e}",
            call.prog
        ));
    }
}

fn write(call: &mut Call, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, bytes)?;
    call.wrote.push(path.display().to_string());
    Ok(())
}

/// A shard (or merged file) of the configured format.
fn shard(format: &str, call: &mut Call, out: &Path) -> std::io::Result<()> {
    let bytes = match format {
        "safetensors" => tiny_safetensors(),
        "torch" => {
            call.problems.push(
                "the stand-in cannot write torch.save shards (aggregate.format torch): wrote nothing"
                    .into(),
            );
            return Ok(());
        }
        "jsonl" => {
            let record = serde_json::json!({
                "rehearsal": true,
                "rank": call.var("RL_NODE_RANK"),
                "split": call.var("RL_NODE_SPLIT"),
                "iteration": call.var("RL_NODE_ITERATION"),
            });
            format!("{record}\n").into_bytes()
        }
        _ => format!(
            "rl-node rehearsal: {} of rank {} in place of {}\n",
            call.var("RL_NODE_PHASE"),
            call.var("RL_NODE_RANK"),
            call.prog
        )
        .into_bytes(),
    };
    write(call, out, &bytes)
}

/// The prepare command's files: `{output}` when it names it, and the files the training
/// reads that only it can have written.
fn prepared(spec: &Spec, call: &mut Call) -> std::io::Result<()> {
    let output = call.var("RL_NODE_OUTPUT").to_string();
    if !output.is_empty() && call.argv.iter().any(|a| a.contains(&output)) {
        write(
            call,
            Path::new(&output),
            b"rl-node rehearsal: prepared data\n",
        )?;
    }
    for f in &spec.prepared {
        if !Path::new(f).exists() {
            write(call, Path::new(f), b"")?;
        }
    }
    Ok(())
}

/// A checkpoint tree in the training output, named like `phases.handoff.pick`.
fn checkpoint(spec: &Spec, call: &mut Call, out: &Path) -> std::io::Result<()> {
    let dir = match spec.pick.trim() {
        "" => out.to_path_buf(),
        pick => out.join(pick.replace(['*', '?'], "1").replace(['[', ']'], "")),
    };
    write(
        call,
        &dir.join("config.json"),
        b"{\"rl_node_rehearsal\": true}\n",
    )?;
    write(call, &dir.join("model.safetensors"), &tiny_safetensors())?;
    write(
        call,
        &dir.join("trainer_state.json"),
        b"{\"global_step\": 1}\n",
    )
}

fn tiny_safetensors() -> Vec<u8> {
    let data = [0u8; 8];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data)
        .expect("two f32");
    safetensors::serialize([("rehearsal", view)], None).expect("serialize")
}

/// Answer every request with 200 on `port` until stopped (the node stops the server with
/// a signal to its process group).
fn serve_health(port: &str) -> i32 {
    let server = match tiny_http::Server::http(format!("0.0.0.0:{port}")) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rl-node rehearse: the server stand-in cannot listen on port {port}: {e}");
            return 1;
        }
    };
    for request in server.incoming_requests() {
        let _ = request.respond(tiny_http::Response::from_string("{\"status\": \"ok\"}"));
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_name_paths_as_values_too() {
        assert_eq!(named_path("/a/b").as_deref(), Some("/a/b"));
        assert_eq!(named_path("save_path=/log").as_deref(), Some("/log"));
        assert_eq!(named_path("--out=/x").as_deref(), Some("/x"));
        assert_eq!(named_path("+env_config.x='/q'").as_deref(), Some("/q"));
        assert_eq!(named_path("policy_config.base_model=Qwen/Qwen3"), None);
        assert_eq!(named_path("/"), None);
        assert_eq!(named_path("http://localhost:8999"), None);
    }
}
