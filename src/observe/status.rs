//! `rl-node status`: the state of a run from the shared directory alone, so it works
//! while nodes run, after they stopped, and with every node dead. The text and the JSON
//! (`--json`, a versioned schema scripts rely on: docs/status.md) are two renderings of
//! one judgement ([`assess`]), so they cannot disagree about a run or a rank.

use crate::layout::Layout;
use crate::protocol::{AbortInfo, ClusterRecord, NodeState, ObservedFile, RankRecord};
use crate::store;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

/// The version of `status --json`'s schema (docs/status.md): raised when a key changes
/// meaning or goes away, not when one is added.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Serialize)]
pub struct RankStatus {
    pub rank: u32,
    /// What the text's STATE column says: the record's state, or `dead` when `status`
    /// found its process gone, or `missing` without a record.
    pub state: String,
    /// The state the rank last wrote in its record (`None`: no record).
    pub record_state: Option<NodeState>,
    pub host: String,
    pub pid: u32,
    pub iteration: u64,
    /// The phase number (docs/phases.md) and its name.
    pub phase: Option<u8>,
    pub phase_name: Option<&'static str>,
    /// This rank's failure stopped the generation (the abort's culprit).
    pub culprit: bool,
    /// The culprit that stopped this rank (which failed because of it), as the text says
    /// "stopped by rank N"; in a pipelined run it may be the other cluster's.
    pub stopped_by: Option<String>,
    /// Work done in the current phase, e.g. "37/120 train items".
    pub progress: Option<String>,
    /// Heartbeat age as the rank's observer saw it (rank 0 observes workers, rank 1
    /// observes rank 0), at the observer's last write.
    pub heartbeat_age_ms: Option<u64>,
    pub last_write: String,
    pub waiting_at: Option<String>,
    /// Whether the process holding the rank is alive, from evidence `status` checked
    /// itself (see [`judge`]); `None` until judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<Process>,
    /// Why a process that tried to take this (still vacant) rank was refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The newest hang report the rank wrote, relative to the log path
    /// (docs/forensics.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hang_report: Option<String>,
}

impl RankStatus {
    /// The phase as the text shows it: `10 (training)`.
    pub fn phase_label(&self) -> Option<String> {
        Some(format!("{} ({})", self.phase?, self.phase_name?))
    }
}

/// What `status` could check about a rank's process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Process {
    /// Its record says it finished or stopped (done, failed, left, vacant).
    Ended,
    /// On this machine, and the kernel has it; or elsewhere, and its heartbeat advanced.
    Alive,
    /// On this machine and gone (or its pid now belongs to another process); or elsewhere
    /// and its heartbeat stood still for the whole watch.
    Gone,
    /// No record to judge by.
    Unknown,
}

/// An iteration whose training failed on some rank: no checkpoint was handed off.
#[derive(Debug, Serialize)]
pub struct TrainingFailure {
    pub iteration: u64,
    /// `training failed on rank(s) 1 (exit code 3); kept model iter-0002`.
    pub outcome: String,
}

/// The run's state, as the text's `state:` line begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    /// The first generation is forming: some rank has not joined yet.
    Starting,
    /// A later generation is forming after a restart: some rank has not joined yet.
    Restarting,
    Running,
    /// A rank's process is gone while others still run.
    Stalled,
    /// Stopped on a failure, or every node is gone: a restart resumes it.
    Stopped,
    Completed,
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub schema_version: u32,
    pub run_id: String,
    pub generation: u64,
    /// `generation` under its schema-0 name, kept for one release.
    pub gen: u64,
    /// The run's state, and the text's `state:` line that explains it.
    pub state: RunState,
    pub state_detail: String,
    /// When `status` read the directory (this machine's clock, for display).
    pub observed_at: String,
    pub num_nodes: u32,
    pub started_at: String,
    pub master: String,
    pub previous: Option<String>,
    pub abort: Option<AbortInfo>,
    /// Ranks rank 0 is waiting for at its current barrier.
    pub waiting_for: Vec<u32>,
    pub ranks: Vec<RankStatus>,
    /// Every start of the cluster: generation, run, when, where, resume iteration, and why
    /// the generation before it ended.
    pub history: Vec<serde_json::Value>,
    /// Iterations whose training failed somewhere and that went on with the model they had
    /// (`phases.train.on-failure = "keep-model"`), from rank 0's journal.
    pub training_failures: Vec<TrainingFailure>,
    /// How long `status` watched heartbeats of ranks on other machines (0: not needed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watched_ms: Option<u64>,
    #[serde(skip)]
    pub heartbeat: Duration,
}

