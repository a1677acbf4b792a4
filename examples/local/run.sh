#!/usr/bin/env bash
# Start a 3-node rl-node cluster on this machine over one directory and wait for it.
# Usage: examples/local/run.sh [DIR]   (default: a fresh temporary directory)
# RL_NODE_BIN: the rl-node binary to run (default: this checkout's release build).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${RL_NODE_BIN:-$here/../../target/release/rl-node}"
[ -x "$bin" ] || (cd "$here/../.." && cargo build --release --quiet)
dir="${1:-$(mktemp -d)}"
echo "shared directory: $dir"
"$bin" --master   --config "$here/rl-node.toml" --log-path "$dir" &
"$bin" --worker 1 --config "$here/rl-node.toml" --log-path "$dir" 2>/dev/null &
"$bin" --worker 2 --config "$here/rl-node.toml" --log-path "$dir" 2>/dev/null &
status=0
for _ in 1 2 3; do wait -n || status=$?; done
"$bin" status --log-path "$dir"
echo "merged trajectories: $dir/rollouts/iter-0004/train.jsonl ($(wc -l < "$dir/rollouts/iter-0004/train.jsonl") records)"
exit "$status"
