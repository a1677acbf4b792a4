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
    /// Elastic mode: the rank is not a member of the current generation, dropped after it
    /// was lost (when, why, in which generation). Its host, pid, iteration and phase are
    /// where its last record left it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped: Option<super::members::Dropped>,
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
    /// Ranks the coordinator (rank 0, unless it was dropped) is waiting for at its current
    /// barrier.
    pub waiting_for: Vec<u32>,
    /// The ranks of the current generation: every rank, or in elastic mode the members
    /// left after a rank was dropped.
    pub members: Vec<u32>,
    /// The rank that coordinates it: the lowest member.
    pub coordinator: u32,
    /// Ranks of the run that are not members of the current generation (details in
    /// their `ranks` entry's `dropped`).
    pub dropped: Vec<u32>,
    /// Members of the current generation that were not members of the one before: back
    /// after a drop.
    pub rejoined: Vec<u32>,
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
    /// `[cluster] min-nodes` of the run (0: every node).
    #[serde(skip)]
    pub min_nodes: u32,
    /// Elastic mode: the generation's abort is the loss of a member the members left go
    /// on from, and they are within the time they take to publish their next generation
    /// (2 × dead-after plus two polls) when `status` read it: they regroup.
    #[serde(skip)]
    pub regrouping: bool,
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
    let members = c.members();
    let coordinator = members.coordinator();
    let coordinator_record = records.get(coordinator as usize).and_then(|r| r.as_ref());
    // Heartbeat ages as the coordinator observes its peers (its own file: every member,
    // or in a cluster of groups the leaders), and the others' as a rank that reads them
    // observes them (in its record: the coordinator's in the next member's, a group
    // member's in its leader's).
    let by_coordinator: Vec<(u32, u64)> =
        store::fs::read_json::<ObservedFile>(&layout.observed(c.gen))
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
        if rank == coordinator {
            by_peer()
        } else {
            find(&by_coordinator).or_else(by_peer)
        }
    };
    let abort = read_abort(&layout, c.gen, &records);
    let waiting_for = coordinator_record
        .map(|r| r.waiting_for.clone())
        .unwrap_or_default();
    // Strict like every reader of the run's state: a damaged line is named, not skipped.
    let mut history =
        crate::state::read_lines::<serde_json::Value>(&crate::store::Fs, &layout.history())
            .map_err(|e| super::state_message(&layout, &e))?
            .entries;
    let (by_gen, changes) = membership_history(&layout, &c, &mut history);
    let ranks = records
        .iter()
        .enumerate()
        .map(|(i, rec)| {
            let rank = i as u32;
            if !members.contains(rank) {
                return dropped_status(&layout, &c, rank, &changes);
            }
            match rec {
                Some(r) => RankStatus {
                    rank,
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
                    heartbeat_age_ms: observed(rank),
                    last_write: r.wall.clone(),
                    waiting_at: r
                        .arrived
                        .as_ref()
                        .filter(|m| !coordinator_record.is_some_and(|c| c.released_at(m.k)))
                        .map(|m| m.name.clone()),
                    process: None,
                    refused: r.refused.clone().filter(|_| r.state == NodeState::Vacant),
                    hang_report: r.hang_report.clone(),
                    dropped: None,
                },
                None => missing(rank),
            }
        })
        .collect();
    let training_failures = training_failures(&layout, &c.run_id, &by_gen)?;
    let duration = |key: &str, default: Duration| {
        c.config["timing"][key]
            .as_str()
            .and_then(|h| humantime::parse_duration(h).ok())
            .unwrap_or(default)
    };
    let dead_after = duration("dead-after", Duration::from_secs(60));
    let poll = duration("poll-interval", Duration::from_secs(1)).max(Duration::from_secs(1));
    let min_nodes = c.config["cluster"]["min-nodes"].as_u64().unwrap_or(0) as u32;
    let regrouping = abort.as_ref().is_some_and(|a| {
        let since = chrono::DateTime::parse_from_rfc3339(&a.at)
            .map(|at| {
                (chrono::Utc::now() - at.to_utc())
                    .to_std()
                    .unwrap_or_default()
            })
            .unwrap_or(Duration::MAX);
        super::members::survived(a, members.ranks(), c.num_nodes, min_nodes)
            && since < 2 * dead_after + 2 * poll
    });
    let rejoined = changes
        .iter()
        .find(|ch| ch.gen == c.gen)
        .map(|ch| ch.rejoined.clone())
        .unwrap_or_default();
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
        dropped: members.dropped(c.num_nodes),
        members: members.ranks().to_vec(),
        coordinator,
        rejoined,
        ranks,
        watched_ms: None,
        heartbeat: duration("heartbeat-interval", Duration::from_secs(5)),
        min_nodes,
        regrouping,
    })
}

