//! Who reads whose record: flat, or in two levels through group leaders.
//!
//! In a flat cluster rank 0 reads every worker's record at every barrier and watches
//! every worker's heartbeat, and a worker reads only rank 0's. Rank 0's reads then grow
//! with the cluster: at 64 nodes it made about 670 shared-directory operations per
//! barrier, and over NFS (about half a millisecond per round trip) that is what makes a
//! large cluster's iteration slow. From `[cluster] barrier-groups-from` nodes on, the
//! workers form groups of about √N consecutive ranks instead. The first rank of each
//! group is its *leader*: it reads its group's records, and once every member arrived at
//! a barrier it publishes the group's arrival (every member's gathered value, in rank
//! order) in its own record. Rank 0 reads only the leaders. Releases and aborts still go
//! out through rank 0's record, which every worker reads; a member's abort or death
//! reaches rank 0 through its leader's record (one hop more).
//!
//! Every node computes the same topology from the cluster's size and the shared
//! configuration (part of the fingerprint every node must match), so no message carries
//! it. Pure: no I/O.

use std::ops::Range;

/// The shape of a cluster's barriers and watching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    num_nodes: u32,
    /// Ranks per group of workers; 0: flat.
    group: u32,
}

impl Topology {
    /// Rank 0 reads every worker.
    pub fn flat(num_nodes: u32) -> Topology {
        Topology {
            num_nodes,
            group: 0,
        }
    }

    /// Workers in groups of `group` consecutive ranks (the last one may be smaller). A
    /// group size of 0, 1 or at least the number of workers is flat: one worker per
    /// group or one group of all adds a hop and saves no read.
    pub fn grouped(num_nodes: u32, group: u32) -> Topology {
        let workers = num_nodes.saturating_sub(1);
        if group <= 1 || group >= workers {
            return Topology::flat(num_nodes);
        }
        Topology { num_nodes, group }
    }

    /// The cluster's topology from its size and `[cluster] barrier-groups-from` (0:
    /// never): flat below it, else groups of ⌈√(N−1)⌉ workers, which makes rank 0's
    /// reads and a leader's about equal (√N each).
    pub fn for_cluster(num_nodes: u32, groups_from: u32) -> Topology {
        if groups_from == 0 || num_nodes < groups_from {
            return Topology::flat(num_nodes);
        }
        let workers = num_nodes.saturating_sub(1);
        let mut g = (workers as f64).sqrt() as u32;
        while g * g < workers {
            g += 1;
        }
        Topology::grouped(num_nodes, g)
    }

    pub fn num_nodes(&self) -> u32 {
        self.num_nodes
    }

    pub fn is_flat(&self) -> bool {
        self.group == 0
    }

    /// Ranks per group (0: flat).
    pub fn group_size(&self) -> u32 {
        self.group
    }

    /// The group of worker `rank` (`rank` ≥ 1): its ranks, its leader first. Flat: every
    /// worker is a group of its own.
    pub fn group_of(&self, rank: u32) -> Range<u32> {
        debug_assert!(rank >= 1 && rank < self.num_nodes, "a worker's group");
        if self.group == 0 {
            return rank..rank + 1;
        }
        let leader = 1 + (rank - 1) / self.group * self.group;
        leader..(leader + self.group).min(self.num_nodes)
    }

    /// Whether `rank` leads a group (a group of one too: it publishes its group's
    /// arrival like any leader, so rank 0 reads every leader alike). Flat: nobody.
    pub fn is_leader(&self, rank: u32) -> bool {
        self.group != 0
            && rank >= 1
            && rank < self.num_nodes
            && (rank - 1).is_multiple_of(self.group)
    }

    /// The other ranks of the group `leader` leads (empty for a rank that leads none).
    pub fn members(&self, leader: u32) -> Range<u32> {
        if !self.is_leader(leader) {
            return leader..leader;
        }
        leader + 1..(leader + self.group).min(self.num_nodes)
    }

    /// What rank 0 reads at a barrier: every worker (flat) or every group's leader (a
    /// group of one is its own leader and publishes its group's arrival too).
    pub fn leaders(&self) -> impl Iterator<Item = u32> + '_ {
        let step = self.group.max(1) as usize;
        (1..self.num_nodes).step_by(step)
    }

    /// The ranks `me` reads, in rank order: rank 0 the leaders (every worker when flat),
    /// a leader rank 0 and its members, any other worker rank 0.
    pub fn watched(&self, me: u32) -> Vec<u32> {
        if me == 0 {
            return self.leaders().collect();
        }
        std::iter::once(0).chain(self.members(me)).collect()
    }

    /// Whether `me` reads `rank`'s record.
    pub fn watches(&self, me: u32, rank: u32) -> bool {
        match (me, rank) {
            (0, 0) => false,
            (0, r) => self.is_flat() || self.is_leader(r),
            (_, 0) => true,
            (m, r) => self.members(m).contains(&r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_clusters_and_degenerate_groups_are_flat() {
        assert!(Topology::for_cluster(63, 64).is_flat());
        assert!(Topology::for_cluster(1000, 0).is_flat());
        assert!(Topology::grouped(5, 1).is_flat());
        assert!(
            Topology::grouped(5, 4).is_flat(),
            "one group of every worker"
        );
        let flat = Topology::flat(4);
        assert_eq!(flat.watched(0), vec![1, 2, 3]);
        assert_eq!(flat.watched(2), vec![0]);
        assert!(!flat.is_leader(1));
        assert!(flat.watches(0, 3) && flat.watches(3, 0) && !flat.watches(1, 2));
    }

    #[test]
    fn sixty_four_nodes_form_eight_groups_of_eight_workers_or_fewer() {
        let t = Topology::for_cluster(64, 64);
        assert_eq!(t.group_size(), 8);
        assert_eq!(t.watched(0), vec![1, 9, 17, 25, 33, 41, 49, 57]);
        assert_eq!(t.watched(9), vec![0, 10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(
            t.watched(57),
            vec![0, 58, 59, 60, 61, 62, 63],
            "the last is short"
        );
        assert_eq!(t.watched(12), vec![0]);
        assert_eq!(t.group_of(12), 9..17);
        assert_eq!(t.group_of(63), 57..64);
        assert!(t.is_leader(57) && !t.is_leader(58) && !t.is_leader(0));
        assert!(t.watches(0, 9) && !t.watches(0, 10) && t.watches(9, 16) && !t.watches(9, 17));
        // Every worker is read by exactly one reader: rank 0 (leaders) or its leader.
        for r in 1..64 {
            let readers = (0..64).filter(|&m| m != r && t.watches(m, r)).count();
            assert_eq!(readers, 1, "rank {r}");
        }
        // 1,024 nodes: groups of 32, so rank 0 reads 32 leaders and each leader 31.
        let big = Topology::for_cluster(1024, 64);
        assert_eq!((big.group_size(), big.leaders().count()), (32, 32));
    }

    #[test]
    fn a_last_group_of_one_leads_only_itself() {
        // 10 nodes, 9 workers in groups of 4: 1-4, 5-8, and 9 alone.
        let t = Topology::grouped(10, 4);
        assert_eq!(t.watched(0), vec![1, 5, 9]);
        assert_eq!(t.members(9), 10..10);
        assert!(
            t.is_leader(9),
            "it leads itself, and publishes its group's arrival"
        );
        assert_eq!(t.watched(9), vec![0]);
        assert_eq!(t.group_of(9), 9..10);
    }
}
