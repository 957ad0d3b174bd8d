#!/usr/bin/env bash
# Gradient buckets (parallel.overlap), in one call: training samples/s (summary.json) of 2
# replicas of THREADS/2 threads each, as threads (r2: parallel.replicas = 2) and as processes
# (p2: RANK / WORLD_SIZE on loopback, gradients through rank 0 over tcp), with
#   after     parallel.overlap = false (the whole buffer averaged after the backward pass)
#   buckets   the default buckets (parallel.bucket_mb = 25, the first at most 1 MiB)
#   small     parallel.bucket_mb = 0.01 (a bucket per linear layer)
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
configs=("after:parallel.overlap=false" "buckets:parallel.overlap=true" "small:parallel.bucket_mb=0.01")
port=29800
rate() { # job mode set -> samples/s
  local sets=(--set device.type=\"cpu\" --set "$3")
  local dir
  if [[ $2 == p2 ]]; then
    port=$((port + 1))
    sets+=(--set "train.threads=$((threads / 2))")
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      $bin run "$1" --runs-dir "$runs" --quiet "${sets[@]}" &
    dir=$(RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      $bin run "$1" --runs-dir "$runs" --quiet "${sets[@]}")
    wait
  else
    sets+=(--set "train.threads=$threads" --set parallel.replicas=2)
    dir=$($bin run "$1" --runs-dir "$runs" --quiet "${sets[@]}")
  fi
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$dir/summary.json"
  rm -rf "$dir"
}
echo "threads=$threads repeats=$repeats commit=$(git rev-parse --short HEAD)"
for job in jobs/mlp.toml bench/mlp1024.toml; do
  for mode in r2 p2; do
    for i in $(seq "$repeats"); do
      for config in "${configs[@]}"; do
        IFS=: read -r name set <<<"$config"
        echo "$job $mode $name $(rate "$job" "$mode" "$set")"
      done
    done
  done
done | python3 -c '
import sys, statistics, collections
rates = collections.defaultdict(list)
for line in sys.stdin:
    job, mode, name, rate = line.split()
    rates[(job, mode, name)].append(float(rate))
for job, mode in dict.fromkeys((j, m) for j, m, _ in rates):
    med = {n: statistics.median(rates[(job, mode, n)]) for n in ("after", "buckets", "small")}
    base = med["after"]
    print(job, mode, " | ".join(f"{n} {v:,.0f} ({v / base:.2f})" for n, v in med.items()))
'
