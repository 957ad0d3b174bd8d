// Shared helpers for every kernel file (prepended by the loader; NVRTC has no include path).
// No CUDA headers are available to NVRTC here, so what we need is written out.

typedef unsigned int u32;
typedef unsigned long long u64;

// SplitMix64's finaliser: the same function as src/tensor/rng.rs, so dropout masks are
// identical on every device.
__device__ __forceinline__ u64 rng_mix(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in [0, 1) with 24 random bits for element `index` of stream `key`.
__device__ __forceinline__ float rng_uniform(u64 key, u64 index) {
    return (float)(rng_mix(key ^ rng_mix(index)) >> 40) * (1.0f / 16777216.0f);
}

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)blockDim.x * gridDim.x)

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); valid in thread 0.
__device__ __forceinline__ double block_sum(double v) {
    __shared__ double partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? partial[lane] : 0.0;
    if (warp == 0)
        for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;
}
