//! Elastic mode (`[cluster] min-nodes`): a generation that ended because a member was
//! lost is followed, in the same processes, by one of the members left. The decisions are
//! the core's ([`membership::Regroup`]: who claims the next generation number, who waits,
//! who stops); here they are performed on the shared directory, and the node then goes on
//! from where the members' journals say.
//!
//! What a dropped rank leaves of the current iteration is done by a *stand-in*
//! ([`membership::stand_ins`]): a member that runs the rank's per-rank rollout under the
//! rank's number, so its shard is merged as if the rank had written it.

use super::Node;
use crate::clock;
use crate::protocol::journal;
use crate::protocol::machine::{self, NodeMachine};
use crate::protocol::membership::{self as ms, Members, Regroup, Regrouped};
use crate::protocol::{AbortInfo, AbortKind, ClusterRecord, NodeState};
use std::collections::BTreeSet;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

/// The node's coordination machine for a generation of `members` (`None`: every rank),
/// as this rank takes part in it.
pub(super) fn machine_for(
    cfg: &crate::config::Config,
    host: &str,
    cluster: Option<&str>,
    rank: u32,
    members: Option<Members>,
    broken: &super::Broken,
) -> NodeMachine {
    let (position, size) = match &members {
        Some(m) => (m.position(rank).expect("a member"), m.len()),
        None => (rank, cfg.cluster.num_nodes),
    };
    NodeMachine::new(machine::Settings {
        rank: position,
        num_nodes: size,
        host: host.to_string(),
        cluster: cluster.map(str::to_string),
        heartbeat_interval: cfg.timing.heartbeat_interval,
        dead_after: cfg.timing.dead_after,
        topology: crate::protocol::topology::Topology::for_cluster(
            size,
            cfg.cluster.barrier_groups_from,
        ),
        members,
    })
    .with_mutations(machine::Mutations {
        barrier: broken.barrier,
        abort: broken.abort,
        liveness: broken.liveness,
        ..Default::default()
    })
}

impl Node {
    /// The members of the generation joined (every rank, unless one was dropped).
    pub(super) fn members(&self) -> Members {
        self.machine
            .settings()
            .members
            .clone()
            .unwrap_or_else(|| Members::all(self.num_nodes()))
    }

    /// The rank whose share the running command does: this rank's own, or the dropped
    /// rank it stands in for.
    pub(super) fn acting_rank(&self) -> u32 {
        self.acting_for.unwrap_or(self.rank)
    }

    /// Run every iteration; in elastic mode, each loss of a member (declared dead) is
    /// followed by a regroup of the members left, and the node goes on.
    pub(super) fn run_elastic(&mut self) -> Result<(), super::Stop> {
        loop {
            let stop = match self.run_iterations() {
                Ok(()) => return Ok(()),
                Err(stop) => stop,
            };
            let Some(info) = self.lost_member() else {
                return Err(stop);
            };
            self.regroup(info)?;
        }
    }

    /// The abort that ended the generation, when it is survived: elastic mode, and a
    /// member other than this one declared dead.
    fn lost_member(&self) -> Option<AbortInfo> {
        if !self.cfg.elastic() {
            return None;
        }
        let info = self.machine.stopped()?;
        (info.kind == AbortKind::PeerDead
            && info.culprit != self.rank
            && self.members().contains(info.culprit)
            && info.cluster.is_none())
        .then(|| info.clone())
    }

