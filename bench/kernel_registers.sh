#!/usr/bin/env bash
# Registers, spills and shared memory of the CUDA kernels whose names match PATTERN, as ptxas
# reports them through NVRTC (--ptxas-options=-v), without a GPU. Needs libnvrtc (.ci/run
# installs one under /tmp/trainer-ci-nvrtc) and python3.
#
#   bash bench/kernel_registers.sh [PATTERN] [ARCH]     # e.g. flash_mma sm_90
set -euo pipefail
cd "$(dirname "$0")/.."
pattern=${1:-.} arch=${2:-sm_90}
lib=$(find /tmp/trainer-ci-nvrtc "${CUDA_HOME:-/usr/local/cuda}" -name 'libnvrtc.so*' 2>/dev/null | head -n 1 || true)
[ -n "$lib" ] || { echo "no libnvrtc found: run .ci/run once, or set CUDA_HOME" >&2; exit 1; }
src=$(mktemp)
trap 'rm -f "$src"' EXIT
# The program as the binary compiles it: common.cuh, then kernels.rs' files in order.
files=$(grep -o 'include_str!("[^"]*\.cu")' src/tensor/cuda/kernels.rs | sed 's/include_str!("\(.*\)")/\1/')
(cd src/tensor/cuda && cat ../../../kernels/common.cuh $files) > "$src"
python3 - "$lib" "$src" "$arch" "$pattern" <<'PY'
import ctypes, re, sys
lib, src, arch, pattern = sys.argv[1:]
nvrtc = ctypes.CDLL(lib)
prog = ctypes.c_void_p()
assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), open(src, "rb").read(), b"k.cu", 0, None, None) == 0
opts = [f"--gpu-architecture={arch}".encode(), b"--fmad=false", b"--ptxas-options=-v"]
status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(prog, log)
if status != 0:
    sys.exit(log.value.decode())
name = None
for line in log.value.decode().splitlines():
    m = re.search(r"Function properties for (\w+)", line)
    if m:
        name = m.group(1)
    elif name and re.search(pattern, name) and ("spill" in line or "registers" in line):
        print(f"{name:32} {line.split(':', 1)[-1].strip()}")
PY
