//! What a person (or a script) sees about a run, read from the files alone.

pub mod recover;
pub mod status;

use crate::layout::Layout;
use crate::protocol::ClusterRecord;

/// The run's cluster record, or a message saying there is no run at `layout`'s path.
pub(crate) fn read_cluster(layout: &Layout) -> Result<ClusterRecord, String> {
    crate::store::read_json(&layout.cluster())
        .map_err(|e| format!("cannot read {}: {e}", layout.cluster().display()))?
        .ok_or_else(|| {
            format!(
                "no rl-node run in {} (no {})",
                layout.root().display(),
                layout.cluster().display()
            )
        })
}