    /// Generation `gen` ended with a member lost (`info`): stop what runs, leave the
    /// generation, and form or join the next one of the members left; then the node is
    /// in that generation, ready to walk from where its journals say.
    fn regroup(&mut self, info: AbortInfo) -> Result<(), super::Stop> {
        let old_gen = self.gen();
        let members = self.members();
        self.warn(&format!(
            "generation {old_gen}: rank {} lost ({}); regrouping without it (cluster.min-nodes = {})",
            info.culprit,
            info.reason,
            self.cfg.min_nodes()
        ));
        self.event(crate::events::Event::MemberLost {
            lost: info.culprit,
            reason: info.reason.clone(),
        });
        // What ran in the generation ended is stopped: its outputs are uncommitted (a
        // commit is fenced by the generation), and are redone in the next one from where
        // the journals say.
        self.watchdog.pet("stopping commands for the regroup");
        let grace = self.cfg.timing.kill_grace;
        if let Some(server) = self.server.take() {
            self.launcher.stop(server.pid, self.cfg.server.stop_grace);
        }
        self.launcher.stop_all(grace);
        self.exited.clear();
        if let Some(p) = self.publisher.take() {
            self.watchdog
                .pet("writing the record of the generation left");
            p.finish(
                |r| {
                    if !r.state.is_terminal() {
                        r.state = NodeState::Failed;
                    }
                    r.waiting_for.clear();
                },
                Duration::from_secs(5),
            );
        }
        let t = &self.cfg.timing;
        // Long enough for a coordinator that is alive to publish, through stale caches.
        let patience = 2 * t.dead_after + 2 * t.poll_interval.max(Duration::from_secs(1));
        let mut regroup = Regroup::new(
            self.rank,
            old_gen,
            members,
            BTreeSet::from([info.culprit]),
            self.cfg.min_nodes(),
            patience,
            self.clock.since_start(),
        );
        let joined = self.drive_regroup(&mut regroup, &info)?;
        self.join_regrouped(joined)
    }

    /// Perform the regroup's effects until it joined a generation (its record) or stopped.
    fn drive_regroup(
        &mut self,
        g: &mut Regroup,
        lost: &AbortInfo,
    ) -> Result<ClusterRecord, super::Stop> {
        let poll = self.cfg.timing.poll_interval;
        loop {
            while let Some(effect) = g.poll_effect() {
                let clock = self.clock.clone();
                let now = move || clock.since_start();
                self.watchdog.pet("regrouping");
                match effect {
                    ms::Effect::Info(line) => self.info(&line),
                    ms::Effect::Claim { gen } => {
                        let won = match self.store.create_dir(&self.layout.gen_dir(gen)) {
                            Ok(()) => true,
                            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
                            Err(e) => return Err(self.regroup_failed(gen, e)),
                        };
                        let published = self.published_regroup(won, gen);
                        g.handle(now(), ms::Input::Claimed { won, published });
                    }
                    ms::Effect::ReadCurrent => {
                        let _ = self.store.refresh(self.layout.root());
                        let current = self
                            .store
                            .read_json::<ClusterRecord>(&self.layout.cluster())
                            .ok()
                            .flatten()
                            .filter(|c| c.run_id == self.run_id())
                            .map(|c| Regrouped::from(&c));
                        g.handle(now(), ms::Input::Current(current));
                    }
                    ms::Effect::Publish(next) => {
                        let won = self.publish_regrouped(&next)?;
                        let found = self.published_regroup(won, next.gen);
                        g.handle(now(), ms::Input::Published { won, found });
                    }
                    ms::Effect::Spend { gen } => {
                        let mark = ms::SpentNumber {
                            spent_by: self.rank,
                            reason: "claimed, never published".into(),
                        };
                        let won = self
                            .store
                            .create_new_json(&self.layout.gen_cluster(gen), &mark)
                            .map_err(|e| self.regroup_failed(gen, e))?;
                        let found = self.published_regroup(won, gen);
                        g.handle(now(), ms::Input::Spent { won, found });
                    }
                    ms::Effect::Joined { gen, .. } => {
                        let _ = self.store.refresh(&self.layout.gen_dir(gen));
                        return match self
                            .store
                            .read_json::<ClusterRecord>(&self.layout.gen_cluster(gen))
                        {
                            Ok(Some(c)) => Ok(c),
                            Ok(None) => Err(self
                                .regroup_failed(gen, std::io::Error::other("its record is gone"))),
                            Err(e) => Err(self.regroup_failed(gen, e)),
                        };
                    }
                    ms::Effect::Stop(ending) => {
                        let mut stop = self.adopt_abort(lost.clone());
                        stop.message = format!("{}; {ending}", stop.message);
                        return Err(stop);
                    }
                }
            }
            // Waiting for the next coordinator: look again each poll (a signal stops).
            match clock::recv_timeout(&*self.clock, &self.events, poll) {
                Ok(crate::process::Event::Signal(sig)) => return Err(self.signalled(sig)),
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => unreachable!("the reaper holds a sender"),
            }
            g.handle(self.clock.since_start(), ms::Input::Timeout);
        }
    }

