//! The timeline as Chrome trace-event JSON, the format Perfetto (ui.perfetto.dev),
//! `chrome://tracing`, `ray timeline`, the torch profiler and nsys exports share, so that a
//! run opens in the viewer RL engineers already use, zoomable to any depth.
//!
//! A cluster is a process (`pid` 1; in a pipelined run rollout 1, update 2) and each rank
//! three threads: its phases, its waits (barriers, the other cluster) and its commands, as
//! complete (`X`) events. Commits, hand-offs, server starts and stops, failed commands,
//! retries, hang reports and the failures that stopped a generation are instant (`i`)
//! events; generation starts are global instants (with, in elastic mode, who they dropped
//! and took back), listed too in the process's labels (`M`); a dropped rank's stretch
//! without membership is a complete event of its phase track. Times are microseconds from the first thing drawn; `otherData` holds its wall
//! clock.

use super::model::{Lane, Timeline};
use serde_json::{json, Value};

/// Threads per rank: phases, waits, commands.
const TRACKS: u32 = 3;

fn pid_of(cluster: Option<&str>) -> u32 {
    match cluster {
        Some("update") => 2,
        _ => 1,
    }
}

/// The trace of `t`, as JSON text.
pub(crate) fn json(t: &Timeline, title: &str) -> String {
    let us = |s: f64| ((s - t.start) * 1e6 * 1000.0).round() / 1000.0;
    let mut ev: Vec<Value> = Vec::new();
    let mut clusters: Vec<Option<&str>> = t.lanes.iter().map(|l| l.cluster).collect();
    clusters.dedup();
    for c in &clusters {
        let pid = pid_of(*c);
        let gens: Vec<String> = t
            .generations
            .iter()
            .filter(|g| g.cluster == *c)
            .map(|g| {
                format!(
                    "generation {} from +{:.3}s{}",
                    g.gen,
                    g.t - t.start,
                    g.ended
                        .as_ref()
                        .map(|e| format!(" (the previous ended: {e})"))
                        .unwrap_or_default()
                )
            })
            .collect();
        let name = c.map_or("rl-node".to_string(), |c| format!("rl-node {c} cluster"));
        ev.push(meta("process_name", pid, 0, json!({ "name": name })));
        ev.push(meta(
            "process_sort_index",
            pid,
            0,
            json!({ "sort_index": pid }),
        ));
        ev.push(meta(
            "process_labels",
            pid,
            0,
            json!({ "labels": gens.join("; ") }),
        ));
        ev.push(meta(
            "thread_name",
            pid,
            0,
            json!({ "name": "generations" }),
        ));
    }
    for g in &t.generations {
        ev.push(json!({
            "name": format!("generation {}", g.gen), "cat": "generation", "ph": "i", "s": "g",
            "ts": us(g.t), "pid": pid_of(g.cluster), "tid": 0,
            "args": {
                "generation": g.gen, "previous": g.previous, "ended": g.ended,
                // Elastic mode: who it dropped (and why) and who it took back.
                "membership": g.membership.as_ref().map(|m| json!({
                    "members": m.members,
                    "dropped": m.dropped.iter()
                        .map(|(rank, why)| json!({ "rank": rank, "why": why }))
                        .collect::<Vec<_>>(),
                    "rejoined": m.rejoined,
                    "regrouped": m.regrouped,
                })),
            },
        }));
    }
    for d in &t.downtime {
        ev.push(json!({
            "name": "downtime", "cat": "downtime", "ph": "X", "ts": us(d.start),
            "dur": us(d.end) - us(d.start), "pid": 1, "tid": 0,
            "args": { "generations_after": d.gens },
        }));
    }
    for l in &t.lanes {
        lane(&mut ev, l, t.end, &us);
    }
    let doc = json!({
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "title": title,
            "start": super::render::wall(t.start),
            "start_unix_s": t.start,
        },
    });
    doc.to_string()
}

fn meta(name: &str, pid: u32, tid: u32, args: Value) -> Value {
    json!({ "name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args })
}

/// One rank's three threads and its instants; `end`, the end of the trace.
fn lane(ev: &mut Vec<Value>, l: &Lane, end: f64, us: &impl Fn(f64) -> f64) {
    let pid = pid_of(l.cluster);
    let base = 1 + l.rank * TRACKS;
    let who = l.label();
    let state = l
        .state
        .as_deref()
        .map(|s| format!(" ({s})"))
        .unwrap_or_default();
    for (i, what) in ["", " waits", " commands"].iter().enumerate() {
        let tid = base + i as u32;
        ev.push(meta(
            "thread_name",
            pid,
            tid,
            json!({ "name": format!("{who}{what}{state}") }),
        ));
        ev.push(meta(
            "thread_sort_index",
            pid,
            tid,
            json!({ "sort_index": tid }),
        ));
    }
    let x = |name: String, cat: &str, tid: u32, a: f64, b: f64, args: Value| {
        json!({
            "name": name, "cat": cat, "ph": "X", "ts": us(a), "dur": (us(b) - us(a)).max(0.0),
            "pid": pid, "tid": tid, "args": args,
        })
    };
    for b in &l.blocks {
        ev.push(x(
            b.phase.name().to_string(),
            "phase",
            base,
            b.start,
            b.end,
            json!({ "iteration": b.iteration, "generation": b.gen, "host": b.host,
                    "open": b.open, "log": b.log, "notes": b.notes }),
        ));
    }
    // Elastic mode: the stretches in which the rank was no member, on its phase track.
    for a in &l.absent {
        ev.push(x(
            "not a member".to_string(),
            "membership",
            base,
            a.from,
            a.until.unwrap_or(end).max(a.from),
            json!({ "dropped_from": a.dropped_from, "back_in": a.back_in, "why": a.why }),
        ));
    }
    for w in &l.waits {
        let (name, cat) = if w.pipeline {
            (format!("wait for {}", w.barrier), "pipeline-wait")
        } else {
            (format!("wait at {}", w.barrier), "barrier-wait")
        };
        ev.push(x(
            name,
            cat,
            base + 1,
            w.start,
            w.end,
            json!({ "iteration": w.iteration, "generation": w.gen, "open": w.open,
                    "waited_for": w.waited_for,
                    "dead": w.dead.iter().map(|d| d.0).collect::<Vec<_>>() }),
        ));
    }
    for c in &l.commands {
        ev.push(x(
            format!("{} command", c.name),
            "command",
            base + 2,
            c.start,
            c.end,
            json!({ "iteration": c.iteration, "generation": c.gen, "exit": c.detail }),
        ));
    }
    let instant = |name: &str, cat: &str, t: f64, scope: &str, args: Value| {
        json!({ "name": name, "cat": cat, "ph": "i", "s": scope, "ts": us(t),
                "pid": pid, "tid": base, "args": args })
    };
    for i in &l.instants {
        ev.push(instant(
            &i.name,
            "event",
            i.t,
            "t",
            json!({ "iteration": i.iteration, "generation": i.gen, "detail": i.detail }),
        ));
    }
    for m in &l.marks {
        // A failure that stopped a generation concerns the whole cluster.
        let scope = if m.kind == super::model::MarkKind::Failure {
            "p"
        } else {
            "t"
        };
        ev.push(instant(
            m.kind.class(),
            m.kind.class(),
            m.t,
            scope,
            json!({ "iteration": m.iteration, "generation": m.gen, "detail": m.text }),
        ));
    }
}
