// Attention without the T×T matrix, as FlashAttention (device.flash_attention): forward keeps
// each row's output and the log-sum-exp of its scaled scores; backward computes the
// probabilities again, a tile of keys or queries at a time. One thread holds one row (a query,
// or in dk/dv's kernel a key) in registers; the block's threads share a tile of the other
// side in shared memory. Plain f32 arithmetic: in bf16 on compute capability 8.0 and later,
// flash_mma.cu runs the same passes on tensor cores.
//
// Layouts: qkv and dqkv [n, T, H + 2·G, hd] in their storage (H query heads, then G key and G
// value heads, each shared by H/G query heads: attention.cu's qkv_at); y and dy [n, T, H, hd];
// saved, per sample, [o: T·H·hd | lse: H·T] in f32 (`flash_saved`); delta [n·H·T].
// A launch has n·H·⌈T/FLASH_ROWS⌉ blocks of FLASH_ROWS threads: block (b·H + h)·tiles + tile;
// dk and dv's kernel one for each key and value head instead, n·G·⌈T/FLASH_ROWS⌉.
// D, a kernel's head width, is the next of 32, 64 or 128 at or above hd (values past hd are 0);
// loops over D are unrolled so that a row's arrays stay in registers.

#define FLASH_ROWS 64

__device__ __forceinline__ float flash_neg_inf() { return __int_as_float(0xff800000); }

// Where sample b's saved output starts; its log-sum-exps follow, T·H·hd values on.
__device__ __forceinline__ u64 flash_saved(u64 b, u64 T, u64 H, u64 hd) { return b * (T * H * hd + H * T); }

// Rows of a tile the block shares: 32, or 16 for the widest heads (shared memory).
#define FLASH_TILE(D) ((D) >= 128 ? 16 : 32)

// Loads rows r0.. of a tile into `a` (and `b`) [rows, D] from head `ha` (and `hb`) of qkv's
// rows of R heads, zeros past T and past hd.
template <int D>
__device__ void flash_load(float* a, float* b, const void* qkv, int xs, u64 ha, u64 hb, u64 r0, u64 bs, u64 T,
                           u64 R, u64 hd) {
    const int rows = FLASH_TILE(D);
    for (u64 e = threadIdx.x; e < (u64)rows * D; e += blockDim.x) {
        u64 r = r0 + e / D, d = e % D;
        bool in = r < T && d < hd;
        a[e] = in ? load(qkv, xs, qkv_at(bs, r, ha, d, T, R, hd)) : 0.0f;
        b[e] = in ? load(qkv, xs, qkv_at(bs, r, hb, d, T, R, hd)) : 0.0f;
    }
}

template <int D>
__device__ void flash_forward(const void* qkv, int xs, void* y, int ys, float* saved, u64 n, u64 T, u64 H, u64 G,
                              u64 hd, float scale, int causal, float drop, u64 key, u64 first) {
    const int BC = FLASH_TILE(D);
    __shared__ float ks[BC * D], vs[BC * D];
    u64 tiles = (T + FLASH_ROWS - 1) / FLASH_ROWS;
    u64 bh = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = bh / H, h = bh % H, R = H + 2 * G;
    u64 i = tile * FLASH_ROWS + threadIdx.x;
    bool active = i < T;
    float q[D], acc[D];
    #pragma unroll
    for (int d = 0; d < D; d++) {
        q[d] = active && d < hd ? load(qkv, xs, qkv_at(b, i, h, d, T, R, hd)) * scale : 0.0f;
        acc[d] = 0.0f;
    }
    float m = flash_neg_inf(), l = 0.0f;
    u64 attended = causal ? i + 1 : T;
    u64 keys = causal ? (tile + 1) * FLASH_ROWS : T;
    if (keys > T) keys = T;
    for (u64 j0 = 0; j0 < keys; j0 += BC) {
        flash_load<D>(ks, vs, qkv, xs, qkv_head(1, h, H, G), qkv_head(2, h, H, G), j0, b, T, R, hd);
        __syncthreads();
        if (active) {
            float s[BC];
            float tile_max = flash_neg_inf();
            for (int jj = 0; jj < BC; jj++) {
                float dot = 0.0f;
                #pragma unroll
                for (int d = 0; d < D; d++) dot += q[d] * ks[jj * D + d];
                s[jj] = j0 + jj < attended ? dot : flash_neg_inf();
                tile_max = fmaxf(tile_max, s[jj]);
            }
            if (tile_max > flash_neg_inf()) {
                // The running sums rescaled once a tile to the new maximum.
                float m_new = fmaxf(m, tile_max), correction = expf(m - m_new);
                l *= correction;
                #pragma unroll
                for (int d = 0; d < D; d++) acc[d] *= correction;
                for (int jj = 0; jj < BC; jj++) {
                    if (s[jj] == flash_neg_inf()) continue;
                    float p = expf(s[jj] - m_new);
                    l += p;
                    if (drop > 0.0f) p *= kept_factor(drop, key, first, ((b * H + h) * T + i) * T + j0 + jj);
                    #pragma unroll
                    for (int d = 0; d < D; d++) acc[d] += p * vs[jj * D + d];
                }
                m = m_new;
            }
        }
        __syncthreads();
    }
    if (active) {
        float inv = 1.0f / l;
        float* own = saved + flash_saved(b, T, H, hd);
        for (u64 d = 0; d < hd; d++) {
            float o = acc[d] * inv;
            store(y, ys, (b * T + i) * H * hd + h * hd + d, o);
            own[i * H * hd + h * hd + d] = o;
        }
        own[T * H * hd + h * T + i] = m + logf(l);
    }
}

