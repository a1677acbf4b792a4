//! `JoinMachine`: a worker's join of a generation as a sans-I/O state machine, in the
//! style of [`super::machine::NodeMachine`], so that the node and the simulator run the
//! same procedure instead of the simulator keeping a model of the node's.
//!
//! A round starts at each of the driver's polls ([`Input::Poll`]). While looking, the
//! machine asks for `cluster.json`, then for exactly the records the worker's decision
//! ([`super::join::look_with`]) gets to: rank 0's record, this rank's own slot, where the
//! run would resume. Each is one [`Effect`] answered by one [`Input`] before the round
//! goes on; the decision is replayed over what was collected so far (it is pure, and a
//! holder judged twice at one instant is judged the same), so a look at a generation
//! already skipped still costs one read. It concludes: wait, skip a generation, end (the
//! run is complete, or this process is refused), or join. Joined, it waits for rank 0's
//! release, reading rank 0's record and `cluster.json` at each poll, and leaves the
//! generation when rank 0 ends it, goes still for dead-after, or `cluster.json` names
//! another generation ([`super::fence`]).
//!
//! Rank 0's side, once its [`super::run_machine::RunMachine`] has chosen the run (and
//! waited out a previous rank 0 that may still run), is a [`FormMachine`]: it claims a new generation directory by
//! exclusive create (the next number when another rank 0 was quicker), asks for the
//! generation's writes in the order that makes it safe to find (a placeholder for every
//! worker, its own record, the generation's copy of the cluster record, `cluster.json`,
//! the doorbell), and then at each poll checks the fence on `cluster.json` and runs a
//! [`join::Forming`] round over every rank's record, until it releases the join or
//! leaves to the rank 0 that wrote `cluster.json` last.
//!
//! The worker's machine judges holders with [`Holders`] and rank 0's heartbeat with [`Liveness`],
//! on the monotonic time the driver hands in; what this machine's kernel says of a process
//! (same host: its pid and start time) comes in with the record it was asked about. Time
//! limits (join-timeout) stay with the driver: the machine never gives up on its own.
//! Every state change checks its invariants in debug builds and in the simulator
//! ([`JoinMachine::assert_invariants`]).

use super::join::{self, ClusterSeen, JoinView, Joiner, Look, Mutation, Skipped};
use super::liveness::{Holder, Holders, Stamp};
use super::messages::Joined;
use super::records::{Filesystem, FsVerdict};
use super::{fence, ClusterRecord, Liveness, Mark, RankRecord};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// Who the worker is and what it judges by.
#[derive(Debug, Clone)]
pub struct Settings {
    pub rank: u32,
    /// This process, as records and refusal notes name it.
    pub nonce: String,
    pub host: String,
    pub pid: u32,
    /// The fingerprint of the configuration every node must share, and that view itself
    /// (to word a refusal).
    pub fingerprint: String,
    pub shared_view: Value,
    /// The fingerprint of what may not change across restarts of one run.
    pub run_fingerprint: String,
    /// `--iterations` (0: no target).
    pub iterations: u64,
    pub slot_patience: Duration,
    pub dead_after: Duration,
    /// Started with `--fresh`: the first run read is the one rank 0 sets aside.
    pub fresh: bool,
    /// `cluster.json`, as a missing one is named while waiting for it.
    pub cluster_path: PathBuf,
    /// The filesystem this node sees the shared directory on (None: it cannot tell), to
    /// compare with rank 0's.
    pub filesystem: Option<Filesystem>,
}

/// What a read of `cluster.json` found.
#[derive(Debug, Clone)]
pub enum ClusterRead {
    Missing,
    /// It exists but cannot be used: why.
    Unreadable(String),
    Cluster(Box<ClusterRecord>),
}

/// What happened, as the driver tells the machine.
#[derive(Debug, Clone)]
pub enum Input {
    /// The driver's poll: start a round (ignored while one is under way).
    Poll,
    /// `cluster.json`, as asked for by [`Effect::ReadCluster`].
    Cluster(ClusterRead),
    /// A record asked for by [`Effect::ReadRecord`] (`None`: missing or unreadable), with
    /// what this machine's kernel says of the process behind it (`None`: it runs
    /// elsewhere, or there is no record).
    Record {
        rank: u32,
        record: Option<Box<RankRecord>>,
        local: Option<Holder>,
    },
    /// Where the run asked about by [`Effect::ReadResume`] would resume.
    Resume(u64),
}

/// Why `cluster.json` is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterFor {
    /// A look for a generation: a missing one may be made visible by rank 0's doorbell.
    Look,
    /// Is the joined generation still the current one? (Read past a cached entry.)
    Fence,
}

/// What the machine asks the driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Read `cluster.json`; hand back [`Input::Cluster`].
    ReadCluster(ClusterFor),
    /// Read `rank`'s record of generation `gen` (after a listing of the generation's
    /// directory, when `list_first`: rank 0 writes it through another client); hand back
    /// [`Input::Record`].
    ReadRecord {
        gen: u64,
        rank: u32,
        list_first: bool,
    },
    /// Find where run `run_id` would resume (its journals); hand back [`Input::Resume`].
    ReadResume { run_id: String },
    /// What the worker waits for now (for its "still waiting" lines and timeouts).
    Waiting(String),
    /// A line for the log.
    Info(String),
    /// A warning for the log.
    Warn(String),
    /// Put `refused` into this rank's placeholder of generation `gen` of `run_id`, if it
    /// is still vacant there (rank 0 reads it while it waits).
    LeaveRefusal {
        run_id: String,
        gen: u64,
        refused: String,
    },
    /// Joined: publish this rank's record of `cluster`'s generation, arrived at the join.
    Join {
        cluster: Box<ClusterRecord>,
        rank0: Box<RankRecord>,
    },
    /// Leave generation `gen` (its record says left) and look for another.
    Leave { gen: u64 },
    /// Rank 0 released the join: the generation formed.
    Passed,
    /// The run is already complete up to `--iterations`: nothing to do (the end).
    Complete { message: String, hint: String },
    /// Refused (the end).
    Refused { message: String, hint: String },
}

