//! `[observe] prometheus-textfile`: each node rewrites a Prometheus text-format file with
//! its own gauges and counters, for node_exporter's textfile collector (docs/metrics.md,
//! "Prometheus").
//!
//! The file is node-local (node_exporter reads it on the same machine), so it is written
//! with plain file calls, not through the shared directory's store, and never waits on
//! the shared filesystem. A rewrite is a temporary file in the same directory renamed over
//! the old one, so the collector never reads half a file; the temporary file's name does
//! not end in `.prom`, which the collector ignores.
//!
//! The node feeds it the events it logs ([`Textfile::observe`]) and the heartbeat ages it
//! observes ([`Textfile::peer_ages`]); its wait loop calls [`Textfile::tick`], which
//! rewrites the file when something changed (at most every [`MIN_GAP`]) and at least
//! every `heartbeat-interval` (the ages grow on their own). The exposition format is the
//! `prometheus` crate's text encoder (format 0.0.4, what the collector parses).
//!
//! Every sample carries `rank` (and `cluster` in a pipelined run, `job` under a batch
//! system), and, once the node has joined, `run_id`: two runs on one host never write the
//! same series. The file's name may hold `{run_id}` and `{job}` too; a name with
//! `{run_id}` is written only once the run is known ([`Textfile::for_run`]).

