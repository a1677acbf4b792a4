//! Forming a generation.
//!
//! Rank 0 starts generation G+1: it checks that no live rank 0 holds the previous one,
//! creates `gen-G/` with a placeholder record for every rank (so each worker later
//! *rewrites* an existing name, which every NFS client sees at its next open, instead of
//! creating one that negative lookup caching could hide for a minute), writes its own
//! record, and only then publishes `cluster.json`. Join is barrier 0 of the generation.
//!
//! A worker waits for a joinable generation: rank 0 alive and still joining. A generation
//! that ended, or formed without this rank, is skipped, so a worker started long before
//! its master simply waits. Refusals (different configuration, rank held by a live
//! process) happen before the worker writes anything. A worker started with `--fresh`
//! (every node is, under srun) never ends at the run it found first: rank 0 sets that one
//! aside, perhaps only after the worker looked.
//!
//! The procedure is the protocol's machines: a worker's `JoinMachine`
//! (`protocol::join_machine`), and as rank 0 a `RunMachine` (`protocol::run_machine`:
//! wait out a previous rank 0, check and choose the run) handing the run chosen to a
//! `FormMachine`. This file is their driver: it performs what they ask on the shared
//! directory, hands back what it read, and says what they concluded, so the simulator
//! (tests/sim/joins.rs), which drives the same machines, checks the node's own procedure.

use super::{random_id, Interrupt, Node, Stop};
use crate::error::Notice;
use crate::events;
use crate::exit::Cause;
use crate::holder;
use crate::protocol::join;
use crate::protocol::join_machine::{self, FormMachine, JoinMachine};
use crate::protocol::journal::Resume;
use crate::protocol::messages;
use crate::protocol::run_machine::{RunEffect, RunInput, RunMachine, RunSettings, StateRead};
use crate::protocol::{ClusterRecord, Mark, NodeState, RankRecord, PROTO};
use crate::state::{self, StateError};
use std::time::Duration;

use crate::protocol::liveness::Holder;

/// How a join ends when it does not stop the node.
pub(super) enum Joined {
    /// The generation formed: this node walks the iterations with it.
    Formed,
    /// The run is complete up to `--iterations`: nothing to do, no generation to form.
    AlreadyComplete(Notice),
}

/// How rank 0's start ended when it does not stop the node.
enum Ran {
    /// Start generation `gen` (at least) of run `run_id` at `resume`.
    Chosen {
        run_id: String,
        gen: u64,
        previous: Option<String>,
        resume: Resume,
    },
    /// The run is complete up to `--iterations`.
    Complete(Notice),
}

/// A write of the generation failed.
fn io_err(what: String, e: std::io::Error) -> Stop {
    Stop::failed(format!("{what}: {e}"))
        .with_hint("check that --log-path is on a writable shared filesystem")
}

impl Node {
    pub(super) fn join(&mut self) -> Result<Joined, Stop> {
        if self.is_master() {
            self.join_master()
        } else {
            self.join_worker()
        }
    }

    pub(super) fn record(&self, gen: u64, run_id: &str, rank: u32, state: NodeState) -> RankRecord {
        let slot = RankRecord {
            state,
            wall: self.wall_stamp(),
            ..RankRecord::vacant(run_id, gen, rank)
        };
        if rank != self.rank {
            return slot;
        }
        RankRecord {
            host: self.host.clone(),
            pid: self.pid,
            machine: self.ident.machine.clone(),
            pid_start: self.ident.start,
            nonce: self.nonce.clone(),
            ..slot
        }
    }

    /// The join (barrier 0) as this rank: its arrival, and as rank 0 its release.
    fn join_barrier(&self) -> join::JoinBarrier {
        join::barrier(self.rank, self.joined())
    }

    /// This process, as the join's marks name it.
    fn joined(&self) -> messages::Joined {
        messages::Joined {
            host: self.host.clone(),
            pid: self.pid,
        }
    }

    fn slot_patience(&self) -> Duration {
        self.cfg.timing.heartbeat_interval * 2 + self.cfg.timing.poll_interval
    }

