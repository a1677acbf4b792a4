//! `rl-node plan`: the commands one rank would run in one iteration, with their
//! environment, output path and inputs, rendered exactly as a node renders them
//! (`node::context`) but without joining a cluster, touching the shared directory or
//! running anything, so that a configuration can be checked before GPUs are spent.
//!
//! The phases come from the same walk a node takes (`protocol::walk`); the values a node
//! learns only once it runs (the generation, rank 0's address, the model a hand-off
//! published) are shown as they will be in a fresh run where every step succeeds, and
//! listed as assumptions.

use crate::config::{Config, PhaseCommand};
use crate::error::{Ending, Failure};
use crate::layout::Layout;
use crate::node::context::{self, CommandInputs};
use crate::protocol::walk::{self, Barrier, IterationWalk, Split, Step, WalkConfig};
use crate::protocol::Phase;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The generation a fresh run forms.
const FRESH_GEN: u64 = 1;

/// The `phase` of the server that serves the iteration, started before it.
const BEFORE: &str = "before-iteration";

/// What the user asked for.
pub(crate) struct Request {
    pub iteration: u64,
    pub rank: u32,
    pub phase: Option<String>,
    pub json: bool,
}

#[derive(Serialize)]
pub(crate) struct Plan {
    rank: u32,
    num_nodes: u32,
    iteration: u64,
    log_path: String,
    /// Values a node learns only at run time, as shown here.
    assumed: Vec<Assumed>,
    pub(crate) steps: Vec<Planned>,
}

#[derive(Serialize)]
struct Assumed {
    name: String,
    value: String,
    why: String,
}

#[derive(Serialize, Default)]
pub(crate) struct Planned {
    /// The rl-node phase it runs in (`train-rollout`, `training`, ...).
    pub(crate) phase: String,
    /// The configuration's section (`phases.rollout`, `server`, ...).
    pub(crate) config: String,
    /// The rendered command line; `None` for work rl-node does itself.
    pub(crate) command: Option<String>,
    /// What the command gets beyond rl-node's own environment, in the order it is set.
    pub(crate) env: Vec<EnvVar>,
    /// rl-node sets none: commands run in the node's working directory.
    pub(crate) cwd: Option<String>,
    /// The path the command must write (`{output}`).
    pub(crate) output: Option<String>,
    /// The files it reads that rl-node names.
    pub(crate) reads: Vec<String>,
    pub(crate) notes: Vec<String>,
    /// The placeholders the command uses that render empty here.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) empty: Vec<String>,
}

#[derive(Serialize)]
pub(crate) struct EnvVar {
    pub(crate) name: String,
    pub(crate) value: String,
}

/// Print the plan of `req` for the configuration `cfg`.
pub(crate) fn main(cfg: &Config, req: Request) -> Result<Ending, Failure> {
    let plan = build(cfg, &req)?;
    if req.json {
        crate::outln!("{}", serde_json::to_string_pretty(&plan).expect("json"));
    } else {
        crate::out!("{}", render(&plan));
    }
    Ok(Ending::Done)
}

fn check(cfg: &Config, req: &Request) -> Result<(), Failure> {
    let n = cfg.cluster.num_nodes;
    if req.rank >= n {
        return Err(Failure::usage(
            format!(
                "--rank {} is out of range: the cluster has {n} nodes (ranks 0 to {})",
                req.rank,
                n.saturating_sub(1)
            ),
            Some("pass a rank below --num-nodes (cluster.num-nodes)".into()),
        ));
    }
    if req.iteration == 0 {
        return Err(Failure::usage(
            "--iteration 0: iterations count from 1",
            None,
        ));
    }
    if let Some(p) = &req.phase {
        if !crate::config::COMMANDS.contains(&p.as_str()) {
            return Err(Failure::usage(
                format!(
                    "--phase {p}: unknown phase; known: {}",
                    crate::config::COMMANDS.join(", ")
                ),
                None,
            ));
        }
    }
    Ok(())
}

/// The values a node learns at run time, as a fresh run would have them.
struct RunTime {
    master_addr: String,
    nproc_per_node: u32,
    /// The model this iteration's rollouts and training start from.
    model: String,
    run_id: String,
    assumed: Vec<Assumed>,
    /// Every rank: a plan assumes no node is lost.
    live: Vec<u32>,
}

