//! The timeline drawn: one self-contained HTML page holding an inline SVG (no network,
//! no external script or style), with a `<title>` on every block for hovering and a few
//! lines of script that show those titles at once and mark the page as loaded.
//!
//! Large runs stay small: a block narrower than [`MIN_PX`] at the page's width is merged
//! with its neighbours of the same lane into one "mixed" block of about [`GROUP_PX`],
//! coloured by the phase that took most of its time, whose title sums up what it holds.
//! Barrier waits and marks are merged the same way.

use super::model::{Block, Lane, Mark, MarkKind, Timeline, Wait};
use crate::protocol::phase::ALL;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The colour of a membership change (elastic mode): its line, its label, where a dropped
/// rank's lane ends and resumes.
const MEMBERSHIP: &str = "#7b2cbf";

/// The height of a row of generation labels.
const GEN_ROW_H: f64 = 12.0;
/// A generous width of a character of a 10 px generation label.
const GEN_CHAR_PX: f64 = 6.0;

/// Width of the lane area in pixels (the page is wider by the labels).
pub const PLOT_W: f64 = 1400.0;
const LABEL_W: f64 = 250.0;
const MARGIN: f64 = 16.0;
const LANE_H: f64 = 16.0;
/// A generous width of a character of an 11 px sans-serif label.
const LABEL_CHAR_PX: f64 = 6.5;
const LANE_GAP: f64 = 4.0;
const CHART_H: f64 = 90.0;
/// Blocks narrower than this are merged into mixed blocks.
pub const MIN_PX: f64 = 1.0;
/// A mixed block grows until it is this wide.
pub const GROUP_PX: f64 = 8.0;

/// One colour per phase, in walk order (ALL).
const COLOURS: [&str; 14] = [
    "#9e9e9e", "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#c5b0d5", "#2ca02c", "#8c564b",
    "#e377c2", "#f7b6d2", "#d62728", "#9467bd", "#17becf", "#7f7f7f",
];

fn colour(phase: &str) -> &'static str {
    ALL.iter()
        .position(|p| p.name() == phase)
        .map_or("#cccccc", |i| COLOURS[i])
}

/// Escape text for XML content and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn short(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

pub(crate) fn wall(t: f64) -> String {
    chrono::DateTime::from_timestamp_millis((t * 1000.0).round() as i64)
        .map(|d| d.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
        .unwrap_or_else(|| format!("{t:.3}"))
}

fn secs(s: f64) -> String {
    if s >= 120.0 {
        // Round once, then split: rounding the seconds alone turns 179.7 into "2m60s".
        let r = s.round() as u64;
        format!("{}m{:02}s", r / 60, r % 60)
    } else if s >= 10.0 {
        format!("{s:.1}s")
    } else {
        format!("{s:.3}s")
    }
}

/// Maps wall-clock seconds to x: linear, except that each collapsed downtime takes
/// [`DOWNTIME_PX`] whatever its length.
struct Scale {
    t0: f64,
    px_per_s: f64,
    /// The collapsed stretches (start, end), in time order.
    gaps: Vec<(f64, f64)>,
}

/// The width a collapsed downtime is drawn at.
pub const DOWNTIME_PX: f64 = 70.0;

impl Scale {
    fn new(t: &Timeline) -> Scale {
        let gaps: Vec<(f64, f64)> = t.downtime.iter().map(|d| (d.start, d.end)).collect();
        let collapsed: f64 = gaps.iter().map(|g| g.1 - g.0).sum();
        let span = (t.end - t.start - collapsed).max(1e-3);
        Scale {
            t0: t.start,
            px_per_s: (PLOT_W - DOWNTIME_PX * gaps.len() as f64) / span,
            gaps,
        }
    }

    fn x(&self, t: f64) -> f64 {
        let mut x = LABEL_W;
        let mut from = self.t0;
        for &(a, b) in &self.gaps {
            if t <= a {
                break;
            }
            x += (a - from) * self.px_per_s;
            if t < b {
                return x + (t - a) / (b - a).max(1e-9) * DOWNTIME_PX;
            }
            x += DOWNTIME_PX;
            from = b;
        }
        x + (t - from) * self.px_per_s
    }

    fn collapsed(&self, t: f64) -> bool {
        self.gaps.iter().any(|&(a, b)| t > a && t < b)
    }
}

/// What was drawn, for the page's own counts (and tests).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub lanes: usize,
    pub blocks: usize,
    pub mixed: usize,
    pub waits: usize,
    pub marks: usize,
}

