//! The node's driver of [`CommitMachine`]: it performs each step of a commit on the shared
//! directory and hands the machine what happened. Every commit of a command's output (a
//! rank's shard, an item, the prepared data, an aggregate command's merged file) goes
//! through here; the order of the steps is the machine's, never the caller's.

use super::{Node, Stop};
use crate::protocol::commit::{CommitMachine, Effect, Found, Input, Outcome, Rules};
use crate::store::Kind;

impl Node {
    /// Commit under `rules`. `what` completes "this node did not …" should the fence
    /// stop it (and names the step for the watchdog). The outcome is the caller's to word.
    pub(super) fn commit(&mut self, rules: Rules, what: &str) -> Result<Outcome, Stop> {
        let mut m = CommitMachine::broken(rules, self.broken.commit);
        while let Some(effect) = m.poll_effect() {
            let input = match effect {
                Effect::Fence(site) => {
                    self.fence_at(site, what)?;
                    self.watchdog.pet("committing a command's output");
                    Input::Passed
                }
                Effect::Journal(item) => {
                    self.journal_item(&item)?;
                    Input::Passed
                }
                Effect::Look(path) => match self.store.lstat(&path) {
                    Ok(meta) => Input::Looked(meta.map(|m| match m.kind {
                        Kind::File => Found::File,
                        Kind::Dir => Found::Dir,
                        _ => Found::Other,
                    })),
                    Err(e) => failed(e),
                },
                Effect::Sync(path) => done(self.store.sync_file(&path)),
                Effect::Rename { from, to } => done(self.store.rename_noreplace(&from, &to)),
                Effect::CreateEmpty(path) => match self.store.create_new(&path, b"") {
                    Ok(created) => Input::Created(created),
                    Err(e) => failed(e),
                },
                Effect::Remove(path) => {
                    let _ = self.store.remove_file(&path);
                    Input::Done
                }
                Effect::SyncDir(dir) => done(self.store.fsync_dir(&dir)),
            };
            m.handle(input);
        }
        Ok(m.outcome()
            .cloned()
            .expect("a commit with no effect left has ended"))
    }
}

fn done(r: std::io::Result<()>) -> Input {
    match r {
        Ok(()) => Input::Done,
        Err(e) => failed(e),
    }
}

fn failed(e: std::io::Error) -> Input {
    Input::Failed(e.kind(), e.to_string())
}
