//! `NodeMachine`: a node's coordination with its peers as one sans-I/O state machine, in
//! the style of quinn-proto's `Connection`. The driver hands it what happened
//! ([`NodeMachine::handle`]: records read, the heartbeat thread's write state, the outcome
//! of an exclusive create), asks it what to do ([`NodeMachine::poll_effect`]: read these
//! ranks, change our record, create `abort.json`, stop) and when to wake it next
//! ([`NodeMachine::poll_timeout`]). It does no I/O, reads no clock (time is handed in as
//! the node's monotonic [`Duration`] since its start) and starts no thread.
//!
//! What it owns today: watching the peers (which ranks to read each round, their liveness
//! and what their records say, [`super::watch`]), every barrier's arrival, gather, release
//! and pass ([`super::barrier`], typed by its messages), the abort procedure (a failure
//! detected here or handed in becomes the generation's `abort.json` by exclusive create;
//! the first creator's is the cause, [`super::abort::cause`]; the cause goes into our
//! record, where rank 0 relays it to every worker) and the self-stop of a node that cannot
//! write. It holds the generation joined ([`NodeMachine::joined`]), the current
//! iteration's walk ([`super::walk::IterationWalk`], stepped by [`NodeMachine::next_step`])
//! and this rank's journal of the run ([`super::journal::Book`]); the position its aborts
//! name follows from them. It also holds the model the node serves
//! ([`super::serving::Serving`]), rank 0's `workers-wait-for` relay
//! ([`super::relay::Relay`]) and a pipelined run's hand-over with the other cluster
//! ([`super::handover::Handover`]), so the runtime keeps handles, not protocol state. The node's runtime (`crate::node`) drives it through the real shared directory,
//! and the simulator (tests/sim/) drives the same machine over the simulated one: a
//! judgement changed here is a judgement changed in both.
//!
//! Every state change checks its pre- and postconditions ([`NodeMachine::assert_invariants`]),
//! in debug builds and in the simulator (the `sim` feature).

use super::barrier::{Barrier, Progress};
use super::handover::Handover;
use super::journal::Book;
use super::liveness::Stamp;
use super::membership::Members;
use super::messages::Payload;
use super::relay::{Relay, Release, RELAY_POLL};
use super::serving::Serving;
use super::topology::Topology;
use super::walk::{IterationWalk, Step};
use super::watch::{self, Note, Watch};
use super::{AbortInfo, AbortKind, ClusterRecord, Liveness, Mark, NodeState, RankRecord};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

/// What a machine is set up with: who it is and the timing it judges by.
#[derive(Debug, Clone)]
pub struct Settings {
    pub rank: u32,
    pub num_nodes: u32,
    /// This node's host name, named in the aborts it detects.
    pub host: String,
    /// A pipelined run's side (`rollout`/`update`), named in its aborts.
    pub cluster: Option<String>,
    pub heartbeat_interval: Duration,
    pub dead_after: Duration,
    /// Who reads whom at barriers and for liveness: flat, or through group leaders.
    pub topology: Topology,
    /// The generation's members, when not every rank is one (`super::membership`):
    /// `rank` and `num_nodes` are then this node's position and the number of members.
    /// The machine decides over positions and speaks ranks to its driver: the ranks it
    /// asks to read, the records handed in, whom it waits for, the aborts it writes.
    pub members: Option<Members>,
}

/// The phase a node is in before its first iteration, as its aborts name it.
pub const JOIN: &str = "join";

/// Where the node is, for the aborts it writes: the phase's label and the iteration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Position {
    pub run_id: String,
    pub gen: u64,
    pub iteration: u64,
    pub phase: String,
}

/// What happened, as the driver tells the machine.
#[derive(Debug, Clone)]
pub enum Input {
    /// The records asked for by [`Effect::Read`], each stamped with when its read was
    /// sent and when it returned (`None`: missing, unreadable or unparsable).
    Records(Vec<(u32, Option<RankRecord>, Stamp)>),
    /// The heartbeat thread's state: its last write error, and another process found
    /// writing this rank's record (host, pid).
    Publisher {
        write_error: Option<String>,
        intruder: Option<(String, u32)>,
    },
    /// The exclusive create of `abort.json` asked for by [`Effect::CreateAbort`]: created
    /// (ours is the cause), or not, with the one there as read back (`None`: unreadable).
    AbortCreated {
        created: bool,
        first: Option<AbortInfo>,
    },
    /// The create failed outright (the directory cannot be written): ours stands.
    AbortNotWritten { error: String },
}

/// A change to this rank's own record (the heartbeat thread's copy).
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// Publish now: this rank arrived at a barrier.
    Arrived(Mark),
    /// Publish now: rank 0 released a barrier (and waits for nobody).
    Released(Mark),
    /// Publish now: every rank of this leader's group arrived at a barrier (and it waits
    /// for none of them).
    GroupArrived(Mark),
    /// With the next heartbeat: the ranks rank 0 still waits for (for `status`).
    WaitingFor(Vec<u32>),
    /// With the next heartbeat: how long each watched rank's heartbeat has been still.
    Observed(Vec<(u32, u64)>),
}

/// What the machine asks the driver to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Read these ranks' records of the current generation (after one listing of its
    /// directory, which refreshes a FUSE client's cached names), and hand them back as
    /// [`Input::Records`].
    Read(Vec<u32>),
    /// Change this rank's record.
    Record(Change),
    /// Create the generation's `abort.json` exclusively with this abort (the driver
    /// stamps `at` with its wall clock) and hand back [`Input::AbortCreated`].
    CreateAbort(AbortInfo),
    /// Something the node should say once, as a warning.
    Warn(String),
    /// Stop: `0` is the cause, adopted. The driver puts it in this rank's record (rank 0's
    /// relays it to every worker) and says what it means for this node.
    Stop(AbortInfo),
}

/// The barrier this rank is at: enough to rebuild its typed [`Barrier`] on demand, so the
/// machine holds no payload type.
#[derive(Debug, Clone)]
struct AtBarrier {
    k: u64,
    iteration: u64,
    name: String,
    arrival: Mark,
    /// Rank 0 (or a leader): the ranks it said it waits for last.
    missing: Vec<u32>,
    /// A group's leader: its group's arrival is published.
    grouped: bool,
}

/// A deliberately broken machine, for showing that the simulator catches it (`sim`
/// feature only; see [`super::mutation`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Mutations {
    pub barrier: Option<super::barrier::Mutation>,
    pub liveness: Option<super::liveness::Mutation>,
    pub watch: Option<watch::Mutation>,
    pub abort: Option<super::abort::Mutation>,
}

