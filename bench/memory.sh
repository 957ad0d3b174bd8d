#!/usr/bin/env bash
# Memory and speed of two trainer builds on the same jobs, in one call: the planned
# activation memory (`trainer check`), the peak RSS (GNU time), samples/s and the final
# training loss (which must be the same bits in both), alternating the builds REPEATS times
# each (default 3). Used to measure buffer-planning changes against the build before them:
#
#   git stash && cargo build --release && cp target/release/trainer /tmp/trainer-before
#   git stash pop && cargo build --release
#   BEFORE=/tmp/trainer-before bench/memory.sh [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
before=${BEFORE:?BEFORE must name the trainer binary to compare with}
after=${AFTER:-target/release/trainer}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
# job and the settings that keep a run short (steps over the same data in both builds)
cases=(
  "bench/mlp8.toml|--set train.max_steps=30"
  "jobs/fashion_mnist_cnn.toml|--set train.max_steps=150"
  "jobs/resnet_small.toml|--set train.max_steps=60"
)
for case in "${cases[@]}"; do
  job=${case%%|*}
  read -ra sets <<<"${case#*|}"
  for build in before after; do
    bin=${!build}
    planned=$($bin check "$job" "${sets[@]}" 2>/dev/null | grep -E '^  activation' | awk '{print $(NF-1), $NF}' | paste -sd' ')
    echo "$job $build: activations, their gradients: $planned"
  done
  for i in $(seq "$repeats"); do
    for build in before after; do
      bin=${!build}
      dir=$( { /usr/bin/time -f "%M" -o "$runs/rss" "$bin" run "$job" -q --runs-dir "$runs" \
        --set train.threads=2 --set train.log_every=1000 "${sets[@]}"; } )
      python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); rate=s["samples_per_sec"]; loss=s["final"]["train_loss"]; print(f"{sys.argv[2]} {sys.argv[3]:<6} run {sys.argv[4]}: {rate:9.0f} samples/s, peak RSS {int(sys.argv[5])/1024:7.1f} MiB, final train loss {loss:.9e}")' \
        "$dir/summary.json" "$job" "$build" "$i" "$(cat "$runs/rss")"
      rm -rf "$dir"
    done
  done
done
