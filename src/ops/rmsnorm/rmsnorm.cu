// rmsnorm over rows of `width`, one block per row; saved = 1 / rms of each row.
extern "C" __global__ void rmsnorm_forward(const void* x, int xs, void* y, int ys, u64 rows, u64 width,
                                           const float* gamma, float* saved, float eps) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    u64 row = r * width;
    double sq = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) { double v = load(x, xs, row + j); sq += v * v; }
    sq = block_sum(sq);
    __shared__ float inv_s;
    if (threadIdx.x == 0) {
        inv_s = (float)(1.0 / sqrt(sq / (double)width + (double)eps));
        saved[r] = inv_s;
    }
    __syncthreads();
    float inv = inv_s;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) store(y, ys, row + j, load(x, xs, row + j) * inv * gamma[j]);
}

// dx per row (one block per row): dx_j = r (dy_j γ_j - x_j r² Σ_k dy_k γ_k x_k / width).
extern "C" __global__ void rmsnorm_backward(const void* x, int xs, const void* dy, int dys, void* dx, int dxs,
                                            u64 rows, u64 width, const float* gamma, const float* saved) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    u64 row = r * width;
    double inv = saved[r], sum = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x)
        sum += (double)load(dy, dys, row + j) * gamma[j] * (double)load(x, xs, row + j);
    sum = block_sum(sum);
    __shared__ double total;
    if (threadIdx.x == 0) total = sum;
    __syncthreads();
    double c = inv * inv * total / (double)width;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) {
        double own = (double)load(dy, dys, row + j) * gamma[j];
        store(dx, dxs, row + j, (float)(inv * (own - (double)load(x, xs, row + j) * c)));
    }
}

// dgamma[j] += sum_r dy * x * r; one thread per column.
extern "C" __global__ void rmsnorm_param_grads(const void* x, int xs, const void* dy, int dys, u64 rows, u64 width,
                                               const float* saved, float* dgamma) {
    GRID_STRIDE(j, width) {
        float g = 0.0f;
        for (u64 r = 0; r < rows; r++) g += load(dy, dys, r * width + j) * (load(x, xs, r * width + j) * saved[r]);
        dgamma[j] += g;
    }
}
