//! The latency projection (`scripts/sim --ops --latency 0.5ms`): how long coordination
//! takes when every request to the shared directory's server is a round trip, at cluster
//! sizes no test machine can run.
//!
//! The nodes are the barrier scenario's (the node's own machine over `store::sim`), paced
//! as the node's wait loop paces itself and costing their reads as its reading threads
//! do, through the node's own functions (`rl_node::poll`): after an arrival a node polls
//! at once, then pauses 0.5 ms, half as long again each round up to `poll-interval` (or
//! the machine's next due); a poll round of m ranks takes as long as the longest run of
//! reads one of its threads makes. Every request that passes a client's caches takes the
//! latency (`SimClient::set_round_trip`); the clients revalidate at each open, as NFS
//! with close-to-open does, so an open is a round trip and a changed record's read
//! another. A node's turn sees the directory as it was when the turn began, and its
//! writes are seen at once; its round trips then keep it busy. Heartbeats have their own
//! thread and cost the loop nothing.
//!
//! Each node goes through the barriers back to back, all starting together; the figures
//! are over the barriers after the first (the start's lock-step is not the steady
//! state's), before the last (whose pass publishes the node's end).

use super::{Ops, OpsSettings, Sim, Step};
use crate::Violation;
use rl_node::poll;
use rl_node::protocol::journal::Resume;
use rl_node::protocol::phase::RlPhase;
use rl_node::protocol::walk::{self, IterationWalk, RolloutSplit, WalkConfig};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

/// The barriers of one iteration with an eval, as the walk lists them for rank 0.
pub fn barriers_per_iteration() -> u64 {
    let cfg = WalkConfig {
        rl_phase: RlPhase::Both,
        split: RolloutSplit::All,
        rank_0: true,
        prepare: true,
        iterations: 0,
    };
    let mut w = IterationWalk::new(cfg, 1, Resume::default());
    let mut count = 0;
    while let Some(step) = w.next_step() {
        if let walk::Step::Barrier(b) = step {
            count += 1;
            match b {
                walk::Barrier::FilesReady => w.eval_decided(true),
                walk::Barrier::TrainingComplete => {
                    w.training_released(None);
                }
                _ => {}
            }
        }
    }
    count
}

/// A cluster's coordination under latency, per barrier.
#[derive(Debug, Clone)]
pub struct LatencyFigures {
    pub n: usize,
    /// Barriers measured.
    pub barriers: u64,
    /// Simulated time per barrier: rank 0's, and the slowest node's.
    pub rank_0: Duration,
    pub slowest: Duration,
    /// Of rank 0's time per barrier, what it spent in round trips.
    pub rank_0_io: Duration,
    /// Rank 0's operations over the barriers measured.
    pub rank_0_ops: Ops,
    /// The most requests a worker sent its server over the barriers measured.
    pub worker_requests: u64,
}

impl LatencyFigures {
    /// Rank 0's operations per barrier: (client, server).
    pub fn rank_0_ops_per_barrier(&self) -> (f64, f64) {
        let b = self.barriers as f64;
        (
            self.rank_0_ops.client.total() as f64 / b,
            self.rank_0_ops.server.total() as f64 / b,
        )
    }
}

/// What a node does at its next turn (`Node::barrier`): publish its arrival, poll the
/// cluster, or look whether it may pass (rank 0 releasing when it may).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Turn {
    Arrive,
    Poll,
    Check,
}

/// Where a node was as it passed a barrier: the time (µs), its operations so far, its time
/// in round trips so far.
type Mark = (u64, Ops, Duration);

