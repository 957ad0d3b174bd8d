// kind 0: max (padding is -inf), 1: average over the full kernel area (count_include_pad).
extern "C" __global__ void pool2d_forward(int kind, const void* x, int xs, PoolGeom g, void* y, int ys) {
    GRID_STRIDE(idx, g.n * g.c * g.oh * g.ow) {
        u64 q = idx % g.ow, p = (idx / g.ow) % g.oh, plane = idx / (g.ow * g.oh);
        u64 xp = plane * g.h * g.w;
        float acc = kind == 0 ? __int_as_float(0xff800000) : 0.0f;
        for (u64 a = 0; a < g.kh; a++) {
            long long i = (long long)(p * g.sh + a) - (long long)g.ph;
            if (i < 0 || i >= (long long)g.h) continue;
            for (u64 b = 0; b < g.kw; b++) {
                long long j = (long long)(q * g.sw + b) - (long long)g.pw;
                if (j < 0 || j >= (long long)g.w) continue;
                float v = load(x, xs, xp + i * g.w + j);
                if (kind == 0) { if (v > acc || v != v) acc = v; } else acc += v;
            }
        }
        store(y, ys, idx, kind == 0 ? acc : acc / (float)(g.kh * g.kw));
    }
}

// One thread per input element gathers from every window containing it; for max pooling only
// from windows whose first maximum (recomputed) is this element. relu = 1: x is a ReLU's output
// and dx the gradient of that ReLU's input (Backend::pool2d_backward's through_relu).
extern "C" __global__ void pool2d_backward(int kind, const void* x, int xs, const void* y, int ys, const void* dy,
                                           int dys, PoolGeom g, int relu, void* dx, int dxs) {
    GRID_STRIDE(idx, g.n * g.c * g.h * g.w) {
        u64 j = idx % g.w, i = (idx / g.w) % g.h, plane = idx / (g.w * g.h);
        u64 xp = plane * g.h * g.w;
        float sum = 0.0f;
        for (u64 a = 0; a < g.kh; a++) {
            long long pi = (long long)(i + g.ph) - (long long)a;
            if (pi < 0 || pi % g.sh != 0 || pi / g.sh >= (long long)g.oh) continue;
            u64 p = pi / g.sh;
            for (u64 b = 0; b < g.kw; b++) {
                long long qj = (long long)(j + g.pw) - (long long)b;
                if (qj < 0 || qj % g.sw != 0 || qj / g.sw >= (long long)g.ow) continue;
                u64 q = qj / g.sw, out = (plane * g.oh + p) * g.ow + q;
                if (kind == 1) { sum += load(dy, dys, out) / (float)(g.kh * g.kw); continue; }
                // Is (i, j) the first position of window (p, q) holding its maximum?
                float target = load(y, ys, out);
                u64 first = ~0ull;
                for (u64 wa = 0; wa < g.kh && first == ~0ull; wa++) {
                    long long wi = (long long)(p * g.sh + wa) - (long long)g.ph;
                    if (wi < 0 || wi >= (long long)g.h) continue;
                    for (u64 wb = 0; wb < g.kw; wb++) {
                        long long wj = (long long)(q * g.sw + wb) - (long long)g.pw;
                        if (wj < 0 || wj >= (long long)g.w) continue;
                        float v = load(x, xs, xp + wi * g.w + wj);
                        if (v == target || (v != v && target != target)) { first = wi * g.w + wj; break; }
                    }
                }
                if (first == i * g.w + j) sum += load(dy, dys, out);
            }
        }
        // The ReLU's backward step: dy · (y > 0 ? 1 : 0), the CPU's product.
        if (relu) sum *= load(x, xs, idx) > 0.0f ? 1.0f : 0.0f;
        store(dx, dxs, idx, sum);
    }
}
