#!/usr/bin/env bash
# Builds the emulated GPU (tests/emulated_cuda/driver.cpp) into DIR as libcuda.so, with
# libcublas.so, libcublasLt.so and libnccl.so naming the same library: put DIR first on
# LD_LIBRARY_PATH (with a real libnvrtc after it) and the CUDA tests run on the host.
# Usage: build.sh DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
out=${1:?usage: build.sh DIR}
mkdir -p "$out"
# The kernel program as NVRTC gets it: common.cuh, then the files in kernels.rs' order (its
# include_str! paths are relative to src/tensor/cuda).
files=$(grep -o 'include_str!("[^"]*\.cu")' "$top/src/tensor/cuda/kernels.rs" | sed 's/include_str!("\(.*\)")/\1/')
(cd "$top/src/tensor/cuda" && cat ../../../kernels/common.cuh $files) > "$out/kernels.cu"
python3 "$here/kernel_table.py" < "$out/kernels.cu" > "$out/kernel_table.inc"
${CXX:-c++} -std=c++17 -O2 -g -w -fPIC -shared -I "$out" "$here/driver.cpp" -o "$out/libcuda.so"
ln -sf libcuda.so "$out/libcublas.so"
ln -sf libcuda.so "$out/libcublasLt.so"
ln -sf libcuda.so "$out/libnccl.so"
