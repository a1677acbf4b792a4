//! One barrier with gather and broadcast, as a pure state machine.
//!
//! Every rank publishes its arrival (`Mark { k, payload }`, the gathered value) in its
//! live record. Rank 0 completes barrier `k` once every other rank's record shows an
//! arrival at `k` or later, computes the broadcast from the gathered payloads (in rank
//! order) and publishes it as its release; a worker passes once rank 0's record shows a
//! release at `k` or later. Arrival and release positions only grow, so a record read
//! late (a stale cache) can only say "not yet", never "yes" too early.
//!
//! The machine owns no clock and does no I/O: the driver publishes [`Barrier::arrival`],
//! feeds it the peers' records as read ([`Barrier::on_records`]) and acts on the
//! [`Progress`] it answers (publish the release, keep waiting and say for whom, pass).
//! The simulator (tests/sim/) drives the same machine over a simulated shared
//! directory.
//!
//! In a cluster of groups ([`super::topology`]) the gather has two levels: a group's
//! leader waits for its members' arrivals and publishes the group's arrival (every
//! member's payload, in rank order, as one array) in its record's `group` mark
//! ([`Barrier::group_arrival`]), and rank 0 completes the barrier once every leader's
//! group mark is at `k` or later, reading the members' payloads from there. The
//! release is the same. A group mark, like an arrival, only grows.
//!
//! A barrier is typed by what it gathers (`G`) and broadcasts (`B`), the messages of
//! [`super::messages`]: the machine writes them into the marks and reads them back from
//! the peers' records, where a payload that does not decode reads as empty.

use super::messages::Payload;
use super::records::{missing_arrivals, Mark, RankRecord};
use super::topology::Topology;
use std::marker::PhantomData;

/// Where a barrier stands after the records were read.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress<G, B> {
    /// Still waiting: rank 0 for these ranks' arrivals; a worker for rank 0's release
    /// (`missing` is `[0]`).
    Waiting { missing: Vec<u32> },
    /// Rank 0: every rank arrived. `payloads` are the gathered values in rank order
    /// (rank 0's own first); the driver computes the broadcast and publishes
    /// [`Barrier::release`] with it.
    Complete { payloads: Vec<G> },
    /// A worker: rank 0 released the barrier with this broadcast.
    Released { broadcast: B },
}

/// A deliberately wrong barrier, for showing that the simulator catches it. Never set
/// by the node.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// Rank 0 completes the barrier with one arrival still missing.
    ReleaseOneEarly,
    /// A worker passes on any release, also an older barrier's.
    AcceptStaleRelease,
    /// Rank 0 counts as arrived every rank whose file it can list, whatever the file
    /// says: the `ls | wc -l` of a flag-file barrier, where a file left by an earlier
    /// barrier or a rank's join counts as an arrival.
    CountListed,
    /// A group's leader publishes its group's arrival with one member still missing.
    GroupOneEarly,
}

/// Barrier number `k` (the node's k-th barrier of the generation) as seen by `rank`.
#[derive(Debug, Clone)]
pub struct Barrier<G, B> {
    k: u64,
    rank: u32,
    iteration: u64,
    name: String,
    gather: G,
    /// `None`: flat, over as many ranks as records are handed in.
    topology: Option<Topology>,
    mutation: Option<Mutation>,
    broadcast: PhantomData<fn() -> B>,
}

impl<G: Payload + Clone, B: Payload> Barrier<G, B> {
    pub fn new(k: u64, rank: u32, iteration: u64, name: &str, gather: G) -> Barrier<G, B> {
        Barrier {
            k,
            rank,
            iteration,
            name: name.to_string(),
            gather,
            topology: None,
            mutation: None,
            broadcast: PhantomData,
        }
    }

    /// The barrier in a cluster of this shape (flat by default).
    pub fn in_topology(mut self, t: Topology) -> Barrier<G, B> {
        self.topology = (!t.is_flat()).then_some(t);
        self
    }

    #[doc(hidden)]
    pub fn with_mutation(mut self, m: Option<Mutation>) -> Barrier<G, B> {
        self.mutation = super::mutation(m);
        self
    }

    pub fn k(&self) -> u64 {
        self.k
    }

    /// What this rank publishes as its arrival.
    pub fn arrival(&self) -> Mark {
        Mark {
            k: self.k,
            iteration: self.iteration,
            name: self.name.clone(),
            payload: self.gather.write(),
        }
    }

    /// What rank 0 publishes as its release, with the broadcast it computed.
    pub fn release(&self, broadcast: &B) -> Mark {
        Mark {
            payload: broadcast.write(),
            ..self.arrival()
        }
    }

