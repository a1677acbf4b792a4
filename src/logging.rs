//! A running node's log lines: `tracing` events with a level and the node's rank, on
//! stderr, each stamped with the date, the time to the millisecond and the UTC offset
//! (RFC 3339), so that the lines of nodes in other time zones, or a log read days later,
//! still say when. `--log-level` drops the lines below a level; `--log-format json` writes
//! one JSON object per line for log shippers.
//!
//! The text format keeps the shape people grep for: `<time> [rank R] warning: …`, the level
//! spelled out only for warnings, errors and debug lines. Only a node logs: what `status`,
//! `recover`, `show-config` and the demo print is a report, written as plain output, and
//! so is a node's final `error: …`/`hint: …` report in the text format. In the JSON format
//! that report is an event too, so that every line a node writes parses.
//!
//! A JSON line carries what the node is doing as fields of its own (`run`, `generation`,
//! `iteration`, `phase`, `host`: [`set_context`], which the node calls as its record
//! changes, so the final report has them too), a message's further lines as `details` and
//! a command's log tail as an array of lines: no value holds a newline. Each event the
//! node records is also a line, its kind in `event` beside the event's own fields.
//!
//! The writer goes through [`crate::output`]: a closed stderr loses the lines, never the
//! node, and a control character in a line (from a peer's host name, an abort reason) is
//! escaped there, in the text and the JSON format alike.

use std::fmt::{self, Write as _};
use std::sync::{Mutex, OnceLock};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{ChronoLocal, FormatTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// The environment variables that set `--log-level` and `--log-format` (the flags win).
pub const LEVEL_ENV: &str = "RL_NODE_LOG_LEVEL";
pub const FORMAT_ENV: &str = "RL_NODE_LOG_FORMAT";

/// RFC 3339 with milliseconds and the offset: `2026-11-23T11:52:12.123+01:00`.
pub(crate) const TIMESTAMP: &str = "%Y-%m-%dT%H:%M:%S%.3f%:z";

/// The least severe lines a node prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
}

impl LogLevel {
    fn filter(self) -> LevelFilter {
        match self {
            LogLevel::Error => LevelFilter::ERROR,
            LogLevel::Warn => LevelFilter::WARN,
            LogLevel::Info => LevelFilter::INFO,
            LogLevel::Debug => LevelFilter::DEBUG,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `<time> [rank R] <message>`, for people
    Text,
    /// one JSON object per line (timestamp, level, rank, message, fields), for log shippers
    Json,
}

/// The flag's value, else the environment variable's, else `default`. A variable that is
/// set to anything else is an error naming it (the flag's own values clap checks).
pub fn resolve<T: clap::ValueEnum>(flag: Option<T>, var: &str, default: T) -> Result<T, String> {
    if let Some(v) = flag {
        return Ok(v);
    }
    let Some(raw) = std::env::var_os(var) else {
        return Ok(default);
    };
    let raw = raw.to_string_lossy();
    T::from_str(raw.trim(), true).map_err(|_| {
        let names: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|p| p.get_name().to_string())
            .collect();
        format!("{var}={raw}: expected one of {}", names.join(", "))
    })
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Install the process's subscriber (once; later calls do nothing).
pub fn init(level: LogLevel, format: LogFormat) {
    if FORMAT.set(format).is_err() {
        return;
    }
    let timer = ChronoLocal::new(TIMESTAMP.into());
    // Internal errors would be reported with eprintln!, which panics on a closed stderr.
    let builder = tracing_subscriber::fmt()
        .with_writer(Stderr)
        .with_max_level(level.filter())
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => {
            tracing::subscriber::set_global_default(builder.event_format(Text { timer }).finish())
        }
        LogFormat::Json => {
            tracing::subscriber::set_global_default(builder.event_format(Json { timer }).finish())
        }
    };
}

/// Whether this process logs JSON: then a node's reports are events too, and it draws no
/// progress bar.
pub fn json() -> bool {
    FORMAT.get() == Some(&LogFormat::Json)
}

/// What the node is doing, for the fields of its JSON lines.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Context {
    pub run: String,
    pub generation: u64,
    pub iteration: u64,
    pub phase: Option<&'static str>,
    pub host: String,
}

static CONTEXT: Mutex<Option<Context>> = Mutex::new(None);

/// The node's run, generation, iteration, phase and host from now on (JSON format only:
/// the text format's lines say them in words where they matter).
pub(crate) fn set_context(c: Context) {
    if json() {
        *CONTEXT.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
    }
}

/// An event the node records (`line`: its line of the event log, `event` its kind), as a
/// line of its own in the JSON format, with the event's fields.
pub(crate) fn event(rank: u32, line: &str) {
    if json() {
        tracing::info!(rank, event_line = line.trim_end());
    }
}

