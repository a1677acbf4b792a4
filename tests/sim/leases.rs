//! Dynamic rollouts: items claimed by leases, taken over from dead nodes, backed up when
//! slow, with the node's own machines.
//!
//! N nodes share a pool of items (`work.mode = "dynamic"`), each running up to
//! `max-workers` at a time. Each simulated node is the node's own `PoolMachine`
//! (`rl_node::protocol::pool`, which `Node::dynamic_loop` drives through the real shared
//! directory) and its own `NodeMachine` for the peers' liveness; this simulator performs
//! their effects on a simulated directory and runs the attempts they start. So the
//! procedure under test is the node's: claims in pool order by an exclusive create of the
//! lease `(item, attempt 0)`, passing claimed items and learning the holders' paces from
//! their leases, leaving the pool's last items to faster live peers for at most the core's
//! patience (`lease::take_next`), retries under the next attempt's lease, commits by a
//! rename that never replaces, and past the end of the pool every item not committed
//! awaited from a live holder, backed up once when that holder is slow
//! (`lease::backup_due`), taken over from a dead one (`lease::holder`) or claimed afresh.
//!
//! In one seed of two the nodes run at different speeds (items 1 to 4 times as long).
//! Attempts fail now and then: most are retried after a delay, some fail for good (the
//! attempt's failure marked; the item fails for good only once every attempt of it has).
//!
//! The directory is seen as an NFS client sees it. Each node has its own attribute cache
//! of the others' records and its own negative-lookup cache of item and lease names ("no
//! such file" is believed for the cache lifetime). Exclusive creates and renames are
//! decided by the server.
//!
//! Faults: up to two nodes killed (kill -9) at random ticks, and one node frozen for
//! longer than dead-after that then carries on.
//!
//! Invariants (and the machines' own, asserted at every state change):
//! - no node takes over an item from a holder that is alive: the holder was killed, or
//!   frozen for about dead-after (less what caches and heartbeat spacing can hide);
//! - every item is committed exactly once, by one attempt, or marked failed for good;
//! - an item is marked failed for good only when none of its attempts still runs on a node
//!   that may be alive (a backup's failure does not fail the first attempt's item);
//! - every run ends: every live node finishes within a bound (so no item is left to a
//!   faster peer for good: one that died or froze, or that leaves it too).

use super::Violation;
use rl_node::protocol::lease;
use rl_node::protocol::liveness::Mutation as LivenessMutation;
use rl_node::protocol::machine::{self, NodeMachine};
use rl_node::protocol::pool::{self, Claim, Effect, Exit, Input, Lease, Note, PoolMachine};
use rl_node::protocol::NodeState;
use rl_node::rng::SplitMix64 as Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// The broken variants a run may be given (never the node's): each is switched on in the
/// node's own machines.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mutations {
    pub lease: Option<lease::Mutation>,
    pub liveness: Option<LivenessMutation>,
    /// The node's end-of-pool loop as it was before the 100,000-seed run (seed 27650):
    /// a lost takeover claim did not count as waiting for a peer.
    pub lease_loss_ends_wait: bool,
    /// The node before per-attempt failure markers: its own attempt's failure for good
    /// failed the item.
    pub own_failure_fails_item: bool,
    /// The node and the scenario as they were before the speed-aware end game: every node
    /// at one speed, no paces, every free worker claims.
    pub without_end_game: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Life {
    Running,
    Frozen(u64),
    Killed,
    Done,
}

/// How an attempt's command ends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fate {
    Success,
    Retry,
    Fail,
}

/// An attempt a node runs: item, attempt, the tick its command ends, and how.
#[derive(Debug, Clone, Copy)]
struct Attempt {
    pos: usize,
    attempt: u32,
    ends: u64,
    fate: Fate,
}

