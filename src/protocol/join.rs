//! Joining a generation: what a worker concludes from one look at the shared directory,
//! and which run rank 0 starts a generation of.
//!
//! A worker waits for a joinable generation: rank 0 alive and still joining. A generation
//! that ended, or formed without this rank, is skipped, so a worker started long before
//! its master simply waits. Refusals (a different configuration, the rank held by a live
//! process) come before the worker writes anything, with words that name what differs.
//!
//! Rank 0's side: [`previous_master`] (does the previous generation's rank 0 still run?),
//! [`previous_end`] (how the previous generation ended, for the history),
//! [`first_free_generation`] (the number of the new generation's directory), and
//! [`Forming`], one round of its wait for every rank to arrive.
//!
//! The join's marks are those of barrier 0 ([`barrier`]): each rank's arrival, and rank
//! 0's release, carry the process holding the record ([`Joined`]), which no rank acts on.
//!
//! [`look`] is the worker's decision. It reads nothing itself: the records it needs are
//! asked of a [`JoinView`] when (and only if) the decision gets to them, so a look at a
//! generation already skipped costs one read, as before. The view is the worker's
//! [`super::join_machine::JoinMachine`], which asks its driver (the node, or the
//! simulator) for each read as an effect and judges a holder by what the kernel says of
//! its process or by its heartbeat (`liveness::Holders`).

use super::barrier::Barrier;
use super::liveness::{Holder, PROOF_FOR_REFUSAL};
use super::messages::Joined;
use super::{ClusterRecord, NodeState, RankRecord};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

/// What was read of `cluster.json`.
#[derive(Debug, Clone, Copy)]
pub enum ClusterSeen<'a> {
    /// It does not exist (yet): the path.
    Missing(&'a Path),
    /// It exists but cannot be used: why.
    Unreadable(&'a str),
    Cluster(&'a ClusterRecord),
}

/// The generations a worker decided never to join, each named by its run and number: a
/// new run (`--fresh`) starts at generation 1 again, which a skipped generation 1 of the
/// run it set aside must not hide (the worker then waited for the new run's rank 0 until
/// join-timeout).
#[derive(Debug, Clone, Default)]
pub struct Skipped(HashSet<(String, u64)>);

impl Skipped {
    pub fn insert(&mut self, run_id: &str, gen: u64) {
        self.0.insert((run_id.to_string(), gen));
    }

    pub fn contains(&self, run_id: &str, gen: u64) -> bool {
        self.0.contains(&(run_id.to_string(), gen))
    }

    /// [`Skipped::contains`], or (`SkippedByNumberOnly`) a generation of that number in any
    /// run.
    fn hides(&self, run_id: &str, gen: u64, mutation: Option<Mutation>) -> bool {
        if mutation == Some(Mutation::SkippedByNumberOnly) {
            return self.0.iter().any(|(_, g)| *g == gen);
        }
        self.contains(run_id, gen)
    }
}

/// The worker that looks.
#[derive(Clone)]
pub struct Joiner<'a> {
    pub rank: u32,
    pub nonce: &'a str,
    /// The fingerprint of the configuration every node must share, and that view itself
    /// (built only to word a refusal).
    pub fingerprint: &'a str,
    pub shared_view: &'a dyn Fn() -> Value,
    /// The fingerprint of what may not change across restarts of one run (computed only
    /// when an ended run's completion is in question).
    pub run_fingerprint: &'a dyn Fn() -> String,
    /// `--iterations` (0: no target).
    pub iterations: u64,
    /// How long a previous holder of the rank may stay silent before it counts as gone;
    /// never less than `dead_after` (a holder on another host is seen through a cache).
    pub slot_patience: Duration,
    pub dead_after: Duration,
    /// Started with `--fresh`: the run this worker found at its first look, which rank 0,
    /// started with `--fresh` as well, sets aside. Never taken as complete: a worker that
    /// looked before rank 0 set it aside ended with "nothing to do" while rank 0 waited
    /// for it in the new run. (It is still joined while its rank 0 forms a generation: then
    /// it is the new run, or a live rank 0 keeps it, and rank 0 refuses to start.)
    pub set_aside: Option<&'a str>,
}

/// The reads a look may need, done when asked.
pub trait JoinView {
    /// Rank 0's record of generation `gen`, if it can be read.
    fn rank0(&mut self, gen: u64) -> Option<RankRecord>;
    /// This rank's own record (its placeholder, or a previous holder's) in generation `gen`.
    fn slot(&mut self, gen: u64) -> Option<RankRecord>;
    /// Is the process behind `rec` alive (its heartbeat advanced `advances` times while
    /// watched, or the kernel says so), gone (not within `patience`), or not yet known?
    fn holder(&mut self, rec: &RankRecord, patience: Duration, advances: u32) -> Holder;
    /// Where run `run_id` would resume: the first iteration not every rank completed.
    fn resume_iteration(&mut self, run_id: &str) -> u64;
}

/// What one look concluded.
#[derive(Debug, Clone, PartialEq)]
pub enum Look {
    /// Keep waiting; the new "still waiting for" note, if it changed.
    Wait(Option<String>),
    /// Never join generation `gen` of run `run_id`; why, for the log, if worth a line.
    Skip {
        run_id: String,
        gen: u64,
        why: Option<String>,
    },
    /// The run is already complete up to `--iterations`: nothing to do (exit 0).
    Complete { message: String, hint: String },
    /// Refused: the rank is held by a live process, or the configuration differs. When
    /// the rank's placeholder should say why (rank 0 reads it while it waits), `note`.
    Refused {
        message: String,
        hint: String,
        note: Option<String>,
    },
    /// Join this generation, whose rank 0 is `rank0`.
    Join(Box<ClusterRecord>, Box<RankRecord>),
}

/// A deliberately broken look, for the simulator's own tests (never set by the node):
/// shows that the simulator (`tests/sim/joins.rs`) catches it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A generation whose rank 0 ended (a terminal record) or is gone (still for
    /// dead-after) is joined anyway.
    JoinEndedGenerations,
    /// A rank held by another process is taken as free.
    StealLiveSlots,
    /// The rank's holder is judged by `slot_patience` alone, as before the simulator
    /// found (tests/sim/joins.rs) that an attribute cache longer than that hides a live
    /// holder's heartbeat.
    SlotPatienceOnly,
    /// Rank 0 starts a new generation without asking whether the previous generation's
    /// rank 0 still runs.
    IgnorePreviousMaster,
    /// One advance of a holder's heartbeat proves it alive before a refusal, as before a
    /// 100,000-seed run of the join scenario found that a cache can show a dead process's
    /// last heartbeat as an advance.
    OneAdvanceProves,
    /// A skipped generation is remembered by its number only, as before every node started
    /// at once with `--fresh` was found to hang: generation 1 of the run set aside, skipped,
    /// hides generation 1 of the new run (tests/sim/fresh.rs).
    SkippedByNumberOnly,
    /// The run a `--fresh` worker read first may end its wait as complete, as before the
    /// same was found: a worker that looked before rank 0 set that run aside exits 0 with
    /// "nothing to do" (tests/sim/fresh.rs).
    EndAtTheRunSetAside,
}

