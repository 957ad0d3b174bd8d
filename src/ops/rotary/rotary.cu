// Rotary position embedding over rows of [queries, keys, values] in heads of d values: first
// the `turned` heads of the queries and the keys, then kv_heads heads of values. Pair
// (i, i + d/2) of each turned head turns by (position + t) · θ^(−2i/d), t the row's place in
// its sample. `inverse` turns back (backward). The angle, its cosine and sine in f32 as the
// CPU's table (src/ops/rotary/cpu.rs). Each thread reads and writes its own pair, so y may
// be x.
__device__ __forceinline__ void turn_pairs(const void* x, int xs, void* y, int ys, u64 rows, u64 len, int turned,
                                           int kv_heads, int head_dim, float theta, u64 position, int inverse) {
    int half = head_dim / 2;
    u64 row_len = (u64)(turned + kv_heads) * head_dim, pairs = (u64)turned * half;
    GRID_STRIDE(p, rows * pairs) {
        u64 row = p / pairs, j = p % pairs;
        int head = (int)(j / half), i = (int)(j % half);
        float frequency = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
        float angle = (float)(position + row % len) * frequency;
        float c = cosf(angle), s = sinf(angle);
        u64 at = row * row_len + (u64)head * head_dim + i;
        float a = load(x, xs, at), b = load(x, xs, at + half);
        if (inverse) {
            store(y, ys, at, a * c + b * s);
            store(y, ys, at + half, b * c - a * s);
        } else {
            store(y, ys, at, a * c - b * s);
            store(y, ys, at + half, b * c + a * s);
        }
    }
}

// y = x turned (or turned back), the values copied.
extern "C" __global__ void rotary(const void* x, int xs, void* y, int ys, u64 rows, u64 len, int turned, int kv_heads,
                                  int head_dim, float theta, u64 position, int inverse) {
    turn_pairs(x, xs, y, ys, rows, len, turned, kv_heads, head_dim, theta, position, inverse);
    u64 values = (u64)kv_heads * head_dim, row_len = (u64)turned * head_dim + values;
    GRID_STRIDE(v, rows * values) {
        u64 at = v / values * row_len + (u64)turned * head_dim + v % values;
        store(y, ys, at, load(x, xs, at));
    }
}

extern "C" __global__ void rotary_in_place(void* y, int ys, u64 rows, u64 len, int turned, int kv_heads, int head_dim,
                                           float theta, u64 position) {
    turn_pairs(y, ys, y, ys, rows, len, turned, kv_heads, head_dim, theta, position, 0);
}
