//! A seeded, single-threaded simulation of rl-node's barrier and liveness over a
//! simulated shared directory, checking invariants as it goes.
//!
//! The nodes run the same pure parts of the protocol core the real node drives: the
//! barrier machine (`rl_node::protocol::barrier::Barrier`: arrivals in each rank's record,
//! rank 0's release with the broadcast) and liveness by observation
//! (`rl_node::protocol::Liveness`, fed each node's own monotonic clock, which runs up to
//! 1 % fast or slow). Each node's heartbeat republishes its record every heartbeat
//! interval of its own clock. What a node concludes from the records it reads is the
//! node's own judgement, `protocol::watch` (which `Node::poll_cluster` calls): rank 0
//! watches every rank's record, a worker only rank 0's; an abort in a watched record is
//! adopted, a heartbeat still for dead-after is a dead peer. A node that finds a dead peer
//! creates `abort.json` exclusively (the first wins; a later one adopts it) and stops with
//! the abort in its record; rank 0 adopts a worker's abort and relays it in its own
//! record, where every worker finds it.
//!
//! The directory is `store::sim`: one `SimWorld`, and a `SimClient` per node with its own
//! attribute cache, as NFS clients have, with a lifetime drawn per seed from 0 to 60 s.
//! Records are published and read as the node does, so the client's counts are the
//! operations the node would make (`ops_figures`, `scripts/sim --ops`). Nodes are
//! scheduled in a random order with random time steps; a node that has not had a turn for
//! N steps' worth of time goes next (a real node polls at least every poll-interval).
//! Some are frozen briefly (up to a quarter of dead-after); in one seed of four, one is
//! stopped for three to five dead-afters and then resumes. The same seed always replays
//! the same run. Wall clocks agree within 50 ms in one seed of two and are off by up to
//! ten minutes in the other; records carry their writer's wall-clock stamp, which no
//! correct judgement reads.
//!
//! Invariants:
//! - no rank passes barrier k before every rank has published its arrival at k (checked
//!   against the directory's true content, not the passing node's view);
//! - every rank passes barrier k with the broadcast rank 0 computed for k;
//! - no live node is declared dead: the rank named in the abort was stopped for about
//!   dead-after (less what caches and heartbeat spacing can hide), and had not finished;
//! - a node stopped far longer than dead-after has been declared dead by the time it
//!   comes back, whenever another node was running to see it;
//! - every node that stops names the cause the abort names;
//! - every run ends within a bound computed from the timing settings.
//!
//! Proof that it has teeth: six deliberately broken variants are each caught within 200
//! seeds. The barrier ones are rank 0 releasing with one arrival missing, rank 0 counting
//! the files it can list instead of the arrivals in them, and a worker taking an older
//! barrier's release. The liveness ones are a judge that takes any read for a sign of
//! life, an impatient judge that waits a quarter of dead-after, and a judge of the
//! records' wall-clock stamps.
//!
//! Crashes, restarts, generations and fencing are the other scenario's (`crashes.rs`).

mod latency;

pub use latency::{latency_figures, latency_table};

use super::Violation;
use rl_node::layout::Layout;
use rl_node::poll;
use rl_node::protocol::barrier::{Mutation, Progress};
use rl_node::protocol::liveness::Mutation as LivenessMutation;
use rl_node::protocol::machine::{self, Change, Effect, Input, NodeMachine};
use rl_node::protocol::messages::Plain;
use rl_node::protocol::topology::Topology;
use rl_node::protocol::watch;
use rl_node::protocol::{wall_stamp, AbortInfo, AbortKind, NodeState, RankRecord};
use rl_node::rng::SplitMix64 as Rng;
use rl_node::store::sim::{SimClient, SimWorld};
use rl_node::store::{Fs, OpClass, OpCounts, SharedDir};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// What a rank gathers at barrier k: a number of its own (rank * 10 + k).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Arrival(u64);
impl Plain for Arrival {}

/// What rank 0 broadcasts: the barrier and the sum of the arrivals it gathered, so a
/// worker passing on another barrier's release (or on a sum short of one arrival) shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Sum {
    k: u64,
    sum: u64,
}
impl Plain for Sum {}

/// Node `rank`'s machine (the node's own, `protocol::machine`) in the simulated
/// generation, formed from the start.
fn machine_of(
    rank: usize,
    topology: Topology,
    heartbeat_ms: u64,
    dead_after_ms: u64,
    m: &Mutations,
) -> NodeMachine {
    let mut machine = NodeMachine::new(machine::Settings {
        rank: rank as u32,
        num_nodes: topology.num_nodes(),
        host: format!("sim-{rank}"),
        cluster: None,
        heartbeat_interval: Duration::from_millis(heartbeat_ms),
        dead_after: Duration::from_millis(dead_after_ms),
        topology,
        members: None,
    })
    .with_mutations(machine::Mutations {
        barrier: m.barrier,
        liveness: match m.early_by_heartbeat {
            true => Some(LivenessMutation::EarlyBy(Duration::from_millis(
                heartbeat_ms,
            ))),
            false => m.liveness,
        },
        watch: None,
        abort: None,
    });
    machine.set_position(machine::Position {
        run_id: "sim".into(),
        gen: 1,
        iteration: 1,
        phase: "sim".into(),
    });
    machine.watch.formed = true;
    machine
}

fn record(rank: u32) -> RankRecord {
    RankRecord {
        host: format!("sim-{rank}"),
        state: NodeState::Running,
        iteration: 1,
        ..RankRecord::vacant("sim", 1, rank)
    }
}

/// `abort.json`'s content: the rank that created it and the dead rank it names.
type Abort = (u32, u32);

/// The shared directory: one simulated NFS server (`SimWorld`) and one client per node
/// (`SimClient`, with the run's attribute and negative-lookup cache lifetime), on the
/// simulation's time. Records live where the real node keeps them
/// (`<root>/.rl-node/gen-1/rank-R.json`), are published as the node's heartbeat thread
/// publishes them (a durable atomic replacement of the JSON) and read as `poll_cluster`
/// reads them (a read and a parse); `abort.json` is created exclusively. The clients count
/// every operation as the real store does.
struct Directory {
    world: Arc<SimWorld>,
    clients: Vec<SimClient>,
    /// Simulated time in ms, which the clients' caches age by.
    clock: Arc<AtomicU64>,
    layout: Layout,
    /// What each rank last published: its heartbeat thread's copy of its own record.
    mine: Vec<RankRecord>,
    /// `abort.json` as it was created: who created it and the dead rank it names. Nobody
    /// polls it: it only decides which of two concurrent detections is the cause (the
    /// first creator).
    abort: Option<Abort>,
    lifetime_ms: u64,
    /// Barriers every rank is known (from the true content) to have arrived at.
    all_arrived: Vec<bool>,
    /// Each rank's record versions parsed lately, with their bytes: every read gets the
    /// bytes, but the same bytes are parsed once (the debug build's serde is slow).
    parsed: Vec<VecDeque<(Vec<u8>, RankRecord)>>,
    /// Periodic heartbeats written per rank (the read-back is every sixth).
    beats: Vec<u64>,
    /// How far each node's wall clock is off true time, in ms (minutes on a cluster
    /// without NTP). Records carry the writer's wall-clock stamp, as the node's do; no
    /// correct judgement reads it.
    wall_skew_ms: Vec<i64>,
    /// Per observer: the round trips of its reads that the node's parallel reading
    /// threads would have overlapped (the latency projection takes them off).
    overlapped: Vec<Duration>,
}

