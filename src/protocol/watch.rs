//! One round of watching peers: what a node concludes from the records it just read.
//!
//! Who watches whom is fixed by the cluster's [`Topology`]: flat, rank 0 reads every
//! worker's record and a worker only rank 0's (rank 0 relays what workers need to know,
//! such as an abort); in groups, rank 0 reads the leaders and a leader its members too
//! (it relays their aborts to rank 0 the same way). For
//! each record read, in rank order, [`Watch::round`] decides: a process refused a vacant
//! rank (noted), the rank was taken over by another process, the record carries an abort
//! (adopt it), or, once the generation has formed, the rank's heartbeat has been still for
//! dead-after (dead; during a dynamic rollout only noted, as its items are taken over).
//! The first finding that stops the node ends the round.
//!
//! Pure: the records are handed in as read, time as the observer's monotonic
//! [`Duration`]. The node performs the reads and acts on the findings
//! (`Node::poll_cluster`); the simulator calls the same function.

use super::liveness::Stamp;
use super::topology::Topology;
use super::{AbortInfo, Liveness, NodeState, RankRecord};
use std::collections::HashMap;
use std::time::{Duration, SystemTime};

/// What a node reads in one round ([`to_read`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Reads {
    pub ranks: Vec<u32>,
    /// The one rank, still missing at the barrier and read lately, that this round looks
    /// at again for its arrival: once it is in, the others still missing are read too
    /// ([`missing`]), in the same round.
    pub probe: Option<u32>,
}

/// Where a node is, for what it reads in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    /// Not at a barrier.
    Away,
    /// At a barrier, waiting for rank 0's release only.
    Barrier,
    /// Gathering arrivals at barrier k (rank 0, or a group's leader).
    Gathering(u64),
}

/// The ranks `me` reads this round, of those it watches ([`Topology::watched`]). Away
/// from barriers only those not read within `refresh` (their
/// heartbeat and an abort are due a look: a node's poll rounds come every few
/// milliseconds when a phase is quick, and the cluster's state changes at barriers).
/// At a barrier rank 0 is always read (its release). A node gathering at barrier k (rank
/// 0, or a group's leader) reads the others so: a rank
/// whose last record read shows it in (an arrival; at rank 0 in a cluster of groups, the
/// leader's group mark: either stands until the release) only once per `refresh` (for its
/// heartbeat and an abort), and of the ranks still missing that it read within `refresh`
/// only one, the one read longest ago: the others arrive about when it does, and rank 0
/// polled every missing rank every round before (about 5 reads of each per barrier at 64
/// nodes). Rank 0 itself is always read. `last_read[r]` is when rank r's record was last
/// read.
pub fn to_read(
    me: u32,
    topology: &Topology,
    peers: &[Option<RankRecord>],
    at: At,
    last_read: &[Option<Duration>],
    now: Duration,
    refresh: Duration,
) -> Reads {
    let watched = topology.watched(me);
    let read_at = |r: u32| last_read.get(r as usize).copied().flatten();
    let recent = |r: u32| read_at(r).is_some_and(|t| now.saturating_sub(t) < refresh);
    let k = match at {
        At::Gathering(k) => k,
        At::Away | At::Barrier => {
            let ranks = watched
                .into_iter()
                .filter(|&r| (r == 0 && at == At::Barrier) || !recent(r))
                .collect();
            return Reads { ranks, probe: None };
        }
    };
    let is_in = |r: u32| arrived(me, topology, peers, r, k);
    let probe = watched
        .iter()
        .copied()
        .filter(|&r| r != 0 && recent(r) && !is_in(r))
        .min_by_key(|&r| (read_at(r), r));
    let ranks = watched
        .into_iter()
        .filter(|&r| r == 0 || !recent(r) || Some(r) == probe)
        .collect();
    Reads { ranks, probe }
}

