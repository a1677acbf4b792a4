//! The model a node serves and hands to its commands (`{model}`), as the node knows it:
//! which model it is on this node's own mount, whether this node has found it complete
//! and verified, and in a pipelined rollout cluster which model the current iteration is
//! rolled out with (`pipeline::RolloutModel`, as rank 0 released it).
//!
//! Finding a checkpoint complete and verifying it is I/O and stays with the node
//! (`node::model`); what follows from the outcome is decided here: whether the model to
//! serve still needs its check (a model is verified once, not before every use), and
//! whether a model released by rank 0 changes what the server serves (then the server
//! restarts on it). A model is never taken as verified because a path looks alike: only
//! the one the node verified last, as this node names it, is.

use super::pipeline::RolloutModel;
use std::path::Path;

/// The model this node serves (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Serving {
    /// `cluster.model`: the base model, as configured (perhaps empty, or a hub name).
    base: String,
    /// The model `{model}` names and the server serves, as this node sees it.
    model: String,
    /// The model last found complete and verified on this node.
    verified: Option<String>,
    /// Pipelined rollout cluster: the model of the iteration rolled out last, as rank 0
    /// released it.
    rollout: Option<RolloutModel>,
}

impl Serving {
    /// Serving the base model (`cluster.model`), verified by nobody yet.
    pub fn new(base: String) -> Serving {
        Serving {
            model: base.clone(),
            base,
            verified: None,
            rollout: None,
        }
    }

    /// The model `{model}` names and the server serves.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the model to serve is the one this node verified last: then it is not
    /// checked again.
    pub fn is_verified(&self) -> bool {
        self.verified.as_deref() == Some(self.model.as_str())
    }

    /// The model to serve was found complete and verified on this node.
    pub fn verified(&mut self) {
        self.verified = Some(self.model.clone());
        debug_assert!(self.is_verified());
    }

    /// Serve `model` from now on: whether that changed the model (a server running on
    /// the previous one must restart). It is checked before its first use.
    pub fn adopt(&mut self, model: String) -> bool {
        let changed = model != self.model;
        self.model = model;
        changed
    }

    /// Serve `model`, which was verified as it was found (`checkpoint::latest_as`).
    pub fn adopt_verified(&mut self, model: String) {
        self.adopt(model);
        self.verified();
    }

    /// The model for messages: never an empty value.
    pub fn label(&self) -> String {
        match self.model.is_empty() {
            true => "the base model (cluster.model is empty)".into(),
            false => self.model.clone(),
        }
    }

    /// The model as an iteration's outcome names it, given the directory checkpoints are
    /// published in: `model iter-0002` for a published checkpoint, `the base model (M)`
    /// for `cluster.model`.
    pub fn kept_label(&self, models: &Path) -> String {
        let model = Path::new(&self.model);
        match model.file_name() {
            Some(name) if model.parent() == Some(models) => {
                format!("model {}", name.to_string_lossy())
            }
            _ if self.model.is_empty() => "the base model (cluster.model is empty)".into(),
            _ if self.model == self.base => format!("the base model ({})", self.model),
            _ => format!("model {}", self.model),
        }
    }

    /// Pipelined rollout cluster: the current iteration is rolled out with `m`.
    pub fn roll_out(&mut self, m: RolloutModel) {
        self.rollout = Some(m);
    }

    /// The model the last iteration rolled out with, as rank 0 released it.
    pub fn rollout(&self) -> Option<&RolloutModel> {
        self.rollout.as_ref()
    }

    /// The model `iteration` is rolled out with, once rank 0 released it.
    pub fn rollout_of(&self, iteration: u64) -> Option<&RolloutModel> {
        self.rollout.as_ref().filter(|m| m.iteration == iteration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rolled(iteration: u64, version: u64) -> RolloutModel {
        RolloutModel {
            iteration,
            model_version: version,
            staleness: iteration - 1 - version,
            model: format!("models/iter-{version:04}"),
            rule: "exact".into(),
        }
    }

    #[test]
    fn the_model_to_serve_is_checked_once_until_it_changes() {
        let mut s = Serving::new("base".into());
        assert_eq!(s.model(), "base");
        assert!(!s.is_verified(), "nothing is verified at start");
        s.verified();
        assert!(s.is_verified());
        assert!(s.adopt("/shared/models/iter-0001".into()), "a new model");
        assert!(!s.is_verified(), "a new model is checked before its use");
        s.verified();
        assert!(
            !s.adopt("/shared/models/iter-0001".into()),
            "the same model"
        );
        assert!(s.is_verified(), "the same model is not checked again");
        // Back to one verified before: verified is the last one only.
        assert!(s.adopt("base".into()));
        assert!(!s.is_verified());
    }

    #[test]
    fn a_model_found_verified_is_not_checked_again() {
        let mut s = Serving::new(String::new());
        s.adopt_verified("/shared/models/iter-0003".into());
        assert_eq!(s.model(), "/shared/models/iter-0003");
        assert!(s.is_verified());
    }

    #[test]
    fn labels_name_a_checkpoint_the_base_model_or_its_absence() {
        let models = Path::new("/shared/models");
        let mut s = Serving::new("Qwen/Qwen2-0.5B".into());
        assert_eq!(s.label(), "Qwen/Qwen2-0.5B");
        assert_eq!(s.kept_label(models), "the base model (Qwen/Qwen2-0.5B)");
        s.adopt("/shared/models/iter-0002".into());
        assert_eq!(s.kept_label(models), "model iter-0002");
        assert_eq!(s.label(), "/shared/models/iter-0002");
        s.adopt("/elsewhere/ckpt".into());
        assert_eq!(s.kept_label(models), "model /elsewhere/ckpt");
        let empty = Serving::new(String::new());
        assert_eq!(empty.label(), "the base model (cluster.model is empty)");
        assert_eq!(
            empty.kept_label(models),
            "the base model (cluster.model is empty)"
        );
    }

    #[test]
    fn the_rollout_model_is_the_current_iterations_only() {
        let mut s = Serving::default();
        assert!(s.rollout().is_none());
        s.roll_out(rolled(3, 1));
        assert_eq!(s.rollout_of(3).map(|m| m.model_version), Some(1));
        assert!(s.rollout_of(4).is_none(), "not yet released for 4");
        assert_eq!(s.rollout().map(|m| m.iteration), Some(3));
        s.roll_out(rolled(4, 2));
        assert!(s.rollout_of(3).is_none());
        assert_eq!(s.rollout_of(4).map(|m| m.model_version), Some(2));
    }
}