/// The node's coordination with its peers (see the module documentation).
#[derive(Debug)]
pub struct NodeMachine {
    cfg: Settings,
    /// Where the node is: its generation's (from `cluster`), its iteration's and phase's
    /// (from `walk`), or as a driver without a walk sets it.
    position: Position,
    /// The record of the generation joined (`None` before, or after leaving one).
    cluster: Option<ClusterRecord>,
    /// The current iteration's walk, with the iteration's state ([`IterationWalk`]).
    walk: IterationWalk,
    /// This rank's journal of the current run, and what its next entry carries.
    journal: Book,
    /// The model this node serves and names `{model}`, whether it verified it, and a
    /// pipelined rollout's model of the current iteration.
    serving: Serving,
    /// Rank 0, while its rollout command runs with `workers-wait-for`: the relay of the
    /// file it creates by itself to the workers' `{ready_file}`.
    relay: Option<Relay>,
    /// A pipelined run: this node's hand-over with the other cluster (its looks at it and
    /// both queue records), from the start of the run.
    handover: Option<Handover>,
    /// The peers as last read, the processes that joined, their liveness.
    pub watch: Watch,
    /// When each rank's record was last read.
    last_read: Vec<Option<Duration>>,
    /// The barrier counter of the generation: every rank walks the same sequence.
    k: u64,
    at: Option<AtBarrier>,
    /// Rank 0 or a group's leader waits at this barrier: it reads only the ranks still
    /// missing (and each other once per half heartbeat), and rank 0.
    barrier_wait: Option<u64>,
    /// The rank read again this round for its arrival ([`watch::Reads::probe`]): found
    /// in, the other missing ranks are read at once.
    probe: Option<u32>,
    /// Why a process was refused a still-vacant rank, as read from its placeholder.
    pub refused: HashMap<u32, String>,
    /// Ranks found dead while dead peers are tolerated (a dynamic rollout).
    pub dead_peers: BTreeSet<u32>,
    write_error: Option<String>,
    write_error_since: Option<Duration>,
    /// The abort being created (ours), until the create's outcome is known.
    creating: Option<AbortInfo>,
    /// The cause this machine stopped for: no input changes anything after it.
    stopped: Option<AbortInfo>,
    now: Duration,
    effects: VecDeque<Effect>,
    mutations: Mutations,
}

impl NodeMachine {
    pub fn new(cfg: Settings) -> NodeMachine {
        let n = cfg.num_nodes;
        NodeMachine {
            watch: Watch::new(n, Liveness::new(cfg.dead_after)),
            last_read: vec![None; n as usize],
            cfg,
            position: Position {
                phase: JOIN.into(),
                ..Position::default()
            },
            cluster: None,
            walk: IterationWalk::idle(),
            journal: Book::default(),
            serving: Serving::default(),
            relay: None,
            handover: None,
            k: 0,
            at: None,
            barrier_wait: None,
            probe: None,
            refused: HashMap::new(),
            dead_peers: BTreeSet::new(),
            write_error: None,
            write_error_since: None,
            creating: None,
            stopped: None,
            now: Duration::ZERO,
            effects: VecDeque::new(),
            mutations: Mutations::default(),
        }
    }

    #[doc(hidden)]
    pub fn with_mutations(mut self, m: Mutations) -> NodeMachine {
        self.watch.liveness = Liveness::new(self.cfg.dead_after).with_mutation(m.liveness);
        self.mutations = Mutations {
            barrier: super::mutation(m.barrier),
            liveness: super::mutation(m.liveness),
            watch: super::mutation(m.watch),
            abort: super::mutation(m.abort),
        };
        self
    }

    /// The machine serving `serving` from the start (the base model, `cluster.model`).
    pub fn with_serving(mut self, serving: Serving) -> NodeMachine {
        self.serving = serving;
        self
    }

    /// The watch's mutation from now on (a judge of wall-clock stamps needs this node's
    /// wall clock at each round).
    #[doc(hidden)]
    pub fn set_watch_mutation(&mut self, m: Option<watch::Mutation>) {
        self.mutations.watch = super::mutation(m);
    }

    pub fn settings(&self) -> &Settings {
        &self.cfg
    }

    /// Who this node reads now: until the generation formed, flat (rank 0 sees every
    /// rank join, each in its own record), then the cluster's topology.
    pub fn watching(&self) -> Topology {
        match self.watch.formed {
            true => self.cfg.topology,
            false => Topology::flat(self.cfg.num_nodes),
        }
    }

    /// Where the node is now (its generation, iteration and phase), for what it judges
    /// and the aborts it writes, as a driver without a walk sets it (the node's position
    /// follows from [`NodeMachine::joined`] and its walk).
    pub fn set_position(&mut self, position: Position) {
        self.position = position;
    }

    pub fn position(&self) -> &Position {
        &self.position
    }

    /// The node joined the generation of `cluster` (or formed it).
    pub fn joined(&mut self, cluster: ClusterRecord) {
        self.position.run_id = cluster.run_id.clone();
        self.position.gen = cluster.gen;
        self.cluster = Some(cluster);
    }

    /// The node left the generation it had joined (another rank 0 formed a newer one).
    pub fn left_generation(&mut self) {
        self.cluster = None;
        self.position.run_id.clear();
        self.position.gen = 0;
    }

    /// The record of the generation joined, if any.
    pub fn cluster(&self) -> Option<&ClusterRecord> {
        self.cluster.as_ref()
    }

    /// An iteration begins: its walk. The position keeps the last phase until the walk
    /// enters its first.
    pub fn begin_iteration(&mut self, walk: IterationWalk) {
        self.position.iteration = walk.iteration();
        if let Some(phase) = walk.phase() {
            self.position.phase = phase.to_string();
        }
        self.walk = walk;
    }

    /// The next step of the iteration's walk; entering a phase moves the node's position.
    pub fn next_step(&mut self) -> Option<Step> {
        let step = self.walk.next_step();
        if let Some(Step::Enter(phase)) = step {
            self.position.phase = phase.to_string();
        }
        step
    }

    /// The current iteration's walk (an idle one before the first iteration).
    pub fn walk(&self) -> &IterationWalk {
        &self.walk
    }

    /// The current iteration's walk, for the decisions its barriers release.
    pub fn walk_mut(&mut self) -> &mut IterationWalk {
        &mut self.walk
    }

    /// This rank's journal of the current run, as read when the run's iterations began.
    pub fn open_journal(&mut self, book: Book) {
        self.journal = book;
    }

    /// This rank's journal of the current run (empty before it is opened).
    pub fn journal(&self) -> &Book {
        &self.journal
    }

    /// This rank's journal, for an entry appended or what the next one carries.
    pub fn journal_mut(&mut self) -> &mut Book {
        &mut self.journal
    }

    /// The model this node serves, as it knows it.
    pub fn serving(&self) -> &Serving {
        &self.serving
    }

    /// The model this node serves, for a model adopted, verified or rolled out with.
    pub fn serving_mut(&mut self) -> &mut Serving {
        &mut self.serving
    }

    /// Rank 0's rollout command starts with `workers-wait-for`: relay its file to the
    /// workers until it appears or the command ends.
    pub fn start_relay(&mut self, relay: Relay) {
        assert_eq!(self.cfg.rank, 0, "only rank 0 relays workers-wait-for");
        debug_assert!(self.relay.is_none(), "one relay at a time");
        self.relay = Some(relay);
        self.assert_invariants();
    }

    /// The relay running, if any: its file is looked for at each round of a wait.
    pub fn relay(&self) -> Option<&Relay> {
        self.relay.as_ref()
    }

