#!/usr/bin/env bash
# Gradient buckets on CPU replicas, in one call: training samples/s (summary.json) of
# parallel.replicas = 2 (THREADS/2 threads each) with
#   after     parallel.overlap = false (the whole buffer averaged after the backward pass)
#   buckets   the default buckets (parallel.bucket_mb = 25: 2 buckets for bench/mlp1024.toml)
#   small     parallel.bucket_mb = 0.5 (one bucket per linear layer)
# alternating, REPEATS times each (default 5); prints the medians and their ratios to `after`.
#
#   cargo build --release && bench/overlap.sh [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-5}
threads=${THREADS:-$(nproc)}
bin=${TRAINER_BIN:-target/release/trainer}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
configs=("after:parallel.overlap=false" "buckets:parallel.overlap=true" "small:parallel.bucket_mb=0.5")
for job in jobs/mlp.toml bench/mlp1024.toml; do
  for i in $(seq "$repeats"); do
    for config in "${configs[@]}"; do
      IFS=: read -r name set <<<"$config"
      dir=$($bin run "$job" --runs-dir "$runs" --quiet --set device.type=\"cpu\" \
        --set "train.threads=$threads" --set parallel.replicas=2 --set "$set")
      echo "$job $name $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$dir/summary.json")"
      rm -rf "$dir"
    done
  done
done | python3 -c '
import sys, statistics, collections
rates = collections.defaultdict(list)
for line in sys.stdin:
    job, name, rate = line.split()
    rates[(job, name)].append(float(rate))
for job in dict.fromkeys(j for j, _ in rates):
    after = statistics.median(rates[(job, "after")])
    cells = [f"{n} {statistics.median(rates[(job, n)]):,.0f} ({statistics.median(rates[(job, n)]) / after:.2f})" for n in ("after", "buckets", "small")]
    print(job, " | ".join(cells))
'
