// The kernels on the host (tests/suite/kernels_on_host.rs):
// - every elementwise kernel against its one-value-at-a-time definition, in every storage (f32,
//   f16, bf16), at lengths around the vector width and at unaligned addresses;
// - the image and row kernels with half-width operands against the f32 kernel's result, rounded;
// - the block-wide kernels (reductions, softmax, norms, losses) against their definitions in
//   double, in both thread orders (cuda_on_host.h), and in half storages against the f32
//   kernel's result.
// Prints each failure; the exit status is the number of failures (at most 100).
#include "cuda_on_host.h"
#include "kernels.cu"

#include <algorithm>
#include <random>
#include <vector>

static int failures = 0;
static std::mt19937 rng(7);

// `n` values in storage `s` (0 f32, 1 f16, 2 bf16), `misaligned` bytes past a 16-byte boundary.
struct Buffer {
    std::vector<unsigned char> bytes;
    int s;
    uint64_t n;
    size_t misaligned, start;
    Buffer(int s, uint64_t n, size_t misaligned = 0) : bytes(n * 4 + 32), s(s), n(n), misaligned(misaligned) {
        uintptr_t a = (uintptr_t)bytes.data();
        start = (16 - a % 16) % 16 + misaligned;
    }
    Buffer(const Buffer& other) : Buffer(other.s, other.n, other.misaligned) {
        memcpy(p(), other.bytes.data() + other.start, n * 4);
    }
    void* p() { return bytes.data() + start; }
    float get(uint64_t i) { return load(p(), s, i); }
    void set(uint64_t i, float v) { store(p(), s, i, v); }
    std::vector<float> values() {
        std::vector<float> v(n);
        for (uint64_t i = 0; i < n; i++) v[i] = get(i);
        return v;
    }
};

static Buffer random_buffer(int s, uint64_t n, size_t misaligned = 0, float scale = 2.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    Buffer b(s, n, misaligned);
    for (uint64_t i = 0; i < n; i++) b.set(i, d(rng));
    return b;
}

// `values` in storage `s` (rounded to it).
static Buffer buffer_of(int s, const std::vector<float>& values) {
    Buffer b(s, values.size());
    for (size_t i = 0; i < values.size(); i++) b.set(i, values[i]);
    return b;
}

// What storage `s` holds of v.
static float stored(int s, float v) {
    Buffer one(s, 1);
    one.set(0, v);
    return one.get(0);
}

template <class T>
static bool same(T a, T b) {
    return memcmp(&a, &b, sizeof(T)) == 0 || (a != a && b != b);
}

template <class T>
static void expect(const char* what, int s, const std::vector<T>& got, const std::vector<T>& want) {
    if (got.size() != want.size()) {
        printf("%s (storage %d): %zu values, expected %zu\n", what, s, got.size(), want.size());
        failures++;
        return;
    }
    for (size_t i = 0; i < got.size(); i++) {
        if (!same(got[i], want[i])) {
            printf("%s (storage %d, n %zu): [%zu] is %.17g, expected %.17g\n", what, s, want.size(), i,
                   (double)got[i], (double)want[i]);
            failures++;
            return;
        }
    }
}

// |got - want| <= tolerance * (1 + |want|) for every value: sums in another order than the
// definition's, and f32 exp/log, differ in the last bits.
template <class T>
static void expect_near(const char* what, const std::vector<T>& got, const std::vector<double>& want,
                        double tolerance) {
    if (got.size() != want.size()) {
        printf("%s: %zu values, expected %zu\n", what, got.size(), want.size());
        failures++;
        return;
    }
    for (size_t i = 0; i < got.size(); i++) {
        if (!(fabs((double)got[i] - want[i]) <= tolerance * (1.0 + fabs(want[i])))) {
            printf("%s (%s order): [%zu] is %.17g, expected %.17g\n", what,
                   host_gpu::reverse_order ? "reverse" : "index", i, (double)got[i], want[i]);
            failures++;
            return;
        }
    }
}

static uint64_t vec_threads(uint64_t n) { return (n + VEC - 1) / VEC; }