pub fn read(log_path: &Path) -> Result<Status, String> {
    read_layout(&Layout::new(log_path))
}

/// Every rank's record in the cluster's current generation (`None`: missing, or not
/// this run's and generation's).
pub fn read_records(layout: &Layout, c: &ClusterRecord) -> Vec<Option<RankRecord>> {
    (0..c.num_nodes)
        .map(|r| {
            store::fs::read_json::<RankRecord>(&layout.rank_record(c.gen, r))
                .ok()
                .flatten()
                .filter(|rec| rec.belongs_to(&c.run_id, c.gen, r))
        })
        .collect()
}

/// Generation `gen`'s abort: its abort record, else one a rank relayed in its record.
pub fn read_abort(layout: &Layout, gen: u64, records: &[Option<RankRecord>]) -> Option<AbortInfo> {
    store::fs::read_json::<AbortInfo>(&layout.abort(gen))
        .ok()
        .flatten()
        .or_else(|| records.iter().flatten().find_map(|r| r.abort.clone()))
}

/// The status of the cluster whose protocol state `layout` addresses (one cluster of a
/// pipelined run: `Layout::with_cluster`).
pub fn read_layout(layout: &Layout) -> Result<Status, String> {
    let layout = layout.clone();
    let c = super::read_cluster(&layout)?;
    let records = read_records(&layout, &c);
    // Heartbeat ages as rank 0 observes its peers (its own file: every worker, or in a
    // cluster of groups the leaders), and the others' as a rank that reads them observes
    // them (in its record: rank 0's in rank 1's, a group member's in its leader's).
    let by_rank0: Vec<(u32, u64)> = store::fs::read_json::<ObservedFile>(&layout.observed(c.gen))
        .ok()
        .flatten()
        .map(|o| o.ages_ms)
        .unwrap_or_default();
    let observed = |rank: u32| -> Option<u64> {
        let find = |ages: &[(u32, u64)]| ages.iter().find(|(r, _)| *r == rank).map(|(_, ms)| *ms);
        let by_peer = || {
            records
                .iter()
                .enumerate()
                .filter(|(r, _)| *r as u32 != rank)
                .find_map(|(_, rec)| find(&rec.as_ref()?.observed_ms))
        };
        match rank {
            0 => by_peer(),
            _ => find(&by_rank0).or_else(by_peer),
        }
    };
    let abort = read_abort(&layout, c.gen, &records);
    let waiting_for = records
        .first()
        .and_then(|r| r.as_ref())
        .map(|r| r.waiting_for.clone())
        .unwrap_or_default();
    let ranks = records
        .iter()
        .enumerate()
        .map(|(i, rec)| match rec {
            Some(r) => RankStatus {
                rank: i as u32,
                state: format!("{:?}", r.state).to_lowercase(),
                record_state: Some(r.state),
                host: r.host.clone(),
                pid: r.pid,
                iteration: r.iteration,
                phase: r.phase.map(|p| p.number()),
                phase_name: r.phase.map(|p| p.name()),
                culprit: false,
                stopped_by: None,
                progress: r.progress.clone(),
                heartbeat_age_ms: observed(i as u32),
                last_write: r.wall.clone(),
                waiting_at: r
                    .arrived
                    .as_ref()
                    .filter(|m| !records[0].as_ref().is_some_and(|r0| r0.released_at(m.k)))
                    .map(|m| m.name.clone()),
                process: None,
                refused: r.refused.clone().filter(|_| r.state == NodeState::Vacant),
                hang_report: r.hang_report.clone(),
            },
            None => RankStatus {
                rank: i as u32,
                state: "missing".into(),
                record_state: None,
                host: String::new(),
                pid: 0,
                iteration: 0,
                phase: None,
                phase_name: None,
                culprit: false,
                stopped_by: None,
                progress: None,
                heartbeat_age_ms: None,
                last_write: String::new(),
                waiting_at: None,
                process: None,
                refused: None,
                hang_report: None,
            },
        })
        .collect();
    // Strict like every reader of the run's state: a damaged line is named, not skipped.
    let history =
        crate::state::read_lines::<serde_json::Value>(&crate::store::Fs, &layout.history())
            .map_err(|e| super::state_message(&layout, &e))?
            .entries;
    let training_failures = crate::state::read_journal(&crate::store::Fs, &layout.journal(0))
        .map_err(|e| super::state_message(&layout, &e))?
        .entries
        .into_iter()
        .filter(|e| {
            e.run_id == c.run_id && e.item == crate::protocol::journal::item::HANDOFF_SKIPPED
        })
        .map(|e| TrainingFailure {
            iteration: e.iteration,
            outcome: e.note.unwrap_or_else(|| "training failed".into()),
        })
        .collect();
    Ok(Status {
        history,
        training_failures,
        schema_version: SCHEMA_VERSION,
        run_id: c.run_id,
        generation: c.gen,
        gen: c.gen,
        // Until judged: `judge_layout` settles both from the processes' evidence.
        state: RunState::Running,
        state_detail: String::new(),
        observed_at: chrono::Local::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, false),
        num_nodes: c.num_nodes,
        started_at: c.started_at,
        master: format!(
            "{} (pid {}), address {}:{}",
            c.host, c.pid, c.master_addr, c.master_port
        ),
        previous: c.previous,
        abort,
        waiting_for,
        ranks,
        watched_ms: None,
        heartbeat: c.config["timing"]["heartbeat-interval"]
            .as_str()
            .and_then(|h| humantime::parse_duration(h).ok())
            .unwrap_or(Duration::from_secs(5)),
    })
}

