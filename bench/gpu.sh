#!/usr/bin/env bash
# The GPU benchmarks, for a session lent a GPU machine: bench/gpu-bundle.sh carries this
# script as .gpu/bench-inner.sh, and `bash .gpu/bench.sh` runs it there (after the GPU tests,
# `bash .gpu/tests.sh`). It measures, side by side in the same call: trainer (cuda) against
# PyTorch eager on the GPU, start-up cold and warm, and predicted against measured device
# memory. Results land in $OUT/gpu-bench.txt.
#
# Each trainer line gives steady_sps: samples/s over the metrics rows after the first log
# window, which holds the warm-up (cuBLAS loading its kernels, the CUDA graph's recording).
# That is the figure to set beside PyTorch's, whose script skips 5 warm-up steps.
# samples_per_sec is the whole run's, warm-up included.
set -uo pipefail
out="${OUT:-/tmp}/gpu-bench.txt"
bin=.gpu/trainer
runs=$(mktemp -d)
log() { echo "$*" | tee -a "$out"; }
cat > "$runs/summary.py" <<'PY'
import csv, json, sys
d = sys.argv[1]
s = json.load(open(d + "/summary.json"))
rows = [r for r in csv.DictReader(open(d + "/metrics.csv"))
        if r["split"] == "train" and r["samples_per_sec"]]
samples = seconds = 0.0
for a, b in zip(rows, rows[1:]):
    n = (int(b["step"]) - int(a["step"])) * int(b["global_batch"])
    samples += n
    seconds += n / float(b["samples_per_sec"])
keys = ["samples_per_sec", "wall_s", "startup_s", "memory_planned_bytes",
        "device_memory_peak_bytes", "cuda_graph_recordings"]
print(json.dumps({"steady_sps": round(samples / seconds) if seconds else None}
                 | {k: s.get(k) for k in keys}
                 | {"test_accuracy": s.get("final", {}).get("test_accuracy")}))
PY
summary() { python3 "$runs/summary.py" "$1"; }
trainer() { local dir; dir=$($bin run "$@" --runs-dir "$runs" --quiet) && summary "$dir"; }
pytorch() { python3 bench/pytorch_mlp.py --device cuda "$@" | tail -1; }
# `trainer check`'s activation memory of the cuBLAS-bound MLP in a precision, on one line.
check4096() {
  $bin check bench/mlp4096.toml --set device.type=\"cuda\" --set precision.mode=\"$1\" \
    | grep -E '^  activation' | tr -s ' ' | paste -sd ';'
}

log "== devices"; $bin devices | tee -a "$out"
export TRAINER_CACHE_DIR=$(mktemp -d)
log "== start-up, cold (NVRTC compiles) then warm (cache)"
log "cold: $(trainer jobs/mlp.toml --set device.type=\"cuda\" --set train.epochs=1)"
log "warm: $(trainer jobs/mlp.toml --set device.type=\"cuda\" --set train.epochs=1)"

