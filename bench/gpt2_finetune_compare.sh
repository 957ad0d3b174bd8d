#!/bin/bash
# GPT-2 small's training step on the CPU: jobs/gpt2_finetune.toml (fp32, random weights, no
# init_from) against bench/gpt2_finetune_torch.py, alternating, 2 threads each. Each side
# runs 2 warm-up steps, then STEPS timed steps of BATCH windows of BLOCK tokens.
#   bench/gpt2_finetune_compare.sh [rounds] [steps] [block] [batch]   (PYTHON=... for PyTorch)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
rounds=${1:-3} steps=${2:-6} block=${3:-256} batch=${4:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The job without its init_from: GPT-2's initialisation instead of downloaded weights.
sed -e '/^init_from = /d' -e 's|^state_dict_names = "nanogpt"|init = "gpt2"\n&|' \
  -e 's|^path = "data/|path = "'"$PWD"'/jobs/data/|' jobs/gpt2_finetune.toml > "$work/job.toml"
last=$((steps + 2))
for round in $(seq 1 "$rounds"); do
  torch=$("$python" bench/gpt2_finetune_torch.py "$steps" "$block" "$batch" |
    grep -o '[0-9]* tokens/s' | cut -d' ' -f1)
  rm -rf "$work/runs"
  target/release/trainer run "$work/job.toml" --runs-dir "$work/runs" -q \
    --set train.max_steps="$last" --set train.grad_accum_steps=1 --set train.log_every=1 \
    --set train.eval_every_steps=100000 --set data.block_size="$block" \
    --set data.batch_size="$batch" --set precision.mode='"fp32"' --set device.type='"cpu"' \
    > /dev/null 2>&1
  metrics=$(ls -d "$work"/runs/gpt2_finetune/*/)metrics.csv
  ours=$(awk -F, -v last="$last" -v tokens=$((steps * block * batch)) '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i }
    $col["split"] == "train" && $col["step"] == 2 { from = $col["elapsed_s"] }
    $col["split"] == "train" && $col["step"] == last { to = $col["elapsed_s"] }
    END { printf "%.0f", tokens / (to - from) }' "$metrics")
  echo "round $round: pytorch $torch trainer $ours tokens/s, ratio $(awk "BEGIN { printf \"%.2f\", $ours / $torch }")"
done