/// The advances that prove a holder alive before a refusal, under `mutation`.
fn refusal_proof(mutation: Option<Mutation>) -> u32 {
    if mutation == Some(Mutation::OneAdvanceProves) {
        1
    } else {
        PROOF_FOR_REFUSAL
    }
}

/// How long a rank's previous holder (or a previous rank 0) may stay silent before it
/// counts as gone. A holder on another host is seen through an attribute cache that may
/// hide its heartbeat for longer than `slot_patience` (up to a minute on NFS); dead-after
/// is what the configuration sizes for that.
fn holder_patience(
    slot_patience: Duration,
    dead_after: Duration,
    mutation: Option<Mutation>,
) -> Duration {
    if mutation == Some(Mutation::SlotPatienceOnly) {
        slot_patience
    } else {
        slot_patience.max(dead_after)
    }
}

/// Rank 0's look at the previous generation's rank 0 before it starts a new generation
/// (at each poll of `run_machine::RunMachine`'s wait), given its record as read now: gone
/// once the record ended; otherwise what `judge` says of the process behind it with the
/// holder's patience (alive: refuse to start, with [`previous_master_refusal`]; unknown:
/// look again).
pub fn previous_master(
    r0: &RankRecord,
    slot_patience: Duration,
    dead_after: Duration,
    judge: impl FnOnce(&RankRecord, Duration, u32) -> Holder,
    mutation: Option<Mutation>,
) -> Holder {
    let mutation = super::mutation(mutation);
    if r0.state.is_terminal() || mutation == Some(Mutation::IgnorePreviousMaster) {
        return Holder::Gone;
    }
    judge(
        r0,
        holder_patience(slot_patience, dead_after, mutation),
        refusal_proof(mutation),
    )
}

/// How the previous generation ended, as its rank 0's record says.
#[derive(Debug, Clone, PartialEq)]
pub enum PreviousEnd {
    /// It completed or stopped: the words for the history and the log.
    Ended(String),
    /// Its rank 0 never wrote a terminal record: it may still run
    /// ([`previous_master`] decides), else it crashed ([`PreviousEnd::unclean`] words it).
    Unclean,
}

/// How generation `gen` ended, from its rank 0's record `r0`.
pub fn previous_end(gen: u64, r0: &RankRecord) -> PreviousEnd {
    match r0.state {
        NodeState::Done => PreviousEnd::Ended(format!("generation {gen} completed")),
        NodeState::Failed => PreviousEnd::Ended(format!(
            "generation {gen} stopped: {}",
            r0.abort
                .as_ref()
                .map(|a| a.describe())
                .unwrap_or_else(|| "failure".into())
        )),
        _ => PreviousEnd::Unclean,
    }
}

impl PreviousEnd {
    /// The words for a generation whose rank 0 (`r0`) stopped heartbeating.
    pub fn unclean(gen: u64, r0: &RankRecord) -> String {
        format!(
            "generation {gen} ended without a clean stop (rank 0, pid {} on {}, stopped heartbeating)",
            r0.pid, r0.host
        )
    }
}