struct Node {
    life: Life,
    /// The node's machines: its part in the rollout, and its liveness judgement.
    pool: PoolMachine,
    machine: NodeMachine,
    /// The commands its machine started, running.
    running: Vec<Attempt>,
    /// How much longer this node's items take (1 to 4).
    slowness: u64,
    /// Heartbeat sequence and the tick of its last beat.
    seq: u64,
    last_beat: u64,
    /// This node's cached view of the peers' heartbeat sequences: (fetched at, seq).
    seen_seq: Vec<Option<(u64, u64)>>,
    /// Negative lookups cached: name → tick of the "no such file" answer.
    missing: BTreeMap<Name, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Name {
    Item(usize),
    Lease(usize, u32),
    Failed(usize),
    AttemptFailed(usize, u32),
}

#[derive(Default)]
pub struct Summary {
    pub ticks: u64,
    pub items: u64,
    pub attempts: u64,
    pub retries: u64,
    /// Attempts that failed for good; items marked failed for good; items committed
    /// although an attempt of theirs failed for good (by a backup, a first attempt or a
    /// takeover that ran on).
    pub failed_attempts: u64,
    pub failed_items: u64,
    pub outlived: u64,
    /// Items marked failed for good behind the marking node's cache of a commit.
    pub hidden_commits: u64,
    pub takeovers: u64,
    pub backups: u64,
    /// Items a node left to faster peers (once per node and item), and of those the ones
    /// it claimed itself after all when its patience ran out.
    pub left: u64,
    pub claimed_after_leaving: u64,
    /// Attempts whose commit found the item committed by another attempt.
    pub lost_commits: u64,
    pub kills: u64,
    pub freezes: u64,
    pub checks: u64,
}

struct Sim {
    seed: u64,
    n: usize,
    items: usize,
    rng: Rng,
    /// Which attempts fail for good (none with `without_end_game`).
    fates: Rng,
    without_end_game: bool,
    tick: u64,
    lifetime: u64,
    heartbeat: u64,
    dead_after: u64,
    nodes: Vec<Node>,
    /// The server's truth: leases (item, attempt) → the lease as created, and committed
    /// items → (rank, attempt).
    leases: BTreeMap<(usize, u32), Lease>,
    committed: BTreeMap<usize, (u32, u32)>,
    /// Attempts whose failure is marked, and items marked failed for good (by whom).
    attempt_failed: BTreeSet<(usize, u32)>,
    failed: BTreeMap<usize, u32>,
    /// (node, item) of every commit that found the item committed already.
    lost: BTreeSet<(usize, usize)>,
    /// Ticks at which a node is killed, and the one long freeze: (tick, rank, length).
    kills_at: Vec<(u64, u32)>,
    freeze: Option<(u64, u32, u64)>,
    /// When each node was frozen (start, end) and killed.
    frozen_spans: Vec<Vec<(u64, u64)>>,
    trace: VecDeque<String>,
    s: Summary,
}

impl Sim {
    fn new(seed: u64, n: usize, mutations: Mutations) -> Sim {
        let mut rng = Rng::new(seed ^ 0x001E_A5E5);
        let items = n * (2 + rng.below(5) as usize);
        let max_workers = 1 + rng.below(3) as u32;
        let lifetime = [0, 2, 10, 30][rng.below(4) as usize];
        let heartbeat = 5 + rng.below(10);
        // dead-after with the documented margin over the cache lifetime and heartbeat.
        let dead_after = 2 * (lifetime + 2 * heartbeat) + 20;
        let length = (items as u64 / n as u64 + 1) * 30;
        let mut kills_at: Vec<(u64, u32)> = (0..rng.below(3))
            .map(|_| (rng.below(length), rng.below(n as u64) as u32))
            .collect();
        kills_at.sort_unstable();
        kills_at.dedup_by_key(|k| k.1);
        // Never every node: someone must finish the pool.
        kills_at.truncate(n - 1);
        let freeze = (rng.below(3) == 0).then(|| {
            let at = rng.below(length);
            let rank = rng.below(n as u64) as u32;
            (at, rank, dead_after * (2 + rng.below(3)))
        });
        // Speeds from a stream of their own, so a seed without them runs as it did before.
        let mut speeds = Rng::new(seed ^ 0x5BEED5);
        let unequal = !mutations.without_end_game && speeds.below(2) == 0;
        let nodes = (0..n)
            .map(|r| Node {
                slowness: if unequal { 1 + speeds.below(4) } else { 1 },
                pool: PoolMachine::new(pool::Settings {
                    rank: r as u32,
                    num_nodes: n as u32,
                    gen: 1,
                    nonce: format!("sim-{r}"),
                    items,
                    workers: max_workers,
                    poll_interval: Duration::from_millis(1),
                })
                .with_mutations(pool::Mutations {
                    judge: mutations.lease,
                    lost_claim_ends_wait: mutations.lease_loss_ends_wait,
                    without_end_game: mutations.without_end_game,
                    own_failure_fails_item: mutations.own_failure_fails_item,
                }),
                machine: NodeMachine::new(machine::Settings {
                    rank: r as u32,
                    num_nodes: n as u32,
                    host: format!("sim-{r}"),
                    cluster: None,
                    heartbeat_interval: Duration::from_millis(heartbeat),
                    dead_after: Duration::from_millis(dead_after),
                    topology: rl_node::protocol::topology::Topology::flat(n as u32),
                    members: None,
                })
                .with_mutations(machine::Mutations {
                    liveness: mutations.liveness,
                    ..Default::default()
                }),
                life: Life::Running,
                running: vec![],
                seq: 0,
                last_beat: 0,
                seen_seq: vec![None; n],
                missing: BTreeMap::new(),
            })
            .collect();
        Sim {
            seed,
            n,
            items,
            rng,
            fates: Rng::new(seed ^ 0xFA7E),
            without_end_game: mutations.without_end_game,
            tick: 0,
            lifetime,
            heartbeat,
            dead_after,
            nodes,
            leases: BTreeMap::new(),
            committed: BTreeMap::new(),
            attempt_failed: BTreeSet::new(),
            failed: BTreeMap::new(),
            lost: BTreeSet::new(),
            kills_at,
            freeze,
            frozen_spans: vec![vec![]; n],
            trace: VecDeque::new(),
            s: Summary {
                items: items as u64,
                ..Summary::default()
            },
        }
    }

