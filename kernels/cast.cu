// f32 <-> f16 / bf16 casts, round-to-nearest-even (as PyTorch and the `half` crate). NVRTC has
// no cuda_fp16.h here, so the conversions are written with PTX cvt instructions; halves are
// stored as their raw 16-bit patterns. Built for the host (tests/suite/kernels_on_host.rs), the
// compiler's _Float16 does the same conversions.

typedef unsigned short u16;

__device__ __forceinline__ u16 f32_to_f16_bits(float x) {
    u16 h;
#ifdef __CUDA_ARCH__
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    _Float16 v = (_Float16)x;
    memcpy(&h, &v, 2);
#endif
    return h;
}

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#endif
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float x) {
#if __CUDA_ARCH__ >= 800
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // quiet NaN
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

__device__ __forceinline__ float bf16_bits_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// x rounded to the nearest f16 (kind 0) or bf16 (kind 1) value, as f32.
__device__ __forceinline__ float round_half(float x, int kind) {
    return kind == 0 ? f16_bits_to_f32(f32_to_f16_bits(x)) : bf16_bits_to_f32(f32_to_bf16_bits(x));
}

// How a buffer of activations stores its values (src/tensor/cuda `CudaBuf::storage`): 0 f32,
// 1 f16, 2 bf16 (mixed precision's half-width buffers, 2 bytes a value). Kernels of the ops
// that take half-width buffers read and write through these, computing in f32: a store to a
// half buffer rounds to nearest even, as the rounding pass of an f32 buffer would. The
// storage is the same for every thread, so the branch costs no divergence.
__device__ __forceinline__ float load(const void* p, int s, u64 i) {
    if (s == 0) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return s == 1 ? f16_bits_to_f32(h) : bf16_bits_to_f32(h);
}

__device__ __forceinline__ void store(void* p, int s, u64 i, float v) {
    if (s == 0) ((float*)p)[i] = v;
    else ((u16*)p)[i] = s == 1 ? f32_to_f16_bits(v) : f32_to_bf16_bits(v);
}

// Vectorised access for the memory-bound kernels: VEC values from i (a multiple of VEC) in one
// 16-byte access of halves or two of f32, where 2-byte accesses would move a quarter as much
// per instruction. Only for 16-byte aligned buffers (`map_values` checks).
#define VEC 8

__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15u) == 0; }

__device__ __forceinline__ void load_vec(const void* p, int s, u64 i, float* v) {
    if (s == 0) {
        const float4* q = (const float4*)p + i / 4;
        float4 a = q[0], b = q[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
    uint4 q = ((const uint4*)p)[i / VEC];
    u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        // Little-endian: the value at the lower address is the word's low half.
        u16 lo = (u16)(words[k] & 0xffffu), hi = (u16)(words[k] >> 16);
        v[2 * k] = s == 1 ? f16_bits_to_f32(lo) : bf16_bits_to_f32(lo);
        v[2 * k + 1] = s == 1 ? f16_bits_to_f32(hi) : bf16_bits_to_f32(hi);
    }
}

__device__ __forceinline__ void store_vec(void* p, int s, u64 i, const float* v) {
    if (s == 0) {
        float4* q = (float4*)p + i / 4;
        float4 a, b;
        a.x = v[0], a.y = v[1], a.z = v[2], a.w = v[3];
        b.x = v[4], b.y = v[5], b.z = v[6], b.w = v[7];
        q[0] = a, q[1] = b;
        return;
    }
    u32 words[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 lo = s == 1 ? f32_to_f16_bits(v[2 * k]) : f32_to_bf16_bits(v[2 * k]);
        u32 hi = s == 1 ? f32_to_f16_bits(v[2 * k + 1]) : f32_to_bf16_bits(v[2 * k + 1]);
        words[k] = lo | (hi << 16);
    }
    uint4 q;
    q.x = words[0], q.y = words[1], q.z = words[2], q.w = words[3];
    ((uint4*)p)[i / VEC] = q;
}

// One operand of `map_values`: a buffer and its storage.
struct In {
    const void* p;
    int s;
};

// out[i] = f(i, v) for i < n, v[k] = in[k][i] (N inputs, each in its storage; N may be 0).
// Whole vectors of VEC values a thread where every buffer is 16-byte aligned (cudaMalloc's
// are; a view at an offset may not be), then the rest one value at a time. out may be one of the inputs:
// each value is read and written by the same thread. Launch with n / VEC threads or more.
template <int N, typename F>
__device__ __forceinline__ void map_values(const In* in, void* out, int out_s, u64 n, F f) {
    bool aligned = aligned16(out);
#pragma unroll
    for (int k = 0; k < N; k++) aligned = aligned && aligned16(in[k].p);
    u64 whole = aligned ? n / VEC * VEC : 0;
    GRID_STRIDE(c, whole / VEC) {
        u64 i = c * VEC;
        float x[N > 0 ? N : 1][VEC], y[VEC];
#pragma unroll
        for (int k = 0; k < N; k++) load_vec(in[k].p, in[k].s, i, x[k]);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float v[N > 0 ? N : 1];
#pragma unroll
            for (int k = 0; k < N; k++) v[k] = x[k][j];
            y[j] = f(i + j, v);
        }
        store_vec(out, out_s, i, y);
    }
    GRID_STRIDE(t, n - whole) {
        u64 i = whole + t;
        float v[N > 0 ? N : 1];
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = load(in[k].p, in[k].s, i);
        store(out, out_s, i, f(i, v));
    }
}

// For half values kept in an f32 buffer (the others round on every store): rounds x[0..n) in
// place to the nearest f16 (kind 0) or bf16 (kind 1) value, ties to even, overflow to inf, as
// a cast would.
extern "C" __global__ void round_to_half(float* x, u64 n, int kind) {
    In in[1] = {{x, 0}};
    map_values<1>(in, x, 0, n, [=](u64, const float* v) { return round_half(v[0], kind); });
}
