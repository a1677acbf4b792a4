//! `RunMachine`: what rank 0 decides before it forms a generation, as a sans-I/O state
//! machine in the style of [`super::join_machine`], so that the node and the simulator
//! run the same procedure: read the run's `cluster.json` and its rank 0's record
//! strictly, judge how the previous generation ended ([`join::previous_end`]), wait out
//! (or refuse to start beside) a previous rank 0 that may still run
//! ([`join::previous_master`]), check the run's journals, choose the run
//! ([`join::choose_run`]: continue it, refuse a restart that would change it, or with
//! `--fresh` set it aside), and find where it resumes ([`journal::resume_point`]).
//!
//! It is a machine of its own rather than stages before [`super::join_machine::FormMachine`]'s
//! claim: its inputs are reads of the run (and a wait on the clock), the forming's are the
//! generation's own writes and arrivals, and its one write (renaming the run aside) must
//! come before anything the forming writes. It ends by handing over the run chosen
//! ([`RunEffect::Chosen`]), from which the driver builds the cluster record the forming
//! publishes, or with the end of the start (complete, refused, failed).
//!
//! Each read is one [`RunEffect`] answered by one [`RunInput`]. What is I/O-heavy stays
//! with the driver as one effect whose value comes back: checking the run's journals and
//! history ([`RunEffect::CheckRun`]), reading every rank's journal
//! ([`RunEffect::ReadJournals`]), setting the run's directories aside
//! ([`RunEffect::SetAside`]). The wait for a previous rank 0 is the one stage that needs
//! polls: the driver hands [`RunInput::Poll`] at each, and [`RunInput::Timeout`] once
//! [`RunMachine::poll_timeout`] passed; the machine never reads a clock of its own.
//! Every input checks its invariants in debug builds and in the simulator
//! ([`RunMachine::assert_invariants`]).

use super::join::{self, Mutation, PreviousEnd, RunChoice};
use super::journal::{self, Entry, Resume};
use super::liveness::{Holder, Holders};
use super::{ClusterRecord, RankRecord};
use serde_json::Value;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

/// What rank 0 decides by.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// This process's host: a previous rank 0 elsewhere is announced before the wait.
    pub host: String,
    /// Started with `--fresh`: set the run in the directory aside and start a new one.
    pub fresh: bool,
    /// The fingerprint of what may not change across restarts of one run, and that
    /// identity itself (to word a refusal).
    pub run_fingerprint: String,
    pub run_identity: Value,
    /// `--log-path`, as a refusal names it.
    pub root: PathBuf,
    /// What the run walks (`Config::walk_item`), as its journals record it.
    pub walk_item: String,
    /// `cluster.first-iteration`: no run resumes before it.
    pub first_iteration: u64,
    /// `--iterations` (0: no target).
    pub iterations: u64,
    pub slot_patience: Duration,
    pub dead_after: Duration,
}

/// A strict read of the run's state: what damage means is the machine's to decide.
#[derive(Debug, Clone)]
pub enum StateRead<T> {
    Missing,
    Found(Box<T>),
    /// It exists and cannot be used: the error, and the hint the state gives for it.
    Damaged {
        message: String,
        hint: String,
    },
}

/// What happened, as the driver tells the machine.
#[derive(Debug, Clone)]
pub enum RunInput {
    /// `cluster.json`, asked for by [`RunEffect::ReadCluster`].
    Cluster(StateRead<ClusterRecord>),
    /// The previous generation's rank 0 record, asked for by [`RunEffect::ReadRank0`].
    Rank0(StateRead<RankRecord>),
    /// The driver's poll: while waiting for a previous rank 0, start a round.
    Poll,
    /// The previous rank 0's record as read now (or the one before, when it cannot be
    /// read), asked for by [`RunEffect::ReadPredecessor`], with what this machine's
    /// kernel says of the process behind it (`None`: it runs elsewhere).
    Predecessor {
        record: Box<RankRecord>,
        local: Option<Holder>,
    },
    /// [`RunMachine::poll_timeout`] passed without a verdict on the previous rank 0.
    Timeout,
    /// The run's journals and history, checked as asked by [`RunEffect::CheckRun`]: every
    /// rank's journal, and the torn tails found (tolerated).
    Checked {
        journals: Vec<Vec<Entry>>,
        torn: Vec<String>,
    },
    /// The check found the run damaged: the error and its hint.
    CheckFailed { message: String, hint: String },
    /// Whether the directory holds a run's files, asked for by
    /// [`RunEffect::ReadRunEvidence`].
    RunEvidence(bool),
    /// The name to set an unreadable run aside under, asked for by
    /// [`RunEffect::NameUnreadableRun`].
    UnreadableRun(String),
    /// The run was set aside (where), or could not be (why), as asked by
    /// [`RunEffect::SetAside`].
    SetAside(Result<PathBuf, String>),
    /// A new run's id, asked for by [`RunEffect::NewRunId`].
    RunId(String),
    /// Every rank's journal, asked for by [`RunEffect::ReadJournals`].
    Journals(Vec<Vec<Entry>>),
}