/// The wall-clock time at the simulation's start: 2026-11-23.
const WALL_ORIGIN_S: u64 = 1_795_392_000;

/// A record's bytes parsed (`None`: unparsable), through `memo`, the last few versions.
fn parse(memo: &mut VecDeque<(Vec<u8>, RankRecord)>, bytes: Vec<u8>) -> Option<RankRecord> {
    if let Some((_, rec)) = memo.iter().find(|(b, _)| *b == bytes) {
        return Some(rec.clone());
    }
    let rec: RankRecord = serde_json::from_slice(&bytes).ok()?;
    if memo.len() == 8 {
        memo.pop_front();
    }
    memo.push_back((bytes, rec.clone()));
    Some(rec)
}

impl Directory {
    fn new(n: usize, lifetime_ms: u64, wall_skew_ms: Vec<i64>) -> Directory {
        let world = SimWorld::new();
        let layout = Layout::new("/sim-run");
        world
            .create_dir_all(layout.rank_record(1, 0).parent().expect("in a directory"))
            .expect("set up");
        let (clock, clients) = super::sim_clients(&world, n, lifetime_ms);
        let mut dir = Directory {
            world,
            clients,
            clock,
            layout,
            mine: (0..n as u32).map(record).collect(),
            abort: None,
            lifetime_ms,
            all_arrived: Vec::new(),
            parsed: vec![VecDeque::new(); n],
            beats: vec![0; n],
            wall_skew_ms,
            overlapped: vec![Duration::ZERO; n],
        };
        // Each node writes its record once before the barriers (the join does).
        for r in 0..n {
            dir.write(r);
        }
        dir
    }

    fn at(&self, now: u64) {
        self.clock.store(now, Ordering::Relaxed);
    }

    /// Node `rank`'s wall clock at true time `now` (ms).
    fn wall(&self, rank: usize, now: u64) -> SystemTime {
        let ms = (WALL_ORIGIN_S * 1_000 + now) as i64 + self.wall_skew_ms[rank];
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms as u64)
    }

    fn write(&mut self, rank: usize) {
        // `publish_live_json`'s bytes (compact JSON and a newline) in its publish without
        // fsync, kept with the record: the heartbeat's read-back finds them without a parse.
        let mut bytes = serde_json::to_vec(&self.mine[rank]).expect("serializable");
        bytes.push(b'\n');
        let dir: &dyn SharedDir = &self.clients[rank];
        dir.publish_with(&self.layout.rank_record(1, rank as u32), false, &mut |w| {
            w.write_all(&bytes)
        })
        .expect("no faults injected here");
        let memo = &mut self.parsed[rank];
        if memo.len() == 8 {
            memo.pop_front();
        }
        memo.push_back((bytes, self.mine[rank].clone()));
    }

    /// An atomic replacement of `rank`'s record; the writer's own cache sees it at once
    /// (close-to-open on its own client).
    fn publish(&mut self, rank: usize, now: u64, f: impl FnOnce(&mut RankRecord)) {
        self.at(now);
        f(&mut self.mine[rank]);
        self.mine[rank].seq += 1;
        self.mine[rank].wall = wall_stamp(self.wall(rank, now));
        self.write(rank);
    }

    /// A periodic heartbeat: every sixth, the heartbeat thread reads the record back
    /// (another process's nonce there would mean two claim this rank); then it
    /// republishes it.
    fn heartbeat(&mut self, rank: usize, now: u64) {
        self.at(now);
        if self.beats[rank].is_multiple_of(6) {
            let dir: &dyn SharedDir = &self.clients[rank];
            let back = dir
                .read(&self.layout.rank_record(1, rank as u32))
                .expect("no faults injected here")
                .and_then(|b| parse(&mut self.parsed[rank], b));
            assert!(back.is_some_and(|b| b.nonce == self.mine[rank].nonce));
        }
        self.beats[rank] += 1;
        self.publish(rank, now, |_| {});
    }

    /// Exclusive create of `abort.json` with `info` by its detector: whether it was
    /// created, and the one there as read back (the node's `Effect::CreateAbort`).
    fn create_abort(&mut self, info: &AbortInfo, now: u64) -> (bool, Option<AbortInfo>) {
        self.at(now);
        let dir: &dyn SharedDir = &self.clients[info.detected_by as usize];
        let path = self.layout.abort(1);
        let created = dir
            .create_new_json(&path, info)
            .expect("no faults injected here");
        let first: AbortInfo = dir
            .read_json(&path)
            .expect("no faults injected here")
            .expect("exists now");
        let first_ = (first.detected_by, first.culprit);
        assert!(self.abort.is_none_or(|a| a == first_), "abort.json changed");
        self.abort = Some(first_);
        (created, Some(first))
    }

    /// A change for the next heartbeat: kept in the heartbeat thread's copy, not written.
    fn stage(&mut self, rank: usize, f: impl FnOnce(&mut RankRecord)) {
        f(&mut self.mine[rank]);
    }

    /// `ranks`' records as `observer` reads them now (the node's `Effect::Read`): a copy
    /// its client fetched less than the attribute cache lifetime ago is what it reads.
    fn read_ranks(
        &mut self,
        observer: usize,
        ranks: &[u32],
        now: u64,
    ) -> Vec<(u32, Option<RankRecord>)> {
        self.at(now);
        let client = &self.clients[observer];
        let dir: &dyn SharedDir = client;
        // In the runs the real node's reading threads would take (one after another here),
        // so that with round trips the time they overlap is known.
        let run = poll::read_run(ranks.len(), Fs.read_parallelism());
        let (mut total, mut longest) = (Duration::ZERO, Duration::ZERO);
        let mut reads = Vec::with_capacity(ranks.len());
        for chunk in ranks.chunks(run) {
            let before = client.latency_spent();
            for &r in chunk {
                let bytes = dir
                    .read(&self.layout.rank_record(1, r))
                    .expect("no faults injected here");
                reads.push((
                    r,
                    bytes.and_then(|b| parse(&mut self.parsed[r as usize], b)),
                ));
            }
            let spent = client.latency_spent() - before;
            total += spent;
            longest = longest.max(spent);
        }
        self.overlapped[observer] += total - longest;
        reads
    }

    /// Whether every rank's record truly (on the server, not in a cache) says it arrived
    /// at barrier k: the first ranks that have not. Arrivals only move forwards, so once
    /// all have arrived at k that is remembered.
    fn not_arrived(&mut self, k: u64) -> Vec<usize> {
        let k_ = k as usize;
        if self.all_arrived.len() <= k_ {
            self.all_arrived.resize(k_ + 1, false);
        }
        if self.all_arrived[k_] {
            return Vec::new();
        }
        let missing: Vec<usize> = (0..self.mine.len())
            .filter(|&q| {
                let bytes = self
                    .world
                    .content(&self.layout.rank_record(1, q as u32))
                    .expect("every rank wrote its record");
                let rec: RankRecord = serde_json::from_slice(&bytes).expect("complete");
                !rec.arrived_at(k)
            })
            .collect();
        self.all_arrived[k_] = missing.is_empty();
        missing
    }

    /// Operations that reached the server, from every client.
    fn server(&self) -> OpCounts {
        self.world.server_counts()
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// About to publish its arrival at barrier k.
    Arrive,
    /// Arrived; polling.
    Wait,
    /// Passed every barrier.
    Done,
    /// Stopped by the cluster's abort (naming this dead rank).
    Stopped(u32),
}

