#!/bin/bash
# Command L: a 20-step run on llm.c token shards: its wall time, and its peak memory split
# into heap (RssAnon) and mapped files (RssFile: the page cache a mapping shows; 0 where the
# files are read, not mapped).
#   python3 bench/token_shards.py /tmp/shards 10      (1B tokens, 2 GB)
#   bench/token_loading.sh /tmp/shards [TRAINER_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
shards=$1
binary=${2:-target/release/trainer}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
start=$(date +%s.%N)
"$binary" run bench/token_loading.toml --set "data.path=\"$shards/fineweb_train_*.bin\"" \
  --runs-dir "$runs" -q > /dev/null &
pid=$!
anon=0 file=0
while kill -0 "$pid" 2> /dev/null; do
  read -r a f < <(awk '/^RssAnon/ { a = $2 } /^RssFile/ { f = $2 } END { print a + 0, f + 0 }' \
    "/proc/$pid/status" 2> /dev/null || echo "0 0")
  ((a > anon)) && anon=$a
  ((f > file)) && file=$f
  sleep 0.2
done
wait "$pid"
end=$(date +%s.%N)
awk -v s="$start" -v e="$end" -v a="$anon" -v f="$file" 'BEGIN {
  printf "%.1f s wall, peak heap %.2f GB, peak mapped files %.2f GB\n", e - s, a / 1048576, f / 1048576 }'
