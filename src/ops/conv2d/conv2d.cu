// Convolution, NCHW: Caffe-style batched im2col. col is [c*kh*kw, n*oh*ow], so one cuBLAS GEMM
// per group covers the whole batch, with layout kernels between [n, o, p] and [o, n*p]. Every
// buffer of values comes with its storage (`load`, `store`): activations and their gradients,
// and the GEMMs' inputs in the workspace (col, dy's [o, n*p] layout), which are half-width when
// the products run on tensor cores. Every backward pass gathers (one thread per input element)
// instead of scattering with atomics, so results are bit-reproducible.

// col[(ci, ki, kj), (s, p, q)] = x[s, ci, p*sh - ph + ki*dh, q*sw - pw + kj*dw], 0 outside.
extern "C" __global__ void im2col(const void* x, int xs, ConvGeom g, void* col, int cs) {
    u64 cols = g.n * g.oh * g.ow;
    GRID_STRIDE(idx, g.c * g.kh * g.kw * cols) {
        u64 row = idx / cols, column = idx % cols;
        u64 s = column / (g.oh * g.ow), pq = column % (g.oh * g.ow);
        u64 p = pq / g.ow, q = pq % g.ow;
        u64 ci = row / (g.kh * g.kw), k = row % (g.kh * g.kw);
        long long i = (long long)(p * g.sh + (k / g.kw) * g.dh) - (long long)g.ph;
        long long j = (long long)(q * g.sw + (k % g.kw) * g.dw) - (long long)g.pw;
        bool inside = i >= 0 && i < (long long)g.h && j >= 0 && j < (long long)g.w;
        store(col, cs, idx, inside ? load(x, xs, ((s * g.c + ci) * g.h + i) * g.w + j) : 0.0f);
    }
}

// dx[s, ci, i, j] = sum of the col entries im2col took from it (a gather: no atomics).
extern "C" __global__ void col2im(const float* col, ConvGeom g, void* dx, int dxs) {
    u64 cols = g.n * g.oh * g.ow;
    GRID_STRIDE(idx, g.n * g.c * g.h * g.w) {
        u64 j = idx % g.w, i = (idx / g.w) % g.h, ci = (idx / (g.w * g.h)) % g.c, s = idx / (g.w * g.h * g.c);
        float sum = 0.0f;
        for (u64 ki = 0; ki < g.kh; ki++) {
            long long pi = (long long)(i + g.ph) - (long long)(ki * g.dh);
            if (pi < 0 || pi % g.sh != 0 || pi / g.sh >= (long long)g.oh) continue;
            for (u64 kj = 0; kj < g.kw; kj++) {
                long long qj = (long long)(j + g.pw) - (long long)(kj * g.dw);
                if (qj < 0 || qj % g.sw != 0 || qj / g.sw >= (long long)g.ow) continue;
                u64 row = (ci * g.kh + ki) * g.kw + kj;
                u64 column = (s * g.oh + pi / g.sh) * g.ow + qj / g.sw;
                sum += col[row * cols + column];
            }
        }
        store(dx, dxs, idx, sum);
    }
}

// y[s, o, p] = src[o, s*P + p] (+ bias[o], bias = params + bias_at in the parameters' storage,
// `load`): from the GEMM's layout to NCHW.
extern "C" __global__ void cn_to_nchw(const float* src, const void* params, int ps, u64 bias_at, int has_bias, u64 n,
                                      u64 o, u64 plane, void* y, int ys) {
    GRID_STRIDE(idx, n * o * plane) {
        u64 p = idx % plane, oc = (idx / plane) % o, s = idx / (plane * o);
        store(y, ys, idx, src[oc * n * plane + s * plane + p] + (has_bias ? load(params, ps, bias_at + oc) : 0.0f));
    }
}

// dst[o, s*P + p] = dy[s, o, p]: NCHW to the GEMM's layout.
extern "C" __global__ void nchw_to_cn(const void* dy, int dys, u64 n, u64 o, u64 plane, void* dst, int ds) {
    GRID_STRIDE(idx, n * o * plane) {
        u64 p = idx % plane, s = (idx / plane) % n, oc = idx / (plane * n);
        store(dst, ds, idx, load(dy, dys, (s * o + oc) * plane + p));
    }
}

// dst[r] += sum of row r of src [rows, cols] (= when !add); one block per row.
extern "C" __global__ void row_sums_add(const void* src, int ss, u64 rows, u64 cols, float* dst, int add) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        double acc = 0.0;
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) acc += load(src, ss, r * cols + c);
        acc = block_sum(acc);
        if (threadIdx.x == 0) dst[r] = add ? dst[r] + (float)acc : (float)acc;
        __syncthreads();
    }
}
