// Ops of non-sequential graphs and output layers: sums (residual connections and gradient
// accumulation), row copies (concat), and softmax / log_softmax over rows.

// dst[i] += src[i]; each buffer in its storage (`load`, `store`).
extern "C" __global__ void add_assign(const void* src, int ss, void* dst, int ds, u64 n) {
    In in[2] = {{dst, ds}, {src, ss}};
    map_values<2>(in, dst, ds, n, [](u64, const float* v) { return v[0] + v[1]; });
}

// dst[i] = src[i]: a copy between storages (mixed precision's half copy of the parameters).
extern "C" __global__ void convert_values(const void* src, int ss, void* dst, int ds, u64 n) {
    In in[1] = {{src, ss}};
    map_values<1>(in, dst, ds, n, [](u64, const float* v) { return v[0]; });
}

// Row r of `width` values: dst[r * dst_stride + dst_offset + j] (+)= src[r * src_stride + src_offset + j].
// Also a copy between storages (one row).
extern "C" __global__ void copy_rows(const void* src, int ss, u64 src_stride, u64 src_offset, void* dst, int ds,
                                     u64 dst_stride, u64 dst_offset, u64 width, u64 rows, int add) {
    GRID_STRIDE(i, rows * width) {
        u64 r = i / width, j = i % width;
        float v = load(src, ss, r * src_stride + src_offset + j);
        u64 d = r * dst_stride + dst_offset + j;
        store(dst, ds, d, add ? load(dst, ds, d) + v : v);
    }
}

// Maximum of `v` over the block; valid in every thread.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float result;
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, offset));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = (threadIdx.x < (blockDim.x >> 5)) ? partial[lane] : __int_as_float(0xff800000);
        for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, offset));
        if (lane == 0) result = v;
    }
    __syncthreads();
    return result;
}




