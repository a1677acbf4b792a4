//! `PoolMachine`: one node's part in one dynamic rollout (`work.mode = "dynamic"`) as a
//! sans-I/O state machine, in the style of [`super::machine::NodeMachine`]. It owns the
//! procedure the node runs over the pool (which item to claim next, the attempts running
//! here, the retries due, the items awaited from peers, the peers' paces, what it
//! committed) and judges with [`super::lease`]; the driver performs what it asks on the
//! shared directory and the launcher and hands back what happened.
//!
//! A round ([`PoolMachine::tick`]) goes as the node always went: retries whose backoff
//! passed are claimed under the next attempt's lease; the pool's next items are claimed in
//! order (an item with a lease is passed, learning its holder's pace; the last ones may be
//! left to faster live peers); attempts that finished are committed by a rename that never
//! replaces; attempts whose item another attempt committed are stopped; and past the end
//! of the pool every item not committed is awaited from its live holder, backed up when
//! that holder is slow, taken over from a dead one, or claimed afresh. Each question
//! (does a file exist, what does a lease say, who is dead, who won a create) is one
//! [`Effect`] answered by one [`Input`] before the round goes on, so a driver performs
//! them in order. Between rounds the driver waits for an attempt to exit
//! ([`Input::Exited`]) or for [`PoolMachine::poll_timeout`].
//!
//! The node (`Node::dynamic_loop`) drives it through the real shared directory and the
//! simulator (tests/sim/leases.rs) drives the same machine over its simulated one, with
//! the peers' liveness judged by the node's own [`super::machine::NodeMachine`] in both.
//! Every state change checks the machine's invariants in debug builds and in the
//! simulator ([`PoolMachine::assert_invariants`]).

use super::lease::{self, Holder, Pace, Take};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

/// A lease as its creator writes it (`leases/pNNNNN.gG.aA`, a live record). Fields in the
/// order of the JSON object (sorted keys). Read from an untrusted directory: whatever a
/// file holds becomes a `Lease` with the same fallbacks the node always had (a rank that
/// is not a number is `u32::MAX`, nobody's; `workers` defaults to 1), and never a panic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "Value")]
pub struct Lease {
    pub attempt: u32,
    pub gen: u64,
    /// Its creator's mean item time so far, in milliseconds (`null` before its first).
    pub item_ms: Option<f64>,
    pub nonce: String,
    pub rank: u32,
    /// Items its creator runs at once (`work.max-workers`).
    pub workers: u32,
}

impl From<Value> for Lease {
    fn from(v: Value) -> Lease {
        Lease {
            attempt: v["attempt"]
                .as_u64()
                .map_or(0, |a| a.min(u64::from(u32::MAX)) as u32),
            gen: v["gen"].as_u64().unwrap_or(0),
            item_ms: v["item_ms"].as_f64(),
            nonce: v["nonce"].as_str().unwrap_or_default().to_string(),
            // Truncated as the node always did: only a real rank matters.
            rank: v["rank"].as_u64().unwrap_or(u64::MAX) as u32,
            workers: v["workers"].as_u64().unwrap_or(1).min(u64::from(u32::MAX)) as u32,
        }
    }
}

impl Lease {
    /// The pace its creator published: none without a positive, finite, representable
    /// item time.
    pub fn pace(&self) -> Option<Pace> {
        let ms = self.item_ms.filter(|ms| ms.is_finite() && *ms > 0.0)?;
        let item = Duration::try_from_secs_f64(ms / 1000.0).ok()?;
        Some(Pace {
            item,
            workers: self.workers,
        })
    }
}

/// What a machine is set up with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub rank: u32,
    /// Ranks in the cluster: a lease naming any other is nobody's, and is taken over.
    pub num_nodes: u32,
    pub gen: u64,
    pub nonce: String,
    /// Items in the pool.
    pub items: usize,
    /// Attempts this node runs at once (`work.max-workers`).
    pub workers: u32,
    /// The longest time between two rounds.
    pub poll_interval: Duration,
}

/// Why a lease is created: what a won create starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Attempt 0 of an item nobody holds.
    First,
    /// The next attempt after a retryable exit here.
    Retry,
    /// A backup of a slow live holder's first attempt.
    Backup { holder: u32 },
    /// A takeover from a dead holder (or from this node, with no attempt running).
    TakeOver { holder: u32 },
}

/// How an attempt ended, as the driver judged its exit.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    Success,
    /// A retryable exit: the next attempt after `after`.
    Retry {
        after: Duration,
    },
    /// Failed for good.
    Failed {
        why: String,
    },
}

/// What the machine asks the driver to do. The questions (reads, exclusive creates, the
/// commit) are answered by the one [`Input`] named; the others are answered by nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Read item `0`'s attempt-0 lease: [`Input::FirstLease`].
    ReadFirstLease(usize),
    /// Read item `0`'s leases, attempt 0, 1, … up to the first missing or unreadable one:
    /// [`Input::Leases`], in attempt order.
    ReadLeases(usize),
    /// Does item `0`'s committed file exist: [`Input::Committed`].
    LookCommitted(usize),
    /// Does item `0`'s failed-for-good marker exist: [`Input::Failed`].
    LookFailed(usize),
    /// Does the marker of this attempt's failure exist: [`Input::AttemptFailed`].
    LookAttemptFailed { pos: usize, attempt: u32 },
    /// Read every peer's record and judge their liveness: [`Input::Peers`].
    JudgePeers,
    /// Create this lease exclusively (first creator wins): [`Input::LeaseCreated`].
    CreateLease {
        pos: usize,
        claim: Claim,
        lease: Lease,
    },
    /// Start this attempt (its lease is held); its exit comes back as [`Input::Exited`].
    Start { pos: usize, attempt: u32 },
    /// Stop this attempt and remove its output: another attempt committed the item.
    Stop { pos: usize, attempt: u32 },
    /// Commit this finished attempt's output by a rename that never replaces:
    /// [`Input::CommitDone`].
    Commit { pos: usize, attempt: u32 },
    /// Remove this finished attempt's output: another attempt committed the item first.
    Discard { pos: usize, attempt: u32 },
    /// Create the marker of this attempt's failure for good: the attempt is over, and the
    /// item's other attempts go on (a retry needs none: its next lease says it). Best
    /// effort, answered by nothing.
    MarkAttemptFailed {
        pos: usize,
        attempt: u32,
        why: String,
    },
    /// Every attempt of the item is over without a commit: create its failed-for-good
    /// marker exclusively, so nobody waits for it: [`Input::MarkedFailed`]. `attempt`
    /// is this node's attempt whose failure it is (its log is here), if one of them is.
    MarkFailed {
        pos: usize,
        attempt: Option<u32>,
        why: String,
    },
    /// Something worth saying.
    Note(Note),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    /// A backup attempt of a slow live holder's item started.
    Backup { pos: usize, holder: u32 },
    /// A dead holder's item is taken over.
    TakeOver {
        pos: usize,
        holder: u32,
        attempt: u32,
    },
    /// The pool's next item is left to faster peers (said once per item).
    Left { pos: usize, unclaimed: usize },
}