    /// A signal while regrouping: the node stops for it (no generation to publish in).
    fn signalled(&mut self, sig: i32) -> super::Stop {
        let (kind, reason) = super::signals::abort_for(sig);
        let mut info = self.machine.abort_info(kind, self.rank, None, reason, None);
        info.at = self.wall_stamp();
        let (cause, hint) =
            crate::protocol::abort::consequence(&info, self.rank, self.layout.cluster_name());
        super::Stop {
            cause,
            message: info.describe(),
            hint,
            detail: None,
        }
    }

    fn regroup_failed(&self, gen: u64, e: std::io::Error) -> super::Stop {
        super::Stop::failed(format!(
            "regrouping into generation {gen}: {}: {e}",
            self.layout.gen_dir(gen).display()
        ))
        .with_hint("check that --log-path is on a writable shared filesystem")
    }

    /// After an exclusive create for `gen` this node lost (`!won`): the generation that
    /// number's record publishes (`None`: none yet, or a spent number's mark).
    fn published_regroup(&self, won: bool, gen: u64) -> Option<Regrouped> {
        if won {
            return None;
        }
        let _ = self.store.refresh(&self.layout.gen_dir(gen));
        self.store
            .read_json::<ClusterRecord>(&self.layout.gen_cluster(gen))
            .ok()
            .flatten()
            .map(|c| Regrouped::from(&c))
    }

    /// This node won the claim of `next.gen`: create the generation's record exclusively
    /// (`false`: it was there already), then, created, its own record and `cluster.json`.
    /// Where the generation resumes is the first iteration not every member completed.
    fn publish_regrouped(&mut self, next: &Regrouped) -> Result<bool, super::Stop> {
        let old = self.machine.cluster().expect("joined").clone();
        let journals = self.journals_of(next.members.ranks());
        let resume = journal::resume_point(&journals, &old.run_id, &self.cfg.walk_item())
            .not_before(self.cfg.cluster.first_iteration);
        let mut cluster = self.cluster_record(next.gen, &old.run_id, old.previous.clone(), resume);
        cluster.members = Some(next.members.clone());
        cluster.master_addr = self.moved_master_addr(&old);
        let path = self.layout.gen_cluster(next.gen);
        let won = self
            .store
            .create_new_json(&path, &cluster)
            .map_err(|e| self.regroup_failed(next.gen, e))?;
        if !won {
            return Ok(false);
        }
        self.start_member_record(&cluster)?;
        self.store
            .publish_json(&self.layout.cluster(), &cluster)
            .map_err(|e| self.regroup_failed(next.gen, e))?;
        self.append_history(&cluster);
        self.info(&format!(
            "formed generation {} of {} (resuming at iteration {})",
            next.gen,
            super::ranks_list(next.members.ranks()),
            resume.iteration
        ));
        Ok(true)
    }

    /// The address the new coordinator publishes for torchrun's rendezvous: its own (a
    /// configured name was rank 0's, unless it is a loopback address: then every node runs
    /// on one machine, the new coordinator's too).
    fn moved_master_addr(&self, old: &ClusterRecord) -> String {
        match self.cfg.cluster.master_addr.as_str() {
            "ip" => crate::node::context::first_ip_address().unwrap_or_else(|| self.host.clone()),
            "" => self.host.clone(),
            configured if self.rank == 0 || is_loopback(configured) => configured.to_string(),
            configured => {
                self.warn(&format!(
                    "cluster.master-addr = {configured:?} names rank 0's host, and rank 0 is not a member; torchrun's MASTER_ADDR is this host ({}) instead (was {})",
                    self.host, old.master_addr
                ));
                self.host.clone()
            }
        }
    }