    /// Rank 0 forms a generation: choose the run (a [`RunMachine`]), then publish the
    /// generation in order (placeholders, own record, `cluster.json`), record it in the
    /// history, wait for every rank, and release them (a [`FormMachine`]).
    fn join_master(&mut self) -> Result<Joined, Stop> {
        let (run_id, gen, previous, resume) = match self.choose_run()? {
            Ran::Chosen {
                run_id,
                gen,
                previous,
                resume,
            } => (run_id, gen, previous, resume),
            Ran::Complete(done) => return Ok(Joined::AlreadyComplete(done)),
        };
        let cluster = self.cluster_record(gen, &run_id, previous, resume);
        let settings = join_machine::FormSettings {
            num_nodes: self.num_nodes(),
            me: self.joined(),
            cluster_path: self.layout.cluster(),
        };
        let mut form = FormMachine::new(settings, cluster);
        self.drive_form(&mut form)?;
        self.wait_for_ranks(&mut form)?;
        Ok(Joined::Formed)
    }

    /// Rank 0's start up to the run chosen: the decisions and their order are the
    /// [`RunMachine`]'s; the reads, the renames and the log lines are here. Only the wait
    /// for a previous rank 0 that may still run polls.
    fn choose_run(&mut self) -> Result<Ran, Stop> {
        let settings = RunSettings {
            host: self.host.clone(),
            fresh: self.fresh,
            run_fingerprint: self.cfg.run_fingerprint(),
            run_identity: self.cfg.run_identity(),
            root: self.layout.root().to_path_buf(),
            walk_item: self.cfg.walk_item(),
            first_iteration: self.cfg.cluster.first_iteration,
            iterations: self.cfg.cluster.iterations,
            slot_patience: self.slot_patience(),
            dead_after: self.cfg.timing.dead_after,
        };
        let mut rm = RunMachine::new(settings);
        loop {
            if let Some(ran) = self.drive_run(&mut rm)? {
                return Ok(ran);
            }
            let due = rm
                .poll_timeout()
                .expect("the start waits only for a previous rank 0");
            let deadline = self.clock.now() + due.saturating_sub(self.clock.since_start());
            let waited = self.wait_for(deadline, |n| {
                rm.handle(n.clock.since_start(), RunInput::Poll);
                n.drive_run(&mut rm)
            });
            match waited {
                Ok(ran) => return Ok(ran),
                Err(Interrupt::Stop(s)) => return Err(s),
                Err(Interrupt::Deadline) => rm.handle(self.clock.since_start(), RunInput::Timeout),
            }
        }
    }

    /// Perform what rank 0's start asks, in order, until it ends or waits for a poll.
    fn drive_run(&mut self, rm: &mut RunMachine) -> Result<Option<Ran>, Stop> {
        while let Some(effect) = rm.poll_effect() {
            let input = match effect {
                RunEffect::ReadCluster => Some(RunInput::Cluster(
                    self.strictly(state::read_cluster(&*self.store, &self.layout)),
                )),
                RunEffect::ReadRank0 { gen } => {
                    let path = self.layout.rank_record(gen, 0);
                    let read = self.store.read_strict::<RankRecord>(&path);
                    Some(RunInput::Rank0(self.strictly(read.map_err(Into::into))))
                }
                RunEffect::ReadPredecessor { last } => {
                    let record = self.read_record(last.gen, 0).unwrap_or(*last);
                    let local = match holder::local(&record.holder()) {
                        holder::Local::Alive => Some(Holder::Alive),
                        holder::Local::Gone => Some(Holder::Gone),
                        holder::Local::Elsewhere => None,
                    };
                    Some(RunInput::Predecessor {
                        record: Box::new(record),
                        local,
                    })
                }
                RunEffect::CheckRun(prev) => Some(
                    match state::check_run(&*self.store, &self.layout, &prev, &self.cfg.walk_item())
                    {
                        Ok(c) => RunInput::Checked {
                            journals: c.journals,
                            torn: c.torn,
                        },
                        Err(e) => RunInput::CheckFailed {
                            message: e.to_string(),
                            hint: e.hint(self.layout.root()),
                        },
                    },
                ),
                RunEffect::ReadRunEvidence => Some(RunInput::RunEvidence(
                    state::run_evidence(&*self.store, &self.layout).is_some(),
                )),
                RunEffect::NameUnreadableRun => {
                    Some(RunInput::UnreadableRun(self.unreadable_run_id()))
                }
                RunEffect::SetAside { run_id } => Some(RunInput::SetAside(
                    self.set_run_aside(&run_id).map_err(|e| e.to_string()),
                )),
                RunEffect::NewRunId => Some(RunInput::RunId(random_id(&*self.clock, 6))),
                RunEffect::ReadJournals => Some(RunInput::Journals(self.journals())),
                RunEffect::Info(line) => {
                    self.info(&line);
                    None
                }
                RunEffect::Warn(line) => {
                    self.warn(&line);
                    None
                }
                RunEffect::Chosen {
                    run_id,
                    gen,
                    previous,
                    resume,
                } => {
                    return Ok(Some(Ran::Chosen {
                        run_id,
                        gen,
                        previous,
                        resume,
                    }))
                }
                RunEffect::Complete { message, hint } => {
                    return Ok(Some(Ran::Complete(Notice {
                        message,
                        hint: Some(hint),
                    })))
                }
                RunEffect::Refused { message, hint } => {
                    return Err(Stop::usage(message, Some(hint)))
                }
                RunEffect::Failed(message) => return Err(Stop::failed(message)),
            };
            if let Some(input) = input {
                rm.handle(self.clock.since_start(), input);
            }
        }
        Ok(None)
    }

