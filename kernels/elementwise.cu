// Elementwise kernels: fills, copies, batch gathers, bias, activations, dropout.
// Activation ids match src/tensor/cuda: 0 relu, 1 gelu (erf), 2 gelu (tanh), 3 tanh, 4 sigmoid.
// A buffer of activations or their gradients comes with its storage (`load`, `store`). The
// kernels over whole buffers go through `map_values` (vectorised; launched with n / VEC
// threads).

extern "C" __global__ void fill_values(void* buf, int s, u64 n, float value) {
    map_values<0>(nullptr, buf, s, n, [=](u64, const float*) { return value; });
}

extern "C" __global__ void scale_f32(float* buf, u64 n, float factor) {
    In in[1] = {{buf, 0}};
    map_values<1>(in, buf, 0, n, [=](u64, const float* v) { return v[0] * factor; });
}

// dst[r, :] = the row_len values of src from rows[r]·stride + offset
extern "C" __global__ void gather_rows(const float* src, const u64* rows, u64 n_rows, u64 row_len, u64 stride,
                                       u64 offset, void* dst, int ds) {
    GRID_STRIDE(i, n_rows * row_len) {
        u64 r = i / row_len, c = i % row_len;
        store(dst, ds, i, src[rows[r] * stride + offset + c]);
    }
}

// gather_rows for token ids: into ids (ds = -1) or, as class indices, into values stored as
// ds says (a text's targets).
extern "C" __global__ void gather_ids(const u32* src, const u64* rows, u64 n_rows, u64 row_len, u64 stride,
                                      u64 offset, void* dst, int ds) {
    GRID_STRIDE(i, n_rows * row_len) {
        u64 r = i / row_len, c = i % row_len;
        u32 id = src[rows[r] * stride + offset + c];
        if (ds < 0) ((u32*)dst)[i] = id;
        else store(dst, ds, i, (float)id);
    }
}

// y[r, :] = b, b = params + bias_at in the parameters' storage (mixed precision's half copy
// is half-width).
extern "C" __global__ void broadcast_rows(const void* params, int ps, u64 bias_at, u64 n, u64 width, void* y, int ys) {
    map_values<0>(nullptr, y, ys, n * width, [=](u64 i, const float*) { return load(params, ps, bias_at + i % width); });
}

// db[j] += sum over rows of dy[r, j] (= when !add: a step's first backward pass, which reads
// nothing of db). A block of BIAS_TILE x BIAS_TILE threads owns BIAS_TILE
// columns: thread (x, y) sums rows y, y + BIAS_TILE, ... of column x (each row read coalesced),
// then row y = 0 adds the column's partial sums in a fixed order (the same bits every run).
// One thread per column, summing all rows alone, left most of the GPU idle: 450 us for a
// 4096 x 4096 gradient on an H100.
#define BIAS_TILE 32
extern "C" __global__ void bias_grad(const void* dy, int dys, u64 n, u64 width, float* db, int add) {
    __shared__ float partial[BIAS_TILE][BIAS_TILE + 1];
    u64 j = (u64)blockIdx.x * BIAS_TILE + threadIdx.x;
    float sum = 0.0f;
    if (j < width) {
        for (u64 r = threadIdx.y; r < n; r += BIAS_TILE) sum += load(dy, dys, r * width + j);
    }
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && j < width) {
        float total = 0.0f;
        for (int k = 0; k < BIAS_TILE; k++) total += partial[k][threadIdx.x];
        db[j] = add ? db[j] + total : total;
    }
}

// Also the backward pass: the same key redraws the same mask. `first` is the stream position
// of x[0] (a replica's share of a larger batch).
__device__ __forceinline__ void drop(float p, u64 key, u64 first, const void* x, int xs, void* y, int ys, u64 n) {
    float keep_scale = 1.0f / (1.0f - p);
    In in[1] = {{x, xs}};
    map_values<1>(in, y, ys, n, [=](u64 i, const float* v) {
        return rng_uniform(key, first + i) >= p ? v[0] * keep_scale : 0.0f;
    });
}


