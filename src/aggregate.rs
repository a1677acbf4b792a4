//! Merging rank shards into one file per iteration and split.
//!
//! The built-in merge streams committed JSONL shards in rank order into a temporary file
//! and publishes it atomically, so memory stays flat whatever the size and a crash never
//! leaves a half-written merged file under the final name.

use std::fs::File;

/// `rl-node aggregate` (built by the partial-recovery work).
#[derive(clap::Args, Debug)]
pub struct AggregateArgs {}

pub fn main(_args: AggregateArgs, _log_path: Option<String>) -> i32 {
    eprintln!("error: rl-node aggregate is not built yet");
    crate::exit::FAILED
}
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub records: u64,
    pub bytes: u64,
}

/// Concatenate `shards` (in order) into `out`. Every shard must exist; a shard whose last
/// line lacks a newline gets one, so records never run together. `tick` is called
/// periodically so a long merge keeps the node's watchdog informed.
pub fn concat_jsonl(shards: &[PathBuf], out: &Path, tick: &mut dyn FnMut()) -> io::Result<Summary> {
    let dir = out.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        out.file_name().and_then(|s| s.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    let result = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        let mut summary = Summary::default();
        for shard in shards {
            let f = File::open(shard)
                .map_err(|e| io::Error::new(e.kind(), format!("shard {}: {e}", shard.display())))?;
            let mut r = BufReader::with_capacity(1 << 20, f);
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = r.read_until(b'\n', &mut line)?;
                if n == 0 {
                    break;
                }
                if line.iter().all(|b| b.is_ascii_whitespace()) {
                    continue;
                }
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                w.write_all(&line)?;
                summary.records += 1;
                summary.bytes += line.len() as u64;
                if summary.records % 65536 == 0 {
                    tick();
                }
            }
        }
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, out)?;
        crate::store::fsync_dir(dir)?;
        Ok(summary)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concatenates_in_order_and_fixes_missing_newline() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        let b = d.path().join("b");
        std::fs::write(&a, "{\"r\":0}\n{\"r\":1}").unwrap();
        std::fs::write(&b, "\n{\"r\":2}\n").unwrap();
        let out = d.path().join("out.jsonl");
        let s = concat_jsonl(&[a, b], &out, &mut || {}).unwrap();
        assert_eq!(s.records, 3);
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "{\"r\":0}\n{\"r\":1}\n{\"r\":2}\n"
        );
    }

    #[test]
    fn a_missing_shard_fails_without_touching_the_output() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out.jsonl");
        std::fs::write(&out, "old\n").unwrap();
        let e = concat_jsonl(&[d.path().join("nope")], &out, &mut || {}).unwrap_err();
        assert!(e.to_string().contains("nope"));
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "old\n");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
