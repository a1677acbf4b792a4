//! Every path rl-node reads or writes, in one place.
//!
//! Protocol state lives under `<log-path>/.rl-node/`; barrier, heartbeat and abort
//! records are namespaced by generation so nothing from an earlier start is mistaken for
//! current. User-facing outputs (trajectories, logs, models) live beside it.

use crate::shards::naming::Naming;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
    /// Names and format of rank shards and merged files (`[aggregate]`).
    naming: Naming,
    /// In a pipelined run, the cluster (`rollout` or `update`) whose protocol state this
    /// layout addresses: `.rl-node/<cluster>/` instead of `.rl-node/`.
    cluster: Option<&'static str>,
}

pub use crate::shards::naming::iter_dir;

impl Layout {
    /// The layout of the run in `log_path`, which becomes a confined root: no write below
    /// it follows a symbolic link (`store::beneath`).
    pub fn new(log_path: impl Into<PathBuf>) -> Layout {
        let root = log_path.into();
        crate::store::beneath::confine(&root);
        Layout {
            root,
            naming: Naming::default(),
            cluster: None,
        }
    }

    /// The same layout with the protocol state of one cluster of a pipelined run
    /// (`Config::pipeline_cluster`): each cluster has its own cluster record, generations
    /// and journals; trajectories, checkpoints and logs stay shared.
    pub fn with_cluster(mut self, cluster: Option<&'static str>) -> Layout {
        self.cluster = cluster;
        self
    }

