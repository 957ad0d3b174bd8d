#!/usr/bin/env bash
# Short device calls with gpu.sh's helpers: `gemm` (default) puts the cuBLAS-bound MLP in
# fp32 and bf16 beside PyTorch, steady state, with and without cuBLASLt's epilogues; `nccl`
# alternates 1 replica through NCCL with no data parallelism, 3 times, on the launch-bound
# MLP 784-1024-1024-10 and on the cuBLAS-bound one (issue 7's overhead); `gpt` times
# jobs/gpt_shakespeare.toml (bf16) with attention's probabilities kept and with flash
# attention, profiles a step of each with CUDA events, times it with flash and no dropout,
# times jobs/llama_char.toml (rotary, silu and multiply) in fp32 and bf16 and with
# grouped-query attention, and times
# `trainer sample` on CUDA;
# `gpt2 [BATCH]` puts jobs/gpt2_124m.toml (bf16, micro-batch BATCH x 1024, 64 by default) beside
# PyTorch eager and compiled (bench/gpt2_torch_gpu.py): steady tokens/s and MFU, then profiles
# its attention beside PyTorch's flash attention alone (bench/attention_torch_gpu.py). About 4
# minutes on an H200.
set -uo pipefail
source .gpu/nccl.sh
eval "$(sed -n '/^out=/,/^}$/p' bench/gpu.sh)"
big=(--set device.type=\"cuda\" --set data.samples=40960 --set train.epochs=20)
if [ "${1:-gemm}" = gpt ]; then
  # No evaluation, so a checkpoint only at the end: the job's keep_best needs checkpoints
  # at evaluations.
  gpt=(--set device.type=\"cuda\" --set train.max_steps=300 --set train.eval_every_steps=100000
       --set checkpoint.every_steps=100000 --set train.log_every=50)
  for flash in false true; do
    log "== jobs/gpt_shakespeare.toml bf16, 300 steps, device.flash_attention=$flash"
    log "trainer: $(trainer jobs/gpt_shakespeare.toml "${gpt[@]}" --set device.flash_attention=$flash)"
    $bin profile jobs/gpt_shakespeare.toml --steps 5 --warmup 5 --runs-dir "$runs" --quiet \
      --set device.type=\"cuda\" --set device.flash_attention=$flash | tee -a "$out"
  done
  # Dropout's cost: the same job with every dropout at 0 (flash_mma.cu hashes each score).
  nodrop=$(mktemp --suffix=.toml)
  sed -e 's/p = 0.2/p = 0.0/g' -e 's/dropout = 0.2/dropout = 0.0/g' \
    -e "s|^path = \"data/|path = \"$PWD/jobs/data/|" jobs/gpt_shakespeare.toml > "$nodrop"
  log "== dropout 0, device.flash_attention=true"
  log "trainer: $(trainer "$nodrop" "${gpt[@]}" --set device.flash_attention=true)"
  for mode in fp32 bf16; do
    log "== jobs/llama_char.toml $mode, 300 steps, device.flash_attention=true"
    log "trainer: $(trainer jobs/llama_char.toml "${gpt[@]}" --set precision.mode=\"$mode\" \
      --set device.flash_attention=true)"
  done
  # Grouped-query attention: two key and value heads for four query heads.
  log "== jobs/llama_char.toml bf16, kv_heads = 2, 300 steps, device.flash_attention=true"
  log "trainer: $(trainer jobs/llama_char.toml "${gpt[@]}" --set precision.mode=\"bf16\" \
    --set device.flash_attention=true --set 'model.blocks.layers[1].out=256' \
    --set 'model.blocks.layers[2].kv_heads=2' --set 'model.blocks.layers[3].kv_heads=2')"
  dir=$($bin run jobs/gpt_shakespeare.toml "${gpt[@]}" --set train.max_steps=50 --runs-dir "$runs" --quiet)
  start=$(date +%s%N)
  $bin sample "$dir" --device cuda --prompt "ROMEO:" --tokens 500 --seed 1 > /dev/null
  log "sample on CUDA, 500 tokens: $(( ($(date +%s%N) - start) / 1000000 )) ms"
  exit 0
fi
if [ "${1:-gemm}" = gpt2 ]; then
  B=${2:-64}
  shards=$(mktemp -d)
  # 20M random GPT-2 ids: the speed does not depend on the text.
  python3 bench/token_shards.py "$shards" 1 20000000
  # A small validation file: the run's last evaluation reads all of it.
  python3 bench/token_shards.py "$shards/val" 1 1000000
  mv "$shards/val/fineweb_train_000000.bin" "$shards/fineweb_val_000000.bin"
  g2=(--set "data.path=\"$shards/fineweb_train_*.bin\"" --set "data.val_path=\"$shards/fineweb_val_*.bin\""
      --set data.batch_size=$B --set train.grad_accum_steps=1 --set train.max_steps=60
      --set train.log_every=10 --set train.eval_every_steps=100000 --set train.eval_steps=1
      --set checkpoint.every_steps=100000)
  log "== jobs/gpt2_124m.toml bf16, micro-batch $B x 1024, 60 steps"
  $bin check jobs/gpt2_124m.toml "${g2[@]}" | grep -E 'model FLOPs|total' | tee -a "$out"
  # Steady tokens/s and MFU: the train rows after the first (which holds the warm-up).
  steady() {
    python3 - "$1" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1] + "/metrics.csv")) if r["split"] == "train"][1:]