    /// Every member's journal among `ranks`, as read now (missing or unreadable: empty).
    pub(super) fn journals_of(&self, ranks: &[u32]) -> Vec<Vec<journal::Entry>> {
        ranks
            .iter()
            .map(|&r| {
                self.store
                    .read_limited(&self.layout.journal(r), crate::store::ReadLimit::Journal)
                    .ok()
                    .flatten()
                    .and_then(|t| String::from_utf8(t).ok())
                    .map(|t| journal::parse(&t))
                    .unwrap_or_default()
            })
            .collect()
    }

    /// This rank's record in `cluster`'s generation, published by the heartbeat thread.
    fn start_member_record(&mut self, cluster: &ClusterRecord) -> Result<(), super::Stop> {
        let me = self.record(cluster.gen, &cluster.run_id, self.rank, NodeState::Running);
        let path = self.layout.rank_record(cluster.gen, self.rank);
        let publisher = super::Publisher::start(
            self.store.clone(),
            self.clock.clone(),
            path.clone(),
            me,
            self.cfg.timing.heartbeat_interval,
            self.watchdog.clone(),
        )
        .map_err(|e| self.regroup_failed(cluster.gen, e))?;
        self.set_publisher(publisher);
        Ok(())
    }

    /// Go on in `cluster`'s generation: a machine over its members (the model served kept),
    /// this rank's record there, and a first barrier that every member passes before any
    /// walks (a member that does not come is found dead there, and regrouped from).
    fn join_regrouped(&mut self, cluster: ClusterRecord) -> Result<(), super::Stop> {
        let members = cluster.members().clone();
        let coordinator = members.coordinator() == self.rank;
        let serving = std::mem::take(self.machine.serving_mut());
        self.machine = machine_for(
            &self.cfg,
            &self.host,
            self.layout.cluster_name(),
            self.rank,
            Some(members.clone()),
            &self.broken,
        )
        .with_serving(serving);
        self.machine.joined(cluster.clone());
        // The coordinator waits for a member that has not appeared yet instead of judging
        // it; a member watches the coordinator, whose record came first.
        self.machine.watch.formed = !coordinator;
        if self.publisher.is_none() {
            self.start_member_record(&cluster)?;
        }
        let dropped = members.dropped(self.num_nodes());
        self.info(&format!(
            "joined generation {} of {} ({} coordinates; dropped: {})",
            cluster.gen,
            super::ranks_list(members.ranks()),
            if coordinator {
                "this rank".to_string()
            } else {
                format!("rank {}", members.coordinator())
            },
            super::ranks_list(&dropped),
        ));
        self.event(crate::events::Event::Regrouped {
            members: members.ranks().to_vec(),
            coordinator: members.coordinator(),
        });
        self.waiting.note = format!("the members of generation {} to regroup", cluster.gen);
        self.barrier("regrouped", (), |_| ())?;
        self.machine.watch.formed = true;
        Ok(())
    }

    /// The dropped ranks this member stands in for, in the current generation.
    pub(super) fn standing_in_for(&self) -> Vec<u32> {
        let members = self.members();
        let dropped = members.dropped(self.num_nodes());
        ms::stand_ins(&members, &dropped)
            .into_iter()
            .filter(|&(_, member)| member == self.rank)
            .map(|(rank, _)| rank)
            .collect()
    }

    /// Whether dropped rank `rank` journaled `item` of the current iteration itself
    /// before it was lost (its output is committed: nothing to stand in for).
    pub(super) fn dropped_rank_did(&self, rank: u32, item: &str) -> bool {
        let journal = self.journals_of(&[rank]).pop().unwrap_or_default();
        journal::has(&journal, self.run_id(), self.machine.iteration(), item)
    }
}

/// Whether `addr` names this machine whichever node reads it (`localhost`, 127.0.0.0/8,
/// `::1`).
fn is_loopback(addr: &str) -> bool {
    addr.eq_ignore_ascii_case("localhost")
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|a| a.is_loopback())
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_addresses_name_every_nodes_machine() {
        for a in ["127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST"] {
            assert!(super::is_loopback(a), "{a}");
        }
        for a in ["10.0.0.1", "node-0", "0.0.0.0", ""] {
            assert!(!super::is_loopback(a), "{a}");
        }
    }
}