/// What the machine asks the driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEffect {
    /// Read `cluster.json` strictly; hand back [`RunInput::Cluster`].
    ReadCluster,
    /// Read rank 0's record of generation `gen` strictly; hand back [`RunInput::Rank0`].
    ReadRank0 { gen: u64 },
    /// Read `last`'s record (rank 0 of its generation) again; hand back
    /// [`RunInput::Predecessor`].
    ReadPredecessor { last: Box<RankRecord> },
    /// Check the journals and history of `cluster`'s run; hand back [`RunInput::Checked`]
    /// or [`RunInput::CheckFailed`].
    CheckRun(Box<ClusterRecord>),
    /// Does the directory hold a run's files without a readable cluster record? Hand back
    /// [`RunInput::RunEvidence`].
    ReadRunEvidence,
    /// Name the run whose cluster record cannot be read (its history's run id, else one
    /// of the time); hand back [`RunInput::UnreadableRun`].
    NameUnreadableRun,
    /// Move every directory of run `run_id` into `previous-runs/`; hand back
    /// [`RunInput::SetAside`].
    SetAside { run_id: String },
    /// Draw a new run id; hand back [`RunInput::RunId`].
    NewRunId,
    /// Read every rank's journal; hand back [`RunInput::Journals`].
    ReadJournals,
    /// A line for the log.
    Info(String),
    /// A warning for the log.
    Warn(String),
    /// Start generation `gen` (at least) of run `run_id` at `resume`; `previous`: how the
    /// previous generation ended, in words (the end: the forming takes over).
    Chosen {
        run_id: String,
        gen: u64,
        previous: Option<String>,
        resume: Resume,
    },
    /// The run is complete up to `--iterations`: nothing to do (the end).
    Complete { message: String, hint: String },
    /// Refused, a usage error (the end).
    Refused { message: String, hint: String },
    /// Failed to do what the start needs (the end).
    Failed(String),
}

/// The input the machine waits for.
#[derive(Debug, Clone, PartialEq)]
enum Stage {
    Cluster,
    Rank0,
    /// The previous rank 0 (`first`, as first read) may still run: judged at each poll
    /// until `deadline` (`reading`: a round is under way).
    Predecessor {
        first: Box<RankRecord>,
        deadline: Duration,
        reading: bool,
    },
    Check,
    Evidence,
    UnreadableName,
    SetAside {
        run_id: String,
    },
    RunId {
        gen: u64,
    },
    Journals {
        run_id: String,
        gen: u64,
    },
    Over,
}

/// Rank 0's start up to the run chosen (see the module documentation).
#[derive(Debug)]
pub struct RunMachine {
    cfg: RunSettings,
    stage: Stage,
    /// The run's cluster record, when there is one (and it could be read).
    prev: Option<ClusterRecord>,
    /// What `--fresh` could not read (and sets aside with the rest).
    damaged: Option<String>,
    /// How the previous generation ended, in words.
    previous: Option<String>,
    /// The journals checked (without `--fresh`, over a run).
    journals: Option<Vec<Vec<Entry>>>,
    /// No previous rank 0 may still run: none, it ended, or it is judged gone.
    predecessor_settled: bool,
    holders: Holders,
    now: Duration,
    effects: VecDeque<RunEffect>,
    mutation: Option<Mutation>,
}

impl RunMachine {
    pub fn new(cfg: RunSettings) -> RunMachine {
        RunMachine {
            cfg,
            stage: Stage::Cluster,
            prev: None,
            damaged: None,
            previous: None,
            journals: None,
            predecessor_settled: false,
            holders: Holders::default(),
            now: Duration::ZERO,
            effects: VecDeque::from([RunEffect::ReadCluster]),
            mutation: None,
        }
    }

    /// A deliberately broken judgement of the previous rank 0 (the simulator's own
    /// tests; see [`super::mutation`]).
    #[doc(hidden)]
    pub fn with_mutation(mut self, m: Option<Mutation>) -> RunMachine {
        self.mutation = super::mutation(m);
        self
    }

    /// What to do next, in order.
    pub fn poll_effect(&mut self) -> Option<RunEffect> {
        self.effects.pop_front()
    }