    fn note(&mut self, line: String) {
        if self.trace.len() == 40 {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("t={} {line}", self.tick));
    }

    fn violation(&self, what: String) -> Violation {
        Violation {
            seed: self.seed,
            what,
            trace: self.trace.iter().cloned().collect(),
        }
    }

    fn now(&self) -> Duration {
        Duration::from_millis(self.tick)
    }

    /// Does `name` exist, as node `r` finds it: a cached "no such file" younger than the
    /// cache lifetime is believed.
    fn exists(&mut self, r: usize, name: Name) -> bool {
        if let Some(&at) = self.nodes[r].missing.get(&name) {
            if self.tick - at < self.lifetime {
                return false;
            }
        }
        let there = match name {
            Name::Item(pos) => self.committed.contains_key(&pos),
            Name::Lease(pos, a) => self.leases.contains_key(&(pos, a)),
            Name::Failed(pos) => self.failed.contains_key(&pos),
            Name::AttemptFailed(pos, a) => self.attempt_failed.contains(&(pos, a)),
        };
        if there {
            self.nodes[r].missing.remove(&name);
        } else {
            self.nodes[r].missing.insert(name, self.tick);
        }
        there
    }

    /// Exclusive create of a lease: decided by the server.
    fn claim(&mut self, r: usize, pos: usize, lease: Lease) -> bool {
        let attempt = lease.attempt;
        if self.leases.contains_key(&(pos, attempt)) {
            return false;
        }
        self.leases.insert((pos, attempt), lease);
        self.nodes[r].missing.remove(&Name::Lease(pos, attempt));
        true
    }

    /// Item `pos`'s lease of `attempt` as node `r` reads it (past its lookup cache).
    fn read_lease(&mut self, r: usize, pos: usize, attempt: u32) -> Option<Lease> {
        self.exists(r, Name::Lease(pos, attempt))
            .then(|| self.leases[&(pos, attempt)].clone())
    }

