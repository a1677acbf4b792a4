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
        let first = self.run_iterations();
        self.go_on(first)
    }

    /// After `result` of a generation: done, or (elastic mode) the next generation after
    /// a member was lost (also while a generation formed) or ranks came back, until done
    /// or stopped.
    pub(super) fn go_on(&mut self, mut result: Result<(), super::Stop>) -> Result<(), super::Stop> {
        loop {
            let stop = match result {
                Ok(()) => return Ok(()),
                Err(stop) => stop,
            };
            result = if let Some(gen) = self.moving_to.take() {
                self.move_to_grown(gen)
                    .and_then(|cluster| self.join_regrouped(cluster))
                    .and_then(|()| self.run_iterations())
            } else if let Some(info) = self.lost_member() {
                let before = self.gen();
                match self.regroup(info) {
                    Ok(()) => self.run_iterations(),
                    // Lost another member while the new generation formed: regroup again.
                    Err(stop) if self.gen() > before => Err(stop),
                    // Below min-nodes, left out, or the directory failed: the end.
                    Err(stop) => return Err(stop),
                }
            } else {
                return Err(stop);
            };
        }
    }

    /// The abort that ended the generation, when it is survived: elastic mode, and a
    /// member other than this one declared dead.
    fn lost_member(&self) -> Option<AbortInfo> {
        if !self.cfg.elastic() {
            return None;
        }
        let info = self.machine.stopped()?;
        ((info.kind == AbortKind::PeerDead || info.dropped)
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
        // the journals say. The inference server goes on: it serves the model the next
        // generation starts with (a hand-off restarts it), and a restart costs minutes.
        // So does a per-rank rollout command: its output, committed in the next generation
        // (`Node::rollout`), is the same rank's share whichever generation commits it.
        self.watchdog.pet("stopping commands for the regroup");
        let grace = self.cfg.timing.kill_grace;
        let carried = self
            .rolling
            .take()
            .filter(|_| self.launcher.registry().is_some());
        let keep: Vec<i32> = self
            .server
            .as_ref()
            .map(|s| s.pid)
            .into_iter()
            .chain(carried.as_ref().map(|c| c.running.pid))
            .collect();
        match self.launcher.registry() {
            Some(registry) => {
                let pids: Vec<i32> = registry
                    .groups()
                    .into_iter()
                    .filter(|g| !keep.contains(g))
                    .collect();
                self.launcher.stop_many(&pids, grace);
            }
            None => {
                self.server = None;
                self.launcher.stop_all(grace);
            }
        }
        self.workers = Default::default();
        self.exited.retain(|pid, _| keep.contains(pid));
        self.carried = carried;
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
        self.rejoins = Rejoins::new(self.cfg.timing.dead_after);
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
                        let current = self
                            .current_record(self.run_id())
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
                    ms::Effect::Joined { gen, .. } => return self.formed_record(gen),
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
                Ok(ev) => self.keep_exit(ev),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => unreachable!("the reaper holds a sender"),
            }
            g.handle(self.clock.since_start(), ms::Input::Timeout);
        }
    }

    /// While regrouping: a command that goes on through it (a rollout, the server) may
    /// end meanwhile; its exit is kept for whoever waits for it next.
    fn keep_exit(&mut self, ev: crate::process::Event) {
        if let crate::process::Event::Reaped { pid, exit } = ev {
            if self.launcher.contains(pid) {
                self.exited.insert(pid, exit);
            }
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
        self.gen_record(gen)
            .ok()
            .flatten()
            .map(|c| Regrouped::from(&c))
    }

    /// Generation `gen`'s record as this node reads it now: another node's client created
    /// it, so the directory's listing is refreshed first (a FUSE client's cached names).
    fn gen_record(&self, gen: u64) -> std::io::Result<Option<ClusterRecord>> {
        let _ = self.store.refresh(&self.layout.gen_dir(gen));
        self.store
            .read_json::<ClusterRecord>(&self.layout.gen_cluster(gen))
    }

    /// The record of generation `gen`, which this node goes to: there, or the regroup
    /// fails.
    fn formed_record(&self, gen: u64) -> Result<ClusterRecord, super::Stop> {
        self.gen_record(gen)
            .map_err(|e| self.regroup_failed(gen, e))?
            .ok_or_else(|| self.regroup_failed(gen, std::io::Error::other("its record is missing")))
    }

    /// The newest generation of run `run_id`, as `cluster.json` says now.
    fn current_record(&self, run_id: &str) -> Option<ClusterRecord> {
        let _ = self.store.refresh(self.layout.root());
        self.store
            .read_json::<ClusterRecord>(&self.layout.cluster())
            .ok()
            .flatten()
            .filter(|c| c.run_id == run_id)
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
        let publisher = self
            .publish_from_now(path, me, self.cfg.timing.heartbeat_interval)
            .map_err(|e| self.regroup_failed(cluster.gen, e))?;
        self.set_publisher(publisher);
        Ok(())
    }

    /// Go on in `cluster`'s generation: a machine over its members (the model served kept),
    /// this rank's record there, and a first barrier that every member passes before any
    /// walks (a member that does not come is found dead there, and regrouped from).
    pub(super) fn join_regrouped(&mut self, cluster: ClusterRecord) -> Result<(), super::Stop> {
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
            if dropped.is_empty() {
                "none".to_string()
            } else {
                super::ranks_list(&dropped)
            },
        ));
        self.event(crate::events::Event::Regrouped {
            members: members.ranks().to_vec(),
            coordinator: members.coordinator(),
        });
        self.regrouped_barrier(cluster.gen)?;
        self.machine.watch.formed = true;
        Ok(())
    }

    /// The generation's first barrier: every member there before any walks. A member that
    /// does not come within twice dead-after (it died while the generation formed, or a
    /// rank asking to come back stopped) is counted lost, which the members left regroup
    /// from; a member whose coordinator does not release it counts the coordinator lost.
    fn regrouped_barrier(&mut self, gen: u64) -> Result<(), super::Stop> {
        const NAME: &str = "regrouped";
        let k = self.machine.arrive(NAME, &());
        let started = self.clock.now();
        let patience = 2 * self.cfg.timing.dead_after;
        let deadline = self.clock.now() + patience;
        let coordinator = self.is_master();
        self.waiting.note = format!("the members of generation {gen} to arrive");
        let mut missing = Vec::new();
        self.drive_machine()?;
        let waited = self.wait_for(deadline, |n| {
            let progress = n.machine.progress::<(), ()>();
            n.drive_machine()?;
            Ok(match progress {
                crate::protocol::barrier::Progress::Waiting { missing: m } => {
                    missing = m;
                    None
                }
                _ => Some(()),
            })
        });
        self.waiting.note.clear();
        let result = match waited {
            Ok(()) => {
                if coordinator {
                    self.machine.release(&());
                    self.drive_machine()?;
                }
                self.event(crate::events::Event::Barrier {
                    name: NAME.to_string(),
                    k,
                    waited_ms: self.clock.elapsed(started).as_millis() as u64,
                });
                Ok(())
            }
            Err(super::Interrupt::Stop(stop)) => Err(stop),
            Err(super::Interrupt::Deadline) => {
                let lost = missing
                    .first()
                    .copied()
                    .unwrap_or_else(|| self.members().coordinator());
                let reason = format!(
                    "rank {lost} did not arrive in generation {gen} within {} (twice dead-after)",
                    humantime::format_duration(patience)
                );
                let mut info =
                    self.abort_info(AbortKind::PeerDead, lost, Some("?".into()), reason, None);
                info.silent_ms = Some(patience.as_millis() as u64);
                Err(self.publish_abort(info))
            }
        };
        self.machine.leave_barrier();
        result
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

/// A per-rank rollout command that goes on running through a regroup.
#[derive(Debug, Clone)]
pub(super) struct Carried {
    pub iteration: u64,
    pub split: String,
    /// The rank whose share it is (this one's, or the dropped rank it stands in for).
    pub rank: u32,
    /// Its `{output}`: the partial file of the generation that started it.
    pub partial: std::path::PathBuf,
    pub running: crate::process::Running,
    pub log: std::path::PathBuf,
}

/// How a process started for a rank while the run goes on without it comes back.
pub(super) enum Rejoined {
    /// A generation formed for it lists it (its record).
    Joined(Box<ClusterRecord>),
    /// The run finished meanwhile.
    Complete(crate::error::Notice),
}

impl Node {
    /// At start in elastic mode: the run's generation, when it is live without this
    /// process (its coordinator heartbeats): this process then asks to come back instead
    /// of joining (or, as rank 0, forming) a generation of its own, which would replace
    /// the one the others are running. A generation whose coordinator stopped, or whose
    /// heartbeat is still for dead-after (every node was stopped or killed), is a run to
    /// start again as usual.
    pub(super) fn live_generation(&mut self) -> Option<ClusterRecord> {
        if !self.cfg.elastic() || self.fresh {
            return None;
        }
        let read = |n: &Node| {
            let c = n
                .store
                .read_json::<ClusterRecord>(&n.layout.cluster())
                .ok()
                .flatten()?;
            let coordinator = c.members().coordinator();
            let rec = n.read_record(c.gen, coordinator)?;
            Some((c, rec))
        };
        let (first, rec) = read(self)?;
        if rec.state.is_terminal() || rec.state == NodeState::Vacant {
            return None;
        }
        // A generation that lists this rank with its slot still vacant is forming, and
        // this process is one it waits for: it joins as usual. A slot some process held
        // is this rank's previous process's, which the others will count lost.
        if first.members().contains(self.rank)
            && self
                .read_record(first.gen, self.rank)
                .is_none_or(|r| r.state == NodeState::Vacant)
        {
            return None;
        }
        let until = self.clock.now() + self.cfg.timing.dead_after;
        self.info(&format!(
            "generation {} of run {} may still be running (rank {}'s record says {:?}); watching its heartbeat for up to {} before deciding to ask to come back or to start as usual",
            first.gen,
            first.run_id,
            first.members().coordinator(),
            rec.state,
            humantime::format_duration(self.cfg.timing.dead_after)
        ));
        while self.clock.now() < until {
            self.watchdog.pet("watching the running generation");
            self.clock.sleep(self.cfg.timing.poll_interval);
            let (now, later) = read(self)?;
            if now.gen != first.gen || later.state.is_terminal() {
                return None;
            }
            if later.seq != rec.seq {
                return Some(now);
            }
        }
        None
    }

    /// Ask to come back into the run `current` belongs to, and wait for a generation
    /// formed after asking that lists this rank (`membership::Rejoin`): the coordinator
    /// forms one at its next iteration boundary. Ends at join-timeout, or when the run
    /// completes meanwhile.
    pub(super) fn rejoin(&mut self, current: ClusterRecord) -> Result<Rejoined, super::Stop> {
        let mut rj = ms::Rejoin::new(self.rank);
        let run_id = current.run_id.clone();
        self.info(&format!(
            "the run goes on without rank {} (generation {} of {}): asking to come back at its next iteration",
            self.rank,
            current.gen,
            super::ranks_list(current.members().ranks()),
        ));
        let deadline = self.clock.now() + self.cfg.timing.join_timeout;
        let mut asking: Option<super::Publisher> = None;
        loop {
            while let Some(effect) = rj.poll_effect() {
                self.watchdog.pet("asking to come back");
                match effect {
                    ms::RejoinEffect::ReadCurrent => {
                        let c = self.current_record(&run_id);
                        if let Some(c) = &c {
                            let coordinator = c.members().coordinator();
                            if self
                                .read_record(c.gen, coordinator)
                                .is_some_and(|r| r.state == NodeState::Done)
                            {
                                break_with(&mut asking);
                                return Ok(Rejoined::Complete(crate::error::Notice {
                                    message: format!(
                                        "run {run_id} completed while rank {} asked to come back: nothing to do",
                                        self.rank
                                    ),
                                    hint: None,
                                }));
                            }
                        }
                        rj.handle(ms::RejoinInput::Current(c.map(|c| Regrouped::from(&c))));
                    }
                    ms::RejoinEffect::Ask { gen } => {
                        if let Some(p) = asking.take() {
                            p.finish(|r| r.state = NodeState::Left, Duration::from_secs(5));
                        }
                        let me = self.record(gen, &run_id, self.rank, NodeState::Joining);
                        let path = self.layout.rejoin_request(gen, self.rank);
                        let p = self
                            .publish_from_now(path, me, self.cfg.timing.heartbeat_interval)
                            .map_err(|e| self.regroup_failed(gen, e))?;
                        self.info(&format!("asked to come back in generation {gen}"));
                        asking = Some(p);
                    }
                    ms::RejoinEffect::Joined { gen, .. } => {
                        let c = self.formed_record(gen)?;
                        break_with(&mut asking);
                        return Ok(Rejoined::Joined(Box::new(c)));
                    }
                }
            }
            if rj.is_done() {
                unreachable!("a joined rejoin returned");
            }
            if self.clock.now() >= deadline {
                break_with(&mut asking);
                return Err(super::Stop::failed(format!(
                    "no generation took rank {} back within join-timeout ({}): the run's coordinator forms one at its next iteration boundary",
                    self.rank,
                    humantime::format_duration(self.cfg.timing.join_timeout)
                ))
                .with_hint("check that the run is still going (rl-node status), or raise timing.join-timeout"));
            }
            match clock::recv_timeout(&*self.clock, &self.events, self.cfg.timing.poll_interval) {
                Ok(crate::process::Event::Signal(sig)) => {
                    break_with(&mut asking);
                    return Err(self.signalled(sig));
                }
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => unreachable!("the reaper holds a sender"),
            }
            rj.handle(ms::RejoinInput::Poll);
        }
    }

    /// The coordinator, every heartbeat while a rank is dropped: read the dropped ranks'
    /// requests to come back in this generation.
    pub(super) fn rejoin_round(&mut self) {
        if !self.cfg.elastic() || !self.is_master() || self.machine.cluster().is_none() {
            return;
        }
        let now = self.clock.since_start();
        if self
            .rejoins
            .read_at
            .is_some_and(|t| now < t + self.cfg.timing.heartbeat_interval)
        {
            return;
        }
        self.rejoins.read_at = Some(now);
        let gen = self.gen();
        for r in self.members().dropped(self.num_nodes()) {
            let path = self.layout.rejoin_request(gen, r);
            let (read, at) = super::stamped(&*self.clock, || {
                self.store.read_json::<crate::protocol::RankRecord>(&path)
            });
            let seq = read
                .ok()
                .flatten()
                .filter(|rec| rec.gen == gen && rec.rank == r && rec.state == NodeState::Joining)
                .map(|rec| rec.seq);
            self.rejoins.requests.observe(r, seq, at);
        }
    }

    /// The coordinator at an iteration's `sync-start`, every member arrived: when dropped
    /// ranks ask to come back (live requests), form the generation of every member and
    /// them, to be released with this barrier. `None`: nobody to take back (or another
    /// rank took the number: the cluster stays as it is).
    pub(super) fn grow_generation(&mut self) -> Option<u64> {
        if !self.cfg.elastic() || !self.is_master() {
            return None;
        }
        let members = self.members();
        let live = self.rejoins.requests.live(self.clock.since_start());
        let grown = ms::grow(&members, &live, self.num_nodes())?;
        let old = self.machine.cluster().expect("joined").clone();
        let gen = old.gen + 1;
        match self.store.create_dir(&self.layout.gen_dir(gen)) {
            Ok(()) => {}
            Err(e) => {
                self.warn(&format!(
                    "cannot form generation {gen} to take back rank(s) {}: {}: {e}; the cluster stays as it is",
                    super::ranks_list(&grown.dropped(0)),
                    self.layout.gen_dir(gen).display()
                ));
                return None;
            }
        }
        // It starts this iteration: the members journaled every earlier one.
        let resume = journal::Resume {
            iteration: self.machine.iteration(),
            train_done: false,
            train_failed: false,
        };
        let mut cluster = self.cluster_record(gen, &old.run_id, old.previous.clone(), resume);
        cluster.members = Some(grown.clone());
        cluster.master_addr = old.master_addr.clone();
        if !matches!(
            self.store
                .create_new_json(&self.layout.gen_cluster(gen), &cluster),
            Ok(true)
        ) {
            self.warn(&format!(
                "cannot publish generation {gen}'s record; the cluster stays as it is"
            ));
            return None;
        }
        // Its own record first: the members watch it from the moment they read the
        // generation.
        let me = self.record(gen, &old.run_id, self.rank, NodeState::Running);
        if let Err(e) = self
            .store
            .publish_json(&self.layout.rank_record(gen, self.rank), &me)
        {
            self.warn(&format!("cannot write this rank's record of generation {gen}: {e}; the cluster stays as it is"));
            return None;
        }
        let back: Vec<u32> = grown
            .ranks()
            .iter()
            .copied()
            .filter(|r| !members.contains(*r))
            .collect();
        self.info(&format!(
            "{} asked to come back: formed generation {gen} of {} from iteration {}",
            super::ranks_list(&back),
            super::ranks_list(grown.ranks()),
            resume.iteration
        ));
        self.rejoins.formed = Some(cluster);
        Some(gen)
    }

    /// After `sync-start` released generation `gen`'s members into a grown generation:
    /// the coordinator makes it the current one (`cluster.json`, the history); every
    /// member leaves its record of this generation as it is and goes there.
    pub(super) fn move_to_grown(&mut self, gen: u64) -> Result<ClusterRecord, super::Stop> {
        let cluster = match self.rejoins.formed.take() {
            Some(c) => {
                self.store
                    .publish_json(&self.layout.cluster(), &c)
                    .map_err(|e| self.regroup_failed(gen, e))?;
                self.append_history(&c);
                c
            }
            None => self.formed_record(gen)?,
        };
        if let Some(p) = self.publisher.take() {
            p.finish(|_| {}, Duration::from_secs(5));
        }
        self.rejoins = Rejoins::new(self.cfg.timing.dead_after);
        Ok(cluster)
    }
}

/// The coordinator's view of dropped ranks asking to come back, and a grown generation
/// formed but not yet made current.
#[derive(Debug)]
pub(super) struct Rejoins {
    requests: ms::Requests,
    read_at: Option<Duration>,
    formed: Option<ClusterRecord>,
}

impl Rejoins {
    pub(super) fn new(dead_after: Duration) -> Rejoins {
        Rejoins {
            requests: ms::Requests::new(dead_after),
            read_at: None,
            formed: None,
        }
    }
}

/// Stop heartbeating a request to come back (its process goes on, or stops).
fn break_with(asking: &mut Option<super::Publisher>) {
    if let Some(p) = asking.take() {
        p.finish(|r| r.state = NodeState::Left, Duration::from_secs(5));
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
