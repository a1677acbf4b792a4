//! `aggregate.check-numbering`: a rollout command that numbers its own files from the
//! merged files present (webgym's rollout.py: one more than the highest
//! `…iterationN`) and rl-node, which numbers them by counting iterations and evals, must
//! agree, or the command writes a file rl-node never looks for and the rollout fails
//! after hours with "wrote no output". They part after a migration with another eval
//! interval, a `--fresh` over old outputs, or a merge that was skipped; so rank 0 compares
//! the two numbers before the iteration's first rollout (and again before each one) and
//! refuses it, naming both and the cause.

use super::{Node, Stop};
use crate::protocol::walk;
use crate::protocol::AbortKind;

impl Node {
    /// Refuse `split`'s rollout of this iteration when it, or a rollout after it in this
    /// iteration, would number its files otherwise than `{split_iteration}` (rank 0 only;
    /// the workers stop with it).
    pub(super) fn check_numbering(&mut self, split: &str, phase: &str) -> Result<(), Stop> {
        if !self.cfg.aggregate.check_numbering || !self.is_master() {
            return Ok(());
        }
        let c = &self.cfg.cluster;
        let splits =
            walk::splits_rolled_out(c.rollout_split, self.machine.iteration(), c.eval_interval);
        let from = splits.iter().position(|s| s.name() == split).unwrap_or(0);
        for s in &splits[from..] {
            if let Some(why) = self.numbering_mismatch(s.name())? {
                let reason = format!(
                    "refusing the {phase} rollout of iteration {} before it starts (aggregate.check-numbering): {why}",
                    self.machine.iteration()
                );
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
        }
        Ok(())
    }

    /// Why `split`'s command would write another number than `{split_iteration}`, if it
    /// would.
    fn numbering_mismatch(&mut self, split: &str) -> Result<Option<String>, Stop> {
        let it = self.machine.iteration();
        let naming = self.layout.naming().clone();
        let ours = naming.split_iteration(split, it);
        let merged = self.layout.aggregated(it, split);
        let Some(dir) = merged.parent() else {
            return Ok(None);
        };
        self.watchdog
            .pet("listing the merged files (aggregate.check-numbering)");
        let names = match self.store.read_dir(dir) {
            Ok(names) => names,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                let reason = format!(
                    "cannot list {} (aggregate.check-numbering): {e}",
                    dir.display()
                );
                return Err(self.fail(AbortKind::Error, self.rank, None, reason, None));
            }
        };
        let highest = names
            .iter()
            .filter_map(|n| n.to_str())
            .filter_map(|n| Some((naming.split_iteration_of_output(n, it, split)?, n)))
            .max();
        let theirs = highest.map_or(1, |(h, _)| h + 1);
        if theirs == ours {
            return Ok(None);
        }
        let label = naming.split_label(split);
        let found = match highest {
            Some((h, name)) => format!(
                "the highest-numbered merged {label} file present is {} (number {h})",
                dir.join(name).display()
            ),
            None => format!("no merged {label} file is present in {}", dir.display()),
        };
        let how = if split == "eval" {
            format!(
                "rl-node numbers evals by cluster.eval-interval ({}): iteration {it}'s eval is eval number {ours}",
                self.cfg.cluster.eval_interval
            )
        } else {
            format!("rl-node numbers train rollouts by iteration: this is iteration {it}")
        };
        Ok(Some(format!(
            "its {label} rollout would write {label} file number {theirs}, rl-node expects number {ours} ({}). The command numbers its files from the ones present: {found}; {how}. They differ after a migration with another eval interval, a --fresh over an earlier run's files, or a merge that was skipped (aggregate --allow-missing). Move the merged files that do not belong to this run aside, or set cluster.first-iteration / cluster.eval-interval so the numbers agree",
            merged.display()
        )))
    }
}