    /// A look for the relay's file: found, the marker to create now, and the relay ends
    /// (the marker is created once).
    pub fn relay_looked(&mut self, found: bool) -> Option<Release> {
        let release = self.relay.as_ref()?.looked(found);
        if release.is_some() {
            self.relay = None;
        }
        release
    }

    /// Rank 0's rollout command ended: nothing is relayed any more.
    pub fn end_relay(&mut self) {
        self.relay = None;
    }

    /// How often a wait looks, at most, for the relay's sake: [`RELAY_POLL`] while a
    /// relay runs.
    pub fn relay_pace(&self) -> Option<Duration> {
        self.relay.as_ref().map(|_| RELAY_POLL)
    }

    /// A pipelined run starts: the hand-over with the other cluster, from now on.
    pub fn begin_handover(&mut self, handover: Handover) {
        debug_assert!(self.handover.is_none(), "one hand-over per run");
        self.handover = Some(handover);
    }

    /// This node's hand-over with the other cluster (a pipelined run only).
    pub fn handover(&self) -> Option<&Handover> {
        self.handover.as_ref()
    }

    /// The hand-over, to look at the other cluster or read or write a queue record.
    pub fn handover_mut(&mut self) -> Option<&mut Handover> {
        self.handover.as_mut()
    }

    /// The current iteration (0 before the first).
    pub fn iteration(&self) -> u64 {
        self.position.iteration
    }

    /// The cause the machine stopped for, once it has.
    pub fn stopped(&self) -> Option<&AbortInfo> {
        self.stopped.as_ref()
    }

    /// The barrier counter: the number of the barrier last arrived at.
    pub fn k(&self) -> u64 {
        self.k
    }