/// Judge every rank's process from evidence: on this machine, the kernel (pid and start
/// time); elsewhere, whether its heartbeat sequence advances while `status` watches all of
/// them together for `window` (a few heartbeat intervals). A record's frozen heartbeat age
/// alone proves nothing: it is what the last writer saw before it died.
pub fn judge(log_path: &Path, s: &mut Status) {
    judge_layout(&Layout::new(log_path), s)
}

/// [`judge`] for the cluster `layout` addresses; then every rank's state and the run's
/// follow from the evidence ([`settle`]).
pub fn judge_layout(layout: &Layout, s: &mut Status) {
    judge_processes(layout, s);
    settle(s, layout.cluster_name());
}

fn judge_processes(layout: &Layout, s: &mut Status) {
    let window = (s.heartbeat * 3).min(Duration::from_secs(10));
    let read = |r: u32| {
        store::fs::read_json::<RankRecord>(&layout.rank_record(s.gen, r))
            .ok()
            .flatten()
            .filter(|rec| rec.belongs_to(&s.run_id, s.gen, r))
    };
    let first: Vec<Option<RankRecord>> = (0..s.num_nodes).map(read).collect();
    let mut remote = Vec::new();
    for (i, rec) in first.iter().enumerate() {
        s.ranks[i].process = Some(match rec {
            None => Process::Unknown,
            Some(r) if r.state.is_terminal() || r.state == NodeState::Vacant => Process::Ended,
            Some(r) => match crate::holder::local(&r.holder()) {
                crate::holder::Local::Alive => Process::Alive,
                crate::holder::Local::Gone => Process::Gone,
                crate::holder::Local::Elsewhere => {
                    remote.push(i);
                    Process::Unknown
                }
            },
        });
    }
    if remote.is_empty() {
        return;
    }
    let started = Instant::now();
    while started.elapsed() < window && !remote.is_empty() {
        std::thread::sleep(Duration::from_millis(100).min(window));
        remote.retain(|&i| {
            let advanced = read(i as u32)
                .zip(first[i].as_ref())
                .is_some_and(|(now, then)| now.seq != then.seq);
            if advanced {
                s.ranks[i].process = Some(Process::Alive);
            }
            !advanced
        });
    }
    for i in remote {
        s.ranks[i].process = Some(Process::Gone);
    }
    s.watched_ms = Some(started.elapsed().as_millis() as u64);
}

/// Each rank's state as the text shows it (dead, the culprit, stopped by whom), and the
/// run's: after [`judge`], so that both rest on the same evidence.
fn settle(s: &mut Status, cluster: Option<&str>) {
    let abort = s.abort.clone();
    for r in &mut s.ranks {
        if r.process == Some(Process::Gone) {
            r.state = "dead".into();
        }
        let Some(a) = &abort else { continue };
        r.culprit = a.culprit == r.rank && a.cluster.as_deref() == cluster;
        if !r.culprit && r.record_state == Some(NodeState::Failed) {
            r.stopped_by = Some(match &a.cluster {
                Some(c) if Some(c.as_str()) != cluster => {
                    format!("the {c} cluster's rank {}", a.culprit)
                }
                _ => format!("rank {}", a.culprit),
            });
        }
    }
    let (state, detail) = assess(s);
    s.state = state;
    s.state_detail = detail;
}

