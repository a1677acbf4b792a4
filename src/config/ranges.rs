//! The accepted range of every numeric and duration key, in one table ([`RANGES`]) that
//! `load` checks on the layered values, before a node writes anything.
//!
//! Why each key has one: a value far outside what any run needs used to pass the load and
//! fail later, after the run's state was written — a duration that overflows the clock
//! when a deadline is computed (a panic), a sample count whose plan cannot be allocated (an
//! abort). The bounds are wide for real runs and narrow enough that nothing computed from
//! them overflows: a duration is at most [`MAX_DURATION`], so a deadline (`Instant` plus a
//! few of them, or one doubled) stays far inside what `Instant` holds; counts that size an
//! allocation are bounded so that the allocation is (an iteration's plan holds at most
//! [`MAX_ITEMS`] items, see `validate`); iterations stay below [`MAX_ITERATION`] so that
//! their arithmetic never wraps. The defaults file states each range in the comment of its
//! key (a test checks it), so a user reads the range where the key is described.

use std::time::Duration;
use toml::Value;

/// The longest duration any key accepts: a year (365.25 days, humantime's `1year`). There
/// is no "no limit" value; a timeout of months is one in practice.
pub const MAX_DURATION: Duration = Duration::from_secs(31_557_600);

/// The most items (task samples) one iteration's plan may hold: `tasks-per-iteration` (or
/// every task of the file) × `samples-per-task`. Every node keeps the plan in memory, about
/// 60 bytes an item besides the task ids.
pub const MAX_ITEMS: u64 = 10_000_000;

/// The longest a per-task item waits before a retry, however often its delay doubled: so
/// `work.retry-backoff` is at most this too.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(300);

/// The largest iteration number (and iteration count) a key accepts.
pub const MAX_ITERATION: i64 = 1_000_000;

/// The shortest non-zero duration: finer waits are not something rl-node can honour.
const MS: Duration = Duration::from_millis(1);

/// What values a key accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Range {
    /// An integer from `min` to `max`.
    Int { min: i64, max: i64 },
    /// A list of integers, each from `min` to `max`; `each` names the i-th one in a
    /// message (`{i}` is replaced by its position, from 0).
    Ints {
        min: i64,
        max: i64,
        each: &'static str,
    },
    /// A number from `min` to `max`, or to below `max` when `below_max`.
    Number { min: f64, max: f64, below_max: bool },
    /// A duration (`"30s"`) from `min` to `max`.
    Duration { min: Duration, max: Duration },
    /// `word`, or a number (written as a string or an integer) from `min` to `max`.
    WordOrInt {
        word: &'static str,
        min: i64,
        max: i64,
    },
    /// `work.max-workers`: a number, or `"K/gpu"`, each from `min` to `max`.
    Workers { min: i64, max: i64 },
}

/// A key's range, and why it is that one (said when a value is refused).
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub key: &'static str,
    pub range: Range,
    /// After the limit in a message: `" nodes"` makes "the limit of 4096 nodes".
    pub unit: &'static str,
    /// Why, for a refused value; empty when the range says it all.
    pub why: &'static str,
}

const fn int(key: &'static str, min: i64, max: i64, why: &'static str) -> Bound {
    Bound {
        key,
        range: Range::Int { min, max },
        unit: "",
        why,
    }
}

const fn duration(key: &'static str, min: Duration, why: &'static str) -> Bound {
    Bound {
        key,
        range: Range::Duration {
            min,
            max: MAX_DURATION,
        },
        unit: "",
        why,
    }
}

/// A timeout or an interval that must be above zero.
const fn wait(key: &'static str) -> Bound {
    duration(key, MS, WAIT_WHY)
}

/// A grace or a delay: zero means none.
const fn delay(key: &'static str) -> Bound {
    duration(key, Duration::ZERO, "")
}

const WAIT_WHY: &str = "there is no \"no limit\" value: use a long duration such as \"30d\"";