// delta[(b·H + h)·T + i] = Σ_d dy·o over head h of row i: the row's Σ_j p·dp, which the
// softmax's gradient subtracts.
extern "C" __global__ void flash_backward_delta(const void* dy, int dys, const float* saved, float* delta, u64 n,
                                                u64 T, u64 H, u64 hd) {
    GRID_STRIDE(r, n * H * T) {
        u64 i = r % T, bh = r / T, h = bh % H, b = bh / H;
        const float* o = saved + flash_saved(b, T, H, hd) + i * H * hd + h * hd;
        double s = 0.0;
        for (u64 d = 0; d < hd; d++) s += (double)load(dy, dys, (b * T + i) * H * hd + h * hd + d) * (double)o[d];
        delta[r] = (float)s;
    }
}

// dk and dv: one thread per key j of key and value head g, over tiles of the queries that
// attend to it, of each of the H/G query heads that share it. With p = exp(q·k·scale − lse)
// and z the dropout factor: dv += p·z·dy, ds = p·(z·(dy·v) − delta)·scale, dk += ds·q.
template <int D>
__device__ void flash_backward_kv(const void* qkv, int xs, const void* dy, int dys, const float* saved,
                                  const float* delta, void* dqkv, int dxs, u64 n, u64 T, u64 H, u64 G, u64 hd,
                                  float scale, int causal, float drop, u64 key, u64 first) {
    const int BR = FLASH_TILE(D);
    __shared__ float qs[BR * D], gs[BR * D], lse[BR], dl[BR];
    u64 tiles = (T + FLASH_ROWS - 1) / FLASH_ROWS;
    u64 bg = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = bg / G, g = bg % G, R = H + 2 * G;
    u64 j = tile * FLASH_ROWS + threadIdx.x;
    bool active = j < T;
    float k[D], v[D], dk[D], dv[D];
    #pragma unroll
    for (int d = 0; d < D; d++) {
        bool in = active && d < hd;
        k[d] = in ? load(qkv, xs, qkv_at(b, j, H + g, d, T, R, hd)) : 0.0f;
        v[d] = in ? load(qkv, xs, qkv_at(b, j, H + G + g, d, T, R, hd)) : 0.0f;
        dk[d] = dv[d] = 0.0f;
    }
    for (u64 h = g * (H / G); h < (g + 1) * (H / G); h++) {
        const float* lses = saved + flash_saved(b, T, H, hd) + T * H * hd + h * T;
        const float* deltas = delta + (b * H + h) * T;
        // Causal: the queries before the block's first key attend to none of its keys.
        for (u64 i0 = causal ? tile * FLASH_ROWS : 0; i0 < T; i0 += BR) {
            for (u64 e = threadIdx.x; e < (u64)BR * D; e += blockDim.x) {
                u64 i = i0 + e / D, d = e % D;
                bool in = i < T && d < hd;
                qs[e] = in ? load(qkv, xs, qkv_at(b, i, h, d, T, R, hd)) : 0.0f;
                gs[e] = in ? load(dy, dys, (b * T + i) * H * hd + h * hd + d) : 0.0f;
            }
            for (u64 e = threadIdx.x; e < (u64)BR; e += blockDim.x) {
                lse[e] = i0 + e < T ? lses[i0 + e] : 0.0f;
                dl[e] = i0 + e < T ? deltas[i0 + e] : 0.0f;
            }
            __syncthreads();
            if (active) {
                for (int ii = 0; ii < BR; ii++) {
                    u64 i = i0 + ii;
                    if (i >= T || (causal && i < j)) continue;
                    float s = 0.0f, dp = 0.0f;
                    #pragma unroll
                    for (int d = 0; d < D; d++) {
                        s += qs[ii * D + d] * k[d];
                        dp += gs[ii * D + d] * v[d];
                    }
                    float p = expf(s * scale - lse[ii]);
                    float z = drop > 0.0f ? kept_factor(drop, key, first, ((b * H + h) * T + i) * T + j) : 1.0f;
                    float ds = p * (z * dp - dl[ii]) * scale;
                    #pragma unroll
                    for (int d = 0; d < D; d++) {
                        dv[d] += p * z * gs[ii * D + d];
                        dk[d] += ds * qs[ii * D + d];
                    }
                }
            }
            __syncthreads();
        }
    }
    if (active) {
        for (u64 d = 0; d < hd; d++) {
            store(dqkv, dxs, qkv_at(b, j, H + g, d, T, R, hd), dk[d]);
            store(dqkv, dxs, qkv_at(b, j, H + G + g, d, T, R, hd), dv[d]);
        }
    }
}