    pub fn cluster_name(&self) -> Option<&'static str> {
        self.cluster
    }

    /// The other cluster of a pipelined run.
    pub fn other_cluster(&self) -> Option<Layout> {
        let other = match self.cluster? {
            "rollout" => "update",
            _ => "rollout",
        };
        Some(self.clone().with_cluster(Some(other)))
    }

    /// The hand-over records of a pipelined run, one per cluster, written by its rank 0
    /// (`.rl-node/pipeline/<cluster>.json`; `protocol::pipeline`).
    pub fn queue(&self, cluster: &str) -> PathBuf {
        self.root
            .join(".rl-node")
            .join("pipeline")
            .join(format!("{cluster}.json"))
    }

    /// Which model an iteration of a pipelined run was rolled out with
    /// (`rollouts/iter-NNNN/model.json`), written by the rollout cluster's rank 0 before
    /// the rollout starts.
    pub fn rollout_model(&self, iteration: u64) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join("model.json")
    }

    /// The same layout with shard and merged file names (and format) from `[aggregate]`.
    pub fn with_naming(mut self, naming: Naming) -> Layout {
        self.naming = naming;
        self
    }

    pub fn naming(&self) -> &Naming {
        &self.naming
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn state_dir(&self) -> PathBuf {
        match self.cluster {
            None => self.root.join(".rl-node"),
            Some(c) => self.root.join(".rl-node").join(c),
        }
    }

    /// Rank 0's record of the current generation (rewritten at every start).
    pub fn cluster(&self) -> PathBuf {
        self.state_dir().join("cluster.json")
    }

    pub fn gen_dir(&self, gen: u64) -> PathBuf {
        self.state_dir().join(format!("gen-{gen}"))
    }

    /// A copy of the generation's cluster record, written once when it starts, from which
    /// `rl-node recover --repair` rebuilds a damaged `cluster.json`.
    pub fn gen_cluster(&self, gen: u64) -> PathBuf {
        self.gen_dir(gen).join("cluster.json")
    }

    /// Rank r's live record in generation `gen`: heartbeat, position, release, abort.
    pub fn rank_record(&self, gen: u64, rank: u32) -> PathBuf {
        self.gen_dir(gen).join(format!("rank-{rank}.json"))
    }

    /// Rank r's journal of completed work (append-only, one writer).
    pub fn journal(&self, rank: u32) -> PathBuf {
        self.state_dir()
            .join("journal")
            .join(format!("rank-{rank}.jsonl"))
    }

    /// The join doorbell: rank 0 appends a line for each generation it starts, after
    /// `cluster.json`; a waiting worker opens it with `O_CREAT`, which no negative-lookup
    /// cache answers, so it learns of the first generation at once (docs/shared-directory.md,
    /// "A generation").
    pub fn doorbell(&self) -> PathBuf {
        self.state_dir().join("doorbell")
    }

    /// One line per start of the cluster, appended by rank 0.
    pub fn history(&self) -> PathBuf {
        self.state_dir().join("history.jsonl")
    }

    /// Rank 0's line per iteration for dashboards (`metrics`; docs/metrics.md). Not
    /// moved by `--fresh`: its lines name their run.
    pub fn metrics(&self) -> PathBuf {
        self.root.join("metrics.jsonl")
    }

    /// Where `--fresh` sets an earlier run's files aside.
    pub fn previous_runs(&self) -> PathBuf {
        self.root.join("previous-runs")
    }

    /// Where `rl-node recover --discard` sets iteration `iteration`'s outputs aside:
    /// `previous-runs/discarded-<run>-iter-NNNN-<stamp>`.
    pub fn discarded(&self, run_id: &str, iteration: u64, stamp: &str) -> Discarded {
        Discarded(self.previous_runs().join(format!(
            "discarded-{run_id}-{}-{stamp}",
            iter_dir(iteration)
        )))
    }

    /// Iteration `iteration`'s outputs, each under its top directory (`rollouts`, `train`,
    /// `logs`, `models`), named as that directory: `(top, <top>/iter-NNNN)`.
    pub fn iteration_outputs(&self, iteration: u64) -> [(&'static str, PathBuf); 4] {
        let name = iter_dir(iteration);
        ["rollouts", "train", "logs", "models"].map(|top| (top, self.root.join(top).join(&name)))
    }

    /// The directories a run writes, which `--fresh` moves aside together.
    pub fn run_dirs(&self) -> Vec<PathBuf> {
        RUN_DIRS.iter().map(|d| self.root.join(d)).collect()
    }

    /// Rank 0's view of its peers in generation `gen`: the heartbeat age of each as rank 0
    /// observes it, rewritten with rank 0's heartbeats, for `rl-node status` only (kept out
    /// of rank 0's record, which every worker re-reads each poll round).
    pub fn observed(&self, gen: u64) -> PathBuf {
        self.gen_dir(gen).join("observed.json")
    }

    /// A process's request to come back as `rank` into the cluster of generation `gen`,
    /// which does not list it (`protocol::membership::Rejoin`).
    pub fn rejoin_request(&self, gen: u64, rank: u32) -> PathBuf {
        self.gen_dir(gen).join(format!("rejoin-{rank}.json"))
    }

    /// The first-writer-wins abort record of a generation.
    pub fn abort(&self, gen: u64) -> PathBuf {
        self.gen_dir(gen).join("abort.json")
    }

    pub fn rollout_dir(&self, iteration: u64, split: &str) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join(split)
    }

    /// A rank's committed shard (default `rollout_dir/rank-R.jsonl`; `aggregate.shard-name`).
    pub fn shard(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.naming.shard(&self.root, iteration, split, rank)
    }

    /// Where a rank's command writes while it runs (`{output}`); renamed to `shard` on
    /// success (default `rank-R.partial.jsonl`; `aggregate.partial-name`).
    pub fn shard_partial(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.naming.partial(&self.root, iteration, split, rank)
    }

    /// Where generation `gen`'s command writes a rank's shard (`{output}`): the partial
    /// name with `.gG` before its last extension (`rank-1.partial.g3.jsonl`). A node of an
    /// older generation that wakes up (a frozen host) can only ever write its own
    /// generation's file, which no newer generation commits.
    pub fn shard_partial_gen(&self, iteration: u64, split: &str, rank: u32, gen: u64) -> PathBuf {
        with_gen(&self.shard_partial(iteration, split, rank), gen)
    }

    /// Which rank's partial shard of `iteration`'s `split` the file `name` in the partial
    /// directory ([`Layout::shard_partial`]'s) is, and of which generation
    /// ([`Layout::shard_partial_gen`]; `None`: the name without one, of earlier versions).
    pub fn shard_partial_of(
        &self,
        iteration: u64,
        split: &str,
        name: &str,
    ) -> Option<(u32, Option<u64>)> {
        let partial = |n: &str| match self.naming.rank_of(n, iteration, split, false, true) {
            Some((rank, true)) => Some(rank),
            _ => None,
        };
        if let Some((base, gen)) = without_gen(name) {
            if let Some(rank) = partial(&base) {
                return Some((rank, Some(gen)));
            }
        }
        partial(name).map(|rank| (rank, None))
    }

    /// The iteration's merged trajectories for a split (default
    /// `rollouts/iter-NNNN/<split>.jsonl`; `aggregate.output-name`).
    pub fn aggregated(&self, iteration: u64, split: &str) -> PathBuf {
        self.naming.output(&self.root, iteration, split)
    }

    /// Where generation `gen`'s `[phases.aggregate] command` writes the merged file
    /// (`{output}`): in the merged file's directory, its name with `.partial.gG` before
    /// the last extension (`train.partial.g3.jsonl`). Renamed to [`Layout::aggregated`]
    /// only when the command exits 0 and `gen` is still current, so a merge of an older
    /// generation that wakes up (a frozen host) writes a file nobody commits.
    pub fn aggregated_partial(&self, iteration: u64, split: &str, gen: u64) -> PathBuf {
        let out = self.aggregated(iteration, split);
        let name = out.file_name().unwrap_or_default().to_string_lossy();
        let (pre, post) = split_ext(&name);
        let partial = out.with_file_name(format!("{pre}.partial{post}"));
        with_gen(&partial, gen)
    }

    /// The generation of a custom merge's partial named `name` (see
    /// [`Layout::aggregated_partial`]) of `split` in `iteration`, if it is one.
    pub fn aggregated_partial_of(&self, iteration: u64, split: &str, name: &str) -> Option<u64> {
        let base = self.aggregated_partial(iteration, split, 0);
        let base = without_gen(base.file_name()?.to_str()?)?.0;
        without_gen(name)
            .filter(|(b, _)| *b == base)
            .map(|(_, g)| g)
    }

    pub fn prepared(&self, iteration: u64) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join("prepared")
    }

    /// Where generation `gen` trains iteration `iteration` (`train/iter-NNNN/gen-G`): a
    /// per-generation directory, so an older generation's training that wakes up never
    /// writes into the one the hand-off publishes.
    pub fn train_output(&self, iteration: u64, gen: u64) -> PathBuf {
        self.root
            .join("train")
            .join(iter_dir(iteration))
            .join(format!("gen-{gen}"))
    }

    /// Where generation `gen`'s prepare command writes (`{output}`), renamed to
    /// [`Layout::prepared`] when it exits 0.
    pub fn prepared_partial(&self, iteration: u64, gen: u64) -> PathBuf {
        with_gen(&self.prepared_partial_base(iteration), gen)
    }

    /// The generation of `name` if it is a prepare command's output in the directory of
    /// [`Layout::prepared_partial`].
    pub fn prepared_partial_of(&self, iteration: u64, name: &str) -> Option<u64> {
        let base = self.prepared_partial_base(iteration);
        gen_of(name, &base.file_name()?.to_string_lossy())
    }

    fn prepared_partial_base(&self, iteration: u64) -> PathBuf {
        self.root
            .join("rollouts")
            .join(iter_dir(iteration))
            .join("prepared.partial")
    }

    /// Where a per-task rollout of `split` commits each item's output (`<item>.jsonl`)
    /// before the rank's shard is made of them.
    pub fn items_dir(&self, iteration: u64, split: &str) -> PathBuf {
        self.rollout_dir(iteration, split).join("items")
    }

    /// Where attempt `attempt` of item `item` writes in generation `gen` (`{output}`), in
    /// [`Layout::items_dir`]: `<item>.gG.aA.partial.jsonl`, with `.rR` (the rank running
    /// it) after the generation for an item any rank may run (dynamic mode's), so that
    /// attempts, generations and ranks never share a file.
    pub fn item_partial(
        &self,
        iteration: u64,
        split: &str,
        item: &str,
        gen: u64,
        rank: Option<u32>,
        attempt: u32,
    ) -> PathBuf {
        let rank = rank.map(|r| format!(".r{r}")).unwrap_or_default();
        self.items_dir(iteration, split)
            .join(format!("{item}.g{gen}{rank}.a{attempt}.partial.jsonl"))
    }

    /// A planned rollout's plan (`plan.json`, rank 0's) in [`Layout::rollout_dir`].
    pub fn plan(&self, iteration: u64, split: &str) -> PathBuf {
        self.rollout_dir(iteration, split).join("plan.json")
    }

    /// Where each rank of a planned rollout writes its share of the tasks.
    pub fn tasks_dir(&self, iteration: u64, split: &str) -> PathBuf {
        self.rollout_dir(iteration, split).join("tasks")
    }

    /// Rank `rank`'s share of the tasks (`tasks/rank-R.jsonl`), in plan order.
    pub fn task_file(&self, iteration: u64, split: &str, rank: u32) -> PathBuf {
        self.tasks_dir(iteration, split)
            .join(format!("rank-{rank}.jsonl"))
    }

    /// A dynamic rollout's claims on items and its markers of items given up.
    pub fn leases_dir(&self, iteration: u64, split: &str) -> PathBuf {
        self.rollout_dir(iteration, split).join("leases")
    }

    /// The lease of attempt `attempt` of item `item` in generation `gen`
    /// (`leases/<item>.gG.aA`).
    pub fn lease(
        &self,
        iteration: u64,
        split: &str,
        item: &str,
        gen: u64,
        attempt: u32,
    ) -> PathBuf {
        self.leases_dir(iteration, split)
            .join(format!("{item}.g{gen}.a{attempt}"))
    }

    /// The marker of item `item` given up in generation `gen` (`leases/<item>.gG.failed`).
    pub fn failed_item(&self, iteration: u64, split: &str, item: &str, gen: u64) -> PathBuf {
        self.leases_dir(iteration, split)
            .join(format!("{item}.g{gen}.failed"))
    }

    /// The marker of attempt `attempt` of item `item` failed in generation `gen`
    /// (`leases/<item>.gG.aA.failed`): that attempt is over; the item's others go on.
    pub fn failed_attempt(
        &self,
        iteration: u64,
        split: &str,
        item: &str,
        gen: u64,
        attempt: u32,
    ) -> PathBuf {
        let mut lease = self
            .lease(iteration, split, item, gen, attempt)
            .into_os_string();
        lease.push(".failed");
        lease.into()
    }

    /// Immutable published checkpoints and the `LATEST` pointer.
    pub fn models(&self) -> PathBuf {
        self.root.join("models")
    }

    /// The pointer to the newest published checkpoint (`models/LATEST`).
    pub fn latest(&self) -> PathBuf {
        latest_in(&self.models())
    }

    /// `path` as records carry it between nodes ([`shared_relative`]); a path outside the
    /// shared directory as it is.
    pub fn relative(&self, path: &Path) -> String {
        shared_relative(&self.root, path).unwrap_or_else(|| path.display().to_string())
    }

    /// Where a path a record carries is on this node ([`resolve_recorded`]).
    pub fn resolve(&self, recorded: &str) -> Result<PathBuf, String> {
        resolve_recorded(&self.root, Path::new(recorded))
    }

    /// Whether `model` is a checkpoint rl-node published (`models/iter-NNNN` under this
    /// node's shared directory), as opposed to `cluster.model`.
    pub fn is_published(&self, model: &Path) -> bool {
        model.parent() == Some(self.models().as_path())
            && model
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(iteration_of)
                .is_some()
    }

    /// Captured output of one item (task, sample, attempt) of a per-task rollout: each
    /// item has its own log, so concurrent items never interleave.
    pub fn item_log(
        &self,
        iteration: u64,
        rank: u32,
        phase: &str,
        item: &str,
        attempt: u32,
    ) -> PathBuf {
        self.root
            .join("logs")
            .join(iter_dir(iteration))
            .join(format!("rank-{rank}.{phase}.items"))
            .join(format!("{item}.a{attempt}.log"))
    }

    /// The log of a reused item process (`phases.<phase>.reuse-processes`) of worker slot
    /// `slot`, beside the per-item logs; a worker started again in that slot appends.
    pub fn worker_log(&self, iteration: u64, rank: u32, phase: &str, slot: usize) -> PathBuf {
        self.root
            .join("logs")
            .join(iter_dir(iteration))
            .join(format!("rank-{rank}.{phase}.items"))
            .join(format!("worker-{slot}.log"))
    }

    /// Captured output of one phase command of one rank.
    pub fn phase_log(&self, iteration: u64, rank: u32, phase: &str) -> PathBuf {
        self.root
            .join("logs")
            .join(iter_dir(iteration))
            .join(format!("rank-{rank}.{phase}.log"))
    }

    /// The `k`-th hang report (1, 2, …) of one rank in one iteration (docs/forensics.md).
    pub fn hang_report(&self, iteration: u64, rank: u32, k: u32) -> PathBuf {
        self.root
            .join("logs")
            .join(iter_dir(iteration))
            .join(format!("rank-{rank}.hang-{k}.txt"))
    }
}