    /// The barrier's progress given every rank's record as read (index = rank; this
    /// rank's own entry is not looked at).
    pub fn on_records(&self, records: &[Option<RankRecord>]) -> Progress<G, B> {
        let mutation = self.mutation;
        if let (0, Some(t)) = (self.rank, &self.topology) {
            return self.gather_groups(t, records);
        }
        if self.rank == 0 {
            let missing = match mutation {
                Some(Mutation::CountListed) => (1..records.len() as u32)
                    .filter(|&r| records[r as usize].is_none())
                    .collect(),
                _ => missing_arrivals(records, self.k),
            };
            let complete = match mutation {
                Some(Mutation::ReleaseOneEarly) => missing.len() <= 1,
                _ => missing.is_empty(),
            };
            if !complete {
                return Progress::Waiting { missing };
            }
            let mut payloads = vec![self.gather.clone()];
            // A rank counted without an arrival (only a mutation does that) reads as
            // having gathered `null`.
            payloads.extend(records.iter().skip(1).map(|r| {
                let arrived = r.as_ref().and_then(|r| r.arrived.as_ref());
                G::read(arrived.map_or(&serde_json::Value::Null, |m| &m.payload))
            }));
            Progress::Complete { payloads }
        } else {
            let wanted = match mutation {
                Some(Mutation::AcceptStaleRelease) => 0,
                _ => self.k,
            };
            match records
                .first()
                .and_then(|r0| r0.as_ref())
                .and_then(|r0| r0.released.as_ref())
                .filter(|m| m.k >= wanted)
            {
                Some(m) => Progress::Released {
                    broadcast: B::read(&m.payload),
                },
                None => Progress::Waiting { missing: vec![0] },
            }
        }
    }

    /// Rank 0 in a cluster of groups: complete once every leader's group mark is at `k`
    /// or later, with the payloads in rank order. A missing group is named by the
    /// members its leader says it waits for (its `waiting_for`, once it arrived here
    /// itself), else by its leader.
    fn gather_groups(&self, t: &Topology, records: &[Option<RankRecord>]) -> Progress<G, B> {
        let mut missing = Vec::new();
        let mut payloads = vec![self.gather.clone()];
        for leader in t.leaders() {
            let rec = records.get(leader as usize).and_then(|r| r.as_ref());
            let size = t.group_of(leader).len();
            let group = rec.and_then(|r| r.grouped_at(self.k));
            let items = group.and_then(|m| m.payload.as_array());
            if group.is_none() {
                let named = rec
                    .filter(|r| r.arrived_at(self.k) && !r.waiting_for.is_empty())
                    .map(|r| r.waiting_for.clone());
                missing.extend(named.unwrap_or_else(|| vec![leader]));
            }
            // A group counted without its mark (only a mutation does that), or a payload
            // that is not an array of the group's size, reads as having gathered `null`.
            payloads.extend((0..size).map(|i| {
                G::read(
                    items
                        .and_then(|a| a.get(i))
                        .unwrap_or(&serde_json::Value::Null),
                )
            }));
        }
        let complete = match self.mutation {
            Some(Mutation::ReleaseOneEarly) => missing.len() <= 1,
            _ => missing.is_empty(),
        };
        if complete {
            Progress::Complete { payloads }
        } else {
            Progress::Waiting { missing }
        }
    }

