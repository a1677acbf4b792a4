//! `elastic`: the cluster going on when nodes are lost (`cluster.min-nodes`), as a seeded,
//! single-threaded simulation of the protocol's own machines over the simulated shared
//! directory.
//!
//! Each node runs the node's machine (`protocol::machine::NodeMachine`: heartbeats
//! watched, barriers, deaths declared through `abort.json`) over a generation's members,
//! and, when its generation ends with a member lost, the survivors' regroup
//! (`protocol::membership::Regroup`): the lowest survivor claims the next generation by
//! an exclusive create of its directory and publishes its members in `cluster.json`;
//! the others wait for it, join it at their position, or stop when it left them out;
//! below `min-nodes` every survivor stops. Every generation begins with a barrier at which
//! the members say where they are, and its coordinator sets where the generation resumes
//! (the earliest), as the journals do in the node.
//!
//! Ranks come back: in one kill of two the rank is started again later as a new process
//! (`membership::Rejoin`), which asks in a request of its own; the coordinator takes live
//! requests into a generation it forms at the next boundary (`membership::grow`).
//!
//! Work: before each logical barrier every rank has items, each committed by an
//! exclusive create; a dropped rank's are dealt over the members (`membership::replan`).
//!
//! Faults: nodes killed at any moment (rank 0 and the coordinators of later
//! generations included, several per run), brief freezes, and in one seed of four a node
//! stopped for three to five dead-afters that wakes up in a generation that went on
//! without it. Per-node NFS attribute and lookup caches of up to a minute, clocks up to
//! 1 % fast or slow. `min-nodes` is drawn per seed, `num-nodes` (today's behaviour) in
//! one seed of five.
//!
//! Invariants, against the directory's true content:
//! - at most one coordinator acts per generation: one `cluster.json` publication per
//!   generation, and every release of its barriers is its own;
//! - no rank passes a generation's barrier before every member of that generation arrived
//!   there, and every member passes with its coordinator's broadcast, which gathered each
//!   member once;
//! - a rank named dead by a generation's abort is no member of a generation formed after
//!   it; a death declared is one the observer's reads saw (dead-after of one heartbeat)
//!   of a rank that really stopped;
//! - with `min-nodes = num-nodes`, no generation is formed after a loss;
//! - every merge finds every rank's items of its step committed (a dropped rank's too);
//! - a generation grows only by ranks whose new process runs, and keeps every member;
//! - progress: whenever at least `min-nodes` nodes were never killed or stopped long,
//!   every one of them passes every barrier; every run ends within a bound.
//!
//! Deliberate mutations caught: a survivor that lost the claim acting as coordinator
//! anyway (two coordinators), and a coordinator keeping the lost ranks among the next
//! generation's members.

use super::Violation;
use rl_node::layout::Layout;
use rl_node::protocol::barrier::Progress;
use rl_node::protocol::machine::{self, Change, Effect, Input, NodeMachine};
use rl_node::protocol::membership::{
    self as ms, Ending, Members, Mutation, Regroup, Regrouped, Rejoin, RejoinEffect, RejoinInput,
    Requests,
};
use rl_node::protocol::messages::Plain;
use rl_node::protocol::topology::Topology;
use rl_node::protocol::{wall_stamp, AbortInfo, AbortKind, ClusterRecord, NodeState, RankRecord};
use rl_node::rng::SplitMix64 as Rng;
use rl_node::store::sim::{SimClient, SimWorld};
use rl_node::store::SharedDir;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The barriers a run walks (logical: the same across generations).
const BARRIERS: u64 = 10;

/// What a member gathers: at a generation's first barrier, the next logical barrier it
/// has to pass; at the others, the logical barrier it arrives at.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Arrival {
    rank: u32,
    at: u64,
}
impl Plain for Arrival {}

/// What a coordinator broadcasts: the logical barrier (at the first barrier: where the
/// generation resumes) and whom it gathered.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Release {
    gen: u64,
    k: u64,
    logical: u64,
    ranks: Vec<u32>,
    /// A generation the coordinator formed at this boundary for ranks coming back: every
    /// member goes on in it.
    next: Option<(u64, Vec<u32>)>,
}
impl Plain for Release {}

/// The wall-clock time at the simulation's start: 2026-11-23.
const WALL_ORIGIN_S: u64 = 1_795_392_000;

#[derive(Debug, Clone, PartialEq)]
enum Life {
    /// A member of its generation, walking the barriers.
    Running,
    /// Its generation ended with a member lost: forming the next one.
    Regrouping,
    /// Passed every barrier.
    Done,
    /// Stopped: declared dead, left out, or below min-nodes.
    Stopped(String),
    /// Killed (kill -9): never acts again (a restart is a new process).
    Killed,
    /// A process started again for a rank the generation does not list: asking to come
    /// back (`membership::Rejoin`).
    Rejoining,
}

struct Node {
    life: Life,
    gen: u64,
    members: Members,
    machine: NodeMachine,
    regroup: Option<Regroup>,
    rejoin: Option<Rejoin>,
    /// As a generation's coordinator: the requests of ranks asking to come back.
    requests: Requests,
    /// This rank's processes so far (a restart is a new one, with a new nonce).
    incarnation: u32,
    /// When this rank was last killed.
    killed_at: Option<u64>,
    /// The machine's barrier number to arrive at next in this generation, and whether
    /// it arrived.
    k: u64,
    arrived: bool,
    /// The next logical barrier to pass, and the logical barrier of this generation's
    /// second barrier (from the first's release).
    next: u64,
    start: u64,
    /// Its own record of the current generation (its heartbeat thread's copy).
    record: RankRecord,
    /// The work of the logical barrier it goes to next (`work_for`): its own items and
    /// those of dropped ranks dealt to it, (rank, item), not yet done.
    work: VecDeque<(u32, u32)>,
    work_for: u64,
    next_beat: u64,
    /// When the generation joined began, by true time (the join's deadline counts from it).
    joined_at: u64,
    rate_ppm: u64,
    frozen_until: u64,
    freezes: Vec<(u64, u64)>,
    last_turn: u64,
    /// Per peer rank: the heartbeat last read in this generation and when (true time) a
    /// read first returned it.
    seen: BTreeMap<u32, (u64, u64)>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Mutations {
    pub regroup: Option<Mutation>,
}

struct Sim {
    n: usize,
    min_nodes: u32,
    mutations: Mutations,
    rng: Rng,
    now: u64,
    world: Arc<SimWorld>,
    clients: Vec<SimClient>,
    clock: Arc<AtomicU64>,
    layout: Layout,
    lifetime_ms: u64,
    /// Items each rank's share of a step has (a step: the work before a logical barrier).
    items: u32,
    /// Workers per group through a leader (`None`: flat).
    group: Option<u32>,
    heartbeat_ms: u64,
    dead_after_ms: u64,
    wall_skew_ms: Vec<i64>,
    nodes: Vec<Node>,
    /// Every generation formed: its coordinator and members (generation 1: everyone).
    formed: BTreeMap<u64, (u32, Members)>,
    /// What each generation's coordinator broadcast at each of its barriers.
    broadcast: BTreeMap<(u64, u64), Release>,
    trace: super::Trace,
    steps: u64,
    faults: u64,
    checks: u64,
    kills: u64,
    regroups: u64,
    /// Items committed: by their own rank, and by a member for a dropped rank.
    committed: u64,
    moved: u64,
    /// Processes started again, those that came back, generations grown for them.
    restarted: u64,
    rejoined: u64,
    grown: u64,
}

#[derive(Default)]
pub struct Summary {
    runs: u64,
    steps: u64,
    faults: u64,
    checks: u64,
    kills: u64,
    /// Generations formed by survivors.
    regroups: u64,
    /// Runs that finished with fewer nodes than they started with, and runs that stopped
    /// below min-nodes.
    shrunk: u64,
    below_min: u64,
    /// Generations formed by a coordinator other than rank 0.
    moved: u64,
    node_ms: u64,
    items: u64,
    items_moved: u64,
    restarted: u64,
    rejoined: u64,
    grown: u64,
}

impl std::ops::AddAssign for Summary {
    fn add_assign(&mut self, o: Summary) {
        self.runs += o.runs;
        self.steps += o.steps;
        self.faults += o.faults;
        self.checks += o.checks;
        self.kills += o.kills;
        self.regroups += o.regroups;
        self.shrunk += o.shrunk;
        self.below_min += o.below_min;
        self.moved += o.moved;
        self.node_ms += o.node_ms;
        self.items += o.items;
        self.items_moved += o.items_moved;
        self.restarted += o.restarted;
        self.rejoined += o.rejoined;
        self.grown += o.grown;
    }
}

impl Summary {
    pub fn faults(&self) -> u64 {
        self.faults
    }

