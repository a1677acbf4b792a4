//! Pipelined mode on a node (docs/pipeline.md): the rollout cluster and the update
//! cluster hand iterations over through their queue records (`protocol::pipeline`), and
//! each cluster's rank 0 watches the other cluster: its aborts (both clusters stop with
//! the same diagnosis) and, while it waits on it, its rank 0's heartbeat.

use super::{Interrupt, Node, Stop};
use crate::events;
use crate::protocol::handover::{self, Found, Handover, Input, QueueError};
use crate::protocol::journal;
use crate::protocol::pipeline::{self, QueueRecord, RolloutGate, RolloutModel};
use crate::protocol::records::{AbortInfo, AbortKind, ClusterRecord};
use std::time::Duration;

impl Node {
    /// At start, in a pipelined run: rank 0 rewrites its cluster's queue record from the
    /// journal and notes the other cluster's state.
    pub(super) fn pipeline_begin(&mut self) -> Result<(), Stop> {
        let (Some(_), Some(other)) = (self.cfg.staleness(), self.layout.other_cluster()) else {
            return Ok(());
        };
        let name = other.cluster_name().expect("a cluster");
        // Once, so that each read of the other cluster's queue record is one open.
        let dir = self.layout.queue(name);
        if let Some(Err(e)) = dir.parent().map(|d| self.store.create_dir_all(d)) {
            let reason = format!("cannot create {}: {e}", dir.display());
            return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
        }
        let handover = Handover::new(handover::Settings {
            other: name,
            fingerprint: self.cfg.pipeline_fingerprint(),
            heartbeat_interval: self.cfg.timing.heartbeat_interval,
            dead_after: self.cfg.timing.dead_after,
            join_timeout: self.cfg.timing.join_timeout,
        })
        .with_mutation(self.broken.liveness);
        self.machine.begin_handover(handover);
        if !self.is_master() {
            // A worker only reads the other cluster's queue record, to wait with rank 0.
            return Ok(());
        }
        // Whether the other cluster's generation there had already ended.
        let found = self.drive_handover(|h| {
            h.begin();
            true
        });
        debug_assert_eq!(found, Some(Found::Nothing));
        // A cluster started with another configuration than the running one is refused
        // before it publishes anything the running one would act on (or refuse in turn).
        self.read_other_queue()?;
        let done = self.queue_done();
        self.publish_queue(done, 0)
    }

    /// How far this cluster's journal shows the hand-over done: train trajectories
    /// committed (rollout), iterations complete (update).
    fn queue_done(&self) -> u64 {
        let item = match self.layout.cluster_name() {
            Some("rollout") => journal::item::AGGREGATE_TRAIN.to_string(),
            _ => self.cfg.walk_item(),
        };
        let first = self.cfg.cluster.first_iteration.max(1);
        pipeline::done_through(
            first,
            self.machine
                .journal()
                .entries()
                .iter()
                .filter(|e| e.item == item && e.failed.is_none())
                .map(|e| e.iteration),
        )
    }