/// The broken variants a run may be given (never the node's).
#[derive(Debug, Clone, Copy, Default)]
pub struct Mutations {
    pub barrier: Option<Mutation>,
    pub liveness: Option<LivenessMutation>,
    /// Judge liveness by the records' wall-clock stamps (`watch::Mutation::WallClock`).
    pub wall_clock: bool,
    /// Judge a peer dead one heartbeat interval early (`liveness::Mutation::EarlyBy`).
    pub early_by_heartbeat: bool,
}

struct Sim {
    n: usize,
    /// Flat, or groups of workers through leaders (one seed in two from 4 nodes).
    topology: Topology,
    barriers: u64,
    mutations: Mutations,
    rng: Rng,
    now: u64,
    dir: Directory,
    k: Vec<u64>,
    step: Vec<Step>,
    /// Heartbeat interval and dead-after, in ms; each node's clock rate in ppm of true time.
    heartbeat_ms: u64,
    dead_after_ms: u64,
    rate_ppm: Vec<u64>,
    next_beat: Vec<u64>,
    /// Each node's machine: the node's own watching, barriers and aborts.
    machines: Vec<NodeMachine>,
    /// What each node has seen of each peer's heartbeat, from the reads performed for it:
    /// the sequence last read and when (true time) a read first returned it. The
    /// specification a death is checked against.
    seen: Vec<Vec<Option<(u64, u64)>>>,
    /// Each node's freezes so far: (start, end).
    freezes: Vec<Vec<(u64, u64)>>,
    frozen_until: Vec<u64>,
    /// When each node last had a turn (simulated time).
    last_turn: Vec<u64>,
    /// Until when each node is busy computing (the figures' slow rank): its heartbeat
    /// runs, it does not poll.
    busy_until: Vec<u64>,
    /// What rank 0 broadcast for each barrier (index k).
    broadcast: Vec<Option<Sum>>,
    trace: super::Trace,
    steps: u64,
    faults: u64,
    checks: u64,
    group_arrivals: u64,
}

#[derive(Default)]
pub struct Summary {
    pub steps: u64,
    faults: u64,
    checks: u64,
    reads: u64,
    writes: u64,
    sim_ms: u64,
    /// Simulated time times nodes, summed over runs.
    node_ms: u64,
    /// Runs that ended with a node declared dead (a long freeze).
    deaths: u64,
    /// Group arrivals leaders published (runs in groups).
    group_arrivals: u64,
    /// Runs in groups that declared a leader dead, and a member dead (by its leader).
    leader_deaths: u64,
    member_deaths: u64,
}

impl Sim {
    fn new(seed: u64, n: usize, barriers: u64, mutations: Mutations) -> Sim {
        let mut rng = Rng::new(seed);
        // NFS attribute caches: none, the 3 s of acregmin, up to a minute.
        let lifetime_ms = [0, 100, 1_000, 3_000, 30_000, 60_000][rng.below(6) as usize];
        let heartbeat_ms = 200 + rng.below(4_800);
        // dead-after with the margin the documentation asks for over the cache lifetime
        // and the heartbeat interval (docs/shared-directory.md), plus 5 s.
        let dead_after_ms = 2 * (lifetime_ms + 2 * heartbeat_ms) + 5_000;
        let rate_ppm: Vec<u64> = (0..n).map(|_| 990_000 + rng.below(20_001)).collect();
        // Wall clocks, from a stream of their own (the runs are those of the seeds before
        // wall clocks were simulated): in one seed of two they are NTP-kept, within
        // 50 ms of each other; otherwise each is off by up to ten minutes either way.
        let mut wall_rng = Rng::new(seed ^ 0x3a11_c10c);
        let spread_ms = if wall_rng.below(2) == 0 {
            50
        } else {
            1_200_000
        };
        let wall_skew_ms = (0..n)
            .map(|_| wall_rng.below(spread_ms + 1) as i64 - spread_ms as i64 / 2)
            .collect();
        // The topology, from a stream of its own (a flat seed runs as it did before
        // groups were simulated): groups of 2 to 4 workers in one seed of two.
        let mut topology_rng = Rng::new(seed ^ 0x70b0_1091);
        let topology = match topology_rng.below(2) {
            0 => Topology::grouped(n as u32, 2 + topology_rng.below(3) as u32),
            _ => Topology::flat(n as u32),
        };
        let machines = (0..n)
            .map(|r| machine_of(r, topology, heartbeat_ms, dead_after_ms, &mutations))
            .collect();
        Sim {
            n,
            topology,
            barriers,
            mutations,
            rng,
            now: 0,
            dir: Directory::new(n, lifetime_ms, wall_skew_ms),
            k: vec![1; n],
            step: vec![Step::Arrive; n],
            heartbeat_ms,
            dead_after_ms,
            rate_ppm,
            next_beat: vec![0; n],
            machines,
            seen: vec![vec![None; n]; n],
            freezes: vec![Vec::new(); n],
            frozen_until: vec![0; n],
            last_turn: vec![0; n],
            busy_until: vec![0; n],
            broadcast: vec![None; barriers as usize + 1],
            trace: super::Trace::new(40),
            steps: 0,
            faults: 0,
            checks: 0,
            group_arrivals: 0,
        }
    }

