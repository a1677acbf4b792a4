#!/usr/bin/env python3
"""Follow rl-node's metrics.jsonl into W&B or TensorBoard, like `tail -F`.

rl-node writes no tracker itself (it runs on nodes that may have no network and no
Python); rank 0 appends one JSON line per completed iteration to
`<log-path>/metrics.jsonl` (docs/metrics.md), and this script, run anywhere that sees
the shared directory, turns each numeric key of each line into a tracker scalar with
`step = iteration`.

    python3 follow_metrics.py --log-path /shared/run1 --to wandb --project my-rl --until-complete
    python3 follow_metrics.py --log-path /shared/run1 --to tensorboard --logdir runs/ --until-complete

It waits for the file to appear, reads only complete lines (a line still being written
is read once its newline is there; a complete line that is not JSON is reported and
skipped), and keeps its place in a state file (`--state`), so a restarted script goes on
where it stopped instead of logging an iteration twice. Each rl-node run (`run`, a new
one after `--fresh`) and, in a pipelined run, each cluster is its own series, so that
steps always grow: in W&B one tracker run per cluster, grouped by `run`; in TensorBoard a
directory per `run` and a tag prefix per cluster (`rollout/time/iteration_s`).

W&B: `pip install wandb`; `WANDB_MODE=offline` logs to `WANDB_DIR` for a later
`wandb sync`. TensorBoard: `pip install tensorboard`; its own event-file writer
(`tensorboard.summary.Writer`) is used, without TensorFlow or torch.
"""

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log-path", required=True, help="the run's shared directory (rl-node --log-path)")
    p.add_argument("--to", required=True, choices=["wandb", "tensorboard"])
    p.add_argument("--project", default="rl-node", help="W&B project (default: rl-node)")
    p.add_argument("--group", help="W&B group (default: the line's `run`; a pipelined run's "
                   "clusters have a `run` each, so give one --group to keep them together)")
    p.add_argument("--logdir", default="runs", help="TensorBoard directory (default: ./runs)")
    p.add_argument(
        "--state",
        help="where to keep the place reached (default: a file under ~/.cache/rl-node/ named "
        "after the metrics file and --to)",
    )
    p.add_argument("--until-complete", action="store_true",
                   help="stop once `rl-node status` says the run completed (and every line is logged)")
    p.add_argument("--iterations", type=int,
                   help="stop once iteration N is logged (in a pipelined run, by both clusters)")
    p.add_argument("--rl-node", default="rl-node", help="the rl-node binary for --until-complete")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between looks at the file (default: 2)")
    return p.parse_args(argv)


def default_state(metrics, to):
    digest = hashlib.sha256(os.path.abspath(metrics).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "rl-node", "follow_metrics", f"{digest}-{to}.json")


def load_state(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"offset": 0, "last": {}}