use crate::events::Event;
use crate::protocol::Phase;
use prometheus::{
    Counter, CounterVec, Encoder, Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The shortest time between two rewrites for a change (a burst of events is one write).
pub(crate) const MIN_GAP: Duration = Duration::from_millis(200);

/// Every phase, for the one-hot `rl_node_phase` gauge.
use crate::protocol::phase::ALL as PHASES;

/// One node's metrics and the file they go to.
pub(crate) struct Textfile {
    /// None until the run is known, for a name that holds `{run_id}`: nothing is written.
    path: Option<PathBuf>,
    /// Where the file of a run goes (the configured name with the run's id).
    path_of_run: PathOf,
    rank: u32,
    host: String,
    labels: Labels,
    registry: Registry,
    running: IntGauge,
    iteration: IntGauge,
    generation: IntGauge,
    live_nodes: IntGauge,
    phase: IntGaugeVec,
    phase_number: IntGauge,
    peer_age: GaugeVec,
    commands: IntCounterVec,
    commands_failed: IntCounterVec,
    barriers: IntCounter,
    barrier_wait: Counter,
    retries: IntCounter,
    items_failed: IntCounter,
    server_starts: IntCounter,
    hang_reports: IntCounter,
    phase_seconds: CounterVec,
    last_iteration: Gauge,
    written_at: Gauge,
    /// The phase the node is in and since when, for `phase_seconds_total`.
    in_phase: Option<(Phase, Instant)>,
    /// Replaced by the run's file ([`Textfile::for_run`]): its drop writes nothing.
    retired: bool,
    /// The peers' heartbeat ages (rank, ms) as last observed; into `peer_age` at a write.
    ages: Vec<(u32, u64)>,
    changed: bool,
    last_write: Option<Instant>,
    /// The last write's error, reported once per kind of failure by the caller.
    pub(crate) last_error: Option<String>,
}

/// Why the file cannot be used, for the node's exit-2 message.
#[derive(Debug)]
pub(crate) struct Unusable(pub String);

impl Textfile {
    /// Metrics of rank `rank` (of `cluster`, in a pipelined run; of batch job `job`; of
    /// run `run_id` once known) on `host`, in a cluster of `live_nodes` nodes, written to
    /// `path`. Writes the file once now, so a path that cannot be written is found before
    /// the node joins anything.
    pub(crate) fn open(
        path: Option<PathBuf>,
        path_of_run: PathOf,
        rank: u32,
        labels_of: &Labels,
        host: &str,
        live_nodes: u32,
    ) -> Result<Textfile, Unusable> {
        let registry = labels_of.registry(rank);
        let (phase_seconds, last_iteration) = time_metrics(&registry);
        let info = reg(
            &registry,
            IntGaugeVec::new(
                Opts::new(
                    "info",
                    "This node: always 1, with its host and rl-node's version.",
                ),
                &["host", "version"],
            )
            .expect("valid"),
        );
        info.with_label_values(&[host, env!("CARGO_PKG_VERSION")])
            .set(1);
        let g = |name: &str, help: &str| reg(&registry, IntGauge::new(name, help).expect("valid"));
        let c =
            |name: &str, help: &str| reg(&registry, IntCounter::new(name, help).expect("valid"));
        let by = |name: &str, help: &str, label: &str| {
            reg(
                &registry,
                IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid"),
            )
        };
        let mut t = Textfile {
            path,
            path_of_run,
            rank,
            host: host.to_string(),
            labels: labels_of.clone(),
            running: g("running", "1 while the node runs; 0 once it has ended."),
            iteration: g("iteration", "The iteration the node is in (0 before the first)."),
            generation: g("generation", "The generation (start of the cluster) the node is in."),
            live_nodes: g(
                "live_nodes",
                "The nodes of the node's generation: num-nodes, or in elastic mode (cluster.min-nodes) the members left after a node was dropped.",
            ),
            phase: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new("phase", "1 for the phase the node is in, 0 for the others."),
                    &["phase"],
                )
                .expect("valid"),
            ),
            phase_number: g(
                "phase_number",
                "The number of the phase the node is in (0 sync-start .. 13 final-sync; -1 none).",
            ),
            peer_age: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "peer_heartbeat_age_seconds",
                        "Age of each peer's heartbeat as this node observes it (rank 0 sees every rank, a worker rank 0).",
                    ),
                    &["peer"],
                )
                .expect("valid"),
            ),
            commands: by(
                "commands_total",
                "Phase commands that ended, by command (rollout, eval, aggregate, prepare, train, handoff).",
                "command",
            ),
            commands_failed: by(
                "commands_failed_total",
                "Phase commands that ended with a non-zero exit or a signal, by command.",
                "command",
            ),
            barriers: c("barriers_total", "Barriers passed."),
            barrier_wait: reg(
                &registry,
                Counter::new(
                    "barrier_wait_seconds_total",
                    "Seconds spent waiting at barriers.",
                )
                .expect("valid"),
            ),
            retries: c("item_retries_total", "Retries of planned items (per-task rollouts)."),
            items_failed: c(
                "items_failed_total",
                "Planned items that failed for good (per-task rollouts).",
            ),
            server_starts: c("server_starts_total", "Inference server starts."),
            hang_reports: c(
                "hang_reports_total",
                "Hang reports this node wrote (docs/forensics.md).",
            ),
            phase_seconds,
            last_iteration,
            written_at: reg(
                &registry,
                Gauge::new(
                    "textfile_written_timestamp_seconds",
                    "When this file was written (Unix time): a stale value means the node stopped writing.",
                )
                .expect("valid"),
            ),
            in_phase: None,
            retired: false,
            registry,
            ages: Vec::new(),
            changed: true,
            last_write: None,
            last_error: None,
        };
        t.running.set(1);
        t.live_nodes.set(i64::from(live_nodes));
        // Every command's counters from 0, so a first failure is an increase to alert on.
        for command in &crate::config::COMMANDS[1..] {
            t.commands.with_label_values(&[command]);
            t.commands_failed.with_label_values(&[command]);
        }
        let started = reg(
            &t.registry,
            Gauge::new(
                "start_time_seconds",
                "When this node process started (Unix time).",
            )
            .expect("valid"),
        );
        started.set(labels_of.started);
        t.set_phase(None);
        match t.path {
            Some(_) => t.write(Instant::now()),
            None => t.probe_dir(),
        }
        .map_err(|e| Unusable(format!("cannot write {e}")))?;
        Ok(t)
    }

    /// For a name known only once the run is (`{run_id}`): that its directory takes a
    /// file, checked once at open with a file made and removed.
    fn probe_dir(&self) -> Result<(), String> {
        let named = (self.path_of_run)("probe");
        let dir = named.parent().unwrap_or(Path::new("."));
        let probe = dir.join(format!(".rl-node-probe-{}", std::process::id()));
        let made = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe);
        let _ = std::fs::remove_file(&probe);
        made.map(drop)
            .map_err(|e| format!("{}: {e}", dir.display()))
    }

    /// The file of run `run_id` (the configured name may hold `{run_id}`), with the run's
    /// label on every sample, taking over from this one, which is retired without a last
    /// write. Counters start again from what this one counted before the join (nothing
    /// but the start).
    pub(crate) fn for_run(mut self, run_id: &str) -> Result<Textfile, Unusable> {
        self.retired = true;
        let labels = Labels {
            run_id: Some(run_id.to_string()),
            ..self.labels.clone()
        };
        let path = (self.path_of_run)(run_id);
        let path_of_run = std::mem::replace(&mut self.path_of_run, Box::new(|_| PathBuf::new()));
        let live = self.live_nodes.get().max(0) as u32;
        Textfile::open(
            Some(path),
            path_of_run,
            self.rank,
            &labels,
            &self.host,
            live,
        )
    }

    /// Take in one event the node logged in `iteration` of generation `gen`.
    pub(crate) fn observe(&mut self, event: &Event, iteration: u64, gen: u64) {
        self.iteration.set(iteration as i64);
        self.generation.set(gen as i64);
        match event {
            Event::Phase { phase, .. } => self.set_phase(Some(*phase)),
            Event::Journal { item } if item.starts_with("iteration-complete") => {
                self.last_iteration.set(unix_now());
            }
            Event::Barrier { waited_ms, .. } => {
                self.barriers.inc();
                self.barrier_wait.inc_by(*waited_ms as f64 / 1000.0);
            }
            Event::Command { phase, exit, .. } => {
                self.commands.with_label_values(&[phase]).inc();
                if exit != crate::process::EXIT_SUCCESS {
                    self.commands_failed.with_label_values(&[phase]).inc();
                }
            }
            Event::Retry { .. } => self.retries.inc(),
            Event::ItemFailed { .. } => self.items_failed.inc(),
            Event::ServerStart { .. } => self.server_starts.inc(),
            Event::HangReport { .. } => self.hang_reports.inc(),
            // Elastic mode: a member lost is no longer live; the generation the members
            // left form says how many they are.
            Event::MemberLost { .. } => self.live_nodes.set((self.live_nodes.get() - 1).max(0)),
            Event::Regrouped { members, .. } => self.live_nodes.set(members.len() as i64),
            _ => return,
        }
        self.changed = true;
    }

    /// The heartbeat ages this node observes now: (rank, milliseconds). Kept until the
    /// next write (this is called at every poll round; a write is rarer).
    pub(crate) fn peer_ages(&mut self, ages: &[(u32, u64)]) {
        self.ages.clear();
        self.ages.extend_from_slice(ages);
    }

    /// The one-hot phase gauges and the phase number: `phase`, or none; the time spent
    /// in the phase it leaves is counted.
    fn set_phase(&mut self, phase: Option<Phase>) {
        self.count_phase_time(Instant::now());
        self.in_phase = phase.map(|p| (p, Instant::now()));
        for p in PHASES {
            self.phase
                .with_label_values(&[p.name()])
                .set(i64::from(Some(p) == phase));
        }
        self.phase_number
            .set(phase.map_or(-1, |p| i64::from(p.number())));
    }

    /// Rewrite the file if something changed (at most every [`MIN_GAP`]) or `refresh`
    /// has passed since the last write. `Err` only for a failed write, with its message.
    pub(crate) fn tick(&mut self, now: Instant, refresh: Duration) -> Result<(), String> {
        let since = self.last_write.map(|t| now.saturating_duration_since(t));
        let due = match since {
            None => true,
            Some(s) => (self.changed && s >= MIN_GAP) || s >= refresh,
        };
        if !due {
            return Ok(());
        }
        self.write(now).map_err(|e| e.to_string())
    }

    /// Add the time spent in the current phase up to `now` to its counter.
    fn count_phase_time(&mut self, now: Instant) {
        if let Some((p, since)) = &mut self.in_phase {
            let secs = now.saturating_duration_since(*since).as_secs_f64();
            self.phase_seconds
                .with_label_values(&[p.name()])
                .inc_by(secs);
            *since = now;
        }
    }

    /// The node has ended: say so in the file (best effort). Also done on drop.
    pub(crate) fn finish(&mut self) {
        self.running.set(0);
        self.set_phase(None);
        let _ = self.write(Instant::now());
    }

    /// The file's text now.
    pub(crate) fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("writing to a Vec");
        String::from_utf8(buf).expect("the text encoder writes UTF-8")
    }

    /// Write the file (its path in the error); nothing while its name waits for the run.
    fn write(&mut self, now: Instant) -> Result<(), String> {
        let Some(path) = self.path.clone() else {
            return Ok(());
        };
        self.written_at.set(unix_now());
        self.count_phase_time(now);
        // Only the peers observed last: one no longer reported leaves the file.
        self.peer_age.reset();
        for (rank, ms) in &self.ages {
            self.peer_age
                .with_label_values(&[&rank.to_string()])
                .set(*ms as f64 / 1000.0);
        }
        let text = self.render();
        self.last_write = Some(now);
        self.changed = false;
        // A node-local file, rewritten often: replaced atomically through a temporary file
        // (`.NAME.tmp-…`, which the collector ignores) made with `O_EXCL`; not synced.
        let store: &dyn crate::store::SharedDir = &crate::store::Fs;
        store
            .publish_with(&path, false, &mut |w| w.write_all(text.as_bytes()))
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}