    /// Node `r`'s monotonic clock: true time at its own rate (±1 %).
    fn local(&self, r: usize) -> Duration {
        Duration::from_micros(self.now * self.rate_ppm[r] / 1_000)
    }

    fn note(&mut self, s: String) {
        self.trace.note(self.now, s);
    }

    fn violation(&self, seed: u64, what: String) -> Violation {
        self.trace.violation(seed, what)
    }

    fn live(&self, r: usize) -> bool {
        matches!(self.step[r], Step::Arrive | Step::Wait)
    }

    fn run(mut self, seed: u64) -> Result<Summary, Violation> {
        // Every wait ends: a bound of simulated time for the whole run, from the cache
        // lifetime, dead-after and the scheduler's step, plus every freeze (each can
        // delay everyone).
        let max_step = 50 + self.dir.lifetime_ms / 20;
        let base_ms =
            (self.barriers + 2) * (2 * self.dir.lifetime_ms + 4 * self.n as u64 * max_step) * 4
                + 4 * self.dead_after_ms
                + 600_000;
        let mut frozen_total = 0;
        // At most one node of a run is stopped for longer than dead-after (a stopped
        // VM), in one seed out of four; it resumes later.
        let long_freeze = self.rng.below(4) == 0;
        let mut long_done = false;
        while (0..self.n).any(|r| self.live(r)) {
            let bound_ms = base_ms + frozen_total;
            if self.now > bound_ms {
                let w = self.violation(
                    seed,
                    format!(
                        "the run did not end within {bound_ms} ms of simulated time (ranks at barriers {:?}, steps {:?})",
                        self.k, self.step
                    ),
                );
                return Err(w);
            }
            self.steps += 1;
            let before = self.now;
            self.now += 1 + self.rng.below(max_step - 1);
            self.check_detection(before, max_step, seed)?;
            self.heartbeats();
            // A node polls at least once a turn, as a real node polls at least every
            // poll-interval: one that has waited a whole turn goes next, else a random one.
            let turn = self.n as u64 * max_step;
            let starving = (0..self.n).find(|&q| {
                self.live(q)
                    && self.frozen_until[q] <= self.now
                    && self.now - self.last_turn[q] >= turn
            });
            let r = match starving {
                Some(q) => q,
                None => self.rng.below(self.n as u64) as usize,
            };
            if !self.live(r) || self.frozen_until[r] > self.now {
                continue;
            }
            self.last_turn[r] = self.now;
            let roll = self.rng.below(10_000);
            if roll < 30 || (long_freeze && !long_done && roll < 60) {
                // A pause: brief (a quarter of dead-after at most), or a stopped VM that
                // comes back after two to four dead-afters.
                let long = roll >= 30;
                let d = if long {
                    long_done = true;
                    3 * self.dead_after_ms + self.rng.below(2 * self.dead_after_ms)
                } else {
                    1 + self.rng.below(self.dead_after_ms / 4)
                };
                frozen_total += d;
                self.frozen_until[r] = self.now + d;
                self.freezes[r].push((self.now, self.now + d));
                self.faults += 1;
                self.note(format!("rank {r} frozen for {d} ms"));
                continue;
            }
            self.act(r, seed)?;
        }
        // Every node that stopped names the cause the abort file names.
        if let Some((_, dead)) = self.dir.abort {
            for r in 0..self.n {
                self.checks += 1;
                match self.step[r] {
                    Step::Stopped(d) if d == dead => {}
                    Step::Done => {}
                    ref other => {
                        return Err(self.violation(
                            seed,
                            format!("rank {r} ended as {other:?}, but the abort names rank {dead}"),
                        ))
                    }
                }
            }
        }
        Ok(Summary {
            steps: self.steps,
            faults: self.faults,
            checks: self.checks,
            reads: self.dir.server().get(OpClass::Read),
            writes: self.dir.server().get(OpClass::Write),
            sim_ms: self.now,
            node_ms: self.now * self.n as u64,
            deaths: u64::from(self.dir.abort.is_some()),
            group_arrivals: self.group_arrivals,
            leader_deaths: u64::from(
                self.dir
                    .abort
                    .is_some_and(|(_, dead)| dead != 0 && self.topology.is_leader(dead)),
            ),
            member_deaths: u64::from(
                self.dir
                    .abort
                    .is_some_and(|(by, dead)| by != 0 && dead != 0 && !self.topology.is_flat()),
            ),
        })
    }

