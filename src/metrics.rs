//! `metrics.jsonl`: one JSON line per completed iteration, appended by rank 0 (of each
//! cluster, in a pipelined run) to the shared directory, for dashboards and people
//! (docs/metrics.md has the scheme).
//!
//! Rank 0 builds the line from what it already sees during the iteration: the events it
//! logs ([`Collector::observe`] is fed by `Node::event`), so no log is read back. The only
//! extra work is reading the merged train split once for the configured numeric fields
//! ([`field_stats`]), which runs on a thread started after the merge and joined at the
//! iteration's end, while the other ranks train: the line costs the barriers one append.
//!
//! A restarted rank 0 reads the file once at start ([`Written::read`]) and skips
//! iterations that already have a line, so a resumed run never writes one twice.

use crate::events::{Aggregated, Event, ItemsMode};
use crate::store::SharedDir;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

/// What rank 0 gathers during one iteration.
#[derive(Debug, Default)]
pub(crate) struct Collector {
    /// Phases in walk order with their wall time so far.
    phases: Vec<(String, Duration)>,
    /// The phase being timed and since when.
    current: Option<(String, Instant)>,
    barrier_wait: Duration,
    /// Train split's merge: (records, bytes), or items for a dynamic concatenation.
    records: Option<u64>,
    bytes: Option<u64>,
    failed: u64,
    retries: u64,
    /// Ranks the train merge went without (their rollout command failed).
    failed_ranks: u64,
    items_seen: bool,
    eval_ran: bool,
    /// The model's version and staleness the iteration ran with.
    model: (u64, u64),
    /// Rank 0: every rank's numbers as gathered at `final-sync` (index = rank; `None`
    /// for a rank whose arrival carried none, e.g. a node of an older version).
    ranks: Vec<Option<RankNumbers>>,
    /// Rank 0: what training did, when the iteration trained.
    train: Option<Trained>,
    /// Rank 0: the trainer's own numbers (`[observe] train-metrics`).
    trainer: BTreeMap<String, f64>,
}

/// One rank's numbers for the iteration, carried by its `final-sync` arrival to rank 0:
/// its wall time in each phase it walked before `final-sync`, its wait at the barriers
/// before it, and its own items' failures and retries.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct RankNumbers {
    /// Seconds per phase (names as in `time/<phase>_s`), rounded to milliseconds.
    #[serde(default)]
    pub phases: BTreeMap<String, f64>,
    #[serde(default)]
    pub wait_s: f64,
    /// Whether the rank ran planned items (per-task mode) this iteration.
    #[serde(default)]
    pub items: bool,
    #[serde(default)]
    pub failed: u64,
    #[serde(default)]
    pub retries: u64,
}

/// The numbers the members' `final-sync` arrivals carried (in the members' order: a
/// generation formed after a loss has fewer), by rank: a rank that is not a member has
/// none, so `barrier/wait_by_rank_s` keeps its index = rank.
pub(crate) fn by_rank(
    members: &[u32],
    num_nodes: u32,
    arrivals: Vec<Option<RankNumbers>>,
) -> Vec<Option<RankNumbers>> {
    let mut ranks = vec![None; num_nodes as usize];
    for (&rank, numbers) in members.iter().zip(arrivals) {
        if let Some(slot) = ranks.get_mut(rank as usize) {
            *slot = numbers;
        }
    }
    ranks
}

/// What training did in the iteration, as rank 0 knows it after `training-complete`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Trained {
    /// Records of the train split it trained on (the merge's manifest), if readable.
    pub samples: Option<u64>,
    /// Ranks whose training failed.
    pub failed_ranks: usize,
}

/// A phase's name as the keys of `metrics.jsonl` spell it: `sync-start` → `sync_start`.
fn phase_slug(name: &str) -> String {
    name.replace('-', "_")
}

/// The key of a phase's wall time in a `metrics.jsonl` line: `sync-start` (or
/// `sync_start`) → `time/sync_start_s`.
pub(crate) fn phase_key(name: &str) -> String {
    format!("time/{}_s", phase_slug(name))
}