/// Whether rank `r`'s record, as `me` last read it, shows it in at barrier `k`: its
/// arrival, or at rank 0 in a cluster of groups its group's arrival.
fn arrived(me: u32, topology: &Topology, peers: &[Option<RankRecord>], r: u32, k: u64) -> bool {
    let peer = peers.get(r as usize).and_then(|p| p.as_ref());
    peer.is_some_and(|p| match me == 0 && !topology.is_flat() {
        true => p.grouped_at(k).is_some(),
        false => p.arrived_at(k),
    })
}

/// The ranks `me` watches that its reads do not show in at barrier `k` (rank 0 aside).
pub fn missing(me: u32, topology: &Topology, peers: &[Option<RankRecord>], k: u64) -> Vec<u32> {
    topology
        .watched(me)
        .into_iter()
        .filter(|&r| r != 0 && !arrived(me, topology, peers, r, k))
        .collect()
}

/// What a node knows while it watches: its peers as last read, the processes that
/// joined its generation, and their liveness.
#[derive(Debug, Clone)]
pub struct Watch {
    /// The last valid record read of each rank.
    pub peers: Vec<Option<RankRecord>>,
    /// The nonce of each rank's process as of the join: a change means it was replaced.
    pub nonces: HashMap<u32, String>,
    pub liveness: Liveness,
    /// The generation has formed (its join released): from now on a silent peer is dead.
    pub formed: bool,
    /// During a dynamic rollout a dead peer is noted, not a reason to stop.
    pub tolerate_dead: bool,
}

/// A finding that does not stop the node.
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    /// A process refused this still-vacant rank and left why in the placeholder.
    Refused { rank: u32, why: String },
    /// The rank is dead, and tolerated (its work is taken over).
    DeadTolerated(u32),
}

/// A finding that stops the node.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// Another process now writes the rank's record.
    TakenOver { rank: u32, host: String, pid: u32 },
    /// The record carries an abort: it is the cause, to be adopted.
    Abort(AbortInfo),
    /// The rank ended (`state`: left, or failed without an abort to say why) in a formed
    /// generation: it will never arrive anywhere. E.g. a worker that gave up on the
    /// generation (its join-timeout, or it took rank 0 for gone) just after rank 0
    /// counted it as joined.
    Ended {
        rank: u32,
        host: String,
        state: NodeState,
    },
    /// The rank's heartbeat has been still for `silent`; `last` is how it was last seen.
    Dead {
        rank: u32,
        silent: Duration,
        last: Option<Box<RankRecord>>,
    },
}

/// What one round concluded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Round {
    pub notes: Vec<Note>,
    pub stop: Option<Stop>,
}

/// A deliberately wrong judgement, for showing that the simulator catches it. Never set
/// by the node.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A peer is dead once the wall-clock stamp its record was written with is older than
    /// dead-after by this node's wall clock, `now`: what a judge of written timestamps or
    /// file mtimes does. The nodes' wall clocks disagree (by minutes on a badly kept
    /// cluster), so a node whose clock is ahead finds live peers dead.
    WallClock { now: SystemTime },
}

/// How old a record's wall-clock stamp is by the wall clock `now` (None: no stamp, or a
/// stamp from `now`'s future).
fn stamp_age(stamp: &str, now: SystemTime) -> Option<Duration> {
    let written = chrono::DateTime::parse_from_rfc3339(stamp).ok()?;
    now.duration_since(SystemTime::from(written)).ok()
}

impl Watch {
    pub fn new(num_nodes: u32, liveness: Liveness) -> Watch {
        Watch {
            peers: vec![None; num_nodes as usize],
            nonces: HashMap::new(),
            liveness,
            formed: false,
            tolerate_dead: false,
        }
    }

    /// Judge the records read at `now` in generation `gen` of run `run_id`, one `(rank,
    /// record as read)` per watched rank in rank order (`None`: missing or unparsable; a
    /// record of another run or generation is not that rank's).
    pub fn round(
        &mut self,
        run_id: &str,
        gen: u64,
        reads: Vec<(u32, Option<RankRecord>)>,
        now: Duration,
    ) -> Round {
        self.round_with(run_id, gen, reads, now, None)
    }

