// Rotary position embedding over rows of [queries, keys, values] in heads of d values: first
// the `turned` heads of the queries and the keys, then kv_heads heads of values. Pair
// (i, i + d/2) of each turned head turns by (position + t) · θ^(−2i/d), t the row's place in
// its sample. `inverse` turns back (backward). The angle, its cosine and sine in f32 as the
// CPU's table (src/ops/rotary/cpu.rs). Each thread reads and writes its own pair, so y may
// be x. `s` is Llama 3.1's stretch of the frequencies (Llama3Scaling in mod.rs); factor 0 for
// none.
struct Stretch {
    float factor, low_freq_factor, high_freq_factor, original_context;
};

// Llama3Scaling::stretch, in its order of operations.
__device__ __forceinline__ float stretched(float f, Stretch s) {
    if (s.factor == 0.0f) return f;
    float low_wavelen = s.original_context / s.low_freq_factor;
    float high_wavelen = s.original_context / s.high_freq_factor;
    float wavelen = (float)(2.0 * 3.14159265358979323846) / f;
    float divided = wavelen > low_wavelen ? f / s.factor : f;
    float smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    return medium ? (1.0f - smooth) * divided / s.factor + smooth * divided : divided;
}

__device__ __forceinline__ void turn_pairs(const void* x, int xs, void* y, int ys, u64 rows, u64 len, int turned,
                                           int kv_heads, int head_dim, float theta, Stretch st, u64 position,
                                           int inverse) {
    int half = head_dim / 2;
    u64 row_len = (u64)(turned + kv_heads) * head_dim, pairs = (u64)turned * half;
    GRID_STRIDE(p, rows * pairs) {
        u64 row = p / pairs, j = p % pairs;
        int head = (int)(j / half), i = (int)(j % half);
        float frequency = stretched(1.0f / powf(theta, (float)(2 * i) / (float)head_dim), st);
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
                                  int head_dim, float theta, float factor, float low_freq_factor,
                                  float high_freq_factor, float original_context, u64 position, int inverse) {
    Stretch st = {factor, low_freq_factor, high_freq_factor, original_context};
    turn_pairs(x, xs, y, ys, rows, len, turned, kv_heads, head_dim, theta, st, position, inverse);
    u64 values = (u64)kv_heads * head_dim, row_len = (u64)turned * head_dim + values;
    GRID_STRIDE(v, rows * values) {
        u64 at = v / values * row_len + (u64)turned * head_dim + v % values;
        store(y, ys, at, load(x, xs, at));
    }
}

extern "C" __global__ void rotary_in_place(void* y, int ys, u64 rows, u64 len, int turned, int kv_heads, int head_dim,
                                           float theta, float factor, float low_freq_factor, float high_freq_factor,
                                           float original_context, u64 position) {
    Stretch st = {factor, low_freq_factor, high_freq_factor, original_context};
    turn_pairs(y, ys, y, ys, rows, len, turned, kv_heads, head_dim, theta, st, position, 0);
}