/// Round to milliseconds, as every `_s` key is.
fn ms(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

/// The median of `v` (sorted in place; the mean of the middle two for an even count).
pub(crate) fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

impl Collector {
    /// Start a new iteration.
    pub(crate) fn reset(&mut self) {
        *self = Collector::default();
    }

    /// Take in one event this rank logged at `now`.
    pub(crate) fn observe(&mut self, event: &Event, now: Instant) {
        match event {
            Event::Phase { phase, .. } => {
                self.close(now);
                self.current = Some((phase_slug(phase.name()), now));
            }
            Event::Barrier { waited_ms, .. } => {
                self.barrier_wait += Duration::from_millis(*waited_ms);
            }
            Event::Aggregate { split, merged } if split == "train" => match merged {
                Aggregated::Shards { records, bytes } => {
                    self.records = Some(*records);
                    self.bytes = Some(*bytes);
                }
                Aggregated::Items { items, .. } => self.records = Some(*items as u64),
            },
            Event::SurvivorsMerged { split, failed, .. } if split == "train" => {
                self.failed_ranks = failed.len() as u64;
            }
            Event::Items {
                split,
                failed,
                mode,
                ..
            } if split == "train" => {
                self.items_seen = true;
                self.failed += *failed as u64;
                if let ItemsMode::Static { retries, .. } = mode {
                    self.retries += u64::from(*retries);
                }
            }
            _ => {}
        }
    }

    /// The model the iteration rolls out or trains with: its version (the iteration that
    /// trained it, 0 for the base model) and how many versions it lags.
    pub(crate) fn model_used(&mut self, version: u64, staleness: u64) {
        self.model = (version, staleness);
    }

    /// Rank 0's eval decision, as `files-ready` released it.
    pub(crate) fn eval_decided(&mut self, eval: bool) {
        self.eval_ran = eval;
    }

    /// This rank's numbers so far, for its `final-sync` arrival: the phases it closed
    /// (not the one it is in), its barrier waits, its items.
    pub(crate) fn numbers(&self) -> RankNumbers {
        RankNumbers {
            phases: self
                .phases
                .iter()
                .map(|(n, d)| (n.clone(), ms(d.as_secs_f64())))
                .collect(),
            wait_s: ms(self.barrier_wait.as_secs_f64()),
            items: self.items_seen,
            failed: self.failed,
            retries: self.retries,
        }
    }

    /// Rank 0: the numbers the ranks' `final-sync` arrivals carried (index = rank; `None`
    /// where an arrival carried none that decode).
    pub(crate) fn gathered(&mut self, ranks: Vec<Option<RankNumbers>>) {
        self.ranks = ranks;
    }

    /// Rank 0: the iteration trained (`failed_ranks` of its ranks failed), on a train
    /// split of `samples` records.
    pub(crate) fn trained(&mut self, samples: Option<u64>, failed_ranks: usize) {
        self.train = Some(Trained {
            samples,
            failed_ranks,
        });
    }

    /// Rank 0: the trainer's own numbers, from its `[observe] train-metrics` file.
    pub(crate) fn trainer(&mut self, numbers: BTreeMap<String, f64>) {
        self.trainer = numbers;
    }

    /// Stop timing the current phase at `now`.
    pub(crate) fn close(&mut self, now: Instant) {
        if let Some((name, since)) = self.current.take() {
            let d = now.saturating_duration_since(since);
            match self.phases.iter_mut().find(|(n, _)| *n == name) {
                Some((_, t)) => *t += d,
                None => self.phases.push((name, d)),
            }
        }
    }

    /// The iteration's line (without its newline). Keys are sorted (serde_json's map),
    /// times in seconds rounded to milliseconds.
    pub(crate) fn line(&self, fixed: &Fixed, stats: &FieldStats) -> String {
        let secs = |d: Duration| Value::from((d.as_secs_f64() * 1000.0).round() / 1000.0);
        let mut m = Map::new();
        m.insert("iteration".into(), fixed.iteration.into());
        m.insert("run".into(), fixed.run.clone().into());
        m.insert("generation".into(), fixed.generation.into());
        m.insert("cluster/live_nodes".into(), fixed.live_nodes.into());
        if let Some(c) = fixed.cluster {
            m.insert("cluster".into(), c.into());
        }
        m.insert("t".into(), fixed.t.clone().into());
        m.insert("time/iteration_s".into(), secs(fixed.elapsed));
        for (name, d) in &self.phases {
            m.insert(phase_key(name), secs(*d));
        }
        m.insert("barrier/wait_s".into(), secs(self.barrier_wait));
        let reported: Vec<&RankNumbers> = self.ranks.iter().flatten().collect();
        // The spread over ranks of each phase any rank walked (before final-sync).
        let names: BTreeSet<&String> = reported.iter().flat_map(|r| r.phases.keys()).collect();
        for name in names {
            let mut v: Vec<f64> = reported
                .iter()
                .filter_map(|r| r.phases.get(name).copied())
                .collect();
            let (min, max) = (
                v.iter().copied().reduce(f64::min),
                v.iter().copied().reduce(f64::max),
            );
            m.insert(format!("time/{name}_min_s"), min.into());
            m.insert(
                format!("time/{name}_median_s"),
                median(&mut v).map(ms).into(),
            );
            m.insert(format!("time/{name}_max_s"), max.into());
        }
        if !self.ranks.is_empty() {
            let waits: Vec<Value> = self
                .ranks
                .iter()
                .map(|r| r.as_ref().map(|r| r.wait_s).into())
                .collect();
            m.insert("barrier/wait_by_rank_s".into(), waits.into());
        }
        m.insert("rollout/records".into(), self.records.into());
        m.insert("rollout/bytes".into(), self.bytes.into());
        m.insert("rollout/raw".into(), self.records.into());
        m.insert("rollout/budget".into(), fixed.budget.into());
        // Counted where the train split was merged (rank 0 of a cluster that rolls out).
        m.insert(
            "rollout/failed_ranks".into(),
            self.records.map(|_| self.failed_ranks).into(),
        );
        // Every rank's items when the ranks reported their numbers, else rank 0's.
        let (items_seen, failed, retries) = if reported.is_empty() {
            (self.items_seen, self.failed, self.retries)
        } else {
            (
                reported.iter().any(|r| r.items),
                reported.iter().map(|r| r.failed).sum(),
                reported.iter().map(|r| r.retries).sum(),
            )
        };
        let items = |n: u64| {
            if items_seen {
                Value::from(n)
            } else {
                Value::Null
            }
        };
        m.insert("rollout/failed".into(), items(failed));
        m.insert("rollout/retries".into(), items(retries));
        m.insert("model/version".into(), self.model.0.into());
        m.insert("model/staleness".into(), self.model.1.into());
        m.insert("eval/ran".into(), self.eval_ran.into());
        let t = self.train.as_ref();
        m.insert("train/ran".into(), t.is_some().into());
        m.insert(
            "train/samples_total".into(),
            t.and_then(|t| t.samples).into(),
        );
        m.insert(
            "train/failed_ranks".into(),
            t.map(|t| t.failed_ranks).into(),
        );
        for (key, v) in &self.trainer {
            m.insert(format!("trainer/{key}"), (*v).into());
        }
        for (field, s) in &stats.fields {
            let f = |v: Option<f64>| v.map(Value::from).unwrap_or(Value::Null);
            m.insert(format!("rollout/{field}_mean"), f(s.mean()));
            m.insert(format!("rollout/{field}_min"), f(s.min));
            m.insert(format!("rollout/{field}_max"), f(s.max));
            m.insert(format!("rollout/{field}_skipped"), s.skipped.into());
        }
        Value::Object(m).to_string()
    }
}

/// What the node knows of the iteration besides its events.
#[derive(Debug, Clone)]
pub(crate) struct Fixed {
    pub iteration: u64,
    /// The run's id: `--fresh` starts a new run beside the old one's lines.
    pub run: String,
    /// The generation that wrote the line: a restart's lines say which start they came
    /// from.
    pub generation: u64,
    /// `rollout` or `update` in a pipelined run.
    pub cluster: Option<&'static str>,
    /// Wall clock at the end, RFC 3339.
    pub t: String,
    pub elapsed: Duration,
    /// The nodes of the generation that wrote the line: every node, or in elastic mode
    /// (`[cluster] min-nodes`) the members left after a loss.
    pub live_nodes: u32,
    /// Planned train items (tasks × samples), when tasks are planned.
    pub budget: Option<u64>,
}

/// Running mean, min and max of one field.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Stat {
    pub count: u64,
    pub sum: f64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    /// Records where the field was missing or not a number.
    pub skipped: u64,
}

