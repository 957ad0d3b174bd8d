#!/usr/bin/env bash
# Multi-process data parallelism against PyTorch DDP (gloo) on the CPU, in one call:
# bench/mlp1024.toml (784-1024-1024-10, global batch 256, Adam) on RANKS processes of
# THREADS threads each (defaults 2 and 1), trainer (RANK/WORLD_SIZE on loopback) and
# bench/pytorch_ddp.py alternating, REPEATS times each (default 5); prints the medians and
# trainer / PyTorch.
#
#   cargo build --release && PYTHON=/path/to/venv/bin/python bench/ddp_compare.sh [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-5}
ranks=${RANKS:-2}
threads=${THREADS:-1}
python=${PYTHON:-python3}
bin=${TRAINER_BIN:-target/release/trainer}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
port=29800

trainer_rate() {
  port=$((port + 1))
  local sets=(--quiet --runs-dir "$runs" --set device.type=\"cpu\" --set "train.threads=$threads")
  for ((rank = 1; rank < ranks; rank++)); do
    RANK=$rank WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      $bin run bench/mlp1024.toml "${sets[@]}" &
  done
  local dir
  dir=$(RANK=0 WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    $bin run bench/mlp1024.toml "${sets[@]}")
  wait
  $python -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$dir/summary.json"
}

torch_rate() {
  port=$((port + 1))
  $python bench/pytorch_ddp.py --ranks "$ranks" --threads "$threads" --port $port |
    $python -c 'import json,sys; print(json.loads(sys.stdin.read().splitlines()[-1])["samples_per_sec"])'
}

echo "ranks=$ranks threads=$threads repeats=$repeats torch=$($python -c 'import torch; print(torch.__version__)') commit=$(git rev-parse --short HEAD)"
t=() p=()
for i in $(seq "$repeats"); do
  t+=("$(trainer_rate)")
  p+=("$(torch_rate)")
  printf '  run %d  trainer %8.0f  pytorch-ddp %8.0f samples/s\n' "$i" "${t[-1]}" "${p[-1]}"
done
$python - "${t[*]}" "${p[*]}" <<'PY'
import statistics, sys
t = statistics.median(map(float, sys.argv[1].split()))
p = statistics.median(map(float, sys.argv[2].split()))
print(f"medians: trainer {t:,.0f}  pytorch-ddp {p:,.0f} samples/s  trainer / pytorch = {t / p:.2f}")
PY