/// An item's committed output in the items directory `items` ([`Layout::items_dir`]):
/// `<item>.jsonl`.
pub fn committed_item(items: &Path, item: &str) -> PathBuf {
    items.join(format!("{item}.jsonl"))
}

/// A dropped group's committed item, set aside (`<item>.jsonl.dropped`: kept, never merged).
pub fn set_aside_item(items: &Path, item: &str) -> PathBuf {
    items.join(format!("{item}.jsonl.dropped"))
}

/// The record that group `group` was dropped (`<group>.dropped.json`), in `items`.
pub fn dropped_group(items: &Path, group: &str) -> PathBuf {
    items.join(format!("{group}.dropped.json"))
}

/// What `rl-node recover --discard` set aside of one iteration ([`Layout::discarded`]):
/// each output under its top directory as it was (`<top>/iter-NNNN`), a hand-off's partial
/// directories under `models/`, the `LATEST` that named a discarded checkpoint, and each
/// rank's journal as it was (`journal/rank-R.jsonl`).
#[derive(Debug, Clone)]
pub struct Discarded(PathBuf);

impl Discarded {
    pub fn root(&self) -> &Path {
        &self.0
    }

    /// Where the output `<top>/iter-NNNN` of [`Layout::iteration_outputs`] is kept.
    pub fn output(&self, top: &str, iteration: u64) -> PathBuf {
        self.0.join(top).join(iter_dir(iteration))
    }