    /// A strict read of the run's state, as the [`RunMachine`] takes it.
    fn strictly<T>(&self, read: Result<Option<T>, StateError>) -> StateRead<T> {
        match read {
            Ok(Some(v)) => StateRead::Found(Box::new(v)),
            Ok(None) => StateRead::Missing,
            Err(e) => StateRead::Damaged {
                message: e.to_string(),
                hint: e.hint(self.layout.root()),
            },
        }
    }

    /// Perform what rank 0's forming asks, in order: the ordered writes that start a
    /// generation (a new `gen-N/`, a placeholder for every worker, rank 0's own record,
    /// heartbeating from here on, the generation's copy of the cluster record, then
    /// `cluster.json` itself and the doorbell), and at each poll of the wait the reads
    /// and what they concluded. True once every rank is released.
    fn drive_form(&mut self, form: &mut FormMachine) -> Result<bool, Stop> {
        use join_machine::{ClusterFor, FormEffect, FormInput};
        let layout = self.layout.clone();
        let claim_err = |e| {
            io_err(
                format!(
                    "cannot create a generation directory in {}",
                    layout.state_dir().display()
                ),
                e,
            )
        };
        let write_err =
            |path: &std::path::Path, e| io_err(format!("cannot write {}", path.display()), e);
        while let Some(effect) = form.poll_effect() {
            let input = match effect {
                FormEffect::ListStateDir => {
                    let state = layout.state_dir();
                    self.store.create_dir_all(&state).map_err(claim_err)?;
                    Some(FormInput::Listing(
                        self.store.read_dir(&state).map_err(claim_err)?,
                    ))
                }
                FormEffect::CreateGenDir(gen) => {
                    match self.store.create_dir(&layout.gen_dir(gen)) {
                        Ok(()) => Some(FormInput::GenDir { created: true }),
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                            Some(FormInput::GenDir { created: false })
                        }
                        Err(e) => return Err(claim_err(e)),
                    }
                }
                FormEffect::Placeholder { run_id, gen, rank } => {
                    let path = layout.rank_record(gen, rank);
                    self.store
                        .publish_live_json(
                            &path,
                            &self.record(gen, &run_id, rank, NodeState::Vacant),
                        )
                        .map_err(|e| write_err(&path, e))?;
                    None
                }
                FormEffect::OwnRecord { cluster, arrived } => {
                    self.start_own_record(*cluster, arrived)?;
                    None
                }
                FormEffect::ClusterCopy(cluster) => {
                    let copy = layout.gen_cluster(cluster.gen);
                    self.store
                        .publish_json(&copy, &*cluster)
                        .map_err(|e| write_err(&copy, e))?;
                    None
                }
                FormEffect::PublishCluster(cluster) => {
                    self.store
                        .publish_json(&layout.cluster(), &*cluster)
                        .map_err(|e| write_err(&layout.cluster(), e))?;
                    crate::exercised::note(crate::exercised::Path::Generations);
                    None
                }
                FormEffect::Doorbell { gen, run_id } => {
                    self.ring_doorbell(gen, &run_id);
                    None
                }
                FormEffect::Published(cluster) => {
                    self.announce_generation(&cluster);
                    self.append_history(&cluster);
                    None
                }
                FormEffect::ReadCluster => {
                    Some(FormInput::Cluster(self.read_cluster_for(ClusterFor::Fence)))
                }
                FormEffect::ReadPeers => {
                    // A worker refused at join leaves the reason in its vacant placeholder,
                    // which the poll just read.
                    Some(FormInput::Peers {
                        peers: self.machine.watch.peers.clone(),
                        refused: self.machine.refused.clone(),
                    })
                }
                FormEffect::Warn(w) => {
                    self.warn(&w);
                    None
                }
                FormEffect::Refusal(why) => {
                    self.warn(&why);
                    // The line's `rank` is this rank 0's, like every line's; `why` names
                    // the refused rank.
                    self.event(events::Event::Refused { why });
                    None
                }
                FormEffect::WaitingFor(missing) => {
                    let gen = form.published().map_or(0, |c| c.gen);
                    self.waiting.note = format!(
                        "waiting for {} to join generation {gen}",
                        super::ranks_list(&missing)
                    );
                    self.publisher().update(|r| r.waiting_for = missing);
                    None
                }
                FormEffect::Fenced(why) => {
                    let gen = self.machine.cluster().map_or(0, |c| c.gen);
                    self.publisher().update(|r| {
                        r.state = NodeState::Left;
                        r.waiting_for.clear();
                    });
                    return Err(Stop::usage(
                        format!("another rank 0 owns this run: {why}; this rank 0 leaves its generation {gen}"),
                        Some("start exactly one rank 0 (--master) per --log-path; `rl-node status` shows the one that runs".into()),
                    ));
                }
                FormEffect::Release(mark) => {
                    self.release_generation(mark);
                    return Ok(true);
                }
            };
            if let Some(input) = input {
                form.handle(input);
            }
        }
        Ok(false)
    }

    /// Rank 0's own record of `cluster`'s generation, arrived at the join, published by
    /// the heartbeat thread from here on (faster while joining).
    fn start_own_record(&mut self, cluster: ClusterRecord, arrived: Mark) -> Result<(), Stop> {
        let (gen, run_id) = (cluster.gen, cluster.run_id.clone());
        self.machine.joined(cluster);
        let mut me = self.record(gen, &run_id, 0, NodeState::Joining);
        me.arrived = Some(arrived);
        let path = self.layout.rank_record(gen, 0);
        let publisher = self
            .publish_from_now(path.clone(), me, self.join_beat())
            .map_err(|e| io_err(format!("cannot write {}", path.display()), e))?;
        self.set_publisher(publisher);
        Ok(())
    }

    /// Ring the doorbell for workers waiting on a fresh directory (best effort: without
    /// it they find cluster.json once their lookup caches expire).
    fn ring_doorbell(&self, gen: u64, run_id: &str) {
        let layout = &self.layout;
        let bell = format!("{}\n", serde_json::json!({ "gen": gen, "run_id": run_id }));
        if let Err(e) = self
            .store
            .append(&layout.doorbell(), bell.as_bytes(), false)
        {
            self.warn(&format!(
                "cannot write {}: {e} (workers may take up to a lookup-cache period longer to join)",
                layout.doorbell().display()
            ));
        }
    }

    pub(super) fn cluster_record(
        &self,
        gen: u64,
        run_id: &str,
        previous: Option<String>,
        resume: Resume,
    ) -> ClusterRecord {
        let master_addr = if self.cfg.cluster.master_addr.is_empty() {
            self.host.clone()
        } else {
            self.cfg.cluster.master_addr.clone()
        };
        ClusterRecord {
            proto: PROTO,
            run_id: run_id.to_string(),
            gen,
            num_nodes: self.num_nodes(),
            rank_weights: self.cfg.weights(),
            fingerprint: self.fingerprint.clone(),
            config: self.cfg.shared_view(),
            master_addr,
            master_port: self.cfg.cluster.master_port,
            host: self.host.clone(),
            pid: self.pid,
            machine: self.ident.machine.clone(),
            pid_start: self.ident.start,
            started_at: self.wall_stamp(),
            previous,
            run_fingerprint: self.cfg.run_fingerprint(),
            resume,
            filesystem: crate::observe::doctor::filesystem(self.layout.root()),
            members: None,
        }
    }

    fn announce_generation(&self, cluster: &ClusterRecord) {
        if let Some(p) = &cluster.previous {
            self.info(&format!("previous: {p}"));
        }
        self.info(&format!(
            "started generation {} of run {}; waiting for {} worker(s) to join",
            cluster.gen,
            cluster.run_id,
            self.num_nodes() - 1
        ));
        self.event(events::Event::Generation {
            previous: cluster.previous.clone(),
        });
    }

    pub(super) fn append_history(&self, cluster: &ClusterRecord) {
        let layout = &self.layout;
        let gen = cluster.gen;
        let history = state::HistoryEntry {
            gen,
            run_id: cluster.run_id.clone(),
            started_at: cluster.started_at.clone(),
            host: self.host.clone(),
            pid: self.pid,
            resume_iteration: cluster.resume.iteration,
            previous: cluster.previous.clone(),
            walk: self.cfg.walk_item(),
            discarded_from: None,
        };
        // The coordinator is history.jsonl's only writer: it sets an unfinished last line aside so
        // this entry starts on a line of its own.
        match state::repair_tail(&*self.store, &layout.history(), gen) {
            Ok(Some(aside)) => self.info(&format!(
                "set the unfinished last line of {} aside in {}",
                layout.history().display(),
                aside.display()
            )),
            Ok(None) => {}
            Err(e) => self.warn(&e.to_string()),
        }
        // Synced, as a journal entry is: the history is evidence a restart checks the
        // journals against and `recover --repair` rebuilds a lost journal from. Unsynced,
        // a crash of rank 0's machine lost it (found by tests/sim/driver.rs).
        let line = format!("{}\n", serde_json::to_string(&history).expect("json"));
        if let Err(e) = self.store.append(&layout.history(), line.as_bytes(), true) {
            self.warn(&format!(
                "cannot append to {}: {e}",
                layout.history().display()
            ));
        }
    }

    /// Barrier 0: wait until every worker has joined the generation published, warning
    /// of the ones refused, and leave if another rank 0 took the run over; then release.
    fn wait_for_ranks(&mut self, form: &mut FormMachine) -> Result<(), Stop> {
        let deadline = self.clock.now() + self.cfg.timing.join_timeout;
        let joined = self.wait_for(deadline, |n| {
            form.handle(join_machine::FormInput::Poll);
            Ok(n.drive_form(form)?.then_some(()))
        });
        match joined {
            Ok(()) => Ok(()),
            Err(Interrupt::Stop(s)) => Err(s),
            Err(Interrupt::Deadline) => {
                let reason = format!(
                    "{} did not join within join-timeout ({})",
                    super::ranks_list(form.missing()),
                    humantime::format_duration(self.cfg.timing.join_timeout)
                );
                Err(self.fail(crate::protocol::AbortKind::Timeout, 0, None, reason, None))
            }
        }
    }

    /// Every rank joined: remember each worker's nonce (a later record with another is
    /// another process), and release them with rank 0's running record.
    fn release_generation(&mut self, release: Mark) {
        for r in 1..self.num_nodes() {
            if let Some(p) = &self.machine.watch.peers[r as usize] {
                self.machine.watch.nonces.insert(r, p.nonce.clone());
            }
        }
        let beat = self.cfg.timing.heartbeat_interval;
        self.publisher().update(|r| {
            r.released = Some(release);
            r.waiting_for.clear();
            r.state = NodeState::Running;
        });
        self.publisher().set_interval(beat);
        self.waiting.note.clear();
        self.info("all ranks joined");
    }

    /// The name a run whose cluster record cannot be read is set aside under: the run id
    /// its history names last, or `unknown-<time>`.
    fn unreadable_run_id(&self) -> String {
        self.store
            .read_limited(&self.layout.history(), crate::store::ReadLimit::Journal)
            .ok()
            .flatten()
            .and_then(|t| String::from_utf8(t).ok())
            .and_then(|t| {
                t.lines()
                    .rev()
                    .find_map(|l| serde_json::from_str::<state::HistoryEntry>(l).ok())
            })
            .map(|h| h.run_id)
            .unwrap_or_else(|| {
                let now = chrono::DateTime::<chrono::Local>::from(self.clock.wall());
                format!("unknown-{}", now.format("%Y%m%dT%H%M%S"))
            })
    }

    /// Move every directory of the run into `previous-runs/<run_id>/`.
    fn set_run_aside(&self, run_id: &str) -> std::io::Result<std::path::PathBuf> {
        let base = self.layout.previous_runs();
        self.store.create_dir_all(&base)?;
        let mut dest = base.join(run_id);
        let mut n = 1;
        while self.store.exists(&dest) {
            n += 1;
            dest = base.join(format!("{run_id}-{n}"));
        }
        self.store.create_dir(&dest)?;
        let fuse = self.store.caches_lookups(self.layout.root());
        for dir in self.layout.run_dirs() {
            if self.store.exists(&dir) {
                self.store
                    .rename(&dir, &dest.join(dir.file_name().expect("named")))?;
                // On FUSE, another node's client trusts its cached entry for this name
                // (the directory just moved aside) for an entry timeout: made again now, a
                // new directory under the old name is what that node's listing of the
                // root (when it joins) finds, replacing the stale entry. Otherwise it could
                // write this run's files into the old run's directories.
                if fuse {
                    self.store.create_dir(&dir)?;
                }
            }
        }
        self.store.fsync_dir(self.layout.root())?;
        Ok(dest)
    }

    /// Every rank's journal, as read now (missing or unreadable: empty). After elastic
    /// mode dropped ranks, the journals of the last generation's members: a rank dropped
    /// journaled nothing since, and the run resumes where its members got to.
    fn journals(&self) -> Vec<Vec<crate::protocol::journal::Entry>> {
        let last = self
            .store
            .read_json::<ClusterRecord>(&self.layout.cluster())
            .ok()
            .flatten();
        let ranks: Vec<u32> = match last.as_ref().and_then(|c| c.members.as_ref()) {
            Some(m) => m.ranks().to_vec(),
            None => (0..self.num_nodes()).collect(),
        };
        self.journals_of(&ranks)
    }

    /// Read every rank's journal and find where this generation begins.
    fn resume_point(&self, run_id: &str) -> crate::protocol::journal::Resume {
        crate::protocol::journal::resume_point(&self.journals(), run_id, &self.cfg.walk_item())
            .not_before(self.cfg.cluster.first_iteration)
    }

    /// While joining, heartbeat faster so workers on other hosts can tell a live rank 0
    /// from a stale record quickly.
    fn join_beat(&self) -> Duration {
        self.cfg
            .timing
            .heartbeat_interval
            .min(Duration::from_secs(1))
    }

    /// A worker's join, driven through the shared directory: the decisions and the order
    /// of the reads are the [`JoinMachine`]'s, the reads, writes and log lines are here.
    fn join_worker(&mut self) -> Result<Joined, Stop> {
        let deadline = self.clock.now() + self.cfg.timing.join_timeout;
        // Compared with rank 0's (a worker that sees a local disk where rank 0 sees the
        // shared filesystem is refused), and named while waiting.
        let filesystem = crate::observe::doctor::filesystem(self.layout.root());
        let settings = join_machine::Settings {
            rank: self.rank,
            nonce: self.nonce.clone(),
            host: self.host.clone(),
            pid: self.pid,
            fingerprint: self.fingerprint.clone(),
            shared_view: self.cfg.shared_view(),
            run_fingerprint: self.cfg.run_fingerprint(),
            iterations: self.cfg.cluster.iterations,
            slot_patience: self.slot_patience(),
            dead_after: self.cfg.timing.dead_after,
            fresh: self.fresh,
            cluster_path: self.layout.cluster(),
            filesystem: filesystem.clone(),
        };
        let mut jm = JoinMachine::new(settings).with_mutation(self.broken.join);
        let on = filesystem.map(|f| format!("; this node sees it on {}", f.describe()));
        self.info(&format!(
            "waiting for rank 0 to start a generation ({}{})",
            self.layout.cluster().display(),
            on.unwrap_or_default()
        ));
        self.waiting.note = "rank 0 to publish a generation to join".into();
        match self.wait_for(deadline, |n| n.drive_join(&mut jm)) {
            Ok(joined) => Ok(joined),
            Err(Interrupt::Stop(s)) => Err(s),
            Err(Interrupt::Deadline) => Err(match jm.joined() {
                None => Stop::new(
                    Cause::Deadline,
                    format!(
                        "no generation to join within join-timeout ({}): {}",
                        humantime::format_duration(self.cfg.timing.join_timeout),
                        self.waiting.note
                    ),
                )
                .with_hint("start rank 0 (--master) with the same configuration and --log-path"),
                Some(c) => self.not_formed(c.gen),
            }),
        }
    }

    /// Join-timeout passed after this worker joined generation `gen`.
    fn not_formed(&self, gen: u64) -> Stop {
        // Rank 0's record says whom it still waited for: the cause, named.
        let missing = self.machine.watch.peers[0]
            .as_ref()
            .map(|r| r.waiting_for.clone())
            .unwrap_or_default();
        let why = if missing.is_empty() {
            String::new()
        } else {
            format!(
                ": rank 0 was still waiting for {} to join",
                super::ranks_list(&missing)
            )
        };
        Stop::new(
            Cause::Deadline,
            format!(
                "generation {gen} did not form within join-timeout ({}){why}",
                humantime::format_duration(self.cfg.timing.join_timeout)
            ),
        )
        .with_hint(
            "look at why those ranks did not join (their logs; `rl-node status` shows each rank)",
        )
    }

    /// One round of the join machine at this poll: perform what it asks, in order.
    fn drive_join(&mut self, jm: &mut JoinMachine) -> Result<Option<Joined>, Stop> {
        use join_machine::{Effect, Input};
        jm.handle(self.clock.since_start(), Input::Poll);
        while let Some(effect) = jm.poll_effect() {
            let input = match effect {
                Effect::ReadCluster(why) => Some(Input::Cluster(self.read_cluster_for(why))),
                Effect::ReadRecord {
                    gen,
                    rank,
                    list_first,
                } => {
                    if list_first {
                        // Rank 0 writes it through another client: on FUSE, seen past
                        // this one's caches.
                        let _ = self.store.refresh(&self.layout.gen_dir(gen));
                    }
                    let record = self.read_record(gen, rank);
                    let local = record
                        .as_ref()
                        .and_then(|r| match holder::local(&r.holder()) {
                            holder::Local::Alive => Some(Holder::Alive),
                            holder::Local::Gone => Some(Holder::Gone),
                            holder::Local::Elsewhere => None,
                        });
                    Some(Input::Record {
                        rank,
                        record: record.map(Box::new),
                        local,
                    })
                }
                Effect::ReadResume { run_id } => {
                    Some(Input::Resume(self.resume_point(&run_id).iteration))
                }
                Effect::Waiting(note) => {
                    self.waiting.note = self.log_path_missing().unwrap_or(note);
                    None
                }
                Effect::Info(line) => {
                    self.info(&line);
                    None
                }
                Effect::Warn(line) => {
                    self.warn(&line);
                    None
                }
                Effect::LeaveRefusal {
                    run_id,
                    gen,
                    refused,
                } => {
                    self.leave_refusal(&run_id, gen, refused);
                    None
                }
                Effect::Join { cluster, rank0 } => {
                    self.joined_generation(*cluster, &rank0)?;
                    None
                }
                Effect::Leave { .. } => {
                    if let Some(p) = self.publisher.take() {
                        p.finish(|r| r.state = NodeState::Left, Duration::from_secs(5));
                    }
                    self.machine.left_generation();
                    None
                }
                Effect::Passed => {
                    self.publisher().update(|r| r.state = NodeState::Running);
                    self.waiting.note.clear();
                    return Ok(Some(Joined::Formed));
                }
                Effect::Complete { message, hint } => {
                    return Ok(Some(Joined::AlreadyComplete(Notice {
                        message,
                        hint: Some(hint),
                    })))
                }
                Effect::Refused { message, hint } => return Err(Stop::usage(message, Some(hint))),
            };
            if let Some(input) = input {
                jm.handle(self.clock.since_start(), input);
            }
        }
        Ok(None)
    }

    /// `cluster.json`, read for a look or for the fence.
    fn read_cluster_for(&self, why: join_machine::ClusterFor) -> join_machine::ClusterRead {
        use join_machine::{ClusterFor, ClusterRead};
        let layout = &self.layout;
        if why == ClusterFor::Fence {
            // `cluster.json` is replaced by rename: a FUSE client's entry cache could
            // answer with the file it replaced.
            let _ = self.store.refresh(&layout.state_dir());
        }
        let mut read = state::read_cluster(&*self.store, layout);
        if why == ClusterFor::Look && matches!(read, Ok(None)) && self.doorbell_rang() {
            read = state::read_cluster(&*self.store, layout);
        }
        match read {
            Ok(Some(c)) => ClusterRead::Cluster(Box::new(c)),
            Ok(None) | Err(StateError::MissingCluster { .. }) => ClusterRead::Missing,
            Err(e) => ClusterRead::Unreadable(e.to_string()),
        }
    }

    /// Joined generation `cluster.gen`, whose rank 0 is `r0`: watch it, and publish this
    /// rank's record, arrived at the join.
    fn joined_generation(&mut self, cluster: ClusterRecord, r0: &RankRecord) -> Result<(), Stop> {
        let gen = cluster.gen;
        self.machine.joined(cluster.clone());
        self.machine.watch.liveness = crate::protocol::Liveness::new(self.cfg.timing.dead_after);
        self.machine.watch.peers = vec![None; self.num_nodes() as usize];
        self.machine.watch.nonces.clear();
        self.machine.watch.nonces.insert(0, r0.nonce.clone());
        let mut me = self.record(gen, &cluster.run_id, self.rank, NodeState::Joining);
        me.arrived = Some(self.join_barrier().arrival());
        let path = self.layout.rank_record(gen, self.rank);
        let publisher = self
            .publish_from_now(path.clone(), me, self.cfg.timing.heartbeat_interval)
            .map_err(|e| {
                Stop::failed(format!("cannot write {}: {e}", path.display()))
                    .with_hint("check that --log-path is on a writable shared filesystem")
            })?;
        self.set_publisher(publisher);
        // `--fresh` on rank 0 may just have renamed the run's directories aside: a FUSE
        // client trusts its cached entries for them (pointing at the old ones, now under
        // previous-runs/) for the entry timeout. A listing of the root refreshes them
        // before this node writes anything there.
        let _ = self.store.refresh(self.layout.root());
        self.info(&format!(
            "joined generation {gen} of run {} (rank 0 on {}, master address {})",
            cluster.run_id, cluster.host, cluster.master_addr
        ));
        self.waiting.note = format!("rank 0 to release the join of generation {gen}");
        Ok(())
    }

    /// A worker's `--log-path` that does not exist on its node: rank 0 creates it, so
    /// this is "not yet" at first, but a typo or a shared filesystem not mounted on this
    /// node looks the same for ever. Said in the wait's note (and so at join-timeout), with
    /// the filesystem the nearest existing directory is on.
    fn log_path_missing(&self) -> Option<String> {
        let root = self.layout.root();
        if self.store.is_dir(root) {
            return None;
        }
        let on = root
            .ancestors()
            .skip(1)
            .find(|d| d.is_dir())
            .and_then(|d| {
                crate::observe::doctor::filesystem_of(d).map(|fs| {
                    format!(
                        "; the nearest directory that exists here, {}, is on {fs}",
                        d.display()
                    )
                })
            })
            .unwrap_or_default();
        Some(format!(
            "--log-path {} does not exist on this node ({}){on}: rank 0 creates it, so if rank 0 runs, check the path and that the shared filesystem is mounted here",
            root.display(),
            self.host
        ))
    }

    /// With `cluster.json` missing as this node sees it: has rank 0 rung the doorbell
    /// (`Layout::doorbell`)? Then `cluster.json` exists on the server, and this node's
    /// lookup cache is made to see it. Best effort: an error is a "no".
    fn doorbell_rang(&self) -> bool {
        // Rank 0 rings it in the directory it made; a worker never makes the log path.
        // (A listing of the parent first: a cached "missing" of the root is a lookup
        // cache's, as for the doorbell.)
        let root = self.layout.root();
        if !self.store.is_dir(root) {
            if let Some(parent) = root.parent() {
                let _ = self.store.refresh(parent);
            }
            if !self.store.is_dir(root) {
                return false;
            }
        }
        // (A FUSE client keeps "missing" past rank 0's create, and answers EEXIST to an
        // O_CREAT of it: `read_or_create` lists the state directory first.)
        let rung = self
            .store
            .read_or_create(&self.layout.doorbell())
            .is_ok_and(|b| !b.is_empty());
        rung && self
            .store
            .revalidate(&self.layout.cluster())
            .unwrap_or(false)
    }
}

impl Node {
    /// Say why this process was refused its rank where rank 0 already reads: in the rank's
    /// placeholder record, only while it is still vacant (a rank held by a live process is
    /// not this process's to touch, and rank 0 is not waiting for it then).
    fn leave_refusal(&self, run_id: &str, gen: u64, refused: String) {
        let path = self.layout.rank_record(gen, self.rank);
        let Ok(Some(mut slot)) = self.store.read_json::<RankRecord>(&path) else {
            return;
        };
        if slot.state != NodeState::Vacant || !slot.belongs_to(run_id, gen, self.rank) {
            return;
        }
        slot.refused = Some(refused);
        slot.wall = self.wall_stamp();
        let _ = self.store.publish_live_json(&path, &slot);
    }
}