    /// Rank 0: rewrite this cluster's queue record (a commit: the other cluster acts on it).
    /// The record carries this node's run, generation and sequence number, so that a late
    /// rename of an older one (a rank 0 of a replaced generation, frozen between its fence
    /// check and its rename) is recognised as older by every reader.
    pub(super) fn publish_queue(&mut self, done: u64, current: u64) -> Result<(), Stop> {
        let Some(cluster) = self.layout.cluster_name() else {
            return Ok(());
        };
        let path = self.layout.queue(cluster);
        let (run, gen) = (self.run_id().to_string(), self.gen());
        let found = self.store.read_json::<QueueRecord>(&path).ok().flatten();
        let draft = QueueRecord {
            cluster: cluster.to_string(),
            fingerprint: self.cfg.pipeline_fingerprint(),
            staleness: self.cfg.staleness().unwrap_or(0),
            done,
            versions: vec![],
            current,
            last: self.cfg.cluster.iterations,
            at: self.wall_stamp(),
            run,
            gen,
            seq: 0,
        };
        let version = self
            .machine
            .serving()
            .rollout()
            .map(|m| (m.iteration, m.model_version));
        let handover = self.machine.handover().expect("a pipelined run");
        let next = match handover.next_queue(found, draft, version) {
            Ok(next) => next,
            Err(newer) => {
                // A newer generation of this cluster moved the record on: never move it
                // back.
                let why = format!(
                    "generation {newer} of this cluster already wrote {} (this node is of generation {gen})",
                    path.display()
                );
                return Err(self.fenced(&why, &format!("write {}", path.display())));
            }
        };
        if let Some((found, written)) = &next.went_back {
            self.warn(&format!(
                "{} went back to a record of generation {} (done {}) after this node wrote done {}: a late write of a replaced generation; rewriting it",
                path.display(),
                found.gen,
                found.done,
                written.done
            ));
        }
        let record = next.record;
        // A commit the other cluster acts on: never from a replaced generation.
        self.fence(&format!("write {}", path.display()))?;
        self.watchdog.pet("writing the pipeline queue record");
        let written = path
            .parent()
            .map_or(Ok(()), |d| self.store.create_dir_all(d))
            .and_then(|_| self.store.publish_json(&path, &record));
        if let Err(e) = written {
            let reason = format!("cannot write {}: {e}", path.display());
            return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
        }
        if let Some(h) = self.machine.handover_mut() {
            h.published(record);
        }
        Ok(())
    }

    /// Start a look at the other cluster (`start`: false when none is due), perform its
    /// reads and hand them to the machine: what it found, if it looked.
    fn drive_handover(&mut self, start: impl FnOnce(&mut Handover) -> bool) -> Option<Found> {
        // The other cluster's paths (a pure copy of this node's layout).
        let other = self.layout.other_cluster()?;
        let handover = self.machine.handover_mut()?;
        if !start(handover) {
            return None;
        }
        while let Some(effect) = handover.poll_effect() {
            // Stamped with its send and its return: a freeze of this node inside the
            // read (a paused VM, a hung mount) is not the other rank 0's silence.
            let (input, at) = super::stamped(&*self.clock, || match effect {
                handover::Effect::ReadCluster => Input::Cluster(
                    self.store
                        .read_json::<ClusterRecord>(&other.cluster())
                        .ok()
                        .flatten()
                        .map(|c| c.gen),
                ),
                handover::Effect::ReadAbort { gen } => {
                    Input::Abort(self.store.read_json(&other.abort(gen)).ok().flatten())
                }
                handover::Effect::ReadRank0 { gen } => Input::Rank0(
                    self.store
                        .read_json(&other.rank_record(gen, 0))
                        .ok()
                        .flatten(),
                ),
            });
            handover.handle(at, input);
        }
        handover.take_found()
    }