// dq: one thread per query i, over tiles of the keys it attends to; dq += ds·k.
template <int D>
__device__ void flash_backward_q(const void* qkv, int xs, const void* dy, int dys, const float* saved,
                                 const float* delta, void* dqkv, int dxs, u64 n, u64 T, u64 H, u64 G, u64 hd,
                                 float scale, int causal, float drop, u64 key, u64 first) {
    const int BC = FLASH_TILE(D);
    __shared__ float ks[BC * D], vs[BC * D];
    u64 tiles = (T + FLASH_ROWS - 1) / FLASH_ROWS;
    u64 bh = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = bh / H, h = bh % H, R = H + 2 * G;
    u64 i = tile * FLASH_ROWS + threadIdx.x;
    bool active = i < T;
    float q[D], g[D], dq[D];
    #pragma unroll
    for (int d = 0; d < D; d++) {
        bool in = active && d < hd;
        q[d] = in ? load(qkv, xs, qkv_at(b, i, h, d, T, R, hd)) : 0.0f;
        g[d] = in ? load(dy, dys, (b * T + i) * H * hd + h * hd + d) : 0.0f;
        dq[d] = 0.0f;
    }
    float lse = active ? saved[flash_saved(b, T, H, hd) + T * H * hd + h * T + i] : 0.0f;
    float dl = active ? delta[(b * H + h) * T + i] : 0.0f;
    u64 attended = causal ? i + 1 : T;
    u64 keys = causal ? (tile + 1) * FLASH_ROWS : T;
    if (keys > T) keys = T;
    for (u64 j0 = 0; j0 < keys; j0 += BC) {
        flash_load<D>(ks, vs, qkv, xs, qkv_head(1, h, H, G), qkv_head(2, h, H, G), j0, b, T, R, hd);
        __syncthreads();
        if (active) {
            for (int jj = 0; jj < BC; jj++) {
                u64 j = j0 + jj;
                if (j >= attended) break;
                float s = 0.0f, dp = 0.0f;
                #pragma unroll
                for (int d = 0; d < D; d++) {
                    s += q[d] * ks[jj * D + d];
                    dp += g[d] * vs[jj * D + d];
                }
                float p = expf(s * scale - lse);
                float z = drop > 0.0f ? kept_factor(drop, key, first, ((b * H + h) * T + i) * T + j) : 1.0f;
                float ds = p * (z * dp - dl) * scale;
                #pragma unroll
                for (int d = 0; d < D; d++) dq[d] += ds * ks[jj * D + d];
            }
        }
        __syncthreads();
    }
    if (active) {
        for (u64 d = 0; d < hd; d++) store(dqkv, dxs, qkv_at(b, i, h, d, T, R, hd), dq[d]);
    }
}

// The kernels by head width (the host picks the narrowest that holds hd).
extern "C" __global__ void flash_forward_32(const void* qkv, int xs, void* y, int ys, float* saved, u64 n, u64 T,
                                            u64 H, u64 G, u64 hd, float scale, int causal, float drop, u64 key,
                                            u64 first) {
    flash_forward<32>(qkv, xs, y, ys, saved, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_forward_64(const void* qkv, int xs, void* y, int ys, float* saved, u64 n, u64 T,
                                            u64 H, u64 G, u64 hd, float scale, int causal, float drop, u64 key,
                                            u64 first) {
    flash_forward<64>(qkv, xs, y, ys, saved, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_forward_128(const void* qkv, int xs, void* y, int ys, float* saved, u64 n, u64 T,
                                            u64 H, u64 G, u64 hd, float scale, int causal, float drop, u64 key,
                                            u64 first) {
    flash_forward<128>(qkv, xs, y, ys, saved, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_backward_kv_32(const void* qkv, int xs, const void* dy, int dys,
                                                const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                u64 key, u64 first) {
    flash_backward_kv<32>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_backward_kv_64(const void* qkv, int xs, const void* dy, int dys,
                                                const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                u64 key, u64 first) {
    flash_backward_kv<64>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_backward_kv_128(const void* qkv, int xs, const void* dy, int dys,
                                                const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                u64 key, u64 first) {
    flash_backward_kv<128>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_backward_q_32(const void* qkv, int xs, const void* dy, int dys,
                                                const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                u64 key, u64 first) {
    flash_backward_q<32>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_backward_q_64(const void* qkv, int xs, const void* dy, int dys,
                                                const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                u64 key, u64 first) {
    flash_backward_q<64>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, n, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_backward_q_128(const void* qkv, int xs, const void* dy, int dys,
                                                const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                u64 key, u64 first) {
    flash_backward_q<128>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, n, T, H, G, hd, scale, causal, drop, key, first);
}