    /// The leases of an item as node `r` finds them: attempts 0, 1, … until a name is (or
    /// is believed) missing.
    fn leases_of(&mut self, r: usize, pos: usize) -> Vec<Lease> {
        (0..)
            .map_while(|attempt| self.read_lease(r, pos, attempt))
            .collect()
    }

    fn start(&mut self, r: usize, pos: usize, attempt: u32) {
        let ends = self.tick + (5 + self.rng.below(40)) * self.nodes[r].slowness;
        // Failures for good from a stream of their own, and none in the scenario as it was
        // before the end game: a seed's schedule stays what it was before them.
        let fate = match (self.rng.below(12), self.fates.below(15)) {
            (0, _) => Fate::Retry,
            (_, 0) if !self.without_end_game => Fate::Fail,
            _ => Fate::Success,
        };
        self.nodes[r].running.push(Attempt {
            pos,
            attempt,
            ends,
            fate,
        });
        self.s.attempts += 1;
    }

    /// Read every peer's record through node `r`'s attribute cache and have its machine
    /// judge them: the ranks it finds dead.
    fn judge_peers(&mut self, r: usize) -> BTreeSet<u32> {
        let now = self.now();
        let mut reads = Vec::with_capacity(self.n);
        for q in 0..self.n {
            if q == r {
                continue;
            }
            let seq = match self.nodes[r].seen_seq[q] {
                Some((at, seq)) if self.tick - at < self.lifetime => seq,
                _ => {
                    let seq = self.nodes[q].seq;
                    self.nodes[r].seen_seq[q] = Some((self.tick, seq));
                    seq
                }
            };
            reads.push((q as u32, Some((seq, NodeState::Running)), now));
        }
        self.nodes[r].machine.judge_peers(reads).clone()
    }

    /// Was `holder` stopped long enough that a judge could rightly find it dead now? Its
    /// heartbeat has been still for dead-after, less what the cache lifetime and the
    /// heartbeat spacing can hide; or it was, in a freeze that ended so recently that a
    /// cached record may not show its new heartbeats yet.
    fn may_be_dead(&self, holder: u32) -> bool {
        let h = &self.nodes[holder as usize];
        if h.life == Life::Killed {
            return true;
        }
        let hidden = self.lifetime + 2 * self.heartbeat;
        let long_enough = |silent: u64| silent + hidden >= self.dead_after;
        long_enough(self.tick - h.last_beat)
            || self.frozen_spans[holder as usize]
                .iter()
                .any(|&(from, to)| long_enough(to - from) && self.tick < to + hidden)
    }

    /// One turn of node `r`: the exits of its attempts that ended, handed to its machine,
    /// then one round of its machine (`Node::dynamic_loop`'s).
    fn round(&mut self, r: usize) -> Result<(), Violation> {
        let tick = self.tick;
        let ended: Vec<Attempt> = self.nodes[r]
            .running
            .iter()
            .copied()
            .filter(|a| a.ends <= tick)
            .collect();
        self.nodes[r].running.retain(|a| a.ends > tick);
        for a in ended {
            let exit = match a.fate {
                Fate::Retry => {
                    self.s.retries += 1;
                    Exit::Retry {
                        after: Duration::from_millis(3 + self.rng.below(10)),
                    }
                }
                Fate::Fail => Exit::Failed {
                    why: "exit code 3".into(),
                },
                Fate::Success => Exit::Success,
            };
            let input = Input::Exited {
                pos: a.pos,
                attempt: a.attempt,
                exit,
            };
            let now = self.now();
            self.nodes[r].pool.handle(now, input);
            self.perform(r)?;
        }
        let now = self.now();
        self.nodes[r].pool.tick(now);
        self.perform(r)?;
        if self.nodes[r].pool.finished() {
            self.nodes[r].life = Life::Done;
            self.note(format!("rank {r} is done"));
        }
        Ok(())
    }

