//! `rl-node status --watch`: the status of a running cluster, refreshed until the run
//! ends. On a terminal the view is redrawn in place; piped, a line is printed whenever
//! what a rank does changes (phase, iteration, state, what rank 0 waits for), so a log
//! of the run's progress builds up. It ends when the run ends (completed, stopped, or
//! every node gone), printing the final state, with exit 0 for a completed run and 1
//! otherwise.

use super::eventlog;
use super::status::{self, PipelineStatus, Status};
use crate::error::{Cause, Ending};
use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

/// Whether the run has ended, and how: `Some(true)` completed, `Some(false)` stopped.
fn ended(s: &Status) -> Option<bool> {
    let o = status::overall(s);
    if o == "completed" {
        Some(true)
    } else if o.starts_with("STOPPED") || o.starts_with("stopped") {
        Some(false)
    } else {
        None
    }
}

/// The last iterations' wall times of one cluster, from its rank 0's event log:
/// "iteration 7 12.3s, 8 11.9s".
fn recent_times(log_path: &Path, cluster: Option<&'static str>, gen: u64) -> String {
    let events = eventlog::read_cluster_events(log_path, cluster, 0);
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
        format!("last iterations (rank 0's time): {}\n", times.join(", "))
    }
}

/// One line per rank of what it does, for piped output: printed when it changes.
fn summary(prefix: &str, s: &Status) -> String {
    let ranks: Vec<String> = s
        .ranks
        .iter()
        .map(|r| {
            let state = r
                .state
                .map(|s| format!("{s:?}").to_lowercase())
                .unwrap_or_else(|| "missing".into());
            format!(
                "rank {} {state} it {} {}",
                r.rank,
                r.iteration,
                r.phase.clone().unwrap_or_else(|| "-".into())
            )
        })
        .collect();
    let waiting = if s.waiting_for.is_empty() {
        String::new()
    } else {
        let w: Vec<String> = s.waiting_for.iter().map(|r| r.to_string()).collect();
        format!("; rank 0 waits for rank(s) {}", w.join(", "))
    };
    format!("{prefix}{}{waiting}", ranks.join(" | "))
}

/// What one refresh shows: the full view (without the recent iteration times, which
/// read rank 0's whole event log: added by [`View::full`] only when it is printed), the
/// change line, and whether (how) it ended.
struct View {
    status: String,
    /// Whose recent times the full view ends with: (label, cluster, generation).
    times: Vec<(&'static str, Option<&'static str>, u64)>,
    line: String,
    ended: Option<bool>,
}

impl View {
    /// The full view: the status, then each cluster's last iterations' times.
    fn full(&self, log_path: &Path) -> String {
        let mut full = self.status.clone();
        for &(label, cluster, gen) in &self.times {
            let times = recent_times(log_path, cluster, gen);
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
        times: vec![("", None, s.gen)],
        line: format!("{} | {}", summary("", &s), status::overall(&s)),
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
                times.push((label, Some(name), s.gen));
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
        ended,
    }
}

/// Cursor home, clear the screen: a terminal watch redraws the whole view.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// Watch the run in `log_path`, refreshing every `every`, until it ends: done when the
/// run completed, failed (exit 1, the last view being the report) when it stopped.
pub fn watch(log_path: &Path, every: Duration) -> Ending {
    let tty = std::io::stdout().is_terminal();
    let mut last_line = String::new();
    loop {
        let view = if status::is_pipelined(log_path) {
            Ok(pipelined(log_path))
        } else {
            single(log_path)
        };
        let now = chrono::Local::now().format("%Y-%m-%dT%H:%M:%S%:z");
        match view {
            Ok(v) => {
                if let Some(done) = v.ended {
                    let clear = if tty { CLEAR } else { "" };
                    crate::output::stdout_after(clear, format_args!("{}", v.full(log_path)), false);
                    return if done {
                        Ending::Done
                    } else {
                        Ending::Reported(Cause::Failed)
                    };
                }
                if tty {
                    crate::output::stdout_after(
                        CLEAR,
                        format_args!(
                            "{now}  (refreshing every {}; Ctrl-C to leave)\n{}",
                            humantime::format_duration(every),
                            v.full(log_path)
                        ),
                        false,
                    );
                } else if v.line != last_line {
                    crate::outln!("{now} {}", v.line);
                    last_line = v.line;
                }
            }
            Err(e) => {
                // Not started yet: wait for it (a watch may be started before the nodes).
                let line = format!("waiting for a run: {}", e.lines().next().unwrap_or(""));
                if tty || line != last_line {
                    crate::outln!("{now} {line}");
                    last_line = line;
                }
            }
        }
        std::thread::sleep(every);
    }
}
