// Batch norm over [n, c, spatial], one block per channel. state = [running_mean | running_var |
// mean | invstd], c each. Training: batch statistics (biased variance to normalise, unbiased
// for the running variance); evaluation: the running statistics.
extern "C" __global__ void batchnorm_forward(const void* x, int xs, void* y, int ys, u64 n, u64 c, u64 spatial,
                                             const float* gamma,
                                             const float* beta, float* state, int train, float momentum, float eps) {
    u64 ch = blockIdx.x;
    if (ch >= c) return;
    u64 m = n * spatial;
    __shared__ float mean_s, invstd_s;
    if (train) {
        double sum = 0.0;
        for (u64 k = threadIdx.x; k < m; k += blockDim.x) sum += load(x, xs, ((k / spatial) * c + ch) * spatial + k % spatial);
        sum = block_sum(sum);
        __shared__ double mu_s;
        if (threadIdx.x == 0) mu_s = sum / (double)m;
        __syncthreads();
        double mu = mu_s, sq = 0.0;
        for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
            double d = load(x, xs, ((k / spatial) * c + ch) * spatial + k % spatial) - mu;
            sq += d * d;
        }
        sq = block_sum(sq);
        if (threadIdx.x == 0) {
            double var = sq / (double)m;
            double unbiased = m > 1 ? var * (double)m / (double)(m - 1) : var;
            mean_s = (float)mu;
            invstd_s = (float)(1.0 / sqrt(var + (double)eps));
            state[ch] = (1.0f - momentum) * state[ch] + momentum * (float)mu;
            state[c + ch] = (1.0f - momentum) * state[c + ch] + momentum * (float)unbiased;
        }
    } else if (threadIdx.x == 0) {
        mean_s = state[ch];
        invstd_s = 1.0f / sqrtf(state[c + ch] + eps);
    }
    __syncthreads();
    float mu = mean_s, is = invstd_s;
    if (threadIdx.x == 0) { state[2 * c + ch] = mu; state[3 * c + ch] = is; }
    for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
        u64 i = ((k / spatial) * c + ch) * spatial + k % spatial;
        store(y, ys, i, (load(x, xs, i) - mu) * is * gamma[ch] + beta[ch]);
    }
}

// Training-mode backward, one block per channel: dgamma += sum dy*xhat, dbeta += sum dy,
// dx = gamma*invstd*(dy - mean(dy) - xhat*mean(dy*xhat)) when write_dx.
extern "C" __global__ void batchnorm_backward(const void* x, int xs, const void* dy, int dys, void* dx, int dxs,
                                              int write_dx, u64 n, u64 c, u64 spatial, const float* gamma,
                                              const float* state, float* dgamma, float* dbeta) {
    u64 ch = blockIdx.x;
    if (ch >= c) return;
    u64 m = n * spatial;
    float mu = state[2 * c + ch], is = state[3 * c + ch];
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
        u64 i = ((k / spatial) * c + ch) * spatial + k % spatial;
        double xhat = (double)((load(x, xs, i) - mu) * is);
        double d = load(dy, dys, i);
        sum_dy += d;
        sum_dy_xhat += d * xhat;
    }
    sum_dy = block_sum(sum_dy);
    __shared__ double totals[2];
    if (threadIdx.x == 0) { totals[0] = sum_dy; }
    __syncthreads();
    sum_dy_xhat = block_sum(sum_dy_xhat);
    if (threadIdx.x == 0) {
        totals[1] = sum_dy_xhat;
        dgamma[ch] += (float)sum_dy_xhat;
        dbeta[ch] += (float)totals[0];
    }
    __syncthreads();
    if (!write_dx) return;
    double scale = (double)gamma[ch] * (double)is, a = totals[0] / (double)m, b = totals[1] / (double)m;
    for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
        u64 i = ((k / spatial) * c + ch) * spatial + k % spatial;
        double xhat = (double)((load(x, xs, i) - mu) * is);
        store(dx, dxs, i, (float)(scale * ((double)load(dy, dys, i) - a - xhat * b)));
    }
}