    /// Perform node `r`'s machine's effects on the simulated directory, as the node's
    /// driver (`Node::drive_pool`) performs them on the real one.
    fn perform(&mut self, r: usize) -> Result<(), Violation> {
        while let Some(effect) = self.nodes[r].pool.poll_effect() {
            let answer = match effect {
                Effect::ReadFirstLease(pos) => Input::FirstLease(self.read_lease(r, pos, 0)),
                Effect::ReadLeases(pos) => Input::Leases(self.leases_of(r, pos)),
                Effect::LookCommitted(pos) => Input::Committed(self.exists(r, Name::Item(pos))),
                Effect::LookFailed(pos) => Input::Failed(self.exists(r, Name::Failed(pos))),
                Effect::LookAttemptFailed { pos, attempt } => {
                    Input::AttemptFailed(self.exists(r, Name::AttemptFailed(pos, attempt)))
                }
                Effect::JudgePeers => Input::Peers(self.judge_peers(r)),
                Effect::CreateLease { pos, claim, lease } => {
                    if let Claim::TakeOver { holder } = claim {
                        self.check_takeover(r, pos, holder)?;
                    }
                    Input::LeaseCreated(self.claim(r, pos, lease))
                }
                Effect::Commit { pos, attempt } => Input::CommitDone(self.commit(r, pos, attempt)),
                Effect::Start { pos, attempt } => {
                    self.start(r, pos, attempt);
                    continue;
                }
                Effect::Stop { pos, attempt } => {
                    self.nodes[r]
                        .running
                        .retain(|a| (a.pos, a.attempt) != (pos, attempt));
                    continue;
                }
                Effect::Discard { .. } => continue,
                Effect::MarkAttemptFailed { pos, attempt, .. } => {
                    self.s.failed_attempts += 1;
                    self.attempt_failed.insert((pos, attempt));
                    self.nodes[r]
                        .missing
                        .remove(&Name::AttemptFailed(pos, attempt));
                    self.note(format!(
                        "rank {r}'s attempt {attempt} of item {pos} failed for good"
                    ));
                    continue;
                }
                Effect::MarkFailed { pos, why, .. } => {
                    self.check_failed(r, pos, &why)?;
                    let won = !self.failed.contains_key(&pos);
                    self.failed.entry(pos).or_insert(r as u32);
                    self.nodes[r].missing.remove(&Name::Failed(pos));
                    Input::MarkedFailed(won)
                }
                Effect::Note(note) => {
                    self.note(match note {
                        Note::Backup { pos, holder } => {
                            format!("rank {r} backs up item {pos} of rank {holder}")
                        }
                        Note::TakeOver {
                            pos,
                            holder,
                            attempt,
                        } => format!(
                            "rank {r} takes over item {pos} from rank {holder} (attempt {attempt})"
                        ),
                        Note::Left { pos, unclaimed } => format!(
                            "rank {r} leaves item {pos} to faster peers ({unclaimed} unclaimed)"
                        ),
                    });
                    continue;
                }
            };
            let now = self.now();
            self.nodes[r].pool.handle(now, answer);
        }
        Ok(())
    }

    /// Node `r` takes over item `pos` from `holder`: only from itself or from a holder
    /// that may be dead.
    fn check_takeover(&mut self, r: usize, pos: usize, holder: u32) -> Result<(), Violation> {
        self.s.checks += 1;
        if holder == r as u32 || self.may_be_dead(holder) {
            return Ok(());
        }
        Err(self.violation(format!(
            "rank {r} took over item {pos} from rank {holder}, which is alive (last heartbeat {} ticks ago; dead-after {}, cache {}, heartbeat {})",
            self.tick - self.nodes[holder as usize].last_beat,
            self.dead_after,
            self.lifetime,
            self.heartbeat
        )))
    }

