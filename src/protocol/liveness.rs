//! Liveness by observation: a peer is alive while its heartbeat sequence keeps advancing
//! as measured by the observer's own monotonic clock. Peer wall-clock times and file
//! mtimes are never compared with the local clock (clocks of nodes disagree).
//!
//! Silence counts only as far as it was witnessed: from the last change seen to the last
//! look (a read of the peer's record, or of its absence), not to whenever the judgement
//! happens. An observer frozen between a look and its judgement (a paused VM, a hung
//! call) must look again before it may call a peer dead: the seeded driver simulation
//! found a worker that woke from a 103 s freeze inside its join wait and took a live
//! rank 0 for gone.
//!
//! A look that finds no heartbeat (the record missing, unreadable, damaged or not the
//! peer's) proves nothing about the time before it: the peer may have written many
//! times since the last look that found its sequence. Only two reads of the same
//! sequence prove it still in between. So a look that finds nothing after one that found
//! a sequence starts a silent spell of its own, and further looks that find nothing
//! extend it: the pipelined simulation found a rank 0 that, out of action for 15 s (6.5 s
//! frozen, then held up), found its worker's record emptied by the worker's crash and
//! declared it dead at once, counting the 15 s it had not been looking (seed 91).
//!
//! Pure: the observer passes its monotonic time as `now` (a [`Duration`] since an origin of
//! its choosing: the node's process start, or the simulator's clock).

use super::RankRecord;
use std::collections::HashMap;
use std::time::Duration;

/// When a read of a rank's record was sent and when it returned, by the observer's clock:
/// what it found was current at some moment in between. A freeze of the observer inside
/// the read (a paused VM after the server answered) makes the two far apart: a change
/// seen counts from the return, and an unchanged sequence proves stillness only up to
/// the send (the nodes scenario's seed 179: a worker frozen for 11 s inside its read of
/// rank 0's record counted the whole freeze as rank 0's silence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub sent: Duration,
    pub returned: Duration,
}

impl Stamp {
    pub fn new(sent: Duration, returned: Duration) -> Stamp {
        Stamp {
            sent: sent.min(returned),
            returned,
        }
    }
}

