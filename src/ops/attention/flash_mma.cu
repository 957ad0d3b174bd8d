// Flash attention on tensor cores, for bf16 activations on compute capability 8.0 and later:
// the products of flash.cu's kernels as warp-wide mma.sync (bf16 operands, f32 sums). The same
// layouts, launch grid and saved values as flash.cu; the host picks these kernels where the
// head width is a multiple of 8 (`flash_on_tensor_cores` in cuda.rs).
//
// A block has four warps and FLASH_ROWS rows of its side (queries, or keys for dk and dv);
// each warp owns 16 of them. The other side comes a tile of MMA_TILE rows at a time through
// shared memory, stored row-major in bf16 and read by ldmatrix. The scores a warp computes
// stay in its registers: mma's result layout for two 16×8 tiles is its operand layout for
// one 16×16 tile, so the probabilities (or their gradients) go into the next product without
// shared memory, as in FlashAttention-2. P and dS are rounded to bf16 for that product, as
// FlashAttention does.

#define MMA_TILE 64

// D = A·B + D for a warp: A 16×16 (row-major), B 16×8 (column-major), bf16 pairs packed in
// u32; D 16×8 in f32. Lane l holds, with g = l / 4 and c = 2·(l % 4) (PTX ISA, mma.m16n8k16):
// a[0] A[g][c, c+1], a[1] A[g+8][c, c+1], a[2] A[g][c+8, c+9], a[3] A[g+8][c+8, c+9];
// b[0] B[c, c+1][g], b[1] B[c+8, c+9][g]; d[0], d[1] D[g][c, c+1], d[2], d[3] D[g+8][c, c+1].
// Every lane of the warp calls it.
__device__ __forceinline__ void mma_bf16_m16n8k16(float* d, const u32* a, const u32* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    asm volatile("trap;");  // the host launches these kernels on 8.0 and later only
#else
    host_gpu::mma_bf16_m16n8k16(d, a, b);
#endif
}

__device__ __forceinline__ u32 bf16_pair(float lo, float hi) {
    return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}

// Scores are kept in base 2: exp(x) = exp2(x·log2(e)), one ex2 instruction. The saved
// log-sum-exps stay natural, as flash.cu's and the CPU's.
#define MMA_LOG2E 1.4426950408889634f
#define MMA_LN2 0.6931471805599453f

// The backward passes take a shared tile's rows in chunks of MMA_CHUNK, so that a chunk's
// scores and their gradients fit in registers beside the head-wide sums (dk and dv, or dq).
// With whole tiles, dk and dv spilled 968 bytes a lane at head width 128.
#define MMA_CHUNK(D) ((D) > 64 ? 16 : 32)

// Halves a row of a shared tile: D values and 8 of padding, so that the lanes' operand reads
// fall in different banks.
#define MMA_STRIDE(D) ((D) + 8)

// Rows r0.. (MMA_TILE of them) of a [T, hd] matrix whose row i starts at src[at + i·stride],
// into `tile` as bf16; zeros past T and past hd. hd is a multiple of 8.
template <int D>
__device__ void mma_load_rows(u16* tile, const void* src, int s, u64 at, u64 stride, u64 r0, u64 T, u64 hd) {
    for (int e = threadIdx.x; e < MMA_TILE * D / 8; e += blockDim.x) {
        int r = e / (D / 8), c = e % (D / 8) * 8;
        u64 i = r0 + r;
        uint4 v = {0u, 0u, 0u, 0u};
        if (i < T && (u64)c < hd) {
            u64 first = at + i * stride + c;
            if (s == 2 && aligned16(src)) {
                v = *(const uint4*)((const u16*)src + first);
            } else {
                u32 w[4];
                for (int k = 0; k < 4; k++) w[k] = bf16_pair(load(src, s, first + 2 * k), load(src, s, first + 2 * k + 1));
                v = {w[0], w[1], w[2], w[3]};
            }
        }
        *(uint4*)(tile + r * MMA_STRIDE(D) + c) = v;
    }
}

// Four 8×8 matrices of bf16 from shared memory, a register each (PTX's ldmatrix .x4): lanes
// 8m..8m+7 give the addresses of matrix m's rows. Lane l gets row l / 4 of each, columns
// 2·(l % 4) and the next; or with `trans` that column pair's rows: column l / 4, rows
// 2·(l % 4) and the next. Every lane of the warp calls it.
template <bool trans>
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    u32 at;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(at) : "l"(row));
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
#elif defined(__CUDA_ARCH__)
    asm volatile("trap;");