    pub fn line(&self) -> String {
        format!(
            "{} steps, {} faults ({} kills), {} invariant checks; {} generation(s) formed by survivors ({} by a coordinator other than rank 0), {} run(s) finished smaller, {} stopped below min-nodes; {} items committed ({} of them a dropped rank's, by a member); {} processes started again, {} came back, in {} generation(s) grown; {:.1} simulated node-hours",
            self.steps,
            self.faults,
            self.kills,
            self.checks,
            self.regroups,
            self.moved,
            self.shrunk,
            self.below_min,
            self.items,
            self.items_moved,
            self.restarted,
            self.rejoined,
            self.grown,
            self.node_ms as f64 / 3_600_000.0
        )
    }
}

/// Node `rank`'s machine in generation `gen`: flat, or (`group`) in groups of that many
/// workers through leaders once the generation has four members or more.
fn machine_of(
    rank: u32,
    gen: u64,
    members: &Members,
    group: Option<u32>,
    hb: u64,
    dead_after: u64,
) -> NodeMachine {
    let position = members.position(rank).expect("a member");
    let mut m = NodeMachine::new(machine::Settings {
        rank: position,
        num_nodes: members.len(),
        host: format!("sim-{rank}"),
        cluster: None,
        heartbeat_interval: Duration::from_millis(hb),
        dead_after: Duration::from_millis(dead_after),
        topology: match group.filter(|_| members.len() >= 4) {
            Some(g) => Topology::grouped(members.len(), g),
            None => Topology::flat(members.len()),
        },
        members: Some(members.clone()),
    });
    m.set_position(machine::Position {
        run_id: "sim".into(),
        gen,
        iteration: 1,
        phase: "sim".into(),
    });
    // The first generation is formed from the start (every record written). In a later
    // one, the coordinator's is formed once its first barrier (the join) is passed: until
    // then a member that has not appeared is waited for, not judged. A member watches
    // the coordinator from the start, as a worker's join does (the coordinator wrote its
    // record before it published the generation).
    m.watch.formed = gen == 1 || position != 0;
    m
}

fn record(rank: u32, gen: u64) -> RankRecord {
    RankRecord {
        host: format!("sim-{rank}"),
        nonce: format!("n{rank}"),
        state: NodeState::Running,
        iteration: 1,
        ..RankRecord::vacant("sim", gen, rank)
    }
}

impl Sim {
    fn new(seed: u64, n: usize, mutations: Mutations) -> Sim {
        let mut rng = Rng::new(seed);
        let lifetime_ms = [0, 100, 1_000, 3_000, 30_000, 60_000][rng.below(6) as usize];
        let heartbeat_ms = 200 + rng.below(4_800);
        let dead_after_ms = 2 * (lifetime_ms + 2 * heartbeat_ms) + 5_000;
        let min_nodes = match rng.below(5) {
            0 => n as u32,
            _ => 1 + rng.below(n as u64) as u32,
        };
        let wall_skew_ms = (0..n).map(|_| rng.below(1_001) as i64 - 500).collect();
        let items = 1 + rng.below(3) as u32;
        // Groups through leaders in one seed of two, from a stream of its own.
        let mut topology_rng = Rng::new(seed ^ 0x70b0_1091);
        let group = (topology_rng.below(2) == 0).then(|| 2 + topology_rng.below(3) as u32);
        let world = SimWorld::new();
        let layout = Layout::new("/sim-run");
        world.create_dir_all(&layout.gen_dir(1)).expect("set up");
        for step in 1..=BARRIERS {
            world
                .create_dir_all(&step_dir(&layout, step))
                .expect("set up");
        }
        let (clock, clients) = super::sim_clients(&world, n, lifetime_ms);
        let all = Members::all(n as u32);
        let nodes = (0..n as u32)
            .map(|r| Node {
                life: Life::Running,
                gen: 1,
                members: all.clone(),
                machine: machine_of(r, 1, &all, group, heartbeat_ms, dead_after_ms),
                regroup: None,
                rejoin: None,
                requests: Requests::new(Duration::from_millis(dead_after_ms)),
                incarnation: 0,
                killed_at: None,
                k: 1,
                arrived: false,
                next: 1,
                start: 1,
                record: record(r, 1),
                work: VecDeque::new(),
                work_for: 0,
                next_beat: 0,
                joined_at: 0,
                rate_ppm: 990_000 + rng.below(20_001),
                frozen_until: 0,
                freezes: vec![],
                last_turn: 0,
                seen: BTreeMap::new(),
            })
            .collect();
        let mut sim = Sim {
            n,
            min_nodes,
            mutations,
            rng,
            now: 0,
            world,
            clients,
            clock,
            layout,
            lifetime_ms,
            items,
            group,
            heartbeat_ms,
            dead_after_ms,
            wall_skew_ms,
            nodes,
            formed: BTreeMap::from([(1, (0, all.clone()))]),
            broadcast: BTreeMap::new(),
            trace: super::Trace::new(60),
            steps: 0,
            faults: 0,
            checks: 0,
            kills: 0,
            regroups: 0,
            committed: 0,
            moved: 0,
            restarted: 0,
            rejoined: 0,
            grown: 0,
        };
        let first = ClusterRecord::bare("sim", 1, n as u32);
        sim.client(0)
            .publish_json(&sim.layout.cluster(), &first)
            .expect("set up");
        for r in 0..n {
            sim.write_record(r);
        }
        sim
    }

