#!/usr/bin/env bash
# Two trainer binaries side by side on the same jobs, alternating, `repeats` times each:
# median samples/s of each and their ratio. For a refactor that must not change speed.
#
#   bench/binaries.sh OLD_BINARY NEW_BINARY [repeats] -- JOB [--set ...] [-- JOB ...]
#
# Example (the binary at an earlier commit against this checkout's):
#   git worktree add /tmp/old 54707b9 && (cd /tmp/old && cargo build --release)
#   bench/binaries.sh /tmp/old/target/release/trainer target/release/trainer 5 \
#     -- jobs/mlp.toml --set train.epochs=300 -- bench/mlp1024.toml
set -euo pipefail
old=$1 new=$2
shift 2
repeats=3
if [[ ${1:-} != -- ]]; then repeats=$1; shift; fi
[[ ${1:-} == -- ]] || { echo "usage: $0 OLD NEW [repeats] -- JOB [args] [-- JOB [args]]" >&2; exit 2; }
shift
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
threads=${THREADS:-2}

rate() { # binary, job and its arguments -> samples/s
  local bin=$1 dir
  shift
  dir=$("$bin" run "$@" --runs-dir "$runs" --quiet --set train.threads="$threads" 2>/dev/null)
  python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["samples_per_sec"]))' "$dir/summary.json"
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

compare() {
  local olds=() news=()
  for _ in $(seq "$repeats"); do
    olds+=("$(rate "$old" "$@")")
    news+=("$(rate "$new" "$@")")
  done
  local o n
  o=$(printf '%s\n' "${olds[@]}" | median)
  n=$(printf '%s\n' "${news[@]}" | median)
  echo "$* | old ${olds[*]} | new ${news[*]} | median $o -> $n = $(python3 -c "print(f'{$n/$o:.2f}x')")"
}

echo "threads=$threads repeats=$repeats cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
job=()
for arg in "$@" --; do
  if [[ $arg == -- ]]; then
    [[ ${#job[@]} -gt 0 ]] && compare "${job[@]}"
    job=()
  else
    job+=("$arg")
  fi
done
