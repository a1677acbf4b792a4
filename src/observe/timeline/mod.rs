//! `rl-node timeline`: one self-contained HTML page (inline SVG) of a run, drawn from its
//! files alone: every rank's phases as coloured blocks on a lane of its own, barrier waits
//! hatched with whom they waited for, failed commands, retries, server restarts and
//! failures marked, generations separated with why the one before ended (in elastic
//! mode, with who was dropped or came back, a dropped rank's lane ending and resuming
//! there); above the lanes,
//! each iteration's time split into phases and the mean of a numeric field of the rollout
//! records.
//!
//! It reads what a finished, crashed or running run leaves: the event logs
//! (`.rl-node/events/rank-R.jsonl`, per cluster in a pipelined run), the records, rank
//! records and aborts of every generation, and `metrics.jsonl`. Torn last lines are skipped. It writes
//! only the page (atomically), never the run's state.
//!
//! [`model`] turns the files into lanes of blocks (pure, unit-tested); [`render`] draws
//! them.

pub mod model;
pub mod render;
mod trace;

use crate::error::{Ending, Failure};
use crate::layout::Layout;
use crate::observe::eventlog;
use crate::protocol::RankRecord;
use crate::store;
use clap::Args;
use model::{ClusterInput, Input, LiveRank, MetricsLine};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct TimelineArgs {
    /// The run's shared directory.
    #[arg(long, value_name = "DIR")]
    pub log_path: Option<String>,
    /// Where to write it [default: DIR/timeline.html, or DIR/timeline.json with
    /// `--format trace`].
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// `html`: a self-contained page; `trace`: Chrome trace-event JSON, for Perfetto
    /// (ui.perfetto.dev) or chrome://tracing.
    #[arg(long, value_name = "FORMAT", default_value = "html", value_parser = ["html", "trace"])]
    pub format: String,
    /// Only these iterations: `A..B` (both included), `A..`, `..B` or `N`.
    #[arg(long, value_name = "A..B")]
    pub iterations: Option<String>,
    /// In a pipelined run, only this cluster's lanes.
    #[arg(long, value_name = "CLUSTER", value_parser = ["rollout", "update"])]
    pub cluster: Option<String>,
    /// The numeric field of the rollout records whose mean is drawn per iteration
    /// (`rollout/<field>_mean` in metrics.jsonl) [default: the run's first
    /// `[observe] metrics-fields`, else `reward`].
    #[arg(long, value_name = "KEY")]
    pub field: Option<String>,
}

/// Parse `--iterations`: `A..B`, `A..`, `..B` or `N`, with A ≤ B.
pub fn parse_range(s: &str) -> Result<RangeInclusive<u64>, String> {
    let num = |p: &str, default: u64| -> Result<u64, String> {
        if p.trim().is_empty() {
            return Ok(default);
        }
        p.trim()
            .parse::<u64>()
            .map_err(|_| format!("--iterations {s}: {p:?} is not an iteration number"))
    };
    let (a, b) = match s.split_once("..") {
        // A range with neither end would mean every iteration: leave the flag out instead.
        Some((a, b)) if a.trim().is_empty() && b.trim_start_matches('=').trim().is_empty() => {
            return Err(format!(
                "--iterations {s}: give at least one end (A..B, A.., ..B or N)"
            ));
        }
        Some((a, b)) => (num(a, 0)?, num(b.trim_start_matches('='), u64::MAX)?),
        None => {
            let n = num(s, 0)?;
            if s.trim().is_empty() {
                return Err("--iterations needs A..B, A.., ..B or N".into());
            }
            (n, n)
        }
    };
    if a > b {
        return Err(format!("--iterations {s}: the range is empty ({a} > {b})"));
    }
    Ok(a..=b)
}

/// A range as `--iterations` takes it, `A..` for one without an end.
fn range_label(r: &RangeInclusive<u64>) -> String {
    match (*r.start(), *r.end()) {
        (a, b) if a == b => a.to_string(),
        (a, u64::MAX) => format!("{a}.."),
        (a, b) => format!("{a}..{b}"),
    }
}