/// A look's reads so far.
#[derive(Debug, Clone, Default)]
struct Round {
    cluster: Option<ClusterRead>,
    rank0: Option<Option<RankRecord>>,
    slot: Option<Option<RankRecord>>,
    resume: Option<u64>,
    /// What this machine's kernel says of the holders read (rank, verdict).
    local: Vec<(u32, Holder)>,
}

#[derive(Debug)]
enum Stage {
    /// Looking for a generation; a round is under way when `Some`.
    Looking(Option<Box<Round>>),
    /// Joined `cluster`'s generation; waiting for the release. `reading`: a round is under
    /// way (rank 0's record was asked for, then `cluster.json`).
    Joined {
        cluster: Box<ClusterRecord>,
        liveness: Liveness,
        reading: bool,
    },
    /// Released: the join is over.
    Passed,
    /// Complete or refused: the join is over.
    Ended,
}

/// A worker's join (see the module documentation).
#[derive(Debug)]
pub struct JoinMachine {
    cfg: Settings,
    stage: Stage,
    skipped: Skipped,
    holders: Holders,
    /// With `--fresh`: the run read at the first look that read one.
    found: Option<String>,
    /// The generation whose rank 0's different filesystem was warned about.
    fs_warned: Option<(String, u64)>,
    now: Duration,
    /// When rank 0's record was last asked for, joined: an unchanged heartbeat in the
    /// answer proves it still only up to then (`liveness::Stamp`).
    asked: Duration,
    effects: VecDeque<Effect>,
    mutation: Option<Mutation>,
}

/// The look's reads, answered from a round: what was not read yet is noted as needed
/// (the first such) and the look's verdict is then thrown away.
struct Collected<'a> {
    round: &'a Round,
    holders: &'a mut Holders,
    now: Duration,
    need: Option<Effect>,
}

impl JoinView for Collected<'_> {
    fn rank0(&mut self, gen: u64) -> Option<RankRecord> {
        if let Some(r) = &self.round.rank0 {
            return r.clone();
        }
        self.need.get_or_insert(Effect::ReadRecord {
            gen,
            rank: 0,
            list_first: true,
        });
        None
    }

    fn slot(&mut self, gen: u64) -> Option<RankRecord> {
        if let Some(r) = &self.round.slot {
            return r.clone();
        }
        // The rank is known only to the machine: filled in by `JoinMachine::look`.
        self.need.get_or_insert(Effect::ReadRecord {
            gen,
            rank: u32::MAX,
            list_first: false,
        });
        None
    }

    fn holder(&mut self, rec: &RankRecord, patience: Duration, advances: u32) -> Holder {
        if self.need.is_some() {
            // A verdict that will be thrown away: judge nothing on it.
            return Holder::Unknown;
        }
        if let Some((_, h)) = self.round.local.iter().find(|(r, _)| *r == rec.rank) {
            return *h;
        }
        self.holders.judge(rec, self.now, patience, advances)
    }

    fn resume_iteration(&mut self, run_id: &str) -> u64 {
        if let Some(r) = self.round.resume {
            return r;
        }
        self.need.get_or_insert(Effect::ReadResume {
            run_id: run_id.to_string(),
        });
        0
    }
}

impl JoinMachine {
    pub fn new(cfg: Settings) -> JoinMachine {
        JoinMachine {
            cfg,
            stage: Stage::Looking(None),
            skipped: Skipped::default(),
            holders: Holders::default(),
            found: None,
            fs_warned: None,
            asked: Duration::ZERO,
            now: Duration::ZERO,
            effects: VecDeque::new(),
            mutation: None,
        }
    }

    /// A deliberately broken look (the simulator's own tests; see [`super::mutation`]).
    #[doc(hidden)]
    pub fn with_mutation(mut self, m: Option<Mutation>) -> JoinMachine {
        self.mutation = super::mutation(m);
        self
    }

    /// What to do next, in order.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// The generation joined and not yet released or left.
    pub fn joined(&self) -> Option<&ClusterRecord> {
        match &self.stage {
            Stage::Joined { cluster, .. } => Some(cluster),
            _ => None,
        }
    }

    /// The join is over (released, complete or refused): no input changes anything.
    pub fn is_over(&self) -> bool {
        matches!(self.stage, Stage::Passed | Stage::Ended)
    }

    /// `now`: the driver's monotonic time (never earlier than the last input's).
    pub fn handle(&mut self, now: Duration, input: Input) {
        self.now = self.now.max(now);
        match input {
            Input::Poll => self.poll(),
            Input::Cluster(read) => self.on_cluster(read),
            Input::Record {
                rank,
                record,
                local,
            } => self.on_record(rank, record, local),
            Input::Resume(r) => {
                if let Stage::Looking(Some(round)) = &mut self.stage {
                    round.resume = Some(r);
                    self.look();
                }
            }
        }
        self.assert_invariants();
    }

    fn poll(&mut self) {
        match &mut self.stage {
            Stage::Looking(round @ None) => {
                *round = Some(Box::default());
                self.effects
                    .push_back(Effect::ReadCluster(ClusterFor::Look));
            }
            Stage::Joined {
                cluster, reading, ..
            } if !*reading => {
                *reading = true;
                self.asked = self.now;
                self.effects.push_back(Effect::ReadRecord {
                    gen: cluster.gen,
                    rank: 0,
                    list_first: false,
                });
            }
            _ => {}
        }
    }

    fn on_cluster(&mut self, read: ClusterRead) {
        match &mut self.stage {
            Stage::Looking(Some(round)) if round.cluster.is_none() => {
                // The first run read is the one a --fresh rank 0 sets aside, unless rank 0
                // was quicker: then it is the new run, which cannot be complete without
                // this rank either. A look that read no run decides nothing.
                if let (true, None, ClusterRead::Cluster(c)) = (self.cfg.fresh, &self.found, &read)
                {
                    self.found = Some(c.run_id.clone());
                }
                round.cluster = Some(read);
                self.look();
            }
            Stage::Joined {
                cluster,
                liveness,
                reading: reading @ true,
            } => {
                *reading = false;
                let path = &self.cfg.cluster_path;
                let seen = match &read {
                    ClusterRead::Cluster(c) => fence::Seen::Cluster(c),
                    ClusterRead::Missing => fence::Seen::Missing(path),
                    ClusterRead::Unreadable(e) => fence::Seen::Unreadable(e),
                };
                let replaced = fence::check(cluster.gen, &cluster.run_id, seen).is_err();
                if replaced || liveness.is_dead(0, self.now) {
                    self.leave();
                }
            }
            _ => {}
        }
    }

