// f32 <-> f16 / bf16 casts, round-to-nearest-even (as PyTorch and the `half` crate). NVRTC has
// no cuda_fp16.h here, so the conversions are written with PTX cvt instructions; halves are
// stored as their raw 16-bit patterns.

typedef unsigned short u16;

__device__ __forceinline__ u16 f32_to_f16_bits(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
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

extern "C" __global__ void cast_f32_to_f16(const float* x, u16* y, u64 n) {
    GRID_STRIDE(i, n) y[i] = f32_to_f16_bits(x[i]);
}

extern "C" __global__ void cast_f16_to_f32(const u16* x, float* y, u64 n) {
    GRID_STRIDE(i, n) y[i] = f16_bits_to_f32(x[i]);
}

extern "C" __global__ void cast_f32_to_bf16(const float* x, u16* y, u64 n) {
    GRID_STRIDE(i, n) y[i] = f32_to_bf16_bits(x[i]);
}

extern "C" __global__ void cast_bf16_to_f32(const u16* x, float* y, u64 n) {
    GRID_STRIDE(i, n) y[i] = bf16_bits_to_f32(x[i]);
}

// Mixed precision keeps half-precision tensors in f32 buffers: rounds x[0..n) in place to the
// nearest f16 (kind 0) or bf16 (kind 1) value, ties to even, overflow to inf, as a cast would.
extern "C" __global__ void round_to_half(float* x, u64 n, int kind) {
    if (kind == 0) {
        GRID_STRIDE(i, n) x[i] = f16_bits_to_f32(f32_to_f16_bits(x[i]));
    } else {
        GRID_STRIDE(i, n) x[i] = bf16_bits_to_f32(f32_to_bf16_bits(x[i]));
    }
}
