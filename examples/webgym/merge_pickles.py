#!/usr/bin/env python3
"""Merge the old run.sh's rollout shards for rl-node's `command` aggregation format.

Each shard (`train_trajectories.pt.iteration{N}_rank_{R}`) holds one Python object,
`{'trajectories': [...], 'metadata': {...}}`, written with `pickle.dump` or `torch.save`.
The merge is one object of the same shape: every shard's trajectories in the order the
shards are given (rl-node gives them in rank order), and metadata made of the entries
every shard agrees on, plus `num_trajectories` and `merged_from` (each shard's rank, path,
trajectory count and own metadata).

rl-node decides which shards exist, which are partial or missing, hashes them for the
manifest and publishes the output atomically; this script only reads and writes. A shard
it cannot read (a truncated pickle, something that is not such a dict) is skipped and
reported in the JSON report ($RL_NODE_REPORT or --report), and rl-node refuses the merge
unless it was run with --allow-missing. Configuration (rl-node.toml):

    [aggregate]
    format = "command"
    shard-name = "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}_rank_{rank}"
    partial-name = "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}_rank_{rank}.checkpoint"
    output-name = "{log_path}/{split}_trajectories/{split}_trajectories.pt.iteration{split_iteration}"
    command = "python3 \"$WEBGYM_MERGE\" --output {output} {inputs}"

(examples/webgym/rl-node.toml; WEBGYM_MERGE is this file's path, set in its [env].)

Run it where the classes inside the trajectories can be imported (PYTHONPATH), as for the
rollout itself: unpickling imports them. Pickles can run code when loaded; merge only
shards your own rollouts wrote.

The output is always a file webgym's loaders read: they call `torch.load(path,
weights_only=False)` (webgym/utils/trajectory_storage.py) and skip, with only a warning,
a file it cannot read, which a plain pickle is ("Invalid magic number"): an iteration's
trajectories would vanish from training. With torch importable the output is written by
`torch.save`; without it (trajectories hold no tensors then: reading a shard that has
some needs torch), in torch.save's own legacy format, which `torch.load` reads with
`weights_only=False`. Run it in webgym's environment (its conda environment has torch),
as run.sh did. Shards written by `torch.save` or `pickle.dump` are read, with or without
torch as long as they hold no tensors.
"""

import argparse
import io
import json
import os
import pickle
import sys
import zipfile

_MISSING = object()


class Unreadable(Exception):
    pass


class _NoTorchUnpickler(pickle.Unpickler):
    """Reads a torch.save archive's data.pkl without torch, as long as it holds no tensors."""

    def persistent_load(self, pid):
        raise Unreadable("it holds tensors: reading it needs torch (pip install torch)")


def _torch():
    try:
        import torch  # noqa: PLC0415

        return torch
    except ImportError:
        return None


# torch.save's legacy format (torch/serialization.py: _legacy_save, _legacy_load): these
# pickles one after another, then the object, then the list of its storages' keys.
TORCH_MAGIC_NUMBER = 0x1950a86a20f9469cfc6c
TORCH_PROTOCOL_VERSION = 1001


def _torch_legacy_header(f):
    """True (and f past the header) for torch.save's legacy format; else f rewound."""
    start = f.tell()
    try:
        if pickle.load(f) == TORCH_MAGIC_NUMBER:
            if pickle.load(f) != TORCH_PROTOCOL_VERSION:
                raise Unreadable("a torch.save file of an unknown protocol version")
            pickle.load(f)  # system info
            return True
    except (EOFError, pickle.UnpicklingError):
        pass
    f.seek(start)
    return False


def save_torch_legacy(obj, f):
    """What torch.save(obj, f, _use_new_zipfile_serialization=False) writes for an object
    without tensors; torch.load(f, weights_only=False) reads it back."""
    sys_info = dict(protocol_version=TORCH_PROTOCOL_VERSION, little_endian=sys.byteorder == "little",
                    type_sizes=dict(short=2, int=4, long=4))
    for part in (TORCH_MAGIC_NUMBER, TORCH_PROTOCOL_VERSION, sys_info, obj, []):
        pickle.dump(part, f, protocol=4)


