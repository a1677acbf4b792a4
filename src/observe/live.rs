//! `rl-node status --watch`: the status of a running cluster, refreshed until the run
//! ends. On a terminal the view is redrawn in place; piped, a line is printed whenever
//! what a rank does changes (phase, iteration, state, what rank 0 waits for), so a log
//! of the run's progress builds up; with `--json`, the status object instead, one per
//! line (NDJSON). A stopped run is usually restarted (by hand or by a batch requeue), so
//! the watch follows it through restarts, like `kubectl get -w`: it ends when the run
//! completes (exit 0), or when it stays stopped for `--restart-wait` with no new
//! generation (exit 1, the final view being the diagnosis), or on Ctrl-C.

use super::eventlog;
use super::status::{self, PipelineStatus, RunState, Status};
use crate::error::{Cause, Ending};
use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

/// Whether the run has ended, and how: `Some(true)` completed, `Some(false)` stopped.
fn ended(s: &Status) -> Option<bool> {
    match s.state {
        RunState::Completed => Some(true),
        RunState::Stopped => Some(false),
        _ => None,
    }
}

/// How `status --watch` shows the run and when it gives up on a stopped one.
pub struct WatchOptions {
    pub every: Duration,
    /// NDJSON: a status object per change.
    pub json: bool,
    /// How long a stopped run is watched for a restart before the watch ends.
    pub restart_wait: Duration,
}

/// The last iterations' wall times of one cluster, from its coordinator's event log (rank
/// 0's, unless elastic mode dropped it): "iteration 7 12.3s, 8 11.9s".
fn recent_times(
    log_path: &Path,
    cluster: Option<&'static str>,
    gen: u64,
    coordinator: u32,
) -> String {
    let events = eventlog::read_cluster_events(log_path, cluster, coordinator);
    // (A pipelined rollout cluster ends an iteration with its journal line, not a barrier.)
    let mut done: Vec<u64> = events
        .iter()
        .filter(|e| e.gen == gen && e.ends_iteration())
        .map(|e| e.iteration)
        .collect();
    done.dedup();
    let times: Vec<String> = done
        .iter()
        .rev()
        .take(5)
        .rev()
        .filter_map(|&i| {
            let (total, _) = eventlog::phase_times(&events, gen, i)?;
            Some(format!("{i}: {total:.1}s"))
        })
        .collect();
    if times.is_empty() {
        String::new()
    } else {
        format!(
            "last iterations (rank {coordinator}'s time): {}\n",
            times.join(", ")
        )
    }
}

/// One line per rank of what it does, for piped output: printed when it changes.
fn summary(prefix: &str, s: &Status) -> String {
    let ranks: Vec<String> = s
        .ranks
        .iter()
        .map(|r| {
            format!(
                "rank {} {} it {} {}",
                r.rank,
                r.state,
                r.iteration,
                r.phase_label().unwrap_or_else(|| "-".into())
            )
        })
        .collect();
    let waiting = if s.waiting_for.is_empty() {
        String::new()
    } else {
        let w: Vec<String> = s.waiting_for.iter().map(|r| r.to_string()).collect();
        format!(
            "; rank {} waits for rank(s) {}",
            s.coordinator,
            w.join(", ")
        )
    };
    format!("{prefix}{}{waiting}", ranks.join(" | "))
}

/// What one refresh shows: the full view (without the recent iteration times, which
/// read rank 0's whole event log: added by [`View::full`] only when it is printed), the
/// change line, and whether (how) it ended.
struct View {
    status: String,
    /// Whose recent times the full view ends with: (label, cluster, generation, its
    /// coordinator).
    times: Vec<(&'static str, Option<&'static str>, u64, u32)>,
    line: String,
    /// The status object `--json` prints.
    json: serde_json::Value,
    ended: Option<bool>,
}

impl View {
    /// The full view: the status, then each cluster's last iterations' times.
    fn full(&self, log_path: &Path) -> String {
        let mut full = self.status.clone();
        for &(label, cluster, gen, coordinator) in &self.times {
            let times = recent_times(log_path, cluster, gen, coordinator);
            if !times.is_empty() {
                full.push_str(label);
                full.push_str(&times);
            }
        }
        full
    }
}

fn single(log_path: &Path) -> Result<View, String> {
    let mut s = status::read(log_path)?;
    status::judge(log_path, &mut s);
    Ok(View {
        status: status::render(&s),
        times: vec![("", None, s.gen, s.coordinator)],
        line: format!("{} | {}", summary("", &s), s.state_detail),
        json: serde_json::to_value(&s).expect("json"),
        ended: ended(&s),
    })
}