/// What happened, as the driver tells the machine.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// The attempt-0 lease, if one could be read.
    FirstLease(Option<Lease>),
    /// The item's leases in this generation, attempt 0 first.
    Leases(Vec<Lease>),
    Committed(bool),
    Failed(bool),
    AttemptFailed(bool),
    /// Whether this node's create of the failed-for-good marker won (an error creating it
    /// counts as won: a failure is never lost).
    MarkedFailed(bool),
    /// The ranks judged dead now (the node's `NodeMachine::judge_peers`).
    Peers(BTreeSet<u32>),
    /// Whether the exclusive create won.
    LeaseCreated(bool),
    /// Whether the rename committed the item (else another attempt's commit stands).
    CommitDone(bool),
    /// An attempt started by [`Effect::Start`] exited.
    Exited {
        pos: usize,
        attempt: u32,
        exit: Exit,
    },
}

/// What a round has found so far, for the summary and the simulator's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Items this node committed.
    pub mine: usize,
    pub backups: usize,
    pub takeovers: usize,
    /// Items left to faster peers (once each), and of those, claimed here after all.
    pub left: usize,
    pub claimed_after_leaving: usize,
    /// Finished attempts whose item another attempt committed first.
    pub lost_commits: usize,
    pub retries: usize,
    /// Attempts that failed for good here.
    pub failed_attempts: usize,
    /// Items this node found failed for good (every attempt over without a commit) and
    /// marked so: each item is counted by one node.
    pub failed: usize,
}

/// Deliberately broken variants, for showing that the simulator catches them (`sim`
/// feature only; see [`super::mutation`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Mutations {
    pub judge: Option<lease::Mutation>,
    /// The node before the 100,000-seed run (seed 27650): a lost takeover or fresh claim
    /// in the end game did not count as waiting for the peer that won it.
    pub lost_claim_ends_wait: bool,
    /// The node before the speed-aware end game: no paces in the leases, every free
    /// worker claims.
    pub without_end_game: bool,
    /// The node before per-attempt failure markers: an attempt of its own that failed
    /// for good fails the item, whatever other attempt (a backup, the first) still runs.
    pub own_failure_fails_item: bool,
}

/// Where a round is: the step, and the question it waits for the answer to.
#[derive(Debug, Clone)]
enum Step {
    /// Between rounds.
    Idle,
    /// Claiming due retries: the head's create is asked.
    Retries(VecDeque<(usize, u32)>),
    /// The claim loop at the cursor.
    Claim(ClaimAt),
    /// Committing `finished`: looking whether its head is committed, or renaming it.
    Commit { renaming: bool },
    /// Looking whether these running attempts' items were committed elsewhere.
    Superseded(VecDeque<(usize, u32)>),
    /// The end of the pool, at item `pos`.
    EndGame { pos: usize, at: EndAt },
}

#[derive(Debug, Clone, Copy)]
enum ClaimAt {
    Next,
    Lease,
    Committed,
    /// Judging the peers before leaving the item (waiting since `since`).
    Peers {
        since: Duration,
    },
    Create {
        pos: usize,
    },
}

#[derive(Debug, Clone)]
enum EndAt {
    Peers,
    Item,
    Committed,
    Failed,
    Leases,
    /// Looking whether `attempt` of these leases failed.
    AttemptFailed {
        leases: Vec<Lease>,
        attempt: u32,
    },
    Create {
        attempt: u32,
        claim: Claim,
    },
    Marking,
}

/// What a step does next.
enum Flow {
    /// Go on to this step at once.
    Go(Step),
    /// Ask this question and wait in this step for its answer.
    Ask(Step, Effect),
    /// The round is over.
    Rest,
}

/// What settles a wait between two rounds ([`PoolMachine::looks`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Looks {
    /// Items awaited from peers: committed or marked failed by anyone.
    pub settle: Vec<usize>,
    /// Items running here: committed by another rank (the round stops this node's
    /// attempt). A failed marker does not settle them: this node's attempt runs on and
    /// may still commit the item (a backup of a holder whose attempt failed for good).
    pub superseding: Vec<usize>,
    /// The item left to faster peers: claimed (its attempt-0 lease created).
    pub leaving: Option<usize>,
}

/// One node's part in one dynamic rollout (see the module documentation).
#[derive(Debug)]
pub struct PoolMachine {
    cfg: Settings,
    step: Step,
    now: Duration,
    /// The next position of the pool to claim, in pool order.
    cursor: usize,
    /// Attempts running here: (item, attempt) → started at.
    running: BTreeMap<(usize, u32), Duration>,
    /// Every attempt this node started (an attempt of this rank's it did not start is a
    /// lease someone else wrote with its rank: nobody's).
    started: BTreeSet<(usize, u32)>,
    /// This node's attempts that failed for good, by item: the last one and why.
    gave_up: BTreeMap<usize, (u32, String)>,
    /// Retryable exits waiting for their backoff: (ready at, item, next attempt).
    delayed: Vec<(Duration, usize, u32)>,
    /// Attempts that exited 0, committed in the next round after the next claims.
    finished: VecDeque<(usize, u32)>,
    /// Items this node committed.
    committed: BTreeSet<usize>,
    /// Items this node learned another attempt committed (its own commit found the name
    /// taken, or a look stopped or discarded its attempt): never looked at again, as a
    /// look through a stale negative-lookup cache could say they are not.
    committed_elsewhere: BTreeSet<usize>,
    /// Times of this node's attempts, start to exit.
    item_times: Vec<Duration>,
    /// The peers' paces as their leases published them.
    paces: HashMap<u32, Pace>,
    /// The peers judged dead at the last look.
    dead: BTreeSet<u32>,
    /// The item left to faster peers and since when, and when to look at it again.
    left: Option<(usize, Duration)>,
    recheck: Option<Duration>,
    /// End game: when each live holder's item was first seen held.
    first_seen: HashMap<usize, Duration>,
    /// End game: the items awaited from peers this round, and the fastest pace of the
    /// live holders awaited.
    awaited: Vec<usize>,
    awaited_pace: Option<Duration>,
    /// End game: when the first awaited first attempt becomes due for a backup.
    backup_at: Option<Duration>,
    /// The round ended with nothing running, due, or awaited, past the end of the pool.
    done: bool,
    stats: Stats,
    effects: VecDeque<Effect>,
    mutations: Mutations,
}

/// The shortest time between two looks at the items a node awaits from its peers (each
/// look reads every peer's record and the leases of the items not committed yet).
const AWAITED_LOOK_MIN: Duration = Duration::from_millis(2);

impl PoolMachine {
    pub fn new(cfg: Settings) -> PoolMachine {
        PoolMachine {
            cfg,
            step: Step::Idle,
            now: Duration::ZERO,
            cursor: 0,
            running: BTreeMap::new(),
            started: BTreeSet::new(),
            gave_up: BTreeMap::new(),
            delayed: Vec::new(),
            finished: VecDeque::new(),
            committed: BTreeSet::new(),
            committed_elsewhere: BTreeSet::new(),
            item_times: Vec::new(),
            paces: HashMap::new(),
            dead: BTreeSet::new(),
            left: None,
            recheck: None,
            first_seen: HashMap::new(),
            awaited: Vec::new(),
            awaited_pace: None,
            backup_at: None,
            done: false,
            stats: Stats::default(),
            effects: VecDeque::new(),
            mutations: Mutations::default(),
        }
    }

