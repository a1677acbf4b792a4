//! Who a generation is: its members, its coordinator, and how the survivors of a loss
//! form the next generation by themselves (`[cluster] min-nodes`).
//!
//! **Members and positions.** A generation's members are some of the run's ranks, in
//! rank order ([`Members`]). The protocol's core (barriers, topology, watching) runs over
//! *positions* `0..members.len()`: position 0 is the generation's coordinator, which does
//! what rank 0 does in a full generation, and a record is still named by its rank
//! (`gen-N/rank-R.json`). With every rank a member, position and rank are the same, so a
//! full generation is exactly today's.
//!
//! **Regrouping after a loss.** When a generation ends because some of its members were
//! lost (declared dead, or their command failed where the phase allows dropping them), a
//! survivor does not exit; it runs a [`Regroup`]:
//! - The next coordinator is the lowest member not known lost. If that is this rank, it
//!   claims the next generation number by an exclusive create of its directory and,
//!   having won, publishes the next generation's members (the previous members less every
//!   rank it knows lost) by an exclusive create of the generation's record.
//! - That record decides the number once: a claimant that never publishes (lost right
//!   after its claim) is waited out, and another survivor *spends* the number by creating
//!   the record as a mark instead. Whoever loses that create follows what is there. So
//!   two coordinators never both form a generation after the same one.
//! - Any other survivor waits for the next generation's record. Listed, it joins it at its
//!   position; not listed, it was dropped and stops. If the coordinator it waits for has
//!   not published within the patience (the driver's: two dead-afters and two cache
//!   lifetimes in the simulator, as it has to notice the loss itself first), it counts
//!   that rank lost too and looks again, so a coordinator that died with the others is
//!   replaced.
//! - Fewer than `min-nodes` survivors: nobody forms anything; every survivor stops with a
//!   diagnosis that names the ranks lost (today's behaviour, whatever `min-nodes`).
//!
//! A claim lost to another survivor is never acted on: the loser waits for the winner's
//! record like any member. A frozen former coordinator that wakes finds its generation
//! ended (its own records are fenced by generation, as always) and the next one either
//! lists it or not.
//!
//! A survivor whose generation ended after its coordinator released the barrier it was
//! at passes that barrier first (every member arrived there); after the last one the run
//! is complete (the simulator found a leader regrouping alone after everyone finished).
//!
//! **The work of the dropped** ([`replan`]): a dropped rank's planned work is dealt over
//! the members, and one member stands in for its shard; only what is not committed is
//! done again.
//!
//! **Coming back** ([`Rejoin`], [`Requests`], [`grow`]): a process started again for a
//! dropped rank asks in a request of its own in the current generation and heartbeats
//! it; the coordinator takes the live requests into a generation it forms at the next
//! iteration boundary, and the members go on in it.
//!
//! The machines own no clock and do no I/O: the driver performs each [`Effect`] and
//! answers with an [`Input`], and hands [`Input::Timeout`] when [`Regroup::poll_timeout`]
//! has passed. Only the simulator drives them so far (`tests/sim/elastic.rs`); the node
//! still stops the cluster on any loss.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// A generation's members: some of the run's ranks, sorted, none twice, at least one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "Vec<u32>", into = "Vec<u32>")]
pub struct Members(Vec<u32>);

impl TryFrom<Vec<u32>> for Members {
    type Error = String;
    fn try_from(mut ranks: Vec<u32>) -> Result<Members, String> {
        if ranks.is_empty() {
            return Err("a generation has at least one member".into());
        }
        let n = ranks.len();
        ranks.sort_unstable();
        ranks.dedup();
        if ranks.len() != n {
            return Err(format!(
                "a rank is listed twice among the members {ranks:?}"
            ));
        }
        Ok(Members(ranks))
    }
}

impl From<Members> for Vec<u32> {
    fn from(m: Members) -> Vec<u32> {
        m.0
    }
}

impl Members {
    /// Every rank of a run of `num_nodes` nodes: a full generation.
    pub fn all(num_nodes: u32) -> Members {
        assert!(num_nodes >= 1, "a run has at least one node");
        Members((0..num_nodes).collect())
    }

    pub fn ranks(&self) -> &[u32] {
        &self.0
    }

    pub fn len(&self) -> u32 {
        self.0.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn contains(&self, rank: u32) -> bool {
        self.0.binary_search(&rank).is_ok()
    }

    /// The rank at position 0, which coordinates the generation.
    pub fn coordinator(&self) -> u32 {
        self.0[0]
    }

    /// `rank`'s position in the generation (`NODE_RANK` among the live nodes).
    pub fn position(&self, rank: u32) -> Option<u32> {
        self.0.binary_search(&rank).ok().map(|p| p as u32)
    }

    /// The rank at `position`.
    pub fn rank_at(&self, position: u32) -> u32 {
        self.0[position as usize]
    }

    /// The members less `lost` (`None`: nobody is left).
    pub fn without(&self, lost: &BTreeSet<u32>) -> Option<Members> {
        let left: Vec<u32> = self
            .0
            .iter()
            .copied()
            .filter(|r| !lost.contains(r))
            .collect();
        (!left.is_empty()).then_some(Members(left))
    }

    /// The ranks of a run of `num_nodes` nodes that are not members.
    pub fn dropped(&self, num_nodes: u32) -> Vec<u32> {
        (0..num_nodes).filter(|&r| !self.contains(r)).collect()
    }
}

/// What a spent generation number's record holds instead of a generation: who spent it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpentNumber {
    pub spent_by: u32,
    pub reason: String,
}

