#!/usr/bin/env bash
# Mixed precision on the CPU against PyTorch's CPU autocast, side by side: jobs/
# fashion_mnist_mlp.toml for 3 epochs in each precision.mode, and bench/pytorch_mlp.py with
# --amp in the same half type (fp16 with GradScaler), alternating, 2 threads each.
#   cargo build --release && bench/amp_cpu.sh [ROUNDS]    (needs the Fashion-MNIST data)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
py=${PYTHON:-/work/torch-venv/bin/python}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for round in $(seq "$rounds"); do
  for mode in fp32 bf16 fp16; do
    dir=$(target/release/trainer run jobs/fashion_mnist_mlp.toml --runs-dir "$runs" --quiet \
      --set train.threads=2 --set train.epochs=3 --set data.val_fraction=0.0 --set "precision.mode=\"$mode\"")
    ours=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(round(s["samples_per_sec"]), s["final"]["test_accuracy"])' "$dir/summary.json")
    amp=$([[ $mode == fp32 ]] && echo none || echo "$mode")
    theirs=$("$py" bench/pytorch_mlp.py --threads 2 --epochs 3 --amp "$amp" | tail -1 |
      python3 -c 'import json,sys; s=json.loads(sys.stdin.read()); print(round(s["samples_per_sec"]), round(s["test_accuracy"], 4))')
    echo "round $round $mode: trainer $ours | pytorch $theirs (samples/s, test accuracy)"
  done
done
