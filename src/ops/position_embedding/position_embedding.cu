// y[i] = x[i] + w[i % len]: a sample of len values plus the table's first len values.
extern "C" __global__ void position_embedding_forward(const void* x, int xs, const float* w, void* y, int ys, u64 n,
                                                      u64 len) {
    GRID_STRIDE(i, n * len) store(y, ys, i, load(x, xs, i) + w[i % len]);
}

// dw[j] += the sum over samples of dy[b, j]: a thread per j walks the samples in order, so
// the sums are deterministic and the CPU's.
extern "C" __global__ void position_embedding_backward(const void* dy, int dys, float* dw, u64 n, u64 len) {
    GRID_STRIDE(j, len) {
        float s = 0.0f;
        for (u64 b = 0; b < n; b++) s += load(dy, dys, b * len + j);
        dw[j] += s;
    }
}