/// The next generation as its coordinator publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regrouped {
    pub gen: u64,
    pub members: Members,
}

impl Regrouped {
    pub fn coordinator(&self) -> u32 {
        self.members.coordinator()
    }
}

/// Why a survivor stops instead of going on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Fewer than `min-nodes` members are left.
    BelowMin {
        left: Vec<u32>,
        lost: Vec<u32>,
        min_nodes: u32,
    },
    /// The next generation was formed without this rank (its coordinator counted it
    /// lost).
    Dropped { gen: u64, coordinator: u32 },
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ending::BelowMin {
                left,
                lost,
                min_nodes,
            } => write!(
                f,
                "rank(s) {} lost, {} node(s) left ({}), below cluster.min-nodes = {min_nodes}: the cluster stops",
                list(lost),
                left.len(),
                list(left)
            ),
            Ending::Dropped { gen, coordinator } => write!(
                f,
                "generation {gen} was formed without this rank (its coordinator, rank {coordinator}, counted it lost): this node stops; start it again to rejoin"
            ),
        }
    }
}

fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the driver does for the machine, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Claim generation `gen`: create its directory exclusively; answer
    /// [`Input::Claimed`], with the generation's record if one is published there.
    Claim { gen: u64 },
    /// Read the run's newest generation record; answer [`Input::Current`].
    ReadCurrent,
    /// Publish the next generation (this rank won its claim): create the generation's
    /// record exclusively (then make it the current one); answer [`Input::Published`].
    Publish(Regrouped),
    /// Spend generation number `gen`, claimed by a rank that never published it: create
    /// the generation's record exclusively as a mark that it was spent; answer
    /// [`Input::Spent`].
    Spend { gen: u64 },
    /// Joined `gen` at `position`; the machine is done.
    Joined {
        gen: u64,
        position: u32,
        members: Members,
    },
    /// A line for the log (who is counted lost, who is waited for).
    Info(String),
    /// Stop; the machine is done.
    Stop(Ending),
}

/// What happened, as the driver tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// The claim asked for: won, or another's already; `published`: the generation's
    /// record, when its claimant published it.
    Claimed {
        won: bool,
        published: Option<Regrouped>,
    },
    /// The run's newest generation record, as read (`None`: not readable now).
    Current(Option<Regrouped>),
    /// The generation's record was created (`won`), or was there already: `found`, the
    /// generation that record publishes (`None`: the number was spent meanwhile).
    Published { won: bool, found: Option<Regrouped> },
    /// The number was spent (`won`), or its record was there already: `found`, as above.
    Spent { won: bool, found: Option<Regrouped> },
    /// [`Regroup::poll_timeout`] has passed, or a poll: look again.
    Timeout,
}

/// A deliberately wrong regrouping, for showing that the simulator catches it. Never set
/// by the node.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A survivor that lost the claim (or the generation's record) acts as the
    /// coordinator all the same.
    IgnoreLostClaim,
    /// The coordinator keeps the ranks lost among the next generation's members.
    KeepLost,
    /// A dropped rank's share is not re-planned: nobody does its uncommitted work.
    NoReplan,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// Waiting for the claim's outcome.
    Claiming,
    /// Waiting for the generation's record to be created.
    Publishing(Regrouped),
    /// Waiting for a number to be spent.
    Spending,
    /// Waiting, from `since`, for the next generation's record: from rank `from` (the
    /// next coordinator), or (`None`) from whoever claimed number `target` (unknown).
    Waiting {
        since: Duration,
        from: Option<u32>,
    },
    Done,
}

/// One survivor's regrouping after generation `gen` ended with ranks lost.
///
/// Who publishes a generation number is decided once, by the exclusive create of its
/// record: the claimant's publication or, once the claimant was waited out, another
/// survivor's mark that the number is spent. A claimant that finds the number spent, or
/// a survivor that finds it published, follows what is there; so two coordinators never
/// form generations from the same one (the simulator found that without the record's
/// create, a slow claimant and the survivor that gave up on it each formed one).
#[derive(Debug, Clone)]
pub struct Regroup {
    rank: u32,
    gen: u64,
    members: Members,
    min_nodes: u32,
    patience: Duration,
    /// Every rank this survivor counts lost: those the generation's end named, and
    /// coordinators that did not publish in time.
    lost: BTreeSet<u32>,
    /// The generation number claimed (or waited for) next: one past `gen`, and one more
    /// for each number spent.
    target: u64,
    stage: Stage,
    now: Duration,
    effects: VecDeque<Effect>,
    mutation: Option<Mutation>,
}