    /// Node `r` marks item `pos` failed for good: only when no attempt of it runs on a node
    /// that may be alive, and it is not committed (unless `r`'s negative-lookup cache
    /// still hides the commit: a takeover of a holder that committed just before it died
    /// can fail for good, and then counts a failure for an item that is committed).
    fn check_failed(&mut self, r: usize, pos: usize, why: &str) -> Result<(), Violation> {
        self.s.checks += 1;
        if let Some(&(by, attempt)) = self.committed.get(&pos) {
            // A node whose own commit of the item lost knows it is committed.
            let hidden = !self.lost.contains(&(r, pos))
                && (self.nodes[r].missing.get(&Name::Item(pos)))
                    .is_some_and(|&at| self.tick - at < self.lifetime);
            if !hidden {
                return Err(self.violation(format!(
                    "rank {r} marks item {pos} failed for good ({why}), committed by rank {by}'s attempt {attempt}"
                )));
            }
            self.s.hidden_commits += 1;
        }
        let running = (0..self.n).find_map(|q| {
            let a = self.nodes[q].running.iter().find(|a| a.pos == pos)?;
            let alive = self.nodes[q].life != Life::Killed && !self.may_be_dead(q as u32);
            alive.then_some((q, a.attempt))
        });
        match running {
            Some((q, attempt)) => Err(self.violation(format!(
                "rank {r} marks item {pos} failed for good ({why}) while rank {q}'s attempt {attempt} of it runs"
            ))),
            None => {
                self.note(format!("rank {r} marks item {pos} failed for good ({why})"));
                Ok(())
            }
        }
    }

    /// A rename that never replaces: the first commit wins.
    fn commit(&mut self, r: usize, pos: usize, attempt: u32) -> bool {
        if let Some(&(by, att)) = self.committed.get(&pos) {
            self.s.lost_commits += 1;
            self.lost.insert((r, pos));
            self.note(format!(
                "rank {r}'s attempt {attempt} of item {pos} finds it committed by rank {by} (attempt {att})"
            ));
            return false;
        }
        self.committed.insert(pos, (r as u32, attempt));
        self.nodes[r].missing.remove(&Name::Item(pos));
        self.note(format!("rank {r} commits item {pos} (attempt {attempt})"));
        true
    }

    fn run(mut self) -> Result<Summary, Violation> {
        // The scheduler gives each node a round about every n ticks, and an attempt takes
        // up to 45 ticks (times the slowest node's slowness): a node's share of the pool
        // takes about (share + 1) rounds of (45 + 2n) ticks. Allow four times that, the
        // share of every killed node again, dead-after four times over, and the freeze.
        // (An item left to faster peers waits at most one item time of its leaver.)
        let n = self.n as u64;
        let slowest = self.nodes.iter().map(|n| n.slowness).max().unwrap_or(1);
        let share = (self.items as u64 / n + 1) * (45 * slowest + 2 * n);
        let bound = 4 * share
            + (self.kills_at.len() as u64) * 4 * share
            + self.dead_after * 4
            + self.freeze.map_or(0, |f| f.2);
        loop {
            self.tick += 1;
            if self.tick > bound {
                return Err(self.unfinished(bound));
            }
            self.faults();
            self.heartbeats();
            let runnable: Vec<usize> = (0..self.n)
                .filter(|&r| self.nodes[r].life == Life::Running)
                .collect();
            if runnable.is_empty() {
                // Done, unless a frozen node is still to wake up.
                if self.nodes.iter().any(|n| matches!(n.life, Life::Frozen(_))) {
                    continue;
                }
                break;
            }
            let r = runnable[self.rng.below(runnable.len() as u64) as usize];
            self.round(r)?;
        }
        // The end: every item committed once, or failed for good.
        self.s.checks += self.items as u64;
        for pos in 0..self.items {
            if !self.committed.contains_key(&pos) && !self.failed.contains_key(&pos) {
                return Err(self.violation(format!(
                    "item {pos} was never committed nor marked failed, yet every live node finished"
                )));
            }
        }
        self.s.failed_items = self.failed.len() as u64;
        self.s.outlived = (self.committed.keys())
            .filter(|&&pos| {
                self.attempt_failed
                    .range((pos, 0)..=(pos, u32::MAX))
                    .next()
                    .is_some()
            })
            .count() as u64;
        for node in &self.nodes {
            let st = node.pool.stats();
            self.s.takeovers += st.takeovers as u64;
            self.s.backups += st.backups as u64;
            self.s.left += st.left as u64;
            self.s.claimed_after_leaving += st.claimed_after_leaving as u64;
        }
        self.s.ticks = self.tick;
        Ok(self.s)
    }