    #[doc(hidden)]
    pub fn round_with(
        &mut self,
        run_id: &str,
        gen: u64,
        reads: Vec<(u32, Option<RankRecord>)>,
        now: Duration,
        mutation: Option<Mutation>,
    ) -> Round {
        let mutation = super::mutation(mutation);
        let reads = reads
            .into_iter()
            .map(|(r, rec)| (r, rec, Stamp::from(now)))
            .collect();
        self.round_stamped(run_id, gen, reads, mutation)
    }

    /// [`Watch::round`] with each read stamped with when it was sent and when it returned
    /// ([`Stamp`]): what a read shows is judged at its return, and an unchanged heartbeat
    /// counts as still only up to its send. A node frozen in the middle of its reads (a
    /// paused VM, a hung call) must not stamp what it read after waking with the time
    /// before: the seeded driver simulation found a worker that did, and so saw rank 0's
    /// heartbeat change 100 s before it had and judged it dead at the next look.
    pub fn round_stamped(
        &mut self,
        run_id: &str,
        gen: u64,
        reads: Vec<(u32, Option<RankRecord>, Stamp)>,
        mutation: Option<Mutation>,
    ) -> Round {
        let mutation = super::mutation(mutation);
        let mut round = Round::default();
        for (r, read, at) in reads {
            let now = at.returned;
            let slot = r as usize;
            if let Some(rec) = read.filter(|rec| rec.belongs_to(run_id, gen, r)) {
                if rec.state == NodeState::Vacant {
                    if let Some(why) = rec.refused {
                        round.notes.push(Note::Refused { rank: r, why });
                    }
                    continue;
                }
                // A rank first read after the join (a leader's members: rank 0 alone
                // saw every worker join) is held by the process first seen holding it.
                if self.formed && !rec.state.is_terminal() {
                    self.nonces.entry(r).or_insert_with(|| rec.nonce.clone());
                }
                if let Some(expected) = self.nonces.get(&r) {
                    if *expected != rec.nonce && !rec.state.is_terminal() {
                        round.stop = Some(Stop::TakenOver {
                            rank: r,
                            host: rec.host,
                            pid: rec.pid,
                        });
                        return round;
                    }
                }
                self.liveness.observe(r, rec.seq, at);
                if let Some(a) = &rec.abort {
                    round.stop = Some(Stop::Abort(a.clone()));
                    return round;
                }
                self.peers[slot] = Some(rec);
            } else if self.peers[slot].is_none() {
                // Not joined yet (during the join the wait itself decides): nothing to judge.
                continue;
            } else {
                // A joined peer whose record is missing or not its own: a look that found
                // no heartbeat.
                self.liveness.watch(r, at);
            }
            let terminal = self.peers[slot]
                .as_ref()
                .is_some_and(|p| p.state.is_terminal());
            // A rank that left a formed generation, or failed without an abort, never
            // arrives: waiting for it would be a hang until barrier-timeout (the seeded
            // driver simulation found both).
            if let Some(p) = self.peers[slot].as_ref().filter(|p| {
                self.formed
                    && (p.state == NodeState::Left
                        || (p.state == NodeState::Failed && p.abort.is_none()))
            }) {
                round.stop = Some(Stop::Ended {
                    rank: r,
                    host: p.host.clone(),
                    state: p.state,
                });
                return round;
            }
            let silent = match mutation {
                Some(Mutation::WallClock { now: wall }) => self.peers[slot]
                    .as_ref()
                    .and_then(|p| stamp_age(&p.wall, wall))
                    .unwrap_or_default(),
                None => self.liveness.silent_for(r, now),
            };
            let dead = match mutation {
                Some(Mutation::WallClock { .. }) => silent > self.liveness.dead_after(),
                None => self.liveness.is_dead(r, now),
            };
            if !self.formed || terminal || !dead {
                continue;
            }
            if self.tolerate_dead {
                round.notes.push(Note::DeadTolerated(r));
                continue;
            }
            round.stop = Some(Stop::Dead {
                rank: r,
                silent,
                last: self.peers[slot].clone().map(Box::new),
            });
            return round;
        }
        round
    }