impl Regroup {
    /// Rank `rank`, a member of generation `gen` (`members`), which ended with `lost`
    /// lost; `patience` is how long to wait for a coordinator to publish before counting
    /// it lost too. The first effects are ready at once.
    pub fn new(
        rank: u32,
        gen: u64,
        members: Members,
        lost: BTreeSet<u32>,
        min_nodes: u32,
        patience: Duration,
        now: Duration,
    ) -> Regroup {
        assert!(members.contains(rank), "only a member regroups");
        assert!(!lost.contains(&rank), "a rank lost does not regroup");
        let mut r = Regroup {
            rank,
            gen,
            members,
            min_nodes,
            patience,
            lost,
            target: gen + 1,
            stage: Stage::Done,
            now,
            effects: VecDeque::new(),
            mutation: None,
        };
        r.look();
        r
    }

    #[doc(hidden)]
    pub fn with_mutation(mut self, m: Option<Mutation>) -> Regroup {
        self.mutation = super::mutation(m);
        self
    }

    pub fn lost(&self) -> &BTreeSet<u32> {
        &self.lost
    }

    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// Decide again from what is known lost: stop below `min-nodes`, claim as the next
    /// coordinator, or wait for it.
    fn look(&mut self) {
        let left = self.members.without(&self.lost).expect("this rank is left");
        if left.len() < self.min_nodes {
            self.stage = Stage::Done;
            self.effects.push_back(Effect::Stop(Ending::BelowMin {
                left: left.ranks().to_vec(),
                lost: self.lost.iter().copied().collect(),
                min_nodes: self.min_nodes,
            }));
            return;
        }
        let coordinator = left.coordinator();
        if coordinator == self.rank {
            self.stage = Stage::Claiming;
            self.effects.push_back(Effect::Claim { gen: self.target });
        } else {
            self.wait_for(Some(coordinator));
        }
    }

    fn wait_for(&mut self, from: Option<u32>) {
        self.stage = Stage::Waiting {
            since: self.now,
            from,
        };
        let who = from.map_or_else(
            || format!("the claimant of generation {}", self.target),
            |r| format!("rank {r}"),
        );
        self.effects.push_back(Effect::Info(format!(
            "waiting for {who} to form the generation after {} (lost: rank(s) {})",
            self.gen,
            list(&self.lost.iter().copied().collect::<Vec<_>>())
        )));
        self.effects.push_back(Effect::ReadCurrent);
    }

    /// Hand in what happened, at `now` on the driver's monotonic clock.
    pub fn handle(&mut self, now: Duration, input: Input) {
        self.now = self.now.max(now);
        let ignore_lost = self.mutation == Some(Mutation::IgnoreLostClaim);
        match (self.stage.clone(), input) {
            (Stage::Claiming, Input::Claimed { won, published }) => match published {
                _ if won || ignore_lost => self.publish(),
                Some(next) => self.found(next),
                // Claimed by a rank that has not published (yet): waited for, then spent.
                None => self.wait_for(None),
            },
            (Stage::Publishing(next), Input::Published { won, found }) => match found {
                _ if won || ignore_lost => self.join(next),
                Some(other) => self.found(other),
                None => self.spent(),
            },
            (Stage::Spending, Input::Spent { won, found }) => match found {
                Some(other) if !won => self.found(other),
                _ => self.spent(),
            },
            (Stage::Waiting { since, from }, Input::Current(current)) => match current {
                Some(next) if next.gen > self.gen => self.found(next),
                _ if self.now >= since + self.patience => self.give_up_on(from),
                _ => {}
            },
            (Stage::Waiting { since, from }, Input::Timeout) => {
                if self.now >= since + self.patience {
                    self.give_up_on(from);
                } else {
                    self.effects.push_back(Effect::ReadCurrent);
                }
            }
            (stage, input) => panic!("regroup: {input:?} while {stage:?}"),
        }
        self.assert_invariants();
    }

    /// When the driver should hand [`Input::Timeout`]: the end of the patience while
    /// waiting (a driver polling more often hands it at each poll: a look).
    pub fn poll_timeout(&self) -> Option<Duration> {
        match self.stage {
            Stage::Waiting { since, .. } => Some(since + self.patience),
            _ => None,
        }
    }

    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    fn publish(&mut self) {
        let members = match self.mutation {
            Some(Mutation::KeepLost) => self.members.clone(),
            _ => self.members.without(&self.lost).expect("this rank is left"),
        };
        let next = Regrouped {
            gen: self.target,
            members,
        };
        self.stage = Stage::Publishing(next.clone());
        self.effects.push_back(Effect::Publish(next));
    }

    /// The number claimed is spent: look again at the next one.
    fn spent(&mut self) {
        self.target += 1;
        self.look();
    }