    /// The other cluster's queue record: opened with `O_CREAT` (an empty file until its
    /// rank 0 first writes it), so no negative-lookup cache delays seeing it appear.
    fn read_other_queue(&mut self) -> Result<Option<QueueRecord>, Stop> {
        let Some(handover) = self.machine.handover_mut() else {
            return Ok(None);
        };
        let name = handover.other();
        let path = self.layout.queue(name);
        let read = self
            .store
            .read_or_create(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
            .map(|bytes| handover.read_queue(&bytes));
        let reason = match read {
            Ok(Ok(q)) => return Ok(q),
            Err(reason) => reason,
            Ok(Err(QueueError::Damaged(e))) => format!("{} is damaged: {e}", path.display()),
            Ok(Err(QueueError::OtherConfiguration(theirs))) => {
                let reason = format!(
                    "the {name} cluster runs another configuration (fingerprint {theirs} in {}, here {}): both clusters of a pipelined run must be started with the same configuration; only cluster.rl-phase, num-nodes, rank-weights, iterations and [timing] may differ",
                    path.display(),
                    self.cfg.pipeline_fingerprint(),
                );
                let mut stop = self.fail(AbortKind::Error, self.rank, None, reason, None);
                stop.cause = crate::exit::Cause::Usage;
                return Err(stop);
            }
        };
        Err(self.fail(AbortKind::Error, self.rank, None, reason, None))
    }

    /// Rank 0, every poll round: look at the other cluster (at most once per heartbeat
    /// interval unless `waiting`), and stop on its abort; while `waiting`, also on its
    /// rank 0's silence for `dead-after`, or its absence for `join-timeout`.
    pub(super) fn watch_other(&mut self, waiting: bool) -> Result<(), Stop> {
        if !self.is_master() {
            return Ok(());
        }
        let now = self.clock.since_start();
        let Some(found) = self.drive_handover(|h| h.look(now, waiting)) else {
            return Ok(());
        };
        let name = self.machine.handover().expect("looked").other();
        match found {
            Found::Nothing => Ok(()),
            Found::Stopped(info) => Err(self.adopt_other_abort(*info, name)),
            Found::Dead { record, silent } => {
                let mut info = self.abort_info(
                    AbortKind::PeerDead,
                    0,
                    Some(record.host.clone()),
                    format!("heartbeat still for {:.1}s", silent.as_secs_f64()),
                    None,
                );
                info.phase = record
                    .phase
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "join".into());
                info.iteration = record.iteration;
                info.silent_ms = Some(silent.as_millis() as u64);
                info.detected_in = info.cluster.take();
                info.cluster = Some(name.to_string());
                Err(self.publish_abort(info))
            }
            Found::Absent {
                timed_out: true, ..
            } => {
                let limit = self.cfg.timing.join_timeout;
                let reason = format!(
                    "the {name} cluster has not been running for {} (timing.join-timeout) while this cluster waits for it: start its nodes with --rl-phase {name} and the same --log-path and configuration",
                    humantime::format_duration(limit)
                );
                Err(self.fail(AbortKind::Timeout, self.rank, None, reason, None))
            }
            Found::Absent { .. } => {
                self.waiting.note = format!(
                    "the {name} cluster, which is not running (no live generation under {})",
                    self.layout
                        .other_cluster()
                        .map(|l| l.state_dir().display().to_string())
                        .unwrap_or_default()
                );
                Ok(())
            }
        }
    }

    /// The other cluster stopped: this one stops with the same diagnosis, published in
    /// its own generation so its workers stop with it.
    fn adopt_other_abort(&mut self, mut info: AbortInfo, name: &str) -> Stop {
        if info.cluster.is_none() {
            info.cluster = Some(name.to_string());
        }
        self.info(&format!(
            "the {name} cluster stopped; stopping this one with it"
        ));
        self.publish_abort(info)
    }