    /// A group's leader: its group's arrival to publish once every member's record shows
    /// an arrival at `k` or later (its payload: every rank's gathered value in rank
    /// order, the leader's first), else the members still missing.
    pub fn group_arrival(&self, records: &[Option<RankRecord>]) -> Result<Mark, Vec<u32>> {
        let t = self.topology.expect("a leader is in a cluster of groups");
        let members = t.members(self.rank);
        let arrival = |r: u32| {
            records
                .get(r as usize)
                .and_then(|rec| rec.as_ref())
                .and_then(|rec| rec.arrived.as_ref())
                .filter(|m| m.k >= self.k)
        };
        let missing: Vec<u32> = members.clone().filter(|&r| arrival(r).is_none()).collect();
        let complete = match self.mutation {
            Some(Mutation::GroupOneEarly) => missing.len() <= 1,
            _ => missing.is_empty(),
        };
        if !complete {
            return Err(missing);
        }
        let mut payload = vec![self.gather.write()];
        payload.extend(members.map(|r| {
            // Re-encoded as decoded, so a payload that does not decode reads as empty
            // here as it would at rank 0.
            let raw = arrival(r).map_or(&serde_json::Value::Null, |m| &m.payload);
            G::read(raw).write()
        }));
        Ok(Mark {
            payload: serde_json::Value::Array(payload),
            ..self.arrival()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::messages::{EvalDecision, Plain};
    use crate::protocol::NodeState;
    use serde::{Deserialize, Serialize};
    use serde_json::{json, Value};

    /// A gather for the tests: the rank's number.
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
    struct N(u64);
    impl Plain for N {}

    fn rec(rank: u32, arrived: Option<u64>, released: Option<(u64, Value)>) -> RankRecord {
        let mark = |k: u64, payload: Value| Mark {
            k,
            iteration: 1,
            name: "b".into(),
            payload,
        };
        RankRecord {
            state: NodeState::Running,
            iteration: 1,
            arrived: arrived.map(|k| mark(k, json!(rank))),
            released: released.map(|(k, p)| mark(k, p)),
            ..RankRecord::vacant("r", 1, rank)
        }
    }

    #[test]
    fn rank_0_completes_only_when_every_rank_arrived_and_gathers_in_rank_order() {
        let b = Barrier::<N, ()>::new(3, 0, 1, "b", N(100));
        let mut recs = vec![
            None,
            Some(rec(1, Some(3), None)),
            Some(rec(2, Some(2), None)),
        ];
        assert_eq!(b.on_records(&recs), Progress::Waiting { missing: vec![2] });
        recs[2] = None;
        assert_eq!(b.on_records(&recs), Progress::Waiting { missing: vec![2] });
        recs[2] = Some(rec(2, Some(4), None));
        assert_eq!(
            b.on_records(&recs),
            Progress::Complete {
                payloads: vec![N(100), N(1), N(2)]
            }
        );
        // A peer's arrival that does not decode is gathered as empty.
        recs[1].as_mut().unwrap().arrived.as_mut().unwrap().payload = json!("one");
        assert_eq!(
            b.on_records(&recs),
            Progress::Complete {
                payloads: vec![N(100), N(0), N(2)]
            }
        );
    }

    #[test]
    fn a_worker_passes_on_this_or_a_later_release_only() {
        let b = Barrier::<(), EvalDecision>::new(3, 2, 1, "b", ());
        let r0 = |k, payload| vec![Some(rec(0, Some(k), Some((k, payload)))), None, None];
        let yes = json!({"eval": true});
        assert_eq!(
            b.on_records(&r0(2, yes.clone())),
            Progress::Waiting { missing: vec![0] }
        );
        assert_eq!(
            b.on_records(&r0(3, yes.clone())),
            Progress::Released {
                broadcast: EvalDecision { eval: true }
            }
        );
        assert!(matches!(
            b.on_records(&r0(5, yes)),
            Progress::Released { .. }
        ));
        // A release that does not decode passes with the empty broadcast: no eval.
        assert_eq!(
            b.on_records(&r0(3, json!({"eval": 1}))),
            Progress::Released {
                broadcast: EvalDecision { eval: false }
            }
        );
        assert_eq!(
            b.on_records(&[None]),
            Progress::Waiting { missing: vec![0] }
        );
        assert_eq!(
            b.release(&EvalDecision { eval: true }),
            Mark {
                k: 3,
                iteration: 1,
                name: "b".into(),
                payload: json!({"eval": true})
            }
        );
        assert_eq!(b.arrival().payload, Value::Null);
    }

    #[test]
    fn in_groups_a_leader_gathers_its_members_and_rank_0_reads_only_the_leaders() {
        // 6 nodes in groups of 3 workers: 1-3 (leader 1) and 4-5 (leader 4).
        let t = Topology::grouped(6, 3);
        let mut recs: Vec<Option<RankRecord>> =
            (0..6).map(|r| Some(rec(r, Some(2), None))).collect();
        recs[3] = Some(rec(3, Some(1), None));
        let leader = Barrier::<N, ()>::new(2, 1, 1, "b", N(1)).in_topology(t);
        assert_eq!(
            leader.group_arrival(&recs),
            Err(vec![3]),
            "rank 3 is at barrier 1"
        );
        recs[3] = Some(rec(3, Some(2), None));
        let mark = leader.group_arrival(&recs).unwrap();
        assert_eq!((mark.k, mark.payload.clone()), (2, json!([1, 2, 3])));
        // Rank 0 ignores the members' own arrivals: it waits for both group marks, and
        // names the members a leader says it waits for.
        let zero = Barrier::<N, ()>::new(2, 0, 1, "b", N(100)).in_topology(t);
        recs[4].as_mut().unwrap().waiting_for = vec![5];
        assert_eq!(
            zero.on_records(&recs),
            Progress::Waiting {
                missing: vec![1, 5]
            }
        );
        recs[1].as_mut().unwrap().group = Some(mark);
        recs[4].as_mut().unwrap().group = Some(Mark {
            k: 2,
            iteration: 1,
            name: "b".into(),
            payload: json!([4, "five"]),
        });
        assert_eq!(
            zero.on_records(&recs),
            Progress::Complete {
                payloads: vec![N(100), N(1), N(2), N(3), N(4), N(0)]
            },
            "in rank order; a payload that does not decode is empty"
        );
        // A group mark of an earlier barrier is not this one's.
        recs[4].as_mut().unwrap().group.as_mut().unwrap().k = 1;
        assert_eq!(
            zero.on_records(&recs),
            Progress::Waiting { missing: vec![5] }
        );
        recs[4].as_mut().unwrap().waiting_for.clear();
        assert_eq!(
            zero.on_records(&recs),
            Progress::Waiting { missing: vec![4] }
        );
    }
}