/// The number of the new generation's directory: at least `wanted` (one above
/// `cluster.json`'s) and above every `gen-N` in `listing` (the state directory's names),
/// so records left by an earlier start are never read as the new generation's. The caller
/// creates `gen-N` exclusively and, if it exists after all (another rank 0 was quicker),
/// tries the next number.
pub fn first_free_generation(wanted: u64, listing: &[OsString]) -> u64 {
    let highest = listing
        .iter()
        .filter_map(|name| name.to_str()?.strip_prefix("gen-")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    wanted.max(highest + 1)
}

/// The join is barrier 0 of a generation, at iteration 0: a rank gathers, and rank 0
/// broadcasts, the process that holds its record.
pub type JoinBarrier = Barrier<Option<Joined>, Option<Joined>>;

/// The join as `rank`, the process `me`: its [`Barrier::arrival`], and rank 0's
/// [`Barrier::release`] (with its own process again).
pub fn barrier(rank: u32, me: Joined) -> JoinBarrier {
    Barrier::new(0, rank, 0, "join", Some(me))
}

/// Rank 0's wait for every rank to arrive at the join (barrier 0), one round at a time.
#[derive(Debug, Clone, Default)]
pub struct Forming {
    /// The ranks missing at the last round (what rank 0's record says it waits for).
    last: Vec<u32>,
    /// Refusals already reported.
    reported: HashSet<String>,
}

/// What one round of [`Forming`] concluded.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FormingRound {
    /// Every rank arrived: release the join.
    pub complete: bool,
    /// The ranks still missing, when that changed since the last round (to publish as
    /// `waiting_for`).
    pub waiting_for: Option<Vec<u32>>,
    /// Refusals read in missing ranks' placeholders for the first time (to report once).
    pub refusals: Vec<String>,
}

impl Forming {
    /// One round: `peers` as read (index = rank; rank 0's own first), `refused` the
    /// refusal notes read in still-vacant placeholders.
    pub fn round(
        &mut self,
        peers: &[Option<RankRecord>],
        refused: &HashMap<u32, String>,
    ) -> FormingRound {
        let missing = super::missing_arrivals(peers, 0);
        if missing.is_empty() {
            return FormingRound {
                complete: true,
                ..FormingRound::default()
            };
        }
        let refusals = missing
            .iter()
            .filter_map(|r| refused.get(r))
            .filter(|why| self.reported.insert((*why).clone()))
            .cloned()
            .collect();
        let waiting_for = (missing != self.last).then(|| missing.clone());
        self.last = missing;
        FormingRound {
            complete: false,
            waiting_for,
            refusals,
        }
    }

    /// The ranks missing at the last round.
    pub fn missing(&self) -> &[u32] {
        &self.last
    }
}

/// The refusal (message, hint) of a rank 0 whose predecessor `r0` still runs.
pub fn previous_master_refusal(r0: &RankRecord) -> (String, String) {
    (
        format!(
            "rank 0 is already held by a live process: pid {} on {} (generation {}, last phase {})",
            r0.pid,
            r0.host,
            r0.gen,
            r0.phase
                .map(|p| p.to_string())
                .unwrap_or_else(|| "join".into())
        ),
        "stop that process first, or use another --log-path for a separate run".into(),
    )
}

/// One look for a generation to join, given what was read of `cluster.json` and the
/// generations already skipped.
pub fn look(seen: ClusterSeen, skipped: &Skipped, me: &Joiner, view: &mut dyn JoinView) -> Look {
    look_with(seen, skipped, me, view, None)
}

