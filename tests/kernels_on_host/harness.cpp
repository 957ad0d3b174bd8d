// The kernels' indexing on the host (tests/kernels_on_host.rs): every elementwise kernel
// against its one-value-at-a-time definition, in every storage (f32, f16, bf16), at lengths
// around the vector width and at unaligned addresses; the image and row kernels with
// half-width operands against the f32 kernel's result, rounded. Prints each failure; the exit
// status is the number of failures (at most 100).
#include "cuda_on_host.h"
#include "kernels.cu"

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

// What storage `s` holds of v.
static float stored(int s, float v) {
    Buffer one(s, 1);
    one.set(0, v);
    return one.get(0);
}

static bool same(float a, float b) { return memcmp(&a, &b, 4) == 0 || (a != a && b != b); }

static void expect(const char* what, int s, uint64_t n, const std::vector<float>& got,
                   const std::vector<float>& want) {
    for (uint64_t i = 0; i < n; i++) {
        if (!same(got[i], want[i])) {
            printf("%s (storage %d, n %llu): [%llu] is %.9g, expected %.9g\n", what, s, (unsigned long long)n,
                   (unsigned long long)i, got[i], want[i]);
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
        expect("activation_forward", ys, n, y.values(), want);
        launch(vec_threads(n), [&] { activation_backward(f, x.p(), xs, y.p(), ys, dy.p(), ys, dx.p(), xs, n); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, dy.get(i) * act_derivative(f, x.get(i), y.get(i)));
        expect("activation_backward", xs, n, dx.values(), want);
        for (int kind = 0; kind < 2; kind++) {
            Buffer z = x;
            launch(vec_threads(n), [&] { activation_in_place_rounding(f, kind, z.p(), xs, n); });
            for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, round_half(act(f, round_half(x.get(i), kind)), kind));
            expect("activation_in_place_rounding", xs, n, z.values(), want);
            launch(vec_threads(n),
                   [&] { activation_backward_rounding(f, kind, x.p(), xs, y.p(), ys, dy.p(), ys, dx.p(), xs, n); });
            for (uint64_t i = 0; i < n; i++) {
                float d = round_half(dy.get(i), kind) * act_derivative(f, x.get(i), y.get(i));
                want[i] = stored(xs, round_half(d, kind));
            }
            expect("activation_backward_rounding", xs, n, dx.values(), want);
        }
        Buffer in_place = x;
        launch(vec_threads(n), [&] { activation_in_place(f, in_place.p(), xs, n); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, act(f, x.get(i)));
        expect("activation_in_place", xs, n, in_place.values(), want);
    }
    Buffer sum = random_buffer(ys, n);
    std::vector<float> before = sum.values();
    launch(vec_threads(n), [&] { add_assign(x.p(), xs, sum.p(), ys, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, before[i] + x.get(i));
    expect("add_assign", ys, n, sum.values(), want);
    Buffer y(ys, n);
    launch(vec_threads(n), [&] { convert_values(x.p(), xs, y.p(), ys, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, x.get(i));
    expect("convert_values", ys, n, y.values(), want);
    const float p = 0.3f, keep = 1.0f / (1.0f - p);
    launch(vec_threads(n), [&] { dropout(p, 99, 5, x.p(), xs, y.p(), ys, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, rng_uniform(99, 5 + i) >= p ? x.get(i) * keep : 0.0f);
    expect("dropout", ys, n, y.values(), want);
    Buffer dropped = x;
    launch(vec_threads(n), [&] { dropout_in_place(p, 99, 5, dropped.p(), xs, n); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(xs, rng_uniform(99, 5 + i) >= p ? x.get(i) * keep : 0.0f);
    expect("dropout_in_place", xs, n, dropped.values(), want);
    launch(vec_threads(n), [&] { fill_values(y.p(), ys, n, 0.1f); });
    for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, 0.1f);
    expect("fill_values", ys, n, y.values(), want);
    const uint64_t width = 13;
    if (n % width == 0) {
        Buffer params = random_buffer(xs, 3 + width);
        launch(vec_threads(n), [&] { broadcast_rows(params.p(), xs, 3, n / width, width, y.p(), ys); });
        for (uint64_t i = 0; i < n; i++) want[i] = stored(ys, params.get(3 + i % width));
        expect("broadcast_rows", ys, n, y.values(), want);
    }
    if (xs == 0) {  // the f32-only ones
        Buffer r = random_buffer(0, n, misaligned, 1000.0f);
        std::vector<float> v = r.values();
        launch(vec_threads(n), [&] { round_to_half((float*)r.p(), n, ys % 2); });
        for (uint64_t i = 0; i < n; i++) want[i] = round_half(v[i], ys % 2);
        expect("round_to_half", 0, n, r.values(), want);
        launch(vec_threads(n), [&] { scale_f32((float*)r.p(), n, 0.37f); });
        for (uint64_t i = 0; i < n; i++) want[i] *= 0.37f;
        expect("scale_f32", 0, n, r.values(), want);
    }
}

// `run(storage, input)` fills an output buffer in that storage from the input: with half
// storages it must hold exactly the f32 run's values, rounded.
template <class Run>
static void half_gives_f32_rounded(const char* what, const std::vector<float>& input, Run run) {
    for (int s = 1; s <= 2; s++) {
        Buffer in32(0, input.size()), in16(s, input.size());
        for (size_t i = 0; i < input.size(); i++) in16.set(i, input[i]);
        for (size_t i = 0; i < input.size(); i++) in32.set(i, in16.get(i));
        std::vector<float> want = run(0, in32);
        for (float& v : want) v = stored(s, v);
        expect(what, s, want.size(), run(s, in16), want);
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
        Buffer col(0, ckk * cols), dx(s, g.n * g.c * g.h * g.w);
        for (uint64_t i = 0; i < col.n; i++) col.set(i, col_values[i]);
        launch(dx.n, [&] { col2im((const float*)col.p(), g, dx.p(), s); });
        return dx.values();
    });
    Buffer params = random_buffer(0, 20);
    std::vector<float> cn = random_values(g.o * cols);
    half_gives_f32_rounded("cn_to_nchw", {0.0f}, [&](int s, Buffer&) {
        Buffer src(0, cn.size()), y(s, cn.size());
        for (uint64_t i = 0; i < src.n; i++) src.set(i, cn[i]);
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
        half_gives_f32_rounded("pool2d_backward", random_values(in_len), [&](int s, Buffer& x) {
            Buffer y(s, out_len), dy(s, out_len), dx(s, in_len);
            for (uint64_t i = 0; i < out_len; i++) dy.set(i, exact(i));
            launch(out_len, [&] { pool2d_forward(kind, x.p(), s, pg, y.p(), s); });
            launch(in_len, [&] { pool2d_backward(kind, x.p(), s, y.p(), s, dy.p(), s, pg, dx.p(), s); });
            return dx.values();
        });
    }
    const uint64_t count = 40, dim = 12, vocab = 9;
    Buffer ids(0, count), table = random_buffer(0, vocab * dim);
    for (uint64_t i = 0; i < count; i++) ids.set(i, (float)(i * 7 % vocab));
    half_gives_f32_rounded("embedding_forward", {0.0f}, [&](int s, Buffer&) {
        Buffer y(s, count * dim);
        launch(y.n, [&] { embedding_forward((const float*)ids.p(), (const float*)table.p(), y.p(), s, count, dim); });
        return y.values();
    });
    const uint64_t rows = 37, n_rows = 11, row_len = 13;
    Buffer data = random_buffer(0, rows * row_len);
    std::vector<uint32_t> picked(n_rows);
    for (uint64_t r = 0; r < n_rows; r++) picked[r] = (uint32_t)(r * 5 % rows);
    half_gives_f32_rounded("gather_rows", {0.0f}, [&](int s, Buffer&) {
        Buffer dst(s, n_rows * row_len);
        launch(dst.n, [&] { gather_rows((const float*)data.p(), picked.data(), n_rows, row_len, dst.p(), s); });
        return dst.values();
    });
    half_gives_f32_rounded("copy_rows", random_values(7 * 20), [&](int s, Buffer& src) {
        Buffer dst(s, 7 * 30);
        for (uint64_t i = 0; i < dst.n; i++) dst.set(i, exact(i));
        launch(7 * 9, [&] { copy_rows(src.p(), s, 20, 3, dst.p(), s, 30, 11, 9, 7, 1); });
        return dst.values();
    });
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
    printf("%d failures\n", failures);
    return failures > 100 ? 100 : failures;
}
