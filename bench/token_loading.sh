#!/bin/bash
# Command L: a 20-step run on llm.c token shards, its wall time and peak memory (RSS).
#   python3 bench/token_shards.py /tmp/shards 10      (1B tokens, 2 GB)
#   bench/token_loading.sh /tmp/shards [TRAINER_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
shards=$1
binary=${2:-target/release/trainer}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
/usr/bin/time -f "%e s wall, %M KB peak RSS" "$binary" run bench/token_loading.toml \
  --set "data.path=\"$shards/fineweb_train_*.bin\"" --runs-dir "$runs" -q > /dev/null