/// The run's state, and the few words the text's `state:` line gives it, from the records
/// and (when judged) the processes.
pub fn assess(s: &Status) -> (RunState, String) {
    if let Some(a) = &s.abort {
        return (RunState::Stopped, format!("STOPPED: {}", a.describe()));
    }
    if s.ranks
        .iter()
        .all(|r| r.record_state == Some(NodeState::Done))
    {
        return (RunState::Completed, "completed".to_string());
    }
    let judged: Vec<(u32, Process)> = s
        .ranks
        .iter()
        .filter_map(|r| r.process.map(|p| (r.rank, p)))
        .collect();
    if judged.len() == s.ranks.len() {
        let gone: Vec<String> = judged
            .iter()
            .filter(|(_, p)| *p == Process::Gone)
            .map(|(r, _)| format!("rank {r}"))
            .collect();
        let alive = judged.iter().filter(|(_, p)| *p == Process::Alive).count();
        if alive == 0 && !gone.is_empty() {
            return (RunState::Stopped, "stopped (every node is gone: none is running and none stopped cleanly; restart every node to resume)".to_string());
        }
        if !gone.is_empty() {
            return (
                RunState::Stalled,
                format!(
                    "stalled ({} gone; the others will stop once they notice, after dead-after)",
                    gone.join(", ")
                ),
            );
        }
    }
    // A generation forms while some rank has not joined: after a restart (a later
    // generation), the run is on its way back, not running yet.
    let forming = |r: &&RankStatus| {
        matches!(
            r.record_state,
            None | Some(NodeState::Vacant | NodeState::Joining)
        )
    };
    if s.ranks.iter().any(|r| forming(&r)) {
        let absent: Vec<String> = s
            .ranks
            .iter()
            .filter(|r| matches!(r.record_state, None | Some(NodeState::Vacant)))
            .map(|r| format!("rank {}", r.rank))
            .collect();
        let not_joined = match absent.is_empty() {
            true => String::new(),
            false => format!("; not joined yet: {}", absent.join(", ")),
        };
        return if s.gen > 1 {
            (
                RunState::Restarting,
                format!("restarting (generation {} is forming{not_joined})", s.gen),
            )
        } else {
            (
                RunState::Starting,
                format!("starting (the cluster is forming{not_joined})"),
            )
        };
    }
    (RunState::Running, "running".to_string())
}

/// The run's state in a few words: the text's `state:` line.
pub fn overall(s: &Status) -> String {
    assess(s).1
}

/// A rank's state in a word or three, from its record, its judged process and the
/// generation's abort: `dead` (its process is gone though its record says it runs),
/// `culprit` (it stopped the generation), `stopped by a peer` (it failed because another
/// rank did), else the record's state (`running`, `done`…; `missing` without a record).
/// `cluster` is the rank's cluster in a pipelined run.
pub(crate) fn rank_label(
    r: &RankStatus,
    abort: Option<&AbortInfo>,
    cluster: Option<&str>,
) -> String {
    if r.process == Some(Process::Gone) {
        return "dead".into();
    }
    let culprit = abort.is_some_and(|a| {
        a.culprit == r.rank && a.cluster.as_deref().is_none_or(|c| Some(c) == cluster)
    });
    match r.record_state {
        Some(NodeState::Failed) if culprit => "culprit".into(),
        Some(NodeState::Failed) if abort.is_some() => "stopped by a peer".into(),
        Some(s) => format!("{s:?}").to_lowercase(),
        None => "missing".into(),
    }
}

