#!/usr/bin/env bash
# The CUDA tests on the emulated GPU (driver.cpp: the driver API, cuBLAS and NCCL on the
# host), so that the CUDA backend's code runs where no GPU is: every test that needs CUDA,
# with TRAINER_REQUIRE_CUDA=1 so that none of them skips. Needs libnvrtc on LD_LIBRARY_PATH (it
# compiles the kernels, whose image the emulator then ignores; .ci/run installs one), a C++
# compiler and python3. Arguments are name filters, in place of the areas with GPU tests.
#
#   tests/emulated_cuda/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${TMPDIR:-/tmp}/trainer-emulated-gpu"
tests/emulated_cuda/build.sh "$dir"
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Two emulated GPUs, so that the two-GPU NCCL test runs too.
export TRAINER_REQUIRE_CUDA=1 TRAINER_CACHE_DIR="$dir/kernel-cache" TRAINER_EMULATED_GPUS=2
# The areas with GPU tests (the others are the same with or without a GPU).
if [ $# -eq 0 ]; then
  set -- cuda_parity:: training_reference:: multiprocess:: cli:: nonfinite:: ops:: primitives:: profile::
  cargo test --test steady_state
fi
cargo test --test suite -- "$@"