    /// Rank 0: wait until the other cluster's queue record satisfies `ready`, watching it.
    fn wait_other(
        &mut self,
        what: String,
        ready: impl Fn(&QueueRecord) -> bool,
    ) -> Result<QueueRecord, Stop> {
        let started = self.clock.now();
        if let Some(q) = self.read_other_queue()?.filter(|q| ready(q)) {
            return Ok(q);
        }
        self.info(&format!("waiting for {what}"));
        // For `status`: what this cluster waits on.
        let note = format!("waiting for {what}");
        self.publisher().update(|r| r.progress = Some(note));
        if let Some(h) = self.machine.handover_mut() {
            h.wait_boundary();
        }
        self.waiting.note = what.clone();
        let far = self.clock.now() + Duration::from_secs(100 * 365 * 24 * 3600);
        // Noticed within pipeline.poll-interval: the other cluster's hand-over is what
        // this cluster's next iteration starts on.
        self.waiting.cap = Some(self.cfg.pipeline.poll_interval);
        let got = self.wait_for(far, |n| {
            n.watch_other(true)?;
            // Read after the watch: a cluster seen finished wrote its last record before.
            if let Some(q) = n.read_other_queue()?.filter(|q| ready(q)) {
                return Ok(Some(q));
            }
            if let Some((gen, it)) = n.machine.handover().and_then(Handover::finished) {
                let name = n.machine.handover().map_or("other", Handover::other);
                let reason = format!(
                    "the {name} cluster finished its iterations (generation {gen}, iteration {it}) while this cluster still waits for it: were both started with the same cluster.iterations?"
                );
                return Err(n.fail(AbortKind::Error, n.rank, None, reason, None));
            }
            n.waiting.note = what.clone();
            Ok(None)
        });
        self.waiting.cap = None;
        if let Some(h) = self.machine.handover_mut() {
            h.wait_boundary();
        }
        self.waiting.note.clear();
        self.publisher().update(|r| r.progress = None);
        match got {
            Ok(q) => {
                let secs = self.clock.elapsed(started).as_secs_f64();
                self.info(&format!("waited {secs:.2}s for {what}"));
                self.event(events::Event::PipelineWait { what, secs });
                Ok(q)
            }
            Err(Interrupt::Stop(s)) => Err(s),
            Err(Interrupt::Deadline) => unreachable!("no deadline"),
        }
    }

    /// Rollout cluster, rank 0, before `sync-start`: which model this iteration is rolled
    /// out with, waiting for the update cluster as the staleness rule says. Recorded in
    /// `rollouts/iter-NNNN/model.json` before any rollout starts, and reused as recorded
    /// when the iteration is resumed.
    pub(super) fn choose_rollout_model(&mut self) -> Result<Option<RolloutModel>, Stop> {
        let Some(staleness) = self.cfg.staleness() else {
            return Ok(None);
        };
        if self.layout.cluster_name() != Some("rollout") {
            return Ok(None);
        }
        let it = self.machine.iteration();
        let path = self.layout.rollout_model(it);
        let first = self.cfg.cluster.first_iteration.max(1);
        if !self.is_master() {
            // A worker waits for what rank 0 waits for (rank 0 decides the model and
            // watches the other cluster): all then arrive at sync-start together, instead
            // of noticing rank 0's release a whole backed-off poll late.
            let needs = pipeline::exact_version(it, staleness, first);
            if needs > 0 && !self.store.exists(&path) {
                let what = format!(
                    "the update cluster to finish training iteration {needs} (with rank 0)"
                );
                self.wait_other(what, |q| q.done >= needs)?;
            }
            return Ok(None);
        }
        if let Some(m) = self.store.read_json::<RolloutModel>(&path).ok().flatten() {
            self.info(&format!(
                "iteration {it}: rolled out on {} (model version {}), as recorded before the restart",
                m.model, m.model_version
            ));
            return Ok(Some(m));
        }
        let newest = self.cfg.pipeline.model == crate::config::PipelineModel::Newest;
        let trained = self.read_other_queue()?.map_or(0, |q| q.done);
        let broken = self.broken.pipeline;
        let version = match pipeline::rollout_gate_with(
            it, staleness, first, trained, newest, broken,
        ) {
            RolloutGate::Go { version } => version,
            RolloutGate::Wait { needs } => {
                let what = format!(
                    "the update cluster to finish training iteration {needs} (iteration {it} is rolled out on its model, pipeline.staleness = {staleness})"
                );
                let q = self.wait_other(what, |q| q.done >= needs)?;
                match pipeline::rollout_gate_with(it, staleness, first, q.done, newest, broken) {
                    RolloutGate::Go { version } => version,
                    RolloutGate::Wait { .. } => unreachable!("waited for it"),
                }
            }
        };
        let model = self.model_of_version(version, first)?;
        let m = RolloutModel {
            iteration: it,
            model_version: version,
            staleness: pipeline::staleness_of(it, version, first),
            model: self.model_record(&model),
            rule: if newest { "newest" } else { "exact" }.into(),
        };
        self.fence(&format!("record the model of iteration {it}"))?;
        self.watchdog.pet("recording the rollout model");
        let written = path
            .parent()
            .map_or(Ok(()), |d| self.store.create_dir_all(d))
            .and_then(|_| self.store.publish_json(&path, &m));
        if let Err(e) = written {
            let reason = format!("cannot write {}: {e}", path.display());
            return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
        }
        Ok(Some(m))
    }

