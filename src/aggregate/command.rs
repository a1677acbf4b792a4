//! The `command` format: the available shards are hashed and handed, in rank order, to
//! the user's merge command (`crate::shards::command`), which writes the merged file and
//! reports records and unreadable inputs per rank.

use super::{unreadable, AggregateError, Extras, MergeOptions, RankEntry};
use super::{IO_BUF, TICK_BYTES};
use crate::layout::Layout;
use crate::shards::command;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, Read as _};
use std::path::{Path, PathBuf};

/// SHA-256 and size of a file, read in blocks.
fn hash_file(path: &Path, tick: &mut dyn FnMut()) -> io::Result<(u64, String)> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; IO_BUF];
    let mut n = 0u64;
    let mut since_tick = 0u64;
    loop {
        let k = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..k]);
        n += k as u64;
        since_tick += k as u64;
        if since_tick >= TICK_BYTES {
            since_tick = 0;
            tick();
        }
    }
    Ok((n, hex::encode(h.finalize())))
}

/// command: hash the available shards, hand them to the merge command in rank order, and
/// take in its report; the command wrote `tmp` (fsynced here).
pub(super) fn merge_command(
    layout: &Layout,
    iteration: u64,
    split: &str,
    ranks: &mut [RankEntry],
    opts: &MergeOptions,
    tmp: &Path,
    tick: &mut dyn FnMut(),
) -> Result<Extras, AggregateError> {
    let mut inputs = Vec::new();
    let mut input_ranks = Vec::new();
    let mut entry_of = Vec::new();
    for (i, e) in ranks.iter_mut().enumerate() {
        if !e.status.has_source() {
            continue;
        }
        tick();
        let path = e.source_path(layout.root());
        let (bytes, sha) = hash_file(&path, tick).map_err(|source| AggregateError::Read {
            rank: e.rank,
            path: path.clone(),
            source,
        })?;
        e.source_bytes = bytes;
        e.bytes = bytes;
        e.sha256 = Some(sha);
        inputs.push(path);
        input_ranks.push(e.rank);
        entry_of.push(i);
    }
    let mut report = tmp.as_os_str().to_os_string();
    report.push(".report.json");
    let job = command::Job {
        template: opts.command.clone(),
        inputs,
        input_ranks,
        output: tmp.to_path_buf(),
        report: PathBuf::from(report),
        iteration,
        split: layout.naming().split_label(split).to_string(),
        num_ranks: ranks.len() as u32,
        log_path: layout.root().to_path_buf(),
        timeout: opts.command_timeout,
        kill_grace: opts.kill_grace,
        log: opts.command_log.clone(),
        registry: opts.registry.clone(),
        env: opts.env.clone(),
    };
    let reports = command::run(&job, tick, &mut |note| super::warn(note))
        .map_err(|source| AggregateError::Command { source })?;
    for (k, r) in reports.into_iter().enumerate() {
        let e = &mut ranks[entry_of[k]];
        if let Some(n) = r.records {
            e.records = n;
        }
        if let Some(why) = r.unreadable {
            unreadable(e, &job.inputs[k], "merge command", why, opts)?;
        }
    }
    let werr = |source| AggregateError::Write {
        path: tmp.to_path_buf(),
        source,
    };
    File::open(tmp).and_then(|f| f.sync_all()).map_err(werr)?;
    let (bytes, sha) = hash_file(tmp, tick).map_err(werr)?;
    Ok(Extras {
        output_bytes: Some(bytes),
        output_sha256: Some(sha),
        command: Some(opts.command.clone()),
        ..Extras::default()
    })
}