    /// The next thing to do, if any.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        let effect = self.effects.pop_front()?;
        if self.cfg.members.is_none() {
            return Some(effect);
        }
        Some(match effect {
            Effect::Read(ps) => Effect::Read(self.ranks_of(ps)),
            Effect::Record(Change::WaitingFor(ps)) => {
                Effect::Record(Change::WaitingFor(self.ranks_of(ps)))
            }
            Effect::Record(Change::Observed(ages)) => Effect::Record(Change::Observed(
                ages.into_iter()
                    .map(|(p, a)| (self.rank_of(p), a))
                    .collect(),
            )),
            other => other,
        })
    }

    /// The rank at `position` of the generation (itself in a full one).
    pub fn rank_of(&self, position: u32) -> u32 {
        self.cfg
            .members
            .as_ref()
            .map_or(position, |m| m.rank_at(position))
    }

    fn ranks_of(&self, positions: Vec<u32>) -> Vec<u32> {
        positions.into_iter().map(|p| self.rank_of(p)).collect()
    }

    /// Records read, by rank, as the machine sees them: by position, each saying its
    /// position, and whom it waits for by position (a leader's `waiting_for`, which rank 0
    /// names a missing group by); a rank that is no member is not the generation's, and
    /// is dropped. (The simulator found a leader's `waiting_for`, written in ranks, read
    /// as positions.)
    fn to_positions(
        &self,
        reads: Vec<(u32, Option<RankRecord>, Stamp)>,
    ) -> Vec<(u32, Option<RankRecord>, Stamp)> {
        let Some(m) = &self.cfg.members else {
            return reads;
        };
        let positions = |ranks: Vec<u32>| ranks.into_iter().filter_map(|q| m.position(q)).collect();
        reads
            .into_iter()
            .filter_map(|(r, rec, at)| {
                let p = m.position(r)?;
                let rec = rec.map(|rec| match rec.rank == r {
                    true => RankRecord {
                        rank: p,
                        waiting_for: positions(rec.waiting_for),
                        observed_ms: rec
                            .observed_ms
                            .into_iter()
                            .filter_map(|(q, ms)| Some((m.position(q)?, ms)))
                            .collect(),
                        ..rec
                    },
                    false => rec,
                });
                Some((p, rec, at))
            })
            .collect()
    }

    /// When the machine next wants [`NodeMachine::tick`]ing, as a time since the node's
    /// start: the next read of a watched rank due, the moment a watched heartbeat would
    /// have been still for dead-after, and the self-stop of a node that cannot write.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.stopped.is_some() {
            return None;
        }
        let refresh = self.cfg.heartbeat_interval / 2;
        let watched = self.watching().watched(self.cfg.rank);
        let reads = watched.iter().map(|&r| {
            let read = self.last_read.get(r as usize).copied().flatten();
            read.map_or(self.now, |t| t + refresh)
        });
        // A death already due was judged at the last read (or is tolerated).
        let deaths = watched
            .iter()
            .filter_map(|&r| self.watch.liveness.dead_at(r))
            .filter(|&t| t > self.now);
        let stop = self.write_error_since.map(|s| s + self.cfg.dead_after / 2);
        reads.chain(deaths).chain(stop).min()
    }

    /// Time passed: decide which watched ranks to read now ([`watch::to_read`]) and ask
    /// for them; check the write-error self-stop.
    pub fn tick(&mut self, now: Duration) {
        self.advance(now);
        if self.stopped.is_some() || self.creating.is_some() {
            return;
        }
        if self.write_stop_due() {
            return;
        }
        let at = match (self.gathering(), &self.at, self.watch.formed) {
            (Some(k), _, _) => watch::At::Gathering(k),
            // Until the generation formed a worker waits for rank 0's release of the join.
            (None, Some(_), _) | (None, None, false) => watch::At::Barrier,
            (None, None, true) => watch::At::Away,
        };
        let reads = watch::to_read(
            self.cfg.rank,
            &self.watching(),
            &self.watch.peers,
            at,
            &self.last_read,
            now,
            self.cfg.heartbeat_interval / 2,
        );
        self.probe = reads.probe;
        if !reads.ranks.is_empty() {
            self.effects.push_back(Effect::Read(reads.ranks));
        }
    }

    /// Something happened.
    pub fn handle(&mut self, now: Duration, input: Input) {
        self.advance(now);
        match input {
            Input::AbortCreated { created, first } => {
                let mine = self.creating.take().expect("an abort was being created");
                self.stop(super::abort::cause(mine, created, first));
            }
            Input::AbortNotWritten { error } => {
                let mine = self.creating.take().expect("an abort was being created");
                self.effects
                    .push_back(Effect::Warn(format!("cannot write abort.json: {error}")));
                self.stop(mine);
            }
            _ if self.stopped.is_some() || self.creating.is_some() => {}
            Input::Publisher {
                write_error,
                intruder,
            } => self.on_publisher(write_error, intruder),
            Input::Records(reads) => {
                let reads = self.to_positions(reads);
                self.on_records(reads);
                self.sweep();
            }
        }
        self.assert_invariants();
    }

    /// This node detected a failure (its command failed, a timeout, a signal, ...):
    /// publish it as the generation's abort (the first creator's is the cause) and stop.
    /// `joined`: the node has a generation to publish it in (else it stops at once).
    pub fn fail(&mut self, info: AbortInfo, joined: bool) {
        if self.stopped.is_some() || self.creating.is_some() {
            return;
        }
        if joined {
            self.creating = Some(info.clone());
            self.effects.push_back(Effect::CreateAbort(info));
        } else {
            self.stop(info);
        }
        self.assert_invariants();
    }

    /// The driver stops because of `info` (an abort found outside the machine, e.g. the
    /// other cluster's, or the cause the machine gave): nothing changes the machine after.
    pub fn adopt(&mut self, info: AbortInfo) {
        if self.stopped.is_none() {
            self.at = None;
            self.barrier_wait = None;
            self.creating = None;
            self.stopped = Some(info);
        }
    }

    /// An abort this node detects: its own kind, culprit and reason, at its position.
    pub fn abort_info(
        &self,
        kind: AbortKind,
        culprit: u32,
        culprit_host: Option<String>,
        reason: String,
        log: Option<String>,
    ) -> AbortInfo {
        AbortInfo {
            kind,
            culprit,
            culprit_host: culprit_host.unwrap_or_else(|| self.cfg.host.clone()),
            phase: self.position.phase.clone(),
            iteration: self.position.iteration,
            reason,
            log,
            detected_by: self.rank_of(self.cfg.rank),
            silent_ms: None,
            at: String::new(),
            cluster: self.cfg.cluster.clone(),
            detected_in: None,
            dropped: false,
        }
    }

    /// Judge every peer from what its record just read says (its heartbeat sequence and
    /// state; `None`: missing or unreadable), each stamped with the time its read returned:
    /// the ranks dead now, by this node's one liveness judgement (a dynamic rollout's
    /// lease holders). A peer that heartbeats again after a long freeze is live again: it
    /// holds its new leases (the simulator found them taken over at once when a death was
    /// never forgotten).
    pub fn judge_peers(
        &mut self,
        reads: impl IntoIterator<Item = (u32, Option<(u64, NodeState)>, impl Into<Stamp>)>,
    ) -> &BTreeSet<u32> {
        for (r, read, at) in reads {
            let at = at.into();
            let failed = if let Some((seq, state)) = read {
                self.watch.liveness.observe(r, seq, at);
                state.is_terminal() && state != NodeState::Done
            } else {
                self.watch.liveness.watch(r, at);
                false
            };
            if failed || self.watch.liveness.is_dead(r, at.returned) {
                self.dead_peers.insert(r);
            } else {
                self.dead_peers.remove(&r);
            }
        }
        self.assert_invariants();
        &self.dead_peers
    }

    // ------------------------------------------------------------------ barriers

    /// Arrive at the next barrier with `gather`: this rank's arrival is published.
    pub fn arrive<G: Payload + Clone>(&mut self, name: &str, gather: &G) -> u64 {
        assert!(self.at.is_none(), "arrived at a barrier while at another");
        self.k += 1;
        let iteration = self.position.iteration;
        let barrier = Barrier::<G, ()>::new(self.k, self.cfg.rank, iteration, name, gather.clone());
        let arrival = barrier.arrival();
        self.effects
            .push_back(Effect::Record(Change::Arrived(arrival.clone())));
        if self.gathers() {
            self.barrier_wait = Some(self.k);
        }
        self.at = Some(AtBarrier {
            k: self.k,
            iteration,
            name: name.to_string(),
            arrival,
            missing: Vec::new(),
            grouped: false,
        });
        self.assert_invariants();
        self.k
    }

    /// Where the barrier stands on the records read so far. Rank 0 says whom it still
    /// waits for (with the next heartbeat) when that changes.
    pub fn progress<G: Payload + Clone, B: Payload>(&mut self) -> Progress<G, B> {
        if self.at.is_none() {
            // Stopped meanwhile (the stop ended the barrier): nothing passes.
            debug_assert!(self.stopped.is_some(), "progress asked outside a barrier");
            return Progress::Waiting {
                missing: Vec::new(),
            };
        }
        if let Some((rank, host, theirs)) = self.walks_apart() {
            let at = self.at.as_ref().expect("at a barrier");
            let rank = self.rank_of(rank);
            let reason = format!(
                "rank {rank} on {host} is at barrier {} as {theirs} where rank {} is at {}: the two walk the iteration differently, as nodes of different rl-node versions do (this one is {})",
                at.k,
                self.rank_of(self.cfg.rank),
                mark_label(at.iteration, &at.name),
                env!("CARGO_PKG_VERSION")
            );
            let info = self.abort_info(AbortKind::Error, rank, Some(host), reason, None);
            self.fail(info, true);
            return Progress::Waiting {
                missing: Vec::new(),
            };
        }
        let at = self.at.as_mut().expect("at a barrier");
        let gather = G::read(&at.arrival.payload);
        let barrier = Barrier::<G, B>::new(at.k, self.cfg.rank, at.iteration, &at.name, gather)
            .in_topology(self.cfg.topology)
            .with_mutation(self.mutations.barrier);
        // A leader first gathers its group, then waits for the release as any worker.
        if self.cfg.topology.is_leader(self.cfg.rank) && !at.grouped {
            match barrier.group_arrival(&self.watch.peers) {
                Ok(mark) => {
                    at.grouped = true;
                    at.missing.clear();
                    self.effects
                        .push_back(Effect::Record(Change::GroupArrived(mark)));
                }
                Err(missing) => {
                    say_waiting_for(at, &missing, &mut self.effects);
                    let missing = match &self.cfg.members {
                        Some(m) => missing.iter().map(|&p| m.rank_at(p)).collect(),
                        None => missing,
                    };
                    return Progress::Waiting { missing };
                }
            }
        }
        let progress = barrier.on_records(&self.watch.peers);
        if let Progress::Waiting { missing } = &progress {
            if self.cfg.rank == 0 {
                say_waiting_for(at, missing, &mut self.effects);
            }
        }
        self.assert_invariants();
        match progress {
            Progress::Waiting { missing } if self.cfg.members.is_some() => Progress::Waiting {
                missing: self.ranks_of(missing),
            },
            other => other,
        }
    }

    /// Whether this rank gathers arrivals at a barrier: rank 0, and a group's leader (which
    /// also relays its members' calls to rank 0).
    pub fn gathers(&self) -> bool {
        self.cfg.rank == 0 || self.cfg.topology.is_leader(self.cfg.rank)
    }

    /// A peer whose mark at this rank's barrier number names another barrier (or
    /// iteration): of the ranks this one reads, rank 0's release and the others'
    /// arrivals (rank 0's workers or leaders, a leader's members).
    /// Barriers are matched by number, so without this a node walking the iteration
    /// differently (another rl-node version, one barrier more or fewer) would pass a
    /// barrier on a release meant for another, and read its broadcast as its own.
    /// Returns (rank, host, what its mark says).
    fn walks_apart(&self) -> Option<(u32, String, String)> {
        let at = self.at.as_ref()?;
        let differs = |m: &Mark| m.k == at.k && (m.name != at.name || m.iteration != at.iteration);
        let peers = self.watch.peers.iter().enumerate();
        peers
            .filter(|(r, _)| self.watching().watches(self.cfg.rank, *r as u32))
            .filter_map(|(r, rec)| {
                let rec = rec.as_ref()?;
                let mark = if r == 0 {
                    rec.released.as_ref()
                } else {
                    rec.arrived.as_ref()
                }?;
                differs(mark).then(|| {
                    (
                        r as u32,
                        rec.host.clone(),
                        mark_label(mark.iteration, &mark.name),
                    )
                })
            })
            .next()
    }

    /// Rank 0, every rank arrived: release the barrier with `broadcast`.
    pub fn release<B: Payload>(&mut self, broadcast: &B) {
        assert_eq!(self.cfg.rank, 0, "only rank 0 releases");
        let at = self.at.as_ref().expect("at a barrier");
        let barrier =
            Barrier::<(), B>::new(at.k, 0, at.iteration, &at.name, ()).with_mutation(None);
        self.effects
            .push_back(Effect::Record(Change::Released(barrier.release(broadcast))));
        self.barrier_wait = None;
    }

    /// The barrier passed (or the wait for it ended): the node goes on.
    pub fn leave_barrier(&mut self) {
        self.at = None;
        self.barrier_wait = None;
        self.assert_invariants();
    }

    /// Which barrier this rank is at: (k, name).
    pub fn at_barrier(&self) -> Option<(u64, &str)> {
        self.at.as_ref().map(|a| (a.k, a.name.as_str()))
    }

    // ------------------------------------------------------------------ inside

    fn advance(&mut self, now: Duration) {
        // Monotonic: a driver never hands in an earlier time.
        debug_assert!(now >= self.now || cfg!(feature = "sim"), "time went back");
        self.now = self.now.max(now);
    }

    fn on_publisher(&mut self, write_error: Option<String>, intruder: Option<(String, u32)>) {
        if write_error != self.write_error {
            if let Some(e) = &write_error {
                self.effects
                    .push_back(Effect::Warn(format!("heartbeat write failed: {e}")));
            }
            self.write_error_since = write_error
                .as_ref()
                .map(|_| self.write_error_since.unwrap_or(self.now));
            self.write_error = write_error;
        }
        if self.write_stop_due() {
            return;
        }
        if let Some((host, pid)) = intruder {
            let rank = self.rank_of(self.cfg.rank);
            let info = self.abort_info(
                AbortKind::Error,
                rank,
                None,
                format!("another process (pid {pid} on {host}) is writing this rank's record: two nodes were started as rank {rank}"),
                None,
            );
            self.fail(info, true);
        }
    }

    /// A node that cannot write (full disk, read-only or failing filesystem) stops and
    /// says so before its peers would only find its heartbeat still: after half of
    /// dead-after of failing writes.
    fn write_stop_due(&mut self) -> bool {
        let (Some(e), Some(since)) = (&self.write_error, self.write_error_since) else {
            return false;
        };
        if self.now.saturating_sub(since) < self.cfg.dead_after / 2 {
            return false;
        }
        let reason = format!("stopped writing to the shared directory: {e}");
        let info = self.abort_info(
            AbortKind::Error,
            self.rank_of(self.cfg.rank),
            None,
            reason,
            None,
        );
        self.fail(info, true);
        true
    }

    fn on_records(&mut self, reads: Vec<(u32, Option<RankRecord>, Stamp)>) {
        for (r, _, at) in &reads {
            if let Some(slot) = self.last_read.get_mut(*r as usize) {
                *slot = Some(at.returned);
            }
        }
        let (run_id, gen) = (self.position.run_id.clone(), self.position.gen);
        let round = self
            .watch
            .round_stamped(&run_id, gen, reads, self.mutations.watch);
        for note in round.notes {
            match note {
                Note::Refused { rank, why } => {
                    self.refused.insert(rank, why);
                }
                Note::DeadTolerated(rank) => {
                    self.dead_peers.insert(rank);
                }
            }
        }
        let adopted = super::abort::adopted(self.mutations.abort);
        let stop = round
            .stop
            .filter(|s| adopted || !matches!(s, watch::Stop::Abort(_)));
        let Some(stop) = stop else {
            let watched = self.watching().watched(self.cfg.rank);
            let observed = self.watch.observed(&watched, self.now);
            self.effects
                .push_back(Effect::Record(Change::Observed(observed)));
            return;
        };
        let info = match stop {
            watch::Stop::Abort(info) => return self.stop(info),
            watch::Stop::TakenOver { rank, host, pid } => {
                let rank = self.rank_of(rank);
                self.abort_info(
                    AbortKind::Error,
                    rank,
                    Some(host.clone()),
                    format!("rank {rank} was taken over by another process (pid {pid} on {host})"),
                    None,
                )
            }
            watch::Stop::Ended { rank, host, state } => {
                let rank = self.rank_of(rank);
                let what = match state {
                    NodeState::Left => format!("left generation {gen} after joining it, giving up on the generation before it saw it form"),
                    _ => format!("stopped in generation {gen} without publishing why"),
                };
                self.abort_info(
                    AbortKind::Error,
                    rank,
                    Some(host.clone()),
                    format!("rank {rank} on {host} {what} (its log says why)"),
                    None,
                )
            }
            watch::Stop::Dead { rank, silent, last } => {
                let rank = self.rank_of(rank);
                let (host, phase, iteration) = last
                    .map(|p| {
                        let phase = p.phase.map_or_else(|| "join".into(), |p| p.to_string());
                        (p.host, phase, p.iteration)
                    })
                    .unwrap_or_else(|| ("?".into(), "?".into(), 0));
                let mut info = self.abort_info(
                    AbortKind::PeerDead,
                    rank,
                    Some(host),
                    format!("heartbeat still for {:.1}s", silent.as_secs_f64()),
                    None,
                );
                info.phase = phase;
                info.iteration = iteration;
                info.silent_ms = Some(silent.as_millis() as u64);
                info
            }
        };
        self.fail(info, true);
    }

    /// The barrier whose arrivals this node gathers now: the one it waits at (rank 0, or
    /// a group's leader), or, until the generation formed, the join (barrier 0) rank 0
    /// forms, whose arrivals are gathered the same way: a worker seen joined is read once
    /// per half heartbeat (for an abort), and of the ones still missing one a round (at 64
    /// nodes rank 0 read every worker every round while the others started, about a
    /// quarter of its operations over a 5-iteration run).
    fn gathering(&self) -> Option<u64> {
        match self.watch.formed {
            true => self.barrier_wait,
            false => (self.cfg.rank == 0).then_some(0),
        }
    }

    /// The probe of this round found its rank in at the barrier: the others still missing
    /// have likely come in meanwhile too, so read them now, not a round later.
    fn sweep(&mut self) {
        let (Some(p), Some(k)) = (self.probe.take(), self.gathering()) else {
            return;
        };
        if self.stopped.is_some() || self.creating.is_some() {
            return;
        }
        let topology = self.watching();
        let missing = watch::missing(self.cfg.rank, &topology, &self.watch.peers, k);
        if !missing.contains(&p) && !missing.is_empty() {
            self.effects.push_back(Effect::Read(missing));
        }
    }

    fn stop(&mut self, info: AbortInfo) {
        debug_assert!(self.stopped.is_none(), "stopped twice");
        self.at = None;
        self.barrier_wait = None;
        self.stopped = Some(info.clone());
        self.effects.push_back(Effect::Stop(info));
    }

    /// The machine's own invariants, checked after every state change in debug builds
    /// and in the simulator (TigerBeetle style: a broken one is a bug here, not a
    /// condition to handle).
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        let n = self.cfg.num_nodes as usize;
        assert_eq!(self.watch.peers.len(), n, "a peer slot per rank");
        assert_eq!(self.last_read.len(), n, "a read time per rank");
        assert!(
            !(self.stopped.is_some() && self.creating.is_some()),
            "stopped while still creating the abort"
        );
        if let Some(at) = &self.at {
            assert_eq!(at.k, self.k, "at the barrier last arrived at");
            assert_eq!(at.arrival.k, at.k, "the arrival is this barrier's");
            assert!(self.stopped.is_none(), "a stopped node is at no barrier");
        }
        assert_eq!(
            self.cfg.topology.num_nodes(),
            self.cfg.num_nodes,
            "the topology is this cluster's"
        );
        if let Some(k) = self.barrier_wait {
            assert!(self.gathers(), "only rank 0 and leaders wait for arrivals");
            assert!(
                self.at.as_ref().is_some_and(|a| a.k == k),
                "waiting at its own barrier"
            );
        }
        assert!(
            self.write_error.is_some() == self.write_error_since.is_some(),
            "a write error has a start"
        );
        assert!(
            self.relay.is_none() || self.cfg.rank == 0,
            "only rank 0 relays workers-wait-for"
        );
    }
}