/// A read taken as instantaneous.
impl From<Duration> for Stamp {
    fn from(at: Duration) -> Stamp {
        Stamp {
            sent: at,
            returned: at,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Liveness {
    dead_after: Duration,
    seen: HashMap<u32, Seen>,
    mutation: Option<Mutation>,
}

/// What the observer knows of a rank's heartbeat.
#[derive(Debug, Clone, Copy)]
struct Seen {
    seq: u64,
    /// When the sequence was last seen to change (or the watch began).
    changed: Duration,
    /// When the rank was last looked at.
    looked: Duration,
    /// While the looks find no heartbeat: since the first of them.
    spell: Option<Duration>,
}

impl Seen {
    /// Since when the rank is known still: the first look that found its sequence, or
    /// during a spell of looks that found nothing, the first of those.
    fn still_since(&self) -> Duration {
        self.spell.unwrap_or(self.changed)
    }
}

/// A deliberately wrong liveness judgement, for showing that the simulator catches it.
/// Never set by the node.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// Every read counts as a sign of life, changed or not: a dead peer is never seen.
    ResetOnEveryRead,
    /// A peer is judged after a quarter of dead-after: stale caches and slow heartbeats
    /// then kill live peers.
    Impatient,
    /// A peer is judged after half of dead-after.
    HalfPatient,
    /// A peer is judged this much before dead-after (one heartbeat interval, say): a
    /// judge only slightly off, which the simulator's check of every death against the
    /// observer's true view catches.
    EarlyBy(Duration),
}

impl Liveness {
    pub fn new(dead_after: Duration) -> Liveness {
        Liveness {
            dead_after,
            seen: HashMap::new(),
            mutation: None,
        }
    }

    #[doc(hidden)]
    pub fn with_mutation(mut self, m: Option<Mutation>) -> Liveness {
        let m = super::mutation(m);
        match m {
            Some(Mutation::Impatient) => self.dead_after /= 4,
            Some(Mutation::HalfPatient) => self.dead_after /= 2,
            Some(Mutation::EarlyBy(d)) => self.dead_after = self.dead_after.saturating_sub(d),
            _ => {}
        }
        self.mutation = m;
        self
    }

    pub fn dead_after(&self) -> Duration {
        self.dead_after
    }

    /// Record the sequence number read for `rank` by a read stamped `at` (a time, or when
    /// it was sent and when it returned). Returns true if it advanced.
    pub fn observe(&mut self, rank: u32, seq: u64, at: impl Into<Stamp>) -> bool {
        let at = at.into();
        let now = at.returned;
        match self.seen.get_mut(&rank) {
            Some(s) if s.seq == seq => {
                // The same sequence proves the rank still up to when the read was sent, not
                // to when it came back: the answer may be that old.
                s.looked = s.looked.max(at.sent);
                // Back after looks that found nothing: the same sequence proves it still
                // since it was first seen.
                s.spell = None;
                if super::mutation(self.mutation) == Some(Mutation::ResetOnEveryRead) {
                    s.changed = now;
                }
                false
            }
            Some(s) => {
                *s = Seen {
                    seq,
                    changed: now,
                    looked: s.looked.max(now),
                    spell: None,
                };
                true
            }
            None => {
                // The first observation starts the clock: a peer gets a full dead-after
                // from the moment we start watching it.
                self.seen.insert(
                    rank,
                    Seen {
                        seq,
                        changed: now,
                        looked: now,
                        spell: None,
                    },
                );
                false
            }
        }
    }

    /// A look at a rank that found no heartbeat (its record missing, unreadable or not
    /// its own): start watching it, or start a silent spell at `now` if the look before
    /// found a heartbeat (what happened in between is unknown: see the module's
    /// documentation), or count the spell's silence up to `now`.
    pub fn watch(&mut self, rank: u32, at: impl Into<Stamp>) {
        let at = at.into();
        let now = at.returned;
        let s = self.seen.entry(rank).or_insert(Seen {
            seq: u64::MAX,
            changed: now,
            looked: now,
            spell: None,
        });
        if s.spell.is_none() {
            s.spell = Some(now.max(s.changed));
        }
        s.looked = s.looked.max(at.sent);
    }

    /// How long the rank's sequence has been seen still, by our clock: from its last
    /// change to our last look at it (at most `now`).
    pub fn silent_for(&self, rank: u32, now: Duration) -> Duration {
        self.seen
            .get(&rank)
            .map(|s| s.looked.min(now).saturating_sub(s.still_since()))
            .unwrap_or_default()
    }

    pub fn is_dead(&self, rank: u32, now: Duration) -> bool {
        self.seen.contains_key(&rank) && self.silent_for(rank, now) > self.dead_after
    }

    /// When `rank` will have been still for dead-after, unless a change is seen first.
    pub fn dead_at(&self, rank: u32) -> Option<Duration> {
        self.seen
            .get(&rank)
            .map(|s| s.still_since() + self.dead_after)
    }

    pub fn forget(&mut self, rank: u32) {
        self.seen.remove(&rank);
    }
}

/// Whether the process behind a record is alive, judged the same way for a record no
/// heartbeat has been seen from yet (a slot being claimed, a previous generation's rank 0):
/// alive once its sequence has advanced `advances` times while watched; gone if that has
/// not happened within `patience` from the first look. Keyed by (generation, rank, the
/// process's nonce): another process's record at the same place is watched from its own
/// first look. A `--fresh` rank 0 starts generation 1 again, and its record may carry the
/// sequence number the set-aside run's rank 0 record had: keyed by (generation, rank)
/// only, it was taken for that process, watched for longer than patience without an
/// advance, and judged gone at the first look (seed 106 of the simulator's `fresh`
/// scenario: the worker then waited until join-timeout).
///
/// Through an attribute cache one advance is no proof of life: the first look may return
/// a stale copy, and the next the last write of a process that has died since. A second
/// advance means it wrote after the watch began ([`PROOF_FOR_REFUSAL`]).
#[derive(Debug, Clone, Default)]
pub struct Holders {
    seen: HashMap<(u64, u32, String), (u64, Duration, u32)>,
}

/// The advances that prove a holder alive before a process is refused because of it (a
/// refusal is final: the process exits). The join seed 78259 of a 100,000-seed run found
/// a restarted rank 0 refused for a predecessor that had died before it started: its
/// host's cache showed the predecessor's last heartbeat as an advance.
pub const PROOF_FOR_REFUSAL: u32 = 2;

/// What [`Holders::judge`] concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Alive,
    Gone,
    Unknown,
}

impl Holders {
    /// Alive once the record's `seq` has advanced `advances` times since the first look
    /// at its (`gen`, `rank`, `nonce`), gone if not within `patience` of it, else unknown.
    pub fn judge(
        &mut self,
        rec: &RankRecord,
        now: Duration,
        patience: Duration,
        advances: u32,
    ) -> Holder {
        let (seq, key) = (rec.seq, (rec.gen, rec.rank, rec.nonce.clone()));
        let e = self.seen.entry(key).or_insert((seq, now, 0));
        if e.0 != seq {
            *e = (seq, e.1, e.2 + 1);
        }
        if e.2 >= advances {
            Holder::Alive
        } else if now.saturating_sub(e.1) > patience {
            Holder::Gone
        } else {
            Holder::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(gen: u64, rank: u32, seq: u64, nonce: &str) -> RankRecord {
        RankRecord {
            seq,
            nonce: nonce.into(),
            ..RankRecord::vacant("run", gen, rank)
        }
    }

    #[test]
    fn another_process_at_the_same_place_is_watched_from_its_own_first_look() {
        let s = Duration::from_secs;
        let mut h = Holders::default();
        assert_eq!(
            h.judge(&rec(1, 0, 3, "old"), s(0), s(5), 1),
            Holder::Unknown
        );
        assert_eq!(h.judge(&rec(1, 0, 3, "old"), s(9), s(5), 1), Holder::Gone);
        // A new run's rank 0 at the same sequence number: not the old one's silence.
        assert_eq!(
            h.judge(&rec(1, 0, 3, "new"), s(9), s(5), 1),
            Holder::Unknown
        );
        assert_eq!(h.judge(&rec(1, 0, 4, "new"), s(10), s(5), 1), Holder::Alive);
    }

    #[test]
    fn a_holder_is_alive_once_it_advances_and_gone_if_still_for_patience() {
        let s = Duration::from_secs;
        let mut h = Holders::default();
        assert_eq!(h.judge(&rec(1, 0, 7, "a"), s(10), s(5), 1), Holder::Unknown);
        assert_eq!(h.judge(&rec(1, 0, 7, "a"), s(15), s(5), 1), Holder::Unknown);
        assert_eq!(h.judge(&rec(1, 0, 7, "a"), s(16), s(5), 1), Holder::Gone);
        // Another generation's rank 0 is watched on its own.
        assert_eq!(h.judge(&rec(2, 0, 7, "a"), s(16), s(5), 1), Holder::Unknown);
        assert_eq!(h.judge(&rec(2, 0, 8, "a"), s(17), s(5), 1), Holder::Alive);
        // Once seen advancing, it stays alive in this watch.
        assert_eq!(h.judge(&rec(2, 0, 8, "a"), s(100), s(5), 1), Holder::Alive);
        // Two advances needed: one (a stale copy, then a dead process's last write) is
        // not enough, and the patience still ends the watch.
        let mut h = Holders::default();
        assert_eq!(h.judge(&rec(1, 0, 7, "a"), s(10), s(5), 2), Holder::Unknown);
        assert_eq!(h.judge(&rec(1, 0, 8, "a"), s(11), s(5), 2), Holder::Unknown);
        assert_eq!(h.judge(&rec(1, 0, 8, "a"), s(16), s(5), 2), Holder::Gone);
        assert_eq!(h.judge(&rec(2, 0, 7, "a"), s(10), s(5), 2), Holder::Unknown);
        assert_eq!(h.judge(&rec(2, 0, 8, "a"), s(11), s(5), 2), Holder::Unknown);
        assert_eq!(h.judge(&rec(2, 0, 9, "a"), s(12), s(5), 2), Holder::Alive);
    }

    #[test]
    fn dead_only_after_sequence_stays_still_for_dead_after() {
        let t0 = Duration::from_secs(100);
        let s = Duration::from_secs;
        let mut l = Liveness::new(s(10));
        l.observe(1, 5, t0);
        l.observe(1, 5, t0 + s(10));
        assert!(!l.is_dead(1, t0 + s(10)));
        l.observe(1, 5, t0 + s(11));
        assert!(l.is_dead(1, t0 + s(11)));
        // Advancing resets the clock.
        assert!(l.observe(1, 6, t0 + s(12)));
        l.observe(1, 6, t0 + s(21));
        assert!(!l.is_dead(1, t0 + s(21)));
        l.observe(1, 6, t0 + s(23));
        assert!(l.is_dead(1, t0 + s(23)));
        // Unknown ranks are never judged.
        assert!(!l.is_dead(7, t0 + s(1000)));
    }

    #[test]
    fn a_watched_missing_record_dies_after_dead_after() {
        let t0 = Duration::from_secs(100);
        let mut l = Liveness::new(Duration::from_secs(3));
        l.watch(2, t0);
        l.watch(2, t0 + Duration::from_secs(4));
        assert!(l.is_dead(2, t0 + Duration::from_secs(4)));
        assert!(l.observe(2, 0, t0 + Duration::from_secs(4)));
        assert!(!l.is_dead(2, t0 + Duration::from_secs(5)));
    }

    /// Silence is what was witnessed: an observer that looked at t0, froze, and judges at
    /// t0 + 100 s has seen nothing; the next look decides.
    #[test]
    fn silence_counts_only_up_to_the_last_look() {
        let s = Duration::from_secs;
        let mut l = Liveness::new(s(10));
        l.observe(1, 5, s(0));
        l.observe(1, 5, s(1));
        assert!(!l.is_dead(1, s(100)), "judged by the clock, not by looks");
        assert_eq!(l.silent_for(1, s(100)), s(1));
        assert!(l.observe(1, 6, s(100)), "the next look sees it alive");
        assert!(!l.is_dead(1, s(100)));
    }

    /// A read that was long on its way (the observer frozen inside it) proves an
    /// unchanged heartbeat still only up to when it was sent, and a changed one alive at
    /// its return (nodes seed 179: 11 s frozen inside a read of rank 0's record).
    #[test]
    fn a_read_long_on_its_way_counts_from_both_ends() {
        let s = Duration::from_secs;
        let mut l = Liveness::new(s(10));
        l.observe(1, 5, s(0));
        l.observe(1, 5, Stamp::new(s(1), s(12)));
        assert!(!l.is_dead(1, s(12)), "the answer may be from 1 s");
        assert_eq!(l.silent_for(1, s(12)), s(1));
        assert!(l.observe(1, 6, Stamp::new(s(12), s(30))));
        l.observe(1, 6, s(35));
        assert_eq!(
            l.silent_for(1, s(35)),
            s(5),
            "changed as of the return, 30 s"
        );
        // A look that found nothing, long on its way: its spell starts at the return.
        l.watch(1, Stamp::new(s(36), s(50)));
        assert_eq!(l.silent_for(1, s(50)), s(0));
        l.watch(1, s(61));
        assert!(l.is_dead(1, s(61)));
    }

    /// A look that finds no heartbeat after one that found a sequence proves nothing
    /// about the time in between (pipeline seed 91: an observer out of action for 15 s
    /// found a crashed worker's record emptied and counted all 15 s): it starts a silent
    /// spell, which further looks that find nothing extend.
    #[test]
    fn a_look_that_finds_nothing_starts_a_silent_spell() {
        let s = Duration::from_secs;
        let mut l = Liveness::new(s(10));
        l.observe(1, 5, s(0));
        l.watch(1, s(15));
        assert!(
            !l.is_dead(1, s(15)),
            "15 s not looking is not 15 s of silence"
        );
        assert_eq!(l.silent_for(1, s(15)), s(0));
        l.watch(1, s(20));
        assert_eq!(l.silent_for(1, s(20)), s(5));
        // Back with the same sequence: it was still all along, since it was first seen.
        l.observe(1, 5, s(9 + 15));
        assert!(l.is_dead(1, s(24)));
        // Looks that fail now and then (a dead peer, an observer's read errors) do not
        // keep it alive: each look that finds the sequence counts from its first sighting.
        let mut l = Liveness::new(s(10));
        l.observe(1, 5, s(0));
        let mut dead = None;
        for t in 1..=10 {
            l.watch(1, s(2 * t - 1));
            assert!(!l.is_dead(1, s(2 * t - 1)));
            l.observe(1, 5, s(2 * t));
            if dead.is_none() && l.is_dead(1, s(2 * t)) {
                dead = Some(2 * t);
            }
        }
        assert_eq!(dead, Some(12), "dead at the first sighting past dead-after");
        // A new sequence is a sign of life, as always.
        assert!(l.observe(1, 6, s(21)));
        assert!(!l.is_dead(1, s(21)));
    }
}
