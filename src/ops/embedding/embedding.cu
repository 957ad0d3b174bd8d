// y[p * dim + j] = W[ids[p] * dim + j] for count token ids.
extern "C" __global__ void embedding_forward(const u32* ids, const float* w, void* y, int ys, u64 count, u64 dim) {
    GRID_STRIDE(i, count * dim) store(y, ys, i, w[ids[i / dim] * dim + i % dim]);
}

// dW[ids[p], j] += dy[p, j]: one thread per column j walks the positions in order, so the
// sums are deterministic (no atomics).
extern "C" __global__ void embedding_backward(const u32* ids, const void* dy, int dys, float* dw, u64 count, u64 dim) {
    GRID_STRIDE(j, dim) {
        for (u64 p = 0; p < count; p++) dw[ids[p] * dim + j] += load(dy, dys, p * dim + j);
    }
}