pub fn render(s: &Status) -> String {
    let mut out = format!(
        "run {}  generation {}  started {}\nrank 0: {}\n",
        s.run_id, s.gen, s.started_at, s.master
    );
    if let Some(p) = &s.previous {
        out.push_str(&format!("previous: {p}\n"));
    }
    if !s.history.is_empty() {
        out.push_str("history:\n");
        for h in &s.history {
            if let Some(n) = h["discarded_from"].as_u64() {
                out.push_str(&format!(
                    "  iterations {n} and later of run {} were set aside (rl-node recover --discard-iteration)\n",
                    h["run_id"].as_str().unwrap_or("?")
                ));
                continue;
            }
            out.push_str(&format!(
                "  generation {} of run {}: started {} on {} (pid {}) at iteration {}{}\n",
                h["gen"],
                h["run_id"].as_str().unwrap_or("?"),
                h["started_at"].as_str().unwrap_or("?"),
                h["host"].as_str().unwrap_or("?"),
                h["pid"],
                h["resume_iteration"],
                h["previous"]
                    .as_str()
                    .map(|p| format!("; before it, {p}"))
                    .unwrap_or_default()
            ));
        }
    }
    if !s.training_failures.is_empty() {
        out.push_str(
            "iterations that kept their model (phases.train.on-failure = \"keep-model\"):\n",
        );
        for f in &s.training_failures {
            out.push_str(&format!("  iteration {}: {}\n", f.iteration, f.outcome));
        }
    }
    out.push_str(&format!("state: {}\n", overall(s)));
    if let Some(ms) = s.watched_ms {
        out.push_str(&format!(
            "(heartbeats of ranks on other machines watched for {:.1}s)\n",
            ms as f64 / 1000.0
        ));
    }
    if !s.waiting_for.is_empty() {
        let w: Vec<String> = s.waiting_for.iter().map(|r| format!("rank {r}")).collect();
        out.push_str(&format!("rank 0 is waiting for: {}\n", w.join(", ")));
    }
    out.push_str(&format!(
        "\n{:<5} {:<9} {:<20} {:>8} {:>5}  {:<22} {:>10}  {}\n",
        "RANK", "STATE", "HOST", "PID", "ITER", "PHASE", "HEARTBEAT", "WAITING AT / PROGRESS"
    ));
    for r in &s.ranks {
        let gone = r.process == Some(Process::Gone);
        let state = if gone {
            "DEAD".to_string()
        } else {
            r.state.clone()
        };
        // A dead rank's last observed age is frozen: it says nothing now.
        let age = r
            .heartbeat_age_ms
            .filter(|_| !gone)
            .map(|ms| format!("{:.1}s", ms as f64 / 1000.0))
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "{:<5} {:<9} {:<20} {:>8} {:>5}  {:<22} {:>10}  {}\n",
            r.rank,
            state,
            r.host,
            r.pid,
            r.iteration,
            r.phase_label().unwrap_or_else(|| "-".into()),
            age,
            match (&r.waiting_at, &r.progress) {
                _ if r.refused.is_some() => r.refused.clone().unwrap_or_default(),
                _ if r.culprit => "the culprit (see state)".to_string(),
                _ if r.stopped_by.is_some() => {
                    format!("stopped by {}", r.stopped_by.clone().unwrap_or_default())
                }
                (Some(w), _) => w.clone(),
                (None, Some(p)) => p.clone(),
                _ => String::new(),
            }
        ));
    }
    // What each rank's processes were doing when a wait overran or a peer fell silent.
    for r in &s.ranks {
        if let Some(h) = &r.hang_report {
            out.push_str(&format!("rank {}: hang report {h}\n", r.rank));
        }
    }
    out
}

/// A pipelined run (docs/pipeline.md): both clusters, and the hand-over between them.
#[derive(Debug, Serialize)]
pub struct PipelineStatus {
    pub schema_version: u32,
    /// The run's state from both clusters' ([`pipeline_state`]).
    pub state: RunState,
    pub state_detail: String,
    pub staleness: Option<u64>,
    /// Each cluster's status, or why it cannot be read (e.g. not started yet).
    pub rollout: Result<Status, String>,
    pub update: Result<Status, String>,
    /// The newest iteration whose train trajectories are committed (0: none).
    pub rolled_out: u64,
    /// The iteration the rollout cluster works on (0: none).
    pub rolling_out: u64,
    /// The newest iteration whose training is complete, its model published (0: none).
    pub trained: u64,
    /// The iteration the update cluster trains or waits to train (0: none).
    pub training: u64,
    /// (iteration, model version, staleness) of the recent rollouts.
    pub versions: Vec<(u64, u64, u64)>,
}

/// Whether `log_path` holds a pipelined run: no cluster record of its own, but clusters
/// under `.rl-node/rollout/` or `.rl-node/update/`.
pub fn is_pipelined(log_path: &Path) -> bool {
    let l = Layout::new(log_path);
    !l.cluster().exists()
        && ["rollout", "update"]
            .iter()
            .any(|c| l.clone().with_cluster(Some(c)).cluster().exists())
}

