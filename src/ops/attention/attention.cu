// Attention's own kernels; its products are cuBLAS's strided-batched GEMMs (cuda.rs).
// Layouts: a sample's rows of heads of hd values: qkv's H query heads, then G key heads and G
// value heads (G = kv_heads, which H is a multiple of); y's and dy's H heads. In the
// workspace each part's heads as [n, H, T, hd] f32 matrices, parts one after another: query
// head h's keys and values are those of key and value head h / (H / G).

// Where value d of head `head` of position t of sample b lies, in rows of R heads of hd.
__device__ __forceinline__ u64 qkv_at(u64 b, u64 t, u64 head, u64 d, u64 T, u64 R, u64 hd) {
    return ((b * T + t) * R + head) * hd + d;
}

// The head of a qkv row that query head h reads in part `part` (0 queries, 1 keys, 2 values).
__device__ __forceinline__ u64 qkv_head(u64 part, u64 h, u64 H, u64 G) {
    return part == 0 ? h : H + (part - 1) * G + h / (H / G);
}

// w[at + part·E + ((b·H + h)·T + t)·hd + d] = x[b, t, qkv_head(part, h), d], E = n·T·H·hd, for
// qkv (parts = 3) or dy (parts = 1).
extern "C" __global__ void attention_split(const void* x, int xs, float* w, u64 at, u64 n, u64 T, u64 H, u64 G,
                                           u64 hd, u64 parts) {
    u64 e = n * T * H * hd, R = parts == 3 ? H + 2 * G : H;
    GRID_STRIDE(i, e * parts) {
        u64 d = i % hd, r = i / hd;
        u64 t = r % T;
        r /= T;
        u64 h = r % H;
        r /= H;
        u64 b = r % n, part = r / n;
        w[at + i] = load(x, xs, qkv_at(b, t, qkv_head(part, h, H, G), d, T, R, hd));
    }
}

// The inverse, into y (parts = 1) or dqkv (parts = 3): a key or value head's gradient is the
// sum of its H / G query heads' in the workspace.
extern "C" __global__ void attention_merge(const float* w, u64 at, void* y, int ys, u64 n, u64 T, u64 H, u64 G,
                                           u64 hd, u64 parts) {
    u64 e = n * T * H * hd, R = parts == 3 ? H + 2 * G : H, group = H / G;
    GRID_STRIDE(i, n * T * R * hd) {
        u64 d = i % hd, r = i / hd;
        u64 head = r % R;
        r /= R;
        u64 t = r % T, b = r / T;
        u64 part = head < H ? 0 : head < H + G ? 1 : 2;
        u64 first = part == 0 ? head : (head - H - (part - 1) * G) * group, count = part == 0 ? 1 : group;
        float sum = 0.0f;
        for (u64 j = 0; j < count; j++) sum += w[at + part * e + ((b * H + first + j) * T + t) * hd + d];
        store(y, ys, i, sum);
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