    pub fn models(&self) -> PathBuf {
        self.0.join("models")
    }

    pub fn latest(&self) -> PathBuf {
        self.0.join(LATEST)
    }

    pub fn journal(&self, rank: u32) -> PathBuf {
        self.0.join("journal").join(format!("rank-{rank}.jsonl"))
    }
}

/// The `LATEST` pointer in the checkpoint directory `models`.
pub fn latest_in(models: &Path) -> PathBuf {
    models.join(LATEST)
}

/// The name of the pointer to the newest published checkpoint in `models/`.
pub const LATEST: &str = "LATEST";
/// A checkpoint's manifest: every file's size and SHA-256.
pub const MANIFEST: &str = "manifest.json";
/// The manifest's SHA-256, as `sha256sum` writes it (`sha256sum -c manifest.sha256` in the
/// checkpoint checks it): what lets a node trust the manifest without re-hashing the files.
pub const MANIFEST_DIGEST: &str = "manifest.sha256";
/// In a moved hand-off's partial directory: the picked directory itself…
pub const MOVED: &str = "moved";
/// …and where it was, written before it is moved (excluded files go back there).
pub const MOVED_FROM: &str = "moved-from";
/// The prefix of a checkpoint being deleted (`checkpoint::prune`).
const TRASH: &str = ".trash-";