    fn on_record(&mut self, rank: u32, record: Option<Box<RankRecord>>, local: Option<Holder>) {
        let record = record.map(|r| *r);
        match &mut self.stage {
            Stage::Looking(Some(round)) => {
                let found = Some(record);
                if rank == 0 {
                    round.rank0 = found;
                } else if rank == self.cfg.rank {
                    round.slot = found;
                } else {
                    return;
                }
                round.local.retain(|(r, _)| *r != rank);
                round.local.extend(local.map(|h| (rank, h)));
                self.look();
            }
            Stage::Joined {
                cluster,
                liveness,
                reading: true,
            } if rank == 0 => {
                let gen = cluster.gen;
                let r0 = record.filter(|r| r.gen == gen && r.rank == 0);
                let at = Stamp::new(self.asked, self.now);
                match &r0 {
                    Some(r) => {
                        liveness.observe(0, r.seq, at);
                    }
                    None => liveness.watch(0, at),
                }
                if r0.as_ref().is_some_and(|r| r.released_at(0)) {
                    self.stage = Stage::Passed;
                    self.effects.push_back(Effect::Passed);
                } else if r0.as_ref().is_some_and(|r| r.state.is_terminal()) {
                    self.leave();
                } else {
                    // Rank 0 still forming: is the generation still the current one?
                    self.effects
                        .push_back(Effect::ReadCluster(ClusterFor::Fence));
                }
            }
            _ => {}
        }
    }

    /// Rank 0 left (another rank 0 took the run), stopped heartbeating, or the generation
    /// was replaced: leave it, never to join it again, and look for the current one.
    fn leave(&mut self) {
        let Stage::Joined { cluster, .. } = &self.stage else {
            return;
        };
        let (run_id, gen) = (cluster.run_id.clone(), cluster.gen);
        self.effects.push_back(Effect::Info(format!(
            "rank 0 of generation {gen} left or stopped heartbeating before the cluster formed; waiting for a new generation"
        )));
        self.effects.push_back(Effect::Leave { gen });
        self.effects.push_back(Effect::Waiting(
            "rank 0 to publish a generation to join".into(),
        ));
        self.skipped.insert(&run_id, gen);
        self.stage = Stage::Looking(None);
    }

    /// The look over the round's reads: ask for the next read it needs, or act on its
    /// verdict and end the round.
    fn look(&mut self) {
        let Stage::Looking(Some(round)) = &self.stage else {
            return;
        };
        let Some(read) = &round.cluster else {
            return;
        };
        let mine = self.cfg.filesystem.as_ref();
        let found = match read {
            ClusterRead::Cluster(c) => mine
                .and_then(|mine| filesystem_look(mine, &self.cfg.host, c))
                .map(|f| (f, (c.run_id.clone(), c.gen))),
            _ => None,
        };
        match found {
            Some((FsLook::Refuse(refused), cluster)) => {
                self.stage = Stage::Looking(None);
                self.conclude(refused, Some(cluster));
                return;
            }
            // Once per generation, not at every poll.
            Some((FsLook::Warn(warning), cluster)) if self.fs_warned.as_ref() != Some(&cluster) => {
                self.fs_warned = Some(cluster);
                self.effects.push_back(Effect::Warn(warning));
            }
            Some((FsLook::Warn(_), _)) | None => {}
        }
        let Stage::Looking(Some(round)) = &self.stage else {
            return;
        };
        let Some(read) = &round.cluster else {
            return;
        };
        let seen = match read {
            ClusterRead::Missing => ClusterSeen::Missing(&self.cfg.cluster_path),
            ClusterRead::Unreadable(why) => ClusterSeen::Unreadable(why),
            ClusterRead::Cluster(c) => ClusterSeen::Cluster(c),
        };
        let shared_view = || self.cfg.shared_view.clone();
        let run_fingerprint = || self.cfg.run_fingerprint.clone();
        let me = Joiner {
            rank: self.cfg.rank,
            nonce: &self.cfg.nonce,
            fingerprint: &self.cfg.fingerprint,
            shared_view: &shared_view,
            run_fingerprint: &run_fingerprint,
            iterations: self.cfg.iterations,
            slot_patience: self.cfg.slot_patience,
            dead_after: self.cfg.dead_after,
            set_aside: self.found.as_deref(),
        };
        let mut view = Collected {
            round,
            holders: &mut self.holders,
            now: self.now,
            need: None,
        };
        let verdict = join::look_with(seen, &self.skipped, &me, &mut view, self.mutation);
        match view.need {
            Some(Effect::ReadRecord {
                gen,
                rank: u32::MAX,
                list_first,
            }) => self.effects.push_back(Effect::ReadRecord {
                gen,
                rank: self.cfg.rank,
                list_first,
            }),
            Some(need) => self.effects.push_back(need),
            None => {
                let cluster = match read {
                    ClusterRead::Cluster(c) => Some((c.run_id.clone(), c.gen)),
                    _ => None,
                };
                self.stage = Stage::Looking(None);
                self.conclude(verdict, cluster);
            }
        }
    }