    /// The model as it was once iteration `version` was trained: the newest checkpoint
    /// published up to it that verifies, else the base model (`cluster.model`).
    fn model_of_version(&mut self, version: u64, first: u64) -> Result<String, Stop> {
        self.watchdog.pet("verifying the rollout model");
        let wd = self.watchdog.clone();
        let up_to = version.max(first - 1);
        let found = crate::checkpoint::newest_at_most(
            &*self.store,
            &self.layout.models(),
            up_to,
            self.cfg.phases.handoff.check(),
            &mut || wd.pet("verifying the rollout model"),
        );
        match found {
            Some(p) => Ok(p.display().to_string()),
            None if version > 0 && self.cfg.cluster.model.is_empty() => {
                let reason = format!(
                    "no checkpoint up to iteration {version} under {} verifies, and there is no base model (cluster.model is empty)",
                    self.layout.models().display()
                );
                Err(self.fail(AbortKind::Error, self.rank, None, reason, None))
            }
            None => Ok(self.cfg.cluster.model.clone()),
        }
    }

    /// Rollout cluster, every rank, after `sync-start`: serve the model rank 0 chose,
    /// restarting the inference server when it changed (between iterations only).
    pub(super) fn use_rollout_model(&mut self, released: Option<RolloutModel>) -> Result<(), Stop> {
        let Some(m) = released else {
            return Ok(());
        };
        let changed = self.adopt_model(&m.model)?;
        if changed || self.server.is_none() {
            if changed && self.server.is_some() {
                self.info(&format!(
                    "iteration {}: restarting the server on {} (model version {}, staleness {})",
                    m.iteration,
                    self.machine.serving().model(),
                    m.model_version,
                    m.staleness
                ));
                self.stop_server()?;
            }
            self.start_server()?;
        }
        self.event(events::Event::RolloutModel {
            model: self.machine.serving().model().to_string(),
            model_version: m.model_version,
            staleness: m.staleness,
        });
        self.machine.serving_mut().roll_out(m);
        Ok(())
    }

    /// Update cluster, every rank, at the start of an iteration: wait until the rollout
    /// cluster has committed its trajectories.
    pub(super) fn wait_for_trajectories(&mut self) -> Result<(), Stop> {
        if self.cfg.staleness().is_none() || self.layout.cluster_name() != Some("update") {
            return Ok(());
        }
        let it = self.machine.iteration();
        // Workers wait too, so that every rank reaches training-ready together.
        if self.is_master() {
            self.publish_queue(self.queue_done(), it)?;
        }
        if let Some(q) = self.read_other_queue()? {
            if pipeline::update_ready(it, q.done) {
                return Ok(());
            }
        }
        let what = format!("the rollout cluster to commit the trajectories of iteration {it}");
        self.wait_other(what, |q| pipeline::update_ready(it, q.done))?;
        Ok(())
    }

    /// Rank 0, when this cluster's part of the hand-over for the current iteration is
    /// committed (and journaled): tell the other cluster.
    pub(super) fn queue_advanced(&mut self) -> Result<(), Stop> {
        if self.cfg.staleness().is_none() || !self.is_master() {
            return Ok(());
        }
        let done = self.queue_done();
        let current = match self.layout.cluster_name() {
            Some("rollout") => self.machine.iteration(),
            _ => 0,
        };
        self.publish_queue(done, current)
    }
}