/// Where generation `gen` assembles the checkpoint `name` in `models`
/// (`.iter-NNNN.gG.partial`), renamed to `models/<name>` when complete.
pub fn checkpoint_partial(models: &Path, name: &str, gen: u64) -> PathBuf {
    models.join(format!(".{name}.g{gen}.partial"))
}

/// The hidden name the checkpoint `name` in `models` is renamed to before it is deleted
/// (`.trash-iter-NNNN`), so a crash mid-deletion never leaves a half-deleted checkpoint.
pub fn checkpoint_trash(models: &Path, name: &str) -> PathBuf {
    models.join(format!("{TRASH}{name}"))
}

/// Whether `file_name` in `models/` is a deletion [`checkpoint_trash`] left unfinished.
pub fn is_checkpoint_trash(file_name: &str) -> bool {
    file_name.starts_with(TRASH)
}

/// The iteration of a checkpoint directory name `iter-NNNN`; `None` for anything else.
pub fn iteration_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("iter-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Why `path` cannot be resolved when a symbolic-link loop is in the way (`ELOOP`): the
/// link that loops (`path` itself or a directory above it) and the links it goes through,
/// e.g. `/shared/run is a symbolic-link loop (/shared/run → b → run; ELOOP: too many
/// levels of symbolic links)`. `None` when `path` resolves (or fails for another reason).
pub fn symlink_loop(path: &Path) -> Option<String> {
    let eloop =
        |p: &Path| std::fs::metadata(p).is_err_and(|e| e.raw_os_error() == Some(libc::ELOOP));
    if !eloop(path) {
        return None;
    }
    // The first link from the top whose target loops: the one to fix.
    let mut looping = path;
    for a in path.ancestors().collect::<Vec<_>>().into_iter().rev() {
        let link = std::fs::symlink_metadata(a).is_ok_and(|m| m.file_type().is_symlink());
        if link && eloop(a) {
            looping = a;
            break;
        }
    }
    // Its chain of targets, until one repeats (a loop may also be too long a chain).
    let mut chain = vec![looping.display().to_string()];
    let mut seen = std::collections::BTreeSet::from([looping.to_path_buf()]);
    let mut at = looping.to_path_buf();
    while chain.len() <= 40 {
        let Ok(target) = std::fs::read_link(&at) else {
            break;
        };
        chain.push(target.display().to_string());
        at = at.parent().unwrap_or(Path::new("/")).join(&target);
        if !seen.insert(at.clone()) {
            break;
        }
    }
    let what = match looping == path {
        true => format!("{} is", path.display()),
        false => format!("{} is inside {},", path.display(), looping.display()),
    };
    Some(format!(
        "{what} a symbolic-link loop ({}; ELOOP: too many levels of symbolic links)",
        chain.join(" → ")
    ))
}

/// Names of the directories a run writes under its log path (see [`Layout::run_dirs`]).
pub const RUN_DIRS: &[&str] = &[".rl-node", "rollouts", "logs", "models", "train"];

/// `path` as a record carries it to other nodes: relative to the shared directory `root`,
/// since every node may mount that directory at a path of its own (`/nfs/exp1` on one,
/// `/mnt/exp1` on another); `None` when `path` is not under `root`. Read back with
/// [`resolve_recorded`].
pub fn shared_relative(root: &Path, path: &Path) -> Option<String> {
    shared_relative_path(root, path)?
        .to_str()
        .map(str::to_string)
}

/// [`shared_relative`] for a record that carries bytes rather than text (a name need not
/// be UTF-8): `path` relative to `root`, `None` when it is not under it.
pub fn shared_relative_path<'p>(root: &Path, path: &'p Path) -> Option<&'p Path> {
    let rel = path.strip_prefix(root).ok()?;
    (!rel.as_os_str().is_empty()).then_some(rel)
}

