//! The pace of the node's waits and the split of a poll round's reads over threads: what
//! coordination costs in time over a network filesystem. They live apart from the wait
//! loop so that the simulator's latency projection (`scripts/sim --ops --latency`) paces
//! its nodes and costs their reads with these very functions, and cannot drift from the
//! node.

use std::time::Duration;

/// The first pause of a wait: a barrier whose peers are already there passes in about
/// this much, not in a whole `poll-interval`.
const FIRST_STEP: Duration = Duration::from_micros(500);

/// The most ranks one reading thread takes in a poll round before another thread joins
/// it (up to the store's parallelism): up to this many, a round reads on the node's own
/// thread (a thread costs more than a few reads of a local file).
pub const READS_PER_THREAD: usize = 8;

/// What the node's current wait is, besides its deadline: what it waits for (said in its
/// "still waiting" lines), and what sets its pace.
#[derive(Debug, Default, Clone)]
pub(crate) struct Waiting {
    /// What the wait waits for, for "still waiting" lines.
    pub note: String,
    /// The wait is for this node's own command.
    pub idle: bool,
    /// The longest poll step, when the wait must notice sooner than `poll-interval` (a
    /// wait for the other cluster of a pipelined run).
    pub cap: Option<Duration>,
}

impl Waiting {
    /// The longest pause between two rounds of this wait: `relay` while rank 0 relays a
    /// ready file, which it looks for at least every `relay_poll`; the cap, if any; while
    /// the node's own command runs, peers are read every half heartbeat (that only delays
    /// noticing a failure elsewhere, and keeps an idle node's operations on the shared
    /// directory to about two a second); otherwise `poll_interval`.
    pub fn max_step(
        &self,
        relay: Option<Duration>,
        poll_interval: Duration,
        heartbeat_interval: Duration,
    ) -> Duration {
        match (relay, self.cap) {
            (Some(relay), _) => relay.min(poll_interval),
            (None, Some(cap)) => cap.min(poll_interval),
            (None, None) if self.idle => poll_interval.max(heartbeat_interval / 2),
            (None, None) => poll_interval,
        }
    }
}

/// The pause before a wait's second round (`poll_interval` if that is shorter).
pub fn first_step(poll_interval: Duration) -> Duration {
    FIRST_STEP.min(poll_interval)
}

/// The pause after `step`: half as long again, up to `max_step`, so a long wait polls at
/// `max_step` while a short one ends within about half its length of the moment it could.
pub fn next_step(step: Duration, max_step: Duration) -> Duration {
    (step * 3 / 2).min(max_step)
}

/// How many of a poll round's `ranks` reads one thread makes in turn, when up to
/// `parallelism` threads read at once: `ranks` (one thread, the caller's) up to
/// [`READS_PER_THREAD`], then an even share of one thread per [`READS_PER_THREAD`] ranks
/// while there are threads left. A round takes as long as this many reads one after
/// another.
pub fn read_run(ranks: usize, parallelism: usize) -> usize {
    let threads = parallelism.min(ranks.div_ceil(READS_PER_THREAD));
    if threads <= 1 {
        return ranks.max(1);
    }
    ranks.div_ceil(threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_splits_over_up_to_the_parallelism_in_runs_of_at_most_eight_while_it_can() {
        assert_eq!(read_run(0, 8), 1);
        assert_eq!(read_run(8, 8), 8);
        assert_eq!(read_run(9, 8), 5);
        assert_eq!(read_run(15, 8), 8);
        assert_eq!(read_run(16, 8), 8);
        assert_eq!(read_run(17, 8), 6);
        assert_eq!(read_run(64, 8), 8);
        assert_eq!(read_run(1_024, 8), 128);
        assert_eq!(read_run(1_023, 8), 128);
        assert_eq!(read_run(1_024, 1), 1_024);
    }

    #[test]
    fn a_wait_polls_at_the_relay_then_the_cap_then_half_a_heartbeat_when_idle() {
        let ms = Duration::from_millis;
        let (poll, beat) = (ms(1_000), ms(5_000));
        let mut w = Waiting::default();
        assert_eq!(w.max_step(None, poll, beat), poll);
        w.idle = true;
        assert_eq!(w.max_step(None, poll, beat), ms(2_500));
        w.cap = Some(ms(200));
        assert_eq!(w.max_step(None, poll, beat), ms(200));
        assert_eq!(w.max_step(Some(ms(500)), poll, beat), ms(500));
        assert_eq!(w.max_step(Some(ms(500)), ms(100), beat), ms(100));
        w.cap = Some(ms(3_000));
        assert_eq!(
            w.max_step(None, poll, beat),
            poll,
            "a cap never slows a wait down"
        );
    }

    #[test]
    fn the_step_grows_by_half_up_to_its_cap() {
        let s = first_step(Duration::from_secs(1));
        assert_eq!(s, Duration::from_micros(500));
        assert_eq!(
            next_step(s, Duration::from_secs(1)),
            Duration::from_micros(750)
        );
        assert_eq!(
            next_step(Duration::from_millis(900), Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            first_step(Duration::from_micros(100)),
            Duration::from_micros(100)
        );
    }
}
