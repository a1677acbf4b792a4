//! The timeline's data: every rank's event log turned into lanes of blocks (one per phase
//! walked), barrier waits, marks (failed commands, retries, server restarts, failures) and
//! generation starts (with, in elastic mode, the membership changes and each dropped
//! rank's stretch without membership), plus the per-iteration numbers drawn above the
//! lanes.
//!
//! Pure: [`build`] takes what [`super::render_run`] read from the files and does no I/O, so
//! that what the picture says can be tested on hand-made input.

use crate::events::Event as Ev;
use crate::observe::eventlog::Event;
use crate::protocol::{AbortInfo, Phase};
use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;

/// What the files of one cluster say (the synchronous loop is one cluster named `None`).
#[derive(Debug, Default)]
pub struct ClusterInput {
    pub name: Option<&'static str>,
    /// Each rank's events, index = rank (empty: no event log).
    pub events: Vec<Vec<Event>>,
    /// Host of (generation, rank), from the rank records that still exist.
    pub hosts: HashMap<(u64, u32), String>,
    /// Last write of (generation, rank)'s record (seconds since the epoch): how long a
    /// rank was alive after its last event.
    pub walls: HashMap<(u64, u32), f64>,
    /// Each generation's abort, where one was published or relayed.
    pub aborts: BTreeMap<u64, AbortInfo>,
    /// The barrier (generation, rank) had arrived at and was not released from at its
    /// record's last write: a rank stopped or still waiting there.
    pub waiting: HashMap<(u64, u32), Waiting>,
    /// The current generation.
    pub gen: u64,
    /// In the current generation: each rank's last write (seconds since the epoch), its
    /// state as `rl-node status` labels it (`running`, `done`, `dead`, `culprit`,
    /// `stopped by a peer`, `dropped`…) and what it is doing.
    pub live: Vec<Option<LiveRank>>,
    /// The members of each generation whose record says (elastic mode: the members left
    /// after a loss, fewer than every rank); a generation not here is taken to be of
    /// every rank.
    pub members: BTreeMap<u64, Vec<u32>>,
}

/// A rank's record in the current generation, as far as the timeline needs it.
#[derive(Debug, Clone)]
pub struct LiveRank {
    pub wall: f64,
    pub state: String,
    /// Its record's progress note (`waiting for …` while a pipelined cluster waits for
    /// the other).
    pub progress: Option<String>,
}

/// A barrier a rank arrived at and was not released from.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub barrier: String,
    /// The ranks of that generation that had not arrived (by their records).
    pub waited_for: Vec<u32>,
}

/// One line of `metrics.jsonl` reduced to what is drawn.
#[derive(Debug, Clone)]
pub struct MetricsLine {
    pub cluster: Option<String>,
    pub iteration: u64,
    pub total: f64,
    /// Phase name (`train-rollout`) and seconds, in walk order.
    pub phases: Vec<(String, f64)>,
    pub value: Option<f64>,
}

#[derive(Debug)]
pub struct Input {
    pub clusters: Vec<ClusterInput>,
    /// The current run's lines of `metrics.jsonl` (empty: none, use the events).
    pub metrics: Vec<MetricsLine>,
    /// The numeric field shown above the lanes (`rollout/<field>_mean`).
    pub field: String,
    /// The field's mean per iteration from the merged train splits, for iterations whose
    /// metrics line has none.
    pub values: BTreeMap<u64, f64>,
    pub iterations: Option<RangeInclusive<u64>>,
}

#[derive(Debug)]
pub struct Timeline {
    /// Seconds since the epoch of the first and last thing drawn.
    pub start: f64,
    pub end: f64,
    pub lanes: Vec<Lane>,
    pub generations: Vec<GenStart>,
    pub iterations: Vec<IterStat>,
    pub field: String,
    /// Whether the per-iteration numbers come from `metrics.jsonl` (else rank 0's events).
    pub from_metrics: bool,
    /// Whether some of the field's means come from the merged train splits.
    pub values_from_splits: bool,
    /// Stretches where no rank of any cluster did anything and a generation began: the
    /// downtime between generations, drawn collapsed.
    pub downtime: Vec<Downtime>,
    /// Per cluster, the time of the iterations its rank 0 completed (in the generation
    /// that completed each): the useful part of the wall time `end - start`.
    pub useful: Vec<(Option<&'static str>, f64)>,
}

/// Time between generations when nothing ran (the time from the last sign of life of a
/// generation to the next one's first event).
#[derive(Debug, Clone, PartialEq)]
pub struct Downtime {
    pub start: f64,
    pub end: f64,
    /// The generation(s) that began at its end.
    pub gens: Vec<u64>,
}

/// A stretch with nothing drawn is collapsed when it holds a generation start and is at
/// least this share of the whole span: shorter ones cost the page nothing to draw true.
pub const DOWNTIME_SHARE: f64 = 0.05;

#[derive(Debug)]
pub struct Lane {
    pub cluster: Option<&'static str>,
    pub rank: u32,
    /// The host of the newest generation that has one.
    pub host: String,
    pub blocks: Vec<Block>,
    pub waits: Vec<Wait>,
    pub marks: Vec<Mark>,
    /// Commands (from their end and duration), for the trace export.
    pub commands: Vec<Span>,
    /// Commits, hand-offs, server starts and stops: points in time, for the trace export.
    pub instants: Vec<Instant>,
    /// Its state in the current generation as `rl-node status` labels it (`done`,
    /// `running`, `dead`, `culprit`, `stopped by a peer`…), if known.
    pub state: Option<String>,
    /// Its last sign of life in the current generation (its record's last write).
    pub last_write: Option<f64>,
    /// Elastic mode: the stretches in which the rank was not a member (dropped after a
    /// loss, until a later generation took it back): its lane ends there.
    pub absent: Vec<Absence>,
}

/// A stretch in which a rank was no member of its cluster's generations: from the
/// membership change that dropped it to the one that took it back (`None`: not back).
#[derive(Debug, Clone, PartialEq)]
pub struct Absence {
    pub from: f64,
    pub until: Option<f64>,
    /// The first generation without it, and the one that took it back.
    pub dropped_from: u64,
    pub back_in: Option<u64>,
    /// Why it was dropped (the abort of the generation it was lost in).
    pub why: String,
}

/// A command's run: `name` is the command's phase (`rollout`, `train`…).
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub gen: u64,
    pub iteration: u64,
    pub start: f64,
    pub end: f64,
    pub detail: String,
}

/// Something that happened at one time on a rank.
#[derive(Debug, Clone)]
pub struct Instant {
    pub name: String,
    pub gen: u64,
    pub iteration: u64,
    pub t: f64,
    pub detail: String,
}

