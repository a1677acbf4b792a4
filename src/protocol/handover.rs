//! A pipelined run's hand-over as one node performs it (docs/pipeline.md), as a sans-I/O
//! state machine (`Handover`) in the style of [`super::machine`]: the node's view of the
//! other cluster and of the two queue records. The rules of the hand-over (which model an
//! iteration is rolled out with, when training may start) are [`super::pipeline`]'s; this
//! is the procedure around them.
//!
//! - **Looking at the other cluster.** A look reads its `cluster.json`, then that
//!   generation's `abort.json`, then its rank 0's record, each an [`Effect`] the driver
//!   answers with an [`Input`], and only as far as the answer needs: an abort there stops
//!   this cluster with the same diagnosis ([`Found::Stopped`]); while this cluster waits
//!   on the other, its rank 0's heartbeat still for dead-after ([`Found::Dead`], judged by
//!   the one [`Liveness`] every peer is judged by) or no live generation of it for
//!   join-timeout ([`Found::Absent`]) stops it too. Outside a wait, rank 0 looks at most
//!   once per heartbeat interval ([`Handover::look`]).
//! - **At start** ([`Handover::begin`]) the same reads tell whether the generation of the
//!   other cluster found there had already ended: its abort is then not news, it is not
//!   the cluster to wait for, and if it finished every iteration a wait it cannot satisfy
//!   fails at once instead of after join-timeout.
//! - **The other cluster's queue record** ([`Handover::read_queue`]): parsed strictly,
//!   refused when the other cluster runs another configuration, and never let move back
//!   (the newest record read stays true, [`pipeline::newest`]).
//! - **This cluster's queue record** ([`Handover::next_queue`]): the next one to write,
//!   numbered after the newest this node wrote or read, or a refusal when a newer
//!   generation of this cluster already moved it on (this node is then fenced).
//!
//! Time is handed in as the node's monotonic [`Duration`] since its start; the machine
//! reads no clock and does no I/O. Every state change checks its invariants
//! ([`Handover::assert_invariants`]) in debug builds and in the simulator.

use super::liveness::{Liveness, Stamp};
use super::pipeline::{self, QueueRecord};
use super::records::{AbortInfo, NodeState, RankRecord};
use std::time::Duration;

/// What a node's hand-over is set up with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The other cluster's name: `rollout` or `update`.
    pub other: &'static str,
    /// This cluster's configuration as both clusters must share it
    /// (`Config::pipeline_fingerprint`).
    pub fingerprint: String,
    pub heartbeat_interval: Duration,
    pub dead_after: Duration,
    pub join_timeout: Duration,
}

/// A read the machine asks the driver for, answered by the [`Input`] of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// The other cluster's `cluster.json`.
    ReadCluster,
    /// The other cluster's `abort.json` of generation `gen`.
    ReadAbort { gen: u64 },
    /// The other cluster's rank 0 record of generation `gen`.
    ReadRank0 { gen: u64 },
}

/// The answer to an [`Effect`]: the record read (`None`: missing, unreadable or damaged).
#[derive(Debug, Clone)]
pub enum Input {
    /// The generation `cluster.json` names.
    Cluster(Option<u64>),
    Abort(Option<Box<AbortInfo>>),
    Rank0(Option<Box<RankRecord>>),
}

/// What a look at the other cluster found that this cluster must act on.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    /// Nothing.
    Nothing,
    /// The other cluster stopped: this one stops with the same diagnosis (its `cluster`
    /// names the other cluster when the abort did not say).
    Stopped(Box<AbortInfo>),
    /// While this cluster waits: the other rank 0's heartbeat has been still for `silent`,
    /// more than dead-after.
    Dead {
        record: Box<RankRecord>,
        silent: Duration,
    },
    /// While this cluster waits: no live generation of the other cluster, for `for_`;
    /// `timed_out` once that is join-timeout.
    Absent { for_: Duration, timed_out: bool },
}

/// Why the other cluster's queue record cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueError {
    /// It does not parse.
    Damaged(String),
    /// The other cluster runs another configuration (its fingerprint).
    OtherConfiguration(String),
}

/// This cluster's next queue record ([`Handover::next_queue`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextQueue {
    pub record: QueueRecord,
    /// The record found had gone back to an older one than the last this node wrote (a
    /// late write of a replaced generation), which the new one moves on again: (found,
    /// written).
    pub went_back: Option<(QueueRecord, QueueRecord)>,
}