impl Stat {
    fn add(&mut self, v: Option<f64>) {
        let Some(v) = v.filter(|v| v.is_finite()) else {
            self.skipped += 1;
            return;
        };
        self.count += 1;
        self.sum += v;
        self.min = Some(self.min.map_or(v, |m| m.min(v)));
        self.max = Some(self.max.map_or(v, |m| m.max(v)));
    }

    pub(crate) fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// The configured fields' statistics over one merged file (in configuration order).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FieldStats {
    pub fields: Vec<(String, Stat)>,
}

impl FieldStats {
    /// Every field with no value: the file was not read (no merge, not JSONL).
    pub(crate) fn empty(fields: &[String]) -> FieldStats {
        FieldStats {
            fields: fields
                .iter()
                .map(|f| (f.clone(), Stat::default()))
                .collect(),
        }
    }
}

/// Mean, min and max of each top-level numeric `fields` of the JSONL records `input`
/// yields, one record at a time (memory: one line). A line that is not a JSON object
/// counts as skipped for every field.
pub(crate) fn field_stats(
    mut input: impl BufRead,
    fields: &[String],
) -> std::io::Result<FieldStats> {
    let mut out = FieldStats::empty(fields);
    if fields.is_empty() {
        return Ok(out);
    }
    let mut line = Vec::new();
    while let Some(whole) = next_line(&mut input, &mut line, MAX_LINE)? {
        // As `BufRead::lines` would: a file that is not UTF-8 gives no statistics.
        let text = std::str::from_utf8(&line)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        if whole && text.bytes().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        // A line past the bound is not read into memory: its fields count as skipped.
        let record: Option<BTreeMap<String, Value>> =
            whole.then(|| serde_json::from_str(text).ok()).flatten();
        for (name, stat) in &mut out.fields {
            stat.add(record.as_ref().and_then(|r| r.get(name)?.as_f64()));
        }
    }
    Ok(out)
}

