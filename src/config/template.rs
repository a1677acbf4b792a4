//! Command templates: `{placeholder}` substitution for phase and server commands.
//!
//! Commands are shell text, so braces also appear in shell syntax (`${HOME}`,
//! `{a,b}` globs). Only a lower-case `{name}` that is not preceded by `$` is a
//! placeholder; `{{` and `}}` are literal braces. An unknown lower-case name is an error at
//! start-up, so a typo never reaches a cluster run. The text is read by the crate's one
//! template reader ([`crate::template`], shell braces); this module adds the names, the
//! messages and the shell quoting.

use crate::template::{self as engine, braced_list, shell_word, Braces, Dialect};
use std::collections::BTreeMap;

pub use crate::process::OWNER_ENV;
/// The variables torchrun's env:// rendezvous (and llamafactory-cli) expect.
pub const TORCHRUN_ENV: &[(&str, &str, &str)] = &[
    (
        "NNODES",
        "num_live",
        "number of nodes training (num-nodes, less those elastic mode dropped)",
    ),
    (
        "NODE_RANK",
        "node_rank",
        "this node's position among them (its rank while none is dropped)",
    ),
    ("MASTER_ADDR", "master_addr", "rank 0's published address"),
    ("MASTER_PORT", "master_port", "cluster.master-port"),
    (
        "NPROC_PER_NODE",
        "nproc_per_node",
        "processes per node (cluster.gpus-per-node)",
    ),
];

/// Marks the node process and names its link: `<supervisor pid>:<pipe fd>`. The node
/// removes it from its environment at start, so no command inherits it.
pub const SUPERVISOR_ENV: &str = "RL_NODE_SUPERVISOR";

/// Every placeholder, with the environment variable that carries the same value and a
/// description. docs/commands.md is written from this table.
pub const PLACEHOLDERS: &[(&str, &str, &str)] = &[
    ("rank", "RL_NODE_RANK", "this node's rank (0 = master)"),
    ("num_nodes", "RL_NODE_NUM_NODES", "number of nodes"),
    (
        "num_live",
        "RL_NODE_NUM_LIVE",
        "number of live nodes: num-nodes, less the ranks elastic mode (cluster.min-nodes) dropped",
    ),
    (
        "live_ranks",
        "RL_NODE_LIVE_RANKS",
        "the live ranks, comma-separated (`0,1,3`)",
    ),
    (
        "node_rank",
        "RL_NODE_NODE_RANK",
        "this node's position among the live ranks (NODE_RANK for torchrun; its rank while none is dropped)",
    ),
    (
        "iteration",
        "RL_NODE_ITERATION",
        "current iteration, from 1",
    ),
    (
        "split",
        "RL_NODE_SPLIT",
        "`train` or `eval` (rollout/eval phases)",
    ),
    (
        "phase",
        "RL_NODE_PHASE",
        "phase name, e.g. `rollout`, `train`",
    ),
    (
        "log_path",
        "RL_NODE_LOG_PATH",
        "the shared directory (--log-path)",
    ),
    ("data_path", "RL_NODE_DATA_PATH", "--data-path"),
    (
        "output",
        "RL_NODE_OUTPUT",
        "the file or directory this phase must write",
    ),
    (
        "trajectories",
        "RL_NODE_TRAJECTORIES",
        "this iteration's aggregated train trajectories",
    ),
    (
        "model",
        "RL_NODE_MODEL",
        "the current model (cluster.model, then each hand-off)",
    ),
    (
        "master_addr",
        "RL_NODE_MASTER_ADDR",
        "rank 0's address, as published in the cluster record",
    ),
    ("master_port", "RL_NODE_MASTER_PORT", "cluster.master-port"),
    (
        "ready_file",
        "RL_NODE_READY_FILE",
        "rollout/eval with workers-wait: the file rank 0's command creates to let the workers start",
    ),
    (
        "resume_from",
        "RL_NODE_RESUME_FROM",
        "per-rank rollout/eval: the newest earlier attempt's partial output of this rank, split and iteration, or empty",
    ),
    (
        "extra_args",
        "RL_NODE_EXTRA_ARGS",
        "cluster.extra-args: the arguments after `--`, shell-quoted",
    ),
    (
        "nproc_per_node",
        "RL_NODE_NPROC_PER_NODE",
        "training processes on this node (cluster.gpus-per-node; \"auto\": its GPUs)",
    ),
    (
        "split_iteration",
        "RL_NODE_SPLIT_ITERATION",
        "the how-many-th rollout of this split: the iteration for train, the number of evals so far for eval",
    ),
    (
        "checkpoint_name",
        "RL_NODE_CHECKPOINT_NAME",
        "{model} relative to the shared directory (`models/iter-NNNN`) when it is a checkpoint rl-node published, empty while it is cluster.model",
    ),
    (
        "model_version",
        "RL_NODE_MODEL_VERSION",
        "the iteration whose training produced {model} (0: the base model); in a pipelined run, the version the staleness rule gives this iteration",
    ),
    (
        "staleness",
        "RL_NODE_STALENESS",
        "how many model versions {model} lags this iteration's rollout (pipelined runs; 0 otherwise)",
    ),
    (
        "train_output",
        "RL_NODE_TRAIN_OUTPUT",
        "the directory this iteration's training writes (the train phase's {output})",
    ),
    ("server_port", "RL_NODE_SERVER_PORT", "server.port"),
    ("rank_weight", "RL_NODE_RANK_WEIGHT", "this rank's weight"),
    ("total_weight", "RL_NODE_TOTAL_WEIGHT", "sum of all weights"),
    (
        "rank_weights",
        "RL_NODE_RANK_WEIGHTS",
        "all weights, comma-separated (`2,1,1`)",
    ),
    (
        "gen",
        "RL_NODE_GEN",
        "the cluster generation (grows at every start)",
    ),
    (
        "run_id",
        "RL_NODE_RUN_ID",
        "the run's id (the same across restarts; --fresh starts a new one), as metrics.jsonl's `run`",
    ),
    (
        "job",
        "RL_NODE_JOB",
        "the batch job's id (SLURM_JOB_ID; empty outside a Slurm job)",
    ),
    (
        "tasks",
        "RL_NODE_TASKS",
        "with [tasks]: this rank's task file for the split (JSONL, plan order)",
    ),
    (
        "task_id",
        "RL_NODE_TASK_ID",
        "per-task mode: the item's task id",
    ),
    (
        "task_json",
        "RL_NODE_TASK_JSON",
        "per-task mode: the item's task record (one JSON line)",
    ),
    (
        "sample",
        "RL_NODE_SAMPLE",
        "per-task mode: the item's sample index (0..samples-per-task)",
    ),
    (
        "sample_seed",
        "RL_NODE_SAMPLE_SEED",
        "per-task mode: the item's seed, from (seed, iteration, task id, sample)",
    ),
    (
        "state",
        "RL_NODE_STATE",
        "per-task mode: initial-state index (rotate: a circular index)",
    ),
    (
        "seed",
        "RL_NODE_SEED",
        "the iteration's seed, derived from (work.seed, iteration)",
    ),
    (
        "samples",
        "RL_NODE_SAMPLES",
        "work.samples-per-task",
    ),
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("unknown placeholder `{{{name}}}`; known: {known}")]
    Unknown { name: String, known: String },
    /// An unclosed `{`.
    #[error(transparent)]
    Syntax(#[from] engine::SyntaxError),
    #[error("`{{{name}}}`: placeholders are lower-case; did you mean `{{{lower}}}`?")]
    UpperCase { name: String, lower: String },
}