/// Where a path a record carries ([`shared_relative`]) is on this node, whose shared
/// directory is `root`.
///
/// A relative path is joined to `root`; one that would leave it (`..`) is refused: the
/// shared directory is not trusted. An absolute path was written by an rl-node from before
/// paths crossed between nodes relative, and is read so: under `root` it is used as it
/// is (that node mounted the directory where this one does); elsewhere it is re-rooted at
/// its last component that names a directory a run writes ([`RUN_DIRS`]:
/// `/nfs/exp1/models/iter-0003` is `models/iter-0003` here), because that is the only
/// place such a path can point to inside a run. An absolute path with no such component
/// is refused, naming it.
pub fn resolve_recorded(root: &Path, recorded: &Path) -> Result<PathBuf, String> {
    use std::path::Component;
    let shown = recorded.display();
    if recorded.as_os_str().is_empty() {
        return Err("an empty path".into());
    }
    if !recorded.is_absolute() {
        let inside = recorded
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        return match inside {
            true => Ok(root.join(recorded)),
            false => Err(format!("`{shown}` leaves the shared directory")),
        };
    }
    if recorded.starts_with(root) {
        return Ok(recorded.to_path_buf());
    }
    let parts: Vec<Component> = recorded.components().collect();
    let top = parts.iter().rposition(|c| {
        matches!(c, Component::Normal(n) if RUN_DIRS.iter().any(|d| std::ffi::OsStr::new(d) == *n))
    });
    match top {
        Some(i) if parts[i + 1..].iter().all(|c| matches!(c, Component::Normal(_))) => {
            Ok(parts[i..].iter().fold(root.to_path_buf(), |p, c| p.join(c)))
        }
        _ => Err(format!(
            "`{shown}` is an absolute path outside this node's shared directory {}, and names no directory of a run in it",
            root.display()
        )),
    }
}

/// Where a write of `target` goes before it is renamed (or linked) to its name:
/// `.<name>.tmp-<tag>` beside it (hidden, and never taken for the file itself). Only a
/// crash mid-write leaves one behind ([`is_temp_of`]).
pub fn temp_path(target: &Path, tag: &str) -> PathBuf {
    let name = target.file_name().unwrap_or_default().to_string_lossy();
    target.with_file_name(format!(".{name}.tmp-{tag}"))
}

/// Whether `name` is a temporary file of a write of the file named `target`
/// ([`temp_path`]).
pub fn is_temp_of(name: &str, target: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.strip_prefix(target))
        .and_then(|n| n.strip_prefix(".tmp-"))
        .is_some_and(|tag| !tag.is_empty())
}

/// The item and generation of `name` if it is an item's partial output
/// ([`Layout::item_partial`]).
pub fn item_partial_of(name: &str) -> Option<(&str, u64)> {
    let rest = name.strip_suffix(".partial.jsonl")?;
    let (rest, attempt) = rest.rsplit_once(".a")?;
    let number = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    if !number(attempt) {
        return None;
    }
    // `.rR` after the generation, for an item any rank may run.
    let rest = match rest.rsplit_once(".r") {
        Some((r, rank)) if number(rank) => r,
        _ => rest,
    };
    let (item, gen) = rest.rsplit_once(".g")?;
    if item.is_empty() || !number(gen) {
        return None;
    }
    Some((item, gen.parse().ok()?))
}

/// `path` with `.g{gen}` inserted before the last extension of its file name when that
/// extension is plain (letters, digits, `_`), else appended: `rank-1.partial.jsonl` →
/// `rank-1.partial.g3.jsonl`, `x_rank_1.partial` → `x_rank_1.g3.partial`.
pub fn with_gen(path: &Path, gen: u64) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let (pre, post) = split_ext(&name);
    path.with_file_name(format!("{pre}.g{gen}{post}"))
}