def save_state(path, state):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def scalars(line):
    """The numeric keys of a line (a list of numbers, like barrier/wait_by_rank_s, as one
    key per index); booleans, strings and nulls are left out."""
    out = {}
    for key, value in line.items():
        if key == "iteration":
            continue
        if isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    out[f"{key}/{i}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = value
    return out


class WandbSink:
    """One W&B run per rl-node run and cluster (W&B has one step per run), grouped by the
    rl-node run or --group; its id is derived from them so a restarted script resumes it."""

    def __init__(self, args):
        import wandb

        self.wandb, self.project, self.group, self.runs = wandb, args.project, args.group, {}

    def log(self, run, cluster, step, values):
        key = (run, cluster)
        if key not in self.runs:
            name = f"{run}-{cluster}" if cluster else run
            self.runs[key] = self.wandb.init(
                project=self.project, group=self.group or run, name=name, id=name, resume="allow",
                job_type=cluster or "train", reinit="create_new",
            )
        self.runs[key].log(values, step=step)

    def flush(self):
        pass

    def close(self):
        for r in self.runs.values():
            r.finish()


class TensorBoardSink:
    """A directory per rl-node run under --logdir; a pipelined run's clusters get their
    own tag prefix, so each tag's steps grow."""

    def __init__(self, args):
        from tensorboard.summary import Writer

        self.Writer, self.logdir, self.writers = Writer, args.logdir, {}

    def log(self, run, cluster, step, values):
        if run not in self.writers:
            self.writers[run] = self.Writer(os.path.join(self.logdir, run))
        w = self.writers[run]
        for k, v in values.items():
            w.add_scalar(f"{cluster}/{k}" if cluster else k, float(v), step=step)

    def flush(self):
        for w in self.writers.values():
            w.flush()

    def close(self):
        for w in self.writers.values():
            w.close()


def read_new(metrics, state):
    """The complete lines after the saved offset, as (end offset, text). Another file (a
    new inode, or shorter than the offset) is read from the start; the iterations already
    logged are still skipped."""
    try:
        with open(metrics, "rb") as f:
            ino = os.fstat(f.fileno()).st_ino
            f.seek(0, os.SEEK_END)
            if f.tell() < state["offset"] or state.get("inode", ino) != ino:
                print(f"follow_metrics: {metrics} was replaced; reading it from the start", file=sys.stderr)
                state["offset"] = 0
            state["inode"] = ino
            f.seek(state["offset"])
            data = f.read()
    except FileNotFoundError:
        return []
    out, pos = [], state["offset"]
    while True:
        nl = data.find(b"\n", pos - state["offset"])
        if nl < 0:
            return out  # a torn last line: wait for its newline
        end = state["offset"] + nl + 1
        out.append((end, data[pos - state["offset"]:nl].decode("utf-8", "replace")))
        pos = end


def handle(text, where, state, sink):
    """Log one line unless its series already has this iteration; the (run, cluster, step)
    logged, or None."""
    if not text.strip():
        return None
    try:
        line = json.loads(text)
        run, step = str(line["run"]), int(line["iteration"])
    except (ValueError, KeyError, TypeError) as e:
        print(f"follow_metrics: {where}: skipping a line that is not a metrics line ({e})", file=sys.stderr)
        return None
    cluster = line.get("cluster") or ""
    series = f"{run}/{cluster}"
    if step <= state["last"].get(series, 0):
        return None
    state["last"][series] = step  # first: an interrupted log is lost, never repeated
    sink.log(run, cluster, step, scalars(line))
    return run, cluster, step


def run_completed(args):
    out = subprocess.run([args.rl_node, "status", "--log-path", args.log_path, "--json"],
                         capture_output=True, text=True)
    try:
        return json.loads(out.stdout).get("state") == "completed"
    except ValueError:
        return False


def reached(args, state):
    """Whether --iterations N is logged: by the newest run, or in a pipelined run (whose
    clusters have a `run` id each) by a rollout and an update series."""
    if args.iterations is None or not state["last"]:
        return False
    newest = {}
    for series, step in state["last"].items():
        run, cluster = series.split("/", 1)
        if cluster or run == state.get("run"):
            newest[cluster] = max(step, newest.get(cluster, 0))
    clusters = [""] if "" in newest else ["rollout", "update"]
    return all(newest.get(c, 0) >= args.iterations for c in clusters)


def follow(args, sink):
    metrics = os.path.join(args.log_path, "metrics.jsonl")
    state_path = args.state or default_state(metrics, args.to)
    state = load_state(state_path)
    try:
        while True:
            done = args.until_complete and run_completed(args)  # asked before reading: no line is missed
            lines = read_new(metrics, state)
            for end, text in lines:
                logged = handle(text, f"{metrics} at byte {state['offset']}", state, sink)
                if logged:
                    state["run"] = logged[0]
                state["offset"] = end
            if lines:
                sink.flush()
                save_state(state_path, state)
            if done or reached(args, state):
                return
            time.sleep(args.poll)
    finally:
        save_state(state_path, state)  # also on Ctrl-C, mid-batch


def stop(_signum, _frame):
    raise KeyboardInterrupt


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop)  # a batch system's stop ends it like Ctrl-C
    sink = WandbSink(args) if args.to == "wandb" else TensorBoardSink(args)
    try:
        follow(args, sink)
    except KeyboardInterrupt:
        pass  # follow() saved the place reached
    finally:
        sink.close()


if __name__ == "__main__":
    main()
