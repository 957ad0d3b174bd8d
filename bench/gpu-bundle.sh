#!/usr/bin/env bash
# Builds .gpu/ for a GPU session, within the device tool's 64 MiB carry (the working tree
# included): ../shared/tools/gpu-bundle with release binaries built without debug info and
# stripped (the everyday release profile keeps line tables for perf: 75 MB a binary), then
# only the test binaries that hold GPU tests, bench/gpu.sh as the benchmark, and the
# Fashion-MNIST files when they still fit.
#
#   bench/gpu-bundle.sh
#   then device calls, each with carry [".gpu"] (a call may run 10 minutes at most):
#     bash .gpu/tests.sh kernels parity     every kernel and whole jobs against the CPU and PyTorch
#     bash .gpu/tests.sh multiprocess       NCCL and the launcher on the GPU
#     bash .gpu/bench.sh                    the H100 tables (bench/gpu.sh)
#
# Both find libnccl.so.2 (which PyTorch's wheels ship) and expose it as libnccl.so, the name
# cudarc loads. Results come back under $OUT: tests.log, gpu-bench.txt.
# Afterwards, `cargo build --release` rebuilds the everyday profile.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols "$top/../shared/tools/gpu-bundle"

# The GPU tests live in these binaries; the rest are CPU tests, run by CI.
for t in .gpu/tests/*; do
  case "$(basename "$t")" in
    suite-test | steady_state-test) ;;
    *) rm "$t" ;;
  esac
done
cp bench/gpu.sh .gpu/bench-inner.sh
# gpu-bundle's run.sh runs every test binary and more in one call, past a call's 10 minutes.
rm -f .gpu/run.sh

cat > .gpu/nccl.sh <<'EOF'
# Sourced: makes NCCL loadable as libnccl.so (cudarc's name) from wherever libnccl.so.2 is.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so '; then
  nccl=$(find / -name 'libnccl.so.2*' -not -path '*/proc/*' 2>/dev/null | head -n 1)
  if [ -n "$nccl" ]; then
    d=$(mktemp -d); ln -s "$nccl" "$d/libnccl.so"
    export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
EOF

cat > .gpu/tests.sh <<'EOF'
#!/usr/bin/env bash
# The GPU tests named (kernels, parity, multiprocess; all when none is named).
# TRAINER_REQUIRE_CUDA=1 makes a test that needs a GPU fail rather than skip.
set -u
source .gpu/nccl.sh
export TRAINER_REQUIRE_CUDA=1 RUST_BACKTRACE=1 TRAINER_BIN="$PWD/.gpu/trainer"
export PATH="$PWD/.gpu:$PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
.gpu/trainer devices
fail=0
run() {
  local name=$1 log="${OUT:-/tmp}/tests-$1.log"
  shift
  echo "=== $name"
  timeout 540 "$@" --test-threads=1 > "$log" 2>&1 || { echo "FAILED: $name"; fail=1; }
  grep -E "^test .*FAILED|panicked at|^test result" "$log" | head -n 30
}
# The suite's tests in module $1 whose names match the pattern $2, for --exact.
tests_in() {
  .gpu/tests/suite-test --list 2>/dev/null | sed -n 's/: test$//p' | grep -E "^$1::.*($2)"
}
for what in ${@:-kernels parity multiprocess}; do
  case $what in
    kernels) run kernels .gpu/tests/suite-test cuda_kernels:: ;;
    parity)
      run parity .gpu/tests/suite-test cuda_parity::
      # Whole runs on the GPU against PyTorch's (tests/fixtures/training_reference.json), and
      # in bf16 and fp16 against the CPU.
      run reference .gpu/tests/suite-test --exact $(tests_in training_reference on_cuda)
      # No host allocation in a CUDA step, through the real driver.
      run steady .gpu/tests/steady_state-test cuda ;;
    # Its GPU tests (the others are CPU tests, run by CI).
    multiprocess)
      run multiprocess .gpu/tests/suite-test --exact $(tests_in multiprocess 'gpu|nccl|streamed|refused') ;;
    *) echo "unknown: $what"; fail=1 ;;
  esac
done
echo "gpu tests: $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail
EOF

cat > .gpu/bench.sh <<'EOF'
#!/usr/bin/env bash
source .gpu/nccl.sh
bash .gpu/bench-inner.sh
EOF

if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  mkdir -p .gpu/data
  cp /usr/share/datasets/fashion-mnist/*.gz .gpu/data/
fi
size() { du -sbc .gpu $(git ls-files) 2>/dev/null | tail -n 1 | cut -f1; }
if [ "$(size)" -gt $((62 << 20)) ]; then
  echo "over the carry limit with Fashion-MNIST: left out (gpu.sh skips those jobs)"
  rm -rf .gpu/data
fi
echo ".gpu and the working tree: $(( $(size) >> 20 )) MiB"
ls -la .gpu .gpu/tests