// Each map kernel: its output against the definition applied value by value.
static void elementwise(int xs, int ys, uint64_t n, size_t misaligned) {
    Buffer x = random_buffer(xs, n, misaligned), dy = random_buffer(ys, n);
    std::vector<float> want(n);
    for (int f = 0; f < 5; f++) {
        Buffer y(ys, n), dx(xs, n);
        launch(vec_threads(n), [&] { activation_forward(f, x.p(), xs, y.p(), ys, n); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, act(f, x.get(i)));
        expect("activation_forward", ys, y.values(), want);
        launch(vec_threads(n), [&] { activation_backward(f, x.p(), xs, y.p(), ys, dy.p(), ys, dx.p(), xs, n); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, dy.get(i) * act_derivative(f, x.get(i), y.get(i)));
        expect("activation_backward", xs, dx.values(), want);
        for (int kind = 0; kind < 2; kind++) {
            Buffer z = x;
            launch(vec_threads(n), [&] { activation_in_place_rounding(f, kind, z.p(), xs, n); });
            for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, round_half(act(f, round_half(x.get(i), kind)), kind));
            expect("activation_in_place_rounding", xs, z.values(), want);
            launch(vec_threads(n),
                   [&] { activation_backward_rounding(f, kind, x.p(), xs, y.p(), ys, dy.p(), ys, dx.p(), xs, n); });
            for (uint64_t i = 0; i < n; i++) {
                float d = round_half(dy.get(i), kind) * act_derivative(f, x.get(i), y.get(i));
                want[i] = stored(xs, round_half(d, kind));
            }
            expect("activation_backward_rounding", xs, dx.values(), want);
        }
        Buffer in_place = x;
        launch(vec_threads(n), [&] { activation_in_place(f, in_place.p(), xs, n); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, act(f, x.get(i)));
        expect("activation_in_place", xs, in_place.values(), want);
    }
    Buffer sum = random_buffer(ys, n);
    std::vector<float> before = sum.values();
    launch(vec_threads(n), [&] { add_assign(x.p(), xs, sum.p(), ys, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, before[i] + x.get(i));
    expect("add_assign", ys, sum.values(), want);
    Buffer y(ys, n);
    launch(vec_threads(n), [&] { convert_values(x.p(), xs, y.p(), ys, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, x.get(i));
    expect("convert_values", ys, y.values(), want);
    const float p = 0.3f, keep = 1.0f / (1.0f - p);
    launch(vec_threads(n), [&] { dropout(p, 99, 5, x.p(), xs, y.p(), ys, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, rng_uniform(99, 5 + i) >= p ? x.get(i) * keep : 0.0f);
    expect("dropout", ys, y.values(), want);
    Buffer dropped = x;
    launch(vec_threads(n), [&] { dropout_in_place(p, 99, 5, dropped.p(), xs, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, rng_uniform(99, 5 + i) >= p ? x.get(i) * keep : 0.0f);
    expect("dropout_in_place", xs, dropped.values(), want);
    launch(vec_threads(n), [&] { fill_values(y.p(), ys, n, 0.1f); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, 0.1f);
    expect("fill_values", ys, y.values(), want);
    const uint64_t width = 13;
    if (n % width == 0) {
        Buffer params = random_buffer(xs, 3 + width);
        launch(vec_threads(n), [&] { broadcast_rows(params.p(), xs, 3, n / width, width, y.p(), ys); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, params.get(3 + i % width));
        expect("broadcast_rows", ys, y.values(), want);
    }
    if (xs == 0) {  // the f32-only ones
        Buffer r = random_buffer(0, n, misaligned, 1000.0f);
        std::vector<float> v = r.values();
        launch(vec_threads(n), [&] { round_to_half((float*)r.p(), n, ys % 2); });
        for (uint64_t i = 0; i < n; i++) want[i] = round_half(v[i], ys % 2);
        expect("round_to_half", 0, r.values(), want);
        launch(vec_threads(n), [&] { scale_f32((float*)r.p(), n, 0.37f); });
        for (uint64_t i = 0; i < n; i++) want[i] *= 0.37f;
        expect("scale_f32", 0, r.values(), want);
    }
}

// What a run leaves: buffers in the run's storage, and those that are f32 or f64 whatever the
// activations' storage (parameter gradients, statistics, per-sample losses).
struct Outputs {
    std::vector<float> values;
    std::vector<double> wide;
    Outputs(std::vector<float> values, std::vector<double> wide = {}) : values(values), wide(wide) {}
};

// `run(storage, input)` fills output buffers in that storage from the input: with half
// storages they must hold exactly the f32 run's values, rounded, and the wide outputs the f32
// run's values.
template <class Run>
static void half_gives_f32_rounded(const char* what, const std::vector<float>& input, Run run) {
    for (int s = 1; s <= 2; s++) {
        Buffer in16 = buffer_of(s, input), in32 = buffer_of(0, in16.values());
        Outputs want = run(0, in32), got = run(s, in16);
        for (float& v : want.values) v = stored(s, v);
        expect(what, s, got.values, want.values);
        expect(what, s, got.wide, want.wide);
    }
}

static std::vector<float> random_values(uint64_t n) { return random_buffer(0, n).values(); }

// A value every storage holds exactly, for operands that are not the rounded input.
static float exact(uint64_t i) { return (float)((int)(i % 17) - 8) * 0.125f; }

static void image_and_row_kernels() {
    ConvGeom g = {3, 4, 9, 7, 6, 3, 2, 2, 1, 1, 0, 1, 2, 0, 0};
    g.oh = (g.h + 2 * g.ph - g.dh * (g.kh - 1) - 1) / g.sh + 1;
    g.ow = (g.w + 2 * g.pw - g.dw * (g.kw - 1) - 1) / g.sw + 1;
    uint64_t plane = g.oh * g.ow, cols = g.n * plane, ckk = g.c * g.kh * g.kw;
    half_gives_f32_rounded("im2col", random_values(g.n * g.c * g.h * g.w), [&](int s, Buffer& x) {
        Buffer col(s, ckk * cols);
        launch(ckk * cols, [&] { im2col(x.p(), s, g, col.p(), s); });
        return col.values();
    });
    std::vector<float> col_values = random_values(ckk * cols);
    half_gives_f32_rounded("col2im", {0.0f}, [&](int s, Buffer&) {
        Buffer col = buffer_of(0, col_values), dx(s, g.n * g.c * g.h * g.w);
        launch(dx.n, [&] { col2im((const float*)col.p(), g, dx.p(), s); });
        return dx.values();
    });
    Buffer params = random_buffer(0, 20);
    std::vector<float> cn = random_values(g.o * cols);
    half_gives_f32_rounded("cn_to_nchw", {0.0f}, [&](int s, Buffer&) {
        Buffer src = buffer_of(0, cn), y(s, cn.size());
        launch(y.n, [&] { cn_to_nchw((const float*)src.p(), params.p(), 0, 5, 1, g.n, g.o, plane, y.p(), s); });
        return y.values();
    });
    half_gives_f32_rounded("nchw_to_cn", random_values(g.n * g.o * plane), [&](int s, Buffer& dy) {
        Buffer dst(s, dy.n);
        launch(dy.n, [&] { nchw_to_cn(dy.p(), s, g.n, g.o, plane, dst.p(), s); });
        return dst.values();
    });
    for (int kind = 0; kind < 2; kind++) {
        PoolGeom pg = {2, 3, 7, 9, 3, 3, 2, 2, 1, 1, 0, 0};
        pg.oh = (pg.h + 2 * pg.ph - pg.kh) / pg.sh + 1;
        pg.ow = (pg.w + 2 * pg.pw - pg.kw) / pg.sw + 1;
        uint64_t in_len = pg.n * pg.c * pg.h * pg.w, out_len = pg.n * pg.c * pg.oh * pg.ow;
        half_gives_f32_rounded("pool2d_forward", random_values(in_len), [&](int s, Buffer& x) {
            Buffer y(s, out_len);
            launch(out_len, [&] { pool2d_forward(kind, x.p(), s, pg, y.p(), s); });
            return y.values();
        });
        for (int relu = 0; relu < 2; relu++) {
            half_gives_f32_rounded("pool2d_backward", random_values(in_len), [&](int s, Buffer& x) {
                Buffer y(s, out_len), dy(s, out_len), dx(s, in_len);
                for (uint64_t i = 0; i < out_len; i++) dy.set(i, exact(i));
                launch(out_len, [&] { pool2d_forward(kind, x.p(), s, pg, y.p(), s); });
                launch(in_len, [&] { pool2d_backward(kind, x.p(), s, y.p(), s, dy.p(), s, pg, relu, dx.p(), s); });
                return dx.values();
            });
        }
    }
    const uint64_t count = 40, dim = 12, vocab = 9;
    Buffer table = random_buffer(0, vocab * dim);
    std::vector<uint32_t> ids(count);
    for (uint64_t i = 0; i < count; i++) ids[i] = (uint32_t)(i * 7 % vocab);
    half_gives_f32_rounded("embedding_forward", {0.0f}, [&](int s, Buffer&) {
        Buffer y(s, count * dim);
        launch(y.n, [&] { embedding_forward(ids.data(), (const float*)table.p(), y.p(), s, count, dim); });
        return y.values();
    });
    const uint64_t rows = 37, n_rows = 11, row_len = 13;
    Buffer data = random_buffer(0, rows * row_len);
    std::vector<u64> picked(n_rows);
    for (uint64_t r = 0; r < n_rows; r++) picked[r] = r * 5 % rows;
    half_gives_f32_rounded("gather_rows", {0.0f}, [&](int s, Buffer&) {
        Buffer dst(s, n_rows * row_len);
        launch(dst.n, [&] { gather_rows((const float*)data.p(), picked.data(), n_rows, row_len, row_len, 0, dst.p(), s); });
        return dst.values();
    });
    // Token ids: gathered as ids (storage -1), and as class indices in any storage.
    std::vector<uint32_t> tokens(rows * row_len + 1);
    for (uint64_t i = 0; i < tokens.size(); i++) tokens[i] = (uint32_t)(i * 2654435761u % 50000);
    std::vector<uint32_t> gathered(n_rows * row_len), next(n_rows * row_len);
    for (uint64_t i = 0; i < next.size(); i++) next[i] = tokens[picked[i / row_len] * row_len + 1 + i % row_len];
    launch(gathered.size(), [&] { gather_ids(tokens.data(), picked.data(), n_rows, row_len, row_len, 1, gathered.data(), -1); });
    expect("gather_ids", -1, gathered, next);
    half_gives_f32_rounded("gather_ids", {0.0f}, [&](int s, Buffer&) {
        Buffer dst(s, n_rows * row_len);
        launch(dst.n, [&] { gather_ids(tokens.data(), picked.data(), n_rows, row_len, row_len, 1, dst.p(), s); });
        return dst.values();
    });
    half_gives_f32_rounded("copy_rows", random_values(7 * 20), [&](int s, Buffer& src) {
        Buffer dst(s, 7 * 30);
        for (uint64_t i = 0; i < dst.n; i++) dst.set(i, exact(i));
        launch(7 * 9, [&] { copy_rows(src.p(), s, 20, 3, dst.p(), s, 30, 11, 9, 7, 1); });
        return dst.values();
    });
}

// ---- Block-wide kernels: their threads wait for one another (__syncthreads, shuffles).

const Dim3 THREADS = {256, 1, 1};  // src/tensor/cuda: THREADS, per_item

// Random values every storage holds exactly (bf16's rounding, then f16's): operands other
// than the rounded input of a half_gives_f32_rounded run.
static std::vector<float> representable(uint64_t n) {
    std::vector<float> v = random_values(n);
    for (float& x : v) x = round_half(round_half(x, 1), 0);
    return v;
}

template <class T>
static std::vector<double> widened(const std::vector<T>& v) {
    return std::vector<double>(v.begin(), v.end());
}

template <class T>
static std::vector<T> joined(std::initializer_list<std::vector<T>> parts) {
    std::vector<T> all;
    for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
    return all;
}

static void softmax_kernels() {
    const uint64_t rows = 3;
    for (uint64_t width : {1, 7, 300, 1000}) {
        const uint64_t n = rows * width;
        for (int log_out = 0; log_out < 2; log_out++) {
            Buffer x = random_buffer(0, n), dy = random_buffer(0, n), y(0, n), dx(0, n);
            launch_blocks(rows, THREADS, [&] { softmax_forward(x.p(), 0, y.p(), 0, rows, width, log_out); });
            launch_blocks(rows, THREADS,
                          [&] { softmax_backward(y.p(), 0, dy.p(), 0, dx.p(), 0, rows, width, log_out); });
            std::vector<double> want_y(n), want_dx(n);
            for (uint64_t r = 0; r < rows; r++) {
                double m = -INFINITY, sum = 0.0, t = 0.0;
                for (uint64_t j = 0; j < width; j++) m = fmax(m, x.get(r * width + j));
                for (uint64_t j = 0; j < width; j++) sum += exp(x.get(r * width + j) - m);
                for (uint64_t j = 0; j < width; j++) {
                    double v = x.get(r * width + j) - m;
                    want_y[r * width + j] = log_out ? v - log(sum) : exp(v) / sum;
                    t += log_out ? dy.get(r * width + j) : dy.get(r * width + j) * y.get(r * width + j);
                }
                for (uint64_t j = 0; j < width; j++) {
                    double yj = y.get(r * width + j), dyj = dy.get(r * width + j);
                    want_dx[r * width + j] = log_out ? dyj - exp(yj) * t : yj * (dyj - t);
                }
            }
            expect_near("softmax_forward", y.values(), want_y, 1e-6);
            expect_near("softmax_backward", dx.values(), want_dx, 1e-5);
            half_gives_f32_rounded("softmax_forward", random_values(n), [&](int s, Buffer& x) {
                Buffer y(s, n);
                launch_blocks(rows, THREADS, [&] { softmax_forward(x.p(), s, y.p(), s, rows, width, log_out); });
                return y.values();
            });
            std::vector<float> dy_values = representable(n);
            half_gives_f32_rounded("softmax_backward", random_values(n), [&](int s, Buffer& y) {
                Buffer dy = buffer_of(s, dy_values), dx(s, n);
                launch_blocks(rows, THREADS,
                              [&] { softmax_backward(y.p(), s, dy.p(), s, dx.p(), s, rows, width, log_out); });
                return dx.values();
            });
        }
    }
}

static void layernorm_kernels() {
    const uint64_t rows = 4;
    const float eps = 1e-5f;
    for (uint64_t width : {5, 300}) {
        const uint64_t n = rows * width;
        Buffer gamma = random_buffer(0, width), beta = random_buffer(0, width);
        std::vector<float> dgamma0 = random_values(width), dbeta0 = random_values(width), dy_values = representable(n);
        // Forward, backward and the parameter gradients; wide: saved statistics, dgamma, dbeta.
        auto run = [&](int s, Buffer& x) {
            Buffer y(s, n), dy = buffer_of(s, dy_values), dx(s, n), saved(0, 2 * rows);
            Buffer dgamma = buffer_of(0, dgamma0), dbeta = buffer_of(0, dbeta0);
            float *sv = (float*)saved.p(), *g = (float*)gamma.p(), *b = (float*)beta.p();
            launch_blocks(rows, THREADS, [&] { layernorm_forward(x.p(), s, y.p(), s, rows, width, g, b, 1, sv, eps); });
            launch_blocks(rows, THREADS,
                          [&] { layernorm_backward(x.p(), s, dy.p(), s, dx.p(), s, rows, width, g, sv); });
            launch(width, [&] {
                layernorm_param_grads(x.p(), s, dy.p(), s, rows, width, sv, (float*)dgamma.p(), (float*)dbeta.p(), 1);
            });
            return Outputs(joined({y.values(), dx.values()}),
                           joined({widened(saved.values()), widened(dgamma.values()), widened(dbeta.values())}));
        };
        Buffer x = random_buffer(0, n);
        Outputs got = run(0, x);
        std::vector<double> want_y(n), want_dx(n), want_saved(2 * rows), want_dgamma(width), want_dbeta(width);
        for (uint64_t j = 0; j < width; j++) want_dgamma[j] = dgamma0[j], want_dbeta[j] = dbeta0[j];
        for (uint64_t r = 0; r < rows; r++) {
            double mu = 0.0, var = 0.0, sum_g = 0.0, sum_g_xhat = 0.0;
            for (uint64_t j = 0; j < width; j++) mu += x.get(r * width + j) / (double)width;
            for (uint64_t j = 0; j < width; j++) var += pow(x.get(r * width + j) - mu, 2) / (double)width;
            double is = 1.0 / sqrt(var + eps);
            want_saved[r] = mu, want_saved[rows + r] = is;
            for (uint64_t j = 0; j < width; j++) {
                double xhat = (x.get(r * width + j) - mu) * is, d = dy_values[r * width + j];
                want_y[r * width + j] = xhat * gamma.get(j) + beta.get(j);
                sum_g += d * gamma.get(j);
                sum_g_xhat += d * gamma.get(j) * xhat;
                want_dgamma[j] += d * xhat;
                want_dbeta[j] += d;
            }
            for (uint64_t j = 0; j < width; j++) {
                double xhat = (x.get(r * width + j) - mu) * is, g = dy_values[r * width + j] * gamma.get(j);
                want_dx[r * width + j] = is * (g - sum_g / width - xhat * sum_g_xhat / width);
            }
        }
        expect_near("layernorm_forward, then layernorm_backward", got.values, joined({want_y, want_dx}), 1e-5);
        expect_near("layernorm statistics, dgamma, dbeta", got.wide, joined({want_saved, want_dgamma, want_dbeta}),
                    1e-4);
        half_gives_f32_rounded("layernorm", random_values(n), run);
    }
}

// state = [running_mean | running_var | mean | invstd] (kernels/spatial.cu). Three passes:
// evaluation (forward with the running statistics), and training with and without dx (the
// first layer's input needs none; dgamma and dbeta are summed either way).
static void batchnorm_kernels() {
    const uint64_t n = 3, c = 4;
    const float momentum = 0.1f, eps = 1e-5f;
    for (uint64_t spatial : {5, 100}) {
        const uint64_t len = n * c * spatial, m = n * spatial;
        Buffer gamma = random_buffer(0, c), beta = random_buffer(0, c);
        std::vector<float> state0 = random_values(4 * c), grads0 = random_values(2 * c), dy_values = representable(len);
        for (uint64_t ch = 0; ch < c; ch++) state0[c + ch] = 1.0f + fabsf(state0[c + ch]);  // a variance
        for (int pass = 0; pass < 3; pass++) {
            const int train = pass > 0, write_dx = pass == 1;
            // values: y, dx (the dy values where it is not written); wide: state, dgamma, dbeta.
            auto run = [&](int s, Buffer& x) {
                Buffer y(s, len), dy = buffer_of(s, dy_values), dx = buffer_of(s, dy_values);
                Buffer state = buffer_of(0, state0), grads = buffer_of(0, grads0);
                float *st = (float*)state.p(), *g = (float*)gamma.p(), *b = (float*)beta.p(), *dg = (float*)grads.p();
                launch_blocks(c, THREADS, [&] {
                    batchnorm_forward(x.p(), s, y.p(), s, n, c, spatial, g, b, st, train, momentum, eps);
                });
                if (train)
                    launch_blocks(c, THREADS, [&] {
                        batchnorm_backward(x.p(), s, dy.p(), s, dx.p(), s, write_dx, n, c, spatial, g, st, dg, dg + c);
                    });
                return Outputs(joined({y.values(), dx.values()}), joined({widened(state.values()),
                                                                          widened(grads.values())}));
            };
            Buffer x = random_buffer(0, len);
            Outputs got = run(0, x);
            std::vector<double> want_y(len), want_dx = widened(dy_values), state = widened(state0),
                                             grads = widened(grads0);
            for (uint64_t ch = 0; ch < c; ch++) {
                auto at = [&](uint64_t k) { return ((k / spatial) * c + ch) * spatial + k % spatial; };
                double mu = 0.0, var = 0.0;
                for (uint64_t k = 0; k < m; k++) mu += x.get(at(k)) / (double)m;
                for (uint64_t k = 0; k < m; k++) var += pow(x.get(at(k)) - mu, 2) / (double)m;
                if (train) {
                    state[ch] = (1 - momentum) * state[ch] + momentum * mu;
                    state[c + ch] = (1 - momentum) * state[c + ch] + momentum * var * m / (m - 1);
                } else {
                    mu = state0[ch], var = state0[c + ch];
                }
                double is = 1.0 / sqrt(var + eps), sum_dy = 0.0, sum_dy_xhat = 0.0;
                state[2 * c + ch] = mu, state[3 * c + ch] = is;
                for (uint64_t k = 0; k < m; k++) {
                    double xhat = (x.get(at(k)) - mu) * is, d = dy_values[at(k)];
                    want_y[at(k)] = xhat * gamma.get(ch) + beta.get(ch);
                    sum_dy += d;
                    sum_dy_xhat += d * xhat;
                }
                if (!train) continue;
                grads[ch] += sum_dy_xhat, grads[c + ch] += sum_dy;
                for (uint64_t k = 0; k < m && write_dx; k++) {
                    double xhat = (x.get(at(k)) - mu) * is;
                    want_dx[at(k)] = gamma.get(ch) * is * (dy_values[at(k)] - sum_dy / m - xhat * sum_dy_xhat / m);
                }
            }
            expect_near("batchnorm_forward, then batchnorm_backward", got.values, joined({want_y, want_dx}), 1e-5);
            expect_near("batchnorm state, dgamma, dbeta", got.wide, joined({state, grads}), 1e-4);
            half_gives_f32_rounded("batchnorm", random_values(len), run);
        }
    }
}

// Parameter gradients: bias_grad (linear) in its exact order, row_sums_add (conv), the
// embedding's.
static void parameter_gradient_kernels() {
    // add = 0 (a step's first backward pass) must not read db: it starts as NaN.
    for (int add : {1, 0})
    for (uint64_t width : {1, 40, 70})
        for (uint64_t rows : {1, 33, 100}) {
            std::vector<float> db0 = add ? random_values(width) : std::vector<float>(width, NAN);
            auto run = [&](int s, Buffer& dy) {
                Buffer db = buffer_of(0, db0);
                launch_blocks((width + 31) / 32, {32, 32, 1},
                              [&] { bias_grad(dy.p(), s, rows, width, (float*)db.p(), add); });
                return Outputs({}, widened(db.values()));
            };
            Buffer dy = random_buffer(0, rows * width);
            std::vector<double> want(width);
            for (uint64_t j = 0; j < width; j++) {
                float partial[32] = {}, total = 0.0f;
                for (uint64_t r = 0; r < rows; r++) partial[r % 32] += dy.get(r * width + j);
                for (float p : partial) total += p;
                want[j] = add ? db0[j] + total : total;
            }
            expect("bias_grad", 0, run(0, dy).wide, want);
            half_gives_f32_rounded("bias_grad", random_values(rows * width), run);
        }
    // A block per row, and (as with more than 65,535 output channels) fewer blocks than rows.
    for (int add : {1, 0})
    for (uint64_t cols : {3, 600})
        for (unsigned blocks : {5, 2}) {
            const uint64_t rows = 5;
            std::vector<float> db0 = add ? random_values(rows) : std::vector<float>(rows, NAN);
            auto run = [&](int s, Buffer& src) {
                Buffer db = buffer_of(0, db0);
                launch_blocks(blocks, THREADS,
                              [&] { row_sums_add(src.p(), s, rows, cols, (float*)db.p(), add); });
                return Outputs({}, widened(db.values()));
            };
            Buffer src = random_buffer(0, rows * cols);
            std::vector<double> want(rows);
            for (uint64_t r = 0; r < rows; r++) {
                double sum = 0.0;
                for (uint64_t j = 0; j < cols; j++) sum += src.get(r * cols + j);
                want[r] = add ? db0[r] + (float)sum : (float)sum;
            }
            expect_near("row_sums_add", run(0, src).wide, want, 1e-6);
            half_gives_f32_rounded("row_sums_add", random_values(rows * cols), run);
        }
    const uint64_t count = 50, dim = 7, vocab = 6;
    std::vector<uint32_t> ids(count);
    for (uint64_t p = 0; p < count; p++) ids[p] = (uint32_t)(p * p % vocab);
    std::vector<float> dw0 = random_values(vocab * dim);
    auto run = [&](int s, Buffer& dy) {
        Buffer dw = buffer_of(0, dw0);
        launch(dim, [&] { embedding_backward(ids.data(), dy.p(), s, (float*)dw.p(), count, dim); });
        return Outputs({}, widened(dw.values()));
    };
    Buffer dy = random_buffer(0, count * dim);
    std::vector<double> want = widened(dw0);
    for (uint64_t j = 0; j < dim; j++) {
        std::vector<float> sums(dw0);
        for (uint64_t p = 0; p < count; p++) sums[ids[p] * dim + j] += dy.get(p * dim + j);
        for (uint64_t v = 0; v < vocab; v++) want[v * dim + j] = sums[v * dim + j];
    }
    expect("embedding_backward", 0, run(0, dy).wide, want);
    half_gives_f32_rounded("embedding_backward", random_values(count * dim), run);
}

// The losses (a warp per row for cross-entropy) and the sums of their per-sample statistics.
static void loss_kernels() {
    const float grad_scale = 0.75f;
    for (uint64_t rows : {1, 9, 20})
        for (uint64_t classes : {3, 10, 40})
            for (float smoothing : {0.0f, 0.1f}) {
                const uint64_t n = rows * classes;
                std::vector<float> logits = random_values(n);
                Buffer labels(0, rows);
                for (uint64_t r = 0; r < rows; r++) labels.set(r, (float)(r * 7 % classes));
                if (rows > 1 && classes > 5) {  // equal maxima: the lowest index is the prediction
                    logits[2] = logits[5] = 100.0f, labels.set(0, 5.0f);
                    logits[classes + 1] = logits[classes + 4] = 100.0f, labels.set(1, 1.0f);
                }
                for (int write_grad = 0; write_grad < 2; write_grad++) {
                    auto run = [&](int s, Buffer& x) {
                        Buffer dout = buffer_of(s, std::vector<float>(n, 7.0f));
                        std::vector<double> row_stats(2 * rows + 1);
                        launch_blocks((rows + 7) / 8, THREADS, [&] {
                            cross_entropy(x.p(), s, (const float*)labels.p(), rows, classes, smoothing, grad_scale,
                                          write_grad, dout.p(), s, row_stats.data(), 0, 0.0f);
                        });
                        row_stats.pop_back();  // the rows scored: not written without an ignored class
                        return Outputs(dout.values(), row_stats);
                    };
                    Buffer x = buffer_of(0, logits);
                    Outputs got = run(0, x);
                    std::vector<double> want_grad(n, 7.0), want_stats(2 * rows);
                    for (uint64_t r = 0; r < rows; r++) {
                        const float* row = &logits[r * classes];
                        uint64_t label = (uint64_t)labels.get(r), arg = 0;
                        double sum_exp = 0.0, sum_x = 0.0;
                        for (uint64_t j = 0; j < classes; j++) arg = row[j] > row[arg] ? j : arg;
                        for (uint64_t j = 0; j < classes; j++) sum_exp += exp((double)row[j] - row[arg]), sum_x += row[j];
                        double lse = (double)row[arg] + log(sum_exp), nll = lse - row[label];
                        want_stats[r] = (1.0 - smoothing) * nll + smoothing * (lse - sum_x / classes);
                        want_stats[rows + r] = arg == label;
                        for (uint64_t j = 0; j < classes && write_grad; j++) {
                            double target = (double)smoothing / classes + (j == label ? 1.0 - smoothing : 0.0);
                            want_grad[r * classes + j] = (exp((double)row[j] - lse) - target) * grad_scale / rows;
                        }
                    }
                    expect_near("cross_entropy gradient", got.values, want_grad, 1e-6);
                    expect_near("cross_entropy losses and hits", got.wide, want_stats, 1e-12);
                    half_gives_f32_rounded("cross_entropy", logits, run);
                }
            }
    for (int kind = 0; kind < 2; kind++)
        for (uint64_t dim : {1, 3}) {
            const uint64_t rows = 300, n = rows * dim;
            Buffer targets(0, n);
            std::uniform_real_distribution<float> unit(0.0f, 1.0f);
            for (uint64_t i = 0; i < n; i++) targets.set(i, kind == 0 ? 3.0f * unit(rng) - 1.5f : unit(rng));
            auto run = [&](int s, Buffer& out) {
                Buffer dout(s, n);
                std::vector<double> row_stats(2 * rows);
                launch_blocks((rows + 255) / 256, THREADS, [&] {
                    elementwise_loss(kind, out.p(), s, (const float*)targets.p(), rows, dim, grad_scale, 1,
                                     dout.p(), s, row_stats.data());
                });
                return Outputs(dout.values(), row_stats);
            };
            Buffer out = random_buffer(0, n);
            Outputs got = run(0, out);
            std::vector<double> want_grad(n), want_stats(2 * rows);
            for (uint64_t r = 0; r < rows; r++)
                for (uint64_t j = 0; j < dim; j++) {
                    uint64_t i = r * dim + j;
                    double x = out.get(i), t = targets.get(i), g = grad_scale / (double)rows / dim;
                    if (kind == 0) {
                        want_stats[r] += (x - t) * (x - t) / dim;
                        want_grad[i] = 2.0 * (x - t) * g;
                    } else {
                        want_stats[r] += (fmax(x, 0.0) - x * t + log1p(exp(-fabs(x)))) / dim;
                        want_stats[rows + r] += ((x > 0) == (t >= 0.5)) / (double)dim;
                        want_grad[i] = (1.0 / (1.0 + exp(-x)) - t) * g;
                    }
                }
            expect_near(kind == 0 ? "mse gradient" : "bce gradient", got.values, want_grad, 1e-6);
            expect_near(kind == 0 ? "mse losses" : "bce losses and hits", got.wide, want_stats, 1e-6);
            half_gives_f32_rounded("elementwise_loss", random_values(n), run);
        }
    const uint64_t samples = 3000;
    std::vector<double> row_stats = widened(random_values(2 * samples)), stats = {1.0, 2.0, 3.0};
    std::vector<double> want = stats;
    for (uint64_t i = 0; i < samples; i++) want[0] += row_stats[i], want[1] += row_stats[samples + i];
    want[2] += samples;
    launch_blocks(1, {1024, 1, 1}, [&] { reduce_stats(row_stats.data(), samples, 0, stats.data()); });
    expect_near("reduce_stats", stats, want, 1e-12);
}

// The gradient norm's two passes: a partial sum a block, then one block adds them.
static void norm_kernels() {
    const unsigned norm_blocks = 16;  // 1 to NORM_BLOCKS (1024) in src/tensor/cuda, by length
    for (uint64_t n : {1, 3000, 10000}) {
        Buffer g = random_buffer(0, n);
        std::vector<double> partials(norm_blocks), sum(1);
        launch_blocks(norm_blocks, THREADS, [&] { sum_squares_partial((const float*)g.p(), n, partials.data()); });
        launch_blocks(1, {1024, 1, 1}, [&] { sum_partials(partials.data(), norm_blocks, sum.data()); });
        double want = 0.0;
        for (uint64_t i = 0; i < n; i++) want += (double)g.get(i) * g.get(i);
        expect_near("sum_squares_partial + sum_partials", sum, {want}, 1e-12);
    }
}

// An optimizer update's half copy (storage s, or none for 0) holds its parameters rounded.
static void expect_half_copy(const char* what, int s, Buffer& copy, Buffer& p) {
    if (s == 0) return;
    std::vector<float> want = p.values();
    for (float& v : want) v = stored(s, v);
    expect(what, s, copy.values(), want);
}

// The optimizer updates (grid-stride, f32) against PyTorch's formulas in double, with no half
// copy of the parameters and with one in f16 and bf16.
static void optimizer_kernels() {
    const uint64_t n = 1000;
    std::vector<float> p0 = random_values(n), g0 = random_values(n), buf0 = random_values(n),
                       v0 = random_values(n);
    for (float& v : v0) v = fabsf(v);  // a second moment
    for (int first_step = 0; first_step < 2; first_step++)
        for (int nesterov = 0; nesterov < 2; nesterov++) {
            const float momentum = 0.9f, dampening = nesterov ? 0.0f : 0.1f, weight_decay = 0.01f;
            const float args[2] = {0.05f, (float)first_step};
            const int half_s = (first_step + 2 * nesterov) % 3;
            Buffer p = buffer_of(0, p0), g = buffer_of(0, g0), buf = buffer_of(0, buf0), copy = buffer_of(half_s, g0);
            launch(n, [&] {
                sgd_step((float*)p.p(), (const float*)g.p(), (float*)buf.p(), n, momentum, dampening, nesterov,
                         weight_decay, args, half_s ? copy.p() : nullptr, half_s, nullptr, 0);
            });
            expect_half_copy("sgd_step half copy", half_s, copy, p);
            std::vector<double> want_p(n), want_buf(n);
            for (uint64_t i = 0; i < n; i++) {
                double d = g0[i] + (double)weight_decay * p0[i];
                want_buf[i] = first_step ? d : (double)momentum * buf0[i] + (1.0 - dampening) * d;
                d = nesterov ? d + momentum * want_buf[i] : want_buf[i];
                want_p[i] = p0[i] - (double)args[0] * d;
            }
            expect_near("sgd_step parameters, then momentum", joined({p.values(), buf.values()}),
                        joined({want_p, want_buf}), 1e-6);
        }
    for (int adamw = 0; adamw < 2; adamw++)
        for (int half_s = 0; half_s < 3; half_s++) {
            const float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, lr = 1e-3f, wd = 0.01f, step = 3;
            const double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
            const float args[3] = {adamw ? 1.0f - lr * wd : 1.0f, (float)(lr / bc1), (float)sqrt(bc2)};
            Buffer p = buffer_of(0, p0), g = buffer_of(0, g0), m = buffer_of(0, buf0), v = buffer_of(0, v0),
                   copy = buffer_of(half_s, g0);
            launch(n, [&] {
                adam_step((float*)p.p(), (const float*)g.p(), (float*)m.p(), (float*)v.p(), n, beta1, beta2, eps,
                          adamw ? 0.0f : wd, args, half_s ? copy.p() : nullptr, half_s, nullptr, 0);
            });
            expect_half_copy("adam_step half copy", half_s, copy, p);
            std::vector<double> want_p(n), want_m(n), want_v(n);
            for (uint64_t i = 0; i < n; i++) {
                double grad = g0[i] + (adamw ? 0.0 : (double)wd * p0[i]);
                want_m[i] = beta1 * (double)buf0[i] + (1.0 - beta1) * grad;
                want_v[i] = beta2 * (double)v0[i] + (1.0 - beta2) * grad * grad;
                double decayed = adamw ? p0[i] * (1.0 - (double)lr * wd) : p0[i];
                want_p[i] = decayed - lr / bc1 * want_m[i] / (sqrt(want_v[i]) / sqrt(bc2) + eps);
            }
            expect_near("adam_step parameters, m, v", joined({p.values(), m.values(), v.values()}),
                        joined({want_p, want_m, want_v}), 1e-5);
        }
    for (double max_norm : {1.0, 1e6}) {  // clipped, and left alone
        Buffer g = buffer_of(0, g0);
        double sum_sq = 0.0;
        for (float x : g0) sum_sq += (double)x * x;
        launch(n, [&] { clip_by_norm((float*)g.p(), n, &sum_sq, max_norm); });
        double coef = std::min(1.0, max_norm / (sqrt(sum_sq) + 1e-6));
        std::vector<double> want(n);
        for (uint64_t i = 0; i < n; i++) want[i] = g0[i] * coef;
        expect_near("clip_by_norm", g.values(), want, 1e-6);
    }
}

static void block_kernels() {
    softmax_kernels();
    layernorm_kernels();
    batchnorm_kernels();
    parameter_gradient_kernels();
    loss_kernels();
    norm_kernels();
}

int main() {
    const uint64_t lengths[] = {0, 1, 7, 8, 9, 17, 1000, 10007};
    for (uint64_t n : lengths)
        for (int xs = 0; xs < 3; xs++)
            for (int ys = 0; ys < 3; ys++) {
                elementwise(xs, ys, n, 0);
                elementwise(xs, ys, n, xs == 0 ? 4 : 2);  // not 16-byte aligned: one value at a time
            }
    image_and_row_kernels();
    optimizer_kernels();
    for (int order = 0; order < 2; order++) {
        host_gpu::reverse_order = order == 1;
        block_kernels();
    }
    failures += host_gpu::barrier_failures;
    printf("%d failures\n", failures);
    return failures > 100 ? 100 : failures;
}