/// The longest record whose fields the metrics read (a merged file written by a custom
/// merge command is not checked line by line as the built-in merge checks it).
const MAX_LINE: u64 = 64 << 20;

/// The next line of `input` into `line` (without its newline), at most `max` bytes:
/// `Some(true)`, or `Some(false)` for a longer line, whose rest is skipped unread into
/// memory; `None` at the end.
fn next_line(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: u64,
) -> std::io::Result<Option<bool>> {
    use std::io::Read;
    line.clear();
    let n = input.by_ref().take(max + 1).read_until(b'\n', line)?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
        return Ok(Some(true));
    }
    if (line.len() as u64) <= max {
        return Ok(Some(true));
    }
    line.clear();
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            return Ok(Some(false));
        }
        match memchr::memchr(b'\n', buf) {
            Some(i) => {
                input.consume(i + 1);
                return Ok(Some(false));
            }
            None => {
                let len = buf.len();
                input.consume(len);
            }
        }
    }
}

/// [`field_stats`] of a file in the shared directory, read through `store`; an
/// unreadable file gives empty statistics (metrics are best effort, never a reason to
/// stop).
pub(crate) fn file_stats(store: &dyn SharedDir, path: &Path, fields: &[String]) -> FieldStats {
    store
        .open_data(path)
        .and_then(|data| field_stats(crate::store::DataReader::new(data), fields))
        .unwrap_or_else(|_| FieldStats::empty(fields))
}