    fn found(&mut self, next: Regrouped) {
        if next.members.contains(self.rank) {
            self.join(next);
        } else {
            self.stage = Stage::Done;
            self.effects.push_back(Effect::Stop(Ending::Dropped {
                gen: next.gen,
                coordinator: next.coordinator(),
            }));
        }
    }

    fn join(&mut self, next: Regrouped) {
        self.stage = Stage::Done;
        let position = next.members.position(self.rank).expect("a member");
        self.effects.push_back(Effect::Joined {
            gen: next.gen,
            position,
            members: next.members,
        });
    }

    /// Nothing was published within the patience: the coordinator waited for is counted
    /// lost (and the decision taken again); a claim whose claimant never published is
    /// spent.
    fn give_up_on(&mut self, from: Option<u32>) {
        match from {
            Some(r) => {
                self.effects.push_back(Effect::Info(format!(
                    "rank {r} did not form generation {} within {:?}: counted lost",
                    self.target, self.patience
                )));
                self.lost.insert(r);
                self.look();
            }
            None => {
                self.effects.push_back(Effect::Info(format!(
                    "generation {} was claimed but not published within {:?}: spending the number",
                    self.target, self.patience
                )));
                self.stage = Stage::Spending;
                self.effects.push_back(Effect::Spend { gen: self.target });
            }
        }
    }

    fn assert_invariants(&self) {
        if !cfg!(any(debug_assertions, feature = "sim")) {
            return;
        }
        assert!(
            !self.lost.contains(&self.rank),
            "this rank counted itself lost"
        );
        assert!(self.members.contains(self.rank));
        assert!(self.target > self.gen, "claims only a later generation");
        if let Stage::Waiting { from, .. } = self.stage {
            assert_ne!(from, Some(self.rank), "waiting for itself");
            assert!(
                from.is_none_or(|r| !self.lost.contains(&r)),
                "waiting for a rank counted lost"
            );
        }
        if let Stage::Publishing(next) = &self.stage {
            assert_eq!(next.gen, self.target, "publishes the number it claimed");
        }
    }
}

/// Rank processes asking to come back (a requeued batch step, the same command run again
/// by hand), as a generation's coordinator sees them: each asks in a record of its own in
/// the current generation, and heartbeats it. A request counts once its heartbeat was seen
/// to advance and for as long as it is not still for dead-after (one liveness judgement,
/// `super::Liveness`): a request left behind by a process that died is not taken.
#[derive(Debug, Clone)]
pub struct Requests {
    liveness: super::Liveness,
    advanced: BTreeSet<u32>,
}

impl Requests {
    pub fn new(dead_after: Duration) -> Requests {
        Requests {
            liveness: super::Liveness::new(dead_after),
            advanced: BTreeSet::new(),
        }
    }

    /// What a read of `rank`'s request found (its heartbeat, or `None`: no request).
    pub fn observe(&mut self, rank: u32, seq: Option<u64>, at: impl Into<super::liveness::Stamp>) {
        match seq {
            Some(seq) => {
                if self.liveness.observe(rank, seq, at) {
                    self.advanced.insert(rank);
                }
            }
            None => {
                self.liveness.forget(rank);
                self.advanced.remove(&rank);
            }
        }
    }

    /// The ranks whose request is live at `now`.
    pub fn live(&self, now: Duration) -> BTreeSet<u32> {
        self.advanced
            .iter()
            .copied()
            .filter(|&r| !self.liveness.is_dead(r, now))
            .collect()
    }
}

/// The generation a coordinator forms at an iteration boundary for the ranks asking to
/// come back (`live`: their live requests): every member and every one of them, or
/// `None` when none is new. Growing never drops a member.
pub fn grow(members: &Members, live: &BTreeSet<u32>, num_nodes: u32) -> Option<Members> {
    let new: Vec<u32> = live
        .iter()
        .copied()
        .filter(|&r| r < num_nodes && !members.contains(r))
        .collect();
    if new.is_empty() {
        return None;
    }
    let mut ranks = members.ranks().to_vec();
    ranks.extend(new);
    Some(Members::try_from(ranks).expect("distinct ranks"))
}

/// What a process asking to come back as a rank does, as the driver performs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RejoinEffect {
    /// Read the run's newest generation record; answer [`RejoinInput::Current`].
    ReadCurrent,
    /// Ask (or keep asking) in generation `gen`: write this process's request there and
    /// heartbeat it from now on (one generation at a time).
    Ask { gen: u64 },
    /// A generation lists this rank: joined at `position`; the machine is done.
    Joined {
        gen: u64,
        position: u32,
        members: Members,
    },
}

/// What the driver tells a rejoining process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RejoinInput {
    Current(Option<Regrouped>),
    /// A poll: look again.
    Poll,
}

/// A process started for `rank` while the run's generation does not list it: it asks
/// in the current generation, and joins the first generation formed after it asked that
/// lists it (formed by the coordinator at an iteration boundary, [`grow`]).
///
/// A generation that still lists the rank, but was not formed for this process, is the
/// one its previous process was a member of (not yet found lost): it waits until a
/// generation without the rank is formed, and asks there. (The simulator found a
/// restarted process joining its dead predecessor's generation as if it were it.)
#[derive(Debug, Clone)]
pub struct Rejoin {
    rank: u32,
    /// The generation asked in.
    asked: Option<u64>,
    done: bool,
    effects: VecDeque<RejoinEffect>,
}