cuda=(--set device.type=\"cuda\")
# Launch-bound: a small MLP at batch 64, where CUDA graphs matter most. 2000 steps.
small=("${cuda[@]}" --set 'model.layers=[{type="linear",out=256},{type="relu"},{type="linear",out=128},{type="relu"},{type="linear",out=10}]' --set data.batch_size=64 --set data.samples=12800 --set train.epochs=10 --set train.log_every=100)
# Issue 3's launch-bound table: 1000 steps.
mid=("${cuda[@]}" --set data.samples=25600 --set train.epochs=10 --set train.log_every=100)
# cuBLAS-bound: 200 steps.
big=("${cuda[@]}" --set data.samples=40960 --set train.epochs=20)
for mode in fp32 bf16; do
  log "check $mode 4096: $(check4096 "$mode")"
done
for rep in 1 2; do
  log "== MLP 784-256-128-10 batch 64 Adam fp32, 2000 steps (repeat $rep)"
  log "trainer: $(trainer bench/mlp1024.toml "${small[@]}")"
  log "trainer, no CUDA graphs: $(trainer bench/mlp1024.toml "${small[@]}" --set device.cuda_graphs=false)"
  log "pytorch: $(pytorch --data synthetic --layers 784,256,128,10 --batch 64 --steps 2000)"
  log "== MLP 784-1024-1024-10 batch 256 Adam fp32, 1000 steps (repeat $rep)"
  log "trainer: $(trainer bench/mlp1024.toml "${mid[@]}")"
  log "trainer, no CUDA graphs: $(trainer bench/mlp1024.toml "${mid[@]}" --set device.cuda_graphs=false)"
  log "trainer, 1 replica through NCCL: $(trainer bench/mlp1024.toml "${mid[@]}" --set parallel.replicas=1)"
  log "trainer again, no data parallelism: $(trainer bench/mlp1024.toml "${mid[@]}")"
  log "trainer, 1 replica through NCCL, a bucket per layer (0.01 MiB): $(trainer bench/mlp1024.toml "${mid[@]}" --set parallel.replicas=1 --set parallel.bucket_mb=0.01)"
  log "trainer, 1 replica through NCCL, averaged after backward: $(trainer bench/mlp1024.toml "${mid[@]}" --set parallel.replicas=1 --set parallel.overlap=false)"
  log "trainer, data streamed from pinned host memory: $(trainer bench/mlp1024.toml "${mid[@]}" --set device.data=\"streamed\")"
  log "pytorch: $(pytorch --data synthetic --layers 784,1024,1024,10 --batch 256 --steps 1000)"
  log "== MLP 784-4096x3-10 batch 4096 Adam fp32, 200 steps (repeat $rep)"
  log "trainer: $(trainer bench/mlp4096.toml "${big[@]}")"
  log "trainer, bias and ReLU in passes of their own: $(trainer bench/mlp4096.toml "${big[@]}" --set device.fused_epilogues=false)"
  log "pytorch: $(pytorch --data synthetic --layers 784,4096,4096,4096,10 --batch 4096 --steps 200)"
  log "== the same in bf16 mixed precision (issue 5: against fp32 above and autocast)"
  log "trainer: $(trainer bench/mlp4096.toml "${big[@]}" --set precision.mode=\"bf16\")"
  log "trainer, bias and ReLU in passes of their own: $(trainer bench/mlp4096.toml "${big[@]}" --set precision.mode=\"bf16\" --set device.fused_epilogues=false)"
  log "pytorch: $(pytorch --data synthetic --layers 784,4096,4096,4096,10 --batch 4096 --steps 200 --amp bf16)"
  log "== the same in fp16 mixed precision with dynamic loss scaling"
  log "trainer: $(trainer bench/mlp4096.toml "${big[@]}" --set precision.mode=\"fp16\")"
done
# Issue 4: activation checkpointing on the GPU, bench/mlp8.toml (8 linear layers of 1024) at
# batch 4096, 200 steps: planned and measured device memory, and steady samples/s.
ckpt=("${cuda[@]}" --set data.batch_size=4096 --set data.samples=40960 --set train.epochs=20 --set train.max_steps=200)
log "== bench/mlp8.toml batch 4096, activation checkpointing"
for mode in '"none"' '{segments=4}'; do
  log "check $mode: $($bin check bench/mlp8.toml "${ckpt[@]}" --set "checkpoint.activations=$mode" | grep -E '^  activations|^activation checkpointing' | tr '\n' ' ')"
done
for rep in 1 2; do
  for mode in '"none"' '{segments=4}'; do
    log "trainer $mode: $(trainer bench/mlp8.toml "${ckpt[@]}" --set "checkpoint.activations=$mode")"
  done
done
log "== MLP 784-1024-1024-10: 2 launched processes sharing cuda:0 (gradients over tcp)"
log "trainer: $(trainer bench/mlp1024.toml "${mid[@]}" --set 'parallel.devices=["cuda:0","cuda:0"]')"
if [ -f .gpu/data/train-images-idx3-ubyte.gz ]; then
  d=.gpu/data
  sets=("${cuda[@]}" --set data.train_images=\"$PWD/$d/train-images-idx3-ubyte.gz\" --set data.train_labels=\"$PWD/$d/train-labels-idx1-ubyte.gz\" --set data.test_images=\"$PWD/$d/t10k-images-idx3-ubyte.gz\" --set data.test_labels=\"$PWD/$d/t10k-labels-idx1-ubyte.gz\" --set data.val_fraction=0.0)
  log "== jobs/fashion_mnist_mlp.toml end to end"
  log "trainer: $(trainer jobs/fashion_mnist_mlp.toml "${sets[@]}")"
  log "pytorch: $(pytorch --data fashion --data-dir $d --layers 784,256,128,10 --batch 128 --epochs 10)"
  log "== jobs/fashion_mnist_cnn.toml end to end (issue 6)"
  log "trainer: $(trainer jobs/fashion_mnist_cnn.toml "${sets[@]}")"
  log "trainer bf16 (issue 5: memory and accuracy against fp32 above): $(trainer jobs/fashion_mnist_cnn.toml "${sets[@]}" --set precision.mode=\"bf16\")"
  log "pytorch: $(pytorch --model cnn --data fashion --data-dir $d --batch 128 --epochs 5)"
  log "== jobs/resnet_small.toml (issue 6)"
  log "trainer: $(trainer jobs/resnet_small.toml "${sets[@]}")"
else
  log "== Fashion-MNIST not carried (.gpu/data): skipped"
fi
log "== issue 5's figures (bench/issue5_summary.py)"
python3 bench/issue5_summary.py "$out" | tee -a "$out"
