//! The environment a command sees. Every placeholder value is also exported as the
//! `RL_NODE_*` variable listed in `config::template::PLACEHOLDERS`; the training command
//! additionally gets the variables torchrun and llamafactory-cli read.

use crate::config::template::PLACEHOLDERS;

/// Set for every command the node starts, to `<node nonce>:<command id>`: descendants
/// inherit it into any process group or session, so the node (and its guardian, after a
/// `kill -9`) can find and stop them (`super::descendants`).
pub const OWNER_ENV: &str = "RL_NODE_OWNER";
use std::collections::BTreeMap;

pub fn env_for(values: &BTreeMap<&'static str, String>) -> Vec<(String, String)> {
    PLACEHOLDERS
        .iter()
        .filter_map(|(name, env, _)| values.get(name).map(|v| (env.to_string(), v.clone())))
        .collect()
}

/// The variables torchrun's env:// rendezvous (and llamafactory-cli) expect.
pub const TORCHRUN_ENV: &[(&str, &str, &str)] = &[
    ("NNODES", "num_nodes", "number of nodes"),
    ("NODE_RANK", "rank", "this node's rank"),
    ("MASTER_ADDR", "master_addr", "rank 0's published address"),
    ("MASTER_PORT", "master_port", "cluster.master-port"),
];

pub fn torchrun_env(values: &BTreeMap<&'static str, String>) -> Vec<(String, String)> {
    TORCHRUN_ENV
        .iter()
        .map(|(env, key, _)| {
            (
                env.to_string(),
                values.get(key).cloned().unwrap_or_default(),
            )
        })
        .collect()
}