    fn client(&self, r: usize) -> &dyn SharedDir {
        &self.clients[r]
    }

    fn at(&self) {
        self.clock.store(self.now, Ordering::Relaxed);
    }

    /// Node `r`'s monotonic clock: true time at its own rate (±1 %).
    fn local(&self, r: usize) -> Duration {
        Duration::from_micros(self.now * self.nodes[r].rate_ppm / 1_000)
    }

    fn note(&mut self, s: String) {
        self.trace.note(self.now, s);
    }

    fn violation(&self, seed: u64, what: String) -> Violation {
        self.trace.violation(seed, what)
    }

    fn active(&self, r: usize) -> bool {
        matches!(
            self.nodes[r].life,
            Life::Running | Life::Regrouping | Life::Rejoining
        )
    }

    /// Node `r`'s record of its generation, published (an atomic replacement).
    fn write_record(&mut self, r: usize) {
        self.at();
        let node = &mut self.nodes[r];
        node.record.seq += 1;
        let wall = WALL_ORIGIN_S as i64 * 1_000 + self.now as i64 + self.wall_skew_ms[r];
        node.record.wall = wall_stamp(SystemTime::UNIX_EPOCH + Duration::from_millis(wall as u64));
        let path = match node.life {
            Life::Rejoining => self.layout.rejoin_request(node.gen, r as u32),
            _ => self.layout.rank_record(node.gen, r as u32),
        };
        let rec = node.record.clone();
        let dir: &dyn SharedDir = &self.clients[r];
        dir.publish_live_json(&path, &rec)
            .expect("no faults injected here");
    }

    fn run(mut self, seed: u64) -> Result<Summary, Violation> {
        let max_step = 50 + self.lifetime_ms / 20;
        let per_gen = (BARRIERS + 2) * (2 * self.lifetime_ms + 4 * self.n as u64 * max_step) * 4
            + 8 * self.dead_after_ms
            + 4 * self.lifetime_ms;
        let mut frozen_total = 0;
        let long_freeze = self.rng.below(4) == 0;
        let mut long_done = false;
        // Kills: none in one seed of four, else up to every node, at random moments.
        let kills = match self.rng.below(4) {
            0 => 0,
            _ => 1 + self.rng.below(self.n as u64),
        };
        let horizon = per_gen / 2;
        let mut kill_at: Vec<(u64, usize)> = (0..kills)
            .map(|_| {
                (
                    self.rng.below(horizon),
                    self.rng.below(self.n as u64) as usize,
                )
            })
            .collect();
        kill_at.sort();
        let mut kill_at: VecDeque<_> = kill_at.into();
        let mut long_frozen: BTreeSet<usize> = BTreeSet::new();
        let mut restart_rng = Rng::new(seed ^ 0x02e5_7a27);
        let mut restarts: Vec<(u64, usize)> = Vec::new();
        while (0..self.n).any(|r| self.active(r)) {
            // A process that asks to come back after the run has ended (every other node
            // done or stopped) has nothing to join.
            if (0..self.n).all(|q| !matches!(self.nodes[q].life, Life::Running | Life::Regrouping))
            {
                for q in 0..self.n {
                    if self.nodes[q].life == Life::Rejoining {
                        self.nodes[q].life =
                            Life::Stopped("the run ended before it came back".into());
                    }
                }
                break;
            }
            restarts.sort();
            while restarts.first().is_some_and(|&(t, _)| t <= self.now) {
                let (_, r) = restarts.remove(0);
                if self.nodes[r].life == Life::Killed {
                    self.restart(r);
                }
            }
            let bound = per_gen * (2 + self.regroups + kills) + frozen_total;
            if self.now > bound {
                let lives: Vec<_> = self
                    .nodes
                    .iter()
                    .map(|n| (n.gen, n.k, n.life.clone()))
                    .collect();
                return Err(self.violation(
                    seed,
                    format!("the run did not end within {bound} ms of simulated time (nodes: {lives:?})"),
                ));
            }
            self.steps += 1;
            self.now += 1 + self.rng.below(max_step - 1);
            self.at();
            while kill_at.front().is_some_and(|&(t, _)| t <= self.now) {
                let (_, r) = kill_at.pop_front().expect("due");
                if self.active(r) {
                    self.nodes[r].life = Life::Killed;
                    self.nodes[r].killed_at = Some(self.now);
                    self.kills += 1;
                    self.faults += 1;
                    self.note(format!("rank {r} killed"));
                    // Requeued, in one kill of two: started again one to four dead-afters
                    // later, as a new process.
                    if restart_rng.below(2) == 0 {
                        let at = self.now + self.dead_after_ms * (1 + restart_rng.below(4));
                        restarts.push((at, r));
                    }
                    // A staggered outage: in one of two runs without a long freeze yet,
                    // the coordinator's death stops its successor too, for three to five
                    // dead-afters, so that the others count it lost and it wakes to a
                    // generation formed without it (and claims that generation too).
                    let members = self.nodes[r].members.clone();
                    let next = members
                        .ranks()
                        .iter()
                        .map(|&q| q as usize)
                        .find(|&q| q != r && self.active(q));
                    if let Some(q) = next.filter(|_| {
                        members.coordinator() == r as u32 && !long_done && self.rng.below(2) == 0
                    }) {
                        long_done = true;
                        long_frozen.insert(q);
                        let d = 3 * self.dead_after_ms + self.rng.below(2 * self.dead_after_ms);
                        frozen_total += d;
                        let until = self.now + d;
                        self.nodes[q].frozen_until = until;
                        self.nodes[q].freezes.push((self.now, until));
                        self.faults += 1;
                        self.note(format!("rank {q}, next to coordinate, frozen for {d} ms"));
                    }
                }
            }
            self.heartbeats();
            let turn = self.n as u64 * max_step;
            let now = self.now;
            let starving = (0..self.n).find(|&q| {
                self.active(q)
                    && self.nodes[q].frozen_until <= now
                    && now - self.nodes[q].last_turn >= turn
            });
            let r = starving.unwrap_or_else(|| self.rng.below(self.n as u64) as usize);
            if !self.active(r) || self.nodes[r].frozen_until > self.now {
                continue;
            }
            self.nodes[r].last_turn = self.now;
            let roll = self.rng.below(10_000);
            if roll < 30 || (long_freeze && !long_done && roll < 60) {
                let long = roll >= 30;
                let d = if long {
                    long_done = true;
                    long_frozen.insert(r);
                    3 * self.dead_after_ms + self.rng.below(2 * self.dead_after_ms)
                } else {
                    1 + self.rng.below(self.dead_after_ms / 4)
                };
                frozen_total += d;
                let until = self.now + d;
                self.nodes[r].frozen_until = until;
                self.nodes[r].freezes.push((self.now, until));
                self.faults += 1;
                self.note(format!("rank {r} frozen for {d} ms"));
                continue;
            }
            self.act(r, seed)?;
        }
        self.check_end(seed, &long_frozen)?;
        let moved = self.formed.values().filter(|(c, _)| *c != 0).count() as u64;
        let finished: Vec<usize> = (0..self.n)
            .filter(|&r| self.nodes[r].life == Life::Done)
            .collect();
        let below = self
            .nodes
            .iter()
            .any(|n| matches!(&n.life, Life::Stopped(why) if why.contains("min-nodes")));
        Ok(Summary {
            runs: 1,
            steps: self.steps,
            faults: self.faults,
            checks: self.checks,
            kills: self.kills,
            regroups: self.regroups,
            shrunk: u64::from(!finished.is_empty() && finished.len() < self.n),
            below_min: u64::from(below),
            moved,
            node_ms: self.now * self.n as u64,
            items: self.committed,
            items_moved: self.moved,
            restarted: self.restarted,
            rejoined: self.rejoined,
            grown: self.grown,
        })
    }