    fn unfinished(&self, bound: u64) -> Violation {
        let states: Vec<String> = (0..self.n)
            .map(|r| {
                let n = &self.nodes[r];
                format!(
                    "rank {r}: {:?}, running {:?}, dead {:?}",
                    n.life, n.running, n.machine.dead_peers
                )
            })
            .collect();
        self.violation(format!(
            "the dynamic rollout did not end within {bound} ticks ({} of {} items committed); the nodes:\n  {}",
            self.committed.len(),
            self.items,
            states.join("\n  ")
        ))
    }

    /// Kills and the freeze due now.
    fn faults(&mut self) {
        while self.kills_at.first().is_some_and(|k| k.0 <= self.tick) {
            let (_, r) = self.kills_at.remove(0);
            if matches!(self.nodes[r as usize].life, Life::Running | Life::Frozen(_)) {
                self.nodes[r as usize].life = Life::Killed;
                self.s.kills += 1;
                self.note(format!("rank {r} killed (kill -9)"));
            }
        }
        if let Some((at, r, len)) = self.freeze {
            if at <= self.tick {
                self.freeze = None;
                if self.nodes[r as usize].life == Life::Running {
                    self.nodes[r as usize].life = Life::Frozen(self.tick + len);
                    self.frozen_spans[r as usize].push((self.tick, self.tick + len));
                    self.s.freezes += 1;
                    self.note(format!("rank {r} frozen for {len} ticks"));
                }
            }
        }
    }

    /// Heartbeats of running nodes (a frozen or killed node's stop).
    fn heartbeats(&mut self) {
        for r in 0..self.n {
            let node = &mut self.nodes[r];
            if let Life::Frozen(until) = node.life {
                if until <= self.tick {
                    node.life = Life::Running;
                }
            }
            if matches!(node.life, Life::Running | Life::Done)
                && self.tick - node.last_beat >= self.heartbeat
            {
                node.seq += 1;
                node.last_beat = self.tick;
            }
        }
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
        Sim::new(seed, n, mutations).run()
    })
}

impl std::ops::AddAssign for Summary {
    fn add_assign(&mut self, o: Summary) {
        self.ticks += o.ticks;
        self.items += o.items;
        self.attempts += o.attempts;
        self.retries += o.retries;
        self.failed_attempts += o.failed_attempts;
        self.failed_items += o.failed_items;
        self.outlived += o.outlived;
        self.hidden_commits += o.hidden_commits;
        self.takeovers += o.takeovers;
        self.backups += o.backups;
        self.left += o.left;
        self.claimed_after_leaving += o.claimed_after_leaving;
        self.lost_commits += o.lost_commits;
        self.kills += o.kills;
        self.freezes += o.freezes;
        self.checks += o.checks;
    }
}

impl Summary {
    /// Faults injected: kills and long freezes.
    pub fn faults(&self) -> u64 {
        self.kills + self.freezes
    }

    pub fn line(&self) -> String {
        format!(
            "{} ticks, {} items in {} attempts ({} retries, {} takeovers, {} backups, {} commits lost to an earlier one); {} attempts failed for good, {} items failed for good, {} items committed although an attempt failed for good ({} marked failed behind a cached miss of their commit); end game: {} items left to faster peers, {} of them claimed after all; faults: {} kills (-9), {} long freezes; {} invariant checks",
            self.ticks,
            self.items,
            self.attempts,
            self.retries,
            self.takeovers,
            self.backups,
            self.lost_commits,
            self.failed_attempts,
            self.failed_items,
            self.outlived,
            self.hidden_commits,
            self.left,
            self.claimed_after_leaving,
            self.kills,
            self.freezes,
            self.checks
        )
    }
}

