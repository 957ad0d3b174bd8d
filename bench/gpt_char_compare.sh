#!/bin/bash
# Command C: jobs/gpt_char.toml against bench/gpt_char_torch.py, alternating, 2 threads each.
# Prints each round's tokens/s and ratio. trainer's rate is over steps 20 to 220.
#   bench/gpt_char_compare.sh [rounds]      (PYTHON=... to pick PyTorch's interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for round in $(seq 1 "${1:-5}"); do
  torch=$("$python" bench/gpt_char_torch.py 200 | grep -o '[0-9]* tokens/s' | cut -d' ' -f1)
  rm -rf "$runs/gpt_char"
  target/release/trainer run jobs/gpt_char.toml --set train.max_steps=220 \
    --set train.log_every=20 --runs-dir "$runs" -q > /dev/null 2>&1
  metrics=$(ls -d "$runs"/gpt_char/*/)metrics.csv
  ours=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i }
    $col["split"] == "train" && $col["step"] == 20 { from = $col["elapsed_s"] }
    $col["split"] == "train" && $col["step"] == 220 { to = $col["elapsed_s"] }
    END { printf "%.0f", 200 * 768 / (to - from) }' "$metrics")
  echo "round $round: pytorch $torch trainer $ours tokens/s, ratio $(awk "BEGIN { printf \"%.2f\", $ours / $torch }")"
done