    /// How long each watched rank's heartbeat has been still, as `rl-node status` shows.
    pub fn observed(&self, watched: &[u32], now: Duration) -> Vec<(u32, u64)> {
        watched
            .iter()
            .map(|&r| (r, self.liveness.silent_for(r, now).as_millis() as u64))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_0_at_a_barrier_rereads_arrived_ranks_only_once_per_refresh() {
        let rec = |k: u64| {
            let mut r = RankRecord::vacant("run", 1, 1);
            r.arrived = Some(crate::protocol::Mark {
                k,
                iteration: 1,
                name: "b".into(),
                payload: serde_json::Value::Null,
            });
            Some(r)
        };
        // Rank 1 arrived at 5, rank 2 only at 4, rank 3 never read.
        let peers = vec![None, rec(5), rec(4), None];
        let s = Duration::from_secs;
        let read = |waiting_at: Option<u64>, last: &[Option<Duration>], now| {
            let at = waiting_at.map_or(At::Away, At::Gathering);
            to_read(0, &Topology::flat(4), &peers, at, last, now, s(2)).ranks
        };
        let last = [None, Some(s(10)), Some(s(10)), None];
        assert_eq!(
            read(Some(5), &last, s(11)),
            vec![2, 3],
            "rank 1 is in, read 1 s ago"
        );
        assert_eq!(
            read(Some(5), &last, s(12)),
            vec![1, 2, 3],
            "2 s: read it again"
        );
        assert_eq!(
            read(None, &last, s(11)),
            vec![3],
            "away from barriers: the ranks not read within refresh"
        );
        assert_eq!(read(Some(4), &last, s(11)), vec![3], "both arrived at 4");
        assert_eq!(
            to_read(
                2,
                &Topology::flat(4),
                &peers,
                At::Barrier,
                &last,
                s(11),
                s(2)
            )
            .ranks,
            vec![0],
            "a worker at a barrier reads rank 0"
        );
        assert!(
            to_read(
                2,
                &Topology::flat(4),
                &peers,
                At::Away,
                &[Some(s(10))],
                s(11),
                s(2)
            )
            .ranks
            .is_empty(),
            "away from barriers, rank 0 read lately is not read again"
        );
    }

    #[test]
    fn of_the_ranks_still_missing_and_read_lately_one_is_read_again_the_one_read_longest_ago() {
        let peers: Vec<Option<RankRecord>> = (0..5)
            .map(|r| Some(RankRecord::vacant("run", 1, r)))
            .collect();
        let s = Duration::from_secs;
        // Ranks 1-3 are missing at barrier 5 and were read lately, rank 2 longest ago;
        // rank 4 was last read more than `refresh` ago (its heartbeat is due).
        let last = [None, Some(s(10)), Some(s(9)), Some(s(10)), Some(s(5))];
        let reads = to_read(
            0,
            &Topology::flat(5),
            &peers,
            At::Gathering(5),
            &last,
            s(11),
            s(3),
        );
        assert_eq!(
            reads,
            Reads {
                ranks: vec![2, 4],
                probe: Some(2)
            }
        );
        // Once the probe shows its rank in, the others missing are the sweep.
        let mut peers = peers;
        peers[2].as_mut().unwrap().arrived = Some(crate::protocol::Mark {
            k: 5,
            iteration: 1,
            name: "b".into(),
            payload: serde_json::Value::Null,
        });
        assert_eq!(missing(0, &Topology::flat(5), &peers, 5), vec![1, 3, 4]);
    }
    use crate::protocol::{AbortKind, NodeState};

    const S: Duration = Duration::from_secs(1);
    const RUN: &str = "run";
    const GEN: u64 = 2;

    fn rec(rank: u32, seq: u64) -> RankRecord {
        RankRecord {
            state: NodeState::Running,
            seq,
            nonce: format!("n{rank}"),
            ..RankRecord::vacant(RUN, GEN, rank)
        }
    }

    fn watch(n: u32) -> Watch {
        let mut w = Watch::new(n, Liveness::new(10 * S));
        w.nonces = (0..n).map(|r| (r, format!("n{r}"))).collect();
        w.formed = true;
        w
    }

    #[test]
    fn rank_0_watches_every_worker_and_a_worker_only_rank_0() {
        assert_eq!(Topology::flat(4).watched(0), [1, 2, 3]);
        assert_eq!(Topology::flat(4).watched(2), [0]);
        assert!(Topology::flat(1).watched(0).is_empty());
    }

    #[test]
    fn in_groups_rank_0_waits_for_the_leaders_group_marks_and_a_leader_for_its_members() {
        let t = Topology::grouped(7, 3); // 1-3 and 4-6
        let mark = |k| crate::protocol::Mark {
            k,
            iteration: 1,
            name: "b".into(),
            payload: serde_json::Value::Null,
        };
        let mut peers: Vec<Option<RankRecord>> = (0..7)
            .map(|r| Some(RankRecord::vacant("run", 1, r)))
            .collect();
        // Both leaders arrived themselves; only leader 4 has its group's arrival.
        for r in [1, 4] {
            peers[r].as_mut().unwrap().arrived = Some(mark(5));
        }
        peers[4].as_mut().unwrap().group = Some(mark(5));
        peers[2].as_mut().unwrap().arrived = Some(mark(5));
        let last = vec![Some(Duration::from_secs(10)); 7];
        let read = |me, waiting: Option<u64>| {
            to_read(
                me,
                &t,
                &peers,
                waiting.map_or(At::Barrier, At::Gathering),
                &last,
                Duration::from_secs(11),
                Duration::from_secs(2),
            )
            .ranks
        };
        assert_eq!(
            read(0, Some(5)),
            vec![1],
            "leader 4's group is in: not read again yet"
        );
        assert_eq!(
            read(2, None),
            vec![0],
            "a member at a barrier reads rank 0 alone"
        );
        assert_eq!(
            read(1, Some(5)),
            vec![0, 3],
            "rank 0 always, and the missing member"
        );
    }

    #[test]
    fn a_still_heartbeat_is_dead_only_after_dead_after_and_only_once_formed() {
        let mut w = watch(3);
        w.formed = false;
        let reads = |s1, s2| vec![(1, Some(rec(1, s1))), (2, Some(rec(2, s2)))];
        assert_eq!(w.round(RUN, GEN, reads(1, 1), S), Round::default());
        assert_eq!(
            w.round(RUN, GEN, reads(2, 1), 20 * S),
            Round::default(),
            "not formed"
        );
        w.formed = true;
        assert_eq!(w.round(RUN, GEN, reads(3, 1), 10 * S), Round::default());
        let r = w.round(RUN, GEN, reads(4, 1), 11 * S + Duration::from_millis(1));
        match r.stop {
            Some(Stop::Dead {
                rank: 2,
                silent,
                last,
            }) => {
                assert!(silent > 10 * S);
                assert_eq!(last.unwrap().seq, 1);
            }
            other => panic!("{other:?}"),
        }
        // A dynamic rollout notes it instead, and goes on to the next rank.
        w.tolerate_dead = true;
        let r = w.round(RUN, GEN, reads(5, 1), 12 * S);
        assert_eq!(r.notes, [Note::DeadTolerated(2)]);
        assert_eq!(r.stop, None);
    }

    #[test]
    fn a_peer_that_ended_in_a_formed_generation_without_a_cause_stops_the_watch() {
        for state in [NodeState::Left, NodeState::Failed] {
            let mut w = watch(3);
            let mut ended = rec(2, 4);
            ended.state = state;
            ended.host = "host-2".into();
            w.formed = false;
            assert_eq!(
                w.round(RUN, GEN, vec![(2, Some(ended.clone()))], S).stop,
                None,
                "before the generation forms, leaving is allowed"
            );
            w.formed = true;
            assert_eq!(
                w.round(RUN, GEN, vec![(2, Some(ended))], S).stop,
                Some(Stop::Ended {
                    rank: 2,
                    host: "host-2".into(),
                    state
                })
            );
        }
        // Done is no cause to stop, and a failure with an abort is that abort.
        let mut w = watch(3);
        let mut done = rec(2, 4);
        done.state = NodeState::Done;
        assert_eq!(w.round(RUN, GEN, vec![(2, Some(done))], S).stop, None);
    }

    #[test]
    fn a_finished_peer_is_never_dead_and_a_foreign_record_is_not_its() {
        let mut w = watch(2);
        let mut done = rec(1, 1);
        done.state = NodeState::Done;
        w.round(RUN, GEN, vec![(1, Some(done.clone()))], S);
        assert_eq!(
            w.round(RUN, GEN, vec![(1, Some(done))], 100 * S),
            Round::default()
        );
        // Another generation's record is not this rank's: it neither feeds liveness nor
        // replaces what was last read. Like a look that finds no record, it starts a
        // silent spell (what the rank did since its last sighting is unknown), and the
        // rank is dead once that spell lasts dead-after.
        let mut w = watch(2);
        w.round(RUN, GEN, vec![(1, Some(rec(1, 1)))], S);
        let mut old = rec(1, 9);
        old.gen = 1;
        assert_eq!(
            w.round(RUN, GEN, vec![(1, Some(old.clone()))], 12 * S).stop,
            None
        );
        assert!(matches!(
            w.round(RUN, GEN, vec![(1, Some(old))], 23 * S).stop,
            Some(Stop::Dead { rank: 1, .. })
        ));
    }

    #[test]
    fn a_replaced_process_an_abort_and_a_refusal_are_reported_in_rank_order() {
        let mut w = watch(4);
        let mut intruder = rec(1, 5);
        intruder.nonce = "other".into();
        intruder.host = "h9".into();
        let mut aborting = rec(2, 1);
        aborting.abort = Some(AbortInfo {
            kind: AbortKind::Error,
            culprit: 2,
            culprit_host: "h2".into(),
            phase: "rollout".into(),
            iteration: 3,
            reason: "boom".into(),
            log: None,
            detected_by: 2,
            silent_ms: None,
            at: String::new(),
            cluster: None,
            detected_in: None,
            dropped: false,
        });
        let mut vacant = RankRecord::vacant("run", 2, 3);
        vacant.refused = Some("another configuration".into());
        let r = w.round(
            RUN,
            GEN,
            vec![
                (1, Some(intruder)),
                (2, Some(aborting.clone())),
                (3, Some(vacant.clone())),
            ],
            S,
        );
        assert!(matches!(r.stop, Some(Stop::TakenOver { rank: 1, ref host, .. }) if host == "h9"));
        let r = w.round(
            RUN,
            GEN,
            vec![(2, Some(aborting)), (3, Some(vacant.clone()))],
            S,
        );
        assert!(matches!(r.stop, Some(Stop::Abort(ref a)) if a.reason == "boom"));
        let r = w.round(RUN, GEN, vec![(3, Some(vacant))], S);
        assert_eq!(
            r.notes,
            [Note::Refused {
                rank: 3,
                why: "another configuration".into()
            }]
        );
    }

    #[test]
    fn wall_clock_stamps_never_decide_liveness_except_in_the_broken_variant() {
        let mut w = watch(2);
        let written = SystemTime::UNIX_EPOCH + 1_000_000 * S;
        let mut peer = rec(1, 1);
        peer.wall = crate::protocol::wall_stamp(written);
        assert_eq!(
            w.round(RUN, GEN, vec![(1, Some(peer.clone()))], S),
            Round::default()
        );
        peer.seq = 2;
        assert_eq!(
            w.round(RUN, GEN, vec![(1, Some(peer.clone()))], 2 * S),
            Round::default(),
            "the sequence advanced: alive, whatever the stamp says"
        );
        // The broken variant (`sim` feature only): the observer's wall clock is ten
        // minutes ahead of the writer's.
        #[cfg(feature = "sim")]
        {
            peer.seq = 3;
            let broken = Some(Mutation::WallClock {
                now: written + 600 * S,
            });
            match w
                .round_with(RUN, GEN, vec![(1, Some(peer))], 3 * S, broken)
                .stop
            {
                Some(Stop::Dead {
                    rank: 1, silent, ..
                }) => assert_eq!(silent, 600 * S),
                other => panic!("{other:?}"),
            }
        }
    }
}