impl Drop for Textfile {
    fn drop(&mut self) {
        if !self.retired {
            self.finish();
        }
    }
}

/// Register `m` in `r` as it is made, so that no metric can be left out of the file.
fn reg<M: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: M) -> M {
    r.register(Box::new(m.clone()))
        .expect("metric names are distinct");
    m
}

/// Seconds per phase, and when the last iteration ended.
fn time_metrics(r: &Registry) -> (CounterVec, Gauge) {
    let per_phase = CounterVec::new(
        Opts::new(
            "phase_seconds_total",
            "Seconds spent in each phase (the 14 phases of rl_node_phase).",
        ),
        &["phase"],
    )
    .expect("valid");
    let last = Gauge::new(
        "last_iteration_timestamp_seconds",
        "When this node last completed an iteration (Unix time; 0: none yet).",
    )
    .expect("valid");
    (reg(r, per_phase), reg(r, last))
}

impl Labels {
    /// A registry whose every sample carries `rank` and these labels.
    fn registry(&self, rank: u32) -> Registry {
        let mut labels = std::collections::HashMap::from([("rank".to_string(), rank.to_string())]);
        for (k, v) in [
            ("cluster", &self.cluster),
            ("job", &self.job),
            ("run_id", &self.run_id),
        ] {
            if let Some(v) = v {
                labels.insert(k.into(), v.clone());
            }
        }
        Registry::new_custom(Some("rl_node".into()), Some(labels)).expect("valid labels")
    }
}