pub fn read_pipeline(log_path: &Path) -> PipelineStatus {
    let base = Layout::new(log_path);
    let cluster = |c: &'static str| {
        let l = base.clone().with_cluster(Some(c));
        let mut s = read_layout(&l)?;
        judge_layout(&l, &mut s);
        Ok(s)
    };
    let (rollout, update) = (cluster("rollout"), cluster("update"));
    let queue = |c: &str| {
        store::fs::read_json::<crate::protocol::pipeline::QueueRecord>(&base.queue(c))
            .ok()
            .flatten()
    };
    let (rq, uq) = (queue("rollout"), queue("update"));
    let first = |s: &Result<Status, String>| {
        s.as_ref()
            .ok()
            .and_then(|s| s.ranks.first())
            .map(|r| r.iteration)
            .unwrap_or(0)
    };
    let trained = uq.as_ref().map_or(0, |q| q.done);
    let staleness = rq.as_ref().or(uq.as_ref()).map(|q| q.staleness);
    let versions = rq
        .as_ref()
        .map(|q| {
            q.versions
                .iter()
                .rev()
                .take(8)
                .rev()
                .map(|&(i, v)| {
                    let first_it = 1;
                    (
                        i,
                        v,
                        crate::protocol::pipeline::staleness_of(i, v, first_it),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let training = match &update {
        Ok(s) if !overall(s).starts_with("completed") => first(&update).max(trained + 1),
        _ => 0,
    };
    let rolling_out = match &rollout {
        Ok(s) if !overall(s).starts_with("completed") => first(&rollout),
        _ => 0,
    };
    let (state, state_detail) = pipeline_state(&rollout, &update);
    PipelineStatus {
        schema_version: SCHEMA_VERSION,
        state,
        state_detail,
        staleness,
        rolled_out: rq.as_ref().map_or(0, |q| q.done),
        rolling_out,
        trained,
        training,
        versions,
        rollout,
        update,
    }
}

/// A pipelined run's state: completed when both clusters are; stopped, stalled or
/// re-forming when either is (the worse first); starting while one has not started.
fn pipeline_state(
    rollout: &Result<Status, String>,
    update: &Result<Status, String>,
) -> (RunState, String) {
    let (Ok(r), Ok(u)) = (rollout, update) else {
        return (
            RunState::Starting,
            "starting (a cluster has not started yet)".into(),
        );
    };
    for state in [
        RunState::Stopped,
        RunState::Stalled,
        RunState::Restarting,
        RunState::Starting,
    ] {
        if let Some((name, s)) = [("rollout", r), ("update", u)]
            .into_iter()
            .find(|(_, s)| s.state == state)
        {
            return (state, format!("{name} cluster: {}", s.state_detail));
        }
    }
    match (r.state, u.state) {
        (RunState::Completed, RunState::Completed) => (RunState::Completed, "completed".into()),
        _ => (RunState::Running, "running".into()),
    }
}

pub fn render_pipeline(p: &PipelineStatus) -> String {
    let mut out = format!(
        "pipelined run (pipeline.staleness = {})\n",
        p.staleness
            .map(|s| s.to_string())
            .unwrap_or_else(|| "?".into())
    );
    let or_none = |i: u64| {
        if i == 0 {
            "none".to_string()
        } else {
            format!("iteration {i}")
        }
    };
    out.push_str(&format!(
        "queue: trajectories committed up to {}; rolling out {}; training {}; models published up to {}\n",
        or_none(p.rolled_out),
        or_none(p.rolling_out),
        or_none(p.training),
        or_none(p.trained),
    ));
    if !p.versions.is_empty() {
        let v: Vec<String> = p
            .versions
            .iter()
            .map(|(i, v, s)| {
                let model = if *v == 0 {
                    "base model".to_string()
                } else {
                    format!("model {v}")
                };
                format!("{i} on {model} (staleness {s})")
            })
            .collect();
        out.push_str(&format!("rolled out: {}\n", v.join(", ")));
    }
    for (name, s) in [("rollout", &p.rollout), ("update", &p.update)] {
        out.push_str(&format!("\n== {name} cluster ==\n"));
        match s {
            Ok(s) => out.push_str(&render(s)),
            Err(e) => out.push_str(&format!("{e}\n")),
        }
    }
    out
}