    #[doc(hidden)]
    pub fn with_mutations(mut self, m: Mutations) -> PoolMachine {
        self.mutations = super::mutation(Some(m)).unwrap_or_default();
        self
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether the last round found the rollout over for this node: past the end of the
    /// pool, nothing running, due or awaited.
    pub fn finished(&self) -> bool {
        self.done
    }

    /// Whether a round is under way (a question is waiting for its answer).
    pub fn in_round(&self) -> bool {
        !matches!(self.step, Step::Idle)
    }

    /// Attempts running here.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Items awaited from peers at the last round.
    pub fn awaited(&self) -> usize {
        self.awaited.len()
    }

    /// This node's mean item time so far.
    pub fn mean_item(&self) -> Option<Duration> {
        let n = u32::try_from(self.item_times.len())
            .ok()
            .filter(|&n| n > 0)?;
        Some(self.item_times.iter().sum::<Duration>() / n)
    }

    /// What the driver watches between rounds, so that it looks again at once when one
    /// changes. Only what a round acts on: a wake-up the round ignores would have the
    /// driver look again and again without waiting (a spin).
    pub fn looks(&self) -> Looks {
        Looks {
            settle: self.awaited.clone(),
            superseding: self.running.keys().map(|&(pos, _)| pos).collect(),
            leaving: self.recheck.map(|_| self.cursor),
        }
    }

    /// When the machine next wants a round, as a time since the node's start: a retry
    /// due, the left item's patience running out, an awaited item's backup coming due,
    /// the next look at awaited items (a quarter of their holder's pace, not under 2 ms),
    /// and at the latest the poll interval.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.done {
            return None;
        }
        let poll = self.now + self.cfg.poll_interval;
        let retry = self.delayed.iter().map(|d| d.0).min();
        let look = self
            .awaited_pace
            .map(|p| self.now + (p / 4).max(AWAITED_LOOK_MIN));
        [Some(poll), retry, self.recheck, self.backup_at, look]
            .into_iter()
            .flatten()
            .min()
    }

    /// The next thing to do, if any.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// Start a round at `now`.
    pub fn tick(&mut self, now: Duration) {
        assert!(!self.in_round(), "a round started inside a round");
        self.advance(now);
        self.done = false;
        self.recheck = None;
        self.awaited.clear();
        self.awaited_pace = None;
        self.backup_at = None;
        let (due, later): (Vec<_>, Vec<_>) = self.delayed.iter().partition(|d| d.0 <= now);
        self.delayed = later;
        let due = due.into_iter().map(|(_, pos, a)| (pos, a)).collect();
        self.run(Step::Retries(due), None);
        self.assert_invariants();
    }

    /// Something happened: the answer to the question asked, or an attempt's exit.
    pub fn handle(&mut self, now: Duration, input: Input) {
        self.advance(now);
        match input {
            Input::Exited { pos, attempt, exit } => self.exited(pos, attempt, exit),
            answer => {
                let step = std::mem::replace(&mut self.step, Step::Idle);
                assert!(
                    !matches!(step, Step::Idle),
                    "an answer outside a round: {answer:?}"
                );
                self.run(step, Some(answer));
            }
        }
        self.assert_invariants();
    }

    fn advance(&mut self, now: Duration) {
        debug_assert!(now >= self.now || cfg!(feature = "sim"), "time went back");
        self.now = self.now.max(now);
    }

    /// Run the round from `step` until it asks a question or ends.
    fn run(&mut self, mut step: Step, mut answer: Option<Input>) {
        loop {
            let flow = match step {
                Step::Idle => unreachable!("the round runs"),
                Step::Retries(q) => self.retries(q, answer.take()),
                Step::Claim(at) => self.claim(at, answer.take()),
                Step::Commit { renaming } => self.commit(renaming, answer.take()),
                Step::Superseded(q) => self.superseded(q, answer.take()),
                Step::EndGame { pos, at } => self.end_game(pos, at, answer.take()),
            };
            assert!(answer.is_none(), "an answer no step took");
            match flow {
                Flow::Go(next) => step = next,
                Flow::Ask(wait, effect) => {
                    self.effects.push_back(effect);
                    self.step = wait;
                    return;
                }
                Flow::Rest => {
                    self.step = Step::Idle;
                    self.done = self.running.is_empty()
                        && self.delayed.is_empty()
                        && self.finished.is_empty()
                        && self.cursor >= self.cfg.items
                        && self.awaited.is_empty();
                    return;
                }
            }
        }
    }

    /// This node's pace, as its leases publish it.
    fn pace(&self) -> Option<Pace> {
        if self.mutations.without_end_game {
            return None;
        }
        self.mean_item().map(|item| Pace {
            item,
            workers: self.cfg.workers,
        })
    }

    fn create(&self, pos: usize, attempt: u32, claim: Claim) -> Effect {
        Effect::CreateLease {
            pos,
            claim,
            lease: Lease {
                attempt,
                gen: self.cfg.gen,
                item_ms: self.pace().map(|p| p.item.as_secs_f64() * 1000.0),
                nonce: self.cfg.nonce.clone(),
                rank: self.cfg.rank,
                workers: self.cfg.workers,
            },
        }
    }

    fn start(&mut self, pos: usize, attempt: u32) {
        let fresh = self.running.insert((pos, attempt), self.now).is_none();
        assert!(
            fresh && self.started.insert((pos, attempt)),
            "attempt {attempt} of item {pos} started twice"
        );
        self.effects.push_back(Effect::Start { pos, attempt });
    }

    fn retries(&mut self, mut q: VecDeque<(usize, u32)>, answer: Option<Input>) -> Flow {
        if let Some(answer) = answer {
            let Input::LeaseCreated(won) = answer else {
                panic!("a retry's create answered with {answer:?}")
            };
            let (pos, attempt) = q.pop_front().expect("a retry was claimed");
            if won {
                self.start(pos, attempt);
            } else {
                // Another rank created this attempt's lease (a backup of this node's
                // first attempt, or a takeover): the retry is still owed, under the next.
                q.push_front((pos, attempt + 1));
            }
        }
        match q.front() {
            Some(&(pos, attempt)) => {
                let ask = self.create(pos, attempt, Claim::Retry);
                Flow::Ask(Step::Retries(q), ask)
            }
            None => Flow::Go(Step::Claim(ClaimAt::Next)),
        }
    }

    /// Claim new items in pool order. An item claimed already (the usual case behind
    /// faster peers) is passed by reading its lease, which says how fast its holder is;
    /// the last ones may be left to faster peers ([`lease::take_next`]).
    fn claim(&mut self, at: ClaimAt, answer: Option<Input>) -> Flow {
        let pos = self.cursor;
        let ask = |at, effect| Flow::Ask(Step::Claim(at), effect);
        match (at, answer) {
            (ClaimAt::Next, None) => {
                if self.running.len() >= self.cfg.workers as usize || pos >= self.cfg.items {
                    return Flow::Go(Step::Commit { renaming: false });
                }
                if self.mutations.without_end_game {
                    return ask(ClaimAt::Committed, Effect::LookCommitted(pos));
                }
                ask(ClaimAt::Lease, Effect::ReadFirstLease(pos))
            }
            (ClaimAt::Lease, Some(Input::FirstLease(Some(lease)))) => {
                if let (Some(p), true) = (lease.pace(), lease.rank != self.cfg.rank) {
                    self.paces.insert(lease.rank, p);
                }
                self.cursor += 1;
                Flow::Go(Step::Claim(ClaimAt::Next))
            }
            (ClaimAt::Lease, Some(Input::FirstLease(None))) => {
                ask(ClaimAt::Committed, Effect::LookCommitted(pos))
            }
            (ClaimAt::Committed, Some(Input::Committed(true))) => {
                self.cursor += 1;
                Flow::Go(Step::Claim(ClaimAt::Next))
            }
            (ClaimAt::Committed, Some(Input::Committed(false))) => {
                if self.mutations.without_end_game {
                    return self.claim_free(pos);
                }
                let since = match self.left {
                    Some((p, t)) if p == pos => t,
                    _ => self.now,
                };
                let all: Vec<Pace> = self.paces.values().copied().collect();
                match self.take(&all, pos, since) {
                    Take::Claim => self.claim_free(pos),
                    // Judged again with the live peers only: a dead peer is not waited for.
                    Take::Leave { .. } => ask(ClaimAt::Peers { since }, Effect::JudgePeers),
                }
            }
            (ClaimAt::Peers { since }, Some(Input::Peers(dead))) => {
                self.dead = dead;
                let live: Vec<Pace> = self
                    .paces
                    .iter()
                    .filter(|(r, _)| !self.dead.contains(r))
                    .map(|(_, p)| *p)
                    .collect();
                match self.take(&live, pos, since) {
                    Take::Claim => self.claim_free(pos),
                    Take::Leave { recheck } => {
                        if self.left.is_none_or(|l| l.0 != pos) {
                            self.stats.left += 1;
                            let unclaimed = self.cfg.items - pos;
                            self.effects
                                .push_back(Effect::Note(Note::Left { pos, unclaimed }));
                        }
                        self.left = Some((pos, since));
                        self.recheck = Some(self.now + recheck);
                        Flow::Go(Step::Commit { renaming: false })
                    }
                }
            }
            (ClaimAt::Create { pos }, Some(Input::LeaseCreated(won))) => {
                if won {
                    self.start(pos, 0);
                }
                Flow::Go(Step::Claim(ClaimAt::Next))
            }
            (at, answer) => panic!("the claim loop at {at:?} answered with {answer:?}"),
        }
    }

    /// The end game's decision for the pool's next unclaimed item `pos`, waiting since
    /// `since`, against these peers' paces.
    fn take(&self, peers: &[Pace], pos: usize, since: Duration) -> Take {
        let waited = self.now.saturating_sub(since);
        let unclaimed = self.cfg.items - pos;
        lease::take_next_with(self.pace(), peers, unclaimed, waited, self.mutations.judge)
    }

    fn claim_free(&mut self, pos: usize) -> Flow {
        if self.left.is_some_and(|l| l.0 == pos) {
            self.stats.claimed_after_leaving += 1;
        }
        self.cursor += 1;
        let ask = self.create(pos, 0, Claim::First);
        Flow::Ask(Step::Claim(ClaimAt::Create { pos }), ask)
    }

    /// Commit what finished, now that this node's next items run (the commit's fsyncs are
    /// not between one item and the next); one whose item is committed already is
    /// discarded.
    fn commit(&mut self, renaming: bool, answer: Option<Input>) -> Flow {
        match (renaming, answer) {
            (false, None) => {}
            (false, Some(Input::Committed(true))) => {
                let (pos, attempt) = self.finished.pop_front().expect("asked");
                self.committed_elsewhere.insert(pos);
                self.effects.push_back(Effect::Discard { pos, attempt });
            }
            (false, Some(Input::Committed(false))) => {
                let &(pos, attempt) = self.finished.front().expect("asked");
                let ask = Effect::Commit { pos, attempt };
                return Flow::Ask(Step::Commit { renaming: true }, ask);
            }
            (true, Some(Input::CommitDone(won))) => {
                let (pos, _) = self.finished.pop_front().expect("asked");
                if won {
                    self.committed.insert(pos);
                    self.stats.mine += 1;
                } else {
                    self.committed_elsewhere.insert(pos);
                    self.stats.lost_commits += 1;
                }
            }
            (_, answer) => panic!("a commit answered with {answer:?}"),
        }
        match self.finished.front() {
            Some(&(pos, _)) => {
                Flow::Ask(Step::Commit { renaming: false }, Effect::LookCommitted(pos))
            }
            None => {
                let running = self.running.keys().copied().collect();
                Flow::Go(Step::Superseded(running))
            }
        }
    }

    /// Stop attempts whose item another rank committed meanwhile.
    fn superseded(&mut self, mut q: VecDeque<(usize, u32)>, answer: Option<Input>) -> Flow {
        if let Some(answer) = answer {
            let Input::Committed(committed) = answer else {
                panic!("a running item's look answered with {answer:?}")
            };
            let (pos, attempt) = q.pop_front().expect("asked");
            if committed {
                self.running.remove(&(pos, attempt));
                self.committed_elsewhere.insert(pos);
                self.effects.push_back(Effect::Stop { pos, attempt });
            }
        }
        match q.front() {
            Some(&(pos, _)) => Flow::Ask(Step::Superseded(q), Effect::LookCommitted(pos)),
            // At the end of the pool, take over items whose claimant died.
            None if self.cursor >= self.cfg.items => Flow::Ask(
                Step::EndGame {
                    pos: 0,
                    at: EndAt::Peers,
                },
                Effect::JudgePeers,
            ),
            None => Flow::Rest,
        }
    }

    /// The end of the pool: each item neither committed nor failed nor here is backed up
    /// or awaited (a live holder), taken over (a dead one), claimed (none), or found
    /// failed for good (every attempt over without a commit).
    fn end_game(&mut self, pos: usize, at: EndAt, answer: Option<Input>) -> Flow {
        let ask = |at, effect| Flow::Ask(Step::EndGame { pos, at }, effect);
        let next = Flow::Go(Step::EndGame {
            pos: pos + 1,
            at: EndAt::Item,
        });
        match (at, answer) {
            (EndAt::Peers, Some(Input::Peers(dead))) => {
                self.dead = dead;
                Flow::Go(Step::EndGame {
                    pos,
                    at: EndAt::Item,
                })
            }
            (EndAt::Item, None) => {
                if self.running.len() >= self.cfg.workers as usize || pos >= self.cfg.items {
                    return Flow::Rest;
                }
                let here = self.runs(pos) || self.delayed.iter().any(|d| d.1 == pos);
                let known =
                    self.committed.contains(&pos) || self.committed_elsewhere.contains(&pos);
                if here || known {
                    return next;
                }
                ask(EndAt::Committed, Effect::LookCommitted(pos))
            }
            (EndAt::Committed, Some(Input::Committed(true)))
            | (EndAt::Failed, Some(Input::Failed(true))) => next,
            (EndAt::Committed, Some(Input::Committed(false))) => {
                ask(EndAt::Failed, Effect::LookFailed(pos))
            }
            (EndAt::Failed, Some(Input::Failed(false))) => {
                ask(EndAt::Leases, Effect::ReadLeases(pos))
            }
            (EndAt::Leases, Some(Input::Leases(leases))) => {
                let newest = leases.len().checked_sub(1);
                match newest {
                    None => self.judge(pos, None),
                    Some(n) => self.scan(pos, leases, n as u32),
                }
            }
            (EndAt::AttemptFailed { leases, attempt }, Some(Input::AttemptFailed(failed))) => {
                match (failed, attempt) {
                    (true, 0) => self.over(pos, leases),
                    (true, a) => self.scan(pos, leases, a - 1),
                    (false, a) => self.open(pos, leases, a),
                }
            }
            (EndAt::Create { attempt, claim }, Some(Input::LeaseCreated(won))) => {
                self.created(pos, attempt, claim, won);
                next
            }
            (EndAt::Marking, Some(Input::MarkedFailed(won))) => {
                if won {
                    self.stats.failed += 1;
                }
                next
            }
            (at, answer) => panic!("the end game at {at:?} answered with {answer:?}"),
        }
    }

    /// Whether `rank` holds no attempt anyone may wait for: dead, no rank of the cluster.
    fn gone(&self, rank: u32) -> bool {
        rank >= self.cfg.num_nodes || self.dead.contains(&rank)
    }

    /// Look for the newest attempt of item `pos` that may still commit it, from
    /// `attempt` down. An attempt is over when this node ran it (it is not running here),
    /// when a later lease is its holder's (it exited to be retried), when it is not the
    /// newest and its holder is dead (someone went on past it), or when its failure is
    /// marked (asked here). A lease of this rank's that this node never started is
    /// someone else's writing: nobody's.
    fn scan(&mut self, pos: usize, leases: Vec<Lease>, attempt: u32) -> Flow {
        if self.mutations.own_failure_fails_item && self.gave_up.contains_key(&pos) {
            return self.over(pos, leases);
        }
        let newest = leases.len() as u32 - 1;
        for a in (0..=attempt).rev() {
            let rank = leases[a as usize].rank;
            let ran_here = rank == self.cfg.rank && self.started.contains(&(pos, a));
            let retried = leases[a as usize + 1..].iter().any(|l| l.rank == rank);
            let gone = self.gone(rank) || (rank == self.cfg.rank && !ran_here);
            if ran_here || retried || (gone && a < newest) {
                continue;
            }
            let at = EndAt::AttemptFailed { leases, attempt: a };
            let look = Effect::LookAttemptFailed { pos, attempt: a };
            return Flow::Ask(Step::EndGame { pos, at }, look);
        }
        self.over(pos, leases)
    }

    /// Attempt `attempt` of item `pos` may still commit it: the newest is judged as
    /// always (await, back up, take over); an earlier one (a first attempt whose backup
    /// failed) is awaited from its live holder.
    fn open(&mut self, pos: usize, mut leases: Vec<Lease>, attempt: u32) -> Flow {
        let rank = leases[attempt as usize].rank;
        if attempt as usize + 1 == leases.len() {
            let lease = leases.pop().expect("the newest");
            return self.judge(pos, Some((attempt, lease)));
        }
        self.await_item(pos, rank);
        Flow::Go(Step::EndGame {
            pos: pos + 1,
            at: EndAt::Item,
        })
    }

    /// Every attempt of item `pos` is over without a commit: it failed for good. Marked by
    /// a node whose own attempt failed, or by anyone once the newest attempt's holder is
    /// gone (it may have died before marking it); the others wait for that mark.
    fn over(&mut self, pos: usize, leases: Vec<Lease>) -> Flow {
        let newest = leases.last().expect("an item with leases");
        let (attempt, why) = match self.gave_up.get(&pos) {
            Some((a, why)) => (Some(*a), why.clone()),
            None if self.gone(newest.rank) || newest.rank == self.cfg.rank => (
                None,
                format!(
                    "every attempt failed or was lost with its node (the last, attempt {}, on rank {})",
                    leases.len() - 1,
                    newest.rank
                ),
            ),
            None => {
                self.await_item(pos, newest.rank);
                return Flow::Go(Step::EndGame {
                    pos: pos + 1,
                    at: EndAt::Item,
                });
            }
        };
        let mark = Effect::MarkFailed { pos, attempt, why };
        Flow::Ask(
            Step::EndGame {
                pos,
                at: EndAt::Marking,
            },
            mark,
        )
    }

    /// Who holds item `pos`, by its newest lease: await, back up, take over or claim it.
    fn judge(&mut self, pos: usize, newest: Option<(u32, Lease)>) -> Flow {
        let holder_rank = newest.as_ref().map(|(_, l)| l.rank);
        let (dead, n) = (&self.dead, self.cfg.num_nodes);
        // A lease naming no rank of this cluster (planted, or its rank unreadable: the
        // directory is untrusted) has no live holder to wait for: a retry's was waited
        // for until the phase timeout, as nobody backs up a retry.
        let holder = lease::holder_with(
            newest.map(|(a, l)| (a, l.rank)),
            self.cfg.rank,
            |r| r >= n || dead.contains(&r),
            self.mutations.judge,
        );
        let (attempt, claim) = match holder {
            Holder::Live { attempt, rank } => {
                let seen = *self.first_seen.entry(pos).or_insert(self.now);
                let held = self.now.saturating_sub(seen);
                // One backup per item, of a first attempt only: a retry or a takeover is
                // not backed up again.
                let mean = self.mean_item();
                if !lease::backup_due(attempt, held, mean) {
                    if let (0, Some(mean)) = (attempt, mean) {
                        // Due once held for longer than the mean: just after it.
                        let at = seen + mean + Duration::from_nanos(1);
                        self.backup_at = Some(self.backup_at.map_or(at, |b| b.min(at)));
                    }
                    self.await_item(pos, rank);
                    return Flow::Go(Step::EndGame {
                        pos: pos + 1,
                        at: EndAt::Item,
                    });
                }
                (attempt + 1, Claim::Backup { holder: rank })
            }
            Holder::Gone { attempt } => (
                attempt + 1,
                Claim::TakeOver {
                    holder: holder_rank.expect("a lease"),
                },
            ),
            // Claimable in this generation (e.g. a lease of an earlier one only).
            Holder::Free => (0, Claim::First),
        };
        let ask = self.create(pos, attempt, claim);
        Flow::Ask(
            Step::EndGame {
                pos,
                at: EndAt::Create { attempt, claim },
            },
            ask,
        )
    }

    fn created(&mut self, pos: usize, attempt: u32, claim: Claim, won: bool) {
        match (claim, won) {
            (Claim::Backup { holder }, true) => {
                self.stats.backups += 1;
                self.effects
                    .push_back(Effect::Note(Note::Backup { pos, holder }));
            }
            (Claim::TakeOver { holder }, true) => {
                self.stats.takeovers += 1;
                crate::exercised::note(crate::exercised::Path::LeaseTakeovers);
                self.effects.push_back(Effect::Note(Note::TakeOver {
                    pos,
                    holder,
                    attempt,
                }));
            }
            (Claim::Backup { holder }, false) => return self.await_item(pos, holder),
            // Someone claimed or took it over first (a lease this node's cache did not
            // show yet): wait for it like any live holder's, or this node could finish
            // while the taker dies too.
            (_, false) => {
                if !self.mutations.lost_claim_ends_wait {
                    self.awaited.push(pos);
                }
                return;
            }
            _ => {}
        }
        self.start(pos, attempt);
    }

    /// Whether an attempt of item `pos` runs here.
    fn runs(&self, pos: usize) -> bool {
        self.running
            .range((pos, 0)..=(pos, u32::MAX))
            .next()
            .is_some()
    }

    fn await_item(&mut self, pos: usize, holder: u32) {
        self.awaited.push(pos);
        if let Some(p) = self.paces.get(&holder) {
            self.awaited_pace = Some(self.awaited_pace.map_or(p.item, |a| a.min(p.item)));
        }
    }

    /// An attempt exited: a success is committed in the next round, a retryable exit
    /// waits for its backoff, anything else failed for good.
    fn exited(&mut self, pos: usize, attempt: u32, exit: Exit) {
        assert!(!self.in_round(), "an exit handed in inside a round");
        let started = self
            .running
            .remove(&(pos, attempt))
            .unwrap_or_else(|| panic!("attempt {attempt} of item {pos} exited, not running"));
        self.item_times.push(self.now.saturating_sub(started));
        self.done = false;
        match exit {
            Exit::Success => self.finished.push_back((pos, attempt)),
            Exit::Retry { after } => {
                self.stats.retries += 1;
                self.delayed.push((self.now + after, pos, attempt + 1));
            }
            Exit::Failed { why } => {
                self.stats.failed_attempts += 1;
                self.gave_up.insert(pos, (attempt, why.clone()));
                self.effects
                    .push_back(Effect::MarkAttemptFailed { pos, attempt, why });
            }
        }
    }

    /// The machine's own invariants, checked after every state change in debug builds
    /// and in the simulator: a broken one is a bug here, not a condition to handle.
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        let n = self.cfg.items;
        assert!(self.cursor <= n, "the cursor past the pool");
        // An item is in at most one of: running here, waiting for a retry, finished.
        let mut here: Vec<usize> = (self.running.keys().map(|r| r.0))
            .chain(self.delayed.iter().map(|d| d.1))
            .chain(self.finished.iter().map(|f| f.0))
            .collect();
        let count = here.len();
        here.sort_unstable();
        here.dedup();
        assert_eq!(here.len(), count, "an item twice here: {here:?}");
        assert!(
            here.last().is_none_or(|&p| p < n),
            "an item outside the pool"
        );
        assert!(
            here.iter().all(|p| !self.committed.contains(p)),
            "an item still here after this node committed it"
        );
        assert_eq!(
            self.stats.mine,
            self.committed.len(),
            "commits counted once"
        );
        assert!(
            self.left.is_none_or(|(pos, _)| pos <= self.cursor),
            "the left item is ahead of the cursor"
        );
        if self.recheck.is_some() {
            assert!(self.cursor < n, "an item left past the end of the pool");
        }
        assert!(
            self.awaited.iter().all(|&p| !self.runs(p)),
            "an item awaited from a peer runs here"
        );
        if self.done {
            assert!(
                self.running.is_empty() && self.delayed.is_empty() && self.cursor == n,
                "finished with work left"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn machine(mutations: Mutations) -> PoolMachine {
        PoolMachine::new(Settings {
            rank: 0,
            num_nodes: 2,
            gen: 3,
            nonce: "n0".into(),
            items: 3,
            workers: 1,
            poll_interval: MS(100),
        })
        .with_mutations(mutations)
    }

    fn lease(rank: u32, attempt: u32, item_ms: Option<f64>) -> Lease {
        Lease {
            attempt,
            gen: 3,
            item_ms,
            nonce: format!("n{rank}"),
            rank,
            workers: 1,
        }
    }

    /// The next effect is `want`; answer it with `answer` (if a question).
    fn step(m: &mut PoolMachine, now: u64, want: Effect, answer: Option<Input>) {
        assert_eq!(m.poll_effect(), Some(want));
        if let Some(a) = answer {
            m.handle(MS(now), a);
        }
    }

    /// The next effect creates a lease of `pos` for `claim`; answer whether it won.
    fn create(m: &mut PoolMachine, now: u64, pos: usize, claim: Claim, won: bool) -> Lease {
        let Some(Effect::CreateLease {
            pos: p,
            claim: c,
            lease,
        }) = m.poll_effect()
        else {
            panic!("a lease create expected")
        };
        assert_eq!((p, c), (pos, claim));
        m.handle(MS(now), Input::LeaseCreated(won));
        lease
    }

    #[test]
    fn a_lease_keeps_its_json_shape_and_its_fallbacks() {
        // The object the node always wrote (json! sorts its keys).
        let old = json!({"rank": 2, "gen": 5, "nonce": "ab", "attempt": 1, "item_ms": 12.5, "workers": 4});
        let typed = Lease {
            attempt: 1,
            gen: 5,
            item_ms: Some(12.5),
            nonce: "ab".into(),
            rank: 2,
            workers: 4,
        };
        assert_eq!(
            serde_json::to_string(&typed).unwrap(),
            serde_json::to_string(&old).unwrap()
        );
        assert_eq!(serde_json::from_value::<Lease>(old).unwrap(), typed);
        let none = Lease {
            item_ms: None,
            ..typed.clone()
        };
        assert_eq!(serde_json::to_value(&none).unwrap()["item_ms"], Value::Null);
        // Whatever the file holds: a rank nobody has, one worker, no pace; no panic.
        for v in [
            json!({"rank": "2", "item_ms": "fast", "workers": -1}),
            json!([1, 2]),
            json!(null),
            json!({"rank": 2, "item_ms": 1e300, "workers": 2}),
            json!({"rank": 2, "item_ms": -5.0}),
        ] {
            let l: Lease = serde_json::from_value(v.clone()).unwrap();
            assert_eq!(l.pace(), None, "{v}");
            if v["rank"] != 2 {
                assert_eq!((l.rank, l.workers), (u32::MAX, 1), "{v}");
            }
        }
        let far = json!({"rank": 7, "item_ms": 250.0, "workers": 1u64 << 40});
        assert_eq!(
            serde_json::from_value::<Lease>(far).unwrap().pace(),
            Some(Pace {
                item: MS(250),
                workers: u32::MAX
            })
        );
    }

    /// One node of two: it claims, learns its faster peer's pace from a lease, leaves the
    /// last item to that peer while it lives, claims it once the peer is dead, and takes
    /// over the dead peer's item; a lost takeover is waited for.
    #[test]
    fn a_round_claims_leaves_to_a_faster_peer_and_takes_over_from_a_dead_one() {
        let mut m = machine(Mutations::default());
        m.tick(MS(0));
        step(
            &mut m,
            0,
            Effect::ReadFirstLease(0),
            Some(Input::FirstLease(None)),
        );
        step(
            &mut m,
            0,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
        let first = create(&mut m, 0, 0, Claim::First, true);
        assert_eq!((first.rank, first.gen, first.item_ms), (0, 3, None));
        step(&mut m, 0, Effect::Start { pos: 0, attempt: 0 }, None);
        // One worker, busy: no more claims; its item is not committed elsewhere.
        step(
            &mut m,
            0,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
        assert_eq!(m.poll_effect(), None);
        assert!(!m.finished() && !m.in_round());
        assert_eq!(m.poll_timeout(), Some(MS(100)));

        let exit = Input::Exited {
            pos: 0,
            attempt: 0,
            exit: Exit::Success,
        };
        m.handle(MS(40), exit);
        m.tick(MS(40));
        // Item 1 is the peer's (5 ms an item); item 2, the last, is left to it.
        let peers = Input::FirstLease(Some(lease(1, 0, Some(5.0))));
        step(&mut m, 40, Effect::ReadFirstLease(1), Some(peers));
        step(
            &mut m,
            40,
            Effect::ReadFirstLease(2),
            Some(Input::FirstLease(None)),
        );
        step(
            &mut m,
            40,
            Effect::LookCommitted(2),
            Some(Input::Committed(false)),
        );
        step(
            &mut m,
            40,
            Effect::JudgePeers,
            Some(Input::Peers(BTreeSet::new())),
        );
        let left = Note::Left {
            pos: 2,
            unclaimed: 1,
        };
        step(&mut m, 40, Effect::Note(left), None);
        // What finished is committed after the claims.
        step(
            &mut m,
            40,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
        let commit = Effect::Commit { pos: 0, attempt: 0 };
        step(&mut m, 40, commit, Some(Input::CommitDone(true)));
        assert_eq!(m.poll_effect(), None);
        assert!(m.looks().settle.is_empty());
        assert_eq!(m.looks().leaving, Some(2));
        // Patience: twice the peer's 5 ms.
        assert_eq!(m.poll_timeout(), Some(MS(50)));

        // The peer is dead now: the left item is claimed after all, with this node's pace.
        m.tick(MS(45));
        step(
            &mut m,
            45,
            Effect::ReadFirstLease(2),
            Some(Input::FirstLease(None)),
        );
        step(
            &mut m,
            45,
            Effect::LookCommitted(2),
            Some(Input::Committed(false)),
        );
        let dead = Input::Peers([1].into());
        step(&mut m, 45, Effect::JudgePeers, Some(dead.clone()));
        let mine = create(&mut m, 45, 2, Claim::First, true);
        assert_eq!(mine.item_ms, Some(40.0));
        step(&mut m, 45, Effect::Start { pos: 2, attempt: 0 }, None);
        step(
            &mut m,
            45,
            Effect::LookCommitted(2),
            Some(Input::Committed(false)),
        );
        // Past the end of the pool, but the worker is busy: no end game yet.
        step(&mut m, 45, Effect::JudgePeers, Some(dead.clone()));
        assert_eq!(m.poll_effect(), None);
        assert_eq!(m.stats().claimed_after_leaving, 1);

        let exit = Input::Exited {
            pos: 2,
            attempt: 0,
            exit: Exit::Success,
        };
        m.handle(MS(60), exit);
        m.tick(MS(60));
        step(
            &mut m,
            60,
            Effect::LookCommitted(2),
            Some(Input::Committed(false)),
        );
        let commit = Effect::Commit { pos: 2, attempt: 0 };
        step(&mut m, 60, commit, Some(Input::CommitDone(true)));
        step(&mut m, 60, Effect::JudgePeers, Some(dead));
        step(
            &mut m,
            60,
            Effect::LookCommitted(1),
            Some(Input::Committed(false)),
        );
        step(
            &mut m,
            60,
            Effect::LookFailed(1),
            Some(Input::Failed(false)),
        );
        let leases = Input::Leases(vec![lease(1, 0, Some(5.0))]);
        step(&mut m, 60, Effect::ReadLeases(1), Some(leases));
        let look = Effect::LookAttemptFailed { pos: 1, attempt: 0 };
        step(&mut m, 60, look, Some(Input::AttemptFailed(false)));
        // Someone else took it over first: this node waits for it.
        create(&mut m, 60, 1, Claim::TakeOver { holder: 1 }, false);
        assert_eq!(m.poll_effect(), None);
        assert!(!m.finished(), "a lost takeover is waited for");
        assert_eq!(
            m.looks(),
            Looks {
                settle: vec![1],
                ..Looks::default()
            }
        );
        assert_eq!(m.stats().mine, 2);
    }

    /// A round at 0 ms that claims item 0 (free, not committed), starts its attempt 0 and
    /// finds it not committed elsewhere.
    fn claims_item_0(m: &mut PoolMachine) {
        m.tick(MS(0));
        step(
            m,
            0,
            Effect::ReadFirstLease(0),
            Some(Input::FirstLease(None)),
        );
        step(
            m,
            0,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
        create(m, 0, 0, Claim::First, true);
        step(m, 0, Effect::Start { pos: 0, attempt: 0 }, None);
        step(
            m,
            0,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
    }

    /// Two items, one worker: item 0 done here in 40 ms, item 1 held by rank 1 and backed
    /// up here (attempt 1) once held for longer than that: the machine, and the time.
    fn backing_up() -> (PoolMachine, Duration) {
        let mut m = PoolMachine::new(Settings {
            items: 2,
            ..machine(Mutations::default()).cfg
        });
        claims_item_0(&mut m);
        let exit = Input::Exited {
            pos: 0,
            attempt: 0,
            exit: Exit::Success,
        };
        m.handle(MS(40), exit);
        m.tick(MS(40));
        let held = Input::FirstLease(Some(lease(1, 0, None)));
        step(&mut m, 40, Effect::ReadFirstLease(1), Some(held));
        step(
            &mut m,
            40,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
        let commit = Effect::Commit { pos: 0, attempt: 0 };
        step(&mut m, 40, commit, Some(Input::CommitDone(true)));
        let end_game = |m: &mut PoolMachine, now: u64| {
            step(
                m,
                now,
                Effect::JudgePeers,
                Some(Input::Peers(BTreeSet::new())),
            );
            step(
                m,
                now,
                Effect::LookCommitted(1),
                Some(Input::Committed(false)),
            );
            step(m, now, Effect::LookFailed(1), Some(Input::Failed(false)));
            let leases = Input::Leases(vec![lease(1, 0, None)]);
            step(m, now, Effect::ReadLeases(1), Some(leases));
            let look = Effect::LookAttemptFailed { pos: 1, attempt: 0 };
            step(m, now, look, Some(Input::AttemptFailed(false)));
        };
        end_game(&mut m, 40);
        assert_eq!(m.poll_effect(), None);
        assert_eq!(
            m.looks(),
            Looks {
                settle: vec![1],
                ..Looks::default()
            }
        );
        // Held since 40 ms; this node's mean is 40 ms: due just after 80 ms.
        let due = MS(80) + Duration::from_nanos(1);
        assert_eq!(m.poll_timeout(), Some(due));
        m.tick(due);
        let mut ask = |want: Effect, answer: Input| {
            assert_eq!(m.poll_effect(), Some(want));
            m.handle(due, answer);
        };
        ask(Effect::JudgePeers, Input::Peers(BTreeSet::new()));
        ask(Effect::LookCommitted(1), Input::Committed(false));
        ask(Effect::LookFailed(1), Input::Failed(false));
        ask(
            Effect::ReadLeases(1),
            Input::Leases(vec![lease(1, 0, None)]),
        );
        let look = Effect::LookAttemptFailed { pos: 1, attempt: 0 };
        ask(look, Input::AttemptFailed(false));
        let Some(Effect::CreateLease {
            pos: 1,
            claim,
            lease,
        }) = m.poll_effect()
        else {
            panic!("a backup's lease expected")
        };
        assert_eq!((claim, lease.attempt), (Claim::Backup { holder: 1 }, 1));
        m.handle(due, Input::LeaseCreated(true));
        let note = Note::Backup { pos: 1, holder: 1 };
        assert_eq!(m.poll_effect(), Some(Effect::Note(note)));
        assert_eq!(m.poll_effect(), Some(Effect::Start { pos: 1, attempt: 1 }));
        assert_eq!(m.poll_effect(), None);
        (m, due)
    }

    /// A live peer's slow first attempt is backed up once it has been held for longer
    /// than this node's mean item time, and the machine asks to be woken just then.
    #[test]
    fn an_awaited_first_attempt_wakes_the_node_when_its_backup_is_due() {
        let (mut m, due) = backing_up();
        assert_eq!(m.stats().backups, 1);
        // The backup runs here: the wait wakes when another rank commits item 1 (its
        // round stops the backup), not when the holder marks it failed (its round would
        // do nothing, and the driver would look again at once, for ever: dynamic seed 26).
        let looks = m.looks();
        assert_eq!((looks.settle, looks.superseding), (vec![], vec![1]));
        m.tick(due);
        let mut ask = |want: Effect, answer: Input| {
            assert_eq!(m.poll_effect(), Some(want));
            m.handle(due, answer);
        };
        ask(Effect::LookCommitted(1), Input::Committed(true));
        assert_eq!(m.poll_effect(), Some(Effect::Stop { pos: 1, attempt: 1 }));
    }

    /// A one-item, one-worker machine of rank 0 in the end game at `now`: the round up
    /// to the end game's look at item 0 (its leases are asked next).
    fn end_game_at(m: &mut PoolMachine, now: u64, dead: &[u32]) {
        m.tick(MS(now));
        if m.cursor == 0 {
            let theirs = Input::FirstLease(Some(lease(1, 0, None)));
            step(m, now, Effect::ReadFirstLease(0), Some(theirs));
        }
        let peers = Input::Peers(dead.iter().copied().collect());
        step(m, now, Effect::JudgePeers, Some(peers));
        step(
            m,
            now,
            Effect::LookCommitted(0),
            Some(Input::Committed(false)),
        );
        step(m, now, Effect::LookFailed(0), Some(Input::Failed(false)));
    }

    /// [`one_item`] whose item runs here (attempt 0), after the round's end-game look at
    /// the peers (nothing else to look at).
    fn one_item_running() -> PoolMachine {
        let mut m = one_item();
        claims_item_0(&mut m);
        step(
            &mut m,
            0,
            Effect::JudgePeers,
            Some(Input::Peers(BTreeSet::new())),
        );
        m
    }

    fn one_item() -> PoolMachine {
        PoolMachine::new(Settings {
            items: 1,
            ..machine(Mutations::default()).cfg
        })
    }

    /// This node's backup fails for good while the peer's first attempt runs on: the item
    /// is not failed (nothing marked, nothing counted); it is awaited from that first
    /// attempt, and marked failed here only once that attempt's failure shows too.
    #[test]
    fn a_failed_backup_awaits_the_first_attempt_and_fails_the_item_only_with_it() {
        let (mut m, due) = backing_up();
        let at = |ms: u64| due + MS(ms);
        let why = "exit code 3".to_string();
        let exit = Exit::Failed { why: why.clone() };
        m.handle(
            at(5),
            Input::Exited {
                pos: 1,
                attempt: 1,
                exit,
            },
        );
        let mark = Effect::MarkAttemptFailed {
            pos: 1,
            attempt: 1,
            why: why.clone(),
        };
        assert_eq!(m.poll_effect(), Some(mark));
        let round = |m: &mut PoolMachine, now: Duration, first_failed: bool| {
            m.tick(now);
            let mut ask = |want: Effect, answer: Input| {
                assert_eq!(m.poll_effect(), Some(want));
                m.handle(now, answer);
            };
            ask(Effect::JudgePeers, Input::Peers(BTreeSet::new()));
            ask(Effect::LookCommitted(1), Input::Committed(false));
            ask(Effect::LookFailed(1), Input::Failed(false));
            let both = vec![lease(1, 0, None), lease(0, 1, Some(40.0))];
            ask(Effect::ReadLeases(1), Input::Leases(both));
            // Its own attempt is over; the first one is looked at.
            let first = Effect::LookAttemptFailed { pos: 1, attempt: 0 };
            ask(first, Input::AttemptFailed(first_failed));
        };
        round(&mut m, at(5), false);
        assert_eq!(m.poll_effect(), None, "nothing marked, no second backup");
        assert!(!m.finished(), "the first attempt is awaited");
        assert_eq!(m.looks().settle, vec![1]);
        assert_eq!((m.stats().failed_attempts, m.stats().failed), (1, 0));

        // The first attempt failed too: the item failed for good, marked and counted here.
        round(&mut m, at(10), true);
        let mark = Effect::MarkFailed {
            pos: 1,
            attempt: Some(1),
            why,
        };
        assert_eq!(m.poll_effect(), Some(mark));
        m.handle(at(10), Input::MarkedFailed(true));
        assert_eq!(m.poll_effect(), None);
        assert!(m.finished());
        assert_eq!(m.stats().failed, 1);
    }

    /// This node's first attempt fails for good while a peer's backup runs: the backup is
    /// awaited, not the item failed; when the backup fails too and the peer's mark wins,
    /// nothing is counted here.
    #[test]
    fn a_failed_first_attempt_awaits_its_backup() {
        let mut m = one_item_running();
        assert_eq!(m.poll_effect(), None);
        let exit = Exit::Failed {
            why: "killed by signal 9".into(),
        };
        m.handle(
            MS(50),
            Input::Exited {
                pos: 0,
                attempt: 0,
                exit,
            },
        );
        assert!(matches!(
            m.poll_effect(),
            Some(Effect::MarkAttemptFailed { attempt: 0, .. })
        ));
        let both = || Input::Leases(vec![lease(0, 0, None), lease(1, 1, Some(5.0))]);
        let backup = Effect::LookAttemptFailed { pos: 0, attempt: 1 };
        end_game_at(&mut m, 50, &[]);
        step(&mut m, 50, Effect::ReadLeases(0), Some(both()));
        step(
            &mut m,
            50,
            backup.clone(),
            Some(Input::AttemptFailed(false)),
        );
        // The backup, a second attempt, is never backed up: awaited.
        assert_eq!(m.poll_effect(), None);
        assert_eq!((m.looks().settle, m.stats().failed), (vec![0], 0));
        end_game_at(&mut m, 60, &[]);
        step(&mut m, 60, Effect::ReadLeases(0), Some(both()));
        step(&mut m, 60, backup, Some(Input::AttemptFailed(true)));
        let Some(Effect::MarkFailed {
            pos: 0,
            attempt: Some(0),
            ..
        }) = m.poll_effect()
        else {
            panic!("the item's mark expected")
        };
        m.handle(MS(60), Input::MarkedFailed(false));
        assert!(m.finished());
        assert_eq!(m.stats().failed, 0, "the peer's mark won: counted there");
    }

    /// A node that ran no attempt of an item whose every attempt failed waits for a node
    /// that did to mark it; once the newest attempt's node is dead, it marks it itself.
    #[test]
    fn an_item_failed_elsewhere_is_marked_here_only_when_its_node_is_gone() {
        let mut m = one_item();
        let first = Effect::LookAttemptFailed { pos: 0, attempt: 0 };
        end_game_at(&mut m, 0, &[]);
        step(
            &mut m,
            0,
            Effect::ReadLeases(0),
            Some(Input::Leases(vec![lease(1, 0, None)])),
        );
        step(&mut m, 0, first.clone(), Some(Input::AttemptFailed(true)));
        assert_eq!(m.poll_effect(), None);
        assert_eq!(m.looks().settle, vec![0]);
        end_game_at(&mut m, 10, &[1]);
        step(
            &mut m,
            10,
            Effect::ReadLeases(0),
            Some(Input::Leases(vec![lease(1, 0, None)])),
        );
        step(&mut m, 10, first, Some(Input::AttemptFailed(true)));
        let Some(Effect::MarkFailed {
            pos: 0,
            attempt: None,
            why,
        }) = m.poll_effect()
        else {
            panic!("the item's mark expected")
        };
        assert!(why.contains("attempt 0, on rank 1"), "{why}");
        m.handle(MS(10), Input::MarkedFailed(true));
        assert!(m.finished());
        assert_eq!(m.stats().failed, 1);
    }

    /// A retry whose lease another rank created first (a backup of this node's first
    /// attempt) is still owed: it is claimed under the next attempt.
    #[test]
    fn a_retry_whose_lease_was_taken_retries_under_the_next() {
        let mut m = one_item_running();
        let exit = Exit::Retry { after: MS(5) };
        m.handle(
            MS(10),
            Input::Exited {
                pos: 0,
                attempt: 0,
                exit,
            },
        );
        m.tick(MS(20));
        let lost = create(&mut m, 20, 0, Claim::Retry, false);
        assert_eq!(lost.attempt, 1);
        let won = create(&mut m, 20, 0, Claim::Retry, true);
        assert_eq!(won.attempt, 2);
        assert_eq!(m.poll_effect(), Some(Effect::Start { pos: 0, attempt: 2 }));
    }
}
