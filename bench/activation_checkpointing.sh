#!/usr/bin/env bash
# Activation checkpointing on the CPU: planned activation memory (trainer check), peak RSS
# (GNU time) and step time (summary.json train_s / steps) for bench/mlp8.toml without
# checkpointing and with 4 segments, alternating, REPEATS times each (default 3).
# Needs a release build: cargo build --release.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
bin=target/release/trainer
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
declare -A modes=([none]='"none"' [segments4]='{ segments = 4 }')
for name in none segments4; do
  echo "$name: $($bin check bench/mlp8.toml --set "checkpoint.activations=${modes[$name]}" | grep -E '^  activations|^activation checkpointing')"
done
for i in $(seq "$repeats"); do
  for name in none segments4; do
    dir=$( { /usr/bin/time -f "%M" -o "$runs/rss" $bin run bench/mlp8.toml -q --runs-dir "$runs" \
      --set "checkpoint.activations=${modes[$name]}"; } )
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); step=1000*s["train_s"]/s["steps"]; loss=s["final"]["train_loss"]; rss=int(sys.argv[4])/1024; print(f"{sys.argv[2]:<10} run {sys.argv[3]}: step {step:.1f} ms, peak RSS {rss:.1f} MiB, final train loss {loss:.9e}")' \
      "$dir/summary.json" "$name" "$i" "$(cat "$runs/rss")"
  done
done