/// What the current look has read so far.
#[derive(Debug, Clone, PartialEq)]
enum Stage {
    Cluster,
    Abort(u64),
    Rank0(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// At start: is the generation found there already over?
    Begin,
    /// A look, during a wait on the other cluster or not.
    Look { waiting: bool },
}

/// The hand-over on one node. See the module's documentation.
#[derive(Debug, Clone)]
pub struct Handover {
    cfg: Settings,
    /// A generation of the other cluster that had ended (an abort, or all its iterations
    /// done): its abort is not news, and it is not the cluster to wait for.
    ended_gen: Option<u64>,
    /// The other cluster's generation and last iteration when it was seen finished: a
    /// wait fails on it once the queue record, read after, still does not suffice.
    finished: Option<(u64, u64)>,
    /// The other cluster's newest queue record read so far.
    newest: Option<QueueRecord>,
    /// This cluster's queue record as this node last wrote it.
    published: Option<QueueRecord>,
    /// When the other cluster was last looked at.
    checked: Option<Duration>,
    /// Since when the current wait has found no live generation of the other cluster.
    absent_since: Option<Duration>,
    /// The other rank 0's heartbeat during the current wait, and whose generation's.
    liveness: Liveness,
    watched_gen: Option<u64>,
    /// The look under way, and what it reads next.
    look: Option<(Kind, Stage)>,
    /// The look's next read was asked for ([`Handover::poll_effect`]) and not answered.
    asked: bool,
    /// What the last look found, until taken.
    found: Option<Found>,
}

impl Handover {
    pub fn new(cfg: Settings) -> Handover {
        let liveness = Liveness::new(cfg.dead_after);
        Handover {
            cfg,
            ended_gen: None,
            finished: None,
            newest: None,
            published: None,
            checked: None,
            absent_since: None,
            liveness,
            watched_gen: None,
            look: None,
            asked: false,
            found: None,
        }
    }

    /// The other rank 0's liveness judged wrongly on purpose (the simulator's own tests).
    #[doc(hidden)]
    pub fn with_mutation(mut self, m: Option<super::liveness::Mutation>) -> Handover {
        self.liveness = Liveness::new(self.cfg.dead_after).with_mutation(m);
        self
    }

    /// The other cluster's name.
    pub fn other(&self) -> &'static str {
        self.cfg.other
    }

    /// At start (rank 0): look whether the other cluster's current generation is over.
    pub fn begin(&mut self) {
        self.start(Kind::Begin);
    }

    /// A look at the other cluster at `now`, while this cluster waits on it or not. Outside
    /// a wait, at most one per heartbeat interval: false when this one is not due.
    pub fn look(&mut self, now: Duration, waiting: bool) -> bool {
        let recent = self
            .checked
            .is_some_and(|t| now.saturating_sub(t) < self.cfg.heartbeat_interval);
        if !waiting && recent {
            return false;
        }
        self.checked = Some(now);
        self.start(Kind::Look { waiting });
        true
    }

    fn start(&mut self, kind: Kind) {
        assert!(
            self.look.is_none(),
            "a look at the other cluster is under way"
        );
        self.found = None;
        self.look = Some((kind, Stage::Cluster));
        self.asked = false;
        self.assert_invariants();
    }