pub(crate) fn error(rank: u32, msg: &str) {
    tracing::error!(rank, "{msg}");
}

pub(crate) fn warn(rank: u32, msg: &str) {
    tracing::warn!(rank, "{msg}");
}

pub(crate) fn info(rank: u32, msg: &str) {
    tracing::info!(rank, "{msg}");
}

pub(crate) fn debug(rank: u32, msg: &str) {
    tracing::debug!(rank, "{msg}");
}

/// A command's failure as one event (for the JSON format): the hint and the failed
/// command's last log lines are fields of their own.
pub(crate) fn report(
    rank: Option<u32>,
    exit_code: i32,
    message: &str,
    hint: Option<&str>,
    log_tail: Option<&str>,
) {
    tracing::error!(rank, exit_code, hint, log_tail, "{message}");
}

/// A node's final word when it had nothing to do, as one event of information (it exits
/// 0, which the event says like a failure's says its code).
pub(crate) fn notice(rank: Option<u32>, message: &str, hint: Option<&str>) {
    let exit_code = crate::exit::Ending::Done.exit_code();
    tracing::info!(rank, exit_code, hint, "{message}");
}

/// Writes each formatted event with one call through [`crate::output`], ignoring errors.
#[derive(Clone, Copy)]
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::output::stderr_bytes(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = Stderr;

    fn make_writer(&'a self) -> Stderr {
        Stderr
    }
}

/// `<time> [rank R] <level: ><message>< key=value…>`.
struct Text {
    timer: ChronoLocal,
}

impl<S, N> FormatEvent<S, N> for Text
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        self.timer.format_time(&mut w)?;
        let mut fields = TextFields::default();
        event.record(&mut fields);
        if let Some(rank) = fields.rank {
            write!(w, " [rank {rank}]")?;
        }
        let level = match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            Level::DEBUG => "debug: ",
            Level::TRACE => "trace: ",
            _ => "",
        };
        writeln!(w, " {level}{}{}", fields.message, fields.rest)
    }
}

#[derive(Default)]
struct TextFields {
    rank: Option<u64>,
    message: String,
    rest: String,
}

impl Visit for TextFields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "rank" {
            self.rank = Some(value);
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }
}

/// One JSON object per line: `timestamp`, `level`, `message`, the event's fields, then the
/// node's context ([`set_context`]). No value holds a newline: a message's further lines
/// go to `details`, a log tail becomes an array of lines.
struct Json {
    timer: ChronoLocal,
}

impl<S, N> FormatEvent<S, N> for Json
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut stamp = String::new();
        self.timer.format_time(&mut Writer::new(&mut stamp))?;
        let mut fields = JsonFields::default();
        fields.put("timestamp", stamp.into());
        fields.put("level", event.metadata().level().as_str().into());
        event.record(&mut fields);
        let context = CONTEXT.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(c) = context {
            let mut put = |k: &str, v: serde_json::Value| {
                fields.0.entry(k).or_insert(v);
            };
            put("run", c.run.into());
            put("generation", c.generation.into());
            put("iteration", c.iteration.into());
            if let Some(p) = c.phase {
                put("phase", p.into());
            }
            put("host", c.host.into());
        }
        writeln!(w, "{}", serde_json::Value::Object(fields.0))
    }
}

#[derive(Default)]
struct JsonFields(serde_json::Map<String, serde_json::Value>);

impl JsonFields {
    fn put(&mut self, key: &str, value: serde_json::Value) {
        self.0.insert(key.to_string(), value);
    }

    /// Lines of `text`, without blank ones, each trimmed of the indentation that set it
    /// under the first.
    fn lines(text: &str) -> Vec<serde_json::Value> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(|l| l.into())
            .collect()
    }
}

impl Visit for JsonFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => {
                let (first, rest) = value.split_once('\n').unwrap_or((value, ""));
                self.put("message", first.into());
                let details = Self::lines(rest);
                if !details.is_empty() {
                    self.put("details", details.into());
                }
            }
            "log_tail" => self.put("log_tail", Self::lines(value).into()),
            // An event's line of the event log: its fields, its kind the message.
            "event_line" => {
                if let Ok(serde_json::Value::Object(m)) = serde_json::from_str(value) {
                    for (k, v) in m {
                        match k.as_str() {
                            "rank" | "t" => {}
                            "gen" => self.put("generation", v),
                            "event" => {
                                self.put("message", v.clone());
                                self.put("event", v);
                            }
                            _ => self.put(&k, v),
                        }
                    }
                }
            }
            name => self.put(name, value.into()),
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field.name(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field.name(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field.name(), value.into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}