impl Rejoin {
    pub fn new(rank: u32) -> Rejoin {
        Rejoin {
            rank,
            asked: None,
            done: false,
            effects: VecDeque::from([RejoinEffect::ReadCurrent]),
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn handle(&mut self, input: RejoinInput) {
        if self.done {
            return;
        }
        match input {
            RejoinInput::Poll => self.effects.push_back(RejoinEffect::ReadCurrent),
            RejoinInput::Current(None) => {}
            RejoinInput::Current(Some(cur)) => match cur.members.position(self.rank) {
                Some(_) if self.asked.is_none_or(|asked| cur.gen <= asked) => {}
                Some(position) => {
                    self.done = true;
                    self.effects.push_back(RejoinEffect::Joined {
                        gen: cur.gen,
                        position,
                        members: cur.members,
                    });
                }
                None if self.asked != Some(cur.gen) => {
                    self.asked = Some(cur.gen);
                    self.effects.push_back(RejoinEffect::Ask { gen: cur.gen });
                }
                None => {}
            },
        }
    }

    pub fn poll_effect(&mut self) -> Option<RejoinEffect> {
        self.effects.pop_front()
    }
}

/// How a generation formed without some ranks does their share of an iteration: each
/// dropped rank's *uncommitted* work spread over the members, and one member standing in
/// for it (what is the rank's own and not work: its shard, written from its items under
/// its number, so the merge is unchanged). What the dropped rank committed stays: nothing
/// committed is redone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replan<T> {
    /// Each dropped rank's stand-in.
    pub stand_ins: BTreeMap<u32, u32>,
    /// What each member does beyond its own share: (dropped rank, item), in plan order.
    pub moved: BTreeMap<u32, Vec<(u32, T)>>,
}

impl<T> Replan<T> {
    /// What `member` does for the dropped ranks.
    pub fn moved_to(&self, member: u32) -> &[(u32, T)] {
        self.moved.get(&member).map_or(&[], Vec::as_slice)
    }

    /// One line per dropped rank, for the log: how many of its items not yet committed
    /// (as `committed` says) moved where.
    pub fn summary(&self, committed: impl Fn(u32, &T) -> bool) -> Vec<String> {
        let mut per: BTreeMap<u32, BTreeMap<u32, usize>> = BTreeMap::new();
        for (&to, items) in &self.moved {
            for (from, _) in items.iter().filter(|(from, item)| !committed(*from, item)) {
                *per.entry(*from).or_default().entry(to).or_default() += 1;
            }
        }
        self.stand_ins
            .iter()
            .map(|(&d, &s)| {
                let moved = per.get(&d).map_or_else(
                    || "no uncommitted item".to_string(),
                    |to| {
                        let n: usize = to.values().sum();
                        let to = to
                            .iter()
                            .map(|(r, k)| format!("{k} to rank {r}"))
                            .collect::<Vec<_>>()
                            .join(", ");
                        format!("{n} uncommitted item(s): {to}")
                    },
                );
                format!("rank {d} (dropped): {moved}; rank {s} stands in for its shard")
            })
            .collect()
    }
}

/// Each rank of `dropped` gets a member standing in for it: dealt from the highest
/// position down, so the coordinator (which also merges) is the last to take one.
pub fn stand_ins(members: &Members, dropped: &[u32]) -> BTreeMap<u32, u32> {
    let n = members.len() as usize;
    dropped
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            assert!(!members.contains(d), "rank {d} is a member");
            (d, members.rank_at((n - 1 - i % n) as u32))
        })
        .collect()
}

/// Spread the dropped ranks' shares (`shares`: each dropped rank's planned work, in plan
/// order, in units the caller chooses: a task with its samples keeps them together) over
/// `members`: dealt one unit at a time, to the member with the fewest so far (ties: the
/// highest position, so the coordinator comes last).
///
/// Every unit is dealt, committed or not, and each member skips, of what it is dealt,
/// what it finds committed (an exclusive create keeps a unit done twice exactly once).
/// Dealing only what one member sees uncommitted would not do: members see the commits
/// through caches of their own, two members' deals would then differ, and a unit could
/// fall to a member in one deal and to another in the other, so that neither does it.
/// Dealt from the plan alone, every member computes the same deal.
pub fn replan<T: Clone>(members: &Members, shares: &BTreeMap<u32, Vec<T>>) -> Replan<T> {
    replan_with(members, shares, None)
}

