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