#else
    host_gpu::ldmatrix_x4(r, row, trans);
#endif
}

// A's fragment for rows r0.. and columns k0.. of a shared tile: its four 8×8 quarters, the
// rows' top then bottom halves, left then right.
template <int D>
__device__ __forceinline__ void mma_a(u32* a, const u16* tile, int r0, int k0) {
    int lane = threadIdx.x & 31;
    ldmatrix_x4<false>(a, tile + (r0 + (lane & 15)) * MMA_STRIDE(D) + k0 + (lane >> 4) * 8);
}

// B's fragments for result columns n0.. and n0 + 8.. (two per register pair) where
// B[k][n] = tile[n + ..][k0 + k]: a product with the tile's rows transposed (q·kᵀ).
template <int D>
__device__ __forceinline__ void mma_b_transposed(u32* b, const u16* tile, int n0, int k0) {
    int lane = threadIdx.x & 31;
    int row = n0 + (lane & 7) + (lane >> 4) * 8, col = k0 + ((lane >> 3) & 1) * 8;
    ldmatrix_x4<false>(b, tile + row * MMA_STRIDE(D) + col);
}

// The same where B[k][n] = tile[k0 + k][n + ..]: a product with the tile as it is (p·v).
template <int D>
__device__ __forceinline__ void mma_b(u32* b, const u16* tile, int k0, int n0) {
    int lane = threadIdx.x & 31;
    int row = k0 + (lane & 15), col = n0 + (lane >> 4) * 8;
    ldmatrix_x4<true>(b, tile + row * MMA_STRIDE(D) + col);
}

// A's fragment for columns 16c.. of a warp's 16 × MMA_TILE results: two 16×8 result tiles.
__device__ __forceinline__ void mma_a_from(u32* a, const float (*x)[4], int c) {
    a[0] = bf16_pair(x[2 * c][0], x[2 * c][1]);
    a[1] = bf16_pair(x[2 * c][2], x[2 * c][3]);
    a[2] = bf16_pair(x[2 * c + 1][0], x[2 * c + 1][1]);
    a[3] = bf16_pair(x[2 * c + 1][2], x[2 * c + 1][3]);
}

// x (16 × N for the warp) = A·Bᵀ over D columns: A the warp's 16 rows (`a`, a fragment for
// each 16 columns), B the first N rows of `tile`.
template <int D, int N>
__device__ __forceinline__ void mma_scores(float (*x)[4], const u32 (*a)[4], const u16* tile) {
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++) x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.0f;
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
        #pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            u32 b[4];
            mma_b_transposed<D>(b, tile, nt * 8, kc * 16);
            mma_bf16_m16n8k16(x[nt], a[kc], b);
            mma_bf16_m16n8k16(x[nt + 1], a[kc], b + 2);
        }
    }
}

// acc (16 × D for the warp) += x·tile, x the warp's 16 × N results (rounded to bf16) and
// tile's first N rows.
template <int D, int N>
__device__ __forceinline__ void mma_accumulate(float (*acc)[4], const float (*x)[4], const u16* tile) {
    #pragma unroll
    for (int c = 0; c < N / 16; c++) {
        u32 a[4];
        mma_a_from(a, x, c);
        #pragma unroll
        for (int nt = 0; nt < D / 8; nt += 2) {
            u32 b[4];
            mma_b<D>(b, tile, c * 16, nt * 8);
            mma_bf16_m16n8k16(acc[nt], a, b);
            mma_bf16_m16n8k16(acc[nt + 1], a, b + 2);
        }
    }
}

// Where the value of result element e (0..3) of 16×8 tile nt lies for this lane: its row in
// the warp's 16 and its column in the tile's MMA_TILE.
__device__ __forceinline__ int mma_row(int e) { return (threadIdx.x & 31) / 4 + 8 * (e / 2); }
__device__ __forceinline__ int mma_col(int nt, int e) { return nt * 8 + 2 * (threadIdx.x & 3) + (e & 1); }