/// The figures for a cluster of `n` (at least 2) nodes at `latency` per round trip.
pub fn latency_figures(
    n: usize,
    s: OpsSettings,
    latency: Duration,
) -> Result<LatencyFigures, Violation> {
    assert!(n >= 2 && s.barriers >= 1);
    // One barrier to leave the start's lock-step, one whose pass publishes the end.
    let mut sim = Sim::for_figures(n, s.barriers + 2, s);
    for c in &sim.dir.clients {
        c.set_close_to_open(true);
        c.set_round_trip(latency);
    }
    let poll_interval = Duration::from_millis(s.poll_ms);
    let mut turn = vec![Turn::Arrive; n];
    let mut step = vec![poll::first_step(poll_interval); n];
    let mut io = vec![Duration::ZERO; n];
    let mut marks: Vec<Vec<Mark>> = vec![Vec::new(); n];
    let mut queue: BinaryHeap<Reverse<(u64, usize)>> = (0..n).map(|r| Reverse((0, r))).collect();
    let bound_us = (s.barriers + 2) * 60_000_000;
    while let Some(Reverse((t, r))) = queue.pop() {
        assert!(t < bound_us, "the barriers did not end: {:?}", sim.step);
        if t / 1_000 > sim.now {
            sim.now = t / 1_000;
            sim.heartbeats();
        }
        let (spent, overlapped) = (sim.dir.clients[r].latency_spent(), sim.dir.overlapped[r]);
        let k = sim.k[r];
        match turn[r] {
            Turn::Arrive | Turn::Check => sim.proceed(r, 0)?,
            Turn::Poll => sim.poll(r, 0)?,
        }
        let took =
            (sim.dir.clients[r].latency_spent() - spent) - (sim.dir.overlapped[r] - overlapped);
        io[r] += took;
        let mut next = t + took.as_micros() as u64;
        turn[r] = match turn[r] {
            Turn::Arrive => {
                step[r] = poll::first_step(poll_interval);
                Turn::Poll
            }
            Turn::Poll => Turn::Check,
            Turn::Check if sim.k[r] > k => {
                marks[r].push((next, sim.ops(r), io[r]));
                if sim.step[r] == Step::Done {
                    continue;
                }
                Turn::Arrive
            }
            Turn::Check => {
                next += pause(&sim, r, step[r]).as_micros() as u64;
                step[r] = poll::next_step(step[r], poll_interval);
                Turn::Poll
            }
        };
        queue.push(Reverse((next, r)));
    }
    assert!(
        (0..n).all(|r| sim.step[r] == Step::Done),
        "a node stopped: {:?}",
        sim.step
    );
    let b = s.barriers as usize;
    let span = |r: usize| Duration::from_micros(marks[r][b].0 - marks[r][0].0);
    let per = |d: Duration| d / s.barriers as u32;
    Ok(LatencyFigures {
        n,
        barriers: s.barriers,
        rank_0: per(span(0)),
        slowest: per((0..n).map(span).max().expect("nodes")),
        rank_0_io: per(marks[0][b].2 - marks[0][0].2),
        rank_0_ops: marks[0][b].1 - marks[0][0].1,
        worker_requests: (1..n)
            .map(|r| (marks[r][b].1 - marks[r][0].1).server.total())
            .max()
            .expect("workers"),
    })
}

/// The pause after a round that did not pass, as `Node::wait_for` takes it: the step, or
/// less when the machine is due sooner (a read of a watched rank, a death to judge).
fn pause(sim: &Sim, r: usize, step: Duration) -> Duration {
    let local = sim.local(r);
    match sim.machines[r].poll_timeout() {
        Some(due) => step.min(due.saturating_sub(local).max(Duration::from_millis(1))),
        None => step,
    }
}

/// The figures as a table (`scripts/sim --ops --latency L`).
pub fn latency_table(figures: &[LatencyFigures], s: OpsSettings, latency: Duration) -> String {
    let per_iteration = barriers_per_iteration();
    let ms = |d: Duration| d.as_secs_f64() * 1_000.0;
    let mut out = format!(
        "Coordination time per barrier and per iteration ({per_iteration} barriers, the walk's with an eval), simulated.\n\
         Every request that reaches the shared directory's server takes {}; opens revalidate (close-to-open), other hits of the {} ms attribute cache are free.\n\
         A poll round splits its reads over up to {} threads (one per {} ranks); polls from {} µs, x1.5 each round, up to poll {} ms; heartbeat {} ms.\n\
         {} barriers measured back to back, after a first that all nodes arrive at together; rank 0 and the slowest node.\n\
         Barriers: {}.\n\n",
        humantime::format_duration(latency),
        s.lifetime_ms,
        rl_node::store::SharedDir::read_parallelism(&rl_node::store::Fs),
        poll::READS_PER_THREAD,
        poll::first_step(Duration::from_millis(s.poll_ms)).as_micros(),
        s.poll_ms,
        s.heartbeat_ms,
        s.barriers,
        match s.groups_from {
            0 => "flat, rank 0 reads every rank (barrier-groups-from = 0)".to_string(),
            g => format!("in groups of about √N workers through their leaders from {g} nodes on (barrier-groups-from = {g}), flat below"),
        },
    );
    out += &format!(
        "{:>6}  {:>16}  {:>17}  {:>18}  {:>19}  {:>16}  {:>16}\n",
        "nodes",
        "rank 0/barrier",
        "slowest/barrier",
        "rank 0/iteration",
        "slowest/iteration",
        "rank 0 in trips",
        "rank 0 ops/barr."
    );
    for f in figures {
        let (client, server) = f.rank_0_ops_per_barrier();
        out += &format!(
            "{:>6}  {:>13.1} ms  {:>14.1} ms  {:>15.1} ms  {:>16.1} ms  {:>13.1} ms  {:>7.0} / {:<6.0}\n",
            f.n,
            ms(f.rank_0),
            ms(f.slowest),
            ms(f.rank_0) * per_iteration as f64,
            ms(f.slowest) * per_iteration as f64,
            ms(f.rank_0_io),
            client,
            server,
        );
    }
    out += "(rank 0 in trips: its time per barrier spent waiting for round trips; ops: client / server requests)\n";
    out
}

