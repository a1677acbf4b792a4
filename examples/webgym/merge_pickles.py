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

The output uses the container of the inputs: a pickle for pickles; for `torch.save`
archives, `torch.save` (needs torch; without it, pass --output-format pickle). Shards
written by `torch.save` that hold no tensors are read without torch.
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
    ap.add_argument("--output-format", choices=["same", "pickle", "torch"], default="same")
    a = ap.parse_args(argv)

    ranks = [int(r) for r in a.ranks.split(",") if r.strip()] if a.ranks else []
    if len(ranks) != len(a.inputs):
        ranks = list(range(len(a.inputs)))

    trajectories, parts, containers = [], [], set()
    records, unreadable = {}, {}
    for rank, path in zip(ranks, a.inputs):
        try:
            obj, container = load(path)
            traj, meta = trajectories_of(obj)
        except Unreadable as e:
            unreadable[path] = str(e)
            print(f"merge_pickles: rank {rank}: {path}: unreadable: {e}", file=sys.stderr)
            continue
        trajectories.extend(traj)
        parts.append((rank, path, len(traj), meta))
        containers.add(container)
        records[path] = len(traj)
        print(f"merge_pickles: rank {rank}: {len(traj)} trajectories from {path}", file=sys.stderr)

    merged = {"trajectories": trajectories, "metadata": merge_metadata(parts)}
    out_format = a.output_format
    if out_format == "same":
        out_format = "torch" if containers == {"torch"} else "pickle"
    with open(a.output, "wb") as f:
        if out_format == "torch":
            torch = _torch()
            if torch is None:
                sys.exit("merge_pickles: the shards are torch.save files and writing one needs torch; "
                         "install it or pass --output-format pickle")
            torch.save(merged, f)
        else:
            pickle.dump(merged, f, protocol=4)
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