    /// Act on a look's verdict; `cluster`: the run and generation `cluster.json` named.
    fn conclude(&mut self, verdict: Look, cluster: Option<(String, u64)>) {
        match verdict {
            Look::Wait(note) => self.effects.extend(note.map(Effect::Waiting)),
            Look::Skip { run_id, gen, why } => {
                self.effects.extend(why.map(Effect::Info));
                self.skipped.insert(&run_id, gen);
                // What this worker waits for now: not what an earlier look at the skipped
                // generation waited for (seed 6474 of the seeded driver simulation timed
                // out naming a previous holder it had long since found gone).
                let waiting = match &self.found {
                    Some(aside) if *aside == run_id => {
                        format!("rank 0 (--fresh) to set run {run_id} aside and start a new run")
                    }
                    _ => "rank 0 to publish a generation to join".into(),
                };
                self.effects.push_back(Effect::Waiting(waiting));
            }
            Look::Complete { message, hint } => {
                self.stage = Stage::Ended;
                self.effects.push_back(Effect::Complete { message, hint });
            }
            Look::Refused {
                message,
                hint,
                note,
            } => {
                if let (Some(note), Some((run_id, gen))) = (note, cluster) {
                    let refused = format!(
                        "rank {} was refused: {note} (pid {} on {})",
                        self.cfg.rank, self.cfg.pid, self.cfg.host
                    );
                    self.effects.push_back(Effect::LeaveRefusal {
                        run_id,
                        gen,
                        refused,
                    });
                }
                self.stage = Stage::Ended;
                self.effects.push_back(Effect::Refused { message, hint });
            }
            Look::Join(cluster, rank0) => {
                self.stage = Stage::Joined {
                    cluster: cluster.clone(),
                    liveness: Liveness::new(self.cfg.dead_after),
                    reading: false,
                };
                self.effects.push_back(Effect::Join { cluster, rank0 });
            }
        }
    }

    /// The machine's invariants (debug builds and the simulator only).
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        match &self.stage {
            Stage::Looking(Some(round)) => {
                assert!(
                    round.cluster.is_some()
                        || (round.rank0.is_none()
                            && round.slot.is_none()
                            && round.resume.is_none()),
                    "no record is read before cluster.json"
                );
            }
            Stage::Looking(None) => {}
            Stage::Joined { cluster, .. } => {
                assert!(
                    !self.skipped.contains(&cluster.run_id, cluster.gen),
                    "joined generation {} of run {}, which it had skipped or left",
                    cluster.gen,
                    cluster.run_id
                );
            }
            Stage::Passed | Stage::Ended => {}
        }
        let end = self.effects.iter().position(|e| {
            matches!(
                e,
                Effect::Passed | Effect::Complete { .. } | Effect::Refused { .. }
            )
        });
        if let Some(i) = end {
            assert!(self.is_over(), "the join ended, and the machine goes on");
            assert_eq!(i + 1, self.effects.len(), "nothing follows the join's end");
        }
    }
}

/// Rank 0's side: forming a generation once the run is chosen (a [`FormMachine`]).
#[derive(Debug, Clone)]
pub struct FormSettings {
    pub num_nodes: u32,
    /// This process, as the join's marks name it.
    pub me: Joined,
    /// `cluster.json`, as a missing one is named when rank 0 leaves.
    pub cluster_path: PathBuf,
}

/// What happened, as rank 0's driver tells its [`FormMachine`].
#[derive(Debug, Clone)]
pub enum FormInput {
    /// The driver's poll: while waiting for arrivals, start a round.
    Poll,
    /// The state directory's names, asked for by [`FormEffect::ListStateDir`].
    Listing(Vec<OsString>),
    /// The exclusive create of [`FormEffect::CreateGenDir`]: made, or it existed already
    /// (another rank 0 was quicker). Any other error stops the driver.
    GenDir { created: bool },
    /// `cluster.json`, asked for by [`FormEffect::ReadCluster`].
    Cluster(ClusterRead),
    /// Every rank's record of the generation as read (index = rank; rank 0's own first),
    /// and the refusal notes read in still-vacant placeholders, asked for by
    /// [`FormEffect::ReadPeers`].
    Peers {
        peers: Vec<Option<RankRecord>>,
        refused: HashMap<u32, String>,
    },
}

/// What rank 0's [`FormMachine`] asks its driver to do, in order. The writes are the
/// order that makes a generation safe to find: its directory, a placeholder for every
/// worker (which each worker later rewrites, never creates), rank 0's own record, the
/// generation's copy of the cluster record, and only then `cluster.json`.
#[derive(Debug, Clone, PartialEq)]
pub enum FormEffect {
    /// List the state directory (creating it if need be); hand back
    /// [`FormInput::Listing`].
    ListStateDir,
    /// Create `gen-N/` exclusively; hand back [`FormInput::GenDir`].
    CreateGenDir(u64),
    /// Write `rank`'s vacant placeholder in generation `gen` of `run_id`.
    Placeholder { run_id: String, gen: u64, rank: u32 },
    /// Start publishing rank 0's own record of `cluster`'s generation, arrived at the
    /// join (`arrived`), heartbeating from here on.
    OwnRecord {
        cluster: Box<ClusterRecord>,
        arrived: Mark,
    },
    /// Write the generation's copy of the cluster record.
    ClusterCopy(Box<ClusterRecord>),
    /// Publish `cluster.json`.
    PublishCluster(Box<ClusterRecord>),
    /// Ring the doorbell for workers waiting on a fresh directory (best effort).
    Doorbell { gen: u64, run_id: String },
    /// The generation is published: say so (and keep its history).
    Published(Box<ClusterRecord>),
    /// Read `cluster.json` past a cached entry; hand back [`FormInput::Cluster`].
    ReadCluster,
    /// Read every rank's record; hand back [`FormInput::Peers`].
    ReadPeers,
    /// Something to say once, as a warning.
    Warn(String),
    /// A worker's refusal, read in its placeholder for the first time (a warning and an
    /// event).
    Refusal(String),
    /// With the next heartbeat: the ranks rank 0 still waits for.
    WaitingFor(Vec<u32>),
    /// Another rank 0 owns the run (it wrote `cluster.json` last): leave the generation,
    /// why (the end).
    Fenced(String),
    /// Every rank arrived: publish the release (the end).
    Release(Mark),
}

#[derive(Debug)]
enum FormStage {
    /// Given the run, until the generation directory is claimed (`asked`: the number
    /// whose create was asked for).
    Claiming {
        cluster: Box<ClusterRecord>,
        asked: Option<u64>,
    },
    /// Published; waiting for arrivals (`reading`: a round is under way).
    Waiting {
        cluster: Box<ClusterRecord>,
        reading: bool,
    },
    /// Released or fenced out.
    Over,
}

