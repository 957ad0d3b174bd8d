// Attention's own kernels; its products are cuBLAS's strided-batched GEMMs (cuda.rs).
// Layouts: a sample's [T, parts, H, hd] rows (qkv: parts = 3; y, dy: parts = 1), and each
// part's heads as [n, H, T, hd] f32 matrices in the workspace, parts one after another.

// w[at + part·E + ((b·H + h)·T + t)·hd + d] = x[b, t, part, h, d], E = n·T·H·hd.
extern "C" __global__ void attention_split(const void* x, int xs, float* w, u64 at, u64 n, u64 T, u64 H, u64 hd,
                                           u64 parts) {
    u64 e = n * T * H * hd;
    GRID_STRIDE(i, e * parts) {
        u64 d = i % hd, r = i / hd;
        u64 h = r % H;
        r /= H;
        u64 part = r % parts;
        r /= parts;
        u64 t = r % T, b = r / T;
        w[at + part * e + ((b * H + h) * T + t) * hd + d] = load(x, xs, i);
    }
}

// The inverse: y[b, t, part, h, d] = w[at + part·E + ((b·H + h)·T + t)·hd + d].
extern "C" __global__ void attention_merge(const float* w, u64 at, void* y, int ys, u64 n, u64 T, u64 H, u64 hd,
                                           u64 parts) {
    u64 e = n * T * H * hd;
    GRID_STRIDE(i, e * parts) {
        u64 d = i % hd, r = i / hd;
        u64 h = r % H;
        r /= H;
        u64 part = r % parts;
        r /= parts;
        u64 t = r % T, b = r / T;
        store(y, ys, i, w[at + part * e + ((b * H + h) * T + t) * hd + d]);
    }
}

// One block per row of T scores, in place: p = softmax(scale·s) over the attended positions
// (j <= i when causal, i = the row's position), 0 after them; sums in double, as the CPU.
extern "C" __global__ void attention_softmax(float* p, u64 rows, u64 T, float scale, int causal) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    float* row = p + r * T;
    u64 last = causal ? r % T + 1 : T;
    float m = __int_as_float(0xff800000);
    for (u64 j = threadIdx.x; j < last; j += blockDim.x) m = fmaxf(m, row[j] * scale);
    m = block_max(m);
    double s = 0.0;
    for (u64 j = threadIdx.x; j < last; j += blockDim.x) s += (double)expf(row[j] * scale - m);
    s = block_sum(s);
    __shared__ double total;
    if (threadIdx.x == 0) total = s;
    __syncthreads();
    float inv = (float)(1.0 / total);
    for (u64 j = threadIdx.x; j < T; j += blockDim.x) row[j] = j < last ? expf(row[j] * scale - m) * inv : 0.0f;
}

// Dropout's factor for element i of the probabilities' stream: 0 or 1/(1 − p), as the CPU's
// ProbsDropout::factor.
__device__ __forceinline__ float kept_factor(float p, u64 key, u64 first, u64 i) {
    return rng_uniform(key, first + i) >= p ? 1.0f / (1.0f - p) : 0.0f;
}

// The kept probabilities: w[at + i] = p[i]·factor(i).
extern "C" __global__ void attention_dropout(const float* p, float* w, u64 at, u64 len, float drop, u64 key,
                                             u64 first) {
    GRID_STRIDE(i, len) w[at + i] = p[i] * kept_factor(drop, key, first, i);
}

// One block per row, in place over the probabilities' gradient:
// ds = p·(dp − Σ_j p·dp)·scale (0 where masked, as p is). With dropout (drop > 0), dp is first
// the kept probabilities' gradient, and is masked and scaled as they were.
extern "C" __global__ void attention_softmax_backward(const float* p, float* dp, u64 rows, u64 T, float scale,
                                                      float drop, u64 key, u64 first) {
    u64 r = blockIdx.x;
    if (r >= rows) return;
    const float* prow = p + r * T;
    float* row = dp + r * T;
    if (drop > 0.0f) {
        for (u64 j = threadIdx.x; j < T; j += blockDim.x) row[j] *= kept_factor(drop, key, first, r * T + j);
        __syncthreads();
    }
    double s = 0.0;
    for (u64 j = threadIdx.x; j < T; j += blockDim.x) s += (double)prow[j] * (double)row[j];
    s = block_sum(s);
    __shared__ double total;
    if (threadIdx.x == 0) total = s;
    __syncthreads();
    float t = (float)total;
    for (u64 j = threadIdx.x; j < T; j += blockDim.x) row[j] = prow[j] * (row[j] - t) * scale;
}