/// The top-level numbers of a trainer's JSON report (`[observe] train-metrics`, e.g.
/// Hugging Face's `all_results.json`: `{"epoch": 1.0, "train_loss": 0.42, …}`), by key made
/// fit for the metrics scheme (lower case; anything but letters, digits and `_` becomes
/// `_`). Anything but a JSON object gives none; non-numbers and non-finite numbers are
/// left out.
pub(crate) fn trainer_numbers(bytes: &[u8]) -> BTreeMap<String, f64> {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(bytes) else {
        return BTreeMap::new();
    };
    obj.iter()
        .filter_map(|(k, v)| {
            let v = v.as_f64().filter(|v| v.is_finite())?;
            let key: String = k
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c.to_ascii_lowercase()
                    } else {
                        '_'
                    }
                })
                .collect();
            Some((key, v))
        })
        .collect()
}

/// The iterations `metrics.jsonl` already has a line for (of this run and cluster), and whether
/// its last line is unfinished (a crash mid-append), so the next line starts on its own.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Written {
    pub iterations: BTreeSet<u64>,
    pub torn_tail: bool,
}

impl Written {
    pub(crate) fn read(bytes: &[u8], run: &str, cluster: Option<&str>) -> Written {
        let text = String::from_utf8_lossy(bytes);
        let iterations = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["run"].as_str() == Some(run) && v["cluster"].as_str() == cluster)
            .filter_map(|v| v["iteration"].as_u64())
            .collect();
        Written {
            iterations,
            torn_tail: !bytes.is_empty() && !bytes.ends_with(b"\n"),
        }
    }
}

#[cfg(test)]
mod line_tests {
    use super::next_line;

