//! What a person (or a script) sees about a run, read from the files alone.

pub mod doctor;
mod doctor_caches;
mod doctor_dirs;
pub mod doctor_nodes;
mod doctor_report;
pub mod eventlog;
pub mod live;
pub mod members;
pub mod recover;
pub mod repair;
pub mod status;
pub mod timeline;

use crate::layout::Layout;
use crate::protocol::ClusterRecord;

/// The shared directory a command that reads a run (`status`, `recover`, `timeline`) looks
/// at: `--log-path`, else `RL_NODE_CLUSTER_LOG_PATH`. A usage error naming `command` when
/// neither is set, and one when the path is a symbolic-link loop ([`check_log_path`]).
pub(crate) fn log_path_of(
    command: &str,
    log_path: Option<String>,
) -> Result<std::path::PathBuf, crate::error::Failure> {
    let path = log_path
        .or_else(|| std::env::var(crate::config::env_name("cluster.log-path")).ok())
        .ok_or_else(|| {
            crate::error::Failure::usage(format!("rl-node {command} needs --log-path DIR"), None)
        })?;
    let path = std::path::PathBuf::from(path);
    check_log_path(&path)?;
    Ok(path)
}

/// `--log-path` refused when it cannot be resolved for a symbolic-link loop: otherwise the
/// loop shows as a damaged or missing state file, which sends the user the wrong way.
pub(crate) fn check_log_path(path: &std::path::Path) -> Result<(), crate::error::Failure> {
    match crate::layout::symlink_loop(path) {
        Some(why) => Err(crate::error::Failure::usage(
            format!("--log-path {why}"),
            Some("fix the link so that it leads to the shared directory".into()),
        )),
        None => Ok(()),
    }
}

/// The run's cluster record, or a message saying there is no run at `layout`'s path, or
/// which state file is damaged and what to do (`rl-node recover`). The run's own
/// `[limits]` become this process's ([`use_run_limits`]).
pub(crate) fn read_cluster(layout: &Layout) -> Result<ClusterRecord, String> {
    match crate::state::read_cluster(&crate::store::Fs, layout) {
        Ok(Some(c)) => {
            use_run_limits(&c);
            Ok(c)
        }
        Ok(None) => Err(format!(
            "no rl-node run in {} (no {})",
            layout.root().display(),
            layout.cluster().display()
        )),
        Err(e) => Err(state_message(layout, &e)),
    }
}

/// The run's own `[limits]` (from its cluster record `c`) become this process's, so a view
/// reads what the run's nodes read (a record without valid ones leaves the defaults).
pub(crate) fn use_run_limits(c: &ClusterRecord) {
    let mib = |key: &str| {
        c.config["limits"][key]
            .as_u64()
            .filter(|m| crate::config::Limits::RANGE_MIB.contains(m))
    };
    if let (Some(journal), Some(manifest)) = (mib("journal-mib"), mib("manifest-mib")) {
        crate::store::ReadLimit::configure(journal, manifest);
    }
}

/// A state error with its hint, for `status` and `recover`.
pub(crate) fn state_message(layout: &Layout, e: &crate::state::StateError) -> String {
    format!("{e}\nhint: {}", e.hint(layout.root()))
}