    /// Progress, and how each node ended.
    fn check_end(&mut self, seed: u64, long_frozen: &BTreeSet<usize>) -> Result<(), Violation> {
        let steady: Vec<usize> = (0..self.n)
            .filter(|&r| self.nodes[r].killed_at.is_none() && !long_frozen.contains(&r))
            .collect();
        self.checks += 1;
        if steady.len() as u32 >= self.min_nodes {
            if let Some(&r) = steady.iter().find(|&&r| self.nodes[r].life != Life::Done) {
                return Err(self.violation(
                    seed,
                    format!(
                        "ranks {steady:?} were never killed nor stopped long ({} node(s), min-nodes {}), but rank {r} ended as {:?}",
                        steady.len(),
                        self.min_nodes,
                        self.nodes[r].life
                    ),
                ));
            }
        }
        self.checks += 1;
        if self.min_nodes == self.n as u32 && self.formed.len() > 1 {
            return Err(self.violation(
                seed,
                format!(
                    "min-nodes = num-nodes = {}, yet generations were formed after a loss: {:?}",
                    self.n, self.formed
                ),
            ));
        }
        Ok(())
    }

    fn heartbeats(&mut self) {
        for r in 0..self.n {
            let node = &self.nodes[r];
            if !self.active(r) || node.frozen_until > self.now || node.gen == 0 {
                continue;
            }
            let local = self.local(r).as_millis() as u64;
            if local >= self.nodes[r].next_beat {
                self.nodes[r].next_beat = local + self.heartbeat_ms;
                self.write_record(r);
            }
        }
    }

    /// Rank `r` started again: a new process that asks to come back.
    fn restart(&mut self, r: usize) {
        self.restarted += 1;
        let node = &mut self.nodes[r];
        node.incarnation += 1;
        node.life = Life::Rejoining;
        node.rejoin = Some(Rejoin::new(r as u32));
        node.regroup = None;
        node.frozen_until = 0;
        // No record of its own until it asks in a generation.
        node.gen = 0;
        let incarnation = node.incarnation;
        self.note(format!("rank {r} started again (process {incarnation})"));
    }