    #[test]
    fn lines_past_the_bound_are_skipped_unread() {
        let text = b"{\"a\": 1}\n0123456789abcdef\n{\"a\": 2}\nlast";
        let mut input = std::io::BufReader::with_capacity(4, &text[..]);
        let mut line = Vec::new();
        let mut seen = vec![];
        while let Some(whole) = next_line(&mut input, &mut line, 10).unwrap() {
            seen.push((whole, String::from_utf8(line.clone()).unwrap()));
        }
        assert_eq!(
            seen,
            [
                (true, "{\"a\": 1}".to_string()),
                (false, String::new()),
                (true, "{\"a\": 2}".to_string()),
                (true, "last".to_string()),
            ]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Phase;

    fn fields(f: &[&str]) -> Vec<String> {
        f.iter().map(|s| s.to_string()).collect()
    }

    /// A merged file read through the store in chunks gives what one read of it gives:
    /// no record lost or counted twice where a line spans two chunks.
    #[test]
    fn stats_of_a_file_read_through_the_store_count_every_record_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("merged.jsonl");
        let text: String = (0..20_000)
            .map(|i| format!("{{\"reward\": {i}, \"pad\": \"{}\"}}\n", "x".repeat(i % 7)))
            .collect();
        assert!(text.len() > 3 * (1 << 16), "{}", text.len());
        std::fs::write(&path, &text).unwrap();
        let f = fields(&["reward"]);
        let s = file_stats(&crate::store::Fs, &path, &f);
        let whole = field_stats(text.as_bytes(), &f).unwrap();
        assert_eq!(s.fields[0].1.count, 20_000);
        assert_eq!(s.fields[0].1.mean(), Some(9_999.5));
        assert_eq!(s.fields[0].1.mean(), whole.fields[0].1.mean());
    }

    #[test]
    fn stats_skip_missing_and_non_numeric_values() {
        let input = "{\"reward\": 1}\n{\"reward\": 0.5, \"len\": 3}\n{\"reward\": \"x\"}\nnot json\n\n{\"len\": 5}\n";
        let s = field_stats(input.as_bytes(), &fields(&["reward", "len", "absent"])).unwrap();
        let (r, l, a) = (&s.fields[0].1, &s.fields[1].1, &s.fields[2].1);
        assert_eq!(
            (r.count, r.skipped, r.min, r.max),
            (2, 3, Some(0.5), Some(1.0))
        );
        assert_eq!(r.mean(), Some(0.75));
        assert_eq!((l.count, l.skipped, l.mean()), (2, 3, Some(4.0)));
        assert_eq!((a.count, a.skipped, a.mean()), (0, 5, None));
    }

    #[test]
    fn written_iterations_are_per_cluster_and_a_torn_tail_is_seen() {
        let text = b"{\"run\":\"a\",\"iteration\":1}\n{\"run\":\"b\",\"iteration\":3}\n{\"run\":\"a\",\"iteration\":1,\"cluster\":\"rollout\"}\n{\"run\":\"a\",\"iteration\":2,\"clu";
        let w = Written::read(text, "a", None);
        assert_eq!(w.iterations, BTreeSet::from([1]));
        assert!(w.torn_tail);
        let r = Written::read(text, "a", Some("rollout"));
        assert_eq!(r.iterations, BTreeSet::from([1]));
        assert_eq!(
            Written::read(text, "b", None).iterations,
            BTreeSet::from([3])
        );
        assert!(!Written::read(b"", "a", None).torn_tail);
    }

    #[test]
    fn a_line_has_every_documented_key() {
        let mut c = Collector::default();
        let t0 = Instant::now();
        let ev = |phase: Phase| Event::Phase {
            phase,
            n: phase.number(),
        };
        c.observe(&ev(Phase::SyncStart), t0);
        c.observe(
            &Event::Barrier {
                name: "sync-start".into(),
                k: 1,
                waited_ms: 250,
            },
            t0,
        );
        c.observe(&ev(Phase::TrainRollout), t0 + Duration::from_secs(1));
        c.observe(
            &Event::Aggregate {
                split: "train".into(),
                merged: Aggregated::Shards {
                    records: 4,
                    bytes: 100,
                },
            },
            t0,
        );
        c.model_used(1, 0);
        c.close(t0 + Duration::from_secs(3));
        let fixed = Fixed {
            iteration: 2,
            run: "r1".into(),
            generation: 2,
            cluster: Some("rollout"),
            t: "now".into(),
            elapsed: Duration::from_millis(3500),
            live_nodes: 3,
            budget: Some(4),
        };
        let v: Value = serde_json::from_str(&c.line(
            &fixed,
            &file_stats(
                &crate::store::Fs,
                Path::new("/nonexistent"),
                &fields(&["reward"]),
            ),
        ))
        .unwrap();
        assert_eq!(v["iteration"], 2);
        assert_eq!(v["cluster"], "rollout");
        assert_eq!(v["cluster/live_nodes"], 3);
        assert_eq!(v["time/iteration_s"], 3.5);
        assert_eq!(v["time/sync_start_s"], 1.0);
        assert_eq!(v["time/train_rollout_s"], 2.0);
        assert_eq!(v["barrier/wait_s"], 0.25);
        assert_eq!(
            (v["rollout/records"].clone(), v["rollout/bytes"].clone()),
            (4.into(), 100.into())
        );
        assert_eq!(v["rollout/raw"], 4);
        assert_eq!(v["rollout/budget"], 4);
        assert_eq!(v["rollout/failed"], Value::Null);
        assert_eq!(v["rollout/failed_ranks"], 0);
        assert_eq!(v["model/version"], 1);
        assert_eq!(v["eval/ran"], false);
        assert_eq!(v["rollout/reward_mean"], Value::Null);
        assert_eq!(v["rollout/reward_skipped"], 0);
    }

    /// `rollout/failed_ranks`: the ranks the train merge went without; `null` where this
    /// cluster merged no train split.
    #[test]
    fn failed_ranks_count_the_train_merge_s_left_out_ranks() {
        let fixed = Fixed {
            iteration: 1,
            run: "r".into(),
            generation: 1,
            cluster: None,
            t: "now".into(),
            elapsed: Duration::ZERO,
            live_nodes: 2,
            budget: None,
        };
        let count = |c: &Collector| {
            let line = c.line(&fixed, &FieldStats::empty(&[]));
            serde_json::from_str::<Value>(&line).unwrap()["rollout/failed_ranks"].clone()
        };
        let mut c = Collector::default();
        assert_eq!(count(&c), Value::Null);
        let now = Instant::now();
        let merged = |split: &str| Event::SurvivorsMerged {
            split: split.into(),
            merged: 1,
            ranks: 2,
            failed: vec![crate::events::RankFailure {
                rank: 1,
                failed: "exit code 7".into(),
            }],
        };
        c.observe(&merged("eval"), now);
        c.observe(
            &Event::Aggregate {
                split: "train".into(),
                merged: Aggregated::Shards {
                    records: 1,
                    bytes: 9,
                },
            },
            now,
        );
        assert_eq!(
            count(&c),
            0,
            "an eval merge's failures are not the train split's"
        );
        c.observe(&merged("train"), now);
        assert_eq!(count(&c), 1);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn trainer_numbers_keep_finite_numbers_under_scheme_keys() {
        let n = trainer_numbers(br#"{"train_loss": 0.25, "Epoch": 1, "eval/acc": 0.5, "note": "x", "ok": true, "nested": {"a": 1}}"#);
        assert_eq!(
            n.into_iter().collect::<Vec<_>>(),
            [
                ("epoch".to_string(), 1.0),
                ("eval_acc".to_string(), 0.5),
                ("train_loss".to_string(), 0.25)
            ]
        );
        assert!(trainer_numbers(b"[1, 2]").is_empty());
        assert!(trainer_numbers(b"not json").is_empty());
    }

    #[test]
    fn the_spread_is_over_the_ranks_that_reported_and_items_are_summed() {
        let mut c = Collector::default();
        let rank = |train: f64, wait: f64, failed: u64, retries: u64| {
            Some(RankNumbers {
                phases: BTreeMap::from([("train_rollout".to_string(), train)]),
                wait_s: wait,
                items: true,
                failed,
                retries,
            })
        };
        c.gathered(vec![
            rank(1.0, 0.5, 0, 1),
            None,
            rank(3.0, 0.0, 2, 3),
            rank(2.0, 0.25, 1, 0),
        ]);
        let fixed = Fixed {
            iteration: 1,
            run: "r".into(),
            generation: 1,
            cluster: None,
            t: "now".into(),
            elapsed: Duration::from_secs(4),
            live_nodes: 4,
            budget: None,
        };
        let v: Value = serde_json::from_str(&c.line(&fixed, &FieldStats::default())).unwrap();
        assert_eq!(v["time/train_rollout_min_s"], 1.0);
        assert_eq!(v["time/train_rollout_median_s"], 2.0);
        assert_eq!(v["time/train_rollout_max_s"], 3.0);
        assert_eq!(
            v["barrier/wait_by_rank_s"],
            serde_json::json!([0.5, null, 0.0, 0.25])
        );
        assert_eq!(v["rollout/failed"], 3);
        assert_eq!(v["rollout/retries"], 4);
        assert_eq!(v["train/ran"], false);
        assert_eq!(v["train/samples_total"], Value::Null);
    }

    /// In elastic mode a generation formed after a loss has fewer members: the line
    /// counts them, and each member's numbers stay under its own rank, the dropped
    /// rank's `null`.
    #[test]
    fn a_generation_without_a_dropped_rank_counts_its_live_nodes_by_rank() {
        let numbers = |wait: f64| {
            Some(RankNumbers {
                wait_s: wait,
                ..RankNumbers::default()
            })
        };
        let mut c = Collector::default();
        // Rank 0 was dropped: ranks 1 and 2 arrive at positions 0 and 1.
        c.gathered(by_rank(&[1, 2], 3, vec![numbers(0.5), numbers(0.25)]));
        let fixed = Fixed {
            iteration: 3,
            run: "r".into(),
            generation: 2,
            cluster: None,
            t: "now".into(),
            elapsed: Duration::from_secs(1),
            live_nodes: 2,
            budget: None,
        };
        let v: Value = serde_json::from_str(&c.line(&fixed, &FieldStats::default())).unwrap();
        assert_eq!(v["cluster/live_nodes"], 2);
        assert_eq!(v["generation"], 2);
        assert_eq!(
            v["barrier/wait_by_rank_s"],
            serde_json::json!([null, 0.5, 0.25])
        );
        // A full generation: positions are ranks.
        assert_eq!(
            by_rank(&[0, 1], 2, vec![numbers(1.0), None]),
            vec![numbers(1.0), None]
        );
    }
}