// The maximum over the four lanes that hold a row.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The forward pass: flash.cu's flash_forward, each warp 16 queries, a tile of keys a step.
template <int D>
__device__ void flash_mma_forward(const void* qkv, int xs, void* y, int ys, float* saved, u64 T, u64 H, u64 G,
                                  u64 hd, float scale, int causal, float drop, u64 key, u64 first) {
    __shared__ uint4 ks_[MMA_TILE * MMA_STRIDE(D) / 8], vs_[MMA_TILE * MMA_STRIDE(D) / 8];  // 16-byte aligned
    u16 *ks = (u16*)ks_, *vs = (u16*)vs_;
    u64 tiles = (T + FLASH_ROWS - 1) / FLASH_ROWS;
    u64 bh = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = bh / H, h = bh % H;
    int warp = threadIdx.x / 32;
    u64 row0 = tile * FLASH_ROWS + warp * 16;  // the warp's first query
    u64 stride = (H + 2 * G) * hd, at_q = b * T * stride + h * hd;
    u64 at_k = b * T * stride + qkv_head(1, h, H, G) * hd, at_v = b * T * stride + qkv_head(2, h, H, G) * hd;
    // The warp's queries as A fragments, through shared memory.
    mma_load_rows<D>(ks, qkv, xs, at_q, stride, tile * FLASH_ROWS, T, hd);
    __syncthreads();
    u32 q[D / 16][4];
    #pragma unroll
    for (int kc = 0; kc < D / 16; kc++) mma_a<D>(q[kc], ks, warp * 16, kc * 16);
    float acc[D / 8][4], m[2], l[2] = {0.0f, 0.0f}, scale2 = scale * MMA_LOG2E;
    m[0] = m[1] = flash_neg_inf();
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    u64 keys = causal ? (tile + 1) * FLASH_ROWS : T;
    if (keys > T) keys = T;
    for (u64 j0 = 0; j0 < keys; j0 += MMA_TILE) {
        __syncthreads();
        mma_load_rows<D>(ks, qkv, xs, at_k, stride, j0, T, hd);
        mma_load_rows<D>(vs, qkv, xs, at_v, stride, j0, T, hd);
        __syncthreads();
        if (causal && j0 > row0 + 15) continue;  // every key of the tile is after the warp's queries
        float s[MMA_TILE / 8][4];
        mma_scores<D, MMA_TILE>(s, q, ks);
        // Only the tile on the diagonal and the last one hold keys to mask.
        bool edge = (causal && j0 + MMA_TILE > row0) || j0 + MMA_TILE > T;
        float tile_max[2] = {flash_neg_inf(), flash_neg_inf()};
        #pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                u64 i = row0 + mma_row(e), j = j0 + mma_col(nt, e);
                bool seen = !edge || (j < T && !(causal && j > i));
                s[nt][e] = seen ? s[nt][e] * scale2 : flash_neg_inf();
                tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
            }
        }
        float base[2], correction[2];
        for (int r = 0; r < 2; r++) {
            float m_new = fmaxf(m[r], quad_max(tile_max[r]));
            // A row that has seen no key yet keeps zeros: nothing to rescale, nothing to add.
            base[r] = m_new == flash_neg_inf() ? 0.0f : m_new;
            correction[r] = exp2f(m[r] - base[r]);
            m[r] = m_new;
            l[r] *= correction[r];
        }
        #pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][e] *= correction[e / 2];
        }
        #pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = exp2f(s[nt][e] - base[e / 2]);
                l[e / 2] += p;
                if (drop > 0.0f) {
                    u64 i = row0 + mma_row(e), j = j0 + mma_col(nt, e);
                    p *= kept_factor(drop, key, first, ((b * H + h) * T + i) * T + j);
                }
                s[nt][e] = p;
            }
        }
        mma_accumulate<D, MMA_TILE>(acc, s, vs);
    }
    float* own = saved + flash_saved(b, T, H, hd);
    for (int r = 0; r < 2; r++) l[r] = quad_sum(l[r]);
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            u64 i = row0 + mma_row(e), d = mma_col(nt, e);
            if (i >= T || d >= hd) continue;
            float o = acc[nt][e] / l[e / 2];
            store(y, ys, (b * T + i) * H * hd + h * hd + d, o);
            own[i * H * hd + h * hd + d] = o;
        }
    }
    if ((threadIdx.x & 3) == 0) {
        for (int r = 0; r < 2; r++) {
            u64 i = row0 + mma_row(2 * r);
            if (i < T) own[T * H * hd + h * T + i] = m[r] * MMA_LN2 + logf(l[r]);
        }
    }
}