    /// Rank `r`'s turn while it asks to come back.
    fn rejoin_turn(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        let _ = seed;
        self.nodes[r]
            .rejoin
            .as_mut()
            .expect("rejoining")
            .handle(RejoinInput::Poll);
        while let Some(effect) = self.nodes[r].rejoin.as_mut().and_then(|j| j.poll_effect()) {
            self.at();
            match effect {
                RejoinEffect::ReadCurrent => {
                    let current = self.read_current(r);
                    let j = self.nodes[r].rejoin.as_mut().expect("rejoining");
                    j.handle(RejoinInput::Current(current));
                }
                RejoinEffect::Ask { gen } => {
                    self.note(format!("rank {r} asks to come back in generation {gen}"));
                    let node = &mut self.nodes[r];
                    node.gen = gen;
                    node.record = RankRecord {
                        nonce: format!("n{r}.{}", node.incarnation),
                        ..record(r as u32, gen)
                    };
                    self.write_record(r);
                }
                RejoinEffect::Joined {
                    gen,
                    position,
                    members,
                } => {
                    self.note(format!(
                        "rank {r} comes back in generation {gen} at position {position} of {members:?}"
                    ));
                    self.rejoined += 1;
                    let node = &mut self.nodes[r];
                    node.rejoin = None;
                    // It has no say in where the generation resumes: the others' journals
                    // have.
                    node.next = u64::MAX;
                    node.gen = 0;
                    self.join(r, gen, members);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The coordinator, at the boundary of logical barrier `logical`: ranks asking to come
    /// back (their requests in this generation, live) make a generation of everyone, which
    /// it forms now (claim and record, each by an exclusive create; nothing when either is
    /// taken); the release tells the members.
    fn grow_at(
        &mut self,
        r: usize,
        seed: u64,
        logical: u64,
    ) -> Result<Option<(u64, Vec<u32>)>, Violation> {
        let (gen, members) = (self.nodes[r].gen, self.nodes[r].members.clone());
        let local = self.local(r);
        for d in members.dropped(self.n as u32) {
            self.at();
            let rec: Option<RankRecord> = self
                .client(r)
                .read_json(&self.layout.rejoin_request(gen, d))
                .ok()
                .flatten();
            let seq = rec.filter(|rec| rec.gen == gen).map(|rec| rec.seq);
            self.nodes[r].requests.observe(d, seq, local);
        }
        if logical >= BARRIERS {
            return Ok(None);
        }
        let live = self.nodes[r].requests.live(local);
        let Some(grown) = ms::grow(&members, &live, self.n as u32) else {
            return Ok(None);
        };
        let next = gen + 1;
        if self
            .client(r)
            .create_dir(&self.layout.gen_dir(next))
            .is_err()
        {
            return Ok(None);
        }
        let cluster = ClusterRecord {
            members: Some(grown.clone()),
            ..ClusterRecord::bare("sim", next, self.n as u32)
        };
        let won = self
            .client(r)
            .create_new_json(&self.layout.gen_cluster(next), &cluster)
            .expect("no faults injected here");
        if !won {
            return Ok(None);
        }
        // Growing adds only ranks whose new process runs (or ran within what dead-after,
        // caches and heartbeat spacing hide: its request is judged by its heartbeat),
        // and drops no member.
        self.checks += 1;
        let hidden = self.dead_after_ms * 1_010 / 1_000 + self.lifetime_ms + 2 * self.heartbeat_ms;
        let now = self.now;
        if let Some(q) = grown.ranks().iter().find(|&&q| {
            let node = &self.nodes[q as usize];
            let recent = node.killed_at.is_some_and(|t| now - t <= hidden);
            !members.contains(q) && node.life != Life::Rejoining && !recent
        }) {
            return Err(self.violation(
                seed,
                format!(
                    "rank {r} grew generation {gen} into {next} with rank {q}, whose process is {:?}",
                    self.nodes[*q as usize].life
                ),
            ));
        }
        self.checks += 1;
        if let Some((other, _)) = self.formed.get(&next) {
            return Err(self.violation(
                seed,
                format!("two coordinators of generation {next}: rank {other} and rank {r}"),
            ));
        }
        self.grown += 1;
        self.formed.insert(next, (r as u32, grown.clone()));
        self.client(r)
            .publish_json(&self.layout.cluster(), &cluster)
            .expect("no faults injected here");
        self.note(format!(
            "rank {r} grows generation {gen} into {next}: {grown:?}"
        ));
        Ok(Some((next, grown.ranks().to_vec())))
    }

    fn act(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        match self.nodes[r].life {
            Life::Rejoining => self.rejoin_turn(r, seed),
            Life::Running => {
                let local = self.local(r);
                self.nodes[r].machine.tick(local);
                self.perform(r, seed)?;
                if self.nodes[r].life == Life::Running {
                    self.proceed(r, seed)?;
                }
                Ok(())
            }
            Life::Regrouping => self.regroup_turn(r, seed),
            _ => Ok(()),
        }
    }

    /// A generation's first barrier doubles as its join: a member that has not appeared
    /// (killed before it joined) is waited for up to a join deadline, as the node's
    /// join-timeout does, and then counted lost: by the coordinator, the first member it
    /// still waits for; by a member, a coordinator whose record it never found (one it
    /// found is judged by its heartbeat).
    fn join_deadline(&mut self, r: usize, missing: &[u32]) {
        let node = &self.nodes[r];
        let deadline = 2 * self.dead_after_ms + 2 * self.lifetime_ms;
        if node.k != 1 || node.gen == 1 || self.now < node.joined_at + deadline {
            return;
        }
        let coordinating = node.members.coordinator() == r as u32;
        let position = node.members.position(r as u32).expect("a member");
        let watched = node.machine.watching().watched(position);
        let seen = watched
            .iter()
            .all(|&p| node.machine.watch.peers[p as usize].is_some());
        if !coordinating && seen {
            return;
        }
        // The coordinator reads every member during the join: it names one it never
        // found, else one that never arrived, else a group's leader that never published
        // its group's arrival (what a leader that died says it waits for is stale).
        let peers = &node.machine.watch.peers;
        let topology = node.machine.settings().topology;
        let k = node.k;
        let never = (1..node.members.len())
            .find(|&p| peers[p as usize].is_none())
            .or_else(|| {
                (1..node.members.len()).find(|&p| {
                    peers[p as usize]
                        .as_ref()
                        .is_some_and(|rec| !rec.arrived_at(k))
                })
            })
            .or_else(|| {
                topology.leaders().find(|&p| {
                    peers[p as usize]
                        .as_ref()
                        .is_some_and(|rec| rec.grouped_at(k).is_none())
                })
            })
            .map(|p| node.members.rank_at(p));
        let Some(culprit) = never
            .filter(|_| coordinating)
            .or_else(|| missing.first().copied())
        else {
            return;
        };
        let gen = node.gen;
        let info = self.nodes[r].machine.abort_info(
            AbortKind::Timeout,
            culprit,
            Some(format!("sim-{culprit}")),
            format!("rank {culprit} did not join generation {gen} in time"),
            None,
        );
        self.note(format!(
            "rank {r} gives up on rank {culprit} joining generation {gen}"
        ));
        self.nodes[r].machine.fail(info, true);
    }

    fn proceed(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        let node = &self.nodes[r];
        let k = node.k;
        if !node.arrived {
            let at = match k {
                1 => node.next,
                _ => node.start + k - 2,
            };
            if k >= 2 && !self.work(r, at) {
                return Ok(());
            }
            let gather = Arrival { rank: r as u32, at };
            let got = self.nodes[r].machine.arrive("sim", &gather);
            assert_eq!(got, k, "the node's barrier count");
            self.nodes[r].arrived = true;
            self.note(format!(
                "rank {r} arrives at barrier {k} of generation {} ({at})",
                self.nodes[r].gen
            ));
            return self.perform(r, seed);
        }
        match self.nodes[r].machine.progress::<Arrival, Release>() {
            Progress::Waiting { missing } => {
                self.join_deadline(r, &missing);
                self.perform(r, seed)
            }
            Progress::Complete { payloads } => {
                let gen = self.nodes[r].gen;
                let ranks: Vec<u32> = payloads.iter().map(|a| a.rank).collect();
                let logical = match k {
                    1 => payloads.iter().map(|a| a.at).min().expect("one at least"),
                    _ => {
                        let first = payloads[0].at;
                        if payloads.iter().any(|a| a.at != first) {
                            return Err(self.violation(
                                seed,
                                format!("the members of generation {gen} arrived at barrier {k} for different logical barriers: {payloads:?}"),
                            ));
                        }
                        first
                    }
                };
                let next = match k {
                    1 => None,
                    _ => self.grow_at(r, seed, logical)?,
                };
                let release = Release {
                    gen,
                    k,
                    logical,
                    ranks,
                    next,
                };
                if k >= 2 {
                    self.check_merge(seed, r, gen, logical)?;
                }
                self.checks += 1;
                if self.broadcast.contains_key(&(gen, k)) {
                    return Err(self.violation(
                        seed,
                        format!(
                            "barrier {k} of generation {gen} was released twice (two coordinators)"
                        ),
                    ));
                }
                self.broadcast.insert((gen, k), release.clone());
                self.nodes[r].machine.release(&release);
                self.note(format!(
                    "rank {r} releases barrier {k} of generation {gen}: {release:?}"
                ));
                self.perform(r, seed)?;
                self.pass(r, release, seed)
            }
            Progress::Released { broadcast } => self.pass(r, broadcast, seed),
        }
    }

    /// Node `r`'s work before logical barrier `step`, a little at each turn: its own items,
    /// and the dropped ranks' items the re-plan deals it (`membership::replan`), each
    /// committed by an exclusive create unless it finds it committed. `true` once done.
    fn work(&mut self, r: usize, step: u64) -> bool {
        if self.nodes[r].work_for != step {
            let node = &self.nodes[r];
            let shares: BTreeMap<u32, Vec<u32>> = node
                .members
                .dropped(self.n as u32)
                .into_iter()
                .map(|d| (d, (0..self.items).collect()))
                .collect();
            let plan = ms::replan_with(&node.members, &shares, self.mutations.regroup);
            let own = (0..self.items).map(|i| (r as u32, i));
            let work = own.chain(plan.moved_to(r as u32).iter().copied()).collect();
            if !shares.is_empty() {
                let seen = |d: u32, i: &u32| {
                    self.world
                        .content(&item_path(&self.layout, step, d, *i))
                        .is_some()
                };
                for line in plan.summary(seen) {
                    self.note(format!("rank {r}, step {step}: {line}"));
                }
            }
            let node = &mut self.nodes[r];
            node.work = work;
            node.work_for = step;
        }
        for _ in 0..2 {
            let Some((owner, i)) = self.nodes[r].work.pop_front() else {
                break;
            };
            self.at();
            let path = item_path(&self.layout, step, owner, i);
            let dir = self.client(r);
            if dir.read(&path).expect("no faults injected here").is_some() {
                continue;
            }
            let created = dir
                .create_new_json(&path, &(r, owner, i))
                .expect("no faults injected here");
            if created {
                self.committed += 1;
                self.moved += u64::from(owner != r as u32);
            }
        }
        self.nodes[r].work.is_empty()
    }

    /// The coordinator merges step `step` as it releases its barrier: every rank's items
    /// of it, the dropped ranks' included, are committed (each exactly once: an exclusive
    /// create).
    fn check_merge(&mut self, seed: u64, r: usize, gen: u64, step: u64) -> Result<(), Violation> {
        self.checks += 1;
        let missing: Vec<(u32, u32)> = (0..self.n as u32)
            .flat_map(|q| (0..self.items).map(move |i| (q, i)))
            .filter(|&(q, i)| {
                self.world
                    .content(&item_path(&self.layout, step, q, i))
                    .is_none()
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(self.violation(
            seed,
            format!(
                "rank {r} merges step {step} in generation {gen} (members {:?}), but items (rank, item) {missing:?} were never committed",
                self.nodes[r].members
            ),
        ))
    }

    fn pass(&mut self, r: usize, release: Release, seed: u64) -> Result<(), Violation> {
        let (gen, k) = (self.nodes[r].gen, self.nodes[r].k);
        self.nodes[r].machine.leave_barrier();
        let (coordinator, members) = self.formed[&gen].clone();
        // Every member's record, on the server, says it arrived.
        self.checks += 1;
        let missing: Vec<u32> = members
            .ranks()
            .iter()
            .copied()
            .filter(|&q| {
                let rec: Option<RankRecord> = self
                    .world
                    .content(&self.layout.rank_record(gen, q))
                    .and_then(|b| serde_json::from_slice(&b).ok());
                !rec.is_some_and(|rec| rec.arrived_at(k))
            })
            .collect();
        if !missing.is_empty() {
            return Err(self.violation(
                seed,
                format!("rank {r} passed barrier {k} of generation {gen} before ranks {missing:?} arrived at it"),
            ));
        }
        self.checks += 1;
        if release.ranks != members.ranks() || release.gen != gen || release.k != k {
            return Err(self.violation(
                seed,
                format!("rank {r} passed barrier {k} of generation {gen} (members {members:?}) with {release:?}"),
            ));
        }
        self.checks += 1;
        if self.broadcast.get(&(gen, k)) != Some(&release) {
            return Err(self.violation(
                seed,
                format!("rank {r} passed barrier {k} of generation {gen} with {release:?}, but its coordinator (rank {coordinator}) broadcast {:?}", self.broadcast.get(&(gen, k))),
            ));
        }
        self.note(format!("rank {r} passes barrier {k} of generation {gen}"));
        let node = &mut self.nodes[r];
        if k == 1 {
            node.machine.watch.formed = true;
            node.start = release.logical;
            node.next = release.logical;
        } else {
            node.next = release.logical + 1;
        }
        node.k += 1;
        node.arrived = false;
        if node.next > BARRIERS {
            node.life = Life::Done;
            node.record.state = NodeState::Done;
            self.write_record(r);
            return Ok(());
        }
        if let Some((next, ranks)) = release.next {
            let members = Members::try_from(ranks).expect("a generation's members");
            // Its record here stays as it is (its release says where the members went):
            // a member that has not passed yet passes on it, where a record that left
            // would read as a member that failed (the simulator found a frozen member
            // stopping the cluster on it).
            self.note(format!("rank {r} goes on in generation {next}"));
            self.join(r, next, members);
        }
        Ok(())
    }

    fn perform(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        while let Some(effect) = self.nodes[r].machine.poll_effect() {
            self.at();
            let gen = self.nodes[r].gen;
            match effect {
                Effect::Read(ranks) => {
                    let mut reads = vec![];
                    for q in ranks {
                        let rec: Option<RankRecord> = self
                            .client(r)
                            .read_json(&self.layout.rank_record(gen, q))
                            .ok()
                            .flatten();
                        let seq = rec.as_ref().map_or(u64::MAX, |rec| rec.seq);
                        let now = self.now;
                        let seen = self.nodes[r].seen.entry(q).or_insert((seq, now));
                        if seen.0 != seq {
                            *seen = (seq, now);
                        }
                        reads.push((q, rec, self.local(r).into()));
                    }
                    let local = self.local(r);
                    self.nodes[r].machine.handle(local, Input::Records(reads));
                }
                Effect::Record(change) => {
                    let rec = &mut self.nodes[r].record;
                    let publish = match change {
                        Change::Arrived(m) => {
                            rec.arrived = Some(m);
                            true
                        }
                        Change::Released(m) => {
                            rec.released = Some(m);
                            rec.waiting_for.clear();
                            true
                        }
                        Change::GroupArrived(m) => {
                            rec.group = Some(m);
                            true
                        }
                        Change::WaitingFor(w) => {
                            rec.waiting_for = w;
                            false
                        }
                        Change::Observed(o) => {
                            rec.observed_ms = o;
                            false
                        }
                    };
                    if publish {
                        self.write_record(r);
                    }
                }
                Effect::CreateAbort(info) => {
                    if info.kind == AbortKind::PeerDead {
                        self.check_silence(r, info.culprit, seed)?;
                    }
                    let path = self.layout.abort(gen);
                    let created = self
                        .client(r)
                        .create_new_json(&path, &info)
                        .expect("no faults injected here");
                    let first: Option<AbortInfo> = self
                        .client(r)
                        .read_json(&path)
                        .expect("no faults injected here");
                    if created && info.kind == AbortKind::PeerDead {
                        self.check_death(r, info.culprit as usize, seed)?;
                    }
                    self.note(format!(
                        "rank {r} finds rank {} lost in generation {gen}{}",
                        info.culprit,
                        if created {
                            ""
                        } else {
                            " (an abort exists: adopted)"
                        }
                    ));
                    let local = self.local(r);
                    self.nodes[r]
                        .machine
                        .handle(local, Input::AbortCreated { created, first });
                }
                Effect::Warn(w) => self.note(format!("rank {r} warns: {w}")),
                Effect::Stop(info) => return self.generation_ended(r, info, seed),
            }
        }
        Ok(())
    }

    /// Node `r`'s generation ended on `info`: it says so in its record; declared dead
    /// itself, it stops; else it regroups with the survivors.
    fn generation_ended(&mut self, r: usize, info: AbortInfo, seed: u64) -> Result<(), Violation> {
        let node = &mut self.nodes[r];
        node.record.state = NodeState::Failed;
        node.record.abort.get_or_insert(info.clone());
        self.write_record(r);
        if info.culprit == r as u32 {
            self.note(format!(
                "rank {r} stops: it was counted lost ({})",
                info.reason
            ));
            self.nodes[r].life = Life::Stopped(format!("counted lost: {}", info.reason));
            return Ok(());
        }
        // A barrier it arrived at that its coordinator released is passed all the same
        // (every member arrived there): the last one's release means the run is
        // complete, as the node's journal says at its next start. (A leader that found a
        // member dead after the last release otherwise regrouped alone.)
        if self.nodes[r].arrived {
            let (gen, k) = (self.nodes[r].gen, self.nodes[r].k);
            let coordinator = self.nodes[r].members.coordinator();
            let released: Option<RankRecord> = self
                .client(r)
                .read_json(&self.layout.rank_record(gen, coordinator))
                .ok()
                .flatten();
            if let Some(mark) = released.and_then(|rec| rec.released).filter(|m| m.k == k) {
                let release: Release = serde_json::from_value(mark.payload).expect("a release");
                self.note(format!(
                    "rank {r} passes barrier {k} of generation {gen}, released before the loss"
                ));
                self.pass(r, release, seed)?;
                // Done, or gone on into a generation grown at that barrier (where the
                // loss is found again, by its members).
                if self.nodes[r].life == Life::Done || self.nodes[r].gen != gen {
                    return Ok(());
                }
            }
        }
        let node = &self.nodes[r];
        let patience = Duration::from_millis(2 * self.dead_after_ms + 2 * self.lifetime_ms);
        let regroup = Regroup::new(
            r as u32,
            node.gen,
            node.members.clone(),
            BTreeSet::from([info.culprit]),
            self.min_nodes,
            patience,
            self.local(r),
        )
        .with_mutation(self.mutations.regroup);
        self.note(format!(
            "rank {r} regroups after generation {}: rank {} lost",
            node.gen, info.culprit
        ));
        self.nodes[r].regroup = Some(regroup);
        self.nodes[r].life = Life::Regrouping;
        Ok(())
    }

    /// Node `r`'s turn while it regroups: what the machine asked for, then a look (the
    /// node's poll) while it waits.
    fn regroup_turn(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        if self.perform_regroup(r, seed)? {
            return Ok(());
        }
        let local = self.local(r);
        if let Some(g) = self.nodes[r].regroup.as_mut() {
            if g.poll_timeout().is_some() {
                g.handle(local, ms::Input::Timeout);
            }
        }
        self.perform_regroup(r, seed).map(|_| ())
    }

    /// Perform the regroup's effects; `true` when the turn is over (a claim won: the
    /// generation is written at the node's next turn, so a kill may come in between).
    fn perform_regroup(&mut self, r: usize, seed: u64) -> Result<bool, Violation> {
        loop {
            let Some(effect) = self.nodes[r].regroup.as_mut().and_then(|g| g.poll_effect()) else {
                return Ok(false);
            };
            self.at();
            let local = self.local(r);
            match effect {
                ms::Effect::Info(line) => self.note(format!("rank {r}: {line}")),
                ms::Effect::Claim { gen } => {
                    let won = match self.client(r).create_dir(&self.layout.gen_dir(gen)) {
                        Ok(()) => true,
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
                        Err(e) => panic!("claim: {e}"),
                    };
                    let published = self.lost_to(r, won, gen);
                    self.note(format!(
                        "rank {r} claims generation {gen}: {}",
                        if won { "won" } else { "taken" }
                    ));
                    let g = self.nodes[r].regroup.as_mut().expect("regrouping");
                    g.handle(local, ms::Input::Claimed { won, published });
                    if won {
                        return Ok(true);
                    }
                }
                ms::Effect::ReadCurrent => {
                    let current = self.read_current(r);
                    let g = self.nodes[r].regroup.as_mut().expect("regrouping");
                    g.handle(local, ms::Input::Current(current));
                }
                ms::Effect::Publish(next) => {
                    let won = self.publish(r, &next, seed)?;
                    let found = self.lost_to(r, won, next.gen);
                    let g = self.nodes[r].regroup.as_mut().expect("regrouping");
                    g.handle(local, ms::Input::Published { won, found });
                }
                ms::Effect::Spend { gen } => {
                    let mark = ms::SpentNumber {
                        spent_by: r as u32,
                        reason: "claimed, never published".into(),
                    };
                    let won = self
                        .client(r)
                        .create_new_json(&self.layout.gen_cluster(gen), &mark)
                        .expect("no faults injected here");
                    let found = self.lost_to(r, won, gen);
                    self.note(format!(
                        "rank {r} spends generation number {gen}: {}",
                        if won { "done" } else { "its record is there" }
                    ));
                    let g = self.nodes[r].regroup.as_mut().expect("regrouping");
                    g.handle(local, ms::Input::Spent { won, found });
                }
                ms::Effect::Joined {
                    gen,
                    position,
                    members,
                } => {
                    self.note(format!(
                        "rank {r} joins generation {gen} at position {position} of {members:?}"
                    ));
                    // At most one coordinator acts per generation: the one whose record
                    // the exclusive create kept.
                    self.checks += 1;
                    let published = self.formed.get(&gen).map(|(c, _)| *c);
                    if position == 0 && published != Some(r as u32) {
                        return Err(self.violation(
                            seed,
                            format!("two coordinators of generation {gen}: rank {r} acts as its coordinator, but its record was published by {published:?}"),
                        ));
                    }
                    self.join(r, gen, members);
                    return Ok(true);
                }
                ms::Effect::Stop(ending) => {
                    self.note(format!("rank {r} stops: {ending}"));
                    if let Ending::BelowMin { left, .. } = &ending {
                        self.checks += 1;
                        if left.len() as u32 >= self.min_nodes {
                            return Err(self.violation(
                                seed,
                                format!("rank {r} stopped below min-nodes with {left:?} left"),
                            ));
                        }
                    }
                    self.nodes[r].regroup = None;
                    self.nodes[r].life = Life::Stopped(ending.to_string());
                    return Ok(true);
                }
            }
        }
    }

    /// The run's newest generation, as node `r` reads `cluster.json`.
    fn read_current(&self, r: usize) -> Option<Regrouped> {
        self.client(r)
            .read_json::<ClusterRecord>(&self.layout.cluster())
            .ok()
            .flatten()
            .map(|c| Regrouped::from(&c))
    }

    /// After an exclusive create for generation `gen` that node `r` lost (`!won`): the
    /// generation its record publishes, as `r` reads it (`None`: none, or a spent
    /// number's mark).
    fn lost_to(&self, r: usize, won: bool, gen: u64) -> Option<Regrouped> {
        if won {
            return None;
        }
        self.client(r)
            .read_json::<ClusterRecord>(&self.layout.gen_cluster(gen))
            .ok()
            .flatten()
            .map(|c| Regrouped::from(&c))
    }

    /// Node `r` won the claim of `next.gen`: create the generation's record exclusively
    /// (`false`: it was there already) and, created, check that the ranks lost stay out
    /// and write the rest as the node's join does (its own record, `cluster.json`).
    fn publish(&mut self, r: usize, next: &Regrouped, seed: u64) -> Result<bool, Violation> {
        let cluster = ClusterRecord {
            members: Some(next.members.clone()),
            ..ClusterRecord::bare("sim", next.gen, self.n as u32)
        };
        let won = self
            .client(r)
            .create_new_json(&self.layout.gen_cluster(next.gen), &cluster)
            .expect("no faults injected here");
        if !won {
            self.note(format!(
                "rank {r} finds generation {}'s record there already",
                next.gen
            ));
            return Ok(false);
        }
        self.checks += 1;
        if let Some((other, _)) = self.formed.get(&next.gen) {
            return Err(self.violation(
                seed,
                format!(
                    "two coordinators of generation {}: rank {other} and rank {r}",
                    next.gen
                ),
            ));
        }
        // The rank the generation regrouped from named lost in its abort is out.
        self.checks += 1;
        let from = self.nodes[r].gen;
        let lost = self
            .world
            .content(&self.layout.abort(from))
            .and_then(|b| serde_json::from_slice::<AbortInfo>(&b).ok())
            .map(|a| a.culprit);
        if let Some(q) = lost.filter(|q| next.members.contains(*q)) {
            return Err(self.violation(
                seed,
                format!(
                    "generation {} lists rank {q}, which generation {from}'s abort named lost (members {:?})",
                    next.gen, next.members
                ),
            ));
        }
        self.regroups += 1;
        self.formed
            .insert(next.gen, (r as u32, next.members.clone()));
        self.nodes[r].gen = next.gen;
        self.nodes[r].record = record(r as u32, next.gen);
        self.write_record(r);
        self.client(r)
            .publish_json(&self.layout.cluster(), &cluster)
            .expect("no faults injected here");
        self.note(format!(
            "rank {r} forms generation {} of {:?}",
            next.gen, next.members
        ));
        Ok(true)
    }

    /// Node `r` joins generation `gen`: a new machine at its position, its record there.
    fn join(&mut self, r: usize, gen: u64, members: Members) {
        let machine = machine_of(
            r as u32,
            gen,
            &members,
            self.group,
            self.heartbeat_ms,
            self.dead_after_ms,
        );
        let node = &mut self.nodes[r];
        let fresh_record = node.gen != gen;
        node.machine = machine;
        node.gen = gen;
        node.members = members;
        node.regroup = None;
        node.life = Life::Running;
        node.k = 1;
        node.arrived = false;
        node.joined_at = self.now;
        node.seen.clear();
        // The work of a step is dealt again over the new members.
        node.work.clear();
        node.work_for = 0;
        node.requests = Requests::new(Duration::from_millis(self.dead_after_ms));
        if fresh_record {
            node.record = record(r as u32, gen);
            self.write_record(r);
        }
    }

    /// A death declared: the observer's reads of the rank's record returned the same
    /// heartbeat for at least dead-after of true time (less what its clock can gain).
    fn check_silence(&mut self, r: usize, q: u32, seed: u64) -> Result<(), Violation> {
        self.checks += 1;
        let least = self.dead_after_ms * 1_000 / 1_010;
        match self.nodes[r].seen.get(&q) {
            Some(&(_, since)) if self.now - since >= least => Ok(()),
            seen => Err(self.violation(
                seed,
                format!(
                    "rank {r} declared rank {q} dead, but its reads had returned the same heartbeat only since {seen:?} (now {} ms, dead-after {} ms)",
                    self.now, self.dead_after_ms
                ),
            )),
        }
    }

    /// Only a rank that was killed, or stopped for about dead-after, may be declared dead.
    fn check_death(&mut self, r: usize, q: usize, seed: u64) -> Result<(), Violation> {
        self.checks += 1;
        let hidden = self.lifetime_ms + 2 * self.heartbeat_ms + 100;
        let needed = (self.dead_after_ms * 1_000 / 1_010).saturating_sub(hidden);
        let now = self.now;
        let stopped = self.nodes[q]
            .freezes
            .iter()
            .any(|&(s, e)| e + hidden >= now && e - s >= needed);
        if stopped || !self.active(q) || self.nodes[q].killed_at.is_some() {
            return Ok(());
        }
        Err(self.violation(
            seed,
            format!(
                "rank {r} declared rank {q} dead, but rank {q} runs ({:?}) and was never stopped for {needed} ms; its freezes: {:?}",
                self.nodes[q].life, self.nodes[q].freezes
            ),
        ))
    }
}

/// Run `seeds` seeds from `first` with 1..=max_nodes nodes; the first violation.
pub fn sweep(
    first: u64,
    seeds: u64,
    max_nodes: u64,
    mutations: Mutations,
) -> Result<Summary, Violation> {
    super::sweep(first, seeds, max_nodes, |seed, n| {
        Sim::new(seed, n, mutations).run(seed)
    })
}

#[test]
fn five_hundred_seeds_of_1_to_16_nodes_lose_nodes_and_go_on() {
    let s = sweep(1, 500, 16, Mutations::default()).unwrap_or_else(|v| panic!("{v}"));
    println!("elastic: {}", s.line());
    assert!(
        s.regroups > 100,
        "generations formed by survivors: {}",
        s.line()
    );
    assert!(s.moved > 10, "coordinators that moved: {}", s.line());
    assert!(s.shrunk > 25 && s.below_min > 10, "{}", s.line());
    assert!(s.rejoined > 10 && s.grown > 10, "came back: {}", s.line());
}

#[test]
fn the_same_seed_replays_the_same_run() {
    super::assert_replays(7, |seed| {
        Sim::new(seed, 5, Mutations::default())
            .run(seed)
            .map(|s| s.line())
    });
}

#[test]
fn a_survivor_acting_on_a_lost_claim_is_caught() {
    let v = super::caught(|first, seeds, nodes| {
        sweep(
            first,
            seeds,
            nodes,
            Mutations {
                regroup: Some(Mutation::IgnoreLostClaim),
            },
        )
    });
    assert!(v.what.contains("two coordinators"), "{v}");
}

#[test]
fn a_coordinator_keeping_the_lost_is_caught() {
    let v = super::caught(|first, seeds, nodes| {
        sweep(
            first,
            seeds,
            nodes,
            Mutations {
                regroup: Some(Mutation::KeepLost),
            },
        )
    });
    assert!(v.what.contains("named lost"), "{v}");
}

fn step_dir(layout: &Layout, step: u64) -> std::path::PathBuf {
    layout.root().join("items").join(format!("step-{step}"))
}

fn item_path(layout: &Layout, step: u64, rank: u32, item: u32) -> std::path::PathBuf {
    step_dir(layout, step).join(format!("rank-{rank}-{item}.json"))
}

#[test]
fn a_dropped_ranks_items_left_unplanned_are_caught() {
    let v = super::caught(|first, seeds, nodes| {
        sweep(
            first,
            seeds,
            nodes,
            Mutations {
                regroup: Some(Mutation::NoReplan),
            },
        )
    });
    assert!(v.what.contains("were never committed"), "{v}");
}