impl Lane {
    pub fn label(&self) -> String {
        match self.cluster {
            Some(c) => format!("{c} rank {}", self.rank),
            None => format!("rank {}", self.rank),
        }
    }
}

/// The time a rank spent in one phase of one iteration.
#[derive(Debug, Clone)]
pub struct Block {
    pub phase: Phase,
    pub gen: u64,
    pub iteration: u64,
    pub host: String,
    pub start: f64,
    pub end: f64,
    /// Not ended by a later event: the rank was still in it at its last write (running),
    /// or stopped in it (crashed, stopped).
    pub open: bool,
    /// What happened inside: commands with their exit, server starts, the hand-off…
    pub notes: Vec<String>,
    /// The command log of the phase's command, relative to the log path.
    pub log: Option<String>,
}

/// A wait at a barrier (hatched over the phase block it ends), or in a pipelined run a
/// cluster's wait for the other one.
#[derive(Debug, Clone)]
pub struct Wait {
    /// The barrier's name; for a pipelined wait, what was waited for.
    pub barrier: String,
    /// A pipelined cluster's wait for the other cluster (not a barrier).
    pub pipeline: bool,
    pub gen: u64,
    pub iteration: u64,
    pub k: Option<u64>,
    pub start: f64,
    pub end: f64,
    pub open: bool,
    /// The rank(s) that arrived last (whom rank 0, and so everyone, waited for).
    pub waited_for: Vec<u32>,
    /// Of those, the ones dead at the end of the wait, with their last sign of life.
    pub dead: Vec<(u32, f64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MarkKind {
    /// The generation stopped here because of this rank (the abort's culprit).
    Failure,
    /// A command exited other than with code 0, or a work item failed for good.
    CommandFailed,
    Retry,
    /// The inference server failed to start, or started on a later attempt.
    ServerRestart,
    /// The rank's generation was replaced while it worked.
    Fenced,
    /// The rank wrote a hang report (docs/forensics.md); the text names its file.
    HangReport,
}

impl MarkKind {
    pub fn class(self) -> &'static str {
        match self {
            MarkKind::Failure => "failure",
            MarkKind::CommandFailed => "command-failed",
            MarkKind::Retry => "retry",
            MarkKind::ServerRestart => "server-restart",
            MarkKind::Fenced => "fenced",
            MarkKind::HangReport => "hang-report",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Mark {
    pub kind: MarkKind,
    pub t: f64,
    pub gen: u64,
    pub iteration: u64,
    pub text: String,
}

/// A generation's start in one cluster, and why the one before it ended.
#[derive(Debug, Clone)]
pub struct GenStart {
    pub cluster: Option<&'static str>,
    pub gen: u64,
    pub t: f64,
    /// The `generation` event's `previous`.
    pub previous: Option<String>,
    /// The previous generation's abort, described.
    pub ended: Option<String>,
    /// Elastic mode: how its members differ from the generation before's (`None`: they
    /// do not).
    pub membership: Option<Membership>,
}

/// A membership change: who a generation dropped and who it took back.
#[derive(Debug, Clone, PartialEq)]
pub struct Membership {
    pub members: Vec<u32>,
    /// Each rank dropped, with why (the abort of the generation it was lost in).
    pub dropped: Vec<(u32, String)>,
    pub rejoined: Vec<u32>,
    /// Formed by the members left after a loss, in their processes (their `regrouped`
    /// events), rather than by a start of the nodes.
    pub regrouped: bool,
}

impl Membership {
    /// `rank 0 dropped`, `rank 2 back`, `rank 0 dropped; rank 2 back`.
    pub fn short(&self) -> String {
        let mut parts = Vec::new();
        if !self.dropped.is_empty() {
            let ranks: Vec<u32> = self.dropped.iter().map(|d| d.0).collect();
            parts.push(format!(
                "{} dropped",
                crate::observe::members::ranks_list(&ranks)
            ));
        }
        if !self.rejoined.is_empty() {
            parts.push(format!(
                "{} back",
                crate::observe::members::ranks_list(&self.rejoined)
            ));
        }
        parts.join("; ")
    }
}

/// One iteration's time, its split into phases, and the chosen field's mean.
#[derive(Debug, Clone)]
pub struct IterStat {
    pub cluster: Option<String>,
    pub iteration: u64,
    pub total: f64,
    pub phases: Vec<(String, f64)>,
    pub value: Option<f64>,
}

/// The barrier arrivals of one cluster within this many seconds of the last one count as
/// last too: ranks that arrive within one poll of each other all held the barrier up.
const LAST_ARRIVAL_SLACK: f64 = 0.01;

pub fn build(input: Input) -> Timeline {
    let in_range = |it: u64| input.iterations.as_ref().is_none_or(|r| r.contains(&it));
    let mut lanes = Vec::new();
    let mut generations = Vec::new();
    for c in &input.clusters {
        let first_lane = lanes.len();
        for (rank, events) in c.events.iter().enumerate() {
            lanes.push(lane(c, rank as u32, events));
        }
        attribute_waits(&mut lanes[first_lane..]);
        mark_dead(&mut lanes[first_lane..], c);
        // Failures: each generation's abort, on its culprit's lane of this cluster.
        for (gen, a) in &c.aborts {
            let culprit_here = a.cluster.as_deref().is_none_or(|n| Some(n) == c.name);
            if !culprit_here {
                continue;
            }
            if let Some(l) = lanes[first_lane..].iter_mut().find(|l| l.rank == a.culprit) {
                let t = parse_t(&a.at)
                    .or_else(|| l.blocks.iter().rev().find(|b| b.gen == *gen).map(|b| b.end))
                    .unwrap_or(0.0);
                l.marks.push(Mark {
                    kind: MarkKind::Failure,
                    t,
                    gen: *gen,
                    iteration: a.iteration,
                    text: a.describe(),
                });
            }
        }
        // Generations: rank 0's `generation` events, and in elastic mode the `regrouped`
        // event of the coordinator of a generation the members left formed.
        let first_gen = generations.len();
        for (rank, events) in c.events.iter().enumerate() {
            for e in events {
                let regrouped = match &e.event {
                    Ev::Generation { .. } if rank == 0 => false,
                    Ev::Regrouped { coordinator, .. } if *coordinator == rank as u32 => true,
                    _ => continue,
                };
                let previous = match &e.event {
                    Ev::Generation { previous } => previous.clone(),
                    _ => None,
                };
                generations.push(GenStart {
                    cluster: c.name,
                    gen: e.gen,
                    t: e.t,
                    previous,
                    ended: c
                        .aborts
                        .get(&e.gen.saturating_sub(1))
                        .filter(|_| e.gen > 1)
                        .map(|a| a.describe()),
                    membership: regrouped.then(|| Membership {
                        members: Vec::new(),
                        dropped: Vec::new(),
                        rejoined: Vec::new(),
                        regrouped: true,
                    }),
                });
            }
        }
        membership_changes(&mut generations, first_gen, &mut lanes[first_lane..], c);
    }
    let mut from_metrics = !input.metrics.is_empty();
    let mut iterations: Vec<IterStat> = input
        .metrics
        .iter()
        .filter(|m| in_range(m.iteration))
        .map(|m| IterStat {
            cluster: m.cluster.clone(),
            iteration: m.iteration,
            total: m.total,
            phases: m.phases.clone(),
            value: m.value,
        })
        .collect();
    if iterations.is_empty() {
        from_metrics = false;
        iterations = from_events(&input.clusters);
    }
    iterations.retain(|s| in_range(s.iteration));
    let mut values_from_splits = false;
    for s in &mut iterations {
        if s.value.is_none() && s.cluster.as_deref().is_none_or(|c| c == "rollout") {
            s.value = input.values.get(&s.iteration).copied();
            values_from_splits |= s.value.is_some();
        }
    }

    // Keep what lies in the asked iterations; the picture spans what is kept.
    if input.iterations.is_some() {
        for l in &mut lanes {
            l.blocks.retain(|b| in_range(b.iteration));
            l.waits.retain(|w| in_range(w.iteration));
            l.marks.retain(|m| in_range(m.iteration));
        }
    }
    let times = lanes.iter().flat_map(|l| {
        l.blocks
            .iter()
            .flat_map(|b| [b.start, b.end])
            .chain(l.waits.iter().flat_map(|w| [w.start, w.end]))
            .chain(l.marks.iter().map(|m| m.t))
    });
    let (mut start, mut end) = (f64::INFINITY, f64::NEG_INFINITY);
    for t in times {
        start = start.min(t);
        end = end.max(t);
    }
    if input.iterations.is_none() {
        for g in &generations {
            start = start.min(g.t);
            end = end.max(g.t);
        }
    } else {
        generations.retain(|g| g.t >= start && g.t <= end);
    }
    if !start.is_finite() {
        (start, end) = (0.0, 0.0);
    }
    let downtime = downtime(&lanes, &generations, start, end);
    let useful = input
        .clusters
        .iter()
        .map(|c| {
            let its = from_events(std::slice::from_ref(c));
            let t: f64 = its
                .iter()
                .filter(|s| in_range(s.iteration))
                .map(|s| s.total)
                .sum();
            // An empty sum of floats is -0.0.
            (c.name, t.max(0.0))
        })
        .collect();
    Timeline {
        start,
        end,
        lanes,
        generations,
        iterations,
        field: input.field,
        from_metrics,
        values_from_splits,
        downtime,
        useful,
    }
}

/// Elastic mode: on each generation start whose members differ from the generation
/// before's (its record's `members`), who it dropped and why (the abort of the generation
/// the rank was lost in) and who it took back; on each dropped rank's lane, the stretch in
/// which it was no member. A changed generation whose start no event marks begins at its
/// first event.
fn membership_changes(
    gens: &mut Vec<GenStart>,
    first: usize,
    lanes: &mut [Lane],
    c: &ClusterInput,
) {
    for change in crate::observe::members::changes(&c.members) {
        let i = match gens[first..].iter().position(|g| g.gen == change.gen) {
            Some(i) => first + i,
            None => {
                let Some(t) = c
                    .events
                    .iter()
                    .flatten()
                    .filter(|e| e.gen == change.gen)
                    .map(|e| e.t)
                    .min_by(f64::total_cmp)
                else {
                    continue;
                };
                gens.push(GenStart {
                    cluster: c.name,
                    gen: change.gen,
                    t,
                    previous: None,
                    ended: c.aborts.get(&change.previous).map(|a| a.describe()),
                    membership: None,
                });
                gens.len() - 1
            }
        };
        let why = |rank: u32| {
            c.aborts
                .get(&change.previous)
                .filter(|a| a.culprit == rank && a.cluster.is_none())
                .map(|a| a.reason.clone())
                .unwrap_or_else(|| format!("lost in generation {}", change.previous))
        };
        let g = &mut gens[i];
        g.membership = Some(Membership {
            members: change.members.clone(),
            dropped: change.dropped.iter().map(|&r| (r, why(r))).collect(),
            rejoined: change.rejoined.clone(),
            regrouped: g.membership.as_ref().is_some_and(|m| m.regrouped),
        });
        let t = g.t;
        for l in lanes.iter_mut() {
            if change.dropped.contains(&l.rank) {
                l.absent.push(Absence {
                    from: t,
                    until: None,
                    dropped_from: change.gen,
                    back_in: None,
                    why: why(l.rank),
                });
            } else if change.rejoined.contains(&l.rank) {
                if let Some(a) = l.absent.last_mut().filter(|a| a.until.is_none()) {
                    a.until = Some(t);
                    a.back_in = Some(change.gen);
                }
            }
        }
    }
    // A generation that is not a membership change is not marked as one.
    for g in &mut gens[first..] {
        if g.membership.as_ref().is_some_and(|m| m.members.is_empty()) {
            g.membership = None;
        }
    }
    gens[first..].sort_by(|a, b| a.t.total_cmp(&b.t));
}

/// The stretches of [`DOWNTIME_SHARE`] or more of the span in which no lane has a block,
/// wait or mark and a generation began.
fn downtime(lanes: &[Lane], gens: &[GenStart], start: f64, end: f64) -> Vec<Downtime> {
    let mut spans: Vec<(f64, f64)> = lanes
        .iter()
        .flat_map(|l| {
            l.blocks
                .iter()
                .map(|b| (b.start, b.end))
                .chain(l.waits.iter().map(|w| (w.start, w.end)))
                .chain(l.marks.iter().map(|m| (m.t, m.t)))
        })
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let min = (end - start) * DOWNTIME_SHARE;
    let mut out = Vec::new();
    let mut reach = f64::NEG_INFINITY;
    for (a, b) in spans {
        if reach.is_finite() && a - reach >= min && a - reach > 0.0 {
            let began: Vec<u64> = gens
                .iter()
                .filter(|g| g.t >= reach && g.t <= a)
                .map(|g| g.gen)
                .collect();
            if !began.is_empty() {
                out.push(Downtime {
                    start: reach,
                    end: a,
                    gens: began,
                });
            }
        }
        reach = reach.max(b);
    }
    out
}

fn parse_t(s: &str) -> Option<f64> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_millis() as f64 / 1000.0)
}

fn lane(c: &ClusterInput, rank: u32, events: &[Event]) -> Lane {
    let host_of = |gen: u64| {
        c.hosts
            .get(&(gen, rank))
            .cloned()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "?".into())
    };
    let mut parts = LaneParts::default();
    for e in events {
        parts.event(e, rank, &host_of);
    }
    let live = c.live.get(rank as usize).cloned().flatten();
    parts.close(c, rank, events, live.as_ref());
    let LaneParts {
        blocks,
        waits,
        marks,
        commands,
        instants,
        ..
    } = parts;
    let host = blocks
        .last()
        .map(|b| b.host.clone())
        .unwrap_or_else(|| host_of(c.gen));
    Lane {
        cluster: c.name,
        rank,
        host,
        blocks,
        waits,
        marks,
        commands,
        instants,
        last_write: live.as_ref().map(|l| l.wall),
        state: live.map(|l| l.state),
        absent: Vec::new(),
    }
}

/// What one rank's events build, event by event: its blocks, barrier waits and marks.
#[derive(Default)]
struct LaneParts {
    blocks: Vec<Block>,
    waits: Vec<Wait>,
    marks: Vec<Mark>,
    commands: Vec<Span>,
    instants: Vec<Instant>,
    /// The block the rank is in (index into `blocks`), if it has not ended.
    current: Option<usize>,
    /// The time of each generation's last event.
    last_t: HashMap<u64, f64>,
    /// The time of each generation's last event of the rank's own work (not a hang
    /// report, fence, refusal or a member found lost, which come while it waits): before
    /// it arrives at a barrier it never passed.
    last_work_t: HashMap<u64, f64>,
}

impl LaneParts {
    fn event(&mut self, e: &Event, rank: u32, host_of: &impl Fn(u64) -> String) {
        let lt = self.last_t.entry(e.gen).or_insert(e.t);
        *lt = lt.max(e.t);
        if !matches!(
            e.event,
            Ev::HangReport { .. } | Ev::Fenced { .. } | Ev::Refused { .. } | Ev::MemberLost { .. }
        ) {
            let lw = self.last_work_t.entry(e.gen).or_insert(e.t);
            *lw = lw.max(e.t);
        }
        // A block of an earlier generation never continues into this one.
        if let Some(i) = self.current {
            if self.blocks[i].gen != e.gen {
                self.current = None;
            }
        }
        match &e.event {
            Ev::Phase { phase, .. } => {
                if let Some(i) = self.current {
                    self.blocks[i].end = e.t;
                }
                self.blocks.push(Block {
                    phase: *phase,
                    gen: e.gen,
                    iteration: e.iteration,
                    host: host_of(e.gen),
                    start: e.t,
                    end: e.t,
                    open: false,
                    notes: Vec::new(),
                    log: None,
                });
                self.current = Some(self.blocks.len() - 1);
            }
            Ev::Barrier { name, k, waited_ms } => {
                self.waits.push(Wait {
                    barrier: name.clone(),
                    pipeline: false,
                    gen: e.gen,
                    iteration: e.iteration,
                    k: Some(*k),
                    start: e.t - *waited_ms as f64 / 1000.0,
                    end: e.t,
                    open: false,
                    waited_for: Vec::new(),
                    dead: Vec::new(),
                });
            }
            // Drawn as the wait it is, not as the phase the cluster waits in.
            Ev::PipelineWait { what, secs } => {
                self.waits.push(Wait {
                    barrier: what.clone(),
                    pipeline: true,
                    gen: e.gen,
                    iteration: e.iteration,
                    k: None,
                    start: e.t - secs,
                    end: e.t,
                    open: false,
                    waited_for: Vec::new(),
                    dead: Vec::new(),
                });
                self.note(format!("waited {secs:.2}s for {what}"));
            }
            Ev::Command { phase, exit, secs } => {
                let log = format!(
                    "logs/{}/rank-{rank}.{phase}.log",
                    crate::layout::iter_dir(e.iteration)
                );
                if let Some(i) = self.current {
                    self.blocks[i]
                        .notes
                        .push(format!("{phase} command: {exit} after {secs:.3}s"));
                    self.blocks[i].log = Some(log.clone());
                }
                self.commands.push(Span {
                    name: phase.clone(),
                    gen: e.gen,
                    iteration: e.iteration,
                    start: e.t - secs,
                    end: e.t,
                    detail: format!("{exit}; log {log}"),
                });
                if exit != crate::process::EXIT_SUCCESS {
                    self.mark(
                        e,
                        MarkKind::CommandFailed,
                        format!("{phase} command: {exit} after {secs:.3}s; log {log}"),
                    );
                }
            }
            Ev::ServerStart {
                model,
                secs,
                attempt,
            } => {
                let text =
                    format!("inference server up in {secs:.2}s (attempt {attempt}, {model})");
                if *attempt > 1 {
                    self.mark(e, MarkKind::ServerRestart, text.clone());
                }
                self.instant(e, "server-start", text.clone());
                self.note(text);
            }
            Ev::Commit {
                split,
                path,
                adopted,
            } => self.instant(
                e,
                "commit",
                format!(
                    "committed {split} shard {path}{}",
                    if *adopted { " (written in place)" } else { "" }
                ),
            ),
            other => {
                if let Some((kind, text)) = mark_of(other) {
                    self.mark(e, kind, text);
                } else if let Some(text) = note_of(other) {
                    if let Some(name) = instant_name(other) {
                        self.instant(e, name, text.clone());
                    }
                    self.note(text);
                }
            }
        }
        if e.ends_iteration() {
            if let Some(i) = self.current.take() {
                self.blocks[i].end = e.t;
            }
        }
    }