/// Every numeric and duration key of `defaults.toml`, in its order.
pub const RANGES: &[Bound] = &[
    Bound {
        key: "cluster.num-nodes",
        range: Range::Int { min: 1, max: 4096 },
        unit: " nodes",
        why: "rank 0 writes a record per rank before anyone joins, and polls each one",
    },
    Bound {
        key: "cluster.rank-weights",
        range: Range::Ints {
            min: 1,
            max: 1_000_000,
            each: "the weight of rank {i}",
        },
        unit: "",
        why: "every weight must be a positive integer; only their ratios matter",
    },
    int("cluster.eval-interval", 0, MAX_ITERATION, ""),
    int("cluster.iterations", 0, MAX_ITERATION, ""),
    int("cluster.master-port", 1, 65535, "a TCP port"),
    Bound {
        key: "cluster.gpus-per-node",
        range: Range::WordOrInt {
            word: "auto",
            min: 1,
            max: 1024,
        },
        unit: "",
        why: "",
    },
    int(
        "cluster.first-iteration",
        1,
        MAX_ITERATION,
        "iterations are numbered from 1",
    ),
    int(
        "cluster.barrier-groups-from",
        0,
        4096,
        "a cluster has at most 4096 nodes",
    ),
    int(
        "cluster.min-nodes",
        0,
        4096,
        "a cluster has at most 4096 nodes; 0 means num-nodes",
    ),
    wait("timing.heartbeat-interval"),
    wait("timing.dead-after"),
    wait("timing.poll-interval"),
    wait("timing.join-timeout"),
    wait("timing.barrier-timeout"),
    delay("timing.kill-grace"),
    wait("timing.fs-timeout"),
    Bound {
        key: "timing.hang-report-at",
        range: Range::Number {
            min: 0.0,
            max: 1.0,
            below_max: true,
        },
        unit: "",
        why: "a fraction of a timeout (e.g. 0.5: a report at half of the timeout), or 0 or \"off\" for no reports",
    },
    int(
        "work.tasks-per-iteration",
        0,
        MAX_ITEMS as i64,
        "an iteration's plan holds each of its items in memory on every node",
    ),
    int(
        "work.samples-per-task",
        1,
        100_000,
        "an iteration's plan holds each of its items in memory on every node",
    ),
    int("work.seed", 0, i64::MAX, ""),
    Bound {
        key: "work.max-workers",
        range: Range::Workers { min: 1, max: 10_000 },
        unit: "",
        why: "items a node runs at once",
    },
    int("work.max-retries", 0, 100, ""),
    Bound {
        key: "work.retryable-exit-codes",
        range: Range::Ints {
            min: 1,
            max: 255,
            each: "the exit code at position {i}",
        },
        unit: "",
        why: "exit codes of a failed command are 1 to 255",
    },
    Bound {
        key: "work.retry-backoff",
        range: Range::Duration {
            min: Duration::ZERO,
            max: MAX_RETRY_DELAY,
        },
        unit: "",
        why: "a retry never waits longer than 5m, however often its delay doubled",
    },
    Bound {
        key: "work.max-failed-fraction",
        range: Range::Number {
            min: 0.0,
            max: 1.0,
            below_max: false,
        },
        unit: "",
        why: "a fraction of the items",
    },
    wait("phases.rollout.timeout"),
    wait("phases.rollout.workers-wait-timeout"),
    delay("phases.rollout.workers-delay"),
    wait("phases.eval.timeout"),
    wait("phases.eval.workers-wait-timeout"),
    delay("phases.eval.workers-delay"),
    wait("phases.aggregate.timeout"),
    wait("phases.prepare.timeout"),
    wait("phases.train.timeout"),
    wait("phases.handoff.timeout"),
    int("phases.handoff.keep-last", 0, MAX_ITERATION, ""),
    int(
        "pipeline.staleness",
        -1,
        100,
        "how many model versions rollouts may lag (0, 1, 2 …), or -1 for the synchronous loop",
    ),
    wait("pipeline.poll-interval"),
    wait("aggregate.timeout"),
    int("server.port", 1, 65535, "a TCP port"),
    wait("server.start-timeout"),
    int(
        "server.start-attempts",
        1,
        100,
        "1: one attempt, no retry",
    ),
    delay("server.start-retry-delay"),
    delay("server.stop-grace"),
    int("server.gpu-drain-mib", 0, 1 << 20, "MiB of GPU memory; 0: do not wait"),
    delay("server.gpu-drain-timeout"),
    int(
        "limits.journal-mib",
        *crate::config::Limits::RANGE_MIB.start() as i64,
        *crate::config::Limits::RANGE_MIB.end() as i64,
        "MiB read of a journal or log at most",
    ),
    int(
        "limits.manifest-mib",
        *crate::config::Limits::RANGE_MIB.start() as i64,
        *crate::config::Limits::RANGE_MIB.end() as i64,
        "MiB read of a manifest at most",
    ),
];

/// A duration as written in the configuration ("500ms", "30s", "10m", "4h").
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| {
        format!("invalid duration `{s}` ({e}); write it like \"500ms\", \"30s\", \"10m\" or \"4h\"")
    })
}

fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