    /// While waiting for a previous rank 0: when the wait ends without a verdict (hand
    /// [`RunInput::Timeout`] then), on the driver's monotonic time.
    pub fn poll_timeout(&self) -> Option<Duration> {
        match &self.stage {
            Stage::Predecessor { deadline, .. } => Some(*deadline),
            _ => None,
        }
    }

    /// Chosen, complete, refused or failed: no input changes anything.
    pub fn is_over(&self) -> bool {
        self.stage == Stage::Over
    }

    /// `now`: the driver's monotonic time (never earlier than the last input's).
    pub fn handle(&mut self, now: Duration, input: RunInput) {
        self.now = self.now.max(now);
        match (&self.stage, input) {
            (Stage::Cluster, RunInput::Cluster(read)) => self.on_cluster(read),
            (Stage::Rank0, RunInput::Rank0(read)) => self.on_rank0(read),
            (Stage::Predecessor { .. }, RunInput::Poll) => self.poll_predecessor(),
            (Stage::Predecessor { .. }, RunInput::Predecessor { record, local }) => {
                self.on_predecessor(&record, local)
            }
            (Stage::Predecessor { .. }, RunInput::Timeout) => self.predecessor_gone(),
            (Stage::Check, RunInput::Checked { journals, torn }) => {
                self.effects.extend(torn.into_iter().map(RunEffect::Warn));
                self.journals = Some(journals);
                self.settle();
            }
            (Stage::Check, RunInput::CheckFailed { message, hint }) => {
                self.end(RunEffect::Refused { message, hint })
            }
            (Stage::Evidence, RunInput::RunEvidence(found)) => {
                if found {
                    self.name_unreadable();
                } else {
                    self.choose();
                }
            }
            (Stage::UnreadableName, RunInput::UnreadableRun(run_id)) => self.set_aside(run_id),
            (Stage::SetAside { run_id }, RunInput::SetAside(done)) => {
                let run_id = run_id.clone();
                match done {
                    Ok(aside) => {
                        self.effects.push_back(RunEffect::Info(format!(
                            "--fresh: run {run_id} set aside in {} (nothing deleted); starting a new run",
                            aside.display()
                        )));
                        self.new_run(1);
                    }
                    Err(e) => self.end(RunEffect::Failed(format!(
                        "--fresh: cannot set run {run_id} aside: {e}"
                    ))),
                }
            }
            (Stage::RunId { gen }, RunInput::RunId(run_id)) => {
                let gen = *gen;
                self.resume(run_id, gen);
            }
            (Stage::Journals { run_id, gen }, RunInput::Journals(journals)) => {
                let (run_id, gen) = (run_id.clone(), *gen);
                self.resumed(run_id, gen, &journals);
            }
            _ => {}
        }
        self.assert_invariants();
    }

    /// The run's `cluster.json`: damage is an error naming the file (never "no run": a
    /// new run would start over the old one), except with `--fresh`, which sets it all
    /// aside anyway.
    fn on_cluster(&mut self, read: StateRead<ClusterRecord>) {
        match read {
            StateRead::Found(c) => {
                self.stage = Stage::Rank0;
                self.effects.push_back(RunEffect::ReadRank0 { gen: c.gen });
                self.prev = Some(*c);
            }
            StateRead::Missing => self.no_predecessor(),
            StateRead::Damaged { message, .. } if self.cfg.fresh => {
                self.damaged = Some(message);
                self.no_predecessor();
            }
            StateRead::Damaged { message, hint } => self.end(RunEffect::Refused { message, hint }),
        }
    }

    /// The previous generation's rank 0 record: how that generation ended, and whether
    /// its rank 0 may still run.
    fn on_rank0(&mut self, read: StateRead<RankRecord>) {
        let gen = self.prev.as_ref().map_or(0, |p| p.gen);
        let r0 = match read {
            StateRead::Found(r0) => r0,
            StateRead::Missing => return self.no_predecessor(),
            StateRead::Damaged { message, .. } if self.cfg.fresh => {
                self.damaged = Some(message);
                return self.no_predecessor();
            }
            StateRead::Damaged { message, hint } => {
                return self.end(RunEffect::Refused { message, hint })
            }
        };
        match join::previous_end(gen, &r0) {
            PreviousEnd::Ended(words) => {
                self.previous = Some(words);
                self.no_predecessor();
            }
            PreviousEnd::Unclean => {
                let patience = self.patience();
                if r0.host != self.cfg.host {
                    self.effects.push_back(RunEffect::Info(format!(
                        "checking whether rank 0 of generation {} (pid {} on {}) is still running (up to {:.0}s)",
                        r0.gen, r0.pid, r0.host, patience.as_secs_f64()
                    )));
                }
                self.stage = Stage::Predecessor {
                    first: r0,
                    deadline: self.now + patience * 2,
                    reading: false,
                };
            }
        }
    }