/// Rank 0's forming of a generation (see the module documentation).
#[derive(Debug)]
pub struct FormMachine {
    cfg: FormSettings,
    stage: FormStage,
    forming: join::Forming,
    /// The `cluster.json` read error last warned of.
    unreadable: Option<String>,
    effects: VecDeque<FormEffect>,
    fence_mutation: Option<fence::Mutation>,
}

impl FormMachine {
    /// Form a generation of `cluster` (its `gen`: the number wanted, one past the
    /// previous; the directory claimed may be higher).
    pub fn new(cfg: FormSettings, cluster: ClusterRecord) -> FormMachine {
        FormMachine {
            cfg,
            stage: FormStage::Claiming {
                cluster: Box::new(cluster),
                asked: None,
            },
            forming: join::Forming::default(),
            unreadable: None,
            effects: VecDeque::from([FormEffect::ListStateDir]),
            fence_mutation: None,
        }
    }

    /// A deliberately broken fence (the simulator's own tests; see [`super::mutation`]).
    #[doc(hidden)]
    pub fn with_fence_mutation(mut self, m: Option<fence::Mutation>) -> FormMachine {
        self.fence_mutation = super::mutation(m);
        self
    }

    pub fn poll_effect(&mut self) -> Option<FormEffect> {
        self.effects.pop_front()
    }

    /// The generation published (and not yet released or fenced out).
    pub fn published(&self) -> Option<&ClusterRecord> {
        match &self.stage {
            FormStage::Waiting { cluster, .. } => Some(cluster),
            _ => None,
        }
    }

    /// The ranks missing at the last round.
    pub fn missing(&self) -> &[u32] {
        self.forming.missing()
    }

    pub fn is_over(&self) -> bool {
        matches!(self.stage, FormStage::Over)
    }

    pub fn handle(&mut self, input: FormInput) {
        match input {
            FormInput::Poll => {
                if let FormStage::Waiting { reading, .. } = &mut self.stage {
                    if !*reading {
                        *reading = true;
                        self.effects.push_back(FormEffect::ReadCluster);
                    }
                }
            }
            FormInput::Listing(names) => {
                if let FormStage::Claiming { cluster, asked } = &mut self.stage {
                    let gen = join::first_free_generation(cluster.gen, &names);
                    *asked = Some(gen);
                    self.effects.push_back(FormEffect::CreateGenDir(gen));
                }
            }
            FormInput::GenDir { created } => self.on_gen_dir(created),
            FormInput::Cluster(read) => self.on_fence(read),
            FormInput::Peers { peers, refused } => self.on_peers(&peers, &refused),
        }
        self.assert_invariants();
    }

    /// The directory asked for was created (publish the generation in it) or existed
    /// (try the next number).
    fn on_gen_dir(&mut self, created: bool) {
        let FormStage::Claiming { cluster, asked } = &mut self.stage else {
            return;
        };
        let Some(gen) = *asked else {
            return;
        };
        if !created {
            *asked = Some(gen + 1);
            self.effects.push_back(FormEffect::CreateGenDir(gen + 1));
            return;
        }
        let mut cluster = cluster.clone();
        cluster.gen = gen;
        self.effects
            .extend((1..self.cfg.num_nodes).map(|rank| FormEffect::Placeholder {
                run_id: cluster.run_id.clone(),
                gen,
                rank,
            }));
        self.effects.push_back(FormEffect::OwnRecord {
            cluster: cluster.clone(),
            arrived: join::barrier(0, self.cfg.me.clone()).arrival(),
        });
        self.effects
            .push_back(FormEffect::ClusterCopy(cluster.clone()));
        self.effects
            .push_back(FormEffect::PublishCluster(cluster.clone()));
        self.effects.push_back(FormEffect::Doorbell {
            gen,
            run_id: cluster.run_id.clone(),
        });
        self.effects
            .push_back(FormEffect::Published(cluster.clone()));
        self.stage = FormStage::Waiting {
            cluster,
            reading: false,
        };
    }

    fn on_fence(&mut self, read: ClusterRead) {
        let FormStage::Waiting {
            cluster,
            reading: reading @ true,
        } = &mut self.stage
        else {
            return;
        };
        let seen = match &read {
            ClusterRead::Cluster(c) => fence::Seen::Cluster(c),
            ClusterRead::Missing => fence::Seen::Missing(&self.cfg.cluster_path),
            ClusterRead::Unreadable(e) => fence::Seen::Unreadable(e),
        };
        // Two rank 0s started at once both publish a generation; the last to write
        // cluster.json owns the run. A cluster.json that cannot be read says nothing of
        // another rank 0: keep the generation and read it again at the next poll.
        match (
            fence::check_with(cluster.gen, &cluster.run_id, seen, self.fence_mutation),
            &read,
        ) {
            (Ok(()), _) => {
                self.unreadable = None;
                self.effects.push_back(FormEffect::ReadPeers);
            }
            (Err(_), ClusterRead::Unreadable(e)) => {
                *reading = false;
                if self.unreadable.as_ref() != Some(e) {
                    self.effects.push_back(FormEffect::Warn(format!(
                        "cannot check that generation {} is still this rank 0's: {e}; reading it again",
                        cluster.gen
                    )));
                    self.unreadable = Some(e.clone());
                }
            }
            (Err(why), _) => {
                self.stage = FormStage::Over;
                self.effects.push_back(FormEffect::Fenced(why));
            }
        }
    }

    fn on_peers(&mut self, peers: &[Option<RankRecord>], refused: &HashMap<u32, String>) {
        let FormStage::Waiting { reading, .. } = &mut self.stage else {
            return;
        };
        *reading = false;
        let round = self.forming.round(peers, refused);
        if round.complete {
            let release = join::barrier(0, self.cfg.me.clone()).release(&Some(self.cfg.me.clone()));
            self.stage = FormStage::Over;
            self.effects.push_back(FormEffect::Release(release));
            return;
        }
        self.effects
            .extend(round.refusals.into_iter().map(FormEffect::Refusal));
        self.effects
            .extend(round.waiting_for.map(FormEffect::WaitingFor));
    }