impl Range {
    /// The range as the defaults file and messages write it, e.g. `1 to 4096`,
    /// `1ms to 1year`.
    pub fn text(&self) -> String {
        match *self {
            Range::Int { min, max } | Range::Ints { min, max, .. } => format!("{min} to {max}"),
            Range::Number {
                min,
                max,
                below_max,
            } => {
                format!("{min} to {}{max}", if below_max { "below " } else { "" })
            }
            Range::Duration { min, max } => format!("{} to {}", show(min), show(max)),
            Range::WordOrInt { word, min, max } => format!("\"{word}\" or {min} to {max}"),
            Range::Workers { min, max } => {
                format!("{min} to {max}, or \"K/gpu\" with K from {min} to {max}")
            }
        }
    }
}

/// Where a refused value falls.
#[derive(Debug, Clone, Copy)]
enum Side {
    /// A zero duration where the least is above zero: "greater than zero" says why.
    Zero,
    Below,
    Above,
}

impl Side {
    fn of(below: bool) -> Side {
        if below {
            Side::Below
        } else {
            Side::Above
        }
    }
}

impl Bound {
    /// Check the layered value of the key. A value of another type passes: the typed
    /// deserialisation that follows reports it.
    pub fn check(&self, v: &Value) -> Result<(), String> {
        let int_in = |n: i64, min: i64, max: i64| (min..=max).contains(&n);
        match (self.range, v) {
            (Range::Int { min, max }, Value::Integer(n)) if !int_in(*n, min, max) => {
                Err(self.refuse(&n.to_string(), Side::of(*n < min), false))
            }
            (Range::Ints { min, max, each }, Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    if let Value::Integer(n) = item {
                        if !int_in(*n, min, max) {
                            let subject = format!("{} is {n}", each.replace("{i}", &i.to_string()));
                            return Err(self.refuse(&subject, Side::of(*n < min), true));
                        }
                    }
                }
                Ok(())
            }
            (
                Range::Number {
                    min,
                    max,
                    below_max,
                },
                Value::Float(x),
            ) => {
                let inside = *x >= min && if below_max { *x < max } else { *x <= max };
                match inside {
                    true => Ok(()),
                    false => Err(self.refuse(&x.to_string(), Side::of(*x < min), false)),
                }
            }
            (Range::Duration { min, max }, Value::String(s)) => {
                let d = parse_duration(s)?;
                match d < min || d > max {
                    true if d.is_zero() => Err(self.refuse(s, Side::Zero, false)),
                    true => Err(self.refuse(s, Side::of(d < min), false)),
                    false => Ok(()),
                }
            }
            (Range::WordOrInt { word, min, max }, Value::String(s)) => {
                let s = s.trim();
                if s == word {
                    return Ok(());
                }
                match s.parse::<i64>() {
                    Ok(n) if int_in(n, min, max) => Ok(()),
                    Ok(n) => Err(self.refuse(s, Side::of(n < min), false)),
                    Err(_) => Err(format!(
                        "`{s}` is neither \"{word}\" nor a number (range: {})",
                        self.range.text()
                    )),
                }
            }
            (Range::Workers { min, max }, Value::Integer(n)) if !int_in(*n, min, max) => {
                Err(self.refuse(&n.to_string(), Side::of(*n < min), false))
            }
            (Range::Workers { min, max }, Value::String(s)) => {
                let k = s
                    .trim()
                    .strip_suffix("/gpu")
                    .and_then(|k| k.trim().parse::<i64>().ok());
                match k {
                    Some(k) if !int_in(k, min, max) => {
                        Err(self.refuse(s, Side::of(k < min), false))
                    }
                    _ => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// The message for a refused value: `shown` (the value, or for a list "the weight of
    /// rank 1 is 0"), which side of the range it falls on, the range and why.
    fn refuse(&self, shown: &str, side: Side, list: bool) -> String {
        let unit = self.unit;
        let (min, max) = match self.range {
            Range::Int { min, max }
            | Range::Ints { min, max, .. }
            | Range::WordOrInt { min, max, .. }
            | Range::Workers { min, max } => (min.to_string(), max.to_string()),
            Range::Number { min, max, .. } => (min.to_string(), max.to_string()),
            Range::Duration { min, max } => (show(min), show(max)),
        };
        let sep = if list { "," } else { " is" };
        let what = match side {
            Side::Zero => format!("{shown}{sep} out of range: it must be greater than zero"),
            Side::Below => format!("{shown}{sep} out of range: it must be at least {min}{unit}"),
            Side::Above => format!("{shown}{sep} above the limit of {max}{unit}"),
        };
        let why = match self.why {
            "" => String::new(),
            why => format!("; {why}"),
        };
        format!("{what} (range: {}){why}", self.range.text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(key: &str) -> Option<&'static Bound> {
        RANGES.iter().find(|b| b.key == key)
    }

    fn check(key: &str, v: Value) -> Result<(), String> {
        bound(key).expect("a bound").check(&v)
    }

    fn s(text: &str) -> Value {
        Value::String(text.into())
    }

    #[test]
    fn integers_are_checked_at_both_ends_naming_value_and_range() {
        assert!(check("work.samples-per-task", Value::Integer(1)).is_ok());
        assert!(check("work.samples-per-task", Value::Integer(100_000)).is_ok());
        let e = check("work.samples-per-task", Value::Integer(4_294_967_295)).unwrap_err();
        assert!(
            e.starts_with("4294967295 is above the limit of 100000 (range: 1 to 100000); "),
            "{e}"
        );
        let e = check("work.samples-per-task", Value::Integer(0)).unwrap_err();
        assert!(
            e.starts_with("0 is out of range: it must be at least 1 (range: 1 to 100000)"),
            "{e}"
        );
        let e = check("cluster.num-nodes", Value::Integer(5000)).unwrap_err();
        assert!(
            e.starts_with("5000 is above the limit of 4096 nodes (range: 1 to 4096)"),
            "{e}"
        );
        assert!(check("pipeline.staleness", Value::Integer(-1)).is_ok());
        assert!(check("pipeline.staleness", Value::Integer(-2)).is_err());
        assert!(check("cluster.master-port", Value::Integer(0)).is_err());
        assert!(check("cluster.master-port", Value::Integer(65536)).is_err());
        assert!(check("cluster.master-port", Value::Integer(65535)).is_ok());
        assert!(check("work.seed", Value::Integer(-1)).is_err());
        assert!(check("work.seed", Value::Integer(i64::MAX)).is_ok());
        // Another type is left to the typed deserialisation, which names it.
        assert!(check("work.samples-per-task", s("many")).is_ok());
    }

    #[test]
    fn durations_are_at_most_a_year_and_above_zero_where_zero_means_nothing() {
        assert!(check("timing.barrier-timeout", s("1year")).is_ok());
        assert!(check("timing.barrier-timeout", s("365days")).is_ok());
        assert!(check("timing.barrier-timeout", s("1ms")).is_ok());
        let e = check("timing.barrier-timeout", s("400000000000years")).unwrap_err();
        assert!(
            e.starts_with("400000000000years is above the limit of 1year (range: 1ms to 1year)"),
            "{e}"
        );
        assert!(check("timing.barrier-timeout", s("366days")).is_err());
        let e = check("timing.fs-timeout", s("0s")).unwrap_err();
        assert!(e.contains("must be greater than zero"), "{e}");
        let e = check("timing.fs-timeout", s("500us")).unwrap_err();
        assert!(
            e.starts_with("500us is out of range: it must be at least 1ms"),
            "{e}"
        );
        // A grace or a delay may be zero.
        assert!(check("timing.kill-grace", s("0s")).is_ok());
        assert!(check("server.stop-grace", s("400000000000years")).is_err());
        // What humantime cannot read is reported as an invalid duration.
        let e = check("timing.dead-after", s("soon")).unwrap_err();
        assert!(e.starts_with("invalid duration `soon`"), "{e}");
        let e = check("timing.dead-after", s("600000000000years")).unwrap_err();
        assert!(e.starts_with("invalid duration `600000000000years`"), "{e}");
    }

    #[test]
    fn lists_name_the_element_at_fault() {
        let weights = |w: &[i64]| Value::Array(w.iter().map(|&n| Value::Integer(n)).collect());
        assert!(check("cluster.rank-weights", weights(&[])).is_ok());
        assert!(check("cluster.rank-weights", weights(&[2, 1, 1])).is_ok());
        let e = check("cluster.rank-weights", weights(&[1, -1, 1])).unwrap_err();
        assert!(
            e.starts_with("the weight of rank 1 is -1, out of range: it must be at least 1"),
            "{e}"
        );
        let e = check("cluster.rank-weights", weights(&[1, 1_000_001])).unwrap_err();
        assert!(
            e.starts_with("the weight of rank 1 is 1000001, above the limit of 1000000"),
            "{e}"
        );
        let e = check("work.retryable-exit-codes", weights(&[75, 256])).unwrap_err();
        assert!(
            e.starts_with("the exit code at position 1 is 256, above the limit of 255"),
            "{e}"
        );
        assert!(check("work.retryable-exit-codes", weights(&[0])).is_err());
    }

    #[test]
    fn numbers_words_and_worker_counts() {
        let f = |x: f64| Value::Float(x);
        assert!(check("timing.hang-report-at", f(0.0)).is_ok());
        assert!(check("timing.hang-report-at", f(0.99)).is_ok());
        for bad in [1.0, -0.1, f64::NAN, f64::INFINITY] {
            assert!(check("timing.hang-report-at", f(bad)).is_err(), "{bad}");
        }
        assert!(check("work.max-failed-fraction", f(1.0)).is_ok());
        assert!(check("work.max-failed-fraction", f(1.01)).is_err());
        assert!(check("cluster.gpus-per-node", s("auto")).is_ok());
        assert!(check("cluster.gpus-per-node", s("8")).is_ok());
        assert!(check("cluster.gpus-per-node", s("0")).is_err());
        assert!(check("cluster.gpus-per-node", s("4294967296")).is_err());
        let e = check("cluster.gpus-per-node", s("many")).unwrap_err();
        assert!(
            e.starts_with("`many` is neither \"auto\" nor a number"),
            "{e}"
        );
        assert!(check("work.max-workers", Value::Integer(10_000)).is_ok());
        assert!(check("work.max-workers", Value::Integer(10_001)).is_err());
        assert!(check("work.max-workers", s("4/gpu")).is_ok());
        let e = check("work.max-workers", s("0/gpu")).unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
        assert!(check("work.max-workers", s("20000/gpu")).is_err());
    }

    /// The defaults' keys, each with its default value.
    fn defaults() -> Vec<(String, Value)> {
        let defaults: Value = toml::from_str(super::super::DEFAULTS_TOML).unwrap();
        let mut keys = Vec::new();
        super::super::leaf_paths(&defaults, "", &mut keys);
        keys
    }

    /// Every key whose default is a number, a list of numbers or a duration has a range,
    /// every range is a key's, and every default is inside its range.
    #[test]
    fn the_table_covers_every_numeric_and_duration_key() {
        let keys = defaults();
        for (key, v) in &keys {
            let numeric = match v {
                Value::Integer(_) | Value::Float(_) => true,
                Value::String(s) => humantime::parse_duration(s).is_ok(),
                Value::Array(a) => a.iter().all(Value::is_integer),
                _ => false,
            };
            let is_list_of_text = matches!(
                key.as_str(),
                "phases.handoff.mutable" | "phases.handoff.exclude" | "observe.metrics-fields"
            );
            if numeric && !is_list_of_text {
                assert!(bound(key).is_some(), "{key} has no range");
            }
        }
        for b in RANGES {
            let (_, v) = keys
                .iter()
                .find(|(k, _)| k == b.key)
                .unwrap_or_else(|| panic!("{} is not a key", b.key));
            b.check(v)
                .unwrap_or_else(|e| panic!("the default of {}: {e}", b.key));
        }
        assert!(bound("cluster.gpus-per-node").is_some());
    }

    /// Each range is written in the comment of its key in `defaults.toml` (the comment
    /// block above it, over the keys it also describes), after "Range" or "Ranges".
    #[test]
    fn every_range_is_documented_in_the_defaults_file() {
        let lines: Vec<&str> = super::super::DEFAULTS_TOML.lines().collect();
        let mut section = String::new();
        let mut comments: Vec<(String, String)> = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            if let Some(s) = line.strip_prefix('[') {
                section = s.trim_end_matches(']').to_string();
                continue;
            }
            let Some((name, _)) = line.split_once(" = ") else {
                continue;
            };
            if line.starts_with('#') {
                continue;
            }
            // The comment above, over the keys it shares it with.
            let mut j = i;
            while j > 0 && !lines[j - 1].starts_with('#') && lines[j - 1].contains(" = ") {
                j -= 1;
            }
            let mut block = Vec::new();
            while j > 0 && lines[j - 1].starts_with('#') {
                j -= 1;
                block.push(lines[j]);
            }
            block.reverse();
            comments.push((format!("{section}.{}", name.trim()), block.join(" ")));
        }
        for b in RANGES {
            let (_, comment) = comments
                .iter()
                .find(|(k, _)| k == b.key)
                .unwrap_or_else(|| panic!("{} is not in defaults.toml", b.key));
            let want = b.range.text();
            let flat = comment.replace("# ", "").replace('#', "");
            assert!(
                flat.contains("Range") && flat.contains(&want),
                "the comment of {} does not give its range, {want}:\n{comment}",
                b.key
            );
        }
    }
}