    /// Every wait ends: a node that was stopped for far longer than dead-after (by the
    /// slowest clock, plus what caches and heartbeat spacing hide, plus two turns of
    /// every node to look) must have been declared dead by the time it comes back, as
    /// long as another node was running to see it.
    fn check_detection(&mut self, before: u64, max_step: u64, seed: u64) -> Result<(), Violation> {
        let turn = self.n as u64 * max_step;
        let needed = self.dead_after_ms * 1_010 / 1_000
            + self.dir.lifetime_ms
            + 2 * self.heartbeat_ms
            + 2 * turn;
        for q in 0..self.n {
            let Some(&(s, e)) = self.freezes[q].last() else {
                continue;
            };
            if !(before < e && e <= self.now) || e - s < needed || self.dir.abort.is_some() {
                continue;
            }
            // Whoever reads q's record: rank 0 (every worker, or the leaders), q's
            // leader, and for rank 0 every worker.
            let watchers = (0..self.n)
                .filter(|&r| {
                    r != q
                        && self.topology.watches(r as u32, q as u32)
                        && self.live(r)
                        && self.freezes[r].iter().all(|&(fs, fe)| fe <= s || fs >= e)
                })
                .count();
            self.checks += 1;
            if watchers > 0 {
                return Err(self.violation(
                    seed,
                    format!(
                        "rank {q} was stopped for {} ms (dead-after {} ms) and nobody declared it dead; the run did not end",
                        e - s,
                        self.dead_after_ms
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Each live, unfrozen node's heartbeat thread republishes its record every
    /// heartbeat interval of its own clock.
    fn heartbeats(&mut self) {
        for r in 0..self.n {
            if !self.live(r) || self.frozen_until[r] > self.now {
                continue;
            }
            let local = self.local(r).as_millis() as u64;
            if local >= self.next_beat[r] {
                self.next_beat[r] = local + self.heartbeat_ms;
                let now = self.now;
                self.dir.heartbeat(r, now);
            }
        }
    }

    /// Node `r`'s turn: its machine reads what it watches and judges it (an abort in a
    /// watched record is adopted, a still heartbeat is a dead peer), then the node
    /// arrives at its barrier or looks whether it may pass.
    fn act(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        self.poll(r, seed)?;
        if !self.live(r) {
            return Ok(());
        }
        self.proceed(r, seed)
    }

    /// Node `r`'s poll round (`Node::poll_cluster`): its machine reads what it watches and
    /// judges it.
    fn poll(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        if self.mutations.wall_clock {
            let wall = self.dir.wall(r, self.now);
            self.machines[r].set_watch_mutation(Some(watch::Mutation::WallClock { now: wall }));
        }
        let local = self.local(r);
        self.machines[r].tick(local);
        self.perform(r, seed)
    }

    /// Node `r` arrives at its barrier, or looks whether it may pass (rank 0 releasing it
    /// when it may).
    fn proceed(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        let k = self.k[r];
        match self.step[r] {
            Step::Arrive => {
                let gather = Arrival(r as u64 * 10 + k);
                let at = self.machines[r].arrive("sim", &gather);
                assert_eq!(at, k, "the node's barrier count");
                self.perform(r, seed)?;
                self.step[r] = Step::Wait;
                self.note(format!("rank {r} arrives at barrier {k}"));
            }
            Step::Wait => match self.machines[r].progress::<Arrival, Sum>() {
                Progress::Waiting { .. } => self.perform(r, seed)?,
                Progress::Complete { payloads } => {
                    let sum = payloads.iter().map(|a| a.0).sum();
                    let broadcast = Sum { k, sum };
                    self.machines[r].release(&broadcast);
                    self.broadcast[k as usize] = Some(broadcast);
                    self.note(format!("rank 0 releases barrier {k} with {broadcast:?}"));
                    self.perform(r, seed)?;
                    self.pass(r, k, &broadcast, seed)?;
                }
                Progress::Released { broadcast } => {
                    self.note(format!("rank {r} passes barrier {k} with {broadcast:?}"));
                    self.pass(r, k, &broadcast, seed)?;
                }
            },
            Step::Done | Step::Stopped(_) => {}
        }
        Ok(())
    }

    /// Perform node `r`'s machine's effects on the simulated directory, as the node's
    /// driver (`Node::drive_machine`) performs them on the real one.
    fn perform(&mut self, r: usize, seed: u64) -> Result<(), Violation> {
        while let Some(effect) = self.machines[r].poll_effect() {
            let now = self.now;
            match effect {
                Effect::Read(ranks) => {
                    let reads = self.dir.read_ranks(r, &ranks, now);
                    for (q, rec) in &reads {
                        let seq = rec.as_ref().map_or(u64::MAX, |rec| rec.seq);
                        let seen = &mut self.seen[r][*q as usize];
                        if seen.is_none_or(|(s, _)| s != seq) {
                            *seen = Some((seq, now));
                        }
                    }
                    let local = self.local(r);
                    let reads = reads
                        .into_iter()
                        .map(|(q, rec)| (q, rec, local.into()))
                        .collect();
                    self.machines[r].handle(local, Input::Records(reads));
                }
                Effect::Record(Change::Arrived(mark)) => {
                    self.dir.publish(r, now, |rec| rec.arrived = Some(mark))
                }
                Effect::Record(Change::Released(mark)) => self.dir.publish(r, now, |rec| {
                    rec.released = Some(mark);
                    rec.waiting_for.clear();
                }),
                Effect::Record(Change::GroupArrived(mark)) => {
                    self.note(format!(
                        "rank {r} publishes its group's arrival at {}",
                        mark.k
                    ));
                    self.group_arrivals += 1;
                    self.dir.publish(r, now, |rec| {
                        rec.group = Some(mark);
                        rec.waiting_for.clear();
                    })
                }
                Effect::Record(Change::WaitingFor(missing)) => {
                    self.dir.stage(r, |rec| rec.waiting_for = missing)
                }
                Effect::Record(Change::Observed(ages)) => {
                    self.dir.stage(r, |rec| rec.observed_ms = ages)
                }
                Effect::CreateAbort(info) => {
                    if info.kind != AbortKind::PeerDead {
                        return Err(self.violation(
                            seed,
                            format!("rank {r} stops for {info:?}: nothing here fails but a stopped node"),
                        ));
                    }
                    let (created, first) = self.dir.create_abort(&info, now);
                    self.note(format!(
                        "rank {r} finds rank {} dead{}",
                        info.culprit,
                        if created {
                            ""
                        } else {
                            " (an abort exists: adopted)"
                        }
                    ));
                    self.check_silence(r, info.culprit as usize, seed)?;
                    if created {
                        self.check_death(r, info.culprit as usize, seed)?;
                    }
                    let local = self.local(r);
                    self.machines[r].handle(local, Input::AbortCreated { created, first });
                }
                Effect::Warn(w) => self.note(format!("rank {r} warns: {w}")),
                Effect::Stop(info) => {
                    self.note(format!(
                        "rank {r} stops: rank {} declared rank {} dead",
                        info.detected_by, info.culprit
                    ));
                    self.stop(r, info);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Node `r` stops on `info` and says so in its record, where its watchers find it
    /// (the runtime's `RecordHandle::fail_with`: the record's first abort stands).
    fn stop(&mut self, r: usize, info: AbortInfo) {
        self.step[r] = Step::Stopped(info.culprit);
        let now = self.now;
        self.dir.publish(r, now, |rec| {
            rec.state = NodeState::Failed;
            rec.abort.get_or_insert(info);
        });
    }

    /// The specification of a death, checked at every declaration: the observer's reads
    /// of rank `q`'s record have returned the same heartbeat for at least dead-after of
    /// true time (less what its clock, up to 1 % fast, can gain). Exact, with no slack
    /// for caches: what the observer could not see cannot count, and what it saw may not
    /// be judged early, not even by one heartbeat.
    fn check_silence(&mut self, r: usize, q: usize, seed: u64) -> Result<(), Violation> {
        self.checks += 1;
        let least = self.dead_after_ms * 1_000 / 1_010;
        match self.seen[r][q] {
            Some((_, since)) if self.now - since >= least => Ok(()),
            seen => Err(self.violation(
                seed,
                format!(
                    "rank {r} declared rank {q} dead, but its reads of rank {q}'s record had returned the same heartbeat only since {seen:?} (now {} ms, dead-after {} ms)",
                    self.now, self.dead_after_ms
                ),
            )),
        }
    }

    /// Node `r` was first to declare rank `q` dead: only a rank that really stopped for
    /// about dead-after may be.
    fn check_death(&mut self, r: usize, q: usize, seed: u64) -> Result<(), Violation> {
        let now = self.now;
        self.checks += 1;
        // How long q must have been stopped, at least, for a correct judge to say so:
        // dead-after by the fastest clock, less what stale caches and heartbeat spacing
        // can hide.
        let hidden = self.dir.lifetime_ms + 2 * self.heartbeat_ms + 100;
        let needed = (self.dead_after_ms * 1_000 / 1_010).saturating_sub(hidden);
        let stopped = self.freezes[q]
            .iter()
            .any(|&(s, e)| e + hidden >= now && e - s >= needed);
        let finished = !self.live(q);
        if !stopped && !finished {
            return Err(self.violation(
                seed,
                format!(
                    "rank {r} declared rank {q} dead, but rank {q} was never stopped for {needed} ms (dead-after {} ms, cache {} ms, heartbeat {} ms); its freezes: {:?}",
                    self.dead_after_ms, self.dir.lifetime_ms, self.heartbeat_ms, self.freezes[q]
                ),
            ));
        }
        if finished {
            return Err(self.violation(
                seed,
                format!("rank {r} declared rank {q} dead after it had finished"),
            ));
        }
        Ok(())
    }

    /// Rank `r` passes barrier `k` having received `broadcast`: check the invariants
    /// against the directory's true content.
    fn pass(&mut self, r: usize, k: u64, broadcast: &Sum, seed: u64) -> Result<(), Violation> {
        self.machines[r].leave_barrier();
        self.checks += 1;
        let not_arrived = self.dir.not_arrived(k);
        if !not_arrived.is_empty() {
            return Err(self.violation(
                seed,
                format!("rank {r} passed barrier {k} before ranks {not_arrived:?} arrived at it"),
            ));
        }
        // What rank 0 gathered is every rank's arrival, each once, through whichever
        // leaders: the sum of them all.
        self.checks += 1;
        let all: u64 = (0..self.n as u64).map(|q| q * 10 + k).sum();
        if broadcast.sum != all {
            return Err(self.violation(
                seed,
                format!(
                    "rank {r} passed barrier {k} with {broadcast:?}, but the arrivals sum to {all}"
                ),
            ));
        }
        self.checks += 1;
        if self.broadcast[k as usize].as_ref() != Some(broadcast) {
            return Err(self.violation(
                seed,
                format!(
                    "rank {r} passed barrier {k} with {broadcast:?}, but rank 0 broadcast {:?} for it",
                    self.broadcast[k as usize]
                ),
            ));
        }
        self.k[r] += 1;
        self.step[r] = Step::Arrive;
        if self.k[r] > self.barriers {
            self.step[r] = Step::Done;
            let now = self.now;
            self.dir.publish(r, now, |rec| rec.state = NodeState::Done);
        }
        Ok(())
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
        Sim::new(seed, n, 12, mutations).run(seed)
    })
}

impl std::ops::AddAssign for Summary {
    fn add_assign(&mut self, o: Summary) {
        self.steps += o.steps;
        self.faults += o.faults;
        self.checks += o.checks;
        self.reads += o.reads;
        self.writes += o.writes;
        self.sim_ms += o.sim_ms;
        self.node_ms += o.node_ms;
        self.deaths += o.deaths;
        self.group_arrivals += o.group_arrivals;
        self.leader_deaths += o.leader_deaths;
        self.member_deaths += o.member_deaths;
    }
}

#[test]
fn a_thousand_seeds_of_1_to_16_nodes_keep_the_invariants() {
    match sweep(1, 1_000, 16, Mutations::default()) {
        Ok(s) => {
            assert!(s.checks > 100_000 && s.faults > 0, "too little was checked");
            // About one run in four stops a node for longer than dead-after: those must
            // have ended with it declared dead, so deaths were really exercised.
            assert!(s.deaths > 100, "only {} runs declared a death", s.deaths);
            // About half the runs of 4 nodes or more gather through group leaders.
            assert!(
                s.group_arrivals > 1_000,
                "only {} group arrivals",
                s.group_arrivals
            );
            assert!(
                s.leader_deaths > 10 && s.member_deaths > 10,
                "leaders declared dead in {} runs, members by their leaders in {}",
                s.leader_deaths,
                s.member_deaths
            );
        }
        Err(v) => panic!("{v}"),
    }
}

#[test]
fn the_same_seed_replays_the_same_run() {
    let run = || {
        Sim::new(42, 7, 12, Mutations::default())
            .run(42)
            .map_err(|v| v.to_string())
            .unwrap()
    };
    let (a, b) = (run(), run());
    assert_eq!(
        (a.steps, a.faults, a.reads, a.writes, a.sim_ms, a.deaths),
        (b.steps, b.faults, b.reads, b.writes, b.sim_ms, b.deaths)
    );
}

fn caught(m: Mutations) -> Violation {
    let v = super::caught(|first, seeds, nodes| sweep(first, seeds, nodes, m));
    println!("{m:?}: caught at seed {}", v.seed);
    v
}

/// The simulator has teeth: a barrier that releases with one arrival missing is caught.
#[test]
fn a_barrier_released_one_arrival_early_is_caught() {
    let v = caught(Mutations {
        barrier: Some(Mutation::ReleaseOneEarly),
        ..Mutations::default()
    });
    assert!(v.what.contains("before ranks"), "{v}");
    assert!(!v.trace.is_empty());
}

/// … and so is a worker that passes on an older barrier's release.
#[test]
fn a_worker_taking_an_older_release_is_caught() {
    let v = caught(Mutations {
        barrier: Some(Mutation::AcceptStaleRelease),
        ..Mutations::default()
    });
    assert!(v.what.contains("passed barrier"), "{v}");
}

/// … a liveness judge that takes any read for a sign of life (a stopped node is never
/// found dead: the run never ends) …
#[test]
fn a_judge_fooled_by_unchanged_records_is_caught() {
    let v = caught(Mutations {
        liveness: Some(LivenessMutation::ResetOnEveryRead),
        ..Mutations::default()
    });
    assert!(v.what.contains("did not end"), "{v}");
}

/// … an impatient one (a live node behind a stale cache is declared dead) …
#[test]
fn an_impatient_liveness_judge_is_caught() {
    let v = caught(Mutations {
        liveness: Some(LivenessMutation::Impatient),
        ..Mutations::default()
    });
    assert!(v.what.contains("declared rank"), "{v}");
}

/// … one that judges by the wall-clock stamps in the records (a node whose clock is
/// minutes ahead finds live peers dead) …
#[test]
fn a_judge_of_wall_clock_stamps_is_caught() {
    let v = caught(Mutations {
        wall_clock: true,
        ..Mutations::default()
    });
    assert!(v.what.contains("declared rank"), "{v}");
}

/// … a judge that waits half of dead-after …
#[test]
fn a_judge_at_half_of_dead_after_is_caught() {
    let v = caught(Mutations {
        liveness: Some(LivenessMutation::HalfPatient),
        ..Mutations::default()
    });
    assert!(v.what.contains("declared rank"), "{v}");
}

/// … one only a heartbeat interval too early, which no cache-tolerant check could tell
/// from a correct one: the check of every death against what the observer truly read
/// catches it …
#[test]
fn a_judge_one_heartbeat_early_is_caught() {
    let v = caught(Mutations {
        early_by_heartbeat: true,
        ..Mutations::default()
    });
    assert!(
        v.what.contains("returned the same heartbeat only since"),
        "{v}"
    );
}

/// … and a barrier that counts the files it can list instead of the arrivals in them.
#[test]
fn a_barrier_counting_listed_files_is_caught() {
    let v = caught(Mutations {
        barrier: Some(Mutation::CountListed),
        ..Mutations::default()
    });
    assert!(v.what.contains("before ranks"), "{v}");
}

/// … and a group's leader that publishes its group's arrival with a member missing.
#[test]
fn a_leader_gathering_its_group_one_arrival_early_is_caught() {
    let v = caught(Mutations {
        barrier: Some(Mutation::GroupOneEarly),
        ..Mutations::default()
    });
    assert!(v.what.contains("before ranks"), "{v}");
    assert!(v.trace.iter().any(|t| t.contains("group's arrival")), "{v}");
}

impl Summary {
    /// Faults injected: frozen nodes.
    pub fn faults(&self) -> u64 {
        self.faults
    }

    pub fn line(&self) -> String {
        format!(
            "{} steps, {} faults (frozen nodes), {} runs with a node declared dead ({} a leader, {} a member by its leader), {} group arrivals through leaders, {} invariant checks, {:.1} simulated node-hours; shared-directory reads {} (past the caches) and writes {}",
            self.steps,
            self.faults,
            self.deaths,
            self.leader_deaths,
            self.member_deaths,
            self.group_arrivals,
            self.checks,
            self.node_ms as f64 / 3.6e6,
            self.reads,
            self.writes,
        )
    }
}

/// The settings of the operation figures: the node's default timing (heartbeat 5 s, poll
/// 1 s, dead-after 60 s) and NFS's default attribute cache (`acregmin` 3 s).
#[derive(Debug, Clone, Copy)]
pub struct OpsSettings {
    pub lifetime_ms: u64,
    pub heartbeat_ms: u64,
    pub poll_ms: u64,
    pub dead_after_ms: u64,
    /// Barriers run back to back for the per-barrier figures.
    pub barriers: u64,
    /// How long every node waits at a barrier for the slow rank, for the idle figures.
    pub idle_s: u64,
    /// `[cluster] barrier-groups-from`: from this many nodes on, groups through leaders.
    pub groups_from: u32,
}

impl Default for OpsSettings {
    fn default() -> OpsSettings {
        OpsSettings {
            lifetime_ms: 3_000,
            heartbeat_ms: 5_000,
            poll_ms: 1_000,
            dead_after_ms: 60_000,
            barriers: 4,
            idle_s: 60,
            groups_from: 64,
        }
    }
}

/// Client-side (by class, as the real store counts) and server-side operations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ops {
    pub client: OpCounts,
    pub server: OpCounts,
}

impl std::ops::Sub for Ops {
    type Output = Ops;
    fn sub(self, o: Ops) -> Ops {
        Ops {
            client: self.client - o.client,
            server: self.server - o.server,
        }
    }
}

/// Shared-directory operations of one cluster of `n` nodes, per node: per barrier (back
/// to back) and per second of waiting at a barrier for a slow rank; rank 0 (the master)
/// and the workers (averaged) apart.
#[derive(Debug, Clone)]
pub struct OpsFigures {
    pub n: usize,
    /// Simulated time a barrier took.
    pub barrier_ms: f64,
    /// Per barrier: the master's, all workers' (summed), over `barriers` barriers.
    pub master_barriers: Ops,
    pub workers_barriers: Ops,
    pub barriers: u64,
    /// Over `idle_s` seconds: the master's, and the waiting workers' summed (every worker
    /// but the slow one).
    pub master_idle: Ops,
    pub workers_idle: Ops,
    pub waiting_workers: u64,
    pub idle_s: u64,
}

impl Sim {
    /// A cluster for the figures: no randomness, exact clocks, the given timing.
    fn for_figures(n: usize, barriers: u64, s: OpsSettings) -> Sim {
        let mut sim = Sim::new(0, n, barriers, Mutations::default());
        sim.dir = Directory::new(n, s.lifetime_ms, vec![0; n]);
        sim.heartbeat_ms = s.heartbeat_ms;
        sim.dead_after_ms = s.dead_after_ms;
        sim.rate_ppm = vec![1_000_000; n];
        sim.topology = Topology::for_cluster(n as u32, s.groups_from);
        sim.machines = (0..n)
            .map(|r| {
                let m = Mutations::default();
                machine_of(r, sim.topology, s.heartbeat_ms, s.dead_after_ms, &m)
            })
            .collect();
        sim
    }

    /// One poll interval: heartbeats, then every node that is not busy polls and acts, in
    /// rank order.
    fn tick(&mut self, poll_ms: u64) -> Result<(), Violation> {
        self.now += poll_ms;
        self.heartbeats();
        for r in 0..self.n {
            if self.live(r) && self.busy_until[r] <= self.now {
                self.act(r, 0)?;
            }
        }
        Ok(())
    }

    fn ops(&self, r: usize) -> Ops {
        Ops {
            client: self.dir.clients[r].counts(),
            server: self.dir.clients[r].server_counts(),
        }
    }

    fn ops_of(&self, ranks: impl Iterator<Item = usize>) -> Ops {
        let mut sum = Ops::default();
        for r in ranks {
            let o = self.ops(r);
            sum.client += o.client;
            sum.server += o.server;
        }
        sum
    }
}

/// The figures for a cluster of `n` (at least 3) nodes.
pub fn ops_figures(n: usize, s: OpsSettings) -> Result<OpsFigures, Violation> {
    assert!(n >= 3, "a master, a waiting worker and a slow one");
    let mut sim = Sim::for_figures(n, s.barriers + 1, s);
    let bound = sim.now + 1_000 * s.dead_after_ms;
    // Barriers back to back.
    let (m0, w0, t0) = (sim.ops(0), sim.ops_of(1..n), sim.now);
    while sim.k.iter().any(|&k| k <= s.barriers) {
        sim.tick(s.poll_ms)?;
        assert!(sim.now < bound, "the barriers did not end: {:?}", sim.step);
    }
    let (m1, w1, t1) = (sim.ops(0), sim.ops_of(1..n), sim.now);
    // The last rank computes for the whole window; the others arrive and wait for it.
    let slow = n - 1;
    sim.busy_until[slow] = sim.now + 1_000 * s.idle_s + 2 * s.poll_ms;
    sim.tick(s.poll_ms)?;
    assert!((0..slow).all(|r| sim.step[r] == Step::Wait));
    let (m2, w2) = (sim.ops(0), sim.ops_of(1..slow));
    for _ in 0..1_000 * s.idle_s / s.poll_ms {
        sim.tick(s.poll_ms)?;
    }
    let (m3, w3) = (sim.ops(0), sim.ops_of(1..slow));
    assert!(
        (0..slow).all(|r| sim.step[r] == Step::Wait),
        "still waiting"
    );
    Ok(OpsFigures {
        n,
        barrier_ms: (t1 - t0) as f64 / s.barriers as f64,
        master_barriers: m1 - m0,
        workers_barriers: w1 - w0,
        barriers: s.barriers,
        master_idle: m3 - m2,
        workers_idle: w3 - w2,
        waiting_workers: (slow - 1) as u64,
        idle_s: s.idle_s,
    })
}

impl OpsFigures {
    /// Per node: (master per barrier, worker per barrier, master per idle second, worker
    /// per idle second), each as (client by class, server) divided out.
    fn rows(&self) -> [(&'static str, &'static str, Ops, f64); 4] {
        let b = self.barriers as f64;
        let w = (self.n - 1) as f64;
        let i = self.idle_s as f64;
        [
            ("per barrier", "master", self.master_barriers, b),
            ("per barrier", "worker", self.workers_barriers, b * w),
            ("per idle second", "master", self.master_idle, i),
            (
                "per idle second",
                "worker",
                self.workers_idle,
                i * self.waiting_workers as f64,
            ),
        ]
    }

    pub fn per(&self, what: &str, role: &str) -> (f64, f64) {
        let (_, _, ops, d) = self
            .rows()
            .into_iter()
            .find(|(w, r, _, _)| *w == what && *r == role)
            .expect("a row");
        (ops.client.total() as f64 / d, ops.server.total() as f64 / d)
    }

    pub fn per_class(&self, what: &str, role: &str, server: bool, class: OpClass) -> f64 {
        let (_, _, ops, d) = self
            .rows()
            .into_iter()
            .find(|(w, r, _, _)| *w == what && *r == role)
            .expect("a row");
        let c = if server { ops.server } else { ops.client };
        c.get(class) as f64 / d
    }
}

fn by_class(c: OpCounts, d: f64) -> String {
    OpClass::ALL
        .iter()
        .filter(|k| c.get(**k) > 0)
        .map(|k| format!("{} {:.1}", k.name(), c.get(*k) as f64 / d))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The figures as a table (`scripts/sim --ops`).
pub fn ops_table(figures: &[OpsFigures], s: OpsSettings) -> String {
    let mut out = format!(
        "Shared-directory operations per node (client side by class, as the real store counts them; server: what reached the NFS server past the caches).\n\
         Attribute and negative-lookup cache {} ms, heartbeat {} ms, poll {} ms; {} barriers back to back; an idle stretch of {} s at a barrier waiting for one slow rank.\n",
        s.lifetime_ms, s.heartbeat_ms, s.poll_ms, s.barriers, s.idle_s
    );
    for what in ["per barrier", "per idle second"] {
        out += &format!("\n{what}:\n");
        out += &format!(
            "{:>6}  {:<6}  {:>8}  {:>8}  client by class\n",
            "nodes", "role", "client", "server"
        );
        for f in figures {
            for (w, role, ops, d) in f.rows() {
                if w != what {
                    continue;
                }
                out += &format!(
                    "{:>6}  {:<6}  {:>8.1}  {:>8.1}  {}\n",
                    f.n,
                    role,
                    ops.client.total() as f64 / d,
                    ops.server.total() as f64 / d,
                    by_class(ops.client, d)
                );
            }
        }
    }
    out += "\nsimulated time per barrier:";
    for f in figures {
        out += &format!(" {} nodes {:.1} s;", f.n, f.barrier_ms / 1_000.0);
    }
    out.pop();
    out.push('\n');
    out
}

/// What the figures say about scaling, checked on small clusters: a worker's operations
/// (per barrier and per idle second) do not grow with the cluster, the master's per idle
/// second grow linearly (one record per worker), and the server sees each worker record
/// once per attribute-cache lifetime.
#[test]
fn a_workers_operations_stay_flat_and_the_masters_grow_linearly() {
    let s = OpsSettings {
        idle_s: 30,
        ..OpsSettings::default()
    };
    let f: Vec<OpsFigures> = [4, 8, 16]
        .into_iter()
        .map(|n| ops_figures(n, s).map_err(|v| v.to_string()).unwrap())
        .collect();
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * b.abs().max(1e-9);
    for what in ["per barrier", "per idle second"] {
        let w: Vec<(f64, f64)> = f.iter().map(|f| f.per(what, "worker")).collect();
        assert!(
            w.iter()
                .all(|x| close(x.0, w[0].0, 0.05) && close(x.1, w[0].1, 0.05)),
            "a worker's operations {what} grow with the cluster: {w:?}"
        );
    }
    let m: Vec<f64> = f
        .iter()
        .map(|f| f.per("per idle second", "master").0)
        .collect();
    let (slope_a, slope_b) = ((m[1] - m[0]) / 4.0, (m[2] - m[1]) / 8.0);
    assert!(
        slope_a > 0.5 && close(slope_b, slope_a, 0.05),
        "the master's idle operations per second are not linear in the workers: {m:?}"
    );
    // Waiting at a barrier, the master reads the slow worker's record every poll (open,
    // read: 2 operations; the one rank still missing is the probe of every round) and
    // each worker that has arrived once per half heartbeat (2.5 s: every third 1 s poll;
    // an arrival is found there, or by a probe's sweep, not by a read of its own), as the
    // node's machine decides (`watch::to_read`); the server sees each of those past the
    // 3 s cache, plus the master's own read-back every sixth heartbeat (30 s).
    let read_back = 1.0 / 30.0;
    let arrived = |n: usize| (n - 2) as f64 / 3.0;
    for f in &f {
        let reads = f.per_class("per idle second", "master", true, OpClass::Read);
        let expected = 1.0 / 3.0 + arrived(f.n) + read_back;
        assert!(
            close(reads, expected, 0.1),
            "{} nodes: {reads} server reads/s, expected {expected}",
            f.n
        );
        let client_reads = f.per_class("per idle second", "master", false, OpClass::Read);
        assert!(
            close(client_reads, 1.0 + arrived(f.n) + read_back, 0.05),
            "{} nodes: {client_reads} client reads/s",
            f.n
        );
    }
    let table = ops_table(&f, s);
    assert!(
        table.contains("per idle second") && table.lines().count() > 10,
        "{table}"
    );
}