    /// How long a previous rank 0 may stay silent before it counts as gone.
    fn patience(&self) -> Duration {
        self.cfg.slot_patience.max(self.cfg.dead_after)
    }

    fn poll_predecessor(&mut self) {
        if let Stage::Predecessor {
            first,
            reading: reading @ false,
            ..
        } = &mut self.stage
        {
            *reading = true;
            self.effects.push_back(RunEffect::ReadPredecessor {
                last: first.clone(),
            });
        }
    }

    /// One look at the previous rank 0: alive refuses this start, gone goes on, unknown
    /// looks again at the next poll.
    fn on_predecessor(&mut self, record: &RankRecord, local: Option<Holder>) {
        let Stage::Predecessor {
            first,
            reading: reading @ true,
            ..
        } = &mut self.stage
        else {
            return;
        };
        *reading = false;
        let holders = &mut self.holders;
        let now = self.now;
        let judge = |rec: &RankRecord, patience, advances| {
            local.unwrap_or_else(|| holders.judge(rec, now, patience, advances))
        };
        let verdict = join::previous_master(
            record,
            self.cfg.slot_patience,
            self.cfg.dead_after,
            judge,
            self.mutation,
        );
        match verdict {
            Holder::Alive => {
                let (message, hint) = join::previous_master_refusal(first);
                self.end(RunEffect::Refused { message, hint });
            }
            Holder::Gone => self.predecessor_gone(),
            Holder::Unknown => {}
        }
    }

    /// The previous rank 0 stopped heartbeating (or gave no sign within the wait): its
    /// generation ended uncleanly.
    fn predecessor_gone(&mut self) {
        if let Stage::Predecessor { first, .. } = &self.stage {
            self.previous = Some(PreviousEnd::unclean(first.gen, first));
            self.no_predecessor();
        }
    }

    /// No previous rank 0 may still run: check the run, then choose it.
    fn no_predecessor(&mut self) {
        self.predecessor_settled = true;
        match &self.prev {
            Some(p) if !self.cfg.fresh => {
                self.stage = Stage::Check;
                self.effects
                    .push_back(RunEffect::CheckRun(Box::new(p.clone())));
            }
            _ => self.settle(),
        }
    }

    /// The run checked (or not to be): say what `--fresh` could not read, and set an
    /// unreadable run aside, or choose.
    fn settle(&mut self) {
        if let Some(e) = &self.damaged {
            self.effects
                .push_back(RunEffect::Info(format!("--fresh: {e}")));
        }
        if !self.cfg.fresh || self.prev.is_some() {
            return self.choose();
        }
        if self.damaged.is_some() {
            return self.name_unreadable();
        }
        self.stage = Stage::Evidence;
        self.effects.push_back(RunEffect::ReadRunEvidence);
    }

    fn name_unreadable(&mut self) {
        self.stage = Stage::UnreadableName;
        self.effects.push_back(RunEffect::NameUnreadableRun);
    }

    fn set_aside(&mut self, run_id: String) {
        self.effects.push_back(RunEffect::SetAside {
            run_id: run_id.clone(),
        });
        self.stage = Stage::SetAside { run_id };
    }

    fn new_run(&mut self, gen: u64) {
        self.stage = Stage::RunId { gen };
        self.effects.push_back(RunEffect::NewRunId);
    }

    /// Continue the run, start a new one, set it aside (`--fresh`) or refuse a restart
    /// whose configuration would change it.
    fn choose(&mut self) {
        let gen = self.prev.as_ref().map_or(1, |p| p.gen + 1);
        let choice = join::choose_run(
            self.prev.as_ref(),
            self.cfg.fresh,
            &self.cfg.run_fingerprint,
            &self.cfg.run_identity,
            &self.cfg.root,
        );
        match choice {
            RunChoice::New => self.new_run(gen),
            RunChoice::Continue { run_id } => self.resume(run_id, gen),
            RunChoice::SetAside { run_id } => self.set_aside(run_id),
            RunChoice::Refuse { message, hint } => self.end(RunEffect::Refused { message, hint }),
        }
    }

    /// Where run `run_id` resumes: from the journals checked, else from its journals read.
    fn resume(&mut self, run_id: String, gen: u64) {
        match self.journals.take() {
            Some(journals) => self.resumed(run_id, gen, &journals),
            None => {
                self.stage = Stage::Journals { run_id, gen };
                self.effects.push_back(RunEffect::ReadJournals);
            }
        }
    }