tps = sum(float(r["tokens_per_sec"]) for r in rows) / len(rows)
mfu = [float(r["mfu"]) for r in rows if r["mfu"]]
print(f"{tps:.0f} tokens/s steady, MFU {100 * sum(mfu) / len(mfu):.1f}%" if mfu else f"{tps:.0f} tokens/s steady")
PY
  }
  for flash in true false; do
    dir=$($bin run jobs/gpt2_124m.toml "${g2[@]}" --set device.flash_attention=$flash --runs-dir "$runs" --quiet)
    log "trainer, flash_attention=$flash: $(steady "$dir") $(summary "$dir")"
  done
  log "$(python3 bench/gpt2_torch_gpu.py --batch "$B" --steps 60 2>&1 | tail -1)"
  log "$(python3 bench/gpt2_torch_gpu.py --batch "$B" --steps 60 --compile 2>&1 | tail -1)"
  $bin profile jobs/gpt2_124m.toml "${g2[@]}" --steps 3 --warmup 3 --runs-dir "$runs" --quiet \
    | grep -E 'attention|^step|model FLOPs|memory' | tee -a "$out"
  # PyTorch's flash attention alone at the same shape: the profile's attention rows beside it.
  log "$(python3 bench/attention_torch_gpu.py --batch "$B" 2>&1 | tail -1)"
  exit 0
fi
if [ "${1:-gemm}" = nccl ]; then
  mid=(--set device.type=\"cuda\" --set data.samples=25600 --set train.epochs=10 --set train.log_every=100)
  for rep in 1 2 3; do
    log "== MLP 784-1024-1024-10 batch 256, 1000 steps (repeat $rep)"
    log "no data parallelism: $(trainer bench/mlp1024.toml "${mid[@]}")"
    log "1 replica through NCCL: $(trainer bench/mlp1024.toml "${mid[@]}" --set parallel.replicas=1)"
  done
  log "== MLP 784-4096x3-10 batch 4096, 200 steps"
  log "no data parallelism: $(trainer bench/mlp4096.toml "${big[@]}")"
  log "1 replica through NCCL: $(trainer bench/mlp4096.toml "${big[@]}" --set parallel.replicas=1)"
  exit 0
fi
for mode in fp32 bf16; do
  log "check $mode 4096: $(check4096 "$mode")"
  amp=$([ $mode = bf16 ] && echo "--amp bf16" || echo "")
  log "== MLP 784-4096x3-10 batch 4096 Adam $mode, 200 steps"
  log "trainer: $(trainer bench/mlp4096.toml "${big[@]}" --set precision.mode=\"$mode\")"
  log "trainer, bias and ReLU in passes of their own: $(trainer bench/mlp4096.toml "${big[@]}" --set precision.mode=\"$mode\" --set device.fused_epilogues=false)"
  log "pytorch: $(pytorch --data synthetic --layers 784,4096,4096,4096,10 --batch 4096 --steps 200 $amp)"
done
python3 bench/issue5_summary.py "$out" | tee -a "$out"