/// The projection's shape on small clusters (`scripts/sim --ops --latency` runs the same
/// at 16 to 1,024 nodes): coordination time per barrier grows with the latency and, for
/// one rank 0 reading every rank, with the cluster; and it is what the round trips rank
/// 0 makes take, plus at most the 0-latency time and one worker's round trips.
///
/// Why those bounds: rank 0's loop is one thread, so each request it sends while it
/// polls, arrives and releases is time it spends (its heartbeat thread's are not, and
/// none falls in the few milliseconds measured); up to 9 nodes it reads its 8 peers or
/// fewer on that thread, so its time is at least its requests times the latency. Beyond,
/// its reads go out in runs (`poll::read_run`), which divides at most their share by
/// (ranks read) / (run), and must divide it: less than its requests' sum. What it waits
/// beyond its own round trips is its pause, which without latency is the 0-latency time,
/// and with it can be a worker's requests: reading the release, publishing the arrival.
#[test]
fn coordination_time_is_rank_0s_round_trips_and_grows_with_latency_and_cluster() {
    let s = OpsSettings {
        barriers: 3,
        ..OpsSettings::default()
    };
    let at = |n: usize, latency: Duration| {
        latency_figures(n, s, latency)
            .map_err(|v| v.to_string())
            .unwrap()
    };
    let l = Duration::from_micros(500);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut at_l = Vec::new();
    for n in [4, 8, 24] {
        let f: Vec<LatencyFigures> = [Duration::ZERO, l, 4 * l]
            .into_iter()
            .map(|latency| at(n, latency))
            .collect();
        let t = |i: usize| ms(f[i].rank_0);
        assert!(
            t(0) < t(1) && t(1) < t(2),
            "{n} nodes: rank 0's time per barrier does not grow with the latency: {:?}",
            [t(0), t(1), t(2)]
        );
        assert!(
            f[0].slowest < f[1].slowest && f[1].slowest < f[2].slowest,
            "{n} nodes: the slowest node's time does not grow with the latency: {f:?}"
        );
        for (i, latency) in [(1, l), (2, 4 * l)] {
            let (_, requests) = f[i].rank_0_ops_per_barrier();
            let sum = requests * ms(latency);
            let worker = f[i].worker_requests as f64 / s.barriers as f64 * ms(latency);
            let what = format!(
                "{n} nodes at {latency:?}: rank 0 {:.3} ms per barrier, {requests} requests ({sum:.3} ms), 0-latency {:.3} ms, a worker's {worker:.3} ms",
                t(i),
                t(0)
            );
            let run = poll::read_run(n - 1, 8);
            if run >= n - 1 {
                assert!(t(i) >= sum - 1e-6, "{what}: less than its round trips");
            } else {
                let share = run as f64 / (n - 1) as f64;
                assert!(
                    t(i) >= sum * share && t(i) < sum,
                    "{what}: its reads did not overlap as its threads would"
                );
            }
            assert!(
                t(i) <= t(0) + sum + worker + 1e-6,
                "{what}: more than its round trips, its pause and a worker's round trips"
            );
        }
        at_l.push(t(1));
    }
    assert!(
        at_l[0] < at_l[1] && at_l[1] < at_l[2],
        "rank 0's time per barrier does not grow with the cluster: {at_l:?}"
    );
    let table = latency_table(&[at(4, l)], s, l);
    assert!(
        table.contains("500us") && table.lines().count() >= 7,
        "{table}"
    );
}
