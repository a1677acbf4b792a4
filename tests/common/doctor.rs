//! `rl-node doctor` as the doctor tests start it (tests/doctor.rs on local disks and
//! sshfs, tests/doctor_moosefs.rs on MooseFS): one process per node, its output piped for
//! the test to read, and a lookup of one check in its JSON report.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::cluster::BIN;

/// `rl-node doctor --log-path DIR ARGS`, started through `launcher` (a program and its
/// arguments, e.g. `nsenter --net=…`; empty: the binary itself), with the test's own
/// `RL_NODE_CLUSTER_LOG_PATH` and `SLURM_JOB_ID` removed and its output piped.
pub fn command(launcher: &[String], dir: &Path, args: &[&str]) -> Command {
    let mut cmd = match launcher.split_first() {
        Some((prog, rest)) => {
            let mut c = Command::new(prog);
            c.args(rest).arg(BIN);
            c
        }
        None => Command::new(BIN),
    };
    cmd.args(["doctor", "--log-path"])
        .arg(dir)
        .args(args)
        .env_remove("RL_NODE_CLUSTER_LOG_PATH")
        .env_remove("SLURM_JOB_ID")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// [`command`], started.
pub fn spawn(launcher: &[String], dir: &Path, args: &[&str]) -> Child {
    command(launcher, dir, args).spawn().unwrap()
}

/// The check `name` of a `--json` report (panics, showing the report, if it has none).
pub fn check<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check: {v:#}"))
}