/// Whether this cluster trains and hands off, so that each iteration publishes the model
/// the next one uses (when its training succeeds).
fn publishes(cfg: &Config) -> bool {
    cfg.phases.train.as_phase().is_set()
        && cfg.cluster.rl_phase != crate::protocol::phase::RlPhase::Rollout
}

fn run_time(cfg: &Config, layout: &Layout, iteration: u64) -> RunTime {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let (master_addr, addr_why) = match cfg.cluster.master_addr.as_str() {
        "" => (
            host,
            "rank 0's host name (cluster.master-addr is empty); this host's name is shown"
                .to_string(),
        ),
        "ip" => (
            context::first_ip_address().unwrap_or(host),
            "rank 0's first IP address (cluster.master-addr = \"ip\"); this host's is shown".into(),
        ),
        a => (a.to_string(), "cluster.master-addr".into()),
    };
    let (nproc_per_node, nproc_why) = context::nproc_per_node(&cfg.cluster.gpus_per_node);
    let (model, model_why) = if iteration == 1 || !publishes(cfg) {
        (
            cfg.cluster.model.clone(),
            "cluster.model: no checkpoint published yet in a fresh run".to_string(),
        )
    } else {
        let m = layout
            .models()
            .join(crate::shards::naming::iter_dir(iteration - 1));
        (
            m.display().to_string(),
            format!("the checkpoint iteration {} publishes when every earlier training succeeds (else the newest published one, or cluster.model)", iteration - 1),
        )
    };
    // A restart keeps the run's id; a fresh run draws one at its start.
    let (run_id, run_why) =
        match crate::store::fs::read_json::<crate::protocol::ClusterRecord>(&layout.cluster()) {
            Ok(Some(c)) => (
                c.run_id,
                "the run in --log-path (a restart keeps it)".to_string(),
            ),
            _ => (
                "RUN_ID".to_string(),
                "a fresh run draws its id when it starts; a stand-in is shown".to_string(),
            ),
        };
    let assumed = vec![
        Assumed {
            name: "run_id".into(),
            value: run_id.clone(),
            why: run_why,
        },
        Assumed {
            name: "gen".into(),
            value: FRESH_GEN.to_string(),
            why: "the generation of a fresh run (a restart forms the next one)".into(),
        },
        Assumed {
            name: "master_addr".into(),
            value: master_addr.clone(),
            why: addr_why,
        },
        Assumed {
            name: "nproc_per_node".into(),
            value: nproc_per_node.to_string(),
            why: format!("{nproc_why}, on this host"),
        },
        Assumed {
            name: "model".into(),
            value: model.clone(),
            why: model_why,
        },
    ];
    RunTime {
        master_addr,
        nproc_per_node,
        model,
        run_id,
        assumed,
        live: (0..cfg.cluster.num_nodes).collect(),
    }
}

pub(crate) fn build(cfg: &Config, req: &Request) -> Result<Plan, Failure> {
    check(cfg, req)?;
    let layout = Layout::new(cfg.log_path())
        .with_naming(cfg.naming())
        .with_cluster(cfg.pipeline_cluster());
    let rt = run_time(cfg, &layout, req.iteration);
    let p = Planner {
        cfg,
        layout: &layout,
        rank: req.rank,
        iteration: req.iteration,
        rt: &rt,
    };
    let mut steps = Vec::new();
    let pipelined = cfg.staleness().is_some();
    // As the node: an update-only cluster starts no server before its iterations, and a
    // pipelined one starts it on the model its staleness rule chooses.
    let serves = cfg.cluster.rl_phase != crate::protocol::phase::RlPhase::Update;
    if !cfg.server.command.trim().is_empty() && serves {
        // Started by the node before its first iteration (as iteration 0), else by the
        // previous iteration's restart-server phase: its values are that iteration's.
        let mut s = p.server(Path::new(&rt.model), req.iteration - 1);
        s.phase = BEFORE.into();
        s.notes.push(if req.iteration == 1 {
            "serves this iteration: started when the node starts, before iteration 1".into()
        } else {
            format!(
                "serves this iteration: started after iteration {}'s hand-off",
                req.iteration - 1
            )
        });
        if pipelined {
            s.notes.push("pipelined run: started on the model pipeline.model chooses for this iteration, shown here as the model above".into());
        }
        steps.push(s);
    }
    steps.extend(p.walk());
    if let Some(only) = &req.phase {
        steps.retain(|s| s.config.rsplit('.').next() == Some(only.as_str()));
    }
    Ok(Plan {
        rank: req.rank,
        num_nodes: cfg.cluster.num_nodes,
        iteration: req.iteration,
        log_path: layout.root().display().to_string(),
        assumed: rt.assumed,
        steps,
    })
}

