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

// One block per row: y = softmax(x) or log_softmax(x), sums in double (as the CPU backend).
extern "C" __global__ void softmax_forward(const void* x, int xs, void* y, int ys, u64 rows, u64 width, int log_out) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    u64 row = r * width;
    float m = __int_as_float(0xff800000);
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) m = fmaxf(m, load(x, xs, row + j));
    m = block_max(m);
    double s = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) s += (double)expf(load(x, xs, row + j) - m);
    s = block_sum(s);
    __shared__ double total;
    if (threadIdx.x == 0) total = s;
    __syncthreads();
    float log_total = (float)log(total), inv = (float)(1.0 / total);
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) {
        float v = load(x, xs, row + j);
        store(y, ys, row + j, log_out ? v - m - log_total : expf(v - m) * inv);
    }
}

// softmax: dx = y (dy - sum(dy y)); log_softmax: dx = dy - exp(y) sum(dy).
extern "C" __global__ void softmax_backward(const void* y, int ys, const void* dy, int dys, void* dx, int dxs, u64 rows,
                                            u64 width, int log_out) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    u64 row = r * width;
    double s = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) {
        double d = load(dy, dys, row + j);
        s += log_out ? d : d * load(y, ys, row + j);
    }
    s = block_sum(s);
    __shared__ double total;
    if (threadIdx.x == 0) total = s;
    __syncthreads();
    float t = (float)total;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) {
        float yj = load(y, ys, row + j), dyj = load(dy, dys, row + j);
        store(dx, dxs, row + j, log_out ? dyj - expf(yj) * t : yj * (dyj - t));
    }
}

// y[p * dim + j] = W[ids[p] * dim + j] for count token ids.
extern "C" __global__ void embedding_forward(const float* ids, const float* w, void* y, int ys, u64 count, u64 dim) {
    GRID_STRIDE(i, count * dim) store(y, ys, i, w[(u64)ids[i / dim] * dim + i % dim]);
}

// dW[ids[p], j] += dy[p, j]: one thread per column j walks the positions in order, so the
// sums are deterministic (no atomics).
extern "C" __global__ void embedding_backward(const float* ids, const void* dy, int dys, float* dw, u64 count, u64 dim) {
    GRID_STRIDE(j, dim) {
        for (u64 p = 0; p < count; p++) dw[(u64)ids[p] * dim + j] += load(dy, dys, p * dim + j);
    }
}
