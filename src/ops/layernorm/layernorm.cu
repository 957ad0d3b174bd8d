// Layer norm over rows of `width`, one block per row; saved = [mean | invstd], rows each.
extern "C" __global__ void layernorm_forward(const void* x, int xs, void* y, int ys, u64 rows, u64 width,
                                             const float* gamma, const float* beta, int has_beta, float* saved,
                                             float eps) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    u64 row = r * width;
    double sum = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) sum += load(x, xs, row + j);
    sum = block_sum(sum);
    __shared__ double mu_s;
    __shared__ float is_s;
    if (threadIdx.x == 0) mu_s = sum / (double)width;
    __syncthreads();
    double mu = mu_s, sq = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) { double d = load(x, xs, row + j) - mu; sq += d * d; }
    sq = block_sum(sq);
    if (threadIdx.x == 0) {
        is_s = (float)(1.0 / sqrt(sq / (double)width + (double)eps));
        saved[r] = (float)mu;
        saved[rows + r] = is_s;
    }
    __syncthreads();
    float m = (float)mu, is = is_s;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x)
        store(y, ys, row + j, (load(x, xs, row + j) - m) * is * gamma[j] + (has_beta ? beta[j] : 0.0f));
}

// dx per row (one block per row); dgamma/dbeta are column sums (layernorm_param_grads).
extern "C" __global__ void layernorm_backward(const void* x, int xs, const void* dy, int dys, void* dx, int dxs,
                                              u64 rows, u64 width, const float* gamma, const float* saved) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    u64 row = r * width;
    float mu = saved[r], is = saved[rows + r];
    double sum_g = 0.0, sum_g_xhat = 0.0;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) {
        double g = (double)load(dy, dys, row + j) * gamma[j];
        sum_g += g;
        sum_g_xhat += g * (double)((load(x, xs, row + j) - mu) * is);
    }
    sum_g = block_sum(sum_g);
    __shared__ double totals[2];
    if (threadIdx.x == 0) totals[0] = sum_g;
    __syncthreads();
    sum_g_xhat = block_sum(sum_g_xhat);
    if (threadIdx.x == 0) totals[1] = sum_g_xhat;
    __syncthreads();
    double a = totals[0] / (double)width, b = totals[1] / (double)width;
    for (u64 j = threadIdx.x; j < width; j += blockDim.x) {
        double g = (double)load(dy, dys, row + j) * gamma[j];
        double xhat = (double)((load(x, xs, row + j) - mu) * is);
        store(dx, dxs, row + j, (float)((double)is * (g - a - xhat * b)));
    }
}

// dgamma[j] += sum_r dy*xhat, dbeta[j] += sum_r dy (with has_beta); one thread per column.
extern "C" __global__ void layernorm_param_grads(const void* x, int xs, const void* dy, int dys, u64 rows, u64 width,
                                                 const float* saved, float* dgamma, float* dbeta, int has_beta) {
    GRID_STRIDE(j, width) {
        float g = 0.0f, b = 0.0f;
        for (u64 r = 0; r < rows; r++) {
            float d = load(dy, dys, r * width + j);
            g += d * ((load(x, xs, r * width + j) - saved[r]) * saved[rows + r]);
            b += d;
        }
        dgamma[j] += g;
        if (has_beta) dbeta[j] += b;
    }
}