/// A command line, its environment, and the placeholders it uses that render empty.
type Rendered = (String, Vec<EnvVar>, Vec<String>);

struct Planner<'a> {
    cfg: &'a Config,
    layout: &'a Layout,
    rank: u32,
    iteration: u64,
    rt: &'a RunTime,
}

impl Planner<'_> {
    /// The node's walk of the iteration, with rank 0's eval decision and a training that
    /// succeeds everywhere.
    fn walk(&self) -> Vec<Planned> {
        let cfg = self.cfg;
        let wc = WalkConfig {
            rl_phase: cfg.cluster.rl_phase,
            split: cfg.cluster.rollout_split,
            rank_0: self.rank == 0,
            prepare: cfg.phases.prepare.is_set(),
            iterations: cfg.cluster.iterations,
        };
        let eval = walk::eval_decision(
            cfg.cluster.rollout_split,
            self.iteration,
            cfg.cluster.eval_interval,
        );
        let mut w = IterationWalk::new(wc, self.iteration, Default::default());
        let mut phase = Phase::SyncStart;
        let mut out = Vec::new();
        while let Some(step) = w.next_step() {
            let planned = match step {
                Step::Enter(p) => {
                    phase = p;
                    None
                }
                Step::Barrier(Barrier::FilesReady) => {
                    w.eval_decided(eval);
                    None
                }
                Step::Barrier(Barrier::TrainingComplete) => {
                    w.training_released(None);
                    None
                }
                Step::Rollout(split) => self.rollout(split),
                Step::Aggregate(split) => Some(self.aggregate(split)),
                Step::Prepare => Some(self.command(
                    "prepare",
                    &cfg.phases.prepare,
                    None,
                    &self.layout.prepared_partial(self.iteration, FRESH_GEN),
                    false,
                )),
                Step::Train { .. } => self.train(),
                Step::Handoff => Some(self.handoff()),
                Step::RestartServer { last } => self.restart_server(last),
                _ => None,
            };
            if let Some(mut p) = planned {
                p.phase = phase.name().to_string();
                out.push(p);
            }
        }
        out
    }

    fn inputs<'b>(
        &'b self,
        phase: &'b str,
        split: Option<&'b str>,
        output: &'b Path,
        model: &'b str,
        extra: &'b BTreeMap<&'static str, String>,
    ) -> CommandInputs<'b> {
        CommandInputs {
            cfg: self.cfg,
            layout: self.layout,
            rank: self.rank,
            live: &self.rt.live,
            node_rank: self.rank,
            iteration: self.iteration,
            phase,
            split,
            output,
            model,
            master_addr: &self.rt.master_addr,
            master_port: self.cfg.cluster.master_port,
            gen: FRESH_GEN,
            run_id: &self.rt.run_id,
            nproc_per_node: self.rt.nproc_per_node,
            rollout_model: None,
            extra,
        }
    }

    /// A phase command rendered as the node renders it (`Node::run_command_to_end`).
    fn render(&self, text: &str, inputs: CommandInputs, torchrun: bool) -> Rendered {
        let values = context::placeholder_values(&inputs);
        let template = self.cfg.template(text);
        let command = template.render(&values);
        let mut empty: Vec<String> = template
            .names()
            .into_iter()
            .filter(|n| values.get(n).is_none_or(|v| v.is_empty()))
            .map(str::to_string)
            .collect();
        empty.sort();
        empty.dedup();
        let mut env = context::command_env(self.cfg, &values);
        if torchrun {
            env.extend(context::torchrun_env(&values));
        }
        let env = env
            .into_iter()
            .map(|(name, value)| EnvVar { name, value })
            .collect();
        (command, env, empty)
    }

    fn command(
        &self,
        phase: &str,
        pc: &PhaseCommand,
        split: Option<&str>,
        output: &Path,
        torchrun: bool,
    ) -> Planned {
        self.command_with(phase, pc, split, output, torchrun, &BTreeMap::new())
    }

    fn command_with(
        &self,
        phase: &str,
        pc: &PhaseCommand,
        split: Option<&str>,
        output: &Path,
        torchrun: bool,
        extra: &BTreeMap<&'static str, String>,
    ) -> Planned {
        let inputs = self.inputs(phase, split, output, &self.rt.model, extra);
        let (command, env, empty) = self.render(&pc.command, inputs, torchrun);
        Planned {
            config: format!("phases.{phase}"),
            command: Some(command),
            env,
            empty,
            output: Some(output.display().to_string()),
            reads: vec![self.rt.model.clone()],
            notes: vec![format!(
                "log: {}; timeout {}",
                self.layout
                    .phase_log(self.iteration, self.rank, phase)
                    .display(),
                humantime::format_duration(pc.timeout)
            )],
            ..Default::default()
        }
    }

    fn rollout(&self, split: Split) -> Option<Planned> {
        let (s, phase, rc) = match split {
            Split::Train => ("train", "rollout", &self.cfg.phases.rollout),
            Split::Eval => ("eval", "eval", &self.cfg.phases.eval),
        };
        let pc = rc.as_phase();
        if !pc.is_set() {
            return None;
        }
        let mut extra = BTreeMap::new();
        let mut notes = Vec::new();
        if rc.workers_wait {
            let ready = self
                .layout
                .gen_dir(FRESH_GEN)
                .join(format!("ready-iter-{:04}-{s}", self.iteration));
            extra.insert("ready_file", ready.display().to_string());
            notes.push(match self.rank {
                0 => format!(
                    "workers start once this command creates {}",
                    ready.display()
                ),
                _ => format!(
                    "starts once rank 0's command created {}{}",
                    ready.display(),
                    match rc.workers_delay.is_zero() {
                        true => String::new(),
                        false => format!(", then {}", humantime::format_duration(rc.workers_delay)),
                    }
                ),
            });
        }
        // A fresh run has no earlier attempt to resume from.
        extra.insert("resume_from", String::new());
        let output = self
            .layout
            .shard_partial_gen(self.iteration, s, self.rank, FRESH_GEN);
        let mut p = self.command_with(phase, &pc, Some(s), &output, false, &extra);
        if rc.workers_wait && self.rank == 0 && !rc.workers_wait_for.trim().is_empty() {
            let inputs = self.inputs(phase, Some(s), Path::new(""), &self.rt.model, &extra);
            let values = context::placeholder_values(&inputs);
            let watched = self.cfg.template(&rc.workers_wait_for).render_raw(&values);
            notes.push(format!(
                "rank 0 releases the workers when {watched} appears"
            ));
        }
        let tasks = match split {
            Split::Train => &self.cfg.tasks.train,
            Split::Eval => &self.cfg.tasks.eval,
        };
        if !tasks.is_empty() {
            notes.push(format!(
                "work is planned from the task file {tasks} (work.strategy {:?}, work.mode {:?}): the command runs per work item as the plan assigns, with its item's values",
                self.cfg.work.strategy, self.cfg.work.mode
            ));
        }
        notes.push(format!(
            "committed as {}",
            self.layout.shard(self.iteration, s, self.rank).display()
        ));
        p.notes.extend(notes);
        Some(p)
    }

    /// Rank 0's merge: rl-node's own, or the merge command it runs over the shards.
    fn aggregate(&self, split: Split) -> Planned {
        let s = split.name();
        let pc = &self.cfg.phases.aggregate;
        if pc.is_set() {
            let out = self.layout.aggregated_partial(self.iteration, s, FRESH_GEN);
            let mut p = self.command("aggregate", pc, Some(s), &out, false);
            p.reads = self.shards(s);
            return p;
        }
        let a = &self.cfg.aggregate;
        let how = if a.format == "command" {
            format!(
                "aggregate.command merges them ({{inputs}}: the committed rank files; {{output}}: a temporary name beside the merged file): {}",
                a.command
            )
        } else {
            format!(
                "rl-node merges them itself (aggregate.format {:?})",
                a.format
            )
        };
        Planned {
            config: "aggregate".into(),
            output: Some(
                self.layout
                    .aggregated(self.iteration, s)
                    .display()
                    .to_string(),
            ),
            reads: self.shards(s),
            notes: vec![how],
            ..Default::default()
        }
    }

    fn shards(&self, split: &str) -> Vec<String> {
        (0..self.cfg.cluster.num_nodes)
            .map(|r| {
                self.layout
                    .shard(self.iteration, split, r)
                    .display()
                    .to_string()
            })
            .collect()
    }

    fn train(&self) -> Option<Planned> {
        let tc = &self.cfg.phases.train;
        let pc = tc.as_phase();
        if !pc.is_set() {
            return None;
        }
        let out = self.layout.train_output(self.iteration, FRESH_GEN);
        let mut p = self.command("train", &pc, None, &out, true);
        p.reads.push(
            self.layout
                .aggregated(self.iteration, "train")
                .display()
                .to_string(),
        );
        Some(p)
    }

    fn handoff(&self) -> Planned {
        let h = &self.cfg.phases.handoff;
        let out = self.layout.train_output(self.iteration, FRESH_GEN);
        let mut p = if h.command.trim().is_empty() {
            Planned {
                config: "phases.handoff".into(),
                reads: vec![out.display().to_string()],
                ..Default::default()
            }
        } else {
            self.command("handoff", &h.as_phase(), None, &out, false)
        };
        p.notes.push(format!(
            "rl-node publishes {} (phases.handoff.pick {:?}) as {} and points models/LATEST at it",
            out.display(),
            h.pick,
            self.published().display()
        ));
        p
    }

    /// The checkpoint this iteration's hand-off publishes.
    fn published(&self) -> PathBuf {
        self.layout
            .models()
            .join(crate::shards::naming::iter_dir(self.iteration))
    }

    fn restart_server(&self, last: bool) -> Option<Planned> {
        if self.cfg.server.command.trim().is_empty() {
            return None;
        }
        if self.cfg.staleness().is_some() {
            return Some(Planned {
                config: "server".into(),
                notes: vec!["pipelined run: the rollout cluster restarts its server on the model pipeline.model chooses at the next iteration's start".into()],
                ..Default::default()
            });
        }
        if last {
            return Some(Planned {
                config: "server".into(),
                notes: vec![
                    "the last planned iteration (cluster.iterations): the server is not restarted"
                        .into(),
                ],
                ..Default::default()
            });
        }
        let model = if publishes(self.cfg) {
            self.published()
        } else {
            PathBuf::from(&self.rt.model)
        };
        let mut s = self.server(&model, self.iteration);
        s.notes.push("serves the next iteration".into());
        Some(s)
    }

    /// The inference server's command (`Node::start_server`) as started in `iteration`:
    /// `{output}` and `{model}` are the model it serves.
    fn server(&self, model: &Path, iteration: u64) -> Planned {
        let m = model.display().to_string();
        let extra = BTreeMap::new();
        let inputs = CommandInputs {
            iteration,
            ..self.inputs("server", None, model, &m, &extra)
        };
        let (command, env, empty) = self.render(&self.cfg.server.command, inputs, false);
        let log = self.layout.phase_log(iteration, self.rank, "server");
        Planned {
            config: "server".into(),
            command: Some(command),
            env,
            empty,
            reads: vec![m.clone()],
            notes: vec![format!("log: {}", log.display())],
            ..Default::default()
        }
    }
}

