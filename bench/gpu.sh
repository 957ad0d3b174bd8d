#!/usr/bin/env bash
# The GPU benchmarks, for a session lent a GPU machine: bench/gpu-bundle.sh carries this
# script as .gpu/bench-inner.sh, and `bash .gpu/bench.sh` runs it there (after the GPU tests,
# `bash .gpu/tests.sh`). It measures, side by side in the same call: trainer (cuda) against
# PyTorch eager on the GPU, start-up cold and warm, and predicted against measured device
# memory. Results land in $OUT/gpu-bench.txt.
set -uo pipefail
out="${OUT:-/tmp}/gpu-bench.txt"
bin=.gpu/trainer
runs=$(mktemp -d)
log() { echo "$*" | tee -a "$out"; }
summary() { python3 -c 'import json,sys; s=json.load(open(sys.argv[1]+"/summary.json")); f=s.get("final",{}); print(json.dumps({k: s.get(k) for k in ["samples_per_sec","wall_s","startup_s","memory_planned_bytes","device_memory_peak_bytes","cuda_graph_recordings"]} | {"test_accuracy": f.get("test_accuracy")}))' "$1"; }
trainer() { local dir; dir=$($bin run "$@" --runs-dir "$runs" --quiet) && summary "$dir"; }

log "== devices"; $bin devices | tee -a "$out"
export TRAINER_CACHE_DIR=$(mktemp -d)
log "== start-up, cold (NVRTC compiles) then warm (cache)"
log "cold: $(trainer jobs/mlp.toml --set device.type=\"cuda\" --set train.epochs=1)"
log "warm: $(trainer jobs/mlp.toml --set device.type=\"cuda\" --set train.epochs=1)"

for rep in 1 2; do
  # Launch-bound: a small MLP at batch 64, where CUDA graphs matter most.
  small=(--set device.type=\"cuda\" --set 'model.layers=[{type="linear",out=256},{type="relu"},{type="linear",out=128},{type="relu"},{type="linear",out=10}]' --set data.batch_size=64 --set data.samples=128000)
  log "== MLP 784-256-128-10 batch 64 Adam fp32, 2000 steps (repeat $rep)"
  log "trainer: $(trainer bench/mlp1024.toml "${small[@]}")"
  log "trainer, no CUDA graphs: $(trainer bench/mlp1024.toml "${small[@]}" --set device.cuda_graphs=false)"
  log "pytorch: $(python3 bench/pytorch_mlp.py --device cuda --data synthetic --layers 784,256,128,10 --batch 64 --steps 2000 | tail -1)"
  log "== MLP 784-1024-1024-10 batch 256 Adam fp32, 200 steps (repeat $rep)"
  log "trainer: $(trainer bench/mlp1024.toml --set device.type=\"cuda\")"
  log "trainer, no CUDA graphs: $(trainer bench/mlp1024.toml --set device.type=\"cuda\" --set device.cuda_graphs=false)"
  log "trainer, 1 replica through NCCL: $(trainer bench/mlp1024.toml --set device.type=\"cuda\" --set parallel.replicas=1)"
  log "trainer, 1 replica through NCCL, a bucket per layer (0.01 MiB): $(trainer bench/mlp1024.toml --set device.type=\"cuda\" --set parallel.replicas=1 --set parallel.bucket_mb=0.01)"
  log "trainer, 1 replica through NCCL, averaged after backward: $(trainer bench/mlp1024.toml --set device.type=\"cuda\" --set parallel.replicas=1 --set parallel.overlap=false)"
  log "trainer, data streamed from pinned host memory: $(trainer bench/mlp1024.toml --set device.type=\"cuda\" --set device.data=\"streamed\")"
  log "trainer, 2 launched processes sharing cuda:0 (tcp): $(trainer bench/mlp1024.toml --set device.type=\"cuda\" --set 'parallel.devices=["cuda:0","cuda:0"]')"
  log "pytorch: $(python3 bench/pytorch_mlp.py --device cuda --data synthetic --layers 784,1024,1024,10 --batch 256 --steps 200 | tail -1)"
  log "== MLP 784-4096x3-10 batch 4096 Adam fp32, 50 steps (repeat $rep)"
  log "trainer: $(trainer bench/mlp4096.toml --set device.type=\"cuda\")"
  log "pytorch: $(python3 bench/pytorch_mlp.py --device cuda --data synthetic --layers 784,4096,4096,4096,10 --batch 4096 --steps 50 | tail -1)"
  log "== the same in bf16 mixed precision (issue 5: against fp32 above and autocast)"
  log "trainer: $(trainer bench/mlp4096.toml --set device.type=\"cuda\" --set precision.mode=\"bf16\")"
  log "pytorch: $(python3 bench/pytorch_mlp.py --device cuda --data synthetic --layers 784,4096,4096,4096,10 --batch 4096 --steps 50 --amp bf16 | tail -1)"
done
if [ -f .gpu/data/train-images-idx3-ubyte.gz ]; then
  d=.gpu/data
  sets=(--set device.type=\"cuda\" --set data.train_images=\"$PWD/$d/train-images-idx3-ubyte.gz\" --set data.train_labels=\"$PWD/$d/train-labels-idx1-ubyte.gz\" --set data.test_images=\"$PWD/$d/t10k-images-idx3-ubyte.gz\" --set data.test_labels=\"$PWD/$d/t10k-labels-idx1-ubyte.gz\")
  log "== jobs/fashion_mnist_mlp.toml end to end"
  log "trainer: $(trainer jobs/fashion_mnist_mlp.toml "${sets[@]}")"
  log "pytorch: $(python3 bench/pytorch_mlp.py --device cuda --data fashion --data-dir $d --layers 784,256,128,10 --batch 128 --epochs 10 | tail -1)"
  log "== jobs/fashion_mnist_cnn.toml end to end (issue 6)"
  log "trainer: $(trainer jobs/fashion_mnist_cnn.toml "${sets[@]}")"
  log "pytorch: $(python3 bench/pytorch_mlp.py --device cuda --model cnn --data fashion --data-dir $d --batch 128 --epochs 5 | tail -1)"
else
  log "== Fashion-MNIST not carried (.gpu/data): skipped"
fi