// dk and dv: each warp 16 keys of key and value head g, a tile of the queries that attend to
// them a step, of each of the H/G query heads that share them. In the transposed scores
// sᵀ = k·qᵀ a lane's row is a key and its column a query:
// dv += (p·z)ᵀ·dy, dsᵀ = p·(z·(v·dyᵀ) − delta)·scale, dk += dsᵀ·q.
template <int D>
__device__ void flash_mma_backward_kv(const void* qkv, int xs, const void* dy, int dys, const float* saved,
                                      const float* delta, void* dqkv, int dxs, u64 T, u64 H, u64 G, u64 hd,
                                      float scale, int causal, float drop, u64 key, u64 first) {
    __shared__ uint4 qs_[MMA_TILE * MMA_STRIDE(D) / 8], gs_[MMA_TILE * MMA_STRIDE(D) / 8];  // 16-byte aligned
    u16 *qs = (u16*)qs_, *gs = (u16*)gs_;
    __shared__ float lse[MMA_TILE], dl[MMA_TILE];
    u64 tiles = (T + FLASH_ROWS - 1) / FLASH_ROWS;
    u64 bg = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = bg / G, g = bg % G;
    int warp = threadIdx.x / 32;
    u64 row0 = tile * FLASH_ROWS + warp * 16;  // the warp's first key
    u64 stride = (H + 2 * G) * hd, at_k = b * T * stride + (H + g) * hd, at_v = at_k + G * hd;
    u32 k[D / 16][4], v[D / 16][4];
    mma_load_rows<D>(qs, qkv, xs, at_k, stride, tile * FLASH_ROWS, T, hd);
    mma_load_rows<D>(gs, qkv, xs, at_v, stride, tile * FLASH_ROWS, T, hd);
    __syncthreads();
    #pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
        mma_a<D>(k[kc], qs, warp * 16, kc * 16);
        mma_a<D>(v[kc], gs, warp * 16, kc * 16);
    }
    float dk[D / 8][4], dv[D / 8][4];
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) dk[nt][e] = dv[nt][e] = 0.0f;
    }
    float scale2 = scale * MMA_LOG2E;
    for (u64 h = g * (H / G); h < (g + 1) * (H / G); h++) {
        u64 at_q = b * T * stride + h * hd, at_dy = b * T * H * hd + h * hd;
        const float* lses = saved + flash_saved(b, T, H, hd) + T * H * hd + h * T;
        const float* deltas = delta + (b * H + h) * T;
        // Causal: the queries before the block's first key attend to none of its keys.
        for (u64 i0 = causal ? tile * FLASH_ROWS : 0; i0 < T; i0 += MMA_TILE) {
            __syncthreads();
            mma_load_rows<D>(qs, qkv, xs, at_q, stride, i0, T, hd);
            mma_load_rows<D>(gs, dy, dys, at_dy, H * hd, i0, T, hd);
            for (int e = threadIdx.x; e < MMA_TILE; e += blockDim.x) {
                lse[e] = i0 + e < T ? lses[i0 + e] * MMA_LOG2E : 0.0f;
                dl[e] = i0 + e < T ? deltas[i0 + e] : 0.0f;
            }
            __syncthreads();
            // Only the tile on the diagonal and the last ones hold pairs to mask.
            bool edge = (causal && i0 < row0 + 16) || i0 + MMA_TILE > T || row0 + 16 > T;
            #pragma unroll 1
            for (int c0 = 0; c0 < MMA_TILE; c0 += MMA_CHUNK(D)) {
                const u16 *q_rows = qs + c0 * MMA_STRIDE(D), *g_rows = gs + c0 * MMA_STRIDE(D);
                float p[MMA_CHUNK(D) / 8][4], ds[MMA_CHUNK(D) / 8][4];
                mma_scores<D, MMA_CHUNK(D)>(p, k, q_rows);
                mma_scores<D, MMA_CHUNK(D)>(ds, v, g_rows);  // dpᵀ = v·dyᵀ
                #pragma unroll
                for (int nt = 0; nt < MMA_CHUNK(D) / 8; nt++) {
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int c = c0 + mma_col(nt, e);
                        u64 j = row0 + mma_row(e), i = i0 + c;
                        bool seen = !edge || (i < T && j < T && !(causal && j > i));
                        float prob = seen ? exp2f(p[nt][e] * scale2 - lse[c]) : 0.0f;
                        float z = drop > 0.0f && seen ? kept_factor(drop, key, first, ((b * H + h) * T + i) * T + j) : 1.0f;
                        ds[nt][e] = prob * (z * ds[nt][e] - dl[c]) * scale;
                        p[nt][e] = prob * z;
                    }
                }
                mma_accumulate<D, MMA_CHUNK(D)>(dv, p, g_rows);
                mma_accumulate<D, MMA_CHUNK(D)>(dk, ds, q_rows);
            }
        }
    }
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            u64 j = row0 + mma_row(e), d = mma_col(nt, e);
            if (j >= T || d >= hd) continue;
            store(dqkv, dxs, qkv_at(b, j, H + g, d, T, H + 2 * G, hd), dk[nt][e]);
            store(dqkv, dxs, qkv_at(b, j, H + G + g, d, T, H + 2 * G, hd), dv[nt][e]);
        }
    }
}