    fn resumed(&mut self, run_id: String, gen: u64, journals: &[Vec<Entry>]) {
        let resume = journal::resume_point(journals, &run_id, &self.cfg.walk_item)
            .not_before(self.cfg.first_iteration);
        let iterations = self.cfg.iterations;
        if iterations > 0 && resume.iteration > iterations {
            // Nothing to do: start no generation (an empty one would make `status` show
            // iteration 0). Workers see the run complete and exit 0 as well.
            return self.end(RunEffect::Complete {
                message: format!(
                    "run {run_id} already completed iteration {} (--iterations {iterations}): nothing to do; no new generation started",
                    resume.iteration - 1,
                ),
                hint: "a larger --iterations extends the run".into(),
            });
        }
        self.effects.extend(self.announce(&run_id, &resume));
        let previous = self.previous.take();
        self.end(RunEffect::Chosen {
            run_id,
            gen,
            previous,
            resume,
        });
    }

    /// Where the run starts, for the log (nothing when it starts at its beginning).
    fn announce(&self, run_id: &str, resume: &Resume) -> Option<RunEffect> {
        let first = self.cfg.first_iteration;
        if resume.iteration == first && resume.iteration > 1 {
            return Some(RunEffect::Info(format!(
                "starting run {run_id} at iteration {} (cluster.first-iteration: the iterations before it ran before rl-node)",
                resume.iteration
            )));
        }
        (resume.iteration > 1).then(|| {
            RunEffect::Info(format!(
                "resuming run {run_id} at iteration {} (every rank completed iteration {}{})",
                resume.iteration,
                resume.iteration - 1,
                match (resume.train_done, resume.train_failed) {
                    (true, true) => "; training of this iteration is done everywhere, and failed on some rank: it is not redone and no checkpoint is handed off",
                    (true, false) => "; training of this iteration is done everywhere",
                    _ => "",
                }
            ))
        })
    }

    fn end(&mut self, last: RunEffect) {
        self.stage = Stage::Over;
        self.effects.push_back(last);
    }