def load(path):
    """(object, container) of one shard, container being 'pickle' or 'torch'."""
    try:
        if zipfile.is_zipfile(path):
            torch = _torch()
            if torch is not None:
                return torch.load(path, map_location="cpu", weights_only=False), "torch"
            with zipfile.ZipFile(path) as z:
                names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                if not names:
                    raise Unreadable("a zip archive without data.pkl: not a torch.save file")
                return _NoTorchUnpickler(io.BytesIO(z.read(names[0]))).load(), "torch"
        with open(path, "rb") as f:
            if _torch_legacy_header(f):
                obj = _NoTorchUnpickler(f).load()
                if pickle.load(f):
                    raise Unreadable("it holds tensors: reading it needs torch (pip install torch)")
                return obj, "torch"
            return pickle.load(f), "pickle"
    except Unreadable:
        raise
    except (EOFError, pickle.UnpicklingError) as e:
        raise Unreadable(f"truncated or corrupt pickle ({type(e).__name__}: {e})") from e
    except (ImportError, AttributeError) as e:
        raise Unreadable(
            f"it refers to a class this Python cannot import ({e}); set PYTHONPATH as for the rollout"
        ) from e
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure to unpickle is this shard's
        raise Unreadable(f"cannot be unpickled ({type(e).__name__}: {e})") from e


def trajectories_of(obj):
    if not isinstance(obj, dict):
        raise Unreadable(f"expected a dict with 'trajectories', found {type(obj).__name__}")
    traj = obj.get("trajectories", _MISSING)
    if traj is _MISSING:
        raise Unreadable(f"the dict has no 'trajectories' (keys: {sorted(map(str, obj))})")
    if not isinstance(traj, (list, tuple)):
        raise Unreadable(f"'trajectories' is a {type(traj).__name__}, not a list")
    meta = obj.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise Unreadable(f"'metadata' is a {type(meta).__name__}, not a dict")
    return list(traj), meta


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. arrays whose == is elementwise
        return False


def merge_metadata(parts):
    """Entries every shard agrees on, then num_trajectories and merged_from."""
    metas = [m for (_, _, _, m) in parts]
    common = {}
    if metas:
        for k, v in metas[0].items():
            if all(_same(m.get(k, _MISSING), v) for m in metas[1:]):
                common[k] = v
    common["num_trajectories"] = sum(n for (_, _, n, _) in parts)
    common["merged_from"] = [
        {"rank": rank, "path": path, "num_trajectories": n, "metadata": m}
        for (rank, path, n, m) in parts
    ]
    return common


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help="shard files, in rank order")
    ap.add_argument("--output", required=True, help="the merged file to write ({output})")
    ap.add_argument("--report", default=os.environ.get("RL_NODE_REPORT"),
                    help="where to write the JSON report (default $RL_NODE_REPORT)")
    ap.add_argument("--ranks", default=os.environ.get("RL_NODE_INPUT_RANKS", ""),
                    help="ranks of the inputs, comma-separated (default $RL_NODE_INPUT_RANKS)")
    a = ap.parse_args(argv)

    ranks = [int(r) for r in a.ranks.split(",") if r.strip()] if a.ranks else []
    if len(ranks) != len(a.inputs):
        ranks = list(range(len(a.inputs)))

    trajectories, parts = [], []
    records, unreadable = {}, {}
    for rank, path in zip(ranks, a.inputs):
        try:
            obj, _ = load(path)
            traj, meta = trajectories_of(obj)
        except Unreadable as e:
            unreadable[path] = str(e)
            print(f"merge_pickles: rank {rank}: {path}: unreadable: {e}", file=sys.stderr)
            continue
        trajectories.extend(traj)
        parts.append((rank, path, len(traj), meta))
        records[path] = len(traj)
        print(f"merge_pickles: rank {rank}: {len(traj)} trajectories from {path}", file=sys.stderr)

    merged = {"trajectories": trajectories, "metadata": merge_metadata(parts)}
    torch = _torch()
    out_format = "torch.save" if torch is not None else "torch.save legacy format, without torch"
    with open(a.output, "wb") as f:
        if torch is not None:
            torch.save(merged, f)
        else:
            save_torch_legacy(merged, f)
        f.flush()
        os.fsync(f.fileno())
    if a.report:
        with open(a.report, "w") as f:
            json.dump({"records": records, "unreadable": unreadable}, f)
    print(f"merge_pickles: {len(trajectories)} trajectories from {len(parts)} of {len(a.inputs)} "
          f"shards into {a.output} ({out_format})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