pub fn main(args: TimelineArgs) -> Result<Ending, Failure> {
    let root = crate::observe::log_path_of("timeline", args.log_path.clone())?;
    let range = args
        .iterations
        .as_deref()
        .map(parse_range)
        .transpose()
        .map_err(|e| Failure::usage(e, None))?;
    let trace = args.format == "trace";
    let mut out = args.out.clone().unwrap_or_else(|| {
        root.join(if trace {
            "timeline.json"
        } else {
            "timeline.html"
        })
    });
    // A bare file name is in the current directory (whose fsync the atomic write needs).
    if out.parent().is_some_and(|p| p.as_os_str().is_empty()) {
        out = Path::new(".").join(out);
    }
    let (timeline, title) = build_run(&root, range, args.cluster.as_deref(), args.field.as_deref())
        .map_err(|e| Failure::usage(e, None))?;
    let (text, what) = if trace {
        let text = trace::json(&timeline, &title);
        let n = text.matches("\"ph\":").count();
        (text, format!("{n} trace events"))
    } else {
        let (page, counts) = render::html(&timeline, &title);
        (
            page,
            format!("{} lanes, {} blocks", counts.lanes, counts.blocks),
        )
    };
    store::fs::publish(&out, text.as_bytes()).map_err(|e| {
        Failure::failed(format!(
            "cannot write the timeline to {}: {e}",
            out.display()
        ))
    })?;
    crate::outln!(
        "wrote {} ({what}, {} KB)",
        out.display(),
        text.len().div_ceil(1024)
    );
    Ok(Ending::Done)
}

/// Read the run in `root` and draw it: the page and what it holds, or why there is
/// nothing to draw (no run there; no iteration in the range; a cluster the run lacks).
pub fn render_run(
    root: &Path,
    range: Option<RangeInclusive<u64>>,
    cluster: Option<&str>,
    field: Option<&str>,
) -> Result<(String, render::Counts), String> {
    let (timeline, title) = build_run(root, range, cluster, field)?;
    Ok(render::html(&timeline, &title))
}

/// Read the run in `root` into a timeline and its title, or say why there is nothing to
/// draw (no run there; no iteration in the range; a cluster the run lacks).
fn build_run(
    root: &Path,
    range: Option<RangeInclusive<u64>>,
    cluster: Option<&str>,
    field: Option<&str>,
) -> Result<(model::Timeline, String), String> {
    let pipelined = super::status::is_pipelined(root);
    let names: Vec<Option<&'static str>> = if pipelined {
        let all = ["rollout", "update"];
        match cluster {
            Some(c) => all.iter().filter(|n| **n == c).map(|n| Some(*n)).collect(),
            None => all.iter().map(|n| Some(*n)).collect(),
        }
    } else {
        if let Some(c) = cluster {
            return Err(format!(
                "--cluster {c}: the run in {} is not pipelined (it has one cluster)",
                root.display()
            ));
        }
        vec![None]
    };
    let mut clusters = Vec::new();
    let mut run_ids = BTreeSet::new();
    let mut default_field = None;
    let mut errors = Vec::new();
    for name in names {
        let layout = Layout::new(root).with_cluster(name);
        match super::read_cluster(&layout) {
            Ok(c) => {
                run_ids.insert(c.run_id.clone());
                if default_field.is_none() {
                    default_field = c.config["observe"]["metrics-fields"][0]
                        .as_str()
                        .map(str::to_string);
                }
                clusters.push(read_cluster_input(&layout, &c));
            }
            // Name the flag when it chose a cluster that is not there.
            Err(e) => errors.push(match cluster {
                Some(c) => format!("--cluster {c}: {e}"),
                None => e,
            }),
        }
    }
    if clusters.is_empty() {
        return Err(errors.join("\n"));
    }
    let field = field
        .map(str::to_string)
        .or(default_field)
        .unwrap_or_else(|| "reward".into());
    let metrics = read_metrics(&Layout::new(root).metrics(), &run_ids, &field, cluster);
    // The field's mean from the merged train splits where metrics.jsonl has none.
    let rollout_side = clusters
        .iter()
        .find(|c| c.name.is_none_or(|n| n == "rollout"));
    let mut wanted: BTreeSet<u64> = rollout_side
        .and_then(|c| c.events.first())
        .map(|e| {
            e.iter()
                .filter(|e| e.ends_iteration())
                .map(|e| e.iteration)
                .collect()
        })
        .unwrap_or_default();
    for m in &metrics {
        if m.value.is_some() {
            wanted.remove(&m.iteration);
        }
    }
    if let Some(r) = &range {
        wanted.retain(|i| r.contains(i));
    }
    let values = split_means(&Layout::new(root), &wanted, &field);
    let timeline = model::build(Input {
        clusters,
        metrics,
        field,
        values,
        iterations: range.clone(),
    });
    if let Some(r) = &range {
        if timeline.lanes.iter().all(|l| l.blocks.is_empty()) {
            return Err(format!(
                "--iterations {}: the run has no event of those iterations in {}",
                range_label(r),
                root.display()
            ));
        }
    }
    let title = format!(
        "rl-node timeline of {}{}",
        root.display(),
        match &range {
            Some(r) if r.start() == r.end() => format!(", iteration {}", r.start()),
            Some(r) => format!(", iterations {}", range_label(r)),
            None => String::new(),
        }
    );
    Ok((timeline, title))
}

