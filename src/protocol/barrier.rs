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
//! A barrier is typed by what it gathers (`G`) and broadcasts (`B`), the messages of
//! [`super::messages`]: the machine writes them into the marks and reads them back from
//! the peers' records, where a payload that does not decode reads as empty.

use super::messages::Payload;
use super::records::{missing_arrivals, Mark, RankRecord};
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
}

/// Barrier number `k` (the node's k-th barrier of the generation) as seen by `rank`.
#[derive(Debug, Clone)]
pub struct Barrier<G, B> {
    k: u64,
    rank: u32,
    iteration: u64,
    name: String,
    gather: G,
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
            mutation: None,
            broadcast: PhantomData,
        }
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
}
