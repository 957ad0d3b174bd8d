#!/usr/bin/env bash
# Steady-state trainer vs PyTorch for the cuBLAS-bound MLP only (gpu.sh's helpers), for
# checking a change to the large-GEMM path inside a short device call.
set -uo pipefail
source .gpu/nccl.sh
eval "$(sed -n '/^out=/,/^pytorch()/p' bench/gpu.sh)"
big=(--set device.type=\"cuda\" --set data.samples=40960 --set train.epochs=20)
for mode in fp32 bf16; do
  amp=$([ $mode = bf16 ] && echo "--amp bf16" || echo "")
  log "== MLP 784-4096x3-10 batch 4096 Adam $mode, 200 steps"
  log "trainer: $(trainer bench/mlp4096.toml "${big[@]}" --set precision.mode=\"$mode\")"
  log "pytorch: $(pytorch --data synthetic --layers 784,4096,4096,4096,10 --batch 4096 --steps 200 $amp)"
done