/// What the files of one cluster say: every rank's events (read in parallel: they are
/// most of the work), hosts from the rank records of each generation seen, each
/// generation's abort, and the current generation's records.
fn read_cluster_input(layout: &Layout, c: &crate::protocol::ClusterRecord) -> ClusterInput {
    let root = layout.root().to_path_buf();
    let name = layout.cluster_name();
    // Ranks: the cluster's size, or more if event logs of more ranks exist (an earlier
    // generation may have been larger).
    let mut n = c.num_nodes;
    if let Ok(dir) = std::fs::read_dir(layout.state_dir().join("events")) {
        for e in dir.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if let Some(r) = f
                .strip_prefix("rank-")
                .and_then(|r| r.strip_suffix(".jsonl"))
                .and_then(|r| r.parse::<u32>().ok())
            {
                n = n.max(r + 1);
            }
        }
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut events: Vec<Vec<eventlog::Event>> = vec![Vec::new(); n as usize];
    std::thread::scope(|s| {
        let chunk = (n as usize).div_ceil(threads).max(1);
        for (i, slot) in events.chunks_mut(chunk).enumerate() {
            let root = &root;
            s.spawn(move || {
                for (j, v) in slot.iter_mut().enumerate() {
                    *v = eventlog::read_cluster_events(root, name, (i * chunk + j) as u32);
                }
            });
        }
    });
    let gens: BTreeSet<u64> = events
        .iter()
        .flat_map(|e| e.iter().map(|e| e.gen))
        .chain([c.gen])
        .collect();
    let members = super::members::read(layout, &c.run_id, gens.iter().copied());
    let mut hosts = HashMap::new();
    let mut walls = HashMap::new();
    let mut aborts = BTreeMap::new();
    let mut waiting = HashMap::new();
    for &gen in &gens {
        let records: Vec<Option<RankRecord>> = (0..n)
            .map(|r| {
                store::fs::read_json::<RankRecord>(&layout.rank_record(gen, r))
                    .ok()
                    .flatten()
                    .filter(|rec| rec.gen == gen && rec.rank == r)
            })
            .collect();
        for rec in records.iter().flatten() {
            hosts.insert((gen, rec.rank), rec.host.clone());
            if let Some(t) = parse_wall(&rec.wall) {
                walls.insert((gen, rec.rank), t);
            }
        }
        let of_gen = members
            .get(&gen)
            .cloned()
            .unwrap_or_else(|| (0..n).collect());
        waiting.extend(waits_of(&records, &of_gen));
        if let Some(a) = super::status::read_abort(layout, gen, &records) {
            aborts.insert(gen, a);
        }
    }
    ClusterInput {
        name,
        events,
        hosts,
        walls,
        aborts,
        waiting,
        gen: c.gen,
        live: live_ranks(layout),
        members,
    }
}

fn parse_wall(s: &str) -> Option<f64> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_millis() as f64 / 1000.0)
}

/// The barrier each member of one generation (`members`: every rank, unless elastic mode
/// dropped some) had arrived at and its coordinator (the lowest member) had not released,
/// with the members (of those records) that had not arrived there.
fn waits_of(records: &[Option<RankRecord>], members: &[u32]) -> Vec<((u64, u32), model::Waiting)> {
    let coordinator = members.first().copied().unwrap_or(0);
    let released0 = records.get(coordinator as usize).cloned().flatten();
    let arrived_k =
        |r: &Option<RankRecord>| r.as_ref().and_then(|r| r.arrived.as_ref()).map(|m| m.k);
    records
        .iter()
        .flatten()
        .filter_map(|rec| {
            let m = rec.arrived.as_ref()?;
            if released0.as_ref().is_some_and(|r0| r0.released_at(m.k)) {
                return None;
            }
            let waited_for = records
                .iter()
                .enumerate()
                .filter(|(i, _)| members.contains(&(*i as u32)))
                .filter(|(_, r)| arrived_k(r).is_none_or(|k| k < m.k))
                .map(|(i, _)| i as u32)
                .collect();
            let w = model::Waiting {
                barrier: m.name.clone(),
                waited_for,
            };
            Some(((rec.gen, rec.rank), w))
        })
        .collect()
}