#[doc(hidden)]
pub fn look_with(
    seen: ClusterSeen,
    skipped: &Skipped,
    me: &Joiner,
    view: &mut dyn JoinView,
    mutation: Option<Mutation>,
) -> Look {
    let mutation = super::mutation(mutation);
    let join_ended = mutation == Some(Mutation::JoinEndedGenerations);
    let c = match seen {
        ClusterSeen::Missing(path) => {
            return Look::Wait(Some(format!(
                "no cluster record at {} yet: is rank 0 started?",
                path.display()
            )))
        }
        ClusterSeen::Unreadable(why) => {
            // Rank 0 refuses to start over this; say so while waiting for it.
            return Look::Wait(Some(format!(
                "{why} (rank 0 will not start until it is repaired)"
            )));
        }
        ClusterSeen::Cluster(c) => c,
    };
    // The run's journals say every iteration this worker was asked for is done: nothing
    // to join (rank 0, started the same way, says the same and starts no generation).
    // Not the run a --fresh start sets aside, though: that one ends nothing.
    let aside =
        me.set_aside == Some(c.run_id.as_str()) && mutation != Some(Mutation::EndAtTheRunSetAside);
    let may_end = me.iterations > 0 && !join_ended && !aside;
    let complete = |view: &mut dyn JoinView| -> Option<Look> {
        if !may_end || c.run_fingerprint != (me.run_fingerprint)() {
            return None;
        }
        let resume = view.resume_iteration(&c.run_id);
        (resume > me.iterations).then(|| Look::Complete {
            message: format!(
                "run {} already completed iteration {} (--iterations {}): nothing to do",
                c.run_id,
                resume - 1,
                me.iterations
            ),
            hint: "a larger --iterations extends the run; to start a new run instead, give --fresh to every node".into(),
        })
    };
    if skipped.hides(&c.run_id, c.gen, mutation) {
        // A generation skipped while it ran may since have completed the run (one read
        // of rank 0's record per look, and only when the run has an end).
        if may_end
            && view
                .rank0(c.gen)
                .is_some_and(|r0| r0.state == NodeState::Done && r0.run_id == c.run_id)
        {
            if let Some(done) = complete(view) {
                return done;
            }
        }
        return Look::Wait(None);
    }
    let r0 = match view.rank0(c.gen) {
        // Another run's: cluster.json was replaced since it was read (a --fresh rank 0
        // set this run aside and started generation 1 of a new one). Read it again.
        Some(r0) if r0.run_id != c.run_id => return Look::Wait(None),
        Some(r0) => r0,
        None => {
            // Rank 0 publishes its record before cluster.json: missing now, it was lost
            // (an unsynced live record on a machine that crashed) or damaged. The run may
            // be complete all the same (seed 411 of the driver scenario); otherwise wait
            // for rank 0 to start a new generation.
            if let Some(done) = complete(view) {
                return done;
            }
            return Look::Wait(None);
        }
    };
    if r0.state.is_terminal() && !join_ended {
        if let Some(done) = complete(view) {
            return done;
        }
        return Look::Skip {
            run_id: c.run_id.clone(),
            gen: c.gen,
            why: Some(waiting_for_new(
                c,
                aside,
                &format!("has ended ({:?})", r0.state),
            )),
        };
    }
    if let Some(look) = held_elsewhere(c, me, view, mutation) {
        return look;
    }
    if r0.state != NodeState::Joining && !(join_ended && r0.state.is_terminal()) {
        // Running, or its rank 0 died: the run may be complete all the same (a rank 0
        // killed after the last iteration's commits never wrote "done").
        if let Some(done) = complete(view) {
            return done;
        }
        return Look::Skip {
            run_id: c.run_id.clone(),
            gen: c.gen,
            why: Some(waiting_for_new(
                c,
                aside,
                "is already running without this rank",
            )),
        };
    }
    // A joinable rank 0: one advance will do (a worker that joins a rank 0 that died
    // meanwhile leaves again when it stays still; a refusal could not be undone).
    match view.holder(&r0, me.dead_after, 1) {
        Holder::Alive => {}
        Holder::Unknown => {
            return Look::Wait(Some(format!(
                "checking that rank 0 of generation {} (pid {} on {}) is alive",
                c.gen, r0.pid, r0.host
            )))
        }
        Holder::Gone if join_ended => {}
        Holder::Gone => {
            return Look::Skip {
                run_id: c.run_id.clone(),
                gen: c.gen,
                why: None,
            }
        }
    }
    if c.fingerprint != me.fingerprint {
        return refused_configuration(c, me);
    }
    Look::Join(Box::new(c.clone()), Box::new(r0))
}

/// Is this rank held in generation `c.gen` by another process (not a placeholder, not
/// ended)? Alive: refused; not yet known: wait; gone, or not held: None (look on).
fn held_elsewhere(
    c: &ClusterRecord,
    me: &Joiner,
    view: &mut dyn JoinView,
    mutation: Option<Mutation>,
) -> Option<Look> {
    let s = view
        .slot(c.gen)
        .filter(|s| s.run_id == c.run_id)
        .filter(|s| s.state != NodeState::Vacant && !s.state.is_terminal() && s.nonce != me.nonce)
        .filter(|_| mutation != Some(Mutation::StealLiveSlots))?;
    let patience = holder_patience(me.slot_patience, me.dead_after, mutation);
    match view.holder(&s, patience, refusal_proof(mutation)) {
        Holder::Alive => {
            Some(Look::Refused {
                message: format!(
                "rank {} is already held by a live process: pid {} on {} (generation {}, phase {})",
                me.rank,
                s.pid,
                s.host,
                c.gen,
                s.phase.map(|p| p.to_string()).unwrap_or_else(|| "join".into())
            ),
                hint: "each rank runs once per cluster: check --worker / RANK on this node".into(),
                note: None,
            })
        }
        Holder::Unknown => Some(Look::Wait(Some(format!(
            "checking whether rank {}'s previous holder (pid {} on {}) is alive",
            me.rank, s.pid, s.host
        )))),
        Holder::Gone => None,
    }
}

/// Why a worker skips generation `c.gen`, which `what` (has ended, runs without it), and
/// what it waits for instead: a new generation, or (`aside`) the new run of a --fresh
/// start.
fn waiting_for_new(c: &ClusterRecord, aside: bool, what: &str) -> String {
    if aside {
        format!(
            "generation {} of run {} {what}; --fresh: waiting for rank 0 to set run {} aside and start a new run",
            c.gen, c.run_id, c.run_id
        )
    } else {
        format!(
            "generation {} {what}; waiting for rank 0 to start a new generation",
            c.gen
        )
    }
}