/// The file's path for a run id.
pub(crate) type PathOf = Box<dyn Fn(&str) -> PathBuf + Send>;

/// The labels every sample carries besides `rank`, and the process's start time.
#[derive(Clone, Debug, Default)]
pub(crate) struct Labels {
    pub cluster: Option<String>,
    /// The batch job's id (`SLURM_JOB_ID`).
    pub job: Option<String>,
    pub run_id: Option<String>,
    /// Unix time.
    pub started: f64,
}

pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The samples of a text-format file: (name, labels) → value. Comment lines are
    /// skipped; every other line must be a sample.
    fn samples(text: &str) -> BTreeMap<(String, BTreeMap<String, String>), f64> {
        let mut out = BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').expect("a sample line");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => {
                    let body = rest.strip_suffix('}').expect("closed labels");
                    let labels = body
                        .split(',')
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').expect("k=v");
                            (k.to_string(), v.trim_matches('"').to_string())
                        })
                        .collect();
                    (n.to_string(), labels)
                }
                None => (series.to_string(), BTreeMap::new()),
            };
            out.insert((name, labels), value.parse().expect("a number"));
        }
        out
    }

    fn get(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        samples(text).get(&(name.to_string(), labels)).copied()
    }

    #[test]
    fn events_become_gauges_and_counters() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rl-node.prom");
        let labels = Labels {
            cluster: Some("update".into()),
            job: Some("77".into()),
            run_id: None,
            started: 1.0e9,
        };
        let mut t = Textfile::open(
            Some(path.clone()),
            Box::new(|_| unreachable!()),
            2,
            &labels,
            "host-a",
            4,
        )
        .unwrap();
        let me = [("rank", "2"), ("cluster", "update"), ("job", "77")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = me.to_vec();
            v.extend_from_slice(extra);
            v
        };
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(get(&text, "rl_node_running", &me), Some(1.0), "{text}");
        assert_eq!(
            get(
                &text,
                "rl_node_info",
                &with(&[("host", "host-a"), ("version", env!("CARGO_PKG_VERSION"))])
            ),
            Some(1.0),
            "{text}"
        );
        t.observe(
            &Event::Phase {
                phase: Phase::Training,
                n: 10,
            },
            3,
            1,
        );
        for exit in ["exit code 0", "exit code 1"] {
            t.observe(
                &Event::Command {
                    phase: "train".into(),
                    exit: exit.into(),
                    secs: 1.0,
                },
                3,
                1,
            );
        }
        t.observe(
            &Event::Barrier {
                name: "training-ready".into(),
                k: 9,
                waited_ms: 1500,
            },
            3,
            1,
        );
        assert_eq!(get(&text, "rl_node_live_nodes", &me), Some(4.0), "{text}");
        t.peer_ages(&[(0, 1200), (1, 300)]);
        // A change right after a write waits for MIN_GAP; then it is written.
        let now = Instant::now();
        t.tick(now, Duration::from_secs(5)).unwrap();
        t.tick(now + MIN_GAP, Duration::from_secs(5)).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        type Want<'a> = (&'a str, Vec<(&'a str, &'a str)>, f64);
        let want: &[Want] = &[
            ("rl_node_iteration", with(&[]), 3.0),
            ("rl_node_generation", with(&[]), 1.0),
            ("rl_node_phase", with(&[("phase", "training")]), 1.0),
            ("rl_node_phase", with(&[("phase", "rollout-complete")]), 0.0),
            ("rl_node_phase_number", with(&[]), 10.0),
            ("rl_node_commands_total", with(&[("command", "train")]), 2.0),
            (
                "rl_node_commands_failed_total",
                with(&[("command", "train")]),
                1.0,
            ),
            ("rl_node_start_time_seconds", with(&[]), 1.0e9),
            ("rl_node_last_iteration_timestamp_seconds", with(&[]), 0.0),
            ("rl_node_barriers_total", with(&[]), 1.0),
            ("rl_node_barrier_wait_seconds_total", with(&[]), 1.5),
            (
                "rl_node_peer_heartbeat_age_seconds",
                with(&[("peer", "0")]),
                1.2,
            ),
            (
                "rl_node_peer_heartbeat_age_seconds",
                with(&[("peer", "1")]),
                0.3,
            ),
        ];
        for (name, labels, value) in want {
            assert_eq!(
                get(&text, name, labels),
                Some(*value),
                "{name} {labels:?} in:\n{text}"
            );
        }
        assert_eq!(
            samples(&text)
                .keys()
                .filter(|(n, _)| n == "rl_node_phase")
                .count(),
            14
        );
        // A peer no longer reported leaves the file; dropping it says the node ended.
        t.peer_ages(&[(0, 100)]);
        drop(t);
        let end = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            get(
                &end,
                "rl_node_peer_heartbeat_age_seconds",
                &with(&[("peer", "1")])
            ),
            None,
            "{end}"
        );
        assert_eq!(get(&end, "rl_node_running", &me), Some(0.0), "{end}");
        assert_eq!(
            get(&end, "rl_node_phase", &with(&[("phase", "training")])),
            Some(0.0),
            "{end}"
        );
        // Only the file itself is left in the directory (the temporary one was renamed).
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn an_unwritable_path_is_refused_at_open() {
        let none = Labels::default();
        let e = Textfile::open(
            Some("/nonexistent-dir/x.prom".into()),
            Box::new(|_| unreachable!()),
            0,
            &none,
            "h",
            1,
        )
        .err()
        .expect("refused");
        assert!(e.0.contains("/nonexistent-dir/x.prom"), "{}", e.0);
        // A name with {run_id}: its directory is checked at open, nothing is written.
        let e = Textfile::open(
            None,
            Box::new(|run| format!("/nonexistent-dir/x-{run}.prom").into()),
            0,
            &none,
            "h",
            1,
        )
        .err()
        .expect("refused");
        assert!(e.0.contains("/nonexistent-dir"), "{}", e.0);
    }

    /// Joined: the file goes to the run's name with the run's id on every sample; time in
    /// each phase and the last iteration's end are counted.
    #[test]
    fn the_run_names_the_file_and_labels_every_sample() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let t = Textfile::open(
            None,
            Box::new(move |run| d.join(format!("rl-node-0-{run}.prom"))),
            0,
            &Labels::default(),
            "h",
            1,
        )
        .unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let mut t = t.for_run("abc123").unwrap();
        let path = dir.path().join("rl-node-0-abc123.prom");
        let me = [("rank", "0"), ("run_id", "abc123")];
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(get(&text, "rl_node_running", &me), Some(1.0), "{text}");
        t.observe(
            &Event::Phase {
                phase: Phase::Training,
                n: 10,
            },
            1,
            1,
        );
        std::thread::sleep(Duration::from_millis(20));
        t.observe(
            &Event::Journal {
                item: "iteration-complete:both".into(),
            },
            1,
            1,
        );
        t.observe(
            &Event::Phase {
                phase: Phase::FinalSync,
                n: 13,
            },
            1,
            1,
        );
        drop(t);
        let text = std::fs::read_to_string(&path).unwrap();
        let training = get(
            &text,
            "rl_node_phase_seconds_total",
            &[("rank", "0"), ("run_id", "abc123"), ("phase", "training")],
        );
        assert!(training.is_some_and(|s| s >= 0.02), "{text}");
        let ended = get(&text, "rl_node_last_iteration_timestamp_seconds", &me).unwrap();
        assert!((ended - unix_now()).abs() < 60.0, "{text}");
        assert_eq!(get(&text, "rl_node_running", &me), Some(0.0), "{text}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Elastic mode: a member lost is one live node less at once; the generation formed
    /// without it says how many are left.
    #[test]
    fn live_nodes_fall_when_a_member_is_lost_and_follow_the_regrouped_generation() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let t = Textfile::open(
            None,
            Box::new(move |run| d.join(format!("rl-node-1-{run}.prom"))),
            1,
            &Labels::default(),
            "h",
            4,
        )
        .unwrap();
        let mut t = t.for_run("r1").unwrap();
        let path = dir.path().join("rl-node-1-r1.prom");
        let me = [("rank", "1"), ("run_id", "r1")];
        let live = |t: &mut Textfile| {
            t.write(Instant::now()).unwrap();
            get(
                &std::fs::read_to_string(&path).unwrap(),
                "rl_node_live_nodes",
                &me,
            )
        };
        assert_eq!(live(&mut t), Some(4.0));
        t.observe(
            &Event::MemberLost {
                lost: 0,
                reason: "heartbeat still for 3.0s".into(),
            },
            2,
            1,
        );
        assert_eq!(live(&mut t), Some(3.0));
        // Rank 3 did not come to the regroup either: the generation has two members.
        t.observe(
            &Event::Regrouped {
                members: vec![1, 2],
                coordinator: 1,
            },
            0,
            2,
        );
        assert_eq!(live(&mut t), Some(2.0));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(get(&text, "rl_node_generation", &me), Some(2.0), "{text}");
    }
}