    /// A note on the block the rank is in; outside a block it is dropped.
    fn note(&mut self, text: String) {
        if let Some(i) = self.current {
            self.blocks[i].notes.push(text);
        }
    }

    fn instant(&mut self, e: &Event, name: &str, detail: String) {
        self.instants.push(Instant {
            name: name.into(),
            gen: e.gen,
            iteration: e.iteration,
            t: e.t,
            detail,
        });
    }

    fn mark(&mut self, e: &Event, kind: MarkKind, text: String) {
        self.marks.push(Mark {
            kind,
            t: e.t,
            gen: e.gen,
            iteration: e.iteration,
            text,
        });
    }

    /// After the rank's last event: end the blocks a generation's end left open, and add
    /// the barrier wait the rank is in right now.
    fn close(&mut self, c: &ClusterInput, rank: u32, events: &[Event], live: Option<&LiveRank>) {
        let LaneParts {
            blocks,
            waits,
            current,
            last_t,
            last_work_t,
            ..
        } = self;
        // The block a rank was still in at the end of a generation: open until the rank's
        // last sign of life in it (its last event, or in the current generation its record's
        // last write).
        let last_sign = |gen: u64, start: f64| {
            let event = last_t.get(&gen).copied().unwrap_or(start);
            c.walls.get(&(gen, rank)).map_or(event, |w| event.max(*w))
        };
        if let Some(i) = *current {
            blocks[i].end = last_sign(blocks[i].gen, blocks[i].start);
            blocks[i].open = true;
        }
        // Blocks cut short by a restart (their generation ended while they were in them).
        for i in 0..blocks.len() {
            let next_gen = blocks.get(i + 1).map(|n| n.gen);
            if blocks[i].end == blocks[i].start && next_gen.is_some_and(|g| g != blocks[i].gen) {
                blocks[i].end = last_sign(blocks[i].gen, blocks[i].start);
                blocks[i].open = true;
            }
        }
        // Where a generation ended (or stands now) with the rank at a barrier it arrived
        // at and was not released from, stopped there by a failure or waiting there now:
        // a wait from its last event (its command's end) to its last sign of life, over
        // the block it would have ended, for whom its records say had not arrived.
        let mut last_of_gen: BTreeMap<u64, usize> = BTreeMap::new();
        for (i, b) in blocks.iter().enumerate() {
            last_of_gen.insert(b.gen, i);
        }
        for (gen, i) in last_of_gen {
            let b = &blocks[i];
            let Some(w) = c.waiting.get(&(gen, rank)).filter(|_| b.open) else {
                continue;
            };
            let start = last_work_t
                .get(&gen)
                .copied()
                .unwrap_or(b.start)
                .max(b.start);
            waits.push(Wait {
                barrier: w.barrier.clone(),
                pipeline: false,
                gen,
                iteration: b.iteration,
                k: None,
                start,
                end: last_sign(gen, b.start).max(start),
                open: true,
                waited_for: w.waited_for.clone(),
                dead: Vec::new(),
            });
        }
        // A pipelined cluster waiting for the other one right now (its progress note).
        let what = live
            .filter(|l| l.state == "running")
            .and_then(|l| l.progress.as_deref()?.strip_prefix("waiting for "));
        if let (Some(what), Some(l), Some(b)) = (what, live, blocks.last()) {
            if b.gen == c.gen {
                let start = events.last().map_or(b.start, |e| e.t).min(l.wall);
                waits.push(Wait {
                    barrier: what.to_string(),
                    pipeline: true,
                    gen: b.gen,
                    iteration: b.iteration,
                    k: None,
                    start,
                    end: l.wall,
                    open: true,
                    waited_for: Vec::new(),
                    dead: Vec::new(),
                });
            }
        }
    }
}

/// Name, on every open wait of one cluster's lanes, the ranks waited for that were dead:
/// in the current generation those `status` judges dead, in an earlier one the culprit of
/// its dead-peer abort; each with its last sign of life.
fn mark_dead(lanes: &mut [Lane], c: &ClusterInput) {
    let dead_now: Vec<(u32, f64)> = lanes
        .iter()
        .filter(|l| l.state.as_deref() == Some("dead"))
        .map(|l| (l.rank, l.last_write.unwrap_or(0.0)))
        .collect();
    for l in lanes.iter_mut() {
        for w in l.waits.iter_mut().filter(|w| w.open && !w.pipeline) {
            w.dead = if w.gen == c.gen {
                dead_now
                    .iter()
                    .filter(|d| w.waited_for.contains(&d.0))
                    .copied()
                    .collect()
            } else {
                c.aborts
                    .get(&w.gen)
                    .filter(|a| a.kind == crate::protocol::AbortKind::PeerDead)
                    .filter(|a| w.waited_for.contains(&a.culprit))
                    .and_then(|a| Some((a.culprit, *c.walls.get(&(w.gen, a.culprit))?)))
                    .into_iter()
                    .collect()
            };
        }
    }
}

/// The mark an event that only marks the lane leaves (`None` for the others).
fn mark_of(ev: &Ev) -> Option<(MarkKind, String)> {
    Some(match ev {
        Ev::Retry {
            item,
            task,
            attempt,
            exit,
            delay_ms,
        } => (
            MarkKind::Retry,
            format!("retry {attempt} of item {item} (task {task}) after exit code {exit}, in {delay_ms}ms"),
        ),
        Ev::ItemFailed { item, task, exit } => (
            MarkKind::CommandFailed,
            format!("item {item} (task {task}) failed for good: {exit}"),
        ),
        Ev::TrainFailed {
            failed,
            reason,
            log,
        } => (
            MarkKind::CommandFailed,
            format!("training failed ({failed}): {reason}; log {log}"),
        ),
        Ev::RolloutFailed {
            split,
            failed,
            reason,
            log,
        } => (
            MarkKind::CommandFailed,
            format!("{split} rollout failed ({failed}), merged without it: {reason}; log {log}"),
        ),
        Ev::ServerStartFailed {
            attempt,
            attempts,
            reason,
            retry,
        } => (
            MarkKind::ServerRestart,
            format!(
                "inference server start {attempt}/{attempts} failed: {reason}{}",
                if *retry { "; retrying" } else { "" }
            ),
        ),
        Ev::Fenced { what, why } => (MarkKind::Fenced, format!("fenced: {what}: {why}")),
        Ev::Refused { why } => (MarkKind::Fenced, why.clone()),
        Ev::HangReport { path, why } => (MarkKind::HangReport, format!("hang report {path}: {why}")),
        _ => return None,
    })
}

/// The trace's name for an event that annotates a block, when it is a point in time of
/// its own there.
fn instant_name(ev: &Ev) -> Option<&'static str> {
    match ev {
        Ev::ServerStop { .. } => Some("server-stop"),
        Ev::Handoff { .. } => Some("hand-off"),
        Ev::HandoffSkipped { .. } => Some("hand-off skipped"),
        _ => None,
    }
}