pub fn html(t: &Timeline, title: &str) -> (String, Counts) {
    let scale = Scale::new(t);
    let mut counts = Counts::default();
    let mut svg = String::with_capacity(1 << 20);
    let mut y = MARGIN;

    // Above the lanes: time per iteration split into phases, one chart per cluster, and
    // the chosen field.
    let mut by_cluster: BTreeMap<Option<String>, Vec<&super::model::IterStat>> = BTreeMap::new();
    for s in &t.iterations {
        by_cluster.entry(s.cluster.clone()).or_default().push(s);
    }
    for (cluster, stats) in &by_cluster {
        y = iteration_chart(&mut svg, y, cluster.as_deref(), stats, t.from_metrics);
    }
    let with_value: Vec<&super::model::IterStat> =
        t.iterations.iter().filter(|s| s.value.is_some()).collect();
    y = field_chart(
        &mut svg,
        y,
        &t.field,
        &with_value,
        t.from_metrics,
        t.values_from_splits,
    );
    y = legend(&mut svg, y);
    y = axis(&mut svg, y, t, &scale);

    // Generation labels that would overlap go in rows above one another, over their
    // cluster's lanes.
    let label_rows = gen_label_rows(t, &scale);

    // The lanes, each cluster's followed by a row per failure that stopped one of its
    // generations (the message in a row of its own, not over other blocks).
    let lanes_top = y;
    let _ = write!(svg, r#"<g id="lanes">"#);
    let mut cluster_rows: Vec<(Option<&'static str>, f64, f64)> = Vec::new();
    let mut i = 0;
    while i < t.lanes.len() {
        let cluster = t.lanes[i].cluster;
        let n = t.lanes[i..]
            .iter()
            .take_while(|l| l.cluster == cluster)
            .count();
        if let Some(c) = cluster {
            let _ = write!(
                svg,
                r#"<text class="cluster" x="{MARGIN}" y="{:.1}" font-weight="bold">{} cluster</text>"#,
                y + 12.0,
                esc(c)
            );
            y += LANE_H + LANE_GAP;
        }
        let rows = t
            .generations
            .iter()
            .zip(&label_rows)
            .filter(|(g, _)| g.cluster == cluster)
            .map(|(_, row)| *row)
            .max()
            .unwrap_or(0);
        y += rows as f64 * GEN_ROW_H;
        let top = y;
        for lane in &t.lanes[i..i + n] {
            draw_lane(&mut svg, lane, y, &scale, &mut counts);
            y += LANE_H + LANE_GAP;
        }
        cluster_rows.push((cluster, top, y));
        y = failure_rows(&mut svg, &t.lanes[i..i + n], y, &scale);
        i += n;
    }
    svg.push_str("</g>");
    let lanes_bottom = y;

    generation_lines(&mut svg, t, &scale, &label_rows, &cluster_rows);
    downtime(&mut svg, t, &scale, lanes_top, lanes_bottom);
    counts.lanes = t.lanes.len();
    let height = y + MARGIN;
    let width = LABEL_W + PLOT_W + 2.0 * MARGIN;

    let mut page = String::with_capacity(svg.len() + 4096);
    let _ = write!(
        page,
        r##"<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 12px; }}
h2, p {{ overflow-wrap: anywhere; }}
#timeline {{ display: block; max-width: 100%; user-select: none; }}
.hint {{ color: #555; font-size: 12px; }}
svg text {{ font-family: sans-serif; font-size: 11px; }}
#tip {{ position: fixed; display: none; background: #ffffe8; border: 1px solid #888; padding: 4px 6px; font-size: 12px; white-space: pre; pointer-events: none; max-width: 900px; overflow: hidden; }}
</style></head>
<body data-timeline="loading">
<h2>{title}</h2>
<p>{summary}</p>
<p class="hint">Zoom the lanes with the mouse wheel over them, drag to pan, double-click to see everything again.</p>
<svg xmlns="http://www.w3.org/2000/svg" id="timeline" width="100%" viewBox="0 0 {width:.0} {height:.0}" data-plot-x="{LABEL_W}" data-plot-w="{PLOT_W}" data-lanes="{lanes}" data-blocks="{blocks}" data-mixed="{mixed}">
<defs><pattern id="hatch" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff" fill-opacity="0.55"/><line x1="0" y1="0" x2="0" y2="6" stroke="#000" stroke-width="2"/></pattern><pattern id="hatch-pipeline" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(-45)"><rect width="6" height="6" fill="#ffffff" fill-opacity="0.7"/><line x1="0" y1="0" x2="0" y2="6" stroke="#06c" stroke-width="2"/></pattern><clipPath id="plot"><rect x="{LABEL_W}" y="-100000" width="{PLOT_W}" height="200000"/></clipPath></defs>
{svg}
</svg>
<div id="tip"></div>
<script>
{SCRIPT}
</script>
</body></html>
"##,
        title = esc(title),
        summary = esc(&summary(t, &counts)),
        lanes = counts.lanes,
        blocks = counts.blocks,
        mixed = counts.mixed,
    );
    (page, counts)
}

/// The generation separators over their cluster's lanes (`cluster_rows`: each cluster's
/// top and bottom), each labelled in its row of `label_rows`; in elastic mode a membership
/// change in its own colour, named by who was dropped or came back.
fn generation_lines(
    svg: &mut String,
    t: &Timeline,
    scale: &Scale,
    label_rows: &[usize],
    cluster_rows: &[(Option<&'static str>, f64, f64)],
) {
    let _ = write!(
        svg,
        r#"<g clip-path="url(#plot)"><g class="tz" id="generations">"#
    );
    for (g, row) in t.generations.iter().zip(label_rows) {
        let Some(&(_, top, bottom)) = cluster_rows.iter().find(|c| c.0 == g.cluster) else {
            continue;
        };
        let x = scale.x(g.t);
        let lift = *row as f64 * GEN_ROW_H;
        // Labels of late generations run leftwards, to stay on the page.
        let right = gen_label_runs_left(x);
        let why = gen_why(g);
        let mut tip = format!(
            "{}generation {} started {}\n{why}",
            g.cluster
                .map(|c| format!("{c} cluster: "))
                .unwrap_or_default(),
            g.gen,
            wall(g.t)
        );
        if let (Some(p), Some(_)) = (&g.previous, &g.ended) {
            let _ = write!(tip, "\nbefore it: {p}");
        }
        // Elastic mode: a membership change, drawn in its own colour and named by who was
        // dropped (and why) or who came back.
        let (attrs, stroke, dash) = match &g.membership {
            Some(m) => {
                let _ = write!(
                    tip,
                    "\nmembership change: {}{}",
                    m.short(),
                    if m.regrouped {
                        " (formed by the members left, in their processes)"
                    } else {
                        ""
                    }
                );
                for (rank, why) in &m.dropped {
                    let _ = write!(tip, "\nrank {rank} dropped: {why}");
                }
                let _ = write!(
                    tip,
                    "\nmembers: {}; coordinator: rank {}",
                    crate::observe::members::ranks_list(&m.members),
                    m.members.first().copied().unwrap_or(0)
                );
                let list = |ranks: &mut dyn Iterator<Item = u32>| {
                    ranks.map(|r| r.to_string()).collect::<Vec<_>>().join(",")
                };
                (
                    format!(
                        r#" class="gen membership" data-dropped="{}" data-rejoined="{}" data-members="{}""#,
                        list(&mut m.dropped.iter().map(|d| d.0)),
                        list(&mut m.rejoined.iter().copied()),
                        list(&mut m.members.iter().copied()),
                    ),
                    MEMBERSHIP,
                    "6 2 1 2",
                )
            }
            None => (r#" class="gen""#.to_string(), "#000", "4 2"),
        };
        let _ = write!(
            svg,
            r##"<g{attrs} data-gen="{}"><title>{}</title><line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{bottom:.1}" stroke="{stroke}" stroke-width="1.5" stroke-dasharray="{dash}" vector-effect="non-scaling-stroke"/><text data-x="{x:.1}" x="{:.1}" y="{:.1}" font-size="10" text-anchor="{}"{}>{}</text></g>"##,
            g.gen,
            esc(&tip),
            top - 4.0 - lift,
            if right { x - 2.0 } else { x + 2.0 },
            top - 6.0 - lift,
            if right { "end" } else { "start" },
            if g.membership.is_some() {
                format!(r#" fill="{MEMBERSHIP}""#)
            } else {
                String::new()
            },
            esc(&gen_label(g))
        );
    }
    svg.push_str("</g></g>");
}

/// Whether the label of a generation line at `x` runs leftwards from it (late ones do, to
/// stay on the page).
fn gen_label_runs_left(x: f64) -> bool {
    x > LABEL_W + PLOT_W * 0.6
}

/// Why generation `g`'s predecessor ended, as far as known.
fn gen_why(g: &super::model::GenStart) -> String {
    match (&g.previous, &g.ended) {
        (_, Some(e)) => format!("the previous generation ended: {e}"),
        (Some(p), None) => format!("before it: {p}"),
        (None, None) => "first generation".to_string(),
    }
}

/// The text of generation `g`'s label: who it dropped or took back (elastic mode), else
/// why the one before ended.
fn gen_label(g: &super::model::GenStart) -> String {
    match &g.membership {
        Some(m) => format!("generation {}: {}", g.gen, m.short()),
        None if g.gen > 1 => format!("generation {}: {}", g.gen, short(&gen_why(g), 60)),
        None => format!("generation {}", g.gen),
    }
}

/// The row (0: just over the lanes, 1: above it…) of each generation's label, so that
/// the labels of generations close in time (a regroup, then a restart) do not overlap
/// at the page's width: each takes the lowest row where it clears the labels there.
fn gen_label_rows(t: &Timeline, scale: &Scale) -> Vec<usize> {
    let mut taken: Vec<(Option<&'static str>, usize, f64, f64)> = Vec::new();
    t.generations
        .iter()
        .map(|g| {
            let x = scale.x(g.t);
            let w = gen_label(g).chars().count() as f64 * GEN_CHAR_PX;
            let (a, b) = if gen_label_runs_left(x) {
                (x - 2.0 - w, x - 2.0)
            } else {
                (x + 2.0, x + 2.0 + w)
            };
            let row = (0..)
                .find(|&row| {
                    !taken.iter().any(|&(c, r, a2, b2)| {
                        c == g.cluster && r == row && a < b2 + 4.0 && a2 < b + 4.0
                    })
                })
                .expect("a free row");
            taken.push((g.cluster, row, a, b));
            row
        })
        .collect()
}

/// The page's script: show a hovered element's `<title>` at once; zoom and pan the lanes'
/// time (wheel, drag, double-click to reset) by scaling the `.tz` groups horizontally
/// while their text and marks (`data-x`) keep their size; and say on `<body>` that the
/// page loaded (with what it holds) or which error it hit.
const SCRIPT: &str = r#"window.onerror = function (m) { document.body.setAttribute('data-error', String(m)); };
(function () {
  var tip = document.getElementById('tip');
  var svg = document.getElementById('timeline');
  svg.addEventListener('mousemove', function (e) {
    var el = e.target;
    while (el && el !== svg && !(el.firstElementChild && el.firstElementChild.tagName === 'title')) el = el.parentNode;
    if (!el || el === svg) { tip.style.display = 'none'; return; }
    tip.textContent = el.firstElementChild.textContent;
    tip.style.left = Math.max(0, Math.min(e.clientX + 14, window.innerWidth - 420)) + 'px';
    tip.style.top = (e.clientY + 14) + 'px';
    tip.style.display = 'block';
  });
  svg.addEventListener('mouseleave', function () { tip.style.display = 'none'; });

  var X = Number(svg.getAttribute('data-plot-x')), W = Number(svg.getAttribute('data-plot-w'));
  var zs = svg.querySelectorAll('.tz'), fixed = svg.querySelectorAll('.tz [data-x]');
  var v0 = X, vw = W;
  function view(a, w) {
    vw = Math.min(W, Math.max(W / 2000, w));
    v0 = Math.min(X + W - vw, Math.max(X, a));
    var k = W / vw, m = 'matrix(' + k + ' 0 0 1 ' + (X - v0 * k) + ' 0)';
    for (var i = 0; i < zs.length; i++) zs[i].setAttribute('transform', m);
    for (var j = 0; j < fixed.length; j++) {
      var x = Number(fixed[j].getAttribute('data-x'));
      fixed[j].setAttribute('transform', 'matrix(' + 1 / k + ' 0 0 1 ' + (x - x / k) + ' 0)');
    }
    svg.setAttribute('data-zoom', k.toFixed(3));
    svg.setAttribute('data-view', v0.toFixed(1) + ' ' + vw.toFixed(1));
  }
  function userX(e) {
    var p = svg.createSVGPoint(); p.x = e.clientX; p.y = e.clientY;
    return p.matrixTransform(svg.getScreenCTM().inverse()).x;
  }
  svg.addEventListener('wheel', function (e) {
    var ux = userX(e);
    if (ux < X) return;
    e.preventDefault();
    var at = v0 + (ux - X) * vw / W, w = vw * Math.pow(1.0015, e.deltaY);
    view(at - (ux - X) * w / W, w);
  }, { passive: false });
  var drag = null;
  svg.addEventListener('mousedown', function (e) { drag = { x: userX(e), v0: v0 }; });
  window.addEventListener('mousemove', function (e) {
    if (drag) view(drag.v0 - (userX(e) - drag.x) * vw / W, vw);
  });
  window.addEventListener('mouseup', function () { drag = null; });
  svg.addEventListener('dblclick', function () { view(X, W); });
  view(X, W);

  var b = document.body;
  b.setAttribute('data-lanes', svg.querySelectorAll('g.lane').length);
  b.setAttribute('data-blocks', svg.querySelectorAll('.block').length);
  b.setAttribute('data-waits', svg.querySelectorAll('.wait').length);
  b.setAttribute('data-timeline', 'ok');
})();"#;

/// Per cluster: the share of the wall time its completed iterations took.
fn goodput(t: &Timeline) -> String {
    let wall_s = (t.end - t.start).max(1e-3);
    let parts: Vec<String> = t
        .useful
        .iter()
        .map(|(c, u)| {
            format!(
                "{}goodput {:.0}% ({} of {} in iterations it completed)",
                c.map(|c| format!("{c} cluster: ")).unwrap_or_default(),
                u / wall_s * 100.0,
                secs(*u),
                secs(wall_s)
            )
        })
        .collect();
    parts.join("; ")
}

fn summary(t: &Timeline, c: &Counts) -> String {
    let gens = t.generations.len();
    // Elastic mode: the membership changes, in a few words each.
    let changes: Vec<String> = t
        .generations
        .iter()
        .filter_map(|g| {
            let m = g.membership.as_ref()?;
            Some(format!(
                "{}generation {}: {}",
                g.cluster
                    .map(|c| format!("{c} cluster "))
                    .unwrap_or_default(),
                g.gen,
                m.short()
            ))
        })
        .collect();
    let changes = match changes.is_empty() {
        true => String::new(),
        false => format!("; membership changes: {}", changes.join(", ")),
    };
    let down: f64 = t.downtime.iter().map(|d| d.end - d.start).sum();
    let down = if t.downtime.is_empty() {
        String::new()
    } else {
        format!(
            "; {} of downtime between generations, drawn collapsed",
            secs(down)
        )
    };
    format!(
        "{}{down}{changes}. {}",
        goodput(t),
        summary_lanes(t, c, gens)
    )
}

fn summary_lanes(t: &Timeline, c: &Counts, gens: usize) -> String {
    format!(
        "{} lane(s), from {} to {} ({}); {} generation start(s); {} block(s) drawn{}. Hover a block for its phase, rank, host, start, duration and command log (relative to the log path). Hatched black: waiting at a barrier; hatched blue: waiting for the other cluster.",
        t.lanes.len(),
        wall(t.start),
        wall(t.end),
        secs(t.end - t.start),
        gens,
        c.blocks,
        if c.mixed > 0 {
            format!(
                ", {} of them mixed (blocks under {MIN_PX}px merged; hover for what they hold)",
                c.mixed
            )
        } else {
            String::new()
        }
    )
}

fn iteration_chart(
    svg: &mut String,
    y: f64,
    cluster: Option<&str>,
    stats: &[&super::model::IterStat],
    from_metrics: bool,
) -> f64 {
    let max = stats.iter().map(|s| s.total).fold(0.0, f64::max).max(1e-3);
    let n = stats.len().max(1) as f64;
    let slot = PLOT_W / n;
    let bar = (slot * 0.8).max(0.5);
    let top = y + 14.0;
    let _ = write!(
        svg,
        r#"<g id="iteration-times" data-cluster="{}"><text x="{MARGIN}" y="{:.1}" font-weight="bold">{}time per iteration (max {}; {})</text>"#,
        esc(cluster.unwrap_or("")),
        y + 10.0,
        esc(&cluster
            .map(|c| format!("{c} cluster: "))
            .unwrap_or_default()),
        secs(max),
        if from_metrics {
            "metrics.jsonl"
        } else {
            "rank 0's events"
        }
    );
    let _ = write!(
        svg,
        r##"<line x1="{LABEL_W}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#444"/>"##,
        LABEL_W + PLOT_W,
        top + CHART_H,
        top + CHART_H
    );
    for (i, s) in stats.iter().enumerate() {
        let x = LABEL_W + i as f64 * slot;
        let mut tip = format!("iteration {}: {}", s.iteration, secs(s.total));
        let mut yy = top + CHART_H;
        let mut rects = String::new();
        for (p, d) in &s.phases {
            if *d <= 0.0 {
                continue;
            }
            let _ = write!(tip, "\n{p} {}", secs(*d));
            let h = d / max * CHART_H;
            // Too thin to see: in the hover text only.
            if h < 0.2 {
                continue;
            }
            yy -= h;
            let _ = write!(
                rects,
                r#"<rect x="{x:.1}" y="{yy:.1}" width="{bar:.1}" height="{h:.1}" fill="{}"/>"#,
                colour(p)
            );
        }
        let _ = write!(
            svg,
            r#"<g class="iteration" data-iteration="{}"><title>{}</title>{rects}</g>"#,
            s.iteration,
            esc(&tip)
        );
    }
    if let (Some(f), Some(l)) = (stats.first(), stats.last()) {
        let _ = write!(
            svg,
            r#"<text x="{LABEL_W}" y="{:.1}" font-size="10">iteration {}</text><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">iteration {}</text>"#,
            top + CHART_H + 12.0,
            f.iteration,
            LABEL_W + PLOT_W,
            top + CHART_H + 12.0,
            l.iteration
        );
    }
    svg.push_str("</g>");
    top + CHART_H + 22.0
}

fn field_chart(
    svg: &mut String,
    y: f64,
    field: &str,
    stats: &[&super::model::IterStat],
    from_metrics: bool,
    from_splits: bool,
) -> f64 {
    let top = y + 14.0;
    if stats.is_empty() {
        let _ = write!(
            svg,
            r#"<text id="field" x="{MARGIN}" y="{:.1}">mean {}: no values ({})</text>"#,
            y + 10.0,
            esc(field),
            if from_metrics {
                format!("metrics.jsonl has no number under rollout/{field}_mean, nor the merged train splits under {field}")
            } else {
                format!("no metrics.jsonl, and no number under {field} in the merged train splits")
            }
        );
        return y + 22.0;
    }
    let values: Vec<f64> = stats.iter().filter_map(|s| s.value).collect();
    let (lo, hi) = values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(*v), b.max(*v))
        });
    let range = (hi - lo).max(1e-9);
    let n = stats.len() as f64;
    let slot = PLOT_W / n;
    let h = CHART_H * 0.7;
    let _ = write!(
        svg,
        r#"<g id="field" data-field="{}"><text x="{MARGIN}" y="{:.1}" font-weight="bold">mean {} per iteration ({} … {}; {})</text>"#,
        esc(field),
        y + 10.0,
        esc(field),
        fmt_num(lo),
        fmt_num(hi),
        if from_splits {
            "from the merged train splits where metrics.jsonl has none"
        } else {
            "metrics.jsonl"
        }
    );
    let mut points = String::new();
    for (i, s) in stats.iter().enumerate() {
        let v = s.value.unwrap_or(lo);
        let x = LABEL_W + (i as f64 + 0.5) * slot;
        let yy = top + h - (v - lo) / range * h;
        let _ = write!(points, "{x:.1},{yy:.1} ");
        if stats.len() <= 400 {
            let _ = write!(
                svg,
                r##"<circle class="value" cx="{x:.1}" cy="{yy:.1}" r="2.5" fill="#1f77b4"><title>{}iteration {}: mean {} {}</title></circle>"##,
                esc(&s
                    .cluster
                    .as_ref()
                    .map(|c| format!("{c} cluster, "))
                    .unwrap_or_default()),
                s.iteration,
                esc(field),
                fmt_num(v)
            );
        }
    }
    let _ = write!(
        svg,
        r##"<polyline points="{}" fill="none" stroke="#1f77b4" stroke-width="1.5"/></g>"##,
        points.trim_end()
    );
    top + h + 10.0
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 1000.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

fn legend(svg: &mut String, y: f64) -> f64 {
    svg.push_str(r#"<g id="legend">"#);
    let mut x = LABEL_W;
    let mut yy = y + 4.0;
    for p in ALL {
        let w = 16.0 + 6.5 * p.name().len() as f64;
        if x + w > LABEL_W + PLOT_W {
            x = LABEL_W;
            yy += 16.0;
        }
        let _ = write!(
            svg,
            r#"<rect x="{x:.1}" y="{yy:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            colour(p.name()),
            x + 13.0,
            yy + 9.0,
            p.name()
        );
        x += w;
    }
    yy += 16.0;
    let _ = write!(
        svg,
        r##"<rect x="{LABEL_W}" y="{yy:.1}" width="24" height="10" fill="url(#hatch)" stroke="#000" stroke-width="0.5"/><text x="{:.1}" y="{:.1}">barrier wait</text><line x1="{:.1}" x2="{:.1}" y1="{yy:.1}" y2="{:.1}" stroke="#d00" stroke-width="3"/><text x="{:.1}" y="{:.1}">failure</text><rect x="{:.1}" y="{yy:.1}" width="4" height="10" fill="#d00"/><text x="{:.1}" y="{:.1}">command failed</text><circle cx="{:.1}" cy="{:.1}" r="3" fill="#f90"/><text x="{:.1}" y="{:.1}">retry</text><path d="M{:.1} {:.1} l4 5 l-4 5 l-4 -5 z" fill="#06c"/><text x="{:.1}" y="{:.1}">server restart</text><rect x="{:.1}" y="{yy:.1}" width="4" height="10" fill="#555"/><text x="{:.1}" y="{:.1}">fenced / refused</text><path d="M{:.1} {yy:.1} l10 0 l-5 8 z" fill="#a0c"/><text x="{:.1}" y="{:.1}">hang report</text>"##,
        LABEL_W + 28.0,
        yy + 9.0,
        LABEL_W + 120.0,
        LABEL_W + 120.0,
        yy + 10.0,
        LABEL_W + 126.0,
        yy + 9.0,
        LABEL_W + 180.0,
        LABEL_W + 188.0,
        yy + 9.0,
        LABEL_W + 290.0,
        yy + 5.0,
        LABEL_W + 297.0,
        yy + 9.0,
        LABEL_W + 340.0,
        yy,
        LABEL_W + 348.0,
        yy + 9.0,
        LABEL_W + 440.0,
        LABEL_W + 448.0,
        yy + 9.0,
        LABEL_W + 560.0,
        LABEL_W + 573.0,
        yy + 9.0
    );
    let x = LABEL_W + 660.0;
    let _ = write!(
        svg,
        r##"<g id="legend-more"><rect x="{x:.1}" y="{yy:.1}" width="24" height="10" fill="url(#hatch-pipeline)" stroke="#000" stroke-width="0.5"/><text x="{:.1}" y="{:.1}">waiting for the other cluster</text><rect x="{:.1}" y="{yy:.1}" width="24" height="10" fill="#e0e0e0"/><text x="{:.1}" y="{:.1}">downtime (collapsed)</text></g>"##,
        x + 28.0,
        yy + 9.0,
        x + 210.0,
        x + 238.0,
        yy + 9.0
    );
    svg.push_str("</g>");
    yy + 20.0
}

/// A time axis with round steps, in seconds since the first thing drawn (none inside a
/// collapsed downtime).
fn axis(svg: &mut String, y: f64, t: &Timeline, scale: &Scale) -> f64 {
    let span = (t.end - t.start).max(1e-3);
    let raw = span / 10.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let _ = write!(
        svg,
        r#"<g id="axis"><text x="{MARGIN}" y="{:.1}">seconds from the start</text><g clip-path="url(#plot)"><g class="tz">"#,
        y + 10.0,
    );
    let mut s = 0.0;
    while s <= span + 1e-9 {
        if !scale.collapsed(t.start + s) {
            let x = scale.x(t.start + s);
            // Labels at the ends of the lanes stay inside them.
            let anchor = if x < LABEL_W + 20.0 {
                "start"
            } else if x > LABEL_W + PLOT_W - 20.0 {
                "end"
            } else {
                "middle"
            };
            let _ = write!(
                svg,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="#999" vector-effect="non-scaling-stroke"/><text data-x="{x:.1}" x="{x:.1}" y="{:.1}" font-size="10" text-anchor="{anchor}">{}</text>"##,
                y + 12.0,
                y + 18.0,
                y + 10.0,
                fmt_num(s)
            );
        }
        s += step;
    }
    svg.push_str("</g></g></g>");
    y + 36.0
}

/// A run of consecutive narrow blocks of one lane, drawn as one.
struct Group {
    x0: f64,
    x1: f64,
    t0: f64,
    t1: f64,
    /// Time per phase, and how many blocks.
    time: BTreeMap<&'static str, f64>,
    n: usize,
    iterations: (u64, u64),
    /// Barrier waits too narrow to draw that began in the group's time.
    waited: f64,
    waits: usize,
}

impl Group {
    fn new(x0: f64, t0: f64, iteration: u64) -> Group {
        Group {
            x0,
            x1: x0,
            t0,
            t1: t0,
            time: BTreeMap::new(),
            n: 0,
            iterations: (iteration, iteration),
            waited: 0.0,
            waits: 0,
        }
    }

    fn add(&mut self, x1: f64, t1: f64, phase: &'static str, d: f64, iteration: u64) {
        self.x1 = self.x1.max(x1);
        self.t1 = self.t1.max(t1);
        *self.time.entry(phase).or_default() += d;
        self.n += 1;
        self.iterations.0 = self.iterations.0.min(iteration);
        self.iterations.1 = self.iterations.1.max(iteration);
    }

    fn dominant(&self) -> &str {
        self.time
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or("", |(k, _)| k)
    }

    /// The hover text: short, as a large run has tens of thousands of these.
    fn describe(&self, who: &str) -> String {
        let total: f64 = self.time.values().sum::<f64>().max(1e-9);
        let mut parts: Vec<(&&str, &f64)> = self.time.iter().collect();
        parts.sort_by(|a, b| b.1.total_cmp(a.1));
        let its = if self.iterations.0 == self.iterations.1 {
            format!("iteration {}", self.iterations.0)
        } else {
            format!("iterations {}–{}", self.iterations.0, self.iterations.1)
        };
        let list: Vec<String> = parts
            .iter()
            .take(3)
            .map(|(k, v)| format!("{k} {:.0}%", **v / total * 100.0))
            .collect();
        let mut s = format!(
            "{who} · {its} · {} blocks, {}: {}",
            self.n,
            secs(total),
            list.join(", ")
        );
        if self.waits > 0 {
            let _ = write!(
                s,
                "; {} barrier waits {:.0}%",
                self.waits,
                self.waited / total * 100.0
            );
        }
        s
    }
}

/// A row under a cluster's lanes for each failure that stopped a generation, its message
/// written from where it happened: the text never covers a block. Returns the next y.
fn failure_rows(svg: &mut String, lanes: &[Lane], mut y: f64, scale: &Scale) -> f64 {
    for lane in lanes {
        for m in lane.marks.iter().filter(|m| m.kind == MarkKind::Failure) {
            let x = scale.x(m.t);
            let right = x > LABEL_W + PLOT_W / 2.0;
            let _ = write!(
                svg,
                r##"<g class="failure-text" data-rank="{}" data-gen="{}"><title>{}</title><g clip-path="url(#plot)"><g class="tz"><text data-x="{x:.1}" x="{:.1}" y="{:.1}" text-anchor="{}" fill="#d00" font-weight="bold">{}</text><line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="#d00" stroke-width="1" stroke-dasharray="2 2" vector-effect="non-scaling-stroke"/></g></g></g>"##,
                lane.rank,
                m.gen,
                esc(&format!(
                    "{} · generation {} · {}\n{}",
                    lane.label(),
                    m.gen,
                    wall(m.t),
                    m.text
                )),
                if right { x - 4.0 } else { x + 4.0 },
                y + 12.0,
                if right { "end" } else { "start" },
                esc(&format!("{}: {}", lane.label(), short(&m.text, 110))),
                y - LANE_GAP,
                y + 14.0
            );
            y += LANE_H + LANE_GAP;
        }
    }
    y
}

/// Each collapsed downtime: a grey band across the lanes, labelled with its length.
fn downtime(svg: &mut String, t: &Timeline, scale: &Scale, top: f64, bottom: f64) {
    let _ = write!(
        svg,
        r#"<g clip-path="url(#plot)"><g class="tz" id="downtime">"#
    );
    for d in &t.downtime {
        let (x0, x1) = (scale.x(d.start), scale.x(d.end));
        let gens: Vec<String> = d.gens.iter().map(|g| g.to_string()).collect();
        let tip = format!(
            "downtime {}: nothing ran from {} to {}; generation {} began after it (drawn {DOWNTIME_PX}px wide, not to scale)\n{}",
            secs(d.end - d.start),
            wall(d.start),
            wall(d.end),
            gens.join(", "),
            goodput(t)
        );
        let mid = (x0 + x1) / 2.0;
        let _ = write!(
            svg,
            r##"<g class="downtime" data-secs="{:.3}"><title>{}</title><rect x="{x0:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="#e0e0e0"/><path d="M{:.1} {top:.1} l4 6 l-8 6 l8 6 l-8 6 l4 6" fill="none" stroke="#888" vector-effect="non-scaling-stroke"/><text data-x="{mid:.1}" x="{mid:.1}" y="{:.1}" font-size="10" text-anchor="middle">downtime</text><text data-x="{mid:.1}" x="{mid:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text></g>"##,
            d.end - d.start,
            esc(&tip),
            x1 - x0,
            bottom - top,
            mid,
            top + 44.0,
            top + 56.0,
            secs(d.end - d.start)
        );
    }
    svg.push_str("</g></g>");
}

fn draw_lane(svg: &mut String, lane: &Lane, y: f64, scale: &Scale, counts: &mut Counts) {
    // The lane's elements are placed relative to its top (a `translate`).
    let who = lane.label();
    let label = format!(
        "{who} · {}{}",
        short(&lane.host, 18),
        lane.state
            .as_ref()
            .map(|s| format!(" · {s}"))
            .unwrap_or_default()
    );
    // A label longer than its column (a long host, `stopped by a peer`) is squeezed to
    // fit rather than run under the lane.
    let room = LABEL_W - MARGIN - 6.0;
    let fit = if label.chars().count() as f64 * LABEL_CHAR_PX > room {
        format!(r#" textLength="{room:.0}" lengthAdjust="spacingAndGlyphs""#)
    } else {
        String::new()
    };
    let _ = write!(
        svg,
        r#"<g class="lane" data-lane="{}" data-rank="{}" data-cluster="{}" data-state="{}" transform="translate(0 {y:.1})"><text x="{MARGIN}" y="12"{fit}>{}</text>"#,
        esc(&who),
        lane.rank,
        lane.cluster.unwrap_or(""),
        esc(lane.state.as_deref().unwrap_or("")),
        esc(&label)
    );
    let _ = write!(
        svg,
        r##"<rect x="{LABEL_W}" width="{PLOT_W}" height="{LANE_H}" fill="#f4f4f4"/><g clip-path="url(#plot)"><g class="tz">"##
    );
    draw_absent(svg, lane, scale);
    // Phase blocks; narrow ones merged into mixed blocks, with the narrow barrier waits
    // of their stretch of time summed up in the same hover text (and hatched in
    // proportion), so that a large run's page stays small.
    let (wide, mut narrow): (Vec<&Wait>, Vec<&Wait>) = lane
        .waits
        .iter()
        .filter(|w| w.end > w.start)
        .partition(|w| (w.end - w.start) * scale.px_per_s >= MIN_PX);
    narrow.sort_by(|a, b| a.start.total_cmp(&b.start));
    let mut narrow = narrow.into_iter().peekable();
    let mut group: Option<Group> = None;
    let mut flush = |svg: &mut String, mut g: Group, counts: &mut Counts| {
        // The narrow waits that began within the group's time.
        while let Some(w) = narrow.next_if(|w| w.start < g.t1) {
            if w.start >= g.t0 {
                g.waited += w.end - w.start;
                g.waits += 1;
            }
        }
        let width = (g.x1 - g.x0).max(MIN_PX);
        let _ = write!(
            svg,
            r#"<rect class="block mixed" data-n="{}" x="{:.1}" width="{width:.1}" height="{LANE_H}" fill="{}"><title>{}</title></rect>"#,
            g.n,
            g.x0,
            colour(g.dominant()),
            esc(&g.describe(&who))
        );
        let f = (g.waited / (g.t1 - g.t0).max(1e-9)).min(1.0);
        if f >= 0.1 {
            let _ = write!(
                svg,
                r#"<rect class="wait mixed" x="{:.1}" y="{:.1}" width="{width:.1}" height="{:.1}" fill="url(#hatch)" pointer-events="none"/>"#,
                g.x0,
                LANE_H * (1.0 - f),
                LANE_H * f
            );
            counts.waits += 1;
        }
        counts.blocks += 1;
        counts.mixed += 1;
    };
    for b in &lane.blocks {
        let (x0, x1) = (scale.x(b.start), scale.x(b.end));
        if x1 - x0 >= MIN_PX {
            if let Some(g) = group.take() {
                flush(svg, g, counts);
            }
            draw_block(svg, lane, b, x0, x1, scale);
            counts.blocks += 1;
            continue;
        }
        if let Some(g) = &group {
            if x0 - g.x1 > MIN_PX || g.x1 - g.x0 >= GROUP_PX {
                flush(svg, group.take().expect("a group"), counts);
            }
        }
        let g = group.get_or_insert_with(|| Group::new(x0, b.start, b.iteration));
        g.add(x1, b.end, b.phase.name(), b.end - b.start, b.iteration);
    }
    if let Some(g) = group.take() {
        flush(svg, g, counts);
    }
    // Barrier waits wide enough to see, hatched over the blocks.
    for w in wide {
        draw_wait(svg, lane, w, scale.x(w.start), scale.x(w.end));
        counts.waits += 1;
    }

    // Marks: those of one kind within a few pixels of each other are drawn as one.
    let mut marks: Vec<&Mark> = lane.marks.iter().collect();
    marks.sort_by(|a, b| a.kind.cmp(&b.kind).then(a.t.total_cmp(&b.t)));
    let mut i = 0;
    while i < marks.len() {
        let first = marks[i];
        let x = scale.x(first.t);
        let mut j = i + 1;
        while j < marks.len() && marks[j].kind == first.kind && scale.x(marks[j].t) - x < GROUP_PX {
            j += 1;
        }
        draw_mark(svg, lane, &marks[i..j], x, 0.0);
        counts.marks += 1;
        i = j;
    }
    svg.push_str("</g></g></g>");
}

/// Elastic mode: where the rank was no member, its lane ends (a bar in the membership
/// colour), is left blank, and resumes where a generation took it back.
fn draw_absent(svg: &mut String, lane: &Lane, scale: &Scale) {
    for a in &lane.absent {
        let x0 = scale.x(a.from);
        let x1 = a.until.map_or(LABEL_W + PLOT_W, |t| scale.x(t)).max(x0);
        let tip = format!(
            "{} · not a member from generation {} ({})\ndropped: {}\n{}",
            lane.label(),
            a.dropped_from,
            wall(a.from),
            a.why,
            match (a.back_in, a.until) {
                (Some(g), Some(t)) => format!("back in generation {g} ({})", wall(t)),
                _ => "not back since".to_string(),
            }
        );
        let _ = write!(
            svg,
            r##"<g class="absent" data-from-gen="{}" data-back-gen="{}"><title>{}</title><rect x="{x0:.1}" width="{:.1}" height="{LANE_H}" fill="#ffffff"/><line class="lane-end" x1="{x0:.1}" x2="{x0:.1}" y1="0" y2="{LANE_H}" stroke="{MEMBERSHIP}" stroke-width="3" vector-effect="non-scaling-stroke"/>"##,
            a.dropped_from,
            a.back_in.map(|g| g.to_string()).unwrap_or_default(),
            esc(&tip),
            x1 - x0,
        );
        // Said in the lane too, where it fits.
        let say = format!("not a member: dropped ({})", a.why);
        if say.chars().count() as f64 * GEN_CHAR_PX + 10.0 < x1 - x0 {
            let _ = write!(
                svg,
                r#"<text data-x="{:.1}" x="{:.1}" y="12" font-size="10" fill="{MEMBERSHIP}">{}</text>"#,
                x0 + 6.0,
                x0 + 6.0,
                esc(&say)
            );
        }
        if a.until.is_some() {
            let _ = write!(
                svg,
                r##"<line class="lane-resume" x1="{x1:.1}" x2="{x1:.1}" y1="0" y2="{LANE_H}" stroke="{MEMBERSHIP}" stroke-width="1.5" stroke-dasharray="2 2" vector-effect="non-scaling-stroke"/>"##
            );
        }
        svg.push_str("</g>");
    }
}

fn draw_block(svg: &mut String, lane: &Lane, b: &Block, x0: f64, x1: f64, scale: &Scale) {
    let mut tip = format!(
        "{} · {} · iteration {} · generation {}\nhost {}\nstart {} (+{})\nduration {}{}",
        b.phase.name(),
        lane.label(),
        b.iteration,
        b.gen,
        b.host,
        wall(b.start),
        secs(b.start - scale.t0),
        secs(b.end - b.start),
        if b.open {
            " (open: no later event; the rank was still in it at its last write, or stopped in it)"
        } else {
            ""
        }
    );
    if let Some(l) = &b.log {
        let _ = write!(tip, "\nlog: {l}");
    }
    for n in &b.notes {
        let _ = write!(tip, "\n{n}");
    }
    let _ = write!(
        svg,
        r#"<rect class="block{}" data-phase="{}" data-iteration="{}" data-gen="{}" x="{x0:.1}" width="{:.1}" height="{LANE_H}" fill="{}"><title>{}</title></rect>"#,
        if b.open { " open" } else { "" },
        b.phase.name(),
        b.iteration,
        b.gen,
        x1 - x0,
        colour(b.phase.name()),
        esc(&tip)
    );
}

fn draw_wait(svg: &mut String, lane: &Lane, w: &Wait, x0: f64, x1: f64) {
    let tip = if w.pipeline {
        format!(
            "{} waited {} for {} (the other cluster; iteration {}, generation {}){}",
            lane.label(),
            secs(w.end - w.start),
            w.barrier,
            w.iteration,
            w.gen,
            if w.open {
                ", still waiting at its last write"
            } else {
                ""
            }
        )
    } else {
        barrier_tip(lane, w)
    };
    let waited: Vec<String> = w.waited_for.iter().map(|r| r.to_string()).collect();
    let dead: Vec<String> = w.dead.iter().map(|d| d.0.to_string()).collect();
    let _ = write!(
        svg,
        r##"<rect class="wait{}{}" data-barrier="{}" data-waited-for="{}" data-dead="{}" x="{x0:.1}" width="{:.1}" height="{LANE_H}" fill="url(#{})"><title>{}</title></rect>"##,
        if w.open { " open" } else { "" },
        if w.pipeline { " pipeline" } else { "" },
        esc(&w.barrier),
        waited.join(","),
        dead.join(","),
        x1 - x0,
        if w.pipeline {
            "hatch-pipeline"
        } else {
            "hatch"
        },
        esc(&tip)
    );
}

/// A barrier wait's hover text: how long, where, for whom, and which of them were dead.
fn barrier_tip(lane: &Lane, w: &Wait) -> String {
    let whom = if w.waited_for.is_empty() {
        if lane.rank == 0 {
            "nobody: it arrived last".to_string()
        } else {
            "rank 0's release (it arrived last)".to_string()
        }
    } else {
        let r: Vec<String> = w.waited_for.iter().map(|r| r.to_string()).collect();
        if w.open {
            format!("rank(s) {} (not arrived)", r.join(", "))
        } else {
            format!("rank(s) {} (arrived last)", r.join(", "))
        }
    };
    let mut tip = format!(
        "{} waited {} at barrier {} (iteration {}, generation {}){}\nwaiting for {whom}",
        lane.label(),
        secs(w.end - w.start),
        w.barrier,
        w.iteration,
        w.gen,
        if w.open {
            ", until its last write (still waiting, or stopped there)"
        } else {
            ""
        }
    );
    for (r, t) in &w.dead {
        let _ = write!(
            tip,
            "\nrank {r} is dead: its last sign of life was {} ({} before this wait's end)",
            wall(*t),
            secs((w.end - t).max(0.0))
        );
    }
    tip
}

fn draw_mark(svg: &mut String, lane: &Lane, marks: &[&Mark], x: f64, y: f64) {
    let kind = marks[0].kind;
    let mut tip = if marks.len() == 1 {
        format!(
            "{} · iteration {} · generation {} · {}\n{}",
            lane.label(),
            marks[0].iteration,
            marks[0].gen,
            wall(marks[0].t),
            marks[0].text
        )
    } else {
        format!("{} · {} marks:", lane.label(), marks.len())
    };
    if marks.len() > 1 {
        for m in marks.iter().take(5) {
            let _ = write!(
                tip,
                "\niteration {} (generation {}): {}",
                m.iteration, m.gen, m.text
            );
        }
        if marks.len() > 5 {
            let _ = write!(tip, "\n… and {} more", marks.len() - 5);
        }
    }
    let shape = match kind {
        // The message is in the failure rows under the lanes (`failure_rows`).
        MarkKind::Failure => format!(
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="#d00" stroke-width="3"/>"##,
            y - 2.0,
            y + LANE_H + 2.0,
        ),
        MarkKind::CommandFailed => format!(
            r##"<rect x="{:.1}" y="{y:.1}" width="4" height="{LANE_H}" fill="#d00"/>"##,
            x - 2.0
        ),
        MarkKind::Retry => format!(
            r##"<circle cx="{x:.1}" cy="{:.1}" r="3" fill="#f90" stroke="#000" stroke-width="0.5"/>"##,
            y + LANE_H / 2.0
        ),
        MarkKind::ServerRestart => format!(
            r##"<path d="M{x:.1} {:.1} l4 5 l-4 5 l-4 -5 z" fill="#06c"/>"##,
            y + 3.0
        ),
        MarkKind::Fenced => format!(
            r##"<rect x="{:.1}" y="{y:.1}" width="4" height="{LANE_H}" fill="#555"/>"##,
            x - 2.0
        ),
        // A downward triangle on the lane's top edge: look at this file.
        MarkKind::HangReport => format!(
            r##"<path d="M{:.1} {:.1} l10 0 l-5 8 z" fill="#a0c" stroke="#000" stroke-width="0.5"/>"##,
            x - 5.0,
            y - 1.0
        ),
    };
    let _ = write!(
        svg,
        r#"<g class="mark {}" data-count="{}" data-x="{x:.1}"><title>{}</title>{shape}</g>"#,
        kind.class(),
        marks.len(),
        esc(&tip)
    );
}

#[cfg(test)]
mod tests {
    use super::super::model::{GenStart, IterStat};
    use super::*;
    use crate::protocol::Phase;

    fn block(phase: Phase, iteration: u64, start: f64, end: f64) -> Block {
        Block {
            phase,
            gen: 1,
            iteration,
            host: "h<&>".into(),
            start,
            end,
            open: false,
            notes: vec!["rollout command: exit code 0 after 1.000s".into()],
            log: Some("logs/iter-0001/rank-0.rollout.log".into()),
        }
    }

    #[test]
    fn durations_of_minutes_carry_rounded_seconds_into_the_minute() {
        assert_eq!(secs(179.7), "3m00s");
        assert_eq!(secs(179.4), "2m59s");
        assert_eq!(secs(120.0), "2m00s");
        assert_eq!(secs(3725.2), "62m05s");
        assert_eq!(secs(12.34), "12.3s");
    }

    fn timeline(lanes: Vec<Lane>, end: f64) -> Timeline {
        Timeline {
            start: 0.0,
            end,
            lanes,
            generations: vec![GenStart {
                cluster: None,
                gen: 1,
                t: 0.0,
                previous: None,
                ended: None,
                membership: None,
            }],
            iterations: vec![IterStat {
                cluster: None,
                iteration: 1,
                total: 2.0,
                phases: vec![("train-rollout".into(), 1.5), ("training".into(), 0.5)],
                value: Some(0.5),
            }],
            field: "reward".into(),
            from_metrics: true,
            values_from_splits: false,
            downtime: vec![],
            useful: vec![(None, end / 2.0)],
        }
    }

    fn lane(blocks: Vec<Block>, marks: Vec<Mark>) -> Lane {
        Lane {
            cluster: None,
            rank: 0,
            host: "h<&>".into(),
            blocks,
            waits: vec![],
            marks,
            commands: vec![],
            instants: vec![],
            state: Some("done".into()),
            last_write: None,
            absent: vec![],
        }
    }

    fn svg(page: &str) -> &str {
        &page[page.find("<svg").unwrap()..page.find("</svg>").unwrap() + 6]
    }

    /// Text with markup characters in it (a host, a failure message) stays text.
    #[test]
    fn the_svg_is_well_formed_and_escapes_what_it_shows() {
        let mark = Mark {
            kind: MarkKind::Failure,
            t: 5.0,
            gen: 1,
            iteration: 1,
            text: r#"rank 0 failed: <exit "3"> & more"#.into(),
        };
        let t = timeline(
            vec![lane(
                vec![block(Phase::TrainRollout, 1, 0.0, 5.0)],
                vec![mark],
            )],
            10.0,
        );
        let (page, counts) = html(&t, "a <title> & more");
        let doc = roxmltree::Document::parse(svg(&page)).unwrap();
        assert_eq!((counts.lanes, counts.blocks, counts.mixed), (1, 1, 0));
        let failure = doc
            .descendants()
            .find(|n| n.attribute("class") == Some("mark failure"))
            .unwrap();
        let title = failure.first_element_child().unwrap().text().unwrap();
        assert!(
            title.ends_with(r#"rank 0 failed: <exit "3"> & more"#),
            "{title}"
        );
        let block = doc
            .descendants()
            .find(|n| n.attribute("class") == Some("block"))
            .unwrap();
        let title = block.first_element_child().unwrap().text().unwrap();
        assert!(title.contains("host h<&>"), "{title}");
        assert!(page.contains("<title>a &lt;title&gt; &amp; more</title>"));
    }

    /// 10,000 blocks of a tenth of a pixel: merged into mixed blocks of about GROUP_PX,
    /// which together stand for every one of them.
    #[test]
    fn narrow_blocks_are_merged_into_few_mixed_blocks() {
        let n = 10_000;
        let blocks: Vec<Block> = (0..n)
            .map(|i| {
                let p = if i % 2 == 0 {
                    Phase::TrainRollout
                } else {
                    Phase::Training
                };
                block(p, 1 + i as u64 / 14, i as f64, i as f64 + 1.0)
            })
            .collect();
        let t = timeline(vec![lane(blocks, vec![])], n as f64);
        let (page, counts) = html(&t, "big");
        let doc = roxmltree::Document::parse(svg(&page)).unwrap();
        let mixed: Vec<_> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("block mixed"))
            .collect();
        assert_eq!(mixed.len(), counts.mixed);
        assert!(
            mixed.len() <= (PLOT_W / GROUP_PX) as usize + 2,
            "{} mixed blocks",
            mixed.len()
        );
        assert!(mixed.len() >= (PLOT_W / (GROUP_PX + 1.0)) as usize);
        let merged: usize = mixed
            .iter()
            .map(|m| m.attribute("data-n").unwrap().parse::<usize>().unwrap())
            .sum();
        assert_eq!(merged, n);
        let title = mixed[0].first_element_child().unwrap().text().unwrap();
        assert!(
            title.contains("train-rollout 50%") && title.contains("training 50%"),
            "{title}"
        );
    }

    /// 100 s with 60 s of downtime in the middle: the downtime takes DOWNTIME_PX, the 40 s
    /// that ran share the rest, and x grows with time throughout.
    #[test]
    fn downtime_is_drawn_collapsed() {
        let mut t = timeline(vec![], 100.0);
        t.downtime = vec![super::super::model::Downtime {
            start: 20.0,
            end: 80.0,
            gens: vec![2],
        }];
        let s = Scale::new(&t);
        let per_s = (PLOT_W - DOWNTIME_PX) / 40.0;
        assert!((s.x(20.0) - (LABEL_W + 20.0 * per_s)).abs() < 1e-9);
        assert!((s.x(80.0) - s.x(20.0) - DOWNTIME_PX).abs() < 1e-9);
        assert!((s.x(100.0) - (LABEL_W + PLOT_W)).abs() < 1e-9);
        assert!(s.collapsed(50.0) && !s.collapsed(10.0) && !s.collapsed(90.0));
        let xs: Vec<f64> = (0..=100).map(|i| s.x(i as f64)).collect();
        assert!(xs.windows(2).all(|w| w[1] > w[0]));
    }

    /// A label too long for its column is squeezed into it; a short one is left alone.
    #[test]
    fn long_lane_labels_are_fitted_to_their_column() {
        let mut long = lane(vec![block(Phase::TrainRollout, 1, 0.0, 5.0)], vec![]);
        long.host = "a-very-long-host-name.cluster.example.org".into();
        long.state = Some("stopped by a peer".into());
        let short = lane(vec![block(Phase::TrainRollout, 1, 0.0, 5.0)], vec![]);
        let t = timeline(vec![long, short], 10.0);
        let (page, _) = html(&t, "labels");
        let doc = roxmltree::Document::parse(svg(&page)).unwrap();
        let labels: Vec<_> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("lane"))
            .map(|l| l.first_element_child().unwrap())
            .collect();
        assert_eq!(
            labels[0].attribute("textLength"),
            Some(format!("{:.0}", LABEL_W - MARGIN - 6.0).as_str())
        );
        assert!(labels[0].text().unwrap().ends_with(" · stopped by a peer"));
        assert_eq!(labels[1].attribute("textLength"), None);
    }

    /// Elastic mode: a generation whose members changed is drawn as a membership change
    /// naming who was dropped and who came back; the dropped rank's lane ends at the drop
    /// (a bar), is blank without membership, and resumes where it is back. The labels of
    /// two generations close in time go in two rows.
    #[test]
    fn a_membership_change_is_marked_and_a_dropped_lane_ends_and_resumes() {
        use super::super::model::{Absence, Membership};
        let mut l = lane(vec![block(Phase::TrainRollout, 1, 0.0, 40.0)], vec![]);
        l.absent = vec![Absence {
            from: 50.0,
            until: Some(60.0),
            dropped_from: 2,
            back_in: Some(3),
            why: "heartbeat still for 3.0s".into(),
        }];
        let mut t = timeline(vec![l], 100.0);
        let change = |gen: u64, t: f64, dropped: Vec<(u32, String)>, rejoined: Vec<u32>| GenStart {
            cluster: None,
            gen,
            t,
            previous: None,
            ended: None,
            membership: Some(Membership {
                members: if rejoined.is_empty() {
                    vec![1, 2]
                } else {
                    vec![0, 1, 2]
                },
                dropped,
                rejoined,
                regrouped: gen == 2,
            }),
        };
        t.generations.push(change(
            2,
            50.0,
            vec![(0, "heartbeat still for 3.0s".into())],
            vec![],
        ));
        t.generations.push(change(3, 60.0, vec![], vec![0]));
        let (page, _) = html(&t, "elastic");
        let doc = roxmltree::Document::parse(svg(&page)).unwrap();
        let changes: Vec<_> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("gen membership"))
            .collect();
        assert_eq!(changes.len(), 2);
        let text = |n: &roxmltree::Node| {
            n.descendants()
                .find(|c| c.has_tag_name("text"))
                .and_then(|c| c.text())
                .unwrap()
                .to_string()
        };
        assert_eq!(text(&changes[0]), "generation 2: rank 0 dropped");
        assert_eq!(changes[0].attribute("data-dropped"), Some("0"));
        assert_eq!(changes[0].attribute("data-members"), Some("1,2"));
        let tip = changes[0].first_element_child().unwrap().text().unwrap();
        assert!(
            tip.contains("rank 0 dropped: heartbeat still for 3.0s")
                && tip.contains("coordinator: rank 1")
                && tip.contains("formed by the members left"),
            "{tip}"
        );
        assert_eq!(text(&changes[1]), "generation 3: rank 0 back");
        assert_eq!(changes[1].attribute("data-rejoined"), Some("0"));
        // 10 s apart on a 100 s page: 140 px, less than a label; one row above the other.
        let y = |n: &roxmltree::Node| -> f64 {
            let t = n.descendants().find(|c| c.has_tag_name("text")).unwrap();
            t.attribute("y").unwrap().parse().unwrap()
        };
        assert!((y(&changes[0]) - y(&changes[1]) - GEN_ROW_H).abs() < 1e-9);
        // The lane: where it ends, blank, and where it resumes.
        let absent = doc
            .descendants()
            .find(|n| n.attribute("class") == Some("absent"))
            .unwrap();
        assert_eq!(absent.attribute("data-from-gen"), Some("2"));
        assert_eq!(absent.attribute("data-back-gen"), Some("3"));
        let line = |class: &str| -> f64 {
            let n = absent
                .descendants()
                .find(|n| n.attribute("class") == Some(class))
                .unwrap_or_else(|| panic!("no {class}"));
            n.attribute("x1").unwrap().parse().unwrap()
        };
        let s = Scale::new(&t);
        assert!((line("lane-end") - s.x(50.0)).abs() < 0.1);
        assert!((line("lane-resume") - s.x(60.0)).abs() < 0.1);
        let tip = absent.first_element_child().unwrap().text().unwrap();
        assert!(
            tip.contains("not a member from generation 2")
                && tip.contains("dropped: heartbeat still for 3.0s")
                && tip.contains("back in generation 3"),
            "{tip}"
        );
        assert!(page.contains(
            "membership changes: generation 2: rank 0 dropped, generation 3: rank 0 back"
        ));
    }
}