// dq: each warp 16 queries, a tile of the keys they attend to a step; dq += ds·k.
template <int D>
__device__ void flash_mma_backward_q(const void* qkv, int xs, const void* dy, int dys, const float* saved,
                                     const float* delta, void* dqkv, int dxs, u64 T, u64 H, u64 G, u64 hd,
                                     float scale, int causal, float drop, u64 key, u64 first) {
    __shared__ uint4 ks_[MMA_TILE * MMA_STRIDE(D) / 8], vs_[MMA_TILE * MMA_STRIDE(D) / 8];  // 16-byte aligned
    u16 *ks = (u16*)ks_, *vs = (u16*)vs_;
    u64 tiles = (T + FLASH_ROWS - 1) / FLASH_ROWS;
    u64 bh = blockIdx.x / tiles, tile = blockIdx.x % tiles, b = bh / H, h = bh % H;
    int warp = threadIdx.x / 32;
    u64 row0 = tile * FLASH_ROWS + warp * 16;  // the warp's first query
    u64 stride = (H + 2 * G) * hd, at_q = b * T * stride + h * hd, at_dy = b * T * H * hd + h * hd;
    u64 at_k = b * T * stride + qkv_head(1, h, H, G) * hd, at_v = b * T * stride + qkv_head(2, h, H, G) * hd;
    u32 q[D / 16][4], g[D / 16][4];
    mma_load_rows<D>(ks, qkv, xs, at_q, stride, tile * FLASH_ROWS, T, hd);
    mma_load_rows<D>(vs, dy, dys, at_dy, H * hd, tile * FLASH_ROWS, T, hd);
    __syncthreads();
    #pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
        mma_a<D>(q[kc], ks, warp * 16, kc * 16);
        mma_a<D>(g[kc], vs, warp * 16, kc * 16);
    }
    // The lse and delta of the lane's two rows.
    const float* own = saved + flash_saved(b, T, H, hd) + T * H * hd + h * T;
    float lse[2], dl[2];
    for (int r = 0; r < 2; r++) {
        u64 i = row0 + mma_row(2 * r);
        lse[r] = i < T ? own[i] * MMA_LOG2E : 0.0f;
        dl[r] = i < T ? delta[(b * H + h) * T + i] : 0.0f;
    }
    float dq[D / 8][4], scale2 = scale * MMA_LOG2E;
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.0f;
    u64 keys = causal ? (tile + 1) * FLASH_ROWS : T;
    if (keys > T) keys = T;
    for (u64 j0 = 0; j0 < keys; j0 += MMA_TILE) {
        __syncthreads();
        mma_load_rows<D>(ks, qkv, xs, at_k, stride, j0, T, hd);
        mma_load_rows<D>(vs, qkv, xs, at_v, stride, j0, T, hd);
        __syncthreads();
        if (causal && j0 > row0 + 15) continue;
        bool edge = (causal && j0 + MMA_TILE > row0) || j0 + MMA_TILE > T || row0 + 16 > T;
        #pragma unroll 1
        for (int c0 = 0; c0 < MMA_TILE; c0 += MMA_CHUNK(D)) {
            if (causal && j0 + c0 > row0 + 15) continue;  // every key of the chunk is after the warp's queries
            const u16 *k_rows = ks + c0 * MMA_STRIDE(D), *v_rows = vs + c0 * MMA_STRIDE(D);
            float s[MMA_CHUNK(D) / 8][4], ds[MMA_CHUNK(D) / 8][4];
            mma_scores<D, MMA_CHUNK(D)>(s, q, k_rows);
            mma_scores<D, MMA_CHUNK(D)>(ds, g, v_rows);  // dp = dy·vᵀ
            #pragma unroll
            for (int nt = 0; nt < MMA_CHUNK(D) / 8; nt++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    u64 i = row0 + mma_row(e), j = j0 + c0 + mma_col(nt, e);
                    bool seen = !edge || (i < T && j < T && !(causal && j > i));
                    float prob = seen ? exp2f(s[nt][e] * scale2 - lse[e / 2]) : 0.0f;
                    float z = drop > 0.0f && seen ? kept_factor(drop, key, first, ((b * H + h) * T + i) * T + j) : 1.0f;
                    ds[nt][e] = prob * (z * ds[nt][e] - dl[e / 2]) * scale;
                }
            }
            mma_accumulate<D, MMA_CHUNK(D)>(dq, ds, k_rows);
        }
    }
    #pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            u64 i = row0 + mma_row(e), d = mma_col(nt, e);
            if (i < T && d < hd) store(dqkv, dxs, qkv_at(b, i, h, d, T, H + 2 * G, hd), dq[nt][e]);
        }
    }
}

