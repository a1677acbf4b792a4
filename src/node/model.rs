//! The model as it crosses between nodes, and the check that a node sees the model rank 0
//! published before anything of it (the inference server, `{model}`) uses it.
//!
//! Every node may mount the shared directory at a path of its own, so rank 0 never hands
//! its own absolute path to the others: a checkpoint it published travels as its path
//! relative to the shared directory (`models/iter-0003`), and each node resolves it
//! against its own `--log-path`; the base model (`cluster.model`) travels as configured,
//! since every node's configuration holds the same string. A node that then does not find
//! the checkpoint on its own mount (missing, without its manifest, or not verifying) stops
//! with its own error, naming both what rank 0 published and where it looked, instead of
//! starting a server on nothing and letting the server take the blame.

use super::{Node, Stop};
use crate::checkpoint;
use crate::protocol::AbortKind;
use std::path::{Path, PathBuf};

impl Node {
    /// The current model as a record carries it to other nodes: a published checkpoint
    /// relative to the shared directory, anything else (`cluster.model`) as it is.
    pub(super) fn model_record(&self, model: &str) -> String {
        let path = Path::new(model);
        match self.layout.is_published(path) {
            true => self.layout.relative(path),
            false => model.to_string(),
        }
    }

    /// The model a record names, on this node: `cluster.model` as configured, any other
    /// path resolved against this node's shared directory (`layout::resolve_recorded`,
    /// which also reads the absolute paths earlier versions recorded).
    pub(super) fn model_from_record(&self, recorded: &str) -> Result<String, String> {
        if recorded == self.cfg.cluster.model {
            return Ok(recorded.to_string());
        }
        self.layout
            .resolve(recorded)
            .map(|p| p.display().to_string())
    }

    /// Take the model rank 0 released (`recorded`, as [`Node::model_record`] wrote it) as
    /// this node's, once this node sees it: a published checkpoint must be there on this
    /// node's own mount and verify. Whether the model changed.
    pub(super) fn adopt_model(&mut self, recorded: &str) -> Result<bool, Stop> {
        let model = match self.model_from_record(recorded) {
            Ok(m) => m,
            Err(why) => {
                let reason = format!(
                    "rank 0 released the model {recorded}, which this node cannot find in its shared directory {}: {why}",
                    self.layout.root().display()
                );
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
        };
        let changed = self.machine.serving_mut().adopt(model);
        self.check_model()?;
        Ok(changed)
    }

    /// Check the current model before it is served or handed to a command, once per
    /// model: a checkpoint rl-node published must exist on this node's mount, hold its
    /// manifest, and verify (`phases.handoff.verify`); any other model with a manifest
    /// must verify; any other model (`cluster.model`, perhaps a hub name) is the user's.
    pub(super) fn check_model(&mut self) -> Result<(), Stop> {
        if self.machine.serving().is_verified() {
            return Ok(());
        }
        let path = PathBuf::from(self.machine.serving().model());
        let published = self.layout.is_published(&path);
        if !published && !self.store.exists_followed(&path.join(checkpoint::MANIFEST)) {
            return Ok(());
        }
        if let Some(problem) = self.model_problem(&path)? {
            let mut stop = match published {
                true => self.unseen_model(&path, &problem),
                false => {
                    let reason =
                        format!("refusing to use the model {}: it {problem}", path.display());
                    self.fail(AbortKind::Error, self.rank, None, reason, None)
                }
            };
            if published {
                stop.hint = Some(format!(
                    "every node must see the directory rank 0 writes at its own --log-path ({} on this node): check that this node mounts the same filesystem or export, that the mount is not stale, and that models/ is not a link to a disk of its own",
                    self.layout.root().display()
                ));
            }
            return Err(stop);
        }
        self.machine.serving_mut().verified();
        Ok(())
    }

    /// What is wrong with the checkpoint at `path` as this node sees it, if anything.
    fn model_problem(&mut self, path: &Path) -> Result<Option<String>, Stop> {
        self.watchdog.pet("verifying the model");
        // Rank 0 made it on another client: a FUSE mount may still cache it as missing.
        if let Some(models) = path.parent() {
            let _ = self.store.refresh(models);
        }
        if !self.store.is_dir(path) {
            return Ok(Some("does not exist".into()));
        }
        if !self.store.is_file(&path.join(checkpoint::MANIFEST)) {
            return Ok(Some(format!(
                "has no {} (it is not a complete checkpoint)",
                checkpoint::MANIFEST
            )));
        }
        let (store, at) = (self.store.clone(), path.to_path_buf());
        let check = self.cfg.phases.handoff.check();
        // A job the loop watches: hashing a large checkpoint takes minutes.
        let verified = self.job("verifying the model", move |_, wd| {
            checkpoint::verify_as(&*store, &at, check, &mut || wd.pet("verifying the model"))
                .err()
                .map(|e| format!("does not verify ({e})"))
        })?;
        Ok(verified.unwrap_or_else(|| Some("could not be verified (the job panicked)".into())))
    }

    /// A checkpoint rank 0 published that this node cannot use: its own failure (exit 1),
    /// naming the checkpoint as rank 0 published it and the path this node looked at.
    fn unseen_model(&mut self, path: &Path, problem: &str) -> Stop {
        let reason = format!(
            "rank 0 published the checkpoint {}, which rank {} looked for at {}: it {problem}",
            self.layout.relative(path),
            self.rank,
            path.display()
        );
        self.fail(AbortKind::Error, self.rank, None, reason, None)
    }
}