/// The worker's configuration differs from rank 0's: say which keys, to the worker and
/// (in its placeholder) to rank 0.
fn refused_configuration(c: &ClusterRecord, me: &Joiner) -> Look {
    let diffs = diff_json(&c.config, &(me.shared_view)(), "");
    let note = if diffs.is_empty() {
        "its configuration differs from rank 0's (fingerprints differ)".to_string()
    } else {
        diffs
            .iter()
            .map(|d| {
                d.replacen(": rank 0 has", " differs (rank 0 has", 1)
                    .replace("this node has", &format!("rank {} has", me.rank))
                    + ")"
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    Look::Refused {
        message: format!(
            "this node's configuration differs from rank 0's (generation {}, host {}):\n  {}",
            c.gen,
            c.host,
            if diffs.is_empty() {
                "(fingerprints differ)".to_string()
            } else {
                diffs.join("\n  ")
            }
        ),
        hint: "start every node with the same --config file and flags".into(),
        note: Some(note),
    }
}

/// Which run rank 0 starts a generation of.
#[derive(Debug, Clone, PartialEq)]
pub enum RunChoice {
    /// No run in the directory: a new one.
    New,
    /// Continue the run in the directory.
    Continue { run_id: String },
    /// `--fresh`: set run `run_id` aside and start a new one.
    SetAside { run_id: String },
    /// The restart's configuration would change the run: refuse.
    Refuse { message: String, hint: String },
}

/// Rank 0's choice, given the directory's previous cluster record (if any), `--fresh`,
/// and this configuration's run fingerprint and identity (`Config::run_identity`).
pub fn choose_run(
    prev: Option<&ClusterRecord>,
    fresh: bool,
    run_fingerprint: &str,
    identity: &Value,
    root: &Path,
) -> RunChoice {
    let Some(p) = prev else {
        return RunChoice::New;
    };
    if fresh {
        return RunChoice::SetAside {
            run_id: p.run_id.clone(),
        };
    }
    if p.run_fingerprint == run_fingerprint {
        return RunChoice::Continue {
            run_id: p.run_id.clone(),
        };
    }
    let diffs = diff_json(&identity_of(p), identity, "");
    RunChoice::Refuse {
        message: format!(
            "{} holds run {} with a different configuration; a restart would mix its work with this one's:\n  {}",
            root.display(),
            p.run_id,
            if diffs.is_empty() {
                "(recorded by an older rl-node)".to_string()
            } else {
                diffs.join("\n  ").replace("rank 0 has", "the run has")
            }
        ),
        hint: "to continue that run, start every node with its configuration; to start a new run in this directory, add --fresh to rank 0 (the old run's files are moved to previous-runs/, nothing is deleted)".into(),
    }
}

/// The run identity recorded by an earlier generation, in `Config::run_identity`'s shape.
fn identity_of(p: &ClusterRecord) -> Value {
    let c = &p.config["cluster"];
    json!({
        "cluster": {
            "num-nodes": p.num_nodes,
            "rank-weights": p.rank_weights,
            "eval-interval": c["eval-interval"],
            "model": c["model"],
        },
        "work": {
            "strategy": p.config["work"]["strategy"],
            "seed": p.config["work"]["seed"],
            "tasks-per-iteration": p.config["work"]["tasks-per-iteration"],
            "samples-per-task": p.config["work"]["samples-per-task"],
        }
    })
}

/// Key-by-key differences between rank 0's shared configuration and ours.
fn diff_json(theirs: &Value, ours: &Value, prefix: &str) -> Vec<String> {
    match (theirs, ours) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .flat_map(|k| {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    diff_json(
                        a.get(k).unwrap_or(&Value::Null),
                        b.get(k).unwrap_or(&Value::Null),
                        &p,
                    )
                })
                .collect()
        }
        (a, b) if a == b => vec![],
        (a, b) => vec![format!("{prefix}: rank 0 has {a}, this node has {b}")],
    }
}

#[cfg(test)]
mod tests {
    use super::super::barrier::Progress;
    use super::*;
    use crate::protocol::Phase;

    #[test]
    fn diff_names_each_key() {
        let a = json!({"cluster": {"num-nodes": 3, "eval-interval": 6}, "timing": {"x": "1s"}});
        let b = json!({"cluster": {"num-nodes": 2, "eval-interval": 6}, "timing": {"x": "2s"}});
        assert_eq!(
            diff_json(&a, &b, ""),
            vec![
                "cluster.num-nodes: rank 0 has 3, this node has 2".to_string(),
                "timing.x: rank 0 has \"1s\", this node has \"2s\"".to_string()
            ]
        );
    }

    fn cluster(gen: u64) -> ClusterRecord {
        ClusterRecord {
            fingerprint: "fp".into(),
            config: json!({"timing": {"dead-after": "30s"}}),
            host: "h0".into(),
            pid: 100,
            run_fingerprint: "run-fp".into(),
            ..ClusterRecord::bare("run", gen, 3)
        }
    }

    fn rec(rank: u32, state: NodeState, nonce: &str) -> RankRecord {
        RankRecord {
            state,
            nonce: nonce.into(),
            host: format!("h{rank}"),
            pid: 100 + rank,
            ..RankRecord::vacant("run", 2, rank)
        }
    }

    /// A directory as a worker would find it, with the holder verdicts it would reach,
    /// counting the reads a look makes.
    #[derive(Default)]
    struct View {
        rank0: Option<RankRecord>,
        slot: Option<RankRecord>,
        holders: Vec<(u32, Holder)>,
        resume: u64,
        reads: u32,
    }

    impl JoinView for View {
        fn rank0(&mut self, _: u64) -> Option<RankRecord> {
            self.reads += 1;
            self.rank0.clone()
        }
        fn slot(&mut self, _: u64) -> Option<RankRecord> {
            self.reads += 1;
            self.slot.clone()
        }
        fn holder(&mut self, rec: &RankRecord, _: Duration, _: u32) -> Holder {
            self.holders
                .iter()
                .find(|(r, _)| *r == rec.rank)
                .map(|(_, h)| *h)
                .unwrap_or(Holder::Unknown)
        }
        fn resume_iteration(&mut self, _: &str) -> u64 {
            self.resume
        }
    }

    fn me(view: &dyn Fn() -> Value) -> Joiner<'_> {
        Joiner {
            rank: 2,
            nonce: "mine",
            fingerprint: "fp",
            shared_view: view,
            run_fingerprint: &|| "run-fp".to_string(),
            iterations: 0,
            slot_patience: Duration::from_secs(12),
            dead_after: Duration::from_secs(30),
            set_aside: None,
        }
    }

    #[test]
    fn a_live_joining_rank_0_is_joined_and_a_skipped_generation_costs_no_read() {
        let shared = || json!({});
        let c = cluster(2);
        let mut view = View {
            rank0: Some(rec(0, NodeState::Joining, "r0")),
            slot: Some(rec(2, NodeState::Vacant, "")),
            holders: vec![(0, Holder::Alive)],
            ..View::default()
        };
        let none = Skipped::default();
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view),
            Look::Join(ref joined, ref r0) if joined.gen == 2 && r0.nonce == "r0"
        ));
        let mut skipped = Skipped::default();
        skipped.insert("run", 2);
        view.reads = 0;
        assert_eq!(
            look(ClusterSeen::Cluster(&c), &skipped, &me(&shared), &mut view),
            Look::Wait(None)
        );
        assert_eq!(view.reads, 0);
        // Rank 0 not yet known alive: wait, saying so.
        view.holders.clear();
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view),
            Look::Wait(Some(ref note)) if note.starts_with("checking that rank 0 of generation 2")
        ));
        view.holders = vec![(0, Holder::Gone)];
        assert_eq!(
            look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view),
            Look::Skip {
                run_id: "run".into(),
                gen: 2,
                why: None
            }
        );
    }

    #[test]
    fn ended_and_running_generations_are_skipped_and_a_complete_run_ends_the_wait() {
        let shared = || json!({});
        let c = cluster(2);
        let none = Skipped::default();
        let mut view = View {
            rank0: Some(rec(0, NodeState::Done, "r0")),
            resume: 11,
            ..View::default()
        };
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view),
            Look::Skip { gen: 2, why: Some(ref w), .. } if w.contains("has ended")
        ));
        let mut target = me(&shared);
        target.iterations = 10;
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &target, &mut view),
            Look::Complete { ref message, .. } if message == "run run already completed iteration 10 (--iterations 10): nothing to do"
        ));
        let mut running = rec(0, NodeState::Running, "r0");
        running.phase = Some(Phase::TrainRollout);
        view.rank0 = Some(running);
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view),
            Look::Skip { gen: 2, why: Some(ref w), .. } if w.contains("already running without this rank")
        ));
        // Rank 0 was killed after the last iteration's commits, so its record still says
        // running. Rank 0, restarted, finds nothing to do and starts no generation; a
        // worker that skipped the "running" one waited for a new one until join-timeout,
        // at every restart. The journals decide instead.
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &target, &mut view),
            Look::Complete { ref message, .. } if message.contains("already completed iteration 10")
        ));
        // And a generation skipped while it ran ends the wait once its rank 0 is done.
        let mut skipped = Skipped::default();
        skipped.insert("run", 2);
        assert_eq!(
            look(ClusterSeen::Cluster(&c), &skipped, &target, &mut view),
            Look::Wait(None),
            "still running"
        );
        view.rank0 = Some(rec(0, NodeState::Done, "r0"));
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &skipped, &target, &mut view),
            Look::Complete { .. }
        ));
        // Seed 411 of the driver scenario: rank 0's machine crashed after the run's last
        // commit, and its unsynced record was lost with it.
        view.rank0 = None;
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &target, &mut view),
            Look::Complete { .. }
        ));
        view.resume = 5;
        assert_eq!(
            look(ClusterSeen::Cluster(&c), &none, &target, &mut view),
            Look::Wait(None),
            "short of --iterations 10: wait for a new generation"
        );
        view.rank0 = Some(rec(0, NodeState::Done, "r0"));
        assert_eq!(
            look(ClusterSeen::Cluster(&c), &skipped, &target, &mut view),
            Look::Wait(None),
            "done, but short of --iterations 10"
        );
    }

    /// Every node started at once with --fresh (srun): a worker may look before rank 0
    /// sets the old run aside, and after.
    #[test]
    fn a_fresh_start_is_waited_for_not_ended_at_the_run_it_sets_aside() {
        let shared = || json!({});
        let old = cluster(1);
        let mut fresh = me(&shared);
        fresh.iterations = 1;
        fresh.set_aside = Some("run");
        let mut view = View {
            rank0: Some(rec(0, NodeState::Done, "r0")),
            resume: 2,
            ..View::default()
        };
        // The old run is complete, but rank 0 is about to set it aside: skip, saying so.
        let mut skipped = Skipped::default();
        match look(ClusterSeen::Cluster(&old), &skipped, &fresh, &mut view) {
            Look::Skip { run_id, gen, why } => {
                assert_eq!((run_id.as_str(), gen), ("run", 1));
                assert_eq!(why.unwrap(), "generation 1 of run run has ended (Done); --fresh: waiting for rank 0 to set run run aside and start a new run");
            }
            other => panic!("{other:?}"),
        }
        skipped.insert("run", 1);
        assert_eq!(
            look(ClusterSeen::Cluster(&old), &skipped, &fresh, &mut view),
            Look::Wait(None)
        );
        // A worker without --fresh continues the run it finds: complete, it ends, and
        // says how to start a new run.
        let mut plain = fresh.clone();
        plain.set_aside = None;
        assert!(matches!(
            look(ClusterSeen::Cluster(&old), &Skipped::default(), &plain, &mut view),
            Look::Complete { ref hint, .. } if hint.ends_with("give --fresh to every node")
        ));
        // The new run starts at generation 1 again: generation 1 of the old run, skipped,
        // does not hide it.
        let new = ClusterRecord {
            run_id: "new".into(),
            ..cluster(1)
        };
        view.rank0 = Some(RankRecord {
            run_id: "new".into(),
            ..rec(0, NodeState::Joining, "r0-new")
        });
        view.slot = None;
        view.holders = vec![(0, Holder::Alive)];
        assert!(matches!(
            look(ClusterSeen::Cluster(&new), &skipped, &fresh, &mut view),
            Look::Join(ref c, ref r0) if c.run_id == "new" && r0.nonce == "r0-new"
        ));
        // cluster.json of the old run read just before rank 0 replaced it, and then the
        // new run's rank 0 record at the same generation number: neither joined nor
        // skipped, read again.
        let mut plain_skipped = Skipped::default();
        plain_skipped.insert("other", 1);
        assert_eq!(
            look(
                ClusterSeen::Cluster(&old),
                &plain_skipped,
                &plain,
                &mut view
            ),
            Look::Wait(None)
        );
    }

    #[test]
    fn refusals_name_the_live_holder_or_every_differing_key() {
        let c = cluster(2);
        let none = Skipped::default();
        let mut view = View {
            rank0: Some(rec(0, NodeState::Joining, "r0")),
            slot: Some(rec(2, NodeState::Running, "theirs")),
            holders: vec![(0, Holder::Alive), (2, Holder::Alive)],
            ..View::default()
        };
        let shared = || json!({"timing": {"dead-after": "30s"}});
        match look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view) {
            Look::Refused { message, note, .. } => {
                assert_eq!(message, "rank 2 is already held by a live process: pid 102 on h2 (generation 2, phase join)");
                assert_eq!(note, None);
            }
            other => panic!("{other:?}"),
        }
        view.holders = vec![(0, Holder::Alive), (2, Holder::Gone)];
        let mut other = me(&shared);
        other.fingerprint = "other";
        let theirs = || json!({"timing": {"dead-after": "60s"}});
        other.shared_view = &theirs;
        match look(ClusterSeen::Cluster(&c), &none, &other, &mut view) {
            Look::Refused { message, note, .. } => {
                assert!(
                    message
                        .ends_with("timing.dead-after: rank 0 has \"30s\", this node has \"60s\""),
                    "{message}"
                );
                assert_eq!(
                    note.unwrap(),
                    "timing.dead-after differs (rank 0 has \"30s\", rank 2 has \"60s\")"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// A rank's holder on another host may look still for a whole attribute-cache
    /// lifetime: it is judged with dead-after's patience at least, like rank 0.
    #[test]
    fn a_held_rank_is_judged_with_dead_afters_patience_at_least() {
        struct Patience(Vec<(u32, Duration)>);
        impl JoinView for Patience {
            fn rank0(&mut self, _: u64) -> Option<RankRecord> {
                Some(rec(0, NodeState::Joining, "r0"))
            }
            fn slot(&mut self, _: u64) -> Option<RankRecord> {
                Some(rec(2, NodeState::Joining, "theirs"))
            }
            fn holder(&mut self, rec: &RankRecord, patience: Duration, _: u32) -> Holder {
                self.0.push((rec.rank, patience));
                Holder::Unknown
            }
            fn resume_iteration(&mut self, _: &str) -> u64 {
                1
            }
        }
        let shared = || json!({});
        let c = cluster(2);
        let none = Skipped::default();
        let mut view = Patience(vec![]);
        assert!(matches!(
            look(ClusterSeen::Cluster(&c), &none, &me(&shared), &mut view),
            Look::Wait(Some(ref note)) if note.starts_with("checking whether rank 2's previous holder")
        ));
        assert_eq!(view.0, vec![(2, Duration::from_secs(30))]);
        let mut patient = me(&shared);
        patient.slot_patience = Duration::from_secs(90);
        view.0.clear();
        look(ClusterSeen::Cluster(&c), &none, &patient, &mut view);
        assert_eq!(view.0, vec![(2, Duration::from_secs(90))]);
    }

    #[test]
    fn rank_0_continues_a_run_sets_it_aside_or_refuses_a_changed_one() {
        let root = Path::new("/nfs/exp");
        let id = json!({});
        assert_eq!(choose_run(None, false, "x", &id, root), RunChoice::New);
        let p = cluster(4);
        assert_eq!(
            choose_run(Some(&p), false, "run-fp", &id, root),
            RunChoice::Continue {
                run_id: "run".into()
            }
        );
        assert_eq!(
            choose_run(Some(&p), true, "other", &id, root),
            RunChoice::SetAside {
                run_id: "run".into()
            }
        );
        match choose_run(
            Some(&p),
            false,
            "other",
            &json!({"cluster": {"num-nodes": 4}}),
            root,
        ) {
            RunChoice::Refuse { message, .. } => {
                assert!(
                    message.starts_with("/nfs/exp holds run run with a different configuration")
                );
                assert!(
                    message.contains("cluster.num-nodes: the run has 3, this node has 4"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rank_0_picks_a_generation_above_every_listed_one_and_waits_for_each_arrival_once() {
        let names = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(first_free_generation(1, &[]), 1);
        assert_eq!(first_free_generation(3, &names(&["gen-1", "gen-2"])), 3);
        assert_eq!(
            first_free_generation(2, &names(&["gen-7", "cluster.json", "gen-x"])),
            8,
            "a directory left by an earlier start is never reused"
        );

        let arrived = |rank| RankRecord {
            arrived: Some(crate::protocol::Mark {
                k: 0,
                iteration: 0,
                name: "join".into(),
                payload: Value::Null,
            }),
            ..rec(rank, NodeState::Joining, "n")
        };
        let mut f = Forming::default();
        let mut refused = HashMap::new();
        refused.insert(2, "rank 2 was refused: another configuration".to_string());
        let peers = vec![Some(arrived(0)), None, Some(rec(2, NodeState::Vacant, ""))];
        let r = f.round(&peers, &refused);
        assert!(!r.complete);
        assert_eq!(r.waiting_for, Some(vec![1, 2]));
        assert_eq!(r.refusals, ["rank 2 was refused: another configuration"]);
        // The same again: nothing new to publish or report.
        assert_eq!(f.round(&peers, &refused), FormingRound::default());
        let peers = vec![Some(arrived(0)), Some(arrived(1)), None];
        let r = f.round(&peers, &refused);
        assert_eq!((r.waiting_for, r.refusals.len()), (Some(vec![2]), 0));
        assert_eq!(f.missing(), [2]);
        let all = vec![Some(arrived(0)), Some(arrived(1)), Some(arrived(2))];
        assert!(f.round(&all, &refused).complete);
    }

    /// The join's marks keep protocol 2's JSON: a node of the same protocol built before
    /// the marks were typed reads them as it did.
    #[test]
    fn the_join_marks_keep_the_json_of_protocol_2() {
        let me = Joined {
            host: "node-a".into(),
            pid: 4711,
        };
        let want = json!({"k": 0, "iteration": 0, "name": "join",
                          "payload": {"host": "node-a", "pid": 4711}});
        let arrival = barrier(2, me.clone()).arrival();
        assert_eq!(serde_json::to_value(&arrival).unwrap(), want);
        let release = barrier(0, me.clone()).release(&Some(me));
        assert_eq!(serde_json::to_value(&release).unwrap(), want);
    }

    /// A peer's record is untrusted, but nothing acts on a join payload: an arrival or a
    /// release counts by its position, whatever its payload holds.
    #[test]
    fn a_join_payload_that_does_not_decode_still_arrives_and_releases() {
        let odd = |rank, payload: Value| RankRecord {
            arrived: Some(crate::protocol::Mark {
                k: 0,
                iteration: 0,
                name: "join".into(),
                payload: payload.clone(),
            }),
            released: (rank == 0).then(|| crate::protocol::Mark {
                k: 0,
                iteration: 0,
                name: "join".into(),
                payload,
            }),
            ..rec(rank, NodeState::Joining, "n")
        };
        let peers = vec![
            Some(odd(0, json!("h0"))),
            Some(odd(1, json!({"pid": "one"}))),
            Some(odd(2, json!([2]))),
        ];
        assert!(Forming::default().round(&peers, &HashMap::new()).complete);
        assert!(peers[0].as_ref().unwrap().released_at(0));
        // The join read as a barrier: the odd payloads read as no process.
        let me = Joined {
            host: "h0".into(),
            pid: 100,
        };
        assert_eq!(
            barrier(0, me.clone()).on_records(&peers),
            Progress::Complete {
                payloads: vec![Some(me), None, None]
            }
        );
        assert_eq!(
            barrier(
                1,
                Joined {
                    host: "h1".into(),
                    pid: 101
                }
            )
            .on_records(&peers),
            Progress::Released { broadcast: None }
        );
    }

    #[test]
    fn the_previous_generation_ended_cleanly_or_its_rank_0_is_in_question() {
        let done = rec(0, NodeState::Done, "a");
        assert_eq!(
            previous_end(4, &done),
            PreviousEnd::Ended("generation 4 completed".into())
        );
        let running = rec(0, NodeState::Running, "a");
        assert_eq!(previous_end(4, &running), PreviousEnd::Unclean);
        assert_eq!(
            PreviousEnd::unclean(4, &running),
            "generation 4 ended without a clean stop (rank 0, pid 100 on h0, stopped heartbeating)"
        );
    }
}
