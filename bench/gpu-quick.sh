#!/usr/bin/env bash
# Short device calls with gpu.sh's helpers: `gemm` (default) puts the cuBLAS-bound MLP in
# fp32 and bf16 beside PyTorch, steady state, with and without cuBLASLt's epilogues; `nccl`
# alternates 1 replica through NCCL with no data parallelism, 3 times, on the launch-bound
# MLP 784-1024-1024-10 and on the cuBLAS-bound one (issue 7's overhead); `gpt` times
# jobs/gpt_shakespeare.toml (bf16) with attention's probabilities kept and with flash
# attention, profiles a step of each with CUDA events, and times `trainer sample` on CUDA.
set -uo pipefail
source .gpu/nccl.sh
eval "$(sed -n '/^out=/,/^}$/p' bench/gpu.sh)"
big=(--set device.type=\"cuda\" --set data.samples=40960 --set train.epochs=20)
if [ "${1:-gemm}" = gpt ]; then
  gpt=(--set device.type=\"cuda\" --set train.max_steps=300 --set train.eval_every_steps=100000
       --set train.log_every=50)
  for flash in false true; do
    log "== jobs/gpt_shakespeare.toml bf16, 300 steps, device.flash_attention=$flash"
    log "trainer: $(trainer jobs/gpt_shakespeare.toml "${gpt[@]}" --set device.flash_attention=$flash)"
    $bin profile jobs/gpt_shakespeare.toml --steps 5 --warmup 5 --runs-dir "$runs" --quiet \
      --set device.type=\"cuda\" --set device.flash_attention=$flash | tee -a "$out"
  done
  dir=$($bin run jobs/gpt_shakespeare.toml "${gpt[@]}" --set train.max_steps=50 --runs-dir "$runs" --quiet)
  start=$(date +%s%N)
  $bin sample "$dir" --device cuda --prompt "ROMEO:" --tokens 500 --seed 1 > /dev/null
  log "sample on CUDA, 500 tokens: $(( ($(date +%s%N) - start) / 1000000 )) ms"
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