/// The plan as plain text for people.
fn render(p: &Plan) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rl-node plan: rank {} of {}, iteration {}, shared directory {}\n(no command was run, nothing was written)\n",
        p.rank, p.num_nodes, p.iteration, p.log_path
    );
    let _ = writeln!(s, "Values known only at run time, as in a fresh run:");
    for a in &p.assumed {
        let _ = writeln!(s, "  {} = {}  ({})", a.name, a.value, a.why);
    }
    if p.steps.is_empty() {
        let _ = writeln!(s, "\nThis rank runs no command in this iteration.");
    }
    for (i, st) in p.steps.iter().enumerate() {
        let phase = match st.phase.as_str() {
            BEFORE => "before the iteration".to_string(),
            ph => format!("phase {ph}"),
        };
        let _ = writeln!(s, "\n{}. {} [{}]", i + 1, phase, st.config);
        match &st.command {
            Some(c) => {
                let _ = writeln!(s, "   command: {c}");
            }
            None => {
                let _ = writeln!(s, "   no command: rl-node does this itself");
            }
        }
        let _ = writeln!(
            s,
            "   working directory: {}",
            st.cwd.as_deref().unwrap_or("the node's own")
        );
        if let Some(o) = &st.output {
            let _ = writeln!(s, "   writes: {o}");
        }
        for r in &st.reads {
            let _ = writeln!(s, "   reads: {r}");
        }
        for n in &st.notes {
            let _ = writeln!(s, "   note: {n}");
        }
        if !st.env.is_empty() {
            let _ = writeln!(s, "   environment:");
            for e in &st.env {
                let _ = writeln!(s, "     {}={}", e.name, e.value);
            }
        }
    }
    s
}