/// The note an event that only annotates the rank's current block adds (`None` for the
/// others).
fn note_of(ev: &Ev) -> Option<String> {
    Some(match ev {
        Ev::ServerStop { secs } => format!("inference server stopped in {secs:.2}s"),
        Ev::Handoff {
            model,
            transfer,
            secs,
            ..
        } => format!("handed off {model} ({transfer}) in {secs:.2}s"),
        Ev::HandoffSkipped { summary, .. } => format!("no hand-off: {summary}"),
        Ev::SurvivorsMerged {
            split,
            merged,
            ranks,
            ..
        } => format!("merged {merged} of {ranks} ranks' {split} shards"),
        _ => return None,
    })
}

/// Who each barrier wait was for: the rank(s) whose arrival (pass time minus wait) came
/// last at that barrier of that generation. Arrival times come from different nodes'
/// clocks, so on a real cluster this is as good as the clocks agree.
fn attribute_waits(lanes: &mut [Lane]) {
    let mut arrivals: HashMap<(u64, u64), Vec<(u32, f64)>> = HashMap::new();
    for l in lanes.iter() {
        for w in &l.waits {
            if let Some(k) = w.k {
                arrivals
                    .entry((w.gen, k))
                    .or_default()
                    .push((l.rank, w.start));
            }
        }
    }
    let last: HashMap<(u64, u64), Vec<u32>> = arrivals
        .into_iter()
        .map(|(key, a)| {
            let latest = a.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
            let mut who: Vec<u32> = a
                .iter()
                .filter(|x| x.1 >= latest - LAST_ARRIVAL_SLACK)
                .map(|x| x.0)
                .collect();
            who.sort_unstable();
            (key, who)
        })
        .collect();
    for l in lanes.iter_mut() {
        let rank = l.rank;
        for w in &mut l.waits {
            if let Some(k) = w.k {
                if let Some(who) = last.get(&(w.gen, k)) {
                    w.waited_for = who.iter().copied().filter(|r| *r != rank).collect();
                }
            }
        }
    }
}