/// A member without a record in the generation.
fn missing(rank: u32) -> RankStatus {
    RankStatus {
        rank,
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
        dropped: None,
    }
}

/// Who was a member of each generation of run `c` (its history's and the current one),
/// and how each differs from the one before: each history entry of the run gets its
/// generation's `members`, and the ranks it `dropped` and took back (`rejoined`).
fn membership_history(
    layout: &Layout,
    c: &ClusterRecord,
    history: &mut [serde_json::Value],
) -> (
    std::collections::BTreeMap<u64, Vec<u32>>,
    Vec<super::members::Change>,
) {
    let gens: std::collections::BTreeSet<u64> = history
        .iter()
        .filter(|h| h["run_id"].as_str() == Some(c.run_id.as_str()))
        .filter_map(|h| h["gen"].as_u64())
        .chain([c.gen])
        .collect();
    let mut by_gen = super::members::read(layout, &c.run_id, gens);
    by_gen.insert(c.gen, c.members().ranks().to_vec());
    let changes = super::members::changes(&by_gen);
    for h in history.iter_mut() {
        let Some(gen) = h["gen"].as_u64() else {
            continue;
        };
        if h["run_id"].as_str() != Some(c.run_id.as_str()) || h.get("discarded_from").is_some() {
            continue;
        }
        if let (Some(m), Some(obj)) = (by_gen.get(&gen), h.as_object_mut()) {
            let change = changes.iter().find(|ch| ch.gen == gen);
            obj.insert("members".into(), serde_json::json!(m));
            obj.insert(
                "dropped".into(),
                serde_json::json!(change.map(|ch| ch.dropped.clone()).unwrap_or_default()),
            );
            obj.insert(
                "rejoined".into(),
                serde_json::json!(change.map(|ch| ch.rejoined.clone()).unwrap_or_default()),
            );
        }
    }
    (by_gen, changes)
}

/// Rank `rank`, not a member of `c`'s generation: dropped from the last generation that
/// went on without it (`changes`), why from the abort of the generation it was lost in,
/// and where it was from its last record there.
fn dropped_status(
    layout: &Layout,
    c: &ClusterRecord,
    rank: u32,
    changes: &[super::members::Change],
) -> RankStatus {
    let dropped = match changes.iter().rev().find(|ch| ch.dropped.contains(&rank)) {
        Some(change) => {
            let lost_in = ClusterRecord::bare(&c.run_id, change.previous, c.num_nodes);
            let records = read_records(layout, &lost_in);
            let abort = read_abort(layout, change.previous, &records);
            super::members::Dropped::of(rank, change, abort.as_ref())
        }
        // Without the records of the generations before (set aside by hand), the one
        // before is the best guess, and nothing says why.
        None => super::members::Dropped {
            rank,
            lost_in: c.gen.saturating_sub(1),
            dropped_from: c.gen,
            reason: None,
            described: None,
            at: None,
            detected_by: None,
            iteration: None,
            phase: None,
        },
    };
    let last = store::fs::read_json::<RankRecord>(&layout.rank_record(dropped.lost_in, rank))
        .ok()
        .flatten()
        .filter(|rec| rec.belongs_to(&c.run_id, dropped.lost_in, rank));
    RankStatus {
        rank,
        state: "dropped".into(),
        record_state: None,
        host: last.as_ref().map(|r| r.host.clone()).unwrap_or_default(),
        pid: last.as_ref().map_or(0, |r| r.pid),
        iteration: last.as_ref().map_or(0, |r| r.iteration),
        phase: last.as_ref().and_then(|r| r.phase).map(|p| p.number()),
        phase_name: last.as_ref().and_then(|r| r.phase).map(|p| p.name()),
        culprit: false,
        stopped_by: None,
        progress: None,
        heartbeat_age_ms: None,
        last_write: last.map(|r| r.wall).unwrap_or_default(),
        waiting_at: None,
        process: None,
        refused: None,
        hang_report: None,
        dropped: Some(dropped),
    }
}