    /// The machine's invariants (debug builds and the simulator only).
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        let end = self.effects.iter().position(|e| {
            matches!(
                e,
                RunEffect::Chosen { .. }
                    | RunEffect::Complete { .. }
                    | RunEffect::Refused { .. }
                    | RunEffect::Failed(_)
            )
        });
        if let Some(i) = end {
            assert!(self.is_over(), "the start ended, and the machine goes on");
            assert_eq!(i + 1, self.effects.len(), "nothing follows the start's end");
        }
        let past_predecessor = !matches!(
            self.stage,
            Stage::Cluster | Stage::Rank0 | Stage::Predecessor { .. } | Stage::Over
        );
        assert!(
            self.predecessor_settled || !past_predecessor,
            "the run is chosen while a previous rank 0 may still run"
        );
        for e in &self.effects {
            match e {
                RunEffect::SetAside { .. } => {
                    assert!(self.cfg.fresh, "a run is set aside without --fresh");
                    assert!(
                        self.predecessor_settled,
                        "a run is set aside while its rank 0 may still run"
                    );
                }
                RunEffect::CheckRun(_) => {
                    assert!(!self.cfg.fresh, "--fresh checks the run it sets aside")
                }
                RunEffect::Chosen { run_id, gen, .. } => {
                    assert!(self.predecessor_settled, "chosen before the predecessor");
                    match &self.prev {
                        Some(p) if !self.cfg.fresh => {
                            assert_eq!(&p.run_id, run_id, "a restart continues the run");
                            assert_eq!(
                                p.run_fingerprint, self.cfg.run_fingerprint,
                                "a run continued with another configuration"
                            );
                            assert_eq!(*gen, p.gen + 1, "a restart starts the next generation");
                        }
                        Some(p) => {
                            assert_ne!(&p.run_id, run_id, "--fresh continues the run set aside");
                            assert_eq!(*gen, 1, "a new run starts at generation 1");
                        }
                        None => assert!(*gen == 1, "a new run starts at generation 1"),
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::NodeState;
    use serde_json::json;

    const WALK: &str = "iteration-complete:both";

    fn settings() -> RunSettings {
        RunSettings {
            host: "h0".into(),
            fresh: false,
            run_fingerprint: "run-fp".into(),
            run_identity: json!({"cluster": {"num-nodes": 2}}),
            root: "/nfs/exp".into(),
            walk_item: WALK.into(),
            first_iteration: 1,
            iterations: 0,
            slot_patience: Duration::from_secs(12),
            dead_after: Duration::from_secs(30),
        }
    }

    fn fresh() -> RunSettings {
        RunSettings {
            fresh: true,
            ..settings()
        }
    }

    fn effects(m: &mut RunMachine) -> Vec<RunEffect> {
        std::iter::from_fn(|| m.poll_effect()).collect()
    }

    fn at(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn prev(gen: u64) -> ClusterRecord {
        ClusterRecord {
            run_fingerprint: "run-fp".into(),
            ..ClusterRecord::bare("old", gen, 2)
        }
    }

    fn r0(gen: u64, state: NodeState, seq: u64) -> RankRecord {
        RankRecord {
            state,
            host: "h9".into(),
            pid: 42,
            seq,
            ..RankRecord::vacant("old", gen, 0)
        }
    }

    fn found<T>(v: T) -> StateRead<T> {
        StateRead::Found(Box::new(v))
    }

    fn damaged<T>(what: &str) -> StateRead<T> {
        StateRead::Damaged {
            message: format!("{what} is damaged"),
            hint: "repair it".into(),
        }
    }

    fn done(rank: u32, iteration: u64) -> Entry {
        Entry {
            run_id: "old".into(),
            gen: 3,
            rank,
            iteration,
            item: WALK.into(),
            at: String::new(),
            note: None,
            failed: None,
            checkpoint: None,
        }
    }

    fn chosen(run_id: &str, gen: u64, previous: Option<&str>, iteration: u64) -> RunEffect {
        RunEffect::Chosen {
            run_id: run_id.into(),
            gen,
            previous: previous.map(Into::into),
            resume: Resume {
                iteration,
                ..Resume::default()
            },
        }
    }

    /// Over a previous generation that completed: its record's words, the run checked,
    /// and the run continued where every rank's journal says.
    fn over_completed(m: &mut RunMachine) {
        assert_eq!(effects(m), [RunEffect::ReadCluster]);
        m.handle(at(0), RunInput::Cluster(found(prev(3))));
        assert_eq!(effects(m), [RunEffect::ReadRank0 { gen: 3 }]);
        m.handle(at(0), RunInput::Rank0(found(r0(3, NodeState::Done, 9))));
        assert_eq!(effects(m), [RunEffect::CheckRun(Box::new(prev(3)))]);
    }

    #[test]
    fn an_empty_directory_starts_a_new_run_at_generation_1() {
        let mut m = RunMachine::new(settings());
        assert_eq!(effects(&mut m), [RunEffect::ReadCluster]);
        m.handle(at(0), RunInput::Cluster(StateRead::Missing));
        assert_eq!(effects(&mut m), [RunEffect::NewRunId]);
        m.handle(at(0), RunInput::RunId("new".into()));
        assert_eq!(effects(&mut m), [RunEffect::ReadJournals]);
        m.handle(at(0), RunInput::Journals(vec![vec![], vec![]]));
        assert_eq!(effects(&mut m), [chosen("new", 1, None, 1)]);
        assert!(m.is_over());
        m.handle(at(1), RunInput::Poll);
        assert_eq!(effects(&mut m), []);
    }

    #[test]
    fn a_restart_continues_the_run_from_the_journals_it_checked() {
        let mut m = RunMachine::new(settings());
        over_completed(&mut m);
        m.handle(
            at(0),
            RunInput::Checked {
                journals: vec![vec![done(0, 1), done(0, 2)], vec![done(1, 1)]],
                torn: vec!["rank-1.jsonl ends in a torn line".into()],
            },
        );
        assert_eq!(
            effects(&mut m),
            [
                RunEffect::Warn("rank-1.jsonl ends in a torn line".into()),
                RunEffect::Info(
                    "resuming run old at iteration 2 (every rank completed iteration 1)".into()
                ),
                chosen("old", 4, Some("generation 3 completed"), 2)
            ]
        );
    }

    #[test]
    fn damaged_state_without_fresh_is_refused_naming_it() {
        let mut m = RunMachine::new(settings());
        effects(&mut m);
        m.handle(at(0), RunInput::Cluster(damaged("cluster.json")));
        assert_eq!(
            effects(&mut m),
            [RunEffect::Refused {
                message: "cluster.json is damaged".into(),
                hint: "repair it".into()
            }]
        );
        let mut m = RunMachine::new(settings());
        over_completed(&mut m);
        m.handle(
            at(0),
            RunInput::CheckFailed {
                message: "journal/rank-1.jsonl line 3 is damaged".into(),
                hint: "repair it".into(),
            },
        );
        assert!(matches!(
            effects(&mut m).as_slice(),
            [RunEffect::Refused { message, .. }] if message.starts_with("journal/rank-1.jsonl")
        ));
        assert!(m.is_over());
    }

    #[test]
    fn a_restart_with_another_run_configuration_is_refused() {
        let mut m = RunMachine::new(RunSettings {
            run_fingerprint: "other".into(),
            ..settings()
        });
        over_completed(&mut m);
        m.handle(
            at(0),
            RunInput::Checked {
                journals: vec![],
                torn: vec![],
            },
        );
        match effects(&mut m).as_slice() {
            [RunEffect::Refused { message, hint }] => {
                assert!(
                    message.starts_with("/nfs/exp holds run old with a different configuration")
                );
                assert!(hint.contains("add --fresh to rank 0"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fresh_sets_the_run_aside_unchecked_and_starts_a_new_one() {
        let mut m = RunMachine::new(fresh());
        effects(&mut m);
        m.handle(at(0), RunInput::Cluster(found(prev(3))));
        m.handle(at(0), RunInput::Rank0(found(r0(3, NodeState::Done, 9))));
        assert_eq!(
            effects(&mut m),
            [
                RunEffect::ReadRank0 { gen: 3 },
                RunEffect::SetAside {
                    run_id: "old".into()
                }
            ]
        );
        m.handle(
            at(0),
            RunInput::SetAside(Ok("/nfs/exp/previous-runs/old".into())),
        );
        assert_eq!(
            effects(&mut m),
            [
                RunEffect::Info("--fresh: run old set aside in /nfs/exp/previous-runs/old (nothing deleted); starting a new run".into()),
                RunEffect::NewRunId
            ]
        );
        m.handle(at(0), RunInput::RunId("new".into()));
        m.handle(at(0), RunInput::Journals(vec![vec![], vec![]]));
        assert_eq!(
            effects(&mut m),
            [
                RunEffect::ReadJournals,
                chosen("new", 1, Some("generation 3 completed"), 1)
            ]
        );

        // A rename that fails: the start fails, naming the run.
        let mut m = RunMachine::new(fresh());
        m.handle(at(0), RunInput::Cluster(found(prev(3))));
        m.handle(at(0), RunInput::Rank0(StateRead::Missing));
        m.handle(at(0), RunInput::SetAside(Err("EACCES".into())));
        assert_eq!(
            effects(&mut m).last(),
            Some(&RunEffect::Failed(
                "--fresh: cannot set run old aside: EACCES".into()
            ))
        );
    }

    #[test]
    fn fresh_over_unreadable_state_sets_it_aside_under_the_name_found() {
        // cluster.json damaged: said, then named and set aside.
        let mut m = RunMachine::new(fresh());
        m.handle(at(0), RunInput::Cluster(damaged("cluster.json")));
        assert_eq!(
            effects(&mut m),
            [
                RunEffect::ReadCluster,
                RunEffect::Info("--fresh: cluster.json is damaged".into()),
                RunEffect::NameUnreadableRun
            ]
        );
        m.handle(at(0), RunInput::UnreadableRun("old".into()));
        assert_eq!(
            effects(&mut m),
            [RunEffect::SetAside {
                run_id: "old".into()
            }]
        );
        // Rank 0's record damaged: the run cluster.json names is set aside.
        let mut m = RunMachine::new(fresh());
        m.handle(at(0), RunInput::Cluster(found(prev(3))));
        m.handle(at(0), RunInput::Rank0(damaged("gen-3/rank-0.json")));
        assert_eq!(
            effects(&mut m)[2..],
            [
                RunEffect::Info("--fresh: gen-3/rank-0.json is damaged".into()),
                RunEffect::SetAside {
                    run_id: "old".into()
                }
            ]
        );
        // No cluster.json, but a run's files: set aside; none: a new run.
        for evidence in [true, false] {
            let mut m = RunMachine::new(fresh());
            m.handle(at(0), RunInput::Cluster(StateRead::Missing));
            m.handle(at(0), RunInput::RunEvidence(evidence));
            let want = if evidence {
                RunEffect::NameUnreadableRun
            } else {
                RunEffect::NewRunId
            };
            assert_eq!(
                effects(&mut m),
                [RunEffect::ReadCluster, RunEffect::ReadRunEvidence, want]
            );
        }
    }

    /// A previous rank 0 that never wrote a terminal record, judged at each poll.
    fn unclean(settings: RunSettings) -> RunMachine {
        let mut m = RunMachine::new(settings);
        m.handle(at(0), RunInput::Cluster(found(prev(3))));
        m.handle(at(0), RunInput::Rank0(found(r0(3, NodeState::Running, 5))));
        assert_eq!(
            effects(&mut m)[2..],
            [RunEffect::Info(
                "checking whether rank 0 of generation 3 (pid 42 on h9) is still running (up to 30s)"
                    .into()
            )]
        );
        assert_eq!(m.poll_timeout(), Some(at(60)));
        m
    }

    /// One poll of the wait: its read, and what comes of the record read.
    fn look(m: &mut RunMachine, t: u64, rec: RankRecord, local: Option<Holder>) -> Vec<RunEffect> {
        m.handle(at(t), RunInput::Poll);
        assert_eq!(
            effects(m),
            [RunEffect::ReadPredecessor {
                last: Box::new(r0(3, NodeState::Running, 5))
            }]
        );
        m.handle(
            at(t),
            RunInput::Predecessor {
                record: Box::new(rec),
                local,
            },
        );
        effects(m)
    }

    #[test]
    fn a_previous_rank_0_still_alive_refuses_the_start() {
        let mut m = unclean(settings());
        assert_eq!(look(&mut m, 0, r0(3, NodeState::Running, 5), None), []);
        assert_eq!(look(&mut m, 1, r0(3, NodeState::Running, 6), None), []);
        assert_eq!(
            look(&mut m, 2, r0(3, NodeState::Running, 7), None),
            [RunEffect::Refused {
                message: "rank 0 is already held by a live process: pid 42 on h9 (generation 3, last phase join)".into(),
                hint: "stop that process first, or use another --log-path for a separate run".into()
            }]
        );
        assert!(m.is_over());

        // On this machine, the kernel says so at once.
        let mut m = unclean(settings());
        let refused = look(&mut m, 0, r0(3, NodeState::Running, 5), Some(Holder::Alive));
        assert!(matches!(refused.as_slice(), [RunEffect::Refused { .. }]));
    }

    #[test]
    fn a_previous_rank_0_gone_is_waited_out_and_the_run_continued() {
        let gone =
            "generation 3 ended without a clean stop (rank 0, pid 42 on h9, stopped heartbeating)";
        // Still for the patience (dead-after): gone.
        let mut m = unclean(settings());
        assert_eq!(look(&mut m, 0, r0(3, NodeState::Running, 5), None), []);
        assert_eq!(look(&mut m, 20, r0(3, NodeState::Running, 5), None), []);
        assert_eq!(
            look(&mut m, 31, r0(3, NodeState::Running, 5), None),
            [RunEffect::CheckRun(Box::new(prev(3)))]
        );
        m.handle(
            at(31),
            RunInput::Checked {
                journals: vec![],
                torn: vec![],
            },
        );
        assert_eq!(effects(&mut m), [chosen("old", 4, Some(gone), 1)]);

        // Its record ended while rank 0 looked: gone.
        let mut m = unclean(settings());
        assert_eq!(
            look(&mut m, 0, r0(3, NodeState::Left, 6), None),
            [RunEffect::CheckRun(Box::new(prev(3)))]
        );

        // Unknown at every look until the wait's time passed: taken as gone.
        let mut m = unclean(settings());
        assert_eq!(look(&mut m, 0, r0(3, NodeState::Running, 5), None), []);
        assert_eq!(look(&mut m, 1, r0(3, NodeState::Running, 6), None), []);
        m.handle(at(60), RunInput::Timeout);
        assert_eq!(effects(&mut m), [RunEffect::CheckRun(Box::new(prev(3)))]);
        assert_eq!(m.poll_timeout(), None);
        m.handle(
            at(60),
            RunInput::Checked {
                journals: vec![],
                torn: vec![],
            },
        );
        assert_eq!(effects(&mut m), [chosen("old", 4, Some(gone), 1)]);
    }

    #[test]
    fn a_run_complete_up_to_iterations_starts_no_generation() {
        let mut m = RunMachine::new(RunSettings {
            iterations: 2,
            ..settings()
        });
        over_completed(&mut m);
        m.handle(
            at(0),
            RunInput::Checked {
                journals: vec![vec![done(0, 1), done(0, 2)], vec![done(1, 1), done(1, 2)]],
                torn: vec![],
            },
        );
        assert_eq!(
            effects(&mut m),
            [RunEffect::Complete {
                message: "run old already completed iteration 2 (--iterations 2): nothing to do; no new generation started".into(),
                hint: "a larger --iterations extends the run".into()
            }]
        );
        assert!(m.is_over());
    }

    #[test]
    fn a_run_continued_past_rl_node_starts_at_the_first_iteration() {
        let mut m = RunMachine::new(RunSettings {
            first_iteration: 31,
            ..settings()
        });
        m.handle(at(0), RunInput::Cluster(StateRead::Missing));
        m.handle(at(0), RunInput::RunId("new".into()));
        m.handle(at(0), RunInput::Journals(vec![]));
        assert_eq!(
            effects(&mut m)[3..],
            [
                RunEffect::Info("starting run new at iteration 31 (cluster.first-iteration: the iterations before it ran before rl-node)".into()),
                chosen("new", 1, None, 31)
            ]
        );
    }
}