/// A gathering rank says whom it waits for (with the next heartbeat, for `status`) when
/// that changed since it last said.
fn say_waiting_for(at: &mut AtBarrier, missing: &[u32], effects: &mut VecDeque<Effect>) {
    if missing != at.missing {
        at.missing = missing.to_vec();
        effects.push_back(Effect::Record(Change::WaitingFor(missing.to_vec())));
    }
}

/// A barrier as messages name it: `eval-complete (iteration 3)`.
fn mark_label(iteration: u64, name: &str) -> String {
    format!("{name} (iteration {iteration})")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::messages::EvalDecision;
    use std::path::Path;

    fn machine(rank: u32, n: u32) -> NodeMachine {
        formed(Settings {
            rank,
            num_nodes: n,
            host: format!("h{rank}"),
            cluster: None,
            heartbeat_interval: Duration::from_secs(1),
            dead_after: Duration::from_secs(10),
            topology: Topology::flat(n),
            members: None,
        })
    }

    /// A machine with `settings` in generation 1's rollout, formed.
    fn formed(settings: Settings) -> NodeMachine {
        let mut m = NodeMachine::new(settings);
        m.set_position(Position {
            run_id: "run".into(),
            gen: 1,
            iteration: 1,
            phase: "rollout".into(),
        });
        m.watch.formed = true;
        m
    }

    /// Rank 0's relay paces its waits until its file is found, then creates the marker
    /// once; the command's end ends it too.
    #[test]
    fn the_relay_paces_the_wait_until_its_file_is_found_once() {
        let mut m = machine(0, 2);
        assert_eq!(m.relay_pace(), None);
        assert_eq!(m.relay_looked(true), None, "no relay, nothing to create");
        let relay = |n| Relay::new(format!("/s/flag-{n}").into(), "/s/ready".into(), "rollout");
        m.start_relay(relay(1));
        assert_eq!(m.relay_pace(), Some(RELAY_POLL));
        assert_eq!(m.relay().map(Relay::watched), Some(Path::new("/s/flag-1")));
        assert_eq!(m.relay_looked(false), None);
        assert_eq!(m.relay_pace(), Some(RELAY_POLL), "still looking");
        let release = m.relay_looked(true).expect("the marker to create");
        assert_eq!(release.marker, Path::new("/s/ready"));
        assert_eq!((m.relay(), m.relay_pace()), (None, None), "once");
        assert_eq!(m.relay_looked(true), None);
        m.start_relay(relay(2));
        m.end_relay();
        assert_eq!(m.relay_pace(), None, "the command ended");
    }

    #[test]
    #[should_panic(expected = "only rank 0 relays")]
    fn a_worker_relays_nothing() {
        let mut m = machine(1, 2);
        m.start_relay(Relay::new("/s/flag".into(), "/s/ready".into(), "rollout"));
    }

    /// A pipelined run's hand-over is the machine's from the run's start: its looks at the
    /// other cluster go through it.
    #[test]
    fn a_pipelined_runs_hand_over_is_held_from_its_start() {
        use crate::protocol::handover::{self, Effect as Look};
        let mut m = machine(0, 2);
        assert!(m.handover().is_none(), "not a pipelined run yet");
        m.begin_handover(Handover::new(handover::Settings {
            other: "update",
            fingerprint: "f".into(),
            heartbeat_interval: Duration::from_secs(1),
            dead_after: Duration::from_secs(10),
            join_timeout: Duration::from_secs(60),
        }));
        assert_eq!(m.handover().map(Handover::other), Some("update"));
        let h = m.handover_mut().expect("begun");
        assert!(h.look(Duration::ZERO, false), "a first look is due");
        assert_eq!(h.poll_effect(), Some(Look::ReadCluster));
    }

    /// The machine's position follows the generation joined and the walk's steps.
    #[test]
    fn the_position_follows_the_generation_and_the_walk() {
        use crate::protocol::journal::Resume;
        use crate::protocol::walk::WalkConfig;
        let mut m = NodeMachine::new(Settings {
            rank: 1,
            num_nodes: 2,
            host: "h1".into(),
            cluster: None,
            heartbeat_interval: Duration::from_secs(1),
            dead_after: Duration::from_secs(10),
            topology: Topology::flat(2),
            members: None,
        });
        assert_eq!((m.position().phase.as_str(), m.iteration()), (JOIN, 0));
        m.joined(ClusterRecord::bare("r7", 3, 2));
        assert_eq!((m.position().run_id.as_str(), m.position().gen), ("r7", 3));
        let cfg = WalkConfig::default();
        m.begin_iteration(IterationWalk::new(cfg, 4, Resume::default()));
        assert_eq!((m.position().phase.as_str(), m.iteration()), (JOIN, 4));
        assert_eq!(
            m.next_step(),
            Some(Step::Enter(crate::protocol::Phase::SyncStart))
        );
        assert_eq!(
            m.position().phase,
            crate::protocol::Phase::SyncStart.to_string()
        );
        m.begin_iteration(IterationWalk::new(cfg, 5, Resume::default()));
        assert_eq!(
            (m.position().phase.clone(), m.iteration()),
            (crate::protocol::Phase::SyncStart.to_string(), 5),
            "the last phase until the walk enters its first"
        );
        m.left_generation();
        assert_eq!((m.position().run_id.as_str(), m.position().gen), ("", 0));
        assert!(m.cluster().is_none());
    }

    fn rec(rank: u32, seq: u64) -> RankRecord {
        RankRecord {
            state: NodeState::Running,
            seq,
            iteration: 1,
            host: format!("h{rank}"),
            ..RankRecord::vacant("run", 1, rank)
        }
    }

    fn drain(m: &mut NodeMachine) -> Vec<Effect> {
        std::iter::from_fn(|| m.poll_effect()).collect()
    }

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_still_peer_is_declared_dead_through_the_abort_file_and_the_first_creator_wins() {
        let mut m = machine(0, 2);
        m.tick(S(0));
        assert_eq!(drain(&mut m), vec![Effect::Read(vec![1])]);
        m.handle(
            S(0),
            Input::Records(vec![(1, Some(rec(1, 5)), S(0).into())]),
        );
        drain(&mut m);
        // Still after dead-after: the machine asks for the abort file.
        m.tick(S(11));
        assert_eq!(drain(&mut m), vec![Effect::Read(vec![1])]);
        m.handle(
            S(11),
            Input::Records(vec![(1, Some(rec(1, 5)), S(11).into())]),
        );
        let effects = drain(&mut m);
        let [Effect::CreateAbort(mine)] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        assert_eq!(
            (mine.kind.clone(), mine.culprit, mine.silent_ms),
            (AbortKind::PeerDead, 1, Some(11_000))
        );
        // Another node's abort was there first: it is the cause.
        let mut theirs = mine.clone();
        theirs.detected_by = 1;
        theirs.kind = AbortKind::Timeout;
        m.handle(
            S(11),
            Input::AbortCreated {
                created: false,
                first: Some(theirs.clone()),
            },
        );
        assert_eq!(drain(&mut m), vec![Effect::Stop(theirs)]);
        // Nothing changes a stopped machine.
        m.tick(S(20));
        m.handle(S(20), Input::Records(vec![]));
        assert!(drain(&mut m).is_empty());
        assert_eq!(m.poll_timeout(), None);
    }

    /// A generation of survivors (ranks 2, 3 and 5 of six): the machine decides over
    /// positions and speaks ranks. Its coordinator (rank 2) reads ranks 3 and 5, takes
    /// their records by rank, waits for ranks, and names a still one by its rank.
    #[test]
    fn a_generation_of_some_ranks_is_read_and_judged_by_rank() {
        let members = crate::protocol::membership::Members::try_from(vec![5, 2, 3]).unwrap();
        let mut m = formed(Settings {
            members: Some(members),
            ..machine(0, 3).cfg
        });
        m.tick(S(0));
        assert_eq!(drain(&mut m), vec![Effect::Read(vec![3, 5])]);
        let arrived = |rank: u32, seq| RankRecord {
            arrived: Some(Mark {
                k: 1,
                iteration: 1,
                name: "b".into(),
                payload: serde_json::Value::Null,
            }),
            ..rec(rank, seq)
        };
        m.arrive("b", &());
        drain(&mut m);
        m.handle(
            S(0),
            Input::Records(vec![
                (3, Some(arrived(3, 1)), S(0).into()),
                (5, Some(rec(5, 1)), S(0).into()),
                // Not a member: not this generation's.
                (1, Some(arrived(1, 1)), S(0).into()),
            ]),
        );
        drain(&mut m);
        assert_eq!(
            m.progress::<(), ()>(),
            Progress::Waiting { missing: vec![5] }
        );
        let effects = drain(&mut m);
        assert!(
            effects.contains(&Effect::Record(Change::WaitingFor(vec![5]))),
            "{effects:?}"
        );
        m.tick(S(11));
        assert_eq!(drain(&mut m), vec![Effect::Read(vec![3, 5])]);
        m.handle(
            S(11),
            Input::Records(vec![
                (3, Some(arrived(3, 2)), S(11).into()),
                (5, Some(rec(5, 1)), S(11).into()),
            ]),
        );
        let effects = drain(&mut m);
        let [Effect::CreateAbort(info)] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        assert_eq!(
            (info.kind.clone(), info.culprit, info.detected_by),
            (AbortKind::PeerDead, 5, 2)
        );
    }

    #[test]
    fn a_node_that_cannot_write_stops_after_half_of_dead_after() {
        let mut m = machine(1, 2);
        let failing = || Input::Publisher {
            write_error: Some("ENOSPC".into()),
            intruder: None,
        };
        m.handle(S(1), failing());
        assert_eq!(
            drain(&mut m),
            vec![Effect::Warn("heartbeat write failed: ENOSPC".into())]
        );
        assert_eq!(m.poll_timeout().map(|t| t <= S(6)), Some(true));
        m.handle(S(5), failing());
        assert!(
            drain(&mut m).is_empty(),
            "4 s of failing writes is not yet half of 10 s"
        );
        m.tick(S(6));
        let effects = drain(&mut m);
        let [Effect::CreateAbort(info)] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        assert_eq!(info.culprit, 1);
        assert!(info.reason.contains("ENOSPC"), "{}", info.reason);
    }

    #[test]
    fn a_barrier_is_arrived_gathered_released_and_passed_with_typed_messages() {
        let mut r0 = machine(0, 2);
        let mut r1 = machine(1, 2);
        assert_eq!(r0.arrive("files-ready", &()), 1);
        assert_eq!(r1.arrive("files-ready", &()), 1);
        let arrival = |m: &mut NodeMachine| {
            drain(m).into_iter().find_map(|e| match e {
                Effect::Record(Change::Arrived(mark)) => Some(mark),
                _ => None,
            })
        };
        let mark1 = arrival(&mut r1).expect("rank 1 arrives");
        arrival(&mut r0).expect("rank 0 arrives");
        assert_eq!(
            r0.progress::<(), EvalDecision>(),
            Progress::Waiting { missing: vec![1] }
        );
        assert_eq!(
            drain(&mut r0),
            vec![Effect::Record(Change::WaitingFor(vec![1]))]
        );
        // Rank 0 at the barrier reads only ranks not yet arrived.
        let mut arrived = rec(1, 2);
        arrived.arrived = Some(mark1);
        r0.handle(S(1), Input::Records(vec![(1, Some(arrived), S(1).into())]));
        drain(&mut r0);
        r0.tick(S(1));
        assert!(
            drain(&mut r0).is_empty(),
            "an arrived rank is not read again at once"
        );
        assert!(matches!(
            r0.progress::<(), EvalDecision>(),
            Progress::Complete { .. }
        ));
        r0.release(&EvalDecision { eval: true });
        let released = drain(&mut r0).into_iter().find_map(|e| match e {
            Effect::Record(Change::Released(m)) => Some(m),
            _ => None,
        });
        let mut r0rec = rec(0, 3);
        r0rec.released = released;
        r1.handle(S(1), Input::Records(vec![(0, Some(r0rec), S(1).into())]));
        assert_eq!(
            r1.progress::<(), EvalDecision>(),
            Progress::Released {
                broadcast: EvalDecision { eval: true }
            }
        );
        r1.leave_barrier();
        r0.leave_barrier();
        assert_eq!(r1.arrive("next", &()), 2);
    }

    /// Rank 0 waiting at a barrier reads one missing rank a round (the probe); when it
    /// is in, the other missing ones are read in the same round, not one at a time.
    #[test]
    fn at_a_barrier_one_missing_rank_is_probed_and_its_arrival_sweeps_the_others() {
        let mut r0 = machine(0, 4);
        r0.arrive("b", &());
        drain(&mut r0);
        // Every worker read lately and not arrived.
        let reads = (1..4).map(|r| (r, Some(rec(r, 1)), S(1).into())).collect();
        r0.handle(S(1), Input::Records(reads));
        drain(&mut r0);
        r0.tick(S(1));
        assert_eq!(drain(&mut r0), vec![Effect::Read(vec![1])], "the probe");
        let ms = Duration::from_millis;
        r0.handle(
            ms(1100),
            Input::Records(vec![(1, Some(rec(1, 2)), ms(1100).into())]),
        );
        let effects = drain(&mut r0);
        assert!(
            !effects.iter().any(|e| matches!(e, Effect::Read(_))),
            "still missing: no sweep"
        );
        r0.tick(ms(1100));
        assert_eq!(
            drain(&mut r0),
            vec![Effect::Read(vec![2])],
            "read longest ago"
        );
        let mut in_ = rec(2, 3);
        in_.arrived = Some(Mark {
            k: 1,
            iteration: 1,
            name: "b".into(),
            payload: serde_json::Value::Null,
        });
        r0.handle(
            ms(1100),
            Input::Records(vec![(2, Some(in_), ms(1100).into())]),
        );
        assert!(
            drain(&mut r0).contains(&Effect::Read(vec![1, 3])),
            "rank 2 is in: the sweep reads the others"
        );
    }

    /// Rank 0 forming a generation gathers the join (barrier 0) like any barrier: a
    /// worker seen joined is not read again within half a heartbeat, of the ones still
    /// vacant one a round, and the one that joined sweeps the rest in. A worker waiting
    /// for the join's release reads rank 0 every round.
    #[test]
    fn the_join_probes_one_vacant_rank_a_round_and_a_joined_one_sweeps_the_rest() {
        let mut r0 = machine(0, 5);
        r0.watch.formed = false;
        let ms = Duration::from_millis;
        let reads = |m: &mut NodeMachine| -> Vec<Effect> {
            let effects = drain(m).into_iter();
            effects.filter(|e| matches!(e, Effect::Read(_))).collect()
        };
        r0.tick(ms(0));
        assert_eq!(
            reads(&mut r0),
            vec![Effect::Read(vec![1, 2, 3, 4])],
            "first look"
        );
        let joined = |r: u32| RankRecord {
            arrived: Some(Mark {
                k: 0,
                iteration: 0,
                name: "join".into(),
                payload: serde_json::Value::Null,
            }),
            ..rec(r, 1)
        };
        let vacant = |r: u32| RankRecord::vacant("run", 1, r);
        let first = vec![
            (1, Some(joined(1)), ms(0).into()),
            (2, Some(vacant(2)), ms(0).into()),
            (3, Some(vacant(3)), ms(0).into()),
            (4, Some(vacant(4)), ms(0).into()),
        ];
        r0.handle(ms(0), Input::Records(first));
        drain(&mut r0);
        r0.tick(ms(10));
        assert_eq!(
            reads(&mut r0),
            vec![Effect::Read(vec![2])],
            "one vacant rank"
        );
        r0.handle(
            ms(10),
            Input::Records(vec![(2, Some(vacant(2)), ms(10).into())]),
        );
        assert_eq!(reads(&mut r0), vec![], "still vacant: no sweep");
        r0.tick(ms(20));
        assert_eq!(
            reads(&mut r0),
            vec![Effect::Read(vec![3])],
            "read longest ago"
        );
        r0.handle(
            ms(20),
            Input::Records(vec![(3, Some(joined(3)), ms(20).into())]),
        );
        assert_eq!(reads(&mut r0), vec![Effect::Read(vec![2, 4])], "the sweep");
        // Half a heartbeat on, every rank is due a look again, joined or not.
        r0.tick(ms(600));
        assert_eq!(reads(&mut r0), vec![Effect::Read(vec![1, 2, 3, 4])]);
        let mut w = machine(2, 5);
        w.watch.formed = false;
        for t in [0, 10, 20] {
            w.tick(ms(t));
            assert_eq!(reads(&mut w), vec![Effect::Read(vec![0])]);
            w.handle(
                ms(t),
                Input::Records(vec![(0, Some(rec(0, 1)), ms(t).into())]),
            );
            drain(&mut w);
        }
    }

    /// A node that walks the iteration with another barrier at the same number (a node
    /// of an rl-node version with one barrier more) is stopped, named, on both sides,
    /// instead of passing on a release meant for another barrier.
    #[test]
    fn a_peer_at_another_barrier_of_the_same_number_stops_the_generation_naming_it() {
        let mark = |name: &str| Mark {
            k: 1,
            iteration: 1,
            name: name.into(),
            payload: serde_json::Value::Null,
        };
        // Rank 0 at eval-complete, rank 1's arrival says eval-decision.
        let mut r0 = machine(0, 2);
        r0.arrive("eval-complete", &());
        drain(&mut r0);
        let mut older = rec(1, 2);
        older.arrived = Some(mark("eval-decision"));
        r0.handle(S(1), Input::Records(vec![(1, Some(older), S(1).into())]));
        drain(&mut r0);
        assert_eq!(
            r0.progress::<(), ()>(),
            Progress::Waiting { missing: vec![] }
        );
        let effects = drain(&mut r0);
        let [Effect::CreateAbort(info)] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        assert_eq!(info.culprit, 1);
        assert!(
            info.reason.contains("rank 1 on h1 is at barrier 1 as eval-decision (iteration 1) where rank 0 is at eval-complete (iteration 1)")
                && info.reason.contains("different rl-node versions"),
            "{}",
            info.reason
        );
        // Rank 1 at eval-decision, rank 0's release says eval-complete: not passed.
        let mut r1 = machine(1, 2);
        r1.arrive("eval-decision", &());
        drain(&mut r1);
        let mut r0rec = rec(0, 3);
        r0rec.released = Some(mark("eval-complete"));
        r1.handle(S(1), Input::Records(vec![(0, Some(r0rec), S(1).into())]));
        drain(&mut r1);
        assert_eq!(
            r1.progress::<(), EvalDecision>(),
            Progress::Waiting { missing: vec![] }
        );
        let effects = drain(&mut r1);
        let [Effect::CreateAbort(info)] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        assert_eq!(info.culprit, 0);
        // The same barrier at the same number passes as before.
        let mut r1 = machine(1, 2);
        r1.arrive("eval-complete", &());
        drain(&mut r1);
        let mut r0rec = rec(0, 3);
        r0rec.released = Some(mark("eval-complete"));
        r1.handle(S(1), Input::Records(vec![(0, Some(r0rec), S(1).into())]));
        assert!(matches!(r1.progress::<(), ()>(), Progress::Released { .. }));
    }
}