/// The iterations of run `run_id` whose training failed and that kept their model, as
/// the coordinator of the generation that trained journaled them: rank 0, or in elastic
/// mode the lowest member of a generation that went on without it (`by_gen`: each
/// generation's members).
fn training_failures(
    layout: &Layout,
    run_id: &str,
    by_gen: &std::collections::BTreeMap<u64, Vec<u32>>,
) -> Result<Vec<TrainingFailure>, String> {
    let coordinators: std::collections::BTreeSet<u32> = by_gen
        .values()
        .filter_map(|m| m.first().copied())
        .chain([0])
        .collect();
    let mut out = Vec::new();
    for rank in coordinators {
        let journal = crate::state::read_journal(&crate::store::Fs, &layout.journal(rank))
            .map_err(|e| super::state_message(layout, &e))?;
        out.extend(
            journal
                .entries
                .into_iter()
                .filter(|e| {
                    e.run_id == run_id && e.item == crate::protocol::journal::item::HANDOFF_SKIPPED
                })
                .map(|e| TrainingFailure {
                    iteration: e.iteration,
                    outcome: e.note.unwrap_or_else(|| "training failed".into()),
                }),
        );
    }
    out.sort_by_key(|f| f.iteration);
    Ok(out)
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
        // A dropped rank is not a member: its process is not this generation's.
        if s.ranks[i].dropped.is_some() {
            continue;
        }
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
        if r.dropped.is_some() {
            continue;
        }
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
    // A rank dropped in elastic mode is not a member: the generation is its members'.
    let members: Vec<&RankStatus> = s.ranks.iter().filter(|r| r.dropped.is_none()).collect();
    if let Some(a) = &s.abort {
        if s.regrouping {
            let left: Vec<u32> = s
                .members
                .iter()
                .copied()
                .filter(|&r| r != a.culprit)
                .collect();
            return (
                RunState::Restarting,
                format!(
                    "regrouping (generation {} lost rank {}: {}; {} form generation {} without it)",
                    s.gen,
                    a.culprit,
                    a.reason,
                    super::members::ranks_list(&left),
                    s.gen + 1
                ),
            );
        }
        return (RunState::Stopped, format!("STOPPED: {}", a.describe()));
    }
    if members
        .iter()
        .all(|r| r.record_state == Some(NodeState::Done))
    {
        return (RunState::Completed, "completed".to_string());
    }
    let judged: Vec<(u32, Process)> = members
        .iter()
        .filter_map(|r| r.process.map(|p| (r.rank, p)))
        .collect();
    if judged.len() == members.len() {
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
            // In elastic mode the others drop a lost member and go on while enough are
            // left.
            let left = (members.len() - gone.len()) as u32;
            let then = match s.min_nodes {
                m if m > 0 && m < s.num_nodes && left >= m => format!(
                    "the others will drop it after dead-after and go on (cluster.min-nodes = {m})"
                ),
                _ => "the others will stop once they notice, after dead-after".to_string(),
            };
            return (
                RunState::Stalled,
                format!("stalled ({} gone; {then})", gone.join(", ")),
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
    if members.iter().any(forming) {
        let absent: Vec<String> = members
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
    if r.dropped.is_some() {
        return "dropped".into();
    }
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
        "run {}  generation {}  started {}\n",
        s.run_id, s.gen, s.started_at
    );
    if s.coordinator == 0 {
        out.push_str(&format!("rank 0: {}\n", s.master));
    } else {
        out.push_str(&format!(
            "rank {} (coordinator): {}\n",
            s.coordinator, s.master
        ));
    }
    if let Some(p) = &s.previous {
        out.push_str(&format!("previous: {p}\n"));
    }
    render_membership(&mut out, s);
    render_history(&mut out, s);
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
        out.push_str(&format!(
            "rank {} is waiting for: {}\n",
            s.coordinator,
            w.join(", ")
        ));
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
                _ if r.dropped.is_some() => r
                    .dropped
                    .as_ref()
                    .map(|d| format!(
                        "dropped in generation {}: {}",
                        d.lost_in,
                        d.reason.as_deref().unwrap_or("lost")
                    ))
                    .unwrap_or_default(),
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

/// Elastic mode: who is left and who coordinates, who was dropped (when, why), who came
/// back in this generation.
fn render_membership(out: &mut String, s: &Status) {
    if !s.dropped.is_empty() {
        out.push_str(&format!(
            "members: {} ({} of {} nodes; rank {} coordinates)\n",
            super::members::ranks_list(&s.members),
            s.members.len(),
            s.num_nodes,
            s.coordinator
        ));
        for d in s.ranks.iter().filter_map(|r| r.dropped.as_ref()) {
            out.push_str(&format!("dropped: {}\n", d.summary()));
        }
    }
    if !s.rejoined.is_empty() {
        out.push_str(&format!(
            "back in this generation: {}\n",
            super::members::ranks_list(&s.rejoined)
        ));
    }
}

/// Every start of the run, with (elastic mode) who each generation dropped or took back.
fn render_history(out: &mut String, s: &Status) {
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
            // Elastic mode: the members of a generation that dropped or took back ranks.
            let ranks = |k: &str| -> Vec<u32> {
                h[k].as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|r| r.as_u64())
                            .map(|r| r as u32)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let (dropped, rejoined) = (ranks("dropped"), ranks("rejoined"));
            let mut membership = Vec::new();
            if !dropped.is_empty() {
                membership.push(format!("dropped {}", super::members::ranks_list(&dropped)));
            }
            if !rejoined.is_empty() {
                membership.push(format!("{} back", super::members::ranks_list(&rejoined)));
            }
            let membership = match membership.is_empty() {
                true => String::new(),
                false => format!(
                    "; members {} ({})",
                    super::members::ranks_list(&ranks("members")),
                    membership.join("; ")
                ),
            };
            out.push_str(&format!(
                "  generation {} of run {}: started {} on {} (pid {}) at iteration {}{membership}{}\n",
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::membership::Members;
    use crate::protocol::{AbortKind, Phase};

    const RUN: &str = "r1";

    fn write(path: &Path, v: &impl Serialize) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, serde_json::to_vec(v).unwrap()).unwrap();
    }

    /// Generation `gen` of `members` (`None`: every rank of 3), published as the current
    /// one and in its own directory, with a history line.
    fn generation(layout: &Layout, gen: u64, members: Option<Vec<u32>>) {
        let mut c = ClusterRecord::bare(RUN, gen, 3);
        c.members = members.map(|m| Members::try_from(m).unwrap());
        c.host = "h1".into();
        c.started_at = format!("2026-01-01T00:0{gen}:00+00:00");
        c.config = serde_json::json!({
            "cluster": {"min-nodes": 2},
            "timing": {"heartbeat-interval": "200ms", "dead-after": "3s", "poll-interval": "100ms"}
        });
        write(&layout.gen_cluster(gen), &c);
        write(&layout.cluster(), &c);
        let line = serde_json::json!({
            "gen": gen, "run_id": RUN, "started_at": c.started_at, "host": "h1", "pid": 1,
            "resume_iteration": gen, "previous": null, "walk": "iteration-complete:both"
        });
        let mut history = std::fs::read_to_string(layout.history()).unwrap_or_default();
        history.push_str(&format!("{line}\n"));
        std::fs::write(layout.history(), history).unwrap();
    }

    /// Rank `rank`'s record in generation `gen`, in `state`, in iteration 2.
    fn record(layout: &Layout, gen: u64, rank: u32, state: NodeState) {
        let r = RankRecord {
            state,
            host: format!("h{rank}"),
            pid: 100 + rank,
            iteration: 2,
            phase: Some(Phase::TrainRollout),
            wall: "2026-01-01T00:01:30+00:00".into(),
            ..RankRecord::vacant(RUN, gen, rank)
        };
        write(&layout.rank_record(gen, rank), &r);
    }

    /// Rank 2 declared rank 0 dead in iteration 2 of generation `gen`, at `at`.
    fn rank_0_lost(layout: &Layout, gen: u64, at: &str) {
        let a = AbortInfo {
            kind: AbortKind::PeerDead,
            culprit: 0,
            culprit_host: "h0".into(),
            phase: "1 (train-rollout)".into(),
            iteration: 2,
            reason: "heartbeat still for 3.0s".into(),
            log: None,
            detected_by: 2,
            silent_ms: Some(3000),
            at: at.into(),
            cluster: None,
            detected_in: None,
            dropped: false,
        };
        write(&layout.abort(gen), &a);
    }

    fn status_of(layout: &Layout) -> Status {
        let mut s = read_layout(layout).unwrap();
        judge_layout(layout, &mut s);
        s
    }

    /// A run of 3 nodes whose generation 1 lost rank 0; ranks 1 and 2 formed generation
    /// 2 and finished it.
    fn dropped_rank_0(dir: &Path) -> Layout {
        let layout = Layout::new(dir);
        generation(&layout, 1, None);
        for rank in 0..3 {
            record(&layout, 1, rank, NodeState::Running);
        }
        rank_0_lost(&layout, 1, "2026-01-01T00:01:33.000+00:00");
        generation(&layout, 2, Some(vec![1, 2]));
        for rank in [1, 2] {
            record(&layout, 2, rank, NodeState::Done);
        }
        layout
    }

    /// A dropped rank is neither missing nor a failed member: the run of the members left
    /// completed, rank 1 coordinates, and rank 0's entry says when, why and where it was
    /// lost, in the text as in the JSON.
    #[test]
    fn a_rank_dropped_in_elastic_mode_is_shown_dropped_with_why_and_when() {
        let dir = tempfile::tempdir().unwrap();
        let layout = dropped_rank_0(dir.path());
        let s = status_of(&layout);
        assert_eq!(s.state, RunState::Completed, "{}", s.state_detail);
        assert_eq!((s.members.clone(), s.coordinator), (vec![1, 2], 1));
        assert_eq!((s.dropped.clone(), s.rejoined.clone()), (vec![0], vec![]));
        let r0 = &s.ranks[0];
        assert_eq!((r0.state.as_str(), r0.record_state), ("dropped", None));
        assert_eq!(r0.process, None);
        assert_eq!((r0.host.as_str(), r0.pid, r0.iteration), ("h0", 100, 2));
        let d = r0.dropped.as_ref().unwrap();
        assert_eq!((d.lost_in, d.dropped_from), (1, 2));
        assert_eq!(d.reason.as_deref(), Some("heartbeat still for 3.0s"));
        assert_eq!(d.detected_by, Some(2));
        assert_eq!(d.at.as_deref(), Some("2026-01-01T00:01:33.000+00:00"));
        assert_eq!(rank_label(r0, s.abort.as_ref(), None), "dropped");
        let text = render(&s);
        for want in [
            "rank 1 (coordinator): h1",
            "members: rank 1, rank 2 (2 of 3 nodes; rank 1 coordinates)",
            "dropped: rank 0 in generation 1 (declared lost by rank 2 at 2026-01-01T00:01:33.000+00:00): heartbeat still for 3.0s",
            "at iteration 2; members rank 1, rank 2 (dropped rank 0)",
            "state: completed",
            "dropped in generation 1: heartbeat still for 3.0s",
        ] {
            assert!(text.contains(want), "{want:?} in:\n{text}");
        }
        assert!(!text.contains("missing"), "{text}");
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["members"], serde_json::json!([1, 2]), "{v}");
        assert_eq!(v["coordinator"], 1, "{v}");
        assert_eq!(v["ranks"][0]["state"], "dropped", "{v}");
        assert_eq!(v["ranks"][0]["dropped"]["lost_in"], 1, "{v}");
        assert!(v["ranks"][0].get("process").is_none(), "{v}");
        assert_eq!(v["history"][1]["dropped"], serde_json::json!([0]), "{v}");
        assert_eq!(
            v["history"][0]["members"],
            serde_json::json!([0, 1, 2]),
            "{v}"
        );
    }

    /// Every node started again: generation 3 takes rank 0 back, which the status and
    /// the history say; nobody is dropped any more.
    #[test]
    fn a_rank_back_after_a_restart_is_named_in_the_generation_that_took_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let layout = dropped_rank_0(dir.path());
        generation(&layout, 3, None);
        for rank in 0..3 {
            record(&layout, 3, rank, NodeState::Done);
        }
        let s = status_of(&layout);
        assert_eq!(s.state, RunState::Completed, "{}", s.state_detail);
        assert_eq!((s.dropped.clone(), s.rejoined.clone()), (vec![], vec![0]));
        assert_eq!(s.coordinator, 0);
        assert!(s.ranks.iter().all(|r| r.dropped.is_none()));
        let text = render(&s);
        for want in [
            "rank 0: h1",
            "back in this generation: rank 0",
            "members rank 1, rank 2 (dropped rank 0)",
            "members rank 0, rank 1, rank 2 (rank 0 back)",
        ] {
            assert!(text.contains(want), "{want:?} in:\n{text}");
        }
        assert!(!text.contains("\nmembers:"), "{text}");
    }

    /// While the members left regroup, the generation that lost a member is not a stop:
    /// it is, once they did not publish the next one in time.
    #[test]
    fn a_survived_loss_is_a_regroup_until_the_members_left_are_overdue() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        generation(&layout, 1, None);
        for rank in [1, 2] {
            record(&layout, 1, rank, NodeState::Failed);
        }
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, false);
        rank_0_lost(&layout, 1, &now);
        let s = status_of(&layout);
        assert_eq!(s.state, RunState::Restarting, "{}", s.state_detail);
        assert_eq!(
            s.state_detail,
            "regrouping (generation 1 lost rank 0: heartbeat still for 3.0s; rank 1, rank 2 form generation 2 without it)"
        );
        // Long past 2 × dead-after: they stopped instead.
        rank_0_lost(&layout, 1, "2026-01-01T00:01:33.000+00:00");
        let s = status_of(&layout);
        assert_eq!(s.state, RunState::Stopped, "{}", s.state_detail);
        assert!(s.state_detail.starts_with("STOPPED: rank 0 on h0 is dead"));
    }
}
