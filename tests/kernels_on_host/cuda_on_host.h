// What the kernels (kernels/*.cu) need of CUDA, for running them on the host one thread at a
// time: enough for kernels whose threads never wait for one another (grid-stride loops). The
// block-wide reductions compile but are never run here.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct Dim3 {
    unsigned x, y, z;
};
static Dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
template <class T>
T __shfl_down_sync(unsigned, T v, int) {
    return v;
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int) {
    return v;
}
inline void __syncthreads() {}

// Runs `kernel` as a launch of blocks of 256 threads covering `threads` (at most 65536
// blocks, as src/tensor/cuda's `grid`), every thread in turn.
template <class K>
void launch(uint64_t threads, K kernel) {
    uint64_t blocks = (threads + 255) / 256;
    blocks = blocks < 1 ? 1 : blocks > 65536 ? 65536 : blocks;
    blockDim = {256, 1, 1};
    gridDim = {(unsigned)blocks, 1, 1};
    for (unsigned b = 0; b < blocks; b++) {
        for (unsigned t = 0; t < 256; t++) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            kernel();
        }
    }
}
