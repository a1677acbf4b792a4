//! The doctor's small shared vocabulary: a check and its verdict, the mount it read, and
//! how it writes a duration in milliseconds. The single-node doctor (`doctor`), its cache
//! knowledge (`doctor_caches`) and its multi-node session (`doctor_nodes`) all speak it, so
//! it lives below them: each imports it and none imports another for it.

use serde::Serialize;
use std::time::Duration;

#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Verdict {
    Ok,
    Warn,
    Fail,
}

impl Verdict {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        }
    }
}

#[derive(Serialize, Debug)]
pub(crate) struct Check {
    pub(crate) name: &'static str,
    pub(crate) verdict: Verdict,
    /// What was measured.
    pub(crate) evidence: String,
    /// What to change, when the verdict is not ok.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) advice: Option<String>,
}

impl Check {
    pub(crate) fn ok(name: &'static str, evidence: String) -> Check {
        Check {
            name,
            verdict: Verdict::Ok,
            evidence,
            advice: None,
        }
    }
    pub(crate) fn not_ok(
        name: &'static str,
        verdict: Verdict,
        evidence: String,
        advice: String,
    ) -> Check {
        Check {
            name,
            verdict,
            evidence,
            advice: Some(advice),
        }
    }
}

/// The /proc/mounts line of the mount holding the directory.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct Mount {
    pub source: String,
    pub mount_point: String,
    pub fs_type: String,
    pub options: Vec<String>,
    /// A FUSE mount's caching options live in its daemon, not in /proc/mounts: the `-o`
    /// options of the daemon process on this host whose arguments name the mount point.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon: Option<FuseDaemon>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct FuseDaemon {
    pub pid: u32,
    pub options: Vec<String>,
}

impl Mount {
    /// The value of option `key=value`, or `Some("")` for a bare flag `key`.
    pub(crate) fn option(&self, key: &str) -> Option<&str> {
        let daemon = self.daemon.iter().flat_map(|d| d.options.iter());
        self.options
            .iter()
            .chain(daemon)
            .find_map(|o| match o.split_once('=') {
                Some((k, v)) if k == key => Some(v),
                None if o == key => Some(""),
                _ => None,
            })
    }
    pub(crate) fn secs(&self, key: &str) -> Option<f64> {
        self.option(key)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
    }
}

pub(crate) fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.2}ms")
    } else {
        format!("{ms:.0}ms")
    }
}