/// Placeholders that have a value only for one item of a per-task rollout.
pub const PER_TASK: &[&str] = &["task_id", "task_json", "sample", "sample_seed", "state"];

/// The entry of [`PLACEHOLDERS`] called `name`.
fn placeholder(name: &str) -> Option<&'static str> {
    PLACEHOLDERS.iter().map(|(n, _, _)| *n).find(|n| *n == name)
}

/// Phase and server commands (and `[env]` values): shell text with [`PLACEHOLDERS`].
struct CommandLine;

impl Dialect for CommandLine {
    type Var = &'static str;
    type Error = TemplateError;
    const BRACES: Braces = Braces::Shell;

    fn var(&self, name: &str) -> Result<&'static str, TemplateError> {
        placeholder(name).ok_or_else(|| TemplateError::Unknown {
            name: name.to_string(),
            known: braced_list(PLACEHOLDERS.iter().map(|(n, _, _)| *n)),
        })
    }

    /// `{RANK}` is not shell syntax either: a placeholder in the wrong case.
    fn literal_brace(&self, word: Option<&str>) -> Result<(), TemplateError> {
        let Some(name) = word else { return Ok(()) };
        let lower = name.to_ascii_lowercase();
        if !name.is_empty()
            && name != lower
            && name.chars().all(|ch| ch.is_ascii_alphabetic() || ch == '_')
            && placeholder(&lower).is_some()
        {
            return Err(TemplateError::UpperCase {
                name: name.to_string(),
                lower,
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(engine::Template<&'static str>);

impl Template {
    /// The placeholders the template uses.
    pub fn names(&self) -> Vec<&str> {
        self.0.vars().copied().collect()
    }

    pub fn parse(text: &str) -> Result<Template, TemplateError> {
        engine::Template::parse(text, &CommandLine).map(Template)
    }

    /// Substitute values. A value with characters the shell would split or expand is
    /// single-quoted, so paths with spaces stay one word; a [`SHELL_TEXT`] value is
    /// already shell words and goes in as it is.
    pub fn render(&self, values: &BTreeMap<&'static str, String>) -> String {
        self.0.render(|name, out| {
            let v = values.get(name).map(String::as_str).unwrap_or("");
            match SHELL_TEXT.contains(name) {
                true => out.push_str(v),
                false => out.push_str(&shell_word(v)),
            }
        })
    }

    /// Substitute values verbatim (for URLs, not shell text).
    pub fn render_raw(&self, values: &BTreeMap<&'static str, String>) -> String {
        self.0
            .render(|name, out| out.push_str(values.get(name).map(String::as_str).unwrap_or("")))
    }
}

/// Placeholders whose value is shell text, already quoted word by word: `{extra_args}`
/// expands to as many words as arguments were given.
pub const SHELL_TEXT: &[&str] = &["extra_args"];

#[cfg(test)]
mod tests {
    use super::*;

    fn vals() -> BTreeMap<&'static str, String> {
        let mut m = BTreeMap::new();
        m.insert("rank", "2".to_string());
        m.insert("output", "/nfs/my exp/rank-2.jsonl".to_string());
        m
    }

    #[test]
    fn substitutes_and_quotes() {
        let t = Template::parse("run --rank {rank} --out {output}").unwrap();
        assert_eq!(
            t.render(&vals()),
            "run --rank 2 --out '/nfs/my exp/rank-2.jsonl'"
        );
    }

    #[test]
    fn shell_braces_survive() {
        let t = Template::parse("echo ${HOME} {a,b} {{rank}} $RL_NODE_RANK {rank}").unwrap();
        assert_eq!(
            t.render(&vals()),
            "echo ${HOME} {a,b} {rank} $RL_NODE_RANK 2"
        );
    }

    #[test]
    fn unknown_placeholder_is_an_error() {
        let e = Template::parse("python x.py --r {rnak}").unwrap_err();
        assert!(matches!(e, TemplateError::Unknown { ref name, .. } if name == "rnak"));
        assert!(e.to_string().contains("{rank}"));
    }

    #[test]
    fn case_and_brace_mistakes_are_named() {
        let err = |t: &str| Template::parse(t).unwrap_err().to_string();
        assert_eq!(
            err("run {RANK}"),
            "`{RANK}`: placeholders are lower-case; did you mean `{rank}`?"
        );
        assert_eq!(
            err("run {Num_Nodes} {rnak}"),
            "`{Num_Nodes}`: placeholders are lower-case; did you mean `{num_nodes}`?"
        );
        assert_eq!(
            err("run {rank"),
            "unclosed `{` at byte 4; write `{{` for a literal brace"
        );
        assert!(
            err("{nope}").starts_with("unknown placeholder `{nope}`; known: {rank} {num_nodes} ")
        );
        // Shell syntax, or not a placeholder in any case: text.
        for ok in [
            "${RANK}", "{NOPE}", "{{RANK}}", "{a,b", "{}", "}", "{R-ANK}",
        ] {
            let t = Template::parse(ok).unwrap();
            assert!(t.names().is_empty(), "{ok}");
        }
        let t = Template::parse("{rank}{iteration}").unwrap();
        assert_eq!(t.names(), ["rank", "iteration"]);
        assert_eq!(t.render(&vals()), "2''");
    }
}

#[cfg(test)]
mod doc_tests {
    /// docs/commands.md is the one place users read placeholders and variables from.
    #[test]
    fn docs_list_every_placeholder_and_variable() {
        let doc = include_str!("../../docs/commands.md");
        for (name, env, _) in super::PLACEHOLDERS {
            assert!(
                doc.contains(&format!("| `{{{name}}}` | `{env}` |")),
                "docs/commands.md misses {{{name}}} / {env}"
            );
        }
        for (env, _, _) in super::TORCHRUN_ENV {
            assert!(
                doc.contains(&format!("| `{env}` |")),
                "docs/commands.md misses {env}"
            );
        }
        let owner = super::OWNER_ENV;
        assert!(
            doc.contains(&format!("`{owner}=")),
            "docs/commands.md misses {owner}"
        );
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn parsing_never_panics(s in "\\PC*") {
            let _ = Template::parse(&s);
        }

        /// Text with every brace doubled renders back to itself, and a known placeholder
        /// between two such texts is replaced by its (shell-safe) value. (Right after a
        /// `$` it would be shell syntax, `${rank}`, and stay as it is.)
        #[test]
        fn escaped_text_round_trips(a in "([ -~]{0,40}[^$])?", b in "[ -~]{0,40}", v in "[a-z0-9/._-]{1,20}") {
            let esc = |t: &str| t.replace('{', "{{").replace('}', "}}");
            let t = Template::parse(&format!("{}{{rank}}{}", esc(&a), esc(&b))).unwrap();
            let mut vals = BTreeMap::new();
            vals.insert("rank", v.clone());
            prop_assert_eq!(t.render(&vals), format!("{a}{v}{b}"));
        }
    }
}