/// The current generation's ranks as `rl-node status` sees them: its records, their
/// processes judged as it judges them, labelled as it labels them (dead, culprit,
/// stopped by a peer…).
fn live_ranks(layout: &Layout) -> Vec<Option<LiveRank>> {
    let Ok(mut s) = super::status::read_layout(layout) else {
        return Vec::new();
    };
    super::status::judge_layout(layout, &mut s);
    s.ranks
        .iter()
        .map(|r| {
            // A rank dropped in elastic mode has no record of this generation: it is shown
            // `dropped`, as of its last record.
            (r.record_state.is_some() || r.dropped.is_some()).then(|| LiveRank {
                wall: parse_wall(&r.last_write).unwrap_or(0.0),
                state: super::status::rank_label(r, s.abort.as_ref(), layout.cluster_name()),
                progress: r.progress.clone(),
            })
        })
        .collect()
}

/// Read no more than this of merged train splits for the field's means: a run without
/// `metrics.jsonl` values can hold gigabytes of trajectories, and the page is not worth
/// reading them all.
const SPLIT_BUDGET: u64 = 256 << 20;

/// The mean of `field` over the records of each iteration's merged train split (JSONL,
/// the default name) that has one, for `iterations`, until [`SPLIT_BUDGET`] is read.
fn split_means(layout: &Layout, iterations: &BTreeSet<u64>, field: &str) -> BTreeMap<u64, f64> {
    let fields = [field.to_string()];
    let mut out = BTreeMap::new();
    let mut read = 0u64;
    for &it in iterations {
        let path = layout.aggregated(it, "train");
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        read += meta.len();
        if read > SPLIT_BUDGET {
            break;
        }
        let stats = crate::metrics::file_stats(&store::Fs, &path, &fields);
        if let Some(mean) = stats.fields.first().and_then(|(_, s)| s.mean()) {
            out.insert(it, mean);
        }
    }
    out
}

/// The lines of `metrics.jsonl` of the current run(s), reduced to what is drawn (lines
/// that do not parse, torn or interleaved, are skipped). The newest line of an iteration
/// wins.
fn read_metrics(
    path: &Path,
    runs: &BTreeSet<String>,
    field: &str,
    cluster: Option<&str>,
) -> Vec<MetricsLine> {
    let limit = crate::store::ReadLimit::Journal.bytes();
    let Ok(Some(bytes)) = store::fs::read_tail(path, limit) else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    let key = format!("rollout/{field}_mean");
    let mut by: BTreeMap<(Option<String>, u64), MetricsLine> = BTreeMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if !v["run"].as_str().is_some_and(|r| runs.contains(r)) {
            continue;
        }
        let c = v["cluster"].as_str().map(str::to_string);
        if cluster.is_some() && c.as_deref() != cluster {
            continue;
        }
        let (Some(it), Some(total)) = (v["iteration"].as_u64(), v["time/iteration_s"].as_f64())
        else {
            continue;
        };
        let phases = crate::protocol::phase::ALL
            .iter()
            .filter_map(|p| {
                v[crate::metrics::phase_key(p.name()).as_str()]
                    .as_f64()
                    .map(|s| (p.name().to_string(), s))
            })
            .collect();
        by.insert(
            (c.clone(), it),
            MetricsLine {
                cluster: c,
                iteration: it,
                total,
                phases,
                value: v[key.as_str()].as_f64(),
            },
        );
    }
    by.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::{parse_range, range_label, split_means};
    use crate::layout::Layout;
    use std::collections::BTreeSet;

    #[test]
    fn split_means_average_the_field_over_each_merged_train_split() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let path = layout.aggregated(2, "train");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(
            &path,
            "{\"reward\": 1.0}\nnot json\n{\"reward\": 2.0}\n{}\n",
        )
        .unwrap();
        let means = split_means(&layout, &BTreeSet::from([1, 2]), "reward");
        assert_eq!(means.into_iter().collect::<Vec<_>>(), [(2, 1.5)]);
    }

    #[test]
    fn iteration_ranges() {
        assert_eq!(parse_range("3..7"), Ok(3..=7));
        assert_eq!(parse_range("3..=7"), Ok(3..=7));
        assert_eq!(parse_range("5"), Ok(5..=5));
        assert_eq!(parse_range("4.."), Ok(4..=u64::MAX));
        assert_eq!(parse_range("..2"), Ok(0..=2));
        assert_eq!(range_label(&(4..=u64::MAX)), "4..");
        assert_eq!(range_label(&(3..=7)), "3..7");
        assert_eq!(range_label(&(5..=5)), "5");
        for bad in ["", "..", " ..= ", "7..3", "a..3", "1..b", "x", "-1"] {
            let e = parse_range(bad).unwrap_err();
            assert!(e.starts_with("--iterations"), "{bad}: {e}");
        }
    }
}