fn pipelined(log_path: &Path) -> View {
    let p: PipelineStatus = status::read_pipeline(log_path);
    let full = status::render_pipeline(&p);
    let mut times = Vec::new();
    let mut lines = vec![format!(
        "queue: committed {}, trained {}",
        p.rolled_out, p.trained
    )];
    let mut ends = Vec::new();
    for (name, label, s) in [
        ("rollout", "rollout cluster: ", &p.rollout),
        ("update", "update cluster: ", &p.update),
    ] {
        match s {
            Ok(s) => {
                times.push((label, Some(name), s.gen, s.coordinator));
                lines.push(summary(&format!("{name}: "), s));
                ends.push(ended(s));
            }
            Err(_) => {
                lines.push(format!("{name}: not started"));
                ends.push(None);
            }
        }
    }
    // Ended when both clusters have; completed when both completed.
    let ended = match (ends[0], ends[1]) {
        (Some(a), Some(b)) => Some(a && b),
        (Some(false), _) | (_, Some(false)) => {
            // One cluster stopped on a failure: the other stops with it (docs/pipeline.md),
            // so wait for it, unless it never started.
            if p.rollout.is_err() || p.update.is_err() {
                Some(false)
            } else {
                None
            }
        }
        _ => None,
    };
    View {
        status: full,
        times,
        line: lines.join(" || "),
        json: serde_json::to_value(&p).expect("json"),
        ended,
    }
}

/// Cursor home, clear the screen: a terminal watch redraws the whole view.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// What the watch prints, and the last change it printed (a view is printed when it
/// differs from that one, except on a terminal, which is redrawn every refresh).
struct Printer {
    tty: bool,
    json: bool,
    every: Duration,
    last_line: String,
}

impl Printer {
    /// A refresh of a run that goes on; `waiting` says it is stopped and for how long
    /// a restart is awaited.
    fn progress(&mut self, v: View, log_path: &Path, waiting: &str) {
        let now = chrono::Local::now().format("%Y-%m-%dT%H:%M:%S%:z");
        if self.tty {
            crate::output::stdout_after(
                CLEAR,
                format_args!(
                    "{now}  (refreshing every {}{waiting}; Ctrl-C to leave)\n{}",
                    humantime::format_duration(self.every),
                    v.full(log_path)
                ),
                false,
            );
        } else if v.line != self.last_line {
            if self.json {
                crate::outln!("{}", v.json);
            } else {
                crate::outln!("{now} {}{waiting}", v.line);
            }
            self.last_line = v.line;
        }
    }

    /// The view the watch ends with: the full view (for JSON the object, unless it was
    /// the last change printed).
    fn last(&mut self, v: &View, log_path: &Path) {
        if self.json {
            if v.line != self.last_line {
                crate::outln!("{}", v.json);
            }
        } else {
            let clear = if self.tty { CLEAR } else { "" };
            crate::output::stdout_after(clear, format_args!("{}", v.full(log_path)), false);
        }
    }

    /// No run to show yet: why (a watch may be started before the nodes).
    fn absent(&mut self, why: &str) {
        let now = chrono::Local::now().format("%Y-%m-%dT%H:%M:%S%:z");
        let line = format!("waiting for a run: {why}");
        if self.json {
            if line != self.last_line {
                let absent = serde_json::json!({
                    "schema_version": status::SCHEMA_VERSION,
                    "state": "absent",
                    "state_detail": why,
                });
                crate::outln!("{absent}");
            }
        } else if self.tty || line != self.last_line {
            crate::outln!("{now} {line}");
        }
        self.last_line = line;
    }
}

/// Watch the run in `log_path`, refreshing every `every`, until it ends: done when the
/// run completed, failed (exit 1, the last view being the report) when it stayed stopped
/// for `restart_wait` without a restart.
pub fn watch(log_path: &Path, o: &WatchOptions) -> Ending {
    let mut out = Printer {
        tty: std::io::stdout().is_terminal() && !o.json,
        json: o.json,
        every: o.every,
        last_line: String::new(),
    };
    // The stopped view being waited on, and since when: a new stop restarts the wait.
    let mut stopped: Option<(String, Instant)> = None;
    loop {
        let view = if status::is_pipelined(log_path) {
            Ok(pipelined(log_path))
        } else {
            single(log_path)
        };
        match view {
            Ok(v) => {
                if v.ended != Some(false) {
                    stopped = None;
                } else if stopped.as_ref().is_none_or(|(line, _)| *line != v.line) {
                    stopped = Some((v.line.clone(), Instant::now()));
                }
                let gave_up = stopped
                    .as_ref()
                    .is_some_and(|(_, since)| since.elapsed() >= o.restart_wait);
                if v.ended == Some(true) || gave_up {
                    out.last(&v, log_path);
                    return match v.ended {
                        Some(true) => Ending::Done,
                        _ => Ending::Reported(Cause::Failed),
                    };
                }
                let waiting = match stopped {
                    Some(_) => format!(
                        "; watching for a restart for up to {} (--restart-wait)",
                        humantime::format_duration(o.restart_wait)
                    ),
                    None => String::new(),
                };
                out.progress(v, log_path, &waiting);
            }
            Err(e) => out.absent(e.lines().next().unwrap_or("")),
        }
        std::thread::sleep(o.every);
    }
}