/// Per-iteration times from the coordinator's events (rank 0's, or in elastic mode the
/// lowest member's of a generation that went on without rank 0), where `metrics.jsonl`
/// has none: the newest generation's walk of each iteration.
fn from_events(clusters: &[ClusterInput]) -> Vec<IterStat> {
    let mut out = Vec::new();
    for c in clusters {
        let coordinator = |gen: u64| {
            c.members
                .get(&gen)
                .and_then(|m| m.first())
                .copied()
                .unwrap_or(0)
        };
        let mut events: Vec<Event> = c
            .events
            .iter()
            .enumerate()
            .flat_map(|(rank, events)| {
                events
                    .iter()
                    .filter(move |e| coordinator(e.gen) == rank as u32)
                    .cloned()
            })
            .collect();
        if events.is_empty() {
            continue;
        }
        // Each generation's events in order, generations in order.
        events.sort_by_key(|e| e.gen);
        let events = &events;
        let mut by_it: BTreeMap<u64, IterStat> = BTreeMap::new();
        let mut done: Vec<(u64, u64)> = events
            .iter()
            .filter(|e| e.ends_iteration())
            .map(|e| (e.gen, e.iteration))
            .collect();
        done.dedup();
        for (gen, it) in done {
            if let Some((total, phases)) = crate::observe::eventlog::phase_times(events, gen, it) {
                by_it.insert(
                    it,
                    IterStat {
                        cluster: c.name.map(str::to_string),
                        iteration: it,
                        total,
                        phases,
                        value: None,
                    },
                );
            }
        }
        out.extend(by_it.into_values());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::AbortKind;

    fn ev(gen: u64, iteration: u64, t: f64, event: Ev) -> Event {
        Event {
            gen,
            iteration,
            event,
            t,
        }
    }

    fn phase(gen: u64, it: u64, t: f64, p: Phase) -> Event {
        ev(
            gen,
            it,
            t,
            Ev::Phase {
                phase: p,
                n: p.number(),
            },
        )
    }

    fn barrier(gen: u64, it: u64, t: f64, name: &str, k: u64, waited_ms: u64) -> Event {
        ev(
            gen,
            it,
            t,
            Ev::Barrier {
                name: name.into(),
                k,
                waited_ms,
            },
        )
    }

    /// Two ranks, one iteration: rank 1 arrives late at `rollout-complete`, so rank 0
    /// waits for it; rank 1's rollout command fails in generation 2 after a restart.
    fn input() -> Input {
        let r0 = vec![
            ev(1, 0, 100.0, Ev::Generation { previous: None }),
            phase(1, 1, 100.0, Phase::SyncStart),
            barrier(1, 1, 100.5, "sync-start", 1, 500),
            phase(1, 1, 100.5, Phase::TrainRollout),
            phase(1, 1, 101.0, Phase::RolloutComplete),
            barrier(1, 1, 104.0, "rollout-complete", 2, 3000),
            phase(1, 1, 104.0, Phase::FinalSync),
            barrier(1, 1, 104.1, "final-sync", 3, 100),
            ev(
                2,
                0,
                200.0,
                Ev::Generation {
                    previous: Some("generation 1 stopped".into()),
                },
            ),
            phase(2, 2, 200.0, Phase::SyncStart),
        ];
        let r1 = vec![
            phase(1, 1, 100.0, Phase::SyncStart),
            barrier(1, 1, 100.5, "sync-start", 1, 0),
            phase(1, 1, 100.5, Phase::TrainRollout),
            ev(
                1,
                1,
                103.9,
                Ev::Command {
                    phase: "rollout".into(),
                    exit: "exit code 0".into(),
                    secs: 3.4,
                },
            ),
            phase(1, 1, 103.9, Phase::RolloutComplete),
            barrier(1, 1, 104.0, "rollout-complete", 2, 0),
            phase(1, 1, 104.0, Phase::FinalSync),
            barrier(1, 1, 104.1, "final-sync", 3, 0),
            phase(2, 2, 200.1, Phase::TrainRollout),
            ev(
                2,
                2,
                201.0,
                Ev::Command {
                    phase: "rollout".into(),
                    exit: "exit code 3".into(),
                    secs: 0.9,
                },
            ),
        ];
        let abort = AbortInfo {
            kind: AbortKind::CommandFailed {
                exit: "exit code 3".into(),
            },
            culprit: 1,
            culprit_host: "h1".into(),
            phase: "train-rollout".into(),
            iteration: 2,
            reason: "the rollout command failed with exit code 3".into(),
            log: None,
            detected_by: 1,
            silent_ms: None,
            at: "1970-01-01T00:03:21.500+00:00".into(),
            cluster: None,
            detected_in: None,
            dropped: false,
        };
        Input {
            clusters: vec![ClusterInput {
                name: None,
                events: vec![r0, r1],
                hosts: [((1, 0), "h0".to_string()), ((2, 1), "h1".to_string())]
                    .into_iter()
                    .collect(),
                walls: [((2, 1), 205.0)].into_iter().collect(),
                aborts: [(2, abort)].into_iter().collect(),
                waiting: HashMap::new(),
                gen: 2,
                live: vec![None, None],
                members: BTreeMap::new(),
            }],
            metrics: vec![],
            field: "reward".into(),
            values: BTreeMap::new(),
            iterations: None,
        }
    }

    #[test]
    fn blocks_follow_phases_and_end_at_the_final_barrier() {
        let t = build(input());
        assert_eq!(t.lanes.len(), 2);
        let b: Vec<(Phase, f64, f64)> = t.lanes[0]
            .blocks
            .iter()
            .map(|b| (b.phase, b.start, b.end))
            .collect();
        assert_eq!(
            b,
            [
                (Phase::SyncStart, 100.0, 100.5),
                (Phase::TrainRollout, 100.5, 101.0),
                (Phase::RolloutComplete, 101.0, 104.0),
                (Phase::FinalSync, 104.0, 104.1),
                (Phase::SyncStart, 200.0, 200.0),
            ]
        );
        assert!(t.lanes[0].blocks[4].open);
        assert_eq!(t.lanes[0].blocks[0].host, "h0");
        assert_eq!(t.lanes[1].host, "h1");
        // Rank 1's rollout block has its command and log.
        let rollout = &t.lanes[1].blocks[1];
        assert_eq!(
            rollout.log.as_deref(),
            Some("logs/iter-0001/rank-1.rollout.log")
        );
        assert!(
            rollout.notes[0].contains("exit code 0"),
            "{:?}",
            rollout.notes
        );
        // Its generation-2 block is open: it lasts until the rank's record's last write,
        // after its last event.
        let last = t.lanes[1].blocks.last().unwrap();
        assert_eq!((last.gen, last.end, last.open), (2, 205.0, true));
    }

    #[test]
    fn a_wait_names_the_rank_that_arrived_last() {
        let t = build(input());
        let w = t.lanes[0]
            .waits
            .iter()
            .find(|w| w.barrier == "rollout-complete")
            .unwrap();
        assert_eq!((w.start, w.end), (101.0, 104.0));
        assert_eq!(w.waited_for, [1]);
        // Rank 1 arrived last: it waited for nobody else.
        let w1 = t.lanes[1]
            .waits
            .iter()
            .find(|w| w.barrier == "rollout-complete")
            .unwrap();
        assert!(w1.waited_for.is_empty(), "{:?}", w1.waited_for);
    }

    #[test]
    fn failures_and_generations_are_marked_with_their_reason() {
        let t = build(input());
        let marks = &t.lanes[1].marks;
        assert!(marks
            .iter()
            .any(|m| m.kind == MarkKind::CommandFailed && m.text.contains("exit code 3")));
        let f = marks.iter().find(|m| m.kind == MarkKind::Failure).unwrap();
        assert_eq!(f.t, 201.5);
        assert!(f.text.contains("exit code 3"), "{}", f.text);
        assert!(t.lanes[0].marks.is_empty());
        let gens: Vec<(u64, Option<&str>)> = t
            .generations
            .iter()
            .map(|g| (g.gen, g.previous.as_deref()))
            .collect();
        assert_eq!(gens, [(1, None), (2, Some("generation 1 stopped"))]);
        assert_eq!((t.start, t.end), (100.0, 205.0));
    }

    #[test]
    fn iteration_times_fall_back_to_rank_0s_events() {
        let t = build(input());
        assert!(!t.from_metrics);
        assert_eq!(t.iterations.len(), 1);
        let s = &t.iterations[0];
        assert_eq!(s.iteration, 1);
        assert!((s.total - 4.1).abs() < 1e-9, "{}", s.total);
        assert_eq!(s.phases[0].0, "sync-start");
    }

    #[test]
    fn an_iteration_range_keeps_only_its_blocks() {
        let mut i = input();
        i.iterations = Some(2..=2);
        let t = build(i);
        assert!(t
            .lanes
            .iter()
            .all(|l| l.blocks.iter().all(|b| b.iteration == 2)));
        assert_eq!(t.lanes[0].blocks.len(), 1);
        assert_eq!(t.start, 200.0);
        assert!(t.iterations.is_empty());
        let gens: Vec<u64> = t.generations.iter().map(|g| g.gen).collect();
        assert_eq!(gens, [2]);
    }

    /// Rank 0 stopped in generation 2 at a barrier it had arrived at, waiting for rank 1,
    /// whom status judges dead: the block it stopped in carries an open wait from its last
    /// event to its last sign of life, naming rank 1 and when rank 1 was last alive.
    #[test]
    fn a_rank_stopped_at_a_barrier_waited_there_for_the_dead_rank() {
        let mut i = input();
        let c = &mut i.clusters[0];
        c.waiting.insert(
            (2, 0),
            Waiting {
                barrier: "sync-start".into(),
                waited_for: vec![1],
            },
        );
        c.walls.insert((2, 0), 204.0);
        c.live = vec![
            Some(LiveRank {
                wall: 204.0,
                state: "stopped by a peer".into(),
                progress: None,
            }),
            Some(LiveRank {
                wall: 201.2,
                state: "dead".into(),
                progress: None,
            }),
        ];
        let t = build(i);
        let w = t.lanes[0].waits.iter().find(|w| w.open).unwrap();
        assert_eq!((w.gen, w.start, w.end), (2, 200.0, 204.0));
        assert_eq!(w.barrier, "sync-start");
        assert_eq!(w.waited_for, [1]);
        assert_eq!(w.dead, [(1, 201.2)]);
        assert_eq!(t.lanes[1].state.as_deref(), Some("dead"));
        // Rank 1 waits at no barrier: it has no open wait.
        assert!(t.lanes[1].waits.iter().all(|w| !w.open));
    }

    /// A pipelined cluster's wait for the other one is a wait, not part of the phase.
    #[test]
    fn a_pipelined_wait_is_a_wait() {
        let mut i = input();
        i.clusters[0].events[0].push(ev(
            2,
            2,
            200.5,
            Ev::PipelineWait {
                what: "the trajectories of iteration 2".into(),
                secs: 0.4,
            },
        ));
        let t = build(i);
        let w = t.lanes[0].waits.iter().find(|w| w.pipeline).unwrap();
        assert_eq!(w.barrier, "the trajectories of iteration 2");
        assert!((w.start - 200.1).abs() < 1e-9 && w.end == 200.5, "{w:?}");
    }

    /// Nothing ran between generation 1's last event (104.1) and generation 2's start
    /// (200): that stretch is downtime; the useful time is iteration 1's.
    #[test]
    fn the_time_between_generations_is_downtime() {
        let t = build(input());
        assert_eq!(
            t.downtime,
            [Downtime {
                start: 104.1,
                end: 200.0,
                gens: vec![2]
            }]
        );
        assert_eq!(t.useful.len(), 1);
        assert!((t.useful[0].1 - 4.1).abs() < 1e-9, "{:?}", t.useful);
    }

    /// A pipelined cluster's rank 0 waiting for the other cluster right now (its record's
    /// progress note): an open wait from its last event to its record's last write.
    #[test]
    fn a_cluster_waiting_for_the_other_now_has_an_open_wait() {
        let mut i = input();
        i.clusters[0].live = vec![
            Some(LiveRank {
                wall: 203.0,
                state: "running".into(),
                progress: Some("waiting for the trajectories of iteration 2".into()),
            }),
            None,
        ];
        let t = build(i);
        let w = t.lanes[0].waits.iter().find(|w| w.pipeline).unwrap();
        assert_eq!(w.barrier, "the trajectories of iteration 2");
        assert_eq!((w.start, w.end, w.open), (200.0, 203.0, true));
    }

    /// Elastic mode, 3 ranks: rank 0 dies in generation 1's rollout; ranks 1 and 2 regroup
    /// into generation 2 (rank 1 coordinates) and complete iteration 2; every node started
    /// again forms generation 3, which takes rank 0 back.
    fn elastic_input() -> Input {
        let gen1 = |t0: f64| {
            vec![
                phase(1, 1, t0, Phase::SyncStart),
                barrier(1, 1, t0 + 0.5, "sync-start", 1, 0),
                phase(1, 1, t0 + 0.5, Phase::TrainRollout),
            ]
        };
        let mut r0 = vec![ev(1, 0, 100.0, Ev::Generation { previous: None })];
        r0.extend(gen1(100.0));
        r0.push(ev(
            3,
            0,
            199.9,
            Ev::Generation {
                previous: Some("generation 2 stopped".into()),
            },
        ));
        r0.push(phase(3, 3, 200.0, Phase::SyncStart));
        let survivor = |rank: u32| {
            let mut v = gen1(100.0);
            v.push(phase(1, 1, 101.0, Phase::RolloutComplete));
            v.push(ev(
                1,
                2,
                104.0,
                Ev::MemberLost {
                    lost: 0,
                    reason: "heartbeat still for 3.0s".into(),
                },
            ));
            v.push(ev(
                2,
                0,
                104.1 + f64::from(rank - 1) * 0.05,
                Ev::Regrouped {
                    members: vec![1, 2],
                    coordinator: 1,
                },
            ));
            v.push(barrier(2, 0, 104.2, "regrouped", 1, 0));
            v.push(phase(2, 2, 104.2, Phase::SyncStart));
            v.push(phase(2, 2, 105.0, Phase::FinalSync));
            v.push(barrier(2, 2, 106.0, "final-sync", 2, 0));
            v.push(phase(3, 3, 200.0, Phase::SyncStart));
            v
        };
        let abort = AbortInfo {
            kind: AbortKind::PeerDead,
            culprit: 0,
            culprit_host: "h0".into(),
            phase: "1 (train-rollout)".into(),
            iteration: 2,
            reason: "heartbeat still for 3.0s".into(),
            log: None,
            detected_by: 2,
            silent_ms: Some(3000),
            at: "1970-01-01T00:01:44.000+00:00".into(),
            cluster: None,
            detected_in: None,
            dropped: false,
        };
        Input {
            clusters: vec![ClusterInput {
                name: None,
                events: vec![r0, survivor(1), survivor(2)],
                hosts: HashMap::new(),
                walls: [((1, 0), 101.0)].into_iter().collect(),
                aborts: [(1, abort)].into_iter().collect(),
                waiting: HashMap::new(),
                gen: 3,
                live: vec![None, None, None],
                members: [(1, vec![0, 1, 2]), (2, vec![1, 2]), (3, vec![0, 1, 2])]
                    .into_iter()
                    .collect(),
            }],
            metrics: vec![],
            field: "reward".into(),
            values: BTreeMap::new(),
            iterations: None,
        }
    }

    /// The regroup is a membership change at the coordinator's `regrouped` event, naming
    /// the rank dropped and why; the restart that takes it back is one too; the dropped
    /// rank's lane has no membership from the one to the other.
    #[test]
    fn a_dropped_rank_s_lane_ends_at_the_regroup_and_resumes_when_it_is_back() {
        let t = build(elastic_input());
        let gens: Vec<(u64, f64, Option<Membership>)> = t
            .generations
            .iter()
            .map(|g| (g.gen, g.t, g.membership.clone()))
            .collect();
        assert_eq!(
            gens,
            [
                (1, 100.0, None),
                (
                    2,
                    104.1,
                    Some(Membership {
                        members: vec![1, 2],
                        dropped: vec![(0, "heartbeat still for 3.0s".into())],
                        rejoined: vec![],
                        regrouped: true,
                    })
                ),
                (
                    3,
                    199.9,
                    Some(Membership {
                        members: vec![0, 1, 2],
                        dropped: vec![],
                        rejoined: vec![0],
                        regrouped: false,
                    })
                ),
            ]
        );
        assert_eq!(
            t.generations[1].membership.as_ref().unwrap().short(),
            "rank 0 dropped"
        );
        assert!(t.generations[1]
            .ended
            .as_ref()
            .unwrap()
            .contains("rank 0 on h0 is dead"));
        assert_eq!(
            t.lanes[0].absent,
            [Absence {
                from: 104.1,
                until: Some(199.9),
                dropped_from: 2,
                back_in: Some(3),
                why: "heartbeat still for 3.0s".into(),
            }]
        );
        assert!(t.lanes[1].absent.is_empty() && t.lanes[2].absent.is_empty());
        // Rank 0's last block ends at its last sign of life, before the regroup.
        let last = t.lanes[0].blocks.iter().rfind(|b| b.gen == 1).unwrap();
        assert_eq!(
            (last.phase, last.end, last.open),
            (Phase::TrainRollout, 101.0, true)
        );
    }

    /// Without metrics.jsonl, the iterations of a generation that went on without rank 0
    /// are timed from its coordinator's events (rank 1), and count in the goodput.
    #[test]
    fn iterations_without_rank_0_are_timed_by_their_coordinator() {
        let t = build(elastic_input());
        let its: Vec<(u64, f64)> = t
            .iterations
            .iter()
            .map(|s| (s.iteration, (s.total * 1000.0).round() / 1000.0))
            .collect();
        assert_eq!(its, [(2, 1.8)]);
        assert!((t.useful[0].1 - 1.8).abs() < 1e-9, "{:?}", t.useful);
    }
}