// The kernels by head width, with flash.cu's arguments (n unused: the grid covers it).
extern "C" __global__ void flash_mma_forward_32(const void* qkv, int xs, void* y, int ys, float* saved, u64 n,
                                              u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                              u64 key, u64 first) {
    flash_mma_forward<32>(qkv, xs, y, ys, saved, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_mma_backward_kv_32(const void* qkv, int xs, const void* dy, int dys,
                                                  const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                  u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                  u64 key, u64 first) {
    flash_mma_backward_kv<32>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, T, H, G, hd, scale, causal, drop, key,
                            first);
}
extern "C" __global__ void flash_mma_backward_q_32(const void* qkv, int xs, const void* dy, int dys,
                                                  const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                  u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                  u64 key, u64 first) {
    flash_mma_backward_q<32>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, T, H, G, hd, scale, causal, drop, key,
                            first);
}
extern "C" __global__ void flash_mma_forward_64(const void* qkv, int xs, void* y, int ys, float* saved, u64 n,
                                              u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                              u64 key, u64 first) {
    flash_mma_forward<64>(qkv, xs, y, ys, saved, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_mma_backward_kv_64(const void* qkv, int xs, const void* dy, int dys,
                                                  const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                  u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                  u64 key, u64 first) {
    flash_mma_backward_kv<64>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, T, H, G, hd, scale, causal, drop, key,
                            first);
}
extern "C" __global__ void flash_mma_backward_q_64(const void* qkv, int xs, const void* dy, int dys,
                                                  const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                  u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                  u64 key, u64 first) {
    flash_mma_backward_q<64>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, T, H, G, hd, scale, causal, drop, key,
                            first);
}
extern "C" __global__ void flash_mma_forward_128(const void* qkv, int xs, void* y, int ys, float* saved, u64 n,
                                              u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                              u64 key, u64 first) {
    flash_mma_forward<128>(qkv, xs, y, ys, saved, T, H, G, hd, scale, causal, drop, key, first);
}
extern "C" __global__ void flash_mma_backward_kv_128(const void* qkv, int xs, const void* dy, int dys,
                                                  const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                  u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                  u64 key, u64 first) {
    flash_mma_backward_kv<128>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, T, H, G, hd, scale, causal, drop, key,
                            first);
}
extern "C" __global__ void flash_mma_backward_q_128(const void* qkv, int xs, const void* dy, int dys,
                                                  const float* saved, const float* delta, void* dqkv, int dxs, u64 n,
                                                  u64 T, u64 H, u64 G, u64 hd, float scale, int causal, float drop,
                                                  u64 key, u64 first) {
    flash_mma_backward_q<128>(qkv, xs, dy, dys, saved, delta, dqkv, dxs, T, H, G, hd, scale, causal, drop, key,
                            first);
}