#[doc(hidden)]
pub fn replan_with<T: Clone>(
    members: &Members,
    shares: &BTreeMap<u32, Vec<T>>,
    mutation: Option<Mutation>,
) -> Replan<T> {
    let dropped: Vec<u32> = shares.keys().copied().collect();
    let n = members.len() as usize;
    let mut counts = vec![0usize; n];
    let mut moved: BTreeMap<u32, Vec<(u32, T)>> = BTreeMap::new();
    let skip = super::mutation(mutation) == Some(Mutation::NoReplan);
    for (&d, items) in shares.iter().filter(|_| !skip) {
        for item in items {
            let p = (0..n)
                .rev()
                .min_by_key(|&p| counts[p])
                .expect("a member at least");
            counts[p] += 1;
            moved
                .entry(members.rank_at(p as u32))
                .or_default()
                .push((d, item.clone()));
        }
    }
    Replan {
        stand_ins: stand_ins(members, &dropped),
        moved,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn set(r: &[u32]) -> BTreeSet<u32> {
        r.iter().copied().collect()
    }

    fn members(r: &[u32]) -> Members {
        Members::try_from(r.to_vec()).unwrap()
    }

    fn drain(g: &mut Regroup) -> Vec<Effect> {
        std::iter::from_fn(|| g.poll_effect())
            .filter(|e| !matches!(e, Effect::Info(_)))
            .collect()
    }

    #[test]
    fn positions_follow_rank_order_and_the_lowest_rank_coordinates() {
        let m = members(&[4, 1, 3]);
        assert_eq!(m.ranks(), &[1, 3, 4]);
        assert_eq!(m.coordinator(), 1);
        assert_eq!(m.position(3), Some(1));
        assert_eq!(m.position(0), None);
        assert_eq!(m.rank_at(2), 4);
        assert_eq!(m.dropped(5), vec![0, 2]);
        assert_eq!(Members::all(3).ranks(), &[0, 1, 2]);
        assert!(Members::try_from(vec![]).is_err());
        assert!(Members::try_from(vec![2, 2]).unwrap_err().contains("twice"));
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, "[1,3,4]");
        assert_eq!(serde_json::from_str::<Members>(&json).unwrap(), m);
        assert!(serde_json::from_str::<Members>("[1,1]").is_err());
    }

    #[test]
    fn the_lowest_survivor_claims_and_publishes_the_members_left() {
        let mut g = Regroup::new(1, 4, Members::all(4), set(&[0]), 2, 10 * SEC, SEC);
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 5 }]);
        g.handle(
            SEC,
            Input::Claimed {
                won: true,
                published: None,
            },
        );
        let next = Regrouped {
            gen: 5,
            members: members(&[1, 2, 3]),
        };
        assert_eq!(drain(&mut g), vec![Effect::Publish(next.clone())]);
        g.handle(
            SEC,
            Input::Published {
                won: true,
                found: None,
            },
        );
        assert_eq!(
            drain(&mut g),
            vec![Effect::Joined {
                gen: 5,
                position: 0,
                members: next.members
            }]
        );
        assert!(g.is_done());
    }

    #[test]
    fn a_survivor_waits_for_the_coordinator_and_joins_at_its_position() {
        let mut g = Regroup::new(3, 4, Members::all(4), set(&[1]), 2, 10 * SEC, SEC);
        assert_eq!(drain(&mut g), vec![Effect::ReadCurrent]);
        // The old generation's record first: keep waiting.
        g.handle(2 * SEC, Input::Current(None));
        assert_eq!(drain(&mut g), vec![]);
        assert_eq!(g.poll_timeout(), Some(11 * SEC));
        g.handle(
            3 * SEC,
            Input::Current(Some(Regrouped {
                gen: 5,
                members: members(&[0, 2, 3]),
            })),
        );
        assert_eq!(
            drain(&mut g),
            vec![Effect::Joined {
                gen: 5,
                position: 2,
                members: members(&[0, 2, 3])
            }]
        );
    }

    #[test]
    fn a_lost_claim_is_never_acted_on() {
        // Rank 2 counts ranks 0 and 1 lost; rank 1 was not, and formed generation 5
        // without rank 2.
        let mut g = Regroup::new(2, 4, Members::all(4), set(&[0, 1]), 2, 10 * SEC, SEC);
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 5 }]);
        g.handle(
            SEC,
            Input::Claimed {
                won: false,
                published: Some(Regrouped {
                    gen: 5,
                    members: members(&[1, 3]),
                }),
            },
        );
        assert_eq!(
            drain(&mut g),
            vec![Effect::Stop(Ending::Dropped {
                gen: 5,
                coordinator: 1
            })]
        );
    }

    #[test]
    fn a_coordinator_silent_past_the_patience_is_counted_lost_and_replaced() {
        let mut g = Regroup::new(2, 4, Members::all(3), set(&[0]), 1, 10 * SEC, SEC);
        assert_eq!(drain(&mut g), vec![Effect::ReadCurrent]);
        g.handle(5 * SEC, Input::Timeout);
        assert_eq!(drain(&mut g), vec![Effect::ReadCurrent], "not yet");
        g.handle(11 * SEC, Input::Timeout);
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 5 }]);
        assert_eq!(g.lost(), &set(&[0, 1]));
        g.handle(
            11 * SEC,
            Input::Claimed {
                won: true,
                published: None,
            },
        );
        assert!(matches!(
            drain(&mut g).as_slice(),
            [Effect::Publish(Regrouped { gen: 5, members })] if members.ranks() == [2]
        ));
    }

    #[test]
    fn a_number_claimed_and_never_published_is_spent_once_by_an_exclusive_create() {
        // Rank 1 claimed generation 5 and was lost before it published; rank 2 waited.
        let mut g = Regroup::new(2, 4, Members::all(4), set(&[0]), 2, 10 * SEC, SEC);
        assert_eq!(drain(&mut g), vec![Effect::ReadCurrent]);
        g.handle(11 * SEC, Input::Timeout);
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 5 }]);
        let taken = Input::Claimed {
            won: false,
            published: None,
        };
        g.handle(11 * SEC, taken.clone());
        assert_eq!(drain(&mut g), vec![Effect::ReadCurrent]);
        g.handle(22 * SEC, Input::Timeout);
        assert_eq!(drain(&mut g), vec![Effect::Spend { gen: 5 }]);
        g.handle(
            22 * SEC,
            Input::Spent {
                won: true,
                found: None,
            },
        );
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 6 }]);
        // Had rank 1 published first, rank 2 would follow it.
        let mut h = Regroup::new(2, 4, Members::all(4), set(&[0, 1]), 2, 10 * SEC, SEC);
        drain(&mut h);
        h.handle(SEC, taken);
        drain(&mut h);
        h.handle(12 * SEC, Input::Timeout);
        assert_eq!(drain(&mut h), vec![Effect::Spend { gen: 5 }]);
        let five = Regrouped {
            gen: 5,
            members: members(&[1, 2, 3]),
        };
        h.handle(
            12 * SEC,
            Input::Spent {
                won: false,
                found: Some(five.clone()),
            },
        );
        assert_eq!(
            drain(&mut h),
            vec![Effect::Joined {
                gen: 5,
                position: 1,
                members: five.members
            }]
        );
    }

    #[test]
    fn a_claimant_that_finds_its_number_spent_claims_the_next() {
        let mut g = Regroup::new(1, 4, Members::all(4), set(&[0]), 2, 10 * SEC, SEC);
        drain(&mut g);
        g.handle(
            SEC,
            Input::Claimed {
                won: true,
                published: None,
            },
        );
        drain(&mut g);
        g.handle(
            SEC,
            Input::Published {
                won: false,
                found: None,
            },
        );
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 6 }]);
    }

    #[test]
    fn below_min_nodes_every_survivor_stops_and_says_who_was_lost() {
        let mut g = Regroup::new(1, 2, Members::all(3), set(&[0, 2]), 2, 10 * SEC, SEC);
        let effects = drain(&mut g);
        let [Effect::Stop(ending)] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        assert_eq!(
            ending.to_string(),
            "rank(s) 0, 2 lost, 1 node(s) left (1), below cluster.min-nodes = 2: the cluster stops"
        );
        assert!(g.is_done());
        // With the default (min-nodes = num-nodes), any loss stops.
        let mut g = Regroup::new(0, 2, Members::all(3), set(&[2]), 3, 10 * SEC, SEC);
        assert!(matches!(
            drain(&mut g).as_slice(),
            [Effect::Stop(Ending::BelowMin { .. })]
        ));
    }

    #[test]
    fn a_smaller_generation_shrinks_again_from_its_own_members() {
        let mut g = Regroup::new(3, 5, members(&[1, 3, 4]), set(&[1]), 2, 10 * SEC, SEC);
        assert_eq!(drain(&mut g), vec![Effect::Claim { gen: 6 }]);
        g.handle(
            SEC,
            Input::Claimed {
                won: true,
                published: None,
            },
        );
        assert!(matches!(
            drain(&mut g).as_slice(),
            [Effect::Publish(Regrouped { gen: 6, members }), ..] if members.ranks() == [3, 4]
        ));
    }

    #[test]
    fn a_dropped_ranks_share_is_dealt_and_its_committed_items_are_not_redone() {
        let members = members(&[0, 1, 3]);
        let shares = BTreeMap::from([(2, vec!["a", "b", "c", "d", "e"])]);
        let plan = replan(&members, &shares);
        assert_eq!(plan.stand_ins, BTreeMap::from([(2, 3)]));
        // Dealt from the highest position down, the coordinator last.
        assert_eq!(plan.moved_to(3), &[(2, "a"), (2, "d")]);
        assert_eq!(plan.moved_to(1), &[(2, "b"), (2, "e")]);
        assert_eq!(plan.moved_to(0), &[(2, "c")]);
        // "b" was committed before rank 2 was lost: it is not redone.
        assert_eq!(
            plan.summary(|_, item| *item == "b"),
            vec!["rank 2 (dropped): 4 uncommitted item(s): 1 to rank 0, 1 to rank 1, 2 to rank 3; rank 3 stands in for its shard"]
        );
        assert_eq!(
            plan.summary(|_, _| true),
            vec!["rank 2 (dropped): no uncommitted item; rank 3 stands in for its shard"]
        );
        assert!(replan_with(&members, &shares, Some(Mutation::NoReplan))
            .moved
            .is_empty());
    }

    #[test]
    fn stand_ins_spare_the_coordinator_until_every_other_member_has_one() {
        let m = members(&[0, 4, 5]);
        assert_eq!(
            stand_ins(&m, &[1, 2, 3, 6]),
            BTreeMap::from([(1, 5), (2, 4), (3, 0), (6, 5)])
        );
    }

    proptest::proptest! {
        /// Every item of every dropped rank is dealt exactly once, to a member; the
        /// members' extra work differs by one at most; every member computes the same.
        #[test]
        fn a_replan_is_an_exact_balanced_partition(
            n in 2u32..12,
            dropped_mask in proptest::collection::vec(proptest::bool::ANY, 12),
            sizes in proptest::collection::vec(0usize..20, 12),
        ) {
            let dropped: Vec<u32> = (0..n).filter(|&r| dropped_mask[r as usize]).collect();
            let live: Vec<u32> = (0..n).filter(|r| !dropped.contains(r)).collect();
            proptest::prop_assume!(!live.is_empty() && !dropped.is_empty());
            let members = Members::try_from(live).unwrap();
            let shares: BTreeMap<u32, Vec<(u32, usize)>> = dropped
                .iter()
                .map(|&d| (d, (0..sizes[d as usize]).map(|i| (d, i)).collect()))
                .collect();
            let plan = replan(&members, &shares);
            let mut done: Vec<(u32, usize)> = plan
                .moved
                .iter()
                .flat_map(|(to, items)| {
                    assert!(members.contains(*to));
                    items.iter().map(|(from, item)| {
                        assert_eq!(*from, item.0);
                        *item
                    })
                })
                .collect();
            done.sort();
            let mut expected: Vec<(u32, usize)> = shares.values().flatten().copied().collect();
            expected.sort();
            proptest::prop_assert_eq!(done, expected);
            let counts: Vec<usize> = members.ranks().iter().map(|&r| plan.moved_to(r).len()).collect();
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            proptest::prop_assert!(hi - lo <= 1, "{:?}", counts);
            proptest::prop_assert_eq!(plan.stand_ins.len(), dropped.len());
            proptest::prop_assert_eq!(replan(&members, &shares), plan);
        }
    }

    #[test]
    fn a_live_request_grows_the_generation_back_and_a_dead_one_does_not() {
        let mut q = Requests::new(10 * SEC);
        q.observe(2, Some(1), SEC);
        assert!(q.live(SEC).is_empty(), "one heartbeat proves nothing yet");
        q.observe(2, Some(2), 2 * SEC);
        q.observe(4, Some(7), 2 * SEC);
        q.observe(4, Some(8), 3 * SEC);
        assert_eq!(q.live(3 * SEC), set(&[2, 4]));
        // Rank 4's request goes still; rank 2's goes away.
        q.observe(4, Some(8), 14 * SEC);
        q.observe(2, None, 14 * SEC);
        assert!(q.live(14 * SEC).is_empty());
        let m = members(&[0, 1, 3]);
        assert_eq!(grow(&m, &set(&[2, 5]), 5), Some(members(&[0, 1, 2, 3])));
        assert_eq!(grow(&m, &set(&[1]), 5), None, "already a member");
    }

    #[test]
    fn a_rejoining_process_asks_in_each_generation_and_joins_the_one_that_lists_it() {
        let mut j = Rejoin::new(2);
        assert_eq!(j.poll_effect(), Some(RejoinEffect::ReadCurrent));
        // Its predecessor's generation, which still lists it: not its to join.
        j.handle(RejoinInput::Current(Some(Regrouped {
            gen: 3,
            members: Members::all(4),
        })));
        assert_eq!(j.poll_effect(), None);
        let without = |gen| Regrouped {
            gen,
            members: members(&[0, 1, 3]),
        };
        j.handle(RejoinInput::Current(Some(without(4))));
        assert_eq!(j.poll_effect(), Some(RejoinEffect::Ask { gen: 4 }));
        j.handle(RejoinInput::Poll);
        assert_eq!(j.poll_effect(), Some(RejoinEffect::ReadCurrent));
        j.handle(RejoinInput::Current(Some(without(4))));
        assert_eq!(j.poll_effect(), None, "asked there already");
        j.handle(RejoinInput::Current(Some(without(5))));
        assert_eq!(j.poll_effect(), Some(RejoinEffect::Ask { gen: 5 }));
        j.handle(RejoinInput::Current(Some(Regrouped {
            gen: 6,
            members: Members::all(4),
        })));
        assert_eq!(
            j.poll_effect(),
            Some(RejoinEffect::Joined {
                gen: 6,
                position: 2,
                members: Members::all(4)
            })
        );
        assert!(j.is_done());
    }
}
