#!/bin/bash
# Command C (and H): a char GPT job against bench/gpt_char_torch.py at the same shape,
# alternating, 2 threads each. Prints each round's tokens/s and ratio.
#   bench/gpt_char_compare.sh [rounds] [gpt_char|llama_char|llama_gqa|gpt_shakespeare]
#   (PYTHON=... picks PyTorch)
# - gpt_char: jobs/gpt_char.toml as it is; trainer's rate over steps 20 to 220, PyTorch's
#   over 200 steps after 20 warm-up steps.
# - llama_char: jobs/llama_char.toml the same way, against ARCH=llama.
# - llama_gqa: llama_char with two key and value heads (kv_heads = 2), against KV_HEADS=2.
# - gpt_shakespeare: jobs/gpt_shakespeare.toml on the CPU in fp32 at batch 8 (2,048 tokens a
#   step, dropout 0.2); trainer's rate over steps 10 to 30, PyTorch's over 10 steps after 20.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
job=${2:-gpt_char}
kv=""
case $job in
  llama_gqa)
    job=llama_char kv=2 torch_args=(200) from=20 to=220 tokens=768
    sets=(--set train.max_steps=220 --set train.log_every=20 --set model.blocks.layers[1].out=256
      --set model.blocks.layers[2].kv_heads=2 --set model.blocks.layers[3].kv_heads=2) ;;
  gpt_char | llama_char)
    torch_args=(200) from=20 to=220 tokens=768
    sets=(--set train.max_steps=220 --set train.log_every=20) ;;
  gpt_shakespeare)
    torch_args=(10 8 256 384 6 6 0.2) from=10 to=30 tokens=2048
    sets=(--set device.type=cpu --set precision.mode=fp32 --set data.batch_size=8
      --set train.max_steps=30 --set train.log_every=5 --set train.eval_every_steps=1000
      --set checkpoint.every_steps=1000) ;;
  *) echo "unknown job $job: gpt_char, llama_char, llama_gqa or gpt_shakespeare" >&2; exit 2 ;;
esac
arch=gpt
[ "$job" = llama_char ] && arch=llama
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for round in $(seq 1 "${1:-5}"); do
  torch=$(ARCH=$arch KV_HEADS=$kv "$python" bench/gpt_char_torch.py "${torch_args[@]}" | grep -o '[0-9]* tokens/s' | cut -d' ' -f1)
  rm -rf "${runs:?}/$job"
  target/release/trainer run "jobs/$job.toml" "${sets[@]}" --runs-dir "$runs" -q > /dev/null 2>&1
  metrics=$(ls -d "$runs/$job"/*/)metrics.csv
  ours=$(awk -F, -v from="$from" -v to="$to" -v tokens="$tokens" 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i }
    $col["split"] == "train" && $col["step"] == from { t0 = $col["elapsed_s"] }
    $col["split"] == "train" && $col["step"] == to { t1 = $col["elapsed_s"] }
    END { printf "%.0f", (to - from) * tokens / (t1 - t0) }' "$metrics")
  echo "round $round: pytorch $torch trainer $ours tokens/s, ratio $(awk "BEGIN { printf \"%.2f\", $ours / $torch }")"
done