    /// The read the look under way needs next, once.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        let (_, stage) = self.look.as_ref().filter(|_| !self.asked)?;
        let effect = match *stage {
            Stage::Cluster => Effect::ReadCluster,
            Stage::Abort(gen) => Effect::ReadAbort { gen },
            Stage::Rank0(gen) => Effect::ReadRank0 { gen },
        };
        self.asked = true;
        Some(effect)
    }

    /// What the finished look found (once).
    pub fn take_found(&mut self) -> Option<Found> {
        self.found.take()
    }

    /// A wait on the other cluster begins or ends: its rank 0's silence and the other
    /// cluster's absence are counted afresh within each wait.
    pub fn wait_boundary(&mut self) {
        self.absent_since = None;
        self.watched_gen = None;
        self.liveness.forget(0);
    }

    /// The other cluster finished its iterations (generation, its rank 0's iteration),
    /// as last seen: a wait its queue record does not satisfy then never will.
    pub fn finished(&self) -> Option<(u64, u64)> {
        self.finished
    }

    /// The answer to the last effect, read `at` (when it was sent and when it returned,
    /// or one time).
    pub fn handle(&mut self, at: impl Into<Stamp>, input: Input) {
        let at = at.into();
        let now = at.returned;
        let (kind, stage) = self
            .look
            .take()
            .filter(|_| self.asked)
            .expect("an answer without a read asked for");
        self.asked = false;
        let next = match (stage, input) {
            (Stage::Cluster, Input::Cluster(c)) => {
                let live = c.filter(|g| Some(*g) != self.ended_gen);
                match (kind, live) {
                    (Kind::Look { waiting: true }, None) => Err(self.absent(now)),
                    (_, None) => Err(Found::Nothing),
                    (Kind::Begin, Some(gen)) => Ok(Stage::Rank0(gen)),
                    (Kind::Look { .. }, Some(gen)) => Ok(Stage::Abort(gen)),
                }
            }
            (Stage::Abort(gen), Input::Abort(abort)) => match (kind, abort) {
                (Kind::Look { .. }, Some(info)) => Err(self.stopped(info)),
                // At start, after the rank 0 record: an abort makes the generation ended.
                (Kind::Begin, abort) => {
                    if abort.is_some() {
                        self.ended_gen = Some(gen);
                    }
                    Err(Found::Nothing)
                }
                (Kind::Look { .. }, None) => Ok(Stage::Rank0(gen)),
            },
            (Stage::Rank0(gen), Input::Rank0(rec)) => match kind {
                Kind::Begin => self.begun(gen, rec),
                Kind::Look { waiting } => Err(self.seen(at, gen, rec, waiting)),
            },
            (stage, input) => panic!("{input:?} does not answer a read of {stage:?}"),
        };
        match next {
            Ok(stage) => self.look = Some((kind, stage)),
            Err(found) => self.found = Some(found),
        }
        self.assert_invariants();
    }

    /// At start: the other rank 0's record of generation `gen` read. A terminal one ends
    /// the generation (a finished one: waits it cannot satisfy fail at once); else its
    /// abort, read next, may.
    fn begun(&mut self, gen: u64, rec: Option<Box<RankRecord>>) -> Result<Stage, Found> {
        if let Some(r) = rec.filter(|r| r.state.is_terminal()) {
            self.ended_gen = Some(gen);
            if r.state == NodeState::Done {
                self.finished = Some((gen, r.iteration));
            }
            return Err(Found::Nothing);
        }
        Ok(Stage::Abort(gen))
    }

    /// A look read the other rank 0's record of the live generation `gen`.
    fn seen(&mut self, at: Stamp, gen: u64, rec: Option<Box<RankRecord>>, waiting: bool) -> Found {
        let now = at.returned;
        let Some(rec) = rec else {
            return if waiting {
                self.absent(now)
            } else {
                Found::Nothing
            };
        };
        if let Some(info) = rec.abort.clone() {
            return self.stopped(Box::new(info));
        }
        self.absent_since = None;
        // A newer generation runs: the one seen finished was restarted.
        self.finished = None;
        if rec.state == NodeState::Done {
            // Its last queue record was written before it finished: a wait reads it
            // again before it calls this a failure.
            self.ended_gen = Some(gen);
            self.finished = Some((gen, rec.iteration));
            return Found::Nothing;
        }
        if !waiting {
            return Found::Nothing;
        }
        if self.watched_gen != Some(gen) {
            self.liveness.forget(0);
            self.watched_gen = Some(gen);
        }
        self.liveness.observe(0, rec.seq, at);
        if self.liveness.is_dead(0, now) {
            let silent = self.liveness.silent_for(0, now);
            return Found::Dead {
                record: rec,
                silent,
            };
        }
        Found::Nothing
    }

    fn absent(&mut self, now: Duration) -> Found {
        let since = *self.absent_since.get_or_insert(now);
        let for_ = now.saturating_sub(since);
        Found::Absent {
            for_,
            timed_out: for_ >= self.cfg.join_timeout,
        }
    }

    fn stopped(&self, mut info: Box<AbortInfo>) -> Found {
        if info.cluster.is_none() {
            info.cluster = Some(self.cfg.other.to_string());
        }
        Found::Stopped(info)
    }

    /// The other cluster's queue record as read (`bytes`: empty until its rank 0 first
    /// writes it): the newest one read so far, or why it cannot be used.
    pub fn read_queue(&mut self, bytes: &[u8]) -> Result<Option<QueueRecord>, QueueError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        let q: QueueRecord =
            serde_json::from_slice(bytes).map_err(|e| QueueError::Damaged(e.to_string()))?;
        if q.fingerprint != self.cfg.fingerprint {
            return Err(QueueError::OtherConfiguration(q.fingerprint));
        }
        // A record older than one already read is a late rename of a replaced
        // generation's: the newer one stays true (`done` only grows), and is kept.
        let q = pipeline::newest(self.newest.take(), q);
        self.newest = Some(q.clone());
        self.assert_invariants();
        Ok(Some(q))
    }

    /// This cluster's next queue record: `draft` (this node's run and generation, what it
    /// has done) numbered after the newest record this node wrote or `found` in the file,
    /// carrying their model versions and `version` (iteration, model version) if any.
    /// `Err(generation)`: a newer generation of this cluster already wrote the record;
    /// this node must not move it back.
    pub fn next_queue(
        &self,
        found: Option<QueueRecord>,
        mut draft: QueueRecord,
        version: Option<(u64, u64)>,
    ) -> Result<NextQueue, u64> {
        if let Some(f) = found
            .as_ref()
            .filter(|f| f.run == draft.run && f.gen > draft.gen)
        {
            return Err(f.gen);
        }
        let mine = self.published.clone();
        let went_back = match (&found, &mine) {
            (Some(f), Some(m)) if f.older_than(m) => Some((f.clone(), m.clone())),
            _ => None,
        };
        let base = match (mine, found) {
            (seen, Some(read)) => Some(pipeline::newest(seen, read)),
            (seen, None) => seen,
        };
        draft.seq = base
            .as_ref()
            .filter(|b| b.run == draft.run && b.gen == draft.gen)
            .map_or(0, |b| b.seq)
            + 1;
        let mut versions = base.map(|q| q.versions).unwrap_or_default();
        if let Some((iteration, model_version)) = version {
            versions.retain(|(i, _)| *i != iteration);
            versions.push((iteration, model_version));
            versions.sort_unstable();
            let keep = versions.len().saturating_sub(64);
            versions.drain(..keep);
        }
        draft.versions = versions;
        Ok(NextQueue {
            record: draft,
            went_back,
        })
    }

    /// This cluster's queue record was written.
    pub fn published(&mut self, record: QueueRecord) {
        if let Some(p) = &self.published {
            assert!(
                !record.older_than(p),
                "a queue record written after a newer one"
            );
        }
        self.published = Some(record);
        self.assert_invariants();
    }

    /// The machine's invariants: a read is asked for only while a look is under way, and
    /// what it found only once the look is over; an ended generation is never the one
    /// watched; the silence counted is within the current generation.
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        assert!(
            self.look.is_some() || !self.asked,
            "a read asked for without a look"
        );
        assert!(
            self.look.is_none() || self.found.is_none(),
            "a finding before the look is over"
        );
        if let (Some(ended), Some((gen, _))) = (self.ended_gen, self.finished) {
            assert_eq!(ended, gen, "finished in a generation not ended");
        }
        if let (Some(q), Some(p)) = (&self.newest, &self.published) {
            assert_ne!(
                q.cluster, p.cluster,
                "this cluster's record read as the other's"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::AbortKind;

    const S: Duration = Duration::from_secs(1);

    fn settings() -> Settings {
        Settings {
            other: "update",
            fingerprint: "fp".into(),
            heartbeat_interval: S,
            dead_after: 10 * S,
            join_timeout: 60 * S,
        }
    }

    fn cluster(gen: u64) -> Option<u64> {
        Some(gen)
    }

    fn r0(gen: u64, seq: u64, state: NodeState) -> Option<Box<RankRecord>> {
        Some(Box::new(RankRecord {
            state,
            seq,
            iteration: 3,
            host: "u0".into(),
            ..RankRecord::vacant("run", gen, 0)
        }))
    }

    fn abort() -> Box<AbortInfo> {
        Box::new(AbortInfo {
            kind: AbortKind::Error,
            culprit: 1,
            culprit_host: "u1".into(),
            phase: "training".into(),
            iteration: 3,
            reason: "train exited 1".into(),
            log: None,
            detected_by: 1,
            silent_ms: None,
            at: String::new(),
            cluster: None,
            detected_in: None,
            dropped: false,
        })
    }

    /// One look at `now` answered from `cluster`, `abort` and `rank0`, in the order the
    /// machine asks: the reads it made, and what it found.
    fn look(
        h: &mut Handover,
        now: Duration,
        waiting: bool,
        cluster: Option<u64>,
        abort: Option<Box<AbortInfo>>,
        rank0: Option<Box<RankRecord>>,
    ) -> (Vec<Effect>, Option<Found>) {
        if !h.look(now, waiting) {
            return (vec![], None);
        }
        answer(h, now, cluster, abort, rank0)
    }

    fn answer(
        h: &mut Handover,
        now: Duration,
        cluster: Option<u64>,
        abort: Option<Box<AbortInfo>>,
        rank0: Option<Box<RankRecord>>,
    ) -> (Vec<Effect>, Option<Found>) {
        let mut reads = vec![];
        while let Some(e) = h.poll_effect() {
            reads.push(e);
            let input = match e {
                Effect::ReadCluster => Input::Cluster(cluster),
                Effect::ReadAbort { .. } => Input::Abort(abort.clone()),
                Effect::ReadRank0 { .. } => Input::Rank0(rank0.clone()),
            };
            h.handle(now, input);
        }
        (reads, h.take_found())
    }

    #[test]
    fn a_look_reads_only_as_far_as_it_needs() {
        let mut h = Handover::new(settings());
        let (reads, found) = look(&mut h, S, false, None, None, None);
        assert_eq!(reads, [Effect::ReadCluster]);
        assert_eq!(found, Some(Found::Nothing));
        let running = r0(4, 1, NodeState::Running);
        let (reads, found) = look(&mut h, 3 * S, false, cluster(4), Some(abort()), running);
        assert_eq!(reads, [Effect::ReadCluster, Effect::ReadAbort { gen: 4 }]);
        let Some(Found::Stopped(info)) = found else {
            panic!("{found:?}")
        };
        assert_eq!(
            info.cluster.as_deref(),
            Some("update"),
            "named after the other"
        );
        let running = r0(4, 2, NodeState::Running);
        let (reads, found) = look(&mut h, 5 * S, false, cluster(4), None, running);
        assert_eq!(
            reads,
            [
                Effect::ReadCluster,
                Effect::ReadAbort { gen: 4 },
                Effect::ReadRank0 { gen: 4 }
            ]
        );
        assert_eq!(found, Some(Found::Nothing));
    }

    #[test]
    fn outside_a_wait_rank_0_looks_once_per_heartbeat_interval() {
        let mut h = Handover::new(settings());
        assert!(h.look(S, false));
        answer(&mut h, S, None, None, None);
        assert!(!h.look(S + S / 2, false), "within the interval");
        assert!(h.look(S + S / 2, true), "a wait looks every time");
        answer(&mut h, S + S / 2, None, None, None);
        assert!(!h.look(2 * S, false));
        assert!(h.look(5 * S / 2, false));
    }

    #[test]
    fn while_waiting_the_other_rank_0_is_dead_only_after_dead_after_of_stillness() {
        let mut h = Handover::new(settings());
        h.wait_boundary();
        let still = || r0(4, 7, NodeState::Running);
        for t in [0, 5, 10] {
            let (_, found) = look(&mut h, t * S, true, cluster(4), None, still());
            assert_eq!(found, Some(Found::Nothing), "at {t}s");
        }
        // A heartbeat resets it.
        let (_, found) = look(
            &mut h,
            11 * S,
            true,
            cluster(4),
            None,
            r0(4, 8, NodeState::Running),
        );
        assert_eq!(found, Some(Found::Nothing));
        let (_, found) = look(
            &mut h,
            21 * S,
            true,
            cluster(4),
            None,
            r0(4, 8, NodeState::Running),
        );
        assert_eq!(
            found,
            Some(Found::Nothing),
            "10 s still is not more than dead-after"
        );
        let (_, found) = look(
            &mut h,
            22 * S,
            true,
            cluster(4),
            None,
            r0(4, 8, NodeState::Running),
        );
        let Some(Found::Dead { record, silent }) = found else {
            panic!("{found:?}")
        };
        assert_eq!((record.host.as_str(), silent), ("u0", 11 * S));
    }

    #[test]
    fn silence_outside_a_wait_or_across_waits_and_generations_is_not_counted() {
        let mut h = Handover::new(settings());
        // Looks outside a wait do not watch the heartbeat.
        look(
            &mut h,
            Duration::ZERO,
            false,
            cluster(4),
            None,
            r0(4, 7, NodeState::Running),
        );
        h.wait_boundary();
        let (_, found) = look(
            &mut h,
            30 * S,
            true,
            cluster(4),
            None,
            r0(4, 7, NodeState::Running),
        );
        assert_eq!(
            found,
            Some(Found::Nothing),
            "the wait's first look starts the count"
        );
        let (_, found) = look(
            &mut h,
            35 * S,
            true,
            cluster(4),
            None,
            r0(4, 7, NodeState::Running),
        );
        assert_eq!(found, Some(Found::Nothing));
        // A new wait counts afresh.
        h.wait_boundary();
        let (_, found) = look(
            &mut h,
            45 * S,
            true,
            cluster(4),
            None,
            r0(4, 7, NodeState::Running),
        );
        assert_eq!(found, Some(Found::Nothing));
        // A new generation whose rank 0 happens to have the same sequence number.
        let (_, found) = look(
            &mut h,
            54 * S,
            true,
            cluster(5),
            None,
            r0(5, 7, NodeState::Running),
        );
        assert_eq!(found, Some(Found::Nothing));
        let (_, found) = look(
            &mut h,
            60 * S,
            true,
            cluster(5),
            None,
            r0(5, 7, NodeState::Running),
        );
        assert_eq!(found, Some(Found::Nothing), "6 s into generation 5");
    }

    #[test]
    fn an_absent_cluster_stops_a_wait_after_join_timeout() {
        let mut h = Handover::new(settings());
        h.wait_boundary();
        let (_, found) = look(&mut h, 10 * S, true, None, None, None);
        assert_eq!(
            found,
            Some(Found::Absent {
                for_: Duration::ZERO,
                timed_out: false
            })
        );
        // Its rank 0's record missing counts as absent too.
        let (_, found) = look(&mut h, 40 * S, true, cluster(4), None, None);
        assert_eq!(
            found,
            Some(Found::Absent {
                for_: 30 * S,
                timed_out: false
            })
        );
        // Seen running: the count starts over.
        look(
            &mut h,
            50 * S,
            true,
            cluster(4),
            None,
            r0(4, 1, NodeState::Running),
        );
        let (_, found) = look(&mut h, 60 * S, true, None, None, None);
        assert_eq!(
            found,
            Some(Found::Absent {
                for_: Duration::ZERO,
                timed_out: false
            })
        );
        let (_, found) = look(&mut h, 120 * S, true, None, None, None);
        assert_eq!(
            found,
            Some(Found::Absent {
                for_: 60 * S,
                timed_out: true
            })
        );
        // Outside a wait, absence is nothing.
        h.wait_boundary();
        let (_, found) = look(&mut h, 500 * S, false, None, None, None);
        assert_eq!(found, Some(Found::Nothing));
    }

    #[test]
    fn at_start_an_ended_generation_is_neither_news_nor_waited_for() {
        // Aborted before this cluster started.
        let mut h = Handover::new(settings());
        h.begin();
        let (reads, _) = answer(
            &mut h,
            S,
            cluster(4),
            Some(abort()),
            r0(4, 3, NodeState::Running),
        );
        assert_eq!(
            reads,
            [
                Effect::ReadCluster,
                Effect::ReadRank0 { gen: 4 },
                Effect::ReadAbort { gen: 4 }
            ]
        );
        assert_eq!(h.finished(), None);
        let (_, found) = look(&mut h, 2 * S, true, cluster(4), Some(abort()), None);
        assert!(
            matches!(found, Some(Found::Absent { .. })),
            "its abort is not news: {found:?}"
        );
        // Finished before this cluster started: a wait can fail at once.
        let mut h = Handover::new(settings());
        h.begin();
        let (reads, _) = answer(&mut h, S, cluster(4), None, r0(4, 3, NodeState::Done));
        assert_eq!(reads, [Effect::ReadCluster, Effect::ReadRank0 { gen: 4 }]);
        assert_eq!(h.finished(), Some((4, 3)));
        // Restarted: generation 5 runs, and the finish no longer holds.
        look(
            &mut h,
            2 * S,
            true,
            cluster(5),
            None,
            r0(5, 1, NodeState::Running),
        );
        assert_eq!(h.finished(), None);
        // Running at start: nothing ended.
        let mut h = Handover::new(settings());
        h.begin();
        answer(&mut h, S, cluster(4), None, r0(4, 3, NodeState::Running));
        let (_, found) = look(&mut h, 2 * S, false, cluster(4), Some(abort()), None);
        assert!(matches!(found, Some(Found::Stopped(_))), "{found:?}");
    }

    #[test]
    fn a_finished_other_cluster_is_noticed_in_a_look() {
        let mut h = Handover::new(settings());
        look(
            &mut h,
            S,
            false,
            cluster(4),
            None,
            r0(4, 9, NodeState::Done),
        );
        assert_eq!(h.finished(), Some((4, 3)));
        // It is over: not waited for, not judged.
        let (_, found) = look(
            &mut h,
            100 * S,
            true,
            cluster(4),
            None,
            r0(4, 9, NodeState::Done),
        );
        assert!(matches!(found, Some(Found::Absent { .. })), "{found:?}");
    }

    fn queue(gen: u64, seq: u64, done: u64) -> QueueRecord {
        QueueRecord {
            cluster: "update".into(),
            fingerprint: "fp".into(),
            staleness: 1,
            done,
            versions: vec![],
            current: 0,
            last: 0,
            at: String::new(),
            run: "run".into(),
            gen,
            seq,
        }
    }

    #[test]
    fn the_other_queue_record_never_moves_back_and_must_share_the_configuration() {
        let mut h = Handover::new(settings());
        assert_eq!(h.read_queue(b""), Ok(None), "not written yet");
        let read =
            |h: &mut Handover, q: &QueueRecord| h.read_queue(&serde_json::to_vec(q).unwrap());
        assert_eq!(read(&mut h, &queue(3, 5, 2)).unwrap().unwrap().done, 2);
        // A late rename of a replaced generation's older record.
        assert_eq!(read(&mut h, &queue(2, 9, 1)).unwrap().unwrap().done, 2);
        assert_eq!(read(&mut h, &queue(3, 6, 3)).unwrap().unwrap().done, 3);
        let other = QueueRecord {
            fingerprint: "elsewhere".into(),
            ..queue(3, 7, 4)
        };
        assert_eq!(
            read(&mut h, &other),
            Err(QueueError::OtherConfiguration("elsewhere".into()))
        );
        assert!(matches!(
            h.read_queue(b"{\"clu"),
            Err(QueueError::Damaged(_))
        ));
    }

    #[test]
    fn this_cluster_queue_record_is_numbered_on_and_fenced_by_a_newer_generation() {
        let mut h = Handover::new(settings());
        let mine = |gen, done| QueueRecord {
            cluster: "rollout".into(),
            ..queue(gen, 0, done)
        };
        let first = h.next_queue(None, mine(3, 1), Some((2, 0))).unwrap();
        assert_eq!(
            (first.record.seq, &first.record.versions[..]),
            (1, &[(2, 0)][..])
        );
        h.published(first.record.clone());
        // Found as written: the next one follows it, and keeps its versions.
        let next = h
            .next_queue(Some(first.record.clone()), mine(3, 2), Some((3, 1)))
            .unwrap();
        assert_eq!(next.record.seq, 2);
        assert_eq!(next.record.versions, [(2, 0), (3, 1)]);
        assert_eq!(next.went_back, None);
        h.published(next.record.clone());
        // Found moved back to a replaced generation's: rewritten, and said.
        let late = QueueRecord {
            cluster: "rollout".into(),
            ..queue(2, 40, 1)
        };
        let again = h.next_queue(Some(late.clone()), mine(3, 2), None).unwrap();
        assert_eq!(
            (again.record.seq, again.went_back),
            (3, Some((late, next.record)))
        );
        // A newer generation wrote it: this node is fenced.
        let newer = QueueRecord {
            cluster: "rollout".into(),
            ..queue(4, 1, 2)
        };
        assert_eq!(h.next_queue(Some(newer), mine(3, 3), None), Err(4));
        // Only the last 64 versions are kept.
        let mut h = Handover::new(settings());
        let mut base = mine(3, 0);
        base.versions = (1..=64).map(|i| (i, i - 1)).collect();
        let next = h
            .next_queue(Some(base), mine(3, 65), Some((65, 64)))
            .unwrap();
        assert_eq!(next.record.versions.len(), 64);
        assert_eq!(next.record.versions[0], (2, 1));
        h.published(next.record);
    }
}
