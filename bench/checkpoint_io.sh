#!/usr/bin/env bash
# Checkpoint write and load times and sizes, from trainer's own log lines ("checkpoint ...
# (N MiB in S s)" for a write: download, write, fsync, rename, directory fsync, pruning;
# "read and verified checkpoint ... in S s" for a load: read, header and length check,
# XXH3 checksum, conversion). Needs a release build (cargo build --release) and, for the
# first case, Debian's dataset-fashion-mnist. RUNS_DIR (default: a temporary directory)
# must have room for 2.5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/trainer
runs=${RUNS_DIR:-$(mktemp -d)}
show() { sed -E 's/\x1b\[[0-9;]*m//g' | grep -E "checkpoint|resum" | sed -E 's/^ *INFO //; s#(/[^ ]*/)?checkpoints/#checkpoints/#'; }

echo "== jobs/fashion_mnist_mlp.toml (235,146 parameters, Adam): one epoch, then resume for a second"
dir=$($bin run jobs/fashion_mnist_mlp.toml --runs-dir "$runs" --set train.epochs=1 \
  --set checkpoint.every_epochs=1 2> >(show >&2))
$bin run jobs/fashion_mnist_mlp.toml --runs-dir "$runs" --resume "$dir" --set train.epochs=2 \
  2> >(show >&2) >/dev/null
ls -l "$dir/checkpoints" "$dir/model.safetensors" | grep safetensors

echo "== bench/mlp100m.toml (100,728,842 parameters, Adam): 2 steps with a checkpoint each, then resume for a third"
dir=$($bin run bench/mlp100m.toml --runs-dir "$runs" 2> >(show >&2))
$bin run bench/mlp100m.toml --runs-dir "$runs" --resume "$dir" --set train.max_steps=3 \
  2> >(show >&2) >/dev/null
ls -l "$dir/checkpoints" "$dir/model.safetensors" | grep safetensors
[ -n "${RUNS_DIR:-}" ] || rm -rf "$runs"
