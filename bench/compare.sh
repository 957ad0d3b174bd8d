#!/usr/bin/env bash
# Side by side on this machine, in one call: trainer against PyTorch (CPU) on the same
# recipes, alternating the two, `repeats` times each. Prints samples/s and the ratio.
#
#   bench/compare.sh [repeats]            (default 3)
#   CASES="resnet_small fashion_mnist_cnn" bench/compare.sh 3   (only these cases)
#
# Needs: a release build (cargo build --release), PyTorch in $PYTHON (default
# /work/torch-venv/bin/python), and Debian's dataset-fashion-mnist for the Fashion case.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
py=${PYTHON:-/work/torch-venv/bin/python}
threads=${THREADS:-2}
bin=target/release/trainer
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT

trainer_rate() { # job -> "samples/s accuracy"
  local dir
  # shellcheck disable=SC2086  # TRAINER_EXTRA is a list of arguments
  # The whole training set, as PyTorch's side trains on (the Fashion jobs hold out 10%).
  dir=$($bin run "$1" --runs-dir "$runs" --quiet --set train.threads=$threads --set data.val_fraction=0.0 ${TRAINER_EXTRA:-})
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); f=s["final"]; print(round(s["samples_per_sec"]), f.get("test_accuracy", "n/a"), round(s["wall_s"],2))' "$dir/summary.json"
}
torch_rate() {
  "$py" bench/pytorch_mlp.py --threads "$threads" "$@" | tail -1 |
    python3 -c 'import json,sys; s=json.loads(sys.stdin.read()); print(round(s["samples_per_sec"]), s["test_accuracy"] or "n/a", round(s["wall_s"],2))'
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

case_run() { # name, trainer job, pytorch args...
  local name=$1 job=$2; shift 2
  if [[ -n ${CASES:-} && " $CASES " != *" $name "* ]]; then return; fi
  local t_rates=() p_rates=()
  for _ in $(seq "$repeats"); do
    read -r tr ta tw < <(trainer_rate "$job"); t_rates+=("$tr")
    read -r pr pa pw < <(torch_rate "$@"); p_rates+=("$pr")
    echo "  $name: trainer $tr samples/s (acc ${ta:-n/a}, wall ${tw}s) | pytorch $pr samples/s (acc ${pa:-n/a}, wall ${pw}s)"
  done
  local t p
  t=$(printf '%s\n' "${t_rates[@]}" | median); p=$(printf '%s\n' "${p_rates[@]}" | median)
  echo "$name: median trainer $t / pytorch $p samples/s = $(python3 -c "print(f'{$t/$p:.2f}x')")"
}

echo "threads=$threads repeats=$repeats torch=$("$py" -c 'import torch; print(torch.__version__)') cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
case_run fashion_mnist_mlp jobs/fashion_mnist_mlp.toml --data fashion --layers 784,256,128,10 --batch 128 --epochs 10 --lr 1e-3
case_run mlp1024_b256 bench/mlp1024.toml --data synthetic --layers 784,1024,1024,10 --batch 256 --steps 200
# The CNN for one epoch (throughput; accuracy after 5 epochs is measured separately).
cnn_epochs=${CNN_EPOCHS:-1}
TRAINER_EXTRA="--set train.epochs=$cnn_epochs" case_run fashion_mnist_cnn jobs/fashion_mnist_cnn.toml \
  --model cnn --data fashion --batch 128 --epochs "$cnn_epochs" --lr 1e-3
# The ResNet for one epoch, with PyTorch's recipe: Adam 1e-3, no weight decay, no schedule.
TRAINER_EXTRA='--set train.epochs=1 --set optimizer.type="adam" --set optimizer.lr=1e-3
  --set optimizer.weight_decay=0 --set optimizer.schedule={type="constant"}' \
  case_run resnet_small jobs/resnet_small.toml --model resnet --data fashion --batch 128 --epochs 1 --lr 1e-3