/// The generation of `name` if it is `base` with a generation inserted ([`with_gen`]).
pub fn gen_of(name: &str, base: &str) -> Option<u64> {
    let (pre, post) = split_ext(base);
    let digits = name
        .strip_prefix(pre)?
        .strip_prefix(".g")?
        .strip_suffix(post)?;
    (!digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The name [`with_gen`] made `name` from, and the generation it inserted, if it is one.
pub fn without_gen(name: &str) -> Option<(String, u64)> {
    let (pre, post) = split_ext(name);
    let candidates = [
        // `.gG` before the last extension.
        pre.rsplit_once(".g")
            .map(|(base, _)| format!("{base}{post}")),
        // `.gG` appended to a name without a plain extension.
        post.starts_with(".g").then(|| pre.to_string()),
    ];
    candidates
        .into_iter()
        .flatten()
        .find_map(|base| gen_of(name, &base).map(|gen| (base, gen)))
}

fn split_ext(name: &str) -> (&str, &str) {
    match name.rfind('.') {
        Some(dot)
            if dot > 0
                && dot + 1 < name.len()
                && name[dot + 1..]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_') =>
        {
            (&name[..dot], &name[dot..])
        }
        _ => (name, ""),
    }
}

#[cfg(test)]
mod gen_tests {
    use super::*;

    #[test]
    fn generation_specific_names() {
        let p = Path::new("/x/rank-1.partial.jsonl");
        assert_eq!(with_gen(p, 3), Path::new("/x/rank-1.partial.g3.jsonl"));
        assert_eq!(
            gen_of("rank-1.partial.g3.jsonl", "rank-1.partial.jsonl"),
            Some(3)
        );
        assert_eq!(gen_of("rank-1.partial.jsonl", "rank-1.partial.jsonl"), None);
        assert_eq!(
            gen_of("rank-1.partial.gx.jsonl", "rank-1.partial.jsonl"),
            None
        );
        assert_eq!(
            with_gen(Path::new("a_rank_1.partial"), 2),
            Path::new("a_rank_1.g2.partial")
        );
        assert_eq!(with_gen(Path::new("prep-"), 2), Path::new("prep-.g2"));
        assert_eq!(gen_of("prep-.g2", "prep-"), Some(2));
    }

    #[test]
    fn a_generation_specific_name_gives_back_its_base_and_generation() {
        for base in [
            "rank-1.partial.jsonl",
            "a_rank_1.partial",
            "prep-",
            "foo.g3",
            "x.y.g.partial.pt",
        ] {
            for gen in [1, 12] {
                let name = with_gen(Path::new(base), gen);
                let name = name.to_str().unwrap();
                assert_eq!(without_gen(name), Some((base.to_string(), gen)), "{name}");
            }
        }
        for not in [
            "rank-1.partial.jsonl",
            "rank-1.partial.gx.jsonl",
            "a.g.jsonl",
            "g3",
        ] {
            assert_eq!(without_gen(not), None, "{not}");
        }
    }

    #[test]
    fn a_symbolic_link_loop_is_described_with_the_link_that_loops() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::os::unix::fs::symlink("b", &a).unwrap();
        std::os::unix::fs::symlink("a", &b).unwrap();
        let at = a.display();
        assert_eq!(
            symlink_loop(&a).as_deref(),
            Some(format!("{at} is a symbolic-link loop ({at} → b → a; ELOOP: too many levels of symbolic links)").as_str())
        );
        let below = a.join("run");
        assert_eq!(
            symlink_loop(&below).as_deref(),
            Some(format!("{} is inside {at}, a symbolic-link loop ({at} → b → a; ELOOP: too many levels of symbolic links)", below.display()).as_str())
        );
        // A dangling link, a missing path, a real directory: no loop.
        std::os::unix::fs::symlink("nowhere", dir.path().join("d")).unwrap();
        assert_eq!(symlink_loop(&dir.path().join("d")), None);
        assert_eq!(symlink_loop(&dir.path().join("missing")), None);
        assert_eq!(symlink_loop(dir.path()), None);
    }

    #[test]
    fn temporary_files_are_recognised_by_their_target() {
        let t = temp_path(Path::new("/r/rollouts/iter-0001/train.jsonl"), "42-0");
        assert_eq!(t, Path::new("/r/rollouts/iter-0001/.train.jsonl.tmp-42-0"));
        assert!(is_temp_of(".train.jsonl.tmp-42-0", "train.jsonl"));
        assert!(!is_temp_of(".train.jsonl.tmp-", "train.jsonl"));
        assert!(!is_temp_of(".eval.jsonl.tmp-1", "train.jsonl"));
        assert!(!is_temp_of("train.jsonl", "train.jsonl"));
    }

    #[test]
    fn item_partials_are_named_and_recognised() {
        let l = Layout::new("/r");
        let p = l.item_partial(3, "train", "p00007", 2, Some(1), 0);
        assert_eq!(
            p,
            Path::new("/r/rollouts/iter-0003/train/items/p00007.g2.r1.a0.partial.jsonl")
        );
        let name = p.file_name().unwrap().to_str().unwrap();
        assert_eq!(item_partial_of(name), Some(("p00007", 2)));
        let p = l.item_partial(3, "eval", "r1-00002", 5, None, 3);
        let name = p.file_name().unwrap().to_str().unwrap();
        assert_eq!(name, "r1-00002.g5.a3.partial.jsonl");
        assert_eq!(item_partial_of(name), Some(("r1-00002", 5)));
        for not in [
            "p00007.jsonl",
            "p00007.g2.partial.jsonl",
            "p00007.gx.a0.partial.jsonl",
            ".g2.a0.partial.jsonl",
        ] {
            assert_eq!(item_partial_of(not), None, "{not}");
        }
    }

    #[test]
    fn partial_shards_and_prepared_data_are_recognised_by_the_names_given_them() {
        let l = Layout::new("/r");
        let name = |p: PathBuf| p.file_name().unwrap().to_str().unwrap().to_string();
        let shard = name(l.shard_partial_gen(2, "train", 3, 4));
        assert_eq!(shard, "rank-3.partial.g4.jsonl");
        assert_eq!(l.shard_partial_of(2, "train", &shard), Some((3, Some(4))));
        assert_eq!(
            l.shard_partial_of(2, "eval", "rank-3.partial.jsonl"),
            Some((3, None))
        );
        assert_eq!(l.shard_partial_of(2, "train", "rank-3.jsonl"), None);
        assert_eq!(l.shard_partial_of(2, "train", "train.jsonl"), None);
        let custom =
            Naming::new("jsonl", "out_{rank}_{iteration}.jsonl", "", "{split}.jsonl").unwrap();
        let l = l.with_naming(custom);
        let shard = name(l.shard_partial_gen(2, "train", 0, 1));
        assert_eq!(shard, "out_0_2.partial.g1.jsonl");
        assert_eq!(l.shard_partial_of(2, "train", &shard), Some((0, Some(1))));
        assert_eq!(l.shard_partial_of(3, "train", &shard), None);
        let prepared = name(l.prepared_partial(2, 7));
        assert_eq!(l.prepared_partial_of(2, &prepared), Some(7));
        assert_eq!(l.prepared_partial_of(2, "prepared"), None);
    }

    #[test]
    fn the_custom_merge_writes_a_partial_of_its_generation_beside_the_merged_file() {
        let l = Layout::new("/r");
        assert_eq!(
            l.aggregated_partial(3, "train", 2),
            Path::new("/r/rollouts/iter-0003/train.partial.g2.jsonl")
        );
        assert_eq!(
            l.aggregated_partial(3, "eval", 7),
            Path::new("/r/rollouts/iter-0003/eval.partial.g7.jsonl")
        );
        // Whatever the output name, the partial sits beside it and differs per generation.
        let naming = Naming::new(
            "command",
            "{log_path}/{split}_trajectories.pt.iteration{iteration}_rank_{rank}",
            "",
            "{log_path}/{split}_trajectories.pt.iteration{iteration}",
        )
        .unwrap();
        let l = Layout::new("/r").with_naming(naming);
        let (g1, g2) = (
            l.aggregated_partial(4, "train", 1),
            l.aggregated_partial(4, "train", 2),
        );
        assert_eq!(g1.parent(), l.aggregated(4, "train").parent());
        assert_ne!(g1, g2);
        assert_ne!(g1, l.aggregated(4, "train"));
        let name = g2.file_name().unwrap().to_str().unwrap();
        assert_eq!(l.aggregated_partial_of(4, "train", name), Some(2));
        assert_eq!(l.aggregated_partial_of(4, "eval", name), None);
        assert_eq!(l.aggregated_partial_of(4, "train", "train.jsonl"), None);
        assert_eq!(
            g1,
            Path::new("/r/train_trajectories.pt.partial.g1.iteration4")
        );
    }
}

#[cfg(test)]
mod shared_path_tests {
    use super::*;

    /// A node that mounts the shared directory at `/mnt/b` reads what a node that mounts
    /// it at `/nfs/a` wrote: relative paths travel, absolute ones from earlier versions
    /// are re-rooted, and nothing leads out of the shared directory.
    #[test]
    fn recorded_paths_resolve_against_each_nodes_own_mount() {
        let a = Layout::new("/nfs/a");
        let b = Path::new("/mnt/b");
        let ckpt = a.models().join("iter-0003");
        let rel = a.relative(&ckpt);
        assert_eq!(rel, "models/iter-0003");
        assert_eq!(
            resolve_recorded(b, Path::new(&rel)).unwrap(),
            Path::new("/mnt/b/models/iter-0003")
        );
        // Outside the shared directory: as it is.
        assert_eq!(a.relative(Path::new("/opt/base-model")), "/opt/base-model");
        // Written by an older version: under this node's root, used as it is; elsewhere
        // re-rooted at the last directory a run writes.
        assert_eq!(
            resolve_recorded(b, Path::new("/mnt/b/models/iter-0003")).unwrap(),
            Path::new("/mnt/b/models/iter-0003")
        );
        assert_eq!(
            resolve_recorded(b, &ckpt).unwrap(),
            Path::new("/mnt/b/models/iter-0003")
        );
        assert_eq!(
            resolve_recorded(
                b,
                Path::new("/scratch/logs/exp/logs/iter-0001/rank-1.train.log")
            )
            .unwrap(),
            Path::new("/mnt/b/logs/iter-0001/rank-1.train.log")
        );
        for (bad, why) in [
            ("../etc/passwd", "leaves the shared directory"),
            ("models/../../x", "leaves the shared directory"),
            ("/etc/passwd", "names no directory of a run"),
            ("/x/models/../../etc", "names no directory of a run"),
            ("", "an empty path"),
        ] {
            let err = resolve_recorded(b, Path::new(bad)).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn only_checkpoints_under_models_are_published_ones() {
        let l = Layout::new("/mnt/b");
        assert!(l.is_published(Path::new("/mnt/b/models/iter-0002")));
        assert!(!l.is_published(Path::new("/nfs/a/models/iter-0002")));
        assert!(!l.is_published(Path::new("/mnt/b/models/LATEST")));
        assert!(!l.is_published(Path::new("base-model")));
    }
}