#[test]
fn a_thousand_seeds_of_dynamic_rollouts_keep_the_invariants() {
    match sweep(1, 1_000, 16, Mutations::default()) {
        Ok(s) => {
            assert!(
                s.kills > 300
                    && s.failed_items > 100
                    && s.outlived > 100
                    && s.takeovers > 100
                    && s.backups > 100
                    && s.left > 100
                    && s.claimed_after_leaving > 10,
                "{}",
                s.line()
            );
        }
        Err(v) => panic!("{v}"),
    }
}

#[test]
fn the_same_lease_seed_replays_the_same_run() {
    super::assert_replays(5, |seed| {
        Sim::new(seed, 8, Mutations::default())
            .run()
            .map(|s| s.line())
    });
}

fn caught(m: Mutations) -> Violation {
    super::caught(|first, seeds, nodes| sweep(first, seeds, nodes, m))
}

/// The simulator has teeth: a judge that never takes over a dead node's items leaves
/// the rollout unfinished …
#[test]
fn a_judge_that_trusts_dead_holders_is_caught() {
    let v = caught(Mutations {
        lease: Some(lease::Mutation::TrustEveryHolder),
        ..Mutations::default()
    });
    assert!(v.what.contains("did not end"), "{v}");
}

/// … an end game without patience leaves an item to a faster peer that died, froze or
/// leaves it too, for good …
#[test]
fn an_end_game_without_patience_is_caught() {
    let v = caught(Mutations {
        lease: Some(lease::Mutation::LeaveForever),
        ..Mutations::default()
    });
    assert!(v.what.contains("did not end"), "{v}");
}

/// … a node whose own attempt's failure fails the item marks it while another attempt
/// (the first, or its backup) runs on …
#[test]
fn an_attempts_failure_failing_its_item_is_caught() {
    let v = caught(Mutations {
        own_failure_fails_item: true,
        ..Mutations::default()
    });
    assert!(
        v.what.contains("failed for good") && v.what.contains("runs"),
        "{v}"
    );
}

/// … and an impatient liveness judge takes over a live node's item.
#[test]
fn an_impatient_takeover_is_caught() {
    let v = caught(Mutations {
        liveness: Some(LivenessMutation::Impatient),
        ..Mutations::default()
    });
    assert!(v.what.contains("which is alive"), "{v}");
}

/// The 100,000-seed run found that a node whose takeover claim lost (another node had
/// taken the item over first, behind this node's negative-lookup cache) finished its pool
/// without waiting for the taker; when the taker died too, the item was never committed.
/// The node now waits for it. The old loop is still caught on that seed; the new one
/// passes it.
#[test]
fn a_lost_takeover_claim_is_waited_for() {
    // The schedule of that seed as it was then, before the speed-aware end game.
    let then = Mutations {
        without_end_game: true,
        ..Mutations::default()
    };
    let old = Mutations {
        lease_loss_ends_wait: true,
        ..then
    };
    let v = sweep(27650, 1, 64, old)
        .err()
        .expect("the old loop is caught");
    assert!(v.what.contains("never committed"), "{v}");
    sweep(27650, 1, 64, then).unwrap_or_else(|v| panic!("{v}"));
    sweep(27650, 1, 64, Mutations::default()).unwrap_or_else(|v| panic!("{v}"));
}

/// Found by the first sweep with failures for good (20,000 seeds of up to 64 nodes): rank
/// 20's takeover of item 6 (its holder, rank 15, committed it just before it died) lost
/// its commit, as it should; but the item's next look went through rank 20's stale
/// negative-lookup cache, which said "not committed", so rank 20 took the item for failed
/// (its own attempt over, the dead holder's before it) and marked a committed item failed
/// for good. A lost commit, like a stopped or discarded attempt, now settles the item for
/// the node that learned of it.
#[test]
fn seed_10968_an_item_whose_commit_was_lost_here_is_not_marked_failed() {
    sweep(10968, 1, 64, Mutations::default()).unwrap_or_else(|v| panic!("{v}"));
}
