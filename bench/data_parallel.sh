#!/usr/bin/env bash
# Data parallelism on the CPU, in one call: training samples/s (summary.json) of each job
#   none      no [parallel] section, all THREADS threads (the plain path)
#   r1        parallel.replicas = 1, all threads (the data-parallel path with one replica)
#   rN        parallel.replicas = N, THREADS/N threads each, for N = 2, 4, ... <= THREADS
#   1dev/N    no [parallel], THREADS/N threads: one of rN's replicas alone (one "device")
#   pN        N processes (RANK/WORLD_SIZE on loopback) of THREADS/N threads each: rN's
#             replicas as processes, gradients averaged through rank 0 over TCP
# alternating the configurations, REPEATS times each (default 5), and prints the medians and
#   r1 / none                overhead of the all-reduce path with one replica (goal: >= 0.98)
#   rN / none                what N replicas gain over one process using every thread
#   rN / (N x 1dev/N)        scaling efficiency: N devices against N times one device
#   pN / rN                  processes against threads (the cost of TCP and of a copy of
#                            the data set and model per process)
#
#   cargo build --release && bench/data_parallel.sh [repeats]
# THREADS=n: total threads (default: every core); TRAINER_BIN: another build.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-5}
threads=${THREADS:-$(nproc)}
bin=${TRAINER_BIN:-target/release/trainer}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
jobs=(jobs/mlp.toml bench/mlp1024.toml)

configs=("none:$threads:" "r1:$threads:1")
for ((n = 2; n <= threads; n *= 2)); do
  configs+=("r$n:$threads:$n" "1dev/$n:$((threads / n)):" "p$n:$((threads / n)):$n")
done

port=29600
rate() { # job threads replicas [processes] -> samples/s
  local sets=(--set device.type=\"cpu\" --set "train.threads=$2")
  local dir
  if [[ -n ${4:-} ]]; then
    port=$((port + 1))
    for ((rank = 1; rank < $4; rank++)); do
      RANK=$rank WORLD_SIZE=$4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        $bin run "$1" --runs-dir "$runs" --quiet "${sets[@]}" &
    done
    dir=$(RANK=0 WORLD_SIZE=$4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      $bin run "$1" --runs-dir "$runs" --quiet "${sets[@]}")
    wait
  else
    [[ -n $3 ]] && sets+=(--set "parallel.replicas=$3")
    dir=$($bin run "$1" --runs-dir "$runs" --quiet "${sets[@]}")
  fi
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$dir/summary.json"
  rm -rf "$dir"
}

echo "threads=$threads repeats=$repeats cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) commit=$(git rev-parse --short HEAD)"
results=$runs/results.txt
for job in "${jobs[@]}"; do
  for i in $(seq "$repeats"); do
    for config in "${configs[@]}"; do
      IFS=: read -r name t replicas <<<"$config"
      if [[ $name == p* ]]; then
        r=$(rate "$job" "$t" "" "$replicas")
      else
        r=$(rate "$job" "$t" "$replicas")
      fi
      echo "$job $name $r" >>"$results"
      printf '  %-20s run %d %-8s %10.0f samples/s\n' "$job" "$i" "$name" "$r"
    done
  done
done

python3 - "$results" <<'EOF'
import statistics, sys, collections
rates = collections.defaultdict(list)
for line in open(sys.argv[1]):
    job, name, r = line.split()
    rates[job, name].append(float(r))
median = {k: statistics.median(v) for k, v in rates.items()}
for job in dict.fromkeys(j for j, _ in median):
    m = {name: r for (j, name), r in median.items() if j == job}
    print(f"{job}: " + ", ".join(f"{name} {r:,.0f}" for name, r in m.items()) + " samples/s (medians)")
    print(f"  r1 / none = {m['r1'] / m['none']:.3f}")
    for name in m:
        if name.startswith("r") and name != "r1":
            n = int(name[1:])
            one = m[f"1dev/{n}"]
            print(f"  {name} / none = {m[name] / m['none']:.3f}   {name} / ({n} x 1dev/{n}) = {m[name] / (n * one):.3f}")
            p = m[f"p{n}"]
            print(f"  p{n} / r{n} = {p / m[name]:.3f}   p{n} / ({n} x 1dev/{n}) = {p / (n * one):.3f}")
EOF