    /// The machine's invariants (debug builds and the simulator only).
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        let end = self
            .effects
            .iter()
            .position(|e| matches!(e, FormEffect::Release(_) | FormEffect::Fenced(_)));
        if let Some(i) = end {
            assert!(self.is_over(), "the forming ended, and the machine goes on");
            assert_eq!(
                i + 1,
                self.effects.len(),
                "nothing follows the forming's end"
            );
        }
        if let FormStage::Claiming { .. } = &self.stage {
            assert!(
                self.effects
                    .iter()
                    .all(|e| matches!(e, FormEffect::ListStateDir | FormEffect::CreateGenDir(_))),
                "nothing is written before the generation's directory is claimed"
            );
        }
    }
}

/// What a worker makes of rank 0's filesystem (in `c`) beside its own (`mine`, on `host`).
enum FsLook {
    /// It may not be looking at the shared directory: say so.
    Warn(String),
    /// It cannot be: refused.
    Refuse(Look),
}

/// Rank 0's filesystem against this node's: a refusal when this node cannot be looking at
/// the shared directory, a warning when it may not be, nothing when they are of a kind.
fn filesystem_look(mine: &Filesystem, host: &str, c: &ClusterRecord) -> Option<FsLook> {
    let theirs = c.filesystem.as_ref()?;
    let verdict = mine.against(theirs);
    if verdict == FsVerdict::Same {
        return None;
    }
    let both = format!(
        "rank 0 (on {}) sees the shared directory on {}; this node ({host}) sees it on {}",
        c.host,
        theirs.describe(),
        mine.describe()
    );
    Some(match verdict {
        FsVerdict::NotShared => FsLook::Refuse(Look::Refused {
            message: format!(
                "{both}, a filesystem of this machine alone: the shared filesystem is not mounted on this node"
            ),
            hint: format!(
                "mount the shared filesystem on {host} (or give --log-path where it is mounted) and start this node again"
            ),
            note: Some(format!(
                "it sees the shared directory on {}, not on {}",
                mine.describe(),
                theirs.describe()
            )),
        }),
        _ => FsLook::Warn(format!(
            "{both}: fine when one of them is the file server's own disk; otherwise this node is not looking at the shared directory"
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Mark, NodeState};
    use serde_json::json;

    fn settings() -> Settings {
        Settings {
            rank: 2,
            nonce: "mine".into(),
            host: "h2".into(),
            pid: 102,
            fingerprint: "fp".into(),
            shared_view: json!({}),
            run_fingerprint: "run-fp".into(),
            iterations: 0,
            slot_patience: Duration::from_secs(12),
            dead_after: Duration::from_secs(30),
            fresh: false,
            cluster_path: "/nfs/exp/state/cluster.json".into(),
            filesystem: None,
        }
    }

    fn fs(fs_type: &str, source: &str, at: &str) -> Filesystem {
        Filesystem {
            fs_type: fs_type.into(),
            source: source.into(),
            mount_point: at.into(),
        }
    }

    /// A worker that sees a local disk where rank 0 recorded Lustre is refused at its
    /// first look, naming both, and tells rank 0 why in its placeholder; one that sees
    /// another kind rank 0's disk may be the server of is warned once and looks on.
    #[test]
    fn a_worker_on_another_filesystem_than_rank_0s_is_refused_or_warned() {
        let with_fs = |f: Filesystem| match cluster(2) {
            ClusterRead::Cluster(mut c) => {
                c.filesystem = Some(f);
                ClusterRead::Cluster(c)
            }
            _ => unreachable!(),
        };
        let lustre = fs("lustre", "10.0.0.1@tcp:/scratch", "");
        let local = fs("ext4", "/dev/sda1", "/");
        let mut m = JoinMachine::new(Settings {
            filesystem: Some(local.clone()),
            ..settings()
        });
        m.handle(Duration::ZERO, Input::Poll);
        m.handle(Duration::ZERO, Input::Cluster(with_fs(lustre.clone())));
        match &effects(&mut m)[..] {
            [Effect::ReadCluster(_), Effect::LeaveRefusal {
                gen: 2, refused, ..
            }, Effect::Refused { message, hint }] => {
                assert!(refused.contains("ext4 (/dev/sda1 at /)"), "{refused}");
                assert!(
                    message.contains("lustre (10.0.0.1@tcp:/scratch);"),
                    "{message}"
                );
                assert!(message.contains("is not mounted on this node"), "{message}");
                assert!(hint.contains("mount the shared filesystem on h2"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
        assert!(m.is_over());

        // Rank 0 on the NFS server's own disk, this worker through NFS: a warning, once.
        let mut m = JoinMachine::new(Settings {
            filesystem: Some(fs("nfs4", "h0:/export", "/nfs")),
            ..settings()
        });
        for at in [0, 1] {
            let at = Duration::from_secs(at);
            m.handle(at, Input::Poll);
            m.handle(
                at,
                Input::Cluster(with_fs(fs("xfs", "/dev/md0", "/export"))),
            );
        }
        let warned: Vec<_> = effects(&mut m)
            .into_iter()
            .filter(|e| matches!(e, Effect::Warn(_)))
            .collect();
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(!m.is_over());

        // The same kind, whatever each client calls the server: nothing to say.
        let mut m = JoinMachine::new(Settings {
            filesystem: Some(fs("nfs", "10.0.0.5:/export", "/mnt/exp")),
            ..settings()
        });
        m.handle(Duration::ZERO, Input::Poll);
        m.handle(
            Duration::ZERO,
            Input::Cluster(with_fs(fs("nfs4", "srv:/export", "/nfs"))),
        );
        assert!(effects(&mut m)
            .iter()
            .all(|e| !matches!(e, Effect::Warn(_) | Effect::Refused { .. })));
    }

    fn cluster(gen: u64) -> ClusterRead {
        ClusterRead::Cluster(Box::new(ClusterRecord {
            fingerprint: "fp".into(),
            config: json!({"timing": {"dead-after": "30s"}}),
            host: "h0".into(),
            run_fingerprint: "run-fp".into(),
            ..ClusterRecord::bare("run", gen, 3)
        }))
    }

    fn r0(gen: u64, seq: u64) -> RankRecord {
        RankRecord {
            state: NodeState::Joining,
            nonce: "r0".into(),
            host: "h0".into(),
            seq,
            ..RankRecord::vacant("run", gen, 0)
        }
    }

    fn effects(m: &mut JoinMachine) -> Vec<Effect> {
        std::iter::from_fn(|| m.poll_effect()).collect()
    }

    fn record(rank: u32, record: Option<RankRecord>) -> Input {
        Input::Record {
            rank,
            record: record.map(Box::new),
            local: None,
        }
    }

    /// One look's reads, in the order the decision needs them, then a join once rank 0's
    /// heartbeat advanced; then the release.
    #[test]
    fn a_look_asks_for_each_read_it_needs_then_joins_and_passes_at_the_release() {
        let s = Duration::from_secs;
        let mut m = JoinMachine::new(settings());
        m.handle(s(0), Input::Poll);
        assert_eq!(effects(&mut m), [Effect::ReadCluster(ClusterFor::Look)]);
        m.handle(s(0), Input::Poll);
        assert_eq!(effects(&mut m), [], "one round at a time");
        m.handle(s(0), Input::Cluster(cluster(2)));
        assert_eq!(
            effects(&mut m),
            [Effect::ReadRecord {
                gen: 2,
                rank: 0,
                list_first: true
            }]
        );
        m.handle(s(0), record(0, Some(r0(2, 1))));
        assert_eq!(
            effects(&mut m),
            [Effect::ReadRecord {
                gen: 2,
                rank: 2,
                list_first: false
            }]
        );
        m.handle(s(0), record(2, None));
        match effects(&mut m).as_slice() {
            [Effect::Waiting(w)] => assert!(w.starts_with("checking that rank 0 of generation 2")),
            other => panic!("{other:?}"),
        }
        // The next round: rank 0's heartbeat advanced.
        m.handle(s(1), Input::Poll);
        m.handle(s(1), Input::Cluster(cluster(2)));
        m.handle(s(1), record(0, Some(r0(2, 2))));
        m.handle(s(1), record(2, None));
        assert!(matches!(
            effects(&mut m).as_slice(),
            [_, _, _, Effect::Join { cluster, rank0 }] if cluster.gen == 2 && rank0.seq == 2
        ));
        assert_eq!(m.joined().map(|c| c.gen), Some(2));
        // Waiting for the release: rank 0's record, then whether the generation is current.
        m.handle(s(2), Input::Poll);
        m.handle(s(2), record(0, Some(r0(2, 3))));
        assert_eq!(
            effects(&mut m).last(),
            Some(&Effect::ReadCluster(ClusterFor::Fence))
        );
        m.handle(s(2), Input::Cluster(cluster(2)));
        assert_eq!(effects(&mut m), []);
        let released = RankRecord {
            released: Some(Mark {
                k: 0,
                iteration: 0,
                name: "join".into(),
                payload: Value::Null,
            }),
            ..r0(2, 4)
        };
        m.handle(s(3), Input::Poll);
        m.handle(s(3), record(0, Some(released)));
        assert_eq!(effects(&mut m).last(), Some(&Effect::Passed));
        assert!(m.is_over());
    }

    /// Joined, a worker leaves when `cluster.json` names another generation, or rank 0
    /// stays still for dead-after, and never joins that generation again.
    #[test]
    fn a_joined_worker_leaves_a_replaced_or_silent_generation_for_good() {
        let s = Duration::from_secs;
        let joined = |m: &mut JoinMachine, at: Duration| {
            m.handle(at, Input::Poll);
            m.handle(at, Input::Cluster(cluster(2)));
            m.handle(
                at,
                Input::Record {
                    rank: 0,
                    record: Some(Box::new(r0(2, 1))),
                    local: Some(Holder::Alive),
                },
            );
            m.handle(at, record(2, None));
        };
        let mut m = JoinMachine::new(settings());
        joined(&mut m, s(0));
        assert!(m.joined().is_some(), "{:?}", effects(&mut m));
        effects(&mut m);
        m.handle(s(1), Input::Poll);
        m.handle(s(1), record(0, Some(r0(2, 1))));
        m.handle(s(1), Input::Cluster(cluster(3)));
        let left = effects(&mut m);
        assert!(left.contains(&Effect::Leave { gen: 2 }), "{left:?}");
        assert!(m.joined().is_none());
        // The same generation again: skipped without reading rank 0's record.
        m.handle(s(2), Input::Poll);
        m.handle(s(2), Input::Cluster(cluster(2)));
        assert_eq!(effects(&mut m), [Effect::ReadCluster(ClusterFor::Look)]);

        // Rank 0 still: gone after dead-after of our own looks.
        let mut m = JoinMachine::new(settings());
        joined(&mut m, s(0));
        effects(&mut m);
        for t in [10, 41] {
            m.handle(s(t), Input::Poll);
            m.handle(s(t), record(0, Some(r0(2, 1))));
            m.handle(s(t), Input::Cluster(cluster(2)));
        }
        assert!(effects(&mut m).contains(&Effect::Leave { gen: 2 }));
    }

    /// Another configuration: the refusal's note for rank 0, into the placeholder, and the
    /// end of the join.
    #[test]
    fn a_refusal_leaves_its_note_and_ends_the_join() {
        let mut m = JoinMachine::new(Settings {
            fingerprint: "other".into(),
            shared_view: json!({"timing": {"dead-after": "60s"}}),
            ..settings()
        });
        let now = Duration::ZERO;
        m.handle(now, Input::Poll);
        m.handle(now, Input::Cluster(cluster(2)));
        m.handle(
            now,
            Input::Record {
                rank: 0,
                record: Some(Box::new(r0(2, 1))),
                local: Some(Holder::Alive),
            },
        );
        m.handle(now, record(2, Some(RankRecord::vacant("run", 2, 2))));
        match effects(&mut m).as_slice() {
            [_, _, _, Effect::LeaveRefusal {
                gen: 2, refused, ..
            }, Effect::Refused { message, .. }] => {
                assert!(refused.starts_with("rank 2 was refused: timing.dead-after differs"));
                assert!(refused.ends_with("(pid 102 on h2)"), "{refused}");
                assert!(message.starts_with("this node's configuration differs"));
            }
            other => panic!("{other:?}"),
        }
        assert!(m.is_over());
        m.handle(now, Input::Poll);
        assert_eq!(effects(&mut m), []);
    }

    fn form_machine() -> FormMachine {
        let settings = FormSettings {
            num_nodes: 3,
            me: Joined {
                host: "h0".into(),
                pid: 100,
            },
            cluster_path: "/nfs/exp/state/cluster.json".into(),
        };
        FormMachine::new(settings, ClusterRecord::bare("run", 2, 3))
    }

    fn form_effects(m: &mut FormMachine) -> Vec<FormEffect> {
        std::iter::from_fn(|| m.poll_effect()).collect()
    }

    /// Rank 0 claims a directory above every listed one (the next when another rank 0
    /// was quicker), then writes in the order that makes the generation safe to find.
    #[test]
    fn rank_0_claims_a_new_directory_and_writes_the_generation_in_order() {
        let mut m = form_machine();
        assert_eq!(form_effects(&mut m), [FormEffect::ListStateDir]);
        m.handle(FormInput::Listing(vec![
            "gen-4".into(),
            "cluster.json".into(),
        ]));
        assert_eq!(form_effects(&mut m), [FormEffect::CreateGenDir(5)]);
        m.handle(FormInput::GenDir { created: false });
        assert_eq!(form_effects(&mut m), [FormEffect::CreateGenDir(6)]);
        m.handle(FormInput::GenDir { created: true });
        let order: Vec<String> = form_effects(&mut m)
            .iter()
            .map(|e| match e {
                FormEffect::Placeholder { gen, rank, .. } => format!("placeholder {gen}/{rank}"),
                FormEffect::OwnRecord { cluster, arrived } => {
                    format!("own {} arrived {}", cluster.gen, arrived.name)
                }
                FormEffect::ClusterCopy(c) => format!("copy {}", c.gen),
                FormEffect::PublishCluster(c) => format!("cluster.json {}", c.gen),
                FormEffect::Doorbell { gen, .. } => format!("doorbell {gen}"),
                FormEffect::Published(c) => format!("published {}", c.gen),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            order,
            [
                "placeholder 6/1",
                "placeholder 6/2",
                "own 6 arrived join",
                "copy 6",
                "cluster.json 6",
                "doorbell 6",
                "published 6"
            ]
        );
        assert_eq!(m.published().map(|c| c.gen), Some(6));
    }

    /// Waiting: the fence first, then the arrivals; refusals reported once; the release
    /// once every rank arrived; and a rank 0 whose cluster.json another wrote leaves.
    #[test]
    fn rank_0_waits_behind_its_fence_and_releases_when_every_rank_arrived() {
        let claimed = || {
            let mut m = form_machine();
            m.handle(FormInput::Listing(vec![]));
            form_effects(&mut m);
            m.handle(FormInput::GenDir { created: true });
            form_effects(&mut m);
            m
        };
        let current = || ClusterRead::Cluster(Box::new(ClusterRecord::bare("run", 2, 3)));
        let arrived = |rank| RankRecord {
            arrived: Some(
                join::barrier(
                    rank,
                    Joined {
                        host: "h".into(),
                        pid: 1,
                    },
                )
                .arrival(),
            ),
            ..RankRecord::vacant("run", 2, rank)
        };
        let mut m = claimed();
        m.handle(FormInput::Poll);
        assert_eq!(form_effects(&mut m), [FormEffect::ReadCluster]);
        m.handle(FormInput::Cluster(current()));
        assert_eq!(form_effects(&mut m), [FormEffect::ReadPeers]);
        let refused = HashMap::from([(2, "rank 2 was refused: why".to_string())]);
        let peers = vec![Some(arrived(0)), Some(arrived(1)), None];
        m.handle(FormInput::Peers {
            peers: peers.clone(),
            refused: refused.clone(),
        });
        assert_eq!(
            form_effects(&mut m),
            [
                FormEffect::Refusal("rank 2 was refused: why".into()),
                FormEffect::WaitingFor(vec![2])
            ]
        );
        // A cluster.json that cannot be read: a warning once, and no round.
        for _ in 0..2 {
            m.handle(FormInput::Poll);
            m.handle(FormInput::Cluster(ClusterRead::Unreadable("EIO".into())));
        }
        let warned = form_effects(&mut m);
        assert_eq!(warned.len(), 3, "{warned:?}");
        assert!(matches!(&warned[1], FormEffect::Warn(w) if w.contains("EIO")));
        m.handle(FormInput::Poll);
        m.handle(FormInput::Cluster(current()));
        m.handle(FormInput::Peers { peers, refused });
        assert_eq!(
            form_effects(&mut m),
            [FormEffect::ReadCluster, FormEffect::ReadPeers]
        );
        m.handle(FormInput::Poll);
        m.handle(FormInput::Cluster(current()));
        m.handle(FormInput::Peers {
            peers: vec![Some(arrived(0)), Some(arrived(1)), Some(arrived(2))],
            refused: HashMap::new(),
        });
        assert!(matches!(
            form_effects(&mut m).last(),
            Some(FormEffect::Release(mark)) if mark.name == "join"
        ));
        assert!(m.is_over());

        let mut m = claimed();
        m.handle(FormInput::Poll);
        m.handle(FormInput::Cluster(ClusterRead::Cluster(Box::new(
            ClusterRecord::bare("run", 3, 3),
        ))));
        assert!(matches!(
            form_effects(&mut m).last(),
            Some(FormEffect::Fenced(why)) if why.starts_with("generation 2 was replaced by generation 3")
        ));
        assert!(m.is_over());
    }
}
